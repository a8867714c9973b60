"""Bad inputs fail loudly, with a message naming the problem, and inputs are never mutated."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import generator, rollout_forests, seeds
from treeattn_lab import RolloutTrie, tree_attention
from treeattn_lab.ops.validation import check_qkv

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BACKENDS = ["reference", "flex", "auto"]


@pytest.fixture(scope="module")
def pack():
    return RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6]]).pack()  # T = 6


def good(T=6, hq=4, hkv=2, d=8, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(T, h, d, generator=g, dtype=dtype).to(device) for h in (hq, hkv, hkv))


# ------------------------------------------------------------------------------------------ sequences
@pytest.mark.parametrize(
    "seqs, exc, match",
    [
        ([], ValueError, "no sequences"),
        ((), ValueError, "no sequences"),
        (iter([]), ValueError, "no sequences"),
        ([[1, 2], []], ValueError, "sequence 1 is empty"),
        ([[1], torch.tensor([], dtype=torch.int64)], ValueError, "sequence 1 is empty"),
        ([[1, -2, 3]], ValueError, r"token id -2; ids must lie in \[0, 2\*\*63\)"),
        ([[1], torch.tensor([4, -1])], ValueError, "sequence 1 holds the token id -1"),
        ([[2**63]], ValueError, "token id 9223372036854775808"),
        ([[1, 2.0]], TypeError, "sequence 0 holds 2.0 of type float"),
        ([[1, 2], [3, 2.5]], TypeError, "sequence 1 holds 2.5"),
        ([[1, "2"]], TypeError, "holds '2' of type str"),
        (["abc"], TypeError, "sequence 0 is a str"),
        ([b"ab"], TypeError, "sequence 0 is a bytes"),
        ([[1, None]], TypeError, "NoneType"),
        ([[True, 1]], TypeError, "bool"),
        ([5], TypeError, "sequence 0 is a int"),
        ([[1], [np.float32(2)]], TypeError, "sequence 1 holds"),
        ([[1, torch.tensor(2.0)]], TypeError, "sequence 0 holds"),
        ([torch.tensor([1.0, 2.0])], TypeError, "sequence 0 has dtype torch.float32"),
        ([torch.tensor([1, 2], dtype=torch.float64)], TypeError, "integer dtype"),
        ([torch.tensor([True, False])], TypeError, "torch.bool"),
        ([torch.tensor([[1, 2], [3, 4]])], ValueError, "sequence 0 is a 2-D tensor"),
        ([[1], torch.tensor(3)], ValueError, "sequence 1 is a 0-D tensor"),
        (torch.tensor([1, 2, 3]), ValueError, "must be 2-D"),
        (torch.tensor([[1.0, 2.0]]), TypeError, "integer dtype"),
        (torch.zeros(2, 2, 2, dtype=torch.long), ValueError, "must be 2-D"),
        (5, TypeError, "seqs must be a sequence"),
        ("123", TypeError, "seqs must be a sequence"),
    ],
)
def test_bad_sequences(seqs, exc, match):
    with pytest.raises(exc, match=match):
        RolloutTrie.from_sequences(seqs)


def test_numpy_integer_ids_are_accepted():
    trie = RolloutTrie.from_sequences([np.array([1, 2, 3]), [np.int32(1), np.int64(4)]])
    assert trie.sequences() == [[1, 2, 3], [1, 4]]


@given(rollout_forests(), st.data())
def test_one_bad_sequence_among_good_ones_is_named(seqs, data):
    i = data.draw(st.integers(0, len(seqs)), label="where")
    bad = data.draw(st.sampled_from([[], [0, -1], [0.5], torch.tensor([1.5])]), label="bad")
    given_seqs = [list(s) for s in seqs]
    given_seqs.insert(i, bad)
    snapshot = [list(s) if isinstance(s, list) else s.clone() for s in given_seqs]
    with pytest.raises((ValueError, TypeError), match=f"sequence {i} "):
        RolloutTrie.from_sequences(given_seqs)
    for a, b in zip(given_seqs, snapshot, strict=True):  # nothing was touched on the way to the error
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_bad_saved_tries():
    good_dict = RolloutTrie.from_sequences([[1, 2], [1, 3]]).to_dict()
    with pytest.raises(ValueError, match="not a saved RolloutTrie"):
        RolloutTrie.from_dict({"nodes": []})
    with pytest.raises(ValueError, match="not a saved RolloutTrie"):
        RolloutTrie.from_dict([good_dict])
    with pytest.raises(ValueError, match="unsupported RolloutTrie version 99"):
        RolloutTrie.from_dict({**good_dict, "version": 99})
    with pytest.raises(ValueError, match="empty root"):
        RolloutTrie.from_dict({**good_dict, "nodes": [{"parent": -1, "tokens": [1]}]})
    nodes = [dict(n) for n in good_dict["nodes"]]
    nodes[1]["parent"] = 2
    with pytest.raises(ValueError, match="parents must come before children"):
        RolloutTrie.from_dict({**good_dict, "nodes": nodes})
    nodes = [dict(n) for n in good_dict["nodes"]]
    nodes[2]["tokens"] = []
    with pytest.raises(ValueError, match="node 2 holds no tokens"):
        RolloutTrie.from_dict({**good_dict, "nodes": nodes})
    with pytest.raises(ValueError, match="sequence 1 ends at unknown node 0"):
        RolloutTrie.from_dict({**good_dict, "seq_end_node": [2, 0]})


# ------------------------------------------------------------------------------------------ pack
def test_pack_errors(pack):
    with pytest.raises(IndexError, match="sequence index 3 out of range for 3 sequences"):
        pack.seq_index(3)
    with pytest.raises(IndexError, match="out of range"):
        pack.seq_index(-4)
    with pytest.raises(ValueError, match=r"packed \[T=6, \.\.\.\], got \(5, 2\)"):
        pack.to_padded(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="packed"):
        pack.to_padded(torch.tensor(1.0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        pack.to_padded([0.0] * 6)
    with pytest.raises(ValueError, match="on meta but the pack is on cpu"):
        pack.to_padded(torch.zeros(6, device="meta"))
    with pytest.raises(ValueError, match=r"\[B=3, L=4, \.\.\.\]"):
        pack.from_padded(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"\[B=3, L=4, \.\.\.\]"):
        pack.from_padded(torch.zeros(12))


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_count_errors(pack, backend):
    q, k, v = good()
    with pytest.raises(ValueError, match="token counts disagree: 6, 5, 6"):
        tree_attention(q, k[:5], v, pack, backend=backend)
    with pytest.raises(ValueError, match="token counts disagree: 5, 6, 6"):
        tree_attention(q[:5], k, v, pack, backend=backend)
    with pytest.raises(ValueError, match="k and v shapes disagree"):
        tree_attention(q, k, v[:, :1], pack, backend=backend)
    q7, k7, v7 = good(T=7)
    with pytest.raises(ValueError, match="T=7 tokens but the pack has T=6"):
        tree_attention(q7, k7, v7, pack, backend=backend)
    with pytest.raises(ValueError, match="T=5 tokens but the pack has T=6"):
        tree_attention(q[:5], k[:5], v[:5], pack, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_errors(pack, backend):
    q, k, v = good()
    with pytest.raises(TypeError, match="dtypes disagree: torch.float32, torch.float64, torch.float32"):
        tree_attention(q, k.double(), v, pack, backend=backend)
    with pytest.raises(TypeError, match="dtypes disagree"):
        tree_attention(q.half(), k, v, pack, backend=backend)
    with pytest.raises(TypeError, match="q has dtype torch.int64"):
        tree_attention(q.long(), k, v, pack, backend=backend)
    with pytest.raises(TypeError, match="v has dtype torch.bool"):
        tree_attention(q, k, v.bool(), pack, backend=backend)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got ndarray"):
        tree_attention(q, k.numpy(), v, pack, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_errors(pack, backend):
    q, k, v = good()
    qm, km, vm = good(device="meta")
    with pytest.raises(ValueError, match="devices disagree: cpu, meta, cpu"):
        tree_attention(q, km, v, pack, backend=backend)
    with pytest.raises(ValueError, match="q, k, v are on meta but the pack is on cpu"):
        tree_attention(qm, km, vm, pack, backend=backend)
    with pytest.raises(ValueError, match="q, k, v are on cpu but the pack is on meta"):
        tree_attention(q, k, v, pack.to("meta"), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_errors(pack, backend):
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
        tree_attention(*good(hq=3, hkv=2), pack, backend=backend)
    with pytest.raises(ValueError, match=r"query heads \(2\) must be a multiple of key/value heads \(4\)"):
        tree_attention(*good(hq=2, hkv=4), pack, backend=backend)
    with pytest.raises(ValueError, match=r"key/value heads \(0\)"):
        tree_attention(*good(hq=2, hkv=0), pack, backend=backend)
    q, k, v = good()
    with pytest.raises(ValueError, match="head dims disagree: 8 vs 4"):
        tree_attention(q, k[..., :4], v[..., :4], pack, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ndim_errors(pack, backend):
    q, k, v = good()
    with pytest.raises(ValueError, match=r"q must be 3-D \[T, heads, head_dim\], got shape \(1, 6, 4, 8\)"):
        tree_attention(q[None], k, v, pack, backend=backend)
    with pytest.raises(ValueError, match=r"k must be 3-D .* got shape \(6, 16\)"):
        tree_attention(q, k.flatten(1), v, pack, backend=backend)
    with pytest.raises(ValueError, match=r"v must be 3-D .* got shape \(\)"):
        tree_attention(q, k, torch.tensor(1.0), pack, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_and_scale_errors(pack, backend):
    q, k, v = good()
    with pytest.raises(TypeError, match="pack must be a TreePack"):
        tree_attention(q, k, v, pack.subtree_end, backend=backend)
    with pytest.raises(TypeError, match="pack must be a TreePack"):
        tree_attention(q, k, v, RolloutTrie.from_sequences([[1, 2]]), backend=backend)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            tree_attention(q, k, v, pack, scale=bad, backend=backend)
    for bad in ("0.5", True, torch.tensor(0.5)):
        with pytest.raises(TypeError, match="scale must be a float or None"):
            tree_attention(q, k, v, pack, scale=bad, backend=backend)


def test_check_qkv_alone():
    q, k, v = good()
    check_qkv(q, k, v, num_tokens=6, device="cpu")
    with pytest.raises(ValueError, match="pack is on cuda"):
        check_qkv(q, k, v, num_tokens=6, device="cuda")


@given(
    rollout_forests(max_sequences=4, max_len=8),
    st.sampled_from(BACKENDS),
    seeds,
    st.sampled_from(["k_T", "q_T", "dtype", "heads", "ndim", "device"]),
)
def test_inputs_not_mutated_on_errors_or_success(seqs, backend, seed, fault):
    pack = RolloutTrie.from_sequences(seqs).pack()
    g = generator(seed)
    T = pack.num_tokens
    q, k, v = (torch.randn(T, h, 4, generator=g) for h in (2, 1, 1))
    if fault == "k_T":
        k = torch.randn(T + 1, 1, 4, generator=g)
    elif fault == "q_T":
        q = torch.randn(T + 2, 2, 4, generator=g)
    elif fault == "dtype":
        v = v.double()
    elif fault == "heads":
        q = torch.randn(T, 3, 4, generator=g)
        k = v = torch.randn(T, 2, 4, generator=g)
    elif fault == "ndim":
        q = q[None]
    else:
        k = k.to("meta")
    before = [x.clone() for x in (q, k, v)]
    with pytest.raises((ValueError, TypeError)):
        tree_attention(q, k, v, pack, backend=backend)
    for x, y in zip((q, k, v), before, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
        if x.device.type != "meta":
            assert torch.equal(x, y)


# ------------------------------------------------------------------ found by review: more clear errors
def _review_cases():
    from treeattn_lab import dilated_attention, sparse_attention  # noqa: F401  (the public entry points)
    from treeattn_lab.corpus import batches, evaluate_loss, train_language_model
    from treeattn_lab.ops.dilated_decode import DilatedKVCache, dilated_decode_step
    from treeattn_lab.patterns.vertical_slash import estimate
    from treeattn_lab.reference import TinyLM, TinyLMConfig

    pack = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4]]).pack()
    T = pack.num_tokens
    q, k, v = torch.randn(T, 2, 16), torch.randn(T, 1, 16), torch.randn(T, 1, 16)
    cache = DilatedKVCache(dilation=3)
    cache.extend(torch.randn(10, 2, 16), torch.randn(10, 2, 16))
    model = TinyLM(TinyLMConfig(vocab_size=256, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16))
    toks = torch.randint(0, 256, (400,))
    train = lambda **kw: train_language_model(
        model, toks, steps=1, seq_len=16, batch_size=2, progress=False, **kw
    )
    return [
        (lambda: tree_attention(*(x[..., :0] for x in (q, k, v)), pack), ValueError, "head_dim is 0"),
        (lambda: estimate(torch.randn(64, 2, 16), torch.randn(64, 2, 16), n_vertical=4, n_slash=4,
                          scale=float("nan")), ValueError, "scale"),
        (lambda: DilatedKVCache(dilation=3).extend(torch.ones(4, 2, 16).long(), torch.ones(4, 2, 16).long()),
         TypeError, "floating-point"),
        (lambda: dilated_decode_step(torch.randn(3, 16), cache), ValueError, "multiple of 2"),
        (lambda: dilated_decode_step(torch.randn(4, 8), cache), ValueError, "dim 16"),
        (lambda: dilated_decode_step(torch.randn(4, 16).double(), cache), TypeError, "cache holds"),
        (lambda: train(grad_clip=-1.0), ValueError, "grad_clip"),
        (lambda: train(final_lr_ratio=float("nan")), ValueError, "final_lr_ratio"),
        (lambda: train(warmup_steps=-3), ValueError, "warmup_steps"),
        (lambda: train(lr=float("inf")), ValueError, "lr must be"),
        (lambda: evaluate_loss(model, toks, seq_len=16, max_windows=0), ValueError, "max_windows"),
        (lambda: next(batches(toks > 5, 2, 8)), TypeError, "int64"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_review_found_inputs_raise_clear_errors(case):
    call, error, match = _review_cases()[case]
    with pytest.raises(error, match=match):
        call()


def test_triton_backend_refuses_bf16_under_the_interpreter():
    from treeattn_lab.runtime import triton_interpreted

    if not triton_interpreted():
        pytest.skip("compiled Triton computes bf16 correctly; the refusal is for the CPU interpreter")
    pack = RolloutTrie.from_sequences([[1, 2, 3]]).pack()
    q, k, v = (torch.randn(3, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(TypeError, match="bf16"):
        tree_attention(q, k, v, pack, backend="triton")
