"""Growing a prepared dataset: `data.skip_records` prepares the next slice of a corpus and
`prep from_prepared=[A, B]` merges slices into one dataset, duplicates dropped, states kept."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from data_prep.prepare import PrepError, prepare
from launch.commands.prep import print_stats
from tests.helpers import conv, prep_config, wide_console
from train.core.errors import UserError
from train.data import check_prepared, load_prepared


def _corpus(tmp_path: Path, n: int = 40) -> Path:
    rows = [
        conv(("human", f"question {i} " * (1 + i % 5)), ("gpt", f"answer {i} " * (2 + i % 3)),
             cid=f"c{i}")
        for i in range(n)
    ]  # fmt: skip
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _prep(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    prepare(prep_config(["base=tiny_random", f"out={out}", "data.val_fraction=0.2", *extra]))
    return out


def _slice(tmp_path: Path, name: str, data: Path, skip: int, n: int, *extra: str) -> Path:
    return _prep(
        tmp_path, name, "data=jsonl", f"data.path={data}", f"data.skip_records={skip}",
        f"data.max_conversations={n}", *extra,
    )  # fmt: skip


def _samples(out: Path) -> dict[str, list]:
    dd = datasets.load_from_disk(str(out))
    return {
        split: sorted(zip(dd[split]["conv_id"], map(tuple, dd[split]["input_ids"]), strict=True))
        for split in dd
    }


def test_slices_prepared_apart_merge_into_the_whole(tmp_path):
    data = _corpus(tmp_path)
    whole = _slice(tmp_path, "whole", data, 0, 40)
    a = _slice(tmp_path, "a", data, 0, 25)
    b = _slice(tmp_path, "b", data, 25, 15)
    b_stats = json.loads((b / "prep_stats.json").read_text())
    assert b_stats["skip_records"] == 25 and b_stats["records_read"] == 15
    assert {c for s in _samples(b).values() for c, _ in s} == {f"c{i}" for i in range(25, 40)}

    merged = _prep(tmp_path, "merged", f"from_prepared=[{a},{b}]")
    assert _samples(merged) == _samples(whole)  # same samples, same train / validation split
    stats = json.loads((merged / "prep_stats.json").read_text())
    assert [e["path"] for e in stats["merged_from"]] == [str(a.resolve()), str(b.resolve())]
    assert stats["records_read"] == 40 and stats["conversations_kept"] == 40
    assert stats["splits"] == json.loads((whole / "prep_stats.json").read_text())["splits"]
    assert stats["cached_hidden"] is False and "duplicate_across_datasets" not in stats["skipped"]


def test_merge_drops_repeats_and_keeps_the_cached_states(tmp_path, capsys, monkeypatch):
    data = _corpus(tmp_path)
    a = _slice(tmp_path, "a", data, 0, 30, "cache_hidden=true")
    b = _slice(tmp_path, "b", data, 20, 20, "cache_hidden=true")  # records 20..29 repeat a's
    merged = _prep(tmp_path, "merged", f"from_prepared=[{a},{b}]")
    stats = json.loads((merged / "prep_stats.json").read_text())
    repeats = sum(1 for s in _samples(b).values() for c, _ in s if int(c[1:]) < 30)
    assert repeats > 0 and stats["skipped"]["duplicate_across_datasets"] == repeats
    assert stats["merged_from"][1]["duplicates_dropped"] == repeats
    assert stats["cached_hidden"] is True
    wide_console(monkeypatch)  # no wrapped rows
    print_stats(stats, str(merged))  # the CLI's summary of a merge
    shown = capsys.readouterr().out
    assert f"{repeats} repeats dropped" in shown and "records read" in shown
    ids = [c for s in _samples(merged).values() for c, _ in s]
    assert sorted(ids) == sorted(f"c{i}" for i in range(40))  # each conversation once
    check_prepared(merged, offline=True)  # offline training takes it as it is
    dd = load_prepared(merged, offline=True)
    src = {}
    for d in (a, b):
        part = datasets.load_from_disk(str(d))
        for split in part:
            for row in part[split]:
                src.setdefault(row["conv_id"], row["hidden"])
    for split in dd:
        for row in dd[split]:
            assert row["hidden"] == src[row["conv_id"]]  # the states came along, unchanged

    plain = _slice(tmp_path, "plain", data, 30, 10)  # no cached states
    with pytest.raises(PrepError, match="different cached states.*cache_hidden=true"):
        _prep(tmp_path, "mixed", f"from_prepared=[{a},{plain}]")
    assert not (tmp_path / "mixed").exists()
    recached = _prep(tmp_path, "recached", f"from_prepared=[{a},{plain}]", "cache_hidden=true")
    dd = datasets.load_from_disk(str(recached))
    assert "hidden" in dd["train"].column_names
    assert sorted(c for s in dd.values() for c in s["conv_id"]) == sorted(
        f"c{i}" for i in range(40)
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["from_prepared=[]"], "one prepared dir, or a list"),
        (["from_prepared=[x,x]"], "listed twice"),
        (["from_prepared=x"], "only caches hidden states anew"),
        (["data=mixture", "data.sources=[{path: a, weight: 1}]", "data.skip_records=5"],
         "skipping applies to one input"),
        (["data.skip_records=-1"], "skip_records"),
    ],
)  # fmt: skip
def test_bad_merge_or_skip_settings_are_refused(overrides, match):
    with pytest.raises(UserError, match=match):
        prep_config(["out=x", *overrides])


def test_a_dataset_of_another_tokenizer_is_refused_under_the_same_base_name(tmp_path):
    """A base keeps its name when its files change (base.path): the tokenizer fingerprint that
    prep records tells its token ids apart, for one source and for a merge."""
    data = _corpus(tmp_path, 20)
    a = _slice(tmp_path, "a", data, 0, 10)
    b = _slice(tmp_path, "b", data, 10, 10)
    stats_path = b / "prep_stats.json"
    stats = json.loads(stats_path.read_text())
    ours = stats["tokenizer"]
    assert ours == json.loads((a / "prep_stats.json").read_text())["tokenizer"]
    stats["tokenizer"] = "0123456789abcdef"  # as if tokenized by another vocabulary
    stats_path.write_text(json.dumps(stats))
    with pytest.raises(PrepError, match=f"another tokenizer.*0123456789abcdef.*{ours}"):
        _prep(tmp_path, "merged", f"from_prepared=[{a},{b}]")
    with pytest.raises(PrepError, match="another tokenizer"):
        _prep(tmp_path, "recached", f"from_prepared={b}", "cache_hidden=true")
    assert not (tmp_path / "merged").exists() and not (tmp_path / "recached").exists()
    del stats["tokenizer"]  # an older release's output: the base name decides, as before
    stats_path.write_text(json.dumps(stats))
    merged = _prep(tmp_path, "merged", f"from_prepared=[{b},{a}]")  # the first records none
    assert json.loads((merged / "prep_stats.json").read_text())["tokenizer"] == ours
