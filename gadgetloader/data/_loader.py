"""GadgetLoader: torch's DataLoader plus GPU prefetch on a side stream, resumable.

Batches are those of a plain ``torch.utils.data.DataLoader`` over a
:class:`GadgetDataset` with a :class:`GadgetSampler` as its batch sampler; the
loader only decides *when* and *on which CUDA stream* each batch is fetched. With
workers (or ``pin_memory=True``) they come through that DataLoader; without, the loader
reads the sampler itself and calls the dataset's gather, which is all DataLoader would
do, less its per-batch bookkeeping.
"""

from __future__ import annotations

import numbers
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from .._errors import GadgetClosedError, GadgetTypeError, GadgetValueError
from .._fork import keep_in_forked_child
from ._dataset import (  # noqa: F401 - the coalesce defaults, re-exported
    COALESCE_BYTES,
    COALESCE_MAX,
    COALESCE_MAX_OTHER,
    GadgetBatch,
    GadgetDataset,
    _stream_id,
    default_coalesce,
)
from ._sampler import GadgetSampler, _check_int

__all__ = ["GadgetLoader"]


class GadgetLoader:
    """Iterate a :class:`GadgetDataset` in batches, gathering ahead on a side CUDA stream.

    Parameters
    ----------
    dataset : GadgetDataset, DataGadget, array or tensor
        What to load (anything but a GadgetDataset becomes a one-column dataset; another
        torch ``Dataset``, such as a ``Subset``, is a ``GadgetTypeError``).
    sampler : GadgetSampler, optional
        The batch order. If omitted one is built from ``batch_size`` and the
        sampler options below (with ``coalesce=1``: the loader's own ``coalesce``
        groups batches; a given sampler's ``coalesce`` applies only where batches
        come through the DataLoader, i.e. with ``pin_memory=True``).
    batch_size : int, optional
        Rows per batch (required without ``sampler``).
    prefetch : int, default 2
        Batches gathered ahead of the one being consumed (CUDA only; 0 gathers
        each batch on the current stream when it is asked for, and makes the
        default ``coalesce`` 1, so writes made before asking for a batch are seen).
    num_workers : int, default 0
        DataLoader worker processes. They never touch CUDA: they gather on the
        CPU, and batches are moved to the GPU here (from pinned memory).
    coalesce : int, optional
        With ``num_workers=0``, gather this many consecutive batches with *one*
        gather per column and hand them out as views (default on CUDA: as many
        batches as fit in 64 MiB, at most 32 where the row kernel gathers every column
        in place, else 8;
        1 on the CPU). Order, contents and resume positions are exactly those of
        ``coalesce=1``; only the number of kernel launches and Python round trips
        per batch shrinks, which is what limits small batches (a 4096 x 512 B batch
        is ~40 us on a PCIe Gen5 link).
    order, drop_last, pad, seed, window_chunks, chunk_rows, num_replicas, rank
        Passed to :class:`GadgetSampler` when ``sampler`` is omitted (its defaults:
        ``order="random"``, ``drop_last=False``, ``pad=False``, ``seed=0``); with
        ``sampler=`` giving any of them, even at its default value, is an error.
    **dataloader_kwargs
        Passed to ``torch.utils.data.DataLoader`` (e.g. ``persistent_workers``,
        ``multiprocessing_context``). The loader sets DataLoader's ``shuffle``,
        ``batch_sampler`` and ``collate_fn`` itself: giving any of them here is a
        ``GadgetTypeError`` (use ``order=`` or ``sampler=``). ``sampler`` and
        ``drop_last`` are this loader's own parameters (a ``GadgetSampler``, and the
        sampler option above), not DataLoader's. A ``generator`` given here
        seeds only the workers' random state, as in DataLoader; the batch order
        comes from ``seed=`` (or the given sampler) alone. ``in_order=False`` is a
        ``GadgetValueError`` (batches finished out of order could not be resumed from a
        count). A ``generator`` that is not a ``torch.Generator`` and, with workers, a
        ``prefetch_factor`` below 1 are refused here (torch would fail only once a pass
        starts). With ``persistent_workers=True`` the workers serve one pass at a time:
        once a newer ``iter()`` has started, reading an older pass raises
        ``GadgetClosedError``.

    Notes
    -----
    With CUDA, the gather for step ``n + 1`` (and up to ``prefetch`` steps ahead)
    is queued on a side stream while step ``n`` computes on the current stream.
    The consuming stream waits on an event recorded after each gather, and every
    batch tensor is marked with ``record_stream`` for it, so the caching
    allocator never hands a batch's memory to another gather while kernels of
    the consuming step may still use it. The side stream waits for the current
    stream once, when iteration starts: rows written into the tables *during*
    iteration may be missed by batches already in flight (use ``prefetch=0`` if
    training writes into the table it reads).

    ``state_dict()`` counts the batches *handed out*, not those prefetched, so
    resuming from it repeats and skips nothing.

    Examples
    --------
    >>> import torch, gadgetloader as gl
    >>> ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    >>> loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    >>> [b[0].tolist() for b in loader]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    """

    def __init__(
        self,
        dataset: Any,
        *,
        sampler: GadgetSampler | None = None,
        batch_size: int | None = None,
        prefetch: int = 2,
        num_workers: int = 0,
        coalesce: int | None = None,
        order: str | None = None,
        drop_last: bool | None = None,
        pad: bool | None = None,
        seed: int | None = None,
        window_chunks: int | None = None,
        chunk_rows: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, GadgetDataset):
            if isinstance(dataset, Dataset):  # a torch Dataset of its own (Subset, ...)
                raise GadgetTypeError(
                    "GadgetLoader takes a GadgetDataset, or one column to make one of (a "
                    "DataGadget, a file path, an array or a tensor); got "
                    f"{type(dataset).__name__} (for a subset of rows, pass their ids to "
                    "GadgetDataset.gather or use DataLoader with that dataset)"
                )
            dataset = GadgetDataset(dataset)
        self._dataset = dataset
        keep_in_forked_child(self)  # never destroyed in a forked worker (see gadgetloader._fork)
        if sampler is None:
            if batch_size is None:
                raise GadgetValueError("GadgetLoader needs batch_size= (or a sampler=)")
            sampler = GadgetSampler(
                dataset,
                batch_size=batch_size,
                order="random" if order is None else order,
                drop_last=False if drop_last is None else drop_last,
                pad=False if pad is None else pad,
                seed=0 if seed is None else seed,
                window_chunks=window_chunks,
                chunk_rows=chunk_rows,
                num_replicas=num_replicas,
                rank=rank,
                coalesce=1,  # the loader groups batches itself (its own `coalesce`)
            )
        elif batch_size is not None:
            raise GadgetValueError(
                "give either sampler= or batch_size= (the sampler already has a batch size), not both"
            )
        elif given := [
            name
            for name, value in (
                ("order", order),
                ("drop_last", drop_last),
                ("pad", pad),
                ("seed", seed),
                ("window_chunks", window_chunks),
                ("chunk_rows", chunk_rows),
                ("num_replicas", num_replicas),
                ("rank", rank),
            )
            if value is not None
        ]:
            raise GadgetValueError(
                f"{', '.join(given)} set the sampler GadgetLoader builds; with sampler= they "
                "would be ignored: give them to the GadgetSampler instead"
            )
        elif not isinstance(sampler, GadgetSampler):
            raise GadgetTypeError(f"sampler must be a GadgetSampler; got {type(sampler).__name__}")
        if sampler.num_rows != len(dataset):
            raise GadgetValueError(
                f"the sampler is for {sampler.num_rows} rows but the dataset has {len(dataset)}"
            )
        self._sampler = sampler
        self._prefetch = _check_int(prefetch, "prefetch", minimum=0)
        workers = _check_int(num_workers, "num_workers", minimum=0)
        if coalesce is None:
            coalesce = (
                default_coalesce(
                    sampler.batch_size * dataset.row_nbytes,
                    all(route == "kernel" for route in dataset._routes()),
                )
                if dataset.device.type == "cuda" and workers == 0 and self._prefetch > 0
                else 1  # prefetch=0: nothing gathered before it is asked for
            )
        self._coalesce = _check_int(coalesce, "coalesce", minimum=1)
        if self._coalesce > 1 and workers > 0:
            raise GadgetValueError(
                "coalesce > 1 needs num_workers=0 (workers gather batch by batch on the CPU)"
            )
        for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn"):
            if key in dataloader_kwargs:
                raise GadgetTypeError(f"GadgetLoader sets DataLoader's {key!r} itself")
        if "in_order" in dataloader_kwargs and dataloader_kwargs["in_order"] is not True:
            raise GadgetValueError(
                "GadgetLoader hands batches out in the sampler's order, so that state_dict() "
                "resumes exactly; DataLoader's in_order="
                f"{dataloader_kwargs['in_order']!r} would hand them out as workers finish "
                "(use DataLoader(ds, batch_sampler=sampler, in_order=False) directly if "
                "resume does not matter)"
            )
        # what torch's DataLoader checks only when a pass starts (with an AssertionError or
        # a TypeError from inside its iterator), refused here
        factor = dataloader_kwargs.get("prefetch_factor")
        if workers > 0 and factor is not None:
            _check_int(factor, "prefetch_factor", minimum=1)
        timeout = dataloader_kwargs.get("timeout", 0)
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise GadgetTypeError(
                "timeout must be a number of seconds (a float or int, not "
                f"{type(timeout).__name__} {timeout!r:.40})"
            )
        if not float(timeout) >= 0:  # (nan too)
            raise GadgetValueError(
                "timeout must be a number of seconds >= 0 (0: wait for a worker's batch "
                f"forever); got {type(timeout).__name__} {timeout!r:.40}"
            )
        generator = dataloader_kwargs.get("generator")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise GadgetTypeError(
                f"generator must be a torch.Generator (it seeds DataLoader's workers); got "
                f"{type(generator).__name__}"
            )
        self._device = dataset.device
        named = ", ".join(map(repr, dataloader_kwargs))  # (for an error message below)
        pin = workers > 0 and self._device.type == "cuda"
        dataloader_kwargs.setdefault("pin_memory", pin)
        try:
            self._dataloader = DataLoader(
                dataset, batch_sampler=sampler, num_workers=workers, **dataloader_kwargs
            )
        except (TypeError, ValueError) as exc:  # an option DataLoader does not take
            error = GadgetTypeError if isinstance(exc, TypeError) else GadgetValueError
            raise error(
                f"GadgetLoader hands its other keyword arguments ({named}) to torch's "
                f"DataLoader, which refused them: {exc}"
            ) from exc
        # without workers (or pinning) DataLoader only adds per-batch bookkeeping (~23 us
        # on the H200 host, a profiler range among it): the sampler is read directly
        self._direct = workers == 0 and not self._dataloader.pin_memory
        # [epoch, first position, batches handed out, sampler changes, pass number] of the
        # pass in progress
        self._active: list[int] | None = None
        # persistent workers serve one pass at a time: torch resets its one iterator for
        # each new pass, so an older pass must stop (see _superseded)
        self._passes = 0
        self._one_pass = workers > 0 and bool(self._dataloader.persistent_workers)

    # ---- facts -------------------------------------------------------------------------------
    @property
    def dataset(self) -> GadgetDataset:
        """The :class:`GadgetDataset` the batches come from (built from ``dataset=`` when
        that was not one already)."""
        return self._dataset

    @property
    def sampler(self) -> GadgetSampler:
        """The :class:`GadgetSampler` that orders the batches (the one given, or the one
        built from ``batch_size=``, ``order=``, ...)."""
        return self._sampler

    @property
    def dataloader(self) -> DataLoader[Any]:
        """The underlying ``torch.utils.data.DataLoader``."""
        return self._dataloader

    @property
    def device(self) -> torch.device:
        """Where the batches' tensors are: the dataset's device."""
        return self._device

    def __len__(self) -> int:
        """Batches per epoch (on this rank)."""
        return len(self._sampler)

    def __repr__(self) -> str:
        workers = self._dataloader.num_workers
        return (
            f"GadgetLoader({len(self._dataset)} rows, {len(self)} batches of "
            f"{self._sampler.batch_size}, order={self._sampler.order!r}, "
            f"device={str(self._device)!r}, num_workers={workers}, prefetch={self._prefetch}, "
            f"coalesce={self._coalesce})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at the next ``iter()``: from its first batch, or, right after
        :meth:`load_state_dict` of that epoch, from the loaded position (as
        :meth:`GadgetSampler.set_epoch`). A refused epoch changes nothing."""
        self._sampler.set_epoch(epoch)  # checks before it changes
        prev = self._active
        if self._kept_start(prev, getattr(self._sampler, "_changes", 0)):
            assert prev is not None
            self._sampler._restart(prev[0], prev[1])  # (see __iter__)
        self._active = None

    # ---- resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (prefetched batches do not count)."""
        active = self._active
        if active is not None and active[3] == getattr(self._sampler, "_changes", 0):
            epoch, start, handed = active[:3]
            return {"sampler": self._sampler._state(epoch, start + handed)}
        # no pass, or the sampler was moved since (its set_epoch / load_state_dict): the
        # next iter() follows the sampler, and so does the state
        return {"sampler": self._sampler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next ``iter()`` (see
        :meth:`GadgetSampler.load_state_dict`: the saved seed and epoch come with it, and a
        state saved at an epoch's end gives one empty pass, then the next epoch)."""
        if not isinstance(state_dict, Mapping):
            raise GadgetTypeError(
                "load_state_dict takes a dict from GadgetLoader.state_dict(); got "
                f"{type(state_dict).__name__}"
            )
        if "sampler" not in state_dict:
            raise GadgetValueError(
                "not a GadgetLoader state: expected a dict from GadgetLoader.state_dict() "
                f"(with a 'sampler' entry); got keys {sorted(map(str, state_dict))}"
            )
        self._sampler.load_state_dict(state_dict["sampler"])  # checks before it changes
        self._active = None

    # ---- iteration ---------------------------------------------------------------------------
    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy (pickle, copy, deepcopy) is registered as the original is in __init__
        self.__dict__.update(state)
        keep_in_forked_child(self)

    def __iter__(self) -> Iterator[GadgetBatch]:
        prev = self._active
        changes = getattr(self._sampler, "_changes", 0)
        if self._kept_start(prev, changes):
            # the last pass handed out nothing (its read-ahead may have moved the sampler)
            # and the one change since was set_epoch of its epoch: like set_epoch right
            # after load_state_dict, that keeps the pass's start (a loaded position)
            self._sampler._restart(prev[0], prev[1])
        elif prev is not None and prev[3] == changes:
            # the last pass was left before its end: read-ahead (coalescing, workers) may
            # have drained the sampler past what was handed out, so go by what the user got
            # -- an unfinished epoch restarts, as a bare sampler's does; a finished one moves
            # on; one that handed out nothing leaves its start (a loaded position) in place.
            # (If the user has since called the sampler's set_epoch / load_state_dict, that
            # wins.)
            epoch, start, handed = prev[:3]
            if handed == 0:
                self._sampler._restart(epoch, start)
            elif start + handed < len(self._sampler):
                self._sampler._restart(epoch)
            else:
                self._sampler._restart(epoch + 1)
        epoch, start = self._sampler._next_start()
        self._sampler._check_next(epoch)  # (refused before the loader records a pass)
        self._passes += 1
        active = [epoch, start, 0, changes, self._passes]
        self._active = active
        # a pass holds streams, events and batches in its generator's frame: like the
        # loader, it must never be destroyed in a forked worker (see gadgetloader._fork)
        if self._direct or self._coalesce > 1:  # the sampler directly (see __init__)
            return keep_in_forked_child(self._grouped(iter(self._sampler), active))
        it = iter(self._dataloader)
        if self._device.type == "cuda" and self._prefetch > 0:
            return keep_in_forked_child(self._prefetched(it, active))
        return keep_in_forked_child(self._plain(it, active))

    def _kept_start(self, prev: list[int] | None, changes: int) -> bool:
        """Whether pass ``prev`` handed out nothing from a start past its epoch's first
        batch, and the sampler's one change since was ``set_epoch`` of that epoch."""
        s = self._sampler
        return (
            prev is not None
            and prev[2] == 0
            and prev[1] > 0
            and changes == prev[3] + 1
            and getattr(s, "_set_epoch_change", None) == changes
            and s._epoch == prev[0]
            and s._resume is None
        )

    def _finish(self, active: list[int]) -> None:
        if self._active is active:
            self._active = None

    def _superseded(self, ticket: int) -> None:
        """With persistent workers a newer pass has reset DataLoader's one iterator, whose
        batches are now that pass's: the older pass stops with an error (it would else
        take the new pass's batches)."""
        if self._one_pass and ticket != self._passes:
            raise GadgetClosedError(
                "this GadgetLoader pass was replaced by a newer iter(): with "
                "persistent_workers=True the workers serve one pass at a time (torch resets "
                "its iterator for the new pass), so an older pass cannot be read on; finish "
                "or drop a pass before starting the next"
            )

    def _plain(self, it: Iterator[Any], active: list[int]) -> Iterator[GadgetBatch]:
        ticket = active[4]
        while True:
            self._superseded(ticket)
            try:
                batch = next(it)
            except StopIteration:
                break
            batch = _on_device(batch, self._device, non_blocking=False)
            active[2] += 1
            yield batch
        self._finish(active)

    def _grouped(
        self, ids_iter: Iterator[torch.Tensor], active: list[int]
    ) -> Iterator[GadgetBatch]:
        """``coalesce`` batches at a time: one gather per column for the group (on the side
        stream with prefetch), handed out as views; one event and one ``record_stream``
        per group, not per batch."""
        # (islice takes at most sys.maxsize: a larger coalesce means the whole epoch)
        dataset, k, device = self._dataset, min(self._coalesce, sys.maxsize), self._device
        side = None
        consumers = _Consumers(device)
        if device.type == "cuda" and self._prefetch > 0:
            side = torch.cuda.Stream(device)
            side.wait_stream(consumers.current())
        depth = max(1, self._prefetch) if side is not None else 1  # no overlap: no read-ahead
        pending: deque[tuple[GadgetBatch, GadgetBatch, Any]] = deque()

        def fetch() -> bool:
            group = list(islice(ids_iter, k))
            if not group:
                return False
            ids = _joined(group)
            ready = None
            if side is not None:
                with torch.cuda.stream(side):
                    whole = _on_device(dataset.gather(ids), device, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(side)
            else:
                whole = _on_device(dataset.gather(ids), device, non_blocking=False)
            if len(group) == 1:
                pending.append((whole, whole, ready))
            else:
                sizes = [g.shape[0] for g in group]
                parts = [t.split_with_sizes(sizes) for t in whole]
                for j in range(len(group)):
                    pending.append((GadgetBatch([p[j] for p in parts]), whole, ready))
            return True

        more = True
        waited: tuple[Any, int] = (None, 0)  # (event, raw stream) last waited for
        if side is not None:
            while more and len(pending) < depth:
                more = fetch()
        while True:
            # no read-ahead without the side stream: a group is gathered only when its
            # first batch is asked for (after the consumer's writes to the tables)
            if not pending and (not more or not (more := fetch())):
                break
            batch, whole, ready = pending.popleft()
            if ready is not None:
                sid = consumers.raw()
                if waited[0] is not ready or waited[1] != sid:
                    consumer = consumers.current(sid)
                    consumer.wait_event(ready)
                    whole.record_stream(consumer)
                    waited = (ready, sid)
            if side is not None and more and len(pending) < depth:
                more = fetch()
            active[2] += 1
            yield batch
        self._finish(active)

    def _prefetched(self, it: Iterator[Any], active: list[int]) -> Iterator[GadgetBatch]:
        if self._device.type != "cuda" or self._prefetch == 0:
            yield from self._plain(it, active)
            return
        device = self._device
        consumers = _Consumers(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(consumers.current())
        pending: deque[tuple[GadgetBatch, torch.cuda.Event]] = deque()
        ticket = active[4]

        def fetch() -> bool:
            self._superseded(ticket)
            with torch.cuda.stream(side):
                try:
                    batch = next(it)
                except StopIteration:
                    return False
                batch = _on_device(batch, device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(side)
            pending.append((batch, ready))
            return True

        more = True
        while more and len(pending) < self._prefetch:
            more = fetch()
        while pending:
            batch, ready = pending.popleft()
            consumer = consumers.current()
            consumer.wait_event(ready)
            batch.record_stream(consumer)
            if more:
                more = fetch()
            active[2] += 1
            yield batch
        self._finish(active)


class _Consumers:
    """The current CUDA stream of one device, as torch's ``Stream`` object, built only when
    the stream changes (``torch.cuda.current_stream`` builds a new object per call; the
    raw handle is a cheap read). The caller may switch streams between batches."""

    __slots__ = ("index", "sid", "stream")

    def __init__(self, device: torch.device) -> None:
        self.index = -1
        if device.type == "cuda":
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.sid: int | None = None
        self.stream: Any = None

    def raw(self) -> int:
        """The current stream's handle."""
        return _stream_id(self.index)

    def current(self, sid: int | None = None) -> Any:
        """The current stream (``sid``: its handle, when just read)."""
        if sid is None:
            sid = _stream_id(self.index)
        if sid != self.sid or self.stream is None:
            self.stream = torch.cuda.current_stream(self.index)
            self.sid = sid
        return self.stream


def _joined(group: list[torch.Tensor]) -> torch.Tensor:
    """The ids of consecutive batches as one tensor: a view of the sampler's epoch order
    when they are consecutive slices of it (so they stay the sampler's own ids: no check,
    no copy to the GPU), else their concatenation."""
    first = group[0]
    if len(group) == 1:
        return first
    base = first._base
    if base is not None and base.dim() == 1:
        origin = base.storage_offset()
        start = pos = first.storage_offset() - origin
        for g in group:
            n = g.numel()
            if (
                g._base is not base
                or g.dim() != 1
                or g.storage_offset() - origin != pos
                or (n > 1 and g.stride(0) != 1)
            ):
                break
            pos += n
        else:
            return base[start:pos]
    return torch.cat(group)


def _on_device(batch: Any, device: torch.device, *, non_blocking: bool) -> GadgetBatch:
    if not isinstance(batch, GadgetBatch):
        batch = GadgetBatch(batch)
    if all(t.device == device for t in batch):
        return batch
    return batch.to(device, non_blocking=non_blocking)
