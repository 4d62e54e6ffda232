"""A user error as the CLI reports it: one `error:` line on the console, kept in the log file,
exit status 2, and found before any heavy work (the base model is never loaded for it)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tests.helpers import run, run_here


def test_an_error_is_printed_once_and_kept_in_the_run_log(tmp_path):
    missing = tmp_path / "nonexistent"
    message = f"data.prepared={missing} does not exist"
    common = ["train", "base=tiny_random", f"data.prepared={missing}", f"out={tmp_path / 'o'}"]
    # The project's console-only logging (conf/common.yaml): the error once, on stderr.
    r = run(*common, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (r.stdout + r.stderr).count(message) == 1, r.stdout + r.stderr
    assert f"error: {message}" in r.stderr
    # With hydra's file logging the run's <job>.log holds it too; the console still once.
    run_dir = tmp_path / "run_dir"
    r = run(*common, "hydra/job_logging=default", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2
    assert (r.stdout + r.stderr).count(message) == 1, r.stdout + r.stderr
    logs = list(run_dir.glob("*.log"))
    assert logs and message in logs[0].read_text()


def test_errors_go_to_log_files_only(tmp_path):
    """`log_to_files` writes the record through every file handler the logger reaches and
    through no console handler."""
    from launch.app import log_to_files

    logger = logging.getLogger("hydra_heads.test_errors")
    parent = logging.getLogger("hydra_heads")
    console, file = logging.StreamHandler(), logging.FileHandler(tmp_path / "job.log")
    emitted = []
    console.emit = emitted.append  # type: ignore[method-assign]
    parent.addHandler(console)
    parent.addHandler(file)
    propagate, parent.propagate = parent.propagate, False  # pytest's own root file handler
    try:
        assert log_to_files("it broke", logger) == 1
    finally:
        parent.propagate = propagate
        parent.removeHandler(console)
        parent.removeHandler(file)
        file.close()
    assert emitted == [] and "it broke" in (tmp_path / "job.log").read_text()


def _base_must_not_load(monkeypatch):
    import train.recipe

    def refuse(*a, **k):
        raise AssertionError("the base was loaded before the inputs were checked")

    monkeypatch.setattr(train.recipe, "load_base", refuse)
    monkeypatch.setattr(train.recipe, "DeferredBase", refuse)


def test_missing_prepared_data_fails_before_the_base_loads(tmp_path, monkeypatch):
    _base_must_not_load(monkeypatch)
    out = tmp_path / "o"
    r = run_here("train", "base=tiny_random", f"data.prepared={tmp_path / 'none'}", f"out={out}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "does not exist; create it with `hydra-heads prep" in r.stderr
    assert "AssertionError" not in r.stderr and not out.exists()


def _damage(prepared, tmp_path, how: str):
    bad = tmp_path / "bad"
    shutil.copytree(prepared, bad)
    if how == "stats":
        (bad / "prep_stats.json").write_text('{"base": "tiny_ran')
    elif how == "dataset_dict":
        (bad / "dataset_dict.json").write_text("not json")
    elif how == "split_dir":
        shutil.rmtree(bad / "validation")
    elif how == "arrow":
        for f in (bad / "train").glob("*.arrow"):
            f.write_bytes(f.read_bytes()[:100])
    elif how == "no_columns":
        info = json.loads((bad / "train" / "dataset_info.json").read_text())
        del info["features"]["loss_mask"]
        (bad / "train" / "dataset_info.json").write_text(json.dumps(info))
    return bad


@pytest.mark.parametrize("how", ["stats", "dataset_dict", "split_dir", "arrow", "no_columns"])
def test_damaged_prepared_data_is_a_clear_error(tiny_prepared, tmp_path, monkeypatch, how):
    bad = _damage(tiny_prepared, tmp_path, how)
    _base_must_not_load(monkeypatch)
    r = run_here(
        "train",
        "base=tiny_random",
        f"data.prepared={bad}",
        f"out={tmp_path / 'o'}",
        "logger=none",
        "trainer.max_steps=1",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "AssertionError" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: data.prepared={bad} ")
    assert f"re-run `hydra-heads prep ... out={bad}`" in line
