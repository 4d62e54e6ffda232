"""Acceptance-rate reports: train / eval run dirs -> report.json, report.md, report.html, plots."""

from __future__ import annotations

import base64
import csv
import html
import json
import math
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evaluation.config import ReportConfig
from evaluation.stats import intervals, item_sums, paired_tau, with_ci
from train.core.atomic import write_text
from train.core.errors import UserError
from train.decoding.generation import STEP_PARTS

TRAIN_WINDOW = 50  # logged steps averaged into a head's train top-1 (one batch is noisy)
PLOTS = {
    "tau_by_run": "τ per run: measured in decoding vs the training-time estimate",
    "acceptance_by_depth": "Acceptance by depth (cumulative: share of steps that accept depth d)",
    "tau_by_category": "τ per prompt category (MT-Bench's categories, ...)",
    "tau_vs_tree_size": "τ vs tree size: dots measured, solid lines expected from calibration; "
    "crosses and dashed lines: the break-even τ measured on the eval's machine (a tree pays "
    "where its τ is above it)",
    "loss_curves": "Training loss",
    "tau_curves": "τ over training: held-out prompts decoded by the verifier (val/tau)",
    "top1_curves": "Overfitting: each head's top-1 accuracy on its training batches (solid, "
    f"mean of the last {TRAIN_WINDOW} steps) against validation (dashed, dots), beside val/tau",
    "accepted_histogram": "Accepted draft tokens per step",
}
# Keys that differ between any two runs by construction, or say nothing of what was measured
# (overwrite: whether an earlier result was replaced): not worth a row in the config diff.
DIFF_IGNORE = ("out", "heads", "eval.out", "eval.heads", "overwrite", "eval.overwrite")


class ReportError(UserError, ValueError):
    """The report's inputs are missing or unreadable; the message names the path and the fix."""


# -- reading runs -------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"cannot read {path} ({e}); re-run the step that writes it") from e


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = json.dumps(v) if isinstance(v, list) else v
    return out


