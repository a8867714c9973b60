"""Savings measured live on the learner's machine, at CPU scale, for the notebooks.

Each notebook shows one saving happening where it runs: fewer attended pairs taking less time (tree
against flat, sparse against dense), a balanced step on two real processes, a RAT+ model that keeps its
quality under dilation. The GPU numbers beside them come from the committed ``bench/results/*.json``
(:func:`measured_on` names where each was measured).

On a CPU the lab's Triton kernels run in Triton's interpreter, which proves them exact but is slow, so the
timings here compute the same pairs with PyTorch's CPU attention (``scaled_dot_product_attention``):

- :func:`nodewise_tree_attention` computes exactly the tree's pairs, node by node: a node's tokens
  against themselves (causal), then its whole subtree below it (one contiguous range in DFS preorder)
  against its tokens, every part merged by log-sum-exp;
- :func:`gathered_sparse_attention` computes exactly the block-rounded vertical-slash pairs: per query
  block, the keys of its selected tiles and its head's columns gathered densely, then one masked product;
- :func:`blockwise_dilated_attention` computes exactly the dilated pattern's pairs the same way: per query
  block, the first keys, the strided keys behind the window and the window, gathered.

All three are checked against the einops references in ``tests/test_demos.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F

__all__ = [
    "blockwise_dilated_attention",
    "dilated_against_dense",
    "gathered_sparse_attention",
    "load_logged_tables",
    "nodewise_tree_attention",
    "measured_balance",
    "measured_on",
    "median_seconds",
    "rat_live_config",
    "run_with_progress",
    "scaled_down",
    "sparse_against_dense",
    "split_step_time",
    "sparse_gather_plan",
    "threads",
    "time_tree_backends",
    "token_work",
    "tree_against_flat",
]


def median_seconds(fn: Callable[[], object], *, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@contextlib.contextmanager
def threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads (None: leave them), restoring the setting after."""
    before = torch.get_num_threads()
    if count is not None:
        if count < 1:
            raise ValueError(f"threads must be >= 1 or None, got {count}")
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measured_on(result: dict) -> str:
    """``"an NVIDIA H200 on 2026-11-30 (torch 2.11, triton 3.6)"``: where a committed result was measured
    (without ``on <date>`` where the result records no time, as a logged run's table does not)."""
    env = result["environment"]
    device = env["device"]
    where = "a CPU" if device == "cpu" else f"an {device}"
    when = f" on {env['time_utc'][:10]}" if env.get("time_utc") else ""
    return f"{where}{when} (torch {env['torch']}, triton {env['triton']})"


