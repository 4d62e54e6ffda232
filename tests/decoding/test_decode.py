"""Speculative decoding on a tiny_base random Llama: lossless greedy for any heads and tree, deep
acceptance with an oracle, KV-cache bookkeeping, and the sampling rules' distributions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import make_heads, oracle_decode, trees
from train.decoding.decoder import Decoder
from train.decoding.dynamic import DynamicTree
from train.decoding.propose import Proposal
from train.decoding.sampling import SamplingConfig, accept_greedy, accept_rejection
from train.decoding.tree import PRESETS, Tree, branching, chain

PROMPTS = ["hello there, how are you?", "count: 1 2 3 4", "<|im_start|>user\nhi<|im_end|>\n"]


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@given(
    paths=trees(max_depth=4, max_nodes=24),
    arch=st.sampled_from(
        ["medusa", "hydra", "hydra_pp", "hydra_eagle", "hydra_cross_attn", "eagle3"]
    ),
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([0.0, 0.01, 0.3]),
    draft=st.sampled_from([None, 64]),
    prompt=st.sampled_from(PROMPTS),
    eos_at=st.integers(0, 39),  # an index into the 40 reference tokens
)
@settings(
    max_examples=40,
    deadline=None,
    # replay the same examples every run: a float near-tie between the tree pass and the
    # one-token pass could flip an argmax (rare, never seen here), and CI must not flake on it
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_greedy_speculative_equals_plain_greedy(
    tiny_base, paths, arch, seed, scale, draft, prompt, eos_at
):
    model = tiny_base.model
    heads = make_heads(model, arch, seed, scale, draft)
    ids = encode(tiny_base.tokenizer, prompt)
    ref = Decoder(model, set(), heads).plain([ids], 40)[0].tokens
    eos = {ref[eos_at]}  # an EOS somewhere in the middle of the reply
    dec = Decoder(model, eos, heads, Tree.from_paths(paths))
    plain, spec = dec.plain([ids], 40)[0], dec.speculative([ids], 40)[0]
    assert spec.tokens == plain.tokens
    assert plain.tokens[-1] in eos and plain.finish == "eos" and spec.finish == "eos"
    assert spec.steps == len(spec.accepted) and (spec.tau >= 1.0 or spec.steps == 0)


def test_plain_decode_matches_transformers_generate(tiny_base):
    ids = encode(tiny_base.tokenizer, PROMPTS[0])
    ours = Decoder(tiny_base.model, set()).plain([ids], 30)[0].tokens
    out = tiny_base.model.generate(
        torch.tensor([ids]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert ours == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("true_path", [[0, 0, 0], [2, 1, 0], [1, 0, 1]])
def test_oracle_heads_accept_full_paths_and_keep_the_right_kv(tiny_base, true_path):
    model = tiny_base.model
    heads = make_heads(model, "hydra_pp", 0, 0.1)
    ref, gen = oracle_decode(model, heads, encode(tiny_base.tokenizer, PROMPTS[1]), true_path)
    assert gen.tokens == ref
    # every step but the last accepts the whole path (3 drafts) + bonus: tau 4
    assert gen.accepted[:-1] == [3] * (len(gen.accepted) - 1)
    assert gen.tau > 3.5


def test_empty_tree_is_plain_decoding(tiny_base):
    heads = make_heads(tiny_base.model, "hydra", 0, 0.0)
    ids = encode(tiny_base.tokenizer, PROMPTS[0])
    dec = Decoder(tiny_base.model, set(), heads, Tree.from_paths(PRESETS["none"]))
    gen = dec.speculative([ids], 12)[0]
    assert gen.tokens == dec.plain([ids], 12)[0].tokens and gen.tau == 1.0


@pytest.mark.parametrize("arch", ["hydra_pp", "eagle3"])
def test_a_kept_prefill_decodes_as_a_fresh_one(tiny_base, arch):
    """decode_kept (tree=auto's timing) rewinds one prefill for every decode: each decode
    from it, of any tree, plain or not, at any batch, must be the fresh decode's, step by step."""
    model = tiny_base.model
    heads = make_heads(model, arch, 3, 0.3)
    ids = encode(tiny_base.tokenizer, PROMPTS[1])
    dec = Decoder(model, set(), heads)
    shapes = [PRESETS["none"], chain(3), branching([3, 2, 2])]
    trees = [Tree.from_paths(p) for p in shapes]
    for batch in (1, 3):
        first = None
        for tree in trees:  # the first one prefills, the others rewind what it kept
            dec.set_tree(tree)
            fresh = dec.speculative([ids] * batch, 16)
            kept = dec.decode_kept(ids, 16, batch)
            assert [g.tokens for g in kept] == [g.tokens for g in fresh]
            assert [g.accepted for g in kept] == [g.accepted for g in fresh]
            first = first or dec.kept
            assert dec.kept is first and dec.kept.key[1] == batch  # one prefill, reused
    first = dec.kept
    dec.decode_kept(ids[:-1], 16, 3)  # another prompt: prefilled anew
    assert dec.kept is not first
    assert dec.decode_step_seconds(ids, 8, 2, 1) > 0
    dec.forget_kept()
    assert dec.kept is None


@pytest.mark.parametrize("arch", ["hydra_pp", "eagle3"])
def test_a_kept_prefill_survives_rows_that_finish_apart(tiny_base, arch):
    """Sampled rows end at different steps and leave by moving the later rows up, prompt
    columns included; EAGLE-3's cache differs per row there (each row's sampled root). Every
    decode must start again from the state right after the kept prefill."""
    model = tiny_base.model
    heads = make_heads(model, arch, 5, 0.3)
    ids = encode(tiny_base.tokenizer, PROMPTS[0])
    hot = SamplingConfig(temperature=1.0, acceptance="rejection", seed=0)
    eos = set(range(0, model.config.vocab_size, 5))  # a fifth of the vocabulary ends a row
    dec = Decoder(model, eos, heads, Tree.from_paths(branching([2, 2])), sampling=hot)
    dec.decode_kept(ids, 24, 4)
    k = dec.kept
    P, head_end = len(ids), k.ends[1]

    def state():
        live = k.state.head_cache.buf
        heads_part = None if live is None else live[:, :, :4, :, :head_end].clone()
        return k.state.cache.buf[:, :, :4, :, :P].clone(), heads_part, k.state.roots.clone()

    before = state()
    lengths = set()
    for _ in range(6):
        gens = dec.decode_kept(ids, 24, 4)
        lengths |= {len({len(g.tokens) for g in gens})}
        with torch.inference_mode():  # where decode_kept restores it, before each decode
            k.restore()
        after = state()
        assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
        assert (after[1] is None) == (before[1] is None)
        assert after[1] is None or torch.equal(after[1], before[1])
    assert max(lengths) > 1  # rows did finish apart, so rows were moved


def test_prompt_too_long_for_the_model_fails_clearly(tiny_base):
    heads = make_heads(tiny_base.model, "hydra", 0, 0.0)
    dec = Decoder(tiny_base.model, set(), heads, Tree.from_paths(chain(4)))
    n = tiny_base.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the base model's"):
        dec.speculative([[5] * (n - 10)], 20)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.plain([[]], 5)
    with pytest.raises(ValueError, match="no prompts"):
        dec.plain([], 5)


def test_greedy_rule_follows_the_matching_child():
    tree = Tree.from_paths([[0], [1], [1, 0], [1, 1]])
    tokens = torch.tensor([7, 3, 5, 2, 9])
    logits = torch.zeros(5, 10)
    logits[0, 5] = 1  # after the root the base picks 5: node 2 (rank 1)
    logits[2, 9] = 1  # after node 2 it picks 9: node 4
    logits[4, 6] = 1  # bonus 6
    # a second row of the batch, whose base picks what no child holds: it keeps the root
    other = torch.zeros(5, 10)
    other[0, 8] = 1
    rows = torch.stack([logits, other])
    (nodes, bonus), (nodes2, bonus2) = accept_greedy(
        [tree, tree], torch.stack([tokens, tokens]), lambda r, i: rows[r, i]
    )
    assert nodes.tolist() == [0, 2, 4] and bonus == 6
    assert nodes2.tolist() == [0] and bonus2 == 8
    # looking ahead along first children projects more nodes per pass, never other answers,
    # and takes fewer passes where the path follows first children
    chain_tree = Tree.from_paths([[0], [0, 0], [0, 0, 0]])
    chain_logits = torch.zeros(4, 10)
    for node, tok in enumerate([3, 5, 2, 6]):  # the base picks each next chain token, then 6
        chain_logits[node, tok] = 1
    for ahead, passes in [(0, 4), (1, 2), (3, 1)]:
        got = accept_greedy([tree, tree], torch.stack([tokens, tokens]), lambda r, i: rows[r, i],
                            ahead)  # fmt: skip
        assert [(n.tolist(), c) for n, c in got] == [([0, 2, 4], 6), ([0], 8)]
        calls = []

        def chain_rows(r, i, calls=calls):
            calls.append(i.tolist())
            return chain_logits[i]

        ((n, c),) = accept_greedy([chain_tree], torch.tensor([[7, 3, 5, 2]]), chain_rows, ahead)
        assert n.tolist() == [0, 1, 2, 3] and c == 6
        assert len(calls) == passes, (ahead, calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_ids_take_the_first_of_tied_maxima_as_argmax_does(dtype):
    """greedy_ids (max's indices, faster on bf16) is argmax exactly: rounded logits tie often,
    and the first maximum wins in both, contiguous or not."""
    from train.decoding.sampling import greedy_ids

    torch.manual_seed(0)
    x = torch.randint(0, 8, (64, 4096)).to(dtype)  # every row's maximum tied hundreds of times
    assert (x == x.max(-1, keepdim=True).values).sum(-1).min() > 100
    for y in (x, x[:, ::3], x[:1]):
        assert torch.equal(greedy_ids(y), y.argmax(-1))


def test_sampling_config_rejects_mismatched_rules():
    with pytest.raises(ValueError, match="greedy acceptance is for temperature 0"):
        SamplingConfig(temperature=0.0, acceptance="rejection", seed=0)
    with pytest.raises(ValueError, match="choose one of"):
        SamplingConfig(temperature=1.0, acceptance="nucleus", seed=0)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of observed counts to probs; cells expected < 5 are pooled."""
    from scipy.stats import chisquare

    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)]).double()
    ex = torch.cat([exp[big], exp[~big].sum().reshape(1)]).double()
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    return float(chisquare(obs.numpy(), ex.numpy() * obs.sum().item() / ex.sum().item()).pvalue)


def test_rejection_rule_preserves_the_base_distribution():
    """Synthetic tree over an 8-token vocab: the first emitted token must follow the root's
    distribution, and the token after an accepted child must follow that child's."""
    g = torch.Generator().manual_seed(0)
    V = 8
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1]])
    tokens = torch.tensor([0, 3, 1, 6, 2, 5])  # root, children 3/1/6 of the root, 2/5 of node 1
    logits = torch.randn(6, V, generator=g) * 1.5
    T = 0.8
    first = torch.zeros(V)
    after_node1 = torch.zeros(V)
    for _ in range(20000):
        nodes, bonus = accept_rejection(tree, tokens, lambda i: logits[i], T, g)
        emitted = [*tokens[nodes[1:]].tolist(), bonus]
        first[emitted[0]] += 1
        if len(nodes) >= 2 and int(nodes[1]) == 1:
            after_node1[emitted[1]] += 1
    p = torch.softmax(logits / T, -1)
    assert _chi2_pvalue(first, p[0]) > 1e-3
    assert _chi2_pvalue(after_node1, p[1]) > 1e-3
    # and the check has power: the root distribution is not what follows node 1
    assert _chi2_pvalue(after_node1, p[0]) < 1e-6


