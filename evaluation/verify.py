"""Tree verification: one base forward over the flattened tree, acceptance rules, KV bookkeeping.

Acceptance rules, each returning the accepted node ids (root first, ascending) and the bonus
token, the base model's own token after the last accepted node:

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

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from evaluation.tree import Tree

ACCEPTANCE = ("greedy", "typical", "rejection")


def tree_bias(tree: Tree, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive attention bias among the tree's nodes: 0 where a node sees an ancestor or
    itself, the dtype's minimum elsewhere. (N, N)."""
    neg = torch.finfo(dtype).min
    bias = torch.full(tree.mask.shape, neg, dtype=dtype)
    return bias.masked_fill(tree.mask, 0.0).to(device)


def tree_attention_mask(bias: torch.Tensor, past: int) -> torch.Tensor:
    """(1, 1, N, past + N) additive mask: every node sees the whole accepted prefix, and
    among the tree only its ancestors and itself."""
    N = bias.shape[0]
    mask = bias.new_zeros(1, 1, N, past + N)
    mask[0, 0, :, past:] = bias
    return mask


@functools.cache
def cache_kwarg(model_cls: type) -> str:
    """transformers 5 renames `past_key_values` to `cache`; use whichever this version takes."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def base_forward(
    model,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache,
    mask: torch.Tensor | None = None,
    hidden_state_offset: int = 0,
    body=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the base over `input_ids` (1, n) at `positions` (1, n), appending to `cache`.

    Returns the last (post-norm) hidden states (n, H), which the base's lm_head turns into
    logits, and the hidden states the heads read (n, H): the same tensor, or the output of the
    `hidden_state_offset`-th layer from the end when the heads were trained on that.
    `body`: what runs in place of `model.model` (its compiled version).
    """
    final, ctx = base_forward_rows(
        model, input_ids, positions, cache, mask, hidden_state_offset, body
    )
    return final[0], ctx[0]


@torch.no_grad()
def base_forward_rows(
    model,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache,
    mask: torch.Tensor | None = None,
    hidden_state_offset: int = 0,
    body=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """base_forward for a batch: input_ids and positions (B, n), mask (B, 1, n, cached + n);
    returns (B, n, H) final and heads' hidden states."""
    out = (body if body is not None else model.model)(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=hidden_state_offset > 0,
        **{cache_kwarg(type(model.model)): cache},
    )
    final = out.last_hidden_state
    ctx = final if hidden_state_offset == 0 else out.hidden_states[-1 - hidden_state_offset]
    return final, ctx


def _path_lengths(tree: Tree, ok: torch.Tensor) -> torch.Tensor:
    """Per leaf path, how many leading nodes (root included) pass `ok` (N,) bool."""
    paths = tree.retrieve
    m = ok[paths.clamp(min=0)] & (paths >= 0)
    return m.long().cumprod(dim=1).sum(dim=1)


# A rule gets `logits(nodes)`: the base's logits (n, V) after the given tree nodes. The greedy
# and rejection rules walk down the tree and ask only for the nodes they reach, so the base's
# output projection runs on ~tau rows instead of every node of the tree (a 64-node tree spends
# ~40 ms per step on it on a 2-core CPU, SmolLM2's 49k-token vocab).
Logits = Callable[[torch.Tensor], torch.Tensor]


def accept_greedy(tree: Tree, tokens: torch.Tensor, logits: Logits):
    """tokens (N,): the tree's tokens, root first. Follows the child whose token is the base's
    argmax after its parent; children of one parent are distinct, so at most one matches."""
    toks = tokens.tolist()
    node, nodes = 0, [0]
    while True:
        choice = int(logits(torch.tensor([node], device=tokens.device))[0].argmax())
        nxt = next((c for c in tree.children[node] if toks[c] == choice), None)
        if nxt is None:
            return torch.tensor(nodes, device=tokens.device), choice
        node = nxt
        nodes.append(nxt)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def typical_threshold(p: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """Medusa's typical-set bound per distribution p (..., V): min(threshold, alpha e^-H(p))."""
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)
    return torch.clamp(alpha * torch.exp(-entropy), max=threshold)


def accept_typical(
    tree: Tree,
    tokens: torch.Tensor,
    logits: Logits,
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
    logits: Logits,
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


def sample_token(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    typical: tuple[float, float] | None = None,
) -> int:
    """The base model's own next token from logits (V,): argmax at temperature 0, else a draw
    (restricted to the typical set when `typical=(threshold, alpha)`)."""
    if temperature == 0:
        return int(logits.argmax())
    p = F.softmax(logits.double() / temperature, dim=-1)
    if typical is not None:
        p = torch.where(p > typical_threshold(p, *typical), p, 0.0)
    return _sample(p, generator)
