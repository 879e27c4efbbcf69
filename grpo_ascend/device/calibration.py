"""Short start-up measurements that choose between equivalent layouts on the CPU at hand.

Which layout of a decode matmul's weight MKL's sgemm reads fastest depends on the instruction set,
the shape and the thread count: on an AVX-512 Xeon a weight stored ``[in, out]`` (a plain operand
behind a ``.t()`` view) ran 32 x 512 -> 256 at 121 vs 66 GFLOP/s for ``nn.Linear``'s own
``[out, in]`` (1 thread), yet 64 x 1408 -> 512 at 94 vs 109; with the kernels capped at AVX2 the two
were within 10% everywhere (bench/gemm_decode_shapes.py). A fixed rule tuned on one CPU is wrong on
another, so each (rows, in, out, dtype, threads) is timed once per process, both layouts interleaved,
a few milliseconds per shape, and the plain operand is taken only where it is clearly faster.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

#: The plain operand must be at least this much faster to be chosen (timing noise stays on nn.Linear's layout).
MARGIN = 0.95
_CHOICES: dict[tuple[int, int, int, torch.dtype, int], bool] = {}


def choose_plain(row_major_seconds: float, plain_seconds: float) -> bool:
    """Whether timings favour the plain ``[in, out]`` operand clearly enough to leave ``nn.Linear``'s layout."""
    return plain_seconds < MARGIN * row_major_seconds


def plain_operand_faster(rows: int, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``F.linear`` of ``rows`` CPU rows runs faster with the weight stored ``[in, out]`` (measured once
    per shape, dtype and thread count in this process)."""
    key = (int(rows), int(in_features), int(out_features), dtype, torch.get_num_threads())
    if key not in _CHOICES:
        _CHOICES[key] = choose_plain(*measure_layouts(*key[:4]))
    return _CHOICES[key]


def forget_measurements() -> None:
    """Drop this process's measured choices: each shape is timed again at its next use (after the machine's
    load or thread budget changed, say)."""
    _CHOICES.clear()


def measure_layouts(rows: int, in_features: int, out_features: int, dtype: torch.dtype,
                    repeats: int = 7) -> tuple[float, float]:
    """Best seconds of ``F.linear`` with a ``[out, in]`` weight and with the same weight stored ``[in, out]``,
    the two timed in turn so a drift of the machine's speed hits both."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    row_major = torch.randn(out_features, in_features, generator=generator).to(dtype)
    plain = row_major.t().contiguous().t()
    best = [float("inf"), float("inf")]
    with torch.no_grad():
        for weight in (row_major, plain):  # warm-up: first-call allocations and kernel selection
            F.linear(x, weight)
        for _ in range(repeats):
            for i, weight in enumerate((row_major, plain)):
                started = time.perf_counter()
                F.linear(x, weight)
                best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1]
