"""treeattn_lab: stop wasting attention compute when training LLMs.

- Tree attention for RL rollouts: :class:`RolloutTrie`, :class:`TreePack`, :func:`tree_attention`;
  training over a trie in :mod:`treeattn_lab.engine`, across ranks in :mod:`treeattn_lab.distributed`.
- Dynamic sparse and dilated attention: :func:`sparse_attention`, :func:`dilated_attention`, their
  patterns in :mod:`treeattn_lab.patterns`.
- Readable references in :mod:`treeattn_lab.reference`; Triton kernels in :mod:`treeattn_lab.kernels`.
- Notebook helpers (drawings, monitor, exercises) in :mod:`treeattn_lab.lab`, which alone needs the
  ``lab`` extra.
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
