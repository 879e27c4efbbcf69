"""Evaluation metrics: mean reward (sampled and greedy), pass@k, mean@k and completion length.

Each rank scores its slice of the eval prompts and turns it into *sums* (:func:`eval_sums`);
the trainer adds the sums over ranks with one collective and :func:`finish_eval_metrics` divides
them, so the result does not depend on how the prompts were split.

Definitions (n = completions sampled per prompt, c = how many of them pass, k ≤ n):

- a completion *passes* when its reward is ``>= eval_pass_threshold`` (per reward function, and
  for the weighted total); a missing (None/NaN) reward never passes;
- ``pass@k`` = mean over prompts of ``1 - C(n - c, k) / C(n, k)``: the unbiased estimate of the
  chance that at least one of k completions drawn without replacement passes (Chen et al. 2021);
- ``mean@k`` = mean over prompts of the pass rate of the prompt's first k completions (the
  average accuracy of k samples, as eval harnesses report avg@k).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.errors import ConfigError

#: Tool-call counts of a multi-turn batch (experience.tool_counts) summed over the sampled eval pass.
TOOL_SUMS = ("tools/calls", "tools/turns", "tools/failed_calls", "tools/completions")


def check_eval_config(cfg: Any) -> None:
    """Refuse evaluation settings that cannot work, naming the value and the fix."""
    for name in ("eval_steps", "num_generations_eval", "per_device_eval_batch_size"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1 (or null for the default), got {value}")
    if cfg.eval_temperature is not None and cfg.eval_temperature < 0:
        raise ConfigError(f"eval_temperature must be >= 0 (0 = greedy), got {cfg.eval_temperature}")
    if cfg.load_best_model_at_end and cfg.eval_strategy == "no":
        raise ConfigError("load_best_model_at_end needs evaluations to pick the best: set eval_strategy: steps")
    every = resolved_eval_steps(cfg)
    if (cfg.load_best_model_at_end or cfg.metric_for_best_model) and cfg.eval_strategy == "steps" \
            and cfg.save_steps and cfg.save_steps % every:
        raise ConfigError(
            f"save_steps ({cfg.save_steps}) must be a multiple of eval_steps ({every}) so every checkpoint is "
            "evaluated and the best one is a saved checkpoint; change one of them"
        )


def resolved_eval_steps(cfg: Any) -> int:
    """Optimizer steps between evaluations: ``eval_steps``, else ``save_steps``, else ``logging_steps``."""
    if cfg.eval_steps is not None:
        return int(cfg.eval_steps)
    return int(cfg.save_steps or cfg.logging_steps)


def eval_ks(n: int) -> list[int]:
    """The k of pass@k/mean@k reported for n samples per prompt: 1, 2, 4, … up to n, and n itself."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    if ks[-1] != n:
        ks.append(n)
    return ks


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` passing completions out of ``n``."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _reward_sums(prefix: str, total: Tensor, per_function: Tensor, names: list[str], lengths: Tensor) -> dict[str, float]:
    out = {
        f"{prefix}rows": float(total.numel()),
        f"{prefix}reward_sum": float(total.double().sum()),  # double: the same sum however rows are split
        f"{prefix}reward_sq_sum": float((total.double() ** 2).sum()),
        f"{prefix}length_sum": float(lengths.float().sum()),
    }
    for i, name in enumerate(names):
        column = per_function[:, i] if per_function.numel() else per_function.new_zeros(0)
        valid = ~torch.isnan(column)
        out[f"{prefix}fn/{name}/sum"] = float(column[valid].double().sum())
        out[f"{prefix}fn/{name}/n"] = float(valid.sum())
    return out


def _pass_sums(scores: Tensor, n: int, threshold: float, suffix: str) -> dict[str, float]:
    """Sums over prompts of pass@k and mean@k for one score column laid out as groups of n."""
    passed = (scores >= threshold).reshape(-1, n)  # NaN >= t is False: a missing reward never passes
    counts = passed.sum(1).tolist()
    out = {}
    for k in eval_ks(n):
        out[f"pass@{k}{suffix}"] = sum(pass_at_k(n, int(c), k) for c in counts)
        out[f"mean@{k}{suffix}"] = float(passed[:, :k].float().mean(1).sum()) if counts else 0.0
    return out


def eval_sums(sampled: dict[str, Any], greedy: dict[str, Any], names: list[str], n: int,
              threshold: float) -> dict[str, float]:
    """This rank's additive evaluation statistics.

    ``sampled``/``greedy``: ``total`` [rows], ``per_function`` [rows, F], ``lengths`` [rows]
    (sampled rows are groups of ``n`` per prompt; greedy has one row per prompt).
    """
    out = {"prompts": float(greedy["total"].numel())}
    out.update(_reward_sums("sampled/", sampled["total"], sampled["per_function"], names, sampled["lengths"]))
    out.update(_reward_sums("greedy/", greedy["total"], greedy["per_function"], names, greedy["lengths"]))
    out.update({f"sampled/{k}": v for k, v in _pass_sums(sampled["total"], n, threshold, "").items()})
    out["greedy/pass_sum"] = float((greedy["total"] >= threshold).sum())
    for i, name in enumerate(names):
        column = sampled["per_function"][:, i] if sampled["per_function"].numel() else sampled["total"]
        out.update({f"sampled/{k}": v for k, v in _pass_sums(column, n, threshold, f"/{name}").items()})
    return out


def finish_eval_metrics(sums: dict[str, float], names: list[str], n: int) -> dict[str, float]:
    """The reported metrics (without the ``eval/`` prefix) from sums added over every rank."""
    prompts = max(sums["prompts"], 1.0)
    metrics: dict[str, float] = {"num_prompts": sums["prompts"], "num_generations": float(n)}
    for mode, label in (("sampled/", ""), ("greedy/", "greedy/")):
        rows = max(sums[f"{mode}rows"], 1.0)
        mean = sums[f"{mode}reward_sum"] / rows
        metrics[f"{label}reward"] = mean
        if mode == "sampled/":
            var = max(sums[f"{mode}reward_sq_sum"] / rows - mean**2, 0.0)
            metrics["reward_std"] = math.sqrt(var * rows / max(rows - 1, 1.0))
        metrics[f"{label}completion_length/mean"] = sums[f"{mode}length_sum"] / rows
        for name in names:
            valid = sums[f"{mode}fn/{name}/n"]
            metrics[f"{label}rewards/{name}/mean"] = sums[f"{mode}fn/{name}/sum"] / valid if valid else float("nan")
    metrics["greedy/pass"] = sums["greedy/pass_sum"] / prompts
    if "sampled/tools/completions" in sums:  # tool-calling runs: the sampled pass's calls
        calls = sums["sampled/tools/calls"]
        metrics["tools/calls_per_completion"] = calls / max(sums["sampled/tools/completions"], 1.0)
        metrics["tools/turns_per_completion"] = sums["sampled/tools/turns"] / max(sums["sampled/tools/completions"], 1.0)
        metrics["tools/failed_calls"] = sums["sampled/tools/failed_calls"]
        metrics["tools/call_frequency"] = metrics["tools/calls_per_completion"]  # TRL 1.16's name
        metrics["tools/failure_frequency"] = sums["sampled/tools/failed_calls"] / max(calls, 1.0)
    if "sampled/loss_rows" in sums:  # an algorithm's evaluation loss (GRPO), its mean over completions
        metrics["loss"] = sums["sampled/loss_sum"] / max(sums["sampled/loss_rows"], 1.0)
    for key, value in sums.items():
        if key.startswith(("sampled/pass@", "sampled/mean@")):
            metrics[key.removeprefix("sampled/")] = value / prompts
    return metrics


def best_metric_name(cfg: Any) -> str:
    """``metric_for_best_model`` without the ``eval/`` prefix (default ``reward``)."""
    name = cfg.metric_for_best_model or "reward"
    return name.removeprefix("eval/").removeprefix("eval_")


def best_metric_key(cfg: Any, metrics: Mapping[str, float]) -> str:
    """The key of ``metrics`` that ``metric_for_best_model`` names (default ``reward``).

    One eval set's keys are ``eval/<metric>``; named eval sets' (a dict or ``DatasetDict``) are
    ``eval_<set>/<metric>``, transformers' prefix ``eval_<set>`` with our ``/`` before the metric.
    A name is matched as written, with ``eval/`` or ``eval_`` put in front, and in transformers'
    spelling ``[eval_]<set>_<metric>``. ConfigError listing the choices when nothing matches.
    """
    name = cfg.metric_for_best_model or "reward"
    aliases: dict[str, str] = {}
    for key in metrics:
        aliases[key] = key
        head, sep, metric = key.partition("/")
        if sep and head.startswith("eval_"):  # a named set's metric: eval_<set>/<metric>
            aliases.setdefault(f"{head}_{metric}", key)
            aliases.setdefault(f"{head.removeprefix('eval_')}/{metric}", key)
            aliases.setdefault(f"{head.removeprefix('eval_')}_{metric}", key)
    bare = name.removeprefix("eval/").removeprefix("eval_") if name.startswith(("eval/", "eval_")) else name
    for candidate in (name, f"eval/{bare}", f"eval_{bare}", bare):
        if candidate in aliases:
            return aliases[candidate]
    raise ConfigError(f"metric_for_best_model {name!r} is not an eval metric; choose one of {sorted(metrics)}")


def greater_is_better(cfg: Any) -> bool:
    if cfg.greater_is_better is not None:
        return bool(cfg.greater_is_better)
    return not best_metric_name(cfg).endswith("loss")


def is_better(value: float, best: float | None, greater: bool) -> bool:
    """Whether ``value`` beats ``best`` (ties keep the earlier checkpoint; NaN never wins)."""
    if math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value > best if greater else value < best
