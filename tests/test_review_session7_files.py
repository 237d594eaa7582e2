"""Files, ids and saves: cases found by session 7's independent reviews (file formats,
README as a new user). Each failed before its fix; values are checked against NumPy,
h5py and zarr read directly."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.convert import convert

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

FILE_PLACEMENTS = ["cpu", "file"]


def _open(path, placement, **kw):
    return gl.DataGadget(path, placement=placement, device="cpu", **kw)


# ---- HDF5 external links, aliases ------------------------------------------------------------
@pytest.mark.parametrize("placement", FILE_PLACEMENTS)
def test_hdf5_dataset_behind_an_external_link_reads_the_linked_rows(tmp_path, placement):
    part = np.arange(40, dtype=np.float32).reshape(10, 4)
    with h5py.File(tmp_path / "part1.h5", "w") as f:
        f["data"] = part
    with h5py.File(tmp_path / "train.h5", "w") as f:
        f["data"] = np.full((10, 4), -7, np.float32)  # same name as the linked one
        f["features"] = h5py.ExternalLink("part1.h5", "/data")
    g = _open(str(tmp_path / "train.h5"), placement, dataset="features")
    np.testing.assert_array_equal(g.getData([0, 9, 3]).numpy(), part[[0, 9, 3]])
    out = tmp_path / "copy.npy"
    convert(str(tmp_path / "train.h5"), str(out), dataset="features")
    np.testing.assert_array_equal(np.load(out), part)


def test_hdf5_link_to_a_missing_file_name_is_a_gadget_error(tmp_path):
    with h5py.File(tmp_path / "part1.h5", "w") as f:
        f["data"] = np.ones((4, 2), np.float32)
    with h5py.File(tmp_path / "train.h5", "w") as f:
        f["features"] = h5py.ExternalLink("part1.h5", "/data")  # no /data in train.h5
    g = _open(str(tmp_path / "train.h5"), "file", dataset="features")
    np.testing.assert_array_equal(g.getData([1]).numpy(), np.ones((1, 2), np.float32))


def test_hdf5_soft_link_alias_shares_writes(tmp_path):
    path = str(tmp_path / "t.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((64, 4), np.float32), chunks=(8, 4), compression="gzip")
        f["alias"] = h5py.SoftLink("/x")
    a = _open(path, "file", dataset="x")
    b = _open(path, "file", dataset="alias")
    assert a.getData([5]).sum() == 0  # cached in a
    b.insertData(torch.ones(1, 4), [5])
    np.testing.assert_array_equal(a.getData([5]).numpy(), np.ones((1, 4), np.float32))


# ---- zarr: one array under two names; a replaced nested array --------------------------------
def test_zarr_array_opened_under_two_names_sees_writes(tmp_path):
    path = str(tmp_path / "s.zarr")
    gl.DataGadget(np.zeros((1000, 4), np.float32), placement="cpu").save(
        path, dataset="g/x", chunk_rows=64
    )
    a = _open(path, "file", dataset="g/x")
    b = _open(os.path.join(path, "g", "x"), "file")
    assert a.getData([5]).sum() == 0
    b.insertData(torch.ones(1, 4), [5])
    np.testing.assert_array_equal(a.getData([5]).numpy(), np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(zarr.open_array(os.path.join(path, "g", "x"))[5], np.ones(4))


def test_zarr_nested_array_replaced_by_a_save_is_detected(tmp_path):
    path = str(tmp_path / "t.zarr")
    gl.DataGadget(np.zeros((500, 4), np.float32), placement="cpu").save(
        path, dataset="g/x", chunk_rows=64
    )
    a = _open(path, "file", dataset="g/x")
    a.getData([1])
    gl.DataGadget(np.ones((500, 4), np.float32), placement="cpu").save(
        os.path.join(path, "g", "x"), format="zarr", chunk_rows=100
    )
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        a.getData([1])
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        a.insertData(torch.zeros(1, 4), [2])
    np.testing.assert_array_equal(zarr.open_array(os.path.join(path, "g", "x"))[2], np.ones(4))


# ---- dtype= casts that would overflow ----------------------------------------------------------
@pytest.mark.parametrize(
    "values,dtype",
    [
        (np.array([[100000, 1]]), "float16"),
        (np.array([[2**40]]), "float16"),
        (np.array([[1e300]]), "float32"),
        (np.array([[1e5]], np.float32), "float16"),
    ],
)
def test_casts_that_would_become_inf_are_refused(values, dtype):
    with pytest.raises(gl.GadgetValueError, match="would become inf"):
        gl.DataGadget(values, dtype=dtype, placement="cpu")


def test_infinite_source_values_stay_infinite():
    g = gl.DataGadget(np.array([[np.inf, 1.0]]), dtype="float32", placement="cpu")
    assert torch.isinf(g.as_tensor()[0, 0]) and g.as_tensor()[0, 1] == 1


# ---- saves keep permissions and symbolic links ----------------------------------------------
@pytest.mark.parametrize("fmt,name", [("npy", "t.npy"), ("hdf5", "t.h5"), ("zarr", "t.zarr")])
def test_save_keeps_the_mode_and_writes_through_a_symlink(tmp_path, fmt, name):
    real = tmp_path / name
    gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu").save(str(real), format=fmt)
    os.chmod(real, 0o700 if fmt == "zarr" else 0o600)
    link = tmp_path / ("link-" + name)
    os.symlink(real, link)
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    gl.DataGadget(data, placement="cpu").save(str(link), format=fmt)
    assert os.path.islink(link)
    assert stat.S_IMODE(os.stat(real).st_mode) == (0o700 if fmt == "zarr" else 0o600)
    back = gl.DataGadget(str(real), placement="cpu", device="cpu").as_tensor().numpy()
    np.testing.assert_array_equal(back, data)


def test_save_cupy_keeps_a_private_file_private(tmp_path):
    p = tmp_path / "secret.npy"
    np.save(p, np.zeros((3, 2), np.float32))
    os.chmod(p, 0o600)
    gl.DataGadget(str(p), placement="cpu", device="cpu").saveCupy(str(p))
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


# ---- loadTorch and NaN; zero-width rows; unsigned dtypes; odd ids ------------------------------
def test_load_torch_accepts_nan_in_an_exactly_converting_file(tmp_path):
    pf = gl.PytorchModelFactory(torch.nn.Embedding(10, 4), 100, 4, deviceType="cpu")
    y = torch.zeros(100, 4, dtype=torch.float64)
    y[0, 0] = float("nan")
    y[1, 1] = 0.5
    torch.save(y, tmp_path / "nan64.pt")
    pf.loadTorch(str(tmp_path / "nan64.pt"))
    got = pf.getNumpyVersion()
    assert np.isnan(got[0, 0]) and got[1, 1] == 0.5 and got.dtype == np.float32
    y[2, 2] = 0.1  # not exact in float32: refused, nothing written
    torch.save(y, tmp_path / "inexact.pt")
    with pytest.raises(gl.GadgetTypeError, match="converts exactly"):
        pf.loadTorch(str(tmp_path / "inexact.pt"))
    assert pf.getNumpyVersion()[2, 2] == 0


@pytest.mark.parametrize("placement", FILE_PLACEMENTS)
def test_zero_width_rows_write_as_a_no_op(tmp_path, placement):
    np.save(tmp_path / "w0.npy", np.zeros((10, 0), np.float32))
    g = _open(str(tmp_path / "w0.npy"), placement)
    g.insertData(torch.zeros(2, 0), [0, 5])
    assert tuple(g.getData([1, 2]).shape) == (2, 0)
    with pytest.raises(gl.GadgetIndexError, match="out of range"):
        g.insertData(torch.zeros(2, 0), [0, 50])


def test_wide_unsigned_arrays_convert_with_dtype(tmp_path):
    a = np.arange(6, dtype=np.uint16).reshape(3, 2) * 1000
    g = gl.DataGadget(a, dtype="int32", placement="cpu")
    np.testing.assert_array_equal(g.as_tensor().numpy(), a.astype(np.int32))
    with pytest.raises(gl.GadgetTypeError, match="dtype='int64'"):
        gl.DataGadget(a.astype(np.uint32), placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="beyond int32"):
        gl.DataGadget(np.array([[2**40]], np.uint64), dtype="int32", placement="cpu")
    np.save(tmp_path / "u16.npy", a)
    with pytest.raises(gl.GadgetTypeError, match="int32"):
        gl.DataGadget(str(tmp_path / "u16.npy"), placement="cpu")


@pytest.mark.skipif(not hasattr(torch, "uint64"), reason="torch < 2.3 has no uint64")
def test_huge_unsigned_and_mixed_ids_are_reported_as_too_large():
    g = gl.DataGadget((10, 2), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetIndexError, match=r"out of range: ids must be in \[0, 2\*\*63-1\]"):
        g.getData(torch.tensor([2**63 + 5], dtype=torch.uint64))
    with pytest.raises(gl.GadgetIndexError, match=r"out of range: ids must be in \[0, 2\*\*63-1\]"):
        g.getData([1, 2**63])
    np.testing.assert_array_equal(
        g.getData(torch.tensor([3], dtype=torch.uint64)).numpy(), g.getData([3]).numpy()
    )
    assert tuple(g.getData([[]]).shape) == (1, 0, 2)


def test_dataset_default_path_refuses_bools():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="bools"):
        ds.__getitems__([1, True, False])
    assert ds.__getitems__([3, 4])[0][0].tolist() == [3.0, 4.0]


def test_external_link_table_watches_the_linked_file_and_is_read_only(tmp_path):
    main, other = str(tmp_path / "main.h5"), str(tmp_path / "other.h5")
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros((10, 2), np.float32)
    with h5py.File(main, "w") as f:
        f["ext"] = h5py.ExternalLink("other.h5", "/x")
    a = _open(main, "file", dataset="ext")
    assert a.getData([0]).sum() == 0
    with pytest.raises(gl.ReadOnlyError, match="external link"):
        a.insertData(torch.ones(1, 2), [1])
    gl.DataGadget(np.full((10, 2), 5, np.float32), placement="cpu").save(other, dataset="x")
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        a.getData([3])
    with h5py.File(other, "r") as f:
        np.testing.assert_array_equal(f["x"][:], np.full((10, 2), 5, np.float32))


def test_saving_over_its_own_zarr_array_spelled_as_its_group(tmp_path):
    p = str(tmp_path / "s.zarr")
    gl.DataGadget(np.zeros((10, 2), np.float32), placement="cpu").save(p, dataset="g/x")
    b = _open(os.path.join(p, "g", "x"), "file")
    b.fill_(1.0)
    b.save(p, dataset="g/x")
    np.testing.assert_array_equal(b.getData([0, 9]).numpy(), np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(zarr.open_array(os.path.join(p, "g", "x"))[:], np.ones((10, 2)))


@pytest.mark.skipif(not hasattr(torch, "uint32"), reason="torch < 2.3 has no uint32")
def test_unsigned_tensors_convert_with_dtype():
    t = torch.tensor([[1, 4_000_000_000]], dtype=torch.uint32)
    g = gl.DataGadget(t, dtype="int64", placement="cpu", device="cpu")
    assert g.as_tensor().tolist() == [[1, 4_000_000_000]]
    with pytest.raises(gl.GadgetTypeError, match="dtype='int64'"):
        gl.DataGadget(t, placement="cpu")


def test_mixed_numpy_scalar_ids_are_ids():
    g = gl.DataGadget(np.arange(20, dtype=np.float32).reshape(10, 2), placement="cpu", device="cpu")
    np.testing.assert_array_equal(
        g.getData([np.uint64(3), np.int64(5)]).numpy(), g.getData([3, 5]).numpy()
    )
    with pytest.raises(gl.GadgetIndexError, match="negative"):
        g.getData([np.uint64(3), -1])
