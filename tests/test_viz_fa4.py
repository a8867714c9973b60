"""Notebook 03's backends side by side (the lab's kernel beside FlashAttention-4, flat SDPA and
FlexAttention): the measuring helper run on the CPU, and the figure checked against the rows it draws."""

from __future__ import annotations

import math

import pytest
import torch

go = pytest.importorskip("plotly.graph_objects")

from treeattn_lab.bench.tree import TreeCase, branching_rollouts  # noqa: E402
from treeattn_lab.lab import demos, viz  # noqa: E402
from treeattn_lab.lab.viz.bench import BACKEND_PANELS  # noqa: E402

METRICS = [metric for metric, _, _ in BACKEND_PANELS]


def _row(case, backend, scale):
    return {"case": case, "backend": backend, "fwd_ms": 1.0 * scale, "fwd_bwd_ms": 3.0 * scale,
            "fwd_tflops": 100.0 / scale, "fwd_bwd_tflops": 90.0 / scale}


def _bars(fig, backend):
    """The traces of ``backend``, in panel order (fwd ms, fwd+bwd ms, fwd TFLOP/s, fwd+bwd TFLOP/s)."""
    return [t for t in fig.data if t.name == backend]


def test_backend_times_draws_every_metric_of_every_row_in_its_panel():
    rows = [_row(c, b, s) for c, s0 in (("a", 1.0), ("b", 2.0)) for b, s in
            (("flat", s0), ("triton", 0.5 * s0), ("fa4", 0.25 * s0))]
    fig = viz.draw_backend_times(rows, title="three backends")
    assert {t.name for t in fig.data} == {"flat", "triton", "fa4"}
    for backend in ("flat", "triton", "fa4"):
        bars = _bars(fig, backend)
        assert len(bars) == len(METRICS)
        for bar, metric, axis in zip(bars, METRICS, ("x", "x2", "x3", "x4"), strict=True):
            assert bar.xaxis == axis
            assert list(bar.x) == ["a", "b"]
            want = [r[metric] for r in rows if r["backend"] == backend]
            assert list(bar.y) == pytest.approx(want)
        assert len({bar.marker.color for bar in bars}) == 1, f"{backend} changes colour between panels"
        assert [bar.showlegend for bar in bars] == [True, False, False, False]
    colors = [_bars(fig, b)[0].marker.color for b in ("flat", "triton", "fa4")]
    assert colors[:2] == [viz.BACKEND_COLORS["flat"], viz.BACKEND_COLORS["triton"]]
    assert len(set(colors)) == 3, "a backend without a colour of its own takes one already in use"
    assert fig.layout.title.text == "three backends"


def test_backend_times_keeps_the_asked_order_and_leaves_gaps():
    rows = [_row("a", "flat", 1.0), _row("a", "triton", 1.0), _row("b", "flat", 2.0)]
    fig = viz.draw_backend_times(rows, backends=["triton", "flat"], cases=["b", "a"])
    assert [t.name for t in fig.data[:2]] == ["triton", "flat"]
    triton_ms = _bars(fig, "triton")[0]
    assert list(triton_ms.x) == ["b", "a"] and list(triton_ms.y) == [None, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"backends": ["flat", "fa4"]}, "fa4"), ({"cases": ["nowhere"]}, "nowhere"),
     ({"backends": []}, "backends")],
)
def test_backend_times_names_what_the_rows_lack(kwargs, message):
    rows = [_row("a", "flat", 1.0), _row("a", "triton", 1.0)]
    with pytest.raises(ValueError, match=message):
        viz.draw_backend_times(rows, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        viz.draw_backend_times([])


def test_backend_times_draws_the_recorded_h200_rows():
    h200 = viz.load_bench_results("tree", "NVIDIA-H200")
    shown = [b for b in ("flat", "flex", "triton", "fa4") if any(r["backend"] == b for r in h200["rows"])]
    assert {"flat", "triton"} <= set(shown)
    fig = viz.draw_backend_times(h200["rows"], backends=shown)
    cases = list(dict.fromkeys(r["case"] for r in h200["rows"]))
    by = {(r["case"], r["backend"]): r for r in h200["rows"]}
    for backend in shown:
        for bar, metric in zip(_bars(fig, backend), METRICS, strict=True):
            assert list(bar.x) == cases
            assert list(bar.y) == pytest.approx([by[c, backend][metric] for c in cases])


def test_time_tree_backends_measures_each_backend_on_each_case_on_the_cpu():
    cases = [TreeCase("tiny grpo", branching_rollouts(1, 24, [(3, 8)])),
             TreeCase("tiny fork", branching_rollouts(1, 16, [(2, 8), (2, 4)]))]
    before = [list(map(list, c.sequences)) for c in cases]
    rows = demos.time_tree_backends(cases, ["flat", "reference"], device="cpu", heads=2, dim=16,
                                    dtype=torch.float32)
    assert [(r["case"], r["backend"]) for r in rows] == [
        ("tiny grpo", "flat"), ("tiny grpo", "reference"), ("tiny fork", "flat"), ("tiny fork", "reference")]
    assert [c.sequences for c in cases] == before, "the cases were changed"
    for r in rows:
        assert all(math.isfinite(r[m]) and r[m] > 0 for m in METRICS), r
        assert r["fwd_bwd_ms"] > r["fwd_ms"] * 0.5, r  # a backward on top of the forward
        assert r["fwd_tflops"] / r["fwd_bwd_tflops"] == pytest.approx(r["fwd_bwd_ms"] / (3.5 * r["fwd_ms"]))
    fig = viz.draw_backend_times(rows)
    assert {t.name for t in fig.data} == {"flat", "reference"}


def test_time_tree_backends_refuses_bad_arguments():
    case = TreeCase("tiny", branching_rollouts(1, 8, [(2, 4)]))
    with pytest.raises(ValueError, match="cudnn"):
        demos.time_tree_backends([case], ["flat", "cudnn"], device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        demos.time_tree_backends([], ["flat"], device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        demos.time_tree_backends([case], [], device="cpu")
    with pytest.raises(TypeError, match="TreeCase"):
        demos.time_tree_backends([case.sequences], ["flat"], device="cpu")
