"""Launch shapes of sorted gathers and scatters across row widths and sparsity.

Run on a CUDA machine from the repository root (needs 32 GB of pinnable host RAM)::

    python notebooks/probes/launch_shapes.py OUT.json

One 32 GB pinned table seen with rows of 128 B to 4 KB; for each, random ids at 32 KB,
64 KB, 256 KB and 1 MB of table per id, sorted (``pos`` un-permutes, as the ``sorted``
strategy does). Each figure is the median of three rounds of a median of 7 CUDA-event
timings (ms). ``d``: the default grid; ``rule``: ``ordered=True``
(``_kernels.ordered_shape``); ``b{m}v{w}``: ``m`` blocks per SM, vectors of at most
``w`` bytes; ``s_*``: scatters of the distinct ids (``rule_u1``: one row per thread per
pass). Session 10's results: ``notebooks/results/h200-launch-shapes-session10c.json``
(``...10a`` / ``...10b``: earlier probes of 512 B rows on 1-64 GB tables, shapes forced
by patching ``_max_blocks``).

Since session 21 ``ordered_shape`` may return ``IN_ORDER`` (0 blocks per SM: the in-order
launch) for narrow rows at up to 128 KB of table per id; this probe's ``b2rule`` variant
reads it as a grid shape, so there it would time two blocks per SM with 16-byte vectors.
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


def case(table: torch.Tensor, gap: int) -> tuple[dict[str, Any], bool]:
    rows, width = table.shape
    row_bytes = width * 4
    n = (GB << 30) // gap
    torch.manual_seed(width + gap)
    ids = torch.randint(0, rows, (n,), device="cuda")
    sorted_ids, perm = torch.sort(ids)
    distinct = torch.unique(ids)
    out = torch.empty(n, width, device="cuda")
    src = torch.randn(distinct.numel(), width, device="cuda")
    blocks, w = kernels.ordered_shape(row_bytes, GB << 30, n)
    wider, narrower = min(16, w * 2), max(1, w // 2)
    gathers: dict[str, dict[str, Any]] = {
        "d": {},
        "rule": {"ordered": True},
        f"b1v{wider}": {"blocks_per_sm": 1, "max_vector": wider},
        f"b1v{narrower}": {"blocks_per_sm": 1, "max_vector": narrower},
        "b2rule": {"blocks_per_sm": 2, "max_vector": w},
    }
    scatters: dict[str, dict[str, Any]] = {
        "d": {},
        "rule": {"ordered": True, "unroll": 4},
        "rule_u1": {"ordered": True},
        "b1v16": {"blocks_per_sm": 1},
        f"b1v{wider}": {"blocks_per_sm": 1, "max_vector": wider},
    }

    def gather(kw: dict[str, Any]) -> Callable[[], None]:
        return lambda: kernels.launch_gather(table, sorted_ids, out, pos=perm, **kw)

    def scatter(kw: dict[str, Any]) -> Callable[[], None]:
        return lambda: kernels.launch_scatter(table, distinct, src, kernels.SCATTER_ALL, **kw)

    runs: dict[str, list[float]] = {}
    for _ in range(3):
        for name, kw in gathers.items():
            runs.setdefault("g_" + name, []).append(timed(gather(kw)))
        runs.setdefault("g_torch", []).append(
            timed(lambda: torch.index_select(table, 0, sorted_ids, out=out))
        )
        for name, kw in scatters.items():
            runs.setdefault("s_" + name, []).append(timed(scatter(kw)))
    gather({"ordered": True})()
    same = torch.equal(out, torch.index_select(table, 0, ids))
    return {
        "rule": [blocks, w],
        "median": {k: round(float(np.median(v)), 3) for k, v in runs.items()},
        "rounds": runs,
        "memcpy_ms_gather": n * row_bytes / 55.3e6,
        "memcpy_ms_scatter": distinct.numel() * row_bytes / 55.3e6,
    }, same


def main() -> None:
    start = time.time()
    g = gl.DataGadget(((GB << 30) // 4,), dtype="float32", placement="pinned")
    flat = g.as_tensor()
    print(f"{GB} GB ready in {time.time() - start:.1f}s", flush=True)
    results, mismatches = {}, 0
    for width in (32, 64, 128, 256, 512, 1024):
        for gap in (32 << 10, 64 << 10, 256 << 10, 1 << 20):
            r, same = case(flat.view(-1, width), gap)
            mismatches += not same
            key = f"{width * 4}B/gap{gap >> 10}K/{(GB << 30) // gap}"
            results[key] = r
            print(key, r["rule"], r["median"], flush=True)
    print("mismatches:", mismatches, flush=True)
    g.close()
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
