"""GadgetDataset: one or more tables with the same rows, as a torch map-style Dataset.

A batch of ids becomes one gather per column, delivered on the target device
(the GPU where present). torch's ``DataLoader`` asks for a whole batch at once
through :meth:`GadgetDataset.__getitems__`; the result is a one-element list
holding a :class:`GadgetBatch`, which ``default_collate`` returns unchanged (the
type is registered in torch's ``default_collate_fn_map``), so
``DataLoader(GadgetDataset(...), batch_size=B, shuffle=True)`` yields already
batched tensors with no per-sample work and no stacking.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data import get_worker_info as _worker_info
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from .._device import PLACEMENTS, cuda_available, cupy_available, resolve_device
from .._errors import (
    GadgetClosedError,
    GadgetError,
    GadgetIndexError,
    GadgetTypeError,
    GadgetValueError,
    as_choice,
)
from .._fork import keep_in_forked_child
from .._ids import as_ids, check_range
from .._paths import as_path
from ..gadget import DataGadget, _rows_of
from ..stores import Store
from ..transfer import _engine, _kernels
from ._sampler import _AHEAD, SamplerIds, _id_buffer, chunk_rows_of, sampler_ids_bound

__all__ = ["GadgetBatch", "GadgetDataset"]


#: the default read-ahead on CUDA (a :class:`GadgetLoader`'s ``coalesce``, a
#: :class:`GadgetSampler`'s batches read through a dataset's indexing) gathers up to this
#: many bytes of batches at once ...
COALESCE_BYTES = 64 << 20
#: ... and at most this many batches where the row kernel gathers every column in place
#: (H200, 4096 x 512 B batches from a pinned table: 83% of the link with 8 batches per
#: gather, 88% with 32, in one machine session) ...
COALESCE_MAX = 32
#: ... or this many for other columns (a file-backed .npy column took 1.0-1.1 ms a batch
#: with 8, 1.6 ms with 32)
COALESCE_MAX_OTHER = 8


def default_coalesce(batch_nbytes: int, in_place: bool = True) -> int:
    """Batches per gather used on CUDA by default; ``in_place``: every column is gathered
    by the row kernel (``cuda`` / ``pinned`` tables)."""
    most = COALESCE_MAX if in_place else COALESCE_MAX_OTHER
    return max(1, min(most, COALESCE_BYTES // max(1, int(batch_nbytes))))


class GadgetBatch(tuple):  # type: ignore[type-arg]
    """A batch: one tensor per column, each with the batch as its first axis.

    A plain ``tuple`` otherwise (``x, y = batch``). ``DataLoader``'s
    ``default_collate`` passes it through unchanged, its ``pin_memory=True`` pins
    only CPU tensors, and :meth:`to` moves every column.
    """

    __slots__ = ()

    def to(self, device: Any, *, non_blocking: bool = False) -> GadgetBatch:
        """Every column on ``device`` (no copy for columns already there).

        Only a device is taken (a ``torch.device``, a string such as ``'cuda'``, or a CUDA
        index, ``0`` being ``'cuda:0'``): a dtype is refused with
        :class:`~gadgetloader.GadgetTypeError`, since one cast for every column would turn
        integer labels into floats; cast columns one by one instead
        (``x.to(torch.float16), y``). As everywhere in gadgetloader, a CUDA device on a
        machine without CUDA means the CPU, with one ``FallbackWarning``. ``non_blocking``
        is passed to each column's ``Tensor.to`` (asynchronous copies from pinned memory)."""
        if isinstance(device, (torch.dtype, torch.Tensor, bool)):
            raise GadgetTypeError(
                "GadgetBatch.to moves every column to a device and takes a device only; got "
                f"{device if isinstance(device, torch.dtype) else type(device).__name__} (a "
                "cast of every column would change integer labels too: cast columns one by one)"
            )
        wanted = device
        if isinstance(device, (int, np.integer)) and int(device) >= 0:
            device = f"cuda:{int(device)}"  # a CUDA index, as torch reads it with CUDA
        try:
            if device is None or isinstance(device, (int, np.integer)):
                raise GadgetTypeError("not a device")
            dev = torch.device(device)
        except (TypeError, RuntimeError, ValueError) as exc:
            raise GadgetTypeError(
                f"GadgetBatch.to takes a device ('cpu', 'cuda', 'cuda:1', a CUDA index >= 0 "
                f"or a torch.device); got {wanted!r}"
            ) from exc
        if dev.type == "cuda":
            dev = resolve_device(dev)  # the CPU, with the one FallbackWarning, without CUDA
        return GadgetBatch(t.to(dev, non_blocking=non_blocking) for t in self)

    def pin_memory(self) -> GadgetBatch:
        """CPU columns in page-locked memory; GPU columns unchanged (DataLoader's hook).
        Torch pins only where a CUDA device exists (it raises ``RuntimeError`` elsewhere)."""
        return GadgetBatch(t.pin_memory() if t.device.type == "cpu" else t for t in self)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every CUDA column as used on ``stream`` (see ``Tensor.record_stream``)."""
        for t in self:
            if t.is_cuda:
                t.record_stream(stream)

    def __repr__(self) -> str:
        return f"GadgetBatch({', '.join(repr(t) for t in self)})"


class _RowBatch(GadgetBatch):
    """The unbatched rows of one 0-d id (``ds[torch.tensor(3)]``): what a wrapper that
    indexes sample by sample (``ConcatDataset``, torch's per-sample fetcher) collects,
    and ``default_collate`` stacks along a new batch axis."""

    __slots__ = ()


def _collate_gadget_batches(
    batch: Sequence[GadgetBatch], *, collate_fn_map: dict[Any, Any] | None = None
) -> GadgetBatch:
    """``default_collate`` for pre-batched results: one batch passes through unchanged;
    several are concatenated along the batch axis. Unbatched rows (of 0-d ids) are
    stacked along a new batch axis, as ``default_collate`` stacks ``ds[i]``'s tuples."""
    # a sample from another dataset beside a GadgetDataset's rows (``ConcatDataset``) is a
    # row too: its columns are collated as default_collate collates them
    rows = [isinstance(b, _RowBatch) or not isinstance(b, GadgetBatch) for b in batch]
    if all(rows):
        if all(isinstance(b, _RowBatch) for b in batch):
            return GadgetBatch(torch.stack(list(cols)) for cols in zip(*batch, strict=True))
        widths = {len(b) if isinstance(b, (tuple, list)) else None for b in batch}
        if len(widths) != 1 or None in widths:
            got = sorted({type(b).__name__ for b in batch if not isinstance(b, GadgetBatch)})
            raise GadgetTypeError(
                "default_collate got a GadgetDataset's rows beside samples that are not "
                f"tuples of as many columns ({', '.join(got)}; column counts "
                f"{sorted(w for w in widths if w is not None)}); expected samples of one shape"
            )
        return GadgetBatch(
            collate(list(cols), collate_fn_map=collate_fn_map or default_collate_fn_map)
            for cols in zip(*batch, strict=True)
        )
    if any(rows):
        raise GadgetTypeError(
            "default_collate got both rows of single ids (a 0-d id gives unbatched rows) and "
            "batches of ids; give one kind of index to a GadgetDataset per batch"
        )
    if len(batch) == 1:
        return batch[0]
    return GadgetBatch(torch.cat(list(cols)) for cols in zip(*batch, strict=True))


# torch's documented extension point for default_collate (see its docstring)
default_collate_fn_map.setdefault(GadgetBatch, _collate_gadget_batches)


def _auto_placement(column: Any, device: torch.device) -> str:
    if isinstance(column, torch.Tensor) and column.is_cuda:
        return "cuda"
    if device.type == "cuda" and cuda_available() and cupy_available():
        return "pinned"
    return "cpu"


class GadgetDataset(Dataset[Any]):
    """Columns with the same rows (features, labels, weights...) as a torch Dataset.

    Parameters
    ----------
    *columns : DataGadget, str, path, numpy.ndarray or torch.Tensor
        One or more tables with the same number of rows, at least one (a dataset of
        zero rows is refused with :class:`~gadgetloader.GadgetValueError`, though a
        table may have none). Arrays, tensors and file paths are loaded into a new :class:`~gadgetloader.DataGadget` (see
        ``placement``); DataGadgets are used as they are. 1-D columns (labels)
        give one value per row.
    device : str or torch.device, optional
        Where batches are delivered: the current CUDA device by default, the CPU
        where CUDA is missing.
    placement : str, optional
        Placement for columns given as arrays, tensors or paths. Default: ``cuda``
        for CUDA tensors, ``pinned`` where CUDA and CuPy are present, else ``cpu``
        (all without a fallback warning). ``'file'`` opens paths file-backed; arrays
        and tensors among the columns (labels beside a file of features, say) then
        take the default in-memory placement, since they have no file to back them.
    **options
        Passed to :class:`~gadgetloader.DataGadget` for paths (``dataset=``,
        ``format=``, file-store options).

    Notes
    -----
    ``ds[ids]`` (list, array, tensor, range or slice) costs one id check, one
    host-to-device copy of the ids (from page-locked memory, asynchronous) and
    one gather per column, all queued on the current CUDA stream; with
    ``pinned`` columns the gather is a GPU kernel reading host RAM in place.
    The dataset decides once per column how its rows move: a ``cuda`` or ``pinned``
    table that its strategy gathers with the row kernel (``auto`` up to 2 GB, where
    batches of 2^18 ids or more take the unsorted kernel too, or ``strategy='kernel'``)
    costs one allocation and one
    kernel launch per batch, with nothing of the general gather's per-call work
    (same bytes); ``cpu`` tables are indexed directly; file tables and other
    strategies take the store's own gather.

    ``__getitems__`` returns ``[GadgetBatch]``: torch's ``default_collate`` hands
    the batch through unchanged, so the default form needs no ``collate_fn``. A
    custom ``collate_fn`` receives that one-element list (take ``batch[0]``).
    With ``sampler=GadgetSampler(...), batch_size=None`` torch's
    ``default_convert`` turns the tuple into a list of the same tensors.

    In a ``DataLoader`` worker process (``num_workers > 0``) CUDA is never
    touched: rows are gathered on the CPU (``pinned``, ``cpu`` and file
    columns) and batches arrive as CPU tensors; ``cuda`` columns cannot be read
    there. For in-memory tables ``num_workers=0`` is fastest: a batch is
    already a single kernel.

    Examples
    --------
    >>> import numpy as np, gadgetloader as gl
    >>> from torch.utils.data import DataLoader
    >>> x, y = np.ones((10, 4), np.float32), np.arange(10)
    >>> ds = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    >>> [tuple(t.shape) for t in next(iter(DataLoader(ds, batch_size=4)))]
    [(4, 4), (4,)]
    """

    def __init__(
        self,
        *columns: Any,
        device: Any = None,
        placement: str | None = None,
        **options: Any,
    ) -> None:
        if not columns:
            raise GadgetValueError(
                "GadgetDataset needs at least one column (a DataGadget, file path, array or tensor)"
            )
        # (bytes count as a path here: the column's own check then says how to pass one)
        if options and not any(isinstance(c, (str, bytes, os.PathLike)) for c in columns):
            raise GadgetTypeError(
                f"options {sorted(options)} apply to file-path columns (how to open the file), "
                "and this dataset has none"
            )
        self._device = resolve_device(device)
        # its CUDA events and buffers must not be destroyed in a forked DataLoader worker
        keep_in_forked_child(self)
        gadgets: list[DataGadget] = []
        self._owned: list[DataGadget] = []
        try:
            for i, col in enumerate(columns):
                gadgets.append(self._as_gadget(col, i, placement, options))
        except BaseException:
            self.close()
            raise
        self._columns = tuple(gadgets)
        sizes = [len(g) for g in gadgets]
        if len(set(sizes)) > 1:
            self.close()
            detail = ", ".join(f"column {i}: {s}" for i, s in enumerate(sizes))
            raise GadgetValueError(f"all columns must have the same number of rows; got {detail}")
        if sizes[0] == 0:
            self.close()
            raise GadgetValueError("the dataset is empty: its columns have 0 rows")
        self._num_rows = sizes[0]
        self._windows: dict[torch.device, _OrderWindow] = {}
        self._plan: tuple[torch.device, list[_Step]] | None = None
        #: the read-ahead group in use and (order, position) where the next batch in
        #: order would start (see :meth:`_read_ahead`)
        self._group: _Group | None = None
        self._expect: tuple[torch.Tensor, int] | None = None

    def _as_gadget(
        self, col: Any, i: int, placement: str | None, options: dict[str, Any]
    ) -> DataGadget:
        if isinstance(col, DataGadget):
            try:
                col.store.check_open()  # refused now, not at the first batch
            except GadgetClosedError as exc:
                raise GadgetClosedError(f"column {i}: {exc}") from exc
            return col
        if placement is not None:  # (a list or array must not reach a truth test)
            placement = as_choice(
                placement.lower() if isinstance(placement, str) else placement,
                "placement",
                PLACEMENTS,
            )
        if isinstance(col, bytes):  # a file name as bytes: refused as every path taker does
            as_path(col, f"a file path in column {i}")
        if isinstance(col, (str, os.PathLike)):
            where = placement if placement is not None else _auto_placement(col, self._device)
            g = DataGadget(col, placement=where, device=self._device, **options)
        elif isinstance(col, (torch.Tensor, np.ndarray)) or hasattr(
            col, "__cuda_array_interface__"
        ):
            if getattr(col, "ndim", 1) == 0:
                raise GadgetValueError(
                    f"column {i} is a 0-d value; a column needs one row per sample"
                )
            # 'file' applies to path columns; arrays and tensors go to memory
            where = (
                placement if placement not in (None, "file") else _auto_placement(col, self._device)
            )
            g = DataGadget(col, placement=where, device=self._device)
        else:
            raise GadgetTypeError(
                f"column {i} must be a DataGadget, a file path, an array or a tensor; "
                f"got {type(col).__name__}"
            )
        self._owned.append(g)
        return g

    # ---- facts -------------------------------------------------------------------------------
    @property
    def columns(self) -> tuple[DataGadget, ...]:
        """The tables, one per column."""
        return self._columns

    @property
    def device(self) -> torch.device:
        """Where batches are delivered (in the main process)."""
        return self._device

    @property
    def row_nbytes(self) -> int:
        """Bytes of one sample over all columns."""
        return sum(g.store.row_nbytes for g in self._columns)

    @property
    def chunk_rows(self) -> int | None:
        """The chunk (in rows) that the ``chunk`` order shuffles, or None without file-backed
        columns: the least common multiple of the file columns' chunk sizes, so that every
        column's chunks line up with it and each is read once per epoch, or the largest
        size where that multiple is over :data:`CHUNK_LCM_MAX` times it (chunks of the
        other columns that straddle two of its chunks may then be read twice)."""
        sizes = [chunk_rows_of(g.store) for g in self._columns]
        known = [s for s in sizes if s]
        if not known:
            return None
        common = math.lcm(*known)
        return common if common <= CHUNK_LCM_MAX * max(known) else max(known)

    def __len__(self) -> int:
        return self._num_rows

    def __repr__(self) -> str:
        cols = ", ".join(f"{tuple(g.shape)} {g.placement}" for g in self._columns)
        return f"GadgetDataset({len(self)} rows; columns: {cols}; device={str(self._device)!r})"

    # ---- rows --------------------------------------------------------------------------------
    def _target(self) -> torch.device:
        if _worker_info() is not None:
            return _CPU  # never touch CUDA in a DataLoader worker
        return self._device

    def gather(self, indices: Any) -> GadgetBatch:
        """The rows at ``indices`` of every column, gathered once per column.

        Returns a :class:`GadgetBatch` with one tensor of shape
        ``indices.shape + row_shape`` per column. Ids that a :class:`GadgetSampler`
        yielded (unchanged) are in range by construction and are not checked again.
        ``indices`` are ids (a list, tuple, range, array or tensor of integers); a slice
        of rows is ``ds[a:b]``.

        Raises
        ------
        GadgetIndexError, GadgetTypeError
            Ids out of range or not integers (nothing is read).
        """
        bound = sampler_ids_bound(indices)
        if bound is not None and bound <= self._num_rows:
            return self._gather(indices, own=True)
        try:
            ids = _checked_ids(indices, self._num_rows)
        except GadgetIndexError:
            self._check_row_counts()  # a column reloaded to another row count says so
            raise
        return self._gather(ids, own=False)

    def _check_row_counts(self) -> None:
        """Raise if a column was reloaded (``loadCupy`` / ``load``) with another number of
        rows than the dataset was built with."""
        for i, g in enumerate(self._columns):
            n = g.store.shape[0]
            if n != self._num_rows:
                raise GadgetValueError(
                    f"column {i} now has {n} rows but the dataset was built with "
                    f"{self._num_rows}; its columns must keep one row count (build a new "
                    "GadgetDataset after reloading a column)"
                )

    def _gather(self, ids: torch.Tensor, *, own: bool) -> GadgetBatch:
        """One gather per column of checked int64 ``ids``; ``own``: a sampler's own ids
        (a view of its epoch order on the CPU), which CUDA columns take from the order's
        window on the GPU instead of a per-batch copy."""
        target = _CPU if _worker_info() is not None else self._device
        plan = self._plan
        if plan is None or plan[0] is not target or not _plan_valid(plan[1]):
            plan = self._make_plan(target)
        last_ids: torch.Tensor | None = None
        last_win: _OrderWindow | None = None
        out = []
        for step in plan[1]:
            win = step.window
            if win is None:  # the store takes CPU ids
                dev_ids = ids.cpu() if ids.is_cuda else ids
            elif win is last_win and last_ids is not None:
                dev_ids = last_ids  # another column on the same device
            else:
                sliced = win.slice(ids) if own else None
                dev_ids = sliced if sliced is not None else _ids_on(ids, win.device)
                last_ids, last_win = dev_ids, win
            route = step.route
            if own and route is not _KERNEL and not dev_ids.is_cuda and dev_ids.numel():
                # a sampler's ids skipped the check; one changed in place (through NumPy)
                # must not make a file or host read take another row (the row kernels, and
                # so every store gather of CUDA ids, guard their reads themselves)
                lo, hi = torch.aminmax(dev_ids)
                if int(lo) < 0 or int(hi) >= self._num_rows:
                    check_range(dev_ids, self._num_rows)
            view = step.view() if route is not _STORE else None
            if view is None:  # the store's general gather (which also reports a closed store)
                out.append(step.store.gather(dev_ids, target, strategy=step.strategy))
            elif route is _KERNEL:
                out.append(_kernel_gather(view, step.row_shape, dev_ids, dedup=not own))
            else:
                step.store.wait_for_gpu()  # a pinned table: queued GPU writes land first
                out.append(_host_gather(view, step.row_shape, dev_ids, target))
        return GadgetBatch(out)

    def _make_plan(self, target: torch.device) -> tuple[torch.device, list[_Step]]:
        """Per column: its store, where the store takes ids (a device's order window, or
        None for CPU ids) and how its rows move (see :func:`_route`). Checked once, reused
        while every column keeps its store (open) and strategy."""
        steps: list[_Step] = []
        for i, g in enumerate(self._columns):
            store = g.store
            store.check_open()
            if store.shape[0] != self._num_rows:
                self._check_row_counts()
            if (
                target.type == "cpu"
                and _worker_info() is not None
                and store.host_view() is None
                and store.device_view() is not None
            ):
                # (in the main process a CPU target takes a GPU gather, then a copy)
                raise GadgetTypeError(
                    f"column {i} lives in GPU memory ({store.placement!r}) and cannot be read in "
                    "a DataLoader worker process; use num_workers=0 (a batch is one GPU gather) "
                    "or a 'pinned' / 'cpu' column"
                )
            where = store.ids_device(target)
            win = None if where.type == "cpu" else self._window(where)
            route = _route(store, g._strategy, target)
            if route is not _STORE and (route is _HOST) != (win is None):
                route = _STORE  # the ids would arrive where the route cannot use them
            steps.append(_Step(g, store, g._strategy, win, route))
        self._plan = (target, steps)
        return self._plan

    def _routes(self) -> tuple[str, ...]:
        """How each column's rows move to the target in this process (making the plan
        if needed): ``'kernel'`` (one launch of the row kernel, nothing else), ``'host'``
        (CPU indexing of the host view) or ``'store'`` (the store's general gather)."""
        target = _CPU if _worker_info() is not None else self._device
        plan = self._plan
        if plan is None or plan[0] is not target or not _plan_valid(plan[1]):
            plan = self._make_plan(target)
        return tuple(step.route for step in plan[1])

    def _pin_sampler_ids(self) -> bool:
        """Whether a :class:`GadgetSampler` built on this dataset should keep its orders in
        page-locked memory: some column takes its ids on a CUDA device, where a window of
        the order (see :class:`_OrderWindow`) is then one asynchronous copy instead of a
        copy through a staging buffer on the host (on the H200, 0.2-0.5 ms of host time
        per 64 batches of 4096 ids, half the sampler form's spare host time)."""
        try:
            return self._target().type == "cuda" and any(
                step.window is not None for step in self._make_plan(self._target())[1]
            )
        except Exception:  # a closed column: the sampler works as for any row count
            return False

    def _window(self, device: torch.device) -> _OrderWindow:
        win = self._windows.get(device)
        if win is None:
            win = self._windows[device] = _OrderWindow(device)
        return win

    def __getitem__(self, index: Any) -> Any:
        """``ds[i]`` -> a tuple of one row per column; ``ds[ids]`` (list, array, tensor,
        range, slice) -> a :class:`GadgetBatch` of batched columns.

        A single int (also a NumPy integer scalar such as ``np.int64(3)``) and a slice
        follow Python (``ds[-1]`` is the last row, ``ds[-3:]``
        the last three); ids in a list, array or tensor must lie in ``[0, len(ds))``
        (a negative one raises :class:`~gadgetloader.GadgetIndexError`). A 0-d tensor
        or array is an id, not an int: it gives a :class:`GadgetBatch` of one row per
        column (unbatched, as ``ds[i]``'s rows) and must lie in ``[0, len(ds))``. A tuple
        is a list of ids (``ds[1, 0]`` is rows 1 and 0), not the row-then-column index a
        :class:`DataGadget` takes: index the batch's columns instead."""
        if isinstance(index, slice):
            index = _rows_of(index, self._num_rows)
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            i, n = int(index), self._num_rows
            if not -n <= i < n:
                self._check_row_counts()
                raise GadgetIndexError(
                    f"index {i} is out of range for a dataset of {n} rows (an int index, as in "
                    f"Python, must be in [-{n}, {n - 1}])"
                )
            if i < 0:
                i += n
            return tuple(t[0] for t in self.gather([i]))
        got = self._read(index)
        if getattr(index, "ndim", None) == 0:
            return _RowBatch(got)  # collated by stacking (see _collate_gadget_batches)
        return got

    def __getitems__(self, indices: Any) -> list[GadgetBatch]:
        """A whole batch for torch's fetcher: ``[GadgetBatch]`` (see the module notes).

        The default form's ``BatchSampler`` hands over a list of Python ints: it is
        read into int64 in one pass (``struct.pack_into``; a list with anything that is
        not an integer, or with a bool, takes the general path, which refuses them) and
        range-checked once, skipping the general id conversion.
        """
        g = self._group
        if g is not None and type(indices) is SamplerIds:
            got = self._take(g, indices)
            if got is not None:
                return [got]
        if (
            type(indices) is list
            and indices
            and isinstance(indices[0], torch.Tensor)
            and indices[0].dim() >= 1
        ):  # (in a worker process a sampler's batches arrive as plain tensors)
            raise GadgetValueError(
                "DataLoader handed this dataset a list of id batches (a GadgetSampler's?): a GadgetSampler "
                "yields whole batches, so pass it as DataLoader(ds, batch_sampler=sampler) or "
                "DataLoader(ds, sampler=sampler, batch_size=None)"
            )
        if type(indices) is list and indices:
            try:
                ids = self._list_ids(indices)
            except GadgetIndexError:
                self._check_row_counts()
                raise
            if ids is not None:
                return [self._gather(ids, own=False)]
        return [self._read(indices)]

    def _list_ids(self, indices: list[Any]) -> torch.Tensor | None:
        """The default form's list of ids as checked int64, or None: take the general path
        (which explains what is wrong with a list that is not all integers).

        Only a list of Python ints takes this path: their ``sum()`` is an int, which
        a tensor, a NumPy scalar, a float or a string anywhere in the list prevents (a
        C-level pass). One ``struct.pack_into`` (~2x ``array.array``) then writes the
        ids straight into a tensor -- page-locked where they go on to a GPU, so that
        their upload needs no staging copy -- refusing ints beyond int64; bools, which
        both would take as 0 and 1, are looked for only when the smallest id is 0 or 1
        (they are no row ids)."""
        try:
            # every element a Python int (or bool, or int subclass) makes an int: a tensor,
            # NumPy scalar, float or anything else gives another type or raises (C speed)
            if type(sum(indices)) is not int:
                return None
        except Exception:  # noqa: BLE001 - whatever it is, the general path explains
            return None
        n = len(indices)
        ids = _id_buffer(n, torch.int64, self._device.type == "cuda")
        try:
            struct.pack_into(f"{n}q", ids.numpy().data, 0, *indices)
        except (struct.error, TypeError, OverflowError, ValueError):
            return None
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo <= 1 and any(type(i) is bool for i in indices):
            return None
        if lo < 0 or hi >= self._num_rows:
            check_range(ids, self._num_rows)  # raises with the full message
        return ids

    def _read(self, indices: Any) -> GadgetBatch:
        """What indexing returns: :meth:`gather`, except that a sampler's batches read in
        order may come from a read-ahead group (see :meth:`_read_ahead`)."""
        if type(indices) is SamplerIds:
            base = indices._base
            if base is not None:
                ahead = getattr(base, _AHEAD, None)
                if ahead is not None and ahead[0] != 1:
                    got = self._read_ahead(indices, base, ahead)
                    if got is not None:
                        return got
        return self.gather(indices)

    def _read_ahead(
        self, ids: torch.Tensor, base: torch.Tensor, ahead: tuple[int, int]
    ) -> GadgetBatch | None:
        """A sampler's batch ``ids`` (a view of its epoch order ``base``) from a group of
        consecutive batches gathered at once, or None: gather it alone.

        A group starts only at a batch that follows the previous one in the same order
        (a loop over one sampler), and only where every column's rows move by the row
        kernel or by CPU indexing of a host table; it ends at ``ahead[1]``, the end of
        the sampler's share. Its rows are those :meth:`gather` returns for each batch,
        read when the group's first batch is asked for."""
        n = ids.numel()
        if ids.dim() != 1 or n == 0 or (n > 1 and ids.stride(0) != 1):
            return None
        bound = sampler_ids_bound(ids)
        if bound is None or bound > self._num_rows:
            return None  # changed in place, or another table's ids: checked as any ids
        off = int(ids.storage_offset() - base.storage_offset())
        g = self._group
        if g is not None:
            got = self._take(g, ids)
            if got is not None:
                return got
            g = self._group  # (dropped if its columns changed)
            if g is not None and g.base is base and g.lo <= off < g.hi:
                # a batch of the group asked for again (another loop over the same
                # sampler) or in another shape: gathered alone, the group goes on
                return None
        expect, self._expect = self._expect, (base, off + n)
        self._group = None
        if expect is None or expect[0] is not base or expect[1] != off:
            return None  # not a loop over this order (yet): nothing read ahead
        target = self._target()
        k = self._ahead_batches(ahead[0], n, target)
        hi = min(off + k * n, ahead[1], base.numel())
        if hi - off <= n:
            return None
        try:
            whole = self._gather(base[off:hi], own=True)
        except GadgetIndexError:
            # a later batch's ids were changed behind torch's back (through NumPy) to an
            # id out of range: each batch is gathered alone, so the error is its own
            self._expect = None
            return None
        g = _Group(base, off, hi, n, whole, target)
        g.steps = self._plan[1] if self._plan is not None else None
        first = g.views[0]
        g.views[0] = None  # each view is handed out once
        if off + n < hi:
            self._group = g
        return first

    def _take(self, g: _Group, ids: torch.Tensor) -> GadgetBatch | None:
        """Batch ``ids`` from the read-ahead group ``g`` if it holds exactly those rows (a
        view of the same order, unchanged since the group was read, at a batch boundary of
        the group, with the group's columns still those of the dataset), else None. This
        is the per-batch path of a read-ahead: a few attribute reads, no torch operation."""
        base = g.base
        if ids._base is not base or base._version != g.version or ids.dim() != 1:
            return None
        n = ids.numel()
        off = int(ids.storage_offset()) - g.origin
        j, r = divmod(off - g.lo, g.n)
        views = g.views
        if r or not 0 <= j < len(views) or (n > 1 and ids.stride(0) != 1):
            return None
        view = views[j]
        if view is None or view[0].shape[0] != n:
            return None  # handed out already (a second loop over the sampler), or not it
        plan = self._plan
        if plan is None or plan[1] is not g.steps or not _plan_valid(plan[1]):
            self._group = None  # a column closed, reloaded or re-planned: rows are stale
            return None
        if g.index is not None:
            g.on_current_stream()
        views[j] = None  # once: a caller may change its batch in place
        self._expect = (base, off + n)
        if j == len(views) - 1:
            self._group = None  # its last batch: the memory goes with the views
        return view

    def _ahead_batches(self, coalesce: int, n: int, target: torch.device) -> int:
        """Batches of ``n`` rows a read-ahead group may hold (1: none) for a sampler's
        ``coalesce`` (0: the default, see :class:`GadgetSampler`)."""
        plan = self._plan
        if plan is None or plan[0] is not target or not _plan_valid(plan[1]):
            plan = self._make_plan(target)
        routes = {step.route for step in plan[1]}
        if coalesce == 0:
            if target.type != "cuda" or routes != {_KERNEL}:
                return 1
            return default_coalesce(n * self.row_nbytes, in_place=True)
        return coalesce if routes <= {_KERNEL, _HOST} else 1

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the tables this dataset created (not DataGadgets passed in). Idempotent.

        A ``copy.copy`` of the dataset shares its columns and owns none of them (its
        ``close()`` frees nothing); ``copy.deepcopy`` and pickles copy ``cpu`` columns and
        reopen ``file`` columns, and own what they made."""
        self._group = self._expect = None
        for g in self._owned:
            g.close()

    def __getstate__(self) -> dict[str, Any]:
        for n, g in enumerate(self._columns):
            try:
                g.__getstate__()  # a cuda / pinned column refuses: say which column it is
            except GadgetError as exc:
                made = any(g is o for o in self._owned)
                hint = (
                    " (this dataset placed the column there: GadgetDataset(..., "
                    "placement='cpu') keeps the columns it makes picklable)"
                    if made
                    else ""
                )
                raise type(exc)(f"GadgetDataset column {n}: {exc}{hint}") from None
        return self._state()

    def _state(self) -> dict[str, Any]:
        # GPU copies of sampler orders stay behind (a spawned worker must not touch CUDA)
        state = self.__dict__.copy()
        state["_windows"] = {}
        state["_plan"] = None
        state["_group"] = None
        state["_expect"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy (pickle, copy, deepcopy) is registered as the original is in __init__
        self.__dict__.update(state)
        keep_in_forked_child(self)

    def __copy__(self) -> GadgetDataset:
        # the columns are shared, and stay the original's to free (see close)
        new = type(self).__new__(type(self))
        state = self._state()
        state["_owned"] = []
        new.__setstate__(state)
        return new

    def __enter__(self) -> GadgetDataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_CPU = torch.device("cpu")
#: the ``chunk`` order lines up with every file column's chunks while their least common
#: multiple is at most this many times the largest (its windows, and the cache they need,
#: grow with it) (see :attr:`GadgetDataset.chunk_rows`)
CHUNK_LCM_MAX = 2

#: how a column's rows move (see :func:`_route`)
_KERNEL, _HOST, _STORE = "kernel", "host", "store"

#: request sizes at which a column's strategy must resolve to the row kernel for the
#: ``kernel`` route: ``auto`` picks by table size and, past 2 GB, by request size
#: (1024 ids is its small-request boundary, 65,536 the hybrid one). Up to 2^17 ids (32
#: coalesced batches of 4096): ``auto`` sorts requests of 2^18 ids and more even on small
#: tables, which the route skips (a speed difference only; the rows are the same)
_PROBE_IDS = (1, 1024, 1025, 1 << 16, 1 << 17)


class _Step:
    """One column's part of a gather, fixed when the plan is made."""

    __slots__ = ("gadget", "store", "strategy", "window", "route", "view", "row_shape")

    def __init__(
        self,
        gadget: DataGadget,
        store: Any,
        strategy: str,
        window: _OrderWindow | None,
        route: str,
    ) -> None:
        self.gadget = gadget
        self.store = store
        self.strategy = strategy
        #: the ids' GPU window, or None: the store takes CPU ids
        self.window = window
        self.route = route
        #: the view the route reads (``kernel``: the store's CUDA view, ``host``: its host
        #: view), fetched per batch rather than kept, so that closing the store frees it
        self.view: Any = store.device_view if route is _KERNEL else store.host_view
        self.row_shape = tuple(store.row_shape)


def _plan_valid(steps: list[_Step]) -> bool:
    """Every column still has the store (open) and the strategy the plan was made for."""
    for step in steps:
        g, store = step.gadget, step.store
        if g._store is not store or store.closed or g._strategy is not step.strategy:
            return False
    return True


def _route(store: Any, strategy: str, target: torch.device) -> str:
    """How a column's rows reach ``target``.

    ``kernel``: the store keeps its rows in a CUDA view on ``target`` and its strategy is
    the row kernel at every request size (``auto`` on a table of at most
    ``SORT_ABOVE_BYTES``, or ``kernel`` forced; CuPy present). A batch is then an
    allocation and one kernel launch, exactly what :meth:`Store.gather` would launch,
    without its per-call bookkeeping. ``host``: the store would index its host view on
    the CPU (CPU target, or no CUDA view). ``store``: anything else -- file stores, other
    strategies, a CUDA view on another device -- goes through :meth:`Store.gather`.
    """
    if type(store).gather is not Store.gather:  # the store moves rows its own way (files)
        return _STORE
    hv = store.host_view()
    dv = store.device_view() if target.type == "cuda" else None  # no CUDA in a worker
    if dv is not None:
        if dv.device != target or dv.dim() == 0:
            return _STORE
        try:
            kernel = all(
                _engine.resolve_strategy(strategy, dv, n, hv) == "kernel" for n in _PROBE_IDS
            )
        except Exception:  # an unknown strategy: the store's gather reports it
            return _STORE
        return _KERNEL if kernel else _STORE
    if hv is not None and hv.dim() > 0:
        return _HOST
    return _STORE


def _kernel_gather(
    view: torch.Tensor, row_shape: tuple[int, ...], ids: torch.Tensor, *, dedup: bool
) -> torch.Tensor:
    """``view[ids]`` by the row kernel (``ids``: checked int64 on the view's device); what
    ``Store.gather`` launches for the ``kernel`` strategy, bit for bit. ``dedup``: the ids
    may repeat (not a sampler's batch), so a large request reads each row once."""
    if ids.dim() == 1:  # a sampler's batch (gather_rows densifies ids it cannot read)
        out = view.new_empty(ids.shape[0], *row_shape)
        _kernels.gather_rows(view, ids, out, dedup=dedup)
        return out
    flat = ids.reshape(-1)
    out = view.new_empty(flat.numel(), *row_shape)
    _kernels.gather_rows(view, flat, out, dedup=dedup)
    return out.view(tuple(ids.shape) + row_shape)


def _host_gather(
    view: torch.Tensor, row_shape: tuple[int, ...], ids: torch.Tensor, target: torch.device
) -> torch.Tensor:
    """``view[ids]`` by CPU indexing of a host view (``ids``: checked int64 on the CPU),
    delivered to ``target``; what ``Store.gather`` does for host tables."""
    if ids.dim() == 1:
        rows = torch.index_select(view, 0, ids)
    else:
        rows = torch.index_select(view, 0, ids.reshape(-1)).view(tuple(ids.shape) + row_shape)
    return rows if target.type == "cpu" else rows.to(target)


#: ids per upload of a sampler's epoch order to the GPU (2 MiB of int64; 64 batches of 4096)
WINDOW_IDS = 1 << 18


class _OrderWindow:
    """A window of a :class:`GadgetSampler`'s epoch order on one device.

    The sampler yields views of its (CPU) epoch order. Instead of copying each
    batch's ids to the GPU, the order is uploaded :data:`WINDOW_IDS` positions at a
    time and a batch's ids are a slice of the upload: one copy per 64 batches of
    4096, none per batch. The upload is queued on the stream current at that time;
    another stream that takes a slice first waits for the upload (an event) and is
    recorded on the window's memory, so the caching allocator never reuses it under
    a kernel still reading it. Only ids that are tagged and unchanged reach here
    (see :func:`~gadgetloader.data._sampler.sampler_ids_bound`), so the window holds
    exactly their values.
    """

    __slots__ = ("device", "index", "current", "uploads")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index: int | None = None  # the CUDA device index (None: no streams to mind)
        if device.type == "cuda":
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        # the upload in use, replaced whole (threads sharing a dataset see one consistent
        # upload): the order (kept alive, so `is` is safe), its positions [lo, hi), the ids
        # on the device, the upload's stream, its event, streams that waited for it
        self.current: _Upload | None = None
        self.uploads = 0

    @property
    def lo(self) -> int:
        return self.current.lo if self.current is not None else 0

    @property
    def base(self) -> torch.Tensor | None:
        return self.current.base if self.current is not None else None

    def slice(self, ids: torch.Tensor) -> torch.Tensor | None:
        """``ids`` on the device as a slice of the window (uploading the window that
        starts at them if needed), or None where ``ids`` is not a 1-D slice of an order."""
        base = ids._base
        if base is None or ids.dim() != 1:
            return None
        n = ids.numel()
        if n > 1 and ids.stride(0) != 1:
            return None
        up = self.current
        if up is not None and base is up.base:  # the order in use (checked at its upload)
            off = int(ids.storage_offset()) - up.origin
            inside = up.lo <= off and off + n <= up.hi
        elif base.dim() != 1 or not base.is_contiguous():
            return None
        else:
            off = int(ids.storage_offset() - base.storage_offset())
            inside = False
        if up is None or not inside:
            if off < 0 or off + n > base.numel():
                return None  # not a slice of the order's elements
            up = self._upload(base, off, n)
        if self.index is not None:
            current = _stream_id(self.index)
            if current != up.stream and current not in up.others:
                stream = torch.cuda.current_stream(self.index)
                stream.wait_event(up.ready)
                up.ids.record_stream(stream)
                up.others.append(current)
        start = off - up.lo
        return up.ids[start : start + n]

    def _upload(self, base: torch.Tensor, off: int, n: int) -> _Upload:
        hi = min(base.numel(), off + max(n, WINDOW_IDS))
        dev_ids = _ids_on(base[off:hi], self.device)
        stream, ready = 0, None
        if self.index is not None:
            stream = _stream_id(self.index)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        up = _Upload(base, int(base.storage_offset()), off, hi, dev_ids, stream, ready, [])
        self.current = up
        self.uploads += 1
        return up


class _Group:
    """Rows of consecutive sampler batches of ``n`` rows gathered at once: positions
    ``[lo, hi)`` of the order ``base`` (its version then: ``version``), one tensor per
    column in ``whole``, cut into the batches' views up front (``views``; the last may be
    shorter). On CUDA, the stream that gathered them and an event after the gather:
    another stream that takes a batch first waits for the event and is recorded on the
    group's memory (as for :class:`_OrderWindow`)."""

    __slots__ = (
        "base", "origin", "version", "lo", "hi", "n", "views", "target",
        "whole", "index", "stream", "ready", "others", "steps",
    )  # fmt: skip

    def __init__(
        self,
        base: torch.Tensor,
        lo: int,
        hi: int,
        n: int,
        whole: GadgetBatch,
        target: torch.device,
    ) -> None:
        self.base, self.lo, self.hi, self.n, self.target = base, lo, hi, n, target
        self.origin = int(base.storage_offset())
        self.version = base._version
        self.whole = whole
        #: the dataset's column plan the rows were read with (see GadgetDataset._take)
        self.steps: list[_Step] | None = None
        full = (hi - lo) // n
        cols = []
        for t in whole:  # one unbind per column: cheaper than a slice per batch
            parts = list(t[: full * n].reshape(full, n, *t.shape[1:]).unbind(0))
            if full * n < hi - lo:
                parts.append(t[full * n :])
            cols.append(parts)
        #: the batches' views, each set to None once handed out
        self.views: list[GadgetBatch | None] = [
            GadgetBatch(parts) for parts in zip(*cols, strict=True)
        ]
        self.index: int | None = None
        self.stream = 0
        self.ready: Any = None
        self.others: list[int] = []
        if target.type == "cuda":
            self.index = target.index if target.index is not None else torch.cuda.current_device()
            self.stream = _stream_id(self.index)
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.index))

    def on_current_stream(self) -> None:
        """Make the group's rows safe to use on the current stream (CUDA only)."""
        assert self.index is not None
        current = _stream_id(self.index)
        if current != self.stream and current not in self.others:
            stream = torch.cuda.current_stream(self.index)
            stream.wait_event(self.ready)
            for t in self.whole:
                t.record_stream(stream)
            self.others.append(current)


