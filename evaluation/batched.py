"""Batched decoding (`eval.batch_size > 1`): plain and speculative decoding of several prompts in
one forward per step, each row with its own length, acceptance and KV compaction.

One cache holds every row (a (B, H_kv, capacity, D) buffer per layer). Prompts are right-padded
for the prefill. Every later forward writes its new entries at the same slots of every row,
[start, start + n), where `start` is the longest row's length. A shorter row has a hole of
stale slots between its own length and `start`, and the batch's attention mask hides it from
that row. RoPE positions are per row (its own length plus the node's depth), so a row's
attention scores are those of its batch-1 decode. After a verify pass each row keeps its own
accepted nodes, moved down to follow its own prefix (`keep_rows`: one gather / scatter per
tensor), and the bonus token of each row roots that row's next tree. Hydra++'s extra layer
keeps its cache the same way. A row that ends (EOS or max_new_tokens) leaves the batch, so the
others stop paying for it.

Greedy rows are the tokens of batch-1 greedy decoding of the same prompt: the acceptance is
exact per row, and a row's attention sees exactly its own prefix and path. (Bit-for-bit
logits can differ between batch sizes, as kernels block a matmul by its row count; a near-tie
could then flip, as it could between a verify pass and a one-token step. The tests compare
rows with batch-1 plain greedy decoding.)

Times: a batch is timed as a whole. Each row's Generation gets a share of the batch's times
in proportion to its tokens, so that the sums over rows (eval.json's tokens/s) are the
batch's wall time.
"""

from __future__ import annotations

import time

import torch

from evaluation.decode import Decoder, Generation, new_cache
from evaluation.dynamic import grow_dynamic
from evaluation.kvcache import PreallocatedCache, keep_rows, pad_nodes, select_rows
from evaluation.verify import base_forward_rows, sample_token, tree_bias
from train.heads import KVCache


class _Batch:
    """What a batched decode carries from step to step."""

    def __init__(self, cache, head_cache, lengths: torch.Tensor, start: int):
        self.cache = cache  # the base's KV cache, every row
        self.head_cache = head_cache  # Hydra++'s extra layer's
        self.lengths = lengths  # (B,) positions each row holds (its root not yet cached)
        self.start = start  # where the next forward writes: the longest row's length
        self.roots: list[int] = []  # each row's next token, emitted, not yet cached
        self.ctx: torch.Tensor | None = None  # (B, H) heads' context at each row's last position
        self.rows: list[int] = []  # the generation each batch row decodes


def _key_mask(lengths: torch.Tensor, start: int, n: int, dtype) -> torch.Tensor:
    """(B, 1, n, start) additive mask over the cached slots: each row sees its own prefix."""
    valid = torch.arange(start, device=lengths.device)[None] < lengths[:, None]
    neg = torch.finfo(dtype).min
    mask = torch.zeros(valid.shape, dtype=dtype, device=lengths.device).masked_fill(~valid, neg)
    return mask[:, None, None, :].expand(-1, 1, n, -1)


def _step_mask(lengths: torch.Tensor, start: int, bias: torch.Tensor, dtype) -> torch.Tensor:
    """(B, 1, n, start + n): each row's prefix, then the new tokens' (B or 1, 1, n, n) bias."""
    B, n = lengths.shape[0], bias.shape[-1]
    return torch.cat([_key_mask(lengths, start, n, dtype), bias.expand(B, 1, n, n)], dim=-1)


def _causal(n: int, dtype, device) -> torch.Tensor:
    neg = torch.finfo(dtype).min
    upper = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill(upper, neg)[None, None]


def _check_prompts(dec: Decoder, prompts, max_new: int) -> list[torch.Tensor]:
    if not prompts:
        raise ValueError("no prompts: a batch needs at least one")
    ids = [dec._prompt(p) for p in prompts]
    dec._check_length(max(x.numel() for x in ids), max_new)
    return ids


