"""Medusa heads: K independent residual MLPs on the base hidden state h_t (Cai et al., 2024)."""

from __future__ import annotations

import torch
from torch import nn

from train.heads.blocks import mlp_stack
from train.heads.headset import HeadSet


class MedusaHeads(HeadSet):
    """Head k sees only h_t; it cannot know which tokens the heads before it proposed."""

    arch = "medusa"
    uses_path = False

    def __init__(
        self, cfg, hidden_size, vocab_size, lm_head_weight, draft_ids=None, base_shape=None
    ):
        super().__init__(cfg, hidden_size, vocab_size, lm_head_weight, draft_ids, base_shape)
        self.mlps = nn.ModuleList(
            mlp_stack(hidden_size, hidden_size, cfg.num_layers, cfg.dropout)
            for _ in range(cfg.num_heads)
        )

    def head_input(self, k: int, ctx: torch.Tensor, path: torch.Tensor | None) -> torch.Tensor:
        return self.mlps[k](ctx)
