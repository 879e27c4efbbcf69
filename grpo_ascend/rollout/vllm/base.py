"""What the in-process engine and the server client share: the rollout seam over one primitive,
"complete these token-id prompts with these vLLM sampling fields" (:meth:`VLLMBackend.complete`).

Grouped generation asks for ``n = G`` completions per prompt; a multi-turn session resubmits each
running row's context (prompt + completion so far, token ids) with ``n = 1`` and the tokens left,
so vLLM's prefix cache serves the part it has seen. Prompts with images (a vision-language model, vision.py)
go as their placeholder prompt plus their pictures, one request per group.
"""

from __future__ import annotations

import dataclasses
import time
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from grpo_ascend.errors import ConfigError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.rollout.backend import RolloutBackend, RolloutBatch, RolloutSession, SessionOutput, TurnEnd
from grpo_ascend.rollout.prompts import left_pad
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm.requests import (
    Completion,
    ImagePrompt,
    build_batch,
    request_seed,
    right_pad,
    sampling_fields,
)
from grpo_ascend.rollout.vllm.vision import placeholder_prompt
from grpo_ascend.vision.inputs import PromptImages, RowVision


class VLLMBackend(RolloutBackend):
    """A vLLM-backed rollout; subclasses implement :meth:`complete`, weight sync and memory.

    ``eos_token_ids``: the ids vLLM stops at (the tokenizer's and the model's generation config's).
    ``length_bucket``: padding multiple of the returned tensors. Subclasses serving a vision-language model set
    ``image_token`` (its image token id, vision.py) so that :meth:`generate_with_images` works.
    """

    #: The served model's image token id; None: a text-only model (prompts with images are refused).
    image_token: int | None = None

    @property  # type: ignore[override]
    def takes_images(self) -> bool:  # type: ignore[override]
        """Whether the served model is a vision-language model vLLM serves with images here (vision.py)."""
        return self.image_token is not None

    def __init__(self, tokenizer: Any, params: SamplingParams, *, device: torch.device | str,
                 eos_token_ids: Sequence[int], length_bucket: int = 1) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._device = torch.device(device)
        self._eos = [int(i) for i in eos_token_ids]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._pad = int(pad)
        self.length_bucket = max(1, int(length_bucket))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pad_token_id(self) -> int:
        return self._pad

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    @abstractmethod
    def complete(self, prompt_ids: Sequence[Sequence[int]], fields: Sequence[dict[str, Any]],
                 keys: Sequence[int] | None = None,
                 images: Sequence[ImagePrompt | None] | None = None) -> list[list[Completion]]:
        """Each prompt's completions under its vLLM sampling ``fields`` (:func:`requests.sampling_fields`).
        ``keys``: each prompt's group (default its index), for a backend that spreads requests over servers;
        ``images``: each prompt's pictures (None: none), its ``prompt_ids`` then holding one placeholder per
        picture; vLLM's expanded prompt is checked against :attr:`ImagePrompt.expanded`."""

    def sampled_version(self) -> int | None:
        """The policy version the calling thread's last :meth:`complete` sampled with (None: not tracked)."""
        return None

    def weight_wait_s(self) -> float:
        """Seconds the calling thread's last :meth:`complete` waited for a weight load before sampling."""
        return 0.0

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
                     generator: torch.Generator | None = None,
                     prompt_texts: Sequence[str] | None = None) -> RolloutBatch:
        return self._generate(prompt_ids, None, params, generator, prompt_texts)

    def generate_with_images(self, prompt_ids: Sequence[Sequence[int]], images: Sequence[PromptImages | None],
                             params: SamplingParams | None = None, generator: torch.Generator | None = None,
                             prompt_texts: Sequence[str] | None = None) -> RolloutBatch:
        """Prompts with images (token ids with each image expanded, as the trainer reads them): each prompt's
        pictures go to vLLM as multi-modal data, its G completions one request; rows without images mix in."""
        if self.image_token is None:
            raise ConfigError(f"the {type(self).__name__} rollout backend serves a text-only model, so it cannot take "
                              "prompts with images; serve the vision-language policy's base model")
        requests: list[ImagePrompt | None] = []
        for i, (ids, inputs) in enumerate(zip(prompt_ids, images)):
            if inputs is None or inputs.num_images == 0:
                requests.append(None)
            elif len(inputs.pictures) != inputs.num_images:
                raise ConfigError(f"prompt {i} has {inputs.num_images} image(s) but carries {len(inputs.pictures)} "
                                  "pictures; vLLM processes the pictures themselves: build its PromptImages with "
                                  "PromptImages.from_processor(outputs, num_images, pictures)")
            else:
                requests.append(ImagePrompt(tuple(inputs.pictures), [int(t) for t in ids], i))
        batch = self._generate(prompt_ids, requests, params, generator, prompt_texts)
        batch.vision = RowVision.repeated(list(images), batch.num_generations)
        return batch

    def _generate(self, prompt_ids: Sequence[Sequence[int]], images: list[ImagePrompt | None] | None,
                  params: SamplingParams | None, generator: torch.Generator | None,
                  prompt_texts: Sequence[str] | None) -> RolloutBatch:
        params = self.checked(params)
        seed = request_seed(params, generator)
        G = params.num_generations
        fields = [sampling_fields(params, None if seed is None else seed + i * G) for i in range(len(prompt_ids))]
        started = time.perf_counter()
        if images is None:
            groups = self.complete(prompt_ids, fields)
        else:
            sent = [list(p) if img is None else placeholder_prompt(p, int(self.image_token))  # type: ignore[arg-type]
                    for p, img in zip(prompt_ids, images)]
            groups = self.complete(sent, fields, images=images)
        texts = list(prompt_texts) if prompt_texts is not None else self.tokenizer.batch_decode(
            [list(p) for p in prompt_ids], skip_special_tokens=False)
        batch = build_batch(self.tokenizer, prompt_ids, texts, groups, params, self.pad_token_id, self.device,
                            self.length_bucket)
        version = self.sampled_version()
        if version is not None:
            batch.policy_versions = torch.full_like(batch.completion_ids, version)
        batch.timing["total_s"] = time.perf_counter() - started
        batch.timing["weight_wait_s"] = self.weight_wait_s()
        return batch

    def start_session(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
                      generator: torch.Generator | None = None) -> RolloutSession:
        params = self.checked(params)
        return VLLMSession(self, prompt_ids, params, request_seed(params, generator))


