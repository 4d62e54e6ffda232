"""`hydra-heads report`: read train / eval / sweep dirs, write report.{json,md,html} + plots."""

from __future__ import annotations

from typing import Any

CONFIG_NAME = "report"
# A working command line, shown when a required key is missing.
EXAMPLE = "hydra-heads report runs=[runs/demo] out=runs/demo/report"


def print_leaderboard(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from evaluation.report import fmt

    t = Table(title=f"{data['title']} (by {data['sort_by']})")
    for col in ("#", "run", "arch", "tau", "speedup", "tau est.", "tree", "val loss"):
        t.add_column(col, justify="left" if col in ("run", "arch") else "right")
    for r in data["leaderboard"]:
        t.add_row(
            str(r["rank"]),
            r["name"],
            fmt(r["arch"]),
            fmt(r["tau"]),
            fmt(r["speedup"], 2),
            fmt(r["tau_est"]),
            fmt(r["tree_nodes"]),
            fmt(r["val_loss"], 2),
        )
    Console().print(t)
    pair = data.get("paired")
    if pair:  # τ against the first run, paired over the same prompts
        from evaluation.stats import with_ci

        p = Table(title=f"tau against {pair['reference']} on the same prompts (paired)")
        for col in ("run", "items", "tau ratio [95% CI]", "tau difference [95% CI]"):
            p.add_column(col, justify="left" if col == "run" else "right")
        for r in pair["rows"]:
            p.add_row(
                r["name"],
                str(r["items"]),
                with_ci(r["ratio"], r["ratio_ci95"], ".3f", "x"),
                with_ci(r["diff"], r["diff_ci95"], "+.3f"),
            )
        Console().print(p)


def run(cfg) -> dict[str, Any]:
    from evaluation.config import ReportConfig
    from evaluation.report import build_report
    from launch.wandb_runs import log_report
    from train.core.config import load

    typed = load(cfg, ReportConfig, EXAMPLE)
    wandb = typed.wandb
    rep = build_report(typed)
    print_leaderboard(rep.data)
    for r in rep.data["runs"]:
        for w in r.get("warnings", []):
            print(f"warning: {w}")
    if wandb is not False:
        logged = log_report(rep, required=wandb is True)
        for name, where in logged.items():
            print(f"logged to wandb run {where} ({name})")
    print(f"wrote {', '.join(str(f) for f in rep.files)}")
    return rep.data


if __name__ == "__main__":
    import sys

    from launch.cli import main

    main(["report", *sys.argv[1:]])
