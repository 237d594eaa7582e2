# ruff: noqa: B023  (every closure runs within its own loop iteration)
"""Does the in-order launch help sparse scatters too? (session 22)

Run on a CUDA machine from the repository root (needs 32 GB of pinnable host RAM)::

    python notebooks/probes/scatter_order.py OUT.json

Session 21 gave sorted gathers of rows under 512 B an in-order launch (one warp per row,
blocks started in id order, ``gl_gather_rows_*``): it keeps the rows in flight a tight
window of the ascending ids and their host pages, and took 20-30% off sparse gathers at
32-128 KB of table per id. Scatters kept one block per SM with 8-byte vectors. This probe
compiles an in-order *scatter* (``gl_scatter_rows_*``: the same one-warp-per-row shape,
with the scatter's last-writer rule, appended to the library's kernel source) and times,
for sorted distinct ids written through a random permutation ``pos`` (as the engine's
scatter runs them, mode ``SCATTER_LAST_OF_RUN``):

* ``rule``: ``launch_scatter(..., ordered=True)``, the library's current choice;
* ``default``: the default grid (16 blocks of 256 threads per SM, 16-byte vectors);
* ``r1``, ``r4``, ``r16``: the in-order scatter with 1, 4 and 16 rows a block;
* ``torch``: ``index_copy_`` of the same rows into the zero-copy view (sorted ids).

Rows of 32 B, 128 B and 512 B, one 32 GB table seen at prefixes of 4-32 GB, 131,072 ids
(32-256 KB of table per id) and 1,048,576 ids on 32 GB (32 KB per id). Each figure is the
median of 7 CUDA-event timings (ms) after one untimed call; every variant's writes are
checked against the rows written (``wrong`` lists any that differ).
Results: ``notebooks/results/h200-scatter-order-session22.json``.

Second argument ``more``: ids with a dense head and a sparse tail (60% of them in the first
1/512 of the table, the rest spread over it), where session 21 found the in-order *gather*
of 512 B rows 20% slower, for rows of 32 B to 1 KB on the 32 GB table; and 1 KB rows at
64-256 KB per id (``...-more-session22.json``). ``head2``: with the library's in-order
scatter adopted (``rule``; ``b1v8`` is the shape it replaced), a dense head and a sparse
tail at 32-128 KB of table per id (``...-head2-session22.json``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

import gadgetloader as gl
from gadgetloader.transfer import _kernels as kernels

GB = 32

EXTRA = r"""
// In-order scatter: one warp per row, a block per few consecutive (ascending) ids.
template <typename V>
__device__ __forceinline__ void scatter_rows_in_order(const ScatterArgs& a)
{
    const long long n = a.count ? min(max(*a.count, 0LL), a.n) : a.n;
    const long long j = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n) return;
    const long long r = a.ids[j];
    const bool wins = a.mode == 0 || j + 1 == n || a.ids[j + 1] != r;
    if (!wins || r < 0 || r >= a.n_rows) return;  // never write outside
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
extern "C" __global__ void gl_scatter_rows_16(const ScatterArgs a) { scatter_rows_in_order<uint4>(a); }
extern "C" __global__ void gl_scatter_rows_8(const ScatterArgs a) { scatter_rows_in_order<uint2>(a); }
extern "C" __global__ void gl_scatter_rows_4(const ScatterArgs a) { scatter_rows_in_order<unsigned int>(a); }
"""


def install() -> None:
    """Add the in-order scatter to the kernel source (the library has it since this probe)."""
    if "gl_scatter_rows_" in kernels._SOURCE:
        return
    kernels._SOURCE = kernels._SOURCE + EXTRA
    kernels._module.cache_clear()
    kernels._functions.clear()


def scatter_in_order(
    table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, rpb: int
) -> None:
    n = ids.numel()
    geom = kernels._check_group([table], [rows], ids, pos, n)
    w, vpr, pitch, segs, gy = kernels._layout([table], [rows], geom, 16)
    kernels._launch(
        kernels._function(0, 1, f"gl_scatter_rows_{w}"),
        (-(-n // rpb), gy),
        [
            *kernels._pointer_args([table]),
            *kernels._pointer_args([rows]),
            table.shape[0],
            vpr,
            pitch,
            segs,
            ids.data_ptr(),
            pos.data_ptr(),
            kernels.SCATTER_LAST_OF_RUN,
            n,
            0,  # no count
            0,  # no last-writer slots (a field since session 24)
            0,  # no guard (a field since session 24)
        ],
        kernels._SCATTER_ARGS,
        table.device,
        32 * rpb,
    )


def timed(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def head_tail(rows_total: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct ascending ids, 60% of them in the first 1/512 of the table."""
    head = min(int(n * 0.6), rows_total // 512)
    a = torch.randperm(rows_total // 512, device="cuda", generator=gen)[:head]
    tail = torch.randint(
        rows_total // 512, rows_total, (n - head + n // 4,), device="cuda", generator=gen
    )
    tail = torch.unique(tail)
    tail = tail[torch.randperm(tail.numel(), device="cuda", generator=gen)[: n - head]]
    return torch.cat([a, tail]).sort().values


def main(path: str, mode: str = "base") -> None:
    install()
    start = time.time()
    g = gl.DataGadget(((GB << 30) // 4,), dtype="float32", placement="pinned")
    flat = g.as_tensor()
    host = g.store.host_view()
    print(f"{GB} GB ready in {time.time() - start:.1f}s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, object] = {}
    cases = [(w, gb, 131_072, "uniform") for w in (8, 32, 128) for gb in (4, 8, 16, 32)]
    cases += [(w, 32, 1_048_576, "uniform") for w in (8, 32, 128)]
    if mode == "more":
        cases = [(w, 32, n, "head") for w in (8, 32, 128, 256) for n in (131_072, 1_048_576)]
        cases += [(256, gb, 131_072, "uniform") for gb in (8, 16, 32)]
    elif mode == "head2":
        cases = [(w, gb, 131_072, "head") for w in (8, 32, 128) for gb in (4, 8, 16)]
        cases += [(w, gb, 524_288, "head") for w in (8, 32, 128) for gb in (16, 32)]
    for width, gb, n, spread in cases:
        rows_total = (gb << 30) // (4 * width)
        table = flat[: rows_total * width].view(rows_total, width)
        if spread == "head":
            ids = head_tail(rows_total, n, gen)
        else:
            drawn = torch.unique(
                torch.randint(0, rows_total, (n + n // 4,), device="cuda", generator=gen)
            )
            pick = torch.randperm(drawn.numel(), device="cuda", generator=gen)[:n]
            ids = drawn[pick].sort().values  # n distinct ids, ascending
        pos = torch.randperm(n, device="cuda", generator=gen)
        rows = torch.randn(n, width, device="cuda", generator=gen)
        want = rows[pos]  # the row each sorted id receives

        def rule() -> None:
            kernels.launch_scatter(table, ids, rows, pos, kernels.SCATTER_LAST_OF_RUN, ordered=True)

        def default() -> None:
            kernels.launch_scatter(table, ids, rows, pos, kernels.SCATTER_LAST_OF_RUN)

        def torch_copy() -> None:
            table.index_copy_(0, ids, want)

        def b1v8() -> None:  # the rule's shape for every sparse scatter before this probe
            kernels.launch_scatter(
                table, ids, rows, pos, kernels.SCATTER_LAST_OF_RUN,
                blocks_per_sm=1, max_vector=8, unroll=1,
            )  # fmt: skip

        variants: dict[str, Callable[[], None]] = {"rule": rule, "default": default}
        if mode != "base":
            variants["b1v8"] = b1v8
        for rpb in (1, 4, 16) if mode == "base" else (1, 2, 4):
            variants[f"r{rpb}"] = lambda rpb=rpb: scatter_in_order(table, ids, rows, pos, rpb)
        variants["torch"] = torch_copy
        got: dict[str, float] = {}
        wrong = []
        sample = ids[:: max(1, n // 4096)]
        sample_want = want[:: max(1, n // 4096)].cpu()
        for name, fn in variants.items():
            table.index_fill_(0, sample, 0.0)  # clear the sampled rows, then write them
            got[name] = timed(fn)
            torch.cuda.synchronize()
            seen = host[: rows_total * width].view(rows_total, width)[sample.cpu()]
            if not torch.equal(seen, sample_want):
                wrong.append(name)
        key = f"{width * 4}B/{gb}GB/{n}" + ("/head" if spread == "head" else "")
        results[key] = {
            "ms": {k: round(v, 3) for k, v in got.items()},
            "table_per_id_KB": (gb << 30) // n >> 10,
            "memcpy_ms": round(n * width * 4 / 55.3e6, 3),
            "wrong": wrong,
        }
        print(key, results[key], flush=True)
    with open(path, "w") as f:
        json.dump(
            {"probe": "scatter_order", "mode": mode, "gb": GB, "results": results}, f, indent=1
        )


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit(
            "this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine"
        )
    main(*sys.argv[1:3])
