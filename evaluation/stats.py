"""Confidence intervals for eval's figures: a cluster bootstrap over prompts.

tau is a ratio of sums over generations (tokens emitted by verify steps / verify steps), and
speedup a ratio of two such ratios (speculative tokens/s over plain tokens/s). Neither is a mean
of per-prompt values, so their intervals come from resampling, not from a normal formula.

The unit resampled is the item (an MT-Bench question, a HumanEval problem, a file line): its
turns share a conversation, so they are drawn together. Each resample draws as many items as
there are, with replacement, recomputes the ratio over the drawn items' sums, and the 95%
interval is the 2.5th to 97.5th percentile of 2,000 resamples (seeded: the same eval.json
always gives the same interval). With one item there is nothing to resample and the interval
is None, which is what MT-Bench's per-category figures get at 8 questions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0
METHOD = (
    f"cluster bootstrap over items (all turns of an item together), {RESAMPLES} resamples, "
    f"{LEVEL:.0%} percentile interval, seed {SEED}"
)


def bootstrap_ci(
    sums: np.ndarray,
    stat: Callable[[np.ndarray], np.ndarray],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> list[float] | None:
    """The `level` percentile interval of `stat` over `resamples` bootstrap draws of the rows of
    `sums` (items x k: each item's sums of k quantities). `stat` maps totals (R, k) to (R,)
    values. None with fewer than two items."""
    sums = np.asarray(sums, dtype=np.float64)
    if sums.ndim != 2:
        raise ValueError(f"sums must be items x quantities, got shape {sums.shape}")
    n = sums.shape[0]
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples)  # (R, n) draws per item
    values = stat(counts @ sums)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(values, [tail, 1.0 - tail])
    return [float(lo), float(hi)]


def _item_sums(records: Sequence[dict], fields: Callable[[dict], list[float]]) -> dict:
    """Per item (in order of first appearance), the sums of `fields` over its records."""
    sums: dict = {}
    for rec in records:
        values = [float(v) for v in fields(rec)]
        prev = sums.get(rec["item"])
        sums[rec["item"]] = (
            values if prev is None else [a + b for a, b in zip(prev, values, strict=True)]
        )
    return sums


def _by_item(records: Sequence[dict], fields: Callable[[dict], list[float]]) -> np.ndarray:
    """The rows of `_item_sums`: items x fields."""
    rows = list(_item_sums(records, fields).values())
    return np.array(rows, dtype=np.float64).reshape(len(rows), -1)


def _verified(rec: dict) -> float:
    """Tokens emitted by rec's verify steps: the accepted drafts plus one bonus per step (older
    eval.json files lack `accepted`: tau x steps, rounded)."""
    if "accepted" in rec:
        return rec["accepted"] + rec["steps"]
    return round(rec["tau"] * rec["steps"])


def _tau_fields(rec: dict) -> list[float]:
    """What tau sums per item: tokens emitted by verify steps, verify steps."""
    return [_verified(rec), rec["steps"]]


def tau_ci(records: Sequence[dict]) -> list[float] | None:
    """95% interval of tau over eval.json `records` (None under two items or no steps)."""
    if not records:
        return None
    sums = _by_item(records, _tau_fields)
    with np.errstate(divide="ignore", invalid="ignore"):
        return bootstrap_ci(sums, lambda t: t[:, 0] / t[:, 1])


def speedup_ci(records: Sequence[dict]) -> list[float] | None:
    """95% interval of speculative over plain tokens/s (None without plain decoding)."""
    if not records or any("plain_s" not in r for r in records):
        return None
    sums = _by_item(
        records, lambda r: [r["new_tokens"], r["spec_s"], r["plain_new_tokens"], r["plain_s"]]
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        return bootstrap_ci(sums, lambda t: (t[:, 0] / t[:, 1]) / (t[:, 2] / t[:, 3]))


def item_sums(records: Sequence[dict]) -> dict[str, list[float]]:
    """Per item (an MT-Bench question, ...): [tokens emitted by verify steps, verify steps],
    summed over its turns; what a paired comparison of two evals resamples."""
    return {str(item): sums for item, sums in _item_sums(records, _tau_fields).items()}


def paired_tau(ref: dict[str, list[float]], run: dict[str, list[float]]) -> dict | None:
    """τ of `run` against τ of `ref` (item_sums of two evals) on the items both decoded: the
    ratio and the difference, each with a 95% interval from one bootstrap that draws the same
    items for both. Paired, an item's own difficulty cancels out, so the interval is much
    narrower than the two runs' own intervals side by side. None under two shared items."""
    shared = [i for i in ref if i in run]
    if len(shared) < 2:
        return None
    sums = np.array([[*ref[i], *run[i]] for i in shared], dtype=np.float64)
    tot = sums.sum(axis=0)
    tau_ref, tau_run = tot[0] / tot[1], tot[2] / tot[3]

    def ratio(t: np.ndarray) -> np.ndarray:
        return (t[:, 2] / t[:, 3]) / (t[:, 0] / t[:, 1])

    def diff(t: np.ndarray) -> np.ndarray:
        return t[:, 2] / t[:, 3] - t[:, 0] / t[:, 1]

    with np.errstate(divide="ignore", invalid="ignore"):
        return {
            "items": len(shared),
            "tau_ref": float(tau_ref),
            "tau": float(tau_run),
            "ratio": float(tau_run / tau_ref),
            "ratio_ci95": bootstrap_ci(sums, ratio),
            "diff": float(tau_run - tau_ref),
            "diff_ci95": bootstrap_ci(sums, diff),
        }


def intervals(records: Sequence[dict]) -> dict[str, list[float] | None]:
    """eval.json's interval fields for `records`."""
    return {"tau_ci95": tau_ci(records), "speedup_ci95": speedup_ci(records)}


def with_ci(value: float | None, ci: list[float] | None, spec: str = ".3f", unit: str = "") -> str:
    """ "2.311 [2.204, 2.418]" (or "1.10x [1.02, 1.18]" with unit "x"): a figure and its 95%
    interval as tables print it; the value alone without an interval, "–" without a value."""
    if value is None:
        return "–"
    if not ci:
        return f"{value:{spec}}{unit}"
    return f"{value:{spec}}{unit} [{ci[0]:{spec}}, {ci[1]:{spec}}]"


__all__ = [
    "METHOD", "bootstrap_ci", "intervals", "item_sums", "paired_tau", "speedup_ci", "tau_ci",
    "with_ci",
]  # fmt: skip
