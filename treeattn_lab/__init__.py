"""treeattn_lab: stop wasting attention compute when training LLMs.

- Tree attention for RL rollouts: :class:`RolloutTrie`, :class:`TreePack`, :func:`tree_attention`.
- Readable references in :mod:`treeattn_lab.reference`; Triton kernels in :mod:`treeattn_lab.kernels`.
"""

from .runtime import configure_triton, link_source_kernels

configure_triton()  # before any kernel module is imported
link_source_kernels()  # a source checkout run without installing: kernels/ -> treeattn_lab.kernels

from .ops import available_backends, tree_attention  # noqa: E402
from .ops.dilated import dilated_attention  # noqa: E402
from .ops.sparse import sparse_attention  # noqa: E402
from .pack import TreePack  # noqa: E402
from .trie import RolloutTrie  # noqa: E402

__version__ = "0.1.0"
__all__ = ["RolloutTrie", "TreePack", "available_backends", "dilated_attention", "sparse_attention",
           "tree_attention"]
