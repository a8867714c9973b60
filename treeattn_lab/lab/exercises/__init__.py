"""Exercise checks for the notebooks: each ``check_*`` runs a learner's function on fresh random cases.

A checker never raises on a wrong answer (nor when the learner's function raises): it prints ``pass``
or ``fail`` with a hint and returns a bool, so a notebook runs top to bottom with the exercise unsolved.
The library's own solution sits next to each checker, one module per notebook topic:

- :mod:`.tile_schedule` (notebook 03): :func:`ancestor_keys` / :func:`check_ancestor_keys`, the keys
  before a query tile that the tile sees.
"""

from .tile_schedule import ancestor_keys, check_ancestor_keys

__all__ = ["ancestor_keys", "check_ancestor_keys"]
