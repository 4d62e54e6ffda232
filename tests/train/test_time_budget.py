"""`max_minutes`: the step count fitted to a time budget, fixed once, kept over a resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import run_here
from train.time_budget import StepsForTime, fix_step, steps_for


class Clock:
    """A clock that moves only when the test moves it."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _trainer(cap: int, step: int = 0):
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(max_steps=cap))
    return SimpleNamespace(
        global_step=step, fit_loop=loop, strategy=SimpleNamespace(broadcast=lambda x: x)
    )


def _run(cb, trainer, module, clock, until, step_s, slow_first=0, validate=None) -> None:
    """Optimizer steps from trainer.global_step to `until` (or the fitted count), with the
    hooks Lightning calls: each takes `step_s` seconds on `clock`, the process's first
    `slow_first` steps 10x that, and a validation of `validate[1]` seconds runs after every
    `validate[0]` steps."""
    cb.on_train_start(trainer, module)
    first = trainer.global_step
    while trainer.global_step < min(until, trainer.fit_loop.epoch_loop.max_steps):
        clock.t += step_s * (10 if trainer.global_step - first < slow_first else 1)
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, module, None, None, 0)
        if validate and trainer.global_step % validate[0] == 0:
            cb.on_validation_start(trainer, module)
            clock.t += validate[1]
            cb.on_validation_end(trainer, module)


def _fresh(minutes=10, cap=10_000, warmup=50, t=0.0):
    clock = Clock(t)
    cb = StepsForTime(minutes, cap=cap, warmup_steps=warmup, clock=clock)
    return cb, _trainer(cap), SimpleNamespace(max_steps=cap), clock


def test_steps_for_fills_the_budget_within_the_cap():
    assert steps_for(10, spent_s=60, step=30, step_s=2.0, cap=10_000) == 300  # 540 s left
    assert steps_for(10, spent_s=60, step=30, step_s=2.0, cap=200) == 200
    assert steps_for(1, spent_s=120, step=30, step_s=2.0, cap=10_000) == 31  # already over


def test_the_count_is_fixed_inside_the_warmup_where_it_can_be():
    assert fix_step(50) == 30  # the recipes: warmup 50
    assert fix_step(20) == 19  # conf/train.yaml's default: the warmup's last step
    assert fix_step(10) == 30  # too short a warmup to time 5 steps in it


def test_the_count_is_fixed_from_the_measured_pace_and_drives_the_schedule():
    cb, trainer, module, clock = _fresh()
    # the first 5 steps (untimed) are 10x slower: they count as time spent, not as the pace
    _run(cb, trainer, module, clock, until=10_000, step_s=2.0, slow_first=5)
    # 100 s + 25 x 2 s spent by step 30, then 450 s left at 2 s a step: 225 more
    assert cb.step_s == pytest.approx(2.0) and cb.fixed_at == 30
    assert cb.steps == 255 and trainer.global_step == 255
    assert trainer.fit_loop.epoch_loop.max_steps == 255 and module.max_steps == 255
    assert cb.summary() == {
        "max_minutes": 10,
        "steps": 255,
        "step_s": 2.0,
        "fixed_at_step": 30,
        "cap": 10_000,
    }


def test_validation_is_not_part_of_the_pace_nor_of_the_time_spent():
    cb, trainer, module, clock = _fresh()
    _run(cb, trainer, module, clock, until=10_000, step_s=2.0, validate=(10, 100.0))
    assert cb.step_s == pytest.approx(2.0) and cb.steps == 300  # as without validation


def test_a_resumed_run_keeps_the_count_it_fixed_within_its_cap(caplog):
    cb, trainer, module, clock = _fresh()
    _run(cb, trainer, module, clock, until=100, step_s=2.0)
    state = cb.state_dict()
    assert state["steps"] == 300 and state["minutes"] == 10
    # the next process runs 3x slower: the count stays the one fixed before
    cb2, trainer2, module2, clock2 = _fresh(t=5_000.0)
    trainer2.global_step = 100
    cb2.load_state_dict(state)
    _run(cb2, trainer2, module2, clock2, until=10_000, step_s=6.0)
    assert trainer2.global_step == 300 and module2.max_steps == 300
    # resumed with a lower cap or another budget: the cap wins, and both are said
    cb3, trainer3, module3, clock3 = _fresh(minutes=20, cap=200)
    trainer3.global_step = 100
    cb3.load_state_dict(state)
    _run(cb3, trainer3, module3, clock3, until=10_000, step_s=2.0)
    assert trainer3.global_step == 200 and module3.max_steps == 200
    assert "under max_minutes=10" in caplog.text and "it ends at 200" in caplog.text


