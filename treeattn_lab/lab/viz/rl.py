"""Drawings of the RL loop on tries (notebook 07): a sampled trie with its text, and GRPO flat against tree.

- :func:`draw_sampled_trie`: :func:`treeattn_lab.lab.viz.draw_trie` of a sampled batch, hover showing each
  node's text (decoded) and the reward of the rollouts ending there.
- :func:`draw_grpo_live` / :func:`add_grpo_record`: reward and log-prob + training seconds per step, one
  line per loop; show the figure through :class:`treeattn_lab.lab.viz.LiveFigure` and add each step's
  record to its widget as it arrives.
- :func:`draw_phase_times`: mean seconds per phase (sample, reward, log-probs, train), loops side by side.

Pure functions: data in, a ``plotly.graph_objects.Figure`` out (``add_grpo_record`` updates the one given).
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import MODE_COLORS
from .tries import draw_trie

LOOP_COLORS = {"flat": MODE_COLORS["flat"], "tree": MODE_COLORS["packed"]}
PHASE_NAMES = {"sample": "sample", "reward": "reward", "logprobs": "log-probs", "train": "train"}
_MAX_TEXT = 120


def _shown(text: str) -> str:
    """Text safe for a hover label: escaped, newlines shown as ⏎, cut to a readable length."""
    text = text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."
    return html.escape(text).replace("\n", "⏎")


def draw_sampled_trie(batch, decode: Callable[[list[int]], str], rewards=None, *, max_nodes: int = 300,
                      title: str | None = None) -> go.Figure:
    """The trie of a :class:`treeattn_lab.rl.SampleBatch`; hover shows each node's tokens as text (``decode``)
    and, when ``rewards [rollouts]`` is given, the rewards of the rollouts ending at the node."""
    trie = batch.trie
    fig = draw_trie(trie, max_nodes=max_nodes, title=title or "The trie that sampling made")
    nodes = next(t for t in fig.data if t.name == "nodes")
    texts = []
    for node in nodes.customdata:
        if node == 0:
            texts.append("<b>root</b>")
            continue
        n = trie.nodes[node]
        lines = [f"<b>node {node}</b> (positions {n.depth}..{n.end_depth - 1})", _shown(decode(n.tokens))]
        if n.ends:
            ends = ", ".join(str(e) for e in n.ends[:8]) + (" ..." if len(n.ends) > 8 else "")
            lines.append(f"rollouts ending here: {ends}")
            if rewards is not None:
                lines.append("rewards: " + ", ".join(f"{float(rewards[e]):.2f}" for e in n.ends[:8]))
        texts.append("<br>".join(lines))
    nodes.text = texts
    return fig


def draw_grpo_live(loops: Sequence[str] = ("flat", "tree"), *, title: str | None = None) -> go.Figure:
    """Empty panels, reward per step and log-prob + training seconds per step, with one line per loop."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("mean reward of the step's rollouts",
                                                        "log-probs + train, seconds per step"))
    for col in (1, 2):
        for loop in loops:
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=loop, legendgroup=loop,
                                     showlegend=col == 1, line=dict(color=LOOP_COLORS.get(loop))),
                          row=1, col=col)
    fig.update_xaxes(title="GRPO step")
    fig.update_yaxes(title="reward", row=1, col=1)
    fig.update_yaxes(title="seconds", rangemode="tozero", row=1, col=2)
    fig.update_layout(template="plotly_white", height=360, title=title or "GRPO, flat against tree")
    return fig


def add_grpo_record(fig, record: Mapping) -> None:
    """Append one step's record (:meth:`treeattn_lab.rl.grpo.GRPO.step`) to its loop's two lines."""
    learner = record["times_s"]["logprobs"] + record["times_s"]["train"]
    traces = [t for t in fig.data if t.name == record["mode"]]
    if len(traces) != 2:
        raise ValueError(f"the figure has no lines for the loop {record['mode']!r}")
    for trace, y in zip(traces, (record["reward"], learner), strict=True):
        trace.x = (*(trace.x or ()), record["step"])
        trace.y = (*(trace.y or ()), y)


def draw_phase_times(histories: Mapping[str, Sequence[Mapping]], *, skip_first: bool = True,
                     title: str | None = None) -> go.Figure:
    """Mean seconds per phase for each loop (``{loop: records}``), stacked, the loops side by side.

    ``skip_first``: leave step 0 out of the means (it pays one-time allocations)."""
    fig = go.Figure()
    loops = list(histories)
    for phase, name in PHASE_NAMES.items():
        means = []
        for loop in loops:
            records = list(histories[loop])
            records = records[1:] if skip_first and len(records) > 1 else records
            means.append(statistics.fmean(r["times_s"][phase] for r in records))
        fig.add_trace(go.Bar(x=loops, y=means, name=name, text=[f"{m:.3f}" for m in means],
                             textposition="inside"))
    fig.update_layout(barmode="stack", template="plotly_white", height=380, yaxis_title="seconds per step",
                      title=title or "Where a GRPO step's time goes")
    return fig


__all__ = ["LOOP_COLORS", "add_grpo_record", "draw_grpo_live", "draw_phase_times", "draw_sampled_trie"]
