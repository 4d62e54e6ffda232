"""The bootstrap intervals of eval's tau and speedup (evaluation/stats.py)."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.stats import (
    bootstrap_ci,
    intervals,
    item_sums,
    paired_tau,
    speedup_ci,
    tau_ci,
    with_ci,
)


def _rec(item: str, steps: int, accepted: int, **kw) -> dict:
    return {"item": item, "steps": steps, "accepted": accepted,
            "tau": (accepted + steps) / steps, **kw}  # fmt: skip


def test_mean_interval_matches_the_normal_approximation():
    """For a plain mean (denominators 1) the percentile interval is ~ mean +- 1.96 s/sqrt(n)."""
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 0.5, size=400)
    sums = np.stack([x, np.ones_like(x)], axis=1)
    lo, hi = bootstrap_ci(sums, lambda t: t[:, 0] / t[:, 1])
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))
    assert lo < x.mean() < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)


def test_tau_interval_covers_the_pooled_ratio_and_narrows_with_more_items():
    rng = np.random.default_rng(2)

    def records(n):
        return [_rec(f"q{i}", 40, int(rng.integers(10, 60))) for i in range(n)]

    few, many = records(8), records(128)
    pooled = sum(r["accepted"] + r["steps"] for r in few) / sum(r["steps"] for r in few)
    lo, hi = tau_ci(few)
    assert lo <= pooled <= hi
    lo2, hi2 = tau_ci(many)
    assert hi2 - lo2 < (hi - lo) / 2


def test_turns_of_an_item_are_resampled_together():
    """Each item's two turns cancel (one fast, one slow, the same totals per item): resampling
    items leaves tau fixed, where resampling turns would spread it."""
    recs = []
    for i in range(10):
        recs += [_rec(f"q{i}", 10, 20, turn=0), _rec(f"q{i}", 10, 0, turn=1)]
    lo, hi = tau_ci(recs)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    as_turns = [dict(r, item=f"{r['item']}/{r['turn']}") for r in recs]
    lo_t, hi_t = tau_ci(as_turns)
    assert hi_t - lo_t > 0.5


def test_speedup_interval_and_when_there_is_none():
    recs = [
        _rec(f"q{i}", 10, 10, new_tokens=20, spec_s=1.0 + 0.1 * i, plain_new_tokens=20,
             plain_s=1.5 + 0.1 * i)
        for i in range(6)
    ]  # fmt: skip
    lo, hi = speedup_ci(recs)
    point = (120 / sum(r["spec_s"] for r in recs)) / (120 / sum(r["plain_s"] for r in recs))
    assert lo <= point <= hi and hi < 1.6
    assert speedup_ci([{k: v for k, v in r.items() if k != "plain_s"} for r in recs]) is None
    assert intervals(recs[:1]) == {"tau_ci95": None, "speedup_ci95": None}  # one item
    assert intervals([]) == {"tau_ci95": None, "speedup_ci95": None}


def test_intervals_are_seeded_and_old_records_use_tau_times_steps():
    recs = [_rec(f"q{i}", 30, 7 * i) for i in range(5)]
    assert tau_ci(recs) == tau_ci(recs)
    old = [{k: v for k, v in r.items() if k != "accepted"} for r in recs]
    assert tau_ci(old) == pytest.approx(tau_ci(recs))


def test_with_ci_formats_value_and_interval():
    assert with_ci(2.31104, [2.2, 2.41]) == "2.311 [2.200, 2.410]"
    assert with_ci(1.5, None) == "1.500"
    assert with_ci(1.1, [1.02, 1.18], ".2f", "x") == "1.10x [1.02, 1.18]"
    assert with_ci(None, [1.0, 2.0]) == "–"


def test_bad_shapes_fail_clearly():
    with pytest.raises(ValueError, match="items x quantities"):
        bootstrap_ci(np.ones(4), lambda t: t)


def test_paired_interval_sees_a_small_gain_that_the_two_intervals_hide():
    """Prompts differ a lot (tau 1.3 to 3.0) and run B gains 4% on every one: B's own interval
    overlaps A's, but the paired ratio's excludes 1 and holds the true 1.04x."""
    rng = np.random.default_rng(3)
    base = rng.uniform(0.3, 2.0, size=24)  # accepted per step, per prompt
    a = [_rec(f"q{i}", 100, int(round(100 * x))) for i, x in enumerate(base)]
    b = [_rec(f"q{i}", 100, int(round(100 * ((1 + x) * 1.04 - 1)))) for i, x in enumerate(base)]
    lo_a, hi_a = tau_ci(a)
    lo_b, hi_b = tau_ci(b)
    assert lo_b < hi_a  # side by side, the gain is inside the spread
    cmp = paired_tau(item_sums(a), item_sums(b))
    assert cmp["items"] == 24 and cmp["ratio"] == pytest.approx(1.04, abs=0.002)
    lo, hi = cmp["ratio_ci95"]
    assert 1.0 < lo < 1.04 < hi < 1.08
    assert cmp["diff_ci95"][0] > 0
    same = paired_tau(item_sums(a), item_sums(a))
    assert same["ratio_ci95"] == [pytest.approx(1.0), pytest.approx(1.0)]


def test_paired_uses_the_shared_items_and_needs_two():
    a = [_rec("q1", 10, 10, turn=0), _rec("q1", 10, 0, turn=1), _rec("q2", 10, 5)]
    b = [_rec("q2", 10, 10), _rec("q3", 10, 10)]
    assert item_sums(a) == {"q1": [30.0, 20.0], "q2": [15.0, 10.0]}  # turns summed per item
    assert paired_tau(item_sums(a), item_sums(b)) is None  # one shared item
    cmp = paired_tau(item_sums(a), item_sums(b + [_rec("q1", 10, 10)]))
    assert cmp["items"] == 2 and cmp["tau_ref"] == pytest.approx(45 / 30)
