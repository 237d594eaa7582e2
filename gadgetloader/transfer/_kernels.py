"""CuPy kernels that move whole rows between a table and a dense buffer.

The table may live in GPU memory or in page-locked host memory mapped into the
GPU's address space: either way the kernel sees one pointer and reads or writes
rows in place (over PCIe for host memory), so no CPU indexing runs.

Design (see ``DESIGN.md``):

* Rows are moved as vectors of 16, 8, 4, 2 or 1 bytes: the widest that divides the
  row size and the alignment of every pointer. Consecutive threads read
  consecutive vectors of one row, so a warp issues whole 128-byte lines.
* Each thread keeps ``UNROLL`` independent loads in flight before it stores, so
  enough PCIe read requests are outstanding to cover the link's latency.
* Every row id is checked against the table's row count inside the kernel as a
  last line of defence: a kernel never reads or writes outside a table, even if a
  caller skipped the host-side check (which raises before any launch).
* ``pos`` lets a gather visit ids in sorted order while writing each row to its
  original output position. A scatter of stably sorted ids writes only the last
  entry of each run of equal ids (its last occurrence), tested in the kernel by
  comparing with the next id: no mask, no compaction, no GPU->CPU synchronisation.
* One launch moves the same ids for up to four tables of one row layout (a table
  and its optimizer states): ``blockIdx.y`` picks the table, so the switchers pay
  one launch per step and direction instead of one per table.
* A table may be a view of one slot of an *interleaved* table (rows of a table and its
  optimizer states side by side, ``pitch`` bytes apart). Consecutive slots of one such
  table move as one wide row per id: each host page is translated once for all of them.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np
import torch

from .._device import cupy_stream, get_cupy

__all__ = [
    "MAX_TABLES",
    "SCATTER_ALL",
    "SCATTER_LAST_OF_RUN",
    "launch_gather",
    "launch_scatter",
    "pitch_nbytes",
    "segments_of",
    "vector_width",
]

#: independent row vectors each thread loads before storing. The H200 sweep (DESIGN.md)
#: measured 1, 4 and 8 within noise of each other: the link, not the issue rate, limits.
UNROLL = 1
SCATTER_UNROLL = 4
BLOCK = 256

#: tables one launch moves at most (a table and up to three optimizer states)
MAX_TABLES = 4

#: scatter modes: write every id as given (distinct ids); ids sorted stably, only the
#: last entry of each run of equal ids writes (the last occurrence wins)
SCATTER_ALL, SCATTER_LAST_OF_RUN = 0, 1

_SOURCE = r"""
// Up to four tables of one row layout move in one launch. Two ways to spread them:
// * blockIdx.y picks the table (separate tables);
// * segs > 1: the tables are consecutive segments of one wider row (a table interleaved
//   with its optimizer states, see DESIGN.md), so a thread walks the whole wide row and
//   the segment it is in picks the dense buffer: one translation of each host page.
// pitch: the table's row stride in vectors (>= vpr * segs for an interleaved table).
struct GatherArgs {
    const void* table[4]; void* out[4];
    long long n_rows, vpr, pitch, segs; const long long* ids; const long long* pos; long long n;
};
struct ScatterArgs {
    void* table[4]; const void* rows[4];
    long long n_rows, vpr, pitch, segs; const long long* ids; const long long* pos;
    long long mode, n;
};

// q = k / d, r = k - q * d; with 32-bit arithmetic when everything fits (64-bit division
// is emulated and costs several times more instructions per vector moved)
__device__ __forceinline__ void divmod(long long k, long long d, bool small, long long& q,
                                       long long& r)
{
    if (small) {
        const unsigned int uq = (unsigned int)k / (unsigned int)d;
        q = uq;
        r = k - (long long)uq * d;
    } else {
        q = k / d;
        r = k - q * d;
    }
}

template <typename V>
__device__ __forceinline__ void gather_rows(const GatherArgs& a)
{
    const int y = blockIdx.y;
    const V* __restrict__ src = (const V*)a.table[y];
    const long long span = a.vpr * a.segs;
    const long long total = a.n * span;
    const long long stride = (long long)blockDim.x * gridDim.x;
    const bool small = total + stride * UNROLL < 4294967296LL;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += stride * UNROLL) {
        V v[UNROLL];
        V* dst[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long k = i + u * stride;
            dst[u] = nullptr;
            if (k < total) {
                long long j, cc, s = 0, c;
                divmod(k, span, small, j, cc);
                if (a.segs > 1) divmod(cc, a.vpr, small, s, c); else c = cc;
                const long long r = a.ids[j];
                dst[u] = (V*)a.out[y + s] + (a.pos ? a.pos[j] : j) * a.vpr + c;
                v[u] = (r >= 0 && r < a.n_rows) ? src[r * a.pitch + cc] : V();  // never read outside
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (dst[u]) *dst[u] = v[u];
        }
    }
}

