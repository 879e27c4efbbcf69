"""Every field of TRL 1.16's ``GRPOConfig`` (its own and those it inherits from transformers'
``TrainingArguments``), classified for :mod:`grpo_ascend.config.trl_compat`:

- **mapped**: moved onto our setting(s), with the difference (if any) in the note;
- **ignored**: harmless here (logging, I/O, kernels, engines we do not have and that TRL itself only
  uses under a setting we refuse); a non-default value draws one warning that lists them all;
- **refused**: it changes the algorithm or the run in a way we do not implement; a non-default value
  is an error saying why.

The table is in TRL's field order; docs/trl_compatibility.md is generated from it, and a test checks
that every field of the installed ``trl.GRPOConfig`` is here.
"""

from __future__ import annotations

from typing import Any

from grpo_ascend.config.trl_mapping import (
    _GENERATION_KEYS,
    TRLField,
    _checkpointing,
    _eval_strategy,
    _generation_kwargs,
    _log_completions,
    _loss_type,
    _metric,
    _model_init_kwargs,
    _nothing,
    _optim,
    _pad_to,
    _print_count,
    _save_steps,
    _save_strategy,
    _scheduler,
    _steps_per_generation,
    _trust_remote_code,
    _use_cpu,
    _warmup,
    _whole_steps,
    _with_vllm,
    ignored,
    refused,
    same,
    to,
)
from grpo_ascend.distributed.trl_config import AFTER, ENGINE_FIELDS

_VLLM = "applies only to vLLM generation (use_vllm=True)"


