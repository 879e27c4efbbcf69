"""What vLLM 0.32 needs to serve a vision-language model from this project: applied once per process, before
the engine (or server) starts. It touches vLLM's and transformers' module tables, so it lives here alone.

* **Without torchvision.** vLLM's LLaVA and Qwen-VL modules import transformers' torchvision-backed image
  processor modules (for a helper each: ``_num_image_tokens``, ``smart_resize``), which fail to import where
  torchvision is missing (vLLM's CPU wheel: docs/vllm.md#install). Those modules are pointed at transformers'
  own PIL implementations of the same processors (the ones ``AutoImageProcessor`` picks without torchvision),
  so the model modules import; the images are still processed by the model folder's processor.
* **Qwen2.5-VL without torchvision.** vLLM builds Qwen2.5-VL's processor (``Qwen2_5_VLProcessor``), whose video
  processor needs torchvision, and asks it for its video settings. Where torchvision is missing, vLLM's
  Qwen2.5-VL is registered in this process (so its model inspection runs here, with the twins above) and its
  processing info builds our image-only processor (models/tiny_vlm_processors.py: the same image processor and
  token expansion, no video part) and declares images as its only modality; a video request is refused by vLLM.
* **LLaVA saved by transformers 5.** transformers 5 saves a LLaVA's CLIP tower as ``vision_tower.<part>`` (and
  names it ``model.vision_tower.<part>`` in memory, what a full weight sync sends), where vLLM 0.32 expects the
  hub layout ``vision_tower.vision_model.<part>``; LLaVA is registered with vLLM
  (in this process, so its model inspection runs here too) with that renaming added to its weight mapper.
  Folders in the hub layout load as before.
"""

from __future__ import annotations

import importlib
import re
import sys
import threading
import types

from grpo_ascend.models.tiny_vlm_processors import image_only_qwen2_5_vl_processor

#: Torchvision-backed transformers modules vLLM imports -> (their PIL twin, {torchvision class: PIL class}).
PIL_TWINS: dict[str, tuple[str, dict[str, str]]] = {
    "transformers.models.pixtral.image_processing_pixtral": (
        "transformers.models.pixtral.image_processing_pil_pixtral", {"PixtralImageProcessor": "PixtralImageProcessorPil"}),
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", {"Qwen2VLImageProcessor": "Qwen2VLImageProcessorPil"}),
}

#: transformers 5's names of a LLaVA CLIP tower's parts, and where vLLM 0.32 keeps them.
_CLIP_PARTS = re.compile(r"^(?:model\.)?vision_tower\.(embeddings|encoder|pre_layrnorm|post_layernorm)\.")

_lock = threading.Lock()
_done = False


def torchvision_available() -> bool:
    """Whether torchvision imports here (transformers' own check)."""
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


def prepare_vllm_for_vision() -> None:
    """Make this process's vLLM able to serve the vision-language families of :mod:`.vision` (idempotent)."""
    global _done
    with _lock:
        if _done:
            return
        if not torchvision_available():
            _install_pil_twins()
            _register_image_only_qwen2_5_vl()
        _register_llava()
        _done = True


def _install_pil_twins() -> None:
    for name, (twin, classes) in PIL_TWINS.items():
        if name in sys.modules:
            continue
        source = importlib.import_module(twin)
        module = types.ModuleType(name, f"{twin} under the name of its torchvision twin (grpo_ascend compat_vision)")
        module.__dict__.update({k: v for k, v in vars(source).items() if not k.startswith("__")})
        for ours, theirs in classes.items():
            setattr(module, ours, getattr(source, theirs))
        sys.modules[name] = module


def _register_llava() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.llava import LlavaForConditionalGeneration
    from vllm.model_executor.models.utils import WeightsMapper

    class TransformersFiveLlava(LlavaForConditionalGeneration):
        """vLLM's LLaVA, also loading a CLIP tower saved by transformers 5 (see the module docstring)."""

        hf_to_vllm_mapper = LlavaForConditionalGeneration.hf_to_vllm_mapper | WeightsMapper(
            orig_to_new_regex={_CLIP_PARTS: r"vision_tower.vision_model.\1."})

    ModelRegistry.register_model("LlavaForConditionalGeneration", TransformersFiveLlava)


def _register_image_only_qwen2_5_vl() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl

    processor_class = image_only_qwen2_5_vl_processor()
    info = qwen2_5_vl.Qwen2_5_VLProcessingInfo

    def get_hf_processor(self, **kwargs: object) -> object:
        return self.ctx.get_hf_processor(processor_class, **kwargs)

    info.get_hf_processor = get_hf_processor
    info.get_supported_mm_limits = lambda self: {"image": None}
    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration", qwen2_5_vl.Qwen2_5_VLForConditionalGeneration)
