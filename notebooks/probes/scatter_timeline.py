"""Session 27 probe: where the seed scatter's time per call goes (131,072 distinct random
CUDA ids and CUDA rows into the 1M x 512 B pinned table), against SpeedTorch's write (CuPy's
fancy assignment into the mapped table) and torch's zero-copy ``index_copy_``.

Part 1, per call as ``gadgetloader bench`` times (``time_fn``), alternating, 9 rounds:
``insertData`` checked and unchecked, the engine's ``slot_scatter`` alone (checked),
the scatter kernel alone (mode 0: no merge, no check), CuPy's assignment, ``index_copy_``.
Part 2, a timeline of ``insertData``: its inner calls wrapped to stamp the host clock on entry
and exit and to record a CUDA event on exit; medians of 40 calls on an idle GPU.
Usage: python notebooks/probes/scatter_timeline.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
from _seed_setup import ROWS, N, dev, g, rows, uids, view

import gadgetloader.gadget as gadget_module
from gadgetloader import _device
from gadgetloader.bench._common import time_fn
from gadgetloader.transfer import _engine, _kernels

cp = _device.get_cupy("probe")
table_cp = cp.from_dlpack(view)
ids_cp = cp.from_dlpack(uids)
rows_cp = cp.from_dlpack(rows)


def cupy_assign() -> None:
    with cp.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream):
        table_cp[ids_cp] = rows_cp


variants = {
    "insertData": lambda: g.insertData(rows, uids),
    "insertData unchecked": lambda: g.insertData(rows, uids, check_ids=False),
    "slot_scatter (checked)": lambda: _engine.slot_scatter(view, uids, rows, check=True),
    "kernel alone (mode 0)": lambda: _kernels.launch_scatter(view, uids, rows),
    "cupy assignment": cupy_assign,
    "torch index_copy_": lambda: view.index_copy_(0, uids, rows),
}
for name, fn in variants.items():
    view.zero_()
    fn()
    torch.cuda.synchronize()
    assert torch.equal(view[uids], rows), name
per: dict[str, list[float]] = {k: [] for k in variants}
for _ in range(9):
    for name, fn in variants.items():
        per[name].append(time_fn(fn)["ms"])
part1 = {k: statistics.median(v) for k, v in per.items()}
print(json.dumps(part1), flush=True)

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


DataGadget = type(g)
for meth in ("_insert_args", "_slot_write"):
    wrap(DataGadget, meth, False)
wrap(_engine, "slot_scatter", True)
wrap(_kernels, "launch_last_slots", True)
wrap(_kernels, "_memset_async", True)
wrap(_kernels, "_launch", True)
wrap(_engine, "read_flag", False)
assert gadget_module is not None

host: dict[str, list[float]] = {}
gpu: dict[str, list[float]] = {}
for rep in range(45):
    torch.cuda.synchronize()
    marks.clear()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    g.insertData(rows, uids)
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
assert torch.equal(view[uids], rows)
print(N, ROWS)
with open(sys.argv[1], "w") as f:
    json.dump(
        {"probe": "scatter_timeline", "per_call_ms": part1, "timeline": timeline}, f, indent=1
    )
