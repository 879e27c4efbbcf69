"""A fake torch_npu for the fused-kernel tests, modelled on torch_npu's documented behaviour.

- ``torch.npu.get_device_name()`` returns the SoC name (torch_npu calls aclrtGetSocName), e.g.
  'Ascend910B2' (A2), 'Ascend910_9391' (A3), 'Ascend910ProB' (Atlas training series).
- ``npu_rms_norm(x, gamma, epsilon)`` returns a tuple ``(y, rstd)``.
- ``npu_swiglu(x, dim=-1)`` = silu(first half) * second half; only on A2/A3 (elsewhere it raises,
  as an operator without a kernel for the SoC does).
- ``npu_rotary_mul(x, r1, r2)`` (half mode) takes 4-D tensors; for x in BNSD layout r1/r2 must be
  11SD, B1SD or BNSD on A2/A3 (D < 896, even) and 11SD with D = 128 on the Atlas training series;
  r1/r2 must lie in [-1, 1].
The kernels compute with plain torch on CPU tensors and count their calls.
"""

from __future__ import annotations

import types
from collections import Counter

import torch

FAMILY_OF_SOC = {"Ascend910B2": "A2", "Ascend910_9391": "A3", "Ascend910ProB": "training", "Ascend310P3": "inference"}


class NpuKernelError(RuntimeError):
    """What the fake raises where the real operator has no kernel or rejects a shape."""


def kernels(soc: str, calls: Counter) -> types.ModuleType:
    """A torch_npu module whose three fused kernels check their documented chip and shape limits."""
    family = FAMILY_OF_SOC[soc]
    module = types.ModuleType("torch_npu")
    module.__version__ = "2.5.1.post1"

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


class Runtime:
    """The ``torch.npu`` namespace torch_npu registers, reduced to what grpo_ascend calls here."""

    def __init__(self, soc: str, count: int = 1) -> None:
        self.soc = soc
        self.count = count
        self.current = 0

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return self.current

    def set_device(self, index):
        self.current = index

    def get_device_name(self, device=None):
        return self.soc

    def is_bf16_supported(self):
        return FAMILY_OF_SOC[self.soc] in ("A2", "A3")

    def mem_get_info(self, index=None):
        return (2**30, 2**32)

    def synchronize(self, index=None):
        pass

    def empty_cache(self):
        pass

    def manual_seed_all(self, seed):
        pass


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


def install(monkeypatch, soc: str = "Ascend910B2", npu_devices: bool = True) -> Counter:
    """Put the fake torch_npu and torch.npu in place; returns the kernel call counts.

    With ``npu_devices`` torch.device('npu:N') returns a FakeDevice (torch.device is then a function,
    so leave it off where library code calls isinstance(x, torch.device)).
    """
    import sys

    from grpo_ascend import device as dev

    calls: Counter = Counter()
    module = kernels(soc, calls)
    module.npu = Runtime(soc)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", module.npu, raising=False)
    dev.load_torch_npu.cache_clear()
    if not npu_devices:
        return calls
    real_device = torch.device

    def device_factory(spec, index=None):
        if isinstance(spec, str) and spec.split(":")[0] == "npu":
            return FakeDevice(spec if index is None else f"npu:{index}")
        return real_device(spec) if index is None else real_device(spec, index)

    monkeypatch.setattr(torch, "device", device_factory)
    return calls