_EVAL_LOOP = "an option of transformers' evaluation loop; evaluation here generates and scores (docs/evaluation.md)"
_LOADER = "there is no DataLoader: prompts are drawn by a seeded, resumable sampler"
_DDP = "DDP tuning knob; data parallelism is accelerate's DDP with its defaults"
_LOG = "logging detail; metrics go to metrics.jsonl and report_to's trackers"
_SPEED = "speed or memory only; the built-in engine and kernels are used"
TRL_FIELDS: dict[str, TRLField] = {
    # --- transformers.TrainingArguments ---
    "output_dir": same("TRL's default 'trainer_output' applies when unset"),
    "per_device_train_batch_size": same("completions per device per micro-batch, as TRL"),
    "num_train_epochs": same(),
    "max_steps": same(),
    "learning_rate": same(),
    "lr_scheduler_type": to("lr_scheduler_type", "linear, cosine, constant (no warm-up, as transformers) and "
                            "constant_with_warmup; others refused. The warm-up ramp is (step+1)/(warmup+1), not "
                            "step/warmup", _scheduler, differs=True),
    "lr_scheduler_kwargs": refused("the schedule's own parameters (cycles, power, min lr) are not implemented"),
    "warmup_steps": to(("warmup_steps", "warmup_ratio"), "a fraction in (0, 1) becomes warmup_ratio", _warmup),
    "optim": to((), "adamw_torch and adamw_torch_fused (the same AdamW, not fused); other optimizers refused", _optim, differs=True),
    "optim_args": refused("optimizer options beyond AdamW's betas, epsilon and weight decay are not implemented"),
    "weight_decay": same(),
    "adam_beta1": same(),
    "adam_beta2": same(),
    "adam_epsilon": same(),
    "optim_target_modules": refused("GaLore / APOLLO-style optimizers are not implemented"),
    "gradient_accumulation_steps": same(),
    "average_tokens_across_devices": ignored("the loss is always normalised by token counts summed over all ranks"),
    "max_grad_norm": same(),
    "label_smoothing_factor": ignored("GRPO has no labels to smooth"),
    "bf16": same("TRL resolves an unset bf16 to true unless fp16; that value is used"),
    "fp16": same(),
    "bf16_full_eval": ignored("evaluation runs in the training precision"),
    "fp16_full_eval": ignored("evaluation runs in the training precision"),
    "tf32": ignored("matmul precision mode of Ampere GPUs; left at torch's setting"),
    "activation_checkpointing": to("gradient_checkpointing", "TRL's default is true", _checkpointing),
    "activation_checkpointing_kwargs": ignored("checkpointing always runs with use_reentrant=False; the numbers "
                                               "are the same"),
    "gradient_checkpointing": to("gradient_checkpointing", "deprecated alias of activation_checkpointing in "
                                 "transformers 5; TRL's default is true", _checkpointing),
    "gradient_checkpointing_kwargs": ignored("checkpointing always runs with use_reentrant=False; the numbers "
                                             "are the same"),
    "torch_compile": ignored(_SPEED + " (compile_decode compiles the rollout's decode step)"),
    "torch_compile_backend": ignored(_SPEED),
    "torch_compile_mode": ignored(_SPEED),
    "use_liger_kernel": ignored(_SPEED + " (Liger's fused GRPO loss computes the same loss)"),
    "liger_kernel_config": ignored(_SPEED),
    "use_cache": ignored("the rollout engine always uses its own KV cache; training forwards never do"),
    "neftune_noise_alpha": refused("NEFTune adds noise to the embeddings during training, which changes the "
                                   "policy's log-probs"),
    "torch_empty_cache_steps": ignored(_SPEED),
    "auto_find_batch_size": refused("halving the batch on out-of-memory breaks whole prompt groups (TRL refuses "
                                    "it too)"),
    "logging_strategy": ignored(_LOG + "; every logging_steps optimizer steps"),
    "logging_steps": to("logging_steps", "whole steps only (a fraction of the run is refused); TRL's default is 10",
                        _whole_steps("logging_steps"), differs=True),
    "logging_first_step": ignored(_LOG),
    "log_on_each_node": ignored(_LOG + "; only the main process logs"),
    "logging_nan_inf_filter": ignored(_LOG + "; a step with a NaN/inf loss is skipped and counted"),
    "include_num_input_tokens_seen": ignored(_LOG + "; tokens_generated is logged per step"),
    "log_level": ignored(_LOG),
    "log_level_replica": ignored(_LOG),
    "disable_tqdm": same(),
    "report_to": same("tensorboard, wandb, swanlab, trackio (and 'none' / 'all'); other trackers refused by "
                      "report_to's own check", differs=True),
    "run_name": ignored(_LOG),
    "project": ignored(_LOG),
    "trackio_space_id": ignored(_LOG),
    "trackio_bucket_id": ignored(_LOG),
    "trackio_static_space_id": ignored(_LOG),
    "eval_strategy": to("eval_strategy", "'no' and 'steps'; 'epoch' refused", _eval_strategy, differs=True),
    "eval_steps": to("eval_steps", "whole steps only", _whole_steps("eval_steps"), differs=True),
    "eval_delay": ignored("evaluation starts at the first eval_steps boundary"),
    "per_device_eval_batch_size": same("completions per engine call during evaluation"),
    "prediction_loss_only": ignored(_EVAL_LOOP),
    "eval_on_start": same(),
    "eval_do_concat_batches": ignored(_EVAL_LOOP),
    "eval_use_gather_object": ignored(_EVAL_LOOP),
    "eval_accumulation_steps": ignored(_EVAL_LOOP),
    "include_for_metrics": ignored(_EVAL_LOOP),
    "batch_eval_metrics": ignored(_EVAL_LOOP),
    "save_only_model": ignored("checkpoints always hold the optimizer and RNG state, for exact resume"),
    "save_strategy": to("save_steps", "'steps'; 'no' becomes save_steps=0 (the final checkpoint is still "
                        "written); 'epoch' and 'best' refused", _save_strategy, differs=True),
    "save_steps": to("save_steps", "whole steps only; saves land on generation-round boundaries",
                     _save_steps, differs=True),
    "save_on_each_node": ignored("the main process writes checkpoints"),
    "save_total_limit": same("the best checkpoint is kept besides the newest"),
    "enable_jit_checkpoint": ignored("checkpoint on SIGTERM is not implemented; resume from the last checkpoint"),
    "push_to_hub": same("uploads are blocking (transformers pushes checkpoints in the background)", differs=True),
    "hub_token": same(),
    "hub_private_repo": same(),
    "hub_model_id": same(),
    "hub_strategy": same(),
    "hub_always_push": ignored("pushes are blocking, so none is ever skipped"),
    "hub_revision": same(),
    "load_best_model_at_end": same(),
    "metric_for_best_model": to("metric_for_best_model", "'eval_X' becomes 'X'; transformers' default 'loss' "
                                "is the GRPO loss on the eval completions (eval/loss, TRL's eval_loss)", _metric,
                                differs=True),
    "greater_is_better": same(),
    "ignore_data_skip": ignored("resume restores the prompt sampler's position exactly"),
    "restore_callback_states_from_checkpoint": ignored("callbacks' own state is not checkpointed"),
    "full_determinism": ignored("runs are always seeded; bit-exact kernels are not forced"),
    "seed": same(),
    "data_seed": ignored("the prompt order is seeded by seed"),
    "use_cpu": to("device", "true becomes device='cpu'", _use_cpu),
    "accelerator_config": same("transformers' options, kept; only dispatch_batches is read (false with a streamed "
                               "dataset, as TRL): the trainer draws prompts itself", differs=True),
    "parallelism_config": refused("tensor / context / sequence parallelism is not implemented"),
    "dataloader_drop_last": ignored(_LOADER),
    "dataloader_num_workers": same("kept with TRL's rule (0 for a streamed train set); no worker starts: prompts "
                                   "are drawn by the trainer's own sampler", differs=True),
    "dataloader_pin_memory": ignored(_LOADER),
    "dataloader_persistent_workers": ignored(_LOADER),
    "dataloader_prefetch_factor": ignored(_LOADER),
    "dataloader_multiprocessing_context": ignored(_LOADER),
    "dataloader_in_order": ignored(_LOADER),
    "remove_unused_columns": ignored("every dataset column reaches the reward functions"),
    "label_names": ignored("GRPO has no labels"),
    "train_sampling_strategy": ignored("TRL's GRPOTrainer samples with its own sampler too (shuffle_dataset)"),
    "length_column_name": ignored("prompts are not grouped by length"),
    "ddp_find_unused_parameters": ignored(_DDP),
    "ddp_bucket_cap_mb": ignored(_DDP),
    "ddp_broadcast_buffers": ignored(_DDP),
    "ddp_static_graph": ignored(_DDP),
    "ddp_backend": ignored("the collective backend follows the device (grpo_ascend/device/)"),
    "ddp_timeout": same("on Ascend HCCL_EXEC_TIMEOUT is derived from it"),
    "debug": ignored("transformers' debug modes (underflow / TPU metrics)"),
    "skip_memory_metrics": ignored("memory/peak_gb metrics are always logged"),
    "do_train": ignored("a flag for scripts; the trainer never reads it (nor does transformers')"),
    "do_eval": ignored("a flag for scripts; eval_strategy decides"),
    "do_predict": ignored("a flag for scripts"),
    "resume_from_checkpoint": same("also a train() argument, as TRL"),
    "local_rank": ignored("set by the launcher; accelerate reads the rank itself"),
    # --- TRL GRPOConfig ---
    "model_init_kwargs": to("model_init_kwargs", "dtype defaults to float32, as TRL", _model_init_kwargs),
    "trust_remote_code": to("model_init_kwargs", "becomes model_init_kwargs['trust_remote_code']", _trust_remote_code),
    "router_aux_loss_coef": same("an MoE model's load-balancing loss (the model's own) is added as TRL: coef · loss / "
                                 "gradient_accumulation_steps per micro-batch, logged as aux_loss; not in eval_loss, "
                                 "not with image prompts", differs=True),
    "disable_dropout": same("every nn.Dropout (LoRA's included) gets p=0, as TRL"),
    "cast_lm_head_to_fp32": same("the head's matmul runs in float32 in training, reference and rollout (a tied "
                                 "head's embeddings still output the model's dtype, as TRL)"),
    "num_generations": same(),
    "num_generations_eval": same(),
    "max_completion_length": same("TRL's default is 512 (ours 256)"),
    "ds3_gather_for_generation": ignored("under ZeRO-3 the weights are always gathered for generation"),
    "shuffle_dataset": same(),
    "pad_to_multiple_of": to("length_bucket", "null (TRL: no padding) leaves the device's default: exact lengths, "
                             "64 on NPUs", _pad_to, differs=True),
    "generation_batch_size": to("steps_per_generation", "TRL resolves it into steps_per_generation, which is used",
                                _nothing),
    "steps_per_generation": to(("steps_per_generation", "generation_batch_size"), "", _steps_per_generation),
    "temperature": same(),
    "top_p": same(),
    "top_k": same(),
    "min_p": same(),
    "generation_kwargs": to(tuple(sorted(_GENERATION_KEYS)), "only the keys temperature, top_p, top_k, min_p, "
                            "repetition_penalty, stop_strings (overriding the fields, as TRL); beam-search keys "
                            "(num_beams, length_penalty, ...) ignored with a warning; others refused",
                            _generation_kwargs, differs=True),
    "chat_template_kwargs": same(),
    "repetition_penalty": same(),
    "cache_implementation": ignored("the rollout engine has its own bucketed KV cache"),
    "use_vllm": same("rollout_backend 'vllm' (docs/vllm.md)"),
    "vllm_mode": same(),
    "vllm_model_impl": same(),
    "vllm_enable_sleep_mode": same("where the platform has a sleep mode (vLLM's CPU build has none: logged)"),
    "vllm_structured_outputs_regex": refused("regex-guided structured outputs are not passed to vLLM"),
    "vllm_server_base_url": same(),
    "vllm_server_host": same(),
    "vllm_server_port": same(),
    "vllm_server_timeout": same(),
    "vllm_group_port": ignored("weights reach a server as an adapter folder or a weights folder it loads, not "
                               "through a collective communication group"),
    "vllm_gpu_memory_utilization": same(),
    "vllm_max_model_length": same(),
    "vllm_tensor_parallel_size": same("colocated engines take 1 (a tensor-parallel engine is a server here)",
                                      differs=True),
    "beta": same(),
    "num_iterations": same(),
    "epsilon": same(),
    "delta": same(),
    "epsilon_high": same(),
    "sapo_temperature_neg": same(),
    "sapo_temperature_pos": same(),
    "vespo_k_pos": same(),
    "vespo_lambda_pos": same(),
    "vespo_k_neg": same(),
    "vespo_lambda_neg": same(),
    "importance_sampling_level": same(),
    "reward_weights": same(),
    "multi_objective_aggregation": same("sum_then_normalize and normalize_then_sum (GDPO), a registry; "
                                        "normalize_then_sum needs advantage_estimator='grpo'"),
    "scale_rewards": same(),
    "loss_type": to("loss_type", "every TRL loss type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo)",
                    _loss_type),
    "mask_truncated_completions": same(),
    "sync_ref_model": same("full fine-tuning; refused under LoRA (the reference is the base with adapters off, "
                           "and a mixture of the policy and the base is not the base; TRL refuses PEFT too)",
                           differs=True),
    "ref_model_mixup_alpha": same(),
    "ref_model_sync_steps": same(),
    "top_entropy_quantile": same("the quantile is taken over each micro-batch's tokens (all ranks), as TRL; our "
                                 "micro-batches are packed per max_tokens_per_micro_batch when that is set",
                                 differs=True),
    "entropy_coef": same("the bonus is the step's mean per-token entropy whatever the loss_type, as TRL; TRL "
                         "averages each micro-batch's mean, equal when micro-batches hold equal token counts",
                         differs=True),
    "use_adaptive_entropy": same("the controller's entropy is the step's token mean over all ranks, as TRL; the "
                                 "bonus as entropy_coef's (above)", differs=True),
    "entropy_coef_min": same(),
    "entropy_coef_max": same(),
    "entropy_coef_delta": same(),
    "entropy_target": same(),
    "max_tool_calling_iterations": same(),
    "vllm_importance_sampling_correction": to("importance_sampling_correction", "with use_vllm=True, as TRL",
                                              _with_vllm("importance_sampling_correction")),
    "vllm_importance_sampling_mode": to("importance_sampling_mode", "with use_vllm=True, as TRL",
                                        _with_vllm("importance_sampling_mode")),
    "vllm_importance_sampling_clip_max": to("importance_sampling_clip_max", "with use_vllm=True, as TRL",
                                            _with_vllm("importance_sampling_clip_max")),
    "vllm_importance_sampling_clip_min": to("importance_sampling_clip_min", "with use_vllm=True, as TRL",
                                            _with_vllm("importance_sampling_clip_min")),
    "off_policy_mask_threshold": same("the KL is taken against the rollout engine's sampling log-probs (TRL: vLLM's, "
                                      "else the old policy's)", differs=True),
    "use_bias_correction_kl": same(),
    "log_completions": to("log_completions_steps", "true writes samples every logging_steps; false keeps "
                          "samples.jsonl at its own default (every 10 steps)", _log_completions, differs=True),
    "log_multimodal": ignored("prompts are text"),
    "num_completions_to_print": to("num_completions_to_print", "null (TRL: all) keeps our default of 4",
                                   _print_count, differs=True),
    "log_unique_prompts": ignored(_LOG),
    "log_completions_hub_repo": ignored("completions are written to samples.jsonl, not uploaded"),
    "use_transformers_continuous_batching": ignored(_SPEED),
    "transformers_continuous_batching_config": ignored(_SPEED),
    "use_transformers_paged": ignored(_SPEED),
    "vllm_importance_sampling_cap": to("importance_sampling_clip_max", "with use_vllm=True, as TRL",
                                       _with_vllm("importance_sampling_clip_max")),
}

def _with_engine_fields(table: dict[str, TRLField]) -> dict[str, TRLField]:
    """Insert the engine-choosing fields (classified in grpo_ascend/distributed/trl_config.py) at their place in TRL's order."""

    out: dict[str, TRLField] = {}
    for name, entry in table.items():
        out[name] = entry
        if name == AFTER:
            out.update({field: refused(why) for field, why in ENGINE_FIELDS.items()})
    return out


TRL_FIELDS = _with_engine_fields(TRL_FIELDS)
for _name, _entry in TRL_FIELDS.items():
    if _entry.kind == "mapped" and not _entry.targets and _entry.convert is None:
        object.__setattr__(_entry, "targets", (_name,))

#: What the conversion sets although TRL has no field for it, and why.
IMPLIED_SETTINGS: dict[str, tuple[Any, str]] = {
    "max_prompt_length": (None, "TRL 1.16 does not truncate or refuse long prompts"),
    "train_vision_parts": (None, "TRL 1.16 trains a vision-language model's vision tower and projector too in full "
                           "fine-tuning (docs/vlm.md)"),
}
