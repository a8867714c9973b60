"""``python -m treeattn_lab bench sparse``: vertical-slash sparse attention against dense causal attention.

For each case (one sequence of N tokens, bf16, 16 heads of dim 128, a seeded :func:`synthetic_pattern`
of about 1000 columns and 1000 diagonals per head):

- dense: causal ``scaled_dot_product_attention`` over all pairs (FlashAttention on a GPU);
- flex: FlexAttention with the pattern's ``mask_mod`` and a block mask made from the same tiles;
- triton: the lab's block-sparse kernel (selected tiles plus gathered bar columns).

The pattern's index and block mask are built once and not timed (reported apart as ``index_ms``).
Reported: median ms forward and forward+backward, speed-up over dense, the pattern's density (computed
pairs over causal pairs, block rounding included) and useful TFLOP/s = computed pairs x 4 x heads x
head_dim / time (x 3.5 for fwd+bwd). Cases differ in how far the slashes spread: ``band`` (offsets
decaying from the diagonal), ``band+far`` (2% of them scattered), ``scattered`` (offsets uniform over
the whole causal range: every diagonal lands in its own tiles, the worst case for tile skipping).
``--check`` compares the bf16 kernel with an fp32 reference at 4K tokens; ``--tune`` times a few launch
settings at the largest case; with two GPUs the 2-GPU ring runs too
(``torchrun --nproc-per-node 2 -m treeattn_lab.bench.ring``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels.tuning import LaunchConfig, SparseConfig
from ..patterns.vertical_slash import synthetic_pattern
from .harness import (
    add_out_argument,
    choice_list,
    environment,
    int_list,
    positive_int,
    print_table,
    time_ms,
    write_results,
)


@dataclass
class SparseCase:
    name: str
    tokens: int
    pattern: dict = field(default_factory=dict)  # synthetic_pattern keyword arguments


def gpu_cases(which: str) -> list[SparseCase]:
    band = [SparseCase("band 32K", 32768), SparseCase("band 128K", 131072)]
    spread = [SparseCase("band+far 128K", 131072, {"far_slash": 0.02}),
              SparseCase("scattered 128K", 131072, {"far_slash": 1.0})]
    return {"band": band, "all": band + spread, "spread": spread}[which]


def quick_cases() -> list[SparseCase]:
    """Tiny cases for CPU smoke runs (the kernel under the interpreter)."""
    return [SparseCase("tiny band 256", 256, {"n_vertical": 12, "n_slash": 12, "sinks": 2, "local": 4,
                                              "slash_scale": 8.0, "block_size": 16})]


@functools.lru_cache(maxsize=4)
def _pattern(tokens, heads, device, items):
    return synthetic_pattern(tokens, heads, device=device, **dict(items))


def _time(fn, inputs, grad, device) -> tuple[float, float]:
    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        fn(*inputs).backward(grad)

    return time_ms(fwd, device=device), time_ms(fwd_bwd, grad_to_none=inputs, device=device)


def run_case(case: SparseCase, *, heads: int, dim: int, dtype, device, backends, config=None) -> list[dict]:
    from ..ops.sparse import flex_block_mask, sparse_attention

    N = case.tokens
    pattern = _pattern(N, heads, device, tuple(sorted(case.pattern.items())))
    t0 = time.perf_counter()
    index = pattern.block_index(N)
    if "triton" in backends:  # what the kernel derives from the index (bar plans) is built once too
        from ..kernels.block_sparse import prepare

        prepare(index, config)
    if device.type == "cuda":
        torch.cuda.synchronize()
    index_ms = (time.perf_counter() - t0) * 1e3
    pairs = pattern.num_pairs(N)
    causal = heads * N * (N + 1) // 2
    nq = index.q_blocks.numel()
    base = {"case": case.name, "tokens": N, "density": pairs / causal, "ideal": causal / pairs,
            "tiles_per_block": index.num_tiles / (heads * nq),
            "bars_per_block": index.num_bar_columns / (heads * nq),
            "index_ms": index_ms}
    gen = torch.Generator(device=device).manual_seed(0)
    rows, outputs = [], {}
    for backend in backends:
        if backend == "dense":
            inputs = [torch.randn(1, heads, N, dim, dtype=dtype, device=device, generator=gen)
                      .requires_grad_() for _ in range(3)]
            fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            useful = causal
        else:
            inputs = [torch.randn(N, heads, dim, dtype=dtype, device=device, generator=gen).requires_grad_()
                      for _ in range(3)]
            if backend == "flex":
                flex_block_mask(pattern, N)  # built once, not timed
            if backend == "triton" and config is not None:  # tuning: launch settings, no validation
                from ..kernels.block_sparse import triton_sparse_attention

                fn = lambda q, k, v: triton_sparse_attention(q, k, v, index, config=config)
            else:
                fn = lambda q, k, v, b=backend: sparse_attention(q, k, v, pattern, backend=b)
            useful = pairs
        try:
            grad = torch.randn_like(fn(*inputs))
            fwd_ms, fwd_bwd_ms = _time(fn, inputs, grad, device)
        except Exception as e:  # a failed backend (compile error, out of memory) is reported, not fatal
            rows.append({**base, "backend": backend, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"{case.name} {backend} failed: {rows[-1]['error']}", flush=True)
            del inputs
            continue
        if backend != "dense":
            with torch.no_grad():
                outputs[backend] = fn(*(x.detach() for x in inputs)).float()
        rows.append({**base, "backend": backend, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
                     "fwd_tflops": useful * 4 * dim / fwd_ms / 1e9,
                     "fwd_bwd_tflops": 3.5 * useful * 4 * dim / fwd_bwd_ms / 1e9})
        del inputs, grad
    dense = next((r for r in rows if r["backend"] == "dense"), None)
    for r in rows:
        if dense is not None and "fwd_ms" in dense and "fwd_ms" in r:
            r["fwd_speedup"] = dense["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_speedup"] = dense["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    if "flex" in outputs and "triton" in outputs:  # same inputs (same generator state) for both
        for r in rows:
            if r["backend"] == "triton":
                a, b = outputs["triton"], outputs["flex"]
                r["rel_err_vs_flex"] = float((a - b).norm() / b.norm())
    return rows


def check_against_reference(device, *, tokens=4096, heads=4, dim=128) -> dict:
    """Relative errors of the bf16 kernel's output and gradients against the fp32 einops reference."""
    from ..kernels.block_sparse import triton_sparse_attention
    from ..reference.sparse import sparse_attention as reference_sparse_attention

    pattern = synthetic_pattern(tokens, heads, n_vertical=200, n_slash=200, slash_scale=200.0, far_slash=0.05,
                                device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v, do = (torch.randn(tokens, heads, dim, device=device, generator=gen) for _ in range(4))
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = reference_sparse_attention(*ref, pattern)
    out_ref.backward(do)

    def rel(a, b):
        return float((a.detach().float() - b).norm() / b.norm())

    errors = {"check_tokens": tokens}
    low = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out = triton_sparse_attention(*low, pattern.block_index(tokens))
    out.backward(do.to(torch.bfloat16))
    errors["rel_err_out"] = rel(out, out_ref)
    errors.update({f"rel_err_d{n}": rel(a.grad, b.grad) for n, a, b in zip("qkv", low, ref, strict=True)})
    return errors


# on top of the tuned defaults (kernels/tuning.py: SPARSE, SPARSE_SHORT); none of these launches spills
# registers on sm_90 (ptxas, Triton 3.6)
TUNE_CONFIGS = [
    SparseConfig(),
    SparseConfig(fwd=LaunchConfig(128, 128, 8, 3)),
    SparseConfig(fwd=LaunchConfig(64, 64, 4, 3)),
    SparseConfig(fwd=LaunchConfig(128, 64, 8, 2)),
    SparseConfig(dq=LaunchConfig(128, 32, 8, 3)),
    SparseConfig(dq=LaunchConfig(64, 64, 4, 2)),
    SparseConfig(dq=LaunchConfig(64, 32, 4, 2)),
    SparseConfig(dkdv=LaunchConfig(32, 64, 4, 2)),
    SparseConfig(dkdv=LaunchConfig(32, 128, 8, 3)),
    SparseConfig(bar_kv=64, dkdv=LaunchConfig(32, 64, 4, 2)),
    SparseConfig(split=4),
]


def _set_fields(config: SparseConfig) -> dict:
    """The fields ``config`` sets (the others stay at the defaults)."""
    return {name: value for name, value in vars(config).items() if value is not None}


def kernel_breakdown(case: SparseCase, *, heads, dim, dtype, device) -> dict:
    """ms of each piece of the triton path (default launch settings): forward with and without the bar
    part, the backward kernels with and without it, the bar gather, and the device time per kernel of one
    forward+backward (torch.profiler, ``kernel_ms``)."""
    from ..kernels.attention_core import attention_delta
    from ..kernels.bar_columns import gather_bars
    from ..kernels.block_sparse import sparse_backward, sparse_forward, triton_sparse_attention

    N = case.tokens
    pattern = _pattern(N, heads, device, tuple(sorted(case.pattern.items())))
    full, tiles_only = pattern.block_index(N), pattern.block_index(N, bars=False)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(N, heads, dim, dtype=dtype, device=device, generator=gen) for _ in range(4))
    scale = dim ** -0.5
    bk, bv = gather_bars(k, v, full)
    o, lse = sparse_forward(q, k, v, bk, bv, full, scale=scale)
    delta = attention_delta(o, do)

    def ms(fn):
        return time_ms(fn, device=device)

    return {
        "gather_bars": ms(lambda: gather_bars(k, v, full)),
        "fwd": ms(lambda: sparse_forward(q, k, v, bk, bv, full, scale=scale)),
        "fwd_tiles_only": ms(lambda: sparse_forward(q, k, v, bk, bv, tiles_only, scale=scale)),
        "delta": ms(lambda: attention_delta(o, do)),
        "bwd": ms(lambda: sparse_backward(do, q, k, v, bk, bv, lse, delta, full, scale=scale)),
        "bwd_tiles_only": ms(lambda: sparse_backward(do, q, k, v, bk, bv, lse, delta, tiles_only,
                                                     scale=scale)),
        "kernel_ms": _kernel_ms(lambda: triton_sparse_attention(*(x.requires_grad_() for x in (q, k, v)), full
                                                                ).backward(do), device),
    }


