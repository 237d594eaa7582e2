"""Session 27 probe: the range check of checked CUDA ids fused into the slots launch of a
gather that reads each distinct row once (``_ids.start_flag_check``), against the check it
replaces (``start_range_check``: one ``aminmax`` into the thread's mapped pair, queued ahead
of the gather), A/B in one process.

Table: the seed benchmark's (1M x 128 float32, pinned); uniform random ids with repeats
(``randint``, as the seed benchmark draws them) of 65,536 and 131,072 ids, given as CUDA
tensors. Variants: ``getData(ids)`` fused (the library now), the same with the fused check
turned off (``gadget.start_flag_check`` answering None, so ``checked_after`` runs),
``check_ids=False`` and CPU ids. Timed per call as ``gadgetloader bench`` times
(``time_fn``: CUDA events around one call on an idle GPU, median of 20), the variants
alternating, 7 rounds; and 20 calls in a row to one synchronisation, medians of 9 blocks.
Usage: python notebooks/probes/flag_check_ab.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

import gadgetloader.gadget as gadget_module
from gadgetloader import DataGadget
from gadgetloader.bench._common import time_fn

dev = torch.device("cuda", 0)
ROWS, W = 1_000_000, 128
gen = torch.Generator().manual_seed(0)
g = DataGadget(torch.randn(ROWS, W, generator=gen), placement="pinned")
ref = g.as_tensor()
fused_check = gadget_module.start_flag_check


def use_fused(on: bool) -> None:
    gadget_module.start_flag_check = fused_check if on else (lambda ids, n: None)  # type: ignore[assignment]


def block(fn, calls: int = 20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


results = []
for n in (65_536, 131_072):
    ids = torch.randint(0, ROWS, (n,), generator=gen)
    cids = ids.to(dev)
    out = torch.empty(n, W, device=dev)
    variants = {
        "checked, fused": (True, lambda c=cids, o=out: g.getData(c, out=o)),
        "checked, aminmax": (False, lambda c=cids, o=out: g.getData(c, out=o)),
        "unchecked": (True, lambda c=cids, o=out: g.getData(c, out=o, check_ids=False)),
        "cpu ids": (True, lambda i=ids, o=out: g.getData(i, out=o)),
    }
    want = torch.index_select(ref, 0, cids)
    for name, (on, fn) in variants.items():
        use_fused(on)
        fn()
        torch.cuda.synchronize()
        assert torch.equal(out, want), name
        bad = cids.clone()
        bad[n // 3] = ROWS
        try:
            g.getData(bad)
        except Exception as e:  # the check must still refuse a bad id either way
            assert "out of range" in str(e), e
        else:
            raise AssertionError("a bad id was not refused")
    per: dict[str, list[float]] = {k: [] for k in variants}
    rows: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(7):
        for name, (on, fn) in variants.items():
            use_fused(on)
            per[name].append(time_fn(fn)["ms"])
    for _ in range(9):
        for name, (on, fn) in variants.items():
            use_fused(on)
            rows[name].append(block(fn))
    use_fused(True)
    row = {"n": n, "distinct": int(torch.unique(cids).numel())}
    for name in variants:
        row[f"per call: {name}"] = statistics.median(per[name])
        row[f"20 in a row: {name}"] = statistics.median(rows[name])
    print(json.dumps(row), flush=True)
    results.append(row)

with open(sys.argv[1], "w") as f:
    json.dump({"probe": "flag_check_ab", "results": results}, f, indent=1)
