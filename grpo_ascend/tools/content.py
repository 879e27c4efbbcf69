"""What a tool returned, as the tool message's content: text, or content blocks with images.

A tool returns a string (or any value, shown with ``str``), or, as in TRL, a list of content blocks:
``[{"type": "image", "image": <PIL image | path | bytes | {"bytes", "path"}>}, {"type": "text", "text": ...}]``.
Blocks keep their order; text blocks are cut at the executor's ``max_output_chars`` like a text result; images
are decoded here (as dataset image columns are, :func:`grpo_ascend.vision.images.decode_image`), so an image
that cannot be read is answered like a tool error, never raised. The images travel beside the message (the
message's image blocks are bare ``{"type": "image"}`` parts, which is what a chat template renders and what a
JSON log can hold).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_ascend.errors import DataError
from grpo_ascend.vision.images import decode_image

#: The keys an image block may hold its image under (TRL / transformers chat content).
IMAGE_KEYS = ("image", "url", "path", "image_url")


#: The content block types a tool may return; a list of other dicts is shown as text (``str``), as before.
BLOCK_TYPES = ("text", "image", "image_url")


def is_content_blocks(value: Any) -> bool:
    """Whether ``value`` is a list of text / image content blocks (the multimodal tool output form)."""
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) > 0
            and all(isinstance(b, Mapping) and b.get("type") in BLOCK_TYPES for b in value))


@dataclass(frozen=True)
class ToolContent:
    """A tool's output as message content: ``content`` (text, or blocks with bare image parts), the decoded
    ``images`` in block order, whether text was cut, and ``problem``: why the output is refused (None: fine)."""

    content: str | list[dict[str, Any]]
    images: tuple[Any, ...] = ()
    truncated: bool = False
    problem: str | None = None


def truncate_output(text: str, max_chars: int | None) -> tuple[str, bool]:
    """``text`` cut to ``max_chars`` characters with a note saying how much was dropped."""
    if max_chars is None or len(text) <= max_chars:
        return text, False
    dropped = len(text) - max_chars
    return f"{text[:max_chars]}\n... [output truncated: {dropped} more characters]", True


def _block_image(block: Mapping[str, Any]) -> Any:
    for key in IMAGE_KEYS:
        if block.get(key) is not None:
            value = block[key]
            return value.get("url") if key == "image_url" and isinstance(value, Mapping) else value
    return None


def tool_content(name: str, value: Any, max_chars: int | None, takes_images: bool) -> ToolContent:
    """``value`` (what tool ``name`` returned) as message content; see the module docstring. ``takes_images``:
    whether the model reads images (a text-only model's tool returning one gets ``problem`` set)."""
    if not is_content_blocks(value):
        text, cut = truncate_output(value if isinstance(value, str) else str(value), max_chars)
        return ToolContent(text, (), cut)
    blocks: list[dict[str, Any]] = []
    images: list[Any] = []
    truncated = False
    for i, block in enumerate(value):
        kind = block["type"]
        if kind in ("image", "image_url"):
            raw = _block_image(block)
            if not takes_images:
                return ToolContent("", problem=(
                    f"tool {name!r} returned an image (content block {i}) but the model is text-only and cannot read "
                    "it; return text from the tool, or train a vision-language model with its processor"))
            try:
                images.append(decode_image(raw, 0, name, i))
            except DataError as exc:
                return ToolContent("", problem=(
                    f"tool {name!r} returned an image that cannot be decoded (content block {i}: "
                    f"{type(raw).__name__} {raw!r:.40}; {_reason(exc)}); "
                    "return a PIL image, an image file's path or its bytes"))
            blocks.append({"type": "image"})
        else:
            text, cut = truncate_output(str(block.get("text", "")), max_chars)
            truncated |= cut
            blocks.append({"type": "text", "text": text})
    return ToolContent(blocks, tuple(images), truncated)


def _reason(exc: DataError) -> str:
    """Why :func:`~grpo_ascend.vision.images.decode_image` refused a value, without its dataset-row wording."""
    text = str(exc)
    _, found, rest = text.partition("cannot be decoded as an image (")
    if found:
        text = rest.rsplit("); fix", 1)[0]
    return text.partition(": ")[2] if text.startswith("row ") else text
