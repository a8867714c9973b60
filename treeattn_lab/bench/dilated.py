"""``python -m treeattn_lab bench dilated``: dilated attention against dense SDPA and FlexAttention; the scan.

Attention, per case ``(N, D, W, P)`` (one sequence, ``heads`` query and kv heads, head dim ``dim``):

- sdpa: dense causal ``scaled_dot_product_attention`` on ``[1, H, N, d]`` (FlashAttention on a GPU): what a
  model pays without dilation;
- flex: FlexAttention with the dilated ``mask_mod`` (block mask built once, not timed): the naive mask;
- triton: the lab's kernel (``treeattn_lab.kernels.dilated_attention``).

Reported: median ms forward and forward+backward, speed-up over sdpa, the ideal speed-up (causal pairs /
dilated pairs), useful TFLOP/s (attended pairs x 4 x heads x dim / time; x 3.5 for forward+backward).
``--check`` compares bf16 triton output and gradients with an fp32 masked-SDPA reference on several
awkward patterns; ``--tune`` first picks the fastest launch configs on the first case.

Scan: the gated recurrence on ``[1, N, heads * dim]`` against the GPU's copy bandwidth measured in the same
run (``dst.copy_(src)``, 2 bytes moved per element byte). The forward pass must move x, g in and h out
(3 tensors); the backward x, g, h, dh in and dx, dg out (6 tensors).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..kernels.tuning import LaunchConfig, ScanConfig
from ..patterns.dilated import DilatedPattern
from .harness import (
    add_out_argument,
    choice_list,
    environment,
    positive_int,
    print_table,
    time_ms,
    write_results,
)


@dataclass(frozen=True)
class DilatedCase:
    name: str
    num_tokens: int
    dilation: int
    window: int
    initial: int

    @property
    def pattern(self) -> DilatedPattern:
        return DilatedPattern(self.dilation, self.window, self.initial)


def gpu_cases() -> list[DilatedCase]:
    """The target's main case (128K, D=16, W=256, P=4) first, then smaller and other dilations."""
    return [
        DilatedCase("128K D16 W256 P4", 131072, 16, 256, 4),
        DilatedCase("32K D16 W256 P4", 32768, 16, 256, 4),
        DilatedCase("128K D4 W256 P4", 131072, 4, 256, 4),
        DilatedCase("128K D64 W256 P4", 131072, 64, 256, 4),
        DilatedCase("128K D16 W0 P0", 131072, 16, 0, 0),
        DilatedCase("8K D16 W256 P4", 8192, 16, 256, 4),
    ]


def quick_cases() -> list[DilatedCase]:
    """Tiny cases for CPU smoke runs."""
    return [DilatedCase("tiny 256 D8 W16 P2", 256, 8, 16, 2), DilatedCase("tiny 200 D4 W0 P0", 200, 4, 0, 0)]


# launch candidates for --tune: fwd; bwd (dkdv, dq)
FWD_CANDIDATES = [LaunchConfig(128, 64, 4, 3), LaunchConfig(128, 64, 8, 3), LaunchConfig(128, 128, 8, 3),
                  LaunchConfig(64, 64, 4, 3)]
BWD_CANDIDATES = [
    (LaunchConfig(32, 128, 4, 3), LaunchConfig(128, 32, 4, 3)),
    (LaunchConfig(64, 128, 8, 2), LaunchConfig(128, 64, 8, 2)),
    (LaunchConfig(128, 128, 8, 2), LaunchConfig(128, 128, 8, 2)),
    (LaunchConfig(64, 64, 4, 2), LaunchConfig(64, 64, 4, 2)),
]


def _scan(block_m, block_n, warps, unroll=8, window=16, programs_per_sm=0) -> ScanConfig:
    return ScanConfig(block_m, block_n, warps, 1, unroll=unroll, window=window,
                      programs_per_sm=programs_per_sm)


