"""The engine under a model whose layers are compiled (``engine.compile_layers``).

The engine's per-layer attention is opaque to torch.compile (``engine/attention.py``),
so each compiled layer is a few graphs around one eager attention call, shared by every layer and every
DFS block: gradients equal the eager flat ground truth in float64, a step neither recompiles per
layer nor per block, no graph takes a float from the host, and a compiled step reads no more values
back to the host than an eager one.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters

from tests.engine_models import (
    HF_RTOL,
    VOCAB,
    assert_grads_close,
    flat_gradients,
    hf_llama,
    hf_model,
    random_weights,
)
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import MODES, compile_layers, tree_backward, tree_logprobs
from treeattn_lab.engine.dfs import PUSH_BLOCKS, walk
from treeattn_lab.reference import TinyLM, TinyLMConfig


def _model(n_layers: int, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=48)
    return TinyLM(cfg).double()


def _rollouts(seed: int) -> list[list[int]]:
    """Rollouts sharing a prompt, two of them branching again, of awkward lengths."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(9, 23))]
    seqs = []
    for _ in range(rng.randint(3, 5)):
        answer = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 17))]
        seqs.append(prompt + answer)
        if rng.random() < 0.6:
            seqs.append(prompt + answer[:3] + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))])
    return seqs


def _compile_blocks(model) -> None:
    torch._dynamo.reset()
    counters.clear()
    assert compile_layers(model, backend="aot_eager") is model


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("mode", ["dfs", "packed", "flat"])
def test_compiled_layers_train_exactly(mode):
    seed = 1000 + ["dfs", "packed", "flat"].index(mode)
    seqs = _rollouts(seed)
    weights = random_weights(seqs, seed)
    model = _model(3, seed)
    expected, _ = flat_gradients(model, seqs, weights)
    _compile_blocks(model)
    model.zero_grad(set_to_none=True)
    trie = RolloutTrie.from_sequences(seqs)
    tree_backward(model, trie, weights, mode=mode, block_tokens=8, token_budget=64)
    assert_grads_close(model, expected, 1e-10)
    assert _graphs() > 0  # the layers really ran compiled


def test_compiled_graphs_are_shared_by_layers_and_blocks():
    """As many graphs for 2 layers as for 4, far fewer graphs than layer calls, and a second step on the
    same trie compiles nothing. (What may add graphs: grad mode, on in a pop and off in a push, the
    first length a graph meets, compiled static before the length turns symbolic, and torch's 0/1 size
    specialization, a 1-token block: a bounded number, never one per block.)"""
    seqs = _rollouts(7)
    trie = RolloutTrie.from_sequences(seqs)
    _, events = walk(trie.pack(), 8, packed_subtrees=True, push_blocks=PUSH_BLOCKS)
    found = {}
    for n_layers in (2, 4):
        model = _model(n_layers, 7)
        _compile_blocks(model)
        tree_backward(model, trie, mode="dfs", block_tokens=8)
        found[n_layers] = _graphs()
        model.zero_grad(set_to_none=True)
        tree_backward(model, trie, mode="dfs", block_tokens=8)
        assert _graphs() == found[n_layers], "a second step recompiled the layers"
        assert found[n_layers] * 3 < len(events) * n_layers
    assert found[2] == found[4]


def test_compiled_layers_give_the_same_logprobs_depth_first():
    seqs = _rollouts(11)
    trie = RolloutTrie.from_sequences(seqs)
    model = _model(2, 11)
    eager = tree_logprobs(model, trie, mode="dfs", block_tokens=8)
    _compile_blocks(model)
    compiled = tree_logprobs(model, trie, mode="dfs", block_tokens=8)
    assert _graphs() > 0
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_compiled_hugging_face_layers_train_exactly():
    seqs = _rollouts(21)
    weights = random_weights(seqs, 21)
    model = hf_llama(seed=21)
    expected, _ = flat_gradients(model, seqs, weights)
    _compile_blocks(model)
    tree_backward(model, RolloutTrie.from_sequences(seqs), weights, mode="dfs", block_tokens=8)
    assert_grads_close(model, expected, HF_RTOL)
    assert _graphs() > 0


def test_compiled_hugging_face_graphs_do_not_depend_on_the_layer():
    """The registered HF attention is opaque too: no graph guards on ``module.layer_idx``, so a 3-layer
    model compiles as many graphs as a 2-layer one."""
    trie = RolloutTrie.from_sequences(_rollouts(23))
    found = {}
    for n_layers in (2, 3):
        model = hf_model("Llama", seed=23, num_hidden_layers=n_layers)
        _compile_blocks(model)
        tree_backward(model, trie, mode="dfs", block_tokens=8)
        found[n_layers] = _graphs()
    assert found[2] == found[3] > 0


def _block_lengths(trie, block_tokens: int, event: str) -> set[int]:
    _, events = walk(trie.pack(), block_tokens, packed_subtrees=True, push_blocks=PUSH_BLOCKS)
    return {b.end - b.start for e, b in events if (e == "push") == (event == "push")}


def test_a_trie_of_new_block_lengths_compiles_nothing():
    """Once a dfs step has run blocks of two lengths with autograd and two without, a trie whose blocks
    all have lengths never seen before runs on the same graphs: the token count is a symbolic size."""
    first, second = (RolloutTrie.from_sequences(_rollouts(seed)) for seed in (42, 62))
    for event in ("push", "run"):
        seen, new = _block_lengths(first, 8, event), _block_lengths(second, 12, event)
        assert len(seen) >= 2 and new and not new & seen and min(new) > 1  # what the test stands on
    model = _model(2, 42)
    _compile_blocks(model)
    tree_backward(model, first, mode="dfs", block_tokens=8)
    graphs, frames = _graphs(), counters["frames"]["total"]
    tree_backward(model, second, mode="dfs", block_tokens=12)
    assert _graphs() == graphs, "blocks of new lengths compiled new graphs"
    assert counters["frames"]["total"] == frames, "blocks of new lengths made dynamo compile again"


def _recording(inputs: list):
    """A torch.compile backend that runs each graph as traced and records the inputs it is called with."""

    def backend(gm, example_inputs):
        inputs.extend(example_inputs)
        return gm.forward

    return backend


@pytest.mark.parametrize("make", [lambda: _model(2, 31), lambda: hf_llama(seed=31)], ids=["tinylm", "hf"])
def test_compiled_layers_take_no_float_from_the_host(make):
    """No graph of a compiled layer takes a float (a norm's eps) as an input: dynamo would build it into
    a 0-d CPU tensor on every call, which inductor's GPU kernels read back with ``.item()``."""
    model, inputs = make(), []
    torch._dynamo.reset()
    compile_layers(model, backend=_recording(inputs))
    trie = RolloutTrie.from_sequences(_rollouts(31))
    for mode in MODES:
        tree_backward(model, trie, mode=mode, block_tokens=8)
    assert inputs, "the layers ran compiled"
    floats = [x for x in inputs if isinstance(x, (float, torch.SymFloat))]
    scalars = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 0]
    assert not floats and not scalars, f"graph inputs read from the host: {floats + scalars}"


def test_compile_layers_refuses_what_the_engine_cannot_run():
    with pytest.raises(TypeError, match="TinyLM or a Hugging Face causal LM"):
        compile_layers(torch.nn.Linear(2, 2))
