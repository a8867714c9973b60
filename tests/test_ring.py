"""Sparse ring attention over gloo ranks equals single-process sparse attention, gradients included.

Each world size runs in fresh processes (torch.multiprocessing spawn) with a timeout, so a hung ring
fails the test instead of hanging CI; every case inside a world compares its rank's output, dQ, dK and
dV with the full-sequence float64 reference. Layouts, schedules and sharding are checked in-process.
"""

from unittest import mock

import pytest
import torch

from treeattn_lab.bench.ring import (
    check_equivalence,
    make_inputs,
    run_spawned,
    small_pattern,
    step_times,
)
from treeattn_lab.distributed import agreement
from treeattn_lab.distributed.cpu_ranks import run_cases, spawn
from treeattn_lab.distributed.layouts import RingSchedule, block_owner, rank_blocks, shard, unshard
from treeattn_lab.distributed.ring import ring_sparse_attention
from treeattn_lab.distributed.simulate import simulate
from treeattn_lab.runtime import triton_interpreted

TOL = 1e-10  # float64 einops steps
TRITON_TOL = 2e-5  # fp32 kernel steps


def _assert_close(results, tol):
    for rank, cases in enumerate(results):
        for case, errors in enumerate(cases):
            assert errors.pop("inputs_unchanged"), f"rank {rank} case {case} modified its inputs"
            assert max(errors.values()) < tol, f"rank {rank} case {case}: {errors}"


def count_digest_exchanges(*, calls: int = 3, fault_rank: int | None = None, tokens: int = 96, group=None
                           ) -> dict:
    """Runs on each spawned rank: ``calls`` ring forwards on the same pattern object and inputs, the last
    one with rank ``fault_rank`` passing the zigzag layout instead of striped; how many digest exchanges
    (the full agreement of :func:`treeattn_lab.distributed.agreement.agree`) this rank made, and how the
    last call ended (``{"exchanges": n, "error": None or the exception's type name, "message": ...}``).
    The exchanges are counted by wrapping ``agreement.gather_objects`` in this rank's own process."""
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    q, k, v, _ = make_inputs(tokens, 2, 1, 16, dtype=torch.float64, device=torch.device("cpu"), seed=0)
    pattern = small_pattern(tokens, 2, 16, 0)
    local = [shard(x, "striped", world, rank, 16) for x in (q, k, v)]
    with mock.patch.object(agreement, "gather_objects", wraps=agreement.gather_objects) as gathers:
        for call in range(calls):
            layout = "zigzag" if call == calls - 1 and rank == fault_rank else "striped"
            try:
                ring_sparse_attention(*local, pattern, num_tokens=tokens, layout=layout, group=group,
                                      backend="reference")
            except Exception as e:  # the last call's outcome is reported below
                if call < calls - 1:
                    raise
                return {"exchanges": gathers.call_count, "error": type(e).__name__, "message": str(e)}
        return {"exchanges": gathers.call_count, "error": None, "message": ""}


@pytest.mark.xdist_group("ring")
def test_two_ranks_every_layout():
    cases = [dict(layout=layout) for layout in ("striped", "zigzag", "contiguous")]
    _assert_close(run_spawned(2, cases, timeout=900), TOL)


@pytest.mark.xdist_group("ring")
@pytest.mark.skipif(not triton_interpreted(), reason="gloo ranks hold CPU tensors, which Triton runs only in "
                    "its interpreter; on a GPU the Triton ring runs over NCCL in `bench sparse --ring`")
def test_two_ranks_run_the_triton_steps():
    cases = [dict(layout="striped", tokens=128, backend="triton", dtype=torch.float32)]
    _assert_close(run_spawned(2, cases, timeout=900), TRITON_TOL)


@pytest.mark.xdist_group("ring")
def test_three_ranks():
    cases = [dict(layout="striped", tokens=144, heads=2, kv_heads=1),
             dict(layout="zigzag", tokens=192, seed=3),
             dict(layout="contiguous", tokens=96, heads=3, kv_heads=3, seed=5)]
    _assert_close(run_spawned(3, cases, timeout=900), TOL)


@pytest.mark.xdist_group("ring")
def test_hierarchical_ring_two_nodes_of_two():
    _assert_close(run_spawned(4, [dict(layout="striped", tokens=128, inner=2)], timeout=900), TOL)


