"""Regressions found by an independent review of the documented API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl


def _a() -> np.ndarray:
    return np.arange(24, dtype=np.float32).reshape(8, 3)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_saving_over_its_own_hdf5_or_zarr_group_keeps_the_dataset_name(
    tmp_path: Path, fmt: str
) -> None:
    a = _a()
    path = tmp_path / f"t.{fmt}"
    if fmt == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "w") as f:
            f["emb"] = a
        g = gl.DataGadget(str(path), placement="file", device="cpu")  # the dataset is found
    else:
        zarr = pytest.importorskip("zarr")
        zarr.open_group(str(path), mode="w").create_array("emb", data=a, chunks=(4, 3))
        g = gl.DataGadget(str(path), dataset="emb", placement="file", device="cpu")
    g.getData([1])
    g.save(str(path))  # no dataset=: the name it was read under is kept
    np.testing.assert_array_equal(g.getData([3]).numpy(), a[[3]])
    g.insertData(np.full((1, 3), 7, np.float32), [0])
    again = gl.DataGadget(str(path), dataset="emb", placement="cpu")
    expected = a.copy()
    expected[0] = 7
    np.testing.assert_array_equal(again.getNumpyVersion(), expected)


def test_saving_a_file_table_over_its_own_file_keeps_reads_current(tmp_path: Path) -> None:
    p = tmp_path / "a.npy"
    np.save(p, _a())
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    g.getData([1])  # maps the file
    g.save(str(p))
    g.insertData(np.zeros((1, 3), np.float32), [2])
    assert not g.getData(2).any() and not np.load(p)[2].any()  # reads see the new file


def test_load_keeps_file_options(tmp_path: Path) -> None:
    p, q = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(p, _a())
    np.save(q, _a() + 1)
    g = gl.DataGadget(str(p), placement="file", cache_bytes=0, writable=False, device="cpu")
    g.load(str(q))
    assert g.store.cache_bytes == 0 and not g.store.supports_writes
    assert g.getData([0]).tolist() == [[1.0, 2.0, 3.0]]


def test_out_is_checked(tmp_path: Path) -> None:
    g = gl.DataGadget(_a(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError, match=r"shape \(1, 3\)"):
        g.getData([1], out=torch.empty(2, 3))
    with pytest.raises(gl.GadgetTypeError, match="float32"):
        g.getData([1], out=torch.empty(1, 3, dtype=torch.float64))
    with pytest.raises(gl.GadgetValueError, match="contiguous"):
        g.getData([1, 2], out=torch.empty(3, 2).t())
    out = torch.empty(1, 3)
    assert g.getData([1], out=out) is out and out.tolist() == [[3.0, 4.0, 5.0]]


def test_hdf5_file_table_written_then_read_by_spawn_workers(tmp_path: Path) -> None:
    h = tmp_path / "t.h5"
    gl.DataGadget(_a(), placement="cpu").save(str(h))
    g = gl.DataGadget(str(h), placement="file", device="cpu")
    g.insertData(np.full((1, 3), 9, np.float32), [0])  # opens the file for writing
    ds = gl.GadgetDataset(g, device="cpu")
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    rows = torch.cat([b[0] for b in loader])
    expect = _a()
    expect[0] = 9
    assert np.array_equal(rows.numpy(), expect)
    g.insertData(np.full((1, 3), 5, np.float32), [1])  # and the parent can still write
    assert g.getData([1]).tolist() == [[5.0, 5.0, 5.0]]


def test_dataset_file_placement_applies_to_paths_only(tmp_path: Path) -> None:
    h = tmp_path / "t.h5"
    gl.DataGadget(_a(), placement="cpu").save(str(h))
    ds = gl.GadgetDataset(str(h), np.arange(8), placement="file", device="cpu")
    assert [c.placement for c in ds.columns] == ["file", "cpu"]
    x, y = ds[[3, 1]]
    assert y.tolist() == [3, 1] and np.array_equal(x.numpy(), _a()[[3, 1]])
