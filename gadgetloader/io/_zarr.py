"""The zarr format (zarr>=3, optional): directory stores, v3 and v2 arrays, atomic chunked writes.

Reads go through whole chunks. Where an array's chunks span whole rows and its
codecs are the common ones (bytes in native order, then zstd / gzip / blosc or
nothing; v2: one numcodecs compressor, no filters), a chunk is read here
directly: its file is read and decoded with numcodecs straight into the caller's
buffer, skipping zarr's per-call machinery (about 10x less overhead per chunk,
which is what random-row reads from a file-backed store pay). Several chunks are
decoded by a small thread pool. Other arrays (sharded, transposed, checksummed,
remote) are read with zarr's ``get_basic_selection(out=...)``.

bfloat16 is stored as uint16 bits with the attribute
``gadgetloader_dtype = "bfloat16"``, so round trips are bit-exact.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import stat
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._dtypes import dtype_name, numpy_dtype
from .._errors import (
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetKeyError,
    GadgetValueError,
    MissingDependencyError,
    ReadOnlyError,
)
from ._atomic import remove_path, replace_atomically, temp_path_beside
from ._base import ArraySink, ArraySource
from ._chunks import (
    ChunkAligner,
    as_bits,
    check_compression,
    check_dataset_name,
    check_level,
    check_sink_target,
    default_chunk_rows,
    for_each_chunk,
    fsync_tree,
    save_errors,
    table_dtype,
    unsigned_carrier,
)

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["DTYPE_ATTR", "ZarrSink", "ZarrSource", "import_zarr", "is_zarr"]

#: array attribute naming the torch dtype when the stored type cannot (bfloat16)
DTYPE_ATTR = "gadgetloader_dtype"
_MARKERS = ("zarr.json", ".zarray", ".zgroup")
_COMPRESSIONS = ("zstd", "gzip", "blosc")
#: bytes read beyond a chunk's decoded size in the first read of a compressed chunk
_SLACK = 4096
#: a compressed chunk file larger than this many times its read buffer is refused as damaged
_MAX_EXPANSION = 4
#: seconds between the warnings of a failed read or write still waiting for zarr's other
#: chunk tasks (it waits until they end)
_DRAIN_S = 60.0


def import_zarr() -> ModuleType:
    """Import zarr (>= 3) or raise :class:`MissingDependencyError` naming the pip extra."""
    try:
        import zarr
    except ImportError as exc:
        raise MissingDependencyError(
            "zarr stores need the optional 'zarr>=3' package, which is not installed; "
            "install it with pip install 'gadgetloader[zarr]' (from a checkout: pip install -e "
            "'.[zarr]'; or pip install 'zarr>=3')"
        ) from exc
    if int(str(zarr.__version__).split(".")[0]) < 3:
        raise MissingDependencyError(
            f"zarr stores need 'zarr>=3' but zarr {zarr.__version__} is installed; "
            "upgrade with pip install 'gadgetloader[zarr]' (from a checkout: pip install -e "
            "'.[zarr]'; or pip install -U 'zarr>=3')"
        )
    return zarr


def is_zarr(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding zarr.json (v3) or .zarray / .zgroup (v2)."""
    p = Path(path)
    return p.is_dir() and any((p / m).is_file() for m in _MARKERS)


def _numcodecs_decoder(codec: Any) -> Any | None:
    """A numcodecs object decoding a zarr v3 bytes-to-bytes codec, or None."""
    import numcodecs

    name = codec.to_dict().get("name")
    if name == "zstd":
        return numcodecs.Zstd()
    if name == "gzip":
        return numcodecs.GZip()
    if name == "blosc":
        return numcodecs.Blosc()
    return None


