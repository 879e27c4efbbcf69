"""GRPO: group-relative advantages and a policy loss from the registry (GRPO / BNPO / Dr. GRPO / DAPO / GSPO / ...).

Use it like TRL's ``GRPOTrainer``::

    trainer = GRPOTrainer(model="builtin:tiny-warm", reward_funcs=[accuracy], args=GRPOConfig(...),
                          train_dataset=dataset, peft_config=LoraConfig(...))
    trainer.train()

One round is :meth:`GRPOTrainer.train_round`, top to bottom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from grpo_ascend import device as dev
from grpo_ascend.algorithms.advantages import ADVANTAGE_ESTIMATORS, select_informative_groups
from grpo_ascend.algorithms.entropy_control import EntropyControl
from grpo_ascend.algorithms.importance_sampling import (
    ImportanceSamplingSettings,
    importance_sampling_metrics,
    importance_sampling_weights,
    merge_stats,
    reduce_stats,
)
from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
)
from grpo_ascend.algorithms.reward_aggregation import GroupedRewards, aggregate_advantages
from grpo_ascend.config.configs import GRPOConfig
from grpo_ascend.config.trl_compat import (
    from_trl_async_config,
    from_trl_config,
    is_trl_async_grpo_config,
    is_trl_grpo_config,
)
from grpo_ascend.errors import ConfigError
from grpo_ascend.experience import Experience, experience_metrics
from grpo_ascend.models.parameters import adapters_disabled, mix_into_reference
from grpo_ascend.models.policy import CompletionLogprobs
from grpo_ascend.models.router_aux import router_aux_for
from grpo_ascend.rollout.row_rollouts import RolloutFuncRollout, build_tool_rollout, prepare_tools
from grpo_ascend.tools.environment_data import environment_train_dataset
from grpo_ascend.tracking.phases import PhaseTimer
from grpo_ascend.trainers.base import RLTrainerBase, RoundLog
from grpo_ascend.trainers.eval_loss import GRPOEvalLoss
from grpo_ascend.trainers.step_metrics import accumulate, policy_metrics
from grpo_ascend.trainers.step_segments import Segment, step_log, step_parts, straddling_normalisers
from grpo_ascend.trainers.trl_api import MicroBatchInputs, TRLTrainerAPI
from reward_models import processing_classes_per_function

logger = logging.getLogger(__name__)
#: Loss types that sum per-token terms, so sequence-level ratios weigh each sequence by its length.
TOKEN_SUMMED_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")
NO_REWARD_SOURCE = ("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment "
                    "defines a `get_reward` method.")


class GRPOTrainer(TRLTrainerAPI, RLTrainerBase):
    """GRPO trainer on accelerate; ``model`` is a path, hub id, ``builtin:*`` name or a loaded model."""

    config_class = GRPOConfig
    args: GRPOConfig

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
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
        _refuse_trl_only(quantization_config, optimizers)
        if is_trl_grpo_config(args):  # TRL's own GRPOConfig: mapped, ignored with a warning, or refused
            args = from_trl_config(args)
        elif is_trl_async_grpo_config(args):  # TRL's AsyncGRPOConfig: asynchronous rollouts on its vLLM server
            args = from_trl_async_config(args)
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
            vespo_k_pos=cfg.vespo_k_pos,
            vespo_lambda_pos=cfg.vespo_lambda_pos,
            vespo_k_neg=cfg.vespo_k_neg,
            vespo_lambda_neg=cfg.vespo_lambda_neg,
            off_policy_mask_threshold=cfg.off_policy_mask_threshold,
        )
        _warn_about_level(cfg)
        self.entropy_control = EntropyControl(
            coef=cfg.entropy_coef, adaptive=cfg.use_adaptive_entropy, coef_min=cfg.entropy_coef_min,
            coef_max=cfg.entropy_coef_max, delta=cfg.entropy_coef_delta, target=cfg.entropy_target)
        if rollout_func is not None and (tools or environment_factory is not None):
            raise ConfigError("pass either rollout_func or tools/environment_factory, not both: a rollout_func "
                              "runs its own generation (return env_mask to keep tool tokens out of the loss)")
        reward_tokenizers = processing_classes_per_function(reward_processing_classes, len(_as_list(reward_funcs)))
        toolset, pool = prepare_tools(tools, environment_factory)
        self._offered_tools = pool.offered_tools() if pool is not None else [t.function for t in toolset or ()]
        if pool is not None:  # environments' get_reward: extra reward sources with weight 1 (as TRL)
            env_rewards = pool.reward_functions()
            reward_funcs = _as_list(reward_funcs) + env_rewards
            reward_tokenizers += [None] * len(env_rewards)
            if cfg.reward_weights is not None and env_rewards:
                cfg = dataclasses.replace(cfg, reward_weights=list(cfg.reward_weights) + [1.0] * len(env_rewards))
        if not _as_list(reward_funcs):  # reward_funcs may be left out only when an environment scores rollouts
            raise ConfigError(NO_REWARD_SOURCE)
        train_dataset = environment_train_dataset(train_dataset, environment_factory, cfg)  # environments' own data
        super().__init__(model, cfg, train_dataset, processing_class, peft_config, callbacks, eval_dataset,
                         require_prompt=environment_factory is None)
        self.router_aux = router_aux_for(self.policy, cfg.router_aux_loss_coef)
        if cfg.sync_ref_model and self.is_peft:
            raise ConfigError(
                "sync_ref_model=True with a LoRA (PEFT) policy: the reference is the base model with the adapters "
                "disabled, and α·policy + (1 − α)·reference is no longer the base plus one low-rank adapter, so it "
                "would need a full copy of the adapted weights; TRL refuses this too. Use sync_ref_model=False, or "
                "full fine-tuning (peft_config=None) for a synced reference"
            )
        self._build_training(reward_funcs, reward_processing_classes=reward_tokenizers)
        if toolset is not None:
            self.rollout = build_tool_rollout(self.rollout.backend, self.tokenizer, self.args, toolset, pool,
                                              self.processor)
        elif rollout_func is not None:
            self.rollout = RolloutFuncRollout(rollout_func, self, self.rollout.backend)
        correction = ImportanceSamplingSettings(
            cfg.importance_sampling_mode, cfg.importance_sampling_clip_max, cfg.importance_sampling_clip_min
        ) if cfg.importance_sampling_correction else None
        self.experience = self._make_experience_maker(cfg.mask_truncated_completions, correction)
        self._policy_params = [p for p in self.policy.parameters() if p.requires_grad]
        self._build_parts()

    def train_round(self) -> None:
        """Experience → group-relative advantages → μ passes of optimizer steps over micro-batches → log.

        A round is one generation batch unless steps straddle them (``BatchPlan.generations_per_round``):
        then the rows left when a batch runs out wait for the next batch to fill their step (TRL's order).
        """
        carried: list[Segment] = []
        for generation in range(self.plan.generations_per_round):
            exp, tokens_global, log = self._generate(generation)
            stream = torch.cat([self._shuffled_rows(exp.size, generation * self.plan.num_iterations + it)
                                for it in range(self.plan.num_iterations)])
            held = sum(int(s.rows.numel()) for s in carried)
            for rows, complete in step_parts(stream, self.plan.micro_batch * self.plan.grad_accum, held):
                segments, carried = carried + [Segment(exp, rows, tokens_global, log)], []
                if not complete:
                    carried = segments
                elif self.step >= self.max_steps or self.control.should_training_stop:
                    return
                else:
                    self._optimizer_step(segments)

    def _generate(self, generation: int) -> tuple[Experience, torch.Tensor, RoundLog]:
        """A generation batch with its advantages, its valid tokens over all ranks (the loss normaliser's,
        see LossNormaliser) and the log its steps carry."""
        timer, started = PhaseTimer(self.device), time.perf_counter()
        exp, metrics = self.experience.make(
            self.plan.prompts_per_rank, timer, old_logps=self.plan.old_logps_needed(generation),
            trainer_state=self._trainer_state_for_rewards, refill=self._refill if self.args.dynamic_sampling else None,
            complete=self._group_advantages,
        )
        tokens_global = self.ranks.reduce(exp.loss_mask.sum())
        return exp, tokens_global, RoundLog(metrics, timer, prep_seconds=time.perf_counter() - started)

    def _group_advantages(self, exp: Experience) -> tuple[dict[str, Any], dict[str, float]]:
        """This rank's group-relative advantages (rewards of every rank grouped), and the round's metrics."""
        args, ranks = self.args, self.ranks
        metrics = experience_metrics(exp, ranks)
        metrics.update(ranks.mean_over_ranks(self.experience.source.metrics()))
        grouped = GroupedRewards(ranks.gather(exp.rewards_per_function), ranks.gather(exp.rewards),
                                 torch.tensor(self.rewards.weights, device=self.device), self.plan.num_generations)
        adv = aggregate_advantages(args.multi_objective_aggregation, grouped, args.advantage_estimator,
                                   args.scale_rewards)
        metrics.update(adv.metrics())
        return {"advantages": adv.advantages[ranks.rank * exp.size : (ranks.rank + 1) * exp.size].float()}, metrics

    def _optimizer_step(self, segments: list[Segment]) -> None:
        """One optimizer step over its segments' micro-batches (gradients synchronise on the very last)."""
        args, ranks = self.args, self.ranks
        dev.reset_peak_memory(self.device)
        step_start, sums, count = time.perf_counter(), {}, 0
        if len(segments) == 1 and self.plan.generations_per_round == 1:
            normalisers = [self._step_normaliser(segments[0].exp.loss_mask[segments[0].rows], segments[0].tokens_global)]
        else:
            normalisers = straddling_normalisers(segments, ranks, self.plan.grad_accum, self.plan.steps_per_generation)
        bonus = self.entropy_control.enabled
        self.policy.train()
        importance: dict[str, torch.Tensor] = {}
        for k, (segment, normaliser) in enumerate(zip(segments, normalisers)):
            for micro, last in self._micro_batches(segment.rows, segment.exp):
                count += 1
                inputs = MicroBatchInputs(segment.exp, micro, last and k == len(segments) - 1, sums, importance)
                self.training_step(self.logprob_model, inputs, normaliser)
        grad_norm, _ = self.clip_and_step(self._policy_params, torch.isfinite(sums["loss"]))
        totals = ranks.sum_scalars(sums)
        step_metrics = {"loss": totals["loss"] / ranks.world, "grad_norm": grad_norm, **policy_metrics(totals)}
        if bonus:
            step_metrics["policy_loss"] = totals["policy_loss"] / ranks.world
        if self.router_aux is not None:  # TRL's aux_loss: the mean over micro-batches and ranks
            step_metrics["aux_loss"] = totals["aux_loss"] / (count * ranks.world)
        if importance:
            step_metrics.update(importance_sampling_metrics(reduce_stats(importance, ranks.sum_scalars)))
        if args.needs_reference_model:
            step_metrics["kl"] = totals.get("kl_sum", 0.0) / max(totals.get("token_count", 0.0), 1.0)
        if args.use_adaptive_entropy:
            self.entropy_control.update(totals["trained_entropy_sum"] / max(totals["trained_tokens"], 1.0))
        if bonus:  # as TRL: the coefficient after this step's update
            step_metrics["entropy_coef"] = self.entropy_control.coef
        self._end_step(step_metrics, step_log(segments), segments[-1].exp, step_start, count)
        self._sync_reference()

    def training_step(self, model: Any, inputs: MicroBatchInputs, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch of an optimizer step (transformers' / TRL's ``training_step``): the policy loss of
        ``inputs``' rows through ``model`` (the trainer's log-prob model; the policy itself means the same),
        its backward (gradients reduced over ranks only when ``inputs.sync_gradients``), its statistics added
        to ``inputs.stats``; returns the loss, detached. ``num_items_in_batch`` is the step's loss normaliser
        (a LossNormaliser: token and sequence counts over the step's micro-batches and all ranks); None
        normalises over these rows alone, as a step of one micro-batch (every rank must call). The train loop
        calls it once per micro-batch, so a subclass may wrap it, as TRL's own wraps transformers'."""
        args, exp, micro = self.args, inputs.experience, inputs.rows
        forward = self.logprob_model if model is None or model is self.policy else model
        normaliser = num_items_in_batch if num_items_in_batch is not None else self._step_normaliser(
            exp.loss_mask[micro], self.ranks.reduce(exp.loss_mask[micro].sum()))
        settings = dataclasses.replace(self.loss_settings, entropy_coef=self.entropy_control.applied())
        bonus = self.entropy_control.enabled
        aux = self.router_aux is not None and forward is self.logprob_model
        with self._no_sync(self.logprob_model, inputs.sync_gradients):
            logps, entropies, *aux_loss = forward(*exp.model_inputs(micro), temperature=args.temperature,
                                                  with_entropy=True, entropy_grad=bonus, **({"aux_loss": True} if aux else {}))
            weights = None if exp.token_weights is None else exp.token_weights[micro]
            if self.experience.importance_weights_deferred(exp):  # the step's old policy is this forward's
                computed = importance_sampling_weights(exp.sampling_logps[micro], logps.detach(), exp.loss_mask[micro],
                                                       self.experience.importance_sampling)
                weights = computed.weights
                merge_stats(inputs.importance_stats, computed.stats)
            batch = PolicyLossBatch(
                logps=logps, advantages=exp.advantages[micro], mask=exp.loss_mask[micro],
                old_logps=None if exp.old_logps is None else exp.old_logps[micro],
                ref_logps=None if exp.ref_logps is None else exp.ref_logps[micro],
                entropies=entropies if bonus or entropies is None else entropies.detach(),
                weights=weights,
                sampling_logps=exp.sampling_logps[micro],
                selection=self._high_entropy_tokens(entropies, exp.loss_mask[micro]),
            )
            loss, stats = policy_loss(args.loss_type, batch, settings, normaliser)
            if bonus:  # TRL's policy_loss: the loss without the entropy bonus
                stats["policy_loss"] = self._loss_without_entropy(batch, settings, normaliser)
            if aux_loss:  # TRL: coef · aux / gradient_accumulation_steps per micro-batch, added after policy_loss
                loss = loss + self.router_aux.coef * aux_loss[0] / self.plan.grad_accum
                stats["aux_loss"] = aux_loss[0].detach().float()
            self._backward(loss)
        accumulate(inputs.stats, {"loss": loss, **stats, **self._trained_entropy(batch)})
        return loss.detach()

    def _eval_loss(self) -> GRPOEvalLoss:
        """TRL's ``eval_loss`` (trainers/eval_loss.py) through a log-prob forward of the policy itself: not the
        data-parallel wrapper, whose forward may make collective calls while ranks score different numbers of
        eval batches."""
        forward = CompletionLogprobs(self.policy, self.args.logprob_chunk_size, self.args.share_prompt_prefill)

        def reference(*inputs: torch.Tensor) -> torch.Tensor:
            if self.ref_logprob_model is not None:
                return self.ref_logprob_model(*inputs, temperature=self.args.temperature)[0]
            with adapters_disabled(self.policy):
                return forward(*inputs, temperature=self.args.temperature)[0]

        return GRPOEvalLoss(
            args=self.args, reward_weights=self.reward_weights, forward=forward,
            reference=reference, importance_sampling=self.experience.importance_sampling, scope=self._eval_loss_scope,
            settings=lambda: dataclasses.replace(self.loss_settings, entropy_coef=self.entropy_control.applied()))

    @contextlib.contextmanager
    def _eval_loss_scope(self) -> Iterator[None]:
        """Around the eval loss's forwards: eval mode (the evaluator restores the mode), autocast, whole weights."""
        self.policy.eval()
        with self._autocast(), self.strategy.whole_weights(self.logprob_model):
            yield

    def _sync_reference(self) -> None:
        """TR-DPO: every ``ref_model_sync_steps`` optimizer steps, reference ← α·policy + (1 − α)·reference."""
        if not self.args.sync_ref_model or self.step % self.args.ref_model_sync_steps:
            return
        with self._gathered_trainable():
            mix_into_reference(self.ref_logprob_model.model, self._trainable_module(), self.args.ref_model_mixup_alpha)

    def _high_entropy_tokens(self, entropies: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
        """The micro-batch's tokens in the top ``top_entropy_quantile`` by entropy over all ranks (None: all)."""
        if self.args.top_entropy_quantile >= 1.0 or entropies is None:
            return None
        return self.get_high_entropy_mask(entropies, mask, 1.0 - self.args.top_entropy_quantile)

    def _trained_entropy(self, batch: PolicyLossBatch) -> dict[str, torch.Tensor]:
        """Entropy sum and count over the tokens the policy term trains on, for adaptive entropy control."""
        if not self.args.use_adaptive_entropy or batch.entropies is None:
            return {}
        trained = batch.mask.bool() if batch.selection is None else batch.selection.bool() & batch.mask.bool()
        ent = torch.where(trained, batch.entropies.detach(), torch.zeros_like(batch.entropies.detach()))
        return {"trained_entropy_sum": ent.sum().float(), "trained_tokens": trained.sum().float()}

    def _trainer_state(self) -> dict[str, Any]:
        return {**super()._trainer_state(), "entropy_control": self.entropy_control.state_dict()}

    def _restore_trainer_state(self, state: dict[str, Any]) -> None:
        if "entropy_control" in state:
            self.entropy_control.load_state_dict(state["entropy_control"])

    def _extra_state_tensors(self) -> dict[str, torch.Tensor]:
        """A synced reference has moved away from the starting weights: it is saved for an exact resume."""
        if not self.args.sync_ref_model:
            return {}
        return {f"reference/{name}": p.detach().cpu() for name, p in self.ref_logprob_model.model.named_parameters()}

    def _restore_extra_state_tensors(self, extra: dict[str, torch.Tensor]) -> None:
        if not self.args.sync_ref_model:
            return
        with torch.no_grad():
            for name, p in self.ref_logprob_model.model.named_parameters():
                p.copy_(extra[f"reference/{name}"].to(p.device, p.dtype))

    def _loss_without_entropy(self, batch: PolicyLossBatch, settings: PolicyLossSettings,
                              normaliser: Any) -> torch.Tensor:
        """The micro-batch's policy loss with the entropy bonus left out (a metric: no gradient)."""
        with torch.no_grad():
            detached = dataclasses.replace(batch, logps=batch.logps.detach(), entropies=None)
            settings = dataclasses.replace(settings, entropy_coef=0.0)
            return policy_loss(self.args.loss_type, detached, settings, normaliser)[0]

    def _refill(self, exp: Experience, timer: PhaseTimer) -> Experience:
        """DAPO dynamic sampling: keep groups whose rewards differ; draw more prompts to refill, up to a cap.

        Ranks refill in lockstep (same draws, same number of extra rounds) so their samplers stay
        aligned; groups that could not be replaced within the cap are kept as they are.
        """
        G, want = self.plan.num_generations, self.plan.prompts_per_rank
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
        return dataclasses.replace(out, counts={
            **counts,
            "dynamic_sampling/extra_rounds": rounds / self.ranks.world,
            "dynamic_sampling/groups_sampled": float(sampled),
            "dynamic_sampling/zero_std_groups_kept": float(filled),
        })


def _refuse_trl_only(quantization_config: Any, optimizers: Any) -> None:
    """TRL's GRPOTrainer arguments that exist for scripts' sake: their empty values are accepted."""
    if quantization_config is not None:
        raise ConfigError("quantization_config: quantized base models (QLoRA) are not supported; the rollout engine "
                          "folds LoRA into full-precision weights. Pass quantization_config=None (TRL's script does "
                          "unless --load_in_4bit / --load_in_8bit)")
    if tuple(optimizers or (None, None)) != (None, None):
        raise ConfigError("optimizers: a custom optimizer / scheduler is not supported; the trainer builds AdamW with "
                          "the config's learning_rate, betas, weight_decay and lr_scheduler_type. Pass (None, None)")


def _warn_about_level(cfg: GRPOConfig) -> None:
    """TRL's warnings where importance_sampling_level and loss_type do not fit as their papers meant."""
    if cfg.importance_sampling_level == "sequence" and cfg.loss_type in TOKEN_SUMMED_LOSSES:
        logger.warning(
            "When using `importance_sampling_level='sequence'`, the '%s' loss sums per-token contributions, which "
            "effectively weights each sequence by its completion length instead of optimizing the per-sequence "
            "objective. To reproduce the GSPO paper's setup, set loss_type='grpo' (or our alias loss_type='gspo').",
            cfg.loss_type)
    if cfg.loss_type == "luspo" and cfg.importance_sampling_level != "sequence":
        logger.warning("When using 'luspo' loss, importance_sampling_level should be set to 'sequence' to mirror the "
                       "paper's setup.")
    if cfg.loss_type == "vespo" and cfg.importance_sampling_level != "token":
        logger.warning("VESPO computes sequence-level importance weights internally; importance_sampling_level "
                       "should be 'token' (the default).")


def _as_list(reward_funcs: Any) -> list[Any]:
    if reward_funcs is None:
        return []
    return list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]


def _group_rows(groups: torch.Tensor, G: int) -> torch.Tensor:
    """Row indices of whole groups."""
    return (groups.unsqueeze(1) * G + torch.arange(G, device=groups.device)).flatten()