@pytest.mark.xdist_group("ring")
@pytest.mark.parametrize("inner", [3, 2])
def test_hierarchical_rings_of_six_ranks(inner):
    """2 nodes x 3 and 3 nodes x 2: with 3 in a loop, "next" and "previous" are different ranks, so a
    swapped direction in either loop (forward, or the backward walking the ring in reverse) fails."""
    _assert_close(run_spawned(6, [dict(layout="striped", tokens=96, inner=inner)], timeout=900), TOL)


@pytest.mark.xdist_group("ring")
def test_ranks_that_disagree_on_the_ring_fail_together_and_quickly():
    """Another layout or another pattern of the same size on one rank, or a rank that rejects its own
    input: every rank raises a clear error at once (no wrong output, no peer left waiting for the
    collective timeout), and the group still runs a correct ring afterwards."""
    cases = [
        dict(layout="striped", rank_faults={1: {"layout": "zigzag"}}),
        dict(layout="zigzag", rank_faults={1: {"pattern_seed": 7}}),
        dict(layout="striped", rank_faults={0: {"drop_row": True}}),
        dict(layout="striped"),
    ]
    per_rank = spawn(2, run_cases, {"fn": check_equivalence, "cases": cases}, timeout_s=900,
                     collective_timeout_s=120)
    # a rank left waiting would fail with the collective's timeout, not the RankMismatchError checked below
    assert all(r["ok"] for r in per_rank), per_rank
    for rank, outcome in enumerate(per_rank):
        mismatched_layout, mismatched_pattern, rejected, fine = outcome["value"]
        for case in (mismatched_layout, mismatched_pattern):
            assert not case["ok"] and case["error"] == "RankMismatchError", case
            assert case["message"].startswith(f"rank {rank}: the ranks disagree on the ring's pattern")
            assert "ranks [0] hold" in case["message"] and "ranks [1] hold" in case["message"]
        assert not rejected["ok"] and rejected["error"] == "RankMismatchError", rejected
        assert rejected["message"].startswith(f"rank {rank}: rank(s) [0] rejected their input")
        assert "rank 0 holds 96 tokens under the striped layout, got 95" in rejected["message"]
        assert fine["ok"], fine
        _assert_close([[fine["value"]]], TOL)


@pytest.mark.xdist_group("ring")
def test_repeated_calls_agree_by_fingerprint_and_a_later_mismatch_still_fails_everywhere():
    """Calls with the same pattern and settings exchange no digests (one fingerprint all-reduce each);
    a rank that then passes another layout makes every rank raise at once, naming the holders."""
    per_rank = spawn(3, run_cases, {"fn": count_digest_exchanges,
                                    "cases": [dict(calls=3), dict(calls=2, fault_rank=1)]},
                     timeout_s=900, collective_timeout_s=120)
    # a rank left waiting would fail with the collective's timeout, not the RankMismatchError checked below
    assert all(r["ok"] for r in per_rank), per_rank
    for rank, outcome in enumerate(per_rank):
        clean, faulty = (case["value"] for case in outcome["value"])
        assert clean == {"exchanges": 0, "error": None, "message": ""}, (rank, clean)
        assert faulty["exchanges"] == 1 and faulty["error"] == "RankMismatchError", (rank, faulty)
        assert faulty["message"].startswith(f"rank {rank}: the ranks disagree on the ring's pattern")
        assert "ranks [0, 2] hold" in faulty["message"] and "ranks [1] hold" in faulty["message"]


def test_the_quick_agreement_fingerprint_takes_63_bits_that_fit_the_int64_all_reduce():
    top, low = "f" * 16, "0" * 16
    assert agreement._fingerprint(top + "0" * 48) == 2**63 - 1
    assert agreement._fingerprint(low + "f" * 48) == 0  # only the first 64 bits count
    assert agreement._fingerprint("8" + "0" * 63) == 2**62  # the 63rd bit is used
    assert agreement._fingerprint("0" * 14 + "02" + "0" * 48) == 1  # ... and the lowest one kept
    assert agreement._fingerprint(None) == -1
    digest = agreement.sha256("ring", 3)
    fingerprint = agreement._fingerprint(digest)
    assert 0 <= fingerprint < 2**63 and fingerprint == int(digest, 16) >> 193
    flags = torch.tensor([2**63 - 1, -(2**63 - 1), 1], dtype=torch.int64)  # what the all-reduce carries
    assert flags.tolist() == [2**63 - 1, -(2**63 - 1), 1]


