"""Prompts with images over HTTP: vLLM's token-in/token-out endpoint ``/inference/v1/generate`` takes a prompt's
token ids (one placeholder per picture, vision.py) with its pictures as ``content_parts`` (``image_url`` parts
holding PNG data URLs), runs the model's processor on them and answers token ids and log-probs. The server must
have the endpoint on (``--enable-scale-out``; our entry point grpo_ascend.rollout.vllm.serve adds it)."""

from __future__ import annotations

import base64
import io
from typing import Any

from grpo_ascend.rollout.vllm.requests import Completion, ImagePrompt
from grpo_ascend.rollout.vllm.server_http import ServerError
from grpo_ascend.rollout.vllm.vision import check_expansion

#: vLLM's endpoint for token-id prompts with multi-modal data.
GENERATE_PATH = "/inference/v1/generate"


def png_data_url(picture: Any) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (lossless: the server decodes the very pixels)."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def generate_body(model: str, prompt: list[int], image: ImagePrompt, fields: dict[str, Any]) -> dict[str, Any]:
    """The ``/inference/v1/generate`` request of one prompt with pictures under vLLM sampling ``fields``."""
    sampling = {k: v for k, v in fields.items() if v is not None}
    return {"model": model, "token_ids": [int(t) for t in prompt], "sampling_params": sampling,
            "content_parts": [{"type": "image_url", "url": png_data_url(p)} for p in image.pictures],
            "return_token_ids": True}


def generate_completions(answer: Any, n: int, image: ImagePrompt) -> list[Completion]:
    """The ``n`` choices of one ``/inference/v1/generate`` answer; the server's expanded prompt is checked against
    the trainer's."""
    if not isinstance(answer, dict):
        raise ServerError(f"the vLLM server answered {GENERATE_PATH} with {str(answer)[:200]!r}, not JSON")
    check_expansion(image.expanded, answer.get("prompt_token_ids"), image.index, len(image.pictures))
    choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise ServerError(f"the vLLM server returned {len(choices)} choices for n={n}")
    out = []
    for c in choices:
        ids = [int(t) for t in c.get("token_ids") or []]
        logprobs = [float(x["logprob"]) for x in ((c.get("logprobs") or {}).get("content") or [])]
        if len(logprobs) != len(ids):
            raise ServerError(f"the vLLM server returned {len(logprobs)} log-probs for {len(ids)} tokens")
        out.append(Completion(token_ids=ids, logprobs=logprobs, stopped=c.get("finish_reason") == "stop"))
    return out
