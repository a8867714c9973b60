"""Public attention entry points: validate the inputs once, then pick a backend.

Backends are chosen here and nowhere else; callers never branch on the device or the interpreter.

Non-finite inputs are not contained: a ``nan`` or ``inf`` in ``k`` or ``v`` at one token makes every row
that sees that token non-finite, and may make rows that do not see it non-finite too. A masked key's
probability is a zero that still multiplies its value (``0 * inf = nan``) wherever the masked key shares
a score tile (the kernels, FlexAttention) or the dense mask (the references) with visible keys, so which
of those rows are hit depends on the backend and its tiles. Rows that see only finite keys and values
are exact only when all of ``q, k, v`` are finite: check with ``torch.isfinite`` where that may fail.

For other engines, a pack's attention rule in their formats: :func:`pack_mask_mod` (a FlexAttention
``mask_mod``), :func:`tree_block_mask` (its ``BlockMask``, cached on the pack) and :func:`varlen_plan`
(variable-length metadata: one sequence per leaf, ``cu_q`` / ``cu_k`` cumulative lengths, the packed rows
of every sequence's keys, the longest query and key lengths).
"""

from .dilated import dilated_attention, gated_scan
from .flex_tree import pack_mask_mod, tree_block_mask
from .sparse import sparse_attention
from .tree import available_backends, tree_attention
from .varlen_tree import VarlenPlan, varlen_plan

__all__ = ["VarlenPlan", "available_backends", "dilated_attention", "gated_scan", "pack_mask_mod",
           "sparse_attention", "tree_attention", "tree_block_mask", "varlen_plan"]
