"""Every causal-LM family of the installed transformers: VeriCache is exact at batch 1 and on a left-padded batch of 3
whose rows accept different counts (unless the model makes every row accept alike, or no draft of its is ever
rejected), or refuses the model with a ValueError before decoding; and `docs/models.md` says which.

The families come from transformers' own mapping (`vericache_tools.families`), so the matrix grows with
transformers; a family whose tiny random model does not build or run stock `generate` is out of the matrix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vericache_tools.families import families, judge_all

TABLE = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def documented() -> dict[str, str]:
    rows = re.findall(
        r"^\| ([\w.-]+) \| [^|]* \| [^|]* \| (exact|refused|out|differs|crashes) \| [a-z]* \|",
        TABLE.read_text(),
        flags=re.M,
    )
    return dict(rows)


@pytest.fixture(scope="module")
def verdicts():
    """Every family judged once, side by side on the cores (`judge_all`)."""
    return {verdict.family: verdict for verdict in judge_all(families())}


@pytest.mark.slow
@pytest.mark.parametrize("family", families())
def test_every_family_is_exact_or_refused_up_front(family, verdicts):
    verdict = verdicts[family]
    assert verdict.verdict in ("exact", "refused", "out"), f"{family}: {verdict.verdict}: {verdict.reason}"
    assert documented().get(family) == verdict.verdict, (
        f"docs/models.md says {documented().get(family)!r} for {family}, the matrix finds {verdict.verdict!r}: "
        "regenerate it with python -m vericache_tools.families --write docs/models.md"
    )
    if verdict.verdict == "exact":  # a batch whose rows left masked slots between their tokens was exact too
        assert verdict.rows in ("ragged", "uniform", "all"), (
            f"{family}: drafts rejected, but never row by row"
        )
    if verdict.verdict == "refused":
        assert "VeriCache" in verdict.reason or "Use " in verdict.reason, verdict.reason


def test_the_table_lists_every_family_of_this_transformers():
    assert set(documented()) == set(families())
