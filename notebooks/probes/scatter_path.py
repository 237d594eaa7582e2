"""Session 23 probe: where the seed scatter's time goes beyond the link.

The seed benchmark's scatter (1M x 128 float32 pinned table, 131,072 distinct random CUDA
ids, rows on the GPU) took 1.61-1.83 ms against a 1.22-1.25 ms memcpy, while SpeedTorch's
CuPy-id scatter, which handles no repeated ids, took 1.43-1.52 ms. This probe times,
interleaved (each repeat runs every variant once; CUDA events around each call, medians),
the public ``insertData`` with and without the range check, its pieces (the check's
``aminmax`` and read-back, the stable sort and last-writer plan, the scatter kernel alone
over sorted and unsorted ids), and torch's zero-copy ``index_copy_`` on the table's CUDA
view (no repeat handling, as SpeedTorch). Session 24 adds the library's sort-free merge
(``_kernels.launch_last_slots`` and the slot-mode kernel) and ``insertData`` with the
sort merge it replaced on tables of this size. Usage: python notebooks/probes/scatter_path.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from _seed_setup import ROWS, dev, event_ms, g, host, rows, uids, view

from gadgetloader._ids import last_writer
from gadgetloader.transfer import _engine, _kernels

REPS = 31
plan = last_writer(uids)
sorted_ids, pos = plan.ids, plan.pos


def host_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3


def sort_free(fill: bool, dtype: torch.dtype) -> torch.Tensor:
    """The last-writer rule without a sort (candidate, not in the library): each id's slot
    in a table-sized array takes the largest position naming it; entries whose position is
    their id's slot win, the rest get an id the kernels skip. ``fill``: reset the slots
    the ids name to -1 first and reduce with ``include_self=True`` (atomics only), else
    ``include_self=False`` on an uninitialised array."""
    n = uids.numel()
    pos_ = torch.arange(n, device=dev, dtype=dtype)
    slot = torch.empty(ROWS, dtype=dtype, device=dev)
    if fill:
        slot.index_fill_(0, uids, -1)
        slot.scatter_reduce_(0, uids, pos_, "amax", include_self=True)
    else:
        slot.scatter_reduce_(0, uids, pos_, "amax", include_self=False)
    keep = slot.index_select(0, uids) == pos_
    return torch.where(keep, uids, ROWS)


slot = torch.empty(ROWS, dtype=torch.int32, device=dev)


def with_sort_merge() -> None:
    """insertData as before session 24: repeats merged by the stable sort."""
    keep = _engine.SLOT_MERGE_MAX_ROWS
    _engine.SLOT_MERGE_MAX_ROWS = 0
    try:
        g.insertData(rows, uids)
    finally:
        _engine.SLOT_MERGE_MAX_ROWS = keep


variants = {
    "insertData CUDA ids": lambda: g.insertData(rows, uids),
    "insertData CUDA ids, sort merge": with_sort_merge,
    "launch_last_slots (slot merge)": lambda: _kernels.launch_last_slots(uids, slot),
    "kernel, unsorted ids, last by slot": lambda: _kernels.launch_scatter(
        view, uids, rows, None, _kernels.SCATTER_LAST_BY_SLOT, slot=slot
    ),
    "insertData CUDA ids, check_ids=False": lambda: g.insertData(rows, uids, check_ids=False),
    "aminmax + read-back": lambda: torch.aminmax(uids)[0].item(),
    "last_writer (stable sort + mask)": lambda: last_writer(uids),
    "sort-free, include_self=False, int32": lambda: sort_free(False, torch.int32),
    "sort-free, index_fill + amax, int32": lambda: sort_free(True, torch.int32),
    "sort-free, index_fill + amax, int64": lambda: sort_free(True, torch.int64),
    "kernel, sorted ids, last of run": lambda: _kernels.launch_scatter(
        view, sorted_ids, rows, pos, _kernels.SCATTER_LAST_OF_RUN
    ),
    "kernel, unsorted ids, all": lambda: _kernels.launch_scatter(view, uids, rows),
    "torch index_copy_ (zero-copy view)": lambda: view.index_copy_(0, uids, rows),
    "kernel all, unroll=1": lambda: _kernels.launch_scatter(view, uids, rows, unroll=1),
    "kernel all, unroll=8": lambda: _kernels.launch_scatter(view, uids, rows, unroll=8),
    "kernel all, 8-byte vectors": lambda: _kernels.launch_scatter(view, uids, rows, max_vector=8),
    "kernel all, 4-byte vectors": lambda: _kernels.launch_scatter(view, uids, rows, max_vector=4),
    "kernel all, 4 blocks/SM": lambda: _kernels.launch_scatter(view, uids, rows, blocks_per_sm=4),
    "kernel all, 32 blocks/SM": lambda: _kernels.launch_scatter(view, uids, rows, blocks_per_sm=32),
    "kernel all, warp per row": lambda: _kernels.launch_scatter(
        view, uids, rows, blocks_per_sm=_kernels.IN_ORDER
    ),
}
try:  # CuPy's own fancy-index write on the same zero-copy view, as SpeedTorch does it
    import cupy as cp

    cp_view, cp_ids, cp_rows = cp.asarray(view), cp.asarray(uids), cp.asarray(rows)

    def cupy_setitem() -> None:
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            cp_view[cp_ids] = cp_rows

    variants["CuPy view[ids] = rows (zero-copy view)"] = cupy_setitem
except ImportError:
    pass
for fn in variants.values():
    for _ in range(3):
        fn()
times: dict[str, list[float]] = {k: [] for k in variants}
hosts: dict[str, list[float]] = {k: [] for k in variants}
for r in range(REPS):
    for k in list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]:
        times[k].append(event_ms(variants[k]))
        hosts[k].append(host_ms(variants[k]))
result: dict[str, object] = {
    k: {"median_ms": statistics.median(v), "min_ms": min(v), "host_ms": statistics.median(hosts[k])}
    for k, v in times.items()
}
for fill, dt in ((False, torch.int32), (True, torch.int32), (True, torch.int64)):
    plan_ids = last_writer(uids).ids  # distinct ids: every entry wins either way
    assert torch.equal(torch.sort(sort_free(fill, dt)).values, plan_ids)
expect = host.clone()
expect[uids.cpu()] = rows.cpu()
result["check"] = bool(torch.equal(g.as_tensor().cpu(), expect))
for k, v in result.items():
    if isinstance(v, dict):
        print(f"{k:40s} {v['median_ms']:.3f} ms (min {v['min_ms']:.3f}, host {v['host_ms']:.3f})")
    else:
        print(f"{k:40s} {v}")
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=2)
