"""TRL compatibility: ``GRPOTrainer(args=trl.GRPOConfig(...))`` and the TRL trainer surface.

:func:`from_trl_config` turns TRL 1.16's own ``GRPOConfig`` into ours with the classification of
:mod:`grpo_ascend.config.trl_fields`: mapped fields are moved over (TRL's defaults included: a TRL config
means TRL's defaults), and only fields changed from TRL's defaults count for the rest: ignored ones
draw one :class:`TRLConfigWarning` listing them, refused ones one :class:`~grpo_ascend.errors.ConfigError`
listing each with why (the pass is :func:`grpo_ascend.config.trl_keywords.classify`, which our own ``GRPOConfig``
uses for TRL field names given as keywords). trl is never imported here: a TRL config is recognised by its class.

``python -m grpo_ascend.config.trl_compat [--check]`` regenerates the tables of docs/trl_compatibility.md.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from grpo_ascend.config.configs import GRPOConfig
from grpo_ascend.config.generated_docs import update_block
from grpo_ascend.config.trl_fields import IMPLIED_SETTINGS, TRL_FIELDS
from grpo_ascend.config.trl_keywords import DOC, TRLConfigWarning, classify, differs

__all__ = ["TRLConfigWarning", "from_trl_config", "is_trl_grpo_config", "render_tables", "update_doc"]

#: The first field TRL's GRPOConfig adds to transformers' TrainingArguments (the table's order).
FIRST_GRPO_FIELD = "model_init_kwargs"
#: Applied after the other mapped fields: TRL lets generation_kwargs override the sampling fields.
_APPLIED_LAST = ("generation_kwargs",)


def is_trl_grpo_config(obj: Any) -> bool:
    """Whether ``obj`` is TRL's ``GRPOConfig`` (or a subclass), without importing trl."""
    return any(c.__name__ == "GRPOConfig" and c.__module__.split(".")[0] == "trl" for c in type(obj).__mro__)


def is_trl_async_grpo_config(obj: Any) -> bool:
    """Whether ``obj`` is TRL's ``AsyncGRPOConfig`` (trl.experimental.async_grpo), without importing trl."""
    return any(c.__name__ == "AsyncGRPOConfig" and c.__module__.split(".")[0] == "trl" for c in type(obj).__mro__)


#: TRL AsyncGRPOConfig's settings that ours take under the same names and meanings (docs/async.md).
ASYNC_FIELDS = ("max_inflight_tasks", "max_staleness", "queue_maxsize", "weight_sync_steps", "heartbeat_stale_after_s",
                "request_timeout", "weight_sync_timeout", "vllm_server_base_url", "vllm_server_timeout")
#: AsyncGRPOConfig's own settings with no counterpart here, and why (a set one is ignored with a warning).
ASYNC_IGNORED = {
    "fork_threshold_tokens": "multi-turn rows here are built from the token ids sampled, never re-tokenized",
    "token_budget": "a per-row token budget of TRL's batcher; use max_tokens_per_micro_batch",
}


def from_trl_async_config(cfg: Any) -> Any:
    """Our :class:`~grpo_ascend.config.configs.GRPOConfig` for TRL's ``AsyncGRPOConfig``: its asynchronous settings
    as they are (``rollout_mode: async`` on its vLLM server), the fields it shares with TRL's GRPOConfig mapped as
    :func:`from_trl_config` maps them; its own settings with no counterpart ignored with a warning."""
    import warnings

    defaults = _defaults(cfg)
    shared = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
              if f.init and f.name not in ASYNC_FIELDS and f.name not in ASYNC_IGNORED]
    result = classify(shared, lambda n, v: n not in defaults or differs(v, defaults[n]), cfg, convert_unchanged=True)
    result.report("trl.AsyncGRPOConfig", stacklevel=3)
    ignored = [f"{name} ({why})" for name, why in ASYNC_IGNORED.items()
               if hasattr(cfg, name) and differs(getattr(cfg, name), defaults.get(name))]
    if ignored:
        warnings.warn(f"trl.AsyncGRPOConfig settings ignored: {'; '.join(ignored)}", TRLConfigWarning, stacklevel=3)
    settings = {name: value for name, (value, _) in IMPLIED_SETTINGS.items()}
    own = {name: getattr(cfg, name) for name in ASYNC_FIELDS if hasattr(cfg, name)}
    return GRPOConfig.from_dict({**settings, **result.settings, **own, "rollout_mode": "async", "use_vllm": True,
                                 "vllm_mode": "server"}, source="trl.AsyncGRPOConfig")


