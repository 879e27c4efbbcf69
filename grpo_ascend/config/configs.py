"""Trainer configuration: ``GRPOConfig`` / ``PPOConfig`` (TRL's field names and meanings) and the batch plan.

Every field carries its help text in ``metadata["help"]`` so the README's config reference is
generated from these dataclasses and cannot drift. Values come from Python, a YAML recipe, or
``--key value`` overrides on the command line (:mod:`grpo_ascend.config.recipe`); bad values raise
:class:`ConfigError` with one clear line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass
from typing import Any, Literal

from grpo_ascend.algorithms.reward_aggregation import REWARD_AGGREGATIONS
from grpo_ascend.algorithms.token_selection import check_quantile
from grpo_ascend.config.fields import _check_choice, _f, _positive, _Validated
from grpo_ascend.config.trl_keywords import own_keywords
from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.evaluation import check_eval_config
from grpo_ascend.tools.parsing import TOOL_CALL_PARSERS
from grpo_ascend.tracking.trackers import check_report_to, installed_trackers


@dataclass
class BaseRLConfig(_Validated):
    """Settings shared by the GRPO and PPO trainers (TRL's names where TRL has the concept)."""

    # --- run ---
    output_dir: str = _f("outputs/run", "Folder for metrics.jsonl, samples.jsonl, checkpoints and exports.")
    model_init_kwargs: dict[str, Any] | None = _f(
        None, "Keyword arguments for from_pretrained when the trainer loads model from a path (TRL's meaning), e.g. "
        "{dtype: bfloat16, revision: main, trust_remote_code: true}; dtype defaults to float32."
    )
    seed: int = _f(42, "Seed for every RNG (python, numpy, torch, device); sampling is reproducible with it.")
    device: str = _f("auto", "'auto' (the best accelerator present, else the CPU) or an explicit device type with an optional index.")
    max_steps: int = _f(-1, "Optimizer steps to run; -1 = derive from num_train_epochs and the dataset size.")
    num_train_epochs: float = _f(1.0, "Passes over the prompt dataset when max_steps is -1.")
    shuffle_dataset: bool = _f(True, "Shuffle prompts each epoch (seeded).")
    # --- batch ---
    per_device_train_batch_size: int = _f(8, "Completions per micro-batch on each device (forward/backward unit).")
    gradient_accumulation_steps: int = _f(1, "Micro-batches accumulated into one optimizer step.")
    max_tokens_per_micro_batch: int | Literal["auto"] | None = _f(
        None, "Token budget of a training micro-batch on each device: each optimizer step's rows (per_device_train_"
        "batch_size × gradient_accumulation_steps) are packed, longest first, into micro-batches whose forward runs "
        "at most this many tokens (rows × their longest completion + the prompt width once per group, or per row "
        "without share_prompt_prefill); a row over it gets a micro-batch of its own. The loss is the same however "
        "the rows are split. null = micro-batches of per_device_train_batch_size rows. 'auto' = the largest budget "
        "whose planned peak fits 90% of the device's memory at start-up (the memory plan of docs/memory.md)."
    )
    num_generations: int = _f(8, "G: completions sampled per prompt (the group).")
    steps_per_generation: int | None = _f(
        None, "Micro-batches fed by one generation batch (default: gradient_accumulation_steps). Not a multiple of "
        "gradient_accumulation_steps: optimizer steps straddle generation batches, in order (as TRL)."
    )
    generation_batch_size: int | None = _f(
        None, "Completions sampled per generation round, all devices; alternative to steps_per_generation."
    )
    # --- generation ---
    max_prompt_length: int | None = _f(512, "Longest prompt in tokens; longer prompts follow prompt_truncation.")
    prompt_truncation: Literal["error", "left"] = _f("error", "Too-long prompts: 'error' (refuse) or 'left' (keep the end).")
    max_completion_length: int = _f(256, "Most tokens generated per completion.")
    temperature: float = _f(1.0, "Sampling temperature (log-probs are of softmax(logits / temperature)).")
    top_p: float = _f(1.0, "Nucleus sampling mass in (0, 1].")
    top_k: int = _f(0, "Keep only the k most likely tokens; 0 = off.")
    min_p: float | None = _f(None, "Drop tokens below min_p × the top probability; null = off.")
    repetition_penalty: float = _f(1.0, "Penalty > 1 discourages tokens already generated; 1 = off.")
    stop_strings: list[str] = _f([], "Extra strings that end a completion (EOS always does).")
    chat_template_kwargs: dict[str, Any] | None = _f(
        None, "Keyword arguments for the tokenizer's apply_chat_template when chat prompts are rendered, e.g. "
        "{enable_thinking: false} (TRL's meaning; tool rollouts too)."
    )
    rollout_merge_lora: bool | None = _f(
        None, "Fold LoRA into the weights while generating (one matmul per linear layer instead of three; "
        "costs a copy of the adapted weights meanwhile); null = when that copy fits in a quarter of free memory."
    )
    fused_lora: bool = _f(
        True, "Run plain LoRA linear layers (one active adapter, no DoRA, no LoRA bias) through grpo-ascend's "
        "fused forward and backward: the adapter product is accumulated into the base output in place, with "
        "no full-width multiply and add per layer (same math; see docs/trainer.md). Off where the distributed "
        "strategy gathers each module's weights in that module's own hook (docs/distributed.md)."
    )
    compile_decode: bool | None = _f(
        None, "Compile the rollout's decode step (torch.compile, or the accelerator's graph mode); null = the "
        "device's default (off everywhere until measured to help: on the CPU it did not)."
    )
    shared_prefix_decode: bool | None = _f(
        None, "In the rollout's decode steps a group's completions read their prompt's keys/values once instead "
        "of once each (same attention up to float rounding); null = the device's default (on for the CPU, "
        "where it is measured to help, off on accelerators until measured there). Models with sliding-window or "
        "soft-capped attention keep the plain cache."
    )
    length_bucket: int | None = _f(
        None, "Pad prompt/completion lengths to multiples of this so NPUs compile few shapes; null = 64 on NPUs, "
        "exact lengths (1) elsewhere, where padding only costs compute."
    )
    rollout_backend: str = _f(
        "builtin", "What samples the completions: 'builtin' (grpo-ascend's engine, on the policy module itself) "
        "or another registered rollout backend (grpo_ascend.rollout.backend; docs/trainer.md#rollout-backends)."
    )
    # --- vLLM rollouts (rollout_backend: vllm; TRL's names and meanings; docs/vllm.md) ---
    use_vllm: bool = _f(False, "TRL's switch for vLLM rollouts: true = rollout_backend 'vllm'.")
    vllm_mode: Literal["colocate", "server"] = _f(
        "colocate", "colocate: an in-process vLLM engine beside the trainer on its device; server: a client of a "
        "running vLLM / vllm-ascend OpenAI server (vllm_server_base_url or host + port)."
    )
    vllm_server_base_url: str | None = _f(None, "Server mode: the server's URL (overrides host and port).")
    vllm_server_host: str = _f("0.0.0.0", "Server mode: the server's host when no base URL is given.")
    vllm_server_port: int = _f(8000, "Server mode: the server's port when no base URL is given.")
    vllm_server_timeout: float = _f(240.0, "Server mode: seconds to wait for the server to answer at start.")
    vllm_gpu_memory_utilization: float = _f(
        0.3, "Colocate: fraction of the device's memory vLLM takes for weights and KV cache (on the CPU build, "
        "of the host's memory)."
    )
    vllm_tensor_parallel_size: int = _f(1, "Colocate: tensor-parallel size of the engine (only 1 here; use a "
                                        "tensor-parallel server for more).")
    vllm_max_model_length: int | None = _f(None, "vLLM's max_model_len (prompt + completion); null = the model's.")
    vllm_enable_sleep_mode: bool = _f(
        False, "Colocate: put the engine to sleep (weights offloaded, KV cache freed) while the trainer trains; "
        "where the platform has it (not vLLM's CPU build)."
    )
    vllm_model_impl: Literal["auto", "vllm", "transformers"] = _f("vllm", "vLLM's model implementation.")
    vllm_kv_cache_memory_bytes: int | None = _f(
        None, "Colocate: the KV cache's size in bytes (overrides vllm_gpu_memory_utilization for the cache); not a "
        "TRL setting."
    )
    vllm_sync_dir: str | None = _f(
        None, "Server mode: the folder adapter versions (and full weights) are written to for the server to load; "
        "the server must read it (same machine or shared storage). null = output_dir/vllm-sync. Not a TRL setting."
    )
    # --- rewards ---
    reward_weights: list[float] | None = _f(None, "Weight per reward function (default 1 each).")
    reward_errors: Literal["raise", "zero"] = _f("raise", "A raising reward function stops the run, or scores 0 and is counted.")
    reward_timeout: float | None = _f(None, "Seconds allowed per reward-function call; null = no limit.")
    # --- optimisation ---
    learning_rate: float = _f(1e-6, "AdamW peak learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this; 0 = no clipping.")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = _f("linear", "Decay after warm-up.")
    warmup_ratio: float = _f(0.0, "Fraction of max_steps spent warming up linearly.")
    warmup_steps: int = _f(0, "Warm-up steps (overrides warmup_ratio when > 0).")
    # --- precision and memory ---
    bf16: bool | None = _f(None, "bf16 autocast; null = on when the device supports it and is not the CPU.")
    fp16: bool = _f(False, "fp16 autocast with a dynamic grad scaler (older Ascend parts).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    disable_dropout: bool = _f(False, "Set every dropout layer's probability to 0 (LoRA's included), so the same "
                               "input gets the same log-probs in sampling and in training (TRL's meaning).")
    logprob_chunk_size: int = _f(128, "Sequence chunk for log-prob/entropy computation (bounds full-vocab memory).")
    share_prompt_prefill: bool = _f(
        True, "Run each prompt once per group in the log-prob forward/backward (its keys/values are shared "
        "by the group's completions); off = every row's full sequence. Off under gradient checkpointing."
    )
    # --- checkpoints and logging ---
    save_steps: int = _f(500, "Save a checkpoint every N optimizer steps (and at the end); 0 = only at the end.")
    save_total_limit: int | None = _f(None, "Keep only the newest N checkpoints; null = keep all.")
    resume_from_checkpoint: str | bool | None = _f(None, "Checkpoint folder, or 'latest' / true to resume the newest in output_dir.")
    export_adapter_at_end: bool = _f(False, "Export the LoRA adapter (PEFT format) to output_dir/adapter at the end.")
    logging_steps: int = _f(1, "Write metrics every N optimizer steps.")
    log_completions_steps: int = _f(10, "Write sample completions with rewards to samples.jsonl every N steps; 0 = off.")
    num_completions_to_print: int = _f(4, "Completions written per sampling of samples.jsonl.")
    report_to: list[str] | str = _f(
        [], "Trackers besides metrics.jsonl/samples.jsonl ('jsonl', always on): tensorboard, wandb, swanlab, trackio "
        "(each needs its extra, e.g. pip install 'grpo-ascend[wandb]'); they get the config, the metrics and "
        "tables of sample completions. One name is a list of one; 'none' = no tracker; 'all' = every installed one."
    )
    disable_tqdm: bool = _f(False, "Hide the progress bar.")
    # --- Hugging Face Hub (transformers' meanings; docs/trl_compatibility.md) ---
    push_to_hub: bool = _f(False, "Create the Hub repo when the trainer is built, push the saved model on save_model() and "
                           "per hub_strategy; trainer.push_to_hub() pushes whatever this says.")
    hub_model_id: str | None = _f(None, "Hub repo ('user/name' or 'name' under your account); null = output_dir's folder name.")
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = _f(
        "every_save", "With push_to_hub: 'end' (only save_model / push_to_hub), 'every_save' (also the model at each "
        "checkpoint), 'checkpoint' (also the latest checkpoint folder as last-checkpoint/), 'all_checkpoints' (every one)."
    )
    hub_token: str | None = _f(None, "Hub token with write access; null = the logged-in one (hf auth login) or HF_TOKEN.")
    hub_private_repo: bool | None = _f(None, "Create the repo private; null = the Hub's default for your account.")
    hub_revision: str | None = _f(None, "Branch to push to; null = main.")
    # --- evaluation (docs/evaluation.md) ---
    eval_strategy: Literal["no", "steps"] = _f(
        "no", "Evaluate on the eval dataset during training: 'no', or 'steps' (every eval_steps optimizer steps, "
        "at round boundaries, and at the end)."
    )
    eval_steps: int | None = _f(None, "Optimizer steps between evaluations; null = save_steps (or logging_steps when "
                                "save_steps is 0), so every evaluation has a checkpoint to be the best.")
    eval_on_start: bool = _f(False, "Evaluate once before the first optimizer step (the starting point of the curve).")
    num_generations_eval: int | None = _f(None, "Sampled completions per eval prompt (the n of pass@k); null = num_generations.")
    per_device_eval_batch_size: int = _f(8, "Completions generated per engine call on each device during evaluation.")
    eval_temperature: float | None = _f(None, "Sampling temperature of the sampled evaluation; null = temperature. "
                                        "The greedy evaluation always decodes at temperature 0.")
    eval_pass_threshold: float = _f(1.0, "A completion passes (pass@k, mean@k) when its reward is >= this (per "
                                    "reward function, and for the weighted total).")
    metric_for_best_model: str | None = _f(
        None, "Eval metric that picks the best checkpoint (with or without the 'eval/' prefix, e.g. 'reward' or "
        "'pass@1'); null = 'eval/reward' when evaluating. The best is named by OUTPUT_DIR/best."
    )
    greater_is_better: bool | None = _f(None, "Whether a larger metric_for_best_model is better; null = true "
                                        "(false when the name ends in 'loss').")
    load_best_model_at_end: bool = _f(False, "After training, load the best checkpoint's weights into the trainer's model.")
    # --- multi-process ---
    ddp_timeout: int = _f(
        1800, "Seconds a rank waits in a collective for the others (process-group timeout under accelerate "
        "launch); raise it when ranks' rollouts or checkpoint saves take longer. On Ascend HCCL_EXEC_TIMEOUT "
        "is derived from it (ddp_timeout - 60 s; at least 128 there)."
    )

    def __post_init__(self) -> None:
        if self.use_vllm:
            if self.rollout_backend not in ("builtin", "vllm"):
                raise ConfigError(f"use_vllm=True conflicts with rollout_backend={self.rollout_backend!r}; set only one")
            self.rollout_backend = "vllm"
        _check_choice("vllm_mode", self.vllm_mode, ("colocate", "server"))
        _positive(self, "vllm_server_timeout", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                  "vllm_max_model_length", "vllm_kv_cache_memory_bytes")
        # TRL's unset values (None) of fields typed more narrowly here: transformers' output folder, a visible
        # progress bar, and our number of printed completions (as a trl.GRPOConfig converts them).
        for name, unset in (("output_dir", "trainer_output"), ("disable_tqdm", False), ("num_completions_to_print", 4)):
            if getattr(self, name) is None:
                setattr(self, name, unset)
        budget = self.max_tokens_per_micro_batch
        if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ConfigError(f"max_tokens_per_micro_batch must be a whole number of tokens, 'auto' or null, got {budget!r}")
        _positive(
            self,
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "max_completion_length",
            "max_prompt_length",
            "num_train_epochs",
            "logprob_chunk_size",
            "steps_per_generation",
            "generation_batch_size",
            "reward_timeout",
            "ddp_timeout",
        )
        if isinstance(budget, int) and budget <= 0:
            raise ConfigError(f"max_tokens_per_micro_batch must be > 0, got {budget}")
        if self.learning_rate < 0:
            raise ConfigError(f"learning_rate must be >= 0 (0 = a control run that never moves), got {self.learning_rate}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be a positive number of optimizer steps or -1, got {self.max_steps}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both true; choose one precision")
        for name in ("save_steps", "logging_steps", "log_completions_steps", "warmup_steps", "length_bucket"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.logging_steps == 0:
            raise ConfigError("logging_steps must be >= 1")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError(f"save_total_limit must be >= 1 or null, got {self.save_total_limit}")

        check_eval_config(self)

        if isinstance(self.report_to, str):  # TRL style: one name, "none" or "all"
            self.report_to = installed_trackers() if self.report_to == "all" else [self.report_to]
        self.report_to = check_report_to(self.report_to)
        self.batch_plan(int(os.environ.get("WORLD_SIZE", "1")))
        if self.model_init_kwargs:  # torch dtypes by name, so the config stays JSON (checkpoints, trackers)
            self.model_init_kwargs = {k: str(v).removeprefix("torch.") if type(v).__name__ == "dtype" else v
                                      for k, v in self.model_init_kwargs.items()}
        if self.resume_from_checkpoint is True:
            self.resume_from_checkpoint = "latest"
        elif self.resume_from_checkpoint is False:
            self.resume_from_checkpoint = None

    @property
    def needs_reference_model(self) -> bool:
        """Whether the algorithm runs a reference model (each algorithm's config says: its KL term is on)."""
        return False

    # --- derived batch plan -------------------------------------------------------------------
    def resolved_steps_per_generation(self, world_size: int = 1) -> int:
        """Micro-batches per generation round on each device (TRL's steps_per_generation)."""
        if self.generation_batch_size is not None:
            per_round = self.per_device_train_batch_size * world_size
            if self.generation_batch_size % per_round:
                raise ConfigError(
                    f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                    f"per_device_train_batch_size × processes ({per_round})"
                )
            return self.generation_batch_size // per_round
        return self.steps_per_generation or self.gradient_accumulation_steps

    def batch_plan(self, world_size: int = 1) -> BatchPlan:
        """The batch arithmetic, validated: what one generation round and one optimizer step contain."""
        return BatchPlan(
            world_size=world_size,
            num_generations=self.num_generations,
            micro_batch=self.per_device_train_batch_size,
            grad_accum=self.gradient_accumulation_steps,
            steps_per_generation=self.resolved_steps_per_generation(world_size),
            num_iterations=getattr(self, "num_iterations", 1),
            max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
        )


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic for one run, spelled out (TRL's is a frequent source of confusion).

    The run's one home of ``num_generations`` (G) and ``max_tokens_per_micro_batch``: the trainer and its
    parts read them here, checked once when the plan is made.
    """

    world_size: int
    num_generations: int
    micro_batch: int
    grad_accum: int
    steps_per_generation: int
    num_iterations: int
    #: Token budget that packs each step's rows into micro-batches (None: grad_accum of micro_batch rows;
    #: 'auto': chosen from the device's memory when the trainer starts).
    max_tokens_per_micro_batch: int | str | None = None

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(
                f"num_generations must be >= 2 (group-relative advantages need a group), got {self.num_generations}"
            )
        per_device = self.micro_batch * self.steps_per_generation
        if per_device % self.num_generations:
            raise ConfigError(
                f"completions per generation round on each device ({per_device} = per_device_train_batch_size "
                f"{self.micro_batch} × steps_per_generation {self.steps_per_generation}) must be divisible by "
                f"num_generations ({self.num_generations}) so every group stays on one device; change one of them"
            )

    @property
    def completions_per_generation(self) -> int:
        return self.micro_batch * self.steps_per_generation * self.world_size

    @property
    def prompts_per_generation(self) -> int:
        return self.completions_per_generation // self.num_generations

    @property
    def prompts_per_rank(self) -> int:
        """Prompts of one generation round on each process (its slice of the global draw)."""
        return self.prompts_per_generation // self.world_size

    @property
    def completions_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Whole optimizer steps one generation batch feeds (when steps do not straddle batches)."""
        return self.steps_per_generation // self.grad_accum * self.num_iterations

    @property
    def generations_per_round(self) -> int:
        """Generation batches in one training round: 1, unless steps_per_generation × num_iterations
        micro-batches are not a multiple of grad_accum. Then, as in TRL, an optimizer step may take its
        micro-batches from two generation batches, and a round runs until the steps line up again."""
        per_generation = self.steps_per_generation * self.num_iterations
        return self.grad_accum // math.gcd(per_generation, self.grad_accum)

    @property
    def optimizer_steps_per_round(self) -> int:
        return self.steps_per_generation * self.num_iterations * self.generations_per_round // self.grad_accum

    @property
    def prompts_per_round(self) -> int:
        return self.prompts_per_generation * self.generations_per_round

    def old_logps_needed(self, generation: int) -> bool:
        """Whether generation batch ``generation`` of a round is still trained on after an optimizer step
        (then the ratio needs the sampling policy's log-probs; TRL's rule for the aligned case too)."""
        per_generation = self.steps_per_generation * self.num_iterations
        return generation * per_generation % self.grad_accum + per_generation > self.grad_accum

    def describe(self) -> str:
        return (
            f"batch plan: {self.prompts_per_generation} prompts × {self.num_generations} generations = "
            f"{self.completions_per_generation} completions per generation round; "
            f"{self.completions_per_step} completions per optimizer step "
            + (f"({self.grad_accum} micro-batches of {self.micro_batch} × {self.world_size} process(es)); "
               if self.max_tokens_per_micro_batch is None else
               f"({self.micro_batch * self.grad_accum} × {self.world_size} process(es), in micro-batches of at most "
               f"{self.max_tokens_per_micro_batch} tokens); " if self.max_tokens_per_micro_batch != "auto" else
               f"({self.micro_batch * self.grad_accum} × {self.world_size} process(es), in micro-batches under a token "
               "budget chosen from the device's memory at start-up); ")
            + (f"{self.optimizer_steps_per_generation} optimizer step(s) per generation round"
               if self.generations_per_round == 1 else
               f"optimizer steps straddle generation rounds: {self.generations_per_round} rounds feed "
               f"{self.optimizer_steps_per_round} optimizer step(s)")
            + (f" ({self.num_iterations} iterations)" if self.num_iterations > 1 else "")
        )


KLEstimatorName = Literal["k1", "k2", "k3"]
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _accepts_trl_keywords(cls: type) -> type:
    """Let ``cls(...)`` also take every TRL 1.16 ``GRPOConfig`` field as a keyword, classified as for a
    ``trl.GRPOConfig`` object (:func:`grpo_ascend.config.trl_keywords.own_keywords`); its own fields are untouched."""
    init = cls.__init__
    own = {f.name for f in dataclasses.fields(cls) if f.init}

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.keys() - own:  # imported here: trl_keywords' table imports grpo_ascend.distributed, which imports us

            kwargs = own_keywords(type(self), kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_accepts_trl_keywords
@dataclass
class GRPOConfig(BaseRLConfig):
    """GRPO settings. Field names and meanings follow TRL's GRPOConfig where TRL has the concept; TRL's other
    fields are accepted as keywords too (docs/trl_compatibility.md)."""

    learning_rate: float = _f(1e-6, "AdamW peak learning rate.")
    beta: float = _f(0.0, "KL coefficient to the reference policy (k3 estimator); 0 = no reference model.")
    epsilon: float = _f(0.2, "Lower clipping range: ratio clipped at 1 - epsilon.")
    epsilon_high: float | None = _f(
        None, "Upper clipping range (DAPO clip-higher); null = epsilon. For loss_type='cispo': the cap ε_max on the "
        "importance weight itself (e.g. 5.0)."
    )
    delta: float | None = _f(None, "Cap on the unclipped ratio (two-sided clipping); must exceed 1 + epsilon_high.")
    loss_type: str = _f(
        "dapo", "Policy loss: grpo | bnpo | dr_grpo | dapo | luspo (aggregations of the clipped objective; luspo = "
        "mean over sequences of each sequence's token sum), cispo (MiniMax-M1: clipped, detached IS weight × A × "
        "log π, aggregated like dapo; the cap is epsilon_high, else epsilon), sapo (soft gate σ(τ(r−1))·4/τ instead "
        "of clipping, aggregated like grpo), vespo (gamma-weighted sequence ratio × A × log π, aggregated like dapo); "
        "gspo = grpo with importance_sampling_level sequence (TRL's spelling of GSPO)."
    )
    scale_rewards: str | bool = _f("group", "Advantage scaling: group | batch | none (Dr. GRPO); true = group, false = none.")
    importance_sampling_level: Literal["token", "sequence"] = _f("token", "Importance ratio per token, or per sequence (GSPO).")
    num_iterations: int = _f(1, "μ: optimisation passes over each generation batch.")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient (subtracted from the loss).")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop zero-variance groups and refill from more prompts.")
    max_dynamic_sampling_rounds: int = _f(3, "Extra generation rounds allowed to refill dropped groups.")
    advantage_estimator: str = _f("grpo", "Advantage estimator registry name.")
    # --- KL, CISPO / SAPO ---
    kl_estimator: KLEstimatorName = _f(
        "k3", "Per-token KL(π ‖ π_ref) estimator when beta > 0: k1 = log π/π_ref, k2 = ½(log π/π_ref)², "
        "k3 = π_ref/π − log(π_ref/π) − 1 (unbiased and >= 0; TRL's only one)."
    )
    use_bias_correction_kl: bool = _f(
        True, "Multiply the KL term by the importance ratio π/π_old, with its gradient, so the KL gradient is the "
        "unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default). Changes the gradient whenever beta > 0."
    )
    sapo_temperature_pos: float = _f(1.0, "loss_type='sapo': gate temperature τ for tokens with positive advantage.")
    sapo_temperature_neg: float = _f(1.05, "loss_type='sapo': gate temperature τ for tokens with advantage <= 0.")
    # --- TRL 1.16's further algorithm options (their meanings; docs/trainer.md) ---
    vespo_k_pos: float = _f(2.0, "loss_type='vespo': shape k of the gamma weight φ(w) = e^λ·w^k·e^(−λw) where A >= 0.")
    vespo_lambda_pos: float = _f(3.0, "loss_type='vespo': rate λ of the gamma weight where A >= 0.")
    vespo_k_neg: float = _f(3.0, "loss_type='vespo': shape k of the gamma weight where A < 0.")
    vespo_lambda_neg: float = _f(2.0, "loss_type='vespo': rate λ of the gamma weight where A < 0.")
    multi_objective_aggregation: str = _f(
        "sum_then_normalize", "Several reward functions: sum_then_normalize (weighted sum, then the advantage "
        "estimator with scale_rewards) | normalize_then_sum (GDPO: each function normalised within its group, "
        "weighted sum, then normalised over the batch; scale_rewards has no effect, advantage_estimator must be grpo)."
    )
    off_policy_mask_threshold: float | None = _f(
        None, "DeepSeek-V3.2 off-policy sequence masking: a completion with negative advantage whose mean per-token "
        "log π_sampler − log π is above this is left out of the policy term (e.g. 0.5); null = off."
    )
    top_entropy_quantile: float = _f(
        1.0, "Train the policy term (and the entropy bonus) only on the tokens whose entropy is in this top fraction "
        "of each micro-batch's completion tokens over all processes (0.2 as in 'Beyond the 80/20 rule'); 1 = all."
    )
    use_adaptive_entropy: bool = _f(
        False, "Skywork-OR1 adaptive entropy: after each optimizer step entropy_coef moves by entropy_coef_delta "
        "(up when the step's mean entropy is at or below entropy_target, down otherwise, within entropy_coef_min/max); "
        "the bonus applies only while the last step's entropy is at or below the target."
    )
    entropy_coef_min: float = _f(0.0, "use_adaptive_entropy: lower bound of entropy_coef.")
    entropy_coef_max: float = _f(1.0, "use_adaptive_entropy: upper bound of entropy_coef.")
    entropy_coef_delta: float = _f(0.005, "use_adaptive_entropy: change of entropy_coef per optimizer step.")
    entropy_target: float = _f(0.2, "use_adaptive_entropy: target mean per-token entropy (nats).")
    cast_lm_head_to_fp32: bool = _f(
        False, "Compute the output head (logits) in float32 in training, the reference and the rollout, whatever the "
        "model's dtype or autocast (ScaleRL); a head tied to the input embeddings keeps them in its float32 weight."
    )
    sync_ref_model: bool = _f(
        False, "TR-DPO reference updates: every ref_model_sync_steps optimizer steps the reference becomes "
        "ref_model_mixup_alpha × policy + (1 − alpha) × reference. Needs beta > 0 and full fine-tuning (under LoRA "
        "the reference is the base with adapters off, see docs/trainer.md)."
    )
    ref_model_mixup_alpha: float = _f(0.6, "sync_ref_model: weight α of the policy in the reference update.")
    ref_model_sync_steps: int = _f(512, "sync_ref_model: optimizer steps between reference updates.")
    # --- tool calling (GRPOTrainer(tools=..., environment_factory=...)) ---
    max_tool_calling_iterations: int | None = _f(
        None, "Tool steps per completion; a turn with calls past it ends the completion; null = only "
        "max_completion_length (generated + tool tokens) limits it (TRL's meaning)."
    )
    tool_call_parser: str = _f("qwen", "How tool calls are read from a turn: qwen (Qwen2.5/Qwen3 <tool_call> JSON) | hermes.")
    tool_timeout: float = _f(30.0, "Seconds allowed per tool call; a call past it returns an error message to the model.")
    tool_max_output_chars: int | None = _f(4096, "Tool output longer than this is cut (with a note); null = no limit.")
    # --- off-policy correction of the sampler/trainer mismatch (TRL: vllm_importance_sampling_*) ---
    importance_sampling_correction: bool = _f(
        False, "Re-weight each token's policy-gradient term by π_trainer/π_sampler (from the trainer's old "
        "log-probs and the sampler's), truncated or masked, to correct sampling in another precision or engine."
    )
    importance_sampling_mode: ImportanceSamplingMode = _f(
        "sequence_mask", "token_truncate (ratio per token clipped to [clip_min, clip_max]) | token_mask (ratio "
        "set to 0 outside) | sequence_truncate | sequence_mask (one ratio per sequence: product over its tokens)."
    )
    importance_sampling_clip_max: float | None = _f(3.0, "Upper bound C_max of the importance ratio; null = none.")
    importance_sampling_clip_min: float | None = _f(None, "Lower bound C_min of the importance ratio; null = none.")
    # TRL 1.16's names for the four settings above; each is moved onto its neutral name (and reset to null).
    vllm_importance_sampling_correction: bool | None = _f(
        None, "TRL alias of importance_sampling_correction.", alias_of="importance_sampling_correction"
    )
    vllm_importance_sampling_mode: str | None = _f(
        None, "TRL alias of importance_sampling_mode.", alias_of="importance_sampling_mode"
    )
    vllm_importance_sampling_clip_max: float | None = _f(
        None, "TRL alias of importance_sampling_clip_max.", alias_of="importance_sampling_clip_max"
    )
    vllm_importance_sampling_clip_min: float | None = _f(
        None, "TRL alias of importance_sampling_clip_min.", alias_of="importance_sampling_clip_min"
    )
    vllm_importance_sampling_cap: float | None = _f(
        None, "TRL's deprecated alias of importance_sampling_clip_max.", alias_of="importance_sampling_clip_max"
    )

    @property
    def needs_reference_model(self) -> bool:
        """The KL term to the reference policy is on (``beta > 0``)."""
        return self.beta > 0

    def __post_init__(self) -> None:
        if (self.use_vllm or self.rollout_backend == "vllm") and self.vllm_importance_sampling_correction is None:
            # TRL's default with vLLM: correct the sampler/trainer mismatch (turn off with the TRL name).
            self.importance_sampling_correction = True
        _apply_aliases(self)
        if self.loss_type == "gspo":  # our alias; TRL spells GSPO as sequence-level ratios under the grpo loss
            self.loss_type, self.importance_sampling_level = "grpo", "sequence"
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(
                f"scale_rewards must be 'group', 'batch' or 'none', got {self.scale_rewards!r}"
                f"{closest(str(self.scale_rewards), ['group', 'batch', 'none'])}"
            )
        if self.epsilon <= 0:
            raise ConfigError(f"epsilon must be > 0, got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(
                f"epsilon_high ({self.epsilon_high}) must be >= epsilon ({self.epsilon}); clip-higher widens the upper range"
            )
        high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        if self.delta is not None and self.delta <= 1 + high:
            raise ConfigError(f"delta ({self.delta}) must be > 1 + epsilon_high ({1 + high})")
        if self.beta < 0 or not math.isfinite(self.beta):
            raise ConfigError(f"beta must be a finite number >= 0, got {self.beta}")
        _positive(self, "tool_timeout", "tool_max_output_chars")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ConfigError(f"max_tool_calling_iterations must be null or >= 0, got {self.max_tool_calling_iterations}")

        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser {self.tool_call_parser!r} is unknown; registered parsers: "
                              f"{', '.join(sorted(TOOL_CALL_PARSERS))}{closest(self.tool_call_parser, list(TOOL_CALL_PARSERS))}")
        if self.num_iterations < 1:
            raise ConfigError(f"num_iterations must be >= 1, got {self.num_iterations}")
        if self.max_dynamic_sampling_rounds < 0:
            raise ConfigError(f"max_dynamic_sampling_rounds must be >= 0, got {self.max_dynamic_sampling_rounds}")
        self._check_loss_and_correction()

    def _check_loss_and_correction(self) -> None:
        """KL estimator, CISPO/SAPO parameters and the importance-sampling correction settings."""
        _check_choice("kl_estimator", self.kl_estimator, typing.get_args(KLEstimatorName))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        self._check_trl_algorithm_options()
        _check_choice("importance_sampling_mode", self.importance_sampling_mode, typing.get_args(ImportanceSamplingMode))
        for name in ("importance_sampling_clip_max", "importance_sampling_clip_min"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a finite number >= 0 or null, got {value}")
        lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ConfigError(f"importance_sampling_clip_min ({lo}) must be less than importance_sampling_clip_max ({hi})")
        if self.importance_sampling_correction and self.importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise ConfigError(
                f"importance_sampling_mode={self.importance_sampling_mode!r} truncates the ratio, so it needs "
                "importance_sampling_clip_max or importance_sampling_clip_min"
            )


    def _check_trl_algorithm_options(self) -> None:
        """VESPO, reward aggregation, token selection, adaptive entropy and reference-sync settings."""
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        REWARD_AGGREGATIONS.get(self.multi_objective_aggregation)
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator != "grpo":
            raise ConfigError(
                f"multi_objective_aggregation='normalize_then_sum' makes GDPO's advantages itself; it does not combine "
                f"with advantage_estimator={self.advantage_estimator!r}. Use advantage_estimator='grpo' or "
                "multi_objective_aggregation='sum_then_normalize'"
            )
        if self.off_policy_mask_threshold is not None and not math.isfinite(self.off_policy_mask_threshold):
            raise ConfigError(f"off_policy_mask_threshold must be a finite number or null, got {self.off_policy_mask_threshold}")
        check_quantile(self.top_entropy_quantile)
        if not 0 <= self.entropy_coef_min <= self.entropy_coef_max:
            raise ConfigError(f"need 0 <= entropy_coef_min ({self.entropy_coef_min}) <= entropy_coef_max "
                              f"({self.entropy_coef_max})")
        if self.entropy_coef_delta < 0:
            raise ConfigError(f"entropy_coef_delta must be >= 0, got {self.entropy_coef_delta}")
        if self.loss_type == "vespo" and self.importance_sampling_correction and \
                self.importance_sampling_mode.startswith("sequence"):
            raise ConfigError(
                f"loss_type='vespo' folds per-token importance-sampling weights into its gamma weight: "
                f"importance_sampling_mode must be token_truncate or token_mask, got {self.importance_sampling_mode!r}"
            )
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ConfigError(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        _positive(self, "ref_model_sync_steps")
        if self.sync_ref_model and self.beta == 0:
            raise ConfigError(
                "sync_ref_model=True with beta=0.0: the reference model is not used, so there is nothing to "
                "synchronize; set beta > 0 or sync_ref_model=False"
            )


def _apply_aliases(cfg: Any) -> None:
    """Move values given under an alias name (fields with ``alias_of`` metadata, e.g. TRL's
    ``vllm_importance_sampling_mode``) onto their own field, then reset the alias to None so the
    config round-trips through ``to_dict``; a conflicting value under both names is an error."""
    for f in dataclasses.fields(cfg):
        target = f.metadata.get("alias_of")
        value = getattr(cfg, f.name)
        if target is None or value is None:
            continue
        target_field = next(t for t in dataclasses.fields(cfg) if t.name == target)
        current = getattr(cfg, target)
        if current != target_field.default and current != value:
            raise ConfigError(
                f"{f.name}={value!r} (TRL's name for {target}) conflicts with {target}={current!r}; set only one"
            )
        setattr(cfg, target, value)
        setattr(cfg, f.name, None)


@dataclass
class PPOConfig(BaseRLConfig):
    """PPO settings: the shared fields plus critic, KL-penalised token rewards and GAE."""

    learning_rate: float = _f(1e-5, "AdamW peak learning rate (policy and critic).")
    num_generations: int = _f(2, "Completions sampled per prompt (PPO needs no group; >= 2 keeps batches comparable).")
    epsilon: float = _f(0.2, "Policy ratio clipping range.")
    epsilon_high: float | None = _f(None, "Upper policy clipping range; null = epsilon.")
    kl_coef: float = _f(0.05, "Per-token KL penalty coefficient in the rewards.")
    adaptive_kl: bool = _f(False, "Adapt kl_coef towards target_kl (proportional controller).")
    target_kl: float = _f(6.0, "Target KL (sum over tokens) for the adaptive controller.")
    kl_horizon: int = _f(10000, "Horizon of the adaptive KL controller.")
    gamma: float = _f(1.0, "Discount factor for GAE.")
    lam: float = _f(0.95, "GAE lambda.")
    whiten_advantages: bool = _f(True, "Normalise advantages over valid tokens.")
    cliprange_value: float = _f(0.2, "Value clipping range around the old values.")
    vf_coef: float = _f(0.1, "Value loss coefficient.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    ppo_epochs: int = _f(2, "Optimisation passes over each rollout batch.")
    num_mini_batches: int = _f(
        1, "Mini-batches (optimizer steps) per pass over a rollout batch; the rollout batch on each device is "
        "per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches completions."
    )
    loss_type: str = _f("bnpo", "Policy-loss aggregation from the loss registry (bnpo = token mean per step, as PPO).")
    critic_init: Literal["policy", "reward_model"] = _f(
        "policy", "Critic backbone: the policy's frozen base with its own LoRA, or a reward model path."
    )
    critic_model: str | None = _f(None, "Reward-model path for critic_init='reward_model'.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma and lam must be in [0, 1], got gamma={self.gamma}, lam={self.lam}")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(f"epsilon_high ({self.epsilon_high}) must be >= epsilon ({self.epsilon})")
        _positive(self, "ppo_epochs", "num_mini_batches", "cliprange_value", "epsilon")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.critic_init == "reward_model" and not self.critic_model:
            raise ConfigError("critic_init='reward_model' needs critic_model: the reward model's path")

    @property
    def needs_reference_model(self) -> bool:
        """The KL penalty in the token rewards is on (``kl_coef > 0``)."""
        return self.kl_coef > 0

    @property
    def num_iterations(self) -> int:
        """Passes over each rollout batch, under the name the batch plan uses (= ppo_epochs)."""
        return self.ppo_epochs

    def resolved_steps_per_generation(self, world_size: int = 1) -> int:
        """Micro-batches per rollout batch on each device: num_mini_batches × gradient_accumulation_steps,
        unless steps_per_generation / generation_batch_size set it (then num_mini_batches must agree)."""
        if self.steps_per_generation is None and self.generation_batch_size is None:
            return self.num_mini_batches * self.gradient_accumulation_steps
        spg = super().resolved_steps_per_generation(world_size)
        if spg != self.num_mini_batches * self.gradient_accumulation_steps:
            raise ConfigError(
                f"num_mini_batches ({self.num_mini_batches}) disagrees with the rollout batch: {spg} micro-batches "
                f"per device / gradient_accumulation_steps {self.gradient_accumulation_steps} give "
                f"{spg / self.gradient_accumulation_steps:g} optimizer steps per pass; set num_mini_batches to that, "
                "or leave steps_per_generation and generation_batch_size unset"
            )
        return spg

