"""The ``pinned`` placement: page-locked host RAM mapped into the GPU's address space.

The table's bytes are one anonymous ``mmap`` of exactly the table's size (rounded
up to a page), registered with ``cudaHostRegister(Portable | Mapped)`` through
CuPy. That gives

* a CPU view (NumPy / torch) for file I/O and CPU work, and
* a CUDA view (a torch CUDA tensor over the same bytes) that GPU kernels read
  and write in place over PCIe: no CPU indexing, no staging copy.

Host RAM used is the table's bytes plus at most one page -- no allocator
rounding (torch's pinned allocator rounds to powers of two) and no pool; neither
CuPy's nor torch's global allocator is touched. The registration is undone when
the store is closed or garbage-collected (after any views handed out are gone),
never at interpreter exit.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import Any

import numpy as np
import torch

from .._device import get_cupy
from .._dtypes import numpy_dtype
from .._errors import GadgetValueError
from ._base import Store

__all__ = ["PinnedStore", "HostBuffer"]

_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_MAPPED = 0x02


def _unregister(ptr: int) -> None:
    cp = get_cupy("pinned memory")
    try:
        cp.cuda.runtime.deviceSynchronize()  # no kernel may still be reading it
        cp.cuda.runtime.hostUnregister(ptr)
    except Exception:  # pragma: no cover - the context is already gone
        pass


def _device_pointer(cp: Any, host_ptr: int) -> int:
    """The GPU-side address of registered host memory (equal to ``host_ptr`` under UVA)."""
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(host_ptr)
        ptr = int(attrs.devicePointer)
    except Exception:  # very old CuPy: UVA makes the addresses identical
        return host_ptr
    return ptr or host_ptr


#: Linux's MAP_HUGETLB (2 MiB pages from the reserved pool, ``vm.nr_hugepages``)
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
#: host page choices for a pinned table
PAGE_KINDS = ("default", "thp", "hugetlb", "cudahost")


def _map_anonymous(nbytes: int, pages: str) -> mmap.mmap:
    if pages not in PAGE_KINDS:
        raise GadgetValueError(f"Unknown pages {pages!r}; expected one of {list(PAGE_KINDS)}")
    if pages == "hugetlb":
        huge = 2 << 20
        size = -(-nbytes // huge) * huge
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB
        try:
            return mmap.mmap(-1, size, flags=flags)
        except OSError as exc:
            raise MemoryError(
                f"could not map {size} bytes of 2 MiB huge pages ({exc}); reserve them first, "
                f"e.g. sysctl vm.nr_hugepages={size // huge}, or use pages='default'"
            ) from exc
    mm = mmap.mmap(-1, nbytes)
    if pages == "thp" and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)  # before the pages are touched (registration faults them in)
    return mm


class HostBuffer:
    """``nbytes`` of page-locked, GPU-mapped host memory.

    Attributes
    ----------
    array : numpy.ndarray
        uint8 view of the bytes.
    device_ptr : int
        The address GPU kernels use for the first byte.
    """

    def __init__(self, nbytes: int, *, register: bool = True, pages: str = "default") -> None:
        self.nbytes = int(nbytes)
        self.pages = pages
        self._finalizer: weakref.finalize | None = None
        if pages == "cudahost" and register and self.nbytes:
            self._init_cuda_host_alloc()
            return
        self._mm: mmap.mmap | None = _map_anonymous(max(self.nbytes, 1), pages)
        self.array = np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes)
        self.host_ptr = int(self.array.ctypes.data) if self.nbytes else 0
        self.device_ptr = self.host_ptr
        if register and self.nbytes:
            cp = get_cupy("the pinned placement")
            flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
            try:
                cp.cuda.runtime.hostRegister(self.host_ptr, self.nbytes, flags)
            except Exception as exc:
                raise MemoryError(
                    f"could not page-lock {self.nbytes} bytes of host RAM for a pinned table "
                    f"({exc}); check `ulimit -l` and free memory, or use placement='cpu'"
                ) from exc
            self.device_ptr = _device_pointer(cp, self.host_ptr)
            fin = weakref.finalize(self, _unregister, self.host_ptr)
            fin.atexit = False  # the OS reclaims it; CUDA may be gone at exit
            self._finalizer = fin

    def _init_cuda_host_alloc(self) -> None:
        """Let the CUDA driver allocate the pinned memory (``cudaHostAlloc``)."""
        cp = get_cupy("the pinned placement")
        ptr = int(
            cp.cuda.runtime.hostAlloc(
                self.nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
            )
        )
        self._mm = None
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(ptr))
        self.host_ptr = ptr
        self.device_ptr = _device_pointer(cp, ptr)
        fin = weakref.finalize(self, _free_host, ptr)
        fin.atexit = False
        self._finalizer = fin


def _free_host(ptr: int) -> None:
    cp = get_cupy("pinned memory")
    try:
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.runtime.freeHost(ptr)
    except Exception:  # pragma: no cover
        pass


class _CudaArray:
    """Exposes a device pointer through ``__cuda_array_interface__`` and keeps its owner alive."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        self._owner = owner


def _torch_views(
    buf: HostBuffer, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    npd = np.dtype(np.int16) if dtype == torch.bfloat16 else numpy_dtype(dtype)
    host = torch.from_numpy(buf.array.view(npd).reshape(shape))
    if dtype == torch.bfloat16:
        host = host.view(torch.bfloat16)
    typestr = npd.str if npd != np.dtype(np.bool_) else "|b1"
    if buf.nbytes == 0:
        dev = torch.empty(shape, dtype=dtype, device=device)
        return host, dev
    with torch.cuda.device(device):
        dev = torch.as_tensor(_CudaArray(buf.device_ptr, shape, typestr, buf), device=device)
    if dtype == torch.bfloat16:
        dev = dev.view(torch.bfloat16)
    if dev.data_ptr() != buf.device_ptr:
        raise GadgetValueError("torch copied the mapped host buffer instead of viewing it")
    return host, dev


class PinnedStore(Store):
    """A table in page-locked host RAM that GPU kernels gather from and scatter to in place.

    Notes
    -----
    Gather/scatter run as GPU kernels reading/writing host memory over PCIe, so
    they reach the link's bandwidth without any CPU indexing (see DESIGN.md for
    the measured figures). Host RAM used is the table's size plus less than one
    page.
    """

    placement = "pinned"

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | None = None,
        *,
        pages: str = "default",
    ) -> None:
        super().__init__(shape, dtype)
        dev = (
            device
            if device is not None and device.type == "cuda"
            else torch.device("cuda", torch.cuda.current_device())
        )
        self._buf: HostBuffer | None = HostBuffer(self.nbytes, pages=pages)
        self._host, self._dev = _torch_views(self._buf, self.shape, dtype, dev)

    def host_view(self) -> torch.Tensor | None:
        return self._host

    def device_view(self) -> torch.Tensor | None:
        return self._dev

    @property
    def host_bytes(self) -> int:
        """Bytes of host RAM this store holds (table bytes plus page rounding)."""
        page = mmap.PAGESIZE
        return -(-max(self.nbytes, 1) // page) * page

    def _release(self) -> None:
        if self._dev is not None and self._dev.is_cuda:
            torch.cuda.synchronize(self._dev.device)
        self._host = None  # type: ignore[assignment]
        self._dev = None  # type: ignore[assignment]
        self._buf = None
