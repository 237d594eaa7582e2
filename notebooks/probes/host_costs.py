"""Session 27 probe: what single host operations on the gather and scatter paths cost on a
host that has just waited ~1.5 ms for the GPU (as in one call of ``gadgetloader bench``),
against the same operation back to back. Each: ``torch.cuda._sleep`` then a
synchronisation, then the operation timed by ``perf_counter``; median of 300.
Usage: python notebooks/probes/host_costs.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

from gadgetloader import _device
from gadgetloader._device import pinned_empty
from gadgetloader.transfer import _kernels

cp = _device.get_cupy("probe")
dev = torch.device("cuda", 0)
N = 131_072
ids = torch.randint(0, 1_000_000, (N,))
ring = pinned_empty(N, torch.int64)
ring.copy_(ids)
dst = torch.empty(N, dtype=torch.int64, device=dev)
ev = torch.cuda.Event()
ev.record()
raw = torch._C._cuda_getCurrentRawStream(0)  # type: ignore[attr-defined]
slot = torch.empty(1_000_001, dtype=torch.int32, device=dev)
_kernels.launch_gather_slots(dst, slot[:-1])  # compiles and prepares the launch path
torch.cuda.synchronize()

ops: dict[str, Callable[[], Any]] = {
    "nothing": lambda: None,
    "ids.is_pinned()": lambda: ids.is_pinned(),
    "event.synchronize() (done)": lambda: ev.synchronize(),
    "ring[:n].view(shape)": lambda: ring[:N].view(ids.shape),
    "ring.copy_(ids) (1 MB)": lambda: ring.copy_(ids),
    "ring.to(cuda, non_blocking)": lambda: ring.to(dev, non_blocking=True),
    "torch.empty 1 MB on cuda": lambda: torch.empty(N, dtype=torch.int64, device=dev),
    "cudaMemcpyAsync via CuPy (1 MB)": lambda: cp.cuda.runtime.memcpyAsync(
        dst.data_ptr(), ring.data_ptr(), N * 8, 1, raw
    ),
    "dst.copy_(ring, non_blocking)": lambda: dst.copy_(ring, non_blocking=True),
    "torch.cuda.Event() + record": lambda: torch.cuda.Event().record(),
    "stream.record_event()": lambda: torch.cuda.current_stream(dev).record_event(),
    "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "torch.empty slots (4 MB)": lambda: torch.empty(1_000_001, dtype=torch.int32, device=dev),
    "memsetAsync 4 B (CuPy runtime)": lambda: _kernels._memset_async(
        slot.data_ptr() + 4_000_000, 4, dev
    ),
    "launch_gather_slots (one launch)": lambda: _kernels.launch_gather_slots(dst, slot[:-1]),
    "aminmax (CPU, 131,072)": lambda: torch.aminmax(ids),
}
cold: dict[str, list[float]] = {k: [] for k in ops}
for _ in range(300):
    for name, fn in ops.items():
        torch.cuda._sleep(2_500_000)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        cold[name].append((time.perf_counter() - t0) * 1e6)
torch.cuda.synchronize()
warm = {k: min(timeit.repeat(fn, number=200, repeat=5)) / 200 * 1e6 for k, fn in ops.items()}
torch.cuda.synchronize()
result = {
    k: {
        "after a GPU wait, us": round(statistics.median(cold[k]), 2),
        "back to back, us": round(warm[k], 2),
    }
    for k in ops
}
print(json.dumps(result, indent=1), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump({"probe": "host_costs", "results": result}, f, indent=1)
