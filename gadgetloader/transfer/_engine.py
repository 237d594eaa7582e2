"""Gather and scatter between a CUDA-addressable table and dense GPU tensors.

A *CUDA-addressable* table is a torch CUDA tensor whose memory the GPU can read
and write in place: GPU memory, or page-locked host memory mapped into the GPU's
address space (the ``pinned`` placement). Every strategy gives bit-identical
results; they differ only in speed. ``auto`` picks per call (see DESIGN.md for the
measurements behind the choice).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .._device import cupy_available, pinned_empty
from .._errors import GadgetIndexError, GadgetTypeError, GadgetValueError, as_choice
from .._fork import keep_in_forked_child
from .._ids import _upload, check_range, flag_word, read_flag
from . import _kernels

__all__ = ["STRATEGIES", "gather", "scatter", "resolve_strategy", "set_hybrid_fraction"]

#: ``kernel``: CuPy row kernel, ids in the order given;
#: ``sorted``: sort ids on the GPU first (locality for large host tables), un-permute on write;
#: ``hybrid``: split the ids between the GPU kernel and CPU threads gathering into a pinned
#: staging buffer moved by the copy engine (pinned tables only);
#: ``torch``: ``index_select`` / ``index_copy_`` on the zero-copy view (no CuPy needed).
STRATEGIES: tuple[str, ...] = ("auto", "kernel", "sorted", "hybrid", "torch")

#: above this many bytes a random gather from host memory loses throughput to the GPU's
#: address translation unless the ids are sorted (DESIGN.md, "Why ids are sorted": falls off past ~2 GB)
SORT_ABOVE_BYTES = 1 << 31

#: above this many table bytes per requested id (ids sparser than one per this many bytes)
#: the GPU's address translation limits even a sorted gather, and CPU threads take a share
HYBRID_GAP_BYTES = 48 << 10

#: requests of at least this many ids are sorted whatever the table's size: on the H200 a
#: 0.5 GB table gave 50 GB/s sorted against 33 unsorted for 976,562 x 512 B ids (71.5 against
#: 50.9 on another loan) and 66 against 51 for 488,281 x 1 KB; at 131,072 ids the sort's
#: cost outweighs its gain there (kernel 49 against sorted 41-47 GB/s)
SORT_FROM_IDS = 1 << 18

#: rows at least this wide are gathered by the GPU alone even on huge tables: a sparse GPU
#: gather moves a roughly fixed number of rows per second (its address translations), so
#: wide rows reach the link anyway -- on the H200's 64 GB table, 1 KB rows sorted 45 GB/s and
#: 4 KB rows 50 GB/s, against 24-34 GB/s with the CPU taking a share
HYBRID_MAX_ROW_BYTES = 1024

#: a ``kernel`` scatter with repeated ids merges them without a sort
#: (:func:`_kernels.launch_last_slots`: a slot per table row, 4 bytes of GPU memory each) on
#: tables of at most this many rows and :data:`SORT_ABOVE_BYTES` bytes, for fewer than
#: :data:`SORT_FROM_IDS` ids and at most :data:`_kernels.SPARSE_GAP_BYTES` of table per id --
#: where a gather would not sort either and a sorted scatter would get the default launch
#: shape, so address order buys nothing. On the H200 (seed scatter, 1M x 128 float32 pinned
#: table, 131,072 ids) the merge took 0.05-0.07 ms against 0.31-0.36 ms for a stable sort and
#: last-of-run mask (DESIGN.md, "The seed scatter's repeat merge")
SLOT_MERGE_MAX_ROWS = 1 << 24

#: ``auto`` considers ``hybrid`` only from this many ids: below it the CPU share's fixed
#: costs (a stream synchronisation, a staging copy, thread start-up) outweigh its gain
#: (the switchers' few thousand rows per step measured slower with it on the H200)
HYBRID_MIN_IDS = 1 << 16

#: share of the rows the CPU moves in the ``hybrid`` strategy (the H200 sweep balanced at ~0.6)
_hybrid = {"fraction": 0.6}

#: ``auto``'s choice between ``sorted`` and ``hybrid`` as measured in this process, by
#: (device, and the powers of two of the table's bytes, the ids and the row's bytes): which
#: of the two is faster follows no fixed boundary (DESIGN.md), so the first such gather of
#: each class times both on its own rows (a warm-up and three timed runs of each, in
#: series) and the one with the lower median serves the rest
_TUNED: dict[tuple[Any, ...], str] = {}
_TUNE_LOCK = threading.Lock()


def set_hybrid_fraction(fraction: float) -> None:
    """Set the share of rows that CPU threads move in the ``hybrid`` strategy (0..1)."""
    if not 0.0 <= fraction <= 1.0:
        raise GadgetValueError(f"hybrid fraction must be in [0, 1]; got {fraction}")
    _hybrid["fraction"] = float(fraction)


def _gpu_addressable(table: torch.Tensor) -> bool:
    """Whether the row kernels can address ``table``: a CUDA tensor (a ``pinned`` table's
    device view is one), or a "meta" tensor, sizes without memory, which asks what
    strategy a CUDA table of its size would get. (Tests that emulate the kernels on the
    CPU replace this.)"""
    return table.device.type in ("cuda", "meta")


def resolve_strategy(
    strategy: str,
    table: torch.Tensor,
    n_ids: int,
    host: torch.Tensor | None = None,
    *,
    kind: str = "gather",
) -> str:
    """Turn ``auto`` into a concrete strategy for one call; validate names (a strategy
    that is not a string is a :class:`~gadgetloader.GadgetTypeError`, an unknown
    strategy or ``kind`` -- ``"gather"`` or ``"scatter"`` -- a
    :class:`~gadgetloader.GadgetKeyError`).

    ``auto`` (measured on an H200, see DESIGN.md): requests of up to 1024 ids ->
    ``kernel``; tables up to 2 GB -> ``kernel``, or ``sorted`` from
    :data:`SORT_FROM_IDS` ids; larger tables -> ``sorted`` while the ids are dense
    enough (at most :data:`HYBRID_GAP_BYTES` of table per id), the request is small
    (under :data:`HYBRID_MIN_IDS` ids) or the rows are wide (at least
    :data:`HYBRID_MAX_ROW_BYTES`), else ``hybrid`` where the table has a host view
    (which :func:`gather_many` replaces by ``sorted`` where that measured faster in this
    process, see :data:`_TUNED`).
    Scatters merge repeated ids by sorting them (which also walks a large table in
    address order) or, on small tables, by a sort-free pass (see :func:`scatter`), so
    ``auto`` scatters with ``kernel``. Without CuPy, and for a table that is not on a CUDA
    device (a CPU tensor, which the GPU cannot address), every strategy becomes ``torch``.
    """
    as_choice(strategy, "strategy", STRATEGIES)
    as_choice(kind, "kind", ("gather", "scatter"))
    if strategy != "torch" and (not cupy_available() or not _gpu_addressable(table)):
        # the row kernels read and write through CUDA addresses: a table the GPU cannot
        # address (a CPU tensor) moves with torch's indexing whatever was asked
        return "torch"
    if strategy == "hybrid" and host is None:
        return "sorted"
    if strategy != "auto":
        return strategy
    nbytes = table.shape[0] * _kernels.pitch_nbytes(table) if table.dim() else 0
    if kind == "scatter" or n_ids <= 1024:
        return "kernel"
    if nbytes <= SORT_ABOVE_BYTES:
        return "sorted" if n_ids >= SORT_FROM_IDS else "kernel"
    row_bytes = math.prod(table.shape[1:]) * table.element_size()
    if (
        host is None
        or n_ids < HYBRID_MIN_IDS
        or nbytes / n_ids <= HYBRID_GAP_BYTES
        or row_bytes >= HYBRID_MAX_ROW_BYTES
    ):
        return "sorted"
    return "hybrid"


class _Side:
    """The hybrid transfer's side stream and its last copy's completion event.

    Registered with the fork hooks in their place (:mod:`gadgetloader._fork`), so a
    forked child still never destroys them: torch streams and events themselves must
    not be held through weak references, which some torch versions leave dangling."""

    __slots__ = ("stream", "done", "__weakref__")

    def __init__(self) -> None:
        self.stream: Any = None
        self.done: Any = None


class _Staging(threading.local):
    """Per-thread reusable pinned staging buffer, side stream and completion event."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        # (kept in a forked child, which frees other threads' locals: see _fork)
        self.side = keep_in_forked_child(_Side())

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        side = self.side
        if side.done is not None:
            side.done.synchronize()  # the previous copy out of (or into) the buffer finished
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = keep_in_forked_child(pinned_empty(max(nbytes, 1 << 20), torch.uint8))
        if side.stream is None or side.stream.device != device:
            side.stream = torch.cuda.Stream(device)
        return self.buf


