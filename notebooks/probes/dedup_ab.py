"""Session 26 probe: ``getData`` reading each distinct row once (``_kernels.dedup_slots``)
against the plain gather, A/B in one process, by request size and repeat pattern.

Table: the seed benchmark's (1M x 128 float32, pinned). Requests of 4,096 to 131,072 ids:
distinct, uniform with repeats (``randint``) and skewed (``perm[floor(rows * u**4)]``),
given as CPU ids (checked on the CPU) and as CUDA ids with ``check_ids=False``. Each
variant: 20 calls in a row after 3 warm-up calls, wall clock to a synchronisation after the
last (as ``gadgetloader bench`` times), median of 9 blocks, the variants alternating block
by block. "off" sets ``DEDUP_MIN_IDS`` past every request.
``--per-call``: 131,072 ids only, and also each variant timed as ``gadgetloader bench``
times it (``time_fn``: CUDA events around one call on an idle GPU, median of 20), 5 rounds.
Usage: python notebooks/probes/dedup_ab.py OUT.json [--per-call]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

from gadgetloader import DataGadget
from gadgetloader.bench._common import time_fn
from gadgetloader.transfer import _kernels

dev = torch.device("cuda", 0)
ROWS, W = 1_000_000, 128
ON = _kernels.DEDUP_MIN_IDS
gen = torch.Generator().manual_seed(0)
g = DataGadget(torch.randn(ROWS, W, generator=gen), placement="pinned")
ref = g.as_tensor()


def block(fn, calls: int = 20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


SIZES = (131072,) if "--per-call" in sys.argv else (4096, 16384, 65536, 131072)
results = []
for n in SIZES:
    perm = torch.randperm(ROWS, generator=gen)
    u = torch.rand(n, generator=gen)
    requests = {
        "distinct": torch.randperm(ROWS, generator=gen)[:n],
        "uniform": torch.randint(0, ROWS, (n,), generator=gen),
        "skewed": perm[(u**4 * ROWS).long().clamp_(max=ROWS - 1)],
    }
    for name, ids in requests.items():
        cids = ids.to(dev)
        out = torch.empty(n, W, device=dev)
        variants = {
            "cpu ids": lambda ids=ids, out=out: g.getData(ids, out=out),
            "cuda ids unchecked": lambda c=cids, out=out: g.getData(c, out=out, check_ids=False),
        }
        row = {"n": n, "request": name, "distinct": int(torch.unique(cids).numel())}
        for vname, fn in variants.items():
            times: dict[str, list[float]] = {"on": [], "off": []}
            for mode in ("on", "off"):
                _kernels.DEDUP_MIN_IDS = ON if mode == "on" else 1 << 40
                for _ in range(3):
                    fn()
                fn()
                torch.cuda.synchronize()
                assert torch.equal(out, torch.index_select(ref, 0, cids)), (n, name, mode)
            for _ in range(9):
                for mode in ("on", "off"):
                    _kernels.DEDUP_MIN_IDS = ON if mode == "on" else 1 << 40
                    times[mode].append(block(fn))
            row[f"{vname} on"] = statistics.median(times["on"])
            row[f"{vname} off"] = statistics.median(times["off"])
        if "--per-call" in sys.argv:  # as `gadgetloader bench` times: one call at a time
            per: dict[str, list[float]] = {"on": [], "off": []}
            for _ in range(5):
                for mode in ("on", "off"):
                    _kernels.DEDUP_MIN_IDS = ON if mode == "on" else 1 << 40
                    for vname, fn in variants.items():
                        per.setdefault(f"{vname} {mode}", []).append(time_fn(fn)["ms"])
            for key, vals in per.items():
                if vals:
                    row[f"per call: {key}"] = statistics.median(vals)
        _kernels.DEDUP_MIN_IDS = 1  # what the slots cost where the default skips them
        row["cuda ids unchecked forced"] = statistics.median(
            block(variants["cuda ids unchecked"]) for _ in range(9)
        )
        _kernels.DEDUP_MIN_IDS = ON
        print(json.dumps(row), flush=True)
        results.append(row)

with open(sys.argv[1], "w") as f:
    json.dump({"probe": "dedup_ab", "dedup_min_ids": ON, "results": results}, f, indent=1)
