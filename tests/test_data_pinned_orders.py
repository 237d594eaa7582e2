"""A GadgetSampler built on a dataset that reads on a CUDA device keeps its epoch orders
(and sequential segments) in page-locked memory, so that the dataset uploads windows of
the order without a host staging copy. Orders, batches and resume are unchanged by it."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader.data import _sampler as smod

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("order", ["random", "chunk"])
def test_pinned_order_equals_pageable(order: str) -> None:
    """Same permutation either way (pinned where this machine can, else pageable)."""
    a = smod._epoch_order(1000, order, 7, 3, 16, 4, False)
    b = smod._epoch_order(1000, order, 7, 3, 16, 4, True)
    assert a.dtype == b.dtype == torch.int64
    assert torch.equal(a, b)
    assert sorted(b.tolist()) == list(range(1000))
    assert b.is_pinned() == smod._can_pin()
    assert not a.is_pinned()
    # both tagged as the sampler's own (the dataset then skips their range check)
    assert smod.sampler_ids_bound(a) == smod.sampler_ids_bound(b) == 1000


def test_no_pinning_without_cuda_or_in_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not smod._can_pin()
    assert not smod._id_buffer(10, torch.int64, True).is_pinned()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(smod, "get_worker_info", lambda: object())  # a DataLoader worker
    assert not smod._can_pin()
    monkeypatch.setattr(smod, "get_worker_info", lambda: None)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True, raising=False)
    assert not smod._can_pin()


def test_pin_failure_falls_back_to_pageable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page-locked memory refused (a memlock limit, or no CUDA runtime): same order, pageable."""
    monkeypatch.setattr(smod, "_can_pin", lambda: True)
    real_empty = torch.empty

    def refusing(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("pin_memory"):
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refusing)
    buf = smod._id_buffer(64, torch.int64, True)
    assert buf.shape == (64,) and buf.dtype == torch.int64 and not buf.is_pinned()
    a = smod._epoch_order(500, "random", 1, 0, 1, 1, True)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert torch.equal(a, smod._epoch_order(500, "random", 1, 0, 1, 1, False))


def test_large_orders_stay_pageable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smod, "PIN_ORDER_ROWS", 100)
    calls: list[bool] = []
    real_empty = torch.empty

    def spying(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(bool(kwargs.pop("pin_memory", False)))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(smod, "_can_pin", lambda: True)
    monkeypatch.setattr(torch, "empty", spying)
    smod._id_buffer(101, torch.int64, True)
    smod._id_buffer(100, torch.int64, True)
    smod._id_buffer(100, torch.int64, False)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert calls == [False, True, False]


def test_cpu_dataset_does_not_ask_for_pinned_orders() -> None:
    ds = gl.GadgetDataset(np.zeros((50, 3), np.float32), device="cpu")
    assert ds._pin_sampler_ids() is False
    s = gl.GadgetSampler(ds, batch_size=8)
    assert s._pin is False
    assert gl.GadgetSampler(50, batch_size=8)._pin is False
    ds.close()
    # a closed dataset: the sampler still works, without pinning
    assert gl.GadgetSampler(ds, batch_size=8)._pin is False


def test_pin_flag_survives_pickling_and_old_pickles_load() -> None:
    s = gl.GadgetSampler(40, batch_size=8, seed=2)
    s._pin = True
    t = pickle.loads(pickle.dumps(s))
    assert t._pin is True
    # a sampler pickled before the flag existed
    state = s.__getstate__()
    del state["_pin"]
    u = gl.GadgetSampler.__new__(gl.GadgetSampler)
    u.__setstate__(state)
    assert [b.tolist() for b in u] == [
        b.tolist() for b in gl.GadgetSampler(40, batch_size=8, seed=2)
    ]


# ---- on the GPU: orders really pinned, and batches exactly as before -----------------------
@pytest.mark.gpu
@pytest.mark.parametrize("order", ["random", "sequential"])
def test_cuda_dataset_sampler_orders_are_pinned(
    placement: str, device: torch.device, order: str
) -> None:
    if placement == "cpu":
        pytest.skip("a CPU placement on a CUDA device is covered by the other placements")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((700, 5)).astype(np.float32)
    ds = gl.GadgetDataset(x, np.arange(700), placement=placement, device=device)
    assert ds._pin_sampler_ids() is True
    s = gl.GadgetSampler(ds, batch_size=32, order=order, seed=9)
    assert s._pin is True
    first = next(iter(s))
    assert first._base is not None and first._base.is_pinned()
    ref = gl.GadgetSampler(700, batch_size=32, order=order, seed=9)  # not pinned
    assert ref._pin is False
    got = [[t.cpu() for t in b] for b in DataLoader(ds, batch_sampler=s)]
    want = [b.clone() for b in ref]
    assert len(got) == len(want) == 22
    for (xb, yb), ids in zip(got, want, strict=True):
        assert torch.equal(yb, ids)
        assert torch.equal(xb, torch.from_numpy(x[ids.numpy()]))
    ds.close()


@pytest.mark.gpu
def test_pinned_order_windows_on_another_stream(device: torch.device) -> None:
    """A window uploaded from a pinned order is read correctly on a side stream."""
    pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5000, 8)).astype(np.float32)
    ds = gl.GadgetDataset(x, placement="pinned", device=device)
    s = gl.GadgetSampler(ds, batch_size=64, seed=1, coalesce=1)
    side = torch.cuda.Stream()
    out = []
    with torch.cuda.stream(side):
        for b in DataLoader(ds, batch_sampler=s):
            out.append(b[0].cpu())
    order = s.epoch_order(0)
    got = torch.cat(out)
    assert torch.equal(got, torch.from_numpy(x[order.numpy()]))
    ds.close()


