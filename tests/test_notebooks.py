"""The guided notebooks: each runs top to bottom headless, and none is committed with outputs.

Execution happens on an in-memory copy, so running these tests never writes outputs into the
committed ``.ipynb`` files. The kernel is ``python3`` (the venv's ipykernel) with ``TREEATTN_QUICK=1``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 1800  # a hang guard only: how long a notebook takes is measured by `bench notebooks`
LESSONS = [p for p in NOTEBOOKS if p.name[:2] in {"01", "02", "03", "04", "05", "06"}]
PROCESS_NOTES = re.compile(r"\bthe issue\b|issue's|\bMILP\b|\bTODO\b|\bwe tried\b|\bfor now\b", re.IGNORECASE)


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_text_has_no_process_notes(path):
    nb = nbformat.read(path, as_version=4)
    notes = [(i, m.group(0)) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
             for m in PROCESS_NOTES.finditer(c.source)]
    assert not notes, f"{path.name}: markdown cells talk about the process, not the lesson: {notes}"


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_lesson_measures_its_saving_live_and_links_the_glossary(path):
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "demos." in code, f"{path.name}: no live measurement through treeattn_lab.lab.demos"
    assert "measured_on(" in code, f"{path.name}: GPU numbers are not labelled with where they were measured"
    assert "glossary" in text and "00_welcome" in text, f"{path.name}: does not point to the glossary"


def test_welcome_lists_every_notebook_and_holds_the_glossary():
    nb = nbformat.read(NOTEBOOK_DIR / "00_welcome.ipynb", as_version=4)
    where_next = next(c.source for c in nb.cells if c.source.startswith("## Where next"))
    for path in NOTEBOOKS:
        if path.name != "00_welcome.ipynb":
            assert path.stem in where_next, f"'Where next' skips {path.stem}"
    glossary = next(c.source for c in nb.cells if c.source.startswith("## Glossary"))
    for term in ("CSR", "TMA", "SM", "warp", "NCCL stream", "dK", "gloo"):
        row = re.search(rf"^\| \*\*[^|]*\b{term}", glossary, re.MULTILINE)
        assert row, f"the glossary does not explain {term}"


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
