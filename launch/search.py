"""`hydra-heads sweep` with `sweep.search`: a budgeted Optuna search over train keys.

Each trial draws a value for every key of `search.space`, trains those overrides as a sweep
point (points/<trial point>/train, resumable like any point), evaluates it with the sweep's
eval overrides, and reports the objective to the study: eval's measured tau, or tau per
minute of training. Optuna is used directly, not through hydra-core's Optuna sweeper: a
sweep's points are separate `train` and `eval` processes with their own checkpoints and
logs, so that a killed trial resumes from its last checkpoint instead of restarting, and the
sweeper plugin runs its jobs inside one hydra multirun.

The study lives in <out>/study.db (SQLite), in Optuna's journal file <out>/study.journal
(`storage=journal`), or in any RDB (`storage=postgresql://...`). A killed search resumes where
it stopped: the finished trials stay, and the trial that was running is marked failed and
queued again with the same values, so its point continues from its checkpoint. Raising
`sweep.search.trials` on the same out extends the search.

Trials run `workers` at a time: local worker processes (`workers=N`, each with its share of the
cores, its console in logs/worker-<i>.log), or one SLURM job per worker (`backend=slurm`), all
sharing the study. A worker holds <out>/workers/<id>.lock while it runs; a running trial whose
worker no longer holds its lock was killed, and is queued again by the next worker to ask.
Asking happens under <out>/search.lock, where finished plus running trials are counted against
`search.trials`, so the workers together run exactly that many. With `sampler=random` every
trial's values are drawn from the seed up front, so the study holds the same trials whatever
the number of workers; TPE (with the constant liar when workers > 1) draws from the trials
finished so far, so its parallel draws depend on timing.

<out>/report/ holds the sweep's report over the finished trials, plus study.md / study.json:
the best trials, and each key's importance (Optuna's PED-ANOVA evaluator, which needs no
scikit-learn) once enough trials are complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from launch.config import SweepConfig
from launch.grid import override_value, unique_slugs
from launch.launchers import job_argv, sweep_job
from launch.points import cli, run_point, write_report
from launch.sweep_state import (
    add_point,
    locked,
    point_lock,
    read_point,
    read_state,
    record_job,
    update_point,
)
from train.core.atomic import write_json, write_text
from train.core.errors import ConfigError, UserError

log = logging.getLogger(__name__)


def check_study(path: Path) -> None:
    """A study file cut short or overwritten fails here, naming it and the fix, instead of as
    a database traceback from inside Optuna."""
    if not path.is_file():
        return
    uri = f"{path.resolve().as_uri()}?mode=ro"  # read only: the check never writes
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            problems = [row[0] for row in db.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as e:  # e.g. "file is not a database"
        problems = [str(e)]
    if problems != ["ok"]:
        raise UserError(
            f"the search's study {path} is corrupt ({'; '.join(problems[:3])}). Move it away "
            "and run the search again with the same out= to start a new study: a trial that "
            "draws the values of a finished training reuses it (its train_summary.json)"
        )


def storage(cfg: SweepConfig, out: Path):
    """The study's storage: <out>/study.db (SQLite), Optuna's journal file <out>/study.journal
    (`storage=journal`: appends under a file lock, for workers on a shared filesystem), or an
    RDB URL (`postgresql://...`, `mysql://...`, `sqlite:///...`)."""
    if cfg.storage is None:
        check_study(out / "study.db")
        return f"sqlite:///{out / 'study.db'}"
    if cfg.storage == "journal":
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        path = str(out / "study.journal")
        return JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
    return cfg.storage


def _study(cfg: SweepConfig, out: Path):
    import optuna

    spec = cfg.sweep.search
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = (
        # constant liar: running trials count as bad ones, so parallel workers spread out
        optuna.samplers.TPESampler(seed=spec.seed, constant_liar=cfg.workers > 1)
        if spec.sampler == "tpe"
        else optuna.samplers.RandomSampler(seed=spec.seed)
    )
    try:
        return optuna.create_study(
            study_name=cfg.sweep.name,
            storage=storage(cfg, out),
            direction="maximize",
            sampler=sampler,
            load_if_exists=True,
        )
    except ImportError as e:  # an RDB URL whose driver is not installed
        raise ConfigError(f"storage={cfg.storage}: {e}; install its database driver") from None


def suggest(trial, space) -> list[str]:
    """The trial's values for every key of the space, as train overrides. Floats are rounded
    to 3 significant digits, so that a point's dir name and command line stay readable."""
    overrides = []
    for key, p in space.items():
        if p.choices is not None:
            # optuna stores choices as strings, numbers or None: lists travel as JSON
            names = [override_value(c) for c in p.choices]
            value = trial.suggest_categorical(key, names)
        elif p.integer:
            value = trial.suggest_int(key, int(p.low), int(p.high), log=p.log)
        else:
            value = float(f"{trial.suggest_float(key, p.low, p.high, log=p.log):.3g}")
        overrides.append(f"{key}={value if isinstance(value, str) else override_value(value)}")
    return overrides


