"""Self-distillation data: regenerate assistant turns with the base model, resumable by shard.

Speed on CPU comes from these choices (evaluation/benchmarks/bench_regen.py measures the
whole against batch-1 `model.generate` and against `model.generate` on the same batches):

- Batches by length. The prompts of one turn step (every conversation's first reply, then every
  second reply, ...) are sorted by token length, longest first, and cut greedily into batches of
  at most `regen.batch_size` rows whose cache, rows x (longest prompt + max_new_tokens), stays
  within `regen.batch_tokens`. Neighbours in length pad little, and a long prompt shares its batch
  only with prompts almost as long (alone when it fills the budget), so it never drags short
  ones through thousands of padding positions. The budget also bounds memory and the per-step
  attention work, which grows with rows x context.
- Prefill in small groups. Rows are prefilled in groups of at most PREFILL_TOKENS padded tokens
  and PREFILL_PAD padding per row (a prompt longer than that alone, unpadded, so attention takes
  SDPA's causal kernel instead of a materialised rows x T x T mask), then copied into the
  batch's left-padded cache.
- A preallocated KV cache. transformers' DynamicCache concatenates, copying the whole cache at
  every decode step; here each step writes its one column in place.
- Finished rows leave, in steps of ROW_STEP rows: once the rows still generating fit in fewer
  steps, the batch shrinks to them (plus finished rows as ballast up to a whole step), and the
  leading columns that are padding in every kept row are cut, so a long prompt that finished
  early stops costing attention. Measured at max_new_tokens=128 (most replies run to the
  limit) it changes nothing (48 rows, within 2%), and dropping rows one at a time was 15%
  slower on 16 rows: on this CPU a matmul over 13 rows takes longer than over 16. It is there
  for longer replies, whose lengths vary more.

Left padding with the attention mask and explicit position ids (0 at each row's first real
token) make a row's greedy reply the same as batch-1 `model.generate` up to float noise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from data_prep.config import RegenConfig
from evaluation.decode import eos_ids
from evaluation.verify import cache_kwarg
from train.core.atomic import write_json, write_text
from train.core.errors import UserError

log = logging.getLogger(__name__)

# Padded tokens per prefill forward: on one CPU core SmolLM2's prefill throughput stops growing
# near 1k tokens per forward (~450 tokens/s), and this bounds a padded group's attention scores
# (rows x T x T).
PREFILL_TOKENS = 2048
# Padding a row by up to this many tokens costs less than the fixed cost of one more prefill
# forward (measured there: a batch-1 forward of 64 tokens runs at half the batched rate).
PREFILL_PAD = 64
# Finished rows leave the batch in whole steps of this many rows (see generate_batch).
ROW_STEP = 8

OnBatch = Callable[[int, int, float], None]  # (rows, generated tokens, seconds) per batch


class RegenError(UserError, RuntimeError):
    """Regeneration cannot run with this base model; the message says why."""


def plan_batches(
    lengths: list[int], max_new_tokens: int, batch_size: int, batch_tokens: int
) -> list[list[int]]:
    """Indices into `lengths`, longest first, cut into batches of at most `batch_size` rows
    whose cache, rows x (longest prompt + max_new_tokens), fits `batch_tokens` (a prompt that
    alone exceeds the budget runs alone). Longest first: a batch that runs out of memory does so
    at once, and the progress bar's rate is not flattered by the short prompts."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties in data order
    batches: list[list[int]] = []
    for i in order:
        cur = batches[-1] if batches else None
        width = lengths[cur[0]] + max_new_tokens if cur else 0  # cur[0] is its longest prompt
        if cur and len(cur) < batch_size and (len(cur) + 1) * width <= batch_tokens:
            cur.append(i)
        else:
            batches.append([i])
    return batches


