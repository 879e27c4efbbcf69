"""GRPO: group-relative advantages and a clipped policy loss (GRPO / BNPO / Dr. GRPO / DAPO / GSPO).

Use it like TRL's ``GRPOTrainer``::

    trainer = GRPOTrainer(model="builtin:tiny-warm", reward_funcs=[accuracy], args=GRPOConfig(...),
                          train_dataset=dataset, peft_config=LoraConfig(...))
    trainer.train()

One round is :meth:`GRPOTrainer._train_round`, top to bottom.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from grpo_ascend.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    select_informative_groups,
)
from grpo_ascend.algorithms.importance_sampling import ImportanceSamplingSettings
from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
)
from grpo_ascend.config import GRPOConfig
from grpo_ascend.errors import ConfigError
from grpo_ascend.experience import Experience, experience_metrics
from grpo_ascend.phases import PhaseTimer
from grpo_ascend.rollout.row_rollouts import RolloutFuncRollout, build_tool_rollout, prepare_tools
from grpo_ascend.trainers.base import RLTrainerBase, RoundLog
from grpo_ascend.trl_compat import from_trl_config, is_trl_grpo_config


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
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        environment_factory: Any = None,
        rollout_func: Any = None,
        callbacks: Any = None,
        quantization_config: Any = None,
        reward_processing_classes: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
    ):
        _refuse_trl_only(quantization_config, reward_processing_classes, optimizers)
        if is_trl_grpo_config(args):  # TRL's own GRPOConfig: mapped, ignored with a warning, or refused
            args = from_trl_config(args)
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
            kl_estimator=cfg.kl_estimator,
            use_bias_correction_kl=cfg.use_bias_correction_kl,
            sapo_temperature_pos=cfg.sapo_temperature_pos,
            sapo_temperature_neg=cfg.sapo_temperature_neg,
        )
        if rollout_func is not None and (tools or environment_factory is not None):
            raise ConfigError("pass either rollout_func or tools/environment_factory, not both: a rollout_func "
                              "runs its own generation (return env_mask to keep tool tokens out of the loss)")
        toolset, pool = prepare_tools(tools, environment_factory)
        if pool is not None:  # environments' get_reward: extra reward sources with weight 1 (as TRL)
            env_rewards = pool.reward_functions()
            reward_funcs = _as_list(reward_funcs) + env_rewards
            if cfg.reward_weights is not None and env_rewards:
                cfg = dataclasses.replace(cfg, reward_weights=list(cfg.reward_weights) + [1.0] * len(env_rewards))
        super().__init__(model, cfg, train_dataset, processing_class, peft_config, callbacks, eval_dataset)
        self._build_training(reward_funcs)
        if toolset is not None:
            self.engine = build_tool_rollout(self.engine, self.tokenizer, self.args, toolset, pool)
        elif rollout_func is not None:
            self.engine = RolloutFuncRollout(rollout_func, self, self.engine)
        if self.args.beta > 0:
            self._setup_reference()
        correction = ImportanceSamplingSettings(
            cfg.importance_sampling_mode, cfg.importance_sampling_clip_max, cfg.importance_sampling_clip_min
        ) if cfg.importance_sampling_correction else None
        self.experience = self._make_experience_maker(self.args.beta > 0, cfg.mask_truncated_completions, correction)
        if rollout_func is not None:  # an external sampler: its log-probs are not the training forward's
            self.experience.exact_sampling_logps = False
        self._policy_params = [p for p in self.policy.parameters() if p.requires_grad]

    def _train_round(self) -> None:
        """Experience → group-relative advantages → μ passes of optimizer steps over micro-batches → log."""
        args, ranks = self.args, self.ranks
        timer, started = PhaseTimer(self.device), time.perf_counter()
        exp = self.experience.make(
            self.plan.prompts_per_rank, timer, old_logps=self.plan.optimizer_steps_per_generation > 1,
            trainer_state=self._trainer_state_for_rewards, refill=self._refill if args.dynamic_sampling else None,
        )
        metrics = experience_metrics(exp, ranks)
        adv = compute_advantages(args.advantage_estimator, ranks.gather(exp.rewards), args.num_generations,
                                 args.scale_rewards)
        exp.advantages = adv.advantages[ranks.rank * exp.size : (ranks.rank + 1) * exp.size].float()
        metrics.update(adv.metrics())
        tokens_global = ranks.reduce(exp.loss_mask.sum())  # the round's loss normaliser (see LossNormaliser)
        log = RoundLog(metrics, timer, prep_seconds=time.perf_counter() - started)

        for rows in self._step_rows(exp.size):
            step_start, sums = time.perf_counter(), {}
            normaliser = self._step_normaliser(exp.loss_mask[rows], tokens_global)
            self.policy.train()
            for micro, last in self._micro_batches(rows, exp):
                with self._no_sync(self.logprob_model, last):
                    logps, entropies = self.logprob_model(*exp.model_inputs(micro), temperature=args.temperature,
                                                          with_entropy=True, entropy_grad=bool(args.entropy_coef))
                    batch = PolicyLossBatch(
                        logps=logps, advantages=exp.advantages[micro], mask=exp.loss_mask[micro],
                        old_logps=None if exp.old_logps is None else exp.old_logps[micro],
                        ref_logps=None if exp.ref_logps is None else exp.ref_logps[micro],
                        entropies=entropies if args.entropy_coef or entropies is None else entropies.detach(),
                        weights=None if exp.token_weights is None else exp.token_weights[micro],
                    )
                    loss, stats = policy_loss(args.loss_type, batch, self.loss_settings, normaliser)
                    if args.entropy_coef:  # TRL's policy_loss: the loss without the entropy bonus
                        stats["policy_loss"] = self._loss_without_entropy(batch, normaliser)
                    self._backward(loss)
                self._accumulate(sums, {"loss": loss, **stats})
            grad_norm, _ = self._clip_and_step(self._policy_params, torch.isfinite(sums["loss"]))
            totals = ranks.sum_scalars(sums)
            step_metrics = {"loss": totals["loss"] / ranks.world, "grad_norm": grad_norm,
                            **self._policy_metrics(totals)}
            if args.entropy_coef:
                step_metrics["policy_loss"] = totals["policy_loss"] / ranks.world
            if args.beta > 0:
                step_metrics["kl"] = totals.get("kl_sum", 0.0) / max(totals.get("token_count", 0.0), 1.0)
            self._end_step(step_metrics, log, exp, step_start)

    def _loss_without_entropy(self, batch: PolicyLossBatch, normaliser: Any) -> torch.Tensor:
        """The micro-batch's policy loss with the entropy bonus left out (a metric: no gradient)."""
        with torch.no_grad():
            detached = dataclasses.replace(batch, logps=batch.logps.detach(), entropies=None)
            settings = dataclasses.replace(self.loss_settings, entropy_coef=0.0)
            return policy_loss(self.args.loss_type, detached, settings, normaliser)[0]

    def _refill(self, exp: Experience, timer: PhaseTimer) -> Experience:
        """DAPO dynamic sampling: keep groups whose rewards differ; draw more prompts to refill, up to a cap.

        Ranks refill in lockstep (same draws, same number of extra rounds) so their samplers stay
        aligned; groups that could not be replaced within the cap are kept as they are.
        """
        G, want = self.args.num_generations, self.plan.prompts_per_rank
        kept: list[Experience] = []
        spare: list[Experience] = []
        have = rounds = sampled = 0
        counts = dict(exp.counts)  # each draw's counts once, however its rows are split
        while True:
            informative = select_informative_groups(exp.rewards, G)
            sampled += informative.numel()
            good = torch.nonzero(informative).flatten()
            bad = torch.nonzero(~informative).flatten()
            take = good[: want - have]
            if take.numel():
                kept.append(exp.select(_group_rows(take, G)))
                have += take.numel()
            if bad.numel():
                spare.append(exp.select(_group_rows(bad, G)))
            need = int(self.ranks.reduce(torch.tensor(float(want - have), device=self.device), "max"))
            if need == 0 or rounds >= self.args.max_dynamic_sampling_rounds:
                break
            rounds += 1
            exp = self.experience.sample_and_score(need, timer, self._trainer_state_for_rewards)
            for k, v in exp.counts.items():
                counts[k] = counts.get(k, 0.0) + v
        filled = 0
        for part in spare:
            if have >= want:
                break
            n = min(want - have, part.size // G)
            kept.append(part.select(torch.arange(n * G, device=self.device)))
            have += n
            filled += n
        out = Experience.concat(kept, self.tokenizer.pad_token_id)
        # Counts are summed over ranks: the extra rounds (the same on every rank) are entered per rank.
        out.counts = {**counts,
            "dynamic_sampling/extra_rounds": rounds / self.ranks.world,
            "dynamic_sampling/groups_sampled": float(sampled),
            "dynamic_sampling/zero_std_groups_kept": float(filled),
        }
        return out


def _refuse_trl_only(quantization_config: Any, reward_processing_classes: Any, optimizers: Any) -> None:
    """TRL's GRPOTrainer arguments that exist for scripts' sake: their empty values are accepted."""
    if quantization_config is not None:
        raise ConfigError("quantization_config: quantized base models (QLoRA) are not supported; the rollout engine "
                          "folds LoRA into full-precision weights. Pass quantization_config=None (TRL's script does "
                          "unless --load_in_4bit / --load_in_8bit)")
    if reward_processing_classes is not None:
        raise ConfigError("reward_processing_classes: reward models load their own tokenizer here; pass None")
    if tuple(optimizers or (None, None)) != (None, None):
        raise ConfigError("optimizers: a custom optimizer / scheduler is not supported; the trainer builds AdamW with "
                          "the config's learning_rate, betas, weight_decay and lr_scheduler_type. Pass (None, None)")


def _as_list(reward_funcs: Any) -> list[Any]:
    if reward_funcs is None:
        return []
    return list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]


def _group_rows(groups: torch.Tensor, G: int) -> torch.Tensor:
    """Row indices of whole groups."""
    return (groups.unsqueeze(1) * G + torch.arange(G, device=groups.device)).flatten()
