"""The reference the fused, chunked loss is checked and measured against: every head's full
logits materialised at once (tests/train/test_losses.py, bench_loss_memory.py). Never used in
training."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def divergence(kind: str, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Mean over positions of each distillation kind, written from its definition (autograd
    gives the gradient the fused loss computes in closed form)."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "kl":
        per = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    elif kind == "reverse_kl":
        per = (q * (log_q - log_p)).sum(-1)
    elif kind == "jsd":
        m = (p + q) / 2
        per = 0.5 * ((p * (p / m).log()).sum(-1) + (q * (q / m).log()).sum(-1))
    elif kind == "tv":
        per = 0.5 * (p - q).abs().sum(-1)
    elif kind == "lk":
        per = -torch.minimum(p, q).sum(-1).log()
    elif kind == "top1":
        per = F.nll_loss(log_q, p.argmax(-1), reduction="none")
    else:
        raise ValueError(kind)
    return per.mean()


def naive_head_losses(
    states: list[torch.Tensor],
    weights: list[torch.Tensor],
    targets: list[torch.Tensor],
    teacher_states: list[torch.Tensor] | None,
    teacher_weight: torch.Tensor | None,
    lm_weight: float,
    distill_weight: float,
    temperature: float,
    head_weights: list[float],
    kinds: dict[str, float] | None = None,
) -> torch.Tensor:
    """Reference: the same total loss with every head's full logits materialised at once.

    Heads must share N (the test/benchmark case); used to check `fused_head_loss` and to
    measure what chunking saves. Never used in training.
    """
    logits = torch.stack([s.float() @ w.float().T for s, w in zip(states, weights, strict=True)])
    total = logits.new_zeros(())
    T = temperature
    for k in range(len(states)):
        term = logits.new_zeros(())
        if lm_weight > 0:
            tgt = targets[k]
            valid = tgt >= 0
            ce = F.cross_entropy(logits[k][valid], tgt[valid], reduction="mean")
            term = term + lm_weight * ce
        if distill_weight > 0:
            with torch.no_grad():
                log_p = torch.log_softmax(
                    teacher_states[k].float() @ teacher_weight.float().T / T, -1
                )
            log_q = torch.log_softmax(logits[k] / T, -1)
            div = sum(
                w * divergence(kind, log_p, log_q) for kind, w in (kinds or {"kl": 1}).items()
            )
            term = term + distill_weight * T * T * div
        total = total + head_weights[k] * term
    return total
