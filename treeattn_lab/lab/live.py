"""Small drawings for the notebooks' live sections, built on :mod:`treeattn_lab.lab.viz`.

- :func:`draw_micro_batch_modes`: a trie coloured by the mode the cost model picks for each node's
  micro-batch (flat, packed or dfs), so a switch of mode shows as a change of colour.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .viz import draw_trie, micro_batch_colors

SHARED = "shared prefix (carried)"


def micro_batch_modes(trie, rows: Sequence[Mapping]) -> dict[int, str]:
    """``{node: mode}`` for ``draw_trie``'s ``color_by``: the mode chosen for the micro-batch whose
    rollouts pass through the node, or :data:`SHARED` for a prefix several micro-batches compute."""
    choice = {f"{r['micro_batch']:0{len(str(len(rows) - 1))}d}: {r['choice']}": r["choice"] for r in rows}
    return {node: choice.get(label, SHARED) for node, label in micro_batch_colors(trie, rows).items()}


def draw_micro_batch_modes(trie, rows: Sequence[Mapping], *, title: str | None = None, max_nodes: int = 400):
    """The trie with every node coloured by its micro-batch's mode (rows from ``viz.micro_batch_choices``)."""
    modes = [r["choice"] for r in rows]
    counts = ", ".join(f"{modes.count(m)} {m}" for m in ("flat", "packed", "dfs") if m in modes)
    head = title or "The cost model's mode per micro-batch"
    return draw_trie(trie, color_by=micro_batch_modes(trie, rows), max_nodes=max_nodes,
                     title=f"{head} ({len(rows)} micro-batches: {counts})")
