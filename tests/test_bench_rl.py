"""``python -m treeattn_lab bench rl --quick`` runs a GRPO step per mode on the CPU and writes its JSON."""

from __future__ import annotations

import json

import pytest
import torch

from treeattn_lab import RolloutTrie
from treeattn_lab.__main__ import main as cli
from treeattn_lab.bench import rl


def test_quick_run_writes_every_phase_of_every_mode(tmp_path):
    argv = ["bench", "rl", "--quick", "--sets", "grpo_math", "--models", "tinylm", "--reps", "1"]
    assert cli(argv + ["--calibration-s", "0.5", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("rl__*.json")
    payload = json.loads(path.read_text())
    rows = payload["rows"]
    assert [r["mode"] for r in rows] == list(rl.STEP_MODES)
    for r in rows:
        assert all(r[f"{phase}_s"] > 0 for phase in rl.PHASES)
        assert r["step_s"] == pytest.approx(sum(r[f"{phase}_s"] for phase in rl.PHASES))
        assert r["tokens_per_s"] > 0 and torch.isfinite(torch.tensor(r["loss"]))
    assert next(r for r in rows if r["mode"] == "flat")["speedup"] == 1.0
    assert payload["grpo"] == rl.GRPO and payload["quick"] is True
    assert [t["target"] for t in payload["targets"]] == ["tinylm grpo_math: auto step x flat"]


def test_step_inputs_count_each_rollout_after_its_group_prompt():
    prompt = [1, 2, 3, 4]
    trie = RolloutTrie.from_sequences([prompt + [5, 6], prompt + [7], [9, 9, 9], prompt + [5, 8, 8]])
    masks, advantages = rl.step_inputs(trie)
    assert [int(m.sum()) for m in masks] == [2, 1, 1, 3]  # the shared prompt is not counted
    assert masks[2].tolist() == [False, True]  # a rollout alone: all but its last token are its prompt
    group = [0, 1, 3]
    assert float(advantages[group].sum()) == pytest.approx(0.0, abs=1e-12)
    assert float(advantages[2]) == 0.0
