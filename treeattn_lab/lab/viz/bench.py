"""Drawing benchmark results: the JSON files under ``bench/results/`` and sweeps filled live.

- :func:`load_bench_results`: the newest committed result file of a bench on a device.
- :func:`draw_bench_summary`: ``bench tree``: fwd+bwd speed-up over flat SDPA and forward TFLOP/s.
- :func:`draw_backend_times`: ``bench tree`` backends side by side: median ms and useful TFLOP/s, forward
  and forward+backward.
- :func:`draw_speed_sweep` / :func:`add_speed_point`: an empty latency / TFLOP/s figure filled point by
  point while a sweep runs.
- :func:`draw_train_bench`: ``bench train``: throughput and peak memory per engine mode and data set.
- :func:`draw_sparse_bench`: ``bench sparse``: speed-up over dense causal SDPA per case and backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import BACKEND_COLORS, MODE_COLORS, PALETTE, labelled_bar


def load_bench_results(bench: str = "tree", device: str = "NVIDIA-H200", directory=None) -> dict:
    """The newest committed result file ``bench/results/<bench>__<device>__*.json``, as a dict.

    Keys: ``rows`` (one dict per case and backend, as ``python -m treeattn_lab bench tree`` writes them),
    ``environment`` (GPU, versions, time) and the run's settings (``dtype``, ``heads``, ``head_dim``).
    """
    import json
    from pathlib import Path

    from ...bench.harness import RESULTS_DIR

    folder = Path(directory) if directory is not None else RESULTS_DIR
    paths = sorted(folder.glob(f"{bench}__{device}__*.json"))
    if not paths:
        raise FileNotFoundError(f"no {bench}__{device}__*.json under {folder}")
    payloads = [json.loads(p.read_text()) for p in paths]
    return max(payloads, key=lambda d: d.get("environment", {}).get("time_utc", ""))


def load_calibrated_train_results(device: str | None = None, directory=None) -> dict:
    """The newest committed plain ``bench train`` run, ``train__<device>__*.json``, whose cost model was
    calibrated: a run that profiled one set with a short calibration leaves it uncalibrated, and the
    cost-model views need measured coefficients and memory.

    Only the plain bench file of a device counts: a ``train-<variant>__`` file (a run kept for comparison,
    such as ``train-before-<change>__``, or a probe of one set) is never picked. ``device``: the file-name
    form (``"NVIDIA-H200"``, ``"NVIDIA-H100-80GB-HBM3"``); None takes the newest run on any device
    (``environment.device`` names it)."""
    import json
    from pathlib import Path

    from ...bench.harness import RESULTS_DIR

    folder = Path(directory) if directory is not None else RESULTS_DIR
    pattern = f"train__{device}__*.json" if device is not None else "train__*__*.json"
    payloads = [json.loads(p.read_text()) for p in sorted(folder.glob(pattern))]
    calibrated = [d for d in payloads if d.get("cost_model", {}).get("calibrated")]
    if not calibrated:
        raise FileNotFoundError(f"no {pattern} under {folder} with a calibrated cost model")
    return max(calibrated, key=lambda d: d.get("environment", {}).get("time_utc", ""))


def _add_speedup_bars(fig, rows, cases, backends, by) -> None:
    """Top panel: each backend's fwd+bwd speed-up over flat per case, then the ideal ratio in grey."""
    for b in backends:
        if b == "flat":
            continue
        ys = [by.get((c, b), {}).get("fwd_bwd_speedup") for c in cases]
        fig.add_trace(
            labelled_bar(
                cases,
                ys,
                [f"{y:.2f}" if y is not None else "" for y in ys],
                name=b,
                legendgroup=b,
                textfont=dict(size=10),  # three labels side by side per case stay apart
                marker_color=BACKEND_COLORS.get(b),
                hovertemplate=f"{b}<br>%{{x}}: %{{y:.2f}}x<extra></extra>",
            ),
            row=1,
            col=1,
        )
    ideal = [next(r["ideal"] for r in rows if r["case"] == c) for c in cases]
    fig.add_trace(
        labelled_bar(
            cases,
            ideal,
            [f"{y:.2f}" for y in ideal],
            name="ideal",
            textfont=dict(size=10),
            marker_color="#CCCCCC",
            hovertemplate="ideal<br>%{x}: %{y:.2f}x<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_hline(y=1.0, line_dash="dash", line_color="#666666", row=1, col=1)


def draw_bench_summary(
    rows: Sequence[Mapping], *, title: str | None = None, backends: Sequence[str] | None = None
) -> go.Figure:
    """Two panels from ``bench tree`` rows: fwd+bwd speed-up over flat SDPA against the ideal ratio
    (attended pairs flat / tree) per case, and forward TFLOP/s per backend (useful work only).

    ``backends``: which of the rows' backends to draw (default: those of flat, flex and triton the rows
    hold; a run may also hold ``gather-flat``, ``varlen`` and ``auto`` rows)."""
    if not rows:
        raise ValueError("rows is empty")
    present = set(r["backend"] for r in rows)
    if backends is None:
        backends = [b for b in ("flat", "flex", "triton") if b in present]
    missing = [b for b in backends if b not in present]
    if missing:
        raise ValueError(f"no rows for backends {missing}; the rows hold {sorted(present)}")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(backends)
    by = {(r["case"], r["backend"]): r for r in rows}
    fig = make_subplots(
        rows=2,
        cols=1,
        vertical_spacing=0.16,
        subplot_titles=(
            "fwd+bwd speed-up over flat SDPA (higher is better); grey: ideal = flat pairs / tree pairs",
            "forward TFLOP/s (useful work: attended pairs only)",
        ),
    )
    _add_speedup_bars(fig, rows, cases, backends, by)
    for b in backends:
        ys = [by.get((c, b), {}).get("fwd_tflops") for c in cases]
        fig.add_trace(
            go.Bar(
                x=cases,
                y=ys,
                name=b,
                legendgroup=b,
                showlegend=b == "flat",
                marker_color=BACKEND_COLORS.get(b),
                hovertemplate=f"{b}<br>%{{x}}: %{{y:.0f}} TFLOP/s<extra></extra>",
            ),
            row=2,
            col=1,
        )
    fig.update_layout(
        title=dict(text=title or "Tree attention against flat SDPA"),
        template="plotly_white",
        barmode="group",
        height=820,
        margin=dict(l=60, r=20, t=90, b=90),
        legend=dict(orientation="h", x=0, y=-0.12, yanchor="top"),  # below the case labels
    )
    fig.update_yaxes(title="x over flat", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="TFLOP/s", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(tickangle=-20)
    return fig


def draw_speed_sweep(backends: Sequence[str], *, x_title: str = "prompt length", title: str | None = None):
    """Empty two-panel figure (fwd+bwd latency, fwd+bwd TFLOP/s) with one line per backend, to be filled
    point by point with :func:`add_speed_point` (show it through :class:`~treeattn_lab.lab.viz.LiveFigure`
    to watch it grow)."""
    if not backends:
        raise ValueError("backends is empty")
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        subplot_titles=("fwd+bwd latency (ms, lower is better)", "fwd+bwd TFLOP/s (useful work)"),
    )
    for col, metric in ((1, "fwd_bwd_ms"), (2, "fwd_bwd_tflops")):
        for b in backends:
            fig.add_trace(
                go.Scatter(
                    x=[],
                    y=[],
                    mode="lines+markers",
                    name=b,
                    legendgroup=b,
                    showlegend=col == 1,
                    meta=metric,
                    line=dict(color=BACKEND_COLORS.get(b)),
                    hovertemplate=f"{b}<br>{x_title} %{{x}}: %{{y:.3g}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_layout(
        title=dict(text=title or "Tree attention as the tree grows"),
        template="plotly_white",
        height=420,
        margin=dict(l=60, r=20, t=80, b=50),
    )
    fig.update_xaxes(title=x_title)
    fig.update_yaxes(rangemode="tozero")
    return fig


def add_speed_point(fig, row: Mapping, x) -> None:
    """Append one ``run_case`` row (one backend) at ``x`` to a :func:`draw_speed_sweep` figure, in place
    (the widget of a :class:`~treeattn_lab.lab.viz.LiveFigure` redraws at once)."""
    traces = [t for t in fig.data if t.name == row["backend"] and t.meta in ("fwd_bwd_ms", "fwd_bwd_tflops")]
    if not traces:
        raise KeyError(f"the figure has no line for backend {row['backend']!r}")
    with fig.batch_update():
        for t in traces:
            t.x = (*(t.x or ()), x)
            t.y = (*(t.y or ()), float(row[t.meta]))


def draw_train_bench(payload: Mapping, *, title: str | None = None) -> go.Figure:
    """``bench train`` results: throughput (flat tokens per second) and peak memory per set and mode."""
    rows = payload["rows"]
    if not rows:
        raise ValueError("the payload has no rows")
    sets = list(dict.fromkeys(r["set"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["set"], r["mode"]): r for r in rows}
    fig = make_subplots(
        rows=2,
        cols=1,
        vertical_spacing=0.15,
        subplot_titles=(
            "throughput: flat tokens per second (the tokens a flat trainer would process)",
            "peak CUDA memory of the step (GiB)",
        ),
    )
    for m in modes:
        got = [by.get((s, m), {}) for s in sets]
        hover = [f"{m}: {r.get('speedup', 0):.2f}x flat; chose {r.get('choices', '')}" for r in got]
        fig.add_trace(
            labelled_bar(
                sets,
                [r.get("tokens_per_s", 0) / 1e3 for r in got],
                [f"{r.get('speedup', 0):.2f}x" for r in got],
                name=m,
                legendgroup=m,
                marker_color=MODE_COLORS.get(m),
                hovertext=hover,
                hovertemplate="%{x}<br>%{y:.0f}K tokens/s<br>%{hovertext}<extra></extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            labelled_bar(
                sets,
                [r.get("peak_gib") for r in got],
                [f"{r.get('peak_gib', 0):.0f}" for r in got],
                name=m,
                legendgroup=m,
                showlegend=False,
                marker_color=MODE_COLORS.get(m),
                hovertemplate=f"{m}<br>%{{x}}: %{{y:.1f}} GiB<extra></extra>",
            ),
            row=2,
            col=1,
        )
    env = payload.get("environment", {})
    sub = f"{env.get('device', '')}, {str(payload.get('dtype', '')).removeprefix('torch.')}"
    if "params" in payload:
        sub += f", {payload['params'] / 1e9:.2f}B parameters"
    fig.update_layout(
        title=dict(text=f"{title or 'One training step per mode'}<br><sup>{sub}</sup>"),
        template="plotly_white",
        barmode="group",
        height=760,
        margin=dict(l=60, r=20, t=90, b=40),
    )
    fig.update_yaxes(title="K tokens/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="GiB", rangemode="tozero", row=2, col=1)
    return fig


def draw_sparse_bench(rows: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """``bench sparse`` rows: forward and forward+backward speed-up over dense causal SDPA, per case."""
    ok = [r for r in rows if "fwd_bwd_speedup" in r and r["backend"] != "dense"]
    if not ok:
        raise ValueError("no timed rows")
    cases = list(dict.fromkeys(r["case"] for r in ok))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("forward x dense", "forward + backward x dense"))
    for col, key in ((1, "fwd_speedup"), (2, "fwd_bwd_speedup")):
        for backend in dict.fromkeys(r["backend"] for r in ok):
            ys = [
                next((r[key] for r in ok if r["case"] == c and r["backend"] == backend), None) for c in cases
            ]
            fig.add_trace(
                labelled_bar(
                    cases,
                    ys,
                    [f"{y:.2f}x" if y else "" for y in ys],
                    name=backend,
                    legendgroup=backend,
                    showlegend=col == 1,
                    marker_color=BACKEND_COLORS.get(backend),
                ),
                row=1,
                col=col,
            )
        fig.add_hline(y=1.0, line_dash="dash", line_color="#666", row=1, col=col)
    fig.update_layout(
        title=title or "Sparse attention against dense causal SDPA",
        template="plotly_white",
        barmode="group",
        height=420,
        margin=dict(l=50, r=20, t=80, b=40),
    )
    fig.update_yaxes(rangemode="tozero")
    return fig


BACKEND_PANELS = (
    ("fwd_ms", "forward: median ms (lower is better)", "ms"),
    ("fwd_bwd_ms", "forward + backward: median ms", "ms"),
    ("fwd_tflops", "forward: useful TFLOP/s (higher is better)", "TFLOP/s"),
    ("fwd_bwd_tflops", "forward + backward: useful TFLOP/s", "TFLOP/s"),
)


def _backend_colors(backends: Sequence[str]) -> dict[str, str]:
    """Each backend's colour: its :data:`BACKEND_COLORS` entry, else the next spare palette colour (the
    same in every panel of one figure)."""
    spare = iter(c for c in PALETTE[3:] if c not in BACKEND_COLORS.values())
    return {b: BACKEND_COLORS.get(b) or next(spare) for b in backends}


def draw_backend_times(
    rows: Sequence[Mapping],
    *,
    backends: Sequence[str] | None = None,
    cases: Sequence[str] | None = None,
    title: str | None = None,
) -> go.Figure:
    """``bench tree`` rows of several backends side by side, one group of bars per case, in four panels:
    median time (top) and useful TFLOP/s (bottom, attended pairs only), forward (left) and forward +
    backward (right).

    ``backends`` / ``cases``: which to draw, in that order (default: all the rows hold, in row order); each
    must have rows. A backend with no row for one of the cases leaves a gap there."""
    if not rows:
        raise ValueError("rows is empty")
    chosen = {}
    for what, asked in (("backend", backends), ("case", cases)):
        present = list(dict.fromkeys(r[what] for r in rows))
        chosen[what] = present if asked is None else list(asked)
        missing = [x for x in chosen[what] if x not in present]
        if not chosen[what] or missing:
            raise ValueError(f"no rows for {what}s {missing or chosen[what]}; the rows hold {present}")
    by = {(r["case"], r["backend"]): r for r in rows}
    colors = _backend_colors(chosen["backend"])
    fig = make_subplots(rows=2, cols=2, shared_xaxes=True, vertical_spacing=0.09, horizontal_spacing=0.09,
                        subplot_titles=[label for _, label, _ in BACKEND_PANELS])
    for i, (metric, _, unit) in enumerate(BACKEND_PANELS):
        for b in chosen["backend"]:
            fig.add_trace(
                go.Bar(
                    x=chosen["case"],
                    y=[by.get((c, b), {}).get(metric) for c in chosen["case"]],
                    name=b,
                    legendgroup=b,
                    showlegend=i == 0,
                    marker_color=colors[b],
                    hovertemplate=f"{b}<br>%{{x}}: %{{y:.3g}} {unit}<extra></extra>",
                ),
                row=1 + i // 2,
                col=1 + i % 2,
            )
    below_case_labels = dict(orientation="h", x=0, y=-0.2, yanchor="top")
    fig.update_layout(title=dict(text=title or "Tree attention backends side by side"), barmode="group",
                      template="plotly_white", height=760, margin=dict(l=60, r=20, t=90, b=40),
                      legend=below_case_labels)
    for col in (1, 2):
        fig.update_yaxes(title="ms", rangemode="tozero", row=1, col=col)
        fig.update_yaxes(title="TFLOP/s", rangemode="tozero", row=2, col=col)
    fig.update_xaxes(tickangle=-20, row=2)
    return fig


__all__ = [
    "add_speed_point",
    "draw_backend_times",
    "draw_bench_summary",
    "draw_sparse_bench",
    "draw_speed_sweep",
    "draw_train_bench",
    "load_bench_results",
]