class _SlabLayer(DynamicLayer):
    """One layer's KV cache in a preallocated (rows, kv_heads, capacity, head_dim) buffer; the
    live part is the first `rows` rows and columns [start, end). A decode step writes its column
    in place; dropping rows moves the kept ones up in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: int, end: int):
        super().__init__()
        self.buf_k, self.buf_v = keys, values
        self.rows, self.start, self.end = keys.shape[0], start, end
        self.is_initialized = True
        self.device, self.dtype = keys.device, keys.dtype
        self._view()

    def _view(self) -> None:
        self.keys = self.buf_k[: self.rows, :, self.start : self.end]
        self.values = self.buf_v[: self.rows, :, self.start : self.end]

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        self.buf_k[: self.rows, :, self.end : self.end + n] = key_states
        self.buf_v[: self.rows, :, self.end : self.end + n] = value_states
        self.end += n
        self._view()
        return self.keys, self.values

    def keep(self, rows: torch.Tensor, lead: int) -> None:
        """Keep `rows` (ascending) only and drop the first `lead` live columns (padding in every
        kept row)."""
        self.start += lead
        for buf in (self.buf_k, self.buf_v):
            live = buf[:, :, self.start : self.end]
            live[: len(rows)] = live[rows]  # the gather copies first, so the overlap is safe
        self.rows = len(rows)
        self._view()


def _slab_cache(prefills: list[tuple[list[int], Cache]], rows: int, width: int, capacity: int):
    """A cache of `rows` left-padded rows `width` wide (room for `capacity`), filled from the
    prefill groups' caches: (batch rows of the group, its DynamicCache) pairs."""
    layers = []
    first = prefills[0][1].layers
    for li, ref in enumerate(first):
        _, heads, _, dim = ref.keys.shape
        # zeros, not empty: padding columns are masked, but NaN garbage would survive 0 * NaN
        k = ref.keys.new_zeros(rows, heads, capacity, dim)
        v = ref.values.new_zeros(rows, heads, capacity, dim)
        for idx, cache in prefills:
            src = cache.layers[li]
            w = src.keys.shape[-2]  # the group's own padded width, right-aligned in the batch
            k[idx, :, width - w : width] = src.keys
            v[idx, :, width - w : width] = src.values
        layers.append(_SlabLayer(k, v, 0, width))
    return Cache(layers=layers)


def _check_full_attention(model) -> None:
    layers = DynamicCache(config=model.config).layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        raise RegenError(
            f"regenerate=true supports bases whose every layer uses full attention (Llama-like); "
            f"{type(model).__name__} has sliding-window or other cache layers. Set "
            "regenerate=false, or regenerate with another base."
        )