class _Upload(NamedTuple):
    base: torch.Tensor
    origin: int  # the base's storage offset
    lo: int
    hi: int
    ids: torch.Tensor
    stream: int
    ready: Any
    others: list[int]


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_id(index: int) -> int:
    """The current CUDA stream of device ``index`` as a number (without building a
    ``torch.cuda.Stream``: this runs once per batch)."""
    if _raw_stream is not None:
        return int(_raw_stream(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


#: tensor types read as ids without the general conversion (a sampler's batches included)
_PLAIN_TENSORS = (torch.Tensor, SamplerIds)


def _checked_ids(indices: Any, num_rows: int) -> torch.Tensor:
    """Checked int64 ids; a CPU int64 tensor (what samplers yield) takes a one-pass check."""
    if (
        isinstance(indices, torch.Tensor)
        and type(indices) in _PLAIN_TENSORS
        and indices.dtype == torch.int64
        and indices.device.type == "cpu"
        and indices.layout == torch.strided
    ):
        if indices.numel():
            lo, hi = torch.aminmax(indices)
            if int(lo) < 0 or int(hi) >= num_rows:
                check_range(indices, num_rows)  # raises with the full message
        return indices
    return as_ids(indices, num_rows)


def _ids_on(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Checked ids on ``device``, contiguous (the row kernel reads them densely); CPU ids go
    to the GPU from page-locked memory, asynchronously."""
    if ids.device == device:
        return ids if ids.is_contiguous() else ids.contiguous()
    if device.type == "cuda" and ids.device.type == "cpu":
        if not ids.is_pinned():
            staged = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            staged.copy_(ids)
            ids = staged
        # torch's pinned allocator keeps `staged` until this copy has run
        return ids.to(device, non_blocking=True)
    return ids.to(device)
