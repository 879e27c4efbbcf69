"""Policy loading, LoRA, and log-prob forwards over completions.

What is done to a loaded policy's parameters (the adapter-disabled reference, the float32 head, frozen
copies, counts) is in :mod:`grpo_ascend.models.parameters`; folding LoRA into the weights for rollouts in
:mod:`grpo_ascend.models.lora_merge`."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.errors import ConfigError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.models.attention_switch import activation_checkpointing_on
from grpo_ascend.models.grouped_attention import grouped_attention
from grpo_ascend.models.logprobs import token_logprobs_from_hidden
from grpo_ascend.models.lora_targets import all_linear_targets, is_all_linear
from grpo_ascend.models.recurrent_state import RecurrentStateLayer, prompt_cache
from grpo_ascend.models.router_aux import RouterAux
from grpo_ascend.models.tiny_model import resolve_builtin
from grpo_ascend.models.vision_language import (
    config_of,
    is_vision_language,
    language_model_linear_targets,
    takes_processor_images,
)
from grpo_ascend.models.wrappers import is_peft
from grpo_ascend.vision.completion_images import completion_inputs, prompt_embeddings
from grpo_ascend.vision.inputs import RowVision
from grpo_ascend.vision.positions import completion_positions, image_placeholders, joined, prompt_positions

logger = logging.getLogger(__name__)

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name: str) -> str:
    """Map ``builtin:*`` names to the offline tiny-model directory; pass other names through."""

    built = resolve_builtin(name)
    return str(built) if built is not None else name


def load_causal_lm(model: str | nn.Module, dtype: str = "float32", init_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """A causal LM (or an image-text-to-text model, models/vision_language.py) from a path / hub id /
    ``builtin:*`` name, or the given module unchanged.

    ``init_kwargs`` go to ``from_pretrained`` (TRL's ``model_init_kwargs``); their ``dtype`` (a name or a
    torch dtype) overrides ``dtype``.
    """
    if isinstance(model, nn.Module):
        return model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = dict(init_kwargs or {})
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or dtype
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"model dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    path = resolve_model_path(model)
    auto = AutoModelForImageTextToText if is_vision_language(config_of(path, kwargs)) else AutoModelForCausalLM
    try:
        return auto.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as exc:
        raise ConfigError(f"could not load model {model!r}: {exc}".splitlines()[0]) from exc


def load_tokenizer(model: str | nn.Module, processing_class: Any = None,
                   init_kwargs: dict[str, Any] | None = None) -> Any:
    """The tokenizer for ``model`` (or ``processing_class``, or a multimodal processor's), left-padded, with a
    pad token.

    The ``revision`` and ``trust_remote_code`` of ``init_kwargs`` (the model's) apply to it too.
    """
    tok = processing_class.tokenizer if takes_processor_images(processing_class) else processing_class
    if tok is None:
        from transformers import AutoTokenizer

        source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        if not source:
            raise ConfigError("pass processing_class=<tokenizer>: the model was given as an object without a path")
        shared = {k: v for k, v in (init_kwargs or {}).items()
                  if k in ("revision", "trust_remote_code") and v is not None}
        tok = AutoTokenizer.from_pretrained(resolve_model_path(source), **shared)
    if tok.pad_token is None:
        logger.warning("the tokenizer has no pad token; using its EOS token %r for padding", tok.eos_token)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def default_lora_config(
    r: int = 16, alpha: int = 32, dropout: float = 0.0, target_modules: str | list[str] = "all-linear"
) -> Any:
    """A causal-LM LoRA config; ``all-linear`` targets every linear layer except the output head."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM")


def apply_peft(model: nn.Module, peft_config: Any | None, vision_parts: Sequence[str] = ()) -> nn.Module:
    """Wrap ``model`` with LoRA (``peft_config``); None keeps full fine-tuning.

    peft reads transformers' deprecated ``is_gradient_checkpointing`` while wrapping; that
    FutureWarning says nothing the user can act on, so it is silenced here (and only here).
    """
    if peft_config is None:
        return model
    from peft import get_peft_model

    if is_all_linear(peft_config.target_modules):
        if is_vision_language(getattr(model, "config", None)):
            targets: str | None = language_model_linear_targets(model, vision_parts)
        else:
            targets = all_linear_targets(model)  # a Mamba hybrid: without the mixers' out_proj PEFT refuses
        if targets is not None:
            peft_config = copy.copy(peft_config)
            peft_config.target_modules = targets

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, peft_config)


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (LoRA layers stay injected), or the model itself."""
    return model.get_base_model() if is_peft(model) else model


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder stack returning hidden states, output projection) of a causal LM."""
    hf = hf_model(model)
    head = hf.get_output_embeddings()
    backbone = getattr(hf, getattr(hf, "base_model_prefix", "model"), None)
    if head is None or backbone is None or backbone is hf:
        raise ConfigError(f"{type(hf).__name__} does not expose a decoder and an output head; use a causal LM")
    return backbone, head


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` computes them."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def shared_prompt_rows(prompt_ids: Tensor, prompt_mask: Tensor,
                       vision: RowVision | None = None) -> tuple[Tensor, Tensor] | None:
    """(first row of each run of identical consecutive prompts, each row's run index), or None.

    GRPO keeps a prompt's G completions next to each other, so a micro-batch usually holds a few
    distinct prompts; None when every row's prompt differs from the previous one (nothing to share).
    With ``vision``, rows share a run only if they also share their images (the same token ids can
    hold different pictures).
    """
    if prompt_ids.shape[0] < 2 or prompt_ids.shape[1] == 0:
        return None
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)
    if vision is not None:
        same &= torch.tensor(vision.same_as_previous()[1:], dtype=torch.bool, device=same.device)
    starts = torch.cat([same.new_ones(1), ~same])
    first = starts.nonzero().squeeze(1)  # one host sync: the number of distinct prompts
    if first.numel() == prompt_ids.shape[0]:
        return None
    return first, starts.long().cumsum(0) - 1


@functools.cache
def _cache_kwarg(decoder_class: type) -> str:
    """The decoder forward's KV-cache argument: ``cache`` (newer transformers) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(decoder_class.forward).parameters else "past_key_values"


def image_prompt_positions(backbone: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                           vision: RowVision) -> tuple[Tensor, Tensor]:
    """(prompt position ids, each row's next position) in the model's own numbering of the prompts' image tokens
    (e.g. Qwen-VL's 3D positions)."""
    grids = vision.forward_kwargs(None, prompt_mask, pixels=False)  # every row's: no copy of G rows' pixels
    return prompt_positions(backbone, prompt_ids, prompt_mask, grids)


def joined_positions(backbone: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_mask: Tensor,
                     vision: RowVision | None) -> Tensor:
    """Position ids of prompt + completion: from the mask, or with images the model's own numbering of the
    prompt's image tokens, the completion continuing from the prompt's next."""
    if vision is None:
        return position_ids_from_mask(torch.cat([prompt_mask, completion_mask], dim=1))
    prompt_pos, next_pos = image_prompt_positions(backbone, prompt_ids, prompt_mask, vision)
    return joined(prompt_pos, completion_positions(next_pos, completion_mask))


def one_call_inputs(backbone: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                    vision: RowVision | None) -> tuple[Tensor, dict[str, Tensor]]:
    """(input ids, image inputs) of one decoder call over prompt + completion. With images, an image token a
    completion sampled reads the pad token's embedding (in one call it would be a slot for image features)."""
    if vision is None:
        return torch.cat([prompt_ids, completion_ids], dim=1), {}
    images = vision.forward_kwargs(None, prompt_mask, completion_ids.shape[1])
    pad = getattr(backbone.config.get_text_config(decoder=True), "pad_token_id", None) or 0
    completion_ids = completion_ids.masked_fill(image_placeholders(backbone.config, completion_ids), pad)
    return torch.cat([prompt_ids, completion_ids], dim=1), images


def completion_hidden_states(
    backbone: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    share_prompts: bool = True,
    fixed_calls: bool = False,
    vision: RowVision | None = None,
) -> Tensor:
    """Last hidden states [B, Lc, H] at the positions that predict each completion token.

    With ``share_prompts``, each run of identical consecutive prompts (a GRPO group) goes through
    the decoder once: its keys/values (a hybrid decoder's recurrent layers: their convolution windows
    and recurrent states, models/recurrent_state.py) are cached and indexed out to the run's rows, and
    only the completions run per row. Forward and backward then cost about (distinct prompt tokens + all
    completion tokens) instead of every row's prompt + completion, with the same result up to
    float rounding. Under activation checkpointing (which drops the cache) every row runs whole.
    ``fixed_calls``: take the cached two-call path even when no prompt repeats (each row its own
    run), so the decoder is called the same number of times whatever the batch holds -- under a
    parameter-sharding strategy (grpo_ascend/dist) every call gathers weights collectively, and all
    ranks must make the same calls. ``vision``: the rows' image inputs (vision/inputs.py); a shared prompt's
    images are then encoded once for its rows, and positions follow the model's numbering of image tokens.
    Completions always run as a second call then, as the sampler ran them: an image token a completion
    sampled is a plain token there, not a slot for image features (under activation checkpointing, which
    needs one call, such a token reads the padding token's embedding instead). Images a tool returned (``vision``'s
    tool images) take their features at their own completion columns only, with the sampler's positions; with
    them, the one-call path embeds prompt and completion itself, so a sampled image token stays a plain token.
    """
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    if vision is not None and not vision.any_images:
        vision = None
    completion_embeds = None  # the completions' embeddings when tools returned images (vision/completion_images.py)
    if vision is not None and vision.any_tool_images:
        prompt_pos, next_pos = image_prompt_positions(backbone, prompt_ids, prompt_mask, vision)
        completion_embeds, completion_pos = completion_inputs(backbone, completion_ids, completion_mask, next_pos,
                                                              vision.tool)
        positions = joined(prompt_pos, completion_pos)
    else:
        positions = joined_positions(backbone, prompt_ids, prompt_mask, completion_mask, vision)
    runs = None
    if (share_prompts or vision is not None) and completion_ids.shape[1] > 0 and not activation_checkpointing_on(backbone):
        runs = shared_prompt_rows(prompt_ids, prompt_mask, vision)
        if runs is None and (fixed_calls or vision is not None):
            every = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
            runs = (every, every)
    width = prompt_ids.shape[1]
    if runs is None and completion_embeds is not None:
        embeds = torch.cat([prompt_embeddings(backbone, prompt_ids, prompt_mask, vision), completion_embeds], dim=1)
        hidden = backbone(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                          use_cache=False).last_hidden_state
        return hidden[:, width - 1 : width - 1 + completion_ids.shape[1]]
    if runs is None:
        ids, images = one_call_inputs(backbone, prompt_ids, prompt_mask, completion_ids, vision)
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                          **images).last_hidden_state
        return hidden[:, width - 1 : width - 1 + completion_ids.shape[1]]
    first, row_run = runs
    cache_kwarg = _cache_kwarg(type(backbone))
    cache = prompt_cache(backbone.config.get_text_config(decoder=True))
    images = vision.forward_kwargs(first, prompt_mask[first]) if vision is not None else {}
    prefill = backbone(
        input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
        position_ids=positions.index_select(-2, first)[..., :width], use_cache=True, **{cache_kwarg: cache}, **images,
    ).last_hidden_state
    _select_cache_rows(cache, row_run)
    tokens = {"input_ids": completion_ids} if completion_embeds is None else {"inputs_embeds": completion_embeds}
    completion = backbone(
        **tokens, attention_mask=mask, position_ids=positions[..., width:], use_cache=True, **{cache_kwarg: cache},
    ).last_hidden_state
    # Token t of a completion is predicted from position t-1: the prompt's last for t = 0.
    return torch.cat([prefill[:, -1:].index_select(0, row_run), completion[:, :-1]], dim=1)


def _select_cache_rows(cache: Any, rows: Tensor) -> None:
    """Each layer's cached keys/values (a recurrent layer's states) gathered to ``rows``.

    Gathers with ``index_select``: its backward is an ``index_add``, where plain indexing's is an
    accumulating ``index_put`` that runs about 9x slower on the CPU (1.2 vs 0.13 ms for one
    prompt's keys to 8 rows) -- 100 ms of a 2.8 s training phase on random-25m at 2 threads.
    """
    for layer in cache.layers:
        if isinstance(layer, RecurrentStateLayer):
            layer.select_rows(rows)
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def hidden_states_and_router_loss(
    backbone: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
    router_aux: RouterAux, vision: RowVision | None = None,
) -> tuple[Tensor, Tensor]:
    """(completion hidden states as :func:`completion_hidden_states`, the MoE load-balancing loss): one decoder
    call per row over prompt and completion, as the model's own forward, so the loss weighs every row's prompt
    tokens like TRL's (a shared prompt prefill would count a group's prompt once). ``vision``: the rows' image
    inputs, each row's images encoded with it (:func:`one_call_inputs`)."""
    if vision is not None and not vision.any_images:
        vision = None
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    ids, images = one_call_inputs(backbone, prompt_ids, prompt_mask, completion_ids, vision)
    out = backbone(input_ids=ids, attention_mask=mask, use_cache=False, output_router_logits=True, **images,
                   position_ids=joined_positions(backbone, prompt_ids, prompt_mask, completion_mask, vision))
    width = prompt_ids.shape[1]
    hidden = out.last_hidden_state[:, width - 1 : width - 1 + completion_ids.shape[1]]
    return hidden, router_aux.loss(out.router_logits, mask)


def _fit_width(x: Tensor, width: int) -> Tensor:
    """``x`` [B, W, ...] cut or right-padded with zeros to ``width`` columns."""
    have = x.shape[1]
    if width <= have:
        return x[:, :width]
    return nn.functional.pad(x, (0, width - have) if x.dim() == 2 else (0, 0, 0, width - have))


def used_completion_width(completion_mask: Tensor) -> int:
    """Columns up to the last one that any row attends to, rounded up to the device's length bucket.

    Columns after it are padding in every row; causal attention never reads them for earlier
    positions, so dropping them changes no log-prob. One host sync.
    """
    width = completion_mask.shape[1]
    if width == 0:
        return 0
    used = completion_mask.ne(0).any(0)
    last = int(used.long().cumsum(0).argmax())  # first index of the maximum: the last used column
    needed = last + 1 if bool(used[last]) else 1
    return min(width, round_up(needed, dev.default_length_bucket(completion_mask.device)))


class CompletionLogprobs(nn.Module):
    """Wraps a causal LM so one forward returns per-token log-probs (and entropies) of completions.

    Being an ``nn.Module`` lets accelerate wrap it (DDP, autocast) while the vocabulary projection
    runs in chunks and never materialises a [B, T, V] float32 tensor. ``share_prompts``: see
    :func:`completion_hidden_states` (a GRPO group's prompt runs once).

    The completions are cut after the micro-batch's own longest one (:func:`used_completion_width`)
    and the outputs padded back with zeros to the input width: a micro-batch of short answers does
    not pay for the round's longest. Positions whose mask is 0 in every row hence read 0.

    ``router_aux``: a Mixture-of-Experts model's load-balancing loss (models/router_aux.py); a forward with
    ``aux_loss=True`` returns it third, from one decoder call per row (no shared prompt prefill).

    ``fixed_calls`` (set by the parameter-sharding strategies, where each module call gathers its
    weights collectively, so every rank must call the same modules in the same order):
    every rank makes the same calls whatever its batch holds -- the decoder takes the two-call
    path even without repeated prompts, and the completions are cut or right-padded (masked) to
    the widest used width over all ranks, so the head runs the same number of chunks (one scalar
    all-reduce).
    """

    def __init__(self, model: nn.Module, chunk_size: int = 128, share_prompts: bool = True,
                 router_aux: RouterAux | None = None):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.share_prompts = share_prompts
        self.fixed_calls = False
        self.router_aux = router_aux

    def forward(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        vision: RowVision | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        aux_loss: bool = False,
    ) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
        """Log-probs [B, W] and entropies (or None) of the completions; ``entropy_grad=False`` when no
        loss term differentiates the entropies (saves the backward a full-vocabulary tensor per chunk);
        ``vision``: the rows' image inputs (prompts with images); ``aux_loss``: also return the
        ``router_aux`` load-balancing loss (a scalar) third."""
        if aux_loss:
            return self._with_router_loss(prompt_ids, prompt_mask, completion_ids, completion_mask, vision,
                                          temperature, with_entropy, entropy_grad)
        width = completion_ids.shape[1]
        target = used_completion_width(completion_mask)
        if self.fixed_calls and torch.distributed.is_available() and torch.distributed.is_initialized():
            widest = torch.tensor([target], dtype=torch.long, device=completion_ids.device)
            torch.distributed.all_reduce(widest, op=torch.distributed.ReduceOp.MAX)
            target = int(widest)  # padded columns come after every real token: attention never reads them
        if target == width:
            return self._logprobs(prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy,
                                  entropy_grad, vision)
        logps, entropies = self._logprobs(
            prompt_ids, prompt_mask, _fit_width(completion_ids, target), _fit_width(completion_mask, target),
            temperature, with_entropy, entropy_grad, vision,
        )
        return _fit_width(logps, width), None if entropies is None else _fit_width(entropies, width)

    def _with_router_loss(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
        vision: RowVision | None, temperature: float, with_entropy: bool, entropy_grad: bool,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        if self.router_aux is None:
            raise ConfigError("aux_loss=True needs a Mixture-of-Experts model's router_aux (models/router_aux.py); "
                              "this log-prob model has none")
        backbone, head = backbone_and_head(self.model)
        with grouped_attention(backbone):
            hidden, aux = hidden_states_and_router_loss(backbone, prompt_ids, prompt_mask, completion_ids,
                                                        completion_mask, self.router_aux, vision)
        logps, entropies = token_logprobs_from_hidden(
            hidden, head, completion_ids, temperature=temperature or 1.0, chunk_size=self.chunk_size,
            with_entropy=with_entropy, entropy_grad=entropy_grad)
        return logps, entropies, aux

    def _logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
        temperature: float, with_entropy: bool, entropy_grad: bool = True, vision: RowVision | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        backbone, head = backbone_and_head(self.model)
        with grouped_attention(backbone):
            hidden = completion_hidden_states(
                backbone, prompt_ids, prompt_mask, completion_ids, completion_mask, self.share_prompts, self.fixed_calls,
                vision,
            )
        return token_logprobs_from_hidden(
            hidden, head, completion_ids, temperature=temperature or 1.0,  # greedy (0) reads T=1 log-probs
            chunk_size=self.chunk_size, with_entropy=with_entropy, entropy_grad=entropy_grad,
        )