def _cell(text: str):
    """A table cell as a number where it reads as one, else its text."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def load_logged_tables(bench: str, device: str = "NVIDIA-H200", directory=None) -> dict:
    """The tables a bench run printed, from its committed log ``bench/results/<bench>__<device>__*.log``
    (runs kept as a log rather than JSON): ``{"title": the first table's title, "tables": {title: rows},
    "environment": {"device", "torch", "triton"}}``, the environment read off the file name. Each row is
    a dict by column header; a cell reads as a float where it is a number, else as its text (``""`` for
    an empty cell)."""
    from pathlib import Path

    from ..bench.harness import RESULTS_DIR

    folder = Path(directory) if directory is not None else RESULTS_DIR
    paths = sorted(folder.glob(f"{bench}__{device}__*.log"))
    if not paths:
        raise FileNotFoundError(f"no {bench}__{device}__*.log under {folder}")
    path = paths[-1]
    _, dev, torch_tag, triton_tag = path.stem.split("__")
    environment = {"device": dev.replace("-", " "),
                   "torch": torch_tag.removeprefix("torch-").replace("-", "+"),
                   "triton": triton_tag.removeprefix("triton-")}
    tables: dict[str, list[dict]] = {}
    title, header = "", None
    for line in path.read_text().splitlines():
        if line.startswith("┃"):
            header = [c.strip() for c in line.strip("┃").split("┃")]
        elif line.startswith("│") and header:
            cells = [_cell(c.strip()) for c in line.strip("│").split("│")]
            tables.setdefault(title, []).append(dict(zip(header, cells, strict=True)))
        elif line.strip() and line.strip()[0] not in "┏┡└":
            title, header = line.strip(), None
    if not tables:
        raise ValueError(f"{path.name} holds no table")
    return {"title": next(iter(tables)), "tables": tables, "environment": environment}


# -------------------------------------------------------------------------------- tree against flat
def _heads_of(k: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[..., Hkv, D]`` -> ``[..., Hq, D]``: each key/value head repeated for its query group."""
    if q_heads % k.shape[-2]:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({k.shape[-2]})")
    return k.repeat_interleave(q_heads // k.shape[-2], dim=-2)


def _attend(q, k, v, *, causal: bool):
    """``q [G, L, H, D]`` over ``k, v [G, S, H, D]`` (``G`` independent groups) with PyTorch's CPU flash
    kernel: ``(out [G, L, H, D], lse [G, L, H])``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(x.transpose(1, 2) for x in (q, k, v)), 0.0, causal)
    return out.transpose(1, 2), lse.transpose(1, 2)


def nodewise_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack) -> torch.Tensor:
    """Tree attention over ``pack`` (``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, forward) computing each of the
    tree's pairs once, node by node. Node ``n`` holds packed tokens ``[a, b)`` and its subtree is
    ``[a, e)``: its tokens attend themselves causally (nodes of equal length in one batched call), and
    every query below it (``[b, e)``, one contiguous range in DFS preorder) attends its keys with no mask.
    A query's parts, one per node on its root path, merge by log-sum-exp, as ring attention merges its
    steps."""
    from ..reference import merge_attention_states

    t = pack.num_tokens
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[0] != t:
        raise ValueError(f"expected q [T, Hq, D] and k, v [T, Hkv, D] with T = {t} packed tokens, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    k, v = _heads_of(k, q.shape[1]), _heads_of(v, q.shape[1])
    node_id = pack.node_id.cpu()
    starts = [0] + (torch.nonzero(node_id.diff()).flatten() + 1).tolist()
    ends = starts[1:] + [t]
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:2])
    by_length: dict[int, list[int]] = {}
    for a, b in zip(starts, ends, strict=True):
        by_length.setdefault(b - a, []).append(a)
    for n, firsts in by_length.items():  # every token's own node, causal
        rows = (torch.tensor(firsts)[:, None] + torch.arange(n)[None, :]).to(q.device)  # [G, n]
        out[rows], lse[rows] = _attend(q[rows], k[rows], v[rows], causal=True)
    subtree_end = pack.subtree_end.cpu()
    for a, b in zip(starts, ends, strict=True):  # the queries below each node against its keys
        e = int(subtree_end[a])
        if e > b:
            part_out, part_lse = _attend(q[None, b:e], k[None, a:b], v[None, a:b], causal=False)
            out[b:e], lse[b:e] = merge_attention_states(out[b:e], lse[b:e], part_out[0], part_lse[0])
    return out


def tree_against_flat(pack, *, heads: int = 4, dim: int = 64, repeats: int = 3, seed: int = 0,
                      num_threads: int | None = 1) -> dict:
    """Time attention over ``pack``'s rollouts two ways on this machine (forward, fp32, random inputs,
    ``heads`` of ``dim``): **flat**, every rollout causal on its own in a batch padded to the longest,
    and **tree**, the packed tree with each attended pair once (:func:`nodewise_tree_attention`).

    Returns the attended pairs (``flat_pairs``: the padded batch's causal pairs, what flat attention
    computes), both times in seconds, ``pair_ratio`` (flat / tree pairs) and ``speedup`` (flat / tree
    time). Timed on ``num_threads`` threads (one by default): the comparison then counts the work each
    side does, not how well its calls spread over cores shared with other programs."""
    gen = torch.Generator().manual_seed(seed)
    lengths = pack.seq_lengths.tolist()
    batch, longest = len(lengths), max(lengths)
    flat = [torch.randn(batch, heads, longest, dim, generator=gen) for _ in range(3)]
    tree = [torch.randn(pack.num_tokens, heads, dim, generator=gen) for _ in range(3)]
    with torch.no_grad(), threads(num_threads):
        flat_s = median_seconds(lambda: F.scaled_dot_product_attention(*flat, is_causal=True),
                                repeats=repeats)
        tree_s = median_seconds(lambda: nodewise_tree_attention(*tree, pack), repeats=repeats)
    flat_pairs = batch * longest * (longest + 1) // 2
    tree_pairs = pack.attended_pairs()
    return {"sequences": batch, "flat_tokens": batch * longest, "tree_tokens": pack.num_tokens,
            "flat_pairs": flat_pairs, "tree_pairs": tree_pairs, "pair_ratio": flat_pairs / tree_pairs,
            "flat_s": flat_s, "tree_s": tree_s, "speedup": flat_s / tree_s}


def scaled_down(trie, factor: int):
    """A copy of ``trie`` with the same shape at ``1 / factor`` of its tokens: the same rollouts and nodes,
    each node keeping its first ``ceil(tokens / factor)`` tokens (so siblings still start with different
    tokens and the radix trie is the same tree), and the token ids renumbered ``0 .. V-1`` in order of
    first use, so that a small model's vocabulary holds them (``V``: the largest id plus one). Run with
    the block size and token budget divided by ``factor`` too, a walk over the copy makes about as many
    micro-batches, blocks and model calls as one over ``trie`` (rounding each node up adds a few)."""
    from ..trie import RolloutTrie

    if int(factor) != factor or factor < 1:
        raise ValueError(f"factor must be an integer >= 1, got {factor!r}")
    kept = [node.tokens[:-(-len(node.tokens) // int(factor))] for node in trie.nodes]
    ids: dict[int, int] = {}
    rollouts = [[ids.setdefault(t, len(ids)) for n in trie.path(trie.seq_end_node[i]) for t in kept[n]]
                for i in range(trie.num_sequences)]
    return RolloutTrie.from_sequences(rollouts)


def token_work(report) -> float:
    """A step's model work in trained tokens, from its :class:`~treeattn_lab.engine.TreeBackwardReport`:
    each token run with autograd counts one, each run without (a dfs push, forward only) its forward
    share (``engine.time_fit.FORWARD_TOKEN_SHARE``)."""
    from ..engine.time_fit import FORWARD_TOKEN_SHARE

    return report.grad_tokens + FORWARD_TOKEN_SHARE * report.no_grad_tokens


def split_step_time(steps) -> dict | None:
    """Two steps' seconds split into a fixed cost per aten op and a cost per token of work: the exact
    solution of ``seconds = per_op_s * aten_ops + per_token_s * work`` for ``steps``, two dicts with
    ``seconds``, ``aten_ops`` and ``work`` (:func:`token_work`). Returns both costs and each step's
    ``op_share`` (the part of its seconds the ops' fixed cost explains), or None where the two steps
    do not pin down positive costs (proportional rows, or timings too noisy to tell)."""
    a, b = steps
    det = a["aten_ops"] * b["work"] - b["aten_ops"] * a["work"]
    if det == 0:
        return None
    per_op = (a["seconds"] * b["work"] - b["seconds"] * a["work"]) / det
    per_token = (b["seconds"] * a["aten_ops"] - a["seconds"] * b["aten_ops"]) / det
    if per_op <= 0 or per_token <= 0:
        return None
    return {"per_op_s": per_op, "per_token_s": per_token,
            "op_share": [per_op * s["aten_ops"] / s["seconds"] for s in steps]}


# ------------------------------------------------------------------------------ sparse against dense
def sparse_gather_plan(pattern, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per query block, the key positions each head computes (``[H, width]``, padded to the busiest head)
    and which entries are real (``[H, width]`` bool): the keys of the block's selected tiles, then its
    head's columns outside them, from ``pattern.block_index`` (what the kernel reads)."""
    index = pattern.block_index(num_tokens)
    bs, heads, nq = index.block_size, pattern.num_heads, index.q_blocks.numel()
    row_ptr, row_idx = index.row_ptr.long().cpu(), index.row_idx.long().cpu()
    offsets = torch.arange(bs)
    plan = []
    for b in range(nq):
        per_head = []
        for h in range(heads):
            r = h * nq + b
            tiles = (row_idx[row_ptr[r]:row_ptr[r + 1], None] * bs + offsets).flatten()
            keys = [tiles[tiles < num_tokens]]
            if index.bar_pos is not None:
                bars = index.bar_pos[h, :int(index.bar_count[h, b])].long().cpu()
                keys.append(bars[index.bar_skip[h, b].cpu()[bars // bs] == 0])
            per_head.append(torch.cat(keys))
        width = max(x.numel() for x in per_head)
        positions = torch.zeros(heads, width, dtype=torch.long)
        valid = torch.zeros(heads, width, dtype=torch.bool)
        for h, x in enumerate(per_head):
            positions[h, :x.numel()], valid[h, :x.numel()] = x, True
        plan.append((positions, valid))
    return plan


def gathered_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern,
                              plan: list | None = None) -> torch.Tensor:
    """Causal attention of ``q [N, Hq, D]`` over ``k, v [N, Hkv, D]`` restricted to ``pattern``'s
    block-rounded pairs (those of ``pattern.dense_mask``), computed block by block: each query block's
    keys (:func:`sparse_gather_plan`, built once per pattern and length) are gathered densely and attended
    in one masked product. Work grows with the pattern's pairs, not with ``N^2``."""
    n, hq, _ = q.shape
    if pattern.num_heads != hq:
        raise ValueError(f"the pattern has {pattern.num_heads} heads, q has {hq}")
    plan = sparse_gather_plan(pattern, n) if plan is None else plan
    bs = pattern.block_size
    kh, vh = _heads_of(k, hq), _heads_of(v, hq)
    heads = torch.arange(hq, device=q.device)[:, None]
    scale = q.shape[-1] ** -0.5
    outs = []
    for b, (positions, valid) in enumerate(plan):
        q0, q1 = b * bs, min(n, b * bs + bs)
        positions, valid = positions.to(q.device), valid.to(q.device)
        rows = torch.arange(q0, q1, device=q.device)
        mask = valid[:, None, :] & (positions[:, None, :] <= rows[None, :, None])  # [H, bq, width]
        scores = q[q0:q1].transpose(0, 1) @ kh[positions, heads].transpose(1, 2) * scale  # [H, bq, width]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append((probs @ vh[positions, heads]).transpose(0, 1))
    return torch.cat(outs)


def sparse_against_dense(pattern, num_tokens: int, *, dim: int = 64, kv_heads: int | None = None,
                         repeats: int = 3, seed: int = 0, num_threads: int | None = 1) -> dict:
    """Time dense causal attention against :func:`gathered_sparse_attention` under ``pattern`` on this
    machine (forward, fp32, random inputs of ``num_tokens``). Returns both times in seconds, the
    pattern's ``density`` (computed pairs over causal pairs), ``ideal`` (1 / density) and ``speedup``.
    Timed on ``num_threads`` threads, as :func:`tree_against_flat`."""
    heads = pattern.num_heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k, v = (torch.randn(num_tokens, kv_heads or heads, dim, generator=gen) for _ in range(2))
    with torch.no_grad(), threads(num_threads):
        dense = [x.transpose(0, 1)[None] for x in (q, _heads_of(k, heads), _heads_of(v, heads))]
        dense_s = median_seconds(lambda: F.scaled_dot_product_attention(*dense, is_causal=True),
                                 repeats=repeats)
        plan = sparse_gather_plan(pattern, num_tokens)  # built once, like the kernel's block index
        sparse_s = median_seconds(lambda: gathered_sparse_attention(q, k, v, pattern, plan), repeats=repeats)
    density = pattern.density(num_tokens)
    return {"tokens": num_tokens, "density": density, "ideal": 1 / density, "dense_s": dense_s,
            "sparse_s": sparse_s, "speedup": dense_s / sparse_s}


# ---------------------------------------------------------------------------- dilated against dense
def blockwise_dilated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern, *,
                                block: int = 256) -> torch.Tensor:
    """Attention of ``q [N, Hq, D]`` over ``k, v [N, Hkv, D]`` under a
    :class:`~treeattn_lab.patterns.dilated.DilatedPattern`, block by block of queries: each block gathers
    only the keys some query of it may see (the first ``P``, the strided ones behind the window, the
    window) and attends them in one masked ``scaled_dot_product_attention`` (``pattern.visible``). Work
    grows with the pattern's pairs, about ``N^2 / (2 D)`` plus the window's, not with ``N^2``."""
    n, hq, _ = q.shape
    D, W, P = pattern.dilation, pattern.window, pattern.initial
    qh, kh, vh = (x.transpose(0, 1) for x in (q, _heads_of(k, hq), _heads_of(v, hq)))  # [H, N, d]
    outs = []
    for q0 in range(0, n, block):
        q1 = min(n, q0 + block)
        lo = max(0, q0 - W)
        strided = torch.arange(D - 1, max(D - 1, lo), D)  # every D-th key before the block's window
        keys = torch.cat([torch.arange(min(P, lo)), strided[strided >= min(P, lo)], torch.arange(lo, q1)])
        keys = keys.to(q.device)
        mask = pattern.visible(torch.arange(q0, q1, device=q.device)[:, None], keys[None, :])  # [bq, width]
        outs.append(F.scaled_dot_product_attention(qh[:, q0:q1], kh[:, keys], vh[:, keys], attn_mask=mask))
    return torch.cat(outs, dim=1).transpose(0, 1)


def dilated_against_dense(
    pattern, num_tokens: int, *, heads: int = 4, kv_heads: int | None = None, dim: int = 64, repeats: int = 3,
    seed: int = 0, num_threads: int | None = 1,
) -> dict:
    """Dense causal attention against dilated attention under ``pattern`` on this machine (forward, fp32,
    random inputs of ``num_tokens``): the times of ``scaled_dot_product_attention`` and of
    :func:`blockwise_dilated_attention`, and the bytes of the keys and values a decoder keeps after
    ``num_tokens`` tokens, all of them against a
    :class:`~treeattn_lab.ops.dilated_decode.DilatedKVCache`'s. Returns both times, ``speedup``, ``ideal``
    (dense causal pairs / the pattern's pairs), both cache sizes and ``cache_ratio``. Timed on
    ``num_threads`` threads, as :func:`tree_against_flat`."""
    from ..ops.dilated_decode import DilatedKVCache

    kv_heads = kv_heads or heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k, v = (torch.randn(num_tokens, kv_heads, dim, generator=gen) for _ in range(2))
    with torch.no_grad(), threads(num_threads):
        dense = [x.transpose(0, 1)[None] for x in (q, _heads_of(k, heads), _heads_of(v, heads))]
        dense_s = median_seconds(lambda: F.scaled_dot_product_attention(*dense, is_causal=True),
                                 repeats=repeats)
        dilated_s = median_seconds(lambda: blockwise_dilated_attention(q, k, v, pattern), repeats=repeats)
    cache = DilatedKVCache(dilation=pattern.dilation, window=pattern.window, initial=pattern.initial)
    cache.extend(k, v)
    kept = [getattr(cache, f"{part}_{x}") for part in ("initial", "window", "compact") for x in "kv"]
    dilated_bytes = sum(x.numel() * x.element_size() for x in kept)
    dense_bytes = 2 * k.numel() * k.element_size()
    return {"tokens": num_tokens, "ideal": num_tokens * (num_tokens + 1) / 2 / pattern.num_pairs(num_tokens),
            "dense_s": dense_s, "dilated_s": dilated_s, "speedup": dense_s / dilated_s,
            "dense_cache_bytes": dense_bytes, "dilated_cache_bytes": dilated_bytes,
            "cache_ratio": dense_bytes / dilated_bytes}


# ------------------------------------------------------------------------------ balance, measured
def measured_balance(timeline: list[dict]) -> dict:
    """A real step's balance from its per-rank timeline (``StepResult.timeline()``): the measured
    imbalance (slowest rank's compute over the mean), the predicted one (the plan's costs, same
    definition), and each rank's wait at the all-reduce as a share of the step."""
    if not timeline:
        raise ValueError("the timeline has no ranks")
    compute = [r["compute_s"] for r in timeline]
    predicted = [r["predicted"] for r in timeline]
    step = max(compute) + timeline[0]["reduce_s"]
    return {"measured_imbalance": max(compute) / (sum(compute) / len(compute)),
            "predicted_imbalance": max(predicted) / (sum(predicted) / len(predicted)),
            "wait_share": [r["wait_s"] / step for r in timeline],
            "slowest_rank": max(range(len(compute)), key=compute.__getitem__)}


# ---------------------------------------------------------------------------------------- RAT+ live
def rat_live_config():
    """A RAT+ experiment (``treeattn_lab.experiments.rat_dilation``) sized for a minute or two on a laptop
    CPU: the ``quick`` mode's models, windows and steps with half its batch, evaluated dense and at
    ``D = 16`` without and with a window, and a shorter adaptation. Long enough for both models to learn
    the previous bytes, which is what plain attention loses at ``D = 16`` without a window."""
    from ..experiments.rat_dilation import MODES

    return replace(MODES["quick"], batch_size=8, dilations=(1, 16), adapt_steps=10, eval_windows=16)


# ---------------------------------------------------------------------------------------- progress
def run_with_progress(fn: Callable[[], object], *, expected_s: float, desc: str):
    """``fn()`` with a ``tqdm.auto`` bar that advances with the seconds elapsed (up to ``expected_s``)
    while ``fn`` runs in a worker thread, for blocking calls (spawned ranks) that report no steps of
    their own. Returns ``fn``'s value; re-raises its exception."""
    import concurrent.futures

    from tqdm.auto import tqdm

    total = max(1, round(expected_s))
    with concurrent.futures.ThreadPoolExecutor(1) as pool, tqdm(total=total, desc=desc, unit="s") as bar:
        future = pool.submit(fn)
        start = time.monotonic()
        while not concurrent.futures.wait([future], timeout=0.5).done:
            bar.n = min(total - 1, int(time.monotonic() - start))
            bar.refresh()
        value = future.result()  # re-raises fn's exception
        bar.n = total
        bar.set_postfix_str(f"done in {time.monotonic() - start:.0f} s")
    return value


# --------------------------------------------------------------------------- backends side by side
def time_tree_backends(cases, backends, *, device, heads: int = 16, dim: int = 128, dtype=torch.bfloat16,
                       desc: str = "measurements") -> list[dict]:
    """``bench tree`` rows of every backend on every case (``bench.tree.run_case``: median ms and useful
    TFLOP/s, forward and forward+backward), measured one backend at a time under a ``tqdm.auto`` bar.

    ``cases``: ``bench.tree.TreeCase`` objects; ``backends``: bench row names (``"flat"``, flat SDPA, or a
    key of ``bench.tree.TREE_BACKENDS``). Each backend runs on its own, so the rows carry no speed-up over
    flat: divide their times."""
    from tqdm.auto import tqdm

    from ..bench.tree import TREE_BACKENDS, TreeCase, run_case

    cases, backends = list(cases), list(backends)
    if not cases or not backends:
        raise ValueError(f"need at least one case and one backend, got {len(cases)} and {len(backends)}")
    if not all(isinstance(c, TreeCase) for c in cases):
        raise TypeError(f"cases must be TreeCase objects, got {sorted({type(c).__name__ for c in cases})}")
    unknown = [b for b in backends if b != "flat" and b not in TREE_BACKENDS]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; choose from {['flat', *TREE_BACKENDS]}")
    rows = []
    with tqdm(total=len(cases) * len(backends), desc=desc) as bar:
        for case in cases:
            for b in backends:
                bar.set_postfix_str(f"{case.name}: {b}")
                rows += run_case(case, heads=heads, dim=dim, dtype=dtype, device=device, backends=[b],
                                 check=False)
                bar.update()
    return rows
