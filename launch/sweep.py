"""Sweeps: a grid of train x eval overrides, each point trained then evaluated, one report.

Layout under `out`:

    sweep.json                       the grid and every point's status (the resume state)
    points/<train point>/train/      `hydra-heads train` output (heads, checkpoints, logs)
    points/<train point>/eval/<eval point>/   `hydra-heads eval` output
    report/                          `hydra-heads report` over every finished point
    logs/<point>.log                 each step's console output

Points run as subprocesses of the real CLI, one after another (`backend=local`) or as one
SLURM job per train point (`backend=slurm`): the job runs this sweep for its own point
(`only=<point>`), training under `srun` on every task of the allocation, then the point's evals,
then refreshes the report. A killed sweep resumes: finished points are skipped, a point whose
training was cut short continues from its last checkpoint (`resume=auto`). A point being run
by another process (a lock per point) is left to it.

The pieces: launch/grid.py (grids -> override lists), launch/sweep_state.py (sweep.json),
launch/points.py (one point's train and eval steps), launch/search.py (`sweep.search`).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

from launch.config import SweepConfig
from launch.grid import override_value
from launch.points import eval_command, run_point, train_command, write_report
from launch.search import run_search, submit_workers
from launch.sweep_state import (
    load_state,
    locked,
    plan_points,
    point_lock,
    read_point,
    read_state,
    record_job,
    update_point,
)
from train.core.atomic import write_json
from train.core.errors import ConfigError

# The sweep's API (its state, plan_points and load_state, is launch/sweep_state.py's).
__all__ = ["run_sweep", "submit_points"]


def train_variants(cfg: SweepConfig) -> list[list[str]]:
    """Override lists that together hold every value a point's training may get: each grid
    point; for a search, every choice and both ends of every range, each beside the first
    value of the other keys."""
    spec = cfg.sweep
    if spec.search is None:
        points = {tuple(p["train_overrides"]): p["train_overrides"] for p in plan_points(spec)}
        return list(points.values())
    values = {key: _space_values(p) for key, p in spec.search.space.items()}
    first = {k: f"{k}={vs[0]}" for k, vs in values.items()}
    return [
        [f"{key}={v}" if k2 == key else o for k2, o in first.items()]
        for key, vs in values.items()
        for v in vs
    ]


def _space_values(p) -> list[str]:
    """A search key's choices, or both ends of its range, written as search.suggest writes a
    trial's value (so a value the check passes is the one the trial gets)."""
    if p.choices is not None:
        return [override_value(c) for c in p.choices]
    ends = (int(p.low), int(p.high)) if p.integer else (p.low, p.high)
    return [override_value(v) for v in ends]


