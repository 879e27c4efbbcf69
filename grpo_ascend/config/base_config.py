"""The settings GRPO and PPO share (:class:`BaseRLConfig`); the batch arithmetic they give is :class:`BatchPlan`
(:mod:`grpo_ascend.config.batch_plan`).

Every field carries its help text in ``metadata["help"]`` (the config reference is generated from it); bad values
raise :class:`ConfigError` with one clear line. The algorithms' own settings are in :mod:`grpo_ascend.config.configs`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from grpo_ascend.config.batch_plan import BatchPlan
from grpo_ascend.config.fields import _check_choice, _f, _positive, _Validated
from grpo_ascend.config.loader_settings import accelerator_config
from grpo_ascend.config.rollout_modes import check_async_settings
from grpo_ascend.errors import ConfigError
from grpo_ascend.eval_metrics import check_eval_config
from grpo_ascend.tracking.trackers import check_report_to, installed_trackers
from grpo_ascend.weight_transfer.settings import check_weight_transfer


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
    train_vision_parts: list[str] | None = _f(
        None, "Vision-language models: what trains besides the language model. null (default, TRL's choice): every "
        "weight in full fine-tuning (vision tower and projector included), the language model's adapters under LoRA; "
        "a list from 'projector' and 'vision_tower': those parts too (LoRA on their linear layers, or their whole "
        "weights without LoRA); [] the language model only (docs/vlm.md).")
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
    vllm_server_base_url: str | list[str] | None = _f(
        None, "Server mode: the server's URL, or a list of servers' URLs (a YAML list, or comma-separated) that "
        "requests are spread over, a dead one dropped; overrides host and port."
    )
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
    # --- asynchronous rollouts (TRL's AsyncGRPOConfig names and meanings; docs/async.md) ---
    rollout_mode: Literal["sync", "one_step_off", "async"] = _f(
        "sync", "sync: sample, score, then train, each waiting for the other; one_step_off: batch k+1 is sampled "
        "while batch k trains (every sample one policy version old); async: a producer keeps up to "
        "max_inflight_tasks prompts in flight into a bounded queue, dropping groups older than max_staleness. "
        "With the built-in engine, one_step_off and async sample in a rollout process of their own."
    )
    max_inflight_tasks: int = _f(
        -1, "async: prompts sampled ahead of training at most (queued or being sampled); -1 = max(max_staleness, 1) "
        "× the prompts of one generation round."
    )
    max_staleness: int = _f(
        4, "async: a group sampled more than this many policy versions before the step that would train it is "
        "dropped (counted as async/dropped_groups) and its prompt sampled again."
    )
    queue_maxsize: int = _f(1024, "async: completions the queue between producer and trainer holds at most.")
    weight_sync_steps: int = _f(
        1, "async: optimizer steps between weight pushes to the sampler (a policy version is one push)."
    )
    heartbeat_stale_after_s: float = _f(
        300.0, "Seconds without a heartbeat from the rollout process after which the run stops instead of waiting."
    )
    request_timeout: float = _f(600.0, "Seconds one rollout request (a batch of prompts) may take before the run stops.")
    weight_sync_timeout: float = _f(
        1800.0, "Seconds one weight push to the sampler may take before the run stops with one clear line."
    )
    weight_transfer: Literal["auto", "collective", "files"] = _f(
        "auto", "How a full or LoRA weight sync reaches a sampler on other devices (a vLLM server, the rollout process "
        "on a device of its own): collective = over a process group (the device's collective backend; gloo on the CPU) "
        "built once per run, in buckets; files = written to vllm_sync_dir for the sampler to read; auto = collective "
        "where the sampler can join a group, else files (said in one line). Not a TRL setting."
    )
    weight_transfer_bucket_bytes: int | None = _f(
        None, "Bytes of one transfer bucket (two are in flight on each side); null = 2 % of free device memory within "
        "64 MiB - 1 GiB, at least the largest tensor. Not a TRL setting."
    )
    weight_transfer_host: str | None = _f(
        None, "The trainer's address the samplers' ranks connect to for a collective transfer; null = this machine's "
        "address on the route to the first server (127.0.0.1 for a local one). Not a TRL setting."
    )
    rollout_device: str | None = _f(
        None, "Where the rollout process samples: a torch device string (the second accelerator, say), or 'cpu'; null = the "
        "trainer's device (its own cores on the CPU). Not a TRL setting."
    )
    rollout_threads: int | None = _f(
        None, "CPU threads of the rollout process; null = half of the trainer's threads (at least 1), the trainer "
        "keeping the rest. Not a TRL setting."
    )
    partial_rollouts: Literal["continue", "abort"] = _f(
        "continue", "async: a newer policy version pushed while a request samples: continue under it (each token "
        "tagged with the version that sampled it; nothing thrown away) or abort and sample the request again "
        "once with it. Not a TRL setting."
    )
    max_rollout_restarts: int = _f(
        3, "Times a rollout process that died is restarted before the run stops. Not a TRL setting."
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
    # --- transformers' data-loading fields (TRL's rules for streams; grpo_ascend/config/loader_settings.py) ---
    dataloader_num_workers: int = _f(
        0, "transformers' DataLoader workers. Prompts are drawn by the trainer's own sampler, so no worker starts; "
        "kept as TRL keeps it: a streamed train_dataset sets it to 0 (with TRL's warning), a map-style one keeps it."
    )
    accelerator_config: Any = _f(
        None, "transformers' AcceleratorConfig options (a mapping, or a JSON file's path; null = its defaults): "
        "split_batches, dispatch_batches, even_batches, use_seedable_sampler, non_blocking, "
        "gradient_accumulation_kwargs, use_configured_state. Only dispatch_batches is read: a streamed train or "
        "eval dataset needs it false (true is refused, unset becomes false), as TRL; the others have no effect."
    )

    def __post_init__(self) -> None:
        if self.use_vllm:
            if self.rollout_backend not in ("builtin", "vllm"):
                raise ConfigError(f"use_vllm=True conflicts with rollout_backend={self.rollout_backend!r}; set only one")
            self.rollout_backend = "vllm"
        _check_choice("vllm_mode", self.vllm_mode, ("colocate", "server"))
        check_async_settings(self)
        check_weight_transfer(self.weight_transfer, self.weight_transfer_bucket_bytes)
        self.accelerator_config = accelerator_config(self.accelerator_config)
        if self.dataloader_num_workers < 0:
            raise ConfigError(f"dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
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
