"""The ``"fa4"`` tree-attention backend: FlashAttention-4 through FlexAttention's FLASH backend.

On the CPU: the backend is absent, a request for it names what it needs, and ``auto`` picks it only where
it runs (half precision on a capable GPU). Where FA4 is installed on a Hopper-class GPU (the H200 with the
``[hopper]`` extra: ``pytest tests/test_fa4_backend.py``) the last tests check its output and gradients
against the float64 reference on random tries with awkward sizes and grouped-query heads.
"""

import random

import pytest
import torch

from tests.conftest import relative_error, tree_backend_inputs
from treeattn_lab import RolloutTrie, available_backends, reference, tree_attention
from treeattn_lab.bench.tree import branching_rollouts
from treeattn_lab.ops import backends, fa4_tree, flat_tree, tile_census
from treeattn_lab.ops import tree as tree_ops

FA4_HERE = torch.cuda.is_available() and fa4_tree.fa4_available("cuda")
SEQS = [list(range(300)), list(range(200)) + [7] * 90, list(range(50)) + [5] * 301, [3] * 77, [9, 8]]


def small_pack():
    return RolloutTrie.from_sequences(SEQS).pack()


def test_absent_on_the_cpu_and_a_request_names_what_it_needs():
    assert "fa4" not in available_backends("cpu")
    assert not fa4_tree.fa4_available("cpu")
    with pytest.raises(ValueError, match=r"fa4.*not available on cpu.*hopper.*compute capability >= 9\.0"):
        backends.choose_backend("fa4", torch.device("cpu"))
    pack = small_pack()
    q = torch.zeros(pack.num_tokens, 2, 16)
    with pytest.raises(ValueError, match="fa4"):
        tree_attention(q, q, q, pack, backend="fa4")


def test_fa4_refuses_what_it_cannot_take(monkeypatch):
    monkeypatch.setattr(fa4_tree, "fa4_available", lambda device: True)
    pack = small_pack()
    for dtype, d in ((torch.float32, 64), (torch.bfloat16, 12), (torch.bfloat16, 264)):
        q = torch.zeros(pack.num_tokens, 2, d, dtype=dtype)
        assert not fa4_tree.runs_fa4(q)
        with pytest.raises(ValueError, match=f"fp16 or bf16.*head dim {d}"):
            fa4_tree.fa4_tree_attention(q, q, q, pack)
    assert fa4_tree.runs_fa4(torch.zeros(3, 2, 128, dtype=torch.bfloat16))


def test_auto_picks_fa4_in_half_precision_where_it_runs_then_flat_at_low_sharing(monkeypatch):
    pack = small_pack()
    monkeypatch.setattr(fa4_tree, "fa4_available", lambda device: torch.device(device).type == "cuda")
    monkeypatch.setattr(tree_ops, "prefers_flat", lambda pack: False)
    monkeypatch.setattr(tree_ops, "partial_tile_share", lambda pack: tree_ops.FA4_MAX_PARTIAL_SHARE)
    pick = lambda device, dtype, d=128: tree_ops.choose_tree_backend("auto", pack, device, dtype, d)
    assert pick("cuda", torch.bfloat16) == "fa4"
    assert pick("cuda", torch.float16, 64) == "fa4"
    assert pick("cuda", torch.bfloat16, 12) == "triton"  # a head dim FA4 does not take
    assert pick("cuda", torch.float32) == "triton"
    assert pick("cpu", torch.bfloat16) == "reference"
    assert tree_ops.choose_tree_backend("triton", pack, "cuda", torch.bfloat16, 128) == "triton"
    monkeypatch.setattr(tree_ops, "prefers_flat", lambda pack: True)
    assert pick("cuda", torch.bfloat16) == "fa4"  # mostly full tiles: FA4 even where the pack shares little
    assert pick("cuda", torch.bfloat16, 12) == "flat"
    monkeypatch.setattr(tree_ops, "partial_tile_share", lambda pack: tree_ops.FA4_MAX_PARTIAL_SHARE + 0.01)
    assert pick("cuda", torch.bfloat16) == "flat"  # mostly partial tiles and little sharing: flat
    monkeypatch.setattr(fa4_tree, "fa4_available", lambda device: False)
    monkeypatch.setattr(tree_ops, "partial_tile_share", lambda pack: pytest.fail("a census FA4 cannot use"))
    assert pick("cuda", torch.bfloat16) == "flat"
    monkeypatch.setattr(tree_ops, "prefers_flat", lambda pack: False)
    assert pick("cuda", torch.bfloat16) == "triton"


