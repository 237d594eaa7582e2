"""Choosing a format for a path: by ``format=``, then by extension, then by content."""

from __future__ import annotations

import inspect
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._errors import (
    GadgetError,
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetTypeError,
    GadgetValueError,
    as_choice,
)
from .._paths import as_path
from ._base import ArraySink, ArraySource
from ._hdf5 import Hdf5Sink, Hdf5Source, is_hdf5
from ._npy import NpySink, NpySource, is_npy
from ._zarr import ZarrSink, ZarrSource, is_zarr

__all__ = [
    "FORMATS",
    "open_source",
    "open_sink",
    "guess_format",
    "register_format",
    "sink_format",
    "sink_takes",
]

#: format name -> (source factory, sink factory, extensions, content sniffer)
_REGISTRY: dict[
    str,
    tuple[
        Callable[..., ArraySource], Callable[..., ArraySink], tuple[str, ...], Callable[[str], bool]
    ],
] = {}


def register_format(
    name: str,
    source: Callable[..., ArraySource],
    sink: Callable[..., ArraySink],
    extensions: tuple[str, ...],
    sniff: Callable[[str], bool],
) -> None:
    """Make a format known to :func:`open_source` / :func:`open_sink`."""
    _REGISTRY[name] = (source, sink, extensions, sniff)


register_format("npy", NpySource, NpySink, (".npy",), is_npy)
# h5py and zarr are imported by these classes only when a file is opened
register_format("hdf5", Hdf5Source, Hdf5Sink, (".h5", ".hdf5", ".hdf"), is_hdf5)
register_format("zarr", ZarrSource, ZarrSink, (".zarr",), is_zarr)

FORMATS = _REGISTRY  # read-only by convention


def _npy_hint(path: str) -> str:
    """A hint for a path given without the ``.npy`` that ``saveCupy`` / ``numpy.save``
    added to it."""
    if not path.endswith(os.sep) and os.path.isfile(path + ".npy"):
        return f" ({path}.npy exists: saveCupy and numpy.save add .npy to a name without it)"
    return ""


def guess_format(path: str | os.PathLike[str], *, must_exist: bool = True) -> str:
    """The format of ``path`` from its extension, else its content."""
    p = str(path)
    lower = p.lower().rstrip("/")
    for name, (_, _, exts, _) in _REGISTRY.items():
        if any(lower.endswith(e) for e in exts):
            return name
    if must_exist:
        if not os.path.exists(p):
            raise GadgetFileNotFoundError(f"no such file or directory: {p}{_npy_hint(p)}", p)
        for name, (_, _, _, sniff) in _REGISTRY.items():
            if sniff(p):
                return name
    known = {n: list(e[2]) for n, e in _REGISTRY.items()}
    raise GadgetValueError(
        f"cannot tell the format of {p!r}; expected one of {known} by extension or content, "
        "or pass format=..."
    )


def _check_format(fmt: str) -> str:
    return as_choice(fmt, "format", sorted(_REGISTRY))


def _check_dataset(dataset: Any) -> None:
    """A dataset / array name must be a non-empty string naming something below the root."""
    if dataset is None:
        return
    if not isinstance(dataset, str):
        raise GadgetTypeError(f"dataset must be a string (a name inside the file); got {dataset!r}")
    if not dataset.strip("/ "):
        raise GadgetValueError(
            f"dataset must name an array inside the file (e.g. 'data' or 'group/emb'); got {dataset!r}"
        )


def _check_regular(path: str) -> None:
    """Refuse a path that is neither a file nor a directory (a named pipe, a device, a
    socket): reading one could block for ever or consume another program's data."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: said below, as before
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = (
        "a named pipe (FIFO)"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )
    raise GadgetFileError(
        f"{path} is {kind}; expected a .npy / HDF5 file or a zarr directory (tables are read "
        "from regular files, at any offset)"
    )


def open_source(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    dataset: str | None = None,
    **kwargs: Any,
) -> ArraySource:
    """Open ``path`` for reading rows.

    Sources keep the absolute path: they open or map the file lazily, which must not
    depend on the process's working directory at that time."""
    path = os.path.abspath(as_path(path))
    _check_regular(path)
    try:
        fmt = _check_format(format) if format is not None else guess_format(path)
        if not os.path.exists(path):
            raise GadgetFileNotFoundError(
                f"no such file or directory: {path}{_npy_hint(path)}", path
            )
        _check_dataset(dataset)
        factory = _REGISTRY[fmt][0]
        if dataset is not None:
            kwargs["dataset"] = dataset
        return factory(path, **kwargs)
    except PermissionError as exc:
        if isinstance(exc, GadgetError):
            raise
        raise GadgetFileError(f"cannot read {path}: permission denied ({exc})") from exc


def open_sink(
    path: str | os.PathLike[str],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    format: str | None = None,
    **kwargs: Any,
) -> ArraySink:
    """Start writing a ``shape`` / ``dtype`` array to ``path`` (atomically, on commit)."""
    path = as_path(path)
    fmt = sink_format(path, format)
    factory = _REGISTRY[fmt][1]
    _check_dataset(kwargs.get("dataset"))
    options = {k: v for k, v in kwargs.items() if v is not None}
    accepted = _keyword_options(factory)
    if accepted is not None:
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise GadgetTypeError(
                f"saving {as_path(path)!r} as {fmt}: unexpected option(s) {unknown}; "
                f"{fmt} accepts {sorted(accepted) or 'no options'}"
            )
    return factory(path, shape, dtype, **options)


def sink_format(path: str | os.PathLike[str], format: str | None = None) -> str:
    """The format a save to ``path`` writes: ``format=``, else by extension.

    A path ending in a separator names a directory: refused for the formats that write
    one file (.npy, HDF5), which would otherwise be written at the name without it."""
    fmt = (
        _check_format(format) if format is not None else guess_format(Path(path), must_exist=False)
    )
    text = os.fspath(path)
    if fmt != "zarr" and isinstance(text, str) and text.endswith(("/", os.sep)):
        raise GadgetValueError(
            f"{text!r} names a directory (it ends with '/'), but "
            f"{'a .npy' if fmt == 'npy' else 'an HDF5'} table is saved as one file; give a file "
            "name"
        )
    return fmt


def sink_takes(fmt: str, option: str) -> bool:
    """Whether the sink of format ``fmt`` takes the keyword option ``option``."""
    accepted = _keyword_options(_REGISTRY[fmt][1])
    return accepted is None or option in accepted


def _keyword_options(factory: Callable[..., Any]) -> set[str] | None:
    """The keyword-only options a sink factory takes (None when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY}
