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
  original output position; ``keep`` lets a scatter skip the repeats of an id that
  lose to its last occurrence, without compacting (no GPU->CPU synchronisation).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from .._device import cupy_stream, get_cupy

__all__ = ["launch_gather", "launch_scatter", "vector_width"]

#: independent row vectors each thread loads before storing. The H200 sweep (DESIGN.md)
#: measured 1, 4 and 8 within noise of each other: the link, not the issue rate, limits.
UNROLL = 1
SCATTER_UNROLL = 4
BLOCK = 256

_SOURCE = r"""
template <typename V>
__device__ __forceinline__ void gather_rows(
    const V* __restrict__ src, long long n_rows, long long vpr,
    const long long* __restrict__ ids, const long long* __restrict__ pos,
    long long n, V* __restrict__ out)
{
    const long long total = n * vpr;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += stride * UNROLL) {
        V v[UNROLL];
        long long dst[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long k = i + u * stride;
            dst[u] = -1;
            if (k < total) {
                const long long j = k / vpr;
                const long long c = k - j * vpr;
                const long long r = ids[j];
                dst[u] = (pos ? pos[j] : j) * vpr + c;
                v[u] = (r >= 0 && r < n_rows) ? src[r * vpr + c] : V();  // never read outside
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (dst[u] >= 0) out[dst[u]] = v[u];
        }
    }
}

template <typename V>
__device__ __forceinline__ void scatter_rows(
    V* __restrict__ dst, long long n_rows, long long vpr,
    const long long* __restrict__ ids, const long long* __restrict__ pos,
    const bool* __restrict__ keep, long long n, const V* __restrict__ src)
{
    const long long total = n * vpr;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += stride * UNROLL) {
        V v[UNROLL];
        long long to[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long k = i + u * stride;
            to[u] = -1;
            if (k < total) {
                const long long j = k / vpr;
                const long long c = k - j * vpr;
                if (keep == nullptr || keep[j]) {
                    const long long r = ids[j];
                    if (r >= 0 && r < n_rows) {
                        v[u] = src[(pos ? pos[j] : j) * vpr + c];
                        to[u] = r * vpr + c;
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (to[u] >= 0) dst[to[u]] = v[u];
        }
    }
}

#define GL_DEFINE(SUFFIX, V)                                                         \
extern "C" __global__ void gl_gather_##SUFFIX(                                       \
    const V* src, long long n_rows, long long vpr, const long long* ids,            \
    const long long* pos, long long n, V* out)                                      \
{ gather_rows<V>(src, n_rows, vpr, ids, pos, n, out); }                             \
extern "C" __global__ void gl_scatter_##SUFFIX(                                      \
    V* dst, long long n_rows, long long vpr, const long long* ids,                  \
    const long long* pos, const bool* keep, long long n, const V* src)              \
{ scatter_rows<V>(dst, n_rows, vpr, ids, pos, keep, n, src); }

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


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _grid(total: int, device_index: int, unroll: int = UNROLL) -> int:
    return max(1, min(-(-total // (BLOCK * unroll)), _max_blocks(device_index)))


_functions: dict[tuple[int, int, str], Any] = {}


def _function(device_index: int, unroll: int, name: str) -> Any:
    key = (device_index, unroll, name)
    fn = _functions.get(key)
    if fn is None:
        fn = _module(device_index, unroll).get_function(name)
        _functions[key] = fn
    return fn


def launch_gather(
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    pos: torch.Tensor | None = None,
    *,
    unroll: int = UNROLL,
    max_vector: int = 16,
) -> None:
    """``out[pos[j]] = table[ids[j]]`` (``out[j]`` when ``pos`` is None) for every ``j``.

    An id outside the table yields a zero row (nothing outside the table is read).

    ``table`` is a CUDA-addressable tensor (GPU memory or a mapped host buffer),
    ``ids`` and ``pos`` int64 CUDA tensors, ``out`` a contiguous CUDA tensor. The
    launch is ordered on torch's current stream.
    """
    n = ids.numel()
    if n == 0:
        return
    device = out.device
    row_nbytes = _row_nbytes(table)
    w = min(max_vector, vector_width(row_nbytes, table.data_ptr(), out.data_ptr()))
    vpr = row_nbytes // w
    idx = device.index if device.index is not None else 0
    kern = _function(idx, unroll, f"gl_gather_{w}")
    with get_cupy("GPU kernels").cuda.Device(idx), cupy_stream(device):
        kern(
            (_grid(n * vpr, idx, unroll),),
            (BLOCK,),
            (
                _ptr(table),
                np.int64(table.shape[0]),
                np.int64(vpr),
                _ptr(ids),
                _ptr(pos),
                np.int64(n),
                _ptr(out),
            ),
        )


def launch_scatter(
    table: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> None:
    """``table[ids[j]] = rows[pos[j]]`` for every ``j`` with ``keep[j]`` (all when None)."""
    n = ids.numel()
    if n == 0:
        return
    device = rows.device
    row_nbytes = _row_nbytes(table)
    w = vector_width(row_nbytes, table.data_ptr(), rows.data_ptr())
    vpr = row_nbytes // w
    idx = device.index if device.index is not None else 0
    kern = _function(idx, SCATTER_UNROLL, f"gl_scatter_{w}")
    with get_cupy("GPU kernels").cuda.Device(idx), cupy_stream(device):
        kern(
            (_grid(n * vpr, idx, SCATTER_UNROLL),),
            (BLOCK,),
            (
                _ptr(table),
                np.int64(table.shape[0]),
                np.int64(vpr),
                _ptr(ids),
                _ptr(pos),
                _ptr(keep),
                np.int64(n),
                _ptr(rows),
            ),
        )
