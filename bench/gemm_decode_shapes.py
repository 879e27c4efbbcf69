"""GEMM GFLOP/s and memory bandwidth at the rollout decode's shapes: the ceiling of a decode step.

For each linear layer of a decode step (``rows`` tokens against an ``[out, in]`` weight through
``nn.functional.linear``) prints the median time, GFLOP/s and the weight-read bandwidth it implies,
for the two weight layouts: row-major ``[out, in]`` (``nn.Linear``'s own, which the BLAS sees as a
transposed operand) and stored ``[in, out]`` behind a ``.t()`` view (a plain operand; what
``device.decode_weights_transposed`` picks for the rollout's merged LoRA copy on the CPU). Also the
machine's copy bandwidth (a 256 MiB ``copy_``), at the given thread counts.
A decode step cannot be faster than the sum of its GEMMs at these rates plus its KV-cache reads
at the copy bandwidth.

Examples::

    python bench/gemm_decode_shapes.py                    # small and real-shape decode shapes, 1 and 2 threads
    python bench/gemm_decode_shapes.py --threads 1 --repeats 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {
    # random-25m (bench_random_model): hidden 512, 8/4 heads, intermediate 1376, vocab 556, 32 rows
    "random-25m": [(32, 512, 512), (32, 512, 256), (32, 512, 1376), (32, 1376, 512)],
    # (rows, in, out): small = hidden 512, 8/4 heads, intermediate 1408, vocab 552, 64 rows
    "small": [(64, 512, 512), (64, 512, 256), (64, 512, 1408), (64, 1408, 512), (64, 512, 552)],
    # Qwen2.5-0.5B: hidden 896, 14/2 heads of 64, intermediate 4864, vocab 151936, 16 rows
    "real-shape": [(16, 896, 896), (16, 896, 128), (16, 896, 4864), (16, 4864, 896), (16, 896, 151936)],
}


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe(args.threads)}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| threads | model | rows × in → out | ms [out, in] / [in, out] | GFLOP/s [out, in] / [in, out] "
          "| weight GB/s [out, in] / [in, out] |")
    print("|---:|---|---|---:|---:|---:|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        src = torch.empty(64 * 2**20)
        dst = torch.empty_like(src)
        t = timed(lambda dst=dst, src=src: dst.copy_(src), max(5, args.repeats // 3))
        print(f"| {threads} | copy 256 MiB | | {t * 1e3:.1f} | | {2 * src.numel() * 4 / t / 1e9:.1f} (read + write) |")
        for model, shapes in SHAPES.items():
            for rows, k, n in shapes:
                x, w = torch.randn(rows, k), torch.randn(n, k)
                w_in_out = w.t().contiguous().t()  # same values and shape, stored [in, out]
                reps = args.repeats if n < 100_000 else max(5, args.repeats // 5)
                times = [timed(lambda x=x, w=weight: F.linear(x, w), reps) for weight in (w, w_in_out)]
                print(
                    f"| {threads} | {model} | {rows} × {k} → {n} | "
                    + " / ".join(f"{t * 1e3:.3f}" for t in times) + " | "
                    + " / ".join(f"{2 * rows * k * n / t / 1e9:.1f}" for t in times) + " | "
                    + " / ".join(f"{w.numel() * 4 / t / 1e9:.1f}" for t in times) + " |"
                )


if __name__ == "__main__":
    main()
