"""GadgetDataset's per-column routes: which columns skip ``Store.gather`` (one kernel launch
per batch, or CPU indexing of the host view) and that those batches are the general path's,
bit for bit."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader._device import cupy_available
from gadgetloader.data import GadgetDataset, GadgetSampler, _dataset
from gadgetloader.stores import Store
from gadgetloader.transfer import _engine, _kernels

N = 1000
CUDA0 = torch.device("cuda", 0)


# ---- which route a column takes (CPU: stores with CUDA-looking views that hold no memory) ----
class _MetaView:
    """Looks like a CUDA table view to the route choice (shape, dtype, device, strides)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self._t = torch.empty(shape, dtype=dtype, device="meta")
        self.device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


class _FakeGpuStore(Store):
    placement = "cuda"

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        *,
        host: bool = False,
        device: torch.device = CUDA0,
    ) -> None:
        super().__init__(shape, dtype)
        self._dv: Any = _MetaView(shape, dtype, device)
        self._hv: Any = torch.empty(shape, dtype=dtype, device="meta") if host else None
        self.device_view_calls = 0

    def device_view(self) -> Any:
        self.device_view_calls += 1
        return self._dv

    def host_view(self) -> Any:
        return self._hv

    def _release(self) -> None:
        self._dv = self._hv = None


@pytest.fixture
def cupy_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "cupy_available", lambda: True)


