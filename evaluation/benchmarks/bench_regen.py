"""Compare self-distillation's batched generation with plain batch-1 `model.generate` on SmolLM2.

Usage: python evaluation/benchmarks/bench_regen.py [--prompts 16] [--max-new-tokens 128]
       [--batch-size B] [--batch-tokens T] [--threads N] [--skip-generate-batched] [--bf16]
       [--keep-states]

The prompts are the first assistant turns of the first `--prompts` bundled ShareGPT
conversations, read and templated the way `hydra-heads prep regenerate=true` does (data order,
so the long-prompt tail is in the sample). Greedy, one pass each, measured in one run:

  (a) model.generate at batch 1, KV cache on: the reference;
  (b) data_prep.regenerate.generate_replies: length-sorted batches, in-place KV cache,
      finished rows leave the batch, the base's linears as regen.weight_layout says (what
      prep runs; oneDNN-packed weights by default), and (b') the same with torch's own
      (standard) weights, to show what the packed copies buy;
  (c) model.generate on (b)'s batches: the same batching, but every row decodes until the
      batch's last row finishes, with transformers' concatenating cache (isolates the loop);
  (d) model.generate on batches of 8 in data order: regeneration before length batching;
  (e) with --bf16: (b) on a bf16 copy of the base (`prep base.dtype=bfloat16`, its weights
      packed as (b)'s): on a CPU with bf16 units (AVX512-BF16 / AMX) or a GPU. Its replies are
      the bf16 base's greedy replies, so "same as (a)" measures how far they are from float32's;
  (f) with --keep-states: (b) keeping the hidden states that caching takes
      (`regen.keep_states`, prep's default with cache_hidden=true): each finished row is fed
      the chat template's tail before it leaves. Its replies should be (b)'s.

tokens/s counts reply tokens (EOS left out) over the whole pass, prefill included. "same as
(a)" is the share of replies identical to batch-1 greedy token for token (float noise in
padded batches can flip a near-tie). Under load from other jobs, --threads 1 avoids
OpenMP spin-waits that can slow every forward by 10x or more; the ratios hold either way.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from data_prep.config import PrepConfig, RegenConfig  # noqa: E402
from data_prep.prepare import read_conversations  # noqa: E402
from data_prep.regenerate import (  # noqa: E402
    generate,
    generate_replies,
    plan_batches,
    reply_tail,
    turn_prompt,
)
from train.core.base import load_base  # noqa: E402
from train.core.config import compose, load  # noqa: E402
from train.core.readers import SkipLog  # noqa: E402
from train.decoding.backend import use_weight_layout  # noqa: E402
from train.decoding.sampling import eos_ids  # noqa: E402

OLD_BATCH_SIZE = 8  # regen.batch_size before length batching


@dataclass
class Result:
    """One measured row of the table."""

    name: str
    replies: list[list[int]]
    seconds: float
    batches: int

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.replies)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def first_turn_prompts(cfg: PrepConfig, base, n: int) -> list[list[int]]:
    """The first-reply prompts of the first `n` conversations that prep reads (data order)
    whose prompt leaves room for max_new_tokens in the model's context, as prep skips the
    others."""
    limit = base.config.max_position_embeddings
    rows, _ = read_conversations(cfg.data, SkipLog())
    prompts = []
    for r in rows:
        msgs = [{"role": a, "content": c} for a, c in zip(r["roles"], r["contents"], strict=True)]
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        p = turn_prompt(base.tokenizer, msgs[:first])
        if len(p) + cfg.regen.max_new_tokens <= limit:
            prompts.append(p)
        if len(prompts) == n:
            break
    return prompts


def hf_generate(base, batches: list[list[list[int]]], max_new_tokens: int) -> list[list[int]]:
    """Greedy `model.generate` over left-padded batches; replies without EOS and padding."""
    tok, eos = base.tokenizer, eos_ids(base.tokenizer, base.model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    replies = []
    for prompts in batches:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = base.model.generate(
            input_ids=ids.to(base.model.device),
            attention_mask=mask.to(base.model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
            use_cache=True,
        )
        for row in out[:, width:].tolist():
            stop = next((j for j, t in enumerate(row) if t in eos), len(row))
            replies.append(row[:stop])
    return replies


def timed(name: str, fn, batches: int) -> Result:
    t0 = time.perf_counter()
    replies = fn()
    seconds = time.perf_counter() - t0
    print(f"  {name}: {seconds:.1f} s", flush=True)
    return Result(name, replies, seconds, batches)


def as_prep_runs(base, cfg: RegenConfig, dtype: torch.dtype | None = None):
    """The base as prep runs it: its own copy of the model (in `dtype`, as `base.dtype`
    sets it), its linears in regen.weight_layout."""
    prep_base = copy.copy(base)
    prep_base.model = copy.deepcopy(base.model)
    if dtype is not None:
        prep_base.model = prep_base.model.to(dtype)
    use_weight_layout(prep_base.model, layout=cfg.weight_layout)
    return prep_base


def run(
    base,
    prompts: list[list[int]],
    cfg: RegenConfig,
    with_batched_generate: bool,
    bf16: bool = False,
    keep_states: bool = False,
):
    new = cfg.max_new_tokens
    prep_base = as_prep_runs(base, cfg)
    plan = plan_batches([len(p) for p in prompts], new, cfg.batch_size, cfg.batch_tokens)
    results = [
        timed(
            "(a) model.generate, batch 1",
            lambda: hf_generate(base, [[p] for p in prompts], new),
            len(prompts),
        ),
        timed(
            f"(b) regenerate.generate_replies, weight_layout={cfg.weight_layout}",
            lambda: generate_replies(prep_base, prompts, cfg),
            len(plan),
        ),
    ]
    if cfg.weight_layout != "standard":
        results.append(
            timed(
                "(b') regenerate.generate_replies, weight_layout=standard",
                lambda: generate_replies(base, prompts, cfg),
                len(plan),
            )
        )
    if keep_states:
        tok = base.tokenizer
        history = [{"role": "user", "content": "Hi"}]
        tail = reply_tail(tok, history, turn_prompt(tok, history))  # the template's, e.g. ChatML
        results.append(
            timed(
                "(f) (b) keeping the states caching takes (regen.keep_states)",
                lambda: generate(prep_base, prompts, cfg, None, [tail] * len(prompts))[0],
                len(plan),
            )
        )
    if bf16:
        half = as_prep_runs(base, cfg, torch.bfloat16)
        results.append(
            timed(
                f"(e) regenerate.generate_replies, bf16 base, weight_layout={cfg.weight_layout}",
                lambda: generate_replies(half, prompts, cfg),
                len(plan),
            )
        )
    if with_batched_generate:
        sorted_batches = [[prompts[i] for i in b] for b in plan]
        order = [i for b in plan for i in b]

        def same_batches() -> list[list[int]]:
            flat = hf_generate(base, sorted_batches, new)
            replies: list[list[int]] = [[] for _ in prompts]
            for i, r in zip(order, flat, strict=True):
                replies[i] = r
            return replies

        old = [prompts[i : i + OLD_BATCH_SIZE] for i in range(0, len(prompts), OLD_BATCH_SIZE)]
        results += [
            timed("(c) model.generate on (b)'s batches", same_batches, len(plan)),
            timed(
                f"(d) model.generate, batch {OLD_BATCH_SIZE} in data order",
                lambda: hf_generate(base, old, new),
                len(old),
            ),
        ]
    return results


def print_table(results: list[Result], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    ref = results[0]
    table = Table(title=title)
    for col in ("measurement", "batches", "reply tokens", "seconds", "tokens/s", "vs (a)"):
        table.add_column(col, justify="left" if col == "measurement" else "right")
    table.add_column("same as (a)", justify="right")
    for r in results:
        same = sum(x == y for x, y in zip(r.replies, ref.replies, strict=True))
        table.add_row(
            r.name,
            str(r.batches),
            f"{r.tokens:,}",
            f"{r.seconds:.1f}",
            f"{r.tokens_per_s:.1f}",
            f"{r.tokens_per_s / ref.tokens_per_s:.2f}x",
            f"{same}/{len(r.replies)}",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # piped to a file or a log: do not wrap at 80 columns
    console.print(table)
    best = results[1].tokens_per_s / ref.tokens_per_s
    console.print(f"(b) / (a) = {best:.2f}x generated tokens/s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="first turns to regenerate (16)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="reply tokens at most (128)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: conf/prep.yaml's")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: conf/prep.yaml's")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: its own)"
    )
    ap.add_argument("--skip-generate-batched", action="store_true", help="leave out (c) and (d)")
    ap.add_argument("--bf16", action="store_true", help="add (e): (b) on a bf16 copy of the base")
    ap.add_argument(
        "--keep-states", action="store_true", help="add (f): (b) keeping caching's states"
    )
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1:
        ap.error("--prompts and --max-new-tokens must be positive integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("data_prep").setLevel(logging.ERROR)  # skipped-row warnings are expected

    overrides = [
        "out=unused",
        "regen.temperature=0.0",
        f"regen.max_new_tokens={args.max_new_tokens}",
        # some records are skipped (no reply, duplicates): read spare ones
        f"data.max_conversations={2 * args.prompts + 16}",
    ]
    if args.batch_size:
        overrides.append(f"regen.batch_size={args.batch_size}")
    if args.batch_tokens:
        overrides.append(f"regen.batch_tokens={args.batch_tokens}")
    cfg = load(compose("prep", overrides), PrepConfig)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = load_base(cfg.base, device=device)
    prompts = first_turn_prompts(cfg, base, args.prompts)
    lengths = sorted(len(p) for p in prompts)
    print(
        f"{len(prompts)} prompts, {sum(lengths):,} tokens (median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}); measuring:",
        flush=True,
    )
    hf_generate(base, [prompts[:1]], 4)  # warm-up: the first forwards pay one-off costs
    results = run(
        base, prompts, cfg.regen, not args.skip_generate_batched, args.bf16, args.keep_states
    )
    title = (
        f"regeneration throughput: SmolLM2, {len(prompts)} ShareGPT first turns, greedy, "
        f"max_new_tokens {args.max_new_tokens}, batch_size {cfg.regen.batch_size}, "
        f"batch_tokens {cfg.regen.batch_tokens}, {device}, {torch.get_num_threads()} threads"
    )
    print_table(results, title)


if __name__ == "__main__":
    main()
