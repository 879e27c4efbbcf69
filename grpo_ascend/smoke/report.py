"""The smoke report: one :class:`CheckResult` per check, written as ``smoke_report.json`` and ``smoke_report.md``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "failed", "skipped")


@dataclass
class CheckResult:
    """One line of the report: ``status`` ok / failed / skipped, a one-line ``summary``, the ``numbers`` behind
    it, and when it failed or was skipped, ``reason``."""

    name: str
    status: str
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status must be one of {STATUSES}, got {self.status!r}")


def _plain(value: Any) -> Any:
    """JSON-safe numbers: non-finite floats as strings ('nan', 'inf'), so the file stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def markdown(results: Sequence[CheckResult], header: dict[str, str]) -> str:
    """A short markdown report: the machine in a few bullet points, then one table row per check."""
    lines = ["# grpo-ascend smoke report", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "| check | status | result | seconds |", "|---|---|---|---|"]
    for result in results:
        text = result.summary + (f" ({result.reason})" if result.reason else "")
        lines.append(f"| {result.name} | {result.status} | {text.replace('|', '/')} | {result.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def write_report(out: str | Path, results: Sequence[CheckResult], doctor: dict[str, Any],
                 header: dict[str, str]) -> tuple[Path, Path]:
    """Write ``smoke_report.json`` (doctor's report, every check) and ``smoke_report.md`` into ``out``."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"header": header, "doctor": doctor, "checks": [asdict(r) for r in results],
               "ok": all(r.status != "failed" for r in results)}
    json_path, md_path = folder / "smoke_report.json", folder / "smoke_report.md"
    json_path.write_text(json.dumps(_plain(payload), indent=2, sort_keys=True, default=str) + "\n")
    md_path.write_text(markdown(results, header))
    return json_path, md_path
