"""Fake accelerators for tests: the one place tests put a fake torch_npu, torch.npu or torch.cuda in.

How tests reach the device layer (grpo_ascend/device/__init__.py says the same):

- a device *function* is replaced on the package, ``monkeypatch.setattr(grpo_ascend.device, name, fake)``;
  code outside the package calls it through the package, so every caller sees the fake;
- the accelerator *runtime* is replaced here: :func:`install` (a fake torch_npu with fused kernels
  and a recording ``torch.npu``), :func:`without_torch_npu`, :func:`broken_torch_npu`,
  :func:`cpu_only`, :func:`fake_cuda`. Each forgets the cached torch_npu import
  (``grpo_ascend.device.forget_torch_npu``) so the device layer imports the fake afresh;
  tests/conftest.py forgets it again after every test, once the monkeypatches are undone.

The fakes follow torch_npu's documented behaviour:

- ``torch.npu.get_device_name()`` returns the SoC name (torch_npu calls aclrtGetSocName), e.g.
  'Ascend910B2' (A2), 'Ascend910_9391' (A3), 'Ascend910ProB' (Atlas training series).
- ``npu_rms_norm(x, gamma, epsilon)`` returns a tuple ``(y, rstd)``.
- ``npu_swiglu(x, dim=-1)`` = silu(first half) * second half; only on A2/A3 (elsewhere it raises,
  as an operator without a kernel for the SoC does).
- ``npu_rotary_mul(x, r1, r2)`` (half mode) takes 4-D tensors; for x in BNSD layout r1/r2 must be
  11SD, B1SD or BNSD on A2/A3 (D < 896, even) and 11SD with D = 128 on the Atlas training series;
  r1/r2 must lie in [-1, 1].
The kernels compute with plain torch on CPU tensors and count their calls.

The fakes follow the newest torch_npu API the device layer uses (2.12/2.14, checked against Ascend/pytorch's
source), so a rename breaks a test here before it breaks a user:

- ``torch.version.cann`` is what torch_npu sets at import from $ASCEND_HOME_PATH's install info, "not known"
  without it (every release); the runtime's answer is ``torch_npu.utils.get_cann_version(module="CANN")``
  (also ``torch_npu.npu.utils``);
- ``torch.npu.is_bf16_supported(including_emulation=False)`` (the argument arrived after 2.5);
- the names torch_npu deprecated (:data:`DEPRECATED_NPU_APIS`) are absent from the fake runtime, so calling
  one fails here; tests/device/test_stack_versions.py also checks the device layer never names them;
- the HCCL watchdog switches are ``TORCH_HCCL_ASYNC_ERROR_HANDLING`` / ``TORCH_HCCL_BLOCKING_WAIT`` from
  2.13 on, the older ``HCCL_*`` names still read when the new ones are unset.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from grpo_ascend import device as dev

#: torch.npu names torch_npu deprecated between 2.5 and 2.14 -> what replaces them (torch_npu/npu/memory.py,
#: torch_npu/npu/amp/autocast_mode.py).
DEPRECATED_NPU_APIS = {
    "memory_cached": "memory_reserved",
    "max_memory_cached": "max_memory_reserved",
    "reset_max_memory_allocated": "reset_peak_memory_stats",
    "reset_max_memory_cached": "reset_peak_memory_stats",
    "custom_fwd": "torch.amp.custom_fwd(device_type=...)",
    "custom_bwd": "torch.amp.custom_bwd(device_type=...)",
}
#: The torch_npu version and CANN the fake reports by default: Ascend's recommended pair (device/stack_versions.py).
FAKE_TORCH_NPU_VERSION = "2.12.0"
FAKE_CANN_VERSION = "9.1.0"
FAMILY_OF_SOC = {"Ascend910B2": "A2", "Ascend910_9391": "A3", "Ascend910ProB": "training", "Ascend310P3": "inference"}
#: What ``import torch_npu`` raises on a machine whose CANN libraries are not on the library path.
CANN_MISSING = "libascendcl.so: cannot open shared object file: No such file or directory"


class NpuKernelError(RuntimeError):
    """What the fake raises where the real operator has no kernel or rejects a shape."""


def kernels(soc: str, calls: Counter, version: str = FAKE_TORCH_NPU_VERSION,
            cann: str = FAKE_CANN_VERSION) -> types.ModuleType:
    """A torch_npu module whose three fused kernels check their documented chip and shape limits."""
    family = FAMILY_OF_SOC[soc]
    module = types.ModuleType("torch_npu")
    module.__version__ = version

    def get_cann_version(module: str = "CANN") -> str:
        if module not in ("CANN", "RUNTIME", "COMPILER", "HCCL", "TOOLKIT", "OPP", "OPP_KERNEL", "DRIVER"):
            raise ValueError(f"unknown CANN module {module!r}")
        return cann

    module.utils = types.SimpleNamespace(get_cann_version=get_cann_version)

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls["rms_norm"] += 1
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd).to(x.dtype) * gamma, rstd

    def npu_swiglu(x, dim=-1):
        if family not in ("A2", "A3"):
            raise NpuKernelError(f"SwiGlu has no kernel for {soc}")
        calls["swiglu"] += 1
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        if x.dim() != 4 or r1.dim() != 4 or r2.shape != r1.shape:
            raise NpuKernelError(f"RotaryMul takes 4-D tensors, got {tuple(x.shape)} and {tuple(r1.shape)}")
        b, n, s, d = x.shape
        layout = {(1, 1, s, d): "11SD", (b, 1, s, d): "B1SD", (b, n, s, d): "BNSD"}.get(tuple(r1.shape))
        allowed = ("11SD",) if family == "training" else ("11SD", "B1SD", "BNSD")
        if layout not in allowed or (family == "training" and d != 128) or d % 2 or d >= 896:
            raise NpuKernelError(f"RotaryMul on {soc} does not take x {tuple(x.shape)} with r1 {tuple(r1.shape)}")
        if r1.abs().max() > 1 or r2.abs().max() > 1:
            raise NpuKernelError("RotaryMul needs r1/r2 in [-1, 1]")
        calls["rotary"] += 1
        x1, x2 = x.chunk(2, dim=-1)
        return x * r1 + torch.cat((-x2, x1), dim=-1) * r2

    module.npu_rms_norm = npu_rms_norm
    module.npu_swiglu = npu_swiglu
    module.npu_rotary_mul = npu_rotary_mul
    return module


class FakeRuntime:
    """A ``torch.npu`` (as torch_npu registers it) or ``torch.cuda`` namespace, reduced to what
    grpo_ascend calls, recording the calls that act on a device in ``calls``."""

    def __init__(self, soc: str = "Ascend910B2", count: int = 1, bf16: bool = True) -> None:
        self.soc = soc  # get_device_name() returns the SoC name (aclrtGetSocName)
        self.count = count
        self.bf16 = bf16
        self.current = 0
        self.free, self.total = 2**30, 2**32  # what mem_get_info reports
        self.calls: list[tuple] = []
        self.rng = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}

    def _rec(self, *call):
        self.calls.append(call)

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return self.current

    def set_device(self, index):
        self._rec("set_device", index)
        self.current = index

    def get_device_name(self, device_name=None):
        return self.soc

    def is_bf16_supported(self, including_emulation: bool = False):
        return self.bf16

    def synchronize(self, index=None):
        self._rec("synchronize", index)

    def empty_cache(self):
        self._rec("empty_cache")

    def memory_allocated(self, index=None):
        self._rec("memory_allocated", index)
        return 100

    def memory_reserved(self, index=None):
        self._rec("memory_reserved", index)
        return 200

    def max_memory_allocated(self, index=None):
        self._rec("max_memory_allocated", index)
        return 150

    def reset_peak_memory_stats(self, index=None):
        self._rec("reset_peak_memory_stats", index)

    def mem_get_info(self, index=None):
        self._rec("mem_get_info", index)
        return (self.free, self.total)

    def manual_seed_all(self, seed):
        self._rec("manual_seed_all", seed)

    def get_rng_state(self, index=None):
        self._rec("get_rng_state", index)
        return self.rng[index].clone()

    def set_rng_state(self, state, index=None):
        self._rec("set_rng_state", index)
        self.rng[index] = state.clone()


class FakeDevice:
    """Stands in for torch.device('npu:N'), which only parses once the real torch_npu registers 'npu'."""

    def __init__(self, spec: str) -> None:
        kind, _, index = spec.partition(":")
        self.type = kind
        self.index = int(index) if index else None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device(type={self.type!r}, index={self.index})"

    def __eq__(self, other) -> bool:
        return str(self) == str(other)

    __hash__ = None


def fake_npu_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``torch.device('npu:N')`` return a :class:`FakeDevice` (torch.device is then a function,
    so leave it off where library code calls isinstance(x, torch.device))."""
    real_device = torch.device

    def device_factory(spec, index=None):
        if isinstance(spec, str) and spec.split(":")[0] == "npu":
            return FakeDevice(spec if index is None else f"npu:{index}")
        return real_device(spec) if index is None else real_device(spec, index)

    monkeypatch.setattr(torch, "device", device_factory)


