"""Tree visibility over a DFS-preorder pack.

Rule: packed query q sees packed key k exactly when ``k <= q < subtree_end[k]``: k comes no later than q
and q lies inside the subtree that starts at k's node. For a single sequence (a chain) subtree_end is T
everywhere and the rule is plain causal attention.
"""

from __future__ import annotations

import torch


def tree_visibility(subtree_end: torch.Tensor) -> torch.Tensor:
    """Dense ``[T, T]`` bool mask, ``mask[q, k]`` = q may attend k."""
    T = subtree_end.numel()
    q = torch.arange(T, device=subtree_end.device)[:, None]
    k = torch.arange(T, device=subtree_end.device)[None, :]
    return (k <= q) & (q < subtree_end.to(torch.int64)[None, :])


def tree_mask_mod(subtree_end: torch.Tensor):
    """A FlexAttention ``mask_mod`` for the rule (batch and head independent)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return mask_mod


def main() -> None:  # pragma: no cover - draw it yourself: python -m treeattn_lab.patterns.tree
    # the pack of the rollouts [1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6], [7, 8]: nodes in preorder
    # (1 2)(3 4)(5)(6)(7 8), each token holding the packed end of its node's subtree
    subtree_end = torch.tensor([6, 6, 4, 4, 6, 6, 8, 8], dtype=torch.int32)
    mask = tree_visibility(subtree_end)
    for row in mask.int().tolist():
        print("".join("#" if v else "." for v in row))


if __name__ == "__main__":  # pragma: no cover
    main()
