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
  caller skipped the host-side check (which raises before any write; a gather's may
  finish after its launch, and a scatter's too when the kernel is given the ids'
  (smallest, largest) pair as a guard: it then writes nothing if either is outside).
* Sorted gathers of narrow rows (and scatters of 512 B to 1 KB rows) from sparse parts of
  a huge host table run one warp per row in blocks started in id order (:data:`IN_ORDER`,
  see :func:`ordered_shape` and :func:`_ordered_launch`).
* ``pos`` lets a gather visit ids in sorted order while writing each row to its
  original output position. A scatter of stably sorted ids writes only the last
  entry of each run of equal ids (its last occurrence), tested in the kernel by
  comparing with the next id: no mask, no compaction, no GPU->CPU synchronisation.
  Without a sort, :func:`launch_last_slots` leaves each id's last position in a slot
  per table row and the scatter writes only the entries found there.
* A gather of ids that repeat, from a table in host memory, may read each distinct row
  once (:func:`dedup_slots`, :func:`launch_gather_slots`, ``slot=``): a slot per table row
  names one entry per id, only that entry reads the host, and ``gl_gather_repeats`` copies
  its row on the GPU to the entries that repeat it.
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
    "IN_ORDER",
    "MAX_TABLES",
    "FusedLauncher",
    "SCATTER_ALL",
    "SCATTER_LAST_BY_SLOT",
    "SCATTER_LAST_BY_SLOT_GUARDED",
    "SCATTER_LAST_OF_RUN",
    "group_geometry",
    "launch_plan",
    "launch_segment_sum",
    "launch_gather",
    "launch_last_slots",
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
#: last entry of each run of equal ids writes (the last occurrence wins); ids in any
#: order, only the entry named by the id's slot (:func:`launch_last_slots`) writes
SCATTER_ALL, SCATTER_LAST_OF_RUN, SCATTER_LAST_BY_SLOT = 0, 1, 2
#: mode 2 guarded by the flag that :func:`launch_last_slots` (given ``flag_out``) leaves
#: past the last slot: the scatter writes nothing if an id was outside the table
SCATTER_LAST_BY_SLOT_GUARDED = 3

