"""tree_logprobs equals every rollout's own log-probs (and entropies), in every mode, for TinyLM and for
Hugging Face Llama and Qwen2; it runs without autograd, writes no gradient and never holds full logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import rollout_forests
from tests.engine_models import (
    CASES,
    HF_RTOL,
    VOCAB,
    flat_entropies,
    flat_logprobs,
    hf_llama,
    hf_qwen2,
    tiny_lm,
)
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import MODES, lm_head, tree_logprobs


def assert_logps_close(got, want, rtol, atol):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        assert not g.requires_grad
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol, msg=f"rollout {i}")


@given(
    seqs=rollout_forests(max_sequences=6, max_len=14, max_vocab=VOCAB),
    mode=st.sampled_from(MODES + ("auto",)),
    block_tokens=st.integers(1, 6),
    token_budget=st.one_of(st.none(), st.integers(1, 30)),
    chunk_rows=st.sampled_from([1, 3, 4096]),
    seed=st.integers(0, 2**8),
)
@settings(max_examples=25, deadline=None)
def test_tinylm_logprobs_and_entropies_equal_flat(seqs, mode, block_tokens, token_budget, chunk_rows, seed):
    model = tiny_lm(seed=seed)
    trie = RolloutTrie.from_sequences(seqs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_head, "CHUNK_ROWS", chunk_rows)  # the head by chunks of 1 or 3 rows, or all at once
        logps, entropies = tree_logprobs(
            model, trie, mode=mode, block_tokens=block_tokens, token_budget=token_budget, entropy=True
        )
    assert all(lp.dtype == torch.float64 for lp in logps)
    assert_logps_close(logps, flat_logprobs(model, seqs), 1e-9, 1e-11)
    assert_logps_close(entropies, flat_entropies(model, seqs), 1e-9, 1e-11)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", MODES + ("auto",))
@pytest.mark.parametrize("make", [hf_llama, hf_qwen2], ids=["llama", "qwen2"])
def test_hugging_face_logprobs_equal_flat(mode, make):
    model = make()
    seqs = CASES[0] + [[4, 4, 4, 4, 4, 4, 4], [4, 4, 4, 4, 5]] + CASES[1][:3]
    before = model.config._attn_implementation
    logps = tree_logprobs(model, RolloutTrie.from_sequences(seqs), mode=mode, block_tokens=3, token_budget=40)
    assert_logps_close(logps, flat_logprobs(model, seqs), HF_RTOL, 1e-6)
    assert model.config._attn_implementation == before
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_float32_model_gives_float32_logprobs(mode):
    model = tiny_lm(dtype=torch.float32, seed=3)
    seqs = CASES[1]
    logps = tree_logprobs(model, RolloutTrie.from_sequences(seqs), mode=mode, block_tokens=4)
    assert all(lp.dtype == torch.float32 for lp in logps)
    assert_logps_close(logps, flat_logprobs(model, seqs), 1e-5, 1e-5)


def test_dfs_holds_one_block_of_logits_and_packed_the_head_chunk(monkeypatch):
    """The head never sees more rows than a chunk (packed) or than one block's entries (dfs)."""
    seqs = [list(range(1, 25)) + [k] for k in range(30, 40)]
    trie = RolloutTrie.from_sequences(seqs)
    model = tiny_lm()
    rows_seen: list[int] = []
    model.head.register_forward_hook(lambda mod, args, out: rows_seen.append(out.shape[0]))
    monkeypatch.setattr(lm_head, "CHUNK_ROWS", 5)
    tree_logprobs(model, trie, mode="packed")
    assert max(rows_seen) <= 5 and sum(rows_seen) == 23 + 10  # in the prompt, then its 10 children
    rows_seen.clear()
    monkeypatch.setattr(lm_head, "CHUNK_ROWS", 10_000)
    tree_logprobs(model, trie, mode="dfs", block_tokens=4)
    assert max(rows_seen) == 3 + 10  # the prompt's last block: 3 entries inside it, 10 for its children


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_each_tree_token_runs_once(mode):
    prompt = [1, 2, 3, 4, 5, 6]
    seqs = [prompt + [7, 8], prompt + [9, 10], prompt + [11, 12], prompt + [7, 8]]  # equal leaves: no pads
    model = tiny_lm()
    rows: list[int] = []
    model.embed.register_forward_hook(lambda mod, args, out: rows.append(args[0].numel()))
    tree_logprobs(model, RolloutTrie.from_sequences(seqs), mode=mode, block_tokens=4)
    assert sum(rows) == 6 + 3 * 2  # the prompt once, each distinct completion once


def test_dfs_logprob_pass_holds_the_path_keys_and_values_only():
    from treeattn_lab.engine.adapters import adapt
    from treeattn_lab.engine.dfs import dfs_logprobs, run_dfs, walk
    from treeattn_lab.engine.loss_plan import LossPlan

    model = tiny_lm()
    pack = RolloutTrie.from_sequences(CASES[1]).pack()
    plan = LossPlan.from_pack(pack)
    out = dfs_logprobs(adapt(model), pack, plan, 4)
    cfg = model.cfg
    row = 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.dim // cfg.n_heads) * 8  # float64 K and V of a position
    longest = int(pack.seq_lengths.max())
    keys = max(b.position + b.end - b.start for _, b in walk(pack, 4)[1])  # the widest event's keys
    assert longest < keys <= longest + 4  # a span of leaves reaches past the longest rollout
    assert out["path_bytes"] == keys * row  # the stacks, no gradient buffers
    trained = run_dfs(adapt(model), pack, plan, 4)["path_bytes"]
    assert trained == keys * row + longest * row  # training keeps fp64 grads of the longest path beside


def test_inputs_untouched_and_bad_arguments_refused():
    trie = RolloutTrie.from_sequences(CASES[0])
    before = trie.to_dict()
    model = tiny_lm()
    tree_logprobs(model, trie, mode="dfs", block_tokens=2)
    assert trie.to_dict() == before
    with pytest.raises(TypeError, match="entropy must be a bool"):
        tree_logprobs(model, trie, entropy="yes")
    with pytest.raises(ValueError, match="mode must be one of"):
        tree_logprobs(model, trie, mode="tree")
    with pytest.raises(ValueError, match="vocabulary size"):
        tree_logprobs(model, RolloutTrie.from_sequences([[1, VOCAB]]))
    with pytest.raises(TypeError, match="trie must be a RolloutTrie"):
        tree_logprobs(model, [[1, 2]])


def test_a_cost_model_of_the_wrong_type_is_refused():
    trie = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(TypeError, match="cost_model must be a treeattn_lab.engine.CostModel"):
        tree_logprobs(tiny_lm(), trie, cost_model="x")
