"""`bench notebooks`: each notebook timed top to bottom on an in-memory copy, failures recorded as rows."""

from __future__ import annotations

import json

import pytest

from treeattn_lab.bench import notebooks

nbformat = pytest.importorskip("nbformat")


def _write(folder, name, sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / name
    nbformat.write(nb, path)
    return path


def test_names_select_notebooks_and_unknown_names_are_refused(tmp_path):
    for name in ("00_a.ipynb", "01_b.ipynb", "02_c.ipynb"):
        _write(tmp_path, name, ["1"])
    assert [p.name for p in notebooks.notebook_paths(["01", "02"], tmp_path)] == ["01_b.ipynb", "02_c.ipynb"]
    assert len(notebooks.notebook_paths(None, tmp_path)) == 3
    with pytest.raises(ValueError, match=r"no notebook starts with \['09'\]"):
        notebooks.notebook_paths(["09"], tmp_path)


@pytest.mark.notebook
def test_a_timed_notebook_reports_its_slowest_cell_and_a_failure_as_a_row(tmp_path):
    pytest.importorskip("nbclient")
    good = _write(tmp_path, "00_good.ipynb", ["import os\nassert os.environ.get('TREEATTN_QUICK') == '1'",
                                              "import time\ntime.sleep(0.3)", "x = 1"])
    before = good.read_bytes()
    row = notebooks.time_notebook(good, quick=True)
    assert row["ok"] and row["error"] is None and row["mode"] == "quick"
    assert row["slowest_cell"] == 1 and row["slowest_cell_s"] >= 0.3 and row["seconds"] >= 0.3
    assert good.read_bytes() == before, "the committed notebook was written to"
    bad = _write(tmp_path, "01_bad.ipynb", ["raise ValueError('broken lesson')"])
    row = notebooks.time_notebook(bad, quick=False)
    assert not row["ok"] and not row["within_budget"] and "broken lesson" in row["error"]
    json.dumps(row)  # a row is JSON
