"""Shared set-up of the seed-scatter probes (``scatter_path.py``, ``insert_path.py``): the
seed benchmark's table (1M x 128 float32, pinned), its 131,072 distinct random CUDA ids and
rows, and a CUDA-event timer for one call on an idle GPU."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine")

from gadgetloader import DataGadget

dev = torch.device("cuda", 0)
ROWS, W, N = 1_000_000, 128, 131_072

gen = torch.Generator().manual_seed(0)
host = torch.randn(ROWS, W, generator=gen)
g = DataGadget(host, placement="pinned")
view = g.as_tensor()
uids = torch.randperm(ROWS, generator=gen)[:N].to(dev)
rows = torch.randn(N, W, generator=gen).to(dev)


def event_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn`` between CUDA events, starting on an idle GPU."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
