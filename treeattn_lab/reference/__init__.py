"""Readable einops references: the definitions every kernel is tested against.

They favour clarity over speed, accept float64, and materialize full score matrices: use them on small
inputs (tests, drawings, notebooks on a laptop).
"""

from .attention import causal_attention, masked_attention, merge_attention_states, tree_attention
from .tiny_lm import TinyLM, TinyLMConfig

__all__ = [
    "TinyLM",
    "TinyLMConfig",
    "causal_attention",
    "masked_attention",
    "merge_attention_states",
    "tree_attention",
]
