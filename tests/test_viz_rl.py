"""treeattn_lab.lab.viz.rl: the sampled trie with its text on hover, the live GRPO panels, phase times."""

from __future__ import annotations

import html

import pytest
import torch

pytest.importorskip("plotly")

from treeattn_lab.lab.viz.rl import (  # noqa: E402
    add_grpo_record,
    draw_greedy_gains,
    draw_grpo_live,
    draw_learner_parts,
    draw_phase_times,
    draw_reward_curves,
    draw_sampled_trie,
    draw_seconds_by_tokens,
    line_fit,
)
from treeattn_lab.reference import TinyLM, TinyLMConfig  # noqa: E402
from treeattn_lab.rl import sample  # noqa: E402
from treeattn_lab.rl.tasks import AdditionTask  # noqa: E402


def _record(mode, step, reward, logprobs, train):
    return {"mode": mode, "step": step, "reward": reward,
            "times_s": {"sample": 0.5, "reward": 0.01, "logprobs": logprobs, "train": train}}


def test_sampled_trie_hover_shows_text_and_rewards():
    task = AdditionTask(digits=1, shots=2)
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32))
    problems = task.problems(2, seed=0)
    batch = sample(model, task.prompt_ids(problems), num_samples=3, max_new_tokens=3,
                   generator=torch.Generator().manual_seed(0))
    rewards = torch.arange(6, dtype=torch.float32) / 10
    fig = draw_sampled_trie(batch, task.tokenizer.decode, rewards)
    nodes = next(t for t in fig.data if t.name == "nodes")
    assert len(nodes.text) == batch.trie.num_nodes + 1
    index = list(nodes.customdata)
    for i in range(batch.num_rollouts):  # a rollout's nodes, read in order, spell its text
        path = batch.trie.path(batch.trie.seq_end_node[i])
        spelled = "".join(nodes.text[index.index(n)].split("<br>")[1] for n in path)
        text = task.tokenizer.decode(batch.trie.sequence(i))
        assert spelled == html.escape(text).replace("\n", "⏎")
    assert "⏎" in "".join(nodes.text)  # newlines shown, not raw
    leaf = batch.trie.seq_end_node[4]
    assert "rewards: " in nodes.text[list(nodes.customdata).index(leaf)] and "0.40" in "".join(nodes.text)


def test_live_panels_and_phase_times():
    fig = draw_grpo_live()
    add_grpo_record(fig, _record("flat", 0, 0.25, 0.4, 1.0))
    add_grpo_record(fig, _record("tree", 0, 0.25, 0.1, 0.3))
    add_grpo_record(fig, _record("tree", 1, 0.5, 0.1, 0.2))
    tree = [t for t in fig.data if t.name == "tree"]
    assert list(tree[0].y) == [0.25, 0.5] and list(tree[1].y) == pytest.approx([0.4, 0.3])
    assert list(tree[1].x) == [0, 1]
    with pytest.raises(ValueError, match="no lines for the loop 'dfs'"):
        add_grpo_record(fig, _record("dfs", 0, 0.0, 0.1, 0.1))
    histories = {"flat": [_record("flat", i, 0, 0.4 + i, 1.0) for i in range(3)],
                 "tree": [_record("tree", i, 0, 0.1, 0.3) for i in range(3)]}
    bars = {t.name: list(t.y) for t in draw_phase_times(histories).data}
    assert bars["log-probs"] == pytest.approx([1.9, 0.1])  # step 0 left out: (1.4 + 2.4) / 2
    assert bars["train"] == pytest.approx([1.0, 0.3])
    assert draw_phase_times(histories, skip_first=False).data[2].y[0] == pytest.approx(1.4)


def test_learner_parts_stack_to_the_total():
    parts = {"flat": {"layout": 0.0, "logprobs": 0.3, "forward_backward": 0.9, "optimizer": 0.01},
             "tree": {"layout": 0.005, "logprobs": 0.05, "forward_backward": 0.12, "optimizer": 0.01}}
    fig = draw_learner_parts(parts)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.name for b in bars] == ["laying the trie out", "log-prob passes", "forward + backward",
                                      "clip + AdamW step"]
    assert [b.y[1] for b in bars] == pytest.approx([0.005, 0.05, 0.12, 0.01])
    (totals,) = [t for t in fig.data if t.type == "scatter"]
    assert list(totals.text) == ["1.210 s", "0.185 s"] and fig.layout.barmode == "stack"


def test_seconds_by_tokens_fits_a_line_per_loop():
    rows = [{"loop": loop, "prompts": k, "tokens": k * per, "seconds": floor + 1e-5 * k * per}
            for loop, per, floor in (("flat", 400, 0.001), ("tree", 60, 0.004)) for k in (1, 2, 4)]
    assert line_fit([r for r in rows if r["loop"] == "tree"]) == pytest.approx((0.004, 1e-5))
    fig = draw_seconds_by_tokens(rows)
    names = [t.name for t in fig.data]
    assert names == ["flat", "flat: 1.0 ms + 10 µs/token", "tree", "tree: 4.0 ms + 10 µs/token"]
    assert list(fig.data[2].x) == [60, 120, 240] and fig.data[3].y[0] == pytest.approx(0.004)


def _result():
    steps = [{"seed": seed, "mode": loop, "step": step, "reward": 0.1 * step + seed}
             for seed in (0, 1) for loop in ("flat", "tree") for step in (1, 0, 2)]
    rows = [{"seed": seed, "loop": loop, "eval_before": 0.2, "eval_after": 0.5 + 0.1 * seed}
            for seed in (0, 1) for loop in ("flat", "tree")]
    return {"config": {"seeds": [0, 1]}, "steps": steps, "rows": rows}


def test_reward_curves_one_panel_per_seed_tree_dashed():
    fig = draw_reward_curves(_result())
    assert len(fig.data) == 4 and [a.text for a in fig.layout.annotations] == ["seed 0", "seed 1"]
    flat0, tree0, flat1, _ = fig.data
    assert list(flat0.x) == [0, 1, 2] and list(flat1.y) == pytest.approx([1.0, 1.1, 1.2])
    assert tree0.line.dash == "dash" and flat0.line.dash == "solid"
    assert [t.showlegend for t in fig.data] == [True, True, False, False]


def test_greedy_gains_before_and_after_per_seed():
    fig = draw_greedy_gains(_result()["rows"])
    assert [t.name for t in fig.data] == ["after the warm-up", "flat, after GRPO", "tree, after GRPO"]
    assert list(fig.data[0].x) == ["seed 0", "seed 1"] and list(fig.data[0].y) == [0.2, 0.2]
    assert list(fig.data[2].y) == pytest.approx([0.5, 0.6]) and fig.layout.barmode == "group"
    one_loop = draw_greedy_gains([r for r in _result()["rows"] if r["loop"] == "tree"])
    assert list(one_loop.data[1].y) == [None, None] and list(one_loop.data[2].y) == pytest.approx([0.5, 0.6])
