"""FSDP2 behind accelerate: 2 processes on the CPU (gloo), and the refusals around it.

The multi-process tests start tests/support/dist_worker.py once per rank with the environment
``accelerate launch --config_file recipes/accelerate/fsdp2_1node_8cards.yaml`` sets
(ACCELERATE_USE_FSDP, FSDP_VERSION=2, FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP). accelerate
1.15 enables its FSDP plugin only for accelerator processes; grpo_ascend.distributed.compat_accelerate switches the
CPU processes' accelerate state to FSDP, so the same fully_shard wrapping runs here.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import dist_worker
import pytest
import torch
from distributed_runs import (
    FSDP_ENV,
    SAMPLED,
    WORLD,
    assert_resumed_run_matches,
    launch,
    launch_once_per_session,
    rank_reports,
    rank_weights,
    stable_metrics,
)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_model_dir):
    """An uninterrupted 2-process FSDP2 run of 4 optimizer steps (checkpoints at 2 and 4)."""
    out = tmp_path_factory.mktemp("fsdp")
    launch("train", out, {"model_dir": str(tiny_model_dir),
                          "config": {"output_dir": str(out / "run"), "export_adapter_at_end": True}},
           extra_env=FSDP_ENV)
    return out


def test_fsdp_shards_per_decoder_layer_and_ranks_agree(fsdp_run):
    reports = rank_reports(fsdp_run)
    assert [r["status"] for r in reports] == ["finished"] * WORLD
    assert [r["step"] for r in reports] == [4] * WORLD
    assert {r["distributed_type"] for r in reports} == {"FSDP"}
    assert {r["backend"] for r in reports} == {"gloo"}
    # Each decoder layer is its own unit, plus the root (embeddings, final norm, head).
    assert {r["sharded"]["units"] for r in reports} == {4 + 1}  # the tiny model has 4 layers
    assert all(r["sharded"]["dtensor"] for r in reports)
    w0, w1 = rank_weights(fsdp_run, 0), rank_weights(fsdp_run, 1)
    assert w0.keys() == w1.keys() and len(w0) > 0
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    assert any(v.abs().max() > 0 for k, v in w0.items() if "lora_B" in k)  # training moved them


@pytest.mark.slow
def test_fsdp_training_matches_plain_data_parallel(fsdp_run, tmp_path_factory, tiny_model_dir):
    """Same seed, same config: FSDP2 ends with the weights (and per-step metrics) of the DDP path
    (the uninterrupted run of test_distributed.py, launched once for both files)."""
    ddp = launch_once_per_session(tmp_path_factory, "ddp-default", "train", {"model_dir": str(tiny_model_dir)})
    expected = rank_weights(ddp, 0)
    for rank in range(WORLD):
        got = rank_weights(fsdp_run, rank)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=f"rank {rank}, {name}")
    sharded = stable_metrics(fsdp_run / "run" / "metrics.jsonl")
    plain = stable_metrics(ddp / "run" / "metrics.jsonl")
    assert [r["step"] for r in sharded] == [1, 2, 3, 4]
    assert any(r["grad_norm"] > 1.0 for r in plain)  # max_grad_norm=1 clipped some step
    for a, b in zip(plain, sharded):
        assert {k: a[k] for k in SAMPLED} == {k: b[k] for k in SAMPLED}, a["step"]
        for key in ("loss", "grad_norm", "kl", "entropy", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
        assert b["skipped_steps"] == 0


def test_fsdp_only_rank_zero_writes_whole_weights(fsdp_run, tiny_model_dir, tmp_path):
    """Rank 0 alone writes; the checkpoint holds whole tensors in the usual format and resumes without FSDP."""
    reports = rank_reports(fsdp_run)
    assert reports[1]["writes"] == []
    run = fsdp_run / "run"
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(run.glob(".tmp-*"))
    final = run / "checkpoint-4"
    assert not (final / "optimizer_shards").exists()
    from safetensors.torch import load_file

    adapter = load_file(str(final / "adapter_model.safetensors"))
    trained = rank_weights(fsdp_run, 0)
    assert len(adapter) == len(trained)
    exported = load_file(str(run / "adapter" / "adapter_model.safetensors"))  # export_adapter_at_end
    assert exported.keys() == adapter.keys() and all(torch.equal(exported[k], adapter[k]) for k in adapter)
    # A single process (no FSDP) resumes it: same weights, whole Adam state of the right shapes.
    cfg = dist_worker.grads_config(str(tmp_path / "one"), 1)
    single = dist_worker.make_trainer(str(tiny_model_dir), cfg, dataset_size=12)
    single.load_checkpoint(final)
    assert single.step == 4
    params = {k: v for k, v in single.policy.named_parameters() if v.requires_grad}
    assert params.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(params[name].detach(), value), name
    state = single.optimizer.optimizer.state
    for p in params.values():
        assert state[p]["exp_avg"].shape == p.shape and state[p]["exp_avg_sq"].abs().sum() > 0


@pytest.mark.slow
def test_fsdp_resume_is_exact(fsdp_run, tmp_path, tiny_model_dir):
    out = tmp_path / "resumed"
    spec = {"model_dir": str(tiny_model_dir), "config": {"output_dir": str(out / "run")}}
    launch("train", out, {**spec, "stop_after_step": 2}, extra_env=FSDP_ENV)
    assert [r["status"] for r in rank_reports(out)] == ["preempted"] * WORLD
    launch("train", out, {**spec, "resume": "latest"}, extra_env=FSDP_ENV)
    reports = rank_reports(out)
    assert [r["status"] for r in reports] == ["finished"] * WORLD
    assert reports[1]["writes"] == []
    assert_resumed_run_matches(fsdp_run, out, [1, 2, 3, 4], rel=1e-5, abs_=1e-8, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# refusals (no processes started)
# ---------------------------------------------------------------------------------------------


def _fake_fsdp_accelerator(monkeypatch, **plugin: Any) -> None:
    """Replace accelerate.Accelerator by one that reports FSDP with the given plugin settings."""
    import accelerate
    from accelerate.utils import DistributedType

    settings = {"fsdp_version": 2, "activation_checkpointing": False, "cpu_offload": None,
                "cpu_ram_efficient_loading": False, **plugin}

    class FakeAccelerator:
        def __init__(self, **kwargs: Any):
            self.device = torch.device("cpu")
            self.distributed_type = DistributedType.FSDP
            self.state = SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=SimpleNamespace(**settings))

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)


@pytest.mark.parametrize(("plugin", "match"), [
    ({"fsdp_version": 1}, "fsdp_version=1 is not supported; set fsdp_version: 2"),
    ({"activation_checkpointing": True}, "fsdp_activation_checkpointing is not supported.*gradient_checkpointing"),
    ({"cpu_offload": "offload"}, "fsdp_offload_params is not supported"),
])
def test_unsupported_fsdp_settings_are_refused(monkeypatch, tmp_path, tiny_model_dir, plugin, match):
    from grpo_ascend.errors import ConfigError

    if plugin.get("cpu_offload") == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = {"cpu_offload": CPUOffloadPolicy()}
    _fake_fsdp_accelerator(monkeypatch, **plugin)
    with pytest.raises(ConfigError, match=match):
        dist_worker.make_trainer(str(tiny_model_dir), dist_worker.grads_config(str(tmp_path / "run"), 1))


def test_ppo_under_fsdp_is_refused(monkeypatch, tmp_path, tiny_model_dir):
    from grpo_ascend import PPOConfig, PPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.errors import ConfigError
    from grpo_ascend.models.policy import default_lora_config

    _fake_fsdp_accelerator(monkeypatch)
    cfg = PPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, disable_tqdm=True)
    with pytest.raises(ConfigError, match="PPOTrainer does not support FSDP: it trains two"):
        PPOTrainer(str(tiny_model_dir), dist_worker.even_token_fraction, cfg, arithmetic_dataset(8, seed=3),
                   peft_config=default_lora_config(r=4))


def test_fsdp_on_the_cpu_is_switched_on_only_when_requested(monkeypatch):
    from accelerate.utils import DistributedType

    from grpo_ascend.distributed.compat_accelerate import switch_cpu_processes_to_fsdp as enable_on_cpu

    accelerator = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.MULTI_CPU,
                                                        mixed_precision="no"))
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not enable_on_cpu(accelerator)
    assert accelerator.state.distributed_type == DistributedType.MULTI_CPU
    for name, value in FSDP_ENV.items():
        monkeypatch.setenv(name, value)
    assert enable_on_cpu(accelerator)
    assert accelerator.state.distributed_type == DistributedType.FSDP
    assert accelerator.state.fsdp_plugin.fsdp_version == 2
    from accelerate.state import PartialState

    assert PartialState().distributed_type != DistributedType.FSDP  # this process's own state is left alone


@pytest.mark.slow
def test_fsdp_full_finetuning_matches_plain_data_parallel(tmp_path, tiny_model_dir):
    """Without LoRA every weight is trained and sharded; 2 steps (with a KL reference, the model's
    gradient checkpointing and bf16 autocast) end where DDP ends."""
    spec = {"model_dir": str(tiny_model_dir), "lora": False,
            "config": {"max_steps": 2, "save_steps": 2, "learning_rate": 1e-4, "gradient_checkpointing": True,
                       "bf16": True}}
    launch("train", tmp_path / "fsdp", {**spec, "config": {**spec["config"], "output_dir": str(tmp_path / "fsdp/run")}},
           extra_env=FSDP_ENV)
    launch("train", tmp_path / "ddp", {**spec, "config": {**spec["config"], "output_dir": str(tmp_path / "ddp/run")}})
    assert {r["distributed_type"] for r in rank_reports(tmp_path / "fsdp")} == {"FSDP"}
    expected = rank_weights(tmp_path / "ddp", 0)
    assert len(expected) > 10  # every weight, not an adapter
    for rank in range(WORLD):
        got = rank_weights(tmp_path / "fsdp", rank)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=f"rank {rank}, {name}")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "fsdp" / "run" / "checkpoint-2" / "model.safetensors"))
    assert saved.keys() == expected.keys()
    for name in expected:
        assert torch.equal(saved[name], rank_weights(tmp_path / "fsdp", 0)[name]), name
