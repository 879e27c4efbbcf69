"""The parts a trainer is built from, each made by one function: policy, optimizer, schedule,
rollout engine, rewards. A trainer's constructor calls them in order, so the order is visible."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_ascend import device as dev
from grpo_ascend.config.configs import BaseRLConfig, BatchPlan
from grpo_ascend.config.loader_settings import apply_stream_rules
from grpo_ascend.data.prompts import is_stream
from grpo_ascend.device.npu_patches import apply_npu_patches
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.lora_merge import lora_merge_bytes
from grpo_ascend.models.parameters import cast_head_to_fp32, count_parameters, frozen_copy
from grpo_ascend.models.policy import (
    CompletionLogprobs,
    activation_checkpointing_on,
    apply_peft,
    backbone_and_head,
    hf_model,
    is_peft,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from grpo_ascend.models.vision_language import (
    check_vision_parts,
    freeze_vision,
    is_vision_language,
    load_processor,
    takes_processor_images,
    trains_whole_model,
)
from grpo_ascend.planning.memory_plan import (
    AUTO_FRACTION,
    auto_token_budget,
    lora_targets,
    run_settings,
    shape_of_config,
)
from grpo_ascend.rollout.backend import build_backend
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.trainers.micro_batches import MicroBatcher
from reward_models import RewardSet

logger = logging.getLogger(__name__)


def build_policy(model: str | nn.Module, processing_class: Any, peft_config: Any, args: BaseRLConfig,
                 device: torch.device, parameter_numel: Callable[[nn.Parameter], int] = torch.numel,
                 ) -> tuple[nn.Module, Any]:
    """The policy (LoRA-wrapped when ``peft_config`` is given) on ``device``, and its tokenizer.

    Fused device kernels are chosen after placement: they depend on the device the model runs on.
    ``parameter_numel``: a parameter's whole size (the strategy's; for the parameter count logged).
    """

    if args.model_init_kwargs and not isinstance(model, str):
        logger.warning("model_init_kwargs are ignored: the model was passed already loaded")
    policy = load_causal_lm(model, init_kwargs=args.model_init_kwargs)
    tokenizer = load_tokenizer(model if isinstance(model, str) else policy, processing_class, args.model_init_kwargs)
    chosen = check_vision_parts(args.train_vision_parts)
    if chosen and not is_vision_language(policy.config):
        raise ConfigError(f"train_vision_parts={list(chosen)} but {type(policy).__name__} has no vision parts; "
                          "leave it empty for a text model")
    vision_parts = chosen or ()  # null (TRL's choice) under LoRA: the language model's adapters only
    if peft_config is None and is_vision_language(policy.config):
        if trains_whole_model(chosen, lora=False):  # as TRL's GRPOTrainer
            logger.info("vision-language model: every part trains (train_vision_parts null, TRL's choice)")
        else:
            logger.info("vision-language model: %d vision tensors frozen", freeze_vision(policy, vision_parts))
    if getattr(args, "cast_lm_head_to_fp32", False):
        cast_head_to_fp32(policy)  # before the adapter: TRL refuses an adapter on the head
    policy = apply_peft(policy, peft_config, vision_parts)
    if args.disable_dropout:
        for module in policy.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    if args.gradient_checkpointing:
        if hasattr(policy, "activation_checkpointing_enable"):  # the name since transformers 5
            policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.config.use_cache = False
    policy = policy.to(device)
    apply_npu_patches(policy, device=device)
    trainable, total = count_parameters(policy, parameter_numel)
    if trainable == 0:
        raise ConfigError("the model has no trainable parameters; pass a peft_config or a trainable model")
    logger.info("parameters: %d trainable of %d (%.2f%%)", trainable, total, 100 * trainable / total)
    return policy, tokenizer


def policy_processor(model: str | nn.Module, policy: nn.Module, processing_class: Any) -> Any:
    """The processor a vision-language ``policy`` samples and trains with (None for a text model):
    ``processing_class`` when it is one, else the one saved with the model."""
    if not is_vision_language(getattr(policy, "config", None)):
        return None
    if takes_processor_images(processing_class):
        return processing_class
    if processing_class is not None:
        raise ConfigError(f"{type(policy).__name__} is a vision-language model but processing_class is a "
                          f"{type(processing_class).__name__}, which takes no images; pass the model's processor "
                          "(AutoProcessor.from_pretrained(...)) or leave processing_class out")
    source = model if isinstance(model, str) else getattr(policy.config, "_name_or_path", None)
    if not source:
        raise ConfigError("pass processing_class=<the model's processor>: the vision-language model was given as an "
                          "object without a path")
    return load_processor(resolve_model_path(source))


def build_optimizer(params: Sequence[nn.Parameter], args: BaseRLConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` with the run's hyper-parameters."""
    return torch.optim.AdamW(list(params), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def check_streamed_steps(args: BaseRLConfig, train_dataset: Any, eval_dataset: Any = None) -> None:
    """A streamed train set (no length) needs ``max_steps``, as in transformers, and TRL's data-loading rules apply
    to streams (config/loader_settings.py): refused or adjusted before loading anything."""
    apply_stream_rules(args, train_dataset, eval_dataset)
    if is_stream(train_dataset) and args.max_steps <= 0:
        raise ConfigError(
            f"train_dataset is a stream ({type(train_dataset).__name__}, no length), so num_train_epochs cannot "
            f"give the number of steps; set max_steps > 0 (got max_steps={args.max_steps})"
        )


def total_steps(args: BaseRLConfig, dataset_size: int | None, plan: BatchPlan) -> int:
    """``max_steps``, or the optimizer steps of ``num_train_epochs`` passes over the prompts (``dataset_size``
    None: a stream, for which :func:`check_streamed_steps` requires ``max_steps``)."""
    if args.max_steps > 0:
        return args.max_steps
    if dataset_size is None:
        raise ConfigError(f"a streamed train set needs max_steps > 0 (got max_steps={args.max_steps})")
    rounds = math.ceil(args.num_train_epochs * dataset_size / plan.prompts_per_round)
    return max(1, rounds * plan.optimizer_steps_per_round)


def lr_factor(args: BaseRLConfig, total: int) -> Callable[[int], float]:
    """Learning-rate multiplier per step: linear warm-up, then constant, linear or cosine decay."""
    warmup = args.warmup_steps if args.warmup_steps > 0 else math.ceil(args.warmup_ratio * total)
    kind = args.lr_scheduler_type

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_rollout_backend(policy: nn.Module, tokenizer: Any, args: BaseRLConfig, device: torch.device) -> Any:
    """The rollout backend ``args.rollout_backend`` over ``policy`` with the run's sampling settings
    (length bucket per device)."""
    bucket = args.length_bucket if args.length_bucket is not None else dev.default_length_bucket(device)
    sampling = SamplingParams(
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop_strings=list(args.stop_strings),
        max_prompt_length=args.max_prompt_length,
        prompt_truncation=args.prompt_truncation,
        length_bucket=bucket,
        compile_decode=args.compile_decode,
        shared_prefix=args.shared_prefix_decode,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    return build_backend(args.rollout_backend, policy, tokenizer, sampling, args)


def build_rewards(reward_funcs: Any, args: BaseRLConfig, device: torch.device, tokenizer: Any,
                  reward_processing_classes: Any = None) -> Any:
    """The reward functions with their weights, error policy and timeout (and reward models' own tokenizers)."""
    return RewardSet(reward_funcs, reward_weights=args.reward_weights, reward_errors=args.reward_errors,
                     reward_timeout=args.reward_timeout, device=device, processing_class=tokenizer,
                     reward_processing_classes=reward_processing_classes)


def merge_lora_for_rollout(policy: nn.Module, wanted: bool | None, strategy_allows: bool, is_peft: bool,
                           device: torch.device) -> bool:
    """Whether rollouts run with LoRA folded into the weights (``rollout_merge_lora``; None = if it fits)."""
    if not strategy_allows:
        return False
    extra = lora_merge_bytes(policy)
    if wanted is False or extra is None:
        if wanted and is_peft:
            logger.warning("rollout_merge_lora: these adapters can't be folded into the weights "
                           "(a LoRA variant or non-linear layer); generating with the adapters unmerged")
        return False
    if wanted is None:
        free, _ = dev.free_memory(device)
        if not free or extra > free // 4:
            logger.info("rollouts keep LoRA unmerged: a merged copy needs %.1f GiB, free memory is %.1f GiB",
                        extra / 2**30, free / 2**30)
            return False
    return True


def build_micro_batcher(policy: nn.Module, args: BaseRLConfig, plan: BatchPlan, algorithm: str, strategy: Any,
                        ranks: Any, precision: str, merge_lora: bool) -> MicroBatcher:
    """What cuts each optimizer step into micro-batches: the plan's rows, or its token budget ('auto' planned
    now, see :func:`plan_token_budget`); the strategy says whether ranks run at the widest over ranks."""
    budget = plan.max_tokens_per_micro_batch
    if budget == "auto":
        budget = plan_token_budget(policy, args, algorithm, strategy, ranks, precision, merge_lora)
    backbone, _ = backbone_and_head(policy)
    return MicroBatcher(plan.micro_batch, budget, ranks, dev.default_length_bucket(strategy.device),
                        shares_prompts=args.share_prompt_prefill and not activation_checkpointing_on(backbone),
                        widest_over_ranks=strategy.fixed_calls)


def training_activation_bytes(policy: nn.Module, args: BaseRLConfig, plan: BatchPlan, precision: str) -> int:
    """The largest activation one decoder layer makes in a training micro-batch: its completion tokens (the token
    budget, or micro-batch rows × ``max_completion_length``) × the MLP's width × the activation's bytes. The
    device layer keeps tensors of that size in the CPU heap (``dev.tune_host_allocator``)."""
    config = hf_model(policy).config.get_text_config(decoder=True)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    width = max(int(getattr(config, "intermediate_size", 0) or 0), hidden)
    budget = plan.max_tokens_per_micro_batch
    tokens = budget if isinstance(budget, int) else plan.micro_batch * args.max_completion_length
    element = 2 if precision in ("bf16", "fp16") else next(policy.parameters()).element_size()
    return tokens * width * element


def build_reference(logprob_model: nn.Module, unsharded: nn.Module | None, args: BaseRLConfig, accelerator: Any,
                    policy_is_peft: bool) -> CompletionLogprobs | None:
    """The reference policy's log-prob model: None for LoRA (the base with adapters disabled is the
    reference), else a frozen copy (the strategy's ``unsharded`` one when it shards the policy)."""
    if policy_is_peft:
        return None
    ref = unsharded if unsharded is not None else frozen_copy(accelerator.unwrap_model(logprob_model).model)
    return CompletionLogprobs(ref, args.logprob_chunk_size, args.share_prompt_prefill).to(accelerator.device)


def plan_token_budget(policy: nn.Module, args: BaseRLConfig, algorithm: str, strategy: Any, ranks: Any,
                      precision: str, merge_lora: bool) -> int:
    """``max_tokens_per_micro_batch: auto``: the largest budget whose memory plan (docs/memory.md) fits
    AUTO_FRACTION of this device's memory (free + what this process holds), the smallest over ranks."""
    device = strategy.device
    model = hf_model(policy)
    peft = is_peft(policy)
    lora = policy.peft_config[policy.active_adapter] if peft else None
    settings = run_settings(
        args, dev.device_type(device), strategy.world_size,
        algorithm=algorithm, use_peft=peft,
        lora_r=lora.r if lora is not None else 0, lora_targets=lora_targets(lora.target_modules if lora else None),
        weight_bytes=next(model.parameters()).element_size(), precision=precision)
    settings = dataclasses.replace(settings, merge_lora=merge_lora)
    free, _ = dev.free_memory(device)
    capacity = int((free + dev.memory_stats(device)["allocated"]) * AUTO_FRACTION)
    folder = Path(model.config.name_or_path)  # a local model's processor settings size its images
    shape = shape_of_config(model.config.to_dict(), type(model).__name__, folder if folder.is_dir() else None)
    if shape.vision is not None:  # one image per prompt; its tokens are within max_prompt_length
        settings = dataclasses.replace(settings, images_per_prompt=1)
    budget = auto_token_budget(shape, settings, strategy.memory_layout(), capacity)
    budget = int(-ranks.reduce(torch.tensor([-float(budget)], device=device), "max")[0])
    logger.info("max_tokens_per_micro_batch: auto -> %d tokens (memory plan within %.1f GiB)", budget, capacity / 2**30)
    return budget