def _read_config(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        return {}
    try:
        return _flatten(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError as e:
        raise ReportError(f"{path} is not valid YAML ({e})") from e


def _read_curves(train_dir: Path) -> dict[str, list[list[float]]]:
    """train/val loss per step from the CSV logger's metrics.csv files (resumed runs append a
    version each; later versions win a step)."""
    curves: dict[str, dict[int, float]] = {
        k: {} for k in ("train/loss", "val/loss", "val/tau_est", "val/tau")
    }
    per_head = re.compile(r"(train|val)/top1_h\d+")  # train against validation, per head
    files = sorted(
        (train_dir / "logs").glob("version_*/metrics.csv"),
        key=lambda p: int(p.parent.name.split("_")[-1]) if p.parent.name[8:].isdigit() else 0,
    )
    for f in files:
        with f.open(newline="") as fh:
            for row in csv.DictReader(fh):
                try:
                    step = int(float(row.get("step") or "nan"))
                except ValueError:
                    continue
                for key, v in row.items():
                    if v not in (None, "") and (key in curves or per_head.fullmatch(key or "")):
                        curves.setdefault(key, {})[step] = float(v)
    return {k: [[s, v] for s, v in sorted(d.items())] for k, d in curves.items() if d}


def _err(values: list[float], cis: list[list[float] | None]) -> list[list[float]]:
    """matplotlib's asymmetric error bars (2, n) from 95% intervals (0 where none)."""
    lows = [v - ci[0] if ci else 0.0 for v, ci in zip(values, cis, strict=True)]
    highs = [ci[1] - v if ci else 0.0 for v, ci in zip(values, cis, strict=True)]
    return [lows, highs]


def _trailing_mean(points: list[list[float]], window: int = TRAIN_WINDOW) -> list[list[float]]:
    """(step, mean of the last `window` values up to it) for each point."""
    out, acc = [], []
    for step, v in points:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append([step, sum(acc) / len(acc)])
    return out


def _train_top1(curves: dict[str, list[list[float]]]) -> list[float]:
    """Each head's train top-1 over the last TRAIN_WINDOW logged steps."""
    out, k = [], 1
    while curves.get(f"train/top1_h{k}"):
        last = [v for _, v in curves[f"train/top1_h{k}"][-TRAIN_WINDOW:]]
        out.append(sum(last) / len(last))
        k += 1
    return out


def _per_head(val: dict, metric: str) -> list[float]:
    out, k = [], 1
    while f"val/{metric}_h{k}" in val:
        out.append(float(val[f"val/{metric}_h{k}"]))
        k += 1
    return out


def _locate(path: Path, train_hint: Path | None = None) -> tuple[Path | None, Path | None, str]:
    """(train dir, eval dir, warning) for a run dir given by the user."""
    eval_dir = next((d for d in (path, path / "eval") if (d / "eval.json").is_file()), None)
    train_dir = next(
        (d for d in (train_hint, path, path / "train")
         if d is not None and (d / "train_summary.json").is_file()),
        None,
    )  # fmt: skip
    warning = ""
    if train_dir is None and eval_dir is not None:
        heads = _read_json(eval_dir / "eval.json").get("heads")
        if heads and (Path(heads).parent / "train_summary.json").is_file():
            train_dir = Path(heads).parent
        else:
            warning = (
                f"no training run found for {eval_dir} (its heads {heads} have no "
                "train_summary.json beside them): training figures left out"
            )
    return train_dir, eval_dir, warning


def expand_runs(paths: list[str]) -> list[tuple[str, Path, Path | None]]:
    """(name, dir, train dir if known) per run; a sweep dir (with sweep.json) stands for its
    finished points."""
    runs: list[tuple[str, Path, Path | None]] = []
    for p in map(lambda s: Path(s).expanduser(), paths):
        if not p.exists():
            raise ReportError(f"run dir {p} does not exist")
        if (p / "sweep.json").is_file():
            sweep = _read_json(p / "sweep.json")
            done = [pt for pt in sweep.get("points", []) if pt.get("status") == "done"]
            if not done:
                raise ReportError(f"sweep {p} has no finished point yet; run or resume it first")
            runs += [
                (pt["name"], p / pt["dir"], p / "points" / pt["train_point"] / "train")
                if "train_point" in pt
                else (pt["name"], p / pt["dir"], None)
                for pt in done
            ]
        else:
            d = p.resolve()
            # `.../<run>/eval` or `.../<run>/train` is named after <run>
            runs.append((d.parent.name if d.name in ("eval", "train") else d.name, p, None))
    return runs


def _finite(x: Any) -> float | None:
    """A figure fit for a table: non-finite values (a diverged run's NaN loss) become None."""
    if isinstance(x, int | float) and not isinstance(x, bool):
        return float(x) if math.isfinite(x) else None
    return None


def load_run(name: str, path: Path, train_hint: Path | None = None) -> dict[str, Any]:
    """Every figure of one run, from its train and/or eval outputs."""
    train_dir, eval_dir, warning = _locate(path, train_hint)
    if train_dir is None and eval_dir is None:
        raise ReportError(
            f"{path} holds neither eval.json nor train_summary.json (nor eval/ or train/ with "
            "them): pass a `hydra-heads train` out dir, an eval out dir, or a sweep dir"
        )
    run: dict[str, Any] = {"name": name, "dir": str(path), "warnings": [warning] if warning else []}
    config: dict[str, Any] = {}
    if train_dir is not None:
        summary = _read_json(train_dir / "train_summary.json")
        val = summary.get("validation") or {}
        heads_cfg = train_dir / "heads" / "heads_config.json"
        meta = _read_json(heads_cfg) if heads_cfg.is_file() else {}
        run["train"] = {
            "dir": str(train_dir),
            **{k: summary.get(k) for k in ("steps", "fit_s", "trainable_params")},
            "world_size": summary.get("world_size", 1),
            "strategy": summary.get("strategy"),
            "val_loss": _finite(val.get("val/loss")),
            "tau_est": _finite(val.get("val/tau_est")),
            **{m: _per_head(val, m) for m in ("top1", "top5", "top1_base", "top5_base")},
            "curves": (curves := _read_curves(train_dir)),
            "train_top1": _train_top1(curves),
            "wandb_run": summary.get("wandb_run"),
        }
        if meta:
            keys = ("arch", "num_heads", "num_layers", "draft_vocab_size")
            run.update({k: meta.get(k) for k in keys}, base=(meta.get("base") or {}).get("name"))
        config.update(_read_config(train_dir / "config.yaml"))
    if eval_dir is not None:
        ev = _read_json(eval_dir / "eval.json")
        tree = ev.get("tree") or {}
        run.setdefault("arch", ev.get("arch"))
        run.setdefault("num_heads", ev.get("num_heads"))
        run.setdefault("base", (ev.get("base") or {}).get("name"))
        run["eval"] = {
            "dir": str(eval_dir),
            **{k: _finite(ev.get(k)) for k in ("tau", "speedup", "break_even_tau")},
            # 95% intervals; an eval.json from before they existed gets them from its records
            **(intervals(ev.get("records") or []) if "tau_ci95" not in ev else {}),
            **{k: ev[k] for k in ("tau_ci95", "speedup_ci95") if k in ev},
            **{k: ev.get(k) for k in ("spec_tokens_per_s", "plain_tokens_per_s")},
            "acceptance_cumulative": ev.get("acceptance_cumulative") or [],
            "acceptance_conditional": ev.get("acceptance_conditional") or [],
            "accepted_histogram": ev.get("accepted_histogram") or [],
            "time_per_step_ms": ev.get("time_per_step_ms") or {},
            "tree_kind": tree.get("kind"),
            "tree_nodes": tree.get("num_nodes"),
            "expected_tau": tree.get("expected_tau"),
            "auto": tree.get("auto") or [],
            "lossless": ev.get("lossless"),
            "prompts": (ev.get("prompts") or {}).get("items"),
            "suite": (ev.get("prompts") or {}).get("suite"),
            "by_category": ev.get("by_category") or {},
            "new_tokens": ev.get("new_tokens"),
            "item_sums": item_sums(ev.get("records") or []),  # for paired comparisons
            **{k: ev.get(k) or {} for k in ("sampling", "hardware")},
            **{k: ev.get(k) for k in ("setup_s", "spec_s", "plain_s")},
        }
        config.update({f"eval.{k}": v for k, v in _read_config(eval_dir / "config.yaml").items()})
    tau = run.get("eval", {}).get("tau")
    est = run.get("train", {}).get("tau_est")
    run["tau"], run["tau_est"] = tau, est
    run["speedup"] = run.get("eval", {}).get("speedup")
    run["val_loss"] = run.get("train", {}).get("val_loss")
    run["tau_gap"] = None if tau is None or est is None else tau - est
    run["config"] = config
    return run


def config_diff(runs: list[dict]) -> dict[str, list[Any]]:
    """Config keys whose values differ between runs: key -> one value per run."""
    keys = sorted({k for r in runs for k in r["config"]})
    diff = {}
    for k in keys:
        if k in DIFF_IGNORE or k.endswith((".out", ".dir", "save_dir")) or k.startswith("hydra."):
            continue
        if sum(k in r["config"] for r in runs) < 2:  # e.g. train keys of eval-only runs
            continue
        vals = [r["config"].get(k) for r in runs]
        if len({json.dumps(v, default=str) for v in vals}) > 1:
            diff[k] = vals
    return diff


def paired(runs: list[dict]) -> dict[str, Any] | None:
    """Every other run's τ against the first run's, paired over the prompts both decoded (the
    same suite): what tells a real gain from the spread of the prompts. None when the first
    run has no eval records or no other run shares its prompts."""
    ref = runs[0].get("eval", {}) if runs else {}
    if not ref.get("item_sums"):
        return None
    rows = []
    for r in runs[1:]:
        ev = r.get("eval", {})
        if not ev.get("item_sums") or ev.get("suite") != ref.get("suite"):
            continue
        cmp = paired_tau(ref["item_sums"], ev["item_sums"])
        if cmp is not None:
            rows.append({"name": r["name"], **cmp})
    return {"reference": runs[0]["name"], "rows": rows} if rows else None


def _sort_key(sort_by: str):
    def key(r: dict):
        v = r.get(sort_by)
        if sort_by == "name":
            return (0, r["name"])
        if v is None:
            return (1, 0.0)
        return (0, v if sort_by == "val_loss" else -v)  # lower loss is better

    return key


def leaderboard(runs: list[dict], sort_by: str) -> list[dict]:
    return [
        {
            "rank": rank,
            "name": r["name"],
            "arch": r.get("arch"),
            "heads": r.get("num_heads"),
            **{k: r.get(k) for k in ("tau", "speedup", "tau_est", "tau_gap")},
            **{k: r.get("eval", {}).get(k) for k in ("tau_ci95", "speedup_ci95")},
            "tree_nodes": r.get("eval", {}).get("tree_nodes"),
            "top1_h1": (r.get("train", {}).get("top1") or [None])[0],
            "val_loss": r.get("val_loss"),
            "steps": r.get("train", {}).get("steps"),
            "lossless": r.get("eval", {}).get("lossless"),
        }
        for rank, r in enumerate(sorted(runs, key=_sort_key(sort_by)), 1)
    ]


# -- plots ----------------------------------------------------------------------------------
# Over 80 lines: one figure after another, each a few lines on the shared style; apart they
# would repeat it.
def _plot_all(runs: list[dict], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: dict[str, str] = {}

    def save(fig, ax, name: str, grid: str = "both", **legend: Any) -> None:
        ax.grid(alpha=0.3, axis=grid)
        ax.legend(fontsize=8, **legend)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        made[name] = f"{name}.png"

    evals = [r for r in runs if r.get("eval", {}).get("acceptance_cumulative")]
    if evals:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for r in evals:
            cum, cond = r["eval"]["acceptance_cumulative"], r["eval"]["acceptance_conditional"]
            d = list(range(1, len(cum) + 1))
            axes[0].plot(d, cum, marker="o", label=r["name"])
            axes[1].plot(d, [math.nan if c is None else c for c in cond], marker="o")
        axes[0].set(title="cumulative", xlabel="depth", ylabel="accepted share", ylim=(0, 1))
        axes[1].set(title="conditional on the depth before", xlabel="depth", ylim=(0, 1))
        axes[1].grid(alpha=0.3)
        for ax in axes:
            ax.xaxis.get_major_locator().set_params(integer=True)
        save(fig, axes[0], "acceptance_by_depth")
    taus = [r for r in runs if r.get("tau") is not None or r.get("tau_est") is not None]
    if taus:
        fig, ax = plt.subplots(figsize=(6.5, 0.9 + 0.45 * len(taus)))
        y = list(range(len(taus)))
        meas = [r.get("tau") or 0.0 for r in taus]
        est = [r.get("tau_est") or 0.0 for r in taus]
        ax.barh([i + 0.2 for i in y], meas, 0.4, label="measured τ (eval, 95% CI)",
                xerr=_err(meas, [r.get("eval", {}).get("tau_ci95") for r in taus]),
                capsize=3)  # fmt: skip
        ax.barh([i - 0.2 for i in y], est, 0.4, label="τ estimate (training)")
        ax.set_yticks(y, [r["name"] for r in taus])
        ax.invert_yaxis()
        ax.set(xlabel="τ (tokens per base forward)", xlim=(0, max(meas + est + [1.0]) * 1.15))
        legend = {"loc": "lower center", "bbox_to_anchor": (0.5, 1.0), "ncol": 2, "frameon": False}
        save(fig, ax, "tau_by_run", grid="x", **legend)
    sized = [r for r in runs if r.get("eval", {}).get("auto") or
             r.get("eval", {}).get("break_even_tau") is not None]  # fmt: skip
    if sized:
        # where speculation pays: a tree pays when its tau (dots, solid) clears its
        # break-even tau (crosses, dashed), the cost of its step in plain steps on this machine
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for r in sized:
            ev = r.get("eval", {})
            (line,) = ax.plot([], [])
            color, auto = line.get_color(), ev.get("auto") or []
            pts = [(a["nodes"], a["expected_tau"]) for a in auto]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=color, alpha=0.6, marker=".")
            even = [(a["nodes"], a["break_even_tau"]) for a in auto if "break_even_tau" in a]
            if even:
                ax.plot(*zip(*even, strict=True), color=color, alpha=0.6, ls="--", marker="x")
            nodes = ev.get("tree_nodes") or 0
            if ev.get("tau") is not None:
                ax.scatter(
                    [nodes], [ev["tau"]], color=color, s=60,
                    zorder=3, label=f"{r['name']} (τ {ev['tau']:.2f})",
                )  # fmt: skip
            if ev.get("break_even_tau") is not None:
                ax.scatter([nodes], [ev["break_even_tau"]], color=color, marker="x", s=60,
                           zorder=3)  # fmt: skip
        ax.set(xlabel="tree nodes", ylabel="τ (tokens per base forward)")
        save(fig, ax, "tau_vs_tree_size")
    cats = _categories(runs)
    if cats:
        fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(cats)), 3.8))
        with_cats = [r for r in runs if r.get("eval", {}).get("by_category")]
        width = 0.8 / len(with_cats)
        for i, r in enumerate(with_cats):
            by = r["eval"]["by_category"]
            taus = [(by.get(c) or {}).get("tau") or math.nan for c in cats]
            cis = [(by.get(c) or {}).get("tau_ci95") for c in cats]
            ax.bar([j + i * width for j in range(len(cats))], taus, width, label=r["name"],
                   yerr=_err(taus, cis), capsize=3)  # fmt: skip
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30)
        ax.set(ylabel="τ (tokens per base forward)")
        save(fig, ax, "tau_by_category", grid="y")
    curved = [r for r in runs if (r.get("train", {}).get("curves") or {}).get("train/loss")]
    if curved:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for r in curved:
            c = r["train"]["curves"]
            (line,) = ax.plot(
                *zip(*_trailing_mean(c["train/loss"]), strict=True), label=f"{r['name']} train"
            )
            if c.get("val/loss"):
                ax.plot(
                    *zip(*c["val/loss"], strict=True), color=line.get_color(), ls="--",
                    marker="o", label=f"{r['name']} val",
                )  # fmt: skip
        ax.set(
            xlabel="optimizer step",
            ylabel=f"loss (sum over heads; train: mean of {TRAIN_WINDOW} steps)",
        )
        # a placed legend: "best" searches every point of thousands of steps (slow, warns)
        save(fig, ax, "loss_curves", loc="upper right")
    tau_curved = [r for r in runs if (r.get("train", {}).get("curves") or {}).get("val/tau")]
    if tau_curved:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for r in tau_curved:
            c = r["train"]["curves"]
            (line,) = ax.plot(*zip(*c["val/tau"], strict=True), marker="o", label=r["name"])
            if c.get("val/tau_est"):
                ax.plot(
                    *zip(*c["val/tau_est"], strict=True), color=line.get_color(), ls=":",
                    label=f"{r['name']} estimate",
                )  # fmt: skip
        ax.set(xlabel="optimizer step", ylabel="τ (val/tau: decoded; dotted: estimate)")
        save(fig, ax, "tau_curves")
    top1 = [r for r in runs if (r.get("train", {}).get("curves") or {}).get("train/top1_h1")]
    if top1:
        fig, (ax, ax_tau) = plt.subplots(1, 2, figsize=(11, 3.8))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for r in top1:
            c, tag = r["train"]["curves"], f"{r['name']} " if len(top1) > 1 else ""
            k = 1
            while c.get(f"train/top1_h{k}"):
                color = colors[(k - 1) % len(colors)]
                ax.plot(*zip(*_trailing_mean(c[f"train/top1_h{k}"]), strict=True), color=color,
                        label=f"{tag}h{k} train")  # fmt: skip
                if c.get(f"val/top1_h{k}"):
                    ax.plot(*zip(*c[f"val/top1_h{k}"], strict=True), color=color, ls="--",
                            marker="o", label=f"{tag}h{k} val")  # fmt: skip
                k += 1
            if c.get("val/tau"):
                ax_tau.plot(*zip(*c["val/tau"], strict=True), marker="o", label=r["name"])
        ax.set(xlabel="optimizer step", ylabel="top-1 accuracy vs the data")
        ax_tau.set(xlabel="optimizer step", ylabel="val/tau")
        ax_tau.grid(alpha=0.3)
        if ax_tau.lines:
            ax_tau.legend(fontsize=8)
        save(fig, ax, "top1_curves", ncol=2, loc="lower right")
    hists = [r for r in runs if r.get("eval", {}).get("accepted_histogram")]
    if hists:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        width = 0.8 / len(hists)
        for i, r in enumerate(hists):
            h = r["eval"]["accepted_histogram"]
            total = sum(h) or 1
            ax.bar(
                [j + i * width for j in range(len(h))], [c / total for c in h], width,
                label=r["name"],
            )  # fmt: skip
        n = max(len(r["eval"]["accepted_histogram"]) for r in hists)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(n)], [str(j) for j in range(n)])
        ax.set(xlabel="draft tokens accepted in a step", ylabel="share of steps")
        save(fig, ax, "accepted_histogram", grid="y")
    return made


