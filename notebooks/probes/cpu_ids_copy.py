"""Session 27 probe: the copy of CPU ids into the page-locked upload ring, the largest
host cost of ``getData`` with CPU ids per call (``cpu_ids_timeline.py``: ~150 us of the
call's host time before the GPU starts, where the same ``copy_`` back to back takes ~15 us).

Hypothesis: torch's ``copy_`` of 131,072 int64 ids runs on its intra-op thread pool, whose
threads fall asleep while the host waits on the GPU between calls, and waking them costs
more than one thread's copy of 1 MB. Variants of the ring's copy (the library's
``_ids._upload`` with only the copy changed), A/B inside one process:
  torch copy_   the library now
  np.copyto     NumPy's copy (one thread)
  memmove       ``ctypes.memmove`` of the bytes (one thread; contiguous int64 ids)
Each: (1) ``getData(ids)`` per call as ``gadgetloader bench`` times (``time_fn``),
alternating, 9 rounds; (2) the copy alone, host microseconds, after the GPU has kept the
host waiting ~1.5 ms (a ``torch.cuda._sleep``), median of 200.
Also the host microseconds of ``getData``'s steps before the upload, back to back.
Usage: python notebooks/probes/cpu_ids_copy.py OUT.json
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable

import numpy as np
import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

import gadgetloader._ids as ids_module
from gadgetloader import DataGadget
from gadgetloader._device import pinned_empty
from gadgetloader.bench._common import time_fn

dev = torch.device("cuda", 0)
ROWS, W, N = 1_000_000, 128, 131_072
gen = torch.Generator().manual_seed(0)
g = DataGadget(torch.randn(ROWS, W, generator=gen), placement="pinned")
ids = torch.randint(0, ROWS, (N,), generator=gen)
cids = ids.to(dev)
out = torch.empty(N, W, device=dev)
want = torch.index_select(g.as_tensor(), 0, cids)
library_upload = ids_module._upload


def torch_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def np_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    np.copyto(dst.numpy(), src.numpy())


def memmove(dst: torch.Tensor, src: torch.Tensor) -> None:
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


COPIES: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "torch copy_": torch_copy,
    "np.copyto": np_copy,
    "memmove": memmove,
}
rings = {name: [pinned_empty(N, torch.int64), pinned_empty(N, torch.int64)] for name in COPIES}
events: dict[str, list[object]] = {name: [None, None] for name in COPIES}
turn = {name: 0 for name in COPIES}


def make_upload(name: str) -> Callable[[torch.Tensor, torch.device], torch.Tensor]:
    copy = COPIES[name]

    def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        i = turn[name]
        turn[name] ^= 1
        ev = events[name][i]
        if ev is not None:
            ev.synchronize()  # type: ignore[attr-defined]
        staged = rings[name][i][: t.numel()].view(t.shape)
        copy(staged, t)
        up = staged.to(device, non_blocking=True)
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(device))
        events[name][i] = e
        return up

    return upload


uploads = {name: make_upload(name) for name in COPIES}


def call(name: str) -> Callable[[], object]:
    def fn() -> object:
        ids_module._upload = uploads[name]
        try:
            return g.getData(ids, out=out)
        finally:
            ids_module._upload = library_upload

    return fn


for name in COPIES:
    out.zero_()
    call(name)()
    torch.cuda.synchronize()
    assert torch.equal(out, want), name
per: dict[str, list[float]] = {k: [] for k in COPIES}
for _ in range(9):
    for name in COPIES:
        per[name].append(time_fn(call(name))["ms"])
result: dict[str, object] = {
    "torch threads": torch.get_num_threads(),
    "per call (events), getData CPU ids": {k: statistics.median(v) for k, v in per.items()},
}
per["library"] = []
for _ in range(9):
    per["library"].append(time_fn(lambda: g.getData(ids, out=out))["ms"])
result["per call (events), getData CPU ids, library"] = statistics.median(per["library"])

cold: dict[str, list[float]] = {k: [] for k in COPIES}
for _ in range(200):
    for name, copy in COPIES.items():
        torch.cuda._sleep(2_500_000)  # ~1.5 ms of GPU time for the host to wait on
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy(rings[name][0], ids)
        cold[name].append((time.perf_counter() - t0) * 1e6)
result["copy alone after a GPU wait, host us"] = {k: statistics.median(v) for k, v in cold.items()}
for name in COPIES:
    assert torch.equal(rings[name][0], ids), name

steps = {
    "check_open": lambda: g._store.check_open(),
    "_split_index": lambda: g._split_index(ids),
    "_delivery_device": lambda: g._delivery_device(None),
    "ids_device": lambda: g._store.ids_device(dev),
    "hybrid_for": lambda: g._store.hybrid_for(dev, N, g._strategy),
    "int64_ids": lambda: ids_module.int64_ids(ids, ROWS, dev),
    "_kernel_plan": lambda: g._kernel_plan(dev, N),
    "new_empty": lambda: out.new_empty(N, W),
    "check_range (CPU)": lambda: ids_module.check_range(ids, ROWS),
}
result["steps back to back, host us"] = {
    k: min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6 for k, fn in steps.items()
}
print(json.dumps(result, indent=1), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump({"probe": "cpu_ids_copy", "results": result}, f, indent=1)