def test_auto_runs_fa4_only_on_packs_of_mostly_full_tiles_whatever_the_grad_mode(monkeypatch):
    pack = small_pack()
    monkeypatch.setattr(fa4_tree, "fa4_available", lambda device: True)
    monkeypatch.setattr(tree_ops, "prefers_flat", lambda pack: False)

    def pick(share):
        monkeypatch.setattr(tree_ops, "partial_tile_share", lambda pack: share)
        return tree_ops.choose_tree_backend("auto", pack, "cuda", torch.bfloat16, 128)

    assert pick(0.0) == "fa4"
    assert pick(tree_ops.FA4_MAX_PARTIAL_SHARE) == "fa4"
    assert pick(tree_ops.FA4_MAX_PARTIAL_SHARE + 0.01) == "triton"  # FA4's backward loses on such packs
    with torch.no_grad():  # a log-prob pass runs what the training pass over the same pack runs
        assert pick(tree_ops.FA4_MAX_PARTIAL_SHARE + 0.01) == "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # no cached census while tracing
    monkeypatch.setattr(tree_ops, "partial_tile_share", lambda pack: pytest.fail("read the pack, tracing"))
    assert tree_ops.choose_tree_backend("auto", pack, "cuda", torch.bfloat16, 128) == "fa4"


def test_while_tracing_auto_uses_only_a_cached_tile_census(monkeypatch):
    monkeypatch.setattr(fa4_tree, "fa4_available", lambda device: True)
    pick = lambda pack: tree_ops.choose_tree_backend("auto", pack, "cuda", torch.bfloat16, 128)
    mostly_partial, mostly_full = small_pack(), small_pack()
    assert pick(mostly_partial) == "triton" and pick(mostly_full) == "triton"  # eager: both censuses cached
    mostly_full._cache["partial_tile_share"] = tree_ops.FA4_MAX_PARTIAL_SHARE  # as if its tiles were full
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(tile_census, "tile_census", lambda *args: pytest.fail("counted tiles while tracing"))
    assert pick(mostly_partial) == "triton"
    assert pick(mostly_full) == "fa4"
    with pytest.raises(ValueError, match="torch.compile cannot build the tile census"):
        tile_census.partial_tile_share(small_pack())


def test_auto_picks_by_the_tiles_of_constructed_packs(monkeypatch):
    """Long nodes in whole 128-token tiles run FA4 even when they share nothing; many short, ragged nodes
    run the Triton kernel, or flat where they share little."""
    monkeypatch.setattr(fa4_tree, "fa4_available", lambda device: True)
    pick = lambda pack: tree_ops.choose_tree_backend("auto", pack, "cuda", torch.bfloat16, 128)
    rng = random.Random(5)
    aligned_low = branching_rollouts(3, 128, [(2, 1536)])  # shares little
    aligned_high = branching_rollouts(2, 1024, [(4, 512)])
    words = lambda n: [rng.randrange(1, 99) for _ in range(n)]
    ragged_high = []  # 40 prompts of ragged length, 6 short ragged responses each
    for group in range(40):
        prompt = [1000 + group] + words(rng.randrange(20, 90))
        ragged_high += [prompt + [child] + words(rng.randrange(5, 40)) for child in range(6)]
    ragged_low = [[1000 + i] + words(199) for i in range(24)]  # nothing shared, nodes across tile edges
    packs = {name: RolloutTrie.from_sequences(seqs).pack() for name, seqs in
             [("aligned_low", aligned_low), ("aligned_high", aligned_high), ("ragged_high", ragged_high),
              ("ragged_low", ragged_low)]}
    share = {name: tile_census.partial_tile_share(pack) for name, pack in packs.items()}
    ratio = {name: flat_tree.flat_pair_ratio(pack) for name, pack in packs.items()}
    assert max(share["aligned_low"], share["aligned_high"]) <= tree_ops.FA4_MAX_PARTIAL_SHARE
    assert min(share["ragged_low"], share["ragged_high"]) > tree_ops.FA4_MAX_PARTIAL_SHARE
    assert max(ratio["aligned_low"], ratio["ragged_low"]) < flat_tree.FLAT_BELOW_PAIR_RATIO
    assert min(ratio["aligned_high"], ratio["ragged_high"]) > flat_tree.FLAT_BELOW_PAIR_RATIO
    assert {name: pick(pack) for name, pack in packs.items()} == {
        "aligned_low": "fa4", "aligned_high": "fa4", "ragged_high": "triton", "ragged_low": "flat"}


