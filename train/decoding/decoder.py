"""The one decoder: plain and tree-speculative decoding of a batch of prompts (batch 1 is B=1).

Every step is the same loop. Propose: the heads draft each row's tree from its context (plain
decoding proposes the root alone: the base's own next token). Verify: one base forward over
every row's tree with a tree attention mask, each row at its own RoPE positions (its length
plus the node's depth). Accept: each row's longest matching path (train/decoding/sampling.py)
and its bonus token, which roots the row's next tree. Bookkeeping: each row keeps its accepted
nodes' KV entries, moved down to follow its own prefix (one indexed copy over every layer,
train/decoding/cache.py), Hydra++'s extra layer reads the accepted hidden states into its own
cache of the same kind, and rows that end (EOS or max_new_tokens) leave the batch.

Prompts are right-padded for the prefill. Every later forward writes at the same slots of every
row, after the longest row; a shorter row's hole of stale slots is hidden by the mask. Greedy
rows are the tokens of their batch-1 greedy decodes: the acceptance is exact per row, and a
row's attention sees exactly its own prefix and path. (Bit-for-bit logits can differ between
batch sizes, as kernels block a matmul by its row count; a near-tie could then flip, as it
could between a verify pass and a one-token step.)
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from train.decoding.backend import compile_body, compute_dtype, forward, output_logits
from train.decoding.cache import KVCache, keep_static, new_cache
from train.decoding.dynamic import DynamicTree
from train.decoding.generation import Generation, share_times
from train.decoding.masks import AttentionLayout, AttentionLayoutError
from train.decoding.propose import Proposal, Proposer, root_only
from train.decoding.recurrent import DraftMemory
from train.decoding.sampling import (
    Accepted,
    SamplingConfig,
    accept_greedy,
    accept_rejection,
    accept_typical,
    row_logits,
    sample_rows,
)
from train.decoding.tree import Tree

CAPACITY_BUCKET = 256  # compiled decoding: KV capacity rounded up to a multiple of this
KEPT_ROOM = 128  # tree nodes per step, and new tokens, a kept prefill's caches leave room for


@dataclass
class _Rows:
    """What a decode carries from step to step, per live batch row."""

    cache: object  # the base's KV cache (a KVCache; a StaticCache when compiled)
    head_cache: KVCache  # Hydra++'s extra layer's
    lengths: torch.Tensor  # (B,) positions each row holds (its root not yet cached)
    start: int  # where the next forward writes: the longest row's length
    roots: torch.Tensor  # (B,) each row's next token, emitted, not yet cached
    rows: list[int]  # the generation each batch row decodes
    ctx: torch.Tensor | None = None  # (B, H) heads' context at each row's last position

    @property
    def flat(self) -> bool:
        """Every row holds `start` positions: no hole to mask."""
        return len(self.rows) == 1 or bool((self.lengths == self.start).all())


@dataclass
class _Kept:
    """A prefill kept for decoding the same prompt again (`Decoder.decode_kept`). A decode
    writes only after the prompt, so rewinding the caches' write positions and the rows'
    lengths restores the state right after the prefill, with one exception: rows that finish
    early leave by moving the later rows up, prompt columns included. The base's prompt
    entries are the same in every row (one prompt), but the heads' may not be (EAGLE-3 reads
    each row's root at the prompt's last position, and sampled roots differ), so with several
    rows the heads' prompt columns are kept aside and written back."""

    key: tuple  # (prompt tokens, batch)
    max_new: int
    nodes: int  # tree nodes per step the caches have room for
    state: _Rows  # right after the prefill: decodes run on copies of its tensors, never on it
    ends: tuple[int, int]  # base and heads' cache write positions after the prefill
    head_prompt: torch.Tensor | None = None  # the heads' cache over the prompt, B > 1

    def restore(self) -> _Rows:
        st, B = self.state, len(self.state.rows)
        st.cache.end, st.head_cache.end = self.ends
        for c in (st.cache, st.head_cache):
            if c.buf is not None:
                c.rows = B
        if self.head_prompt is not None:
            st.head_cache.buf[:, :, :B, :, : self.ends[1]] = self.head_prompt
        ctx = None if st.ctx is None else st.ctx.clone()
        return _Rows(
            st.cache,
            st.head_cache,
            st.lengths.clone(),
            st.start,
            st.roots.clone(),
            list(st.rows),
            ctx,
        )


