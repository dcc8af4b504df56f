"""The README's first Python block runs as written, on the embedded model, and prints `identical: True`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_block() -> str:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert match, "the README has no ```python block"
    return match.group(1)


def test_the_first_python_block_is_the_use_snippet():
    code = first_python_block()
    compile(code, "README.md", "exec")  # valid Python as written
    assert 'generation_mode="vericache"' in code and "identical" in code


@pytest.mark.slow
def test_the_first_python_block_runs_and_prints_identical(tmp_path):
    script = tmp_path / "readme_snippet.py"
    script.write_text(first_python_block())
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "identical: True" in done.stdout, done.stdout[-3000:]
