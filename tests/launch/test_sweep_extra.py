"""`sweep.extra`: more train overrides for the points that hold one grid value (each
architecture's own step count at equal training time, EAGLE-3's unrolled steps), checked
against the grid, kept out of the points' names, and part of the sweep's identity."""

from __future__ import annotations

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
    assert "sweep.extra.head.eagle3" in r.stderr


def test_changed_extra_is_another_sweep_and_old_state_without_it_resumes(tmp_path):
    from launch.config import SweepConfig
    from launch.sweep_state import load_state
    from train.core.atomic import write_json
    from train.core.config import compose
    from train.core.config import load as to_typed

    out = tmp_path / "s"
    train = 'sweep.train=["base=tiny_random","trainer.max_steps=4"]'
    args = [f"out={out}", "sweep.grid={head:[medusa,eagle3]}", train]
    cfg = to_typed(compose("sweep", [*args, EXTRA]), SweepConfig)
    out.mkdir()
    write_json(out / "sweep.json", load_state(out, cfg.sweep))
    r = _dry(tmp_path, EXTRA)  # the same sweep: resumes
    assert r.returncode == 0, r.stderr[-2000:]
    r = _dry(tmp_path, '+sweep.extra={head:{eagle3:["trainer.max_steps=9"]}}')
    assert r.returncode == 2 and "belongs to a different sweep: sweep.extra changed" in r.stderr
    r = _dry(tmp_path)  # no extras at all is another sweep too
    assert r.returncode == 2 and "sweep.extra changed" in r.stderr

    # a sweep.json written before `extra` existed (no key) is the same sweep as one with no
    # extras, and as one whose extras a command-line grid has all dropped
    only_medusa = [*args, 'grid=["head=medusa"]']
    plain = to_typed(compose("sweep", only_medusa), SweepConfig)
    state = load_state(tmp_path / "fresh", plain.sweep)
    del state["spec"]["extra"]
    state["points"][0]["status"] = "done"
    (tmp_path / "old").mkdir()
    write_json(tmp_path / "old" / "sweep.json", state)
    assert load_state(tmp_path / "old", plain.sweep)["points"][0]["status"] == "done"
    gone = to_typed(compose("sweep", [*only_medusa, EXTRA]), SweepConfig).sweep
    assert gone.extra == {}
    assert load_state(tmp_path / "old", gone)["points"][0]["status"] == "done"
    held = to_typed(compose("sweep", [*args, EXTRA, 'grid=["head=eagle3"]']), SweepConfig).sweep
    assert held.extra == {"head": {"eagle3": ["head.num_heads=3", "trainer.max_steps=7"]}}


def test_extra_matches_values_as_the_grid_reads_them_and_refuses_grid_keys(tmp_path):
    from launch.config import SweepSpec
    from launch.grid import held_extras, parse_grid
    from launch.sweep_state import plan_points

    # a command-line grid reads 1e-3 as text, a sweep file as the float 0.001: one value
    grid = parse_grid("grid", ["optim.lr=1e-3,3e-3"])
    assert grid["optim.lr"] == ["1e-3", "3e-3"]
    extra = {"optim.lr": {0.001: ["head.num_layers=2"]}, "head": {"x": ["a=1"]}}
    kept, dropped = held_extras(extra, grid)
    assert kept == {"optim.lr": {0.001: ["head.num_layers=2"]}} and dropped == ["head=x"]
    spec = SweepSpec(name="t", grid=grid, eval_grid={}, train=[], eval=[], sort_by="tau",
                     extra=kept)  # fmt: skip
    over = {p["train_point"]: p["train_overrides"] for p in plan_points(spec)}
    assert over == {
        "optim.lr-1e-3": ["optim.lr=1e-3", "head.num_layers=2"],
        "optim.lr-3e-3": ["optim.lr=3e-3"],
    }
    # ints and floats, bools and None each match their own kind only
    extra = {"a": {2.0: ["b=1"], True: ["b=2"], None: ["b=3"], "1x": ["b=4"]}}
    spec = SweepSpec(name="t", grid={"a": [2, True, None, "1x"]}, eval_grid={}, train=[],
                     eval=[], sort_by="tau", extra=extra)  # fmt: skip
    assert [p["train_overrides"][1:] for p in plan_points(spec)] == [
        ["b=1"], ["b=2"], ["b=3"], ["b=4"]
    ]  # fmt: skip
    # an extra may not set a key the grid sets: the points would differ in name only
    r = _dry(tmp_path, '+sweep.extra={head:{eagle3:["head=hydra"]}}')
    assert r.returncode == 2 and "sweep.extra.head.eagle3" in r.stderr
    assert "head is a grid key" in r.stderr


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

    from evaluation.benchmarks.bench_arch_train import (
        head_overrides,
        sweep_head_extras,
        sweep_train_overrides,
    )

    shared = sweep_train_overrides("architectures_cpu")
    assert "experiment=smollm2_cpu_1h" in shared
    assert not any(o.startswith(("trainer.max_steps=", "checkpoint_every=")) for o in shared)
    assert head_overrides(["eagle3:head.num_heads=3"], ["medusa", "eagle3"]) == {
        "medusa": [],
        "eagle3": ["head.num_heads=3"],
    }
    # the sweep's own extras, minus the step counts the benchmark measures
    extras = sweep_head_extras("architectures_cpu")
    assert extras["eagle3"] == ["head.num_heads=3"] and extras["medusa"] == []
    got = head_overrides(["eagle3:head.dropout=0.1"], ["medusa", "eagle3"], extras)
    assert got == {"medusa": [], "eagle3": ["head.num_heads=3", "head.dropout=0.1"]}
    # a labelled variant starts from its architecture's extras and takes its own overrides
    got = head_overrides(["eagle3@d:head.dropout=0.1"], ["eagle3", "eagle3@d"], extras)
    assert got == {
        "eagle3": ["head.num_heads=3"],
        "eagle3@d": ["head.num_heads=3", "head.dropout=0.1"],
    }
    with pytest.raises(SystemExit, match="HEAD:key=value"):
        head_overrides(["eagle3=3"], ["eagle3"])
    with pytest.raises(SystemExit, match="not in --heads"):
        head_overrides(["hydra:head.num_layers=2"], ["eagle3"])
    with pytest.raises(SystemExit, match="choose one of"):
        sweep_train_overrides("no_such_sweep")


def test_a_point_finished_by_another_process_meanwhile_is_not_run_again(tmp_path, monkeypatch):
    # two local sweeps share the points: the second reads sweep.json, waits, and by the time
    # it takes a point another process may have finished it (its eval used to run again)
    import launch.sweep as sweep_mod
    from launch.config import SweepConfig
    from launch.sweep_state import update_point
    from train.core.config import compose
    from train.core.config import load as to_typed

    out = tmp_path / "s"
    cfg = to_typed(
        compose(
            "sweep",
            [
                f"out={out}",
                "sweep.grid={head:[medusa,hydra]}",
                "report=false",
                'train_args=["data.prepared=/p"]',
            ],  # fmt: skip
        ),
        SweepConfig,
    )
    ran = []

    def fake_run_point(cfg, out, p, describe=None, env=None):
        ran.append(p["name"])
        update_point(out, p["name"], status="done")
        if p["name"] == "head-medusa":  # meanwhile another process finishes head-hydra
            update_point(out, "head-hydra", status="done")
        return None, ""

    monkeypatch.setattr(sweep_mod, "run_point", fake_run_point)
    state = sweep_mod.run_sweep(cfg, progress=False)
    assert ran == ["head-medusa"]
    assert [p["status"] for p in state["points"]] == ["done", "done"]
