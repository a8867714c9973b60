"""dfs walks timed per attention kernel: the walk's mean block rectangle (what picks SDPA or FA4, read as
the engine reads it), the rectangle from which a model's walks run FA4, and the cost model fitting the walks
on each side of it apart (``CostModel.fa4_walks``), carried through refit, refine and a round trip."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import rollout_forests
from tests.test_cost_model import (  # noqa: F401  (fake_device is a fixture)
    DEVICE_PER_CALL,
    HOST_PER_CALL,
    TRUTH,
    fake_device,
    prompt_groups,
    tiny_model,
)
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import (
    CostModel,
    MicroBatchShape,
    block_attention,
    calibrate,
    calibration,
    tree_backward,
)
from treeattn_lab.engine import dfs as engine_dfs
from treeattn_lab.engine.adapters import adapt
from treeattn_lab.engine.block_attention import WalkKernel, fa4_walk_rectangle
from treeattn_lab.engine.time_fit import FORWARD_PAIR_SHARE, FORWARD_TOKEN_SHARE

# per call (host, device constant) of walks that run SDPA and of walks whose blocks are large enough for FA4
KERNEL_PER_CALL = {"sdpa": (HOST_PER_CALL, DEVICE_PER_CALL), "fa4": (4e-5, 2e-5)}


def kernel_truth(shape: MicroBatchShape, fa4_rectangle: int) -> float:
    """A dfs walk on a device whose walks at or above ``fa4_rectangle`` run a kernel cheaper per call."""
    host, device = KERNEL_PER_CALL["fa4" if shape.dfs_walk_rectangle >= fa4_rectangle else "sdpa"]
    _, per_token, per_pair, _ = TRUTH["packed"]
    return sum(max(share * host, share * device + per_token * n + per_pair * p)
               for share, n, p in shape.dfs_call_work)


@pytest.mark.usefixtures("fake_device")
def test_walks_of_each_attention_kernel_are_fitted_apart_and_predicted_by_their_own_costs(monkeypatch):
    rectangles = []

    def fake_tree_backward(model, trie, token_weights, *, mode, block_tokens, token_budget):
        shape = MicroBatchShape.of(trie, block_tokens, token_budget)
        if mode == "dfs":
            rectangles.append(shape.dfs_walk_rectangle)
            seconds = kernel_truth(shape, fa4_rectangle)
        else:
            seconds = sum(a * f for a, f in zip(TRUTH[mode], shape.time_features(mode), strict=True))
        return SimpleNamespace(report=SimpleNamespace(time_s=seconds, peak_memory_bytes=None))

    monkeypatch.setattr(calibration, "tree_backward", fake_tree_backward)
    fa4_rectangle = 1 << 62  # first no walk runs FA4: one fit, as on a CPU
    single = calibrate(tiny_model(), block_tokens=8, token_budget=64, progress=False, use_cache=False)
    assert single.fa4_walks is None and single.fit_info["calibration"]["fa4_rectangle"] is None
    fa4_rectangle = sorted(rectangles)[len(rectangles) // 2]  # then the larger half of the walks do
    monkeypatch.setattr(calibration, "_fa4_rectangle", lambda model: fa4_rectangle)
    fitted = calibrate(tiny_model(), block_tokens=8, token_budget=64, progress=False, use_cache=False)
    assert fitted.fa4_walks["rectangle"] == fa4_rectangle and fitted.identifies("dfs")
    assert fitted.fit_info["dfs"]["fa4_walks"]["rel_rms_residual"] < 0.01
    assert fitted.fit_info["dfs"]["rel_rms_residual"] < 0.01
    assert fitted.host["dfs"][1] == pytest.approx(HOST_PER_CALL, rel=0.05)
    trie = RolloutTrie.from_sequences(prompt_groups(prompts=3, prompt_len=40, samples=5, tail=12, seed=9))
    kernels = set()
    for block in (8, 16, 32, 64):  # sizes and a trie the calibration never ran
        shape = MicroBatchShape.of(trie, block, 64)
        kernels.add(shape.dfs_walk_rectangle >= fa4_rectangle)
        truth = kernel_truth(shape, fa4_rectangle)
        assert fitted.predict(shape, "dfs")[0] == pytest.approx(truth, rel=0.05)
    assert kernels == {False, True}
    again = CostModel.from_dict(json.loads(json.dumps(fitted.to_dict())))
    assert again.fa4_walks == fitted.fa4_walks
    refitted = calibration.refit(again).fa4_walks
    for key in ("time", "host"):
        assert refitted[key] == pytest.approx(fitted.fa4_walks[key], rel=1e-9, abs=1e-15)
    refined = fitted.refine([([(MicroBatchShape.of(trie, 64, 64), "dfs")], 2 * fitted.predict(
        MicroBatchShape.of(trie, 64, 64), "dfs")[0])])
    assert refined.fa4_walks["time"] == pytest.approx([2 * c for c in fitted.fa4_walks["time"]])


def test_the_shape_reads_the_walks_kernel_rectangle_as_the_engine_chooses_it(monkeypatch):
    chosen = []

    def spy(events):
        kernel = walk_kernel(events)
        chosen.append(kernel.mean_rectangle)
        return kernel

    walk_kernel = engine_dfs.walk_kernel
    monkeypatch.setattr(engine_dfs, "walk_kernel", spy)
    trie = RolloutTrie.from_sequences(prompt_groups(prompts=3, prompt_len=40, samples=5, tail=12, seed=4))
    for block in (8, 16, 64):  # the rectangle of the walk a dfs training step runs
        chosen.clear()
        tree_backward(tiny_model(), trie, None, mode="dfs", block_tokens=block, token_budget=64)
        assert chosen and MicroBatchShape.of(trie, block, 64).dfs_walk_rectangle == chosen[0] > 0


def test_the_fa4_rectangle_is_where_the_walk_kernel_rule_turns_to_fa4(monkeypatch):
    assert fa4_walk_rectangle(8, 128, "cpu", torch.bfloat16) is None  # FA4 never runs on a CPU
    monkeypatch.setattr(block_attention, "fa4_takes", lambda device, dtype, head_dim: True)
    for heads, head_dim in ((8, 128), (14, 64), (3, 40)):
        r = fa4_walk_rectangle(heads, head_dim, "cpu", torch.bfloat16)
        assert WalkKernel.choose(r * heads * head_dim, True) == "fa4"
        assert WalkKernel.choose((r - 1) * heads * head_dim, True) == "sdpa"
    adapter = adapt(tiny_model())
    assert (adapter.query_heads, adapter.head_dim) == (4, 8)


@pytest.mark.parametrize("extra, head_dim", [({}, 16), ({"head_dim": 24}, 24)])
def test_a_hugging_face_model_gives_its_query_width(extra, head_dim):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      **extra)
    adapter = adapt(transformers.LlamaForCausalLM(config))
    assert (adapter.query_heads, adapter.head_dim) == (4, head_dim)


@pytest.mark.usefixtures("fake_device")
def test_a_side_with_fewer_than_two_walks_is_not_fitted_apart(monkeypatch):
    rectangles = sorted(set(calibration_rectangles(monkeypatch)))  # each walk's once
    monkeypatch.setattr(calibration, "_fa4_rectangle", lambda model: rectangles[-1])  # one walk runs FA4
    fitted = calibrate(tiny_model(), block_tokens=8, token_budget=64, progress=False, use_cache=False)
    assert fitted.fa4_walks is None and fitted.identifies("dfs")
    monkeypatch.setattr(calibration, "_fa4_rectangle", lambda model: rectangles[-2])  # two do
    assert calibrate(tiny_model(), block_tokens=8, token_budget=64, progress=False,
                     use_cache=False).fa4_walks["rectangle"] == rectangles[-2]


def calibration_rectangles(monkeypatch) -> list[int]:
    """The walk rectangle of every dfs run (repeats included) of a calibration at block 8, budget 64."""
    rectangles = []
    fake = calibration.tree_backward

    def record(model, trie, token_weights, *, mode, block_tokens, token_budget):
        if mode == "dfs":
            rectangles.append(MicroBatchShape.of(trie, block_tokens, token_budget).dfs_walk_rectangle)
        return fake(model, trie, token_weights, mode=mode, block_tokens=block_tokens,
                    token_budget=token_budget)

    monkeypatch.setattr(calibration, "tree_backward", record)
    calibrate(tiny_model(), block_tokens=8, token_budget=64, progress=False, use_cache=False)
    monkeypatch.setattr(calibration, "tree_backward", fake)
    return rectangles


@pytest.mark.usefixtures("fake_device")
def test_the_calibration_cache_tells_apart_a_machine_where_walks_run_fa4(monkeypatch):
    plain = calibration.cache_path(tiny_model(), 8, 64, 64)
    monkeypatch.setattr(calibration, "_fa4_rectangle", lambda model: 1000)
    assert calibration.cache_path(tiny_model(), 8, 64, 64) != plain


@pytest.mark.parametrize("walks, match", [
    ({"rectangle": 10, "time": [0.0, 1.0, 1.0, 1.0]}, "rectangle, time and host"),
    ({"rectangle": -1, "time": [0.0] * 4, "host": [0.0] * 2}, "rectangle"),
    ({"rectangle": 10, "time": [0.0] * 3, "host": [0.0] * 2}, "4 coefficients"),
    ({"rectangle": 10, "time": [0.0] * 4, "host": [0.0, -1.0]}, "finite and >= 0"),
])
def test_cost_model_refuses_bad_fa4_walks(walks, match):
    with pytest.raises(ValueError, match=match):
        CostModel(fa4_walks=walks)


@settings(max_examples=40, deadline=None)
@given(rollout_forests(), st.integers(1, 12))
def test_a_walks_blocks_and_call_work_are_read_off_every_packed_token(seqs, block_tokens):
    trie = RolloutTrie.from_sequences(seqs)
    pack = trie.pack()
    positions = pack.position_ids.tolist()
    for block in engine_dfs.split_blocks(pack, block_tokens, packed_subtrees=True):
        assert block.position == positions[block.start]  # the position of the block's first token
    shape = MicroBatchShape.of(trie, block_tokens)
    _, events = engine_dfs.walk(pack, block_tokens, packed_subtrees=True)
    events = engine_dfs.merge_pushes(events, engine_dfs.PUSH_BLOCKS * block_tokens)
    expected = []
    for event, b in events:  # every token of the call attends its position + 1 keys
        token, pair = (FORWARD_TOKEN_SHARE, FORWARD_PAIR_SHARE) if event == "push" else (1, 1)
        keys = sum(p + 1 for p in positions[b.start : b.end])
        expected.append((token, token * (b.end - b.start), pair * keys))
    assert len(shape.dfs_call_work) == len(expected)
    for work, want in zip(shape.dfs_call_work, expected, strict=True):
        assert work == pytest.approx(want)
