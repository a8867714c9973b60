"""The figure of a :class:`~.live.LiveMonitor`: memory over time on top, latency per step below.

Every trace carries its column's name in ``meta`` (``"allocated:0"``, ``"rss"``, ``"latency"``, ...), so
:func:`fill_figure` can refresh a figure (or a ``FigureWidget``, which then redraws in place) from
:func:`history_columns` without knowing how it was built. Plotly is imported only when a figure is made.
"""

from __future__ import annotations

from collections.abc import Sequence

from .records import Sample, Step

GPU_COLORS = ("#4C78A8", "#E45756", "#54A24B", "#F58518", "#B279A2", "#72B7B2", "#EECA3B", "#9D755D")
HOST_COLOR = "#888888"
GPU_MEMORY_KINDS = (("allocated", "solid"), ("reserved", "dash"), ("peak", "dot"))

Columns = dict[str, tuple[list, list, "list | None"]]


def _line(name: str, meta: str, hover: str, mode: str = "lines", **style):
    import plotly.graph_objects as go

    return go.Scatter(x=[], y=[], mode=mode, name=name, meta=meta, hovertemplate=hover, **style)


def _add_gpu_lines(fig, devices: Sequence[int], nvml: bool) -> None:
    """Per GPU: allocated, reserved and peak memory (MiB, left axis) and, with NVML, utilisation (%)."""
    for i, d in enumerate(devices):
        color = GPU_COLORS[i % len(GPU_COLORS)]
        for kind, dash in GPU_MEMORY_KINDS:
            hover = f"cuda:{d} {kind}: %{{y:,.0f}} MiB at %{{x:.2f}} s<extra></extra>"
            trace = _line(f"cuda:{d} {kind}", f"{kind}:{d}", hover, line=dict(color=color, dash=dash))
            fig.add_trace(trace, row=1, col=1, secondary_y=False)
        if nvml:
            hover = f"cuda:{d} utilisation: %{{y:.0f}}% at %{{x:.2f}} s<extra></extra>"
            trace = _line(f"cuda:{d} utilisation", f"util:{d}", hover, line=dict(color=color, width=1),
                          opacity=0.4)
            fig.add_trace(trace, row=1, col=1, secondary_y=True)


def monitor_figure(title: str, devices: Sequence[int], nvml: bool, *, widget: bool = False):
    """The empty two-panel figure: memory over time (MiB; NVML utilisation in % on a second axis when
    ``nvml``) on top, latency per step below. ``widget=True`` returns a ``go.FigureWidget`` (needs
    anywidget), else a ``go.Figure``."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2,
        cols=1,
        specs=[[{"secondary_y": True}], [{}]],
        vertical_spacing=0.14,
        subplot_titles=("memory over time (seconds since start)", "latency per step"),
    )
    _add_gpu_lines(fig, devices, nvml)
    rss = _line("host RSS", "rss", "host RSS: %{y:,.0f} MiB at %{x:.2f} s<extra></extra>",
                line=dict(color=HOST_COLOR))
    fig.add_trace(rss, row=1, col=1, secondary_y=False)
    latency = _line("step latency", "latency", "step %{x}: %{y:.3g} ms<br>%{text}<extra></extra>",
                    mode="lines+markers", line=dict(color="#333333"), marker=dict(size=6), showlegend=False)
    fig.add_trace(latency, row=2, col=1)
    fig.update_layout(
        title=dict(text=title),
        template="plotly_white",
        height=520,
        margin=dict(l=60, r=60, t=80, b=50),
        legend=dict(orientation="h", y=-0.14),
        uirevision="live",  # redraws keep the user's zoom
    )
    fig.update_yaxes(title="MiB", rangemode="tozero", row=1, col=1, secondary_y=False)
    if nvml:
        fig.update_yaxes(title="utilisation %", range=[0, 100], row=1, col=1, secondary_y=True)
    fig.update_xaxes(title="step", row=2, col=1)
    fig.update_yaxes(title="ms", rangemode="tozero", row=2, col=1)
    return go.FigureWidget(fig) if widget else fig


def history_columns(samples: Sequence[Sample], steps: Sequence[Step], devices: Sequence[int]) -> Columns:
    """The histories as plot columns ``{trace meta: (x, y, hover text or None)}``."""
    t = [s.t_s for s in samples]
    cols: Columns = {
        "rss": (t, [s.rss_mib for s in samples], None),
        "latency": ([s.index for s in steps], [s.latency_ms for s in steps], [s.label or "" for s in steps]),
    }
    for j, d in enumerate(devices):
        cols[f"allocated:{d}"] = (t, [s.gpus[j].allocated_mib for s in samples], None)
        cols[f"reserved:{d}"] = (t, [s.gpus[j].reserved_mib for s in samples], None)
        cols[f"peak:{d}"] = (t, [s.gpus[j].peak_mib for s in samples], None)
        cols[f"util:{d}"] = (t, [s.gpus[j].utilization for s in samples], None)
    return cols


def fill_figure(fig, columns: Columns, title_text: str) -> None:
    """Set every trace of a :func:`monitor_figure` to its column, and the title, in one batch."""
    with fig.batch_update():
        for trace in fig.data:
            x, y, text = columns[trace.meta]
            trace.x, trace.y = x, y
            if text is not None:
                trace.text = text
        fig.layout.title.text = title_text
