"""Model adapters: the one door through which the engine runs a model.

The engine needs two things from a causal LM: the final hidden states (after the last norm) for
``input_ids [B, N]`` at ``position_ids [B, N]``, where every layer's attention is a function the engine
supplies,

    layer_attention(layer, q [B, N, Hq, D], k [B, N, Hkv, D], v [B, N, Hkv, D], scale) -> [B, N, Hq, D]

with q and k already rotated (RoPE). Flat training passes causal attention, packed training tree
attention over a :class:`TreePack`, and DFS materialization an attention that reads each layer's stored
prefix keys and values; and the output head, which the engine applies by chunks of rows
(:mod:`treeattn_lab.engine.lm_head`) so that ``[tokens, vocab]`` logits never exist at once. The adapter
never changes the model's weights; a Hugging Face model's attention
implementation is switched only for the duration of a call and then restored.

- :class:`TinyLMAdapter`: the lab's :class:`treeattn_lab.reference.TinyLM`.
- :class:`HFCausalLMAdapter`: Hugging Face ``transformers`` causal LMs whose attention goes through
  ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2, Mistral and their relatives), through
  :mod:`treeattn_lab.engine.hf_attention`, which refuses the attention features the lab cannot honour.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from . import hf_attention

LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]


def query_width(cfg) -> int | None:
    """A query head's width in a model config (TinyLM's ``cfg`` or a Hugging Face ``config``): MLA models
    (DeepSeek-V3) give it as ``qk_head_dim``, their ``head_dim`` being the rope part alone; others as
    ``head_dim``, or it is the hidden size over the query heads. None where the config says neither."""
    for name in ("qk_head_dim", "head_dim"):
        width = getattr(cfg, name, None)
        if isinstance(width, int) and not isinstance(width, bool) and width > 0:
            return width
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "dim", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


class ModelAdapter:
    """What the engine knows of a model: sizes (layers, vocabulary, query heads and their width), hidden
    states under an engine-supplied attention, the head."""

    def __init__(self, model: nn.Module, *, num_layers: int, vocab_size: int, query_heads: int,
                 head_dim: int):
        self.model = model
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.query_heads = query_heads
        self.head_dim = head_dim

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: LayerAttention):
        """Final hidden states ``[B, N, d]`` (after the last norm, before the head)."""
        raise NotImplementedError

    @property
    def head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The output head: hidden rows ``[n, d]`` -> logits ``[n, V]``."""
        raise NotImplementedError

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: LayerAttention):
        return self.head(self.hidden(input_ids, position_ids, attention))

    @contextlib.contextmanager
    def session(self, longest: int | None = None):
        """Hold whatever the engine's attention needs for a whole call, backward passes included
        (activation checkpointing recomputes layers during backward); ``longest``: the longest rollout."""
        yield self

    def check_length(self, longest: int) -> None:
        """Raise if the model cannot run a rollout of ``longest`` tokens exactly under the engine."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def features_and_head(adapter, input_ids, position_ids, attention):
    """``(features [B, N, ...], head)``: hidden states and the head, or, for an adapter that only gives
    logits (a test probe), the logits and the identity."""
    if hasattr(adapter, "hidden"):
        return adapter.hidden(input_ids, position_ids, attention), adapter.head
    return adapter.logits(input_ids, position_ids, attention), _identity


def _identity(x):
    return x


class TinyLMAdapter(ModelAdapter):
    """The lab's TinyLM: its blocks run one by one, each with its layer's attention (TinyLM calls
    ``attention(q, k, v)``; its scale is the default ``1/sqrt(head_dim)``)."""

    def __init__(self, model):
        cfg = model.cfg
        super().__init__(model, num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, query_heads=cfg.n_heads,
                         head_dim=cfg.head_dim)

    def hidden(self, input_ids, position_ids, attention: LayerAttention):
        per_layer = [partial(_call_with_layer, attention, layer) for layer in range(self.num_layers)]
        return self.model.hidden(input_ids, position_ids, per_layer)

    @property
    def head(self):
        return self.model.head


# Hugging Face models whose head has been checked (see HFCausalLMAdapter._check_head); weak, so a model
# that goes away leaves it.
_HEADS_CHECKED: weakref.WeakSet = weakref.WeakSet()


@torch.compiler.disable
def _call_with_layer(attention: LayerAttention, layer: int, q, k, v):
    """A TinyLM layer's attention call, eager even inside a compiled layer (``engine/attention.py``)."""
    return attention(layer, q, k, v, None)


