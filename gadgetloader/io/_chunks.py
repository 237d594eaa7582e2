"""Helpers shared by the chunked formats (HDF5, zarr): chunk sizes, aligned writes, fsync,
and a thread pool that reads and decodes many chunks at once.

Streams hand a sink blocks whose size is set by the staging buffer, not by the
file's chunking. Writing such a block straight into a chunked file would split
chunks between two calls, and both HDF5 and zarr then read, decode, merge and
re-encode the split chunk. :class:`ChunkAligner` keeps the tail of a block (less
than one chunk) until the next block completes it, so every chunk of a
sequential save is written exactly once, whole.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._dtypes import as_torch_dtype
from .._errors import (
    GadgetError,
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetKeyError,
    GadgetTypeError,
    GadgetValueError,
    ReadOnlyError,
)
from ._atomic import resolved_target

__all__ = [
    "CHUNK_BYTES",
    "ChunkAligner",
    "as_bits",
    "check_compression",
    "check_dataset_name",
    "check_free_space",
    "check_sink_target",
    "table_dtype",
    "default_chunk_rows",
    "for_each_chunk",
    "fsync_tree",
    "thread_pool",
]

#: default bytes per chunk for new HDF5 / zarr files (HDF5's own advice: 10 KiB - 1 MiB)
CHUNK_BYTES = 1 << 20


#: the signed integer of each wide unsigned one's size: the bits a uint16/32/64 file is read
#: as when it is converted on the way into a table (see ``wide_unsigned``)
CARRIERS: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def unsigned_carrier(npd: np.dtype, wide_unsigned: bool) -> torch.dtype | None:
    """With ``wide_unsigned``, the same-size signed dtype a uint16/32/64 array is read as
    (its bits, not its values; the reader converts them); else None."""
    if wide_unsigned and npd.kind == "u" and npd.itemsize in CARRIERS:
        return CARRIERS[npd.itemsize]
    return None


def table_dtype(
    npd: np.dtype, marked_bfloat16: bool, where: str, wide_unsigned: bool = False
) -> torch.dtype:
    """The table dtype of a stored array (``marked_bfloat16``: its dtype attribute says
    the uint16 values are bfloat16 bits; ``wide_unsigned``: see :func:`unsigned_carrier`).

    Raises
    ------
    GadgetTypeError
        Strings, objects, structured or other dtypes a table cannot hold.
    """
    if marked_bfloat16:
        if npd.itemsize != 2 or npd.kind not in "iu":
            raise GadgetTypeError(
                f"{where}: marked bfloat16 but stored as {npd}; expected uint16 bits"
            )
        return torch.bfloat16
    if npd.subdtype is not None and npd.fields is None:
        base, inner = npd.subdtype
        raise GadgetTypeError(
            f"{where}: dtype {npd} is an array type (each element holds {inner} values of "
            f"{base}); a table's elements are single numbers: store it as a plain {base} "
            f"array with the inner shape as extra axes"
        )
    if npd.hasobject or npd.kind in "OSUVMmT" or npd.fields is not None:
        raise GadgetTypeError(
            f"{where}: dtype {npd} (strings, objects, structured or variable-length types) "
            "cannot be a table; expected a numeric or bool dtype"
        )
    carrier = unsigned_carrier(npd, wide_unsigned)
    if carrier is not None:
        return carrier
    try:
        return as_torch_dtype(npd)
    except GadgetTypeError as exc:
        raise GadgetTypeError(f"{where}: {exc}") from exc


def as_bits(arr: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """bfloat16 rows arrive as int16 or uint16 bits; files hold uint16 (reinterpret, never convert)."""
    if dtype == torch.bfloat16 and arr.dtype != np.uint16:
        return arr.view(np.uint16)
    return arr


def check_sink_target(path: Path, shape: tuple[int, ...], store: str = "file") -> tuple[int, ...]:
    """Check that a table of ``shape`` can be written at ``path``; the shape as ints.

    ``store``: ``'file'`` (.npy, HDF5: ``path`` may be an existing file, never a
    directory) or ``'zarr'`` (``path`` may be an existing zarr store or an empty
    directory, nothing else): a
    save replaces what is there, and must never replace a user's directory or file of
    another kind.
    """
    if len(shape) and int(shape[0]) == 0:
        # a file with no rows is refused when opened (nothing to load), so none is written
        raise GadgetValueError(
            f"cannot save {path}: the table has zero rows {tuple(shape)}, and a zero-row file "
            "cannot be loaded back"
        )
    name = os.path.basename(os.path.normpath(path))
    if name in ("", ".", ".."):
        raise GadgetValueError(
            f"cannot save to {path}: a save needs a file (or zarr store) name, not a folder "
            "reached by '.' or '..'"
        )
    try:
        limit = int(os.pathconf(path.parent if str(path.parent) else ".", "PC_NAME_MAX"))
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(name)) > limit:
        raise GadgetFileError(
            f"cannot save to {path}: its name is {len(os.fsencode(name))} bytes long; the file "
            f"system takes names of at most {limit} bytes"
        )
    if not path.parent.exists():
        raise GadgetFileNotFoundError(
            f"directory {path.parent} does not exist (saving {path})", path.parent
        )
    # a save writes a temporary file beside the target (the file a link names) and renames
    # it over the target
    folder = resolved_target(path).parent
    if not folder.is_dir():  # a link into a folder that does not exist
        if folder.exists():
            raise GadgetFileError(f"cannot save {path}: {folder} is not a directory")
        raise GadgetFileNotFoundError(f"directory {folder} does not exist (saving {path})", folder)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ReadOnlyError(
            f"cannot save {path}: the directory {folder} is not writable (a save writes "
            "a new file there and renames it over the target)"
        )
    if store == "file" and path.exists() and not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        raise GadgetFileError(
            f"cannot save to {path}: it is {what}, and a save replaces what is at its "
            "path; remove it or choose another name"
        )
    if store == "zarr" and (path.exists() or path.is_symlink()):
        from ._zarr import is_zarr

        if not (path.is_dir() and (is_zarr(path) or not any(path.iterdir()))):
            raise GadgetFileError(
                f"cannot save to {path}: it exists and is not a zarr store, and a save "
                "replaces what is at its path; remove it or choose another name"
            )
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise GadgetValueError(f"{path}: a table needs at least one axis; got shape ()")
    return shape


#: bytes a new file may need beyond what its format's sink counts (headers, metadata)
SPACE_SLACK_BYTES = 16 << 10


def check_free_space(path: Path, need: int) -> None:
    """Refuse a save of an uncompressed table that cannot fit beside ``path``.

    The new file is written beside the target (the old one stays until the rename), so
    ``need`` bytes plus :data:`SPACE_SLACK_BYTES` must be free in its folder. Checked
    before anything is created: HDF5 can crash the process (upstream) while closing a
    file whose writes failed for want of space. A folder whose free space cannot be
    read is not checked.

    Raises
    ------
    GadgetFileError
        Not enough free space.
    """
    folder = resolved_target(path).parent
    try:
        free = shutil.disk_usage(folder).free
    except (OSError, ValueError):
        return
    total = int(need) + SPACE_SLACK_BYTES
    if free < total:
        raise GadgetFileError(
            f"cannot save {path}: not enough space: need {total} bytes, {free} free on "
            f"{folder}; free some space or save elsewhere"
        )


def check_dataset_name(dataset: str | None, fmt: str, path: object) -> str | None:
    """A dataset / array name for a new file, without empty parts (``'/a//b/'`` is ``'a/b'``).

    Raises
    ------
    GadgetTypeError
        Not a string.
    GadgetValueError
        A name with ``.`` or ``..`` parts (``'..'``, ``'a/../x'``), or none: it must name
        an array below the file's root. Also a name with a backslash or a NUL character, text
        that is not UTF-8, or a part named as a zarr metadata file (``zarr.json``,
        ``.zarray``...): the formats would store another name or break the group.
    """
    if dataset is None:
        return None
    if not isinstance(dataset, str):
        raise GadgetTypeError(f"dataset must be a string (a name inside the file); got {dataset!r}")
    parts = [part for part in dataset.split("/") if part]
    try:
        dataset.encode("utf-8")
        encodable = True
    except UnicodeEncodeError:
        encodable = False
    if (
        not parts
        or not encodable
        or any(part in (".", "..") or part.lower() in _METADATA_NAMES for part in parts)
        or any(c in dataset for c in "\\\0")
    ):
        raise GadgetValueError(
            f"dataset {dataset!r} is not a valid {fmt} array name for {path}: expected names "
            "joined by '/' below the root (e.g. 'data' or 'group/emb'), without '.' or '..' "
            "parts, backslashes, NUL characters, text that is not UTF-8, or a part named as a "
            f"zarr metadata file ({', '.join(sorted(_METADATA_NAMES))})"
        )
    return "/".join(parts)


#: file names a zarr store keeps its metadata in: an array or group so named would take
#: the place of its parent's metadata
_METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


def default_chunk_rows(row_nbytes: int, num_rows: int, chunk_rows: int | None = None) -> int:
    """Rows per chunk: ``chunk_rows`` if given, else about :data:`CHUNK_BYTES` of rows.

    Raises
    ------
    GadgetValueError
        ``chunk_rows`` is not a positive integer.
    """
    if chunk_rows is not None:
        if (
            isinstance(chunk_rows, bool)
            or not isinstance(chunk_rows, (int, np.integer))
            or chunk_rows < 1
        ):
            raise GadgetValueError(f"chunk_rows must be a positive integer; got {chunk_rows!r}")
        rows = int(chunk_rows)
    else:
        rows = max(1, CHUNK_BYTES // max(1, row_nbytes))
    return max(1, min(rows, max(1, num_rows)))


def check_compression(
    compression: str | None, valid: tuple[str, ...], fmt: str, path: object
) -> str | None:
    """Normalise a compression name (``None`` / ``'none'`` mean no compression).

    Raises
    ------
    GadgetKeyError
        A name that ``fmt`` does not support; the message lists the valid ones.
    """
    if compression is None:
        return None
    name = str(compression).lower()
    if name in ("none", ""):
        return None
    if name not in valid:
        raise GadgetKeyError(
            f"Unknown {fmt} compression {compression!r} for {path}; expected one of "
            f"{[*valid, 'none']}"
        )
    return name


#: accepted ``compression_level`` range per compressor
_LEVELS = {"gzip": (0, 9), "zstd": (-131072, 22), "blosc": (0, 9)}


def check_level(
    compression: str | None,
    level: Any,
    fmt: str,
    path: object,
    compressions: tuple[str, ...] = tuple(_LEVELS),
) -> int | None:
    """``compression_level`` as an int in the compressor's range (None: its default).
    ``compressions``: those the format takes (named in the message for a compressor without
    levels).

    Raises
    ------
    GadgetValueError
        A level for a compressor without levels (``lzf``, none), a non-integer, or a
        value outside the compressor's range.
    """
    if level is None:
        return None
    if compression not in _LEVELS:
        raise GadgetValueError(
            f"compression_level={level!r} for {path}: {fmt} compression "
            f"{compression or 'none'!r} takes no level (levels apply to "
            f"{sorted(k for k in _LEVELS if k in compressions)})"
        )
    lo, hi = _LEVELS[compression]
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or not lo <= level <= hi:
        raise GadgetValueError(
            f"compression_level for {compression} must be an integer in [{lo}, {hi}]; "
            f"got {level!r} (saving {path})"
        )
    return int(level)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file and directory under ``path`` (a zarr store) and ``path`` itself."""
    root = Path(path)
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        try:
            fd = os.open(dirpath, os.O_RDONLY)
        except OSError:  # pragma: no cover - platforms without directory fds
            continue
        try:
            os.fsync(fd)
        except OSError:  # pragma: no cover
            pass
        finally:
            os.close(fd)


