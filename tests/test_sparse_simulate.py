"""The ring-work simulator: totals equal the pattern's pairs, each (rank, step) equals a brute-force count,
and the striped layout balances ring steps where contiguous and zigzag do not."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from treeattn_lab.distributed.layouts import RingSchedule, block_owner
from treeattn_lab.distributed.simulate import simulate
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern, synthetic_pattern


def brute_force_work(pattern, n, world, layout, inner=None):
    """Pairs per (rank, step) from the dense mask: tiles at the step that holds their keys, bars at 0."""
    bs = pattern.block_size
    owner = block_owner(layout, n // bs, world)
    table = RingSchedule.make(world, inner).table()
    index = pattern.block_index(n)
    tiles = index.block_mask()  # [H, N, N]
    dense = pattern.dense_mask(n)
    bars = dense & ~tiles
    rank_of = owner.repeat_interleave(bs)  # per token
    work = torch.zeros(world, world, dtype=torch.float64)
    for r in range(world):
        for t in range(world):
            rows = rank_of == r
            cols = rank_of == table[r, t]
            work[r, t] += tiles[:, rows][:, :, cols].sum()
        work[r, 0] += bars[:, rank_of == r].sum()
    return work


@settings(max_examples=12)
@given(seed=st.integers(0, 2**31 - 1), world=st.sampled_from([1, 2, 3, 4]),
       layout=st.sampled_from(["contiguous", "zigzag", "striped"]), inner=st.sampled_from([None, 2]))
def test_simulated_work_matches_brute_force_and_totals_the_pattern(seed, world, layout, inner):
    if inner is not None and world % inner:
        inner = None
    gen = torch.Generator().manual_seed(seed)
    n = 16 * 2 * world * 2
    pattern = VerticalSlashPattern(torch.randint(-1, n, (2, 5), generator=gen),
                                   torch.randint(-1, n, (2, 4), generator=gen), 16)
    work = simulate(pattern, n, world, layout, inner=inner)
    assert work.total_pairs == pattern.num_pairs(n) == int(pattern.dense_mask(n).sum())
    torch.testing.assert_close(work.pairs, brute_force_work(pattern, n, world, layout, inner))
    assert work.tiles.sum() > 0 or work.total_pairs == 0


def test_striped_balances_steps_at_eight_ranks_and_contiguous_does_not():
    n = 65536
    pattern = synthetic_pattern(n, 8, seed=2)
    by_layout = {layout: simulate(pattern, n, 8, layout) for layout in ("contiguous", "zigzag", "striped")}
    striped = by_layout["striped"]
    assert striped.total_pairs == pattern.num_pairs(n)
    assert striped.step_imbalance() <= 1.10
    assert striped.step_imbalance("tiles") <= 1.10
    assert striped.worker_imbalance() <= 1.05
    assert by_layout["contiguous"].step_imbalance() > striped.step_imbalance() + 0.05
    assert by_layout["contiguous"].worker_imbalance() > striped.worker_imbalance()
    # contiguous leaves the ring's later steps nearly empty: hand-overs are exposed
    handover = float(striped.pairs.mean())
    assert by_layout["contiguous"].ring_time(handover) > striped.ring_time(handover)


def test_sixty_four_ranks_without_running_attention():
    n = 64 * 128 * 4
    work = simulate(synthetic_pattern(n, 2, n_vertical=200, n_slash=200, seed=1), n, 64, "striped")
    assert work.pairs.shape == (64, 64)
    assert work.step_imbalance() < 1.5


def test_simulator_errors():
    pattern = synthetic_pattern(1024, 1, n_vertical=8, n_slash=8, block_size=16)
    with pytest.raises(ValueError, match="multiple of 6 blocks"):
        simulate(pattern, 1024, 3, "zigzag")
    with pytest.raises(TypeError, match="VerticalSlashPattern"):
        simulate("pattern", 1024, 2)
    with pytest.raises(ValueError, match="metric"):
        simulate(pattern, 1024, 2).step_imbalance("flops")