class Decoder:
    """Plain and speculative decoding with one base model (and optionally draft heads)."""

    def __init__(
        self,
        model,
        eos: set[int],
        heads=None,
        tree: Tree | DynamicTree | None = None,
        sampling: SamplingConfig | None = None,
        hidden_state_offset: int = 0,
        compile: bool = False,
    ):
        self.model = model.eval()
        self.eos = set(eos)
        self.sampling = sampling or SamplingConfig(temperature=0.0, acceptance="greedy", seed=0)
        # what the heads read from the base: theirs (EAGLE-3: several layers), else the offset
        self.offset = heads.features if heads is not None else hidden_state_offset
        self.device = next(model.parameters()).device
        self.dtype = compute_dtype(model)  # the base's activations (bf16 for a bf16 base)
        self.heads = None
        if heads is not None:
            # the heads run in the base's compute dtype: a copy when that changes theirs, so
            # that training's own heads (val/tau) stay as they are
            if next(heads.parameters()).dtype != self.dtype:
                heads = copy.deepcopy(heads).to(self.dtype)
            self.heads = heads.eval()
        embed = model.get_input_embeddings()
        if embed.weight.dtype != self.dtype:
            embed = torch.nn.Embedding.from_pretrained(embed.weight.to(self.dtype), freeze=True)
        self.embed = embed
        self.proposer = Proposer(self.heads, embed, self.dtype, self.device)
        # steps of up to this many tree nodes (all rows together) get all their output logits
        # from one projection, larger ones walk the trees (one row per row and depth reached).
        # SmolLM2's 49k x 576 projection on one core: float32 11 ms for 1 row, 35 ms for 16;
        # bf16 6.6 ms for 1 row, 8.5 ms for 16 (a batch of 4 x 16 nodes paid 25 ms a step).
        self.project_all = 5 if self.dtype == torch.float32 else 64
        # walking, each row's pass also projects the next node down its first children (the
        # heads' likeliest) where 2 rows cost about what 1 does: float32, 8.7 ms against 7.8
        # (bf16 on a CPU without bf16 units: 12.1 against 9.5; with them every node at once)
        self.lookahead_rows = 2 if self.dtype == torch.float32 else 1
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.layout = AttentionLayout(model.config)  # full or sliding-window layers
        if compile and self.layout.sliding:
            raise AttentionLayoutError(
                f"eval.compile=true decodes through a StaticCache, which keeps no sliding window "
                f"for {type(model.config).__name__}'s window of {self.layout.window}: set "
                "eval.compile=false"
            )
        self.project_s = 0.0  # time in the base's output projection (lm_head), all calls
        self.generator = torch.Generator().manual_seed(self.sampling.seed)
        # eval.compile: one compiled graph per (tokens per forward, cache capacity bucket);
        # the prefill stays eager (its length varies). compile_s: time spent compiling.
        self.compiled = compile_body(model) if compile else None
        self.compiled_shapes: set[tuple[int, int]] = set()
        self.static_caches: dict[int, object] = {}  # capacity bucket -> its StaticCache
        self.compile_s = 0.0
        self.kept: _Kept | None = None  # decode_kept's prefill
        if tree is not None:
            self.set_tree(tree)

    # -- settings ---------------------------------------------------------------------------
    def set_tree(self, tree: Tree | DynamicTree) -> None:
        """A fixed tree, or a DynamicTree: the rule each step grows its own tree by."""
        if self.heads is None:
            raise ValueError("speculative decoding needs heads")
        self.proposer.set_tree(tree)

    @property
    def has_tree(self) -> bool:
        """Whether set_tree was called (an empty fixed tree counts: it decodes plainly)."""
        return self.tree is not None or self.dynamic is not None

    @property
    def tree(self) -> Tree | None:
        return self.proposer.tree

    @property
    def dynamic(self) -> DynamicTree | None:
        return self.proposer.dynamic

    @property
    def speculating(self) -> bool:
        """Whether speculative() has drafts to verify (an empty fixed tree has none)."""
        return self.dynamic is not None or (self.tree is not None and self.tree.num_nodes > 1)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base's own logits (Gemma-2: soft-capped) from its lm_head, looked up at each
        call (use_weight_layout may replace it after the decoder is built); timed."""
        t = time.perf_counter()
        out = output_logits(self.model, hidden)
        self.project_s += time.perf_counter() - t
        return out

    # -- the public loops -------------------------------------------------------------------
    # Under inference_mode, not only no_grad: no op of a decode bumps version counters or
    # records views, which took ~3 ms of a ~35 ms step (plain and speculative alike, bf16
    # SmolLM2 on 2 Xeon cores). Every tensor a decode makes lives and dies inside it (its KV
    # caches are allocated per decode), so none leaks out as an inference tensor; decode_kept's
    # kept prefill outlives its call but is only ever read and written inside decode_kept.
    @torch.inference_mode()
    def plain(self, prompts: list, max_new_tokens: int) -> list[Generation]:
        """One base forward per token for the whole batch: the baseline to match and beat."""
        return self._decode(self._check_prompts(prompts, max_new_tokens), max_new_tokens, False)

    @torch.inference_mode()
    def speculative(self, prompts: list, max_new_tokens: int) -> list[Generation]:
        """Each step proposes a tree per row, verifies all of them in one base forward, and
        accepts per row. An empty tree is plain decoding (every step accepts 0 drafts)."""
        if not self.has_tree:
            raise ValueError("speculative decoding needs a tree: call set_tree first")
        if not self.speculating:
            gens = self.plain(prompts, max_new_tokens)
            for g in gens:
                g.accepted = [0] * g.steps
                g.verify_s = g.total_s - g.prefill_s
            return gens
        return self._decode(self._check_prompts(prompts, max_new_tokens), max_new_tokens, True)

    def propose(
        self,
        ctx: torch.Tensor,
        roots: torch.Tensor,
        lengths: torch.Tensor,
        memory: DraftMemory | None = None,
    ) -> Proposal:
        """Each row's tree at heads' context ctx (B, H) and roots (B,); `lengths` (B,): where
        each root sits in its sequence (what a test's oracle proposer reads); `memory`: a
        recurrent head set's cache to draft against."""
        return self.proposer.propose(ctx, roots, memory)

    @torch.inference_mode()
    def decode_kept(self, prompt, max_new_tokens: int, batch: int = 1) -> list[Generation]:
        """`batch` copies of `prompt` decoded with the current tree (plainly without one), as
        speculative() / plain() would, but from a prefill kept from the previous call with the
        same prompt and batch: tree=auto times many trees on one long prompt, and its prefill
        is most of a short decode. Compiled decoding (static caches) prefills every time.
        `forget_kept()` frees the kept caches."""
        speculate = self.speculating
        ids = self._check_prompts([prompt] * batch, max_new_tokens)
        if self.compiled is not None:
            return self._decode(ids, max_new_tokens, speculate)
        nodes = self.proposer.max_nodes if speculate else 1
        key = (tuple(ids[0].tolist()), batch)
        k = self.kept
        if k is None or k.key != key or k.max_new < max_new_tokens or k.nodes < nodes:
            self.kept = None  # its caches go before the new ones are allocated
            room, longer = max(nodes, KEPT_ROOM), max(max_new_tokens, KEPT_ROOM)
            st = self._prefill(ids, longer, self.heads is not None, room)
            ends = (st.cache.end, st.head_cache.end)
            k = _Kept(key, longer, room, st, ends)
            if batch > 1 and st.head_cache.buf is not None:
                k.head_prompt = st.head_cache.buf[:, :, :batch, :, : ends[1]].clone()
            self.kept = k
        return self._decode(ids, max_new_tokens, speculate, k.restore())

    def forget_kept(self) -> None:
        self.kept = None

    @torch.inference_mode()
    def decode_step_seconds(
        self, prompt, new_tokens: int = 16, reps: int = 2, batch: int = 1
    ) -> float:
        """Wall time per base forward of a real decode of `new_tokens` after `prompt`, `batch`
        copies at once: the speculative one with the current tree (propose, verify, accept, KV
        upkeep and all), or the plain one without a tree. The least disturbed of `reps`. The
        prompt is prefilled once and kept for the next calls (`decode_kept`)."""
        best = float("inf")
        for _ in range(reps):
            gens = self.decode_kept(prompt, new_tokens, batch)
            steps = max(g.steps for g in gens)
            if steps:
                best = min(best, sum(g.total_s - g.prefill_s for g in gens) / steps)
        return best

    # -- one decode -------------------------------------------------------------------------
    def _decode(
        self, ids: list[torch.Tensor], max_new: int, speculate: bool, st: _Rows | None = None
    ) -> list[Generation]:
        """Decode checked prompts `ids`, from state `st` after their prefill if given."""
        t0, c0 = time.perf_counter(), self.compile_s
        if st is None:
            st = self._prefill(ids, max_new, speculate)
        gens = [Generation([], "length") for _ in ids]
        times = {"prefill_s": time.perf_counter() - t0, "propose_s": 0.0, "verify_s": 0.0}
        times.update(project_s=0.0, bookkeeping_s=0.0)
        done = self._emit(st, gens, [[t] for t in st.roots.tolist()], max_new)
        while len(done) < len(st.rows):
            if done:
                self._leave(st, done)
            t1 = time.perf_counter()
            if speculate:
                memory = None
                if self.heads.recurrent:
                    memory = DraftMemory(st.head_cache, st.lengths, st.start, self.dtype)
                prop = self.propose(st.ctx, st.roots, st.lengths, memory)
            else:
                prop = root_only(st.roots, self.dtype)
            t2, c1 = time.perf_counter(), self.compile_s
            final, hid = self._verify(st, prop)
            t3, p0 = time.perf_counter(), self.project_s
            accepted = self._accept(prop, final)
            # each row's emitted tokens: its accepted drafts, then the bonus token
            new = [[*prop.tokens[i, a[1:]].tolist(), b] for i, (a, b) in enumerate(accepted)]
            n = self._keep(st, accepted, hid if speculate else None, new)
            for i, r in enumerate(st.rows):
                gens[r].steps += 1
                gens[r].accepted.append(int(n[i]) - 1)
            st.roots = torch.tensor([b for _, b in accepted], device=self.device)
            done = self._emit(st, gens, new, max_new)
            t4 = time.perf_counter()
            times["propose_s"] += t2 - t1
            times["verify_s"] += t3 - t2 - (self.compile_s - c1)  # compiling reported apart
            times["project_s"] += self.project_s - p0
            times["bookkeeping_s"] += t4 - t3 - (self.project_s - p0)
        compiling = self.compile_s - c0
        share_times(gens, {"total_s": time.perf_counter() - t0 - compiling, **times})
        for g in gens:
            g.compile_s = compiling / len(gens)
        return gens

    def _check_prompts(self, prompts: list, max_new: int) -> list[torch.Tensor]:
        if not prompts:
            raise ValueError("no prompts: a batch needs at least one")
        if self.compiled is not None and len(prompts) > 1:
            raise ValueError("compiled decoding runs one prompt at a time (batch size 1)")
        ids = []
        for p in prompts:
            x = torch.as_tensor(p, dtype=torch.long, device=self.device).flatten()
            if x.numel() == 0:
                raise ValueError("empty prompt: nothing to decode from")
            ids.append(x)
        longest = max(x.numel() for x in ids)
        extra = (self.proposer.max_depth if self.has_tree else 0) + 1
        if self.max_positions and longest + max_new + extra > self.max_positions:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={max_new} exceeds the base "
                f"model's {self.max_positions} positions: shorten the prompt or max_new_tokens"
            )
        return ids

    def _caches(self, longest: int, max_new: int, nodes: int):
        """The base's and the heads' caches. A row's length never passes longest + max_new +
        nodes; a forward writes up to `nodes` more after the longest row."""
        need = longest + max_new + 2 * nodes + 2
        if self.compiled is None:
            return new_cache(self.model, need), KVCache(1, need)
        from transformers import StaticCache

        bucket = -(-need // CAPACITY_BUCKET) * CAPACITY_BUCKET
        # one cache per bucket for the decoder's life: a compiled graph holds on to the
        # buffers it was compiled with (static addresses, frozen in), so a new cache would
        # be one it never writes to. Stale entries past the prefix are masked out.
        base = self.static_caches.get(bucket)
        if base is None:
            base = self.static_caches[bucket] = StaticCache(
                config=self.model.config, max_cache_len=bucket
            )
        for layer in base.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()
        return base, KVCache(1, need)

    def _prefill(
        self, ids: list[torch.Tensor], max_new: int, speculate: bool, nodes: int | None = None
    ) -> _Rows:
        """Every prompt in one right-padded forward; each row's root token (and context).
        `nodes`: tree nodes per step to leave cache room for (default: the current tree's)."""
        dev, B = self.device, len(ids)
        P = torch.tensor([x.numel() for x in ids], device=dev)
        Pm = int(P.max())
        tokens = torch.zeros(B, Pm, dtype=torch.long, device=dev)
        for b, x in enumerate(ids):
            tokens[b, : x.numel()] = x
        if nodes is None:
            nodes = self.proposer.max_nodes if speculate else 1
        cache, head_cache = self._caches(Pm, max_new, nodes)
        pos = torch.arange(Pm, device=dev).expand(B, Pm)
        # plain causal attention: a real token never sees the padding after it (only padding
        # does, and its outputs are unused); later steps hide it by row length
        final, hid = forward(self.model, tokens, pos, cache, None, self.offset)
        last = torch.arange(B, device=dev), P - 1
        s = self.sampling
        roots = sample_rows(self.lm_head(final[last]), s.temperature, self.generator, s.typical)
        st = _Rows(cache, head_cache, P.clone(), Pm, roots, list(range(B)))
        if speculate:
            extra = {}
            if self.heads.recurrent:  # position p reads the token after it: the root at the end
                nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
                nxt[last] = roots
                extra["next_emb"] = self.embed(nxt)
            st.ctx = self.heads.context(hid, cache=head_cache, positions=pos, **extra)[last]
        return st

    def _mask(self, st: _Rows, bias: torch.Tensor, n: int, dtype) -> torch.Tensor | None:
        """(B, 1, n, start + n) additive mask: each row's own prefix, then the new tokens'
        bias; None where plain causal attention is the same (one query, no hole)."""
        B, start = len(st.rows), st.start
        if n == 1 and st.flat:
            return None
        mask = torch.zeros(B, 1, n, start + n, dtype=dtype, device=self.device)
        if not st.flat:
            hole = torch.arange(start, device=self.device)[None] >= st.lengths[:, None]
            mask[..., :start].masked_fill_(hole[:, None, None], torch.finfo(dtype).min)
        mask[..., start:] = bias.to(dtype)
        return mask

    def _verify(self, st: _Rows, prop: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
        """The base over every row's tree: (B, N, H) final and heads' hidden states."""
        n = prop.tokens.shape[1]
        pos = st.lengths[:, None] + prop.depth
        if self.compiled is None:
            mask = self.layout.apply(self._mask(st, prop.bias, n, self.dtype), pos, st.start)
            return forward(self.model, prop.tokens, pos, st.cache, mask, self.offset)
        cap = st.cache.layers[0].max_cache_len
        # static shapes: attend over the whole buffer, the unused slots masked out
        mask = torch.full((1, 1, n, cap), torch.finfo(self.dtype).min, dtype=self.dtype,
                          device=self.device)  # fmt: skip
        mask[..., : st.start] = 0
        mask[0, 0, :, st.start : st.start + n] = prop.bias[0, 0]
        key, t = (n, cap), time.perf_counter()
        out = forward(self.model, prop.tokens, pos, st.cache, mask, self.offset, self.compiled)
        if key not in self.compiled_shapes:  # this call compiled its graph
            self.compiled_shapes.add(key)
            self.compile_s += time.perf_counter() - t
        return out

    def _accept(self, prop: Proposal, final: torch.Tensor) -> list[Accepted]:
        """Each row's accepted nodes and bonus token."""
        B, N, _ = final.shape
        lm_head = self.lm_head
        if self.project_all >= B * N:
            # one projection of every node of every row reads the output weights once;
            # walking the trees reads them once per depth reached (each a matmul of one row per
            # row still walking, which costs about as much as one row)
            every = lm_head(final.reshape(B * N, -1)).view(B, N, -1)

            def logits(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
                return every[rows, nodes]

        else:

            def logits(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
                return lm_head(final[rows, nodes])

        s = self.sampling
        if s.acceptance == "greedy":
            ahead = 0 if self.project_all >= B * N else max(self.lookahead_rows // B - 1, 0)
            return accept_greedy(prop.trees, prop.tokens, logits, ahead)
        out = []
        for b, tree in enumerate(prop.trees):  # the sampling rules, row by row (padding cut)
            toks, fn = prop.tokens[b, : tree.num_nodes], row_logits(logits, b)
            if s.acceptance == "rejection":
                out.append(accept_rejection(tree, toks, fn, s.temperature, self.generator))
            else:
                thr, alpha = s.typical
                rule = accept_typical(tree, toks, fn, s.temperature, thr, alpha, self.generator)
                out.append(rule)
        return out

    def _keep(
        self,
        st: _Rows,
        accepted: list[Accepted],
        hid: torch.Tensor | None,
        new: list[list[int]],
    ):
        """Keep each row's accepted entries in the caches and, with `hid` (speculative
        decoding), read them into the heads' context; `new`: each row's emitted tokens (the
        tokens after its accepted nodes, which a recurrent head set's context reads). Returns
        (B,) accepted counts."""
        dev = self.device
        n = torch.tensor([int(a.numel()) for a, _ in accepted], device=dev)
        # a shorter row repeats its last node into its last slot: same value, same place
        col = torch.minimum(torch.arange(int(n.max()), device=dev)[None], (n - 1)[:, None])
        picked = torch.stack([a.to(dev)[col[b]] for b, (a, _) in enumerate(accepted)])
        start, end = st.start, int((st.lengths + n).max())
        dst = st.lengths[:, None] + col
        if isinstance(st.cache, KVCache):
            st.cache.keep(start + picked, dst, end)
        else:  # compiled decoding's StaticCache, batch 1
            keep_static(st.cache, start, picked[0])
        if hid is not None:
            m = picked.shape[1]
            rows = torch.arange(len(accepted), device=dev)[:, None]
            h = hid[rows, picked]  # (B, m, H)
            hpos = st.lengths[:, None] + torch.arange(m, device=dev)[None]
            hmask = None
            if not st.flat:
                causal = torch.ones(m, m, dtype=torch.bool, device=dev).triu(1)
                bias = torch.zeros(m, m, dtype=self.dtype, device=dev)
                bias = bias.masked_fill(causal, torch.finfo(self.dtype).min)
                hmask = self._mask(st, bias[None, None], m, self.dtype)
            extra = {}
            if self.heads.recurrent:  # accepted node j reads the token emitted after it
                nxt = torch.tensor([toks + toks[-1:] * (m - len(toks)) for toks in new], device=dev)
                extra["next_emb"] = self.embed(nxt)
            ctx = self.heads.context(h, cache=st.head_cache, positions=hpos, mask=hmask, **extra)
            st.head_cache.keep(start + col, dst, end)
            st.ctx = ctx[rows[:, 0], n - 1]
        st.lengths = st.lengths + n
        st.start = end
        return n

    def _emit(self, st: _Rows, gens: list[Generation], new: list[list[int]], max_new: int):
        """Append each row's new tokens to its generation; the batch indices of rows that
        ended (their first EOS kept as their last token, or max_new tokens)."""
        done = []
        for i, (r, toks) in enumerate(zip(st.rows, new, strict=True)):
            out = gens[r].tokens
            for t in toks:
                out.append(t)
                if t in self.eos:
                    gens[r].finish = "eos"
                    break
                if len(out) >= max_new:
                    gens[r].finish = "length"
                    break
            else:
                continue
            done.append(i)
        return done

    def _leave(self, st: _Rows, done: list[int]) -> None:
        """Rows `done` (batch indices) leave the batch: caches, lengths and contexts shrink."""
        ended = set(done)
        keep = [i for i in range(len(st.rows)) if i not in ended]
        idx = torch.tensor(keep, device=self.device)
        st.lengths, st.roots = st.lengths[idx], st.roots[idx]
        st.start = int(st.lengths.max())
        for cache in (st.cache, st.head_cache):
            cache.select_rows(idx)
            cache.end = cache.lo + st.start
        st.rows = [st.rows[i] for i in keep]
        if st.ctx is not None:
            st.ctx = st.ctx[idx]