def _worker_alive(out: Path, worker: str | None, me: str) -> bool:
    """Whether the worker process that runs a trial still holds its lock. This worker's own
    running trials are a killed run's: it asks for a trial only between trials."""
    if worker is None or worker == me:  # None: a trial from before workers
        return False
    with point_lock(out / "workers" / f"{worker}.lock") as free:
        return not free


def _requeue_interrupted(study, out: Path, me: str) -> int:
    """Running trials whose worker is gone (killed): failed, and queued again with the same
    values. Called under the ask lock, so no worker is between asking and marking a trial."""
    from optuna.trial import TrialState

    stale = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not _worker_alive(out, t.user_attrs.get("worker"), me)
    ]
    for t in stale:
        study.tell(t.number, state=TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"requeued_from": t.number})
    return len(stale)


def _draw_ahead(study, cfg: SweepConfig) -> None:
    """sampler=random: every trial's values drawn up front from the seed and queued in trial
    order, so that the study holds the same trials whatever the number of workers and the
    order they finish in (TPE draws from the trials finished so far, so its parallel trials
    depend on timing)."""
    import optuna

    search = cfg.sweep.search
    drawn = int(study.user_attrs.get("drawn", 0))
    if search.sampler != "random" or drawn >= search.trials:
        return
    draft = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=search.seed))
    params = []
    for _ in range(search.trials):
        t = draft.ask()
        suggest(t, search.space)
        draft.tell(t, 0.0)
        params.append(t.params)
    for i in range(drawn, search.trials):
        study.enqueue_trial(params[i], user_attrs={"draw": i})
    study.set_user_attr("drawn", search.trials)


def finished_trials(study) -> int:
    """Trials that count toward search.trials: complete or failed, but not the interrupted
    ones that were queued again."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    requeued = {t.user_attrs["requeued_from"] for t in trials if "requeued_from" in t.user_attrs}
    finished = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
    return sum(1 for t in trials if t.state in finished and t.number not in requeued)


def objective(out: Path, point: dict, kind: str) -> float:
    """The point's objective from its eval.json (and train_summary.json)."""
    ev = json.loads((out / point["dir"] / "eval.json").read_text())
    tau = ev.get("tau")
    if tau is None:
        raise ValueError(f"{out / point['dir'] / 'eval.json'} has no tau")
    if kind == "tau":
        return float(tau)
    summary = out / "points" / point["train_point"] / "train" / "train_summary.json"
    fit_s = float(json.loads(summary.read_text())["fit_s"])
    return float(tau) / max(fit_s / 60.0, 1e-9)


def _point(overrides: list[str], trial: int) -> dict[str, Any]:
    (tname,) = unique_slugs([overrides])
    return {
        "name": tname,
        "train_point": tname,
        "train_overrides": overrides,
        "eval_overrides": [],
        "dir": f"points/{tname}/eval/default",
        "status": "pending",
        "trial": trial,
    }


