"""Vertical-slash attention patterns (MInference, MTraining): a few key columns plus a few diagonals.

Long-context attention heads put most of their mass on two shapes: **vertical** lines (key columns that
every later query reads, e.g. the first tokens, "sinks", or a salient token) and **slash** lines
(diagonals: key ``k = q - s`` at a fixed distance ``s`` from the query, e.g. the local window ``s < 100``).
A :class:`VerticalSlashPattern` keeps, per head,

- ``vertical [H, nv]``: key columns, and
- ``slash [H, ns]``: diagonal offsets ``s >= 0`` (``s = 0`` is the query itself),

and query ``q`` attends key ``k <= q`` when ``k`` is one of the head's columns or ``q - k`` one of its
offsets. Entries ``-1`` (:data:`PAD`) are padding (heads may keep different numbers of lines).

One concept per module:

- :mod:`.pattern`: :class:`VerticalSlashPattern`, its masks and block rounding, :func:`pair_counts`;
- :mod:`.block_index`: :class:`BlockSparseIndex`, what the block-sparse kernel reads, and
  :func:`build_block_index`;
- :mod:`.estimator`: :func:`line_scores`, :func:`estimate`, :func:`estimate_top_p` (MInference's
  estimate from the last queries);
- :mod:`.recall_mass`: :func:`recall`, the share of causal attention mass a pattern computes;
- :mod:`.synthetic`: :func:`synthetic_pattern`, a seeded pattern shaped like estimated ones;
- :mod:`.lines`: the padded line-list format both the pattern and the index read.
"""

from .block_index import BAR_PAD, BlockSparseIndex, build_block_index
from .estimator import estimate, estimate_top_p, line_scores
from .lines import PAD
from .pattern import VerticalSlashPattern, pair_counts
from .recall_mass import causal_row_probs, recall
from .synthetic import synthetic_pattern

__all__ = [
    "BAR_PAD",
    "PAD",
    "BlockSparseIndex",
    "VerticalSlashPattern",
    "build_block_index",
    "causal_row_probs",
    "estimate",
    "estimate_top_p",
    "line_scores",
    "pair_counts",
    "recall",
    "synthetic_pattern",
]