def _pick(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Next token per row from (B, V) logits: argmax at temperature 0, else nucleus sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        p, order = probs.sort(dim=-1, descending=True)
        # drop a token once the likelier ones already cover top_p (the likeliest always stays)
        p = p.masked_fill(p.cumsum(-1) - p >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, p)
    return torch.multinomial(probs, 1)[:, 0]


def _left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """0 at each row's first real token (padding gets 0 too; it is masked anyway)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _forward(model, ids, mask, positions, cache) -> torch.Tensor:
    """Logits (B, V) at the last position of `ids` (B, T), appending to `cache`; the lm_head
    runs on that position only."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg(type(model)): cache},
    )
    return out.logits[:, -1]


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: set[int],
    pad: int,
    temperature: float,
    top_p: float,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` after each prompt, batched; a row stops after its first
    EOS token (kept as its last token, as `model.generate` does) and soon leaves the batch."""
    device = model.device
    width = max(len(p) for p in prompts)
    rows = len(prompts)
    # Prefill groups, longest first: a row joins while the group's padded size fits
    # PREFILL_TOKENS and padding it costs less than another forward would.
    groups: list[list[int]] = []
    for i in sorted(range(rows), key=lambda i: -len(prompts[i])):
        g = groups[-1] if groups else None
        longest = len(prompts[g[0]]) if g else 0
        if (
            g
            and (len(g) + 1) * longest <= PREFILL_TOKENS
            and longest - len(prompts[i]) <= PREFILL_PAD
        ):
            g.append(i)
        else:
            groups.append([i])
    last = None
    prefills = []
    for g in groups:
        ids, mask = _left_pad([prompts[i] for i in g], pad, device)
        cache = DynamicCache(config=model.config)
        logits = _forward(model, ids, mask, _positions(mask), cache)
        if last is None:
            last = logits.new_empty(rows, logits.shape[-1])
        last[g] = logits
        prefills.append((g, cache))
    cache = _slab_cache(prefills, rows, width, width + max_new_tokens)
    _, attn = _left_pad(prompts, pad, device)  # (B, L): 1 on real tokens
    pos = attn.sum(-1)  # (B,) position of each row's next token
    owner = torch.arange(rows, device=device)  # batch row -> prompt index
    going = torch.ones(rows, dtype=torch.bool, device=device)  # rows still generating
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    out_tokens: list[list[int]] = [[] for _ in prompts]
    logits = last
    for step in range(max_new_tokens):
        nxt = _pick(logits, temperature, top_p)  # (B,)
        for r, t, g in zip(owner.tolist(), nxt.tolist(), going.tolist(), strict=True):
            if g:
                out_tokens[r].append(t)
        if step == max_new_tokens - 1:
            break
        going &= ~torch.isin(nxt, eos_t)
        alive = int(going.sum())
        if alive == 0:
            break
        # Finished rows leave in whole steps of ROW_STEP rows: a matmul over 13 rows costs
        # more than over 16 here, so the rest of a step's rows keep generating as ballast.
        target = -(-alive // ROW_STEP) * ROW_STEP
        if target < len(owner):
            keep = torch.cat([going.nonzero()[:, 0], (~going).nonzero()[:, 0]])[:target]
            keep = keep.sort().values
            owner, going, nxt, pos, attn = (x[keep] for x in (owner, going, nxt, pos, attn))
            # columns that are padding in every remaining row: the longest prompt may be gone
            lead = int((attn.shape[1] - attn.sum(-1)).min())
            attn = attn[:, lead:]
            for layer in cache.layers:
                layer.keep(keep, lead)
        attn = torch.cat([attn, attn.new_ones(len(owner), 1)], dim=1)
        logits = _forward(model, nxt[:, None], attn, pos[:, None], cache)
        pos = pos + 1
    return out_tokens


def generate_replies(
    base, prompts: list[list[int]], cfg: RegenConfig, on_batch: OnBatch | None = None
) -> list[list[int]]:
    """The reply token ids (EOS not included) of every prompt, in the order of `prompts`,
    batched by length (see the module docstring)."""
    _check_full_attention(base.model)
    tok = base.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = eos_ids(base.tokenizer, base.model)
    replies: list[list[int]] = [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    for batch in plan_batches(lengths, cfg.max_new_tokens, cfg.batch_size, cfg.batch_tokens):
        t0 = time.perf_counter()
        out = generate_batch(
            base.model,
            [prompts[i] for i in batch],
            cfg.max_new_tokens,
            eos,
            pad,
            cfg.temperature,
            cfg.top_p,
        )
        for i, ids in zip(batch, out, strict=True):
            replies[i] = ids[:-1] if ids and ids[-1] in eos else ids
        if on_batch is not None:
            on_batch(len(batch), sum(len(o) for o in out), time.perf_counter() - t0)
    return replies


# How a server's replies are fetched, not what they are: changing these keeps finished shards.
_OPERATIONAL = ("url", "concurrency", "timeout_s", "retries", "backoff_s", "api_key_env")


def _manifest(rows: list[dict], cfg: RegenConfig, base_name: str, seed: int) -> dict:
    h = hashlib.sha256()
    for r in rows:
        h.update(r["key"].encode())
    regen = {k: v for k, v in cfg.to_dict().items() if k not in _OPERATIONAL}
    return {
        "conversations": len(rows),
        "keys_sha256": h.hexdigest(),
        "base": base_name,
        "seed": seed,
        "regen": regen,
    }


def _planned_turns(row: dict, cfg: RegenConfig) -> int:
    n = sum(role == "assistant" for role in row["roles"])
    return n if cfg.max_turns is None else min(n, cfg.max_turns)


class _Progress:
    """The regeneration bar: turns done (skipped ones too) and generated tokens/s per batch."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="regenerating", unit=" turn")
        self.tokens = 0
        self.seconds = 0.0

    def batch(self, rows: int, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.bar.set_postfix(
            batch=rows,
            tok_s=f"{tokens / max(seconds, 1e-9):.1f}",
            avg_tok_s=f"{self.tokens / max(self.seconds, 1e-9):.1f}",
            refresh=False,
        )
        self.bar.update(rows)

    def skip(self, turns: int) -> None:
        if turns:
            self.bar.update(turns)


def turn_prompt(tokenizer, history: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat `history` (role/content dicts) plus the assistant-turn opener."""
    ids = tokenizer.apply_chat_template(
        history, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _replies(base, group: list[dict], prompts, step: int, cfg: RegenConfig, progress):
    """This turn step's replies, (text or None, why not), from the base in this process or
    from the OpenAI-compatible server (which gets the chat so far and applies the template)."""
    if not prompts:
        return []
    if cfg.backend == "openai":
        from data_prep.openai_backend import chat_replies

        t0 = time.perf_counter()
        out = chat_replies([c["msgs"][: c["turns"][step]] for c in group], cfg)
        tokens = sum(
            len(base.tokenizer(t, add_special_tokens=False)["input_ids"]) for t, _ in out if t
        )
        progress.batch(len(group), tokens, time.perf_counter() - t0)
        return out
    ids = generate_replies(base, prompts, cfg, progress.batch)
    return [(base.tokenizer.decode(x, skip_special_tokens=True), "") for x in ids]


def _regen_shard(rows: list[dict], base, cfg: RegenConfig, progress: _Progress) -> list[dict]:
    """Regenerate every assistant turn of `rows`, turn by turn, batching across conversations."""
    tok = base.tokenizer
    limit = getattr(base.config, "max_position_embeddings", None)
    if limit is not None:
        limit -= cfg.max_new_tokens  # the reply must fit in the context too
    if cfg.max_prompt_tokens is not None:
        limit = cfg.max_prompt_tokens if limit is None else min(limit, cfg.max_prompt_tokens)
    convs = []
    for r in rows:
        msgs = [{"role": a, "content": c} for a, c in zip(r["roles"], r["contents"], strict=True)]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if cfg.max_turns is not None:
            turns = turns[: cfg.max_turns]
        convs.append({"row": r, "msgs": msgs, "turns": turns, "done": 0, "stop": None})
    step = 0
    while True:
        active = [c for c in convs if c["stop"] is None and step < len(c["turns"])]
        if not active:
            break
        group, prompts = [], []
        for c in active:
            idx = c["turns"][step]
            p = turn_prompt(tok, c["msgs"][:idx])
            if limit is not None and len(p) > limit:
                c["stop"] = "prompt_too_long"  # keep the turns before this one
                progress.skip(len(c["turns"]) - step)
                continue
            group.append(c)
            prompts.append(p)
        texts = _replies(base, group, prompts, step, cfg, progress)
        for c, (text, why) in zip(group, texts, strict=True):
            idx = c["turns"][step]
            reply = (text or "").strip()
            if not reply:
                c["stop"] = why or "empty_reply"  # the conversation ends before this turn
                progress.skip(len(c["turns"]) - step - 1)
                continue
            c["msgs"][idx] = {"role": "assistant", "content": reply}
            c["done"] += 1
        step += 1
    out = []
    for c in convs:
        # Keep the conversation up to its last regenerated reply.
        end = c["turns"][c["done"] - 1] + 1 if c["done"] else 0
        msgs = c["msgs"][:end]
        r = c["row"]
        out.append(
            {
                "conv_id": r["conv_id"],
                "key": r["key"],
                "roles": [m["role"] for m in msgs],
                "contents": [m["content"] for m in msgs],
                "regenerated_turns": c["done"],
                "stop": c["stop"],
            }
        )
    return out


def regenerate(
    rows: list[dict], base, cfg: RegenConfig, workdir: Path, seed: int = 0, skips=None
) -> list[dict]:
    """Replace assistant turns in `rows` by the base model's own replies.

    Work is cut into shards of `cfg.shard_size` conversations; each finished shard is written
    atomically to `workdir`, so a killed job resumes at the first missing shard. A conversation
    ends before a turn whose reply comes back empty or whose prompt is too long (over
    `cfg.max_prompt_tokens`, or no room for the reply in the context); one left without a turn
    is dropped, counted as 'regen_empty_reply' or 'regen_prompt_too_long'.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(rows, cfg, base.cfg.name, seed)
    mpath = workdir / "manifest.json"
    if mpath.exists() and json.loads(mpath.read_text()) != manifest:
        log.warning("regeneration inputs changed since the last run; discarding %s", workdir)
        shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
    write_json(mpath, manifest)
    n_shards = (len(rows) + cfg.shard_size - 1) // cfg.shard_size
    done = sum((workdir / f"shard-{s:05d}.jsonl").exists() for s in range(n_shards))
    if done:
        log.info("resuming regeneration: %d of %d shards already done", done, n_shards)
    progress = _Progress(sum(_planned_turns(r, cfg) for r in rows))
    result: list[dict] = []
    for s in range(n_shards):
        path = workdir / f"shard-{s:05d}.jsonl"
        shard_rows = rows[s * cfg.shard_size : (s + 1) * cfg.shard_size]
        if path.exists():
            progress.skip(sum(_planned_turns(r, cfg) for r in shard_rows))
        else:
            torch.manual_seed(seed * 1_000_003 + s)  # per-shard seed: resume == uninterrupted
            shard = _regen_shard(shard_rows, base, cfg, progress)
            write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in shard))
        with open(path, encoding="utf-8") as f:
            result.extend(json.loads(line) for line in f)
    progress.bar.close()
    if progress.seconds:
        log.info(
            "regenerated %d tokens in %.0f s of generation (%.1f tokens/s)",
            progress.tokens,
            progress.seconds,
            progress.tokens / progress.seconds,
        )
    kept, cut = [], Counter()
    for r in result:
        if r.get("stop") and r.get("regenerated_turns", 0):
            cut[r["stop"]] += 1
        if r.get("regenerated_turns", 0) == 0:
            if skips is not None:
                skips.skip(f"regen_{r['stop']}", f"conversation {r['conv_id']}")
            continue
        r.pop("regenerated_turns", None)
        r.pop("stop", None)
        kept.append(r)
    if cut and skips is not None:  # kept, with the turns before the one that failed
        skips.warn(
            f"regeneration cut {sum(cut.values())} conversation(s) short before a turn: "
            + ", ".join(f"{n} {why}" for why, n in sorted(cut.items()))
        )
    return kept
