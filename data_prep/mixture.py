"""Weighted, seeded mixtures of several chat sources: each source's quota and its selection.

The rules (also in conf/data/_shared.yaml, `sources`): source i with weight w_i gets the share
w_i / sum(w) of the conversations selected. The total is data.max_conversations when set, else
the largest total at which every source fills its share. Quotas are rounded by largest
remainder (ties to the earlier source), so they sum to the total exactly. A source with fewer
usable conversations than its quota gives all of them; the difference is its shortfall and is
never filled from the other sources, so a mixture never holds more of a source than its weight
says. Within a source the quota is drawn without replacement by a `random.Random` seeded with
(seed, source name): the same seed gives the same mixture, and adding a source changes no other
source's draw unless it changes that source's quota.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from train.core.readers import MAX_EXAMPLES, SkipLog


def quotas(available: list[int], weights: list[float], total: int | None) -> list[int]:
    """Each source's quota of a mixture of `total` (None: the largest total whose every share
    fits in `available`) conversations, in proportion to `weights`; sums to that total."""
    if len(available) != len(weights) or not weights or any(w <= 0 for w in weights):
        raise ValueError("one weight > 0 per source")
    exact_w = [Fraction(w) for w in weights]  # exact: no float drift in the rounding
    shares = [w / sum(exact_w) for w in exact_w]
    if total is None:
        total = min(math.floor(n / s) for n, s in zip(available, shares, strict=True))
    exact = [s * total for s in shares]
    out = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


def select(n: int, k: int, seed: int, name: str) -> list[int]:
    """`k` of the indices 0..n-1 (all when k >= n), drawn without replacement by a generator
    seeded with (`seed`, `name`), in ascending order (the source's own order)."""
    if k >= n:
        return list(range(n))
    return sorted(random.Random(f"{seed}:{name}").sample(range(n), k))


@dataclass
class SourceSkips(SkipLog):
    """A SkipLog that also counts, per source, the skips of mixed conversations: those logged
    as `conversation <source name>/<record id>` (tokenization, regeneration)."""

    sources: tuple[str, ...] = ()
    by_source: dict[str, Counter] = field(default_factory=dict)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        super().skip(reason, where, detail)
        prefix = "conversation "
        if where.startswith(prefix):
            name = where[len(prefix) :].split("/", 1)[0]
            if name in self.sources:
                self.by_source.setdefault(name, Counter())[reason] += 1


def merge_skips(into: SkipLog, other: SkipLog) -> None:
    """Add `other`'s counts, examples (up to the usual few per reason) and warnings to `into`."""
    into.counts.update(other.counts)
    for reason, examples in other.examples.items():
        mine = into.examples.setdefault(reason, [])
        mine.extend(examples[: max(0, MAX_EXAMPLES - len(mine))])
    into.warnings.extend(other.warnings)
