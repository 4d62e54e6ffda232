"""Dynamic trees (tree=dynamic): always a valid tree within the budget, grown toward the
heads' most probable paths, and lossless under greedy decoding (rejection sampling on them:
tests/decoding/test_decode.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_heads
from train.decoding.decoder import Decoder
from train.decoding.dynamic import DynamicTree, Shape, by_temperature, grow_dynamic
from train.decoding.tree import Tree, TreeError


@pytest.mark.parametrize("arch", ["medusa", "hydra", "hydra_pp"])
@pytest.mark.parametrize("draft", [None, 64])
def test_dynamic_tree_is_a_tree_of_the_most_probable_paths(tiny_base, arch, draft):
    heads = make_heads(tiny_base.model, arch, 4, 0.3, draft)
    embed = tiny_base.model.get_input_embeddings()
    spec = DynamicTree(budget=12, expand=3, width=4)
    ctxs = heads.context(torch.randn(2, 5, 64))[:, -1]
    grown = grow_dynamic(spec, heads, embed, ctxs, torch.tensor([7, 7]))
    ctx = ctxs[0]
    tree, tokens = grown[0]
    # a batch grows each row's own tree: row 1 has another context, so another tree
    alone = grow_dynamic(spec, heads, embed, ctxs[1:], torch.tensor([7]))[0]
    assert grown[1][0].paths == alone[0].paths and torch.equal(grown[1][1], alone[1])
    assert tree.num_nodes == 13 and tokens.shape == (13,) and int(tokens[0]) == 7
    assert tree.max_depth <= heads.num_heads
    assert Tree.from_paths(tree.to_json()).paths == tree.paths  # closed: every parent kept

    # the kept nodes' cumulative probabilities beat every dropped candidate's
    def logp(path):
        toks, total = [7], 0.0
        for d, r in enumerate(path):
            p = torch.tensor([toks], dtype=torch.long)
            state = heads.head_input(d, ctx[None], embed(p) if heads.uses_path else None)
            lp = torch.log_softmax(heads.logits(d, state).float(), -1)[0]
            top = lp.topk(r + 1)
            total += float(top.values[r].detach())
            idx = top.indices[r]
            toks.append(int(idx if heads.draft is None else heads.draft.to_full[idx]))
        return total, toks[-1]

    kept = {p: logp(p) for p in tree.paths}
    for i, p in enumerate(tree.paths, start=1):
        assert kept[p][1] == int(tokens[i])  # each node's token is its rank's candidate
    worst_kept = min(v for v, _ in kept.values())
    for p in tree.paths:  # siblings are kept best rank first
        assert p[-1] == 0 or (*p[:-1], p[-1] - 1) in kept
    # the root is always expanded: a root child left out is no more probable than any kept node
    dropped = [logp((r,))[0] for r in range(spec.width) if (r,) not in kept]
    assert all(v <= worst_kept + 1e-5 for v in dropped)
    # and the tree follows the probabilities: a deeper tree than the budget's best chain
    assert tree.max_depth >= 2


@pytest.mark.parametrize(
    "arch", ["medusa", "hydra", "hydra_pp", "hydra_eagle", "hydra_cross_attn", "eagle3"]
)
def test_greedy_with_dynamic_trees_equals_plain_greedy(tiny_base, arch):
    heads = make_heads(tiny_base.model, arch, 5, 0.05)
    for prompt in ("hello there, how are you?", "count: 1 2 3 4"):
        ids = tiny_base.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref = Decoder(tiny_base.model, set(), heads).plain([ids], 40)[0].tokens
        for spec in (DynamicTree(8, 2, 3), DynamicTree(24, 4, 4, depth=3)):
            dec = Decoder(tiny_base.model, set(), heads, spec)
            gen = dec.speculative([ids], 40)[0]
            assert gen.tokens == ref
            assert gen.steps == len(gen.accepted)


def test_bad_dynamic_trees_fail_clearly(tiny_base):
    with pytest.raises(TreeError, match="tree.budget=0 is invalid"):
        DynamicTree(budget=0, expand=2, width=2)
    heads = make_heads(tiny_base.model, "hydra", 0, 0.0)
    with pytest.raises(TreeError, match="tree.depth=6 but the heads propose only 4"):
        Decoder(tiny_base.model, set(), heads, DynamicTree(8, 2, 2, depth=6))


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [
        (0.0, DynamicTree(15, 2, 3, 4)),  # cold: as deep as the 4 heads, narrow
        (1.0, DynamicTree(15, 4, 8, 2)),  # hot: broad and shallow
        (2.5, DynamicTree(15, 4, 8, 2)),  # past hot_at: the hot end
        (0.5, DynamicTree(15, 3, 6, 3)),  # halfway: interpolated, rounded
    ],
)
def test_temperature_tree_goes_from_deep_and_narrow_to_broad_and_shallow(temperature, expected):
    cold, hot = Shape(expand=2, width=3, depth=None), Shape(expand=4, width=8, depth=2)
    assert by_temperature(temperature, 15, cold, hot, 1.0, num_heads=4) == expected


def test_a_budget_the_shape_cannot_fill_is_flagged(tiny_base, caplog):
    """candidates() counts what the depths grow (a budget past it keeps them all), and eval
    warns when the budget is more than that."""
    from evaluation.config import DynamicTreeConfig
    from evaluation.evaluate import fixed_tree

    heads = make_heads(tiny_base.model, "hydra", 4, 0.3, None)
    embed = tiny_base.model.get_input_embeddings()
    ctx = heads.context(torch.randn(1, 5, 64))[:, -1]
    for expand, width, levels in [(4, 4, 4), (2, 3, 3), (10, 10, 1), (1, 5, 4)]:
        spec = DynamicTree(budget=10_000, expand=expand, width=width, depth=levels)
        tree, _ = grow_dynamic(spec, heads, embed, ctx, torch.tensor([7]))[0]
        assert tree.num_nodes - 1 == spec.candidates(levels)
    assert DynamicTree(63, 4, 4).candidates(4) == 52  # 4 + 3 x 16
    tc = DynamicTreeConfig(kind="dynamic", budget=63, expand=4, width=4, depth=None)
    with caplog.at_level("WARNING"):
        fixed_tree(tc, 4, 4)
    assert "grows only 52 draft nodes" in caplog.text
    caplog.clear()
    tc = DynamicTreeConfig(kind="dynamic", budget=63, expand=10, width=10, depth=None)
    with caplog.at_level("WARNING"):
        fixed_tree(tc, 4, 4)
    assert caplog.text == ""
