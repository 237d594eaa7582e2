"""Atomic replacement of a file or directory: write beside it, then rename."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

__all__ = ["temp_path_beside", "replace_atomically", "remove_path"]


def temp_path_beside(target: str | os.PathLike[str]) -> Path:
    """A fresh hidden path in the target's directory (same file system, so rename is atomic)."""
    t = Path(target)
    return t.with_name(f".{t.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_path(path: str | os.PathLike[str]) -> None:
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def replace_atomically(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Move ``tmp`` onto ``target``. A file is replaced in one ``rename``; a directory
    (zarr) is renamed aside first, so at every instant either the old or the new one
    is complete at ``target``'s path or at the aside path."""
    tmp_p, target_p = Path(tmp), Path(target)
    if tmp_p.is_dir() and target_p.exists():
        aside = temp_path_beside(target_p)
        os.replace(target_p, aside)
        os.replace(tmp_p, target_p)
        remove_path(aside)
    else:
        os.replace(tmp_p, target_p)
    _fsync_dir(target_p.parent)
