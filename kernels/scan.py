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
there is no second pass over the data.

Publishing is a flag per (chunk, chain): 0 nothing yet, 1 map published, 2 inclusive state published.
A writer stores the vector(s), synchronizes its threads, then one thread sets the flag with a *release*
atomic; a reader reads the flag with an *acquire* atomic (one scalar, the same for every thread), and
only then loads the vectors it announces, bypassing the L1 cache. The decision to stop or step back is
thus uniform across the program's threads (an earlier version used the data as its own flag: threads
holding copies of the same element could disagree, and wide tiles returned NaN on the GPU).
Padding rows beyond ``N`` load ``g = 1, x = 0``: the identity map. (Under the interpreter programs run
one after another in ticket order and never wait.)

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

Status on an H200 (``bench/results/scan__*.json``, ``[1, 128K, 2048]`` bf16): every launch candidate
matches the fp32 loop (1.7e-3 forward over 128K steps, 1.9e-3 backward over 16K); the best, the row loop
over 16 rows x 256 channels, moves 1.21 TB/s forward and 1.11 TB/s backward, 29% and 26% of a 4.2 TB/s
copy. That is far from a bandwidth-bound scan: each chunk's ticket, two release fences and look-back
round trips cost more than its 16 rows of data; a persistent kernel walking many chunks per program
would amortize them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A ScanConfig; `python -m treeattn_lab bench dilated --scan-only --tune-scan` times and checks the
# candidates on a GPU.
DEFAULT_CONFIG = (16, 256, 2, 1, "loop")
# Flag values per (chunk, chain).
MAP_READY = tl.constexpr(1)
STATE_READY = tl.constexpr(2)
# Tests raise _INCLUSIVE_EVERY so that most chunks publish only their map: under the interpreter the
# look-back then has to compose maps, as it does on a GPU whenever a predecessor is still running.
_INCLUSIVE_EVERY = 1
# Predecessor chunks whose flags one look-back step reads at once (CUB reads a warp's worth).
LOOK_BACK_WINDOW = 16


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
def _publish(FLAGS, slot, value):
    """Raise the flag of ``slot`` to ``value`` once every thread's stores before it are visible."""
    tl.debug_barrier()  # all threads of the program have issued their stores
    tl.atomic_xchg(FLAGS + slot, value, sem="release")


@triton.jit
def _look_back(AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, offs, WINDOW: tl.constexpr):
    """The state entering chunk ``pos`` of ``chain``: compose earlier chunks' maps back to a known state.

    Reads the flags of ``WINDOW`` predecessors at once (newest first, one acquire per flag). With ``z``
    the nearest not-yet-published chunk and ``s`` the nearest with its inclusive state, it composes the
    maps of the chunks before ``min(z, s)`` in one scan, plus the state at ``s`` if ``s < z`` (done);
    otherwise it steps back past the composed chunks and reads the next window (or waits at ``z``).
    """
    run_a = tl.full(offs.shape, 1.0, tl.float32)  # map from the looked-at point to this chunk's start
    run_b = tl.zeros(offs.shape, tl.float32)
    back = tl.arange(0, WINDOW)  # flag i: the chunk i steps back from the window's newest chunk j
    dist = WINDOW - 1 - back  # tile row r (oldest first, so the scan composes in time order): dist steps back
    j = pos - 1
    while j >= 0:
        chunk = j - back
        flags = tl.atomic_add(FLAGS + tl.maximum(chunk, 0) * n_chains + chain, 0, sem="acquire")  # +0: a read
        flags = tl.where(chunk >= 0, flags, STATE_READY)  # before the sequence: the known state 0
        tl.debug_barrier()  # every thread's loads below come after every thread's acquire above
        z = tl.min(tl.where(flags == 0, back, WINDOW), 0)  # nearest chunk not yet published
        s = tl.min(tl.where(flags == STATE_READY, back, WINDOW), 0)  # nearest known state
        row_map = (dist < z) & (dist < s)
        row_state = (dist == s) & (dist < z) & (j - dist >= 0)  # s < z: a state before any gap
        ptrs = (((j - dist) * n_chains + chain) * offs.shape[0])[:, None] + offs[None, :]
        a = tl.load(AGG_A + ptrs, mask=row_map[:, None], other=1.0, volatile=True)
        b = tl.load(AGG_B + ptrs, mask=row_map[:, None], other=0.0, volatile=True)
        state = tl.load(INCL + ptrs, mask=row_state[:, None], other=0.0, volatile=True)
        a = tl.where(row_state[:, None], 0.0, a)  # a known state is the constant map h -> state
        b = tl.where(row_state[:, None], state, b)
        a, b = tl.associative_scan((a, b), 0, _compose)
        run_b += run_a * _last_row(b, WINDOW)
        run_a *= _last_row(a, WINDOW)
        j = tl.where(s < z, -1, j - z)  # done, or step back past the composed maps (0 steps: wait)
    return run_b  # applied to the zero state before the sequence, or to the known state found


