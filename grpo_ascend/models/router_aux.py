"""A Mixture-of-Experts model's load-balancing (router auxiliary) loss, added to the GRPO loss as TRL 1.16 does.

TRL turns it on when the model's (text) config declares ``output_router_logits`` and the coefficient
(``router_aux_loss_coef`` of the trainer config, else the model config's own) is not 0. The loss is the model's own:
transformers' ``load_balancing_loss_func`` of the model's module over the router logits of every layer, weighted by
the attention mask (prompt and completion tokens), with the model's expert count and top-k.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.wrappers import is_peft


@dataclass(frozen=True)
class RouterAux:
    """The resolved load-balancing loss of one model: its coefficient and how the model computes the loss."""

    coef: float
    num_experts: int
    top_k: int
    loss_fn: Callable[..., Tensor]

    def loss(self, router_logits: tuple[Tensor, ...], attention_mask: Tensor) -> Tensor:
        """The unweighted loss of one forward's router logits (one [tokens, experts] tensor per MoE layer)."""
        return self.loss_fn(router_logits, self.num_experts, self.top_k, attention_mask)


def router_aux_for(model: nn.Module, coef: float | None) -> RouterAux | None:
    """The model's load-balancing loss where TRL adds it, else None. ``coef`` is the trainer config's
    ``router_aux_loss_coef`` (None: the model config's, 0.0 turns the loss off, as in TRL)."""
    hf = model.get_base_model() if is_peft(model) else model
    config = getattr(hf, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    is_moe = hasattr(text_config, "output_router_logits")
    if coef and not is_moe:
        raise ConfigError(f"router_aux_loss_coef={coef} but {type(hf).__name__} is not a Mixture-of-Experts model "
                          "that returns router logits, so there is no auxiliary loss to weight; leave it unset")
    effective = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if not is_moe or not effective:
        return None
    loss_fn = getattr(sys.modules.get(type(hf).__module__), "load_balancing_loss_func", None)
    # the causal LM's own attributes; a vision-language model (Qwen3.5 MoE) reads them from its text config
    num_experts = getattr(hf, "num_experts", None) or getattr(text_config, "num_experts", None)
    top_k = getattr(hf, "num_experts_per_tok", None) or getattr(text_config, "num_experts_per_tok", None)
    if loss_fn is None or num_experts is None or top_k is None:
        raise ConfigError(
            f"{type(hf).__name__} declares output_router_logits (a Mixture-of-Experts model) but its module has no "
            "load_balancing_loss_func, or the model no num_experts / num_experts_per_tok, so its load-balancing loss "
            f"cannot be computed (router_aux_loss_coef={effective}); set router_aux_loss_coef=0.0 to train without it")
    return RouterAux(float(effective), int(num_experts), int(top_k), loss_fn)
