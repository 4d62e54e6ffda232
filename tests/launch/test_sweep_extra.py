"""`sweep.extra`: more train overrides for the points that hold one grid value (each
architecture's own step count at equal training time, EAGLE-3's unrolled steps), checked
against the grid, kept out of the points' names, and part of the sweep's identity."""

from __future__ import annotations

import json

from tests.helpers import run_here

EXTRA = '+sweep.extra={head:{eagle3:["head.num_heads=3","trainer.max_steps=7"]}}'


def _dry(tmp_path, *args: str):
    return run_here(
        "sweep", f"out={tmp_path / 's'}", "dry_run=true", "sweep.grid={head:[medusa,eagle3]}",
        'sweep.train=["base=tiny_random","trainer.max_steps=4"]', *args,
    )  # fmt: skip


def test_extra_overrides_reach_only_their_points_after_the_grid(tmp_path):
    r = _dry(tmp_path, EXTRA)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln.startswith("# ")}
    assert set(lines) == {"head-medusa", "head-eagle3"}  # names: the grid's values only
    cmds = [ln for ln in r.stdout.splitlines() if " train " in ln]
    medusa, eagle3 = (next(c for c in cmds if f"head={h}" in c) for h in ("medusa", "eagle3"))
    assert "head.num_heads" not in medusa and "trainer.max_steps=7" not in medusa
    # after the shared train list, so the point's own step count wins
    assert eagle3.index("trainer.max_steps=4") < eagle3.index("head=eagle3")
    assert eagle3.index("head=eagle3") < eagle3.index("head.num_heads=3 trainer.max_steps=7")
    # a command-line grid keeps the extras of the values it still holds, drops the others
    r = _dry(tmp_path, EXTRA, 'grid=["head=eagle3","optim.lr=1e-3,3e-3"]')
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("head.num_heads=3 trainer.max_steps=7") == 2
    r = _dry(tmp_path, EXTRA, 'grid=["head=medusa,hydra"]')
    assert r.returncode == 0 and "head.num_heads" not in r.stdout


def test_extra_refuses_what_the_grid_does_not_hold(tmp_path):
    r = _dry(tmp_path, '+sweep.extra={head:{eagle_3:["head.num_heads=3"]}}')
    assert r.returncode == 2 and "sweep.extra.head" in r.stderr and "eagle3" in r.stderr
    r = _dry(tmp_path, '+sweep.extra={optim:{x:["head.num_heads=3"]}}')
    assert r.returncode == 2 and "a key of the grid" in r.stderr
    r = _dry(tmp_path, '+sweep.extra={head:{eagle3:["head.num_heads"]}}')
    assert r.returncode == 2 and "key=value" in r.stderr
    r = _dry(tmp_path, '+sweep.extra={head:{eagle3:["out=/tmp/elsewhere"]}}')
    assert r.returncode == 2 and "no out= or resume=" in r.stderr


def test_changed_extra_is_another_sweep_and_old_state_without_it_resumes(tmp_path):
    from launch.config import SweepConfig
    from launch.sweep_state import load_state
    from train.core.atomic import write_json
    from train.core.config import compose
    from train.core.config import load as to_typed

    out = tmp_path / "s"
    args = [f"out={out}", "sweep.grid={head:[medusa,eagle3]}", EXTRA]
    cfg = to_typed(compose("sweep", args), SweepConfig)
    out.mkdir()
    state = load_state(out, cfg.sweep)
    write_json(out / "sweep.json", state)
    r = _dry(tmp_path, '+sweep.extra={head:{eagle3:["trainer.max_steps=9"]}}')
    assert r.returncode == 2 and "sweep.extra changed" in r.stderr
    # a sweep.json written before `extra` existed is the same sweep as one with no extras
    del state["spec"]["extra"]
    write_json(out / "sweep.json", state)
    r = _dry(tmp_path)
    assert r.returncode == 2 and "sweep.extra" not in r.stderr  # its train list differs
    plain = to_typed(compose("sweep", args[:2]), SweepConfig)
    state = load_state(tmp_path / "fresh", plain.sweep)
    del state["spec"]["extra"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "sweep.json").write_text(json.dumps(state))
    assert load_state(tmp_path / "old", plain.sweep)["points"] == state["points"]


def test_every_ready_sweep_plans_and_the_architecture_sweeps_cover_six_heads():
    from pathlib import Path

    from launch.config import SweepConfig
    from launch.sweep_state import plan_points
    from train.core.config import compose
    from train.core.config import load as to_typed

    names = sorted(p.stem for p in Path("conf/sweep").glob("*.yaml"))
    assert {"architectures_cpu", "architectures_gpu"} <= set(names)
    for name in names:
        cfg = to_typed(compose("sweep", [f"sweep={name}", "out=/tmp/unused"]), SweepConfig)
        points = plan_points(cfg.sweep) if cfg.sweep.search is None else []
        if name.startswith("architectures_"):
            heads = {p["train_point"]: p["train_overrides"] for p in points}
            assert len(heads) == 6 and "head-eagle3" in heads, heads
    cpu = to_typed(compose("sweep", ["sweep=architectures_cpu", "out=/x"]), SweepConfig)
    over = {p["train_point"]: p["train_overrides"] for p in plan_points(cpu.sweep)}
    assert over["head-eagle3"][-3:][0] == "head.num_heads=3"
    assert over["head-hydra_pp"] == ["head=hydra_pp"]  # the reference: the shared 1,100 steps
    assert all(any(o.startswith("trainer.max_steps=") for o in v[1:]) for k, v in over.items()
               if k != "head-hydra_pp")  # fmt: skip


def test_bench_arch_train_reads_the_sweep_and_refuses_bad_head_overrides():
    import pytest

    from evaluation.benchmarks.bench_arch_train import head_overrides, sweep_train_overrides

    shared = sweep_train_overrides("architectures_cpu")
    assert "experiment=smollm2_cpu_1h" in shared
    assert not any(o.startswith(("trainer.max_steps=", "checkpoint_every=")) for o in shared)
    assert head_overrides(["eagle3:head.num_heads=3"], ["medusa", "eagle3"]) == {
        "medusa": [],
        "eagle3": ["head.num_heads=3"],
    }
    with pytest.raises(SystemExit, match="HEAD:key=value"):
        head_overrides(["eagle3=3"], ["eagle3"])
    with pytest.raises(SystemExit, match="not in --heads"):
        head_overrides(["hydra:head.num_layers=2"], ["eagle3"])
    with pytest.raises(SystemExit, match="choose one of"):
        sweep_train_overrides("no_such_sweep")
