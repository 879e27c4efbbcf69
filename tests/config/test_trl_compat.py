"""TRL's own GRPOConfig in our trainer: every field classified, mapped, ignored with one warning, or refused."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from grpo_ascend.config.trl_compat import (
    TRAINER_SURFACE,
    TRLConfigWarning,
    from_trl_config,
    is_trl_grpo_config,
    update_doc,
)
from grpo_ascend.config.trl_fields import TRL_FIELDS
from grpo_ascend.errors import ConfigError


def _trl():
    return pytest.importorskip("trl", reason="trl is not installed (pip install trl==1.16.0)")


def _config(tmp_path, **kw):
    """A TRL GRPOConfig that validates on any machine (TRL's bf16 default refuses the CPU)."""
    return _trl().GRPOConfig(output_dir=str(tmp_path / "out"), bf16=False, **kw)


def _convert(cfg):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = from_trl_config(cfg)
    return ours, [w for w in caught if issubclass(w.category, TRLConfigWarning)]


def test_every_trl_field_is_classified():
    """A TRL upgrade that adds (or drops) a field fails here until trl_fields.py classifies it."""
    trl = _trl()
    names = [f.name for f in dataclasses.fields(trl.GRPOConfig)]
    assert [n for n in names if n not in TRL_FIELDS] == [], "classify these in grpo_ascend/config/trl_fields.py"
    assert [n for n in TRL_FIELDS if n not in names] == [], "these are no longer TRL fields"
    assert list(TRL_FIELDS) == names  # the table (and the doc) follow TRL's order
    from grpo_ascend.config.configs import GRPOConfig

    ours = set(GRPOConfig.field_names())
    for name, entry in TRL_FIELDS.items():
        assert entry.note or entry.kind == "mapped", f"{name}: ignored and refused fields say why"
        assert set(entry.targets) <= ours, f"{name} maps onto unknown settings {entry.targets}"


def test_detection_matches_only_trl_configs(tmp_path):
    """(That grpo_ascend never imports trl is checked by tests/project/test_device_names.py's import test.)"""
    from grpo_ascend.config.configs import GRPOConfig

    assert not is_trl_grpo_config(GRPOConfig())
    assert is_trl_grpo_config(_config(tmp_path))

    class Script(_trl().GRPOConfig):  # a script's own subclass is still TRL's config
        pass

    assert is_trl_grpo_config(Script(output_dir=str(tmp_path), bf16=False))


def test_trl_defaults_convert_silently_with_trl_meanings(tmp_path):
    ours, caught = _convert(_config(tmp_path))
    assert caught == []
    assert ours.output_dir == str(tmp_path / "out")
    # TRL's defaults, not ours: a TRL config means TRL's behaviour
    assert (ours.max_completion_length, ours.logging_steps, ours.num_train_epochs) == (512, 10, 3.0)
    assert ours.gradient_checkpointing is True and ours.bf16 is False
    assert ours.max_prompt_length is None  # TRL 1.16 has no prompt limit
    assert ours.train_vision_parts is None  # TRL trains a VLM's vision tower too in full fine-tuning
    # TRL's vllm_importance_sampling_correction=True only acts on vLLM samples: not our correction
    assert ours.importance_sampling_correction is False


def test_mapping_of_changed_fields(tmp_path):
    cfg = _config(
        tmp_path, learning_rate=3e-4, num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        steps_per_generation=4, beta=0.04, epsilon_high=0.28, loss_type="grpo", scale_rewards=False,
        lr_scheduler_type="cosine", warmup_steps=0.1, eval_strategy="steps", eval_steps=5,
        metric_for_best_model="eval_pass@1", save_strategy="no", pad_to_multiple_of=16,
        generation_kwargs={"top_k": 5, "stop_strings": "</answer>"}, top_k=50, use_cpu=True,
        model_init_kwargs={"dtype": torch.bfloat16}, trust_remote_code=True, log_completions=True, logging_steps=3,
        num_completions_to_print=2, report_to="none", push_to_hub=False, hub_model_id="me/run",
    )
    ours, caught = _convert(cfg)
    assert caught == []
    assert (ours.learning_rate, ours.num_generations, ours.per_device_train_batch_size) == (3e-4, 4, 4)
    assert (ours.gradient_accumulation_steps, ours.steps_per_generation, ours.generation_batch_size) == (2, 4, None)
    assert (ours.beta, ours.epsilon_high, ours.loss_type, ours.scale_rewards) == (0.04, 0.28, "grpo", "none")
    assert (ours.lr_scheduler_type, ours.warmup_ratio, ours.warmup_steps) == ("cosine", 0.1, 0)
    assert (ours.eval_strategy, ours.eval_steps) == ("steps", 5)
    assert (ours.metric_for_best_model, ours.greater_is_better) == ("pass@1", True)
    assert ours.save_steps == 0 and ours.length_bucket == 16 and ours.device == "cpu"
    assert ours.top_k == 5 and ours.stop_strings == ["</answer>"]  # generation_kwargs override, as TRL
    assert ours.model_init_kwargs == {"dtype": "bfloat16", "trust_remote_code": True}  # by name: JSON-safe
    assert (ours.log_completions_steps, ours.logging_steps, ours.num_completions_to_print) == (3, 3, 2)
    assert ours.report_to == [] and ours.hub_model_id == "me/run"


def test_constant_schedule_has_no_warmup_and_default_loss_metric_becomes_ours(tmp_path):
    ours, _ = _convert(_config(tmp_path, lr_scheduler_type="constant", warmup_steps=5, load_best_model_at_end=True,
                               eval_strategy="steps", eval_steps=5))
    assert (ours.lr_scheduler_type, ours.warmup_steps, ours.warmup_ratio) == ("constant", 0, 0.0)
    # transformers fills in metric_for_best_model='loss' (lower is better): the GRPO loss on the eval completions
    assert (ours.metric_for_best_model, ours.greater_is_better) == ("loss", False)


def test_one_warning_lists_every_ignored_field_and_nothing_else(tmp_path):
    cfg = _config(tmp_path, torch_compile=True, dataloader_pin_memory=False, run_name="x", vllm_group_port=9000,
                  learning_rate=1e-4, dataloader_num_workers=2)
    ours, caught = _convert(cfg)
    assert len(caught) == 1
    message = str(caught[0].message)
    for name in ("torch_compile=True", "dataloader_pin_memory=False", "run_name='x'", "vllm_group_port=9000"):
        assert name in message
    # transformers derives torch_compile_backend from torch_compile: also not at its default, also listed
    assert "5 setting(s)" in message and "torch_compile_backend='inductor'" in message
    assert "learning_rate" not in message and "bf16" not in message and "dataloader_num_workers" not in message
    assert ours.learning_rate == 1e-4 and ours.dataloader_num_workers == 2  # kept, as TRL keeps it


@pytest.mark.parametrize("changes, expected", [
    ({"vllm_structured_outputs_regex": "[0-9]+"}, "regex-guided structured outputs are not passed to vLLM"),
    ({"loss_type": "gspo"}, "loss_type='gspo' is not supported by grpo-ascend: expected one of grpo, bnpo"),
    ({"optim": "sgd"}, "optim='sgd' is not supported by grpo-ascend: expected 'adamw_torch'"),
    ({"eval_strategy": "epoch"}, "eval_strategy='epoch' is not supported by grpo-ascend: expected 'no' or 'steps'"),
    ({"logging_steps": 0.1}, "logging_steps=0.1 is not supported by grpo-ascend: expected a whole number of steps"),
    ({"generation_kwargs": {"num_beams": 4, "penalty_alpha": 0.6}}, "it has no penalty_alpha"),
])
def test_refusals_say_which_field_and_why(tmp_path, changes, expected):
    with pytest.raises(ConfigError, match="not supported by grpo-ascend") as info:
        from_trl_config(_config(tmp_path, **changes))
    assert expected in str(info.value)


def test_beam_search_generation_kwargs_are_ignored_with_a_warning(tmp_path):
    """TRL passes generation_kwargs to generate(); beam-search keys shape a search GRPO never runs."""
    with pytest.warns(UserWarning, match=r"generation_kwargs \['length_penalty', 'num_beams'\] are ignored"):
        ours = from_trl_config(_config(tmp_path, generation_kwargs={"num_beams": 2, "length_penalty": -1.0,
                                                                    "top_k": 7}))
    assert ours.top_k == 7


def test_trl_algorithm_options_map_onto_ours(tmp_path):
    """Issue 27 point 5: the options TRL 1.16 has beyond the basic losses arrive with their values."""
    changes = {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0,
               "vespo_lambda_neg": 1.5, "multi_objective_aggregation": "normalize_then_sum",
               "off_policy_mask_threshold": 0.5, "top_entropy_quantile": 0.2, "use_adaptive_entropy": True,
               "entropy_coef_min": 0.01, "entropy_coef_max": 0.5, "entropy_coef_delta": 0.01, "entropy_target": 1.5,
               "cast_lm_head_to_fp32": True, "beta": 0.04, "sync_ref_model": True, "ref_model_mixup_alpha": 0.9,
               "ref_model_sync_steps": 64}
    ours, warned = _convert(_config(tmp_path, **changes))
    assert {k: getattr(ours, k) for k in changes} == changes
    assert not warned
    luspo, _ = _convert(_config(tmp_path, loss_type="luspo", importance_sampling_level="sequence"))
    assert (luspo.loss_type, luspo.importance_sampling_level) == ("luspo", "sequence")


def test_all_refusals_come_in_one_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        from_trl_config(_config(tmp_path, vllm_structured_outputs_regex="x", neftune_noise_alpha=5.0,
                                lr_scheduler_type="polynomial", torch_compile=True))
    text = str(info.value)
    assert "3 setting(s)" in text and "vllm_structured_outputs_regex" in text and "neftune_noise_alpha" in text
    assert "lr_scheduler_type='polynomial'" in text and "torch_compile" not in text  # ignored, not refused


def test_trainer_takes_a_trl_config_and_has_the_trl_surface(tmp_path, tiny_model_dir):
    from datasets import Dataset

    from grpo_ascend import GRPOTrainer
    from grpo_ascend.config.configs import GRPOConfig

    cfg = _config(tmp_path, num_generations=4, per_device_train_batch_size=4, max_completion_length=4, max_steps=1,
                  learning_rate=1e-3, save_steps=100, logging_steps=1, disable_tqdm=True, report_to="none",
                  gradient_checkpointing=False)
    data = Dataset.from_list([{"prompt": f"{i} + 1 ="} for i in range(8)])
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[lambda completions, **k: [float(len(c)) for c in
                          completions]], args=cfg, train_dataset=data, quantization_config=None)
    assert isinstance(trainer.args, GRPOConfig) and trainer.args.max_completion_length == 4
    for name, status, _ in TRAINER_SURFACE:
        attr = name.split("(")[0]
        if attr.isidentifier() and attr != "GRPOTrainer" and status != "refused":
            assert hasattr(trainer, attr), f"docs/trl_compatibility.md lists trainer.{attr}"
    trainer.train()
    assert trainer.state.global_step == 1
    # end(): TRL's / transformers' Trainer.end = accelerator.end_training (trackers, process group); ours
    # also finishes any of our trackers still open (train() closes its own at the end)
    closed, ended = [], []
    trainer.tracker.trackers.append(type("Open", (), {"close": lambda self: closed.append(True)})())
    end_training = trainer.accelerator.end_training
    trainer.accelerator.end_training = lambda: (ended.append(True), end_training())
    trainer.end()
    assert closed == [True] and ended == [True] and trainer.tracker.trackers == []
    with pytest.raises(ConfigError, match="quantized base models"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[len], args=cfg, train_dataset=data,
                    quantization_config={"load_in_4bit": True})


