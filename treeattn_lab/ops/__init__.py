"""Public attention entry points: validate the inputs once, then pick a backend.

Backends are chosen here and nowhere else; callers never branch on the device or the interpreter.
"""

from .tree import available_backends, tree_attention

__all__ = ["available_backends", "tree_attention"]
