"""A path argument checked at the door: what every file-taking call does first."""

from __future__ import annotations

import os
from typing import Any

from ._errors import GadgetTypeError, GadgetValueError

__all__ = ["as_path"]

#: characters of a refused argument's repr shown in the message (a long path stays whole)
_SHOWN = 200


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def as_path(path: Any, what: str = "path", *, allow_empty: bool = False) -> str:
    """``os.fspath(path)`` for a ``str`` or an ``os.PathLike`` whose ``__fspath__`` gives a
    ``str``; anything else is a :class:`~gadgetloader.GadgetTypeError` naming what arrived.

    ``bytes`` paths (and ``os.PathLike`` objects that give bytes) are refused, everywhere a
    file name is taken: ``DataGadget`` reads a ``bytes`` source as data, so accepting them
    here would make ``save(b"t.npy")`` work while ``DataGadget(b"t.npy")`` cannot. The
    message names ``os.fsdecode``, which turns such a path into the ``str`` taken here
    (undecodable bytes survive as surrogate escapes, and name the same file).

    An empty string is refused (it would stand for the working directory) unless
    ``allow_empty`` (a directory argument, where ``''`` is what ``os.path.dirname`` gives
    for a bare file name).
    """
    if isinstance(path, (str, os.PathLike)):
        try:
            p = os.fspath(path)
        except TypeError:  # an __fspath__ that returns neither str nor bytes
            p = None
        if isinstance(p, str):
            if "\0" in p:  # (the OS's own refusal is a bare ValueError)
                raise GadgetValueError(
                    f"{what} must not contain a NUL character (no file name can); got {p!r:.80}"
                )
            if not p and not allow_empty:  # (would resolve to the working directory)
                raise GadgetValueError(f"{what} is an empty string; give a file or directory name")
            return p
        if isinstance(p, bytes):  # an os.PathLike whose __fspath__ gives bytes
            raise GadgetTypeError(
                f"{what} must be a str or an os.PathLike that gives a str (a file or directory "
                f"name); got {type(path).__name__}, whose __fspath__() gives bytes "
                f"{_shown(p)}: pass os.fsdecode(path) instead"
            )
    if isinstance(path, bytes):
        raise GadgetTypeError(
            f"{what} must be a str or os.PathLike (a file or directory name); got bytes "
            f"{_shown(path)}: pass os.fsdecode(path) instead"
        )
    raise GadgetTypeError(
        f"{what} must be a str or os.PathLike (a file or directory name); got "
        f"{type(path).__name__} {_shown(path)}"
    )


def file_identity(path: str) -> Any:
    """What names one file whatever path reaches it (symbolic or hard links): its
    ``(device, inode)``, or its real path where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (st.st_dev, st.st_ino)
