"""PPO's critic: a scalar value head on a language model, memory-conscious by default.

One value per completion token, ``V[b, t]`` = value of the state *before* completion token t (the
same hidden position :class:`~grpo_ascend.models.policy.CompletionLogprobs` reads token t's log-prob from),
so GAE's δ_t = r_t + γ·V[t+1] − V[t] lines up with the policy's per-token log-probs.

Where the critic lives (``build_critic``):

* LoRA policy, ``init="policy"`` (default): a second LoRA adapter named ``critic`` on the *same*
  PeftModel plus a :class:`ValueHead`. The frozen base is shared, so the critic costs one adapter
  and H + 1 head weights (and their optimizer state); the reference policy is still the base with
  every adapter disabled. The critic forward runs inside :func:`active_adapter`.
* LoRA policy, ``init="reward_model"``: the reward model's backbone (frozen) with its own LoRA
  adapter, and the head initialised from the reward model's score layer. Costs a second frozen
  model in memory (no optimizer state for it).
* Full fine-tuning: a trainable copy of the policy's backbone (``init="policy"``) or the reward
  model's backbone (``init="reward_model"``) plus the head. Costs a second full model *and* its
  gradients and AdamW moments: about 4× the backbone's parameter bytes on top of the policy's.

Sharing the base saves memory, not compute: the critic runs its own forward (and backward) through
the whole backbone, so a PPO step costs about twice a GRPO step's model passes.

With LoRA the head (and for ``reward_model`` the whole critic) is attached to the PeftModel as a
non-adapter submodule, so checkpoints keep the critic next to the policy adapter (the ``critic``
adapter in its own subfolder, the head in ``extra_trainable.safetensors``) and resume restores it;
the exported adapter is the policy's alone. With full fine-tuning the trainer checkpoints policy
and critic together (``policy.*`` and ``critic.*`` tensors).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.parameters import preserve_requires_grad
from grpo_ascend.models.policy import backbone_and_head, completion_hidden_states, is_peft, resolve_model_path
from grpo_ascend.vision.inputs import RowVision

logger = logging.getLogger(__name__)

CRITIC_ADAPTER = "critic"
CRITIC_INITS = ("policy", "reward_model")


class ValueHead(nn.Module):
    """Scalar head ``V = w·h + b`` on last hidden states, computed in float32 (also under autocast).

    Zero-initialised by default (V = 0 before training, no random bias in the first advantages);
    ``weight``/``bias`` copy a reward model's score layer.
    """

    def __init__(self, hidden_size: int, weight: Tensor | None = None, bias: Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.zeros(()))
        with torch.no_grad():
            if weight is not None:
                if weight.numel() != hidden_size:
                    raise ConfigError(
                        f"value head init: score weight has {weight.numel()} entries, expected hidden size {hidden_size}"
                    )
                self.weight.copy_(weight.reshape(hidden_size).float())
            if bias is not None:
                self.bias.copy_(bias.reshape(()).float())

    def forward(self, hidden: Tensor) -> Tensor:
        """[B, T, H] → [B, T] float32 (element-wise product + sum: autocast leaves it in float32)."""
        return (hidden.float() * self.weight).sum(-1) + self.bias


class CompletionValues(nn.Module):
    """Critic forward: values [B, Tc] (float32) of the completion-token states, an ``nn.Module`` for accelerate.

    With ``shared_backbone`` the decoder belongs to the policy's PeftModel and is *not* registered
    here: the module's parameters are exactly the critic's trainable ones (``adapter_params`` + the
    head), so a DistributedDataParallel wrapper of it synchronises the critic and nothing else.
    """

    def __init__(self, backbone: nn.Module, head: ValueHead, shared_backbone: bool = False,
                 adapter_params: Sequence[nn.Parameter] = ()):
        super().__init__()
        self.shared_backbone = shared_backbone
        if shared_backbone:
            object.__setattr__(self, "_shared", backbone)  # deliberately unregistered
            self.adapter_params = nn.ParameterList(list(adapter_params))
        else:
            self.backbone = backbone
        self.head = head

    @property
    def decoder(self) -> nn.Module:
        return self._shared if self.shared_backbone else self.backbone

    share_prompts = True  # a group's prompt runs once (see models.completion_hidden_states)

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                vision: RowVision | None = None) -> Tensor:
        hidden = completion_hidden_states(
            self.decoder, prompt_ids, prompt_mask, completion_ids, completion_mask, self.share_prompts, vision=vision
        )
        return self.head(hidden)


@dataclass
class Critic:
    """What ``build_critic`` returns.

    module: the forward to run (prepare it with accelerate).
    trainable: the critic's trainable parameters (for the optimizer and gradient clipping).
    adapter: adapter name to activate on the policy's PeftModel around critic forwards and
        backwards (None when the critic has its own backbone).
    owned: the critic's own modules when it is not attached to a PeftModel (full fine-tuning);
        the trainer checkpoints them next to the policy.
    memory: a one-line description of what the critic costs.
    """

    module: CompletionValues
    trainable: list[nn.Parameter]
    adapter: str | None
    owned: nn.Module | None
    memory: str


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str | None) -> Iterator[None]:
    """Make ``name`` the active adapter of a PeftModel inside the block (None: no change).

    Every parameter's ``requires_grad`` is restored on exit (see :func:`preserve_requires_grad`), so
    both adapters stay trainable and a DDP wrapper built over one of them never sees its parameters
    change. Run the critic's *backward* inside the block too: gradient checkpointing recomputes the
    forward then, with whatever adapter is active.
    """
    if name is None:
        yield
        return
    previous = model.active_adapter
    with preserve_requires_grad(model):
        model.set_adapter(name)
        try:
            yield
        finally:
            model.set_adapter(previous)


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model", None)
    if not size:
        raise ConfigError(f"cannot find the hidden size in the config of {type(model).__name__}")
    return int(size)


def _load_reward_model(path: str, dtype: torch.dtype, vocab_size: int) -> tuple[nn.Module, ValueHead]:
    """Backbone and a head initialised from the score layer of a sequence-classification reward model."""
    from transformers import AutoModelForSequenceClassification

    try:
        rm = AutoModelForSequenceClassification.from_pretrained(resolve_model_path(path), dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"could not load the critic's reward model {path!r}: {exc}".splitlines()[0]) from exc
    score = rm.get_output_embeddings() if rm.get_output_embeddings() is not None else getattr(rm, "score", None)
    if not isinstance(score, nn.Linear) or score.out_features != 1:
        raise ConfigError(
            f"critic_model {path!r} must be a reward model with one score output (num_labels=1); "
            f"got score layer {score!r}"
        )
    backbone = getattr(rm, getattr(rm, "base_model_prefix", "model"), None)
    if backbone is None or backbone is rm:
        raise ConfigError(f"critic_model {path!r} ({type(rm).__name__}) does not expose a backbone")
    rm_vocab = rm.get_input_embeddings().num_embeddings
    if rm_vocab != vocab_size:
        raise ConfigError(
            f"critic_model {path!r} has a vocabulary of {rm_vocab} tokens but the policy has {vocab_size}: the critic "
            "reads the policy's token ids, so it must share the policy's tokenizer"
        )
    head = ValueHead(_hidden_size(rm), score.weight.detach(), None if score.bias is None else score.bias.detach())
    return backbone, head


def build_critic(policy: nn.Module, init: str = "policy", critic_model: str | None = None) -> Critic:
    """Create the critic for ``policy`` (a PeftModel or a plain causal LM); see the module docstring.

    Every critic parameter starts with ``requires_grad=False``: the caller enables them
    (``enable_critic_grads``) once the policy's data-parallel wrapper exists, so that wrapper never
    includes critic parameters it would not see gradients for.
    """
    if init not in CRITIC_INITS:
        raise ConfigError(f"critic_init must be one of {CRITIC_INITS}, got {init!r}")
    if init == "reward_model" and not critic_model:
        raise ConfigError("critic_init='reward_model' needs critic_model: the reward model's path")
    backbone, _ = backbone_and_head(policy)
    dtype = next(backbone.parameters()).dtype
    vocab = backbone.get_input_embeddings().num_embeddings
    hidden = _hidden_size(policy)
    device = next(backbone.parameters()).device

    if is_peft(policy):
        lora = copy.deepcopy(policy.peft_config[policy.active_adapter])
        lora.inference_mode = False
        if init == "policy":
            if CRITIC_ADAPTER in policy.peft_config:
                raise ConfigError(f"the policy already has an adapter named {CRITIC_ADAPTER!r}")
            policy.add_adapter(CRITIC_ADAPTER, lora)
            adapter_params = [p for n, p in policy.named_parameters() if CRITIC_ADAPTER in n.split(".")]
            head = ValueHead(hidden).to(device)
            policy.add_module("value_head", head)  # checkpointed as a non-adapter trainable tensor
            module = CompletionValues(backbone, head, shared_backbone=True, adapter_params=adapter_params)
            n = sum(p.numel() for p in adapter_params) + hidden + 1
            critic = Critic(module, adapter_params + list(head.parameters()), CRITIC_ADAPTER, None,
                            f"critic: LoRA adapter {CRITIC_ADAPTER!r} on the shared frozen base + value head "
                            f"({n:,} trainable parameters, no second model)")
        else:
            from peft import inject_adapter_in_model

            rm_backbone, head = _load_reward_model(str(critic_model), dtype, vocab)
            lora.task_type = None
            rm_backbone = inject_adapter_in_model(lora, rm_backbone, adapter_name=CRITIC_ADAPTER)
            module = CompletionValues(rm_backbone, head).to(device)
            policy.add_module("value_model", module)  # its LoRA and head are checkpointed with the policy
            trainable = [p for n, p in module.named_parameters() if CRITIC_ADAPTER in n.split(".") or n.startswith("head.")]
            for p in module.parameters():
                p.requires_grad_(False)
            frozen = sum(p.numel() for p in module.parameters()) - sum(p.numel() for p in trainable)
            critic = Critic(module, trainable, None, None,
                            f"critic: reward model {critic_model!r} backbone, frozen ({frozen:,} parameters) + "
                            f"its own LoRA adapter and the score head ({sum(p.numel() for p in trainable):,} trainable)")
    else:
        if init == "policy":
            critic_backbone = copy.deepcopy(backbone)
            head = ValueHead(hidden)
            source = "a copy of the policy's backbone"
        else:
            critic_backbone, head = _load_reward_model(str(critic_model), dtype, vocab)
            source = f"reward model {critic_model!r} backbone"
        module = CompletionValues(critic_backbone, head).to(device)
        trainable = list(module.parameters())
        n = sum(p.numel() for p in trainable)
        critic = Critic(module, trainable, None, module,
                        f"critic: {source} + value head, fully trained ({n:,} parameters: a second model plus "
                        "its gradients and optimizer state)")
    for p in critic.trainable:
        p.requires_grad_(False)
    logger.info("%s", critic.memory)
    return critic


def enable_critic_grads(critic: Critic) -> None:
    """Make the critic's parameters trainable (see ``build_critic``)."""
    for p in critic.trainable:
        p.requires_grad_(True)
