"""Launch shapes of sorted gathers and scatters of narrow to 1 KB rows (session 20).

Run on a CUDA machine from the repository root (needs 32 GB of pinnable host RAM)::

    python notebooks/probes/sparse_shapes.py OUT.json

One 32 GB pinned table seen with rows of 32 B to 1 KB; for each, random ids at 32 KB,
256 KB and 1 MB of table per id, sorted (``pos`` un-permutes, as the ``sorted`` strategy
does), and two requests whose ids cluster (the table's bytes per id says sparse, the ids
are dense): all ids in the first 1/32 of the table, and a dense head of 60% of the ids with
a sparse tail. Each figure is the median of two rounds of a median of 7 CUDA-event timings
(ms). ``d``: the default grid; ``rule``: ``ordered=True`` (``_kernels.ordered_shape``);
``b1v{v}``: one block per SM with vectors of at most ``v`` bytes; ``torch``: torch's
zero-copy ``index_select``; ``s_*``: scatters of the distinct ids.

Session 20's results: ``notebooks/results/h200-sparse-shapes-session20.json``, measured with
the build of commit 3e23f4a, in which the kernel itself judged the ids' spread and picked a
sparse shape (its ``dev{v}`` variants; ``verdict``: whether it took the ids as sparse;
``...20a.json`` and ``...20b.json``: two earlier forms of that build, the first in one
launch whose surplus blocks returned, the second with the sparse shape run inside the wide
kernel); that build was not adopted. ``...20c.json``: this probe with the adopted build, commit
259c5cb (DESIGN.md, "Launch shape for sparse ascending requests").
"""

from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import gadgetloader as gl
from gadgetloader.transfer import _kernels as kernels

GB = 32
VECTORS = (8, 4, 2, 1)


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


def case(table: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    rows, width = table.shape
    row_bytes = width * 4
    n = ids.numel()
    sorted_ids, perm = torch.sort(ids)
    distinct = torch.unique(ids)
    out = torch.empty(n, width, device="cuda")
    src = torch.randn(distinct.numel(), width, device="cuda")

    def gather(**kw: Any) -> Callable[[], None]:
        return lambda: kernels.launch_gather(table, sorted_ids, out, pos=perm, **kw)

    def scatter(**kw: Any) -> Callable[[], None]:
        return lambda: kernels.launch_scatter(table, distinct, src, mode=kernels.SCATTER_ALL, **kw)

    variants: dict[str, Callable[[], None]] = {
        "g_d": gather(),
        "g_rule": gather(ordered=True),
        **{f"g_b1v{v}": gather(blocks_per_sm=1, max_vector=v) for v in VECTORS},
        "g_torch": lambda: torch.index_select(table, 0, sorted_ids, out=out),
        "s_d": scatter(),
        "s_rule": scatter(ordered=True),
        "s_b1v8u1": scatter(blocks_per_sm=1, max_vector=8, unroll=1),
    }
    runs: dict[str, list[float]] = {}
    for _ in range(2):
        for name, fn in variants.items():
            runs.setdefault(name, []).append(timed(fn))
    gather(ordered=True)()
    same = torch.equal(out, torch.index_select(table, 0, ids))
    return {
        "rule": list(kernels.ordered_shape(row_bytes, GB << 30, n)),
        "median": {k: round(float(np.median(v)), 3) for k, v in runs.items()},
        "rounds": runs,
        "same": same,
        "memcpy_ms_gather": n * row_bytes / 55.3e6,
        "memcpy_ms_scatter": distinct.numel() * row_bytes / 55.3e6,
    }


def main() -> None:
    start = time.time()
    g = gl.DataGadget(((GB << 30) // 4,), dtype="float32", placement="pinned")
    flat = g.as_tensor()
    print(f"{GB} GB ready in {time.time() - start:.1f}s", flush=True)
    results: dict[str, Any] = {}
    mismatches = 0
    for width in (8, 16, 32, 64, 128, 256):
        table = flat.view(-1, width)
        rows = table.shape[0]
        for gap in (32 << 10, 256 << 10, 1 << 20):
            n = (GB << 30) // gap
            torch.manual_seed(width + gap)
            ids = torch.randint(0, rows, (n,), device="cuda")
            key = f"{width * 4}B/gap{gap >> 10}K/{n}"
            results[key] = r = case(table, ids)
            mismatches += not r["same"]
            print(key, r["rule"], r["median"], flush=True)
        if width in (32, 128):  # 128 B and 512 B rows: clustered ids
            n = 131_072
            torch.manual_seed(width)
            corner = torch.randint(0, rows // 32, (n,), device="cuda")
            head = torch.randint(0, rows // 512, (n * 6 // 10,), device="cuda")
            tail = torch.randint(0, rows, (n - head.numel(),), device="cuda")
            for name, ids in (("corner", corner), ("head+tail", torch.cat([head, tail]))):
                key = f"{width * 4}B/{name}/{n}"
                results[key] = r = case(table, ids)
                mismatches += not r["same"]
                print(key, r["rule"], r["median"], flush=True)
    print("mismatches:", mismatches, flush=True)
    g.close()
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
