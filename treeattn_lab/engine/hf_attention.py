"""The lab's attention as a Hugging Face ``transformers`` attention implementation.

``transformers`` calls ``attention_interface(module, query, key, value, attention_mask, **kwargs)`` in every
layer, ``[B, H, N, D]`` in and ``[B, N, H, D]`` out. The implementation registered here under the name
``"treeattn_lab"`` hands q, k, v to whatever attention is *active*: the engine's (causal, tree or DFS
prefix attention) during an engine call, or tree attention over one :class:`TreePack` inside
:func:`hf_tree_attention`. The model's own mask is never read: the active attention is causal or
tree-shaped by construction (no mask is built either: the name is not registered with the mask interface).

Everything else a layer may ask for is checked, not dropped. The lab computes plain softmax attention
with the layer's ``scaling``, so it refuses logit softcapping (Gemma2 ``softcap``), attention sinks
(GPT-OSS ``s_aux``), a sliding window that the longest rollout exceeds, attention dropout, returned
attention weights, and any keyword argument it does not know. Models whose causal-LM head post-processes
the logits (final logit softcapping, logit scales) are refused by :func:`check_supported_config`.

    from treeattn_lab.engine import hf_tree_attention

    pack = trie.pack()
    with hf_tree_attention(model, pack):
        logits = model(input_ids=pack.input_ids[None], position_ids=pack.position_ids[None]).logits[0]
        logits.sum().backward()   # backward inside too: checkpointed layers recompute with tree attention
"""

from __future__ import annotations

import contextlib
import functools

import torch

HF_ATTENTION_NAME = "treeattn_lab"
# The running call's attention and its longest rollout. A plain module-level slot, not a ContextVar: on
# CUDA, checkpointed layers are recomputed on autograd's worker threads, which must see it too. So one
# call at a time per process: whoever sets it (a session below) clears it afterwards.
_ACTIVE: dict = {"attention": None, "longest": None}

# Keyword arguments that carry nothing the attention must honour (bookkeeping of the layer's call).
_PASSIVE_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits"})


def _refuse_unhandled(kwargs: dict, longest: int | None) -> None:
    """Raise on every attention feature in ``kwargs`` that plain tree/causal softmax attention drops."""
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"attention logit softcapping (softcap={kwargs['softcap']}) is not supported by treeattn_lab's "
            "attention: it computes plain softmax attention (set attn_logit_softcapping=None)"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            "attention sinks (s_aux) are not supported by treeattn_lab's attention: a sink adds a logit to "
            "every softmax row, which tree attention does not compute"
        )
    window = kwargs.get("sliding_window")
    if window is not None and (longest is None or longest > window):
        raise ValueError(
            f"a sliding-window layer (window {window}) sees rollouts of up to {longest} tokens: "
            "sliding-window attention is not supported by treeattn_lab's attention, only windows that no "
            "rollout exceeds"
        )
    if kwargs.get("output_attentions"):
        raise ValueError("treeattn_lab's attention does not return attention weights (output_attentions)")
    if kwargs.get("is_causal") is False:
        raise ValueError("treeattn_lab's attention is causal/tree-shaped: is_causal=False cannot be honoured")
    known = _PASSIVE_KWARGS | {"softcap", "s_aux", "sliding_window", "output_attentions", "is_causal"}
    unknown = sorted(k for k, v in kwargs.items() if k not in known and v is not None)
    if unknown:
        raise ValueError(
            f"attention arguments {unknown} are not handled by treeattn_lab's attention; refusing rather "
            "than computing a different attention than the model asks for"
        )


