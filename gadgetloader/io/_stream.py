"""Streaming rows between a file and a store in bounded blocks, with a progress bar.

Extra host RAM during a load or save is the staging size (two blocks), never the
table's size: host-resident stores (``cpu``, ``pinned``) are read straight into
their own memory (a ``pinned`` store made for the load page-locks itself on a
background thread meanwhile, and the load waits for that at its end); GPU stores go through two reusable pinned buffers, so the disk
read of one block overlaps the GPU copy of the previous one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .._errors import as_flag
from ._atomic import interrupts_deferred
from ._base import ArraySink, ArraySource

if TYPE_CHECKING:
    from ..stores import Store

__all__ = ["STAGING_BYTES", "load_converted", "load_into", "progress_bar", "save_from", "blocks"]

#: bytes per staging block for loads and saves
STAGING_BYTES = 64 << 20
#: transfers smaller than this show no progress bar unless asked
QUIET_BELOW_BYTES = 256 << 20


def progress_bar(total_bytes: int, desc: str, progress: bool | None) -> Any:
    """A tqdm bar in bytes; ``progress=None`` shows one only for large transfers."""
    progress = as_flag(progress, "progress", allow_none=True)
    disable = (not progress) if progress is not None else total_bytes < QUIET_BELOW_BYTES
    return tqdm(
        total=total_bytes,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=disable,
        leave=False,
    )


def blocks(num_rows: int, rows_per_block: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` pairs covering ``range(num_rows)``."""
    rows_per_block = max(1, rows_per_block)
    for start in range(0, num_rows, rows_per_block):
        yield start, min(num_rows, start + rows_per_block)


def _rows_per_block(row_nbytes: int, natural: int) -> int:
    """A multiple of the natural chunk near :data:`STAGING_BYTES`."""
    if row_nbytes == 0:
        return max(1, natural)
    target = max(1, STAGING_BYTES // row_nbytes)
    if natural >= target:
        return natural
    return max(natural, (target // natural) * natural)


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def load_into(source: ArraySource, store: Store, *, progress: bool | None = None) -> None:
    """Copy every row of ``source`` into ``store`` (same shape and dtype)."""
    rpb = _rows_per_block(source.row_nbytes, source.chunk_rows)
    host = store.host_view()
    bar = progress_bar(source.nbytes, f"load {source.path}", progress)
    with bar:
        if host is not None and host.is_contiguous():  # else (a strided slot): staged
            full = _numpy_view(host)
            if getattr(source, "concurrent_reads", False):
                _read_overlapped(source, full, rpb, bar)
            else:
                for start, stop in blocks(source.num_rows, rpb):
                    source.read_into(start, stop, full[start:stop])
                    bar.update((stop - start) * source.row_nbytes)
            ready = getattr(store, "wait_ready", None)
            if ready is not None:  # a pinned store page-locking itself while we read
                ready()
            return
        shape = (rpb, *source.shape[1:])
        pinned = torch.cuda.is_available()
        stages = [torch.empty(shape, dtype=source.dtype, pin_memory=pinned) for _ in range(2)]
        events: list[Any] = [None, None]
        for k, (start, stop) in enumerate(blocks(source.num_rows, rpb)):
            i = k % 2
            if events[i] is not None:
                events[i].synchronize()  # the GPU has finished copying out of this buffer
            stage = stages[i][: stop - start]
            source.read_into(start, stop, _numpy_view(stage))
            store.write_block(start, stage)
            if pinned:
                ev = torch.cuda.Event()
                ev.record()
                events[i] = ev
            bar.update((stop - start) * source.row_nbytes)
        store.synchronize()


def load_converted(
    source: ArraySource,
    store: Store,
    convert: Callable[[np.ndarray], np.ndarray],
    *,
    progress: bool | None = None,
) -> None:
    """Copy every row of a ``wide_unsigned`` source (see ``ArraySource.unsigned_bits``)
    into ``store``, block by block through ``convert`` (file values -> the table's dtype;
    it raises where a value does not fit, and the caller drops the store)."""
    bits = source.unsigned_bits
    assert bits is not None
    rpb = _rows_per_block(source.row_nbytes, source.chunk_rows)
    bar = progress_bar(source.nbytes, f"load {source.path}", progress)
    with bar:
        for start, stop in blocks(source.num_rows, rpb):
            raw = np.empty((stop - start, *source.shape[1:]), dtype=bits)
            source.read_into(start, stop, raw)
            rows = torch.from_numpy(np.ascontiguousarray(convert(raw)))
            store.write_block(start, rows if rows.dtype == store.dtype else rows.to(store.dtype))
            bar.update((stop - start) * source.row_nbytes)
        ready = getattr(store, "wait_ready", None)
        if ready is not None:  # a pinned store page-locking itself meanwhile: its errors here
            ready()
        store.synchronize()


def _read_overlapped(source: ArraySource, full: Any, rpb: int, bar: Any) -> None:
    """Read blocks two at a time, so the chunk pool never drains between blocks
    (sources whose ``read_into`` may run in several threads at once: zarr)."""
    with ThreadPoolExecutor(2, thread_name_prefix="gadgetloader-load") as ex:
        pending: deque[tuple[Future[None], int]] = deque()
        for start, stop in blocks(source.num_rows, rpb):
            if len(pending) == 2:
                fut, n = pending.popleft()
                fut.result()
                bar.update(n)
            pending.append(
                (
                    ex.submit(source.read_into, start, stop, full[start:stop]),
                    (stop - start) * source.row_nbytes,
                )
            )
        while pending:  # on an error, leaving the executor waits for the other block
            fut, n = pending.popleft()
            fut.result()
            bar.update(n)


def save_from(
    store: Store,
    sink: ArraySink | Callable[[], ArraySink],
    *,
    chunk_rows: int | None = None,
    progress: bool | None = None,
    desc: str = "save",
) -> None:
    """Stream every row of ``store`` into ``sink``, then commit it (abort on any error).

    ``sink`` is an open sink (:func:`open_sink`) or a function that opens one: the
    library passes the function, so that the sink is made with Ctrl-C already held (see
    :func:`interrupts_deferred`) and an interrupt that comes while it creates its
    partial file stops the save at the first check, with the partial file removed."""
    open_sink = (lambda: sink) if isinstance(sink, ArraySink) else sink
    rpb = _rows_per_block(
        store.row_nbytes, chunk_rows or max(1, STAGING_BYTES // max(1, store.row_nbytes))
    )
    opened: ArraySink | None = None
    try:
        with interrupts_deferred() as check:
            opened = open_sink()
            check()
            with progress_bar(store.nbytes, desc, progress) as bar:
                for start, stop in blocks(store.num_rows, rpb):
                    block = store.read_block(start, stop)
                    opened.write(start, _numpy_view(block.contiguous()))
                    bar.update((stop - start) * store.row_nbytes)
                    check()
            check()  # the last point where the save can stop with the old file in place
            opened.commit()
            check.committed = True
    except BaseException:
        if opened is not None:
            opened.abort()
        elif isinstance(sink, ArraySink):  # an open sink given that was never written
            sink.abort()
        raise
    check.deliver(desc)  # a Ctrl-C held during the commit, now the file is written


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
