"""The memory plan's terms for a vision-language model's vision part (see docs/memory.md).

``train_vision_parts`` chooses what of the vision part trains (:func:`trained_parts`): in full fine-tuning the
chosen parts' whole weights, under LoRA adapters on their linear layers (what ``all-linear`` adapts there).
Their trainable elements (:func:`trained_vision_params`) join the decoder's in
:func:`grpo_ascend.planning.terms.plan_memory`, which counts gradients, optimizer state and master copies of
both alike; the frozen rest holds weights only.

Each forward that reads images (the rollout's prefill, old log-probs, reference, training) holds its prompts'
float32 pixel tensors; a group's G rows share their prompt's images, so a micro-batch of ``r`` rows holds
``ceil(r / G)`` prompts' images (``r`` under gradient checkpointing). A frozen tower runs without autograd, one
layer at a time. In the training forward a trained tower keeps every layer's saved tensors for the backward
(under gradient checkpointing each layer's input and one layer recomputed) and the projector's; a trained
projector over a frozen tower keeps the projector's alone (the tower's output, its input, is all autograd
holds of the tower). The image tokens themselves are prompt tokens: counted in ``prompt_length`` by the
decoder's terms.
"""

from __future__ import annotations

from grpo_ascend.distributed.memory_layout import MemoryLayout
from grpo_ascend.models.vision_language import VISION_PARTS, trains_whole_model
from grpo_ascend.planning.settings import RunSettings, Term
from grpo_ascend.planning.vision_model import VisionShape

#: Bytes per pixel element: processors return float32.
PIXEL_BYTES = 4


def trained_parts(v: VisionShape, s: RunSettings) -> tuple[str, ...]:
    """The vision parts that train: ``train_vision_parts`` (every part for TRL's choice in full fine-tuning), with
    the projector when it sits inside a trained tower (Qwen-VL's merger)."""
    if trains_whole_model(s.train_vision_parts, lora=s.use_peft):
        return tuple(VISION_PARTS)
    parts = tuple(s.train_vision_parts or ())
    if v.projector_in_tower and "vision_tower" in parts and "projector" not in parts:
        parts = ("projector", *parts)
    return parts


def trained_vision_params(v: VisionShape, s: RunSettings) -> int:
    """Trainable vision elements: the trained parts' weights, or under LoRA their linear layers' adapters
    (none when explicit ``target_modules`` name the decoder's layers: the plan adapts the decoder alone then)."""
    parts = trained_parts(v, s)
    if s.use_peft:
        return sum(v.part(p).lora_params(s.lora_r) for p in parts) if s.lora_targets is None else 0
    return sum(v.part(p).params for p in parts)


def adapted_vision_weights(v: VisionShape, s: RunSettings) -> int:
    """Elements of the vision linear layers carrying LoRA (what merging the adapters copies)."""
    if not s.use_peft or s.lora_targets is not None:
        return 0
    return sum(v.part(p).linear_weights for p in trained_parts(v, s))


