"""``python -m treeattn_lab bench compile``: a TinyLM packed training step, eager against torch.compile.

The step: TinyLM logits for every token of a packed rollout trie, attention through
``tree_attention(..., backend=B)`` (``auto`` and ``triton``), a cross-entropy loss of each packed token
against the next packed token (a stand-in objective: the timing is the point), and its backward. Eager
runs it as it is; compiled runs the same function through ``torch.compile(fullgraph=True)`` (inductor by
default, ``--compile-backend``), the backward through the compiled graph's own backward. On a GPU the
model is the 0.49B TinyLM of ``bench train`` in bf16 over the first ``--rollouts`` rollouts of a bundled
GRPO-like set; ``--quick`` (the default on a CPU) runs the tiny model in fp32 over a shrunk subset.

Before compiling, the eager steps have cached on the pack what the backends build with host work (the
Triton tile schedules, the flat-or-tree decision of ``auto``). ``TinyLM.forward``'s host-side check of
the token ids runs in the eager steps; a fullgraph trace skips it.

Reported per (backend, mode): the backend ``auto`` ran, the median step time, the first compiled call
(tracing and compilation included), the speed-up over eager, and the compiled loss's and gradients'
relative difference from eager. A mode that fails is a row with its error; ``--budget-s`` skips the
compiled rows that would start after that many seconds (a 24-layer model compiles in about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..ops import tree_attention
from ..ops.tree import choose_tree_backend
from ..reference import TinyLM
from ..trie import RolloutTrie
from .harness import (
    add_out_argument,
    choice_list,
    environment,
    flat_gradient,
    positive_int,
    print_table,
    synchronize,
    write_results,
)
from .train import LLAMA_05B, TINY, rollout_set

BACKENDS = ("auto", "triton")
COLUMNS = [
    ("backend", "backend"),
    ("ran", "ran"),
    ("mode", "mode"),
    ("step_ms", "step ms"),
    ("first_call_s", "first call s"),
    ("speedup", "x eager"),
    ("loss_rel_diff", "loss diff"),
    ("grad_rel_diff", "grad diff"),
    ("error", "error"),
]


def step_loss(model: TinyLM, pack, targets: torch.Tensor, backend: str) -> torch.Tensor:
    """The step's loss: cross-entropy of every packed token's logits against ``targets``."""
    logits = model.forward_packed(pack, lambda q, k, v: tree_attention(q, k, v, pack, backend=backend))
    return F.cross_entropy(logits.float(), targets)


def run_step(model, loss_fn) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One step (fresh gradients, loss, backward): ``(seconds, loss, flat gradient)``."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    synchronize(device)
    t0 = time.perf_counter()
    loss = loss_fn()
    loss.backward()
    synchronize(device)
    seconds = time.perf_counter() - t0
    return seconds, loss.detach().float(), flat_gradient(model)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def timed_mode(model, loss_fn, reps: int) -> dict:
    """The first call's time, then the median of ``reps`` steps; the last step's loss and gradients."""
    first, loss, grads = run_step(model, loss_fn)
    times = []
    for _ in range(reps):
        seconds, loss, grads = run_step(model, loss_fn)
        times.append(seconds)
    return {"first_call_s": first, "step_ms": 1e3 * statistics.median(times), "loss_t": loss,
            "grads_t": grads}


def backend_rows(model, pack, backend: str, *, reps: int, compile_backend: str,
                 compile_allowed: bool) -> list[dict]:
    """The eager row and the compiled row of one tree backend (a failed mode reports its error)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    targets = pack.input_ids.roll(-1)
    base = {"backend": backend, "ran": choose_tree_backend(backend, pack, device, dtype, model.cfg.head_dim)}

    def loss_fn():
        return step_loss(model, pack, targets, backend)
    eager = _attempt(lambda: timed_mode(model, loss_fn, reps))
    if compile_allowed:
        torch._dynamo.reset()
        compiled_loss = torch.compile(step_loss, fullgraph=True, backend=compile_backend)

        def compiled_fn():
            return compiled_loss(model, pack, targets, backend)

        compiled = _attempt(lambda: timed_mode(model, compiled_fn, reps))
    else:
        compiled = {"error": "skipped: past --budget-s"}
    if "error" not in compiled and "error" not in eager:
        compiled["speedup"] = eager["step_ms"] / compiled["step_ms"]
        compiled["loss_rel_diff"] = _rel(compiled["loss_t"], eager["loss_t"])
        compiled["grad_rel_diff"] = _rel(compiled["grads_t"], eager["grads_t"])
    for result in (eager, compiled):
        result.pop("loss_t", None)
        result.pop("grads_t", None)
    return [{**base, "mode": "eager", **eager}, {**base, "mode": "compiled", **compiled}]


def _attempt(fn) -> dict:
    """``fn()``, or ``{"error": ...}`` when it raises (one failing mode must not end the run); the whole
    traceback goes to stderr, the results keep its first line."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - recorded in the results, the run goes on
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny subset (default on a CPU)")
    parser.add_argument("--backends", type=choice_list(BACKENDS), default=list(BACKENDS),
                        help="comma list of tree_attention backends: auto,triton")
    parser.add_argument("--set", default="grpo_math", choices=["grpo_math", "agentic", "tree_search",
                                                               "low_sharing"], help="bundled rollout set")
    parser.add_argument("--rollouts", type=positive_int, default=None,
                        help="its first N rollouts (default 32 on a GPU, 8 shrunk 32x quick)")
    parser.add_argument("--reps", type=positive_int, default=None, help="timed steps (default 10, quick 2)")
    parser.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                        help="torch.compile's backend (default inductor)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="start no compiled row after this many seconds of the run (default 170)")
    add_out_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    quick = args.quick or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float32 if quick else torch.bfloat16
    cfg = TINY if quick else LLAMA_05B
    seqs = rollout_set(args.set, shrink=32 if quick else 1, first=args.rollouts or (8 if quick else 32))
    pack = RolloutTrie.from_sequences(seqs).pack().to(device)
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device, dtype)
    reps = args.reps or (2 if quick else 10)
    env = environment()
    n_params = sum(p.numel() for p in model.parameters())
    extra = {"dtype": str(dtype), "params": n_params, "config": cfg.__dict__, "set": args.set,
             "rollouts": len(seqs), "packed_tokens": pack.num_tokens, "compile_backend": args.compile_backend,
             "quick": quick, "reps": reps}
    rows = []
    for backend in tqdm(args.backends, desc="bench compile", unit="backend"):
        rows += backend_rows(model, pack, backend, reps=reps, compile_backend=args.compile_backend,
                             compile_allowed=time.perf_counter() - start < args.budget_s)
        for row in rows[-2:]:
            tqdm.write(f"{row['backend']} {row['mode']}: "
                       + (row["error"] if "error" in row else f"{row['step_ms']:.1f} ms per step"))
        # written after every backend: a run cut short keeps the rows it finished
        path = write_results("compile", rows, env, directory=args.out, extra=extra)
    title = (f"TinyLM {n_params / 1e9:.2f}B packed training step, eager vs torch.compile(fullgraph=True, "
             f"backend={args.compile_backend!r}), {env['device']}, {str(dtype).removeprefix('torch.')}, "
             f"{args.set} x {len(seqs)} rollouts ({pack.num_tokens} packed tokens)")
    print_table(title, COLUMNS, rows)
    print(f"wrote {path}")
    return 0