def _caches(dec: Decoder, longest: int, max_new: int, nodes: int):
    """The base's and the heads' caches for a batch. A row's length never passes
    longest + max_new + nodes; a forward writes up to `nodes` more after the longest row."""
    if dec.kv_cache == "dynamic":
        return new_cache(dec.model), KVCache()
    need = longest + max_new + 2 * nodes + 2
    return new_cache(dec.model, need), PreallocatedCache(1, need)


@torch.no_grad()
def _prefill(dec: Decoder, ids: list[torch.Tensor], max_new: int, nodes: int) -> _Batch:
    """Every prompt in one right-padded forward; each row's root token (and heads' context)."""
    dev, B = dec.device, len(ids)
    P = torch.tensor([x.numel() for x in ids], device=dev)
    Pm = int(P.max())
    tokens = torch.zeros(B, Pm, dtype=torch.long, device=dev)
    for b, x in enumerate(ids):
        tokens[b, : x.numel()] = x
    st = _Batch(*_caches(dec, Pm, max_new, nodes), P.clone(), Pm)
    pos = torch.arange(Pm, device=dev).expand(B, Pm)
    # plain causal attention, as at batch 1: a real token never sees the padding after it
    # (only padding does, and its outputs are unused); later steps hide it by row length
    final, hid = base_forward_rows(dec.model, tokens, pos, st.cache, None, dec.offset)
    last = torch.arange(B, device=dev), P - 1
    st.roots = _next_tokens(dec, final[last])
    if dec.heads is not None:
        ctx = dec.heads.context(hid.float(), cache=st.head_cache, positions=pos)
        st.ctx = ctx[last]
    st.rows = list(range(B))
    return st


def _next_tokens(dec: Decoder, final: torch.Tensor) -> list[int]:
    """Each row's own next token after its (B, H) final hidden state."""
    s = dec.sampling
    logits = dec.model.lm_head(final)
    if s.temperature == 0:
        return logits.argmax(-1).tolist()
    return [sample_token(row, s.temperature, dec.generator, s.typical) for row in logits]


def _leave(st: _Batch, done: list[int]) -> None:
    """Rows `done` (batch indices) leave the batch: caches, lengths and contexts shrink."""
    ended = set(done)
    keep = [i for i in range(len(st.rows)) if i not in ended]
    idx = torch.tensor(keep, device=st.lengths.device)
    st.lengths = st.lengths[idx]
    st.start = int(st.lengths.max())
    select_rows(st.cache, idx, st.start)
    select_rows(st.head_cache, idx, st.start)
    st.roots = [st.roots[i] for i in keep]
    st.rows = [st.rows[i] for i in keep]
    if st.ctx is not None:
        st.ctx = st.ctx[idx]


def _emit_rows(dec: Decoder, st: _Batch, gens, new: list[list[int]], max_new: int) -> list[int]:
    """Append each row's new tokens to its generation; the batch indices of rows that ended."""
    done = []
    for i, (r, toks) in enumerate(zip(st.rows, new, strict=True)):
        finish = dec._emit(gens[r].tokens, toks, max_new)
        if finish:
            gens[r].finish = finish
            done.append(i)
    return done


def _share_times(gens: list[Generation], fields: dict[str, float]) -> None:
    """Each generation's share (by its tokens) of the batch's times."""
    total = sum(len(g.tokens) for g in gens) or 1
    for g in gens:
        w = len(g.tokens) / total
        for name, seconds in fields.items():
            setattr(g, name, seconds * w)


