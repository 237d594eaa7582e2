"""The per-batch fast path: a sampler's own ids skip the range check and, on the GPU, the
per-batch id copy; lists from torch's BatchSampler take a one-pass conversion."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader import GadgetIndexError, GadgetTypeError
from gadgetloader.data import GadgetDataset, GadgetSampler, _dataset, _loader, _sampler
from gadgetloader.data._sampler import sampler_ids_bound

N = 1000


def _no_check(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("the sampler's own ids were range-checked again")


# ---- tagging ------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["random", "sequential", "chunk"])
@pytest.mark.parametrize("pad", [False, True])
def test_sampler_ids_are_tagged(order: str, pad: bool) -> None:
    s = GadgetSampler(N, batch_size=64, order=order, chunk_rows=10, pad=pad, num_replicas=3, rank=2)
    batches = list(s)
    assert batches and all(sampler_ids_bound(b) == N for b in batches)
    if order == "random" and not pad:
        # a batch is a view of the epoch order, not a copy
        assert all(b._base is not None and b._base is batches[0]._base for b in batches[:-1])


def test_tag_is_lost_by_changes_and_copies() -> None:
    s = GadgetSampler(N, batch_size=64, seed=1)
    b0, b1 = next(iter(s)), None
    assert sampler_ids_bound(b0) == N
    assert sampler_ids_bound(b0.clone()) is None
    assert sampler_ids_bound(b0.to(torch.int32)) is None
    assert sampler_ids_bound(b0.view(torch.float64)) is None  # a view of another dtype
    assert sampler_ids_bound(b0.tolist()) is None
    assert sampler_ids_bound(torch.arange(10)) is None
    b1 = b0[3:9]
    assert sampler_ids_bound(b1) == N  # a view of the order: still in range
    b0.add_(0)  # any in-place change, even a no-op, bumps the version counter
    assert sampler_ids_bound(b0) is None and sampler_ids_bound(b1) is None


def test_dataset_skips_the_check_for_sampler_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(N, 3)
    ds = GadgetDataset(x, torch.arange(N), placement="cpu", device="cpu")
    monkeypatch.setattr(_dataset, "_checked_ids", _no_check)
    seen = []
    for xb, ids in DataLoader(ds, batch_sampler=GadgetSampler(ds, batch_size=100, seed=3)):
        assert torch.equal(xb, x[ids])
        seen.append(ids)
    assert sorted(torch.cat(seen).tolist()) == list(range(N))
    with pytest.raises(AssertionError, match="range-checked"):
        ds.gather(torch.arange(5))  # anything else is still checked


def test_changed_sampler_ids_are_checked_again() -> None:
    ds = GadgetDataset(torch.randn(N, 3), placement="cpu", device="cpu")
    ids = next(iter(GadgetSampler(ds, batch_size=10, seed=0)))
    ids[0] = N + 5  # in place: the tag no longer vouches for the values
    with pytest.raises(GadgetIndexError, match="out of range"):
        ds.gather(ids)


def test_sampler_for_more_rows_than_the_dataset_is_checked() -> None:
    small = GadgetDataset(torch.randn(100, 2), placement="cpu", device="cpu")
    ids = torch.cat(list(GadgetSampler(N, batch_size=N, order="sequential")))[-10:]
    with pytest.raises(GadgetIndexError):
        small.gather(ids)
    big_ids = next(iter(GadgetSampler(N, batch_size=N, seed=0)))
    with pytest.raises(GadgetIndexError):
        small.gather(big_ids)
    ok = next(iter(GadgetSampler(50, batch_size=50, seed=0)))  # fewer rows: in range
    assert torch.equal(small.gather(ok)[0], small.columns[0].getData(ok))


def test_epoch_order_is_a_copy() -> None:
    s = GadgetSampler(N, batch_size=100, seed=2)
    before = torch.cat(list(s))
    s.set_epoch(0)
    s.epoch_order().zero_()
    assert torch.equal(torch.cat(list(s)), before)


def test_inference_mode() -> None:
    x = torch.randn(N, 2)
    ds = GadgetDataset(x, torch.arange(N), placement="cpu", device="cpu")
    s = GadgetSampler(ds, batch_size=128, seed=4)
    with torch.inference_mode():
        got = list(DataLoader(ds, batch_sampler=s))
    assert sorted(torch.cat([ids for _, ids in got]).tolist()) == list(range(N))
    assert all(torch.equal(xb, x[ids]) for xb, ids in got)


def test_int32_orders_above_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = [b.clone() for b in GadgetSampler(N, batch_size=64, seed=9)]
    monkeypatch.setattr(_sampler, "WIDE_ORDER_ROWS", 100)
    s = GadgetSampler(N, batch_size=64, seed=9)
    assert s.epoch_order().dtype == torch.int64  # public form unchanged
    assert s._order_future(0, background=False).result().dtype == torch.int32  # type: ignore[union-attr]
    narrow = list(s)
    assert all(b.dtype == torch.int64 and sampler_ids_bound(b) == N for b in narrow)
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow, strict=True))  # same order


# ---- the GPU window of the order (its bookkeeping, run on the CPU here) -----------------------
def test_order_window_uploads_once_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dataset, "WINDOW_IDS", 256)
    win = _dataset._OrderWindow(torch.device("cpu"))
    s = GadgetSampler(N, batch_size=100, seed=5)
    for epoch in range(2):
        for b in s:
            got = win.slice(b)
            assert got is not None and torch.equal(got, b)
        # windows of 256 ids start at the first batch that misses: 5 uploads, not 10 copies
        assert win.uploads == 5 * (epoch + 1)
    assert win.slice(torch.arange(10)) is None  # not a view of an order
    assert win.slice(next(iter(s))[::2]) is None  # not contiguous
    s.set_epoch(1)  # back to an earlier position: a new window from there
    first = next(iter(s))
    assert torch.equal(win.slice(first), first) and win.lo == 0  # type: ignore[arg-type]
    assert win.uploads == 11


def test_order_window_shared_by_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(_dataset, "WINDOW_IDS", 64)  # many uploads, many chances to race
    win = _dataset._OrderWindow(torch.device("cpu"))
    bad: list[int] = []

    def run(seed: int) -> None:
        s = GadgetSampler(N, batch_size=50, seed=seed)
        for _ in range(30):
            for b in s:
                got = win.slice(b)
                if got is None or not torch.equal(got, b):
                    bad.append(seed)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and win.uploads >= 3 * 30 * 10


def test_dataset_pickles_without_gpu_windows() -> None:
    ds = GadgetDataset(torch.randn(10, 2), placement="cpu", device="cpu")
    ds._window(torch.device("cpu"))
    assert ds._windows
    again = pickle.loads(pickle.dumps(ds))
    assert again._windows == {} and torch.equal(again[3][0], ds[3][0])


# ---- GadgetLoader groups ------------------------------------------------------------------------
def test_joined_groups_stay_views_of_the_order() -> None:
    batches = list(GadgetSampler(N, batch_size=64, seed=6))
    joined = _loader._joined(batches[2:6])
    assert joined._base is batches[0]._base and sampler_ids_bound(joined) == N
    assert torch.equal(joined, torch.cat(batches[2:6]))
    gap = _loader._joined([batches[1], batches[3]])  # not consecutive: a concatenation
    assert gap._base is None and torch.equal(gap, torch.cat([batches[1], batches[3]]))
    mixed = _loader._joined([batches[0], torch.arange(3)])
    assert torch.equal(mixed, torch.cat([batches[0], torch.arange(3)]))


def test_grouped_loader_skips_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(N, 4)
    ds = GadgetDataset(x, torch.arange(N), placement="cpu", device="cpu")
    monkeypatch.setattr(_dataset, "_checked_ids", _no_check)
    loader = gl.GadgetLoader(ds, batch_size=96, seed=1, coalesce=4)
    got = list(loader)
    assert [len(b[1]) for b in got] == [96] * 10 + [40]
    assert sorted(torch.cat([ids for _, ids in got]).tolist()) == list(range(N))
    assert all(torch.equal(xb, x[ids]) for xb, ids in got)


# ---- the default form's lists -------------------------------------------------------------------
def test_getitems_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(0).standard_normal((N, 3)).astype(np.float32)
    ds = GadgetDataset(x, placement="cpu", device="cpu")
    ids = [5, 0, 999, 5]
    (batch,) = ds.__getitems__(ids)
    np.testing.assert_array_equal(batch[0].numpy(), x[ids])
    (batch,) = ds.__getitems__([np.int64(7), 3])  # NumPy ints after a Python int: same path
    np.testing.assert_array_equal(batch[0].numpy(), x[[7, 3]])
    with pytest.raises(GadgetIndexError, match="out of range"):
        ds.__getitems__([1, N])
    with pytest.raises(GadgetIndexError, match="negative"):
        ds.__getitems__([1, -1])
    with pytest.raises(GadgetTypeError, match="integers"):
        ds.__getitems__([1, 2.5])  # not truncated to 2
    with pytest.raises(GadgetTypeError, match="integers"):
        ds.__getitems__([True, False])
    with pytest.raises((GadgetIndexError, GadgetTypeError)):
        ds.__getitems__([1, 2**70])
    assert ds.__getitems__([])[0][0].shape == (0, 3)


def test_default_form_list_path_values() -> None:
    x = torch.randn(N, 5)
    ds = GadgetDataset(x, torch.arange(N), placement="cpu", device="cpu")
    torch.manual_seed(1)
    got = list(DataLoader(ds, batch_size=128, shuffle=True))
    assert [len(b[1]) for b in got] == [128] * 7 + [104]
    assert sorted(torch.cat([ids for _, ids in got]).tolist()) == list(range(N))
    assert all(torch.equal(xb, x[ids]) for xb, ids in got)


# ---- on a GPU: the ids come from the order's window, on any stream ------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["cuda", "pinned"])
def test_gpu_batches_slice_the_window(placement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gadgetloader._device import cupy_available

    if placement == "pinned" and not cupy_available():
        pytest.skip("pinned needs CuPy")
    x = torch.randn(N, 16)
    ds = GadgetDataset(x, torch.arange(N), placement=placement, device="cuda")
    copies = []
    real = _dataset._ids_on

    def counting(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append(ids.numel())
        return real(ids, device)

    monkeypatch.setattr(_dataset, "_ids_on", counting)
    monkeypatch.setattr(_dataset, "_checked_ids", _no_check)
    side = torch.cuda.Stream()
    got = []
    for k, ids in enumerate(GadgetSampler(ds, batch_size=64, seed=2)):
        stream = side if k % 3 == 1 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            xb, back = ds.gather(ids)
            got.append((xb.clone(), back.clone(), ids))
    torch.cuda.synchronize()
    assert copies == [N]  # one upload of the order, no per-batch copy
    for xb, back, ids in got:
        assert torch.equal(back.cpu(), ids) and torch.equal(xb.cpu(), x[ids])
    loader_got = list(gl.GadgetLoader(ds, batch_size=64, seed=2, prefetch=2, coalesce=4))
    assert len(copies) == 2  # the loader's sampler has its own order: one more upload
    assert len(loader_got) == len(got) == 16
    for (xb, back, _), (lx, lback) in zip(got, loader_got, strict=True):
        assert torch.equal(lback, back) and torch.equal(lx, xb)


def test_plan_follows_replaced_and_closed_stores(tmp_path: Path) -> None:
    g = gl.DataGadget(np.zeros((N, 2), np.float32), placement="cpu", device="cpu")
    ds = GadgetDataset(g, device="cpu")
    s = GadgetSampler(ds, batch_size=100, seed=0)
    ids = next(iter(s))
    assert ds.gather(ids)[0].abs().sum() == 0  # the plan is made here
    path = tmp_path / "ones.npy"
    np.save(path, np.ones((N, 2), np.float32))
    g.load(path)  # replaces the gadget's store
    assert torch.equal(ds.gather(ids)[0], torch.ones(100, 2))
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        ds.gather(ids)