def _kernel_ms(fn, device, reps: int = 5) -> dict:
    """Device ms per kernel name for one call of ``fn`` (mean of ``reps``), from torch.profiler (on a CPU:
    CPU ms per op)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    field = "device_time_total" if cuda else "self_cpu_time_total"
    times = {e.key: getattr(e, field, 0) / reps / 1e3 for e in prof.key_averages()}
    return {name: ms for name, ms in sorted(times.items(), key=lambda kv: -kv[1]) if ms > 0}


def tune(case: SparseCase, *, heads, dim, dtype, device) -> list[dict]:
    """fwd and fwd+bwd ms of the triton kernel under a few launch settings (on top of the defaults), then
    under the settings that beat the defaults combined (greedily, best first, one per kernel)."""
    def run(cfg):
        (row,) = run_case(case, heads=heads, dim=dim, dtype=dtype, device=device, backends=["triton"],
                          config=cfg)
        result = {"case": case.name, "config": repr(cfg), "fwd_ms": row.get("fwd_ms"),
                  "fwd_bwd_ms": row.get("fwd_bwd_ms"), "error": row.get("error")}
        print("tune", result, flush=True)
        return result

    rows = [run(cfg) for cfg in TUNE_CONFIGS]
    base = rows[0]
    if base["error"]:
        return rows

    def gain(cfg, row):  # a forward setting is judged on the forward alone
        if row["error"]:
            return 0.0
        key = "fwd_ms" if set(_set_fields(cfg)) == {"fwd"} else "fwd_bwd_ms"
        return base[key] - row[key]

    combined = {}
    for cfg, row in sorted(zip(TUNE_CONFIGS[1:], rows[1:], strict=True), key=lambda cr: -gain(*cr)):
        if gain(cfg, row) > 0 and not set(_set_fields(cfg)) & set(combined):
            combined.update(_set_fields(cfg))
    if len(combined) > 1:
        rows.append(run(SparseConfig(**combined)))
    return rows


def run_ring(out_dir: Path, tokens: int) -> list[dict]:
    """The 2-GPU ring (``torchrun -m treeattn_lab.bench.ring``), when this machine has two GPUs."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
           "treeattn_lab.bench.ring", "--tokens", str(tokens), "--out", str(out_dir)]
    subprocess.run(cmd, check=True, env=env)
    (path,) = sorted(out_dir.glob("sparse-ring__*.json"))[-1:]
    return json.loads(path.read_text())["rows"]