class VLLMSession(RolloutSession):
    """Token-id contexts continued through :meth:`VLLMBackend.complete`; every running row is submitted
    at each :meth:`advance` (one request each, ``n = 1``) and all of them return at once."""

    def __init__(self, backend: VLLMBackend, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 seed: int | None) -> None:
        G = params.num_generations
        self.backend, self.params, self.seed = backend, params, seed
        self.prompts = [list(p) for p in prompt_ids for _ in range(G)]
        n = len(self.prompts)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.generated: list[list[bool]] = [[] for _ in range(n)]
        self.versions: list[list[int]] = [[] for _ in range(n)]  # per token (versions tracked by the backend)
        self.running = set(range(n))
        self.paused: set[int] = set()
        self.rounds = 0

    def advance(self) -> list[TurnEnd]:
        rows = sorted(self.running)
        self.running, self.paused = set(), set()
        if not rows:
            return []
        limit = self.params.max_completion_length
        ends = [TurnEnd(r, [], False, len(self.tokens[r])) for r in rows if len(self.tokens[r]) >= limit]
        rows = [r for r in rows if len(self.tokens[r]) < limit]
        if rows:
            n = len(self.prompts)
            params = dataclasses.replace(self.params, num_generations=1, stop_strings=())
            fields = []
            for r in rows:
                f = sampling_fields(params, None if self.seed is None else self.seed + self.rounds * n + r)
                f["max_tokens"] = limit - len(self.tokens[r])
                fields.append(f)
            self.rounds += 1
            G = self.params.num_generations
            outs = self.backend.complete([self.prompts[r] + self.tokens[r] for r in rows], fields,
                                         keys=[r // G for r in rows])
            version = self.backend.sampled_version()
            for r, (c,) in zip(rows, outs):
                self.tokens[r].extend(c.token_ids)
                self.logprobs[r].extend(c.logprobs)
                self.generated[r].extend([True] * len(c.token_ids))
                self.versions[r].extend([-1 if version is None else version] * len(c.token_ids))
                ends.append(TurnEnd(r, list(c.token_ids), c.stopped, len(self.tokens[r])))
        self.paused = {e.row for e in ends}
        return sorted(ends, key=lambda e: e.row)

    def append(self, row: int, token_ids: Sequence[int]) -> None:
        ids = [int(t) for t in token_ids]
        if row not in self.paused:
            raise ConfigError(f"row {row} is not paused: append to rows the last advance() returned, once each")
        if len(self.tokens[row]) + len(ids) >= self.params.max_completion_length:
            raise ConfigError(f"appending {len(ids)} tokens to row {row} at {len(self.tokens[row])} leaves no room "
                              f"under max_completion_length={self.params.max_completion_length}")
        self.paused.discard(row)
        self.tokens[row].extend(ids)
        self.logprobs[row].extend([0.0] * len(ids))
        self.generated[row].extend([False] * len(ids))
        self.versions[row].extend([self.versions[row][-1] if self.versions[row] else -1] * len(ids))
        self.running.add(row)

    def output(self) -> SessionOutput:
        lengths = [len(t) for t in self.tokens]
        width = max(1, round_up(max(lengths), self.backend.length_bucket))
        dev = self.backend.device
        prompt_ids, prompt_mask = left_pad(self.prompts, self.backend.pad_token_id, self.backend.length_bucket, dev)
        return SessionOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask.long(),
            completion_ids=right_pad(self.tokens, self.backend.pad_token_id, width, torch.long).to(dev),
            sampling_logprobs=right_pad(self.logprobs, 0.0, width, torch.float32).to(dev),
            generated=right_pad(self.generated, False, width, torch.bool).to(dev),
            lengths=torch.tensor(lengths, dtype=torch.long).to(dev),
            steps=self.rounds,
            policy_versions=self._versions(width, dev),
        )

    def _versions(self, width: int, device: torch.device) -> torch.Tensor | None:
        """Each token's sampling version, padding taking the row's newest; None when the backend tracks none."""
        if self.backend.sampled_version() is None:
            return None
        newest = max((x for v in self.versions for x in v), default=0)
        rows = [v + [v[-1] if v else newest] * (width - len(v)) for v in self.versions]
        return torch.tensor(rows, dtype=torch.long, device=device)
