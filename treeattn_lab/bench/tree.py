"""``python -m treeattn_lab bench tree``: tree attention against flat SDPA and FlexAttention.

For each case (four synthetic tries: GRPO groups of 16 rollouts on 1K and 4K prompts, agentic
rollouts forking twice after an 8K prompt, and a low-sharing batch of short prompts with long
responses; then the bundled rollout sets):

- flat SDPA: every rollout its own sequence, causal ``scaled_dot_product_attention`` on a padded batch
  ``[B, H, L, D]`` (FlashAttention on a GPU);
- flex: the packed trie, FlexAttention with the tree ``mask_mod`` (block mask built once, not timed);
- triton: the packed trie, the lab's tile-skipping kernel (schedule built once, not timed);
- gather-flat: the packed trie, ``tree_attention(backend="flat")``: every root-to-leaf rollout gathered out
  of the pack into length buckets, causal SDPA, each token's output written back from one rollout (plan
  built once, not timed; the gathers and scatters are timed);
- varlen: the packed trie, ``tree_attention(backend="varlen")``: FlashAttention's varlen kernel with one
  sequence per leaf, the packed queries as they are and each leaf's rollout gathered as keys (the gathers
  and the backward's sums into the pack are timed);
- fa4 (where available: a Hopper-class GPU with the ``[hopper]`` extra): the packed trie,
  FlashAttention-4's kernels with the tree ``mask_mod`` through FlexAttention's FLASH backend (block mask
  built once, not timed; the first call of each size compiles, not timed);
- auto: the packed trie, ``tree_attention(backend="auto")`` (its pick is reported: fa4 where available,
  else gather-flat when the pack shares little, else triton).

Reported: median ms forward and forward+backward, speed-up over flat, the ideal speed-up (attended pairs
flat / tree) and useful TFLOP/s = attended pairs x 4 x heads x head_dim / time (x 3.5 for fwd+bwd:
the backward does 2.5 times the forward's matrix work). ``--check`` also compares the bf16 triton,
gather-flat, varlen and fa4 outputs and gradients with an fp32 flat reference. When auto runs, a second
table puts auto beside flat SDPA, triton and the fastest other row for every case.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..ops.backends import available_backends
from ..trie import RolloutTrie
from .harness import (
    add_out_argument,
    choice_list,
    environment,
    positive_int,
    print_table,
    time_ms,
    write_results,
)

# bench row name -> tree_attention backend ("flat" is the flat SDPA baseline, not a tree_attention backend)
TREE_BACKENDS = {"reference": "reference", "flex": "flex", "triton": "triton", "gather-flat": "flat",
                 "varlen": "varlen", "fa4": "fa4", "auto": "auto"}
ROW_OF_BACKEND = {b: row for row, b in TREE_BACKENDS.items()}


@dataclass
class TreeCase:
    name: str
    sequences: list[list[int]]


def branching_rollouts(roots: int, root_len: int, levels: list[tuple[int, int]], *, seed: int = 0,
                       vocab: int = 32000) -> list[list[int]]:
    """Rollouts of ``roots`` prompts of ``root_len`` tokens, forking ``fan`` ways per level.

    ``levels = [(fan, segment_len), ...]``: e.g. GRPO 16 samples of 512 tokens is ``[(16, 512)]``;
    an agent forking 4 ways at two tool calls is ``[(4, 1024), (4, 1024)]``. Siblings start with
    distinct tokens so the trie has exactly this shape.
    """
    rng = random.Random(seed)

    def segment(n, first):
        return [first] + [rng.randrange(vocab) for _ in range(n - 1)]

    out = []

    def grow(prefix, depth):
        if depth == len(levels):
            out.append(prefix)
            return
        fan, seg = levels[depth]
        for child in range(fan):
            grow(prefix + segment(seg, child), depth + 1)

    for r in range(roots):
        grow(segment(root_len, r), 0)
    return out


def research_cases() -> list[TreeCase]:
    """Four synthetic tries (bf16, 16 heads, head dim 128): GRPO groups sharing a 1K or 4K prompt, agentic
    rollouts that fork twice after an 8K prompt, and 32 short prompts with 4 long responses each (little
    sharing)."""
    return [
        TreeCase("grpo 8x16 p1024 r512", branching_rollouts(8, 1024, [(16, 512)])),
        TreeCase("grpo 4x16 p4096 r1024", branching_rollouts(4, 4096, [(16, 1024)])),
        TreeCase("agentic 2x(4x4) p8192 s1024+1024", branching_rollouts(2, 8192, [(4, 1024), (4, 1024)])),
        TreeCase("low sharing 32x4 p256 r2048", branching_rollouts(32, 256, [(4, 2048)])),
    ]


def dataset_cases() -> list[TreeCase]:
    from ..datasets import DATASETS, load_rollouts

    return [TreeCase(f"data:{name}", load_rollouts(name)) for name in DATASETS]


def quick_cases() -> list[TreeCase]:
    """Tiny cases for CPU smoke runs."""
    return [
        TreeCase("tiny grpo 2x4 p48 r24", branching_rollouts(2, 48, [(4, 24)])),
        TreeCase("tiny agentic 1x(2x2) p64 s16+16", branching_rollouts(1, 64, [(2, 16), (2, 16)])),
        TreeCase("tiny low sharing 4x2 p8 r40", branching_rollouts(4, 8, [(2, 40)])),
    ]


def _flat_inputs(pack, heads, dim, dtype, device, gen):
    B, L = pack.num_sequences, int(pack.seq_lengths.max())
    return [torch.randn(B, heads, L, dim, dtype=dtype, device=device, generator=gen).requires_grad_()
            for _ in range(3)]


def _packed_inputs(pack, heads, dim, dtype, device, gen):
    T = pack.num_tokens
    return [torch.randn(T, heads, dim, dtype=dtype, device=device, generator=gen).requires_grad_()
            for _ in range(3)]


def _timings(fwd, inputs, device) -> tuple[float, float]:
    out = fwd(*inputs)
    grad = torch.randn_like(out)

    def fwd_bwd():
        fwd(*inputs).backward(grad)

    return (time_ms(lambda: fwd(*inputs), device=device),
            time_ms(fwd_bwd, grad_to_none=inputs, device=device))


def check_against_flat(pack, heads, dim, device, gen, backend: str = "triton") -> dict:
    """Relative errors of a bf16 tree_attention ``backend``'s output and grads against fp32 per-sequence
    attention."""
    from ..ops import tree_attention

    q, k, v = (x.detach() for x in _packed_inputs(pack, heads, dim, torch.float32, device, gen))
    do = torch.randn_like(q)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    padded = [pack.to_padded(x).transpose(1, 2) for x in ref]  # [B, H, L, D]
    out_pad = F.scaled_dot_product_attention(*padded, is_causal=True)
    out_ref = pack.from_padded(out_pad.transpose(1, 2))
    out_ref.backward(do)
    low = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out = tree_attention(*low, pack, backend=backend)
    out.backward(do.to(torch.bfloat16))

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    return {"rel_err_out": rel(out, out_ref), "rel_err_dq": rel(low[0].grad, ref[0].grad),
            "rel_err_dk": rel(low[1].grad, ref[1].grad), "rel_err_dv": rel(low[2].grad, ref[2].grad)}


def run_case(case: TreeCase, *, heads: int, dim: int, dtype, device, backends, check: bool) -> list[dict]:
    from ..ops import tree_attention
    from ..ops.flat_tree import flat_pair_ratio
    from ..ops.tile_census import partial_tile_share
    from ..ops.tree import choose_tree_backend

    trie = RolloutTrie.from_sequences(case.sequences)
    stats = trie.stats()
    pack = trie.pack().to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    base = {"case": case.name, "T": pack.num_tokens, "flat_tokens": stats["flat_tokens"],
            "sequences": stats["num_sequences"], "ideal": stats["ideal_attention_ratio"],
            "token_ratio": stats["token_ratio"],  # and the pack features backend="auto" decides by:
            "flat_pair_ratio": flat_pair_ratio(pack), "partial_tile_share": partial_tile_share(pack)}
    pairs = {"flat": stats["flat_attention_pairs"], "tree": stats["tree_attention_pairs"]}
    rows = []
    for backend in backends:
        if backend == "flat":
            inputs = _flat_inputs(pack, heads, dim, dtype, device, gen)
            fwd = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            inputs = _packed_inputs(pack, heads, dim, dtype, device, gen)
            fwd = lambda q, k, v, b=TREE_BACKENDS[backend]: tree_attention(q, k, v, pack, backend=b)
        fwd_ms, fwd_bwd_ms = _timings(fwd, inputs, device)
        useful = pairs["flat" if backend == "flat" else "tree"] * 4 * heads * dim
        rows.append({**base, "backend": backend, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
                     "fwd_tflops": useful / fwd_ms / 1e9, "fwd_bwd_tflops": 3.5 * useful / fwd_bwd_ms / 1e9})
        if backend == "auto":
            rows[-1]["auto_picks"] = ROW_OF_BACKEND[choose_tree_backend("auto", pack, device, dtype, dim)]
        del inputs
    flat = next((r for r in rows if r["backend"] == "flat"), None)
    for r in rows:
        if flat is not None:
            r["fwd_speedup"] = flat["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_speedup"] = flat["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    for r in rows:
        if check and r["backend"] in ("triton", "gather-flat", "varlen", "fa4"):
            r.update(check_against_flat(pack, heads, dim, device, gen, TREE_BACKENDS[r["backend"]]))
    return rows


def auto_summary(rows: list[dict]) -> list[dict]:
    """One row per case: auto's pick and speed beside flat SDPA, the triton kernel and the fastest other
    tree_attention backend of the case (fwd+bwd; flat SDPA is the baseline, not a backend)."""
    by = {(r["case"], r["backend"]): r for r in rows}
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        auto, flat, triton = (by.get((case, b)) for b in ("auto", "flat", "triton"))
        if auto is None:
            continue
        others = [r for r in rows if r["case"] == case and r["backend"] not in ("auto", "reference", "flat")]
        row = {"case": case, "ideal": auto["ideal"], "auto_picks": auto.get("auto_picks"),
               "auto_fwd_bwd_ms": auto["fwd_bwd_ms"]}
        if others:
            fastest = min(others, key=lambda r: r["fwd_bwd_ms"])
            row.update(fastest=fastest["backend"], auto_x_fastest=fastest["fwd_bwd_ms"] / auto["fwd_bwd_ms"])
        if flat is not None:
            row.update(flat_fwd_bwd_ms=flat["fwd_bwd_ms"], auto_fwd_x_flat=flat["fwd_ms"] / auto["fwd_ms"],
                       auto_x_flat=flat["fwd_bwd_ms"] / auto["fwd_bwd_ms"])
        if triton is not None:
            row["auto_x_triton"] = triton["fwd_bwd_ms"] / auto["fwd_bwd_ms"]
        out.append(row)
    return out


COLUMNS = [("case", "case"), ("T", "packed T"), ("backend", "backend"), ("fwd_ms", "fwd ms"),
           ("fwd_bwd_ms", "fwd+bwd ms"), ("fwd_speedup", "fwd x flat"), ("fwd_bwd_speedup", "fwd+bwd x flat"),
           ("ideal", "ideal"), ("fwd_tflops", "fwd TFLOP/s"), ("fwd_bwd_tflops", "fwd+bwd TFLOP/s"),
           ("auto_picks", "auto picks")]
AUTO_COLUMNS = [("case", "case"), ("ideal", "ideal"), ("auto_picks", "auto picks"),
                ("flat_fwd_bwd_ms", "flat SDPA fwd+bwd ms"), ("auto_fwd_bwd_ms", "auto fwd+bwd ms"),
                ("auto_x_flat", "auto fwd+bwd x flat"), ("auto_fwd_x_flat", "auto fwd x flat"),
                ("auto_x_triton", "auto x triton"), ("fastest", "fastest backend"),
                ("auto_x_fastest", "auto x fastest")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench tree", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", choices=["research", "data", "all", "quick"], default=None,
                        help="default: all on a GPU, quick on the CPU")
    parser.add_argument("--backends", default=None, type=choice_list(["flat", *TREE_BACKENDS]),
                        help="comma list of flat,flex,triton,gather-flat,varlen,fa4,auto (and reference); "
                             "default: all but reference on a GPU (fa4 where it is available), all but flex "
                             "and fa4 on the CPU")
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--dim", type=positive_int, default=128)
    parser.add_argument("--check", action="store_true",
                        help="also check the bf16 triton, gather-flat, varlen and fa4 rows against fp32 flat")
    add_out_argument(parser)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    which = args.cases or ("all" if cuda else "quick")
    cases = {"research": research_cases, "data": dataset_cases, "quick": quick_cases,
             "all": lambda: research_cases() + dataset_cases()}[which]()
    fa4 = ["fa4"] if "fa4" in available_backends(device) else []
    backends = args.backends or (
        ["flat", "flex", "triton", "gather-flat", "varlen", *fa4, "auto"] if cuda
        else ["flat", "reference", "triton", "gather-flat", "varlen", "auto"])
    heads, dim = (args.heads, args.dim) if cuda or args.cases else (2, 16)

    rows = []
    for case in tqdm(cases, desc="bench tree", unit="case"):
        rows += run_case(case, heads=heads, dim=dim, dtype=dtype, device=device, backends=backends,
                         check=args.check and cuda)
    env = environment()
    title = f"tree attention, {env['device']}, {str(dtype).removeprefix('torch.')}, {heads} heads x {dim}"
    columns = COLUMNS + ([("rel_err_out", "err out"), ("rel_err_dk", "err dk")] if args.check else [])
    print_table(title, columns, rows)
    summary = auto_summary(rows)
    if summary:
        print_table(f"auto against flat SDPA and triton (fwd+bwd), {env['device']}", AUTO_COLUMNS, summary)
    path = write_results("tree", rows, env, directory=args.out,
                         extra={"dtype": str(dtype), "heads": heads, "head_dim": dim})
    print(f"wrote {path}")
    return 0
