"""`hydra-heads sweep`: train + eval every grid point (locally or as SLURM jobs), then report."""

from __future__ import annotations

from typing import Any

CONFIG_NAME = "sweep"
# A working command line, shown when a required key is missing.
EXAMPLE = (
    "hydra-heads sweep sweep=architectures out=runs/arch "
    "'train_args=[\"data.prepared=runs/demo/data\"]'"
)


def run(cfg) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from launch.config import SweepConfig
    from launch.sweep import run_sweep
    from train.core.config import load

    typed = load(cfg, SweepConfig, EXAMPLE)
    state = run_sweep(typed)
    if typed.dry_run or typed.backend == "slurm":
        return state
    if typed.worker is not None:  # one of a search's workers: the others' trials may still run
        print(f"search worker {typed.worker}: no trial left to ask for")
        return state
    from rich.markup import escape

    mine = [p for p in state["points"] if typed.only is None or p["train_point"] == typed.only]
    t = Table(title=f"sweep {typed.sweep.name}: {typed.out}")
    for col in ("point", "status", "seconds", "note"):
        t.add_column(col)
    for p in mine:
        t.add_row(
            escape(p["name"]), p["status"], str(p.get("seconds", "")), escape(p.get("error", ""))
        )
    Console().print(t)
    failed = [p["name"] for p in mine if p["status"] != "done"]
    print(f"report: {typed.out}/report/report.md")
    if failed:
        raise SystemExit(f"error: {len(failed)} point(s) not done: {', '.join(failed)}")
    return state


if __name__ == "__main__":
    import sys

    from launch.cli import main

    main(["sweep", *sys.argv[1:]])
