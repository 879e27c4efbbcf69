"""The memory a run needs on each device, per phase of a round, from shapes alone (no weights loaded).

The public surface of the memory plan: the shape (:mod:`grpo_ascend.planning.shape`) and the terms
(:mod:`grpo_ascend.planning.terms`, :func:`plan_memory`) are re-exported here; this module adds what
reads a recipe into :class:`RunSettings` (:func:`settings_from_config`, :func:`run_settings`) and
what searches the plan: the largest micro-batch that fits (:func:`largest_fitting_rows`,
:func:`auto_token_budget` for ``max_tokens_per_micro_batch: auto``) and what to change when a run
does not fit (:func:`suggest`). docs/memory.md explains every term, its assumptions and how it
compares with measurement.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from grpo_ascend import device as dev
from grpo_ascend.distributed.memory_layout import MemoryLayout, sharding_alternatives
from grpo_ascend.errors import ConfigError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.models.vision_language import check_vision_parts
from grpo_ascend.planning.shape import (
    LINEARS,
    MODEL_CONFIGS,
    ModelShape,
    dtype_bytes,
    load_model_shape,
    lora_targets,
    shape_of_config,
)
from grpo_ascend.planning.terms import (
    PHASES,
    GiB,
    MemoryPlan,
    RunSettings,
    Term,
    micro_batch_shape,
    plan_memory,
    rows_under_budget,
    tokens_of,
)
from grpo_ascend.weight_transfer.settings import rollout_process_transfer

__all__ = [
    "AUTO_FRACTION", "LINEARS", "MODEL_CONFIGS", "PHASES", "GiB", "MemoryPlan", "ModelShape", "RunSettings", "Term",
    "auto_token_budget", "dtype_bytes", "largest_fitting_rows", "load_model_shape", "lora_targets",
    "micro_batch_shape", "parse_memory", "plan_memory", "rows_under_budget", "run_settings", "settings_from_config",
    "shape_of_config", "suggest", "tokens_of",
]

#: Share of the device's memory ``max_tokens_per_micro_batch: auto`` plans into (the rest: what the plan
#: does not see, e.g. allocator fragmentation and communication buffers).
AUTO_FRACTION = 0.9


def largest_fitting_rows(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int) -> int:
    """Most rows of full-length completions a training micro-batch may hold with every phase under ``capacity``
    (0 when even one row does not fit)."""
    best = 0
    for rows in range(1, s.rows_per_step + 1):
        if plan_memory(shape, s, layout, rows=rows).peak_bytes <= capacity:
            best = rows
        else:
            break
    return best


def auto_token_budget(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int) -> int:
    """``max_tokens_per_micro_batch: auto``: the token budget of the largest micro-batch that fits ``capacity``.

    Raises ConfigError when no micro-batch fits (the message names the phase and what to change).
    """
    rows = largest_fitting_rows(shape, s, layout, capacity)
    if rows == 0:
        plan = plan_memory(shape, s, layout, capacity, rows=1)
        raise ConfigError(
            f"max_tokens_per_micro_batch: auto found no micro-batch that fits: with one row per micro-batch the "
            f"{plan.peak_phase} phase needs {plan.peak_bytes / GiB:.2f} GiB of {capacity / GiB:.2f} GiB; "
            "run `grpo-ascend plan` on the recipe for what to change"
        )
    return tokens_of(s, rows)


def suggest(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int) -> list[str]:
    """What to change when the run does not fit ``capacity`` (each suggestion re-planned and checked)."""
    out: list[str] = []
    rows = largest_fitting_rows(shape, s, layout, capacity)
    if rows:
        out.append(f"max_tokens_per_micro_batch: {tokens_of(s, rows)} (micro-batches of {rows} full-length rows; "
                   f"or per_device_train_batch_size: {rows}), or max_tokens_per_micro_batch: auto")
    candidates: list[tuple[str, RunSettings, MemoryLayout]] = []
    if s.logprob_chunk > 32:
        candidates.append(("logprob_chunk_size: 32", dataclasses.replace(s, logprob_chunk=32), layout))
    if not s.gradient_checkpointing:
        candidates.append(("gradient_checkpointing: true", dataclasses.replace(s, gradient_checkpointing=True), layout))
    if s.merge_lora is not False and s.use_peft and layout.may_merge_lora:
        candidates.append(("rollout_merge_lora: false", dataclasses.replace(s, merge_lora=False), layout))
    if not s.shared_prefix_decode:
        candidates.append(("shared_prefix_decode: true", dataclasses.replace(s, shared_prefix_decode=True), layout))
    if s.num_generations > 2 and s.num_generations % 2 == 0:
        half = s.num_generations // 2
        candidates.append((f"num_generations: {half}", dataclasses.replace(
            s, num_generations=half, rows_per_step=max(1, s.rows_per_step // 2),
            micro_batch_rows=min(s.micro_batch_rows, max(1, s.rows_per_step // 2))), layout))
    if s.prompts_per_rank > 1:
        candidates.append((f"fewer prompts per generation round ({s.prompts_per_rank // 2} per rank: halve "
                           "steps_per_generation / generation_batch_size)",
                           dataclasses.replace(s, prompts_per_rank=s.prompts_per_rank // 2), layout))
    for label, other in sharding_alternatives(layout, s.use_peft):
        candidates.append((label, s, other))
    if not s.use_peft:
        candidates.append(("use_peft: true (LoRA)", dataclasses.replace(s, use_peft=True), layout))
    base = plan_memory(shape, s, layout, capacity).peak_bytes
    helping = []
    for label, changed, lay in candidates:
        peak = plan_memory(shape, changed, lay, capacity).peak_bytes
        if peak < base:
            helping.append(label)
            out.append(f"{label}: peak {peak / GiB:.2f} GiB ({'fits' if peak <= capacity else 'still over'})")
    if not rows and len(helping) > 1:
        out.append(_together(shape, s, layout, capacity, [c for c in candidates if c[0] in helping]))
    if not out:
        out.append("nothing in the plan's reach fits: use more devices with a sharding engine, or a smaller model")
    return out


def _together(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int,
              candidates: list[tuple[str, RunSettings, MemoryLayout]]) -> str:
    """The changes that each helped, applied one after another until the run fits (then the micro-batch that fits)."""
    applied: list[str] = []
    original = s
    for label, changed, lay in candidates:
        fields = {f.name: getattr(changed, f.name) for f in dataclasses.fields(changed)
                  if getattr(changed, f.name) != getattr(original, f.name)}
        s, layout = dataclasses.replace(s, **fields) if fields else s, lay
        applied.append(label)
        rows = largest_fitting_rows(shape, s, layout, capacity)
        if rows:
            return (f"together: {' + '.join(applied)} + max_tokens_per_micro_batch: {tokens_of(s, rows)} "
                    f"({rows} rows): peak {plan_memory(shape, s, layout, capacity, rows=rows).peak_bytes / GiB:.2f} GiB (fits)")
    return f"together: {' + '.join(applied)}: peak {plan_memory(shape, s, layout, capacity).peak_bytes / GiB:.2f} GiB (still over)"


def settings_from_config(recipe: Any, args: Any, device: str, world_size: int = 1,
                         prompt_length: int | None = None) -> RunSettings:
    """The plan's view of a recipe (``RecipeConfig``) and trainer config (``GRPOConfig`` / ``PPOConfig``) on
    ``device`` (a device type, as the device layer names it: its defaults for precision and layout)."""
    dtype = (args.model_init_kwargs or {}).get("dtype") or recipe.model_dtype
    return run_settings(args, device, world_size, algorithm=recipe.algorithm, use_peft=recipe.use_peft,
                        lora_r=recipe.lora_r, lora_targets=lora_targets(recipe.lora_target_modules),
                        weight_bytes=4 if dtype == "auto" else dtype_bytes(str(dtype).removeprefix("torch.")),
                        prompt_length=prompt_length)


def run_settings(args: Any, device: str, world_size: int, *, algorithm: str, use_peft: bool, lora_r: int,
                 lora_targets: tuple[str, ...] | None, weight_bytes: int, prompt_length: int | None = None,
                 precision: str | None = None) -> RunSettings:
    """The plan's view of a trainer config (``GRPOConfig`` / ``PPOConfig``) and the model facts beside it.

    ``precision`` ('bf16', 'fp16', 'fp32'): the run's, when known; else the config's on ``device``.
    """
    plan = args.batch_plan(world_size)
    bucket = args.length_bucket if args.length_bucket is not None else dev.default_length_bucket(device)
    if precision is None:
        bf16 = args.bf16 if args.bf16 is not None else dev.is_accelerator(device)
        precision = "bf16" if bf16 else "fp16" if args.fp16 else "fp32"
    activation = 4 if precision == "fp32" else 2
    prompt = prompt_length if prompt_length is not None else args.max_prompt_length
    if prompt is None:
        raise ConfigError("max_prompt_length is null: the memory plan needs the longest prompt in tokens "
                          "(grpo-ascend plan --prompt-length N, or set max_prompt_length)")
    shared = args.shared_prefix_decode if args.shared_prefix_decode is not None else dev.default_shared_prefix_decode(device)
    budget = plan.max_tokens_per_micro_batch
    ahead = args.rollout_mode != "sync" and args.rollout_backend == "builtin"
    rollout_process = None if not ahead else "own" if args.rollout_device not in (None, device) else "same"
    transfer_to = _collective_sync(args, device, rollout_process)
    # the sampler's log-probs are the training forward's: the in-process engine in fp32 (see ExperienceMaker)
    exact = activation == 4 and args.rollout_backend == "builtin" and not ahead
    return RunSettings(
        algorithm=algorithm, use_peft=use_peft, lora_r=lora_r, lora_targets=lora_targets,
        weight_bytes=weight_bytes, activation_bytes=activation,
        reference=args.needs_reference_model,
        prompts_per_rank=plan.prompts_per_rank, num_generations=plan.num_generations,
        prompt_length=round_up(prompt, bucket), completion_length=round_up(args.max_completion_length, bucket),
        micro_batch_rows=args.per_device_train_batch_size, rows_per_step=plan.micro_batch * plan.grad_accum,
        token_budget=budget if isinstance(budget, int) else None, logprob_chunk=args.logprob_chunk_size,
        gradient_checkpointing=args.gradient_checkpointing, share_prompt_prefill=args.share_prompt_prefill,
        shared_prefix_decode=shared, merge_lora=args.rollout_merge_lora,
        filtered_sampling=args.top_k > 0 or args.top_p < 1 or args.min_p is not None,
        old_logprobs=plan.optimizer_steps_per_generation > 1 and not exact,
        entropy_grad=bool(getattr(args, "entropy_coef", 0.0)),
        grouped_attention_bytes=dev.grouped_attention_max_bytes(device) if activation == 4 else 0,
        critic_shares_base=getattr(args, "critic_init", "policy") == "policy",
        rollout_process=rollout_process, transfer_to=transfer_to, transfer_bucket_bytes=args.weight_transfer_bucket_bytes,
        ring_in_device_memory=rollout_process is not None and transfer_to is None and not dev.is_accelerator(device),
        train_vision_parts=check_vision_parts(args.train_vision_parts),
    )


def _collective_sync(args: Any, device: str, rollout_process: str | None) -> str | None:
    """Where a collective weight sync goes ("server", "rollout process"), as the run will decide; None: none.
    A server under ``auto`` is planned as collective (the larger of the two: a server that cannot join falls back
    to files)."""
    if args.rollout_backend == "vllm" and args.vllm_mode == "server":
        return "server" if args.weight_transfer != "files" else None
    if rollout_process is None:
        return None
    kind, _ = rollout_process_transfer(args.weight_transfer, device, args.rollout_device or device)
    return "rollout process" if kind == "collective" else None


def parse_memory(text: str) -> int:
    """Bytes of '64GiB', '64GB' (decimal), '65536MiB', '1.5TiB' or a plain number of bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not value > 0:
        raise ConfigError(f"device memory {text!r} is not a size; expected e.g. 64GiB, 64GB or 65536MiB")
    return int(value * units[unit])
