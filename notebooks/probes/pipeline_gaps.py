"""Where the sampler form's time goes: host time per batch and the GPU's idle gaps.

Run on a CUDA machine from the repository root::

    python notebooks/probes/pipeline_gaps.py OUT_DIR

The pipeline benchmark's table (1,048,576 x 128 float32, pinned, batch 4096), read three
ways: (c) ``DataLoader(ds, batch_sampler=GadgetSampler(ds))``, (e) ``ds.__getitems__`` per
sampler batch without DataLoader, (d) ``GadgetLoader``. For each: microseconds a batch
over 2048 batches (clock stopped after a synchronisation), the host time of each
``next()`` (mean, percentiles, the slowest with their place in the epoch), and, under
``torch.profiler``, the GPU's busy share and its largest idle gaps with the host
operations running when each gap began. Writes ``OUT_DIR/pipeline_gaps.json`` and one
Chrome trace per form.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine")
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

from gadgetloader import DataGadget, GadgetDataset, GadgetLoader, GadgetSampler
from gadgetloader.data import _dataset as dsmod

ROWS, WIDTH, B = 1 << 20, 128, 4096
PER_EPOCH = ROWS // B


def _labelled(cls: Any, name: str) -> None:
    """Wrap ``cls.name`` in a profiler range of the same name (probe only)."""
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        with record_function(f"gl::{cls.__name__}.{name}"):
            return fn(*a, **k)

    setattr(cls, name, wrapper)


def endless(make: Callable[[], Any]) -> Iterator[Any]:
    while True:
        yield from make()


def first(b: Any) -> torch.Tensor:
    return b[0] if isinstance(b, (tuple, list)) else b


def timed(stream: Iterator[Any], n: int) -> dict[str, Any]:
    host = []
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter()
        out = first(next(stream))
        host.append(time.perf_counter() - a)
        del out
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    us = [h * 1e6 for h in host]
    slow = sorted(range(n), key=lambda i: -us[i])[:16]
    q = statistics.quantiles(us, n=100)
    return {
        "us_per_batch": total / n * 1e6,
        "host_us_mean": statistics.fmean(us),
        "host_us_p50": q[49],
        "host_us_p90": q[89],
        "host_us_p99": q[98],
        "host_us_sum_share": sum(us) / (total * 1e6),
        "slowest": [(i, i % PER_EPOCH, round(us[i], 1)) for i in slow],
    }


def gaps(prof: Any, top: int = 12) -> dict[str, Any]:
    events = list(prof.events())
    gpu = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not gpu:
        return {"gpu_events": 0}
    busy, found = 0.0, []
    cur_s, cur_e = gpu[0][0], gpu[0][1]
    for s, e, _ in gpu[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            found.append((s - cur_e, cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = gpu[-1][1] - gpu[0][0]
    found.sort(reverse=True)
    out = []
    for length, g0, g1 in found[:top]:
        during = sorted(
            {e.name for e in cpu if e.time_range.start <= g0 <= e.time_range.end}
            | {e.name for e in cpu if g0 <= e.time_range.start <= g1}
        )
        out.append({"gap_us": round(length, 1), "host_ops": during[:30]})
    hist = [0, 0, 0, 0]
    for length, _, _ in found:
        hist[0 if length < 5 else 1 if length < 20 else 2 if length < 100 else 3] += 1
    total_gap = sum(f[0] for f in found)
    kernels: dict[str, list[float]] = {}
    for s, e, name in gpu:
        kernels.setdefault(name[:60], []).append(e - s)
    return {
        "gpu_events": len(gpu),
        "span_us": span,
        "busy_share": busy / span if span else None,
        "gap_us_total": total_gap,
        "gaps_lt5_lt20_lt100_ge100": hist,
        "largest": out,
        "kernels": {k: [len(v), round(statistics.fmean(v), 1)] for k, v in kernels.items()},
    }


def main() -> None:
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    for cls, names in (
        (GadgetDataset, ("_read_ahead", "_gather", "_take")),
        (dsmod._OrderWindow, ("_upload",)),
        (GadgetSampler, ("_order_future",)),
    ):
        for name in names:
            _labelled(cls, name)
    rng = np.random.default_rng(0)
    arr = rng.standard_normal((ROWS, WIDTH), dtype=np.float32)
    g = DataGadget(arr, placement="pinned")
    ds = GadgetDataset(g)
    src = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    gbps = 20 * (64 << 20) / (time.perf_counter() - t0) / 1e9
    line_us = B * WIDTH * 4 / gbps / 1e3
    result: dict[str, Any] = {"memcpy_GBps": gbps, "line_us_per_batch": line_us}
    print(f"memcpy {gbps:.1f} GB/s, line {line_us:.1f} us/batch", flush=True)

    def c_form() -> Any:
        s = GadgetSampler(ds, batch_size=B, seed=1)
        return lambda: DataLoader(ds, batch_sampler=s)

    def e_form() -> Any:
        s = GadgetSampler(ds, batch_size=B, seed=1)
        return lambda: (ds.__getitems__(ids)[0] for ids in s)

    def d_form() -> Any:
        loader = GadgetLoader(ds, batch_size=B, seed=1)
        return lambda: loader

    forms = {"c": c_form, "e": e_form, "d": d_form}
    for rnd in range(2):
        for name, make in forms.items():
            stream = endless(make())
            for _ in range(300):
                next(stream)
            torch.cuda.synchronize()
            r = timed(stream, 2048)
            r["of_line"] = line_us / r["us_per_batch"]
            key = f"{name}{rnd}"
            if rnd == 0:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(520):
                        first(next(stream))
                    torch.cuda.synchronize()
                r["profile"] = gaps(prof)
                prof.export_chrome_trace(os.path.join(out_dir, f"trace_{name}.json"))
            result[key] = r
            p = r.get("profile", {})
            print(
                f"({name}) round {rnd}: {r['us_per_batch']:.1f} us/batch ({r['of_line']:.1%} of line), "
                f"host mean {r['host_us_mean']:.1f} p50 {r['host_us_p50']:.1f} p99 {r['host_us_p99']:.1f}, "
                f"busy {p.get('busy_share')}",
                flush=True,
            )
    with open(os.path.join(out_dir, "pipeline_gaps.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
