"""Session 52's fixes.

- An HDF5 ``file`` table memory-mapped its rows by path. A save that replaced the file
  after the table's check at the start of a call, but before the map was made, had the
  call return the new file's rows (seen once in ~330 runs of a thread test). The map and
  the raw descriptor are now made from the file HDF5 has open, checked by inode.
"""

from __future__ import annotations

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
