"""Attention patterns as data: which keys each query may see.

Each pattern comes in the forms the rest of the lab needs: a dense boolean mask for small drawings and
references, and a ``mask_mod`` for FlexAttention. Kernels read the compact form directly.
"""

from .tree import tree_mask_mod, tree_visibility

__all__ = ["tree_mask_mod", "tree_visibility"]
