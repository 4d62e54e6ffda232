"""Dataset mixtures (data=mixture, data.sources): quotas, seeded selection, per-source stats,
dedup across sources, and clear errors, through prepare() and the real CLI."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import datasets
import pytest

from data_prep.mixture import quotas, select
from data_prep.prepare import PrepError, prepare
from tests.helpers import conv, prep_config, run_here
from train.core.errors import ConfigError
from train.core.readers import DataError


def _rows(tag: str, n: int, words: int = 1) -> list[dict]:
    """`n` distinct chats of source `tag`; `words` sets how long each reply is."""
    return [
        conv(("human", f"{tag} question {i}"), ("gpt", f"{tag} answer {i} " * words), cid=f"{i}")
        for i in range(n)
    ]


def _jsonl(path: Path, rows: list[dict], extra: list[bytes] = ()) -> Path:
    lines = [json.dumps(r).encode() for r in rows] + list(extra)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _sources(*items: tuple[Path, float, str]) -> str:
    """A `data.sources=[...]` override, written as a user types it."""
    body = ", ".join(f"{{path: {p}, weight: {w}{extra}}}" for p, w, extra in items)
    return f"data.sources=[{body}]"


def _cfg(tmp_path: Path, sources: str, *extra: str, out: str = "out"):
    return prep_config(
        [
            "base=tiny_random",
            "data=mixture",
            sources,
            f"out={tmp_path / out}",
            "data.val_fraction=0.0",
            *extra,
        ]
    )


def _conv_ids(out: Path) -> list[str]:
    dd = datasets.load_from_disk(str(out))
    return sorted(cid for split in dd.values() for cid in split["conv_id"])


# -- the rules, as pure functions ------------------------------------------------------------
def test_quotas_follow_the_weights():
    assert quotas([100, 100], [2, 1], 30) == [20, 10]
    assert quotas([1000, 1000], [0.7, 0.3], 10) == [7, 3]
    # no total: the largest one at which every source fills its share (b runs out first)
    assert quotas([100, 30], [2, 1], None) == [60, 30]
    assert quotas([10, 100], [1, 1], None) == [10, 10]
    # largest remainder: the quotas add up to the total, ties go to the earlier source
    assert quotas([10, 10, 10], [1, 1, 1], 10) == [4, 3, 3]
    assert quotas([50, 50, 50], [1, 2, 4], 10) == [1, 3, 6]  # exact 1.43, 2.86, 5.71
    # a quota may exceed what a source has: the caller reports the shortfall
    assert quotas([5, 100], [1, 1], 40) == [20, 20]


def test_selection_is_seeded_reproducible_and_without_replacement():
    a = select(100, 10, seed=0, name="a")
    assert a == select(100, 10, seed=0, name="a")
    assert a == sorted(set(a)) and len(a) == 10 and all(0 <= i < 100 for i in a)
    assert a != select(100, 10, seed=1, name="a")
    assert a != select(100, 10, seed=0, name="b")  # each source draws on its own
    assert select(5, 10, seed=0, name="a") == [0, 1, 2, 3, 4]


# -- prepare() -------------------------------------------------------------------------------
def test_shares_and_per_source_counts_in_prep_stats(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 40))
    # b: a JSON array (format auto-detected per source) ...
    b = tmp_path / "b.json"
    b.write_text(json.dumps(_rows("b", 40)))
    # ... and c, JSON lines with one unparsable line
    c = _jsonl(tmp_path / "chats.jsonl", _rows("c", 40), [b'{"broken'])
    sources = _sources((a, 3, ""), (b, 1, ""), (c, 1, ", name: c"))
    stats = prepare(_cfg(tmp_path, sources, "data.max_conversations=25"))

    ids = _conv_ids(tmp_path / "out")
    assert Counter(cid.split("/")[0] for cid in ids) == {"a": 15, "b": 5, "c": 5}
    assert stats["conversations_kept"] == 25
    assert stats["records_read"] == 40 + 40 + 41
    assert stats["skipped"] == {"invalid_json": 1}
    assert stats["mixture"] == {
        "seed": 0,
        "max_conversations": 25,
        "target": 25,
        "selected": 25,
        "shortfall": 0,
    }
    on_disk = json.loads((tmp_path / "out" / "prep_stats.json").read_text())
    assert on_disk["sources"] == stats["sources"]
    src = on_disk["sources"]
    assert list(src) == ["a", "b", "c"]
    assert src["a"]["path"] == str(a) and src["b"]["format"] == "auto"
    assert [src[n]["weight"] for n in src] == [3.0, 1.0, 1.0]
    assert [src[n]["share"] for n in src] == [0.6, 0.2, 0.2]
    assert [src[n]["records_read"] for n in src] == [40, 40, 41]
    assert [src[n]["usable"] for n in src] == [40, 40, 40]
    assert [src[n]["selected"] for n in src] == [15, 5, 5]
    assert [src[n]["not_selected"] for n in src] == [25, 35, 35]
    assert [src[n]["kept"] for n in src] == [15, 5, 5]
    assert [src[n]["kept_share"] for n in src] == [0.6, 0.2, 0.2]
    assert src["c"]["skipped"] == {"invalid_json": 1} and src["c"]["skipped_total"] == 1
    assert src["a"]["skipped"] == {} == src["b"]["skipped"]


def test_without_a_total_the_smallest_source_sets_the_size(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 50))
    b = _jsonl(tmp_path / "b.jsonl", _rows("b", 12))
    stats = prepare(_cfg(tmp_path, _sources((a, 2, ""), (b, 1, ""))))
    assert [s["selected"] for s in stats["sources"].values()] == [24, 12]
    assert stats["conversations_kept"] == 36 and stats["mixture"]["shortfall"] == 0


def test_a_short_source_gives_all_it_has_and_the_shortfall_is_reported(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 50))
    b = _jsonl(tmp_path / "b.jsonl", _rows("b", 8))
    stats = prepare(_cfg(tmp_path, _sources((a, 1, ""), (b, 1, "")), "data.max_conversations=40"))
    a_st, b_st = stats["sources"]["a"], stats["sources"]["b"]
    assert (a_st["target"], a_st["selected"], a_st["shortfall"]) == (20, 20, 0)
    assert (b_st["target"], b_st["selected"], b_st["shortfall"]) == (20, 8, 12)
    assert stats["mixture"]["selected"] == 28 and stats["mixture"]["shortfall"] == 12
    assert stats["conversations_kept"] == 28  # not filled up from a
    assert any("'b'" in w and "12 short" in w for w in stats["warnings"])


def test_per_source_max_conversations_caps_the_records_read(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 40))
    b = _jsonl(tmp_path / "b.jsonl", _rows("b", 40))
    stats = prepare(_cfg(tmp_path, _sources((a, 1, ", max_conversations: 10"), (b, 1, ""))))
    assert stats["sources"]["a"]["records_read"] == 10
    assert [s["selected"] for s in stats["sources"].values()] == [10, 10]


def test_duplicates_across_sources_are_dropped_from_the_later_source(tmp_path):
    rows_a = _rows("a", 20)
    # b: 10 own chats, 3 copies of a's (other ids), 1 copy of its own
    rows_b = _rows("b", 10) + [{**r, "id": f"copy{i}"} for i, r in enumerate(rows_a[:3])]
    rows_b.append({**rows_b[0], "id": "again"})
    a = _jsonl(tmp_path / "a.jsonl", rows_a)
    b = _jsonl(tmp_path / "b.jsonl", rows_b)
    sources = _sources((a, 1, ""), (b, 1, ""))
    stats = prepare(_cfg(tmp_path, sources, "data.max_conversations=20"))
    a_st, b_st = stats["sources"]["a"], stats["sources"]["b"]
    assert a_st["skipped"] == {}
    assert b_st["skipped"] == {"cross_source_duplicate": 3, "duplicate": 1}
    assert (b_st["records_read"], b_st["usable"]) == (14, 10)
    assert stats["skipped"] == {"cross_source_duplicate": 3, "duplicate": 1}
    assert "source 'a'" in stats["skipped_examples"]["cross_source_duplicate"][0]
    ids = _conv_ids(tmp_path / "out")
    assert not [cid for cid in ids if "copy" in cid or "again" in cid]

    stats = prepare(_cfg(tmp_path, sources, "data.dedup=false", out="nodedup"))
    assert stats["skipped"] == {}
    assert stats["sources"]["b"]["usable"] == 14


def test_skips_after_selection_are_counted_per_source(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 10))
    b = _jsonl(tmp_path / "b.jsonl", _rows("b", 10, words=40))  # too long for 64 tokens
    cfg = _cfg(
        tmp_path,
        _sources((a, 1, ""), (b, 1, "")),
        "data.max_length=64",
        "data.long_conversations=drop",
    )
    stats = prepare(cfg)
    a_st, b_st = stats["sources"]["a"], stats["sources"]["b"]
    assert (a_st["selected"], a_st["kept"], a_st["skipped"]) == (10, 10, {})
    assert (b_st["selected"], b_st["kept"], b_st["skipped"]) == (10, 0, {"too_long": 10})
    assert stats["skipped"] == {"too_long": 10}
    assert (a_st["kept_share"], b_st["kept_share"]) == (1.0, 0.0)


# -- the CLI -----------------------------------------------------------------------------------
def _digest(root: Path) -> dict[str, str]:
    # prep_timing.json holds times; config.yaml holds the (different) out dir
    skip = ("prep_timing.json", "config.yaml")
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def test_cli_mixture_is_reproducible_and_seed_dependent(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 60))
    b = _jsonl(tmp_path / "b.jsonl", _rows("b", 60))
    sources = _sources((a, 2, ""), (b, 1, ""))

    def prep(out: str, *extra: str) -> Path:
        args = ["base=tiny_random", "data=mixture", sources, "data.max_conversations=30"]
        r = run_here("prep", *args, "data.val_fraction=0.1", f"out={tmp_path / out}", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        return tmp_path / out

    first, again, other = prep("s0"), prep("s0-again"), prep("s1", "seed=1")
    r = run_here("prep", "base=tiny_random", "data=mixture", sources, "data.max_conversations=30",
                 "data.val_fraction=0.1", f"out={tmp_path / 's0'}", "overwrite=true")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mixture: per source" in r.stdout  # the summary table: source a's row, weight 2
    assert re.search(r"^\W*a\W+2\W", r.stdout, re.M), r.stdout
    assert _digest(first) == _digest(again)
    stats = json.loads((first / "prep_stats.json").read_text())
    assert [s["selected"] for s in stats["sources"].values()] == [20, 10]
    assert [s["weight"] for s in stats["sources"].values()] == [2.0, 1.0]
    ids, ids_other = _conv_ids(first), _conv_ids(other)
    assert ids != ids_other  # another seed, another selection ...
    assert Counter(c.split("/")[0] for c in ids_other) == {"a": 20, "b": 10}  # ... same shares
    assert "sources:" in (first / "config.yaml").read_text()


def test_cli_missing_source_names_the_source_and_path(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 5))
    missing = tmp_path / "nowhere.jsonl"
    r = run_here(
        "prep",
        "base=tiny_random",
        "data=mixture",
        _sources((a, 1, ""), (missing, 1, ", name: extra")),
        f"out={tmp_path / 'out'}",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "data.sources[1] (source 'extra')" in r.stderr and str(missing) in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_cli_sources_with_the_default_data_option_say_what_to_do(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 5))
    r = run_here("prep", "base=tiny_random", _sources((a, 1, "")), f"out={tmp_path / 'out'}")
    assert r.returncode == 2
    assert "'data.package_file'" in r.stderr and "data=mixture" in r.stderr


# -- config errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sources", "key", "fix"),
    [
        ("[{path: a.jsonl, weight: 0}]", "data.sources[0].weight", "> 0"),
        (
            "[{path: a.jsonl, weight: 1}, {path: b.jsonl, weight: -2}]",
            "data.sources[1].weight",
            "> 0",
        ),
        ("[{path: a.jsonl, weight: inf}]", "data.sources[0].weight", "> 0"),
        ("[{path: a.jsonl}]", "data.sources[0].weight", "required"),
        ("[{weight: 1}]", "data.sources[0].path", "required"),
        ("[]", "data.sources", "at least one source"),
        ("[{path: a.jsonl, weight: 1, colour: red}]", "data.sources[0].colour", "unknown key"),
        ("[{path: a.jsonl, weight: 1, format: csv}]", "data.sources[0].format", "'jsonl'"),
        ("[{path: a.jsonl, weight: 1, name: x/y}]", "data.sources[0].name", "without '/'"),
        ("[{path: a.jsonl, weight: 1}, {path: d/a.jsonl, weight: 1}]", "data.sources", "distinct"),
        ("[{path: a.jsonl, weight: 1, max_conversations: 0}]", "data.sources[0]", "positive"),
    ],
)
def test_bad_sources_name_the_key(sources, key, fix):
    with pytest.raises(ConfigError) as e:
        prep_config(["out=/tmp/x", "data=mixture", f"data.sources={sources}"])
    msg = str(e.value)
    assert f"'{key}" in msg and fix in msg, msg


def test_sources_and_a_path_together_are_refused():
    with pytest.raises(ConfigError) as e:
        prep_config(
            ["out=/tmp/x", "data=jsonl", "data.path=c.jsonl", "data.sources=[{path: a, weight: 1}]"]
        )
    assert "'data.path'" in str(e.value) and "data.sources replaces" in str(e.value)


def test_mixture_without_sources_says_the_key_is_required():
    with pytest.raises(ConfigError, match=r"'data.sources' is required"):
        prep_config(["out=/tmp/x", "data=mixture"])


def test_a_source_with_nothing_usable_is_an_error_naming_it(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 5))
    empty = _jsonl(tmp_path / "empty.jsonl", [{"id": "x", "text": "no turns"}])
    with pytest.raises(PrepError, match=r"data.sources\[1\] \(source 'empty'.*no usable"):
        prepare(_cfg(tmp_path, _sources((a, 1, ""), (empty, 1, ""))))


def test_a_directory_read_as_a_file_names_the_source(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 5))
    (tmp_path / "adir").mkdir()
    sources = _sources((a, 1, ""), (tmp_path / "adir", 1, ", format: jsonl"))
    with pytest.raises(DataError, match=r"data.sources\[1\] \(source 'adir'"):
        prepare(_cfg(tmp_path, sources))
