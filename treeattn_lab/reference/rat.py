"""RAT+ (recurrence-augmented attention): a layer that is trained dense and can run dilated at inference.

The layer (after RMSNorm, inside a TinyLM block)::

    o, q, k, v, g = split(W_in x)                      # one projection
    g = sigmoid(g)                                     # per kv channel, shared by keys and values
    k~_t = g_t k~_{t-1} + (1 - g_t) k_t                # full-sequence gated recurrence (fp32, never reset)
    v~_t = g_t v~_{t-1} + (1 - g_t) v_t
    out = W_out( attention(rope(q), rope(k~), v~) * sigmoid(o) )

Because every position's key and value already summarize the recent past, attention no longer needs to
read every position: at inference it may read only every D-th one (plus a local window and a few initial
tokens; ``treeattn_lab.patterns.dilated``) and lose little. RAT+ trains for that with two passes per
batch, one dense (D = 1) and one dilated (D = 64, no window), each with its own optimizer step, then
adapts briefly to the target ``(D, W, P)`` (``treeattn_lab.experiments.rat_dilation``).

:class:`RATTinyLM` is :class:`~treeattn_lab.reference.tiny_lm.TinyLM` with this layer in place of plain
self-attention: the same embedding, RMSNorm, RoPE, SwiGLU and head (imported, not copied), and the same
call ``model(input_ids, position_ids, attention)`` with an injected ``attention(q, k, v)`` on
``[..., N, H, head_dim]`` tensors. Plain :class:`TinyLM` is the comparison model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange
from torch import nn

from .scan import gated_scan
from .tiny_lm import Attention, Rotary, TinyLM, TinyLMConfig

Scan = Callable[..., torch.Tensor]  # scan(x, g, dim=...) -> h, e.g. treeattn_lab.ops.gated_scan


class RATAttention(nn.Module):
    """The RAT+ token mixer: gated recurrence on keys and values, then (any) attention, output gate."""

    def __init__(self, cfg: TinyLMConfig, scan: Scan | None = None):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        # output gate o and queries per query head; keys, values and the gate g per kv head
        self.split_sizes = [cfg.n_heads * hd, cfg.n_heads * hd] + [cfg.n_kv_heads * hd] * 3
        self.w_in = nn.Linear(cfg.dim, sum(self.split_sizes), bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.scan = gated_scan if scan is None else scan

    def recurrent_kv(self, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor):
        """``k~, v~`` from ``k, v, gate [..., N, Hkv, hd]`` (gate already in (0, 1)): one scan, both."""
        kv = self.scan(torch.cat([k, v], dim=-1), torch.cat([gate, gate], dim=-1), dim=-3)
        return kv.chunk(2, dim=-1)

    def forward(self, x, rotary: Rotary, attention: Attention):
        hd = self.cfg.head_dim
        o, q, k, v, g = (
            rearrange(t, "... n (h d) -> ... n h d", d=hd) for t in self.w_in(x).split(self.split_sizes, -1)
        )
        k, v = self.recurrent_kv(k, v, torch.sigmoid(g))
        out = attention(rotary(q), rotary(k), v)
        out = out * torch.sigmoid(o)
        return self.wo(rearrange(out, "... n h d -> ... n (h d)"))


class RATTinyLM(TinyLM):
    """TinyLM whose blocks mix tokens with :class:`RATAttention` (``scan`` defaults to the reference loop).

    Pass ``scan=functools.partial(treeattn_lab.ops.gated_scan, backend="triton")`` on a GPU.
    """

    def __init__(self, cfg: TinyLMConfig | None = None, scan: Scan | None = None):
        super().__init__(cfg)
        for block in self.blocks:
            block.attn = RATAttention(self.cfg, scan)
            block.attn.apply(self._init)
