"""Stores in ordinary memory: ``cpu`` (host RAM) and ``cuda`` (GPU memory)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._errors import allocation_error, check_fits_in_host
from ._base import Store, _cuda_usable

__all__ = ["CpuStore", "CudaStore", "rows_by_value"]


class CpuStore(Store):
    """A table in ordinary (pageable) host RAM; rows move through CPU indexing.

    This is also where ``cuda`` and ``pinned`` requests land on a machine
    without CUDA, so the whole API runs (with the same results) everywhere.
    """

    placement = "cpu"

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__(shape, dtype)
        hint = "a file-backed table (DataGadget(path, placement='file')) keeps one larger than RAM"
        check_fits_in_host(self.shape, dtype, "host RAM", hint)
        try:
            self._t: torch.Tensor | None = torch.zeros(self.shape, dtype=dtype, device="cpu")
        except (RuntimeError, MemoryError) as exc:
            err = allocation_error(exc, self.shape, dtype, "host RAM", hint)
            if err is None:
                raise
            raise err from exc

    def host_view(self) -> torch.Tensor | None:
        return self._t

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle (or deep-copy) by value: see :func:`rows_by_value`."""
        if self._t is None:  # closed: a closed copy
            return (_closed_cpu_store, (self.shape, self.dtype))
        return rows_by_value(self._t)

    def _release(self) -> None:
        self._t = None


def rows_by_value(rows: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """How a ``cpu`` store of ``rows`` pickles: its rows as NumPy bytes, so every pickler
    copies them. A torch tensor would go to a DataLoader's *spawned* workers (or through
    any ``multiprocessing`` queue) through torch's shared memory: its rows moved there in
    place -- a NumPy view taken of the table before (``getNumpyVersion(copy=False)``) left
    pointing at freed memory -- and shared with the worker, whose writes would reach the
    parent's table. The copy is an independent table, as the docs promise."""
    flat = rows.detach().contiguous().reshape(-1).view(torch.uint8)
    return (_cpu_store_of_bytes, (flat.numpy(), tuple(rows.shape), rows.dtype))


def cpu_store_of(rows: torch.Tensor) -> CpuStore:
    """A ``cpu`` store holding ``rows`` (no copy)."""
    store = CpuStore.__new__(CpuStore)
    Store.__init__(store, tuple(rows.shape), rows.dtype)
    store._t = rows
    return store


def _cpu_store_of_bytes(data: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> CpuStore:
    if not data.flags.writeable:  # unpickled from bytes: read-only, so the store's own copy
        data = data.copy()
    return cpu_store_of(torch.from_numpy(data).view(dtype).reshape(shape))


def _closed_cpu_store(shape: tuple[int, ...], dtype: torch.dtype) -> CpuStore:
    store = CpuStore.__new__(CpuStore)
    Store.__init__(store, shape, dtype)
    store._t = None
    store._closed = True
    return store


class CudaStore(Store):
    """A table in GPU memory (allocated through torch's caching allocator)."""

    placement = "cuda"

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__(shape, dtype)
        dev = device if device is not None and device.type == "cuda" else torch.device("cuda")
        try:
            self._t: torch.Tensor | None = torch.zeros(self.shape, dtype=dtype, device=dev)
        except (RuntimeError, MemoryError) as exc:  # (torch.OutOfMemoryError is a RuntimeError)
            err = allocation_error(
                exc,
                self.shape,
                dtype,
                f"the memory of {dev}",
                "placement='pinned' keeps a table larger than the GPU's memory in host RAM",
            )
            if err is None:
                raise
            raise err from exc

    def device_view(self) -> torch.Tensor | None:
        return self._t

    def _release(self) -> None:
        t, self._t = self._t, None
        if t is not None and t.is_cuda and _cuda_usable():
            # kernels queued on any stream may still use the memory; the caching allocator
            # would hand it out again once freed
            torch.cuda.synchronize(t.device)
