"""``python -m grpo_ascend.models.builtin_weights``: rebuild the shipped warm starts from scratch."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from grpo_ascend.models.builtin_weights import MANIFEST, manifest, record
from grpo_ascend.models.tiny_model import build_name, build_tiny_model, first_warm_start_losses


def main() -> int:
    """Rebuild the shipped seed-0 warm starts from scratch and record them (minutes of CPU): the warm
    start first, then the calculator warm start on top of the newly recorded one."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = [build_name("tiny", warm=True, tools=tools, seed=0) for tools in (False, True)]
    entries = {k: v for k, v in manifest().items() if k not in names}
    MANIFEST.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for tools, name in zip((False, True), names):
            out = build_tiny_model("tiny", warm=True, tools=tools, out_dir=Path(tmp) / name)
            losses = first_warm_start_losses("tiny", tools=tools)
            print(record(name, out / "model.safetensors", AutoTokenizer.from_pretrained(out), losses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
