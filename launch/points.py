"""Running one sweep point: its train and eval commands, each logged, and the sweep's report."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launch.config import SweepConfig, SweepSpec
from launch.sweep_state import locked, read_state, update_point


def cli(*args: str) -> list[str]:
    """`hydra-heads <args>` as this interpreter runs it."""
    return [sys.executable, "-m", "launch", *args]


def train_command(cfg: SweepConfig, out: Path, tname: str, overrides: list[str]) -> list[str]:
    train_out = out / "points" / tname / "train"
    args = [*cfg.sweep.train, *overrides, *cfg.train_args, *cfg.job_train_args]
    return [*cfg.train_prefix, *cli("train", *args, f"out={train_out}", "resume=auto")]


def eval_command(cfg: SweepConfig, out: Path, point: dict) -> list[str]:
    heads = out / "points" / point["train_point"] / "train" / "heads"
    args = [*cfg.sweep.eval, *point["eval_overrides"], *cfg.eval_args, *cfg.job_eval_args]
    # overwrite: the sweep owns the point's dir (a point killed after its eval.json is run again)
    return cli("eval", *args, f"heads={heads}", f"out={out / point['dir']}", "overwrite=true")


def _run_logged(cmd: list[str], logfile: Path, env: dict[str, str] | None = None) -> int:
    """Run one CLI step, its output appended to `logfile`; the exit status."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("a") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n")
        fh.flush()
        return subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)


def _tail(logfile: Path, n: int = 5) -> str:
    try:
        lines = [ln for ln in logfile.read_text().splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("error:")]
    return errors[-1] if errors else " | ".join(lines[-n:])


def run_point(
    cfg: SweepConfig,
    out: Path,
    p: dict,
    describe: Callable[[str], object] = lambda text: None,
    env: dict[str, str] | None = None,
) -> tuple[str | None, str]:
    """Train point `p` (unless its training finished before) and evaluate it, each step's
    output in logs/<point>.log, the steps in `env` (default: this process's). Returns
    (None, "") or (the stage that failed, why)."""
    tname = p["train_point"]
    log_file = out / "logs" / f"{p['name']}.log"
    tdir = out / "points" / tname / "train"
    t0 = time.time()
    if not (tdir / "train_summary.json").is_file():
        describe(f"train {tname}")
        update_point(out, p["name"], status="training")
        cmd = train_command(cfg, out, tname, p["train_overrides"])
        if _run_logged(cmd, log_file, env) != 0:
            return "train", _tail(log_file)
    describe(f"eval {p['name']}")
    update_point(out, p["name"], status="evaluating")
    if _run_logged(eval_command(cfg, out, p), log_file, env) != 0:
        return "eval", _tail(log_file)
    update_point(out, p["name"], status="done", seconds=round(time.time() - t0, 1))
    return None, ""


def write_report(out: Path, spec: SweepSpec) -> Path | None:
    """The comparison report over every finished point (rewritten as points finish)."""
    from evaluation.config import ReportConfig
    from evaluation.report import build_report

    with locked(out / "report.json"):  # out/report.lock; reads sweep.json inside the lock
        state = read_state(out)
        if not any(p["status"] == "done" for p in state["points"]):
            return None
        rep = build_report(
            ReportConfig(
                runs=[str(out)],
                out=str(out / "report"),
                title=f"sweep {spec.name}",
                sort_by=spec.sort_by,
                names=None,
                plots=True,
                wandb=False,
            )
        )
    return rep.files[0]