def _categories(runs: list[dict]) -> list[str]:
    """The prompt categories of the runs' evals (eval.json `by_category`), in first-seen order;
    empty when no run has more than one category."""
    cats = list(dict.fromkeys(c for r in runs for c in r.get("eval", {}).get("by_category", {})))
    return cats if len(cats) > 1 else []


# -- rendering --------------------------------------------------------------------------------
def fmt(v: Any, nd: int = 3) -> str:
    """A value as the report's tables show it: "–" for none, floats to `nd` places."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _cfg_value(v: Any) -> str:
    if v is None:
        return "–"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _slashed(series: list[list], i: int) -> str:
    """Entry i of each series, as "a / b / c" ("–" where a series is shorter)."""
    return " / ".join(fmt(x[i] if i < len(x) else None) for x in series)


def _timing_table(runs: list[dict]) -> tuple[str, list[str], list[list[str]]]:
    """The "Hardware and timing" table: tokens/s, the step's split, training time, hardware."""
    rows = []
    for r in runs:
        ev = r.get("eval", {})
        ms = ev.get("time_per_step_ms") or {}
        hw = ev.get("hardware") or {}
        rows.append(
            [
                r["name"],
                fmt(ev.get("spec_tokens_per_s"), 1),
                fmt(ev.get("plain_tokens_per_s"), 1),
                " / ".join(fmt(ms.get(k), 1) for k in STEP_PARTS),
                fmt(r.get("train", {}).get("fit_s"), 0),
                fmt(r.get("train", {}).get("world_size")),
                ", ".join(f"{k}={v}" for k, v in hw.items()) or "–",
            ]
        )
    header = ["run", "spec tok/s", "plain tok/s", "propose / verify / project / bookkeep ms",
              "train s", "train ranks", "eval hardware"]  # fmt: skip
    return "Hardware and timing", header, rows