@torch.compiler.disable
def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered with ``transformers`` (module docstring). Opaque to ``torch.compile``,
    like the TinyLM adapter's per-layer call (``engine/attention.py``): a compiled layer calls it eagerly,
    so its graphs do not depend on the layer's index or on the engine's per-call state."""
    attention = _ACTIVE["attention"]
    if attention is None:
        raise RuntimeError(
            f"attention implementation {HF_ATTENTION_NAME!r} runs inside the treeattn_lab engine or inside "
            "`with treeattn_lab.engine.hf_tree_attention(model, pack):`"
        )
    if dropout:
        raise ValueError("attention dropout is not supported by treeattn_lab's attention; set it to 0")
    _refuse_unhandled(kwargs, _ACTIVE["longest"])
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    return attention(module.layer_idx, q, k, v, scaling), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)


# Head post-processing that a hidden-state + lm_head path would silently skip: (attribute, neutral value).
_HEAD_FEATURES = (("final_logit_softcapping", None), ("logit_scale", None), ("logits_scaling", 1.0))


def check_supported_config(config) -> None:
    """Raise for models whose logits the lab cannot reproduce exactly (see the module docstring)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"attention logit softcapping (attn_logit_softcapping={config.attn_logit_softcapping}) is not "
            "supported by treeattn_lab's attention"
        )
    for name, neutral in _HEAD_FEATURES:
        value = getattr(config, name, neutral)
        if value != neutral:
            raise ValueError(
                f"{name}={value}: the model post-processes its logits, which treeattn_lab's engine does not "
                "reproduce; it is not supported"
            )


def check_supported_model(model) -> None:
    """:func:`check_supported_config`, and attention layers that hold sinks (GPT-OSS ``sinks``): refused
    before anything runs (the attention call would refuse them too, as ``s_aux``)."""
    check_supported_config(model.config)
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise ValueError(
                f"{name} has attention sinks: not supported by treeattn_lab's attention (a sink adds a logit "
                "to every softmax row, which tree attention does not compute)"
            )


def sliding_window(config) -> int | None:
    """The narrowest sliding window any layer uses (None: every layer attends the whole rollout)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


@contextlib.contextmanager
def attention_session(model, longest: int | None):
    """Switch ``model`` to the registered implementation, yield the slot to fill, restore it after."""
    if _ACTIVE["attention"] is not None or _ACTIVE["longest"] is not None:
        raise RuntimeError("another treeattn_lab attention session is running in this process")
    register()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = HF_ATTENTION_NAME
    _ACTIVE["longest"] = longest
    try:
        yield _ACTIVE
    finally:
        config._attn_implementation = previous
        _ACTIVE["attention"] = None
        _ACTIVE["longest"] = None


@contextlib.contextmanager
def hf_tree_attention(model, pack, *, backend: str = "auto"):
    """Inside, ``model`` (a Hugging Face causal LM) runs tree attention over ``pack``.

    Call it as ``model(input_ids=pack.input_ids[None], position_ids=pack.position_ids[None])``: row 0 of the
    logits then equals each rollout's own logits at its packed positions. Run backward inside the block too
    when the model uses activation checkpointing. Unsupported attention features, ``position_ids`` other
    than the pack's (missing ones included: the model would number the packed row 0 .. T - 1), and an
    ``attention_mask`` that hides tokens raise a ValueError.
    """
    from ..pack import TreePack
    from .attention import packed_tree

    if not hasattr(model, "config") or not hasattr(model.config, "_attn_implementation"):
        raise TypeError(f"model must be a Hugging Face model, got {type(model).__name__}")
    if not isinstance(pack, TreePack):
        raise TypeError(f"pack must be a TreePack, got {type(pack).__name__}")
    check_supported_model(model)
    tree = packed_tree(pack, backend)
    hook = model.register_forward_pre_hook(functools.partial(_check_call, pack), with_kwargs=True)
    try:
        with attention_session(model, int(pack.seq_lengths.max())) as slot:
            slot["attention"] = lambda layer, q, k, v, scale: tree(q, k, v, scale)
            yield model
    finally:
        hook.remove()


def _check_call(pack, module, args, kwargs):
    """The pack's tree decides what each token sees and where it sits: the call must give the pack's
    ``position_ids``, and a mask that hides tokens cannot be honoured."""
    positions = kwargs.get("position_ids")
    if positions is None or not torch.equal(
        positions.reshape(-1), pack.position_ids.to(positions.device, positions.dtype)
    ):
        got = "none" if positions is None else f"a tensor of shape {tuple(positions.shape)} with other values"
        raise ValueError(
            "inside hf_tree_attention call the model with position_ids=pack.position_ids[None] (each token's "
            f"position in its own rollout), got {got}"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError(
            "inside hf_tree_attention the pack's tree decides what each token attends; an attention_mask "
            "that hides tokens cannot be honoured (drop the pads first: RolloutTrie.from_padded)"
        )


__all__ = [
    "HF_ATTENTION_NAME",
    "check_supported_config",
    "check_supported_model",
    "hf_tree_attention",
    "sliding_window",
]
