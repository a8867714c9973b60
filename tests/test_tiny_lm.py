"""TinyLM: logits over a packed rollout tree equal per-sequence logits (float64), GQA included."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import orders, rollout_forests, seeds
from treeattn_lab import RolloutTrie
from treeattn_lab import tree_attention as ops_tree_attention
from treeattn_lab.reference import TinyLM, TinyLMConfig
from treeattn_lab.reference.tiny_lm import Rotary, rope

VOCAB = 50

configs = st.sampled_from(
    [
        TinyLMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48),  # GQA
        TinyLMConfig(vocab_size=VOCAB, dim=24, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=40),  # MHA
        TinyLMConfig(vocab_size=VOCAB, dim=36, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=20),  # G=3
    ]
)


def make_model(cfg: TinyLMConfig, seed: int, dtype=torch.float64) -> TinyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(cfg)
        for p in model.parameters():  # std 0.02 everywhere makes attention nearly uniform: sharpen it
            p.data.normal_(0, 0.3)
    return model.to(dtype).eval()


@given(rollout_forests(max_vocab=VOCAB), orders, configs, seeds)
def test_packed_logits_equal_per_sequence_logits(seqs, order, cfg, seed):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    model = make_model(cfg, seed)
    with torch.no_grad():
        packed = model.forward_packed(pack)
        padded = model.forward_padded(pack.padded_input_ids(), pack.seq_lengths)
        unmasked = model.forward_padded(pack.padded_input_ids(pad_id=VOCAB - 1))
    assert packed.shape == (pack.num_tokens, VOCAB) and packed.dtype == torch.float64
    _, valid = pack.padded_index()
    expected = padded[valid]
    torch.testing.assert_close(pack.to_padded(packed)[valid], expected, rtol=1e-9, atol=1e-9)
    # causal attention never lets a real token see the padding that follows it
    torch.testing.assert_close(unmasked[valid], expected, rtol=1e-9, atol=1e-9)
    for i, s in enumerate(seqs):  # one rollout at a time, no padding at all
        with torch.no_grad():
            alone = model.forward_padded(torch.tensor([s]))[0]
        torch.testing.assert_close(packed[pack.seq_index(i)], alone, rtol=1e-9, atol=1e-9)


@given(rollout_forests(max_sequences=4, max_len=10, max_vocab=VOCAB), seeds)
def test_packed_gradients_equal_per_sequence_gradients(seqs, seed):
    """Tree training is exact: the summed per-sequence loss has the same parameter gradients."""
    cfg = TinyLMConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=24)
    pack = RolloutTrie.from_sequences(seqs).pack()
    model = make_model(cfg, seed)
    _, valid = pack.padded_index()
    g = torch.Generator().manual_seed(seed ^ 7)
    weights = torch.randn(valid.shape + (VOCAB,), generator=g, dtype=torch.float64) * valid[..., None]

    flat = model.forward_padded(pack.padded_input_ids(), pack.seq_lengths)
    grads_flat = torch.autograd.grad((flat * weights).sum(), list(model.parameters()))
    tree = model.forward_packed(pack)
    grads_tree = torch.autograd.grad((pack.to_padded(tree) * weights).sum(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), grads_tree, grads_flat, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@given(rollout_forests(max_sequences=4, max_len=12, max_vocab=VOCAB), seeds)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_forward_packed_with_ops_backends(seqs, seed):
    cfg = TinyLMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    pack = RolloutTrie.from_sequences(seqs).pack()
    model = make_model(cfg, seed, dtype=torch.float32)
    with torch.no_grad():
        ref = model.forward_packed(pack)
        flex = model.forward_packed(pack, lambda q, k, v: ops_tree_attention(q, k, v, pack, backend="flex"))
    torch.testing.assert_close(flex, ref, rtol=1e-4, atol=1e-4)


def test_rope_is_relative():
    """RoPE scores depend only on the distance between positions."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 8, generator=g, dtype=torch.float64)

    def score(pq, pk):
        rq = rope(q, torch.tensor([pq]), 10000.0)
        rk = rope(k, torch.tensor([pk]), 10000.0)
        return (rq * rk).sum()

    torch.testing.assert_close(score(5, 3), score(12, 10))
    torch.testing.assert_close(score(0, 0), (q * k).sum())
    assert not torch.allclose(score(5, 3), score(5, 4))


