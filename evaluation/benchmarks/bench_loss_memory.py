"""Compare peak memory and time of the chunked head loss with the naive all-logits reference.

Usage: python evaluation/benchmarks/bench_loss_memory.py [--small] [--chunk-size 1024]
       [--repeats 2] [--lm-weight 0 --distill-weight 1] [--kind kl|reverse_kl|jsd|tv|lk]

The default (SmolLM2 sizes, K=4, V=49152, N=4*1024, H=576) takes about 4-5 minutes on 2 cores:
one forward+backward costs ~70 s naive and ~45-55 s chunked there, mostly the four (N, H) x (H, V)
matmuls per head that both variants share. `--repeats 1` roughly halves it; `--small` takes
seconds, but at its sizes allocator caching blurs the memory numbers.

Each variant runs in a fresh subprocess (this script re-invoked with a hidden --variant flag):
a warm-up on a reduced problem, then the full inputs are built and `--repeats` timed passes of
forward+backward of the total loss run; the best time counts. Peak memory is the kernel's
resident-set high-water mark of that subprocess, VmHWM in /proc/self/status, reset
(`echo 5 > /proc/self/clear_refs`) right after the inputs are built; the number reported is the
VmHWM after the timed passes minus the RSS at the reset. It is exact, unlike a sampling thread
reading /proc/self/statm, which could miss a short spike and would compete for one of the cores.
`resource.getrusage(RUSAGE_SELF).ru_maxrss` is shown beside it as a cross-check only: it cannot
be reset, and after (v)fork + exec it starts at the *parent's* high-water mark. Where /proc is
missing, ru_maxrss is used. Loss and gradient equality of the two variants is checked on a small
problem in the parent process, after the subprocesses have run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch and train.losses are imported inside functions: the parent stays small while the
# subprocesses run, so their ru_maxrss (which starts at the parent's high-water mark) stays usable.

MEMORY_TARGET = 0.30  # chunked peak extra memory must be at most this fraction of naive's
TIME_TARGET = 1.2  # chunked forward+backward may take at most this multiple of naive's time
VARIANTS = ("naive", "chunked")
DEFAULTS = {"heads": 4, "vocab": 49152, "seq": 1024, "batch": 4, "hidden": 576, "chunk_size": 1024}
SMALL = {"heads": 4, "vocab": 8192, "seq": 256, "batch": 2, "hidden": 128, "chunk_size": 128}
CHECK = {"vocab": 2048, "seq": 96, "batch": 4, "hidden": 64, "chunk_size": 160}  # 384 rows: ragged


@dataclass(frozen=True)
class Problem:
    """Sizes and loss settings shared by both variants."""

    heads: int
    vocab: int
    seq: int
    batch: int
    hidden: int
    chunk_size: int
    lm_weight: float
    distill_weight: float
    temperature: float = 1.0
    kind: str = "kl"  # the distillation divergence (head.loss.kind)

    @property
    def n(self) -> int:
        return self.batch * self.seq

    @property
    def head_weights(self) -> list[float]:
        return [1.0] * self.heads  # constant w_k; decay does not change memory or time


@dataclass
class Inputs:
    """One problem's tensors: per-head states (N, H) and weights (V, H) require grad."""

    states: list[torch.Tensor]
    weights: list[torch.Tensor]
    targets: list[torch.Tensor]
    teacher_states: list[torch.Tensor]
    teacher_weight: torch.Tensor

    def params(self) -> list[torch.Tensor]:
        return [*self.states, *self.weights]


@dataclass
class Measurement:
    """What one variant's subprocess reports."""

    variant: str
    peak_extra_mib: float
    maxrss_extra_mib: float  # ru_maxrss cross-check (see the module docstring)
    baseline_mib: float
    seconds: list[float]  # timed runs
    warmup_s: float  # the reduced-size warm-up
    loss: float
    memory_source: str

    @property
    def best_s(self) -> float:
        return min(self.seconds)


def build_inputs(p: Problem, seed: int = 0) -> Inputs:
    """Random inputs with O(1) logits, built in place so no temporaries raise the baseline."""
    import torch

    g = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(p.hidden)

    def randn(*shape: int, std: float = 1.0, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g).mul_(std).requires_grad_(grad)

    return Inputs(
        states=[randn(p.n, p.hidden, grad=True) for _ in range(p.heads)],  # (N, H)
        weights=[randn(p.vocab, p.hidden, std=scale, grad=True) for _ in range(p.heads)],  # (V, H)
        targets=[torch.randint(0, p.vocab, (p.n,), generator=g) for _ in range(p.heads)],  # (N,)
        teacher_states=[randn(p.n, p.hidden) for _ in range(p.heads)],  # (N, H)
        teacher_weight=randn(p.vocab, p.hidden, std=scale),  # (V, H)
    )