@pytest.mark.parametrize(("backend", "dtype", "world", "layout"),
                         [("reference", torch.float64, 3, "zigzag"), ("triton", torch.float32, 2, "striped")])
def test_one_ranks_steps_without_communication_compute_its_shard(backend, dtype, world, layout):
    """bench ring's per-step timing runs a rank's ring steps on one device: they must compute exactly
    the rank's rows of the whole sequence's attention (so what is timed is what the ring runs)."""
    from treeattn_lab.reference.sparse import sparse_attention as reference_sparse_attention

    tokens = 96 if world == 3 else 64
    q, k, v, do = make_inputs(tokens, 4, 2, 16, dtype=dtype, device=torch.device("cpu"), seed=2)
    pattern = small_pattern(tokens, 4, 16, 2)
    full = [x.detach().double().clone().requires_grad_() for x in (q, k, v)]
    want = reference_sparse_attention(*full, pattern)
    want.backward(do.double())
    calls = []

    def once(fn):
        calls.append(fn())
        return 1.0

    work = simulate(pattern, tokens, world, layout).tiles
    for rank in range(world):
        timed = step_times(q, k, v, do, pattern, layout=layout, world=world, rank=rank, backend=backend,
                           timer=once)
        tol = 1e-10 if backend == "reference" else 2e-5
        for got, expected in ((timed["out"], want.detach()), (timed["dq"], full[0].grad)):
            assert (got.double() - shard(expected, layout, world, rank, 16)).abs().max() < tol
        assert [s["step"] for s in timed["steps"]] == list(range(world))
        assert [s["tiles"] for s in timed["steps"]] == work[rank].tolist()
        assert timed["steps"][-1]["bwd_merge_ms"] == 0.0 and timed["steps"][0]["bwd_merge_ms"] == 1.0
        assert ("fwd_merge_ms" in timed["steps"][0]) == (backend == "triton")
        assert timed["totals"]["tiles"] == pytest.approx(float(work[rank].sum()))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layouts_partition_the_blocks_and_shard_round_trips(layout, world):
    nb = 2 * world * 3
    owner = block_owner(layout, nb, world)
    assert torch.bincount(owner, minlength=world).tolist() == [nb // world] * world
    blocks = [rank_blocks(layout, nb, world, r) for r in range(world)]
    assert sorted(torch.cat(blocks).tolist()) == list(range(nb))
    x = torch.randn(nb * 4, 3)
    shards = [shard(x, layout, world, r, 4) for r in range(world)]
    assert torch.equal(unshard(shards, layout, 4), x)
    if layout == "striped":
        assert blocks[world - 1].tolist() == list(range(world - 1, nb, world))
    if layout == "zigzag":
        assert owner[0] == owner[-1] == 0


def test_layout_errors():
    with pytest.raises(ValueError, match="unknown layout"):
        block_owner("diagonal", 8, 2)
    with pytest.raises(ValueError, match="multiple of 4 blocks"):
        block_owner("zigzag", 6, 2)
    with pytest.raises(ValueError, match="whole blocks"):
        shard(torch.zeros(10, 1), "striped", 2, 0, 4)


@pytest.mark.parametrize(("world", "inner"), [(1, None), (4, None), (6, 3), (8, 2), (8, 4)])
def test_ring_schedule_visits_every_origin_once_and_holders_invert_it(world, inner):
    sched = RingSchedule.make(world, inner)
    table = sched.table()
    for r in range(world):
        assert sorted(table[r].tolist()) == list(range(world)), "each rank meets every origin once"
        assert table[r, 0] == r, "step 0 is the rank's own keys"
    for t in range(world):
        assert sorted(table[:, t].tolist()) == list(range(world)), "each step is a permutation"
        for r in range(world):
            assert sched.holder(table[r, t].item(), t) == r
    for r in range(world):  # inner steps pass keys from the inner neighbour
        for t in range(world - 1):
            if (t + 1) % sched.inner:
                assert table[r, t + 1] == table[sched.inner_prev(r), t]
            else:  # outer steps: from the previous node, what it held at the start of this outer step
                start = t + 1 - sched.inner
                assert table[r, t + 1] == table[sched.outer_prev(r), start]
    with pytest.raises(ValueError, match="must divide"):
        RingSchedule.make(6, 4)


def test_ring_needs_an_initialized_process_group():
    q = torch.randn(32, 2, 16)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        ring_sparse_attention(q, q, q, small_pattern(32, 2, 16, 0), num_tokens=32)
