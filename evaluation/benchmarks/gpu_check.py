"""GPU check on one CUDA GPU (under 8 minutes on an H200): a randomly initialised ~1B Llama,
built from a config (no download), decoding and training on it.

Usage: bash evaluation/benchmarks/gpu_check.sh [--quick] [--sections verify,train]
       [--out DIR]   (or python evaluation/benchmarks/gpu_check.py ...)

Prints, and writes to <out>/gpu_check.json:
  1. verify: the cost of one bf16 base forward over n = 1, 2, 4, ..., 64 new tokens on a
     512-token KV cache (a chain's tree mask when n > 1), relative to a one-token step of the
     same backend: eager (the static cache, the grouped-KV SDPA kernel), torch.compile
     (inductor, no CUDA graphs) and torch.compile with CUDA graphs (mode=reduce-overhead,
     what eval.compile=true uses on CUDA). Goal: 64 tokens <= 1.2x a one-token step.
  2. train: a few Hydra++ training steps on the same model under trainer=gpu,
     deepspeed_zero2, deepspeed_zero3 and fsdp (one device each, bf16-mixed), each in a fresh
     process: seconds per step after a warm-up, and the measured peak of
     torch.cuda.max_memory_allocated against `hydra-heads plan`'s tensor estimate for the same
     config (the ratio; the plan is checked within 25% by tests/gpu on a small model).

The model: Llama shape hidden 2048, 16 layers, 32 heads (8 KV), MLP 8192, vocab 32000
(~1.1B parameters), from base=tiny_random with that shape; its tokenizer is the tiny byte-level
one, so the training data is synthetic counting chats, prepared by `hydra-heads prep`.
`--quick` shrinks the model to 4 layers and the sizes to 1, 16, 64 for a fast look. On a
machine without CUDA the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SIZES = (1, 2, 4, 8, 16, 32, 64)
SHAPE = {  # ~1.1B parameters
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
STRATEGIES = ("gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp")


def base_overrides(shape: dict) -> list[str]:
    out = ["base=tiny_random", "base.dtype=bfloat16"]
    return out + [
        f"base.tiny.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shape.items()
    ]


# -- 1. verify cost -------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# Over 80 lines: one measurement, from building the model to its table, as a script reads.
def verify_section(
    shape: dict, sizes: list[int], context: int, reps: int, device: str, backends: list[str]
) -> dict:
    from transformers import StaticCache

    from train.core.base import BaseConfig, load_base
    from train.core.config import from_group
    from train.decoding.backend import compile_body, forward, use_gqa_attention
    from train.decoding.cache import new_cache
    from train.decoding.tree import Tree, chain, tree_bias

    cfg = from_group(BaseConfig, "base", "tiny_random", dtype="bfloat16")
    cfg = BaseConfig(**{**cfg.model_dump(), "tiny": {**cfg.tiny.model_dump(), **shape}})
    t0 = time.perf_counter()
    model = load_base(cfg, device).model
    use_gqa_attention(model)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    built = time.perf_counter() - t0
    print(f"model: {params:.2f}B parameters, bf16, built in {built:.0f} s", flush=True)
    vocab, dtype = model.config.vocab_size, torch.bfloat16
    results: dict[str, dict[int, float]] = {}
    for backend in backends:
        body = None
        if backend == "cuda graphs":  # the decoder's eval.compile on CUDA
            body = compile_body(model)
        elif backend == "compiled":  # inductor without CUDA graphs
            body = torch.compile(model.model, dynamic=False)
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, vocab, (1, context), generator=g).to(device)
        cap = context + max(sizes)
        if body is None:
            cache = new_cache(model, cap)
        else:  # compiled graphs need a cache whose buffers keep their addresses
            cache = StaticCache(config=model.config, max_cache_len=cap)
        forward(model, prefix, torch.arange(context, device=device)[None], cache)
        costs = {}
        t_backend, compiling = time.perf_counter(), 0.0
        for n in sizes:
            x = torch.randint(0, vocab, (1, n), generator=g).to(device)
            pos = (context + torch.arange(n, device=device))[None]
            if body is None:
                mask = torch.zeros(1, 1, n, context + n, dtype=dtype, device=device)
            else:  # static shapes: the whole buffer, the unused slots masked out
                mask = torch.full((1, 1, n, cap), torch.finfo(dtype).min, dtype=dtype,
                                  device=device)  # fmt: skip
                mask[..., :context] = 0
            bias = tree_bias(Tree.from_paths(chain(n - 1)), dtype, device)
            mask[0, 0, :, context : context + n] = bias

            def once(x=x, pos=pos, n=n, mask=mask, cache=cache, body=body, model=model):
                forward(model, x, pos, cache, mask, 0, body)
                if body is None:
                    cache.crop(-n)
                else:
                    for layer in cache.layers:
                        layer.cumulative_length.fill_(context)

            tc = time.perf_counter()
            once()  # compiles its graph, if any
            sync(device)
            compiling += time.perf_counter() - tc
            for _ in range(2):  # warm
                once()
            sync(device)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                once()
                sync(device)
                times.append(time.perf_counter() - t)
            costs[n] = statistics.median(times)
        results[backend] = costs
        print(f"{backend}: {len(sizes)} sizes in {time.perf_counter() - t_backend:.0f} s "
              f"(first calls, compiling included, {compiling:.0f} s)", flush=True)  # fmt: skip
    print(f"\none bf16 forward of n tokens on a {context}-token cache / a one-token step (ms)")
    print(f"{'n':>4} " + " ".join(f"{b:>20}" for b in results))
    for n in sizes:
        cells = [f"{c[n] / c[1]:6.2f}x ({c[n] * 1e3:7.2f})" for c in results.values()]
        print(f"{n:>4} " + " ".join(f"{c:>20}" for c in cells))
    n = max(sizes)
    for b, c in results.items():
        verdict = "meets" if c[n] / c[1] <= 1.2 else "misses"
        print(f"  {b}: {n}-token verify = {c[n] / c[1]:.2f}x a one-token step ({verdict} 1.2x)")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {b: {str(n): s for n, s in c.items()} for b, c in results.items()}


# -- 2. training steps under each strategy --------------------------------------------------------
MEASURE = """
import json, sys, time
import lightning.pytorch as pl
import torch
from train.config import TrainConfig
from train.core.config import compose, load
from train.plan import base_arch, estimate
from train.recipe import fit

