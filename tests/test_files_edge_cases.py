"""Files, edge cases found in review: byte order and layout of .npy write-through, several
tables of one HDF5 file, saves that must not replace a directory, convert's refusals."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr

import gadgetloader as gl
from gadgetloader import convert as conv


def _file_gadget(path: Path, **kw: object) -> gl.DataGadget:
    return gl.DataGadget(path, placement="file", device="cpu", **kw)


def test_big_endian_npy_writes_in_the_files_byte_order(tmp_path: Path) -> None:
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    p = tmp_path / "be.npy"
    np.save(p, a.astype(">f4"))
    g = _file_gadget(p)
    g.insertData(torch.full((2, 4), 1.5), [3, 60])
    assert torch.equal(
        g.getData([3, 4, 60]), torch.tensor(a[[3, 4, 60]]).index_fill_(0, torch.tensor([0, 2]), 1.5)
    )
    g.close()
    back = np.load(p)
    assert back.dtype == np.dtype(">f4")  # the file keeps its byte order
    want = a.copy()
    want[[3, 60]] = 1.5
    np.testing.assert_array_equal(back, want)  # neighbours of the written rows unchanged
    g = _file_gadget(p)
    g.fill_(2.5)
    g.close()
    np.testing.assert_array_equal(np.load(p), np.full_like(a, 2.5))


def test_fortran_npy_is_a_read_only_file_table(tmp_path: Path) -> None:
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(a))
    before = p.read_bytes()
    g = _file_gadget(p)
    assert not g.store.supports_writes
    np.testing.assert_array_equal(g.getData([0, 7, 19]).numpy(), a[[0, 7, 19]])
    with pytest.raises(gl.ReadOnlyError, match="read-only"):
        g.insertData(torch.zeros((1, 3)), [0])
    g.close()
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        _file_gadget(p, writable=True)
    assert p.read_bytes() == before


@pytest.mark.parametrize("first", ["words", "chars"])
def test_two_tables_of_one_hdf5_file_both_write(tmp_path: Path, first: str) -> None:
    p = tmp_path / "m.h5"
    words = np.arange(40, dtype=np.float32).reshape(10, 4)
    chars = np.zeros((6, 4), np.float32)
    with h5py.File(p, "w") as f:
        f.create_dataset("emb/words", data=words, chunks=(2, 4))
        f.create_dataset("emb/chars", data=chars, chunks=(2, 4))
    g = {name: _file_gadget(p, dataset=f"emb/{name}") for name in ("words", "chars")}
    for x in g.values():  # both hold the file open read-only now
        x.getData([1])
    second = "chars" if first == "words" else "words"
    g[first].insertData(torch.full((1, 4), 7.0), [3])
    g[second].insertData(torch.full((1, 4), 9.0), [2])
    assert g[first].getData([3]).eq(7.0).all() and g[second].getData([2]).eq(9.0).all()
    np.testing.assert_array_equal(g["words"].getData([1]).numpy(), words[[1]])
    for x in g.values():
        x.close()
    with h5py.File(p, "r") as f:
        assert (f[f"emb/{first}"][3] == 7.0).all() and (f[f"emb/{second}"][2] == 9.0).all()
        assert f["emb/words"][1].tolist() == words[1].tolist()


def test_truncated_hdf5_gets_no_lock_hint(tmp_path: Path) -> None:
    p = tmp_path / "t.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.ones((100, 8), np.float32))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])
    with pytest.raises(gl.GadgetError) as info:
        gl.DataGadget(p, placement="cpu", device="cpu")
    assert str(p) in str(info.value) and "locks files" not in str(info.value)


def test_npy_truncated_after_opening_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "x.npy"
    np.save(p, np.ones((1000, 16), np.float32))
    g = _file_gadget(p, cache_bytes=0)
    with open(p, "r+b") as f:
        f.truncate(1024)
    with pytest.raises(gl.GadgetError, match="x.npy"):
        g.getData([900])
    g.close()


@pytest.mark.parametrize("name", ["d.npy", "d.h5", "d.zarr"])
def test_save_never_replaces_a_directory_that_is_not_a_store(tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetFileError, match="cannot save to"):
        g.save(target)
    assert (target / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(target)) == ["keep.txt"]
    assert not [q for q in os.listdir(tmp_path) if q.startswith(".")]  # no temporary left


def test_save_replaces_a_zarr_store_and_refuses_a_plain_file(tmp_path: Path) -> None:
    g = gl.DataGadget(np.arange(6, dtype=np.float32).reshape(3, 2), placement="cpu", device="cpu")
    z = tmp_path / "t.zarr"
    g.save(z)
    g.insertData(torch.zeros((1, 2)), [0])
    g.save(z)  # an existing zarr store is replaced
    np.testing.assert_array_equal(zarr.open_array(z, mode="r")[:], g.getNumpyVersion())
    f = tmp_path / "f.zarr"
    f.write_text("not a store")
    with pytest.raises(gl.GadgetFileError, match="not a zarr store"):
        g.save(f)
    assert f.read_text() == "not a store"


def test_convert_refuses_a_zero_row_table_before_writing(tmp_path: Path) -> None:
    src = tmp_path / "z.npy"
    np.save(src, np.zeros((0, 4), np.float32))
    with pytest.raises(gl.GadgetValueError, match="zero rows"):
        conv.convert(src, tmp_path / "z.h5", progress=False)
    assert not (tmp_path / "z.h5").exists()


def test_convert_dataset_of_a_npy_source_points_at_dst_dataset(tmp_path: Path) -> None:
    src = tmp_path / "a.npy"
    np.save(src, np.ones((5, 4), np.float32))
    with pytest.raises(gl.GadgetValueError, match="--dst-dataset"):
        conv.convert(src, tmp_path / "a.h5", dataset="emb", progress=False)
    conv.convert(src, tmp_path / "a.h5", dst_dataset="emb", progress=False)
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert list(f) == ["emb"] and f["emb"].shape == (5, 4)