def test_while_tracing_auto_uses_only_a_cached_flat_decision(monkeypatch):
    pack = small_pack()
    monkeypatch.setattr(fa4_tree, "fa4_available", lambda device: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def host_work(pack):
        raise AssertionError("auto read the pack on the host while tracing")

    monkeypatch.setattr(tree_ops, "prefers_flat", host_work)
    assert tree_ops.choose_tree_backend("auto", pack, "cuda", torch.bfloat16, 128) == "triton"
    pack._cache["flat_pair_ratio"] = 1.0  # what an eager call caches
    monkeypatch.setattr(tree_ops, "prefers_flat", lambda pack: pack._cache["flat_pair_ratio"] < 1.1)
    assert tree_ops.choose_tree_backend("auto", pack, "cuda", torch.bfloat16, 128) == "flat"


@pytest.mark.skipif(not FA4_HERE, reason="FlashAttention-4 needs a Hopper-class GPU and the [hopper] extra")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (2, 1, 96)])
@pytest.mark.parametrize("seed", [3, 11])
def test_fa4_equals_the_reference_forward_and_backward(dtype, heads, seed):
    pack = small_pack().to("cuda")
    q, k, v, do = (x.cuda() for x in tree_backend_inputs(pack, heads, seed, torch.float32))
    low = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    originals = [x.detach().clone() for x in low]
    out = tree_attention(*low, pack, backend="fa4")
    out.backward(do.to(dtype))
    want = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference.tree_attention(*want, pack.subtree_end, scale=None)
    ref.backward(do.double())
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-2
    for x, w, original in zip(low, want, originals, strict=True):
        assert torch.equal(x.detach(), original)
        assert torch.isfinite(x.grad).all() and relative_error(x.grad, w.grad) < 1e-2


@pytest.mark.skipif(not FA4_HERE, reason="FlashAttention-4 needs a Hopper-class GPU and the [hopper] extra")
def test_auto_runs_fa4_and_packs_of_other_sizes_reuse_it():
    for extra in (0, 129, 1000):
        pack = RolloutTrie.from_sequences(SEQS + [[4] * (extra + 1)]).pack().to("cuda")
        pack._cache["partial_tile_share"] = tree_ops.FA4_MAX_PARTIAL_SHARE  # a pack FA4 suits
        assert tree_ops.choose_tree_backend("auto", pack, pack.device, torch.bfloat16, 128) == "fa4"
        inputs = tree_backend_inputs(pack, (4, 4, 128), extra, torch.float32)
        q, k, v = (x.cuda().bfloat16() for x in inputs[:3])
        ref = reference.tree_attention(q.double(), k.double(), v.double(), pack.subtree_end)
        assert relative_error(tree_attention(q, k, v, pack), ref) < 1e-2


def test_an_unknown_flex_kernel_is_refused():
    from treeattn_lab.ops import flex

    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="unknown FlexAttention kernel 'bogus'"):
        flex.flex_attention(q, q, q, None, kernel="bogus")
