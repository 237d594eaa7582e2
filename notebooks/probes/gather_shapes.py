"""Launch shapes of the row kernel's gather against torch's zero-copy ``index_select``.

Run on a CUDA machine from the repository root (the large tables need ~32 GB of
pinnable host RAM)::

    python notebooks/probes/gather_shapes.py OUT.json [--large]

Each figure is the median of CUDA-event timings (ms) of one call, the GPU synchronised
between calls. ``b{m}``: the grid capped at ``m`` blocks per SM (the row kernel's default
is 16); ``v{w}``: vectors of at most ``w`` bytes; ``u{k}``: loads in flight per thread.
Session 9's results: ``notebooks/results/h200-gather-shapes*-session9.json`` (written by an
earlier form of this script: their keys ``kernel_b*`` / ``g_b*`` are ``b*`` here and
``s_b*`` is ``scatter_b*``; the large tables' ids were distinct there too; the first file
also has an 8 GB / 131,072-id case and the second ``torch_index_copy``, and that form took
25 calls a figure for the small tables).
"""

from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import json
import sys
from collections.abc import Callable

import numpy as np
import torch

import gadgetloader as gl
from gadgetloader.transfer import _kernels as kernels


def timed(fn: Callable[[], object], reps: int = 15) -> float:
    for _ in range(2):
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
    return round(float(np.median(times)), 3)


def probe(rows: int, width: int, n_ids: int, distinct: bool) -> dict[str, float]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = gl.DataGadget((rows, width), dtype="float32", placement="pinned")
    table = g.as_tensor()
    ids = torch.randint(0, rows, (n_ids,), device="cuda")
    if distinct:
        ids = ids.unique()  # sorted, as a training step's row plan
    sorted_ids = ids.sort().values
    out = torch.empty(ids.numel(), width, device="cuda")
    src = torch.randn(ids.numel(), width, device="cuda")
    r = {
        "torch_index_select": timed(lambda: torch.index_select(table, 0, ids, out=out)),
        "torch_index_select_sorted": timed(
            lambda: torch.index_select(table, 0, sorted_ids, out=out)
        ),
        "getData": timed(lambda: g.getData(ids)),
        "getData_unchecked": timed(lambda: g.getData(ids, check_ids=False)),
    }
    default = kernels._max_blocks
    try:
        for m in (1, 2, 4, 8, 16):
            kernels._max_blocks = lambda idx, m=m: sms * m  # type: ignore[assignment]
            for w in (16, 8, 4):
                r[f"b{m}_v{w}"] = timed(
                    lambda w=w: kernels.launch_gather(table, ids, out, max_vector=w)
                )
            r[f"b{m}_v16_sorted"] = timed(lambda: kernels.launch_gather(table, sorted_ids, out))
            for k in (2, 4):
                r[f"b{m}_v16_u{k}"] = timed(
                    lambda k=k: kernels.launch_gather(table, ids, out, unroll=k)
                )
            if distinct:
                r[f"scatter_b{m}"] = timed(
                    lambda: kernels.launch_scatter(table, ids, src, mode=kernels.SCATTER_ALL)
                )
    finally:
        kernels._max_blocks = default
    g.close()
    return r


def main() -> None:
    cases = [(1 << 20, 128, 131072, False), (1 << 20, 128, 1 << 20, False)]
    if "--large" in sys.argv:
        cases = [
            (16 << 20, 128, 131072, True),
            (10_000_000, 384, 21_000, True),
            (64 << 20, 128, 131072, True),
        ]
    results = {}
    for rows, width, n_ids, distinct in cases:
        key = f"{rows}x{width * 4}B/{n_ids}{' distinct' if distinct else ''}"
        results[key] = probe(rows, width, n_ids, distinct)
        print(key, results[key], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
