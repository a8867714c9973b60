"""treeattn_lab.rl.learner_costs: each learner part timed on copies (the trainer is left as it was), calls
timed by size against the tokens each loop computes, and FLOP ratios by hand."""

from __future__ import annotations

import pytest
import torch

from treeattn_lab.engine.time_fit import model_work
from treeattn_lab.reference import TinyLM, TinyLMConfig
from treeattn_lab.rl.grpo import GRPO, GRPOConfig
from treeattn_lab.rl.learner_costs import PARTS, flop_ratios, fresh_trie, learner_parts, seconds_by_size
from treeattn_lab.rl.tasks import AdditionTask
from treeattn_lab.trie import RolloutTrie


def scored_trainer(mode: str):
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64))
    config = GRPOConfig(prompts_per_step=2, group_size=4, beta=0.04, attention_backend="flat")
    trainer = GRPO(model, AdditionTask(digits=1, shots=2), config, mode=mode, seed=0)
    rollouts = trainer.rollouts(0)
    trainer.score(rollouts)
    return trainer, rollouts


@pytest.mark.parametrize("mode, backend", [("flat", None), ("tree", None), ("tree", "reference")])
def test_learner_parts_time_every_part_on_copies(mode, backend):
    trainer, rollouts = scored_trainer(mode)
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    parts = learner_parts(trainer, rollouts, attention_backend=backend, repeats=1)
    assert list(parts) == list(PARTS) and all(seconds >= 0 for seconds in parts.values())
    # timed directly, so never 0; "logprobs" and "layout" are differences of timings (a loaded machine may
    # make a difference 0, never negative)
    assert parts["forward_backward"] > 0 and parts["optimizer"] > 0
    assert all(torch.equal(a, b) for a, b in zip(weights, trainer.model.parameters(), strict=True))
    assert not trainer.optimizer.state and all(p.grad is None for p in trainer.model.parameters())
    assert not rollouts.batch.trie._cache  # every round laid out a fresh copy of the trie


def test_fresh_trie_holds_the_same_rollouts_and_nothing_cached():
    _, rollouts = scored_trainer("tree")
    trie = rollouts.batch.trie
    trie.pack_on("cpu")
    fresh = fresh_trie(trie)
    assert fresh == trie and fresh is not trie and trie._cache and not fresh._cache


def test_seconds_by_size_counts_what_each_loop_computes():
    trainer, rollouts = scored_trainer("tree")
    trie = rollouts.batch.trie
    engines = {"flat": {"mode": "flat"}, "tree": trainer.engine}
    rows = seconds_by_size(trainer.model, trie, 4, engines, prompts=(1, 2), repeats=1)
    assert [(r["loop"], r["prompts"]) for r in rows] == [("flat", 1), ("tree", 1), ("flat", 2), ("tree", 2)]
    for r in rows:
        sub = trie.subtrie(range(4 * r["prompts"]))
        want = sum(sub.seq_lengths) if r["loop"] == "flat" else sub.stats()["tree_tokens"]
        assert r["tokens"] == want and r["seconds"] > 0
    assert all(p.grad is None for p in trainer.model.parameters())  # the gradients went to a copy
    with pytest.raises(ValueError, match="holds 8"):
        seconds_by_size(trainer.model, trie, 4, engines, prompts=(3,), repeats=1)


def test_flop_ratios_by_hand():
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64))
    trie = RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5]])  # 3 shared tokens, then one each
    work = model_work(model)
    token, pair = work["flops_per_token"], work["flops_per_pair"]
    flat = 8 * token + 20 * pair  # two rollouts of 4 tokens, 1 + 2 + 3 + 4 causal pairs each
    ratios = flop_ratios(model, trie)
    assert ratios["token_ratio"] == pytest.approx(8 / 5)
    assert ratios["attention_share_flat"] == pytest.approx(20 * pair / flat)
    assert ratios["tree_kernel"] == pytest.approx(flat / (5 * token + (1 + 2 + 3 + 4 + 4) * pair))
    assert ratios["flat"] == pytest.approx(flat / (5 * token + 20 * pair))  # both leaves run whole
    assert ratios["reference"] == pytest.approx(flat / (5 * token + 25 * pair))  # the packed row's 5 x 5
