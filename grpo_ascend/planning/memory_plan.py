"""The memory a run needs on each device, per phase of a round, from shapes alone (no weights loaded).

Inputs: the model's architecture (:class:`ModelShape`, from a ``config.json`` or a built-in size),
what of the run's configuration changes memory (:class:`RunSettings`, from a recipe) and where the
distributed engine keeps its state (:class:`~grpo_ascend.distributed.memory_layout.MemoryLayout`).
:func:`plan_memory` adds up named terms (:class:`Term`) per phase -- generation, reference,
old_logprobs, values, training, the names ``memory/peak_gb/<phase>`` is logged under -- and
:func:`largest_fitting_rows` / :func:`auto_token_budget` search the micro-batch that fits.
docs/memory.md explains every term, its assumptions and how it compares with measurement.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_ascend.distributed.memory_layout import MemoryLayout, sharding_alternatives
from grpo_ascend.errors import ConfigError

GiB = 2**30
#: config.json files of published models (Qwen2.5 0.5B-72B), used for their hub ids without a download.
MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "model_configs"
#: The linear layers of one decoder layer, as LoRA target names.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Share of the device's memory ``max_tokens_per_micro_batch: auto`` plans into (the rest: what the plan
#: does not see, e.g. allocator fragmentation and communication buffers).
AUTO_FRACTION = 0.9
#: Phases in the order a round runs them.
PHASES = ("generation", "old_logprobs", "reference", "values", "training")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (Qwen2 / Llama style: GQA attention, gated MLP)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    dtype: str = "float32"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config") -> ModelShape:
        """From a ``config.json`` mapping (or a transformers config's ``to_dict()``)."""
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=int(config["num_hidden_layers"]),
                num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch."),
            )
        except KeyError as exc:
            raise ConfigError(f"{source}: the model config has no {exc.args[0]!r}; expected a decoder-only "
                              "transformer's config.json (hidden_size, num_hidden_layers, num_attention_heads, "
                              "intermediate_size, vocab_size)") from None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by LoRA target name."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        return sum(a * b for a, b in self.linear_shapes().values()) + bias + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Parameters of the output head that are not the embedding's (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.embedding_params

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.head_params + self.num_layers * self.layer_params + self.hidden_size

    def lora_params(self, r: int, targets: tuple[str, ...] | None) -> int:
        """LoRA A and B elements over every layer (``targets`` None = every linear but the head)."""
        chosen = LINEARS if targets is None else targets
        return self.num_layers * sum(r * (a + b) for name, (a, b) in self.linear_shapes().items() if name in chosen)

    def adapted_linear_params(self, targets: tuple[str, ...] | None) -> int:
        chosen = LINEARS if targets is None else targets
        return self.num_layers * sum(a * b for name, (a, b) in self.linear_shapes().items() if name in chosen)

    def kv_bytes_per_token(self, activation_bytes: int) -> int:
        """Keys + values of one token over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * activation_bytes


def load_model_shape(model: str, model_config: str | Path | None = None) -> ModelShape:
    """The shape of ``model`` without loading weights: ``model_config`` (a config.json or its folder) if
    given, else ``builtin:*`` sizes, else ``model``'s own config.json when it is a local folder, else the
    config shipped in recipes/model_configs for a known hub id (``Qwen/Qwen2.5-7B-Instruct``)."""
    if model_config is None and model.startswith("builtin:"):
        from grpo_ascend.models.tiny_model import builtin_architecture

        return ModelShape.from_config(builtin_architecture(model), model)
    path = Path(model_config if model_config is not None else model)
    known = MODEL_CONFIGS / f"{model.rpartition('/')[2].lower().removesuffix('-instruct')}.json"
    if model_config is None and not path.exists() and known.is_file():
        path = known  # a hub id whose shape ships with grpo-ascend
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json for model {model!r} at {str(path)!r}: pass --model-config PATH "
                          "(a config.json, e.g. recipes/model_configs/qwen2.5-7b.json) or a local model folder")
    try:
        return ModelShape.from_config(json.loads(path.read_text()), str(path))
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc


def lora_targets(target_modules: Any) -> tuple[str, ...] | None:
    """A LoRA config's target modules as the plan's targets: None when every decoder linear is adapted."""
    if target_modules is None or target_modules == "all-linear":
        return None
    names = {target_modules} if isinstance(target_modules, str) else set(target_modules)
    chosen = tuple(name for name in LINEARS if name in names)
    return None if len(chosen) == len(LINEARS) else chosen


def dtype_bytes(name: str) -> int:
    if name not in _DTYPE_BYTES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _round_up(n: int, bucket: int) -> int:
    return n if bucket <= 1 else -(-n // bucket) * bucket


@dataclass(frozen=True)
class RunSettings:
    """What of a run's configuration the plan reads (:func:`settings_from_config` builds it)."""

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


