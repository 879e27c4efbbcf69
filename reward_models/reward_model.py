"""A learned reward model (sequence classification, one logit) as a reward function."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from grpo_ascend import device as dev
from grpo_ascend.errors import ConfigError, RewardError
from reward_models.text import completion_text, is_conversational

logger = logging.getLogger(__name__)


def _default_device() -> torch.device:
    """The training device picked by the project's device module (``auto``)."""
    return dev.resolve_device("auto")


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(
            f"reward model: dtype must be a floating dtype name such as 'bfloat16' or 'float32', got {dtype!r}"
        )
    return value


class RewardModelScorer:
    """Scores ``prompt + completion`` with an ``AutoModelForSequenceClassification`` that has one logit.

    ``model`` is a directory or hub id (the tokenizer is loaded from the same place) or an
    already-loaded model, then ``tokenizer`` is required. The text of a chat sample is the reward
    model tokenizer's chat template applied to the prompt messages plus the assistant message
    (plain concatenation of the contents when the tokenizer has no template); a plain sample is
    ``prompt + completion``. Texts longer than ``max_length`` tokens keep their last ``max_length``
    tokens, since the score is read at the final token. Scoring runs in batches of ``batch_size``
    under ``torch.inference_mode()`` on ``device`` (None: the project's automatic device choice);
    a missing pad token falls back to the EOS token.
    """

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        tokenizer: Any = None,
        batch_size: int = 16,
        max_length: int = 1024,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(f"reward model: batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ConfigError(f"reward model: max_length must be a positive integer, got {max_length!r}")
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = torch.device(device) if device is not None else _default_device()
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ConfigError(
                    f"reward model {type(model).__name__} was given as a loaded model without a tokenizer; "
                    "pass tokenizer=... (or give the model's directory instead)"
                )
            source = str(getattr(model, "name_or_path", "") or type(model).__name__)
        else:
            source = os.fspath(model)
            model, tokenizer = self._load(source, tokenizer)
        self.source = source
        self.__name__ = os.path.basename(source.rstrip("/\\")) or source
        labels = getattr(getattr(model, "config", None), "num_labels", None)
        if labels != 1:
            raise ConfigError(
                f"reward model {source!r} has num_labels={labels}; a reward model must output exactly one "
                "logit (AutoModelForSequenceClassification with num_labels=1). If this is a causal LM or a "
                "classifier, train a one-logit reward head first."
            )
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise ConfigError(
                    f"reward model {source!r}: its tokenizer has neither a pad token nor an EOS token; set one"
                )
            tokenizer.pad_token = tokenizer.eos_token
        # The score is read at the last token that is not the config's pad id: it must be the pad id the
        # rows are padded with, which is the tokenizer's (a tokenizer given for the model may differ).
        model.config.pad_token_id = tokenizer.pad_token_id
        self.tokenizer = tokenizer
        model.eval()
        model.requires_grad_(False)
        target_dtype = _as_dtype(dtype)
        self.model = (
            model.to(device=self.device, dtype=target_dtype) if target_dtype else model.to(self.device)
        )
        self._warned_template = False
        self._warned_truncation = False

    @staticmethod
    def _load(source: str, tokenizer: Any) -> tuple[torch.nn.Module, Any]:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"could not load reward model {source!r}: it is not a model directory (with config.json) "
                f"and not loadable as a hub id: {exc}"
            ) from exc
        if getattr(config, "num_labels", None) != 1:
            raise ConfigError(
                f"reward model {source!r} has num_labels={getattr(config, 'num_labels', None)}; a reward model "
                "must output exactly one logit (AutoModelForSequenceClassification with num_labels=1). If this "
                "is a causal LM or a classifier, train a one-logit reward head first."
            )
        model = AutoModelForSequenceClassification.from_pretrained(source)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(source)
        return model, tokenizer

    def text(self, prompt: Any, completion: Any) -> tuple[str, bool]:
        """The text scored for one sample and whether it was rendered with the chat template."""
        if is_conversational(prompt) or is_conversational(completion):
            prompt_messages = (
                list(prompt) if is_conversational(prompt) else [{"role": "user", "content": str(prompt)}]
            )
            if is_conversational(completion):
                reply = list(completion)
            else:
                reply = [{"role": "assistant", "content": completion_text(completion)}]
            messages = prompt_messages + reply
            if getattr(self.tokenizer, "chat_template", None):
                return self.tokenizer.apply_chat_template(messages, tokenize=False), True
            if not self._warned_template:
                logger.warning(
                    "reward model %s: its tokenizer has no chat template; scoring chat samples as the message "
                    "contents joined by newlines",
                    self.__name__,
                )
                self._warned_template = True
            return "\n".join(completion_text([m]) for m in messages), False
        return str(prompt) + completion_text(completion), False

    def _encode(self, texts: Sequence[str], chat: Sequence[bool]) -> list[list[int]]:
        rows: list[list[int]] = []
        for index, (text, is_chat) in enumerate(zip(texts, chat)):
            ids = self.tokenizer(text, add_special_tokens=not is_chat)["input_ids"]
            if not ids:
                raise RewardError(
                    f"reward model {self.__name__}: sample {index} is empty after tokenization; nothing to score"
                )
            if len(ids) > self.max_length:
                if not self._warned_truncation:
                    logger.warning(
                        "reward model %s: a sample of %d tokens was cut to its last max_length=%d tokens",
                        self.__name__,
                        len(ids),
                        self.max_length,
                    )
                    self._warned_truncation = True
                ids = ids[-self.max_length :]
            rows.append(list(ids))
        return rows

    def score_ids(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """One float32 score per token-id row, on the scorer's device.

        Rows are sorted by length so each batch pads little; each batch moves to the device in one
        copy (ids and mask stacked) and the scores stay there.
        """
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        pad = self.tokenizer.pad_token_id
        scores = torch.empty(len(rows), dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                width = max(1, max(len(rows[i]) for i in chunk))
                host = torch.full((2, len(chunk), width), pad, dtype=torch.long)
                host[1].zero_()
                for j, i in enumerate(chunk):
                    n = len(rows[i])
                    host[0, j, :n] = torch.as_tensor(rows[i], dtype=torch.long)
                    host[1, j, :n] = 1
                ids, mask = host.to(self.device).unbind(0)
                logits = self.model(input_ids=ids, attention_mask=mask).logits
                index = torch.as_tensor(chunk, device=self.device)
                scores[index] = logits[:, 0].float()
        return scores

    def __call__(
        self,
        prompts: list | None = None,
        completions: list | None = None,
        completion_ids: list | None = None,
        **kwargs: Any,
    ) -> list[float]:
        """Score each (prompt, completion) pair; one device-to-host copy for the whole batch."""
        completions = list(completions or [])
        prompts = list(prompts) if prompts is not None else [""] * len(completions)
        if len(prompts) != len(completions):
            raise RewardError(
                f"reward model {self.__name__}: got {len(prompts)} prompts for {len(completions)} completions"
            )
        if not completions:
            return []
        rendered = [self.text(p, c) for p, c in zip(prompts, completions)]
        rows = self._encode([t for t, _ in rendered], [chat for _, chat in rendered])
        return self.score_ids(rows).tolist()

    def __repr__(self) -> str:
        return f"RewardModelScorer({self.source!r}, device={self.device}, batch_size={self.batch_size}, max_length={self.max_length})"
