"""Which rows go into which batch, on which rank, in which epoch.

:class:`GadgetSampler` yields one int64 id tensor per batch. It is a *batch*
sampler: torch's ``DataLoader`` hands each tensor to
``GadgetDataset.__getitems__`` whole, so a batch costs one gather per column and
no per-sample Python.

The epoch order is a pure function of ``(num_rows, order, seed, epoch)`` (and the
chunk layout for ``order='chunk'``), so every rank computes the same order
without communicating, and a saved ``(epoch, position)`` pair is enough to resume.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sized
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler, get_worker_info

from .._errors import GadgetTypeError, GadgetValueError, as_choice
from .._fork import keep_in_forked_child

__all__ = ["ORDERS", "GadgetSampler"]

#: the batch orders :class:`GadgetSampler` knows
ORDERS: tuple[str, ...] = ("sequential", "random", "chunk")

_STATE_VERSION = 1
_MASK64 = (1 << 64) - 1

#: epoch orders of up to this many rows are kept as int64, so a batch is a slice (a view)
#: of the order; larger ones as int32 (half the memory; a batch is then a converted copy)
WIDE_ORDER_ROWS = 1 << 27

#: epoch orders of up to this many rows are computed two epochs ahead, on two background
#: threads: a shuffle of 1M rows takes 16-18 ms of one core on the H200 host, longer than
#: a fast loader takes to use up the epoch (256 batches of 4096 at ~50 us), so one epoch
#: ahead left the next epoch's first batch waiting for its order (measured: 10-37 us a
#: batch on average, in stalls of up to 15 ms)
AHEAD_TWO_ROWS = 1 << 24

#: a sampler built on a dataset that reads on a CUDA device keeps orders (and sequential
#: segments) of up to this many rows in page-locked memory (128 MiB a 2**24-row order;
#: the sampler keeps the orders of up to three epochs, plus any asked for through
#: ``epoch_order``, and a dataset's order window may still hold an older one), so that a dataset uploads a window of the order with one
#: asynchronous copy instead of first copying it into a staging buffer on the host
PIN_ORDER_ROWS = 1 << 24

#: attribute on an id tensor a sampler made (or on the order its batches are views of):
#: ``(bound, version)`` -- every id is in ``[0, bound)`` as long as the tensor's version
#: counter still reads ``version`` (an in-place change bumps it)
_MARK = "_gadget_ids_below"


#: attribute on an epoch order a sampler reads its batches from: ``(coalesce, stop)`` --
#: how many of its batches a dataset may gather at once when they are read through its
#: indexing (0: the dataset's default), and the end of this sampler's share of the order
#: (a read-ahead never goes past it). See :meth:`GadgetDataset.__getitems__`.
_AHEAD = "_gadget_read_ahead"
#: batches per id segment of a sequential pass (the span a read-ahead can group)
SEQUENTIAL_SEGMENT = 64


def _mark(t: torch.Tensor, bound: int) -> torch.Tensor:
    """Tag ``t`` (ids this module made, all in ``[0, bound)``) so that a dataset can skip
    their range check. Inference tensors (no version counter) stay untagged."""
    if not t.is_inference():
        setattr(t, _MARK, (bound, t._version))
    return t


class SamplerIds(torch.Tensor):
    """A :class:`GadgetSampler` batch: int64 ids, a view of the epoch's order.

    It behaves as a plain tensor (operations on it return ``torch.Tensor``). Pickled --
    as ``DataLoader`` does to send it to a worker process -- it becomes a compact copy of
    its own ids: torch would otherwise move the whole epoch order the view belongs to
    (8 bytes a row) into shared memory, for every epoch, which fills a small
    ``/dev/shm`` (64 MiB in Docker) and stalls the workers.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # a plain tensor of just these ids (clone() of a subclass with torch functions
        # disabled is a plain tensor): torch.save / weights_only loads and worker queues
        # see an ordinary tensor
        return self.clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.clone()