def test_kernel_route_for_tables_up_to_the_sort_threshold(cupy_here: None) -> None:
    small = _FakeGpuStore((N, 128))
    assert _dataset._route(small, "auto", CUDA0) == "kernel"
    assert _dataset._route(small, "kernel", CUDA0) == "kernel"
    for other in ("sorted", "hybrid", "torch"):
        assert _dataset._route(small, other, CUDA0) == "store", other
    assert _dataset._route(small, "no-such", CUDA0) == "store"  # Store.gather reports it
    assert _dataset._route(small, "auto", torch.device("cuda", 1)) == "store"  # another GPU
    limit = _engine.SORT_ABOVE_BYTES
    at = _FakeGpuStore((limit // 512, 128), host=True)  # 512 B rows: exactly the threshold
    assert at.nbytes == limit and _dataset._route(at, "auto", CUDA0) == "kernel"


def test_no_kernel_route_above_the_threshold_unless_forced(
    cupy_here: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = _FakeGpuStore((_engine.SORT_ABOVE_BYTES // 512 + 1, 128), host=True)
    assert big.nbytes > _engine.SORT_ABOVE_BYTES
    assert _dataset._route(big, "auto", CUDA0) == "store"  # sorted / hybrid past 1024 ids
    assert _dataset._route(big, "kernel", CUDA0) == "kernel"
    # the engine's threshold, read when the plan is made (not a copy of its value)
    monkeypatch.setattr(_engine, "SORT_ABOVE_BYTES", N * 512 - 1)
    assert _dataset._route(_FakeGpuStore((N, 128)), "auto", CUDA0) == "store"
    assert _dataset._route(_FakeGpuStore((N, 128)), "kernel", CUDA0) == "kernel"


def test_no_kernel_route_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "cupy_available", lambda: False)  # the 'torch' strategy
    for strategy in ("auto", "kernel"):
        assert _dataset._route(_FakeGpuStore((N, 8)), strategy, CUDA0) == "store"


def test_host_route_reads_no_cuda_view(cupy_here: None) -> None:
    store = _FakeGpuStore((N, 8), host=True)
    assert _dataset._route(store, "auto", torch.device("cpu")) == "host"  # a worker's target
    assert store.device_view_calls == 0  # a worker never touches CUDA
    assert _dataset._route(_FakeGpuStore((N, 8)), "auto", torch.device("cpu")) == "store"


def test_routes_of_cpu_and_file_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 4)).astype(np.float32)
    y = rng.integers(0, 9, (N, 2, 3)).astype(np.int16)
    np.save(tmp_path / "y.npy", y)
    ds = GadgetDataset(x, str(tmp_path / "y.npy"), placement="file", device="cpu")
    assert [g.placement for g in ds.columns] == ["cpu", "file"]
    assert ds._routes() == ("host", "store")  # a file store moves rows its own way

    def no_store_gather(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a host-route column went through Store.gather")

    monkeypatch.setattr(Store, "gather", no_store_gather)
    for ids in GadgetSampler(ds, batch_size=128, seed=1):
        xb, yb = ds.gather(ids)
        np.testing.assert_array_equal(xb.numpy(), x[ids.numpy()])
        np.testing.assert_array_equal(yb.numpy(), y[ids.numpy()])


def test_host_route_equals_store_gather_for_every_id_form() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, 3, 2)).astype(np.float64)
    ds = GadgetDataset(x, placement="cpu", device="cpu")
    store = ds.columns[0].store
    forms: list[Any] = [
        torch.tensor([5, 0, 999, 5]),
        torch.arange(40)[::3],  # strided
        np.array([[1, 2, 3], [4, 5, 6]]).T,  # 2-D, not contiguous
        torch.tensor(7),  # 0-d
        torch.empty(0, dtype=torch.int64),
        [3, 3, 1],
    ]
    assert ds._routes() == ("host",)
    for ids in forms:
        (got,) = ds.gather(ids)
        expect = store.gather(torch.as_tensor(np.asarray(ids)), torch.device("cpu"))
        assert got.shape == expect.shape == (*np.asarray(ids).shape, 3, 2)
        assert got.numpy().tobytes() == expect.numpy().tobytes()
        np.testing.assert_array_equal(got.numpy(), x[np.asarray(ids)])


def test_plan_keeps_no_view_of_a_closed_table() -> None:
    g = gl.DataGadget(np.ones((N, 4), np.float32), placement="cpu", device="cpu")
    ds = GadgetDataset(g, device="cpu")
    ids = next(iter(GadgetSampler(ds, batch_size=10, seed=0)))
    assert ds._routes() == ("host",) and ds.gather(ids)[0].sum() == 40
    host = weakref.ref(g.store.host_view())  # type: ignore[arg-type]
    g.close()
    gc.collect()
    assert host() is None  # the dataset's plan did not keep the table's memory
    with pytest.raises(gl.GadgetClosedError):
        ds.gather(ids)


def test_kernel_gather_hands_the_kernel_dense_flat_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel route's batch-time code, with the launch emulated on the CPU (the
    prepared launch densifies strided ids itself: test_review_session15_kernels)."""
    seen: list[tuple[int, tuple[int, ...], bool]] = []

    def launch(
        table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, *, dedup: bool = False
    ) -> None:
        seen.append((ids.dim(), tuple(out.shape), dedup))
        assert out.is_contiguous() and out.dtype == table.dtype
        torch.index_select(table, 0, ids, out=out)  # what the kernel computes

    monkeypatch.setattr(_kernels, "gather_rows", launch)
    view = torch.randn(50, 3, 2)
    for dedup in (False, True):
        for ids in (
            torch.arange(10),
            torch.arange(40)[::3],  # strided
            torch.tensor([[1, 2], [3, 4]]).T,  # 2-D, not contiguous
            torch.tensor(7),
            torch.empty(0, dtype=torch.int64),
        ):
            out = _dataset._kernel_gather(view, (3, 2), ids, dedup=dedup)
            assert seen[-1] == (1, (ids.numel(), 3, 2), dedup)
            assert out.shape == (*ids.shape, 3, 2)
            assert torch.equal(out, view[ids])


# ---- on a GPU: the kernel route itself --------------------------------------------------------
GPU_PLACEMENTS = [
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    pytest.param("pinned", id="pinned", marks=[pytest.mark.gpu, NEEDS_CUPY]),
]


def _columns() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, 16)).astype(np.float32)
    y = rng.permutation(N).astype(np.int64)  # 1-D labels
    z = rng.standard_normal((N, 3, 5)).astype(np.float16)  # 30 B rows: 2-byte vectors
    return x, y, z


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("placement", GPU_PLACEMENTS)
def test_gpu_columns_take_the_kernel_route(placement: str) -> None:
    ds = GadgetDataset(*_columns(), placement=placement, device="cuda")
    expect = "kernel" if cupy_available() else "store"  # without CuPy: the 'torch' strategy
    assert ds._routes() == (expect,) * 3


@NEEDS_CUPY
@pytest.mark.parametrize("placement", GPU_PLACEMENTS)
def test_kernel_route_batches_equal_numpy_and_the_general_path(
    placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cols = _columns()
    ds = GadgetDataset(*cols, placement=placement, device="cuda")
    assert ds._routes() == ("kernel",) * 3

    def refuse(*args: object, **kwargs: object) -> Any:
        raise AssertionError("a kernel-route column went through the general path")

    monkeypatch.setattr(Store, "gather", refuse)
    monkeypatch.setattr(_engine, "gather_many", refuse)
    side = torch.cuda.Stream()
    got = []
    it = iter(DataLoader(ds, batch_sampler=GadgetSampler(ds, batch_size=96, seed=5)))
    for k in range(11):
        if k % 4 == 3:  # gathered on another stream now and then
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                batch = next(it)
            torch.cuda.current_stream().wait_stream(side)
        else:
            batch = next(it)
        got.append([t.cpu() for t in batch])
    with pytest.raises(StopIteration):
        next(it)
    loader = [[t.cpu() for t in b] for b in gl.GadgetLoader(ds, batch_size=96, seed=5)]
    assert len(got) == len(loader) == 11
    for a, b in zip(got, loader, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    seen = np.concatenate([b[1].numpy() for b in got])
    assert sorted(seen.tolist()) == list(range(N))  # y is a permutation: every row once
    order = np.argsort(cols[1])  # row of each label
    for b in got:
        rows = order[b[1].numpy()]
        for t, c in zip(b, cols, strict=True):
            np.testing.assert_array_equal(t.numpy(), c[rows])

    # checked ids of every form take the kernel route too
    cuda_ids = torch.arange(0, 200, device="cuda")
    forms: list[Any] = [
        [5, 0, 999, 5],
        np.array([[1, 2, 3], [4, 5, 6]]).T,
        cuda_ids[::3],  # strided CUDA ids
        torch.tensor(7),
        torch.empty(0, dtype=torch.int64),
    ]
    direct = [ds.gather(ids) for ids in forms]
    monkeypatch.undo()
    for ids, batch in zip(forms, direct, strict=True):
        host_ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids)
        for t, c, g in zip(batch, cols, ds.columns, strict=True):
            assert t.device == ds.device and t.shape == (*host_ids.shape, *c.shape[1:])
            np.testing.assert_array_equal(t.cpu().numpy(), c[host_ids])
            general = g.store.gather(
                torch.as_tensor(host_ids).to(ds.device).contiguous(), ds.device
            )
            assert _bytes(t) == _bytes(general)


@NEEDS_CUPY
@pytest.mark.parametrize("placement", GPU_PLACEMENTS)
def test_threshold_and_strategies_on_the_gpu(
    placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _columns()[0]
    forced = gl.DataGadget(x, placement=placement, device="cuda", strategy="kernel")
    sort = gl.DataGadget(x, placement=placement, device="cuda", strategy="sorted")
    auto = gl.DataGadget(x, placement=placement, device="cuda")
    ds = GadgetDataset(auto, forced, sort)
    assert ds._routes() == ("kernel", "kernel", "store")
    monkeypatch.setattr(_engine, "SORT_ABOVE_BYTES", x.nbytes - 1)  # x is now "large"
    ds = GadgetDataset(auto, forced, sort)
    assert ds._routes() == ("store", "kernel", "store")
    batches = [*GadgetSampler(ds, batch_size=300, seed=2), torch.randint(0, N, (3000,))]
    for ids in batches:  # the last has > 1024 ids: auto sorts them
        for t in ds.gather(ids):
            np.testing.assert_array_equal(t.cpu().numpy(), x[ids.numpy()])
    forced._strategy = "sorted"  # a plan follows a column's strategy
    assert ds._routes() == ("store", "store", "store")


@pytest.mark.parametrize("placement", GPU_PLACEMENTS)
def test_closed_gpu_column_raises(placement: str) -> None:
    g = gl.DataGadget(_columns()[0], placement=placement, device="cuda")
    ds = GadgetDataset(g)
    ids = next(iter(GadgetSampler(ds, batch_size=64, seed=0)))
    assert ds.gather(ids)[0].shape == (64, 16)
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        ds.gather(ids)
