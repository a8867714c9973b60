"""Readable einops references: the definitions every kernel is tested against.

One per op: ``tree_attention`` (a DFS-preorder pack), ``sparse_attention`` (a vertical-slash pattern),
``dilated_attention`` (the RAT+ pattern), ``gated_scan`` (the recurrence), all built on
``masked_attention``; ``merge_attention_states`` merges partial results by log-sum-exp.

They favour clarity over speed, accept float64, and materialize full score matrices: use them on small
inputs (tests, drawings, notebooks on a laptop).
"""

from .attention import causal_attention, masked_attention, merge_attention_states, tree_attention
from .dilated import dilated_attention
from .scan import gated_scan
from .sparse import sparse_attention
from .tiny_lm import TinyLM, TinyLMConfig

__all__ = [
    "TinyLM",
    "TinyLMConfig",
    "causal_attention",
    "dilated_attention",
    "gated_scan",
    "masked_attention",
    "merge_attention_states",
    "sparse_attention",
    "tree_attention",
]