# scan launch candidates for --tune-scan. Long chunks: the states of a chain's N / block_m chunks resolve
# about `window` chunks per look-back round, one round after another, so short chunks make that chain (not
# the data) the limit. Persistent launches (programs_per_sm > 0): the row loop re-reads each chunk, cheap
# only while running programs x block_m x block_n x 4 bytes fit in L2. Measured on an H200 in
# bench/results/scan-tune*__*.json; narrowing runs around the fastest use --scan-config.
SCAN_CANDIDATES = [
    _scan(16, 256, 2), _scan(16, 256, 2, unroll=16),
    # one program per chunk (block_n / (32 x warps) = 8 channels a thread: 16-byte loads; 4: 8 bytes; 2: 4)
    _scan(32, 256, 4), _scan(64, 256, 4), _scan(64, 256, 2, window=8), _scan(64, 256, 1, window=8),
    _scan(64, 128, 1), _scan(64, 64, 1), _scan(128, 256, 2, window=8), _scan(128, 256, 1, window=4),
    _scan(128, 512, 2, window=4), _scan(256, 256, 2, window=4), _scan(256, 128, 1, window=8),
    # persistent: a fixed number of programs per multiprocessor walk the chunks
    _scan(32, 256, 4, programs_per_sm=4), _scan(64, 256, 2, window=8, programs_per_sm=3),
    _scan(64, 256, 2, window=8, programs_per_sm=6), _scan(64, 256, 1, window=8, programs_per_sm=4),
    _scan(64, 256, 4, unroll=16, programs_per_sm=2),
    _scan(64, 128, 1, unroll=16, window=8, programs_per_sm=4),
    _scan(64, 128, 1, programs_per_sm=8), _scan(64, 64, 1, programs_per_sm=16),
    _scan(128, 256, 2, window=8, programs_per_sm=4), _scan(128, 512, 2, window=4, programs_per_sm=2),
    _scan(256, 256, 2, window=4, programs_per_sm=2),
    _scan(64, 256, 2, window=8, programs_per_sm=8), _scan(64, 256, 2, window=8, programs_per_sm=12),
    _scan(64, 256, 2, window=8, programs_per_sm=16), _scan(64, 256, 2, programs_per_sm=8),
    _scan(64, 256, 2, unroll=16, window=8, programs_per_sm=8), _scan(32, 256, 2, window=8, programs_per_sm=8),
    _scan(32, 256, 2, window=8, programs_per_sm=12), _scan(128, 256, 2, window=8, programs_per_sm=8),
    _scan(64, 128, 1, window=8, programs_per_sm=12), _scan(64, 128, 1, window=8, programs_per_sm=16),
    _scan(64, 512, 4, window=8, programs_per_sm=4), _scan(64, 512, 4, window=8, programs_per_sm=6),
]


def _inputs(n, heads, dim, dtype, device, gen, layout="nhd"):
    shape = (n, heads, dim) if layout == "nhd" else (1, heads, n, dim)
    return [torch.randn(*shape, dtype=dtype, device=device, generator=gen).requires_grad_() for _ in range(3)]


def _timings(fwd, inputs, device) -> tuple[float, float]:
    out = fwd(*inputs)
    grad = torch.randn_like(out)

    def fwd_bwd():
        fwd(*inputs).backward(grad)

    return time_ms(lambda: fwd(*inputs), device=device), time_ms(fwd_bwd, grad_to_none=inputs, device=device)


def _triton_fn(case, configs):
    from ..kernels.dilated_attention import triton_dilated_attention

    return lambda q, k, v: triton_dilated_attention(q, k, v, dilation=case.dilation, window=case.window,
                                                    initial=case.initial, **configs)


