"""What the GRPO and PPO trainers share: setup on accelerate, the experience pipeline, optimizer and
schedule, and the run loop; the trainer's parts do the rest.

A subclass implements :meth:`RLTrainerBase.train_round`: one generation round (an
:class:`~grpo_ascend.experience.Experience`) and the optimizer steps it feeds. ``train()`` runs
:meth:`~RLTrainerBase.begin_run`, rounds until ``max_steps`` with evaluations and checkpoints
(:meth:`~RLTrainerBase.save_checkpoint`) in between, and the end of the run; a caller may drive the
rounds itself (benchmarks, profilers) with ``begin_run`` and ``train_round``.

The parts the trainer holds, each made with what it uses (:meth:`RLTrainerBase._build_parts`):

- ``run`` (trainers/run_state.py): the counters and records the parts share (step, round, best, ...);
- ``micro_batcher`` (trainers/micro_batches.py): each optimizer step's rows into micro-batches;
- ``checkpointer`` (trainers/checkpointing.py): save and exact resume;
- ``best`` (trainers/best_tracking.py): the best checkpoint and the ``best`` pointer;
- ``evaluator`` (trainers/evaluating.py): ``evaluate()``'s metrics and when evaluation is due;
- ``events`` (trainers/surface.py): TRL's ``state``, ``control``, callbacks and ``log_history``;
- ``publisher`` (trainers/publishing.py): ``save_model``, the end-of-run export and the Hub;
- ``recorder`` (trainers/run_recording.py): metrics.jsonl, the trackers, TRL's log entries, the summary.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.algorithms.importance_sampling import ImportanceSamplingSettings
from grpo_ascend.algorithms.losses import LossNormaliser
from grpo_ascend.checkpoints.checkpoint import resolve_checkpoint
from grpo_ascend.config.configs import BaseRLConfig, BatchPlan
from grpo_ascend.data.prompts import is_stream, make_prompt_sampler
from grpo_ascend.distributed.launch import make_accelerator, select_strategy
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.errors import ConfigError
from grpo_ascend.experience import Experience, ExperienceMaker
from grpo_ascend.models.lora_merge import lora_merged
from grpo_ascend.models.parameters import adapters_disabled, trainable_parameters
from grpo_ascend.models.policy import CompletionLogprobs, is_peft
from grpo_ascend.models.router_aux import RouterAux
from grpo_ascend.producers.factory import build_source
from grpo_ascend.producers.lockstep import SourceParts
from grpo_ascend.rollout.backend import serving
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.protocol import PromptRollout, Rollout
from grpo_ascend.trainers.best_tracking import BestCheckpointTracker
from grpo_ascend.trainers.checkpoint_api import TrainerCheckpoints
from grpo_ascend.trainers.checkpointing import Checkpointer
from grpo_ascend.trainers.components import (
    build_micro_batcher,
    build_optimizer,
    build_policy,
    build_reference,
    build_rewards,
    build_rollout_backend,
    check_streamed_steps,
    lr_factor,
    merge_lora_for_rollout,
    policy_processor,
    total_steps,
    training_activation_bytes,
)
from grpo_ascend.trainers.evaluating import EvalLoss, EvalSets, Evaluator
from grpo_ascend.trainers.micro_batches import round_row_order
from grpo_ascend.trainers.public_api import TrainerPublicAPI
from grpo_ascend.trainers.publishing import ModelPublisher
from grpo_ascend.trainers.run_recording import RoundLog, RunRecorder
from grpo_ascend.trainers.run_state import RunState
from grpo_ascend.trainers.surface import EventHub
from grpo_ascend.vision.images import check_images_usable

logger = logging.getLogger(__name__)


class RLTrainerBase(TrainerCheckpoints, TrainerPublicAPI):
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
        require_prompt: bool = True,
    ):
        """The run and its policy: accelerator, distributed strategy, batch plan, policy and tokenizer.

        A subclass then builds what the policy trains with (:meth:`_build_training`), adding its
        own parts in between (PPO: the critic, whose parameters the optimizer also updates), and
        last the trainer's parts (:meth:`_build_parts`). ``require_prompt=False``: the datasets' rows
        may lack a ``prompt`` (environments supply it; see data/prompts.py's ``row_prompt``).
        """
        self.args = args if args is not None else self.config_class()
        if not isinstance(self.args, self.config_class):
            raise ConfigError(f"args must be a {self.config_class.__name__}, got {type(self.args).__name__}")
        if train_dataset is None:
            raise ConfigError("`train_dataset` is required: pass a datasets.Dataset with a 'prompt' column (GRPOTrainer: "
                              "or an environment_factory whose environments supply the prompts, with max_steps > 0)")
        args = self.args
        self.require_prompt = require_prompt
        self.eval_sets = EvalSets(eval_dataset, args, require_prompt)  # before loading anything: refuse eval settings without a dataset
        self.eval_dataset = eval_dataset
        check_streamed_steps(args, train_dataset, eval_dataset)
        dev.seed_everything(args.seed)
        self.accelerator, self.precision = make_accelerator(args)
        # Chosen once; refuses a launch its engine can't run. The trainer never asks which engine runs.
        self.strategy = select_strategy(self.accelerator, args, self.precision, type(self).__name__,
                                        self.prepared_models)
        self.device = self.accelerator.device
        self.ranks = Ranks(self.accelerator)
        self.plan: BatchPlan = args.batch_plan(self.accelerator.num_processes)
        self.model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        self.policy, self.tokenizer = build_policy(model, processing_class, peft_config, args, self.device,
                                                   self.strategy.parameter_numel)
        #: A vision-language policy's processor (prompts with images), None for a text model.
        self.processor = policy_processor(model, self.policy, processing_class)
        for dataset in (train_dataset, *self.eval_sets.datasets()):
            check_images_usable(dataset, self.processor is not None, self.model_name)
        self.is_peft = is_peft(self.policy)
        self.strategy.validate_model(self.is_peft)
        self.train_dataset = train_dataset
        self._callbacks = callbacks
        self.run = RunState()
        #: What summary.json holds after ``train()`` (steps, first/last reward, peak memory, ...); None before.
        self.run_summary: dict[str, Any] | None = None
        #: A Mixture-of-Experts policy's load-balancing loss added to the loss (set by GRPO, as TRL); None: none.
        self.router_aux: RouterAux | None = None

    def _build_training(self, reward_funcs: Any, extra_parameters: Sequence[nn.Parameter] = (),
                        reward_processing_classes: Any = None) -> None:
        """Optimizer and schedule, the prepared log-prob model (and the reference, when the algorithm's KL
        term is on), rollout engine, micro-batching, rewards and sampling stream; ``reward_processing_classes``:
        TRL's tokenizers for reward models (see reward_models.RewardSet)."""
        args, plan = self.args, self.plan
        self.optimizer = build_optimizer(trainable_parameters(self.policy) + list(extra_parameters), args)
        self.sampler = make_prompt_sampler(self.train_dataset, seed=args.seed, shuffle=args.shuffle_dataset,
                                           require_prompt=self.require_prompt)
        self.run.max_steps = total_steps(args, None if is_stream(self.train_dataset) else len(self.train_dataset), plan)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(args, self.max_steps))
        self.logprob_model = CompletionLogprobs(self.policy, args.logprob_chunk_size, args.share_prompt_prefill,
                                                self.router_aux)
        self.strategy.configure(self.policy, plan)
        if args.fused_lora and self.is_peft and self.strategy.may_fuse_lora():
            # Imported here: the kernel subclasses peft's LoRA layer when imported (peft loads only when used).
            from grpo_ascend.models import lora_kernel

            logger.info("fused LoRA kernel on %d layers", lora_kernel.install(self.policy))
        unsharded_reference = self.strategy.unsharded_reference(
            self.policy, self.is_peft, wants_reference=args.needs_reference_model)
        self.logprob_model, self.optimizer = self.strategy.prepare(self.logprob_model, self.optimizer, self.policy)
        #: What the trainer samples through (rollout/protocol.py); GRPO may wrap it in a tool loop or a rollout_func.
        self.rollout: Rollout = PromptRollout(build_rollout_backend(self.policy, self.tokenizer, args, self.device),
                                              processor=self.processor)
        self.rollout.backend.set_training_rank(self.accelerator.process_index)
        # Folding LoRA into the weights speeds up a backend that samples with the policy module itself.
        self.merge_lora_for_rollout = self.rollout.backend.samples_policy_module and merge_lora_for_rollout(
            self.policy, args.rollout_merge_lora, self.strategy.may_merge_lora(args.rollout_merge_lora, self.is_peft),
            self.is_peft, self.device)
        self.micro_batcher = build_micro_batcher(self.policy, args, plan, self.algorithm, self.strategy, self.ranks,
                                                 self.precision, self.merge_lora_for_rollout)
        # The CPU heap keeps tensors as large as a training micro-batch's activations (device/host_allocator.py).
        dev.tune_host_allocator(self.device, tensor_bytes=training_activation_bytes(self.policy, args, plan,
                                                                                    self.precision))
        self.rewards = build_rewards(reward_funcs, args, self.device, self.tokenizer, reward_processing_classes)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed + 1000 * self.accelerator.process_index)
        #: The reference policy's log-prob model; None: none, or the base with adapters disabled (LoRA).
        self.ref_logprob_model = build_reference(self.logprob_model, unsharded_reference, args, self.accelerator,
                                                 self.is_peft) if args.needs_reference_model else None

    def _build_parts(self) -> None:
        """The trainer's parts (see the module docstring), made last: they take the run's final rollout
        (tools, a ``rollout_func``) and the module a checkpoint holds."""
        args, run = self.args, self.run
        self.best = BestCheckpointTracker(args, run, self.is_main_process)
        self.checkpointer = Checkpointer(
            args=args, accelerator=self.accelerator, strategy=self.strategy, run=run, module=self._trainable_module(),
            optimizer=self.optimizer, scheduler=self.scheduler, sampler=self.sampler, generator=self.generator,
            tokenizer=self.processing_class, model_name=self.model_name, best=self.best)
        self.evaluator = Evaluator(
            args=args, sets=self.eval_sets, run=run, rollout=self.rollout, rewards=self.rewards, ranks=self.ranks,
            device=self.device, policy=self.policy, rollout_context=self._rollout_context,
            reward_state=self._trainer_state_for_rewards, eval_loss=self._eval_loss())
        self.events = EventHub(
            args=args, accelerator=self.accelerator, callbacks=self._callbacks, run=run, sampler=self.sampler,
            objects={"model": self.policy, "processing_class": self.processing_class, "optimizer": self.optimizer,
                     "lr_scheduler": self.scheduler})
        self.publisher = ModelPublisher(
            args=args, accelerator=self.accelerator, strategy=self.strategy, run=run, policy=self.policy,
            tokenizer=self.processing_class, model_name=self.model_name, is_peft=self.is_peft,
            gathered=self.checkpointer.gathered)
        self.recorder = RunRecorder(
            args=args, plan=self.plan, run=run, events=self.events, ranks=self.ranks, device=self.device,
            scheduler=self.scheduler, sampler=self.sampler, policy=self.policy, is_main_process=self.is_main_process)

    def _eval_loss(self) -> EvalLoss | None:
        """Subclass hook: the algorithm's evaluation loss (trainers/evaluating.py's EvalLoss); None: none."""
        return None

    def _trainable_module(self) -> nn.Module:
        """What a checkpoint holds: the policy (PPO adds its critic)."""
        return self.policy

    def _gathered_trainable(self, modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        """The trainable parameters whole on every rank inside the block (all ranks must enter)."""
        return self.checkpointer.gathered(modifier_rank)

    # ------------------------------------------------------------------------------ rollouts
    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def _autocast(self):
        return dev.autocast(self.device, self.precision)

    def _rollout_context(self) -> contextlib.AbstractContextManager:
        """Around generation: eval mode, autocast, the whole weights (sharded engines) where the backend reads the
        policy module, LoRA folded in where it samples with it, the rollout backend serving the policy's current weights
        (rollout/backend.py: restore, sync, release)."""
        self.policy.eval()
        stack = contextlib.ExitStack()
        stack.enter_context(self._autocast())
        if not self.rollout.backend.streams_weights:
            stack.enter_context(self.strategy.whole_weights(self.logprob_model))
        if self.merge_lora_for_rollout:
            stack.enter_context(lora_merged(self.policy, rows=self.plan.prompts_per_rank * self.plan.num_generations))
        stack.enter_context(serving(self.rollout.backend, lambda: self._policy_weights(self.step)))
        return stack

    def _policy_weights(self, step: int) -> PolicyWeights:
        """Version ``step`` of the policy for the rollout backend: as it stands (whole, inside the rollout context)
        for a backend reading the policy module; streamed whole one tensor at a time through the strategy (every
        rank in lockstep, rank 0 sending) for one that reads only the named tensors (a server's own copy)."""
        if not self.rollout.backend.streams_weights:
            return PolicyWeights(self.policy, step)
        return PolicyWeights(self.policy, step, whole=self.strategy, sends=self.is_main_process)

    def _make_experience_maker(self, mask_truncated_completions: bool = False,
                               importance_sampling: ImportanceSamplingSettings | None = None) -> ExperienceMaker:
        """The round's experience pipeline over this trainer's sampler, rollout, rewards and forwards."""
        args = self.args
        parts = SourceParts(sampler=self.sampler, rollout=self.rollout, rewards=self.rewards, ranks=self.ranks,
                            generator=self.generator, mask_truncated_completions=mask_truncated_completions)
        source = build_source(args, self.plan, self._push_weights, parts, self._rollout_context)
        return ExperienceMaker(
            source=source, micro_batch=self.plan.micro_batch, policy_logprobs=self._policy_logprobs,
            reference_logprobs=self._reference_logprobs if args.needs_reference_model else None,
            # the built-in engine's fp32 log-probs are the training forward's; an external sampler's are not
            exact_sampling_logps=self.precision == "fp32" and self.rollout.samples_policy_module,
            importance_sampling=importance_sampling,
        )

    def _push_weights(self, step: int) -> None:
        """The policy's weights to the rollout's sampler as version ``step`` (every rank together), for a producer
        sampling ahead: the trainer goes on while the sampler loads them."""
        weights = self._policy_weights(step)
        if weights.whole is None:
            with self.strategy.whole_weights(self.logprob_model):
                self.rollout.backend.publish_weights(weights)
            return
        self.rollout.backend.publish_weights(weights)
        weights.complete()

    def _trainer_state_for_rewards(self) -> dict[str, Any]:
        """``trainer_state`` as reward functions receive it."""
        return {"step": self.step, "epoch": self.sampler.epochs_done}

    def _policy_logprobs(self, *inputs: Tensor) -> Tensor:
        return self.logprob_model(*inputs, temperature=self.args.temperature)[0]

    def _reference_logprobs(self, *inputs: Tensor) -> Tensor:
        if self.ref_logprob_model is not None:
            with self._autocast():
                return self.ref_logprob_model(*inputs, temperature=self.args.temperature)[0]
        with adapters_disabled(self.policy):
            return self.logprob_model(*inputs, temperature=self.args.temperature)[0]

    # ------------------------------------------------------------------------------ loop
    def train_round(self) -> None:
        """One generation round and the optimizer steps it feeds (the algorithm's own), up to ``max_steps``.

        ``train()`` calls it round after round; a caller driving the run itself opens it first with
        :meth:`begin_run`. A subclass may wrap it (to time or profile a round)."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_round")

    def _shuffled_rows(self, n: int, iteration: int) -> Tensor:
        """Row order for one pass over this round's ``n`` rows (seeded; see micro_batches.round_row_order)."""
        return round_row_order(n, self.plan, self.args.seed, self.run.round_index, iteration, self.device)

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
        parts = self.micro_batcher.split(rows, exp.completion_mask, exp.prompt_ids.shape[1], exp.group_ids)
        for i, part in enumerate(parts):
            yield part, i == len(parts) - 1

    def _no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """One micro-batch of ``model``: gradients are reduced over ranks only on the step's ``last``."""
        return self.strategy.no_sync(model, last)

    def _backward(self, loss: Tensor, model: nn.Module | None = None) -> None:
        """Backward of an already normalised micro-batch loss (see :meth:`_step_normaliser`) through
        ``model``'s engine (the log-prob model by default); the step is :meth:`clip_and_step`'s."""
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

    def clip_and_step(self, params: list[nn.Parameter], loss_finite: Tensor) -> tuple[float, bool]:
        """Clip, check for NaN/inf (all ranks agree), and step — or skip the step leaving the weights untouched;
        returns (the gradient norm before clipping, whether the step was taken).

        The train loop calls it once per optimizer step with the step's gradients of ``params`` in place, so
        a subclass (or a wrapper on an instance) may read them first."""
        grad_norm, stepped = self.strategy.clip_and_step(self.logprob_model, self.optimizer, params, loss_finite)
        if stepped:
            self.scheduler.step()
        else:
            self.run.skipped_steps += 1
            logger.warning("step %d: loss or gradient is NaN/inf; step skipped, weights untouched", self.step + 1)
        return grad_norm, stepped

    # ------------------------------------------------------------------------------ the run
    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:
        """Run until ``max_steps`` optimizer steps; resume from a checkpoint path, 'latest' or True.

        Returns transformers' ``TrainOutput(global_step, training_loss, metrics)``, whose metrics are also the
        last entry of ``state.log_history`` (trainers/trl_logs.py); the run summary written to summary.json is
        :attr:`run_summary`.
        """
        run, evaluator = self.run, self.evaluator
        self.begin_run(resume_from_checkpoint)
        try:
            if evaluator.enabled and self.args.eval_on_start and run.step == 0:
                self._evaluate_in_run()
            self.experience.source.start(run.step, self._trainer_state_for_rewards)
            while run.step < self.max_steps and not self.control.should_training_stop:
                self.train_round()
                run.round_index += 1
                if evaluator.due():
                    self._evaluate_in_run()
                if self._should_save():
                    self.save_checkpoint()
            if evaluator.enabled and run.last_eval_step != run.step:
                self._evaluate_in_run()  # the last weights are evaluated (and can be the best)
            if run.last_saved_step != run.step:
                self.save_checkpoint()
            if self.args.load_best_model_at_end:
                self.load_best_model()
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
        self.experience.source.close()
        self.rollout.close()

    def begin_run(self, resume_from_checkpoint: str | bool | None = None) -> None:
        """Open the run without training: resume from a checkpoint if asked (a path, 'latest' or True; None:
        ``args.resume_from_checkpoint``), open its records (metrics.jsonl, the trackers), fire ``on_train_begin``.
        ``train()`` starts with it; then :meth:`train_round` runs the rounds."""
        args = self.args
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        path = resolve_checkpoint(resume, args.output_dir) if resume not in (None, False) else None
        if path is not None:
            self.load_checkpoint(path)
            self.best.restore()
        self.recorder.begin()
        self.events.fire("on_train_begin")

    def _should_save(self) -> bool:
        every = self.args.save_steps
        if not every:
            return False
        # Saves happen at round boundaries (no half-used generation batch to persist); a save that
        # falls inside a round is taken at its end.
        return self.step // every > max(self.run.last_saved_step, 0) // every

    # ------------------------------------------------------------------------------ logging
    def _end_step(self, step_metrics: dict[str, float], log: RoundLog, exp: Experience, started: float,
                  micro_batches: int) -> None:
        """Count the optimizer step just taken (``micro_batches``: its micro-batches), record it
        (trainers/run_recording.py), fire ``on_step_end``."""
        self.run.step += 1
        self.run.step_micro_batches = micro_batches
        self.experience.source.policy_updated(self.run.step)
        micro_batches = micro_batches if self.token_budget is not None else None
        self.recorder.step(step_metrics, log, exp, started, micro_batches)
        self.events.fire("on_step_end")

    def _finish(self) -> Any:
        """Export the adapter (``export_adapter_at_end``), close the run's records; transformers' TrainOutput."""
        args = self.args
        export_dir = self.publisher.export_adapter(Path(args.output_dir) / "adapter") if args.export_adapter_at_end else None
        self.accelerator.wait_for_everyone()
        self.run_summary, output = self.recorder.finish(export_dir)
        self.events.fire("on_train_end")
        return output
