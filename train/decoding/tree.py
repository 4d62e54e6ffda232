"""Candidate trees: Medusa-format paths of top-k ranks -> tree mask, positions, retrieve indices.

A tree is a set of paths, each a list of ranks: `[0, 1]` is "the top-1 token of head 1, then
the top-2 token of head 2 after it". The root (node 0) is the base model's own next token, which
is always accepted; path `p` is node `1 + index of p` once paths are sorted by (depth, ranks), so
every parent comes before its children and each depth is one contiguous block of nodes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from train.core.atomic import write_json
from train.core.errors import NotFound, UserError

# Medusa's sparse 63-node tree for 4 heads, tuned on Vicuna-7B (FasterDecoding/Medusa,
# medusa/model/medusa_choices.py `mc_sim_7b_63`; Hydra's code uses it too). Data, in its order.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2],
    [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1],
    [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3],
    [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0],
    [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip


class TreeError(UserError, ValueError):
    """A tree that cannot be used: malformed paths, or deeper than the heads can propose."""


def chain(depth: int) -> list[list[int]]:
    """The top-1 chain [[0], [0, 0], ...] of `depth` draft tokens."""
    return [[0] * d for d in range(1, depth + 1)]


def branching(widths: Sequence[int]) -> list[list[int]]:
    """Full tree with `widths[d]` children per node at depth d: [3, 2, 2] -> 3 + 6 + 12 nodes."""
    if not widths or any(int(w) < 1 for w in widths):
        raise TreeError(f"branching widths must be a non-empty list of integers >= 1, got {widths}")
    paths: list[list[int]] = []
    level: list[list[int]] = [[]]
    for w in widths:
        level = [p + [r] for p in level for r in range(int(w))]
        paths += level
    return paths


def preset_paths(name: str, num_heads: int) -> list[list[int]]:
    """The paths of tree preset `name`: `chain` (one top-1 guess per head) or a key of PRESETS."""
    return chain(num_heads) if name == "chain" else PRESETS[name]


# Named trees. Prefixes of mc_sim_7b_63 are trees too: it was grown greedily, parents first.
PRESETS: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "sparse_31": MC_SIM_7B_63[:31],
    "sparse_15": MC_SIM_7B_63[:15],
    "sparse_7": MC_SIM_7B_63[:7],
    "chain_4": chain(4),
    "chain_2": chain(2),
    "none": [],  # no drafts: every step is one plain decode step through the verifier
}


@dataclass(frozen=True)
class Tree:
    """A validated candidate tree and the index tensors the verifier needs (all on CPU).

    Node 0 is the root; nodes 1..N are the paths in (depth, ranks) order. Tensors:
      depth (N+1,)          depth of each node, root 0 -> position offset in the verify pass
      parent (N+1,)         parent node, -1 for the root
      rank (N+1,)           the node's top-k rank among its parent's candidates (root: 0)
      mask (N+1, N+1) bool  node i attends to node j iff j is i or an ancestor of i
      ancestors (N+1, D+1)  node ids from the root down to the node, padded with -1
      retrieve (P, D+1)     one row per leaf: its root-to-leaf node ids, padded with -1
    """

    paths: tuple[tuple[int, ...], ...]
    depth: torch.Tensor = field(repr=False, compare=False)
    parent: torch.Tensor = field(repr=False, compare=False)
    rank: torch.Tensor = field(repr=False, compare=False)
    mask: torch.Tensor = field(repr=False, compare=False)
    ancestors: torch.Tensor = field(repr=False, compare=False)
    retrieve: torch.Tensor = field(repr=False, compare=False)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], max_depth: int | None = None) -> Tree:
        norm = _validate(paths, max_depth)
        n = len(norm) + 1
        index = {p: i + 1 for i, p in enumerate(norm)}
        index[()] = 0
        D = max((len(p) for p in norm), default=0)
        depth = torch.zeros(n, dtype=torch.long)
        parent = torch.full((n,), -1, dtype=torch.long)
        rank = torch.zeros(n, dtype=torch.long)
        ancestors = torch.full((n, D + 1), -1, dtype=torch.long)
        ancestors[0, 0] = 0
        for p, i in index.items():
            if not p:
                continue
            depth[i], parent[i], rank[i] = len(p), index[p[:-1]], p[-1]
            ancestors[i, : len(p) + 1] = torch.tensor([index[p[:j]] for j in range(len(p) + 1)])
        mask = torch.zeros(n, n, dtype=torch.bool)
        rows = torch.arange(n)[:, None].expand_as(ancestors)
        ok = ancestors >= 0
        mask[rows[ok], ancestors[ok]] = True
        has_child = torch.zeros(n, dtype=torch.bool)
        has_child[parent[1:]] = True
        leaves = (~has_child).nonzero().flatten()
        retrieve = ancestors[leaves]
        return cls(tuple(norm), depth, parent, rank, mask, ancestors, retrieve)

    # -- shape -------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Tokens in one verify pass: the root plus every draft node."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Child node ids of each node, best rank first."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[int(self.parent[i])].append(i)
        return tuple(tuple(sorted(k, key=lambda c: int(self.rank[c]))) for k in kids)

    @cached_property
    def levels(self) -> tuple[Level, ...]:
        """Per depth d = 1..D: which nodes expand and where their candidates go."""
        out = []
        for d in range(1, self.max_depth + 1):
            nodes = (self.depth == d).nonzero().flatten()
            par = self.parent[nodes]
            parents = torch.unique(par)  # sorted, so rows follow node order
            row = torch.searchsorted(parents, par)
            topk = int(self.rank[nodes].max()) + 1
            paths = self.ancestors[parents, :d]  # each parent's node ids, root first
            out.append(Level(d, parents, paths, nodes, row, self.rank[nodes], topk))
        return tuple(out)

    def check_heads(self, num_heads: int | None) -> None:
        """Fail if the tree is deeper than heads that draft `num_heads` levels (None: any)."""
        if num_heads is not None and self.max_depth > num_heads:
            raise TreeError(
                f"the tree is {self.max_depth} levels deep but the heads propose only "
                f"{num_heads}; use a tree of depth <= {num_heads} (e.g. tree=chain)"
            )

    def to_json(self) -> list[list[int]]:
        return [list(p) for p in self.paths]

    def save(self, path: str | Path) -> Path:
        """Write the tree as tree.json (`tree=file tree.path=...` reads it back), atomically."""
        write_json(path, {"paths": self.to_json(), "num_nodes": self.num_nodes})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, max_depth: int | None = None) -> Tree:
        p = Path(path)
        if not p.is_file():
            raise NotFound(f"tree file {p} does not exist (written by eval as tree.json)")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise TreeError(f"tree file {p} is not valid JSON: {e}") from None
        paths = data["paths"] if isinstance(data, dict) and "paths" in data else data
        return cls.from_paths(paths, max_depth)

    def expected_length(self, acc: torch.Tensor) -> float:
        """Expected tokens per step (tau) if node acceptance follows `acc[k, r]`, the chance
        that head k+1's rank-r candidate is the accepted token given its parent was accepted."""
        return expected_length(self.paths, acc)


