"""Which table rows a batch touches: merge repeated ids into one local row each.

A batch of global row ids (any shape, repeats allowed) becomes a :class:`RowPlan`:
the distinct ids in ascending order (the rows to gather and scatter) and, for
every position of the batch, its *local* id -- the row of the small per-batch
variable that holds it. Every occurrence of a repeated id maps to the same local
row, so autograd sums the gradients of all its occurrences exactly as it would for
a full-table parameter.

The SpeedTorch protocol (``variableTransformer``) instead lays the rows out one per
position (``duplicates='separate'``): repeats become separate rows, each updated on
its own, and the last one written back wins. That mode is kept for old loops.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np
import torch

from .._device import pinned_empty
from .._errors import GadgetKeyError
from .._fork import keep_in_forked_child
from .._ids import check_range

__all__ = [
    "DUPLICATE_MODES",
    "PlanCache",
    "RowPlan",
    "exact_plan",
    "plan_rows",
    "plan_rows_async",
    "split_local",
]

#: ``merge``: one local row per distinct id (exact); ``separate``: one row per position
DUPLICATE_MODES: tuple[str, ...] = ("merge", "separate")


class RowPlan(NamedTuple):
    """Rows of one step.

    Attributes
    ----------
    ids : torch.Tensor
        1-D int64 global ids, one per local row (sorted and distinct for ``merge``).
    local : torch.Tensor
        1-D int64 local row of every batch position (flattened ``pos`` then ``neg``).
    shapes : tuple of tuple of int
        Shapes of the id tensors the plan was built from, to split ``local`` again.
    distinct : bool
        Whether ``ids`` are distinct (``merge``): writes then need no merging of repeats.
    """

    ids: torch.Tensor
    local: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]
    #: True when ``ids`` are distinct (``merge``): scatters then skip merging repeats
    distinct: bool = False
    #: a plan sized on the GPU (:func:`plan_rows_async`): the number of distinct ids as a
    #: 1-element int64 tensor; ``ids`` then holds one entry per batch position, the
    #: distinct ids first and, after them, copies of the largest id (padding rows)
    n_distinct: torch.Tensor | None = None
    #: with ``n_distinct``: the batch positions in ascending id order (a stable sort) ...
    order: torch.Tensor | None = None
    #: ... and the local row of each of them (ascending)
    order_local: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Rows of the per-step variable (with ``n_distinct``: its capacity, padding included)."""
        return int(self.ids.numel())


def plan_rows(
    parts: tuple[torch.Tensor, ...], mode: str = "merge", num_rows: int | None = None
) -> RowPlan:
    """Build the plan for the int64 id tensors ``parts`` (all on one device).

    With ``num_rows`` the ids are range-checked here (for CUDA ids in ``merge``, within
    the one synchronisation that ``torch.unique`` needs anyway), so callers can convert
    ids with ``as_ids(..., check=False)``.

    Raises
    ------
    GadgetIndexError
        An id outside ``[0, num_rows)``; nothing has been read or written.

    Notes
    -----
    ``merge`` runs one ``torch.unique(sorted=True, return_inverse=True)``; on CUDA that
    is a sort plus one stream synchronisation (the number of distinct rows sizes the
    per-step variable). Sorted distinct ids also make the later gather and scatter walk
    the table in address order. The local ids preserve the order of the global ids, so
    gradient accumulation for repeats runs in the same order as for a full table.
    """
    shapes = tuple(tuple(p.shape) for p in parts)
    flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
    if mode == "separate":
        if num_rows is not None:
            check_range(flat, num_rows)
        local = torch.arange(flat.numel(), device=flat.device)
        return RowPlan(flat, local, shapes)
    if num_rows is None or flat.numel() == 0:
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    elif not flat.is_cuda:
        check_range(flat, num_rows)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    else:
        # the range travels to pinned host memory on the stream *before* unique, whose own
        # synchronisation (it must learn the row count) then covers the copy: one
        # synchronisation per plan instead of two
        ends = _ends_buffer()
        ends.copy_(torch.stack(torch.aminmax(flat)), non_blocking=True)
        done = torch.cuda.current_stream(flat.device).record_event()
        # int32 keys halve the radix sort's passes (ids out of int32 range are refused below)
        narrow = flat.to(torch.int32) if num_rows <= _INT32_ROWS else flat
        uniq, inverse = torch.unique(narrow, sorted=True, return_inverse=True)
        uniq = uniq.to(torch.int64)
        done.synchronize()  # already complete: unique synchronised after it
        lo, hi = ends.tolist()
        if lo < 0 or hi >= num_rows:
            check_range(torch.tensor([lo, hi]), num_rows)  # raises with the usual message
    return RowPlan(uniq, inverse.reshape(-1), shapes, True)


