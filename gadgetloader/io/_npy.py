"""The .npy format: header parsing, block reads straight into the destination, streamed atomic writes."""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import threading
import tokenize
import weakref
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from .._dtypes import as_torch_dtype, dtype_name, numpy_dtype
from .._errors import (
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetTypeError,
    GadgetValueError,
    ReadOnlyError,
)
from ._atomic import remove_path, replace_atomically, temp_path_beside
from ._base import ArraySink, ArraySource
from ._chunks import check_free_space, check_sink_target, save_errors, unsigned_carrier

__all__ = ["NpySink", "NpySource", "is_npy"]

#: rows per read for .npy files: about this many bytes
NPY_BLOCK_BYTES = 8 << 20
_MAGIC = b"\x93NUMPY"

#: NumPy parses a .npy header with ``ast.literal_eval``. CPython 3.11 keeps the AST
#: builder's recursion counter per interpreter, not per thread, so two threads parsing at
#: once can fail with "SystemError: AST constructor recursion depth mismatch" (CPython
#: gh-106905). Every header NpySource parses goes through this lock.
_HEADER_LOCK = threading.Lock()


def is_npy(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a file that starts with the .npy magic string."""
    try:
        with open(path, "rb") as f:
            return f.read(6) == _MAGIC
    except OSError:
        return False


def _read_header(f: BinaryIO, path: str) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    try:
        version = np.lib.format.read_magic(f)
        with _HEADER_LOCK:
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
    except (
        ValueError,
        SyntaxError,
        TypeError,
        OverflowError,
        EOFError,
        tokenize.TokenError,
    ) as exc:
        # NumPy parses the header as a Python literal: a damaged one fails in any of these
        raise GadgetFileError(f"{path}: not a readable .npy file ({exc})") from exc
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise GadgetFileError(
            f"{path}: not a readable .npy file (its header gives the shape {shape}; "
            "expected non-negative whole numbers)"
        )
    return tuple(shape), dtype, fortran, f.tell()


class NpySource(ArraySource):
    """Rows of a C-ordered .npy file, read with ``readinto`` into the caller's buffer.

    Raises
    ------
    GadgetFileNotFoundError
        The path does not exist.
    GadgetFileError
        The file is not .npy, or is shorter than its header says (truncated).
    GadgetTypeError
        The dtype cannot be a table (object, strings, ...).
    """

    format = "npy"
    supports_writes = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: str = "r",
        dataset: str | None = None,
        wide_unsigned: bool = False,
    ) -> None:
        self.path = str(path)
        if dataset is not None:
            raise GadgetValueError(
                f"{self.path}: a .npy file holds one array; dataset={dataset!r} does not apply"
            )
        if not os.path.exists(self.path):
            raise GadgetFileNotFoundError(f"no such .npy file: {self.path}", self.path)
        if os.path.isdir(self.path):
            raise GadgetFileError(f"{self.path} is a directory, not a .npy file")
        self._mode = mode
        with open(self.path, "rb") as f:
            shape, npd, fortran, offset = _read_header(f, self.path)
            st = os.fstat(f.fileno())
        #: the file this source parsed: every later descriptor and map must be of it
        self._ident = (st.st_dev, st.st_ino)
        if npd.hasobject or npd.kind in "OSUVMm":
            raise GadgetTypeError(
                f"{self.path}: dtype {npd} cannot be a table; expected a numeric or bool dtype"
            )
        carrier = unsigned_carrier(npd, wide_unsigned)
        #: a uint16/32/64 file opened with ``wide_unsigned``: its dtype (native order); rows
        #: are read into arrays of it and converted (``dtype`` is then the bits' carrier)
        self.unsigned_bits: np.dtype | None = None
        if carrier is not None:
            self.dtype = carrier
            self.unsigned_bits = npd.newbyteorder("=")
        else:
            try:
                self.dtype = as_torch_dtype(npd)
            except GadgetTypeError as exc:
                raise GadgetTypeError(f"{self.path}: {exc}") from exc
        if len(shape) == 0:
            raise GadgetValueError(f"{self.path}: holds a scalar; a table needs at least one axis")
        self.shape = shape
        self._file_dtype = npd
        self._fortran = fortran
        self._offset = offset
        need = offset + math.prod(shape) * npd.itemsize
        size = st.st_size
        if size < need:
            raise GadgetFileError(
                f"{self.path} is truncated: its header promises {shape} {npd} "
                f"({need} bytes with the header) but the file has {size} bytes"
            )
        self.chunk_rows = max(1, NPY_BLOCK_BYTES // max(1, self.row_nbytes))
        self._f: io.FileIO | None = None

    def _file(self) -> io.FileIO:
        if self._f is None or self._f.closed:
            mode = "r+b" if self._mode == "r+" else "rb"
            try:
                self._f = open(self.path, mode, buffering=0)  # noqa: SIM115
            except OSError as exc:  # (e.g. made read-only or removed since it was opened)
                what = "for writing" if mode == "r+b" else "for reading"
                raise GadgetFileError(
                    f"{self.path}: cannot open it {what} ({exc.strerror or exc})"
                ) from exc
            # closed quietly at exit too (a table still open then warned of an unclosed file)
            weakref.finalize(self, self._f.close)
            try:
                self._check_ident(self._f.fileno())
            except GadgetFileError:
                self._f.close()
                raise
        return self._f

    def _check_ident(self, fd: int) -> None:
        """Raise unless ``fd`` is the file this source parsed: a save that replaced the
        file after that (and after the table's check at the start of this call) must
        never have the new file's rows read."""
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._ident:
            raise GadgetFileError(
                f"{self.path} was replaced on disk by another file since this table "
                "opened it; open it again to read the new file"
            )

    def _map(self) -> np.memmap:
        """A read-only map of the file this source parsed. The map holds its own
        descriptor: none other is kept open for it (only :meth:`_file`'s, if open)."""
        if self._f is not None and not self._f.closed:
            fd = os.dup(self._f.fileno())
        else:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self._check_ident(fd)
            except BaseException:
                os.close(fd)
                raise
        with os.fdopen(fd, "rb") as fh:
            return np.memmap(
                fh,
                dtype=self._file_dtype,
                mode="r",
                offset=self._offset,
                shape=self.shape,
                order="F" if self._fortran else "C",
            )

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        if self._fortran or self._file_dtype.byteorder == ">":
            # a map at the header's offset: no second header parse (see _HEADER_LOCK)
            out[...] = self._map()[start:stop]
            return
        f = self._file()
        f.seek(self._offset + start * self.row_nbytes)
        view = out.reshape(-1).view(np.uint8).data
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise GadgetFileError(
                    f"{self.path}: unexpected end of file (truncated while reading)"
                )
            done += n

    def memmap(self) -> np.ndarray | None:
        """A read-only memory map of the rows (None for Fortran-ordered files)."""
        if self._fortran:
            return None
        try:
            return self._map()
        except GadgetFileError:
            raise
        except (ValueError, OSError) as exc:  # shorter than its header says since it was opened
            if getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE):
                raise GadgetFileError(
                    f"{self.path}: cannot map its rows: too many open files ({exc}); close "
                    "tables no longer used, or raise the limit (ulimit -n)"
                ) from exc
            raise GadgetFileError(
                f"{self.path}: cannot map its rows {self.shape} {self._file_dtype} ({exc}); "
                "was the file truncated or replaced?"
            ) from exc

    def writes_in_place(self) -> bool:
        """A Fortran-ordered file's rows are not contiguous: it is never written in place."""
        return not self._fortran

    def read_only_reason(self) -> str | None:
        if self._fortran:
            return (
                f"{self.path} is a Fortran-ordered .npy, which cannot be written in place (its "
                "rows are not contiguous); save it again in C order with "
                "DataGadget(path).save(path) to write it"
            )
        return None

    def write_rows(self, start: int, rows: np.ndarray) -> None:
        reason = self.read_only_reason()
        if reason is not None:
            raise ReadOnlyError(reason)
        # in the file's byte order (a big-endian file gets big-endian rows)
        data = np.ascontiguousarray(rows, dtype=self._file_dtype)
        f = self._file()
        f.seek(self._offset + start * self.row_nbytes)
        view = memoryview(data.reshape(-1).view(np.uint8))
        done = 0
        # an unbuffered write may be short (a full disk): write on until every byte is in,
        # and fail loudly where the file takes no more
        while done < len(view):
            try:
                n = f.write(view[done:])
            except OSError as exc:
                raise GadgetFileError(
                    f"could not write rows {start}..{start + len(data) - 1} to {self.path}: {exc} "
                    f"({done} of {len(view)} bytes written; the rows before them may be partly "
                    "written)"
                ) from exc
            if not n:
                raise GadgetFileError(
                    f"could not write rows {start}..{start + len(data) - 1} to {self.path}: the "
                    f"file took {done} of {len(view)} bytes (is the disk full?)"
                )
            done += n

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_f"] = None
        return state


class NpySink(ArraySink):
    """Writes a .npy file beside ``path`` and renames it into place on :meth:`commit`."""

    format = "npy"

    def __init__(
        self, path: str | os.PathLike[str], shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        if dtype == torch.bfloat16:
            raise GadgetTypeError(
                f"{os.fspath(path)}: NumPy has no bfloat16 dtype, so a bfloat16 table has no "
                ".npy form; save it to "
                "HDF5 or zarr (bit-exact), or save a float32 copy, e.g. "
                "DataGadget(table.as_tensor().float(), placement='cpu').save(path)"
            )
        self.path = Path(path)
        self.shape = check_sink_target(self.path, shape)
        self.dtype = dtype
        self._npd = numpy_dtype(dtype)
        check_free_space(self.path, math.prod(self.shape) * self._npd.itemsize)
        self._tmp = temp_path_beside(self.path)
        self._f: BinaryIO | None = open(self._tmp, "wb")  # noqa: SIM115
        header = {
            "descr": np.lib.format.dtype_to_descr(self._npd),
            "fortran_order": False,
            "shape": self.shape,
        }
        try:
            with save_errors(self.path, "write the header"):
                try:
                    np.lib.format.write_array_header_1_0(self._f, header)
                except ValueError:
                    np.lib.format.write_array_header_2_0(self._f, header)
                self._offset = self._f.tell()
        except BaseException:
            self.abort()  # no hidden partial file after a failed or interrupted header
            raise
        self._row_nbytes = math.prod(self.shape[1:]) * self._npd.itemsize

    def write(self, start: int, rows: np.ndarray) -> None:
        assert self._f is not None
        self._accept(start, rows)
        block = np.ascontiguousarray(rows, dtype=self._npd)  # (another dtype: converted)
        with save_errors(self.path, f"write rows {start}:{start + block.shape[0]}"):
            self._f.seek(self._offset + start * self._row_nbytes)
            self._f.write(block.reshape(-1).view(np.uint8).data)

    def commit(self) -> None:
        assert self._f is not None
        self._require_complete()
        total = self._offset + self.shape[0] * self._row_nbytes
        with save_errors(self.path, "finish the file"):
            self._f.truncate(total)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        self._f = None
        replace_atomically(self._tmp, self.path)

    def abort(self) -> None:
        f, self._f = self._f, None
        try:
            if f is not None:
                # closing flushes what is buffered, which fails again on a full disk: the
                # partial file is removed whatever the close says
                with contextlib.suppress(OSError):
                    f.close()
        finally:
            remove_path(self._tmp)


def describe(path: str) -> str:
    src = NpySource(path)
    return f"{path}: .npy {src.shape} {dtype_name(src.dtype)}"
