"""``bench tree-tune``'s sweeps on a tiny case under the interpreter: every row timed and checked."""

import pytest
import torch

from treeattn_lab.bench import tree_tune
from treeattn_lab.bench.tree import TreeCase

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU


def test_atomic_sweep_times_every_mode_and_matches_the_default_launch(monkeypatch):
    monkeypatch.setattr(tree_tune, "ATOMIC_DKDV_SHAPES", [(16, 32, 4, 1)])
    case = TreeCase("tiny", [list(range(20)), list(range(9)) + [50, 51, 52], [7] * 5])
    rows = tree_tune.tune_case(case, heads=2, dim=16, device=DEVICE, dtype=torch.float32,
                               passes=("atomic",))
    launch = (16, 32, 4, 1, False)
    assert [r["config"] for r in rows] == [(launch, "atomic"), (launch, "atomic-tma")]
    for row in rows:
        assert row["pass"] == "fwd+bwd, atomic dq"
        assert row["ms"] > 0 and row["err"] < 1e-5  # gradients as the default launch's (dQ kernel)


def test_unknown_pass_is_refused():
    case = TreeCase("tiny", [[1, 2, 3]])
    with pytest.raises(ValueError, match="unknown tune passes"):
        tree_tune.tune_case(case, heads=1, dim=16, device=DEVICE, dtype=torch.float32, passes=("dk",))


def test_passes_option_is_checked_before_any_work(capsys):
    with pytest.raises(SystemExit):
        tree_tune.main(["--passes", "fwd,bogus"])
    assert "unknown tune passes ['bogus']" in capsys.readouterr().err  # argparse's error, not "needs a GPU"
