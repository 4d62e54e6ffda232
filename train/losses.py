"""Head losses: cross-entropy on the true token + KL distillation from the frozen base, chunked.

total = sum_k w_k * (lm_weight * CE(head_k, x_{t+k+1}) + distill_weight * T^2 * KL(p_T || q_T))

over assistant positions only, where p is the base model's own distribution at position t+k
(the one that predicts x_{t+k+1}) and q head k's at position t. Logits are never held for all
heads or all positions at once: `fused_head_loss` walks over position chunks, computes each
chunk's loss *and* its gradient immediately (dL/dlogits has a closed form), and keeps only
(N, H) and (V, H) gradients, so peak memory is one chunk x vocab instead of K x N x vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

METRIC_NAMES = ("top1", "top5", "top1_base", "top5_base")


@dataclass
class HeadLoss:
    """One head's loss (a scalar with grad) and its detached counts over N positions."""

    loss: torch.Tensor
    ce: torch.Tensor  # mean CE over positions whose target is in the head's vocab
    kl: torch.Tensor  # mean KL_T over all positions
    counts: torch.Tensor  # (4,) correct top1 / top5 vs the true token / vs the base's argmax
    n: int


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, weight, bias, teacher_state, teacher_weight, target, base_top1, opts):
        # opts: (lm_weight, distill_weight, temperature, chunk size, #CE positions, #KL positions)
        lm_w, kl_w, temperature, chunk, n_ce, n_kl = opts
        N = state.shape[0]
        need_grad = any(ctx.needs_input_grad[:3])
        grad_state = torch.zeros_like(state, dtype=torch.float32) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        has_bias = bias is not None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_grad and has_bias else None
        w32 = weight.float()
        b32 = bias.float() if has_bias else None
        tw32 = teacher_weight.float() if teacher_weight is not None else None
        ce_sum = state.new_zeros((), dtype=torch.float32)
        kl_sum = state.new_zeros((), dtype=torch.float32)
        counts = torch.zeros(4, dtype=torch.long, device=state.device)
        T = temperature
        for a in range(0, N, chunk):
            s_c = state[a : a + chunk].float()
            logits = s_c @ w32.T  # (c, V)
            if has_bias:
                logits += b32
            dlogits = torch.zeros_like(logits) if need_grad else None
            tgt = target[a : a + chunk]
            if lm_w > 0:
                valid = tgt >= 0
                logp = torch.log_softmax(logits, -1)
                safe = tgt.clamp_min(0)
                nll = -logp.gather(1, safe[:, None])[:, 0]
                ce_sum += (nll * valid).sum()
                if need_grad:
                    g = logp.exp()
                    g[torch.arange(len(tgt), device=g.device), safe] -= 1.0
                    dlogits += (lm_w / n_ce) * g * valid[:, None]
                del logp
            if kl_w > 0:
                with torch.no_grad():
                    t_logits = (teacher_state[a : a + chunk].float() @ tw32.T) / T
                    log_p = torch.log_softmax(t_logits, -1)
                    del t_logits
                log_q = torch.log_softmax(logits / T, -1)
                p = log_p.exp()
                kl_sum += (p * (log_p - log_q)).sum()
                if need_grad:
                    # d/dlogits of T^2 * KL(p || softmax(logits / T)) = T * (q - p)
                    dlogits += (kl_w * T / n_kl) * (log_q.exp() - p)
                del log_p, log_q, p
            with torch.no_grad():
                top5 = logits.topk(min(5, logits.shape[-1]), -1).indices
                counts[0] += (top5[:, 0] == tgt).sum()
                counts[1] += (top5 == tgt[:, None]).any(-1).sum()
                bt = base_top1[a : a + chunk]
                counts[2] += (top5[:, 0] == bt).sum()
                counts[3] += (top5 == bt[:, None]).any(-1).sum()
            if need_grad:
                grad_state[a : a + chunk] = dlogits @ w32
                grad_weight += dlogits.T @ s_c
                if has_bias:
                    grad_bias += dlogits.sum(0)
            del logits, dlogits
        ce_mean = ce_sum / max(n_ce, 1)
        kl_mean = kl_sum / max(n_kl, 1)
        loss = lm_w * ce_mean + kl_w * T * T * kl_mean
        ctx.has_bias = has_bias
        if need_grad:
            saved = [grad_state.to(state.dtype), grad_weight.to(weight.dtype)]
            if has_bias:
                saved.append(grad_bias.to(bias.dtype))
            ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(ce_mean, kl_mean, counts)
        return loss, ce_mean, kl_mean, counts

    @staticmethod
    def backward(ctx, g_loss, *_):
        saved = ctx.saved_tensors
        grad_bias = saved[2] * g_loss if ctx.has_bias else None
        return (saved[0] * g_loss, saved[1] * g_loss, grad_bias) + (None,) * 5


def fused_head_loss(
    state: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    base_top1: torch.Tensor,
    teacher_state: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    lm_weight: float = 0.0,
    distill_weight: float = 1.0,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: torch.Tensor | None = None,
) -> HeadLoss:
    """Loss of one head over N selected positions, computed chunk by chunk.

    state: (N, H) head states; weight: (V, H) the head's output projection; target: (N,) the
    true token as an index into V (-1: not in the head's vocab, no CE); base_top1: (N,) the base
    model's argmax as an index into V (-1 when outside it); bias: (V,) or None, added to the
    head's logits; teacher_state: (N, H) the base's
    final hidden state at position t+k, projected by teacher_weight (V, H) to the teacher logits.
    """
    if distill_weight > 0 and (teacher_state is None or teacher_weight is None):
        raise ValueError("distill_weight > 0 needs teacher_state and teacher_weight")
    n = state.shape[0]
    n_ce = int((target >= 0).sum()) if lm_weight > 0 else 0
    opts = (float(lm_weight), float(distill_weight), float(temperature), int(chunk_size), n_ce, n)
    loss, ce, kl, counts = _FusedHeadLoss.apply(
        state, weight, bias, teacher_state, teacher_weight, target, base_top1, opts
    )
    return HeadLoss(loss=loss, ce=ce, kl=kl, counts=counts, n=n)


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
