"""GPU timelines from chrome traces (``treeattn_lab.bench.trace``) and their drawing."""

import json

import pytest

from treeattn_lab.bench.trace import gpu_timeline, kernel_family
from treeattn_lab.lab.viz import draw_gpu_timeline


def _event(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


TRACE = {"traceEvents": [
    _event("_bsa_bwd_dkdv", 5000.0, 7000.0, 7),
    _event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 1300.0, 3300.0, 20),
    _event("_bsa_fwd", 1500.0, 7000.0, 7),
    _event("void at::native::vectorized_elementwise_kernel<4>", 1000.0, 50.0, 7),  # below 0.1 ms: dropped
    _event("Memcpy DtoD", 12500.0, 400.0, 7, cat="gpu_memcpy"),
    _event("aten::add_", 900.0, 3000.0, 7, cat="cpu_op"),  # a CPU op: not a GPU activity
    {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0.0},  # not a complete event
]}


def test_timeline_keeps_gpu_activities_in_start_order():
    rows = gpu_timeline(TRACE)
    assert [r["family"] for r in rows] == ["NCCL", "forward", "dK/dV", "other"]
    assert rows[0]["start_ms"] == 0.3 and rows[0]["ms"] == 3.3  # from the first GPU activity (1.0 ms)
    assert [r["stream"] for r in rows] == [20, 7, 7, 7]
    assert len(gpu_timeline(TRACE, min_ms=0.0)) == 5
    assert len(TRACE["traceEvents"]) == 7  # the input is left alone


def test_timeline_reads_a_path_and_refuses_other_input(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    assert gpu_timeline(path) == gpu_timeline(TRACE) == gpu_timeline(str(path))
    assert gpu_timeline({"traceEvents": []}) == []
    with pytest.raises(ValueError, match="chrome trace"):
        gpu_timeline({"events": []})


def test_kernel_families():
    assert kernel_family("_bsa_bwd_dq") == "dQ" and kernel_family("_bsa_delta") == "delta"
    assert kernel_family("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "NCCL"
    assert kernel_family("triton_per_fused_add") == "other"


def test_drawing_puts_each_run_and_stream_on_its_own_lane():
    rows = gpu_timeline(TRACE)
    fig = draw_gpu_timeline({"before": rows, "after": rows[:2]}, title="ring")
    lanes = list(fig.layout.yaxis.categoryarray)
    assert lanes == ["before · NCCL (stream 20)", "before · compute (stream 7)", "after · NCCL (stream 20)",
                     "after · compute (stream 7)"]
    bars = {(t.name, y) for t in fig.data for y in t.y}
    assert ("dK/dV", "before · compute (stream 7)") in bars and ("NCCL", "after · NCCL (stream 20)") in bars
    assert sum(t.showlegend for t in fig.data) == len({t.name for t in fig.data})  # one legend entry each
