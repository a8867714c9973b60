"""tree_backward fills .grad exactly as flat training on every rollout would, in every mode.

The ground truth is computed independently: each rollout alone through the model's own forward
(TinyLM.forward_padded, or the Hugging Face model's forward with its own attention), the weighted NLL
summed and backpropagated.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import rollout_forests
from tests.engine_models import (
    CASES,
    HF_RTOL,
    VOCAB,
    assert_grads_close,
    enable_hf_checkpointing,
    flat_gradients,
    hf_llama,
    hf_model,
    random_weights,
    tiny_lm,
)
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import (
    MODES,
    CostModel,
    MicroBatchShape,
    calibrate,
    plan_micro_batches,
    tree_backward,
)
from treeattn_lab.engine.nnls import nnls


@given(
    seqs=rollout_forests(max_sequences=6, max_len=14, max_vocab=VOCAB),
    mode=st.sampled_from(MODES + ("auto",)),
    block_tokens=st.integers(1, 6),
    token_budget=st.one_of(st.none(), st.integers(1, 30)),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_tinylm_gradients_equal_flat_training(seqs, mode, block_tokens, token_budget, seed):
    model = tiny_lm()
    weights = random_weights(seqs, seed)
    expected, expected_losses = flat_gradients(model, seqs, weights)
    trie = RolloutTrie.from_sequences(seqs)
    result = tree_backward(
        model, trie, weights, mode=mode, block_tokens=block_tokens, token_budget=token_budget
    )
    assert_grads_close(model, expected, 1e-9)
    torch.testing.assert_close(result.losses, expected_losses, rtol=1e-9, atol=1e-12)
    report = result.report
    assert report.flat_tokens == sum(len(s) for s in seqs)
    if mode == "dfs":
        assert report.grad_tokens == report.tree_tokens  # every tree token runs with grad exactly once
    if mode == "flat":
        assert report.grad_tokens == report.flat_tokens and report.no_grad_tokens == 0


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_checkpointing_composes_with_every_mode(case, mode, checkpointing):
    seqs = CASES[case]
    model = tiny_lm(checkpointing=checkpointing)
    weights = random_weights(seqs, case)
    expected, _ = flat_gradients(model, seqs, weights)
    tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode=mode, block_tokens=3)
    assert_grads_close(model, expected, 1e-9)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_hugging_face_llama_gradients_equal_flat_training(mode, checkpointing):
    model = hf_llama()
    seqs = CASES[0] + [[4, 4, 4, 4, 4, 4, 4], [4, 4, 4, 4, 5]]
    weights = random_weights(seqs, 3)
    expected, expected_losses = flat_gradients(model, seqs, weights)
    if checkpointing:
        enable_hf_checkpointing(model)
    before = model.config._attn_implementation
    result = tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode=mode, block_tokens=2)
    assert_grads_close(model, expected, HF_RTOL)
    torch.testing.assert_close(result.losses, expected_losses, rtol=1e-6, atol=1e-8)
    assert model.config._attn_implementation == before  # the model's own attention is restored


@given(
    seqs=rollout_forests(max_sequences=5, max_len=10, max_vocab=VOCAB),
    mode=st.sampled_from(MODES),
    block_tokens=st.integers(1, 4),
    checkpointing=st.booleans(),
)
@settings(max_examples=8, deadline=None)
def test_hugging_face_llama_on_random_tries(seqs, mode, block_tokens, checkpointing):
    model = hf_llama(seed=2)
    weights = random_weights(seqs, 6)
    expected, _ = flat_gradients(model, seqs, weights)
    if checkpointing:
        enable_hf_checkpointing(model)
    tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode=mode, block_tokens=block_tokens)
    assert_grads_close(model, expected, HF_RTOL)


@pytest.mark.parametrize("mode", MODES)
def test_float32_gradients_within_1e5_of_flat(mode):
    model = tiny_lm(dtype=torch.float32, seed=4)
    seqs = CASES[1]
    weights = random_weights(seqs, 5, dtype=torch.float32)
    expected, _ = flat_gradients(model, seqs, weights)
    tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode=mode, block_tokens=4)
    assert_grads_close(model, expected, 1e-5)


def test_gradients_accumulate_into_existing_grad():
    model, seqs = tiny_lm(), CASES[0]
    weights = random_weights(seqs, 1)
    expected, _ = flat_gradients(model, seqs, weights)
    trie = RolloutTrie.from_sequences(seqs)
    tree_backward(model, trie, weights, mode="dfs", block_tokens=2)
    tree_backward(model, trie, weights, mode="packed")
    assert_grads_close(model, {k: 2 * v for k, v in expected.items()}, 1e-9)


# ------------------------------------------------------------------------------ micro-batching
@given(seqs=rollout_forests(max_sequences=10, max_len=16), budget=st.integers(1, 40))
def test_micro_batches_count_every_rollout_once_within_budget(seqs, budget):
    trie = RolloutTrie.from_sequences(seqs)
    batches = plan_micro_batches(trie, budget)
    ids = [i for mb in batches for i in mb.sequences]
    assert sorted(ids) == list(range(len(seqs)))  # every rollout (hence every token's loss) exactly once
    for mb in batches:
        assert mb.trie.sequences() == [seqs[i] for i in mb.sequences]
        alone = RolloutTrie.from_sequences([seqs[i] for i in mb.sequences])
        assert mb.tree_tokens == alone.stats()["tree_tokens"]
        assert mb.tree_tokens <= budget or len(mb.sequences) == 1
    assert (
        sum(mb.tree_tokens for mb in batches) - sum(mb.carried_tokens for mb in batches)
        == trie.stats()["tree_tokens"]
    )


def test_micro_batches_keep_subtrees_together():
    prompts = [[p] * 5 for p in (1, 2, 3)]
    seqs = [prompt + [10 + j] for j in range(4) for prompt in prompts]  # interleaved on input
    batches = plan_micro_batches(RolloutTrie.from_sequences(seqs), token_budget=9)
    for mb in batches:  # each micro-batch holds one prompt's 4 samples: 5 + 4 tokens
        assert len({seqs[i][0] for i in mb.sequences}) == 1 and len(mb.sequences) == 4


# ------------------------------------------------------------------------------ cost model
def test_prior_falls_back_to_flat_on_low_sharing_and_trees_elsewhere():
    from treeattn_lab.datasets import load_trie

    model = CostModel()
    for name, tree_wins in (("low_sharing", False), ("agentic", True), ("grpo_math", True)):
        shape = MicroBatchShape.of(load_trie(name), 2048, token_budget=16384)
        choice, predictions = model.choose(shape)
        assert (choice != "flat") == tree_wins, (name, predictions)


def test_nnls_recovers_nonnegative_coefficients():
    g = torch.Generator().manual_seed(0)
    A = torch.rand(40, 4, generator=g, dtype=torch.float64)
    truth = torch.tensor([0.5, 0.0, 2.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(nnls(A, A @ truth), truth, atol=1e-9, rtol=0)
    # a target that pulls coefficients negative: the optimum over every support set, found by brute force
    for seed in range(5):
        g.manual_seed(seed)
        b = A @ torch.tensor([1.0, -0.4, 0.0, 0.5], dtype=torch.float64) + 0.1 * torch.randn(
            40, generator=g, dtype=torch.float64
        )
        best = b.norm()
        for support in itertools.product([False, True], repeat=4):
            cols = torch.tensor(support)
            if cols.any():
                sol = torch.linalg.lstsq(A[:, cols], b[:, None]).solution[:, 0]
                if (sol >= 0).all():
                    best = min(best, (A[:, cols] @ sol - b).norm())
        x = nnls(A, b)
        assert (x >= 0).all()
        assert (A @ x - b).norm() <= best + 1e-9


def test_calibration_fits_measurements_and_restores_grads(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    model = tiny_lm(dtype=torch.float32)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    fitted = calibrate(model, block_tokens=16, seconds=30, scale_tokens=96, progress=False)
    assert fitted.calibrated and fitted.samples >= 6
    assert all(c >= 0 for mode in MODES for c in fitted.time[mode])
    assert all(torch.all(p.grad == 7.0) for p in model.parameters())
    assert list(tmp_path.rglob("*.json")), "the calibration is cached"
    again = calibrate(model, block_tokens=16, scale_tokens=96, progress=False)  # from the cache, instantly
    assert again.to_dict() == fitted.to_dict()
    choice, _ = again.choose(MicroBatchShape.of(RolloutTrie.from_sequences(CASES[1]), 16))
    assert choice in MODES


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "tree"}, ValueError, "mode must be one of"),
        ({"block_tokens": 0}, ValueError, "block_tokens must be at least 1"),
        ({"block_tokens": 2.0}, TypeError, "block_tokens must be an int"),
        ({"token_budget": -1}, ValueError, "token_budget must be at least 1"),
        ({"token_weights": [torch.ones(3)]}, ValueError, "token_weights for 2 sequences"),
        ({"token_weights": [torch.ones(3), torch.ones(4)]}, ValueError, r"must have shape \[2\]"),
        ({"token_weights": [torch.ones(3), torch.ones(2, dtype=torch.int64)]}, TypeError, "floating point"),
        ({"token_weights": [torch.ones(3), torch.tensor([1.0, float("nan")])]}, ValueError, "NaN"),
        ({"token_weights": torch.ones(2, 3)}, TypeError, "list of 1-D float tensors"),
        ({"memory_limit": 1e9}, ValueError, "calibrated cost model"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, error, match):
    trie = RolloutTrie.from_sequences([[1, 2, 3], [1, 2]])
    weights = kwargs.pop("token_weights", None)
    with pytest.raises(error, match=match):
        tree_backward(tiny_lm(), trie, weights, **kwargs)


def test_bad_model_and_trie_and_token_ids():
    trie = RolloutTrie.from_sequences([[1, 2, 3]])
    with pytest.raises(TypeError, match="TinyLM or a Hugging Face causal LM"):
        tree_backward(torch.nn.Linear(2, 2), trie)
    with pytest.raises(TypeError, match="trie must be a RolloutTrie"):
        tree_backward(tiny_lm(), [[1, 2, 3]])
    with pytest.raises(ValueError, match="vocabulary size"):
        tree_backward(tiny_lm(), RolloutTrie.from_sequences([[1, VOCAB]]))


def test_inputs_are_not_mutated():
    seqs = CASES[0]
    trie = RolloutTrie.from_sequences(seqs)
    weights = random_weights(seqs, 9)
    before = ([w.clone() for w in weights], trie.to_dict())
    tree_backward(tiny_lm(), trie, weights, mode="auto", block_tokens=2, token_budget=6)
    assert all(torch.equal(a, b) for a, b in zip(before[0], weights, strict=True))
    assert trie.to_dict() == before[1]


def test_hf_attention_restored_after_an_error():
    model = hf_llama()
    before = model.config._attn_implementation
    trie = RolloutTrie.from_sequences([[1, 2, 3]])
    with contextlib.suppress(RuntimeError):
        model.model.embed_tokens.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        tree_backward(model, trie, mode="dfs")
    assert model.config._attn_implementation == before


# ---------------------------------------------------------------------- frozen layers, no_grad, dropout
@pytest.mark.parametrize("mode", MODES + ("auto",))
def test_frozen_bottom_layers_and_frozen_model(mode):
    seqs = CASES[0]
    weights = random_weights(seqs, 11)
    model = tiny_lm()
    model.embed.weight.requires_grad_(False)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    expected, _ = flat_gradients(model, seqs, weights)
    expected = {n: g for n, g in expected.items() if dict(model.named_parameters())[n].requires_grad}
    tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode=mode, block_tokens=2)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{name} is frozen but got a gradient"
    total = torch.sqrt(sum(g.pow(2).sum() for g in expected.values()))
    for name, want in expected.items():
        got = dict(model.named_parameters())[name].grad
        assert (got - want).norm() <= 1e-9 * torch.maximum(want.norm(), 1e-6 * total), name
    for p in model.parameters():
        p.requires_grad_(False)
    result = tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode=mode, block_tokens=2)
    assert torch.isfinite(result.losses).all()  # nothing trainable: losses only, no error


def test_no_grad_context_and_active_dropout_are_refused_clearly():
    trie = RolloutTrie.from_sequences(CASES[0])
    with torch.no_grad(), pytest.raises(RuntimeError, match="outside torch.no_grad"):
        tree_backward(tiny_lm(), trie)
    model = tiny_lm()
    model.blocks[0].mlp.down = torch.nn.Sequential(model.blocks[0].mlp.down, torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match="dropout is active"):
        tree_backward(model, trie, mode="dfs")
    result = tree_backward(
        model,
        trie,
        mode="auto",
        cost_model=CostModel(time={"flat": [0, 1, 0, 0], "packed": [0, 1, 0, 0], "dfs": [0, 0, 0, 0]}),
    )
    assert "dfs" not in result.report.modes  # auto never picks dfs while dropout is active
    model.eval()
    assert tree_backward(model, trie, mode="dfs").report.modes == ["dfs"]


def test_sliding_window_models_run_while_rollouts_fit_the_window():
    model = hf_model("Mistral", num_hidden_layers=1, sliding_window=8)
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6]]
    weights = random_weights(seqs, 12)
    expected, _ = flat_gradients(model, seqs, weights)
    tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode="dfs", block_tokens=2)
    assert_grads_close(model, expected, HF_RTOL)
    with pytest.raises(ValueError, match="sliding window"):
        tree_backward(model, RolloutTrie.from_sequences([list(range(1, 12))]), mode="packed")