@triton.jit
def _chunk_state_in(a_last, b_last, AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains,
                    BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr):
    """Steps 3-5 for a chunk whose whole map is ``(a_last, b_last)``: publish it, look back, publish the
    inclusive state; returns the state entering the chunk."""
    vec = tl.arange(0, BLOCK_C)
    slot = pos * n_chains + chain
    if pos > 0:
        tl.store(AGG_A + slot * BLOCK_C + vec, a_last)  # publish the chunk's map
        tl.store(AGG_B + slot * BLOCK_C + vec, b_last)
        _publish(FLAGS, slot, MAP_READY)
    h_in = _look_back(AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, vec, WINDOW)
    if pos % INCLUSIVE_EVERY == 0:  # publish the state at the chunk's end
        tl.store(INCL + slot * BLOCK_C + vec, a_last * h_in + b_last)
        _publish(FLAGS, slot, STATE_READY)
    return h_in


@triton.jit(do_not_specialize=["N", "C", "n_chains", "n_cblk"])
def _scan_fwd(
    X, G, H, AGG_A, AGG_B, INCL, FLAGS, TICKETS, N, C, n_chains, n_cblk, stride_b, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr,
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
    h_in = _chunk_state_in(_last_row(a, BLOCK_T), _last_row(b, BLOCK_T), AGG_A, AGG_B, INCL, FLAGS, pos,
                           chain, n_chains, BLOCK_C, INCLUSIVE_EVERY, WINDOW)
    tl.store(H + ptrs, (a * h_in[None, :] + b).to(H.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "C", "n_chains", "n_cblk"])
def _scan_bwd(
    X, G, H, DH, DX, DG, AGG_A, AGG_B, INCL, FLAGS, TICKETS, N, C, n_chains, n_cblk, stride_b, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr,
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
    g = tl.load(G + ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + ptrs, mask=mask, other=0.0).to(tl.float32)
    has_prev = (valid & (offs_t >= 1))[:, None] & in_c[None, :]
    h_prev = tl.load(H + ptrs - stride_t, mask=has_prev, other=0.0).to(tl.float32)
    a = tl.where(valid[:, None], g_next, 1.0)  # padding rows: identity maps
    a, b = tl.associative_scan((a, dh), 0, _compose)
    lam_in = _chunk_state_in(_last_row(a, BLOCK_T), _last_row(b, BLOCK_T), AGG_A, AGG_B, INCL, FLAGS, pos,
                             chain, n_chains, BLOCK_C, INCLUSIVE_EVERY, WINDOW)
    lam = a * lam_in[None, :] + b
    tl.store(DX + ptrs, ((1.0 - g) * lam).to(DX.dtype.element_ty), mask=mask)
    tl.store(DG + ptrs, (lam * (h_prev - x)).to(DG.dtype.element_ty), mask=mask)


@triton.jit
def _in_row(offs_c, C, row_ok):
    """Channels ``offs_c`` that exist in a row the scalar ``row_ok`` admits (one comparison, no scalar-and-
    vector ``&``, which the interpreter mistypes)."""
    return offs_c < tl.where(row_ok, C, 0)


@triton.jit(do_not_specialize=["N", "C", "n_chains", "n_cblk"])
def _scan_fwd_loop(
    X, G, H, AGG_A, AGG_B, INCL, FLAGS, TICKETS, N, C, n_chains, n_cblk, stride_b, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr,
):
    """The forward with the chunk walked row by row (unrolled): no tile scan, no cross-thread work.
    Pass 1 folds the rows into the chunk's map; after the look-back, pass 2 re-reads the rows (cache
    hits: the same program just read them) and writes ``h``."""
    chain = tl.program_id(0) % n_chains
    pos = tl.atomic_add(TICKETS + chain, 1)
    offs_c = (chain % n_cblk) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = (chain // n_cblk).to(tl.int64) * stride_b + offs_c
    a = tl.full((BLOCK_C,), 1.0, tl.float32)
    b = tl.zeros((BLOCK_C,), tl.float32)
    for i in tl.static_range(BLOCK_T):
        t = pos * BLOCK_T + i
        ptrs = base + t.to(tl.int64) * stride_t
        g = tl.load(G + ptrs, mask=_in_row(offs_c, C, t < N), other=1.0).to(tl.float32)
        x = tl.load(X + ptrs, mask=_in_row(offs_c, C, t < N), other=0.0).to(tl.float32)
        a, b = _compose(a, b, g, (1.0 - g) * x)
    h = _chunk_state_in(a, b, AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, BLOCK_C, INCLUSIVE_EVERY,
                        WINDOW)
    for i in tl.static_range(BLOCK_T):
        t = pos * BLOCK_T + i
        ptrs = base + t.to(tl.int64) * stride_t
        g = tl.load(G + ptrs, mask=_in_row(offs_c, C, t < N), other=1.0).to(tl.float32)
        x = tl.load(X + ptrs, mask=_in_row(offs_c, C, t < N), other=0.0).to(tl.float32)
        h = g * h + (1.0 - g) * x
        tl.store(H + ptrs, h.to(H.dtype.element_ty), mask=_in_row(offs_c, C, t < N))


@triton.jit(do_not_specialize=["N", "C", "n_chains", "n_cblk"])
def _scan_bwd_loop(
    X, G, H, DH, DX, DG, AGG_A, AGG_B, INCL, FLAGS, TICKETS, N, C, n_chains, n_cblk, stride_b, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr,
):
    """The backward walked row by row, latest row first, like :func:`_scan_fwd_loop`."""
    chain = tl.program_id(0) % n_chains
    pos = tl.atomic_add(TICKETS + chain, 1)  # counted from the end
    offs_c = (chain % n_cblk) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = (chain // n_cblk).to(tl.int64) * stride_b + offs_c
    a = tl.full((BLOCK_C,), 1.0, tl.float32)
    b = tl.zeros((BLOCK_C,), tl.float32)
    for i in tl.static_range(BLOCK_T):
        t = N - 1 - pos * BLOCK_T - i
        ptrs = base + t.to(tl.int64) * stride_t
        dh = tl.load(DH + ptrs, mask=_in_row(offs_c, C, t >= 0), other=0.0).to(tl.float32)
        g_next = tl.load(G + ptrs + stride_t, mask=_in_row(offs_c, C, (t >= 0) & (t + 1 < N)),
                         other=0.0).to(tl.float32)
        a, b = _compose(a, b, tl.where(t >= 0, g_next, 1.0), dh)  # rows before the sequence: identities
    lam = _chunk_state_in(a, b, AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, BLOCK_C, INCLUSIVE_EVERY,
                          WINDOW)
    for i in tl.static_range(BLOCK_T):
        t = N - 1 - pos * BLOCK_T - i
        ptrs = base + t.to(tl.int64) * stride_t
        valid = _in_row(offs_c, C, t >= 0)
        dh = tl.load(DH + ptrs, mask=valid, other=0.0).to(tl.float32)
        g_next = tl.load(G + ptrs + stride_t, mask=_in_row(offs_c, C, (t >= 0) & (t + 1 < N)),
                         other=0.0).to(tl.float32)
        lam = g_next * lam + dh
        g = tl.load(G + ptrs, mask=valid, other=0.0).to(tl.float32)
        x = tl.load(X + ptrs, mask=valid, other=0.0).to(tl.float32)
        h_prev = tl.load(H + ptrs - stride_t, mask=_in_row(offs_c, C, t >= 1), other=0.0).to(tl.float32)
        tl.store(DX + ptrs, ((1.0 - g) * lam).to(DX.dtype.element_ty), mask=valid)
        tl.store(DG + ptrs, (lam * (h_prev - x)).to(DG.dtype.element_ty), mask=valid)


class ScanConfig(NamedTuple):
    """One launch: chunk rows, channels per chain, warps, pipeline stages, and how a chunk is scanned:
    ``"tile"`` (load the ``[block_t, block_c]`` tile, ``tl.associative_scan`` it) or ``"loop"`` (walk its
    rows one by one, twice)."""

    block_t: int
    block_c: int
    num_warps: int = 4
    num_stages: int = 1
    method: str = "loop"


KERNELS = {"tile": ("_scan_fwd", "_scan_bwd"), "loop": ("_scan_fwd_loop", "_scan_bwd_loop")}


def _launch(direction, tensors, B, N, C, config):
    """Allocate the per-chunk vectors, flags (0) and tickets (0); run the kernel over every (chunk, chain)."""
    cfg = ScanConfig(*(config or DEFAULT_CONFIG))
    if cfg.method not in KERNELS:
        raise ValueError(f"scan method must be one of {sorted(KERNELS)}, got {cfg.method!r}")
    tile_rows = cfg.method == "tile"  # the loop kernel unrolls any number of rows; tl.arange needs 2**k
    for name, size, pow2 in (("block_t", cfg.block_t, tile_rows), ("block_c", cfg.block_c, True)):
        if not isinstance(size, int) or size < 1 or (pow2 and size & (size - 1)):
            kind = "power of two" if pow2 else "positive int"
            raise ValueError(f"scan {name} must be a {kind}, got {size!r}")
    kernel = globals()[KERNELS[cfg.method][direction]]
    n_cblk = triton.cdiv(C, cfg.block_c)
    n_chains, n_chunks = B * n_cblk, triton.cdiv(N, cfg.block_t)
    dev = tensors[0].device
    vecs = torch.empty((3, n_chunks * n_chains * cfg.block_c), device=dev, dtype=torch.float32)
    counters = torch.zeros(n_chunks * n_chains + n_chains, device=dev, dtype=torch.int32)
    flags, tickets = counters[: n_chunks * n_chains], counters[n_chunks * n_chains:]
    kernel[(n_chunks * n_chains,)](*tensors, vecs[0], vecs[1], vecs[2], flags, tickets, N, C, n_chains,
                                   n_cblk, tensors[0].stride(0), tensors[0].stride(1), BLOCK_T=cfg.block_t,
                                   BLOCK_C=cfg.block_c, INCLUSIVE_EVERY=_INCLUSIVE_EVERY,
                                   WINDOW=LOOK_BACK_WINDOW, num_warps=cfg.num_warps,
                                   num_stages=cfg.num_stages)


def scan_forward(x: torch.Tensor, g: torch.Tensor, config=None) -> torch.Tensor:
    """``h`` for contiguous ``x, g [B, N, C]`` (no autograd)."""
    B, N, C = x.shape
    h = torch.empty_like(x)
    if h.numel():
        _launch(0, (x, g, h), B, N, C, config)
    return h


def scan_backward(x, g, h, dh, config=None):
    """``(dx, dg)`` for contiguous ``[B, N, C]`` tensors, from the saved output ``h``."""
    B, N, C = x.shape
    dh = dh.contiguous()
    dx, dg = torch.empty_like(x), torch.empty_like(g)
    if dx.numel():
        _launch(1, (x, g, h, dh, dx, dg), B, N, C, config)
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
    ``[before dim, N, after dim]`` (made contiguous if it is not). ``config`` overrides the launch: a
    :class:`ScanConfig` or a tuple of its fields, powers of two for the blocks.
    """
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {x.dtype} is not supported by the triton scan; use fp16, bf16 or fp32")
    shape = x.shape
    N = shape[dim]
    B = shape[:dim].numel()
    view = (B, N, x.numel() // max(1, B * N))
    h = GatedScanFunction.apply(x.contiguous().view(view), g.contiguous().view(view), config)
    return h.view(shape)
