# ruff: noqa: B023  (every closure runs within its own loop iteration)
"""Session 13 probe: how CPU ids reach a pinned table's transfer, on huge tables.

Times, interleaved (each repeat runs every variant once, so a drifting host affects all
alike), per call with a synchronisation as ``bench sweep`` times: the engine's ``auto``
with CPU ids uploaded by a pageable copy (the old path) or through the pinned ring (the
new one), the engine's ``hybrid`` and ``sorted`` strategies, and the public
``DataGadget.getData`` with CPU and CUDA ids. Smaller tables are the first rows of one
64 GB table. Usage: python notebooks/probes/ids_paths.py OUT.json
"""

from __future__ import annotations

import gc
import json
import statistics
import sys

import torch
if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine")

from gadgetloader.gadget import DataGadget
from gadgetloader.stores._pinned import PinnedStore
from gadgetloader.transfer import _engine

dev = torch.device("cuda")
W = 128
REPS = 15


def old_ids_on(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    return flat.contiguous() if flat.device == device else flat.to(device).contiguous()


new_ids_on = _engine._ids_on


def lat(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    results = []
    for size in (4, 16, 64):
        rows = int(size * 1e9) // (4 * W)
        store = PinnedStore((rows, W), torch.float32, dev)
        g = DataGadget._of_store(store, device=dev)
        dv, hv = store.device_view(), store.host_view()
        dv.uniform_(-1, 1)
        torch.cuda.synchronize()
        for n in (131072, 1 << 20):
            ids_cpu = torch.randint(0, rows, (n,), generator=gen)
            ids_gpu = ids_cpu.to(dev)
            out = torch.empty(n, W, device=dev)
            want = hv[ids_cpu[:4096]].to(dev)

            def eng(strategy, ids, patch=None):
                def fn():
                    if patch is not None:
                        _engine._ids_on = patch
                    try:
                        _engine.gather(dv, ids, out=out, strategy=strategy, host=hv)
                    finally:
                        _engine._ids_on = new_ids_on

                return fn

            def old_routing():
                store.hybrid_for = lambda *a, **k: False  # CPU ids always uploaded first
                try:
                    g.getData(ids_cpu, out=out)
                finally:
                    del store.hybrid_for

            variants = {
                "engine auto, CPU ids, pageable upload": eng("auto", ids_cpu, old_ids_on),
                "engine auto, CPU ids, pinned ring": eng("auto", ids_cpu),
                "engine hybrid, CPU ids": eng("hybrid", ids_cpu),
                "engine sorted, CUDA ids": eng("sorted", ids_gpu),
                "getData, CPU ids (uploaded first: session 12)": old_routing,
                "getData, CPU ids (kept for hybrid: session 13)": lambda: g.getData(
                    ids_cpu, out=out
                ),
                "getData, CUDA ids": lambda: g.getData(ids_gpu, out=out),
            }
            times = {k: [] for k in variants}
            checks = {}
            for name, fn in variants.items():  # warm-up (auto's one-off trial) and check
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                checks[name] = bool(torch.equal(out[:4096], want))
                out.zero_()
            for _ in range(REPS):
                for name, fn in variants.items():
                    times[name].append(lat(fn))
            nbytes = n * W * 4
            for name in variants:
                ms = statistics.median(times[name])
                entry = {
                    "table_GB": size,
                    "ids": n,
                    "variant": name,
                    "ms": round(ms, 4),
                    "GBps": round(nbytes / ms / 1e6, 2),
                    "ok": checks[name],
                }
                results.append(entry)
                print(
                    f"{size:>3} GB {n:>8} {name:<48} {ms:8.3f} ms {entry['GBps']:6.1f} GB/s "
                    f"ok={entry['ok']}",
                    flush=True,
                )
        tuned = {str(k): v for k, v in _engine._TUNED.items()}
        results.append({"table_GB": size, "auto_choices": tuned})
        print(f"{size} GB auto choices: {tuned}", flush=True)
        g.close()
        dv = hv = out = want = None  # the views keep the memory until they go
        gc.collect()
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
