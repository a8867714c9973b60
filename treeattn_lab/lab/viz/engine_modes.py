"""Drawing the engine's modes side by side: what each holds, what it computes, how exact it is.

- :func:`held_tokens` / :func:`draw_held_tokens`: the tokens flat, packed and dfs keep alive at their
  peak on one trie (activations for backward, and the DFS stack's K/V and gradient buffers).
- :func:`draw_gradient_errors`: each mode's largest relative gradient error against flat training.
- :func:`mode_memory_rows` / :func:`draw_mode_memory`: peak memory and tokens computed of runs in each
  mode watched by a :class:`~treeattn_lab.lab.monitor.LiveMonitor` (:func:`host_rss_rise` where no CUDA
  peak is known).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import HIGHLIGHT_COLOR, LOG_AXIS, MODE_COLORS, PALETTE, labelled_bar

MIB = 2**20


def held_tokens(trace, token_budget: int | None = None) -> dict[str, dict[str, int]]:
    """Tokens each mode holds at its peak on the trie of ``trace``: ``{mode: {"activations", "path"}}``.

    ``activations``: tokens whose activations are kept for backward at once (flat: its largest padded
    batch, rows x longest; packed: every tree token; dfs: the largest with-autograd run, a block or a
    padded batch of sibling leaves). ``path``: tokens whose K/V and gradient buffers the DFS stack holds
    (a few numbers per layer each, far less than a token's activations).
    """
    from ...engine.modes import flat_chunks

    lengths = trace.pack.seq_lengths.tolist()
    flat = max(len(c) * lengths[c[0]] for c in flat_chunks(lengths, token_budget))
    runs = [len(s.blocks) * max(trace.block_size(b) for b in s.blocks) for s in trace if s.with_grad]
    return {
        "flat": {"activations": flat, "path": 0},
        "packed": {"activations": trace.pack.num_tokens, "path": 0},
        "dfs": {"activations": max(runs), "path": trace.peak_stack_tokens()},
    }


def draw_held_tokens(trace, token_budget: int | None = None, *, title: str | None = None) -> go.Figure:
    """Stacked bars of :func:`held_tokens`: what flat, packed and dfs keep alive at their peak."""
    held = held_tokens(trace, token_budget)
    modes = list(held)
    fig = go.Figure()
    for key, name, color in (
        ("activations", "activations kept for backward", "#4C78A8"),
        ("path", "K/V + gradient buffers of the active path", HIGHLIGHT_COLOR),
    ):
        ys = [held[m][key] for m in modes]
        fig.add_trace(
            go.Bar(
                x=modes,
                y=ys,
                name=name,
                marker_color=color,
                text=[str(y) if y else "" for y in ys],
                textposition="inside",
                hovertemplate=f"%{{x}}: %{{y}} tokens ({name})<extra></extra>",
            )
        )
    s = trace[-1]
    sub = (
        f"flat {sum(trace.pack.seq_lengths.tolist())} tokens, tree {trace.pack.num_tokens}; "
        f"dfs recomputes {s.no_grad_tokens} tokens (pushes run twice)"
    )
    fig.update_layout(
        title=dict(text=f"{title or 'Tokens held at the peak'}<br><sup>{sub}</sup>"),
        template="plotly_white",
        barmode="stack",
        height=380,
        yaxis_title="tokens",
        margin=dict(l=60, r=20, t=80, b=40),
    )
    return fig


def draw_gradient_errors(
    errors: Mapping[str, float], *, tolerance: float | None = None, title: str | None = None
) -> go.Figure:
    """Bars (log scale) of each mode's largest relative gradient error against flat training."""
    if not errors:
        raise ValueError("errors is empty")
    modes = list(errors)
    ys = [max(float(errors[m]), 1e-18) for m in modes]
    fig = go.Figure(
        labelled_bar(
            modes,
            ys,
            [f"{errors[m]:.1e}" for m in modes],
            marker_color=[MODE_COLORS.get(m, PALETTE[0]) for m in modes],
            hovertemplate="%{x}: %{y:.2e}<extra></extra>",
        )
    )
    if tolerance is not None:
        fig.add_hline(
            y=tolerance, line_dash="dash", line_color="#666666", annotation_text=f"tolerance {tolerance:g}"
        )
    fig.update_layout(
        title=dict(text=title or "Largest relative gradient error per parameter, against flat training"),
        template="plotly_white",
        height=360,
        yaxis=dict(title="relative error", **LOG_AXIS),
        margin=dict(l=60, r=20, t=60, b=40),
    )
    return fig


def host_rss_rise(samples, start_s: float, end_s: float) -> float | None:
    """MiB the host RSS rose above its level at ``start_s`` during ``[start_s, end_s]`` (monitor samples),
    or None without RSS samples. The baseline is the last sample at or before ``start_s``."""
    rss = [(s.t_s, s.rss_mib) for s in samples if s.rss_mib is not None]
    if not rss:
        return None
    before = [r for t, r in rss if t <= start_s] or [rss[0][1]]
    inside = [r for t, r in rss if start_s <= t <= end_s] + [before[-1]]
    return max(inside) - before[-1]


def mode_memory_rows(results: Mapping[str, object], monitor) -> list[dict]:
    """One row per mode from ``{mode: TreeBackwardResult}`` and the :class:`LiveMonitor` that watched them.

    Each run must have been recorded as a monitor step labelled with its mode, right after it (e.g.
    ``mon.step(result.report.time_s * 1e3, label=mode)``). Peak memory: the report's CUDA peak where it
    has one (allocated, weights included), else the host RSS rise over the run's window.
    """
    steps = {s.label: s for s in monitor.steps}
    samples = monitor.samples
    rows = []
    for mode, result in results.items():
        if mode not in steps:
            raise KeyError(
                f"the monitor has no step labelled {mode!r}; record each run with mon.step(..., label=mode)"
            )
        rep, step = result.report, steps[mode]
        if rep.peak_memory_bytes is not None:
            peak, source = rep.peak_memory_bytes / MIB, "CUDA peak allocated"
        else:
            peak = host_rss_rise(samples, step.t_s - step.latency_ms / 1e3, step.t_s)
            source = "host RSS rise"
        rows.append(
            {
                "mode": mode,
                "peak_mib": peak,
                "memory": source,
                "time_s": rep.time_s,
                "flat_tokens": rep.flat_tokens,
                "grad_tokens": rep.grad_tokens,
                "recomputed_tokens": rep.recomputed_tokens,
                "modes": ",".join(sorted(set(rep.modes))),
            }
        )
    return rows


def draw_mode_memory(rows: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """Two panels from :func:`mode_memory_rows`: peak memory per mode, and the tokens each computed
    (with autograd, and recomputed without) against the flat tokens of the rollouts."""
    if not rows:
        raise ValueError("rows is empty")
    modes = [r["mode"] for r in rows]
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.12,
        subplot_titles=(f"peak memory ({rows[0]['memory']}, MiB)", "tokens computed"),
    )
    peaks = [r["peak_mib"] for r in rows]
    fig.add_trace(
        labelled_bar(
            modes,
            peaks,
            [f"{p:,.0f}" if p is not None else "n/a" for p in peaks],
            marker_color=[MODE_COLORS.get(m) for m in modes],
            showlegend=False,
            hovertemplate="%{x}: %{y:,.1f} MiB<extra></extra>",
        ),
        row=1,
        col=1,
    )
    for key, name, color in (
        ("grad_tokens", "with autograd", "#4C78A8"),
        ("recomputed_tokens", "recomputed without autograd", "#F58518"),
    ):
        fig.add_trace(
            go.Bar(
                x=modes,
                y=[r[key] for r in rows],
                name=name,
                marker_color=color,
                hovertemplate=f"%{{x}}: %{{y:,}} tokens {name}<extra></extra>",
            ),
            row=1,
            col=2,
        )
    fig.add_hline(
        y=rows[0]["flat_tokens"],
        line_dash="dash",
        line_color="#666666",
        row=1,
        col=2,
        annotation_text="flat tokens",
    )
    fig.update_layout(
        title=dict(text=title or "Memory and work per mode"),
        template="plotly_white",
        barmode="stack",
        height=380,
        margin=dict(l=60, r=20, t=80, b=40),
        legend=dict(orientation="h", y=-0.15),
    )
    fig.update_yaxes(rangemode="tozero")
    return fig


__all__ = [
    "draw_gradient_errors",
    "draw_held_tokens",
    "draw_mode_memory",
    "held_tokens",
    "host_rss_rise",
    "mode_memory_rows",
]
