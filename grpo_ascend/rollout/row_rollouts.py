"""Rollouts that need the dataset rows, not just the prompts: tool calling with environments, and a
user's ``rollout_func`` (TRL 1.16's contract).

Both implement the :class:`~grpo_ascend.rollout.protocol.Rollout` protocol; their batches may
carry ``extra_columns`` (one value per completion row) that the reward functions receive as
keyword arguments, like dataset columns. A tool rollout's evaluation copy has environments of its
own, so that evaluation never touches the training rollouts' state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grpo_ascend.data.prompts import row_prompt
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.rollout.backend import RolloutBackend, RolloutBatch
from grpo_ascend.rollout.multiturn import MultiTurnEngine, ToolSettings
from grpo_ascend.rollout.protocol import Rollout
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.tools.environments import EnvironmentPool, append_observation
from grpo_ascend.tools.execution import ToolExecutor
from grpo_ascend.tools.toolset import Toolset, load_toolset
from grpo_ascend.tools.turns import check_tool_chat_template
from grpo_ascend.vision.images import row_images


class ToolRollout(Rollout):
    """Multi-turn tool calling over the trainer's engine, with per-rollout environments when given.

    Each round: one environment per completion row (``pool.start``), ``reset``'s observation added
    to the row's prompt, the row's toolset (standalone tools + its environment's methods) used for
    its calls; the environments reach the reward functions as the ``environments`` column. When
    the observations of a group differ, its rows are prefilled separately (no shared prompt).
    """

    def __init__(self, engine: MultiTurnEngine, pool: EnvironmentPool | None = None) -> None:
        self.multiturn = engine
        self.pool = pool

    @property
    def backend(self) -> RolloutBackend:
        """The backend the tool loop samples with."""
        return self.multiturn.backend

    def close(self) -> None:
        """Stop the tool executor's threads (they start again at the next rollout)."""
        self.multiturn.tools.executor.close()

    def generate_rows(self, rows: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                      generator: torch.Generator | None = None) -> RolloutBatch:
        """Tool rollouts of ``rows``; ``params``: this call's sampling (default the run's; evaluation passes its own).
        A row without a prompt (environments supply it) starts from an empty user message, as in TRL."""
        prompts = [row_prompt(r) for r in rows]
        params = params if params is not None else self.params
        images = ([row_images(r, i) for i, r in enumerate(rows)] if self.multiturn.processor is not None else None)
        if self.pool is None:
            return self.multiturn.generate(prompts, params, generator=generator, images=images)
        G = params.num_generations
        envs = self.pool.start([r for r in rows for _ in range(G)])
        observations = [e.observation for e in envs]
        toolsets = [e.toolset for e in envs]
        shared = all(len(set(observations[i * G : (i + 1) * G])) == 1 for i in range(len(prompts)))
        if shared:
            batch = self.multiturn.generate(
                [append_observation(p, observations[i * G]) for i, p in enumerate(prompts)], params,
                generator=generator, toolsets=toolsets, images=images,
            )
        else:
            per_row = [append_observation(prompts[k // G], observations[k]) for k in range(len(envs))]
            per_row_images = [images[k // G] for k in range(len(envs))] if images is not None else None
            batch = self.multiturn.generate(per_row, _with_group(params, 1), generator=generator, toolsets=toolsets,
                                            images=per_row_images)
            batch.num_generations = G
        batch.extra_columns = {"environments": [e.instance for e in envs]}
        return batch

    def for_evaluation(self) -> ToolRollout:
        """The same rollout with environments of its own (new instances from the same factories), so
        evaluation never resets, advances or grows the training rollouts' environments."""
        if self.pool is None:
            return self
        factories = self.pool.factories if self.pool.multi else self.pool.factories[None]
        return ToolRollout(self.multiturn, EnvironmentPool(factories, self.pool.tools))


def _with_group(params: Any, group: int) -> Any:
    return dataclasses.replace(params, num_generations=group)


def prepare_tools(tools: Any, environment_factory: Any) -> tuple[Toolset | None, EnvironmentPool | None]:
    """The standalone toolset and the environment pool of ``GRPOTrainer(tools=..., environment_factory=...)``
    (None, None without either). ``tools``: callables, recipe specs or a :class:`Toolset`."""
    if not tools and environment_factory is None:
        return None, None
    toolset = tools if isinstance(tools, Toolset) else load_toolset(tools or [])
    pool = EnvironmentPool(environment_factory, toolset) if environment_factory is not None else None
    return toolset, pool


def build_tool_rollout(
    backend: RolloutBackend, tokenizer: Any, args: Any, toolset: Toolset, pool: EnvironmentPool | None,
    processor: Any = None,
) -> ToolRollout:
    """The multi-turn tool rollout over ``backend`` with the config's parser, timeout, output and
    iteration limits; checks that the chat template renders tool conversations. ``processor``: a
    vision-language model's (prompts keep their images, tools may return images)."""
    kwargs = getattr(args, "chat_template_kwargs", None)
    check_tool_chat_template(tokenizer, kwargs)
    executor = ToolExecutor(timeout=args.tool_timeout, max_output_chars=args.tool_max_output_chars,
                            takes_images=processor is not None)
    settings = ToolSettings(toolset, executor, parser=args.tool_call_parser,
                            max_tool_calling_iterations=args.max_tool_calling_iterations, chat_template_kwargs=kwargs)
    return ToolRollout(MultiTurnEngine(backend, settings, processor), pool)


#: ``rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", ...extra}`` (TRL 1.16).
RolloutFunc = Callable[[list[Any], Any], Mapping[str, Any]]
_REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


class RolloutFuncTrainer:
    """What a ``rollout_func`` receives as ``trainer``: the trainer, seen with ``rollout_params`` (the
    call's sampling) added; every other attribute is the trainer's own, read and set through."""

    def __init__(self, trainer: Any, rollout_params: SamplingParams) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "rollout_params", rollout_params)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_trainer"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_trainer"), name, value)


class RolloutFuncRollout(Rollout):
    """Calls a user's ``rollout_func`` (TRL 1.16 contract) and turns its output into a batch.

    ``rollout_func(prompts, trainer)`` receives this rank's prompts (no repetition) and returns
    ``prompt_ids`` and ``completion_ids`` (one list of ids per completion,
    ``trainer.rollout_params.num_generations`` per prompt, in prompt order; ``rollout_params`` is
    the call's sampling: the run's in training, the sampled or greedy pass's in evaluation),
    ``logprobs`` (one float per completion token) and optionally ``env_mask`` (1 on model tokens,
    0 on tokens the model did not generate: out of the loss).
    Every other key goes to the reward functions: a list (one value per completion) or a value
    shared by all. A completion counts as truncated when it does not end with an EOS id.
    """

    def __init__(self, rollout_func: RolloutFunc, trainer: Any, backend: RolloutBackend) -> None:
        if not callable(rollout_func):
            raise ConfigError(f"rollout_func must be callable (prompts, trainer) -> dict, got {rollout_func!r}")
        self.rollout_func = rollout_func
        self.trainer = trainer
        self._backend = backend

    @property
    def backend(self) -> RolloutBackend:
        return self._backend

    @property
    def samples_policy_module(self) -> bool:
        """A rollout_func samples on its own: its log-probs are not the training forward's."""
        return False

    def generate_rows(self, rows: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                      generator: torch.Generator | None = None) -> RolloutBatch:
        prompts = [r["prompt"] for r in rows]
        params = params if params is not None else self.params
        G = params.num_generations
        out = self.rollout_func(prompts, RolloutFuncTrainer(self.trainer, params))
        if not isinstance(out, Mapping):
            raise DataError(f"rollout_func must return a dict with {list(_REQUIRED)}, got {type(out).__name__}")
        missing = [k for k in _REQUIRED if k not in out]
        if missing:
            raise DataError(f"rollout_func must return keys {missing} in its output dict (got {sorted(out)})")
        n = len(prompts) * G
        for key in ("prompt_ids", "completion_ids", "logprobs", *(("env_mask",) if "env_mask" in out else ())):
            if len(out[key]) != n:
                raise DataError(
                    f"rollout_func returned {len(out[key])} {key} for {len(prompts)} prompts × num_generations={G}; "
                    f"return {n}, trainer.rollout_params.num_generations ({G}) per prompt in prompt order"
                )
        completion_ids = [list(map(int, c)) for c in out["completion_ids"]]
        for i, (c, lp) in enumerate(zip(completion_ids, out["logprobs"])):
            if len(lp) != len(c):
                raise DataError(f"rollout_func: completion {i} has {len(c)} tokens but {len(lp)} logprobs")
        env_mask = out.get("env_mask")
        extra = {}
        for key, value in out.items():
            if key in _REQUIRED or key == "env_mask":
                continue
            extra[key] = list(value) if isinstance(value, list) and len(value) == n else [value] * n
        return self._batch(prompts, [list(map(int, p)) for p in out["prompt_ids"]], completion_ids,
                           out["logprobs"], env_mask, extra, G)

    def _batch(self, prompts: list[Any], prompt_ids: list[list[int]], completion_ids: list[list[int]],
               logprobs: Sequence[Sequence[float]], env_mask: Sequence[Sequence[int]] | None,
               extra: dict[str, list[Any]], G: int) -> RolloutBatch:
        backend, dev, pad = self.backend, self.backend.device, self.backend.pad_token_id
        lp_width = max(len(p) for p in prompt_ids)
        lc = max(1, max(len(c) for c in completion_ids))
        p_ids = torch.tensor([[pad] * (lp_width - len(p)) + p for p in prompt_ids], dtype=torch.long)
        p_mask = torch.tensor([[0] * (lp_width - len(p)) + [1] * len(p) for p in prompt_ids], dtype=torch.long)
        c_ids = torch.tensor([c + [pad] * (lc - len(c)) for c in completion_ids], dtype=torch.long)
        c_mask = torch.tensor([[1] * len(c) + [0] * (lc - len(c)) for c in completion_ids], dtype=torch.long)
        c_lp = torch.tensor([[float(x) for x in lp] + [0.0] * (lc - len(lp)) for lp in logprobs], dtype=torch.float32)
        if not torch.isfinite(c_lp).all():
            raise DataError("rollout_func returned non-finite logprobs")
        tool = None
        if env_mask is not None:
            tool = torch.tensor([list(map(int, m)) + [0] * (lc - len(m)) for m in env_mask], dtype=torch.long).to(dev)
        eos = set(backend.eos_token_ids)
        truncated = torch.tensor([not c or c[-1] not in eos for c in completion_ids])
        return RolloutBatch(
            prompt_ids=p_ids.to(dev), prompt_mask=p_mask.to(dev), completion_ids=c_ids.to(dev),
            completion_mask=c_mask.to(dev), sampling_logprobs=c_lp.to(dev), truncated=truncated.to(dev),
            prompt_texts=backend.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False),
            completion_texts=backend.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            num_generations=G, completion_lengths=c_mask.sum(1).to(dev), tool_mask=tool, extra_columns=extra,
        )