def install(monkeypatch: pytest.MonkeyPatch, soc: str = "Ascend910B2", npu_devices: bool = True,
            count: int = 1, version: str = FAKE_TORCH_NPU_VERSION, cann: str = FAKE_CANN_VERSION) -> Counter:
    """Put a fake torch_npu ``version`` (fused kernels of ``soc``, runtime CANN ``cann``) and a recording
    torch.npu with ``count`` devices in place; returns the kernel call counts. The runtime is ``torch.npu``
    afterwards, and ``torch.version.cann`` is "not known", as torch_npu leaves it without $ASCEND_HOME_PATH.

    With ``npu_devices`` torch.device('npu:N') returns a FakeDevice (see :func:`fake_npu_devices`).
    """
    calls: Counter = Counter()
    module = kernels(soc, calls, version, cann)
    module.npu = FakeRuntime(soc, count=count, bf16=FAMILY_OF_SOC[soc] in ("A2", "A3"))
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", module.npu, raising=False)
    monkeypatch.setattr(torch.version, "cann", "not known", raising=False)
    dev.forget_torch_npu()
    if npu_devices:
        fake_npu_devices(monkeypatch)
    return calls


def without_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import torch_npu`` fails with ModuleNotFoundError, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    dev.forget_torch_npu()


def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torch_npu and no CUDA device: the machine is a plain CPU host."""
    without_torch_npu(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


class _BrokenTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError(self.message)


def broken_torch_npu(monkeypatch: pytest.MonkeyPatch, message: str = CANN_MISSING) -> None:
    """``import torch_npu`` raises OSError(message), as it does when the CANN libraries do not load."""
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpuFinder(message), *sys.meta_path])
    dev.forget_torch_npu()


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int = 2) -> FakeRuntime:
    """torch.cuda looks available with ``count`` devices and records the calls made on it; no torch_npu."""
    runtime = FakeRuntime(count=count)
    without_torch_npu(monkeypatch)
    for name in (
        "is_available", "device_count", "current_device", "set_device", "synchronize", "empty_cache",
        "memory_allocated", "memory_reserved", "max_memory_allocated", "reset_peak_memory_stats",
        "mem_get_info", "is_bf16_supported", "get_device_name", "manual_seed_all", "get_rng_state",
        "set_rng_state",
    ):
        monkeypatch.setattr(torch.cuda, name, getattr(runtime, name))
    return runtime


def autoloaded_broken_torch_npu(root: Path, message: str = CANN_MISSING) -> None:
    """A torch_npu under ``root`` registered as a torch device backend (as its wheel does) whose import
    raises OSError(message), so torch >= 2.5 fails at ``import torch`` unless autoload is off.
    For subprocesses with ``root`` on PYTHONPATH."""
    (root / "torch_npu").mkdir()
    (root / "torch_npu" / "__init__.py").write_text(f"raise OSError({message!r})\n")
    info = root / "torch_npu-2.5.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-npu\nVersion: 2.5.1\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
