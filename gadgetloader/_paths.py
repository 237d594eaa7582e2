"""A path argument checked at the door: what every file-taking call does first."""

from __future__ import annotations

import os
from typing import Any

from ._errors import GadgetTypeError

__all__ = ["as_path"]


def as_path(path: Any, what: str = "path") -> str:
    """``os.fspath(path)`` for a ``str`` or ``os.PathLike``; anything else (``None``, a
    number, ``bytes``) is a :class:`~gadgetloader.GadgetTypeError` naming what arrived."""
    if isinstance(path, (str, os.PathLike)):
        p = os.fspath(path)
        if isinstance(p, str):
            return p
    raise GadgetTypeError(
        f"{what} must be a str or os.PathLike (a file or directory name); got "
        f"{type(path).__name__} {path!r:.60}"
    )