class ChunkAligner:
    """Turns a stream of row blocks into writes of whole chunks.

    Parameters
    ----------
    write : callable ``(start, rows) -> None``
        Writes rows into the file (the format's raw write).
    num_rows, chunk_rows : int
        The array's length and its chunk length along the rows.
    row_shape : tuple of int
    dtype : numpy.dtype

    Notes
    -----
    Holds at most one chunk of rows. Blocks that do not continue the previous one
    flush what is held first, so any write order stays correct; only sequential
    streams (every save and convert) avoid partial-chunk writes.
    """

    def __init__(
        self,
        write: Callable[[int, np.ndarray], None],
        num_rows: int,
        chunk_rows: int,
        row_shape: tuple[int, ...],
        dtype: np.dtype,
    ) -> None:
        self._write = write
        self._n = int(num_rows)
        self._c = max(1, int(chunk_rows))
        self._buf = np.empty((min(self._c, max(1, self._n)), *row_shape), dtype=dtype)
        self._p0 = 0  # first row held
        self._pn = 0  # rows held

    def _boundary(self, row: int) -> int:
        """The end of the chunk holding ``row``."""
        return min(self._n, (row // self._c + 1) * self._c)

    def flush(self) -> None:
        """Write what is held (possibly a partial chunk)."""
        if self._pn:
            self._write(self._p0, self._buf[: self._pn])
            self._pn = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        """Accept rows ``start : start + len(rows)``."""
        n = int(rows.shape[0])
        if n == 0:
            return
        if self._pn and start != self._p0 + self._pn:
            self.flush()
        cur, pos = int(start), 0
        if self._pn:
            end = self._p0 + self._pn
            take = min(n, self._boundary(self._p0) - end)
            self._buf[self._pn : self._pn + take] = rows[:take]
            self._pn += take
            cur, pos = cur + take, take
            if self._p0 + self._pn == self._boundary(self._p0):
                self.flush()
            if pos == n:
                return
        # an unaligned head (only after a non-sequential write): up to the next boundary
        if cur % self._c:
            take = min(n - pos, self._boundary(cur) - cur)
            self._write(cur, rows[pos : pos + take])
            cur, pos = cur + take, pos + take
            if pos == n:
                return
        left = n - pos
        full = left if cur + left == self._n else (left // self._c) * self._c
        if full:
            self._write(cur, rows[pos : pos + full])
            cur, pos = cur + full, pos + full
        if pos < n:
            self._p0, self._pn = cur, n - pos
            self._buf[: self._pn] = rows[pos:]


_pool: list[Any] = [None, 0]  # executor, pid
#: spread chunk reads over threads only when a call moves at least this many bytes
_PARALLEL_BYTES = 1 << 20
#: threads for chunks of up to 256 KiB (see :func:`_concurrency`)
_SMALL_CHUNK_THREADS = 3


def _workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def thread_pool() -> ThreadPoolExecutor:
    """A process-wide pool for chunk reads and decodes (recreated after a fork)."""
    if _pool[0] is None or _pool[1] != os.getpid():  # threads do not survive a fork
        _pool[0] = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="gadgetloader-io")
        _pool[1] = os.getpid()
    return _pool[0]  # type: ignore[no-any-return]


def _concurrency(chunk_nbytes: int) -> int:
    """Threads worth running at once on chunks of this size.

    Each chunk costs some Python work under the GIL (a few tens of microseconds:
    open, read, decode calls) beside the work that releases it. For small chunks
    that shared part dominates and more threads only queue on the GIL: on a 16-core
    host, random reads of 32 KiB zstd chunks took 121 ms with 3 threads and 238 ms with
    16. Large chunks (decoding ~1 MiB each) use the whole pool.
    """
    return max(1, min(_workers(), max(_SMALL_CHUNK_THREADS, chunk_nbytes // (64 << 10))))


def for_each_chunk(
    fn: Callable[[int, int], None],
    chunks: Sequence[int],
    slots: Sequence[int],
    chunk_nbytes: int = 0,
) -> None:
    """Call ``fn(chunk, slot)`` for every pair, on the thread pool when the call is large.

    File reads (``os.read``, ``preadv``) and numcodecs decoders release the GIL,
    so several chunks are read and decoded at once on multi-core hosts. The chunks
    are cut into groups (about four per thread, to keep the per-task overhead small
    next to the work) that a few threads (:func:`_concurrency`) take in turn.
    """
    n = len(chunks)
    workers = _concurrency(chunk_nbytes)
    if n < 2 or workers < 2 or n * chunk_nbytes < _PARALLEL_BYTES:
        for k, s in zip(chunks, slots, strict=True):
            fn(k, s)
        return
    step = max(1, min(64, -(-n // (4 * workers))))
    starts = iter(range(0, n, step))  # shared: next() on it is atomic under the GIL
    lock = threading.Lock()
    stop = threading.Event()  # a task failed, or the caller was interrupted

    def task() -> None:
        while not stop.is_set():
            with lock:
                i = next(starts, None)
            if i is None:
                return
            try:
                for k, s in zip(chunks[i : i + step], slots[i : i + step], strict=True):
                    fn(k, s)
            except BaseException:
                stop.set()  # the others take no more groups
                raise

    pool = thread_pool()
    futures = [pool.submit(task) for _ in range(min(workers, -(-n // step)))]
    # Every task has ended before this returns or raises: a failed call must not leave
    # threads writing into the caller's buffers (which it may free or reuse) or reading
    # a descriptor the caller closes. A failed task stops the others at their next group.
    try:
        concurrent.futures.wait(futures)
    except BaseException:  # (an interrupt while waiting)
        stop.set()
        concurrent.futures.wait(futures)
        raise
    for f in futures:
        f.result()


@contextlib.contextmanager
def save_errors(
    path: object, what: str, also: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """A sink's failure while it writes its partial file (a full disk, a file size limit:
    an ``OSError``, or one of ``also``) as a :class:`GadgetFileError` naming the target,
    ``"cannot save PATH: cannot WHAT (...)"``; the library's own errors pass as they are."""
    caught: tuple[type[BaseException], ...] = (OSError, *also)
    try:
        yield
    except GadgetError:
        raise
    except caught as exc:
        raise GadgetFileError(f"cannot save {path}: cannot {what} ({exc})") from exc
