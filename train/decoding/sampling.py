"""Acceptance rules and sampling: how decoding chooses tokens and which drafts it keeps.

Acceptance rules, each giving the accepted node ids of a row's tree (root first, ascending) and
the bonus token, the base model's own token after the last accepted node:

- greedy: the longest path whose every token is the base model's argmax after its parent.
  Speculative decoding with it returns exactly the tokens of plain greedy decoding.
- rejection (temperature > 0): lossless speculative sampling. The heads' candidates are
  deterministic (top-k), so each candidate is a one-hot draft: at a node with base distribution
  p, candidate x is accepted with probability p(x); if rejected, p loses x and is renormalized,
  and the next sibling is tried against that residual. When every child is rejected the bonus
  token is drawn from the residual. Each emitted token is therefore distributed exactly as p
  (P(x) = p(x); P(y) = (1 - p(x)) p(y) / (1 - p(x)) = p(y)), so the output has the base model's
  sampling distribution (SpecInfer's multi-draft rule with one-hot drafts).
- typical (temperature > 0): Medusa/Hydra's typical acceptance. A candidate passes when its base
  probability exceeds min(threshold, alpha * exp(-entropy)); the longest passing path wins (ties
  by likelihood). Faster than rejection at high temperature, but not distribution-preserving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.decoding.tree import Tree

ACCEPTANCE = ("greedy", "typical", "rejection")


def _path_lengths(tree: Tree, ok: torch.Tensor) -> torch.Tensor:
    """Per leaf path, how many leading nodes (root included) pass `ok` (N,) bool."""
    paths = tree.retrieve
    m = ok[paths.clamp(min=0)] & (paths >= 0)
    return m.long().cumprod(dim=1).sum(dim=1)


@dataclass
class SamplingConfig:
    """How tokens are chosen: greedy at temperature 0; above it lossless rejection sampling, or
    Medusa's typical acceptance with its posterior threshold and alpha (eval.yaml holds them)."""

    temperature: float
    acceptance: str  # greedy | typical | rejection (temperature > 0 for the last two)
    seed: int
    posterior_threshold: float | None = None  # typical acceptance only
    posterior_alpha: float | None = None

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(
                f"acceptance={self.acceptance!r} is invalid: choose one of {', '.join(ACCEPTANCE)}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is invalid: a number >= 0")
        if (self.temperature == 0) != (self.acceptance == "greedy"):
            raise ValueError(
                f"acceptance={self.acceptance!r} with temperature={self.temperature}: greedy "
                "acceptance is for temperature 0, typical and rejection for temperature > 0"
            )
        if self.acceptance == "typical" and None in (
            self.posterior_threshold,
            self.posterior_alpha,
        ):
            raise ValueError("typical acceptance needs posterior_threshold and posterior_alpha")

    @property
    def typical(self) -> tuple[float, float] | None:
        if self.acceptance != "typical":
            return None
        return (self.posterior_threshold, self.posterior_alpha)


def eos_ids(tokenizer, model) -> set[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    for v in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list | tuple):
            ids.update(int(i) for i in v)
    return ids


# A rule gets `logits(rows, nodes)`: the base's logits (n, V) after the given tree nodes of the
# given batch rows. The greedy and rejection rules walk down the tree and ask only for the
# nodes they reach, so the base's output projection runs on ~tau rows instead of every node
# of the tree (a 64-node tree spends ~40 ms per step on it on a 2-core CPU, SmolLM2's 49k
# vocab).
Logits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Accepted = tuple[torch.Tensor, int]  # a row's accepted nodes (root first) and bonus token