def _defaults(cfg: Any) -> dict[str, Any]:
    """TRL's value of every field that is not mapped, when left unset: the fields of an instance of the same
    class built with ``cfg``'s mapped fields (its ``__post_init__`` derives some fields from them, e.g.
    ``do_eval`` from ``eval_strategy``, ``bf16`` from ``fp16``), else the fields' declared defaults."""
    mapped = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init
              and f.name in TRL_FIELDS and TRL_FIELDS[f.name].kind == "mapped"}
    mapped.pop("generation_batch_size", None)  # resolved together with steps_per_generation; TRL refuses both
    minimal = {k: mapped[k] for k in ("output_dir", "bf16", "fp16", "use_cpu") if k in mapped}
    for kwargs in (mapped, minimal):
        try:
            reference = type(cfg)(**kwargs)
            return {f.name: getattr(reference, f.name) for f in dataclasses.fields(cfg)}
        except Exception:  # e.g. a subclass with required fields: try less, then the declared defaults
            continue
    out = {}
    for f in dataclasses.fields(cfg):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def from_trl_config(cfg: Any) -> Any:
    """Our :class:`~grpo_ascend.config.configs.GRPOConfig` for TRL's ``cfg`` (see the module docstring)."""

    defaults = _defaults(cfg)
    names = [f.name for f in dataclasses.fields(cfg)]
    names.sort(key=lambda n: n in _APPLIED_LAST)
    result = classify(((n, getattr(cfg, n)) for n in names),
                      lambda n, v: n not in defaults or differs(v, defaults[n]), cfg, convert_unchanged=True)
    result.report("trl.GRPOConfig", stacklevel=3)
    settings = {name: value for name, (value, _) in IMPLIED_SETTINGS.items()}
    return GRPOConfig.from_dict({**settings, **result.settings}, source="trl.GRPOConfig")


