"""Session 45's fixes, from four black-box reviews of the documented API.

- An index into the row given as a 0-d uint8 tensor or array is an int, not a mask, and a
  1-element tensor there is refused: before, reads took the wrong part and writes went
  into a copy (nothing written, no error).
- ``load(progress='False')`` is refused on a ``file`` table as on every other.
- A .npy ``file`` table's write that the file takes only in part (a full disk) is written
  on, and raises ``GadgetFileError`` where the file takes no more (it returned normally).
- A zarr array named with a backslash (``'g\\x'``, which zarr reads as ``'g/x'``) reads
  its rows (it read the fill value); names the formats cannot store are refused on save.
- ``convert`` refuses a destination that holds the source's rows (a zarr array inside
  it, an HDF5 external link's target file).
- ``GadgetDataset`` rows of 0-d ids collate by stacking (``ConcatDataset``, per-sample
  fetchers): they were concatenated, losing or breaking the batch axis.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

import gadgetloader as gl
from gadgetloader.convert import convert
from gadgetloader.io import _npy

zarr = pytest.importorskip("zarr")

from conftest import MEMORY_PLACEMENTS  # noqa: E402

PLACEMENTS = [*MEMORY_PLACEMENTS, "file"]


def _table(tmp_path, placement):
    data = np.arange(30, dtype=np.float32).reshape(5, 3, 2)
    if placement == "file":
        np.save(tmp_path / "t.npy", data)
        return gl.DataGadget(str(tmp_path / "t.npy"), placement="file"), data
    return gl.DataGadget(torch.from_numpy(data.copy()), placement=placement), data


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "index",
    [
        torch.tensor(1, dtype=torch.uint8),
        np.array(1, dtype=np.uint8),
        torch.tensor(1),
        np.int16(1),
    ],
    ids=["torch-uint8", "numpy-uint8", "torch-int64", "numpy-int16"],
)
def test_zero_d_index_into_row_is_an_int(tmp_path, placement, index):
    g, data = _table(tmp_path, placement)
    got = g[[1, 2], index]
    np.testing.assert_array_equal(got.cpu().numpy(), data[[1, 2], 1])
    g[[1, 2], index] = torch.full((2, 2), -7.0)
    expected = data.copy()
    expected[[1, 2], 1] = -7.0
    np.testing.assert_array_equal(g[:].cpu().numpy(), expected)
    g.insertData(torch.full((2, 2), 9.0), ([3, 4], index))
    expected[[3, 4], 1] = 9.0
    np.testing.assert_array_equal(g[:].cpu().numpy(), expected)
    g.close()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "index", [torch.tensor([1]), torch.tensor([[0]]), np.array([1])], ids=["t1", "t11", "a1"]
)
def test_index_into_row_of_one_element_array_is_refused(tmp_path, placement, index):
    g, data = _table(tmp_path, placement)
    with pytest.raises(gl.GadgetTypeError, match="shape"):
        g[[1, 2], index]
    with pytest.raises(gl.GadgetTypeError, match="slices and ints"):
        g[[1, 2], index] = torch.full((2, 1, 2), -5.0)
    with pytest.raises(gl.GadgetTypeError, match="slices and ints"):
        g.insertData(torch.full((2, 1, 2), 99.0), (slice(1, 3), index))
    np.testing.assert_array_equal(g[:].cpu().numpy(), data)
    g.close()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_load_progress_string_refused_everywhere(tmp_path, placement):
    g, data = _table(tmp_path, placement)
    other = tmp_path / "o.npy"
    np.save(other, data + 1)
    with pytest.raises(gl.GadgetTypeError, match="progress must be True or False"):
        g.load(str(other), progress="False")
    np.testing.assert_array_equal(g[:].cpu().numpy(), data)
    g.load(str(other), progress=0)
    np.testing.assert_array_equal(g[:].cpu().numpy(), data + 1)
    g.close()


class _ShortWrites:
    """A file whose writes take at most ``most`` bytes (0: nothing, a full disk)."""

    def __init__(self, f, most):
        self._f, self._most = f, most

    def write(self, b):
        return self._f.write(memoryview(b)[: self._most])

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_npy_short_writes_are_written_on(tmp_path, monkeypatch):
    path = tmp_path / "s.npy"
    np.save(path, np.zeros((300, 16), np.float32))
    g = gl.DataGadget(str(path), placement="file", cache_bytes=0)
    real = _npy.NpySource._file
    monkeypatch.setattr(_npy.NpySource, "_file", lambda self: _ShortWrites(real(self), 100))
    rows = torch.arange(200 * 16, dtype=torch.float32).reshape(200, 16)
    g.insertData(rows, list(range(50, 250)))
    monkeypatch.undo()
    g.close()
    got = np.load(path)
    np.testing.assert_array_equal(got[50:250], rows.numpy())
    assert not got[:50].any() and not got[250:].any()


def test_npy_write_that_the_file_refuses_raises(tmp_path, monkeypatch):
    path = tmp_path / "s.npy"
    np.save(path, np.zeros((300, 16), np.float32))
    g = gl.DataGadget(str(path), placement="file", cache_bytes=0)
    real = _npy.NpySource._file
    monkeypatch.setattr(_npy.NpySource, "_file", lambda self: _ShortWrites(real(self), 0))
    with pytest.raises(gl.GadgetFileError, match="is the disk full"):
        g.insertData(torch.ones(20, 16), list(range(20)))
    monkeypatch.undo()
    g.close()


def _nested_zarr(path):
    root = zarr.open_group(str(path), mode="w")
    arr = root.create_array("g/x", shape=(4, 2), dtype="f4", chunks=(2, 2))
    arr[:] = np.arange(1, 9, dtype="f4").reshape(4, 2)
    root.create_array("g/y", shape=(4, 2), dtype="f4", chunks=(2, 2))[:] = 2
    return np.arange(1, 9, dtype="f4").reshape(4, 2)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_zarr_backslash_name_reads_the_array(tmp_path, placement):
    want = _nested_zarr(tmp_path / "b.zarr")
    g = gl.DataGadget(str(tmp_path / "b.zarr"), dataset="g\\x", placement=placement)
    np.testing.assert_array_equal(g.getNumpyVersion(), want)
    g.close()


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
@pytest.mark.parametrize("name", ["x\\y", "a\x00b", "\udcff", "a/zarr.json", ".zarray"])
def test_save_refuses_names_the_format_cannot_store(tmp_path, suffix, name):
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    target = tmp_path / ("t" + suffix)
    with pytest.raises(gl.GadgetValueError, match="not a valid"):
        g.save(str(target), dataset=name)
    assert not os.path.exists(target)


def test_convert_refuses_zarr_store_holding_the_source(tmp_path):
    _nested_zarr(tmp_path / "s.zarr")
    with pytest.raises(gl.GadgetValueError, match="would replace"):
        convert(str(tmp_path / "s.zarr" / "g" / "x"), str(tmp_path / "s.zarr"))
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    np.testing.assert_array_equal(root["g/y"][:], np.full((4, 2), 2, "f4"))


def test_convert_refuses_external_link_target(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["data"] = np.ones((4, 2), "f4")
        f["keep_me"] = np.arange(3)
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f["x"] = h5py.ExternalLink("other.h5", "/data")
    with pytest.raises(gl.GadgetValueError, match="would replace"):
        convert(str(tmp_path / "src.h5"), str(tmp_path / "other.h5"), dataset="x")
    with h5py.File(tmp_path / "other.h5", "r") as f:
        assert sorted(f) == ["data", "keep_me"]
    # another destination works and holds the linked rows
    convert(str(tmp_path / "src.h5"), str(tmp_path / "out.npy"), dataset="x")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), np.ones((4, 2), "f4"))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_concat_dataset_batches_stack_like_tensor_dataset(batch_size):
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    ds = gl.GadgetDataset(x, y, device="cpu")
    ref = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    for order in ("sequential", "random"):

        def sampler(order=order):
            return gl.GadgetSampler(20, batch_size=batch_size, order=order, seed=3)

        got = list(DataLoader(ConcatDataset([ds, ds]), batch_sampler=sampler()))
        want = list(DataLoader(ConcatDataset([ref, ref]), batch_sampler=sampler()))
        assert len(got) == len(want)
        for (gx, gy), (wx, wy) in zip(got, want, strict=True):
            assert gx.shape == wx.shape and gy.shape == wy.shape
            torch.testing.assert_close(gx, wx, rtol=0, atol=0)
            torch.testing.assert_close(gy, wy, rtol=0, atol=0)


def test_rows_of_zero_d_ids_stack_and_batches_concatenate():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    ds = gl.GadgetDataset(x, device="cpu")
    from torch.utils.data import default_collate

    (stacked,) = default_collate([ds[torch.tensor(1)], ds[np.array(2)]])
    np.testing.assert_array_equal(stacked.numpy(), x[[1, 2]])
    (cat,) = default_collate([ds[[1, 2]], ds[[3]]])
    np.testing.assert_array_equal(cat.numpy(), x[[1, 2, 3]])
    (one,) = default_collate([ds[[4, 5]]])
    np.testing.assert_array_equal(one.numpy(), x[[4, 5]])
    with pytest.raises(gl.GadgetTypeError, match="one kind of index"):
        default_collate([ds[torch.tensor(1)], ds[[2]]])
