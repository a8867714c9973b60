"""Non-finite keys and values, as the ops document them (``treeattn_lab.ops``): one ``inf`` in ``v`` at one
token reaches every row that sees that token, on every backend; finite inputs give finite outputs.
Rows that do not see the token may be hit too (which ones depends on the backend), so they are not
asserted on."""

from __future__ import annotations

import pytest
import torch

import treeattn_lab.ops
from treeattn_lab import RolloutTrie, dilated_attention, sparse_attention, tree_attention
from treeattn_lab.patterns.dilated import DilatedPattern
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BAD = 3  # the token whose value holds the inf


def _inputs(n, hq=2, hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv)]


def _check(run, sees, n):
    """``run(q, k, v)`` on finite inputs is finite; with ``v[BAD] = inf`` every row in ``sees`` is not."""
    q, k, v = _inputs(n)
    assert torch.isfinite(run(q, k, v)).all()
    v[BAD, :, 0] = float("inf")
    bad_rows = ~torch.isfinite(run(q, k, v).cpu()).all(-1).all(-1)
    assert bad_rows[sees].all(), "a row that sees the inf came out finite"


def _on(backend, *tensors):
    dev = DEVICE if backend == "triton" else "cpu"
    return [x.to(dev) for x in tensors]


@pytest.mark.parametrize("backend", ["reference", "flex", "triton", "flat", "varlen"])
def test_tree_attention(backend):
    pack = RolloutTrie.from_sequences([list(range(20)), list(range(5)) + [100 + i for i in range(30)],
                                       [7] * 10]).pack()
    sees = pack.visibility_mask()[:, BAD]
    assert (~sees).any()
    _check(lambda q, k, v: tree_attention(*_on(backend, q, k, v), pack.to(DEVICE if backend == "triton"
                                                                           else "cpu"), backend=backend),
           sees, pack.num_tokens)


@pytest.mark.parametrize("backend", ["reference", "flex", "triton"])
def test_sparse_attention(backend):
    n = 64
    pattern = VerticalSlashPattern([[BAD, 40], [-1, -1]], [[0], [0]], 16)
    sees = pattern.dense_mask(n)[:, :, BAD].any(0)  # [N]: some head of the row sees the token
    _check(lambda q, k, v: sparse_attention(*_on(backend, q, k, v), pattern.to(DEVICE if backend == "triton"
                                                                               else "cpu"), backend=backend),
           sees, n)


@pytest.mark.parametrize("backend", ["reference", "flex", "triton"])
def test_dilated_attention(backend):
    n, pattern = 70, DilatedPattern(4, 2, 1)
    sees = pattern.dense_mask(n)[:, BAD]
    _check(lambda q, k, v: dilated_attention(*_on(backend, q, k, v), dilation=4, window=2, initial=1,
                                             backend=backend), sees, n)


def test_the_behaviour_is_documented():
    assert "Non-finite inputs are not contained" in treeattn_lab.ops.__doc__
    for op in (tree_attention, sparse_attention, dilated_attention):
        assert "``nan`` / ``inf`` in k or v reaches every row" in " ".join(op.__doc__.split())
