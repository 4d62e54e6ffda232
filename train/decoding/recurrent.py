"""Recurrent drafting: a head set of one draft layer (eagle-attn) that drafts deeper on its own
output states, attending to the accepted prefix in its own KV cache and to each node's
ancestors, drafted earlier in the same proposal (appended to that cache, then dropped)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from train.decoding.cache import KVCache
from train.decoding.tree import Tree


@dataclass
class DraftMemory:
    """What a recurrent head set's drafting attends to: its own KV cache of the accepted prefix
    (written up to `start`, row b's own entries the first `lengths[b]`, the rest a hole), the
    rows' lengths (B,) and the base's compute dtype for the masks."""

    cache: object  # a KVCache
    lengths: torch.Tensor
    start: int
    dtype: torch.dtype

    def mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """(B, 1, P, start + R + P) additive mask for P drafted nodes per row: each sees its
        row's own prefix, the R nodes drafted before it that `ancestors` (B, P, R) bool marks,
        and itself."""
        B, P, R = ancestors.shape
        dev, neg = self.lengths.device, torch.finfo(self.dtype).min
        own = torch.eye(P, dtype=torch.bool, device=dev).expand(B, P, P)
        prefix = torch.arange(self.start, device=dev)[None] < self.lengths[:, None]  # (B, S)
        seen = torch.cat([prefix[:, None].expand(B, P, -1), ancestors.to(dev), own], dim=-1)
        bias = torch.zeros(seen.shape, dtype=self.dtype, device=dev).masked_fill(~seen, neg)
        return bias[:, None]

    def positions(self, depth: int, P: int) -> torch.Tensor:
        """(B, P) positions of drafted nodes at `depth`: the last accepted position + depth."""
        return (self.lengths - 1 + depth)[:, None].expand(-1, P)


def recurrent_step(heads, embed, memory: DraftMemory, tokens, parents, depth, ancestors):
    """Run a recurrent head set on P drafted nodes per row at `depth`: their tokens (B, P),
    their parents' output states `parents` (B, P, H), `ancestors` (B, P, R) over the nodes
    drafted before. Returns their output states (B, P, H); their keys and values stay in
    memory.cache until the proposal ends."""
    P = tokens.shape[1]
    return heads.step(
        embed(tokens),
        parents,
        memory.cache,
        memory.positions(depth, P),
        memory.mask(ancestors),
        memory.positions(0, P),  # the last accepted position: cross-attn's ancestor keys
    )


def expand_recurrent(
    heads, embed: nn.Module, tree: Tree, ctx: torch.Tensor, roots: torch.Tensor, memory
) -> torch.Tensor:
    """expand_tree for a recurrent head set: each depth runs its one layer on that depth's
    parents (their token, their parent's output state), attending to the accepted prefix and
    their own ancestors, and scores their children; the drafted nodes' keys and values are
    dropped from the cache at the end."""
    B, N = ctx.shape[0], tree.num_nodes
    tokens = torch.empty(B, N, dtype=torch.long, device=ctx.device)
    tokens[:, 0] = roots
    states = ctx.new_zeros(B, N, ctx.shape[-1])
    states[:, 0] = ctx  # the root's: the context at the last accepted position
    end, ran = memory.cache.end, torch.empty(0, dtype=torch.long)
    try:
        for lv in tree.levels:
            par = lv.parents  # nodes at depth - 1 with children
            if lv.depth > 1:
                anc = tree.mask[par][:, ran][None].expand(B, -1, -1)  # (B, P, R)
                states[:, par] = recurrent_step(
                    heads, embed, memory, tokens[:, par], states[:, tree.parent[par]],
                    lv.depth - 1, anc,
                )  # fmt: skip
                ran = torch.cat([ran, par])
            logits = heads.logits(0, states[:, par])  # (B, P, V_out)
            idx = logits.topk(min(lv.topk, logits.shape[-1]), dim=-1).indices
            cand = idx if heads.draft is None else heads.draft.to_full[idx]
            tokens[:, lv.nodes] = cand[:, lv.row, lv.ranks]
    finally:
        memory.cache.end = end  # the drafted nodes leave the cache
    return tokens


@torch.no_grad()
def unroll(
    heads, hidden: torch.Tensor, ids: torch.Tensor, embed: nn.Module, depth: int
) -> list[torch.Tensor]:
    """A recurrent head set drafting along known tokens, at every position at once (calibration:
    what drafting does along an accepted path). hidden (T, H) the base's states over ids (T,).
    Returns `depth` tensors (1, T, H): entry k-1 at t is the state whose logits draft
    x_{t+k+1}, made as drafting makes it: the context at t (reading x_{t+1}), then one step per
    depth on x_{t+2}, ..., x_{t+k} and its own previous state, at positions t+1, ..., t+k-1,
    each attending to the contexts up to t, the chain's earlier states and itself. Positions
    whose tokens run past the end read a repeated token; callers score only valid ones."""
    T, dev = ids.numel(), ids.device
    dtype = next(heads.parameters()).dtype
    cache = KVCache(1, T * depth)
    idx = torch.arange(T, device=dev)

    def shifted(k: int) -> torch.Tensor:  # x_{t+k}, clamped at the end
        return ids[(idx + k).clamp(max=T - 1)][None]

    states = [heads.context(hidden[None].to(dtype), cache=cache, positions=idx,
                            next_emb=embed(shifted(1)))]  # fmt: skip
    neg = torch.finfo(dtype).min
    causal = idx[None] <= idx[:, None]  # (T, T) context s <= t
    eye = torch.eye(T, dtype=torch.bool, device=dev)
    for k in range(2, depth + 1):
        seen = torch.cat([causal] + [eye] * (k - 1), dim=-1)  # contexts, chain states, itself
        mask = torch.zeros(seen.shape, dtype=dtype, device=dev).masked_fill(~seen, neg)
        pos = (idx + k - 1)[None]
        states.append(
            heads.step(embed(shifted(k)), states[-1], cache, pos, mask[None, None], idx[None])
        )
    return states
