"""Where tables live. One module per placement, all behind :class:`Store`."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._device import resolve_placement
from .._dtypes import dtype_name
from .._errors import GadgetKeyError, GadgetValueError
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
#: the most bytes one torch storage can describe
_MAX_BYTES = 2**63 - 1


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
    if any(int(s) > _MAX_BYTES for s in shape):
        raise GadgetValueError(
            f"a table of shape {tuple(shape)}: no axis can be longer than 2**63-1"
        )
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes > _MAX_BYTES:
        raise GadgetValueError(
            f"a {dtype_name(dtype)} table of shape {tuple(shape)} needs {nbytes:,} bytes, more "
            f"than any {where} allocation can hold ({_MAX_BYTES:,})"
        )
    # a table is storage of its own, never an inference tensor: one made under
    # torch.inference_mode() must stay writable once that block ends
    with torch.inference_mode(False):
        if cls is CpuStore:
            return CpuStore(shape, dtype)
        return cls(shape, dtype, device)


def standalone_copy(store: Store) -> Store:
    """A store of its own (same placement, shape and dtype) holding ``store``'s rows: takes a
    table out of a shared interleaved buffer (:class:`SlotStore`), copied in bounded blocks."""
    store.synchronize()
    new = empty_store(store.placement, store.shape, store.dtype, store.cuda_device)
    try:
        src, dst = store.host_view(), new.host_view()
        if src is None or dst is None:
            raise GadgetValueError(f"a {store.placement} store has no host view to copy")
        step = max(1, (256 << 20) // max(1, store.row_nbytes))
        for start in range(0, store.num_rows, step):  # torch's threads copy each block
            dst[start : start + step].copy_(src[start : start + step])
    except BaseException:
        new.close()
        raise
    return new


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
