"""The gated scan: the Triton kernel against the plain loop, forward and backward, and the op's checks.

On CPU the kernel runs under TRITON_INTERPRET=1 (fp32 and fp16); on a GPU it runs compiled. Buffers the
kernel module allocates start as NaN, so an element it forgets to write fails the comparison.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from treeattn_lab.kernels import scan as kernel_module
from treeattn_lab.kernels.scan import scan_forward, triton_gated_scan
from treeattn_lab.kernels.tuning import ScanConfig

from tests.conftest import poisoned_allocations, relative_error
from treeattn_lab.ops.dilated import gated_scan
from treeattn_lab.reference.scan import gated_scan as reference_scan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
# (rows per chunk, channels per chain, warps, stages[, unroll, window, programs_per_sm]); chunks of 24 and
# 40 rows walked in groups of 8 and 3 (groups that overrun the chunk), a persistent launch of 2 programs
# per chain (under the interpreter programs run one after another, so the first walks every chunk of its
# chain and the other finds none left: the ticket walk's bookkeeping is tested here, its concurrency on
# a GPU)
CONFIGS = [ScanConfig(16, 4, 1, 1), ScanConfig(8, 8, 1, 1), ScanConfig(32, 16, 4, 1), ScanConfig(4, 16, 1, 1),
           ScanConfig(32, 8, 2, 1), ScanConfig(24, 4, 1, 1, unroll=8, window=4),
           ScanConfig(40, 8, 2, 1, unroll=3, window=2, programs_per_sm=64)]


class _PublishEvery:
    """A scan kernel launched with ``INCLUSIVE_EVERY=every``: only every k-th chunk publishes its inclusive
    state, the others only their maps, so later chunks must compose maps in the look-back (under the
    interpreter predecessors are always finished, and the fast path would be taken every time)."""

    def __init__(self, kernel, every):
        self.kernel, self.every = kernel, every

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, "INCLUSIVE_EVERY": self.every})


def publishing_every(every: int) -> dict:
    """Patches for :func:`poisoned_allocations`: both scan kernels launched with ``INCLUSIVE_EVERY``."""
    return {name: _PublishEvery(getattr(kernel_module, name), every) for name in ("_scan_fwd", "_scan_bwd")}


def _check(shape, dim, dtype, seed, config, inclusive_every=1, window=16):
    """Kernel vs the float64 loop, forward and backward; ``window`` replaces the config's look-back window,
    ``inclusive_every`` makes only every k-th chunk publish its inclusive state."""
    config = dataclasses.replace(config, window=window)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype)
    dh = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    xk, gk = (t.clone().to(DEVICE).requires_grad_() for t in (x, g))
    with poisoned_allocations(kernel_module, **publishing_every(inclusive_every)):
        h = triton_gated_scan(xk, gk, dim=dim, config=config)
        h.backward(dh.to(DEVICE))
    xr, gr = (t.double().requires_grad_() for t in (x, g))
    hr = reference_scan(xr, gr, dim=dim)
    hr.backward(dh.double())
    tol = TOL[dtype]
    assert h.dtype == dtype and h.shape == x.shape
    assert torch.isfinite(h).all() and torch.isfinite(xk.grad).all() and torch.isfinite(gk.grad).all()
    assert relative_error(h, hr, floor=1e-12) < tol
    assert relative_error(xk.grad, xr.grad, floor=1e-12) < 2 * tol
    # dg = lam (h_{t-1} - x_t) reads the stored (rounded) h
    assert relative_error(gk.grad, gr.grad, floor=1e-12) < 4 * tol
    torch.testing.assert_close(xk.detach().cpu(), x, rtol=0, atol=0)  # inputs untouched


@settings(max_examples=10)
@given(
    n=st.integers(1, 70),
    channels=st.sampled_from([(1,), (3,), (2, 5), (4, 4)]),
    batch=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 2**31 - 1),
    config=st.sampled_from(CONFIGS),
    inclusive_every=st.sampled_from([1, 3, 1000]),
    window=st.sampled_from([2, 4, 16]),
)
def test_kernel_matches_loop_fp32(n, channels, batch, seed, config, inclusive_every, window):
    shape = (*batch, n, *channels)
    _check(shape, len(batch), torch.float32, seed, config, inclusive_every, window)


@pytest.mark.parametrize(("inclusive_every", "window"), [(2, 16), (3, 2), (1000, 4), (1000, 16), (5, 4)])
def test_look_back_composes_chunk_maps(inclusive_every, window):
    """Chunks that publish only their map make later chunks compose maps back to a known state, one
    window of flags at a time (several windows, a state inside a window, the start of the sequence)."""
    _check((2, 70, 5), 1, torch.float32, seed=inclusive_every, config=ScanConfig(8, 4, 1, 1),
           inclusive_every=inclusive_every, window=window)


@pytest.mark.parametrize(("shape", "dim"), [((45, 3, 7), 0), ((2, 33, 6), 1)])
def test_kernel_matches_loop_fp16(shape, dim):
    _check(shape, dim, torch.float16, seed=shape[0], config=ScanConfig(16, 4, 1, 1))


@pytest.mark.parametrize(("dtype", "config", "inclusive_every", "window"), [
    (torch.float32, ScanConfig(64, 4, 1, 1, unroll=5), 1000, 2),  # groups of 5 overrun each chunk's end
    (torch.float32, ScanConfig(64, 8, 2, 1, unroll=8, window=16, programs_per_sm=8), 1, 16),  # persistent
    (torch.float16, ScanConfig(128, 4, 1, 1, unroll=16), 2, 4),
])
def test_long_loop_chunks(dtype, config, inclusive_every, window):
    """Chunks of 64-128 rows walked in unrolled groups: 150 steps are 2-3 chunks, the last one short."""
    _check((1, 150, 5), 1, dtype, seed=config.block_m + inclusive_every, config=config,
           inclusive_every=inclusive_every, window=window)


def _forward_and_buffers(x, g, config, inclusive_every):
    """``scan_forward`` under NaN-poisoned allocations, and the kernel's per-chunk vectors (maps A, B and
    inclusive states: the first ``torch.empty`` of the launch) after it ran."""
    allocated = []
    with poisoned_allocations(kernel_module, **publishing_every(inclusive_every)):
        nan_empty = torch.empty

        def recording_empty(*args, **kwargs):
            allocated.append(nan_empty(*args, **kwargs))
            return allocated[-1]

        with mock.patch.object(torch, "empty", recording_empty):
            h = scan_forward(x.to(DEVICE), g.to(DEVICE), config)
    return h, allocated[0].cpu()


def test_fast_path_skips_the_map():
    """Under the interpreter every chunk finds its predecessor's inclusive state published, so no chunk
    publishes its map (the map buffers keep their NaN poison); when only every 3rd chunk publishes its
    state, every later chunk publishes its map for its successors to compose."""
    gen = torch.Generator().manual_seed(11)
    x, g = torch.randn(1, 40, 4, generator=gen), torch.rand(1, 40, 4, generator=gen)
    maps = {}
    for inclusive_every in (1, 3):
        h, buffers = _forward_and_buffers(x, g, ScanConfig(8, 4, 1, 1), inclusive_every)
        assert relative_error(h, reference_scan(x.double(), g.double(), dim=1), floor=1e-12) < 1e-5
        agg_a, _, states = buffers.view(3, 5, 4)  # 5 chunks of one chain
        maps[inclusive_every] = torch.isfinite(agg_a).all(1)
        assert torch.isfinite(states[::inclusive_every]).all()
    assert maps[3][1:].all()
    if DEVICE == "cpu":  # on a GPU a chunk may finish pass 1 before its predecessor publishes its state
        assert not maps[1].any()


@pytest.mark.parametrize("config", [(8, 4, 1, 1), (8, 4, 1, 1, "loop"), "loop"])
def test_launch_configs_other_than_scan_configs_are_refused(config):
    x = torch.rand(5, 3, device=DEVICE)
    with pytest.raises(TypeError, match="config must be a treeattn_lab.kernels.tuning.ScanConfig"):
        triton_gated_scan(x, x, config=config)


@pytest.mark.parametrize(("fields", "match"), [((4, 3, 1, 1), "block_n must be a power of two"),
                                               ((0, 4, 1, 1), "block_m must be an int >= 1"),
                                               ((8, 4, 1, 1, False, 0), "unroll must be an int >= 1"),
                                               ((8, 4, 1, 1, False, 2.0), "unroll must be an int >= 1"),
                                               ((8, 4, 1, 1, False, 4, 3), "window must be a power of two"),
                                               ((8, 4, 1, 1, False, 4, 8, -1), "programs_per_sm must be"),
                                               ((8, 4, 1, 1, False, 4, 8, True), "programs_per_sm must be")])
def test_bad_launch_configs_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        ScanConfig(*fields)


def test_scan_config_has_no_tma_path():
    with pytest.raises(ValueError, match="no TMA path"):
        ScanConfig(8, 4, 1, 1, tma=True)


def test_time_axis_anywhere():
    """``dim=-3`` of ``[B, N, H, d]`` (the RAT+ layout) equals the loop; so does the op's auto backend."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 19, 2, 4, generator=gen)
    g = torch.rand(2, 19, 2, 4, generator=gen)
    ref = reference_scan(x, g, dim=1)
    torch.testing.assert_close(triton_gated_scan(x.to(DEVICE), g.to(DEVICE), dim=1).cpu(), ref)
    torch.testing.assert_close(gated_scan(x, g, dim=-3, backend="reference"), ref)
    auto = gated_scan(x.to(DEVICE), g.to(DEVICE), dim=-3).cpu()
    torch.testing.assert_close(auto, ref, atol=1e-5, rtol=1e-5)


