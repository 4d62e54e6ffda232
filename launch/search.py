"""`hydra-heads sweep` with `sweep.search`: a budgeted Optuna search over train keys.

Each trial draws a value for every key of `search.space`, trains those overrides as a sweep
point (points/<trial point>/train, resumable like any point), evaluates it with the sweep's
eval overrides, and reports the objective to the study: eval's measured tau, or tau per
minute of training. Optuna is used directly, not through hydra-core's Optuna sweeper: a
sweep's points are separate `train` and `eval` processes with their own checkpoints and
logs, so that a killed trial resumes from its last checkpoint instead of restarting, and the
sweeper plugin runs its jobs inside one hydra multirun.

The study lives in <out>/study.db (SQLite). A killed search resumes where it stopped: the
finished trials stay, and the trial that was running is marked failed and queued again with
the same values, so its point continues from its checkpoint. Raising `sweep.search.trials` on
the same out extends the search. One process runs a search at a time (<out>/search.lock).

<out>/report/ holds the sweep's report over the finished trials, plus study.md / study.json:
the best trials, and each key's importance (Optuna's PED-ANOVA evaluator, which needs no
scikit-learn) once enough trials are complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

from launch.config import SearchSpec, SweepConfig
from launch.grid import override_value, unique_slugs
from launch.points import run_point, write_report
from launch.sweep_state import add_point, read_state, update_point
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


def _study(spec: SearchSpec, name: str, out: Path):
    import optuna

    check_study(out / "study.db")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = (
        optuna.samplers.TPESampler(seed=spec.seed)
        if spec.sampler == "tpe"
        else optuna.samplers.RandomSampler(seed=spec.seed)
    )
    return optuna.create_study(
        study_name=name,
        storage=f"sqlite:///{out / 'study.db'}",
        direction="maximize",
        sampler=sampler,
        load_if_exists=True,
    )


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


def _requeue_interrupted(study) -> int:
    """Trials a killed search left running: failed, and queued again with the same values."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in stale:
        study.tell(t.number, state=TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"requeued_from": t.number})
    return len(stale)


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


def run_search(cfg: SweepConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    """Run the search to `search.trials` finished trials; returns sweep.json's content."""
    from optuna.trial import TrialState
    from rich.markup import escape
    from rich.progress import Progress

    spec, search = cfg.sweep, cfg.sweep.search
    with open(out / "search.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(
                f"another process is running the search in {out}; wait for it, or use another out"
            ) from None
        study = _study(search, spec.name, out)
        requeued = _requeue_interrupted(study)
        done = finished_trials(study)
        with Progress(disable=not progress) as bar:
            task = bar.add_task(f"search {spec.name}", total=search.trials, completed=done)
            if requeued:
                bar.console.print(f"resuming: {requeued} interrupted trial(s) queued again")
            failures = 0
            while done < search.trials:
                trial = study.ask()
                point = _point(suggest(trial, search.space), trial.number)
                add_point(out, point)
                state = read_state(out)
                current = next(p for p in state["points"] if p["name"] == point["name"])
                stage, msg = None, ""
                if current["status"] != "done":
                    stage, msg = run_point(
                        cfg, out, current, lambda d, n=trial.number: bar.update(
                            task, description=f"trial {n}: {d}"
                        )
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
                done += 1
                bar.advance(task)
                if cfg.report:
                    refresh_report(out, spec, study)
                if cfg.max_failures and failures >= cfg.max_failures:
                    break
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
