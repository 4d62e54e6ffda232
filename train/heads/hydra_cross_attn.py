"""Hydra's cross-attn draft head: the next token's embedding attends to the base's hidden
states, drafting recurrently with its ancestors' output states as extra keys.

As in zankner/Hydra (`hydra_head_arch=cross-attn`, `HydraCrossAttentionDecoderLayer`): at
position t the query is the embedding of x_{t+1}, at RoPE position t; the keys and values are
the base's hidden states h_0..h_t, each at its own position; one RMSNorm (`input_layernorm`)
normalises both. Then a Llama block: `out = e(x_{t+1}) + o_proj(attention)`, `out += mlp(
post_attention_layernorm(out))`, scored by the base's own lm_head (frozen, no norm before it):
the output at t predicts x_{t+2}. The same training noise goes on the embeddings and the
hidden states; the head has no dropout; one head is trained (num_heads=1).

Drafting is recurrent: the root's children come from the output at the last accepted position
T; a node at depth d >= 1 is a query (its token's embedding, at position T + d) over the
accepted prefix's keys (the layer's KV cache) and its ancestors' output states, projected like
hidden states and placed at position T (the official "virtual" keys). Each drafting step
appends one such key per node, its parent's output, so that a node sees exactly the keys of
its ancestors and itself (train/decoding/recurrent.py).

State-dict names mirror the official module: `cross_attn.{q,k,v,o}_proj`, `mlp.*`,
`input_layernorm`, `post_attention_layernorm`; the lm head is `lm_heads.0` (the base's rows,
frozen); the base embedding table is not part of the heads.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from train.heads.blocks import DraftAttention, positions_after
from train.heads.headset import RecurrentHeadSet


class CrossAttention(DraftAttention):
    """Llama attention whose queries and keys come from different inputs (no biases)."""

    def __init__(self, config):
        super().__init__(config, config.hidden_size, config.hidden_size)

    def forward(self, q_in, kv_in, q_rope, kv_rope, cache, mask) -> torch.Tensor:
        """q_in (B, Tq, H) normalised queries; kv_in (B, Tk, H) normalised key/value inputs,
        appended to `cache` (their rotated keys) when given; mask: additive (B, 1, Tq, all
        keys), or None for causal attention whose last query sees every key."""
        q = self.split(self.q_proj(q_in), self.heads)
        q = apply_rotary_pos_emb(q, q, *q_rope)[0]  # queries and keys at their own positions
        k = self.split(self.k_proj(kv_in), self.kv_heads)
        k = apply_rotary_pos_emb(k, k, *kv_rope)[0]
        return self.attend(q, k, self.split(self.v_proj(kv_in), self.kv_heads), cache, mask)


class CrossAttnHeads(RecurrentHeadSet):
    """One cross-attention draft layer over the base hidden states (Hydra's cross-attn)."""

    arch = "hydra_cross_attn"
    noise_on_hidden = True  # zankner/Hydra: the same noise on the embeddings and h
    noise_on_path = True

    def build(self, config) -> None:
        hidden_size = config.hidden_size
        self.cross_attn = CrossAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        for module in (self.cross_attn, self.mlp):  # LlamaPreTrainedModel's initialisation
            for lin in module.modules():
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=config.initializer_range)
        if self.cfg.init == "ours":  # attention and MLP outputs at zero: it starts as e(x_{t+1})
            nn.init.zeros_(self.cross_attn.o_proj.weight)
            nn.init.zeros_(self.mlp.down_proj.weight)

    def _block(self, query_emb, kv_hidden, q_pos, kv_pos, cache, mask) -> torch.Tensor:
        q_in = self.input_layernorm(query_emb)
        kv_in = self.input_layernorm(kv_hidden)  # one norm for both, as theirs
        attn = self.cross_attn(
            q_in, kv_in, self._rope(q_in, q_pos), self._rope(kv_in, kv_pos), cache, mask
        )
        out = query_emb + attn  # the residual is the raw embedding
        return out + self.mlp(self.post_attention_layernorm(out))

    def context(
        self,
        hidden: torch.Tensor,
        cache=None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        next_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, H) base hidden states (keys, appended to `cache`) and the embeddings of the
        tokens after them (B, T, H, the queries) -> the output at each position."""
        if next_emb is None:
            raise ValueError("cross-attn heads query with the next token's embedding (next_emb)")
        if positions is None:
            positions = positions_after(cache, hidden.shape[1], hidden.device)
        return self._block(next_emb.to(hidden.dtype), hidden, positions, positions, cache, mask)

    def step(self, emb, parent, cache, positions, mask, anchor=None) -> torch.Tensor:
        """One drafting step: queries emb (B, P, H) at `positions` (B, P); one key per node,
        its parent's output state `parent` (B, P, H), appended to `cache` at position
        `anchor` (B, P: the last accepted position); `mask` (B, 1, P, cached + P)."""
        if anchor is None:
            raise ValueError("cross-attn drafting places its ancestor keys at `anchor`")
        return self._block(emb.to(parent.dtype), parent, positions, anchor, cache, mask)
