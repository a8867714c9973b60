"""The command line: every benchmark shows its own options, and bad options are usage errors that stop
before anything runs (exit status 2 with a message naming the option), never tracebacks."""

import argparse
import json
from unittest import mock

import pytest

from treeattn_lab.__main__ import BENCHES, main
from treeattn_lab.bench import harness
from treeattn_lab.bench import tree as bench_tree


def run_cli(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_name_help_shows_the_benchmarks_own_options(capsys):
    code, out, _ = run_cli(["bench", "tree", "--help"], capsys)
    assert code == 0
    assert "python -m treeattn_lab bench tree" in out
    for option in ("--heads", "--backends", "--cases", "--out"):
        assert option in out


def test_bench_help_lists_the_benchmarks(capsys):
    code, out, _ = run_cli(["bench", "--help"], capsys)
    assert code == 0
    for name in BENCHES:
        assert name in out


def test_options_after_a_double_dash_still_reach_the_benchmark(capsys):
    code, out, _ = run_cli(["bench", "tree", "--", "--help"], capsys)
    assert code == 0 and "--heads" in out


def test_unknown_benchmark_is_a_usage_error(capsys):
    code, _, err = run_cli(["bench", "nope"], capsys)
    assert code == 2 and "invalid choice" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "0"], "positive integer"),
        (["--heads", "a"], "positive integer"),
        (["--dim", "-3"], "positive integer"),
        (["--backends", "triton,nope"], "unknown 'nope'"),
        (["--backends", ""], "unknown ''"),
    ],
)
def test_bad_tree_options_stop_before_running(argv, message, capsys):
    with mock.patch.object(bench_tree, "run_case") as run_case:
        code, _, err = run_cli(["bench", "tree", *argv], capsys)
    assert code == 2
    assert message in err
    run_case.assert_not_called()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["balance", "--ks", "a"], "positive integers"),
        (["balance", "--ks", "2,0"], "positive integers"),
        (["balance", "--partitioners", "nope"], "unknown 'nope'"),
        (["balance", "--sets", "nope"], "nope"),
        (["train", "--sets", "nope"], "unknown 'nope'"),
        (["train", "--reps", "0"], "positive integer"),
        (["tree-tune", "--heads", "0"], "positive integer"),
        (["sparse", "--heads", "0"], "positive integer"),
        (["dilated", "--dim", "x"], "positive integer"),
        (["dilated", "--backends", "sdpa,nope"], "unknown 'nope'"),
        (["sparse", "--backends", "nope"], "unknown 'nope'"),
        (["sparse", "--tune-tokens", "32768,x"], "positive integers"),
    ],
)
def test_bad_options_of_other_benchmarks_are_usage_errors(argv, message, capsys):
    code, _, err = run_cli(["bench", *argv], capsys)
    assert code == 2, err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmark_checks_its_out_folder_first(name, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_cli(["bench", name, "--out", str(blocker)], capsys)
    assert code == 2 and "--out" in err


def test_an_unusable_out_folder_stops_before_running(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for out in (blocker, blocker / "below"):
        with mock.patch.object(bench_tree, "run_case") as run_case:
            code, _, err = run_cli(["bench", "tree", "--out", str(out)], capsys)
        assert code == 2, out
        assert "--out" in err and "file" in err
        run_case.assert_not_called()
    assert blocker.read_text() == "not a folder"


def test_out_folder_is_checked_without_creating_it(tmp_path):
    target = tmp_path / "a" / "b"
    assert harness.out_dir(str(target)) == target
    assert not (tmp_path / "a").exists()


def test_tree_bench_writes_to_out(tmp_path, capsys):
    code, out, _ = run_cli(["bench", "tree", "--backends", "flat,triton", "--out", str(tmp_path)], capsys)
    assert code == 0
    (written,) = tmp_path.glob("tree__*.json")
    assert str(written) in out
    rows = json.loads(written.read_text())["rows"]  # each row names the pack features auto decides by
    assert rows and all(r["flat_pair_ratio"] >= 1 and 0 <= r["partial_tile_share"] <= 1 for r in rows)


@pytest.mark.parametrize(
    ("parse", "text", "want"),
    [
        (harness.positive_int, "7", 7),
        (harness.int_list, "2,4, 8", [2, 4, 8]),
        (harness.choice_list(["a", "b"]), "b,a", ["b", "a"]),
    ],
)
def test_argparse_types_accept_good_values(parse, text, want):
    assert parse(text) == want


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (harness.positive_int, "0"),
        (harness.positive_int, "1.5"),
        (harness.int_list, "a"),
        (harness.int_list, "2,,4"),
        (harness.int_list, "2,0"),
        (harness.int_list, ""),
        (harness.choice_list(["a", "b"]), "a,c"),
    ],
)
def test_argparse_types_reject_bad_values(parse, text):
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text) if parse is harness.int_list else "."):
        parse(text)


def test_info_prints_a_report(capsys):
    code, out, _ = run_cli(["info"], capsys)
    assert code == 0 and "torch" in out


@pytest.mark.parametrize(
    ("module", "entry", "argv", "message"),
    [
        ("treeattn_lab.experiments.rat_dilation", "main", ["--steps", "0"], "positive integer"),
        ("treeattn_lab.experiments.sparse_recall", "main", ["--windows", "a"], "positive integer"),
        ("treeattn_lab.experiments.sparse_recall", "main", ["--budgets", "8", "0"], "positive integer"),
        ("treeattn_lab.bench.multi_gpu_train", "_parse_args", ["--token-budget", "-1"], "positive integer"),
        ("treeattn_lab.bench.multi_gpu_train", "_parse_args", ["--out", "FILE"], "--out"),
        ("treeattn_lab.experiments.rat_dilation", "main", ["--out", "FILE"], "--out"),
        ("treeattn_lab.experiments.sparse_recall", "main", ["--out", "FILE"], "--out"),
    ],
)
def test_runner_options_are_checked_before_running(module, entry, argv, message, tmp_path, capsys):
    import importlib

    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [str(blocker) if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        getattr(importlib.import_module(module), entry)(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
