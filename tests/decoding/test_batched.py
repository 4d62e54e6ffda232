"""Batched decoding (eval.batch_size > 1) on the tiny random Llama: every row is the tokens of
its batch-1 greedy decode, rows that end leave the batch, the per-row KV compaction keeps each
row's own entries, and the heads see the same context as at batch 1."""

from __future__ import annotations

import pytest

from tests.helpers import make_heads
from train.decoding.decoder import Decoder
from train.decoding.dynamic import DynamicTree
from train.decoding.sampling import SamplingConfig
from train.decoding.tree import Tree, branching, chain

PROMPTS = [
    "hello there, how are you?",
    "count: 1 2 3 4",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a b",
    "the quick brown fox jumps over the lazy dog and then",
]


def _ids(tok) -> list[list[int]]:
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


TREES = {
    "branching": lambda: Tree.from_paths(branching([3, 2, 2])),
    "chain": lambda: Tree.from_paths(chain(4)),
    "dynamic": lambda: DynamicTree(budget=10, expand=3, width=3),
}


@pytest.mark.parametrize(
    "arch", ["medusa", "hydra", "hydra_pp", "hydra_eagle", "hydra_cross_attn", "eagle3"]
)
@pytest.mark.parametrize("tree", list(TREES))
def test_batched_rows_are_their_batch_1_greedy_decodes(tiny_base, arch, tree):
    """Prompts of different lengths, one row ending at an EOS mid-batch: each row's tokens are
    batch-1 plain greedy's, and its acceptance per step is batch-1 speculative's (so the heads,
    Hydra++'s cached extra layer included, saw the same context)."""
    model, ids = tiny_base.model, _ids(tiny_base.tokenizer)
    heads = make_heads(model, arch, 1, 0.02)
    first = Decoder(model, set(), heads).plain([ids[0]], 30)[0].tokens
    eos = {first[9]}  # row 0 ends early; others may too
    dec = Decoder(model, eos, heads, TREES[tree]())
    one_plain = [dec.plain([x], 30)[0] for x in ids]
    one_spec = [dec.speculative([x], 30)[0] for x in ids]
    spec = dec.speculative(ids, 30)
    plain = dec.plain(ids, 30)
    assert [g.tokens for g in spec] == [g.tokens for g in one_plain]
    assert [g.tokens for g in plain] == [g.tokens for g in one_plain]
    assert [g.finish for g in spec] == [g.finish for g in one_plain]
    assert spec[0].finish == "eos" and len(spec[0].tokens) < 30  # it left the batch early
    assert [g.accepted for g in spec] == [g.accepted for g in one_spec]
    assert max(g.tau for g in spec) > 1.5  # drafts were accepted: compaction was exercised
    assert [g.steps for g in plain] == [len(g.tokens) - 1 for g in plain]


def test_batch_times_add_up_to_the_batch(tiny_base):
    """The rows' shares of the batch's times sum to the batch's wall time, and the parts of a
    row's time (prefill, propose, verify, project, bookkeeping) fit within its total; the
    output projection is timed apart from the rest of the bookkeeping (both decoders pay it)."""
    import time

    model, ids = tiny_base.model, _ids(tiny_base.tokenizer)
    dec = Decoder(model, set(), make_heads(model, "hydra", 0, 0.02), Tree.from_paths(chain(3)))
    t0 = time.perf_counter()
    gens = dec.speculative(ids[:3], 12)
    wall = time.perf_counter() - t0
    total = sum(g.total_s for g in gens)
    assert 0.5 * wall < total <= wall
    for g in gens + dec.plain(ids[:3], 12):
        parts = g.prefill_s + g.propose_s + g.verify_s + g.project_s + g.bookkeeping_s
        assert g.prefill_s > 0 and g.verify_s > 0 and parts <= g.total_s * (1 + 1e-9)
        assert g.project_s > 0 and g.bookkeeping_s > 0
    for g in gens:
        assert g.total_s / total == pytest.approx(len(g.tokens) / sum(len(x.tokens) for x in gens))


@pytest.mark.parametrize("tree", ["branching", "dynamic"])
def test_batched_sampling_near_zero_temperature_is_greedy(tiny_base, tree):
    """The per-row rejection and typical rules read their own row's logits (and only its own
    tree's nodes, not a dynamic batch's padding): at a temperature close to 0 they pick the
    argmax, like greedy decoding."""
    model, ids = tiny_base.model, _ids(tiny_base.tokenizer)
    heads = make_heads(model, "hydra_pp", 1, 0.02)
    greedy = [Decoder(model, set(), heads).plain([x], 20)[0].tokens for x in ids]
    for acceptance in ("rejection", "typical"):
        sampling = SamplingConfig(1e-4, acceptance, 0, 0.09, 0.3)
        spec = TREES[tree]() if tree == "dynamic" else Tree.from_paths(branching([2, 2]))
        dec = Decoder(model, set(), heads, spec, sampling)
        assert [g.tokens for g in dec.speculative(ids, 20)] == greedy