def _running(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def _next_trial(cfg: SweepConfig, out: Path, study, worker: str):
    """The worker's next trial, or None when the search has all it needs (finished plus
    running trials make search.trials). Under <out>/search.lock: stale trials are queued
    again first, and no two workers count the same free slot."""
    with locked(out / "search.json"):  # <out>/search.lock
        _requeue_interrupted(study, out, worker)
        _draw_ahead(study, cfg)
        if finished_trials(study) + _running(study) >= cfg.sweep.search.trials:
            return None
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        return trial


SLURM_WORKER = "slurm-"  # the worker ids of backend=slurm's jobs: slurm-0, slurm-1, ...


def worker_threads(cfg: SweepConfig) -> int | None:
    """Torch threads per worker: the key, or for local workers this machine's cores shared out
    (several torch processes with all the cores each run several times slower than one alone);
    a SLURM worker's trials use the whole of its job's own allocation (None)."""
    if cfg.threads_per_worker is not None:
        return cfg.threads_per_worker
    if cfg.workers == 1 or str(cfg.worker).startswith(SLURM_WORKER):
        return None
    return max(1, len(os.sched_getaffinity(0)) // cfg.workers)


def run_search(cfg: SweepConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    """Run the search to `search.trials` finished trials; returns sweep.json's content. With
    workers > 1 (and no worker=), this process starts the workers and follows them."""
    if cfg.worker is None and cfg.workers > 1:
        return run_workers(cfg, out, progress)
    return run_worker(cfg, out, "0" if cfg.worker is None else str(cfg.worker), progress)


def run_worker(cfg: SweepConfig, out: Path, worker: str, progress: bool) -> dict[str, Any]:
    """One worker: trials asked from the shared study, trained, evaluated and told, until the
    search has its trials. <out>/workers/<worker>.lock, held while it runs, tells the other
    workers that its running trial is not a killed one."""
    from optuna.trial import TrialState
    from rich.markup import escape
    from rich.progress import Progress

    search = cfg.sweep.search
    with point_lock(out / "workers" / f"{worker}.lock") as mine:
        if not mine:
            raise ConfigError(
                f"another process is running the search in {out} as worker {worker}; wait for "
                "it, or use another out"
            )
        study = _study(cfg, out)
        with locked(out / "search.json"):
            requeued = _requeue_interrupted(study, out, worker)
        env = None
        if (threads := worker_threads(cfg)) is not None:
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        label = f"search {cfg.sweep.name}" + (f" (worker {worker})" if cfg.workers > 1 else "")
        with Progress(disable=not progress) as bar:
            task = bar.add_task(label, total=search.trials, completed=finished_trials(study))
            if requeued:
                bar.console.print(f"resuming: {requeued} interrupted trial(s) queued again")
            failures = 0
            while (trial := _next_trial(cfg, out, study, worker)) is not None:
                point = _point(suggest(trial, search.space), trial.number)
                add_point(out, point)
                current = read_point(out, point["name"])
                stage, msg = None, ""
                if current["status"] != "done":
                    stage, msg = run_point(
                        cfg, out, current, lambda d, n=trial.number: bar.update(
                            task, description=f"trial {n}: {d}"
                        ), env=env,
                    )  # fmt: skip
                if stage is None:
                    try:
                        value = objective(out, current, search.objective)
                    except (OSError, ValueError, KeyError) as e:
                        stage, msg = "objective", str(e)
                if stage is not None:
                    failures += 1
                    update_point(out, current["name"], status="failed", stage=stage, error=msg)
                    study.tell(trial, state=TrialState.FAIL)
                    bar.console.print(
                        f"[red]trial {trial.number} ({escape(current['name'])}): {stage} "
                        f"failed[/red]: {escape(msg)}"
                    )
                else:
                    study.tell(trial, value)
                    update_point(out, current["name"], objective=value)
                    bar.console.print(
                        f"trial {trial.number}: {search.objective} {value:.4f} "
                        f"({' '.join(point['train_overrides'])})"
                    )
                bar.update(task, completed=finished_trials(study))
                if cfg.report:
                    refresh_report(out, cfg.sweep, study)
                if cfg.max_failures and failures >= cfg.max_failures:
                    break
    return read_state(out)


def run_workers(cfg: SweepConfig, out: Path, progress: bool) -> dict[str, Any]:
    """`workers` local worker processes (`hydra-heads sweep ... worker=<i>`), each with its
    share of the cores and its console in <out>/logs/worker-<i>.log; this process shows the
    study's progress and fails naming a worker that failed."""
    from rich.progress import Progress

    study = _study(cfg, out)  # created once here, before the workers open it
    with locked(out / "search.json"):
        _draw_ahead(study, cfg)
    argv = job_argv()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(cfg.workers):
        log_path = out / "logs" / f"worker-{i}.log"
        fh = log_path.open("a")
        cmd = cli("sweep", *argv, "backend=local", f"worker={i}")
        procs.append((i, log_path, fh, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)))
    try:
        with Progress(disable=not progress) as bar:
            label = f"{cfg.workers} workers ({worker_threads(cfg)} threads each)"
            task = bar.add_task(f"search {cfg.sweep.name}: {label}", total=cfg.sweep.search.trials)
            while any(p.poll() is None for *_, p in procs):
                bar.update(task, completed=finished_trials(study))
                time.sleep(1.0)
            bar.update(task, completed=finished_trials(study))
    finally:
        for *_, fh, p in procs:
            if p.poll() is None:  # this process was interrupted: the workers stop with it
                p.terminate()
                p.wait()
            fh.close()
    failed = [(i, path, p.returncode) for i, path, _, p in procs if p.returncode != 0]
    if failed:
        i, path, rc = failed[0]
        raise UserError(f"search worker {i} failed (exit {rc}); its console is in {path}")
    return read_state(out)


def submit_workers(cfg: SweepConfig, out: Path) -> dict[str, Any]:
    """backend=slurm: `workers` SLURM jobs, each a worker (`worker=slurm-<i>`) whose trials
    train under srun on the job's allocation, sharing the study (put it on storage every node
    reaches: out= on a shared filesystem with storage=journal, or an RDB URL)."""
    study = _study(cfg, out)
    with locked(out / "search.json"):
        _draw_ahead(study, cfg)
    wdir = out / "workers"
    for i in range(cfg.workers):
        path = wdir / f"worker-{i}.sbatch"
        worker = f"{SLURM_WORKER}{i}"
        job_id = sweep_job(cfg, [f"worker={worker}"], wdir, path, f"search worker {i}")
        record_job(out, f"worker-{worker}", job_id)
        print(f"submitted search worker {worker}: job {job_id} ({path})")
    return read_state(out)


def study_summary(study, objective_name: str, top: int = 5) -> dict[str, Any]:
    """The best trials and the keys' importances (when Optuna can compute them)."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = sorted(complete, key=lambda t: -t.value)[:top]
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    importance: dict[str, float] | None = None
    note = None
    if len(complete) >= 2:
        import optuna

        try:
            importance = {
                k: float(v)
                for k, v in optuna.importance.get_param_importances(
                    study, evaluator=optuna.importance.PedAnovaImportanceEvaluator()
                ).items()
            }
        except (RuntimeError, ValueError, ZeroDivisionError) as e:  # e.g. all values equal
            note = f"no importances: {e}"
    else:
        note = "importances need 2 or more complete trials"
    return {
        "study": study.study_name,
        "objective": objective_name,
        "trials": counts,
        "best": [{"trial": t.number, "value": t.value, "params": t.params} for t in best],
        "importance": importance,
        "importance_note": note,
    }


def _cell(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def study_markdown(summary: dict[str, Any]) -> str:
    keys = sorted({k for b in summary["best"] for k in b["params"]})
    lines = [
        f"## Study `{summary['study']}`: maximize {summary['objective']}",
        "",
        "Trials: " + ", ".join(f"{n} {k}" for k, n in sorted(summary["trials"].items())),
        "",
        "| trial | " + summary["objective"] + " | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for b in summary["best"]:
        cells = [_cell(b["params"].get(k, "")) for k in keys]
        lines.append(f"| {b['trial']} | {b['value']:.4f} | " + " | ".join(cells) + " |")
    lines.append("")
    if summary["importance"]:
        lines += ["| key | importance (PED-ANOVA) |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in summary["importance"].items()]
    else:
        lines.append(f"({summary['importance_note']})")
    return "\n".join(lines) + "\n"


def refresh_report(out: Path, spec, study) -> None:
    """The sweep's report over the finished trials, with the study's section appended."""
    try:
        md = write_report(out, spec)
        summary = study_summary(study, spec.search.objective)
        report = out / "report"
        report.mkdir(parents=True, exist_ok=True)
        write_json(report / "study.json", summary)
        text = study_markdown(summary)
        write_text(report / "study.md", text)
        if md is not None and (report / "report.md").is_file():
            write_text(report / "report.md", (report / "report.md").read_text() + "\n" + text)
    except Exception as e:  # noqa: BLE001 - a report problem must not stop the search
        log.warning("report not refreshed: %s", e)