def plan_rows_async(
    parts: tuple[torch.Tensor, ...], num_rows: int, ends: torch.Tensor | None = None
) -> RowPlan:
    """The ``merge`` plan of int64 id tensors on one device, built without a GPU->CPU
    synchronisation: its row count stays on the device.

    The per-step variable gets one row per batch position (its *capacity*): the distinct
    ids in ascending order come first, and the rest are padding rows (their ids repeat the
    largest id; the row kernels read ``n_distinct`` and neither read nor write them: a
    gather zero-fills them). Local ids are as :func:`plan_rows` gives. The ids are not
    range-checked here: ``ends`` (a pinned int64 pair), if given, receives the smallest
    and largest id, copied on the stream (see :func:`gadgetloader._ids.start_range_check`).

    On CUDA (up to :data:`KERNEL_PLAN_MAX` ids) one sort and one kernel build the plan;
    elsewhere a few torch operations do.
    """
    shapes = tuple(tuple(p.shape) for p in parts)
    flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
    n = flat.numel()
    if n == 0:
        return plan_rows(parts, "merge")
    sorted_ids, order = torch.sort(flat, stable=True)
    if flat.is_cuda and n <= KERNEL_PLAN_MAX:
        from ..transfer._kernels import launch_plan

        out = torch.empty(3 * n + 3, dtype=torch.int64, device=flat.device)
        launch_plan(sorted_ids, order, out)
        order_local, local, ids = out[:n], out[n : 2 * n], out[2 * n : 3 * n]
        count, lo_hi = out[3 * n : 3 * n + 1], out[3 * n + 1 :]
    else:
        # the local row of each sorted position: how many distinct ids come before it
        order_local = torch.zeros(n, dtype=torch.int64, device=flat.device)
        if n > 1:
            torch.cumsum(torch.ne(sorted_ids[1:], sorted_ids[:-1]), 0, out=order_local[1:])
        local = torch.empty_like(order_local).scatter_(0, order, order_local)
        ids = sorted_ids[-1:].expand(n).clone().scatter_(0, order_local, sorted_ids)
        count = order_local[-1:] + 1
        lo_hi = sorted_ids[:: max(n - 1, 1)] if n > 1 else sorted_ids.expand(2)
    if ends is not None:
        ends.copy_(lo_hi, non_blocking=True)
    return RowPlan(ids, local, shapes, True, count, order, order_local)


#: the one-kernel plan takes up to this many ids (one thread block walks them)
KERNEL_PLAN_MAX = 1 << 18


def same_rows(a: RowPlan, b: RowPlan) -> bool:
    """Whether two plans move the same rows in the same order (the same plan, or equal ids)."""
    return a is b or (a.ids.shape == b.ids.shape and bool(torch.equal(a.ids, b.ids)))


def rows_preview(plan: RowPlan | None, k: int = 6) -> str:
    """``plan``'s rows for an error message: their count and first ``k`` ids."""
    if plan is None:
        return "none"
    ids = exact_plan(plan).ids
    head = ", ".join(str(int(v)) for v in ids[:k].tolist())
    more = ", ..." if ids.numel() > k else ""
    return f"{ids.numel()} rows: ids [{head}{more}]"


