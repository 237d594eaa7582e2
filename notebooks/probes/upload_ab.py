"""Session 27 probe: cheaper ways to upload CPU ids (``_ids._upload``), the largest part of
the CPU-id gather's host time before its first GPU work (``cpu_ids_timeline.py``), A/B in
one process. A host that has just waited on the GPU runs each torch call several times
slower than back to back (``host_costs.py``), so the variants differ in how many calls
they make:
  ring (library)   the thread's two pinned buffers: event wait, slice, ``copy_``, ``.to``,
                   a new event recorded
  pin_memory().to  ``t.pin_memory().to(device, non_blocking=True)`` (torch's caching host
                   allocator reuses a block once the copy reading it has finished)
  empty+copy       ``torch.empty(pin_memory=True)``, ``copy_``, ``torch.empty`` on the GPU,
                   ``copy_(non_blocking=True)``
  lean ring        the ring with the staged view kept per shape, ``torch.empty`` +
                   ``copy_(non_blocking=True)`` on the GPU, and one event per buffer made
                   once and re-recorded
Each: ``getData(ids)`` per call as ``gadgetloader bench`` times (``time_fn``), alternating,
11 rounds; and the upload alone after a ~1.5 ms GPU wait (host us, median of 300).
Usage: python notebooks/probes/upload_ab.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

import gadgetloader._ids as ids_module
from gadgetloader import DataGadget
from gadgetloader._device import pinned_empty
from gadgetloader.bench._common import time_fn

dev = torch.device("cuda", 0)
ROWS, W, N = 1_000_000, 128, 131_072
gen = torch.Generator().manual_seed(0)
g = DataGadget(torch.randn(ROWS, W, generator=gen), placement="pinned")
ids = torch.randint(0, ROWS, (N,), generator=gen)
cids = ids.to(dev)
out = torch.empty(N, W, device=dev)
want = torch.index_select(g.as_tensor(), 0, cids)
library = ids_module._upload


def pin_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_pinned():
        return t.to(device, non_blocking=True)
    return t.pin_memory().to(device, non_blocking=True)


def empty_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_pinned():
        return t.to(device, non_blocking=True)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    up = torch.empty(t.shape, dtype=t.dtype, device=device)
    up.copy_(staged, non_blocking=True)
    return up


class Lean:
    def __init__(self) -> None:
        self.bufs = [pinned_empty(N, torch.int64), pinned_empty(N, torch.int64)]
        self.views: list[dict[tuple[int, ...], torch.Tensor]] = [{}, {}]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]
        self.turn = 0

    def __call__(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.is_pinned():
            return t.to(device, non_blocking=True)
        i = self.turn
        self.turn ^= 1
        if self.used[i]:
            self.events[i].synchronize()
        staged = self.views[i].get(t.shape)
        if staged is None:
            staged = self.bufs[i][: t.numel()].view(t.shape)
            self.views[i][t.shape] = staged
        staged.copy_(t)
        up = torch.empty(t.shape, dtype=t.dtype, device=device)
        up.copy_(staged, non_blocking=True)
        self.events[i].record(torch.cuda.current_stream(device))
        self.used[i] = True
        return up


VARIANTS: dict[str, Callable[[torch.Tensor, torch.device], torch.Tensor]] = {
    "ring (library)": library,
    "pin_memory().to": pin_to,
    "empty+copy": empty_copy,
    "lean ring": Lean(),
}


def call(name: str) -> Callable[[], object]:
    up = VARIANTS[name]

    def fn() -> object:
        ids_module._upload = up
        try:
            return g.getData(ids, out=out)
        finally:
            ids_module._upload = library

    return fn


for name in VARIANTS:
    out.zero_()
    call(name)()
    torch.cuda.synchronize()
    assert torch.equal(out, want), name
per: dict[str, list[float]] = {k: [] for k in VARIANTS}
for _ in range(11):
    for name in VARIANTS:
        per[name].append(time_fn(call(name))["ms"])
alone: dict[str, list[float]] = {k: [] for k in VARIANTS}
for _ in range(300):
    for name, up in VARIANTS.items():
        torch.cuda._sleep(2_500_000)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = up(ids, dev)
        alone[name].append((time.perf_counter() - t0) * 1e6)
        assert r.shape == ids.shape
torch.cuda.synchronize()
result = {
    "per call (events), getData CPU ids, ms": {k: statistics.median(v) for k, v in per.items()},
    "upload alone after a GPU wait, host us": {k: statistics.median(v) for k, v in alone.items()},
    "unchecked CUDA ids per call, ms": statistics.median(
        time_fn(lambda: g.getData(cids, out=out, check_ids=False))["ms"] for _ in range(5)
    ),
}
print(json.dumps(result, indent=1), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump({"probe": "upload_ab", "results": result}, f, indent=1)
