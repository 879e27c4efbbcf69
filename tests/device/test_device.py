"""Device layer: the CPU path for real; the NPU and CUDA branches through recording fakes."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import fake_device
import numpy as np
import pytest
import torch

from grpo_ascend import device as dev
from grpo_ascend.device import doctor_facts
from grpo_ascend.errors import ConfigError, DeviceError

NPU_ENV = (*dev.NPU_RUNTIME_DEFAULTS, "HCCL_EXEC_TIMEOUT", "HCCL_OP_EXPANSION_MODE")


def _track_env(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Unset ``names`` for the test and restore their original state afterwards, even if code sets them."""
    for name in names:
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


# --------------------------------------------------------------------------------------------
# fakes (tests/support/fake_device.py)
# --------------------------------------------------------------------------------------------


@pytest.fixture()
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> fake_device.FakeRuntime:
    """A fake torch_npu with two NPUs (its torch.npu runtime is returned); torch.device learns 'npu'."""
    fake_device.install(monkeypatch, count=2)
    _track_env(monkeypatch, "LOCAL_RANK", *NPU_ENV)
    return torch.npu


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> fake_device.FakeRuntime:
    """Make torch.cuda look available with two devices; record the calls made on it."""
    runtime = fake_device.fake_cuda(monkeypatch, count=2)
    _track_env(monkeypatch, "LOCAL_RANK")
    return runtime


@pytest.fixture()
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device.cpu_only(monkeypatch)
    _track_env(monkeypatch, "LOCAL_RANK")


def test_package_reexports_its_modules_names_on_first_use():
    from grpo_ascend.device import core, memory, npu_patches

    assert dev.resolve_device is core.resolve_device and dev.memory_stats is memory.memory_stats
    assert dev.apply_npu_patches is npu_patches.apply_npu_patches
    assert all(getattr(dev, name) is not None for name in dev.__all__) and set(dev.__all__) <= set(dir(dev))
    with pytest.raises(AttributeError, match="'grpo_ascend.device' has no attribute 'resolve'"):
        dev.resolve  # noqa: B018


# --------------------------------------------------------------------------------------------
# CPU, for real
# --------------------------------------------------------------------------------------------


def test_cpu_resolution(cpu_only):
    assert dev.detect_device_type() == "cpu"
    assert dev.resolve_device() == torch.device("cpu")
    assert dev.resolve_device("CPU") == torch.device("cpu")
    assert dev.device_type("cpu") == "cpu"
    assert dev.device_type(torch.device("cpu")) == "cpu"
    assert dev.dist_backend("cpu") == "gloo"
    assert dev.default_length_bucket("cpu") == 1  # padding only costs compute off NPU
    assert dev.device_count() == 1
    assert dev.bf16_supported("cpu")
    dev.synchronize("cpu")
    dev.empty_cache("cpu")


def test_unknown_device_names_the_value_and_suggests(cpu_only):
    with pytest.raises(DeviceError, match=r"unknown device 'nup'.*did you mean 'npu'"):
        dev.resolve_device("nup")
    with pytest.raises(DeviceError, match="index after ':'"):
        dev.resolve_device("cpu:x")


def test_cuda_requested_on_cpu_only_machine(cpu_only):
    with pytest.raises(DeviceError) as info:
        dev.resolve_device("cuda")
    message = str(info.value)
    assert "'cuda'" in message and "CUDA is not available" in message and "--device" in message
    with pytest.raises(DeviceError, match="'cuda:1'"):
        dev.resolve_device("cuda:1")


