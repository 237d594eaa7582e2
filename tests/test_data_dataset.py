"""GadgetDataset: values against NumPy on every placement and file format, DataLoader forms."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

import gadgetloader as gl
from gadgetloader import GadgetIndexError, GadgetTypeError, GadgetValueError
from gadgetloader.data import GadgetBatch, GadgetDataset, GadgetSampler

N, D = 203, 6


@pytest.fixture
def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    y = rng.integers(0, 10, N).astype(np.int64)
    w = rng.standard_normal((N, 2, 3)).astype(np.float64)
    return x, y, w


def make(placement: str, device: torch.device, *cols: np.ndarray) -> GadgetDataset:
    return GadgetDataset(*cols, placement=placement, device=device)


def check_batch(
    batch: tuple[torch.Tensor, ...],
    cols: tuple[np.ndarray, ...],
    ids: np.ndarray,
    device: torch.device,
) -> None:
    assert len(batch) == len(cols)
    for t, c in zip(batch, cols, strict=True):
        assert t.device.type == device.type
        np.testing.assert_array_equal(t.cpu().numpy(), c[ids])


# ---- indexing -------------------------------------------------------------------------------
def test_indexing_forms(
    placement: str, device: torch.device, arrays: tuple[np.ndarray, ...]
) -> None:
    ds = make(placement, device, *arrays)
    assert len(ds) == N and ds.device.type == device.type
    row = ds[5]
    assert type(row) is tuple and [tuple(t.shape) for t in row] == [(D,), (), (2, 3)]
    check_batch(tuple(t[None] for t in row), arrays, np.array([5]), device)
    ids = np.array([3, 0, 202, 3])
    for form in (ids.tolist(), ids, torch.from_numpy(ids), torch.from_numpy(ids).int()):
        batch = ds[form]
        assert isinstance(batch, GadgetBatch) and isinstance(batch, tuple)
        check_batch(batch, arrays, ids, device)
    check_batch(ds[range(10, 20)], arrays, np.arange(10, 20), device)
    check_batch(ds[190:], arrays, np.arange(190, N), device)
    two_d = np.array([[1, 2], [3, 4]])
    assert ds[two_d][0].shape == (2, 2, D)
    check_batch(ds[[]], arrays, np.array([], dtype=np.int64), device)


def test_cuda_ids(placement: str, device: torch.device, arrays: tuple[np.ndarray, ...]) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA ids need a GPU")
    ds = make(placement, device, *arrays)
    ids = torch.tensor([7, 1, 7], device=device)
    check_batch(ds[ids], arrays, ids.cpu().numpy(), device)


def test_bad_ids(arrays: tuple[np.ndarray, ...]) -> None:
    ds = make("cpu", torch.device("cpu"), *arrays)
    with pytest.raises(GadgetIndexError, match=r"\[0, 202\]"):
        ds[[0, N]]
    with pytest.raises(GadgetIndexError):
        ds[N]
    with pytest.raises(GadgetIndexError, match=rf"\[-{N}, {N - 1}\]"):
        ds[-N - 1]  # ds[-1] is the last row, as in Python
    with pytest.raises(GadgetIndexError, match="negative"):
        ds[[-1]]
    with pytest.raises(GadgetTypeError, match="integers"):
        ds[[0.5, 1.0]]
    with pytest.raises(IndexError):  # Python's iteration protocol stops on it
        ds[10**9]
    assert len(list(iter(ds))) == N


# ---- the DataLoader forms ---------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 16, 50, N, 500])
def test_default_dataloader_form(
    placement: str, device: torch.device, arrays: tuple[np.ndarray, ...], batch_size: int
) -> None:
    x, y, w = arrays
    ids_col = np.arange(N)
    ds = make(placement, device, x, y, w, ids_col)
    torch.manual_seed(0)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True)
    seen = []
    sizes = []
    for batch in loader:
        assert isinstance(batch, GadgetBatch) and len(batch) == 4
        xb, yb, wb, ib = batch
        ids = ib.cpu().numpy()
        sizes.append(len(ids))
        assert (
            xb.shape == (len(ids), D) and yb.shape == (len(ids),) and wb.shape == (len(ids), 2, 3)
        )
        check_batch((xb, yb, wb), (x, y, w), ids, device)
        seen.append(ids)
    assert sorted(np.concatenate(seen).tolist()) == list(range(N))
    full, last = divmod(N, batch_size)
    assert sizes == [batch_size] * full + ([last] if last else [])
    assert not np.array_equal(np.concatenate(seen), np.arange(N)) or batch_size >= N


def test_default_form_drop_last_and_sequential(arrays: tuple[np.ndarray, ...]) -> None:
    ds = make("cpu", torch.device("cpu"), arrays[0], np.arange(N))
    batches = list(DataLoader(ds, batch_size=50, drop_last=True))
    assert [len(b[1]) for b in batches] == [50] * 4
    assert torch.cat([b[1] for b in batches]).tolist() == list(range(200))


def test_sampler_forms(
    placement: str, device: torch.device, arrays: tuple[np.ndarray, ...]
) -> None:
    x, y, _ = arrays
    ds = make(placement, device, x, y, np.arange(N))
    sampler = GadgetSampler(ds, batch_size=32, seed=1)
    fast = list(DataLoader(ds, batch_sampler=sampler))
    assert len(fast) == len(sampler) == 7 and all(isinstance(b, GadgetBatch) for b in fast)
    ids = torch.cat([b[2].cpu() for b in fast]).numpy()
    assert sorted(ids.tolist()) == list(range(N))
    for b in fast:
        check_batch(b[:2], (x, y), b[2].cpu().numpy(), device)
    # sampler= with batch_size=None: torch's default_convert hands back a list of columns
    again = GadgetSampler(ds, batch_size=32, seed=1)
    nobatch = list(DataLoader(ds, sampler=again, batch_size=None))
    assert [b[2].tolist() for b in nobatch] == [b[2].tolist() for b in fast]


def test_workers_gather_on_the_cpu(
    arrays: tuple[np.ndarray, ...], tmp_path: pytest.TempPathFactory
) -> None:
    x, y, _ = arrays
    path = os.path.join(str(tmp_path), "x.npy")
    np.save(path, x)
    ds = GadgetDataset(
        gl.DataGadget(path, placement="file", device="cpu"),
        y,
        np.arange(N),
        placement="cpu",
        device="cpu",
    )
    loader = DataLoader(ds, batch_sampler=GadgetSampler(ds, batch_size=40), num_workers=2)
    got = list(loader)
    assert all(isinstance(b, GadgetBatch) for b in got)
    ids = torch.cat([b[2] for b in got]).numpy()
    assert sorted(ids.tolist()) == list(range(N))
    for b in got:
        check_batch(b[:2], (x, y), b[2].numpy(), torch.device("cpu"))


def test_collate_passes_batches_through() -> None:
    a = GadgetBatch([torch.arange(3), torch.zeros(3, 2)])
    b = GadgetBatch([torch.arange(2), torch.ones(2, 2)])
    assert default_collate([a]) is a
    both = default_collate([a, b])
    assert isinstance(both, GadgetBatch) and both[0].tolist() == [0, 1, 2, 0, 1]
    assert both[1].shape == (5, 2)
    assert a.to("cpu")[0] is a[0]
    assert "GadgetBatch(" in repr(a)


# ---- files ---------------------------------------------------------------------------------------
def _write(fmt: str, path: str, x: np.ndarray) -> dict[str, str]:
    if fmt == "npy":
        np.save(path, x)
        return {}
    if fmt == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=x, chunks=(16, x.shape[1]))
        return {"dataset": "x"}
    zarr = pytest.importorskip("zarr")
    z = zarr.create_array(path, shape=x.shape, chunks=(24, x.shape[1]), dtype=x.dtype)
    z[:] = x
    return {}


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
@pytest.mark.parametrize("where", ["file", "memory"])
def test_file_columns(
    fmt: str,
    where: str,
    arrays: tuple[np.ndarray, ...],
    tmp_path: pytest.TempPathFactory,
    device: torch.device,
) -> None:
    x, y, _ = arrays
    path = os.path.join(str(tmp_path), f"x.{fmt}")
    opts = _write(fmt, path, x)
    placement = "file" if where == "file" else "cpu"
    ds = GadgetDataset(path, placement=placement, device=device, **opts)
    with ds:
        assert ds.columns[0].placement == placement
        if where == "file":
            assert ds.chunk_rows is not None and ds.chunk_rows > 0
        ids_col = np.arange(N)
        full = GadgetDataset(ds.columns[0], y, ids_col, placement="cpu", device=device)
        for order in ("random", "chunk") if where == "file" else ("random",):
            sampler = GadgetSampler(full, batch_size=37, order=order, seed=2)
            seen = []
            for xb, yb, ib in DataLoader(full, batch_sampler=sampler):
                check_batch((xb, yb), (x, y), ib.cpu().numpy(), device)
                seen.extend(ib.tolist())
            assert sorted(seen) == list(range(N))
    assert ds.columns[0].store.closed  # the dataset opened it, the dataset closed it


def test_dataset_closes_only_what_it_created(arrays: tuple[np.ndarray, ...]) -> None:
    mine = gl.DataGadget(arrays[0], placement="cpu", device="cpu")
    ds = GadgetDataset(mine, arrays[1], device="cpu")
    ds.close()
    assert not mine.store.closed and ds.columns[1].store.closed
    mine.close()


def test_auto_placement_and_repr(arrays: tuple[np.ndarray, ...]) -> None:
    ds = GadgetDataset(arrays[0], torch.from_numpy(arrays[1]))
    expected = "pinned" if torch.cuda.is_available() and gl._device.cupy_available() else "cpu"
    if torch.cuda.is_available() and not gl._device.cupy_available():
        expected = "cpu"
    assert [c.placement for c in ds.columns] == [expected, expected]
    assert ds.row_nbytes == D * 4 + 8
    assert "203 rows" in repr(ds)


# ---- bad input -------------------------------------------------------------------------------------
def test_columns_with_different_row_counts() -> None:
    with pytest.raises(
        GadgetValueError, match="same number of rows; got column 0: 10, column 1: 9"
    ):
        GadgetDataset(np.zeros((10, 2)), np.zeros(9), placement="cpu", device="cpu")


def test_empty_dataset() -> None:
    with pytest.raises(GadgetValueError, match="at least one column"):
        GadgetDataset()
    with pytest.raises(GadgetValueError, match="empty"):
        GadgetDataset(np.zeros((0, 3), np.float32), placement="cpu", device="cpu")


def test_bad_columns() -> None:
    with pytest.raises(GadgetTypeError, match="column 1 must be a DataGadget"):
        GadgetDataset(np.zeros(3), {"a": 1}, placement="cpu", device="cpu")
    with pytest.raises(GadgetValueError, match="0-d"):
        GadgetDataset(np.array(1.0), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetKeyError, match="Unknown placement"):
        GadgetDataset(np.zeros(3), placement="pined", device="cpu")


def test_dataloader_batch_size_must_be_positive(arrays: tuple[np.ndarray, ...]) -> None:
    ds = make("cpu", torch.device("cpu"), arrays[0])
    with pytest.raises(ValueError):
        DataLoader(ds, batch_size=0)
    with pytest.raises(GadgetValueError, match="batch_size must be >= 1"):
        GadgetSampler(ds, batch_size=0)


def test_bad_slices_of_a_dataset_raise_gadget_errors() -> None:
    """A slice with a zero step or non-integer bounds is refused with the library's own
    errors (catchable as ``GadgetError`` and as the builtin), as ``DataGadget`` refuses it;
    valid slices follow Python."""
    ds = GadgetDataset(np.arange(10), device="cpu")
    with pytest.raises(GadgetValueError, match="non-zero step"):
        ds[::0]
    for bad in (slice(0.5, 2), slice("a", None)):
        with pytest.raises(GadgetTypeError, match="integer bounds"):
            ds[bad]
    with pytest.raises(TypeError):  # the matching builtin
        ds[slice(0.5, 2)]
    assert ds[-3:][0].tolist() == [7, 8, 9]
    assert ds[::-4][0].tolist() == [9, 5, 1]


def test_drop_last_with_fewer_rows_than_a_batch_per_rank_is_refused() -> None:
    """``drop_last=True`` with fewer rows than ``num_replicas * batch_size`` would leave no
    batch: refused, saying so (documented in the sampler's docstring)."""
    with pytest.raises(GadgetValueError, match="leaves no batch"):
        GadgetSampler(1, batch_size=2, drop_last=True)
    with pytest.raises(GadgetValueError, match="leaves no batch"):
        GadgetSampler(10, batch_size=4, drop_last=True, num_replicas=3, rank=0)
    assert len(GadgetSampler(12, batch_size=4, drop_last=True, num_replicas=3, rank=2)) == 1


def test_file_placement_sends_in_memory_columns_to_memory(tmp_path) -> None:
    # placement='file' opens path columns file-backed; an array beside them has no file
    # and takes the default in-memory placement (documented in GadgetDataset's docstring)
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.save(tmp_path / "x.npy", x)
    y = np.arange(10)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), y, placement="file", device="cpu")
    assert [c.placement for c in ds.columns] == ["file", "cpu"]
    feats, labels = ds[[3, 1]]
    assert np.array_equal(feats.numpy(), x[[3, 1]]) and labels.tolist() == [3, 1]
