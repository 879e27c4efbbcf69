"""glibc malloc tuning on the CPU path: applied only there, only when the user set nothing, and it
makes freed tensors leave the resident set."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpo_ascend import device as dev
from grpo_ascend.device import host_allocator as ha


class FakeLibc:
    """Records mallopt calls; answers ``result`` (glibc returns 1 on success, 0 on error)."""

    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result


@pytest.fixture(autouse=True)
def floor_threshold():
    """Each test starts at the floor (what an unsized call sets), whatever a trainer in this worker sized before."""
    ha.fix_mmap_threshold({}, FakeLibc(), tensor_bytes=0)
    yield
    ha.fix_mmap_threshold({}, FakeLibc(), tensor_bytes=0)


def test_fixes_threshold_when_unset() -> None:
    libc = FakeLibc()
    assert ha.fix_mmap_threshold({}, libc) == ha.MMAP_THRESHOLD_BYTES
    assert libc.calls == [(ha.M_MMAP_THRESHOLD, ha.MMAP_THRESHOLD_BYTES), (ha.M_TRIM_THRESHOLD, ha.TRIM_THRESHOLD_BYTES)]


@pytest.mark.parametrize("env", [
    {"MALLOC_MMAP_THRESHOLD_": "65536"},
    {"MALLOC_TRIM_THRESHOLD_": "65536"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=262144"},
    {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=262144"},
    {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=262144"},
])
def test_user_setting_is_left_alone(env: dict[str, str]) -> None:
    libc = FakeLibc()
    assert ha.fix_mmap_threshold(env, libc) is None
    assert libc.calls == []


def test_other_tunables_do_not_count_as_a_threshold() -> None:
    libc = FakeLibc()
    assert ha.fix_mmap_threshold({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, libc) == ha.MMAP_THRESHOLD_BYTES
    assert libc.calls


@pytest.mark.parametrize(("tensor_bytes", "threshold_mib"), [
    (0, 4), (3 * 2**20, 4), (4 * 2**20, 4), (4 * 2**20 + 1, 8),
    (32 * 64 * 1408 * 4, 16),  # one micro-batch of 32 x 64 tokens through a 1,408-wide MLP in float32
    (32 * 2**20, 32),
    (32 * 2**20 + 1, 4), (8 * 256 * 4864 * 4, 4),  # past glibc's ceiling they are mapped anyway: the floor
])
def test_threshold_is_the_power_of_two_above_the_tensor_within_bounds(tensor_bytes: int, threshold_mib: int) -> None:
    assert ha.threshold_for(tensor_bytes) == threshold_mib * 2**20


def test_a_sized_call_sets_both_thresholds_and_a_plain_call_keeps_them() -> None:
    libc = FakeLibc()
    assert ha.fix_mmap_threshold({}, libc, tensor_bytes=11 * 2**20) == 16 * 2**20
    assert libc.calls == [(ha.M_MMAP_THRESHOLD, 16 * 2**20), (ha.M_TRIM_THRESHOLD, 64 * 2**20)]
    assert ha.fix_mmap_threshold({}, libc) == 16 * 2**20  # resolve_device again: the trainer's size stays
    assert ha.fix_mmap_threshold({}, libc, tensor_bytes=2**20) == ha.MMAP_THRESHOLD_BYTES  # a later, smaller run
    with pytest.raises(ValueError, match="tensor_bytes must be >= 0, got -1"):
        ha.threshold_for(-1)


def test_a_sized_call_leaves_a_user_setting_alone() -> None:
    libc = FakeLibc()
    assert ha.fix_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "65536"}, libc, tensor_bytes=11 * 2**20) is None
    assert libc.calls == []


def test_refused_mallopt_reports_nothing_set() -> None:
    assert ha.fix_mmap_threshold({}, FakeLibc(result=0)) is None


def test_only_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(ha, "glibc", lambda: libc)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for device in ("cuda", "cuda:1", "npu:0"):
        assert dev.tune_host_allocator(device) is None
    assert libc.calls == []
    assert dev.resolve_device("cpu").type == "cpu"
    assert libc.calls[0] == (ha.M_MMAP_THRESHOLD, ha.MMAP_THRESHOLD_BYTES)


_PROBE = r"""
import ctypes, json, sys
from grpo_ascend.device import host_allocator

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    assert host_allocator.fix_mmap_threshold() is not None
n = 16 * 2**20  # a tensor-sized block above the fixed threshold (and under the adaptive maximum, 32 MiB): its first free raises glibc's adaptive threshold above it
block = libc.malloc(n)
ctypes.memset(block, 1, n)
libc.free(block)
block = libc.malloc(n)  # adaptive: now from the heap (its top); fixed: its own mapping again
ctypes.memset(block, 1, n)
held = rss_kib()
libc.free(block)
print(json.dumps({"released_mib": (held - rss_kib()) / 1024}))
"""


@pytest.mark.skipif(ha.glibc() is None, reason="glibc only")
def test_freed_tensor_leaves_the_resident_set() -> None:
    """The mechanism itself: with glibc's adaptive threshold a freed 16 MiB block stays resident,
    with the fixed one it is returned to the OS (PyTorch's CPU tensors are such malloc blocks)."""
    env = {k: v for k, v in os.environ.items() if k not in (*ha.USER_SETTINGS, "GLIBC_TUNABLES")}
    released = {}
    for mode in ("default", "tuned"):
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True,
                             check=True, timeout=60)
        released[mode] = json.loads(out.stdout.strip().splitlines()[-1])["released_mib"]
    assert released["tuned"] > 12, released
    assert released["default"] < 4, released


def test_the_trainer_sizes_the_threshold_to_its_micro_batch(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """A CPU trainer asks the device layer to keep its training micro-batch's largest activation in the heap:
    rows × completion tokens × the MLP's width × 4 bytes (float32); a token budget replaces rows × tokens."""
    import dataclasses

    from helpers import SMALL_RUN, first_digit_is_one

    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.trainers.components import training_activation_bytes

    asked: list[tuple[str, int | None]] = []
    monkeypatch.setattr(dev, "tune_host_allocator",
                        lambda device, env=os.environ, tensor_bytes=None: asked.append((str(device), tensor_bytes)))
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run")})
    trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8))
    config = trainer.policy.config
    width = max(config.intermediate_size, config.hidden_size)
    assert asked == [("cpu", SMALL_RUN["per_device_train_batch_size"] * SMALL_RUN["max_completion_length"] * width * 4)]
    budget = dataclasses.replace(trainer.plan, max_tokens_per_micro_batch=300)
    assert training_activation_bytes(trainer.policy, cfg, budget, "fp32") == 300 * width * 4
    assert training_activation_bytes(trainer.policy, cfg, budget, "bf16") == 300 * width * 2
