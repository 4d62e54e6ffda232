"""Building blocks shared by the head architectures: residual MLP blocks, draft vocab, noise,
the config of the heads' own decoder layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig


class ResBlock(nn.Module):
    """x -> proj(x) + SiLU(W x) on dropout(x): the Medusa/Hydra head block (zankner/Hydra's
    `[Dropout, ResBlock]`; proj is its `res_connection` when in_dim != dim, else identity).

    init="ours": W, its bias and proj's bias start at zero and proj at "pick the first `dim`
    features", so a new block passes the context state through and a fresh head starts as the
    base model's own lm_head. init="official": as zankner/Hydra builds it, W at zero and
    everything else at nn.Linear's default (random) initialisation.
    """

    def __init__(
        self, in_dim: int, dim: int, dropout: float, bias: bool, init: str = "ours"
    ) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(in_dim, dim)
        self.proj = nn.Identity() if in_dim == dim else nn.Linear(in_dim, dim, bias=bias)
        self.act = nn.SiLU()
        nn.init.zeros_(self.linear.weight)
        if init == "ours":
            with torch.no_grad():
                nn.init.zeros_(self.linear.bias)
                if in_dim != dim:
                    self.proj.weight.zero_()
                    self.proj.weight[:, :dim] = torch.eye(dim)
                    if bias:
                        self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        return self.proj(x) + self.act(self.linear(x))


def mlp_stack(
    in_dim: int, dim: int, num_layers: int, dropout: float, bias: bool, tie: bool, init: str
) -> nn.Sequential:
    """num_layers ResBlocks, the first mapping in_dim -> dim. `bias`: a first block that changes
    the width has a bias on its input projection. `tie`: every dim -> dim block is one module
    repeated, as zankner/Hydra's `[ResBlock] * n` builds them (blocks 2..L of a Hydra head, all
    L of a Medusa one); otherwise each block has its own weights."""
    shared = ResBlock(dim, dim, dropout, bias, init) if tie else None
    blocks = [] if in_dim == dim else [ResBlock(in_dim, dim, dropout, bias, init)]
    while len(blocks) < num_layers:
        blocks.append(shared or ResBlock(dim, dim, dropout, bias, init))
    return nn.Sequential(*blocks)


def official_noise(x: torch.Tensor, alpha: float, lengths: torch.Tensor | None) -> torch.Tensor:
    """zankner/Hydra's NEFTune noise for `x` (B, T, H): uniform in +-alpha / sqrt(n_b * H), with
    n_b row b's unpadded length (T when `lengths` is None)."""
    n = lengths if lengths is not None else torch.full((x.shape[0],), x.shape[1])
    scale = alpha / torch.sqrt(n.clamp_min(1).to(x.device, torch.float32) * x.shape[-1])
    return (torch.rand_like(x) * 2 - 1) * scale.to(x.dtype)[:, None, None]


class DraftVocabError(ValueError):
    """A draft vocab map (draft.to_full) that cannot stand for tokens of the vocab given."""


class DraftVocab(nn.Module):
    """Maps between the full vocab and a head's draft vocab (the N most frequent tokens)."""

    def __init__(self, token_ids: torch.Tensor, full_vocab_size: int):
        super().__init__()
        token_ids = token_ids.long()
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise DraftVocabError(
                f"the draft vocab map (draft.to_full) has shape {tuple(token_ids.shape)}, not "
                "one token id per draft token"
            )
        outside = token_ids[(token_ids < 0) | (token_ids >= full_vocab_size)]
        if outside.numel():  # e.g. heads made for a base with a larger vocab
            raise DraftVocabError(
                f"the draft vocab maps to {outside.numel()} token "
                f"id{'s' if outside.numel() > 1 else ''} outside the vocab of "
                f"{full_vocab_size} (e.g. {outside[:3].tolist()}): a damaged map, or one made "
                "for another vocab"
            )
        if torch.unique(token_ids).numel() != token_ids.numel():
            raise DraftVocabError(
                "the draft vocab map (draft.to_full) lists a token id twice: each draft token "
                "must stand for another base token"
            )
        to_draft = torch.full((full_vocab_size,), -1, dtype=torch.long)
        to_draft[token_ids] = torch.arange(len(token_ids))
        self.register_buffer("to_full", token_ids, persistent=True)
        self.register_buffer("to_draft", to_draft, persistent=False)

    @property
    def size(self) -> int:
        return int(self.to_full.numel())

    def draft_ids(self, full_ids: torch.Tensor) -> torch.Tensor:
        """Draft index of each full-vocab id, -1 where the token is not in the draft vocab."""
        return self.to_draft[full_ids]

    def full_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.to_full[draft_ids]


