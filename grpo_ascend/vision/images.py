"""A dataset row's images, as TRL's data carries them: an ``image`` or ``images`` column holding PIL images,
file paths, or the ``{"bytes": ..., "path": ...}`` records ``datasets`` stores for its Image feature."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_ascend.data.prompts import dataset_columns
from grpo_ascend.errors import DataError

#: TRL's columns of prompt images (one image, or a list per row).
IMAGE_COLUMNS = ("image", "images")


def row_images(row: Mapping[str, Any], row_index: int = 0) -> list[Any]:
    """The row's images as RGB PIL images (none: an empty list); an image that cannot be decoded is named."""
    found = []
    for column in IMAGE_COLUMNS:
        value = row.get(column)
        if value is None:
            continue
        items = value if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else [value]
        found.extend(decode_image(item, row_index, column, i) for i, item in enumerate(items) if item is not None)
    return found


def decode_image(item: Any, row_index: int, column: str, position: int = 0) -> Any:
    """One image value (PIL image, path, bytes, or a datasets record) as an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    where = f"row {row_index}, column {column!r}, image {position}"
    try:
        if isinstance(item, Image.Image):
            image = item
        elif isinstance(item, Mapping) and item.get("bytes") is not None:
            image = Image.open(io.BytesIO(item["bytes"]))
        elif isinstance(item, Mapping) and item.get("path"):
            image = Image.open(item["path"])
        elif isinstance(item, (bytes, bytearray)):
            image = Image.open(io.BytesIO(item))
        elif isinstance(item, str):
            image = Image.open(item)
        else:
            raise DataError(f"{where}: expected a PIL image, a file path, bytes or a {{'bytes', 'path'}} record, "
                            f"got {type(item).__name__}")
        image.load()
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise DataError(f"{where} cannot be decoded as an image ({exc}); fix or drop that row") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def has_image_column(columns: Sequence[str]) -> list[str]:
    """The image columns among ``columns``."""
    return [c for c in IMAGE_COLUMNS if c in columns]


def check_images_usable(dataset: Any, takes_images: bool, model_name: str) -> None:
    """Refuse image columns for a model that cannot read them (they would be ignored without a word)."""
    images = has_image_column(dataset_columns(dataset))
    if images and not takes_images:
        raise DataError(
            f"the dataset has image column(s) {images} but {model_name or 'the model'} is a text-only model, which "
            "would ignore them without a word. Use a vision-language model (and its processor), or train on the "
            f"text alone with dataset.remove_columns({images!r})")
