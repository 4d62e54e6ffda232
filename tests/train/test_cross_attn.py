"""Hydra's cross-attn head (head=hydra_cross_attn): recurrent drafting against the unrolled
chain, and exact agreement with a stand-in written to zankner/Hydra's
HydraCrossAttentionDecoderLayer (its state-dict names, its attention computed by hand), in
training and along a drafted chain with its "virtual" ancestor keys, through format=hydra."""

from __future__ import annotations

import json
import math

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

from tests.helpers import base_config, head_config
from train.decoding.cache import KVCache
from train.decoding.recurrent import DraftMemory, recurrent_step, unroll
from train.export import export_heads, import_heads
from train.heads import base_shape, build_heads, heads_meta, load_heads, save_heads
from train.heads.hydra_pp import prefix_config

TINY = base_config("tiny_random", name="tiny_random")


def make(tiny_base, seed: int = 0):
    torch.manual_seed(seed)
    cfg = head_config("hydra_cross_attn")
    heads = build_heads(cfg, base_shape(tiny_base.config), tiny_base.lm_head.weight)
    with torch.no_grad():  # random weights: a near-identity layer would hide wiring bugs
        for p in heads.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.1)
    return heads.eval()


def test_drafting_on_a_path_equals_the_unrolled_chain(tiny_base):
    """Decoding's drafting along a path (a decoy sibling beside each node) is calibration's
    unroll at that position, at every depth."""
    heads = make(tiny_base)
    embed = tiny_base.embed_tokens
    T, t = 14, 8
    torch.manual_seed(3)
    ids = torch.randint(0, tiny_base.vocab_size, (T,))
    hidden = torch.randn(T, 64)
    chain = unroll(heads, hidden, ids, embed, 4)
    cache = KVCache(1, 64)
    ctx = heads.context(hidden[None, : t + 1], cache=cache, next_emb=embed(ids[None, 1 : t + 2]))
    assert torch.allclose(ctx[0, t], chain[0][0, t], atol=1e-5)
    mem = DraftMemory(cache, torch.tensor([t + 1]), t + 1, torch.float32)
    state = ctx[:, t][:, None]
    for d in range(1, 4):
        toks = torch.stack([ids[t + d + 1], (ids[t + d + 1] + 5) % tiny_base.vocab_size])[None]
        anc = torch.tensor([True, False] * (d - 1), dtype=torch.bool).expand(1, 2, -1)
        out = recurrent_step(heads, embed, mem, toks, state.expand(1, 2, -1), d, anc)
        assert torch.allclose(out[0, 0], chain[d][0, t], atol=1e-5), d
        assert not torch.allclose(out[0, 1], chain[d][0, t], atol=1e-3)
        state = out[:, :1]


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
    heads = make(tiny_base, seed=1)
    meta = heads_meta(heads, tiny_base.fingerprint(), TINY.to_dict())
    hdir = save_heads(tmp_path / "run" / "heads", heads, meta)
    export_heads(hdir, "hydra", tmp_path / "x")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["hydra_head_arch"] == "cross-attn" and cfg["grounded_heads"] is True
    state = torch.load(tmp_path / "x" / "hydra_lm_head.pt", weights_only=True)
    config = prefix_config(base_shape(tiny_base.config))
    off = OfficialCrossAttn(config, tiny_base.embed_tokens, nn.Linear(64, tiny_base.vocab_size))
    off.lm_head = nn.Linear(64, tiny_base.vocab_size, bias=False)
    off.load(state)
    torch.manual_seed(5)
    ids = torch.randint(0, tiny_base.vocab_size, (10,))
    hidden = torch.randn(10, 64)
    embed = tiny_base.embed_tokens
    with torch.no_grad():
        ours = heads.logits(0, heads(hidden[None], embed(ids)[None])[0])[0]
        want = off.training_logits(ids, hidden)
        assert torch.allclose(ours[:-1], want[:-1], atol=1e-4)  # the last wraps in theirs
        drafts = [int(x) for x in torch.randint(0, tiny_base.vocab_size, (4,))]
        path = torch.cat([ids, torch.tensor(drafts)])
        chain = unroll(heads, torch.cat([hidden, torch.zeros(4, 64)]), path, embed, 4)
        got = torch.stack([heads.logits(0, chain[d][0, 9]) for d in range(4)])
        assert torch.allclose(got, off.chain_logits(ids, hidden, drafts), atol=1e-4)
    import_heads(tmp_path / "x", "hydra", TINY, tmp_path / "back")
    back, _ = load_heads(tmp_path / "back", tiny_base.fingerprint())
    assert back.arch == "hydra_cross_attn"
    for (n, a), (m, b) in zip(heads.state_dict().items(), back.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
