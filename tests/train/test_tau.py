"""val/tau: τ measured by the real verifier while training, and the best heads kept by it."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_here, train_config


def test_val_tau_is_the_verifier_s_tau_and_the_best_heads_are_kept(
    tiny_prepared, tiny_base, tmp_path
):
    """The logged figure is what decoding the same held-out prompts with the saved heads gives;
    heads_best holds the heads of the best measurement, heads/ the last ones."""
    from train.core.prompts import held_out_prompts, prepared_rows
    from train.decoding.decoder import Decoder
    from train.decoding.generation import acceptance_figures
    from train.decoding.sampling import eos_ids
    from train.heads import load_heads
    from train.tau import tree_named

    out = tmp_path / "run"
    r = run_here(
        "train",
        "base=tiny_random",
        "head=hydra_pp",
        "head.num_heads=3",  # mc_sim_7b_63 is cut to the depth 3 heads can propose
        f"data.prepared={tiny_prepared}",
        f"out={out}",
        "trainer.max_steps=12",
        "trainer.val_check_interval=4",
        "data.batch_size=4",
        "optim.lr=3e-3",
        "val_tau.prompts=2",
        "val_tau.max_new_tokens=12",
        "logger=csv",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    vt = summary["val_tau"]
    assert vt["last"]["step"] == 12 and vt["prompts"] == 2
    assert summary["validation"]["val/tau"] == pytest.approx(vt["last"]["taus"]["mc_sim_7b_63"])
    assert summary["validation"]["val/tau_chain"] == pytest.approx(vt["last"]["taus"]["chain"])
    logged = [
        float(row["val/tau"])
        for f in (out / "logs").rglob("metrics.csv")
        for row in __import__("csv").DictReader(f.open())
        if row.get("val/tau")
    ]
    # steps 4, 8, 12, then the final validation reports step 12's figure (not decoded again)
    assert len(logged) == 4 and logged[-1] == logged[-2]
    assert vt["best"]["tau"] == pytest.approx(max(logged), rel=1e-6)

    prompts = [p.tokens for p in held_out_prompts(prepared_rows(tiny_prepared), 2, 512)[0]]
    eos = eos_ids(tiny_base.tokenizer, tiny_base.model)
    for name, want_step in (("heads", 12), ("heads_best", vt["best"]["step"])):
        heads, meta = load_heads(out / name)
        assert meta["training"]["steps"] == want_step
        # both name their training data: eval tree=auto calibrates on its held-out rows
        assert meta["training"]["prepared"] == str(tiny_prepared.resolve())
        dec = Decoder(tiny_base.model, eos, heads)
        taus = {}
        for tree in ("mc_sim_7b_63", "chain"):
            dec.set_tree(tree_named(tree, 3, 3))
            accepted = [a for p in prompts for a in dec.speculative([p], 12)[0].accepted]
            taus[tree] = acceptance_figures(accepted, 0)["tau"]
        if name == "heads":
            assert taus == pytest.approx(vt["last"]["taus"])
        else:
            assert taus["mc_sim_7b_63"] == pytest.approx(vt["best"]["tau"])
            assert meta["training"]["val_tau"]["tau"] == pytest.approx(vt["best"]["tau"])


def test_val_tau_settings_are_checked_and_can_be_turned_off(tiny_prepared, tmp_path):
    common = ["base=tiny_random", f"data.prepared={tiny_prepared}", f"out={tmp_path / 'o'}"]
    with pytest.raises(Exception, match="val_tau.trees") as e:
        train_config([*common, "val_tau.trees=[chain,bushy]"])
    assert "mc_sim_7b_63" in str(e.value)
    out = tmp_path / "off"
    r = run_here(
        "train", *common[:2], f"out={out}", "trainer.max_steps=2", "trainer.val_check_interval=1",
        "val_tau.prompts=0", "logger=csv",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert "val_tau" not in summary and "val/tau" not in summary["validation"]
    assert not (out / "heads_best").exists()


def test_a_resumed_run_keeps_the_best_measured_on_disk(tmp_path, tiny_base):
    """The checkpoint of a step is written before that step's validation: the heads_best on
    disk may be newer than the checkpoint's record, and must not be overwritten by worse."""
    from tests.helpers import make_heads
    from train.config import ValTauConfig
    from train.heads import heads_meta, save_heads
    from train.tau import MeasuredTau

    heads = make_heads(tiny_base.model, "hydra", 0, 0.01)
    meta = heads_meta(heads, tiny_base.fingerprint(), tiny_base.cfg.to_dict())
    best = tmp_path / "heads_best"
    save_heads(best, heads, {**meta, "training": {"steps": 8, "val_tau": {"tau": 1.7}}})
    cfg = ValTauConfig(prompts=1, max_new_tokens=4, max_prompt_tokens=64, trees=["chain"])
    cb = MeasuredTau(cfg, tiny_base, [[1, 2, 3]], best, meta)
    cb.load_state_dict({"best": {"tau": 1.5, "step": 4}})
    assert cb.best == {"tau": 1.7, "step": 8}
    cb.load_state_dict({"best": {"tau": 1.9, "step": 4}})
    assert cb.best == {"tau": 1.9, "step": 4}
    assert cb.state_dict() == {"best": {"tau": 1.9, "step": 4}}
