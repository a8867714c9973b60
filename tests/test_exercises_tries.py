"""The trie exercises (notebooks 00 and 01): the solutions are right, the checkers accept them, reject wrong
answers with a hint, report the learner's exceptions instead of raising, and draw fresh cases each call."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given

from tests.conftest import orders, rollout_forests
from treeattn_lab import RolloutTrie
from treeattn_lab.lab import exercises


# ---------------------------------------------------------------------------------------- solutions
@given(rollout_forests())
def test_tree_tokens_is_the_tries_token_count(seqs):
    assert exercises.tree_tokens(seqs) == RolloutTrie.from_sequences(seqs).stats()["tree_tokens"]


@given(rollout_forests(), orders)
def test_subtree_end_from_nodes_matches_the_pack(seqs, order):
    pack = RolloutTrie.from_sequences(seqs).pack(order=order)
    parent, num_tokens = exercises.pack_nodes(pack)
    assert parent[0] == -1 and num_tokens[0] == 0
    assert all(0 <= parent[n] < n for n in range(1, len(parent)))  # preorder: parents first
    assert sum(num_tokens) == pack.num_tokens
    # node n's tokens follow those of nodes 0..n-1 in the pack
    node_of_token = [n for n, c in enumerate(num_tokens) for _ in range(c)]
    assert node_of_token == sorted(node_of_token)
    assert exercises.subtree_end_from_nodes(parent, num_tokens) == pack.subtree_end.tolist()


def test_subtree_end_small_example():
    # README's trie: [1 2][3 4] and [1 2][5][6] share the node [1 2]; [7 8] is a tree of its own
    pack = RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6], [7, 8]]).pack()
    assert exercises.pack_nodes(pack) == ([-1, 0, 1, 1, 3, 0], [0, 2, 2, 1, 1, 2])
    got = exercises.subtree_end_from_nodes([-1, 0, 1, 1, 3, 0], [0, 2, 2, 1, 1, 2])
    assert got == [6, 6, 4, 4, 6, 6, 8, 8]


@pytest.mark.parametrize(
    ("parent", "num_tokens", "match"),
    [
        ([-1, 0], [0], "one length"),
        ([], [], "non-empty"),
        ([0, 0], [0, 1], "node 0 must be the root"),
        ([-1, 0], [2, 1], "node 0 must be the root"),
        ([-1, 2, 1], [0, 1, 1], "preorder"),
        ([-1, 0, 0, 1], [0, 1, 1, 1], "preorder"),  # node 3 belongs under node 1, before node 2
        ([-1, 0], [0, -1], "negative"),
    ],
)
def test_subtree_end_from_nodes_rejects_bad_nodes(parent, num_tokens, match):
    with pytest.raises(ValueError, match=match):
        exercises.subtree_end_from_nodes(parent, num_tokens)


# ---------------------------------------------------------------------------------------- checkers
def test_checkers_accept_the_solutions(capsys):
    assert exercises.check_tree_tokens(exercises.tree_tokens, seed=0)
    assert capsys.readouterr().out.startswith("pass")
    assert exercises.check_subtree_end(exercises.subtree_end_from_nodes, seed=0)
    assert capsys.readouterr().out.startswith("pass")
    # a tensor answer is fine too
    import torch

    assert exercises.check_subtree_end(
        lambda p, n: torch.tensor(exercises.subtree_end_from_nodes(p, n)), seed=1, verbose=False
    )


def _own_end(parent, num_tokens):  # where each node's own tokens end, not its subtree
    ends = list(itertools.accumulate(num_tokens))
    return [ends[n] for n in range(len(num_tokens)) for _ in range(num_tokens[n])]


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda seqs: sum(len(s) for s in seqs), "flat count"),
        (lambda seqs: len({t for s in seqs for t in s}), "distinct token ids"),
        (lambda seqs: sum(len(s) for s in {tuple(s) for s in seqs}), "duplicates are gone"),
        (lambda seqs: len({(i, t) for s in seqs for i, t in enumerate(s)}), "too few"),
        (lambda seqs: exercises.tree_tokens(seqs) + 1, "too many"),
        (lambda seqs: 1 / 0, "raised ZeroDivisionError"),
        (lambda seqs: "12", "returned the wrong type"),
        (lambda seqs: True, "returned the wrong type"),
    ],
)
def test_check_tree_tokens_rejects_wrong_answers(wrong, hint, capsys):
    assert exercises.check_tree_tokens(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out and "hint:" in out


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda p, n: [sum(n)] * sum(n), "too far"),  # plain causal: everything after is visible
        (_own_end, "where node"),
        (lambda p, n: [e - 1 for e in exercises.subtree_end_from_nodes(p, n)], "exclusive"),
        (lambda p, n: exercises.subtree_end_from_nodes(p, n)[:-1], "one value per packed token"),
        (lambda p, n: [n[i] + 0 for i in range(len(n))], "one value per packed token"),
        (lambda p, n: [0] * sum(n), "too short"),
        (lambda p, n: p[1000], "raised IndexError"),
        (lambda p, n: None, "returned the wrong type"),
        (lambda p, n: [0.5] * sum(n), "returned the wrong type"),
    ],
)
def test_check_subtree_end_rejects_wrong_answers(wrong, hint, capsys):
    assert exercises.check_subtree_end(wrong, seed=0) is False
    out = capsys.readouterr().out
    assert out.startswith("fail") and hint in out and "hint:" in out


def test_checkers_are_quiet_when_asked(capsys):
    assert exercises.check_tree_tokens(lambda seqs: 1 / 0, verbose=False) is False
    assert exercises.check_subtree_end(lambda p, n: None, verbose=False) is False
    assert capsys.readouterr().out == ""


def test_checkers_draw_fresh_cases_and_never_share_inputs():
    seen_rollouts, seen_nodes = [], []

    def spy_tokens(seqs):
        seen_rollouts.append([list(s) for s in seqs])
        answer = exercises.tree_tokens(seqs)
        seqs.clear()  # a learner mutating its input must not change the checker's case
        return answer

    def spy_nodes(parent, num_tokens):
        seen_nodes.append((list(parent), list(num_tokens)))
        answer = exercises.subtree_end_from_nodes(parent, num_tokens)
        num_tokens[-1] += 5
        return answer

    for _ in range(2):  # seed=None: two calls see different cases
        assert exercises.check_tree_tokens(spy_tokens, trials=5, verbose=False)
        assert exercises.check_subtree_end(spy_nodes, trials=5, verbose=False)
    assert len(seen_rollouts) == 10 and len(seen_nodes) == 10
    assert seen_nodes[:5] != seen_nodes[5:] and seen_rollouts[:5] != seen_rollouts[5:]
    # cases grow with the case number, so the first (the one a wrong answer usually fails on) is tiny
    assert len(seen_rollouts[0]) <= 4 and max(map(len, seen_rollouts[0])) <= 4
    # same seed, same cases
    runs = [[], []]
    for seen in runs:
        exercises.check_subtree_end(lambda p, n, seen=seen: seen.append(p) or [0], seed=3, verbose=False)
    assert runs[0] == runs[1] != []
