"""The notebooks in notebooks/: committed with their outputs, and still run top to bottom.

They are committed executed (tables, small PNGs) so they read on the web without running. CI
executes each one again (nbclient) and fails if a cell raises; the fresh outputs are not compared
with the committed ones (timings and measured bytes vary from run to run). The notebooks assert
what they show (same gradients and loss curve, less memory, plans within budget), so a notebook
that runs is one whose claims hold.

Refresh the committed outputs after changing a notebook or the API it shows:

    python -m tests.test_notebooks            # every notebook, or name some: ... 02_compare
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MAX_PNG_BYTES = 120_000  # one figure at a modest dpi
MAX_NOTEBOOK_BYTES = 600_000
MAX_TEXT_LINES = 120  # per output: a table or a summary, not a log


def execute(path: Path) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel; raises CellExecutionError on a failure."""
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(
        book,
        timeout=600,
        kernel_name="python3",
        record_timing=False,  # no timestamps in the committed cells
        resources={"metadata": {"path": str(path.parent)}},
    )
    # One intra-op thread: the models are tiny, and on a loaded 2-core runner two threads per
    # process spin against each other (a 60 ms step took 3 s in our measurements).
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return book


def test_the_three_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_inspect_plan",
        "02_compare_solvers",
        "03_export_and_train",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_executed_with_small_outputs(path):
    assert path.stat().st_size <= MAX_NOTEBOOK_BYTES, path.name
    book = nbformat.read(path, as_version=4)
    code = [cell for cell in book.cells if cell.cell_type == "code"]
    # executed top to bottom in one run: counts 1, 2, 3, ... in cell order
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), path.name
    outputs = [out for cell in code for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"], path.name
    pngs = [out.data["image/png"] for out in outputs if "image/png" in out.get("data", {})]
    assert all(len(base64.b64decode(png)) <= MAX_PNG_BYTES for png in pngs), path.name
    for out in outputs:
        text = out.get("text") or out.get("data", {}).get("text/plain", "")
        assert len(text.splitlines()) <= MAX_TEXT_LINES, (path.name, text[:200])
        assert "Traceback" not in text, path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    book = execute(path)
    errors = [
        out
        for cell in book.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors


if __name__ == "__main__":
    names = sys.argv[1:]
    for path in NOTEBOOKS:
        if names and not any(path.stem.startswith(n) for n in names):
            continue
        print(f"executing {path.name}", flush=True)
        nbformat.write(execute(path), path)
