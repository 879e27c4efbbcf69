"""The parts a trainer is built from, each made by one function: policy, optimizer, schedule,
rollout engine, rewards. A trainer's constructor calls them in order, so the order is visible."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from grpo_ascend import device as dev
from grpo_ascend.config.configs import BaseRLConfig, BatchPlan
from grpo_ascend.data.prompts import is_stream
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import (
    apply_peft,
    cast_head_to_fp32,
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    lora_merge_bytes,
)
from grpo_ascend.rollout.backend import build_backend
from grpo_ascend.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)


def build_policy(model: str | nn.Module, processing_class: Any, peft_config: Any, args: BaseRLConfig,
                 device: torch.device) -> tuple[nn.Module, Any]:
    """The policy (LoRA-wrapped when ``peft_config`` is given) on ``device``, and its tokenizer.

    Fused device kernels are chosen after placement: they depend on the device the model runs on.
    """
    from grpo_ascend.device.npu_patches import apply_npu_patches

    if args.model_init_kwargs and not isinstance(model, str):
        logger.warning("model_init_kwargs are ignored: the model was passed already loaded")
    policy = load_causal_lm(model, init_kwargs=args.model_init_kwargs)
    tokenizer = load_tokenizer(model if isinstance(model, str) else policy, processing_class, args.model_init_kwargs)
    if getattr(args, "cast_lm_head_to_fp32", False):
        cast_head_to_fp32(policy)  # before the adapter: TRL refuses an adapter on the head
    policy = apply_peft(policy, peft_config)
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
    trainable, total = count_parameters(policy)
    if trainable == 0:
        raise ConfigError("the model has no trainable parameters; pass a peft_config or a trainable model")
    logger.info("parameters: %d trainable of %d (%.2f%%)", trainable, total, 100 * trainable / total)
    return policy, tokenizer


def build_optimizer(params: Sequence[nn.Parameter], args: BaseRLConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` with the run's hyper-parameters."""
    return torch.optim.AdamW(list(params), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def check_streamed_steps(args: BaseRLConfig, train_dataset: Any) -> None:
    """A streamed train set (no length) needs ``max_steps``, as in transformers: refused before loading anything."""
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


def build_engine(policy: nn.Module, tokenizer: Any, args: BaseRLConfig, device: torch.device) -> Any:
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
    from reward_models import RewardSet

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
