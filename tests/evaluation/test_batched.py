"""Batched decoding (eval.batch_size > 1) on the tiny random Llama: every row is the tokens of
its batch-1 greedy decode, rows that end leave the batch, the per-row KV compaction keeps each
row's own entries, and the heads see the same context as at batch 1."""

from __future__ import annotations

import pytest
import torch

from evaluation.batched import plain_batch, speculative_batch
from evaluation.decode import Decoder, SamplingConfig
from evaluation.dynamic import DynamicTree
from evaluation.kvcache import PreallocatedCache, keep_rows, select_rows
from evaluation.tree import Tree, branching, chain
from tests.helpers import make_heads

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


@pytest.mark.parametrize("arch", ["medusa", "hydra", "hydra_pp"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("kv_cache", ["static", "dynamic"])
def test_batched_rows_are_their_batch_1_greedy_decodes(tiny_base, arch, tree, kv_cache):
    """Prompts of different lengths, one row ending at an EOS mid-batch: each row's tokens are
    batch-1 plain greedy's, and its acceptance per step is batch-1 speculative's (so the heads,
    Hydra++'s cached extra layer included, saw the same context)."""
    model, ids = tiny_base.model, _ids(tiny_base.tokenizer)
    heads = make_heads(model, arch, 1, 0.02)
    first = Decoder(model, set(), heads, kv_cache=kv_cache).plain(ids[0], 30).tokens
    eos = {first[9]}  # row 0 ends early; others may too
    dec = Decoder(model, eos, heads, TREES[tree](), kv_cache=kv_cache)
    one_plain = [dec.plain(x, 30) for x in ids]
    one_spec = [dec.speculative(x, 30) for x in ids]
    spec = speculative_batch(dec, ids, 30)
    plain = plain_batch(dec, ids, 30)
    assert [g.tokens for g in spec] == [g.tokens for g in one_plain]
    assert [g.tokens for g in plain] == [g.tokens for g in one_plain]
    assert [g.finish for g in spec] == [g.finish for g in one_plain]
    assert spec[0].finish == "eos" and len(spec[0].tokens) < 30  # it left the batch early
    assert [g.accepted for g in spec] == [g.accepted for g in one_spec]
    assert max(g.tau for g in spec) > 1.5  # drafts were accepted: compaction was exercised
    assert [g.steps for g in plain] == [len(g.tokens) - 1 for g in plain]


def test_batch_times_add_up_to_the_batch(tiny_base):
    model, ids = tiny_base.model, _ids(tiny_base.tokenizer)
    dec = Decoder(model, set(), make_heads(model, "hydra", 0, 0.02), Tree.from_paths(chain(3)))
    gens = speculative_batch(dec, ids[:3], 12)
    assert all(g.total_s > g.prefill_s > 0 for g in gens)
    shares = [g.total_s / len(g.tokens) for g in gens]  # by tokens: equal per token
    assert max(shares) == pytest.approx(min(shares))


@pytest.mark.parametrize("tree", ["branching", "dynamic"])
def test_batched_sampling_near_zero_temperature_is_greedy(tiny_base, tree):
    """The per-row rejection and typical rules read their own row's logits (and only its own
    tree's nodes, not a dynamic batch's padding): at a temperature close to 0 they pick the
    argmax, like greedy decoding."""
    model, ids = tiny_base.model, _ids(tiny_base.tokenizer)
    heads = make_heads(model, "hydra_pp", 1, 0.02)
    greedy = [Decoder(model, set(), heads).plain(x, 20).tokens for x in ids]
    for acceptance in ("rejection", "typical"):
        sampling = SamplingConfig(1e-4, acceptance, 0, 0.09, 0.3)
        spec = TREES[tree]() if tree == "dynamic" else Tree.from_paths(branching([2, 2]))
        dec = Decoder(model, set(), heads, spec, sampling)
        assert [g.tokens for g in speculative_batch(dec, ids, 20)] == greedy


def test_keep_rows_moves_each_rows_accepted_entries():
    """Rows of lengths 3 and 5 wrote a 4-node tree at slots 5..8; row 0 keeps nodes 0, 2, row 1
    nodes 0, 1, 3. Each row's prefix stays; its accepted entries follow its own prefix."""
    cache = PreallocatedCache(2, 16)
    keys = torch.arange(2 * 1 * 9, dtype=torch.float32).view(2, 1, 9, 1)
    for layer in cache.layers:
        layer.update(keys.clone(), keys.clone() + 100)
    lengths = torch.tensor([3, 5])
    start = keep_rows(cache, lengths, 5, [torch.tensor([0, 2]), torch.tensor([0, 1, 3])])
    assert start == 8
    for layer in cache.layers:
        k = layer.key_buf[:, 0, :, 0]
        assert k[0, :5].tolist() == [0, 1, 2, 5, 7]  # prefix 0..2, then tree slots 5 and 7
        assert k[1, :8].tolist() == [9, 10, 11, 12, 13, 14, 15, 17]
        assert layer.keys.shape[2] == 8 and layer.get_seq_length() == 8
        assert torch.equal(layer.value_buf[:, 0, :8, 0], k[:, :8] + 100)
    select_rows(cache, torch.tensor([1]), 8)  # row 0 leaves
    assert cache.layers[0].key_buf[0, 0, :8, 0].tolist() == [9, 10, 11, 12, 13, 14, 15, 17]
