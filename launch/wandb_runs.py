"""Log eval figures and report tables into the wandb run that trained the heads (offline too)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def run_info(logger: Any) -> dict[str, str] | None:
    """What finds a Lightning WandbLogger's run again later: id, project and its save dir."""
    if isinstance(logger, list | tuple):
        return next((i for i in map(run_info, logger) if i is not None), None)
    if type(logger).__name__ != "WandbLogger":
        return None
    exp = logger.experiment
    return {
        "id": str(exp.id),
        "project": str(exp.project or logger.name or "hydra-heads"),
        "dir": str(Path(logger.save_dir or os.environ.get("WANDB_DIR", ".")).resolve()),
        "mode": "offline" if getattr(exp.settings, "mode", "") == "offline" else "online",
    }


def _open(info: dict[str, str]):
    import wandb

    os.environ.setdefault("WANDB_CACHE_DIR", str(Path(info["dir"]) / ".wandb_cache"))
    mode = info.get("mode", "offline")
    if mode == "online" and not os.environ.get("WANDB_API_KEY"):
        mode = "offline"  # never block on the network
    return wandb.init(
        id=info["id"],
        project=info["project"],
        dir=info["dir"],
        resume="allow",
        mode=mode,
        reinit="create_new",
    )


def train_run_of(heads_dir: str | Path) -> dict[str, str] | None:
    """The wandb run recorded by the `hydra-heads train` that wrote `heads_dir`, if any."""
    import json

    summary = Path(heads_dir).parent / "train_summary.json"
    if not summary.is_file():
        return None
    return json.loads(summary.read_text()).get("wandb_run")


def log_eval(res: dict[str, Any]) -> str | None:
    """eval.json's figures into the training run: scalars in the summary, tables per depth."""
    info = train_run_of(res["heads"])
    if info is None:
        return None
    import wandb

    run = _open(info)
    try:
        scalars = {
            f"eval/{k}": res[k]
            for k in ("tau", "speedup", "spec_tokens_per_s", "plain_tokens_per_s")
            if res.get(k) is not None
        }
        scalars["eval/tree_nodes"] = res["tree"]["num_nodes"]
        depth = wandb.Table(columns=["depth", "cumulative", "conditional"])
        for d, (cum, cond) in enumerate(
            zip(res["acceptance_cumulative"], res["acceptance_conditional"], strict=True), 1
        ):
            depth.add_data(d, cum, cond)
        hist = wandb.Table(columns=["accepted", "steps"])
        for n, c in enumerate(res["accepted_histogram"]):
            hist.add_data(n, c)
        run.log({**scalars, "eval/acceptance_by_depth": depth, "eval/accepted_histogram": hist})
        run.summary.update(scalars)
    finally:
        run.finish()
    return f"{info['project']}/{info['id']}"


def log_report(rep: Any, required: bool = False) -> dict[str, str]:
    """The report's leaderboard and plots into each reported run's own wandb run."""
    runs = [r for r in rep.data["runs"] if (r.get("train") or {}).get("wandb_run")]
    if not runs:
        if required:
            from train.config import ConfigError

            raise ConfigError(
                "wandb=true but no reported run was trained with logger=wandb; "
                "use wandb=auto or false"
            )
        return {}
    import wandb

    out = Path(rep.files[0]).parent
    columns = list(rep.data["leaderboard"][0])
    logged = {}
    for r in runs:
        info = r["train"]["wandb_run"]
        run = _open(info)
        try:
            table = wandb.Table(columns=columns)
            for row in rep.data["leaderboard"]:
                table.add_data(*[row[c] for c in columns])
            images = {
                f"report/{name}": wandb.Image(str(out / file))
                for name, file in rep.data["plots"].items()
            }
            run.log({"report/leaderboard": table, **images})
        finally:
            run.finish()
        logged[r["name"]] = f"{info['project']}/{info['id']}"
    return logged
