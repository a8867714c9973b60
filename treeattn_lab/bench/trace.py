"""GPU timelines from ``torch.profiler`` chrome traces: what ran on which stream, when, for how long.

A chrome trace (``prof.export_chrome_trace``) holds every CPU op, runtime call and GPU activity of a
profiled region, a few MB for one ring step. :func:`gpu_timeline` keeps only the GPU side (kernels, copies,
memsets) longer than a threshold, as small rows that can be committed beside a benchmark's JSON and drawn
(:func:`treeattn_lab.lab.viz.draw_gpu_timeline`): overlap of communication and compute is then
something to look at rather than infer from totals.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["GPU_CATEGORIES", "gpu_timeline", "kernel_family"]

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# short names for the kernels of this lab and NCCL; anything else is "other" (elementwise ops, copies)
FAMILIES = (("ncclDevKernel", "NCCL"), ("_bsa_fwd", "forward"), ("_bsa_bwd_dq", "dQ"),
            ("_bsa_bwd_dkdv", "dK/dV"), ("_bsa_delta", "delta"))


def kernel_family(name: str) -> str:
    """``"NCCL"``, ``"forward"``, ``"dQ"``, ``"dK/dV"``, ``"delta"`` or ``"other"`` for a kernel name."""
    for prefix, family in FAMILIES:
        if name.startswith(prefix):
            return family
    return "other"


def gpu_timeline(trace, *, min_ms: float = 0.1) -> list[dict]:
    """Rows ``{"name", "family", "stream", "start_ms", "ms"}`` of the GPU activities in ``trace`` (a path
    or the loaded dict) lasting at least ``min_ms``, in start order; ``start_ms`` counts from the first
    GPU activity of the trace."""
    if isinstance(trace, (str, Path)):
        trace = json.loads(Path(trace).read_text())
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError("trace must be a chrome trace (a dict with 'traceEvents') or the path of one")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not events:
        return []
    t0 = min(e["ts"] for e in events)
    rows = [{"name": e["name"][:80], "family": kernel_family(e["name"]),
             "stream": int(e.get("args", {}).get("stream", e.get("tid", 0))),
             "start_ms": (e["ts"] - t0) / 1e3, "ms": e["dur"] / 1e3}
            for e in events if e["dur"] / 1e3 >= min_ms]
    return sorted(rows, key=lambda r: r["start_ms"])