def test_time_before_a_kill_counts_against_the_budget():
    cb, trainer, module, clock = _fresh()
    _run(cb, trainer, module, clock, until=20, step_s=2.0)  # killed at step 20, not yet fixed
    state = cb.state_dict()
    assert cb.steps is None and state["spent_s"] == pytest.approx(40.0)
    cb2, trainer2, module2, clock2 = _fresh(t=7_000.0)
    trainer2.global_step = 20
    cb2.load_state_dict(state)
    # the new process's first 5 steps are slow and untimed; steps 25-50 are timed
    _run(cb2, trainer2, module2, clock2, until=10_000, step_s=2.0, slow_first=5)
    assert cb2.fixed_at == 50 and cb2.step_s == pytest.approx(2.0)
    # 40 s before the kill, 100 + 50 s after: 410 s left at 2 s a step
    assert cb2.steps == 255 and trainer2.global_step == 255


def _train_args(prepared, out, *extra: str) -> list[str]:
    """`hydra-heads train` of tiny Hydra heads, capped at 60 steps, with `extra`."""
    return [
        "train",
        "base=tiny_random",
        "head=hydra",
        f"data.prepared={prepared}",
        f"out={out}",
        "logger=none",
        "final_validation=false",
        "trainer.max_steps=60",
        "trainer.val_check_interval=1000",
        *extra,
    ]


def test_a_run_with_a_spent_budget_stops_when_its_count_is_fixed(tiny_prepared, tmp_path):
    """Through the CLI, the real clock: a budget spent by step 19 (the default warmup's last
    step) stops the run at step 20, short of trainer.max_steps; the summary, the heads and the
    checkpoint record the count, and last.ckpt holds step 20 though the periodic checkpoints
    (every 7 steps) wrote it at step 14 before."""
    out = tmp_path / "run"
    r = run_here(*_train_args(tiny_prepared, out, "checkpoint_every=7", "max_minutes=0.0001"))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 20
    budget = summary["time_budget"]
    assert budget["steps"] == 20 and budget["cap"] == 60 and budget["fixed_at_step"] == 19
    assert budget["step_s"] > 0
    meta = json.loads((out / "heads" / "heads_config.json").read_text())
    assert meta["training"]["steps"] == 20
    logs = r.stdout + r.stderr
    assert "over steps 5-19 -> 20 steps in all" in logs and "the LR never decays" in logs
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("StepsForTime")]
    assert state["steps"] == 20 and state["spent_s"] > 0
    assert ckpt["global_step"] == 20


def test_the_schedule_ends_at_the_fitted_count_and_a_resume_keeps_it(
    tiny_prepared, tmp_path, monkeypatch
):
    """Through the CLI with a clock that ticks a second each time it is read: the count lands
    between the warmup and the cap, the LR reaches optim.final_lr_ratio at it (a schedule as
    long as the cap would leave it ~5x higher), and a resume takes the count the checkpoint
    holds."""
    monkeypatch.setattr("train.time_budget._now", iter(range(1, 10_000)).__next__)
    out = tmp_path / "run"
    args = _train_args(
        tiny_prepared,
        out,
        "checkpoint_every=100",
        "max_minutes=0.08",
        "optim.lr=1e-3",
        "optim.final_lr_ratio=0.1",
    )
    r = run_here(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = json.loads((out / "train_summary.json").read_text())["steps"]
    assert 30 < steps < 60
    last = out / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == steps
    assert ckpt["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(1e-4)
    # a resume goes on to the count its checkpoint holds (here raised by hand), not the cap
    (key,) = [k for k in ckpt["callbacks"] if k.startswith("StepsForTime")]
    ckpt["callbacks"][key]["steps"] = steps + 5
    torch.save(ckpt, last)
    r = run_here(*args, "resume=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "train_summary.json").read_text())["steps"] == steps + 5
    assert f"{steps + 5} steps, as fixed at step 19" in r.stdout + r.stderr


def test_max_minutes_must_be_a_positive_number():
    from tests.helpers import train_config

    assert train_config(["data.prepared=x", "out=y", "max_minutes=55"]).max_minutes == 55
    for bad in ("0", "-1", "inf"):
        with pytest.raises(ValueError, match="max_minutes.*a number of minutes > 0"):
            train_config(["data.prepared=x", "out=y", f"max_minutes={bad}"])
