"""`hydra-heads eval`: validate the config, run speculative vs plain decoding, print the figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.decoding.generation import STEP_PARTS

CONFIG_NAME = "eval"
# A working command line, shown when a required key is missing.
EXAMPLE = "hydra-heads eval heads=runs/hpp/heads out=runs/hpp-eval"


def print_summary(res: dict[str, Any], out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from evaluation.stats import with_ci

    t = Table(
        title=f"eval: {res['arch']} heads, tree of {res['tree']['num_nodes']} nodes",
        show_header=False,
    )
    t.add_column("what")
    t.add_column("value", justify="right")

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    t.add_row(
        "prompts / generations", f"{res['prompts']['items']} / {res['prompts']['generations']}"
    )
    t.add_row("tau (tokens per base forward)", with_ci(res["tau"], res.get("tau_ci95")))
    if "expected_tau" in res["tree"]:
        t.add_row("  expected from calibration", num(res["tree"]["expected_tau"], ".3f"))
    for d, (cum, cond) in enumerate(
        zip(res["acceptance_cumulative"], res["acceptance_conditional"], strict=True), 1
    ):
        t.add_row(
            f"  depth {d} accepted (cumulative / conditional)",
            f"{num(cum, '.3f')} / {num(cond, '.3f')}",
        )
    t.add_row("speculative tokens/s", num(res["spec_tokens_per_s"], ".1f"))
    if "plain_tokens_per_s" in res:
        t.add_row("plain tokens/s", num(res["plain_tokens_per_s"], ".1f"))
        t.add_row("speedup", with_ci(res["speedup"], res.get("speedup_ci95"), unit="x"))
    ms = res["time_per_step_ms"]
    t.add_row(
        "per step: propose / verify / project / bookkeeping",
        " / ".join(f"{ms[k]:.1f}" if k in ms else "–" for k in STEP_PARTS) + " ms",
    )
    if "setup" in res:
        parts = res["setup"]
        t.add_row(
            "setup: load / calibrate / time trees",
            f"{res['setup_s']:.1f} s ({parts['load_s']:.1f} / {parts['calibrate_s']:.1f} / "
            f"{parts['choose_tree_s']:.1f})",
        )
    by_category = res.get("by_category") or {}
    if len(by_category) > 1:  # a suite with categories (MT-Bench): tau / speedup per category
        timed = "plain_tokens_per_s" in res  # eval.compare_plain=false: no speedups
        for name, fig in by_category.items():
            tau = with_ci(fig["tau"], fig.get("tau_ci95"))
            if timed:
                t.add_row(f"  {name} ({fig['generations']}): tau / speedup",
                          f"{tau} / {num(fig['speedup'], '.2f')}x")  # fmt: skip
            else:
                t.add_row(f"  {name} ({fig['generations']}): tau", tau)
    if res["lossless"] is not None:
        t.add_row("lossless (greedy == plain greedy)", "yes" if res["lossless"] else "NO")
    Console().print(t)
    if res.get("tau_ci95"):
        items = res["intervals"]["items"]
        Console().print(f"[a, b]: 95% interval, bootstrap over the {items} items")
    tree = f" and {out}/tree.json" if (Path(out) / "tree.json").is_file() else ""  # a static tree
    Console().print(f"wrote {out}/eval.json{tree}")


def run(cfg) -> dict[str, Any]:
    from rich.console import Console

    from evaluation.config import EvalConfig
    from evaluation.evaluate import run_eval
    from launch.wandb_runs import log_eval, train_run_of
    from train.core.config import load, resolved_yaml
    from train.core.errors import ConfigError

    typed = load(cfg, EvalConfig, EXAMPLE)
    wandb = typed.wandb
    if wandb is True and train_run_of(typed.heads) is None:
        raise ConfigError(
            f"wandb=true but the training run of {typed.heads} did not log to wandb "
            "(logger=wandb); use wandb=auto or false"
        )
    res = run_eval(typed, resolved_yaml(cfg))
    print_summary(res, typed.out)
    if wandb is not False:
        where = log_eval(res)
        if where:
            Console().print(f"logged the eval figures to wandb run {where}")
    return res


if __name__ == "__main__":  # how multi-process launchers re-run this subcommand on other ranks
    import sys

    from launch.cli import main

    main(["eval", *sys.argv[1:]])
