"""Images inside a completion (a tool returned them): their features placed at their tokens, and positions.

A prompt's images go through the model's own forward (it fills every image token of the prompt). Tokens in a
completion are different: the policy may sample an image token id itself, which the sampler read as a plain
token, so only the columns a tool's images were rendered at may take image features. Both the sampler (one
fed segment) and the trainer (a whole completion) therefore embed the token ids themselves and put the
features, from the model's ``get_image_features``, at exactly those columns (:func:`embed_with_images`), then
call the model with ``inputs_embeds`` and no pixel inputs.

Positions: a model numbering image tokens like text (LLaVA) counts them one each. A multimodal-rotary model
(Qwen-VL) numbers an image's tokens over its grid and resumes text after the grid
(:func:`~grpo_ascend.vision.positions.segment_positions`); that numbering only depends on where a segment
starts, so a segment numbered alone and shifted to its start equals the same tokens numbered within the whole
sequence, which is what lets the sampler feed a tool response on its KV cache and the trainer run the whole
completion at once with the same positions.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.vision.inputs import RowVision, ToolImages
from grpo_ascend.vision.positions import image_placeholders, segment_positions


@dataclass(frozen=True)
class Placement:
    """Image features for batch row ``row`` at its ``columns`` (one per feature vector), from ``per_image``."""

    row: int
    columns: tuple[int, ...]
    per_image: Mapping[str, Tensor]


def image_features(model: nn.Module, per_image: Mapping[str, Tensor]) -> Tensor:
    """Feature vectors [tokens, H] of the images ``per_image`` holds (processor outputs), in order, from the
    model's ``get_image_features`` (the call its own forward makes)."""
    encode = getattr(model, "get_image_features", None)
    if encode is None:
        raise ConfigError(f"{type(model).__name__} has no get_image_features: images a tool returns need a "
                          "transformers vision-language model (AutoModelForImageTextToText)")
    accepted = inspect.signature(encode).parameters
    kwargs = {k: v for k, v in per_image.items() if k in accepted}
    out = encode(**kwargs, return_dict=True)
    pooled = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(pooled, (list, tuple)):
        return torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
    return pooled.reshape(-1, pooled.shape[-1])


def embed_with_images(model: nn.Module, ids: Tensor, placements: Sequence[Placement]) -> Tensor:
    """Input embeddings [B, L, H] of ``ids``, image features at each placement's columns (one vision call)."""
    embeds = model.get_input_embeddings()(ids)
    placements = [p for p in placements if p.columns]
    if not placements:
        return embeds
    keys = sorted({k for p in placements for k in p.per_image})
    joined = {k: torch.cat([p.per_image[k] for p in placements if k in p.per_image]).to(ids.device) for k in keys}
    features = image_features(model, joined).to(embeds.dtype)
    rows = torch.tensor([p.row for p in placements for _ in p.columns], device=ids.device)
    cols = torch.tensor([c for p in placements for c in p.columns], device=ids.device)
    if features.shape[0] != rows.numel():
        raise ConfigError(f"the images give {features.shape[0]} feature vectors for {rows.numel()} image tokens; "
                          "the processor and the model disagree on the image size (check the processor's settings)")
    return embeds.index_put((rows, cols), features)


def _types_and_grids(placements: Sequence[Placement], shape: tuple[int, int], device: torch.device) -> tuple[Tensor, dict]:
    types = torch.zeros(shape, dtype=torch.long, device=device)
    for p in placements:
        if p.columns:
            types[p.row, list(p.columns)] = 1
    grids = [p.per_image["image_grid_thw"] for p in sorted(placements, key=lambda p: p.row)
             if p.columns and "image_grid_thw" in p.per_image]
    return types, ({"image_grid_thw": torch.cat(grids).to(device)} if grids else {})


def segment_inputs(model: nn.Module, ids: Tensor, real: Tensor, starts: Tensor,
                   placements: Sequence[Placement]) -> tuple[Tensor, Tensor, Tensor]:
    """What one forward over a segment with images takes: (``inputs_embeds`` [B, L, H], position ids [B, L] or
    [3, B, L], each row's span: how far its next position moves past the segment).

    ``ids`` [B, L] with ``real`` [B, L] (bool, False on padding), each row's first position ``starts`` [B];
    placements' rows are batch rows (at most one per row) and their columns ``ids`` columns."""
    types, grids = _types_and_grids(placements, tuple(ids.shape), ids.device)
    positions, spans = segment_positions(model, types, real, grids)
    positions = positions + (starts.view(1, -1, 1) if positions.dim() == 3 else starts.view(-1, 1))
    return embed_with_images(model, ids, placements), positions, spans


def completion_placements(tool: Sequence[ToolImages | None], offset: int = 0) -> list[Placement]:
    """The placements of each row's tool images (their completion columns, shifted by ``offset``)."""
    return [Placement(i, tuple(c + offset for c in t.columns), t.per_image)
            for i, t in enumerate(tool) if t is not None and t.num_images > 0]


def completion_inputs(model: nn.Module, completion_ids: Tensor, completion_mask: Tensor, next_positions: Tensor,
                      tool: Sequence[ToolImages | None]) -> tuple[Tensor, Tensor]:
    """(``inputs_embeds``, position ids) of whole completions holding tool images, each row starting at its
    prompt's next position: the same embeddings and positions the sampler fed, segment by segment."""
    embeds, positions, _ = segment_inputs(model, completion_ids, completion_mask.bool(), next_positions,
                                          completion_placements(tool))
    return embeds, positions


def prompt_embeddings(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, vision: RowVision) -> Tensor:
    """Input embeddings of left-padded prompts with their own images' features at their image tokens (what the
    model's forward computes from the prompts' pixel inputs), for a forward given ``inputs_embeds``."""
    slots = image_placeholders(model.config, prompt_ids) & prompt_mask.bool()
    placements = []
    for i, row in enumerate(vision.rows):
        if row is not None and row.num_images > 0:
            placements.append(Placement(i, tuple(slots[i].nonzero().squeeze(1).tolist()), row.per_image))
    return embed_with_images(model, prompt_ids, placements)
