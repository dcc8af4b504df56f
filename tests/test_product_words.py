"""The product speaks of the product. No tracked file (README, docs, code, comments, tests, benchmarks, notebooks,
scripts, examples) names the sessions, issues or dates of the work that built it, or narrates how the code came to be
as it is: a comment says why the code is as it is now. File names are held to the same rule."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the product: what git tracks under these
PRODUCT = (
    "README.md",
    "docs",
    "src",
    "tests",
    "benchmarks",
    "notebooks",
    "scripts",
    "examples",
    "custom_generate",
    "pyproject.toml",
    ".ci",
)
#: the story of the work instead of the product: session and issue numbers, names tagged with an s and two
#: digits, dates, and phrases that tell how the code got here
NARRATION = re.compile(
    r"""
      \bsessions?\s+\d+
    | \bissues?\s+\#?\d+
    | \bs\d{2}\b
    | \b20\d\d-[01]\d-[0-3]\d\b
    | \bas\ before\b
    | \bno\ longer\b
    | \buntil\ now\b
    | \b(?:before|after)\ the\ fix\b
    | \bCPU\ here\b
    """,
    re.IGNORECASE | re.VERBOSE,
)


def product_files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", *PRODUCT], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing says which files are the product")
    return [name for name in listed.decode().split("\0") if name]


def narration(text: str) -> list[str]:
    return [match.group(0) for match in NARRATION.finditer(text)]


# The planted examples are built from pieces, so that this file passes its own check.
@pytest.mark.parametrize(
    "text",
    [
        "measured in " + "session" + " 44",
        "sessions" + " 43-44",
        "see " + "issue" + " 23",
        "Issue" + " #22, part 4",
        "docs/bench-floor-" + "s" + "31/results.md",
        "measured on " + "2026" + "-12-04",
        "compressed at prefill, as" + " before",
        "the slope no" + " longer keeps drafts short",
        "every paired run until" + " now",
        "39 rounds before the" + " fix",
        "on the 2-core CPU" + " here",
    ],
)
def test_the_matcher_finds_planted_narration(text):
    assert narration(text), text


@pytest.mark.parametrize(
    "text",
    [
        '@pytest.fixture(scope="session")',
        "restart the session and go on from the next cell",
        "issues a warning and recomputes",
        "on a 2-core CPU, a draft step at batch 4",
        "docs/benchmarks/long-context/code-8k-b4-paired-1/results.md",
        "sha256 of the tokens, 512 MiB, 30 layers",
    ],
)
def test_the_matcher_passes_words_about_the_product(text):
    assert not narration(text), text


def test_no_product_file_narrates_its_history():
    found = []
    for name in product_files():
        found += [f"{name} (file name): {word}" for word in narration(name)]
        path = ROOT / name
        if not path.is_file():
            continue  # listed by git, deleted in the working tree
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # images and other binary files
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{number}: {word!r} in {line.strip()[:100]!r}" for word in narration(line)]
    assert not found, "say what the product is, not how it got here:\n" + "\n".join(found)
