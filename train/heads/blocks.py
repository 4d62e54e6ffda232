"""Building blocks shared by the head architectures: residual MLP blocks, draft vocab, noise."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    """x -> proj(x) + SiLU(W x): the Medusa/Hydra head block.

    W starts at zero and proj at "pick the first `dim` features", so a new block passes the
    context state through unchanged and a fresh head starts as the base model's own lm_head.
    """

    def __init__(self, in_dim: int, dim: int, dropout: float = 0.0, bias: bool = False):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(in_dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.proj: nn.Module
        if in_dim == dim:
            self.proj = nn.Identity()
        else:
            self.proj = nn.Linear(in_dim, dim, bias=bias)
            with torch.no_grad():
                if bias:
                    self.proj.bias.zero_()
                self.proj.weight.zero_()
                self.proj.weight[:, :dim] = torch.eye(dim)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        return self.proj(x) + self.act(self.linear(x))


def mlp_stack(
    in_dim: int, dim: int, num_layers: int, dropout: float, bias: bool = False
) -> nn.Sequential:
    """num_layers ResBlocks, the first mapping in_dim -> dim; each block its own module.
    `bias`: the first block's input projection (in_dim != dim) carries a bias."""
    return nn.Sequential(
        ResBlock(in_dim, dim, dropout, bias),
        *(ResBlock(dim, dim, dropout) for _ in range(num_layers - 1)),
    )


def neftune_noise(x: torch.Tensor, alpha: float, training: bool) -> torch.Tensor:
    """NEFTune: uniform noise of scale alpha / sqrt(seq_len * dim), training only."""
    if not training or alpha <= 0:
        return x
    scale = alpha / math.sqrt(x.shape[-2] * x.shape[-1])
    return x + torch.empty_like(x).uniform_(-scale, scale)


def shift_left(x: torch.Tensor, j: int) -> torch.Tensor:
    """x[:, t + j] at position t (zeros past the end): (B, T, H) -> (B, T, H)."""
    if j == 0:
        return x
    return F.pad(x[:, j:], (0, 0, 0, j))


class DraftVocab(nn.Module):
    """Maps between the full vocab and a head's draft vocab (the N most frequent tokens)."""

    def __init__(self, token_ids: torch.Tensor, full_vocab_size: int):
        super().__init__()
        token_ids = token_ids.long()
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
