"""The rollout seam: what every sampler behind the trainer implements, and how one is chosen by name.

A :class:`RolloutBackend` samples G completions per prompt with the sampler's own per-token
log-probs, token ids in and out (a prompt is tokenized once, here, and never re-tokenised by the
backend). The built-in engine (``"builtin"``, :mod:`grpo_ascend.rollout.engine`) and a serving
engine such as vLLM implement it; the trainer, evaluation, multi-turn tool loops and a user's
``rollout_func`` see only this interface:

- :meth:`RolloutBackend.generate` / :meth:`RolloutBackend.generate_ids`: grouped completions
  (prompts as text / chat messages, or as token ids) -> :class:`RolloutBatch`.
- :meth:`RolloutBackend.start_session`: a :class:`RolloutSession` that continues a batch of
  token-id contexts until each row stops, lets the caller append tokens the policy did not
  generate (tool responses) and continue; the multi-turn tool loop drives it.
- :meth:`RolloutBackend.sync_weights`: take the policy's current weights (:class:`PolicyWeights`:
  LoRA adapter only, or full named tensors); a no-op for a backend that runs the policy module itself.
  :meth:`RolloutBackend.publish_weights`: the same without waiting for the sampler to load them, where
  a backend can (a producer sampling ahead of training; the vLLM server client loads adapters on a thread).
- :meth:`RolloutBackend.release_memory` / :meth:`RolloutBackend.restore_memory`: give back the
  device memory the backend holds between rollouts (KV cache, a weight copy) and take it again.

:func:`serving` wraps one generation phase (restore, sync, release); :func:`build_backend` makes
the backend a ``rollout_backend`` setting names, from a registry (:func:`register_backend`).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.prompts import Prompt, PromptEncoder
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.inputs import PromptImages, RowVision, ToolImages

#: What to use instead, for a backend that cannot run a vision-language model's tool loop.
USE_BUILTIN_FOR_TOOL_IMAGES = "set use_vllm: false and rollout_mode: sync (the built-in engine in the trainer's process)"


def tool_images_refused(backend: RolloutBackend) -> str:
    """The line a backend without multi-turn image support answers a vision-language model's tools with."""
    return (f"tools with a vision-language model (prompt or tool images in a multi-turn rollout) are not supported on "
            f"the {type(backend).__name__} backend; " + USE_BUILTIN_FOR_TOOL_IMAGES)


def images_refused(backend: RolloutBackend) -> str:
    """The line a backend that takes no images answers prompts with images with."""
    return (f"the {type(backend).__name__} rollout backend does not take prompts with images yet; sample them with "
            "the built-in engine (use_vllm: false)")


