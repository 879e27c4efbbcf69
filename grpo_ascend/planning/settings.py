"""What the memory plan reads of a run (:class:`RunSettings`) and what it adds up (:class:`Term`).

Kept apart from :mod:`grpo_ascend.planning.terms` so that the terms of a model's parts (the decoder's there,
a vision-language model's vision part in :mod:`grpo_ascend.planning.vision_terms`) share them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunSettings:
    """What of a run's configuration the plan reads (:func:`grpo_ascend.planning.memory_plan.settings_from_config` builds it)."""

    algorithm: str = "grpo"
    use_peft: bool = True
    lora_r: int = 16
    lora_targets: tuple[str, ...] | None = None
    weight_bytes: int = 4
    activation_bytes: int = 4
    reference: bool = False
    prompts_per_rank: int = 1
    num_generations: int = 8
    prompt_length: int = 64
    completion_length: int = 256
    micro_batch_rows: int = 8
    rows_per_step: int = 8
    token_budget: int | None = None
    logprob_chunk: int = 128
    gradient_checkpointing: bool = False
    share_prompt_prefill: bool = True
    shared_prefix_decode: bool = False
    #: rollout_merge_lora: None = merged when the copy fits a quarter of what the device has left (as at run time).
    merge_lora: bool | None = None
    filtered_sampling: bool = False
    old_logprobs: bool = False
    entropy_grad: bool = False
    grouped_attention_bytes: int = 0
    critic_shares_base: bool = True
    #: Asynchronous rollouts on the built-in engine: None (the trainer samples), "same" (a rollout process on the
    #: trainer's device, all the time beside every phase) or "own" (on a device of its own).
    rollout_process: str | None = None
    #: The weight ring (two versions in host shared memory) counts on this device: a CPU run.
    ring_in_device_memory: bool = False
    #: A collective weight sync (weight_transfer): its receiving end, "rollout process" or "server"; None: none
    #: (shared memory, files, or the trainer samples). Its bucket: ``transfer_bucket_bytes`` (None: the default,
    #: sized from the device's memory).
    transfer_to: str | None = None
    transfer_bucket_bytes: int | None = None
    #: Images in each prompt of a vision-language run (its image tokens are part of ``prompt_length``).
    images_per_prompt: int = 0
    #: ``train_vision_parts``: vision parts trained besides the language model ('projector', 'vision_tower');
    #: None = TRL's choice (every part in full fine-tuning, none under LoRA).
    train_vision_parts: tuple[str, ...] | None = ()


@dataclass(frozen=True)
class Term:
    """One named amount of memory per device and the phases it is held in."""

    name: str
    nbytes: int
    phases: tuple[str, ...]
    note: str = ""
