"""Session 22 probe: where the seed gather's time goes beyond its kernel.

The seed benchmark (1M x 128 float32 pinned table, 131,072 random ids) times each call
from a CUDA event recorded before it to one recorded after it, so host work done before
the kernel starts counts. This probe times, interleaved (each repeat runs every variant
once), the public ``getData`` with CPU (torch and NumPy) and CUDA ids, with and without
the range check, torch's zero-copy ``index_select`` and the bare row-kernel launch; the
host-side pieces of the CPU-id path alone (range check, copy into the pinned ring,
upload, launch); the GPU sort; and a cProfile of the CPU-id and CUDA-id calls, plus
torch.profiler's GPU-time table. Usage: python notebooks/probes/seed_path.py OUT.json
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine")

from gadgetloader import DataGadget
from gadgetloader._device import pinned_empty
from gadgetloader._ids import _upload, as_ids, check_range, int64_ids, start_range_check
from gadgetloader.transfer import _engine, _kernels

dev = torch.device("cuda", 0)
ROWS, W, N = 1_000_000, 128, 131_072
REPS = 41

gen = torch.Generator().manual_seed(0)
host = torch.randn(ROWS, W, generator=gen)
g = DataGadget(host, placement="pinned")
view = g.as_tensor()
ids_cpu = torch.randint(0, ROWS, (N,), generator=gen)
ids_np = ids_cpu.numpy()
ids = ids_cpu.to(dev)
out = torch.empty(N, W, device=dev)
ref = host[ids_cpu].to(dev)
ring = pinned_empty(N, torch.int64)
ids_dev_buf = torch.empty(N, dtype=torch.int64, device=dev)


def event_ms(fn) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def host_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3


store = g._store


def old_cpu_ids() -> None:  # session 21's order for CPU ids: check, upload, then gather
    store.gather(as_ids(ids_cpu, ROWS, dev), dev, out=out)


def old_cuda_ids() -> None:  # CUDA ids through the store: queue the check, gather, wait
    t = as_ids(ids, ROWS, dev, check=False)
    finish = start_range_check(t, ROWS)
    store.gather(t, dev, out=out)
    finish()


variants = {
    "as_ids then Store.gather, CPU ids": old_cpu_ids,
    "start_range_check + Store.gather, CUDA ids": old_cuda_ids,
    "getData CPU ids (torch)": lambda: g.getData(ids_cpu, out=out),
    "getData CPU ids (NumPy)": lambda: g.getData(ids_np, out=out),
    "getData CUDA ids": lambda: g.getData(ids, out=out),
    "getData CUDA ids, check_ids=False": lambda: g.getData(ids, out=out, check_ids=False),
    "engine gather, kernel": lambda: _engine.gather(view, ids, out, "kernel"),
    "engine gather, sorted": lambda: _engine.gather(view, ids, out, "sorted"),
    "launch_gather only": lambda: _kernels.launch_gather(view, ids, out),
    "torch index_select": lambda: torch.index_select(view, 0, ids, out=out),
}
pieces = {
    "torch.aminmax CPU ids": lambda: torch.aminmax(ids_cpu),
    "check_range CPU ids": lambda: check_range(ids_cpu, ROWS),
    "NumPy min+max": lambda: (ids_np.min(), ids_np.max()),
    "copy into pinned ring": lambda: ring.copy_(ids_cpu),
    "ring copy + H2D": lambda: ids_dev_buf.copy_(ring.copy_(ids_cpu), non_blocking=True),
    "as_ids CPU ids -> cuda": lambda: as_ids(ids_cpu, ROWS, dev),
    "as_ids NumPy ids -> cuda": lambda: as_ids(ids_np, ROWS, dev),
    "int64_ids CPU ids": lambda: int64_ids(ids_cpu, ROWS, dev),
    "_upload CPU ids": lambda: _upload(ids_cpu, dev),
    "is_pinned": lambda: ids_cpu.is_pinned(),
    "torch.cuda.Event()": lambda: torch.cuda.Event(),
    "current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "current_stream().record_event()": lambda: torch.cuda.current_stream().record_event(),
    "_kernel_plan": lambda: g._kernel_plan(dev, N),
    "torch.empty 1 MB cuda": lambda: torch.empty(N, dtype=torch.int64, device=dev),
    "torch.sort CUDA ids": lambda: torch.sort(ids),
    "torch.sort CUDA ids int32": lambda: torch.sort(ids.to(torch.int32)),
}

for fn in variants.values():  # warm-up, and every variant gives the right rows
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    out.zero_()
for fn in pieces.values():
    for _ in range(3):
        fn()

res: dict[str, dict[str, list[float]]] = {k: {"event": [], "host": []} for k in variants}
pres: dict[str, dict[str, list[float]]] = {k: {"event": [], "host": []} for k in pieces}
for _ in range(REPS):
    for name, fn in variants.items():
        res[name]["event"].append(event_ms(fn))
        res[name]["host"].append(host_ms(fn))
    for name, fn in pieces.items():
        pres[name]["event"].append(event_ms(fn))
        pres[name]["host"].append(host_ms(fn))


def summary(d: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {
        k: {
            "event_ms": statistics.median(v["event"]),
            "event_min_ms": min(v["event"]),
            "host_ms": statistics.median(v["host"]),
        }
        for k, v in d.items()
    }


text = io.StringIO()
for name in ("getData CPU ids (torch)", "getData CUDA ids"):
    fn = variants[name]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fn()
        torch.cuda.synchronize()
    prof.disable()
    text.write(f"==== cProfile: {name}, 200 calls (each followed by a synchronize)\n")
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(40)

for name in ("getData CPU ids (torch)", "getData CUDA ids"):
    fn = variants[name]
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as p:
        for _ in range(10):
            fn()
            torch.cuda.synchronize()
    text.write(f"==== torch.profiler: {name}, 10 calls\n")
    text.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    text.write("\n")

result = {
    "probe": "seed_path",
    "device": torch.cuda.get_device_name(),
    "rows": ROWS,
    "width": W,
    "ids": N,
    "repeats": REPS,
    "variants": summary(res),
    "pieces": summary(pres),
}
path = sys.argv[1]
with open(path, "w") as f:
    json.dump(result, f, indent=1)
with open(path.replace(".json", ".txt"), "w") as f:
    f.write(text.getvalue())
for k, v in result["variants"].items():
    print(
        f"{k:40s} event {v['event_ms']:.3f} ms (min {v['event_min_ms']:.3f})  host {v['host_ms']:.3f}"
    )
for k, v in result["pieces"].items():
    print(f"{k:40s} event {v['event_ms']:.3f} ms  host {v['host_ms']:.3f}")
