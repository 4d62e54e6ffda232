"""What a decode returns: one prompt's tokens, its per-step acceptance and where its time went,
and the acceptance figures (tau, per-depth rates) over many of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# where a decode step's time goes, in order (each a Generation field `<part>_s`)
STEP_PARTS = ("propose", "verify", "project", "bookkeeping")


@dataclass
class Generation:
    """One prompt's output and what it cost. In a batch, each row's times are its share (by
    tokens) of the batch's, so that sums over rows are the batch's wall time."""

    tokens: list[int]
    finish: str  # "eos" or "length"
    prefill_s: float = 0.0
    total_s: float = 0.0  # prefill included, compiling not
    compile_s: float = 0.0  # eval.compile: time this generation spent compiling graphs
    steps: int = 0  # base forwards after the prefill
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verify step
    propose_s: float = 0.0
    verify_s: float = 0.0  # the base's body over each step's tokens
    project_s: float = 0.0  # the base's output projection (lm_head) over the nodes accepting reads
    bookkeeping_s: float = 0.0  # acceptance, KV-cache compaction, the heads' context update

    @property
    def tau(self) -> float:
        """Tokens per verify forward, the bonus token included."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)


def share_times(gens: list[Generation], times: dict[str, float]) -> None:
    """Give each generation its share (by its tokens) of a batch's `times`."""
    total = sum(len(g.tokens) for g in gens) or 1
    for g in gens:
        w = len(g.tokens) / total
        for name, seconds in times.items():
            setattr(g, name, seconds * w)


def acceptance_figures(accepted: list[int], depth: int) -> dict[str, Any]:
    """tau, per-depth acceptance (cumulative: P(step reaches depth d); conditional: P(reaches d |
    reached d-1)) and the histogram of draft tokens accepted per step."""
    steps = len(accepted)
    hist = [sum(1 for a in accepted if a == d) for d in range(depth + 1)]
    reach = [sum(1 for a in accepted if a >= d) for d in range(depth + 1)]
    return {
        "steps": steps,
        "tau": (sum(accepted) + steps) / steps if steps else None,
        "accepted_histogram": hist,
        "acceptance_cumulative": [reach[d] / steps if steps else None for d in range(1, depth + 1)],
        "acceptance_conditional": [
            reach[d] / reach[d - 1] if reach[d - 1] else None for d in range(1, depth + 1)
        ],
    }