_staging = _Staging()


def _stage_view(buf: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    row = tuple(like.shape[1:])
    nbytes = n * math.prod(row) * like.element_size()
    return buf[:nbytes].view(like.dtype).view(n, *row)


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


#: tables of at most this many bytes together are moved by one fused launch; larger ones
#: one launch per table. On the H200 (3 x 5 GB pinned tables, 15,000 sparse sorted rows)
#: a fused scatter took 1.35 ms against 0.50 ms for three launches in turn, and a fused
#: gather 1.21 ms against 1.14 ms: interleaving several huge tables multiplies the host
#: pages the GPU must translate at once. Small tables gain the saved launches.
FUSE_MAX_BYTES = 1 << 31


def _groups(tables: list[torch.Tensor]) -> list[slice]:
    """Slices of tables that share one launch: up to ``MAX_TABLES`` small tables together,
    large tables (over :data:`FUSE_MAX_BYTES` together) one by one, and the slots of an
    interleaved table together (up to ``MAX_TABLES`` per launch) whatever their size.
    Cached by the tables' geometry (the same tables move every step)."""
    key = tuple(_kernels._table_key(t) for t in tables)
    out = _groups_cache.get(key)
    if out is None:
        out = _split_groups(tables)
        if len(_groups_cache) > 1024:
            _groups_cache.clear()
        _groups_cache[key] = out
    return out


_groups_cache: dict[tuple[Any, ...], list[slice]] = {}


def _split_groups(tables: list[torch.Tensor]) -> list[slice]:
    n = len(tables)
    if _kernels.segments_of(tables):
        # slots of one interleaved table: moving them together is what shares the
        # host pages' translations, whatever the size
        step = _kernels.MAX_TABLES
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]
    total = sum(t.numel() * t.element_size() for t in tables)
    step = _kernels.MAX_TABLES if total <= FUSE_MAX_BYTES else 1
    # one launch needs one row pitch: a run of tables changes group where the pitch changes
    # (a slot of an interleaved table beside an ordinary table)
    pitches = [_kernels.pitch_nbytes(t) for t in tables]
    out: list[slice] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or i - start == step or pitches[i] != pitches[start]:
            out.append(slice(start, i))
            start = i
    return out


