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
- Generation itself is the decoding engine's left-padded strategy
  (train/decoding/slab.py): prefill in groups, one KV cache written in place, finished rows
  leaving the batch.

With `keep_states` (prep cache_hidden=true, regen.keep_states) the base's final hidden states
over each conversation's last regenerated turn (prompt, reply and the template's tail) are
saved per shard, for hidden-state caching to take instead of running the base again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from jinja2 import TemplateError as JinjaTemplateError

from data_prep.config import RegenConfig, RegenError
from data_prep.hidden import dtype_name, save_regen_states
from data_prep.normalize import pack_extras, unpack_messages
from data_prep.openai_backend import chat_replies
from data_prep.template import template_messages
from train.core.atomic import write_json, write_text
from train.decoding.sampling import eos_ids
from train.decoding.slab import generate_left_padded

log = logging.getLogger(__name__)

OnBatch = Callable[[int, int, float], None]  # (rows, generated tokens, seconds) per batch
# A shard's turns a minute enter regen_summary's spread only from this many turns: a short last
# shard's rate is mostly its fixed costs.
RATE_MIN_TURNS = 8


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


def _check_attention(model) -> None:
    """Full and sliding-window layers regenerate exactly (transformers builds each layer kind's
    mask from the slab's 2-D mask, so a window holds over the left-padded columns); other
    layer kinds are refused by name, as the decoder refuses them."""
    from train.decoding.masks import AttentionLayout, AttentionLayoutError

    try:
        AttentionLayout(model.config)
    except AttentionLayoutError as e:
        raise RegenError(
            f"regenerate=true: {str(e).rstrip('.')}. Set regenerate=false, or use another base"
        ) from None


def generate_replies(
    base, prompts: list[list[int]], cfg: RegenConfig, on_batch: OnBatch | None = None
) -> list[list[int]]:
    """The reply token ids (EOS not included) of every prompt, in the order of `prompts`,
    batched by length (see the module docstring)."""
    return generate(base, prompts, cfg, on_batch)[0]


def generate(
    base,
    prompts: list[list[int]],
    cfg: RegenConfig,
    on_batch: OnBatch | None = None,
    tails: list[list[int] | None] | None = None,
) -> tuple[list[list[int]], list[np.ndarray | None]]:
    """generate_replies' replies, and with `tails` each prompt's hidden states over prompt +
    reply + tail (train/decoding/slab.py; None where its tail is None or without `tails`)."""
    _check_attention(base.model)
    tok = base.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = eos_ids(base.tokenizer, base.model)
    replies: list[list[int]] = [[] for _ in prompts]
    states: list[np.ndarray | None] = [None for _ in prompts]
    lengths = [len(p) for p in prompts]
    for batch in plan_batches(lengths, cfg.max_new_tokens, cfg.batch_size, cfg.batch_tokens):
        t0 = time.perf_counter()
        out = generate_left_padded(
            base.model,
            [prompts[i] for i in batch],
            cfg.max_new_tokens,
            eos,
            pad,
            cfg.temperature,
            cfg.top_p,
            None if tails is None else [tails[i] for i in batch],
        )
        out, got = out if tails is not None else (out, [None] * len(batch))
        for i, ids, st in zip(batch, out, got, strict=True):
            replies[i] = ids[:-1] if ids and ids[-1] in eos else ids
            states[i] = st
        if on_batch is not None:
            on_batch(len(batch), sum(len(o) for o in out), time.perf_counter() - t0)
    return replies, states


def reply_tail(tokenizer, history: list[dict], prompt: list[int]) -> list[int] | None:
    """The tokens the chat template puts after an assistant reply to `history` (whose prompt,
    turn_prompt's, is `prompt`): SmolLM2's `<|im_end|>` and a newline. None where the template
    does not render a reply as the prompt, then the reply's own tokens, then the tail (one
    that rewrites the history once a reply follows, say): that turn's states are not kept."""
    probe = "Hello"
    try:
        ids = _template_ids(tokenizer, [*history, {"role": "assistant", "content": probe}], False)
    except JinjaTemplateError:  # a template that refuses this history followed by a reply
        return None
    probe_ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    n, k = len(prompt), len(probe_ids)
    if ids[:n] != prompt or ids[n : n + k] != probe_ids:
        return None
    return ids[n + k :]


