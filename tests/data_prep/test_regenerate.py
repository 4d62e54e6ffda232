"""Self-distillation: assistant turns come from the base model; a killed job resumes by shard."""

from __future__ import annotations

import json

import datasets
import pytest

from data_prep.prepare import prepare
from data_prep.regenerate import regenerate
from tests.helpers import conv, prep_config, regen_config


def _rows(n):
    rows = []
    for i in range(n):
        rows.append(
            {
                "conv_id": f"c{i}",
                "key": f"k{i}",
                "roles": ["user", "assistant", "user", "assistant"],
                "contents": [f"q{i}", "ORIGINAL", f"again {i}", "ORIGINAL"],
            }
        )
    return rows


# The random tiny_base model's greedy reply is all whitespace (dropped as empty), so sample.
SAMPLE = {"temperature": 1.0}


def test_regenerates_every_assistant_turn_reproducibly(tmp_path, tiny_base):
    cfg = regen_config(max_new_tokens=6, batch_size=3, shard_size=4, **SAMPLE)
    out = regenerate(_rows(5), tiny_base, cfg, tmp_path / "r")
    assert len(out) == 5
    for r in out:
        assert r["roles"] == ["user", "assistant", "user", "assistant"]
        assert "ORIGINAL" not in r["contents"] and all(c.strip() for c in r["contents"])
    assert regenerate(_rows(5), tiny_base, cfg, tmp_path / "again") == out  # seeded per shard
    other = regenerate(_rows(5), tiny_base, cfg, tmp_path / "seed1", seed=1)
    assert other != out


def test_empty_replies_end_the_conversation(tmp_path, tiny_base):
    from data_prep.readers import SkipLog

    skips = SkipLog()
    out = regenerate(_rows(2), tiny_base, regen_config(max_new_tokens=4), tmp_path / "g", 0, skips)
    assert out == [] and skips.counts == {"regen_empty_reply": 2}


def test_killed_run_resumes_at_the_first_missing_shard(tmp_path, tiny_base, monkeypatch):
    import data_prep.regenerate as regen_mod

    cfg = regen_config(max_new_tokens=4, batch_size=2, shard_size=2, **SAMPLE)
    full = regenerate(_rows(6), tiny_base, cfg, tmp_path / "a")

    calls = []
    real = regen_mod._regen_shard

    def dies_on_second_shard(rows, base, c):
        calls.append(rows[0]["conv_id"])
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(rows, base, c)

    monkeypatch.setattr(regen_mod, "_regen_shard", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        regenerate(_rows(6), tiny_base, cfg, tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b").glob("shard-*")) == ["shard-00000.jsonl"]
    calls.clear()
    monkeypatch.setattr(regen_mod, "_regen_shard", real)
    monkeypatch.setattr(
        regen_mod,
        "_regen_shard",
        lambda rows, base, c: calls.append(rows[0]["conv_id"]) or real(rows, base, c),
    )
    resumed = regenerate(_rows(6), tiny_base, cfg, tmp_path / "b")
    assert calls == ["c2", "c4"]  # shard 0 was not redone
    assert resumed == full


def test_changed_inputs_discard_stale_shards(tmp_path, tiny_base):
    cfg = regen_config(max_new_tokens=3, shard_size=2, **SAMPLE)
    regenerate(_rows(2), tiny_base, cfg, tmp_path / "r")
    stale = tmp_path / "r" / "shard-00000.jsonl"
    stale.write_text(
        json.dumps(
            {"conv_id": "stale", "key": "x", "roles": [], "contents": [], "regenerated_turns": 1}
        )
        + "\n"
    )
    out = regenerate(_rows(3), tiny_base, cfg, tmp_path / "r")
    assert [r["conv_id"] for r in out] == ["c0", "c1", "c2"]


def test_prep_regenerate_end_to_end_tiny(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(conv(("human", f"hello {i}"), ("gpt", "ORIGINAL"), cid=f"c{i}"))
            for i in range(4)
        )
    )
    cfg = prep_config(
        [
            "base=tiny_random",
            "data=jsonl",
            f"data.path={data}",
            f"out={tmp_path / 'out'}",
            "data.val_fraction=0",
            "regenerate=true",
            "regen.max_new_tokens=5",
            "regen.shard_size=2",
            "regen.temperature=1.0",
        ]
    )
    stats = prepare(cfg)
    assert stats["regenerated"] is True
    assert not (tmp_path / "out.partial").exists()  # work dir removed once published
    tok = __import__("train.core.base", fromlist=["tiny_tokenizer"]).tiny_tokenizer()
    for row in datasets.load_from_disk(str(tmp_path / "out"))["train"]:
        assert "ORIGINAL" not in tok.decode(row["input_ids"])


def test_regeneration_that_empties_every_reply_is_a_clear_error(tmp_path):
    from data_prep.prepare import PrepError

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(conv(("human", "hello"), ("gpt", "ORIGINAL"), cid="c0")))
    overrides = [f"data.path={data}", f"out={tmp_path / 'out'}", "regenerate=true"]
    cfg = prep_config(["base=tiny_random", "data=jsonl", *overrides, "regen.max_new_tokens=3"])
    # the random tiny model's greedy reply is all whitespace: every turn is dropped as empty
    with pytest.raises(PrepError, match=r"regeneration left no conversation.*regen_empty_reply"):
        prepare(cfg)
    assert not (tmp_path / "out").exists()


def test_regenerate_a_few_smollm2_conversations(tmp_path):
    """The real base model answers in its own words (greedy, short)."""
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(conv(("human", q), ("gpt", "ORIGINAL"), cid=f"s{i}"))
            for i, q in enumerate(["What is the capital of France?", "Say hello in Spanish."])
        )
    )
    cfg = prep_config(
        [
            f"data.path={data}",
            "data=jsonl",
            f"out={tmp_path / 'o'}",
            "data.val_fraction=0",
            "regenerate=true",
            "regen.max_new_tokens=12",
        ]
    )
    prepare(cfg)
    ds = datasets.load_from_disk(str(tmp_path / "o"))["train"]
    from train.core.base import load_tokenizer

    tok = load_tokenizer(cfg.base)
    texts = [
        tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m])
        for r in ds
    ]
    assert len(texts) == 2
    assert all("ORIGINAL" not in t and t.endswith("<|im_end|>") for t in texts)
    assert "Paris" in texts[0] or "paris" in texts[0].lower(), texts
