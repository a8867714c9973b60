"""``python -m treeattn_lab.bench.ring``: sparse ring attention equals one-device attention, and timings.

On GPUs, under torchrun (NCCL)::

    torchrun --nproc-per-node 2 -m treeattn_lab.bench.ring --tokens 262144 --out results/

checks the ring's output and gradients against the single-GPU kernel on the same inputs and times both
(forward and forward + backward), writing ``sparse-ring__*.json``; ``--profile`` also writes each rank's
chrome trace and GPU timeline. On CPUs (gloo; the tests spawn ranks through :func:`run_spawned`)
:func:`check_equivalence` compares against the einops reference, and can make one rank pass inputs that
disagree with its peers' (``rank_faults``) to check that every rank then raises.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.cpu_ranks import run_cases, spawn
from ..distributed.layouts import LAYOUTS, shard
from ..distributed.ring import ring_sparse_attention
from ..patterns.vertical_slash import VerticalSlashPattern, synthetic_pattern
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


def count_digest_exchanges(*, calls: int = 3, fault_rank: int | None = None, tokens: int = 96, group=None
                           ) -> dict:
    """``calls`` ring forwards on the same pattern object and inputs, the last one with rank
    ``fault_rank`` passing the zigzag layout instead of striped; how many digest exchanges (the full
    agreement of :func:`treeattn_lab.distributed.agreement.agree`) this rank made, and how the last call
    ended (``{"exchanges": n, "error": None or the exception's type name, "message": ...}``)."""
    from ..distributed import agreement

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, _ = make_inputs(tokens, 2, 1, 16, dtype=torch.float64, device=torch.device("cpu"), seed=0)
    pattern = small_pattern(tokens, 2, 16, 0)
    local = [shard(x, "striped", world, rank, 16) for x in (q, k, v)]
    exchanges, real_gather = 0, agreement.gather_objects

    def counted(obj, monitor):
        nonlocal exchanges
        exchanges += 1
        return real_gather(obj, monitor)

    agreement.gather_objects = counted
    try:
        for call in range(calls):
            layout = "zigzag" if call == calls - 1 and rank == fault_rank else "striped"
            try:
                ring_sparse_attention(*local, pattern, num_tokens=tokens, layout=layout, group=group,
                                      backend="reference")
            except Exception as e:  # the last call's outcome is reported below
                if call < calls - 1:
                    raise
                return {"exchanges": exchanges, "error": type(e).__name__, "message": str(e)}
    finally:
        agreement.gather_objects = real_gather
    return {"exchanges": exchanges, "error": None, "message": ""}


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


def _report(rows, *, world, args, dtype, pattern) -> None:
    from .harness import environment, print_table, write_results

    env = environment()
    env["world"] = world
    env["nccl_high_priority_streams"] = bool(args.high_priority)
    columns = [("layout", "layout"), ("tokens", "tokens"), ("single_fwd_bwd_ms", "1 GPU fwd+bwd ms"),
               ("ring_fwd_bwd_ms", f"ring x{world} fwd+bwd ms"), ("fwd_bwd_speedup", "fwd+bwd x 1 GPU"),
               ("fwd_speedup", "fwd x 1 GPU"), ("rel_err_out", "err out"), ("rel_err_dk", "err dk")]
    print_table(f"sparse ring attention over {world} ranks, {env['device']}", columns, rows)
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
        rows.append({"tokens": args.tokens, "world": world, "layout": layout,
                     "single_fwd_ms": single["fwd_ms"], "single_fwd_bwd_ms": single["fwd_bwd_ms"],
                     "ring_fwd_ms": row["ring_fwd_ms"], "ring_fwd_bwd_ms": row["ring_fwd_bwd_ms"],
                     "fwd_speedup": single["fwd_ms"] / row["ring_fwd_ms"],
                     "fwd_bwd_speedup": single["fwd_bwd_ms"] / row["ring_fwd_bwd_ms"],
                     **{k: v for k, v in row.items() if k.startswith("rel_err_")}})
    if rank == 0:
        _report(rows, world=world, args=args, dtype=dtype, pattern=pattern)
    if args.profile:  # after the results are written: a profiler failure cannot lose them
        _profile(profiled[0], rank, Path(args.out or "bench/results"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
