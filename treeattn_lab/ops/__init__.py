"""Public attention entry points: validate the inputs once, then pick a backend.

Backends are chosen here and nowhere else; callers never branch on the device or the interpreter.

Non-finite inputs are not contained: a ``nan`` or ``inf`` in ``k`` or ``v`` at one token makes every row
that sees that token non-finite, and may make rows that do not see it non-finite too. A masked key's
probability is a zero that still multiplies its value (``0 * inf = nan``) wherever the masked key shares
a score tile (the kernels, FlexAttention) or the dense mask (the references) with visible keys, so which
of those rows are hit depends on the backend and its tiles. Rows that see only finite keys and values
are exact only when all of ``q, k, v`` are finite: check with ``torch.isfinite`` where that may fail.
"""

from .dilated import dilated_attention, gated_scan
from .sparse import sparse_attention
from .tree import available_backends, tree_attention

__all__ = ["available_backends", "dilated_attention", "gated_scan", "sparse_attention", "tree_attention"]
