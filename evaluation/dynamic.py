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

from evaluation.tree import Tree, TreeError


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

    def levels(self, num_heads: int) -> int:
        if self.depth is not None and self.depth > num_heads:
            raise TreeError(
                f"tree.depth={self.depth} but the heads propose only {num_heads} tokens: use "
                f"tree.depth <= {num_heads} or null"
            )
        return self.depth or num_heads

    @property
    def max_nodes(self) -> int:
        """Tokens in one verify pass at most: the root and the budget."""
        return self.budget + 1


@torch.no_grad()
def grow_dynamic(
    spec: DynamicTree, heads, embed, ctx: torch.Tensor, root: int
) -> tuple[Tree, torch.Tensor]:
    """The step's tree and its tokens (N,), root first, in the tree's node order.

    ctx: (H,) the heads' context at the last accepted position; root: the base's next token.
    """
    device = ctx.device
    D = spec.levels(heads.num_heads)
    # candidates: path of ranks -> (token, log cumulative probability); the root has path ()
    paths: list[tuple[int, ...]] = []
    tokens: list[int] = []
    logp: list[float] = []
    frontier = [((), [root], 0.0)]  # (rank path, token path root first, log cum prob)
    for d in range(D):
        frontier.sort(key=lambda f: -f[2])
        grow = frontier[: spec.expand]
        if heads.uses_path:
            path = torch.tensor([f[1] for f in grow], device=device)  # (P, d + 1)
            state = heads.head_input(d, ctx.expand(len(grow), -1), embed(path))
            lp = F.log_softmax(heads.logits(d, state).float(), dim=-1)  # (P, V_out)
        else:  # Medusa: one distribution per depth, whatever the parent
            state = heads.head_input(d, ctx[None], None)
            lp = F.log_softmax(heads.logits(d, state).float(), dim=-1).expand(len(grow), -1)
        top = lp.topk(min(spec.width, lp.shape[-1]), dim=-1)
        ids = top.indices if heads.draft is None else heads.draft.to_full[top.indices]
        vals, ids = top.values.tolist(), ids.tolist()
        frontier = []
        for (ranks, toks, base_lp), row_v, row_i in zip(grow, vals, ids, strict=True):
            for r, (v, t) in enumerate(zip(row_v, row_i, strict=True)):
                child = (ranks + (r,), toks + [t], base_lp + v)
                frontier.append(child)
                paths.append(child[0])
                tokens.append(t)
                logp.append(child[2])
    # the budget best by cumulative probability; a parent sorts before its children
    order = sorted(range(len(paths)), key=lambda i: (-logp[i], len(paths[i])))[: spec.budget]
    kept = {paths[i]: tokens[i] for i in order}
    tree = Tree.from_paths(list(kept))
    node_tokens = [root] + [kept[p] for p in tree.paths]
    return tree, torch.tensor(node_tokens, dtype=torch.long, device=device)


@dataclass(frozen=True)
class Shape:
    """A dynamic tree's shape: nodes expanded per depth, children each, levels (None: all)."""

    expand: int
    width: int
    depth: int | None = None


def by_temperature(
    temperature: float, budget: int, cold: Shape, hot: Shape, hot_at: float, num_heads: int
) -> DynamicTree:
    """`tree=temperature`: the dynamic tree for a sampling temperature. Greedy decoding accepts
    a draft only if it is the base's argmax, and the heads' top-1 is right often enough that
    deep, narrow trees pay (the `cold` shape, at temperature 0). Sampling at a high
    temperature spreads the base's distribution: a sampled token is less often the heads'
    top-1, so deep paths rarely survive and more siblings per level catch more of the mass
    (the `hot` shape, at temperature >= `hot_at`). In between, expand, width and depth are
    interpolated linearly and rounded; the node budget stays."""
    f = min(max(temperature / hot_at, 0.0), 1.0) if hot_at > 0 else 1.0
    depth = [s.depth or num_heads for s in (cold, hot)]

    def mix(a: int, b: int) -> int:
        return max(1, round(a + f * (b - a)))

    return DynamicTree(
        budget,
        mix(cold.expand, hot.expand),
        mix(cold.width, hot.width),
        min(mix(*depth), num_heads),
    )
