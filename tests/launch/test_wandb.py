"""logger=wandb (offline, no network): training records its run; eval and report log their
figures and tables into that same run; loss curves still reach the report."""

from __future__ import annotations

import json

from tests.helpers import run


def test_eval_and_report_log_into_the_training_run(tiny_prepared, tmp_path):
    train, ev, rep = tmp_path / "train", tmp_path / "eval", tmp_path / "report"
    r = run(
        "train", "base=tiny_random", "head=hydra", "logger=wandb", "trainer.max_steps=4",
        "trainer.val_check_interval=2", f"data.prepared={tiny_prepared}", f"out={train}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((train / "train_summary.json").read_text())["wandb_run"]
    assert info["mode"] == "offline" and info["dir"] == str(train.resolve())
    r = run("eval", f"heads={train / 'heads'}", f"out={ev}", "tree=chain", "eval.num_prompts=2",
            "eval.max_new_tokens=12")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    # offline runs cannot be resumed: the eval logs into a run grouped with the training run
    assert f"(group {info['id']})" in r.stdout
    r = run("report", f"runs=[{tmp_path}]", f"out={rep}", "wandb=true")
    assert r.returncode == 0, r.stderr[-3000:]

    runs = sorted((train / "wandb").glob("offline-run-*"))
    assert len(runs) == 3  # training, eval, report
    media = [
        p.relative_to(runs[0].parent).as_posix() for p in train.glob("wandb/*/files/media/**/*")
    ]
    assert any("table/eval/acceptance_by_depth" in m for m in media), media
    assert any("table/report/leaderboard" in m for m in media), media
    assert any("images/report/acceptance_by_depth" in m for m in media), media
    # the CSV logger rides along with wandb, so the report has loss curves
    data = json.loads((rep / "report.json").read_text())
    assert data["runs"][0]["train"]["curves"]["train/loss"]
    assert "loss_curves" in data["plots"]
