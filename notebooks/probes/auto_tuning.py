"""``auto`` against forced ``hybrid`` and ``sorted`` on sparse requests to huge pinned tables.

Run on a CUDA machine from the repository root (needs ~40 GB of pinnable host RAM)::

    python notebooks/probes/auto_tuning.py OUT.json

Per table: the first ``auto`` call (which measures both strategies once, see
``DESIGN.md``), then medians of 10 calls (ms, wall clock to the GPU's end, ids on the GPU)
for each strategy, and which one ``auto`` kept.
"""

from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import json
import sys
import time

import numpy as np
import torch

import gadgetloader as gl
from gadgetloader.transfer import _engine


def wall_ms(fn: object, reps: int = 10) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(float(np.median(times)), 3)


def main() -> None:
    results = {}
    for gb in (8, 32):
        rows = (gb << 30) // 512
        g = gl.DataGadget((rows, 128), dtype="float32", placement="pinned")
        ids = torch.randint(0, rows, (131072,), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        g.getData(ids, check_ids=False)
        torch.cuda.synchronize()
        r = {"first_auto_ms": round((time.perf_counter() - start) * 1e3, 3)}
        for strategy in ("hybrid", "sorted", "kernel", "torch"):
            g._strategy = strategy  # as DataGadget(..., strategy=...) sets it
            r[strategy] = wall_ms(lambda g=g, ids=ids: g.getData(ids, check_ids=False))
        g._strategy = "auto"
        r["auto"] = wall_ms(lambda g=g, ids=ids: g.getData(ids, check_ids=False))
        r["kept"] = [v for k, v in _engine._TUNED.items() if k[1] == (rows * 512).bit_length()]
        results[f"{gb} GB / 131072"] = r
        print(gb, "GB", r, flush=True)
        g.close()
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
