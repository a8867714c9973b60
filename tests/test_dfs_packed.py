"""DFS of packed subtrees: the walk the engine runs (every tree token once with autograd, only the spine
pushed, every call within the block budget), the attention mask of a packed span (exactly the pack's tree
rule beside the stored prefix), exact gradients with never-written path slots poisoned with NaN, and the
``bench train`` pieces that measure it (scaled sets, the profiler row, memory-limited auto, targets)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import long_forest, orders, rollout_forests
from tests.engine_models import CASES, assert_grads_close, flat_gradients, random_weights, tiny_lm
from treeattn_lab import RolloutTrie
from treeattn_lab.bench import train as bench_train
from treeattn_lab.bench.report import render_train, renderer_for
from treeattn_lab.bench.step_profile import profile_step
from treeattn_lab.engine import MODES, CostModel, MicroBatchShape, block_attention, tree_backward
from treeattn_lab.engine import dfs as engine_dfs
from treeattn_lab.engine.adapters import adapt
from treeattn_lab.engine.time_fit import model_work
from treeattn_lab.ops.fa4_tree import fa4_available
from treeattn_lab.patterns.tree import tree_visibility
from treeattn_lab.reference import TinyLM, TinyLMConfig

FA4_HERE = torch.cuda.is_available() and fa4_available("cuda")

# two prompts; below the first, small subtrees (packed whole at 8 tokens) beside one too large for a block
SUBTREES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13],
    [1, 2, 3, 4, 5, 6, 20, 21, 22],
    [1, 2, 3, 4, 5, 6, 20, 21, 23, 24],
    [1, 2, 3, 4, 5, 6, 20, 25],
    [1, 2, 3, 4, 5, 6, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
    [1, 2, 3, 4, 5, 6, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 41, 42],
    [1, 2, 3],
    [9, 8, 7, 6],
    [9, 8, 7, 6, 5],
]


def grad_ranges(events):
    return sorted((b.start, b.end) for e, b in events if e != "push")


@given(rollout_forests(max_sequences=8, max_len=16), orders, st.integers(1, 9))
@settings(max_examples=60)
def test_packed_walk_runs_every_token_once_within_the_budget(seqs, order, block_tokens):
    pack = RolloutTrie.from_sequences(seqs).pack(order=order)
    blocks, events = engine_dfs.walk(pack, block_tokens, push_blocks=engine_dfs.PUSH_BLOCKS)
    _, chains = engine_dfs.walk(pack, block_tokens, packed_subtrees=False)
    covered = [t for a, b in grad_ranges(events) for t in range(a, b)]
    assert covered == list(range(pack.num_tokens))  # every tree token with autograd exactly once
    for event, b in events:
        budget = engine_dfs.PUSH_BLOCKS * block_tokens if event == "push" else block_tokens
        assert 0 < b.end - b.start <= budget
        if event == "push":
            assert b.has_children and not b.tree  # only the spine is pushed, a chain of blocks at a time
        if event == "pop":
            assert b in blocks  # ... and popped block by block
    pushed = [b for e, b in events if e == "push"]
    pushed_tokens = [t for b in pushed for t in range(b.start, b.end)]
    assert pushed_tokens == [t for b in blocks if b.has_children for t in range(b.start, b.end)]
    assert len(events) <= len(chains)
    assert sum(b.end - b.start for b in pushed) <= sum(b.end - b.start for e, b in chains if e == "push")
    subtree_end = pack.subtree_end.tolist()
    for _, b in events:  # a span's prefix is the stack: exactly the ancestors of its first token
        ancestors = [k for k in range(b.start) if subtree_end[k] > b.start]
        assert len(ancestors) == b.position
        assert all(subtree_end[k] >= b.end for k in ancestors)  # ... and of every token in the span


@given(rollout_forests(max_sequences=8, max_len=16), orders, st.integers(1, 9), st.booleans(),
       st.sampled_from([1, engine_dfs.PUSH_BLOCKS]))
@settings(max_examples=60)
def test_a_block_sees_the_whole_prefix_and_the_tree_rule_inside_it(seqs, order, block_tokens, packed, pushes):
    pack = RolloutTrie.from_sequences(seqs).pack(order=order)
    subtree_end = pack.subtree_end
    visible = tree_visibility(subtree_end)  # [T, T]: the pack's rule
    for _, b in engine_dfs.walk(pack, block_tokens, packed_subtrees=packed, push_blocks=pushes)[1]:
        n, p = b.end - b.start, b.position
        ancestors = [k for k in range(b.start) if subtree_end[k] > b.start]  # the stored prefix
        assert len(ancestors) == p
        mask = block_attention.span_mask(subtree_end, b.start, b.end, p)
        want = visible[b.start : b.end][:, ancestors + list(range(b.start, b.end))]
        assert mask.shape == (n, p + n) and torch.equal(mask, want)
        if not b.tree:  # a chain (merged pushes too): causal after the prefix is the rule
            assert torch.equal(mask[:, p:], torch.ones(n, n, dtype=torch.bool).tril())
        bias = block_attention.additive_mask(mask, torch.float32)  # what the layers attend under on SDPA
        assert torch.equal(bias == 0, mask) and bool(torch.isneginf(bias[~mask]).all())
        assert bias.stride(0) % 16 == 0


def test_a_walk_runs_one_kernel_chosen_by_its_mean_block(monkeypatch):
    q = torch.zeros(1, 5, 8, 128, dtype=torch.bfloat16)  # 8 heads of 128: work = rectangle x 1024
    rectangles = [2**20, 6 * 2**23 - 2**20, 3 * 2**23, 3 * 2**23]  # mean 3 x 2^23
    assert block_attention.WalkKernel(rectangles).mean_rectangle == 3 * 2**23
    assert block_attention.WalkKernel([]).mean_rectangle == 0
    assert block_attention.WalkKernel(rectangles)(q) == "sdpa"  # no FA4 on this machine
    monkeypatch.setattr(block_attention, "runs_fa4", lambda q: True)
    assert block_attention.WalkKernel(rectangles)(q) == "fa4"  # 3 x 2^23 x 1024 = the threshold
    assert block_attention.WalkKernel(rectangles[:-1] + [3 * 2**23 - 4])(q) == "sdpa"  # just below it
    assert block_attention.WalkKernel([2**20] * 7 + [2**29])(q) == "fa4"  # one large block pays for all
    walk_kernel = block_attention.WalkKernel(rectangles)
    assert walk_kernel(q) == "fa4"
    monkeypatch.setattr(block_attention, "runs_fa4", lambda q: False)
    assert walk_kernel(q) == "fa4"  # decided once: every later event and layer of the walk runs it
    pack = RolloutTrie.from_sequences(SUBTREES).pack()
    events = engine_dfs.walk(pack, 8)[1]  # the blocks before pushes merge
    kernel = engine_dfs.walk_kernel(events)
    want = [(b.end - b.start) * (b.end - b.start + b.position) for _, b in events]
    assert kernel.mean_rectangle == sum(want) // len(want)
    merged = engine_dfs.walk(pack, 8, push_blocks=engine_dfs.PUSH_BLOCKS)[1]
    assert len(merged) < len(events)  # the training walk merges pushes; its kernel is the same walk's
    state = engine_dfs._path_state(adapt(small_model()), pack, events, kernel, with_grads=False)
    assert all(engine_dfs.attention_of(state, b).kernel is kernel for _, b in merged)


class NanPath(engine_dfs.PathState):
    """A path whose K/V start as NaN: a slot read before it is written poisons the gradients."""

    def ensure(self, layer, like):
        fresh = self.k[layer] is None
        super().ensure(layer, like)
        if fresh:
            self.k[layer].fill_(float("nan"))
            self.v[layer].fill_(float("nan"))


@pytest.mark.parametrize("block_tokens", [1, 3, 8, 64])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_subtrees_equal_flat_with_unwritten_slots_poisoned(block_tokens, checkpointing, monkeypatch):
    seqs = SUBTREES + CASES[0]
    pack = RolloutTrie.from_sequences(seqs).pack()
    events = engine_dfs.walk(pack, block_tokens, push_blocks=engine_dfs.PUSH_BLOCKS)[1]
    if block_tokens == 8:  # packed subtrees and spans of siblings, beside pushed chains
        assert any(b.tree for _, b in events) and any(e == "push" for e, _ in events)
    model = tiny_lm(seed=3, checkpointing=checkpointing)
    weights = random_weights(seqs, 13)
    expected, expected_losses = flat_gradients(model, seqs, weights)
    monkeypatch.setattr(engine_dfs, "PathState", NanPath)
    result = tree_backward(
        model, RolloutTrie.from_sequences(seqs), weights, mode="dfs", block_tokens=block_tokens
    )
    assert_grads_close(model, expected, 1e-9)
    torch.testing.assert_close(result.losses, expected_losses, rtol=1e-9, atol=1e-12)
    assert result.report.grad_tokens == result.report.tree_tokens
    recomputed = sum(b.end - b.start for e, b in events if e == "push")
    assert result.report.no_grad_tokens == recomputed


def test_cost_model_reads_the_packed_walk():
    trie = RolloutTrie.from_sequences(bench_train.rollout_set("agentic", shrink=32))
    shape = MicroBatchShape.of(trie, 128)
    pack = trie.pack()
    chains = engine_dfs.walk(pack, 128, packed_subtrees=False)[1]
    packed = engine_dfs.walk(pack, 128, push_blocks=engine_dfs.PUSH_BLOCKS)[1]
    assert shape.dfs_calls == len(packed) < len(chains)
    assert shape.recomputed_tokens == sum(b.end - b.start for e, b in packed if e == "push")
    assert shape.max_block == max(b.end - b.start for e, b in packed if e != "push") <= 128
    assert any(b.end - b.start > 128 for e, b in packed if e == "push")  # a chain of pushes in one call


# ------------------------------------------------------------------------------------ bench train
def test_rollout_sets_scaled_down_and_copied():
    base = RolloutTrie.from_sequences(bench_train.rollout_set("agentic"))
    small = RolloutTrie.from_sequences(bench_train.rollout_set("agentic", shrink=32))
    assert small.num_nodes == base.num_nodes and small.num_sequences == base.num_sequences
    assert small.stats()["tree_tokens"] < base.stats()["tree_tokens"] / 20
    copies = RolloutTrie.from_sequences(bench_train.rollout_set("agentic_x4", shrink=32))
    assert copies.num_sequences == 4 * small.num_sequences
    assert copies.stats()["tree_tokens"] == 4 * small.stats()["tree_tokens"] + 4  # one new first token each


def small_model():
    torch.manual_seed(0)
    cfg = TinyLMConfig(vocab_size=32000, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16)
    return TinyLM(cfg)


def test_profile_row_counts_ops_and_host_reads():
    model = small_model()
    trie = RolloutTrie.from_sequences(bench_train.rollout_set("agentic", shrink=256, first=6))
    row = profile_step(model, trie, mode="dfs", block_tokens=16, token_budget=64)
    assert row["mode"] == "dfs" and row["aten_ops"] > 0
    assert row["host_reads"] > 0  # the dfs walk reads block and path bounds off the pack
    assert "device_syncs" not in row  # a CPU has no device to wait for
    assert row["wall_s"] > 0 and row["profiled_wall_s"] > 0
    assert all(p.grad is None for p in model.parameters())  # the profiled calls leave no gradient behind


def test_memory_limited_auto_on_a_large_set_chooses_dfs_and_meets_its_targets():
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    prior = CostModel()
    fitted = CostModel(
        time=prior.time,
        memory={"flat": [0.0, 1e6, 0.0], "packed": [0.0, 1e6, 0.0], "dfs": [0.0, 1e3, 1e3]},
        calibrated=True,
        fit_info={m: {"memory": "nnls"} for m in MODES},
    )
    assert bench_train.measures_memory(fitted) and not bench_train.measures_memory(prior)
    rows = bench_train.train_rows(
        model, optimizer, fitted, ["agentic_x2"], quick=True, reps=1, memory_limit=1e6,
        block_tokens=32, token_budget=256,
    )  # fmt: skip
    assert [r["mode"] for r in rows] == ["flat", "auto"]
    auto = rows[1]
    assert auto["choices"].startswith("dfs@") and auto["memory_limit_gib"] == pytest.approx(1e6 / 2**30)
    checks = bench_train.targets(rows, [], [{"set": "agentic", "mode": "dfs", "busy_share": 0.9}])
    names = {c["target"]: c for c in checks}
    assert names["agentic_x2: auto chose dfs"]["met"]
    assert f"agentic_x2: auto ({auto['choices']}) >= 1.0 x flat" in names
    assert names["agentic: GPU busy (kernel time / wall) of a dfs step >= 0.85"]["met"]


def test_a_memory_limit_that_cannot_act_stops_the_bench_before_any_work(tmp_path, monkeypatch):
    def run(sets):
        bench_train.main(["--quick", "--sets", sets, "--memory-limit-gib", "1", "--calibration-s", "0.5",
                          "--out", str(tmp_path)])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's message, on any machine
    monkeypatch.setattr(bench_train, "calibrate", lambda *a, **kw: pytest.fail("calibrated first"))
    with pytest.raises(SystemExit, match="applies to the large sets .* --sets agentic has none"):
        run("agentic")
    with pytest.raises(SystemExit, match="peak memory, measured on CUDA only, not cpu"):
        run("agentic_x2")
    monkeypatch.setattr(bench_train, "check_memory_limit_applies", lambda sets, device: None)
    monkeypatch.setattr(bench_train, "calibrate", lambda *a, **kw: CostModel())  # nothing measured
    with pytest.raises(SystemExit, match="--memory-limit-gib needs .* peak memory measured.*--calibration-s"):
        run("agentic_x2")
    assert not list(tmp_path.iterdir())


def test_a_run_cut_short_keeps_its_rows_and_its_cost_model(tmp_path, monkeypatch):
    steps = []

    def step(model, optimizer, trie, *, mode, **kw):
        if len(steps) == 2:
            raise RuntimeError("cut short")
        steps.append(mode)
        return {"step_s": 2.0 if mode == "flat" else 0.5, "peak_gib": None, "choices": mode}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_train, "calibrate", lambda *a, **kw: CostModel())
    monkeypatch.setattr(bench_train, "timed_steps", step)
    earlier = bench_train.result_path("train", bench_train.environment(), tmp_path)
    earlier.write_text("{}")  # a whole earlier run's result stays as it was
    with pytest.raises(RuntimeError, match="cut short"):
        bench_train.main(["--quick", "--sets", "agentic", "--calibration-s", "0.5", "--out", str(tmp_path)])
    assert earlier.read_text() == "{}"
    (path,) = tmp_path.glob("train-partial__*.json")
    saved = json.loads(path.read_text())
    assert saved["partial"] is True and [r["mode"] for r in saved["rows"]] == ["flat", "packed"]
    assert renderer_for(saved["bench"])[2] is render_train  # the results document renders it as a run
    assert [r["speedup"] for r in saved["rows"]] == [1.0, 4.0]
    assert saved["cost_model"] == CostModel().to_dict() and "targets" not in saved
    assert "A partial run" in "\n".join(render_train(saved))


def test_the_checkpointed_dfs_row_runs_longer_blocks_checkpointed_and_restores_the_model():
    model = small_model()
    engine = {"block_tokens": 32, "token_budget": 256}
    with bench_train.row_settings(model, "packed", engine) as (mode, settings):
        assert (mode, settings, model.gradient_checkpointing) == ("packed", engine, False)
    with pytest.raises(RuntimeError, match="stop"), bench_train.row_settings(model, "dfs-ckpt", engine) as (
            mode, settings):
        assert (mode, settings["block_tokens"], model.gradient_checkpointing) == ("dfs", 256, True)
        raise RuntimeError("stop")
    assert not model.gradient_checkpointing and engine["block_tokens"] == 32
    with bench_train.row_settings(model, "dfs-budget", engine) as (mode, settings):
        assert (mode, settings["block_tokens"], model.gradient_checkpointing) == ("dfs", 256, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = bench_train.train_rows(model, optimizer, CostModel(), ["agentic"], quick=True, reps=1, **engine)
    assert [r["mode"] for r in rows] == ["flat", "packed", "dfs", "dfs-ckpt", "dfs-budget", "auto"]
    by = {(r["set"], r["mode"]): r for r in rows}
    assert by[("agentic", "dfs-ckpt")]["recomputed_tokens"] < by[("agentic", "dfs")]["recomputed_tokens"]
    assert by[("agentic", "dfs-budget")]["choices"] == "dfs@256"
    assert len({r["work_ratio"] for r in rows}) == 1 and rows[0]["work_ratio"] > 1
    profiles = [{"set": "agentic", "mode": m, "busy_share": 0.5} for m in ("dfs", "dfs-ckpt")]
    names = {c["target"] for c in bench_train.targets(rows, [], profiles)}
    assert {"agentic: dfs >= 0.8 x packed", "agentic: dfs-ckpt >= 0.8 x packed",
            "agentic: GPU busy (kernel time / wall) of a dfs-ckpt step >= 0.85"} <= names


@pytest.mark.skipif(not FA4_HERE, reason="FlashAttention-4 needs a Hopper-class GPU and the [hopper] extra")
@pytest.mark.parametrize("seed", [2, 5])
def test_dfs_blocks_run_fa4_with_the_gradients_of_fp32_flat(monkeypatch, seed):
    seqs = long_forest(seed)
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=100, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=320)
    reference = TinyLM(cfg).cuda()
    model = TinyLM(cfg).cuda().bfloat16()
    model.load_state_dict(reference.state_dict())
    trie = RolloutTrie.from_sequences(seqs)
    tree_backward(reference, trie, None, mode="flat")
    want = bench_train.flat_gradient(reference)
    monkeypatch.setattr(block_attention, "FA4_MIN_WALK_WORK", 0)  # every walk on FA4, however small
    kernels = []
    for name in ("fa4_causal_attention", "fa4_rule_attention"):
        run = getattr(block_attention, name)
        monkeypatch.setattr(block_attention, name,
                            lambda *a, run=run, name=name, **kw: kernels.append(name) or run(*a, **kw))
    tree_backward(model, trie, None, mode="dfs", block_tokens=333)
    got = bench_train.flat_gradient(model)
    assert set(kernels) == {"fa4_causal_attention", "fa4_rule_attention"}  # chains and trees
    assert torch.isfinite(got).all() and float((got - want).norm() / want.norm()) < 2e-2


def test_the_work_ratio_weighs_tokens_and_pairs_by_the_models_flops():
    model = small_model()
    work = model_work(model)
    unshared = RolloutTrie.from_sequences([[1, 2, 3], [4, 5, 6, 7]]).stats()
    assert bench_train.work_ratio(model, unshared) == pytest.approx(1.0)
    shared = RolloutTrie.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 8]]).stats()
    flat = work["flops_per_token"] * 16 + work["flops_per_pair"] * (21 + 21 + 10)
    tree = work["flops_per_token"] * 8 + work["flops_per_pair"] * (21 + 6 + 4)
    assert bench_train.work_ratio(model, shared) == pytest.approx(flat / tree)