def _declared_size(decoder: Any, data: Any) -> int | None:
    """The decoded size a chunk's compressed frame declares in its header, for codecs that
    check their output against it (Zstd, LZ4, Blosc), else None.

    Decoding into the chunk's place (``out=``) is safe only where the codec would notice
    a frame that decodes to fewer bytes than the place holds; numcodecs checks too many
    bytes but leaves a short frame's tail as it was (GZip and others). Raises
    ``ValueError`` for a Blosc frame whose header gives a greater length than the file's
    (blosc would read past the end of a truncated frame)."""
    import numcodecs

    head = bytes(memoryview(data)[:18])
    if isinstance(decoder, numcodecs.Blosc):
        if len(head) < 16:  # (blosc would read a header from beyond the bytes given)
            raise ValueError(f"blosc frame of {len(head)} bytes; a header alone takes 16")
        cbytes = int.from_bytes(head[12:16], "little")
        if cbytes > memoryview(data).nbytes:  # (bytes after the frame are left, as zarr does)
            raise ValueError(
                f"blosc frame of {memoryview(data).nbytes} bytes; its header says {cbytes}"
            )
        return int.from_bytes(head[4:8], "little")
    if isinstance(decoder, numcodecs.LZ4):  # numcodecs' LZ4: the size, then one block
        return int.from_bytes(head[:4], "little") if len(head) >= 4 else None
    if isinstance(decoder, numcodecs.Zstd):  # a frame header's Frame_Content_Size
        if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":
            return None
        fhd = head[4]
        single = (fhd >> 5) & 1
        pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
        width = ((1 if single else 0), 2, 4, 8)[fhd >> 6]
        if not width or len(head) < pos + width:
            return None
        size = int.from_bytes(head[pos : pos + width], "little")
        return size + 256 if width == 2 else size
    return None


#: zarr v3 codecs that store what they are given (sharding: if its inner codecs do)
_LOSSLESS_V3 = {"bytes", "transpose", "zstd", "gzip", "blosc", "crc32c", "sharding_indexed"}
#: zarr v2 compressors that do, and filters that do
_LOSSLESS_V2 = {"zstd", "gzip", "zlib", "blosc", "lz4", "bz2", "lzma"}
_LOSSLESS_V2_FILTERS = {"shuffle"}


def _codec_names(spec: Any) -> list[str]:
    """The names of the codecs in a zarr v3 codec description (nested ones included)."""
    if isinstance(spec, dict):
        found = [str(spec["name"])] if "name" in spec else []
        for value in (spec.get("configuration") or {}).values():
            if isinstance(value, (list, tuple)):
                for inner in value:
                    found += _codec_names(inner)
        return found
    return []


def _exact_codecs(arr: Any) -> bool:
    """Whether every codec of zarr array ``arr`` stores rows exactly (see
    :attr:`~gadgetloader.io._base.ArraySource.exact_writes`)."""
    try:
        meta = arr.metadata
        if meta.zarr_format == 3:
            names = [n for c in meta.codecs for n in _codec_names(c.to_dict())]
            return all(n in _LOSSLESS_V3 for n in names)
        filters = [f.get_config().get("id") for f in (meta.filters or ())]
        comp = meta.compressor
        return all(f in _LOSSLESS_V2_FILTERS for f in filters) and (
            comp is None or comp.get_config().get("id") in _LOSSLESS_V2
        )
    except Exception:  # (metadata of a kind not known here: assume the worst)
        return False


#: per-thread scratch for compressed chunk bytes (reused: no allocation per chunk)
_SCRATCH = threading.local()
#: larger chunks get a fresh buffer each time instead of a kept one
_SCRATCH_MAX = 16 << 20


def _read_compressed(fd: int, cap: int) -> Any:
    """A chunk file's bytes: read into this thread's scratch buffer when they fit.

    Reusing one buffer per thread keeps the allocator out of the loop: a fresh
    megabyte per chunk makes glibc grow and trim its heaps (``mprotect`` / ``munmap``),
    and each of those waits for the process's memory-map lock -- held for seconds while
    a pinned store is being page-locked during a load.
    """
    kept: bytearray | None = getattr(_SCRATCH, "buf", None)
    if cap > _SCRATCH_MAX:
        buf = bytearray(cap)
    elif kept is None or len(kept) < cap:
        buf = _SCRATCH.buf = bytearray(cap)
    else:
        buf = kept
    n = os.readv(fd, [buf])
    if n < len(buf):
        return memoryview(buf)[:n]
    # more than expected (an incompressible chunk): read the rest, up to a bound no codec's
    # output comes near (a huge or endless file is damage, not a chunk)
    # (this thread's kept buffer may be larger than ``cap``: then so is what was read)
    limit = _MAX_EXPANSION * cap
    parts, got = [bytes(buf)], len(buf)
    while got <= limit and (more := os.read(fd, min(1 << 20, limit + 1 - got))):
        parts.append(more)
        got += len(more)
    if got > limit:
        raise ValueError(f"the file holds more than {limit} bytes")
    return b"".join(parts)


