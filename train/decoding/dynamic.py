"""Dynamic trees (`tree=dynamic`), EAGLE-2 style: each step grows its own tree from the heads'
draft probabilities instead of using a fixed topology.

From the root (the base's own next token) the tree grows one depth at a time. At depth d, the
`expand` deepest-level nodes with the highest cumulative draft probability (the product of the
heads' probabilities along the path, an estimate of the chance that the path is accepted) are
expanded by head d into their `width` best children. When every head has run, the `budget`
candidates with the highest cumulative probability are kept. A child's cumulative probability
never exceeds its parent's, and ties go to the shallower node, so the kept nodes always form a
tree (every kept node's parent is kept).

The tree is verified like a fixed one, so greedy acceptance stays exactly plain greedy decoding
and rejection sampling stays distribution-preserving: the drafts depend on the heads alone,
never on the verifier's random draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.decoding.recurrent import recurrent_step
from train.decoding.tree import Tree, TreeError


@dataclass(frozen=True)
class DynamicTree:
    """How a dynamic tree grows: at most `budget` draft nodes, `expand` nodes expanded per
    depth, `width` children per expanded node, `depth` levels (None: as many as the heads)."""

    budget: int
    expand: int
    width: int
    depth: int | None = None

    def __post_init__(self) -> None:
        for name in ("budget", "expand", "width"):
            if int(getattr(self, name)) < 1:
                raise TreeError(f"tree.{name}={getattr(self, name)} is invalid: an integer >= 1")
        if self.depth is not None and self.depth < 1:
            raise TreeError(f"tree.depth={self.depth} is invalid: an integer >= 1 or null")

    def levels(self, draft_depth: int, limit: int | None = None) -> int:
        """Levels grown: `depth`, or the heads' `draft_depth` when None; fails past `limit`,
        the deepest the heads draft (None: any depth, a recurrent head set)."""
        if self.depth is not None and limit is not None and self.depth > limit:
            raise TreeError(
                f"tree.depth={self.depth} but the heads propose only {limit} tokens: use "
                f"tree.depth <= {limit} or null"
            )
        return self.depth or draft_depth

    def candidates(self, levels: int) -> int:
        """How many draft nodes `levels` depths grow in all, the most the budget can keep:
        `width` children of the root, then of the `expand` best of each depth's nodes."""
        total, frontier = 0, 1
        for _ in range(levels):
            total += frontier * self.width
            frontier = min(self.expand, frontier * self.width)
        return total

    @property
    def max_nodes(self) -> int:
        """Tokens in one verify pass at most: the root and the budget."""
        return self.budget + 1


@torch.no_grad()
def grow_dynamic(
    spec: DynamicTree, heads, embed, ctx: torch.Tensor, roots: torch.Tensor, memory=None
) -> list[tuple[Tree, torch.Tensor]]:
    """Each row's tree and its tokens (N_b,), root first, in the tree's node order.

    ctx: (B, H) the heads' context at each row's last accepted position; roots: (B,) each
    row's next token from the base. Every depth is one heads call for every row and node it
    expands. A recurrent head set (memory: its DraftMemory) first runs its layer on the
    frontier (each node's token and its parent's output state, attending to the prefix and
    its ancestors), then scores their children; the drafted keys and values are dropped at
    the end.
    """
    if heads.recurrent:
        end = memory.cache.end
        try:
            return _grow(spec, heads, embed, ctx, roots, memory)
        finally:
            memory.cache.end = end
    return _grow(spec, heads, embed, ctx, roots, None)


