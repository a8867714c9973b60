"""Exercise checks for the notebooks: each ``check_*`` runs a learner's function on fresh random cases.

A checker never raises on a wrong answer (nor when the learner's function raises): it prints ``pass``
or ``fail`` with a hint and returns a bool, so a notebook runs top to bottom with the exercise unsolved.
The library's own solution sits next to each checker, one module per notebook topic:

- :mod:`.tile_schedule` (notebook 03): :func:`ancestor_keys` / :func:`check_ancestor_keys`, the keys
  before a query tile that the tile sees.
- :mod:`.tries` (notebooks 00 and 01): :func:`tree_tokens` / :func:`check_tree_tokens`, the tokens a trie
  stores; :func:`subtree_end_from_nodes` / :func:`check_subtree_end`, the pack's mask vector from its nodes.
- :mod:`.dfs` (notebook 02): :func:`stack_positions` / :func:`check_stack_positions`, the packed positions on
  the K/V stack when a block runs; :func:`dfs_events` / :func:`check_dfs_events`, the push/leaf/pop order.
- :mod:`.balance` (notebook 04): :func:`contiguous_cuts` / :func:`check_contiguous_cuts`, rollouts in DFS
  order cut into K contiguous ranges with the smallest makespan in trie tokens (the anchor's search).
- :mod:`.sparse` (notebook 05): :func:`merge_partial_states` / :func:`check_merge_partial_states`, two
  partial attention results merged by their log-sum-exps (ring attention's rule).
- :mod:`.dilated` (notebook 06): :func:`dilated_keys` / :func:`check_dilated_keys`, the keys a query sees
  under dilated attention with a window and initial tokens.
- :mod:`.grpo` (notebook 07): :func:`advantages` / :func:`check_advantages`, each rollout's reward against
  its group's (GRPO's advantages).

:mod:`.checking` holds what the checkers share: random rollouts, the learner's function called safely,
a failed case reported with its hint.
"""

from .balance import check_contiguous_cuts, contiguous_cuts
from .dfs import block_lists, check_dfs_events, check_stack_positions, dfs_events, stack_positions
from .dilated import check_dilated_keys, dilated_keys
from .grpo import advantages, check_advantages
from .sparse import check_merge_partial_states, merge_partial_states
from .tile_schedule import ancestor_keys, check_ancestor_keys
from .tries import check_subtree_end, check_tree_tokens, pack_nodes, subtree_end_from_nodes, tree_tokens

__all__ = [
    "advantages",
    "ancestor_keys",
    "block_lists",
    "check_advantages",
    "check_ancestor_keys",
    "check_contiguous_cuts",
    "check_dfs_events",
    "check_dilated_keys",
    "check_merge_partial_states",
    "check_stack_positions",
    "check_subtree_end",
    "check_tree_tokens",
    "contiguous_cuts",
    "dfs_events",
    "dilated_keys",
    "merge_partial_states",
    "pack_nodes",
    "stack_positions",
    "subtree_end_from_nodes",
    "tree_tokens",
]
