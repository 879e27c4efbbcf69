"""The rollout protocol: what a trainer samples through, declared once.

A :class:`Rollout` takes this rank's drawn dataset rows (one per prompt, each with its
``prompt`` and whatever other columns the dataset has) and returns a
:class:`~grpo_ascend.rollout.backend.RolloutBatch` of ``num_generations`` completions per row.
Every sampler the trainer holds implements it: plain prompts on a backend
(:class:`PromptRollout`), tool calling with environments and a user's ``rollout_func``
(:mod:`grpo_ascend.rollout.row_rollouts`). Training, evaluation and the asynchronous producer
(:mod:`grpo_ascend.rollout.producer`) call only these methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.backend import RolloutBackend, RolloutBatch, images_refused
from grpo_ascend.rollout.image_prompts import VisionPromptEncoder
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.images import row_images


class Rollout(ABC):
    """Dataset rows in, a :class:`RolloutBatch` out; an evaluation copy; resources closed.

    ``backend`` is the :class:`RolloutBackend` the rollout samples with (weight sync and memory go
    through it); ``params`` is the run's sampling, used when a call passes none.
    """

    @property
    @abstractmethod
    def backend(self) -> RolloutBackend:
        """The sampler underneath."""

    @property
    def params(self) -> SamplingParams:
        """The run's sampling settings."""
        return self.backend.params

    @abstractmethod
    def generate_rows(self, rows: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                      generator: torch.Generator | None = None) -> RolloutBatch:
        """``params.num_generations`` completions per row (``params``: this call's sampling, default the run's)."""

    @property
    def samples_policy_module(self) -> bool:
        """Whether the batches' sampling log-probs come from the trainer's policy module itself (see
        :attr:`RolloutBackend.samples_policy_module`); False for completions made elsewhere."""
        return self.backend.samples_policy_module

    def for_evaluation(self) -> Rollout:
        """The rollout evaluation uses; one whose state training owns (environments) returns a copy."""
        return self

    def close(self) -> None:
        """Stop what the rollout keeps running between calls (threads, engines); it starts again when used."""
        return None


class PromptRollout(Rollout):
    """Plain prompts on a backend: each row's ``prompt`` sampled by :meth:`RolloutBackend.generate`; rows with
    images (a vision-language model's ``processor`` given) through :meth:`RolloutBackend.generate_with_images`."""

    def __init__(self, backend: RolloutBackend, processor: Any = None) -> None:
        if processor is not None and not backend.takes_images:
            raise ConfigError(images_refused(backend))
        self._backend = backend
        self._images = VisionPromptEncoder(processor) if processor is not None else None

    @property
    def backend(self) -> RolloutBackend:
        return self._backend

    def generate_rows(self, rows: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                      generator: torch.Generator | None = None) -> RolloutBatch:
        prompts = [r["prompt"] for r in rows]
        if self._images is None:
            return self._backend.generate(prompts, params, generator)
        params = self._backend.checked(params)
        encoded, images = self._images.encode(prompts, [row_images(r, i) for i, r in enumerate(rows)], params)
        return self._backend.generate_with_images(encoded.ids, images, params, generator, encoded.texts)

    def close(self) -> None:
        self._backend.close()
