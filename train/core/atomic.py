"""Atomic writes: a file or a whole directory appears complete or not at all, never half written."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _temp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def publish_dir(build: Path, dest: Path) -> None:
    """Move the complete directory `build` to `dest`, replacing any previous `dest`.

    The old `dest` is renamed aside first and deleted only after the new one is in place, so an
    interruption leaves either the old or the new directory at `dest`, never a mix.
    """
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
    os.replace(build, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(dest: str | Path, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty directory beside `dest`; when the block ends it becomes `dest`.

    An exception deletes it and leaves `dest` as it was. `keep_existing`: when another process
    published `dest` meanwhile (a shared cache), keep that one and drop this build.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_existing and dest.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        publish_dir(tmp, dest)


def write_text(path: str | Path, text: str) -> None:
    """Write `path` through a temp file and a rename: a kill never leaves half a file."""
    path = Path(path)
    tmp = _temp_beside(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | Path, data: Any) -> None:
    """`data` as indented JSON (non-JSON values as their str), written atomically."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")
