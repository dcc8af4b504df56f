"""Both notebooks run top to bottom on the embedded model (small sizes, `VERICACHE_NOTEBOOK_CI=1`), so they
cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


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
    if name == "quickstart.ipynb":
        assert "identical to full-cache output: True" in text
    else:
        assert "lossless methods identical to full cache: True" in text
        assert any("image/png" in out.get("data", {}) for out in outputs)
