"""A prompt's image inputs (what a processor returns besides the token ids) and how rows of them batch.

A processor's outputs are of two kinds: token-aligned tensors ``[1, L]`` beside ``input_ids`` (Qwen-VL's
``mm_token_type_ids``, Gemma's ``token_type_ids``), padded with the prompt and extended with zeros over the
completion; and per-image tensors (``pixel_values``, ``image_grid_thw``, ``image_sizes`` ...), joined along
their first dimension in row order, which is the order the model scatters image features into image tokens
(zero-padded to a common shape where a processor pads, e.g. LLaVA-NeXT's tiles: :func:`join_images`).
The G rows of a prompt share its :class:`PromptImages` by reference: nothing is copied per completion.

Images a tool returned in a multi-turn rollout sit inside a row's completion: :class:`ToolImages` holds a row's
per-image tensors (all its tool images, in order) and the completion columns their features fill
(:mod:`grpo_ascend.vision.completion_images` embeds and numbers them). Rows of a group may call tools
differently, so these are per row, never shared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

#: Processor outputs that are the prompt itself, not image inputs.
TEXT_KEYS = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class PromptImages:
    """One prompt's image inputs: ``per_image`` tensors and ``per_token`` ones (length = the prompt's tokens);
    ``pictures``: the decoded images they came from (RGB PIL images), for a sampler that runs its own processor
    (vLLM)."""

    per_image: dict[str, Tensor]
    per_token: dict[str, Tensor]
    num_images: int
    pictures: tuple[Any, ...] = field(default=(), compare=False)

    @classmethod
    def from_processor(cls, outputs: Mapping[str, Tensor], num_images: int,
                       pictures: Sequence[Any] = ()) -> PromptImages:
        """Split one prompt's processor outputs (batch of 1) into per-token and per-image tensors."""
        length = outputs["input_ids"].shape[-1]
        per_token, per_image = {}, {}
        for key, value in outputs.items():
            if key in TEXT_KEYS or not isinstance(value, Tensor):
                continue
            if value.dim() == 2 and value.shape[0] == 1 and value.shape[1] == length and key != "pixel_values":
                per_token[key] = value[0].cpu()
            else:
                per_image[key] = value.cpu()
        return cls(per_image, per_token, num_images, tuple(pictures))


def join_images(pieces: Sequence[Tensor]) -> Tensor:
    """Per-image tensors of several prompts joined along the first dimension. Where their other dimensions
    differ (LLaVA-NeXT's ``pixel_values`` [images, tiles, C, H, W]: each prompt's processor padded the tiles to
    its own images' most), each is zero-padded at the end to the largest, as a processor pads one call's images;
    the model reads each image's real tiles from its ``image_sizes``."""
    shape = [max(sizes) for sizes in zip(*(p.shape[1:] for p in pieces))]
    padded = []
    for piece in pieces:
        missing = [want - have for want, have in zip(shape, piece.shape[1:])]
        if any(missing):
            pad = [amount for m in reversed(missing) for amount in (0, m)]
            piece = torch.nn.functional.pad(piece, pad)
        padded.append(piece)
    return torch.cat(padded)


@dataclass(frozen=True)
class ToolImages:
    """A completion row's tool images: ``per_image`` tensors (every tool image of the row, in order, joined along
    dim 0) and ``columns``, the completion columns of their image tokens, in order (one per feature vector)."""

    per_image: dict[str, Tensor]
    columns: tuple[int, ...]
    num_images: int

    def then(self, other: ToolImages) -> ToolImages:
        """This row's images followed by ``other``'s (a later tool turn)."""
        keys = sorted(set(self.per_image) | set(other.per_image))
        joined = {k: join_images([x.per_image[k] for x in (self, other) if k in x.per_image]) for k in keys}
        return ToolImages(joined, self.columns + other.columns, self.num_images + other.num_images)


class RowVision:
    """The image inputs of a batch's rows (None: a row without images); see the module docstring.
    ``tool``: each row's tool images (None: the row's tools returned none; all None by default)."""

    def __init__(self, rows: Sequence[PromptImages | None], tool: Sequence[ToolImages | None] | None = None) -> None:
        self.rows = list(rows)
        self.tool = list(tool) if tool is not None else [None] * len(self.rows)
        if len(self.tool) != len(self.rows):
            raise ValueError(f"RowVision: {len(self.tool)} rows of tool images for {len(self.rows)} rows")

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def repeated(cls, prompts: Sequence[PromptImages | None], group: int) -> RowVision:
        """Each prompt's inputs for its ``group`` rows (shared, not copied)."""
        return cls([p for p in prompts for _ in range(group)])

    def select(self, index: Sequence[int]) -> RowVision:
        return RowVision([self.rows[i] for i in index], [self.tool[i] for i in index])

    @staticmethod
    def concat(parts: Sequence[RowVision | None], sizes: Sequence[int]) -> RowVision | None:
        """Row-wise join; a part without images contributes ``sizes[i]`` rows of None."""
        if all(p is None for p in parts):
            return None
        rows = [r for p, n in zip(parts, sizes) for r in (p.rows if p is not None else [None] * n)]
        tool = [t for p, n in zip(parts, sizes) for t in (p.tool if p is not None else [None] * n)]
        return RowVision(rows, tool)

    def same_as_previous(self) -> list[bool]:
        """Per row: whether it holds the very inputs of the row before it (a prompt's rows share them)."""
        return [i > 0 and row is self.rows[i - 1] for i, row in enumerate(self.rows)]

    @property
    def any_images(self) -> bool:
        return self.any_prompt_images or self.any_tool_images

    @property
    def any_prompt_images(self) -> bool:
        return any(r is not None and r.num_images > 0 for r in self.rows)

    @property
    def any_tool_images(self) -> bool:
        return any(t is not None and t.num_images > 0 for t in self.tool)

    def forward_kwargs(self, rows: Sequence[int] | Tensor | None, prompt_mask: Tensor,
                       completion_width: int = 0, pixels: bool = True) -> dict[str, Tensor]:
        """The model's image keyword arguments for ``rows`` (None: all) whose prompts are left-padded as
        ``prompt_mask`` [R, Lp] is; per-token tensors get ``completion_width`` zero columns after the prompt.
        ``pixels=False`` leaves out the pixel tensors (what position ids need: grids and token types)."""
        index = range(len(self.rows)) if rows is None else [int(i) for i in rows]
        chosen = [self.rows[i] for i in index]
        device = prompt_mask.device
        out: dict[str, Tensor] = {}
        keys = {k for r in chosen if r is not None for k in r.per_image if pixels or not k.startswith("pixel_values")}
        for key in sorted(keys):
            pieces = [r.per_image[key] for r in chosen if r is not None and key in r.per_image]
            out[key] = join_images(pieces).to(device)
        token_keys = {k for r in chosen if r is not None for k in r.per_token}
        width = prompt_mask.shape[1]
        for key in sorted(token_keys):
            full = torch.zeros((len(chosen), width + completion_width), dtype=torch.long, device=device)
            for j, r in enumerate(chosen):
                if r is not None and key in r.per_token:
                    values = r.per_token[key].to(device)
                    full[j, width - values.shape[0]: width] = values
            out[key] = full
        return out