COLUMNS = [("case", "case"), ("backend", "backend"), ("fwd_ms", "fwd ms"), ("fwd_bwd_ms", "fwd+bwd ms"),
           ("fwd_speedup", "fwd x dense"), ("fwd_bwd_speedup", "fwd+bwd x dense"), ("ideal", "ideal"),
           ("tiles_per_block", "tiles/qblock"), ("bars_per_block", "bars/qblock"),
           ("fwd_tflops", "fwd TFLOP/s"), ("fwd_bwd_tflops", "fwd+bwd TFLOP/s"),
           ("rel_err_vs_flex", "err vs flex")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench sparse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", choices=["band", "spread", "all", "quick"], default=None,
                        help="default: all on a GPU, quick on the CPU")
    parser.add_argument("--backends", default=None, help="comma list of dense,flex,triton (and reference)",
                        type=choice_list(["dense", "flex", "triton", "reference"]))
    parser.add_argument("--flex-cases", default="band 32K,band 128K",
                        help="cases that also run flex (it compiles per shape and is slow)")
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--dim", type=positive_int, default=128)
    parser.add_argument("--check", action="store_true",
                        help="check the bf16 kernel against fp32 at 4K tokens")
    parser.add_argument("--tune", action="store_true", help="time a few launch settings at a band case")
    parser.add_argument("--tune-tokens", type=int_list, default=[131072],
                        help="comma list of band case sizes (32768, 131072) that --tune and the per-kernel "
                             "breakdown run at")
    parser.add_argument("--ring", type=int, default=262144, help="tokens of the 2-GPU ring (0: skip)")
    add_out_argument(parser)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cases = quick_cases() if (args.cases == "quick" or not cuda) else gpu_cases(args.cases or "all")
    backends = args.backends if args.backends else (["dense", "flex", "triton"] if cuda else
                                                                 ["dense", "reference", "triton"])
    heads, dim = (args.heads, args.dim) if cuda else (2, 16)
    flex_cases = set(args.flex_cases.split(","))
    out_dir = Path(args.out) if args.out else None

    rows, extra = [], {"dtype": str(dtype), "heads": heads, "head_dim": dim}
    if args.check and cuda:
        try:
            extra["check"] = check_against_reference(device)
        except Exception as e:  # reported, and the timings still run
            extra["check"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print("check against fp32 at 4K tokens:", extra["check"], flush=True)
    for case in cases:
        use = [b for b in backends if b != "flex" or case.name in flex_cases or not cuda]
        rows += run_case(case, heads=heads, dim=dim, dtype=dtype, device=device, backends=use)
        print_table(f"sparse attention: {case.name}", COLUMNS, rows[-len(use):])
    env = environment()
    write_results("sparse", rows, env, directory=out_dir, extra=extra)  # kept if a later part fails
    if args.tune and cuda:
        tokens = set(args.tune_tokens)
        extra["breakdown"], extra["tune"] = {}, []
        for case in [c for c in gpu_cases("band") if c.tokens in tokens]:
            extra["breakdown"][case.name] = kernel_breakdown(case, heads=heads, dim=dim, dtype=dtype,
                                                             device=device)
            print(f"ms per piece ({case.name}):", extra["breakdown"][case.name], flush=True)
            write_results("sparse", rows, env, directory=out_dir, extra=extra)
            extra["tune"] += tune(case, heads=heads, dim=dim, dtype=dtype, device=device)
            print_table(f"triton launch settings ({case.name})", [("config", "config"), ("fwd_ms", "fwd ms"),
                        ("fwd_bwd_ms", "fwd+bwd ms")], [r for r in extra["tune"] if r["case"] == case.name])
    if cuda and torch.cuda.device_count() >= 2 and args.ring:
        extra["ring"] = run_ring(out_dir or write_results("sparse", rows, env).parent, args.ring)
    title = f"sparse attention, {env['device']}, {str(dtype).removeprefix('torch.')}, {heads} heads x {dim}"
    print_table(title, COLUMNS, rows)
    path = write_results("sparse", rows, env, directory=out_dir, extra=extra)
    print(f"wrote {path}")
    return 0