def exact_plan(plan: RowPlan) -> RowPlan:
    """``plan`` without padding rows: a plan sized on the GPU has its count read back (one
    synchronisation) and its ids cut to the distinct ones; other plans come back as they are."""
    if plan.n_distinct is None:
        return plan
    k = int(plan.n_distinct.item())
    return RowPlan(plan.ids[:k], plan.local, plan.shapes, True)


#: tables of up to this many rows take the int32 sort in :func:`plan_rows`
_INT32_ROWS = 2**31 - 1


class _Ends(threading.local):
    buf: torch.Tensor | None = None


_ends = _Ends()


def _ends_buffer() -> torch.Tensor:
    """A per-thread pinned pair for an id range read back without its own synchronisation."""
    if _ends.buf is None:
        # (kept in a forked child, which frees other threads' locals: see _fork)
        _ends.buf = keep_in_forked_child(pinned_empty(2, torch.int64))
    return _ends.buf


def split_local(plan: RowPlan) -> tuple[torch.Tensor, ...]:
    """The local ids of each input tensor, in that tensor's shape."""
    out = []
    start = 0
    for shape in plan.shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(plan.local[start : start + n].view(shape))
        start += n
    return tuple(out)


def _fingerprint(x: Any) -> Any:
    """What must be unchanged for a cached plan of ``x`` to stay valid (None: never cache).

    A CUDA tensor is identified by itself and its in-place version counter; a CPU tensor
    or NumPy array also by a copy of its values, because a buffer refilled through NumPy
    (``torch.from_numpy(buf)``, then ``buf[:] = ...``) changes without moving torch's
    version counter, and an in-place update of a reused id buffer must never reuse the
    old plan. An inference tensor (made under ``torch.inference_mode``) has no version
    counter, so its plans are never cached.
    """
    if x is None:
        return ()
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu":
            try:
                return x.detach().numpy().copy()
            except (TypeError, RuntimeError):  # sparse, bfloat16...: never cached
                return None
        if x.is_inference():  # no version counter: it may change in place unseen
            return None
        return (x._version, x.data_ptr(), tuple(x.shape))
    if isinstance(x, np.ndarray):
        return x.copy()
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
        )
    return bool(a == b)


class PlanCache:
    """The plan of the last (pos, neg) id objects, reused while they are unchanged.

    A step asks for the same ids up to four times (model and optimizer switchers,
    before and after the step); the cache avoids recomputing the plan (a sort and a
    synchronisation) each time, and is invalidated when the id objects change or are
    modified in place. :meth:`ModelSwitch.beforeForwardPass` starts every step with a
    fresh plan, so a CUDA id buffer refilled outside torch (e.g. through CuPy) between
    steps is seen too.
    """

    def __init__(self) -> None:
        self._entry: tuple[Any, Any, Any, Any, RowPlan] | None = None

    def get(self, pos: Any, neg: Any) -> RowPlan | None:
        e = self._entry
        if e is None or e[0] is not pos or e[1] is not neg:
            return None
        fp_pos, fp_neg = _fingerprint(pos), _fingerprint(neg)
        if fp_pos is None or fp_neg is None:
            return None
        if not (_same(e[2], fp_pos) and _same(e[3], fp_neg)):
            return None
        return e[4]

    def put(self, pos: Any, neg: Any, plan: RowPlan) -> None:
        fp_pos, fp_neg = _fingerprint(pos), _fingerprint(neg)
        if fp_pos is None or fp_neg is None:
            self._entry = None
            return
        self._entry = (pos, neg, fp_pos, fp_neg, plan)

    def clear(self) -> None:
        self._entry = None


def check_training_placement(placement: Any, what: str) -> None:
    """Refuse ``placement='file'`` for a table that trains (its rows and optimizer state
    live in memory), saying where file-backed tables come in (checkpoints)."""
    # (by name: resolving would warn of the CPU fallback before the caller's own checks)
    if isinstance(placement, str) and placement.lower() == "file":
        raise GadgetKeyError(
            f"{what} cannot use placement 'file': a trained table and its optimizer state "
            "live in memory (placements 'pinned', 'cpu', 'cuda'); save and restore them "
            "through files with save_checkpoint / load_checkpoint"
        )
