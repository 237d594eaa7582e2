"""CUDA graphs of a training lookup's row plan and fused gather.

A lookup of an :class:`~gadgetloader.OffloadedEmbedding` on a CUDA device queues a
stable sort of its ids, the plan kernel and the fused gather of the rows and their
optimizer states: a dozen launches whose CPU cost (torch's sort alone takes 0.1-0.2 ms
of CPU on the H200 host) is most of a training step's forward, and the step is bound
by the CPU. The same id count comes back every step, so the second lookup of a count
captures that work into a CUDA graph, and later lookups of it copy their ids into the
graph's input and replay it: one launch. The graph runs the very kernels the eager
path runs, so its results are bit-identical (tested).

A replay overwrites the graph's outputs (the plan and the gathered rows), which a
step keeps using until its write-back, and an optimizer's state keeps until the next
step. So each id count has up to :data:`PER_COUNT` captured copies, and a copy is
replayed only when nothing holds the tensors of its last replay (weak references):
a copy whose outputs are still in use is skipped, and when every copy is in use the
lookup runs eagerly. Nothing here ever synchronises with the GPU. A table keeps at
most :data:`COUNTS` id counts and :data:`MAX_BYTES` of captured outputs.

Set ``GADGETLOADER_CUDA_GRAPHS=0`` (or :data:`ENABLED` to False) to turn it off.
"""

from __future__ import annotations

import gc
import math
import os
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from ._rows import KERNEL_PLAN_MAX, RowPlan, plan_rows_async

if TYPE_CHECKING:
    from ..stores._base import FusedRows

__all__ = ["ENABLED", "LookupGraphs"]

#: whether training lookups replay captured graphs (``GADGETLOADER_CUDA_GRAPHS=0``: no)
ENABLED = os.environ.get("GADGETLOADER_CUDA_GRAPHS", "1").strip().lower() not in (
    "0",
    "false",
    "no",
    "off",
)

#: captured copies per id count: a step's outputs stay in use until the next step
#: (the optimizer keeps the state rows), so a loop alternates between two
PER_COUNT = 2
#: id counts kept per table (the least recently used one is dropped)
COUNTS = 4
#: captured outputs (rows and states) kept per table at most, in bytes
MAX_BYTES = 512 << 20
#: a count is captured the second time a lookup of it is seen (a count seen once, such
#: as an epoch's last partial batch, costs no capture)
CAPTURE_AFTER = 2


class _Captured:
    """One captured plan + gather of ``n`` ids."""

    def __init__(self, fused: FusedRows, n: int, stream: torch.cuda.Stream) -> None:
        device = fused.device
        self.ids = torch.empty(n, dtype=torch.int64, device=device)
        self.graph = torch.cuda.CUDAGraph()
        ends = torch.empty(2, dtype=torch.int64, device=device)
        # no garbage collection while capturing: a collected store's finalizer (a pinned
        # table being unregistered) synchronises the device, which a capturing thread may not
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.no_grad(), torch.cuda.stream(stream):
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    # ``ends`` on the device: the pinned copy is queued after each replay
                    plan = plan_rows_async((self.ids,), 1 << 62, ends)
                    outs = fused.gather(plan.ids, plan.n_distinct)  # type: ignore[arg-type]
                finally:
                    self.graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        self.plan = plan
        self.ends = ends
        self.outs = outs
        self.nbytes = sum(o.numel() * o.element_size() for o in outs)
        self._handed: list[weakref.ref[torch.Tensor]] = []

    def busy(self) -> bool:
        """Whether a tensor handed out by the last replay is still alive."""
        return any(r() is not None for r in self._handed)

    def run(self, ids: torch.Tensor) -> tuple[RowPlan, list[torch.Tensor], torch.Tensor]:
        self.ids.copy_(ids.reshape(-1))
        self.graph.replay()
        p = self.plan
        assert p.n_distinct is not None and p.order is not None and p.order_local is not None
        # fresh tensor objects over the graph's outputs: their lifetimes say when the
        # outputs are free again, and each lookup's rows get their own grad and hooks
        plan = RowPlan(
            p.ids.detach(),
            p.local.detach(),
            (tuple(ids.shape),),
            True,
            p.n_distinct.detach(),
            p.order.detach(),
            p.order_local.detach(),
        )
        outs = [o.detach() for o in self.outs]
        handed = [plan.ids, plan.local, plan.n_distinct, plan.order, plan.order_local, *outs]
        self._handed = [weakref.ref(t) for t in handed]  # type: ignore[arg-type]
        return plan, outs, self.ends


class LookupGraphs:
    """The captured lookups of one table's fused transfer (a table and its interleaved
    optimizer states, :class:`~gadgetloader.stores._base.FusedRows`)."""

    def __init__(self, fused: FusedRows) -> None:
        self.fused = fused
        self._by_count: OrderedDict[int, list[_Captured]] = OrderedDict()
        self._seen: dict[int, int] = {}
        self._stream: torch.cuda.Stream | None = None
        self.failed: BaseException | None = None
        #: bytes of the captured copies' outputs
        self.nbytes = 0
        #: replays and captures so far (for tests and the benchmark's notes)
        self.replays = 0
        self.captures = 0

    def run(self, ids: torch.Tensor) -> tuple[RowPlan, list[torch.Tensor], torch.Tensor] | None:
        """The plan and gathered rows of the int64 CUDA ``ids`` (on the fused transfer's
        device) from a replay, plus the device pair (smallest, largest id); None where
        the lookup should run eagerly."""
        n = ids.numel()
        if self.failed is not None or not 0 < n <= KERNEL_PLAN_MAX:
            return None
        copies = self._by_count.get(n)
        if copies is None:
            seen = self._seen.get(n, 0) + 1
            if len(self._seen) > 64:  # ever-changing counts: forget them
                self._seen.clear()
            self._seen[n] = seen
            if seen < CAPTURE_AFTER:
                return None
            copies = self._by_count[n] = []
            while len(self._by_count) > COUNTS:
                _, dropped = self._by_count.popitem(last=False)
                self.nbytes -= sum(c.nbytes for c in dropped)
        else:
            self._by_count.move_to_end(n)
        for c in copies:
            if not c.busy():
                self.replays += 1
                return c.run(ids)
        if len(copies) >= PER_COUNT or self.nbytes + self._out_bytes(n) > MAX_BYTES:
            return None
        try:
            c = self._capture(n)
        except Exception as e:  # capture unsupported here: run eagerly from now on
            self.failed = e
            self._by_count.clear()
            return None
        copies.append(c)
        self.nbytes += c.nbytes
        self.captures += 1
        self.replays += 1
        return c.run(ids)

    def _out_bytes(self, n: int) -> int:
        """Bytes of the outputs of a copy for ``n`` ids (one row per lookup position)."""
        return sum(
            n * math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            for shape, dtype in self.fused.layouts
        )

    def _capture(self, n: int) -> _Captured:
        device = self.fused.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.device(device):
            return _Captured(self.fused, n, self._stream)

    def counts(self) -> dict[int, int]:
        """Captured copies by id count."""
        return {n: len(c) for n, c in self._by_count.items()}