def prompts_with_images(s: RunSettings, rows: int) -> int:
    """Prompts whose images a forward of ``rows`` rows passes to the vision tower."""
    return rows if s.gradient_checkpointing else min(rows, -(-rows // s.num_generations))


def image_input_terms(v: VisionShape, s: RunSettings, prompts: int, phases: tuple[str, ...], prefix: str = "") -> list[Term]:
    """Pixel tensors and the tower's no-grad working set for ``prompts`` prompts' images in ``phases``."""
    images = prompts * s.images_per_prompt
    pixels = images * v.image.pixel_elements * PIXEL_BYTES
    patches = images * v.image.patches
    return [Term(f"{prefix}pixel tensors", pixels, phases, f"{images} images x {v.image.pixel_elements} float32"),
            Term(f"{prefix}vision forward", patches * v.transient_elements * s.activation_bytes, phases,
                 f"{patches} patches, one vision layer at a time, no grad")]


def training_terms(v: VisionShape, s: RunSettings, prompts: int) -> list[Term]:
    """The training forward's vision terms for ``prompts`` prompts' images: pixels, and the tower's no-grad
    working set when it is frozen or what autograd keeps of it when it trains, and the trained projector's."""
    parts, a = trained_parts(v, s), s.activation_bytes
    images = prompts * s.images_per_prompt
    pixels, transient = image_input_terms(v, s, prompts, ("training",))
    terms = [pixels]
    if "vision_tower" not in parts:
        terms.append(transient)
    else:
        patches = images * v.image.patches
        embedding = patches * v.embedding_saved * v.hidden_size * a
        if s.gradient_checkpointing:
            kept = v.num_layers * patches * v.hidden_size * a + patches * v.saved_elements * a + embedding
            note = "checkpointed: layer inputs + one layer recomputed"
        else:
            kept = v.num_layers * patches * v.saved_elements * a + embedding
            note = "every vision layer's saved tensors"
        # no backward working set of its own: the tower's backward runs after the decoder's freed its activations
        terms.append(Term("vision activations", kept, ("training",), f"{patches} patches; {note}"))
    if parts:
        shared = 0 if "vision_tower" in parts else v.projector_input  # else the tower's last layer keeps it
        terms.append(Term("projector activations", images * (v.projector_saved + shared) * a, ("training",),
                          f"{images} images x {v.image.projected} positions, kept for the backward"))
    return terms


def describe_training(v: VisionShape, s: RunSettings) -> str:
    """What of the vision part trains, for the plan's header."""
    parts = trained_parts(v, s)
    if not parts:
        return "vision: tower and projector frozen (train_vision_parts: [])"
    what = "LoRA on their linear layers" if s.use_peft else "their whole weights"
    return (f"vision: trains {' + '.join(parts)} ({what}: {trained_vision_params(v, s):,} trainable elements; "
            f"train_vision_parts: {list(s.train_vision_parts) if s.train_vision_parts is not None else 'null'})")


def vision_terms(v: VisionShape, s: RunSettings, layout: MemoryLayout, rows: int) -> list[Term]:
    """Every vision term of a run per device (``rows``: the training micro-batch's rows); the trained parts'
    gradients and optimizer state are the decoder's terms' (:func:`trained_vision_params`)."""
    w, world = s.weight_bytes, layout.world_size
    everywhere = ("generation", "old_logprobs", "reference", "values", "training")
    shard = world if layout.shards_weights else 1
    parts = trained_parts(v, s)
    held = (f"trains {' + '.join(parts)}" + (" (LoRA)" if s.use_peft else "") if parts
            else "frozen: no gradients or optimizer state")
    terms = [Term("vision tower + projector", v.num_params * w // shard, everywhere,
                  f"{v.num_params / 1e6:.1f}M params x {w} B, {held}" + (f" / {world} ranks" if shard > 1 else ""))]
    if layout.shards_weights:
        terms.append(Term("whole vision weights for rollout", v.num_params * w, ("generation",), "gathered once per round"))
    if s.reference and not s.use_peft:
        terms.append(Term("reference model: vision part", v.num_params * w, everywhere, "frozen whole copy"))
    if s.images_per_prompt <= 0:
        return terms
    if s.rollout_process is None:
        terms.extend(image_input_terms(v, s, s.prompts_per_rank, ("generation",)))
    else:
        held_by = everywhere if s.rollout_process == "same" else ("rollout device",)
        terms.append(Term("rollout process: vision weights", v.num_params * w, held_by, "its own copy"))
        terms.extend(image_input_terms(v, s, s.prompts_per_rank, held_by, "rollout process: "))
    scoring = min(s.micro_batch_rows, s.prompts_per_rank * s.num_generations)
    for phase, phase_rows in {"old_logprobs": scoring if s.old_logprobs else 0,
                              "reference": scoring if s.reference else 0}.items():
        if phase_rows:  # no-grad forwards
            terms.extend(image_input_terms(v, s, prompts_with_images(s, phase_rows), (phase,)))
    terms.extend(training_terms(v, s, prompts_with_images(s, rows)))
    return terms