def test_reference_is_the_recurrence():
    x = torch.tensor([1.0, 2.0, 3.0])
    g = torch.tensor([0.5, 0.25, 1.0])
    # h0 = 0.5 * 1; h1 = 0.25 * 0.5 + 0.75 * 2; h2 = 1.0 * h1 (a closed gate keeps the state)
    torch.testing.assert_close(reference_scan(x, g), torch.tensor([0.5, 1.625, 1.625]))
    assert reference_scan(x.double(), g.double()).dtype == torch.float64
    assert reference_scan(torch.empty(0, 3), torch.empty(0, 3)).shape == (0, 3)


@pytest.mark.parametrize(
    ("x", "g", "kwargs", "error", "match"),
    [
        (torch.zeros(3, 2), torch.zeros(3, 3), {}, ValueError, "shapes"),
        (torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.float64), {}, TypeError, "dtypes"),
        (torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64), {}, TypeError,
         "floating"),
        ([1.0, 2.0], torch.zeros(2), {}, TypeError, "x must be"),
        (torch.zeros(3, 2), torch.zeros(3, 2), {"dim": 2}, ValueError, "out of range"),
        (torch.zeros(3, 2), torch.zeros(3, 2), {"dim": 0.0}, TypeError, "dim"),
        (torch.zeros(3, 2), torch.zeros(3, 2), {"backend": "flex"}, ValueError, "no 'flex'"),
        (torch.zeros(3, 2), torch.zeros(3, 2), {"backend": "cuda"}, ValueError, "unknown backend"),
    ],
)
def test_gated_scan_rejects_bad_input(x, g, kwargs, error, match):
    with pytest.raises(error, match=match):
        gated_scan(x, g, **kwargs)


def test_bench_scan_config_parses_what_it_prints():
    from treeattn_lab.kernels.tuning import SCAN

    from treeattn_lab.bench.dilated import parse_scan_config

    assert parse_scan_config(repr(SCAN)) == SCAN
    assert parse_scan_config("48, 512, 4, 1, unroll=16, window=8, programs_per_sm=6") == SCAN
    for text in ("(48, 512)", "48, 500, 4, 1", "Launch(48, 512, 4, 1)", "48, 512, 4, 1, colour=2"):
        with pytest.raises(ValueError, match="--scan-config must be ScanConfig fields"):
            parse_scan_config(text)
