"""Log eval figures and report tables into the wandb run that trained the heads.

Online, eval and report resume the training run itself (same id). wandb cannot resume an
offline run, so offline they log into runs of their own, grouped with it (`group` = the
training run's id, `job_type` eval / report); `wandb sync` uploads all of them together.
`WANDB_MODE` wins when set (`disabled`: nothing is logged).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def run_info(logger: Any) -> dict[str, str] | None:
    """What finds a Lightning WandbLogger's run again later: id, project, entity, its dir."""
    if isinstance(logger, list | tuple):
        return next((i for i in map(run_info, logger) if i is not None), None)
    if type(logger).__name__ != "WandbLogger":
        return None
    exp = logger.experiment
    mode = str(getattr(exp.settings, "mode", "") or "")
    if mode == "disabled" or not getattr(exp, "id", None):
        return None
    return {
        "id": str(exp.id),
        "name": str(getattr(exp, "name", "") or exp.id),
        "project": str(exp.project or logger.name or "hydra-heads"),
        "entity": getattr(exp, "entity", None) or None,
        "dir": str(Path(logger.save_dir or os.environ.get("WANDB_DIR", ".")).resolve()),
        "mode": "online" if mode in ("online", "run") else "offline",
    }


def _mode(info: dict[str, str]) -> str:
    env = os.environ.get("WANDB_MODE")
    if env:  # the user's explicit choice
        return "offline" if env == "dryrun" else env
    if info.get("mode") == "online" and os.environ.get("WANDB_API_KEY"):
        return "online"
    return "offline"  # never block on the network


def _open(info: dict[str, str], job_type: str):
    """The training run resumed (online), or a run grouped with it (offline); None if disabled."""
    mode = _mode(info)
    if mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_CACHE_DIR", str(Path(info["dir"]) / ".wandb_cache"))
    kw: dict[str, Any] = {
        "project": info["project"],
        "entity": info.get("entity"),
        "dir": info["dir"],
        "mode": mode,
        "reinit": "create_new",
    }
    if mode == "online":
        kw.update(id=info["id"], resume="allow")
    else:
        kw.update(
            group=info["id"],
            job_type=job_type,
            name=f"{info.get('name') or info['id']}-{job_type}",
            config={"train_run_id": info["id"]},
        )
    return wandb.init(**kw)


def _where(info: dict[str, str], run) -> str:
    base = f"{info['project']}/{info['id']}"
    return base if run.id == info["id"] else f"{info['project']}/{run.id} (group {info['id']})"


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

    run = _open(info, "eval")
    if run is None:
        return None
    try:
        scalars = {
            f"eval/{k}": res[k]
            for k in ("tau", "speedup", "spec_tokens_per_s", "plain_tokens_per_s")
            if res.get(k) is not None
        }
        scalars["eval/tree_nodes"] = res["tree"]["num_nodes"]
        cum, cond = res["acceptance_cumulative"], res["acceptance_conditional"]
        rows = [[d, a, c] for d, (a, c) in enumerate(zip(cum, cond, strict=True), 1)]
        depth = wandb.Table(columns=["depth", "cumulative", "conditional"], data=rows)
        rows = [[n, c] for n, c in enumerate(res["accepted_histogram"])]
        hist = wandb.Table(columns=["accepted", "steps"], data=rows)
        run.log({**scalars, "eval/acceptance_by_depth": depth, "eval/accepted_histogram": hist})
        run.summary.update(scalars)
    finally:
        run.finish()
    return _where(info, run)


def log_report(rep: Any, required: bool = False) -> dict[str, str]:
    """The report's leaderboard and plots into each reported run's own wandb run."""
    runs = [r for r in rep.data["runs"] if (r.get("train") or {}).get("wandb_run")]
    if not runs:
        if required:
            from train.core.errors import ConfigError

            raise ConfigError(
                "wandb=true but no reported run was trained with logger=wandb; "
                "use wandb=auto or false"
            )
        return {}
    import wandb

    out = Path(rep.files[0]).parent
    columns = list(rep.data["leaderboard"][0])
    logged: dict[str, str] = {}
    seen: set[str] = set()
    for r in runs:
        info = r["train"]["wandb_run"]
        if info["id"] in seen:  # several eval points of one training run: log it once
            continue
        seen.add(info["id"])
        run = _open(info, "report")
        if run is None:
            continue
        try:
            rows = [[row[c] for c in columns] for row in rep.data["leaderboard"]]
            table = wandb.Table(columns=columns, data=rows)
            images = {
                f"report/{name}": wandb.Image(str(out / file))
                for name, file in rep.data["plots"].items()
            }
            run.log({"report/leaderboard": table, **images})
        finally:
            run.finish()
        logged[r["name"]] = _where(info, run)
    return logged
