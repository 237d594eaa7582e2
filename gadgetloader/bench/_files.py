"""File benchmarks: loading .npy / HDF5 / zarr into a store, and random rows from file-backed stores.

One run measures, on the same disk:

* the disk's sequential read rate: the .npy file read with large ``readinto`` calls;
* load throughput of each format into a pinned store (``cpu`` where CUDA is
  missing), as GB/s and as a fraction of that rate: the read into a store that is
  already allocated, and the whole ``DataGadget(path)`` including allocating (and,
  for ``pinned``, page-locking) the store;
* random-row ``getData`` from a ``file`` store whose chunk cache is smaller than
  the table, against what a user would write by hand: h5py fancy indexing
  (sorted ids, as h5py requires), zarr ``oindex`` and ``np.load(mmap_mode='r')[ids]``.

Files just written sit in the page cache, so every file is flushed and dropped
from it with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each timed sequential
read or load; the fraction of its pages still resident afterwards (``mincore``)
is reported, since some file systems (tmpfs, some overlays) cannot drop them.
Random-row reads run with a warm page cache for every method alike (they measure
the per-row cost of each method, not the disk). Every method's result is checked
against NumPy before it is timed; times are medians.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import importlib.util
import mmap
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._device import cuda_available, cupy_available
from .._errors import FallbackWarning, GadgetFileError, GadgetKeyError, GadgetValueError
from ..io import load_into, open_source
from ._common import (
    OptionError,
    comma_list,
    format_table,
    positive_finite_float,
    positive_int,
    seed_int,
)

__all__ = ["add_arguments", "run"]

_FORMATS = {"npy": ".npy", "hdf5": ".h5", "zarr": ".zarr"}
_DEFAULT_FORMATS = "npy,hdf5,zarr"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``gadgetloader bench files``."""
    p.add_argument(
        "--mb",
        type=positive_finite_float,
        default=256.0,
        help="table size in MB for the load test (default 256)",
    )
    p.add_argument(
        "--gb",
        type=positive_finite_float,
        default=None,
        help="table size in GB (overrides --mb; e.g. --gb 4)",
    )
    p.add_argument(
        "--width", type=positive_int, default=128, help="float32 elements per row (default 128)"
    )
    p.add_argument("--dir", default=None, help="directory for the test files (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the files afterwards")
    p.add_argument(
        "--formats",
        default=_DEFAULT_FORMATS,
        help="comma-separated subset of npy,hdf5,zarr (default: all three, less those whose "
        "library is not installed)",
    )
    p.add_argument(
        "--chunk-rows",
        type=positive_int,
        default=None,
        help="rows per chunk of the load-test files (default ~1 MiB)",
    )
    p.add_argument(
        "--compression",
        default=None,
        help="compression of the zarr files, load-test and random-read (default zstd)",
    )
    p.add_argument(
        "--random-mb",
        type=positive_finite_float,
        default=None,
        help="table size in MB for random reads (default: min(size, 256), so a --gb 4 run "
        "times the same random reads as the default run)",
    )
    p.add_argument(
        "--random-chunk-rows",
        type=positive_int,
        default=64,
        help="rows per chunk of the random-read files (default 64)",
    )
    p.add_argument(
        "--cache-mb",
        type=positive_finite_float,
        default=None,
        help="file store cache budget (default: 1/8 of the random table)",
    )
    p.add_argument(
        "--ids",
        type=positive_int,
        default=4096,
        help="distinct random ids per getData call (default 4096)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per method (median reported)"
    )
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (0 to 2**62)")
    p.add_argument("--no-baselines", action="store_true", help="skip the hand-written baselines")


# ---- page cache ---------------------------------------------------------------------------------
def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return [Path(d, f) for d, _, fs in os.walk(path) for f in fs]
    return [path]


def drop_cache(path: str | os.PathLike[str]) -> None:
    """fsync, then ask the kernel to drop ``path``'s pages (every file of a zarr directory)."""
    for f in _files_of(Path(path)):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_fraction(path: str | os.PathLike[str]) -> float | None:
    """Fraction of ``path``'s pages in the page cache (``mincore``), or None where unknown."""
    try:
        libc = _libc()
    except OSError:
        return None
    if libc is None or not hasattr(libc, "mincore"):
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for f in _files_of(Path(path)):
        size = f.stat().st_size
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
                total += pages
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return resident / total if total else None


