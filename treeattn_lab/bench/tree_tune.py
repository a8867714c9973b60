"""``python -m treeattn_lab bench tree-tune``: sweep the tree kernel's tile shapes on this GPU.

Times the forward for every forward config, then forward+backward for every dK/dV config (with the
best forward) and every dQ config (with the best of both), over the research cases. The winners belong
in ``CONFIGS`` of ``kernels/tree_attention.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..trie import RolloutTrie
from .harness import environment, print_table, time_ms, write_results
from .tree import research_cases

FWD_CONFIGS = [(64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 4),
               (128, 32, 4, 3), (128, 32, 4, 4), (256, 64, 8, 3)]
DKDV_CONFIGS = [(128, 128, 8, 2), (64, 128, 8, 2), (32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3),
                (64, 64, 4, 2), (32, 128, 8, 3)]
DQ_CONFIGS = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 32, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
              (64, 64, 4, 2), (128, 32, 8, 3)]


def _sweep(name, configs, step, grad_to_none, flops) -> list[dict]:
    rows = []
    for cfg in configs:
        try:
            ms = time_ms(lambda c=cfg: step(c), grad_to_none=grad_to_none, device="cuda")
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
            rows.append({"case": name, "config": cfg, "error": str(e)[:80]})
            continue
        rows.append({"case": name, "config": cfg, "ms": ms, "tflops": flops / ms / 1e9})
    return rows


def tune_case(case, heads: int, dim: int) -> list[dict]:
    from ..kernels.tree_attention import triton_tree_attention

    pack = RolloutTrie.from_sequences(case.sequences).pack().to("cuda")
    flops = pack.attended_pairs() * 4 * heads * dim
    q, k, v = (torch.randn(pack.num_tokens, heads, dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    fwd = _sweep(case.name, FWD_CONFIGS, lambda c: triton_tree_attention(q, k, v, pack, fwd_config=c),
                 None, flops)
    best = min((r for r in fwd if "ms" in r), key=lambda r: r["ms"])["config"]

    def with_dkdv(c):
        triton_tree_attention(q, k, v, pack, fwd_config=best, dkdv_config=c).backward(do)

    dkdv = _sweep(case.name, DKDV_CONFIGS, with_dkdv, [q, k, v], 3.5 * flops)
    best_dkdv = min((r for r in dkdv if "ms" in r), key=lambda r: r["ms"])["config"]

    def with_dq(c):
        triton_tree_attention(q, k, v, pack, fwd_config=best, dkdv_config=best_dkdv, dq_config=c).backward(do)

    dq = _sweep(case.name, DQ_CONFIGS, with_dq, [q, k, v], 3.5 * flops)
    return ([{**r, "pass": "fwd"} for r in fwd] + [{**r, "pass": "fwd+bwd, dkdv"} for r in dkdv]
            + [{**r, "pass": "fwd+bwd, dq"} for r in dq])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench tree-tune", description=__doc__)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench tree-tune needs a CUDA GPU (the interpreter cannot time kernels)")
    rows = []
    for case in tqdm(research_cases(), desc="tune", unit="case"):
        rows += tune_case(case, args.heads, args.dim)
    for r in rows:
        r["config"] = str(r["config"])
    env = environment()
    columns = [("case", "case"), ("pass", "pass"), ("config", "(BM, BN, warps, stages)"), ("ms", "ms"),
               ("tflops", "TFLOP/s"), ("error", "error")]
    print_table(f"tree kernel configs, {env['device']}", columns, rows)
    path = write_results("tree-tune", rows, env, directory=Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0
