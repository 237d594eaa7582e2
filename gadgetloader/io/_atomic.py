"""Atomic replacement of a file or directory: write beside it, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["interrupts_deferred", "temp_path_beside", "replace_atomically", "remove_path"]


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


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[Callable[[], None]]:
    """Hold Ctrl-C (SIGINT) until a safe point of a long write.

    Yields ``check``: call it between blocks; it raises ``KeyboardInterrupt`` if Ctrl-C was
    pressed since. Python drops a ``KeyboardInterrupt`` that lands inside a finalizer (h5py
    closes objects in ``__del__`` and weakref callbacks), which let an interrupted save run
    on to the end; deferred to ``check`` it always stops the save, which then removes its
    partial file. A second Ctrl-C raises at once. Only in the main thread, and only while
    Python's own SIGINT handler is installed (a program's handler is left alone).
    """
    pressed: list[bool] = []

    def check() -> None:
        if pressed:
            pressed.clear()
            raise KeyboardInterrupt

    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield check
        return

    def hold(signum: int, frame: object) -> None:
        if pressed:
            raise KeyboardInterrupt  # pressed twice: stop now
        pressed.append(True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    check()
