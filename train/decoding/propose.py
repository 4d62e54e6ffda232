"""Proposal: the heads draft each row's tree of candidate tokens, one heads call per depth.

The one path for every tree kind. A chain is a fixed tree of one node per depth; a fixed tree
expands level by level, every parent of every row in one call per depth (Hydra heads read the
embeddings of each node's path, Medusa heads one distribution per row); a dynamic tree grows
per step from the heads' probabilities (train/decoding/dynamic.py), also one call per depth
for every row. Plain decoding is the root-only proposal: the base's own next token, no drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from train.decoding.dynamic import DynamicTree, grow_dynamic
from train.decoding.recurrent import DraftMemory, expand_recurrent
from train.decoding.tree import Tree, tree_bias

ROOT_ONLY = Tree.from_paths([])


@dataclass
class Proposal:
    """One step's trees: `trees[b]` is row b's; tokens (B, N) root first (a smaller tree is
    padded); bias (B or 1, 1, N, N) the additive attention among the nodes; depth (B or 1, N)
    each node's depth, its position offset in the verify pass."""

    trees: list[Tree]
    tokens: torch.Tensor
    bias: torch.Tensor
    depth: torch.Tensor


def candidates(
    heads, k: int, ctx: torch.Tensor, path: torch.Tensor | None, embed: nn.Module, topk: int
) -> torch.Tensor:
    """Head k's (0-based) `topk` best full-vocab token ids for N nodes: (N, topk). ctx (N, H);
    path (N, k+1) the tokens from the root down to each node (None for Medusa heads). The top-k
    runs over the head's own output vocab, so a draft vocab is never scattered into the full
    one."""
    emb = embed(path) if heads.uses_path else None
    logits = heads.logits(k, heads.head_input(k, ctx, emb))
    idx = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices
    return idx if heads.draft is None else heads.draft.to_full[idx]


def expand_tree(heads, embed: nn.Module, tree: Tree, ctx: torch.Tensor, roots: torch.Tensor):
    """Every row's tokens (B, N) of the fixed `tree` from contexts ctx (B, H) and roots (B,)."""
    B = ctx.shape[0]
    tokens = torch.empty(B, tree.num_nodes, dtype=torch.long, device=ctx.device)
    tokens[:, 0] = roots
    for lv in tree.levels:
        k = lv.depth - 1
        if heads.uses_path:
            path = tokens[:, lv.parent_paths]  # (B, P, depth): root..parent
            P = path.shape[1]
            c = ctx[:, None].expand(B, P, -1).reshape(B * P, -1)
            cand = candidates(heads, k, c, path.reshape(B * P, -1), embed, lv.topk)
            tokens[:, lv.nodes] = cand.view(B, P, -1)[:, lv.row, lv.ranks]
        else:  # Medusa: one distribution per depth and row
            cand = candidates(heads, k, ctx, None, embed, lv.topk)
            tokens[:, lv.nodes] = cand[:, lv.ranks]
    return tokens


class Proposer:
    """Drafts with `heads` over a fixed tree or a dynamic rule; biases in `dtype`."""

    def __init__(self, heads, embed: nn.Module, dtype: torch.dtype, device):
        self.heads, self.embed, self.dtype, self.device = heads, embed, dtype, device
        self.tree: Tree | None = None
        self.dynamic: DynamicTree | None = None

    def set_tree(self, tree: Tree | DynamicTree) -> None:
        if isinstance(tree, DynamicTree):
            tree.levels(self.heads.draft_depth, self.heads.depth_limit)  # fails if too deep
            self.dynamic, self.tree = tree, None
            return
        tree.check_heads(self.heads.depth_limit)
        self.tree, self.dynamic = tree, None
        self.bias = tree_bias(tree, self.dtype, self.device)[None, None]
        self.depth = tree.depth.to(self.device)[None]

    @property
    def max_nodes(self) -> int:
        """Tokens in one verify pass at most."""
        if self.dynamic is not None:
            return self.dynamic.max_nodes
        return self.tree.num_nodes if self.tree is not None else 1

    @property
    def max_depth(self) -> int:
        if self.dynamic is not None:
            return self.dynamic.levels(self.heads.draft_depth, self.heads.depth_limit)
        return self.tree.max_depth if self.tree is not None else 0

    @torch.no_grad()
    def propose(
        self, ctx: torch.Tensor, roots: torch.Tensor, memory: DraftMemory | None = None
    ) -> Proposal:
        """Each row's tree from its heads' context ctx (B, H) and its root token roots (B,);
        `memory`: what a recurrent head set attends to while drafting."""
        B = ctx.shape[0]
        if self.heads.recurrent and memory is None:
            raise ValueError(f"{self.heads.arch} heads draft from their own cache: pass memory")
        if self.dynamic is None:
            if self.heads.recurrent:
                tokens = expand_recurrent(self.heads, self.embed, self.tree, ctx, roots, memory)
            else:
                tokens = expand_tree(self.heads, self.embed, self.tree, ctx, roots)
            return Proposal([self.tree] * B, tokens, self.bias, self.depth)
        grown = grow_dynamic(self.dynamic, self.heads, self.embed, ctx, roots, memory)
        if B == 1:
            tree, toks = grown[0]
            bias = tree_bias(tree, self.dtype, self.device)[None, None]
            return Proposal([tree], toks[None], bias, tree.depth.to(self.device)[None])
        N = max(t.num_nodes for t, _ in grown)
        neg = torch.finfo(self.dtype).min
        tokens = torch.zeros(B, N, dtype=torch.long, device=self.device)
        bias = torch.full((B, 1, N, N), neg, dtype=self.dtype, device=self.device)
        bias[:, 0].diagonal(dim1=-2, dim2=-1).zero_()  # padding nodes see themselves only
        depth = torch.zeros(B, N, dtype=torch.long, device=self.device)
        for b, (tree, toks) in enumerate(grown):
            n = tree.num_nodes
            tokens[b, :n] = toks
            bias[b, 0, :n, :n] = tree_bias(tree, self.dtype, self.device)
            depth[b, :n] = tree.depth.to(self.device)
        return Proposal([t for t, _ in grown], tokens, bias, depth)


def root_only(roots: torch.Tensor, dtype: torch.dtype) -> Proposal:
    """Plain decoding's step: each row's root token alone."""
    zero = torch.zeros(1, 1, 1, 1, dtype=dtype, device=roots.device)
    depth = torch.zeros(1, 1, dtype=torch.long, device=roots.device)
    return Proposal([ROOT_ONLY] * roots.shape[0], roots[:, None], zero, depth)
