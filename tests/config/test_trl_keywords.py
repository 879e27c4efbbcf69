"""TRL 1.16's GRPOConfig fields given to our own GRPOConfig as keywords: classified as for a trl.GRPOConfig object."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from grpo_ascend.config.configs import GRPOConfig
from grpo_ascend.config.trl_compat import TRLConfigWarning, from_trl_config
from grpo_ascend.config.trl_defaults import TRL_DEFAULTS
from grpo_ascend.config.trl_fields import TRL_FIELDS
from grpo_ascend.errors import ConfigError

OURS = set(GRPOConfig.field_names())
TRL_ONLY = [name for name in TRL_FIELDS if name not in OURS]


def _build(**kwargs):
    """(our config, the TRLConfigWarnings it drew)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = GRPOConfig(**kwargs)
    return cfg, [w for w in caught if issubclass(w.category, TRLConfigWarning)]


def _trl():
    return pytest.importorskip("trl", reason="trl is not installed (pip install trl==1.16.0)")


def test_recorded_defaults_are_trl_1_16s():
    """trl_defaults.py is what "left at TRL's default" means without trl; it must be the installed TRL's."""
    trl = _trl()
    declared = {}
    for f in dataclasses.fields(trl.GRPOConfig):
        declared[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    assert TRL_DEFAULTS == declared
    assert list(TRL_DEFAULTS) == list(TRL_FIELDS)


def test_fields_from_trls_tests_are_accepted_at_their_defaults_silently():
    """The fields the issue saw refused (`GRPOConfig(use_liger_kernel=False)` was a TypeError)."""
    at_defaults = dict(use_liger_kernel=False, dataloader_num_workers=0, trust_remote_code=False,
                       accelerator_config=None, pad_to_multiple_of=None, generation_kwargs=None, log_completions=False)
    cfg, caught = _build(**at_defaults)
    assert caught == []
    assert cfg == GRPOConfig()


def test_supported_trl_fields_are_mapped_as_for_a_trl_config():
    cfg, caught = _build(trust_remote_code=True, model_init_kwargs={"revision": "main"}, pad_to_multiple_of=16,
                         top_k=50, generation_kwargs={"top_k": 5, "stop_strings": "</answer>"}, log_completions=True,
                         logging_steps=3, activation_checkpointing=True, use_cpu=True, save_strategy="no",
                         save_steps=20, optim="adamw_torch")
    assert caught == []
    assert cfg.model_init_kwargs == {"revision": "main", "trust_remote_code": True}
    assert cfg.length_bucket == 16
    assert (cfg.top_k, cfg.stop_strings) == (5, ["</answer>"])  # generation_kwargs override the fields, as in TRL
    assert (cfg.log_completions_steps, cfg.logging_steps) == (3, 3)
    assert cfg.gradient_checkpointing is True and cfg.device == "cpu" and cfg.save_steps == 0


def test_one_warning_lists_exactly_the_ignored_fields_changed_from_trls_defaults():
    cfg, caught = _build(use_liger_kernel=True, dataloader_pin_memory=False, dataloader_drop_last=True,
                         run_name="x", tf32=None, learning_rate=1e-4, dataloader_num_workers=2)
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller's line
    message = str(caught[0].message)
    assert message.startswith("GRPOConfig: 4 setting(s) have no effect here and are ignored: use_liger_kernel=True, "
                              "dataloader_pin_memory=False, dataloader_drop_last=True, run_name='x'")
    assert "tf32" not in message and cfg.learning_rate == 1e-4
    assert cfg.dataloader_num_workers == 2  # our own field now (kept as TRL keeps it), not an ignored one


def test_refused_fields_fail_only_when_changed_and_say_why():
    cfg, caught = _build(use_vllm=False, neftune_noise_alpha=None, optim_args=None, lr_scheduler_kwargs={})
    assert caught == [] and cfg == GRPOConfig()
    with pytest.raises(ConfigError) as err:
        GRPOConfig(vllm_structured_outputs_regex="[0-9]+", neftune_noise_alpha=5.0, generation_kwargs={"max_tokens": 3},
                   optim="sgd")
    text = str(err.value)
    assert text.startswith("GRPOConfig: 4 setting(s) are not supported by grpo-ascend")
    assert "vllm_structured_outputs_regex='[0-9]+': regex-guided" in text
    assert "neftune_noise_alpha=5.0: NEFTune adds noise" in text
    assert "generation_kwargs={'max_tokens': 3} is not supported by grpo-ascend: expected only the keys" in text
    assert "optim='sgd'" in text


def test_every_trl_only_field_is_classified_by_the_shared_table():
    """Each TRL field we have no field for, set to a value unlike TRL's default: ignored ones are listed in the
    warning, refused ones in the error, supported ones converted or refused by their converter."""
    changed = "changed-value"
    for name in TRL_ONLY:
        kind = TRL_FIELDS[name].kind
        if kind == "mapped":
            continue  # converters check their values; covered above and in test_trl_compat.py
        assert TRL_DEFAULTS[name] != changed
        if kind == "ignored":
            _, caught = _build(**{name: changed})
            assert len(caught) == 1 and f"{name}='changed-value'" in str(caught[0].message), name
        else:
            with pytest.raises(ConfigError, match=f"{name}='changed-value': {TRL_FIELDS[name].note[:20]}"):
                GRPOConfig(**{name: changed})


def test_unknown_keyword_is_still_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_liger_kernl' .*'use_liger_kernel'"):
        GRPOConfig(use_liger_kernl=True)


def test_all_trl_fields_at_trls_defaults_match_a_trl_config(tmp_path):
    """The sweep: every TRL 1.16 field at TRL's declared default is accepted silently, and gives the settings a
    trl.GRPOConfig with the same defaults converts to, except the documented differences: our own defaults for
    fields TRL has no value for, the TRL-resolved steps_per_generation, and TRL's vllm_importance_sampling_* names,
    which our config takes as aliases of its own correction (docs/trl_compatibility.md)."""
    trl = _trl()
    ours, caught = _build(**{**TRL_DEFAULTS, "output_dir": str(tmp_path), "bf16": False})
    assert caught == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers: gradient_checkpointing is deprecated
        converted = from_trl_config(trl.GRPOConfig(output_dir=str(tmp_path), bf16=False))
    differ = {k for k, v in ours.to_dict().items() if converted.to_dict()[k] != v}
    differ.discard("disable_tqdm")  # TRL resolves its None from the logging level, ours to False (bar shown)
    assert differ == {"max_prompt_length", "steps_per_generation",  # train_vision_parts: null, TRL's, both
                      "importance_sampling_correction"}
    assert (ours.steps_per_generation, converted.steps_per_generation) == (None, 1)  # the same plan
    assert ours.batch_plan() == converted.batch_plan()
    # TRL's unset values of fields typed more narrowly here read as a trl.GRPOConfig reads them
    assert (ours.num_completions_to_print, ours.disable_tqdm) == (4, False)
    assert GRPOConfig(output_dir=None).output_dir == "trainer_output"
