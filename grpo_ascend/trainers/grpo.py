"""GRPO: group-relative advantages and a clipped policy loss (GRPO / BNPO / Dr. GRPO / DAPO / GSPO).

Use it like TRL's ``GRPOTrainer``::

    trainer = GRPOTrainer(model="builtin:tiny-warm", reward_funcs=[accuracy], args=GRPOConfig(...),
                          train_dataset=dataset, peft_config=LoraConfig(...))
    trainer.train()
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    select_informative_groups,
)
from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
)
from grpo_ascend.config import GRPOConfig
from grpo_ascend.trainers.base import RLTrainerBase, Round


class GRPOTrainer(RLTrainerBase):
    """GRPO trainer on accelerate; ``model`` is a path, hub id, ``builtin:*`` name or a loaded model."""

    config_class = GRPOConfig
    args: GRPOConfig

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ):
        cfg = args if args is not None else GRPOConfig()
        POLICY_LOSSES.get(cfg.loss_type)  # fail before loading anything on a bad name
        ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
        self.loss_settings = PolicyLossSettings(
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            delta=cfg.delta,
            beta=cfg.beta,
            entropy_coef=cfg.entropy_coef,
            importance_sampling_level=cfg.importance_sampling_level,
            max_completion_length=cfg.max_completion_length,
        )
        super().__init__(model, reward_funcs, cfg, train_dataset, processing_class, peft_config)
        if self.args.beta > 0:
            self._setup_reference()

    # ------------------------------------------------------------------------------ rollouts
    def _prepare_round(self, timings: dict[str, float]) -> tuple[Round, dict[str, float]]:
        args, G = self.args, self.args.num_generations
        prompts_per_rank = self.plan.completions_per_generation // self.accelerator.num_processes // G
        rnd = self._sample_and_score(self._next_rows(prompts_per_rank), timings)
        metrics = self._completion_metrics(rnd)
        if args.dynamic_sampling:
            rnd, ds_metrics = self._dynamic_sampling(rnd, prompts_per_rank, timings)
            metrics.update(ds_metrics)

        t = rnd.tensors
        all_rewards = self.accelerator.gather(t["rewards"])
        adv = compute_advantages(args.advantage_estimator, all_rewards, G, args.scale_rewards)
        rank = self.accelerator.process_index
        t["advantages"] = adv.advantages[rank * rnd.size : (rank + 1) * rnd.size].float()
        loss_mask = t["completion_mask"].float()
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~t["truncated"]).float().unsqueeze(1)
        t["loss_mask"] = loss_mask

        start = time.perf_counter()
        if self.plan.optimizer_steps_per_generation > 1:
            # Several optimizer steps use this batch: the sampling policy's log-probs are needed.
            # The engine's are exact in fp32; under autocast the training forward is recomputed.
            t["old_logps"] = t["sampling_logprobs"] if self.precision == "fp32" else self._forward_logprobs(rnd)
            start = self._timed(timings, "old_logprobs", start)
        if args.beta > 0:
            t["ref_logps"] = self._forward_logprobs(rnd, reference=True)
            self._timed(timings, "reference", start)

        std = adv.group_std.float()
        metrics.update(
            {
                "advantages/mean": float(adv.advantages.mean()),
                "advantages/std": float(adv.advantages.std()) if adv.advantages.numel() > 1 else 0.0,
                "advantages/abs_max": float(adv.advantages.abs().max()),
                "frac_reward_zero_std": float(adv.zero_variance.float().mean()),
                "reward_group_std/mean": float(std.mean()),
            }
        )
        return rnd, metrics

    def _dynamic_sampling(self, rnd: Round, want: int, timings: dict[str, float]) -> tuple[Round, dict[str, float]]:
        """DAPO: keep groups whose rewards differ; sample more prompts to refill, up to a cap."""
        G = self.args.num_generations
        kept: list[Round] = []
        spare: list[Round] = []
        have = 0
        rounds = 0
        sampled = 0
        while True:
            informative = select_informative_groups(rnd.tensors["rewards"], G)
            sampled += informative.numel()
            good = torch.nonzero(informative).flatten()
            bad = torch.nonzero(~informative).flatten()
            take = good[: want - have]
            if take.numel():
                kept.append(self._select(rnd, self._group_rows(take, G)))
                have += take.numel()
            if bad.numel():
                spare.append(self._select(rnd, self._group_rows(bad, G)))
            # Ranks refill in lockstep (same draws, same number of rounds) so samplers stay aligned.
            shortfall = torch.tensor(float(want - have), device=self.device)
            if self.accelerator.num_processes > 1:
                shortfall = self.accelerator.reduce(shortfall, reduction="max")
            need = int(shortfall)
            if need == 0 or rounds >= self.args.max_dynamic_sampling_rounds:
                break
            rounds += 1
            rnd = self._sample_and_score(self._next_rows(need), timings)
        filled = 0
        for s in spare:
            if have >= want:
                break
            n = min(want - have, s.size // G)
            kept.append(self._select(s, torch.arange(n * G, device=self.device)))
            have += n
            filled += n
        return self._merge_rounds(kept), {
            "dynamic_sampling/extra_rounds": float(rounds),
            "dynamic_sampling/groups_sampled": float(sampled),
            "dynamic_sampling/zero_std_groups_kept": float(filled),
        }

    def _group_rows(self, groups: Tensor, G: int) -> Tensor:
        return (groups.unsqueeze(1) * G + torch.arange(G, device=groups.device)).flatten()

    def _round_context(self, rnd: Round) -> dict[str, Any]:
        return {"generation_tokens_global": self._sum_over_ranks(rnd.tensors["loss_mask"].sum())}

    # ------------------------------------------------------------------------------ training
    def _optimizer_step(self, rnd: Round, rows: Tensor, round_ctx: dict[str, Any]) -> dict[str, float]:
        args, t = self.args, rnd.tensors
        normaliser = self._step_normaliser(t["loss_mask"][rows], round_ctx["generation_tokens_global"])
        self.policy.train()
        micro_batches = rows.split(args.per_device_train_batch_size)
        sums: dict[str, Tensor] = {}
        for i, m in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._no_sync(self.logprob_model, last):
                logps, entropies = self.logprob_model(
                    t["prompt_ids"][m], t["prompt_mask"][m], t["completion_ids"][m], t["completion_mask"][m],
                    temperature=args.temperature, with_entropy=True,
                )
                if entropies is not None and not args.entropy_coef:
                    entropies = entropies.detach()
                batch = PolicyLossBatch(
                    logps=logps,
                    advantages=t["advantages"][m],
                    mask=t["loss_mask"][m],
                    old_logps=t["old_logps"][m] if "old_logps" in t else None,
                    ref_logps=t["ref_logps"][m] if "ref_logps" in t else None,
                    entropies=entropies,
                )
                loss, stats = policy_loss(args.loss_type, batch, self.loss_settings, normaliser)
                self._backward(loss)
            self._accumulate(sums, {"loss": loss, **stats})
        grad_norm, _ = self._clip_and_step(
            [p for p in self.policy.parameters() if p.requires_grad], torch.isfinite(sums["loss"])
        )
        totals = self._reduce(sums)
        metrics = {"loss": totals["loss"] / self.accelerator.num_processes, "grad_norm": grad_norm,
                   **self._policy_metrics(totals)}
        if args.beta > 0:
            metrics["kl"] = totals.get("kl_sum", 0.0) / max(totals.get("token_count", 0.0), 1.0)
        return metrics
