"""`hydra-heads train`: validate the config, build Trainer and logger from `_target_`, fit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CONFIG_NAME = "train"
# A working command line, shown when a required key is missing.
EXAMPLE = "hydra-heads train data.prepared=runs/demo/data out=runs/hpp"


def make_logger(cfg) -> Any:
    """The configured Lightning logger, or False. wandb goes offline without an API key."""
    from hydra.utils import instantiate

    if cfg.logger is None:
        return False
    out = cfg.out
    target = str(cfg.logger["_target_"])
    if target.endswith("WandbLogger"):
        os.environ.setdefault("WANDB_DIR", out)
        os.environ.setdefault("WANDB_CACHE_DIR", str(Path(out) / ".wandb_cache"))
        if not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")  # never block on the network
    Path(out).mkdir(parents=True, exist_ok=True)
    logger = instantiate(cfg.logger)
    if target.endswith("WandbLogger"):
        # metrics.csv too: reports read loss curves from disk, with or without a network
        from lightning.pytorch.loggers import CSVLogger

        return [logger, CSVLogger(save_dir=out, name="logs")]
    return logger


def print_summary(summary: dict, num_heads: int) -> None:
    from rich.console import Console
    from rich.table import Table

    val = summary.get("validation", {})
    t = Table(title=f"heads after {summary['steps']} steps ({summary['fit_s']:.0f} s)")
    for col in ("head", "top-1", "top-5", "top-1 vs base", "top-5 vs base"):
        t.add_column(col, justify="right")
    for k in range(1, num_heads + 1):
        cells = [val.get(f"val/{m}_h{k}") for m in ("top1", "top5", "top1_base", "top5_base")]
        t.add_row(str(k), *("-" if c is None else f"{c:.3f}" for c in cells))
    Console().print(t)
    if "val/tau_est" in val:
        Console().print(
            f"training-time acceptance estimate tau = {val['val/tau_est']:.3f} "
            "(1 + sum_k prod_j<=k top-1 vs base; measured tau comes from eval)"
        )


def quiet_lightning() -> None:
    """Lightning prints through its own handler; stop its records reaching hydra's root handler
    too (every line twice), and drop the warning about the base being in eval mode on purpose."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).propagate = False
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    if "SLURM_JOB_ID" not in os.environ:  # a local run on a host that has SLURM installed
        warnings.filterwarnings("ignore", message=r".*`srun` command is available.*")


def _record_wandb_run(summary: dict, logger: Any, out: str) -> None:
    """Remember the wandb run, so that eval and report log into it later."""
    from launch.wandb_runs import run_info
    from train.core.atomic import write_json

    info = run_info(logger)
    if info is None:
        return
    summary["wandb_run"] = info
    write_json(Path(out).expanduser() / "train_summary.json", summary)


def run(cfg) -> dict:
    from train.config import TrainConfig
    from train.core.config import load, resolved_yaml
    from train.data import check_prepared
    from train.recipe import fit

    typed = load(cfg, TrainConfig, EXAMPLE)  # fails here, before any heavy work, on a bad config
    # and here on missing or damaged data, before the logger, the out dir or the base exist
    check_prepared(typed.data.prepared, typed.data.offline)
    quiet_lightning()
    logger = make_logger(typed)
    summary = fit(typed, logger=logger, resolved_config=resolved_yaml(cfg))
    if summary.get("global_rank", 0) == 0:  # one table, not one per process
        _record_wandb_run(summary, logger, typed.out)
        print_summary(summary, typed.head.num_heads)
    return summary


if __name__ == "__main__":  # how multi-process launchers re-run this subcommand on other ranks
    import sys

    from launch.cli import main

    main(["train", *sys.argv[1:]])
