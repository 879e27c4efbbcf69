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
    """Prompt positions ([B, Lp] or [3, B, Lp]) followed by the completion's [B, Lc] (broadcast to 3-D)."""
    if prompt.dim() == 3:
        completion = completion.unsqueeze(0).expand(prompt.shape[0], -1, -1)
    return torch.cat([prompt, completion], dim=-1)


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
