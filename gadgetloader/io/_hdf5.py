"""The HDF5 format (h5py, optional): whole-chunk reads into the caller's buffer, atomic chunked writes.

Reads never use h5py's fancy or point indexing. A block of rows is read with
``read_direct`` (one hyperslab, whole chunks, straight into the destination), or,
for chunks that span whole rows and carry no filter (or only deflate / shuffle),
with ``read_direct_chunk``: the chunk's stored bytes are read without HDF5's
selection machinery and decoded here (about 5x less overhead per chunk).

bfloat16 has no HDF5 type: a bfloat16 table is stored as its uint16 bits with the
dataset attribute ``gadgetloader_dtype = "bfloat16"``, so round trips are bit-exact.

HDF5 handles never cross a fork: open files are closed before ``os.fork`` (they
reopen lazily), and a handle found in a process other than the one that opened it
is abandoned unclosed -- closing it could flush the parent's state -- and reopened.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._dtypes import dtype_name, numpy_dtype
from .._errors import (
    GadgetError,
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetKeyError,
    GadgetValueError,
    MissingDependencyError,
    ReadOnlyError,
)
from .._paths import file_identity
from ._atomic import remove_path, replace_atomically, temp_path_beside
from ._base import ArraySink, ArraySource
from ._chunks import (
    ChunkAligner,
    as_bits,
    check_compression,
    check_dataset_name,
    check_free_space,
    check_level,
    check_sink_target,
    default_chunk_rows,
    for_each_chunk,
    save_errors,
    table_dtype,
    unsigned_carrier,
)

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["DTYPE_ATTR", "Hdf5Sink", "Hdf5Source", "is_hdf5", "import_h5py"]

#: dataset attribute naming the torch dtype when the stored type cannot (bfloat16)
DTYPE_ATTR = "gadgetloader_dtype"
#: default dataset name for new files
DEFAULT_DATASET = "data"
#: rows per read for contiguous (unchunked) datasets: about this many bytes
_CONTIGUOUS_BLOCK_BYTES = 8 << 20
_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_COMPRESSIONS = ("gzip", "lzf")
#: reads of a read-only handle tried while another process writes the file (see _reading)
_READ_ATTEMPTS = 3
_H5Z_DEFLATE, _H5Z_SHUFFLE = 1, 2

#: handles inherited through a fork: kept alive, never closed in the child
_ABANDONED: list[Any] = []
_OPEN: weakref.WeakSet[Hdf5Source] = weakref.WeakSet()
#: every source made in this process and not closed (whether or not its h5py handle is open)
_SOURCES: weakref.WeakSet[Hdf5Source] = weakref.WeakSet()
#: writes through any source of a file (by real path) in this process: a reader's cached
#: chunk positions are dropped when it changes (HDF5 may move a rewritten compressed chunk)
_WRITES: dict[str, int] = {}


def import_h5py() -> ModuleType:
    """Import h5py or raise :class:`MissingDependencyError` naming the pip extra."""
    try:
        import h5py
    except ImportError as exc:
        raise MissingDependencyError(
            "HDF5 files need the optional 'h5py' package, which is not installed; "
            "install it with pip install 'gadgetloader[hdf5]' (from a checkout: pip install -e "
            "'.[hdf5]'; or pip install h5py)"
        ) from exc
    _register_fork_hooks()
    return h5py


def is_hdf5(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a file with the HDF5 signature (at offset 0, 512, 1024, ...)."""
    try:
        with open(path, "rb") as f:
            offset = 0
            size = os.fstat(f.fileno()).st_size
            while offset + 8 <= size:
                f.seek(offset)
                if f.read(8) == _SIGNATURE:
                    return True
                offset = 512 if offset == 0 else offset * 2
    except PermissionError:
        raise  # a file that cannot be read is no evidence of its format
    except OSError:
        return False
    return False


def _h5_open(h5py: ModuleType, path: str, mode: str, *, cache: bool = True) -> Any:
    """Open ``path``; in a DataLoader worker process, read-only and without HDF5's file
    lock (``locking=False``).

    A worker's locked read handle would stop the main process from writing rows through
    a ``file`` table ("unable to lock file") for as long as the worker lives
    (``persistent_workers``), and a worker could not open a file the main process is
    writing. Elsewhere HDF5's default applies: one process may not mix locked and
    unlocked handles of a file, and users open the same files with h5py themselves. What
    a worker reads while the main process writes rows is not defined (as for any file
    written in place); rows written before the worker opened the file are seen.

    A file table's handle for writing keeps HDF5's chunk cache, which merges the partial
    chunk writes of tables whose ``block_rows`` is below the chunk (without it each
    block rewrote its whole chunk: 2.7x slower in a review's test). A new file a save
    writes has none (:class:`Hdf5Sink`): a chunk HDF5 still caches when a write fails
    for want of space crashes the process when the file is closed (upstream).
    ``cache=False`` opens without the chunk cache: a handle writing a dataset whose
    filters are lossy (scale-offset), where the cache would hand back the rows as written
    rather than as the file stores them.
    """
    if mode == "r" and _worker_info() is not None:
        try:
            return h5py.File(path, mode, locking=False)
        except (TypeError, ValueError):  # an h5py / HDF5 without the option
            pass
        except OSError as exc:
            # the file is open in this process with HDF5's lock already: a handle the
            # user's own h5py code held when the worker was forked
            if "locking flag" not in str(exc):
                raise
    return h5py.File(path, mode) if cache else h5py.File(path, mode, rdcc_nbytes=0)


def _worker_info() -> Any:
    from torch.utils.data import get_worker_info

    return get_worker_info()


def _listed(sources: weakref.WeakSet[Hdf5Source]) -> list[Hdf5Source]:
    """The sources in ``sources`` now. A weak set's iteration runs in Python: another
    thread adding a source meanwhile ends it with RuntimeError, so it is made again."""
    while True:
        try:
            return list(sources)
        except RuntimeError:
            continue


def _release_readers(writer: Hdf5Source) -> bool:
    """Let other sources of ``writer``'s file in this process drop their read-only handles
    (each under its own lock; they reopen on their next read). Returns whether any did.
    Sources that reach the file through an external link count: HDF5 keeps a linked file
    open read-only for as long as the linking file's handle holds its dataset."""
    pid, here = os.getpid(), file_identity(writer.path)
    released = False
    for src in _listed(_OPEN):
        if (
            src is writer
            or src._mode != "r"
            or src._file is None
            or src._pid != pid
            # (a source reached through an external link holds the linked file open too)
            or here not in {file_identity(w) for w in getattr(src, "watch_paths", (src.path,))}
        ):
            continue
        lock = src._guard()
        if not lock.acquire(timeout=10):  # busy reading in another thread for that long
            continue
        try:
            with contextlib.suppress(Exception):  # already closed by h5py
                src._file.close()
            src._file = src._ds = None
            _OPEN.discard(src)
            released = True
        finally:
            lock.release()
    return released


#: the sources' locks held by the forking thread from just before a fork until just after it
_FORK_HELD: list[threading.RLock] = []
#: writes begun on each file (by identity) in this process: a table checking where its
#: file ends does not trust HDF5's allocation if another table began a write meanwhile
_WRITE_STARTS: dict[Any, int] = {}
#: taken by every source while it opens its file, and by a fork's hook from before the fork
#: until just after it: no handle (with its HDF5 file lock) opens between the hook closing
#: the handles and the fork -- a child would inherit it, and the lock with it, so that this
#: process could not open the file for writing again while the child lives. (A source made
#: in another thread after the hook listed the sources used to slip through.)
_OPEN_GATE = [threading.Lock()]
#: whether this fork's hook holds the gate
_GATE_HELD = [False]
#: one fork's hooks at a time: a second thread's fork waits until the first is done (the
#: state above describes one fork; a second hook giving up on the gate would have left it
#: held for good, and every later open waiting on it)
_FORK_HOOK_LOCK = [threading.Lock()]
#: whether this fork's before-hook took that lock (hooks registered during a fork: not)
_HOOK_OWNED = [False]
#: how long a fork waits for a thread busy with one source before copying it as it is
_FORK_WAIT_S = 5.0
_FORK_HOOKS = [False]