def naive_total(x: Inputs, p: Problem) -> torch.Tensor:
    """(a) the reference: all K heads' logits as one [K, N, V] tensor, autograd backward."""
    from evaluation.benchmarks.naive_losses import naive_head_losses

    return naive_head_losses(
        x.states,
        x.weights,
        x.targets,
        x.teacher_states,
        x.teacher_weight,
        lm_weight=p.lm_weight,
        distill_weight=p.distill_weight,
        temperature=p.temperature,
        head_weights=p.head_weights,
        kinds={p.kind: 1.0},
    )


def chunked_total(x: Inputs, p: Problem) -> torch.Tensor:
    """(b) the training path: per head, chunk by chunk, gradient computed in the forward."""
    from train.losses import fused_head_loss

    terms = []
    for k in range(p.heads):
        out = fused_head_loss(
            x.states[k],
            x.weights[k],
            x.targets[k],
            base_top1=x.targets[k],
            teacher_state=x.teacher_states[k],
            teacher_weight=x.teacher_weight,
            lm_weight=p.lm_weight,
            distill_weight=p.distill_weight,
            temperature=p.temperature,
            chunk_size=p.chunk_size,
            kinds={p.kind: 1.0},
        )
        terms.append(p.head_weights[k] * out.loss)
    return sum(terms)  # 0 + the first term is that term exactly


TotalFn = Callable[[Inputs, Problem], "torch.Tensor"]
TOTALS: dict[str, TotalFn] = {"naive": naive_total, "chunked": chunked_total}


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_high_water() -> bool:
    """Reset this process's VmHWM to its current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


def maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def forward_backward(total_fn: TotalFn, x: Inputs, p: Problem) -> tuple[float, float]:
    """One timed forward+backward of the total loss from fresh grads: (seconds, loss)."""
    for t in x.params():
        t.grad = None  # every run allocates its .grad tensors, as the first one does
    t0 = time.perf_counter()
    total = total_fn(x, p)
    total.backward()
    seconds = time.perf_counter() - t0
    return seconds, total.item()


def run_variant(variant: str, p: Problem, repeats: int) -> Measurement:
    """Warm up on a reduced problem, build the inputs, reset the high-water mark, then run
    `repeats` timed forward+backward passes; the peak is over all of them."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    total_fn = TOTALS[variant]
    # The warm-up takes the same code path on a reduced problem (at full size one pass costs
    # about a minute on 2 cores and runs no faster afterwards). It triggers the one-time lazy
    # initialisation (thread pool, kernels), whose memory must not count as the loss's.
    warm = replace(
        p,
        heads=min(p.heads, 2),
        vocab=min(p.vocab, 8192),
        batch=1,
        seq=min(p.seq, 2 * min(p.chunk_size, 128)),
        chunk_size=min(p.chunk_size, 128),
    )
    warmup_s, _ = forward_backward(total_fn, build_inputs(warm), warm)
    x = build_inputs(p)
    gc.collect()
    use_proc = reset_high_water()
    baseline_kib = _proc_status_kib("VmRSS") if use_proc else maxrss_kib()
    maxrss0 = maxrss_kib()
    times: list[float] = []
    loss = float("nan")
    for _ in range(repeats):
        seconds, loss = forward_backward(total_fn, x, p)
        times.append(seconds)
        gc.collect()
    peak_kib = _proc_status_kib("VmHWM") if use_proc else maxrss_kib()
    return Measurement(
        variant=variant,
        peak_extra_mib=(peak_kib - baseline_kib) / 1024,
        maxrss_extra_mib=(maxrss_kib() - maxrss0) / 1024,
        baseline_mib=baseline_kib / 1024,
        seconds=times,
        warmup_s=warmup_s,
        loss=loss,
        memory_source="VmHWM" if use_proc else "ru_maxrss",
    )


