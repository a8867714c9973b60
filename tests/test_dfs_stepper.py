"""The DFS trace tells what the engine really does, and the notebook 02 drawings and widget follow it.

The trace (:func:`dfs_trace`) only keeps the books over the engine's own events; the ground truth here is
the engine itself: :func:`run_dfs` is run with a probe model whose keys and values are each token's packed
position, and a recording ``BlockRun`` reads, while each block runs, which packed positions the K/V stack
holds and which gradient-buffer slots hold gradients.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from unittest import mock

import plotly.graph_objects as go
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import orders, rollout_forests
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import MODES, CostModel, plan_micro_batches, tree_backward
from treeattn_lab.engine import dfs as engine_dfs
from treeattn_lab.engine.loss_plan import LossPlan
from treeattn_lab.lab import exercises, viz
from treeattn_lab.lab.dfs_stepper import DfsStepper, dfs_trace
from treeattn_lab.lab.monitor import Sample, Step
from treeattn_lab.reference import TinyLM, TinyLMConfig

TOY = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    [1, 2, 3, 4, 5, 6, 7, 8, 10, 11],
    [1, 2, 3, 4, 5, 6, 12, 13],
    [1, 2, 3, 4, 5, 6, 12, 14, 15, 16, 17],
    [1, 2, 3, 4, 5, 6, 18],
]


# ------------------------------------------------------------------------------------ the engine, probed
class PositionProbe:
    """A model adapter whose keys and values are the packed position of each token (fed as its input id),
    with one scalar parameter so that everything carries autograd history. Every layer attends the same
    keys; the logits add up every layer's output, so every layer's prefix receives gradients."""

    num_layers = 2

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab
        self.scale = torch.ones((), dtype=torch.float64, requires_grad=True)
        self.head = torch.randn(vocab, generator=g, dtype=torch.float64)

    def logits(self, input_ids, position_ids, attention):
        x = input_ids.double()[..., None, None] * self.scale  # [B, N, 1, 1] = packed position
        q = 0.01 * torch.ones_like(x) * self.scale
        out = sum(attention(layer, q, x, x, 1.0) for layer in range(self.num_layers))
        return out[..., 0, 0, None] * self.head


def run_engine_recorded(pack, block_tokens: int, seed: int = 0) -> list[dict]:
    """Run the engine's DFS over ``pack`` with the probe; per event: the block span, whether it ran with
    grad, the packed positions stored below it (layer 0) and the nonzero gradient-buffer slots before it."""
    T = pack.num_tokens
    probe_pack = dataclasses.replace(pack, input_ids=torch.arange(T), _cache={})
    weights = [torch.ones(int(n), dtype=torch.float64) for n in pack.seq_lengths]
    plan = LossPlan.from_pack(probe_pack, weights)
    log: list[dict] = []

    class Recorder(engine_dfs.BlockRun):
        def __init__(self, state, block, with_grad):
            super().__init__(state, block, with_grad)
            buf = state.grad_v[-1]
            filled = set() if buf is None else set(torch.nonzero(buf.abs().sum((1, 2)) > 0)[:, 0].tolist())
            if log:
                log[-1]["filled_after"] = filled
            log.append({"start": block.start, "end": block.end, "with_grad": with_grad, "stack": None})
            self.entry = log[-1]

        def __call__(self, layer, q, k, v, scale=None):
            out = super().__call__(layer, q, k, v, scale)
            if layer == 0 and self.entry["stack"] is None:
                p = self.block.position
                self.entry["stack"] = [int(x) for x in self.state.k[0][:p, 0, 0].tolist()]
            return out

    with mock.patch.object(engine_dfs, "BlockRun", Recorder):
        out = engine_dfs.run_dfs(PositionProbe(max(T, 2), seed), probe_pack, plan, block_tokens)
    return log, out


@given(rollout_forests(max_sequences=6, max_len=12), orders, st.integers(1, 6), st.integers(0, 2**16))
@settings(max_examples=25)
def test_trace_matches_what_the_engine_holds(seqs, order, block_tokens, seed):
    pack = RolloutTrie.from_sequences(seqs).pack(order=order)
    trace = dfs_trace(pack, block_tokens)
    log, out = run_engine_recorded(pack, block_tokens, seed)
    assert len(log) == len(trace)
    for rec, step in zip(log, trace, strict=True):
        blocks = [trace.blocks[b] for b in step.blocks]
        assert (rec["start"], rec["end"]) == (blocks[0].start, blocks[-1].end)
        assert rec["with_grad"] == step.with_grad
        assert rec["stack"] == step.prefix_positions  # the K/V the block reads: exactly the trace's prefix
        if "filled_after" in rec:  # buffer slots holding gradients, on the blocks still on the stack
            held = {s for b in step.stack_after for s in trace.slots(b)}
            expected = {s for b in step.stack_after if step.grad_received[b] for s in trace.slots(b)}
            # a leaf whose tokens all end rollouts scores nothing and sends no gradient: hence <=
            assert rec["filled_after"] & held <= expected
    assert out["grad_tokens"] == trace[-1].grad_tokens == pack.num_tokens
    assert out["no_grad_tokens"] == trace[-1].no_grad_tokens


def test_trace_matches_the_engine_buffers_exactly_when_every_leaf_scores_a_token():
    prompt = [1, 2, 3, 4, 5, 6]  # every leaf block (of 4 tokens at most) ends with two tokens or more
    seqs = [prompt + [7, 8, 9, 10], prompt + [7, 8, 11, 12, 13], prompt + [14, 15, 16]]
    seqs += [prompt + [14, 17, 18, 19, 20, 21, 22], prompt + [23, 24]]
    pack = RolloutTrie.from_sequences(seqs).pack()
    trace = dfs_trace(pack, 4)
    log, _ = run_engine_recorded(pack, 4)
    for rec, step in zip(log[:-1], trace, strict=False):
        held = {s for b in step.stack_after for s in trace.slots(b)}
        expected = {s for b in step.stack_after if step.grad_received[b] for s in trace.slots(b)}
        assert rec["filled_after"] & held == expected, step


# ------------------------------------------------------------------------------------ the trace's books
@given(rollout_forests(max_sequences=8, max_len=16), orders, st.integers(1, 8))
@settings(max_examples=40)
def test_trace_invariants(seqs, order, block_tokens):
    pack = RolloutTrie.from_sequences(seqs).pack(order=order)
    trace = dfs_trace(pack, block_tokens)
    blocks = trace.blocks
    with_grad = [b for s in trace if s.with_grad for b in s.blocks]
    pushed = [s.blocks[0] for s in trace if s.kind == "push"]
    assert sorted(with_grad) == list(range(len(blocks)))  # every block runs with autograd exactly once
    assert sorted(pushed) == [i for i, b in enumerate(blocks) if b.has_children]
    assert trace[-1].stack_after == () and trace[0].stack_before == ()
    subtree_end = pack.subtree_end.tolist()
    for step in trace:
        first = blocks[step.blocks[0]]
        assert len(step.prefix_positions) == first.position
        # the stack holds exactly the keys before the block that its first token sees: its ancestors
        assert step.prefix_positions == [k for k in range(first.start) if subtree_end[k] > first.start]
        assert list(step.prefix_ranges) == exercises.ancestor_keys(pack.subtree_end, first.start)
        if step.kind == "pop":  # a block pops once everything below it has sent its gradients
            b = step.blocks[0]
            before = trace[step.index - 1].grad_received[b]
            assert before == trace.descendant_tokens[b] > 0
        assert set(step.grad_received) == set(step.stack_after)
        assert trace.block_states(step.index).count("running") == len(step.blocks)
    assert trace.peak_stack_tokens() <= max(pack.seq_lengths.tolist())
    assert trace[-1].no_grad_tokens == sum(b.end - b.start for b in blocks if b.has_children)


def test_toy_trace():
    trace = dfs_trace(RolloutTrie.from_sequences(TOY), 4)
    kinds = [(s.kind, s.blocks) for s in trace]
    assert kinds[:5] == [("push", (0,)), ("push", (1,)), ("push", (2,)), ("leaves", (3, 4)), ("pop", (2,))]
    assert trace[3].prefix_positions == list(range(8)) and trace[3].grad_received == {0: 3, 1: 3, 2: 3}
    assert trace.peak_stack_tokens() == 8 and len(trace) == 12
    assert (
        trace.block_states(4)
        == ["stack", "stack", "running", "done", "done", "waiting", "waiting"] + ["waiting"] * 2
    )
    assert "pop block 2" in trace.describe(4) and "3 tokens below it" in trace.describe(4)
    assert "no prefix" in trace.describe(0) and "one padded batch of 2 rows" in trace.describe(3)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([[1, 2]], 0), ValueError, "block_tokens must be at least 1"),
        (([[1, 2]], 2.0), TypeError, "block_tokens must be an int"),
        (([[1, 2]], True), TypeError, "block_tokens must be an int"),
        (("not a trie", 2), TypeError, "TreePack or a RolloutTrie"),
    ],
)
def test_trace_rejects_bad_input(args, error, match):
    pack, block_tokens = args
    if isinstance(pack, list):
        pack = RolloutTrie.from_sequences(pack)
    with pytest.raises(error, match=match):
        dfs_trace(pack, block_tokens)


def test_describe_and_restyle_reject_unknown_events():
    trace = dfs_trace(RolloutTrie.from_sequences(TOY), 4)
    with pytest.raises(IndexError, match="out of range"):
        trace.describe(len(trace))
    fig = viz.draw_dfs_step(trace, 0)
    with pytest.raises(IndexError, match="out of range"):
        viz.restyle_dfs_step(fig, trace, -1)


# ------------------------------------------------------------------------------------ drawings and widget
def _trace_by_name(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return t


def test_step_figure_restyles_to_the_same_figure_as_drawing_afresh():
    trace = dfs_trace(RolloutTrie.from_sequences(TOY), 4)
    fig = viz.draw_dfs_step(trace, 0)
    for i in (3, 4, 11, 0):
        viz.restyle_dfs_step(fig, trace, i)
        assert fig.to_dict() == viz.draw_dfs_step(trace, i).to_dict()
    fig = viz.draw_dfs_step(trace, 3)
    blocks, kv, grad = (_trace_by_name(fig, n) for n in ("blocks", "kv", "grad"))
    assert blocks.marker.color[3] == viz.STATE_COLORS["grad"]  # leaf 3 runs with autograd
    assert blocks.marker.color[0] == viz.STATE_COLORS["stack"]
    assert list(kv.y[:10]) == [1.0] * 10 and kv.text[8] == "4" and kv.marker.pattern.shape[8] == "/"
    assert grad.y[0] == pytest.approx(3 / 14) and grad.y[6] == 1.0  # block 2: all 3 tokens below arrived
    assert "event 4 of 12" in fig.layout.title.text


def test_timeline_has_one_column_per_event():
    trace = dfs_trace(RolloutTrie.from_sequences(TOY), 4)
    fig = viz.draw_dfs_timeline(trace)
    kv, grad = _trace_by_name(fig, "kv"), _trace_by_name(fig, "grad")
    assert len(kv.z) == trace.num_slots and len(kv.z[0]) == len(trace)
    assert [row[0] for row in kv.z[:4]] == [2, 2, 2, 2]  # event 0 pushes block 0 into slots 0..3
    assert grad.z[6][4] == 1.0  # event 4 pops block 2 (slots 6, 7) with a full buffer
    assert "never holds more than 8" in fig.layout.title.text


def test_stepper_widget_follows_the_slider_and_buttons():
    stepper = DfsStepper(RolloutTrie.from_sequences(TOY), 4, title="toy")
    box = stepper.widget()
    assert stepper.widget() is box and stepper.index == 0
    stepper.show(4)
    assert (
        stepper.figure.layout.title.text == "toy: event 5 of 12" and "pop block 2" in stepper.sentence.value
    )
    stepper.forward.click()
    assert stepper.index == 5
    stepper.back.click()
    stepper.back.click()
    assert stepper.index == 3
    stepper.show(99)
    assert stepper.index == len(stepper.trace) - 1 and stepper.play.max == stepper.index
    stepper.show(-5)
    assert stepper.index == 0


def test_held_tokens_on_the_toy():
    held = viz.held_tokens(dfs_trace(RolloutTrie.from_sequences(TOY), 4))
    assert held["flat"]["activations"] == 5 * 11  # one padded batch: 5 rollouts x the longest, 11
    assert held["packed"]["activations"] == 18
    assert held["dfs"] == {"activations": 4, "path": 8}
    assert isinstance(viz.draw_held_tokens(dfs_trace(RolloutTrie.from_sequences(TOY), 4)), go.Figure)


def test_mode_memory_rows_read_the_monitor_windows():
    samples = [Sample(t, rss, ()) for t, rss in [(0.0, 100), (0.5, 100), (0.9, 180), (1.2, 120), (1.6, 130)]]
    steps = [Step(0, 1.0, 600.0, "flat"), Step(1, 1.7, 400.0, "dfs")]
    monitor = SimpleNamespace(samples=samples, steps=steps)
    report = SimpleNamespace(peak_memory_bytes=None, time_s=0.5, flat_tokens=10, grad_tokens=8,
                             recomputed_tokens=2, modes=["dfs"])  # fmt: skip
    gpu = SimpleNamespace(**{**vars(report), "peak_memory_bytes": 3 * 2**20})
    rows = viz.mode_memory_rows(
        {"flat": SimpleNamespace(report=report), "dfs": SimpleNamespace(report=gpu)}, monitor
    )
    assert rows[0]["peak_mib"] == 80 and rows[0]["memory"] == "host RSS rise"
    assert rows[1]["peak_mib"] == 3 and rows[1]["memory"] == "CUDA peak allocated"
    assert viz.host_rss_rise(samples, 1.3, 1.7) == 10  # baseline 120 at 1.2, peak 130
    assert viz.host_rss_rise([Sample(0.0, None, ())], 0, 1) is None
    with pytest.raises(KeyError, match="no step labelled 'packed'"):
        viz.mode_memory_rows({"packed": SimpleNamespace(report=report)}, monitor)
    assert isinstance(viz.draw_mode_memory(rows), go.Figure)


def test_micro_batches_drawn_on_the_trie():
    seqs = [[1] * 6 + [k, k + 1] for k in range(10, 20, 2)] + [[2] * 9, [3] * 9 + [4]]
    trie = RolloutTrie.from_sequences(seqs)
    rows = viz.micro_batch_choices(trie, token_budget=14, block_tokens=4)
    assert sorted(i for r in rows for i in r["sequences"]) == list(range(len(seqs)))
    assert all(r["choice"] in MODES and set(r["predicted"]) == set(MODES) for r in rows)
    colors = viz.micro_batch_colors(trie, rows)
    assert set(colors) == set(range(1, len(trie.nodes)))  # every node of the trie is labelled
    assert "shared prefix (carried)" in colors.values()  # the prompt [1]*6 is cut across micro-batches
    fig = viz.draw_micro_batches(trie, rows)
    assert f"{len(rows)} micro-batches" in fig.layout.title.text
    table = viz.draw_micro_batch_table(rows)
    assert len(table.data[0].header.values) == 5 + 3 + 1  # no GiB columns under the uncalibrated prior


def test_micro_batches_with_a_calibrated_model_and_a_memory_limit():
    payload = train_bench_payload()
    model = CostModel.from_dict(payload["cost_model"])
    trie = RolloutTrie.from_sequences([[1] * 3000 + [k] * 500 for k in range(2, 10)])
    free = viz.micro_batch_choices(trie, token_budget=None, block_tokens=4096, cost_model=model)
    tight = viz.micro_batch_choices(
        trie, token_budget=None, block_tokens=4096, cost_model=model, memory_limit=10 * 2**30
    )
    assert free[0]["choice"] != "dfs" and tight[0]["choice"] == "dfs"  # only dfs fits in 10 GiB
    # cut by a budget, the micro-batches auto puts in dfs run as one (its memory is a block and a path)
    dfs_fastest = CostModel(time={m: [1e-6, 1e-5 * (1 if m == "dfs" else 3), 1e-9, 1e-6] for m in MODES},
                            host={m: [0.0, 0.0] for m in MODES}, calibrated=True)
    cut = viz.micro_batch_choices(trie, token_budget=5000, block_tokens=3000, cost_model=dfs_fastest)
    assert [r["choice"] for r in cut] == ["dfs"] and cut[0]["carried_tokens"] == 0
    assert len(plan_micro_batches(trie, 5000)) > 1
    table = viz.draw_micro_batch_table(tight)
    assert len(table.data[0].header.values) == 5 + 3 + 3 + 1
    assert tight[0]["block_tokens"] >= 4096 and tight[0]["predicted"]["dfs"][1] <= 10 * 2**30
    assert table.data[0].cells.values[-1][0] == f"<b>dfs @ {tight[0]['block_tokens']}</b>"


def train_bench_payload():
    return viz.load_calibrated_train_results()


def test_train_bench_figure_from_the_committed_gpu_results():
    payload = train_bench_payload()
    fig = viz.draw_train_bench(payload)
    bars = [t for t in fig.data if t.type == "bar"]
    modes = {r["mode"] for r in payload["rows"]}
    assert len(bars) == 2 * len(modes)
    assert payload["environment"]["device"] in fig.layout.title.text
    json.dumps(fig.to_plotly_json(), default=str)  # serialisable


def test_calibrated_train_results_skip_variant_files(tmp_path):
    def write(name, time_utc, calibrated=True):
        payload = {
            "environment": {"device": name, "time_utc": time_utc},
            "cost_model": {"calibrated": calibrated},
        }
        (tmp_path / f"{name}__torch-x__triton-y.json").write_text(json.dumps(payload))

    write("train__GPU-A", "2026-01-01T00:00:00Z")
    write("train__GPU-B", "2026-01-02T00:00:00Z")
    write("train__GPU-C", "2026-01-05T00:00:00Z", calibrated=False)  # newest, but not calibrated
    write("train-before-change__GPU-A", "2026-01-03T00:00:00Z")  # a variant: never picked
    write("train-probe__GPU-B", "2026-01-04T00:00:00Z")
    newest = viz.load_calibrated_train_results(directory=tmp_path)
    assert newest["environment"]["device"] == "train__GPU-B"
    assert viz.load_calibrated_train_results("GPU-A", tmp_path)["environment"]["device"] == "train__GPU-A"
    with pytest.raises(FileNotFoundError, match="calibrated"):
        viz.load_calibrated_train_results("GPU-C", tmp_path)
    with pytest.raises(FileNotFoundError):
        viz.load_calibrated_train_results("GPU-D", tmp_path)


def test_gradient_errors_figure():
    fig = viz.draw_gradient_errors({"flat": 0.0, "dfs": 1e-15}, tolerance=1e-9)
    assert list(fig.data[0].y) == [1e-18, 1e-15]
    with pytest.raises(ValueError, match="empty"):
        viz.draw_gradient_errors({})


def test_tree_backward_report_feeds_the_memory_rows():
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=20, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16))
    trie = RolloutTrie.from_sequences(TOY)
    results = {m: tree_backward(model, trie, mode=m, block_tokens=4) for m in MODES}
    steps = [Step(i, 1.0 + i, 1.0, m) for i, m in enumerate(MODES)]
    rows = viz.mode_memory_rows(results, SimpleNamespace(samples=[], steps=steps))
    dfs = rows[MODES.index("dfs")]
    assert dfs["grad_tokens"] == 18 and dfs["recomputed_tokens"] == dfs_trace(trie, 4)[-1].no_grad_tokens
