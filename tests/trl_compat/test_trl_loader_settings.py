"""transformers' dataloader_num_workers and accelerator_config with TRL 1.16's rules for streamed datasets
(issue 37, group 2): one reader for a streamed train set, map-style training keeps its workers,
dispatch_batches false with any stream (TRL's error when true)."""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset, IterableDataset
from helpers import SMALL_RUN, first_digit_is_one

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.config.loader_settings import DISPATCH_BATCHES_ERROR, AcceleratorConfig
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import default_lora_config

PROMPTS = [{"prompt": f"{i} + 1 ="} for i in range(8)]


def _stream():
    return IterableDataset.from_generator(lambda: iter(PROMPTS))


def _trainer(tmp_path, tiny_model_dir, train, eval_dataset=None, **kw):
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": 1, **kw})
    return GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, train, eval_dataset=eval_dataset,
                       peft_config=default_lora_config(r=4))


def test_fields_are_transformers_with_its_defaults(tmp_path):
    cfg = GRPOConfig()
    assert cfg.dataloader_num_workers == 0 and cfg.accelerator_config == AcceleratorConfig()
    assert cfg.accelerator_config.dispatch_batches is None and cfg.accelerator_config.even_batches is True
    given = GRPOConfig(accelerator_config={"dispatch_batches": False, "even_batches": False}, dataloader_num_workers=3)
    assert (given.accelerator_config.dispatch_batches, given.accelerator_config.even_batches) == (False, False)
    assert GRPOConfig.from_dict(given.to_dict()) == given  # JSON-safe round trip (checkpoints, recipes)
    path = tmp_path / "accelerator.json"
    path.write_text('{"dispatch_batches": true}')
    assert GRPOConfig(accelerator_config=str(path)).accelerator_config.dispatch_batches is True
    with pytest.raises(ConfigError, match=r"unknown option 'dispatch_batch'.*dispatch_batches"):
        GRPOConfig(accelerator_config={"dispatch_batch": False})
    with pytest.raises(ConfigError, match="dataloader_num_workers must be >= 0, got -1"):
        GRPOConfig(dataloader_num_workers=-1)


def test_trl_config_values_arrive(tmp_path):
    trl = pytest.importorskip("trl", reason="trl is not installed")
    from grpo_ascend.config.trl_compat import from_trl_config

    ours = from_trl_config(trl.GRPOConfig(output_dir=str(tmp_path), bf16=False, dataloader_num_workers=2,
                                          accelerator_config={"dispatch_batches": False, "split_batches": True}))
    assert ours.dataloader_num_workers == 2
    assert (ours.accelerator_config.dispatch_batches, ours.accelerator_config.split_batches) == (False, True)


def test_streamed_train_set_reads_with_one_worker(tmp_path, tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_ascend.config.loader_settings"):
        trainer = _trainer(tmp_path, tiny_model_dir, _stream(), dataloader_num_workers=4)
    assert trainer.args.dataloader_num_workers == 0
    assert trainer.args.accelerator_config.dispatch_batches is False
    assert ("Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
            "provided value (4).") in caplog.text


def test_map_style_training_keeps_its_workers_beside_a_streamed_eval_set(tmp_path, tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_ascend.config.loader_settings"):
        trainer = _trainer(tmp_path, tiny_model_dir, Dataset.from_list(PROMPTS), eval_dataset={"s": _stream()},
                           dataloader_num_workers=4)
    assert trainer.args.dataloader_num_workers == 4 and "dataloader_num_workers=0" not in caplog.text
    assert trainer.args.accelerator_config.dispatch_batches is False  # any stream: dispatching is off
    plain = _trainer(tmp_path, tiny_model_dir, Dataset.from_list(PROMPTS), dataloader_num_workers=2)
    assert plain.args.accelerator_config.dispatch_batches is None  # no stream: left as given


def test_dispatch_batches_true_is_refused_with_a_stream(tmp_path, tiny_model_dir):
    assert DISPATCH_BATCHES_ERROR.startswith("Iterable datasets require `dispatch_batches=False`")
    with pytest.raises(ConfigError, match="Iterable datasets require `dispatch_batches=False`, but it is set to "
                                          "`True` in `accelerator_config`. Please set it to `False`."):
        _trainer(tmp_path, tiny_model_dir, _stream(), accelerator_config={"dispatch_batches": True})
    with pytest.raises(ConfigError, match="Iterable datasets require `dispatch_batches=False`"):
        _trainer(tmp_path, tiny_model_dir, Dataset.from_list(PROMPTS), eval_dataset=_stream(),
                 accelerator_config={"dispatch_batches": True})
    trainer = _trainer(tmp_path, tiny_model_dir, Dataset.from_list(PROMPTS), accelerator_config={"dispatch_batches": True})
    with pytest.raises(ConfigError, match="Iterable datasets require `dispatch_batches=False`"):
        trainer.evaluate(_stream())  # a stream given to evaluate() only is checked when it arrives
