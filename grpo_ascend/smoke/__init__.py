"""``grpo-ascend smoke``: a few minutes of checks on a node, one JSON + markdown report to attach to a bug report.

``cli`` runs the checks of its registry in order within a time budget; each check is one module
(``rollout_check``, ``training_check``, ``vllm_check``, ``ddp_check``) returning a
:class:`~grpo_ascend.smoke.report.CheckResult`; ``report`` writes the report. docs/ascend.md says what each
line means when it fails.
"""
