"""``grpo-ascend plan RECIPE``: the memory each part of a run needs per device, before launch (no weights loaded)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from grpo_ascend.config.recipe import load_recipe, parse_overrides
from grpo_ascend.device import ACCELERATOR_TYPES
from grpo_ascend.distributed.memory_layout import layout_from_accelerate_config
from grpo_ascend.errors import ConfigError
from grpo_ascend.planning.memory_plan import (
    AUTO_FRACTION,
    GiB,
    ModelShape,
    auto_token_budget,
    load_model_shape,
    parse_memory,
    plan_memory,
    settings_from_config,
    suggest,
)
from grpo_ascend.planning.vision_shape import parse_image_size
from grpo_ascend.planning.vision_terms import describe_training


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False  # an override such as --model must not read as --model-config
    parser.add_argument("--device-memory", "--device_memory", default=None, metavar="SIZE",
                        help="memory of one device, e.g. 64GiB (Ascend 910B) or 64GB; prints the margin and what to "
                        "change when the run does not fit")
    parser.add_argument("--num-processes", "--num_processes", type=int, default=None, metavar="N",
                        help="processes (devices) the run is launched on; default: the accelerate config's, else 1")
    parser.add_argument("--accelerate-config", "--accelerate_config", default=None, metavar="FILE",
                        help="the accelerate config the run is launched with (its engine decides what is sharded), "
                        "e.g. recipes/accelerate/fsdp2_1node_8cards.yaml")
    parser.add_argument("--model-config", "--model_config", default=None, metavar="PATH",
                        help="the model's config.json (or its folder) when the recipe's model is a hub id, e.g. "
                        "recipes/model_configs/qwen2.5-7b.json")
    parser.add_argument("--device", default=ACCELERATOR_TYPES[0], help="device type the run will use: its precision "
                        f"and layout defaults (bf16, length buckets, shared-prefix decode) apply (default: {ACCELERATOR_TYPES[0]})")
    parser.add_argument("--prompt-length", "--prompt_length", type=int, default=None, metavar="N",
                        help="longest prompt in tokens (default: the recipe's max_prompt_length)")
    parser.add_argument("--images-per-prompt", "--images_per_prompt", type=int, default=None, metavar="N",
                        help="vision-language models: images in each prompt (default 1)")
    parser.add_argument("--image-size", "--image_size", default=None, metavar="WxH",
                        help="vision-language models: the images' size, e.g. 448x336 (default: the largest the "
                        "model's processor makes; LLaVA resizes every image to its tower's square)")
    parser.add_argument("config", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value pairs overriding the recipe")


_OWN = ("device-memory", "num-processes", "accelerate-config", "model-config", "device", "prompt-length",
        "images-per-prompt", "image-size")
_INTEGER_OPTIONS = ("num_processes", "prompt_length", "images_per_prompt")
#: The plan's own options (both spellings) -> their attribute; given after the recipe they are taken out of the overrides.
_OWN_OPTIONS = {f"--{spelling}": name.replace("-", "_") for name in _OWN for spelling in (name, name.replace("-", "_"))}


def _take_own_options(ns: argparse.Namespace) -> list[str]:
    """The override tokens without the plan's own options, which are set on ``ns`` (``--key value`` or ``--key=value``)."""
    tokens, rest, i = list(ns.overrides or []), [], 0
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if name not in _OWN_OPTIONS:
            rest.append(tokens[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(tokens):
                raise ConfigError(f"{name} needs a value")
            value = tokens[i + 1]
            i += 1
        attribute = _OWN_OPTIONS[name]
        setattr(ns, attribute, int(value) if attribute in _INTEGER_OPTIONS else value)
        i += 1
    return rest


@dataclass(frozen=True)
class PlannedImages:
    """A vision-language run's images per prompt, their tokens, and the header lines that say so."""

    count: int = 0
    tokens: int = 0
    lines: tuple[str, ...] = ()


def vision_images(shape: ModelShape, per_prompt: int | None, max_prompt_length: int | None,
                  text_length: int | None) -> PlannedImages:
    """The images a plan counts: none for a text model (``--images-per-prompt`` refused), else ``per_prompt``
    (default 1); their tokens are added to ``--prompt-length`` (text tokens) when given, and are part of
    ``max_prompt_length`` otherwise (the limit counts image tokens, as at run time)."""
    v = shape.vision
    if v is None:
        if per_prompt:
            raise ConfigError("--images-per-prompt is for vision-language models; this model's config has no vision_config")
        return PlannedImages()
    count = 1 if per_prompt is None else per_prompt
    tokens = count * v.image.tokens
    lines = [f"vision: {v.family} tower {v.tower_params:,} + projector {v.projector_params:,} "
             f"parameters; {count} image(s) per prompt, {v.image.tokens} tokens, {v.image.patches} patches "
             f"each ({v.image.size_note})"]
    if text_length is not None:
        lines.append(f"prompt: {text_length} text tokens (--prompt-length) + {tokens} image tokens")
    elif max_prompt_length is not None and tokens > max_prompt_length:
        lines.append(f"warning: {count} image(s) are {tokens} tokens, more than max_prompt_length={max_prompt_length}:"
                     " such prompts are refused at run time; pass --image-size or raise max_prompt_length")
    else:
        lines.append(f"prompt: max_prompt_length, which counts the {tokens} image tokens")
    return PlannedImages(count, tokens, tuple(lines))


def run_plan(ns: argparse.Namespace) -> int:
    """Entry point of ``grpo-ascend plan``: prints the plan; exit code 1 when it does not fit ``--device-memory``."""
    overrides = _take_own_options(ns)
    layout = layout_from_accelerate_config(ns.accelerate_config, ns.num_processes)
    recipe, args = load_recipe(ns.config, parse_overrides(overrides))
    shape = load_model_shape(recipe.model, ns.model_config, parse_image_size(ns.image_size))
    images = vision_images(shape, ns.images_per_prompt, args.max_prompt_length, ns.prompt_length)
    prompt_length = ns.prompt_length + images.tokens if ns.prompt_length is not None else None
    settings = settings_from_config(recipe, args, ns.device, layout.world_size, prompt_length)
    settings = dataclasses.replace(settings, images_per_prompt=images.count)
    capacity = parse_memory(ns.device_memory) if ns.device_memory else None
    header = [
        f"model: {recipe.model}" + (f" with the shape of {ns.model_config}" if ns.model_config else "")
        + f" ({shape.num_params / 1e9:.2f}B parameters, vocabulary {shape.vocab_size}, {shape.num_layers} layers)",
        f"run: {recipe.algorithm}, {'LoRA r=' + str(recipe.lora_r) if recipe.use_peft else 'full fine-tuning'}, "
        f"{layout.describe()}, weights {settings.weight_bytes} B, activations {settings.activation_bytes} B; "
        f"{settings.prompts_per_rank} prompts x G={settings.num_generations} per rank, prompt {settings.prompt_length} "
        f"+ completion {settings.completion_length} tokens",
    ]
    header.extend(images.lines)
    if shape.vision is not None:
        header.append(describe_training(shape.vision, settings))
    if args.max_tokens_per_micro_batch == "auto":
        if capacity is None:
            raise ConfigError("max_tokens_per_micro_batch: auto is resolved from the device's memory: pass "
                              "--device-memory SIZE to plan it")
        budget = auto_token_budget(shape, settings, layout, int(capacity * AUTO_FRACTION))
        settings = dataclasses.replace(settings, token_budget=budget)
        header.append(f"max_tokens_per_micro_batch: auto -> {budget} tokens ({AUTO_FRACTION:.0%} of the device memory)")
    plan = plan_memory(shape, settings, layout, capacity)
    if capacity is not None and not plan.fits():
        plan.suggestions = ["does not fit; each change below is re-planned alone:",
                            *suggest(shape, settings, layout, capacity)]
    print("\n".join(header))
    print(plan.report())
    if capacity is not None:
        print(f"(planned peak {plan.peak_bytes / GiB:.2f} of {capacity / GiB:.2f} GiB; the runtime's own memory -- "
              "allocator fragmentation, communication buffers, kernels' workspaces -- comes on top: see docs/memory.md)")
    return 0 if plan.fits() else 1
