"""Run tracking: metrics and samples files, the ``report_to`` trackers, per-phase time and memory, plots."""
