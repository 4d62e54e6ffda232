"""Decoding loops: plain one-token-per-forward decoding and tree speculative decoding (batch 1;
evaluation/batched.py decodes batches).

Both keep the base model's KV cache across steps. A speculative step: the heads propose the tree
from the context of the last accepted token (level by level; Hydra heads read the embeddings of
each node's path, Hydra++ keeps its extra layer's own KV cache), the base verifies the whole
tree in one forward with a tree attention mask, the accepted path's KV entries are kept (the
rest dropped, nothing recomputed), and the base model's own token after the path is the bonus
token that roots the next tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from evaluation.backend import compute_dtype
from evaluation.dynamic import DynamicTree, grow_dynamic
from evaluation.kvcache import PreallocatedCache, keep_accepted, num_cache_layers
from evaluation.tree import Tree
from evaluation.verify import (
    ACCEPTANCE,
    accept_greedy,
    accept_rejection,
    accept_typical,
    base_forward,
    sample_token,
    tree_attention_mask,
    tree_bias,
)
from train.heads import HeadSet, KVCache

KV_CACHES = ("static", "dynamic")
CAPACITY_BUCKET = 256  # compiled decoding: KV capacity rounded up to a multiple of this


def compile_body(model):
    """torch.compile of the base's body (no output projection): inductor with frozen weights
    on CPU, CUDA graphs (mode=reduce-overhead) on CUDA."""
    import torch._dynamo.config as dynamo_config

    # a graph per (verify size, capacity bucket) and per compiled model: a multi-turn suite
    # with trees passes dynamo's default limit of 8, past which it falls back to eager
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 512)
    device = next(model.parameters()).device
    if device.type == "cpu":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: prepacked for oneDNN
        return torch.compile(model.model, dynamic=False)
    return torch.compile(model.model, dynamic=False, mode="reduce-overhead")


@dataclass
class Generation:
    """One prompt's output and what it cost."""

    tokens: list[int]
    finish: str  # "eos" or "length"
    prefill_s: float = 0.0
    total_s: float = 0.0  # prefill included, compiling not
    compile_s: float = 0.0  # eval.compile: time this generation spent compiling graphs
    steps: int = 0  # base forwards after the prefill
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verify step
    propose_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0  # acceptance, KV-cache compaction, the heads' context update

    @property
    def tau(self) -> float:
        """Tokens per verify forward, the bonus token included."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)


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


def new_cache(model, capacity: int | None = None):
    """The base's KV cache for one generation: pre-allocated for `capacity` positions, or
    transformers' concatenating DynamicCache when capacity is None."""
    if capacity is not None:
        return PreallocatedCache(num_cache_layers(model), capacity)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


