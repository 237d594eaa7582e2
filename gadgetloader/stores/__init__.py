"""Where tables live. One module per placement, all behind :class:`Store`."""

from __future__ import annotations

from typing import Any

import torch

from .._device import resolve_placement
from .._errors import GadgetKeyError
from ._base import Store
from ._file import FileStore, file_store
from ._interleaved import SlotStore, interleave
from ._memory import CpuStore, CudaStore
from ._pinned import HostBuffer, PinnedStore

__all__ = [
    "CpuStore",
    "CudaStore",
    "FileStore",
    "HostBuffer",
    "PinnedStore",
    "SlotStore",
    "Store",
    "empty_store",
    "file_store",
    "interleaved_stores",
]

_IN_MEMORY: dict[str, Any] = {"cpu": CpuStore, "cuda": CudaStore, "pinned": PinnedStore}


def empty_store(
    placement: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> Store:
    """A zero-filled in-memory store (``cpu``, ``cuda`` or ``pinned``; CPU fallback applies)."""
    where = resolve_placement(placement)
    if where not in _IN_MEMORY:
        raise GadgetKeyError(
            f"placement {where!r} is backed by a file; open it from a path instead "
            f"(in-memory placements: {sorted(_IN_MEMORY)})"
        )
    cls = _IN_MEMORY[where]
    if cls is CpuStore:
        return CpuStore(shape, dtype)
    return cls(shape, dtype, device)


def interleaved_stores(
    placement: str,
    num_rows: int,
    row_shape: tuple[int, ...],
    dtype: torch.dtype,
    slots: int,
    device: torch.device | None = None,
) -> list[SlotStore]:
    """``slots`` zero-filled tables of ``num_rows`` rows whose row ``i`` lie side by side
    in one buffer of ``placement`` (``pinned`` or ``cpu``); see :class:`SlotStore`."""
    parent = empty_store(placement, (int(num_rows), int(slots), *row_shape), dtype, device)
    return interleave(parent)
