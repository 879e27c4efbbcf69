"""One supervised optimizer step of a built-in model's warm start (the plain, calculator and vision-language warm starts)."""

from __future__ import annotations

from typing import Any


def supervised_step(model: Any, optimizer: Any, scheduler: Any, ids: Any, attention_mask: Any, labels: Any,
                    losses: list[float] | None = None, **inputs: Any) -> float:
    """Loss on ``labels``, backward, gradient norm clipped to 1, optimizer and schedule stepped; returns the loss
    (also appended to ``losses`` when given). ``inputs`` go to the model too (a vision-language model's images)."""
    import torch

    out = model(input_ids=ids, attention_mask=attention_mask, labels=labels, **inputs)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    loss = out.loss.item()
    if losses is not None:
        losses.append(loss)
    return loss