def _tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table, shared by the markdown and the HTML."""
    runs = report["runs"]
    header = ["#", "run", "arch", "K", "τ [95% CI]", "speedup [95% CI]", "τ est. (train)",
              "gap", "tree", "top-1 h1", "val loss", "steps", "lossless"]  # fmt: skip
    rows = [
        [
            str(r["rank"]),
            r["name"],
            *(fmt(r[k]) for k in ("arch", "heads")),
            with_ci(r["tau"], r["tau_ci95"]),
            with_ci(r["speedup"], r["speedup_ci95"], ".2f", "x"),
            *(fmt(r[k]) for k in ("tau_est", "tau_gap", "tree_nodes", "top1_h1")),
            fmt(r["val_loss"], 2),
            *(fmt(r[k]) for k in ("steps", "lossless")),
        ]
        for r in report["leaderboard"]
    ]
    out = [(f"Leaderboard (sorted by {report['sort_by']})", header, rows)]
    # Per-depth and per-head figures: column i holds entry i of each series, "a / b / c".
    for title, label, part, keys in (
        ("Acceptance by depth (cumulative / conditional)", "depth", "eval",
         ("acceptance_cumulative", "acceptance_conditional")),
        ("Per-head accuracy (validation top-1 / top-5 vs data; top-1 vs base; train top-1, "
         f"last {TRAIN_WINDOW} steps)", "head", "train",
         ("top1", "top5", "top1_base", "train_top1")),
    ):  # fmt: skip
        n = max((len(r.get(part, {}).get(keys[0], [])) for r in runs), default=0)
        if n:
            rows = []
            for r in runs:
                cols = [r.get(part, {}).get(k, []) for k in keys]
                rows.append([r["name"]] + [_slashed(cols, i) for i in range(n)])
            out.append((title, ["run"] + [f"{label} {i + 1}" for i in range(n)], rows))
    cats = _categories(runs)
    if cats:  # τ / speedup per prompt category (MT-Bench's 8, ...)
        rows = []
        for r in runs:
            by = r.get("eval", {}).get("by_category") or {}

            def cell(f: dict) -> str:
                return f"{with_ci(f.get('tau'), f.get('tau_ci95'))} / {fmt(f.get('speedup'), 2)}"

            rows.append([r["name"]] + [cell(by[c]) if c in by else "–" for c in cats])
        out.append(("τ [95% CI] / speedup by prompt category", ["run", *cats], rows))
    pair = report.get("paired")
    if pair:  # τ against the first run, paired over the prompts both decoded
        rows = [
            [
                p["name"],
                str(p["items"]),
                f"{p['tau_ref']:.3f} -> {p['tau']:.3f}",
                with_ci(p["ratio"], p["ratio_ci95"], ".3f", "x"),
                with_ci(p["diff"], p["diff_ci95"], "+.3f"),
            ]
            for p in pair["rows"]
        ]
        header = ["run", "shared items", "τ", "τ ratio [95% CI]", "τ difference [95% CI]"]
        out.append((f"τ against {pair['reference']} on the same prompts (paired)", header, rows))
    out.append(_timing_table(runs))
    diff = report["config_diff"]
    if diff and len(runs) > 1:
        rows = [[k] + [_cfg_value(v) for v in vals] for k, vals in diff.items()]
        out.append(("Config differences between runs", ["key"] + [r["name"] for r in runs], rows))
    return out


GAP_NOTE = (
    "τ est. (train) is 1 + Σ_k Π_{j≤k} top-1(head j vs base) on validation data: a chain of "
    "top-1 guesses with teacher-forced inputs. Measured τ comes from real tree decoding, where "
    "a tree adds alternatives (τ above the estimate) and heads see their own accepted tokens."
)


PAIRED_NOTE = (
    "Paired: one cluster bootstrap over the prompts both runs decoded draws the same prompts "
    "for both, so a prompt's own difficulty cancels out. An interval that excludes 1.000x "
    "(difference: 0) is a gain or a loss beyond the spread of the prompts, even where the two "
    "runs' own τ intervals overlap."
)


def _markdown(report: dict) -> str:
    lines = [f"# {report['title']}", "", f"{len(report['runs'])} run(s); {report['created']}.", ""]
    for title, header, rows in _tables(report):
        cell = lambda c: c.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines += [f"## {title}", "", "| " + " | ".join(map(cell, header)) + " |"]
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
        lines.append("")
        if title.startswith("Leaderboard"):
            lines += [GAP_NOTE, ""]
        if title.startswith("τ against"):
            lines += [PAIRED_NOTE, ""]
    notes = [w for r in report["runs"] for w in r.get("warnings", [])]
    if notes:
        lines += ["## Notes", "", *(f"- {w}" for w in notes), ""]
    if report["plots"]:
        lines += ["## Plots", ""]
        for name, file in report["plots"].items():
            lines += [f"### {PLOTS[name]}", "", f"![{name}]({file})", ""]
    return "\n".join(lines)


CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em;font-variant-numeric:tabular-nums}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child,td.t{text-align:left}img.plot{max-width:100%;border:1px solid #eee}
.note{color:#555;max-width:80ch}"""


