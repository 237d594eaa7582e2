"""Gather and scatter between a CUDA-addressable table and dense GPU tensors.

A *CUDA-addressable* table is a torch CUDA tensor whose memory the GPU can read
and write in place: GPU memory, or page-locked host memory mapped into the GPU's
address space (the ``pinned`` placement). Every strategy gives bit-identical
results; they differ only in speed. ``auto`` picks per call.
"""

from __future__ import annotations

import math

import torch

from .._device import cupy_available
from .._errors import GadgetKeyError
from .._ids import last_writer
from . import _kernels

__all__ = ["STRATEGIES", "gather", "scatter", "resolve_strategy"]

#: ``kernel``: CuPy row kernel, ids in the order given;
#: ``sorted``: sort ids on the GPU first (better locality for large host tables), un-permute on write;
#: ``torch``: ``index_select`` / ``index_copy_`` on the zero-copy view (no CuPy needed).
STRATEGIES: tuple[str, ...] = ("auto", "kernel", "sorted", "torch")

#: above this many bytes a random gather from host memory loses throughput to the GPU's
#: address translation unless the ids are sorted (PERF.md: falls off past ~2 GB)
SORT_ABOVE_BYTES = 1 << 31


def resolve_strategy(strategy: str, table: torch.Tensor, n_ids: int) -> str:
    """Turn ``auto`` into a concrete strategy for one call; validate names."""
    if strategy not in STRATEGIES:
        raise GadgetKeyError(f"Unknown strategy {strategy!r}; expected one of {list(STRATEGIES)}")
    if strategy != "auto":
        return strategy
    if not cupy_available():
        return "torch"
    nbytes = table.numel() * table.element_size()
    if nbytes > SORT_ABOVE_BYTES and n_ids > 1024:
        return "sorted"
    return "kernel"


def gather(
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
    strategy: str = "auto",
) -> torch.Tensor:
    """Rows ``table[ids]`` as a new (or the given ``out``) contiguous CUDA tensor.

    ``ids`` must be a checked int64 CUDA tensor (see :func:`gadgetloader._ids.as_ids`);
    its shape becomes the leading shape of the result.
    """
    row_shape = tuple(table.shape[1:])
    flat = ids.reshape(-1)
    if out is None:
        out = torch.empty((flat.numel(), *row_shape), dtype=table.dtype, device=ids.device)
    elif out.shape != (*ids.shape, *row_shape) or not out.is_contiguous():
        raise ValueError("out must be contiguous with shape ids.shape + row shape")
    if flat.numel() == 0 or math.prod(row_shape) == 0:
        return out.view(*ids.shape, *row_shape)
    how = resolve_strategy(strategy, table, flat.numel())
    if how == "torch":
        torch.index_select(table, 0, flat, out=out.view(flat.numel(), *row_shape))
    elif how == "sorted":
        sorted_ids, pos = torch.sort(flat)
        _kernels.launch_gather(table, sorted_ids, out, pos)
    else:
        _kernels.launch_gather(table, flat, out)
    return out.view(*ids.shape, *row_shape)


def scatter(
    table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, strategy: str = "auto"
) -> None:
    """``table[ids] = rows`` in place; for a repeated id the *last* occurrence wins.

    ``rows`` is a CUDA tensor of shape ``ids.shape + row shape`` and the table's dtype.
    The ids are sorted on the GPU and repeats are masked out, so the result is
    deterministic and the writes walk the table in address order.
    """
    flat = ids.reshape(-1)
    n = flat.numel()
    if n == 0 or math.prod(table.shape[1:]) == 0:
        return
    src = rows.reshape(n, *table.shape[1:])
    if not src.is_contiguous():
        src = src.contiguous()
    how = resolve_strategy(strategy, table, n)
    plan = last_writer(flat)
    if how == "torch":
        sel = plan.keep.nonzero().squeeze(1)
        table.index_copy_(0, plan.ids[sel], src[plan.pos[sel]])
    else:
        _kernels.launch_scatter(table, plan.ids, src, plan.pos, plan.keep)
