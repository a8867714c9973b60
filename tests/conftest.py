"""Shared test setup: the Triton interpreter switch, hypothesis profiles and rollout strategies.

Test modules import the strategies with ``from tests.conftest import rollout_forests`` (pytest runs in
``--import-mode=importlib``, which registers this file as ``tests.conftest``).
"""

import contextlib
import os
from unittest import mock

import torch

if not torch.cuda.is_available():  # before treeattn_lab (and any Triton kernel) is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        # the tests use tiny tensors: intra-op threads only fight each other (and xdist workers) for cores
        torch.set_num_threads(1)

import hypothesis.strategies as st  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import treeattn_lab  # noqa: E402, F401  (configures Triton before any kernel module)

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("ci"),
    max_examples=500,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def under_ci() -> bool:
    """Whether this run is CI's (``CI`` or ``TREEATTN_REQUIRE_BROWSER=1``), which builds everything the
    suite needs: a missing browser or venv then fails a test instead of skipping it."""
    return bool(os.environ.get("CI")) or os.environ.get("TREEATTN_REQUIRE_BROWSER") == "1"


# ---------------------------------------------------------------------------------------------- forests
def _tokens(draw, tok, lo: int, hi: int) -> list[int]:
    """A list of ``lo..hi`` tokens; the length is drawn first so long lists are as likely as short ones."""
    n = draw(st.integers(lo, hi))
    return draw(st.lists(tok, min_size=n, max_size=n))


@st.composite
def rollout_forests(draw, max_sequences: int = 8, max_len: int = 20, max_vocab: int = 50):
    """A list of rollouts (lists of non-negative ints) shaped like RL rollouts, awkward cases included.

    Mixes fresh sequences, exact duplicates, sequences that are prefixes of earlier ones, extensions of
    earlier ones (which makes the earlier one a prefix), single-token rollouts, deep chains (one long
    rollout plus prefixes of it) and wide fans (a shared prompt forking into many short tails). A tiny
    vocabulary is drawn often so that independent rollouts collide on their first tokens.
    """
    vocab = draw(st.sampled_from([1, 2, 3, 5, max_vocab]))
    tok = st.integers(0, vocab - 1)
    shape = draw(st.sampled_from(["mixed", "mixed", "chain", "fan", "singles"]))
    seqs: list[list[int]] = []
    if shape == "chain":
        base = _tokens(draw, tok, 1, 3 * max_len)
        seqs.append(base)
        for _ in range(draw(st.integers(0, max_sequences - 1))):
            seqs.append(base[: draw(st.integers(1, len(base)))])
    elif shape == "fan":
        prompt = _tokens(draw, tok, 0, max_len)
        for _ in range(draw(st.integers(1, 2 * max_sequences))):
            seqs.append(prompt + _tokens(draw, st.integers(0, max_vocab - 1), 0 if prompt else 1, 2))
    elif shape == "singles":
        seqs = [_tokens(draw, tok, 1, 1) for _ in range(draw(st.integers(1, max_sequences)))]
    else:
        for _ in range(draw(st.integers(1, max_sequences))):
            kind = draw(st.sampled_from(["fresh", "extend", "prefix", "duplicate"])) if seqs else "fresh"
            if kind == "fresh":
                seqs.append(_tokens(draw, tok, 1, max_len))
                continue
            base = seqs[draw(st.integers(0, len(seqs) - 1))]
            if kind == "duplicate":
                seqs.append(list(base))
            elif kind == "prefix":
                seqs.append(base[: draw(st.integers(1, len(base)))])
            else:
                cut = draw(st.integers(0, len(base)))
                seqs.append(base[:cut] + _tokens(draw, tok, 0 if cut else 1, max_len // 2))
    perm = draw(st.permutations(range(len(seqs))))
    return [seqs[i] for i in perm]


@st.composite
def long_rollout_forests(draw, min_trunk: int = 100, max_trunk: int = 300):
    """Forests of a few hundred packed tokens: a long shared trunk, rollouts forking off it at random
    depths (some ending inside it), plus a small random forest beside it. Crosses 128-token blocks."""
    vocab = draw(st.sampled_from([2, 1000]))
    tok = st.integers(0, vocab - 1)
    trunk = _tokens(draw, tok, min_trunk, max_trunk)
    seqs = [trunk]
    for _ in range(draw(st.integers(0, 5))):
        cut = draw(st.integers(1, len(trunk)))
        seqs.append(trunk[:cut] + _tokens(draw, tok, 0, 40))
    seqs += draw(rollout_forests(max_sequences=3))
    perm = draw(st.permutations(range(len(seqs))))
    return [seqs[i] for i in perm]


@st.composite
def rollout_inputs(draw, forest=None):
    """``(forest, inputs)``: the same rollouts, each given as a list, tuple or integer tensor."""
    forest = draw(rollout_forests()) if forest is None else forest
    inputs = []
    for s in forest:
        kind = draw(st.sampled_from(["list", "tuple", "int64", "int32", "int16"]))
        if kind == "list":
            inputs.append(list(s))
        elif kind == "tuple":
            inputs.append(tuple(s))
        else:
            dtype = getattr(torch, kind)
            inputs.append(torch.tensor(s, dtype=dtype))
    return forest, inputs


# ---------------------------------------------------------------------------------------------- tensors
seeds = st.integers(0, 2**32 - 1)
orders = st.sampled_from(["insertion", "size"])


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape, dtype=torch.float64, requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen, dtype=dtype)
    return x.requires_grad_(requires_grad)


@st.composite
def head_configs(draw):
    """``(Hq, Hkv, D)``: plain multi-head (Hq = Hkv), GQA with Hq = 2 Hkv and a few other groupings."""
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 2, 3]))
    d = draw(st.sampled_from([2, 3, 8, 16]))
    return hkv * group, hkv, d


