"""Session 25 probe: the seed scatter with its range check fused into the merge, against
session 24's path, A/B in one process (so a process's host speed, which differed by up to
2x between subprocesses in ``seed_ab.py``'s runs, affects both alike).

Variants: ``insertData`` as the library runs it now (``_engine.slot_scatter``: the check
fused into the sort-free merge, no store or engine bookkeeping) and with that path turned
off for the gadget, which leaves session 24's path (a guarded ``aminmax`` check, then
``Store.scatter`` -> ``_engine.scatter_many``); both also with ``check_ids=False``; CuPy's
own fancy assignment into the same pinned table (what SpeedTorch's ``insertData`` runs:
no repeat merge, no check) and torch's zero-copy ``index_copy_``; and the unchecked gather
through the one-launch path against the store's path. Timed with CUDA events around one
call on an idle GPU: rotating between variants (medians of 41), 20 calls of one variant in
a row after 3 warm-up calls (as ``gadgetloader bench`` times; 3 blocks, median), and back
to back (50 calls, one synchronisation).
Usage: python notebooks/probes/insert_fused.py OUT.json
"""

from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import cupy as cp
import torch
from _seed_setup import ROWS, N, W, dev, event_ms, g, rows, uids, view

from gadgetloader._ids import as_ids

REPS = 41
gen = torch.Generator().manual_seed(1)
ids = torch.randint(0, ROWS, (N,), generator=gen).to(dev)
out = torch.empty(N, W, device=dev)
cview, cuids, crows = cp.from_dlpack(view), cp.from_dlpack(uids), cp.from_dlpack(rows)


def old_path(check: bool = True) -> None:
    g._slot_write = lambda *a: False  # type: ignore[method-assign]
    try:
        g.insertData(rows, uids, check_ids=check)
    finally:
        del g._slot_write


def cupy_assign() -> None:
    cview[cuids] = crows


def store_gather() -> None:
    g._store.gather(as_ids(ids, ROWS, dev, check=False), dev, out=out)


variants = {
    "scatter: insertData, fused check (now)": lambda: g.insertData(rows, uids),
    "scatter: insertData, session 24's path": old_path,
    "scatter: insertData(check_ids=False), now": lambda: g.insertData(rows, uids, check_ids=False),
    "scatter: insertData(check_ids=False), session 24's path": lambda: old_path(False),
    "scatter: CuPy fancy assignment": cupy_assign,
    "scatter: torch index_copy_ on the view": lambda: view.index_copy_(0, uids, rows),
    "gather: getData(check_ids=False), now": lambda: g.getData(ids, out=out, check_ids=False),
    "gather: store path (session 24's for check_ids=False)": store_gather,
    "gather: torch index_select": lambda: torch.index_select(view, 0, ids, out=out),
}

for fn in variants.values():
    for _ in range(3):
        fn()
torch.cuda.synchronize()
ref_rows = view.cpu()
assert torch.equal(ref_rows[uids.cpu()], rows.cpu())
g.getData(ids, out=out, check_ids=False)
assert torch.equal(out.cpu(), ref_rows[ids.cpu()])

names = list(variants)
rot: dict[str, list[float]] = {k: [] for k in names}
for r in range(REPS):
    for k in names[r % len(names) :] + names[: r % len(names)]:
        rot[k].append(event_ms(variants[k]))
row: dict[str, list[float]] = {k: [] for k in names}
for _ in range(3):
    for k in names:
        for _ in range(3):
            variants[k]()
        row[k].append(statistics.median(event_ms(variants[k]) for _ in range(20)))
b2b: dict[str, list[float]] = {k: [] for k in names}
for _ in range(3):
    for k in names:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            variants[k]()
        torch.cuda.synchronize()
        b2b[k].append((time.perf_counter() - t0) * 1e3 / 50)
result = {
    k: {
        "rotating_ms": statistics.median(rot[k]),
        "in_a_row_ms": statistics.median(row[k]),
        "back_to_back_ms": statistics.median(b2b[k]),
        "in_a_row_blocks": row[k],
    }
    for k in names
}
for k, v in result.items():
    print(
        f"{k:58s} rotating {v['rotating_ms']:.3f}  in a row {v['in_a_row_ms']:.3f}  "
        f"back to back {v['back_to_back_ms']:.3f}"
    )

# where the host time of the library's checked scatter goes: cProfile of 300 calls
prof = cProfile.Profile()
torch.cuda.synchronize()
prof.enable()
for _ in range(300):
    g.insertData(rows, uids)
prof.disable()
torch.cuda.synchronize()
text = io.StringIO()
pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
print(text.getvalue())
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(
            {"probe": "insert_fused", "variants": result, "profile": text.getvalue()}, f, indent=1
        )