@pytest.mark.gpu
def test_gadget_loader_sampler_pins_and_resumes(device: torch.device) -> None:
    pytest.importorskip("cupy")
    x = np.arange(3000 * 4, dtype=np.float32).reshape(3000, 4)
    ds = gl.GadgetDataset(x, placement="pinned", device=device)
    loader = gl.GadgetLoader(ds, batch_size=100, seed=3)
    assert loader.sampler._pin is True
    it = iter(loader)
    head = [next(it)[0].cpu().clone() for _ in range(7)]
    state = loader.state_dict()
    rest = [b[0].cpu().clone() for b in it]
    again = gl.GadgetLoader(ds, batch_size=100, seed=3)
    again.load_state_dict(state)
    assert all(torch.equal(a[0].cpu(), b) for a, b in zip(again, rest, strict=True))
    whole = torch.cat(head + rest)
    assert sorted(whole[:, 0].div(4).long().tolist()) == list(range(3000))
    ds.close()


# ---- the default form's lists: one struct pass, strict about what is not an id ------------
def test_default_form_lists_strict() -> None:
    from enum import IntEnum

    from gadgetloader import GadgetIndexError, GadgetTypeError

    class Color(IntEnum):
        RED = 4

    x = np.arange(40 * 2, dtype=np.float32).reshape(40, 2)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    for ids in ([3, 1, 3], [np.int64(7), 3], [Color.RED, 0], [39], [0, 1, 2]):
        (batch,) = ds.__getitems__(list(ids))
        np.testing.assert_array_equal(batch[0].numpy(), x[[int(i) for i in ids]])
    for bad in ([2, True], [True, 30], [False], [5, 1.0], [5, "6"], [5, None]):
        with pytest.raises(GadgetTypeError, match="integers"):
            ds.__getitems__(list(bad))
    with pytest.raises(GadgetIndexError, match="out of range"):
        ds.__getitems__([0, 40])
    with pytest.raises(GadgetIndexError, match="negative"):
        ds.__getitems__([3, -2])
    with pytest.raises((GadgetIndexError, GadgetTypeError)):
        ds.__getitems__([3, 2**63])
    # a list of 1-element tensors after an int is still read as ids, value by value
    (batch,) = ds.__getitems__([3, torch.tensor(5)])
    np.testing.assert_array_equal(batch[0].numpy(), x[[3, 5]])


@pytest.mark.gpu
def test_default_form_ids_are_page_locked(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.random.default_rng(1).standard_normal((300, 4)).astype(np.float32)
    ds = gl.GadgetDataset(x, np.arange(300), placement="cuda", device=device)
    seen: list[torch.Tensor] = []
    inner = ds._gather

    def spy(ids: torch.Tensor, own: bool) -> Any:
        seen.append(ids)
        return inner(ids, own=own)

    monkeypatch.setattr(ds, "_gather", spy)
    got = [(xb.cpu(), yb.cpu()) for xb, yb in DataLoader(ds, batch_size=64, shuffle=True)]
    assert len(seen) == len(got) == 5
    assert all(t.is_pinned() and t.device.type == "cpu" for t in seen)
    assert sorted(torch.cat([yb for _, yb in got]).tolist()) == list(range(300))
    for xb, yb in got:
        assert torch.equal(xb, torch.from_numpy(x[yb.numpy()]))
    ds.close()
