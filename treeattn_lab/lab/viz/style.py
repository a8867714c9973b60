"""The look every drawing shares: colours, colour scales, legend entries, wrapped titles, widths that fit.

A figure fits JupyterLab's default layout on a small laptop screen: at a 1366 x 900 window with the file
browser open, a notebook's output area is about 930 px wide. A drawing either autosizes (no ``width``) or
sets a width of at most :data:`MAX_FIGURE_WIDTH`; titles are wrapped to the figure's
width (:func:`fit_title`) with the top margin they need, and legends sit beside or below the data.

Colours name what they show, so the same thing has the same colour in every notebook: a highlighted
rollout is :data:`HIGHLIGHT_COLOR` on a trie and on the DFS stack, a backend or an engine mode keeps its
colour across bench figures (:data:`BACKEND_COLORS`, :data:`MODE_COLORS`), a rank its colour across the
partition and ring drawings (:data:`PALETTE`).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.colors import qualitative

NODE_COLOR = "#4C78A8"
ROOT_COLOR = "#888888"
EDGE_COLOR = "#B0B0B0"
HIGHLIGHT_COLOR = "#E45756"
DIMMED_COLOR = "#C8D3E0"
PALETTE = qualitative.Plotly  # categories, partitioners and ranks, in order
MASK_COLORSCALE = [[0.0, "#F4F4F4"], [1.0, "#2F5D8A"]]  # masked, attended
BACKEND_COLORS = {"flat": "#888888", "flex": "#4C78A8", "triton": "#E45756", "reference": "#72B7B2"}
MODE_COLORS = {"flat": "#888888", "packed": "#4C78A8", "dfs": "#E45756", "dfs-ckpt": "#F58518",
               "dfs-budget": "#B279A2", "auto": "#54A24B"}
MAX_FIGURE_WIDTH = 900  # px: the widest a drawing sets; the output area at 1366 x 900 is about 930 px
TITLE_FONT_PX = 17  # plotly's default title size
LINE_PX = 22  # the height of one title line
LOG_AXIS = dict(type="log", exponentformat="power")  # log axes tick as 10^3, not 1e+3 or 1k
TABLE_HEADER_COLOR = "#2F5D8A"
_KEEP = "\u00a0"  # a space textwrap does not break at
TABLE_CELL_COLOR = "#F7F7F7"


def stepped_colorscale(colors: Sequence[str]) -> list[list]:
    """A plotly colorscale with one flat band per colour: value ``i`` of ``zmin=-0.5, zmax=n-0.5`` (or
    ``zmin=0, zmax=n``, each band's lower edge) is drawn in ``colors[i]``."""
    n = len(colors)
    scale = []
    for i, color in enumerate(colors):
        scale += [[i / n, color], [(i + 1) / n, color]]
    return scale


def labelled_bar(x, y, text, **trace) -> go.Bar:
    """A bar trace with each bar's label (``text``) printed above it, never clipped by the axis."""
    return go.Bar(x=x, y=y, text=text, textposition="outside", cliponaxis=False, **trace)


def legend_entry(name: str, marker: dict, **trace) -> go.Scatter:
    """A trace with no points and one marker in the legend, to name a colour that a heatmap or a
    per-point colour list does not name itself."""
    return go.Scatter(x=[None], y=[None], mode="markers", name=name, marker=marker, **trace)


def wrap(text: str, width: int = 100) -> str:
    """``text`` broken into lines of at most ``width`` characters with ``<br>`` (plotly titles)."""
    return "<br>".join(textwrap.wrap(text, width))


def fit_width(px: float) -> int:
    """``px`` capped at :data:`MAX_FIGURE_WIDTH`: the width a drawing may set."""
    return int(min(MAX_FIGURE_WIDTH, px))


def fit_title(text: str, width_px: float) -> tuple[str, int]:
    """``text`` (plotly title markup: lines split by ``<br>``, a ``<sup>...</sup>`` line is a subtitle in
    smaller type) wrapped to a figure ``width_px`` wide, and the number of lines it takes.

    Give the layout ``margin.t`` of at least ``30 + 22 * lines`` (plus whatever sits above the plot,
    an axis on top or subplot titles) and the title is never cut.
    """
    chars = max(24, int((width_px - 40) / (0.55 * TITLE_FONT_PX)))
    lines = []
    for part in text.split("<br>"):
        sup = part.startswith("<sup>") and part.endswith("</sup>")
        body = part[5:-6] if sup else part
        body = re.sub(r"<b>.*?</b>", lambda m: m.group(0).replace(" ", _KEEP), body)  # never split a tag
        pieces = [
            p.replace(_KEEP, " ") for p in textwrap.wrap(body, int(chars * 1.45) if sup else chars)
        ] or [""]
        lines += [f"<sup>{p}</sup>" for p in pieces] if sup else pieces
    return "<br>".join(lines), len(lines)


def above_plot(text: str, lines: int, gap_px: int) -> dict:
    """A plotly title of ``lines`` lines (:func:`fit_title`) whose last line sits ``gap_px`` above the
    plot area, clear of an axis or subplot titles on top. Plotly anchors a title by its first line, so
    the pad lifts it by the lines below that one."""
    return dict(text=text, yref="paper", y=1, yanchor="bottom", pad=dict(b=gap_px + LINE_PX * (lines - 1)))


def table_figure(
    header: Sequence[str], columns: Sequence[Sequence], *, height: int, header_align="left", cell_align="left"
) -> go.Figure:
    """A plotly table in the lab's colours: ``columns`` are the cell values, one list per column."""
    fig = go.Figure(
        go.Table(
            header=dict(
                values=list(header),
                fill_color=TABLE_HEADER_COLOR,
                font=dict(color="white"),
                align=header_align,
            ),
            cells=dict(values=[list(c) for c in columns], align=cell_align, fill_color=TABLE_CELL_COLOR),
        )
    )
    fig.update_layout(height=height, margin=dict(l=10, r=10, t=10, b=10))
    return fig