class TopKDecoder(Decoder):
    """Proposes, after the root, the base's own k most likely next tokens: good drafts, so the
    acceptance branch of the rejection rule runs often."""

    def __init__(self, *a, prompt: list[int], **k):
        super().__init__(*a, **k)
        self.prompt = prompt

    def propose(self, ctx, roots, lengths, memory=None):
        root = int(roots[0])
        with torch.no_grad():
            logits = self.model(torch.tensor([[*self.prompt, root]])).logits[0, -1]
        tokens = torch.empty(1, self.tree.num_nodes, dtype=torch.long)
        tokens[0, 0] = root
        tokens[0, 1:] = logits.topk(self.tree.num_nodes - 1).indices
        return Proposal([self.tree], tokens, self.proposer.bias, self.proposer.depth)


@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
def test_rejection_sampling_end_to_end_matches_direct_sampling(tiny_base, kind):
    """On the tiny_base model: the second generated token (the first one the tree decides) is
    distributed like sampling from the base directly, whether a draft or the bonus emits it,
    on a fixed tree and on a dynamic one (tree=dynamic)."""
    model = tiny_base.model
    heads = make_heads(model, "hydra", 1, 0.0)
    ids = encode(tiny_base.tokenizer, PROMPTS[2])
    T = 0.3
    with torch.no_grad():
        x = torch.tensor([ids])
        p1 = torch.softmax(model(x).logits[0, -1] / T, -1)
        V = p1.numel()
        batch = torch.cat([x.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        p2 = torch.softmax(model(batch).logits[:, -1] / T, -1)  # (V, V): p(x2 | x1)
    exact = p1 @ p2  # marginal of the second token
    sampling = SamplingConfig(temperature=T, acceptance="rejection", seed=0)
    if kind == "fixed":
        tree = Tree.from_paths(branching([3]))
        dec = TopKDecoder(model, set(), heads, tree, sampling, prompt=ids)
        runs = 1500
    else:  # wide at depth 1: these heads only echo the base, so it takes many guesses to hit
        dec = Decoder(model, set(), heads, DynamicTree(budget=30, expand=2, width=24), sampling)
        runs = 1000
    counts = torch.zeros(V)
    accepted = 0
    for _ in range(runs):
        gen = dec.speculative([ids], 2)[0]
        counts[gen.tokens[1]] += 1
        accepted += gen.accepted[0] > 0
    assert 0.07 * runs < accepted < 0.95 * runs  # both the draft and the bonus branch ran
    assert _chi2_pvalue(counts, exact) > 1e-3
    assert _chi2_pvalue(counts, p1) < 1e-6  # power: not just the first token's distribution


def test_typical_acceptance_runs_and_stays_in_the_typical_set(tiny_base):
    """Every emitted token, accepted draft or bonus, lies in the base's typical set at its
    position: p(x_t) > min(threshold, alpha * e^-H(p)) at temperature T (Medusa's rule)."""
    from train.decoding.sampling import typical_threshold

    heads = make_heads(tiny_base.model, "hydra", 2, 0.0)
    ids = encode(tiny_base.tokenizer, PROMPTS[0])
    # T=0.2: a third of the base's probability mass lies outside its typical set here
    T, threshold, alpha = 0.2, 0.09, 0.3
    sampling = SamplingConfig(
        temperature=T, acceptance="typical", seed=3, posterior_threshold=threshold,
        posterior_alpha=alpha,
    )  # fmt: skip
    dec = Decoder(tiny_base.model, set(), heads, Tree.from_paths(PRESETS["sparse_15"]), sampling)
    gen = dec.speculative([ids], 30)[0]
    assert len(gen.tokens) == 30 and gen.steps == len(gen.accepted)
    assert sum(gen.accepted) > 0  # drafts were accepted, not only bonus tokens
    with torch.no_grad():  # the base's distribution before each emitted token, teacher-forced
        logits = tiny_base.model(torch.tensor([ids + gen.tokens])).logits[0, len(ids) - 1 : -1]
    p = torch.softmax(logits.float() / T, -1)
    thr = typical_threshold(p, threshold, alpha)
    p_emitted = p[torch.arange(30), torch.tensor(gen.tokens)]
    # the tree pass and this one-pass forward differ by float rounding only
    assert bool((p_emitted > thr * (1 - 1e-4)).all()), (p_emitted - thr).min()
    # and the check has teeth: plain sampling at T leaves the typical set on this model
    rng = torch.Generator().manual_seed(0)
    sampled = torch.multinomial(p, 50, replacement=True, generator=rng)  # (30, 50)
    assert bool((p.gather(1, sampled) <= thr[:, None]).any())
