"""The chunked loss equals the naive one (values and gradients), and scores what it should."""

from __future__ import annotations

import pytest
import torch

from evaluation.benchmarks.naive_losses import naive_head_losses
from train.losses import HeadInput, fused_head_loss, fused_heads_loss


@pytest.mark.parametrize(("lm", "kl", "T"), [(1.0, 0.0, 1.0), (0.0, 1.0, 1.0), (0.3, 1.0, 2.0)])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_equals_naive_loss_and_gradients(lm, kl, T, chunk):
    torch.manual_seed(0)
    K, N, H, V = 3, 29, 12, 40
    states = [torch.randn(N, H, requires_grad=True) for _ in range(K)]
    weights = [torch.randn(V, H, requires_grad=True) for _ in range(K)]
    targets = [torch.randint(-1, V, (N,)) for _ in range(K)]  # -1: outside the head's vocab
    teacher = [torch.randn(N, H) for _ in range(K)]
    tw = torch.randn(V, H)
    hw = [1.0, 0.8, 0.64]
    ref = naive_head_losses(states, weights, targets, teacher, tw, lm, kl, T, hw)
    g_ref = torch.autograd.grad(ref, states + weights)
    total = sum(
        hw[k]
        * fused_head_loss(
            states[k], weights[k], targets[k], targets[k], teacher[k], tw, lm, kl, T, chunk
        ).loss
        for k in range(K)
    )
    g = torch.autograd.grad(total, states + weights)
    assert torch.allclose(total, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_counts_top1_top5():
    H, V = 4, 10
    # token v scores highest for state e_v (v < H); the rest rank by id, so every state's
    # top 5 is itself and 9, 8, 7, 6
    w = torch.eye(V, H) * 10 + 0.01 * torch.arange(V, dtype=torch.float)[:, None]
    state = torch.eye(H)  # argmax = 0, 1, 2, 3
    target = torch.tensor([0, 1, 9, -1])
    base = torch.tensor([0, 6, 2, 3])
    out = fused_head_loss(state, w, target, base, lm_weight=1.0, distill_weight=0.0)
    # top-1 vs true: positions 0, 1; top-5 vs true: 0, 1, 2 (9 in its top 5; -1 is ignored);
    # top-1 vs the base's argmax: 0, 2, 3; top-5: all four (6 in position 1's top 5)
    assert out.counts.tolist() == [2, 3, 3, 4]
    assert out.n == 4


def test_perfect_student_has_zero_kl():
    torch.manual_seed(0)
    s = torch.randn(8, 6)
    w = torch.randn(20, 6)
    out = fused_head_loss(
        s,
        w,
        torch.zeros(8, dtype=torch.long),
        torch.zeros(8, dtype=torch.long),
        teacher_state=s,
        teacher_weight=w,
        lm_weight=0.0,
        distill_weight=1.0,
    )
    assert float(out.loss) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("chunk", [5, 1000])
def test_bias_enters_logits_and_gets_its_gradient(chunk):
    """zankner/Hydra-style heads carry an lm-head bias: the chunked loss and its gradients match
    plain autograd over `s @ W.T + b`."""
    torch.manual_seed(1)
    N, H, V, T = 13, 8, 30, 2.0
    s = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True)
    tgt = torch.randint(-1, V, (N,))
    ts, tw = torch.randn(N, H), torch.randn(V, H)
    out = fused_head_loss(s, w, tgt, tgt, ts, tw, 0.4, 1.0, T, chunk, bias=b)
    logits = s @ w.T + b
    valid = tgt >= 0
    ce = torch.nn.functional.cross_entropy(logits[valid], tgt[valid])
    log_p = torch.log_softmax(ts @ tw.T / T, -1)
    log_q = torch.log_softmax(logits / T, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    ref = 0.4 * ce + T * T * kl
    assert torch.allclose(out.loss, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(torch.autograd.grad(out.loss, (s, w, b)), torch.autograd.grad(ref, (s, w, b)),
                    strict=True):  # fmt: skip
        assert torch.allclose(a, r, rtol=1e-4, atol=1e-5)
    # the bias really changed the loss: without it the same call scores differently
    no_bias = fused_head_loss(s, w, tgt, tgt, ts, tw, 0.4, 1.0, T, chunk)
    assert abs(float(no_bias.loss) - float(out.loss)) > 1e-3


@pytest.mark.parametrize(("lm", "kl", "T"), [(1.0, 0.0, 1.0), (0.0, 1.0, 1.0), (0.3, 1.0, 2.0)])
@pytest.mark.parametrize("chunk", [1, 6, 1000])
def test_shared_teacher_equals_per_head_teacher(lm, kl, T, chunk):
    """fused_heads_loss computes each teacher row once for all heads. Heads score different,
    overlapping subsets of the rows (as head k does at t = p - k); the total, each head's
    figures and every gradient equal the naive loss with each head's own teacher copy."""
    torch.manual_seed(2)
    K, M, H, V = 3, 23, 10, 35
    teacher = torch.randn(M, H)
    tw = torch.randn(V, H)
    hw = [1.0, 0.8, 0.64]
    rows = [torch.arange(M)[k:] if k % 2 == 0 else torch.arange(M)[: M - 2 * k] for k in range(K)]
    rows[2] = rows[2][::2]  # a gappy subset: chunk edges fall between a head's rows
    states = [torch.randn(len(r), H, requires_grad=True) for r in rows]
    weights = [torch.randn(V, H, requires_grad=True) for _ in range(K)]
    targets = [torch.randint(-1, V, (len(r),)) for r in rows]
    ref_total = 0.0
    for k in range(K):  # naive_head_losses needs equal N: one head at a time
        ref_total = ref_total + naive_head_losses(
            [states[k]], [weights[k]], [targets[k]], [teacher[rows[k]]], tw, lm, kl, T, [hw[k]]
        )
    g_ref = torch.autograd.grad(ref_total, states + weights)
    heads = [HeadInput(states[k], weights[k], None, rows[k], targets[k], hw[k]) for k in range(K)]
    total, per_head = fused_heads_loss(heads, teacher, tw, None, lm, kl, T, chunk)
    assert torch.allclose(total, ref_total, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(total, states + weights)
    for a, b in zip(g, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert sum(hw[k] * float(h.loss) for k, h in enumerate(per_head)) == pytest.approx(
        float(total), rel=1e-5
    )
    # the "vs base" counts use the teacher's own argmax at each head's rows
    top = (teacher @ tw.T).argmax(-1)
    for k, h in enumerate(per_head):
        pred = (states[k] @ weights[k].T).argmax(-1)
        assert int(h.counts[2]) == int((pred == top[rows[k]]).sum())
        assert h.n == len(rows[k])


@pytest.mark.parametrize("chunk", [4, 1000])
def test_one_projection_shared_by_several_heads_gets_their_summed_gradient(chunk):
    """EAGLE-3's unrolled steps share one lm head: passed once per head, its gradient is the sum
    over the heads (accumulated in one buffer and returned once), as autograd gives it."""
    torch.manual_seed(4)
    K, M, H, V = 3, 17, 8, 25
    teacher, tw = torch.randn(M, H), torch.randn(V, H)
    w = torch.randn(V, H, requires_grad=True)
    rows = [torch.arange(M)[k:] for k in range(K)]
    states = [torch.randn(len(r), H, requires_grad=True) for r in rows]
    targets = [torch.randint(-1, V, (len(r),)) for r in rows]
    hw = [1.0, 0.8, 0.64]
    ref = sum(
        naive_head_losses(
            [states[k]], [w], [targets[k]], [teacher[rows[k]]], tw, 0.0, 1.0, 1.0, [hw[k]]
        )  # fmt: skip
        for k in range(K)
    )
    g_ref = torch.autograd.grad(ref, [*states, w])
    heads = [HeadInput(states[k], w, None, rows[k], targets[k], hw[k]) for k in range(K)]
    total, _ = fused_heads_loss(heads, teacher, tw, None, 0.0, 1.0, 1.0, chunk)
    assert torch.allclose(total, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(total, [*states, w]), g_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


KINDS = [{"kl": 1.0}, {"reverse_kl": 1.0}, {"jsd": 1.0}, {"tv": 1.0}, {"lk": 1.0},
         {"top1": 1.0}, {"kl": 0.5, "lk": 0.3, "tv": 0.2}, {"kl": 0.5, "top1": 0.5}]  # fmt: skip


@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "+".join(k))
@pytest.mark.parametrize(("lm", "T", "chunk"), [(0.0, 1.0, 7), (0.3, 2.0, 1000)])
def test_every_distillation_kind_equals_its_naive_definition(kinds, lm, T, chunk):
    """Value and gradient of each divergence (and a mix) in the fused, chunked loss against
    autograd over its definition on full tensors; several heads share teacher rows."""
    torch.manual_seed(3)
    K, N, H, V = 3, 23, 10, 37
    states = [torch.randn(N, H, requires_grad=True) for _ in range(K)]
    weights = [torch.randn(V, H, requires_grad=True) for _ in range(K)]
    targets = [torch.randint(-1, V, (N,)) for _ in range(K)]
    teacher = torch.randn(N, H) * 2
    tw = torch.randn(V, H)
    hw = [1.0, 0.8, 0.64]
    ref = naive_head_losses(states, weights, targets, [teacher] * K, tw, lm, 1.0, T, hw, kinds)
    g_ref = torch.autograd.grad(ref, states + weights)
    rows = torch.arange(N)
    heads = [HeadInput(states[k], weights[k], None, rows, targets[k], hw[k]) for k in range(K)]
    total, losses = fused_heads_loss(
        heads, teacher, tw, None, lm, 1.0, T, chunk_size=chunk, kinds=kinds
    )
    g = torch.autograd.grad(total, states + weights)
    assert torch.allclose(total, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert all(float(hl.distill) > 0 for hl in losses)


@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd", "tv", "lk"])
def test_every_kind_is_zero_for_a_perfect_student(kind):
    torch.manual_seed(0)
    s, w = torch.randn(8, 6), torch.randn(20, 6)
    zeros = torch.zeros(8, dtype=torch.long)
    out = fused_head_loss(s, w, zeros, zeros, s, w, 0.0, 1.0, kinds={kind: 1.0})
    assert float(out.loss) == pytest.approx(0.0, abs=1e-5)


def test_unknown_or_empty_kinds_fail_clearly():
    s, w = torch.randn(4, 3), torch.randn(5, 3)
    t = torch.zeros(4, dtype=torch.long)
    for kinds in ({"wasserstein": 1.0}, {}, {"kl": 0.0}, {"kl": -1.0}):
        with pytest.raises(ValueError, match="distillation kinds"):
            fused_head_loss(s, w, t, t, s, w, 0.0, 1.0, kinds=kinds)


@pytest.mark.parametrize("kind", ["tv", "lk"])
def test_ties_take_the_subgradient_autograd_takes(kind):
    """tv and lk are not differentiable where p == q, which float32 hits exactly over a large
    vocab: the head's logits here are the teacher's with two tokens swapped, so every other
    token ties, and the fused gradient must be autograd's there too."""
    torch.manual_seed(4)
    N, H, V = 6, 8, 30
    teacher, tw = torch.randn(N, H), torch.randn(V, H)
    w = tw.clone()
    w[[2, 7]] = tw[[7, 2]]
    s, w = teacher.clone().requires_grad_(True), w.requires_grad_(True)
    t = torch.zeros(N, dtype=torch.long)
    ref = naive_head_losses([s], [w], [t], [teacher], tw, 0.0, 1.0, 1.0, [1.0], {kind: 1.0})
    g_ref = torch.autograd.grad(ref, [s, w])
    out = fused_head_loss(s, w, t, t, teacher, tw, 0.0, 1.0, kinds={kind: 1.0})
    g = torch.autograd.grad(out.loss, [s, w])
    assert float(ref) > 0 and torch.allclose(out.loss, ref, atol=1e-6)
    for a, b in zip(g, g_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kinds", [{"kl": 1.0}, {"lk": 1.0}], ids=lambda k: "+".join(k))
def test_teacher_softcap_is_the_base_distribution(kinds):
    """Gemma-2's final soft-cap: the fused loss distils toward cap * tanh(logits / cap), as the
    naive loss on those logits does (value and gradient), and not toward the raw logits."""
    torch.manual_seed(5)
    K, N, H, V, cap = 2, 17, 8, 31, 2.0
    states = [torch.randn(N, H, requires_grad=True) for _ in range(K)]
    weights = [torch.randn(V, H, requires_grad=True) for _ in range(K)]
    targets = [torch.randint(0, V, (N,)) for _ in range(K)]
    teacher, tw = torch.randn(N, H) * 2, torch.randn(V, H)
    capped = cap * torch.tanh(teacher @ tw.T / cap)  # (N, V): as teacher (N, V) @ eye(V)
    hw = [1.0, 0.8]
    ref = naive_head_losses(states, weights, targets, [capped] * K, torch.eye(V), 0.0, 1.0, 1.0,
                            hw, kinds)  # fmt: skip
    g_ref = torch.autograd.grad(ref, states + weights)
    rows = torch.arange(N)
    heads = [HeadInput(states[k], weights[k], None, rows, targets[k], hw[k]) for k in range(K)]
    total, _ = fused_heads_loss(heads, teacher, tw, None, 0.0, 1.0, 1.0, 7, kinds, cap)
    assert torch.allclose(total, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(total, states + weights), g_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    raw, _ = fused_heads_loss(heads, teacher, tw, None, 0.0, 1.0, 1.0, 7, kinds)
    assert not torch.allclose(raw, ref, rtol=1e-3)
