"""Every relative link and image in README.md and docs/*.md points to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = ("http://", "https://", "mailto:", "#")


def relative_links_of(text: str) -> list[str]:
    """Link targets outside fenced code blocks, without external URLs or pure anchors."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [t for t in LINK.findall(text) if not t.startswith(EXTERNAL)]


def test_link_pattern_finds_links_and_images():
    text = "see [a](docs/a.md#x) and ![b](../b.png) and [c](https://e.org)\n```\n[d](in/code.md)\n```"
    assert LINK.findall(text) == ["docs/a.md#x", "../b.png", "https://e.org", "in/code.md"]
    assert relative_links_of(text) == ["docs/a.md#x", "../b.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = [t for t in relative_links_of(page.read_text()) if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files {broken}"
