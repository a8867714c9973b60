"""The GRPO flat-vs-tree experiment: its tiny mode end to end, the JSON it writes, per-seed runs merged."""

from __future__ import annotations

import json

import pytest

from treeattn_lab.experiments import grpo_tree


def _run(tmp_path, *args):
    assert grpo_tree.main(["--mode", "tiny", "--out", str(tmp_path), "--no-progress", *args]) == 0
    (path,) = tmp_path.glob("grpo-tree-tiny__*.json")
    return path, json.loads(path.read_text())


def test_tiny_mode_end_to_end(tmp_path, capsys):
    path, result = _run(tmp_path, "--seeds", "3")
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
    assert result["grad_rel_diff"]["3"] < 1e-5  # step-0 gradients agree, float32
    head = result["headline"]
    assert head["token_ratio"] > 1 and head["learner_speedup"] > 0
    assert {s["loop"] for s in result["rows"]} == {"flat", "tree"}
    assert result["config"]["model"]["dim"] == cfg.model.dim and result["environment"]["device"] == "cpu"
    assert not list(tmp_path.glob(".*.tmp")), "written through a temporary file, then replaced"


def test_merge_of_per_seed_runs(tmp_path):
    a_dir, b_dir, out = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    a_path, a = _run(a_dir, "--seeds", "0")
    b_path, b = _run(b_dir, "--seeds", "1")
    merged = grpo_tree.merge_results([a, b])
    assert merged["config"]["seeds"] == [0, 1]
    assert len(merged["steps"]) == len(a["steps"]) + len(b["steps"])
    assert {s["seed"] for s in merged["summary"]} == {0, 1}
    assert set(merged["grad_rel_diff"]) == {0, 1}
    assert grpo_tree.main(["--mode", "tiny", "--merge", str(a_path), str(b_path), "--out", str(out)]) == 0
    (written,) = out.glob("grpo-tree-tiny__*.json")
    assert json.loads(written.read_text())["config"]["seeds"] == [0, 1]
    with pytest.raises(ValueError, match="repeat a seed"):
        grpo_tree.merge_results([a, a])
    with pytest.raises(SystemExit):  # a tiny run is not a quick run
        grpo_tree.main(["--mode", "quick", "--merge", str(a_path), "--no-save"])


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