class Decoder:
    """Plain and speculative decoding with one base model (and optionally draft heads)."""

    def __init__(
        self,
        model,
        eos: set[int],
        heads: HeadSet | None = None,
        tree: Tree | None = None,
        sampling: SamplingConfig | None = None,
        hidden_state_offset: int = 0,
        kv_cache: str = "static",
        compile: bool = False,
    ):
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache={kv_cache!r} is invalid: choose one of {KV_CACHES}")
        if compile and kv_cache != "static":
            raise ValueError("compile=True needs kv_cache='static' (compiled shapes are fixed)")
        self.kv_cache = kv_cache
        self.model = model.eval()
        self.eos = set(eos)
        self.heads = heads.eval() if heads is not None else None
        self.sampling = sampling or SamplingConfig(temperature=0.0, acceptance="greedy", seed=0)
        self.offset = hidden_state_offset
        self.device = next(model.parameters()).device
        self.dtype = compute_dtype(model)  # the base's activations (bf16 for a bf16 base)
        embed = model.get_input_embeddings()
        if embed.weight.dtype != torch.float32:  # the heads run in float32 whatever the base
            embed = torch.nn.Embedding.from_pretrained(embed.weight.float(), freeze=True)
        self.embed = embed
        # trees up to this many nodes get all their output logits from one projection, larger
        # ones walk the tree (one row per accepted node). SmolLM2's 49k x 576 projection on one
        # core: float32 11 ms for 1 row, 35 ms for 16; bf16 6.6 ms for 1 row, 8.5 ms for 16.
        self.project_all = 5 if self.dtype == torch.float32 else 64
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.generator = torch.Generator().manual_seed(self.sampling.seed)
        # eval.compile: one compiled graph per (tokens per forward, cache capacity bucket);
        # the prefill stays eager (its length varies). compile_s: time spent compiling.
        self.compiled = compile_body(model) if compile else None
        self.compiled_shapes: set[tuple[int, int]] = set()
        self.static_caches: dict[int, object] = {}  # capacity bucket -> its StaticCache
        self.compile_s = 0.0
        self.tree: Tree | None = None
        self.dynamic: DynamicTree | None = None
        if tree is not None:
            self.set_tree(tree)

    def set_tree(self, tree: Tree | DynamicTree) -> None:
        """A fixed tree, or a DynamicTree: the rule each step grows its own tree by."""
        if self.heads is None:
            raise ValueError("speculative decoding needs heads")
        if isinstance(tree, DynamicTree):
            tree.levels(self.heads.num_heads)  # fails clearly if deeper than the heads
            self.dynamic, self.tree = tree, None
            return
        tree.check_heads(self.heads.num_heads)
        self.tree, self.dynamic = tree, None
        self.bias = tree_bias(tree, self.dtype, self.device)
        self.depth = tree.depth.to(self.device)

    @property
    def speculating(self) -> bool:
        """Whether speculative() has drafts to verify (an empty fixed tree has none)."""
        return self.dynamic is not None or (self.tree is not None and self.tree.num_nodes > 1)

    def _tree_shape(self) -> tuple[int, int]:
        """(tokens per verify pass, levels) at most."""
        if self.dynamic is not None:
            return self.dynamic.max_nodes, self.dynamic.levels(self.heads.num_heads)
        if self.tree is not None:
            return self.tree.num_nodes, self.tree.max_depth
        return 1, 0

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    # -- shared pieces ----------------------------------------------------------------------
    def _check_length(self, prompt_len: int, max_new: int) -> None:
        extra = self._tree_shape()[1] + 1
        if self.max_positions and prompt_len + max_new + extra > self.max_positions:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new} exceeds the base "
                f"model's {self.max_positions} positions: shorten the prompt or max_new_tokens"
            )

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, bias=None):
        """The base over `ids` at `positions` (a prefill, a one-token step, or a tree with its
        (N, N) attention `bias`), appending to `cache`: (final, heads' input) hidden states."""
        tree = bias is not None
        n = ids.numel()
        past = int(positions[0])  # a step's first token sits right after the cached ones
        if self.compiled is not None and (tree or n == 1):
            cap = cache.layers[0].max_cache_len
            # static shapes: attend over the whole buffer, the unused slots masked out
            mask = torch.full((1, 1, n, cap), torch.finfo(self.dtype).min, dtype=self.dtype,
                              device=self.device)  # fmt: skip
            mask[..., :past] = 0
            mask[0, 0, :, past : past + n] = bias if tree else 0
            key, t = (n, cap), time.perf_counter()
            final, hid = base_forward(
                self.model, ids[None], positions[None], cache, mask, self.offset, self.compiled
            )
            if key not in self.compiled_shapes:  # this call compiled its graph
                self.compiled_shapes.add(key)
                self.compile_s += time.perf_counter() - t
            return final, hid.float()
        mask = tree_attention_mask(bias, past) if tree else None
        final, hid = base_forward(self.model, ids[None], positions[None], cache, mask, self.offset)
        return final, hid.float()

    def _caches(self, prompt_len: int, max_new: int):
        """The base's KV cache and the heads' (Hydra++'s extra layer) for one generation."""
        if self.kv_cache == "dynamic":
            return new_cache(self.model), KVCache()
        nodes = self._tree_shape()[0]
        need = prompt_len + max_new + nodes + 1
        if self.compiled is not None:  # capacity in buckets, so that few graphs compile
            from transformers import StaticCache

            bucket = -(-need // CAPACITY_BUCKET) * CAPACITY_BUCKET
            # one cache per bucket for the decoder's life: a compiled graph holds on to the
            # buffers it was compiled with (static addresses, frozen in), so a new cache
            # would be one it never writes to. Stale entries past the prefix are masked out.
            base = self.static_caches.get(bucket)
            if base is None:
                base = self.static_caches[bucket] = StaticCache(
                    config=self.model.config, max_cache_len=bucket
                )
            for layer in base.layers:
                if layer.is_initialized:
                    layer.cumulative_length.zero_()
        else:
            base = new_cache(self.model, need)
        return base, PreallocatedCache(1, need)

    def _next_token(self, final: torch.Tensor) -> int:
        """The base model's own token after the last of `final` (n, H) hidden states."""
        s = self.sampling
        logits = self.model.lm_head(final[-1:])[0]  # 2-D: quantized linears take no vectors
        return sample_token(logits, s.temperature, self.generator, s.typical)

    def _emit(self, out: list[int], new: list[int], max_new: int) -> str | None:
        for t in new:
            out.append(t)
            if t in self.eos:
                return "eos"
            if len(out) >= max_new:
                return "length"
        return None

    def _prompt(self, prompt) -> torch.Tensor:
        ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device).flatten()
        if ids.numel() == 0:
            raise ValueError("empty prompt: nothing to decode from")
        return ids

    # -- plain decoding ---------------------------------------------------------------------
    @torch.no_grad()
    def plain(self, prompt, max_new_tokens: int) -> Generation:
        """One base forward per token: the baseline speculative decoding must match/beat."""
        ids = self._prompt(prompt)
        L = ids.numel()
        self._check_length(L, max_new_tokens)
        t0, c0 = time.perf_counter(), self.compile_s
        cache, _ = self._caches(L, max_new_tokens)
        final, _ = self._forward(ids, torch.arange(L, device=self.device), cache)
        token = self._next_token(final)
        prefill = time.perf_counter() - t0
        out: list[int] = []
        finish = self._emit(out, [token], max_new_tokens)
        steps = 0
        while finish is None:
            pos = torch.tensor([L + steps], device=self.device)
            final, _ = self._forward(torch.tensor([token], device=self.device), pos, cache)
            steps += 1
            token = self._next_token(final)
            finish = self._emit(out, [token], max_new_tokens)
        compiling = self.compile_s - c0
        total = time.perf_counter() - t0 - compiling
        return Generation(out, finish, prefill, total, compiling, steps)

    # -- speculative decoding ---------------------------------------------------------------
    @torch.no_grad()
    def propose(self, ctx: torch.Tensor, root: int, position: int) -> torch.Tensor:
        """The tree's tokens (N,), root first, from the heads at context ctx (H,); the root
        sits at sequence position `position`."""
        tree, heads = self.tree, self.heads
        tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=self.device)
        tokens[0] = root
        for lv in tree.levels:
            k = lv.depth - 1
            if heads.uses_path:
                path = tokens[lv.parent_paths]  # (P, depth): root..parent
                cand = heads.candidates(k, ctx.expand(path.shape[0], -1), path, self.embed, lv.topk)
                tokens[lv.nodes] = cand[lv.row, lv.ranks]
            else:  # Medusa: one distribution per depth, shared by every parent
                cand = heads.candidates(k, ctx[None], None, self.embed, lv.topk)
                tokens[lv.nodes] = cand[0, lv.ranks]
        return tokens

    def _accept(self, tree: Tree, tokens: torch.Tensor, final: torch.Tensor):
        s = self.sampling
        if final.shape[0] <= self.project_all:
            # one projection of every node reads the output weights once; walking the tree
            # reads them once per accepted node (each a ~1-row matmul of the same cost)
            every = self.model.lm_head(final)

            def logits(nodes: torch.Tensor) -> torch.Tensor:
                return every[nodes]

        else:

            def logits(nodes: torch.Tensor) -> torch.Tensor:
                return self.model.lm_head(final[nodes])

        if s.acceptance == "greedy":
            return accept_greedy(tree, tokens, logits)
        if s.acceptance == "rejection":
            return accept_rejection(tree, tokens, logits, s.temperature, self.generator)
        return accept_typical(
            tree,
            tokens,
            logits,
            s.temperature,
            s.posterior_threshold,
            s.posterior_alpha,
            self.generator,
        )

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor, max_new: int) -> _State:
        dev = self.device
        L = ids.numel()
        st = _State(*self._caches(L, max_new), L)
        final, hid = self._forward(ids, torch.arange(L, device=dev), st.cache)
        st.root = self._next_token(final)
        ctx = self.heads.context(
            hid[None], cache=st.head_cache, positions=torch.arange(L, device=dev)
        )
        st.ctx = ctx[0, -1]
        return st

    @torch.no_grad()
    def _step(self, st: _State, gen: Generation) -> list[int]:
        """One propose -> verify -> accept round; returns the tokens it emits."""
        t1 = time.perf_counter()
        if self.dynamic is not None:  # this step's own tree
            tree, tokens = grow_dynamic(self.dynamic, self.heads, self.embed, st.ctx, st.root)
            bias, depth = tree_bias(tree, self.dtype, self.device), tree.depth.to(self.device)
        else:
            tree, bias, depth = self.tree, self.bias, self.depth
            tokens = self.propose(st.ctx, st.root, st.length)
        t2 = time.perf_counter()
        c0 = self.compile_s
        final, hid = self._forward(tokens, st.length + depth, st.cache, bias)
        t3 = time.perf_counter()
        compiling = self.compile_s - c0  # reported apart, not as verify time
        nodes, bonus = self._accept(tree, tokens, final)
        keep_accepted(st.cache, st.length, nodes)
        n = nodes.numel()
        pos = torch.arange(st.length, st.length + n, device=self.device)
        st.ctx = self.heads.context(hid[nodes][None], cache=st.head_cache, positions=pos)[0, -1]
        st.length += n
        st.root = bonus
        gen.steps += 1
        gen.accepted.append(n - 1)
        new = [*tokens[nodes[1:]].tolist(), bonus]
        t4 = time.perf_counter()
        gen.propose_s += t2 - t1
        gen.verify_s += t3 - t2 - compiling
        gen.bookkeeping_s += t4 - t3
        return new

    @torch.no_grad()
    def speculative(self, prompt, max_new_tokens: int) -> Generation:
        if self.tree is None and self.dynamic is None:
            raise ValueError("speculative decoding needs a tree: call set_tree first")
        if not self.speculating:  # an empty tree: speculation off, plain decoding
            gen = self.plain(prompt, max_new_tokens)
            gen.accepted = [0] * gen.steps
            gen.verify_s = gen.total_s - gen.prefill_s
            return gen
        ids = self._prompt(prompt)
        self._check_length(ids.numel(), max_new_tokens)
        t0, c0 = time.perf_counter(), self.compile_s
        st = self._prefill(ids, max_new_tokens)
        gen = Generation([], "length")
        gen.prefill_s = time.perf_counter() - t0
        finish = self._emit(gen.tokens, [st.root], max_new_tokens)
        while finish is None:
            finish = self._emit(gen.tokens, self._step(st, gen), max_new_tokens)
        gen.finish = finish
        gen.compile_s = self.compile_s - c0
        gen.total_s = time.perf_counter() - t0 - gen.compile_s
        return gen

    @torch.no_grad()
    def decode_step_seconds(
        self, prompt, new_tokens: int = 16, reps: int = 2, batch: int = 1
    ) -> float:
        """Wall time per base forward of a real decode of `new_tokens` after `prompt`: the
        speculative one with the current tree (propose, verify, accept, KV upkeep and all),
        or the plain one without a tree; with `batch` > 1, of a batch of that many copies of
        the prompt (batched decoding). The least disturbed of `reps` runs."""
        if batch > 1:
            from evaluation.batched import plain_batch, speculative_batch

            many = speculative_batch if self.speculating else plain_batch

            def fn(p, n):  # one Generation holding the batch's totals
                gens = many(self, [p] * batch, n)
                g = Generation([], "length", steps=max(x.steps for x in gens))
                g.total_s = sum(x.total_s for x in gens)
                g.prefill_s = sum(x.prefill_s for x in gens)
                return g
        else:
            fn = self.speculative if self.speculating else self.plain
        best = float("inf")
        for _ in range(reps):
            g = fn(prompt, new_tokens)
            if g.steps:
                best = min(best, (g.total_s - g.prefill_s) / g.steps)
        return best


@dataclass
class _State:
    """What a speculative decode carries from step to step."""

    cache: object  # the base model's KV cache (accepted tokens only, root excluded)
    head_cache: KVCache  # Hydra++'s extra layer's KV cache
    length: int  # tokens in the base cache = position of the root
    root: int = 0  # the base model's own next token, already emitted, not yet in the cache
    ctx: torch.Tensor | None = None  # head context at the last cached position (H,)
