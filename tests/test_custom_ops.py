"""The Triton kernels as ``torch.library`` custom ops: opcheck, and ``torch.compile(fullgraph=True)``.

Each op (tree attention, its tile schedule, block-sparse attention, dilated attention, the gated scan)
passes ``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOT dispatch with
dynamic shapes) on small awkward sizes, forward and backward. Functions calling each op compile with
``fullgraph=True`` under the ``eager`` backend and under inductor, and their outputs and gradients equal
eager mode's. On CPU the kernels run under Triton's interpreter (fp32 here).
"""

import pytest
import torch
from torch._dynamo.exc import Unsupported
from treeattn_lab.kernels import attention_core
from treeattn_lab.kernels import block_sparse as sparse_kernel
from treeattn_lab.kernels import dilated_attention as dilated_kernel
from treeattn_lab.kernels import scan as scan_kernel
from treeattn_lab.kernels import tree_attention as tree_kernel
from treeattn_lab.kernels.tuning import LaunchConfig, ScanConfig, SparseConfig

from treeattn_lab import RolloutTrie, reference, tree_attention
from treeattn_lab.ops import dilated_attention, gated_scan, sparse_attention
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE = LaunchConfig(16, 16, 4, 1)
TREE_TILES = {"fwd_config": TILE, "dkdv_config": LaunchConfig(16, 32, 4, 1), "dq_config": TILE}
COMPILERS = ["eager", "inductor"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seed, *shapes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(DEVICE, dtype).requires_grad_() for s in shapes]


