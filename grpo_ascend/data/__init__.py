"""Prompt data: loading and checking prompt datasets, resumable sampling, and the built-in synthetic task."""