def run_case(case: DilatedCase, *, heads, dim, dtype, device, backends, configs) -> list[dict]:
    from ..ops.dilated import flex_dilated_attention, reference_dilated_attention

    gen = torch.Generator(device=device).manual_seed(0)
    n = case.num_tokens
    pairs = {"dense": n * (n + 1) // 2, "dilated": case.pattern.num_pairs(n)}
    base = {"case": case.name, "N": n, "D": case.dilation, "W": case.window, "P": case.initial,
            "ideal": pairs["dense"] / pairs["dilated"],
            "kv_cache_ratio": n / case.pattern.kv_cache_entries(n)}
    rows = []
    for backend in backends:
        if backend == "sdpa":
            inputs = _inputs(n, heads, dim, dtype, device, gen, layout="bhnd")
            fwd = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            inputs = _inputs(n, heads, dim, dtype, device, gen)
            fwd = {
                "flex": lambda q, k, v: flex_dilated_attention(q, k, v, case.pattern),
                "reference": lambda q, k, v: reference_dilated_attention(q, k, v, case.pattern),
                "triton": _triton_fn(case, configs),
            }[backend]
        fwd_ms, fwd_bwd_ms = _timings(fwd, inputs, device)
        useful = pairs["dense" if backend == "sdpa" else "dilated"] * 4 * heads * dim
        rows.append({**base, "backend": backend, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
                     "fwd_tflops": useful / fwd_ms / 1e9, "fwd_bwd_tflops": 3.5 * useful / fwd_bwd_ms / 1e9})
        del inputs
    dense = next((r for r in rows if r["backend"] == "sdpa"), None)
    for r in rows:
        if dense is not None:
            r["fwd_speedup"] = dense["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_speedup"] = dense["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


# ---------------------------------------------------------------------------------------------- checks
CHECK_CASES = [(4096, 16, 256, 4, 16, 16), (1000, 3, 5, 7, 4, 2), (777, 1, 0, 0, 4, 4),
               (2049, 64, 0, 0, 8, 4),
               (300, 400, 17, 130, 2, 1)]  # (N, D, W, P, Hq, Hkv): GQA groups 1 and 2 only (fewer compiles)


def check_kernel(dim, device, configs) -> list[dict]:
    """bf16 triton against fp32 masked SDPA (forward and backward) on awkward sizes and patterns."""
    from ..kernels.dilated_attention import triton_dilated_attention

    out_rows = []
    for n, D, W, P, hq, hkv in CHECK_CASES:
        gen = torch.Generator(device=device).manual_seed(n)
        q, k, v = (torch.randn(n, h, dim, device=device, generator=gen) for h in (hq, hkv, hkv))
        do = torch.randn(n, hq, dim, device=device, generator=gen)
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        mask = DilatedPattern(D, W, P).dense_mask(n, device=device)
        qh, kh, vh = (x.transpose(0, 1) for x in ref)
        kh, vh = (x.repeat_interleave(hq // hkv, dim=0) for x in (kh, vh))
        out_ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(0, 1)
        out_ref.backward(do)
        low = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
        out = triton_dilated_attention(*low, dilation=D, window=W, initial=P, **configs)
        out.backward(do.to(torch.bfloat16))

        def rel(a, b):
            return float((a.float() - b).norm() / b.norm())

        out_rows.append({"check": f"N={n} D={D} W={W} P={P} Hq={hq} Hkv={hkv}",
                         "rel_err_out": rel(out, out_ref), "rel_err_dq": rel(low[0].grad, ref[0].grad),
                         "rel_err_dk": rel(low[1].grad, ref[1].grad),
                         "rel_err_dv": rel(low[2].grad, ref[2].grad)})
    return out_rows


def tune(case: DilatedCase, *, heads, dim, dtype, device) -> tuple[dict, list[dict]]:
    """Fastest forward config, then fastest backward pair (by forward+backward time), on ``case``."""
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = _inputs(case.num_tokens, heads, dim, dtype, device, gen)
    trials = []
    best_fwd = None
    for cfg in FWD_CANDIDATES:
        fn = _triton_fn(case, {"fwd_config": cfg})
        ms = time_ms(lambda fn=fn: fn(*inputs), device=device)
        trials.append({"kernel": "fwd", "config": repr(cfg), "ms": ms})
        if best_fwd is None or ms < best_fwd[1]:
            best_fwd = (cfg, ms)
    grad = torch.randn_like(inputs[0])
    best_bwd = None
    for dkdv, dq in BWD_CANDIDATES:
        fn = _triton_fn(case, {"fwd_config": best_fwd[0], "dkdv_config": dkdv, "dq_config": dq})
        ms = time_ms(lambda fn=fn: fn(*inputs).backward(grad), grad_to_none=inputs, device=device)
        trials.append({"kernel": "fwd+bwd", "config": repr((dkdv, dq)), "ms": ms})
        if best_bwd is None or ms < best_bwd[1]:
            best_bwd = ((dkdv, dq), ms)
    configs = {"fwd_config": best_fwd[0], "dkdv_config": best_bwd[0][0], "dq_config": best_bwd[0][1]}
    return configs, trials


# ---------------------------------------------------------------------------------------------- scan
def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """GB/s of ``dst.copy_(src)`` on ``nbytes`` (bytes read + bytes written per second)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device=device)
    return 2 * nbytes / ms / 1e6


def parse_scan_config(text: str) -> ScanConfig:
    """A :class:`ScanConfig` from the command line: its printed form, ``ScanConfig(48, 512, 4, 1,
    unroll=16)``, or just the arguments, ``48, 512, 4, 1, unroll=16`` (literal values, checked by
    ``ScanConfig``)."""
    import ast

    source = text.strip()
    if not source.startswith("ScanConfig("):
        source = f"ScanConfig({source})"
    try:
        call = ast.parse(source, mode="eval").body
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "ScanConfig"):
            raise ValueError("not a ScanConfig(...) call")
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        return ScanConfig(*args, **kwargs)
    except (ValueError, SyntaxError, TypeError) as e:
        raise ValueError(f"--scan-config must be ScanConfig fields like '48, 512, 4, 1, unroll=16, window=8, "
                         f"programs_per_sm=6', got {text!r}: {e}") from e


def scan_candidates(which: str | None) -> list | None:
    """The ``--tune-scan`` launches: ``"all"``, ``"persistent"`` (programs_per_sm > 0) or None (none)."""
    if which is None:
        return None
    return [c for c in SCAN_CANDIDATES if which == "all" or c.programs_per_sm > 0]


def bench_scan(*, n, channels, dtype, device, tune_configs: list | None) -> tuple[list[dict], dict]:
    """Rows per launch config: GB/s of the bytes each pass must move, against copy, and the errors of the
    forward and backward over the first 16K steps against the fp32 loop. Then the fastest correct config's
    forward error over the whole sequence."""
    from ..kernels.scan import scan_backward, scan_forward
    from ..kernels.tuning import SCAN
    from ..reference.scan import gated_scan

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    copy_gbs = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, n, channels, dtype=dtype, device=device, generator=gen)
    g = torch.rand(1, n, channels, dtype=dtype, device=device, generator=gen)
    dh = torch.randn_like(x)
    elem = x.element_size() * x.numel()
    m = min(n, 16384)  # the fp32 loop's reference runs on the first m steps
    x_m, g_m, dh_m = (t[:, :m].contiguous() for t in (x, g, dh))
    xs, gs = (t.float().requires_grad_() for t in (x_m, g_m))
    head = gated_scan(xs, gs, dim=1)
    head.backward(dh_m.float())
    errs = ("rel_err_fwd_16k", "rel_err_dx_16k", "rel_err_dg_16k")

    def measure(cfg) -> dict:
        h = scan_forward(x, g, cfg)
        fwd_ms = time_ms(lambda: scan_forward(x, g, cfg), device=device)
        bwd_ms = time_ms(lambda: scan_backward(x, g, h, dh, cfg), device=device)
        dx, dg = scan_backward(x_m, g_m, scan_forward(x_m, g_m, cfg), dh_m, cfg)
        r = {"case": f"scan [1, {n}, {channels}]", "config": repr(cfg), "copy_GBps": copy_gbs,
             "fwd_ms": fwd_ms, "fwd_GBps": 3 * elem / fwd_ms / 1e6, "bwd_ms": bwd_ms,
             "bwd_GBps": 6 * elem / bwd_ms / 1e6, "rel_err_fwd_16k": rel(h[:, :m], head.detach()),
             "rel_err_dx_16k": rel(dx, xs.grad), "rel_err_dg_16k": rel(dg, gs.grad)}
        r["fwd_frac_copy"] = r["fwd_GBps"] / copy_gbs
        r["bwd_frac_copy"] = r["bwd_GBps"] / copy_gbs
        print(f"scan {cfg!r}: fwd {fwd_ms:.3f} ms ({r['fwd_frac_copy']:.0%} of copy), "
              f"bwd {bwd_ms:.3f} ms ({r['bwd_frac_copy']:.0%}), errors {[f'{r[e]:.1e}' for e in errs]}",
              flush=True)
        return r

    rows, failed, launches = [], [], {}
    for cfg in tune_configs or [SCAN]:
        try:
            rows.append(measure(cfg))
            launches[rows[-1]["config"]] = cfg
        except Exception as exc:  # one candidate that fails to compile or run must not end the sweep
            failed.append({"config": repr(cfg), "error": repr(exc)[:500]})
            print(f"scan {cfg!r}: FAILED {failed[-1]['error']}", flush=True)
    if not rows:
        raise RuntimeError(f"every scan launch failed: {failed}")
    correct = [r for r in rows if all(r[e] < 1e-2 for e in errs)] or rows  # NaN fails the comparison
    best = min(correct, key=lambda r: r["fwd_ms"] + r["bwd_ms"])
    with torch.no_grad():
        errors = {"config": best["config"], "all_correct": len(correct) == len(rows), "failed": failed,
                  "rel_err_fwd": rel(scan_forward(x, g, launches[best["config"]]),
                                     gated_scan(x.float(), g.float(), dim=1)),
                  **{e: best[e] for e in errs}, "backward_tokens": m}
    return rows, errors


COLUMNS = [("case", "case"), ("backend", "backend"), ("fwd_ms", "fwd ms"), ("fwd_bwd_ms", "fwd+bwd ms"),
           ("fwd_speedup", "fwd x sdpa"), ("fwd_bwd_speedup", "fwd+bwd x sdpa"), ("ideal", "ideal"),
           ("kv_cache_ratio", "KV cache /"), ("fwd_tflops", "fwd TFLOP/s"),
           ("fwd_bwd_tflops", "fwd+bwd TFLOP/s")]
SCAN_COLUMNS = [("case", "case"), ("config", "config"), ("copy_GBps", "copy GB/s"), ("fwd_ms", "fwd ms"),
                ("fwd_GBps", "fwd GB/s"), ("fwd_frac_copy", "fwd / copy"), ("bwd_ms", "bwd ms"),
                ("bwd_GBps", "bwd GB/s"), ("bwd_frac_copy", "bwd / copy"), ("rel_err_fwd_16k", "err"),
                ("rel_err_dg_16k", "err dg")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench dilated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", choices=["main", "all", "quick"], default=None,
                        help="default: all on a GPU (main = the 128K case only), quick on the CPU")
    parser.add_argument("--backends", default=None, type=choice_list(["sdpa", "flex", "triton", "reference"]),
                        help="comma list of sdpa,flex,triton,reference")
    parser.add_argument("--flex-max-cases", type=positive_int, default=2,
                        help="time flex on the first K cases only")
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--dim", type=positive_int, default=128)
    parser.add_argument("--check", action="store_true", help="check bf16 triton against fp32 (GPU)")
    parser.add_argument("--tune", action="store_true", help="pick attention launch configs on the first case")
    parser.add_argument("--tune-scan", nargs="?", const="all", choices=["all", "persistent"], default=None,
                        help="time every scan launch candidate (persistent: the persistent launches only)")
    parser.add_argument("--scan-config", action="append", default=None, metavar="TUPLE",
                        help="time this scan launch, e.g. '48, 512, 4, 1, unroll=16, window=8, "
                             "programs_per_sm=6' or its printed form 'ScanConfig(...)' (repeatable; with "
                             "--tune-scan, after its candidates)")
    parser.add_argument("--no-scan", action="store_true", help="attention only")
    parser.add_argument("--scan-only", action="store_true", help="the scan only")
    add_out_argument(parser)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    which = args.cases or ("all" if cuda else "quick")
    cases = {"main": gpu_cases()[:1], "all": gpu_cases(), "quick": quick_cases()}[which]
    backends = args.backends if args.backends else (
        ["sdpa", "triton", "flex"] if cuda else ["sdpa", "reference", "triton"])
    heads, dim = (args.heads, args.dim) if cuda or args.cases else (2, 16)
    env = environment()
    out_dir = Path(args.out) if args.out else None
    extra = {"dtype": str(dtype), "heads": heads, "head_dim": dim}

    def save(rows):  # after every step, so a run cut short still leaves its numbers
        name = "scan" if args.scan_only else "dilated"
        return write_results(name, rows, env, directory=out_dir, extra=extra)

    configs: dict = {}
    if args.tune and cuda:
        configs, trials = tune(cases[0], heads=heads, dim=dim, dtype=dtype, device=device)
        extra.update(tuned={k: repr(v) for k, v in configs.items()}, tune_trials=trials)
        print_table("tuning (first case)", [("kernel", "kernel"), ("config", "config"), ("ms", "ms")], trials)
        save([])
    if args.check and cuda:
        extra["checks"] = check_kernel(dim, device, configs)
        print_table("bf16 triton vs fp32 reference", [("check", "case"), ("rel_err_out", "out"),
                    ("rel_err_dq", "dq"), ("rel_err_dk", "dk"), ("rel_err_dv", "dv")], extra["checks"])
        save([])
    rows: list[dict] = []
    if not args.no_scan:
        n_scan, channels = (131072, heads * dim) if cuda else (512, 64)
        tune_configs = scan_candidates(args.tune_scan) if cuda else None
        if args.scan_config:
            tune_configs = (tune_configs or []) + [parse_scan_config(text) for text in args.scan_config]
        extra["scan"], extra["scan_check"] = bench_scan(n=n_scan, channels=channels, dtype=dtype,
                                                        device=device, tune_configs=tune_configs)
        print_table("gated scan vs copy bandwidth", SCAN_COLUMNS, extra["scan"])
        print("scan errors vs the fp32 loop:", extra["scan_check"])
        save(rows)
    if args.scan_only:
        cases = []
    path = save(rows)
    for i, case in enumerate(tqdm(cases, desc="bench dilated", unit="case")):
        use = [b for b in backends if b != "flex" or i < args.flex_max_cases]
        rows += run_case(case, heads=heads, dim=dim, dtype=dtype, device=device, backends=use,
                         configs=configs)
        path = save(rows)
    title = f"dilated attention, {env['device']}, {str(dtype).removeprefix('torch.')}, {heads} heads x {dim}"
    if rows:
        print_table(title, COLUMNS, rows)
    print(f"wrote {path}")
    return 0
