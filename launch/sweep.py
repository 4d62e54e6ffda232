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
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launch.config import IDENTITY, SweepConfig, SweepSpec
from train.core.atomic import write_json
from train.core.config import fail
from train.core.errors import ConfigError

log = logging.getLogger(__name__)


def _split_values(text: str) -> list[str]:
    """`a,[1,2],b` -> ['a', '[1,2]', 'b']: commas inside brackets or quotes do not split."""
    out, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    return [*out, cur]


def _value(text: str) -> Any:
    """An override value as YAML reads it (`null`, `[1,2]`, `0.5`, `medusa`)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_grid(key: str, items: list[str]) -> dict[str, list[Any]]:
    """['head=medusa,hydra', 'optim.lr=1e-3,3e-3'] -> {'head': [...], 'optim.lr': [...]}."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = str(item).partition("=")
        vals = [v.strip() for v in _split_values(values)]
        if not sep or not name.strip() or not all(vals):
            fail(key, item, "entries like 'head=medusa,hydra' (a key, '=', comma-separated values)")
        grid[name.strip()] = [_value(v) for v in vals]
    return grid


_SPECIAL = re.compile(r"[\s,=\[\]{}()'\":]")


def _fmt(v: Any) -> str:
    """A value as hydra's override grammar reads it back."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list | dict):
        return json.dumps(v, separators=(",", ":"))
    s = str(v)
    if isinstance(v, str) and (not s or _SPECIAL.search(s)):
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return s


def _slug(overrides: list[str]) -> str:
    """A readable dir name: `head=hydra,head.num_layers=2` -> `head-hydra_head.num_layers-2`."""
    s = "_".join(o.replace("=", "-").replace(",", "-") for o in overrides) or "default"
    return re.sub(r"[^A-Za-z0-9._-]+", "", s)


def _unique_slugs(groups: list[list[str]]) -> list[str]:
    """One dir name per override group, distinct for distinct groups: readable slugs, with a
    hash of the overrides where slugs would be cut short or would coincide."""
    slugs = [_slug(g) for g in groups]
    out = []
    for g, s in zip(groups, slugs, strict=True):
        if len(s) > 80 or slugs.count(s) > 1:
            digest = hashlib.sha1(json.dumps(g).encode()).hexdigest()[:8]
            s = f"{s[:80]}-{digest}"
        out.append(s)
    return out


def grid_points(grid: dict[str, list[Any]]) -> list[list[str]]:
    return [
        [f"{k}={_fmt(v)}" for k, v in zip(grid, combo, strict=True)]
        for combo in itertools.product(*grid.values())
    ]


def plan_points(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every (train point, eval point) pair with its dirs; the order they run in."""
    trains = grid_points(spec.grid) or [[]]
    evals = grid_points(spec.eval_grid) or [[]]
    return [
        {
            "name": tname if not ev else f"{tname}__{ename}",
            "train_point": tname,
            "train_overrides": tr,
            "eval_overrides": ev,
            "dir": f"points/{tname}/eval/{ename}",
            "status": "pending",
        }
        for tr, tname in zip(trains, _unique_slugs(trains), strict=True)
        for ev, ename in zip(evals, _unique_slugs(evals), strict=True)
    ]


