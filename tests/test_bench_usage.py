"""Bad benchmark options are usage errors (exit status 2, a message naming the option), never a traceback
from deep inside a run, and they are caught before anything runs or is written."""

import pytest

from treeattn_lab.__main__ import main
from treeattn_lab.bench.ring import _parse_args as ring_args

BAD = [
    (["bench", "balance", "--ks", "a"], "--ks"),
    (["bench", "balance", "--ks", "2,0"], "--ks"),
    (["bench", "balance", "--sets", "nope"], "unknown sets"),
    (["bench", "balance", "--partitioners", "best"], "--partitioners"),
    (["bench", "sparse", "--heads", "0"], "--heads"),
    (["bench", "dilated", "--dim", "-1"], "--dim"),
    (["bench", "tree-tune", "--heads", "x"], "--heads"),
    (["bench", "tree", "--heads", "0"], "--heads"),
    (["bench", "train", "--sets", "nope"], "--sets"),
]


@pytest.mark.parametrize("argv,named", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_option_is_a_usage_error(argv, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "a refused run wrote files"


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--layouts", "ring"], ["--reps", "1.5"]])
def test_ring_runner_refuses_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ring_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_ring_runner_defaults_keep_the_layout_order():
    assert ring_args([]).layouts == ["striped", "zigzag", "contiguous"]
