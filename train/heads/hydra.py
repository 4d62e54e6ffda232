"""Hydra heads: head k reads h_t and the embeddings of the k tokens before its target."""

from __future__ import annotations

import torch

from train.heads.headset import HeadSet


class HydraHeads(HeadSet):
    """Sequentially dependent heads (Ankner et al., 2024): zankner/Hydra's `hydra_head_arch=mlp`
    with `grounded_heads=true`. (Its `prefix-mlp` is Hydra++, train/heads/hydra_pp.py; an
    ungrounded `mlp` is our Medusa.)

    Head k (0-based) predicts x_{t+k+2} from [ctx_t, e(x_{t+1}), ..., e(x_{t+k+1})]: its first
    block maps (k+2)H -> H, the rest are H -> H (one shared block with head.tie_blocks).
    """

    arch = "hydra"
    uses_path = True

    def head_input(self, k: int, ctx: torch.Tensor, path: torch.Tensor | None) -> torch.Tensor:
        # ctx (..., H), path (..., k+1, H) -> (..., (k+2)H)
        x = torch.cat([ctx, path.flatten(-2)], dim=-1)
        return self.mlps[k](x)