def test_autocast_bf16_on_cpu_changes_matmul_dtype():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with dev.autocast("cpu", "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with dev.autocast(torch.device("cpu"), "fp32"):
        assert (a @ b).dtype == torch.float32
    with dev.autocast("cpu", None):
        assert (a @ b).dtype == torch.float32
    assert (a @ b).dtype == torch.float32


def test_autocast_rejects_fp16_on_cpu_and_unknown_dtypes():
    with pytest.raises(ConfigError, match="fp16 mixed precision is not supported on device 'cpu'"):
        dev.autocast("cpu", "fp16")
    with pytest.raises(ConfigError, match=r"'bf61'.*did you mean 'bf16'"):
        dev.autocast("cpu", "bf61")
    assert not hasattr(dev, "grad_scaler")  # fp16 loss scaling is accelerate's (torch.npu.amp.GradScaler on NPU)


def test_mixed_precision_for_accelerate():
    assert dev.mixed_precision_for_accelerate(True, False) == "bf16"
    assert dev.mixed_precision_for_accelerate(False, True) == "fp16"
    assert dev.mixed_precision_for_accelerate(False, False) == "no"
    with pytest.raises(ConfigError, match="both true"):
        dev.mixed_precision_for_accelerate(True, True)


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_is_reproducible():
    dev.seed_everything(1234)
    first = _draws()
    dev.seed_everything(1234)
    assert _draws() == first
    dev.seed_everything(4321)
    assert _draws() != first


def test_rng_state_round_trip_gives_identical_draws(tmp_path):
    dev.seed_everything(7)
    _draws()
    state = dev.rng_state("cpu")
    assert set(state) == {"python", "numpy", "torch"}
    expected = _draws()
    # the state survives a weights_only checkpoint round trip
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)
    _draws()
    dev.set_rng_state(loaded, "cpu")
    assert _draws() == expected
    with pytest.raises(ConfigError, match="missing"):
        dev.set_rng_state({"python": state["python"]})


def test_cpu_memory_stats_are_positive():
    stats = dev.memory_stats("cpu")
    assert set(stats) == {"allocated", "reserved", "peak"}
    assert all(isinstance(v, int) and v > 0 for v in stats.values())
    assert stats["peak"] >= stats["allocated"]
    dev.reset_peak_memory("cpu")
    assert dev.memory_stats("cpu")["peak"] > 0
    free, total = dev.free_memory("cpu")
    assert 0 < free <= total


def test_npu_runtime_defaults_only_fill_unset_values():
    env = {"HCCL_CONNECT_TIMEOUT": "600"}
    applied = dev.apply_npu_runtime_defaults(env)
    assert "HCCL_CONNECT_TIMEOUT" not in applied
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"
    assert applied == {k: v for k, v in dev.NPU_RUNTIME_DEFAULTS.items() if k != "HCCL_CONNECT_TIMEOUT"}
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert dev.apply_npu_runtime_defaults(env) == {}


# --------------------------------------------------------------------------------------------
# NPU through a fake torch_npu
# --------------------------------------------------------------------------------------------


