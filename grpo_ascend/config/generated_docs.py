"""Generated blocks inside hand-written docs pages, between a start and an end marker.

The config reference (:mod:`grpo_ascend.config.docs`) and the TRL compatibility tables
(:mod:`grpo_ascend.config.trl_compat`) are generated from code into such blocks, and tests fail when
a page is stale, so the page and the code cannot drift.
"""

from __future__ import annotations

import re
from pathlib import Path


def update_block(path: str | Path, start: str, end: str, body: str, check: bool = False) -> bool:
    """Put ``body`` between the markers of ``path`` (with ``check``, only compare); True if it was up to date."""
    p = Path(path)
    text = p.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{p}: markers {start!r} ... {end!r} not found")
    new = pattern.sub(lambda _: f"{start}\n\n{body}\n\n{end}", text)
    if new == text:
        return True
    if not check:
        p.write_text(new)
    return False
