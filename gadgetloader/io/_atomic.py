"""Atomic replacement of a file or directory: write beside it, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

from .._device import user_stacklevel
from .._errors import GadgetError, GadgetFileError, ReadOnlyError

__all__ = [
    "InterruptedAfterWrite",
    "resolved_target",
    "interrupts_deferred",
    "temp_path_beside",
    "temp_prefix",
    "replace_atomically",
    "remove_path",
]


def resolved_target(target: str | os.PathLike[str]) -> Path:
    """``target``, or what it links to when it is a symbolic link: a save through a link
    writes the file the link names (as ``numpy.save`` does) and the link stays."""
    t = Path(target)
    return Path(os.path.realpath(t)) if t.is_symlink() else t


def _name_max(folder: Path) -> int:
    """The longest file name (in bytes) the file system of ``folder`` takes."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def temp_prefix(target: str | os.PathLike[str], tag: str = "partial") -> str:
    """The start ``.NAME.TAG-`` of the names :func:`temp_path_beside` gives for ``target``
    (NAME shortened where the whole name would pass the file system's limit), to find
    the temporaries a failed write left."""
    t = resolved_target(target)
    # ".NAME" + ".TAG-" + "PID-XXXXXXXX": room for the widest pid (7 digits) and the tag
    fixed = len(f"..{tag}-") + 7 + 1 + 8
    room = _name_max(t.parent if str(t.parent) else Path(".")) - fixed
    raw = os.fsencode(t.name)
    # a long name keeps its start (cut at a byte: the file system stores bytes, and a
    # cut character is kept as the same bytes by fsdecode's surrogate escapes)
    name = t.name if len(raw) <= room else os.fsdecode(raw[: max(room, 1)])
    return f".{name}.{tag}-"


def temp_path_beside(target: str | os.PathLike[str], tag: str = "partial") -> Path:
    """A fresh hidden path ``.NAME.TAG-PID-XXXXXXXX`` in the target's directory (same file
    system, so rename is atomic); NAME is shortened where the whole would pass the file
    system's name limit (a target whose own name is near that limit). A symbolic link's
    target is the one written (see :func:`replace_atomically`)."""
    t = resolved_target(target)
    return t.with_name(f"{temp_prefix(t, tag)}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _keep_attributes(old: Path, new: Path) -> None:
    """Give ``new`` the permission bits (and, where allowed, the owner and group) of
    ``old``, which it replaces: a private 0600 table stays private."""
    try:
        st = os.stat(old)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.chmod(new, stat.S_IMODE(st.st_mode))
    if hasattr(os, "chown"):
        with contextlib.suppress(OSError):
            os.chown(new, st.st_uid, st.st_gid)


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
    (zarr) is renamed aside first (to ``.NAME.old-PID-XXXXXXXX``), so at every instant
    either the old or the new one is complete at ``target``'s path or at the aside path;
    if the new one cannot take the path, the old one is moved back. The old store is then
    renamed to ``.NAME.trash-PID-XXXXXXXX`` and removed (a kill during that removal leaves
    that half-deleted entry, never a partial ``.old-`` one). The new file keeps the old
    one's permission bits (and owner, where allowed); a symbolic link stays a link and
    the file it names is replaced. Other hard links to the old file keep the old data."""
    tmp_p, target_p = Path(tmp), resolved_target(target)
    _keep_attributes(target_p, tmp_p)
    try:
        _replace(tmp_p, target_p)
    except OSError as exc:
        if isinstance(exc, GadgetError):
            raise
        # (an immutable or protected target, a vanished folder: the old file is kept)
        error = ReadOnlyError if isinstance(exc, PermissionError) else GadgetFileError
        raise error(
            f"cannot put the new {target_p} in place of the old one ({exc}); the old file is "
            "kept as it was"
        ) from exc
    _fsync_dir(target_p.parent)


def _replace(tmp_p: Path, target_p: Path) -> None:
    if tmp_p.is_dir() and target_p.exists():
        aside = temp_path_beside(target_p, tag="old")
        os.replace(target_p, aside)
        try:
            os.replace(tmp_p, target_p)
        except BaseException:
            # the new store could not take the path: put the old one back (where something
            # else took the path meanwhile, the old store stays at ``aside``, complete)
            with contextlib.suppress(OSError):
                os.replace(aside, target_p)
            raise
        # renamed once more before the removal, so that a ``.old-`` entry is always a
        # complete store: a kill during the removal leaves a ``.trash-`` entry, safe to delete
        trash = temp_path_beside(target_p, tag="trash")
        try:
            os.replace(aside, trash)
        except OSError:
            trash = aside
        remove_path(trash)
        if os.path.lexists(trash):
            # the new store is in place; the old one could not all be removed (read-only
            # folders inside it, say): say where it is, as a save must not fill the disk
            # with hidden copies unseen
            warnings.warn(
                f"{target_p} was replaced, but the old store's files could not all be "
                f"removed; remove {trash} by hand",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
    else:
        os.replace(tmp_p, target_p)


class InterruptedAfterWrite(KeyboardInterrupt):
    """Ctrl-C came while a save replaced its target: the save is complete (the new file is
    in place), and the interrupt is delivered once it is."""


class _Held:
    """The ``check`` of :func:`interrupts_deferred`."""

    def __init__(self) -> None:
        self.pressed: list[bool] = []
        #: set by the caller once its write is committed: a held Ctrl-C is then reported
        #: by :meth:`deliver` as :class:`InterruptedAfterWrite` (the target is written)
        self.committed = False
        self.late = False

    def __call__(self) -> None:
        if self.pressed:
            self.pressed.clear()
            raise KeyboardInterrupt

    def deliver(self, what: str) -> None:
        """After the commit and its clean-up: raise a Ctrl-C held during the commit."""
        if self.late:
            self.late = False
            raise InterruptedAfterWrite(f"interrupted after {what} was written")


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[_Held]:
    """Hold Ctrl-C (SIGINT) until a safe point of a long write.

    Yields ``check``: call it between blocks; it raises ``KeyboardInterrupt`` if Ctrl-C was
    pressed since. Python drops a ``KeyboardInterrupt`` that lands inside a finalizer (h5py
    closes objects in ``__del__`` and weakref callbacks), which let an interrupted save run
    on to the end; deferred to ``check`` it always stops the save, which then removes its
    partial file. A second Ctrl-C raises at once. Only in the main thread, and only while
    Python's own SIGINT handler is installed (a program's handler is left alone).

    Call ``check()`` just before the commit (the last point where the write can stop) and
    set ``check.committed = True`` after it: a Ctrl-C held during the commit, when the
    target has been replaced, is then not raised on leaving the block but by
    ``check.deliver(...)`` as :class:`InterruptedAfterWrite`, after the caller's clean-up.
    """
    held = _Held()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield held
        return

    def hold(signum: int, frame: object) -> None:
        if held.pressed:
            raise KeyboardInterrupt  # pressed twice: stop now
        held.pressed.append(True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held.committed:
        held.late = bool(held.pressed)
        held.pressed.clear()
    else:
        held()
