"""Readers: truncated JSON arrays, corrupt records, bad lines and encodings are counted."""

from __future__ import annotations

import json

import pytest

from train.core import readers
from train.core.readers import DataError, SkipLog, detect_format, iter_records


@pytest.fixture(autouse=True, params=[8 << 20, 5], ids=["one_chunk", "5_byte_chunks"])
def chunk_bytes(request, monkeypatch):
    """Every test reads JSON arrays whole (one chunk) and in 5-byte chunks, so that records,
    strings, numbers, multi-byte characters and bad bytes all straddle a chunk boundary."""
    monkeypatch.setattr(readers, "CHUNK_BYTES", request.param)
    return request.param


def _write_array(path, records, tail=b""):
    body = b"[\n" + b",\n".join(json.dumps(r, indent=2).encode() for r in records)
    path.write_bytes(body + tail)


def test_truncated_array_keeps_complete_records_and_warns_with_offset(tmp_path):
    recs = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)
    ]
    full = tmp_path / "full.json"
    _write_array(full, recs, b"\n]")
    data = full.read_bytes()
    cut_at = data.index(b'"q4"')  # cut inside the last record, after a nested '}, {'
    cut = tmp_path / "cut.json"
    cut.write_bytes(data[:cut_at])
    skips = SkipLog()
    got = [r for _, r in iter_records(cut, "auto", skips)]
    assert [r["id"] for r in got] == ["0", "1", "2", "3"]
    assert skips.counts == {"truncated_record": 1}
    start = data.rindex(b"{\n", 0, data.index(b'"id": "4"'))
    assert any(f"byte {start}" in w for w in skips.warnings), skips.warnings


def test_unclosed_array_after_complete_record_warns(tmp_path):
    p = tmp_path / "a.json"
    _write_array(p, [{"a": 1}, {"a": 2}], b",\n")
    skips = SkipLog()
    assert [r["a"] for _, r in iter_records(p, "json", skips)] == [1, 2]
    assert any("not closed" in w for w in skips.warnings)


def test_corrupt_record_in_the_middle_is_skipped_and_reading_continues(tmp_path):
    p = tmp_path / "mid.json"
    p.write_text('[{"a": 1}, {"a": 2, "b": [1, 2,, 3], "c": "}, {"}, {"a": 3}]')
    skips = SkipLog()
    assert [r["a"] for _, r in iter_records(p, "json", skips)] == [1, 3]
    assert skips.counts == {"invalid_json": 1}


def test_json_array_read_in_chunks_yields_what_json_load_does(tmp_path):
    recs = [
        {"id": str(i), "n": 12345678901234567890 + i, "f": -1.5e-3, "t": True, "z": None}
        for i in range(4)
    ]
    recs += [{"text": 'caf\u00e9 \u4e2d\u6587 \U0001f600 \\" ]},{', "esc": "\\u00e9"}, 7, "x"]
    p = tmp_path / "a.json"
    p.write_bytes(b"\xef\xbb\xbf " + json.dumps(recs, ensure_ascii=False).encode() + b"  \n")
    skips = SkipLog()
    assert [r for _, r in iter_records(p, "json", skips)] == recs
    assert skips.counts == {} and skips.warnings == []


def test_truncated_array_offset_is_the_same_in_chunks(tmp_path):
    """The byte offset of a cut is counted in bytes, not characters, across chunks."""
    recs = [{"id": str(i), "text": "\u00e9\u4e2d" * 7} for i in range(6)]
    data = json.dumps(recs, ensure_ascii=False).encode()
    cut_at = data.index(b'"id": "5"') + 3
    p = tmp_path / "cut.json"
    p.write_bytes(data[:cut_at])
    skips = SkipLog()
    assert len(list(iter_records(p, "json", skips))) == 5
    start = data.rindex(b"{", 0, cut_at)
    assert any(f"starting at byte {start} " in w for w in skips.warnings), skips.warnings


def test_jsonl_bad_lines_and_encoding_are_counted(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n\n{"a": \n' + '{"a": "\xe9"}'.encode("latin-1") + b'\n{"a": 4}\n')
    skips = SkipLog()
    assert [r["a"] for _, r in iter_records(p, "auto", skips)] == [1, 4]
    assert skips.counts == {"invalid_json": 1, "bad_encoding": 1}
    assert skips.examples["invalid_json"][0].startswith("x.jsonl:3")


def test_json_array_with_bad_bytes_skips_only_that_record(tmp_path):
    p = tmp_path / "enc.json"
    p.write_bytes(b'[{"a": "ok"}, {"a": "caf' + b"\xe9" + b'"}, {"a": "fine"}]')
    skips = SkipLog()
    assert [r["a"] for _, r in iter_records(p, "json", skips)] == ["ok", "fine"]
    assert skips.counts == {"bad_encoding": 1}


def test_missing_file_and_wrong_kind_fail_clearly(tmp_path):
    with pytest.raises(DataError, match="input not found"):
        list(iter_records(tmp_path / "nope.json", "auto", SkipLog()))
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(DataError, match="not a JSON array"):
        list(iter_records(tmp_path / "obj.json", "json", SkipLog()))
    with pytest.raises(DataError, match="cannot read the Hugging Face dataset"):
        list(iter_records(tmp_path, "hf_disk", SkipLog()))


def test_hf_disk_dataset_is_read(tmp_path):
    import datasets

    ds = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "x"}]}])}
    )
    ds.save_to_disk(str(tmp_path / "d"))
    assert detect_format(tmp_path / "d") == "hf_disk"
    rows = [r for _, r in iter_records(tmp_path / "d", "auto", SkipLog())]
    assert rows == [{"messages": [{"role": "user", "content": "x"}]}]
