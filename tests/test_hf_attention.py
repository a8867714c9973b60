"""The lab's attention registered with transformers: exact over a pack outside the engine, and a clear
refusal of every attention feature it cannot honour (softcapping, sinks, windows a rollout exceeds,
unknown attention arguments), which it used to drop silently."""

from __future__ import annotations

import pytest
import torch

from tests.engine_models import (
    CASES,
    HF_RTOL,
    assert_grads_close,
    enable_hf_checkpointing,
    flat_gradients,
    hf_model,
)
from treeattn_lab import RolloutTrie
from treeattn_lab.engine import MODES, hf_attention, hf_tree_attention, tree_backward, tree_logprobs

SEQS = CASES[0] + [[4, 4, 4, 4, 4, 4, 4], [4, 4, 4, 4, 5]]


def tiny_gpt_oss(**overrides):
    return hf_model("GptOss", num_local_experts=2, num_experts_per_tok=1, head_dim=8, **overrides)


def tiny_gemma2(**overrides):
    return hf_model("Gemma2", head_dim=8, **overrides)


@pytest.mark.parametrize("arch", ["Llama", "Qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_hf_tree_attention_outside_the_engine_is_exact(arch, checkpointing):
    model = hf_model(arch)
    expected, _ = flat_gradients(model, SEQS, [torch.ones(len(s), dtype=torch.float64) for s in SEQS])
    if checkpointing:
        enable_hf_checkpointing(model)
    pack = RolloutTrie.from_sequences(SEQS).pack()
    before = model.config._attn_implementation
    with hf_tree_attention(model, pack):
        logits = model(input_ids=pack.input_ids[None], position_ids=pack.position_ids[None]).logits[0]
        logp = torch.log_softmax(logits.double(), dim=-1)
        loss = 0
        for i in range(pack.num_sequences):
            idx = pack.seq_index(i)
            loss = loss - logp[idx[:-1]].gather(-1, pack.input_ids[idx[1:], None]).sum()
        loss.backward()
    assert model.config._attn_implementation == before
    assert_grads_close(model, expected, HF_RTOL)
    model.eval()
    with torch.no_grad():  # outside the block the model's own attention is back; the lab's refuses to run
        model(input_ids=pack.input_ids[None, :3])
        model.config._attn_implementation = hf_attention.HF_ATTENTION_NAME
        with pytest.raises(RuntimeError, match="hf_tree_attention"):
            model(input_ids=pack.input_ids[None, :3])
    model.config._attn_implementation = before


@pytest.mark.parametrize("run", ["tree_backward", "tree_logprobs", "hf_tree_attention"])
def test_attention_sinks_are_refused(run):
    model = tiny_gpt_oss()
    trie = RolloutTrie.from_sequences(SEQS)
    with pytest.raises(ValueError, match="attention sinks"):
        if run == "tree_backward":
            tree_backward(model, trie, mode="packed")
        elif run == "tree_logprobs":
            tree_logprobs(model, trie, mode="dfs", block_tokens=2)
        else:
            with hf_tree_attention(model, trie.pack()):
                model(input_ids=trie.pack().input_ids[None], position_ids=trie.pack().position_ids[None])
    assert all(p.grad is None for p in model.parameters())
    assert model.config._attn_implementation != hf_attention.HF_ATTENTION_NAME


@pytest.mark.parametrize("mode", MODES)
def test_softcapping_is_refused_and_gemma2_without_it_is_exact(mode):
    trie = RolloutTrie.from_sequences(SEQS)
    with pytest.raises(ValueError, match="attention logit softcapping"):
        tree_backward(tiny_gemma2(), trie, mode=mode)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        tree_backward(tiny_gemma2(attn_logit_softcapping=None), trie, mode=mode)
    model = tiny_gemma2(attn_logit_softcapping=None, final_logit_softcapping=None)
    expected, _ = flat_gradients(model, SEQS, [torch.ones(len(s), dtype=torch.float64) for s in SEQS])
    tree_backward(model, trie, mode=mode, block_tokens=2)
    assert_grads_close(model, expected, HF_RTOL)


def test_sliding_windows_a_rollout_exceeds_are_refused():
    model = tiny_gemma2(attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=4)
    long_trie = RolloutTrie.from_sequences([list(range(1, 8))])
    with pytest.raises(ValueError, match="sliding window"):
        tree_logprobs(model, long_trie)
    with pytest.raises(ValueError, match="sliding-window"), hf_tree_attention(model, long_trie.pack()) as m:
        pack = long_trie.pack()
        m(input_ids=pack.input_ids[None], position_ids=pack.position_ids[None])
    short = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4]])
    assert len(tree_logprobs(model, short)) == 2  # every rollout fits the window: exact, accepted


