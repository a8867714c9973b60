"""The GRPO flat-vs-tree experiment: its tiny mode end to end, the JSON it writes, per-seed runs merged."""

from __future__ import annotations

import io
import json
import sys

import pytest

from treeattn_lab.bench.harness import environment
from treeattn_lab.experiments import grpo_tree


def _run(tmp_path, *args):
    assert grpo_tree.main(["--mode", "tiny", "--out", str(tmp_path), "--no-progress", *args]) == 0
    (path,) = tmp_path.glob("grpo-tree-tiny__*.json")
    return path, json.loads(path.read_text())


def test_tiny_mode_end_to_end(tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        path, result = _run(tmp_path, "--seeds", "3", "--budget-s", "1e6", "--threads", "1")  # never binds
        assert result["environment"]["torch_threads"] == 1
    finally:
        torch.set_num_threads(threads)
    assert "GRPO flat vs tree" in capsys.readouterr().out
    cfg = grpo_tree.MODES["tiny"]
    rows = result["steps"]
    assert len(result["rows"]) == 2 and {"final_reward", "learner_s", "token_ratio"} <= set(result["rows"][0])
    assert len(rows) == 2 * cfg.steps and {r["mode"] for r in rows} == {"flat", "tree"}
    first = {r["mode"]: r for r in rows if r["step"] == 0}
    for key in ("reward", "flat_tokens", "tree_tokens", "token_ratio"):  # the same seed: the same first batch
        assert first["flat"][key] == first["tree"][key], key
    for r in rows:
        assert r["token_ratio"] > 1 and r["times_s"]["train"] > 0 and r["step_s"] > 0
    check = result["grad_check"]["3"]
    assert check["tree_vs_flat"] < 1e-5  # step-0 gradients agree, float32
    assert 0 < check["flat_vs_fp64"] < 1e-5 and 0 < check["tree_vs_fp64"] < 1e-5  # rounding, not zero
    assert result["headline"]["tree_grad_as_exact_as_flat"] is True
    assert result["steps_done"] == {"3": cfg.steps} and result["stopped_early"] is False
    assert all(s["steps"] == cfg.steps and s["learner_median_s"] > 0 for s in result["rows"])
    head = result["headline"]
    assert head["token_ratio"] > 1 and head["learner_speedup"] > 0 and head["learner_speedup_median"] > 0
    assert {s["loop"] for s in result["rows"]} == {"flat", "tree"}
    for s in result["rows"]:
        assert s["eval_gain"] == pytest.approx(s["eval_after"] - s["eval_before"])
        assert head[s["loop"]]["eval_gain"] == pytest.approx(s["eval_gain"])  # one seed: its own gain
    assert result["config"]["model"]["dim"] == cfg.model.dim
    assert result["environment"]["device"] == environment()["device"]  # this machine's device, named
    assert not list(tmp_path.glob(".*.tmp")), "written through a temporary file, then replaced"


def test_merge_of_per_seed_runs(tmp_path):
    a_dir, b_dir, out = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    a_path, a = _run(a_dir, "--seeds", "0")
    b_path, b = _run(b_dir, "--seeds", "1")
    merged = grpo_tree.merge_results([a, b])
    assert merged["config"]["seeds"] == [0, 1]
    assert len(merged["steps"]) == len(a["steps"]) + len(b["steps"])
    assert {s["seed"] for s in merged["summary"]} == {0, 1}
    assert set(merged["grad_check"]) == {0, 1}
    assert grpo_tree.main(["--mode", "tiny", "--merge", str(a_path), str(b_path), "--out", str(out)]) == 0
    (written,) = out.glob("grpo-tree-tiny__*.json")
    assert json.loads(written.read_text())["config"]["seeds"] == [0, 1]
    with pytest.raises(ValueError, match="repeat a seed"):
        grpo_tree.merge_results([a, a])
    old = {k: v for k, v in b.items() if k != "grad_check"}
    with pytest.raises(ValueError, match=r"results \[1\] have no 'grad_check'"):
        grpo_tree.merge_results([a, old])
    _, both = _run(tmp_path / "both", "--seeds", "0,1")  # one process, two seeds: the same result
    merged_json = json.loads(written.read_text())
    assert set(merged_json) - {"merged_from"} == set(both)
    assert [set(r) for r in merged_json["rows"]] == [set(r) for r in both["rows"]]
    assert set(merged_json["headline"]) == set(both["headline"])
    for key in ("config", "evals", "grad_check", "steps_done", "stopped_early"):
        assert merged_json[key] == both[key], key
    for key in ("seed", "loop", "final_reward", "first_reward", "eval_before", "eval_after", "token_ratio",
                "steps"):
        assert [r[key] for r in merged_json["rows"]] == [r[key] for r in both["rows"]], key
    with pytest.raises(SystemExit):  # a tiny run is not a quick run
        grpo_tree.main(["--mode", "quick", "--merge", str(a_path), "--no-save"])


def test_headline_gives_the_greedy_gain_per_loop_with_its_spread():
    rows = []
    greedy = [(0.2, 0.9, 0.9), (0.3, 0.5, 0.6), (0.1, 0.8, 0.7)]  # per seed: before, flat after, tree after
    for seed, (before, flat_after, tree_after) in enumerate(greedy):
        for loop, after in (("flat", flat_after), ("tree", tree_after)):
            rows.append({"seed": seed, "loop": loop, "final_reward": after, "eval_before": before,
                         "eval_after": after, "learner_s": 2.0 if loop == "flat" else 1.0,
                         "learner_median_s": 1.0, "step_s": 2.5, "token_ratio": 4.0})
    check = {seed: {"tree_vs_flat": 1e-7, "flat_vs_fp64": 1e-6, "tree_vs_fp64": 1e-6} for seed in range(3)}
    head = grpo_tree.headline(rows, check)
    assert head["flat"]["eval_before"] == pytest.approx(0.2)
    assert head["flat"]["eval_gain"] == pytest.approx((0.7 + 0.2 + 0.7) / 3)
    assert (head["flat"]["eval_gain_min"], head["flat"]["eval_gain_max"]) == pytest.approx((0.2, 0.7))
    assert (head["tree"]["eval_gain_min"], head["tree"]["eval_gain_max"]) == pytest.approx((0.3, 0.7))
    assert head["learner_speedup"] == pytest.approx(2.0)


def test_budget_stops_after_the_first_step_and_still_evaluates(tmp_path, capsys):
    path, result = _run(tmp_path, "--seeds", "2", "--budget-s", "0.001")
    assert "stopped early by --budget-s" in capsys.readouterr().out
    assert result["stopped_early"] is True and result["steps_done"] == {"2": 1}
    assert sorted((r["mode"], r["step"]) for r in result["steps"]) == [("flat", 0), ("tree", 0)]
    assert [(r["loop"], r["steps"]) for r in result["rows"]] == [("flat", 1), ("tree", 1)]
    assert set(result["evals"]["2"]) == {"warm-up", "flat", "tree"}  # evaluated after the stop
    assert result["config"]["steps"] == grpo_tree.MODES["tiny"].steps  # the mode's setting, still mergeable


def test_a_run_of_several_seeds_saves_after_each_seed(tmp_path, monkeypatch):
    from treeattn_lab.bench import harness

    written = []

    def recording_write(path, text):
        written.append((path, json.loads(text)["config"]["seeds"]))
        real_write(path, text)

    real_write = harness.write_text_atomic
    monkeypatch.setattr(harness, "write_text_atomic", recording_write)
    path, result = _run(tmp_path, "--seeds", "0,1", "--budget-s", "0.001")
    assert [seeds for _, seeds in written] == [[0], [0, 1]]  # after each seed; the last is the run's result
    assert {p for p, _ in written} == {path}
    assert result["steps_done"] == {"0": 1, "1": 1}  # the budget holds for the run; each seed takes a step


@pytest.mark.parametrize("budget", ["0", "-1", "nan", "inf", "soon"])
def test_bad_budget(budget, capsys):
    with pytest.raises(SystemExit):
        grpo_tree.main(["--mode", "tiny", "--budget-s", budget, "--no-save"])
    assert "argument --budget-s" in capsys.readouterr().err


def test_a_budget_for_a_merge_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        grpo_tree.main(["--mode", "tiny", "--merge", str(tmp_path / "a.json"), "--budget-s", "60"])
    assert "--merge trains nothing" in capsys.readouterr().err


@pytest.mark.parametrize("budget, error", [(0, ValueError), (float("nan"), ValueError), (True, TypeError),
                                           ("60", TypeError)])
def test_run_experiment_refuses_a_bad_budget_before_training(budget, error, monkeypatch):
    monkeypatch.setattr(grpo_tree, "run_seed", lambda *a, **k: pytest.fail("trained despite a bad budget"))
    with pytest.raises(error, match="budget_s"):
        grpo_tree.run_experiment("tiny", progress=False, budget_s=budget)


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_bars_off_a_terminal_redraw_every_few_seconds(monkeypatch):
    from tqdm.notebook import tqdm_notebook
    from tqdm.std import tqdm as text_bar

    from treeattn_lab.progress import LOG_REDRAW_INTERVAL_S, progress_bar, redraws_in_place

    monkeypatch.setattr(sys, "stderr", _Stderr(tty=True))
    assert progress_bar(total=3, file=_Stderr(tty=True)).mininterval == 0.1  # a terminal: tqdm's default
    assert not redraws_in_place(text_bar, io.StringIO())  # a bar's own file decides, not stderr
    monkeypatch.setattr(sys, "stderr", _Stderr(tty=False))
    assert not redraws_in_place(text_bar) and redraws_in_place(tqdm_notebook)
    sink = _Stderr(tty=False)
    bar = progress_bar(total=10, file=sink)
    own = progress_bar(total=3, file=sink, mininterval=0.5)
    assert bar.mininterval == LOG_REDRAW_INTERVAL_S and own.mininterval == 0.5  # the caller's is kept
    clock = [bar.last_print_t]  # a fake clock from the bar's last redraw on
    bar._time = lambda: clock[0]
    drawn = sink.getvalue()
    for loss in range(4):  # a second per step: past tqdm's default 0.1 s, within the 5 s of a log
        clock[0] += 1.0
        bar.set_postfix(loss=loss, refresh=False)
        bar.update(1)
    assert sink.getvalue() == drawn  # no redraw yet, and the postfixes waited
    clock[0] += LOG_REDRAW_INTERVAL_S
    bar.update(1)
    assert sink.getvalue() != drawn and "loss=3" in sink.getvalue()
    bar.close()
    own.close()


@pytest.mark.parametrize("seeds", ["a", "-1", "1,1"])
def test_bad_seeds(seeds, capsys):
    with pytest.raises(SystemExit):
        grpo_tree.main(["--mode", "tiny", "--seeds", seeds, "--no-save"])
    assert "argument --seeds" in capsys.readouterr().err


@pytest.mark.parametrize("mode", sorted(grpo_tree.MODES))
def test_every_mode_is_a_valid_setting(mode):
    cfg = grpo_tree.MODES[mode]
    config = cfg.grpo()  # checks group_size against the forks, the loss type, the tree mode
    task = cfg.task()
    assert config.num_samples * (config.forks[0] if config.forks else 1) == cfg.group_size
    assert cfg.model.vocab_size == task.tokenizer.vocab_size and cfg.model.dim % cfg.model.n_heads == 0
    assert (task.environment(task.problems(1)) is None) == (cfg.turns == 1)
    model = grpo_tree.TinyLM(cfg.model)
    trainer = grpo_tree.GRPO(model, task, config, mode="tree")
    assert len(trainer.forks) == cfg.turns - 1 or (cfg.turns == 1 and trainer.forks == cfg.forks)