# How a server's replies are fetched, not what they are, whether the states are kept (a
# shard without them has its samples cached by the base) and which tokens the samples take
# (tokenizing reads it): changing these keeps finished shards.
_OPERATIONAL = (
    "url", "concurrency", "timeout_s", "retries", "backoff_s", "api_key_env", "keep_states",
    "token_ids",
)  # fmt: skip


def _manifest(rows: list[dict], cfg: RegenConfig, base_name: str, seed: int) -> dict:
    h = hashlib.sha256()
    for r in rows:
        h.update(r["key"].encode())
    regen = {k: v for k, v in cfg.to_dict().items() if k not in _OPERATIONAL}
    return {
        # 2: tool calls and reasoning stay in the history (1 kept roles and contents only)
        "history": 2,
        "conversations": len(rows),
        "keys_sha256": h.hexdigest(),
        "base": base_name,
        "seed": seed,
        "regen": regen,
    }


def _messages(row: dict) -> list[dict]:
    return unpack_messages(row["roles"], row["contents"], row.get("extras"))


def _targets(msgs: list[dict], cfg: RegenConfig) -> list[int]:
    """Indices of the assistant turns to regenerate: every reply, but not a turn that calls
    tools (its calls and their results stay as the history the next reply answers)."""
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and not m.get("tool_calls")]
    return turns if cfg.max_turns is None else turns[: cfg.max_turns]


def _planned_turns(row: dict, cfg: RegenConfig) -> int:
    return len(_targets(_messages(row), cfg))