def test_padding_masks_are_refused_inside_hf_tree_attention():
    model = hf_model("Llama")
    pack = RolloutTrie.from_sequences(SEQS).pack()
    ids, pos = pack.input_ids[None], pack.position_ids[None]
    with torch.no_grad(), hf_tree_attention(model, pack):
        plain = model(input_ids=ids, position_ids=pos).logits
        ones = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
        torch.testing.assert_close(ones, plain)  # a mask hiding nothing changes nothing
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        with pytest.raises(ValueError, match="attention_mask that hides tokens"):
            model(input_ids=ids, position_ids=pos, attention_mask=mask)
    assert not model._forward_pre_hooks  # the check leaves with the block


def test_models_whose_logits_are_not_the_head_of_the_last_hidden_state_are_refused():
    model = hf_model("Llama", seed=7)

    def scale_logits(module, args, kwargs, out):  # a causal-LM forward that post-processes its logits
        out.logits = out.logits * 2
        return out

    model.register_forward_hook(scale_logits, with_kwargs=True)
    model.train()
    with pytest.raises(ValueError, match="post-processes them"):
        tree_logprobs(model, RolloutTrie.from_sequences(SEQS))
    assert model.training and all(m.training for m in model.modules())  # its flags are restored


def test_unknown_attention_arguments_are_refused():
    q = k = v = torch.randn(1, 2, 3, 4)
    module = torch.nn.Module()
    module.layer_idx = 0
    model = hf_model("Llama")
    with hf_attention.attention_session(model, 3) as slot:
        slot["attention"] = lambda layer, q, k, v, scale: q
        out, _ = hf_attention._hf_attention(
            module, q, k, v, None, scaling=0.5, position_ids=None, use_cache=False
        )
        assert out.shape == (1, 3, 2, 4)
        with pytest.raises(ValueError, match=r"\['window_bias'\] are not handled"):
            hf_attention._hf_attention(module, q, k, v, None, scaling=0.5, window_bias=torch.ones(1))
        with pytest.raises(ValueError, match="output_attentions"):
            hf_attention._hf_attention(module, q, k, v, None, output_attentions=True)
        with pytest.raises(ValueError, match="dropout"):
            hf_attention._hf_attention(module, q, k, v, None, dropout=0.1)
        with pytest.raises(ValueError, match="attention sinks"):
            hf_attention._hf_attention(module, q, k, v, None, s_aux=torch.zeros(2))
        with pytest.raises(ValueError, match="softcapping"):
            hf_attention._hf_attention(module, q, k, v, None, softcap=50.0)
        with pytest.raises(ValueError, match="sliding-window"):  # the session's longest rollout is 3
            hf_attention._hf_attention(module, q, k, v, None, sliding_window=2)
        hf_attention._hf_attention(module, q, k, v, None, sliding_window=3)  # a window no rollout exceeds
    with pytest.raises(TypeError, match="pack must be a TreePack"), hf_tree_attention(model, [[1, 2]]):
        pass
    with pytest.raises(TypeError, match="Hugging Face model"), hf_tree_attention(torch.nn.Linear(2, 2), None):
        pass


def test_hf_tree_attention_requires_the_packs_position_ids():
    model = hf_model("Llama")
    pack = RolloutTrie.from_sequences(SEQS).pack()
    ids = pack.input_ids[None]
    shifted = pack.position_ids[None].clone()
    shifted[0, -1] += 1
    with torch.no_grad(), hf_tree_attention(model, pack):
        with pytest.raises(ValueError, match=r"position_ids=pack.position_ids\[None\].*got none"):
            model(input_ids=ids)
        with pytest.raises(ValueError, match="position_ids=pack.position_ids"):
            model(input_ids=ids, position_ids=shifted)
        with pytest.raises(ValueError, match="position_ids=pack.position_ids"):
            model(input_ids=ids, position_ids=torch.arange(pack.num_tokens)[None])
        exact = model(input_ids=ids, position_ids=pack.position_ids[None]).logits
    assert torch.isfinite(exact).all()
    assert not model._forward_pre_hooks
