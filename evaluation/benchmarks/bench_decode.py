"""Where speculative decoding pays on this machine: verify cost, break-even tau, and the
speedup each decode-backend feature buys, measured side by side in one run.

Usage: python evaluation/benchmarks/bench_decode.py [--heads runs/demo/train/heads]
       [--prompts 4] [--max-new-tokens 64] [--context 300] [--reps 5] [--threads 2]
       [--tree sparse_15] [--batch 4] [--skip compiled fp32,...] [--sections 1,2,3]

Prints:
  1. the cost of one base forward over n = 1, 2, 4, ..., 64 new tokens on a `--context`-token
     KV cache (the verify pass of an (n-1)-node tree, tree mask included) relative to a
     one-token step of the same backend: the engine's cache with transformers' sdpa attention,
     and with the grouped-KV kernel in float32 (with the standard weight layout and with
     eval.weight_layout=auto's oneDNN-packed copies), bf16 and int8. Goal: 16 tokens <= 1.3x.
  2. per tree (chain, sparse presets, calibrated trees of several sizes, dynamic trees), on the
     float32 base (and the bf16 one on a CPU with bf16 units; `--tree-backends`): the whole
     speculative step (a real 24-token decode, per base forward) relative to a plain step,
     which is the break-even tau (speculation pays when tau exceeds it), beside its tau, and
     where the step's time goes: propose, verify (the base's body), project (the base's
     output projection over the nodes acceptance reads), bookkeeping.
  3. speculative / plain wall clock on MT-Bench first turns (both decoded in the same run,
     interleaved, on the same backend) per backend and tree: float32, int8, bf16, compiled,
     fixed and dynamic trees, batch 1 and `--batch`; with each one's per-step breakdown and
     the share of propose + bookkeeping in a step. Goals: >= 1.5x on a bf16 base and >= 1.2x on
     float32 with the one-hour recipe's heads, >= 1.0x at batch 4 in bf16, propose +
     bookkeeping <= 15% of a step. Compile time is printed apart and is in no figure.

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

from evaluation.calibrate import calibrate  # noqa: E402
from evaluation.config import CalibratedTree  # noqa: E402
from evaluation.evaluate import calibration_rows, render_chat  # noqa: E402
from evaluation.suites import suite_prompts  # noqa: E402
from train.core.base import load_base, recorded_base  # noqa: E402
from train.core.checkpoint import read_meta  # noqa: E402
from train.core.config import from_group  # noqa: E402
from train.core.hardware import cpu_has_bf16  # noqa: E402
from train.core.prompts import held_out_prompts, prepared_rows  # noqa: E402
from train.decoding.backend import (  # noqa: E402
    forward,
    quantize_base,
    use_gqa_attention,
    use_weight_layout,
)
from train.decoding.cache import new_cache  # noqa: E402
from train.decoding.decoder import Decoder  # noqa: E402
from train.decoding.dynamic import DynamicTree  # noqa: E402
from train.decoding.generation import STEP_PARTS, Generation  # noqa: E402
from train.decoding.sampling import eos_ids  # noqa: E402
from train.decoding.tree import PRESETS, Tree, chain, grow, tree_bias  # noqa: E402
from train.heads import load_heads  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64)
# backend name -> (base weights, compiled, transformers' own attention, weight layout)
BACKENDS = {
    "hf-attention fp32": ("none", False, True, "standard"),
    "fp32 standard layout": ("none", False, False, "standard"),
    "fp32": ("none", False, False, "auto"),
    "bf16": ("bf16", False, False, "auto"),
    "int8": ("int8", False, False, "auto"),
    "compiled fp32": ("none", True, False, "standard"),  # inductor prepacks its own
    "compiled bf16": ("bf16", True, False, "standard"),
}
EAGER = [name for name, (_, compiled, *_) in BACKENDS.items() if not compiled]


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Backends:
    """One Decoder per backend over copies of one float32 base and its heads."""

    def __init__(self, model, eos, heads, offset):
        self.model, self.eos, self.heads, self.offset = model, eos, heads, offset
        self.decoders: dict[str, Decoder] = {}

    def get(self, name: str) -> Decoder:
        if name not in self.decoders:
            quant, compiled, hf_attention, layout = BACKENDS[name]
            model = quantize_base(copy.deepcopy(self.model), quant)
            if not hf_attention:
                use_gqa_attention(model)
            dec = Decoder(
                model,
                self.eos,
                copy.deepcopy(self.heads),
                hidden_state_offset=self.offset,
                compile=compiled,
            )
            use_weight_layout(dec.model, dec.heads, layout=layout)
            self.decoders[name] = dec
        return self.decoders[name]


def verify_cost(dec: Decoder, context: int, n: int, reps: int) -> float:
    """Seconds of one base forward of n tokens (a chain's tree mask when n > 1) after a
    `context`-token prefix, the cache cut back to the prefix after each."""
    torch.manual_seed(0)
    vocab = dec.model.config.vocab_size
    cache = new_cache(dec.model, context + 64)
    prefix = torch.randint(0, vocab, (1, context))
    forward(dec.model, prefix, torch.arange(context)[None], cache)
    x = torch.randint(0, vocab, (1, n))
    mask = None
    if n > 1:
        mask = torch.zeros(1, 1, n, context + n, dtype=dec.dtype)
        mask[0, 0, :, context:] = tree_bias(Tree.from_paths(chain(n - 1)), dec.dtype)
    pos = (context + torch.arange(n))[None]

    def run() -> None:
        forward(dec.model, x, pos, cache, mask)
        cache.crop(-n)  # drop the n new entries

    return median_time(run, reps)


def breakdown(gens: list[Generation]) -> tuple[float, float, float, float, float]:
    """Per base forward: propose, verify, project, bookkeeping ms, and propose +
    bookkeeping's share of the step (the base's own output projection counted apart)."""
    steps = max(max(g.steps for g in gens), 1)
    p, v, o, b = (1e3 * sum(getattr(g, f"{k}_s") for g in gens) / steps for k in STEP_PARTS)
    return p, v, o, b, (p + b) / max(p + v + o + b, 1e-9)


def section_verify(backends: Backends, args, console: Console) -> None:
    t = Table(title=f"one base forward of n tokens on a {args.context}-token cache, "
              "relative to a one-token step of the same backend (ms in brackets)")  # fmt: skip
    t.add_column("n", justify="right")
    costs: dict[str, dict[int, float]] = {}
    for name in EAGER:
        dec = backends.get(name)
        costs[name] = {n: verify_cost(dec, args.context, n, args.reps) for n in SIZES}
        t.add_column(name, justify="right")
    for n in SIZES:
        cells = []
        for name in EAGER:
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
    # a recurrent head set drafts any depth (depth_limit None); its chain: draft_depth levels
    limit = heads.depth_limit
    trees: dict[str, Tree | DynamicTree] = {"chain": Tree.from_paths(chain(heads.draft_depth))}
    for name in ("sparse_7", "sparse_15", "mc_sim_7b_63"):
        trees[name] = Tree.from_paths(PRESETS[name], limit)
    for n in (4, 8, 16, 32):
        trees[f"calibrated_{n}"] = Tree.from_paths(grow(calib.acc, n), limit)
    for n in (8, 16, 32):
        trees[f"dynamic_{n}"] = DynamicTree(budget=n, expand=4, width=4)
    return trees


def section_trees(dec: Decoder, name: str, trees, prompt, reps, console: Console) -> None:
    dec.set_tree(Tree.from_paths([]))
    plain = dec.decode_step_seconds(prompt, 24, reps)
    t = Table(title=f"speculative step vs plain step ({plain * 1e3:.1f} ms) on {name}, after a "
              f"{len(prompt)}-token prompt: break-even tau = step / plain")  # fmt: skip
    for col in ("tree", "nodes", "step ms", "break-even tau", "tau (24-token decode)",
                "propose / verify / project / bookkeeping ms",
                "propose+bookkeeping"):  # fmt: skip
        t.add_column(col, justify="right")
    for tname, tree in trees.items():
        dec.set_tree(tree)
        step = dec.decode_step_seconds(prompt, 24, reps)
        gen = dec.speculative([prompt], 24)[0]
        p, v, o, b, share = breakdown([gen])
        nodes = tree.budget if isinstance(tree, DynamicTree) else tree.num_nodes - 1
        split = f"{p:.1f} / {v:.1f} / {o:.1f} / {b:.1f}"
        t.add_row(tname, str(nodes), f"{step * 1e3:.1f}", f"{step / plain:.2f}",
                  f"{gen.tau:.2f}", split, f"{share:.0%}")  # fmt: skip
    dec.forget_kept()  # the prefill the timed decodes shared
    console.print(t)


def compare(dec: Decoder, tree, prompts, max_new: int, batch: int = 1) -> dict:
    """Speculative and plain decoding of `prompts` on `dec`, `batch` at a time, interleaved."""
    dec.set_tree(tree)
    dec.speculative(prompts[:batch], 8)  # warm-up (and, when compiled, compile) both paths
    dec.plain(prompts[:batch], 8)
    spec: list[Generation] = []
    plain: list[Generation] = []
    shares = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        order = ("spec", "plain") if (i // batch) % 2 == 0 else ("plain", "spec")
        out = {w: (dec.speculative if w == "spec" else dec.plain)(group, max_new) for w in order}
        spec += out["spec"]
        plain += out["plain"]
        shares.append(breakdown(out["spec"]))
    steps = sum(g.steps for g in spec)
    spec_tok = sum(len(g.tokens) for g in spec) / sum(g.total_s for g in spec)
    plain_tok = sum(len(g.tokens) for g in plain) / sum(g.total_s for g in plain)
    p, v, o, b = (statistics.mean(x[j] for x in shares) for j in range(4))
    return {
        "tau": (sum(sum(g.accepted) for g in spec) + steps) / max(steps, 1),
        "spec": spec_tok,
        "plain": plain_tok,
        "speedup": spec_tok / plain_tok,
        "same": f"{sum(s.tokens == q.tokens for s, q in zip(spec, plain, strict=True))}"
        f"/{len(prompts)}",
        "breakdown": f"{p:.1f} / {v:.1f} / {o:.1f} / {b:.1f}",
        "overhead": (p + b) / max(p + v + o + b, 1e-9),
    }


def section_features(backends: Backends, fixed: Tree, prompts, args, console: Console) -> None:
    dynamic = DynamicTree(budget=fixed.num_nodes - 1, expand=4, width=4)
    runs = {
        "fp32 standard layout": ("fp32 standard layout", fixed, 1),
        "fp32": ("fp32", fixed, 1),
        "fp32, dynamic tree": ("fp32", dynamic, 1),
        "int8": ("int8", fixed, 1),
        "bf16": ("bf16", fixed, 1),
        "bf16, dynamic tree": ("bf16", dynamic, 1),
        f"bf16, batch {args.batch}": ("bf16", fixed, args.batch),
        "compiled fp32": ("compiled fp32", fixed, 1),
        "compiled bf16": ("compiled bf16", fixed, 1),
    }
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    t = Table(title=f"speculative / plain on {len(prompts)} MT-Bench first turns x "
              f"{args.max_new_tokens} tokens, tree {args.tree} ({fixed.num_nodes - 1} nodes; "
              "dynamic trees: the same budget)")  # fmt: skip
    for col in ("backend", "tau", "spec tok/s", "plain tok/s", "speedup", "same as plain",
                "propose / verify / project / bookkeeping ms",
                "propose+bookkeeping"):  # fmt: skip
        t.add_column(col, justify="right")
    for label, (backend, tree, batch) in runs.items():
        if label in skip or backend in skip:
            continue
        r = compare(backends.get(backend), tree, prompts, args.max_new_tokens, batch)
        t.add_row(label, f"{r['tau']:.2f}", f"{r['spec']:.1f}", f"{r['plain']:.1f}",
                  f"{r['speedup']:.2f}x", r["same"], r["breakdown"],
                  f"{r['overhead']:.0%}")  # fmt: skip
        console.print(f"  {label}: {r['speedup']:.2f}x at tau {r['tau']:.2f}")
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
    ap.add_argument("--batch", type=int, default=4, help="the batched row of section 3")
    ap.add_argument("--skip", default="", help="section 3 rows to leave out, e.g. compiled")
    ap.add_argument("--sections", default="1,2,3")
    ap.add_argument("--tree-backends", default="fp32,bf16" if cpu_has_bf16() else "fp32",
                    help="section 2's backends (default: fp32, and bf16 on a CPU with bf16 "
                    "units)")  # fmt: skip
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
        if prepared is None:
            raise SystemExit(
                f"{args.heads} names no prep output (heads from before it was recorded): "
                "pass --prepared DIR, the prep output the heads were trained on"
            )
        ds = prepared_rows(prepared)
        _, next_row = held_out_prompts(ds, 1, 1024)
        rows = calibration_rows(ds, next_row, from_group(CalibratedTree, "tree", "calibrated"))
        calib = calibrate(base.model, heads, rows, 10, offset)
        for name in args.tree_backends.split(","):
            section_trees(backends.get(name.strip()), name.strip(), trees_to_try(heads, calib),
                          prompts[0], args.reps, console)  # fmt: skip
    if 3 in sections:
        fixed = Tree.from_paths(PRESETS[args.tree] if args.tree in PRESETS
                                else chain(heads.draft_depth), heads.depth_limit)  # fmt: skip
        section_features(backends, fixed, prompts, args, console)


if __name__ == "__main__":
    main()
