"""The library's exceptions and warnings.

Every error raised by gadgetloader derives from :class:`GadgetError`, so
``except gadgetloader.GadgetError`` catches them all; each also derives from the
matching builtin (``IndexError``, ``ValueError``, ...), so code written against
plain Python or NumPy keeps working.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterable

import numpy as np

__all__ = [
    "FallbackWarning",
    "GadgetClosedError",
    "GadgetError",
    "GadgetFileError",
    "GadgetFileNotFoundError",
    "GadgetIndexError",
    "GadgetKeyError",
    "GadgetMemoryError",
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


class GadgetFileNotFoundError(GadgetFileError, FileNotFoundError):
    """A path that does not exist (a :class:`GadgetFileError` and a ``FileNotFoundError``).

    As the builtin's, ``errno`` is ``errno.ENOENT`` and ``filename`` the missing path
    (the file, or the directory a save would write into), so ``except OSError as e:
    if e.errno == errno.ENOENT`` works; ``str(e)`` is the message alone."""

    def __init__(self, message: str, filename: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT
        self.strerror = message
        self.filename = None if filename is None else os.fspath(filename)

    def __str__(self) -> str:  # OSError would prefix "[Errno 2]" and repeat the path
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        return type(self), (str(self), self.filename)


class ReadOnlyError(GadgetError, PermissionError):
    """A write to a store whose source cannot be written."""


class GadgetClosedError(GadgetError, RuntimeError):
    """Use of a store or gadget after ``close()`` (or of a ``GadgetLoader`` pass that a newer
    one has replaced, with persistent workers)."""


class GadgetMemoryError(GadgetError, MemoryError):
    """A table that does not fit in the memory of its placement (host RAM or the GPU's):
    the message names the table's shape, dtype and bytes."""


def allocation_error(
    exc: BaseException, shape: tuple[int, ...], dtype: object, where: str, hint: str
) -> GadgetMemoryError | None:
    """A :class:`GadgetMemoryError` for ``exc`` if it is an allocator's out-of-memory
    error (torch's ``OutOfMemoryError``, a ``MemoryError``, or the CPU allocator's
    ``RuntimeError``), else None."""
    text = str(exc)
    oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
    if not oom and not (
        isinstance(exc, RuntimeError)
        and ("can't allocate memory" in text or "out of memory" in text.lower())
    ):
        return None
    nbytes = math.prod(shape) * int(getattr(dtype, "itemsize", 0))
    return GadgetMemoryError(
        f"a {tuple(shape)} {str(dtype).replace('torch.', '')} table ({nbytes:,} bytes) does not "
        f"fit in {where} ({type(exc).__name__}: {text.splitlines()[0] if text else ''}); {hint}"
    )


def host_memory_bytes(*, swap: bool = True) -> int | None:
    """This machine's physical RAM in bytes, plus its swap when ``swap`` (Linux's
    ``/proc/meminfo``), or None where the OS does not say."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    if ram <= 0:
        return None
    if swap:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("SwapTotal:"):
                        ram += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            pass
    return ram


def check_fits_in_host(
    shape: tuple[int, ...], dtype: object, where: str, hint: str, *, swap: bool = True
) -> None:
    """Raise :class:`GadgetMemoryError` before allocating a table larger than this
    machine's RAM (plus swap when ``swap``; page-locked memory cannot be swapped).

    Where the kernel overcommits memory, such an allocation succeeds and the process is
    killed while the rows are zeroed or page-locked; this check makes it an error. It
    knows the machine's memory, not a container's (cgroup) limit below it."""
    nbytes = math.prod(shape) * int(getattr(dtype, "itemsize", 0))
    limit = host_memory_bytes(swap=swap)
    if limit is not None and nbytes > limit:
        what = "RAM and swap" if swap else "RAM"
        raise GadgetMemoryError(
            f"a {tuple(shape)} {str(dtype).replace('torch.', '')} table ({nbytes:,} bytes) does "
            f"not fit in {where}: this machine has {limit:,} bytes of {what}; {hint}"
        )


class MissingDependencyError(GadgetError, ImportError):
    """A feature needs an optional package that is not installed."""


class FallbackWarning(UserWarning):
    """Emitted once per process when gadgetloader falls back to a slower path
    (e.g. the ``cuda`` or ``pinned`` placement on a machine without CUDA)."""


def as_flag(value: object, name: str, *, allow_none: bool = False) -> bool | None:
    """``value`` as a bool: True/False (NumPy's too) or the ints 1/0 (SpeedTorch compared
    ``CPUPinn == True``); anything else, a string above all (``bool('False')`` is True), is a
    ``GadgetTypeError``. ``allow_none``: None passes through (an automatic default)."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise GadgetTypeError(f"{name} must be True or False; got {type(value).__name__} {value!r:.40}")


def as_choice(
    value: object,
    name: str,
    choices: Iterable[str],
    *,
    error: type[GadgetError] | None = None,
) -> str:
    """``value`` as one of the names ``choices``: anything but a string (a list, an array,
    ``None``, ``False``) is a ``GadgetTypeError``; an unknown name raises ``error``
    (``GadgetKeyError`` unless given), both naming the choices."""
    options = list(choices)
    if not isinstance(value, str):
        raise GadgetTypeError(
            f"{name} must be a string, one of {options}; got {type(value).__name__} {value!r:.40}"
        )
    if value not in options:
        raise (error or GadgetKeyError)(f"Unknown {name} {value!r}; expected one of {options}")
    return value


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
    if not math.isfinite(value):  # (int() of nan / inf raises ValueError / OverflowError)
        raise GadgetValueError(f"{name} must be a whole number; got {value!r}")
    whole = int(value)  # type: ignore[call-overload]
    if whole != value:
        raise GadgetValueError(f"{name} must be a whole number; got {value!r}")
    if whole < minimum:
        raise GadgetValueError(f"{name} must be at least {minimum}; got {value!r}")
    return whole
