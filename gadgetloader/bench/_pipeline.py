"""The input-pipeline benchmark: GPU batches per second, four ways, side by side.

(a) the per-sample torch way a user would write: a ``Dataset`` over
``np.load(mmap_mode='r')``, ``DataLoader(batch_size=B, shuffle=True,
pin_memory=True)`` with 0 workers and the best of a few worker counts, then
``.cuda()``; (b) ``DataLoader(GadgetDataset)``, the default form; (c) the fast form
with a :class:`~gadgetloader.GadgetSampler` as batch sampler (its default read-ahead;
(c1) the same with ``coalesce=1``, every batch gathered when asked for); (d)
:class:`~gadgetloader.GadgetLoader` with GPU prefetch; (e) the dataset's own share of
(c): ``__getitems__`` on each sampler batch, without DataLoader. (b)-(e) run over the
table in RAM (``pinned``; ``cpu`` without CUDA) and file-backed (``placement='file'``,
where that placement exists). The report also gives each source's column routes (see
``GadgetDataset``: ``kernel`` is one launch per batch), the sampler's own time per
batch, and the time torch's ``RandomSampler`` + ``BatchSampler`` take to build one
batch's list of ids, which (b) spends before any gadgetloader code runs (its
ratio to (c)'s time a batch is a floor under (b)'s ratio).

Every row of the table encodes its own row number in its first three elements,
so each method's first batch is checked against the file with NumPy before it
is timed, whatever order it drew. The pinned memcpy ceiling is measured in the
same run; on CUDA every method is also reported as a fraction of it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from ._common import (
    OptionError,
    comma_list,
    format_table,
    measure_memcpy,
    non_negative_int,
    positive_float,
    positive_int,
    seed_int,
)

__all__ = ["add_arguments", "run"]

_DTYPES = ("float32", "float64", "float16", "int32", "int64")
_BASE = 256  # row ids are written in base 256 over 3 elements: exact in every dtype above


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rows", type=positive_int, default=1 << 20, help="table rows (default 1,048,576)"
    )
    p.add_argument(
        "--width", type=positive_int, default=128, help="elements per row (default 128, >= 3)"
    )
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="table dtype")
    p.add_argument(
        "--batch",
        type=positive_int,
        default=4096,
        help="rows per batch (default 4096; at most --rows)",
    )
    p.add_argument(
        "--batches",
        type=positive_int,
        default=1024,
        help="timed batches per run, at most (default 1024: whole epochs of the default table, "
        "so per-epoch costs such as the next shuffle count in full)",
    )
    p.add_argument(
        "--seconds",
        type=positive_float,
        default=2.0,
        help="stop a timed run after this long (default 2)",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per method (median)")
    p.add_argument(
        "--workers",
        default="0,2,4,8",
        help="worker counts tried for the per-sample torch DataLoader (default 0,2,4,8)",
    )
    p.add_argument(
        "--sources",
        default="memory,file",
        help="where gadgetloader reads: memory (pinned / cpu) and/or file (default both)",
    )
    p.add_argument(
        "--prefetch",
        type=non_negative_int,
        default=2,
        help="GadgetLoader prefetch depth (0: gather each batch when it is asked for)",
    )
    p.add_argument(
        "--coalesce",
        type=positive_int,
        default=None,
        help="batches per GadgetLoader gather (default: the loader's own: on CUDA as many as fit in 64 MiB, up to 32; 8 for file columns)",
    )
    p.add_argument("--dir", default=None, help="directory for the benchmark's .npy file")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (0 to 2**62)")


# ---- the table ---------------------------------------------------------------------------------
def _write_table(path: str, rows: int, width: int, dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if rows * width * np.dtype(dtype).itemsize >= 1 << 63:  # (NumPy would warn, then refuse)
        raise MemoryError(f"a {rows} x {width} {dtype} table: more than 2**63 bytes")
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.dtype(dtype), shape=(rows, width))
    step = max(1, (32 << 20) // (width * arr.dtype.itemsize))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        block = rng.integers(0, 100, size=(stop - start, width)).astype(arr.dtype)
        ids = np.arange(start, stop)
        block[:, 0] = ids // (_BASE * _BASE)
        block[:, 1] = (ids // _BASE) % _BASE
        block[:, 2] = ids % _BASE
        arr[start:stop] = block
    arr.flush()
    del arr


def _check_batch(batch: torch.Tensor, ref: np.ndarray, expect_rows: int) -> bool:
    """The batch's rows equal the file's rows whose numbers they encode."""
    host = batch.detach().cpu().numpy()
    if host.shape != (expect_rows, ref.shape[1]):
        return False
    ids = (
        host[:, 0].astype(np.int64) * _BASE * _BASE
        + host[:, 1].astype(np.int64) * _BASE
        + host[:, 2].astype(np.int64)
    )
    if ids.min() < 0 or ids.max() >= ref.shape[0]:
        return False
    return bool(np.array_equal(host, np.asarray(ref[ids])))


# ---- (a) the per-sample torch way ---------------------------------------------------------------
class _NpyRows(Dataset[torch.Tensor]):
    """What a user writes: one row per ``__getitem__`` from a memory-mapped .npy."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows = int(np.load(path, mmap_mode="r").shape[0])
        self.arr: np.ndarray | None = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.arr is None:  # opened in each worker
            self.arr = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.array(self.arr[i]))


