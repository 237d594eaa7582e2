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
from typing import Any

import torch

from .._device import cupy_available
from .._errors import GadgetKeyError, GadgetValueError
from .._ids import last_writer
from . import _kernels

__all__ = ["STRATEGIES", "gather", "scatter", "resolve_strategy", "set_hybrid_fraction"]

#: ``kernel``: CuPy row kernel, ids in the order given;
#: ``sorted``: sort ids on the GPU first (locality for large host tables), un-permute on write;
#: ``hybrid``: split the ids between the GPU kernel and CPU threads gathering into a pinned
#: staging buffer moved by the copy engine (pinned tables only);
#: ``torch``: ``index_select`` / ``index_copy_`` on the zero-copy view (no CuPy needed).
STRATEGIES: tuple[str, ...] = ("auto", "kernel", "sorted", "hybrid", "torch")

#: above this many bytes a random gather from host memory loses throughput to the GPU's
#: address translation unless the ids are sorted (PERF.md: falls off past ~2 GB)
SORT_ABOVE_BYTES = 1 << 31

#: above this many table bytes per requested id (ids sparser than one per this many bytes)
#: the GPU's address translation limits even a sorted gather, and CPU threads take a share
HYBRID_GAP_BYTES = 48 << 10

#: share of the rows the CPU moves in the ``hybrid`` strategy (the H200 sweep balanced at ~0.6)
_hybrid = {"fraction": 0.6}


def set_hybrid_fraction(fraction: float) -> None:
    """Set the share of rows that CPU threads move in the ``hybrid`` strategy (0..1)."""
    if not 0.0 <= fraction <= 1.0:
        raise GadgetValueError(f"hybrid fraction must be in [0, 1]; got {fraction}")
    _hybrid["fraction"] = float(fraction)


def resolve_strategy(
    strategy: str,
    table: torch.Tensor,
    n_ids: int,
    host: torch.Tensor | None = None,
    *,
    kind: str = "gather",
) -> str:
    """Turn ``auto`` into a concrete strategy for one call; validate names.

    ``auto`` (measured on an H200, see DESIGN.md): tables up to 2 GB or requests of
    up to 1024 ids -> ``kernel``; larger tables -> ``sorted`` while the ids are dense
    enough (at most :data:`HYBRID_GAP_BYTES` of table per id), else ``hybrid`` where
    the table has a host view. Scatters always sort (that is how repeats are
    merged), so ``auto`` scatters with ``kernel``.
    """
    if strategy not in STRATEGIES:
        raise GadgetKeyError(f"Unknown strategy {strategy!r}; expected one of {list(STRATEGIES)}")
    if not cupy_available() and strategy != "torch":
        return "torch"
    if strategy == "hybrid" and host is None:
        return "sorted"
    if strategy != "auto":
        return strategy
    nbytes = table.numel() * table.element_size()
    if kind == "scatter" or nbytes <= SORT_ABOVE_BYTES or n_ids <= 1024:
        return "kernel"
    if host is None or nbytes / n_ids <= HYBRID_GAP_BYTES:
        return "sorted"
    return "hybrid"


class _Staging(threading.local):
    """Per-thread reusable pinned staging buffer, side stream and completion event."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.stream: Any = None
        self.done: Any = None

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()  # the previous copy out of (or into) the buffer finished
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        return self.buf


_staging = _Staging()


def _stage_view(buf: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    row = tuple(like.shape[1:])
    nbytes = n * math.prod(row) * like.element_size()
    return buf[:nbytes].view(like.dtype).view(n, *row)


def gather(
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
    strategy: str = "auto",
    host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``table[ids]`` as a new (or the given ``out``) contiguous CUDA tensor.

    ``ids`` must be checked int64 ids (see :func:`gadgetloader._ids.as_ids`), on the
    table's device (or the CPU for ``hybrid``); its shape becomes the leading shape of
    the result. ``host`` is the CPU view of the same table where one exists.
    """
    row_shape = tuple(table.shape[1:])
    flat = ids.reshape(-1)
    n = flat.numel()
    device = table.device
    if out is None:
        out = torch.empty((n, *row_shape), dtype=table.dtype, device=device)
    elif (
        tuple(out.shape) not in ((*ids.shape, *row_shape), (n, *row_shape))
        or not out.is_contiguous()
    ):
        raise GadgetValueError(
            f"out must be a contiguous tensor of shape {(*ids.shape, *row_shape)}; got {tuple(out.shape)}"
        )
    flat_out = out.view(n, *row_shape)
    if n == 0 or math.prod(row_shape) == 0:
        return out.view(tuple(ids.shape) + row_shape)
    how = resolve_strategy(strategy, table, n, host)
    if how == "hybrid":
        assert host is not None
        _hybrid_gather(table, host, flat, flat_out)
    else:
        flat = flat.to(device)
        if how == "torch":
            torch.index_select(table, 0, flat, out=flat_out)
        elif how == "sorted":
            sorted_ids, pos = torch.sort(flat)
            _kernels.launch_gather(table, sorted_ids, flat_out, pos)
        else:
            _kernels.launch_gather(table, flat, flat_out)
    return out.view(tuple(ids.shape) + row_shape)


