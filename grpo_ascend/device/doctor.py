"""``grpo-ascend doctor``: versions and whether they form a supported set, the device, collective timeouts and
runtime environment, as text or JSON.

The facts come from :mod:`grpo_ascend.device.doctor_facts`; this module builds the report and lays
it out. It imports torch only inside :func:`run`, in a try, and the facts (which need torch) only
inside :func:`doctor_report`: from torch 2.5 on, ``import torch`` loads every device backend
extension registered under the ``torch.backends`` entry point, and one whose libraries cannot
load makes ``import torch`` itself fail, which is exactly what doctor must explain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib import metadata
from typing import Any

from grpo_ascend.errors import ConfigError

PACKAGES = ("transformers", "peft", "accelerate", "datasets")
#: The entry-point group torch (>= 2.5) loads at ``import torch`` unless TORCH_DEVICE_BACKEND_AUTOLOAD=0.
BACKEND_ENTRY_POINTS = "torch.backends"
#: Where the Ascend CANN toolkit's environment script usually is.
CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
#: Variables that decide whether and how torch loads a backend extension.
_IMPORT_ENV = ("TORCH_DEVICE_BACKEND_AUTOLOAD", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "LD_LIBRARY_PATH")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``grpo-ascend doctor`` (no torch import: it may be what is broken)."""
    parser.add_argument(
        "--device",
        default=None,
        help="check that this device is usable (auto, cpu or an accelerator type, optionally with an index such "
        "as TYPE:0); exit 2 if it is not",
    )
    parser.add_argument("--ddp_timeout", type=int, default=1800,
                        help="the run's ddp_timeout in seconds, to show the collective timeouts it leads to (default 1800)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _base_report(device: str | None) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "grpo-ascend": _version("grpo-ascend"),
        "packages": {name: _version(name) for name in PACKAGES},
        "requested_device": device,
    }


def backend_extensions() -> list[dict[str, str | None]]:
    """Device backend extensions registered with torch's autoload entry point (name, package, version)."""
    found = []
    for entry in metadata.entry_points(group=BACKEND_ENTRY_POINTS):
        dist = getattr(entry, "dist", None)
        found.append({
            "name": entry.name,
            "target": entry.value,
            "package": dist.metadata["Name"] if dist is not None else None,
            "version": dist.version if dist is not None else None,
        })
    return found


def torch_import_report(error: BaseException, device: str | None = None) -> dict[str, Any]:
    """What doctor can say when ``import torch`` fails: the error, its cause, the autoloaded extensions, fixes."""
    cause = error.__cause__ or error.__context__
    torch_version = _version("torch")
    extensions = backend_extensions()
    fixes = [
        f"load the accelerator toolkit's libraries before starting Python: `source {CANN_SET_ENV}` (the set_env.sh "
        "of your CANN toolkit)",
        "on a machine without that accelerator, start torch without autoloading device extensions: "
        "`export TORCH_DEVICE_BACKEND_AUTOLOAD=0`",
    ]
    for extension in extensions:
        if extension["package"] and torch_version:
            base = torch_version.split("+", 1)[0]
            fixes.append(f"install the {extension['package']} release built for torch {base} (installed: "
                         f"{extension['version']}): `pip install \"{extension['package']}=={base}.*\"`")
    report = _base_report(device)
    report.update({
        "torch": torch_version,
        "torch_import_error": f"{type(error).__name__}: {error}",
        "torch_import_cause": f"{type(cause).__name__}: {cause}" if cause is not None else None,
        "backend_extensions": extensions,
        "env": {name: os.environ.get(name) for name in _IMPORT_ENV},
        "fixes": fixes,
    })
    return report


def doctor_report(device: str | None = None, ddp_timeout: int = 1800) -> dict[str, Any]:
    """Versions, device facts, collective timeouts and runtime environment.

    Raises DeviceError if ``device`` is given and unusable. torch must import (see :func:`run`).
    """
    from grpo_ascend.device import core, doctor_facts  # these import torch (see the module docstring)

    resolved = core.resolve_device(device) if device is not None else None
    facts = doctor_facts.device_facts(resolved)
    report = _base_report(device)
    report.update({
        "software": doctor_facts.software_versions(),
        "stack": doctor_facts.stack_facts(),
        **facts,
        "timeouts": doctor_facts.timeout_facts(facts["device"], ddp_timeout),
        "env": doctor_facts.runtime_environment(),
        "defaults_pending": doctor_facts.pending_runtime_defaults(ddp_timeout),
        "warnings": doctor_facts.accelerator_warnings(),
    })
    return report


