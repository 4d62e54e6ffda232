"""tree=auto's choice: candidates timed in interleaved rounds, so a slow spell of the machine
cannot decide between plain decoding and speculation."""

from __future__ import annotations

import pytest
import torch

from evaluation.calibrate import Calibration, choose_tree
from train.decoding.tree import Tree

# per-step seconds of a step with a tree of n nodes, on a quiet machine
COST = {0: 1.00, 1: 1.05, 2: 1.10, 3: 1.40, 4: 1.45, 6: 1.6, 8: 1.7}


class FakeDecoder:
    """decode_step_seconds: the tree's cost times the machine's speed at that call."""

    def __init__(self, slow=lambda i: 1.0):
        self.tree, self.calls, self.slow, self.timed = Tree.from_paths([]), 0, slow, []
        self.forgotten = False

    def set_tree(self, tree: Tree) -> None:
        self.tree = tree

    def decode_step_seconds(self, prompt, new_tokens, reps, batch) -> float:
        nodes = self.tree.num_nodes - 1
        self.timed.append(nodes)
        s = COST[nodes] * self.slow(self.calls)
        self.calls += 1
        return s

    def forget_kept(self) -> None:
        self.forgotten = True


def calibration() -> Calibration:
    acc = torch.tensor([[0.30, 0.12, 0.05], [0.20, 0.08, 0.04]])  # 2 heads, top-3
    return Calibration(acc, [1000, 800], 16, [True, True])


def test_quiet_machine_picks_the_best_expected_speedup():
    dec = FakeDecoder()
    best, options = choose_tree(dec, calibration(), [1, 2, 3], budget=8)
    assert dec.forgotten  # the kept prefill is freed once the candidates are timed
    assert options[0].tree.num_nodes == 1 and options[0].expected_speedup == 1.0
    for o in options[1:]:
        nodes = o.tree.num_nodes - 1
        assert o.step_s == COST[nodes]
        assert o.expected_speedup == pytest.approx(o.expected_tau / COST[nodes])
    assert best is max(options, key=lambda o: o.expected_speedup)
    assert best.tree.num_nodes - 1 in (1, 2) and dec.tree is best.tree
    # every round times every candidate once: plain decoding among them, not only first
    n = len(options)
    assert len(dec.timed) == 4 * n  # a warm-up round and 3 timed rounds
    assert all(dec.timed[r * n : (r + 1) * n] == dec.timed[:n] for r in range(4))


@pytest.mark.parametrize("start", range(0, 24, 3))
def test_a_slow_spell_as_long_as_a_round_does_not_change_the_choice(start):
    """Wherever a 1.3x slow spell one round long falls, every candidate keeps a clean round;
    timing plain decoding first and each tree after it, a spell over the trees' turn made
    every tree look 1.3x dearer and the choice plain decoding."""
    quiet = FakeDecoder()
    want, _ = choose_tree(quiet, calibration(), [1, 2, 3], budget=8)
    n = len(quiet.timed) // 4
    dec = FakeDecoder(lambda i: 1.3 if start <= i < start + n else 1.0)
    got, options = choose_tree(dec, calibration(), [1, 2, 3], budget=8)
    assert got.tree.num_nodes == want.tree.num_nodes > 1
    assert [o.step_s for o in options] == [COST[o.tree.num_nodes - 1] for o in options]


def test_no_tree_clears_the_margin_decodes_plainly():
    weak = Calibration(torch.tensor([[0.04, 0.01], [0.02, 0.01]]), [900, 700], 16, [True, True])
    best, options = choose_tree(FakeDecoder(), weak, [1, 2], budget=4, min_speedup=1.05)
    assert best is options[0] and best.tree.num_nodes == 1
    assert all(o.expected_speedup < 1.05 for o in options)


def test_a_calibration_without_held_out_rows_says_why(tmp_path):
    from evaluation.evaluate import calibration_split
    from train.core.errors import ConfigError

    with pytest.raises(ConfigError, match="and the heads name no prep output: pass"):
        calibration_split(None, "auto")
    with pytest.raises(ConfigError, match="gone does not exist: pass eval.prepared=DIR"):
        calibration_split(str(tmp_path / "gone"), "auto")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty has none: pass"):
        calibration_split(str(tmp_path / "empty"), "calibrated")