cfg = load(compose("train", sys.argv[1:]), TrainConfig)
est = estimate(cfg, base_arch(cfg.base))
t = {k: v for k, v in cfg.trainer.items() if k != "_target_"}
stamps = []

class Stamp(pl.Callback):
    def on_train_batch_end(self, *a, **k):
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())

def make(**kw):
    callbacks = [*kw.pop("callbacks", []), Stamp()]
    return pl.Trainer(**{**t, **kw, "callbacks": callbacks, "enable_progress_bar": False})

start = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
fit(cfg, make, False)
gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # the first two steps warm up
print(json.dumps({
    "plan_tensors": est["total"],
    "plan_overhead": est["runtime_overhead"],
    "peak_allocated": torch.cuda.max_memory_allocated() - start,
    "peak_reserved": torch.cuda.max_memory_reserved(),
    "step_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
    "steps": len(stamps),
}))
"""


def counting_chats(n: int) -> list[dict]:
    """Synthetic chats whose replies count on: learnable, and any length wanted."""
    rows = []
    for i in range(n):
        start, step = i % 50, 1 + i % 4
        reply = " ".join(str(start + step * j) for j in range(120))
        rows.append({"conversations": [
            {"from": "human", "value": f"count from {start} by {step}"},
            {"from": "gpt", "value": reply},
        ]})  # fmt: skip
    return rows


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "hydra-heads"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "launch"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout)


def train_section(shape: dict, steps: int, work: Path) -> dict:
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in counting_chats(100)))
    prepared = work / "prepared"
    r = cli("prep", "base=tiny_random", "data=jsonl", f"data.path={data}", f"out={prepared}",
            "data.val_fraction=0.05", "data.max_length=512")  # fmt: skip
    if r.returncode:
        raise SystemExit(f"prep failed:\n{r.stderr[-3000:]}")
    out: dict[str, dict] = {}
    for strategy in STRATEGIES:
        args = [
            *base_overrides(shape),
            "head=hydra_pp",
            f"trainer={strategy}",
            "trainer.devices=1",
            f"trainer.max_steps={steps}",
            "trainer.val_check_interval=100000",
            "final_validation=false",
            "logger=none",
            "data.batch_size=8",
            "data.max_length=512",
            f"data.prepared={prepared}",
            f"out={work / strategy}",
        ]
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True,
                           text=True, cwd=REPO, timeout=600)  # fmt: skip
        wall = time.perf_counter() - t
        if r.returncode:
            out[strategy] = {"error": r.stderr.strip().splitlines()[-1:] or ["?"], "wall_s": wall}
            print(f"{strategy}: FAILED after {wall:.0f} s: {r.stderr[-1500:]}", flush=True)
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["wall_s"] = wall
        res["plan_vs_peak"] = res["plan_tensors"] / res["peak_allocated"]
        out[strategy] = res
        print(f"{strategy}: {res['steps']} steps, {res['step_s']:.3f} s/step, peak "
              f"{res['peak_allocated'] / 2**30:.2f} GiB allocated, plan "
              f"{res['plan_tensors'] / 2**30:.2f} GiB (plan / peak {res['plan_vs_peak']:.2f}), "
              f"{wall:.0f} s in all", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers; verify sizes 1, 16, 64")
    ap.add_argument("--sections", default="verify,train")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None, help="where gpu_check.json goes (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layers")
    ap.add_argument("--device", default="cuda", help="cpu: the verify section's logic only")
    ap.add_argument("--backends", default="eager,compiled,cuda graphs")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        raise SystemExit(2)
    shape = dict(SHAPE, num_hidden_layers=4) if args.quick else dict(SHAPE)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    sizes = [1, 16, 64] if args.quick else list(SIZES)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out = Path(args.out) if args.out else work
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report: dict = {"device": name, "torch": torch.__version__, "shape": shape}
    t0 = time.perf_counter()
    sections = set(args.sections.split(","))
    if "verify" in sections:
        report["verify_s"] = verify_section(
            shape, sizes, args.context, args.reps, args.device, args.backends.split(",")
        )
    if "train" in sections:
        report["train"] = train_section(shape, args.steps, work)
    report["wall_s"] = time.perf_counter() - t0
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"\n{report['device']}: done in {report['wall_s']:.0f} s -> {out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
