"""A sweep's resume state, <out>/sweep.json: planned, read back, updated under a file lock."""

from __future__ import annotations

import errno
import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launch.config import IDENTITY, SweepSpec
from launch.grid import grid_points, grid_value_key, override_value, unique_slugs
from train.core.atomic import write_json
from train.core.errors import ConfigError, UserError


def plan_points(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every (train point, eval point) pair with its dirs; the order they run in."""
    trains = grid_points(spec.grid) or [[]]
    evals = grid_points(spec.eval_grid) or [[]]
    return [
        {
            "name": tname if not ev else f"{tname}__{ename}",
            "train_point": tname,
            "train_overrides": [*tr, *_extra(spec, tr)],
            "eval_overrides": ev,
            "dir": f"points/{tname}/eval/{ename}",
            "status": "pending",
        }
        for tr, tname in zip(trains, unique_slugs(trains), strict=True)
        for ev, ename in zip(evals, unique_slugs(evals), strict=True)
    ]


def _extra(spec: SweepSpec, overrides: list[str]) -> list[str]:
    """`spec.extra`'s overrides for the grid values a train point holds, in the grid's order."""
    out = []
    for key, values in spec.grid.items():
        by_value = {grid_value_key(v): o for v, o in spec.extra.get(key, {}).items()}
        for v in values:
            if f"{key}={override_value(v)}" in overrides:
                out.extend(by_value.get(grid_value_key(v), []))
    return out


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`.lock: SLURM point jobs update sweep.json concurrently."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError as e:  # e.g. Lustre mounted without flock
            raise ConfigError(
                f"cannot lock {fh.name} ({e}); put the sweep's out= on a filesystem with file "
                "locks (local disk, NFS, or Lustre mounted with -o flock)"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def point_lock(path: Path) -> Iterator[bool]:
    """Yields False if another process holds the point (it is being run there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_state(out: Path) -> dict[str, Any]:
    """<out>/sweep.json as written; a file cut short (a full disk, a copy interrupted) or
    edited into something else is a UserError that says how to go on."""
    path = out / "sweep.json"
    try:
        state = json.loads(path.read_text())
    except ValueError as e:  # json.JSONDecodeError, or bytes that are not UTF-8
        state, why = None, f"not valid JSON: {e}"
    else:
        ok = isinstance(state, dict) and isinstance(state.get("points"), list)
        why = "" if ok else "no list of points"
    if why:
        raise UserError(
            f"the sweep state {path} is corrupt ({why}). Delete it and run the sweep again "
            "with the same out=: trainings that finished are reused (their "
            "points/<point>/train/train_summary.json), only their evals run again; a search "
            "keeps its trials in study.db"
        )
    return state


def _identity(spec: dict, key: str) -> Any:
    """spec[key] as far as it makes the sweep the same: a search may raise its trials."""
    value = spec.get(key)
    if key == "search" and value:
        value = {k: v for k, v in value.items() if k != "trials"}
    if key == "extra":  # sweeps from before `extra` have none; a key without values adds nothing
        value = {k: v for k, v in (value or {}).items() if v}
    return value


def load_state(out: Path, spec: SweepSpec) -> dict[str, Any]:
    """sweep.json (or a fresh plan); a resumed sweep must be the same grid."""
    path = out / "sweep.json"
    fresh = {"spec": spec.to_dict(), "points": plan_points(spec) if spec.search is None else []}
    if not path.is_file():
        return fresh
    state = read_state(out)
    old = state.get("spec") or {}
    changed = [k for k in IDENTITY if _identity(old, k) != _identity(fresh["spec"], k)]
    if changed:
        raise ConfigError(
            f"{path} belongs to a different sweep: sweep.{', sweep.'.join(changed)} changed. "
            "Resume it with the same settings, or choose another out"
        )
    state["spec"] = fresh["spec"]  # e.g. a new sort_by
    return state


def read_point(out: Path, name: str) -> dict[str, Any] | None:
    """Point `name` as sweep.json holds it now (None: no such point)."""
    return next((pt for pt in read_state(out)["points"] if pt["name"] == name), None)


def update_point(out: Path, name: str, **changes: Any) -> None:
    """Set `changes` on point `name` in sweep.json (a finished point loses its last error)."""
    with locked(out / "sweep.json"):
        state = read_state(out)
        for pt in state["points"]:
            if pt["name"] == name:
                pt.update(changes)
                if changes.get("status") == "done":
                    pt.pop("error", None)
                    pt.pop("stage", None)
        write_json(out / "sweep.json", state)


def add_point(out: Path, point: dict[str, Any]) -> None:
    """Append a search trial's point to sweep.json; a point with the same name (the same
    values drawn again) records the trial instead, and its training is reused."""
    with locked(out / "sweep.json"):
        state = read_state(out)
        known = {p["name"]: p for p in state["points"]}
        if point["name"] in known:
            known[point["name"]].setdefault("trials", []).append(point["trial"])
        else:
            state["points"].append(point)
        write_json(out / "sweep.json", state)


def record_job(out: Path, train_point: str, job_id: str) -> None:
    """Note the SLURM job that runs `train_point`, at once: a later failure forgets nothing."""
    with locked(out / "sweep.json"):
        state = read_state(out)
        state.setdefault("jobs", {})[train_point] = job_id
        write_json(out / "sweep.json", state)
