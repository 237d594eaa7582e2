"""The ``file`` placement: a table that stays in its .npy / HDF5 / zarr file, for tables larger than RAM.

A gather sorts the ids, finds the blocks (the file's chunks) that hold them, reads
each block once -- from an LRU cache of recently used blocks under a byte budget,
else from the file -- and gathers the rows in memory with one fancy index. The
cache is one slab of block-sized slots, allocated on first use: a missing block is
read straight into the slot it will occupy, so caching costs no copy; blocks that
do not fit go through a bounded temporary buffer. Chunked sources read all the
missing chunks of a call at once (on their thread pool); others read runs of
consecutive blocks with one call each. Rows bound for a GPU leave through a reusable pinned
staging buffer. A scatter writes through to the file: each touched block is read
(unless the ids cover it completely), patched with the winning rows (the last
occurrence of a repeated id), and written back whole; the rest of a unit the file
rewrites whole (a chunk or zarr shard larger than the block) is read too, to check it.

The store pickles as its file's name: a copy in a DataLoader worker reopens the
file lazily, and a copy inherited through ``fork`` reopens it in the new process.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._device import pinned_empty
from .._dtypes import dtype_name, numpy_dtype
from .._errors import GadgetFileError, GadgetTypeError, GadgetValueError, ReadOnlyError
from .._ids import last_writer
from .._paths import as_path, file_identity
from ..io import open_source
from ..io._base import ArraySource
from ._base import Store

__all__ = ["DEFAULT_CACHE_BYTES", "FileStore", "file_store"]

#: default byte budget of a file-backed store's chunk cache
DEFAULT_CACHE_BYTES = 256 << 20
#: block size for sources without their own chunking (.npy, contiguous HDF5)
UNCHUNKED_BLOCK_BYTES = 4 << 10
#: most bytes read in one call when consecutive blocks are missing
_RUN_BYTES = 32 << 20
#: most bytes of blocks assembled at once during a gather
_BATCH_BYTES = 64 << 20

#: a scatter reads (and so checks) up to this many bytes of the blocks it rewrites before
#: its first write: a damaged chunk among them leaves the file unchanged
PRECHECK_BYTES = 256 << 20
#: rows an initializer (``fill_``, ``uniform_``, ...) of a file table writes at a time
#: (rounded to whole chunks or zarr shards)
INIT_BLOCK_BYTES = 64 << 20
#: a block is at least one whole write unit (chunk, zarr shard) up to this size
INIT_MAX_UNIT_BYTES = 256 << 20
#: pinned buffers and CUDA events inherited through a fork (never freed in the child)
_INHERITED: list[Any] = []

#: one lock per (process, file, dataset): every read and write of a file-backed table holds
#: it, so threads sharing one table, or several tables of one file, never interleave
_LOCKS: dict[tuple[int, tuple[str, str | None]], threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()
#: the open file-backed tables of each (file, dataset) in this process: a write through one
#: drops the others' cached blocks
_OPEN: dict[tuple[str, str | None], weakref.WeakSet[FileStore]] = {}


def _file_lock(key: tuple[str, str | None]) -> threading.RLock:
    k = (os.getpid(), key)  # a forked child makes its own (a parent's may be held)
    lock = _LOCKS.get(k)
    if lock is None:
        with _LOCKS_GUARD:
            lock = _LOCKS.setdefault(k, threading.RLock())
    return lock


#: closed tables whose close() gave up waiting for another table's call on the same file,
#: by (process, file, dataset): whichever call next leaves that file's lock releases them
_DEFERRED: dict[tuple[int, tuple[str, str | None]], list[weakref.ref[FileStore]]] = {}


def _defer_release(store: FileStore) -> None:
    with _LOCKS_GUARD:
        _DEFERRED.setdefault((os.getpid(), store._key), []).append(weakref.ref(store))


def _release_deferred(key: tuple[str, str | None]) -> None:
    """Release the closed tables of ``key`` whose close gave up (the caller holds its lock)."""
    with _LOCKS_GUARD:
        waiting = _DEFERRED.pop((os.getpid(), key), None)
    for ref in waiting or ():
        store = ref()
        if store is not None and store._closed:
            store._release_locked()


def _locks_after_fork_in_child() -> None:
    global _LOCKS_GUARD
    _LOCKS_GUARD = threading.Lock()  # another thread may have held the parent's
    _LOCKS.clear()  # the parent's, keyed by its pid
    _DEFERRED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_locks_after_fork_in_child)


#: elementwise initializers that may run block by block
_ELEMENTWISE: tuple[Any, ...] = (
    torch.Tensor.zero_,
    torch.Tensor.fill_,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.nn.init.zeros_,
    torch.nn.init.ones_,
    torch.nn.init.constant_,
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
)


def _file_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _meta_stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _meta_content(path: str) -> Any:
    """A metadata file's JSON without its user attributes (zarr v3 keeps them inside)."""
    try:
        with open(path, "rb") as f:
            content = json.load(f)
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    if isinstance(content, dict):
        content.pop("attributes", None)
    return content


def _pin(paths: tuple[str, ...]) -> list[int]:
    """A read-only descriptor on each path (file or folder), held while a store is open:
    an inode in use is never handed to a new file, so a file deleted and written anew
    under its name (which would often get the freed inode) gets another (device, inode)
    and :meth:`FileStore._check_file` tells it from the file opened. A path that cannot
    be opened so (a folder on some systems) is left unpinned."""
    fds = []
    for p in paths:
        with contextlib.suppress(OSError):
            fds.append(os.open(p, os.O_RDONLY))
    return fds


