"""The reference the fused, chunked loss is checked and measured against: every head's full
logits materialised at once (tests/train/test_losses.py, bench_loss_memory.py). Never used in
training."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
            kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum") / logits.shape[1]
            term = term + distill_weight * T * T * kl
        total = total + head_weights[k] * term
    return total
