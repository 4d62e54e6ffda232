"""Hydra's eagle-attn draft head: EAGLE's fused input and one Llama decoder layer, drafting
recurrently on its own output states.

As in zankner/Hydra (`hydra_head_arch=eagle-attn`, `EagleAttentionDecoderLayer`): at position t
the head reads `fc([e(x_{t+1}); h_t])` (the next token's embedding first, then the base hidden
state; `fc` a (2H -> H) linear with a bias), runs one `LlamaDecoderLayer` with the base's
attention shape over those inputs (causal, RoPE at t) and scores its output with the base's own
lm_head, frozen, with no norm before it: the output at t predicts x_{t+2}. Training noise goes
on h_t only; the head has no dropout. One head is trained (num_heads=1, its target x_{t+2}).

Drafting is recurrent (EAGLE): the root's children come from the output at the last accepted
position; a node at depth d >= 1 reads `fc([e(its token); its parent's output])` at position
T + d and attends to the accepted prefix (the layer's KV cache) and to its own ancestors' states
(appended to the cache for the proposal, then dropped), so a tree may be as deep as wanted
(`depth_limit` is None). The official proposal writes a mask built for cross-attn into the
corner of eagle's cache, which lets a drafted node see its siblings and cousins; here a node
sees exactly the prefix, its ancestors and itself, the same rule training's unrolled
calibration uses.

State-dict names mirror the official module: `fc.*`, `attn.*` (the decoder layer). The lm head
is `lm_heads.0` (the base's rows, frozen); the base embedding table is not part of the heads.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from train.heads.blocks import run_decoder_layer
from train.heads.headset import RecurrentHeadSet


class EagleAttnHeads(RecurrentHeadSet):
    """One EAGLE-style draft layer over the base hidden states (Hydra's eagle-attn)."""

    arch = "hydra_eagle"
    noise_on_hidden = True
    noise_on_path = False  # zankner/Hydra adds the noise to h_t only

    def build(self, config) -> None:
        hidden_size = config.hidden_size
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=True)
        self.attn = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        for module in self.attn.modules():  # LlamaPreTrainedModel's initialisation
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)
        if self.cfg.init == "ours":
            # fc starts as "pass h_t through" and the layer's attention and MLP outputs at
            # zero, so a fresh head is the base lm_head on h_t (predicting x_{t+1}'s successor
            # from h_t alone, as an untrained Medusa head does)
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight[:, hidden_size:] = torch.eye(hidden_size)
                self.fc.bias.zero_()
            nn.init.zeros_(self.attn.self_attn.o_proj.weight)
            nn.init.zeros_(self.attn.mlp.down_proj.weight)

    def _layer(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cache,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder layer over fused inputs x (B, T, H) at `positions` ((T,) or (B, T)),
        appending to `cache`; `mask` an additive (B, 1, T, cached + T) mask, or None for causal
        attention over the cache and the new positions."""
        return run_decoder_layer(self.attn, self.rotary_emb, x, positions, cache, mask)

    def context(
        self,
        hidden: torch.Tensor,
        cache=None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        next_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, H) base hidden states and the embeddings of the tokens after them (B, T, H)
        -> the layer's output at each position, which predicts the token after the next."""
        if next_emb is None:
            raise ValueError("eagle-attn heads read the next token's embedding (next_emb)")
        x = self.fc(torch.cat([next_emb.to(hidden.dtype), hidden], dim=-1))
        return self._layer(x, positions, cache, mask)

    def step(
        self,
        emb: torch.Tensor,
        parent: torch.Tensor,
        cache,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        anchor: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One drafting step: nodes with token embeddings emb (B, P, H) whose parents' output
        states are `parent` (B, P, H), at `positions` (B, P), attending to `cache` under
        `mask` (B, 1, P, cached + P). Returns their output states (B, P, H); their keys and
        values are appended to the cache (the caller drops them after the proposal). `anchor`
        (the last accepted position) is not used: each node's key sits at its own position."""
        x = self.fc(torch.cat([emb.to(parent.dtype), parent], dim=-1))
        return self._layer(x, positions, cache, mask)
