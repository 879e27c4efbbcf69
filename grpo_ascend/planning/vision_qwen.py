"""The Qwen-VL families' vision parts for the memory plan: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5.

Each has a patch-embedding 3D convolution, ``depth`` vision blocks (Qwen2.5-VL's with RMS norms and a gated MLP,
the others' with layer norms and a two-linear MLP) and a merger over ``spatial_merge_size²`` patches, the
projector (``visual.merger``). Qwen3-VL and Qwen3.5 add learned position embeddings, Qwen3-VL its deepstack
mergers (inside the tower: ``train_vision_parts`` counts them with it). The processor resizes an image to a
multiple of ``patch × merge`` within its pixel bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from grpo_ascend.planning.vision_model import Config, ImageCost, Linear, PartShape, VisionFamily


def _size_setting(processor: Config, key: str, size_key: str, default: int) -> int:
    size = processor.get("size") or {}
    return int(processor.get(key) or size.get(size_key) or default)


def _merger(v: Config, width: int, norm_width: int, out: int) -> PartShape:
    """A merger: a norm of ``norm_width`` (weight, and bias unless RMS) and two biased linears."""
    merged = width * v["spatial_merge_size"] ** 2
    return PartShape(norm_width + (merged * merged + merged) + (merged * out + out),
                     (Linear(merged, merged), Linear(merged, out)))


def _block(h: int, i: int, gated: bool, norm: int) -> tuple[int, tuple[Linear, ...]]:
    """One vision block's parameters (two norms of ``norm`` each, biased qkv / proj, the MLP) and linears."""
    mlp = (Linear(h, i), Linear(h, i), Linear(i, h)) if gated else (Linear(h, i), Linear(i, h))
    linears = (Linear(h, 3 * h), Linear(h, h), *mlp)
    return 2 * norm + sum(x.in_features * x.out_features + x.out_features for x in linears), linears


def _tower(v: Config, h: int, i: int, gated: bool, norm: int, embeddings: int) -> PartShape:
    params, linears = _block(h, i, gated, norm)
    return PartShape(embeddings + v["depth"] * params, tuple(Linear(x.in_features, x.out_features, v["depth"])
                                                            for x in linears))


def _patch_embedding(v: Config, h: int, bias: bool) -> int:
    return v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * h + (h if bias else 0)


def qwen2_vl_parameters(config: Config, v: Config) -> tuple[PartShape, PartShape]:
    """Layer-normed blocks with a ``mlp_ratio`` MLP; a layer-normed merger to ``hidden_size`` (the text's)."""
    e = v["embed_dim"]
    tower = _tower(v, e, e * v["mlp_ratio"], False, 2 * e, _patch_embedding(v, e, bias=False))
    return tower, _merger(v, e, 2 * e, v["hidden_size"])


def qwen2_5_vl_parameters(config: Config, v: Config) -> tuple[PartShape, PartShape]:
    """RMS-normed blocks with a gated MLP (biased); an RMS-normed merger to ``out_hidden_size``."""
    h = v["hidden_size"]
    tower = _tower(v, h, v["intermediate_size"], True, h, _patch_embedding(v, h, bias=False))
    return tower, _merger(v, h, h, v["out_hidden_size"])


def qwen3_vl_parameters(config: Config, v: Config) -> tuple[PartShape, PartShape]:
    """Layer-normed blocks, a biased patch embedding, learned positions; a layer-normed merger, and per
    ``deepstack_visual_indexes`` entry a merger normed after the shuffle (counted in the tower)."""
    h, out = v["hidden_size"], v["out_hidden_size"]
    embeddings = _patch_embedding(v, h, bias=True) + v["num_position_embeddings"] * h
    tower = _tower(v, h, v["intermediate_size"], False, 2 * h, embeddings)
    deep = len(v.get("deepstack_visual_indexes") or ())
    if deep:
        merger = _merger(v, h, 2 * h * v["spatial_merge_size"] ** 2, out)
        tower = PartShape(tower.params + deep * merger.params,
                          tower.linears + tuple(Linear(x.in_features, x.out_features, deep) for x in merger.linears))
    return tower, _merger(v, h, 2 * h, out)


