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

Chunks chained by a look-back (the forward kernel)
--------------------------------------------------
Memory layout ``[B, N, C]`` with channels contiguous. A *chain* is ``BLOCK_C`` channels of one batch row;
time is cut into chunks of ``BLOCK_T`` steps. Programs serve one chain each (``program_id % chains``) and
take its chunks by *ticket*: ``pos = atomic_add(counter[chain], 1)`` is the next chunk index along the
chain. Tickets are handed out in the order programs ask, and a program holds one until it has finished
that chunk, so every chunk before ``pos`` is finished or being worked on by a running program: nobody
waits on a chunk that no one runs. By default there is one program per chunk (one ticket each); with
``programs_per_sm`` set, a fixed number of programs (about that many per multiprocessor) each walks
ticket after ticket until its chain runs out (a *persistent* launch). For one chunk a program:

1. scans its ``[BLOCK_T, BLOCK_C]`` rows into the chunk's map ``(A, B)`` from the state before the chunk
   to the state at its end (below);
2. finds the state entering the chunk. Fast path: if the previous chunk's *inclusive* state (the true
   ``h`` at its end) is already published, take it. Otherwise publish the chunk's map and *look back*:
   walking to earlier chunks, compose their published maps until one with a published inclusive state,
   or the start of the sequence (state 0). Chunks publish maps as soon as their rows are scanned, so the
   walk rarely waits for long (the "decoupled look-back" of single-pass GPU scans; the fast path saves a
   map store and a release fence whenever the chain's states keep up);
3. publishes its own inclusive state ``A h_in + B``, then writes ``h_t`` for its rows.

Publishing is a flag per (chunk, chain): 0 nothing yet, 1 map published, 2 inclusive state published.
A writer stores the vector(s), synchronizes its threads, then one thread sets the flag with a *release*
atomic; a reader reads the flag with an *acquire* atomic (one scalar, the same for every thread), and
only then loads the vectors it announces, bypassing the L1 cache. Every decision to take the fast path,
stop or step back is thus uniform across the program's threads (data used as its own flag would not be:
threads holding copies of the same element could disagree). Rows beyond the chunk or the sequence load
``g = 1, x = 0``: the identity map. (Under the interpreter programs run one after another in ticket order
and never wait.) The constexpr ``INCLUSIVE_EVERY`` has every k-th chunk publish its inclusive state and
the others only their maps; every launch here uses 1, and a larger k makes later chunks compose maps,
the path a GPU takes whenever a predecessor is still running.

Scanning a chunk: rows in unrolled groups
-----------------------------------------
A chunk's rows are walked in two passes, each thread keeping the state of its ``BLOCK_C / (32 x warps)``
channels in registers: pass 1 folds the rows into ``(A, B)``; after step 2, pass 2 reads the rows again
and writes ``h``. Each pass is a runtime loop over groups of ``UNROLL`` rows (``unroll``, capped at
``BLOCK_T``; the last group of a chunk may overrun it: rows past the chunk's end are identities and are
not written); a group issues all of its loads before it uses any (the loads are independent of the
state, so their memory latencies overlap) and then folds or writes its rows one by one. The compiled
code holds one group's worth of rows per pass whatever ``BLOCK_T`` is, so long chunks compile quickly.
Pass 1 asks the L2 cache to keep the rows (``evict_last``) and pass 2 lets them go (``evict_first``, and
the outputs are streamed the same way): pass 2's reads are cheap only while the rows that all running
programs have read but not yet re-read fit in L2, which is what a persistent launch with few programs
bounds (an unbounded launch holds about ``resident programs x chunk bytes``).

What limits the speed. Per chunk there is a fixed cost: a ticket, one acquire read (fast path) or a map
publish and a look-back, and one state publish (a release fence each). And along a chain states resolve
in order: a look-back round (flag reads, then map loads: two trips to L2) settles at most ``WINDOW``
chunks, so a chain's ``N / BLOCK_T`` chunks take about ``N / (BLOCK_T x WINDOW)`` rounds one after
another. Long chunks shorten that chain; a wide window shortens it too but its ``[WINDOW, BLOCK_C]`` map
tiles are most of the kernel's registers, hence a launch parameter.

