"""The policy's weights as a rollout backend takes them at a sync (:class:`PolicyWeights`): a version, LoRA adapter
tensors or every tensor under its transformers name, streamed whole one tensor at a time from a sharded strategy
(:class:`WholeTensors`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from grpo_ascend.errors import ConfigError


class WholeTensors(Protocol):
    """What a sharded training strategy gives :class:`PolicyWeights` to stream whole tensors (distributed/base.py's
    Strategy has both): a tensor's whole shape without gathering, and named tensors gathered one at a time."""

    def full_shape(self, tensor: Tensor) -> tuple[int, ...]: ...

    def stream_whole(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]: ...


@dataclass
class PolicyWeights:
    """The policy's current weights, as a backend takes them at :meth:`RolloutBackend.sync_weights`.

    ``version`` is the optimizer step the weights are from: a backend may skip a sync whose
    version it already holds, and must load a new version (a new LoRA adapter id, a reset prefix
    cache) otherwise. ``adapter_only``: the policy is a PEFT LoRA model, and only its adapter
    tensors change (:meth:`named_tensors` yields PEFT's adapter state-dict names,
    :meth:`adapter_config` its config); otherwise :meth:`named_tensors` yields every parameter
    and buffer of the (unwrapped) model under its transformers names, one at a time, never copied.

    ``whole``: None when the caller made the weights whole for the round; else the training strategy, and
    :meth:`named_tensors` gathers each tensor alone as it is asked for (sharded: never the whole model on one
    rank). A collective: every training rank iterates it once, in lockstep, ``sends`` (rank 0) keeping what it
    sends, the others dropping it; the trainer's :meth:`complete` iterates it where the backend did not.
    """

    model: nn.Module
    version: int
    whole: WholeTensors | None = None
    sends: bool = True
    _passes: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def adapter_only(self) -> bool:
        return bool(getattr(self.model, "peft_config", None)) and hasattr(self.model, "get_base_model")

    def adapter_config(self) -> dict[str, Any]:
        """The active adapter's PEFT config as a JSON-ready dict (``adapter_config.json``)."""
        if not self.adapter_only:
            raise ConfigError("adapter_config() needs a PEFT policy; this policy is fully fine-tuned")
        config = self.model.peft_config[self.model.active_adapter]  # type: ignore[index]
        return config.to_dict()

    def tensor_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of every tensor :meth:`named_tensors` yields, in its order, read without
        gathering or copying anything (what a collective transfer's manifest is planned from)."""
        shape = self.whole.full_shape if self.whole is not None else (lambda t: tuple(t.shape))
        return [(name, t.dtype, shape(t)) for name, t in self._live_tensors()]

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The tensors to sync, lazily (see the class docstring); consumers bucket them."""
        self._passes += 1  # counted when begun: a consumer that takes exactly every tensor never ends the loop
        if self.whole is None:
            yield from self._live_tensors()
        else:
            yield from self.whole.stream_whole(self._live_tensors())

    def complete(self) -> None:
        """After the backend took this version: iterate :meth:`named_tensors` once, dropping every tensor, if this
        rank's backend did not (a streamed sync is a collective every training rank takes part in)."""
        if self.whole is not None and self._passes == 0:
            for _ in self.named_tensors():
                pass

    def _live_tensors(self) -> Iterator[tuple[str, Tensor]]:
        keep_vars = self.whole is not None  # a strategy gathers the live parameters themselves
        if self.adapter_only:
            from peft import get_peft_model_state_dict

            yield from get_peft_model_state_dict(self.model, state_dict=self.model.state_dict(keep_vars=keep_vars)).items()
            return
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        yield from model.state_dict(keep_vars=keep_vars).items()
