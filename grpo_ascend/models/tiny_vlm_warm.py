"""The warm start of ``builtin:vlm-<family>-warm``: a little supervised exposure to the coloured-shapes task.

A random-weight tiny VLM answers the coloured-shapes question (:mod:`grpo_ascend.vision.shapes_task`) with
random tokens, and its picture barely moves them, so GRPO on it stays at chance. This warm start trains every
weight (vision tower included) on the task's prompts, each answered by one random letter of its picture's
colour code and end of turn, and stops as soon as the policy's expected reward on held-out pictures (the
probability, under its first-token distribution, of a letter of the right colour) reaches
:attr:`VLMWarmStart.target`. The model then answers with a letter almost always and knows the colour a
little: about two answers in three are right at temperature 1, leaving GRPO room to rise towards 1.

Stopping on the measured accuracy rather than after a fixed number of steps lands every machine in the same
band (float order differs between CPUs, so the step count may not), and the accuracy climbs by about 0.02 a
step there, checked every :attr:`VLMWarmStart.check_every` steps. Data, label letters and initial weights are
seeded: the same machine builds the same weights. The Qwen2.5-VL build stops after 48 optimizer steps of 16 rows,
LLaVA after 106 (15-20 s of one CPU core each).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from grpo_ascend.models.seeding import seeded
from grpo_ascend.models.warm_step import supervised_step
from grpo_ascend.vision.shapes_task import CODES, QUESTION, shape_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLMWarmStart:
    """Settings of the warm start: at most ``max_steps`` AdamW steps of ``batch_size`` rows at ``lr``, stopped
    once the expected reward on ``held_out`` pictures reaches ``target`` (checked every ``check_every`` steps)."""

    max_steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    target: float = 0.65
    check_every: int = 2
    held_out: int = 64


WARM_START = VLMWarmStart()


def shapes_messages() -> list[dict[str, Any]]:
    """The task's chat prompt with its image part first, as the rollout renders a dataset row."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def code_token_ids(tokenizer: Any) -> dict[str, list[int]]:
    """Each colour's code letters as single token ids."""
    ids = {}
    for colour, letters in CODES.items():
        ids[colour] = [tokenizer(letter, add_special_tokens=False)["input_ids"][0] for letter in letters]
    return ids


def expected_reward(model: Any, processor: Any, rows: list[tuple[str, Any]]) -> tuple[float, float]:
    """(mean probability that the first answer token is a letter of the picture's colour code, mean probability
    that it is any code letter) over ``rows`` of (colour, image)."""
    import torch

    prompt = processor.apply_chat_template(shapes_messages(), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt] * len(rows), images=[image for _, image in rows], return_tensors="pt",
                       padding=True, add_special_tokens=False)
    ids = code_token_ids(processor.tokenizer)
    letters = ids["red"] + ids["blue"]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        probs = model(**inputs).logits[:, -1].float().softmax(-1)
    model.train(was_training)
    right = [probs[i, ids[colour]].sum().item() for i, (colour, _) in enumerate(rows)]
    return sum(right) / len(rows), probs[:, letters].sum(-1).mean().item()


def _batch(processor: Any, prompt: str, rows: list[tuple[str, Any]], rng: random.Random) -> dict[str, Any]:
    """Processor inputs of ``rows`` answered by a random letter of their colour's code, right-padded, with
    ``labels`` on the answer and its end of turn only."""
    tokenizer = processor.tokenizer
    answers = [rng.choice(CODES[colour]) + tokenizer.eos_token for colour, _ in rows]
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        inputs = processor(text=[prompt + answer for answer in answers], images=[image for _, image in rows],
                           return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    labels = inputs["input_ids"].clone().fill_(-100)
    for i, answer in enumerate(answers):
        end = int(inputs["attention_mask"][i].sum())
        start = end - len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        labels[i, start:end] = inputs["input_ids"][i, start:end]
    return {**inputs, "labels": labels}


def vlm_warm_start(model: Any, processor: Any, seed: int = 0, settings: VLMWarmStart = WARM_START,
                   losses: list[float] | None = None) -> float:
    """Warm-start ``model`` in place (see the module docstring); returns the held-out expected reward it stopped
    at. Raises if ``settings.target`` is not reached within ``settings.max_steps``."""
    import torch

    held_out = shape_rows(settings.held_out, seed=seed + 997)
    train = shape_rows(settings.max_steps * settings.batch_size, seed=seed + 101)
    prompt = processor.apply_chat_template(shapes_messages(), tokenize=False, add_generation_prompt=True)
    rng = random.Random(seed + 5)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model.train()
    accuracy = 0.0
    with seeded(seed):
        for step in range(settings.max_steps):
            batch = _batch(processor, prompt, train[step * settings.batch_size: (step + 1) * settings.batch_size], rng)
            ids, mask, labels = batch.pop("input_ids"), batch.pop("attention_mask"), batch.pop("labels")
            loss = supervised_step(model, opt, sched, ids, mask, labels, losses, **batch)
            if (step + 1) % settings.check_every:
                continue
            accuracy, letters = expected_reward(model, processor, held_out)
            logger.info("vlm warm start step %d loss %.3f expected reward %.3f (letters %.3f)", step + 1, loss,
                        accuracy, letters)
            if accuracy >= settings.target:
                model.eval()
                return accuracy
    raise RuntimeError(f"the vision-language warm start reached an expected reward of {accuracy:.3f} after "
                       f"{settings.max_steps} steps, short of its target {settings.target}")
