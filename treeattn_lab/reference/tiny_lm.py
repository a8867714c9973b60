"""TinyLM: a small GPT-style language model that reads top to bottom (after nanoGPT).

RMSNorm -> attention (RoPE on position ids, grouped-query heads) -> residual -> RMSNorm -> SwiGLU MLP
-> residual, repeated, then a final norm and the output head.

The attention itself is injected: every block calls ``attention(q, k, v)`` on ``[..., N, H, D]``
tensors. The same weights therefore run

- per sequence, on a padded batch ``[B, L]`` with causal attention (``forward_padded``), or
- once over a packed rollout tree ``[T]`` with tree attention (``forward_packed``),

and because RoPE reads each token's position inside its rollout, both give the same logits for every
token of every sequence. That identity is what makes tree training exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import causal_attention, tree_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TinyLMConfig:
    vocab_size: int = 32000
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 344
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x * rsqrt(mean(x^2) + eps) * weight, computed in at least float32 but never below the input
        # (float64 stays float64). On CUDA a half-precision input of the weight's dtype goes to torch's
        # fused kernel as it is: the kernel computes in float32 and rounds once, so the result is the one
        # of the float32 path below without its conversion kernels (two forward, three backward).
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and self.weight.dtype == x.dtype:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(dtype), x.shape[-1:], self.weight.to(dtype), self.eps).to(x.dtype)


class Rotary:
    """Rotary embedding (rotate-half form) at ``position_ids [..., N]``, computed once per forward and
    applied by every layer to its queries and keys: ``rotary(x)`` rotates ``x [..., N, H, D]``.

    Dims ``i`` and ``i + D/2`` turn together by angle ``a_i``: ``(x1, x2) -> (x1 cos - x2 sin,
    x2 cos + x1 sin)``. That is ``x * cos + roll(x, D/2) * signed_sin`` with ``cos = (cos a, cos a)`` and
    ``signed_sin = (-sin a, sin a)``: one roll and one multiply-add per tensor, and autograd's backward
    of it is as short (a roll by ``D/2`` is its own inverse).

    The angles are computed in float64 and their tables cast to ``dtype`` (the dtype the layers' q and
    k come in) when the object is made, so a layer only multiplies. An ``x`` of another dtype gets tables
    computed again in float64 and cast to its own dtype; only ``dtype``'s tables are kept, and nothing is
    cached on the object while layers run, which keeps a compiled layer's graph independent of which
    layer ran first.
    """

    def __init__(self, position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
        self.position_ids, self.head_dim, self.theta, self.dtype = position_ids, head_dim, theta, dtype
        self.cos, self.signed_sin = self._computed_tables(dtype)

    def _computed_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` of the float64 angles, cast to ``dtype``."""
        d = self.head_dim
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, d, 2, device=self.position_ids.device, dtype=torch.float64) / d
        )
        angles = self.position_ids.to(torch.float64)[..., None] * inv_freq  # [..., N, D/2]
        cos, sin = angles.cos(), angles.sin()
        cos, signed_sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
        return cos[..., None, :].to(dtype), signed_sin[..., None, :].to(dtype)  # [..., N, 1, D]

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` ``[..., N, 1, D]`` in ``dtype``."""
        if dtype == self.dtype:
            return self.cos, self.signed_sin
        return self._computed_tables(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        if d != self.head_dim:
            raise ValueError(f"rotary tables were made for head_dim {self.head_dim}, got {d}")
        cos, signed_sin = self.tables(x.dtype)
        return torch.addcmul(x * cos, x.roll(d // 2, dims=-1), signed_sin)


def rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x [..., N, H, D]`` at ``position_ids [..., N]``."""
    return Rotary(position_ids, x.shape[-1], theta, x.dtype)(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x, rotary: Rotary, attention: Attention):
        hd = self.cfg.head_dim
        q = rearrange(self.wq(x), "... n (h d) -> ... n h d", d=hd)
        k = rearrange(self.wk(x), "... n (h d) -> ... n h d", d=hd)
        v = rearrange(self.wv(x), "... n (h d) -> ... n h d", d=hd)
        out = attention(rotary(q), rotary(k), v)
        return self.wo(rearrange(out, "... n h d -> ... n (h d)"))


class SwiGLU(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = SelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, rotary: Rotary, attention: Attention):
        x = x + self.attn(self.attn_norm(x), rotary, attention)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or TinyLMConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False  # recompute each block in backward (non-reentrant checkpoint)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids, position_ids, attention: Attention | Sequence[Attention]) -> torch.Tensor:
        """Logits for ``input_ids [..., N]`` at ``position_ids [..., N]`` with the given attention.

        ``attention`` is one callable for every layer, or a sequence of one callable per layer (what the
        DFS engine passes, since each layer reads its own stored prefix keys and values).
        """
        if input_ids.dtype.is_floating_point:
            raise TypeError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        # a host-side check that a traced graph cannot run: compiled calls skip it (check ids eagerly)
        if not torch.compiler.is_compiling() and (
                int(input_ids.max()) >= self.cfg.vocab_size or int(input_ids.min()) < 0):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        per_layer = list(attention) if isinstance(attention, Sequence) else [attention] * len(self.blocks)
        if len(per_layer) != len(self.blocks):
            raise ValueError(f"got {len(per_layer)} attention callables for {len(self.blocks)} layers")
        return self.head(self.hidden(input_ids, position_ids, per_layer))

    def rotary(self, position_ids: torch.Tensor) -> Rotary:
        """The rotary embedding every layer applies at ``position_ids``, its tables in the dtype the
        layers' projections produce: autocast's where autocast is on, else the weights'."""
        device = position_ids.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = self.embed.weight.dtype
        return Rotary(position_ids, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def hidden(self, input_ids, position_ids, per_layer: Sequence[Attention]) -> torch.Tensor:
        """The final norm's output for ``input_ids`` with attention ``per_layer[i]`` in layer ``i``
        (no checks: :meth:`forward` makes them)."""
        x = self.embed(input_ids)
        rotary = self.rotary(position_ids)
        for block, layer_attention in zip(self.blocks, per_layer, strict=True):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rotary, layer_attention, use_reentrant=False)
            else:
                x = block(x, rotary, layer_attention)
        return self.norm(x)

    def forward_padded(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sequence logits ``[B, L, V]`` for a padded batch, with flat causal attention."""
        B, L = input_ids.shape
        pos = torch.arange(L, device=input_ids.device).expand(B, L)
        return self(input_ids, pos, lambda q, k, v: causal_attention(q, k, v, lengths))

    def forward_packed(self, pack, attention: Attention | None = None) -> torch.Tensor:
        """Logits ``[T, V]`` over a :class:`TreePack`; ``attention`` defaults to the tree reference.

        Pass ``lambda q, k, v: treeattn_lab.tree_attention(q, k, v, pack)`` to use a fast backend.
        """
        if attention is None:
            attention = lambda q, k, v: tree_attention(q, k, v, pack.subtree_end)
        return self(pack.input_ids, pack.position_ids, attention)