def qwen_image_cost(low_default: int, high_default: int) -> Callable[[Config, Config, Config, tuple[int, int] | None],
                                                                       ImageCost]:
    """A Qwen-VL processor's image cost with its default pixel bounds (``min_pixels``, ``max_pixels``)."""

    def cost(config: Config, v: Config, processor: Config, size: tuple[int, int] | None) -> ImageCost:
        """Resized to a multiple of ``patch × merge`` within [min_pixels, max_pixels]; without a size the largest
        square image the processor makes is planned."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        patch = int(processor.get("patch_size") or v["patch_size"])
        merge = int(processor.get("merge_size") or v["spatial_merge_size"])
        temporal = int(processor.get("temporal_patch_size") or v["temporal_patch_size"])
        low = _size_setting(processor, "min_pixels", "shortest_edge", low_default)
        high = _size_setting(processor, "max_pixels", "longest_edge", high_default)
        width, height = size if size is not None else (math.isqrt(high),) * 2
        h, w = smart_resize(height, width, factor=patch * merge, min_pixels=low, max_pixels=high)
        patches = (h // patch) * (w // patch)
        note = f"{width}x{height} from --image-size" if size is not None else f"the largest square, max_pixels {high}"
        return ImageCost(tokens=patches // merge**2, patches=patches,
                         pixel_elements=patches * v["in_channels"] * temporal * patch**2,
                         size_note=f"{note} -> {w}x{h} pixels", projected=patches // merge**2)

    return cost


def merger_saved(config: Config, v: Config, image: ImageCost) -> tuple[int, int]:
    """The merger keeps its norm's input and output (a patch's width each) and both linears' inputs (merged);
    the last block's output, its input, is no block's saved tensor."""
    return 4 * image.patches * v.get("embed_dim", v["hidden_size"]), 0


def _qwen_family(parameters: Callable[[Config, Config], tuple[PartShape, PartShape]], low: int, high: int,
                 keys: tuple[str, str, str], gated: bool = False, text_bias: bool = True,
                 saved_hidden: int = 11, embedding_saved: int = 4) -> VisionFamily:
    """A Qwen-VL family; ``saved_hidden``: 11 hidden widths kept per layer, CLIP's 8 and the rotary embedding's
    copies of q and k (measured); the patch embedding, window reordering and rotary tables keep 4 before them."""

    def layers(v: Config) -> tuple[int, int, int]:
        if keys[0] == "embed_dim":  # Qwen2-VL: the MLP's width is a ratio
            return int(v["embed_dim"]), int(v["embed_dim"] * v["mlp_ratio"]), int(v["depth"])
        return int(v[keys[0]]), int(v[keys[1]]), int(v[keys[2]])

    return VisionFamily(parameters, qwen_image_cost(low, high), layers, merger_saved, text_attention_bias=text_bias,
                        saved_hidden=saved_hidden, embedding_saved=embedding_saved, gated_mlp=gated, projector_in_tower=True)


_QWEN2_BOUNDS = (56 * 56, 28 * 28 * 1280)
#: Qwen3-VL's processor: 32x32-pixel merged patches from 65,536 up to 16,777,216 pixels.
_QWEN3_BOUNDS = (65_536, 16_777_216)
_DEPTH_KEYS = ("hidden_size", "intermediate_size", "depth")

QWEN_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_vl": _qwen_family(qwen2_vl_parameters, *_QWEN2_BOUNDS, ("embed_dim", "mlp_ratio", "depth")),
    # RMS norms keep their input and its normalised copy: two more hidden widths than layer norms
    "qwen2_5_vl": _qwen_family(qwen2_5_vl_parameters, *_QWEN2_BOUNDS, _DEPTH_KEYS, gated=True, saved_hidden=13,
                               embedding_saved=5),
    "qwen3_vl": _qwen_family(qwen3_vl_parameters, *_QWEN3_BOUNDS, _DEPTH_KEYS, text_bias=False),
    "qwen3_5": _qwen_family(qwen3_vl_parameters, *_QWEN3_BOUNDS, _DEPTH_KEYS, text_bias=False),
    "qwen3_5_moe": _qwen_family(qwen3_vl_parameters, *_QWEN3_BOUNDS, _DEPTH_KEYS, text_bias=False),
}
