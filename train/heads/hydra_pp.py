"""Hydra++: Hydra heads reading one extra causal self-attention decoder layer over h_{1..t}."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.heads.hydra import HydraHeads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form). x: (B, h, T, d); positions: (T,)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None]  # (T, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class KVCache:
    """Keys and values of the extra layer for the tokens accepted so far: (B, kv_heads, S, d)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drop rejected draft tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class DecoderLayer(nn.Module):
    """A pre-norm Llama-style decoder layer (GQA attention with RoPE, SwiGLU MLP).

    Its output projections start at zero, so a new layer is the identity and a new Hydra++
    head set starts exactly where a Hydra one does.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        inter: int,
        eps: float,
        rope_theta: float,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope_theta = rope_theta
        self.attn_norm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj):
            nn.init.normal_(lin.weight, std=0.02)
        nn.init.zeros_(self.o_proj.weight)
        nn.init.zeros_(self.down_proj.weight)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """x: (B, T, H) new positions; with a cache they follow the cached ones."""
        B, T, _ = x.shape
        past = len(cache) if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + T, device=x.device)
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        if cache is not None:
            k, v = cache.append(k, v)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if past == 0:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new queries see every cached position and the new ones up to themselves
            S = k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.dropout(self.o_proj(att.transpose(1, 2).reshape(B, T, -1)))
        h = self.mlp_norm(x)
        return x + self.dropout(self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)))


class HydraPPHeads(HydraHeads):
    """Hydra++ (Ankner et al., 2024): the heads' context is one extra decoder layer over the
    base model's hidden states, with the attention shape of the base's own layers."""

    arch = "hydra_pp"
    uses_path = True

    def __init__(
        self, cfg, hidden_size, vocab_size, lm_head_weight, draft_ids=None, base_shape=None
    ):
        super().__init__(cfg, hidden_size, vocab_size, lm_head_weight, draft_ids, base_shape)
        s = self.base_shape
        heads = int(s.get("num_attention_heads", max(1, hidden_size // 64)))
        self.prefix = DecoderLayer(
            hidden=hidden_size,
            heads=heads,
            kv_heads=int(s.get("num_key_value_heads") or heads),
            head_dim=int(s.get("head_dim") or hidden_size // heads),
            inter=int(s.get("intermediate_size", 4 * hidden_size)),
            eps=float(s.get("rms_norm_eps", 1e-6)),
            rope_theta=float(s.get("rope_theta", 10000.0)),
            dropout=cfg.dropout,
        )

    def context(
        self,
        hidden: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.prefix(hidden, positions=positions, cache=cache)
