"""Hydra's cross-attn head (head=hydra_cross_attn): exact agreement with a stand-in written
to zankner/Hydra's HydraCrossAttentionDecoderLayer (its state-dict names, its attention
computed by hand), in training and along a drafted chain with its "virtual" ancestor keys,
through format=hydra."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

from tests.helpers import official_round_trip, random_one_layer_heads
from train.heads import base_shape
from train.heads.blocks import layer_config


def make(tiny_base, seed: int = 0):
    return random_one_layer_heads(tiny_base, "hydra_cross_attn", seed)


class OfficialCrossAttn(nn.Module):
    """zankner/Hydra's HydraCrossAttentionDecoderLayer as its code computes it, attention by
    hand: queries from token embeddings, keys / values from hidden states, one shared
    `input_layernorm`, the raw embedding as the residual, a Llama MLP, the base lm_head."""

    def __init__(self, config, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        H, nh, nkv, hd = (config.hidden_size, config.num_attention_heads,
                          config.num_key_value_heads, config.head_dim)  # fmt: skip
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.input_embed_fn, self.lm_head = embed, lm_head
        self.cross_attn = nn.Module()
        for n, (o, i) in {"q": (nh * hd, H), "k": (nkv * hd, H), "v": (nkv * hd, H),
                          "o": (H, nh * hd)}.items():  # fmt: skip
            setattr(self.cross_attn, f"{n}_proj", nn.Linear(i, o, bias=False))
        self.mlp = nn.Module()
        I = config.intermediate_size  # noqa: E741
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(H, I, False), nn.Linear(H, I, False)
        self.mlp.down_proj = nn.Linear(I, H, False)
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.eps = config.rms_norm_eps
        self.rope = LlamaRotaryEmbedding(config)

    def load(self, state: dict) -> None:
        own = {k.removesuffix(".weight") if "layernorm" in k else k: v for k, v in state.items()}
        missing, unexpected = self.load_state_dict(own, strict=False)
        assert unexpected == [] and set(missing) == {"input_embed_fn.weight"}

    def norm(self, x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def rot(self, x, pos):  # x (n, heads, hd) at positions pos (n,)
        cos, sin = self.rope(x, pos[None])
        return x * cos[0][:, None] + rotate_half(x) * sin[0][:, None]

    def attend(self, q_emb, q_pos, kv_h, kv_pos, allowed):
        n_q, n_k = q_emb.shape[0], kv_h.shape[0]
        qn, kn = self.norm(q_emb, self.input_layernorm), self.norm(kv_h, self.input_layernorm)
        q = self.rot(self.cross_attn.q_proj(qn).view(n_q, self.nh, self.hd), q_pos)
        k = self.rot(self.cross_attn.k_proj(kn).view(n_k, self.nkv, self.hd), kv_pos)
        v = self.cross_attn.v_proj(kn).view(n_k, self.nkv, self.hd)
        rep = self.nh // self.nkv  # repeat_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd)
        s = s.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        a = torch.einsum("hqk,khd->qhd", s, v).reshape(n_q, -1)
        out = q_emb + self.cross_attn.o_proj(a)
        m = self.mlp
        x = self.norm(out, self.post_attention_layernorm)
        return out + m.down_proj(nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))

    def training_logits(self, ids, hidden):  # ids (T,), hidden (T, H)
        T = ids.shape[0]
        emb = self.input_embed_fn(torch.roll(ids, -1))
        pos = torch.arange(T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        return self.lm_head(self.attend(emb, pos, hidden, pos, causal))

    def chain_logits(self, ids, hidden, drafts):
        """The root drafts[0] queries the prefix at T; depth d queries at T + d, over the
        prefix and the virtual keys (the root's and earlier depths' outputs) at T."""
        T = ids.shape[0] - 1  # the last prefix position
        pos = torch.arange(T + 1)
        outs = [self.attend(self.input_embed_fn(torch.tensor([drafts[0]])), pos[-1:], hidden,
                            pos, torch.ones(1, T + 1, dtype=torch.bool))]  # fmt: skip
        for d, tok in enumerate(drafts[1:], start=1):
            virtual = torch.cat(outs)  # root, depth 1 .. d - 1
            kv = torch.cat([hidden, virtual])
            kv_pos = torch.cat([pos, torch.full((len(virtual),), T)])
            outs.append(self.attend(self.input_embed_fn(torch.tensor([tok])),
                                    torch.tensor([T + d]), kv, kv_pos,
                                    torch.ones(1, len(kv), dtype=torch.bool)))  # fmt: skip
        return self.lm_head(torch.cat(outs))


def test_format_hydra_round_trip_matches_the_official_module(tmp_path, tiny_base):
    config = layer_config(base_shape(tiny_base.config))
    lm = nn.Linear(64, tiny_base.vocab_size, bias=False)
    official = OfficialCrossAttn(config, tiny_base.embed_tokens, lm)
    official_round_trip(tmp_path, tiny_base, make(tiny_base, seed=1), official, "cross-attn")
