"""Rows on disk instead of in memory: prep's bounded-memory working sets.

prep never holds a corpus as Python rows. What it reads is written as it goes into Arrow files
under its work dir (`spool`) and opened memory-mapped (`datasets.Dataset.from_file`); every
later stage (tokenize, filter, pack, the stats) reads those files a batch at a time
(`iter_batches`), so prep's memory is about one batch and the dedup index, whatever the size of
the corpus. The files are the ones `datasets` itself writes (its ArrowWriter), so a spooled set
is an ordinary Dataset for `map`, `filter`, `select` and `save_to_disk`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

BATCH_ROWS = 1024  # rows per Arrow record batch, written and read


def spool(rows: Iterable[dict], path: Path, features):
    """Write `rows` (dicts of `features`' columns) to the Arrow file `path`, BATCH_ROWS at a
    time, and return it as a memory-mapped Dataset."""
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    with ArrowWriter(features=features, path=str(path), writer_batch_size=BATCH_ROWS) as writer:
        for row in rows:
            writer.write(row)
        writer.finalize()
    return Dataset.from_file(str(path))


def iter_batches(ds, columns: list[str], numpy: bool = False) -> Iterator[dict]:
    """`ds`'s `columns`, BATCH_ROWS rows at a time: lists, or numpy arrays (`numpy`)."""
    part = ds.select_columns(columns)
    if numpy:
        part = part.with_format("numpy")
    for start in range(0, len(part), BATCH_ROWS):
        yield part[start : start + BATCH_ROWS]


def column_array(ds, column: str) -> np.ndarray:
    """One scalar column of `ds` as a numpy array, read a batch at a time."""
    chunks = [b[column] for b in iter_batches(ds, [column], numpy=True)]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
