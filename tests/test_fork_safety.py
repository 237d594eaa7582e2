"""Pipeline objects holding CUDA resources (a dataset's order windows and read-ahead
groups, a loader's events, page-locked sampler orders) are never destroyed in a forked
DataLoader worker, where destroying them would call CUDA and abort the worker."""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gadgetloader as gl
from gadgetloader import _fork

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


class _Cyclic:
    """An object in a reference cycle that reports its destruction through a pipe."""

    def __init__(self, fd: int) -> None:
        self.me = self
        self.fd = fd

    def __del__(self) -> None:
        os.write(self.fd, b"D")  # (the test closes the pipe only after both died)


def _collect_earlier_garbage() -> None:
    """Collect what earlier tests left in reference cycles before forking. Session 22 saw a
    forked child abort on a CUDA initialization error thrown from a destructor when GPU
    tests ran just before these in one process: torch objects in such garbage (which one
    was not established) are not this library's to keep, and are not what these tests
    are about."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@needs_fork
def test_registered_objects_outlive_a_fork_unregistered_ones_do_not(monkeypatch) -> None:
    # the registry alone: no freeze of the collector for the fork (which a process that
    # started CUDA gets, and which keeps the unregistered object too: test_session37_fork)
    monkeypatch.setattr(_fork, "_cuda_started", lambda: False)
    r, w = os.pipe()
    _collect_earlier_garbage()
    was_enabled = gc.isenabled()
    gc.disable()  # the cycles must still be garbage, not yet collected, at the fork
    try:
        kept = _fork.keep_in_forked_child(_Cyclic(w))
        plain = _Cyclic(w)
        del kept, plain
        pid = os.fork()
        if pid == 0:  # the child: collect the parent's garbage, report what died
            try:
                gc.collect()
                os.write(w, b"K" if len(_fork._KEPT) >= 1 else b"-")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        gc.collect()  # the parent frees both as usual (registration holds weakly)
    finally:
        if was_enabled:
            gc.enable()
    os.close(w)
    got = b""
    while True:
        chunk = os.read(r, 64)
        if not chunk:
            break
        got += chunk
    os.close(r)
    # child: the unregistered object died ("D"), the registered one was kept ("K");
    # parent: both died ("DD")
    assert sorted(got.decode()) == ["D", "D", "D", "K"], got


def test_pipeline_objects_register() -> None:
    ds = gl.GadgetDataset(np.zeros((64, 2), np.float32), device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=8)
    assert _fork._HOLDERS[id(ds)] is ds and _fork._HOLDERS[id(loader)] is loader
    ref = weakref.ref(loader)
    del loader
    gc.collect()
    assert ref() is None  # held weakly: the parent frees it as usual
    assert _fork._HOLDERS[id(ds)] is ds


class _Collecting(Dataset[int]):
    """A CPU dataset whose worker collects the garbage it inherited."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


@pytest.mark.gpu
@needs_fork
def test_worker_forked_beside_cuda_garbage_survives(device: torch.device) -> None:
    pytest.importorskip("cupy")
    x = np.random.default_rng(0).standard_normal((4096, 8)).astype(np.float32)
    _collect_earlier_garbage()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for placement in ("pinned", "cuda"):
            ds = gl.GadgetDataset(x, placement=placement, device=device)
            s = gl.GadgetSampler(ds, batch_size=256, seed=1)
            assert s._pin is True
            it: Any = iter(DataLoader(ds, batch_sampler=s))
            batches = [next(it) for _ in range(3)]  # a window (event) and a group in use
            loader = gl.GadgetLoader(ds, batch_size=256, seed=2)
            got = [b[0].sum() for b in loader]
            torch.cuda.synchronize()
            assert ds._windows and len(got) == 16
            # everything in one cycle, unreachable, not collected before the fork
            junk: list[Any] = [ds, s, it, batches, loader, next(iter(s))]
            junk.append(junk)
            del ds, s, it, batches, loader, got, junk
        out = list(
            DataLoader(_Collecting(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        )
    finally:
        if was_enabled:
            gc.enable()
    assert torch.cat(out).tolist() == list(range(8))
    gc.collect()