@dataclass(frozen=True)
class Level:
    """One depth of a tree: head `depth` expands `parents` (whose root-to-parent node ids are
    `parent_paths`, (P, depth)); node `nodes[i]` gets rank `ranks[i]` of row `row[i]` of that
    head's top-`topk` candidates."""

    depth: int
    parents: torch.Tensor
    parent_paths: torch.Tensor
    nodes: torch.Tensor
    row: torch.Tensor
    ranks: torch.Tensor
    topk: int


def _validate(paths: Sequence[Sequence[int]], max_depth: int | None) -> list[tuple[int, ...]]:
    if not isinstance(paths, Sequence) or isinstance(paths, str):
        raise TreeError(f"a tree is a list of paths like [[0], [0, 0], [1]], got {paths!r}")
    norm = []
    for p in paths:
        if (
            isinstance(p, str)
            or not isinstance(p, Sequence)
            or not p
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
        ):
            raise TreeError(
                f"tree path {p!r} is invalid: each path is a non-empty list of top-k ranks >= 0"
            )
        norm.append(tuple(int(r) for r in p))
    seen = set()
    for p in norm:
        if p in seen:
            raise TreeError(f"tree path {list(p)} appears twice")
        seen.add(p)
    for p in norm:
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(
                f"tree path {list(p)} has no parent: add {list(p[:-1])} (every prefix of a path "
                "must be in the tree)"
            )
        if max_depth is not None and len(p) > max_depth:
            raise TreeError(
                f"tree path {list(p)} is {len(p)} deep but the heads propose only {max_depth} "
                f"tokens; use a tree of depth <= {max_depth}"
            )
    return sorted(norm, key=lambda p: (len(p), p))


def expected_length(paths: Sequence[Sequence[int]], acc: torch.Tensor) -> float:
    """1 (the base model's own token) + the sum over nodes of the product of acceptance
    chances along its path. Ranks beyond acc's width count as never accepted."""
    total = 1.0
    for p in paths:
        prob = 1.0
        for k, r in enumerate(p):
            prob *= float(acc[k, r]) if k < acc.shape[0] and r < acc.shape[1] else 0.0
        total += prob
    return total


def grow(acc: torch.Tensor, budget: int) -> list[list[int]]:
    """The tree of at most `budget` nodes that greedily maximizes the expected accepted length.

    acc[k, r]: chance that head k+1's rank-r candidate is accepted given its parent was (from
    `evaluation.calibrate`). Adding a node adds the product of acc along its path; each step adds
    the best child of the current tree, so every prefix of the result is a tree too (how Medusa
    chose its sparse trees).
    """
    K, R = acc.shape
    prob: dict[tuple[int, ...], float] = {(): 1.0}
    chosen: list[tuple[int, ...]] = []
    frontier = {(r,): float(acc[0, r]) for r in range(R)}
    while len(chosen) < budget and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p), [-r for r in p]))
        if frontier[best] <= 0.0:
            break
        prob[best] = frontier.pop(best)
        chosen.append(best)
        if len(best) < K:
            for r in range(R):
                frontier[best + (r,)] = prob[best] * float(acc[len(best), r])
    return [list(p) for p in chosen]


def tree_bias(tree: Tree, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive attention bias among the tree's nodes: 0 where a node sees an ancestor or
    itself, the dtype's minimum elsewhere. (N, N)."""
    neg = torch.finfo(dtype).min
    bias = torch.full(tree.mask.shape, neg, dtype=dtype)
    return bias.masked_fill(tree.mask, 0.0).to(device)
