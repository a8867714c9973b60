"""Models, tries and ground truths shared by the engine's tests.

The ground truth is computed independently of the engine: each rollout alone through the model's own
forward (``TinyLM.forward_padded``, or the Hugging Face model's forward with its own attention).
"""

from __future__ import annotations

import pytest
import torch

from treeattn_lab.reference import TinyLM, TinyLMConfig

VOCAB = 50
# transformers computes RMSNorm and RoPE in float32 even for float64 weights: its float64 models agree with
# themselves run another way only to fp32 rounding, amplified on degenerate rollouts (one token repeated)
HF_RTOL = 1e-4


def tiny_lm(dtype=torch.float64, seed=0, checkpointing=False) -> TinyLM:
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    model = TinyLM(cfg).to(dtype)
    model.gradient_checkpointing = checkpointing
    return model


# a tiny Hugging Face decoder: two layers, grouped-query attention (4 query heads, 2 kv heads)
HF_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
)


def hf_model(arch: str, dtype=torch.float64, seed=0, **overrides):
    """A random-weight ``transformers`` causal LM of architecture ``arch`` ("Llama", "Qwen2", ...)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{arch}Config")(**{**HF_SIZES, "max_position_embeddings": 512, **overrides})
    return getattr(transformers, f"{arch}ForCausalLM")(cfg).to(dtype)


def hf_llama(dtype=torch.float64, seed=0):
    return hf_model("Llama", dtype, seed)


def hf_qwen2(dtype=torch.float64, seed=0):
    return hf_model("Qwen2", dtype, seed)


def enable_hf_checkpointing(model) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def per_sequence_logits(model, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, TinyLM):
        return model.forward_padded(ids[None])[0]
    return model(input_ids=ids[None]).logits[0]


def flat_gradients(model, seqs, weights):
    """Ground truth: sum of per-rollout weighted NLLs, each rollout run alone, then backward()."""
    model.zero_grad(set_to_none=True)
    losses = []
    for s, w in zip(seqs, weights, strict=True):
        ids = torch.tensor(s)
        logp = torch.log_softmax(per_sequence_logits(model, ids).double(), dim=-1)
        nll = -logp[:-1].gather(-1, ids[1:, None])[:, 0]
        losses.append((w[1:].double() * nll).sum())
    total = torch.stack(losses).sum()
    if total.requires_grad:  # else every rollout is one token long: nothing to predict, zero gradient
        total.backward()
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return grads, torch.stack(losses).detach()


def assert_grads_close(model, expected, rtol):
    """Per parameter: ||grad - expected|| <= rtol * ||expected||, where a parameter whose true gradient
    nearly cancels (below 1e-6 of the whole gradient's norm) is held to that floor instead."""
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in expected.values()))
    for name, p in model.named_parameters():
        want = expected[name].double()
        got = torch.zeros_like(want) if p.grad is None else p.grad.double()
        err = (got - want).norm() / torch.maximum(want.norm(), 1e-6 * total).clamp_min(1e-300)
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


def random_weights(seqs, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s), generator=g, dtype=dtype) for s in seqs]


CASES = [
    [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 6, 7, 8], [9], [1, 2], [1, 2, 3, 4, 5]],  # dups, prefixes
    [list(range(1, 30))] + [list(range(1, 30)) + [k, k + 1] for k in range(30, 40, 3)],  # deep and wide
]


def flat_logprobs(model, seqs, *, grad=False):
    """Ground truth: per rollout ``log p(x[t] | x[<t])`` ``[len - 1]`` (float64), each rollout alone."""
    out = []
    with torch.set_grad_enabled(grad):
        for s in seqs:
            ids = torch.tensor(s)
            logp = torch.log_softmax(per_sequence_logits(model, ids).double(), dim=-1)
            out.append(logp[:-1].gather(-1, ids[1:, None])[:, 0])
    return out


def flat_entropies(model, seqs):
    out = []
    with torch.no_grad():
        for s in seqs:
            logp = torch.log_softmax(per_sequence_logits(model, torch.tensor(s)).double(), dim=-1)[:-1]
            out.append(-(logp.exp() * logp).sum(-1))
    return out


def flat_objective_gradients(model, seqs, objective):
    """Ground truth: autograd of ``objective(per-rollout flat log-probs)``; gradients and the value."""
    model.zero_grad(set_to_none=True)
    value = objective(flat_logprobs(model, seqs, grad=True))
    if value.requires_grad:
        value.backward()
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return grads, float(value.detach())
