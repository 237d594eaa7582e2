"""The store contract: one table, a first axis of rows, one placement.

A store says where its bytes are through two capabilities:

* :meth:`Store.device_view` -- a CUDA tensor over the whole table that GPU kernels
  may read and write in place (``cuda`` and ``pinned``), or ``None``;
* :meth:`Store.host_view` -- a CPU tensor over the whole table in host RAM
  (``pinned`` and ``cpu``), or ``None``.

Gather and scatter are written once, here, against those two views; a placement
only allocates and frees memory. Stores that hold their rows elsewhere (files)
override :meth:`gather`, :meth:`scatter`, :meth:`read_block` and
:meth:`write_block`. Ids reaching a store are already checked int64 tensors, except those of a GPU gather
by the row kernels, whose check may finish after it (``DataGadget.getData``).
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

import torch

from .._dtypes import dtype_name
from .._errors import GadgetClosedError, ReadOnlyError
from .._ids import last_writer
from ..transfer import _engine
from ..transfer._engine import shares_memory

__all__ = ["FusedRows", "Store", "gather_many", "scatter_many"]


class StoreRetired(GadgetClosedError):
    """A call reached a store that a load replaced meanwhile (see :meth:`Store.retire`);
    the table makes the call again on its new store."""


class Store(abc.ABC):
    """Abstract table of ``shape[0]`` rows of shape ``shape[1:]`` and one dtype."""

    #: the placement name (``'cpu'``, ``'cuda'``, ``'pinned'``, ``'file'``)
    placement: ClassVar[str]
    #: whether :meth:`scatter` / :meth:`write_block` are allowed
    supports_writes: ClassVar[bool] = True

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._shape = tuple(int(s) for s in shape)
        self._dtype = dtype
        self._closed = False

    # ---- facts ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def num_rows(self) -> int:
        return self._shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self._shape[1:]

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.row_shape) * self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def cuda_device(self) -> torch.device | None:
        """The CUDA device of :meth:`device_view`, or None."""
        view = self.device_view()
        return view.device if view is not None else None

    # ---- capabilities (placements implement these) ---------------------------------------
    def device_view(self) -> torch.Tensor | None:
        """A CUDA tensor over the whole table, read and written in place, or None."""
        return None

    def host_view(self) -> torch.Tensor | None:
        """A CPU tensor over the whole table in host RAM, or None."""
        return None

    @abc.abstractmethod
    def _release(self) -> None:
        """Drop this store's references to its memory."""

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Release the table's memory now. Idempotent."""
        if not self._closed:
            self._closed = True
            self._release()

    def exclusive(self) -> Any:
        """A context in which this thread's calls on the store are not interleaved with
        other threads' (a read, change and write-back of part of rows). In-memory stores
        take no locks: a null context. A file store holds its file's lock."""
        return contextlib.nullcontext()

    #: set by :meth:`retire`: the table this store served has another store now
    _retired = False

    def retire(self) -> None:
        """Close this store because its table has a new one (``DataGadget.load``): a call
        that another thread began on it and that reaches it after this raises
        :class:`StoreRetired`, which the table answers by making the call again on its
        new store."""
        self._retired = True
        self.close()

    def check_open(self) -> None:
        if self._closed:
            if self._retired:
                raise StoreRetired(
                    f"this {self.placement} table was reloaded by another thread during this call"
                )
            raise GadgetClosedError(
                f"this {self._describe()} is closed; open it again (e.g. a new DataGadget) "
                "to use its rows"
            )

    def check_writable(self) -> None:
        self.check_open()
        if not self.supports_writes:
            raise ReadOnlyError(f"this {self.placement} store is read-only")

    def _describe(self) -> str:
        """The table in a few words, for messages."""
        return f"{self.placement} table ({tuple(self._shape)} {dtype_name(self._dtype)})"

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<{type(self).__name__} {self.placement} shape={self._shape} dtype={self._dtype}{state}>"

    # ---- row movement ------------------------------------------------------------------
    def ids_device(self, out_device: torch.device) -> torch.device:
        """Where ids should be for a gather delivered to ``out_device``."""
        dv = self.device_view()
        if out_device.type == "cuda" and dv is not None:
            return dv.device
        if self.host_view() is not None:
            return torch.device("cpu")
        return dv.device if dv is not None else torch.device("cpu")

    def hybrid_for(self, out_device: torch.device, n_ids: int, strategy: str = "auto") -> bool:
        """Whether a gather of ``n_ids`` ids to ``out_device`` would take the ``hybrid``
        strategy (CPU threads gather a share of the rows), which wants the ids on the
        CPU: CPU ids then stay there instead of going to the GPU and back."""
        if out_device.type != "cuda" or n_ids <= 0:
            return False
        dv, hv = self.device_view(), self.host_view()
        if dv is None or hv is None:
            return False
        return _engine.resolve_strategy(strategy, dv, n_ids, hv) == "hybrid"

    def gather(
        self,
        ids: torch.Tensor,
        device: torch.device,
        out: torch.Tensor | None = None,
        strategy: str = "auto",
    ) -> torch.Tensor:
        """Rows at ``ids`` (checked int64) as a tensor on ``device`` of shape ``ids.shape + row_shape``."""
        self.check_open()
        dv = self.device_view()
        if device.type == "cuda" and dv is not None:
            return _engine.gather(dv, ids, out=out, strategy=strategy, host=self.host_view())
        hv = self.host_view()
        if hv is not None:
            self.wait_for_gpu()
            rows = torch.index_select(hv, 0, ids.reshape(-1).cpu())
            rows = rows.view(tuple(ids.shape) + self.row_shape)
        else:
            if dv is None:
                self._closed_meanwhile()
            rows = _engine.gather(dv, ids.to(dv.device), strategy=strategy)
        if out is not None:
            out.copy_(rows)
            return out
        return rows.to(device)

    def precheck_scatter(self, ids: torch.Tensor) -> None:
        """Raise now what a scatter of ``ids`` would find on its way (a damaged file chunk)
        without writing anything: a write to several tables checks them all before the
        first is written. In-memory stores have nothing to check."""
        return None

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
        """``table[ids] = rows``; a repeated id takes its *last* occurrence's row.

        ``unique=True`` promises distinct ids, which lets the GPU path skip the merge
        of repeats (results with repeated ids are then undefined);
        ``ids_sorted=True`` with it promises they ascend too (a row plan's), for the
        GPU kernel's launch shape (any order gives the same result). ``check``: a
        pending check of the ids (it raises if they are bad), called before anything
        is written (on the GPU path after the merge of repeats is queued), or, for a
        :class:`~gadgetloader._ids.GuardedCheck` on the GPU kernels' path, after the
        write is queued: the kernel then writes nothing if an id is bad.
        """
        self.check_writable()
        dv = self.device_view()
        hv = self.host_view()
        if dv is not None and (rows.is_cuda or hv is None):
            _engine.scatter(
                dv,
                ids,
                rows.to(dv.device),
                strategy=strategy,
                host=hv,
                unique=unique,
                ids_sorted=ids_sorted,
                check=check,
            )
            return
        if check is not None:
            check()
        if hv is None:
            self._closed_meanwhile()
        src = rows.reshape(ids.numel(), *self.row_shape).cpu()
        self.wait_for_gpu()  # queued GPU writes land first: this write is the later one
        if unique:
            if shares_memory(src, hv):
                src = src.clone()  # rows of the table itself: read them all before any write
            hv.index_copy_(0, ids.reshape(-1).cpu(), src)
            return
        flat = ids.reshape(-1).cpu()
        plan = last_writer(flat)
        if bool(plan.keep.all()):  # no repeats: every row is written as it is
            if shares_memory(src, hv):
                src = src.clone()  # rows of the table itself: read them all before any write
            hv.index_copy_(0, flat, src)
            return
        # each id's last occurrence, in the order given: ascending positions read the rows
        # nearly in order (gathering them in id order was 2.4x slower on 64 MiB of rows)
        win = plan.pos[plan.keep].sort().values
        hv.index_copy_(0, flat[win], src[win])

    def read_block(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` as a CPU tensor (a view where the table is in host RAM)."""
        self.check_open()
        hv = self.host_view()
        if hv is not None:
            self.wait_for_gpu()
            return hv[start:stop]
        dv = self.device_view()
        if dv is None:
            self._closed_meanwhile()
        return dv[start:stop].cpu()

    def write_block(self, start: int, rows: torch.Tensor) -> None:
        """Write contiguous rows from ``start`` (any device; values only, never autograd)."""
        self.check_writable()
        rows = rows.detach()  # a Parameter copied in must not put the table under autograd
        stop = start + rows.shape[0]
        hv = self.host_view()
        if hv is not None and not rows.is_cuda:
            self.wait_for_gpu()
            hv[start:stop].copy_(rows)
            return
        dv = self.device_view()
        if dv is not None:
            dv[start:stop].copy_(rows, non_blocking=rows.is_pinned())
        else:
            if hv is None:
                self._closed_meanwhile()
            hv[start:stop].copy_(rows)

    def apply_(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run an in-place torch initializer ``fn(tensor, *args, **kwargs)`` over the table.

        Where a CUDA view exists the GPU fills the table in place (for ``pinned``,
        straight into host RAM: no GPU-sized temporary); otherwise the CPU does.
        """
        self.check_writable()
        view = self.device_view()
        if view is None:
            view = self.host_view()
        assert view is not None
        with torch.no_grad():  # an alias: a shape-changing fn (t_, resize_) leaves the table's
            fn(view.view(view.shape), *args, **kwargs)

    def _closed_meanwhile(self) -> NoReturn:
        """A view came back empty after the open check: another thread closed the table."""
        self.check_open()  # a store retired by a load says so
        raise GadgetClosedError(f"this {self.placement} table was closed by another thread")

    def gpu_view_in_use(self) -> torch.Tensor | None:
        """The CUDA view GPU kernels may have used on rows the CPU also reaches (a
        ``pinned`` table's), or None (no such view, or none made yet)."""
        return None

    def wait_for_gpu(self) -> None:
        """Before the CPU reads or writes rows the GPU also reaches: wait for the work queued
        on the device, so CPU reads see queued GPU writes and CPU writes land after them.
        (Nothing to wait for without a GPU view, or where CUDA is unusable: a DataLoader
        worker, a process forked after CUDA started.)"""
        dv = self.gpu_view_in_use()
        if dv is not None and dv.is_cuda and _cuda_usable():
            torch.cuda.synchronize(dv.device)

    def synchronize(self) -> None:
        """Wait for GPU work on this store's device (not on the hot path)."""
        dv = self.device_view()
        if dv is not None:
            torch.cuda.synchronize(dv.device)


def _cuda_usable() -> bool:
    """CUDA started in this process and may be called (not a process forked after it started)."""
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    return torch.cuda.is_initialized() and not bad_fork()


def _fused_views(stores: list[Store], device: torch.device) -> list[torch.Tensor] | None:
    """The CUDA views of ``stores`` if one fused launch can move them all to/from ``device``."""
    if device.type != "cuda" or not stores:
        return None
    views = []
    for s in stores:
        s.check_open()
        dv = s.device_view()
        if dv is None or dv.device != device:
            return None
        views.append(dv)
    first = stores[0]
    if any(s.num_rows != first.num_rows or s.row_nbytes != first.row_nbytes for s in stores):
        return None
    return views


def gather_many(
    stores: list[Store],
    ids: torch.Tensor,
    device: torch.device,
    outs: list[torch.Tensor | None] | None = None,
    strategy: str = "auto",
    *,
    ids_sorted: bool = False,
    count: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The rows at ``ids`` of several stores with the same rows (a table and its optimizer
    states): one fused GPU launch per four stores where they are all CUDA-addressable,
    else one :meth:`Store.gather` each. ``ids_sorted=True``: the ids are ascending.

    ``count`` (a 1-element int64 tensor, see :func:`gadgetloader.transfer._engine.gather_many`):
    only the first ``count`` of the 1-D ``ids`` are gathered, the other rows are zeros.
    The GPU kernels read it on the device; other paths read it back first."""
    outs = [None] * len(stores) if outs is None else list(outs)
    views = _fused_views(stores, device)
    if views is not None:
        hosts = [s.host_view() for s in stores]
        return _engine.gather_many(
            views, ids, outs, strategy, hosts, ids_sorted=ids_sorted, count=count
        )
    if count is not None:
        n = ids.numel()
        k = max(0, min(int(count.reshape(()).item()), n))
        full = [
            torch.empty((n, *s.row_shape), dtype=s.dtype, device=device) if o is None else o
            for s, o in zip(stores, outs, strict=True)
        ]
        for s, o in zip(stores, full, strict=True):
            o[k:].zero_()
            s.gather(ids.reshape(-1)[:k], device, out=o[:k], strategy=strategy)
        return full
    return [
        s.gather(ids, device, out=o, strategy=strategy) for s, o in zip(stores, outs, strict=True)
    ]


def scatter_many(
    stores: list[Store],
    ids: torch.Tensor,
    rows: list[torch.Tensor],
    strategy: str = "auto",
    *,
    unique: bool = False,
    count: torch.Tensor | None = None,
    ids_sorted: bool = False,
) -> None:
    """``store[ids] = rows[k]`` for every store ``k`` (same rows), fused like :func:`gather_many`.

    ``unique=True`` promises distinct ids and ``ids_sorted=True`` with it ascending ones
    (see :meth:`Store.scatter`). ``count`` (with ``unique``): only the first ``count`` ids
    and rows are written."""
    device = rows[0].device if rows else torch.device("cpu")
    views = _fused_views(stores, device)
    if views is not None and all(r.device == device for r in rows):
        for s in stores:
            s.check_writable()
        _engine.scatter_many(
            views,
            ids,
            rows,
            strategy,
            [s.host_view() for s in stores],
            unique=unique,
            count=count,
            ids_sorted=ids_sorted,
        )
        return
    if count is not None:
        n = ids.numel()
        k = max(0, min(int(count.reshape(()).item()), n))
        ids = ids.reshape(-1)[:k]
        rows = [r.reshape(n, *s.row_shape)[:k] for s, r in zip(stores, rows, strict=True)]
    # rows that alias one of the tables are read before any table is written (as the fused
    # GPU path does)
    rows = [
        r.clone() if any(_engine.shares_memory(r, v) for s in stores for v in _views(s)) else r
        for r in rows
    ]
    for s, r in zip(stores, rows, strict=True):
        s.scatter(ids, r, strategy, unique=unique, ids_sorted=ids_sorted)


def _views(store: Store) -> list[torch.Tensor]:
    return [v for v in (store.host_view(), store.gpu_view_in_use()) if v is not None]


class FusedRows:
    """Stores moved together on every training step (a table and its optimizer states),
    with their CUDA views, launch groups and kernels resolved once (see
    :class:`~gadgetloader.transfer._kernels.FusedLauncher`): the per-step cost of a
    gather or scatter of a plan sized on the GPU is then one allocation and one launch
    per group. :meth:`of` returns None where the stores have no fused GPU path.
    """

    def __init__(self, stores: list[Store], views: list[torch.Tensor]) -> None:
        from ..transfer._kernels import FusedLauncher

        self.stores = list(stores)
        self.groups = [(g, FusedLauncher(views[g])) for g in _engine._groups(views)]
        self.device = views[0].device
        self.layouts = [(s.row_shape, s.dtype) for s in stores]

    @classmethod
    def of(cls, stores: list[Store], device: torch.device) -> FusedRows | None:
        from .._device import cupy_available

        if device.type != "cuda" or not cupy_available():
            return None
        views = _fused_views(stores, device)
        if views is None:
            return None
        how = _engine.resolve_strategy("auto", views[0], 1 << 20, None)
        return cls(stores, views) if how in ("kernel", "sorted") else None

    def matches(self, stores: list[Store]) -> bool:
        """Whether this was built for exactly ``stores`` and they are all still open."""
        return (
            len(stores) == len(self.stores)
            and all(a is b for a, b in zip(stores, self.stores, strict=True))
            and not any(s.closed for s in stores)
        )

    def gather(self, ids: torch.Tensor, count: torch.Tensor) -> list[torch.Tensor]:
        """Rows of the first ``count`` of the sorted distinct 1-D ``ids`` (int64 on the
        device) from every store, the rest zero (see :func:`gather_many`)."""
        n = ids.numel()
        outs = [
            torch.empty((n, *shape), dtype=dtype, device=self.device)
            for shape, dtype in self.layouts
        ]
        for g, launcher in self.groups:
            launcher.gather(ids, outs[g], count)
        return outs

    def scatter(self, ids: torch.Tensor, rows: list[torch.Tensor], count: torch.Tensor) -> None:
        """``store[ids[:count]] = rows[k][:count]`` for every store (distinct ids)."""
        for st in self.stores:
            st.check_writable()
        for g, launcher in self.groups:
            launcher.scatter(ids, rows[g], count)
