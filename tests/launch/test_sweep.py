"""`hydra-heads sweep` end to end on the tiny model: every point trained and evaluated, one
report, and a sweep killed mid-way resumes without redoing finished points."""

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


def sweep_args(out: Path, prepared: Path) -> list[str]:
    return [
        f"out={out}",
        "sweep.grid={head:[medusa,hydra]}",
        'sweep.train=["base=tiny_random","trainer.max_steps=4","logger=csv","data.batch_size=2",'
        '"checkpoint_every=2"]',
        'sweep.eval=["tree=chain","eval.num_prompts=2","eval.max_new_tokens=12"]',
        f'train_args=["data.prepared={prepared}"]',
    ]


def _state(out: Path) -> dict:
    try:
        return json.loads((out / "sweep.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def test_sweep_runs_reports_and_resumes_after_a_kill(tiny_prepared, tmp_path):
    out = tmp_path / "sweep"
    args = sweep_args(out, tiny_prepared)
    # First run: killed (the whole process group, as a scheduler would) once point 1 is done.
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "sweep", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        pts = _state(out).get("points", [])
        if pts and pts[0]["status"] == "done" and (out / "report" / "report.md").is_file():
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = _state(out)["points"]
    assert first[0]["status"] == "done" and first[1]["status"] != "done", first
    report_md = out / "report" / "report.md"
    assert "head-medusa" in report_md.read_text()  # the report already covers finished points

    # The resumed sweep runs in this process (its points still run as `hydra-heads` processes).
    r = run_here("sweep", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    final = _state(out)["points"]
    assert [p["status"] for p in final] == ["done", "done"]
    # the finished point was not trained again
    log1 = (out / "logs" / "head-medusa.log").read_text()
    assert log1.count(" train ") == 1, log1[-2000:]
    rep = json.loads((out / "report" / "report.json").read_text())
    assert sorted(r["name"] for r in rep["leaderboard"]) == ["head-hydra", "head-medusa"]
    assert {r["arch"] for r in rep["runs"]} == {"medusa", "hydra"}
    assert all(r["tau"] >= 1.0 for r in rep["runs"])
    # what differs between the points is the head, and the report says so
    assert "head.name" in rep["config_diff"], list(rep["config_diff"])
    for f in ("report.html", "acceptance_by_depth.png", "loss_curves.png"):
        assert (out / "report" / f).stat().st_size > 1000

    # A third run has nothing left to do: no new train or eval step.
    before = {p.name: p.stat().st_size for p in (out / "logs").iterdir()}
    r = run_here("sweep", *args)
    assert r.returncode == 0
    assert {p.name: p.stat().st_size for p in (out / "logs").iterdir()} == before


def test_sweep_refuses_a_changed_grid_and_bad_keys(tiny_prepared, tmp_path):
    # `hydra-heads sweep` in this process: none of these runs a point (the sweep above runs the
    # real command), so each would mostly pay a new interpreter's imports
    out = tmp_path / "sweep"
    r = run_here("sweep", *sweep_args(out, tiny_prepared), "dry_run=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "head-medusa [pending]" in r.stdout and "resume=auto" in r.stdout
    assert "overwrite=true" in r.stdout  # a point's eval is re-run into its own dir
    assert not out.exists()  # a dry run writes nothing, so a corrected grid is still welcome
    # a sweep that started (its sweep.json written) refuses another grid, naming what changed
    from launch.config import SweepConfig
    from launch.sweep_state import load_state
    from train.core.atomic import write_json
    from train.core.config import compose
    from train.core.config import load as to_typed

    cfg = to_typed(compose("sweep", sweep_args(out, tiny_prepared)), SweepConfig)
    out.mkdir()
    write_json(out / "sweep.json", load_state(out, cfg.sweep))
    changed = [a if not a.startswith("sweep.grid") else "sweep.grid={head:[hydra_pp]}" for a in
               sweep_args(out, tiny_prepared)]  # fmt: skip
    r = run_here("sweep", *changed, "dry_run=true")
    assert r.returncode == 2 and "belongs to a different sweep: sweep.grid changed" in r.stderr
    r = run_here("sweep", *sweep_args(out, tiny_prepared), "dry_run=true", "sweep.sort_by=speedup")
    assert r.returncode == 0  # the report's order is not the sweep's identity
    r = run_here("sweep", *sweep_args(out, tiny_prepared), "sweep.sort_by=vibes")
    assert r.returncode == 2 and "sweep.sort_by" in r.stderr
    r = run_here("sweep", f"out={tmp_path / 'x'}", "sweep.grid={head:[]}")
    assert r.returncode == 2 and "sweep.grid.head" in r.stderr
    # the command-line grid (hydra multirun style) replaces the file's; values keep brackets
    r = run_here("sweep", f"out={tmp_path / 'z'}", "dry_run=true",
            'grid=["head.num_layers=1,2","optim.betas=[0.9,0.99],[0.8,0.9]"]')  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("[pending]") == 4
    assert "head.num_layers=2 'optim.betas=[0.8,0.9]'" in r.stdout
    r = run_here("sweep", f"out={tmp_path / 'w'}", "dry_run=true", 'grid=["head"]')
    assert r.returncode == 2 and "a key, '=', comma-separated values" in r.stderr
    r = run_here(
        "sweep",
        f"out={tmp_path / 'y'}",
        "only=nope",
        *sweep_args(tmp_path / "y", tiny_prepared)[1:],
    )
    assert r.returncode == 2 and "not a train point" in r.stderr


@pytest.mark.skipif(not slurm_up(), reason="no SLURM cluster (launch/slurm/local_cluster_up.sh)")
@pytest.mark.xdist_group("slurm")  # one xdist worker runs the SLURM tests, one after another
def test_sweep_points_as_slurm_jobs(tiny_prepared, tmp_path):
    """backend=slurm: one job per train point; each job trains, evaluates, refreshes the report."""
    out = tmp_path / "sweep"
    slurm = ["backend=slurm", "slurm.gpus_per_node=0", "slurm.cpus_per_task=1",
             "slurm.time=00:10:00"]  # fmt: skip
    r = run("sweep", *sweep_args(out, tiny_prepared), *slurm)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("submitted head-") == 2
    deadline = time.time() + 400
    while time.time() < deadline:  # until both jobs have left the queue (report written too)
        jobs = set(_state(out).get("jobs", {}).values())
        queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
        if jobs and not jobs & set(queued.stdout.split()):
            break
        time.sleep(0.5)
    logs = " ".join(p.read_text()[-1500:] for p in out.rglob("slurm-*.out"))
    assert [p["status"] for p in _state(out)["points"]] == ["done", "done"], logs
    assert set(_state(out)["jobs"]) == {"head-medusa", "head-hydra"}
    rep = json.loads((out / "report" / "report.json").read_text())
    assert len(rep["leaderboard"]) == 2
    # the job ran this point's training as a job step (srun) and its eval after it
    log = (out / "logs" / "head-hydra.log").read_text()
    assert "$ srun --kill-on-bad-exit=1 " in log and " -m launch eval " in log
    assert list((out / "points" / "head-hydra").glob("slurm-*.out"))
    # submitting again while nothing is left to do submits nothing (no job: in this process)
    r = run_here("sweep", *sweep_args(out, tiny_prepared), *slurm)
    assert r.returncode == 0 and "submitted" not in r.stdout


def test_slurm_point_script_and_grid_values(tiny_prepared, tmp_path, monkeypatch):
    """backend=slurm renders, per train point, an sbatch script whose job runs this sweep for
    that point with srun on the train step; grid values survive hydra's grammar."""
    import shlex

    from launch.config import SweepConfig, SweepSpec
    from launch.sweep import submit_points
    from launch.sweep_state import plan_points
    from train.core.config import compose
    from train.core.config import load as to_typed

    def sweep_spec(**kw):
        return SweepSpec(**{"eval_grid": {}, "train": [], "eval": [], "sort_by": "tau", **kw})

    spec = sweep_spec(
        name="t",
        grid={"head.draft_vocab_size": [None, 64], "eval.prompts": ["/d/a b.jsonl"]},
        train=["base=tiny_random"],
    )
    pts = plan_points(spec)
    assert [p["train_overrides"][0] for p in pts] == [
        "head.draft_vocab_size=null",
        "head.draft_vocab_size=64",
    ]
    assert pts[0]["train_overrides"][1] == "eval.prompts='/d/a b.jsonl'"
    # overrides that slug alike still get their own dirs
    alike = plan_points(sweep_spec(name="t", grid={"tree.paths": [[[0], [1]], [[0, 1]]]}))
    assert len({p["dir"] for p in alike}) == 2

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = "" if cmd[0] == "squeue" else f"{100 + len(calls)}\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["sweep.py", "out=X", "backend=slurm", "only=zz"])
    out = tmp_path / "s"
    out.mkdir()
    cfg = to_typed(compose("sweep", [f"out={out}", "backend=slurm", "slurm.gpus_per_node=2",
                   "slurm.tasks_per_node=2", "slurm.partition=gpu"]), SweepConfig)  # fmt: skip
    cfg.sweep = spec
    state = {"spec": {}, "points": plan_points(spec)}
    (out / "sweep.json").write_text(json.dumps(state))
    st = submit_points(cfg, out, state)
    assert len(st["jobs"]) == 2 and [c[0] for c in calls] == ["sbatch", "sbatch"]
    script = (out / "points" / pts[0]["train_point"] / "sweep_point.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=2" in script and "#SBATCH --partition=gpu" in script
    assert "#SBATCH --requeue" in script
    job = shlex.split(script.strip().splitlines()[-1])
    assert job[1:4] == ["-m", "launch", "sweep"] and "backend=slurm" not in job
    assert "only=zz" not in job and f"only={pts[0]['train_point']}" in job
    assert 'train_prefix=["srun", "--kill-on-bad-exit=1"]' in job
    assert 'job_train_args=["trainer.num_nodes=1", "trainer.devices=2"]' in job
    assert 'job_eval_args=["eval.device=cuda"]' in job
    # the job's own command line composes into the point's config

    job_cfg = to_typed(compose("sweep", [a for a in job[4:] if not a.startswith("out=")] +
                               [f"out={out}"]), SweepConfig)  # fmt: skip
    assert job_cfg.backend == "local" and job_cfg.train_prefix[0] == "srun"


def test_a_misspelled_grid_key_fails_before_any_point(tiny_prepared, tmp_path):
    out = tmp_path / "s"
    args = ["sweep=architectures", f"out={out}", 'grid=["optim.lrr=0.1,0.2"]']
    r = run_here("sweep", *args, f'train_args=["data.prepared={tiny_prepared}"]')
    assert r.returncode == 2, r.stderr[-2000:]
    assert "a point's training would fail its config check with optim.lrr=0.1" in r.stderr
    assert "Traceback" not in r.stderr and not (out / "sweep.json").exists()


def test_a_corrupt_sweep_state_fails_naming_the_file_and_the_fix(tmp_path):
    """sweep.json cut short (a full disk, an interrupted copy) or replaced: a one-line error
    that names the file and what to do, from the CLI and from every reader of the state."""
    from launch.config import SweepSpec
    from launch.sweep_state import add_point, load_state, read_state, update_point
    from train.core.atomic import write_json
    from train.core.errors import UserError

    out = tmp_path / "sweep"
    args = [f"out={out}", "sweep.grid={head:[medusa,hydra]}", "dry_run=true"]
    grid = {"head": ["medusa", "hydra"]}
    spec = SweepSpec(name="t", grid=grid, eval_grid={}, train=[], eval=[], sort_by="tau")
    out.mkdir()
    write_json(out / "sweep.json", load_state(out, spec))
    text = (out / "sweep.json").read_text()
    (out / "sweep.json").write_text(text[: len(text) // 2])  # truncated mid-record
    r = run_here("sweep", *args)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-2000:]
    assert f"the sweep state {out / 'sweep.json'} is corrupt (not valid JSON" in r.stderr
    assert "Delete it and run the sweep again with the same out=" in r.stderr
    assert "Traceback" not in r.stderr
    for read in (
        lambda: read_state(out),
        lambda: load_state(out, spec),
        lambda: update_point(out, "head-medusa", status="done"),
        lambda: add_point(out, {"name": "x", "trial": 0}),
    ):
        with pytest.raises(UserError, match="is corrupt .*Delete it"):
            read()
    for content in (b"[]", b'{"points": 3}', b"\xff\xfe{"):
        (out / "sweep.json").write_bytes(content)
        with pytest.raises(UserError, match=r"sweep\.json is corrupt \((not valid JSON|no list)"):
            read_state(out)
