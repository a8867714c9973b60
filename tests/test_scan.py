"""The gated scan: the Triton kernel against the plain loop, forward and backward, and the op's checks.

On CPU the kernel runs under TRITON_INTERPRET=1 (fp32 and fp16); on a GPU it runs compiled. Buffers the
kernel module allocates start as NaN, so an element it forgets to write fails the comparison.
"""

from __future__ import annotations

from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from treeattn_lab.kernels import scan as kernel_module
from treeattn_lab.kernels.scan import ScanConfig, scan_forward, triton_gated_scan

from tests.conftest import poisoned_allocations, relative_error
from treeattn_lab.ops.dilated import gated_scan
from treeattn_lab.reference.scan import gated_scan as reference_scan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
# (block_t, block_c, warps, stages, method[, unroll, window, programs_per_sm]); loop chunks of 24 and 40 rows
# walked in groups of 8 and 3 (groups that overrun the chunk), a persistent launch of 2 programs per chain
# (under the interpreter programs run one after another, so the first walks every chunk of its chain and
# the other finds none left: the ticket walk's bookkeeping is tested here, its concurrency on a GPU)
CONFIGS = [(16, 4, 1, 1, "tile"), (8, 8, 1, 1, "tile"), (32, 16, 4, 1, "tile"), (16, 4, 1, 1, "loop"),
           (4, 16, 1, 1, "loop"), (32, 8, 2, 1, "loop"), (24, 4, 1, 1, "loop", 8, 4),
           (40, 8, 2, 1, "loop", 3, 2, 64)]


def _check(shape, dim, dtype, seed, config, inclusive_every=1, window=16):
    """Kernel vs the float64 loop, forward and backward; ``window`` replaces the config's look-back window,
    ``inclusive_every`` makes only every k-th chunk publish its inclusive state."""
    config = ScanConfig(*config)._replace(window=window)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype)
    dh = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    xk, gk = (t.clone().to(DEVICE).requires_grad_() for t in (x, g))
    with poisoned_allocations(kernel_module, _INCLUSIVE_EVERY=inclusive_every):
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


@pytest.mark.parametrize(("inclusive_every", "window", "method"), [
    (2, 16, "tile"), (3, 2, "tile"), (1000, 4, "tile"), (1000, 16, "tile"), (5, 4, "tile"),
    (3, 2, "loop"), (1000, 4, "loop"),  # the row loop is slow under the interpreter: its two hardest
])
def test_look_back_composes_chunk_maps(inclusive_every, window, method):
    """Chunks that publish only their map make later chunks compose maps back to a known state, one
    window of flags at a time (several windows, a state inside a window, the start of the sequence)."""
    _check((2, 70, 5), 1, torch.float32, seed=inclusive_every, config=(8, 4, 1, 1, method),
           inclusive_every=inclusive_every, window=window)


@pytest.mark.parametrize(("shape", "dim", "method"), [((45, 3, 7), 0, "tile"), ((2, 33, 6), 1, "tile"),
                                                     ((2, 33, 6), 1, "loop")])
def test_kernel_matches_loop_fp16(shape, dim, method):
    _check(shape, dim, torch.float16, seed=shape[0], config=(16, 4, 1, 1, method))


@pytest.mark.parametrize(("dtype", "config", "inclusive_every", "window"), [
    (torch.float32, (64, 4, 1, 1, "loop", 5), 1000, 2),  # groups of 5 overrun each chunk's end; maps composed
    (torch.float32, (64, 8, 2, 1, "loop", 8, 16, 8), 1, 16),  # fast path throughout; persistent
    (torch.float16, (128, 4, 1, 1, "loop", 16), 2, 4),
])
def test_long_loop_chunks(dtype, config, inclusive_every, window):
    """Chunks of 64-128 rows walked in unrolled groups: 150 steps are 2-3 chunks, the last one short."""
    _check((1, 150, 5), 1, dtype, seed=config[0] + inclusive_every, config=config,
           inclusive_every=inclusive_every, window=window)


def _forward_and_buffers(x, g, config, inclusive_every):
    """``scan_forward`` under NaN-poisoned allocations, and the kernel's per-chunk vectors (maps A, B and
    inclusive states: the first ``torch.empty`` of the launch) after it ran."""
    allocated = []
    with poisoned_allocations(kernel_module, _INCLUSIVE_EVERY=inclusive_every):
        nan_empty = torch.empty

        def recording_empty(*args, **kwargs):
            allocated.append(nan_empty(*args, **kwargs))
            return allocated[-1]

        with mock.patch.object(torch, "empty", recording_empty):
            h = scan_forward(x.to(DEVICE), g.to(DEVICE), config)
    return h, allocated[0].cpu()


@pytest.mark.parametrize("method", ["tile", "loop"])
def test_fast_path_skips_the_map(method):
    """Under the interpreter every chunk finds its predecessor's inclusive state published, so no chunk
    publishes its map (the map buffers keep their NaN poison); when only every 3rd chunk publishes its
    state, every later chunk publishes its map for its successors to compose."""
    gen = torch.Generator().manual_seed(11)
    x, g = torch.randn(1, 40, 4, generator=gen), torch.rand(1, 40, 4, generator=gen)
    maps = {}
    for inclusive_every in (1, 3):
        h, buffers = _forward_and_buffers(x, g, (8, 4, 1, 1, method), inclusive_every)
        assert relative_error(h, reference_scan(x.double(), g.double(), dim=1), floor=1e-12) < 1e-5
        agg_a, _, states = buffers.view(3, 5, 4)  # 5 chunks of one chain
        maps[inclusive_every] = torch.isfinite(agg_a).all(1)
        assert torch.isfinite(states[::inclusive_every]).all()
    assert maps[3][1:].all()
    if DEVICE == "cpu":  # on a GPU a chunk may finish pass 1 before its predecessor publishes its state
        assert not maps[1].any()


def test_unknown_method_is_refused():
    x = torch.rand(5, 3, device=DEVICE)
    with pytest.raises(ValueError, match="scan method"):
        triton_gated_scan(x, x, config=(4, 4, 1, 1, "magic"))


@pytest.mark.parametrize(("config", "match"), [((4, 3, 1, 1, "loop"), "block_c must be a power of two"),
                                               ((3, 4, 1, 1, "tile"), "block_t must be a power of two"),
                                               ((0, 4, 1, 1, "loop"), "block_t must be a positive int"),
                                               ((8, 4, 1, 1, "loop", 0), "unroll must be a positive int"),
                                               ((8, 4, 1, 1, "loop", 2.0), "unroll must be a positive int"),
                                               ((8, 4, 1, 1, "loop", 4, 3), "window must be a power of two"),
                                               ((8, 4, 1, 1, "tile", 4, 8, -1), "programs_per_sm must be"),
                                               ((8, 4, 1, 1, "loop", 4, 8, True), "programs_per_sm must be")])
def test_bad_launch_configs_are_refused(config, match):
    x = torch.rand(5, 3, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        triton_gated_scan(x, x, config=config)


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