@torch.no_grad()
def plain_batch(dec: Decoder, prompts, max_new_tokens: int) -> list[Generation]:
    """Plain decoding of every prompt, one forward per token for the whole batch."""
    ids = _check_prompts(dec, prompts, max_new_tokens)
    t0 = time.perf_counter()
    st = _prefill(dec, ids, max_new_tokens, 1)
    gens = [Generation([], "length") for _ in ids]
    prefill = time.perf_counter() - t0
    done = _emit_rows(dec, st, gens, [[t] for t in st.roots], max_new_tokens)
    zero = torch.zeros(1, 1, 1, 1, dtype=dec.dtype, device=dec.device)
    while True:
        if done:
            if len(done) == len(st.rows):
                break
            _leave(st, done)
        B = len(st.rows)
        tokens = torch.tensor(st.roots, device=dec.device)[:, None]
        mask = _step_mask(st.lengths, st.start, zero, dec.dtype)
        final, _ = base_forward_rows(
            dec.model, tokens, st.lengths[:, None], st.cache, mask, dec.offset
        )
        st.start = keep_rows(st.cache, st.lengths, st.start, [_ROOT] * B)
        st.lengths = st.lengths + 1
        st.roots = _next_tokens(dec, final[:, -1])
        for r in st.rows:
            gens[r].steps += 1
        done = _emit_rows(dec, st, gens, [[t] for t in st.roots], max_new_tokens)
    _share_times(gens, {"total_s": time.perf_counter() - t0, "prefill_s": prefill})
    return gens


_ROOT = torch.zeros(1, dtype=torch.long)


