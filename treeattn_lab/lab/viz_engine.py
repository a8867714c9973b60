"""Plotly drawings of the training engine (notebook 02): DFS steps, memory per mode, micro-batches, bench.

Pure functions: data in, a ``plotly.graph_objects.Figure`` out (the helpers that prepare the data for a
drawing sit beside it). Shared colours and the trie drawing come from :mod:`treeattn_lab.lab.viz`.

- :func:`draw_dfs_step` / :func:`restyle_dfs_step`: one event of a
  :func:`~treeattn_lab.lab.dfs_stepper.dfs_trace`: the blocks of the trie by state, the K/V stack by
  position and the gradient buffers' fill.
- :func:`draw_dfs_timeline`: every event at once, the stack over time (the static view of the stepper).
- :func:`draw_held_tokens`: what each mode holds at its peak, in tokens, on one trie.
- :func:`draw_gradient_errors`: relative gradient error of each mode against flat training.
- :func:`mode_memory_rows` / :func:`draw_mode_memory`: peak memory and tokens computed of runs in each mode
  watched by a :class:`~treeattn_lab.lab.monitor.LiveMonitor`.
- :func:`micro_batch_choices` / :func:`draw_micro_batches` / :func:`draw_micro_batch_table`: the
  micro-batches of a trie and the mode the cost model picks for each, drawn on the trie.
- :func:`draw_train_bench`: ``bench train`` results: throughput and peak memory per mode and set.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import networkx as nx
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .viz import (
    DIMMED_COLOR,
    EDGE_COLOR,
    HIGHLIGHT_COLOR,
    PALETTE,
    ROOT_COLOR,
    draw_trie,
    node_size,
    tree_layout,
)

MIB = 2**20
GIB = 2**30
MODE_COLORS = {"flat": "#888888", "packed": "#4C78A8", "dfs": "#E45756", "auto": "#54A24B"}

# what a block (or a stack slot) is doing during an event
STATE_COLORS = {
    "waiting": DIMMED_COLOR,  # not run yet
    "stack": HIGHLIGHT_COLOR,  # its K/V (and gradient buffers) are held on the stack
    "push": "#F58518",  # running without autograd; its K/V are being stored
    "grad": "#54A24B",  # running with autograd (a pop or a batch of leaves)
    "done": "#7F7F7F",  # its gradient is computed; nothing of it is held any more
}
STATE_LABELS = {
    "push": "running: push (no autograd)",
    "grad": "running: with autograd",
    "stack": "K/V on the stack",
    "done": "done (freed)",
    "waiting": "waiting",
}


def _wrap(text: str, width: int = 100) -> str:
    return "<br>".join(textwrap.wrap(text, width))


# ------------------------------------------------------------------------------------ DFS steps
def _block_graph(trace) -> nx.DiGraph:
    """The blocks as a tree under a virtual root ``-1``, children in block (= packed) order."""
    graph = nx.DiGraph()
    graph.add_node(-1)
    for i, b in enumerate(trace.blocks):
        graph.add_edge(b.parent, i)
    return graph


def _block_hover(trace, i: int) -> str:
    b = trace.blocks[i]
    chunks = [j for j, n in enumerate(trace.block_node) if n == trace.block_node[i]]
    lines = [
        f"<b>block {i}</b> (node {trace.block_node[i]}, chunk {chunks.index(i) + 1} of {len(chunks)})",
        f"packed {b.start}..{b.end - 1}, positions {b.position}..{b.position + b.end - b.start - 1}",
        f"tokens: {trace.pack.input_ids[b.start : b.end].tolist()}",
    ]
    if trace.descendant_tokens[i]:
        lines.append(f"{trace.descendant_tokens[i]} tokens below it: pushed, then popped after them")
    else:
        lines.append("a leaf block: runs once, with autograd")
    return "<br>".join(lines)


def _running_state(step) -> str:
    return "push" if step.kind == "push" else "grad"


def _stack_columns(trace, i: int):
    """Per stack slot during event ``i``: (held, colour, pattern, hover) of the K/V panel and
    (fill, colour, hover) of the gradient buffer panel (after the event)."""
    step = trace[i]
    n = trace.num_slots
    kv_y, kv_color, kv_pattern, kv_text = [0.0] * n, [STATE_COLORS["waiting"]] * n, [""] * n, ["empty"] * n
    kv_block = [""] * n  # the block whose K/V sit in the slot, written on the bar
    gr_y, gr_color, gr_text = [0.0] * n, [STATE_COLORS["stack"]] * n, ["no buffer held"] * n

    def packed(b, s):
        return trace.blocks[b].start + s - trace.blocks[b].position

    for b in step.stack_before:
        if b in step.blocks:
            continue
        for s in trace.slots(b):
            kv_y[s], kv_color[s], kv_block[s] = 1.0, STATE_COLORS["stack"], str(b)
            kv_text[s] = f"K/V of block {b} (packed {packed(b, s)}), stored: read as prefix"
    running = _running_state(step)
    for b in step.blocks:
        for s in trace.slots(b):
            kv_y[s], kv_color[s], kv_block[s] = 1.0, STATE_COLORS[running], str(b)
            if step.kind == "push":
                kv_text[s] = f"K/V of block {b} (packed {packed(b, s)}): written by this push"
            elif step.kind == "pop":
                kv_text[s] = f"K/V of block {b} (packed {packed(b, s)}): recomputed with autograd, then freed"
            else:
                kv_pattern[s] = "/"
                kv_text[s] = (
                    f"leaf block {b} (packed {packed(b, s)}): K/V computed with autograd, never stored"
                )
    for b in step.stack_after:
        total = trace.descendant_tokens[b]
        got = step.grad_received[b]
        for s in trace.slots(b):
            gr_y[s] = got / total if total else 0.0
            gr_text[s] = f"block {b}: {got} of the {total} tokens below it have sent their gradients"
    if step.kind == "push":
        for s in trace.slots(step.blocks[0]):
            gr_y[s], gr_color[s] = 0.0, STATE_COLORS["push"]
            gr_text[s] = f"block {step.blocks[0]}: buffer zeroed, waiting for the tokens below it"
    elif step.kind == "pop":
        b = step.blocks[0]
        for s in trace.slots(b):
            gr_y[s], gr_color[s] = 1.0, STATE_COLORS["grad"]
            gr_text[s] = f"block {b}: complete buffer flows back through its K/V in this run, then freed"
    return (kv_y, kv_color, kv_pattern, kv_text, kv_block), (gr_y, gr_color, gr_text)


def _step_title(trace, i: int, title: str | None, sentence: bool) -> str:
    head = f"{title or 'DFS materialization'}: event {i + 1} of {len(trace)}"
    return f"{head}<br><sup>{_wrap(trace.describe(i))}</sup>" if sentence else head


def draw_dfs_step(trace, index: int = 0, *, title: str | None = None, sentence: bool = True) -> go.Figure:
    """One event of a DFS trace (:func:`treeattn_lab.lab.dfs_stepper.dfs_trace`) in three panels.

    Left: the trie's blocks as a tree (a node cut into several blocks is a chain), coloured by state:
    running (orange without autograd, green with), K/V on the stack (red), done (grey), waiting (pale).
    Top right: the K/V stack, one slot per position (the same slots in every layer); hatched slots are a
    leaf's K/V, computed in the run and never stored. Bottom right: after the event, each stack block's
    gradient buffer as the share of the tokens below it that have sent their gradients (a block pops at 1).
    Restyle the figure to another event with :func:`restyle_dfs_step` (a ``FigureWidget`` redraws in place).
    ``sentence``: say what the event does under the title (:meth:`DfsTrace.describe`).
    """
    graph = _block_graph(trace)
    pos = tree_layout(graph, -1)
    fig = make_subplots(
        rows=2,
        cols=2,
        specs=[[{"rowspan": 2}, {}], [None, {}]],
        column_widths=[0.5, 0.5],
        horizontal_spacing=0.07,
        vertical_spacing=0.22,
        subplot_titles=(
            "blocks of the trie, walked depth first",
            "K/V stack, by position (every layer alike)",
            "gradient buffers: share arrived",
        ),
    )
    ex, ey = [], []
    for u, v in graph.edges():
        ex += [pos[u][0], pos[v][0], None]
        ey += [pos[u][1], pos[v][1], None]
    fig.add_trace(
        go.Scatter(
            x=ex,
            y=ey,
            mode="lines",
            name="edges",
            hoverinfo="skip",
            showlegend=False,
            line=dict(color=EDGE_COLOR, width=1.5),
        ),
        row=1,
        col=1,
    )
    order = list(range(len(trace.blocks)))
    fig.add_trace(
        go.Scatter(
            x=[pos[-1][0]],
            y=[pos[-1][1]],
            mode="markers",
            name="root",
            showlegend=False,
            hovertemplate="root (holds no tokens)<extra></extra>",
            marker=dict(size=9, color=ROOT_COLOR),
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=[pos[b][0] for b in order],
            y=[pos[b][1] for b in order],
            mode="markers+text",
            name="blocks",
            showlegend=False,
            text=[str(b) for b in order],
            textposition="middle right",
            customdata=order,
            hovertext=[_block_hover(trace, b) for b in order],
            hovertemplate="%{hovertext}<extra></extra>",
            marker=dict(
                size=[node_size(trace.block_size(b)) + 8 for b in order],
                color=[STATE_COLORS["waiting"]] * len(order),
                line=dict(width=1, color="#333333"),
            ),
        ),
        row=1,
        col=1,
    )
    for state, label in STATE_LABELS.items():  # legend entries
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=label,
                marker=dict(size=11, color=STATE_COLORS[state]),
            ),
            row=1,
            col=1,
        )
    slots = list(range(trace.num_slots))
    fig.add_trace(
        go.Bar(
            x=slots,
            y=[0.0] * len(slots),
            name="kv",
            showlegend=False,
            textposition="inside",
            insidetextanchor="middle",
            hovertemplate="slot %{x}: %{hovertext}<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.add_trace(
        go.Bar(
            x=slots,
            y=[0.0] * len(slots),
            name="grad",
            showlegend=False,
            hovertemplate="slot %{x}: %{hovertext}<extra></extra>",
        ),
        row=2,
        col=2,
    )
    depth = max(-y for _, y in pos.values())
    fig.update_xaxes(visible=False, row=1, col=1)
    fig.update_yaxes(visible=False, range=[-depth - 0.5, 0.5], row=1, col=1)
    fig.update_xaxes(range=[-0.5, len(slots) - 0.5], row=1, col=2)
    fig.update_xaxes(title="position in the rollout", range=[-0.5, len(slots) - 0.5], row=2, col=2)
    fig.update_yaxes(range=[0, 1.05], tickvals=[0, 1], ticktext=["", "held"], row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=2, col=2)
    fig.update_layout(
        template="plotly_white",
        height=max(560, min(900, 260 + 60 * int(depth))),
        margin=dict(l=20, r=20, t=140, b=80),
        bargap=0.1,
        legend=dict(orientation="h", y=-0.16, x=0),
        meta=dict(index=index, events=len(trace)),
    )
    restyle_dfs_step(fig, trace, index, title=title, sentence=sentence)
    return fig


def restyle_dfs_step(fig, trace, index: int, *, title: str | None = None, sentence: bool = True) -> None:
    """Restyle a :func:`draw_dfs_step` figure (or its ``FigureWidget``) in place to event ``index``."""
    if not 0 <= index < len(trace):
        raise IndexError(f"event {index} out of range for {len(trace)} events")
    states = trace.block_states(index)
    running = _running_state(trace[index])
    colors = [STATE_COLORS[running if s == "running" else s] for s in states]
    widths = [3 if s in ("running", "stack") else 1 for s in states]
    kv_columns, (gr_y, gr_color, gr_text) = _stack_columns(trace, index)
    kv_y, kv_color, kv_pattern, kv_text, kv_block = kv_columns
    by_name = {t.name: t for t in fig.data}
    with fig.batch_update():
        by_name["blocks"].marker.color = colors
        by_name["blocks"].marker.line.width = widths
        by_name["kv"].y = kv_y
        by_name["kv"].marker.color = kv_color
        by_name["kv"].marker.pattern.shape = kv_pattern
        by_name["kv"].hovertext = kv_text
        by_name["kv"].text = kv_block
        zeroed = STATE_COLORS["push"]  # a just-zeroed buffer gets a sliver, so it can be seen and hovered
        by_name["grad"].y = [max(y, 0.03) if c == zeroed else y for y, c in zip(gr_y, gr_color, strict=True)]
        by_name["grad"].marker.color = gr_color
        by_name["grad"].hovertext = gr_text
        fig.layout.title.text = _step_title(trace, index, title, sentence)
        fig.layout.meta = dict(index=index, events=len(trace))


def _event_label(step) -> str:
    return f"{step.index}: {step.kind} {','.join(str(b) for b in step.blocks)}"


def draw_dfs_timeline(trace, *, title: str | None = None) -> go.Figure:
    """Every event of a DFS trace at once: the K/V stack (top) and the gradient buffers (bottom) over time.

    Columns are events, rows stack slots (positions). Top: red = K/V held and read as prefix, orange =
    written by a push, green = run with autograd (a pop recomputing its block, or leaves). Bottom: each
    stack block's buffer fill after the event (share of the tokens below it whose gradients arrived).
    The stack grows and shrinks with the depth of the walk, never with the number of rollouts.
    """
    n_slots, n_events = trace.num_slots, len(trace)
    code = {"stack": 1, "push": 2, "grad": 3}
    kv = [[0] * n_events for _ in range(n_slots)]
    kv_text = [["empty"] * n_events for _ in range(n_slots)]
    fill = [[None] * n_events for _ in range(n_slots)]
    for e, step in enumerate(trace):
        (held, _, _, text, _), (gr_y, _, gr_text) = _stack_columns(trace, e)
        running = {s for b in step.blocks for s in trace.slots(b)}
        buffers = {s for b in step.stack_after for s in trace.slots(b)}
        if step.kind == "pop":  # the popped block's full buffer is consumed by this event
            buffers |= running
        for s in range(n_slots):
            if held[s]:
                kv[s][e] = code[_running_state(step)] if s in running else code["stack"]
                kv_text[s][e] = text[s]
            if s in buffers:
                fill[s][e] = gr_y[s]
                kv_text[s][e] += f"<br>buffer after the event: {gr_text[s]}"
    colors = ["#FFFFFF", STATE_COLORS["stack"], STATE_COLORS["push"], STATE_COLORS["grad"]]
    scale = []
    for c, color in enumerate(colors):
        scale += [[c / 4, color], [(c + 1) / 4, color]]
    labels = [_event_label(s) for s in trace]
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=("K/V stack per position, event by event", "gradient buffer fill after each event"),
    )
    fig.add_trace(
        go.Heatmap(
            z=kv,
            x=labels,
            zmin=-0.5,
            zmax=3.5,
            colorscale=scale,
            showscale=False,
            xgap=1,
            ygap=1,
            text=kv_text,
            hovertemplate="event %{x}, slot %{y}: %{text}<extra></extra>",
            name="kv",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            z=fill,
            x=labels,
            zmin=0,
            zmax=1,
            colorscale=[[0, "#FBE3E3"], [1, HIGHLIGHT_COLOR]],
            xgap=1,
            ygap=1,
            colorbar=dict(title="fill", len=0.4, y=0.2, tickformat=".0%"),
            hovertemplate="event %{x}, slot %{y}: %{z:.0%}<extra></extra>",
            name="grad",
        ),
        row=2,
        col=1,
    )
    for label, c in (
        ("K/V held (prefix)", "stack"),
        ("push: written", "push"),
        ("run with autograd", "grad"),
    ):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=label,
                marker=dict(symbol="square", size=12, color=STATE_COLORS[c]),
            ),
            row=1,
            col=1,
        )
    peak = trace.peak_stack_tokens()
    sub = (
        f"{len(trace.blocks)} blocks of at most {trace.block_tokens} tokens, {n_events} events; "
        f"the stack never holds more than {peak} of the {trace.pack.num_tokens} tree tokens"
    )
    fig.update_yaxes(title="slot", autorange="reversed", row=1, col=1)
    fig.update_yaxes(title="slot", autorange="reversed", row=2, col=1)
    fig.update_xaxes(tickangle=-45, row=2, col=1)
    fig.update_layout(
        title=dict(text=f"{title or 'The stack over time'}<br><sup>{sub}</sup>"),
        template="plotly_white",
        height=max(560, min(1000, 320 + 30 * n_slots)),
        margin=dict(l=60, r=20, t=90, b=60),
        legend=dict(orientation="h", y=-0.22, x=0),
        plot_bgcolor="white",
    )
    return fig


# ------------------------------------------------------------------------------------ memory
def held_tokens(trace, token_budget: int | None = None) -> dict[str, dict[str, int]]:
    """Tokens each mode holds at its peak on the trie of ``trace``: ``{mode: {"activations", "path"}}``.

    ``activations``: tokens whose activations are kept for backward at once (flat: its largest padded
    batch, rows x longest; packed: every tree token; dfs: the largest with-autograd run, a block or a
    padded batch of sibling leaves). ``path``: tokens whose K/V and gradient buffers the DFS stack holds
    (a few numbers per layer each, far less than a token's activations).
    """
    from ..engine.modes import flat_chunks

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
        go.Bar(
            x=modes,
            y=ys,
            marker_color=[MODE_COLORS.get(m, PALETTE[0]) for m in modes],
            text=[f"{errors[m]:.1e}" for m in modes],
            textposition="outside",
            cliponaxis=False,
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
        yaxis=dict(type="log", title="relative error"),
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
        go.Bar(
            x=modes,
            y=peaks,
            marker_color=[MODE_COLORS.get(m) for m in modes],
            showlegend=False,
            text=[f"{p:,.0f}" if p is not None else "n/a" for p in peaks],
            textposition="outside",
            cliponaxis=False,
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


# ------------------------------------------------------------------------------------ micro-batches
def micro_batch_choices(
    trie, *, token_budget: int | None, block_tokens: int, cost_model=None, memory_limit: float | None = None
) -> list[dict]:
    """The micro-batches of ``trie`` (:func:`~treeattn_lab.engine.plan_micro_batches`) and, per
    micro-batch, the cost model's predictions ``{mode: (seconds, bytes)}`` and choice, as ``"auto"``
    would make them (:meth:`~treeattn_lab.engine.CostModel.choose` on :meth:`MicroBatchShape.of`)."""
    from ..engine import CostModel, MicroBatchShape, plan_micro_batches

    cost_model = cost_model or CostModel()
    rows = []
    for j, mb in enumerate(plan_micro_batches(trie, token_budget)):
        shape = MicroBatchShape.of(mb.trie, block_tokens, token_budget)
        choice, predictions = cost_model.choose(shape, memory_limit=memory_limit)
        rows.append(
            {
                "micro_batch": j,
                "sequences": mb.sequences,
                "flat_tokens": mb.flat_tokens,
                "tree_tokens": mb.tree_tokens,
                "carried_tokens": mb.carried_tokens,
                "choice": choice,
                "predicted": predictions,
                "calibrated": cost_model.calibrated,
            }
        )
    return rows


def micro_batch_colors(trie, rows: Sequence[Mapping]) -> dict[int, str]:
    """``{node: label}`` for :func:`treeattn_lab.lab.viz.draw_trie`'s ``color_by``: each node labelled by the
    micro-batch (and its mode) whose rollouts pass through it; a prefix that several micro-batches
    compute (carried across a cut) is labelled as shared."""
    owners: dict[int, set[int]] = {}
    for r in rows:
        for i in r["sequences"]:
            for node in trie.path(trie.seq_end_node[i]):
                owners.setdefault(node, set()).add(r["micro_batch"])
    width = len(str(len(rows) - 1))
    label = {r["micro_batch"]: f"{r['micro_batch']:0{width}d}: {r['choice']}" for r in rows}
    return {n: label[next(iter(o))] if len(o) == 1 else "shared prefix (carried)" for n, o in owners.items()}


def draw_micro_batches(trie, rows: Sequence[Mapping], *, title: str | None = None, max_nodes: int = 400):
    """The trie with every node coloured by its micro-batch and the mode chosen for it."""
    modes = [r["choice"] for r in rows]
    counts = ", ".join(f"{modes.count(m)} {m}" for m in ("flat", "packed", "dfs") if m in modes)
    head = title or "Micro-batches and the cost model's choices"
    return draw_trie(
        trie,
        color_by=micro_batch_colors(trie, rows),
        max_nodes=max_nodes,
        title=f"{head} ({len(rows)} micro-batches: {counts})",
    )


def draw_micro_batch_table(rows: Sequence[Mapping]) -> go.Figure:
    """The micro-batches as a table: sizes, predicted time (and memory, when calibrated) per mode, choice."""
    if not rows:
        raise ValueError("rows is empty")
    modes = list(rows[0]["predicted"])
    header = ["micro-batch", "rollouts", "flat tokens", "tree tokens", "carried"]
    header += [f"{m} ms" for m in modes]
    calibrated = rows[0]["calibrated"]
    if calibrated:
        header += [f"{m} GiB" for m in modes]
    header.append("choice")
    cols = [
        [r["micro_batch"] for r in rows],
        [len(r["sequences"]) for r in rows],
        [r["flat_tokens"] for r in rows],
        [r["tree_tokens"] for r in rows],
        [r["carried_tokens"] for r in rows],
    ]
    cols += [[f"{r['predicted'][m][0] * 1e3:.1f}" for r in rows] for m in modes]
    if calibrated:
        cols += [[f"{r['predicted'][m][1] / GIB:.1f}" for r in rows] for m in modes]
    cols.append([f"<b>{r['choice']}</b>" for r in rows])
    fig = go.Figure(
        go.Table(
            header=dict(values=header, fill_color="#2F5D8A", font=dict(color="white"), align="right"),
            cells=dict(values=cols, align="right", fill_color="#F7F7F7"),
        )
    )
    fig.update_layout(height=70 + 24 * (len(rows) + 1), margin=dict(l=10, r=10, t=10, b=10))
    return fig


# ------------------------------------------------------------------------------------ bench train
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
            go.Bar(
                x=sets,
                y=[r.get("tokens_per_s", 0) / 1e3 for r in got],
                name=m,
                legendgroup=m,
                marker_color=MODE_COLORS.get(m),
                hovertext=hover,
                text=[f"{r.get('speedup', 0):.2f}x" for r in got],
                textposition="outside",
                cliponaxis=False,
                hovertemplate="%{x}<br>%{y:.0f}K tokens/s<br>%{hovertext}<extra></extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=sets,
                y=[r.get("peak_gib") for r in got],
                name=m,
                legendgroup=m,
                showlegend=False,
                marker_color=MODE_COLORS.get(m),
                text=[f"{r.get('peak_gib', 0):.0f}" for r in got],
                textposition="outside",
                cliponaxis=False,
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


__all__ = [
    "MODE_COLORS",
    "STATE_COLORS",
    "draw_dfs_step",
    "draw_dfs_timeline",
    "draw_gradient_errors",
    "draw_held_tokens",
    "draw_micro_batch_table",
    "draw_micro_batches",
    "draw_mode_memory",
    "draw_train_bench",
    "held_tokens",
    "host_rss_rise",
    "micro_batch_choices",
    "micro_batch_colors",
    "mode_memory_rows",
    "restyle_dfs_step",
]