def _before_fork() -> None:
    """Close every source's handles and hold each source's lock across the fork.

    Holding the locks keeps other threads from reopening a file between this hook and
    the fork itself: HDF5's list of open files is copied into the child, and a handle open
    there makes the child's own open fail ("file locking flag values don't match" in a
    DataLoader worker, which opens without HDF5's lock)."""
    _FORK_HOOK_LOCK[0].acquire()  # released by the after-fork hooks
    _HOOK_OWNED[0] = True
    _GATE_HELD[0] = _OPEN_GATE[0].acquire(timeout=_FORK_WAIT_S)
    held: list[threading.RLock] = []
    for src in _listed(_SOURCES):
        try:
            lock = src._guard()
        except Exception:  # noqa: BLE001 - a hook must not fail the fork
            continue
        if not _lock_for_fork(src, lock):
            continue  # busy that long, or waiting to open: the child opens its own handle
        held.append(lock)
        with contextlib.suppress(Exception):
            src._drop_handles()
    _FORK_HELD[:] = held


def _lock_for_fork(src: Hdf5Source, lock: threading.RLock) -> bool:
    """Take ``src``'s lock for a fork, waiting up to ``_FORK_WAIT_S`` for a thread using
    it; give up at once when that thread is waiting for the gate this hook holds to open
    the file (it has no handle open yet, and would wait for the hook)."""
    deadline = time.monotonic() + _FORK_WAIT_S
    while not lock.acquire(timeout=0.005):
        if (_GATE_HELD[0] and getattr(src, "_awaiting_gate", False)) or (
            time.monotonic() > deadline
        ):
            return False
    return True


def _after_fork_in_parent() -> None:
    try:
        held = list(_FORK_HELD)
        _FORK_HELD.clear()
        for lock in reversed(held):
            lock.release()
        if _GATE_HELD[0]:
            _GATE_HELD[0] = False
            _OPEN_GATE[0].release()
    finally:
        if _HOOK_OWNED[0]:
            _HOOK_OWNED[0] = False
            _FORK_HOOK_LOCK[0].release()


def _after_fork_in_child() -> None:
    _FORK_HELD.clear()  # the child makes its own locks (Hdf5Source._guard)
    # and its own gate: the parent's may be held by a thread that the child does not have
    _OPEN_GATE[0] = threading.Lock()
    _GATE_HELD[0] = False
    _FORK_HOOK_LOCK[0] = threading.Lock()
    _HOOK_OWNED[0] = False


def _register_fork_hooks() -> None:
    """Registered once h5py is imported, so that these run before h5py's own hooks (which
    take h5py's global lock): a thread reading a file can then finish before the fork."""
    if _FORK_HOOKS[0] or not hasattr(os, "register_at_fork"):
        return
    _FORK_HOOKS[0] = True
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def _object_key(obj: Any, h5py: ModuleType) -> tuple[Any, ...]:
    """One HDF5 object however it is reached: its file and header address."""
    home = os.path.realpath(obj.file.filename)
    addr = getattr(h5py.h5o.get_info(obj.id), "addr", None)
    return (home, addr) if addr is not None else (home, obj.name)


def _datasets_in(f: Any, h5py: ModuleType) -> list[str]:
    """The datasets of ``f``, each once (under the first name found), also those reached
    through external links, to a dataset or into a group (``visititems`` follows
    neither); a link whose target cannot be opened is left out, and a group reached
    again (an alias, a cycle of links) is not walked again."""
    names: list[str] = []
    found: set[tuple[Any, ...]] = set()
    walked: set[tuple[Any, ...]] = set()

    def add(name: str, obj: Any) -> None:
        key = _object_key(obj, h5py)
        if key not in found:
            found.add(key)
            names.append(name)

    def walk(group: Any, prefix: str) -> None:
        groups: list[tuple[str, Any]] = [("", group)]
        walked.add(_object_key(group, h5py))

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                add(prefix + name, obj)
            elif isinstance(obj, h5py.Group):
                walked.add(_object_key(obj, h5py))
                groups.append((name + "/", obj))

        group.visititems(visit)
        for sub, g in groups:
            for key in g:
                link = g.get(key, getlink=True)
                if not isinstance(link, h5py.ExternalLink):
                    continue
                try:
                    _check_links_on_path(g, h5py, key, key)
                    target = g.get(key)
                except (KeyError, OSError):  # its file or object is missing (or a pipe)
                    continue
                if isinstance(target, h5py.Dataset):
                    add(prefix + sub + key, target)
                elif isinstance(target, h5py.Group) and _object_key(target, h5py) not in walked:
                    walk(target, prefix + sub + key + "/")

    walk(f, "")
    return names


def _link_file_candidates(filename: str, home: str) -> list[str]:
    """Where HDF5 looks for an external link's file (``HDF5_EXT_PREFIX``, the folder of
    the linking file as it was opened -- not through its symbolic links --, the working
    folder; an absolute name as it is first)."""
    if os.path.isabs(filename):
        names, base = [filename], os.path.basename(filename)
    else:
        names, base = [], filename
    prefixes = [p for p in os.environ.get("HDF5_EXT_PREFIX", "").split(":") if p]
    folders = [*prefixes, os.path.dirname(os.path.abspath(home)), os.getcwd()]
    return names + [os.path.join(d, base) for d in folders]


def _check_link_file(link: Any, home: str, where: str) -> str | None:
    """Refuse an external link whose file is a named pipe, device or socket: HDF5 would
    open it and wait for ever. The file HDF5 will open, or None (missing: HDF5's own,
    ordinary error)."""
    for c in _link_file_candidates(link.filename, home):
        if os.path.exists(c) and not os.path.isfile(c):
            raise GadgetFileError(
                f"{where} is an external link to {link.filename}:{link.path}, and {c} is not a "
                "regular file (a named pipe, device or socket, which HDF5 would wait on for ever)"
            )
        if os.path.isfile(c):
            return c  # HDF5 opens the first it finds
    return None


def _check_links_on_path(f: Any, h5py: ModuleType, name: str, where: str) -> None:
    """Check every external link met on the way to ``name`` (see :func:`_check_link_file`)
    before ``f.get(name)`` follows them: soft links are followed (a few deep) and links
    inside a linked file too (each such file opened by itself, read-only)."""
    work: list[tuple[str | None, str]] = [(None, name)]
    for _ in range(16):  # (links of links: a cycle ends here, as in HDF5)
        if not work:
            return
        path, inner = work.pop()
        if path is None:
            _walk_links(f, h5py, inner, where, work, 0)
            continue
        try:
            with _OPEN_GATE[0]:  # (never between a fork's hook and the fork)
                other = h5py.File(path, "r")
        except (OSError, RuntimeError):
            continue  # HDF5's own error comes when the link is followed
        try:
            _walk_links(other, h5py, inner, where, work, 0)
        finally:
            with contextlib.suppress(Exception):
                other.close()


def _walk_links(
    root: Any, h5py: ModuleType, name: str, where: str, work: list[Any], depth: int
) -> None:
    group = root
    parts = [p for p in name.split("/") if p]
    for i, part in enumerate(parts):
        try:
            link = group.get(part, getlink=True)
        except (KeyError, OSError, RuntimeError):
            return
        if isinstance(link, h5py.ExternalLink):
            target = _check_link_file(link, group.file.filename, where)
            if target is not None:  # the rest of the way lies in that file
                work.append((target, "/".join([link.path.rstrip("/"), *parts[i + 1 :]])))
            return
        if isinstance(link, h5py.SoftLink) and depth < 8:
            target = link.path
            if not target.startswith("/"):
                target = group.name.rstrip("/") + "/" + target
            rest = "/".join([target.rstrip("/"), *parts[i + 1 :]])
            _walk_links(root, h5py, rest, where, work, depth + 1)
            return
        if i == len(parts) - 1:
            return
        try:
            group = group.get(part)
        except (KeyError, OSError, RuntimeError):
            return
        if not isinstance(group, h5py.Group):
            return


def _dangling_link(f: Any, h5py: ModuleType, name: str) -> str | None:
    """Where the external link ``name`` points, when it is one (None otherwise)."""
    try:
        link = f.get(name, getlink=True)
    except (KeyError, OSError):
        return None
    if isinstance(link, h5py.ExternalLink):
        return f"{link.filename}:{link.path}"
    return None


def _dangling_links(f: Any, h5py: ModuleType) -> dict[str, str]:
    """The external links at the top of ``f`` whose target cannot be opened, by name."""
    out = {}
    for name in f:
        try:
            _check_links_on_path(f, h5py, name, name)
            f[name]
        except (KeyError, OSError):
            target = _dangling_link(f, h5py, name)
            if target is not None:
                out[name] = target
    return out


