"""The ``best`` pointer of a run folder: which saved checkpoint scored best on ``metric_for_best_model``.

``OUTPUT_DIR/best.json`` records ``{"checkpoint", "step", "metric", "value"}``; ``OUTPUT_DIR/best``
is a relative symlink to that ``checkpoint-N`` folder (where the filesystem allows links), so
``grpo-ascend export OUTPUT_DIR/best`` and ``grpo-ascend export OUTPUT_DIR --best`` both export it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grpo_ascend.errors import CheckpointError

BEST_LINK = "best"
BEST_FILE = "best.json"


def write_best_pointer(output_dir: str | os.PathLike, checkpoint: Path, metric: str, value: float) -> None:
    """Point ``best``/``best.json`` at ``checkpoint`` (replaced atomically; main process only)."""
    root = Path(output_dir)
    record = {"checkpoint": checkpoint.name, "step": int(checkpoint.name.rsplit("-", 1)[-1]),
              "metric": metric, "value": value}
    tmp = root / f".{BEST_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, root / BEST_FILE)
    link_tmp = root / f".{BEST_LINK}.tmp"
    try:
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(checkpoint.name, link_tmp, target_is_directory=True)
        os.replace(link_tmp, root / BEST_LINK)
    except OSError:  # no symlinks here (some network filesystems): best.json is the pointer
        pass


def read_best_pointer(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``best.json`` record of a run folder, or None when the run has none."""
    path = Path(output_dir) / BEST_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def best_checkpoint(output_dir: str | os.PathLike) -> Path:
    """The best checkpoint folder of a run, with a clear error when the run has no best."""
    record = read_best_pointer(output_dir)
    if record is None:
        raise CheckpointError(
            f"{str(output_dir)!r} has no {BEST_FILE}: the best checkpoint is recorded only by runs with "
            "eval_strategy: steps and an eval dataset; export a checkpoint-N folder instead"
        )
    folder = Path(output_dir) / record["checkpoint"]
    if not folder.is_dir():
        raise CheckpointError(f"the best checkpoint {str(folder)!r} named by {BEST_FILE} no longer exists "
                              "(deleted by hand?); export another checkpoint-N folder")
    return folder


def resolve_best_path(path: str | os.PathLike) -> Path:
    """``RUN/best`` (a link, or a name resolved through ``RUN/best.json``) to its checkpoint folder."""
    p = Path(path)
    if p.name == BEST_LINK and not p.is_dir():
        return best_checkpoint(p.parent)
    return p
