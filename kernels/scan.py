"""Gated linear recurrence (the RAT+ scan) in Triton: a chunked scan, forward and backward.

The recurrence
--------------
For every channel ``c`` independently, along time ``t = 0 .. N-1``::

    h_t = g_t * h_{t-1} + (1 - g_t) * x_t,        h_{-1} = 0.

``g`` is a gate in (0, 1): near 1 the state keeps its memory, near 0 it takes the new input. RAT+ runs it
on keys and values (``x = k`` or ``v``, one gate for both) so that each position's key/value summarizes
the recent past, which is what later lets attention look at only every D-th position.

Each step is an affine map ``h -> a h + b`` with ``a = g_t`` and ``b = (1 - g_t) x_t``, and affine maps
compose associatively: applying ``(a1, b1)`` then ``(a2, b2)`` is ``(a1 a2, b1 a2 + b2)``. That is what
makes the recurrence a *scan*: any block of steps can be collapsed into one ``(A, B)`` pair.

Chunks, in parallel, chained by a look-back (the forward kernel)
----------------------------------------------------------------
Memory layout ``[B, N, C]`` with channels contiguous. A *chain* is ``BLOCK_C`` channels of one batch row;
time is cut into chunks of ``BLOCK_T`` steps, and every (chunk, chain) is its own program, so a long
sequence gives many thousands of programs even when there are few channels. A program:

1. takes a ticket: ``pos = atomic_add(counter[chain], 1)`` is its chunk index along the chain. Tickets
   are handed out in the order programs *start*, so every chunk before ``pos`` already runs somewhere;
2. loads its ``[BLOCK_T, BLOCK_C]`` tile of ``x`` and ``g`` (channels contiguous: coalesced) and scans it
   along time with ``tl.associative_scan`` on the pairs ``(a, b)``: row ``t`` becomes the map
   ``(A_t, B_t)`` from the state before the chunk to ``h_t``;
3. publishes the chunk's whole map (its last row);
4. looks back for the state entering the chunk: walking to earlier chunks, it composes their published
   maps until it meets one whose *inclusive* state (the true ``h`` at its end) is published, or the start
   of the sequence (state 0). Chunks publish maps right after loading, so the walk rarely waits for long
   (the "decoupled look-back" of single-pass GPU scans);
5. publishes its own inclusive state, then writes ``h_t = A_t h_in + B_t``.

Every byte of x, g and h crosses memory once (plus a few small per-chunk vectors), the state is fp32, and
there is no second pass over the data. Published vectors need no flags or fences: the buffers start
filled with a NaN of a private bit pattern, and a vector without that pattern is complete (each 32-bit
element is written atomically). Padding rows beyond ``N`` load ``g = 1, x = 0``: the identity map.
(Under the interpreter programs run one after another in ticket order and never wait.)

Backward
--------
With ``dh`` the gradient of the outputs, the gradient reaching ``h_t`` (from ``dh_t`` and through every
later step) runs backward in time with the *next* step's gate::

    lam_t = dh_t + g_{t+1} * lam_{t+1},     lam_{N-1} = dh_{N-1},
    dx_t  = (1 - g_t) * lam_t,
    dg_t  = lam_t * (h_{t-1} - x_t).

``lam`` is the same kind of scan, run from the end: ticket ``pos`` is the ``pos``-th chunk *from the end*,
its rows are loaded latest first, so the forward combine and the same look-back apply unchanged. It
reads the saved output ``h`` shifted by one step for ``h_{t-1}``.

Precision: the state and all arithmetic are fp32 whatever the input dtype; outputs and gradients are
stored in the input dtype. Under ``TRITON_INTERPRET=1`` (CPU) the kernels run through numpy.

Status on an H200 (``bench/results/dilated__*.json``, ``[1, 128K, 2048]`` bf16): correct with the default
``(256, 32, 4, 1)`` (forward within 1.7e-3 of the fp32 loop over 128K steps, backward within 1.9e-3 over
16K), but only 715 GB/s forward and 845 GB/s backward, 17% and 20% of a 4.2 TB/s copy, far from a
bandwidth-bound scan; tiles of 64 channels ran faster (25%) but returned NaN, a fault not yet found.
Suspects: the per-chunk work is small next to the look-back's L2 round trips and the cross-warp scan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (BLOCK_T, BLOCK_C, num_warps, num_stages): the one launch checked correct on an H200 (see the docstring;
# `python -m treeattn_lab bench dilated --scan-only --tune-scan` times and checks the candidates).
DEFAULT_CONFIG = (256, 32, 4, 1)
# A chunk publishes two vectors per chain: its map (a, b) as soon as it has scanned its tile, then its
# inclusive state. Buffers start filled with a NaN of a private bit pattern (EMPTY): a vector holding no
# EMPTY element is published, so the data is its own flag and needs no memory fence. (Arithmetic never
# produces this NaN: GPUs return the canonical one.) Tests raise _INCLUSIVE_EVERY so that most chunks
# publish only their map: under the interpreter the look-back then has to compose maps, as it does on a
# GPU whenever a predecessor is still running.
EMPTY_BITS = 0x7FBADBAD
EMPTY = tl.constexpr(EMPTY_BITS)  # kernels may read globals only as constexpr
_INCLUSIVE_EVERY = 1


@triton.jit
def _compose(a1, b1, a2, b2):
    """Apply the affine map (a1, b1), then (a2, b2): h -> a2 (a1 h + b1) + b2."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _last_row(x, BLOCK_T: tl.constexpr):
    """Row ``BLOCK_T - 1`` of a ``[BLOCK_T, BLOCK_C]`` tile (padding rows are identities: the chunk's end)."""
    last = (tl.arange(0, BLOCK_T) == BLOCK_T - 1)[:, None]
    return tl.sum(tl.where(last, x, 0.0), 0)


