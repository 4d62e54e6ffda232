"""Compare prep's tokenization throughput with the raw fast tokenizer on the same ShareGPT texts.

Usage: python evaluation/benchmarks/bench_prep.py --conversations 2000
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from data_prep.config import DataConfig, PrepConfig
from data_prep.prepare import prepare, read_conversations
from data_prep.template import Encoded, encode_batch
from train.core.base import load_tokenizer
from train.core.config import compose, load
from train.core.readers import SkipLog

TARGET = 0.7  # prep must reach at least this fraction of the raw tokenizer's tokens/s


@dataclass
class Result:
    """One measured row of the table."""

    name: str
    conversations: int
    tokens: int
    seconds: float
    note: str = ""
    is_reference: bool = False
    has_target: bool = True  # whole-job rows (reading, writing) are shown for information

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def time_raw(tokenizer, texts: list[str], batch_size: int) -> tuple[int, float]:
    """(a) one pass of fast-tokenizer batch encode over pre-rendered texts: (tokens, seconds)."""
    gc.collect()
    tokens = 0
    t0 = time.perf_counter()
    for batch in batches(texts, batch_size):
        enc = tokenizer(batch, add_special_tokens=False)
        tokens += sum(len(ids) for ids in enc["input_ids"])
    return tokens, time.perf_counter() - t0


def time_encode_batch(
    tokenizer, convs: list[list[dict[str, str]]], batch_size: int
) -> tuple[int, float, int]:
    """(b) one pass of prep's per-conversation work (render per turn, tokenize with offsets,
    loss mask): (tokens, seconds, template errors)."""
    gc.collect()
    tokens = errors = 0
    t0 = time.perf_counter()
    for batch in batches(convs, batch_size):
        for enc in encode_batch(tokenizer, batch, ("assistant",)):
            if isinstance(enc, Encoded):
                tokens += len(enc.input_ids)
            else:
                errors += 1
    return tokens, time.perf_counter() - t0, errors


def bench_in_process(
    tokenizer, convs: list[list[dict[str, str]]], batch_size: int, repeats: int
) -> list[Result]:
    """(a) and (b), interleaved so that a slow spell of the machine hits both; best of repeats."""
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in convs]  # untimed
    tokenizer(texts[:8], add_special_tokens=False)  # warm-up
    encode_batch(tokenizer, convs[:8], ("assistant",))
    raw_s: list[float] = []
    prep_s: list[float] = []
    for _ in range(repeats):
        raw_tokens, s = time_raw(tokenizer, texts, batch_size)
        raw_s.append(s)
        prep_tokens, s, errors = time_encode_batch(tokenizer, convs, batch_size)
        prep_s.append(s)
    runs = f"best of {repeats}: " + ", ".join(f"{x:.2f}" for x in raw_s) + "s"
    raw = Result("(a) raw tokenizer(texts)", len(texts), raw_tokens, min(raw_s), runs, True)
    runs = f"best of {repeats}: " + ", ".join(f"{x:.2f}" for x in prep_s) + "s"
    if errors:
        runs += f"; {errors} template errors"
    prep = Result("(b) template.encode_batch", len(convs), prep_tokens, min(prep_s), runs)
    return [raw, prep]


def prep_config(overrides: list[str]) -> PrepConfig:
    """conf/prep.yaml (SmolLM2, the bundled ShareGPT) with `overrides`, as the CLI builds it."""
    return load(compose("prep", overrides), PrepConfig)


def bench_prepare(data: DataConfig, num_proc: int, batch_size: int, tokens: int) -> list[Result]:
    """(c) prep's tokenize stage (the datasets.map that the target is about) and (d) the whole
    `prepare` job (tokenizer load, read, map, filter, stats, save) into a temp dir.

    tokens/s uses the tokens of the input conversations (from (a)): the job tokenizes all of
    them, even the few it then drops.
    """
    with tempfile.TemporaryDirectory(prefix="bench_prep-") as tmp:
        cfg = prep_config(
            [f"out={Path(tmp) / 'prepared'}", f"num_proc={num_proc}", f"batch_size={batch_size}"]
        )
        cfg.data = data
        gc.collect()
        t0 = time.perf_counter()
        stats = prepare(cfg)
        seconds = time.perf_counter() - t0
    timing = stats["timing"]
    note = (
        f"num_proc={timing['num_proc']}; read {timing['read_s']:.1f}s, "
        f"map {timing['tokenize_s']:.1f}s, save {timing['save_s']:.1f}s; "
        f"{stats['tokens_total']:,} tokens saved"
    )
    kept = stats["conversations_kept"]
    procs = f"num_proc={num_proc}"
    map_note = f"datasets.map(batched) incl. Arrow writes; {timing['num_proc']} proc"
    return [
        Result(f"(c) prep map stage, {procs}", kept, tokens, timing["tokenize_s"], map_note),
        Result(f"(d) whole prepare(), {procs}", kept, tokens, seconds, note, has_target=False),
    ]


def print_table(results: list[Result], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    ref = next(r for r in results if r.is_reference)
    table = Table(title=title)
    target = f"target >= {TARGET}x"
    for col in ("measurement", "convs", "tokens", "seconds", "tokens/s", "vs (a)", target, "notes"):
        justify = (
            "left" if col in ("measurement", "notes") else "center" if col == target else "right"
        )
        table.add_column(col, justify=justify)
    summary = []  # a PASS / FAIL line per row with a target, printed under the table
    for r in results:
        if r.is_reference:
            ratio, verdict = "1.00x", "-"
        else:
            x = r.tokens_per_s / ref.tokens_per_s
            ratio, verdict = f"{x:.2f}x", "info"
            if r.has_target:
                verdict = "[green]PASS[/green]" if x >= TARGET else "[red]FAIL[/red]"
                passed = "PASS" if x >= TARGET else "FAIL"
                summary.append(f"{r.name} / (a) = {x:.2f}x (target >= {TARGET}x): {passed}")
        table.add_row(
            r.name,
            f"{r.conversations:,}",
            f"{r.tokens:,}",
            f"{r.seconds:.2f}",
            f"{r.tokens_per_s:,.0f}",
            ratio,
            verdict,
            r.note,
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=180)  # piped to a file or a log: do not wrap at 80 columns
    console.print(table)
    for line in summary:
        console.print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--conversations", type=int, default=2000, help="ShareGPT records to read (default 2000)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=256, help="conversations per tokenizer call (256)"
    )
    parser.add_argument("--skip-e2e", action="store_true", help="skip (c)/(d), the prepare() runs")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed passes of (a) and (b); the best counts (3)"
    )
    args = parser.parse_args(argv)
    if args.conversations < 1 or args.batch_size < 1 or args.repeats < 1:
        parser.error("--conversations, --batch-size and --repeats must be positive integers")
    logging.getLogger("data_prep").setLevel(logging.ERROR)  # skipped-row warnings are expected

    import datasets

    datasets.disable_progress_bars()

    data = prep_config(["out=unused", f"data.max_conversations={args.conversations}"]).data
    tokenizer = load_tokenizer(prep_config(["out=unused"]).base)
    rows, _ = read_conversations(data, SkipLog())
    convs = [
        [{"role": r, "content": c} for r, c in zip(row["roles"], row["contents"], strict=True)]
        for row in rows
    ]
    results = bench_in_process(tokenizer, convs, args.batch_size, args.repeats)
    if not args.skip_e2e:
        for num_proc in (1, 2):
            results += bench_prepare(data, num_proc, args.batch_size, results[0].tokens)

    title = (
        f"prep throughput: {args.conversations:,} ShareGPT records -> {len(convs):,} "
        f"conversations, batch {args.batch_size}, SmolLM2 tokenizer, {os.cpu_count()} CPUs, "
        f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}"
    )
    print_table(results, title)


if __name__ == "__main__":
    main()
