"""The memory plan's terms: the bytes each part of a run holds per device in each phase of a round.

:func:`plan_memory` adds up named :class:`Term` s per phase -- generation, old_logprobs, reference,
values, training, the names ``memory/peak_gb/<phase>`` is logged under -- from a model's shape
(:class:`~grpo_ascend.planning.shape.ModelShape`), what of the run's configuration changes memory
(:class:`RunSettings`) and where the distributed engine keeps its state
(:class:`~grpo_ascend.distributed.memory_layout.MemoryLayout`). docs/memory.md explains every term.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from grpo_ascend.distributed.memory_layout import MemoryLayout
from grpo_ascend.errors import ConfigError
from grpo_ascend.planning.settings import RunSettings, Term
from grpo_ascend.planning.shape import ModelShape
from grpo_ascend.planning.vision_terms import adapted_vision_weights, trained_vision_params, vision_terms
from grpo_ascend.weight_transfer.sender import planned_staging_bytes
from grpo_ascend.weight_transfer.settings import bucket_bytes_for

GiB = 2**30
#: Phases in the order a round runs them; "rollout device" is a rollout process's own device (asynchronous
#: rollouts with ``rollout_device`` another device), its memory beside the trainer's phases.
PHASES = ("generation", "old_logprobs", "reference", "values", "training", "rollout device")


@dataclass
class MemoryPlan:
    """The terms of one run per device, the peak of each phase, and the margin to the device's memory."""

    terms: list[Term]
    settings: RunSettings
    layout: MemoryLayout
    shape: ModelShape
    device_memory: int | None = None
    suggestions: list[str] = field(default_factory=list)

    @property
    def phases(self) -> list[str]:
        """The phases this run has (old_logprobs, reference and values only when it runs them)."""
        s = self.settings
        has = {"generation": s.rollout_process is None, "old_logprobs": s.old_logprobs, "reference": s.reference,
               "values": s.algorithm == "ppo", "training": True, "rollout device": s.rollout_process == "own"}
        return [p for p in PHASES if has[p]]

    def phase_bytes(self, phase: str) -> int:
        return sum(t.nbytes for t in self.terms if phase in t.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def margin(self) -> int | None:
        return None if self.device_memory is None else self.device_memory - self.peak_bytes

    def fits(self) -> bool:
        return self.margin is None or self.margin >= 0

    def report(self) -> str:
        """The plan as a table: one row per term, one column per phase (GiB), then peaks and margin."""
        phases = self.phases
        name_width = max(len(t.name) for t in self.terms)
        lines = [f"{'per device (GiB)':<{name_width}}  " + "  ".join(f"{p:>12}" for p in phases) + "  note"]
        for t in self.terms:
            cells = "  ".join(f"{t.nbytes / GiB:>12.3f}" if p in t.phases else f"{'':>12}" for p in phases)
            lines.append(f"{t.name:<{name_width}}  {cells}  {t.note}")
        lines.append(f"{'total':<{name_width}}  " + "  ".join(f"{self.phase_bytes(p) / GiB:>12.3f}" for p in phases))
        lines.append(f"peak: {self.peak_phase} {self.peak_bytes / GiB:.2f} GiB")
        if self.device_memory is not None:
            verdict = "fits" if self.fits() else "does NOT fit"
            lines.append(f"device memory {self.device_memory / GiB:.2f} GiB: {verdict}, margin "
                         f"{self.margin / GiB:+.2f} GiB")  # type: ignore[operator]
        lines.extend(f"  - {s}" for s in self.suggestions)
        return "\n".join(lines)


def micro_batch_shape(s: RunSettings, rows: int) -> tuple[int, int]:
    """(rows, prompt forwards) of a training micro-batch of ``rows`` full-length completions."""
    prompts = -(-rows // s.num_generations) if s.share_prompt_prefill and not s.gradient_checkpointing else rows
    return rows, min(prompts, rows)


def rows_under_budget(s: RunSettings, budget: int) -> int:
    """Most full-length rows a micro-batch of at most ``budget`` tokens holds (at least 1)."""
    best = 1
    for rows in range(1, s.rows_per_step + 1):
        r, prompts = micro_batch_shape(s, rows)
        if r * s.completion_length + prompts * s.prompt_length <= budget:
            best = rows
    return best


def tokens_of(s: RunSettings, rows: int) -> int:
    """Decoder tokens of a micro-batch of ``rows`` full-length rows (the token budget's unit)."""
    r, prompts = micro_batch_shape(s, rows)
    return r * s.completion_length + prompts * s.prompt_length


def _layer_saved_elements(m: ModelShape) -> int:
    """Elements one token keeps for the backward in one decoder layer (no checkpointing; see docs/memory.md)."""
    q = m.num_heads * m.head_dim
    return 4 * m.hidden_size + 4 * q + 4 * m.intermediate_size


def _layer_transient_elements(m: ModelShape) -> int:
    """Elements one token holds at once inside one decoder layer's no-grad forward."""
    return 2 * m.hidden_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + 3 * m.intermediate_size


def _upcast(activation_bytes: int) -> int:
    """Bytes per element of the float32 copy of 16-bit logits (none when they already are float32)."""
    return 0 if activation_bytes == 4 else 4


def _forward_terms(m: ModelShape, s: RunSettings, rows: int, grad: bool, phase: str) -> list[Term]:
    """Activations and log-prob buffers of one log-prob forward (and backward when ``grad``) of ``rows`` rows."""
    a, c = s.activation_bytes, s.completion_length
    r, prompts = micro_batch_shape(s, rows)
    tokens = r * c + prompts * s.prompt_length
    shared = prompts < r or (s.share_prompt_prefill and not s.gradient_checkpointing)
    # the prompt's keys (a hybrid's recurrent states) gathered per row
    prompt_kv = (m.kv_bytes_per_token(a) * s.prompt_length + m.state_bytes_per_row(a)) * r if shared else 0
    v = m.vocab_size
    chunk = min(s.logprob_chunk, r * c)
    terms: list[Term] = []
    if not grad:
        cache = (m.kv_bytes_per_token(a) * (s.prompt_length + c) + m.state_bytes_per_row(a)) * r if shared else 0
        terms.append(Term("activations (no grad)", tokens * _layer_transient_elements(m) * a + cache, (phase,),
                          f"{r} rows, {tokens} tokens, one layer at a time" + (" + every layer's KV" if shared else "")))
        terms.append(Term("log-prob chunk", chunk * v * (a + _upcast(a) + 4) + r * c * m.hidden_size * a, (phase,),
                          f"{chunk} tokens x {v} vocabulary: logits, float32, exp"))
        return terms
    saved = _layer_saved_elements(m)
    scores = r * m.num_heads * c * (s.prompt_length + c) * 4
    grouped = scores if 0 < scores <= s.grouped_attention_bytes and not s.gradient_checkpointing else 0
    if s.gradient_checkpointing:
        stored = m.num_layers * tokens * m.hidden_size * a + tokens * saved * a
        note = "checkpointed: layer inputs + one layer recomputed"
    else:
        stored = m.num_layers * (tokens * saved * a + grouped) + prompt_kv
        note = "every layer's saved tensors"
    terms.append(Term("activations", stored, (phase,), f"{r} rows, {tokens} tokens; {note}"))
    working = 2 * m.hidden_size + 3 * m.num_heads * m.head_dim + 2 * m.intermediate_size
    terms.append(Term("backward working set", tokens * working * a, (phase,), "one layer's gradients"))
    terms.append(Term("log-prob chunk", chunk * v * (a + _upcast(a) + 4 * 4) + r * c * m.hidden_size * a, (phase,),
                      f"{chunk} tokens x {v} vocabulary, recomputed in backward: logits, float32 + 4 more"))
    return terms


def plan_memory(shape: ModelShape, s: RunSettings, layout: MemoryLayout, device_memory: int | None = None,
                rows: int | None = None) -> MemoryPlan:
    """Every term of the run per device; ``rows``: training micro-batch rows (default: from the settings)."""
    m, world = shape, layout.world_size
    if not s.use_peft and layout.refuses_full_fine_tuning:
        raise ConfigError(f"full fine-tuning (use_peft: false) is refused under {layout.strategy_name}; plan it under "
                          "an engine that keeps whole weights (docs/distributed.md), or train LoRA")
    w, a = s.weight_bytes, s.activation_bytes
    G, P = s.num_generations, s.prompts_per_rank
    B = P * G
    if rows is None:
        rows = rows_under_budget(s, s.token_budget) if s.token_budget is not None else min(s.micro_batch_rows, s.rows_per_step)
    # the decoder's trainable elements and the trained vision parts' (train_vision_parts), counted alike
    vision = trained_vision_params(m.vision, s) if m.vision is not None else 0
    trainable = (m.lora_params(s.lora_r, s.lora_targets) if s.use_peft else m.num_params) + vision
    train_bytes = 4 if s.use_peft else w  # peft keeps adapters in float32
    after_gen = ("old_logprobs", "reference", "values", "training")
    everywhere = ("generation", *after_gen)
    shard = world if layout.shards_weights else 1
    terms = [Term("weights", m.num_params * w // shard, everywhere,
                  f"{m.num_params / 1e9:.2f}B params x {w} B" + (f" / {world} ranks" if shard > 1 else ""))]
    if s.use_peft:
        terms.append(Term("LoRA parameters", trainable * 4, everywhere, f"r={s.lora_r}, {trainable / 1e6:.1f}M"
                          + (f" ({vision / 1e6:.2f}M on vision parts)" if vision else "")))
    if layout.shards_weights and s.transfer_to == "server":  # streamed to the server one tensor at a time
        terms.append(Term("whole tensors streamed to a sampler", 2 * _largest_tensor(m, s), ("generation",),
                          "a sync gathers one tensor at a time (two alive at most)"))
    elif layout.shards_weights:  # gathered into new buffers beside each rank's shard
        terms.append(Term("whole weights for rollout", m.num_params * w, ("generation",), "gathered once per round"))
    if layout.whole_head_in_training:
        others = min(m.num_params - m.embedding_params, layout.live_gathered_elements)
        terms.append(Term("gathered weights", (m.embedding_params + others) * w, ("old_logprobs", "reference", "training"),
                          f"output head + {others / 1e6:.1f}M live parameters whole in each forward"))
    opt_shard = world if layout.shards_optimizer else 1
    per_param = (12 if layout.fp32_master_weights else 2 * train_bytes)
    terms.append(Term("optimizer state", trainable * per_param // opt_shard, everywhere,
                      ("fp32 master + Adam moments" if layout.fp32_master_weights else "Adam moments")
                      + (f" / {world} ranks" if opt_shard > 1 else "")))
    grad_shard = world if layout.shards_gradients else 1
    terms.append(Term("gradients", trainable * train_bytes // grad_shard, ("training",),
                      f"{trainable / 1e6:.1f}M trainable x {train_bytes} B" + (f" / {world}" if grad_shard > 1 else "")))
    if layout.gradient_buckets:
        terms.append(Term("DDP gradient buckets", trainable * train_bytes, ("training",), "every gradient again"))
    if layout.reduce_bucket_elements:
        terms.append(Term("gradient reduce bucket", min(trainable, layout.reduce_bucket_elements) * 4, ("training",),
                          "reduce_bucket_size, fp32"))
    if not s.use_peft and w == 4 and a == 2:
        terms.append(Term("autocast weight casts", trainable * 2 // shard, ("training",),
                          "bf16 copies of trainable fp32 weights"))
    if s.reference:
        ref = 0 if s.use_peft else m.num_params * w
        terms.append(Term("reference model", ref, everywhere,
                          "adapters disabled: none" if s.use_peft else "frozen whole copy"))
    if s.algorithm == "ppo":
        if s.use_peft and s.critic_shares_base:
            critic = trainable + m.hidden_size + 1
            terms.append(Term("critic (adapter + head)", critic * 4 * 4, everywhere, "weights, gradients, Adam"))
        else:
            backbone = m.num_params - m.head_params  # a value head instead of the vocabulary head
            terms.append(Term("critic (backbone copy)", backbone * (w + w + 2 * w), everywhere,
                              "weights, gradients, Adam"))
    # --- rollout ---
    lp, lc = s.prompt_length, s.completion_length
    sampler = _rollout_terms(m, s, layout, terms, device_memory, everywhere)
    if s.rollout_process is None:
        terms.extend(sampler)
    else:
        held = everywhere if s.rollout_process == "same" else ("rollout device",)
        synced = (m.adapted_linear_params(s.lora_targets) if s.use_peft else m.num_params) * w
        terms.append(Term("rollout process: weights", m.num_params * w, held, "its own copy, LoRA folded in"))
        terms.extend(Term(f"rollout process: {t.name}", t.nbytes, held, t.note) for t in sampler
                     if t.name not in ("merged LoRA copy", "whole weights for rollout"))
        if s.ring_in_device_memory:
            terms.append(Term("weight ring", 2 * synced, everywhere,
                              "two versions in shared memory: " + ("adapted layers merged" if s.use_peft else "every weight")))
    terms.extend(_transfer_terms(m, s, trainable, device_memory, everywhere))
    terms.append(Term("rollout / experience tensors", B * (16 * lp + 40 * lc), everywhere,
                      "ids, masks, log-probs per row"))
    # --- forwards over the experience ---
    if s.old_logprobs:
        terms.extend(_forward_terms(m, s, min(s.micro_batch_rows, B), False, "old_logprobs"))
    if s.reference:
        terms.extend(_forward_terms(m, s, min(s.micro_batch_rows, B), False, "reference"))
    if s.algorithm == "ppo":
        terms.extend(dataclasses.replace(t, phases=("values",)) for t in
                     _forward_terms(m, s, min(s.micro_batch_rows, B), False, "values") if t.name != "log-prob chunk")
    terms.extend(_forward_terms(m, s, rows, True, "training"))
    if m.vision is not None:
        terms.extend(vision_terms(m.vision, s, layout, rows))
    return MemoryPlan(terms=[t for t in terms if t.nbytes > 0], settings=s, layout=layout, shape=m,
                      device_memory=device_memory)


def _largest_tensor(m: ModelShape, s: RunSettings) -> int:
    """Bytes of the largest tensor a sync sends: the embedding (full), a merged MLP weight (LoRA, the rollout
    process), an adapter matrix is far below any bucket (LoRA, a server)."""
    if not s.use_peft:
        return m.hidden_size * max(m.vocab_size, m.intermediate_size) * s.weight_bytes
    return m.hidden_size * m.intermediate_size * s.weight_bytes if s.transfer_to == "rollout process" else 0


def _transfer_terms(m: ModelShape, s: RunSettings, trainable: int, device_memory: int | None,
                    everywhere: tuple[str, ...]) -> list[Term]:
    """A collective sync's buckets: the sender's two on the trainer's device (kept between syncs), the receiver's
    two on the sampler's; the rollout process also keeps the previous version for requests pinned to it."""
    if s.transfer_to is None:
        return []
    if s.transfer_to == "server":
        sent = trainable * 4 if s.use_peft else m.num_params * s.weight_bytes
    else:
        sent = (m.adapted_linear_params(s.lora_targets) if s.use_peft else m.num_params) * s.weight_bytes
    bucket = s.transfer_bucket_bytes or bucket_bytes_for(device_memory or 0, _largest_tensor(m, s))
    staging = planned_staging_bytes(sent, bucket)
    how = f"two buckets of <= {bucket / 2**20:.0f} MiB" + ("" if s.transfer_bucket_bytes else
                                                          " (null: sized from the device's memory)")
    out = [Term("weight transfer: sender buckets", staging, everywhere, f"{how}, kept between syncs")]
    if s.transfer_to == "server":
        out.append(Term("weight transfer: receiver buckets", staging, (),
                        "on each server's workers, beside vLLM's memory (not a device planned here)"))
        return out
    held = everywhere if s.rollout_process == "same" else ("rollout device",)
    out.append(Term("weight transfer: receiver buckets", staging, held, f"{how}, in the rollout process"))
    out.append(Term("rollout process: previous version", sent, held,
                    "kept for requests pinned to it (one_step_off)"))
    return out


def _rollout_terms(m: ModelShape, s: RunSettings, layout: MemoryLayout, terms: list[Term], device_memory: int | None,
                   everywhere: tuple[str, ...]) -> list[Term]:
    """What sampling holds in the generation phase (``terms``: the run's so far, for the merge decision)."""
    w, a = s.weight_bytes, s.activation_bytes
    G, P = s.num_generations, s.prompts_per_rank
    B = P * G
    out: list[Term] = []
    kv_token = m.kv_bytes_per_token(a)
    lp, lc = s.prompt_length, s.completion_length
    if s.shared_prefix_decode and G > 1 and m.recurrent is None:  # a hybrid decoder's rows never share a prefix
        kv = kv_token * (P * lp + B * lc)
        kv_note = "prompt once per group + completions per row"
    else:
        kv = kv_token * (B * (lp + lc) + P * lp)
        kv_note = "prompt copied per row (+ prefill cache)"
    out.append(Term("rollout KV cache", kv, ("generation",), f"{B} rows x ({lp} + {lc}) tokens; {kv_note}"))
    if m.recurrent is not None:
        out.append(Term("rollout recurrent state", m.state_bytes_per_row(a) * (B + P), ("generation",),
                        f"{B} rows (+ {P} prefilled) x {m.recurrent.recurrent_layers} recurrent layers: "
                        "convolution window + float32 state"))
    sampling_units = 6 if s.filtered_sampling else 3
    out.append(Term("sampling buffers", B * m.vocab_size * (a + sampling_units * 4), ("generation",),
                      f"logits + {sampling_units} float32 [rows, vocabulary]"))
    out.append(Term("prefill activations", P * lp * _layer_transient_elements(m) * a, ("generation",),
                      "one layer at a time"))
    merged = (m.adapted_linear_params(s.lora_targets) + (adapted_vision_weights(m.vision, s) if m.vision else 0)) * w
    if s.merge_lora is None and device_memory is not None:
        left = device_memory - sum(t.nbytes for t in [*terms, *out] if "generation" in t.phases)
        merge = merged <= left // 4
    else:
        merge = s.merge_lora is not False
    if s.use_peft and merge and layout.may_merge_lora:
        out.append(Term("merged LoRA copy", merged, ("generation",),
                          "rollout_merge_lora" + (" (null: fits a quarter of what is left)" if s.merge_lora is None else "")))
    return out
