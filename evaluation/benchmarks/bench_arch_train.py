"""Training step time of each head architecture, side by side: what "equal training time" means.

Usage: python evaluation/benchmarks/bench_arch_train.py --data DIR [--sweep architectures_cpu]
       [--heads medusa,hydra,hydra_pp,hydra_eagle,hydra_cross_attn,eagle3] [--steps 12]
       [--warmup 3] [--repeats 2] [--threads N] [--head-override eagle3:head.num_heads=7 ...]
       [--budget-steps 1100] [--ref hydra_pp] [--override KEY=VALUE ...]

A `--heads` entry `NAME@LABEL` is a variant of head NAME with its own `--head-override
NAME@LABEL:KEY=VALUE`s, timed beside the others, e.g. the recipe's heads with frozen lm heads:
`--heads hydra_pp,hydra_pp@frozen --head-override hydra_pp@frozen:head.freeze_lm_heads=true`.

`--data` is a prepared dataset with cached hidden states (`prep cache_hidden=true`); EAGLE-3
also needs its three fused layers there (`prep from_prepared=DIR cache_hidden=true
'cache_aux_layers=[2,15,27]' out=DIR_E3`): without them eagle3 is left out, and the command that
adds them is printed.

Every head trains with the sweep's own shared train overrides (`conf/sweep/<sweep>.yaml`, its
`train:` list, with `trainer.max_steps` and the checkpoint and validation cadence replaced by
this run's step count), then any `--override`s (one GPU of a GPU sweep: `--override trainer=gpu
--override trainer.devices=1`), its own `head=<name>`, the sweep's `extra` for that head
(EAGLE-3's unrolled steps, not the step counts this measures) and any `--head-override`s. It
trains through Lightning's real Trainer on the same batches in the same order. Offline modules
are built once; online ones (the base runs each step) are rebuilt for each run, one base in
memory at a time. Runs are interleaved (medusa, hydra, ..., medusa, ...) `--repeats` times, and
the table reports each head's best run (the least disturbed by other load) with every run
beside it. The ratios come from one run of this script on one machine, measured side by side.

Columns: s/step; the ratio to the reference head (`--ref`, default the first); and how many
steps each head gets in the time the reference needs for `--budget-steps` steps (the sweep's
`trainer.max_steps` by default). Those are the step counts of an equal-training-time comparison.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from evaluation.benchmarks.bench_train import (  # noqa: E402
    Run,
    StepTimer,
    busy_processes,
    load_average,
    quiet_training,
)
from train.config import TrainConfig  # noqa: E402
from train.core.config import compose  # noqa: E402
from train.core.config import load as to_typed  # noqa: E402
from train.heads import HEADS  # noqa: E402
from train.recipe import build_module, make_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the sweep's keys this benchmark sets itself (its own step count, no checkpoints or validation)
OWN_KEYS = ("trainer.max_steps", "trainer.val_check_interval", "checkpoint_every", "out")
console = Console(width=120)


def _sweep_file(name: str) -> dict:
    path = ROOT / "conf" / "sweep" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise SystemExit(f"--sweep {name}: no {path}; choose one of {names}")
    return yaml.safe_load(path.read_text()) or {}


def _own(o: str) -> bool:
    return o.split("=", 1)[0].lstrip("+~") in OWN_KEYS


def sweep_train_overrides(name: str) -> list[str]:
    """The shared `train:` overrides of conf/sweep/<name>.yaml, minus the keys set here."""
    return [o for o in _sweep_file(name).get("train") or [] if not _own(o)]


def sweep_head_extras(name: str) -> dict[str, list[str]]:
    """The sweep's `extra` overrides of each `head=` grid value (e.g. EAGLE-3's unrolled
    steps), minus the step counts this benchmark is there to measure."""
    by_head = (_sweep_file(name).get("extra") or {}).get("head") or {}
    return {str(h): [o for o in overrides if not _own(o)] for h, overrides in by_head.items()}


def arch(head: str) -> str:
    """The head architecture of a `--heads` entry: 'hydra_pp@frozen' -> 'hydra_pp'."""
    return head.partition("@")[0]


def head_overrides(
    items: list[str], heads: list[str], base: dict[str, list[str]] | None = None
) -> dict[str, list[str]]:
    """['eagle3:head.num_heads=3'] -> {'eagle3': ['head.num_heads=3']}, after each head's
    overrides in `base` (the sweep's extras; a variant 'NAME@LABEL' starts from NAME's)."""
    out: dict[str, list[str]] = {h: list((base or {}).get(arch(h), [])) for h in heads}
    for item in items:
        head, sep, override = item.partition(":")
        if not sep or "=" not in override:
            raise SystemExit(f"--head-override {item!r}: write HEAD:key=value")
        if head not in out:
            raise SystemExit(f"--head-override {item!r}: {head} is not in --heads {heads}")
        out[head].append(override)
    return out


def has_aux_layers(data: Path) -> bool:
    import json

    stats = json.loads((data / "prep_stats.json").read_text())
    return bool(stats.get("cached_aux_layers"))


def train_cfg(args: argparse.Namespace, head: str, extra: list[str], out: Path) -> TrainConfig:
    total = args.warmup + args.steps
    overrides = [
        *sweep_train_overrides(args.sweep),
        *args.override,
        f"head={arch(head)}",
        *extra,
        f"data.prepared={args.data}",
        "logger=none",
        f"trainer.max_steps={total}",
        f"trainer.val_check_interval={total}",
        f"out={out}",
    ]
    return to_typed(compose("train", overrides), TrainConfig)


def run_lightning(cfg: TrainConfig, module, dm, total: int) -> Run:
    """`total` steps of the real Trainer (the config's precision, `auto` resolved), timed."""
    timer = StepTimer()
    trainer = make_trainer(
        cfg,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=dm)
    if trainer.global_step != total:
        raise RuntimeError(f"Lightning ran {trainer.global_step} steps, expected {total}")
    return timer.run


def report(
    runs: dict[str, list[Run]],
    params: dict[str, int],
    args: argparse.Namespace,
    threads: int,
    offline: bool,
) -> None:
    w = args.warmup
    best = {h: min(rs, key=lambda r: r.s_per_step(w)) for h, rs in runs.items()}
    ref_head = args.ref or next(iter(best))
    ref = best[ref_head].s_per_step(w)
    table = Table(
        title=f"{'offline' if offline else 'online'} training step, sweep={args.sweep} "
        f"(best of {args.repeats} runs, {threads} threads)"
    )
    cols = (
        "heads",
        "trainable",
        "s/step",
        "every run s/step",
        f"vs {ref_head}",
        f"time for {args.budget_steps:,} steps",
        f"steps in {ref_head}'s {args.budget_steps:,}-step time",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "heads" else "right")
    for head, r in best.items():
        s = r.s_per_step(w)
        table.add_row(
            head,
            f"{params[head] / 1e6:.1f}M",
            f"{s:.3f}",
            " ".join(f"{x.s_per_step(w):.3f}" for x in runs[head]),
            f"{s / ref:.2f}x",
            f"{s * args.budget_steps / 60:.1f} min",
            f"{round(args.budget_steps * ref / s):,}",
        )
    console.print(table)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="prepared data with hidden states")
    p.add_argument("--sweep", default="architectures_cpu", help="conf/sweep/<name>.yaml")
    p.add_argument(
        "--heads",
        default=",".join(HEADS),
        help="comma-separated head names; NAME@LABEL for a variant of one (see --head-override)",
    )
    p.add_argument("--head-override", action="append", default=[], metavar="HEAD:KEY=VALUE")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="for every head, after the sweep's (one GPU: trainer=gpu trainer.devices=1)",
    )
    p.add_argument("--steps", type=int, default=12, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (>= 1)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of each head")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--budget-steps", type=int, default=None, help="default: the sweep's")
    p.add_argument("--ref", default=None, help="the head whose budget the others match")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    args.data = args.data.expanduser().resolve()
    if not (args.data / "prep_stats.json").is_file():
        p.error(f"--data {args.data}: not a prepared dataset (no prep_stats.json)")
    if args.budget_steps is None:
        train = _sweep_file(args.sweep).get("train") or []
        steps = [o.split("=", 1)[1] for o in train if o.startswith("trainer.max_steps=")]
        args.budget_steps = int(steps[0]) if steps else 1000
    return args


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    threads = torch.get_num_threads()
    quiet_training()
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    unknown = [h for h in heads if arch(h) not in HEADS]
    if len(set(heads)) != len(heads):
        raise SystemExit(f"--heads {args.heads}: an entry twice; label variants NAME@LABEL")
    if unknown:
        raise SystemExit(f"--heads: unknown {unknown}; registered: {list(HEADS)}")
    extra = head_overrides(args.head_override, heads, sweep_head_extras(args.sweep))
    offline = train_cfg(args, heads[0], extra[heads[0]], Path("/nonexistent")).data.offline
    if offline and any(arch(h) == "eagle3" for h in heads) and not has_aux_layers(args.data):
        console.print(
            f"[yellow]eagle3 left out: {args.data} has no fused layers; add them with "
            f"`hydra-heads prep from_prepared={args.data} cache_hidden=true "
            f"'cache_aux_layers=[2,15,27]' out=DIR` and pass --data DIR[/yellow]"
        )
        heads = [h for h in heads if arch(h) != "eagle3"]
    if args.ref is not None and args.ref not in heads:  # before the runs, not after them
        raise SystemExit(f"--ref {args.ref}: not one of the heads timed ({', '.join(heads)})")
    console.print(f"load average before: {load_average()}; busy: {busy_processes()}")
    total = args.warmup + args.steps
    params: dict[str, int] = {}
    kept: dict[str, tuple] = {}  # offline: every head's module, built once

    def build(head: str) -> tuple:
        """The head's config, module and data. Offline modules are kept between runs. Online
        ones hold the frozen base, so each is rebuilt per run and one base is in memory at a
        time (the heads' initial weights are seeded: a rebuild starts from the same ones)."""
        if head in kept:
            return kept[head]
        cfg = train_cfg(args, head, extra[head], Path("/nonexistent/bench_arch_train") / head)
        module, dm, *_ = build_module(cfg)
        params[head] = sum(p.numel() for p in module.heads.parameters() if p.requires_grad)
        init = {k: v.clone() for k, v in module.heads.state_dict().items()}
        if offline:
            kept[head] = (cfg, module, dm, init)
        return cfg, module, dm, init

    console.print(f"{len(heads)} heads; {total} steps per run ({args.warmup} untimed)")
    runs: dict[str, list[Run]] = {h: [] for h in heads}
    for rep in range(args.repeats):
        for head in heads:
            cfg, module, dm, init = build(head)
            module.heads.load_state_dict(init)  # every run starts from the same weights
            pl.seed_everything(0, workers=True, verbose=False)
            r = run_lightning(cfg, module, dm, total)
            runs[head].append(r)
            del module, dm  # online: the base goes before the next one loads
            console.print(
                f"  run {rep + 1}/{args.repeats} {head:<17} {r.s_per_step(args.warmup):7.3f} "
                f"s/step  (load {load_average()})"
            )
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
    keys = {h: rs[0].batch_keys for h, rs in runs.items()}
    if len({tuple(k) for k in keys.values()}) != 1:
        raise RuntimeError("the heads saw different batches: the comparison is unfair")
    console.print("same batches for every head: yes")
    report(runs, params, args, threads, offline)
    console.print(
        f"load average after {load_average()}; busy now: {busy_processes()}; "
        f"wall time {time.perf_counter() - t_start:.0f} s"
    )


if __name__ == "__main__":
    main()