def _ids_from_bytes(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a :class:`SamplerIds` batch sent through a ``multiprocessing`` queue."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.int64).reshape(shape).copy())


def _reduce_for_queue(ids: SamplerIds) -> Any:
    """How a batch goes through a ``multiprocessing`` queue (a ``DataLoader`` worker's index
    queue): its ids inline in the message. Torch's own reduction would move them into a
    new shared-memory file and hand its descriptor over a socket to the worker, about
    1 ms a batch against about 50 us inline (4096 ids, measured on a 2-core host), and a
    worker still receiving one while its parent exits could fail the handover."""
    if ids.dtype != torch.int64 or ids.device.type != "cpu" or ids.requires_grad:
        return ids.clone().__reduce_ex__(2)
    return _ids_from_bytes, (ids.numpy().tobytes(), tuple(ids.shape))


ForkingPickler.register(SamplerIds, _reduce_for_queue)


def _as_batch(ids: torch.Tensor) -> SamplerIds:
    """``ids`` as a :class:`SamplerIds` (same memory; a view keeps its base and tag)."""
    out = ids.as_subclass(SamplerIds)
    if ids._base is None:
        mark = getattr(ids, _MARK, None)
        if mark is not None:
            setattr(out, _MARK, mark)
    return out  # type: ignore[return-value]


def sampler_ids_bound(ids: Any) -> int | None:
    """``bound`` if ``ids`` is an int64 CPU tensor a :class:`GadgetSampler` yielded (or a view
    of one), unchanged since, with every id in ``[0, bound)``; else None.

    Costs a few attribute reads: this is what lets a dataset skip the per-batch range
    check for a sampler's own ids.
    """
    if type(ids) is not torch.Tensor and type(ids) is not SamplerIds:
        return None
    holder = ids._base
    if holder is None:
        holder = ids
    mark = getattr(holder, _MARK, None)
    if mark is None or ids.dtype != torch.int64:  # views share the base's device
        return None
    try:
        version = holder._version
    except RuntimeError:  # pragma: no cover - inference tensors are never marked
        return None
    return mark[0] if version == mark[1] else None


def _check_seed(value: Any) -> int:
    """A seed in [0, 2**64): the order mixes it as a 64-bit number, so larger seeds would
    repeat smaller ones."""
    seed = _check_int(value, "seed", minimum=0)
    if seed >= 1 << 64:
        raise GadgetValueError(f"seed must be below 2**64 (it is mixed as 64 bits); got {seed}")
    return seed


def _check_int(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise GadgetTypeError(f"{name} must be an int; got a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise GadgetTypeError(f"{name} must be an int; got {type(value).__name__}") from None
    if value < minimum:
        raise GadgetValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def _same_kind(mine: Any, theirs: Any) -> bool:
    """Whether a saved setting has the kind of the sampler's own: an int setting wants an
    int (not a bool or a float that equals it), a flag a bool, a name a str."""
    flags = (bool, np.bool_)
    if isinstance(mine, flags) or isinstance(theirs, flags):
        return isinstance(mine, flags) and isinstance(theirs, flags)
    if isinstance(mine, int):
        return isinstance(theirs, (int, np.integer))
    if isinstance(mine, str):
        return isinstance(theirs, str)  # (NumPy's str_ too)
    return type(mine) is type(theirs)


#: the first epoch that cannot be ordered (epochs are mixed as 64-bit numbers)
_EPOCH_END = 1 << 64


def _check_epoch(value: Any) -> int:
    """An epoch in [0, 2**64): the order mixes it as a 64-bit number, so a larger epoch
    would silently repeat an earlier epoch's order."""
    epoch = _check_int(value, "epoch", minimum=0)
    if epoch >= _EPOCH_END:
        raise GadgetValueError(
            f"epoch must be below 2**64 (it is mixed as 64 bits, so a larger one would repeat "
            f"an earlier epoch's order); got {epoch}"
        )
    return epoch


def chunk_rows_of(obj: Any) -> int | None:
    """The read unit in rows of a dataset, DataGadget or store (``chunk_rows`` or a file
    store's ``block_rows``), or None for in-memory tables."""
    for holder in (obj, getattr(obj, "store", None)):
        if holder is None:
            continue
        for name in ("chunk_rows", "block_rows"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _mix_seed(seed: int, epoch: int) -> int:
    """A well-mixed 63-bit generator seed for ``(seed, epoch)`` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _index_dtype(num_rows: int) -> torch.dtype:
    return torch.int32 if WIDE_ORDER_ROWS < num_rows < 2**31 else torch.int64


def _can_pin() -> bool:
    """Page-locked memory may be taken here: CUDA is present, and this is neither a
    process forked after CUDA started nor a DataLoader worker (which never touch CUDA)."""
    if not torch.cuda.is_available() or get_worker_info() is not None:
        return False
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    return not (bad_fork is not None and bad_fork())


def _id_buffer(num: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised 1-D id tensor; page-locked where ``pin`` asks for it, the order is
    small enough (:data:`PIN_ORDER_ROWS`) and pinning is possible (else pageable)."""
    if pin and num <= PIN_ORDER_ROWS and _can_pin():
        try:
            # freed in a forked child after an async copy, it would abort the child
            return keep_in_forked_child(torch.empty(num, dtype=dtype, pin_memory=True))
        except RuntimeError:  # no page-locked memory to be had (a memlock limit): pageable
            pass
    return torch.empty(num, dtype=dtype)


def _epoch_order(
    num_rows: int,
    order: str,
    seed: int,
    epoch: int,
    chunk_rows: int,
    window_chunks: int,
    pin: bool = False,
) -> torch.Tensor:
    """The epoch's permutation of ``range(num_rows)``: int64, or int32 between
    :data:`WIDE_ORDER_ROWS` and 2**31 rows; tagged (see :func:`sampler_ids_bound`);
    page-locked if ``pin`` (see :func:`_id_buffer`)."""
    with torch.inference_mode(False):  # a normal tensor (with a version counter) even when
        # the first epoch's order is computed inside the caller's inference mode
        return _mark(
            _epoch_order_of(num_rows, order, seed, epoch, chunk_rows, window_chunks, pin),
            num_rows,
        )


def _epoch_order_of(
    num_rows: int,
    order: str,
    seed: int,
    epoch: int,
    chunk_rows: int,
    window_chunks: int,
    pin: bool = False,
) -> torch.Tensor:
    gen = torch.Generator()
    gen.manual_seed(_mix_seed(seed, epoch))
    dtype = _index_dtype(num_rows)
    if order == "random":
        # int32 shuffles faster (half the memory traffic) and gives the same permutation
        narrow = torch.int32 if num_rows < 2**31 else torch.int64
        perm = torch.randperm(num_rows, generator=gen, dtype=narrow)
        if not pin:
            return perm.to(dtype)
        return _id_buffer(num_rows, dtype, pin).copy_(perm)
    # chunk-aware: shuffle the chunks, then rows inside windows of `window_chunks` chunks
    num_chunks = -(-num_rows // chunk_rows)
    chunk_order = torch.randperm(num_chunks, generator=gen)
    out = _id_buffer(num_rows, dtype, pin)
    pos = 0
    for w in range(0, num_chunks, window_chunks):
        chunks = chunk_order[w : w + window_chunks]
        starts = chunks * chunk_rows
        lens = torch.clamp(num_rows - starts, max=chunk_rows)
        total = int(lens.sum())
        # row ids of the window's chunks, chunk after chunk
        first = torch.cumsum(lens, 0) - lens
        rows = torch.repeat_interleave(starts - first, lens) + torch.arange(total)
        out[pos : pos + total] = rows[torch.randperm(total, generator=gen)]
        pos += total
    return out


#: every sampler of this process (weakly), for the at-fork hook below
_LIVE: weakref.WeakSet[GadgetSampler] = weakref.WeakSet()


def _forget_orders_in_child() -> None:
    """A forked child (a DataLoader worker) has only the thread that forked: an epoch order
    another thread of the parent was still computing would never finish there, and a lock
    held by another thread would stay held. So each sampler gets a new lock and forgets
    its orders; it computes again (the same, from its seed) the ones it is asked for."""
    for sampler in list(_LIVE):
        sampler._lock = threading.Lock()
        sampler._orders = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_orders_in_child)


def _run_into(fut: Future[torch.Tensor], fn: Any, *args: Any) -> None:
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # pragma: no cover - surfaced by fut.result()
        fut.set_exception(exc)


class GadgetSampler(Sampler[Any]):
    """A seeded, resumable, rank-aware batch sampler yielding int64 id tensors.

    Parameters
    ----------
    data_source : int or sized object
        The number of rows, or anything with ``len()`` (a :class:`GadgetDataset`,
        a :class:`~gadgetloader.DataGadget`). Its ``chunk_rows`` attribute, where
        present, gives the chunk size for ``order='chunk'``. A file path is refused
        (``len()`` of a path is its length in characters): open it as a table first.
    batch_size : int
        Rows per batch (> 0).
    order : {'random', 'sequential', 'chunk'}, default 'random'
        ``random``: a fresh uniform permutation every epoch. ``sequential``:
        row order. ``chunk``: chunk-aware shuffle for file-backed tables (see Notes).
    drop_last : bool, default False
        Drop the incomplete last batch (see *Ranks*).
    pad : bool, default False
        Give every rank ``ceil(n / (num_replicas * batch_size))`` full batches: the
        epoch order is extended, cyclically from its start, to a multiple of
        ``num_replicas * batch_size`` rows before it is split among the ranks, so the
        repeated rows fall at the end of the order -- on the last ranks, which may get
        whole batches of them (up to ``num_replicas * batch_size - 1`` repeats in all).
        Exclusive with ``drop_last``.
    seed : int, default 0
        The order depends only on ``(seed, epoch)``: same on every rank and run. From 0
        to 2**64 - 1 (else :class:`~gadgetloader.GadgetValueError`).
    window_chunks : int, optional
        For ``order='chunk'``: how many chunks are shuffled together. Default:
        enough chunks to hold 16 batches, and at least 8.
    chunk_rows : int, optional
        For ``order='chunk'``: rows per file chunk. Default: the ``chunk_rows`` (or
        file store's ``block_rows``) of ``data_source`` or of its store.

        ``window_chunks`` and ``chunk_rows`` shape only the chunk order: with
        ``order='random'`` or ``'sequential'`` they have no effect (the batches are
        those of a sampler built without them), so one set of options can serve every
        order. A value given is still checked (an int >= 1; a ``GadgetTypeError`` or
        ``GadgetValueError`` otherwise), and a saved state is compared on them only for
        ``order='chunk'``: a ``random`` / ``sequential`` state loads into a sampler
        built with other values, or without them.
    num_replicas, rank : int, optional
        Shard over ranks; default: ``torch.distributed``'s world size and rank, read
        when the sampler is built, if it is initialised then, else one rank. Each of
        the two not given is taken from the group (``num_replicas=1`` on every rank of a
        group also needs ``rank=0``). Without ``torch.distributed``, a
        ``num_replicas`` above 1 needs ``rank`` too (a ``GadgetValueError`` otherwise).
    coalesce : int, optional
        Read-ahead for the batches a dataset is asked for through its indexing, as
        ``DataLoader(ds, batch_sampler=sampler)`` does: when a batch follows the
        previous one in this sampler's order, :class:`GadgetDataset` gathers it and
        up to ``coalesce - 1`` following batches with *one* gather per column and
        hands them out as views, one per request (see *Read-ahead*). Default: on
        CUDA, where the row kernel gathers every column (``cuda`` / ``pinned``
        tables), as many batches as fit in 64 MiB, at most 32 (what
        :class:`GadgetLoader` gathers at once); 1 elsewhere. ``1`` gathers every
        batch when it is asked for.

    Notes
    -----
    **Epochs.** Each full pass ends by advancing :attr:`epoch`, so successive
    epochs are shuffled differently without calling :meth:`set_epoch` (calling it
    every epoch, as with ``DistributedSampler``, gives the same result). Starting a
    new ``iter()`` before the pass ends restarts the current epoch (after
    :meth:`load_state_dict`: at the loaded position until a batch is drawn).

    **Ranks.** The epoch order is cut into ``num_replicas`` contiguous shares, one
    per rank; every rank yields the same number of batches ``len(sampler)``.
    With ``n`` rows, ``R`` ranks and batch size ``B``:

    * default: every row is yielded exactly once per epoch over all ranks. Rank
      ``r`` takes ``n // R`` rows, plus one for the first ``n % R`` ranks, in
      ``ceil((n // R) / B)`` batches: full batches, then one last batch of
      1 to ``B`` rows -- or ``B + 1`` rows on the ranks holding an extra row when
      ``n // R`` is a multiple of ``B``. Needs ``n >= R``.
    * ``drop_last=True``: each rank yields ``n // (R * B)`` full batches; the last
      ``n % (R * B)`` rows of the epoch order (a different set every shuffled
      epoch) are not yielded that epoch. Fewer than ``R * B`` rows would leave no batch
      at all, which is refused (:class:`~gadgetloader.GadgetValueError`).
    * ``pad=True``: each rank yields ``ceil(n / (R * B))`` full batches; the
      ``R * B * ceil(n / (R * B)) - n`` missing rows are taken again from the start
      of the epoch order (cyclically), so those rows are seen twice that epoch (or
      more often where the missing rows outnumber the rows).

    A state saved on one rank can be loaded on any rank of the same world size
    (the position is the same on every rank).

    **Chunk order.** The file's chunks (``chunk_rows`` rows each) are shuffled,
    then taken ``window_chunks`` at a time and the rows of each window are
    shuffled together. All rows of a chunk are therefore requested within one
    window (``window_chunks * chunk_rows`` consecutive positions), so a store
    whose cache holds two windows (a file store's ``cache_bytes``, 256 MiB by
    default; a batch that straddles two windows needs chunks of both) reads each
    chunk once per epoch, as long as a batch is no larger than a window (the
    default ``window_chunks`` makes a window at least 16 batches); with room for
    only one window, chunks at window boundaries may be read again (when a
    batch straddles two windows). The price is randomness: a batch draws from only ``window_chunks``
    chunks, so rows that are stored together (sorted by label, time, user...)
    stay correlated within a window. Larger windows approach a full shuffle and
    need more read-ahead memory; ``window_chunks >= num_chunks`` is a full shuffle.
    With several ranks, shares are contiguous in this order, so ranks read
    disjoint chunks except at most one shared window per share boundary.

    **Read-ahead.** A batch costs the dataset one kernel launch and some Python
    per column; torch's ``DataLoader`` adds its own per-batch bookkeeping. For
    small batches from a pinned table (4096 x 512 B, ~40 us on a PCIe Gen5
    link) that host time, not the link, sets the pace; gathering several
    batches at once halves it. Batches, their order, resume positions and
    ``state_dict`` are exactly those of ``coalesce=1``: only *when* rows are
    read changes. Rows written into a table after a group was gathered are not
    seen by the group's later batches (at most ``coalesce - 1`` of them): use
    ``coalesce=1`` if training writes into the table it reads. The group is a
    read of this sampler's own order; batches not read in order (another
    loader interleaved, a batch changed in place, ``GadgetDataset.gather``,
    worker processes) are gathered one by one, as with ``coalesce=1``. A
    ``GadgetLoader`` reads the sampler itself and coalesces by its own
    ``coalesce``. The sequential order has no order tensor; its ids are made in
    segments of :data:`SEQUENTIAL_SEGMENT` batches (``2 * coalesce`` if more) and
    a group stays within one. A batch of a group is a view of the group's memory
    (``clone()`` one you keep); each is handed out once; ids changed through NumPy
    after the group was read are not seen (torch cannot see such a change).

    **Cost.** The order of epoch ``e + 1`` is computed by a background thread
    while epoch ``e`` runs (``torch.randperm`` releases the GIL), so no batch
    waits for it; it holds 8 bytes per row (4 between :data:`WIDE_ORDER_ROWS` =
    2**27 and 2**31 rows), twice while the next epoch's order is ready. The first
    epoch's order is computed when iteration starts (about 10-40 ns per row).
    Built on a :class:`GadgetDataset` that takes ids on a CUDA device, the sampler
    keeps orders (and sequential segments) of up to :data:`PIN_ORDER_ROWS` = 2**24
    rows in page-locked memory, so the dataset uploads a window of the order with
    one asynchronous copy (a pageable order first needs a host copy into a staging
    buffer, 0.2-0.5 ms per 2**18 ids on the H200 host, which held the sampler form
    at 59-81% of the link); where page-locked memory cannot be had (no CUDA, a
    DataLoader worker, a memlock limit) orders are pageable as before.

    A batch is then a *view* of the epoch's order (one slice, about a microsecond;
    a converted copy for int32 orders and for the wrapped-around rows of ``pad``):
    clone it before changing it in place. The sampler's ids are tagged as its own,
    so :class:`GadgetDataset` skips their range check (they are in range by
    construction) and, for tables on the GPU, uploads the order a window of many
    batches at a time instead of copying each batch's ids to the GPU. An id
    tensor changed in place loses the tag and is checked like any other.

    Examples
    --------
    >>> from gadgetloader.data import GadgetSampler
    >>> [b.tolist() for b in GadgetSampler(10, batch_size=4, order="sequential")]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> [[b.tolist() for b in GadgetSampler(9, batch_size=2, order="sequential",
    ...   num_replicas=2, rank=r)] for r in (0, 1)]
    [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]
    """

    def __init__(
        self,
        data_source: Sized | int | np.integer[Any],
        *,
        batch_size: int,
        order: str = "random",
        drop_last: bool = False,
        pad: bool = False,
        seed: int = 0,
        window_chunks: int | None = None,
        chunk_rows: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        coalesce: int | None = None,
    ) -> None:
        if isinstance(data_source, (int, np.integer)) and not isinstance(data_source, bool):
            n = int(data_source)
        elif isinstance(data_source, (str, bytes, os.PathLike)):
            # len() of a path is its length in characters, never the table's rows
            raise GadgetTypeError(
                "data_source must be a row count or a sized table (a GadgetDataset, a "
                f"DataGadget); got the path {os.fsdecode(data_source)!r:.80}: open it first, "
                "e.g. GadgetSampler(gl.DataGadget(path, placement='file'), ...)"
            )
        elif hasattr(data_source, "__len__"):
            try:
                n = len(data_source)
            except TypeError as exc:  # (a 0-d tensor or array has __len__ but no length)
                raise GadgetTypeError(
                    "data_source must be a row count or a sized object; got a "
                    f"{type(data_source).__name__} without a length ({exc}); pass int(x) for a "
                    "row count"
                ) from exc
        else:
            raise GadgetTypeError(
                f"data_source must be a row count or have len(); got {type(data_source).__name__}"
            )
        if n < 0:
            raise GadgetValueError(f"a row count must be positive; got {n} rows")
        if n == 0:
            raise GadgetValueError("cannot sample from an empty dataset: it has 0 rows")
        if n >= 1 << 63:  # (no table is longer; len() could not even report it)
            raise GadgetValueError(f"a row count must be below 2**63; got {n} rows")
        self._num_rows = int(n)
        self._batch_size = _check_int(batch_size, "batch_size", minimum=1)
        as_choice(order, "order", ORDERS)
        self._order = order
        for name, flag in (("drop_last", drop_last), ("pad", pad)):
            if not isinstance(flag, (bool, np.bool_)):
                raise GadgetTypeError(f"{name} must be True or False; got {flag!r}")
        self._drop_last = bool(drop_last)
        self._pad = bool(pad)
        if self._drop_last and self._pad:
            raise GadgetValueError(
                "drop_last=True and pad=True are exclusive: drop the incomplete batch or pad it"
            )
        self._seed = _check_seed(seed)
        if chunk_rows is None and order == "chunk":
            chunk_rows = chunk_rows_of(data_source)
            if chunk_rows is None:
                raise GadgetValueError(
                    "order='chunk' needs the file's chunk size: pass chunk_rows=, or a dataset "
                    "with a file-backed column (which has a chunk_rows attribute)"
                )
        self._chunk_rows = (
            _check_int(chunk_rows, "chunk_rows", minimum=1) if chunk_rows is not None else None
        )
        if window_chunks is None:
            # enough chunks for 16 batches (at least 8): cheap to cache, well mixed
            per = self._chunk_rows or 1
            window_chunks = max(8, -(-16 * self._batch_size // per))
        self._window_chunks = _check_int(window_chunks, "window_chunks", minimum=1)
        self._num_replicas, self._rank = self._resolve_ranks(num_replicas, rank)
        #: batches a dataset may gather at once (0: its default; see the class notes)
        self._coalesce = 0 if coalesce is None else _check_int(coalesce, "coalesce", minimum=1)
        #: keep orders page-locked (see PIN_ORDER_ROWS): the data source asks for it
        hook = getattr(data_source, "_pin_sampler_ids", None)
        self._pin = bool(hook()) if callable(hook) else False
        self._layout()
        self._epoch = 0
        self._position = 0
        self._resume: int | None = None
        #: bumped by the user's set_epoch / load_state_dict (a GadgetLoader leaves them be)
        self._changes = 0
        self._orders: dict[int, Future[torch.Tensor]] = {}
        self._lock = threading.Lock()
        _LIVE.add(self)

    # ---- set-up --------------------------------------------------------------------------
    @staticmethod
    def _resolve_ranks(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        given = num_replicas is not None
        if num_replicas is None:
            num_replicas = torch.distributed.get_world_size() if dist_on else 1
        num_replicas = _check_int(num_replicas, "num_replicas", minimum=1)
        if rank is None and not dist_on:
            if given and num_replicas != 1:
                # (every process would read rank 0's share: torch's DistributedSampler
                # refuses this too)
                raise GadgetValueError(
                    f"num_replicas={num_replicas!r} needs rank= too when torch.distributed is "
                    "not initialised (each process passes its own rank); got no rank"
                )
            rank = 0
        elif rank is None:
            rank = torch.distributed.get_rank()
        rank = _check_int(rank, "rank", minimum=0)
        if rank >= num_replicas:
            raise GadgetValueError(f"rank must be in [0, {num_replicas - 1}]; got rank={rank}")
        return num_replicas, rank

    def _layout(self) -> None:
        n, R, r, B = self._num_rows, self._num_replicas, self._rank, self._batch_size
        if self._drop_last:
            nb = n // (R * B)
            if nb == 0:
                raise GadgetValueError(
                    f"drop_last=True leaves no batch: {n} rows < num_replicas * batch_size = "
                    f"{R} * {B}; use a smaller batch_size or drop_last=False"
                )
            self._share_start, self._share_len = r * nb * B, nb * B
        elif self._pad:
            nb = -(-n // (R * B))
            self._share_start, self._share_len = r * nb * B, nb * B
        else:
            q, extra = divmod(n, R)
            if q == 0:
                raise GadgetValueError(
                    f"{n} rows cannot be shared by {R} ranks without repeating rows; "
                    "pass pad=True or use fewer ranks"
                )
            nb = -(-q // B)
            self._share_start = r * q + min(r, extra)
            self._share_len = q + (1 if r < extra else 0)
        self._num_batches = nb

    # ---- facts -----------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows of the dataset this sampler orders (all ranks together)."""
        return self._num_rows

    @property
    def batch_size(self) -> int:
        """Ids per batch (the last batch of an epoch may be shorter unless ``drop_last``)."""
        return self._batch_size

    @property
    def order(self) -> str:
        """``'sequential'``, ``'random'`` or ``'chunk'``: how each epoch orders the rows."""
        return self._order

    @property
    def coalesce(self) -> int | None:
        """Batches a dataset may gather at once (None: the dataset's default)."""
        return self._coalesce or None

    @property
    def seed(self) -> int:
        """The seed of every epoch's order (with the epoch number: the same seed and epoch give
        the same order on every rank and run)."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) pass belongs to."""
        if self._resume is None and self._position >= self._num_batches:
            return self._epoch + 1  # every batch of the last one was handed out
        return self._epoch

    @property
    def num_replicas(self) -> int:
        """Ranks the rows are split over (1 without sharding)."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """This sampler's rank among :attr:`num_replicas` (0 without sharding)."""
        return self._rank

    @property
    def drop_last(self) -> bool:
        """Whether an epoch's last, shorter batch is left out."""
        return self._drop_last

    @property
    def pad(self) -> bool:
        """Whether the last batch on every rank is filled up to :attr:`batch_size` with rows
        repeated from the start of the epoch order."""
        return self._pad

    @property
    def chunk_rows(self) -> int | None:
        """Rows per file chunk that ``order='chunk'`` shuffles whole: the value given, else
        (for that order) the one the dataset's columns report; None otherwise."""
        return self._chunk_rows

    @property
    def window_chunks(self) -> int:
        """Chunks shuffled together by ``order='chunk'`` (the value given, else the default;
        the other orders do not use it)."""
        return self._window_chunks

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._num_batches

    def __repr__(self) -> str:
        return (
            f"GadgetSampler(num_rows={self._num_rows}, batch_size={self._batch_size}, "
            f"order={self._order!r}, epoch={self._epoch}, rank={self._rank}/{self._num_replicas})"
        )

    # ---- epochs ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch at the next ``iter()`` (also when a
        :class:`GadgetLoader` over this sampler was left mid-epoch: this call wins).
        Without it, the next pass starts the next epoch once every batch of this one was
        handed out (else this epoch anew). After :meth:`load_state_dict`, ``set_epoch`` of
        the loaded epoch keeps the loaded position (the ``DistributedSampler`` loop calls
        ``set_epoch`` at the top of every epoch, the resumed one included)."""
        epoch = _check_epoch(epoch)
        if not (self._resume is not None and epoch == self._epoch):
            self._restart(epoch)
        self._changes = getattr(self, "_changes", 0) + 1
        #: which change was this set_epoch (a GadgetLoader whose last pass handed out
        #: nothing keeps that pass's start through it: see GadgetLoader.__iter__)
        self._set_epoch_change = self._changes

    def _restart(self, epoch: int, start: int = 0) -> None:
        """Make the next pass start epoch ``epoch`` at batch ``start`` (a position other
        than 0 holds as a loaded one does, until a batch is drawn)."""
        self._epoch = _check_epoch(epoch)
        self._position = start
        self._resume = start if start else None
        self._passes = getattr(self, "_passes", 0) + 1  # a pass still being read stops here

    def _order_future(self, epoch: int, *, background: bool) -> Future[torch.Tensor] | None:
        if self._order == "sequential":
            return None
        with self._lock:
            fut = self._orders.get(epoch)
            if fut is None:
                fut = Future()
                self._orders[epoch] = fut
                args = (
                    self._num_rows,
                    self._order,
                    self._seed,
                    epoch,
                    self._chunk_rows or 1,
                    self._window_chunks,
                    getattr(self, "_pin", False),
                )
                if background:
                    # not a daemon: interpreter exit waits for it instead of killing it
                    # inside torch (which aborts the process)
                    threading.Thread(
                        target=_run_into, args=(fut, _epoch_order, *args), daemon=False
                    ).start()
                else:
                    _run_into(fut, _epoch_order, *args)
            keep = (epoch, epoch + 1, epoch + 2, self._epoch, self._epoch + 1, self._epoch + 2)
            for old in [e for e in self._orders if e not in keep]:
                del self._orders[old]
        return fut

    def epoch_order(self, epoch: int | None = None) -> torch.Tensor:
        """The full order of ``epoch`` (default: the current one) over all ranks, as int64.

        Row ``epoch_order()[p]`` is at position ``p``; rank ``r`` reads positions
        ``[start_r, start_r + share_r)`` (wrapping around with ``pad``).
        """
        e = self._epoch if epoch is None else _check_epoch(epoch)
        fut = self._order_future(e, background=False)
        if fut is None:
            return torch.arange(self._num_rows)
        return fut.result().to(torch.int64, copy=True)  # the sampler's own stays untouched

    # ---- iteration ---------------------------------------------------------------------------
    def _ids_at(self, order: torch.Tensor | None, p0: int, p1: int) -> torch.Tensor:
        """Ids at epoch positions ``[p0, p1)``: a view of an int64 order, else a new tensor;
        tagged either way (see :func:`sampler_ids_bound`)."""
        n = self._num_rows
        if p1 <= n:
            if order is None:
                return _mark(torch.arange(p0, p1, dtype=torch.int64), n)
            if order.dtype == torch.int64:
                return order[p0:p1]  # the order is tagged; views share its tag
            return _mark(order[p0:p1].to(torch.int64), n)
        pos = torch.arange(p0, p1, dtype=torch.int64).remainder_(n)
        return _mark(pos if order is None else order[pos].to(torch.int64), n)

    def __iter__(self) -> Iterator[Any]:  # int64 id tensors; Any keeps DataLoader's typing happy
        # The new pass takes the state over now: state_dict() reads where it will start and
        # an older pass still being read no longer moves it. Its start is kept as a resume
        # position, so that a second iter() before any batch (DataLoader calls it twice with
        # workers) starts at the same place, and the pass reads it (or a position loaded
        # since) at its first next(). No thread is started here: DataLoader forks its
        # workers between iter() and next().
        epoch, start = self._next_start()
        if epoch < _EPOCH_END:  # (the pass after the last epoch refuses at its first next())
            self._epoch, self._resume = epoch, start
            self._passes = getattr(self, "_passes", 0) + 1
        self._iters = getattr(self, "_iters", 0) + 1
        return self._batches(self._iters, epoch, start)

    def _next_start(self) -> tuple[int, int]:
        """(epoch, position) where the next pass will start: a loaded position, else the
        next epoch once every batch of this one was handed out, else this epoch anew."""
        if self._resume is not None:
            return self._epoch, self._resume
        if self._position >= self._num_batches:
            return self._epoch + 1, 0
        return self._epoch, 0

    def _owner(self) -> tuple[int, int]:
        """Who may move the sampler's position: the latest pass, until the user's
        ``set_epoch`` / ``load_state_dict`` (or a restart) takes it back."""
        return getattr(self, "_changes", 0), getattr(self, "_passes", 0)

    def _check_next(self, epoch: int) -> None:
        """Refuse the pass after epoch 2**64 - 1: its order would repeat epoch 0's."""
        if epoch >= _EPOCH_END:
            raise GadgetValueError(
                f"the sampler has finished epoch 2**64 - 1 ({_EPOCH_END - 1}), the last one it "
                "can order (epochs are mixed as 64 bits, so the next would repeat epoch 0's "
                "order); call set_epoch() with a smaller epoch to go on"
            )

    def _batches(self, token: int, epoch: int, start: int) -> Iterator[torch.Tensor]:
        """The pass made by the ``iter()`` numbered ``token``, which computed ``epoch`` and
        ``start``. If it is still the latest ``iter()`` at its first ``next()``, it takes the
        state over from where the state then stands (a position loaded since included);
        else a newer pass took over before this one drew a batch, and this one yields the
        batches it was made for without moving the state."""
        mine: tuple[int, int] | None = None
        if token == getattr(self, "_iters", 0):
            epoch, start = self._next_start()
            self._check_next(epoch)
            self._resume = None
            self._epoch, self._position = epoch, start
            self._passes = getattr(self, "_passes", 0) + 1
            mine = self._owner()  # an older pass still being read no longer moves the state
        else:
            self._check_next(epoch)
        if start >= self._num_batches:  # resumed after the epoch's last batch: nothing left
            if mine is not None:
                self._advance(epoch)
            return
        fut = self._order_future(epoch, background=False)
        order = fut.result() if fut is not None else None
        for ahead in (1, 2) if self._num_rows <= AHEAD_TWO_ROWS else (1,):
            if epoch + ahead < _EPOCH_END:
                self._order_future(epoch + ahead, background=True)
        # the per-batch path: a slice of the epoch order and a few integer operations
        nb, B, s0, n = self._num_batches, self._batch_size, self._share_start, self._num_rows
        full_end = s0 + (nb - 1) * B  # start of the last batch
        last_end = s0 + self._share_len
        fast = order is not None and order.dtype == torch.int64 and last_end <= n
        coalesce = getattr(self, "_coalesce", 0)
        pin = getattr(self, "_pin", False)
        if fast:
            # a plain attribute (not a tensor write): the order's version and tag stand
            setattr(order, _AHEAD, (coalesce, last_end))
        # the sequential order has no order tensor: its batches are views of segments of
        # SEQUENTIAL_SEGMENT batches, so that a dataset can read ahead within a segment
        seq = order is None and last_end <= n and coalesce != 1
        seg_lo = seg_hi = 0
        segment: torch.Tensor | None = None
        for b in range(start, nb):
            p0 = s0 + b * B
            if fast:
                ids = order[p0 : p0 + B] if p0 < full_end else order[p0:last_end]  # type: ignore[index]
            elif seq:
                p1 = p0 + B if p0 < full_end else last_end
                if segment is None or p1 > seg_hi:
                    seg_lo = p0
                    seg_hi = min(last_end, p0 + B * max(SEQUENTIAL_SEGMENT, 2 * coalesce))
                    buf = _id_buffer(seg_hi - seg_lo, torch.int64, pin)
                    segment = _mark(torch.arange(seg_lo, seg_hi, out=buf), n)
                    setattr(segment, _AHEAD, (coalesce, seg_hi - seg_lo))
                ids = segment[p0 - seg_lo : p1 - seg_lo]
            else:
                ids = self._ids_at(order, p0, p0 + B if p0 < full_end else last_end)
            if self._epoch == epoch and self._owner() == mine:
                # after the last batch the state reads (epoch, nb): the next pass starts the
                # next epoch even if this generator is never resumed (see _next_start), and a
                # resumed state sees an empty rest of this epoch, as StatefulDataLoader expects
                self._position = b + 1
            yield _as_batch(ids)
        if self._epoch == epoch and self._position == self._num_batches and self._owner() == mine:
            self._advance(epoch)

    def _advance(self, epoch: int) -> None:
        """Move on to the epoch after ``epoch``, whose batches are all handed out; after the
        last epoch the state stays at its end (a loadable state; the next pass refuses)."""
        if epoch + 1 < _EPOCH_END:
            self._epoch, self._position = epoch + 1, 0
        else:
            self._epoch, self._position = epoch, self._num_batches

    # ---- resume (torchdata StatefulDataLoader protocol) -------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands: load it into a fresh sampler to continue from the next batch.

        After the epoch's last batch was drawn the state reads (epoch, number of batches):
        a sampler loaded from it yields an empty pass (the rest of that epoch), then the
        next epoch -- the protocol ``StatefulDataLoader`` expects when it saves inside
        the loop. Batches drawn ahead by DataLoader workers count as drawn.

        ``StatefulDataLoader`` (torchdata) calls this for its batch sampler, or for
        its sampler with ``batch_size=None``.
        """
        position = self._resume if self._resume is not None else self._position
        return self._state(self._epoch, position)

    def _state(self, epoch: int, position: int) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "num_rows": self._num_rows,
            "num_replicas": self._num_replicas,
            "rank": self._rank,
            "batch_size": self._batch_size,
            "order": self._order,
            "drop_last": self._drop_last,
            "pad": self._pad,
            "chunk_rows": self._chunk_rows,
            "window_chunks": self._window_chunks,
            "seed": self._seed,
            "epoch": epoch,
            "position": position,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next ``iter()`` resumes mid-epoch.

        The state's seed and epoch replace the sampler's own: the sampler continues the
        saved run's order. A state saved after an epoch's last batch gives one empty pass,
        then the next epoch.

        Raises
        ------
        GadgetTypeError
            ``state_dict`` is not a mapping (a dict, or any read-only mapping).
        GadgetValueError
            The state was saved for another dataset size, world size, batch size,
            order, ``drop_last`` / ``pad`` setting or chunk layout (the positions would
            mean different rows), or a setting is of another kind than the sampler's own
            (``num_rows=50.0`` or ``drop_last=0``). The sampler is then unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise GadgetTypeError(
                "load_state_dict takes a dict from GadgetSampler.state_dict(); got "
                f"{type(state_dict).__name__}"
            )
        if "position" not in state_dict:
            raise GadgetValueError(
                "not a GadgetSampler state: expected a dict from GadgetSampler.state_dict(); "
                f"got a dict without 'position' (keys {sorted(map(str, state_dict))})"
            )
        if state_dict.get("version") != _STATE_VERSION:
            raise GadgetValueError(
                f"sampler state version {state_dict.get('version')!r} is not supported; "
                f"expected {_STATE_VERSION}"
            )
        keys = ["num_rows", "num_replicas", "batch_size", "order", "drop_last", "pad"]
        if self._order == "chunk":
            keys += ["chunk_rows", "window_chunks"]
        for key in keys:
            mine, theirs = getattr(self, f"_{key}"), state_dict.get(key)
            if mine == theirs and not _same_kind(mine, theirs):
                kind = f"{type(theirs).__module__}.{type(theirs).__qualname__}".removeprefix(
                    "builtins."
                )
                raise GadgetValueError(
                    f"sampler state's {key} is {theirs!r} ({kind}); expected "
                    f"a {type(mine).__name__} as GadgetSampler.state_dict() saves it"
                )
            if mine != theirs:
                what = {
                    "num_rows": "a dataset of a different size",
                    "num_replicas": "a different world size",
                }.get(key, f"a different {key}")
                raise GadgetValueError(
                    f"this sampler state was saved for {what}: {key}={theirs!r}, but this sampler "
                    f"has {key}={mine!r}; load it into a sampler built with the same settings"
                )
        position = _check_int(state_dict["position"], "position", minimum=0)
        if position > self._num_batches:
            raise GadgetValueError(
                f"sampler state position {position} is beyond the epoch's {self._num_batches} batches"
            )
        missing = [k for k in ("seed", "epoch") if k not in state_dict]
        if missing:
            raise GadgetValueError(
                f"not a complete GadgetSampler state: {missing} missing; expected a dict from "
                "GadgetSampler.state_dict()"
            )
        seed = _check_seed(state_dict["seed"])
        epoch = _check_epoch(state_dict["epoch"])
        self._seed, self._epoch = seed, epoch  # only once everything is checked
        with self._lock:
            self._orders.clear()
        self._resume = position
        self._position = position
        self._changes = getattr(self, "_changes", 0) + 1

    # ---- pickling (DataLoader may copy samplers) ---------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_orders"] = {}
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _LIVE.add(self)
