"""``python -m treeattn_lab bench compile --quick``: the eager and compiled TinyLM steps run on a CPU,
agree, and land in one JSON file named like the other runners' results."""

import json

import pytest

from treeattn_lab.__main__ import main
from treeattn_lab.bench.harness import environment


def test_quick_run_writes_agreeing_eager_and_compiled_rows(tmp_path, capsys):
    out = tmp_path / "results"
    code = main(["bench", "compile", "--quick", "--compile-backend", "aot_eager", "--reps", "1",
                 "--out", str(out)])
    assert code == 0
    (path,) = out.glob("compile__*.json")
    result = json.loads(path.read_text())
    assert path.name.startswith("compile__") and result["environment"]["device"] == environment()["device"]
    assert result["bench"] == "compile" and result["quick"] and result["compile_backend"] == "aot_eager"
    rows = {(r["backend"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(b, m) for b in ("auto", "triton") for m in ("eager", "compiled")}
    assert rows[("triton", "eager")]["ran"] == "triton"
    for row in rows.values():
        assert "error" not in row, row
        assert row["step_ms"] > 0 and row["first_call_s"] > 0
    for backend in ("auto", "triton"):
        compiled = rows[(backend, "compiled")]
        assert compiled["loss_rel_diff"] < 1e-5 and compiled["grad_rel_diff"] < 1e-5
        assert compiled["speedup"] > 0
    assert "eager vs torch.compile(fullgraph=True" in capsys.readouterr().out


def test_a_past_budget_skips_the_compiled_rows_and_still_writes(tmp_path):
    code = main(["bench", "compile", "--quick", "--backends", "auto", "--reps", "1", "--budget-s", "0",
                 "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads(next(tmp_path.glob("compile__*.json")).read_text())["rows"]
    assert [r["mode"] for r in rows] == ["eager", "compiled"]
    assert "error" not in rows[0] and rows[1]["error"].startswith("skipped")


@pytest.mark.parametrize("argv, named", [(["--backends", "flex"], "--backends"), (["--reps", "0"], "--reps"),
                                          (["--set", "nope"], "--set")])
def test_bad_options_are_usage_errors_before_anything_runs(argv, named, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "compile", *argv])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