def distinct_prefixes(seqs) -> set[tuple[int, ...]]:
    """Every non-empty prefix of every rollout, each once."""
    return {tuple(s[: j + 1]) for s in seqs for j in range(len(s))}


# ------------------------------------------------------------------------------ kernel checks
@contextlib.contextmanager
def poisoned_allocations(kernel_module, **patches):
    """Make ``kernel_module``'s ``torch.empty`` / ``torch.empty_like`` return NaN-filled tensors, so any
    element a kernel forgets to write fails the comparison; ``patches`` overrides other module attributes
    for the duration (e.g. a test hook)."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    def nan_empty_like(x, **kwargs):
        return empty_like(x, **kwargs).fill_(float("nan"))

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(kernel_module.torch, "empty", nan_empty))
        stack.enter_context(mock.patch.object(kernel_module.torch, "empty_like", nan_empty_like))
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(kernel_module, name, value))
        yield


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float | None = None) -> float:
    """``||a - b|| / ||b||`` in float64 on the CPU, the denominator floored at ``floor`` (default
    sqrt(numel): gradients that are exactly zero, e.g. a query that sees only itself, then compare per
    element instead of as noise over zero)."""
    b = b.detach().cpu().double()
    floor = b.numel() ** 0.5 if floor is None else floor
    return float((a.detach().cpu().double() - b).norm() / max(float(b.norm()), floor))


def tree_backend_inputs(pack, heads, seed: int, dtype):
    """Packed ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` and an output gradient for ``heads = (Hq, Hkv, D)``."""
    hq, hkv, d = heads
    g = generator(seed)
    T = pack.num_tokens
    q, k, v = (randn(g, T, h, d, dtype=dtype) for h in (hq, hkv, hkv))
    return q, k, v, randn(g, T, hq, d, dtype=dtype)


def check_tree_backend(pack, heads, seed: int, dtype, backend: str, tol: float, *, scale=None,
                       context=None) -> torch.Tensor:
    """``tree_attention(backend=...)`` (run inside ``context``, e.g. :func:`poisoned_allocations`) against
    the float64 einops reference: output and the gradients of q, k and v within ``tol``. Returns the
    output. The inputs are copies: the test also checks that the backend left them unchanged."""
    from treeattn_lab import reference, tree_attention

    q, k, v, do = tree_backend_inputs(pack, heads, seed, dtype)
    got = [x.clone().requires_grad_() for x in (q, k, v)]
    with context or contextlib.nullcontext():
        out = tree_attention(*got, pack, scale=scale, backend=backend)
        out.backward(do)
    want = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference.tree_attention(*want, pack.subtree_end, scale=scale)
    ref.backward(do.double())
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tol
    for x, w, original, name in zip(got, want, (q, k, v), "qkv", strict=True):
        assert torch.equal(x.detach(), original), f"{name} was modified"
        assert torch.isfinite(x.grad).all(), f"d{name} has non-finite entries"
        assert relative_error(x.grad, w.grad) < tol, f"d{name} differs"
    return out


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group for the test (skipped when this process already has one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def long_forest(seed: int) -> list[list[int]]:
    """Six rollouts below a shared trunk of 150-227 tokens, each 40-299 tokens more: blocks of a few
    128-token tiles at ``block_tokens`` 333."""
    g = torch.Generator().manual_seed(seed)
    trunk = torch.randint(1, 99, (150 + seed * 77,), generator=g).tolist()
    tails = [int(n) for n in torch.randint(40, 300, (6,), generator=g)]
    return [trunk + torch.randint(1, 99, (n,), generator=g).tolist() for n in tails]
