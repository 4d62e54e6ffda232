"""`hydra-heads report` on fixture runs: figures, ordering, config diff, files, errors, and the
HTML page checked in a real headless browser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluation.report import ReportError, build_report
from tests.browser import check_page, chromium_path
from tests.helpers import report_config, run, run_here


def make_run(
    root: Path, name: str, *, tau: float, speedup: float, top1: list[float], lr: float,
    arch: str = "hydra", with_train: bool = True, extra: dict | None = None,
) -> Path:  # fmt: skip
    """A run dir shaped like `make demo`'s: <name>/train and <name>/eval."""
    d = root / name
    K = len(top1)
    if with_train:
        tr = d / "train"
        (tr / "heads").mkdir(parents=True)
        val = {"val/loss": 10.0 - tau, "val/tau_est": 1 + top1[0]}
        for k, a in enumerate(top1, 1):
            val |= {f"val/top1_h{k}": a, f"val/top5_h{k}": a + 0.2, f"val/top1_base_h{k}": a + 0.05}
        summary = {"steps": 6, "fit_s": 12.5, "world_size": 1, "validation": val}
        (tr / "train_summary.json").write_text(json.dumps(summary))
        meta = {"arch": arch, "num_heads": K, "num_layers": 1, "draft_vocab_size": None,
                "base": {"name": "tiny_random"}}  # fmt: skip
        (tr / "heads" / "heads_config.json").write_text(json.dumps(meta))
        (tr / "config.yaml").write_text(
            f"out: {tr}\nhead:\n  name: {arch}\n  num_heads: {K}\noptim:\n  lr: {lr}\nseed: 0\n"
        )
        logs = tr / "logs" / "version_0"
        logs.mkdir(parents=True)
        rows = ["epoch,step,train/loss,val/loss,val/tau,train/top1_h1,train/top1_h2,val/top1_h1"]
        rows += [f"0,{s},{20 - s},{'' if s % 3 else 15 - s},{'' if s % 3 else 1 + s / 10},"
                 f"{0.1 * s},{0.05 * s},{'' if s % 3 else 0.04 * s}"
                 for s in range(6)]  # fmt: skip
        (logs / "metrics.csv").write_text("\n".join(rows) + "\n")
    ev = d / "eval"
    ev.mkdir(parents=True)
    cum = [top1[0] * 0.9, top1[0] * top1[1] * 0.8]
    res = {
        "tau": tau, "speedup": speedup, "spec_tokens_per_s": 20 * speedup,
        "plain_tokens_per_s": 20.0, "acceptance_cumulative": cum,
        "acceptance_conditional": [cum[0], cum[1] / cum[0]], "accepted_histogram": [5, 3, 2],
        "time_per_step_ms": {"propose": 1.0, "verify": 9.0, "bookkeeping": 0.5},
        "heads": str(d / "train" / "heads"), "arch": arch, "num_heads": K,
        "base": {"name": "tiny_random"}, "lossless": True, "prompts": {"items": 2},
        "tree": {"kind": "calibrated", "num_nodes": 8, "expected_tau": tau + 0.1,
                 "auto": [{"nodes": n, "expected_tau": 1 + n * 0.1, "break_even_tau": 1 + n / 20}
                          for n in (0, 4, 8)]},
        "break_even_tau": tau / speedup,
        "hardware": {"device": "cpu", "threads": 2},
        "by_category": {"writing": {"tau": tau + 0.2, "speedup": speedup},
                        "coding": {"tau": tau - 0.2, "speedup": None}},
    }  # fmt: skip
    (ev / "eval.json").write_text(json.dumps(res | (extra or {})))
    (ev / "config.yaml").write_text(f"heads: {res['heads']}\ntree:\n  kind: calibrated\n")
    return d


@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    return [
        make_run(tmp_path, "slow", tau=1.4, speedup=1.3, top1=[0.3, 0.2], lr=1e-3),
        make_run(
            tmp_path,
            "fast",
            tau=1.9,
            speedup=1.1,
            top1=[0.5, 0.4],
            lr=3e-3,
            arch="hydra_pp",
            extra={"tau_ci95": [1.8, 2.05], "speedup_ci95": [1.02, 1.2]},
        ),
    ]


