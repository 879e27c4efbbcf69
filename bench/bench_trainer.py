"""GRPO step time and memory: grpo_ascend's GRPOTrainer vs TRL's GRPOTrainer, side by side.

Both trainers do the same work on the same offline model (``small``, ~24M params, fp32 on the
CPU by default): the same arithmetic chat prompts, the same cheap rule reward (TRL's signature),
LoRA r=16 / alpha=32 on every linear layer, G=8 completions for each of 4 prompts per optimizer
step (32 completions = per_device_train_batch_size 8 × gradient_accumulation_steps 4 on both,
so steps_per_generation = 4 and one generation round per optimizer step), 64 new tokens,
temperature 1, beta=0.04 (reference = the base with the adapter disabled, on both), the same
``loss_type``, one optimizer step per generation round (so neither computes old log-probs), no
gradient checkpointing, no checkpoint saving inside the timed steps.

Completion lengths are forced equal by default (``--lengths fixed``): ours samples with
``ignore_eos`` (an EOS may be drawn but does not stop or mask the row), TRL's ``generate`` gets
``min_new_tokens`` (EOS is suppressed until the limit). Both then train on 32 × 64 completion
tokens per step. ``--lengths natural`` lets both stop at EOS.

Each trainer runs in a fresh subprocess (``--worker``), ``--repeats`` times. By default
(``--interleave steps``) the two workers of a repeat are alive together and take turns step by
step: the driver hands a baton (one byte over a pipe) to ours, which runs one optimizer step and
hands it back, then to TRL's, and so on, so a drift of the machine's speed (seconds to minutes
here) hits both trainers' steps alike; a worker that has made its last step exits before the other
runs again. ``--interleave runs`` runs one whole worker after the other instead. A step's time is
the wall-clock interval from the moment its worker holds the baton (or, for ``runs``, from the
previous optimizer-step end) to its optimizer-step end (ours: the per-step metrics hook; TRL:
``on_step_end``), so it covers generation, rewards, reference and policy forwards, backward,
optimizer and logging; the first (warm-up) step is not counted. Peak
memory is that process's peak RSS during ``train()`` (VmHWM reset just before it) on the CPU, or
the allocator's peak on an accelerator. On the CPU each runs as a user gets it: ours with the fixed
glibc mmap threshold grpo_ascend sets (grpo_ascend.device; ``--host-malloc adaptive`` switches it off), TRL
with glibc's adaptive one.

The CPU may be shared: each step also records its process CPU time, and a step counts as
uncontended when CPU time >= 0.8 × threads × wall time (a preempted OpenMP thread stalls every
barrier of the step). The headline ratio uses the medians of the uncontended steps (all-step
medians, minima and CPU-time ratios are printed next to it); the load average is printed too.

MFU: our step's model FLOPs over the best fp32 (or bf16) ``torch.mm`` rate measured in the same
process with the same thread count. With ``P`` the weights of every matmul (the base's linear
layers, the LoRA A/B matrices and the tied output head; embeddings are lookups), ``P_base`` the
frozen part, ``Lp`` the prompt's real tokens and ``Lc`` the completion tokens, for 4 prompts × G=8
the step needs ``T = 4·Lp + 32·Lc`` token positions (a group's prompt once, every completion):

* generation: ``2·P·T`` (one shared prefill per prompt, then one token per row),
* reference forward + policy forward: ``2 · 2·P·T``,
* backward: ``2·P_base·T`` (input gradients only through the frozen weights) plus ``4·P_lora·T``
  (input and weight gradients of the LoRA matrices).

A trainer that runs each row's prompt again (TRL does, in its log-prob forwards) computes more
than this; those FLOPs are not counted as useful. Attention score/value products are left out
(under 2% at these lengths), as are padding positions.

Examples::

    python bench/bench_trainer.py                      # CPU, fp32, 2 threads, 1 warm-up + 3 steps, 2 repeats
    python bench/bench_trainer.py --threads 1 --repeats 3
    python bench/bench_trainer.py --max-operand 20 --length-bucket 64  # 63-65-token prompts straddle the bucket
    python bench/bench_trainer.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMPLS = ("ours", "trl")


@dataclass
class Settings:
    """What both workers run with (passed to them as JSON)."""

    device: str = "cpu"
    dtype: str = "fp32"
    threads: int = 2
    model_config: str = "small"
    prompts_per_step: int = 4
    num_generations: int = 8
    micro_batch: int = 8
    grad_accum: int = 4
    new_tokens: int = 64
    beta: float = 0.04
    loss_type: str = "dapo"
    learning_rate: float = 1e-5
    lora_r: int = 16
    lora_alpha: int = 32
    warmup_steps: int = 1
    steps: int = 3
    lengths: str = "fixed"
    length_bucket: int | None = None
    dataset_size: int = 256
    max_operand: int = 10
    seed: int = 0
    host_malloc: str = "tuned"
    isa: str = "native"


# ------------------------------------------------------------------------------ shared pieces
def rule_reward(prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any) -> list[float]:
    """A cheap rule reward in TRL's signature: share of digit characters, +1 if the answer appears."""
    answers = kwargs.get("answer") or [None] * len(completions)
    scores = []
    for completion, answer in zip(completions, answers):
        text = completion if isinstance(completion, str) else "".join(m.get("content") or "" for m in completion)
        digits = sum(ch.isdigit() for ch in text) / max(1, len(text))
        scores.append(digits + (1.0 if answer is not None and f"<answer>{answer}</answer>" in text else 0.0))
    return scores