@triton.jit
def _published(x):
    """True when no element of the vector ``x`` is still EMPTY."""
    return tl.max((x.to(tl.int32, bitcast=True) == EMPTY).to(tl.int32), 0) == 0


@triton.jit
def _look_back(AGG_A, AGG_B, INCL, pos, chain, n_chains, offs):
    """The state entering chunk ``pos`` of ``chain``: compose earlier chunks' maps back to a known state."""
    run_a = tl.full(offs.shape, 1.0, tl.float32)  # map from the looked-at point to this chunk's start
    run_b = tl.zeros(offs.shape, tl.float32)
    j = pos - 1
    while j >= 0:  # each pass either steps back one chunk, stops at a known state, or waits and retries
        base = (j * n_chains + chain) * offs.shape[0] + offs
        state = tl.load(INCL + base, volatile=True)
        map_a = tl.load(AGG_A + base, volatile=True)
        map_b = tl.load(AGG_B + base, volatile=True)
        known = _published(state)  # the true state at the end of chunk j: a map h -> state (a = 0)
        step = known | (_published(map_a) & _published(map_b))
        prev_a = tl.where(known, 0.0, map_a)
        prev_b = tl.where(known, state, map_b)
        run_b = tl.where(step, prev_b * run_a + run_b, run_b)
        run_a = tl.where(step, prev_a * run_a, run_a)
        j = tl.where(known, -1, tl.where(step, j - 1, j))
    return run_b  # applied to the zero state before the sequence, or to the known state found


