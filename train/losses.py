"""Head losses: cross-entropy on the true token + distillation from the frozen base, chunked.

total = sum_k w_k * (lm_weight * CE(head_k, x_{t+k+1}) + distill_weight * T^2 * D(p_T, q_T))

over assistant positions only, where p is the base model's own distribution at position t+k
(the one that predicts x_{t+k+1}), q head k's at position t, both at temperature T, and D the
distillation divergence, `head.loss.kind` or a weighted mix of kinds (`head.loss.mix`):

  kl          forward KL(p || q) = sum p log(p / q): the paper's and zankner/Hydra's
  reverse_kl  KL(q || p): mode-seeking, the head spends its mass where the base's is
  jsd         Jensen-Shannon: (KL(p || m) + KL(q || m)) / 2, m = (p + q) / 2
  tv          total variation: sum |p - q| / 2 = 1 - sum min(p, q)
  lk          acceptance (an extra, after the LK losses of arXiv 2602.23881): -log alpha,
              alpha = sum min(p, q), the chance that a token drawn from q is accepted against
              p; greedy verification accepts the head's top token when it is the base's
  top1        cross-entropy against the base's own top token, -log q(argmax p) (an extra:
              hard distillation; greedy verification accepts the head's token exactly when
              it is that one). Not a divergence: its least value is 0 only for a one-hot q

Logits are never held for all heads or all positions at once: `fused_heads_loss` walks over
chunks of teacher positions, computes the teacher's softmax at each position once, then every
head's loss *and* gradient against it immediately (dL/dlogits has a closed form for each kind:
for a divergence D(q) with g = dD/dq, dD/du = q * (g - sum q g) at u = logits / T), and keeps
only (N, H) and (V, H) gradients, so peak memory is a few chunk x vocab buffers instead of
K x N x vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from train.heads.config import KINDS as DISTILL_KINDS  # head.loss.kind's divergences

METRIC_NAMES = ("top1", "top5", "top1_base", "top5_base")


@dataclass
class HeadLoss:
    """One head's loss (a scalar) and its detached counts over N positions."""

    loss: torch.Tensor
    ce: torch.Tensor  # mean CE over positions whose target is in the head's vocab
    distill: torch.Tensor  # mean distillation divergence (head.loss.kind) over all positions
    counts: torch.Tensor  # (4,) correct top1 / top5 vs the true token / vs the base's argmax
    n: int


@dataclass
class HeadInput:
    """What one head brings to `fused_heads_loss`: its N scored positions.

    state: (N, H) head states; weight: (V, H) the head's output projection; bias: (V,) or None;
    rows: (N,) increasing indices into the teacher rows (the base's state at the position
    whose next token is this head's target); target: (N,) the true token as an index into V
    (-1: not in the head's vocab, no CE); weight_k: the head's weight in the total loss.
    """

    state: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    rows: torch.Tensor
    target: torch.Tensor
    weight_k: float = 1.0


