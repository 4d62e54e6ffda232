"""EAGLE-3's draft (arXiv 2503.01840): low, middle and high base layers fused by one linear, one
decoder layer over [the next token's embedding; that feature], a draft vocabulary, and
training-time test.

At position t the draft reads g_t = fc([a_t; b_t; c_t]) (3H -> H, no bias), the base's hidden
states at three layers (`head.aux_layers`, indices of transformers' `hidden_states`, so i is
the input of layer i; null: EAGLE-3's 2, N // 2 and N - 3 of an N-layer base), and the
embedding of x_{t+1}. Its one decoder layer normalises both (`input_layernorm` on the
embedding, `hidden_norm` on the feature), concatenates them (embedding first) into q, k and v
projections of width 2H, adds the attention's output to the un-normalised feature (the
residual) and ends with a Llama MLP block. That output o_t is the draft's state: its own final
`norm` and `lm_head` (over the draft vocabulary, trained, initialised from the base's rows)
score x_{t+2}, and o_t itself is the feature the next drafting step reads in place of g.

Drafting is recurrent on the one engine's path for one-layer drafts (train/decoding/
recurrent.py): a node at depth d >= 1 reads [e(its token); its parent's o] at position T + d and
attends to the accepted prefix's keys (the layer's KV cache) and its ancestors'.

Training-time test: `num_heads` (K) is the number of unrolled steps. Step 0 is the teacher-forced
pass over the base's features; step j >= 1 reads, at every position t, the data token x_{t+j+1}
and its own step-(j-1) output at t, at RoPE position t + j, attending to step 0's keys up to t
and to the keys of steps 1..j at t (each position's own chain): exactly what drafting computes
along an accepted path, so training sees its own states as decoding feeds them. Step j's output
at t scores x_{t+j+2}, the target of "head" j+1; with `head_weighting: geometric` and
`head_decay: 0.8` the steps weigh 0.8**j, as EAGLE-3's. Every step shares the one lm head.

State-dict names are ours (`fc`, `layer.*`, `norm`, `lm_heads.0`, `draft.to_full`);
`format=eagle3` (train/export/eagle3.py) writes the layouts vLLM, SGLang and speculators read.
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

from train.core.errors import ConfigError
from train.heads.blocks import DraftAttention, positions_after
from train.heads.headset import RecurrentHeadSet


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's fused layers of an N-layer base, (2, N // 2, N - 3); for bases of under 7
    layers (test models) those indices clamped into 0..N-1, which may repeat."""
    N = num_layers
    return (min(2, N - 1), N // 2, max(N - 3, 0))


class Eagle3Attention(DraftAttention):
    """Llama self-attention whose q, k and v read a 2H input (no biases)."""

    def __init__(self, config):
        super().__init__(config, 2 * config.hidden_size, 2 * config.hidden_size)

    def forward(self, x, rope, cache, mask) -> torch.Tensor:
        """x (B, T, 2H) at RoPE `rope`; keys and values appended to `cache`; mask as
        `DraftAttention.attend`'s."""
        q = self.split(self.q_proj(x), self.heads)
        k = self.split(self.k_proj(x), self.kv_heads)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        return self.attend(q, k, self.split(self.v_proj(x), self.kv_heads), cache, mask)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [input_layernorm(emb); hidden_norm(feature)],
    added to the feature, then a Llama MLP block."""

    def __init__(self, config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, emb, feature, rope, cache, mask) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], dim=-1)
        h = feature + self.self_attn(x, rope, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _GrowingKV:
    """Keys and values that grow by concatenation: the unrolled training's cache (autograd
    keeps every step's tensors; a pre-allocated cache written in place would overwrite what
    backward needs)."""

    def __init__(self):
        self.layers = [self]
        self.k = self.v = None

    def update(self, k: torch.Tensor, v: torch.Tensor, *args, **kwargs):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.k is None else self.k.shape[2]


class Eagle3Heads(RecurrentHeadSet):
    """EAGLE-3's draft: fused base layers, one decoder layer, its own norm and draft lm head."""

    arch = "eagle3"
    noise_on_hidden = True  # head.noise_alpha (EAGLE-3 uses none: 0 in conf/head/eagle3.yaml)
    noise_on_path = False
    unrolled = True
    shared_lm_head = True

    def build(self, config) -> None:
        H = config.hidden_size
        n_layers = int(self.base_shape.get("num_hidden_layers") or 0)
        aux = self.cfg.aux_layers
        if aux is None:
            if n_layers < 1:
                raise ConfigError(
                    "eagle3 heads need the base's num_hidden_layers for their default "
                    "aux_layers; set head.aux_layers (e.g. [2, 15, 27])"
                )
            aux = default_aux_layers(n_layers)
        if n_layers and max(aux) >= n_layers:
            raise ConfigError(
                f"head.aux_layers={list(aux)} reaches past this base's {n_layers} layers: give "
                f"indices in 0..{n_layers - 1} (i: the input of layer i)"
            )
        self.aux_layers = tuple(int(i) for i in aux)
        self.fc = nn.Linear(len(self.aux_layers) * H, H, bias=False)
        self.layer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        for module in (self.fc, self.layer):  # LlamaPreTrainedModel's initialisation
            for lin in module.modules():
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=config.initializer_range)
        if self.cfg.init == "ours":
            # fc starts as "pass the highest layer through", the attention and MLP outputs at
            # zero: a fresh draft is the lm head on the normalised high layer
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight[:, -H:] = torch.eye(H)
            nn.init.zeros_(self.layer.self_attn.o_proj.weight)
            nn.init.zeros_(self.layer.mlp.down_proj.weight)

    @property
    def features(self) -> tuple[int, ...]:
        return self.aux_layers

    def context(
        self,
        hidden: torch.Tensor,
        cache=None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        next_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, len(aux_layers) H) fused base layers and the embeddings of the tokens after
        them (B, T, H) -> the layer's output o_t at each position (pre-norm: the state the next
        step reads, and `logits` normalises)."""
        if next_emb is None:
            raise ValueError("eagle3 heads read the next token's embedding (next_emb)")
        if positions is None:
            positions = positions_after(cache, hidden.shape[1], hidden.device)
        g = self.fc(hidden)
        return self.layer(next_emb.to(g.dtype), g, self._rope(g, positions), cache, mask)

    def step(self, emb, parent, cache, positions, mask, anchor=None) -> torch.Tensor:
        """One drafting step: nodes' token embeddings emb (B, P, H) and their parents' outputs
        `parent` (B, P, H), at `positions` (B, P), attending to `cache` under `mask`; their keys
        are appended to the cache (the caller drops them after the proposal)."""
        return self.layer(emb.to(parent.dtype), parent, self._rope(parent, positions), cache, mask)

    def logits(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """The draft-vocab logits of a drafting state (what `context` and `step` return, the
        pre-norm output): its final norm, then the lm head. (`forward` returns the normalised
        states, what the fused loss's output projection reads.)"""
        return self.lm_heads[0](self.norm(state))

    def forward(
        self,
        hidden: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        select: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test: K unrolled steps over (B, T, len(aux) H) fused base layers and
        the input embeddings (B, T, H). Entry j is the normalised step-j output (what the lm
        head reads), at every position (B, T, H) or at `select[j]`'s (N_j, H); at t it scores
        x_{t+j+2}."""
        if input_embeds is None:
            raise ValueError("eagle3 heads need input_embeds")
        if self.training and self.cfg.noise_alpha > 0:
            from train.heads.blocks import official_noise

            hidden = hidden + official_noise(hidden, self.cfg.noise_alpha, lengths)
        B, T, H = input_embeds.shape
        K = self.num_heads
        emb = torch.cat([input_embeds, input_embeds.new_zeros(B, K, H)], dim=1)  # e(x_s), 0 past T
        cache, idx = _GrowingKV(), torch.arange(T, device=hidden.device)
        state = self.context(hidden, cache=cache, positions=idx, next_emb=emb[:, 1 : T + 1])
        states = [state]
        causal = idx[None] <= idx[:, None]  # step 0's keys up to t
        eye = torch.eye(T, dtype=torch.bool, device=hidden.device)
        for j in range(1, K):
            seen = torch.cat([causal] + [eye] * j, dim=-1)[None, None]  # then t's own chain
            pos = (idx + j)[None].expand(B, T)
            state = self.step(emb[:, j + 1 : T + j + 1], state, cache, pos, seen)
            states.append(state)
        out = []
        for j, s in enumerate(states):
            if select is not None:
                b, t = select[j]
                s = s[b, t]
            out.append(self.norm(s))
        return out