def _check_fused(tables: list[torch.Tensor]) -> None:
    first = tables[0]
    for t in tables[1:]:
        if (
            t.device != first.device
            or t.shape[0] != first.shape[0]
            or t.shape[1:].numel() * t.element_size()
            != first.shape[1:].numel() * first.element_size()
        ):
            raise GadgetValueError(
                "tables moved together must be on one device with the same number of rows and "
                f"the same row size in bytes; got {tuple(first.shape)} {first.dtype} on "
                f"{first.device} and {tuple(t.shape)} {t.dtype} on {t.device}"
            )


def _int64_ids(ids: Any) -> torch.Tensor:
    """Ids as int64 (the row kernels read 8-byte integers): other integer dtypes are
    widened, so every strategy takes the same ids; anything else is refused. (Ids are
    range-checked by the caller: see :func:`gadgetloader._ids.as_ids`.)"""
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.int64:
        return ids
    if (
        isinstance(ids, torch.Tensor)
        and not ids.dtype.is_floating_point
        and not ids.dtype.is_complex
        and ids.dtype != torch.bool
    ):
        return ids.long()
    raise GadgetTypeError(
        "the transfer engine takes integer id tensors (convert and check them with "
        "gadgetloader._ids.as_ids, as DataGadget does); got "
        f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"
    )


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one device may share bytes (their address ranges meet)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + _extent(a)
    b1 = b0 + _extent(b)
    return a0 < b1 and b0 < a1


