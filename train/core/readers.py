"""Stream raw chat records from JSON arrays, JSONL and on-disk HF datasets; count bad rows."""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.core.errors import UserError

log = logging.getLogger(__name__)

MAX_EXAMPLES = 3  # first few examples of each skip reason that are logged and kept in the stats


# Chat record roles as datasets spell them -> the chat template's roles.
DEFAULT_ROLE_MAP: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
}


class DataError(UserError, RuntimeError):
    """Input data cannot be read at all (missing file, unreadable dataset)."""


@dataclass
class SkipLog:
    """Counts skipped rows by reason and remembers the first few examples of each."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            msg = f"{where}: {detail}" if detail else where
            ex.append(msg[:300])
            log.warning("skipping %s (%s)", msg[:300], reason)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning(message)


_STRUCT = re.compile(r'["{}\[\]]')
_STRING_END = re.compile(r'(?:[^"\\]|\\.)*"', re.S)
_SPACE = re.compile(r"\s*")  # \s: exactly the characters str.isspace() accepts
_SEPARATORS = re.compile(r"[\s,]*")


def _value_end(text: str, i: int) -> int | None:
    """End index of the bracketed value starting at `i`, ignoring its inner syntax; None at EOF.

    Used to step over a corrupt record: brackets are balanced outside strings, so the scan finds
    where the record ends even when its content does not parse.
    """
    depth = 0
    pos = i
    while True:
        m = _STRUCT.search(text, pos)
        if m is None:
            return None
        ch = m.group()
        if ch == '"':
            s = _STRING_END.match(text, m.end())
            if s is None:
                return None
            pos = s.end()
            continue
        depth += 1 if ch in "{[" else -1
        pos = m.end()
        if depth == 0:
            return pos


def _has_bad_chars(obj: Any) -> bool:
    """True when a decoded record still holds undecodable bytes (lone surrogates)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_bad_chars(k) or _has_bad_chars(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_bad_chars(v) for v in obj)
    return False


CHUNK_BYTES = 8 << 20  # a JSON array file is read this many bytes at a time
_BAD_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a non-UTF-8 byte


class _Window:
    """The part of a JSON array file not yet parsed, as text, read CHUNK_BYTES at a time.

    Positions are indices into `text`; `offset(i)` is the byte offset in the file (after a
    BOM) of index i, as a whole-file read would give it. Bytes that are not UTF-8 are kept as
    escapes (surrogateescape), which `_has_bad_chars` finds in a record; the first one is
    warned about once, with its byte offset."""

    def __init__(self, f, where: str, skips: SkipLog):
        self.f, self.where, self.skips = f, where, skips
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogateescape")
        self.text = ""
        self.base = 0  # bytes (after a BOM) before text[0]
        self.eof = False
        self.warned = False

    def more(self) -> bool:
        """Read the next chunk onto the window; False at the end of the file."""
        if self.eof:
            return False
        raw = self.f.read(CHUNK_BYTES)
        self.eof = not raw
        new = self.decoder.decode(raw, final=self.eof)
        if not self.warned and (bad := _BAD_BYTE.search(new)):
            self.warned = True
            at = self.offset(len(self.text)) + len(
                new[: bad.start()].encode("utf-8", "surrogateescape")
            )
            self.skips.warn(
                f"{self.where}: not valid UTF-8 at byte {at}; undecodable bytes are kept as "
                "escapes and the records that contain them are skipped as 'bad_encoding'"
            )
        self.text += new
        return bool(raw) or bool(new)

    def offset(self, i: int) -> int:
        return self.base + len(self.text[:i].encode("utf-8", "surrogateescape"))

    def drop(self, i: int) -> int:
        """Forget text[:i] (parsed); returns the index in the new text of the old index i."""
        if i >= CHUNK_BYTES:
            self.base = self.offset(i)
            self.text = self.text[i:]
            return 0
        return i