@dataclass
class RolloutBatch:
    """Sampled completions for a batch of prompts, every tensor on the trainer's device.

    ``N = num_prompts * num_generations``; rows ``i*G .. i*G+G-1`` belong to prompt ``i``.
    ``completion_mask`` is 1 up to and including the first EOS/stop token (or up to the length
    limit) and 0 after; ``completion_ids`` hold the pad id and ``sampling_logprobs`` 0 where the
    mask is 0. ``sampling_logprobs`` are ``log_softmax(logits / T)`` of the chosen tokens, before
    any top-k/top-p/min-p/repetition-penalty filtering (T = 1 for greedy); see
    :mod:`grpo_ascend.rollout.sampling`. ``prompt_texts`` are the rendered prompts (chat template
    applied), one per row like ``completion_texts``. Extras: ``completion_lengths`` [N] (tokens
    counted by the mask), ``timing`` (seconds per phase, steps, tokens; ``weight_wait_s``: seconds the request
    waited for a weight load, where the sampler reports it) and ``decode_batch_sizes`` (the batch size after each
    compaction, starting with N).

    What some rollouts add (defaults: none): ``tool_mask`` [N, Lc], 1 on tokens the policy
    generated and 0 on tokens it did not (tool responses, a ``rollout_func``'s ``env_mask``; the
    loss mask is ``completion_mask * tool_mask``); ``messages``, each row's completion as chat
    messages; ``num_turns`` [N], assistant turns per row; ``tool_metrics``, the tool loop's
    numbers; ``extra_columns``, per-row values the reward functions receive as keyword arguments
    (e.g. ``environments``); ``policy_versions`` [N, Lc], the policy version that sampled each
    token (asynchronous rollouts; None: the trainer's current weights sampled every token); ``vision``,
    each row's image inputs (prompts with images; vision/inputs.py).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    sampling_logprobs: Tensor
    truncated: Tensor
    prompt_texts: list[str]
    completion_texts: list[str]
    num_generations: int
    completion_lengths: Tensor | None = None
    timing: dict[str, float] = field(default_factory=dict)
    decode_batch_sizes: list[int] = field(default_factory=list)
    tool_mask: Tensor | None = None
    messages: list[list[dict[str, Any]]] = field(default_factory=list)
    num_turns: Tensor | None = None
    tool_metrics: dict[str, float] = field(default_factory=dict)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    vision: RowVision | None = None
    policy_versions: Tensor | None = None

    @property
    def num_prompts(self) -> int:
        """Number of distinct prompts."""
        return self.prompt_ids.shape[0] // self.num_generations

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


@dataclass
class TurnEnd:
    """A session row that stopped at this :meth:`RolloutSession.advance`.

    ``tokens``: the tokens it generated since it last (re)started, its stop token included;
    ``stopped``: True when it ended on an EOS / stop token id, False when it reached the length
    limit mid-turn; ``length``: completion tokens the row holds now (generated and appended).
    """

    row: int
    tokens: list[int]
    stopped: bool
    length: int


@dataclass
class SessionOutput:
    """What a finished :class:`RolloutSession` produced, rows as in :meth:`RolloutBackend.start_session`.

    ``prompt_ids`` / ``prompt_mask`` [N, Lp]: each row's prompt, left-padded (mask long);
    ``completion_ids`` / ``sampling_logprobs`` / ``generated`` are [N, W] (W a bucketed width
    >= the longest row); ``generated`` is True on tokens the policy sampled, False on appended
    tokens and padding; ``lengths`` [N] counts each row's tokens (sampled and appended).
    ``steps``: decode steps run; ``decode_batch_sizes``: see :class:`RolloutBatch`.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    sampling_logprobs: Tensor
    generated: Tensor
    lengths: Tensor
    steps: int
    decode_batch_sizes: list[int] = field(default_factory=list)
    #: [N, W] the policy version that sampled each token (an appended token takes its turn's), None: not tracked.
    policy_versions: Tensor | None = None
    #: Each row's tool images (completion columns), None per row without; empty: no row has any.
    tool_images: list[ToolImages | None] = field(default_factory=list)


