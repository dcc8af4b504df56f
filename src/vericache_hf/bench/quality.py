"""Output quality, judged against full-cache output: identical tokens, code that parses, code that passes tests.

HumanEval's own `test` and `check(entry_point)` run in a fresh Python subprocess with a timeout, in an empty
temporary folder: a completion is untrusted code.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tempfile

import torch

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def trim(tokens: torch.Tensor, eos_token_ids: set[int]) -> list[int]:
    """A row of new tokens up to and including its first EOS (stock generate pads the rest of the batch)."""
    row = tokens.tolist()
    for index, token in enumerate(row):
        if token in eos_token_ids:
            return row[: index + 1]
    return row


def extract_code(text: str) -> str:
    """The first fenced code block of a chat answer, else the whole text."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def humaneval_program(problem: dict, code: str) -> str:
    """The problem's prompt (its imports and helpers), the completion, then its own tests.

    A completion that defines the function again replaces the prompt's stub; one that is only a body continues it.
    """
    entry = problem["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        body = problem["prompt"] + "    pass\n\n" + code
    else:
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


def passes_humaneval(problem: dict, code: str, timeout: float = 10.0) -> bool:
    """True when the problem's own tests pass on the completion, run in a subprocess with a timeout."""
    program = humaneval_program(problem, code)
    with tempfile.TemporaryDirectory() as folder:
        try:
            result = subprocess.run(
                [sys.executable, "-I", "-c", program],
                cwd=folder,
                capture_output=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0
