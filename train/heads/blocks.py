"""Building blocks shared by the head architectures: residual MLP blocks, draft vocab, noise."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from train.config import fail


@dataclass
class LossConfig:
    """How head outputs are scored (`head.loss` in conf/head/*.yaml)."""

    lm_weight: float = 0.0  # cross-entropy on the true next-next token
    distill_weight: float = 1.0  # KL(p_base || p_head) at temperature T
    temperature: float = 1.0
    head_weighting: Literal["constant", "geometric"] = "constant"
    head_decay: float = 0.8  # geometric: head k weighs decay**(k-1)
    chunk_size: int = 1024  # positions per logits chunk: bounds memory to chunk x vocab

    def __post_init__(self) -> None:
        if self.lm_weight < 0 or self.distill_weight < 0:
            fail("lm_weight", (self.lm_weight, self.distill_weight), "weights must be >= 0")
        if self.lm_weight == 0 and self.distill_weight == 0:
            fail("distill_weight", 0, "lm_weight and distill_weight cannot both be 0")
        if self.temperature <= 0:
            fail("temperature", self.temperature, "a number > 0")
        if not 0 < self.head_decay <= 1:
            fail("head_decay", self.head_decay, "a number in (0, 1]")
        if self.chunk_size < 1:
            fail("chunk_size", self.chunk_size, "a positive integer")

    def head_weights(self, k: int) -> list[float]:
        if self.head_weighting == "constant":
            return [1.0] * k
        return [self.head_decay**i for i in range(k)]


@dataclass
class HeadConfig:
    """Architecture of a draft head set (`conf/head/*.yaml`)."""

    name: Literal["medusa", "hydra", "hydra_pp"]
    num_heads: int = 4
    num_layers: int = 1  # residual MLP blocks per head, each with its own weights
    hidden_state_offset: int = 0  # 0: last (post-norm) state; n: output of the n-th layer from last
    draft_vocab_size: int | None = None  # predict only the N most frequent training tokens
    noise_alpha: float = 0.0  # NEFTune-style uniform noise on the head inputs (0 = off)
    dropout: float = 0.0
    # Biases on the output projections and on a head's input projection, as zankner/Hydra's
    # heads have (`hydra_lm_head`, `res_connection`); off by default: the base lm_head has none.
    bias: bool = False
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.num_heads <= 16:
            fail("num_heads", self.num_heads, "an integer in [1, 16]")
        if self.num_layers < 1:
            fail("num_layers", self.num_layers, "an integer >= 1")
        if self.hidden_state_offset < 0:
            fail("hidden_state_offset", self.hidden_state_offset, "an integer >= 0")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 16:
            fail("draft_vocab_size", self.draft_vocab_size, "null (full vocab) or >= 16")
        if self.noise_alpha < 0:
            fail("noise_alpha", self.noise_alpha, "a number >= 0")
        if not 0 <= self.dropout < 1:
            fail("dropout", self.dropout, "a number in [0, 1)")


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