def measure_in_subprocess(variant: str, p: Problem, repeats: int) -> Measurement:
    """Re-invoke this script for one variant; it prints its Measurement as the last stdout line."""
    script = os.path.abspath(__file__)
    cmd = [sys.executable, script, f"--variant={variant}", f"--repeats={repeats}"]
    for name in (*DEFAULTS, "lm_weight", "distill_weight", "kind"):  # the problem, as flags
        cmd.append(f"--{name.replace('_', '-')}={getattr(p, name)}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr passes through
    if proc.returncode != 0:
        hint = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
        raise SystemExit(f"{variant} subprocess failed with exit code {proc.returncode}{hint}")
    return Measurement(**json.loads(proc.stdout.strip().splitlines()[-1]))


@dataclass
class Check:
    """Loss and gradient agreement of the two variants on a small problem."""

    problem: Problem
    loss_naive: float
    loss_abs_diff: float
    grad_state_max_diff: float
    grad_weight_max_diff: float
    grad_state_scale: float
    grad_weight_scale: float

    @property
    def ok(self) -> bool:
        loss_ok = self.loss_abs_diff <= 1e-5 * max(1.0, abs(self.loss_naive))
        states_ok = self.grad_state_max_diff <= 1e-4 * self.grad_state_scale
        weights_ok = self.grad_weight_max_diff <= 1e-4 * self.grad_weight_scale
        return loss_ok and states_ok and weights_ok


def check_equal(p: Problem) -> Check:
    """Run both variants on the same small inputs (a ragged last chunk included) and compare."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    results = {}
    for variant, total_fn in TOTALS.items():
        x = build_inputs(p, seed=1)
        total = total_fn(x, p)
        total.backward()
        results[variant] = (total.item(), x)
    (loss_a, a), (loss_b, b) = results["naive"], results["chunked"]

    def max_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
        return max((u.grad - v.grad).abs().max().item() for u, v in zip(xs, ys, strict=True))

    def max_abs(xs: list[torch.Tensor]) -> float:
        return max(u.grad.abs().max().item() for u in xs)

    return Check(
        problem=p,
        loss_naive=loss_a,
        loss_abs_diff=abs(loss_a - loss_b),
        grad_state_max_diff=max_diff(a.states, b.states),
        grad_weight_max_diff=max_diff(a.weights, b.weights),
        grad_state_scale=max_abs(a.states),
        grad_weight_scale=max_abs(a.weights),
    )


def verdict(ok: bool) -> str:
    return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"


def print_report(
    results: dict[str, Measurement], p: Problem, check: Check, repeats: int, load: list[float]
) -> None:
    from rich.console import Console
    from rich.table import Table

    naive, chunked = results["naive"], results["chunked"]
    mem_ratio = chunked.peak_extra_mib / naive.peak_extra_mib
    time_ratio = chunked.best_s / naive.best_s
    logits_mib = p.heads * p.n * p.vocab * 4 / 2**20
    chunk_mib = min(p.chunk_size, p.n) * p.vocab * 4 / 2**20
    title = (
        f"head loss forward+backward: K={p.heads} heads, V={p.vocab:,}, N=B*T={p.batch}*{p.seq}"
        f"={p.n:,}, H={p.hidden}, chunk {p.chunk_size}, lm_weight={p.lm_weight:g}, "
        f"distill_weight={p.distill_weight:g} ({p.kind}), T={p.temperature:g}; "
        f"{os.cpu_count()} CPUs, best of {repeats} after a reduced-size warm-up"
    )
    table = Table(title=title)
    targets = (f"target <= {MEMORY_TARGET:.2f}x", f"target <= {TIME_TARGET:.1f}x")
    for col in ("variant", "peak extra MiB", "ru_maxrss extra MiB", "time (s)",
                "memory vs naive", targets[0], "time vs naive", targets[1], "notes"):  # fmt: skip
        justify = "left" if col in ("variant", "notes") else "center" if col in targets else "right"
        table.add_column(col, justify=justify)
    for m in (naive, chunked):
        is_ref = m is naive
        runs = ", ".join(f"{s:.2f}" for s in m.seconds)
        note = f"runs {runs}s, warm-up {m.warmup_s:.2f}s; loss {m.loss:.6g}"
        if is_ref:
            note += f"; K*N*V fp32 logits alone = {logits_mib:,.0f} MiB"
        else:
            note += f"; one chunk x V fp32 = {chunk_mib:,.0f} MiB"
        table.add_row(
            "(a) naive_head_losses" if is_ref else f"(b) fused_head_loss, chunk {p.chunk_size}",
            f"{m.peak_extra_mib:,.0f}",
            f"{m.maxrss_extra_mib:,.0f}",
            f"{m.best_s:.2f}",
            "1.00x" if is_ref else f"{mem_ratio:.2f}x",
            "-" if is_ref else verdict(mem_ratio <= MEMORY_TARGET),
            "1.00x" if is_ref else f"{time_ratio:.2f}x",
            "-" if is_ref else verdict(time_ratio <= TIME_TARGET),
            note,
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped to a file or a log: do not wrap at 80 columns
    console.print(table)
    console.print(
        f"memory: peak resident set over the post-input baseline ({naive.memory_source}; "
        f"baselines naive {naive.baseline_mib:,.0f} MiB, chunked {chunked.baseline_mib:,.0f} MiB)"
    )
    console.print(
        f"chunked / naive memory = {mem_ratio:.3f}x (target <= {MEMORY_TARGET}x): "
        f"{'PASS' if mem_ratio <= MEMORY_TARGET else 'FAIL'}"
    )
    console.print(
        f"chunked / naive time   = {time_ratio:.3f}x (target <= {TIME_TARGET}x): "
        f"{'PASS' if time_ratio <= TIME_TARGET else 'FAIL'}"
    )
    c = check.problem
    console.print(
        f"equality check (K={c.heads}, V={c.vocab}, N={c.n}, H={c.hidden}, chunk {c.chunk_size}): "
        f"|loss diff| = {check.loss_abs_diff:.3g} (loss {check.loss_naive:.6g}), "
        f"max |grad diff| states = {check.grad_state_max_diff:.3g} "
        f"(max |grad| {check.grad_state_scale:.3g}), "
        f"weights = {check.grad_weight_max_diff:.3g} (max |grad| {check.grad_weight_scale:.3g}): "
        f"{'PASS' if check.ok else 'FAIL'}"
    )
    busy = load[0] > 0.5
    console.print(
        f"1-min load average before / after: {load[0]:.2f} / {load[1]:.2f}"
        + (" -- other processes were using the cores: times are not reliable" if busy else "")
    )
    console.print(
        f"full-size |loss naive - loss chunked| = {abs(naive.loss - chunked.loss):.3g} "
        "(from the subprocesses, same seed)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, help=f"K heads ({DEFAULTS['heads']})")
    parser.add_argument("--vocab", type=int, help=f"V, vocab size ({DEFAULTS['vocab']})")
    parser.add_argument("--seq", type=int, help=f"T, sequence length ({DEFAULTS['seq']})")
    parser.add_argument("--batch", type=int, help=f"B, batch size ({DEFAULTS['batch']})")
    parser.add_argument("--hidden", type=int, help=f"H, hidden size ({DEFAULTS['hidden']})")
    parser.add_argument(
        "--chunk-size", type=int, help=f"fused_head_loss chunk_size ({DEFAULTS['chunk_size']})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs after a reduced-size warm-up; the best counts (2)",
    )
    parser.add_argument(
        "--lm-weight", type=float, default=0.0, help="CE weight (0, the Hydra++ recipe)"
    )
    parser.add_argument(
        "--distill-weight", type=float, default=1.0, help="KL weight (1, the Hydra++ recipe)"
    )
    parser.add_argument(
        "--kind",
        default="kl",
        choices=("kl", "reverse_kl", "jsd", "tv", "lk"),
        help="distillation divergence, head.loss.kind (kl)",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="quick run: " + ", ".join(f"{k}={v}" for k, v in SMALL.items()),
    )
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # subprocess mode
    args = parser.parse_args(argv)
    preset = SMALL if args.small else DEFAULTS
    sizes = {k: preset[k] if getattr(args, k) is None else getattr(args, k) for k in DEFAULTS}
    if min(sizes.values()) < 1 or args.repeats < 1:
        parser.error("sizes, --chunk-size and --repeats must be positive integers")
    if args.lm_weight < 0 or args.distill_weight < 0 or args.lm_weight + args.distill_weight == 0:
        parser.error("--lm-weight and --distill-weight must be >= 0 and not both 0")
    p = Problem(
        **sizes, lm_weight=args.lm_weight, distill_weight=args.distill_weight, kind=args.kind
    )

    if args.variant:
        print(json.dumps(asdict(run_variant(args.variant, p, args.repeats))))
        return

    load_before = os.getloadavg()[0]
    results = {}
    for variant in VARIANTS:
        print(f"running {variant} in a subprocess ...", file=sys.stderr, flush=True)
        results[variant] = measure_in_subprocess(variant, p, args.repeats)
    # After the subprocesses: the parent's high-water mark would leak into their ru_maxrss.
    small = Problem(
        heads=p.heads, **CHECK, lm_weight=p.lm_weight, distill_weight=p.distill_weight, kind=p.kind
    )
    check = check_equal(small)
    print_report(results, p, check, args.repeats, [load_before, os.getloadavg()[0]])


if __name__ == "__main__":
    main()
