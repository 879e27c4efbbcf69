"""The vision parts of the families with a CLIP or SigLIP tower, for the memory plan: LLaVA, LLaVA-NeXT and Gemma 3.

LLaVA maps every patch of one square view through a two-linear projector; LLaVA-NeXT ("anyres") adds the tiles
of the best fitting resolution of ``image_grid_pinpoints`` (its image tokens: the base view, the tiles unpadded
to the picture's aspect ratio, and a newline feature per row); Gemma 3 pools its SigLIP tower's patches to
``mm_tokens_per_image`` and projects them with one matrix (no linear layer: nothing for LoRA).
"""

from __future__ import annotations

from grpo_ascend.errors import ConfigError
from grpo_ascend.planning.vision_model import Config, ImageCost, Linear, PartShape, VisionFamily


def _encoder_layer(h: int, i: int) -> tuple[int, tuple[Linear, ...]]:
    """A CLIP / SigLIP encoder layer: two layer norms, biased q, k, v, out projections, a biased two-linear MLP."""
    linears = (Linear(h, h, 4), Linear(h, i), Linear(i, h))
    return 4 * h + sum(x.count * (x.in_features * x.out_features + x.out_features) for x in linears), linears


def _encoder(v: Config, embeddings: int, extra: int = 0, extra_linears: tuple[Linear, ...] = ()) -> PartShape:
    h, layers = v["hidden_size"], v["num_hidden_layers"]
    params, linears = _encoder_layer(h, v["intermediate_size"])
    return PartShape(embeddings + layers * params + 2 * h + extra,  # + the post layer norm
                     tuple(Linear(x.in_features, x.out_features, x.count * layers) for x in linears) + extra_linears)


