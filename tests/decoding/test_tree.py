"""Trees: validation, masks, positions, retrieve indices, presets, calibrated growth."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from tests.helpers import trees
from train.decoding.tree import (
    MC_SIM_7B_63,
    PRESETS,
    Tree,
    TreeError,
    branching,
    chain,
    expected_length,
    grow,
)


def test_mask_positions_and_retrieve_of_a_small_tree():
    t = Tree.from_paths([[1], [0], [0, 0], [0, 1]])
    assert t.paths == ((0,), (1,), (0, 0), (0, 1))  # sorted: depth, then ranks
    assert t.num_nodes == 5 and t.max_depth == 2
    assert t.depth.tolist() == [0, 1, 1, 2, 2]
    assert t.parent.tolist() == [-1, 0, 0, 1, 1]
    assert t.rank.tolist() == [0, 0, 1, 0, 1]
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(t.mask, want)
    assert sorted(t.retrieve.tolist()) == [[0, 1, 3], [0, 1, 4], [0, 2, -1]]
    assert t.children == ((1, 2), (3, 4), (), (), ())
    lv = t.levels
    assert [x.depth for x in lv] == [1, 2] and lv[1].topk == 2
    assert lv[1].parents.tolist() == [1] and lv[1].nodes.tolist() == [3, 4]


def test_presets_and_generators():
    assert len(MC_SIM_7B_63) == 63
    big = Tree.from_paths(PRESETS["mc_sim_7b_63"])
    assert big.num_nodes == 64 and big.max_depth == 4
    assert branching([3, 2, 2]) == Tree.from_paths(branching([3, 2, 2])).to_json()
    assert len(branching([3, 2, 2])) == 3 + 6 + 12
    assert chain(3) == [[0], [0, 0], [0, 0, 0]]
    for name, paths in PRESETS.items():
        tree = Tree.from_paths(paths)  # every preset is a valid tree, in its nodes' order
        assert tree.to_json() == sorted(paths, key=lambda p: (len(p), p)), name
        size = name.rsplit("_", 1)[-1]
        if size.isdigit():  # sparse_15, chain_4, mc_sim_7b_63: that many draft nodes
            assert tree.num_nodes - 1 == int(size), name


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([[0], [0, 0, 1]], "has no parent"),
        ([[0], [0]], "appears twice"),
        ([[0], [-1]], "ranks >= 0"),
        ([[]], "non-empty"),
        ("0,1", "list of paths"),
        ([[0], [0, 0], [0, 0, 0]], "propose only 2"),
    ],
)
def test_bad_trees_fail_clearly(paths, message):
    with pytest.raises(TreeError, match=message):
        Tree.from_paths(paths, max_depth=2)


def test_a_too_deep_tree_is_refused_for_fewer_heads():
    with pytest.raises(TreeError, match="propose only 3"):
        Tree.from_paths(MC_SIM_7B_63).check_heads(3)


def test_save_and_load_round_trip(tmp_path):
    t = Tree.from_paths(branching([2, 2]))
    assert Tree.load(t.save(tmp_path / "tree.json")).paths == t.paths
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TreeError, match="not valid JSON"):
        Tree.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tree.load(tmp_path / "missing.json")


@given(trees())
@settings(max_examples=60, deadline=None)
def test_mask_is_ancestor_relation(paths):
    t = Tree.from_paths(paths)
    for i, p in enumerate(t.paths, start=1):
        for j, q in enumerate(t.paths, start=1):
            assert bool(t.mask[i, j]) == (q == p[: len(q)])  # ancestor-or-self
        assert bool(t.mask[i, 0]) and int(t.depth[i]) == len(p)
    # every node lies on exactly the leaf rows whose path passes through it
    covered = set(t.retrieve[t.retrieve >= 0].tolist())
    assert covered == set(range(t.num_nodes))


def test_grow_is_greedy_by_path_probability():
    acc = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.1, 0.0]])
    paths = grow(acc, 3)
    assert paths == [[0], [0, 0], [1]]  # 0.6, then 0.3 (0.6*0.5), then 0.2
    assert expected_length(paths, acc) == pytest.approx(1 + 0.6 + 0.3 + 0.2)
    # every prefix of a grown tree is a tree, and expected length grows with the budget
    big = grow(acc, 6)
    prev = 1.0
    for n in range(1, len(big) + 1):
        Tree.from_paths(big[:n])
        cur = expected_length(big[:n], acc)
        assert cur >= prev
        prev = cur
    assert all(acc[len(p) - 1, p[-1]] > 0 for p in big)  # zero-probability nodes never added
