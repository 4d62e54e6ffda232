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

from tests.launch.test_cli import run

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

    r = run("sweep", *args)
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
    r = run("sweep", *args)
    assert r.returncode == 0
    assert {p.name: p.stat().st_size for p in (out / "logs").iterdir()} == before


def test_sweep_refuses_a_changed_grid_and_bad_keys(tiny_prepared, tmp_path):
    out = tmp_path / "sweep"
    r = run("sweep", *sweep_args(out, tiny_prepared), "dry_run=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "head-medusa [pending]" in r.stdout and "resume=auto" in r.stdout
    changed = [a if not a.startswith("sweep.grid") else "sweep.grid={head:[hydra_pp]}" for a in
               sweep_args(out, tiny_prepared)]  # fmt: skip
    r = run("sweep", *changed, "dry_run=true")
    assert r.returncode == 2 and "belongs to a different sweep" in r.stderr
    r = run("sweep", f"out={tmp_path / 'x'}", "sweep.grid={head:[]}")
    assert r.returncode == 2 and "sweep.grid.head" in r.stderr
    # the command-line grid (hydra multirun style) replaces the file's; values keep brackets
    r = run("sweep", f"out={tmp_path / 'z'}", "dry_run=true",
            'grid=["head.num_layers=1,2","optim.betas=[0.9,0.99],[0.8,0.9]"]')  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("[pending]") == 4
    assert "head.num_layers=2 optim.betas=[0.8,0.9]" in r.stdout
    r = run("sweep", f"out={tmp_path / 'w'}", "dry_run=true", 'grid=["head"]')
    assert r.returncode == 2 and "a key, '=', comma-separated values" in r.stderr
    r = run(
        "sweep",
        f"out={tmp_path / 'y'}",
        "only=nope",
        *sweep_args(tmp_path / "y", tiny_prepared)[1:],
    )
    assert r.returncode == 2 and "not a train point" in r.stderr