class FileStore(Store):
    """A table read from (and written through to) its file on demand.

    Parameters
    ----------
    source : ArraySource
        An open source; the store takes ownership (closes it on :meth:`close`).
    cache_bytes : int, default 256 MiB
        Budget of the LRU block cache (0 turns it off).
    writable : bool, optional
        Whether :meth:`scatter` / :meth:`write_block` write through to the file.
        Default: when the format can write and the file is writable. ``False``
        makes the store read-only; ``True`` on a file that cannot be written raises.
        It takes ``True``, ``False`` (NumPy's bools too) or ``None``; anything else (an
        int, a string) raises :class:`~gadgetloader.GadgetTypeError`.
    block_rows : int, optional
        Rows per read. Default: the file's chunk length, or about 4 KiB (a page) of rows for
        unchunked files (.npy, contiguous HDF5).

    Notes
    -----
    Ids are sorted so every block is read at most once per call, and only blocks
    holding requested ids are read. For chunked files a block is a chunk -- reading
    less would still decode the whole chunk -- so random access wants small chunks
    (a few to a few hundred KiB); sequential loads want large ones. Rows bound for a
    GPU are gathered into one of two reusable pinned buffers and copied with
    ``non_blocking=True``. ``stats`` counts cache hits, misses and read calls.

    Writes go straight to the file, block by block; they are visible to this store
    (its cache is written through as well) and to the other tables of the same file in
    this process (their cached blocks are dropped), but not to copies in other
    processes, whose caches may hold older rows; only one process may write a .npy or
    zarr file at a time (HDF5 enforces this with its file lock). A failure part-way (a
    full disk) can leave earlier blocks of that call written.

    Threads may share a store: every read and write holds a lock per file (one lock
    for the file under every name, hard links included; :meth:`exclusive` holds it
    across several calls). Every
    call also checks that the file is still the one the store opened: a file replaced
    on disk (another ``save``, or any program that writes a new file and renames it over
    the name), deleted (or deleted and written anew under its name), a .npy or HDF5 file truncated (or rewritten in place) below its
    size, or a file reopened with another shape or dtype raises
    :class:`~gadgetloader.GadgetFileError` (open the new file with a new table, or
    ``DataGadget.load``) instead of mixing two files' rows; from then on every call does
    (the file is let go, even if it comes back). A program that rewrites the
    same file in place at the same or a larger size is not detected. For HDF5 the
    truncation check covers rows served from the cache only while the table reads (has
    not written): a table that has written refuses the file when it next reads or writes
    it through the file (and every call from then on), and an external link's target is
    watched only through those reads and writes. A read also checks the file again when
    it ends: rows of a file saved over this one during the read are never returned.
    """

    placement = "file"

    def __init__(
        self,
        source: ArraySource,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        writable: bool | None = None,
        block_rows: int | None = None,
    ) -> None:
        super().__init__(source.shape, source.dtype)
        # the wrong kind of value is a GadgetTypeError, an int out of range a GadgetValueError
        for name, value, least, none_ok in (
            ("cache_bytes", cache_bytes, 0, False),
            ("block_rows", block_rows, 1, True),
        ):
            if value is None and none_ok:
                continue
            what = "a non-negative" if least == 0 else "a positive"
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise GadgetTypeError(
                    f"{name} must be {what} integer; got {value!r} of type {type(value).__name__}"
                )
            if value < least:
                raise GadgetValueError(f"{name} must be {what} integer; got {value!r}")
        if writable is not None and not isinstance(writable, (bool, np.bool_)):
            # bool('no') is True: a string or number here must not give a writable table
            raise GadgetTypeError(
                f"writable must be True, False or None (the default: writable when the file "
                f"is); got {writable!r} of type {type(writable).__name__}"
            )
        #: absolute: the store reopens (after a fork, to write) and checks its file by this path,
        #: which must not change meaning when the process changes its working directory
        self._path = os.path.abspath(source.path)
        self._format = source.format
        self._dataset: str | None = getattr(source, "dataset", None) or None
        self._holder: list[ArraySource | None] = [source]
        self._src_mode = getattr(source, "_mode", "r")
        self._npd = numpy_dtype(source.dtype)
        self.cache_bytes = int(cache_bytes)
        if block_rows is None:
            if getattr(source, "chunked", False):
                block_rows = source.chunk_rows
            else:
                block_rows = max(1, UNCHUNKED_BLOCK_BYTES // max(1, self.row_nbytes))
        self.block_rows = max(1, min(int(block_rows), max(1, self.num_rows)))
        #: blocks the cache holds: one slab of this many blocks, allocated on first use
        num_blocks = -(-self.num_rows // self.block_rows)
        # never more slots than the table has blocks (a budget far above a small or narrow
        # table would otherwise mean a huge slot list)
        self._capacity = min(
            num_blocks, self.cache_bytes // max(1, self.block_rows * self.row_nbytes)
        )
        reason = source.read_only_reason()
        if reason is None and not os.access(self._path, os.W_OK):
            reason = f"{self._path} cannot be written (no write permission)"
        if writable and reason is not None:
            raise ReadOnlyError(f"writable=True but {reason}")
        self._writable = bool(reason is None if writable is None else writable)
        if reason is None and not self._writable:
            reason = f"{self._path} ({self._format}) was opened with writable=False"
        #: why this table cannot write (None when it can), for check_writable's message
        self._read_only_reason = reason
        #: an HDF5 dataset behind an external link (read-only, see the HDF5 source)
        self._external = bool(getattr(source, "external", False))
        #: what the file lock and cache invalidation are keyed by: the array itself (a
        #: source's ``identity``: one HDF5 dataset or zarr array under any name)
        self._key = getattr(source, "identity", None) or (
            file_identity(self._path),  # (by inode: also through a hard link)
            self._dataset,
        )
        #: the paths whose files (or folders) must stay the ones opened: a zarr array's
        #: folder; an HDF5 file, and the file an external link leads to
        self._watch_paths = tuple(
            os.path.abspath(p) for p in (getattr(source, "watch_paths", None) or (self._path,))
        )
        #: the files this store opened: (device, inode) each, and a .npy's size (fixed by
        #: its header)
        self._pins = _pin(self._watch_paths)  # (before the ids are taken: see _pin)
        #: why the file is no longer this table's (gone, replaced, shrunk), once found
        self._lost: str | None = None
        self._ident = tuple(_file_id(p) for p in self._watch_paths)
        st = os.stat(self._watch_paths[0])
        self._size0 = st.st_size if self._format == "npy" else None
        #: metadata files whose change in place (a zarr ``resize``) changes the table:
        #: [path, stamp, content] each, the content read again only when the stamp moves
        self._metas = [
            [p, _meta_stamp(p), _meta_content(p)] for p in getattr(source, "meta_paths", ())
        ]
        self._reset_process_state()
        self._watch()

    @property
    def _src(self) -> ArraySource | None:
        return self._holder[0]

    @_src.setter
    def _src(self, value: ArraySource | None) -> None:
        self._holder[0] = value

    def _watch(self) -> None:
        """Close the file when the store is garbage-collected (not at interpreter exit);
        list the store among its file's open tables."""
        fin = weakref.finalize(self, _close_held, self._holder, self._pins)
        fin.atexit = False
        with _LOCKS_GUARD:
            _OPEN.setdefault(self._key, weakref.WeakSet()).add(self)

    def exclusive(self) -> Any:
        """The file's lock: this thread's calls on any table of the file run, other
        threads' wait (a re-entrant lock: the calls made inside take it again)."""
        return _file_lock(self._key)

    @contextlib.contextmanager
    def _guard(self) -> Any:
        """Hold the file's lock and check the file is still the one this store opened."""
        with _file_lock(self._key):
            self.check_open()  # closed by another thread while this one waited
            self._check_file()
            try:
                yield
            except GadgetFileError as exc:
                if getattr(exc, "file_lost", False) and self._lost is None:
                    # the source found the file truncated: refused from now on, as the
                    # checks before each call refuse it (cached rows are not served)
                    self._lost = str(exc)
                    self._release_locked()
                raise
            finally:
                if self._closed:  # closed during this call (see _release): release here
                    self._release_locked()
                _release_deferred(self._key)  # other tables' closes that gave up waiting

    def _check_file(self) -> None:
        if self._lost is not None:
            raise GadgetFileError(self._lost)
        try:
            for path, ident in zip(self._watch_paths, self._ident, strict=True):
                self._check_one(path, ident)
            for meta in self._metas:
                self._check_meta(meta)
            src = self._src
            if src is not None and self._pid == os.getpid():
                check = getattr(src, "check_unchanged", None)
                if check is not None:  # a file shorter than the open handle knows it (HDF5)
                    check()
        except GadgetFileError as exc:
            # for good: the file (and its inode, see _pin) is let go, so a file made later
            # under the name, even on the same inode, is never taken for it
            self._lost = str(exc)
            self._release_locked()
            raise

    def _check_one(self, path: str, ident: tuple[int, int]) -> None:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise GadgetFileError(
                f"{path} is gone ({exc.strerror}); this file-backed table cannot read or "
                "write it any more"
            ) from exc
        if (st.st_dev, st.st_ino) != ident:
            raise GadgetFileError(
                f"{path} was replaced on disk since this table opened it (by a save or "
                "another program); open the new file with a new DataGadget (or call load()) "
                "instead of mixing rows of two files"
            )
        if self._size0 is not None and st.st_size < self._size0:
            raise GadgetFileError(
                f"{self._path} shrank from {self._size0} to {st.st_size} bytes since this table "
                "opened it (rewritten in place?); open it again"
            )

    def _check_meta(self, meta: list[Any]) -> None:
        """Refuse a table whose metadata file changed what it describes (shape, chunks,
        dtype, codecs: a zarr ``resize`` in place) since the table opened it."""
        path, stamp, content = meta
        try:
            now = _meta_stamp(path)
        except OSError as exc:
            raise GadgetFileError(
                f"{path} is gone ({exc.strerror}); this file-backed table cannot read or "
                "write it any more"
            ) from exc
        if now == stamp:
            return
        new = _meta_content(path)
        if new != content:
            shape = new.get("shape") if isinstance(new, dict) else None
            if isinstance(new, str):  # the file no longer parses
                what = f"is now {new}"
            elif isinstance(shape, list) and shape != list(self.shape):
                what = (
                    f"now describes another array (shape {shape}, where it had {list(self.shape)})"
                )
            else:
                what = "now describes another array (other chunks, dtype or codecs)"
            raise GadgetFileError(
                f"{self._path} changed since this table opened it: its metadata ({path}) "
                f"{what}; open it again"
            )
        meta[1] = now  # rewritten with the same content (attributes only)

    def file_replaced(self) -> bool:
        """Whether the path now names another file than the one this store opened."""
        if self._lost is not None:
            return True
        try:
            return tuple(_file_id(p) for p in self._watch_paths) != self._ident
        except OSError:
            return True

    def _drop_others(self) -> None:
        """After a write: other tables of this file in this process forget cached blocks."""
        for other in list(_OPEN.get(self._key, ())):
            if other is not self and other._pid == os.getpid() and other._lru:
                other._lru.clear()
                other._free = list(range(other._capacity - 1, -1, -1))

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        #: block -> slot of the slab, least recently used first
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._free: list[int] = list(range(self._capacity - 1, -1, -1))
        self._slab: np.ndarray | None = None
        self._stages: list[torch.Tensor | None] = [None, None]
        self._events: list[Any] = [None, None]
        self._turn = 0
        self._last_stage = 0
        #: counters: blocks served from the cache / read from the file, read calls
        self.stats = {"hits": 0, "misses": 0, "reads": 0}
        #: a read-only memory map of the rows where the source offers one (.npy)
        self._mm: np.ndarray | None = None

    # ---- facts --------------------------------------------------------------------------
    @property  # type: ignore[override]
    def supports_writes(self) -> bool:  # type: ignore[override]
        """Whether scatters write through to the file (False for read-only sources)."""
        return self._writable

    @property
    def path(self) -> str:
        return self._path

    @property
    def format(self) -> str:
        return self._format

    @property
    def dataset(self) -> str | None:
        return self._dataset

    @property
    def cached_bytes(self) -> int:
        """Bytes of blocks the cache holds now (never above :attr:`cache_bytes`)."""
        return len(self._lru) * self.block_rows * self.row_nbytes

    def check_writable(self) -> None:
        self.check_open()
        if not self._writable:
            reason = getattr(self, "_read_only_reason", None) or f"{self._path} is read-only"
            raise ReadOnlyError(
                f"this file-backed table is read-only: {reason}; to change rows, load it into "
                "memory (placement='cpu', 'pinned' or 'cuda')"
            )

    def _describe(self) -> str:
        ds = f" dataset {self._dataset!r}" if self._dataset else ""
        return f"file table {self._path!r}{ds}"

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        ds = f"[{self._dataset!r}]" if self._dataset else ""
        return f"<FileStore {self._format} {self._path}{ds} shape={self._shape} dtype={self._dtype}{state}>"

    # ---- process-local state ------------------------------------------------------------------
    def _source(self, *, write: bool = False) -> ArraySource:
        if self._pid != os.getpid():  # inherited through fork: reopen here
            if self._src is not None:
                self._src.close()  # a source abandons handles that belong to another process
            self._src = None
            self._src_mode = "r"
            # CUDA objects of the parent must not be destroyed in a forked child: keep them
            _INHERITED.append((self._stages, self._events))
            self._reset_process_state()
        if write and self._src_mode != "r+":
            if self._src is not None:
                self._src.close()  # one handle per file: HDF5 refuses 'r+' beside an open 'r'
            self._src = None
            try:
                self._src = self._reopen("r+")
            except BaseException:
                # refused (the file is open read-only elsewhere, locked, ...): reads go
                # on reopening it read-only, as before this call
                self._src_mode = "r"
                raise
            self._src_mode = "r+"
        if self._src is None:
            self._src = self._reopen(self._src_mode)
        return self._src

    def _reopen(self, mode: str) -> ArraySource:
        """The file opened again; refused if it no longer holds this table's shape and
        dtype (rewritten since the table opened it: its rows would be someone else's)."""
        src = open_source(self._path, format=self._format, dataset=self._dataset, mode=mode)
        if tuple(src.shape) != tuple(self.shape) or src.dtype != self.dtype:
            got = f"{tuple(src.shape)} {dtype_name(src.dtype)}"
            src.close()
            raise GadgetFileError(
                f"{self._path} changed since this table opened it: it held {tuple(self.shape)} "
                f"{dtype_name(self.dtype)}, now {got}; open it again"
            )
        return src

    def __getstate__(self) -> dict[str, Any]:
        if self._src_mode == "r+" and self._src is not None and self._pid == os.getpid():
            # a handle open for writing locks HDF5 files against the readers being started;
            # this process reopens the file for writing when it writes again
            self._src.close()
            self._src = None
            self._src_mode = "r"
        state = self.__dict__.copy()
        for key in (
            "_holder",
            "_pins",
            "_lru",
            "_free",
            "_slab",
            "_stages",
            "_events",
            "stats",
            "_mm",
        ):
            state.pop(key, None)
        state["_src_mode"] = "r"  # a copy opens the file for writing only when it writes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._holder = [None]
        # (a file replaced since the original opened it is not the one pinned here: the
        # ids taken then tell it apart)
        self._pins = [] if self._closed else _pin(self._watch_paths)
        self._reset_process_state()
        self._watch()

    def _release(self) -> None:
        # not while another thread reads or writes the file: wait for its call to end. A
        # call that is itself waiting for this thread (a close from a finalizer run on one
        # of its I/O threads) would never end, so after a while the release is left to
        # that call, which makes it on its way out (see _guard)
        lock = _file_lock(self._key)
        if lock.acquire(timeout=1.0):
            try:
                self._release_locked()
            finally:
                lock.release()
            return
        # another table of this file (or this table's own call) holds the lock: the call
        # that next leaves it releases this table; if that call ended meanwhile, do it here
        _defer_release(self)
        if lock.acquire(blocking=False):
            try:
                _release_deferred(self._key)
            finally:
                lock.release()

    def _release_locked(self) -> None:
        if self._src is not None:
            self._src.close()
        self._src = None
        _unpin(self._pins)
        self._lru.clear()
        self._free = list(range(self._capacity - 1, -1, -1))
        self._slab = None
        self._stages = [None, None]
        self._events = [None, None]
        self._mm = None

    # ---- blocks ---------------------------------------------------------------------------------
    def _block_range(self, b: int) -> tuple[int, int]:
        r0 = b * self.block_rows
        return r0, min(self.num_rows, r0 + self.block_rows)

    def _slot_rows(self, slot: int, b: int) -> np.ndarray:
        """The cached rows of block ``b`` (a view of its slot in the slab)."""
        assert self._slab is not None
        b0, b1 = self._block_range(b)
        return self._slab[slot * self.block_rows : slot * self.block_rows + b1 - b0]

    def _slab_array(self) -> np.ndarray:
        if self._slab is None:
            self._slab = np.empty((self._capacity * self.block_rows, *self.row_shape), self._npd)
        return self._slab

    def _forget(self, b: int) -> None:
        slot = self._lru.pop(b, None)
        if slot is not None:
            self._free.append(slot)

    def _runs(self, blocks: np.ndarray) -> list[tuple[int, int]]:
        """Split sorted block numbers into ``(first, last)`` runs of consecutive blocks."""
        if blocks.size == 0:
            return []
        limit = max(1, _RUN_BYTES // max(1, self.block_rows * self.row_nbytes))
        runs: list[tuple[int, int]] = []
        breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
        for seg in np.split(blocks, breaks):
            for i in range(0, seg.size, limit):
                part = seg[i : i + limit]
                runs.append((int(part[0]), int(part[-1])))
        return runs

    def _read_rows(self, start: int, stop: int) -> np.ndarray:
        buf = np.empty((stop - start, *self.row_shape), dtype=self._npd)
        self._source().read_into(start, stop, buf)
        self.stats["reads"] += 1
        return buf

    def _read_blocks(self, blocks: list[int], dest: np.ndarray, slots: list[int]) -> None:
        """Read block ``blocks[j]`` into ``dest[slots[j] * block_rows :]`` for every j.

        Sources that read many chunks at once (``read_chunks``) get one call;
        others one ``read_into`` per run of blocks that are consecutive both in the
        file and in ``dest``.
        """
        if not blocks:
            return
        src = self._source()
        b_rows = self.block_rows
        reader = getattr(src, "read_chunks", None)
        if reader is not None and getattr(src, "chunked", False) and src.chunk_rows == b_rows:
            reader(blocks, dest, slots)
            self.stats["reads"] += 1
            return
        limit = max(1, _RUN_BYTES // max(1, b_rows * self.row_nbytes))
        i, n = 0, len(blocks)
        while i < n:
            j = i
            while (
                j + 1 < n
                and j + 1 - i < limit
                and blocks[j + 1] == blocks[j] + 1
                and slots[j + 1] == slots[j] + 1
            ):
                j += 1
            r0 = blocks[i] * b_rows
            r1 = self._block_range(blocks[j])[1]
            src.read_into(r0, r1, dest[slots[i] * b_rows : slots[i] * b_rows + r1 - r0])
            self.stats["reads"] += 1
            i = j + 1

    # ---- row movement -----------------------------------------------------------------------------
    def _stage(self, n: int) -> torch.Tensor:
        """A pinned host buffer for ``n`` rows that no pending copy is reading."""
        i = self._turn
        self._turn ^= 1
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
            self._events[i] = None
        stage = self._stages[i]
        shape = (n, *self.row_shape)
        if stage is None or stage.shape[0] < n:
            rows = max(n, 2 * stage.shape[0]) if stage is not None else n
            stage = pinned_empty((rows, *self.row_shape), self._dtype)
            self._stages[i] = stage
        self._last_stage = i
        return stage[:n].view(shape)

    def _memmap(self) -> np.ndarray | None:
        """The source's memory map (uncompressed, contiguous files such as .npy), or None."""
        if self._mm is None:
            mapper = getattr(self._source(), "memmap", None)
            self._mm = mapper() if mapper is not None else None
        return self._mm

    def _gather_rows(self, flat: np.ndarray, result: np.ndarray) -> None:
        """``result[i] = table[flat[i]]``, reading each needed block once.

        Files whose rows can be memory-mapped (.npy, uncompressed HDF5) are gathered
        through the map: the OS page cache is then the cache and a row costs one copy,
        no per-block Python work."""
        mm = self._memmap()
        if mm is not None:
            if mm.dtype == result.dtype:
                np.take(mm, flat, axis=0, out=result)  # the page cache is the cache
            else:  # a big-endian file: convert while copying
                result[...] = mm[flat]
            self.stats["reads"] += 1
            return
        gather = getattr(self._source(), "gather_rows", None)
        if gather is not None and gather(flat, result):  # rows at their file offsets (HDF5)
            self.stats["reads"] += 1
            return
        b_rows = self.block_rows
        order = np.argsort(flat, kind="stable")
        sorted_ids = flat[order]
        blk = sorted_ids // b_rows
        blocks, counts = np.unique(blk, return_counts=True)
        which = np.repeat(np.arange(blocks.size, dtype=np.int64), counts)  # block of each id
        local = sorted_ids - blk * b_rows
        # 1. cache lookups first, so blocks read below cannot evict this call's hits
        slot = np.full(blocks.size, -1, dtype=np.int64)
        lru = self._lru
        for j, b in enumerate(blocks.tolist()):
            hit = lru.get(b)
            if hit is not None:
                lru.move_to_end(b)
                slot[j] = hit
        missing = np.flatnonzero(slot < 0)
        self.stats["hits"] += blocks.size - missing.size
        self.stats["misses"] += missing.size
        # 2. missing blocks go straight into free or least recently used slots ...
        room = self._capacity - (blocks.size - missing.size)
        cached = missing[: max(0, room)]
        if cached.size:
            slab = self._slab_array()
            new: list[int] = []
            for _ in range(cached.size):
                new.append(self._free.pop() if self._free else lru.popitem(last=False)[1])
            try:
                self._read_blocks(blocks[cached].tolist(), slab, new)
            except BaseException:
                self._free.extend(new)  # a failed read keeps its slots (they hold no block)
                raise
            for b, sl in zip(blocks[cached].tolist(), new, strict=True):
                lru[b] = sl
            slot[cached] = new
        if self._slab is not None:
            inside = slot[which] >= 0
            pick = order[inside] if not inside.all() else order
            rows_at = slot[which][inside] * b_rows + local[inside]
            result[pick] = self._slab[rows_at]
        # 3. ... and those that do not fit through a bounded temporary buffer
        rest = missing[max(0, room) :]
        per_batch = max(1, _BATCH_BYTES // max(1, b_rows * self.row_nbytes))
        for k in range(0, rest.size, per_batch):
            part = rest[k : k + per_batch]
            tmp = np.empty((part.size * b_rows, *self.row_shape), dtype=self._npd)
            self._read_blocks(blocks[part].tolist(), tmp, list(range(part.size)))
            at = np.full(blocks.size, -1, dtype=np.int64)
            at[part] = np.arange(part.size)
            lo = int(np.searchsorted(which, part[0]))
            hi = int(np.searchsorted(which, part[-1], side="right"))
            pos = at[which[lo:hi]]
            sel = pos >= 0
            result[order[lo:hi][sel]] = tmp[pos[sel] * b_rows + local[lo:hi][sel]]

    def _gather(
        self,
        ids: torch.Tensor,
        device: torch.device,
        out: torch.Tensor | None = None,
        strategy: str = "auto",
    ) -> torch.Tensor:
        """Rows at ``ids`` on ``device``; reads each needed block once (cache first)."""
        self.check_open()
        self._source()  # reopen after a fork before anything else
        flat = ids.reshape(-1).cpu().numpy()
        n = flat.size
        to_cuda = device.type == "cuda"
        result_t = (
            self._stage(n)
            if to_cuda
            else torch.empty((n, *self.row_shape), dtype=self._dtype, device="cpu")
        )
        result = _numpy_bits(result_t)
        if n:
            self._gather_rows(flat, result)
        shaped = result_t.view((*ids.shape, *self.row_shape))
        if to_cuda:
            target = (
                out
                if out is not None
                else torch.empty(shaped.shape, dtype=self._dtype, device=device)
            )
            target.copy_(shaped, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._last_stage] = ev
            return target
        if out is not None:
            out.copy_(shaped)
            return out
        return shaped

    def _scatter(
        self, ids: torch.Tensor, rows: torch.Tensor, strategy: str = "auto", *, unique: bool = False
    ) -> None:
        """``table[ids] = rows`` written through to the file; a repeated id takes its last row."""
        self.check_writable()
        src = _numpy_bits(rows.reshape(ids.numel(), *self.row_shape).detach().cpu().contiguous())
        plan = last_writer(ids.reshape(-1).cpu())
        sel = plan.keep.nonzero().squeeze(1)
        uid = plan.ids[sel].numpy()
        win = src[plan.pos[sel].numpy()]
        if uid.size == 0:
            return
        writer = self._source(write=True)
        blk = uid // self.block_rows
        blocks = np.unique(blk)
        # every block the write touches is read (and so checked) before the first write,
        # so a damaged chunk found on the way leaves the file unchanged; past
        # PRECHECK_BYTES of partly written blocks the runs are read and written in turn.
        # The file rewrites whole units (a chunk, a zarr shard), which may be larger than
        # a block: the rest of every unit a run only partly covers is read as well
        unit = max(1, int(getattr(writer, "write_unit_rows", 1)))
        runs = self._runs(blocks)
        spans = [(self._block_range(f)[0], self._block_range(la)[1]) for f, la in runs]
        checked = 0  # rows below this were read or lie in an earlier run
        # HDF5 reads its edge chunks even when a write covers them: read them first too
        edges = getattr(writer, "check_write_edges", None)
        pending: list[tuple[int, int, np.ndarray]] = []
        held = 0
        for i, (first, last) in enumerate(runs):
            r0, r1 = spans[i]
            if edges is not None:
                edges(r0, r1)
            if unit > 1:
                nxt = spans[i + 1][0] if i + 1 < len(spans) else self.num_rows
                u0, u1 = r0 // unit * unit, min(self.num_rows, -(-r1 // unit) * unit)
                self._check_rows(writer, max(u0, checked), r0)
                self._check_rows(writer, r1, min(u1, nxt))
                checked = max(r1, min(u1, nxt))
            buf = self._merged_run(first, last, r0, r1, uid, win)
            pending.append((first, last, buf))
            held += 0 if buf.base is win else buf.nbytes
            if held > PRECHECK_BYTES:
                self._write_runs(writer, pending)
                pending, held = [], 0
        self._write_runs(writer, pending)

    def _check_rows(self, src: ArraySource, start: int, stop: int) -> None:
        """Read rows ``start:stop`` from the file and drop them: a damaged chunk among them
        raises here, before anything is written."""
        step = max(1, _RUN_BYTES // max(1, self.row_nbytes))
        for a in range(start, stop, step):
            b = min(stop, a + step)
            src.read_into(a, b, np.empty((b - a, *self.row_shape), dtype=self._npd))
            self.stats["reads"] += 1

    def _merged_run(
        self, first: int, last: int, r0: int, r1: int, uid: np.ndarray, win: np.ndarray
    ) -> np.ndarray:
        """Rows ``r0:r1`` (blocks ``first..last``) as they will be after the write."""
        lo = int(np.searchsorted(uid, r0))
        hi = int(np.searchsorted(uid, r1))
        if hi - lo == r1 - r0:  # the ids cover the run completely
            return win[lo:hi]
        buf = np.empty((r1 - r0, *self.row_shape), dtype=self._npd)
        uncached = []
        for b in range(first, last + 1):
            b0, b1 = self._block_range(b)
            sl = self._lru.get(b)
            if sl is not None:
                buf[b0 - r0 : b1 - r0] = self._slot_rows(sl, b)
            else:
                uncached.append(b)
        for f2, l2 in self._runs(np.asarray(uncached, dtype=np.int64)):
            a0, a1 = self._block_range(f2)[0], self._block_range(l2)[1]
            self._source(write=True).read_into(a0, a1, buf[a0 - r0 : a1 - r0])
            self.stats["reads"] += 1
        buf[uid[lo:hi] - r0] = win[lo:hi]
        return buf

    def _write_runs(self, writer: ArraySource, runs: list[tuple[int, int, np.ndarray]]) -> None:
        for first, last, buf in runs:
            r0 = self._block_range(first)[0]
            writer.write_rows(r0, buf)
            exact = getattr(writer, "exact_writes", True)
            for b in range(first, last + 1):  # the cache is written through as well
                if not exact:  # (a lossy filter: the next read takes what the file holds)
                    self._forget(b)
                    continue
                sl = self._lru.get(b)
                if sl is not None:
                    b0, b1 = self._block_range(b)
                    self._slot_rows(sl, b)[...] = buf[b0 - r0 : b1 - r0]

    def _read_block(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` read from the file as a new CPU tensor."""
        self.check_open()
        buf = self._read_rows(start, stop)
        return _torch_bits(buf, self._dtype)

    def _write_block(self, start: int, rows: torch.Tensor, *, whole_units: bool = False) -> None:
        """Write contiguous rows from ``start`` through to the file."""
        self.check_writable()
        data = _numpy_bits(rows.detach().cpu().contiguous())
        stop = start + data.shape[0]
        if stop <= start:
            return
        src = self._source(write=True)
        overwrite = getattr(src, "overwrite_rows", None) if whole_units else None
        try:
            (overwrite or src.write_rows)(start, data)
        finally:  # (after a failure too: what the file holds there is not known)
            for b in range(start // self.block_rows, (stop - 1) // self.block_rows + 1):
                self._forget(b)

    # ---- public entry points: one file lock, a check that the file is unchanged -----------------
    def gather(
        self,
        ids: torch.Tensor,
        device: torch.device,
        out: torch.Tensor | None = None,
        strategy: str = "auto",
    ) -> torch.Tensor:
        """Rows at ``ids`` on ``device``; reads each needed block once (cache first)."""
        self.check_open()
        with self._guard():
            got = self._gather(ids, device, out, strategy)
            self._check_read_whole()
            return got

    def scatter(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        strategy: str = "auto",
        *,
        unique: bool = False,
        ids_sorted: bool = False,
        check: Callable[[], None] | None = None,
    ) -> None:
        """``table[ids] = rows`` written through to the file; a repeated id takes its last row.

        ``ids_sorted`` (a launch-shape hint for in-memory stores) does not apply here;
        ``check`` (a pending check of the ids) is called before anything is done."""
        if check is not None:
            check()
        self.check_writable()
        with self._guard():
            self._scatter(ids, rows, strategy, unique=unique)
            self._drop_others()
            self._push()

    def precheck_scatter(self, ids: torch.Tensor) -> None:
        """Read (and drop) the blocks a scatter of ``ids`` rewrites, up to
        :data:`PRECHECK_BYTES`, as :meth:`scatter` does before its first write: a damaged
        chunk raises :class:`~gadgetloader.GadgetFileError` here, with nothing written."""
        self.check_writable()
        uid = np.unique(ids.reshape(-1).cpu().numpy())
        if uid.size == 0:
            return
        with self._guard():
            writer = self._source(write=True)
            budget = PRECHECK_BYTES
            # the file rewrites whole units (a zarr shard): the rest of each is read too,
            # as the scatter itself reads it before its first write
            unit = max(1, int(getattr(writer, "write_unit_rows", 1)))
            checked = 0  # rows below this were read already
            for first, last in self._runs(np.unique(uid // self.block_rows)):
                r0, r1 = self._block_range(first)[0], self._block_range(last)[1]
                if unit > 1:
                    r0, r1 = r0 // unit * unit, min(self.num_rows, -(-r1 // unit) * unit)
                r0 = max(r0, checked)
                if r1 > r0:
                    self._check_rows(writer, r0, r1)
                    budget -= (r1 - r0) * self.row_nbytes
                checked = max(checked, r1)
                if budget <= 0:
                    break

    def read_block(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` read from the file as a new CPU tensor."""
        self.check_open()
        with self._guard():
            got = self._read_block(start, stop)
            self._check_read_whole()
            return got

    def _check_read_whole(self) -> None:
        """After a read: raise if the file was replaced meanwhile (a save renamed another
        over it). The check before the read cannot see a replacement during it, and rows
        read after it may have come from the new file (a zarr chunk is opened by its path)."""
        for path, ident in zip(self._watch_paths, self._ident, strict=True):
            try:
                same = _file_id(path) == ident
            except OSError:
                same = False
            if not same:
                self._check_file()  # raises, with the reason, and lets the file go

    def write_block(self, start: int, rows: torch.Tensor, *, whole_units: bool = False) -> None:
        """Write contiguous rows from ``start`` through to the file. ``whole_units``: the
        rows fill whole chunks (or zarr shards) and their old values are not needed, so
        the file need not read them (a damaged chunk is replaced)."""
        self.check_writable()
        with self._guard():
            self._write_block(start, rows, whole_units=whole_units)
            self._drop_others()
            self._push()

    def apply_(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run an elementwise initializer (``zero_``, ``fill_``, ``uniform_``, ``normal_``,
        ``torch.nn.init.{zeros_, ones_, constant_, uniform_, normal_}``) block by block.

        The file is not read: every block is whole chunks (or zarr shards of up to
        :data:`INIT_MAX_UNIT_BYTES`), written over, so a damaged chunk or shard is replaced
        by the new values; in a larger shard, blocks are whole chunks and zarr reads the
        shard they rewrite, so a damaged one raises :class:`~gadgetloader.GadgetFileError`.
        HDF5 reads its edge chunks (those reaching past the last row, or past a row's
        last columns) on every write, so those chunks are read first and a damaged one
        raises before anything is written. An error part-way (a full disk)
        leaves the blocks before it initialized and the rest as they were.

        Raises
        ------
        GadgetTypeError
            For other initializers: those that look at the whole tensor's shape
            (``xavier_uniform_``, ``orthogonal_``, ...) would see one block only.
        """
        self.check_writable()
        if fn not in _ELEMENTWISE:
            raise GadgetTypeError(
                f"{getattr(fn, '__name__', fn)!r} cannot run on a file-backed table block by block; "
                "file-backed tables take elementwise initializers (zero_, fill_, uniform_, normal_); "
                "initialize the table in memory and save it instead"
            )
        # these initializers set every value without looking at the old ones, so nothing is
        # read: each block is whole units of the file (chunks, zarr shards), which the file
        # writes without reading them either (a damaged zarr shard is written anew, see
        # ZarrSource.overwrite_rows), so damage is overwritten rather than failing the call
        # half-way through the table. A unit above INIT_MAX_UNIT_BYTES (a huge shard) is
        # not held whole: blocks are then whole chunks of it
        with self._guard():
            src = self._source(write=True)
            unit = max(1, int(getattr(src, "write_unit_rows", 1)))
            if unit * self.row_nbytes > INIT_MAX_UNIT_BYTES:
                unit = max(1, min(unit, int(getattr(src, "chunk_rows", 1) or 1)))
            # HDF5 reads its edge chunks (past the last row, or splitting a row) on every
            # write: a damaged one is found before anything is written (up to PRECHECK_BYTES)
            edges = getattr(src, "check_write_edges", None)
            if edges is not None:
                edges(0, self.num_rows)
        step = max(1, INIT_BLOCK_BYTES // max(1, self.row_nbytes))
        step = max(unit, step // unit * unit)
        with torch.no_grad():
            for start in range(0, self.num_rows, step):
                stop = min(self.num_rows, start + step)
                block = torch.empty((stop - start, *self.row_shape), dtype=self._dtype)
                fn(block, *args, **kwargs)
                self.write_block(start, block, whole_units=True)

    def _push(self) -> None:
        """After a write call: its rows out of the source's buffers into the file (not to
        disk), once per call, so other processes (DataLoader workers) and other tables
        of the file read them."""
        if self._src is not None and hasattr(self._src, "flush"):
            self._src.flush()

    def flush(self) -> None:
        """Ask the source to push written rows to the file (where it buffers)."""
        with _file_lock(self._key):
            if self._src is not None and hasattr(self._src, "flush"):
                self._src.flush()

    def synchronize(self) -> None:
        ev = [e for e in self._events if e is not None]
        for e in ev:
            e.synchronize()


def _close_held(holder: list[ArraySource | None], pins: list[int]) -> None:
    src = holder[0]
    holder[0] = None
    if src is not None:
        with contextlib.suppress(Exception):  # never raise from a finalizer
            src.close()
    _unpin(pins)


def _unpin(pins: list[int]) -> None:
    """Close the descriptors of :func:`_pin` (once: the list is emptied)."""
    while pins:
        with contextlib.suppress(OSError):
            os.close(pins.pop())


def _numpy_bits(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (bfloat16 as uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _torch_bits(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_OPTIONS = ("cache_bytes", "writable", "block_rows")


def file_store(
    source: Any, *, format: str | None = None, dataset: str | None = None, **options: Any
) -> FileStore:
    """A :class:`FileStore` over ``source`` (an open :class:`~gadgetloader.io.ArraySource` or a path).

    Parameters
    ----------
    source : ArraySource, str or path
    format, dataset : str, optional
        For a path: force the format; the array inside an HDF5 file or zarr group.
    **options
        ``cache_bytes``, ``writable``, ``block_rows`` (see :class:`FileStore`).

    Raises
    ------
    GadgetTypeError
        An unknown option (the message lists the valid ones).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise GadgetTypeError(
            f"unexpected option(s) {unknown} for placement='file'; expected some of {list(_OPTIONS)}"
        )
    if not isinstance(source, ArraySource):
        source = open_source(as_path(source), format=format, dataset=dataset)
    try:
        if source.num_rows == 0:
            raise GadgetValueError(
                f"{source.path} holds a table with zero rows {source.shape}; nothing to read"
            )
        return FileStore(source, **options)
    except BaseException:
        source.close()  # a refused store leaves no file handle behind
        raise
