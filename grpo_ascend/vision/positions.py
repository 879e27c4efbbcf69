"""Position ids of prompts with images, and where each prompt's completion starts counting.

Most vision-language models number an image's tokens like text (LLaVA, Gemma): positions skip left
padding. Qwen-VL models use multimodal rotary positions: three components (time, height, width) from the
model's ``get_rope_index``, an image's tokens spanning its grid, so the text after it continues from the
grid's largest position rather than the token count. A completion's tokens are text: each takes one
position after the prompt's next one in all three components, which the model builds from 2-D ids.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn


def _plain(model: nn.Module, ids: Tensor, mask: Tensor, kwargs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return positions, mask.long().sum(-1)


def _rope_index_owner(model: nn.Module) -> Any:
    """The module defining ``get_rope_index`` (the model, or the backbone inside it), or None."""
    for candidate in (model, getattr(model, "model", None), getattr(getattr(model, "model", None), "model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    return None


def _multimodal_rope(model: nn.Module, ids: Tensor, mask: Tensor, kwargs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    owner = _rope_index_owner(model)
    accepted = inspect.signature(owner.get_rope_index).parameters
    given = {k: v for k, v in kwargs.items() if k in accepted and k != "input_ids"}
    positions, _ = owner.get_rope_index(input_ids=ids, attention_mask=mask.long(), **given)
    last = positions.masked_fill(~mask.bool().unsqueeze(0), -1).amax(dim=(0, 2))
    return positions, last + 1


#: (applies to this model and these image inputs, the scheme); the first that applies is used.
SCHEMES: list[tuple[Callable[[nn.Module, Mapping[str, Tensor]], bool], Callable[..., tuple[Tensor, Tensor]]]] = [
    (lambda model, kwargs: "image_grid_thw" in kwargs and _rope_index_owner(model) is not None, _multimodal_rope),
    (lambda model, kwargs: True, _plain),
]


def prompt_positions(model: nn.Module, ids: Tensor, mask: Tensor,
                     kwargs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(position ids of the left-padded prompts ``ids`` [P, Lp]: [P, Lp] or [3, P, Lp]; each prompt's next
    position [P]) for ``model`` given the prompts' image inputs ``kwargs``."""
    scheme = next(scheme for applies, scheme in SCHEMES if applies(model, kwargs))
    return scheme(model, ids, mask, kwargs)


def completion_positions(next_positions: Tensor, completion_mask: Tensor) -> Tensor:
    """Positions [B, Lc] of completion tokens: each row's next prompt position onwards, skipping nothing."""
    return next_positions.unsqueeze(1) + (completion_mask.long().cumsum(-1) - 1).clamp_min(0)


def joined(prompt: Tensor, completion: Tensor) -> Tensor:
    """Prompt positions ([B, Lp] or [3, B, Lp]) followed by the completion's ([B, Lc] or [3, B, Lc]); a 2-D
    part is broadcast to 3-D when the other is 3-D (text positions are equal in every component)."""
    if prompt.dim() == 3 and completion.dim() == 2:
        completion = completion.unsqueeze(0).expand(prompt.shape[0], -1, -1)
    elif prompt.dim() == 2 and completion.dim() == 3:
        prompt = prompt.unsqueeze(0).expand(completion.shape[0], -1, -1)
    return torch.cat([prompt, completion], dim=-1)


def _plain_segment(model: nn.Module, types: Tensor, real: Tensor, grids: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    counted = real.long()
    return (counted.cumsum(-1) - 1).clamp_min(0), counted.sum(-1)


def _multimodal_segment(model: nn.Module, types: Tensor, real: Tensor,
                        grids: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    # One text token after every row's segment: where it lands is the row's span.
    types = torch.cat([types, types.new_zeros(types.shape[0], 1)], dim=1)
    real = torch.cat([real.bool(), real.new_ones(real.shape[0], 1, dtype=torch.bool)], dim=1)
    owner = _rope_index_owner(model)
    positions, _ = owner.get_rope_index(input_ids=types, mm_token_type_ids=types, attention_mask=real.long(),
                                        image_grid_thw=grids.get("image_grid_thw"))
    return positions[..., :-1], positions[0, :, -1]


#: (applies, scheme) for segments inside a completion, from 0: the first that applies is used.
SEGMENT_SCHEMES: list[tuple[Callable[[nn.Module, Mapping[str, Tensor]], bool], Callable[..., tuple[Tensor, Tensor]]]] = [
    (lambda model, grids: "image_grid_thw" in grids and _rope_index_owner(model) is not None, _multimodal_segment),
    (lambda model, grids: True, _plain_segment),
]


def segment_positions(model: nn.Module, types: Tensor, real: Tensor,
                      grids: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Positions of token segments counted from 0 ([B, L] or [3, B, L]) and each row's span (where its next
    text token goes, [B]). ``types`` [B, L]: 1 on image tokens, 0 on text; ``real`` [B, L]: False on padding;
    ``grids``: the segments' ``image_grid_thw`` in row order (empty: no image is numbered over a grid)."""
    scheme = next(scheme for applies, scheme in SEGMENT_SCHEMES if applies(model, grids))
    return scheme(model, types, real, grids)


#: Config fields naming the token ids a model fills with image (or video) features.
PLACEHOLDER_FIELDS = ("image_token_id", "image_token_index", "video_token_id")


def image_placeholders(config: Any, ids: Tensor) -> Tensor:
    """Where ``ids`` hold a token id the model would fill with image features (bool, like ``ids``)."""
    found = torch.zeros_like(ids, dtype=torch.bool)
    for name in PLACEHOLDER_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            found |= ids == value
    return found
