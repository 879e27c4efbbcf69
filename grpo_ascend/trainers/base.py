"""What the GRPO and PPO trainers share: setup on accelerate, the experience pipeline, optimizer and
schedule, the run loop with checkpoints and tracking.

A subclass implements :meth:`RLTrainerBase._train_round`: one generation round (an
:class:`~grpo_ascend.experience.Experience`) and the optimizer steps it feeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.algorithms.importance_sampling import ImportanceSamplingSettings
from grpo_ascend.algorithms.losses import LossNormaliser
from grpo_ascend.config.configs import BaseRLConfig, BatchPlan
from grpo_ascend.data.prompts import is_stream, make_prompt_sampler
from grpo_ascend.distributed.launch import make_accelerator, select_strategy
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.errors import ConfigError
from grpo_ascend.experience import Experience, ExperienceMaker
from grpo_ascend.models.policy import (
    CompletionLogprobs,
    activation_checkpointing_on,
    adapters_disabled,
    backbone_and_head,
    is_peft,
    lora_merged,
    trainable_parameters,
)
from grpo_ascend.rollout.backend import PolicyWeights, serving
from grpo_ascend.tracking.phases import PhaseTimer
from grpo_ascend.tracking.run_tracker import RunTracker, truncate_metrics
from grpo_ascend.trainers.checkpointing import CheckpointingMixin
from grpo_ascend.trainers.components import (
    build_engine,
    build_optimizer,
    build_policy,
    build_rewards,
    check_streamed_steps,
    lr_factor,
    merge_lora_for_rollout,
    total_steps,
)
from grpo_ascend.trainers.evaluating import EvaluationMixin
from grpo_ascend.trainers.micro_batches import TokenCost, plan_for_rank
from grpo_ascend.trainers.surface import TrainerSurfaceMixin
from grpo_ascend.trainers.trl_logs import TRLLogHistory, training_flops_per_token

logger = logging.getLogger(__name__)


@dataclass
class RoundLog:
    """What a round's optimizer steps log besides their own: the round's metrics and phase timings."""

    metrics: dict[str, float]
    timer: PhaseTimer
    prep_seconds: float
    steps: int = 0


class RLTrainerBase(CheckpointingMixin, EvaluationMixin, TrainerSurfaceMixin):
    """Shared machinery; see the module docstring."""

    config_class: type[BaseRLConfig] = BaseRLConfig
    #: The algorithm's name in recipes (``algorithm:``), as the memory plan knows it.
    algorithm: str = "grpo"
    #: Models handed to accelerate's prepare (PPO: policy and critic); engines taking one refuse more.
    prepared_models: int = 1

    def __init__(
        self,
        model: str | nn.Module,
        args: BaseRLConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: Sequence[Any] | None = None,
        eval_dataset: Any = None,
    ):
        """The run and its policy: accelerator, distributed strategy, batch plan, policy and tokenizer.

        A subclass then builds what the policy trains with (:meth:`_build_training`), adding its
        own parts in between (PPO: the critic, whose parameters the optimizer also updates).
        """
        self.args = args if args is not None else self.config_class()
        if not isinstance(self.args, self.config_class):
            raise ConfigError(f"args must be a {self.config_class.__name__}, got {type(self.args).__name__}")
        if train_dataset is None:
            raise ConfigError("`train_dataset` is required: pass a datasets.Dataset with a 'prompt' column (TRL 1.16 "
                              "lets an environment_factory replace it; here the prompts come from a dataset always)")
        args = self.args
        self._init_evaluation(eval_dataset)  # before loading anything: refuse eval settings without a dataset
        check_streamed_steps(args, train_dataset)
        dev.seed_everything(args.seed)
        self.accelerator, self.precision = make_accelerator(args)
        # Chosen once; refuses a launch its engine can't run. The trainer never asks which engine runs.
        self.strategy = select_strategy(self.accelerator, args, self.precision, type(self).__name__,
                                        self.prepared_models)
        self.device = self.accelerator.device
        self.ranks = Ranks(self.accelerator)
        self.plan: BatchPlan = args.batch_plan(self.accelerator.num_processes)
        self.model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        self.policy, self.tokenizer = build_policy(model, processing_class, peft_config, args, self.device)
        self.is_peft = is_peft(self.policy)
        self.strategy.validate_model(self.is_peft)
        self.train_dataset = train_dataset
        self._callbacks = callbacks
        #: What summary.json holds after ``train()`` (steps, first/last reward, peak memory, ...); None before.
        self.run_summary: dict[str, Any] | None = None

    def _build_training(self, reward_funcs: Any, extra_parameters: Sequence[nn.Parameter] = (),
                        reward_processing_classes: Any = None) -> None:
        """Optimizer and schedule, the prepared log-prob model, rollout engine, rewards and sampling stream;
        ``reward_processing_classes``: TRL's tokenizers for reward models (see reward_models.RewardSet)."""
        args = self.args
        self.optimizer = build_optimizer(trainable_parameters(self.policy) + list(extra_parameters), args)
        self.sampler = make_prompt_sampler(self.train_dataset, seed=args.seed, shuffle=args.shuffle_dataset)
        self.max_steps = total_steps(args, None if is_stream(self.train_dataset) else len(self.train_dataset), self.plan)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(args, self.max_steps))
        self.logprob_model = CompletionLogprobs(self.policy, args.logprob_chunk_size, args.share_prompt_prefill)
        self.strategy.configure(self.policy, self.plan)
        if args.fused_lora and self.is_peft and self.strategy.may_fuse_lora():
            from grpo_ascend.models import lora_kernel

            logger.info("fused LoRA kernel on %d layers", lora_kernel.install(self.policy))
        self._unsharded_reference = self.strategy.unsharded_reference(
            self.policy, self.is_peft, wants_reference=getattr(args, "beta", 0.0) > 0)
        self.logprob_model, self.optimizer = self.strategy.prepare(self.logprob_model, self.optimizer, self.policy)
        self.engine = build_engine(self.policy, self.tokenizer, args, self.device)
        # Folding LoRA into the weights speeds up a backend that samples with the policy module itself.
        self.merge_lora_for_rollout = self.engine.backend.samples_policy_module and merge_lora_for_rollout(
            self.policy, args.rollout_merge_lora, self.strategy.may_merge_lora(args.rollout_merge_lora, self.is_peft),
            self.is_peft, self.device)
        self._auto_token_budget = self._plan_token_budget() if args.max_tokens_per_micro_batch == "auto" else None
        self.rewards = build_rewards(reward_funcs, args, self.device, self.tokenizer, reward_processing_classes)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed + 1000 * self.accelerator.process_index)
        self.step = 0
        self.round_index = 0
        self.skipped_steps = 0
        self._step_micro_batches = 0
        self._token_cost_shares_prompts: bool | None = None
        self._warned_over_budget = False
        self._last_saved_step = -1
        self.tracker: RunTracker | None = None
        self._init_surface(self._callbacks)

    # ------------------------------------------------------------------------------ setup
    @property
    def token_budget(self) -> int | None:
        """The training micro-batches' token budget: ``max_tokens_per_micro_batch``, 'auto' as resolved at start-up."""
        budget = self.args.max_tokens_per_micro_batch
        return self._auto_token_budget if budget == "auto" else budget

    def _plan_token_budget(self) -> int:
        """``max_tokens_per_micro_batch: auto``: the largest budget whose memory plan (docs/memory.md) fits
        AUTO_FRACTION of this device's memory (free + what this process holds), the smallest over ranks."""
        from grpo_ascend.models.policy import hf_model
        from grpo_ascend.planning.memory_plan import (
            AUTO_FRACTION,
            ModelShape,
            auto_token_budget,
            lora_targets,
            run_settings,
        )

        model = hf_model(self.policy)
        lora = self.policy.peft_config[self.policy.active_adapter] if self.is_peft else None
        settings = run_settings(
            self.args, dev.device_type(self.device), self.accelerator.num_processes,
            algorithm=self.algorithm, use_peft=self.is_peft,
            lora_r=lora.r if lora is not None else 0, lora_targets=lora_targets(lora.target_modules if lora else None),
            weight_bytes=next(model.parameters()).element_size(), precision=self.precision)
        settings = dataclasses.replace(settings, merge_lora=self.merge_lora_for_rollout)
        free, _ = dev.free_memory(self.device)
        capacity = int((free + dev.memory_stats(self.device)["allocated"]) * AUTO_FRACTION)
        budget = auto_token_budget(ModelShape.from_config(model.config.to_dict()), settings,
                                   self.strategy.memory_layout(), capacity)
        budget = int(-self.ranks.reduce(torch.tensor([-float(budget)], device=self.device), "max")[0])
        logger.info("max_tokens_per_micro_batch: auto -> %d tokens (memory plan within %.1f GiB)", budget, capacity / 2**30)
        return budget

    def _whole_weights(self) -> contextlib.AbstractContextManager:
        """The whole policy on every rank for one generation round (the strategy's; all ranks enter)."""
        return self.strategy.whole_weights(self.logprob_model)

    def _gathered_trainable(self, modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        """The trainable parameters whole on every rank inside the block (all ranks must enter)."""
        return self.strategy.gathered(trainable_parameters(self._trainable_module()), modifier_rank=modifier_rank)

    # ------------------------------------------------------------------------------ rollouts
    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def _autocast(self):
        return dev.autocast(self.device, self.precision)

    def _rollout_context(self) -> contextlib.AbstractContextManager:
        """Around generation: eval mode, autocast, the whole weights (sharded engines), LoRA folded in, the
        rollout backend serving the policy's current weights (rollout/backend.py: restore, sync, release)."""
        self.policy.eval()
        stack = contextlib.ExitStack()
        stack.enter_context(self._autocast())
        stack.enter_context(self._whole_weights())
        if self.merge_lora_for_rollout:
            stack.enter_context(lora_merged(self.policy))
        stack.enter_context(serving(self.engine.backend, lambda: PolicyWeights(self.policy, self.step)))
        return stack

    def _make_experience_maker(self, reference: bool, mask_truncated_completions: bool = False,
                               importance_sampling: ImportanceSamplingSettings | None = None) -> ExperienceMaker:
        """The round's experience pipeline over this trainer's sampler, engine, rewards and forwards."""
        args = self.args
        return ExperienceMaker(
            sampler=self.sampler, engine=self.engine, rewards=self.rewards, ranks=self.ranks,
            generator=self.generator, num_generations=args.num_generations,
            micro_batch=args.per_device_train_batch_size, pad_token_id=self.tokenizer.pad_token_id,
            rollout_context=self._rollout_context, policy_logprobs=self._policy_logprobs,
            reference_logprobs=self._reference_logprobs if reference else None,
            # the built-in engine's fp32 log-probs are the training forward's; an external sampler's are not
            exact_sampling_logps=self.precision == "fp32" and self.engine.backend.samples_policy_module,
            mask_truncated_completions=mask_truncated_completions,
            importance_sampling=importance_sampling,
        )

    def _trainer_state_for_rewards(self) -> dict[str, Any]:
        """``trainer_state`` as reward functions receive it."""
        return {"step": self.step, "epoch": self.sampler.epochs_done}

    def _policy_logprobs(self, *inputs: Tensor) -> Tensor:
        return self.logprob_model(*inputs, temperature=self.args.temperature)[0]

    def _setup_reference(self) -> None:
        """The reference policy: the base with adapters disabled (LoRA), else a frozen copy."""
        if self.is_peft:
            self.ref_logprob_model = None
        else:
            from grpo_ascend.models.policy import frozen_copy

            ref = self._unsharded_reference
            if ref is None:
                ref = frozen_copy(self.accelerator.unwrap_model(self.logprob_model).model)
            self.ref_logprob_model = CompletionLogprobs(
                ref, self.args.logprob_chunk_size, self.args.share_prompt_prefill
            ).to(self.device)

    def _reference_logprobs(self, *inputs: Tensor) -> Tensor:
        if self.ref_logprob_model is not None:
            with self._autocast():
                return self.ref_logprob_model(*inputs, temperature=self.args.temperature)[0]
        with adapters_disabled(self.policy):
            return self.logprob_model(*inputs, temperature=self.args.temperature)[0]

    # ------------------------------------------------------------------------------ loop
    def _train_round(self) -> None:
        """One generation round and the optimizer steps it feeds (the algorithm's own)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _train_round")

    def _step_rows(self, size: int) -> Iterator[Tensor]:
        """Rows of each optimizer step of a round of ``size`` rows: μ passes, each a fresh seeded shuffle.

        Stops at ``max_steps``. Resets the peak-memory counter before each step (see :meth:`_end_step`).
        """
        per_step = self.plan.micro_batch * self.plan.grad_accum
        for iteration in range(self.plan.num_iterations):
            order = self._shuffled_rows(size, iteration)
            for k in range(size // per_step):
                if self.step >= self.max_steps or self.control.should_training_stop:
                    return
                dev.reset_peak_memory(self.device)
                yield order[k * per_step : (k + 1) * per_step]

    def _micro_batches(self, rows: Tensor, exp: Experience) -> Iterator[tuple[Tensor, bool]]:
        """The step's micro-batches, each with whether it is the step's last (where gradients synchronise):
        ``per_device_train_batch_size`` rows each, or packed under ``max_tokens_per_micro_batch``."""
        if self.token_budget is None:
            parts = list(rows.split(self.args.per_device_train_batch_size))
        else:
            parts = self._token_budget_parts(rows, exp)
        self._step_micro_batches = len(parts)
        for i, part in enumerate(parts):
            yield part, i == len(parts) - 1

    def _token_budget_parts(self, rows: Tensor, exp: Experience) -> list[Tensor]:
        """``rows`` packed under the token budget (trainers/micro_batches.py), as many parts on every rank."""
        budget = self.token_budget
        mask = exp.completion_mask[rows].ne(0)
        width = mask.shape[1]
        lengths = (mask * torch.arange(1, width + 1, device=mask.device)).amax(1) if width else mask.sum(1)
        if self._token_cost_shares_prompts is None:
            backbone, _ = backbone_and_head(self.policy)
            self._token_cost_shares_prompts = self.args.share_prompt_prefill and not activation_checkpointing_on(backbone)
        cost = TokenCost(prompt_width=exp.prompt_ids.shape[1], completion_width=width,
                         share_prompts=self._token_cost_shares_prompts, length_bucket=dev.default_length_bucket(self.device))
        # Under a parameter-sharding strategy every rank's micro-batch runs at the widest over ranks.
        widest = bool(getattr(self.accelerator.unwrap_model(self.logprob_model), "fixed_calls", False))
        parts, host_lengths = plan_for_rank(lengths, exp.group_ids[rows], cost, budget, self.ranks, widest)
        over = [host_lengths[p[0]] for p in parts if len(p) == 1 and cost(1, 1, host_lengths[p[0]]) > budget]
        if over and not self._warned_over_budget:
            self._warned_over_budget = True
            logger.warning("max_tokens_per_micro_batch=%d is below what one row's forward costs (%d tokens: prompt width "
                           "%d + completion width %d); such rows get a micro-batch of their own (warned once)", budget,
                           cost(1, 1, over[0]), cost.prompt_width, cost.width(over[0]))
        order = torch.tensor([i for p in parts for i in p], device=rows.device)  # one copy to the device
        return list(rows[order].split([len(p) for p in parts]))

    def _no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """One micro-batch of ``model``: gradients are reduced over ranks only on the step's ``last``."""
        return self.strategy.no_sync(model, last)

    def _backward(self, loss: Tensor, model: nn.Module | None = None) -> None:
        """Backward of an already normalised micro-batch loss (see :meth:`_step_normaliser`) through
        ``model``'s engine (the log-prob model by default); the step is :meth:`_clip_and_step`'s."""
        self.strategy.backward(self.logprob_model if model is None else model, loss)

    def _step_normaliser(self, step_mask: Tensor, generation_tokens_global: Tensor) -> LossNormaliser:
        """The optimizer step's loss normaliser (token counts over all ranks; see algorithms/losses.py)."""
        return LossNormaliser.for_step(
            step_mask,
            generation_tokens_global=generation_tokens_global,
            steps_per_generation=self.plan.steps_per_generation // self.plan.grad_accum,
            world_size=self.accelerator.num_processes,
            step_tokens_global=self.ranks.reduce(step_mask.sum()),
        )

    @staticmethod
    def _accumulate(sums: dict[str, Tensor], values: dict[str, Tensor]) -> None:
        """Add detached micro-batch statistics into ``sums`` (kept on the device, no host sync)."""
        for k, v in values.items():
            sums[k] = sums[k] + v.detach() if k in sums else v.detach().clone()

    @staticmethod
    def _policy_metrics(totals: dict[str, float]) -> dict[str, float]:
        """Per-token averages of the policy-loss statistics summed over a step and all ranks."""
        n_tok = max(totals.get("token_count", 0.0), 1.0)
        return {
            "entropy": totals.get("entropy_sum", 0.0) / n_tok,
            "clip_ratio/low": totals.get("clipped_low", 0.0) / n_tok,
            "clip_ratio/high": totals.get("clipped_high", 0.0) / n_tok,
            "clip_ratio/region": totals.get("clipped_region", 0.0) / n_tok,
            "ratio/mean": totals.get("ratio_sum", 0.0) / n_tok,
        }

    def _clip_and_step(self, params: list[nn.Parameter], loss_finite: Tensor) -> tuple[float, bool]:
        """Clip, check for NaN/inf (all ranks agree), and step — or skip the step leaving the weights untouched."""
        grad_norm, stepped = self.strategy.clip_and_step(self.logprob_model, self.optimizer, params, loss_finite)
        if stepped:
            self.scheduler.step()
        else:
            self.skipped_steps += 1
            logger.warning("step %d: loss or gradient is NaN/inf; step skipped, weights untouched", self.step + 1)
        return grad_norm, stepped

    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:
        """Run until ``max_steps`` optimizer steps; resume from a checkpoint path, 'latest' or True.

        Returns transformers' ``TrainOutput(global_step, training_loss, metrics)``, whose metrics are also the
        last entry of ``state.log_history`` (trainers/trl_logs.py); the run summary written to summary.json is
        :attr:`run_summary`.
        """
        self._begin(resume_from_checkpoint)
        try:
            if self._evaluating() and self.args.eval_on_start and self.step == 0:
                self._evaluate_in_run()
            while self.step < self.max_steps and not self.control.should_training_stop:
                self._train_round()
                self.round_index += 1
                if self._should_evaluate():
                    self._evaluate_in_run()
                if self._should_save():
                    self._save()
            if self._evaluating() and self._last_eval_step != self.step:
                self._evaluate_in_run()  # the last weights are evaluated (and can be the best)
            if self._last_saved_step != self.step:
                self._save()
            self._load_best_at_end()
        except BaseException:
            assert self.tracker is not None
            self.tracker.abort()
            raise
        finally:
            self._release_rollout()
        return self._finish()

    def _release_rollout(self) -> None:
        """Stop what the rollout keeps running between rounds (the tool executor's threads), at the
        end of ``train`` whether it finished or failed; a later ``train``/``evaluate`` restarts it."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def _begin(self, resume_from_checkpoint: str | bool | None) -> None:
        """Resume if asked, prepare the output folder and the tracker."""
        from grpo_ascend.checkpoints import checkpoint as ckpt

        args = self.args
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        path = ckpt.resolve_checkpoint(resume, args.output_dir) if resume not in (None, False) else None
        if path is not None:
            self._load(path)
            self._restore_best()
        if self.is_main_process:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            truncate_metrics(args.output_dir, self.step)
            print(self.plan.describe() + f"; {self.max_steps} optimizer steps", flush=True)
        self.tracker = RunTracker(args.output_dir, self.max_steps, enabled=self.is_main_process,
                                  start_step=self.step, disable_tqdm=args.disable_tqdm,
                                  report_to=args.report_to, config=args.to_dict())
        self._first_reward: float | None = None
        self._last_record: dict[str, float] = {}
        self._peak_gb = 0.0
        self.state.global_step = self.step
        self._trl_log = TRLLogHistory(self.state, getattr(args, "loss_type", ""), getattr(args, "entropy_coef", 0.0),
                                      training_flops_per_token(self.policy), self.plan.completions_per_step)
        self._event("on_train_begin")

    def _shuffled_rows(self, n: int, iteration: int) -> Tensor:
        """Row order for one pass over a round: seeded by (seed, round, iteration), so resume is exact.

        When every optimizer step holds whole groups (its rows are a multiple of G), whole groups
        are shuffled and a group's rows stay adjacent: the log-prob forward then runs each prompt
        once per micro-batch (``share_prompt_prefill``). Otherwise single rows are shuffled.
        """
        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.round_index * 101 + iteration)
        G = self.args.num_generations
        if (self.plan.micro_batch * self.plan.grad_accum) % G == 0 and n % G == 0:
            groups = torch.randperm(n // G, generator=gen)
            order = (groups[:, None] * G + torch.arange(G)).reshape(-1)
        else:
            order = torch.randperm(n, generator=gen)
        return order.to(self.device)

    def _should_save(self) -> bool:
        every = self.args.save_steps
        if not every:
            return False
        # Saves happen at round boundaries (no half-used generation batch to persist); a save that
        # falls inside a round is taken at its end.
        return self.step // every > max(self._last_saved_step, 0) // every

    def _end_step(self, step_metrics: dict[str, float], log: RoundLog, exp: Experience, started: float) -> None:
        """Count the optimizer step just taken, log it and write sample completions when due."""
        args = self.args
        self.step += 1
        log.steps += 1
        train_time = time.perf_counter() - started
        step_peak = dev.memory_stats(self.device)["peak"] / 2**30
        self._peak_gb = max(self._peak_gb, step_peak, *log.timer.peak_gb.values())
        if self.token_budget is not None:
            step_metrics = {**step_metrics, "micro_batches": float(self._step_micro_batches)}
        if log.steps == 1:
            self._trl_log.add_round(log.metrics, exp, self.ranks)
        self._trl_log.add_step({**step_metrics, "learning_rate": self.scheduler.get_last_lr()[0],
                                "time/step": train_time + (log.prep_seconds if log.steps == 1 else 0.0)})
        if self.step % args.logging_steps == 0 or self.step == self.max_steps:
            self._log_step(step_metrics, log, train_time, step_peak)
        assert self.tracker is not None
        self.tracker.advance()
        if args.log_completions_steps and self.step % args.log_completions_steps == 0:
            self.tracker.log_samples(self.step, exp.samples(args.num_completions_to_print))
        self._event("on_step_end")

    def _log_step(self, step_metrics: dict[str, float], log: RoundLog, train_time: float, step_peak: float) -> None:
        """One metrics.jsonl record; the round's phases are charged to its first step (zeros after)."""
        first = log.steps == 1
        prep = log.prep_seconds if first else 0.0
        phases = {k: (v if first else 0.0) for k, v in log.timer.metrics().items()}
        record = {
            **step_metrics,
            **log.metrics,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "epoch": self.sampler.epochs_done,
            "skipped_steps": float(self.skipped_steps),
            **phases,
            "time/training": train_time,
            "time/step": train_time + prep,
            "tokens_per_second": log.metrics.get("tokens_generated", 0.0) / max(prep, 1e-9) if first else 0.0,
            "memory/peak_gb": self._peak_gb,
            "memory/peak_gb/training": step_peak,
            "memory/allocated_gb": dev.memory_stats(self.device)["allocated"] / 2**30,
        }
        assert self.tracker is not None
        self.tracker.log(self.step, record)
        if self.step % self.args.logging_steps == 0:  # TRL's entries; a last step off them waits for the summary
            self._log({**record, **self._trl_log.flush()})
        if self._first_reward is None:
            self._first_reward = record.get("reward")
        self._last_record = record

    def _log(self, logs: dict[str, Any]) -> None:
        """One ``state.log_history`` entry and its ``on_log`` event (transformers' ``Trainer.log``)."""
        self.state.log_history.append({**logs, "step": self.step})
        self._event("on_log", logs=logs)

    def _finish(self) -> Any:
        from transformers.trainer_utils import TrainOutput

        args = self.args
        export_dir = None
        if args.export_adapter_at_end:
            from grpo_ascend.checkpoints.export import export_checkpoint

            source = self.strategy.export_source(self.policy, Path(args.output_dir) / f"checkpoint-{self.step}")
            with self._gathered_trainable():  # every rank gathers (if partitioned), the main rank writes
                if self.is_main_process:
                    export_dir = str(export_checkpoint(source, Path(args.output_dir) / "adapter",
                                                       tokenizer=self.tokenizer, base_model=self.model_name))
        self.accelerator.wait_for_everyone()
        assert self.tracker is not None
        summary = {
            "steps": self.step,
            "reward_first": self._first_reward,
            "reward_last": self._last_record.get("reward"),
            "skipped_steps": self.skipped_steps,
            "peak_memory_gb": round(self._peak_gb, 3),
            "output_dir": args.output_dir,
        }
        if export_dir:
            summary["adapter"] = export_dir
        self.run_summary = self.tracker.close(summary)
        train_loss, metrics = self._trl_log.summary()
        metrics["epoch"] = self.sampler.epochs_done
        self._log(metrics)
        self._event("on_train_end")
        return TrainOutput(self.step, train_loss, metrics)