def test_compatibility_doc_is_fresh():
    assert update_doc(check=True), "run: python -m grpo_ascend.config.trl_compat"


def test_model_init_kwargs_reach_from_pretrained(tiny_model_dir):
    from grpo_ascend.models.policy import load_causal_lm, load_tokenizer

    model = load_causal_lm(str(tiny_model_dir), init_kwargs={"dtype": "bfloat16", "attn_implementation": "eager"})
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert next(load_causal_lm(str(tiny_model_dir), init_kwargs={"revision": None}).parameters()).dtype == torch.float32
    assert load_tokenizer(str(tiny_model_dir), init_kwargs={"trust_remote_code": False}).padding_side == "left"
    with pytest.raises(ConfigError, match="model dtype 'float8'"):
        load_causal_lm(str(tiny_model_dir), init_kwargs={"dtype": "float8"})


@pytest.mark.parametrize("disable", [False, True])
def test_disable_dropout_zeroes_every_dropout_lora_included(tiny_model_dir, disable):
    from peft import LoraConfig

    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.trainers.components import build_policy

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    policy, _ = build_policy(str(tiny_model_dir), None, lora, GRPOConfig(disable_dropout=disable), torch.device("cpu"))
    rates = {m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == ({0.0} if disable else {0.3})


def test_chat_template_kwargs_reach_the_prompts(tiny_model):
    """TRL's chat_template_kwargs (e.g. enable_thinking) render chat prompts; the config carries them to the engine."""
    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.rollout.engine import RolloutEngine
    from grpo_ascend.trainers.components import build_rollout_backend

    model, tokenizer = tiny_model
    tokenizer.chat_template = "{% if greeting is defined %}{{ greeting }}|{% endif %}" + tokenizer.chat_template
    chat = [[{"role": "user", "content": "2 + 2?"}]]
    engine = build_rollout_backend(model, tokenizer, GRPOConfig(chat_template_kwargs={"greeting": "HELLO"}), torch.device("cpu"))
    assert engine.prompts.encode(chat, engine.params).texts[0].startswith("HELLO|<|im_start|>user")
    plain = RolloutEngine(model, tokenizer)
    assert not plain.prompts.encode(chat, plain.params).texts[0].startswith("HELLO")