def _array_records(win: _Window, path: Path, skips: SkipLog) -> Iterator[tuple[str, Any]]:
    dec = json.JSONDecoder()
    while True:
        i = _SPACE.match(win.text).end()
        if i < len(win.text) or not win.more():
            break
    if i >= len(win.text) or win.text[i] != "[":
        raise DataError(f"{path} is not a JSON array (expected '[' at the start)")
    i += 1
    index = 0
    while True:
        i = win.drop(i)
        i = _SEPARATORS.match(win.text, i).end()
        if i >= len(win.text):
            if win.more():
                continue
            skips.warn(
                f"{path}: JSON array is not closed (file ends at byte {win.offset(i)}); kept "
                f"{index} records"
            )
            return
        if win.text[i] == "]":
            return
        try:
            obj, end = dec.raw_decode(win.text, i)
            if end >= len(win.text) and win.more():  # a number or word may go on
                continue
        except json.JSONDecodeError as e:
            end = _value_end(win.text, i) if win.text[i] in "{[" else None
            if end is None and win.more():  # the record goes on in the next chunk
                continue
            if end is None:
                offset = win.offset(i)
                skips.skip("truncated_record", f"{path.name}#{index}", f"record at byte {offset}")
                skips.warn(
                    f"{path} is truncated: the record starting at byte {offset} is incomplete "
                    f"({e.msg}); kept the {index} complete records before it"
                )
                return
            skips.skip("invalid_json", f"{path.name}#{index}", e.msg)
        else:
            yield f"{path.name}#{index}", obj
        index += 1
        i = end


def iter_json_array(path: Path, skips: SkipLog) -> Iterator[tuple[str, Any]]:
    """Yield (location, record) from a JSON array file, record by record, reading the file
    CHUNK_BYTES at a time (memory: a chunk and the longest record, not the file).

    A file cut short mid-record (an interrupted download, or the bundled ShareGPT file) keeps
    every complete record and records a warning with the byte offset of the cut. A corrupt
    record in the middle is skipped as 'invalid_json' and reading resumes at the next record.
    """
    with open(path, "rb") as f:
        yield from _array_records(_Window(f, str(path), skips), path, skips)


def iter_jsonl(path: Path, skips: SkipLog) -> Iterator[tuple[str, Any]]:
    """Yield (location, record) per line of a JSON-lines file; bad lines are skipped and counted."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path.name}:{lineno}"
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                skips.skip("bad_encoding", where, f"not UTF-8 at byte {e.start}")
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                skips.skip("invalid_json", where, e.msg)


def iter_hf_disk(path: Path, split: str | None, skips: SkipLog) -> Iterator[tuple[str, Any]]:
    """Yield (location, record) from a dataset saved with `datasets.save_to_disk`."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - re-raised with the path and the fix
        raise DataError(
            f"cannot read the Hugging Face dataset at {path} ({type(e).__name__}: {e}); it must "
            "be a directory written by datasets' save_to_disk"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            split = "train" if "train" in ds else next(iter(ds))
        if split not in ds:
            raise DataError(f"split '{split}' not in {path}; it has {', '.join(ds)}")
        ds = ds[split]
    for i, row in enumerate(ds):
        yield f"{path.name}[{i}]", row


def detect_format(path: Path) -> str:
    """'hf_disk' for a saved dataset dir, 'json' for a JSON array, else 'jsonl'."""
    if path.is_dir():
        return "hf_disk"
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return "json" if head.startswith(b"[") else "jsonl"


def iter_records(
    path: Path, fmt: str, skips: SkipLog, split: str | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield (location, record) from `path` in format `fmt` (auto|json|jsonl|hf_disk)."""
    if not path.exists():
        raise DataError(f"input not found: {path} (set data.path to an existing file or dir)")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "hf_disk":
        yield from iter_hf_disk(path, split, skips)
        return
    if path.is_dir():
        raise DataError(f"data.path={path} is a directory; data.format={fmt} needs a file")
    reader = iter_json_array if fmt == "json" else iter_jsonl
    for where, obj in reader(path, skips):
        if _has_bad_chars(obj):
            skips.skip("bad_encoding", where, "record holds bytes that are not UTF-8")
            continue
        yield where, obj