# ---- timing ------------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _endless(make_iter: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    while True:
        yield from make_iter()


def _same(obj: Any) -> Any:
    return obj


def _first(batch: Any) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _shut_down(loader: Any) -> None:
    """End a baseline DataLoader's worker processes (and its pin-memory thread) now.
    Left alive (persistent workers), they halved every later method's measured rate on
    the H200 host (GadgetLoader 47 -> 118 us a batch), so no method is timed beside them."""
    it = getattr(loader, "_iterator", None)
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
    loader._iterator = None
    gc.collect()


def _dataset_calls(ds: Any, sampler: Any) -> Iterator[Any]:
    """What (c)'s DataLoader asks of the dataset, without DataLoader: one ``__getitems__``
    per sampler batch."""
    for ids in sampler:
        yield ds.__getitems__(ids)[0]


def _sampler_us(sampler: Any, seconds: float) -> float | None:
    """CPU microseconds per batch of iterating ``sampler`` alone: the batches after each
    pass's first (which may wait for the epoch's order)."""
    done, spent, t_end = 0, 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        it = iter(sampler)
        if next(it, None) is None:
            break
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        spent += time.perf_counter() - t0
        done += n
        if n == 0:
            break
    return spent / done * 1e6 if done else None


def _time_method(
    make_iter: Callable[[], Iterable[Any]],
    move: Callable[[Any], torch.Tensor],
    *,
    batch: int,
    batches: int,
    seconds: float,
    repeats: int,
) -> tuple[float, float]:
    """Median rows per second and median microseconds per batch over ``repeats`` runs
    of up to ``batches`` batches (the clock stops after a device synchronisation)."""
    stream = _endless(make_iter)
    for _ in range(2):  # warm-up: worker start, first epoch order, allocator
        move(next(stream))
    _sync()
    rates, per_batch = [], []
    for _ in range(repeats):
        rows = done = 0
        t0 = time.perf_counter()
        for _ in range(batches):
            out = move(next(stream))
            rows += out.shape[0]
            done += 1
            if time.perf_counter() - t0 > seconds:
                break
        _sync()
        elapsed = time.perf_counter() - t0
        rates.append(rows / elapsed)
        per_batch.append(elapsed / done * 1e6)
    return statistics.median(rates), statistics.median(per_batch)


