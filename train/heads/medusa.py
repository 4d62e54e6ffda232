"""Medusa heads: K independent residual MLPs on the base hidden state h_t (Cai et al., 2024)."""

from __future__ import annotations

import torch

from train.heads.headset import HeadSet


class MedusaHeads(HeadSet):
    """Head k sees only h_t; it cannot know which tokens the heads before it proposed."""

    arch = "medusa"
    uses_path = False

    def head_input(self, k: int, ctx: torch.Tensor, path: torch.Tensor | None) -> torch.Tensor:
        return self.mlps[k](ctx)
