"""``trainer.state.log_history`` as transformers' ``Trainer`` and TRL 1.16's ``GRPOTrainer`` write it.

Each logged step's entry holds our metrics (as in metrics.jsonl) and, beside them, TRL's name for every
quantity TRL logs too (``completions/mean_length`` for our ``completion_length/mean``, ...), averaged as TRL
averages them: over the values since the last log (one per generation round for the round's statistics, one per
optimizer step for the loss's), skipping NaN. Entries come every ``logging_steps`` steps (TRL's schedule; a
last step off it still reaches metrics.jsonl). ``train()`` ends with transformers' summary entry
(``train_runtime``, ``train_samples_per_second``, ``train_steps_per_second``, ``total_flos``, ``train_loss``
and what was not logged yet) and returns transformers' ``TrainOutput``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.experience import Experience

#: Our metric -> TRL 1.16's name for the same quantity (metrics with the same name in both are kept as they are).
TRL_NAMES = {
    "completion_length/mean": "completions/mean_length",
    "completion_length/min": "completions/min_length",
    "completion_length/max": "completions/max_length",
    "truncated_fraction": "completions/clipped_ratio",
    "time/step": "step_time",
}
#: Our metrics that TRL logs under the same name; ``rewards/<function>/mean|std`` too.
SAME_NAMES = ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "frac_reward_zero_std", "entropy", "kl",
              "policy_loss", "tools/call_frequency", "tools/failure_frequency",
              "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
              "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
              "sampling/importance_sampling_ratio/max")
#: The clipped-token fractions, under TRL's names for the loss types TRL logs them for.
CLIP_NAMES = {"clip_ratio/low": "clip_ratio/low_mean", "clip_ratio/high": "clip_ratio/high_mean",
              "clip_ratio/region": "clip_ratio/region_mean"}
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: CISPO's capped-weight fraction (ratio > epsilon_high where the advantage is positive) under TRL's name.
CISPO_NAMES = {"clip_ratio/high": "cispo_clip_ratio"}
#: transformers logs these from its own loop at logging steps only: the last value, never in the summary.
LOOP_ONLY = ("grad_norm", "learning_rate")


def training_flops_per_token(model: nn.Module) -> int:
    """transformers' estimate of a training forward + backward: 6 × the non-embedding parameters per token."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    counter = getattr(base, "num_parameters", None)
    params = counter(exclude_embeddings=True) if counter is not None else sum(p.numel() for p in base.parameters())
    return 6 * int(params)


def round_statistics(exp: Experience, ranks: Ranks) -> tuple[dict[str, float], float, int]:
    """TRL's statistics of a generation round that ours lack (lengths of the completions that ended before
    max_completion_length; zeros when none did, as TRL), its tokens (prompts + completions) and rows, all ranks."""
    lengths = ranks.gather(exp.completion_mask.sum(1).float())
    truncated = ranks.gather(exp.truncated.float()).bool()  # float: collectives of every backend take it
    ended = lengths[~truncated]
    if ended.numel() == 0:
        ended = lengths.new_zeros(1)
    tokens = ranks.reduce(exp.prompt_mask.sum().float() + exp.completion_mask.sum().float())
    values = torch.stack([ended.mean(), ended.min(), ended.max(), tokens]).tolist()
    names = ("completions/mean_terminated_length", "completions/min_terminated_length",
             "completions/max_terminated_length")
    return dict(zip(names, values[:3])), values[3], int(lengths.numel())


class TRLLogHistory:
    """Collects a run's values between log entries and writes the entries (see the module docstring)."""

    def __init__(self, state: Any, loss_type: str, entropy_coef: float, flops_per_token: int,
                 completions_per_step: int) -> None:
        self.state = state
        clip_names = CLIP_NAMES if loss_type in CLIPPED_LOSSES else CISPO_NAMES if loss_type == "cispo" else {}
        self.names = {**TRL_NAMES, **clip_names}
        self.constant = {"entropy_coef": entropy_coef} if entropy_coef else {}
        self.flops_per_token = flops_per_token
        self.completions_per_step = completions_per_step
        self.started = time.time()
        self.start_step = state.global_step
        self._values: dict[str, list[float]] = {}
        self._latest: dict[str, float] = {}
        self._tokens_per_row = 0.0
        self._losses: list[float] = []

    def _trl_view(self, metrics: dict[str, Any]) -> dict[str, float]:
        return {self.names.get(k, k): float(v) for k, v in metrics.items() if isinstance(v, (int, float))
                and (k in self.names or k in SAME_NAMES or (k.startswith("rewards/") and k.endswith(("/mean", "/std"))))}

    def _add(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            if name in LOOP_ONLY:
                self._latest[name] = value
            else:
                self._values.setdefault(name, []).append(value)

    def add_round(self, metrics: dict[str, float], exp: Experience, ranks: Ranks) -> None:
        """A generation round's statistics (once per round, as TRL appends them once per generation)."""
        extra, tokens, rows = round_statistics(exp, ranks)
        self.state.num_input_tokens_seen += int(tokens)
        self._tokens_per_row = tokens / max(rows, 1)
        self._add({**self._trl_view(metrics), **extra})
        self._latest["num_tokens"] = float(self.state.num_input_tokens_seen)

    def add_step(self, metrics: dict[str, float]) -> None:
        """An optimizer step's values: loss statistics, grad_norm, learning_rate, step_time."""
        self._add({**self._trl_view(metrics), **self.constant})
        self.state.total_flos += self.flops_per_token * self._tokens_per_row * self.completions_per_step
        if "loss" in metrics:
            self._losses.append(float(metrics["loss"]))

    def flush(self, with_loop_values: bool = True) -> dict[str, float | None]:
        """The values since the last entry, averaged as TRL does (None where every value was NaN)."""
        out: dict[str, float | None] = {k: v for k, v in self._latest.items() if with_loop_values or k not in LOOP_ONLY}
        for name, values in self._values.items():
            finite = [v for v in values if not math.isnan(v)]
            out[name] = sum(finite) / len(finite) if finite else None
        if not with_loop_values:
            out.pop("loss", None)
        self._values.clear()
        self._latest.clear()
        return out

    def summary(self) -> tuple[float, dict[str, Any]]:
        """(train_loss, transformers' end-of-training metrics plus the values not logged yet)."""
        steps = self.state.global_step - self.start_step
        finite = [v for v in self._losses if math.isfinite(v)]  # as transformers' logging_nan_inf_filter
        train_loss = sum(finite) / max(len(finite), 0.001)
        runtime = time.time() - self.started
        metrics: dict[str, Any] = {"train_runtime": round(runtime, 4)}
        if runtime > 0:
            metrics["train_samples_per_second"] = round(steps * self.completions_per_step / runtime, 3)
            metrics["train_steps_per_second"] = round(steps / runtime, 3)
        metrics["total_flos"] = float(self.state.total_flos)
        metrics["train_loss"] = train_loss
        metrics.update(self.flush(with_loop_values=False))
        return train_loss, metrics