def test_report_figures_order_and_diff(two_runs, tmp_path):
    rep = build_report(report_config([str(p) for p in two_runs], str(tmp_path / "r")))
    lb = rep.data["leaderboard"]
    assert [r["name"] for r in lb] == ["fast", "slow"]  # by tau
    fast = next(r for r in rep.data["runs"] if r["name"] == "fast")
    assert fast["tau_est"] == pytest.approx(1.5) and fast["tau_gap"] == pytest.approx(0.4)
    assert fast["train"]["top1"] == [0.5, 0.4] and fast["train"]["top5"] == pytest.approx(
        [0.7, 0.6]
    )
    assert fast["train"]["curves"]["val/loss"] == [[0, 15.0], [3, 12.0]]
    # only what differs: the head and the lr (out dirs are ignored)
    assert set(rep.data["config_diff"]) == {"head.name", "optim.lr"}
    by_speed = build_report(
        report_config([str(p) for p in two_runs], str(tmp_path / "s"), sort_by="speedup")
    )
    assert [r["name"] for r in by_speed.data["leaderboard"]] == ["slow", "fast"]
    names = {f.name for f in rep.files}
    assert {"report.json", "report.md", "report.html", "acceptance_by_depth.png"} <= names
    assert {"tau_vs_tree_size.png", "loss_curves.png", "accepted_histogram.png"} <= names
    assert {"tau_by_run.png", "tau_by_category.png", "tau_curves.png", "top1_curves.png"} <= names
    # train top-1: the mean over the (at most 50) logged steps; validation's series beside it
    assert fast["train"]["train_top1"] == pytest.approx([0.25, 0.125])
    assert fast["train"]["curves"]["val/top1_h1"] == [[0, 0.0], [3, pytest.approx(0.12)]]
    assert fast["train"]["curves"]["val/tau"] == [[0, 1.0], [3, 1.3]]
    assert fast["eval"]["break_even_tau"] == pytest.approx(1.9 / 1.1)  # drawn beside its tau
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| 1 | fast | hydra_pp | 2 | 1.900 [1.800, 2.050] | 1.10x [1.02, 1.20] | 1.500 |" in md
    assert "| 2 | slow | hydra | 2 | 1.400 | 1.30x | " in md  # no interval in its eval.json
    assert "![loss_curves](loss_curves.png)" in md and "| optim.lr |" in md
    assert "| run | writing | coding |" in md and "| fast | 2.100 / 1.10 | 1.700 / – |" in md
    assert json.loads((tmp_path / "r" / "report.json").read_text())["leaderboard"] == lb


def test_eval_only_run_and_clear_errors(tmp_path):
    only_eval = make_run(tmp_path, "e", tau=1.2, speedup=0.9, top1=[0.2, 0.1], lr=1e-3,
                         with_train=False)  # fmt: skip
    rep = build_report(report_config([str(only_eval / "eval")], str(tmp_path / "r")))
    assert rep.data["runs"][0]["tau"] == 1.2 and rep.data["runs"][0]["tau_est"] is None
    assert "loss_curves" not in rep.data["plots"]
    with pytest.raises(ReportError, match="does not exist"):
        build_report(report_config([str(tmp_path / "nope")], str(tmp_path / "x")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="neither eval.json nor train_summary.json"):
        build_report(report_config([str(tmp_path / "empty")], str(tmp_path / "x")))
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"points": [{"name": "a", "status": "failed"}]}))
    with pytest.raises(ReportError, match="no finished point"):
        build_report(report_config([str(sweep)], str(tmp_path / "x")))
    bad = make_run(tmp_path, "bad", tau=1.2, speedup=0.9, top1=[0.2, 0.1], lr=1e-3)
    (bad / "eval" / "eval.json").write_text("{not json")
    with pytest.raises(ReportError, match="cannot read .*eval.json"):
        build_report(report_config([str(bad)], str(tmp_path / "x")))


def test_report_cli(two_runs, tmp_path):
    out = tmp_path / "cli"
    r = run("report", f"runs=[{two_runs[0]},{two_runs[1]}]", f"out={out}", "sort_by=speedup")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "slow" in r.stdout and (out / "report.html").is_file()
    # the same command line in this process: errors before any work (no new interpreter)
    r = run_here("report", f"runs=[{two_runs[0]}]", f"out={out}", "sort_by=vibes")
    assert r.returncode == 2 and "sort_by" in r.stderr and "speedup" in r.stderr
    r = run_here("report", f"runs=[{two_runs[0]}]", f"out={out}", "wandb=true")
    assert r.returncode == 2 and "logger=wandb" in r.stderr


