"""The library's exceptions and warnings.

Every error raised by gadgetloader derives from :class:`GadgetError`, so
``except gadgetloader.GadgetError`` catches them all; each also derives from the
matching builtin (``IndexError``, ``ValueError``, ...), so code written against
plain Python or NumPy keeps working.
"""

from __future__ import annotations

__all__ = [
    "FallbackWarning",
    "GadgetClosedError",
    "GadgetError",
    "GadgetFileError",
    "GadgetFileNotFoundError",
    "GadgetIndexError",
    "GadgetKeyError",
    "GadgetTypeError",
    "GadgetValueError",
    "MissingDependencyError",
    "ReadOnlyError",
]


class GadgetError(Exception):
    """Base class of every gadgetloader error."""


class GadgetIndexError(GadgetError, IndexError):
    """Row ids out of range or negative."""


class GadgetValueError(GadgetError, ValueError):
    """A value of the right type but the wrong shape, size or content."""


class GadgetTypeError(GadgetError, TypeError):
    """An argument of the wrong type, dtype or device."""


class GadgetKeyError(GadgetError, KeyError):
    """A name (dataset, placement, strategy, optimizer state) that does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class GadgetFileError(GadgetError, OSError):
    """A file that exists but cannot be used (truncated, wrong format, ...)."""


class GadgetFileNotFoundError(GadgetError, FileNotFoundError):
    """A path that does not exist."""


class ReadOnlyError(GadgetError, PermissionError):
    """A write to a store whose source cannot be written."""


class GadgetClosedError(GadgetError, RuntimeError):
    """Use of a store or gadget after ``close()``."""


class MissingDependencyError(GadgetError, ImportError):
    """A feature needs an optional package that is not installed."""


class FallbackWarning(UserWarning):
    """Emitted once per process when gadgetloader falls back to a slower path
    (e.g. the ``cuda`` or ``pinned`` placement on a machine without CUDA)."""


def table_mismatch(same_shape: bool, message: str) -> GadgetError:
    """The error for a file or tensor that does not fit a table: a ``GadgetTypeError`` when
    only the dtype differs, a ``GadgetValueError`` when the shape does."""
    return GadgetTypeError(message) if same_shape else GadgetValueError(message)


def as_count(value: object, name: str, *, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum``: integral ints (NumPy ints, integral floats
    such as ``20.0``) pass; bools, fractions and smaller values raise."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GadgetTypeError(f"{name} must be an integer; got {value!r}")
    whole = int(value)  # type: ignore[call-overload]
    if whole != value:
        raise GadgetValueError(f"{name} must be a whole number; got {value!r}")
    if whole < minimum:
        raise GadgetValueError(f"{name} must be at least {minimum}; got {value!r}")
    return whole
