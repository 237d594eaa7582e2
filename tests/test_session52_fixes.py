"""Session 52's fixes.

- An HDF5 ``file`` table memory-mapped its rows by path. A save that replaced the file
  after the table's check at the start of a call, but before the map was made, had the
  call return the new file's rows (seen once in ~330 runs of a thread test). The map and
  the raw descriptor are now made from the file HDF5 has open, checked by inode.
"""

from __future__ import annotations

import os
import traceback

import h5py
import numpy as np
import pytest

import gadgetloader as gl
from gadgetloader.io import _hdf5


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "contiguous"])
def test_hdf5_file_replaced_while_rows_are_mapped_never_reads_new_file(
    tmp_path, monkeypatch, chunked
):
    """A file table reads its rows as they were when it opened the file, or raises
    GadgetFileError saying the file was replaced; never rows of the file saved over it."""
    arr = np.arange(96 * 8, dtype=np.float32).reshape(96, 8)
    path = str(tmp_path / "t.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("emb", data=arr, chunks=(16, 8) if chunked else None)
    g = gl.DataGadget(path, placement="file")
    name = "_chunk_table" if chunked else "_dataset"
    orig = getattr(_hdf5.Hdf5Source, name)
    replaced = []

    def replace_inside_row_map(self, *a, **k):
        out = orig(self, *a, **k)
        if not replaced and traceback.extract_stack()[-2].name == "_row_map":
            replaced.append(1)  # after the call's checks, before the rows are mapped
            gl.DataGadget(arr + 1000, placement="cpu").save(path, dataset="emb")
        return out

    monkeypatch.setattr(_hdf5.Hdf5Source, name, replace_inside_row_map)
    ids = np.arange(0, 96, 3)
    try:
        got = g.getData(ids).numpy()
    except gl.GadgetFileError as exc:
        assert "replaced" in str(exc)
    else:
        np.testing.assert_array_equal(got, arr[ids])
    assert replaced, "the read did not map the file's rows"
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.getData(ids)
    g.close()
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["emb"][...], arr + 1000)


@pytest.mark.parametrize("order", ["C", "F", "big-endian"])
def test_npy_file_replaced_before_rows_are_mapped_never_reads_new_file(
    tmp_path, monkeypatch, order
):
    """The same for .npy tables: the rows are mapped (or read) from the file the table
    parsed, so a save over it between the call's check and the read is refused."""
    from gadgetloader.io import _npy

    arr = np.arange(96 * 8, dtype=np.float32).reshape(96, 8)
    stored = arr.astype(">f4") if order == "big-endian" else arr
    if order == "F":
        stored = np.asfortranarray(arr)
    path = str(tmp_path / "t.npy")
    np.save(path, stored)
    g = gl.DataGadget(path, placement="file")
    replaced = []

    def hook(name):
        orig = getattr(_npy.NpySource, name)

        def wrapped(self, *a, **k):
            if not replaced:
                replaced.append(1)  # after the call's checks, before the rows are read
                np.save(str(tmp_path / "new.npy"), stored + 1000)
                os.replace(tmp_path / "new.npy", path)
            return orig(self, *a, **k)

        monkeypatch.setattr(_npy.NpySource, name, wrapped)

    hook("memmap")
    hook("read_into")
    ids = np.arange(0, 96, 3)
    try:
        got = g.getData(ids).numpy()
    except gl.GadgetFileError as exc:
        assert "replaced" in str(exc)
    else:
        np.testing.assert_array_equal(got, arr[ids])
    assert replaced, "the read did not touch the file"
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.getData(ids)
    g.close()


@pytest.mark.parametrize("cls", ["OffloadedEmbedding", "OffloadedEmbeddingBag"])
def test_shallow_copy_of_offloaded_embedding_is_refused(cls):
    """README: a table belongs to one OffloadedOptimizer at a time. copy.copy shared the
    table yet looked unowned, so a second optimizer could take the same rows; it is a
    GadgetTypeError now, and deepcopy still gives a separate table with no optimizer."""
    import copy

    import torch

    torch.manual_seed(0)
    emb = getattr(gl, cls)(20, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    ids = torch.arange(5)
    out = emb(ids) if cls == "OffloadedEmbedding" else emb(ids.view(1, -1))
    out.sum().backward()
    opt.step()
    before = emb.state_dict()["weight"].clone()
    with pytest.raises(gl.GadgetTypeError, match="copy.copy.*share its table"):
        copy.copy(emb)
    twin = copy.deepcopy(emb)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, twin, lr=0.1)
    out = twin(ids) if cls == "OffloadedEmbedding" else twin(ids.view(1, -1))
    out.sum().backward()
    opt2.step()
    assert torch.equal(emb.state_dict()["weight"], before)
    assert not torch.equal(twin.state_dict()["weight"], before)
    with pytest.raises(gl.GadgetValueError, match="already belongs"):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
