"""LoRA adapters a vLLM worker received over its transfer group, which vLLM's LoRA manager loads from memory.

vLLM's worker LoRA manager builds an adapter from a folder (``adapter_config.json`` + ``adapter_model.safetensors``)
whenever it needs one: at ``/v1/load_lora_adapter``, and again after its LRU cache evicted it. :class:`AdapterMemory`
wraps the manager's loader once: a ``lora_path`` of :data:`~.collective_sync.ADAPTER_SCHEME` + name is built from
the tensors and PEFT config held here under that name (vLLM's own ``LoRAModel.from_lora_tensors``, with the checks
its folder loader runs); every other path goes to vLLM's loader unchanged. An adapter stays held until the client
forgets it (after unloading it), so an evicted version can be rebuilt for as long as requests may name it.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_ascend.rollout.vllm.collective_sync import ADAPTER_SCHEME


class AdapterMemory:
    """The adapters held by one worker's LoRA manager (see the module docstring); :meth:`of` makes one per manager."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.adapters: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self._from_folder = manager._load_adapter
        manager._load_adapter = self._load

    @classmethod
    def of(cls, worker: Any) -> AdapterMemory:
        """The memory of ``worker``'s LoRA manager (made, and its loader wrapped, on first use)."""
        manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM server runs without LoRA; start it with --enable-lora --max-lora-rank R "
                               "to receive adapters")
        memory = getattr(manager, "grpo_adapter_memory", None)
        if memory is None:
            memory = cls(manager)
            manager.grpo_adapter_memory = memory
        return memory

    def put(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.adapters[name] = (tensors, dict(config))

    def forget(self, name: str) -> None:
        self.adapters.pop(name, None)

    def _load(self, lora_request: Any) -> Any:
        path = str(lora_request.lora_path)
        if not path.startswith(ADAPTER_SCHEME):
            return self._from_folder(lora_request)
        from vllm.exceptions import LoRAAdapterNotFoundError
        from vllm.lora.peft_helper import PEFTHelper

        held = self.adapters.get(path[len(ADAPTER_SCHEME):])
        if held is None:
            raise LoRAAdapterNotFoundError(lora_request.lora_name, path)
        tensors, config = held
        m = self.manager
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": m.max_position_embeddings})
        helper.validate_legal(m.lora_config)
        model = m._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = m._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id, peft_helper=helper, device="cpu",
            tensors={n: t.clone() for n, t in tensors.items()},  # vLLM scales lora_B in place: keep ours intact
            dtype=m.lora_config.lora_dtype, model_vocab_size=m.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
        m._adapter_manager._validate_moe_lora_format(lora)
        m._adapter_manager._validate_modules_to_save(lora)
        m._adapter_manager._validate_token_classification_lora(lora)
        return lora