def _sequential_read_s(path: Path, block: int = 16 << 20) -> float:
    buf = bytearray(block)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t0


def _warm(path: Path) -> None:
    """Read every file of ``path`` once, so its pages are in the page cache."""
    for f in _files_of(path):
        _sequential_read_s(f)


# ---- helpers ----------------------------------------------------------------------------------------
def _median_s(
    fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None
) -> float:
    times = []
    for _ in range(max(1, repeats)):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _table(rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((rows, width), dtype=np.float32)
    step = max(1, (64 << 20) // (width * 4))
    for s in range(0, rows, step):
        out[s : s + step] = rng.standard_normal((min(step, rows - s), width), dtype=np.float32)
    return out


def _write(
    table: np.ndarray, path: Path, fmt: str, chunk_rows: int | None, compression: str | None
) -> float:
    from ..gadget import DataGadget

    t0 = time.perf_counter()
    if fmt == "npy":
        try:
            np.save(path, table)
        except OSError as exc:  # NumPy says only "N requested and M written"
            raise GadgetFileError(
                f"cannot write {path}: {exc} (a full disk, or a file size limit?)"
            ) from exc
    else:
        g = DataGadget(table, placement="cpu")
        opts: dict[str, Any] = {}
        if chunk_rows:
            opts["chunk_rows"] = chunk_rows
        if compression and fmt == "zarr":
            opts["compression"] = compression
        g.save(path, progress=False, **opts)
        g.close()
    drop_cache(path)
    return time.perf_counter() - t0


def _placement() -> str:
    """``pinned`` where CUDA and CuPy are present, else ``cpu`` (said in the report)."""
    return "pinned" if cuda_available() and cupy_available() else "cpu"


# ---- the benchmark -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the file benchmark; prints tables and returns a JSON-able dict."""
    from ..gadget import DataGadget

    width = int(args.width)
    row_bytes = width * 4
    size = int((args.gb * 1e9) if args.gb else args.mb * 1e6)
    rows = max(16, size // row_bytes)
    rsize = int(args.random_mb * 1e6) if args.random_mb else min(rows * row_bytes, 256 * 10**6)
    rrows = max(16, rsize // row_bytes)
    cache = int(args.cache_mb * 1e6) if args.cache_mb else max(1, rrows * row_bytes // 8)
    formats = comma_list(str(args.formats), list(_FORMATS), "--formats")
    skipped: list[str] = []
    if str(args.formats) == _DEFAULT_FORMATS:
        # the default list times what this install can read; formats asked for by name
        # need their library (a one-line error naming the pip extra)
        for fmt, module, extra in (("hdf5", "h5py", "hdf5"), ("zarr", "zarr", "zarr")):
            if importlib.util.find_spec(module) is None:
                formats.remove(fmt)
                skipped.append(
                    f"{fmt}: {module} is not installed (pip install 'gadgetloader[{extra}]'; "
                    f"from a checkout: pip install -e '.[{extra}]')"
                )
    placement = _placement()
    device = torch.device("cuda") if cuda_available() else torch.device("cpu")
    if args.dir is not None and not os.path.isdir(args.dir):
        raise OptionError(f"--dir {args.dir}: no such directory")
    if args.compression is not None and "zarr" in formats:  # before any file is written
        from ..io._chunks import check_compression
        from ..io._zarr import _COMPRESSIONS as _ZARR_COMPRESSIONS

        try:
            check_compression(args.compression, _ZARR_COMPRESSIONS, "zarr", "--compression")
        except (GadgetKeyError, GadgetValueError) as exc:
            raise OptionError(str(exc)) from exc
    root = Path(tempfile.mkdtemp(prefix="gadgetloader-bench-", dir=args.dir))
    report: dict[str, Any] = {
        "config": {
            "table_bytes": rows * row_bytes,
            "rows": rows,
            "width": width,
            "dtype": "float32",
            "placement": placement,
            "device": str(device),
            "dir": str(root),
            "random_table_bytes": rrows * row_bytes,
            "random_rows": rrows,
            "random_chunk_rows": args.random_chunk_rows,
            "chunk_rows": args.chunk_rows,
            "zarr_compression": args.compression or "zstd",
            "cache_bytes": cache,
            "ids_per_call": min(args.ids, rrows),
            "repeats": args.repeats,
            "page_cache": "dropped (fsync + posix_fadvise DONTNEED) before every sequential read and load; "
            "warm for random reads",
        },
        "checks_passed": True,
        "skipped": skipped,
    }
    try:
        table = _table(rows, width, args.seed)
        # ---- files -------------------------------------------------------------------------------
        paths: dict[str, Path] = {}
        writes = []
        for fmt in ["npy", *[f for f in formats if f != "npy"]]:
            p = root / f"table{_FORMATS[fmt]}"
            secs = _write(table, p, fmt, args.chunk_rows, args.compression)
            paths[fmt] = p
            writes.append({"format": fmt, "GBps": table.nbytes / secs / 1e9, "seconds": secs})
        report["write"] = writes

        # ---- disk ---------------------------------------------------------------------------------
        npy = paths["npy"]
        drop_cache(npy)
        resident = resident_fraction(npy)
        disk_s = _median_s(lambda: _sequential_read_s(npy), args.repeats, lambda: drop_cache(npy))
        disk = npy.stat().st_size / disk_s / 1e9
        report["disk"] = {
            "read_GBps": disk,
            "file_bytes": npy.stat().st_size,
            "resident_after_drop": resident,
            "method": "sequential readinto of 16 MiB blocks after fsync + posix_fadvise(DONTNEED)",
        }

        # ---- loads --------------------------------------------------------------------------------
        loads = []
        for fmt in formats:
            p = paths[fmt]
            holder: list[Any] = []

            def load(p: Path = p, holder: list[Any] = holder) -> None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FallbackWarning)
                    holder.append(DataGadget(p, placement=placement, progress=False))

            def fresh(p: Path = p, holder: list[Any] = holder) -> None:
                # the previous run's table is freed untimed: a user's load frees nothing
                while holder:
                    holder.pop().close()
                drop_cache(p)

            # what a user runs: DataGadget(path) allocates (and page-locks) the store too
            secs_alloc = _median_s(load, args.repeats, fresh)
            ok = bool(np.array_equal(holder[0].getNumpyVersion(copy=False), table))
            store = holder[0].store  # reused: the read alone, into a store already allocated

            def read_into(p: Path = p, store: Any = store) -> None:
                source = open_source(p)
                try:
                    load_into(source, store, progress=False)
                finally:
                    source.close()

            secs = _median_s(read_into, args.repeats, functools.partial(drop_cache, p))
            ok &= bool(np.array_equal(holder[0].getNumpyVersion(copy=False), table))
            while holder:
                holder.pop().close()
            report["checks_passed"] &= ok
            gb = table.nbytes / secs / 1e9
            loads.append(
                {
                    "format": fmt,
                    "GBps": gb,
                    "fraction_of_disk": gb / disk,
                    "seconds": secs,
                    "GBps_with_alloc": table.nbytes / secs_alloc / 1e9,
                    "fraction_of_disk_with_alloc": table.nbytes / secs_alloc / 1e9 / disk,
                    "checked": ok,
                }
            )
        report["load"] = loads

        # ---- random rows ----------------------------------------------------------------------------------
        rtable = table[:rrows] if rrows <= rows else _table(rrows, width, args.seed + 1)
        rpaths: dict[str, Path] = {}
        for fmt in formats:
            p = root / f"random{_FORMATS[fmt]}"
            _write(rtable, p, fmt, args.random_chunk_rows, args.compression)
            _warm(p)  # random reads run on a warm page cache, for every method alike
            rpaths[fmt] = p
        n_ids = min(args.ids, rrows)
        rng = np.random.default_rng(args.seed + 2)
        id_sets = [rng.choice(rrows, size=n_ids, replace=False) for _ in range(args.repeats + 2)]
        report["random"] = _random_reads(
            rpaths, rtable, id_sets, cache, device, not args.no_baselines
        )
        report["checks_passed"] &= all(r["checked"] for r in report["random"])
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    _print(report)
    return report


def _random_reads(
    paths: dict[str, Path],
    table: np.ndarray,
    id_sets: list[np.ndarray],
    cache: int,
    device: torch.device,
    baselines: bool,
) -> list[dict[str, Any]]:
    from ..gadget import DataGadget

    results: list[dict[str, Any]] = []
    n = id_sets[0].size
    nbytes = n * table.shape[1] * table.itemsize

    def timed(
        fmt: str, method: str, fn: Callable[[np.ndarray], torch.Tensor], ref_sorted: bool
    ) -> dict[str, Any]:
        first = id_sets[0]
        want = table[np.sort(first)] if ref_sorted else table[first]
        got = fn(first)
        ok = bool(np.array_equal(got.cpu().numpy(), want))
        it: Iterator[np.ndarray] = iter(id_sets[1:])
        secs = _median_s(lambda: fn(next(it)), len(id_sets) - 1)
        return {
            "format": fmt,
            "method": method,
            "ms": secs * 1e3,
            "rows_per_s": n / secs,
            "GBps": nbytes / secs / 1e9,
            "checked": ok,
        }

    for fmt, p in paths.items():
        g = DataGadget(p, placement="file", cache_bytes=cache, device=device)
        ours = timed(fmt, "gadgetloader file store", g.getData, False)
        ours["cache_bytes"] = cache
        ours["cache_hits"] = g.store.stats["hits"]  # type: ignore[attr-defined]
        ours["cache_misses"] = g.store.stats["misses"]  # type: ignore[attr-defined]
        results.append(ours)
        if baselines:
            base = _baseline(fmt, p, timed, device)
            if base is not None:
                ours["speedup_vs_baseline"] = base["ms"] / ours["ms"]
                results.append(base)
        g.close()
    return results


def _baseline(
    fmt: str, path: Path, timed: Callable[..., dict[str, Any]], device: torch.device
) -> dict[str, Any] | None:
    if fmt == "npy":
        mm = np.load(path, mmap_mode="r")
        return timed(
            fmt,
            "np.load(mmap_mode='r')[ids]",
            lambda ids: torch.from_numpy(mm[ids]).to(device),
            False,
        )
    if fmt == "hdf5":
        import h5py

        f = h5py.File(path, "r")
        ds = f["data"]
        try:
            return timed(
                fmt,
                "h5py ds[sorted ids]",
                lambda ids: torch.from_numpy(ds[np.sort(ids)]).to(device),
                True,
            )
        finally:
            f.close()
    if fmt == "zarr":
        import zarr

        z = zarr.open_array(str(path), mode="r")
        return timed(
            fmt, "zarr z.oindex[ids]", lambda ids: torch.from_numpy(z.oindex[ids]).to(device), False
        )
    return None


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    disk = report.get("disk", {})
    print(
        f"files: {cfg['rows']} x {cfg['width']} float32 ({cfg['table_bytes'] / 1e9:.3f} GB) in {cfg['dir']}; "
        f"loads into placement={cfg['placement']!r}"
    )
    if disk:
        res = disk.get("resident_after_drop")
        res_s = "unknown" if res is None else f"{res:.0%}"
        print(
            f"disk sequential read: {disk['read_GBps']:.2f} GB/s (pages resident after drop: {res_s})"
        )
    if report.get("load"):
        print(
            format_table(
                [
                    "format",
                    "read into store GB/s",
                    "fraction of disk",
                    "incl. allocation GB/s",
                    "fraction",
                    "checked",
                ],
                [
                    [
                        r["format"],
                        r["GBps"],
                        r["fraction_of_disk"],
                        r["GBps_with_alloc"],
                        r["fraction_of_disk_with_alloc"],
                        r["checked"],
                    ]
                    for r in report["load"]
                ],
            )
        )
    if report.get("random"):
        print(
            f"random getData: {cfg['ids_per_call']} distinct ids per call from {cfg['random_rows']} rows "
            f"({cfg['random_table_bytes'] / 1e6:.1f} MB, chunks of {cfg['random_chunk_rows']} rows), "
            f"file-store cache {cfg['cache_bytes'] / 1e6:.1f} MB, page cache warm"
        )
        print(
            format_table(
                ["format", "method", "ms", "rows/s", "speedup", "checked"],
                [
                    [
                        r["format"],
                        r["method"],
                        r["ms"],
                        r["rows_per_s"],
                        r.get("speedup_vs_baseline"),
                        r["checked"],
                    ]
                    for r in report["random"]
                ],
            )
        )
    for line in report.get("skipped", []):
        print(f"skipped: {line}")
    print(f"all results checked against NumPy: {report['checks_passed']}")