def _propose(dec: Decoder, st: _Batch) -> tuple[list, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's tree: (trees, tokens (B, N), bias (B or 1, 1, N, N), depths (B or 1, N))."""
    dev, B = dec.device, len(st.rows)
    if dec.dynamic is None:
        tree, heads = dec.tree, dec.heads
        tokens = torch.empty(B, tree.num_nodes, dtype=torch.long, device=dev)
        tokens[:, 0] = torch.tensor(st.roots, device=dev)
        for lv in tree.levels:
            k = lv.depth - 1
            if heads.uses_path:
                path = tokens[:, lv.parent_paths]  # (B, P, depth): root..parent
                P = path.shape[1]
                ctx = st.ctx[:, None].expand(B, P, -1).reshape(B * P, -1)
                cand = heads.candidates(k, ctx, path.reshape(B * P, -1), dec.embed, lv.topk)
                tokens[:, lv.nodes] = cand.view(B, P, -1)[:, lv.row, lv.ranks]
            else:  # Medusa: one distribution per depth and row
                cand = heads.candidates(k, st.ctx, None, dec.embed, lv.topk)
                tokens[:, lv.nodes] = cand[:, lv.ranks]
        return [tree] * B, tokens, dec.bias[None, None], dec.depth[None]
    grown = [
        grow_dynamic(dec.dynamic, dec.heads, dec.embed, st.ctx[i], st.roots[i]) for i in range(B)
    ]
    N = max(t.num_nodes for t, _ in grown)
    neg = torch.finfo(dec.dtype).min
    tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
    bias = torch.full((B, 1, N, N), neg, dtype=dec.dtype, device=dev)
    bias[:, 0].diagonal(dim1=-2, dim2=-1).zero_()  # padding nodes see themselves only
    depth = torch.zeros(B, N, dtype=torch.long, device=dev)
    for b, (tree, toks) in enumerate(grown):
        n = tree.num_nodes
        tokens[b, :n] = toks
        bias[b, 0, :n, :n] = tree_bias(tree, dec.dtype, dev)
        depth[b, :n] = tree.depth.to(dev)
    return [t for t, _ in grown], tokens, bias, depth


def _accept_rows(dec: Decoder, trees, tokens: torch.Tensor, final: torch.Tensor):
    """Each row's accepted nodes and bonus token. Greedy walks every row down its tree at once:
    one output projection of one node per row and depth."""
    B = len(trees)
    if dec.sampling.acceptance != "greedy":  # the batch-1 rules, row by row (padding cut)
        return [
            dec._accept(t, tokens[b, : t.num_nodes], final[b, : t.num_nodes])
            for b, t in enumerate(trees)
        ]
    toks = tokens.tolist()
    cur, nodes, bonus = [0] * B, [[0] for _ in range(B)], [0] * B
    active = list(range(B))
    while active:
        rows = torch.tensor(active, device=final.device)
        at = torch.tensor([cur[b] for b in active], device=final.device)
        choice = dec.model.lm_head(final[rows, at]).argmax(-1).tolist()
        still = []
        for b, c in zip(active, choice, strict=True):
            nxt = next((ch for ch in trees[b].children[cur[b]] if toks[b][ch] == c), None)
            if nxt is None:
                bonus[b] = c
            else:
                cur[b] = nxt
                nodes[b].append(nxt)
                still.append(b)
        active = still
    return [(torch.tensor(n, device=final.device), c) for n, c in zip(nodes, bonus, strict=True)]


@torch.no_grad()
def speculative_batch(dec: Decoder, prompts, max_new_tokens: int) -> list[Generation]:
    """Speculative decoding of every prompt: each step proposes a tree per row, verifies all
    of them in one base forward, and accepts per row."""
    if dec.tree is None and dec.dynamic is None:
        raise ValueError("speculative decoding needs a tree: call set_tree first")
    if not dec.speculating:  # an empty tree: plain decoding
        gens = plain_batch(dec, prompts, max_new_tokens)
        for g in gens:
            g.accepted = [0] * g.steps
            g.verify_s = g.total_s - g.prefill_s
        return gens
    ids = _check_prompts(dec, prompts, max_new_tokens)
    dev = dec.device
    t0 = time.perf_counter()
    st = _prefill(dec, ids, max_new_tokens, dec._tree_shape()[0])
    gens = [Generation([], "length") for _ in ids]
    times = {"prefill_s": time.perf_counter() - t0, "propose_s": 0.0, "verify_s": 0.0}
    times["bookkeeping_s"] = 0.0
    done = _emit_rows(dec, st, gens, [[t] for t in st.roots], max_new_tokens)
    while True:
        if done:
            if len(done) == len(st.rows):
                break
            _leave(st, done)
        t1 = time.perf_counter()
        trees, tokens, bias, depth = _propose(dec, st)
        t2 = time.perf_counter()
        mask = _step_mask(st.lengths, st.start, bias, dec.dtype)
        pos = st.lengths[:, None] + depth
        final, hid = base_forward_rows(dec.model, tokens, pos, st.cache, mask, dec.offset)
        t3 = time.perf_counter()
        accepted = _accept_rows(dec, trees, tokens, final)
        nodes = [n for n, _ in accepted]
        start = st.start
        st.start = keep_rows(st.cache, st.lengths, start, nodes)
        # the heads' context over each row's accepted nodes (padded to the longest path)
        n, _, picked = pad_nodes(nodes, dev)  # (B,), (B, m)
        m = picked.shape[1]
        rows = torch.arange(len(nodes), device=dev)[:, None]
        h = hid.float()[rows, picked]
        hpos = st.lengths[:, None] + torch.arange(m, device=dev)[None]
        hmask = _step_mask(st.lengths, start, _causal(m, torch.float32, dev), torch.float32)
        ctx = dec.heads.context(h, cache=st.head_cache, positions=hpos, mask=hmask)
        keep_rows(st.head_cache, st.lengths, start, [torch.arange(int(k)) for k in n.tolist()])
        st.ctx = ctx[rows[:, 0], n - 1]
        st.lengths = st.lengths + n
        new = []
        for i, r in enumerate(st.rows):
            gens[r].steps += 1
            gens[r].accepted.append(int(n[i]) - 1)
            st.roots[i] = accepted[i][1]
            new.append([*tokens[i, nodes[i][1:]].tolist(), st.roots[i]])
        done = _emit_rows(dec, st, gens, new, max_new_tokens)
        t4 = time.perf_counter()
        times["propose_s"] += t2 - t1
        times["verify_s"] += t3 - t2
        times["bookkeeping_s"] += t4 - t3
    _share_times(gens, {"total_s": time.perf_counter() - t0, **times})
    return gens