@pytest.mark.skipif(
    chromium_path() is None, reason="chromium not installed (apt-get install chromium)"
)
def test_report_html_renders_in_a_browser(two_runs, tmp_path):
    rep = build_report(report_config([str(p) for p in two_runs], str(tmp_path / "r")))
    shot = tmp_path / "r" / "screenshot.png"
    page = check_page(tmp_path / "r" / "report.html", screenshot=shot)
    assert page.errors == []
    assert page.external_requests == []  # self-contained: opens offline
    assert page.images_total == len(rep.data["plots"]) == 8
    assert page.images_rendered == 8, page.broken_images
    assert page.title == "hydra-heads acceptance report"
    assert shot.stat().st_size > 20_000


def test_names_noise_nan_and_missing_training(tmp_path):
    a = make_run(tmp_path / "x", "run", tau=1.5, speedup=1.0, top1=[0.3, 0.2], lr=1e-3)
    b = make_run(tmp_path / "y", "run", tau=1.6, speedup=1.0, top1=[0.3, 0.2], lr=1e-3)
    for d in (a, b):  # every real run logs under its own out dir: not a difference worth a row
        cfg = d / "train" / "config.yaml"
        cfg.write_text(cfg.read_text() + f"logger:\n  save_dir: {d}\n")
    summary = a / "train" / "train_summary.json"
    data = json.loads(summary.read_text())
    data["validation"]["val/loss"] = float("nan")  # a diverged run
    summary.write_text(json.dumps(data))
    rep = build_report(report_config([str(a / "eval"), str(b), str(b)], str(tmp_path / "r")))
    assert [r["name"] for r in rep.data["runs"]] == ["run", "run-2", "run-3"]  # eval/ -> its run
    assert rep.data["config_diff"] == {}
    assert rep.data["runs"][0]["val_loss"] is None
    assert "NaN" not in (tmp_path / "r" / "report.json").read_text()
    # an eval whose heads moved away keeps its eval figures and says what is missing
    ev = json.loads((b / "eval" / "eval.json").read_text())
    (b / "eval" / "eval.json").write_text(json.dumps({**ev, "heads": "/gone/heads"}))
    rep = build_report(report_config([str(b / "eval")], str(tmp_path / "s")))
    assert rep.data["runs"][0]["tau"] == 1.6 and "train" not in rep.data["runs"][0]
    assert "no training run found" in (tmp_path / "s" / "report.md").read_text()


def test_an_eval_json_without_intervals_gets_them_from_its_records(tmp_path):
    """eval.json files written before the intervals existed: the report bootstraps them from
    the records (tau x steps, as those records carry no `accepted`)."""
    recs = [{"item": f"q{i}", "steps": 20, "tau": 1.5 + 0.1 * i} for i in range(6)]
    old = make_run(tmp_path, "old", tau=1.75, speedup=1.0, top1=[0.2, 0.1], lr=1e-3,
                   with_train=False, extra={"records": recs})  # fmt: skip
    rep = build_report(report_config([str(old / "eval")], str(tmp_path / "r")))
    lo, hi = rep.data["runs"][0]["eval"]["tau_ci95"]
    assert 1.5 < lo < 1.75 < hi < 2.0
    assert rep.data["runs"][0]["eval"]["speedup_ci95"] is None  # no plain times recorded
    assert "| 1 | old | hydra | 2 | 1.750 [" in (tmp_path / "r" / "report.md").read_text()


def test_runs_on_the_same_prompts_get_a_paired_comparison(tmp_path):
    """The second run's tau against the first's, paired over their shared prompts, in the
    report's json and markdown; runs of another suite are left out of it."""
    recs_a = [{"item": f"q{i}", "steps": 20, "accepted": 10 + 3 * i} for i in range(6)]
    recs_b = [dict(r, accepted=r["accepted"] + 2) for r in recs_a]
    dirs = [
        make_run(tmp_path, name, tau=tau, speedup=1.0, top1=[0.2, 0.1], lr=1e-3,
                 with_train=False, extra={"records": recs, "prompts": {"suite": suite}})
        for name, tau, recs, suite in (("a", 1.9, recs_a, "mt_bench"),
                                       ("b", 2.0, recs_b, "mt_bench"),
                                       ("c", 2.0, recs_b, "humaneval"))
    ]  # fmt: skip
    rep = build_report(report_config([str(d / "eval") for d in dirs], str(tmp_path / "r")))
    pair = rep.data["paired"]
    assert pair["reference"] == "a" and [r["name"] for r in pair["rows"]] == ["b"]
    row = pair["rows"][0]
    assert row["diff"] == pytest.approx(0.1) and row["diff_ci95"][0] == pytest.approx(0.1)
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## τ against a on the same prompts (paired)" in md
    assert "| b | 6 | " in md and "+0.100 [+0.100, +0.100]" in md