class ZarrSource(ArraySource):
    """Rows of a zarr array in a directory store (zarr v3, or v2 arrays that zarr 3 opens).

    Parameters
    ----------
    path : str or path
        The store's directory.
    dataset : str, optional
        Path of the array inside a group. Optional when the store is an array, or a
        group holding exactly one array.
    mode : {'r', 'r+'}, default 'r'
        ``'r+'`` allows :meth:`write_rows` (write-through from a file-backed store).

    Raises
    ------
    GadgetFileNotFoundError
        The path does not exist.
    GadgetFileError
        The path is not a zarr store (no zarr.json / .zarray / .zgroup).
    GadgetKeyError
        ``dataset`` is not in the store (the message lists the arrays there).
    GadgetTypeError
        The array's dtype cannot be a table.
    MissingDependencyError
        zarr (>= 3) is not installed.
    """

    format = "zarr"
    supports_writes = True
    chunked = True
    #: ``read_into`` may run in several threads at once (each chunk is its own file)
    concurrent_reads = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dataset: str | None = None,
        mode: str = "r",
        wide_unsigned: bool = False,
    ) -> None:
        zarr = import_zarr()
        self.path = os.fspath(path)
        if mode not in ("r", "r+"):
            raise GadgetValueError(f"mode must be 'r' or 'r+'; got {mode!r}")
        if not os.path.exists(self.path):
            raise GadgetFileNotFoundError(f"no such zarr store: {self.path}", self.path)
        if not is_zarr(self.path):
            kind = "a directory" if os.path.isdir(self.path) else "a file"
            raise GadgetFileError(
                f"{self.path} is not a zarr array or group: it is {kind} without zarr.json "
                "(zarr v3) or .zarray / .zgroup (zarr v2)"
            )
        self._mode = mode
        node = self._open_node(zarr, "")
        if isinstance(node, zarr.Group):
            arr = None
            if dataset is not None and dataset.strip("/"):
                # the array asked for is opened by itself: damage elsewhere in the group
                # (another array's metadata) does not stop it
                dataset = dataset.strip("/")
                # (by its own metadata: a group's consolidated metadata may be out of date)
                with contextlib.suppress(Exception):
                    found = self._open_node(zarr, dataset)
                    if isinstance(found, zarr.Array):
                        arr = found
            if arr is None:
                arrays = self._group_arrays(zarr, node)
                if dataset is None:
                    if not arrays:
                        raise GadgetKeyError(
                            f"{self.path} is a zarr group holding no arrays: there is no table "
                            "in it to open"
                        )
                    if len(arrays) != 1:
                        raise GadgetKeyError(
                            f"{self.path} is a zarr group holding {len(arrays)} arrays: "
                            f"{arrays}; pass dataset= to choose one"
                        )
                    dataset = arrays[0]
                dataset = dataset.strip("/")
                if dataset not in arrays:
                    raise GadgetKeyError(
                        f"{self.path} has no zarr array {dataset!r}; arrays in the store: {arrays}"
                    )
                arr = node[dataset]
                with contextlib.suppress(Exception):  # its own metadata, as above
                    found = self._open_node(zarr, str(arr.path).strip("/") or dataset)
                    if isinstance(found, zarr.Array):
                        arr = found
            # zarr normalises the name it was given (``'g\\x'`` is ``'g/x'``); the chunk files
            # are found under the array's own path
            dataset = str(arr.path).strip("/") or dataset
        else:
            if dataset not in (None, "", "/"):
                raise GadgetKeyError(
                    f"{self.path} is a single zarr array, not a group; it has no array {dataset!r} "
                    "(omit dataset=)"
                )
            dataset = ""
            arr = node
        self.dataset = dataset
        #: the array's own folder: one array has one identity however it was named
        #: (``"s.zarr"`` + ``dataset="g/x"`` or ``"s.zarr/g/x"``), and a save that replaces
        #: it replaces this folder
        folder = os.path.join(self.path, dataset) if dataset else self.path
        self.watch_paths = (folder,)
        #: the array's metadata file: a change in place (``resize``) keeps the folder
        self.meta_paths = tuple(
            p
            for p in (os.path.join(folder, n) for n in ("zarr.json", ".zarray"))
            if os.path.isfile(p)
        )[:1]
        self.identity: tuple[Any, ...] = ("zarr", os.path.realpath(folder))
        where = f"{self.path}[{dataset!r}]" if dataset else self.path
        marked = arr.attrs.get(DTYPE_ATTR) == "bfloat16"
        self.dtype = table_dtype(np.dtype(arr.dtype), marked, where, wide_unsigned)
        #: a uint16/32/64 array opened with ``wide_unsigned`` (see NpySource)
        self.unsigned_bits = (
            np.dtype(arr.dtype).newbyteorder("=")
            if unsigned_carrier(np.dtype(arr.dtype), wide_unsigned) is not None and not marked
            else None
        )
        if len(arr.shape) == 0:
            raise GadgetValueError(f"{where} holds a scalar; a table needs at least one axis")
        self.shape = tuple(int(s) for s in arr.shape)
        self.chunk_rows = int(arr.chunks[0]) if self.shape[0] else 1
        shards = getattr(arr, "shards", None)
        #: rows zarr rewrites whole when one of them is written: a shard, else a chunk
        self._unit_rows = int(shards[0]) if shards and self.shape[0] else self.chunk_rows
        self._arr: Any = arr
        self._key: Any = None
        self._key_pid = 0
        #: (file shape, column coordinates, folder, metadata) for _check_files
        self._units: Any = None
        self._decoders: list[Any] | None = self._plan_direct(arr)
        self.exact_writes = _exact_codecs(arr)
        fill = arr.fill_value
        self._fill = 0 if fill is None else fill

    def _group_arrays(self, zarr: ModuleType, group: Any) -> list[str]:
        """The names of every array under ``group``, or a clear error naming the store."""
        try:
            return sorted(
                name
                for name, member in group.members(max_depth=None)
                if isinstance(member, zarr.Array)
            )
        except Exception as exc:
            raise GadgetFileError(
                f"cannot list the arrays of zarr group {self.path} (is a member's metadata "
                f"damaged?): {type(exc).__name__}: {exc}"
            ) from exc

    def _open_node(self, zarr: ModuleType, path: str) -> Any:
        from zarr.storage import LocalStore

        try:
            store = LocalStore(self.path, read_only=self._mode == "r")
            return zarr.open(store=store, mode="r" if self._mode == "r" else "r+", path=path)
        except Exception as exc:
            raise GadgetFileError(f"cannot open zarr store {self.path}: {exc}") from exc

    def _plan_direct(self, arr: Any) -> list[Any] | None:
        """Decoders (last codec first) for reading chunk files directly, or None."""
        if tuple(arr.chunks[1:]) != self.shape[1:] or not self.shape[0]:
            return None
        meta = arr.metadata
        if getattr(arr, "shards", None) is not None:
            return None
        native = sys.byteorder
        if meta.zarr_format == 3:
            codecs = list(meta.codecs)
            first = codecs[0].to_dict() if codecs else {}
            if first.get("name") != "bytes":
                return None
            endian = (first.get("configuration") or {}).get("endian")
            if endian not in (None, native):
                return None
            decoders = [_numcodecs_decoder(c) for c in codecs[1:]]
            if any(d is None for d in decoders):
                return None
            return decoders[::-1]
        if meta.filters or getattr(meta, "order", "C") != "C":
            return None
        npd = np.dtype(arr.dtype)
        if npd.byteorder not in ("=", "|") and npd.byteorder != {"little": "<", "big": ">"}[native]:
            return None
        return [meta.compressor] if meta.compressor is not None else []

    def _array(self) -> Any:
        if self._arr is None:
            # an array in a group by its own metadata (not the group's consolidated copy)
            self._arr = self._open_node(import_zarr(), self.dataset)
        return self._arr

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arr"] = None  # reopened lazily in the new process
        state["_key"], state["_key_pid"], state["_units"] = None, 0, None
        return state

    # ---- rows -----------------------------------------------------------------------------
    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        out = as_bits(out, self.dtype)
        if stop <= start:
            return
        if self._decoders is None:
            self._read_zarr(start, stop, out)
            return
        c = self.chunk_rows
        ks = list(range(start // c, (stop - 1) // c + 1))

        def one(k: int, _slot: int) -> None:
            lo, hi = max(k * c, start), min((k + 1) * c, stop)
            self._read_chunk(k, lo, hi, out[lo - start : hi - start])

        for_each_chunk(one, ks, ks, c * self.row_nbytes)

    def read_chunks(
        self, chunks: Sequence[int], out: np.ndarray, slots: Sequence[int] | None = None
    ) -> None:
        """Read whole chunks ``chunks[j]`` into ``out[slots[j] * chunk_rows :]`` (many at once).

        The rows of chunk ``k`` are ``k * chunk_rows`` up to the next chunk (or the end).
        """
        out = as_bits(out, self.dtype)
        c = self.chunk_rows
        slots = list(range(len(chunks))) if slots is None else slots
        if self._decoders is None:
            for k, s in zip(chunks, slots, strict=True):
                lo, hi = k * c, min((k + 1) * c, self.num_rows)
                self._read_zarr(lo, hi, out[s * c : s * c + hi - lo])
            return

        def one(k: int, s: int) -> None:
            lo, hi = k * c, min((k + 1) * c, self.num_rows)
            self._read_chunk(k, lo, hi, out[s * c : s * c + hi - lo])

        for_each_chunk(one, chunks, slots, c * self.row_nbytes)

    def _unit_files(
        self, start: int, stop: int, *, with_columns: bool = False
    ) -> Iterator[tuple[int, Any, str]]:
        """(row index of the file, rows per file -- or, ``with_columns``, the file's
        column coordinates --, path) of each file (chunk, or shard) holding rows
        ``start:stop``."""
        if stop <= start:
            return
        if self._units is None:
            meta = self._array().metadata
            grid = meta.chunk_grid.chunk_shape if meta.zarr_format == 3 else meta.chunks
            grid = tuple(int(g) for g in grid)
            cols = [range(-(-n // g)) for n, g in zip(self.shape[1:], grid[1:], strict=True)]
            base = os.path.join(self.path, self.dataset) if self.dataset else self.path
            self._units = (grid, list(itertools.product(*cols)), base, meta)
        grid, cols, base, meta = self._units
        rows = grid[0]
        for r in range(start // rows, (stop - 1) // rows + 1):
            for c in cols:
                path = os.path.join(base, meta.encode_chunk_key((r, *c)))
                yield r, (c if with_columns else rows), path

    def overwrite_rows(self, start: int, rows: np.ndarray) -> None:
        """:meth:`write_rows` for rows whose old values are not needed (an initializer's).

        zarr reads a shard it rewrites, even whole, and :meth:`_check_files` refuses a
        chunk file that is a pipe or device: where a write fails so, the files of each
        write unit (chunk, or shard) the rows cover whole that cannot be read (damaged,
        or not regular files) are removed and the unit written anew, so the damage is
        replaced rather than refused. Files that read are never removed, so a write that
        fails otherwise (a full disk) leaves their old values."""
        try:
            self.write_rows(start, rows)
            return
        except GadgetFileError:
            pass  # find the unit that failed: unit by unit
        stop = start + rows.shape[0]
        unit = self.write_unit_rows
        edges = [start, *range((start // unit + 1) * unit, stop, unit), stop]
        for u0, u1 in zip(edges, edges[1:], strict=False):
            part = rows[u0 - start : u1 - start]
            try:
                self.write_rows(u0, part)
                continue
            except GadgetFileError:
                whole = u0 % unit == 0 and (u1 % unit == 0 or u1 == self.shape[0])
                damaged = self._damaged_files(u0, u1) if whole else []
                if not damaged:
                    raise  # not damage the rows replace: the write's own error
            for path in damaged:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise GadgetFileError(
                        f"{self.path}: cannot remove the damaged file {path} to write it "
                        f"anew ({exc})"
                    ) from exc
            self.write_rows(u0, part)

    def _damaged_files(self, start: int, stop: int) -> list[str]:
        """The files (chunks, or shards) holding rows ``start:stop`` that cannot be read:
        not regular files, empty shards, or files zarr fails to decode."""
        out = []
        sharded = getattr(self._array(), "shards", None) is not None
        for _r, coords, path in self._unit_files(start, stop, with_columns=True):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            except OSError:
                out.append(path)
                continue
            if not stat.S_ISREG(st.st_mode) or (sharded and st.st_size == 0):
                out.append(path)
                continue
            grid = self._units[0]
            sel = (slice(start, stop),) + tuple(
                slice(c * g, min((c + 1) * g, n))
                for c, g, n in zip(coords, grid[1:], self.shape[1:], strict=True)
            )
            try:
                self._array().get_basic_selection(sel)
            except Exception:  # (zarr's decode errors have no common class)
                _drain_zarr_tasks()
                out.append(path)
        return out

    def _check_files(self, start: int, stop: int) -> None:
        """Before zarr itself reads or rewrites rows ``start:stop``: each file it opens
        (chunk, or shard) must be a regular file or missing (zarr would block for ever
        on a named pipe, or read a device without end), and a shard file must not be
        empty (zarr reads an empty shard as the fill value: it is a write cut short)."""
        sharded = getattr(self._array(), "shards", None) is not None
        for r, rows, path in self._unit_files(start, stop):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # not written: zarr reads the fill value
            except OSError as exc:
                raise GadgetFileError(f"{self.path}: cannot read {path} ({exc})") from exc
            span = f"rows {r * rows}:{min((r + 1) * rows, self.shape[0])}"
            if not stat.S_ISREG(st.st_mode):
                raise GadgetFileError(f"{self.path}: {path} ({span}) is not a regular file")
            if sharded and st.st_size == 0:
                raise GadgetFileError(
                    f"{self.path}: shard {path} ({span}) is an empty file (a shard holds at "
                    "least its index): it is damaged or truncated"
                )

    def _read_zarr(self, start: int, stop: int, out: np.ndarray) -> None:
        from zarr.core.buffer import cpu

        self._check_files(start, stop)
        try:
            self._array().get_basic_selection(
                slice(start, stop), out=cpu.NDBuffer.from_numpy_array(out)
            )
        except BaseException as exc:
            # zarr decodes chunk batches as tasks on its event loop and raises at the first
            # failure (or an interrupt) while the others run on, writing into ``out``: the
            # call ends only when they have (the caller may free ``out`` right after)
            _drain_zarr_tasks()
            if not isinstance(exc, Exception):
                raise
            raise GadgetFileError(f"{self.path}: cannot read rows {start}:{stop} ({exc})") from exc

    def _chunk_file(self, k: int) -> str:
        """The path of the file holding chunk ``k`` (chunks span whole rows)."""
        if self._key_pid != os.getpid() or self._key is None:
            meta = self._array().metadata
            zeros = (0,) * (len(self.shape) - 1)
            base = os.path.join(self.path, self.dataset) if self.dataset else self.path
            probe = 987654321
            key = meta.encode_chunk_key((probe, *zeros))
            at = key.find(str(probe))
            template: tuple[str, str] | None = None
            if at >= 0:
                pre = os.path.join(base, key[:at])
                post = key[at + len(str(probe)) :]
                n = -(-self.num_rows // self.chunk_rows)
                if all(
                    os.path.join(base, meta.encode_chunk_key((j, *zeros))) == f"{pre}{j}{post}"
                    for j in {0, 1, 10, max(0, n - 1)}
                ):
                    template = (pre, post)
            self._key, self._key_pid = (template, base, meta), os.getpid()
        template, base, meta = self._key
        if template is not None:
            return f"{template[0]}{k}{template[1]}"  # no zarr call per chunk
        return os.path.join(base, meta.encode_chunk_key((k,) + (0,) * (len(self.shape) - 1)))

    def _read_chunk(self, k: int, lo: int, hi: int, dst: np.ndarray) -> None:
        """Rows ``lo:hi`` (inside chunk ``k``) into ``dst``, straight from the chunk's file.

        Lean on purpose (``os.open`` / ``os.read`` / the decoder, nothing else): many
        threads run this at once and every Python step holds the GIL they share.
        """
        c = self.chunk_rows
        c0 = k * c
        whole = lo == c0 and hi - lo == c
        buf = dst if whole else np.empty((c, *self.shape[1:]), dtype=dst.dtype)
        flat = buf.reshape(-1).view(np.uint8)
        try:
            # (non-blocking: a named pipe in the store reads as empty instead of waiting)
            fd = os.open(self._chunk_file(k), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            dst[...] = self._fill
            return
        except OSError as exc:
            raise GadgetFileError(f"{self.path}: cannot read chunk {k} ({exc})") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a device or pipe would never end
                raise GadgetFileError(
                    f"{self.path}: chunk {k} ({self._chunk_file(k)}) is not a regular file"
                )
            if self._decoders:
                raw = _read_compressed(fd, flat.nbytes + flat.nbytes // 64 + _SLACK)
            else:  # stored raw: read straight into place (one byte more shows a longer file)
                got = os.readv(fd, [flat.data, bytearray(1)])
        except GadgetFileError:
            raise
        except (OSError, ValueError) as exc:
            raise GadgetFileError(f"{self.path}: cannot read chunk {k} ({exc})") from exc
        finally:
            os.close(fd)
        if not self._decoders and got != flat.nbytes:
            raise GadgetFileError(
                f"{self.path}: chunk {k} holds "
                f"{got if got < flat.nbytes else 'more than ' + str(flat.nbytes)} bytes; "
                f"expected {flat.nbytes}"
            )
        if self._decoders:
            try:
                self._decode(raw, buf)
            except Exception as exc:
                raise GadgetFileError(
                    f"{self.path}: chunk {k} is damaged or truncated ({exc})"
                ) from exc
        if not whole:
            dst[...] = buf[lo - c0 : hi - c0]

    def _decode(self, raw: Any, dst: np.ndarray) -> None:
        flat = dst.reshape(-1).view(np.uint8)
        data: Any = raw
        decoders = self._decoders or []
        for i, dec in enumerate(decoders):
            if i == len(decoders) - 1 and _declared_size(dec, data) == flat.nbytes:
                dec.decode(data, out=flat)  # (the codec checks what it wrote: see above)
                return
            data = dec.decode(data)
        got = np.frombuffer(data, dtype=np.uint8)
        if got.nbytes != flat.nbytes:
            raise ValueError(f"it decodes to {got.nbytes} bytes; expected {flat.nbytes}")
        flat[...] = got

    @property
    def write_unit_rows(self) -> int:
        """Rows of a shard (sharded arrays), else of a chunk: zarr rewrites it whole."""
        return getattr(self, "_unit_rows", self.chunk_rows)

    def write_rows(self, start: int, rows: np.ndarray) -> None:
        rows = as_bits(rows, self.dtype)
        if self._mode != "r+":
            raise ReadOnlyError(
                f"{self.path} was opened read-only; open it with mode='r+' to write"
            )
        self._check_files(start, start + rows.shape[0])
        try:
            self._array()[start : start + rows.shape[0]] = rows
        except Exception as exc:
            _drain_zarr_tasks()  # the call ends when its writes do
            raise GadgetFileError(
                f"{self.path}: cannot write rows {start}:{start + rows.shape[0]} ({exc})"
            ) from exc

    def close(self) -> None:
        """Nothing to release: zarr holds no open files between reads."""


class ZarrSink(ArraySink):
    """Writes a chunked, compressed zarr v3 array into a directory beside ``path``, renamed into place.

    Parameters
    ----------
    path : str or path
    shape : tuple of int
    dtype : torch.dtype
    dataset : str, optional
        Path of the array inside a new root group; by default the store is the array.
    chunk_rows : int, optional
        Rows per chunk (default: about 1 MiB of rows). Chunks span whole rows.
    compression : {'zstd', 'gzip', 'blosc', None}, default 'zstd'
        ``None`` / ``'none'`` stores raw bytes here; through ``DataGadget.save`` and
        ``convert`` leaving it out (or ``None``) means the default, zstd, and ``'none'``
        means raw.
    compression_level : int, optional
        zstd: -131072 to 22 (default 0, zstd's own default); gzip and blosc: 0 to 9
        (default 5).

    Notes
    -----
    The whole store is replaced on commit; every file is fsynced first.
    """

    format = "zarr"

    def __init__(
        self,
        path: str | os.PathLike[str],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        dataset: str | None = None,
        chunk_rows: int | None = None,
        compression: str | None = "zstd",
        compression_level: int | None = None,
    ) -> None:
        zarr = import_zarr()
        from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec
        from zarr.storage import LocalStore

        self.path = Path(path)
        self.shape = check_sink_target(self.path, shape, "zarr")
        self.dtype = dtype
        dataset = check_dataset_name(dataset or None, "zarr", self.path)
        comp = check_compression(compression, _COMPRESSIONS, "zarr", self.path)
        compression_level = check_level(comp, compression_level, "zarr", self.path, _COMPRESSIONS)
        npd = numpy_dtype(dtype)
        row_nbytes = int(np.prod(self.shape[1:], dtype=np.int64)) * npd.itemsize
        self.chunk_rows = default_chunk_rows(row_nbytes, self.shape[0], chunk_rows)
        compressors: Any = None
        if comp == "zstd":
            compressors = ZstdCodec(
                level=0 if compression_level is None else int(compression_level)
            )
        elif comp == "gzip":
            compressors = GzipCodec(
                level=5 if compression_level is None else int(compression_level)
            )
        elif comp == "blosc":
            compressors = BloscCodec(
                cname="zstd", clevel=5 if compression_level is None else int(compression_level)
            )
        self._tmp = temp_path_beside(self.path)
        chunks = tuple(max(1, s) for s in (self.chunk_rows, *self.shape[1:]))
        attrs = {DTYPE_ATTR: "bfloat16"} if dtype == torch.bfloat16 else {}
        try:
            with save_errors(self.path, "create the store"):
                store = LocalStore(self._tmp)
                kwargs: dict[str, Any] = dict(
                    shape=self.shape,
                    chunks=chunks,
                    dtype=npd,
                    compressors=compressors,
                    fill_value=0,
                    attributes=attrs,
                )
                if dataset:
                    root = zarr.open_group(store=store, mode="w")
                    self._arr = root.create_array(dataset, **kwargs)
                else:
                    self._arr = zarr.create_array(store=store, **kwargs)
            self._aligner = ChunkAligner(
                self._write_raw, self.shape[0], self.chunk_rows, self.shape[1:], npd
            )
        except BaseException:
            # (anything raised here, an interrupt too, leaves no partial store: the caller
            # has no sink to abort)
            self.abort()
            raise

    def _write_raw(self, start: int, rows: np.ndarray) -> None:
        # zarr writes on its own event-loop thread: an interrupt (Ctrl-C) while this thread
        # waits would leave that write running, and re-creating chunk files in the directory
        # that abort() removes. The write runs on a helper thread and is waited out first.
        fut = _writer().submit(self._arr.__setitem__, slice(start, start + rows.shape[0]), rows)
        try:
            with save_errors(self.path, f"write rows {start}:{start + rows.shape[0]}"):
                fut.result()
        except BaseException:
            _wait_out(fut)
            raise

    def write(self, start: int, rows: np.ndarray) -> None:
        self._accept(start, rows)
        self._aligner.write(start, as_bits(rows, self.dtype))

    def commit(self) -> None:
        self._require_complete()
        self._aligner.flush()
        with save_errors(self.path, "flush the store"):
            fsync_tree(self._tmp)
        replace_atomically(self._tmp, self.path)

    def abort(self) -> None:
        # zarr writes chunks concurrently: when one fails, the others run on and would
        # re-create the directory (and chunk files) after it is removed
        try:
            drained = _drain_zarr_tasks()
        finally:
            remove_path(self._tmp)
        if not drained:  # zarr's loop could not be reached: remove what comes back
            time.sleep(0.5)
            remove_path(self._tmp)


def _drain_zarr_tasks() -> bool:
    """Wait until zarr's event loop has no task left running: the chunk reads or writes of
    a call that raised when one of them failed (or when the caller was interrupted). They
    write into the call's buffer (or files), so the wait has no time limit: a
    ``RuntimeWarning`` says so every :data:`_DRAIN_S` seconds, and only an interrupt (a
    further Ctrl-C) ends it early. Returns False when zarr's loop cannot be reached (its
    internals changed)."""
    try:
        from zarr.core import sync as zsync

        loop = zsync.loop[0]
    except Exception:
        return False
    if loop is None:  # zarr never ran anything in this process
        return True
    if not isinstance(loop, asyncio.AbstractEventLoop) or loop.is_closed():
        return False
    if threading.current_thread() is getattr(zsync, "iothread", [None])[0]:
        return False  # on zarr's own loop thread: waiting there would never end

    async def others() -> None:
        me = asyncio.current_task()
        while True:
            pending = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
            if not pending:
                return
            await asyncio.wait(pending)

    try:
        fut = asyncio.run_coroutine_threadsafe(others(), loop)
    except Exception:
        return False
    waited = 0.0
    try:
        while True:
            try:
                fut.result(timeout=_DRAIN_S)
                return True
            except concurrent.futures.TimeoutError:
                waited += _DRAIN_S
                warnings.warn(
                    f"zarr's chunk tasks of a failed call are still running after {waited:g} s;"
                    " waiting for them to end (they write into the call's buffer or files)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            except Exception:  # the loop stopped under the wait
                return False
    finally:
        fut.cancel()  # nothing when it is done


_WRITER: list[concurrent.futures.ThreadPoolExecutor] = []
_WRITER_PID = [0]


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    """One helper thread per process for zarr writes (see ``ZarrSink._write_raw``)."""
    if not _WRITER or _WRITER_PID[0] != os.getpid():
        _WRITER[:] = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gl-zarr")]
        _WRITER_PID[0] = os.getpid()
    return _WRITER[0]


def _wait_out(fut: concurrent.futures.Future[Any]) -> None:
    """Wait until ``fut`` is done, through further interrupts."""
    while not fut.done():
        with contextlib.suppress(BaseException):
            concurrent.futures.wait([fut])


def describe(path: str, dataset: str | None = None) -> str:
    """One line about a zarr table (for CLI messages)."""
    src = ZarrSource(path, dataset=dataset)
    return f"{path}: zarr {src.shape} {dtype_name(src.dtype)}"
