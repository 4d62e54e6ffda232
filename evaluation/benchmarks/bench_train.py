"""Measure training step time: Lightning online vs a plain PyTorch loop vs Lightning offline.

Usage: python evaluation/benchmarks/bench_train.py [--steps 8] [--warmup 2] [--repeats 2]
       [--conversations 40] [--batch-size 4] [--max-length 512] [--keep-data DIR]
       [--precision 32-true|bf16-mixed] [--threads N]

First a small dataset is prepared in a temp dir (bundled ShareGPT, SmolLM2, hidden states
cached for offline training: the base runs over every sample, about 2-4 min for the default 40
conversations, 126 samples); `--keep-data DIR` prepares into DIR once and reuses it later.

Three variants then train the same heads (hydra_pp, 1 layer, 8,192-token draft vocab) from the
same initial weights on the same batches in the same order, `--warmup` + `--steps` optimizer
steps each:

  plain             `HeadsModule.compute(batch)` -> backward -> clip grad norm 1.0 -> AdamW ->
                    zero_grad -> LR scheduler, batches from `PreparedDataModule.train_dataloader()`
  lightning online  `Trainer.fit(HeadsModule)` with data.offline=false (frozen base forward)
  lightning offline the same with data.offline=true (cached hidden states, no base forward)

A step's time is the time between the ends of consecutive steps (data loading, forward,
backward, optimizer, LR schedule and Lightning's per-step bookkeeping all included); the warm-up
steps are excluded. The variants run interleaved (plain, online, offline, plain, online, ...)
`--repeats` times and the table reports the *best* run (least disturbed by other load), with
every run's figure beside it. The loss of each step is compared across variants: plain and
Lightning online must agree exactly (same math), offline up to the fp16 hidden-state cache.

`--precision bf16-mixed` runs every variant under CPU autocast (trainer.precision=bf16-mixed):
on CPUs with AVX512-BF16 / AMX it roughly halves both the online and the offline step.
Measured on one thread beside two other jobs (6 steps): online 13.4 s fp32 / 6.1 s bf16,
offline 5.2 s / 2.4 s; offline / online 2.56x (fp32) and 2.50x (bf16). On SmolLM2 the heads'
own work (the Hydra++ layer and four 8,192-token losses, forward and backward) is ~40% of an
online step: a 135M base is cheap next to its heads.

Targets: Lightning online <= 1.10x the plain loop's seconds/step; offline >= 3x online tokens/s.
The defaults took 22 min on 2 cores shared with another job (prep 4 min, online steps ~20 s);
`--repeats 1` and `--keep-data` shorten it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from data_prep.config import PrepConfig  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.core.config import compose  # noqa: E402
from train.core.config import load as to_typed  # noqa: E402
from train.data import PreparedDataModule  # noqa: E402
from train.module import HeadsModule  # noqa: E402
from train.recipe import build_module  # noqa: E402

OVERHEAD_TARGET = 1.10  # Lightning online s/step <= this x the plain loop's
OFFLINE_TARGET = 3.0  # offline tokens/s >= this x online tokens/s
VARIANTS = ("plain", "lightning online", "lightning offline")
console = Console(width=110)


@dataclass
class Run:
    """One timed run of one variant: per-step end times, in-step times, tokens and losses."""

    ends: list[float] = field(default_factory=list)  # perf_counter() at the end of each step
    in_step: list[float] = field(default_factory=list)  # batch in hand -> step done
    tokens: list[int] = field(default_factory=list)  # real (unpadded) tokens per step
    batch_keys: list[int] = field(default_factory=list)  # identifies the batch: same data?
    losses: list[float] = field(default_factory=list)

    def s_per_step(self, warmup: int) -> float:
        return (self.ends[-1] - self.ends[warmup - 1]) / (len(self.ends) - warmup)

    def in_step_s(self, warmup: int) -> float:
        return statistics.fmean(self.in_step[warmup:])

    def tokens_per_step(self, warmup: int) -> float:
        return statistics.fmean(self.tokens[warmup:])


def batch_key(batch: dict) -> int:
    ids = batch["input_ids"]
    pos = torch.arange(ids.numel(), dtype=torch.long).view_as(ids) % 9973
    return int(((ids + 1) * (pos + 1)).sum()) ^ (ids.shape[0] << 40) ^ (ids.shape[1] << 48)


def record_batch(run: Run, batch: dict, loss: torch.Tensor) -> None:
    run.tokens.append(int(batch["attention_mask"].sum()))
    run.batch_keys.append(batch_key(batch))
    run.losses.append(float(loss.detach()))


class StepTimer(pl.Callback):
    """Times each training batch: start and end of the step, as Lightning reports them."""

    def __init__(self) -> None:
        self.run = Run()
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        self.run.in_step.append(now - self._start)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        record_batch(self.run, batch, loss)
        # record_batch (~1 ms) falls inside every variant's step interval alike
        self.run.ends.append(time.perf_counter())


# -- configs, composed from conf/ exactly like the CLI does -------------------------------------
def ensure_prepared(out: Path, base: str, conversations: int, max_length: int) -> float:
    """Prepare (with cached hidden states) into `out` unless it is already there: seconds."""
    if (out / "prep_stats.json").is_file():
        console.print(f"reusing prepared data in {out}")
        return 0.0
    from data_prep.prepare import prepare

    overrides = [
        f"base={base}",
        f"data.max_conversations={conversations}",
        f"data.max_length={max_length}",
        "cache_hidden=true",
        f"out={out}",
    ]
    cfg = to_typed(compose("prep", overrides), PrepConfig)
    console.print(f"preparing {conversations} conversations with cached hidden states -> {out}")
    t0 = time.perf_counter()
    prepare(cfg)
    return time.perf_counter() - t0


def train_cfg(args: argparse.Namespace, data: Path, out: Path, offline: bool) -> TrainConfig:
    overrides = [
        f"base={args.base}",
        "head=hydra_pp",
        "head.num_layers=1",
        "head.draft_vocab_size=8192",
        f"data.prepared={data}",
        f"data.offline={str(offline).lower()}",
        f"data.batch_size={args.batch_size}",
        f"data.max_length={args.max_length}",
        "logger=none",
        f"trainer.max_steps={args.warmup + args.steps}",
        f"out={out}",
    ]
    return to_typed(compose("train", overrides), TrainConfig)


# -- the three variants ---------------------------------------------------------------------
def run_plain(module: HeadsModule, dm: PreparedDataModule, total: int, precision: str) -> Run:
    """The Lightning online step written out by hand: the reference for Lightning's overhead
    (bf16-mixed: the step under CPU autocast, as Lightning's precision plugin runs it)."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    run = Run()
    module.train()
    opt_conf = module.configure_optimizers()
    opt = opt_conf["optimizer"]
    sched = opt_conf["lr_scheduler"]["scheduler"]
    params = [p for g in opt.param_groups for p in g["params"]]
    dm.trainer = None  # a finished fit's trainer would make train_dataloader() skip batches
    batches = iter(dm.train_dataloader())
    with torch.enable_grad():
        for _ in range(total):
            batch = next(batches)
            t0 = time.perf_counter()
            with autocast:
                loss, _ = module.compute(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            run.in_step.append(time.perf_counter() - t0)
            record_batch(run, batch, loss)
            run.ends.append(time.perf_counter())
    return run


def run_lightning(module: HeadsModule, dm: PreparedDataModule, total: int, precision: str) -> Run:
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        precision=precision,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        gradient_clip_val=1.0,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=dm)
    if trainer.global_step != total:
        raise RuntimeError(f"Lightning ran {trainer.global_step} steps, expected {total}")
    return timer.run


# -- report ---------------------------------------------------------------------------------
def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def busy_processes() -> str:
    """Other processes using CPU now (the machine may be shared with another benchmark)."""
    cmd = ["ps", "-eo", "pid=,pcpu=,comm=", "--sort=-pcpu"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    rows = []
    for line in out.splitlines():
        pid, pcpu, comm = line.split(None, 2)
        if int(pid) != os.getpid() and float(pcpu) >= 20:
            rows.append(f"{comm}({pid}) {pcpu}%")
    return ", ".join(rows[:4]) or "none"


def verdict(ok: bool) -> str:
    return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"


def report(runs: dict[str, list[Run]], warmup: int, n_threads: int, precision: str) -> None:
    best = {v: min(rs, key=lambda r: r.s_per_step(warmup)) for v, rs in runs.items()}
    table = Table(
        title=f"training step time (best of {len(runs['plain'])} runs, {n_threads} threads, "
        f"precision {precision})"
    )
    for col in ("variant", "s/step", "every run s/step", "in-step s", "tokens/step", "tokens/s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in VARIANTS:
        r = best[v]
        s = r.s_per_step(warmup)
        tps = r.tokens_per_step(warmup)
        table.add_row(
            v,
            f"{s:.3f}",
            " ".join(f"{x.s_per_step(warmup):.3f}" for x in runs[v]),
            f"{r.in_step_s(warmup):.3f}",
            f"{tps:,.0f}",
            f"{tps / s:,.0f}",
        )
    console.print(table)

    plain, online, offline = (best[v] for v in VARIANTS)
    overhead = online.s_per_step(warmup) / plain.s_per_step(warmup)
    speedup = (offline.tokens_per_step(warmup) / offline.s_per_step(warmup)) / (
        online.tokens_per_step(warmup) / online.s_per_step(warmup)
    )
    ratios = Table(title="ratios")
    for col in ("ratio", "value", "target", "result"):
        ratios.add_column(col, justify="left" if col == "ratio" else "right")
    ratios.add_row(
        "Lightning online / plain loop (s/step)",
        f"{overhead:.3f}x",
        f"<= {OVERHEAD_TARGET:.2f}x",
        verdict(overhead <= OVERHEAD_TARGET),
    )
    ratios.add_row(
        "offline / online (tokens/s)",
        f"{speedup:.2f}x",
        f">= {OFFLINE_TARGET:.1f}x",
        verdict(speedup >= OFFLINE_TARGET),
    )
    console.print(ratios)


def check_same_work(runs: dict[str, list[Run]]) -> None:
    """Every run saw the same batches; plain and Lightning online computed the same losses."""
    ref = runs["plain"][0]
    for v, rs in runs.items():
        if any(r.batch_keys != ref.batch_keys for r in rs):
            raise RuntimeError(f"{v} saw other batches than plain: the comparison is unfair")

    def max_diff(variant: str) -> float:
        return max(
            abs(a - b) for r in runs[variant] for a, b in zip(r.losses, ref.losses, strict=True)
        )

    d_online, d_offline = max_diff("lightning online"), max_diff("lightning offline")
    console.print(
        f"same batches in every run: yes; max |loss - plain loss| per step: Lightning online "
        f"{d_online:.2e}, offline {d_offline:.2e} (fp16 hidden-state cache)"
    )
    if d_online > 1e-4 * max(1.0, max(abs(x) for x in ref.losses)):
        raise RuntimeError("Lightning online and the plain loop compute different losses")


# -- main -----------------------------------------------------------------------------------
def quiet_training() -> None:
    """Lightning's and datasets' per-run chatter off: the timings are the output."""
    for name in ("lightning.pytorch", "lightning.fabric", "train"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in (
        ".*does not have many workers.*",
        ".*max_steps=.* reached.*",
        ".*module\\(s\\) in eval mode.*",  # the frozen base
        ".*isinstance\\(treespec, LeafSpec\\).*",
        ".*`srun` command is available.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)
    import datasets

    datasets.disable_progress_bars()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (>= 1)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of each variant")
    p.add_argument("--conversations", type=int, default=40, help="ShareGPT conversations")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--base", default="smollm2_135m", help="conf/base/<name>.yaml")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--precision",
        default="32-true",
        choices=["32-true", "bf16-mixed"],
        help="Lightning precision of every variant (bf16-mixed: matmuls in bf16 under autocast)",
    )
    p.add_argument(
        "--keep-data",
        type=Path,
        default=None,
        metavar="DIR",
        help="prepare into DIR and keep it; reuse it if it is already prepared",
    )
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    n_threads = torch.get_num_threads()
    quiet_training()
    load_before = load_average()
    console.print(f"load average before: {load_before}; busy: {busy_processes()}")

    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        data = args.keep_data.expanduser().resolve() if args.keep_data else Path(tmp) / "data"
        prep_s = ensure_prepared(data, args.base, args.conversations, args.max_length)
        total = args.warmup + args.steps
        t0 = time.perf_counter()
        pl.seed_everything(0, workers=True, verbose=False)
        on_module, on_dm, *_ = build_module(train_cfg(args, data, Path(tmp) / "on", False))
        off_module, off_dm, *_ = build_module(train_cfg(args, data, Path(tmp) / "off", True))
        build_s = time.perf_counter() - t0
        n_train = len(on_dm.dd["train"])
        n_batches = len(on_dm.train_dataloader())
        if n_batches < total:
            raise SystemExit(
                f"{n_train} training samples make {n_batches} batches of {args.batch_size}, but "
                f"a run needs {total} (--warmup + --steps): raise --conversations"
            )
        console.print(
            f"data: {n_train} training samples ({n_batches} batches); prep {prep_s:.0f} s, "
            f"module build {build_s:.0f} s; {total} steps per run ({args.warmup} untimed)"
        )
        # Every run starts from the same head weights (and a fresh optimizer).
        init = {k: v.clone() for k, v in on_module.heads.state_dict().items()}
        runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        for rep in range(args.repeats):
            for v in VARIANTS:
                module, dm = (
                    (off_module, off_dm) if v == "lightning offline" else (on_module, on_dm)
                )
                module.heads.load_state_dict(init)
                torch.manual_seed(0)
                fn = run_plain if v == "plain" else run_lightning
                r = fn(module, dm, total, args.precision)
                runs[v].append(r)
                console.print(
                    f"  run {rep + 1}/{args.repeats} {v:<17} {r.s_per_step(args.warmup):7.3f} "
                    f"s/step  (load {load_average()})"
                )
                if torch.get_num_threads() != n_threads:
                    console.print(f"[yellow]threads changed to {torch.get_num_threads()}[/yellow]")
                    torch.set_num_threads(n_threads)

    check_same_work(runs)
    report(runs, args.warmup, n_threads, args.precision)
    console.print(
        f"load average before {load_before}, after {load_average()}; busy now: "
        f"{busy_processes()}; wall time {time.perf_counter() - t_start:.0f} s"
    )


if __name__ == "__main__":
    main()
