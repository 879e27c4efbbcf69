"""What a vLLM request asks for and what its answer becomes, shared by the in-process engine and
the server client: our sampling settings as vLLM's, and vLLM's token ids and log-probs as a
:class:`~grpo_ascend.rollout.engine.RolloutBatch`.

Log-probs: vLLM runs with ``logprobs_mode='processed_logprobs'`` (as TRL), so the reported value
of a sampled token is ``log_softmax`` of the logits after the repetition penalty, the temperature
and the top-k / top-p / min-p filters. Without penalty and filters that is exactly what the
built-in engine reports, ``log_softmax(logits / T)``; with them it is the log-prob under the
proposal the token was drawn from, and the importance-sampling correction accounts for the rest.
Greedy requests (temperature 0) report ``log_softmax(logits)`` as the built-in engine does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_ascend.length_buckets import round_up
from grpo_ascend.rollout.backend import RolloutBatch
from grpo_ascend.rollout.prompts import cut_at_stop, left_pad
from grpo_ascend.rollout.sampling import SamplingParams

#: vLLM's log-prob mode the backends start engines with (see the module docstring).
LOGPROBS_MODE = "processed_logprobs"


def request_seed(params: SamplingParams, generator: torch.Generator | None) -> int | None:
    """The seed of one request: ``params.seed``, else one drawn from ``generator`` (so a seeded run
    is reproducible and each round differs), else None (vLLM's own randomness)."""
    if params.seed is not None:
        return int(params.seed)
    if generator is None:
        return None
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device).item())


def sampling_fields(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """vLLM SamplingParams fields for one prompt's group. Temperature 0 asks for one completion (vLLM refuses
    ``n > 1`` when greedy) that :func:`group_completions` copies G times."""
    greedy = params.temperature == 0
    return {
        "n": 1 if greedy else params.num_generations,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "min_p": float(params.min_p or 0.0),
        "repetition_penalty": float(params.repetition_penalty),
        "max_tokens": int(params.max_completion_length),
        "stop": list(params.stop_strings),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "ignore_eos": bool(params.ignore_eos),
        "logprobs": 0,
        "seed": seed,
        "skip_special_tokens": True,
    }


@dataclass(frozen=True)
class ImagePrompt:
    """One prompt's pictures for vLLM (RGB PIL images), the prompt the trainer reads (each image expanded into
    its tokens: what vLLM's own expansion must give) and the prompt's place in its batch (for messages)."""

    pictures: tuple[Any, ...]
    expanded: list[int]
    index: int


@dataclass
class Completion:
    """One sampled completion as a backend returns it: token ids, their log-probs, and whether it ended by a
    stop condition (EOS, stop token or stop string) rather than the length limit."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool


def group_completions(completions: Sequence[Completion], num_generations: int) -> list[Completion]:
    """A prompt's G completions: as given, or one greedy completion copied G times."""
    if len(completions) == num_generations:
        return list(completions)
    if len(completions) == 1:
        return list(completions) * num_generations
    raise RuntimeError(f"vLLM returned {len(completions)} completions for a group of {num_generations}")


def right_pad(rows: Sequence[Sequence[Any]], fill: Any, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows right-padded with ``fill`` to ``width`` as one host tensor."""
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)


def build_batch(tokenizer: Any, prompt_ids: Sequence[Sequence[int]], prompt_texts: Sequence[str],
                groups: Sequence[Sequence[Completion]], params: SamplingParams, pad_token_id: int,
                device: torch.device, length_bucket: int) -> RolloutBatch:
    """A RolloutBatch (rows ``i*G .. i*G+G-1`` = prompt ``i``) from each prompt's completions, laid out
    as the built-in engine lays them: prompts left-padded, completions right-padded to bucketed widths."""
    G = params.num_generations
    rows = [c for group in groups for c in group_completions(group, G)]
    p_ids, p_mask = left_pad(prompt_ids, pad_token_id, length_bucket, device)
    lengths = [len(c.token_ids) for c in rows]
    lc = max(1, round_up(max(lengths), length_bucket))
    c_mask = torch.tensor([[1] * n + [0] * (lc - n) for n in lengths], dtype=torch.long)
    texts = tokenizer.batch_decode([c.token_ids for c in rows], skip_special_tokens=True)
    if params.stop_strings:
        texts = [cut_at_stop(t, params.stop_strings) for t in texts]
    return RolloutBatch(
        prompt_ids=p_ids.repeat_interleave(G, dim=0),
        prompt_mask=p_mask.long().repeat_interleave(G, dim=0),
        completion_ids=right_pad([c.token_ids for c in rows], pad_token_id, lc, torch.long).to(device),
        completion_mask=c_mask.to(device),
        sampling_logprobs=right_pad([c.logprobs for c in rows], 0.0, lc, torch.float32).to(device),
        truncated=torch.tensor([not c.stopped for c in rows], dtype=torch.bool).to(device),
        prompt_texts=[t for t in prompt_texts for _ in range(G)],
        completion_texts=texts,
        num_generations=G,
        completion_lengths=c_mask.sum(1).to(device),
        timing={"tokens": float(sum(lengths))},
    )
