"""Model adapters: the one door through which the engine runs a model.

The engine needs a single thing from a causal LM: logits for ``input_ids [B, N]`` at ``position_ids [B, N]``
where every layer's attention is a function the engine supplies,

    layer_attention(layer, q [B, N, Hq, D], k [B, N, Hkv, D], v [B, N, Hkv, D], scale) -> [B, N, Hq, D]

with q and k already rotated (RoPE). Flat training passes causal attention, packed training tree
attention over a :class:`TreePack`, and DFS materialization an attention that reads each layer's stored
prefix keys and values. The adapter never changes the model's weights; a Hugging Face model's attention
implementation is switched only for the duration of a call and then restored.

- :class:`TinyLMAdapter`: the lab's :class:`treeattn_lab.reference.TinyLM`.
- :class:`HFCausalLMAdapter`: Hugging Face ``transformers`` causal LMs whose attention goes through
  ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2, Mistral and their relatives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]


class ModelAdapter:
    """What the engine knows of a model: sizes, and logits under an engine-supplied attention."""

    def __init__(self, model: nn.Module, *, num_layers: int, vocab_size: int):
        self.model = model
        self.num_layers = num_layers
        self.vocab_size = vocab_size

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: LayerAttention):
        raise NotImplementedError

    @contextlib.contextmanager
    def session(self):
        """Hold whatever the engine's attention needs for a whole call, backward passes included
        (activation checkpointing recomputes layers during backward)."""
        yield self

    def check_length(self, longest: int) -> None:
        """Raise if the model cannot run a rollout of ``longest`` tokens exactly under the engine."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


class TinyLMAdapter(ModelAdapter):
    def __init__(self, model):
        super().__init__(model, num_layers=model.cfg.n_layers, vocab_size=model.cfg.vocab_size)

    def logits(self, input_ids, position_ids, attention: LayerAttention):
        per_layer = [
            partial(_call_with_layer, attention, layer) for layer in range(self.num_layers)
        ]  # TinyLM calls attention(q, k, v); its scale is the default 1/sqrt(head_dim)
        return self.model(input_ids, position_ids, per_layer)


def _call_with_layer(attention: LayerAttention, layer: int, q, k, v):
    return attention(layer, q, k, v, None)


# ---------------------------------------------------------------------------------- Hugging Face
HF_ATTENTION_NAME = "treeattn_lab"
# The attention of the running engine call. A plain module-level slot, not a ContextVar: on CUDA,
# checkpointed layers are recomputed on autograd's worker threads, which must see it too. So one
# tree_backward call at a time per process (each call sets it in session() and clears it after).
_ACTIVE: dict[str, LayerAttention | None] = {"attention": None}


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered with ``transformers``: ``[B, H, N, D]`` in, ``[B, N, H, D]`` out.

    The engine's attention is causal (or tree-shaped) by construction, so the model's mask is ignored;
    none is built, because this name is not registered with ``transformers``' mask interface.
    """
    attention = _ACTIVE["attention"]
    if attention is None:
        raise RuntimeError(
            f"attention implementation {HF_ATTENTION_NAME!r} only runs inside the treeattn_lab engine"
        )
    if dropout:
        raise ValueError("attention dropout is not supported by the treeattn_lab engine; set it to 0")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    return attention(module.layer_idx, q, k, v, scaling), None


def _register_hf_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)


class HFCausalLMAdapter(ModelAdapter):
    """A ``transformers`` causal LM (``*ForCausalLM``) run with the engine's attention."""

    def __init__(self, model):
        cfg = model.config
        super().__init__(model, num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size)
        uses_window = getattr(cfg, "use_sliding_window", True) and getattr(cfg, "sliding_window", None)
        self.sliding_window = int(cfg.sliding_window) if uses_window else None
        _register_hf_attention()

    def check_length(self, longest: int) -> None:
        """A sliding-window model is exact here only while no rollout is longer than its window."""
        if self.sliding_window is not None and longest > self.sliding_window:
            raise ValueError(
                f"a rollout of {longest} tokens is longer than the model's sliding window "
                f"({self.sliding_window}): sliding-window attention is not supported by the engine"
            )

    @contextlib.contextmanager
    def session(self):
        """Switch the model to the engine's attention for the call, then restore its own."""
        if _ACTIVE["attention"] is not None:
            raise RuntimeError("another treeattn_lab engine call is running in this process")
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = HF_ATTENTION_NAME
        try:
            yield self
        finally:
            config._attn_implementation = previous
            _ACTIVE["attention"] = None

    def logits(self, input_ids, position_ids, attention: LayerAttention):
        if self.model.config._attn_implementation != HF_ATTENTION_NAME:
            raise RuntimeError("HFCausalLMAdapter.logits runs inside `with adapter.session():`")
        # stays set after the forward: a checkpointed layer recomputed in backward must see it too
        _ACTIVE["attention"] = attention
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def adapt(model) -> ModelAdapter:
    """The adapter for ``model``: a :class:`TinyLM` or a Hugging Face causal LM; else a TypeError."""
    if isinstance(model, ModelAdapter):
        return model
    from ..reference.tiny_lm import TinyLM

    if isinstance(model, TinyLM):
        return TinyLMAdapter(model)
    config = getattr(model, "config", None)
    if isinstance(model, nn.Module) and config is not None and hasattr(config, "num_hidden_layers"):
        return HFCausalLMAdapter(model)
    raise TypeError(
        f"model must be a treeattn_lab TinyLM or a Hugging Face causal LM (e.g. LlamaForCausalLM), "
        f"got {type(model).__name__}"
    )
