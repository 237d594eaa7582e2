"""Stores in ordinary memory: ``cpu`` (host RAM) and ``cuda`` (GPU memory)."""

from __future__ import annotations

import torch

from ._base import Store, _cuda_usable

__all__ = ["CpuStore", "CudaStore"]


class CpuStore(Store):
    """A table in ordinary (pageable) host RAM; rows move through CPU indexing.

    This is also where ``cuda`` and ``pinned`` requests land on a machine
    without CUDA, so the whole API runs (with the same results) everywhere.
    """

    placement = "cpu"

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__(shape, dtype)
        self._t: torch.Tensor | None = torch.zeros(self.shape, dtype=dtype, device="cpu")

    def host_view(self) -> torch.Tensor | None:
        return self._t

    def _release(self) -> None:
        self._t = None


class CudaStore(Store):
    """A table in GPU memory (allocated through torch's caching allocator)."""

    placement = "cuda"

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        super().__init__(shape, dtype)
        dev = device if device is not None and device.type == "cuda" else torch.device("cuda")
        self._t: torch.Tensor | None = torch.zeros(self.shape, dtype=dtype, device=dev)

    def device_view(self) -> torch.Tensor | None:
        return self._t

    def _release(self) -> None:
        t, self._t = self._t, None
        if t is not None and t.is_cuda and _cuda_usable():
            # kernels queued on any stream may still use the memory; the caching allocator
            # would hand it out again once freed
            torch.cuda.synchronize(t.device)
