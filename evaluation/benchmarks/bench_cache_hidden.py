"""Hidden-state caching with one process against N processes (torchrun), on SmolLM2.

Usage: python evaluation/benchmarks/bench_cache_hidden.py [--conversations 200]
       [--processes 2] [--threads 2] [--per-process] [--max-length 512] [--batch-size 4]
       [--out DIR]

Runs the real `hydra-heads prep cache_hidden=true` on the first bundled ShareGPT
conversations twice, one run after the other on an otherwise idle machine:

  (a) one process with --threads torch threads;
  (b) `torchrun --nproc_per_node=N`, each process with threads / N threads (the same cores);
      with --per-process, each with --threads threads (N times the cores: how the ranks scale
      where each has cores, or a device, of its own);

and prints each run's caching time (prep_timing.json's cache_hidden_s), samples per second,
the speedup of (b) over (a), and whether the two datasets are equal column for column.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CLI = str(Path(sys.executable).parent / "hydra-heads")


def _prep(out: Path, args, processes: int) -> dict:
    threads = args.threads if args.per_process else max(1, args.threads // processes)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    cmd = [CLI, "prep", f"data.max_conversations={args.conversations}",
           f"data.max_length={args.max_length}", "cache_hidden=true",
           f"cache_batch_size={args.batch_size}", f"out={out}", "overwrite=true"]  # fmt: skip
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", "--no-python", *cmd]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"prep failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    timing = json.loads((out / "prep_timing.json").read_text())
    stats = json.loads((out / "prep_stats.json").read_text())
    samples = sum(s["samples"] for s in stats["splits"].values())
    return {"s": timing["cache_hidden_s"], "samples": samples, "threads": threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all")
    ap.add_argument(
        "--per-process", action="store_true", help="--threads for each process, not in all"
    )
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default=None, help="where the two preps go (default: a temp dir)")
    args = ap.parse_args()
    from datasets import load_from_disk
    from rich.console import Console
    from rich.table import Table

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_cache_hidden-"))
    one = _prep(root / "one", args, 1)
    many = _prep(root / "many", args, args.processes)
    a, b = load_from_disk(str(root / "one")), load_from_disk(str(root / "many"))
    same = all(a[s][c] == b[s][c] for s in a for c in a[s].column_names)
    cores = "threads each" if args.per_process else "threads in all"
    t = Table(title=f"cache_hidden: {one['samples']} samples, SmolLM2, {args.threads} {cores}")
    for col in ("run", "threads each", "caching s", "samples/s"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for name, r in (("1 process", one), (f"{args.processes} processes (torchrun)", many)):
        t.add_row(name, str(r["threads"]), f"{r['s']:.1f}", f"{r['samples'] / r['s']:.2f}")
    console = Console()
    console.print(t)
    console.print(f"speedup {one['s'] / many['s']:.2f}x; datasets equal: {same}")


if __name__ == "__main__":
    main()
