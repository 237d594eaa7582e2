"""Session 26 probe: where the host time of ``getData`` with CPU ids goes (the seed
benchmark's request: 131,072 int64 ids in pageable memory, 1M x 512 B pinned table).

Host microseconds (``perf_counter``, median of 200 calls, the GPU idle before each call):
the copy of the ids into a page-locked buffer (torch ``copy_`` at the default and at one
intra-op thread, NumPy ``copyto``), the enqueue of the upload, the CPU range check, and the
whole ``getData`` call (CPU ids; CUDA ids checked and unchecked) up to its return. Then the
same calls timed as ``gadgetloader bench`` times them (CUDA events around one call), and the
CPU-id call with the ring's one-thread copy against torch's ``copy_`` (7 alternating rounds).
``--profile``: also a cProfile of 300 calls of each (synchronised after each call).
Usage: python notebooks/probes/cpu_ids_path.py OUT.json [--profile]
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

from gadgetloader import DataGadget, _ids
from gadgetloader._ids import check_range
from gadgetloader.bench._common import time_fn

dev = torch.device("cuda", 0)
ROWS, W, N = 1_000_000, 128, 131_072
gen = torch.Generator().manual_seed(0)
g = DataGadget(torch.randn(ROWS, W, generator=gen), placement="pinned")
ids = torch.randint(0, ROWS, (N,), generator=gen)
cids = ids.to(dev)
out = torch.empty(N, W, device=dev)
pinned = torch.empty(N, dtype=torch.int64, pin_memory=True)
pn, ids_np = pinned.numpy(), ids.numpy()


def host_us(fn: Callable[[], Any], reps: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


threads = torch.get_num_threads()
row: dict[str, Any] = {"torch threads": threads}
row["copy_ into pinned"] = host_us(lambda: pinned.copy_(ids))
torch.set_num_threads(1)
row["copy_ into pinned, 1 thread"] = host_us(lambda: pinned.copy_(ids))
torch.set_num_threads(threads)
row["np.copyto into pinned"] = host_us(lambda: np.copyto(pn, ids_np))
row["upload enqueue (pinned -> cuda)"] = host_us(lambda: pinned.to(dev, non_blocking=True))
row["check_range (CPU)"] = host_us(lambda: check_range(ids, ROWS))
row["aminmax (CPU)"] = host_us(lambda: torch.aminmax(ids))
calls = {
    "getData CPU ids": lambda: g.getData(ids, out=out),
    "getData CUDA ids": lambda: g.getData(cids, out=out),
    "getData CUDA ids unchecked": lambda: g.getData(cids, out=out, check_ids=False),
}
for name, fn in calls.items():
    row[f"host: {name}"] = host_us(fn)
for name, fn in calls.items():
    row[f"per call (events): {name}"] = statistics.median(time_fn(fn)["ms"] for _ in range(5))
# A/B of a one-thread copy into the ring (_ids.SERIAL_COPY_MAX; 0 = torch's parallel copy_):
# measured in session 26 with that constant in the working tree, rejected (DESIGN.md)
serial = getattr(_ids, "SERIAL_COPY_MAX", None)
if serial is not None:
    ab: dict[str, list[float]] = {"one-thread copy": [], "torch copy_": []}
    for _ in range(7):
        for name, limit in (("one-thread copy", serial), ("torch copy_", 0)):
            _ids.SERIAL_COPY_MAX = limit
            ab[name].append(time_fn(calls["getData CPU ids"])["ms"])
    _ids.SERIAL_COPY_MAX = serial
    for name, vals in ab.items():
        row[f"per call (events): getData CPU ids, {name}"] = statistics.median(vals)
if "--profile" in sys.argv:  # where each call's host time goes (cProfile, 300 calls each)
    for name, fn in calls.items():
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(300):
            fn()
            torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        row[f"profile: {name}"] = text.getvalue().splitlines()
        print(name, "\n".join(text.getvalue().splitlines()[:40]), sep="\n", flush=True)
print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump({"probe": "cpu_ids_path", "results": row}, f, indent=1)
