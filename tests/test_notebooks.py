"""The guided notebooks: each runs top to bottom headless, and none is committed with outputs.

Execution happens on an in-memory copy, so running these tests never writes outputs into the
committed ``.ipynb`` files. The kernel is ``python3`` (the venv's ipykernel) with ``TREEATTN_QUICK=1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def _ids(paths):
    return [p.name for p in paths]


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found under {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: code cells {dirty} carry outputs or execution counts; clear them"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs_headless(path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    from nbclient.exceptions import CellExecutionError

    before = path.read_bytes()
    nb = nbformat.read(path, as_version=4)  # executed in memory only
    monkeypatch.setenv("TREEATTN_QUICK", "1")  # the kernel inherits this process's environment
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},  # cwd of the kernel
        allow_errors=False,
    )
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}")

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells), "some code cells did not run"
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert sum(len(c.outputs) for c in code_cells) > 0, f"{path.name} produced no output at all"
    assert path.read_bytes() == before, "executing the notebook must not touch the committed file"
