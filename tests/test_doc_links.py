"""Every relative link in the README and the docs leads somewhere: to a file of this tree and, for a `#section` of a
Markdown file, to one of its headings (as GitHub makes anchors from them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(match) for match in re.findall(r"^#+\s+(.+)$", text, re.MULTILINE)}


def test_anchor_follows_github():
    assert anchor("Long contexts: 8k tokens, batch 4") == "long-contexts-8k-tokens-batch-4"
    assert anchor("Everything stock `generate` does") == "everything-stock-generate-does"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, section = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif section and resolved.suffix == ".md" and section not in anchors(resolved):
            broken.append(f"{target}: no heading makes #{section}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
