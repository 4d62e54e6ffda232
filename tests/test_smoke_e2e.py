"""End-to-end smoke test on the embedded defaults: real SmolLM2 tokenizer, bundled ShareGPT.

Later pipeline stages (train, eval, report) extend this test as they land.
"""

from __future__ import annotations

import json

import datasets

from tests.helpers import run


def test_prep_on_bundled_sharegpt_with_smollm2(smol_prepared):
    """`hydra-heads prep data.max_conversations=60 data.max_length=512` (the session's
    `smol_prepared`, which the next test trains on)."""
    out = smol_prepared
    stats = json.loads((out / "prep_stats.json").read_text())
    assert stats["records_read"] == 60
    assert 40 <= stats["conversations_kept"] <= 60
    assert stats["skipped_total"] + stats["conversations_kept"] == 60
    dd = datasets.load_from_disk(str(out))
    train = dd["train"]
    assert len(train) > stats["conversations_kept"] * 0.5
    assert max(train["length"]) <= 512
    # Trainable tokens are a real share of the data, and every sample carries some.
    assert 0.3 < stats["trainable_tokens_total"] / stats["tokens_total"] < 0.98
    assert min(train["num_trainable"]) >= 1
    from tests.helpers import prep_config
    from train.core.base import load_tokenizer

    tok = load_tokenizer(prep_config(["out=x"]).base)
    row = train[0]
    text = tok.decode(row["input_ids"])
    assert text.startswith("<|im_start|>")
    # Each masked run ends on the end-of-turn token.
    runs, cur = [], []
    for t, m in zip(row["input_ids"], row["loss_mask"], strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    assert runs and all(tok.decode(x).endswith("<|im_end|>") for x in runs)


def test_prep_then_train_hydra_pp_on_smollm2(smol_prepared, tmp_path):
    """Real base, real data: a few Hydra++ steps, heads exported and loadable on SmolLM2."""
    data = smol_prepared  # the real `hydra-heads prep` of bundled ShareGPT, checked above
    out = tmp_path / "train"
    r = run(
        "train",
        "experiment=smollm2_cpu",
        f"data.prepared={data}",
        f"out={out}",
        "trainer.max_steps=3",
        "data.batch_size=2",
        "data.max_length=256",  # cut to 256 tokens: half the base's work per step at 512
        "head.draft_vocab_size=2048",
        "data.max_val_samples=4",
        "trainer.val_check_interval=1000",
        "val_tau.prompts=1",  # the final validation decodes one held-out prompt for val/tau
        "val_tau.max_new_tokens=8",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "heads after 3 steps" in r.stdout and "acceptance estimate" in r.stdout
    from tests.helpers import prep_config
    from train.core.base import load_base
    from train.heads import load_heads

    base = load_base(prep_config(["out=x"]).base)
    heads, meta = load_heads(out / "heads", base.fingerprint())
    assert meta["arch"] == "hydra_pp" and meta["draft_vocab_size"] == 2048
    assert meta["training"]["steps"] == 3
    assert 0.0 <= meta["training"]["validation"]["val/top1_base_h1"] <= 1.0
    assert meta["training"]["validation"]["val/tau"] >= 1.0 and (out / "heads_best").is_dir()
    assert (out / "config.yaml").is_file() and list(out.glob("logs/*/metrics.csv"))
    # eval: greedy speculative decoding on SmolLM2 returns exactly plain greedy's tokens, with
    # the 63-node tree (the run fails loudly otherwise) and with a calibrated tree.
    ev = tmp_path / "eval"
    r = run(
        "eval",
        f"heads={out / 'heads'}",
        f"out={ev}",
        "tree=mc_sim_7b_63",
        "eval.num_prompts=2",
        "eval.max_new_tokens=24",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((ev / "eval.json").read_text())
    assert res["lossless"] is True and res["prompts"]["items"] == 2
    assert res["tree"]["num_nodes"] == 63 and res["tau"] >= 1.0
    assert all(rec["new_tokens"] > 0 for rec in res["records"])
    # report: the figures of this run, in md / html / json, with its plots
    rep = tmp_path / "report"
    r = run("report", f"runs=[{tmp_path}]", f"out={rep}")
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((rep / "report.json").read_text())
    (row,) = data["leaderboard"]
    assert row["tau"] == res["tau"] and row["arch"] == "hydra_pp" and row["steps"] == 3
    assert row["tau_est"] == meta["training"]["validation"]["val/tau_est"]
    assert {"acceptance_by_depth", "loss_curves", "tau_by_run"} <= set(data["plots"])
    assert "| 1 | " in (rep / "report.md").read_text()
