"""Session 27 probe: where the CPU-id gather's extra time per call goes (the seed request:
131,072 uniform int64 ids in pageable memory, 1M x 512 B pinned table), against the same
gather given CUDA ids unchecked.

Part 1, variants timed as ``gadgetloader bench`` times (``time_fn``: CUDA events around one
call on an idle GPU, median of 20), alternating, 7 rounds:
  cpu ids            ``getData(ids)`` (the library)
  pinned cpu ids     ``getData(ids_pinned)``: the ids already page-locked (no staging copy)
  upload + unchecked ``ids_pinned.to(cuda, non_blocking)`` then ``getData(check_ids=False)``
  ring + unchecked   ``_ids._upload(ids)`` then ``getData(check_ids=False)`` then the CPU check
  cuda unchecked     ``getData(cids, check_ids=False)``
  cpu ids, 1 thread  ``getData(ids)`` under ``torch.set_num_threads(1)``
Part 2, a timeline of ``getData(ids)``: the library's inner calls wrapped to stamp the host
clock on entry and exit and to record a CUDA event on exit; per call (GPU idle before), the
host microseconds from the start event's record to each stamp and the GPU microseconds
from the start event to each event, medians of 40 calls.
Usage: python notebooks/probes/cpu_ids_timeline.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

import gadgetloader._ids as ids_module
import gadgetloader.gadget as gadget_module
from gadgetloader import DataGadget
from gadgetloader.bench._common import time_fn
from gadgetloader.transfer import _kernels

dev = torch.device("cuda", 0)
ROWS, W, N = 1_000_000, 128, 131_072
gen = torch.Generator().manual_seed(0)
g = DataGadget(torch.randn(ROWS, W, generator=gen), placement="pinned")
ids = torch.randint(0, ROWS, (N,), generator=gen)
ids_pinned = ids.pin_memory()
cids = ids.to(dev)
out = torch.empty(N, W, device=dev)
want = torch.index_select(g.as_tensor(), 0, cids)
threads = torch.get_num_threads()


def one_thread() -> None:
    torch.set_num_threads(1)
    try:
        g.getData(ids, out=out)
    finally:
        torch.set_num_threads(threads)


def ring_unchecked() -> None:
    up = ids_module._upload(ids, dev)
    g.getData(up, out=out, check_ids=False)
    ids_module.check_range(ids, ROWS)


variants = {
    "cpu ids": lambda: g.getData(ids, out=out),
    "pinned cpu ids": lambda: g.getData(ids_pinned, out=out),
    "upload + unchecked": lambda: g.getData(
        ids_pinned.to(dev, non_blocking=True), out=out, check_ids=False
    ),
    "ring + unchecked": ring_unchecked,
    "cuda unchecked": lambda: g.getData(cids, out=out, check_ids=False),
    "cpu ids, 1 thread": one_thread,
}
for name, fn in variants.items():
    out.zero_()
    fn()
    torch.cuda.synchronize()
    assert torch.equal(out, want), name
per: dict[str, list[float]] = {k: [] for k in variants}
for _ in range(7):
    for name, fn in variants.items():
        per[name].append(time_fn(fn)["ms"])
part1 = {k: statistics.median(v) for k, v in per.items()}
print(json.dumps(part1), flush=True)

# ---- part 2: the timeline ----------------------------------------------------------------
marks: list[tuple[str, float, Any]] = []


def wrap(module: Any, name: str, event: bool) -> None:
    real = getattr(module, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        marks.append((f"{name} in", time.perf_counter(), None))
        r = real(*a, **k)
        ev = torch.cuda.current_stream(dev).record_event(torch.cuda.Event(enable_timing=True))
        marks.append((f"{name} out", time.perf_counter(), ev if event else None))
        return r

    setattr(module, name, wrapped)


wrap(gadget_module, "int64_ids", False)
wrap(ids_module, "_upload", True)  # (checked_after calls it by module name)
wrap(gadget_module, "checked_after", True)
wrap(_kernels, "launch_gather_slots", True)
wrap(_kernels, "_launch", True)
wrap(ids_module, "check_range", False)

host: dict[str, list[float]] = {}
gpu: dict[str, list[float]] = {}
for rep in range(45):
    torch.cuda.synchronize()
    marks.clear()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    g.getData(ids, out=out)
    t1 = time.perf_counter()
    end.record()
    end.synchronize()
    if rep < 5:
        continue
    seen: dict[str, int] = {}
    for label, t, ev in [*marks, ("return", t1, end)]:
        k = seen.get(label, 0)
        seen[label] = k + 1
        key = f"{label} #{k}" if k else label
        host.setdefault(key, []).append((t - t0) * 1e6)
        if ev is not None:
            gpu.setdefault(key, []).append(start.elapsed_time(ev) * 1e3)
timeline = [
    {
        "step": k,
        "host_us": round(statistics.median(v), 1),
        "gpu_us": round(statistics.median(gpu[k]), 1) if k in gpu else None,
    }
    for k, v in host.items()
]
for row in timeline:
    print(json.dumps(row), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(
        {
            "probe": "cpu_ids_timeline",
            "torch_threads": threads,
            "per_call_ms": part1,
            "timeline": timeline,
        },
        f,
        indent=1,
    )
