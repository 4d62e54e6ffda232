"""Measure speculative decoding against plain decoding on SmolLM2 with trained heads.

Usage: python evaluation/benchmarks/bench_decode.py [--heads runs/demo/train/heads]
       [--prepared runs/demo/data] [--prompts 4] [--max-new-tokens 64] [--context 300]
       [--reps 7] [--threads 2]

Prints, from one run on this machine:
  1. the cost of one base forward over n = 1, 2, 4, ..., 64 new tokens on a `--context`-token KV
     cache (the verify pass of an n-1 node tree, with its tree mask), relative to one plain
     decode step (one token, no mask); the output projection is timed apart, since the verifier
     projects only the ~tau rows its walk down the tree reaches;
  2. per tree (chain, mc_sim_7b_63, sparse presets, calibrated trees of several sizes): the
     cost of one proposal by the heads, and of one whole speculative step (a real 24-token
     decode, per base forward) relative to a plain step, and from it the break-even tau
     (speculation pays when tau exceeds step / plain);
  3. the measured speculative / plain wall-clock ratio on held-out prompts, decoded both ways
     interleaved in the same run, for the chain, the 63-node tree and the `tree=auto` choice.

Each timing is the median of `--reps` repetitions after one warm-up. Targets: >= 1.0x with the
demo heads (tree=auto never slows decoding down), >= 1.5x with heads trained for an hour.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from evaluation.calibrate import calibrate, choose_tree  # noqa: E402
from evaluation.config import CalibratedTree  # noqa: E402
from evaluation.decode import Decoder, eos_ids, new_cache  # noqa: E402
from evaluation.evaluate import calibration_rows  # noqa: E402
from evaluation.prompts import held_out_prompts, prepared_rows  # noqa: E402
from evaluation.tree import PRESETS, Tree, chain, grow  # noqa: E402
from evaluation.verify import base_forward, tree_attention_mask, tree_bias  # noqa: E402
from train.core.base import load_base, recorded_base  # noqa: E402
from train.core.checkpoint import read_meta  # noqa: E402
from train.core.config import from_group  # noqa: E402
from train.heads import load_heads  # noqa: E402

SPEEDUP_TARGET_DEMO = 1.0


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def forward_costs(model, context: int, reps: int) -> tuple[float, dict[int, float], float]:
    """Seconds for: a plain step (1 token, no mask, + lm_head on 1 row); the body forward over n
    tree tokens with a tree mask; one lm_head row."""
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context))
    cache = new_cache(model)
    base_forward(model, ids, torch.arange(context)[None], cache)

    def run(n: int, masked: bool) -> None:
        x = torch.randint(0, vocab, (1, n))
        pos = (context + torch.arange(n))[None]
        mask = None
        if masked:
            tree = Tree.from_paths(chain(n - 1))
            mask = tree_attention_mask(tree_bias(tree, torch.float32), context)
        final, _ = base_forward(model, x, pos, cache, mask)
        if not masked:
            model.lm_head(final[-1])
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :context], layer.values[:, :, :context]

    plain = median_time(lambda: run(1, False), reps)
    body = {n: median_time(lambda n=n: run(n, n > 1), reps) for n in (1, 2, 4, 8, 16, 32, 64)}
    h = torch.randn(1, model.config.hidden_size)
    row = median_time(lambda: model.lm_head(h), reps)
    return plain, body, row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="runs/demo/train/heads")
    ap.add_argument("--prepared", default=None, help="prep output (default: the heads' own)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=120)

    if not Path(args.heads).is_dir():
        raise SystemExit(f"{args.heads} not found: run `make demo` first or pass --heads DIR")
    meta = read_meta(args.heads)
    base = load_base(recorded_base(meta["base"]["config"]))
    heads, meta = load_heads(args.heads, base.fingerprint())
    model = base.model
    prepared = args.prepared or (meta.get("training") or {}).get("prepared") or "runs/demo/data"
    ds = prepared_rows(prepared)
    items, next_row = held_out_prompts(ds, args.prompts, 1024)
    prompts = [it.tokens for it in items]
    dec = Decoder(model, eos_ids(base.tokenizer, model), heads)

    # 1. forward cost vs tree tokens
    plain, body, row = forward_costs(model, args.context, args.reps)
    t = Table(
        title=f"one base forward on a {args.context}-token cache vs a plain decode step "
        f"({plain * 1e3:.1f} ms: 1 token + output projection)"
    )
    for col in ("new tokens", "forward ms", "x plain step"):
        t.add_column(col, justify="right")
    for n, s in body.items():
        t.add_row(str(n), f"{s * 1e3:.1f}", f"{s / plain:.2f}")
    console.print(t)
    console.print(f"output projection, one row: {row * 1e3:.1f} ms ({row / plain:.2f}x plain step)")

    # 2. proposal and whole-step cost per tree, break-even tau
    rows = calibration_rows(ds, next_row, from_group(CalibratedTree, "tree", "calibrated"))
    calib = calibrate(model, heads, rows, 10)
    trees = {
        "chain": chain(heads.num_heads),
        **{name: PRESETS[name] for name in ("sparse_7", "sparse_15", "mc_sim_7b_63")},
        **{f"calibrated_{n}": grow(calib.acc, n) for n in (4, 8, 16, 32, 64)},
    }
    prompt = prompts[0]
    ctx = torch.zeros(model.config.hidden_size)  # the proposal's cost does not depend on it
    dec.set_tree(Tree.from_paths([]))
    dec.decode_step_seconds(prompt, 4, 1)  # warm-up
    plain_step = dec.decode_step_seconds(prompt, 24, 3)
    t = Table(
        title=f"speculative step vs plain step ({plain_step * 1e3:.1f} ms) after a "
        f"{len(prompt)}-token prompt"
    )
    for col in ("tree", "nodes", "propose ms", "x plain", "step ms", "break-even tau",
                "expected tau"):  # fmt: skip
        t.add_column(col, justify="right")
    for name, paths in trees.items():
        tree = Tree.from_paths(paths, heads.num_heads)
        dec.set_tree(tree)
        prop = median_time(lambda: dec.propose(ctx, 0, len(prompt)), args.reps)
        step = dec.decode_step_seconds(prompt, 24, 3)
        t.add_row(
            name,
            str(tree.num_nodes - 1),
            f"{prop * 1e3:.1f}",
            f"{prop / plain_step:.2f}",
            f"{step * 1e3:.1f}",
            f"{step / plain_step:.2f}",
            f"{tree.expected_length(calib.acc):.2f}",
        )
    console.print(t)

    # 3. measured end-to-end ratio
    best, _ = choose_tree(dec, calib, prompt, 64)
    runs = {
        "chain": Tree.from_paths(trees["chain"]),
        "mc_sim_7b_63": Tree.from_paths(trees["mc_sim_7b_63"]),
        f"auto ({best.tree.num_nodes - 1} nodes)": best.tree,
    }
    t = Table(
        title=f"speculative / plain wall clock, {len(prompts)} held-out prompts x "
        f"{args.max_new_tokens} new tokens, interleaved"
    )
    for col in ("tree", "tau", "spec tok/s", "plain tok/s", "speedup", "lossless"):
        t.add_column(col, justify="right")
    for name, tree in runs.items():
        dec.set_tree(tree)
        spec_s = plain_s = 0.0
        spec_n = plain_n = steps = acc = 0
        same = True
        for i, p in enumerate(prompts):
            order = (dec.speculative, dec.plain) if i % 2 == 0 else (dec.plain, dec.speculative)
            out = {fn.__name__: fn(p, args.max_new_tokens) for fn in order}
            s, q = out["speculative"], out["plain"]
            spec_s, spec_n = spec_s + s.total_s, spec_n + len(s.tokens)
            plain_s, plain_n = plain_s + q.total_s, plain_n + len(q.tokens)
            steps, acc = steps + s.steps, acc + sum(s.accepted)
            same &= s.tokens == q.tokens
        ratio = (spec_n / spec_s) / (plain_n / plain_s)
        t.add_row(
            name,
            f"{(acc + steps) / max(steps, 1):.2f}",
            f"{spec_n / spec_s:.1f}",
            f"{plain_n / plain_s:.1f}",
            f"{ratio:.2f}x",
            "yes" if same else "NO",
        )
    console.print(t)
    console.print(f"target with the demo heads: tree=auto >= {SPEEDUP_TARGET_DEMO:.1f}x")


if __name__ == "__main__":
    main()
