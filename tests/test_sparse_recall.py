"""The sparse-recall experiment end to end at a toy size: JSON structure, recall in [0, 1], rising with
the budget."""

from __future__ import annotations

import json

from treeattn_lab.experiments import sparse_recall

BUDGETS = (4, 16, 64)


def test_sparse_recall_writes_sane_results(tmp_path, capsys):
    argv = ["--steps", "3", "--seq-len", "128", "--batch-size", "4", "--windows", "2", "--out", str(tmp_path),
            "--no-progress", "--budgets", *map(str, BUDGETS)]
    assert sparse_recall.main(argv) == 0
    assert "recall" in capsys.readouterr().out
    (path,) = tmp_path.glob("sparse-recall__*.json")
    result = json.loads(path.read_text())
    assert result["bench"] == "sparse-recall"
    assert result["config"]["budgets"] == list(BUDGETS) and result["config"]["windows"] == 2
    assert {"torch", "device"} <= set(result["environment"])

    rows = result["rows"]
    assert len(rows) == 3 * len(BUDGETS) * 2  # layers 0, 1 and "all"; lines and tiles
    for row in rows:
        assert 0.0 <= row["recall_min"] <= row["recall_mean"] <= 1.0 + 1e-6
        assert 0.0 < row["density"] <= 1.0
        assert row["samples"] == 2 * 4 * (2 if row["layer"] == "all" else 1)  # windows x heads (x layers)
    for layer in (0, 1, "all"):
        for kind in ("lines", "tiles"):
            curve = sorted((r["budget"], r["recall_mean"], r["density"]) for r in rows
                           if r["layer"] == layer and r["kind"] == kind)
            recalls, densities = [c[1] for c in curve], [c[2] for c in curve]
            assert recalls == sorted(recalls) and densities == sorted(densities), (layer, kind, curve)
    tiles = {r["budget"]: r for r in rows if r["layer"] == "all" and r["kind"] == "tiles"}
    lines = {r["budget"]: r for r in rows if r["layer"] == "all" and r["kind"] == "lines"}
    for b in BUDGETS:  # block rounding only adds pairs
        assert tiles[b]["recall_mean"] >= lines[b]["recall_mean"] - 1e-6
        assert tiles[b]["density"] >= lines[b]["density"]

    raw = result["raw"]
    assert len(raw) == 2 * 2 * len(BUDGETS) * 2  # layers x windows x budgets x kinds
    assert all(len(r["recall"]) == 4 and all(0.0 <= x <= 1.0 + 1e-6 for x in r["recall"]) for r in raw)
    assert set(result["verdict"]) == {f"layer {la} {k}" for la in (0, 1, "all") for k in ("lines", "tiles")}
