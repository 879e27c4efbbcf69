"""``grpo-ascend smoke``: doctor's facts, then every check of :data:`CHECKS` in order within ``--budget`` seconds,
then ``smoke_report.json`` + ``smoke_report.md`` in ``--out``. Exit code 1 when a check failed."""

from __future__ import annotations

import argparse
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

from grpo_ascend import device as dev
from grpo_ascend.device.doctor import doctor_report
from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.smoke.context import SmokeContext
from grpo_ascend.smoke.ddp_check import check_ddp
from grpo_ascend.smoke.report import CheckResult, write_report
from grpo_ascend.smoke.rollout_check import check_rollout
from grpo_ascend.smoke.training_check import check_builtin_training, check_user_training
from grpo_ascend.smoke.transfer_check import check_server_transfer, check_transfer
from grpo_ascend.smoke.vllm_check import check_vllm

logger = logging.getLogger(__name__)

#: name -> check, run in this order (docs/ascend.md explains each line of the report).
CHECKS: dict[str, Callable[[SmokeContext], CheckResult]] = {
    "rollout": check_rollout,
    "train_builtin": check_builtin_training,
    "train_model": check_user_training,
    "vllm": check_vllm,
    "transfer": check_transfer,
    "transfer_server": check_server_transfer,
    "ddp": check_ddp,
}
DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``grpo-ascend smoke``."""
    parser.add_argument("--model", default=None, help="a model folder (or hub id) to train for a few steps too")
    parser.add_argument("--device", default="auto", help="auto, cpu or an accelerator, as in recipes (default auto)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                        help="auto: bf16 on an accelerator that supports it, else fp32")
    parser.add_argument("--out", default="outputs/smoke", help="folder for the report and the runs (default outputs/smoke)")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per training check (default 5)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens per completion in the rollout checks")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds for the whole run; checks not started by then are skipped (default 300)")
    parser.add_argument("--vllm-server", default="",
                        help="comma-separated vLLM server URLs (our entry point) to check a weight-transfer round trip with")
    parser.add_argument("--skip", default="", help=f"comma-separated checks to skip, of {', '.join(CHECKS)}")


def _skipped(value: str) -> set[str]:
    names = {name.strip() for name in value.split(",") if name.strip()}
    for name in names:
        if name not in CHECKS:
            raise ConfigError(f"--skip {name!r} is not a check{closest(name, CHECKS)}; expected some of {list(CHECKS)}")
    return names


def _context(args: argparse.Namespace) -> SmokeContext:
    if args.steps < 1 or args.new_tokens < 1 or args.budget <= 0:
        raise ConfigError(f"--steps ({args.steps}), --new-tokens ({args.new_tokens}) and --budget ({args.budget}) "
                          "must be positive")
    device = dev.resolve_device(args.device)
    dtype = DTYPES[args.dtype] or ("bfloat16" if dev.is_accelerator(device) and dev.bf16_supported(device) else "float32")
    if dtype == "bfloat16" and not dev.bf16_supported(device):
        raise ConfigError(f"--dtype bf16 is not supported on {device}; use --dtype fp32")
    return SmokeContext(device=device, dtype=dtype, out=Path(args.out), model=args.model, steps=args.steps,
                        new_tokens=args.new_tokens, deadline=time.monotonic() + args.budget,
                        servers=[u.strip().rstrip("/") for u in args.vllm_server.split(",") if u.strip()])


def run_checks(ctx: SmokeContext, skip: set[str] = frozenset()) -> list[CheckResult]:
    """Every check in order; one that raises is 'failed' with the error, one after the deadline 'skipped'."""
    results = []
    for name, check in CHECKS.items():
        start = time.monotonic()
        if name in skip:
            result = CheckResult(name, "skipped", "skipped", reason="--skip")
        elif ctx.seconds_left() <= 0:
            result = CheckResult(name, "skipped", "not started", reason="the --budget was spent")
        else:
            logger.info("smoke: %s", name)
            try:
                result = check(ctx)
            except Exception as exc:  # the report says what broke; the other checks still run
                logger.exception("smoke check %s failed", name)
                result = CheckResult(name, "failed", "raised", reason=f"{type(exc).__name__}: {exc}".splitlines()[0])
        result.seconds = time.monotonic() - start
        results.append(result)
    return results


def run(args: argparse.Namespace) -> int:
    """Entry point of ``grpo-ascend smoke``: 0 when no check failed, 1 otherwise."""
    skip = _skipped(args.skip)
    started = time.monotonic()
    ctx = _context(args)
    doctor = doctor_report(None)
    results = run_checks(ctx, skip)
    header = {"device": f"{ctx.device} ({doctor['device_name'] or 'host CPU'}, {doctor['device_count']} visible)",
              "dtype": ctx.dtype, "python": platform.python_version(),
              **{name: version or "n/a" for name, version in doctor["software"].items()},
              **{name: line for name, line in doctor["stack"].items()},
              "wall time": f"{time.monotonic() - started:.0f} s of a {args.budget:g} s budget"}
    json_path, md_path = write_report(ctx.out, results, doctor, header)
    print(md_path.read_text())
    print(f"report: {json_path} and {md_path} (attach both to a bug report)")
    failed = [r.name for r in results if r.status == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)} (docs/ascend.md#grpo-ascend-smoke-check-a-node says what each means)")
    return 1 if failed else 0