def test_detection_prefers_npu_over_cuda(fake_npu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dev.detect_device_type() == "npu"
    assert dev.device_count() == 2


def test_resolve_npu_sets_device_and_env_defaults(fake_npu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "7000")
    device = dev.resolve_device()
    assert str(device) == "npu:1"
    assert ("set_device", 1) in fake_npu.calls
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "7000"  # user value kept
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == dev.NPU_RUNTIME_DEFAULTS["HCCL_CONNECT_TIMEOUT"]
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert str(dev.resolve_device("npu:0", local_rank=1)) == "npu:0"  # explicit index wins
    assert ("set_device", 0) in fake_npu.calls
    with pytest.raises(DeviceError, match=r"index 5 .* 2 npu device"):
        dev.resolve_device("npu:5")


def test_npu_calls_reach_torch_npu(fake_npu):
    device = dev.resolve_device("npu")
    assert dev.device_type(device) == "npu"
    assert dev.dist_backend(device) == "hccl"
    assert dev.default_length_bucket(device) == 64  # few shapes for graph compilation
    assert dev.bf16_supported(device)
    fake_npu.calls.clear()
    dev.synchronize(device)
    dev.empty_cache(device)
    assert dev.memory_stats(device) == {"allocated": 100, "reserved": 200, "peak": 150}
    dev.reset_peak_memory(device)
    assert dev.free_memory(device) == (2**30, 2**32)
    assert fake_npu.calls == [
        ("synchronize", 0),
        ("empty_cache",),
        ("memory_allocated", 0),
        ("memory_reserved", 0),
        ("max_memory_allocated", 0),
        ("reset_peak_memory_stats", 0),
        ("mem_get_info", 0),
    ]


def test_npu_seed_and_rng_state(fake_npu):
    device = dev.resolve_device("npu:1")
    dev.seed_everything(3)
    assert ("manual_seed_all", 3) in fake_npu.calls
    state = dev.rng_state(device)
    assert state["device_type"] == "npu" and state["device"].tolist() == [1]
    fake_npu.rng[1] = torch.tensor([9], dtype=torch.uint8)
    dev.set_rng_state(state, device)
    assert fake_npu.rng[1].tolist() == [1]
    assert ("set_rng_state", 1) in fake_npu.calls


def test_npu_facts_report_versions_and_chip(fake_npu):
    assert doctor_facts.software_versions()["torch_npu"] == "2.12.0"
    assert doctor_facts.software_versions()["CANN"] == "9.1.0"  # torch.version.cann is "not known": the runtime is asked
    facts = doctor_facts.device_facts()
    assert facts["device_type"] == "npu" and facts["dist_backend"] == "hccl"
    assert facts["free_memory"] == 2**30 and facts["total_memory"] == 2**32
    assert facts["device_name"] == "Ascend910B2" and facts["chip_family"] == "Atlas A2 series"
    assert doctor_facts.accelerator_warnings() == []


@pytest.mark.parametrize(("soc", "family"), [
    ("Ascend910A", "training"), ("Ascend910ProB", "training"), ("Ascend910B", "training"),
    ("Ascend910B1", "A2"), ("Ascend910B4-1", "A2"), ("Ascend910_9391", "A3"), ("Ascend910_9362", "A3"),
    ("Ascend310P3", "inference"), ("Ascend310B4", "200I/500 A2"), ("Ascend950PR", None), ("", None),
])
def test_chip_family_of_torch_npu_soc_names(soc, family):
    # names from torch_npu's NpuVariables.cpp; 'Ascend910B' (no digit) is the older training-series part
    assert dev.chip_family(soc) == family


def test_soc_name_asks_torch_npu_for_the_device(fake_npu):
    fake_npu.soc = "Ascend910_9391"
    assert dev.soc_name("npu:0") == "Ascend910_9391"
    assert dev.soc_name("cpu") is None


def test_npu_present_but_no_device(fake_npu):
    fake_npu.count = 0
    assert dev.detect_device_type() in ("cuda", "cpu")
    with pytest.raises(DeviceError, match="reports no NPU.*npu-smi"):
        dev.resolve_device("npu")


def test_missing_torch_npu_message(monkeypatch):
    fake_device.without_torch_npu(monkeypatch)
    with pytest.raises(DeviceError) as info:
        dev.resolve_device("npu")
    message = str(info.value)
    assert "torch_npu is not installed" in message
    assert "pip install" in message and "torch-npu==" in message and "grpo-ascend[npu]" in message
    assert "\n" not in message


def test_torch_npu_import_failure_names_cann(monkeypatch, caplog):
    fake_device.broken_torch_npu(monkeypatch)
    with pytest.raises(DeviceError) as info:
        dev.resolve_device("npu:0")
    message = str(info.value)
    assert "importing it failed" in message and "libascendcl.so" in message
    assert "set_env.sh" in message and "TORCH_DEVICE_BACKEND_AUTOLOAD" in message
    # auto-detection falls back instead of failing, and says why once
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("WARNING", logger="grpo_ascend.device.backends"):
        assert dev.detect_device_type() == "cpu"
        assert dev.detect_device_type() == "cpu"
    assert sum("libascendcl.so" in r.getMessage() for r in caplog.records) == 1
    assert "import failed: OSError: libascendcl.so" in doctor_facts.software_versions()["torch_npu"]
    assert "set_env.sh" in doctor_facts.accelerator_warnings()[0]


# --------------------------------------------------------------------------------------------
# CUDA through monkeypatched torch.cuda
# --------------------------------------------------------------------------------------------


def test_cuda_branch(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dev.detect_device_type() == "cuda"
    device = dev.resolve_device()
    assert device == torch.device("cuda:1")
    assert ("set_device", 1) in fake_cuda.calls
    assert dev.dist_backend(device) == "nccl"
    assert dev.memory_stats(device) == {"allocated": 100, "reserved": 200, "peak": 150}
    dev.synchronize(device)
    dev.empty_cache(device)
    assert ("synchronize", 1) in fake_cuda.calls and ("empty_cache",) in fake_cuda.calls
    fake_cuda.bf16 = False
    with pytest.raises(ConfigError, match="bf16 is not supported on device 'cuda:1'"):
        dev.autocast(device, "bf16")
    with pytest.raises(DeviceError, match="out of range"):
        dev.resolve_device("cuda:2")
    fake_cuda.count = 1  # one device bound per rank by the launcher
    assert dev.resolve_device() == torch.device("cuda:0")
    fake_cuda.count = 2
    monkeypatch.setenv("LOCAL_RANK", "abc")
    with pytest.raises(DeviceError, match="LOCAL_RANK='abc' is not an integer"):
        dev.resolve_device("cuda")


# --------------------------------------------------------------------------------------------
# fused NPU kernels (npu_patches) through the fake torch_npu of tests/support/fake_device.py
# --------------------------------------------------------------------------------------------


def _qwen2(head_dim: int = 8, **rope):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = 4 if head_dim == 8 else 2
    config = Qwen2Config(
        vocab_size=64, hidden_size=head_dim * heads, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
        **({"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}),
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_qwen2():
    return _qwen2()


@pytest.fixture()
def rotary_restored(monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", modeling_qwen2.apply_rotary_pos_emb)


def test_npu_patches_match_eager_outputs(tiny_qwen2, monkeypatch, rotary_restored):
    import copy

    from grpo_ascend.device.npu_patches import apply_npu_patches

    model = copy.deepcopy(tiny_qwen2)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits

    assert apply_npu_patches(model) == []  # parameters on the CPU: no-op
    counts = fake_device.install(monkeypatch, soc="Ascend910B2")
    patched = apply_npu_patches(model, device="npu")
    assert patched == ["npu_rms_norm: 5 x Qwen2RMSNorm", "npu_swiglu: 2 x Qwen2MLP", "npu_rotary_mul: 2 x Qwen2Attention"]
    with torch.no_grad():
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert counts == {"rms_norm": 5, "swiglu": 2, "rotary": 4}  # rotary: q and k per layer
    assert apply_npu_patches(model, device="npu") == []  # idempotent
    # another model of the same family in the process keeps its eager RMSNorm, MLP and rotary
    counts.clear()
    with torch.no_grad():
        torch.testing.assert_close(tiny_qwen2(ids).logits, expected, rtol=0, atol=0)
    assert sum(counts.values()) == 0
    # a deep copy (e.g. a frozen reference) carries the kernels, bound to the copy
    clone = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(clone(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert counts == {"rms_norm": 5, "swiglu": 2, "rotary": 4}
    # gradients flow through the patched modules
    model(ids).logits.sum().backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None
    with pytest.raises(ConfigError, match="did you mean 'swiglu'"):
        apply_npu_patches(model, device="npu", kinds=["swigl"])


@pytest.mark.parametrize(("soc", "expected"), [
    ("Ascend910_9391", {"rms_norm": 5, "swiglu": 2, "rotary": 4}),  # A3: all three
    ("Ascend910ProB", {"rms_norm": 5}),  # training series: no swiglu; rotary needs head_dim 128 (here 8)
    ("Ascend310P3", {"rms_norm": 5}),  # inference series: rms_norm only
])
def test_kernels_follow_the_chip(tiny_qwen2, monkeypatch, rotary_restored, soc, expected):
    import copy

    from grpo_ascend.device.npu_patches import apply_npu_patches

    model = copy.deepcopy(tiny_qwen2)
    counts = fake_device.install(monkeypatch, soc=soc)
    apply_npu_patches(model, device="npu")
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 7)))  # the fake raises if a kernel the chip lacks is called
    assert counts == expected


def test_unknown_chip_keeps_eager_code(tiny_qwen2, monkeypatch, rotary_restored, caplog):
    import copy

    from grpo_ascend.device.npu_patches import apply_npu_patches

    fake_device.install(monkeypatch, soc="Ascend910B2")
    monkeypatch.setattr(torch.npu, "soc", "Ascend950PR")
    with caplog.at_level("INFO", logger="grpo_ascend.device.npu_patches"):
        assert apply_npu_patches(copy.deepcopy(tiny_qwen2), device="npu") == []
    assert "Ascend950PR is not a documented chip" in caplog.text


def test_training_series_rotary_needs_head_dim_128_and_shared_positions(monkeypatch, rotary_restored):
    from grpo_ascend.device.npu_patches import apply_npu_patches

    model = _qwen2(head_dim=128)
    ids = torch.randint(0, 64, (2, 7))
    rows = torch.tensor([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]])  # left padding: positions differ per row
    with torch.no_grad():
        expected_shared, expected_rows = model(ids).logits, model(ids, position_ids=rows).logits
    counts = fake_device.install(monkeypatch, soc="Ascend910ProB")
    assert apply_npu_patches(model, device="npu") == ["npu_rms_norm: 5 x Qwen2RMSNorm", "npu_rotary_mul: 2 x Qwen2Attention"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected_shared, rtol=1e-5, atol=1e-5)
        assert counts["rotary"] == 4  # one position row for the batch: cos/sin 11SD
        torch.testing.assert_close(model(ids, position_ids=rows).logits, expected_rows, rtol=1e-5, atol=1e-5)
    assert counts["rotary"] == 4  # per-row positions (B1SD): eager on this chip


def test_rotary_kernel_is_skipped_for_scaled_rope(monkeypatch, rotary_restored):
    from grpo_ascend.device.npu_patches import apply_npu_patches, rotary_scaling

    model = _qwen2(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    assert rotary_scaling(model) > 1.0  # transformers multiplies cos/sin by it
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
    counts = fake_device.install(monkeypatch, soc="Ascend910B2")
    assert apply_npu_patches(model, device="npu") == ["npu_rms_norm: 5 x Qwen2RMSNorm", "npu_swiglu: 2 x Qwen2MLP"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert counts["rotary"] == 0
    assert rotary_scaling(_qwen2()) == 1.0


# --------------------------------------------------------------------------------------------
# collective timeouts against torch_npu's watchdog rule, per release
# --------------------------------------------------------------------------------------------

DEFAULT_TIMEOUT_MS = 30 * 60 * 1000  # ProcessGroupHCCL.hpp


def torch_npu_watchdog(pg_timeout_ms: float, env: dict, release: str) -> tuple[float, bool]:
    """(watchdog ms, warned) as ProcessGroupHCCL's constructor sets them (HCCL_ASYNC_ERROR_HANDLING on).

    release '7.0': torch_npu v7.0.0 (2.5.1, 2.4.0.post4, ...); '7.1': v7.1.0 and later (2.5.1.post1, 2.6.0, 2.8.0).
    """
    exec_timeout = int(env["HCCL_EXEC_TIMEOUT"]) if "HCCL_EXEC_TIMEOUT" in env else -1  # GetHCCLExecTimeout
    if release == "7.0":
        if exec_timeout > 0:
            return pg_timeout_ms, exec_timeout * 1000 > pg_timeout_ms
        if exec_timeout == 0:
            return pg_timeout_ms, True
        if pg_timeout_ms == DEFAULT_TIMEOUT_MS:
            return DEFAULT_TIMEOUT_MS * 2, False
        return pg_timeout_ms, pg_timeout_ms < DEFAULT_TIMEOUT_MS
    if exec_timeout < 0:
        exec_timeout = 1836  # defaultExecTimeout
    if pg_timeout_ms != DEFAULT_TIMEOUT_MS:
        return pg_timeout_ms, pg_timeout_ms <= exec_timeout * 1000 or exec_timeout == 0
    return (float("inf") if exec_timeout == 0 else (exec_timeout + 1800) * 1000), False


#: torch_npu pip version -> Ascend Extension for PyTorch release (version.txt / setup.py at each tag)
RELEASES = {"2.1.0.post12": "7.0", "2.1.0.post13": "7.1", "2.4.0.post4": "7.0", "2.5.1": "7.0", "2.5.1.post1": "7.1",
            "2.6.0": "7.1", "2.8.0": "7.1", "2.9.0.post1": "7.1"}


def test_the_naive_settings_disagree_with_the_watchdog():
    # what the issue found: 7.0 aborts at 1800 s despite HCCL_EXEC_TIMEOUT=3600 (and warns); 7.1+ ignores 1800 s
    assert torch_npu_watchdog(1800_000, {"HCCL_EXEC_TIMEOUT": "3600"}, "7.0") == (1800_000, True)
    assert torch_npu_watchdog(1800_000, {"HCCL_EXEC_TIMEOUT": "3600"}, "7.1") == (5400_000, False)


@pytest.mark.parametrize("ddp_timeout", [128, 600, 1800, 3600])
def test_watchdog_fires_at_ddp_timeout_after_hccl_on_every_release(ddp_timeout):
    timeouts = dev.collective_timeouts("npu", ddp_timeout, {})
    env = {"HCCL_EXEC_TIMEOUT": str(timeouts.exec_timeout_s)}
    assert timeouts.exec_timeout_s == ddp_timeout - 60 and timeouts.watchdog_s == pytest.approx(ddp_timeout, abs=1e-3)
    for version, release in RELEASES.items():
        watchdog_ms, warned = torch_npu_watchdog(timeouts.process_group.total_seconds() * 1000, env, release)
        assert watchdog_ms == pytest.approx(ddp_timeout * 1000, abs=1) and not warned, version


def test_exported_exec_timeout_must_fit_ddp_timeout():
    kept = dev.collective_timeouts("npu:0", 1800, {"HCCL_EXEC_TIMEOUT": "1200"})
    assert kept.exec_timeout_s == 1200 and kept.exec_source == "exported"
    for bad in ("3600", "0", "1800"):
        with pytest.raises(ConfigError, match=rf"HCCL_EXEC_TIMEOUT={bad} does not fit ddp_timeout=1800.*Unset"):
            dev.collective_timeouts("npu", 1800, {"HCCL_EXEC_TIMEOUT": bad})
    with pytest.raises(ConfigError, match="ddp_timeout=100 is too short on Ascend.*128"):
        dev.collective_timeouts("npu", 100, {})
    off = dev.collective_timeouts("cpu", 100, {"HCCL_EXEC_TIMEOUT": "3600"})
    assert off.process_group == timedelta(seconds=100) and off.exec_timeout_s is None


def test_effective_exec_timeout_per_chip():
    assert dev.effective_exec_timeout(1740, "training") == 1700  # rounded down to 25 x 68 s
    assert dev.effective_exec_timeout(50, "inference") == 68
    assert dev.effective_exec_timeout(1740, "A2", {}) == 1740
    assert dev.effective_exec_timeout(1740, "A3", {"HCCL_OP_EXPANSION_MODE": "AIV"}) == 1091


def test_npu_run_exports_the_derived_exec_timeout(fake_npu, monkeypatch):
    assert dev.apply_collective_timeouts("npu:0", 600) == timedelta(seconds=600)
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "540"
    group = dev.apply_collective_timeouts("npu:0", 1800)  # a later run in the process derives again
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "1740"
    assert group == timedelta(seconds=1800, milliseconds=1)  # torch_npu 7.1+ would replace exactly 1800 s
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1000")  # exported by the user: kept
    dev.apply_collective_timeouts("npu:0", 1800)
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "1000"
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1740")
    fake_npu.soc = "Ascend910ProB"
    assert doctor_facts.timeout_facts("npu:0", 1800) == {
        "ddp_timeout": "1800 s (process-group timeout)",
        "HCCL exec timeout": "1740 s (exported, 1700 s on this chip)",
        "HCCL watchdog": "1800 s (torch_npu 2.12.0)",
    }
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT")
    assert doctor_facts.timeout_facts("npu:0", 600)["HCCL exec timeout"] == "540 s (derived from ddp_timeout, 476 s on this chip)"
    assert doctor_facts.pending_runtime_defaults(600, {})["HCCL_EXEC_TIMEOUT"] == "540"
