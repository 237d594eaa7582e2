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
"""

from __future__ import annotations

import functools
import math
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
// Up to four tables of one row layout move in one launch: blockIdx.y picks the table.
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
    int mode, long long n, const V* __restrict__ src)
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
                const long long r = ids[j];
                // mode 1: ids sorted stably; a repeat that a later entry overwrites is skipped
                const bool wins = mode == 0 || j + 1 == n || ids[j + 1] != r;
                if (wins && r >= 0 && r < n_rows) {  // never write outside
                    v[u] = src[(pos ? pos[j] : j) * vpr + c];
                    to[u] = r * vpr + c;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (to[u] >= 0) dst[to[u]] = v[u];
        }
    }
}

// All arguments travel in one struct passed by value: one kernel parameter to marshal
// from Python instead of fourteen (the launch's CPU cost bounds small transfers).
struct GatherArgs {
    const void* table[4]; void* out[4];
    long long n_rows, vpr; const long long* ids; const long long* pos; long long n;
};
struct ScatterArgs {
    void* table[4]; const void* rows[4];
    long long n_rows, vpr; const long long* ids; const long long* pos; long long mode, n;
};

#define GL_DEFINE(SUFFIX, V)                                                         \
extern "C" __global__ void gl_gather_##SUFFIX(const GatherArgs a)                    \
{                                                                                    \
    const int k = blockIdx.y;                                                        \
    gather_rows<V>((const V*)a.table[k], a.n_rows, a.vpr, a.ids, a.pos, a.n,         \
                   (V*)a.out[k]);                                                    \
}                                                                                    \
extern "C" __global__ void gl_scatter_##SUFFIX(const ScatterArgs a)                  \
{                                                                                    \
    const int k = blockIdx.y;                                                        \
    scatter_rows<V>((V*)a.table[k], a.n_rows, a.vpr, a.ids, a.pos, (int)a.mode, a.n, \
                    (const V*)a.rows[k]);                                            \
}

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


def _grid(total: int, device_index: int, unroll: int = UNROLL) -> int:
    return max(1, min(-(-total // (BLOCK * unroll)), _max_blocks(device_index)))


_functions: dict[tuple[int, int, str], tuple[Any, bool]] = {}


def _function(device_index: int, unroll: int, name: str) -> tuple[Any, bool]:
    """The compiled kernel and whether its call takes the stream directly: CuPy's
    low-level ``Function`` does (``RawKernel.kernel``); a plain ``RawKernel`` does not."""
    key = (device_index, unroll, name)
    entry = _functions.get(key)
    if entry is None:
        raw = _module(device_index, unroll).get_function(name)
        with get_cupy("GPU kernels").cuda.Device(device_index):
            low = getattr(raw, "kernel", None)
        entry = (low, True) if low is not None and _raw_stream is not None else (raw, False)
        _functions[key] = entry
    return entry


class _StreamRef:
    """What CuPy's kernel call reads from a stream: its handle, as ``.ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


#: torch's current raw stream handle for a device index, without building a Stream object
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _launch(
    kernel: tuple[Any, bool], grid: tuple[int, int], args: tuple[Any, ...], device: torch.device
) -> None:
    """Launch on torch's current stream of ``device`` with as little Python as possible:
    this runs once per batch, and its cost bounds the rate of small transfers."""
    fn, takes_stream = kernel
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if takes_stream:
        assert _raw_stream is not None
        stream = _StreamRef(_raw_stream(idx))
        if torch.cuda.current_device() == idx:
            fn(grid, (BLOCK,), args, stream=stream)
        else:
            with get_cupy("GPU kernels").cuda.Device(idx):
                fn(grid, (BLOCK,), args, stream=stream)
        return
    with get_cupy("GPU kernels").cuda.Device(idx), cupy_stream(device):
        fn(grid, (BLOCK,), args)


def _check_group(tables: list[torch.Tensor], others: list[torch.Tensor]) -> int:
    """Validate a fused group; return the row size in bytes."""
    if not 1 <= len(tables) <= MAX_TABLES or len(others) != len(tables):
        raise ValueError(
            f"a fused launch takes 1..{MAX_TABLES} tables with one buffer each; "
            f"got {len(tables)} tables and {len(others)} buffers"
        )
    first = tables[0]
    row_nbytes = _row_nbytes(first)
    for t in tables[1:]:
        if t.shape[0] != first.shape[0] or _row_nbytes(t) != row_nbytes:
            raise ValueError(
                "fused tables must have the same number of rows and the same row size; got "
                f"{tuple(first.shape)} {first.dtype} and {tuple(t.shape)} {t.dtype}"
            )
    return row_nbytes


def _pointer_args(tensors: list[torch.Tensor]) -> list[int]:
    ptrs = [t.data_ptr() for t in tensors]
    return ptrs + [ptrs[0]] * (MAX_TABLES - len(ptrs))  # unused slots: never selected


#: the kernels' argument structs as raw 8-byte words (GatherArgs: 13, ScatterArgs: 14)
_GATHER_ARGS = np.dtype([("w", np.uint64, (13,))])
_SCATTER_ARGS = np.dtype([("w", np.uint64, (14,))])


def _pack(dtype: np.dtype, words: list[int]) -> np.ndarray:
    """One struct argument: a size-1 NumPy array, which CuPy passes to the kernel by value."""
    arg = np.empty(1, dtype)
    arg["w"][0] = words
    return arg


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
    w = min(max_vector, vector_width(row_nbytes, *(t.data_ptr() for t in tables + outs)))
    vpr = row_nbytes // w
    idx = device.index if device.index is not None else torch.cuda.current_device()
    _launch(
        _function(idx, unroll, f"gl_gather_{w}"),
        (_grid(n * vpr, idx, unroll), len(tables)),
        (
            _pack(
                _GATHER_ARGS,
                [
                    *_pointer_args(tables),
                    *_pointer_args(outs),
                    tables[0].shape[0],
                    vpr,
                    ids.data_ptr(),
                    0 if pos is None else pos.data_ptr(),
                    n,
                ],
            ),
        ),
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
    w = vector_width(row_nbytes, *(t.data_ptr() for t in tables + srcs))
    vpr = row_nbytes // w
    idx = device.index if device.index is not None else torch.cuda.current_device()
    _launch(
        _function(idx, SCATTER_UNROLL, f"gl_scatter_{w}"),
        (_grid(n * vpr, idx, SCATTER_UNROLL), len(tables)),
        (
            _pack(
                _SCATTER_ARGS,
                [
                    *_pointer_args(tables),
                    *_pointer_args(srcs),
                    tables[0].shape[0],
                    vpr,
                    ids.data_ptr(),
                    0 if pos is None else pos.data_ptr(),
                    mode,
                    n,
                ],
            ),
        ),
        device,
    )