def test_rotary_tables_follow_the_input_dtype():
    """One Rotary serves every layer: tables made once in its dtype, and an input of another dtype
    (bf16 under autocast, say) rotated with the float64 angles cast to its own; both equal rope(), and
    in float64 both equal the rotation written out pair by pair (dims i and i + D/2 turned by
    pos * theta^(-2i/D))."""
    g = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 5000, (2, 7), generator=g)
    rotary = Rotary(pos, 16, 500000.0, torch.float32)
    x = torch.randn(2, 7, 3, 16, generator=g)
    x64 = x.double()
    freq = 500000.0 ** (-torch.arange(8, dtype=torch.float64) * 2 / 16)
    angle = (pos.double()[..., None] * freq)[..., None, :]  # [2, 7, 1, 8]
    cos, sin = angle.cos(), angle.sin()
    first, second = x64[..., :8], x64[..., 8:]
    turned = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    torch.testing.assert_close(rotary(x64), turned, rtol=1e-12, atol=1e-12)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        out = rotary(x.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out, rope(x.to(dtype), pos, 500000.0), rtol=0, atol=0)
    assert rotary.tables(torch.float32)[0] is rotary.cos
    with pytest.raises(ValueError, match="head_dim 16"):
        rotary(torch.randn(2, 7, 3, 8))


def test_rotary_tables_take_the_autocast_dtype():
    model = make_model(TinyLMConfig(vocab_size=VOCAB, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=8), 0,
                       dtype=torch.float32)
    pos = torch.arange(5)[None]
    assert model.rotary(pos).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.rotary(pos).dtype == torch.bfloat16


def test_rmsnorm_keeps_float64_precision():
    model = make_model(TinyLMConfig(vocab_size=VOCAB, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=8), 0)
    x = torch.randn(3, 8, dtype=torch.float64) * (1 + 1e-12)
    out = model.norm(x)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps) * model.norm.weight
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_config_errors():
    with pytest.raises(ValueError, match="n_heads"):
        TinyLMConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        TinyLMConfig(dim=32, n_heads=4, n_kv_heads=3)


def test_token_id_errors():
    model = make_model(TinyLMConfig(vocab_size=VOCAB, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=8), 0)
    with pytest.raises(TypeError, match="integer token ids"):
        model.forward_padded(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        model.forward_padded(torch.tensor([[1, VOCAB]]))
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        model.forward_packed(RolloutTrie.from_sequences([[1, 2, VOCAB + 3]]).pack())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused half-precision path runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_half_precision_on_cuda_equals_the_float32_path(dtype):
    """On CUDA a bf16/fp16 norm goes to the fused kernel as it is; its output and gradients equal the
    float32 path's rounded once (awkward width, a scale spread over rows, random weight)."""
    from treeattn_lab.reference.tiny_lm import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(7)
    norm = RMSNorm(1000, 1e-6).to("cuda", dtype)
    norm.weight.data = torch.randn(1000, device="cuda", generator=g).to(dtype)
    scale = torch.logspace(-2, 2, 37, device="cuda")[:, None]
    x = (torch.randn(37, 1000, device="cuda", generator=g) * scale).to(dtype).requires_grad_(True)
    up = torch.randn(37, 1000, device="cuda", generator=g).to(dtype)
    out = norm(x)
    (out.float() * up.float()).sum().backward()
    x32 = x.detach().float().requires_grad_(True)
    w32 = norm.weight.detach().float().requires_grad_(True)
    want = torch.nn.functional.rms_norm(x32, (1000,), w32, 1e-6)
    (want * up.float()).sum().backward()
    assert out.dtype == dtype
    torch.testing.assert_close(out, want.to(dtype), rtol=1e-2, atol=1e-2)
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    assert rel(out, want) < 4e-3
    assert rel(x.grad, x32.grad) < 8e-3 and rel(norm.weight.grad, w32.grad) < 8e-3
