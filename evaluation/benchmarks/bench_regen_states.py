"""Regeneration then caching: caching running the base again, against caching taking the states
regeneration computed (`regen.keep_states`), on SmolLM2; and which samples the states cover
when the samples are the replies' text tokenized anew instead of the tokens the base generated
(`regen.token_ids=false`).

Usage: python evaluation/benchmarks/bench_regen_states.py [--conversations 200] [--turns 1]
       [--max-new-tokens 128] [--max-prompt-tokens 384] [--max-length 512] [--threads 2]
       [--out DIR]

Runs the real `hydra-heads prep regenerate=true cache_hidden=true` (the one-hour recipe's
regeneration options by default) on the first bundled ShareGPT conversations three times, one
run after the other on an otherwise idle machine: `regen.keep_states=false`, then `true` with
`regen.token_ids=false` (the text's tokens), then both `true` (prep's defaults). It prints each
run's regeneration, caching and whole prep time (prep_timing.json), how many samples took
regeneration's states, the first run's time over the last's, how many samples the first and
last datasets share token for token and the largest difference between their cached states
over those samples (float16 rounding of the same float32 arithmetic, batched otherwise), and
how many of the last run's samples the text's tokens differ from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CLI = str(Path(sys.executable).parent / "hydra-heads")


def _prep(out: Path, args, keep: bool, token_ids: bool = True) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    cmd = [CLI, "prep", f"data.max_conversations={args.conversations}", "regenerate=true",
           f"regen.max_turns={args.turns}", f"regen.max_new_tokens={args.max_new_tokens}",
           f"regen.max_prompt_tokens={args.max_prompt_tokens}",
           f"data.max_length={args.max_length}", "cache_hidden=true",
           f"regen.keep_states={str(keep).lower()}", f"regen.token_ids={str(token_ids).lower()}",
           f"out={out}", "overwrite=true"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"prep failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    timing = json.loads((out / "prep_timing.json").read_text())
    taken = re.search(r"hidden states of (\d+) of (\d+) samples taken", r.stdout + r.stderr)
    return {
        "regen": timing["regenerate_s"],
        "cache": timing["cache_hidden_s"],
        "total": timing["total_s"],
        "taken": f"{taken[1]} of {taken[2]}" if taken else "-",
    }


def _compare(a, b) -> tuple[int, int, float]:
    """(samples in a, samples of b with a's tokens, largest |a - b| of their states)."""
    import numpy as np

    n = same = 0
    worst = 0.0
    for split in a:
        index = {tuple(x): i for i, x in enumerate(b[split]["input_ids"])}
        for i, ids in enumerate(a[split]["input_ids"]):
            n += 1
            j = index.get(tuple(ids))
            if j is None:
                continue
            same += 1
            ha = np.asarray(a[split][i]["hidden"], np.float32)
            hb = np.asarray(b[split][j]["hidden"], np.float32)
            worst = max(worst, float(np.abs(ha - hb).max()))
    return n, same, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=1, help="regen.max_turns")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="where the two preps go (default: a temp dir)")
    args = ap.parse_args()
    from datasets import load_from_disk
    from rich.console import Console
    from rich.table import Table

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_regen_states-"))
    runs = {
        "caching runs the base (keep_states=false)": _prep(root / "apart", args, False),
        "takes the states, the text's tokens (token_ids=false)": _prep(
            root / "text", args, True, token_ids=False
        ),
        "takes the states, the generated tokens (both true)": _prep(root / "kept", args, True),
    }
    a, b = load_from_disk(str(root / "apart")), load_from_disk(str(root / "kept"))
    n, same, worst = _compare(a, b)
    text = load_from_disk(str(root / "text"))
    n_text, same_text, _ = _compare(b, text)
    t = Table(
        title=f"prep regenerate + cache_hidden: {args.conversations} conversations, "
        f"{args.turns} turn(s) x {args.max_new_tokens} tokens, SmolLM2, {args.threads} threads"
    )
    for col in ("run", "regeneration s", "caching s", "prep s", "states taken"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for name, r in runs.items():
        row = (f"{r['regen']:.1f}", f"{r['cache']:.1f}", f"{r['total']:.1f}", r["taken"])
        t.add_row(name, *row)
    console = Console()
    console.print(t)
    apart, _, kept = runs.values()
    console.print(
        f"prep {apart['total'] / kept['total']:.2f}x faster, caching "
        f"{apart['cache'] / kept['cache']:.1f}x; {same} of {n} samples the same tokens in the "
        f"first and last runs, their states at most {worst:.4g} apart; the text's tokens differ "
        f"from the generated ones in {n_text - same_text} of {n_text} samples"
    )


if __name__ == "__main__":
    main()
