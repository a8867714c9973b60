"""``python -m treeattn_lab.bench.ring``: sparse ring attention equals one-device attention, and timings.

On GPUs, under torchrun (NCCL)::

    torchrun --nproc-per-node 2 -m treeattn_lab.bench.ring --tokens 262144 --out results/

checks the ring's output and gradients against the single-GPU kernel on the same inputs and times both
(forward and forward + backward), writing ``sparse-ring__*.json``; ``--profile`` also writes each rank's
chrome trace and GPU timeline. Each row also holds every rank's **steps** (:func:`step_times`): the
rank's ring steps run one after another on its own device without communication, each step's kernels
and merges timed, so ``per_tile_vs_single`` (the slowest rank's kernel time per tile over the one-device
kernel's) and the merge costs show what the ring adds besides transfers. ``--steps-world K`` times the
steps of every rank of a K-rank ring instead (on one GPU: what K GPUs would each run).

On CPUs (gloo; the tests spawn ranks through :func:`run_spawned`)
:func:`check_equivalence` compares against the einops reference, and can make one rank pass inputs that
disagree with its peers' (``rank_faults``) to check that every rank then raises.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.cpu_ranks import run_cases, spawn
from ..distributed.layouts import LAYOUTS, shard
from ..distributed.ring import STEP_BACKENDS, ring_plan, ring_sparse_attention
from ..distributed.simulate import simulate
from ..patterns.vertical_slash import BAR_PAD, VerticalSlashPattern, synthetic_pattern
from .harness import add_out_argument, choice_list, positive_int


def make_inputs(num_tokens, heads, kv_heads, dim, *, dtype, device, seed):
    """Seeded ``q, k, v, do`` of the whole sequence, identical on every rank (same device type)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(num_tokens, heads, dim), (num_tokens, kv_heads, dim), (num_tokens, kv_heads, dim),
              (num_tokens, heads, dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float32, device=device).to(dtype) for s in shapes]


def small_pattern(num_tokens, heads, block_size, seed) -> VerticalSlashPattern:
    """A random pattern with lines everywhere (far slashes too), so every ring step has work."""
    gen = torch.Generator().manual_seed(seed + 1)
    vertical = torch.randint(-1, num_tokens, (heads, 6), generator=gen)
    slash = torch.randint(-1, num_tokens, (heads, 4), generator=gen)
    slash[:, 0] = 0
    return VerticalSlashPattern(vertical, slash, block_size)


def check_equivalence(*, layout="striped", inner=None, backend="reference", tokens=192, heads=4, kv_heads=2,
                      dim=16, block_size=16, dtype=torch.float64, seed=0, group=None,
                      rank_faults: dict | None = None) -> dict:
    """This rank's largest errors of ring attention against the full-sequence reference (fwd and grads).

    ``rank_faults[rank]`` makes that rank disagree with its peers: ``{"layout": ...}`` passes another
    layout to the ring, ``{"pattern_seed": ...}`` another pattern of the same size, ``{"drop_row": True}``
    one token too few (a rank that rejects its own input)."""
    from ..reference.sparse import sparse_attention as reference_sparse_attention

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    faults = (rank_faults or {}).get(rank, {})
    device = torch.device("cpu")
    q, k, v, do = make_inputs(tokens, heads, kv_heads, dim, dtype=torch.float64, device=device, seed=seed)
    pattern = small_pattern(tokens, heads, block_size, seed)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = reference_sparse_attention(*full, pattern)
    out_ref.backward(do)
    local = [shard(x, layout, world, rank, block_size).to(dtype).requires_grad_() for x in (q, k, v)]
    inputs_before = [x.detach().clone() for x in local]
    ring_pattern = small_pattern(tokens, heads, block_size, faults.get("pattern_seed", seed))
    ring_inputs = [x[:-1] for x in local] if faults.get("drop_row") else local
    out = ring_sparse_attention(*ring_inputs, ring_pattern, num_tokens=tokens, inner=inner, group=group,
                                layout=faults.get("layout", layout), backend=backend)
    out.backward(shard(do, layout, world, rank, block_size).to(dtype))
    want = [out_ref] + [x.grad for x in full]
    got = [out] + [x.grad for x in local]
    errors = {}
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        w = shard(w.detach(), layout, world, rank, block_size)
        errors[name] = float((g.detach().double() - w).abs().max()) if g is not None else float("inf")
    errors["inputs_unchanged"] = all(torch.equal(a.detach(), b)
                                     for a, b in zip(local, inputs_before, strict=True))
    return errors