def _run(fn, inputs, *args):
    """``fn(*inputs, *args)`` and the gradients of a fixed random projection of its output."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves, *args)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _assert_compiles_like_eager(fn, inputs, *args, compiler, tol=1e-5):
    want, want_grads = _run(fn, inputs, *args)
    got, got_grads = _run(torch.compile(fn, fullgraph=True, backend=compiler), inputs, *args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------- tree
def _pack():
    seqs = [[1, 2, 3, 4] * 5, [1, 2, 5] * 7, [1, 2, 5, 6] * 3, [7, 8] * 9, [1, 2, 3]]
    return RolloutTrie.from_sequences(seqs).pack().to(DEVICE)  # 59 tokens: no tile size divides it


def _tree_op_args(pack, hq=4, hkv=2, d=16, seed=0):
    q, k, v = _inputs(seed, (pack.num_tokens, hq, d), (pack.num_tokens, hkv, d), (pack.num_tokens, hkv, d))
    fwd, dkdv = (tree_kernel.tile_schedule(pack.subtree_end, 16, n) for n in (16, 32))
    schedule = [fwd["fwd_ptr"], fwd["fwd_idx"], dkdv["bwd_ptr"], dkdv["bwd_idx"], fwd["fwd_ptr"],
                fwd["fwd_idx"]]
    launches = [16, 16, 4, 1, 0, 16, 32, 4, 1, 0, 16, 16, 4, 1, 0]
    return q, k, v, pack.subtree_end, schedule, 0.3, launches


@pytest.mark.parametrize("split_groups", [False, True])
def test_tree_ops_pass_opcheck(split_groups):
    args = (*_tree_op_args(_pack()), split_groups)
    torch.library.opcheck(tree_kernel.tree_attention_fwd, args)
    q, k, v = args[:3]
    o, lse = tree_kernel.tree_attention_fwd(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(tree_kernel.tree_attention_bwd, (do, q.detach(), k.detach(), v.detach(), o.detach(),
                                                           lse.detach(), *args[3:]))


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 32), (32, 16)])
def test_tree_schedule_op_passes_opcheck_and_equals_tile_schedule(block_m, block_n):
    pack = _pack()
    torch.library.opcheck(tree_kernel.tree_schedule_op, (pack.subtree_end, block_m, block_n))
    want = tree_kernel.tile_schedule(pack.subtree_end, block_m, block_n)
    got = tree_kernel.tree_schedule_op(pack.subtree_end, block_m, block_n)
    for name, tensor in zip(("fwd_ptr", "fwd_idx", "bwd_ptr", "bwd_idx"), got, strict=True):
        assert torch.equal(tensor, want[name]), name


def _tree_fn(pack):
    def fn(q, k, v):
        return tree_kernel.triton_tree_attention(q, k, v, pack, scale=0.3, **TREE_TILES)
    return fn


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("cached", [True, False])
def test_tree_attention_compiles_fullgraph_like_eager(compiler, cached):
    """A pack whose schedule is cached reads it; a fresh one builds it inside the graph (not cached)."""
    pack = _pack()
    inputs = _inputs(1, (pack.num_tokens, 4, 16), (pack.num_tokens, 2, 16), (pack.num_tokens, 2, 16))
    compiled_pack = pack if cached else _pack()
    want, want_grads = _run(_tree_fn(pack), inputs)  # eager: caches the schedules on `pack`
    got, got_grads = _run(torch.compile(_tree_fn(compiled_pack), fullgraph=True, backend=compiler), inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert bool(compiled_pack._cache) == cached  # the graph built its schedules without caching them
    ref = reference.tree_attention(*(x.detach().double() for x in inputs), pack.subtree_end, scale=0.3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_tree_attention_compiles_once_for_packs_of_every_size():
    """Packs of three sizes through one compiled function: the second size recompiles with a symbolic
    token count (the fake implementations' shapes, the schedule's dynamic size), the third reuses it."""
    compiled = torch.compile(lambda q, k, v, pack: tree_kernel.triton_tree_attention(q, k, v, pack,
                                                                                     **TREE_TILES),
                             fullgraph=True, backend="eager")
    for seqs in ([[1, 2, 3] * 9, [1, 2, 4] * 5], [[1, 2, 3] * 13, [1, 2, 4] * 5, [5] * 7],
                 [[1, 2, 3] * 4, [7, 2, 4] * 11, [5] * 3]):
        pack = RolloutTrie.from_sequences(seqs).pack().to(DEVICE)
        T = pack.num_tokens
        inputs = _inputs(len(seqs), (T, 4, 16), (T, 2, 16), (T, 2, 16))
        got, got_grads = _run(compiled, inputs, pack)
        want, want_grads = _run(reference.tree_attention, inputs, pack.subtree_end)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_tree_attention_through_the_public_entry_point_compiles():
    pack = _pack()
    inputs = _inputs(2, (pack.num_tokens, 4, 32), (pack.num_tokens, 4, 32), (pack.num_tokens, 4, 32))

    def fn(q, k, v):
        return tree_attention(q, k, v, pack, backend="triton")

    _assert_compiles_like_eager(fn, inputs, compiler="eager")


# ---------------------------------------------------------------------------------------- dilated
DILATED_LAUNCHES = [TILE, LaunchConfig(16, 32, 4, 1), LaunchConfig(32, 16, 4, 1)]


@pytest.mark.parametrize("pattern", [[3, 5, 7], [2, 0, 0], [4, 17, 3]])
def test_dilated_ops_pass_opcheck(pattern):
    q, k, v = _inputs(3, (2, 53, 4, 16), (2, 53, 2, 16), (2, 53, 2, 16))
    args = (q, k, v, 0.3, pattern, attention_core.launch_ints(*DILATED_LAUNCHES))
    torch.library.opcheck(dilated_kernel.dilated_attention_fwd, args)
    o, lse = dilated_kernel.dilated_attention_fwd(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(dilated_kernel.dilated_attention_bwd,
                          (do, *(x.detach() for x in (q, k, v, o, lse)), *args[3:]))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_dilated_attention_compiles_fullgraph_like_eager(compiler):
    inputs = _inputs(4, (61, 4, 16), (61, 2, 16), (61, 2, 16))

    def fn(q, k, v):
        return dilated_kernel.triton_dilated_attention(q, k, v, dilation=3, window=6, initial=2, scale=0.3,
                                                       fwd_config=TILE, dkdv_config=TILE, dq_config=TILE)

    _assert_compiles_like_eager(fn, inputs, compiler=compiler)

    def public(q, k, v):
        return dilated_attention(q, k, v, dilation=3, window=6, initial=2, backend="triton")

    _assert_compiles_like_eager(public, inputs, compiler="eager")


# ------------------------------------------------------------------------------------------- scan
SCAN_CONFIG = ScanConfig(8, 4, 1, 1, unroll=3, window=2)


def _gates(seed, shape):
    x, g = _inputs(seed, shape, shape)
    return x, torch.sigmoid(g.detach()).requires_grad_()


def test_scan_ops_pass_opcheck():
    x, g = _gates(5, (2, 37, 6))
    config = scan_kernel._config_ints(SCAN_CONFIG)
    torch.library.opcheck(scan_kernel.gated_scan_fwd, (x, g, config))
    h = scan_kernel.gated_scan_fwd(x, g, config)
    dh = torch.randn_like(h)
    torch.library.opcheck(scan_kernel.gated_scan_bwd, (x.detach(), g.detach(), h.detach(), dh, config))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_gated_scan_compiles_fullgraph_like_eager(compiler):
    inputs = _gates(6, (3, 29, 5))

    def fn(x, g):
        return scan_kernel.triton_gated_scan(x, g, dim=1, config=SCAN_CONFIG)

    _assert_compiles_like_eager(fn, inputs, compiler=compiler)
    _assert_compiles_like_eager(lambda x, g: gated_scan(x, g, dim=1, backend="triton"), inputs,
                                compiler="eager")


# ----------------------------------------------------------------------------------- block-sparse
SPARSE_CONFIG = SparseConfig(bar=16, split=2)


def _sparse_pattern(n=75, heads=4, seed=8, n_vertical=9):
    gen = torch.Generator().manual_seed(seed)
    vertical = torch.randint(-1, n, (heads, n_vertical), generator=gen)
    slash = torch.randint(-1, n, (heads, 5), generator=gen)
    slash[:, 0] = 0
    return VerticalSlashPattern(vertical, slash, 16).to(DEVICE)


@pytest.mark.parametrize("n_vertical", [9, 0])
def test_sparse_ops_pass_opcheck(n_vertical):
    index = _sparse_pattern(n_vertical=n_vertical).block_index(75)
    q, k, v = _inputs(9, (75, 4, 16), (75, 2, 16), (75, 2, 16))
    tensors, sizes = sparse_kernel._call(q, k, index, SPARSE_CONFIG).op_args()
    args = (q, k, v, tensors, 0.3, sizes)
    torch.library.opcheck(sparse_kernel.sparse_attention_fwd, args)
    o, lse, bar_k, bar_v = sparse_kernel.sparse_attention_fwd(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(sparse_kernel.sparse_attention_bwd,
                          (do, *(x.detach() for x in (q, k, v, o, lse, bar_k, bar_v)), *args[3:]))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_sparse_attention_compiles_fullgraph_like_eager(compiler):
    pattern = _sparse_pattern()
    index = pattern.block_index(75)
    inputs = _inputs(10, (75, 4, 16), (75, 2, 16), (75, 2, 16))

    def fn(q, k, v):
        return sparse_kernel.triton_sparse_attention(q, k, v, index, scale=0.3, config=SPARSE_CONFIG)

    _assert_compiles_like_eager(fn, inputs, compiler=compiler)  # the eager run prepares the index
    _assert_compiles_like_eager(lambda q, k, v: sparse_attention(q, k, v, pattern, backend="triton"), inputs,
                                compiler="eager")


def test_compiling_an_unprepared_sparse_call_is_refused_clearly():
    pattern = _sparse_pattern(seed=11)
    q, k, v = _inputs(12, (75, 4, 16), (75, 2, 16), (75, 2, 16))
    # fullgraph reports the ValueError as the reason it cannot trace; without fullgraph the call runs eagerly
    with pytest.raises((ValueError, Unsupported), match="cannot build a block-sparse index"):
        torch.compile(lambda q, k, v: sparse_attention(q, k, v, pattern, backend="triton"), fullgraph=True,
                      backend="eager")(q, k, v)
    index = pattern.block_index(75)
    sparse_kernel.prepare(index, None, group=2)
    got = torch.compile(lambda q, k, v: sparse_attention(q, k, v, pattern, backend="triton"), fullgraph=True,
                        backend="eager")(q, k, v)
    torch.testing.assert_close(got, sparse_attention(q, k, v, pattern, backend="triton"), rtol=0, atol=0)


# ------------------------------------------------------------------------------ flat and varlen backends
def _flat_or_varlen_dtype(backend):
    """float32, except varlen on CUDA, which runs FlashAttention there and takes only fp16 / bf16."""
    return torch.bfloat16 if backend == "varlen" and DEVICE == "cuda" else torch.float32


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", ["flat", "varlen"])
def test_flat_and_varlen_backends_compile_fullgraph_once_their_plan_is_cached(backend, compiler):
    pack = _pack()
    dtype = _flat_or_varlen_dtype(backend)
    inputs = _inputs(13, (pack.num_tokens, 4, 16), (pack.num_tokens, 2, 16), (pack.num_tokens, 2, 16),
                     dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def fn(q, k, v):
        return tree_attention(q, k, v, pack, backend=backend)

    _assert_compiles_like_eager(fn, inputs, compiler=compiler, tol=tol)  # the eager run caches the plan
    ref = reference.tree_attention(*(x.detach().double() for x in inputs), pack.subtree_end)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend=compiler)(*inputs).double(), ref,
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["flat", "varlen"])
def test_compiling_flat_or_varlen_on_a_pack_without_a_plan_is_refused_clearly(backend):
    pack = _pack()
    q, k, v = _inputs(14, (pack.num_tokens, 2, 16), (pack.num_tokens, 2, 16), (pack.num_tokens, 2, 16),
                      dtype=_flat_or_varlen_dtype(backend))
    with pytest.raises((ValueError, Unsupported), match="run the call once eagerly on this pack"):
        torch.compile(lambda q, k, v: tree_attention(q, k, v, pack, backend=backend), fullgraph=True,
                      backend="eager")(q, k, v)
    assert not pack._cache  # nothing half-built was left behind


def test_varlen_backend_calls_the_public_varlen_api_with_causal_gqa_and_scale(monkeypatch):
    """Flash runs on CUDA only: on a CPU a stand-in for ``varlen_attn`` checks the arguments and computes
    what flash would (bottom-right causal per sequence), through the same call the CUDA path makes."""
    from treeattn_lab.ops import varlen_tree

    calls = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        calls.append((window_size, enable_gqa, scale, max_q, max_k))
        assert torch.equal(cu_q, plan.cu_q) and torch.equal(cu_k, plan.cu_k)
        return reference.masked_attention(q, k, v, varlen_tree.varlen_mask(plan), scale=scale)

    monkeypatch.setattr(varlen_tree, "VARLEN_ATTN", stand_in)
    pack = _pack()
    plan = varlen_tree.varlen_plan(pack)
    q, k, v = (x.detach() for x in _inputs(15, (pack.num_tokens, 4, 16), (pack.num_tokens, 2, 16),
                                           (pack.num_tokens, 2, 16)))
    keys, values = k.index_select(0, plan.key_rows), v.index_select(0, plan.key_rows)
    out = varlen_tree._flash_varlen(q, keys, values, plan, 0.3)
    assert calls == [((-1, 0), True, 0.3, plan.max_q, plan.max_k)]
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, pack.subtree_end, scale=0.3))


def test_varlen_backend_takes_the_public_api_only_with_the_arguments_it_passes(monkeypatch):
    """``varlen_attn`` is used when it takes ``window_size``, ``scale`` and ``enable_gqa`` (torch 2.13's
    does); one lacking any of them leaves the backend on the private aten path."""
    import torch.nn.attention.varlen as public
    from torch.torch_version import TorchVersion

    from treeattn_lab.ops import varlen_tree

    def full(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False): ...

    def no_window(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False, enable_gqa=False): ...

    if TorchVersion(torch.__version__) >= "2.13":
        assert varlen_tree._public_varlen_attn() is public.varlen_attn
    monkeypatch.setattr(public, "varlen_attn", full)
    assert varlen_tree._public_varlen_attn() is full
    monkeypatch.setattr(public, "varlen_attn", no_window)
    assert varlen_tree._public_varlen_attn() is None


# ------------------------------------------------------------------------------------------ TinyLM
@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_tinylm_packed_training_step_compiles_fullgraph_like_eager(compiler):
    """forward_packed's layers with ``tree_attention(..., backend="triton")``, a loss and its backward:
    compiled with fullgraph=True (``aot_eager`` traces the backward graph too, through the backward ops)."""
    from treeattn_lab.bench.compile import run_step, step_loss
    from treeattn_lab.bench.train import TINY
    from treeattn_lab.reference import TinyLM

    pack = _pack()
    torch.manual_seed(0)
    model = TinyLM(TINY).to(DEVICE)
    targets = pack.input_ids.roll(-1)
    _, loss, grads = run_step(model, lambda: step_loss(model, pack, targets, "triton"))
    compiled = torch.compile(step_loss, fullgraph=True, backend=compiler)
    _, got_loss, got_grads = run_step(model, lambda: compiled(model, pack, targets, "triton"))
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grads, grads, rtol=1e-5, atol=1e-6)
    logits = model.forward_packed(pack, lambda q, k, v: tree_attention(q, k, v, pack, backend="triton"))
    torch.testing.assert_close(torch.nn.functional.cross_entropy(logits, targets), loss, rtol=1e-6, atol=1e-6)