def lora_config(s: Settings) -> Any:
    """LoRA on every linear layer except the output head (the same object type for both trainers)."""
    from peft import LoraConfig

    return LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def dataset(s: Settings) -> Any:
    """The built-in arithmetic task: conversational prompts of nearly equal length, an ``answer`` column."""
    from grpo_ascend.data.synthetic import arithmetic_dataset

    return arithmetic_dataset(n=s.dataset_size, seed=s.seed, max_operand=s.max_operand)


def prompt_tokens(tokenizer: Any, ds: Any) -> float:
    """Mean real token count of the rendered prompts (chat template + generation prompt)."""
    lens = []
    for messages in ds["prompt"]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        lens.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return statistics.fmean(lens)


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in KiB; 0 where unavailable."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass


def matmul_peak(dtype: Any, device: Any, n: int = 2048, reps: int = 5) -> float:
    """Best FLOP/s of an ``n×n @ n×n`` torch.mm in this process (current thread count)."""
    import torch

    from grpo_ascend import device as dev

    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    dev.synchronize(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        dev.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def matmul_params(model: Any) -> tuple[int, int]:
    """(all matmul weights, LoRA weights) of a model: every nn.Linear, the tied head counted once more."""
    from torch import nn

    total = lora = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()
            if "lora_" in name:
                lora += module.weight.numel()
    return total, lora


def model_flops(s: Settings, p_all: int, p_lora: int, lp: float, lc: float) -> float:
    """Model FLOPs of one optimizer step; see the module docstring for the formula."""
    positions = s.prompts_per_step * lp + s.prompts_per_step * s.num_generations * lc
    generation = 2 * p_all * positions
    forwards = 2 * (2 * p_all * positions)
    backward = 2 * (p_all - p_lora) * positions + 4 * p_lora * positions
    return generation + forwards + backward


# ------------------------------------------------------------------------------ workers
def _setup(s: Settings, impl: str) -> tuple[Any, Any, Any]:
    import torch

    from grpo_ascend import device as dev
    from grpo_ascend.device import host_allocator
    from grpo_ascend.models.tiny_model import build_tiny_model

    torch.set_num_threads(s.threads)
    if impl == "trl" or s.host_malloc == "adaptive":  # glibc's adaptive mmap threshold, as TRL runs
        host_allocator.fix_mmap_threshold = lambda *args, **kwargs: None
    device = dev.resolve_device(s.device)
    if s.model_config.startswith("qwen2.5-"):  # bench_real_shape's random-weight real-shape models
        from bench_real_shape import build_real_shape_model as build
    elif s.model_config.startswith("random-"):  # bench_random_model's random-weight models
        from bench_random_model import build_random_model as build
    else:
        build = build_tiny_model
    return device, build(s.model_config), torch


def _finish_memory(device: Any, before_train_hwm_kib: int, rss_before_kib: int) -> dict[str, float]:
    from grpo_ascend import device as dev

    out = {
        "peak_rss_train_mib": status_kib("VmHWM") / 1024,
        "peak_rss_life_mib": max(before_train_hwm_kib, status_kib("VmHWM")) / 1024,
        "rss_before_train_mib": rss_before_kib / 1024,
    }
    if dev.is_accelerator(device):
        out["device_peak_mib"] = dev.memory_stats(device)["peak"] / 2**20
    return out


BATON_ENV = "GRPO_BENCH_BATON"  # "<read fd>,<write fd>" of a lockstep worker's pipes to the driver


class StepClock:
    """Wall and CPU stamps of each optimizer step's start and end.

    Alone, a step starts where the previous one ended. In lockstep (``BATON_ENV`` set by the
    driver) the worker reports ``r`` when set up and ``d`` after each step, and each step starts
    when the driver's byte arrives, so the time another worker holds the machine is not counted.
    """

    def __init__(self, total_steps: int) -> None:
        self.total = total_steps
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        fds = os.environ.get(BATON_ENV)
        self.baton = tuple(int(fd) for fd in fds.split(",")) if fds else None

    def _hand_over(self, message: bytes, then_wait: bool) -> None:
        if self.baton is None:
            return
        os.write(self.baton[1], message)
        if then_wait and os.read(self.baton[0], 1) != b"g":
            raise SystemExit("the benchmark driver went away")

    def _start(self) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def begin(self) -> None:
        """Before ``train()``: wait for the first turn."""
        self._hand_over(b"r", then_wait=True)
        self._start()

    def step_end(self) -> None:
        """At an optimizer-step end: stamp it, and in lockstep hand the machine over until the next turn."""
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        more = len(self.ends) < self.total
        self._hand_over(b"d", then_wait=more)
        if more:
            self._start()

    def steps(self, warmup: int) -> tuple[float, list[float], list[float]]:
        """(warm-up wall s, timed steps' wall s, timed steps' CPU s)."""
        wall = [e - b for b, e in zip(self.starts, self.ends)]
        cpu = [e - b for b, e in zip(self.cpu_starts, self.cpu_ends)]
        return sum(wall[:warmup]), wall[warmup:], cpu[warmup:]


def _span_medians(spans: list[tuple[float, str, float]], ends: list[float], warmup: int) -> dict[str, float]:
    """Median per timed step of the summed durations of each named span (TRL's profiling blocks)."""
    per_step: list[dict[str, float]] = [{} for _ in ends]
    for stamp, name, duration in spans:
        step = next((i for i, end in enumerate(ends) if stamp <= end), None)
        if step is not None and step >= warmup:
            per_step[step][name] = per_step[step].get(name, 0.0) + duration
    names = sorted({n for d in per_step[warmup:] for n in d})
    return {n: statistics.median(d.get(n, 0.0) for d in per_step[warmup:]) for n in names}


def measured_train(trainer: Any, device: Any, s: Settings, profile: str | None,
                    clock: StepClock) -> tuple[dict[str, Any], float, list[float]]:
    """Run ``trainer.train()`` (under cProfile if asked) measuring peak memory and the steps that
    ``clock`` stamps; returns (memory and CPU-time result, warm-up s, timed steps' s)."""
    from grpo_ascend import device as dev

    rss_before, hwm_before = status_kib("VmRSS"), status_kib("VmHWM")
    _reset_peak_rss()
    dev.reset_peak_memory(device)
    clock.begin()
    if profile:
        import cProfile

        cProfile.runctx("trainer.train()", globals(), {"trainer": trainer}, profile)
    else:
        trainer.train()
    result = _finish_memory(device, hwm_before, rss_before)
    warmup, gaps, result["cpu_step_s"] = clock.steps(s.warmup_steps)
    return result, warmup, gaps


def run_ours(s: Settings, out_dir: Path, profile: str | None) -> dict[str, Any]:
    """Train with grpo_ascend's GRPOTrainer; return timings, memory and the FLOP inputs."""
    device, model_dir, torch = _setup(s, "ours")
    from machine import describe
    from transformers import AutoTokenizer

    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend.tracking.run_tracker import read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ds = dataset(s)
    cfg = GRPOConfig(
        output_dir=str(out_dir), device=s.device, seed=s.seed, max_steps=s.warmup_steps + s.steps,
        per_device_train_batch_size=s.micro_batch, gradient_accumulation_steps=s.grad_accum,
        num_generations=s.num_generations, max_completion_length=s.new_tokens, temperature=1.0,
        beta=s.beta, loss_type=s.loss_type, learning_rate=s.learning_rate, bf16=s.dtype == "bf16",
        length_bucket=s.length_bucket, save_steps=0, log_completions_steps=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[rule_reward], args=cfg, train_dataset=ds,
                          processing_class=tokenizer, peft_config=lora_config(s))
    if s.lengths == "fixed":
        trainer.rollout.params.ignore_eos = True
    clock = StepClock(s.warmup_steps + s.steps)
    record_step = trainer.recorder.step

    def timed_record_step(*args: Any, **kwargs: Any) -> None:
        record_step(*args, **kwargs)
        clock.step_end()

    trainer.recorder.step = timed_record_step  # type: ignore[method-assign]
    result, warmup, gaps = measured_train(trainer, device, s, profile, clock)
    records = read_jsonl(out_dir / "metrics.jsonl")[s.warmup_steps:]
    phases = {}
    phase_keys = [k for k in records[0] if k == "time/step" or k.startswith(("time/", "memory/peak_gb/"))]
    for key in phase_keys:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            phases[key] = statistics.median(values)
    p_all, p_lora = matmul_params(trainer.policy)
    mm_dtype = torch.bfloat16 if s.dtype == "bf16" else torch.float32
    result.update(
        warmup_s=warmup, step_s=gaps, phases=phases, threads=torch.get_num_threads(),
        completion_len=statistics.fmean(r["completion_length/mean"] for r in records),
        prompt_len=prompt_tokens(tokenizer, ds), p_all=p_all, p_lora=p_lora,
        matmul_peak=matmul_peak(mm_dtype, device), machine=describe(torch.get_num_threads()),
    )
    return result


def run_trl(s: Settings, out_dir: Path, profile: str | None) -> dict[str, Any]:
    """Train with TRL's GRPOTrainer (transformers ``generate``, no vLLM); return timings and memory."""
    device, model_dir, torch = _setup(s, "trl")
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_ascend import device as dev

    clock = StepClock(s.warmup_steps + s.steps)

    class StepEnds(TrainerCallback):
        """Optimizer-step ends, to the step clock."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            dev.synchronize(device)
            clock.step_end()

    import trl.extras.profiling as trl_profiling

    spans: list[tuple[float, str, float]] = []

    def record(ctx: Any, duration: float) -> None:
        spans.append((time.perf_counter(), ctx.name, duration))

    trl_profiling.ProfilingContext._log_metrics = record  # type: ignore[method-assign]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ds = dataset(s)
    generation_kwargs = {"min_new_tokens": s.new_tokens} if s.lengths == "fixed" else None
    cfg = GRPOConfig(
        output_dir=str(out_dir), use_cpu=dev.device_type(device) == "cpu", seed=s.seed,
        max_steps=s.warmup_steps + s.steps, per_device_train_batch_size=s.micro_batch,
        gradient_accumulation_steps=s.grad_accum, num_generations=s.num_generations,
        max_completion_length=s.new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=s.beta,
        loss_type=s.loss_type, learning_rate=s.learning_rate, bf16=s.dtype == "bf16", fp16=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32},
        generation_kwargs=generation_kwargs, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False, lr_scheduler_type="linear",
        max_grad_norm=1.0, optim="adamw_torch",
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[rule_reward], args=cfg, train_dataset=ds,
                          processing_class=tokenizer, peft_config=lora_config(s), callbacks=[StepEnds()])
    result, warmup, gaps = measured_train(trainer, device, s, profile, clock)
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r][s.warmup_steps:]
    result.update(
        warmup_s=warmup, step_s=gaps, phases=_span_medians(spans, clock.ends, s.warmup_steps),
        threads=torch.get_num_threads(), trl_version=trl.__version__,
        completion_len=statistics.fmean(r["completions/mean_length"] for r in logs) if logs else float("nan"),
    )
    return result


# ------------------------------------------------------------------------------ driver
@dataclass
class Worker:
    """One worker's command line, environment and files."""

    impl: str
    cmd: list[str]
    env: dict[str, str]
    out: Path
    log: Path

    def failed(self, code: int | None) -> SystemExit:
        tail = "".join(self.log.read_text().splitlines(keepends=True)[-30:])
        return SystemExit(f"{self.impl} worker failed (exit {code}); log {self.log}:\n{tail}")


def make_worker(impl: str, s: Settings, python: str, log_dir: Path, index: int, mmap_threshold: int,
                script: Path | None = None) -> Worker:
    """A worker in a fresh process with the thread count (and malloc setting) fixed in its environment;
    ``script``: the benchmark whose ``--worker`` it runs (default this one; ``s`` is any dataclass with
    ``threads``, ``isa``, ``warmup_steps`` and ``steps``)."""
    out = log_dir / f"{impl}-{index}.json"
    from machine import isa_environment

    env = dict(os.environ, OMP_NUM_THREADS=str(s.threads), MKL_NUM_THREADS=str(s.threads), **isa_environment(s.isa))
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    cmd = [python, str(script or Path(__file__).resolve()), "--worker", impl, "--settings", json.dumps(asdict(s)),
           "--result", str(out)]
    return Worker(impl, cmd, env, out, log_dir / f"{impl}-{index}.log")


def spawn(impl: str, s: Settings, python: str, log_dir: Path, index: int, mmap_threshold: int = 0) -> dict[str, Any]:
    """Run one worker to its end, alone."""
    w = make_worker(impl, s, python, log_dir, index, mmap_threshold)
    with open(w.log, "w") as handle:
        proc = subprocess.run(w.cmd, env=w.env, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise w.failed(proc.returncode)
    return json.loads(w.out.read_text())


def spawn_lockstep(s: Settings, python: str, log_dir: Path, index: int,
                   mmap_threshold: int = 0, script: Path | None = None) -> dict[str, dict[str, Any]]:
    """Run ours and TRL's workers together, one optimizer step at a time in turn (see StepClock)."""
    workers = [make_worker(impl, s, python, log_dir, index, mmap_threshold, script=script) for impl in IMPLS]
    procs, pipes, handles = {}, {}, []
    try:
        for w in workers:
            to_worker, from_driver = os.pipe()
            to_driver, from_worker = os.pipe()
            env = dict(w.env, **{BATON_ENV: f"{to_worker},{from_worker}"})
            handle = open(w.log, "w")
            handles.append(handle)
            procs[w.impl] = subprocess.Popen(w.cmd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                             pass_fds=(to_worker, from_worker))
            os.close(to_worker)
            os.close(from_worker)
            pipes[w.impl] = (from_driver, to_driver)  # the driver writes the first, reads the second

        def expect(w: Worker, message: bytes) -> None:
            if os.read(pipes[w.impl][1], 1) != message:
                raise w.failed(procs[w.impl].wait())

        for w in workers:
            expect(w, b"r")
        left = {w.impl: s.warmup_steps + s.steps for w in workers}
        while any(left.values()):
            for w in workers:
                if not left[w.impl]:
                    continue
                os.write(pipes[w.impl][0], b"g")
                expect(w, b"d")
                left[w.impl] -= 1
                if not left[w.impl] and procs[w.impl].wait() != 0:  # its wind-down overlaps no step
                    raise w.failed(procs[w.impl].returncode)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for fd in (fd for pair in pipes.values() for fd in pair):
            os.close(fd)
        for handle in handles:
            handle.close()
    return {w.impl: json.loads(w.out.read_text()) for w in workers}


def worker_main(impl: str, settings: str, result: str, profile: str | None) -> None:
    s = Settings(**json.loads(settings))
    with tempfile.TemporaryDirectory(prefix=f"bench-{impl}-") as tmp:
        fn = run_ours if impl == "ours" else run_trl
        data = fn(s, Path(tmp), profile)
    Path(result).write_text(json.dumps(data))


def fmt_gib(mib: float) -> str:
    return f"{mib / 1024:.2f}"


def _median_steps(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median([t for r in runs for t in r[key]])


def uncontended(runs: list[dict[str, Any]], threads: int) -> list[float]:
    """Wall times of steps whose CPU time kept ``threads`` cores busy (CPU/wall >= 0.8 × threads).

    A step slowed by other processes shows it: with one thread it waits (CPU < wall); with more,
    OpenMP barriers stall on a preempted thread (CPU/wall falls towards 1).
    """
    return [w for r in runs for w, c in zip(r["step_s"], r["cpu_step_s"]) if c >= 0.8 * threads * w]


def report(s: Settings, runs: dict[str, list[dict[str, Any]]], loads: list[tuple[float, float, float]]) -> None:
    """Print the summary table and the lines that explain it."""
    wall = {impl: _median_steps(runs[impl], "step_s") for impl in IMPLS}
    cpu = {impl: _median_steps(runs[impl], "cpu_step_s") for impl in IMPLS}
    clean = {impl: uncontended(runs[impl], s.threads) for impl in IMPLS}
    total = {impl: sum(len(r["step_s"]) for r in runs[impl]) for impl in IMPLS}
    best = {impl: min(t for r in runs[impl] for t in r["step_s"]) for impl in IMPLS}
    ours = runs["ours"]
    flops = model_flops(s, ours[0]["p_all"], ours[0]["p_lora"], ours[0]["prompt_len"],
                        statistics.fmean(r["completion_len"] for r in ours))
    peak = statistics.median(r["matmul_peak"] for r in ours)
    per_repeat = [statistics.median(o["step_s"]) / statistics.median(t["step_s"]) for o, t in zip(ours, runs["trl"])]
    enough = all(len(clean[impl]) >= 3 for impl in IMPLS)
    headline = {impl: statistics.median(clean[impl]) if enough else wall[impl] for impl in IMPLS}
    ratio = headline["ours"] / headline["trl"]
    mem_key = "device_peak_mib" if "device_peak_mib" in ours[0] else "peak_rss_train_mib"
    mem = {impl: max(r[mem_key] for r in runs[impl]) for impl in IMPLS}
    life = {impl: max(r["peak_rss_life_mib"] for r in runs[impl]) for impl in IMPLS}
    base = {impl: statistics.median(r["rss_before_train_mib"] for r in runs[impl]) for impl in IMPLS}
    lens = {impl: statistics.fmean(r["completion_len"] for r in runs[impl]) for impl in IMPLS}

    print()
    mem_label = "device peak GiB" if mem_key == "device_peak_mib" else "peak RSS in train() GiB"
    print("| trainer | s/step, uncontended steps (median) | ratio ours/TRL | s/step, all steps (median) | s/step min "
          f"| CPU s/step (median) | {mem_label} | peak RSS whole process GiB | RSS before train() GiB "
          "| completion tokens | MFU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for impl in IMPLS:
        name = "grpo_ascend" if impl == "ours" else f"TRL {runs['trl'][0]['trl_version']}"
        r = f"{ratio:.3f}" if impl == "ours" else ""
        c = f"{statistics.median(clean[impl]):.2f} ({len(clean[impl])}/{total[impl]})" if clean[impl] else "none"
        mfu = flops / headline[impl] / peak
        print(f"| {name} | {c} | {r} | {wall[impl]:.2f} | {best[impl]:.2f} | {cpu[impl]:.2f} | {fmt_gib(mem[impl])} "
              f"| {fmt_gib(life[impl])} | {fmt_gib(base[impl])} | {lens[impl]:.1f} | {100 * mfu:.1f}% |")
    print()
    basis = "uncontended-step medians" if enough else "all-step medians (fewer than 3 uncontended steps: too noisy)"
    print(f"ratio ours/TRL: {ratio:.3f} from {basis}; all-step medians {wall['ours'] / wall['trl']:.3f}, minima "
          f"{best['ours'] / best['trl']:.3f}, CPU time {cpu['ours'] / cpu['trl']:.3f}, per repeat (all steps) "
          f"{', '.join(f'{x:.3f}' for x in per_repeat)}")
    print(f"targets: step time <= 0.65x TRL's: {'met' if ratio <= 0.65 else 'NOT met'}; peak memory ours/TRL "
          f"{mem['ours'] / mem['trl']:.2f} (<= 1: {'met' if mem['ours'] <= mem['trl'] else 'NOT met'})")
    for impl in IMPLS:
        keys = sorted({k for r in runs[impl] for k in r["phases"]})
        phases = {k: statistics.median(r["phases"].get(k, 0.0) for r in runs[impl]) for k in keys}
        label = "ours (metrics.jsonl)" if impl == "ours" else "TRL (its profiling blocks, nested)"
        times = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if not k.startswith("memory/"))
        print(f"{label}, median s per timed step: {times}")
        peaks = ", ".join(f"{k.rsplit('/', 1)[1]} {v:.2f}" for k, v in phases.items() if k.startswith("memory/"))
        if peaks:
            print(f"{label}, peak GiB per phase (memory/peak_gb, median over runs): {peaks}")
    print(f"model FLOPs per step {flops / 1e9:.1f} GFLOP (P={ours[0]['p_all'] / 1e6:.2f}M matmul weights, "
          f"P_lora={ours[0]['p_lora'] / 1e6:.2f}M, Lp={ours[0]['prompt_len']:.1f}, "
          f"Lc={lens['ours']:.1f}); measured {s.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s "
          f"at {ours[0]['threads']} thread(s); MFU = FLOPs / (headline s/step × peak)")
    print(f"machine: {ours[0]['machine']}")
    print("load average (1, 5, 15 min) before each run (each repeat when interleaved by step): " + "; ".join(f"{a:.2f} {b:.2f} {c:.2f}" for a, b, c in loads))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, npu or auto (default cpu)")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                        help="fp32 (CPU default) or bf16 autocast (accelerator default)")
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads for both trainers")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run, after the warm-up")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs per trainer")
    parser.add_argument("--interleave", default="steps", choices=["steps", "runs"],
                        help="steps: each repeat's two workers take turns one optimizer step at a time (default); "
                        "runs: one whole run after the other")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--loss-type", default="dapo", choices=["dapo", "grpo", "bnpo", "dr_grpo"])
    parser.add_argument("--lengths", default="fixed", choices=["fixed", "natural"],
                        help="fixed: every completion has --new-tokens tokens on both; natural: stop at EOS")
    parser.add_argument("--length-bucket", type=int, default=None,
                        help="our length_bucket (default: the config's, exact lengths off NPU and 64 on NPU)")
    parser.add_argument("--model-config", default="small",
                        help="tiny or small (built-in), qwen2.5-0.5b-<N>l (bench_real_shape.py's) or random-25m "
                        "(bench_random_model.py's)")
    parser.add_argument("--prompts-per-step", type=int, default=4,
                        help="prompts per optimizer step (G=8 completions each)")
    parser.add_argument("--micro-batch", type=int, default=Settings.micro_batch,
                        help="completions per micro-batch on both (per_device_train_batch_size; default 8, TRL's)")
    parser.add_argument("--max-operand", type=int, default=10,
                        help="arithmetic operands below this: 10 gives 63-token prompts, 20 gives 63-65")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0,
                        help="glibc MALLOC_MMAP_THRESHOLD_ for the workers (e.g. 131072): large tensors are then "
                        "mmapped and returned on free, so peak RSS tracks live memory instead of heap retention")
    parser.add_argument("--host-malloc", default="tuned", choices=["tuned", "adaptive"],
                        help="ours only (TRL always runs with glibc's): tuned = the fixed glibc mmap threshold "
                        "grpo_ascend sets on the CPU (grpo_ascend.device), adaptive = glibc's own adaptive one")
    parser.add_argument("--isa", default="native", choices=["native", "avx2"],
                        help="avx2: cap torch's kernels at AVX2 on an AVX-512 machine (bench/machine.py)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the workers (needs trl)")
    parser.add_argument("--keep-logs", default=None, help="folder for worker logs/results (default: a temp dir)")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default=None, help="worker only: write a cProfile of train() here")
    args = parser.parse_args(argv)

    if args.worker:
        worker_main(args.worker, args.settings, args.result, args.profile)
        return
    if args.python == sys.executable:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            raise SystemExit("TRL is not installed here: pip install -e '.[bench]' (or pass --python PATH)")
    from grpo_ascend import device as dev

    accelerator = dev.is_accelerator(dev.resolve_device(args.device))
    s = Settings(
        device=args.device, dtype=args.dtype or ("bf16" if accelerator else "fp32"), threads=args.threads,
        model_config=args.model_config, new_tokens=args.new_tokens, loss_type=args.loss_type,
        warmup_steps=args.warmup_steps, steps=args.steps, lengths=args.lengths, length_bucket=args.length_bucket,
        max_operand=args.max_operand, prompts_per_step=args.prompts_per_step, host_malloc=args.host_malloc, isa=args.isa,
        micro_batch=args.micro_batch, grad_accum=args.prompts_per_step * Settings.num_generations // args.micro_batch,
    )
    print(f"GRPO step, {s.model_config} model, {s.dtype} on {s.device}, {s.threads} thread(s): "
          f"{s.prompts_per_step} prompts × G={s.num_generations} = {s.micro_batch * s.grad_accum} completions per "
          f"optimizer step ({s.grad_accum} micro-batches of {s.micro_batch}), {s.new_tokens} new tokens "
          f"({s.lengths} lengths), beta={s.beta}, loss_type={s.loss_type}, LoRA r={s.lora_r} all-linear; "
          f"{s.warmup_steps} warm-up + {s.steps} timed steps per run, {args.repeats} run(s) each, interleaved by "
          f"{args.interleave[:-1]}; "
          f"our length_bucket {s.length_bucket or 'config default'}; malloc mmap threshold "
          f"{args.malloc_mmap_threshold or 'not exported'}, host malloc {s.host_malloc}", flush=True)
    log_dir = Path(args.keep_logs) if args.keep_logs else Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in IMPLS}
    loads: list[tuple[float, float, float]] = []
    for rep in range(args.repeats):
        if args.interleave == "steps":
            loads.append(os.getloadavg())
            results = spawn_lockstep(s, args.python, log_dir, rep, args.malloc_mmap_threshold)
        else:
            results = {}
            for impl in IMPLS:
                loads.append(os.getloadavg())
                results[impl] = spawn(impl, s, args.python, log_dir, rep, args.malloc_mmap_threshold)
        for impl in IMPLS:
            r = results[impl]
            runs[impl].append(r)
            print(f"  [{impl} run {rep + 1}] warm-up {r['warmup_s']:.2f} s, steps "
                  f"{', '.join(f'{t:.2f}' for t in r['step_s'])} s wall, "
                  f"{', '.join(f'{t:.2f}' for t in r['cpu_step_s'])} s CPU; load {loads[-1][0]:.2f}", flush=True)
    report(s, runs, loads)


if __name__ == "__main__":
    main()
