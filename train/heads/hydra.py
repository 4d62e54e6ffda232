"""Hydra heads: head k reads h_t and the embeddings of the k tokens before its target."""

from __future__ import annotations

import torch
from torch import nn

from train.heads.blocks import mlp_stack
from train.heads.headset import HeadSet


class HydraHeads(HeadSet):
    """Sequentially dependent heads (Ankner et al., 2024, "prefix-mlp" grounded heads).

    Head k (0-based) predicts x_{t+k+2} from [ctx_t, e(x_{t+1}), ..., e(x_{t+k+1})]: its first
    block maps (k+2)H -> H, the rest are H -> H, every block with its own weights.
    """

    arch = "hydra"
    uses_path = True

    def __init__(
        self, cfg, hidden_size, vocab_size, lm_head_weight, draft_ids=None, base_shape=None
    ):
        super().__init__(cfg, hidden_size, vocab_size, lm_head_weight, draft_ids, base_shape)
        self.mlps = nn.ModuleList(
            mlp_stack((k + 2) * hidden_size, hidden_size, cfg.num_layers, cfg.dropout)
            for k in range(cfg.num_heads)
        )

    def head_input(self, k: int, ctx: torch.Tensor, path: torch.Tensor | None) -> torch.Tensor:
        # ctx (..., H), path (..., k+1, H) -> (..., (k+2)H)
        x = torch.cat([ctx, path.flatten(-2)], dim=-1)
        return self.mlps[k](x)