def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last."""
    last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def gather(
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
    strategy: str = "auto",
    host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``table[ids]`` as a new contiguous tensor on the table's device (a CUDA
    tensor for a GPU-visible table, a CPU one for a CPU table), or in the given ``out``:
    ``out`` itself when it has the result's shape, else (``out`` of shape
    ``(ids.numel(), *row shape)`` for N-d ids) a view of it in the result's shape.

    This is the engine under :meth:`~gadgetloader.DataGadget.getData`, for callers that
    hold tensors: ``ids`` must already be in range, int64, on the table's device (or the
    CPU for ``hybrid``) -- :meth:`~gadgetloader.DataGadget.getData` checks and converts
    ids of any kind. Their shape becomes the leading shape of the result. ``host`` is
    the CPU view of the same table where one exists (``pinned`` tables).
    """
    return gather_many([table], ids, None if out is None else [out], strategy, [host])[0]


def gather_many(
    tables: list[torch.Tensor],
    ids: torch.Tensor,
    outs: list[torch.Tensor | None] | None = None,
    strategy: str = "auto",
    hosts: list[torch.Tensor | None] | None = None,
    *,
    ids_sorted: bool = False,
    count: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The same rows of several tables (a table and its optimizer states) at once.

    The tables must share the device, the row count and the row size in bytes (dtypes
    and row shapes may differ); the ``kernel`` and ``sorted`` strategies move up to
    four of them per launch while they total at most :data:`FUSE_MAX_BYTES` (larger
    tables go one launch each). Returns one tensor per table, as :func:`gather`.
    ``ids_sorted=True`` says the ids are already ascending (a switcher's row plan), so
    the ``sorted`` strategy needs no sort. ``count`` (a 1-element int64 tensor on the
    tables' device, with ``ids_sorted``): only the first ``count`` ids are moved and the
    other output rows are zero-filled; the row kernels read it on the GPU (no
    synchronisation), other strategies read it back first.
    """
    tables = _as_list(tables)
    hosts = [None] * len(tables) if hosts is None else _as_list(hosts)
    _check_fused(tables)
    ids = _int64_ids(ids)
    n = ids.numel()
    flat = ids.reshape(-1)
    results: list[torch.Tensor] = []
    flat_outs: list[torch.Tensor] = []
    clash = False
    for k, table in enumerate(tables):
        row_shape = tuple(table.shape[1:])
        out = None if outs is None else outs[k]
        if out is None:
            out = torch.empty((n, *row_shape), dtype=table.dtype, device=table.device)
        elif (
            tuple(out.shape) not in ((*ids.shape, *row_shape), (n, *row_shape))
            or not out.is_contiguous()
            or out.dtype != table.dtype
            or out.device != table.device
        ):
            raise GadgetValueError(
                f"out must be a contiguous {table.dtype} tensor on {table.device} of shape "
                f"{(*ids.shape, *row_shape)}; got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        elif any(shares_memory(out, t) for t in tables):
            clash = True
        shaped = tuple(ids.shape) + row_shape
        results.append(out if tuple(out.shape) == shaped else out.view(shaped))
        flat_outs.append(out.view(n, *row_shape))
    if clash:
        # rows of a table gathered into that table: gather apart, then copy (as torch's
        # strategy and the CPU do); the kernel would read rows it is overwriting
        fresh = gather_many(tables, ids, None, strategy, hosts, ids_sorted=ids_sorted, count=count)
        for got, res in zip(fresh, results, strict=True):
            res.copy_(got)
        return results
    first = tables[0]
    if n == 0 or math.prod(first.shape[1:]) == 0:
        return results
    host0 = hosts[0] if all(h is not None for h in hosts) else None
    how = resolve_strategy(strategy, first, n, host0)
    if how == "hybrid" and strategy == "auto":
        key = _tune_key(tables, flat, ids_sorted)
        choice = _TUNED.get(key)
        if choice is None:
            _tune(key, tables, hosts, flat, flat_outs, ids_sorted, count)
            return results  # the trial gathered the rows
        how = choice
    _run_gather(how, tables, hosts, flat, flat_outs, ids_sorted, count)
    return results


def _ids_on(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Int64 ids on ``device``, dense. CPU ids go up through page-locked staging, an
    asynchronous copy: a pageable one would first wait for the work queued before it
    (the last call's transfer), leaving the GPU idle while it copies."""
    if flat.device == device:
        return flat.contiguous()
    if flat.device.type == "cpu" and device.type == "cuda" and flat.dtype == torch.int64:
        return _upload(flat.contiguous(), device)
    return flat.to(device).contiguous()


def _run_gather(
    how: str,
    tables: list[torch.Tensor],
    hosts: list[torch.Tensor | None],
    flat: torch.Tensor,
    flat_outs: list[torch.Tensor],
    ids_sorted: bool,
    count: torch.Tensor | None = None,
) -> None:
    """``flat_outs[k] = tables[k][flat]`` by one concrete strategy (only the first
    ``count`` ids with ``count``, the other rows zero-filled)."""
    ordered = how == "sorted" or ids_sorted  # ascending ids: see _kernels.ordered_shape
    if count is not None:
        if how in ("kernel", "sorted"):  # the kernel reads the count on the GPU
            flat = _ids_on(flat, tables[0].device)
            for g in _groups(tables):
                _kernels.launch_gather(  # (no sort here: ascending only if they came so)
                    tables[g], flat, flat_outs[g], None, count=count, ordered=ids_sorted
                )
            return
        k = _count_value(count, flat.numel())
        for out in flat_outs:
            out[k:].zero_()
        flat, flat_outs = flat[:k], [o[:k] for o in flat_outs]
    if how == "hybrid":
        for table, host, out in zip(tables, hosts, flat_outs, strict=True):
            assert host is not None
            _hybrid_gather(table, host, flat, out)
        return
    flat = _ids_on(flat, tables[0].device)  # the kernels read ids densely
    if how == "torch":
        for table, out in zip(tables, flat_outs, strict=True):
            torch.index_select(table, 0, flat, out=out)
        return
    pos = slot = None
    if how == "sorted" and not ids_sorted:
        flat, pos = torch.sort(flat)
    elif how == "kernel" and not ids_sorted:  # (ids of a row plan are distinct)
        slot = _kernels.dedup_slots(tables[0], flat.numel())
        if slot is not None:  # each distinct row crosses the link once
            _kernels.launch_gather_slots(flat, slot)
    for g in _groups(tables):
        _kernels.launch_gather(tables[g], flat, flat_outs[g], pos, ordered=ordered, slot=slot)


def _tune_key(tables: list[torch.Tensor], flat: torch.Tensor, ids_sorted: bool) -> tuple[Any, ...]:
    """A request's class for :data:`_TUNED`: its device, the powers of two of the table's
    bytes, the ids and the row's bytes, the number of tables, where the ids are, whether
    they come sorted, and the ``hybrid`` CPU share."""
    table = tables[0]
    nbytes = table.shape[0] * _kernels.pitch_nbytes(table)
    row_bytes = math.prod(table.shape[1:]) * table.element_size()
    index = table.device.index if table.device.index is not None else 0
    return (
        index,
        nbytes.bit_length(),
        flat.numel().bit_length(),
        row_bytes.bit_length(),
        len(tables),
        flat.is_cuda,
        ids_sorted,
        _hybrid["fraction"],
    )


def _tune(
    key: tuple[Any, ...],
    tables: list[torch.Tensor],
    hosts: list[torch.Tensor | None],
    flat: torch.Tensor,
    flat_outs: list[torch.Tensor],
    ids_sorted: bool,
    count: torch.Tensor | None = None,
) -> None:
    """Gather the request by ``hybrid`` and by ``sorted``, each once to set up and then three
    times in a row (as a workload repeats one strategy), timing each run to its end on the
    GPU; record the one with the lower median in :data:`_TUNED`. Both give the same rows,
    so the outputs hold the request's rows."""
    device = tables[0].device
    times: dict[str, list[float]] = {"hybrid": [], "sorted": []}
    with _TUNE_LOCK:
        done = _TUNED.get(key)
        if done is not None:  # another thread measured this class meanwhile
            _run_gather(done, tables, hosts, flat, flat_outs, ids_sorted, count)
            return
        for how in times:
            for k in range(4):
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                _run_gather(how, tables, hosts, flat, flat_outs, ids_sorted, count)
                torch.cuda.synchronize(device)
                if k:  # the first run pays its set-up (staging buffers, kernels)
                    times[how].append(time.perf_counter() - start)
        medians = {how: sorted(t)[len(t) // 2] for how, t in times.items()}
        _TUNED.setdefault(key, min(medians, key=medians.__getitem__))


def _hybrid_gather(
    table: torch.Tensor, host: torch.Tensor, flat: torch.Tensor, out: torch.Tensor
) -> None:
    n = flat.numel()
    k = int(n * _hybrid["fraction"])
    device = table.device
    before = torch.cuda.current_stream(device).record_event()  # writes queued so far
    gpu_ids = _ids_on(flat[k:], device)
    if gpu_ids.numel():
        sorted_ids, pos = torch.sort(gpu_ids)
        _kernels.launch_gather(table, sorted_ids, out[k:], pos, ordered=True)
    if k == 0:
        return
    cpu_ids = flat[:k].cpu()
    nbytes = k * math.prod(table.shape[1:]) * table.element_size()
    buf = _staging.get(nbytes, device)
    stage = _stage_view(buf, k, table)
    before.synchronize()  # the CPU must not read rows a queued kernel is still writing
    torch.index_select(host, 0, cpu_ids, out=stage)  # CPU threads, while the GPU kernel runs
    current = torch.cuda.current_stream(device)
    side = _staging.side
    stream = side.stream
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        out[:k].copy_(stage, non_blocking=True)
        done = stream.record_event()
    current.wait_event(done)
    out.record_stream(stream)
    side.done = done  # (the registered _Side keeps it in a forked child)


def scatter(
    table: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    strategy: str = "auto",
    host: torch.Tensor | None = None,
    *,
    unique: bool = False,
    ids_sorted: bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """``table[ids] = rows`` in place; for a repeated id the *last* occurrence wins.

    ``rows`` is a tensor on the table's device (CUDA for a GPU-visible table, CPU for a
    CPU table) of shape ``ids.shape + row shape`` (or ``(ids.numel(),) + row shape``) and
    the table's dtype; ``ids`` must be
    in range and int64 (:meth:`~gadgetloader.DataGadget.insertData` checks and converts
    ids and rows of any kind). Repeated ids are merged so that only each id's last entry
    is written, whatever the strategy, and the result is deterministic: on a table of at
    most 2**24 rows and 2 GB, for fewer than 2**18 ids and at most 16 KiB of table per
    id, the ``kernel`` strategy marks each id's last position in a slot array (two small
    launches, no sort) and writes in the order given; otherwise the ids are sorted
    (stably) and the kernel writes the last entry of each run of equal ids, walking the
    table in address order (DESIGN.md has the measurements behind these limits). ``unique=True`` promises distinct ids
    (the switchers' row plans): no merge, every entry is written in the order given;
    ``ids_sorted=True`` with it says they also ascend (a row plan's do), which gives
    sparse requests the launch shape of :func:`_kernels.ordered_shape`.

    ``check``: a function that raises if the ids are bad (a pending range check, see
    :func:`gadgetloader._ids.start_range_check`); it is called after the merge is queued
    and before anything is written, so the GPU merges while the check's result travels.
    A :class:`gadgetloader._ids.GuardedCheck` (its two numbers on the GPU too) is called
    after the kernels are queued instead: they write nothing if an id is bad, and the
    check's round trip overlaps the write (``torch`` and ``hybrid`` check first).
    """
    scatter_many(
        [table], ids, [rows], strategy, [host], unique=unique, ids_sorted=ids_sorted, check=check
    )


def scatter_many(
    tables: list[torch.Tensor],
    ids: torch.Tensor,
    rows: list[torch.Tensor],
    strategy: str = "auto",
    hosts: list[torch.Tensor | None] | None = None,
    *,
    unique: bool = False,
    count: torch.Tensor | None = None,
    ids_sorted: bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """Scatter the same ids into several tables at once (one fused launch per four
    tables up to :data:`FUSE_MAX_BYTES` together, else one per table); ``rows[k]`` goes
    to ``tables[k]``. Rules as :func:`scatter`. ``count`` (with ``unique=True``, whose ids
    a row plan gives in ascending order): only the first ``count`` ids and rows are
    written (see :func:`gather_many`)."""
    tables = _as_list(tables)
    rows = _as_list(rows)
    hosts = [None] * len(tables) if hosts is None else _as_list(hosts)
    if len(rows) != len(tables):
        raise GadgetValueError(f"got {len(tables)} tables but {len(rows)} row tensors")
    _check_fused(tables)
    ids = _int64_ids(ids)
    first = tables[0]
    n = ids.numel()
    for k, (table, r) in enumerate(zip(tables, rows, strict=True)):
        # every strategy writes the same thing, or none does: the kernels copy bytes, so rows
        # of another dtype or size must not reach them
        if not isinstance(r, torch.Tensor) or r.dtype != table.dtype:
            raise GadgetTypeError(
                f"rows for table {k} must be a {table.dtype} tensor (the table's dtype); got "
                f"{r.dtype if isinstance(r, torch.Tensor) else type(r).__name__}"
            )
        # the shape itself, not just the element count: rows of another layout with as
        # many elements (a transpose) would be written scrambled
        row_shape = tuple(table.shape[1:])
        if tuple(r.shape) not in ((*ids.shape, *row_shape), (n, *row_shape)):
            raise GadgetValueError(
                f"rows for table {k} must have shape {(*ids.shape, *row_shape)} "
                f"({n} ids); got {tuple(r.shape)}"
            )
    flat = _ids_on(ids.reshape(-1), first.device)  # the kernels read ids densely
    if n == 0 or math.prod(first.shape[1:]) == 0:
        if check is not None:
            check()
        return
    srcs = []
    for table, r in zip(tables, rows, strict=True):
        src = r.reshape(n, *table.shape[1:])
        if any(shares_memory(src, t) for t in tables):
            src = src.clone()  # rows of the table itself: read them all before any write
        srcs.append(src if src.is_contiguous() else src.contiguous())
    host0 = hosts[0] if all(h is not None for h in hosts) else None
    how = resolve_strategy(strategy, first, n, host0, kind="scatter")
    if count is not None:
        if not unique:
            raise GadgetValueError("a scatter with a count needs distinct ids (unique=True)")
        if check is not None:
            check()
        if how in ("kernel", "sorted"):  # a plan's ids: ascending
            for g in _groups(tables):
                _kernels.launch_scatter(
                    tables[g], flat, srcs[g], None, _kernels.SCATTER_ALL, count=count, ordered=True
                )
            return
        k = _count_value(count, n)
        scatter_many(
            tables, flat[:k], [r[:k] for r in srcs], how, hosts, unique=True, ids_sorted=ids_sorted
        )
        return
    # a guarded check (its two numbers on the GPU too) lets the kernels be queued first:
    # they write nothing if an id is bad, and the check's round trip overlaps the write
    guard = getattr(check, "ends", None)
    if not isinstance(guard, torch.Tensor) or guard.device != first.device:
        guard = None
    if not unique and how == "kernel" and _slot_merge(first, n):
        slot = torch.empty(first.shape[0], dtype=torch.int32, device=first.device)
        _kernels.launch_last_slots(flat, slot)
        if check is not None and guard is None:
            check()  # the GPU marks the last writers while the check's numbers travel
        for g in _groups(tables):
            _kernels.launch_scatter(
                tables[g],
                flat,
                srcs[g],
                None,
                _kernels.SCATTER_LAST_BY_SLOT,
                slot=slot,
                guard=guard,
            )
        if check is not None and guard is not None:
            check()
        return
    ascending = ids_sorted or not unique  # sorted here unless the ids are promised distinct
    if unique:
        sorted_ids, pos, mode = flat, None, _kernels.SCATTER_ALL
    else:
        sorted_ids, pos = torch.sort(flat, stable=True)
        mode = _kernels.SCATTER_LAST_OF_RUN
    if check is not None and (guard is None or how in ("torch", "hybrid")):
        check()
        check = None
    if how in ("torch", "hybrid"):
        keep = _last_of_run(sorted_ids) if not unique else None
        sel_ids, sel_pos = sorted_ids, pos
        if keep is not None:
            sel = keep.nonzero().squeeze(1)
            sel_ids, sel_pos = sorted_ids[sel], pos[sel] if pos is not None else sel
        for table, host, src in zip(tables, hosts, srcs, strict=True):
            picked = src if sel_pos is None else src[sel_pos]
            if how == "torch" or host is None:
                table.index_copy_(0, sel_ids, picked)
            else:
                _hybrid_scatter(table, host, sel_ids, picked, ordered=ascending)
        return
    for g in _groups(tables):
        _kernels.launch_scatter(
            tables[g], sorted_ids, srcs[g], pos, mode, ordered=ascending, guard=guard
        )
    if check is not None:
        check()


def slot_scatter(
    table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, *, check: bool
) -> bool:
    """``table[ids] = rows`` by the ``kernel`` strategy with the sort-free merge of repeats
    (the last occurrence wins), for a table and a request that :func:`_slot_merge` admits,
    with the range check of the ids fused into the merge when ``check``: the merge's first
    launch flags any id outside the table, the scatter then writes nothing, and the flag
    reaches the host through a page-locked word (no reduction, no copy of its own). Raises
    :class:`~gadgetloader.GadgetIndexError` with the table unchanged for a bad id.

    ``ids``: 1-D contiguous int64 on the table's CUDA device; ``rows``: the table's dtype,
    ``(n, *row_shape)``, on that device. Returns False, having done nothing, where the check
    cannot be fused (the flag word is not mapped into the device): the caller then takes
    :func:`scatter` with a check of its own. No ids: nothing to do (True)."""
    if ids.numel() == 0:
        return True  # (no launch would write the flag: it must not be read)
    device = table.device
    flag = flag_word(device) if check else 0
    if flag is None:
        return False
    src = rows.clone() if shares_memory(rows, table) else rows  # read all before any write
    if not src.is_contiguous():
        src = src.contiguous()
    slot = torch.empty(table.shape[0] + (1 if check else 0), dtype=torch.int32, device=device)
    if not check:
        _kernels.launch_last_slots(ids, slot)
        _kernels.launch_scatter(table, ids, src, None, _kernels.SCATTER_LAST_BY_SLOT, slot=slot)
        return True
    stream = torch.cuda.current_stream(device)
    try:
        _kernels.launch_last_slots(ids, slot, flag_out=flag)
        merged = stream.record_event()
        _kernels.launch_scatter(
            table, ids, src, None, _kernels.SCATTER_LAST_BY_SLOT_GUARDED, slot=slot
        )
    except BaseException:
        stream.synchronize()  # the flag word is free for the thread's next check
        raise
    merged.synchronize()  # the merge has run (the write may still be running)
    if read_flag():
        check_range(ids, table.shape[0])  # raises, saying which id
        raise GadgetIndexError(  # (the ids changed meanwhile: nothing was written)
            f"an id was outside the table ({table.shape[0]} rows) when it was written; "
            "nothing was written"
        )
    return True


def _slot_merge(table: torch.Tensor, n: int) -> bool:
    """Whether a ``kernel`` scatter of ``n`` ids with repeats into ``table`` merges them by
    last-writer slots rather than a sort (see :data:`SLOT_MERGE_MAX_ROWS`)."""
    rows = table.shape[0]
    nbytes = rows * _kernels.pitch_nbytes(table)
    return (
        table.is_cuda
        and 0 < n < SORT_FROM_IDS
        and rows <= SLOT_MERGE_MAX_ROWS
        and nbytes <= SORT_ABOVE_BYTES
        and nbytes <= n * _kernels.SPARSE_GAP_BYTES
    )


def _count_value(count: torch.Tensor, n: int) -> int:
    """A device-side count read back (one synchronisation), clamped to ``[0, n]``."""
    return max(0, min(int(count.reshape(()).item()), n))


def _last_of_run(sorted_ids: torch.Tensor) -> torch.Tensor:
    """Mask of the entries that are the last of their run of equal (sorted) ids."""
    keep = torch.ones_like(sorted_ids, dtype=torch.bool)
    if sorted_ids.numel() > 1:
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=keep[:-1])
    return keep


def _hybrid_scatter(
    table: torch.Tensor,
    host: torch.Tensor,
    ids: torch.Tensor,
    src: torch.Tensor,
    *,
    ordered: bool = False,
) -> None:
    """``table[ids] = src`` for distinct ``ids``: the GPU kernel writes a share while CPU
    threads write the rest from a pinned staging copy."""
    n = ids.numel()
    k = int(n * _hybrid["fraction"])
    device = table.device
    if k < n:
        _kernels.launch_scatter(table, ids[k:], src[k:], ordered=ordered)
    if k == 0:
        return
    cpu_ids = ids[:k].cpu()
    buf = _staging.get(k * math.prod(table.shape[1:]) * table.element_size(), device)
    stage = _stage_view(buf, k, table)
    stage.copy_(src[:k], non_blocking=True)
    ev = torch.cuda.current_stream(device).record_event()
    ev.synchronize()
    host.index_copy_(0, cpu_ids, stage)  # CPU threads; the GPU kernel writes its share meanwhile