class _Progress:
    """The regeneration bar: turns done (skipped ones too) and generated tokens/s per batch."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="regenerating", unit=" turn")
        self.tokens = 0
        self.seconds = 0.0
        self.prompt_tokens = 0  # of the prompts this run regenerated from
        self.shards: list[dict] = []  # this run's shards, as they finish (`shard_done`)
        self._at = (0, 0, 0.0, time.perf_counter())  # counters when the current shard began

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

    def shard_done(self, shard: int, turns: int) -> None:
        """Record shard `shard`'s figures (`turns` regenerated), counted since shard_start:
        its wall time holds the states' and the shard's writing, its generation seconds the
        batches alone."""
        prompts, tokens, seconds, t0 = self._at
        now = time.perf_counter()
        self.shards.append(
            {
                "shard": shard,
                "turns": turns,
                "prompt_tokens": self.prompt_tokens - prompts,
                "generated_tokens": self.tokens - tokens,
                "generation_s": round(self.seconds - seconds, 2),
                "wall_s": round(now - t0, 2),
            }
        )

    def shard_start(self) -> None:
        self._at = (self.prompt_tokens, self.tokens, self.seconds, time.perf_counter())


def regen_summary(rows: list[dict], shards: int, resumed: int, progress: _Progress) -> dict:
    """What a regeneration produced (prep_stats.json's `regeneration`): the conversations with
    at least one regenerated turn, their regenerated turns and reply tokens (all shards,
    resumed ones too; `untracked_conversations`: from shards written before reply tokens were
    recorded), and this run's own generation: the tokens it generated (end-of-turn tokens and
    replies dropped as empty too), the prompt tokens it generated them after (prefilled by the
    local base; a server's prompts as the template renders them here), the seconds it spent
    generating and their rate (0 where every shard was resumed), and per shard it wrote
    (`shards_run`) those figures with its wall time, whose turns a minute (`shard_turns_per_min`:
    min, median, max over shards of at least RATE_MIN_TURNS turns) show whether the rate held
    over the run."""
    done = [r for r in rows if r.get("regenerated_turns", 0)]
    summary = {
        "conversations": len(done),
        "turns": sum(r["regenerated_turns"] for r in done),
        "reply_tokens": sum(r.get("reply_tokens", 0) for r in done),
        "shards": shards,
        "shards_resumed": resumed,
        "generated_tokens": progress.tokens,
        "generation_s": round(progress.seconds, 1),
        "tokens_per_s": round(progress.tokens / progress.seconds, 1) if progress.seconds else 0.0,
        "prompt_tokens": progress.prompt_tokens,
        "shards_run": progress.shards,
    }
    timed = [x for x in progress.shards if x["turns"] >= RATE_MIN_TURNS and x["wall_s"]]
    rates = sorted(60 * x["turns"] / x["wall_s"] for x in timed)
    if rates:
        summary["shard_turns_per_min"] = {
            "min": round(rates[0], 1),
            "median": round(statistics.median(rates), 1),
            "max": round(rates[-1], 1),
        }
    untracked = sum("reply_tokens" not in r for r in done)
    if untracked:
        summary["untracked_conversations"] = untracked
    return summary


def turn_prompt(tokenizer, history: list[dict]) -> list[int]:
    """Token ids of the chat `history` plus the assistant-turn opener. Tool calls and reasoning
    in the history reach the model as training renders them (template_messages: inlined where
    the chat template does not read them)."""
    return _template_ids(tokenizer, history, True)


def _template_ids(tokenizer, msgs: list[dict], opener: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        template_messages(tokenizer, msgs),
        add_generation_prompt=opener,
        tokenize=True,
        return_dict=False,
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _replies(base, group: list[dict], prompts, step: int, cfg: RegenConfig, progress, tails):
    """This turn step's replies, (text or None, why not, the states over prompt + reply + tail
    or None, the reply's token ids or None), from the base in this process or from the
    OpenAI-compatible server (which gets the chat so far and applies the template; no states,
    no token ids). The states are of `prompt + reply ids + tail`: _regen_shard pairs them."""
    if not prompts:
        return []
    if cfg.backend == "openai":
        t0 = time.perf_counter()
        out = chat_replies([c["msgs"][: c["turns"][step]] for c in group], cfg)
        tokens = sum(
            len(base.tokenizer(t, add_special_tokens=False)["input_ids"]) for t, _ in out if t
        )
        progress.batch(len(group), tokens, time.perf_counter() - t0)
        return [(t, why, None, None) for t, why in out]
    ids, states = generate(base, prompts, cfg, progress.batch, tails)
    decode = base.tokenizer.decode
    return [
        (decode(x, skip_special_tokens=True), "", st, x) for x, st in zip(ids, states, strict=True)
    ]


def _regen_shard(
    rows: list[dict], base, cfg: RegenConfig, progress: _Progress, keep_states: bool = False
) -> tuple[list[dict], list[tuple[str, np.ndarray, np.ndarray]]]:
    """Regenerate every assistant turn of `rows`, turn by turn, batching across conversations.
    Returns the rows and (keep_states) each conversation's (key, token ids, hidden states) of
    its last regenerated turn: the whole conversation as the template renders it.

    Each row from the local base also records the token ids its last regenerated turn ran
    over, `token_ids` (prompt + the reply as generated + the template's tail), with the
    reply's [start, end) in `reply_at`: the sample `regen.token_ids` trains on. The prompt
    holds the earlier replies as the template renders their text, as a chat server is fed
    them back. Both are empty from a server, or where reply_tail finds the template renders
    the history otherwise once a reply follows."""
    tok = base.tokenizer
    limit = getattr(base.config, "max_position_embeddings", None)
    if limit is not None:
        limit -= cfg.max_new_tokens  # the reply must fit in the context too
    if cfg.max_prompt_tokens is not None:
        limit = cfg.max_prompt_tokens if limit is None else min(limit, cfg.max_prompt_tokens)
    local = cfg.backend == "local"
    keep_states = keep_states and local
    convs = []
    for r in rows:
        msgs = _messages(r)
        turns = _targets(msgs, cfg)
        convs.append({"row": r, "msgs": msgs, "turns": turns, "done": 0, "stop": None, "n": 0})
    step = 0
    while True:
        active = [c for c in convs if c["stop"] is None and step < len(c["turns"])]
        if not active:
            break
        group, prompts, tails = [], [], []
        for c in active:
            idx = c["turns"][step]
            p = turn_prompt(tok, c["msgs"][:idx])
            if limit is not None and len(p) > limit:
                c["stop"] = "prompt_too_long"  # keep the turns before this one
                progress.skip(len(c["turns"]) - step)
                continue
            group.append(c)
            prompts.append(p)
            if local:
                tails.append(reply_tail(tok, c["msgs"][:idx], p))
        progress.prompt_tokens += sum(len(p) for p in prompts)
        texts = _replies(base, group, prompts, step, cfg, progress, tails if keep_states else None)
        for i, (c, (text, why, st, x)) in enumerate(zip(group, texts, strict=True)):
            idx = c["turns"][step]
            reply = (text or "").strip()
            if not reply:
                c["stop"] = why or "empty_reply"  # the conversation ends before this turn
                progress.skip(len(c["turns"]) - step - 1)
                continue
            c["msgs"][idx] = {"role": "assistant", "content": reply}
            c["done"] += 1
            # its length as generated (a server's reply: as its kept text tokenizes)
            c["n"] += (
                len(x) if x is not None else len(tok(reply, add_special_tokens=False).input_ids)
            )
            tail, p = tails[i] if local else None, prompts[i]
            # the tokens this turn ran over; its prompt holds the earlier replies as text
            ids = None if x is None or tail is None else p + x + tail
            c["ids"] = None if ids is None else (ids, len(p), len(p) + len(x))
            # its states (kept where a tail is: over those tokens) cover the earlier turns'
            c["kept"] = None if st is None else (np.asarray(ids, dtype=np.int32), st)
        step += 1
    out, kept = [], []
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
                "extras": pack_extras(msgs),  # the history's tool calls and reasoning
                "regenerated_turns": c["done"],
                "reply_tokens": c["n"],  # over its regenerated turns
                "stop": c["stop"],
                "token_ids": c["ids"][0] if c.get("ids") else [],
                "reply_at": list(c["ids"][1:]) if c.get("ids") else [],
            }
        )
        if c.get("kept") is not None:
            kept.append((r["key"], *c["kept"]))
    return out, kept


def regenerate(
    rows: list[dict],
    base,
    cfg: RegenConfig,
    workdir: Path,
    seed: int = 0,
    skips=None,
    keep_states: bool = False,
    stats: dict | None = None,
) -> list[dict]:
    """Replace assistant turns in `rows` by the base model's own replies.

    Work is cut into shards of `cfg.shard_size` conversations; each finished shard is written
    atomically to `workdir`, so a killed job resumes at the first missing shard. A conversation
    ends before a turn whose reply comes back empty or whose prompt is too long (over
    `cfg.max_prompt_tokens`, or no room for the reply in the context); one left without a turn
    is dropped, counted as 'regen_empty_reply' or 'regen_prompt_too_long'.

    keep_states (prep cache_hidden=true, the local backend): each shard's hidden states of its
    conversations as regenerated, the base's own over every token of the last regenerated
    turn's prompt, reply and the chat template's tail after it, are saved beside it
    (`states-<shard>/`, before the shard itself), for caching to take instead of running the
    base over those samples again. A shard's states are held in memory until it is written:
    shard_size x tokens x hidden size x 2 bytes (a smaller regen.shard_size for a large base).

    `stats`, where given, is filled with what was regenerated (`regen_summary`).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(rows, cfg, base.cfg.name, seed)
    mpath = workdir / "manifest.json"
    if mpath.exists() and json.loads(mpath.read_text()) != manifest:
        log.warning("regeneration inputs changed since the last run; discarding %s", workdir)
        shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
    write_json(mpath, manifest)
    for stale in workdir.glob(".states-*"):  # a killed run's half-written or replaced states
        shutil.rmtree(stale, ignore_errors=True)
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
            progress.shard_start()
            shard, kept = _regen_shard(shard_rows, base, cfg, progress, keep_states)
            if kept:  # first: a shard that exists has its states saved, if it kept any
                save_regen_states(workdir / f"states-{s:05d}", kept, dtype_name(base.model))
            write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in shard))
            progress.shard_done(s, sum(r["regenerated_turns"] for r in shard))
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
    if stats is not None:
        stats.update(regen_summary(result, n_shards, done, progress))
    kept, cut = [], Counter()
    for r in result:
        if r.get("stop") and r.get("regenerated_turns", 0):
            cut[r["stop"]] += 1
        if r.get("regenerated_turns", 0) == 0:
            if skips is not None:
                skips.skip(f"regen_{r['stop']}", f"conversation {r['conv_id']}")
            continue
        r.pop("regenerated_turns", None)
        r.pop("reply_tokens", None)
        r.pop("stop", None)
        r.setdefault("token_ids", [])  # a shard written before they were recorded
        r.setdefault("reply_at", [])
        kept.append(r)
    no_ids = sum(not r["token_ids"] for r in kept)
    if no_ids and cfg.backend == "local":
        log.warning(
            "%d of %d regenerated conversations have no recorded token ids (shards written "
            "before they were, or a template that renders the history otherwise once a reply "
            "follows): with regen.token_ids their samples take their text's tokens",
            no_ids,
            len(kept),
        )
    if cut and skips is not None:  # kept, with the turns before the one that failed
        skips.warn(
            f"regeneration cut {sum(cut.values())} conversation(s) short before a turn: "
            + ", ".join(f"{n} {why}" for why, n in sorted(cut.items()))
        )
    return kept