template <typename V>
__device__ __forceinline__ void scatter_rows(const ScatterArgs& a)
{
    const int y = blockIdx.y;
    V* __restrict__ table = (V*)a.table[y];
    const long long span = a.vpr * a.segs;
    const long long total = a.n * span;
    const long long stride = (long long)blockDim.x * gridDim.x;
    const bool small = total + stride * UNROLL < 4294967296LL;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += stride * UNROLL) {
        V v[UNROLL];
        V* to[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long k = i + u * stride;
            to[u] = nullptr;
            if (k < total) {
                long long j, cc;
                divmod(k, span, small, j, cc);
                const long long r = a.ids[j];
                // mode 1: ids sorted stably; a repeat that a later entry overwrites is skipped
                const bool wins = a.mode == 0 || j + 1 == a.n || a.ids[j + 1] != r;
                if (wins && r >= 0 && r < a.n_rows) {  // never write outside
                    long long s = 0, c = cc;
                    if (a.segs > 1) divmod(cc, a.vpr, small, s, c);
                    v[u] = ((const V*)a.rows[y + s])[(a.pos ? a.pos[j] : j) * a.vpr + c];
                    to[u] = table + r * a.pitch + cc;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (to[u]) *to[u] = v[u];
        }
    }
}

// All arguments travel in one struct passed by value: one kernel parameter to marshal
// from Python (the launch's CPU cost bounds small transfers).
#define GL_DEFINE(SUFFIX, V)                                                         \
extern "C" __global__ void gl_gather_##SUFFIX(const GatherArgs a) { gather_rows<V>(a); } \
extern "C" __global__ void gl_scatter_##SUFFIX(const ScatterArgs a) { scatter_rows<V>(a); }

GL_DEFINE(16, uint4)
GL_DEFINE(8, uint2)
GL_DEFINE(4, unsigned int)
GL_DEFINE(2, unsigned short)
GL_DEFINE(1, unsigned char)
"""

_WIDTHS = (16, 8, 4, 2, 1)


def vector_width(row_nbytes: int, *pointers: int) -> int:
    """The widest vector (bytes) dividing the row size and every pointer's alignment."""
    for w in _WIDTHS:
        if row_nbytes % w == 0 and all(p % w == 0 for p in pointers):
            return w
    return 1


@functools.cache
def _module(device_index: int, unroll: int = UNROLL) -> Any:
    cp = get_cupy("GPU gather/scatter kernels")
    with cp.cuda.Device(device_index):
        mod = cp.RawModule(code=_SOURCE, options=("-std=c++14", f"-DUNROLL={unroll}"))
        mod.compile()
    return mod


@functools.cache
def _max_blocks(device_index: int) -> int:
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms * (2048 // BLOCK) * 2


def _row_nbytes(table: torch.Tensor) -> int:
    return math.prod(table.shape[1:]) * table.element_size()


def pitch_nbytes(table: torch.Tensor) -> int:
    """Bytes from one row of ``table`` to the next: its row size for a contiguous table,
    more for a view of one slot of an interleaved table. The elements of a row must be
    contiguous."""
    row = _row_nbytes(table)
    if table.is_contiguous() or table.shape[0] <= 1:
        return row
    inner = table[0]
    pitch = table.stride(0) * table.element_size()
    if (inner.numel() > 1 and not inner.is_contiguous()) or pitch < row:
        # (a stride-0 or overlapping view: rows would alias each other)
        raise ValueError(
            f"a table's rows must each be contiguous and not overlap; got strides "
            f"{tuple(table.stride())} for shape {tuple(table.shape)}"
        )
    return pitch


def segments_of(tables: list[torch.Tensor]) -> bool:
    """Whether ``tables`` (two or more) are consecutive slots of one interleaved table:
    same row size and row pitch, slot ``k`` starting ``k`` rows' bytes after slot 0,
    all slots inside one pitch. Such a group moves as one wide row per id."""
    if len(tables) < 2:
        return False
    first = tables[0]
    row = _row_nbytes(first)
    pitch = pitch_nbytes(first)
    if row == 0 or pitch < row * len(tables):
        return False
    base = first.data_ptr()
    for k, t in enumerate(tables[1:], start=1):
        if (
            t.data_ptr() != base + k * row
            or _row_nbytes(t) != row
            or pitch_nbytes(t) != pitch
            or t.shape[0] != first.shape[0]
            or t.device != first.device
        ):
            return False
    return True


def _grid(total: int, device_index: int, unroll: int = UNROLL) -> int:
    return max(1, min(-(-total // (BLOCK * unroll)), _max_blocks(device_index)))


_functions: dict[tuple[int, int, str], tuple[Any, int]] = {}


def _function(device_index: int, unroll: int, name: str) -> tuple[Any, int]:
    """The compiled kernel and its driver handle (0: launch through CuPy's call instead).

    The fast path hands the kernel's one struct argument to ``cuLaunchKernel`` (CuPy's
    ``driver.launchKernel``) on torch's raw current stream: ~7 us of CPU a launch on the
    H200 host against ~15 us through CuPy's kernel call (measured)."""
    key = (device_index, unroll, name)
    entry = _functions.get(key)
    if entry is None:
        raw = _module(device_index, unroll).get_function(name)
        cp = get_cupy("GPU kernels")
        with cp.cuda.Device(device_index):
            low = getattr(raw, "kernel", None)
        ptr = int(getattr(low, "ptr", 0) or 0)
        driver = getattr(getattr(cp.cuda, "driver", None), "launchKernel", None)
        if low is None or not ptr or driver is None or _raw_stream is None:
            entry = (raw, 0)
        else:
            entry = (driver, ptr)
        _functions[key] = entry
    return entry


#: torch's current raw stream handle for a device index, without building a Stream object
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _Contexts(threading.local):
    """Devices whose primary CUDA context this thread has made current (once each)."""

    def __init__(self) -> None:
        self.ready: set[int] = set()


_contexts = _Contexts()


def _ensure_context(idx: int) -> None:
    """``cuLaunchKernel`` needs a current context in the calling thread, which a thread
    that has made no CUDA runtime call yet may lack (CuPy's own launch ensures it too):
    ``cudaSetDevice`` makes the device's primary context current, keeping the device."""
    cp = get_cupy("GPU kernels")
    current = torch.cuda.current_device()
    cp.cuda.runtime.setDevice(idx)
    if current != idx:
        cp.cuda.runtime.setDevice(current)
    else:
        _contexts.ready.add(idx)


def _launch(
    kernel: tuple[Any, int],
    grid: tuple[int, int],
    words: list[int],
    struct: np.dtype,
    device: torch.device,
) -> None:
    """Launch on torch's current stream of ``device`` with as little Python as possible:
    this runs once per batch, and its cost bounds the rate of small transfers. ``words``
    are the kernel's struct argument as 8-byte words."""
    fn, ptr = kernel
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if ptr:
        assert _raw_stream is not None
        if idx not in _contexts.ready:
            _ensure_context(idx)
        arg = np.array(words, dtype=np.uint64)  # the struct's bytes, kept alive over the call
        params = np.array([arg.__array_interface__["data"][0]], dtype=np.uint64)
        launch = (
            ptr, grid[0], grid[1], 1, BLOCK, 1, 1, 0, _raw_stream(idx),
            params.__array_interface__["data"][0], 0,
        )  # fmt: skip
        if torch.cuda.current_device() == idx:
            fn(*launch)
        else:
            with get_cupy("GPU kernels").cuda.Device(idx):
                fn(*launch)
        return
    packed = np.empty(1, struct)
    packed["w"][0] = words
    with get_cupy("GPU kernels").cuda.Device(idx), cupy_stream(device):
        fn(grid, (BLOCK,), (packed,))


def _check_group(tables: list[torch.Tensor], others: list[torch.Tensor]) -> int:
    """Validate a fused group; return the row size in bytes."""
    if not 1 <= len(tables) <= MAX_TABLES or len(others) != len(tables):
        raise ValueError(
            f"a fused launch takes 1..{MAX_TABLES} tables with one buffer each; "
            f"got {len(tables)} tables and {len(others)} buffers"
        )
    first = tables[0]
    row_nbytes = _row_nbytes(first)
    pitch = pitch_nbytes(first)
    for t in tables[1:]:
        if t.shape[0] != first.shape[0] or _row_nbytes(t) != row_nbytes:
            raise ValueError(
                "fused tables must have the same number of rows and the same row size; got "
                f"{tuple(first.shape)} {first.dtype} and {tuple(t.shape)} {t.dtype}"
            )
        if pitch_nbytes(t) != pitch:
            raise ValueError(
                "fused tables must have the same row pitch; got "
                f"{pitch} and {pitch_nbytes(t)} bytes"
            )
    for o in others:
        if not o.is_contiguous():
            raise ValueError("the dense row buffers of a launch must be contiguous")
    return row_nbytes


def _pointer_args(tensors: list[torch.Tensor]) -> list[int]:
    ptrs = [t.data_ptr() for t in tensors]
    return ptrs + [ptrs[0]] * (MAX_TABLES - len(ptrs))  # unused slots: never selected


#: the kernels' argument structs as raw 8-byte words (GatherArgs: 15, ScatterArgs: 16)
_GATHER_ARGS = np.dtype([("w", np.uint64, (15,))])
_SCATTER_ARGS = np.dtype([("w", np.uint64, (16,))])


def _layout(
    tables: list[torch.Tensor], bufs: list[torch.Tensor], row_nbytes: int, max_vector: int
) -> tuple[int, int, int, int, int]:
    """(vector bytes, vectors per row, row pitch in vectors, segments, grid rows)."""
    pitch = pitch_nbytes(tables[0])
    segs = len(tables) if segments_of(tables) else 1
    w = min(
        max_vector,
        vector_width(row_nbytes, pitch, *(t.data_ptr() for t in tables + bufs)),
    )
    return w, row_nbytes // w, pitch // w, segs, (1 if segs > 1 else len(tables))


def launch_gather(
    table: torch.Tensor | list[torch.Tensor],
    ids: torch.Tensor,
    out: torch.Tensor | list[torch.Tensor],
    pos: torch.Tensor | None = None,
    *,
    unroll: int = UNROLL,
    max_vector: int = 16,
) -> None:
    """``out[pos[j]] = table[ids[j]]`` (``out[j]`` when ``pos`` is None) for every ``j``.

    ``table`` and ``out`` may be lists (up to :data:`MAX_TABLES`, same row count and
    row size): the same ids are gathered from every table in one launch. An id
    outside the table yields a zero row (nothing outside the table is read).

    Tables are CUDA-addressable tensors (GPU memory or a mapped host buffer), ``ids``
    and ``pos`` int64 CUDA tensors, outputs contiguous CUDA tensors. The launch is
    ordered on torch's current stream.
    """
    tables = table if isinstance(table, list) else [table]
    outs = out if isinstance(out, list) else [out]
    row_nbytes = _check_group(tables, outs)
    n = ids.numel()
    if n == 0 or row_nbytes == 0:
        return
    device = outs[0].device
    w, vpr, pitch, segs, gy = _layout(tables, outs, row_nbytes, max_vector)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    _launch(
        _function(idx, unroll, f"gl_gather_{w}"),
        (_grid(n * vpr * segs, idx, unroll), gy),
        [
            *_pointer_args(tables),
            *_pointer_args(outs),
            tables[0].shape[0],
            vpr,
            pitch,
            segs,
            ids.data_ptr(),
            0 if pos is None else pos.data_ptr(),
            n,
        ],
        _GATHER_ARGS,
        device,
    )


def launch_scatter(
    table: torch.Tensor | list[torch.Tensor],
    ids: torch.Tensor,
    rows: torch.Tensor | list[torch.Tensor],
    pos: torch.Tensor | None = None,
    mode: int = SCATTER_ALL,
) -> None:
    """``table[ids[j]] = rows[pos[j]]`` (``rows[j]`` when ``pos`` is None).

    ``mode`` :data:`SCATTER_ALL` writes every entry (the ids must be distinct, or a
    repeated row's bytes may mix); :data:`SCATTER_LAST_OF_RUN` expects ids sorted
    stably (``pos`` the permutation) and writes only the last entry of each run of
    equal ids, i.e. each id's last occurrence. Lists of tables / rows as in
    :func:`launch_gather`.
    """
    tables = table if isinstance(table, list) else [table]
    srcs = rows if isinstance(rows, list) else [rows]
    row_nbytes = _check_group(tables, srcs)
    n = ids.numel()
    if n == 0 or row_nbytes == 0:
        return
    device = srcs[0].device
    w, vpr, pitch, segs, gy = _layout(tables, srcs, row_nbytes, 16)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    _launch(
        _function(idx, SCATTER_UNROLL, f"gl_scatter_{w}"),
        (_grid(n * vpr * segs, idx, SCATTER_UNROLL), gy),
        [
            *_pointer_args(tables),
            *_pointer_args(srcs),
            tables[0].shape[0],
            vpr,
            pitch,
            segs,
            ids.data_ptr(),
            0 if pos is None else pos.data_ptr(),
            mode,
            n,
        ],
        _SCATTER_ARGS,
        device,
    )
