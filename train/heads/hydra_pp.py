"""Hydra++: Hydra heads reading one extra causal self-attention layer over h_{1..t}.

As in zankner/Hydra (`hydra_head_arch=prefix-mlp`), the extra layer is a one-layer Llama model
built from transformers' own classes: a `LlamaDecoderLayer` with the base model's attention
shape, then its own learned final `LlamaRMSNorm` (eps = the base's rms_norm_eps). That normalised
output replaces h_t as every head's first input. Parameter names mirror the official
`prefix_embeding_layer` (`layers.0.*`, `norm.weight`); it reads inputs_embeds, so the
official module's unused token embedding table is not built.

At inference the layer keeps its own KV cache, the decoding engine's KVCache (any
`transformers.Cache` works): only accepted tokens enter it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from train.heads.blocks import layer_config, run_decoder_layer
from train.heads.hydra import HydraHeads


class PrefixLayer(nn.Module):
    """One Llama decoder layer and its final RMSNorm over (B, T, H) hidden states."""

    def __init__(self, config, init: str):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        for module in self.layers.modules():  # LlamaPreTrainedModel's initialisation
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)
        if init == "ours":  # attention and MLP outputs at zero: the layer starts as its norm
            attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
            nn.init.zeros_(attn.o_proj.weight)
            nn.init.zeros_(mlp.down_proj.weight)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: Cache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, H) new positions; with a cache they follow the cached ones. positions:
        (T,) or per row (B, T). mask: an explicit (B, 1, T, cached + T) additive mask (batched
        decoding, where rows hold different numbers of cached positions)."""
        h = run_decoder_layer(self.layers[0], self.rotary_emb, x, positions, cache, mask)
        return self.norm(h)


class HydraPPHeads(HydraHeads):
    """Hydra++ (Ankner et al., 2024): the heads' context is one extra decoder layer (and its
    final norm) over the base model's hidden states, with the base's own attention shape."""

    arch = "hydra_pp"
    uses_path = True
    noise_on_hidden = False  # zankner/Hydra's prefix-mlp: noise on the path embeddings only

    def __init__(
        self, cfg, hidden_size, vocab_size, lm_head_weight, draft_ids=None, base_shape=None
    ):
        super().__init__(cfg, hidden_size, vocab_size, lm_head_weight, draft_ids, base_shape)
        shape = {**self.base_shape, "hidden_size": hidden_size, "vocab_size": vocab_size}
        self.prefix = PrefixLayer(layer_config(shape), cfg.init)

    def context(
        self,
        hidden: torch.Tensor,
        cache: Cache | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.prefix(hidden, positions=positions, cache=cache, mask=mask)
