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

Registering is mostly page faulting, so the pages are first prefaulted on several
threads (:func:`populate`), then registered with one call (CUDA copies may not span
two registrations). A store about to be filled from a file (made with a
:class:`~gadgetloader.io.SourceShape`, as ``DataGadget(path, placement='pinned')``
does) does both on a background thread while the rows are read; its CUDA view,
and so every GPU use, waits for that (:meth:`PinnedStore.wait_ready`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .._device import get_cupy
from .._dtypes import numpy_dtype
from .._errors import GadgetMemoryError, GadgetValueError, as_choice, check_fits_in_host
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
    as_choice(pages, "pages", PAGE_KINDS, error=GadgetValueError)
    if pages == "hugetlb":
        huge = 2 << 20
        size = -(-nbytes // huge) * huge
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB
        try:
            return mmap.mmap(-1, size, flags=flags)
        except OSError as exc:
            raise GadgetMemoryError(
                f"could not map {size} bytes of 2 MiB huge pages ({exc}); reserve them first, "
                f"e.g. sysctl vm.nr_hugepages={size // huge}, or use pages='default'"
            ) from exc
    try:
        mm = mmap.mmap(-1, nbytes)
    except OSError as exc:  # ENOMEM: the address space or the overcommit limit
        raise GadgetMemoryError(
            f"could not map {nbytes:,} bytes of host RAM for a pinned table ({exc}); "
            "free memory, or use a file-backed table (DataGadget(path, placement='file'))"
        ) from exc
    if pages == "thp" and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)  # before the pages are touched (registration faults them in)
    return mm


#: Linux's MADV_POPULATE_WRITE (5.14+): fault pages in writable without touching their bytes
_MADV_POPULATE_WRITE = 23
#: bytes per prefault call (each holds the process's memory-map lock only that long)
_POPULATE_SLICE = 64 << 20
_LIBC: list[Any] = []


def _madvise() -> Any:
    if not _LIBC:
        fn = None
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        _LIBC.append(fn)
    return _LIBC[0]


def populate(ptr: int, nbytes: int, threads: int | None = None) -> bool:
    """Fault in the pages of ``[ptr, ptr + nbytes)`` (page-aligned) on several threads, keeping
    their contents. Returns False where the kernel cannot (before Linux 5.14).

    Why: ``cudaHostRegister`` of untouched memory spends most of its time faulting and
    zeroing pages one by one (~2.4 s for 4 GB on the H200 host, ~0.2 s once the pages are
    present), all of it holding the process's memory-map lock -- which stalls every
    other thread's ``mmap`` / ``munmap`` (and the page faults queued behind them) for
    that long. Prefaulting in 64 MiB slices on several threads is faster and holds the
    lock only per slice. ctypes releases the GIL for each call.
    """
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return False
    starts = range(0, nbytes, _POPULATE_SLICE)

    def one(off: int) -> bool:
        return madvise(ptr + off, min(_POPULATE_SLICE, nbytes - off), _MADV_POPULATE_WRITE) == 0

    if not one(0):  # unsupported here (EINVAL), or no memory: registration will say so
        return False
    rest = starts[1:]
    n = max(1, min(threads or 8, os.cpu_count() or 1, len(rest)))
    if n == 1:
        for off in rest:
            one(off)
    else:
        with ThreadPoolExecutor(n, thread_name_prefix="gadgetloader-populate") as ex:
            list(ex.map(one, rest))
    return True


class HostBuffer:
    """``nbytes`` of page-locked, GPU-mapped host memory.

    Attributes
    ----------
    array : numpy.ndarray
        uint8 view of the bytes.
    device_ptr : int
        The address GPU kernels use for the first byte.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        register: bool = True,
        pages: str = "default",
        background: bool = False,
    ) -> None:
        self.nbytes = int(nbytes)
        self.pages = pages
        self._finalizer: weakref.finalize | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        if pages == "cudahost" and register and self.nbytes:
            self._init_cuda_host_alloc()
            return
        self._mm: mmap.mmap | None = _map_anonymous(max(self.nbytes, 1), pages)
        self.array = np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes)
        self.host_ptr = int(self.array.ctypes.data) if self.nbytes else 0
        self.device_ptr = self.host_ptr
        if register and self.nbytes:
            cp = get_cupy("the pinned placement")
            device = int(cp.cuda.runtime.getDevice())
            if background:
                self._thread = threading.Thread(
                    target=self._register_in_background,
                    args=(cp, device),
                    name="gadgetloader-pin",
                    daemon=True,
                )
                self._thread.start()
            else:
                self._register(cp)

    def _register(self, cp: Any) -> None:
        """Page-lock and map the whole buffer with one ``cudaHostRegister`` (one
        registration: CUDA copies may not span two), after prefaulting its pages."""
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        if self.pages != "hugetlb":
            populate(self.host_ptr, self.nbytes)
        try:
            cp.cuda.runtime.hostRegister(self.host_ptr, self.nbytes, flags)
        except Exception as exc:
            raise GadgetMemoryError(
                f"could not page-lock {self.nbytes} bytes of host RAM for a pinned table "
                f"({exc}); check `ulimit -l` and free memory, or use placement='cpu'"
            ) from exc
        fin = weakref.finalize(self, _unregister, self.host_ptr)
        fin.atexit = False  # the OS reclaims it; CUDA may be gone at exit
        self._finalizer = fin
        self.device_ptr = _device_pointer(cp, self.host_ptr)

    def _register_in_background(self, cp: Any, device: int) -> None:
        # runs while the caller reads rows into ``array``; writes meanwhile are safe:
        # neither prefaulting nor pinning changes the pages' contents
        try:
            cp.cuda.runtime.setDevice(device)
            self._register(cp)
        except BaseException as exc:  # raised by wait(), in the caller's thread
            self._error = exc

    @property
    def pending(self) -> bool:
        """Whether a background registration has not been waited for yet."""
        return self._thread is not None

    def wait(self) -> None:
        """Wait for a background registration; raise its error (MemoryError) if it failed."""
        with self._lock:
            th = self._thread
            if th is not None:
                th.join()
                self._thread = None
            if self._error is not None:  # every later wait raises it too
                raise self._error

    def _init_cuda_host_alloc(self) -> None:
        """Let the CUDA driver allocate the pinned memory (``cudaHostAlloc``)."""
        cp = get_cupy("the pinned placement")
        ptr = int(
            cp.cuda.runtime.hostAlloc(
                self.nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
            )
        )
        self._mm = None
        # the memory is freed when the last NumPy / torch view of it is gone (every view's
        # base is ``mem``), not with this object: a host view handed out outlives the store
        mem = _HostMemory(ptr, self.nbytes)
        self.array = np.asarray(mem)
        self.host_ptr = ptr
        self.device_ptr = _device_pointer(cp, ptr)
        fin = weakref.finalize(mem, _free_host, ptr)
        fin.atexit = False
        self._finalizer = fin


class _HostMemory:
    """Exposes ``nbytes`` at ``ptr`` to NumPy as uint8; NumPy views keep it alive."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


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


def _host_view(buf: HostBuffer, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    npd = np.dtype(np.int16) if dtype == torch.bfloat16 else numpy_dtype(dtype)
    host = torch.from_numpy(buf.array.view(npd).reshape(shape))
    if dtype == torch.bfloat16:
        host = host.view(torch.bfloat16)
    return host


def _device_view(
    buf: HostBuffer, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    npd = np.dtype(np.int16) if dtype == torch.bfloat16 else numpy_dtype(dtype)
    typestr = npd.str if npd != np.dtype(np.bool_) else "|b1"
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.cuda.device(device):
        dev = torch.as_tensor(_CudaArray(buf.device_ptr, shape, typestr, buf), device=device)
    if dtype == torch.bfloat16:
        dev = dev.view(torch.bfloat16)
    if dev.data_ptr() != buf.device_ptr:
        raise GadgetValueError("torch copied the mapped host buffer instead of viewing it")
    return dev


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
        # page-locked memory cannot be swapped out: a table larger than RAM never pins
        check_fits_in_host(
            self.shape,
            dtype,
            "page-locked host RAM",
            "a file-backed table (DataGadget(path, placement='file')) keeps one larger than RAM",
            swap=False,
        )
        dev = (
            device
            if device is not None and device.type == "cuda"
            else torch.device("cuda", torch.cuda.current_device())
        )
        # a store about to be filled from a file (its shape came from the file's source)
        # page-locks its memory while the rows are read; see io.load_into
        background = bool(getattr(shape, "filled_from_host", False)) and pages != "cudahost"
        self._device = dev
        self._buf: HostBuffer | None = HostBuffer(self.nbytes, pages=pages, background=background)
        self._host: torch.Tensor | None = _host_view(self._buf, self.shape, dtype)
        self._dev: torch.Tensor | None = None
        if not background:
            self._finish()

    def _finish(self) -> None:
        """Wait for the buffer's registration and make the CUDA view (once)."""
        buf = self._buf
        if self._dev is not None or buf is None:
            return
        try:
            buf.wait()
        except BaseException:
            self._host = None
            self._buf = None
            self._closed = True
            raise
        self._dev = _device_view(buf, self.shape, self._dtype, self._device)

    def wait_ready(self) -> None:
        """Wait until GPU kernels may use the table (its page-locking has finished).

        Raises
        ------
        MemoryError
            The memory could not be page-locked (the store is closed).
        """
        self._finish()

    def host_view(self) -> torch.Tensor | None:
        return self._host

    def device_view(self) -> torch.Tensor | None:
        if self._dev is None and self._buf is not None:
            self._finish()
        return self._dev

    def gpu_view_in_use(self) -> torch.Tensor | None:
        return self._dev

    @property
    def host_bytes(self) -> int:
        """Bytes of host RAM this store holds (table bytes plus page rounding)."""
        page = mmap.PAGESIZE
        return -(-max(self.nbytes, 1) // page) * page

    def _release(self) -> None:
        buf = self._buf
        if buf is not None and buf.pending:
            with contextlib.suppress(MemoryError):  # never map/unmap under a running pin
                buf.wait()
        if self._dev is not None and self._dev.is_cuda:
            torch.cuda.synchronize(self._dev.device)
        self._host = None
        self._dev = None
        self._buf = None
