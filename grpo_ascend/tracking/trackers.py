"""Experiment trackers behind one small interface, chosen by name in ``report_to``.

Each tracker logs the run's config once, scalar metrics per step, and tables of sample
completions. ``jsonl`` (the run's own files in ``output_dir``) needs nothing; the others need their
package (``pip install 'grpo-ascend[NAME]'``) and follow that package's own settings for where data
goes: ``WANDB_MODE=offline`` and ``SWANLAB_MODE=local|offline`` keep everything on disk, trackio is
local unless given a Space (``TRACKIO_DIR`` sets its folder). Project name: ``<NAME>_PROJECT``
(e.g. ``WANDB_PROJECT``) or ``grpo-ascend``; run name: the output folder's name.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from grpo_ascend.errors import ConfigError, closest

CONFIG_FILE = "run_config.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
DEFAULT_PROJECT = "grpo-ascend"


class Tracker(Protocol):
    """What every tracker implements. ``rows`` of a table share the same keys (its columns)."""

    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None: ...
    def close(self) -> None: ...


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _project(name: str) -> str:
    return os.environ.get(f"{name.upper()}_PROJECT", DEFAULT_PROJECT)


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    return columns


class JsonlTracker:
    """The run's own files: ``run_config.json``, ``metrics.jsonl`` and ``samples.jsonl`` (one row per line)."""

    def __init__(self, output_dir: str | Path, run_name: str) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def log_config(self, config: dict[str, Any]) -> None:
        (self.dir / CONFIG_FILE).write_text(json.dumps(_jsonable(config), indent=2) + "\n")

    def _append(self, name: str, records: list[dict[str, Any]]) -> None:
        with open(self.dir / name, "a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in records)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._append(METRICS_FILE, [{"step": step, **metrics}])

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        self._append(SAMPLES_FILE, [{"step": step, **row} for row in rows])

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """TensorBoard event files under ``output_dir/tensorboard``: scalars, config and tables as text."""

    def __init__(self, output_dir: str | Path, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))

    def log_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(_jsonable(config), indent=2)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # indented = code block

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        columns = _columns(rows)
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Weights & Biases; ``WANDB_MODE=offline`` writes the run under ``output_dir/wandb`` only."""

    def __init__(self, output_dir: str | Path, run_name: str) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=_project("wandb"), name=run_name, dir=str(output_dir), reinit="finish_previous")

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(_jsonable(config), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        columns = _columns(rows)
        table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class SwanLabTracker:
    """SwanLab (popular with Ascend users); ``SWANLAB_MODE=local`` or ``offline`` keeps the run under
    ``output_dir/swanlog``."""

    def __init__(self, output_dir: str | Path, run_name: str) -> None:
        import swanlab

        self.swanlab = swanlab
        self.run = swanlab.init(project=_project("swanlab"), name=run_name, log_dir=str(Path(output_dir) / "swanlog"),
                                reinit=True)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(_jsonable(config))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        columns = _columns(rows)
        table = self.swanlab.echarts.Table()
        table.add(columns, [[row.get(c) for c in columns] for row in rows])
        self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """trackio: local-first (an SQLite file under ``TRACKIO_DIR``) unless a Space is configured."""

    def __init__(self, output_dir: str | Path, run_name: str) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=_project("trackio"), name=run_name, auto_log_gpu=False, auto_log_cpu=False)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(_jsonable(config))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(dict(metrics), step=step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        columns = _columns(rows)
        table = self.trackio.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.trackio.log({name: table}, step=step)

    def close(self) -> None:
        self.trackio.finish()


# name → (package to import, factory); the extra to install has the tracker's name.
TRACKERS: dict[str, tuple[str | None, Callable[[str | Path, str], Tracker]]] = {
    "jsonl": (None, JsonlTracker),
    "tensorboard": ("tensorboard", TensorBoardTracker),
    "wandb": ("wandb", WandbTracker),
    "swanlab": ("swanlab", SwanLabTracker),
    "trackio": ("trackio", TrackioTracker),
}


def check_report_to(report_to: list[str]) -> list[str]:
    """The tracker names of ``report_to`` (``"none"`` dropped), ConfigError for unknown names."""
    names = []
    for name in report_to:
        if name == "none":
            continue
        if name not in TRACKERS:
            valid = ", ".join([*TRACKERS, "none"])
            raise ConfigError(f"report_to: unknown tracker {name!r}{closest(str(name), TRACKERS)}; valid: {valid}")
        if name not in names:
            names.append(name)
    return names


def installed_trackers() -> list[str]:
    """Every tracker whose package is installed (``report_to: all``)."""
    return [name for name, (package, _) in TRACKERS.items()
            if package is None or importlib.util.find_spec(package) is not None]


def make_tracker(name: str, output_dir: str | Path, run_name: str | None = None) -> Tracker:
    """Start the tracker registered as ``name``; ConfigError naming the extra when its package is missing."""
    check_report_to([name])
    package, factory = TRACKERS[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"report_to includes {name!r} but the {package} package is not installed: "
            f"pip install 'grpo-ascend[{name}]' (or pip install {package})"
        )
    return factory(output_dir, run_name or Path(output_dir).resolve().name or "run")