_NUMERIC = re.compile(r"^[-–+]?[\d.,/ x%]*$")


def _td(cell: str) -> str:
    """Numbers right-aligned (columns of figures line up), text left-aligned."""
    cls = "" if _NUMERIC.match(cell) else " class='t'"
    return f"<td{cls}>{html.escape(cell)}</td>"


def _html(report: dict, out: Path) -> str:
    e = html.escape
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{e(report['title'])}</title><style>{CSS}</style></head><body>",
        f"<h1>{e(report['title'])}</h1><p>{len(report['runs'])} run(s); {e(report['created'])}.",
        "</p>",
    ]
    for title, header, rows in _tables(report):
        parts.append(f"<h2>{e(title)}</h2><table><tr>")
        parts += [f"<th>{e(h)}</th>" for h in header]
        parts.append("</tr>")
        parts += ["<tr>" + "".join(_td(c) for c in row) + "</tr>" for row in rows]
        parts.append("</table>")
        if title.startswith("Leaderboard"):
            parts.append(f"<p class='note'>{e(GAP_NOTE)}</p>")
        if title.startswith("τ against"):
            parts.append(f"<p class='note'>{e(PAIRED_NOTE)}</p>")
    notes = [w for r in report["runs"] for w in r.get("warnings", [])]
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(w)}</li>" for w in notes) + "</ul>")
    for name, file in report["plots"].items():
        data = base64.b64encode((out / file).read_bytes()).decode()
        parts.append(
            f"<h2>{e(PLOTS[name])}</h2><img class='plot' alt='{e(name)}' "
            f"src='data:image/png;base64,{data}'>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


@dataclass
class Report:
    """A written report: its figures and the files it produced."""

    data: dict[str, Any]
    files: list[Path] = field(default_factory=list)


def build_report(cfg: ReportConfig) -> Report:
    """Read every run, write report.{json,md,html} and the plots under cfg.out."""
    found = expand_runs(cfg.runs)
    if cfg.names is not None:
        if len(found) != len(cfg.names):
            raise ReportError(f"{len(cfg.names)} names for {len(found)} runs (sweeps expand)")
        found = [(n, p, t) for n, (_, p, t) in zip(cfg.names, found, strict=True)]
    taken: set[str] = set()
    runs = []
    for name, path, train_hint in found:
        unique, i = name, 1
        while unique in taken:
            i += 1
            unique = f"{name}-{i}"
        taken.add(unique)
        runs.append(load_run(unique, path, train_hint))
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    plots = _plot_all(runs, out) if cfg.plots else {}
    data = {
        "title": cfg.title,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "sort_by": cfg.sort_by,
        "leaderboard": leaderboard(runs, cfg.sort_by),
        "config_diff": config_diff(runs),
        "paired": paired(runs),
        "runs": runs,
        "plots": plots,
    }
    files = []
    for name, text in (
        ("report.json", json.dumps(data, indent=2, default=str) + "\n"),
        ("report.md", _markdown(data) + "\n"),
        ("report.html", _html(data, out) + "\n"),
    ):
        write_text(out / name, text)  # a killed report never leaves a half-written file
        files.append(out / name)
    files += [out / f for f in plots.values()]
    return Report(data, files)