def run_spawned(world: int, cases: list[dict], *, timeout: float = 120.0) -> list[list[dict]]:
    """Run :func:`check_equivalence` for each case on ``world`` gloo ranks in fresh processes.

    Returns ``results[rank][case]``; raises RuntimeError naming the rank and case where one raised, and
    TimeoutError (after killing the ranks it started) when they do not finish within ``timeout`` seconds,
    so a hung ring never hangs the caller.
    """
    per_rank = spawn(world, run_cases, {"fn": check_equivalence, "cases": cases}, timeout_s=timeout,
                     collective_timeout_s=timeout)
    results = []
    for rank, outcome in enumerate(per_rank):
        failed = [(c, o) for c, o in enumerate(outcome["value"]) if not o["ok"]] if outcome["ok"] else []
        if not outcome["ok"] or failed:
            case, o = failed[0] if failed else ("-", outcome)
            raise RuntimeError(f"rank {rank} case {case}: {o['error']}: {o['message']}")
        results.append([o["value"] for o in outcome["value"]])
    return results


# ------------------------------------------------------------------------------- one rank's ring steps
def bar_columns(k, v, index):
    """The bar columns' keys and values ``[Hq, nb, D]`` of a whole sequence's ``k, v``: what the ring's
    all-reduce gathers (zeros in the padding)."""
    hq = index.num_heads
    if index.bar_pos is None:
        empty = k.new_zeros(hq, 0, k.shape[-1])
        return empty, empty
    pos = index.bar_pos.long()
    valid = pos != BAR_PAD
    kv_head = (torch.arange(hq, device=k.device) // (hq // k.shape[1]))[:, None].expand_as(pos)
    rows = torch.where(valid, pos, 0)
    return [torch.where(valid[..., None], x[rows, kv_head], 0) for x in (k, v)]


@torch.no_grad()
def step_times(q, k, v, do, pattern, *, layout: str, world: int, rank: int, backend: str = "triton",
               timer=None) -> dict:
    """Rank ``rank``'s steps of a ``world``-rank ring on this device, one after another and without
    communication (the keys of every origin are sharded from the whole sequence's ``k, v``).

    Per step: ``tiles`` (tile-equivalents, :func:`treeattn_lab.distributed.simulate.simulate`),
    ``fwd_ms`` (the kernel folding its tiles into the running fp32 state), ``fwd_merge_ms`` (that minus
    the same tiles into a fresh output: what merging costs; triton only), ``bwd_ms`` (dQ accumulated,
    dK/dV of the keys held) and ``bwd_merge_ms`` (adding the arriving dK/dV accumulator; 0 at the first
    backward step, which receives none). Also the totals, and for checking the rank's output ``out`` and
    ``dq`` (its dQ where ``timer`` runs each call once; :func:`.harness.time_ms`, the default on the
    inputs' device, repeats them, adding dQ again each time).
    """
    from .harness import time_ms

    timer = timer or (lambda fn: time_ms(fn, device=q.device))
    step = STEP_BACKENDS[backend]
    n, bs = q.shape[0], pattern.block_size
    plan = ring_plan(pattern, n, layout, rank, world)
    q_r, do_r = (shard(x, layout, world, rank, bs) for x in (q, do))
    origins = [plan.schedule.origin(rank, t) for t in range(world)]
    keys = [[shard(x, layout, world, o, bs) for x in (k, v)] for o in origins]
    bar_k, bar_v = bar_columns(k, v, plan.steps[0])
    tiles = simulate(pattern, n, world, layout).tiles[rank].tolist()
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    state = (torch.zeros(q_r.shape, device=q.device, dtype=acc),
             torch.full((q.shape[1], q_r.shape[0]), float("-inf"), device=q.device, dtype=acc))
    rows = []
    for t in range(world):  # the forward, merging every step into the state as the ring does
        args = (q_r, *keys[t], bar_k, bar_v, plan.steps[t], scale)
        scratch = tuple(x.clone() for x in state)
        row = {"step": t, "tiles": tiles[t], "fwd_ms": timer(partial(step.forward, *args, scratch))}
        if backend == "triton":
            from ..kernels.block_sparse import sparse_forward

            fresh = timer(partial(sparse_forward, *args[:6], scale=scale))
            row["fwd_merge_ms"] = row["fwd_ms"] - fresh
        step.forward(*args, state)
        rows.append(row)
    out = state[0].to(q.dtype)
    delta = step.delta(out, do_r)
    dq = torch.zeros(q_r.shape, device=q.device, dtype=acc)
    # dK, dV stacked as the ring keeps them; a merge adds the accumulator arriving from the next holder
    dkv, incoming = (torch.empty((2, *keys[0][0].shape), device=q.device, dtype=acc) for _ in range(2))
    for t in reversed(range(world)):  # the backward walks the ring in reverse
        args = (do_r, q_r, *keys[t], bar_k, bar_v, state[1], delta, plan.steps[t], scale, dq, dkv[0], dkv[1])
        rows[t]["bwd_ms"] = timer(partial(step.backward, *args))
        rows[t]["bwd_merge_ms"] = 0.0 if t == world - 1 else timer(partial(dkv.add_, incoming))
    keys = ("tiles", "fwd_ms", "fwd_merge_ms", "bwd_ms", "bwd_merge_ms")
    totals = {key: sum(r.get(key, 0.0) for r in rows) for key in keys}
    return {"rank": rank, "steps": rows, "totals": totals, "out": out, "dq": dq}


def per_tile_vs_single(ranks: list[dict], single: dict, pattern, num_tokens: int) -> dict:
    """The slowest rank's step kernel time per tile over the one-device kernel's (forward, and forward +
    backward): 1.0 means the ring's kernels run at the one-device per-tile speed."""
    single_tiles = float(simulate(pattern, num_tokens, 1, "contiguous").tiles.sum())
    fwd = max(r["totals"]["fwd_ms"] / r["totals"]["tiles"] for r in ranks if r["totals"]["tiles"])
    both = max((r["totals"]["fwd_ms"] + r["totals"]["bwd_ms"] + r["totals"]["bwd_merge_ms"])
               / r["totals"]["tiles"] for r in ranks if r["totals"]["tiles"])
    return {"per_tile_vs_single_fwd": fwd / (single["fwd_ms"] / single_tiles),
            "per_tile_vs_single_fwd_bwd": both / (single["fwd_bwd_ms"] / single_tiles)}


# ------------------------------------------------------------------------------------------ torchrun
def _timed(fn, reps: int, group) -> float:
    """Median ms of ``fn()`` across ranks in step (barrier before and after each run)."""
    for _ in range(2):
        fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    samples = []
    for _ in range(reps):
        dist.barrier(group)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        dist.barrier(group)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _profile(fn, rank: int, out: Path) -> None:
    """One profiled run of ``fn`` (after a barrier): kernels, NCCL and copies on this rank's GPU, as a
    chrome trace and as a compact GPU timeline (:func:`treeattn_lab.bench.trace.gpu_timeline`)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from .trace import gpu_timeline

    cuda = torch.cuda.is_available()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"sparse-ring-trace-rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    timeline = out / f"sparse-ring-timeline-rank{rank}.json"
    timeline.write_text(json.dumps(gpu_timeline(trace), indent=1) + "\n")
    if rank == 0:
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node K -m treeattn_lab.bench.ring",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=262144)
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--kv-heads", type=positive_int, default=16)
    parser.add_argument("--dim", type=positive_int, default=128)
    parser.add_argument("--layouts", type=choice_list(LAYOUTS), default=["striped", "zigzag", "contiguous"])
    parser.add_argument("--reps", type=positive_int, default=5)
    add_out_argument(parser)
    parser.add_argument("--high-priority", action="store_true",
                        help="NCCL on high-priority streams: transfers start ahead of queued kernel blocks")
    parser.add_argument("--steps-world", type=positive_int, default=None,
                        help="time the ring steps of every rank of a ring of this many ranks, spread over "
                             "this run's ranks (default: this run's world, each rank its own steps)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one fwd+bwd of the first layout: rank 0 prints its top GPU ops, "
                             "every rank writes a chrome trace and a GPU timeline next to the results")
    return parser.parse_args(argv)


def _init(high_priority: bool) -> tuple[int, int, torch.device]:
    """NCCL with one GPU per local rank (high-priority streams on request), else gloo."""
    cuda = torch.cuda.is_available()
    options = None
    if cuda and high_priority:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
    dist.init_process_group("nccl" if cuda else "gloo", pg_options=options)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def _single_device(q, k, v, do, pattern, device) -> tuple[list, dict]:
    """The one-device kernel's output and gradients, and its times (``fwd_ms``, ``fwd_bwd_ms``)."""
    from ..ops.sparse import sparse_attention
    from .harness import time_ms

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_single = sparse_attention(*full, pattern, backend="triton")
    out_single.backward(do)
    want = [out_single.detach()] + [x.grad.clone() for x in full]  # timing below reruns backward

    def single_fwd():
        with torch.no_grad():
            sparse_attention(*full, pattern, backend="triton")

    def single_fwd_bwd():
        sparse_attention(*full, pattern, backend="triton").backward(do)

    return want, {"fwd_ms": time_ms(single_fwd, device=device),
                  "fwd_bwd_ms": time_ms(single_fwd_bwd, grad_to_none=full, device=device)}


def _ring_layout(layout, inputs, want, pattern, *, rank, world, reps):
    """The ring under ``layout``: its largest relative errors over ranks and its times, and a callable
    running one forward + backward (to profile)."""
    q, k, v, do = inputs
    n, bs = q.shape[0], pattern.block_size
    local = [shard(x, layout, world, rank, bs).requires_grad_() for x in (q, k, v)]
    do_local = shard(do, layout, world, rank, bs)

    def ring_fwd():
        with torch.no_grad():
            ring_sparse_attention(*local, pattern, num_tokens=n, layout=layout)

    def ring_fwd_bwd():
        for x in local:
            x.grad = None
        ring_sparse_attention(*local, pattern, num_tokens=n, layout=layout).backward(do_local)

    ring_fwd_bwd()
    got = [ring_sparse_attention(*local, pattern, num_tokens=n, layout=layout).detach()]
    got += [x.grad for x in local]
    row = {"layout": layout}
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        w = shard(w, layout, world, rank, bs).float()
        e = torch.tensor([float((g.float() - w).norm() / w.norm().clamp_min(1e-30))], device=q.device)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        row[f"rel_err_{name}"] = float(e)
    row["ring_fwd_ms"] = _timed(ring_fwd, reps, None)
    row["ring_fwd_bwd_ms"] = _timed(ring_fwd_bwd, reps, None)
    return row, ring_fwd_bwd


def _steps_row(inputs, want, pattern, single, *, layout, rank, world, steps_world) -> dict:
    """Every rank's :func:`step_times` of a ``steps_world``-rank ring (each of this run's ranks times its
    share of them), gathered on every rank: the steps, the per-tile ratios and the largest relative error
    of the steps' outputs against the one-device kernel's."""
    q, k, v, do = inputs
    backend = "triton" if q.device.type == "cuda" else "reference"
    mine, err = [], 0.0
    for r in range(rank, steps_world, world):
        timed = step_times(q, k, v, do, pattern, layout=layout, world=steps_world, rank=r, backend=backend)
        w = shard(want[0], layout, steps_world, r, pattern.block_size).float()
        err = max(err, float((timed.pop("out").float() - w).norm() / w.norm().clamp_min(1e-30)))
        del timed["dq"]
        mine.append(timed)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"ranks": mine, "err": err})
    ranks = sorted((r for g in gathered for r in g["ranks"]), key=lambda r: r["rank"])
    merge_ms = max(r["totals"]["bwd_merge_ms"] for r in ranks) / max(1, steps_world - 1)
    return {"steps_world": steps_world, "steps": ranks, "steps_rel_err_out": max(g["err"] for g in gathered),
            **per_tile_vs_single(ranks, single, pattern, q.shape[0]), "bwd_merge_ms_per_step": merge_ms}


