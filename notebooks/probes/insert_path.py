"""Session 24 probe: the range check of a seed scatter's CUDA ids, A/B in one process.

The seed scatter (``insertData`` of 131,072 distinct CUDA ids into a 1M x 128 float32
pinned table) spent 0.16-0.4 ms beyond its kernel on the check of its ids. Session 24
queues the write first with the ids' (smallest, largest) pair on the GPU, so the kernel
writes nothing if an id is bad and the check's round trip overlaps the write (a
"guarded" check). This probe times, interleaved (each repeat runs every variant once;
CUDA events around each call, medians), the library's ``insertData`` against the same
call with the previous check (the pair written to mapped host memory, finished before the
write), the check done first (``check_range`` then ``check_ids=False``), no check, and
the bare kernel; then the same variants back to back (50 calls, one synchronisation:
what a training loop sees); then profiles the host side of 300 calls.
Usage: python notebooks/probes/insert_path.py OUT.json
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
from _seed_setup import ROWS, event_ms, g, rows, uids, view

import gadgetloader.gadget as gadget_mod
from gadgetloader._ids import check_range, start_range_check
from gadgetloader.transfer import _kernels

REPS = 41
guarded = gadget_mod.start_guarded_check


def previous_check() -> None:
    """The check as before session 24: finished before the kernel is queued."""
    gadget_mod.start_guarded_check = lambda ids, n: start_range_check(ids, n)  # type: ignore[assignment]
    try:
        g.insertData(rows, uids)
    finally:
        gadget_mod.start_guarded_check = guarded


def check_first() -> None:
    check_range(uids, ROWS)
    g.insertData(rows, uids, check_ids=False)


variants = {
    "insertData (guarded check)": lambda: g.insertData(rows, uids),
    "insertData (check finished before the write)": previous_check,
    "check_range, then insertData(check_ids=False)": check_first,
    "insertData(check_ids=False)": lambda: g.insertData(rows, uids, check_ids=False),
    "kernel alone (distinct ids, all)": lambda: _kernels.launch_scatter(view, uids, rows),
}


def loop_ms(fn, calls: int = 50) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / calls


for fn in variants.values():
    for _ in range(3):
        fn()
times: dict[str, list[float]] = {k: [] for k in variants}
loops: dict[str, list[float]] = {k: [] for k in variants}
names = list(variants)
for r in range(REPS):
    for k in names[r % len(names) :] + names[: r % len(names)]:
        times[k].append(event_ms(variants[k]))
for r in range(5):
    for k in names[r % len(names) :] + names[: r % len(names)]:
        loops[k].append(loop_ms(variants[k]))
result: dict[str, object] = {
    k: {
        "median_ms": statistics.median(v),
        "min_ms": min(v),
        "loop_ms": statistics.median(loops[k]),
    }
    for k, v in times.items()
}
expect = view.cpu()
expect[uids.cpu()] = rows.cpu()
result["check"] = bool(torch.equal(g.as_tensor().cpu(), expect))

prof = cProfile.Profile()
torch.cuda.synchronize()
prof.enable()
for _ in range(300):
    g.insertData(rows, uids)
prof.disable()
torch.cuda.synchronize()
text = io.StringIO()
pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
result["profile_top30_tottime"] = text.getvalue()

for k, v in result.items():
    if isinstance(v, dict):
        print(f"{k:48s} {v['median_ms']:.3f} ms (min {v['min_ms']:.3f}; loop {v['loop_ms']:.3f})")
    elif k != "profile_top30_tottime":
        print(f"{k:48s} {v}")
print(result["profile_top30_tottime"])
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=2)