Backward
--------
With ``dh`` the gradient of the outputs, the gradient reaching ``h_t`` (from ``dh_t`` and through every
later step) runs backward in time with the *next* step's gate::

    lam_t = dh_t + g_{t+1} * lam_{t+1},     lam_{N-1} = dh_{N-1},
    dx_t  = (1 - g_t) * lam_t,
    dg_t  = lam_t * (h_{t-1} - x_t).

``lam`` is the same kind of scan, run from the end: ticket ``pos`` is the ``pos``-th chunk *from the end*,
its rows are walked latest first, so the forward combine and the same look-back apply unchanged. It
reads the saved output ``h`` shifted by one step for ``h_{t-1}``.

Precision: the state and all arithmetic are fp32 whatever the input dtype; outputs and gradients are
stored in the input dtype. Under ``TRITON_INTERPRET=1`` (CPU) the kernels run through numpy.

Launch settings are a :class:`~.tuning.ScanConfig` (``block_m`` rows per chunk, ``block_n`` channels per
chain, warps, stages, ``unroll``, ``window``, ``programs_per_sm``); the default is ``tuning.SCAN``.

Both directions run as ``torch.library`` custom ops (``treeattn_lab::gated_scan_fwd`` / ``_bwd``, the
backward registered as the forward's autograd) with fake implementations, so ``torch.compile`` traces a
model that calls the scan.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import tuning
from .tuning import ScanConfig

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Flag values per (chunk, chain).
MAP_READY = tl.constexpr(1)
STATE_READY = tl.constexpr(2)


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
def _state_published(FLAGS, slot):
    """Whether ``slot``'s inclusive state is published: one acquire read of its flag (a scalar, so every
    thread of the program gets the same answer), then a barrier so that no thread loads the state first."""
    flag = tl.atomic_add(FLAGS + slot, 0, sem="acquire")  # +0: a read
    tl.debug_barrier()
    return flag == STATE_READY


@triton.jit
def _in_row(offs_c, C, row_ok):
    """The mask ``offs_c < C`` where the scalar ``row_ok`` holds, else all false: the existing channels of
    a row that may not exist (one comparison, no scalar-and-vector ``&``, which the interpreter mistypes)."""
    return offs_c < tl.where(row_ok, C, 0)


@triton.jit
def _look_back(AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, offs, WINDOW: tl.constexpr):
    """The state entering chunk ``pos`` of ``chain``: compose earlier chunks' maps back to a known state.

    Reads the flags of ``WINDOW`` predecessors at once (newest first, one acquire per flag). With ``z``
    the nearest not-yet-published chunk and ``s`` the nearest with its inclusive state, it composes the
    maps of the chunks before ``min(z, s)`` in one scan, then applies them to the state at ``s`` if
    ``s < z`` (done); otherwise it steps back past the composed chunks and reads the next window (or waits
    at ``z``). The ``[WINDOW, BLOCK_C]`` map tiles are most of the kernel's registers.
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
        row_map = dist < tl.minimum(z, s)
        ptrs = (((j - dist) * n_chains + chain) * offs.shape[0])[:, None] + offs[None, :]
        a = tl.load(AGG_A + ptrs, mask=row_map[:, None], other=1.0, volatile=True)
        b = tl.load(AGG_B + ptrs, mask=row_map[:, None], other=0.0, volatile=True)
        a, b = tl.associative_scan((a, b), 0, _compose)
        run_b += run_a * _last_row(b, WINDOW)
        run_a *= _last_row(a, WINDOW)
        found = (s < z) & (j - s >= 0)  # a published state before any gap (not the zero before the start)
        state = tl.load(INCL + ((j - s) * n_chains + chain) * offs.shape[0] + offs,
                        mask=_in_row(offs, offs.shape[0], found), other=0.0, volatile=True)
        run_b += run_a * state  # 0 unless found: then the loop ends here
        j = tl.where(s < z, -1, j - z)  # done, or step back past the composed maps (0 steps: wait)
    return run_b  # applied to the zero state before the sequence, or to the known state found


@triton.jit
def _chunk_state_in(a_last, b_last, AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains,
                    BLOCK_C: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr):
    """Steps 2-3 for a chunk whose whole map is ``(a_last, b_last)``: the state entering the chunk (the
    predecessor's published state, or a look-back after publishing the map), then publish the inclusive
    state; returns the state entering the chunk.

    The fast path is only for chunks that publish their inclusive state: one that publishes nothing but
    its map (``INCLUSIVE_EVERY > 1``) must publish it, or its successors would wait forever."""
    vec = tl.arange(0, BLOCK_C)
    slot = pos * n_chains + chain
    prev = tl.maximum(slot - n_chains, 0)  # the same chain's previous chunk (clamped: unused for pos 0)
    publishes_state = pos % INCLUSIVE_EVERY == 0
    if (pos > 0) & publishes_state & _state_published(FLAGS, prev):
        h_in = tl.load(INCL + prev * BLOCK_C + vec, volatile=True)
    else:
        if pos > 0:
            tl.store(AGG_A + slot * BLOCK_C + vec, a_last)  # publish the chunk's map
            tl.store(AGG_B + slot * BLOCK_C + vec, b_last)
            _publish(FLAGS, slot, MAP_READY)
        h_in = _look_back(AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, vec, WINDOW)
    if publishes_state:  # publish the state at the chunk's end
        tl.store(INCL + slot * BLOCK_C + vec, a_last * h_in + b_last)
        _publish(FLAGS, slot, STATE_READY)
    return h_in


# ------------------------------------------------------------------------- a chunk's rows in unrolled groups
@triton.jit
def _row_at(PTR, base, offs_c, C, stride_t, t, lo, hi):
    """Pointers to row ``t`` of the chain at ``PTR + base`` (channels ``offs_c``) and the mask of its
    existing channels: none unless ``lo <= t < hi``."""
    return PTR + base + tl.cast(t, tl.int64) * stride_t, _in_row(offs_c, C, (t >= lo) & (t < hi))


@triton.jit
def _rows(PTR, base, offs_c, C, stride_t, first, STEP: tl.constexpr, lo, hi, other, UNROLL: tl.constexpr,
          EVICT: tl.constexpr):
    """Rows ``first, first + STEP, ..`` (``UNROLL`` of them) of the chain at ``PTR + base``, as a tuple of
    ``[BLOCK_C]`` vectors in ``PTR``'s dtype; a row outside ``[lo, hi)`` reads ``other``.

    Every load is issued before the caller uses any value, so the group's memory latencies overlap
    (the values stay in the input dtype until used: half the registers for fp16/bf16)."""
    rows = ()
    for i in tl.static_range(UNROLL):
        ptrs, mask = _row_at(PTR, base, offs_c, C, stride_t, first + STEP * i, lo, hi)
        rows = rows + (tl.load(ptrs, mask=mask, other=other, eviction_policy=EVICT),)
    return rows


@triton.jit
def _store_row(PTR, base, offs_c, C, stride_t, t, lo, hi, value):
    """Store fp32 ``value`` as row ``t`` of the chain at ``PTR + base`` (in ``PTR``'s dtype), if ``lo <= t <
    hi``; marked first to leave the L2 cache (``evict_first``): nothing reads it soon."""
    ptrs, mask = _row_at(PTR, base, offs_c, C, stride_t, t, lo, hi)
    tl.store(ptrs, value.to(PTR.dtype.element_ty), mask=mask, eviction_policy="evict_first")


@triton.jit
def _fwd_loop_chunk(X, G, H, AGG_A, AGG_B, INCL, FLAGS, pos, chain, N, C, n_chains, n_cblk, stride_b,
                    stride_t, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
                    INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr):
    """Forward chunk ``pos`` of ``chain``, rows ``[start, end)`` walked in groups of ``UNROLL``: pass 1
    folds them into the chunk's map, pass 2 re-reads them (from L2, if they are still there) and writes
    ``h``. Rows past ``end`` in the last group are identities and are not written."""
    offs_c = (chain % n_cblk) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = (chain // n_cblk).to(tl.int64) * stride_b + offs_c
    start = pos * BLOCK_T
    end = tl.minimum(start + BLOCK_T, N)
    a = tl.full((BLOCK_C,), 1.0, tl.float32)
    b = tl.zeros((BLOCK_C,), tl.float32)
    for first in tl.range(start, end, UNROLL):
        g = _rows(G, base, offs_c, C, stride_t, first, 1, start, end, 1.0, UNROLL, "evict_last")
        x = _rows(X, base, offs_c, C, stride_t, first, 1, start, end, 0.0, UNROLL, "evict_last")
        for i in tl.static_range(UNROLL):
            g_i = g[i].to(tl.float32)
            a, b = _compose(a, b, g_i, (1.0 - g_i) * x[i].to(tl.float32))
    h = _chunk_state_in(a, b, AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, BLOCK_C, INCLUSIVE_EVERY,
                        WINDOW)
    for first in tl.range(start, end, UNROLL):
        g = _rows(G, base, offs_c, C, stride_t, first, 1, start, end, 1.0, UNROLL, "evict_first")
        x = _rows(X, base, offs_c, C, stride_t, first, 1, start, end, 0.0, UNROLL, "evict_first")
        for i in tl.static_range(UNROLL):
            g_i = g[i].to(tl.float32)
            h = g_i * h + (1.0 - g_i) * x[i].to(tl.float32)
            _store_row(H, base, offs_c, C, stride_t, first + i, start, end, h)


@triton.jit
def _bwd_loop_chunk(X, G, H, DH, DX, DG, AGG_A, AGG_B, INCL, FLAGS, pos, chain, N, C, n_chains, n_cblk,
                    stride_b, stride_t, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
                    INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr):
    """Backward chunk ``pos`` (counted from the end): rows ``[lo, hi)`` walked latest first in groups of
    ``UNROLL``, two passes like :func:`_fwd_loop_chunk`.

    ``g_{t+1}`` is read through ``G`` shifted one row (missing for ``t = N - 1``: read as 1, which
    multiplies the zero state after the sequence), ``h_{t-1}`` through ``H`` shifted back one row (0 for
    ``t = 0``). Rows below ``lo`` read ``g_{t+1} = 1, dh = 0``: identities."""
    offs_c = (chain % n_cblk) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = (chain // n_cblk).to(tl.int64) * stride_b + offs_c
    hi = N - pos * BLOCK_T
    lo = tl.maximum(hi - BLOCK_T, 0)
    next_hi = tl.minimum(hi, N - 1)  # rows that have a next gate
    a = tl.full((BLOCK_C,), 1.0, tl.float32)
    b = tl.zeros((BLOCK_C,), tl.float32)
    for k in tl.range(0, hi - lo, UNROLL):
        first = hi - 1 - k
        dh = _rows(DH, base, offs_c, C, stride_t, first, -1, lo, hi, 0.0, UNROLL, "evict_last")
        g_next = _rows(G + stride_t, base, offs_c, C, stride_t, first, -1, lo, next_hi, 1.0, UNROLL,
                       "evict_last")
        for i in tl.static_range(UNROLL):
            a, b = _compose(a, b, g_next[i].to(tl.float32), dh[i].to(tl.float32))
    lam = _chunk_state_in(a, b, AGG_A, AGG_B, INCL, FLAGS, pos, chain, n_chains, BLOCK_C, INCLUSIVE_EVERY,
                          WINDOW)
    for k in tl.range(0, hi - lo, UNROLL):
        first = hi - 1 - k
        dh = _rows(DH, base, offs_c, C, stride_t, first, -1, lo, hi, 0.0, UNROLL, "evict_first")
        g_next = _rows(G + stride_t, base, offs_c, C, stride_t, first, -1, lo, next_hi, 1.0, UNROLL,
                       "evict_first")
        g = _rows(G, base, offs_c, C, stride_t, first, -1, lo, hi, 0.0, UNROLL, "evict_first")
        x = _rows(X, base, offs_c, C, stride_t, first, -1, lo, hi, 0.0, UNROLL, "evict_first")
        h_prev = _rows(H - stride_t, base, offs_c, C, stride_t, first, -1, tl.maximum(lo, 1), hi, 0.0, UNROLL,
                       "evict_first")
        for i in tl.static_range(UNROLL):
            lam = g_next[i].to(tl.float32) * lam + dh[i].to(tl.float32)
            _store_row(DX, base, offs_c, C, stride_t, first - i, lo, hi, (1.0 - g[i].to(tl.float32)) * lam)
            _store_row(DG, base, offs_c, C, stride_t, first - i, lo, hi,
                       lam * (h_prev[i].to(tl.float32) - x[i].to(tl.float32)))


# ------------------------------------------------------------------------------ kernels: the ticket walk
@triton.jit(do_not_specialize=["N", "n_chains", "n_cblk", "n_chunks"])
def _scan_fwd(
    X, G, H, AGG_A, AGG_B, INCL, FLAGS, TICKETS, N, C, n_chains, n_cblk, n_chunks, stride_b, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr, INCLUSIVE_EVERY: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Serve one chain: take its next ticket and scan that chunk until the chain's chunks run out."""
    chain = tl.program_id(0) % n_chains
    pos = tl.atomic_add(TICKETS + chain, 1)
    while pos < n_chunks:
        _fwd_loop_chunk(X, G, H, AGG_A, AGG_B, INCL, FLAGS, pos, chain, N, C, n_chains, n_cblk, stride_b,
                        stride_t, BLOCK_T, BLOCK_C, UNROLL, INCLUSIVE_EVERY, WINDOW)
        pos = tl.atomic_add(TICKETS + chain, 1)


@triton.jit(do_not_specialize=["N", "n_chains", "n_cblk", "n_chunks"])
def _scan_bwd(
    X, G, H, DH, DX, DG, AGG_A, AGG_B, INCL, FLAGS, TICKETS, N, C, n_chains, n_cblk, n_chunks, stride_b,
    stride_t, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
    INCLUSIVE_EVERY: tl.constexpr, WINDOW: tl.constexpr,
):
    """The backward ticket walk (tickets count chunks from the end), like :func:`_scan_fwd`."""
    chain = tl.program_id(0) % n_chains
    pos = tl.atomic_add(TICKETS + chain, 1)
    while pos < n_chunks:
        _bwd_loop_chunk(X, G, H, DH, DX, DG, AGG_A, AGG_B, INCL, FLAGS, pos, chain, N, C, n_chains, n_cblk,
                        stride_b, stride_t, BLOCK_T, BLOCK_C, UNROLL, INCLUSIVE_EVERY, WINDOW)
        pos = tl.atomic_add(TICKETS + chain, 1)


def _checked_config(config) -> ScanConfig:
    """``config``: a :class:`~.tuning.ScanConfig` (checked when it was made), or None for ``tuning.SCAN``."""
    if config is None:
        return tuning.SCAN
    if type(config) is not ScanConfig:
        raise TypeError(f"config must be a treeattn_lab.kernels.tuning.ScanConfig or None, got "
                        f"{type(config).__name__} {config!r}")
    return config


def _num_programs(cfg: ScanConfig, n_chains: int, n_chunks: int, device: torch.device) -> int:
    """One program per chunk, or for a persistent launch about ``programs_per_sm`` per multiprocessor
    (one on the CPU), shared equally by the chains, at most one per chunk."""
    if cfg.programs_per_sm == 0:
        return n_chunks * n_chains
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    per_chain = max(1, cfg.programs_per_sm * sms // n_chains)
    return n_chains * min(per_chain, n_chunks)


def _launch(direction, tensors, B, N, C, config):
    """Allocate the per-chunk vectors, flags (0) and tickets (0); run the ticket walk over every chain."""
    cfg = _checked_config(config)
    n_cblk = triton.cdiv(C, cfg.block_n)
    n_chains, n_chunks = B * n_cblk, triton.cdiv(N, cfg.block_m)
    dev = tensors[0].device
    vecs = torch.empty((3, n_chunks * n_chains * cfg.block_n), device=dev, dtype=torch.float32)
    counters = torch.zeros(n_chunks * n_chains + n_chains, device=dev, dtype=torch.int32)
    flags, tickets = counters[: n_chunks * n_chains], counters[n_chunks * n_chains:]
    kernel = (_scan_fwd, _scan_bwd)[direction]
    kernel[(_num_programs(cfg, n_chains, n_chunks, dev),)](
        *tensors, vecs[0], vecs[1], vecs[2], flags, tickets, N, C, n_chains, n_cblk, n_chunks,
        tensors[0].stride(0), tensors[0].stride(1), BLOCK_T=cfg.block_m, BLOCK_C=cfg.block_n,
        UNROLL=min(cfg.unroll, cfg.block_m), INCLUSIVE_EVERY=1, WINDOW=cfg.window, num_warps=cfg.num_warps,
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


# The custom ops (module docstring); the launch travels as the config's fields in order.
def _config_ints(config) -> list[int]:
    return [int(x) for x in dataclasses.astuple(_checked_config(config))]


def _config_of(ints) -> ScanConfig:
    fields = list(ints)
    fields[4] = bool(fields[4])  # tma
    return ScanConfig(*fields)


@torch.library.custom_op("treeattn_lab::gated_scan_fwd", mutates_args=())
def gated_scan_fwd(x: torch.Tensor, g: torch.Tensor, config: list[int]) -> torch.Tensor:
    """``h`` of contiguous ``x, g [B, N, C]`` (:func:`scan_forward`); ``config``: :func:`_config_ints`."""
    return scan_forward(x, g, _config_of(config))


@gated_scan_fwd.register_fake
def _(x, g, config):
    return torch.empty_like(x)


@torch.library.custom_op("treeattn_lab::gated_scan_bwd", mutates_args=())
def gated_scan_bwd(x: torch.Tensor, g: torch.Tensor, h: torch.Tensor, dh: torch.Tensor, config: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dg)`` of :func:`scan_backward`."""
    return scan_backward(x, g, h, dh, _config_of(config))


@gated_scan_bwd.register_fake
def _(x, g, h, dh, config):
    return torch.empty_like(x), torch.empty_like(g)


def _scan_setup_context(ctx, inputs, output):
    x, g, config = inputs
    ctx.save_for_backward(x, g, output)
    ctx.config = config


def _scan_backward(ctx, dh):
    x, g, h = ctx.saved_tensors
    dx, dg = gated_scan_bwd(x, g, h, dh, ctx.config)
    return dx, dg, None


gated_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup_context)


def triton_gated_scan(x: torch.Tensor, g: torch.Tensor, *, dim: int = 0, config=None) -> torch.Tensor:
    """The recurrence along ``dim`` of ``x`` and ``g`` (same shape), with the Triton kernels.

    Inputs are already validated by ``treeattn_lab.ops.gated_scan``. The tensor is viewed as
    ``[before dim, N, after dim]`` (made contiguous if it is not). ``config`` overrides the launch with a
    :class:`~.tuning.ScanConfig`.
    """
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {x.dtype} is not supported by the triton scan; use fp16, bf16 or fp32")
    shape = x.shape
    N = shape[dim]
    B = shape[:dim].numel()
    view = (B, N, x.numel() // max(1, B * N))
    h = gated_scan_fwd(x.contiguous().view(view), g.contiguous().view(view), _config_ints(config))
    return h.view(shape)
