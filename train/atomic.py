"""Publish a finished directory in place of another with renames: readers never see half of one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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


def write_text(path: Path, text: str) -> None:
    """Write `path` through a temp file and a rename: a kill never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
