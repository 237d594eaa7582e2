"""Session 26 probe: do repeated ids in a zero-copy gather cost link bytes, and would a
gather that reads each distinct row once (and copies the repeats on the GPU) be faster?

Tables: 1M and 8M rows of 128 float32 (0.5 and 4 GB), pinned and mapped. Requests of
131,072 ids: distinct (``randperm``), uniform with repeats (``randint``: ~6% repeats on 1M
rows) and skewed (``perm[floor(rows * u**4)]``: a hot head scattered over the table).
Variants, each timed with CUDA events (20 calls back to back, median of 7 blocks):
- ``index_select``: torch's zero-copy gather of the request as it is;
- ``unique only``: ``index_select`` of the request's distinct ids (computed beforehand,
  not timed) -- the bytes a deduplicating gather would move, without its extra work;
- ``dedup 3 launches``: a slot per table row takes any position naming it (plain stores,
  any winner), the positions that won read their row from the host, the others copy the
  winner's row on the GPU (three CuPy kernels, 16-byte vectors);
- ``plain kernel``: the same gather kernel with every position reading the host (the
  kernel's own speed, against which the dedup variant is compared).
Usage: python notebooks/probes/gather_dedup.py OUT.json
"""

from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import json
import statistics
import sys

import cupy as cp
import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

from gadgetloader import DataGadget

dev = torch.device("cuda", 0)
W, N = 128, 131_072
VEC = W * 4 // 16  # 16-byte vectors per row

SRC = r"""
extern "C" __global__ void claim(const long long* ids, int* slot, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) slot[ids[i]] = i;
}
extern "C" __global__ void owners(const long long* ids, const int* slot, const float4* table,
                                  float4* out, int n, int vec, int dedup) {
    long long total = (long long)n * vec;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        int i = (int)(k / vec), j = (int)(k % vec);
        long long id = ids[i];
        if (!dedup || slot[id] == i) out[k] = table[id * vec + j];
    }
}
extern "C" __global__ void repeats(const long long* ids, const int* slot, float4* out,
                                   int n, int vec) {
    long long total = (long long)n * vec;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        int i = (int)(k / vec), j = (int)(k % vec);
        int o = slot[ids[i]];
        if (o != i) out[k] = out[(long long)o * vec + j];
    }
}
"""
mod = cp.RawModule(code=SRC)
k_claim, k_owners, k_repeats = (mod.get_function(n) for n in ("claim", "owners", "repeats"))
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
GRID = SMS * 16


def timed(fn, blocks: int = 7, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(blocks):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) / calls)
    return statistics.median(res)


def measure(view: torch.Tensor, host: torch.Tensor, slot: torch.Tensor, ids: torch.Tensor) -> dict:
    """Every variant on one request (checked against ``index_select`` first)."""
    uniq = torch.unique(ids)
    out = torch.empty(N, W, device=dev)
    out_u = torch.empty(len(uniq), W, device=dev)
    ctable, cids, cslot, cout = (cp.from_dlpack(t) for t in (view, ids, slot, out))
    n32, vec32 = cp.int32(N), cp.int32(VEC)

    def dedup(d: int = 1) -> None:
        if d:
            k_claim(((N + 255) // 256,), (256,), (cids, cslot, n32))
        k_owners((GRID,), (256,), (cids, cslot, ctable, cout, n32, vec32, cp.int32(d)))
        if d:
            k_repeats((GRID,), (256,), (cids, cslot, cout, n32, vec32))

    ref = torch.index_select(view, 0, ids)
    for d in (1, 0):
        out.zero_()
        dedup(d)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"kernel (dedup={d}) differs from index_select"
    return {
        "distinct": len(uniq),
        "index_select": timed(lambda: torch.index_select(view, 0, ids, out=out)),
        "unique only": timed(lambda: torch.index_select(view, 0, uniq, out=out_u)),
        "dedup 3 launches": timed(lambda: dedup(1)),
        "plain kernel": timed(lambda: dedup(0)),
        "memcpy": timed(lambda: out.copy_(host[:N], non_blocking=True)),
        "request MB": N * W * 4 / 1e6,
    }


def run_table(rows: int) -> list[dict]:
    gen = torch.Generator().manual_seed(rows)
    g = DataGadget(torch.randn(rows, W, generator=gen), placement="pinned")
    view = g.as_tensor()
    host = g._store.host_view()
    assert host is not None and host.is_pinned()
    slot = torch.empty(rows, dtype=torch.int32, device=dev)
    perm = torch.randperm(rows, generator=gen)
    u = torch.rand(N, generator=gen)
    requests = {
        "distinct": torch.randperm(rows, generator=gen)[:N],
        "uniform": torch.randint(0, rows, (N,), generator=gen),
        "skewed": perm[(u**4 * rows).long().clamp_(max=rows - 1)],
    }
    found = []
    for name, ids in requests.items():
        row = {"table_rows": rows, "request": name, **measure(view, host, slot, ids.to(dev))}
        print(json.dumps(row), flush=True)
        found.append(row)
    g.close()
    return found


results = [r for rows in (1_000_000, 8_000_000) for r in run_table(rows)]
with open(sys.argv[1], "w") as f:
    json.dump({"probe": "gather_dedup", "results": results}, f, indent=1)
