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

from tests.helpers import run, run_here, slurm_up

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
        ("storage=study.db", "null (<out>/study.db), journal (<out>/study.journal) or an RDB"),
        ("threads_per_worker=0", "threads_per_worker"),
    ],
)
def test_bad_searches_fail_clearly(tiny_prepared, tmp_path, override, message):
    r = run_here("sweep", *search_args(tmp_path / "s", tiny_prepared), override)
    assert r.returncode == 2, r.stdout[-1000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_misspelled_space_key_fails_before_any_trial(tiny_prepared, tmp_path):
    space = "+sweep.search.space={head: {choices: [hydra]}, optim.lrr: {low: 0.001, high: 0.01}}"
    out = tmp_path / "s"
    r = run_here("sweep", *search_args(out, tiny_prepared), "~sweep.search.space", space)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "would fail its config check with head=hydra optim.lrr=0.001 (Could not override" in (
        r.stderr
    )
    assert not (out / "study.db").exists()


def test_search_and_grid_together_is_an_error(tiny_prepared, tmp_path):
    args = [*search_args(tmp_path / "s", tiny_prepared), 'grid=["head=medusa,hydra"]']
    r = run_here("sweep", *args)
    assert r.returncode == 2 and "a search draws its own points" in r.stderr


def test_workers_are_for_searches(tiny_prepared, tmp_path):
    args = ["sweep=architectures_cpu", f"out={tmp_path / 'g'}", "workers=2"]
    r = run_here("sweep", *args)
    assert r.returncode == 2 and "1 for a grid (workers run a search's trials" in r.stderr


def _draws(space, seed: int, n: int) -> list[dict]:
    """What sampler=random with `seed` draws for n trials in one process, one after another."""
    import optuna

    from launch.search import suggest

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        t = study.ask()
        suggest(t, space)
        study.tell(t, 0.0)
        out.append(t.params)
    return out


def test_two_local_workers_share_one_journal_study(tiny_prepared, tmp_path):
    """workers=2 storage=journal: two worker processes, 1 thread each on 2 cores, finish the
    search's trials together, with the trials (seeded random) that one process draws."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    from launch.config import SweepConfig
    from train.core.config import compose, load

    out = tmp_path / "search"
    args = [*search_args(out, tiny_prepared), "sweep.search.trials=4"]
    space = load(compose("sweep", args), SweepConfig).sweep.search.space
    r = run_here("sweep", *args, "workers=2", "storage=journal", "threads_per_worker=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert not (out / "study.db").exists()
    storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
    trials = optuna.load_study(study_name="search_cpu", storage=storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert [t.params for t in trials] == _draws(space, 3, 4)
    assert {t.user_attrs["worker"] for t in trials} == {"0", "1"}  # both workers ran trials
    for i in (0, 1):  # each worker's console, and its trials' steps at one thread
        log = (out / "logs" / f"worker-{i}.log").read_text()
        assert "trial " in log, log[-2000:]
    state = json.loads((out / "sweep.json").read_text())
    assert sorted(p["status"] for p in state["points"]) == ["done"] * 4
    assert json.loads((out / "report" / "study.json").read_text())["trials"]["complete"] == 4


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (["workers=1"], None),  # one worker: the trials use every core
        (["workers=2", "worker=0"], "shared"),  # local workers share this machine's cores
        (["workers=2", "worker=slurm-1"], None),  # a SLURM job: its own allocation, whole
        (["workers=2", "worker=slurm-1", "threads_per_worker=3"], 3),  # the key always wins
        (["workers=2", "worker=1", "threads_per_worker=3"], 3),
    ],
)
def test_threads_a_workers_trials_run_on(tiny_prepared, tmp_path, overrides, want):
    from launch.config import SweepConfig
    from launch.search import worker_threads
    from train.core.config import compose, load

    cfg = load(compose("sweep", [*search_args(tmp_path, tiny_prepared), *overrides]), SweepConfig)
    if want == "shared":
        want = max(1, len(os.sched_getaffinity(0)) // 2)
    assert worker_threads(cfg) == want


def test_a_killed_workers_trial_is_queued_again_and_a_live_ones_is_not(tmp_path):
    """A running trial whose worker's lock is free (the worker was killed) fails and is queued
    again with its values; one whose worker holds its lock is left alone."""
    import optuna
    from optuna.trial import TrialState

    from launch.search import _requeue_interrupted
    from launch.sweep_state import point_lock

    out = tmp_path / "s"
    (out / "workers").mkdir(parents=True)
    study = optuna.create_study(storage=f"sqlite:///{out / 'study.db'}", study_name="x")
    for worker in ("dead", "alive", "me"):  # "me": the asking worker's own, from a killed run
        t = study.ask()
        t.suggest_float("optim.lr", 0.01, 1.0)
        t.set_user_attr("worker", worker)
    with point_lock(out / "workers" / "alive.lock") as held:  # a live worker, in another fd
        assert held
        assert _requeue_interrupted(study, out, "me") == 2
    trials = study.get_trials()
    assert [t.state for t in trials[:3]] == [TrialState.FAIL, TrialState.RUNNING, TrialState.FAIL]
    queued = [t for t in trials if t.state == TrialState.WAITING]
    assert [t.user_attrs["requeued_from"] for t in queued] == [0, 2]
    fixed = [t.system_attrs["fixed_params"] for t in queued]  # what their ask will suggest
    assert fixed == [trials[0].params, trials[2].params]


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


@pytest.mark.skipif(not slurm_up(), reason="no SLURM cluster (launch/slurm/local_cluster_up.sh)")
@pytest.mark.xdist_group("slurm")  # one xdist worker runs the SLURM tests, one after another
def test_search_workers_as_slurm_jobs(tiny_prepared, tmp_path):
    """backend=slurm workers=2: two SLURM jobs, each a worker of the one journal study."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    out = tmp_path / "search"
    slurm = ["backend=slurm", "workers=2", "storage=journal", "slurm.gpus_per_node=0",
             "slurm.cpus_per_task=1", "slurm.time=00:10:00"]  # fmt: skip
    r = run("sweep", *search_args(out, tiny_prepared), *slurm)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("submitted search worker slurm-") == 2
    jobs = set(json.loads((out / "sweep.json").read_text())["jobs"].values())
    deadline = time.time() + 400
    while time.time() < deadline:  # until both jobs have left the queue
        queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
        if not jobs & set(queued.stdout.split()):
            break
        time.sleep(0.5)
    logs = " ".join(p.read_text()[-1500:] for p in out.rglob("slurm-*.out"))
    storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
    trials = optuna.load_study(study_name="search_cpu", storage=storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, logs
    assert {t.user_attrs["worker"] for t in trials} <= {"slurm-0", "slurm-1"}
    log = " ".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "$ srun --kill-on-bad-exit=1 " in log  # trials trained as job steps


def test_the_sweep_check_writes_search_values_as_trials_get_them():
    """sweep's config check composes each search value as search.suggest writes it."""
    from launch.config import SearchParam
    from launch.sweep import _space_values

    assert _space_values(SearchParam(choices=["a b", 2, None])) == ["'a b'", "2", "null"]
    ranged = SearchParam(low=200, high=1600, log=True, integer=True)
    assert _space_values(ranged) == ["200", "1600"]
    assert _space_values(SearchParam(low=3e-4, high=3e-3)) == ["0.0003", "0.003"]