# ---- the benchmark -----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the pipeline benchmark; returns a JSON-able dict and prints a table."""
    from .._device import cupy_available
    from ..data import GadgetDataset, GadgetLoader, GadgetSampler
    from ..data._sampler import chunk_rows_of
    from ..gadget import DataGadget

    if args.width < 3:
        raise OptionError(f"--width must be >= 3 (rows carry their id); got {args.width}")
    if args.rows >= _BASE**3:
        raise OptionError(f"--rows must be < {_BASE**3}; got {args.rows}")
    if args.dir is not None and not os.path.isdir(args.dir):
        raise OptionError(f"--dir {args.dir}: no such directory")
    try:
        worker_counts = {int(w) for w in str(args.workers).split(",") if w.strip() != ""}
    except ValueError:
        raise OptionError(
            f"--workers must be comma-separated whole numbers; got {args.workers!r}"
        ) from None
    if not worker_counts:
        raise OptionError(
            f"--workers must name at least one worker count (0 is always timed); got {args.workers!r}"
        )
    if any(w < 0 for w in worker_counts):
        raise OptionError(f"--workers must not be negative; got {args.workers!r}")
    sources = comma_list(str(args.sources), ("memory", "file"), "--sources")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    row_bytes = args.width * np.dtype(args.dtype).itemsize
    B = min(args.batch, args.rows)
    workers = sorted(worker_counts | {0})
    timing = {"batch": B, "batches": args.batches, "seconds": args.seconds, "repeats": args.repeats}
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    routes: dict[str, list[str]] = {}
    sampler_us: dict[str, float | None] = {}
    tmp = tempfile.mkdtemp(prefix="gadgetloader-pipeline-", dir=args.dir)
    try:
        path = os.path.join(tmp, "table.npy")
        _write_table(path, args.rows, args.width, args.dtype, args.seed)
        ref = np.load(path, mmap_mode="r")
        link = measure_memcpy(min(1 << 30, max(64 << 20, args.rows * row_bytes))) if cuda else {}
        limit = link.get("h2d_GBps")

        def record(
            source: str,
            method: str,
            make_iter: Callable[[], Iterable[Any]],
            move: Callable[[Any], torch.Tensor],
            **extra: Any,
        ) -> None:
            entry: dict[str, Any] = {"source": source, "method": method, **extra}
            try:
                first = move(next(iter(make_iter())))
                _sync()
                entry["check"] = "ok" if _check_batch(first, ref, B) else "MISMATCH"
                if entry["check"] == "ok":
                    rate, us = _time_method(make_iter, move, **timing)  # type: ignore[arg-type]
                    entry["rows_per_s"] = rate
                    entry["us_per_batch"] = us
                    entry["GBps"] = rate * row_bytes / 1e9
                    entry["of_limit"] = entry["GBps"] / limit if limit else None
            except Exception as exc:  # report, keep benchmarking the others
                entry["check"] = "error"
                entry["error"] = f"{type(exc).__name__}: {exc}"
            results.append(entry)

        # what the default form (b) spends in torch before any gadgetloader code runs:
        # DataLoader(shuffle=True) builds each batch as a list of ints from these two
        sampler_us["torch RandomSampler + BatchSampler"] = _sampler_us(
            BatchSampler(RandomSampler(range(args.rows)), B, drop_last=False),
            min(args.seconds, 0.5),
        )
        # (b)-(d) gadgetloader, per source
        file_ok = _file_placement_available()
        for source in sources:
            if source == "memory":
                where = "pinned" if cuda and cupy_available() else "cpu"
                label = f"memory ({where})"
                options: dict[str, Any] = {}
            elif source == "file":
                if not file_ok:
                    skipped.append("file: the 'file' placement is not available in this build")
                    continue
                where, label, options = "file", "file (npy)", {}
            else:
                skipped.append(f"unknown source {source!r} (expected memory, file)")
                continue
            try:
                gadget = DataGadget(path, placement=where, device=dev, **options)
            except Exception as exc:
                skipped.append(f"{label}: {type(exc).__name__}: {exc}")
                continue
            with contextlib.closing(gadget):
                ds = GadgetDataset(gadget, device=dev)

                def first_col(b: Any) -> torch.Tensor:
                    return _first(b)

                record(
                    label,
                    "(b) DataLoader(GadgetDataset) default",
                    functools.partial(DataLoader, ds, batch_size=B, shuffle=True),
                    first_col,
                )
                orders = ["random"]
                if where == "file" and chunk_rows_of(gadget.store):
                    orders.append("chunk")
                for order in orders:
                    sampler = GadgetSampler(ds, batch_size=B, order=order, seed=args.seed)
                    record(
                        label,
                        f"(c) DataLoader + GadgetSampler ({order})",
                        functools.partial(DataLoader, ds, batch_sampler=sampler),
                        first_col,
                    )
                    one = GadgetSampler(ds, batch_size=B, order=order, seed=args.seed, coalesce=1)
                    record(
                        label,
                        f"(c1) DataLoader + GadgetSampler coalesce=1, no read-ahead ({order})",
                        functools.partial(DataLoader, ds, batch_sampler=one),
                        first_col,
                    )
                    gl = GadgetLoader(
                        ds,
                        batch_size=B,
                        order=order,
                        seed=args.seed,
                        prefetch=args.prefetch,
                        coalesce=args.coalesce,
                    )
                    record(
                        label,
                        f"(d) GadgetLoader prefetch={args.prefetch} coalesce={gl._coalesce} ({order})",
                        functools.partial(_same, gl),
                        first_col,
                    )
                    own = GadgetSampler(ds, batch_size=B, order=order, seed=args.seed)
                    record(
                        label,
                        f"(e) __getitems__ per sampler batch, no DataLoader ({order})",
                        functools.partial(_dataset_calls, ds, own),
                        first_col,
                    )
                    sampler_us[f"{label} {order}"] = _sampler_us(own, min(args.seconds, 0.5))
                routes[label] = list(ds._routes())
                del ds
        # the torch baseline runs last: after its worker processes had run, every method
        # timed in the same process measured 2-3x slower on the H200 host (cause not found;
        # shutting the workers down did not help), so it must not precede the others
        # (a) per-sample torch DataLoader over np.load(mmap_mode='r')
        rows_ds = _NpyRows(path)

        def to_dev(b: Any) -> torch.Tensor:
            return b.to(dev, non_blocking=True)

        best_torch: dict[str, Any] | None = None
        for w in workers:
            loader = DataLoader(
                rows_ds,
                batch_size=B,
                shuffle=True,
                pin_memory=cuda,
                num_workers=w,
                persistent_workers=w > 0,
            )
            try:
                record(
                    "npy mmap",
                    "(a) torch per-sample DataLoader",
                    functools.partial(_same, loader),
                    to_dev,
                    workers=w,
                )
            finally:
                _shut_down(loader)
            entry = results[-1]
            if "rows_per_s" in entry and (
                best_torch is None or entry["rows_per_s"] > best_torch["rows_per_s"]
            ):
                best_torch = entry

    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results.sort(key=lambda r: r["source"] != "npy mmap")  # report the baseline first
    base = best_torch["rows_per_s"] if best_torch else None
    for r in results:
        if "rows_per_s" in r and base:
            r["x_torch"] = r["rows_per_s"] / base

    def rate(prefix: str, source_prefix: str = "memory") -> float | None:
        vals = [
            r["rows_per_s"]
            for r in results
            if r["method"].startswith(prefix)
            and r["source"].startswith(source_prefix)
            and "rows_per_s" in r
        ]
        return max(vals) if vals else None

    fast, default = rate("(c)"), rate("(b)")
    torch_sampler_us = sampler_us.get("torch RandomSampler + BatchSampler")
    summary = {
        "best_torch_rows_per_s": base,
        "best_torch_workers": best_torch["workers"] if best_torch else None,
        "memory_fast_x_torch": fast / base if fast and base else None,
        "memory_fast_of_limit": (fast * row_bytes / 1e9) / limit if fast and limit else None,
        "memory_default_vs_fast": fast / default if fast and default else None,
        # the default form can be no faster than torch's sampler alone
        "torch_sampler_vs_fast": (
            torch_sampler_us * 1e-6 * fast / B if torch_sampler_us and fast else None
        ),
    }
    report = {
        "benchmark": "pipeline",
        "rows": args.rows,
        "width": args.width,
        "dtype": args.dtype,
        "batch": B,
        "row_bytes": row_bytes,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "link": link,
        "results": results,
        "routes": routes,
        "sampler_us_per_batch": sampler_us,
        "summary": summary,
        "skipped": skipped,
    }
    headers = [
        "source",
        "method",
        "workers",
        "rows/s",
        "us/batch",
        "GB/s",
        "of limit",
        "x torch",
        "check",
    ]
    table = [
        [
            r["source"],
            r["method"],
            r.get("workers"),
            r.get("rows_per_s"),
            r.get("us_per_batch"),
            r.get("GBps"),
            r.get("of_limit"),
            r.get("x_torch"),
            r.get("check") if "error" not in r else r["error"][:60],
        ]
        for r in results
    ]
    print(
        f"pipeline benchmark: table {args.rows} x {args.width} {args.dtype} "
        f"({args.rows * row_bytes / 2**20:.1f} MiB), batch {B}, {report['device']}"
        + (f", pinned memcpy {limit:.1f} GB/s" if limit else "")
    )
    print(format_table(headers, table))
    print(
        "fast form vs best per-sample torch: "
        + (f"{summary['memory_fast_x_torch']:.1f}x" if summary["memory_fast_x_torch"] else "-")
        + "; default form: "
        + (
            f"{summary['memory_default_vs_fast']:.2f}x the fast form's time a batch"
            if summary["memory_default_vs_fast"]
            else "-"
        )
        + (
            f"; fast form at {summary['memory_fast_of_limit']:.0%} of the pinned memcpy limit"
            if summary["memory_fast_of_limit"]
            else ""
        )
        + (
            f"; torch's sampler alone: {summary['torch_sampler_vs_fast']:.2f}x the fast form's time"
            if summary["torch_sampler_vs_fast"]
            else ""
        )
    )
    timed = [f"{k}: {v:.1f} us/batch" for k, v in sampler_us.items() if v is not None]
    print(
        "column routes: "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in routes.items())
        + " | sampler alone: "
        + (
            "; ".join(timed)
            if timed
            else "not measured (only the batches after each epoch's first are timed, and an "
            "epoch here is one batch)"
        )
    )
    for s in skipped:
        print(f"skipped: {s}")
    return report


def _file_placement_available() -> bool:
    try:
        from ..stores import _file  # noqa: F401
    except ImportError:
        return False
    return True
