"""RolloutTrie: RL rollouts stored as a radix-compressed prefix trie.

Rollouts sampled from one prompt (or an agent's history that forks at every tool call) share long
prefixes. A prefix trie stores each distinct prefix once: every root-to-node path spells a prefix that
at least one rollout starts with, and a rollout is a path from the root to the node where it ends.

Radix compression merges chains of single-child tokens into one node holding a run of tokens, so the
number of nodes grows with the number of *forks*, not with the number of tokens. A node is split
wherever a rollout ends inside it, so every rollout ends exactly at the last token of some node; that is
how identical rollouts and rollouts that are prefixes of others are all kept.

Node 0 is the root: it holds no tokens. Every other node holds at least one token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .atomic import atomic_writer
from .pack import TreePack
from .token_ids import as_integer, rollout_token_ids, token_ids
from .unpad import unpad

if TYPE_CHECKING:  # pragma: no cover
    import networkx

ROOT = 0
_FORMAT = "treeattn_lab.RolloutTrie"
_FORMAT_VERSION = 1


@dataclass
class TrieNode:
    """One radix node: a run of tokens, its place in the tree and the rollouts ending on it."""

    tokens: list[int]
    parent: int
    depth: int  # tokens on the path from the root before this node's first token
    children: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # indices of the sequences ending at this node

    @property
    def end_depth(self) -> int:
        """Length of the prefix spelled by the path up to and including this node."""
        return self.depth + len(self.tokens)


class RolloutTrie:
    """A radix prefix trie over rollouts; build it with :meth:`from_sequences`.

    Attributes:
        nodes: ``nodes[0]`` is the empty root; the others each hold a run of tokens.
        seq_end_node: ``seq_end_node[i]`` is the node whose last token is sequence i's last token.
        seq_lengths: token count of each sequence.

    A trie is not changed once built: what is derived from it for many passes over the same rollouts
    (:meth:`pack_on`, :meth:`cached`) is computed once per trie and kept on it.
    """

    def __init__(self, nodes: list[TrieNode], seq_end_node: list[int]):
        self.nodes = nodes
        self.seq_end_node = seq_end_node
        self.seq_lengths = [nodes[n].end_depth for n in seq_end_node]
        self._cache: dict = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def from_sequences(cls, seqs: Sequence) -> RolloutTrie:
        """Build the trie of ``seqs`` (lists of ints or 1-D integer tensors), keeping every sequence."""
        if isinstance(seqs, torch.Tensor):
            if seqs.dim() != 2:
                raise ValueError(
                    f"a tensor of sequences must be 2-D [num_sequences, length], got {seqs.dim()}-D"
                )
            seqs = list(seqs.unbind(0))
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Iterable):
            raise TypeError(f"seqs must be a sequence of rollouts, got {type(seqs).__name__}")
        token_lists = [rollout_token_ids(s, i) for i, s in enumerate(seqs)]
        if not token_lists:
            raise ValueError("no sequences given: a trie needs at least one rollout")
        nodes = [TrieNode(tokens=[], parent=-1, depth=0)]
        # first token of each child -> child id, one dict per node (kept beside the nodes while building)
        child_by_token: list[dict[int, int]] = [{}]
        for i, tokens in enumerate(token_lists):
            nodes[_insert(nodes, child_by_token, tokens)].ends.append(i)
        # splits give the head of a node its old id and the tail a new one, so a tail's inherited children
        # can have smaller ids than their parent; number the nodes in preorder so parents come first
        nodes = _renumber_preorder(nodes)
        seq_end_node = [0] * len(token_lists)
        for node_id, node in enumerate(nodes):
            node.ends.sort()
            for i in node.ends:
                seq_end_node[i] = node_id
        return cls(nodes, seq_end_node)

    @classmethod
    def from_padded(cls, input_ids, attention_mask=None, *, pad_id: int | None = None) -> RolloutTrie:
        """The trie of the rows of a padded batch ``input_ids [B, L]`` without their pads; rollout i is
        row i.

        ``attention_mask [B, L]`` (1 at real tokens) or ``pad_id`` says which tokens are padding; each
        row's real tokens must be one contiguous run: left or right padding, or left-padded prompts
        beside right-padded completions (see :func:`treeattn_lab.unpad.unpad`).
        """
        return cls.from_sequences(unpad(input_ids, attention_mask, pad_id=pad_id))

    # ------------------------------------------------------------------ queries
    @property
    def num_sequences(self) -> int:
        return len(self.seq_end_node)

    @property
    def num_nodes(self) -> int:
        """Token-holding nodes (the empty root is not counted)."""
        return len(self.nodes) - 1

    def sequence(self, i: int) -> list[int]:
        """The tokens of sequence ``i``, read back from the trie."""
        return [t for n in self.path(self.seq_end_node[i]) for t in self.nodes[n].tokens]

    def sequences(self) -> list[list[int]]:
        return [self.sequence(i) for i in range(self.num_sequences)]

    def path(self, node: int) -> list[int]:
        """Node ids from the root's child down to ``node`` (the root itself excluded)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def shared_prefix(self, i: int, j: int) -> int:
        """Length of the longest common prefix of sequences ``i`` and ``j``: the end depth of the deepest
        node on both their paths (children of a node start with distinct tokens, so the paths part there)."""
        a, b = self.seq_end_node[i], self.seq_end_node[j]
        while a != b:
            if self.nodes[a].end_depth >= self.nodes[b].end_depth:  # so a is not above b: lift a
                a = self.nodes[a].parent
            else:
                b = self.nodes[b].parent
        return self.nodes[a].end_depth

    def dfs_sequence_order(self) -> list[int]:
        """Sequence indices in DFS preorder of their end nodes (ties: insertion order)."""
        return [i for node in self.preorder() for i in self.nodes[node].ends]

    def subtrie(self, indices: Sequence[int]) -> RolloutTrie:
        """The trie of sequences ``indices`` in that order, exactly as :meth:`from_sequences` builds it from
        them, read off this trie's nodes: the nodes on their paths, each node's children in the order the
        sequences first reach them, and every chain that the chosen sequences neither end on nor branch
        from merged into one node (it costs the paths' nodes, not the rollouts' tokens). Raises ValueError
        for no indices or one outside ``[0, num_sequences)``, TypeError for one that is not an integer."""
        indices = [as_integer(i, "subtrie got the index", "sequence indices") for i in indices]
        if not indices:
            raise ValueError("subtrie got no sequence indices: a trie needs at least one rollout")
        if not all(0 <= i < self.num_sequences for i in indices):
            bad = next(i for i in indices if not 0 <= i < self.num_sequences)
            raise ValueError(f"subtrie got the sequence index {bad}; this trie holds {self.num_sequences}")
        children: dict[int, list[int]] = {}  # old node -> its children on chosen paths, first reached first
        ends: dict[int, list[int]] = {}  # old node -> the new indices of the chosen sequences ending there
        reached: set[int] = set()
        for new, old in enumerate(indices):
            parent = ROOT
            for node in self.path(self.seq_end_node[old]):
                if node not in reached:
                    reached.add(node)
                    children.setdefault(parent, []).append(node)
                parent = node
            ends.setdefault(parent, []).append(new)
        nodes, seq_end_node = [TrieNode([], -1, 0)], [0] * len(indices)
        stack = [(child, ROOT) for child in reversed(children.get(ROOT, []))]
        while stack:  # preorder, merging each chain into its first node
            old, parent = stack.pop()
            tokens, depth = list(self.nodes[old].tokens), self.nodes[old].depth
            while old not in ends and len(children[old]) == 1:
                old = children[old][0]
                tokens += self.nodes[old].tokens
            node_id = len(nodes)
            nodes.append(TrieNode(tokens, parent, depth, ends=ends.get(old, [])))
            nodes[parent].children.append(node_id)
            for i in nodes[-1].ends:
                seq_end_node[i] = node_id
            stack.extend((child, node_id) for child in reversed(children.get(old, [])))
        return RolloutTrie(nodes, seq_end_node)

    def subtree_tokens(self) -> list[int]:
        """Tokens stored in each node's subtree (node included)."""
        total = [len(n.tokens) for n in self.nodes]
        for node in reversed(self.preorder()):
            p = self.nodes[node].parent
            if p >= 0:
                total[p] += total[node]
        return total

    def preorder(self, order: str = "insertion") -> list[int]:
        """Node ids in DFS preorder, root first.

        ``order="insertion"`` visits children in the order they first appeared; ``order="size"`` visits the
        child with the largest subtree (in tokens) first, which packs the heaviest branch next to its prefix.
        """
        if order not in ("insertion", "size"):
            raise ValueError(f"order must be 'insertion' or 'size', got {order!r}")
        size = self.subtree_tokens() if order == "size" else None
        out, stack = [], [ROOT]
        while stack:
            node = stack.pop()
            out.append(node)
            kids = self.nodes[node].children
            if size is not None:
                kids = sorted(kids, key=lambda c: -size[c])  # stable: ties keep insertion order
            stack.extend(reversed(kids))
        return out

    def leaves(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if i != ROOT and not n.children]

    def stats(self) -> dict:
        """Sizes, sharing and shape of the trie.

        ``token_ratio`` = flat tokens / tree tokens is the saving in stored and MLP-computed tokens;
        ``ideal_attention_ratio`` = causal pairs attended flat / pairs attended in the tree (diagonal
        included) is the best an attention kernel over the packed tree can save.
        """
        lengths = self.seq_lengths
        flat_tokens = sum(lengths)
        tree_tokens = sum(len(n.tokens) for n in self.nodes)
        flat_pairs = sum(L * (L + 1) // 2 for L in lengths)
        # a token at depth d (0-based position) attends d + 1 keys: its ancestors and itself
        tree_pairs = sum((n.depth + 1 + n.end_depth) * len(n.tokens) // 2 for n in self.nodes if n.tokens)
        real = self.nodes[1:]
        internal = [n for n in real if n.children]
        node_depth = self._node_depths()
        leaf_ids = self.leaves()
        return {
            "num_sequences": self.num_sequences,
            "num_nodes": self.num_nodes,
            "num_leaves": len(leaf_ids),
            "flat_tokens": flat_tokens,
            "tree_tokens": tree_tokens,
            "token_ratio": flat_tokens / tree_tokens,
            "flat_attention_pairs": flat_pairs,
            "tree_attention_pairs": tree_pairs,
            "ideal_attention_ratio": flat_pairs / tree_pairs,
            "max_sequence_length": max(lengths),
            "mean_sequence_length": flat_tokens / len(lengths),
            "max_node_depth": max(node_depth[1:]),
            "mean_leaf_node_depth": sum(node_depth[i] for i in leaf_ids) / len(leaf_ids),
            "root_branching": len(self.nodes[ROOT].children),
            "max_branching": max((len(n.children) for n in real), default=0),
            "mean_branching": (sum(len(n.children) for n in internal) / len(internal) if internal else 0.0),
            "mean_node_tokens": tree_tokens / max(self.num_nodes, 1),
        }

    def _node_depths(self) -> list[int]:
        """Depth of each node in nodes (root 0, its children 1, ...)."""
        depth = [0] * len(self.nodes)
        for node in self.preorder()[1:]:
            depth[node] = depth[self.nodes[node].parent] + 1
        return depth

    # ------------------------------------------------------------------ conversions
    def pack(self, order: str = "insertion") -> TreePack:
        """Pack the trie in DFS preorder: every tree token stored once (see :class:`TreePack`); a new pack
        each call (:meth:`pack_on` shares one)."""
        return TreePack.from_trie(self, order=order)

    def pack_on(self, device, order: str = "insertion") -> TreePack:
        """The trie's pack (:meth:`pack`) on ``device``, built and moved once per trie, order and device,
        and shared by every caller together with what they cache on it (the attention backend's decision,
        tile schedules, loss plans): the passes of one batch reuse it. Treat it as read-only; it lives as long
        as the trie, in the device's memory."""
        device = torch.empty(0, device=device).device  # "cuda" and "cuda:0" name one device
        cpu_pack = self.cached(("pack", order), lambda: self.pack(order))
        if device.type == "cpu":
            return cpu_pack
        return self.cached(("pack", order, str(device)), lambda: cpu_pack.to(device))

    def cached(self, key, build):
        """``build()``, computed on the first call for ``key`` and returned again by later ones (the class
        docstring): readers keep what they derive from the trie here, keyed by what it depends on."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def to_networkx(self, preview_tokens: int = 8) -> networkx.DiGraph:
        """A ``networkx.DiGraph`` with one vertex per node (root included) and parent -> child edges.

        Vertex attributes: ``num_tokens``, ``depth`` (tokens before the node), ``end_depth``, ``preview``
        (first token ids as text), ``ends`` (sequences ending there), ``node_depth`` (edges from the root).
        """
        import networkx as nx

        g = nx.DiGraph()
        node_depth = self._node_depths()
        for i, n in enumerate(self.nodes):
            head = " ".join(str(t) for t in n.tokens[:preview_tokens])
            more = " ..." if len(n.tokens) > preview_tokens else ""
            g.add_node(
                i,
                num_tokens=len(n.tokens),
                depth=n.depth,
                end_depth=n.end_depth,
                preview=head + more,
                ends=list(n.ends),
                node_depth=node_depth[i],
            )
            if n.parent >= 0:
                g.add_edge(n.parent, i)
        return g

    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "nodes": [{"parent": n.parent, "tokens": list(n.tokens)} for n in self.nodes],
            "seq_end_node": list(self.seq_end_node),
        }

    @classmethod
    def from_dict(cls, data: dict) -> RolloutTrie:
        """The trie of :meth:`to_dict`, checked as :meth:`from_sequences` checks its input.

        Token ids must be ints in [0, 2**63), every rollout must end at a node, and the tree must be the
        one :meth:`from_sequences` builds: one child per first token, every leaf the end of a rollout,
        no node with a single child that no rollout ends at (radix compression). Parents come before
        their children.
        """
        if not isinstance(data, dict) or data.get("format") != _FORMAT or "seq_end_node" not in data:
            raise ValueError(f"not a saved RolloutTrie (expected format {_FORMAT!r})")
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(f"unsupported RolloutTrie version {data.get('version')!r}")
        nodes = _nodes_from_dict(data.get("nodes"))
        ends = data["seq_end_node"]
        if isinstance(ends, (str, bytes)) or not isinstance(ends, Sequence):
            raise TypeError(f"seq_end_node must be a list of node ids, got {type(ends).__name__}")
        if not ends:
            raise ValueError("no sequences given: a trie needs at least one rollout")
        seq_end_node = [as_integer(n, f"sequence {i} ends at", "node ids") for i, n in enumerate(ends)]
        for i, n in enumerate(seq_end_node):
            if not (0 < n < len(nodes)):
                raise ValueError(f"sequence {i} ends at unknown node {n}")
            nodes[n].ends.append(i)
        _check_radix_tree(nodes)
        return cls(nodes, seq_end_node)

    def save(self, path: str | os.PathLike) -> None:
        """Write the trie as JSON; :meth:`load` reads it back exactly (nodes, order and sequences).

        The write is atomic: a failed one (a full disk, a file-size limit) leaves an existing file whole.
        """
        with atomic_writer(path) as f:
            json.dump(self.to_dict(), f, separators=(",", ":"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> RolloutTrie:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def __eq__(self, other) -> bool:
        return isinstance(other, RolloutTrie) and self.to_dict() == other.to_dict()

    def __getstate__(self) -> dict:
        """A trie pickles without what is cached on it (packs, maybe on a device): rebuilt where used."""
        return {**self.__dict__, "_cache": {}}

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"RolloutTrie({s['num_sequences']} sequences, {s['num_nodes']} nodes, "
            f"{s['flat_tokens']} flat -> {s['tree_tokens']} tree tokens, x{s['token_ratio']:.2f})"
        )


def _nodes_from_dict(raw) -> list[TrieNode]:
    """The nodes of a saved trie, with depths and children filled in (ends are added by the caller)."""
    if not isinstance(raw, list) or not all(
        isinstance(n, dict) and {"parent", "tokens"} <= n.keys() for n in raw
    ):
        raise ValueError("nodes must be a list of {'parent': id, 'tokens': [ids]} objects")
    if not raw or raw[0]["parent"] != -1 or raw[0]["tokens"]:
        raise ValueError("a saved trie must start with the empty root node")
    nodes = [TrieNode(tokens=[], parent=-1, depth=0)]
    for i, rn in enumerate(raw[1:], start=1):
        parent = as_integer(rn["parent"], f"node {i} names parent", "node ids")
        if not (0 <= parent < i):
            raise ValueError(f"node {i} names parent {parent}; parents must come before children")
        tokens = token_ids(rn["tokens"], f"node {i}")
        if not tokens:
            raise ValueError(f"node {i} holds no tokens")
        nodes.append(TrieNode(tokens=tokens, parent=parent, depth=nodes[parent].end_depth))
        nodes[parent].children.append(i)
    return nodes


def _check_radix_tree(nodes: list[TrieNode]) -> None:
    """Raise unless ``nodes`` (with their ends) form the tree :meth:`RolloutTrie.from_sequences` builds."""
    for i, node in enumerate(nodes):
        first_child: dict[int, int] = {}
        for c in node.children:
            other = first_child.setdefault(nodes[c].tokens[0], c)
            if other != c:
                raise ValueError(
                    f"nodes {other} and {c} are children of node {i} that both start with token "
                    f"{nodes[c].tokens[0]}; a prefix trie has one child per first token"
                )
        if i == ROOT or node.ends:
            continue
        if not node.children:
            raise ValueError(f"node {i} is a leaf that no rollout ends at")
        if len(node.children) == 1:
            raise ValueError(
                f"node {i} has one child and no rollout ends at it; a radix trie merges the two into one node"
            )


def _insert(nodes: list[TrieNode], child_by_token: list[dict[int, int]], tokens: list[int]) -> int:
    """Insert one rollout, splitting nodes as needed; return the node it ends at."""
    node, pos = ROOT, 0
    while pos < len(tokens):
        child = child_by_token[node].get(tokens[pos])
        if child is None:  # a new branch: the whole rest becomes one node
            new = len(nodes)
            nodes.append(TrieNode(tokens=tokens[pos:], parent=node, depth=pos))
            child_by_token.append({})
            nodes[node].children.append(new)
            child_by_token[node][tokens[pos]] = new
            return new
        run = nodes[child].tokens
        common = _common_prefix(run, tokens, pos)
        if common < len(run):  # the rollout leaves (or ends inside) this node: split it
            _split(nodes, child_by_token, child, common)
        node, pos = child, pos + common
    return node


def _renumber_preorder(nodes: list[TrieNode]) -> list[TrieNode]:
    """The same tree with node ids in DFS preorder (children in their order): parents before children."""
    order, stack = [], [ROOT]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(nodes[node].children))
    new_id = {old: new for new, old in enumerate(order)}
    return [
        TrieNode(
            tokens=nodes[old].tokens,
            parent=new_id[nodes[old].parent] if old != ROOT else -1,
            depth=nodes[old].depth,
            children=[new_id[c] for c in nodes[old].children],
            ends=nodes[old].ends,
        )
        for old in order
    ]


def _common_prefix(run: list[int], tokens: list[int], start: int) -> int:
    n = min(len(run), len(tokens) - start)
    if run[:n] == tokens[start : start + n]:
        return n
    lo = 0
    while lo < n and run[lo] == tokens[start + lo]:
        lo += 1
    return lo


def _split(nodes: list[TrieNode], child_by_token: list[dict[int, int]], node: int, at: int) -> None:
    """Split ``node`` after ``at`` tokens: ``node`` keeps the head, a new child takes the tail.

    Keeping the id on the head means every existing parent pointer stays valid.
    """
    old = nodes[node]
    tail = TrieNode(
        tokens=old.tokens[at:], parent=node, depth=old.depth + at, children=old.children, ends=old.ends
    )
    tail_id = len(nodes)
    nodes.append(tail)
    child_by_token.append(child_by_token[node])
    for c in tail.children:
        nodes[c].parent = tail_id
    old.tokens = old.tokens[:at]
    old.children = [tail_id]
    old.ends = []  # rollouts that ended at the old last token now end at the tail
    child_by_token[node] = {tail.tokens[0]: tail_id}
