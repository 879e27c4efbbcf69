"""The memory plan's terms for a vision-language model's vision part (see docs/memory.md).

The vision tower and projector are frozen in training (LoRA targets the language model, full fine-tuning
freezes them): their weights are held like the decoder's, with no gradients or optimizer state. Each forward
that reads images (the rollout's prefill, old log-probs, reference, training) holds its prompts' float32 pixel
tensors and runs the tower without autograd, one layer at a time; a group's G rows share their prompt's
images, so a micro-batch of ``r`` rows holds ``ceil(r / G)`` prompts' images (``r`` under gradient
checkpointing). The image tokens themselves are prompt tokens: counted in ``prompt_length`` by the decoder's
terms.
"""

from __future__ import annotations

from grpo_ascend.distributed.memory_layout import MemoryLayout
from grpo_ascend.planning.settings import RunSettings, Term
from grpo_ascend.planning.vision_shape import VisionShape

#: Bytes per pixel element: processors return float32.
PIXEL_BYTES = 4


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


def vision_terms(v: VisionShape, s: RunSettings, layout: MemoryLayout, rows: int) -> list[Term]:
    """Every vision term of a run per device (``rows``: the training micro-batch's rows)."""
    w, world = s.weight_bytes, layout.world_size
    everywhere = ("generation", "old_logprobs", "reference", "values", "training")
    shard = world if layout.shards_weights else 1
    frozen = f"{v.num_params / 1e6:.1f}M params x {w} B, frozen: no gradients or optimizer state"
    terms = [Term("vision tower + projector", v.num_params * w // shard, everywhere,
                  frozen + (f" / {world} ranks" if shard > 1 else ""))]
    if layout.shards_weights:
        terms.append(Term("whole vision weights for rollout", v.num_params * w, ("generation",), "gathered once per round"))
    if s.reference and not s.use_peft:
        terms.append(Term("reference model: vision part", v.num_params * w, everywhere, "frozen whole copy"))
    if s.images_per_prompt <= 0:
        return terms
    if s.rollout_process is None:
        terms.extend(image_input_terms(v, s, s.prompts_per_rank, ("generation",)))
    else:
        held = everywhere if s.rollout_process == "same" else ("rollout device",)
        terms.append(Term("rollout process: vision weights", v.num_params * w, held, "its own copy"))
        terms.extend(image_input_terms(v, s, s.prompts_per_rank, held, "rollout process: "))
    scoring = min(s.micro_batch_rows, s.prompts_per_rank * s.num_generations)
    forwards = {"old_logprobs": scoring if s.old_logprobs else 0, "reference": scoring if s.reference else 0,
                "training": rows}
    for phase, phase_rows in forwards.items():
        if phase_rows:
            terms.extend(image_input_terms(v, s, prompts_with_images(s, phase_rows), (phase,)))
    return terms