def accept_greedy(
    trees: list[Tree], tokens: torch.Tensor, logits: Logits, ahead: int = 0
) -> list[Accepted]:
    """tokens (B, N): each row's tree tokens, root first. Every row walks down its tree at
    once: at each pass one projection of the node each row still walking stands on, and the
    row follows the child whose token is the base's argmax after that node (children of one
    parent are distinct, so at most one matches).

    `ahead`: each pass also projects up to that many nodes below, along the first children
    (the heads' likeliest): where a float32 projection of 2 rows costs what 1 does, a row that
    accepts its first child then needs no pass of its own for it."""
    B, dev = len(trees), tokens.device
    toks = tokens.tolist()
    cur, nodes, bonus = [0] * B, [[0] for _ in range(B)], [0] * B
    known: list[dict[int, int]] = [{} for _ in range(B)]  # node -> the base's argmax after it
    active = list(range(B))
    while active:
        rows, at = [], []
        for b in active:
            n = cur[b]
            for _ in range(ahead + 1):
                rows.append(b)
                at.append(n)
                kids = trees[b].children[n]
                if not kids:
                    break
                n = kids[0]
        choice = logits(torch.tensor(rows, device=dev), torch.tensor(at, device=dev))
        for b, n, c in zip(rows, at, greedy_ids(choice).tolist(), strict=True):
            known[b][n] = c
        still = []
        for b in active:
            while (c := known[b].get(cur[b])) is not None:
                nxt = next((ch for ch in trees[b].children[cur[b]] if toks[b][ch] == c), None)
                if nxt is None:
                    bonus[b] = c
                    break
                cur[b] = nxt
                nodes[b].append(nxt)
            else:
                still.append(b)  # reached a node not projected yet
        active = still
    return [(torch.tensor(n, device=dev), c) for n, c in zip(nodes, bonus, strict=True)]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, the first of tied maxima, as `argmax` (both documented so):
    `max` is 4x faster on bf16 CPU logits (a 49k-vocab row: 40 us against 178 on 2 cores)."""
    return logits.max(-1).indices


def row_logits(logits: Logits, row: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """One row's `logits(nodes)` for the per-row rules."""
    return lambda nodes: logits(torch.full_like(nodes, row), nodes)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def typical_threshold(p: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """Medusa's typical-set bound per distribution p (..., V): min(threshold, alpha e^-H(p))."""
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)
    return torch.clamp(alpha * torch.exp(-entropy), max=threshold)


def accept_typical(
    tree: Tree,
    tokens: torch.Tensor,
    logits: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    threshold: float,
    alpha: float,
    generator: torch.Generator | None = None,
):
    """Longest path of candidates inside the base's typical set (Medusa's rule); needs every
    node's distribution, so it projects all of them."""
    dev = tokens.device
    p = F.softmax(logits(torch.arange(tokens.shape[0], device=dev)).float() / temperature, -1)
    thr = typical_threshold(p, threshold, alpha)  # (N,)
    parent = tree.parent.to(dev)
    cand = torch.ones(tokens.shape[0], dtype=p.dtype, device=dev)
    cand[1:] = p[parent[1:], tokens[1:]]
    ok = torch.ones_like(tokens, dtype=torch.bool)
    ok[1:] = cand[1:] > thr[parent[1:]]
    ok = ok.cpu()
    lengths = _path_lengths(tree, ok)
    longest = int(lengths.max())
    ties = (lengths == longest).nonzero().flatten()
    if len(ties) > 1:  # equal length: the most likely path
        paths = tree.retrieve[ties, :longest]
        ties = ties[torch.log(cand.cpu()[paths]).sum(-1).argmax()].reshape(1)
    nodes = tree.retrieve[int(ties[0]), :longest].to(dev)
    last = p[nodes[-1]]
    bonus = _sample(torch.where(last > thr[nodes[-1]], last, 0.0), generator)
    return nodes, bonus


def accept_rejection(
    tree: Tree,
    tokens: torch.Tensor,
    logits: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    generator: torch.Generator | None = None,
):
    """Lossless speculative sampling over the tree (see the module docstring)."""
    toks = tokens.tolist()
    node, nodes = 0, [0]
    while True:
        row = logits(torch.tensor([node], device=tokens.device))[0]
        p = F.softmax(row.double() / temperature, dim=-1).cpu()
        for c in tree.children[node]:
            x = toks[c]
            px, mass = float(p[x]), float(p.sum())
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if px > 0 and u * mass < px:
                node = c
                nodes.append(c)
                break
            p[x] = 0.0  # the residual max(p - onehot(x), 0)
        else:
            return torch.tensor(nodes, device=tokens.device), _sample(p, generator)


def sample_rows(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    typical: tuple[float, float] | None = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """The base model's own next token per row of logits (B, V): argmax at temperature 0, else
    a draw (restricted to the typical set when `typical=(threshold, alpha)`, to the nucleus of
    `top_p` when < 1). `generator` None draws from torch's global generator."""
    if temperature == 0:
        return greedy_ids(logits)
    p = F.softmax(logits.double() / temperature, dim=-1)
    if typical is not None:
        p = torch.where(p > typical_threshold(p, *typical)[..., None], p, 0.0)
    if top_p < 1:
        sp, order = p.sort(dim=-1, descending=True)
        # drop a token once the likelier ones already cover top_p (the likeliest always stays)
        sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, sp)
    return torch.multinomial(p, 1, generator=generator)[:, 0]
