"""`hydra-heads sweep` with an Optuna search on the tiny model: trials trained and evaluated,
the objective told to a SQLite study, a search killed mid-trial resumes (the interrupted trial
runs again with the same values), and the report shows the study."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import run_here

pytestmark = pytest.mark.slow

# conf/sweep/search_cpu.yaml's space on the tiny model: no draft vocab (259 tokens)
TINY = 'sweep.search.space={head.draft_vocab_size: {choices: ["null"]}}'


def search_args(out: Path, prepared: Path, *extra: str) -> list[str]:
    return [
        "sweep=search_cpu",
        f"out={out}",
        "sweep.search.trials=2",
        "sweep.search.sampler=random",
        "sweep.search.seed=3",
        TINY,
        'sweep.train=["base=tiny_random","head=hydra","trainer.max_steps=6","logger=csv",'
        '"data.batch_size=2","checkpoint_every=2"]',
        'sweep.eval=["tree=chain","eval.num_prompts=2","eval.max_new_tokens=12",'
        '"eval.compare_plain=false"]',
        f'train_args=["data.prepared={prepared}"]',
        *extra,
    ]


def _trials(out: Path):
    import optuna

    study = optuna.load_study(study_name="search_cpu", storage=f"sqlite:///{out / 'study.db'}")
    return study.get_trials(deepcopy=False)


def test_search_runs_resumes_after_a_kill_and_reports_the_study(tiny_prepared, tmp_path):
    from optuna.trial import TrialState

    out = tmp_path / "search"
    args = search_args(out, tiny_prepared)
    # killed (its process group) while the second trial trains, after its first checkpoint
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "sweep", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline, killed_in = time.time() + 300, None
    while time.time() < deadline and proc.poll() is None:
        if (out / "study.db").is_file() and (out / "sweep.json").is_file():
            pts = json.loads((out / "sweep.json").read_text())["points"]
            if len(pts) >= 2 and list((out / "points" / pts[1]["name"]).rglob("*.ckpt")):
                killed_in = pts[1]
                break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert killed_in is not None, "the search never reached its second trial"
    states = [t.state for t in _trials(out)]
    assert states[0] == TrialState.COMPLETE and states[1] == TrialState.RUNNING, states

    r = run_here("sweep", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    trials = _trials(out)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 2, [(t.number, t.state) for t in trials]
    # the interrupted trial failed and ran again with its values, from its checkpoint
    assert trials[1].state == TrialState.FAIL
    again = [t for t in trials if t.user_attrs.get("requeued_from") == 1]
    assert len(again) == 1 and again[0].params == trials[1].params
    log = (out / "logs" / f"{killed_in['name']}.log").read_text()
    assert "resum" in log.lower(), log[-2000:]
    # every complete trial's value is its point's measured tau
    state = json.loads((out / "sweep.json").read_text())
    for t in complete:
        (point,) = [p for p in state["points"] if t.number in (p["trial"], *p.get("trials", []))]
        ev = json.loads((out / point["dir"] / "eval.json").read_text())
        assert t.value == pytest.approx(ev["tau"])
    study = json.loads((out / "report" / "study.json").read_text())
    assert study["trials"]["complete"] == 2 and len(study["best"]) == 2
    assert study["best"][0]["value"] == max(t.value for t in complete)
    md = (out / "report" / "report.md").read_text()
    assert "## Study `search_cpu`: maximize tau" in md
    assert "head.num_layers" in md and "optim.lr" in md

    # raising the budget extends the same study; a changed space is another search
    r = run_here("sweep", *search_args(out, tiny_prepared), "sweep.search.trials=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sum(t.state == TrialState.COMPLETE for t in _trials(out)) == 3
    r = run_here("sweep", *search_args(out, tiny_prepared), "sweep.search.seed=4")
    assert r.returncode == 2 and "belongs to a different sweep: sweep.search changed" in r.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sweep.search.space={optim.lr: {low: 1, high: 0.1}}", "low < high"),
        ("sweep.search.space={head: {choices: []}}", "a non-empty list"),
        ("sweep.search.objective=speed", "sweep.search.objective"),
        ("backend=slurm", "a search runs its trials one after another"),
    ],
)
def test_bad_searches_fail_clearly(tiny_prepared, tmp_path, override, message):
    r = run_here("sweep", *search_args(tmp_path / "s", tiny_prepared), override)
    assert r.returncode == 2, r.stdout[-1000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_search_and_grid_together_is_an_error(tiny_prepared, tmp_path):
    args = [*search_args(tmp_path / "s", tiny_prepared), 'grid=["head=medusa,hydra"]']
    r = run_here("sweep", *args)
    assert r.returncode == 2 and "a search draws its own points" in r.stderr


def test_search_space_schema():
    from launch.config import SearchParam, SearchSpec
    from train.core.errors import ConfigError

    with pytest.raises(ConfigError, match="at least one train key to search"):
        SearchSpec(backend="optuna", trials=2, sampler="tpe", seed=0, objective="tau", space={})
    with pytest.raises(ConfigError, match="> 0 on a log scale"):
        SearchParam(low=0.0, high=1.0, log=True)
    with pytest.raises(ConfigError, match="either choices"):
        SearchParam(choices=["a"], low=1.0, high=2.0)
    assert SearchParam(low=1.0, high=4.0, integer=True).integer


def test_a_corrupt_study_fails_naming_the_file_and_the_fix(tmp_path):
    """study.db cut short or overwritten: a one-line error naming it and the fix, from the CLI,
    before any trial runs (not a database traceback from inside Optuna)."""
    import sqlite3
    from contextlib import closing

    from launch.search import check_study
    from train.core.errors import UserError

    out = tmp_path / "s"
    out.mkdir()
    db = out / "study.db"
    db.write_bytes(b"not a database, only some text long enough to be read as a header")
    r = run_here("sweep", *search_args(out, tmp_path / "no_data"))
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-2000:]
    assert f"the search's study {db} is corrupt" in r.stderr and "Traceback" not in r.stderr
    assert "Move it away and run the search again with the same out=" in r.stderr
    assert not (out / "points").exists()  # no trial ran
    # a real SQLite file truncated mid-page; an intact one passes, and so does none at all
    db.unlink()
    with closing(sqlite3.connect(db)) as con, con:
        con.execute("create table t (x text)")
        con.executemany("insert into t values (?)", [("x" * 500,)] * 200)
    check_study(db)
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="is corrupt"):
        check_study(db)
    check_study(out / "missing.db")
