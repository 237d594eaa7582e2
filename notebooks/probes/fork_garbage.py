"""Does a DataLoader worker forked beside unreachable pipeline objects survive?

Run on a CUDA machine from the repository root::

    python notebooks/probes/fork_garbage.py [--unprotected]

Builds CUDA datasets (order windows with events, read-ahead groups, a GadgetLoader,
page-locked sampler orders), leaves them in an uncollected reference cycle, then forks
two DataLoader workers that run the garbage collector. ``--unprotected`` empties the
registry of ``gadgetloader._fork`` first (the behaviour before it): the workers are
expected to abort. Prints ``survived`` or the error.
"""

from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import gc
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import gadgetloader as gl
from gadgetloader import _fork


class _NoSet:
    def add(self, obj: Any) -> None:
        pass

    def __iter__(self) -> Any:
        return iter(())


class _Collecting(Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


def main() -> None:
    if "--unprotected" in sys.argv:
        _fork._HOLDERS = _NoSet()  # type: ignore[assignment]
    x = np.random.default_rng(0).standard_normal((4096, 8)).astype(np.float32)
    gc.disable()
    for placement in ("pinned", "cuda"):
        ds = gl.GadgetDataset(x, placement=placement, device="cuda")
        s = gl.GadgetSampler(ds, batch_size=256, seed=1)
        it: Any = iter(DataLoader(ds, batch_sampler=s))
        batches = [next(it) for _ in range(3)]
        loader = gl.GadgetLoader(ds, batch_size=256, seed=2)
        got = [b[0].sum() for b in loader]
        torch.cuda.synchronize()
        junk: list[Any] = [ds, s, it, batches, loader, got, next(iter(s))]
        junk.append(junk)
        del ds, s, it, batches, loader, got, junk
    try:
        out = list(
            DataLoader(_Collecting(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        )
        print("survived", torch.cat(out).tolist())
    except RuntimeError as exc:
        print("worker died:", str(exc).splitlines()[0])


if __name__ == "__main__":
    main()
