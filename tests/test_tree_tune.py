"""``bench tree-tune``'s sweeps on a tiny case under the interpreter: every row timed and checked."""

import pytest
import torch
from treeattn_lab.kernels.tuning import LaunchConfig

from treeattn_lab.bench import tree_tune
from treeattn_lab.bench.tree import TreeCase

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU


def test_dq_sweep_times_both_load_paths_and_matches_the_default_launch(monkeypatch):
    monkeypatch.setattr(tree_tune, "DQ_SHAPES", [(16, 32, 4, 1)])
    case = TreeCase("tiny", [list(range(20)), list(range(9)) + [50, 51, 52], [7] * 5])
    rows = tree_tune.tune_case(case, heads=2, dim=16, device=DEVICE, dtype=torch.float32, passes=("dq",))
    assert [r["config"] for r in rows] == [LaunchConfig(16, 32, 4, 1), LaunchConfig(16, 32, 4, 1, tma=True)]
    for row in rows:
        assert row["pass"] == "fwd+bwd, dq"
        assert row["ms"] > 0 and row["err"] < 1e-5  # gradients as the default launch's
    summary = tree_tune.load_path_summary(rows)
    assert [(r["pointer"], r["tma"]) for r in summary] == [("(16, 32, 4, 1)", "(16, 32, 4, 1)")]


def test_unknown_pass_is_refused():
    case = TreeCase("tiny", [[1, 2, 3]])
    with pytest.raises(ValueError, match="unknown tune passes"):
        tree_tune.tune_case(case, heads=1, dim=16, device=DEVICE, dtype=torch.float32, passes=("dk",))


def test_passes_option_is_checked_before_any_work(capsys):
    with pytest.raises(SystemExit):
        tree_tune.main(["--passes", "fwd,bogus"])
    assert "unknown tune passes ['bogus']" in capsys.readouterr().err  # argparse's error, not "needs a GPU"