_SOURCE = r"""
// Up to four tables of one row layout move in one launch. Two ways to spread them:
// * blockIdx.y picks the table (separate tables);
// * segs > 1: the tables are consecutive segments of one wider row (a table interleaved
//   with its optimizer states, see DESIGN.md), so a thread walks the whole wide row and
//   the segment it is in picks the dense buffer: one translation of each host page.
// pitch: the table's row stride in vectors (>= vpr * segs for an interleaved table).
// count (may be null): a device-side number of ids to move, read by the kernel so that a
// row plan built on the GPU needs no synchronisation to learn its size; a gather zero-fills
// the output rows from *count to n, a scatter writes only the first *count ids.
// slot (may be null; no pos, no count): a gather that reads each distinct row once --
// gl_last_slot's phase 2 left in every named row's slot one position naming it, only that
// entry reads the host, and gl_gather_repeats then copies its row to the other entries.
struct GatherArgs {
    const void* table[4]; void* out[4];
    long long n_rows, vpr, pitch, segs; const long long* ids; const long long* pos; long long n;
    const long long* count; const int* slot;
};
struct ScatterArgs {
    void* table[4]; const void* rows[4];
    long long n_rows, vpr, pitch, segs; const long long* ids; const long long* pos;
    long long mode, n; const long long* count; const int* slot; const long long* ends;
};

// A write guarded by its ids' (smallest, largest) pair on the device (a range check
// whose result the host has not read yet), or in mode 3 by the flag gl_last_slot left
// past the last slot: any id outside the table, and nothing is written at all.
__device__ __forceinline__ bool refused(const ScatterArgs& a)
{
    if (a.mode == 3 && a.slot[a.n_rows] != 0) return true;
    return a.ends && (a.ends[0] < 0 || a.ends[1] >= a.n_rows);
}

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
    const long long valid = a.count ? min(max(*a.count, 0LL), a.n) : a.n;
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
                const long long r = j < valid ? a.ids[j] : -1;  // rows past the count: zeros
                const bool inside = r >= 0 && r < a.n_rows;      // never read outside
                if (inside && a.slot && a.slot[r] != (int)j) continue;  // a repeat: copied later
                dst[u] = (V*)a.out[y + s] + (a.pos ? a.pos[j] : j) * a.vpr + c;
                v[u] = inside ? src[r * a.pitch + cc] : V();
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (dst[u]) *dst[u] = v[u];
        }
    }
}

// One warp per row and a block per few consecutive rows, each block running once: the GPU
// starts blocks in order as earlier ones finish, so the rows in flight stay the lowest ids
// not yet moved, a tight window of ascending ids (their host pages' translations) where a
// grid-stride loop's warps drift apart. Lane l moves vectors l, l + 32, ... of its row.
template <typename V>
__device__ __forceinline__ void gather_rows_in_order(const GatherArgs& a)
{
    const long long j = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= a.n) return;
    const int y = blockIdx.y;
    const V* __restrict__ src = (const V*)a.table[y];
    const long long span = a.vpr * a.segs;
    const long long valid = a.count ? min(max(*a.count, 0LL), a.n) : a.n;
    const long long r = j < valid ? a.ids[j] : -1;  // rows past the count: zeros
    const bool inside = r >= 0 && r < a.n_rows;      // never read outside
    const long long o = (a.pos ? a.pos[j] : j) * a.vpr;
    for (long long cc = threadIdx.x & 31; cc < span; cc += 32) {
        long long s = 0, c = cc;
        if (a.segs > 1) divmod(cc, a.vpr, span < 4294967296LL, s, c);
        ((V*)a.out[y + s])[o + c] = inside ? src[r * a.pitch + cc] : V();
    }
}

// The second half of a gather that reads each distinct row once (GatherArgs.slot): every
// entry whose id is inside the table but not the one its slot names copies that entry's
// row, which the gather has written (an earlier launch on the same stream). A slot that
// does not name an entry of the same id (ids changed between the launches, or slots not
// filled for these ids) never sends a copy outside the output: the entry then reads its
// row from the table itself.
template <typename V>
__device__ __forceinline__ void gather_repeats(const GatherArgs& a)
{
    const int y = blockIdx.y;
    const long long span = a.vpr * a.segs;
    const long long total = a.n * span;
    const long long stride = (long long)blockDim.x * gridDim.x;
    const bool small = total + stride < 4294967296LL;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long j, cc, s = 0, c;
        divmod(i, span, small, j, cc);
        const long long r = a.ids[j];
        if (r < 0 || r >= a.n_rows) continue;
        const long long o = a.slot[r];
        if (o == j) continue;
        if (a.segs > 1) divmod(cc, a.vpr, small, s, c); else c = cc;
        V* out = (V*)a.out[y + s];
        out[j * a.vpr + c] = (o >= 0 && o < a.n && a.ids[o] == r)
            ? out[o * a.vpr + c] : ((const V*)a.table[y])[r * a.pitch + cc];
    }
}

// Whether entry j (id r, inside the table) writes. mode 0: every entry (distinct ids);
// mode 1: ids sorted stably, a repeat that a later entry overwrites is skipped; modes 2
// and 3: ids in any order, and the entry whose position gl_last_slot left in r's slot
// writes (the largest position naming r: its last occurrence).
__device__ __forceinline__ bool wins_slot(const ScatterArgs& a, long long j, long long r,
                                          long long n)
{
    if (a.mode == 0) return true;
    if (a.mode == 1) return j + 1 == n || a.ids[j + 1] != r;
    return a.slot[r] == (int)j;
}

template <typename V>
__device__ __forceinline__ void scatter_rows(const ScatterArgs& a)
{
    const int y = blockIdx.y;
    V* __restrict__ table = (V*)a.table[y];
    const long long span = a.vpr * a.segs;
    if (refused(a)) return;
    const long long n = a.count ? min(max(*a.count, 0LL), a.n) : a.n;
    const long long total = n * span;
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
                if (r >= 0 && r < a.n_rows && wins_slot(a, j, r, n)) {  // never write outside
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

// The in-order launch of a scatter: one warp per row, blocks in id order (as
// gather_rows_in_order), the last-writer rule and the count as scatter_rows.
template <typename V>
__device__ __forceinline__ void scatter_rows_in_order(const ScatterArgs& a)
{
    const long long n = a.count ? min(max(*a.count, 0LL), a.n) : a.n;
    const long long j = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n || refused(a)) return;
    const long long r = a.ids[j];
    if (r < 0 || r >= a.n_rows || !wins_slot(a, j, r, n)) return;  // never write outside
    const int y = blockIdx.y;
    V* __restrict__ table = (V*)a.table[y];
    const long long span = a.vpr * a.segs;
    const long long o = (a.pos ? a.pos[j] : j) * a.vpr;
    for (long long cc = threadIdx.x & 31; cc < span; cc += 32) {
        long long s = 0, c = cc;
        if (a.segs > 1) divmod(cc, a.vpr, span < 4294967296LL, s, c);
        table[r * a.pitch + cc] = ((const V*)a.rows[y + s])[o + c];
    }
}

// All arguments travel in one struct passed by value: one kernel parameter to marshal
// from Python (the launch's CPU cost bounds small transfers).
#define GL_DEFINE(SUFFIX, V)                                                         \
extern "C" __global__ void gl_gather_##SUFFIX(const GatherArgs a) { gather_rows<V>(a); } \
extern "C" __global__ void gl_gather_rows_##SUFFIX(const GatherArgs a)                   \
{ gather_rows_in_order<V>(a); }                                                          \
extern "C" __global__ void gl_gather_repeats_##SUFFIX(const GatherArgs a)                \
{ gather_repeats<V>(a); }                                                                \
extern "C" __global__ void gl_scatter_##SUFFIX(const ScatterArgs a) { scatter_rows<V>(a); } \
extern "C" __global__ void gl_scatter_rows_##SUFFIX(const ScatterArgs a)                 \
{ scatter_rows_in_order<V>(a); }

// The gradient of a lookup ``rows[local]`` for a plan sized on the GPU: row r of ``out`` sums
// the gradient rows of the batch positions whose local id is r (rows past the plan's count:
// zeros). order: positions in ascending id order (stable), order_local: their local ids.
// The summation order copies torch's embedding backward on CUDA, so the result is
// bit-identical to F.embedding's: up to 3072 positions, chunks of 32 consecutive positions
// are summed first (grouped by position / 32); above, runs of 10 entries of a row's sorted
// positions are; then the partial sums are added in order. No synchronisation.
struct SegSumArgs {
    const void* grad; void* out; const long long* order; const long long* order_local;
    long long n, dim, by_position;
};

template <typename T>
__device__ __forceinline__ void segment_sum(const SegSumArgs& a)
{
    const T* __restrict__ grad = (const T*)a.grad;
    T* __restrict__ out = (T*)a.out;
    const long long total = a.n * a.dim;
    const long long count = a.order_local[a.n - 1] + 1;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long j = i / a.dim, f = i - j * a.dim;
        if (j >= count) out[i] = T(0);  // a padding row
        const long long r = a.order_local[j];
        if (j > 0 && a.order_local[j - 1] == r) continue;  // not the first entry of row r
        T acc = T(0), part = T(0);
        long long group = a.by_position ? a.order[j] / 32 : 0;
        for (long long k = j; k < a.n && a.order_local[k] == r; ++k) {
            const long long p = a.order[k];
            const long long g = a.by_position ? p / 32 : (k - j) / 10;
            if (g != group) { acc += part; part = T(0); group = g; }
            part += grad[p * a.dim + f];
        }
        out[r * a.dim + f] = acc + part;
    }
}

// A row plan from ids sorted stably (keys) and their positions (order), in one block of
// 1024 threads walking tiles of 1024 entries: order_local[i] = number of distinct keys
// before keys[i]; local[order[i]] = order_local[i]; ids[l] = the l-th distinct key, then
// padding (the largest key) up to n; *count = distinct keys; ends = (smallest, largest).
struct PlanArgs {
    const long long* keys; const long long* order; long long* order_local; long long* local;
    long long* ids; long long* count; long long* ends; long long n;
};

extern "C" __global__ void __launch_bounds__(1024) gl_plan(const PlanArgs a)
{
    __shared__ long long warp_sums[32];
    __shared__ long long carry;
    const int t = threadIdx.x, lane = t & 31, w = t >> 5, warps = blockDim.x >> 5;
    if (t == 0) carry = 0;
    __syncthreads();
    for (long long base = 0; base < a.n; base += blockDim.x) {
        const long long i = base + t;
        long long x = (i < a.n && i > 0 && a.keys[i] != a.keys[i - 1]) ? 1 : 0;
        for (int d = 1; d < 32; d <<= 1) {  // inclusive scan within the warp
            const long long y = __shfl_up_sync(0xffffffffu, x, d);
            if (lane >= d) x += y;
        }
        if (lane == 31) warp_sums[w] = x;
        __syncthreads();
        if (w == 0) {  // inclusive scan of the warps' sums
            long long s = lane < warps ? warp_sums[lane] : 0;
            for (int d = 1; d < 32; d <<= 1) {
                const long long y = __shfl_up_sync(0xffffffffu, s, d);
                if (lane >= d) s += y;
            }
            if (lane < warps) warp_sums[lane] = s;
        }
        __syncthreads();
        const long long l = carry + (w > 0 ? warp_sums[w - 1] : 0) + x;
        if (i < a.n) {
            a.order_local[i] = l;
            a.local[a.order[i]] = l;
            a.ids[l] = a.keys[i];
        }
        __syncthreads();
        if (t == blockDim.x - 1) carry = l;
        __syncthreads();
    }
    const long long count = carry + 1;
    const long long last = a.keys[a.n - 1];
    if (t == 0) {
        *a.count = count;
        a.ends[0] = a.keys[0];
        a.ends[1] = last;
    }
    for (long long j = count + t; j < a.n; j += blockDim.x) a.ids[j] = last;
}

// The last-writer rule without a sort (scatter mode 2), in two launches over the ids:
// phase 0 sets the slot of every id inside the table to -1, phase 1 raises it to the
// largest position naming that id (atomicMax: the result does not depend on the order
// the atomics land in). Ids outside the table are skipped: their slots do not exist.
// With flag_out (mode 3's range check, fused into the merge): the slots have one more
// entry, slot[n_rows]; phase 0 zeroes it and flag_out (a page-locked host word the host
// reads), and phase 1 sets both to 1 for any id outside the table (no memset launch).
// Phase 2 (a gather that reads each distinct row once): one plain store per id inside the
// table, so its slot ends up holding one of the positions naming it (any one: the rows
// they read are the same); every slot read later was written here, so none needs a reset.
// With flag_out (the range check of the gather's ids, fused into this launch): a warp
// that met an id outside the table sets the host word, which the host zeroed before.
struct SlotArgs { const long long* ids; int* slot; long long n, n_rows, phase; long long* flag_out; };

extern "C" __global__ void gl_last_slot(const SlotArgs a)
{
    if (a.phase == 0 && a.flag_out && blockIdx.x == 0 && threadIdx.x == 0) {
        a.slot[a.n_rows] = 0;  // this call's flags, raised by phase 1 (the next launch)
        *a.flag_out = 0;
    }
    const long long stride = (long long)blockDim.x * gridDim.x;
    bool bad = false;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < a.n; j += stride) {
        const long long r = a.ids[j];
        if (r < 0 || r >= a.n_rows) {
            bad = true;
            continue;
        }
        if (a.phase == 0) a.slot[r] = -1;
        else if (a.phase == 1) atomicMax(a.slot + r, (int)j);
        else a.slot[r] = (int)j;
    }
    if (a.phase != 0 && a.flag_out) {
        // one write over the link per warp (of the lanes here together) that met a bad id
        const unsigned int met = __ballot_sync(__activemask(), bad);
        if (bad && (threadIdx.x & 31) == __ffs(met) - 1) {
            if (a.phase == 1) a.slot[a.n_rows] = 1;  // the scatter (mode 3) then writes nothing
            *a.flag_out = 1;
        }
    }
}

extern "C" __global__ void gl_segsum_f4(const SegSumArgs a) { segment_sum<float>(a); }
extern "C" __global__ void gl_segsum_f8(const SegSumArgs a) { segment_sum<double>(a); }

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
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.cache
def _max_blocks(device_index: int) -> int:
    return _sm_count(device_index) * (2048 // BLOCK) * 2


#: table bytes per id above which an ascending request is taken as *sparse*: each row then
#: needs its own translation of a host page, which the GPU serves faster with fewer rows in
#: flight
SPARSE_GAP_BYTES = 16 << 10
#: rows narrower than this, or this wide and wider, keep the default grid (see
#: :func:`ordered_shape`)
MIN_SHAPED_ROW, MAX_SHAPED_ROW = 32, 2048
#: vector bytes of a sparse launch by row size, widest rows first: (smallest row bytes,
#: vector bytes). One block of 256 threads per SM: 2 KiB in flight per SM for rows of
#: 512 B and wider, 1 KiB for narrower ones.
SPARSE_VECTORS: tuple[tuple[int, int], ...] = ((512, 8), (32, 4))
#: vector bytes of a sparse scatter, any row size (the narrow-row scatter shape measured on
#: the H200 is 8-byte vectors)
SPARSE_SCATTER_VECTOR = 8
#: ``blocks_per_sm`` value of the in-order launch: a block of one warp per row, blocks
#: started in id order (``gl_gather_rows_*``), which keeps the rows in flight a tight window
#: of the ascending ids
IN_ORDER = 0
#: rows narrower than :data:`IN_ORDER_MAX_ROW` bytes of an ascending gather with more than
#: :data:`SPARSE_GAP_BYTES` and at most this many bytes of table per id take the in-order
#: launch (H200, 32 GB table, DESIGN.md: 6-28% less time than one block per SM at 32-128 KB
#: per id; 17-34% more at 512 KB per id, 5-6x at 1 MB, and 14% more for 128 B rows at 256 KB)
IN_ORDER_GAP_BYTES = 128 << 10
IN_ORDER_MAX_ROW = 512
#: a sparse ascending *scatter* (more than :data:`SPARSE_GAP_BYTES` and at most
#: :data:`IN_ORDER_GAP_BYTES` of table per id) of rows of these many bytes (both included)
#: takes the in-order launch. H200, session 22 (DESIGN.md, "In-order scatters"): 512 B rows
#: 0-12% less time than one block per SM on uniform ids, 7-23% with a dense head and a sparse
#: tail at 32-64 KB per id, 1% and 9% more at 32 and 128 KB per id with 131,072 such ids;
#: 1 KB rows 0-8% less. Narrower rows gained 20-31% on uniform ids at 64-128 KB per id but
#: took 1.4-2.8x the time where a dense head packs their rows (one warp per row writes each
#: narrow row alone)
IN_ORDER_SCATTER_ROWS = (512, 1024)
#: the in-order launch needs vectors at least this wide (narrower ones: the default grid)
IN_ORDER_MIN_VECTOR = 4


def ordered_shape(row_nbytes: int, table_nbytes: int, n_ids: int) -> tuple[int | None, int]:
    """(blocks per SM, or None for the default grid, or :data:`IN_ORDER`; widest vector in
    bytes) for a launch whose ``n_ids`` ids ascend through a table of ``table_nbytes`` in
    host memory.

    The default grid (16 blocks of 256 threads per SM, 16-byte vectors) keeps ~8 MB of
    loads in flight, which dense requests need to fill the link. A sparse request is
    bound by the GPU's translations of host pages instead, so rows of
    :data:`MIN_SHAPED_ROW` up to :data:`MAX_SHAPED_ROW` bytes from a table with more than
    :data:`SPARSE_GAP_BYTES` per id get another shape:

    * rows under :data:`IN_ORDER_MAX_ROW` bytes with at most :data:`IN_ORDER_GAP_BYTES` of
      table per id: :data:`IN_ORDER`, a block of one warp per row, the blocks started in id
      order (the shape of torch's own ``index_select`` kernel). H200, 32 GB table: 32-128 B
      rows at 32-128 KB per id 5.25 -> 4.95 to 15.5 -> 11.1 ms against one block per SM;
      16 GB table with the GPU's L2 cache flushed before each call, 22-29% less time at
      64-128 KB per id (DESIGN.md, "In-order launches");
    * other rows under 512 B: one block per SM with 4-byte vectors (128-256 B rows 6-19%
      faster than the default grid at 32-256 KB per id, 4-6x at 1 MB per id, where the
      in-order launch took 5-6x its time);
    * rows of 512 B up to 2 KB: one block per SM with 8-byte vectors. Gathers of 131,072
      sorted 512 B ids from 4-64 GB tables 9-18% faster than with the default grid (1M ids
      on 64 GB: 25%); 2-4 KB rows gained nothing.

    The table's bytes per id is only an estimate of how far apart the ids are (they
    may cluster in part of the table, and their real spread is on the GPU), so the shapes
    are ones that measured close to the default on dense requests too (within 2% on ids
    packed in 1/32 of a 32 GB table), and at least as fast on a dense head with a sparse
    tail for the rows they are given to: narrower vectors were faster still on sparse
    requests at 256 KB per id but 40-60% slower on clustered ones, and the in-order launch
    of 512 B rows 20% slower on a dense head with a sparse tail. (A build in which the
    kernel judged the ids' spread itself was slower on small sparse requests: DESIGN.md.)
    """
    if (
        n_ids <= 0
        or not MIN_SHAPED_ROW <= row_nbytes < MAX_SHAPED_ROW
        or table_nbytes // n_ids <= SPARSE_GAP_BYTES
    ):
        return None, 16
    if row_nbytes < IN_ORDER_MAX_ROW and table_nbytes // n_ids <= IN_ORDER_GAP_BYTES:
        return IN_ORDER, 16
    for smallest, vector in SPARSE_VECTORS:
        if row_nbytes >= smallest:
            return 1, vector
    return None, 16


#: whether a pointer is host memory (registered or CUDA-allocated), by (pointer, device)
_host_memory: dict[tuple[int, int], bool] = {}


def in_host_memory(table: torch.Tensor) -> bool:
    """Whether a CUDA-addressable ``table`` lies in host memory mapped for the GPU (a
    ``pinned`` store's) rather than in GPU memory, where a narrow launch would only be
    slower. Asked of the driver once per pointer."""
    ptr = table.data_ptr()
    idx = table.device.index if table.device.index is not None else torch.cuda.current_device()
    key = (ptr, idx)
    known = _host_memory.get(key)
    if known is None:
        # (cached: host allocations and GPU memory lie in separate ranges of the unified
        # address space while the driver holds them; a wrong answer would cost speed only)
        try:
            cp = get_cupy("GPU kernels")
            with cp.cuda.Device(idx):
                kind = int(cp.cuda.runtime.pointerGetAttributes(ptr).type)
        except Exception:  # (an old driver or CuPy without the call: assume host memory)
            return True
        known = kind == 1  # cudaMemoryTypeHost
        if len(_host_memory) > 1024:
            _host_memory.clear()
        _host_memory[key] = known
    return known


def _row_nbytes(table: torch.Tensor) -> int:
    return math.prod(table.shape[1:]) * table.element_size()


def pitch_nbytes(table: torch.Tensor) -> int:
    """Bytes from one row of ``table`` to the next: its row size for a contiguous table,
    more for a view of one slot of an interleaved table. The elements of a row must be
    contiguous."""
    row = _row_nbytes(table)
    if table.is_contiguous() or table.shape[0] == 0:
        return row
    inner = table[0]
    if inner.numel() > 1 and not inner.is_contiguous():
        # (one row too: a kernel moves a row as one run of bytes, and would write between
        # the elements of a strided row)
        raise ValueError(
            f"a table's rows must each be contiguous and not overlap; got strides "
            f"{tuple(table.stride())} for shape {tuple(table.shape)}"
        )
    if table.shape[0] == 1:
        return row
    pitch = table.stride(0) * table.element_size()
    if pitch < row:
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


def _grid(
    total: int, device_index: int, unroll: int = UNROLL, blocks_per_sm: int | None = None
) -> int:
    cap = (
        _max_blocks(device_index)
        if blocks_per_sm is None
        else _sm_count(device_index) * blocks_per_sm
    )
    return max(1, min(-(-total // (BLOCK * unroll)), cap))


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
        #: the kernel's struct argument (8-byte words) and the one-entry parameter array
        #: pointing at it, reused by every launch of this thread
        self.args = np.zeros(32, dtype=np.uint64)
        self.params = np.array([self.args.__array_interface__["data"][0]], dtype=np.uint64)
        self.params_ptr = int(self.params.__array_interface__["data"][0])


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
    block: int = BLOCK,
) -> None:
    """Launch on torch's current stream of ``device`` with as little Python as possible:
    this runs once per batch, and its cost bounds the rate of small transfers. ``words``
    are the kernel's struct argument as 8-byte words."""
    fn, ptr = kernel
    # every field of the struct, or the kernel would read a previous launch's words
    assert len(words) * 8 == struct.itemsize, (len(words), struct.itemsize)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if ptr:
        assert _raw_stream is not None
        if idx not in _contexts.ready:
            _ensure_context(idx)
        # the struct's bytes in this thread's argument buffer: cuLaunchKernel copies the
        # parameters before it returns, so the buffer is free again after the call
        args = _contexts.args
        args[: len(words)] = words
        launch = (
            ptr, grid[0], grid[1], 1, block, 1, 1, 0, _raw_stream(idx), _contexts.params_ptr, 0,
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
        fn(grid, (block,), (packed,))


def _table_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


#: geometry of table groups already validated, by their tables' pointers, shapes,
#: strides and dtypes: a step moves the same tables every time, and recomputing pitches
#: and segment layouts in Python cost more CPU than the launch itself (measured)
_geometry_cache: dict[tuple[Any, ...], tuple[int, int, int]] = {}


def group_geometry(tables: list[torch.Tensor]) -> tuple[int, int, int]:
    """(row bytes, row pitch in bytes, segments) of a fused group of tables, validated:
    ``segments`` is ``len(tables)`` when they are consecutive slots of one interleaved
    table (see :func:`segments_of`), else 1. Cached by the tables' geometry."""
    key = tuple(_table_key(t) for t in tables)
    geom = _geometry_cache.get(key)
    if geom is not None:
        return geom
    if not 1 <= len(tables) <= MAX_TABLES:
        raise ValueError(f"a fused launch takes 1..{MAX_TABLES} tables; got {len(tables)}")
    first = tables[0]
    row_nbytes = _row_nbytes(first)
    pitch = pitch_nbytes(first)
    for t in tables[1:]:
        if t.device != first.device:
            raise ValueError(
                f"fused tables must be on one device; got {first.device} and {t.device}"
            )
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
    geom = (row_nbytes, pitch, len(tables) if segments_of(tables) else 1)
    if len(_geometry_cache) > 1024:
        _geometry_cache.clear()
    _geometry_cache[key] = geom
    return geom


def _check_group(
    tables: list[torch.Tensor],
    others: list[torch.Tensor],
    ids: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
    rows_needed: int | None = None,
) -> tuple[int, int, int]:
    """Validate a fused group, its dense buffers (contiguous, on the tables' device, rows
    of the tables' row size, at least ``rows_needed`` of them) and its ``ids`` / ``pos``
    (contiguous int64 on that device): a kernel reads and writes every buffer by these
    facts, so a wrong one would reach memory outside it. Returns :func:`group_geometry`."""
    if len(others) != len(tables):
        raise ValueError(
            f"a fused launch takes 1..{MAX_TABLES} tables with one buffer each; "
            f"got {len(tables)} tables and {len(others)} buffers"
        )
    geom = group_geometry(tables)
    device = tables[0].device
    for o in others:
        _check_buffer(o, geom[0], device, rows_needed)
    for name, t in (("ids", ids), ("pos", pos)):
        if t is not None and (
            t.dtype != torch.int64 or t.device != device or not t.is_contiguous()
        ):
            raise ValueError(
                f"a launch's {name} must be contiguous int64 on {device}; got "
                f"{'' if t.is_contiguous() else 'non-contiguous '}{t.dtype} on {t.device}"
            )
    if pos is not None and ids is not None and pos.numel() < ids.numel():
        # (pos is a permutation of the ids' positions: its values are the caller's promise)
        raise ValueError(
            f"a launch's pos must have an entry per id; got {pos.numel()} for {ids.numel()} ids"
        )
    return geom


def _check_buffer(
    o: torch.Tensor, row_nbytes: int, device: torch.device, rows_needed: int | None
) -> None:
    if not o.is_contiguous():
        raise ValueError("the dense row buffers of a launch must be contiguous")
    if o.device != device:
        raise ValueError(f"a launch's row buffers must be on {device}; got one on {o.device}")
    if o.dim() == 0 or math.prod(o.shape[1:]) * o.element_size() != row_nbytes:
        raise ValueError(
            f"a launch's row buffers must hold rows of {row_nbytes} bytes (the tables'); got "
            f"shape {tuple(o.shape)} {o.dtype}"
        )
    if rows_needed is not None and o.shape[0] < rows_needed:
        raise ValueError(
            f"a launch of {rows_needed} ids needs row buffers of at least {rows_needed} rows; "
            f"got {o.shape[0]}"
        )


def _pointer_args(tensors: list[torch.Tensor]) -> list[int]:
    ptrs = [t.data_ptr() for t in tensors]
    return ptrs + [ptrs[0]] * (MAX_TABLES - len(ptrs))  # unused slots: never selected


#: the kernels' argument structs as raw 8-byte words (GatherArgs: 17, ScatterArgs: 19)
_GATHER_ARGS = np.dtype([("w", np.uint64, (17,))])
_SCATTER_ARGS = np.dtype([("w", np.uint64, (19,))])


def _count_ptr(count: torch.Tensor | None, device: torch.device) -> int:
    """The device pointer of a 1-element int64 count on ``device`` (0: no count)."""
    if count is None:
        return 0
    if count.dtype != torch.int64 or count.numel() != 1 or count.device != device:
        raise ValueError(
            f"count must be a 1-element int64 tensor on {device}; got {count.numel()} "
            f"{count.dtype} on {count.device}"
        )
    return int(count.data_ptr())


def _layout(
    tables: list[torch.Tensor],
    bufs: list[torch.Tensor],
    geom: tuple[int, int, int],
    max_vector: int,
) -> tuple[int, int, int, int, int]:
    """(vector bytes, vectors per row, row pitch in vectors, segments, grid rows)."""
    row_nbytes, pitch, segs = geom
    w = min(
        max_vector,
        vector_width(row_nbytes, pitch, *(t.data_ptr() for t in tables + bufs)),
    )
    return w, row_nbytes // w, pitch // w, segs, (1 if segs > 1 else len(tables))


def _ordered_launch(
    tables: list[torch.Tensor],
    bufs: list[torch.Tensor],
    geom: tuple[int, int, int],
    n: int,
    *,
    scatter: bool = False,
) -> tuple[int | None, int]:
    """(blocks per SM or :data:`IN_ORDER`, widest vector) of a launch whose ids ascend:
    :func:`ordered_shape` for the group's whole row (an interleaved group moves whole wide
    rows); a sparse scatter takes the in-order launch for rows of
    :data:`IN_ORDER_SCATTER_ROWS` bytes at most :data:`IN_ORDER_GAP_BYTES` apart, else one
    block per SM with :data:`SPARSE_SCATTER_VECTOR`; the default grid for a table in GPU memory, and
    where the rows' size or the buffers' alignment allow only narrower vectors than the
    shape's (1 x 256 x 1 or 2 B was up to 2.6x slower than the default grid on clustered
    ids: DESIGN.md) or, for the in-order launch, narrower than
    :data:`IN_ORDER_MIN_VECTOR`."""
    row_nbytes, pitch, segs = geom
    table_nbytes = tables[0].shape[0] * pitch
    blocks, vector = ordered_shape(row_nbytes * segs, table_nbytes, n)
    if blocks is None:
        return None, 16
    if scatter:
        low, high = IN_ORDER_SCATTER_ROWS
        in_order = low <= row_nbytes * segs <= high and table_nbytes // n <= IN_ORDER_GAP_BYTES
        blocks, vector = (IN_ORDER, 16) if in_order else (1, SPARSE_SCATTER_VECTOR)
    need = IN_ORDER_MIN_VECTOR if blocks == IN_ORDER else vector
    if (
        _layout(tables, bufs, geom, vector)[0] < need
        or (blocks == IN_ORDER and n > _MAX_GRID_X)
        or not in_host_memory(tables[0])
    ):
        return None, 16
    return blocks, vector


#: the most blocks a launch's grid may have along x (CUDA's limit)
_MAX_GRID_X = (1 << 31) - 1


def _in_order_shape(
    blocks_per_sm: int | None, rows_per_block: int | None, n: int
) -> tuple[bool, int]:
    """(whether the launch is in-order, rows a block) of a launch of ``n`` ids asked for
    with these arguments; refuses a negative ``blocks_per_sm``, and an in-order launch
    with other than 1..32 rows a block or more blocks than a grid may have."""
    if blocks_per_sm is not None and blocks_per_sm < 0:
        raise ValueError(f"a launch takes blocks_per_sm >= 0; got {blocks_per_sm}")
    in_order = blocks_per_sm == IN_ORDER or rows_per_block is not None
    per_block = 1 if rows_per_block is None else rows_per_block
    if in_order and (not 1 <= per_block <= 32 or -(-n // per_block) > _MAX_GRID_X):
        raise ValueError(
            f"an in-order launch takes 1..32 rows a block and at most {_MAX_GRID_X} "
            f"blocks; got {per_block} rows a block for {n} ids"
        )
    return in_order, per_block


def launch_gather(
    table: torch.Tensor | list[torch.Tensor],
    ids: torch.Tensor,
    out: torch.Tensor | list[torch.Tensor],
    pos: torch.Tensor | None = None,
    *,
    unroll: int = UNROLL,
    max_vector: int = 16,
    count: torch.Tensor | None = None,
    ordered: bool = False,
    blocks_per_sm: int | None = None,
    rows_per_block: int | None = None,
    slot: torch.Tensor | None = None,
) -> None:
    """``out[pos[j]] = table[ids[j]]`` (``out[j]`` when ``pos`` is None) for every ``j``.

    ``count``: a 1-element int64 CUDA tensor; only the first ``count`` ids are read
    and the output rows of the others are zero-filled (a plan sized on the GPU).

    ``ordered=True`` says the ids ascend: the launch shape then follows
    :func:`ordered_shape` unless ``blocks_per_sm`` or a narrower ``max_vector`` is given.
    ``blocks_per_sm``: blocks of the grid-stride kernel per SM, or :data:`IN_ORDER` for
    one block per row (the in-order launch; ``rows_per_block``, 1-32, rows a block, one
    warp each: given, it makes the launch in-order whatever ``blocks_per_sm`` says). Any
    shape gives the same result.

    ``table`` and ``out`` may be lists (up to :data:`MAX_TABLES`, same row count and
    row size): the same ids are gathered from every table in one launch. An id
    outside the table yields a zero row (nothing outside the table is read).

    ``slot`` (see :func:`dedup_slots`), filled by :func:`launch_gather_slots` for these
    ``ids``: each distinct row is read once, by the entry its slot names, and a second
    launch copies it to the entries that repeat it (no ``pos``, ``count`` or in-order
    launch; the result is the same).

    Tables are CUDA-addressable tensors (GPU memory or a mapped host buffer), ``ids``
    and ``pos`` int64 CUDA tensors, outputs contiguous CUDA tensors. The launch is
    ordered on torch's current stream.
    """
    tables = table if isinstance(table, list) else [table]
    outs = out if isinstance(out, list) else [out]
    n = ids.numel()
    geom = _check_group(tables, outs, ids, pos, n)
    if slot is not None:
        _check_slot(slot, tables[0], ids, pos)
        if count is not None:
            raise ValueError("a gather that reads each row once takes no count")
        if ordered or blocks_per_sm == IN_ORDER or rows_per_block is not None:
            raise ValueError(
                "a gather that reads each row once takes the grid-stride launch (no ordered, "
                "in-order or rows_per_block launch)"
            )
    if n == 0 or geom[0] == 0:
        return
    device = outs[0].device
    if ordered and blocks_per_sm is None and max_vector >= 16:
        blocks_per_sm, max_vector = _ordered_launch(tables, outs, geom, n)
    in_order, per_block = _in_order_shape(blocks_per_sm, rows_per_block, n)
    w, vpr, pitch, segs, gy = _layout(tables, outs, geom, max_vector)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    block = BLOCK
    if in_order:
        grid = -(-n // per_block)
        kernel, block = _function(idx, UNROLL, f"gl_gather_rows_{w}"), 32 * per_block
    else:
        grid = _grid(n * vpr * segs, idx, unroll, blocks_per_sm)
        kernel = _function(idx, unroll, f"gl_gather_{w}")
    words = [
        *_pointer_args(tables),
        *_pointer_args(outs),
        tables[0].shape[0],
        vpr,
        pitch,
        segs,
        ids.data_ptr(),
        0 if pos is None else pos.data_ptr(),
        n,
        _count_ptr(count, device),
        0 if slot is None else slot.data_ptr(),
    ]
    _launch(kernel, (grid, gy), words, _GATHER_ARGS, device, block)
    if slot is not None:
        repeats = _function(idx, UNROLL, f"gl_gather_repeats_{w}")
        _launch(repeats, (_grid(n * vpr * segs, idx), gy), words, _GATHER_ARGS, device)


#: a gather of at least this many ids from a table in host memory of at most
#: :data:`DEDUP_MAX_ROWS` rows reads each distinct row once (:func:`dedup_slots`): repeated
#: ids cost the link their bytes again otherwise (the GPU's cache does not keep them: on
#: the H200, 131,072 uniform ids with 6% repeats took as long as 131,072 distinct ones).
#: H200, ``getData`` from the 1M x 512 B seed table (DESIGN.md, "Gathers read each row
#: once"): 131,072 ids 4% less time with uniform repeats, 25% less with a skewed request
#: (68% distinct), 2% more without repeats; 65,536 ids 1%, 17% less and 3% more; at 16,384
#: ids the two extra launches cost more than they saved
DEDUP_MIN_IDS = 1 << 16
#: the slot array of such a gather holds 4 bytes per table row (64 MiB at most)
DEDUP_MAX_ROWS = 1 << 24
#: ... and the table has at most this many rows per requested id: on the H200 a request of
#: 131,072 ids to an 8M-row table (61 rows per id; uniform ids then repeat under 1%) took
#: 5% longer with the slots, distinct or uniform, and a skewed one (16% repeats) 1% less;
#: at 7.6 rows per id (the seed's 1M rows) uniform ids gained 4% and skewed ones 25%, at
#: 15 rows per id (65,536 ids) 1% and 17%
DEDUP_ROWS_PER_ID = 16


def reads_once(table: torch.Tensor, n: int) -> bool:
    """Whether a gather of ``n`` ids that may repeat from ``table`` reads each distinct
    row once (see :func:`dedup_slots`): a table in host memory of at most
    :data:`DEDUP_MAX_ROWS` rows and :data:`DEDUP_ROWS_PER_ID` rows per id, at least
    :data:`DEDUP_MIN_IDS` ids."""
    rows = table.shape[0] if table.dim() else 0
    return (
        DEDUP_MIN_IDS <= n < 2**31
        and 0 < rows <= min(DEDUP_MAX_ROWS, DEDUP_ROWS_PER_ID * n)
        and table.is_cuda
        and in_host_memory(table)
    )


def dedup_slots(table: torch.Tensor, n: int) -> torch.Tensor | None:
    """A slot array (one int32 per table row, uninitialised) for a gather of ``n`` ids
    from ``table`` that reads each distinct row once, where that pays
    (:func:`reads_once`). None otherwise (the plain gather)."""
    if not reads_once(table, n):
        return None
    return torch.empty(table.shape[0], dtype=torch.int32, device=table.device)


def launch_gather_slots(ids: torch.Tensor, slot: torch.Tensor, *, flag_out: int = 0) -> None:
    """Fill ``slot`` for a gather of contiguous 1-D int64 ``ids`` that reads each row
    once: the slot of every id inside the table (``slot`` has one entry per table row)
    gets one of the positions naming it. One launch of plain stores; ids outside the
    table are skipped (the gather gives them zero rows).

    ``flag_out``: the device address of a page-locked host int64 that the caller zeroed
    (see :func:`gadgetloader._ids.flag_word`); the launch sets it to 1 if any id is
    outside the table, so the ids' range check costs no launch of its own."""
    n = ids.numel()
    if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.dim() != 1:
        raise ValueError(
            f"ids must be a contiguous 1-D int64 tensor; got {ids.dtype} {ids.dim()}-D"
        )
    if (
        slot.dtype != torch.int32
        or slot.dim() != 1
        or not slot.is_contiguous()
        or slot.device != ids.device
    ):
        raise ValueError(
            f"the slots must be a contiguous 1-D int32 tensor on {ids.device}; got "
            f"{tuple(slot.shape)} {slot.dtype} on {slot.device}"
        )
    if n >= 2**31:
        raise ValueError(f"the slots take under 2**31 ids; got {n}")
    if n == 0:
        return
    device = ids.device
    idx = device.index if device.index is not None else torch.cuda.current_device()
    _launch(
        _function(idx, UNROLL, "gl_last_slot"),
        (max(1, min(-(-n // BLOCK), _max_blocks(idx))), 1),
        [ids.data_ptr(), slot.data_ptr(), n, slot.numel(), 2, int(flag_out)],
        _SLOT_ARGS,
        device,
    )


#: prepared single-table gathers (see :func:`gather_rows`), by the table's pointer,
#: shape, strides, dtype and device: the kernel, vector width and the struct's fixed
#: words. Plain numbers only (no tensor is kept: closing a table still frees it).
_row_gathers: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def gather_rows(
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    *,
    dedup: bool = False,
    flag_out: int = 0,
) -> Any:
    """``out[j] = table[ids[j]]``: exactly :func:`launch_gather`'s launch for one table,
    with its checks and geometry resolved once per table (a data loader's batch costs a
    lookup and ``cuLaunchKernel``). ``ids``: 1-D contiguous int64 on the device; ``out``:
    contiguous, ``(ids.numel(), *row_shape)``; anything else takes :func:`launch_gather`.
    ``dedup``: read each distinct row once where :func:`dedup_slots` says it pays (ids
    that may repeat; a sampler's batch, which cannot, leaves it off).

    ``flag_out``: a zeroed page-locked flag word's device address (see
    :func:`launch_gather_slots`) that the slots' launch, where the gather takes one, sets
    for any id outside the table. Returns the CUDA event recorded after that launch
    (before the rows are read: waiting for it does not wait for the gather), or None
    where no slots were used and the flag was not written.
    """
    key = (table.data_ptr(), table.shape, table.stride(), table.dtype, table.device)
    prep = _row_gathers.get(key)
    if prep is None:
        row_nbytes, pitch, segs = _check_group([table], [out])
        device = table.device
        idx = device.index if device.index is not None else torch.cuda.current_device()
        w = vector_width(row_nbytes, pitch, table.data_ptr())
        vpr = row_nbytes // w if row_nbytes else 0
        prep = (
            _function(idx, UNROLL, f"gl_gather_{w}"),
            w,
            vpr * segs,
            idx,
            [table.data_ptr()] * MAX_TABLES,
            [table.shape[0], vpr, pitch // w, segs],
            row_nbytes,
            device,
        )
        if len(_row_gathers) > 1024:
            _row_gathers.clear()
        _row_gathers[key] = prep
    fn, w, span, idx, head, tail, row_nbytes, device = prep
    n = ids.numel()
    if (
        n == 0
        or row_nbytes == 0
        or ids.dim() != 1
        or ids.dtype != torch.int64
        or ids.device != device
        or out.device != device
        or out.dim() == 0
        or out.shape[0] != n
        or math.prod(out.shape[1:]) * out.element_size() != row_nbytes
        or out.data_ptr() % w
        or not (ids.is_contiguous() and out.is_contiguous())
    ):
        # the general launch, which reads ids densely and refuses what does not fit
        flat = ids.reshape(-1).contiguous()
        slot = dedup_slots(table, n) if dedup else None
        claimed = None
        if slot is not None:
            claimed = _claim_slots(flat, slot, flag_out)
        launch_gather(table, flat, out, slot=slot)
        return claimed
    slot = dedup_slots(table, n) if dedup else None
    claimed = None
    if slot is not None:
        claimed = _claim_slots(ids, slot, flag_out)
    words = [*head, *([out.data_ptr()] * MAX_TABLES), *tail, ids.data_ptr(), 0, n, 0]
    words.append(0 if slot is None else slot.data_ptr())
    grid = (_grid(n * span, idx), 1)
    _launch(fn, grid, words, _GATHER_ARGS, device)
    if slot is not None:
        _launch(_function(idx, UNROLL, f"gl_gather_repeats_{w}"), grid, words, _GATHER_ARGS, device)
    return claimed


def _claim_slots(ids: torch.Tensor, slot: torch.Tensor, flag_out: int) -> Any:
    """:func:`launch_gather_slots`; with ``flag_out``, the event recorded after it."""
    launch_gather_slots(ids, slot, flag_out=flag_out)
    if not flag_out:
        return None
    return torch.cuda.current_stream(ids.device).record_event()


def launch_scatter(
    table: torch.Tensor | list[torch.Tensor],
    ids: torch.Tensor,
    rows: torch.Tensor | list[torch.Tensor],
    pos: torch.Tensor | None = None,
    mode: int = SCATTER_ALL,
    *,
    count: torch.Tensor | None = None,
    ordered: bool = False,
    blocks_per_sm: int | None = None,
    max_vector: int = 16,
    unroll: int | None = None,
    rows_per_block: int | None = None,
    slot: torch.Tensor | None = None,
    guard: torch.Tensor | None = None,
) -> None:
    """``table[ids[j]] = rows[pos[j]]`` (``rows[j]`` when ``pos`` is None).

    ``count``: a 1-element int64 CUDA tensor; only the first ``count`` ids are written.
    ``ordered``, ``blocks_per_sm`` (:data:`IN_ORDER` included), ``rows_per_block``,
    ``max_vector``: the launch shape, as in :func:`launch_gather`; ``unroll`` (rows a
    thread of the grid-stride kernel writes per pass) defaults to :data:`SCATTER_UNROLL`,
    and to 1 for a sparse ordered request (measured faster).

    ``mode`` :data:`SCATTER_ALL` writes every entry (the ids must be distinct, or a
    repeated row's bytes may mix); :data:`SCATTER_LAST_OF_RUN` expects ids sorted
    stably (``pos`` the permutation) and writes only the last entry of each run of
    equal ids, i.e. each id's last occurrence; :data:`SCATTER_LAST_BY_SLOT` takes ids in
    any order (``pos`` None) and ``slot``, the int32 array of one entry per table row that
    :func:`launch_last_slots` filled for these ids, and writes each id's last occurrence
    too; :data:`SCATTER_LAST_BY_SLOT_GUARDED` is mode 2 with slots that
    :func:`launch_last_slots` filled with ``flag_out`` (one entry more than the table has
    rows): if an id was outside the table, nothing is written. Lists of tables / rows as
    in :func:`launch_gather`.

    ``guard``: the ids' (smallest, largest) pair as a 2-element int64 tensor on the
    device (:func:`gadgetloader._ids.start_guarded_check`); if either is outside the
    table, the launch writes nothing.
    """
    if mode not in (
        SCATTER_ALL,
        SCATTER_LAST_OF_RUN,
        SCATTER_LAST_BY_SLOT,
        SCATTER_LAST_BY_SLOT_GUARDED,
    ):
        raise ValueError(f"unknown scatter mode {mode!r}; expected 0, 1, 2 or 3")
    by_slot = mode in (SCATTER_LAST_BY_SLOT, SCATTER_LAST_BY_SLOT_GUARDED)
    if count is not None and (by_slot or guard is not None):
        # the slots and the guard speak of all the ids, not of the first count
        raise ValueError("a scatter with a count takes neither last-writer slots nor a guard")
    tables = table if isinstance(table, list) else [table]
    srcs = rows if isinstance(rows, list) else [rows]
    n = ids.numel()
    geom = _check_group(tables, srcs, ids, pos, n)
    if by_slot:
        _check_slot(slot, tables[0], ids, pos, flagged=mode == SCATTER_LAST_BY_SLOT_GUARDED)
    if n == 0 or geom[0] == 0:
        return
    device = srcs[0].device
    if ordered and blocks_per_sm is None and max_vector >= 16:
        blocks_per_sm, max_vector = _ordered_launch(tables, srcs, geom, n, scatter=True)
        if unroll is None and blocks_per_sm is not None:
            unroll = 1
    if unroll is None:
        unroll = SCATTER_UNROLL
    in_order, per_block = _in_order_shape(blocks_per_sm, rows_per_block, n)
    w, vpr, pitch, segs, gy = _layout(tables, srcs, geom, max_vector)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if in_order:
        grid, block = -(-n // per_block), 32 * per_block
        kernel = _function(idx, UNROLL, f"gl_scatter_rows_{w}")
    else:
        grid, block = _grid(n * vpr * segs, idx, unroll, blocks_per_sm), BLOCK
        kernel = _function(idx, unroll, f"gl_scatter_{w}")
    _launch(
        kernel,
        (grid, gy),
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
            _count_ptr(count, device),
            slot.data_ptr() if by_slot and slot is not None else 0,
            _guard_ptr(guard, device),
        ],
        _SCATTER_ARGS,
        device,
        block,
    )


#: SegSumArgs: 7 words
_SEGSUM_ARGS = np.dtype([("w", np.uint64, (7,))])

#: torch's CUDA embedding backward sums by chunks of positions up to this many lookups
#: (and by runs of a row's sorted positions above): the segment sum copies it
_BY_POSITION_MAX = 3072


def launch_segment_sum(
    grad: torch.Tensor, order: torch.Tensor, order_local: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[r] = sum of grad[p] over the positions p whose local row is r``, rows past the
    plan's count zero-filled, in the summation order of torch's CUDA embedding backward
    (bit-identical to ``F.embedding``'s gradient), without a synchronisation.

    ``grad`` and ``out``: contiguous float32/float64 CUDA tensors of shape (n, dim);
    ``order``/``order_local``: a :class:`~gadgetloader.switching._rows.RowPlan`'s.
    """
    n = order.numel()
    dim = grad.shape[1] if grad.dim() == 2 else 0
    if grad.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the segment sum takes float32 or float64; got {grad.dtype}")
    if (
        tuple(grad.shape) != (n, dim)
        or tuple(out.shape) != (n, dim)
        or out.dtype != grad.dtype
        or not (grad.is_contiguous() and out.is_contiguous())
        or out.device != grad.device
    ):
        raise ValueError(
            f"grad and out must be contiguous ({n}, dim) tensors of one dtype; got "
            f"{tuple(grad.shape)} {grad.dtype} and {tuple(out.shape)} {out.dtype}"
        )
    for name, t in (("order", order), ("order_local", order_local)):
        if (
            t.dtype != torch.int64
            or t.dim() != 1
            or t.numel() != n
            or not t.is_contiguous()
            or t.device != grad.device
        ):
            raise ValueError(
                f"{name} must be a contiguous 1-D int64 tensor of {n} entries on {grad.device}; "
                f"got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if n == 0 or dim == 0:
        return
    device = grad.device
    idx = device.index if device.index is not None else torch.cuda.current_device()
    name = "gl_segsum_f4" if grad.dtype == torch.float32 else "gl_segsum_f8"
    _launch(
        _function(idx, UNROLL, name),
        (max(1, min(-(-(n * dim) // BLOCK), _max_blocks(idx))), 1),
        [
            grad.data_ptr(),
            out.data_ptr(),
            order.data_ptr(),
            order_local.data_ptr(),
            n,
            dim,
            1 if n <= _BY_POSITION_MAX else 0,
        ],
        _SEGSUM_ARGS,
        device,
    )


def _guard_ptr(guard: torch.Tensor | None, device: torch.device) -> int:
    """The device pointer of a scatter's (smallest, largest) id pair (0: none)."""
    if guard is None:
        return 0
    if (
        guard.dtype != torch.int64
        or guard.numel() != 2
        or not guard.is_contiguous()
        or guard.device != device
    ):
        raise ValueError(
            f"a scatter's guard must be a contiguous 2-element int64 tensor on {device}; got "
            f"{guard.numel()} {guard.dtype} on {guard.device}"
        )
    return int(guard.data_ptr())


#: SlotArgs: 6 words
_SLOT_ARGS = np.dtype([("w", np.uint64, (6,))])


def _check_slot(
    slot: torch.Tensor | None,
    table: torch.Tensor,
    ids: torch.Tensor,
    pos: torch.Tensor | None,
    *,
    flagged: bool = False,
) -> None:
    """A last-writer slot array fits ``table`` and the ids (the kernels index it by id);
    ``flagged``: it also holds the range-check flag past the last slot."""
    size = table.shape[0] + (1 if flagged else 0)
    if (
        slot is None
        or slot.dtype != torch.int32
        or slot.dim() != 1
        or slot.numel() != size
        or not slot.is_contiguous()
        or slot.device != ids.device
    ):
        got = "None" if slot is None else f"{tuple(slot.shape)} {slot.dtype} on {slot.device}"
        raise ValueError(
            f"the last-writer slots must be a contiguous 1-D int32 tensor of {size} "
            f"entries (one per table row{', and the flag' if flagged else ''}) on "
            f"{ids.device}; got {got}"
        )
    if pos is not None or ids.numel() >= 2**31:
        raise ValueError("the last-writer slots take ids as given (no pos), under 2**31 of them")


def launch_last_slots(ids: torch.Tensor, slot: torch.Tensor, *, flag_out: int = 0) -> None:
    """Fill ``slot`` (int32, one entry per table row) for a :data:`SCATTER_LAST_BY_SLOT`
    scatter of contiguous int64 ``ids``: the slot of each id inside the table gets the
    largest position naming it; other slots are not touched (ids outside the table are
    skipped). Two launches, no sort, no synchronisation; the result does not depend on
    the order the GPU's atomics land in.

    ``flag_out``: the device address of a page-locked host int64 (see
    :func:`gadgetloader._ids.flag_word`) for a :data:`SCATTER_LAST_BY_SLOT_GUARDED`
    scatter. ``slot`` then has one entry more than the table has rows: the first launch
    zeroes that entry and ``flag_out``, and the second sets both to 1 for any id outside
    the table, so the ids' range check costs no launch of its own (nor a memset)."""
    n = ids.numel()
    if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.dim() != 1:
        raise ValueError(
            f"ids must be a contiguous 1-D int64 tensor; got {ids.dtype} {ids.dim()}-D"
        )
    if (
        slot.dtype != torch.int32
        or slot.dim() != 1
        or not slot.is_contiguous()
        or slot.device != ids.device
        or (flag_out and slot.numel() < 1)
    ):
        raise ValueError(
            f"the slots must be a contiguous 1-D int32 tensor on {ids.device}; got "
            f"{tuple(slot.shape)} {slot.dtype} on {slot.device}"
        )
    if n >= 2**31:
        raise ValueError(f"the last-writer slots take under 2**31 ids; got {n}")
    if n == 0:
        return
    device = ids.device
    idx = device.index if device.index is not None else torch.cuda.current_device()
    fn = _function(idx, UNROLL, "gl_last_slot")
    grid = (max(1, min(-(-n // BLOCK), _max_blocks(idx))), 1)
    n_rows = slot.numel() - (1 if flag_out else 0)
    for phase in (0, 1):
        _launch(
            fn,
            grid,
            [ids.data_ptr(), slot.data_ptr(), n, n_rows, phase, int(flag_out)],
            _SLOT_ARGS,
            device,
        )


#: PlanArgs: 8 words
_PLAN_ARGS = np.dtype([("w", np.uint64, (8,))])

#: the one-block plan kernel walks tiles of this many ids
PLAN_BLOCK = 1024


def launch_plan(keys: torch.Tensor, order: torch.Tensor, out: torch.Tensor) -> None:
    """A row plan from int64 ``keys`` sorted stably and their positions ``order`` (both
    1-D, length n >= 1, contiguous, on one CUDA device) into ``out``, an int64 tensor of
    3n + 3 entries: ``order_local``, ``local``, ``ids`` (n each), the count, and the
    smallest and largest key. One launch, no synchronisation (see ``gl_plan``)."""
    n = keys.numel()
    if (
        n < 1
        or keys.dtype != torch.int64
        or order.dtype != torch.int64
        or out.dtype != torch.int64
        or order.numel() != n
        or out.numel() != 3 * n + 3
        or not (keys.is_contiguous() and order.is_contiguous() and out.is_contiguous())
    ):
        raise ValueError(
            f"launch_plan takes n >= 1 contiguous int64 keys and order and 3n + 3 outputs; "
            f"got {n} {keys.dtype}, {order.numel()} {order.dtype}, {out.numel()} {out.dtype}"
        )
    device = keys.device
    idx = device.index if device.index is not None else torch.cuda.current_device()
    base, step = out.data_ptr(), out.element_size()
    _launch(
        _function(idx, UNROLL, "gl_plan"),
        (1, 1),
        [
            keys.data_ptr(),
            order.data_ptr(),
            base,
            base + n * step,
            base + 2 * n * step,
            base + 3 * n * step,
            base + (3 * n + 1) * step,
            n,
        ],
        _PLAN_ARGS,
        device,
        PLAN_BLOCK,
    )


class FusedLauncher:
    """Gathers and scatters of one fixed group of tables (a table and its optimizer states,
    see :func:`group_geometry`) with the geometry, the vector width and the kernels
    resolved once: a launch then costs one struct fill and ``cuLaunchKernel``, which
    matters for a training step that moves a few thousand rows several times.

    Buffers whose pointers break the resolved vector alignment fall back to
    :func:`launch_gather` / :func:`launch_scatter`.
    """

    def __init__(self, tables: list[torch.Tensor]) -> None:
        # numbers only, no tensor: a closed table's memory is freed even while a cached
        # launcher of it lives on (its users check that the tables are open before a launch)
        self.geometry = group_geometry(tables)
        row_nbytes, pitch, segs = self.geometry
        self.device = tables[0].device
        self.index = (
            self.device.index if self.device.index is not None else torch.cuda.current_device()
        )
        self.n_tables = len(tables)
        self.ptrs = [t.data_ptr() for t in tables]
        self.num_rows = int(tables[0].shape[0])
        self.width = vector_width(row_nbytes, pitch, *self.ptrs)
        self.head = self.ptrs + [self.ptrs[0]] * (MAX_TABLES - self.n_tables)
        self.grid_y = 1 if segs > 1 else self.n_tables
        self.vpr, self.span, self.tail = self._shape(self.width)
        self._gather = _function(self.index, UNROLL, f"gl_gather_{self.width}")
        self._scatter = _function(self.index, SCATTER_UNROLL, f"gl_scatter_{self.width}")

    def _shape(self, w: int) -> tuple[int, int, list[int]]:
        row_nbytes, pitch, segs = self.geometry
        vpr = row_nbytes // w
        return vpr, vpr * segs, [self.num_rows, vpr, pitch // w, segs]

    def _width(self, ids: torch.Tensor, bufs: list[torch.Tensor]) -> int:
        """The vector width of a launch with ``bufs`` (the launcher's own, unless a buffer's
        alignment needs a narrower one), after checking ``ids`` and every buffer."""
        if len(bufs) != self.n_tables:
            raise ValueError(
                f"this launch moves {self.n_tables} tables and takes one buffer each; got "
                f"{len(bufs)}"
            )
        n = ids.numel()
        if ids.dtype != torch.int64 or ids.device != self.device or not ids.is_contiguous():
            raise ValueError(
                f"a launch's ids must be contiguous int64 on {self.device}; got {ids.dtype} "
                f"on {ids.device}"
            )
        w = self.width
        for b in bufs:
            _check_buffer(b, self.geometry[0], self.device, n)
            if b.data_ptr() % w:
                w = vector_width(self.geometry[0], self.geometry[1], *self.ptrs, b.data_ptr())
        return w

    def gather(self, ids: torch.Tensor, outs: list[torch.Tensor], count: torch.Tensor) -> None:
        """As :func:`launch_gather` with ``count`` (contiguous int64 ``ids`` on the device)."""
        n = ids.numel()
        if n == 0 or self.geometry[0] == 0:
            return
        w = self._width(ids, outs)
        fn, span, tail = self._gather, self.span, self.tail
        if w != self.width:  # a buffer aligned to less: the same launch, narrower vectors
            fn = _function(self.index, UNROLL, f"gl_gather_{w}")
            _, span, tail = self._shape(w)
        _launch(
            fn,
            (_grid(n * span, self.index), self.grid_y),
            [
                *self.head,
                *_pointer_args(outs),
                *tail,
                ids.data_ptr(),
                0,
                n,
                _count_ptr(count, self.device),
                0,
            ],
            _GATHER_ARGS,
            self.device,
        )

    def scatter(self, ids: torch.Tensor, rows: list[torch.Tensor], count: torch.Tensor) -> None:
        """As :func:`launch_scatter` of distinct ``ids`` with ``count``."""
        n = ids.numel()
        if n == 0 or self.geometry[0] == 0:
            return
        w = self._width(ids, rows)
        fn, span, tail = self._scatter, self.span, self.tail
        if w != self.width:
            fn = _function(self.index, SCATTER_UNROLL, f"gl_scatter_{w}")
            _, span, tail = self._shape(w)
        _launch(
            fn,
            (_grid(n * span, self.index, SCATTER_UNROLL), self.grid_y),
            [
                *self.head,
                *_pointer_args(rows),
                *tail,
                ids.data_ptr(),
                0,
                SCATTER_ALL,
                n,
                _count_ptr(count, self.device),
                0,
                0,
            ],
            _SCATTER_ARGS,
            self.device,
        )