@triton.jit(do_not_specialize=["N", "C", "n_chains", "n_cblk"])
def _scan_fwd(
    X, G, H, AGG_A, AGG_B, INCL, TICKETS, N, C, n_chains, n_cblk, stride_b, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr,
):
    chain = tl.program_id(0) % n_chains
    pos = tl.atomic_add(TICKETS + chain, 1)  # this program's chunk along its chain
    row = (chain // n_cblk).to(tl.int64)
    offs_c = (chain % n_cblk) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = pos * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (offs_t < N)[:, None] & (offs_c < C)[None, :]
    ptrs = row * stride_b + offs_t.to(tl.int64)[:, None] * stride_t + offs_c[None, :]
    x = tl.load(X + ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + ptrs, mask=mask, other=1.0).to(tl.float32)
    a, b = tl.associative_scan((g, (1.0 - g) * x), 0, _compose)
    a_last, b_last = _last_row(a, BLOCK_T), _last_row(b, BLOCK_T)
    vec = tl.arange(0, BLOCK_C)
    slot = pos * n_chains + chain
    tl.store(AGG_A + slot * BLOCK_C + vec, a_last)  # publish the chunk's map
    tl.store(AGG_B + slot * BLOCK_C + vec, b_last)
    tl.debug_barrier()  # keep the stores ahead of the wait below
    h_in = _look_back(AGG_A, AGG_B, INCL, pos, chain, n_chains, vec)
    if pos % INCLUSIVE_EVERY == 0:  # publish the state at the chunk's end
        tl.store(INCL + slot * BLOCK_C + vec, a_last * h_in + b_last)
    tl.store(H + ptrs, (a * h_in[None, :] + b).to(H.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "C", "n_chains", "n_cblk"])
def _scan_bwd(
    X, G, H, DH, DX, DG, AGG_A, AGG_B, INCL, TICKETS, N, C, n_chains, n_cblk, stride_b, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr,
):
    chain = tl.program_id(0) % n_chains
    pos = tl.atomic_add(TICKETS + chain, 1)  # this program's chunk, counted from the end
    row = (chain // n_cblk).to(tl.int64)
    offs_c = (chain % n_cblk) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < C
    offs_t = N - 1 - pos * BLOCK_T - tl.arange(0, BLOCK_T)  # latest row first
    valid = offs_t >= 0
    mask = valid[:, None] & in_c[None, :]
    ptrs = row * stride_b + offs_t.to(tl.int64)[:, None] * stride_t + offs_c[None, :]
    dh = tl.load(DH + ptrs, mask=mask, other=0.0).to(tl.float32)
    has_next = (valid & (offs_t + 1 < N))[:, None] & in_c[None, :]
    g_next = tl.load(G + ptrs + stride_t, mask=has_next, other=0.0).to(tl.float32)
    a = tl.where(valid[:, None], g_next, 1.0)  # padding rows: identity maps
    a, b = tl.associative_scan((a, dh), 0, _compose)
    a_last, b_last = _last_row(a, BLOCK_T), _last_row(b, BLOCK_T)
    vec = tl.arange(0, BLOCK_C)
    slot = pos * n_chains + chain
    tl.store(AGG_A + slot * BLOCK_C + vec, a_last)
    tl.store(AGG_B + slot * BLOCK_C + vec, b_last)
    tl.debug_barrier()
    lam_in = _look_back(AGG_A, AGG_B, INCL, pos, chain, n_chains, vec)
    if pos % INCLUSIVE_EVERY == 0:
        tl.store(INCL + slot * BLOCK_C + vec, a_last * lam_in + b_last)
    lam = a * lam_in[None, :] + b
    g = tl.load(G + ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + ptrs, mask=mask, other=0.0).to(tl.float32)
    has_prev = (valid & (offs_t >= 1))[:, None] & in_c[None, :]
    h_prev = tl.load(H + ptrs - stride_t, mask=has_prev, other=0.0).to(tl.float32)
    tl.store(DX + ptrs, ((1.0 - g) * lam).to(DX.dtype.element_ty), mask=mask)
    tl.store(DG + ptrs, (lam * (h_prev - x)).to(DG.dtype.element_ty), mask=mask)


def _launch(kernel, tensors, B, N, C, config):
    """Allocate the per-chunk vectors (EMPTY) and tickets (0); run ``kernel`` over every (chunk, chain)."""
    block_t, block_c, warps, stages = config
    n_cblk = triton.cdiv(C, block_c)
    n_chains, n_chunks = B * n_cblk, triton.cdiv(N, block_t)
    dev = tensors[0].device
    vecs = torch.full((3, n_chunks * n_chains * block_c), EMPTY_BITS, device=dev, dtype=torch.int32)
    vecs = vecs.view(torch.float32)
    tickets = torch.zeros(n_chains, device=dev, dtype=torch.int32)
    kernel[(n_chunks * n_chains,)](*tensors, vecs[0], vecs[1], vecs[2], tickets, N, C, n_chains, n_cblk,
                                   tensors[0].stride(0), tensors[0].stride(1), BLOCK_T=block_t,
                                   BLOCK_C=block_c, INCLUSIVE_EVERY=_INCLUSIVE_EVERY, num_warps=warps,
                                   num_stages=stages)


def scan_forward(x: torch.Tensor, g: torch.Tensor, config=None) -> torch.Tensor:
    """``h`` for contiguous ``x, g [B, N, C]`` (no autograd)."""
    B, N, C = x.shape
    h = torch.empty_like(x)
    if h.numel():
        _launch(_scan_fwd, (x, g, h), B, N, C, config or DEFAULT_CONFIG)
    return h


def scan_backward(x, g, h, dh, config=None):
    """``(dx, dg)`` for contiguous ``[B, N, C]`` tensors, from the saved output ``h``."""
    B, N, C = x.shape
    dh = dh.contiguous()
    dx, dg = torch.empty_like(x), torch.empty_like(g)
    if dx.numel():
        _launch(_scan_bwd, (x, g, h, dh, dx, dg), B, N, C, config or DEFAULT_CONFIG)
    return dx, dg


class GatedScanFunction(torch.autograd.Function):
    """Autograd wrapper over ``[B, N, C]``: forward saves (x, g, h); backward runs the reverse scan."""

    @staticmethod
    def forward(ctx, x, g, config):
        h = scan_forward(x, g, config)
        ctx.save_for_backward(x, g, h)
        ctx.config = config
        return h

    @staticmethod
    def backward(ctx, dh):
        x, g, h = ctx.saved_tensors
        dx, dg = scan_backward(x, g, h, dh, ctx.config)
        return dx, dg, None


def triton_gated_scan(x: torch.Tensor, g: torch.Tensor, *, dim: int = 0, config=None) -> torch.Tensor:
    """The recurrence along ``dim`` of ``x`` and ``g`` (same shape), with the Triton kernels.

    Inputs are already validated by ``treeattn_lab.ops.gated_scan``. The tensor is viewed as
    ``[before dim, N, after dim]`` (made contiguous if it is not). ``config`` overrides the launch as
    ``(BLOCK_T, BLOCK_C, num_warps, num_stages)``, powers of two for the blocks.
    """
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {x.dtype} is not supported by the triton scan; use fp16, bf16 or fp32")
    shape = x.shape
    N = shape[dim]
    B = shape[:dim].numel()
    view = (B, N, x.numel() // max(1, B * N))
    h = GatedScanFunction.apply(x.contiguous().view(view), g.contiguous().view(view), config)
    return h.view(shape)
