"""Peak memory of `hydra-heads prep` against corpus size: is prep's memory bounded?

prep spools what it reads to Arrow files and works on them a batch at a time
(data_prep/spool.py), so its peak memory should stay about flat as the corpus grows (one batch,
the tokenizer, the dedup index of ~100 bytes a conversation). This benchmark builds JSONL
corpora of the given sizes (ShareGPT records, cycled, each made unique so dedup keeps it), runs
the real CLI on each in a fresh process (`python -m launch prep data=jsonl ...`, one tokenizer
process so the peak is one process's), and reads the process's peak RSS from the kernel
(os.wait4). With --compare-with DIR it runs another checkout (e.g. a git worktree of an older
commit) on the same corpora, side by side in the same run.

    python evaluation/benchmarks/bench_prep_memory.py --conversations 10000 100000
    git worktree add /tmp/old <commit>
    python evaluation/benchmarks/bench_prep_memory.py --compare-with /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    code: str
    conversations: int
    peak_mib: float
    anon_mib: float
    seconds: float
    kept: int


def build_corpus(path: Path, n: int, max_chars: int, pool_size: int = 4000) -> None:
    """`n` JSONL conversations: the first `pool_size` usable bundled ShareGPT records, cycled,
    with contents cut to `max_chars` and a counter in the first turn so that none is a
    duplicate of another. Written a line at a time."""
    sys.path.insert(0, str(ROOT))
    from data_prep.config import PrepConfig
    from data_prep.prepare import resolve_input
    from train.core.config import compose, load
    from train.core.readers import SkipLog, iter_records

    src = resolve_input(load(compose("prep", ["out=unused"]), PrepConfig).data)
    pool = []
    for _, record in iter_records(src, "json", SkipLog()):
        turns = record.get("conversations") or []
        if len(turns) >= 2 and all(isinstance(t.get("value"), str) for t in turns):
            pool.append([{"from": t["from"], "value": t["value"][:max_chars]} for t in turns])
        if len(pool) == pool_size:
            break
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            turns = [dict(t) for t in pool[i % len(pool)]]
            turns[0]["value"] = f"[{i}] {turns[0]['value']}"
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")


def run_prep(
    code: Path, corpus: Path, out: Path, extra: list[str]
) -> tuple[float, float, float, int]:
    """One `prep` in a fresh process of checkout `code`: (peak RSS MiB, peak anonymous RSS MiB,
    seconds, samples kept). The RSS peak (the kernel's ru_maxrss) includes the pages of the
    memory-mapped Arrow files that were read, which the page cache can drop; the anonymous
    peak (RssAnon in /proc, polled every 50 ms) is the memory prep itself holds."""
    argv = [sys.executable, "-m", "launch", "prep", "data=jsonl", f"data.path={corpus}"]
    argv += [f"out={out}", "num_proc=1", "overwrite=true", *extra]
    env = {**os.environ, "PYTHONPATH": str(code), "TQDM_DISABLE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    anon = [0]
    stop = threading.Event()

    def sample() -> None:  # the heap's peak: RssAnon, polled (ru_maxrss also counts mmapped files)
        while not stop.wait(0.05):
            try:
                text = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("RssAnon:"):
                    anon[0] = max(anon[0], int(line.split()[1]))

    poller = threading.Thread(target=sample, daemon=True)
    poller.start()
    err = proc.stderr.read()
    stop.set()
    poller.join()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"prep failed in {code} on {corpus}:\n{err[-3000:]}")
    stats = json.loads((out / "prep_stats.json").read_text())
    kept = sum(split["samples"] for split in stats["splits"].values())
    return usage.ru_maxrss / 1024, anon[0] / 1024, seconds, kept


def print_table(runs: list[Run], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ("code", "conversations", "peak RSS MiB", "x smallest", "peak anon MiB", "x smallest")
    for col in (*cols, "conv/s", "samples"):
        table.add_column(col, justify="right" if col != "code" else "left")
    for code in dict.fromkeys(r.code for r in runs):
        mine = [r for r in runs if r.code == code]
        for r in mine:
            table.add_row(
                code,
                f"{r.conversations:,}",
                f"{r.peak_mib:,.0f}",
                f"{r.peak_mib / mine[0].peak_mib:.2f}",
                f"{r.anon_mib:,.0f}",
                f"{r.anon_mib / mine[0].anon_mib:.2f}",
                f"{r.conversations / r.seconds:,.0f}",
                f"{r.kept:,}",
            )
    Console().print(table)
    codes = list(dict.fromkeys(r.code for r in runs))
    if len(codes) == 2:
        for n in sorted({r.conversations for r in runs}):
            a, b = (next(r for r in runs if r.code == c and r.conversations == n) for c in codes)
            print(
                f"{n:,} conversations, {codes[0]}/{codes[1]}: peak RSS "
                f"{a.peak_mib / b.peak_mib:.2f}x, anonymous {a.anon_mib / b.anon_mib:.2f}x, "
                f"time {a.seconds / b.seconds:.2f}x"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--max-chars", type=int, default=300, help="characters kept per turn")
    parser.add_argument("--pack", action="store_true", help="data.pack=true")
    parser.add_argument("--max-length", type=int, default=2048, help="data.max_length")
    parser.add_argument("--compare-with", type=Path, help="another checkout to run side by side")
    parser.add_argument("--workdir", type=Path, help="where corpora and outputs go (a temp dir)")
    args = parser.parse_args(argv)
    sizes = sorted(set(args.conversations))
    if sizes[0] < 1 or args.max_chars < 1:
        parser.error("--conversations and --max-chars must be positive")
    if args.compare_with and not (args.compare_with / "launch" / "__main__.py").is_file():
        parser.error(f"--compare-with {args.compare_with}: not a hydra-heads checkout")
    work = Path(tempfile.mkdtemp(prefix="bench-prep-mem-", dir=args.workdir))
    extra = [f"data.max_length={args.max_length}", f"data.pack={str(args.pack).lower()}"]
    codes = {"this": ROOT}
    if args.compare_with:
        codes["other"] = args.compare_with.resolve()
    runs = []
    try:
        for n in sizes:
            corpus = work / f"corpus-{n}.jsonl"
            build_corpus(corpus, n, args.max_chars)
            mib = corpus.stat().st_size / 2**20
            for name, code in codes.items():
                peak, anon, seconds, kept = run_prep(code, corpus, work / f"out-{name}-{n}", extra)
                print(
                    f"{name}: {n:,} conversations ({mib:,.0f} MiB JSONL): peak RSS {peak:,.0f} "
                    f"MiB, anonymous {anon:,.0f} MiB, {seconds:,.0f} s",
                    flush=True,
                )
                runs.append(Run(name, n, peak, anon, seconds, kept))
                shutil.rmtree(work / f"out-{name}-{n}", ignore_errors=True)
            corpus.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    title = (
        f"prep peak memory: JSONL ShareGPT corpora, turns cut to {args.max_chars} chars, "
        f"max_length {args.max_length}, pack={args.pack}, num_proc=1"
        + (f"; other = {args.compare_with}" if args.compare_with else "")
    )
    print_table(runs, title)


if __name__ == "__main__":
    main()
