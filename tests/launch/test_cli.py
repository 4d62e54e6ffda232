"""The hydra-heads CLI as a user runs it: help, --cfg job, clear errors, outputs with config."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import pytest
import yaml

from tests.helpers import GOOD, run


def test_help_lists_subcommands():
    r = run("--help")
    assert r.returncode == 0 and "prep" in r.stdout and "subcommands" in r.stdout
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown subcommand 'frobnicate'" in r.stderr


def test_cfg_job_shows_composed_config():
    r = run("prep", "base=tiny_random", "out=/tmp/x", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["base"]["source"] == "tiny_random" and cfg["data"]["name"] == "sharegpt_bundled"


def test_bad_value_exits_2_naming_key_before_heavy_work():
    r = run("prep", "out=/tmp/x", "data.max_length=-5")
    assert r.returncode == 2
    assert "'data.max_length' = -5" in r.stderr and ">= 16" in r.stderr
    assert "Traceback" not in r.stderr


def test_no_arguments_name_every_missing_key_with_an_example():
    r = run("train")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        "'data.prepared', 'out' are required" in r.stderr and "e.g. hydra-heads train" in r.stderr
    )
    assert "MissingMandatoryValue" not in r.stderr and "logger.save_dir" not in r.stderr


def test_missing_input_file_is_a_clear_error(tmp_path):
    r = run(
        "prep",
        "base=tiny_random",
        "data=sharegpt",
        f"data.path={tmp_path / 'no.json'}",
        f"out={tmp_path / 'o'}",
    )
    assert r.returncode == 2
    assert "input not found" in r.stderr and "no.json" in r.stderr
    assert not (tmp_path / "o").exists()


def test_prep_via_cli_writes_dataset_stats_and_resolved_config(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in GOOD))
    r = run(
        "prep",
        "base=tiny_random",
        "data=jsonl",
        f"data.path={data}",
        f"out={tmp_path / 'o'}",
        "data.val_fraction=0",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    out = tmp_path / "o"
    assert {"dataset_dict.json", "prep_stats.json", "config.yaml", "train"} <= {
        p.name for p in out.iterdir()
    }
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["path"] == str(data) and saved["base"]["name"] == "tiny_random"
    assert "conversations kept" in r.stdout
    # Nothing is written into the working directory besides what was asked for.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "o"]


def test_python_dash_m_entry_points(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "launch", "prep", "base=tiny_random", "out=x", "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "tiny_random" in r.stdout, r.stderr


@pytest.mark.parametrize(
    "package, command", [("train", "train"), ("data_prep", "prep"), ("evaluation", "eval")]
)
def test_python_dash_m_package_runs_its_subcommand(package, command, monkeypatch, capsys):
    """`python -m <package>` (run here as the interpreter runs it) is `hydra-heads <command>`:
    without arguments, that command's own missing keys and example."""
    monkeypatch.setattr(sys, "argv", [package])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(package, run_name="__main__")
    assert e.value.code == 2
    assert f"e.g. hydra-heads {command} " in capsys.readouterr().err


def test_train_on_missing_prepared_data_is_a_clear_error(tmp_path):
    r = run(
        "train", "base=tiny_random", f"data.prepared={tmp_path / 'none'}", f"out={tmp_path / 'o'}"
    )
    assert r.returncode == 2
    assert "does not exist; create it with `hydra-heads prep" in r.stderr
    assert "Traceback" not in r.stderr


def test_train_with_wandb_logger_runs_offline_without_an_api_key(tiny_prepared, tmp_path):
    env_key = os.environ.pop("WANDB_API_KEY", None)
    try:
        r = run(
            "train",
            "base=tiny_random",
            f"data.prepared={tiny_prepared}",
            f"out={tmp_path / 'o'}",
            "trainer.max_steps=2",
            "logger=wandb",
            "head.num_heads=2",
        )
    finally:
        if env_key is not None:
            os.environ["WANDB_API_KEY"] = env_key
    assert r.returncode == 0, r.stderr[-2000:]
    assert list((tmp_path / "o" / "wandb").glob("offline-run-*"))
    assert (tmp_path / "o" / "heads" / "heads.safetensors").is_file()