def _hybrid_gather(
    table: torch.Tensor, host: torch.Tensor, flat: torch.Tensor, out: torch.Tensor
) -> None:
    n = flat.numel()
    k = int(n * _hybrid["fraction"])
    device = table.device
    before = torch.cuda.current_stream(device).record_event()  # writes queued so far
    gpu_ids = flat[k:].to(device, non_blocking=True)
    if gpu_ids.numel():
        sorted_ids, pos = torch.sort(gpu_ids)
        _kernels.launch_gather(table, sorted_ids, out[k:], pos)
    if k == 0:
        return
    cpu_ids = flat[:k].cpu()
    nbytes = k * math.prod(table.shape[1:]) * table.element_size()
    buf = _staging.get(nbytes, device)
    stage = _stage_view(buf, k, table)
    before.synchronize()  # the CPU must not read rows a queued kernel is still writing
    torch.index_select(host, 0, cpu_ids, out=stage)  # CPU threads, while the GPU kernel runs
    current = torch.cuda.current_stream(device)
    side = _staging.stream
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out[:k].copy_(stage, non_blocking=True)
        done = side.record_event()
    current.wait_event(done)
    out.record_stream(side)
    _staging.done = done


def scatter(
    table: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    strategy: str = "auto",
    host: torch.Tensor | None = None,
) -> None:
    """``table[ids] = rows`` in place; for a repeated id the *last* occurrence wins.

    ``rows`` is a CUDA tensor of shape ``ids.shape + row shape`` and the table's dtype.
    The ids are sorted on the GPU and repeats are masked out, so the result is
    deterministic and the writes walk the table in address order.
    """
    flat = ids.reshape(-1).to(table.device)
    n = flat.numel()
    if n == 0 or math.prod(table.shape[1:]) == 0:
        return
    src = rows.reshape(n, *table.shape[1:])
    if not src.is_contiguous():
        src = src.contiguous()
    how = resolve_strategy(strategy, table, n, host, kind="scatter")
    plan = last_writer(flat)
    if how == "torch":
        sel = plan.keep.nonzero().squeeze(1)
        table.index_copy_(0, plan.ids[sel], src[plan.pos[sel]])
    elif how == "hybrid":
        assert host is not None
        _hybrid_scatter(table, host, plan.ids, plan.pos, plan.keep, src)
    else:
        _kernels.launch_scatter(table, plan.ids, src, plan.pos, plan.keep)


def _hybrid_scatter(
    table: torch.Tensor,
    host: torch.Tensor,
    ids: torch.Tensor,
    pos: torch.Tensor,
    keep: torch.Tensor,
    src: torch.Tensor,
) -> None:
    n = ids.numel()
    k = int(n * _hybrid["fraction"])
    device = table.device
    if k < n:
        _kernels.launch_scatter(table, ids[k:], src, pos[k:], keep[k:])
    if k == 0:
        return
    sel = keep[:k].nonzero().squeeze(1)
    cpu_rows_dev = src[pos[:k][sel]]  # the CPU's share, packed on the GPU
    cpu_ids = ids[:k][sel].cpu()
    m = cpu_ids.numel()
    buf = _staging.get(m * math.prod(table.shape[1:]) * table.element_size(), device)
    stage = _stage_view(buf, m, table)
    stage.copy_(cpu_rows_dev, non_blocking=True)
    ev = torch.cuda.current_stream(device).record_event()
    ev.synchronize()
    host.index_copy_(0, cpu_ids, stage)  # CPU threads; the GPU kernel writes its share meanwhile
