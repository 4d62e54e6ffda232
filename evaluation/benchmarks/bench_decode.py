"""Where speculative decoding pays on this machine: verify cost, break-even tau, and the
speedup each decode-backend feature buys, measured side by side in one run.

Usage: python evaluation/benchmarks/bench_decode.py [--heads runs/demo/train/heads]
       [--prompts 4] [--max-new-tokens 64] [--context 300] [--reps 5] [--threads 2]
       [--tree sparse_15] [--compile-sizes 1,4,16,64] [--sections 1,2,3]

Prints:
  1. the cost of one base forward over n = 1, 2, 4, ..., 64 new tokens on a `--context`-token
     KV cache (the verify pass of an (n-1)-node tree, tree mask included) relative to a
     one-token step of the same backend: transformers' own path (DynamicCache, its sdpa), the
     static cache with the grouped-KV kernel in float32, bf16 and int8, and compiled
     (`--compile-sizes` only: each size compiles its own graph). Goal: 16 tokens <= 1.3x.
  2. per tree (chain, sparse presets, calibrated trees of several sizes, dynamic trees), on the
     fastest backend that is exactly lossless: the whole speculative step (propose, verify,
     accept, KV upkeep; a real 24-token decode, per base forward) relative to a plain step,
     which is the break-even tau (speculation pays when tau exceeds it), beside its tau.
  3. speculative / plain wall clock on MT-Bench first turns (both decoded in the same run,
     interleaved, on the same backend) for each feature alone and all together: the static
     cache, compile, the dynamic tree, int8 and bf16. Goals: >= 1.5x with the one-hour recipe's
     heads, >= 1.0x with the demo's. Compile time is printed apart and is in no figure.

Timings are medians of `--reps` after a warm-up.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from evaluation.backend import quantize_base, use_gqa_attention  # noqa: E402
from evaluation.calibrate import calibrate  # noqa: E402
from evaluation.config import CalibratedTree  # noqa: E402
from evaluation.decode import Decoder, eos_ids  # noqa: E402
from evaluation.dynamic import DynamicTree  # noqa: E402
from evaluation.evaluate import calibration_rows, render_chat  # noqa: E402
from evaluation.prompts import held_out_prompts, prepared_rows  # noqa: E402
from evaluation.suites import suite_prompts  # noqa: E402
from evaluation.tree import PRESETS, Tree, chain, grow  # noqa: E402
from evaluation.verify import tree_bias  # noqa: E402
from train.core.base import load_base, recorded_base  # noqa: E402
from train.core.checkpoint import read_meta  # noqa: E402
from train.core.config import from_group  # noqa: E402
from train.heads import load_heads  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64)
# backend name -> (kv cache, base weights, compiled, transformers' own attention)
BACKENDS = {
    "transformers fp32": ("dynamic", "none", False, True),
    "static fp32": ("static", "none", False, False),
    "static bf16": ("static", "bf16", False, False),
    "static int8": ("static", "int8", False, False),
    "compiled fp32": ("static", "none", True, False),
    "compiled bf16": ("static", "bf16", True, False),
}


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Backends:
    """One Decoder per backend over copies of one float32 base (the heads are shared)."""

    def __init__(self, model, eos, heads, offset):
        self.model, self.eos, self.heads, self.offset = model, eos, heads, offset
        self.decoders: dict[str, Decoder] = {}

    def get(self, name: str) -> Decoder:
        if name not in self.decoders:
            kv, quant, compiled, hf_attention = BACKENDS[name]
            model = quantize_base(copy.deepcopy(self.model), quant)
            if not hf_attention:
                use_gqa_attention(model)
            self.decoders[name] = Decoder(
                model, self.eos, self.heads, hidden_state_offset=self.offset, kv_cache=kv,
                compile=compiled,
            )  # fmt: skip
        return self.decoders[name]


def verify_cost(dec: Decoder, context: int, n: int, reps: int) -> float:
    """Seconds of one base forward of n tokens (a chain's tree mask when n > 1) after a
    `context`-token prefix, the cache cut back to the prefix after each."""
    torch.manual_seed(0)
    vocab = dec.model.config.vocab_size
    prefix = torch.randint(0, vocab, (context,))
    dec.tree = None
    cache, _ = dec._caches(context, 64)
    dec._forward(prefix, torch.arange(context), cache)
    x = torch.randint(0, vocab, (n,))
    bias = tree_bias(Tree.from_paths(chain(n - 1)), dec.dtype) if n > 1 else None
    pos = context + torch.arange(n)

    def run() -> None:
        dec._forward(x, pos, cache, bias)
        if dec.compiled is None:
            cache.crop(-n)  # drop the n new entries
        else:
            for layer in cache.layers:
                layer.cumulative_length.fill_(context)

    return median_time(run, reps)


def section_verify(backends: Backends, args, console: Console) -> None:
    t = Table(title=f"one base forward of n tokens on a {args.context}-token cache, "
              "relative to a one-token step of the same backend (ms in brackets)")  # fmt: skip
    t.add_column("n", justify="right")
    compile_sizes = [int(s) for s in args.compile_sizes.split(",") if s]
    costs: dict[str, dict[int, float]] = {}
    for name in BACKENDS:
        dec = backends.get(name)
        sizes = compile_sizes if dec.compiled is not None else SIZES
        c0 = dec.compile_s
        costs[name] = {n: verify_cost(dec, args.context, n, args.reps) for n in sizes}
        t.add_column(name, justify="right")
        if dec.compiled is not None:
            console.print(f"{name}: compiling {len(sizes)} graphs took {dec.compile_s - c0:.0f} s")
    for n in SIZES:
        cells = []
        for name in BACKENDS:
            c = costs[name]
            cells.append(f"{c[n] / c[1]:.2f} ({c[n] * 1e3:.0f})" if n in c and 1 in c else "-")
        t.add_row(str(n), *cells)
    console.print(t)
    for name, c in costs.items():
        if 16 in c:
            verdict = "meets" if c[16] / c[1] <= 1.3 else "misses"
            console.print(f"  {name}: 16-token verify = {c[16] / c[1]:.2f}x a one-token step "
                          f"({verdict} the 1.3x goal)")  # fmt: skip


def trees_to_try(heads, calib) -> dict[str, Tree | DynamicTree]:
    trees: dict[str, Tree | DynamicTree] = {"chain": Tree.from_paths(chain(heads.num_heads))}
    for name in ("sparse_7", "sparse_15", "mc_sim_7b_63"):
        trees[name] = Tree.from_paths(PRESETS[name], heads.num_heads)
    for n in (4, 8, 16, 32):
        trees[f"calibrated_{n}"] = Tree.from_paths(grow(calib.acc, n), heads.num_heads)
    for n in (8, 16, 32):
        trees[f"dynamic_{n}"] = DynamicTree(budget=n, expand=4, width=4)
    return trees


def section_trees(dec: Decoder, name: str, trees, prompt, reps, console: Console) -> None:
    dec.set_tree(Tree.from_paths([]))
    plain = dec.decode_step_seconds(prompt, 24, reps)
    t = Table(title=f"speculative step vs plain step ({plain * 1e3:.1f} ms) on {name}, after a "
              f"{len(prompt)}-token prompt: break-even tau = step / plain")  # fmt: skip
    for col in ("tree", "nodes", "step ms", "break-even tau", "tau (24-token decode)"):
        t.add_column(col, justify="right")
    for tname, tree in trees.items():
        dec.set_tree(tree)
        step = dec.decode_step_seconds(prompt, 24, reps)
        tau = dec.speculative(prompt, 24).tau
        nodes = tree.budget if isinstance(tree, DynamicTree) else tree.num_nodes - 1
        t.add_row(tname, str(nodes), f"{step * 1e3:.1f}", f"{step / plain:.2f}", f"{tau:.2f}")
    console.print(t)


def compare(dec: Decoder, tree, prompts, max_new: int) -> dict:
    """Speculative and plain decoding of `prompts` on `dec`, interleaved."""
    dec.set_tree(tree)
    for p in prompts[:1]:  # warm-up (and, when compiled, compile) both paths
        dec.speculative(p, 8)
        dec.plain(p, 8)
    spec_s = plain_s = 0.0
    spec_n = plain_n = steps = acc = same = 0
    for i, p in enumerate(prompts):
        order = (dec.speculative, dec.plain) if i % 2 == 0 else (dec.plain, dec.speculative)
        out = {fn.__name__: fn(p, max_new) for fn in order}
        s, q = out["speculative"], out["plain"]
        spec_s, spec_n = spec_s + s.total_s, spec_n + len(s.tokens)
        plain_s, plain_n = plain_s + q.total_s, plain_n + len(q.tokens)
        steps, acc = steps + s.steps, acc + sum(s.accepted)
        same += s.tokens == q.tokens
    return {
        "tau": (acc + steps) / max(steps, 1),
        "spec": spec_n / spec_s,
        "plain": plain_n / plain_s,
        "speedup": (spec_n / spec_s) / (plain_n / plain_s),
        "same": f"{same}/{len(prompts)}",
    }


def section_features(backends: Backends, fixed: Tree, prompts, args, console: Console) -> None:
    dynamic = DynamicTree(budget=fixed.num_nodes - 1, expand=4, width=4)
    runs = {
        "before: transformers cache, fixed tree": ("transformers fp32", fixed),
        "static cache": ("static fp32", fixed),
        "compile": ("compiled fp32", fixed),
        "dynamic tree": ("transformers fp32", dynamic),
        "int8 base": ("static int8", fixed),
        "bf16 base": ("static bf16", fixed),
        "static + dynamic + int8": ("static int8", dynamic),
        "all: static + compile + dynamic + bf16": ("compiled bf16", dynamic),
    }
    baseline_plain = None
    t = Table(title=f"speculative / plain on {len(prompts)} MT-Bench first turns x "
              f"{args.max_new_tokens} tokens, tree {args.tree} ({fixed.num_nodes - 1} nodes; "
              "dynamic trees: the same budget)")  # fmt: skip
    for col in ("features", "tau", "spec tok/s", "plain tok/s", "speedup",
                "spec vs fp32 plain", "same as plain"):  # fmt: skip
        t.add_column(col, justify="right")
    for label, (backend, tree) in runs.items():
        dec = backends.get(backend)
        r = compare(dec, tree, prompts, args.max_new_tokens)
        if baseline_plain is None:
            baseline_plain = r["plain"]
        vs_fp32 = r["spec"] / baseline_plain
        t.add_row(label, f"{r['tau']:.2f}", f"{r['spec']:.1f}", f"{r['plain']:.1f}",
                  f"{r['speedup']:.2f}x", f"{vs_fp32:.2f}x", r["same"])  # fmt: skip
    console.print(t)
    for name, dec in backends.decoders.items():
        if dec.compiled is not None:
            console.print(f"  {name}: {dec.compile_s:.0f} s compiling "
                          f"{len(dec.compiled_shapes)} graphs, not in any figure")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="runs/demo/train/heads")
    ap.add_argument("--prepared", default=None, help="prep output (default: the heads' own)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", default="sparse_15", help="the fixed tree of section 3")
    ap.add_argument("--compile-sizes", default="1,4,16,64")
    ap.add_argument("--sections", default="1,2,3")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=140)
    sections = {int(s) for s in args.sections.split(",")}

    if not Path(args.heads).is_dir():
        raise SystemExit(f"{args.heads} not found: run `make demo` first or pass --heads DIR")
    meta = read_meta(args.heads)
    base = load_base(recorded_base(meta["base"]["config"]))
    heads, meta = load_heads(args.heads, base.fingerprint())
    offset = int(meta.get("hidden_state_offset") or 0)
    backends = Backends(base.model, eos_ids(base.tokenizer, base.model), heads, offset)
    console.print(f"heads {args.heads} ({heads.arch}), {torch.get_num_threads()} threads")

    if 1 in sections:
        section_verify(backends, args, console)
    items, _ = suite_prompts("mt_bench", args.prompts, 0)
    prompts = [render_chat(base.tokenizer, [{"role": "user", "content": it.user_turns[0]}])
               for it in items]  # fmt: skip
    if 2 in sections:
        prepared = args.prepared or (meta.get("training") or {}).get("prepared")
        ds = prepared_rows(prepared)
        _, next_row = held_out_prompts(ds, 1, 1024)
        rows = calibration_rows(ds, next_row, from_group(CalibratedTree, "tree", "calibrated"))
        calib = calibrate(base.model, heads, rows, 10, offset)
        section_trees(backends.get("static fp32"), "static fp32", trees_to_try(heads, calib),
                      prompts[0], args.reps, console)  # fmt: skip
    if 3 in sections:
        fixed = Tree.from_paths(PRESETS[args.tree] if args.tree in PRESETS
                                else chain(heads.num_heads), heads.num_heads)  # fmt: skip
        section_features(backends, fixed, prompts, args, console)


if __name__ == "__main__":
    main()