class HFCausalLMAdapter(ModelAdapter):
    """A ``transformers`` causal LM (``*ForCausalLM``) run with the engine's attention."""

    def __init__(self, model):
        cfg = model.config
        hf_attention.check_supported_model(model)
        super().__init__(model, num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                         query_heads=cfg.num_attention_heads, head_dim=query_width(cfg))
        self.sliding_window = hf_attention.sliding_window(cfg)
        self._slot: dict | None = None
        if model not in _HEADS_CHECKED:
            self._check_head()
            _HEADS_CHECKED.add(model)

    def _check_head(self) -> None:
        """Refuse a model whose logits are not ``head(last hidden state)`` (its causal-LM forward
        post-processes them in a way the engine would skip). Checked once per model, on four tokens,
        with the model's own attention and in eval mode (its train/eval flags are restored)."""
        model = self.model
        flags = [(m, m.training) for m in model.modules()]
        ids = torch.arange(min(4, self.vocab_size), device=self.device)[None]
        try:
            model.eval()
            with torch.no_grad():
                own = model(input_ids=ids, use_cache=False).logits
                ours = self.head(model.base_model(input_ids=ids, use_cache=False).last_hidden_state)
        finally:
            for m, training in flags:
                m.training = training
        if not torch.allclose(
            own.float(), ours.float(), rtol=1e-3, atol=1e-3 * float(own.abs().max()) + 1e-6
        ):
            raise ValueError(
                f"{type(model).__name__}'s logits are not its output head applied to the last hidden state: "
                "its causal-LM forward post-processes them, which treeattn_lab's engine does not reproduce"
            )

    def check_length(self, longest: int) -> None:
        """A sliding-window model is exact here only while no rollout is longer than its window."""
        if self.sliding_window is not None and longest > self.sliding_window:
            raise ValueError(
                f"a rollout of {longest} tokens is longer than the model's sliding window "
                f"({self.sliding_window}): sliding-window attention is not supported by the engine"
            )

    @contextlib.contextmanager
    def session(self, longest: int | None = None):
        """Switch the model to the engine's attention for the call, then restore its own."""
        with hf_attention.attention_session(self.model, longest) as slot:
            self._slot = slot
            try:
                yield self
            finally:
                self._slot = None

    def hidden(self, input_ids, position_ids, attention: LayerAttention):
        if self._slot is None:
            raise RuntimeError("HFCausalLMAdapter runs the model inside `with adapter.session():`")
        # stays set after the forward: a checkpointed layer recomputed in backward must see it too
        self._slot["attention"] = attention
        base = self.model.base_model
        return base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state

    @property
    def head(self):
        return self.model.get_output_embeddings()


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


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of a TinyLM (``blocks``) or of a Hugging Face causal LM (its base model's
    ``layers``, as Llama, Qwen2 and Mistral have); else a TypeError."""
    model = model.model if isinstance(model, ModelAdapter) else model
    adapt(model)  # the same models the engine runs, with its checks
    from ..reference.tiny_lm import TinyLM

    layers = model.blocks if isinstance(model, TinyLM) else getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder layer list (base_model.layers) to compile")
    return layers


def compile_layers(model, **compile_kwargs):
    """Compile every decoder layer of ``model`` in place (``layer.compile(...)``) and return ``model``:
    the way to run the engine with ``torch.compile``.

    The engine hands each layer its attention through an eager call (``engine/attention.py``), so every
    layer's code compiles to the same graphs, shared by all layers and by every DFS block and micro-batch
    size. The call splits each frame on the way to it into a graph before and one after: a TinyLM block,
    whose attention module makes the call, runs as four (norm; projections and rotary; output projection;
    residual and MLP). What adds graphs is grad mode (a DFS push runs without autograd), the first sizes
    a graph meets (below) and torch's specialization of 1-token sizes. The fusion cuts
    the kernels, and the host's work per kernel, that a layer of many small calls costs. ``compile_kwargs``
    go to ``torch.compile`` (e.g. ``backend="aot_eager"``, ``mode=...``).

    Sizes: ``dynamic`` defaults to None, torch's automatic dynamic shapes. A graph compiles first for the
    sizes it meets; the first time a size changes (the next block's length) it compiles once more with
    that size symbolic, and that graph serves every later length. The layers' floats (a norm's ``eps``)
    stay constants of the graphs. ``dynamic=True`` makes every size symbolic from the first call but also
    turns every float a layer reads into a graph input: a 0-d float64 CPU tensor that dynamo builds on
    every call and that inductor's GPU kernels read back with ``.item()``, one host read per norm and
    layer call.

    Hugging Face layers: transformers wraps a decoder layer's and its attention module's ``forward`` in
    one kwarg-deprecation wrapper whose frame dynamo compiles once per guard variant of both, so one
    model run in several engine modes can pass dynamo's ``recompile_limit`` (8); past it that frame runs
    eagerly (still exact, slower) and torch warns. Raise ``torch._dynamo.config.recompile_limit`` (e.g. to
    32) when one HF model mixes modes.
    """
    for layer in decoder_layers(model):
        layer.compile(**compile_kwargs)
    return model