def _missing_or_odd(places: list[str]) -> str:
    """Why none of ``places`` is a file HDF5 can read rows from (for a message)."""
    odd = [c for c in places if os.path.exists(c)]
    if odd:
        return f"is not a regular file ({odd[0]} is a folder, named pipe, device or socket)"
    return "cannot be found"


def _resolve_row_file(name: str, home: str, env: str, beside_home: bool) -> list[str]:
    """Where HDF5 looks for a file a dataset's rows live in, in its order: under the
    prefix in the environment variable ``env``, then (a virtual dataset's sources only)
    beside ``home``, then relative to the working directory."""
    if os.path.isabs(name):
        return [name]
    prefix = os.environ.get(env)
    out = [os.path.abspath(os.path.join(p, name)) for p in (prefix or "").split(os.pathsep) if p]
    if beside_home:
        out.append(os.path.join(os.path.dirname(os.path.abspath(home)), name))
    out.append(os.path.abspath(name))
    return out


def _rows_elsewhere(obj: Any, home: str, where: str, h5py: ModuleType) -> tuple[str, list[str]]:
    """For a dataset whose rows are stored outside its own file -- a virtual dataset (rows
    mapped from datasets in other files) or one with external raw storage -- what it is and
    the files its rows are read from; ``("", [])`` for an ordinary dataset.

    HDF5 reads rows whose file is missing (or cut short) as the fill value, which would pass
    for data: a missing source file, a missing source dataset, or an external file shorter
    than its segment raises :class:`GadgetFileError` instead."""
    files: list[str] = []
    if getattr(obj, "is_virtual", False):
        for src in obj.virtual_sources():
            name = src.file_name
            if name == "." or "%" in name:  # this file; a printf-style name pattern
                continue
            places = _resolve_row_file(name, home, "HDF5_VDS_PREFIX", True)
            found = [c for c in places if os.path.isfile(c)]
            if not found:
                raise GadgetFileError(
                    f"{where} is an HDF5 virtual dataset with rows in {name!r}, which "
                    f"{_missing_or_odd(places)} (HDF5 would read those rows as the fill value); "
                    "put that file back, or open the source datasets themselves"
                )
            path = found[0]
            try:
                # (under the open lock: a fork meanwhile must not copy this handle)
                with _OPEN_GATE[0], h5py.File(path, "r") as sf:
                    present = isinstance(sf.get(src.dset_name), h5py.Dataset)
            except OSError as exc:
                raise GadgetFileError(
                    f"{where} is an HDF5 virtual dataset with rows in {path}, which cannot be "
                    f"opened ({exc})"
                ) from None
            if not present:
                raise GadgetFileError(
                    f"{where} is an HDF5 virtual dataset with rows in {path}[{src.dset_name!r}], "
                    "which is not in that file (HDF5 would read those rows as the fill value)"
                )
            if path not in files:
                files.append(path)
        return "an HDF5 virtual dataset (its rows live in other files)", files
    external = getattr(obj, "external", None)
    if external:
        need = int(obj.size) * int(obj.dtype.itemsize)
        have = 0
        for name, offset, size in external:
            name = os.fsdecode(name)
            places = _resolve_row_file(name, home, "HDF5_EXTFILE_PREFIX", False)
            found = [c for c in places if os.path.isfile(c)]
            if not found:
                raise GadgetFileError(
                    f"{where} stores its rows in the external file {name!r}, which "
                    f"{_missing_or_odd(places)}"
                )
            path = found[0]
            have += max(0, min(int(size), os.path.getsize(path) - int(offset)))
            if path not in files:
                files.append(path)
        if have < need:
            raise GadgetFileError(
                f"{where} stores its rows in external files ({', '.join(files)}) that hold "
                f"{have} of the {need} bytes its rows need: truncated? (HDF5 would read the "
                "rest as zeros)"
            )
        return "an HDF5 dataset with external raw storage", files
    return "", files


def _exact_filters(obj: Any, h5py: ModuleType) -> bool:
    """Whether every filter of dataset ``obj`` is lossless (deflate, shuffle, fletcher32,
    szip, lzf); scale-offset, n-bit and filters from plugins may change what is written."""
    z = h5py.h5z
    lossless = {z.FILTER_DEFLATE, z.FILTER_SHUFFLE, z.FILTER_FLETCHER32, z.FILTER_SZIP, 32000}
    try:
        plist = obj.id.get_create_plist()
        return all(plist.get_filter(i)[0] in lossless for i in range(plist.get_nfilters()))
    except Exception:  # (a property list h5py cannot read: assume the worst)
        return False