class RolloutSession(ABC):
    """A batch of token-id contexts (G rows per prompt) continued until each row stops.

    Rows are numbered ``0 .. N-1`` (``i*G + g`` for prompt ``i``). Each :meth:`advance` samples
    the running rows until at least one of them ends (a stop / EOS id, or the length limit) and
    returns those rows; each returned row is paused: :meth:`append` tokens to it (a tool response
    and the next turn's header) to continue it at the next :meth:`advance`, or leave it and it is
    finished. A backend may return more rows per call than another (the built-in engine returns at
    the first step where any row ends; a server returns when every submitted row has stopped).
    Use it as a context manager (``with backend.start_session(...) as session:``).
    """

    @abstractmethod
    def advance(self) -> list[TurnEnd]:
        """Continue every running row until some stop; the rows that stopped (empty: none is left)."""

    @abstractmethod
    def append(self, row: int, token_ids: Sequence[int]) -> None:
        """Add tokens the policy did not generate to paused ``row`` (out of the log-probs); it continues."""

    def append_with_images(self, row: int, token_ids: Sequence[int], images: ToolImages) -> None:
        """As :meth:`append`, ``images`` being the tool images among the tokens (columns from ``token_ids``' start);
        only sessions of a backend that :attr:`RolloutBackend.takes_tool_images` implement it."""
        raise ConfigError(f"the {type(self).__name__} session cannot take a tool's images; " + USE_BUILTIN_FOR_TOOL_IMAGES)

    @abstractmethod
    def output(self) -> SessionOutput:
        """The completions once :meth:`advance` returned no rows."""

    def close(self) -> None:
        """Give back what the session holds (cache, model mode); called on leaving a ``with`` block."""
        return None

    def __enter__(self) -> RolloutSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RolloutBackend(ABC):
    """A sampler of grouped completions; see the module docstring.

    Subclasses set ``tokenizer`` and ``params`` (the run's sampling, used when a call passes
    none) and implement the abstract methods. ``backend`` is the object itself, so a wrapping
    rollout (tool loops, ``rollout_func``) and a backend both answer ``rollout.backend``.
    """

    tokenizer: Any
    params: SamplingParams
    #: True when the backend samples with the trainer's policy module in place (the built-in engine), so
    #: the trainer's speed-ups of that module apply (LoRA folded into the weights while generating); a
    #: backend holding its own copy of the weights takes them through :meth:`sync_weights` instead.
    samples_policy_module: ClassVar[bool] = False
    #: True when :meth:`sync_weights` reads only :meth:`PolicyWeights.named_tensors`, so a sharded strategy may
    #: stream them one at a time; False when it reads the policy module whole (the trainer gathers it first).
    streams_weights: ClassVar[bool] = True
    #: True when :meth:`generate_with_images` feeds prompts' images to the model.
    takes_images: ClassVar[bool] = False
    #: True when :meth:`start_image_session` works and its sessions take tool images
    #: (:meth:`RolloutSession.append_with_images`): multi-turn tool rollouts of a vision-language model.
    takes_tool_images: ClassVar[bool] = False

    @property
    def backend(self) -> RolloutBackend:
        return self

    @property
    def prompts(self) -> PromptEncoder:
        """Renders and tokenizes prompts for this backend's tokenizer (one place for every backend)."""
        return PromptEncoder(self.tokenizer)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the batches' tensors are put (the trainer's device)."""

    @property
    @abstractmethod
    def pad_token_id(self) -> int:
        """The id completions and prompts are padded with."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> list[int]:
        """Ids that end a completion (unless ``ignore_eos``): the tokenizer's and the model's."""

    def checked(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (default the run's) validated."""
        params = params if params is not None else self.params
        params.validate()
        return params

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> RolloutBatch:
        """``params.num_generations`` completions for each prompt (text or chat messages)."""
        params = self.checked(params)
        encoded = self.prompts.encode(prompts, params)
        return self.generate_ids(encoded.ids, params, generator, prompt_texts=encoded.texts)

    def generate_with_images(
        self, prompt_ids: Sequence[Sequence[int]], images: Sequence[PromptImages], params: SamplingParams | None = None,
        generator: torch.Generator | None = None, prompt_texts: Sequence[str] | None = None,
    ) -> RolloutBatch:
        """Completions for prompts with images: token ids with each image's tokens expanded, and each prompt's
        image inputs (rollout/image_prompts.py). Only backends that feed images to the model implement it."""
        raise ConfigError(images_refused(self))

    @abstractmethod
    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
        generator: torch.Generator | None = None, prompt_texts: Sequence[str] | None = None,
    ) -> RolloutBatch:
        """Completions for prompts given as token ids (``prompt_texts``: their rendered texts, else decoded).

        ``generator`` seeds the sampling (a backend that cannot take a torch generator derives
        its seeds from it); ``params.seed`` reseeds every call.
        """

    @abstractmethod
    def start_session(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> RolloutSession:
        """A :class:`RolloutSession` over ``num_generations`` rows per prompt (stop strings unsupported)."""

    def start_image_session(
        self, prompt_ids: Sequence[Sequence[int]], images: Sequence[PromptImages | None],
        params: SamplingParams | None = None, generator: torch.Generator | None = None,
    ) -> RolloutSession:
        """As :meth:`start_session`, each prompt's image inputs encoded with it; only backends that
        :attr:`takes_tool_images` implement it."""
        raise ConfigError(tool_images_refused(self))

    @abstractmethod
    def sync_weights(self, weights: PolicyWeights) -> None:
        """Sample from ``weights`` from now on (a no-op when the backend runs the policy module itself)."""

    def set_training_rank(self, rank: int) -> None:
        """Which training process this backend serves (0: the first). A sampler every rank shares (a server) lets
        the first rank load new weights and has the others wait until it serves them; default: nothing."""
        return None

    def publish_weights(self, weights: PolicyWeights) -> None:
        """Hand ``weights`` over as the next version without waiting for the sampler to serve them, where the
        backend can (rollouts ahead of training push from the trainer's thread while a producer samples): the
        backend takes what it needs of ``weights`` before returning, and a later request samples with them, as
        after :meth:`sync_weights`. Default: :meth:`sync_weights`."""
        self.sync_weights(weights)

    @abstractmethod
    def release_memory(self) -> None:
        """Free the device memory the backend holds between rollouts (a weight copy, KV cache blocks)."""

    @abstractmethod
    def restore_memory(self) -> None:
        """Take back what :meth:`release_memory` freed, before the next rollout."""

    def close(self) -> None:
        """Stop what the backend keeps running (threads, an in-process server); default: nothing runs."""
        return None

    def pinned(self, version: int | None) -> contextlib.AbstractContextManager:
        """Inside the block, the calling thread asks for policy ``version`` (None: the newest synced); nested
        pins restore the outer one. A backend that keeps several versions reads :attr:`pinned_version`; one
        holding a single version at a time samples with that one."""
        return _ThreadPin(self._thread_pins(), version)

    @property
    def pinned_version(self) -> int | None:
        """The version the calling thread pinned (None: the newest synced)."""
        return getattr(self._thread_pins(), "version", None)

    def _thread_pins(self) -> threading.local:
        return self.__dict__.setdefault("_pins", threading.local())


class _ThreadPin:
    """One thread's ``with backend.pinned(version):`` block."""

    def __init__(self, pins: threading.local, version: int | None) -> None:
        self.pins, self.version = pins, version

    def __enter__(self) -> None:
        self.outer = getattr(self.pins, "version", None)
        self.pins.version = self.version

    def __exit__(self, *exc: object) -> None:
        self.pins.version = self.outer


@contextlib.contextmanager
def serving(backend: RolloutBackend, weights: Callable[[], PolicyWeights]) -> Iterator[None]:
    """One generation phase: memory restored, the policy's weights synced, memory released after.

    ``weights`` is called once, inside the caller's rollout context (whole weights when sharded).
    """
    backend.restore_memory()
    current = weights()
    backend.sync_weights(current)
    current.complete()
    try:
        yield
    finally:
        backend.release_memory()


#: ``factory(policy, tokenizer, params, args) -> RolloutBackend``; ``args``: the run's config.
BackendFactory = Callable[[nn.Module, Any, SamplingParams, Any], RolloutBackend]

#: name -> factory, or "module:attribute" imported when the name is first built (optional dependencies).
_BACKENDS: dict[str, BackendFactory | str] = {
    "builtin": "grpo_ascend.rollout.builtin:build_builtin_backend",
    "vllm": "grpo_ascend.rollout.vllm.factory:build_vllm_backend",
}


def register_backend(name: str, factory: BackendFactory | str) -> None:
    """Make ``rollout_backend: name`` build its backend with ``factory`` (a callable or "module:attribute")."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a rollout backend name must be a non-empty string, got {name!r}")
    _BACKENDS[name] = factory


def backend_names() -> list[str]:
    """The registered backend names."""
    return sorted(_BACKENDS)


def check_backend_name(name: str) -> None:
    """Raise a clear error when ``name`` is not a registered backend."""
    if name not in _BACKENDS:
        raise ConfigError(f"rollout_backend={name!r} is not a known rollout backend; choose one of {backend_names()}")


def build_backend(name: str, policy: nn.Module, tokenizer: Any, params: SamplingParams, args: Any) -> RolloutBackend:
    """The backend ``name`` over ``policy`` with the run's sampling ``params`` and config ``args``."""
    check_backend_name(name)
    factory = _BACKENDS[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    backend = factory(policy, tokenizer, params, args)
    if not isinstance(backend, RolloutBackend):
        raise ConfigError(f"rollout backend {name!r} built {type(backend).__name__}, not a RolloutBackend")
    return backend

