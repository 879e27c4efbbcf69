"""``grpo-ascend`` command line: a registry of subcommands, one line each.

Adding a command is one entry in :data:`COMMANDS`; its module is imported only when that
command runs (``lazy("package.module:function")``), so ``grpo-ascend --help`` stays fast and a
broken optional dependency of one command cannot break the others. User errors
(:class:`GrpoAscendError`, a missing file) print one line ``grpo-ascend: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_ascend.errors import GrpoAscendError

PROG = "grpo-ascend"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, how to add its arguments, and how to run it (returns an exit code)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def lazy(target: str) -> Callable[..., Any]:
    """A callable that imports ``'package.module:function'`` on first call and forwards to it."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"lazy target {target!r} must look like 'package.module:function'")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module_name), attribute)(*args, **kwargs)

    call.__name__ = attribute
    call.__qualname__ = target
    return call


def _version(dist_name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# registry and entry point
# --------------------------------------------------------------------------------------------

#: name -> Command. Add one line per subcommand, e.g.
#: "train": Command("train from a YAML recipe", lazy("grpo_ascend.train:add_arguments"), lazy("grpo_ascend.train:run")),
COMMANDS: dict[str, Command] = {
    "train": Command("train with GRPO or PPO from a YAML recipe, e.g. train recipes/default.yaml --max_steps 20",
                     lazy("grpo_ascend.run:add_train_arguments"), lazy("grpo_ascend.run:run_train")),
    "export": Command("export a checkpoint's LoRA adapter (PEFT format), or with --merge a full model", lazy("grpo_ascend.checkpoints.export:add_export_arguments"), lazy("grpo_ascend.checkpoints.export:run_export")),
    "plot": Command("plot reward, KL, completion length and step time of one or more runs to a PNG",
                    lazy("grpo_ascend.tracking.plot:add_plot_arguments"), lazy("grpo_ascend.tracking.plot:run_plot")),
    "build-tiny-model": Command("build the offline tiny/small Qwen2 model + tokenizer (cached) and print its folder",
                                lazy("grpo_ascend.models.tiny_model:add_build_arguments"), lazy("grpo_ascend.models.tiny_model:run_build")),
    "build-tiny-vlm": Command("build an offline tiny vision-language model (Qwen2.5-VL or LLaVA) + processor and print its folder",
                              lazy("grpo_ascend.models.tiny_vlm:add_build_arguments"), lazy("grpo_ascend.models.tiny_vlm:run_build")),
    "plan": Command("the memory a recipe needs per device, per phase, before launch (no weights loaded), e.g. plan "
                    "recipes/gsm8k_qwen.yaml --model-config recipes/model_configs/qwen2.5-7b.json --device-memory 64GiB",
                    lazy("grpo_ascend.planning.cli:add_plan_arguments"), lazy("grpo_ascend.planning.cli:run_plan")),
    "doctor": Command("report versions, the accelerator and its chip, bf16 support, collective timeouts, runtime env "
                      "vars and free memory", lazy("grpo_ascend.device.doctor:add_arguments"),
                      lazy("grpo_ascend.device.doctor:run")),
    "smoke": Command("check this node in minutes: doctor, rollout engine vs generate, GRPO steps with LoRA, vLLM "
                     "log-prob parity, two-device DDP; writes a JSON + markdown report, e.g. smoke --model PATH",
                     lazy("grpo_ascend.smoke.cli:add_arguments"), lazy("grpo_ascend.smoke.cli:run")),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s arguments are added (importing just its module)."""
    parser = argparse.ArgumentParser(prog=PROG, description="GRPO / PPO fine-tuning for causal LMs on Ascend NPUs, GPUs and CPUs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('grpo-ascend') or 'source'}")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="verbosity of grpo_ascend logs (default: info)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, spec in COMMANDS.items():
        sub = subparsers.add_parser(name, help=spec.help, description=spec.help)
        if name == command:
            spec.add_arguments(sub)
    return parser


def _error(message: str) -> None:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run ``grpo-ascend``; returns the exit code (2 for user errors, with a one-line message)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((token for token in args_list if token in COMMANDS), None)
    try:
        parser = build_parser(command)
        try:
            args = parser.parse_args(args_list)
        except SystemExit as exc:  # --help, --version, or an argparse usage error
            return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
        logging.getLogger("grpo_ascend").setLevel(args.log_level.upper())
        return int(COMMANDS[args.command].run(args) or 0)
    except GrpoAscendError as exc:
        _error(str(exc))
        return 2
    except FileNotFoundError as exc:
        _error(f"file not found: {exc.filename}" if exc.filename else str(exc))
        return 2
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