class Hdf5Source(ArraySource):
    """Rows of one dataset in an HDF5 file.

    Parameters
    ----------
    path : str or path
    dataset : str, optional
        ``"group/name"`` of the array. Optional when the file holds exactly one dataset.
    mode : {'r', 'r+'}, default 'r'
        ``'r+'`` allows :meth:`write_rows` (write-through from a file-backed store).

    Attributes
    ----------
    dataset : str
        The resolved dataset name.
    chunked : bool
        Whether :attr:`chunk_rows` is the file's own chunking (reading fewer rows
        still costs a whole chunk), or just a read size for a contiguous dataset.

    Raises
    ------
    GadgetFileNotFoundError
        The path does not exist.
    GadgetFileError
        Not an HDF5 file, or it cannot be opened.
    GadgetKeyError
        ``dataset`` is not in the file (the message lists the datasets there), or it
        is omitted and the file holds more than one.
    GadgetTypeError
        The dataset's dtype cannot be a table.
    MissingDependencyError
        h5py is not installed.
    """

    format = "hdf5"
    supports_writes = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dataset: str | None = None,
        mode: str = "r",
        wide_unsigned: bool = False,
    ) -> None:
        h5py = import_h5py()
        self.path = os.fspath(path)
        if mode not in ("r", "r+"):
            raise GadgetValueError(f"mode must be 'r' or 'r+'; got {mode!r}")
        if not os.path.exists(self.path):
            raise GadgetFileNotFoundError(f"no such HDF5 file: {self.path}", self.path)
        if os.path.isdir(self.path):
            raise GadgetFileError(f"{self.path} is a directory, not an HDF5 file")
        if not is_hdf5(self.path):
            raise GadgetFileError(
                f"{self.path} is not an HDF5 file (no HDF5 signature); expected an .h5/.hdf5 file"
            )
        self._mode = mode
        self._closed = False
        self._awaiting_gate = False
        self._lock = threading.RLock()
        self._lock_pid = os.getpid()
        self._file: Any = None
        self._ds: Any = None
        self._pid = 0
        self._table: np.ndarray | None = None
        self._table_pid = 0
        self._fd = -1
        self._fd_pid = 0
        self._map: Any = None
        self._map_pid = 0
        #: the file size the mapped rows need (the end of the last row or allocated chunk)
        self._map_end = 0
        self._all_raw = False
        _SOURCES.add(self)  # (complete: a fork's hook may now close its handles)
        # the metadata is read under the source's lock: a fork's hook (another thread)
        # must not close the file in the middle of it
        with self._guard():
            f = self._open_file(h5py)
            try:
                # the listing opens every externally linked file: only when it is needed
                names = _datasets_in(f, h5py) if dataset is None else None
                if dataset is None:
                    assert names is not None
                    if not names:
                        broken = _dangling_links(f, h5py)
                        if broken:
                            raise GadgetFileError(
                                f"{self.path} holds no datasets it can open: its external "
                                f"links {broken} cannot be opened (is that file missing?)"
                            )
                        raise GadgetKeyError(
                            f"{self.path} holds no datasets: there is no table in it to open"
                        )
                    if len(names) != 1:
                        raise GadgetKeyError(
                            f"{self.path} holds {len(names)} datasets: {names}; pass dataset= "
                            "to choose one"
                        )
                    dataset = names[0]
                _check_links_on_path(f, h5py, dataset, f"{self.path}[{dataset!r}]")
                try:
                    obj = f.get(dataset)
                except (KeyError, OSError):  # an external link whose target cannot be opened
                    obj = None
                if not isinstance(obj, h5py.Dataset):
                    link = _dangling_link(f, h5py, dataset) if obj is None else None
                    if link is not None:
                        raise GadgetFileError(
                            f"{self.path}[{dataset!r}] is an external link to {link}, which cannot "
                            "be opened (is that file missing?)"
                        )
                    if names is None:
                        names = _datasets_in(f, h5py)
                    raise GadgetKeyError(
                        f"{self.path} has no dataset {dataset!r}; datasets in the file: {names}"
                    )
                home = os.path.realpath(obj.file.filename)
                #: reached through an external link: the rows live in another file, which is
                #: watched too; such a table is read-only (the other file may be open elsewhere
                #: in this process under its own name, and HDF5 opens it once per process)
                self.external = home != os.path.realpath(self.path)
                if not self.external:
                    self.dataset = obj.name.lstrip("/")
                else:  # its name is the other file's: keep the link's
                    self.dataset = dataset.strip("/")
                #: where an external link leads: (file, dataset in that file), for messages
                self.link_target: tuple[str, str] | None = (
                    (home, obj.name.lstrip("/")) if self.external else None
                )
                self.watch_paths: tuple[str, ...] = (
                    (self.path, home) if self.external else (self.path,)
                )
                #: a virtual dataset's or external raw storage's files: read only (writes would
                #: go into those files), and watched for replacement like the file itself
                self.stored_as, row_files = _rows_elsewhere(
                    obj, home, f"{self.path}[{dataset.strip('/')!r}]", h5py
                )
                self.watch_paths += tuple(p for p in row_files if p not in self.watch_paths)
                #: the dataset object itself (file and header address): soft links and other
                #: spellings of one dataset share caches and locks
                info = h5py.h5o.get_info(obj.id)
                addr = getattr(info, "addr", None)
                #: (the file by inode: a hard link reaches the same dataset)
                self.identity: tuple[Any, ...] = (
                    "hdf5",
                    file_identity(home),
                    addr if addr is not None else obj.name,
                )
                where = f"{self.path}[{self.dataset!r}]"
                self.dtype = table_dtype(
                    obj.dtype, obj.attrs.get(DTYPE_ATTR) == "bfloat16", where, wide_unsigned
                )
                #: a uint16/32/64 dataset opened with ``wide_unsigned`` (see NpySource)
                self.unsigned_bits = (
                    obj.dtype.newbyteorder("=")
                    if unsigned_carrier(obj.dtype, wide_unsigned) is not None
                    and obj.attrs.get(DTYPE_ATTR) != "bfloat16"
                    else None
                )
                if obj.shape is None or len(obj.shape) == 0:
                    what = "an empty (null) dataspace" if obj.shape is None else "a scalar"
                    raise GadgetValueError(f"{where} holds {what}; a table needs at least one axis")
                self.shape = tuple(int(s) for s in obj.shape)
                self._stored = obj.dtype
                chunks = obj.chunks
                self.chunked = chunks is not None
                #: the chunk shape (for the edge chunks a write makes HDF5 read)
                self._chunks = tuple(int(k) for k in chunks) if chunks is not None else ()
                if chunks is not None:
                    self.chunk_rows = int(chunks[0])
                else:
                    self.chunk_rows = max(1, _CONTIGUOUS_BLOCK_BYTES // max(1, self.row_nbytes))
                self._direct = self._direct_mode(obj, chunks)
                self.exact_writes = _exact_filters(obj, h5py)
            except BaseException as exc:
                self.close()
                if isinstance(exc, RuntimeError) and not isinstance(exc, GadgetError):
                    # h5py's error for damaged metadata (a heap or B-tree signature)
                    raise GadgetFileError(
                        f"cannot read HDF5 file {self.path}: its metadata is damaged or was "
                        f"changed while it was read, or its links form a cycle ({exc})"
                    ) from exc
                raise
            if self._mode == "r+" and not self.exact_writes:
                self._drop_handles()  # reopened without the chunk cache (see _h5_open)

    # ---- handles ----------------------------------------------------------------------
    def writes_in_place(self) -> bool:
        """Rows of a dataset behind an external link are not written in place."""
        return (
            bool(self.supports_writes)
            and not getattr(self, "external", False)
            and not getattr(self, "stored_as", "")
        )

    def read_only_reason(self) -> str | None:
        """Why rows cannot be written here: the dataset was reached through an external
        link, so its rows live in the linked file (written only by a table opened on that
        file). Says what was expected, what the link is and where to write instead; the
        file table adds its own advice (load the table into memory) after it."""
        if getattr(self, "external", False):
            home, name = self.link_target or (self.path, self.dataset)
            return (
                "rows are written only into the file the table opened, and "
                f"{self.path}[{self.dataset!r}] is an HDF5 external link to {home}[{name!r}]; "
                f"open {home} with dataset={name!r} to write those rows in place"
            )
        if getattr(self, "stored_as", ""):
            return (
                f"rows are written only into the file the table opened, and "
                f"{self.path}[{self.dataset!r}] is {self.stored_as}"
            )
        return None

    @property
    def write_unit_rows(self) -> int:
        """A chunked dataset's chunk length (HDF5 rewrites whole chunks); 1 for contiguous."""
        return self.chunk_rows if self.chunked else 1

    def check_write_edges(self, start: int, stop: int) -> None:
        """Read the edge chunks HDF5 reads when rows ``start:stop`` are written, though
        they are written whole: chunks reaching past the dataset's last row, or past its
        columns (a row split over chunks that do not divide it). A damaged one raises
        :class:`GadgetFileError` here, so a writer finds it before its first write. Only
        those chunks are read (about 32 MiB at a time)."""
        if not self.chunked or stop <= start:
            return
        c = self.chunk_rows
        n = self.shape[0]
        lo, hi = start // c * c, min(n, -(-stop // c) * c)
        spans: list[tuple[tuple[int, int], tuple[slice, ...]]] = []
        for axis, (size, k) in enumerate(zip(self.shape[1:], self._chunks[1:], strict=True)):
            if size % k:  # the last chunk along this axis sticks out
                idx = [slice(None)] * len(self.shape)
                idx[axis + 1] = slice(size // k * k, size)
                spans.append(((lo, hi), tuple(idx)))
        last = (n - 1) // c * c
        if n % c and stop > last:
            spans.append(((last, n), (slice(None),) * len(self.shape)))
        for (a, b), idx in spans:
            width = max(1, self.row_nbytes)
            step = max(c, (32 << 20) // width // c * c)
            for r in range(a, b, step):
                sel = (slice(r, min(b, r + step)), *idx[1:])
                try:
                    with self._guard():
                        self._dataset()[sel]
                except (OSError, RuntimeError, ValueError) as exc:
                    raise GadgetFileError(
                        f"{self.path}[{self.dataset!r}]: cannot read rows {r}:{min(b, r + step)} "
                        f"of an edge chunk a write rewrites ({exc})"
                    ) from exc

    def _open_file(self, h5py: ModuleType | None = None) -> Any:
        h5py = h5py or import_h5py()
        pid = os.getpid()
        if self._file is not None and self._pid != pid:
            _ABANDONED.append(
                (self._file, self._ds)
            )  # inherited through a fork: never close it here
            self._file = self._ds = None
        if self._file is None:
            # what the file looked like when this handle opened it (before: a change made
            # while it opens is seen at the next read)
            self._opened_key = self._stat_key()
            try:
                self._awaiting_gate = True  # (a fork's hook need not wait for this thread)
                with _OPEN_GATE[0]:  # never between a fork's hook and the fork
                    self._awaiting_gate = False
                    # (a writing handle of a lossy dataset reads what the file stores)
                    cache = not (self._mode == "r+" and not getattr(self, "exact_writes", True))
                    try:
                        self._file = _h5_open(h5py, self.path, self._mode, cache=cache)
                    except OSError as exc:
                        # HDF5 refuses 'r+' while this process holds the file open read-only
                        # (another table of the same file, say); those readers let go of
                        # their handles and reopen lazily ('r' beside an open 'r+' is allowed).
                        # Tried again also when none was found open: a reader's own thread
                        # may have closed its handle meanwhile (to reopen it, which waits for
                        # the gate held here)
                        if not (self._mode == "r+" and "already open for read-only" in str(exc)):
                            raise
                        _release_readers(self)
                        self._file = _h5_open(h5py, self.path, self._mode, cache=cache)
                    # listed while the gate is held: a writer opening the file next (which
                    # holds the gate) must find this handle to let it go
                    self._pid = pid
                    _OPEN.add(self)
            except OSError as exc:
                text = str(exc).lower()
                hint = (
                    " (is it open for writing elsewhere? HDF5 locks files while they are written)"
                    if "unable to lock" in text or "file locking" in text
                    else ""
                )
                raise GadgetFileError(
                    f"cannot open HDF5 file {self.path} (mode {self._mode!r}): {exc}{hint}"
                ) from exc
            self._pid = pid
            self._unflushed = False  # a handle just opened: the file is as HDF5 left it
            try:  # the file HDF5 opened, under any name (hard links share HDF5's file)
                held = os.fstat(self._file.id.get_vfd_handle())
                self._fid: Any = (held.st_dev, held.st_ino)
            except Exception:  # a driver without a file descriptor
                self._fid = file_identity(self.path)
            _OPEN.add(self)
            self._closed = False
            _SOURCES.add(self)
        return self._file

    def _dataset(self) -> Any:
        if self._ds is None or self._pid != os.getpid():
            f = self._open_file()
            if self._mode == "r+" and not getattr(self, "exact_writes", True):
                # a lossy dataset written here: without the chunk cache (per dataset, as
                # the file's own setting is shared with other open handles of the file),
                # so reads are what the file stores, not the rows as written. (Opened
                # only this way: HDF5 shares one cache between opens of a dataset.)
                h5py = import_h5py()
                dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
                dapl.set_chunk_cache(0, 0, 1.0)
                try:
                    ds = h5py.Dataset(h5py.h5d.open(f.id, self.dataset.encode(), dapl=dapl))
                except (KeyError, OSError, RuntimeError, ValueError):
                    ds = None
            else:
                ds = f.get(self.dataset)
            if (
                ds is None
                or not hasattr(ds, "shape")
                or tuple(ds.shape or ()) != self.shape
                or ds.dtype != self._stored
            ):
                got = "no such dataset" if ds is None else f"{ds.shape} {ds.dtype}"
                raise GadgetFileError(
                    f"{self.path}[{self.dataset!r}] changed since this table opened it (it held "
                    f"{self.shape} {self._stored}, now {got}); was the file rewritten? open it again"
                )
            self._ds = ds
        return self._ds

    def _others_writing(self) -> bool:
        """Whether another handle of this file in this process holds unflushed writes
        (HDF5 shares the file's allocation between them: its end may run ahead of the
        file until that handle flushes)."""
        fid = getattr(self, "_fid", None)
        pid = os.getpid()
        for src in _listed(_OPEN):
            if (
                src is not self
                and getattr(src, "_unflushed", False)
                and src._pid == pid
                and getattr(src, "_fid", None) == fid
            ):
                return True
        return False

    def _check_extent(self, ds: Any, start: int, stop: int) -> None:
        """Raise if the file holding ``ds`` (this one, or the target of an external link)
        is now shorter than rows ``start:stop`` are stored at, as this handle knows them:
        HDF5 reads past the end of a file as zeros, which would pass for rows. Truncated
        or replaced in place by a smaller file; a chunk another process moved is judged
        by where this process last saw it."""
        if self._mode == "r+" and getattr(self, "_unflushed", False):
            # this handle's own writes since its last flush: HDF5 may have placed a
            # rewritten (compressed) chunk past the file's current end and hold its bytes in
            # its chunk cache until the flush, so the file's size says nothing yet (the call
            # that wrote them checked the file before its first write)
            return
        try:
            size = os.fstat(ds.file.id.get_vfd_handle()).st_size
        except Exception:  # a driver without a file descriptor
            return
        need = 0
        fid = getattr(self, "_fid", None)
        started = _WRITE_STARTS.get(fid, 0)
        if (
            self._mode == "r+"
            and not getattr(self, "external", False)
            and not getattr(self, "_unflushed", False)
            and not self._others_writing()
        ):
            # a handle open for writing is the file's only writer (HDF5's lock): once its
            # writes are flushed (the file table flushes once per call) the end of the space
            # HDF5 has allocated is where the file ends; a truncation, or a smaller file
            # copied over it, ends before (between a call's writes the file may lag behind).
            # Not while another table of the file writes in this process: HDF5 shares the
            # allocation between the handles, and that table's call may not have flushed yet
            with contextlib.suppress(Exception):
                need = int(ds.file.id.get_filesize())
            if _WRITE_STARTS.get(fid, 0) != started:
                need = 0  # another table of the file began writing meanwhile
        if not self.chunked:
            offset = ds.id.get_offset()
            if offset is None:  # not allocated yet: fill values
                return
            need = max(
                need,
                int(offset) + self.num_rows * math.prod(self.shape[1:]) * self._stored.itemsize,
            )
        elif hasattr(ds.id, "get_chunk_info_by_coord"):
            c = self.chunk_rows
            # every chunk of the rows: a dataset may split its rows into several chunks too
            inner = itertools.product(
                *(range(0, n, step) for n, step in zip(self.shape[1:], ds.chunks[1:], strict=True))
            )
            corners = list(inner)
            for k in range(start // c, (max(stop, start + 1) - 1) // c + 1):
                for corner in corners:
                    try:
                        info = ds.id.get_chunk_info_by_coord((k * c, *corner))
                    except (KeyError, OSError, RuntimeError, ValueError):
                        continue
                    if info.byte_offset is not None:  # (None: not allocated)
                        need = max(need, int(info.byte_offset) + int(info.size))
        if size < need:
            exc = GadgetFileError(
                f"{self.path}: its file is {size} bytes, shorter than the rows {start}:{stop} "
                f"need ({need}); it was truncated or rewritten in place since this table "
                "opened it (HDF5 would read the missing bytes as zeros); open it again"
            )
            # a handle open for writing is the file's only writer: it was truncated, for
            # good (the file table lets it go, and every later call raises)
            exc.file_lost = self._mode == "r+"  # type: ignore[attr-defined]
            raise exc

    def _guard(self) -> threading.RLock:
        if self._lock_pid != os.getpid():  # a lock inherited through a fork may be held
            self._lock = threading.RLock()
            self._lock_pid = os.getpid()
        return self._lock

    def _plain_bytes(self, stored: np.dtype) -> bool:
        """Whether stored elements are the table's bytes as they are (native order, same type)."""
        if (
            stored.byteorder not in ("=", "|")
            and stored.byteorder != {"little": "<", "big": ">"}[sys.byteorder]
        ):
            return False
        return stored == numpy_dtype(self.dtype) or (
            self.dtype == torch.bfloat16 and stored.itemsize == 2
        )

    def _direct_mode(self, ds: Any, chunks: tuple[int, ...] | None) -> str | None:
        """``'raw'`` / ``'deflate'`` / ``'shuffle+deflate'`` when chunks may be read raw."""
        if chunks is None or tuple(chunks[1:]) != self.shape[1:]:
            return None
        if not hasattr(ds.id, "read_direct_chunk"):  # pragma: no cover - old h5py
            return None
        if not self._plain_bytes(ds.dtype):
            return None
        dcpl = ds.id.get_create_plist()
        filters = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
        if not filters:
            return "raw"
        if filters == [_H5Z_DEFLATE]:
            return "deflate"
        if filters == [_H5Z_SHUFFLE, _H5Z_DEFLATE]:
            return "shuffle+deflate"
        return None

    def close(self) -> None:
        with self._guard():
            self._drop_handles()
            self._closed = True
            _SOURCES.discard(self)

    def _drop_handles(self) -> None:
        """Close the file's handles and forget cached chunk positions (the source stays
        usable: the next read reopens). Done before every fork as well."""
        with self._guard():
            if self._file is not None:
                if self._pid == os.getpid():
                    with contextlib.suppress(Exception):  # already closed by h5py
                        self._file.close()
                else:
                    _ABANDONED.append((self._file, self._ds))
            self._file = self._ds = None
            if self._fd_pid == os.getpid() and self._fd >= 0:
                os.close(self._fd)
            self._fd, self._fd_pid = -1, 0
            self._table, self._table_pid = None, 0
            self._map, self._map_pid = None, 0
            _OPEN.discard(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(
            _file=None,
            _ds=None,
            _lock=None,
            _lock_pid=0,
            _awaiting_gate=False,
            _pid=0,
            _fd=-1,
            _fd_pid=0,
            _table=None,
            _table_pid=0,
            _map=None,
            _map_pid=0,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._lock_pid = os.getpid()
        self._closed = False
        _SOURCES.add(self)

    # ---- another process's writes ------------------------------------------------------
    def _stat_key(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _follow_other_writers(self) -> tuple[int, ...] | None:
        """A read-only handle (a DataLoader worker's, another table's) on a file that
        changed since it opened it -- another process (or table) wrote -- reopens it:
        HDF5 caches the file's chunk index, and a rewritten compressed chunk moves, so
        the old handle would read other bytes than the rows (even of rows never written).
        Returns the file's state as seen now. A file replaced by another is left to the
        checks that refuse it."""
        key = self._stat_key()
        if self._mode != "r":
            return key
        with self._guard():
            opened = getattr(self, "_opened_key", None)
            if (
                self._file is not None
                and key is not None
                and opened is not None
                and key != opened
                and key[0] == opened[0]
            ):
                if self._pid == os.getpid():
                    with contextlib.suppress(Exception):
                        self._file.close()
                else:
                    _ABANDONED.append((self._file, self._ds))
                self._file = self._ds = None
                self._table, self._table_pid = None, 0
                self._map, self._map_pid = None, 0
                _OPEN.discard(self)
                try:
                    self._dataset()  # reopened now: a file that no longer fits says so
                except GadgetFileError as exc:
                    if key[1] >= opened[1]:
                        raise
                    raise GadgetFileError(
                        f"{self.path} changed since this table opened it (it shrank from "
                        f"{opened[1]} to {key[1]} bytes) and no longer holds its rows as "
                        f"they were: truncated, replaced in place, or being written ({exc})"
                    ) from exc
        return key

    def check_unchanged(self) -> None:
        """Raise :class:`GadgetFileError` if the file of this read-only source shrank and no
        longer opens (truncated by another program). A file table calls this on every call,
        also one served from its cache of rows: an open handle on a file that changed is
        reopened (see :meth:`_follow_other_writers`), and a file that shrank since this
        source last opened it is opened again even while the source holds no handle (after
        a fork, or while another table of the file writes). A source open for writing is
        left to its reads and writes, which check the file's extent (:meth:`_check_extent`):
        between another table's writes to the same file HDF5's allocation may run ahead
        of the file. Only the file at :attr:`path` is watched, not an external link's
        target."""
        if self._mode != "r":
            return
        for attempt in range(_READ_ATTEMPTS):
            key = self._stat_key()
            try:
                self._check_read_only(key)
                return
            except GadgetFileError:
                # (another process may be writing the file: its state moves meanwhile)
                if attempt == _READ_ATTEMPTS - 1 or key is None or self._stat_key() == key:
                    raise

    def _check_read_only(self, key: tuple[int, ...] | None) -> None:
        if self._file is not None:
            if self._pid == os.getpid():
                self._follow_other_writers()
            return
        opened = getattr(self, "_opened_key", None)
        if opened is None or key is None or key[0] != opened[0] or key[1] >= opened[1]:
            return  # never opened, gone or replaced (the store's checks), or not smaller
        try:
            with self._guard():
                self._dataset()  # HDF5 refuses a file that ends before its own end
        except GadgetFileError as exc:
            raise GadgetFileError(
                f"{self.path} changed since this table opened it (it shrank from "
                f"{opened[1]} to {key[1]} bytes) and no longer holds its rows as they were: "
                f"truncated, replaced in place, or being written ({exc})"
            ) from exc

    def _reading(self, read: Callable[[], Any]) -> Any:
        """Run ``read`` for a read-only handle; if it fails while another process writes
        the file (its state changed meanwhile), reopen and read again (a few times)."""
        for attempt in range(_READ_ATTEMPTS):
            key = self._stat_key()
            try:
                self._follow_other_writers()  # (a reopen during a write may fail too)
                return read()
            except GadgetFileError:
                if (
                    self._mode != "r"
                    or attempt == _READ_ATTEMPTS - 1
                    or key is None
                    or self._stat_key() == key
                ):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- rows -----------------------------------------------------------------------------
    @property
    def concurrent_reads(self) -> bool:
        """Whether ``read_into`` may run in several threads at once: read-only handles on
        chunks read by file offset (the h5py calls left are serialised here)."""
        return self._mode == "r" and self._direct is not None

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        self._reading(lambda: self._read_into(start, stop, out))

    def _read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        out = as_bits(out, self.dtype)
        with self._guard():
            ds = self._dataset()
            if stop <= start:
                return
            table = self._chunk_table(ds) if self._direct is not None else None
        c = self.chunk_rows
        if table is not None:
            # whole chunks on the thread pool; partial ones at either end here
            first, last = -(-start // c), stop // c  # chunks [first, last) lie inside
            if stop == self.num_rows:
                last = -(-stop // c)
            # each guarded block takes the dataset handle anew: between two of them a
            # fork's hook may close the file (the next _dataset() reopens it)
            if last > first:
                if start < first * c:
                    with self._guard():
                        self._read_chunks(
                            self._dataset(), start, first * c, out[: first * c - start]
                        )
                ks = list(range(first, last))
                self.read_chunks(ks, out[first * c - start :], [k - first for k in ks])
                if last * c < stop:
                    with self._guard():
                        self._read_chunks(self._dataset(), last * c, stop, out[last * c - start :])
                return
        with self._guard():
            ds = self._dataset()
            if self._direct is not None:
                self._read_chunks(ds, start, stop, out)
            else:
                self._read_hyperslab(ds, start, stop, out)

    def _read_hyperslab(self, ds: Any, start: int, stop: int, out: np.ndarray) -> None:
        self._check_extent(ds, start, stop)
        try:
            ds.read_direct(out, np.s_[start:stop], np.s_[0 : stop - start])
        except OSError as exc:
            raise GadgetFileError(
                f"{self.path}[{self.dataset!r}]: cannot read rows {start}:{stop} ({exc})"
            ) from exc

    def _read_chunks(self, ds: Any, start: int, stop: int, out: np.ndarray) -> None:
        c = self.chunk_rows
        row_bytes = self.row_nbytes
        flat = out.reshape(-1).view(np.uint8)
        table = self._chunk_table(ds)
        fd = self._raw_fd() if table is not None else -1
        origin = (0,) * (len(self.shape) - 1)
        for k in range(start // c, (stop - 1) // c + 1):
            c0, c1 = k * c, min(self.num_rows, (k + 1) * c)
            lo, hi = max(c0, start), min(c1, stop)
            if lo != c0 or hi != c1 or c1 - c0 != c:
                self._read_hyperslab(ds, lo, hi, out[lo - start : hi - start])
                continue
            dst = flat[(c0 - start) * row_bytes : (c1 - start) * row_bytes]
            ok = False
            if table is None:
                self._check_extent(ds, c0, c1)  # (the chunk table path checks its reads)
            try:
                if table is not None:
                    ok = self._read_raw_chunk(fd, table, k, dst)
                elif self._direct == "raw":
                    mask, _ = ds.id.read_direct_chunk((c0, *origin), out=dst)
                    ok = mask == 0
                else:
                    mask, raw = ds.id.read_direct_chunk((c0, *origin))
                    ok = mask == 0 and self._decode(raw, dst)
            except (
                KeyError,
                OSError,
                ValueError,
                RuntimeError,
                MemoryError,  # (h5py's read_direct_chunk of an unallocated compressed chunk)
                zlib.error,
            ):  # unallocated chunk, ...
                ok = False
            if not ok:
                self._read_hyperslab(ds, c0, c1, out[c0 - start : c1 - start])

    def read_chunks(
        self, chunks: Sequence[int], out: np.ndarray, slots: Sequence[int] | None = None
    ) -> None:
        """Read whole chunks ``chunks[j]`` into ``out[slots[j] * chunk_rows :]`` (many at once).

        The rows of chunk ``k`` are ``k * chunk_rows`` up to the next chunk (or the
        end). With a read-only handle on raw chunks this is one ``preadv`` per chunk,
        spread over a thread pool.
        """
        self._reading(lambda: self._read_chunks_into(chunks, out, slots))

    def _read_chunks_into(
        self, chunks: Sequence[int], out: np.ndarray, slots: Sequence[int] | None
    ) -> None:
        out = as_bits(out, self.dtype)
        c = self.chunk_rows
        slots = list(range(len(chunks))) if slots is None else slots
        with self._guard():
            ds = self._dataset()
            table = self._chunk_table(ds) if self._direct is not None else None
            if table is None:
                for k, s in zip(chunks, slots, strict=True):
                    lo, hi = k * c, min((k + 1) * c, self.num_rows)
                    if hi > lo:
                        self._read_into(lo, hi, out[s * c : s * c + hi - lo])
                return
            # a private descriptor: close() (e.g. before a fork) may run while the pool
            # reads, and a reused descriptor number must never be read by mistake
            fd = os.dup(self._raw_fd())

        def one(k: int, s: int) -> None:
            lo, hi = k * c, min((k + 1) * c, self.num_rows)
            dst = out[s * c : s * c + hi - lo]
            ok = False
            if hi - lo == c:
                flat = dst.reshape(-1).view(np.uint8)
                try:
                    ok = self._read_raw_chunk(fd, table, k, flat)
                except (OSError, ValueError, zlib.error):
                    ok = False
            if not ok:
                with self._guard():  # the handle anew: a fork may have closed the file
                    self._read_hyperslab(self._dataset(), lo, hi, dst)

        # outside the guard: preadv and zlib release the GIL, and another read_into
        # (the next block of a load) may run meanwhile
        try:
            for_each_chunk(one, chunks, slots, c * self.row_nbytes)
        finally:
            os.close(fd)

    def gather_rows(self, ids: np.ndarray, out: np.ndarray) -> bool:
        """``out[i] = rows[ids[i]]`` (int64 ids in range, any order, repeats allowed), read
        through a memory map of the file where the rows are stored as plain bytes.

        Only for a read-only handle on an uncompressed dataset: chunked (every chunk the
        ids touch allocated, unfiltered and of full size, at the offsets of the chunk
        index, which is checked once) or contiguous (``id.get_offset``). The page cache
        is then the cache and one row costs one copy -- no per-row or per-chunk Python
        work, no h5py call. Returns False, having written nothing, where rows are not
        stored that way; callers then read whole chunks.
        """
        if self._mode != "r" or ids.size == 0 or self.row_nbytes == 0:
            return False
        plain = self._direct == "raw" if self.chunked else self._plain_bytes(self._stored)
        if not plain:
            return False
        self._follow_other_writers()
        with self._guard():
            rows = self._row_map()
            if rows is None:
                return False
            self._check_map_size()
            rb = self.row_nbytes
            dst = as_bits(out, self.dtype).reshape(ids.size, -1).view(np.uint8)
            if isinstance(rows, np.ndarray):  # contiguous: the rows in file order
                np.take(rows, ids, axis=0, out=dst)
                return True
            table, view = rows
            c = self.chunk_rows
            k = ids // c
            if not self._all_raw:
                entries = table[k]
                if (entries[:, 0] < 0).any() or (entries[:, 2] != 0).any():
                    return False
                if (entries[:, 1] != c * rb).any():
                    return False
            pos = table[k, 0] + (ids - k * c) * rb
            dst[...] = view[pos]  # one fancy index over rows starting at any byte offset
            return True

    def _check_map_size(self) -> None:
        """Raise if the file is now shorter than the mapped rows need: reading a mapped page
        past the end of a file kills the process (SIGBUS) instead of raising. A rewrite
        in place at the same or a larger size is not detected."""
        try:
            size = os.fstat(self._raw_fd()).st_size
        except OSError as exc:
            raise GadgetFileError(f"{self.path}: cannot check its size ({exc})") from exc
        if size < self._map_end:
            raise GadgetFileError(
                f"{self.path} shrank to {size} bytes since this table mapped its rows (they "
                f"need {self._map_end}); was it rewritten in place? open it again"
            )

    def _check_writes(self) -> None:
        """Forget cached chunk positions if any source of this file wrote since."""
        seen = _WRITES.get(self._realpath(), 0)
        if getattr(self, "_seen_writes", 0) != seen:
            self._seen_writes = seen
            self._table, self._table_pid = None, 0
            self._map, self._map_pid = None, 0

    def _realpath(self) -> str:
        real = getattr(self, "_real", None)
        if real is None:
            real = self._real = os.path.realpath(self.path)
        return real

    def _row_map(self) -> np.ndarray | tuple[np.ndarray, np.ndarray] | None:
        """The file's rows as memory-mapped bytes (built once per process), or None.

        Contiguous datasets: an ``(n, row_nbytes)`` uint8 array of the rows. Chunked
        ones: the chunk index and an ``(size - row_nbytes + 1, row_nbytes)`` view of the
        whole file whose row ``j`` starts at byte ``j``.
        """
        self._check_writes()
        if self._map_pid == os.getpid():
            return self._map
        self._map, self._map_pid, self._all_raw = None, os.getpid(), False
        self._map_end = 0
        ds = self._dataset()
        rb = self.row_nbytes
        try:
            size = os.fstat(self._raw_fd()).st_size
            if not self.chunked:
                offset = ds.id.get_offset()
                if offset is None or offset + self.num_rows * rb > size:
                    return None  # not allocated yet (all fill values), or a short file
                with os.fdopen(os.dup(self._raw_fd()), "rb") as fh:  # the file HDF5 reads
                    rows = np.memmap(
                        fh,
                        dtype=np.uint8,
                        mode="r",
                        offset=int(offset),
                        shape=(self.num_rows, rb),
                    )
                for r in {0, self.num_rows - 1}:  # trust the offset only if the bytes agree
                    want = np.empty((1, *self.shape[1:]), dtype=self._stored)
                    ds.read_direct(want, np.s_[r : r + 1], np.s_[0:1])
                    if want.tobytes() != rows[r].tobytes():
                        return None
                self._map, self._map_end = rows, int(offset) + self.num_rows * rb
                return self._map
            table = self._chunk_table(ds)
            if table is None or size < rb:
                return None
            alloc = table[:, 0] >= 0
            ends = table[alloc, 0] + table[alloc, 1]
            if (ends > size).any():
                return None  # an index pointing past the end: do not map
            with os.fdopen(os.dup(self._raw_fd()), "rb") as fh:  # the file HDF5 reads
                whole = np.memmap(fh, dtype=np.uint8, mode="r")
            self._map_end = int(ends.max()) if ends.size else 0
        except (OSError, ValueError):
            return None
        view = np.lib.stride_tricks.as_strided(
            whole, shape=(whole.size - rb + 1, rb), strides=(1, 1), writeable=False
        )
        c = self.chunk_rows
        self._all_raw = bool(
            alloc.all() and (table[:, 2] == 0).all() and (table[:, 1] == c * rb).all()
        )
        self._map = (table, view)
        return self._map

    # ---- reading chunks by file offset (read-only handles) --------------------------------------------
    def _chunk_table(self, ds: Any) -> np.ndarray | None:
        """Per chunk along the rows: (file offset, stored size, filter mask), or None.

        Built once per process for read-only handles (a writer may move chunks), and
        checked against ``read_direct_chunk`` before it is trusted.
        """
        if self._mode != "r" or not hasattr(ds.id, "chunk_iter"):
            return None
        self._check_writes()
        if self._table_pid == os.getpid():
            return self._table
        self._table, self._table_pid = None, os.getpid()
        n = -(-self.num_rows // self.chunk_rows)
        table = np.full((n, 3), -1, dtype=np.int64)
        c = self.chunk_rows

        def record(info: Any) -> None:
            table[info.chunk_offset[0] // c] = (info.byte_offset, info.size, info.filter_mask)

        try:
            ds.id.chunk_iter(record)
        except Exception:  # pragma: no cover - HDF5 without chunk iteration
            return None
        allocated = np.flatnonzero(table[:, 0] >= 0)
        if allocated.size:
            k = int(allocated[0])
            try:
                _, want = ds.id.read_direct_chunk((k * c,) + (0,) * (len(self.shape) - 1))
                got = os.pread(self._raw_fd(), int(table[k, 1]), int(table[k, 0]))
            except OSError:  # e.g. an index another process is rewriting: read through h5py
                return None
            if bytes(got) != bytes(want):  # e.g. a user block shifts addresses: do not trust
                return None
        self._table = table
        return table

    def _raw_fd(self) -> int:
        """This process's descriptor of the file HDF5 has open, opened by path and checked
        to be that same file: a save that replaced the file at :attr:`path` after the
        handle opened it must never have its rows read through the old file's chunk
        index (or mapped)."""
        if self._fd_pid != os.getpid():
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self._check_same_file(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._fd_pid = fd, os.getpid()
        return self._fd

    def _check_same_file(self, fd: int) -> None:
        """Raise :class:`GadgetFileError` if ``fd`` is not the file the HDF5 handle reads."""
        st = os.fstat(fd)
        try:
            held = os.fstat(self._dataset().file.id.get_vfd_handle())
            want = (held.st_dev, held.st_ino)
        except GadgetFileError:
            raise
        except Exception:  # a driver without a file descriptor: what the path held at open
            opened = getattr(self, "_opened_key", None)
            want = (st.st_dev, opened[0]) if opened is not None else (st.st_dev, st.st_ino)
        if (st.st_dev, st.st_ino) != want:
            raise GadgetFileError(
                f"{self.path} was replaced on disk by another file since this table opened "
                "it; open it again to read the new file"
            )

    def _read_raw_chunk(self, fd: int, table: np.ndarray, k: int, dst: np.ndarray) -> bool:
        offset, size, mask = (int(v) for v in table[k])
        if offset < 0 or mask != 0:
            return False
        if self._direct == "raw":
            if size != dst.nbytes:
                return False
            got = os.preadv(fd, [dst.data], offset)
        else:
            raw = os.pread(fd, size, offset)
            got = len(raw)
        if got < size:  # the file ends inside the chunk: it shrank since the table was made
            raise GadgetFileError(
                f"{self.path}: its file ends inside chunk {k} (bytes {offset}:{offset + size}, "
                f"{got} read); it was truncated or rewritten in place since this table opened "
                "it; open it again"
            )
        return True if self._direct == "raw" else self._decode(raw, dst)

    def _decode(self, raw: bytes, dst: np.ndarray) -> bool:
        data = zlib.decompress(raw)
        if len(data) != dst.nbytes:
            return False
        src = np.frombuffer(data, dtype=np.uint8)
        if self._direct == "shuffle+deflate":
            size = self._stored.itemsize
            dst.reshape(-1, size)[...] = src.reshape(size, -1).T
        else:
            dst[...] = src
        return True

    def write_rows(self, start: int, rows: np.ndarray) -> None:
        rows = as_bits(rows, self.dtype)
        if self._mode != "r+":
            raise ReadOnlyError(
                f"{self.path} was opened read-only; open it with mode='r+' to write"
            )
        stop = start + rows.shape[0]
        with self._guard():
            ds = self._dataset()
            self._check_extent(ds, start, stop)  # a shrunk file: refused before any write
            # counted before the write allocates: another table's check of the file's end
            # (below) then knows the allocation may run ahead of the file
            self._unflushed = True
            fid = getattr(self, "_fid", None)
            _WRITE_STARTS[fid] = _WRITE_STARTS.get(fid, 0) + 1
            try:
                ds.write_direct(
                    np.ascontiguousarray(rows), np.s_[0 : stop - start], np.s_[start:stop]
                )
            except (OSError, RuntimeError) as exc:  # a damaged chunk, a full disk
                # push what was written so far: while the handle holds unflushed writes the
                # truncation check stands aside, and no later flush may come on this path
                self._unflushed = True  # (rows may have been written before the error)
                with contextlib.suppress(Exception):
                    ds.file.flush()
                    self._unflushed = False
                raise GadgetFileError(
                    f"{self.path}[{self.dataset!r}]: cannot write rows {start}:{stop} ({exc})"
                ) from exc
            else:
                self._unflushed = True  # the file may end before HDF5's allocation until flushed
            finally:  # rows may have been written before an error, too
                real = self._realpath()
                _WRITES[real] = _WRITES.get(real, 0) + 1
            # (the file table flushes HDF5's caches once per write call: other tables of
            # this file read chunks by their file offsets, DataLoader workers the file)

    def flush(self) -> None:
        """Push written rows to the file (the OS may still hold them)."""
        with self._guard():
            if self._file is not None and self._pid == os.getpid() and self._mode == "r+":
                try:
                    self._file.flush()
                except (OSError, RuntimeError) as exc:  # a full disk
                    raise GadgetFileError(
                        f"{self.path}: cannot flush written rows ({exc})"
                    ) from exc
                self._unflushed = False


class Hdf5Sink(ArraySink):
    """Writes one chunked dataset into a new HDF5 file beside ``path``, renamed into place on commit.

    Parameters
    ----------
    path : str or path
    shape : tuple of int
    dtype : torch.dtype
    dataset : str, optional
        ``"group/name"`` of the array (default ``"data"``); groups are created.
    chunk_rows : int, optional
        Rows per chunk (default: about 1 MiB of rows). Chunks always span whole rows.
    compression : {None, 'gzip', 'lzf'}, optional
        A filter for every chunk (default none: fastest to read).
    compression_level : int, optional
        gzip's level (0-9).

    Notes
    -----
    The whole file is replaced on commit: other datasets in an existing file at
    ``path`` are not carried over.
    """

    format = "hdf5"

    def __init__(
        self,
        path: str | os.PathLike[str],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        dataset: str | None = None,
        chunk_rows: int | None = None,
        compression: str | None = None,
        compression_level: int | None = None,
    ) -> None:
        h5py = import_h5py()
        self.path = Path(path)
        self.shape = check_sink_target(self.path, shape)
        self.dtype = dtype
        self.dataset = check_dataset_name(dataset or None, "HDF5", self.path) or DEFAULT_DATASET
        comp = check_compression(compression, _COMPRESSIONS, "HDF5", self.path)
        compression_level = check_level(comp, compression_level, "HDF5", self.path, _COMPRESSIONS)
        npd = numpy_dtype(dtype)
        row_nbytes = int(np.prod(self.shape[1:], dtype=np.int64)) * npd.itemsize
        self.chunk_rows = default_chunk_rows(row_nbytes, self.shape[0], chunk_rows)
        if comp is None:  # whole chunks (the last one too), and an index entry for each
            n_chunks = -(-self.shape[0] // self.chunk_rows)
            check_free_space(self.path, n_chunks * (self.chunk_rows * row_nbytes + 64))
        self._tmp = temp_path_beside(self.path)
        # no chunk cache: the aligned writes hand HDF5 whole chunks, and a chunk that
        # HDF5 still caches when a write fails for want of space crashes the process
        # when the file is closed (upstream); uncached, the write itself raises.
        # No HDF5 file lock either: no one else opens the temporary file, and a process
        # forked while the save runs (a DataLoader worker) would inherit the lock and keep
        # it after the file is renamed into place, so that the saved file could not be
        # opened, even read-only, while that process lived
        try:
            self._f: Any = h5py.File(self._tmp, "w", rdcc_nbytes=0, locking=False)
        except (TypeError, ValueError):  # an h5py / HDF5 without the option
            self._f = h5py.File(self._tmp, "w", rdcc_nbytes=0)
        try:
            kwargs: dict[str, Any] = {}
            if comp is not None:
                kwargs["compression"] = comp
                if comp == "gzip" and compression_level is not None:
                    kwargs["compression_opts"] = int(compression_level)
            chunks = (
                (self.chunk_rows, *self.shape[1:]) if self.shape[0] and all(self.shape) else None
            )
            if chunks is None:
                kwargs.pop("compression", None)
                kwargs.pop("compression_opts", None)
            self._ds = self._f.create_dataset(
                self.dataset, shape=self.shape, dtype=npd, chunks=chunks, **kwargs
            )
            if dtype == torch.bfloat16:
                self._ds.attrs[DTYPE_ATTR] = "bfloat16"
        except BaseException:
            self.abort()
            raise
        self._aligner = ChunkAligner(
            self._write_raw, self.shape[0], self.chunk_rows, self.shape[1:], npd
        )

    def _write_raw(self, start: int, rows: np.ndarray) -> None:
        stop = start + rows.shape[0]
        with save_errors(self.path, f"write rows {start}:{stop}", also=(RuntimeError,)):
            self._ds.write_direct(
                np.ascontiguousarray(rows), np.s_[0 : stop - start], np.s_[start:stop]
            )

    def write(self, start: int, rows: np.ndarray) -> None:
        self._accept(start, rows)
        self._aligner.write(start, as_bits(rows, self.dtype))

    def commit(self) -> None:
        self._require_complete()
        self._aligner.flush()
        with save_errors(self.path, "flush the file", also=(RuntimeError,)):
            self._f.flush()
            self._f.close()
            self._f = None
            fd = os.open(self._tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        replace_atomically(self._tmp, self.path)

    def abort(self) -> None:
        if getattr(self, "_f", None) is not None:
            with contextlib.suppress(Exception):
                self._f.close()
            self._f = None
        remove_path(self._tmp)


def describe(path: str, dataset: str | None = None) -> str:
    """One line about an HDF5 table (for CLI messages)."""
    src = Hdf5Source(path, dataset=dataset)
    try:
        return f"{path}[{src.dataset!r}]: HDF5 {src.shape} {dtype_name(src.dtype)}"
    finally:
        src.close()