def _report(rows, *, world, args, dtype, pattern) -> None:
    from .harness import environment, print_table, write_results

    env = environment()
    env["world"] = world
    env["nccl_high_priority_streams"] = bool(args.high_priority)
    columns = [("layout", "layout"), ("tokens", "tokens"), ("single_fwd_bwd_ms", "1 GPU fwd+bwd ms"),
               ("ring_fwd_bwd_ms", f"ring x{world} fwd+bwd ms"), ("fwd_bwd_speedup", "fwd+bwd x 1 GPU"),
               ("fwd_speedup", "fwd x 1 GPU"), ("rel_err_out", "err out"), ("rel_err_dk", "err dk"),
               ("per_tile_vs_single_fwd", "fwd per tile x 1 GPU"),
               ("per_tile_vs_single_fwd_bwd", "fwd+bwd per tile x 1 GPU"),
               ("bwd_merge_ms_per_step", "dK/dV merge ms/step")]
    steps = f", steps of a {args.steps_world}-rank ring" if args.steps_world else ""
    print_table(f"sparse ring attention over {world} ranks, {env['device']}{steps}", columns, rows)
    path = write_results("sparse-ring", rows, env, directory=Path(args.out) if args.out else None,
                         extra={"dtype": str(dtype), "heads": args.heads, "head_dim": args.dim,
                                "pattern": repr(pattern)})
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = _parse_args(argv)
    import triton  # noqa: F401  (the GPU path needs it)

    rank, world, device = _init(args.high_priority)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = make_inputs(args.tokens, args.heads, args.kv_heads, args.dim, dtype=dtype, device=device, seed=0)
    pattern = synthetic_pattern(args.tokens, args.heads, device=device,
                                block_size=128 if device.type == "cuda" else 16)
    want, single = _single_device(*inputs, pattern, device)
    rows, profiled = [], []
    for layout in args.layouts:
        row, fwd_bwd = _ring_layout(layout, inputs, want, pattern, rank=rank, world=world, reps=args.reps)
        profiled.append(fwd_bwd)
        steps = _steps_row(inputs, want, pattern, single, layout=layout, rank=rank, world=world,
                           steps_world=args.steps_world or world)
        rows.append({"tokens": args.tokens, "world": world, "layout": layout,
                     "single_fwd_ms": single["fwd_ms"], "single_fwd_bwd_ms": single["fwd_bwd_ms"],
                     "ring_fwd_ms": row["ring_fwd_ms"], "ring_fwd_bwd_ms": row["ring_fwd_bwd_ms"],
                     "fwd_speedup": single["fwd_ms"] / row["ring_fwd_ms"],
                     "fwd_bwd_speedup": single["fwd_bwd_ms"] / row["ring_fwd_bwd_ms"],
                     **{k: v for k, v in row.items() if k.startswith("rel_err_")}, **steps})
    if rank == 0:
        _report(rows, world=world, args=args, dtype=dtype, pattern=pattern)
    if args.profile:  # after the results are written: a profiler failure cannot lose them
        _profile(profiled[0], rank, Path(args.out or "bench/results"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