def clip_tower(v: Config) -> PartShape:
    """CLIP's vision transformer: class + patch + position embeddings, a pre layer norm, the layers, a post norm."""
    if v.get("model_type") != "clip_vision_model":
        raise ConfigError(f"a LLaVA vision tower of type {v.get('model_type')!r} cannot be planned yet (CLIP only)")
    h = v["hidden_size"]
    positions = (v["image_size"] // v["patch_size"]) ** 2 + 1
    return _encoder(v, h + v["num_channels"] * v["patch_size"] ** 2 * h + positions * h + 2 * h)


def siglip_tower(v: Config) -> PartShape:
    """SigLIP's vision transformer: a biased patch embedding, positions, the layers, a post norm, and the
    attention-pooling head when ``vision_use_head`` (its out projection and MLP are linear layers)."""
    if v.get("model_type") != "siglip_vision_model":
        raise ConfigError(f"a Gemma 3 vision tower of type {v.get('model_type')!r} cannot be planned (SigLIP only)")
    h, i = v["hidden_size"], v["intermediate_size"]
    embeddings = v["num_channels"] * v["patch_size"] ** 2 * h + h + (v["image_size"] // v["patch_size"]) ** 2 * h
    if not v.get("vision_use_head", True):
        return _encoder(v, embeddings)
    head_linears = (Linear(h, h), Linear(h, i), Linear(i, h))
    head = h + (3 * h * h + 3 * h) + 2 * h + sum(x.in_features * x.out_features + x.out_features for x in head_linears)
    return _encoder(v, embeddings, head, head_linears)


def llava_parameters(config: Config, v: Config) -> tuple[PartShape, PartShape]:
    """A CLIP tower and LLaVA's two-linear projector (from every selected vision layer to the text hidden);
    LLaVA-NeXT's learned newline feature belongs to the projector."""
    layers = config.get("vision_feature_layer", -2)
    width = v["hidden_size"] * (len(layers) if isinstance(layers, list) else 1)
    text = config["text_config"]["hidden_size"]
    bias = 1 if config.get("multimodal_projector_bias", True) else 0
    newline = text if config.get("model_type") == "llava_next" else 0
    projector = PartShape(width * text + bias * text + text * text + bias * text + newline,
                          (Linear(width, text), Linear(text, text)))
    return clip_tower(v), projector


def gemma3_parameters(config: Config, v: Config) -> tuple[PartShape, PartShape]:
    """A SigLIP tower; the projector: an RMS norm and one projection matrix to the text hidden (a parameter)."""
    h = v["hidden_size"]
    return siglip_tower(v), PartShape(h + h * config["text_config"]["hidden_size"])


def _crop(v: Config, processor: Config) -> tuple[int, int]:
    crop = processor.get("crop_size") or {}
    side = int(crop.get("height") or v["image_size"])
    return side, int(crop.get("width") or side)


def llava_image_cost(config: Config, v: Config, processor: Config, size: tuple[int, int] | None) -> ImageCost:
    """LLaVA's processor resizes and crops every image to the tower's square: a fixed count whatever the size."""
    side, _ = _crop(v, processor)
    grid = (side // v["patch_size"]) ** 2
    extra = 1 if config.get("vision_feature_select_strategy") == "full" else 0
    return ImageCost(tokens=grid + extra, patches=grid + 1, pixel_elements=v["num_channels"] * side * side,
                     size_note=f"every image resized to {side}x{side}", projected=grid + extra)


def _anyres_tokens(height: int, width: int, best: tuple[int, int], tile: tuple[int, int], patch: int) -> int:
    """LLaVA-NeXT's processor's image tokens before the strategy: the tiles' features unpadded to the picture's
    aspect ratio, a newline per row, and the base view's patches."""
    rows, columns = tile[0] // patch, tile[1] // patch
    current_height, current_width = rows * (best[0] // tile[0]), columns * (best[1] // tile[1])
    if width / height > current_width / current_height:
        current_height -= (current_height - int(round(height * (current_width / width), 7))) // 2 * 2
    else:
        current_width -= (current_width - int(round(width * (current_height / height), 7))) // 2 * 2
    return current_height * current_width + current_height + rows * columns


def llava_next_image_cost(config: Config, v: Config, processor: Config, size: tuple[int, int] | None) -> ImageCost:
    """LLaVA-NeXT's processor: a base view plus the crop-sized tiles of the best fitting ``image_grid_pinpoints``
    resolution; without a size, the pinpoint of most tokens is planned."""
    from transformers.image_processing_utils import select_best_resolution

    tile = _crop(v, processor)
    pinpoints = [tuple(p) for p in processor.get("image_grid_pinpoints") or config["image_grid_pinpoints"]]
    grid = (v["image_size"] // v["patch_size"]) ** 2
    full = 1 if config.get("vision_feature_select_strategy") == "full" else 0

    def cost(width: int, height: int) -> ImageCost:
        best = select_best_resolution((height, width), pinpoints)
        views = 1 + (best[0] // tile[0]) * (best[1] // tile[1])
        tokens = _anyres_tokens(height, width, best, tile, v["patch_size"]) + full  # the processor's CLS
        return ImageCost(tokens=tokens, patches=views * (grid + 1),
                         pixel_elements=views * v["num_channels"] * tile[0] * tile[1],
                         size_note=f"{width}x{height} -> {views - 1} tiles of {tile[1]}x{tile[0]} + the base view",
                         projected=views * (grid + full))

    if size is not None:
        return cost(*size)
    return max((cost(w, h) for h, w in pinpoints), key=lambda c: c.tokens)


def gemma3_image_cost(config: Config, v: Config, processor: Config, size: tuple[int, int] | None) -> ImageCost:
    """Gemma 3's processor resizes every image to the tower's square (``size``) and the model pools it to
    ``mm_tokens_per_image`` tokens; pan-and-scan crops are not planned."""
    if processor.get("do_pan_and_scan"):
        raise ConfigError("the processor's do_pan_and_scan: true adds crops per image, which the plan does not "
                          "count; plan with do_pan_and_scan: false")
    side = int((processor.get("size") or {}).get("height") or v["image_size"])
    tokens = int(config["mm_tokens_per_image"])
    return ImageCost(tokens=tokens, patches=(v["image_size"] // v["patch_size"]) ** 2,
                     pixel_elements=v["num_channels"] * side * side,
                     size_note=f"every image resized to {side}x{side}", projected=tokens)


def _layers(v: Config) -> tuple[int, int, int]:
    return int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"])


def _projector_saved(config: Config, v: Config, image: ImageCost) -> tuple[int, int]:
    """LLaVA's projector keeps its hidden before and after GELU, and its input (the selected layers' features:
    a trained tower's layers keep them already)."""
    layers = config.get("vision_feature_layer", -2)
    width = v["hidden_size"] * (len(layers) if isinstance(layers, list) else 1)
    return image.projected * 2 * config["text_config"]["hidden_size"], image.projected * width


def _gemma3_projector_saved(config: Config, v: Config, image: ImageCost) -> tuple[int, int]:
    """Gemma 3's projector keeps its RMS norm's input and output per pooled token (the pooling keeps nothing)."""
    return 2 * image.projected * v["hidden_size"], 0


CLIP_FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily(llava_parameters, llava_image_cost, _layers, _projector_saved, text_attention_bias=False),
    "llava_next": VisionFamily(llava_parameters, llava_next_image_cost, _layers, _projector_saved,
                               text_attention_bias=False),
    "gemma3": VisionFamily(gemma3_parameters, gemma3_image_cost, _layers, _gemma3_projector_saved,
                           text_attention_bias=False),
}
