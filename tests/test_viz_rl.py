"""treeattn_lab.lab.viz.rl: the sampled trie with its text on hover, the live GRPO panels, phase times."""

from __future__ import annotations

import html

import pytest
import torch

pytest.importorskip("plotly")

from treeattn_lab.lab.viz.rl import add_grpo_record, draw_grpo_live, draw_phase_times, draw_sampled_trie  # noqa: E402
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
