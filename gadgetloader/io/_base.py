"""The file-format contract: a source reads row blocks, a sink writes them.

Every format (.npy, HDF5, zarr) implements these two small classes; loading,
saving, converting and file-backed stores are written once against them.
"""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar

import numpy as np
import torch

from .._dtypes import numpy_dtype
from .._errors import GadgetValueError

__all__ = ["ArraySink", "ArraySource", "SourceShape"]


class SourceShape(tuple):  # type: ignore[type-arg]
    """A source's shape: a plain tuple that also says "a store of this shape is about to
    be filled from a file, through its host memory".

    A ``pinned`` store created with such a shape (``DataGadget(path, placement='pinned')``
    builds its store from ``source.shape``) page-locks its memory on a background thread
    while the rows are read into it, instead of before the first row is read; the load
    waits for it at the end (:func:`~gadgetloader.io.load_into`).
    """

    __slots__ = ()
    #: read by :class:`~gadgetloader.stores.PinnedStore`
    filled_from_host = True


class ArraySource(abc.ABC):
    """An array of one or more dimensions in a file (rows along the first), read in blocks of
    whole rows.

    Attributes
    ----------
    path : str
    shape : tuple of int
    dtype : torch.dtype
    chunk_rows : int
        The natural read unit in rows (the file's own chunking, or a few MB for .npy).
    """

    format: ClassVar[str]
    #: whether :meth:`write_rows` works on this source (write-through for file-backed stores)
    supports_writes: ClassVar[bool] = False

    path: str
    dtype: torch.dtype
    chunk_rows: int
    _shape: tuple[int, ...]

    #: whether the file stores the rows :meth:`write_rows` gets exactly (False where a
    #: filter may change them: HDF5's scale-offset, zarr's quantising filters, or a codec
    #: not known to be lossless); a file-backed store then drops the written blocks from
    #: its cache, so that its next read is what the file holds
    exact_writes: bool = True

    def writes_in_place(self) -> bool:
        """Whether this file's rows can be written in place (:meth:`write_rows`)."""
        return self.supports_writes

    #: set by sources opened with ``wide_unsigned=True`` over a uint16/32/64 array (which no
    #: table dtype holds): the array's NumPy dtype. ``dtype`` is then the signed carrier of
    #: the same size, and rows must be read into arrays of this dtype and converted
    #: (:func:`~gadgetloader.io.load_converted`)
    unsigned_bits: np.dtype | None = None

    def read_only_reason(self) -> str | None:
        """Why this file's rows cannot be written in place (None when they can)."""
        if self.writes_in_place():
            return None
        return f"{self.format} files cannot be written in place"

    @property
    def write_unit_rows(self) -> int:
        """Rows of the unit the file rewrites whole when any of its rows is written (a
        chunk, or a zarr shard); 1 where rows are written in place one by one. A write
        covering only part of a unit makes the format read (decode) the rest of it."""
        return 1

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @shape.setter
    def shape(self, value: tuple[int, ...]) -> None:
        self._shape = SourceShape(int(s) for s in value)

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_nbytes

    @property
    def numpy_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @abc.abstractmethod
    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Fill ``out`` (C-contiguous, ``numpy_dtype``, shape ``(stop-start, *shape[1:])``)."""

    def write_rows(self, start: int, rows: np.ndarray) -> None:
        """Write rows back to the file (only where :attr:`supports_writes`)."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional hook, most sources hold no handle
        """Release file handles (reopened lazily if used again)."""

    def __enter__(self) -> ArraySource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ArraySink(abc.ABC):
    """A file being written in row blocks, beside its target, renamed into place on commit."""

    format: ClassVar[str]

    @abc.abstractmethod
    def write(self, start: int, rows: np.ndarray) -> None:
        """Write the C-contiguous block ``rows`` at row ``start`` (rows of another dtype are
        converted, as NumPy assigns them; a block that does not fit the file's shape raises
        :class:`~gadgetloader.GadgetValueError` and writes nothing)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Flush, fsync and atomically move the file into place. A file with rows never
        written raises :class:`~gadgetloader.GadgetValueError` and is removed instead (the
        previous target, if any, is kept)."""

    def _accept(self, start: int, rows: np.ndarray) -> None:
        """Check that the block ``rows`` fits at row ``start`` of this sink's shape, and
        note the rows it covers (for :meth:`_require_complete`)."""
        shape = tuple(int(s) for s in self.shape)  # type: ignore[attr-defined]
        if rows.ndim != len(shape) or tuple(rows.shape[1:]) != shape[1:]:
            raise GadgetValueError(
                f"a block of rows of shape (n, {', '.join(map(str, shape[1:]))}) was expected for "
                f"this {shape} file; got a block of shape {tuple(rows.shape)}"
            )
        n = int(rows.shape[0])
        if not isinstance(start, (int, np.integer)) or start < 0 or start + n > shape[0]:
            raise GadgetValueError(
                f"rows {start}:{start + n} do not fit this file's {shape[0]} rows"
            )
        if n:
            self.__dict__.setdefault("_spans", []).append((int(start), int(start) + n))

    def _require_complete(self) -> None:
        """Before a commit: raise (and remove the partial file) if any row was never written,
        which the file would otherwise hold as zeros or its fill value."""
        total = int(self.shape[0])  # type: ignore[attr-defined]
        covered, end = 0, 0
        for a, b in sorted(self.__dict__.get("_spans", [])):
            if b > end:
                covered += b - max(a, end)
                end = b
        if covered < total:
            self.abort()
            raise GadgetValueError(
                f"only {covered} of this file's {total} rows were written: nothing was saved"
            )

    @abc.abstractmethod
    def abort(self) -> None:
        """Remove the partial file; the previous target (if any) is untouched."""

    def __enter__(self) -> ArraySink:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
