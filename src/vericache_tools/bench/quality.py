"""Output quality, judged against full-cache output: identical tokens, code that parses, code that passes tests.

HumanEval's own `test` and `check(entry_point)` run in a fresh Python subprocess with a timeout, in an empty
temporary folder: a completion is untrusted code.
"""

from __future__ import annotations

import ast
import codeop
import re
import subprocess
import sys
import tempfile
import warnings

import torch

_FENCE = re.compile(r"```[ \t]*[\w.+-]*[ \t]*\n(.*?)(?:(```)|\Z)", re.DOTALL)
#: HumanEval's stop sequences (Chen et al., 2021): top-level code that starts after the function.
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def trim(tokens: torch.Tensor, eos_token_ids: set[int]) -> list[int]:
    """A row of new tokens up to and including its first EOS (stock generate pads the rest of the batch)."""
    row = tokens.tolist()
    for index, token in enumerate(row):
        if token in eos_token_ids:
            return row[: index + 1]
    return row


def extract_code(text: str, problem: dict | None = None, truncated: bool = False) -> str:
    """The program one output is judged by, built the same way for every method (the usual HumanEval way).

    1. The code: the first fenced block of a chat answer (a fence the token limit left open runs to the end),
       else the whole text.
    2. A whole function (it defines the problem's entry point, or without a problem any function, at top level)
       replaces the prompt's stub: the program is the problem's prompt (its imports and helpers), `pass`, then the
       function, with any prose before it dropped. Anything else is a body that continues the prompt.
    3. The code ends at the first of HumanEval's stop sequences (`STOP_SEQUENCES`) after the function's `def`
       line (from the start, for a body): top-level code after the function is not part of the answer.
    4. When the token limit cut the output (`truncated`) before a closing fence or a stop sequence, the last line
       is unfinished: it is dropped, then trailing lines while what remains is only unfinished (an open bracket,
       block or string), keeping at least one written line of the answer. So the code is judged on what was
       written before the cut.
    """
    code, closed = _code_block(text)
    if not code.strip():
        return ""  # no code at all: nothing parses, nothing passes
    name = re.escape(problem["entry_point"]) if problem else r"\w+"
    function = re.compile(rf"^def\s+{name}\s*\(", re.MULTILINE)
    found = function.search(code)
    if found:
        before = code[: found.start()]
        if before.strip() and not parses(before):  # prose before the function (imports and helpers stay)
            code = code[found.start() :]
            found = function.search(code)
        head = problem["prompt"] + "    pass\n\n" if problem else ""
        body = code.find("\n", found.start())
        body = len(code) if body < 0 else body
        fixed = code.count("\n", 0, body) + 1  # the lines up to the def line
    else:
        head, body, fixed = (problem["prompt"] if problem else ""), 0, 0
    stops = [i for i in (code.find(stop, body) for stop in STOP_SEQUENCES) if i >= 0]
    if stops:
        return head + code[: min(stops)] + "\n"
    if truncated and not closed:
        code = _drop_unfinished(head, code, fixed)
    return head + code


def _code_block(text: str) -> tuple[str, bool]:
    """The first fenced block and whether its closing fence came, else the whole text (not closed)."""
    match = _FENCE.search(text)
    if match is None:
        return text, False
    return match.group(1), match.group(2) is not None


def _drop_unfinished(head: str, code: str, fixed: int) -> str:
    """Drop the line the token limit cut, then trailing lines while the program is only unfinished.

    The first `fixed` lines (a function's `def` line) and one written line after them always stay; a real syntax
    error (not merely unfinished input) stops the dropping.
    """
    lines = code.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    while sum(bool(line.strip()) for line in lines[fixed:]) > 1 and _unfinished(head + "".join(lines)):
        lines.pop()
    return "".join(lines)


def _unfinished(code: str) -> bool:
    """True when `code` does not parse only because it stops early: a valid start of a longer program."""
    if parses(code):
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return codeop.compile_command(code, "<completion>", "exec") is None
    except (SyntaxError, ValueError, OverflowError):
        return False


def parses(code: str) -> bool:
    """True when `code` is Python that `ast.parse` accepts; blank code (no answer) does not count."""
    if not code.strip():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for an invalid escape: still parses
            ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def humaneval_program(problem: dict, code: str) -> str:
    """The program from `extract_code(text, problem)`, then the problem's own tests."""
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def passes_humaneval(problem: dict, code: str, timeout: float = 10.0) -> bool:
    """True when the problem's own tests pass on `code` (from `extract_code(text, problem)`), run in a subprocess
    with a timeout."""
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