@contextmanager
def _locked(path: Path):
    """An exclusive lock on `path`.lock: SLURM point jobs update sweep.json concurrently."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError as e:  # e.g. Lustre mounted without flock
            raise ConfigError(
                f"cannot lock {fh.name} ({e}); put the sweep's out= on a filesystem with file "
                "locks (local disk, NFS, or Lustre mounted with -o flock)"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def _point_lock(path: Path):
    """Yields False if another process holds the point (it is being run there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _identity(spec: dict, key: str) -> Any:
    """spec[key] as far as it makes the sweep the same: a search may raise its trials."""
    value = spec.get(key)
    if key == "search" and value:
        value = {k: v for k, v in value.items() if k != "trials"}
    return value


def load_state(out: Path, spec: SweepSpec) -> dict[str, Any]:
    """sweep.json (or a fresh plan); a resumed sweep must be the same grid."""
    path = out / "sweep.json"
    fresh = {"spec": spec.to_dict(), "points": plan_points(spec) if spec.search is None else []}
    if not path.is_file():
        return fresh
    state = json.loads(path.read_text())
    old = state.get("spec") or {}
    changed = [k for k in IDENTITY if _identity(old, k) != _identity(fresh["spec"], k)]
    if changed:
        raise ConfigError(
            f"{path} belongs to a different sweep: sweep.{', sweep.'.join(changed)} changed. "
            "Resume it with the same settings, or choose another out"
        )
    state["spec"] = fresh["spec"]  # e.g. a new sort_by
    return state


def _update_point(out: Path, name: str, **changes: Any) -> None:
    with _locked(out / "sweep.json"):
        state = json.loads((out / "sweep.json").read_text())
        for pt in state["points"]:
            if pt["name"] == name:
                pt.update(changes)
                if changes.get("status") == "done":
                    pt.pop("error", None)
                    pt.pop("stage", None)
        write_json(out / "sweep.json", state)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch", *args]


def train_command(cfg: SweepConfig, out: Path, tname: str, overrides: list[str]) -> list[str]:
    train_out = out / "points" / tname / "train"
    args = [*cfg.sweep.train, *overrides, *cfg.train_args, *cfg.job_train_args]
    return [*cfg.train_prefix, *_cli("train", *args, f"out={train_out}", "resume=auto")]


def eval_command(cfg: SweepConfig, out: Path, point: dict) -> list[str]:
    heads = out / "points" / point["train_point"] / "train" / "heads"
    args = [*cfg.sweep.eval, *point["eval_overrides"], *cfg.eval_args, *cfg.job_eval_args]
    return _cli("eval", *args, f"heads={heads}", f"out={out / point['dir']}")


def _run_logged(cmd: list[str], logfile: Path) -> int:
    """Run one CLI step, its output appended to `logfile`; the exit status."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("a") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n")
        fh.flush()
        return subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)


def _tail(logfile: Path, n: int = 5) -> str:
    try:
        lines = [ln for ln in logfile.read_text().splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("error:")]
    return errors[-1] if errors else " | ".join(lines[-n:])


def run_point(cfg: SweepConfig, out: Path, p: dict, describe=lambda text: None):
    """Train point `p` (unless its training finished before) and evaluate it, each step's
    output in logs/<point>.log. Returns (None, "") or (the stage that failed, why)."""
    tname = p["train_point"]
    log_file = out / "logs" / f"{p['name']}.log"
    tdir = out / "points" / tname / "train"
    t0 = time.time()
    if not (tdir / "train_summary.json").is_file():
        describe(f"train {tname}")
        _update_point(out, p["name"], status="training")
        if _run_logged(train_command(cfg, out, tname, p["train_overrides"]), log_file) != 0:
            return "train", _tail(log_file)
    describe(f"eval {p['name']}")
    _update_point(out, p["name"], status="evaluating")
    if _run_logged(eval_command(cfg, out, p), log_file) != 0:
        return "eval", _tail(log_file)
    _update_point(out, p["name"], status="done", seconds=round(time.time() - t0, 1))
    return None, ""


def run_sweep(cfg: SweepConfig, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) every unfinished point; return the final sweep.json content."""
    out = Path(cfg.out).expanduser().resolve()
    spec = cfg.sweep
    if cfg.dry_run:
        state = load_state(out, spec)
    else:
        out.mkdir(parents=True, exist_ok=True)
        with _locked(out / "sweep.json"):
            state = load_state(out, spec)
            write_json(out / "sweep.json", state)
    points = [p for p in state["points"] if cfg.only is None or p["train_point"] == cfg.only]
    if cfg.only is not None and not points:
        names = sorted({p["train_point"] for p in state["points"]})
        raise ConfigError(f"only={cfg.only!r} is not a train point; choose one of {names}")
    if cfg.dry_run and spec.search is not None:
        s = spec.search
        print(f"# search: {s.trials} trials ({s.sampler}, seed {s.seed}), maximize {s.objective}")
        for key, param in s.space.items():
            print(f"#   {key}: {param.model_dump(exclude_defaults=True)}")
        draw = {"name": "TRIAL", "train_point": "TRIAL", "dir": "points/TRIAL/eval/default"}
        keys = [f"{k}=<drawn>" for k in s.space]
        print(shlex.join(train_command(cfg, out, "TRIAL", keys)))
        print(shlex.join(eval_command(cfg, out, {**draw, "eval_overrides": []})))
        return state
    if cfg.dry_run:
        for p in points:
            print(f"# {p['name']} [{p['status']}]")
            print(shlex.join(train_command(cfg, out, p["train_point"], p["train_overrides"])))
            print(shlex.join(eval_command(cfg, out, p)))
        return state
    if cfg.backend == "slurm":
        return submit_points(cfg, out, state)
    if spec.search is not None:
        from launch.search import run_search

        return run_search(cfg, out, progress)
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
            _update_point(out, p["name"], status="failed", stage=stage, error=msg)
            bar.console.print(f"[red]{escape(p['name'])}: {stage} failed[/red]: {escape(msg)}")
            return bool(cfg.max_failures and failures >= cfg.max_failures)

        for p in todo:
            bar.advance(task)
            tname = p["train_point"]
            if tname in failed_train:  # its training already failed in this run
                if failed(p, "train", f"training of {tname} failed (see its other point)"):
                    break
                continue
            with _point_lock(out / "points" / tname / ".lock") as mine:
                if not mine:
                    bar.console.print(f"{escape(p['name'])}: being run by another process")
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
    return json.loads((out / "sweep.json").read_text())


def write_report(out: Path, spec: SweepSpec) -> Path | None:
    """The comparison report over every finished point (rewritten as points finish)."""
    from evaluation.config import ReportConfig
    from evaluation.report import build_report

    with _locked(out / "report.json"):  # out/report.lock; reads sweep.json inside the lock
        state = json.loads((out / "sweep.json").read_text())
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
    from launch.launchers import sbatch_script

    sl = cfg.slurm
    live = _live_jobs(state.get("jobs", {}))
    pending = sorted(
        {p["train_point"] for p in state["points"] if p["status"] != "done"} - set(live)
    )
    for tname in sorted(live):
        print(f"{tname}: job {live[tname]} is still queued or running; not submitted again")
    argv = [
        a
        for a in sys.argv[1:]
        if not a.lstrip("+~").startswith(("backend=", "only=", "train_prefix=", "job_"))
    ]
    job_train = [f"trainer.num_nodes={sl.nodes}", f"trainer.devices={sl.tasks_per_node}"]
    user_eval = [*cfg.sweep.eval, *cfg.eval_args]
    # Evals run on the job's first GPU unless the sweep says where.
    job_eval = (
        ["eval.device=cuda"]
        if sl.gpus_per_node and not any(a.startswith("eval.device=") for a in user_eval)
        else []
    )
    for tname in pending:
        tdir = out / "points" / tname
        tdir.mkdir(parents=True, exist_ok=True)
        job = _cli(
            "sweep",
            *argv,
            "backend=local",
            f"only={tname}",
            "train_prefix=" + json.dumps(["srun", "--kill-on-bad-exit=1"]),
            "job_train_args=" + json.dumps(job_train),
            "job_eval_args=" + json.dumps(job_eval),
        )
        script = sbatch_script(sl, [], str(tdir), os.getcwd(), body=[shlex.join(job)])
        path = tdir / "sweep_point.sbatch"
        path.write_text(script)
        try:
            r = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
        except FileNotFoundError:
            raise ConfigError("sbatch not found: run backend=slurm on a SLURM login node") from None
        if r.returncode != 0:
            raise ConfigError(f"sbatch failed for point {tname}: {r.stderr.strip()}")
        job_id = r.stdout.strip().split(";")[0]
        with _locked(out / "sweep.json"):  # recorded at once: a later failure forgets nothing
            st = json.loads((out / "sweep.json").read_text())
            st.setdefault("jobs", {})[tname] = job_id
            write_json(out / "sweep.json", st)
        print(f"submitted {tname}: job {job_id} ({path})")
    return json.loads((out / "sweep.json").read_text())