def _divergence(
    kind: str, p: torch.Tensor, log_p: torch.Tensor, q: torch.Tensor, log_q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kind's per-position value (n,) and its gradient dD/dq (n, V) up to a per-row
    constant (which the softmax's Jacobian removes), for every kind but kl."""
    if kind == "reverse_kl":
        r = log_q - log_p
        return (q * r).sum(-1), r
    if kind == "jsd":
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        value = 0.5 * ((p * (log_p - log_m)).sum(-1) + (q * (log_q - log_m)).sum(-1))
        return value, 0.5 * (log_q - log_m)
    if kind == "tv":
        diff = q - p
        return 0.5 * diff.abs().sum(-1), 0.5 * diff.sign()
    if kind == "lk":
        alpha = torch.minimum(p, q).sum(-1).clamp_min(1e-12)
        # d alpha / dq: 1 where q < p, 0 where q > p, and 1/2 at a tie (float32 ties do occur
        # over a 49k vocab), the subgradient autograd takes for min
        return -alpha.log(), (p - q).sign_().add_(1.0).mul_(-0.5).div_(alpha[:, None])
    raise ValueError(f"unknown distillation kind {kind!r}: one of {', '.join(DISTILL_KINDS)}")


# The kinds `_distill` computes in closed form from q and p (no log p, no softmax Jacobian).
CLOSED_FORM = ("kl", "top1")


def _distill(
    kinds: tuple[tuple[str, float], ...],
    p: torch.Tensor,
    log_p: torch.Tensor | None,
    log_q: torch.Tensor,
    neg_ent: torch.Tensor,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weighted mix of divergences per position (n,) and, if `grad`, its gradient with
    respect to u = logits / T (n, V)."""
    q = log_q.exp()
    value = neg_ent.new_zeros(neg_ent.shape)
    du = None
    for kind, w in kinds:
        if kind == "kl":  # sum p log p - sum p log q; dD/du = q - p
            value += w * (neg_ent - (p * log_q).sum(-1))
            g = (q - p).mul_(w) if grad else None
        elif kind == "top1":  # -log q_a at a = argmax p; dD/du = q - onehot(a)
            a = p.argmax(-1, keepdim=True)
            value -= w * log_q.gather(1, a)[:, 0]
            g = q.mul(w).scatter_add_(1, a, q.new_full(a.shape, -w)) if grad else None
        else:
            v, gq = _divergence(kind, p, log_p, q, log_q)
            value += w * v
            g = None
            if grad:
                g = gq.sub_((q * gq).sum(-1, keepdim=True)).mul_(q).mul_(w)
        if g is not None:
            du = g if du is None else du.add_(g)
    return value, du


class _FusedHeadsLoss(torch.autograd.Function):
    """All heads' losses in one walk over teacher-row chunks: the teacher's logits, softmax and
    argmax at a position are computed once and shared by every head scored against it."""

    @staticmethod
    # Over 80 lines: one chunk loop computes loss and gradient together, so that no chunk's
    # logits outlive it (the memory bound); split, its state would have to be passed around.
    def forward(ctx, opts, teacher_state, teacher_weight, teacher_top1, *flat):
        # opts: (lm_weight, distill_weight, temperature, chunk, head weights, #CE and #KL
        # positions per head, distillation kinds); flat: (state, weight, bias, rows, target)
        # per head
        lm_w, kl_w, T, chunk, head_w, n_ce, n_kl, kinds, cap = opts
        pure_kl = kinds == (("kl", 1.0),)
        # log p is read only by the kinds of `_divergence`; kl and top1 have closed forms in q, p
        needs_log_p = any(kind not in CLOSED_FORM for kind, _ in kinds)
        K = len(head_w)
        heads = [flat[5 * k : 5 * k + 5] for k in range(K)]
        need = [any(ctx.needs_input_grad[4 + 5 * k : 4 + 5 * k + 3]) for k in range(K)]
        # a frozen output projection (eagle-attn's is the base's lm_head) gets no gradient
        need_w = [ctx.needs_input_grad[5 + 5 * k] for k in range(K)]
        dev = teacher_state.device
        M = teacher_state.shape[0]
        # The three (n, H) x (H, V) products per head are most of a step's arithmetic; under
        # autocast (trainer.precision=bf16-mixed) they run in bf16, softmax and sums in fp32.
        tw32 = teacher_weight.float()
        w32 = [h[1].float() for h in heads]
        b32 = [None if h[2] is None else h[2].float() for h in heads]
        grads = []
        # One output projection shared by several heads (EAGLE-3's unrolled steps) accumulates
        # into one gradient buffer, returned once (for its first head): one V x H buffer, not K.
        shared_gw: dict[int, torch.Tensor] = {}
        owns_w = [False] * K
        for k, (state, weight, bias, _, _) in enumerate(heads):
            if not need[k]:
                grads.append(None)
                continue
            gb = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
            gw = None
            if need_w[k]:
                owns_w[k] = id(weight) not in shared_gw
                gw = shared_gw.setdefault(id(weight), torch.zeros_like(w32[k]))
            grads.append([torch.zeros_like(state, dtype=torch.float32), gw, gb])
        ce_sum = torch.zeros(K, dtype=torch.float32, device=dev)
        kl_sum = torch.zeros(K, dtype=torch.float32, device=dev)
        counts = torch.zeros(K, 4, dtype=torch.long, device=dev)
        # head k's rows that fall in teacher chunk i: bounds[k][i] .. bounds[k][i + 1]
        edges = torch.arange(0, M + chunk, chunk, device=dev).clamp_max(M)
        bounds = [torch.searchsorted(h[3], edges).tolist() for h in heads]
        for i, a in enumerate(range(0, M, chunk)):
            with torch.no_grad():
                t_logits = (teacher_state[a : a + chunk].float() @ tw32.T).float()  # (c, V)
                if cap:  # the base's own final soft-cap (Gemma-2): its distribution, same argmax
                    t_logits = torch.tanh(t_logits / cap).mul_(cap)
                top = (
                    teacher_top1[a : a + chunk] if teacher_top1 is not None else t_logits.argmax(-1)
                )
                if kl_w > 0:
                    if T != 1.0:
                        t_logits /= T
                    log_p = torch.log_softmax(t_logits, -1)
                    p = log_p.exp()
                    neg_ent = (p * log_p).sum(-1)  # sum_v p log p, once per position
                    if not needs_log_p:
                        del log_p
                        log_p = None
                del t_logits
            for k, (state, _, _, rows, target) in enumerate(heads):
                lo, hi = bounds[k][i], bounds[k][i + 1]
                if lo == hi:
                    continue
                sel = rows[lo:hi] - a
                whole = hi - lo == p.shape[0] if kl_w > 0 else False
                s_c = state[lo:hi].float()
                logits = (s_c @ w32[k].T).float()  # (n, V); bf16 under autocast
                if b32[k] is not None:
                    logits += b32[k]
                tgt = target[lo:hi]
                d = None
                log_q = None
                if kl_w > 0:
                    log_q = torch.log_softmax(logits / T if T != 1.0 else logits, -1)
                    p_k = p if whole else p[sel]
                    if pure_kl:  # the default: no buffer beyond q
                        kl_sum[k] += neg_ent[sel].sum() - (p_k * log_q).sum()
                        if need[k]:
                            d = log_q.exp().sub_(p_k)
                    else:
                        lp_k = None if log_p is None else (log_p if whole else log_p[sel])
                        value, d = _distill(kinds, p_k, lp_k, log_q, neg_ent[sel], need[k])
                        kl_sum[k] += value.sum()
                        del lp_k
                    if d is not None:
                        # d/dlogits of T^2 * D(p, softmax(logits / T)) = T * dD/du
                        d.mul_(head_w[k] * kl_w * T / n_kl[k])
                    del p_k
                if lm_w > 0:
                    valid = tgt >= 0
                    safe = tgt.clamp_min(0)
                    logp = log_q if (log_q is not None and T == 1.0) else logits.log_softmax(-1)
                    nll = -logp.gather(1, safe[:, None])[:, 0]
                    ce_sum[k] += (nll * valid).sum()
                    if need[k]:
                        c = (head_w[k] * lm_w / n_ce[k]) * valid.float()
                        g = logp.exp().mul_(c[:, None])
                        g[torch.arange(len(tgt), device=dev), safe] -= c
                        d = g if d is None else d.add_(g)
                    del logp
                del log_q
                with torch.no_grad():
                    top5 = logits.topk(min(5, logits.shape[-1]), -1).indices
                    bt = top[sel]
                    counts[k, 0] += (top5[:, 0] == tgt).sum()
                    counts[k, 1] += (top5 == tgt[:, None]).any(-1).sum()
                    counts[k, 2] += (top5[:, 0] == bt).sum()
                    counts[k, 3] += (top5 == bt[:, None]).any(-1).sum()
                del logits
                if d is not None:
                    gs, gw, gb = grads[k]
                    gs[lo:hi] = d @ w32[k]
                    if gw is not None:
                        gw += d.T @ s_c
                    if gb is not None:
                        gb += d.sum(0)
                    del d
            if kl_w > 0:
                del p, neg_ent, log_p
        ce = ce_sum / torch.tensor([max(n, 1) for n in n_ce], dtype=torch.float32, device=dev)
        kl = kl_sum / torch.tensor([max(n, 1) for n in n_kl], dtype=torch.float32, device=dev)
        per_head = lm_w * ce + kl_w * T * T * kl  # (K,)
        total = (per_head * torch.tensor(head_w, dtype=torch.float32, device=dev)).sum()
        saved, layout = [], []
        for k, (state, weight, bias, _, _) in enumerate(heads):
            if grads[k] is None:
                layout.append(None)
                continue
            gs, gw, gb = grads[k]
            gw = gw if owns_w[k] else None  # a shared projection's gradient goes back once
            layout.append((len(saved), gb is not None, gw is not None))
            saved += [gs.to(state.dtype), gs.new_zeros(0) if gw is None else gw.to(weight.dtype)]
            if gb is not None:
                saved.append(gb.to(bias.dtype))
        ctx.layout = layout
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(per_head, ce, kl, counts)
        return total, per_head, ce, kl, counts

    @staticmethod
    def backward(ctx, g_total, *_):
        saved = ctx.saved_tensors
        out: list[torch.Tensor | None] = [None, None, None, None]
        for entry in ctx.layout:
            if entry is None:
                out += [None] * 5
                continue
            j, has_bias, has_w = entry
            gb = saved[j + 2] * g_total if has_bias else None
            gw = saved[j + 1] * g_total if has_w else None
            out += [saved[j] * g_total, gw, gb, None, None]
        return tuple(out)


def _kinds(kinds: dict[str, float] | None) -> tuple[tuple[str, float], ...]:
    if kinds is None:
        return (("kl", 1.0),)
    bad = [k for k in kinds if k not in DISTILL_KINDS]
    if bad or not kinds or any(w < 0 for w in kinds.values()) or sum(kinds.values()) <= 0:
        raise ValueError(
            f"distillation kinds {kinds}: a weight >= 0 (not all 0) for each of "
            f"{', '.join(DISTILL_KINDS)}"
        )
    return tuple((k, float(w)) for k, w in kinds.items() if w > 0)


def fused_heads_loss(
    heads: list[HeadInput],
    teacher_state: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_top1: torch.Tensor | None = None,
    lm_weight: float = 0.0,
    distill_weight: float = 1.0,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    kinds: dict[str, float] | None = None,
    teacher_softcap: float | None = None,
) -> tuple[torch.Tensor, list[HeadLoss]]:
    """Total loss (with grad) and each head's figures, walking teacher rows chunk by chunk.

    teacher_state: (M, H) the base's final hidden states at the M positions some head is
    scored against; teacher_weight: (V, H) projects them to the teacher logits (the head
    vocab); teacher_top1: (M,) the base's argmax as an index into V (-1 outside it), or None
    for the argmax of the teacher logits themselves. Each teacher row's logits, softmax and
    argmax are computed once per step, however many heads use that row. Peak memory is a few
    chunk x V buffers. kinds: the distillation divergence, {kind: weight} (default {"kl": 1}).
    teacher_softcap: the base's `final_logit_softcapping` (Gemma-2/3), applied to the teacher
    logits as the base applies it (cap * tanh(logits / cap)) before the temperature.
    """
    K = len(heads)
    n_kl = [int(h.state.shape[0]) for h in heads]
    n_ce = [int((h.target >= 0).sum()) if lm_weight > 0 else 0 for h in heads]
    opts = (
        float(lm_weight),
        float(distill_weight),
        float(temperature),
        int(chunk_size),
        [float(h.weight_k) for h in heads],
        n_ce,
        n_kl,
        _kinds(kinds),
        float(teacher_softcap or 0.0),
    )
    flat = []
    for h in heads:
        flat += [h.state, h.weight, h.bias, h.rows, h.target]
    total, per_head, ce, kl, counts = _FusedHeadsLoss.apply(
        opts, teacher_state, teacher_weight, teacher_top1, *flat
    )
    losses = [
        HeadLoss(loss=per_head[k], ce=ce[k], distill=kl[k], counts=counts[k], n=n_kl[k])
        for k in range(K)
    ]
    return total, losses


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
    kinds: dict[str, float] | None = None,
) -> HeadLoss:
    """One head's loss over N positions: `fused_heads_loss` with one head, one teacher row each.

    state: (N, H) head states; weight: (V, H) the head's output projection; target: (N,) the
    true token as an index into V (-1: not in the head's vocab, no CE); base_top1: (N,) the base
    model's argmax as an index into V (-1 when outside it); bias: (V,) or None, added to the
    head's logits; teacher_state: (N, H) the base's final hidden state at position t+k,
    projected by teacher_weight (V, H) to the teacher logits. `loss` carries the gradient.
    """
    if distill_weight > 0 and (teacher_state is None or teacher_weight is None):
        raise ValueError("distill_weight > 0 needs teacher_state and teacher_weight")
    n = state.shape[0]
    if teacher_state is None:  # CE only: a zero-width teacher, the argmax comes from base_top1
        teacher_state = state.new_zeros((n, 0))
        teacher_weight = weight.new_zeros((1, 0))
    rows = torch.arange(n, device=state.device)
    head = HeadInput(state, weight, bias, rows, target)
    total, (hl,) = fused_heads_loss(
        [head],
        teacher_state,
        teacher_weight,
        base_top1,
        lm_weight,
        distill_weight,
        temperature,
        chunk_size,
        kinds,
    )
    return HeadLoss(loss=total, ce=hl.ce, distill=hl.distill, counts=hl.counts, n=n)
