"""What every smoke check is given: the device, precision, models, sizes, output folder and the time left."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.data.prompts import load_prompt_dataset
from grpo_ascend.models.policy import load_causal_lm, resolve_model_path

#: The built-in model every smoke run trains (warm-started weights ship with the package: no download).
BUILTIN_MODEL = "builtin:tiny-warm"
#: The task every smoke run uses: the built-in arithmetic prompts (what the built-in model was warm-started on).
DATASET = "synthetic:arithmetic"
DATASET_KWARGS = {"n": 64, "max_operand": 10, "ops": "+-", "seed": 7}


def prompt_texts(tokenizer: Any, n: int = 4) -> list[str]:
    """``n`` of the task's prompts rendered to text (the chat template when the tokenizer has one), so the
    rollout engine and ``generate`` see the same token ids."""
    rows = load_prompt_dataset(DATASET, synthetic_kwargs=DATASET_KWARGS)
    messages = [rows[i]["prompt"] for i in range(n)]
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    return ["\n".join(turn["content"] for turn in m) + "\n" for m in messages]


@dataclass
class SmokeContext:
    """The run's settings; ``deadline`` is a ``time.monotonic()`` value after which checks are skipped."""

    device: torch.device
    dtype: str  # 'float32' or 'bfloat16'
    out: Path
    model: str | None  # the user's model path (None: only the built-in model)
    steps: int = 5
    new_tokens: int = 24
    generations: int = 8
    deadline: float = field(default_factory=lambda: time.monotonic() + 300)
    servers: list[str] = field(default_factory=list)  # vLLM servers' URLs for the transfer_server check

    @property
    def device_type(self) -> str:
        """The device's type as the device layer names it."""
        return self.device.type

    def seconds_left(self) -> float:
        """Seconds until the deadline (negative once it has passed)."""
        return self.deadline - time.monotonic()

    def load(self, model: str) -> tuple[Any, Any]:
        """``model`` (a path or ``builtin:*`` name) in eval mode on the device, and its tokenizer."""
        from transformers import AutoTokenizer

        policy = load_causal_lm(model, self.dtype).to(self.device).eval()
        return policy, AutoTokenizer.from_pretrained(resolve_model_path(model))
