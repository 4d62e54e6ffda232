"""Does decoding deliver what the heads predict? Calibration on an eval's own outputs.

Usage: python evaluation/benchmarks/bench_calibration.py EVAL_DIR [EVAL_DIR ...] [--threads 2]
       [--topk 10]

For each finished `hydra-heads eval` output (eval.json and tree.json, a fixed or calibrated
tree), the texts it decoded (every record's prompt and greedy output, both turns) are run
teacher-forced through the base and its heads, and the heads' acceptance by depth and rank is
measured on exactly those tokens (`evaluation.calibrate`, as `tree=calibrated` measures
held-out rows). Prints, side by side:

  - tau the eval decoded;
  - tau that acceptance expects on the eval's own tree, from its own outputs;
  - tau the eval's held-out calibration expected (tree=calibrated / auto only);
  - each head's top-1 agreement with the base on the outputs, against the held-out one.

The first two agree when the decoder loses nothing that teacher forcing measures (a bug in the
tree, the caches or the heads' inputs during decoding would show here as a gap). The gap
between the last two is the prompts' domain: held-out training-style rows against the suite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from evaluation.calibrate import calibrate
from train.core.base import load_base, recorded_base
from train.core.checkpoint import read_meta
from train.decoding.tree import expected_length
from train.heads import load_heads


def _rows(tokenizer, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt + output tokens, mask on the output) per record: the rendered prompt as the eval
    rendered it, then its greedy output, re-tokenized from their text."""
    rows = []
    for r in records:
        p = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        o = tokenizer(r["output"], add_special_tokens=False)["input_ids"]
        rows.append((p + o, [0] * len(p) + [1] * len(o)))
    return rows


def measure(eval_dir: Path, topk: int, loaded: dict) -> dict:
    ev = json.loads((eval_dir / "eval.json").read_text())
    tree_file = eval_dir / "tree.json"
    if not tree_file.exists():
        raise SystemExit(f"{eval_dir} has no tree.json: a dynamic tree has no fixed paths to score")
    paths = json.loads(tree_file.read_text())["paths"]
    heads_dir = ev["heads"]
    if heads_dir not in loaded:  # one load per heads directory
        meta = read_meta(heads_dir)
        base = load_base(recorded_base(meta["base"]["config"], heads_dir), "cpu")
        heads, meta = load_heads(heads_dir, base.fingerprint(), "cpu")
        loaded[heads_dir] = (base, heads.eval(), int(meta.get("hidden_state_offset") or 0))
    base, heads, offset = loaded[heads_dir]
    calib = calibrate(base.model, heads, _rows(base.tokenizer, ev["records"]), topk, offset)
    held_out = ev["tree"].get("calibration")
    return {
        "eval": str(eval_dir),
        "nodes": len(paths),
        "decoded": ev["tau"],
        "expected_own": expected_length(paths, calib.acc),
        "expected_held_out": ev["tree"].get("expected_tau"),
        "top1_own": [float(x) for x in calib.acc[:, 0]],
        "top1_held_out": held_out["top1"] if held_out else None,
        "positions": calib.positions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("evals", nargs="+", type=Path, help="hydra-heads eval output directories")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--topk", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded: dict = {}
    results = [measure(d, args.topk, loaded) for d in args.evals]

    def fmt(xs):
        return " / ".join(f"{x:.3f}" for x in xs) if xs else "-"

    print(
        "| eval | nodes | tau decoded | tau expected from its outputs | ratio | tau expected "
        "from held-out rows | head top-1 on its outputs | head top-1 on held-out rows |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        held = r["expected_held_out"]
        print(f"| {r['eval']} | {r['nodes']} | {r['decoded']:.3f} | {r['expected_own']:.3f} | "
              f"{r['expected_own'] / r['decoded']:.3f} | {f'{held:.3f}' if held else '-'} | "
              f"{fmt(r['top1_own'])} | {fmt(r['top1_held_out'])} |")  # fmt: skip
    for r in results:
        print(f"{r['eval']}: positions measured per head on its outputs: {r['positions']}")


if __name__ == "__main__":
    main()