def _gib(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def _layout(sections: dict[str, list[tuple[str, str]]], notes: list[str]) -> str:
    width = max(len(name) for rows in sections.values() for name, _ in rows) + 2
    lines: list[str] = []
    for title, rows in sections.items():
        lines += ["", title] if lines else [title]
        lines += [f"  {name.ljust(width)}{value}" for name, value in rows]
    return "\n".join(lines + notes)


def _software_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("python", report["python"]),
        ("grpo-ascend", report["grpo-ascend"] or "not installed (running from source)"),
        *((label, value or "n/a") for label, value in report["software"].items()),
        *((name, version or "not installed") for name, version in report["packages"].items()),
    ]


def _device_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    on_cpu = report["device_type"] == "cpu"
    if report["free_memory"] is None:
        memory = f"unknown ({report['memory_error']})" if report["memory_error"] else "unknown"
    else:
        where = " (host RAM)" if on_cpu else ""
        memory = f"{_gib(report['free_memory'])} free of {_gib(report['total_memory'])}{where}"
    rows = [
        ("device", report["device"]),
        ("device count", str(report["device_count"])),
        ("device name", report["device_name"] or ("host CPU" if on_cpu else "unknown")),
    ]
    if report["chip_family"]:
        rows.append(("chip family", report["chip_family"]))
    rows += [
        ("bf16 supported", "yes" if report["bf16_supported"] else "no"),
        ("dist backend", report["dist_backend"]),
        ("free memory", memory),
    ]
    if report["requested_device"] is not None:
        rows.insert(0, ("requested", f"{report['requested_device']} (usable)"))
    return rows


def _env_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    pending = report["defaults_pending"]
    rows = []
    for name, value in report["env"].items():
        if value is not None:
            rows.append((name, value))
        elif name in pending:
            rows.append((name, f"unset -> {pending[name]} when the run is on Ascend"))
        else:
            rows.append((name, "unset"))
    return rows


def format_doctor_report(report: dict[str, Any]) -> str:
    """Aligned, human-readable text for :func:`doctor_report` (or :func:`torch_import_report`)."""
    if "torch_import_error" in report:
        return _format_torch_import_report(report)
    sections = {
        "Software": _software_rows(report),
        "Version check (docs/ascend.md#versions)": list(report["stack"].items()),
        "Device": _device_rows(report),
        "Collective timeouts": list(report["timeouts"].items()),
        "Environment (Ascend / collectives / launcher)": _env_rows(report),
    }
    return _layout(sections, [f"\nwarning: {warning}" for warning in report["warnings"]])


def _format_torch_import_report(report: dict[str, Any]) -> str:
    software = [("python", report["python"]), ("torch", f"{report['torch'] or 'not installed'} - import failed")]
    software += [(name, version or "not installed") for name, version in report["packages"].items()]
    extensions = [(ext["name"], f"{ext['package'] or '?'} {ext['version'] or '?'} ({ext['target']})")
                  for ext in report["backend_extensions"]] or [("none", "no extension is registered")]
    sections = {
        "Software": software,
        f"Device extensions torch loads at import ({BACKEND_ENTRY_POINTS} entry points)": extensions,
        "Environment": [(name, value if value is not None else "unset") for name, value in report["env"].items()],
    }
    notes = [f"\nerror: `import torch` failed: {report['torch_import_error']}"]
    if report["torch_import_cause"]:
        notes.append(f"cause: {report['torch_import_cause']}")
    notes.append("fixes:")
    notes += [f"  - {fix}" for fix in report["fixes"]]
    return _layout(sections, notes)


def run(args: argparse.Namespace) -> int:
    """``grpo-ascend doctor``: 0 when torch imports, 1 when it does not (the report says why), 2 for an unusable --device."""
    if args.ddp_timeout <= 0:
        raise ConfigError(f"--ddp_timeout must be a positive number of seconds, got {args.ddp_timeout}")
    try:
        import torch  # noqa: F401  (autoloads device extensions; see the module docstring)
    except Exception as exc:  # RuntimeError("Failed to load the backend extension: ...") and the like
        report = torch_import_report(exc, args.device)
        status = 1
    else:
        report = doctor_report(args.device, args.ddp_timeout)
        status = 0
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_doctor_report(report))
    return status
