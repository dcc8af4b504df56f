"""Where a benchmark script's results go: `results.json` (every row) and `table.md` (what a reader sees)."""

from __future__ import annotations

import json
from pathlib import Path


def save_results(out: str | Path, rows: list[dict], lines: list[str]) -> Path:
    """Write `rows` as results.json and `lines` as table.md under `out` (created); print the table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out