# ---------------------------------------------------------------------------------------- trainer surface
#: TRL 1.16's GRPOTrainer arguments and the attributes / methods scripts use: (name, status, note).
#: "supported" and "differs" names exist on our trainer (a test checks it); "refused" ones raise.
TRAINER_SURFACE: list[tuple[str, str, str]] = [
    ("GRPOTrainer(model=...)", "supported", "a path, hub id, builtin:* name or a loaded PreTrainedModel"),
    ("GRPOTrainer(reward_funcs=...)", "supported", "callables (sync or async), module:function strings, reward-model "
     "paths (docs/rewards.md)"),
    ("GRPOTrainer(args=...)", "differs", "ours, or TRL's GRPOConfig converted per the tables above"),
    ("GRPOTrainer(train_dataset=...)", "supported", "a datasets.Dataset or IterableDataset (needs max_steps; "
     "resumes exactly, docs/checkpoints.md) with a prompt column"),
    ("GRPOTrainer(eval_dataset=...)", "supported", "a Dataset, an IterableDataset, or a dict / DatasetDict of them "
     "(metrics eval_<name>/..., docs/evaluation.md)"),
    ("GRPOTrainer(processing_class=...)", "supported", "a tokenizer (text models only)"),
    ("GRPOTrainer(reward_processing_classes=...)", "supported", "one tokenizer per reward model (a list as long as "
     "reward_funcs; None and plain functions' entries unused), docs/rewards.md"),
    ("GRPOTrainer(callbacks=...)", "supported", "TrainerCallback instances or classes"),
    ("GRPOTrainer(optimizers=...)", "differs", "(None, None) only: the optimizer is AdamW built from the config"),
    ("GRPOTrainer(quantization_config=...)", "differs", "None only: quantized (QLoRA) base models are refused"),
    ("GRPOTrainer(peft_config=...)", "supported", "a peft LoraConfig"),
    ("GRPOTrainer(tools=...)", "supported", "docs/tools.md"),
    ("GRPOTrainer(rollout_func=...)", "supported", ""),
    ("GRPOTrainer(environment_factory=...)", "supported", "docs/tools.md"),
    ("model", "differs", "the PEFT-wrapped policy with LoRA, else the policy; assigning a module with the same "
     "parameters copies its weights into the trained policy (optimizer and engines keep theirs), the same model is "
     "a no-op, anything else is refused"),
    ("ref_model", "supported", "the reference model (moved by sync_ref_model); None when beta is 0 or under LoRA "
     "(the policy with adapters disabled), as TRL's None for PEFT"),
    ("reward_processing_classes", "supported", "one entry per reward function: a reward model's tokenizer (given, "
     "else its own), None for other functions"),
    ("reward_funcs", "supported", "the reward functions in scoring order (a reward model named by a string: its "
     "loaded scorer), environments' get_reward sources last"),
    ("reward_func_names", "supported", "their names as the metrics use them (an environment's reward: its class name)"),
    ("reward_weights", "supported", "float32 tensor: reward_weights (1 each when unset), 1 for each environment's "
     "reward"),
    ("tools", "supported", "the functions offered as tools: the tools given, then every environment's methods"),
    ("entropy_coef", "supported", "the entropy-bonus coefficient, moved by use_adaptive_entropy; settable"),
    ("aux_loss_enabled", "supported", "TRL's rule: the model config declares output_router_logits and the coefficient "
     "(router_aux_loss_coef, else the config's) is not 0; the loss is then added and logged as aux_loss"),
    ("get_high_entropy_mask(entropies, mask, threshold)", "supported", "TRL's signature: the tokens at or above "
     "the threshold quantile of every rank's valid entropies; training calls it (with 1 - top_entropy_quantile), "
     "so an override selects the trained tokens"),
    ("get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)",
     "supported", "TRL's static method: [B, 1] in mask's dtype, 1 = keep"),
    ("training_step(model, inputs, num_items_in_batch)", "differs", "called once per micro-batch as in TRL (a "
     "wrapper or override sees every one): loss, backward, statistics; returns the detached loss. inputs is a "
     "MicroBatchInputs (the generation batch and the micro-batch's rows; TRL: the raw prompt rows), "
     "num_items_in_batch the step's loss normaliser"),
    ("args", "differs", "always our GRPOConfig (a TRL config is converted)"),
    ("state", "supported", "a transformers.TrainerState: global_step, epoch, num_input_tokens_seen, total_flos, "
     "log_history (TRL's metric names beside ours, every logging_steps; transformers' closing summary entry)"),
    ("control", "supported", "a transformers.TrainerControl; should_training_stop ends the run"),
    ("accelerator", "supported", "the run's accelerate.Accelerator (print, is_main_process, ...)"),
    ("processing_class", "supported", "the tokenizer, or a vision-language model's processor (docs/vlm.md)"),
    ("train_dataset", "supported", ""),
    ("eval_dataset", "supported", ""),
    ("optimizer", "supported", "torch AdamW (prepared by the distributed strategy)"),
    ("lr_scheduler", "supported", "a LambdaLR"),
    ("hub_model_id", "supported", "the repo's full id once the repo exists, else None"),
    ("train(resume_from_checkpoint=...)", "supported", "a path, True or 'latest'; returns transformers' TrainOutput "
     "(the run summary of summary.json is trainer.run_summary)"),
    ("evaluate()", "supported", "docs/evaluation.md"),
    ("save_model(output_dir)", "supported", "the LoRA adapter in PEFT's format (or the full model) plus tokenizer"),
    ("push_to_hub(commit_message, blocking, token, revision, private, dataset_name, tags)", "supported",
     "writes a short model card; blocking uploads"),
    ("end()", "supported", "closes open trackers and the process group (accelerator.end_training)"),
    ("add_callback(callback)", "supported", ""),
    ("reward functions' log_metric / log_extra keywords", "supported", "docs/rewards.md"),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_tables() -> str:
    """The generated part of docs/trl_compatibility.md: counts, the argument tables and the trainer surface."""
    counts = {k: sum(e.kind == k for e in TRL_FIELDS.values()) for k in ("mapped", "ignored", "refused")}
    names = list(TRL_FIELDS)
    split = names.index(FIRST_GRPO_FIELD)
    label = {"mapped": "supported", "ignored": "ignored", "refused": "refused"}

    def table(part: list[str]) -> str:
        rows = ["| TRL argument | status | grpo-ascend setting | differences / why |", "|---|---|---|---|"]
        for name in part:
            e = TRL_FIELDS[name]
            status = "supported, differs" if e.differs else label[e.kind]
            target = ", ".join(f"`{t}`" for t in e.targets) if e.kind == "mapped" and e.targets else "—"
            rows.append(f"| `{name}` | {status} | {target} | {_cell(e.note)} |")
        return "\n".join(rows)

    implied = "; ".join(f"`{k}` = `{v!r}` ({why})" for k, (v, why) in IMPLIED_SETTINGS.items())
    surface = ["| TRL trainer argument / attribute | status | notes |", "|---|---|---|"]
    surface += [f"| `{name}` | {status} | {_cell(note)} |" for name, status, note in TRAINER_SURFACE]
    return "\n\n".join([
        f"{len(TRL_FIELDS)} fields: {counts['mapped']} supported (mapped), {counts['ignored']} ignored, "
        f"{counts['refused']} refused. Set besides them: {implied}.",
        "### Fields from transformers' `TrainingArguments`",
        table(names[:split]),
        "### Fields of TRL's `GRPOConfig`",
        table(names[split:]),
        "### Trainer arguments, attributes and methods",
        "\n".join(surface),
    ])


START = "<!-- trl-compat:start (generated by python -m grpo_ascend.config.trl_compat) -->"
END = "<!-- trl-compat:end -->"
DEFAULT_PATH = Path(__file__).resolve().parents[2] / DOC


def update_doc(path: str | Path = DEFAULT_PATH, check: bool = False) -> bool:
    """Rewrite (or with ``check``, compare) the generated block; True if it was up to date."""
    return update_block(path, START, END, render_tables(), check)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    ok = update_doc(check=check)
    state = "up to date" if ok else ("stale" if check else "regenerated")
    print(f"{DEFAULT_PATH}: TRL compatibility tables {state}")
    return 0 if ok or not check else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