def check_points(cfg: SweepConfig) -> None:
    """Compose and validate every point's train config before any point runs (a misspelled
    grid or search key fails here, once, not in every point's training)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from train.config import TrainConfig
    from train.core.config import compose, load

    spec = cfg.sweep
    for overrides in train_variants(cfg):
        args = [*spec.train, *overrides, *cfg.train_args, *cfg.job_train_args]
        try:
            load(compose("train", [*args, "out=sweep-check"]), TrainConfig)
        except (ConfigError, HydraException, OmegaConfBaseException) as e:
            msg = str(e).strip()
            if not isinstance(e, ConfigError):  # hydra's first line names the key; its hint to
                msg = msg.splitlines()[0]  # append with + would not fix a misspelling
            raise ConfigError(
                f"sweep {spec.name}: a point's training would fail its config check with "
                f"{' '.join(overrides) or 'no point overrides'} ({msg}); fix the sweep's train "
                "keys, grid, search space or train_args"
            ) from None


def run_sweep(cfg: SweepConfig, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) every unfinished point; return the final sweep.json content."""
    out = Path(cfg.out).expanduser().resolve()
    spec = cfg.sweep
    if cfg.dry_run:
        state = load_state(out, spec)
    else:
        check_points(cfg)
        out.mkdir(parents=True, exist_ok=True)
        with locked(out / "sweep.json"):
            state = load_state(out, spec)
            write_json(out / "sweep.json", state)
    points = [p for p in state["points"] if cfg.only is None or p["train_point"] == cfg.only]
    if cfg.only is not None and not points:
        names = sorted({p["train_point"] for p in state["points"]})
        raise ConfigError(f"only={cfg.only!r} is not a train point; choose one of {names}")
    if cfg.dry_run:
        _print_commands(cfg, out, points)
        return state
    if spec.search is not None:
        if cfg.backend == "slurm":
            return submit_workers(cfg, out)
        return run_search(cfg, out, progress)
    if cfg.backend == "slurm":
        return submit_points(cfg, out, state)
    from rich.markup import escape
    from rich.progress import Progress

    failures = 0
    failed_train: set[str] = set()
    todo = [p for p in points if p["status"] != "done"]
    skipped = len(points) - len(todo)
    with Progress(disable=not progress) as bar:
        task = bar.add_task(f"sweep {spec.name} ({skipped} done before)", total=len(points))
        bar.advance(task, skipped)

        def failed(p: dict, stage: str, msg: str) -> bool:
            nonlocal failures
            failures += 1
            update_point(out, p["name"], status="failed", stage=stage, error=msg)
            bar.console.print(f"[red]{escape(p['name'])}: {stage} failed[/red]: {escape(msg)}")
            return bool(cfg.max_failures and failures >= cfg.max_failures)

        for p in todo:
            bar.advance(task)
            tname = p["train_point"]
            if tname in failed_train:  # its training already failed in this run
                if failed(p, "train", f"training of {tname} failed (see its other point)"):
                    break
                continue
            with point_lock(out / "points" / tname / ".lock") as mine:
                if not mine:
                    bar.console.print(f"{escape(p['name'])}: being run by another process")
                    continue
                # another process may have finished it since this one read sweep.json
                if (read_point(out, p["name"]) or {}).get("status") == "done":
                    bar.console.print(f"{escape(p['name'])}: finished by another process")
                    continue
                stage, msg = run_point(cfg, out, p, lambda d: bar.update(task, description=d))
                if stage == "train":
                    failed_train.add(tname)
                if stage is not None:
                    if failed(p, stage, msg):
                        break
                    continue
            if cfg.report:
                try:
                    write_report(out, spec)
                except Exception as e:  # noqa: BLE001 - a report problem must not stop training
                    bar.console.print(f"[yellow]report not refreshed[/yellow]: {escape(str(e))}")
    return read_state(out)


def _print_commands(cfg: SweepConfig, out: Path, points: list[dict]) -> None:
    """`dry_run=true`: the commands each point (or a search's trials) would run."""
    s = cfg.sweep.search
    if s is not None:
        print(f"# search: {s.trials} trials ({s.sampler}, seed {s.seed}), maximize {s.objective}")
        for key, param in s.space.items():
            print(f"#   {key}: {param.model_dump(exclude_defaults=True)}")
        draw = {"name": "TRIAL", "train_point": "TRIAL", "dir": "points/TRIAL/eval/default"}
        keys = [f"{k}=<drawn>" for k in s.space]
        print(shlex.join(train_command(cfg, out, "TRIAL", keys)))
        print(shlex.join(eval_command(cfg, out, {**draw, "eval_overrides": []})))
        return
    for p in points:
        print(f"# {p['name']} [{p['status']}]")
        print(shlex.join(train_command(cfg, out, p["train_point"], p["train_overrides"])))
        print(shlex.join(eval_command(cfg, out, p)))


def _live_jobs(jobs: dict[str, str]) -> dict[str, str]:
    """The submitted point jobs SLURM still knows as pending or running."""
    if not jobs:
        return {}
    try:
        r = subprocess.run(["squeue", "--me", "-h", "-o", "%i"], capture_output=True, text=True)
    except FileNotFoundError:
        raise ConfigError("squeue not found: run backend=slurm on a SLURM login node") from None
    if r.returncode != 0:
        raise ConfigError(
            f"squeue failed ({r.stderr.strip()}): cannot tell which point jobs still run, so "
            "none is submitted again; retry when the controller answers"
        )
    alive = set(r.stdout.split())
    return {t: j for t, j in jobs.items() if j in alive}


def submit_points(cfg: SweepConfig, out: Path, state: dict) -> dict[str, Any]:
    """One sbatch job per unfinished train point. The job runs this sweep for its point only:
    training under srun on every task (requeued on pre-emption, resumed), then the evals."""
    from launch.launchers import sweep_job

    live = _live_jobs(state.get("jobs", {}))
    pending = sorted(
        {p["train_point"] for p in state["points"] if p["status"] != "done"} - set(live)
    )
    for tname in sorted(live):
        print(f"{tname}: job {live[tname]} is still queued or running; not submitted again")
    for tname in pending:
        tdir = out / "points" / tname
        path = tdir / "sweep_point.sbatch"
        job_id = sweep_job(cfg, [f"only={tname}"], tdir, path, f"point {tname}")
        record_job(out, tname, job_id)
        print(f"submitted {tname}: job {job_id} ({path})")
    return read_state(out)