def _grow(spec: DynamicTree, heads, embed, ctx, roots, memory) -> list[tuple[Tree, torch.Tensor]]:
    # Over 80 lines with its docstring's caller: one depth loop keeps the frontier's tokens,
    # probabilities, ranks and (recurrent) states and ancestors in step.
    B = ctx.shape[0]
    D = spec.levels(heads.draft_depth, heads.depth_limit)
    toks = roots.view(B, 1, 1)  # (B, P, d + 1): the frontier's token paths, root first
    lp = torch.zeros(B, 1, device=ctx.device)  # (B, P) their log cumulative probability
    ranks: list[list[tuple[int, ...]]] = [[()] for _ in range(B)]  # their rank paths
    found: list[list[tuple[tuple[int, ...], int, float]]] = [[] for _ in range(B)]
    states = ctx[:, None]  # (B, P, H) recurrent: the frontier's parents' output states
    anc = torch.zeros(B, 1, 0, dtype=torch.bool, device=ctx.device)  # (B, P, R) ancestors
    for d in range(D):
        P = toks.shape[1]
        if heads.recurrent:
            if d > 0:  # the frontier's own states (the root's is the context)
                states = recurrent_step(heads, embed, memory, toks[:, :, -1], states, d, anc)
                own = torch.eye(P, dtype=torch.bool, device=anc.device).expand(B, P, P)
                anc = torch.cat([anc, own], -1)  # a child's ancestors: its parent's and it
            logq = F.log_softmax(heads.logits(0, states).float(), dim=-1)  # (B, P, V)
        elif heads.uses_path:
            x = ctx[:, None].expand(B, P, -1).reshape(B * P, -1)
            state = heads.head_input(d, x, embed(toks.reshape(B * P, -1)))
            logq = F.log_softmax(heads.logits(d, state).float(), dim=-1).view(B, P, -1)
        else:  # Medusa: one distribution per depth, whatever the parent
            state = heads.head_input(d, ctx, None)
            logq = F.log_softmax(heads.logits(d, state).float(), dim=-1)[:, None]
            logq = logq.expand(B, P, -1)
        W = min(spec.width, logq.shape[-1])
        top = logq.topk(W, dim=-1)  # (B, P, W)
        ids = top.indices if heads.draft is None else heads.draft.to_full[top.indices]
        child_lp = (lp[:, :, None] + top.values).reshape(B, P * W)
        child_ids = ids.reshape(B, P * W)
        child_ranks = [[r + (w,) for r in row for w in range(W)] for row in ranks]
        for b, (rs, ts, ls) in enumerate(
            zip(child_ranks, child_ids.tolist(), child_lp.tolist(), strict=True)
        ):
            found[b].extend(zip(rs, ts, ls, strict=True))
        # the next depth expands the `expand` most probable children (ties: tree order)
        E = min(spec.expand, P * W)
        order = torch.sort(child_lp, dim=-1, descending=True, stable=True).indices[:, :E]
        parent = (order // W)[:, :, None].expand(-1, -1, d + 1)
        toks = torch.cat([toks.gather(1, parent), child_ids.gather(1, order)[:, :, None]], -1)
        lp = child_lp.gather(1, order)
        ranks = [[child_ranks[b][j] for j in row] for b, row in enumerate(order.tolist())]
        if heads.recurrent:  # each child keeps its parent's state and ancestors
            par = order // W  # (B, E)
            states = states.gather(1, par[:, :, None].expand(-1, -1, states.shape[-1]))
            anc = anc.gather(1, par[:, :, None].expand(-1, -1, anc.shape[-1]))
    out = []
    for b in range(B):
        # the budget best by cumulative probability; a parent sorts before its children
        best = sorted(found[b], key=lambda c: (-c[2], len(c[0])))[: spec.budget]
        kept = {r: t for r, t, _ in best}
        tree = Tree.from_paths(list(kept))
        node_tokens = [int(roots[b])] + [kept[p] for p in tree.paths]
        out.append((tree, torch.tensor(node_tokens, dtype=torch.long, device=ctx.device)))
    return out


@dataclass(frozen=True)
class Shape:
    """A dynamic tree's shape: nodes expanded per depth, children each, levels (None: all)."""

    expand: int
    width: int
    depth: int | None = None


def by_temperature(
    temperature: float,
    budget: int,
    cold: Shape,
    hot: Shape,
    hot_at: float,
    num_heads: int,
) -> DynamicTree:
    """`tree=temperature`: the dynamic tree for a sampling temperature. Greedy decoding accepts
    a draft only if it is the base's argmax, and the heads' top-1 is right often enough that
    deep, narrow trees pay (the `cold` shape, at temperature 0). Sampling at a high
    temperature spreads the base's distribution: a sampled token is less often the heads'
    top-1, so deep paths rarely survive and more siblings per level catch more of the mass
    (the `hot` shape, at temperature >= `hot_at`). In between, expand, width and depth are
    interpolated linearly and rounded; the node budget stays. `num_heads`: the depth of a
    shape whose depth is None (the heads' draft depth)."""
    f = min(max(temperature / hot_at, 0.0), 1.0) if hot_at > 0 else 1.0
    depth = [s.depth or num_heads for s in (cold, hot)]

    def mix(a: int, b: int) -> int:
        return max(1, round(a + f * (b - a)))

    return DynamicTree(
        budget,
        mix(cold.expand, hot.expand),
        mix(cold.width, hot.width),
        mix(*depth),  # between two depths the heads draft (fixed_tree checked them)
    )