@dataclass(frozen=True)
class Term:
    """One named amount of memory per device and the phases it is held in."""

    name: str
    nbytes: int
    phases: tuple[str, ...]
    note: str = ""


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
        has = {"generation": True, "old_logprobs": s.old_logprobs, "reference": s.reference,
               "values": s.algorithm == "ppo", "training": True}
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
    prompt_kv = m.kv_bytes_per_token(a) * r * s.prompt_length if shared else 0  # the prompt's keys gathered per row
    v = m.vocab_size
    chunk = min(s.logprob_chunk, r * c)
    terms: list[Term] = []
    if not grad:
        cache = m.kv_bytes_per_token(a) * r * (s.prompt_length + c) if shared else 0  # every layer's keys, per row
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
        raise ConfigError(f"full fine-tuning (use_peft: false) is refused under {layout.engine}; plan it under "
                          "an engine that keeps whole weights (docs/distributed.md), or train LoRA")
    w, a = s.weight_bytes, s.activation_bytes
    G, P = s.num_generations, s.prompts_per_rank
    B = P * G
    if rows is None:
        rows = rows_under_budget(s, s.token_budget) if s.token_budget is not None else min(s.micro_batch_rows, s.rows_per_step)
    trainable = m.lora_params(s.lora_r, s.lora_targets) if s.use_peft else m.num_params
    train_bytes = 4 if s.use_peft else w  # peft keeps adapters in float32
    after_gen = ("old_logprobs", "reference", "values", "training")
    everywhere = ("generation", *after_gen)
    shard = world if layout.shards_weights else 1
    terms = [Term("weights", m.num_params * w // shard, everywhere,
                  f"{m.num_params / 1e9:.2f}B params x {w} B" + (f" / {world} ranks" if shard > 1 else ""))]
    if s.use_peft:
        terms.append(Term("LoRA parameters", trainable * 4, everywhere, f"r={s.lora_r}, {trainable / 1e6:.1f}M"))
    if layout.shards_weights:
        terms.append(Term("whole weights for rollout", m.num_params * w - m.num_params * w // shard, ("generation",),
                          "gathered once per round"))
    if layout.whole_head_in_training:
        terms.append(Term("whole output head", m.embedding_params * w - m.embedding_params * w // shard, ("training",),
                          "kept gathered from forward to step"))
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
        terms.append(Term("autocast weight casts", m.num_params * 2 // shard, ("training",),
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
    kv_token = m.kv_bytes_per_token(a)
    lp, lc = s.prompt_length, s.completion_length
    if s.shared_prefix_decode and G > 1:
        kv = kv_token * (P * lp + B * lc)
        kv_note = "prompt once per group + completions per row"
    else:
        kv = kv_token * (B * (lp + lc) + P * lp)
        kv_note = "prompt copied per row (+ prefill cache)"
    terms.append(Term("rollout KV cache", kv, ("generation",), f"{B} rows x ({lp} + {lc}) tokens; {kv_note}"))
    sampling_units = 6 if s.filtered_sampling else 3
    terms.append(Term("sampling buffers", B * m.vocab_size * (a + sampling_units * 4), ("generation",),
                      f"logits + {sampling_units} float32 [rows, vocabulary]"))
    terms.append(Term("prefill activations", P * lp * _layer_transient_elements(m) * a, ("generation",),
                      "one layer at a time"))
    merged = m.adapted_linear_params(s.lora_targets) * w
    if s.merge_lora is None and device_memory is not None:
        left = device_memory - sum(t.nbytes for t in terms if "generation" in t.phases)
        merge = merged <= left // 4
    else:
        merge = s.merge_lora is not False
    if s.use_peft and merge and layout.may_merge_lora:
        terms.append(Term("merged LoRA copy", merged, ("generation",),
                          "rollout_merge_lora" + (" (null: fits a quarter of what is left)" if s.merge_lora is None else "")))
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
    return MemoryPlan(terms=[t for t in terms if t.nbytes > 0], settings=s, layout=layout, shape=m,
                      device_memory=device_memory)


def largest_fitting_rows(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int) -> int:
    """Most rows of full-length completions a training micro-batch may hold with every phase under ``capacity``
    (0 when even one row does not fit)."""
    best = 0
    for rows in range(1, s.rows_per_step + 1):
        if plan_memory(shape, s, layout, rows=rows).peak_bytes <= capacity:
            best = rows
        else:
            break
    return best


def auto_token_budget(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int) -> int:
    """``max_tokens_per_micro_batch: auto``: the token budget of the largest micro-batch that fits ``capacity``.

    Raises ConfigError when no micro-batch fits (the message names the phase and what to change).
    """
    rows = largest_fitting_rows(shape, s, layout, capacity)
    if rows == 0:
        plan = plan_memory(shape, s, layout, capacity, rows=1)
        raise ConfigError(
            f"max_tokens_per_micro_batch: auto found no micro-batch that fits: with one row per micro-batch the "
            f"{plan.peak_phase} phase needs {plan.peak_bytes / GiB:.2f} GiB of {capacity / GiB:.2f} GiB; "
            "run `grpo-ascend plan` on the recipe for what to change"
        )
    return tokens_of(s, rows)


def suggest(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int) -> list[str]:
    """What to change when the run does not fit ``capacity`` (each suggestion re-planned and checked)."""
    out: list[str] = []
    rows = largest_fitting_rows(shape, s, layout, capacity)
    if rows:
        out.append(f"max_tokens_per_micro_batch: {tokens_of(s, rows)} (micro-batches of {rows} full-length rows; "
                   f"or per_device_train_batch_size: {rows}), or max_tokens_per_micro_batch: auto")
    candidates: list[tuple[str, RunSettings, MemoryLayout]] = []
    if s.logprob_chunk > 32:
        candidates.append(("logprob_chunk_size: 32", dataclasses.replace(s, logprob_chunk=32), layout))
    if not s.gradient_checkpointing:
        candidates.append(("gradient_checkpointing: true", dataclasses.replace(s, gradient_checkpointing=True), layout))
    if s.merge_lora is not False and s.use_peft and layout.may_merge_lora:
        candidates.append(("rollout_merge_lora: false", dataclasses.replace(s, merge_lora=False), layout))
    if not s.shared_prefix_decode:
        candidates.append(("shared_prefix_decode: true", dataclasses.replace(s, shared_prefix_decode=True), layout))
    if s.num_generations > 2 and s.num_generations % 2 == 0:
        half = s.num_generations // 2
        candidates.append((f"num_generations: {half}", dataclasses.replace(
            s, num_generations=half, rows_per_step=max(1, s.rows_per_step // 2),
            micro_batch_rows=min(s.micro_batch_rows, max(1, s.rows_per_step // 2))), layout))
    if s.prompts_per_rank > 1:
        candidates.append((f"fewer prompts per generation round ({s.prompts_per_rank // 2} per rank: halve "
                           "steps_per_generation / generation_batch_size)",
                           dataclasses.replace(s, prompts_per_rank=s.prompts_per_rank // 2), layout))
    for label, other in sharding_alternatives(layout, s.use_peft):
        candidates.append((label, s, other))
    if not s.use_peft:
        candidates.append(("use_peft: true (LoRA)", dataclasses.replace(s, use_peft=True), layout))
    base = plan_memory(shape, s, layout, capacity).peak_bytes
    helping = []
    for label, changed, lay in candidates:
        peak = plan_memory(shape, changed, lay, capacity).peak_bytes
        if peak < base:
            helping.append(label)
            out.append(f"{label}: peak {peak / GiB:.2f} GiB ({'fits' if peak <= capacity else 'still over'})")
    if not rows and len(helping) > 1:
        out.append(_together(shape, s, layout, capacity, [c for c in candidates if c[0] in helping]))
    if not out:
        out.append("nothing in the plan's reach fits: use more devices with a sharding engine, or a smaller model")
    return out


def _together(shape: ModelShape, s: RunSettings, layout: MemoryLayout, capacity: int,
              candidates: list[tuple[str, RunSettings, MemoryLayout]]) -> str:
    """The changes that each helped, applied one after another until the run fits (then the micro-batch that fits)."""
    applied: list[str] = []
    original = s
    for label, changed, lay in candidates:
        fields = {f.name: getattr(changed, f.name) for f in dataclasses.fields(changed)
                  if getattr(changed, f.name) != getattr(original, f.name)}
        s, layout = dataclasses.replace(s, **fields) if fields else s, lay
        applied.append(label)
        rows = largest_fitting_rows(shape, s, layout, capacity)
        if rows:
            return (f"together: {' + '.join(applied)} + max_tokens_per_micro_batch: {tokens_of(s, rows)} "
                    f"({rows} rows): peak {plan_memory(shape, s, layout, capacity, rows=rows).peak_bytes / GiB:.2f} GiB (fits)")
    return f"together: {' + '.join(applied)}: peak {plan_memory(shape, s, layout, capacity).peak_bytes / GiB:.2f} GiB (still over)"


def settings_from_config(recipe: Any, args: Any, device: str, world_size: int = 1,
                         prompt_length: int | None = None) -> RunSettings:
    """The plan's view of a recipe (``RecipeConfig``) and trainer config (``GRPOConfig`` / ``PPOConfig``) on
    ``device`` (a device type, as the device layer names it: its defaults for precision and layout)."""
    dtype = (args.model_init_kwargs or {}).get("dtype") or recipe.model_dtype
    return run_settings(args, device, world_size, algorithm=recipe.algorithm, use_peft=recipe.use_peft,
                        lora_r=recipe.lora_r, lora_targets=lora_targets(recipe.lora_target_modules),
                        weight_bytes=4 if dtype == "auto" else dtype_bytes(str(dtype).removeprefix("torch.")),
                        prompt_length=prompt_length)


def run_settings(args: Any, device: str, world_size: int, *, algorithm: str, use_peft: bool, lora_r: int,
                 lora_targets: tuple[str, ...] | None, weight_bytes: int, prompt_length: int | None = None,
                 precision: str | None = None) -> RunSettings:
    """The plan's view of a trainer config (``GRPOConfig`` / ``PPOConfig``) and the model facts beside it.

    ``precision`` ('bf16', 'fp16', 'fp32'): the run's, when known; else the config's on ``device``.
    """
    from grpo_ascend import device as dev

    plan = args.batch_plan(world_size)
    bucket = args.length_bucket if args.length_bucket is not None else dev.default_length_bucket(device)
    if precision is None:
        bf16 = args.bf16 if args.bf16 is not None else dev.is_accelerator(device)
        precision = "bf16" if bf16 else "fp16" if args.fp16 else "fp32"
    activation = 4 if precision == "fp32" else 2
    prompt = prompt_length if prompt_length is not None else args.max_prompt_length
    if prompt is None:
        raise ConfigError("max_prompt_length is null: the memory plan needs the longest prompt in tokens "
                          "(grpo-ascend plan --prompt-length N, or set max_prompt_length)")
    shared = args.shared_prefix_decode if args.shared_prefix_decode is not None else dev.default_shared_prefix_decode(device)
    budget = plan.max_tokens_per_micro_batch
    return RunSettings(
        algorithm=algorithm, use_peft=use_peft, lora_r=lora_r, lora_targets=lora_targets,
        weight_bytes=weight_bytes, activation_bytes=activation,
        reference=args.needs_reference_model,
        prompts_per_rank=plan.prompts_per_rank, num_generations=plan.num_generations,
        prompt_length=_round_up(prompt, bucket), completion_length=_round_up(args.max_completion_length, bucket),
        micro_batch_rows=args.per_device_train_batch_size, rows_per_step=plan.micro_batch * plan.grad_accum,
        token_budget=budget if isinstance(budget, int) else None, logprob_chunk=args.logprob_chunk_size,
        gradient_checkpointing=args.gradient_checkpointing, share_prompt_prefill=args.share_prompt_prefill,
        shared_prefix_decode=shared, merge_lora=args.rollout_merge_lora,
        filtered_sampling=args.top_k > 0 or args.top_p < 1 or args.min_p is not None,
        old_logprobs=(plan.optimizer_steps_per_generation > 1 and activation != 4)
        or bool(getattr(args, "importance_sampling_correction", False)),
        entropy_grad=bool(getattr(args, "entropy_coef", 0.0)),
        grouped_attention_bytes=dev.grouped_attention_max_bytes(device) if activation == 4 else 0,
        critic_shares_base=getattr(args, "critic_init", "policy") == "policy",
    )


def parse_memory(text: str) -> int:
    """Bytes of '64GiB', '64GB' (decimal), '65536MiB', '1.5TiB' or a plain number of bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not value > 0:
        raise ConfigError(f"device memory {text!r} is not a size; expected e.g. 64GiB, 64GB or 65536MiB")
    return int(value * units[unit])