def top_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids (ties broken by the smaller id), sorted by id."""
    order = torch.argsort(-counts, stable=True)  # stable: equal counts keep id order
    return torch.sort(order[:n]).values


def layer_config(shape: dict) -> LlamaConfig:
    """A one-layer Llama config with the base's attention shape, for the heads' own decoder
    layers (Hydra++'s extra layer, eagle-attn's and cross-attn's), as zankner/Hydra deep-copies
    the base config and sets num_hidden_layers=1."""
    H = int(shape["hidden_size"])
    heads = int(shape.get("num_attention_heads") or max(1, H // 64))
    config = LlamaConfig(
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=int(shape.get("num_key_value_heads") or heads),
        head_dim=int(shape.get("head_dim") or H // heads),
        intermediate_size=int(shape.get("intermediate_size") or 4 * H),
        rms_norm_eps=float(shape.get("rms_norm_eps") or 1e-6),
        # the base's RoPE (its scaling too, e.g. Llama 3's), or only its theta when recorded
        # by an older hydra-heads
        rope_parameters=shape.get("rope_parameters")
        or {"rope_type": "default", "rope_theta": float(shape.get("rope_theta") or 10000.0)},
        max_position_embeddings=int(shape.get("max_position_embeddings") or 2048),
        initializer_range=float(shape.get("initializer_range") or 0.02),
        num_hidden_layers=1,
        vocab_size=int(shape.get("vocab_size") or 1),
    )
    config._attn_implementation = "sdpa"
    return config


def positions_after(cache, T: int, device) -> torch.Tensor:
    """(T,) positions of T new tokens after what `cache` holds (None: from 0)."""
    past = cache.get_seq_length() if cache is not None else 0
    return torch.arange(past, past + T, device=device)


def run_decoder_layer(layer: nn.Module, rotary: nn.Module, x, positions, cache, mask):
    """A transformers Llama decoder `layer` over x (B, T, H) at `positions` ((T,), (B, T), or
    None: after what `cache` holds), appending to `cache` (any transformers Cache, or None).
    `mask`: an explicit additive (B, 1, T, cached + T) mask (batched decoding, where rows hold
    different numbers of cached positions), or None: the new queries see every cached position
    and the new ones up to themselves."""
    B, T, _ = x.shape
    past = cache.get_seq_length() if cache is not None else 0
    if positions is None:
        positions = positions_after(cache, T, x.device)
    pos = positions if positions.dim() == 2 else positions[None].expand(B, -1)
    if mask is None and past and T > 1:  # one query sees everything without a mask
        mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        mask = mask[None, None].expand(B, 1, T, past + T)
    return layer(
        x,
        attention_mask=mask,
        position_ids=pos,
        cache=cache,
        use_cache=cache is not None,
        position_embeddings=rotary(x, pos),
    )


class DraftAttention(nn.Module):
    """Llama-shaped attention of the one-layer drafts (cross-attn, EAGLE-3): q from a `q_dim`
    input, k and v from a `kv_dim` one, no biases, grouped KV heads as the base's."""

    def __init__(self, config, q_dim: int, kv_dim: int):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(q_dim, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(kv_dim, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(kv_dim, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, H, bias=False)

    def split(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # (B, n, T, hd)

    def attend(self, q, k, v, cache, mask) -> torch.Tensor:
        """Rotated q (B, heads, T, hd) over k, v (B, kv_heads, T', hd), appended to `cache`
        (any object whose `layers[0].update(k, v)` returns every key and value so far) when
        given; mask: additive or boolean (B, 1, T, all keys), or None for causal attention
        whose last query sees every key. Returns the output projection (B, T, H)."""
        if cache is not None:
            k, v = cache.layers[0].update(k, v)
        T, S = q.shape[2], k.shape[2]
        causal = mask is None and T > 1 and T == S  # no cache: the kernel's own causal mask
        if mask is None and T > 1 and S > T:  # query i sees the keys up to S - T + i
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
        if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        gqa = self.heads != self.kv_heads
        if gqa and mask is not None and q.is_cuda:
            # CUDA's memory-efficient kernel takes a mask but not grouped heads: expand them
            # (else the math kernel keeps every unrolled step's full score matrix)
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
        )
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], T, -1))
