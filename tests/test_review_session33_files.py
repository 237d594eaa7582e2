"""Black-box review (session 33): file-backed stores and saving.

Written from README.md ("Files: .npy, HDF5 and zarr", "Errors"), SPEC.md and the public
docstrings only: .npy (C / Fortran order, big-endian, bad dtypes, 1-D, zero rows), HDF5
(groups, chunked / contiguous, gzip / lzf, wrong dataset names), zarr v3 (arrays, groups,
ragged last chunk, sharding, compression), gathers and scatters of ``file`` tables against
NumPy, write-through / flush / close, saving to every format bit for bit, atomic saves over
existing files, damaged files, read-only tables, path kinds, and ``gadgetloader convert``.
"""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

ZARR3 = int(zarr.__version__.split(".")[0]) >= 3
needs_zarr3 = pytest.mark.skipif(not ZARR3, reason="needs zarr >= 3")
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# --------------------------------------------------------------------------- helpers


def _table(rows=37, dim=5, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=(rows, dim)).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=(rows, dim), dtype=dtype, endpoint=True)
    return rng.standard_normal((rows, dim)).astype(dtype)


def _write_h5(path, arr, name="data", **kw):
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=arr, **kw)


def _read_h5(path, name="data"):
    with h5py.File(path, "r") as f:
        return f[name][()]


def _zarr_array(path, arr, chunks, **kw):
    if ZARR3:
        z = zarr.create_array(str(path), shape=arr.shape, chunks=chunks, dtype=arr.dtype, **kw)
    else:  # pragma: no cover - zarr 2
        z = zarr.open_array(str(path), mode="w", shape=arr.shape, chunks=chunks, dtype=arr.dtype)
    z[...] = arr
    return z


def _read_zarr(path, name=None):
    obj = zarr.open(str(path), mode="r")
    if name is not None:
        obj = obj[name]
    return obj[...]


def _bits(x: np.ndarray) -> np.ndarray:
    """A view that compares NaN payloads and signed zeros exactly."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.view(np.uint8)
    return x.view(f"u{x.dtype.itemsize}")


def _gadget_np(g) -> np.ndarray:
    return np.asarray(g.getNumpyVersion())


def _env():
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _cli(*args, timeout=60):
    r = subprocess.run(
        [sys.executable, "-m", "gadgetloader", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
    )
    return r.returncode, r.stdout, r.stderr


def _snapshot(path: pathlib.Path) -> dict:
    """Bytes of every file under path (or of the file)."""
    path = pathlib.Path(path)
    if path.is_file():
        return {".": path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _leftovers(folder: pathlib.Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


FORMATS = [("npy", ".npy"), ("hdf5", ".h5"), ("zarr", ".zarr")]


def _make_file(tmp_path, kind, arr, name="t"):
    """Write arr in one of the three formats; returns (path, dataset-or-None)."""
    if kind == "npy":
        p = tmp_path / f"{name}.npy"
        np.save(p, arr)
        return p, None
    if kind == "hdf5":
        p = tmp_path / f"{name}.h5"
        _write_h5(p, arr, "grp/emb", chunks=(4,) + arr.shape[1:])
        return p, "grp/emb"
    p = tmp_path / f"{name}.zarr"
    _zarr_array(p, arr, chunks=(4,) + arr.shape[1:])
    return p, None


def _read_back(kind, path, dataset):
    if kind == "npy":
        return np.load(path)
    if kind == "hdf5":
        return _read_h5(path, dataset)
    return _read_zarr(path, dataset)


# --------------------------------------------------------------------------- .npy


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_npy_c_and_fortran_order_read_equal(tmp_path, placement, order):
    a = _table(23, 6)
    p = tmp_path / "t.npy"
    np.save(p, np.asarray(a, order=order))
    with gl.DataGadget(p, placement=placement) as g:
        assert tuple(g.shape) == a.shape
        assert g.dtype == torch.float32
        ids = np.array([22, 0, 5, 5, 11])
        np.testing.assert_array_equal(g.getData(ids).numpy(), a[ids])
        np.testing.assert_array_equal(_gadget_np(g), a)


def test_npy_fortran_file_table_is_read_only_and_says_why(tmp_path):
    a = _table(10, 4)
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(a))
    before = p.read_bytes()
    with gl.DataGadget(p, placement="file") as g:
        with pytest.raises(gl.ReadOnlyError) as ei:
            g.insertData(torch.zeros(1, 4), [0])
        assert "Fortran" in str(ei.value)
        assert str(p) in str(ei.value) or p.name in str(ei.value)
        np.testing.assert_array_equal(_gadget_np(g), a)
    assert p.read_bytes() == before


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("dt", [">f4", ">i8", ">f8", ">i2"])
def test_npy_big_endian_reads_values(tmp_path, placement, dt):
    a = _table(17, 3, dtype=np.dtype(dt).newbyteorder("="))
    p = tmp_path / "be.npy"
    np.save(p, a.astype(dt))
    with gl.DataGadget(p, placement=placement) as g:
        assert g.dtype == getattr(torch, np.dtype(dt).newbyteorder("=").name)
        np.testing.assert_array_equal(g.getData([16, 3, 3]).numpy(), a[[16, 3, 3]])
        np.testing.assert_array_equal(_gadget_np(g), a)


def test_npy_big_endian_file_write_through_keeps_values(tmp_path):
    a = _table(12, 3)
    p = tmp_path / "be.npy"
    np.save(p, a.astype(">f4"))
    rows = torch.tensor([[1.5, -2.0, 3.25], [7.0, 8.0, 9.0]])
    with gl.DataGadget(p, placement="file") as g:
        g.insertData(rows, [11, 2])
        np.testing.assert_array_equal(g.getData([2, 11]).numpy(), rows.numpy()[[1, 0]])
    back = np.load(p)
    exp = a.copy()
    exp[[11, 2]] = rows.numpy()
    np.testing.assert_array_equal(back.astype("=f4"), exp)


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(4, dtype=[("a", "f4"), ("b", "i4")]),
        lambda: np.array([[1, "x"], [2, "y"]], dtype=object),
        lambda: np.array(["ab", "cd"]),
        lambda: np.array([b"ab", b"cd"]),
        lambda: np.zeros((3, 2), np.complex64),
    ],
    ids=["structured", "object", "unicode", "bytes", "complex"],
)
def test_npy_bad_dtypes_are_clear_type_errors_naming_file(tmp_path, placement, make):
    arr = make()
    p = tmp_path / "bad.npy"
    np.save(p, arr, allow_pickle=True)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(p, placement=placement)
    msg = str(ei.value)
    assert "bad.npy" in msg
    assert isinstance(ei.value, TypeError)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_npy_one_dimensional_rows_are_scalars(tmp_path, placement):
    a = np.arange(50, dtype=np.int64) * 3 - 7
    p = tmp_path / "labels.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement=placement) as g:
        assert tuple(g.shape) == (50,)
        assert len(g) == 50
        ids = torch.tensor([[49, 0], [7, 7]])
        out = g.getData(ids)
        assert tuple(out.shape) == (2, 2)
        np.testing.assert_array_equal(out.numpy(), a[ids.numpy()])
        assert int(g.getData(3)) == a[3]
        if placement == "file":
            g.insertData(torch.tensor([100, 200], dtype=torch.int64), [1, 48])
    if placement == "file":
        exp = a.copy()
        exp[[1, 48]] = [100, 200]
        np.testing.assert_array_equal(np.load(p), exp)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_npy_three_dimensional_rows(tmp_path, placement):
    a = _table(9, 6).reshape(9, 3, 2)
    p = tmp_path / "r3.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement=placement) as g:
        assert tuple(g.shape) == (9, 3, 2)
        np.testing.assert_array_equal(g.getData([8, 1]).numpy(), a[[8, 1]])
        np.testing.assert_array_equal(g[[2, 4], 1].numpy(), a[[2, 4], 1])


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_zero_row_file_is_clear_error_naming_file(tmp_path, placement, kind):
    a = np.zeros((0, 3), np.float32)
    if kind == "npy":
        p = tmp_path / "zero.npy"
        np.save(p, a)
    elif kind == "hdf5":
        p = tmp_path / "zero.h5"
        _write_h5(p, a)
    else:
        p = tmp_path / "zero.zarr"
        _zarr_array(p, a, chunks=(4, 3))
    with pytest.raises(gl.GadgetError) as ei:
        gl.DataGadget(p, placement=placement)
    assert "zero" in str(ei.value)
    assert "row" in str(ei.value).lower()


def test_zero_row_in_memory_table_is_not_saved(tmp_path):
    g = gl.DataGadget(np.zeros((0, 3), np.float32), placement="cpu")
    assert len(g) == 0
    p = tmp_path / "z.npy"
    with pytest.raises(gl.GadgetError):
        g.save(p)
    assert not p.exists()
    assert _leftovers(tmp_path, set()) == []


# --------------------------------------------------------------------------- HDF5


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"chunks": (5, 4)},
        {"chunks": (3, 4), "compression": "gzip"},
        {"chunks": (6, 4), "compression": "lzf"},
        {"chunks": (4, 2), "compression": "gzip", "shuffle": True},
    ],
    ids=["contiguous", "chunked", "gzip", "lzf", "gzip-shuffle-colchunks"],
)
def test_hdf5_layouts_in_group_read_and_gather(tmp_path, placement, layout):
    a = _table(29, 4)
    p = tmp_path / "data.h5"
    _write_h5(p, a, "emb/words", **layout)
    with gl.DataGadget(p, dataset="emb/words", placement=placement) as g:
        assert tuple(g.shape) == a.shape
        ids = np.random.default_rng(1).integers(0, 29, size=(3, 7))
        np.testing.assert_array_equal(g.getData(ids).numpy(), a[ids])
        np.testing.assert_array_equal(g[3:17].numpy(), a[3:17])
        np.testing.assert_array_equal(g[-2:].numpy(), a[-2:])
        np.testing.assert_array_equal(_gadget_np(g), a)


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"chunks": (5, 4)},
        {"chunks": (3, 4), "compression": "gzip"},
        {"chunks": (6, 4), "compression": "lzf"},
    ],
    ids=["contiguous", "chunked", "gzip", "lzf"],
)
def test_hdf5_file_table_scatter_writes_through(tmp_path, layout):
    a = _table(29, 4)
    p = tmp_path / "data.h5"
    _write_h5(p, a, "emb/words", **layout)
    ids = np.array([28, 0, 5, 5, 13, 0])
    rows = _table(6, 4, seed=7)
    exp = a.copy()
    for i, r in zip(ids, rows, strict=False):
        exp[i] = r  # sequential: last occurrence wins
    with gl.DataGadget(p, dataset="emb/words", placement="file") as g:
        g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
        np.testing.assert_array_equal(_gadget_np(g), exp)
        # README: "Each write reaches the file before it returns"; another process reads it
        code = (
            "import h5py,numpy as np,sys;f=h5py.File(sys.argv[1],'r',locking=False);"
            "np.save(sys.argv[2], f['emb/words'][()])"
        )
        out = tmp_path / "seen.npy"
        r = subprocess.run(
            [sys.executable, "-c", code, str(p), str(out)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode == 0:
            np.testing.assert_array_equal(np.load(out), exp)
    np.testing.assert_array_equal(_read_h5(p, "emb/words"), exp)
    # layout preserved
    with h5py.File(p, "r") as f:
        assert f["emb/words"].compression == layout.get("compression")


def test_hdf5_wrong_dataset_name_lists_existing(tmp_path):
    a = _table(8, 2)
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("emb/words", data=a)
        f.create_dataset("labels", data=np.arange(8))
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetKeyError) as ei:
            gl.DataGadget(p, dataset="emb/nope", placement=placement)
        msg = str(ei.value)
        assert "emb/nope" in msg and "emb/words" in msg and "labels" in msg
        assert isinstance(ei.value, KeyError)
        # without dataset= and two datasets: must say which exist
        with pytest.raises(gl.GadgetError) as ei:
            gl.DataGadget(p, placement=placement)
        assert "emb/words" in str(ei.value) and "labels" in str(ei.value)


def test_hdf5_dataset_name_that_is_a_group_is_refused(tmp_path):
    p = tmp_path / "m.h5"
    _write_h5(p, _table(8, 2), "emb/words")
    with pytest.raises(gl.GadgetError) as ei:
        gl.DataGadget(p, dataset="emb", placement="cpu")
    assert "emb/words" in str(ei.value)


def test_hdf5_single_dataset_needs_no_name(tmp_path):
    a = _table(8, 2)
    p = tmp_path / "one.hdf5"
    _write_h5(p, a, "deep/inside/it")
    with gl.DataGadget(p, placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)


def test_hdf5_open_elsewhere_for_read_still_opens(tmp_path):
    a = _table(16, 3)
    p = tmp_path / "r.h5"
    _write_h5(p, a, chunks=(4, 3))
    with h5py.File(p, "r") as other:
        assert other["data"].shape == (16, 3)
        with gl.DataGadget(p, placement="cpu") as g:
            np.testing.assert_array_equal(_gadget_np(g), a)
        with gl.DataGadget(p, placement="file", writable=False) as g:
            np.testing.assert_array_equal(g.getData([15, 1]).numpy(), a[[15, 1]])


def test_hdf5_file_table_holds_lock_against_other_writers(tmp_path):
    """README: an open HDF5 file table holds HDF5's file lock, read-only ones too."""
    a = _table(16, 3)
    p = tmp_path / "lock.h5"
    _write_h5(p, a, chunks=(4, 3))
    code = "import h5py,sys\nf=h5py.File(sys.argv[1],'r+')\nf['data'][0,0]=-99\nf.close()\n"
    with gl.DataGadget(p, placement="file", writable=False) as g:
        r = subprocess.run(
            [sys.executable, "-c", code, str(p)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0, "another process could open the file to write"
        np.testing.assert_array_equal(g.getData([0]).numpy(), a[[0]])
    # closed: now another process may write it
    r = subprocess.run(
        [sys.executable, "-c", code, str(p)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert _read_h5(p)[0, 0] == -99


def test_hdf5_detected_by_content_without_extension(tmp_path):
    a = _table(10, 3)
    p = tmp_path / "noext.bin"
    _write_h5(p, a)
    with gl.DataGadget(p, placement="cpu") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
    q = tmp_path / "npy_noext.dat"
    with open(q, "wb") as f:
        np.save(f, a)
    with gl.DataGadget(q, placement="cpu") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)


def test_format_forced_reads_mismatched_extension(tmp_path):
    a = _table(10, 3)
    p = tmp_path / "really_hdf5.npy"
    _write_h5(p, a)
    with gl.DataGadget(p, placement="cpu", format="hdf5") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)


def test_unknown_format_name_lists_valid(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _table(4, 2))
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, placement="cpu", format="parquet")
    msg = str(ei.value)
    assert "parquet" in msg and "npy" in msg and "zarr" in msg


# --------------------------------------------------------------------------- zarr


@needs_zarr3
@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 37, 100])
def test_zarr_ragged_chunks_read_and_gather(tmp_path, placement, chunk_rows):
    a = _table(37, 5)
    p = tmp_path / "a.zarr"
    _zarr_array(p, a, chunks=(chunk_rows, 5))
    with gl.DataGadget(p, placement=placement) as g:
        assert tuple(g.shape) == a.shape
        ids = np.array([36, 35, 0, 36, 18, 7])
        np.testing.assert_array_equal(g.getData(ids).numpy(), a[ids])
        np.testing.assert_array_equal(g[30:37].numpy(), a[30:37])
        np.testing.assert_array_equal(_gadget_np(g), a)


@needs_zarr3
@pytest.mark.parametrize("chunk_rows", [4, 7, 37])
def test_zarr_file_scatter_into_last_partial_chunk(tmp_path, chunk_rows):
    a = _table(37, 5)
    p = tmp_path / "a.zarr"
    _zarr_array(p, a, chunks=(chunk_rows, 5))
    ids = np.array([36, 0, 35, 36])
    rows = _table(4, 5, seed=3)
    exp = a.copy()
    for i, r in zip(ids, rows, strict=False):
        exp[i] = r
    with gl.DataGadget(p, placement="file") as g:
        g[torch.from_numpy(ids)] = torch.from_numpy(rows)
        np.testing.assert_array_equal(_gadget_np(g), exp)
        g.flush()
    back = _read_zarr(p)
    assert back.shape == (37, 5)
    np.testing.assert_array_equal(back, exp)


@needs_zarr3
def test_zarr_group_dataset_and_wrong_name(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "g.zarr"
    root = zarr.open_group(str(p), mode="w")
    arr = root.create_array("sub/arr", shape=a.shape, chunks=(6, 3), dtype=a.dtype)
    arr[...] = a
    root.create_array("other", shape=(4, 3), chunks=(2, 3), dtype="f4")
    with gl.DataGadget(p, dataset="sub/arr", placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
        g.insertData(torch.ones(1, 3), [19])
    np.testing.assert_array_equal(_read_zarr(p, "sub/arr")[19], np.ones(3, np.float32))
    np.testing.assert_array_equal(_read_zarr(p, "sub/arr")[:19], a[:19])
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, dataset="nothere", placement="cpu")
    assert "nothere" in str(ei.value) and "sub/arr" in str(ei.value) and "other" in str(ei.value)
    with pytest.raises(gl.GadgetError) as ei:
        gl.DataGadget(p, placement="cpu")
    assert "sub/arr" in str(ei.value)


@needs_zarr3
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_zarr_sharded_read_and_write(tmp_path, placement):
    a = _table(23, 3)
    p = tmp_path / "sh.zarr"
    _zarr_array(p, a, chunks=(2, 3), shards=(6, 3))
    ids = np.array([22, 3, 3, 12])
    rows = _table(4, 3, seed=9)
    exp = a.copy()
    for i, r in zip(ids, rows, strict=False):
        exp[i] = r
    with gl.DataGadget(p, placement=placement) as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
        np.testing.assert_array_equal(g.getData(ids).numpy(), a[ids])
        if placement == "file":
            g.insertData(torch.from_numpy(rows), ids)
            np.testing.assert_array_equal(_gadget_np(g), exp)
    if placement == "file":
        np.testing.assert_array_equal(_read_zarr(p), exp)


@needs_zarr3
@pytest.mark.parametrize("compressor", ["zstd", "gzip", "blosc", "none"])
def test_zarr_compressed_sources(tmp_path, compressor):
    from zarr import codecs as zc

    comp = {
        "zstd": [zc.ZstdCodec(level=3)],
        "gzip": [zc.GzipCodec(level=5)],
        "blosc": [zc.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
        "none": None,
    }[compressor]
    a = _table(19, 4, dtype=np.float64)
    p = tmp_path / "c.zarr"
    _zarr_array(p, a, chunks=(5, 4), compressors=comp)
    with gl.DataGadget(p, placement="file") as g:
        np.testing.assert_array_equal(g.getData([18, 0, 9]).numpy(), a[[18, 0, 9]])
        g.insertData(torch.full((1, 4), 2.5, dtype=torch.float64), [10])
    exp = a.copy()
    exp[10] = 2.5
    np.testing.assert_array_equal(_read_zarr(p), exp)


@needs_zarr3
def test_zarr_v2_store_reads(tmp_path):
    a = _table(15, 3, dtype=np.int32)
    p = tmp_path / "v2.zarr"
    z = zarr.create_array(str(p), shape=a.shape, chunks=(4, 3), dtype=a.dtype, zarr_format=2)
    z[...] = a
    with gl.DataGadget(p, placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
        g.insertData(torch.tensor([[1, 2, 3]], dtype=torch.int32), [14])
    exp = a.copy()
    exp[14] = [1, 2, 3]
    np.testing.assert_array_equal(_read_zarr(p), exp)


@needs_zarr3
def test_zarr_missing_chunk_reads_fill_value(tmp_path):
    """README: a missing chunk file reads as the array's fill value."""
    p = tmp_path / "sparse.zarr"
    z = zarr.create_array(str(p), shape=(12, 2), chunks=(4, 2), dtype="f4", fill_value=-1.0)
    z[0:4] = np.ones((4, 2), np.float32)
    with gl.DataGadget(p, placement="file") as g:
        out = g.getData([0, 5, 11]).numpy()
    np.testing.assert_array_equal(out, np.array([[1, 1], [-1, -1], [-1, -1]], np.float32))


# --------------------------------------------------------------------------- gathers / scatters vs numpy


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_file_store_random_ops_match_numpy(tmp_path, kind, cache_bytes):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(41, 6)
    p, ds = _make_file(tmp_path, kind, a)
    ref = a.copy()
    rng = np.random.default_rng(11)
    with gl.DataGadget(p, dataset=ds, placement="file", cache_bytes=cache_bytes) as g:
        for step in range(8):
            ids = rng.integers(0, 41, size=rng.integers(1, 15))
            if step % 2:
                rows = rng.standard_normal((len(ids), 6)).astype(np.float32)
                g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
                for i, r in zip(ids, rows, strict=False):
                    ref[i] = r
            got = g.getData(torch.from_numpy(ids)).numpy()
            np.testing.assert_array_equal(got, ref[ids])
        # partial-row writes through a tuple index
        part = torch.full((3, 2), 9.0)
        g.insertData(part, (torch.tensor([1, 40, 20]), slice(2, 4)))
        ref[[1, 40, 20], 2:4] = 9.0
        np.testing.assert_array_equal(g[[1, 40, 20], 3].numpy(), ref[[1, 40, 20], 3])
        np.testing.assert_array_equal(g.getData((slice(0, 6), slice(0, 3))).numpy(), ref[0:6, 0:3])
        np.testing.assert_array_equal(_gadget_np(g), ref)
    np.testing.assert_array_equal(_read_back(kind, p, ds), ref)


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_file_store_id_kinds(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(20, 3)
    p, ds = _make_file(tmp_path, kind, a)
    with gl.DataGadget(p, dataset=ds, placement="file") as g:
        for ids in (
            [3, 1, 19],
            np.array([3, 1, 19], np.uint8),
            torch.tensor([3, 1, 19], dtype=torch.int16),
            range(2, 9, 3),
            (3, 1, 19),
        ):
            exp = a[np.asarray(list(ids))]
            np.testing.assert_array_equal(g.getData(ids).numpy(), exp)
        empty = g.getData(torch.tensor([], dtype=torch.int64))
        assert tuple(empty.shape) == (0, 3)


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_file_store_bad_ids_raise_before_writing(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(20, 3)
    p, ds = _make_file(tmp_path, kind, a)
    with gl.DataGadget(p, dataset=ds, placement="file") as g:
        with pytest.raises(gl.GadgetIndexError) as ei:
            g.insertData(torch.ones(3, 3), [0, 20, 5])
        assert "20" in str(ei.value)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.ones(2, 3), [-1, 2])
        with pytest.raises(gl.GadgetTypeError) as ei:
            g.insertData(torch.ones(2, 3, dtype=torch.float64), [1, 2])
        assert "float64" in str(ei.value) and "float32" in str(ei.value)
        with pytest.raises(gl.GadgetValueError):
            g.insertData(torch.ones(2, 4), [1, 2])
        with pytest.raises(gl.GadgetTypeError):
            g.getData(torch.tensor([1.0, 2.0]))
        np.testing.assert_array_equal(_gadget_np(g), a)
    np.testing.assert_array_equal(_read_back(kind, p, ds), a)


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_file_store_out_tensor(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(20, 3)
    p, ds = _make_file(tmp_path, kind, a)
    with gl.DataGadget(p, dataset=ds, placement="file") as g:
        out = torch.empty(4, 3)
        r = g.getData([19, 0, 4, 4], out=out)
        assert r.data_ptr() == out.data_ptr()
        np.testing.assert_array_equal(out.numpy(), a[[19, 0, 4, 4]])


def test_gather_many_scatter_many_file_and_cpu(tmp_path):
    a = _table(30, 4)
    b = _table(30, 4, seed=5)
    pa = tmp_path / "a.npy"
    np.save(pa, a)
    pb = tmp_path / "b.h5"
    _write_h5(pb, b, chunks=(4, 4))
    with gl.DataGadget(pa, placement="file") as ga, gl.DataGadget(pb, placement="file") as gb:
        ids = torch.tensor([29, 3, 3, 0])
        ra, rb = gl.gather_many([ga, gb], ids)
        np.testing.assert_array_equal(ra.numpy(), a[ids.numpy()])
        np.testing.assert_array_equal(rb.numpy(), b[ids.numpy()])
        na, nb = torch.full((4, 4), 1.0), torch.full((4, 4), 2.0)
        na[2] = 7.0
        gl.scatter_many([ga, gb], [na, nb], ids)
    a2, b2 = a.copy(), b.copy()
    for k, i in enumerate(ids.tolist()):
        a2[i] = na[k].numpy()
        b2[i] = nb[k].numpy()
    np.testing.assert_array_equal(np.load(pa), a2)
    np.testing.assert_array_equal(_read_h5(pb), b2)


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_file_store_elementwise_init_writes_file(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(20, 3)
    p, ds = _make_file(tmp_path, kind, a)
    with gl.DataGadget(p, dataset=ds, placement="file") as g:
        g.fill_(3.5)
        with pytest.raises(gl.GadgetTypeError):
            g.init_(torch.nn.init.orthogonal_)
    np.testing.assert_array_equal(_read_back(kind, p, ds), np.full_like(a, 3.5))


# --------------------------------------------------------------------------- write-back / close


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_close_and_context_manager_semantics(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(12, 3)
    p, ds = _make_file(tmp_path, kind, a)
    with gl.DataGadget(p, dataset=ds, placement="file") as g:
        g.insertData(torch.zeros(1, 3), [5])
        g.flush()
        np.testing.assert_array_equal(_read_back(kind, p, ds)[5], np.zeros(3, np.float32))
    # after the with block: closed
    for call in (
        lambda: g.getData([0]),
        lambda: g.insertData(torch.zeros(1, 3), [0]),
        g.flush,
        lambda: g.load(p),
        lambda: g.save(tmp_path / "x.npy"),
        lambda: g[0],
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert tuple(g.shape) == (12, 3) and len(g) == 12 and g.dtype == torch.float32
    assert "DataGadget" in repr(g)
    g.close()  # idempotent
    assert not (tmp_path / "x.npy").exists()


def test_close_on_exception_in_with_block(tmp_path):
    p = tmp_path / "e.h5"
    a = _table(8, 2)
    _write_h5(p, a)
    with pytest.raises(RuntimeError, match="boom"), gl.DataGadget(p, placement="file") as g:
        g.insertData(torch.ones(1, 2), [7])
        raise RuntimeError("boom")
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    exp = a.copy()
    exp[7] = 1
    np.testing.assert_array_equal(_read_h5(p), exp)
    # and the HDF5 lock was released: h5py can open it for writing now
    with h5py.File(p, "r+") as f:
        f["data"][0, 0] = 5.0


def test_writable_false_refuses_and_leaves_file(tmp_path):
    a = _table(10, 3)
    for kind in ("npy", "hdf5"):
        p, ds = _make_file(tmp_path, kind, a, name=f"ro_{kind}")
        snap = _snapshot(p)
        with gl.DataGadget(p, dataset=ds, placement="file", writable=False) as g:
            with pytest.raises(gl.ReadOnlyError):
                g.insertData(torch.zeros(1, 3), [0])
            with pytest.raises(gl.ReadOnlyError):
                g.fill_(0.0)
            np.testing.assert_array_equal(g.getData([0, 9]).numpy(), a[[0, 9]])
        np.testing.assert_array_equal(_read_back(kind, p, ds), a)
        if kind == "npy":
            assert _snapshot(p) == snap


@pytest.mark.parametrize("bad", ["yes", 1, 0, "False"])
def test_writable_takes_only_bools(tmp_path, bad):
    p = tmp_path / "w.npy"
    np.save(p, _table(4, 2))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="file", writable=bad)


def test_writable_numpy_bool_accepted(tmp_path):
    p = tmp_path / "w.npy"
    np.save(p, _table(4, 2))
    with (
        gl.DataGadget(p, placement="file", writable=np.False_) as g,
        pytest.raises(gl.ReadOnlyError),
    ):
        g.insertData(torch.zeros(1, 2), [0])


def test_file_options_refused_for_memory_placements(tmp_path):
    p = tmp_path / "w.npy"
    np.save(p, _table(4, 2))
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(p, placement="cpu", cache_bytes=1024)


@pytest.mark.skipif(IS_ROOT, reason="root ignores file permission bits")
def test_read_only_file_opens_read_only_by_default(tmp_path):
    a = _table(10, 3)
    p = tmp_path / "ro.npy"
    np.save(p, a)
    os.chmod(p, 0o444)
    try:
        with gl.DataGadget(p, placement="file") as g:
            np.testing.assert_array_equal(g.getData([1]).numpy(), a[[1]])
            with pytest.raises(gl.ReadOnlyError):
                g.insertData(torch.zeros(1, 3), [1])
        with pytest.raises(gl.ReadOnlyError):
            gl.DataGadget(p, placement="file", writable=True)
    finally:
        os.chmod(p, 0o644)


@pytest.mark.skipif(IS_ROOT, reason="root ignores folder permission bits")
def test_save_into_read_only_folder_is_readonly_error(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o555)
    try:
        g = gl.DataGadget(_table(4, 2), placement="cpu")
        with pytest.raises(gl.ReadOnlyError) as ei:
            g.save(d / "x.npy")
        assert isinstance(ei.value, PermissionError)
        assert list(d.iterdir()) == []
    finally:
        os.chmod(d, 0o755)


# --------------------------------------------------------------------------- saving


SAVE_DTYPES = [
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
]


def _random_torch(dtype: str, shape=(21, 4)):
    g = torch.Generator().manual_seed(3)
    td = getattr(torch, dtype)
    if td == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if td.is_floating_point:
        t = torch.randn(shape, generator=g).to(td)
        t[0, 0] = float("nan")
        t[0, 1] = float("-inf")
        t[0, 2] = -0.0
        return t
    info = torch.iinfo(td)
    t = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(td)
    t[0, 0] = info.min
    t[0, 1] = info.max
    return t


def _tbits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.bool:
        return t.numpy().view(np.uint8)
    n = t.numpy()
    return n.view(f"u{n.dtype.itemsize}")


@pytest.mark.parametrize("fmt,ext", FORMATS)
@pytest.mark.parametrize("dtype", SAVE_DTYPES)
def test_save_round_trip_bit_exact(tmp_path, fmt, ext, dtype):
    if fmt == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    t = _random_torch(dtype)
    g = gl.DataGadget(t, placement="cpu")
    p = tmp_path / f"rt{ext}"
    if fmt == "npy" and dtype == "bfloat16":
        # README: "bfloat16 is stored as uint16 bits plus an attribute (it has no .npy form)"
        with pytest.raises(gl.GadgetTypeError) as ei:
            g.save(p)
        assert "bfloat16" in str(ei.value)
        assert not p.exists() and _leftovers(tmp_path, set()) == []
        return
    g.save(p)
    for placement in ("cpu", "file"):
        with gl.DataGadget(p, placement=placement) as h:
            assert h.dtype == t.dtype
            assert tuple(h.shape) == tuple(t.shape)
            got = h.getData(torch.arange(len(h)))
            np.testing.assert_array_equal(_tbits(got), _tbits(t))
    # and the file holds the values natively (bfloat16: uint16 bits + an attribute)
    if dtype != "bfloat16":
        if fmt == "npy":
            raw = np.load(p)
        elif fmt == "hdf5":
            raw = _read_h5(p, "data")
        else:
            raw = _read_zarr(p)
        np.testing.assert_array_equal(_bits(raw), _tbits(t))
    else:
        if fmt == "hdf5":
            raw = _read_h5(p, "data")
        elif fmt == "zarr":
            raw = _read_zarr(p)
        else:
            raw = None
        if raw is not None:
            assert raw.dtype == np.uint16
            np.testing.assert_array_equal(raw.view(np.int16), _tbits(t))


@pytest.mark.parametrize("fmt,ext", FORMATS)
def test_save_from_file_table_and_load_method(tmp_path, fmt, ext):
    if fmt == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(33, 3, dtype=np.float64)
    src = tmp_path / "src.npy"
    np.save(src, a)
    dst = tmp_path / f"dst{ext}"
    with gl.DataGadget(src, placement="file") as g:
        g.save(dst, chunk_rows=5) if fmt != "npy" else g.save(dst)
    h = gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu")
    h.load(dst)
    assert tuple(h.shape) == (33, 3) and h.dtype == torch.float64
    np.testing.assert_array_equal(_gadget_np(h), a)


@pytest.mark.parametrize("compression", ["gzip", "lzf", "none", None])
def test_save_hdf5_options(tmp_path, compression):
    a = _table(50, 4)
    g = gl.DataGadget(a, placement="cpu")
    p = tmp_path / "o.h5"
    g.save(p, dataset="emb/words", chunk_rows=7, compression=compression)
    with h5py.File(p, "r") as f:
        assert list(f.keys()) == ["emb"]
        ds = f["emb/words"]
        assert ds.chunks is not None and ds.chunks[0] == 7
        expect = None if compression in ("none", None) else compression
        assert ds.compression == expect
        np.testing.assert_array_equal(ds[()], a)
    with gl.DataGadget(p, placement="file") as h:  # only one dataset: no name needed
        np.testing.assert_array_equal(_gadget_np(h), a)


@needs_zarr3
@pytest.mark.parametrize("compression", ["zstd", "gzip", "blosc", "none", None])
def test_save_zarr_options(tmp_path, compression):
    a = _table(50, 4)
    g = gl.DataGadget(a, placement="cpu")
    p = tmp_path / "o.zarr"
    g.save(p, chunk_rows=7, compression=compression)
    z = zarr.open_array(str(p), mode="r")
    assert z.chunks[0] == 7
    np.testing.assert_array_equal(z[...], a)
    comps = getattr(z, "compressors", ())
    names = " ".join(type(c).__name__.lower() for c in comps)
    if compression in (None, "zstd"):
        assert "zstd" in names
    elif compression == "none":
        assert comps == () or comps is None or len(comps) == 0
    else:
        assert compression in names


@needs_zarr3
def test_save_zarr_with_dataset_is_group(tmp_path):
    a = _table(10, 2)
    p = tmp_path / "grp.zarr"
    gl.DataGadget(a, placement="cpu").save(p, dataset="sub/emb")
    np.testing.assert_array_equal(_read_zarr(p, "sub/emb"), a)
    with gl.DataGadget(p, placement="file") as h:
        np.testing.assert_array_equal(_gadget_np(h), a)


@pytest.mark.parametrize("fmt,ext", FORMATS)
@pytest.mark.parametrize(
    "bad",
    [
        {"compression": "snappy"},
        {"compression_level": 99},
        {"chunk_rows": 0},
        {"chunk_rows": -3},
        {"progress": "False"},
        {"dataset": "../x"},
    ],
)
def test_save_bad_options_refused_before_any_file(tmp_path, fmt, ext, bad):
    if fmt == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    if fmt == "npy" and set(bad) & {"compression_level"}:
        pass
    g = gl.DataGadget(_table(10, 2), placement="cpu")
    p = tmp_path / f"x{ext}"
    with pytest.raises(gl.GadgetError) as ei:
        g.save(p, **bad)
    assert isinstance(ei.value, (ValueError, KeyError, TypeError))
    assert not p.exists()
    assert _leftovers(tmp_path, set()) == []


def test_save_unknown_compression_message(tmp_path):
    g = gl.DataGadget(_table(10, 2), placement="cpu")
    with pytest.raises(gl.GadgetError) as ei:
        g.save(tmp_path / "x.h5", compression="snappy")
    msg = str(ei.value)
    assert "snappy" in msg and "gzip" in msg and "lzf" in msg


@pytest.mark.parametrize("fmt,ext", FORMATS)
def test_save_over_existing_replaces_whole(tmp_path, fmt, ext):
    if fmt == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    p = tmp_path / f"old{ext}"
    old = _table(40, 7, dtype=np.float64)
    if fmt == "npy":
        np.save(p, old)
    elif fmt == "hdf5":
        with h5py.File(p, "w") as f:
            f.create_dataset("a", data=old)
            f.create_dataset("b", data=old[:3])
    else:
        root = zarr.open_group(str(p), mode="w")
        root.create_array("a", shape=old.shape, chunks=(8, 7), dtype=old.dtype)[...] = old
        root.create_array("b", shape=(3, 7), chunks=(3, 7), dtype=old.dtype)[...] = old[:3]
    new = _table(9, 2, dtype=np.int16)
    gl.DataGadget(new, placement="cpu").save(p)
    if fmt == "hdf5":
        with h5py.File(p, "r") as f:
            assert list(f.keys()) == ["data"]
    if fmt == "zarr":
        assert isinstance(zarr.open(str(p), mode="r"), zarr.Array)
    with gl.DataGadget(p, placement="cpu") as h:
        assert h.dtype == torch.int16
        np.testing.assert_array_equal(_gadget_np(h), new)
    assert _leftovers(tmp_path, {p.name}) == []


@needs_zarr3
@pytest.mark.parametrize("fmt,ext", FORMATS)
def test_failed_save_keeps_old_file(tmp_path, fmt, ext):
    """A save that fails part-way (its source has a damaged chunk in the middle) leaves
    the old file whole and no partial file beside it."""
    old = _table(12, 3)
    p, _ = _make_file(tmp_path, fmt, old, name="keep")
    before = _snapshot(p)
    src = tmp_path / "src.zarr"
    _zarr_array(src, _table(400, 3, seed=1), chunks=(10, 3))
    chunks = sorted(q for q in src.rglob("*") if q.is_file() and q.name != "zarr.json")
    chunks[len(chunks) // 2].write_bytes(b"\x00not a zstd frame\xff" * 2)
    keep = {p.name, src.name}
    with (
        gl.DataGadget(src, placement="file", cache_bytes=0) as g,
        pytest.raises(gl.GadgetFileError),
    ):
        g.save(p)
    assert _snapshot(p) == before
    assert _leftovers(tmp_path, keep) == []


def test_save_keeps_permission_bits(tmp_path):
    p = tmp_path / "perm.npy"
    np.save(p, _table(4, 2))
    os.chmod(p, 0o640)
    gl.DataGadget(_table(6, 2, seed=4), placement="cpu").save(p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    np.testing.assert_array_equal(np.load(p), _table(6, 2, seed=4))


@pytest.mark.parametrize("fmt,ext", [("npy", ".npy"), ("hdf5", ".h5")])
def test_save_through_symlink_replaces_target_keeps_link(tmp_path, fmt, ext):
    real = tmp_path / f"real{ext}"
    link = tmp_path / f"link{ext}"
    gl.DataGadget(_table(4, 2), placement="cpu").save(real)
    link.symlink_to(real)
    new = _table(7, 2, seed=8)
    gl.DataGadget(new, placement="cpu").save(link)
    assert link.is_symlink()
    with gl.DataGadget(real, placement="cpu") as h:
        np.testing.assert_array_equal(_gadget_np(h), new)


def test_save_hard_link_other_name_keeps_old_data(tmp_path):
    p = tmp_path / "a.npy"
    q = tmp_path / "b.npy"
    old = _table(4, 2)
    np.save(p, old)
    os.link(p, q)
    gl.DataGadget(_table(4, 2, seed=9), placement="cpu").save(p)
    np.testing.assert_array_equal(np.load(q), old)
    np.testing.assert_array_equal(np.load(p), _table(4, 2, seed=9))


@pytest.mark.parametrize("fmt,ext", [("npy", ".npy"), ("hdf5", ".h5")])
def test_save_refuses_directory_target(tmp_path, fmt, ext):
    d = tmp_path / f"dir{ext}"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(_table(4, 2), placement="cpu").save(d)
    assert str(d) in str(ei.value) or d.name in str(ei.value)
    assert (d / "keep.txt").read_text() == "x"


@needs_zarr3
def test_save_zarr_refuses_non_store_folder_but_takes_empty(tmp_path):
    d = tmp_path / "notstore.zarr"
    d.mkdir()
    (d / "precious.txt").write_text("x")
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(_table(4, 2), placement="cpu").save(d)
    assert (d / "precious.txt").read_text() == "x"
    e = tmp_path / "empty.zarr"
    e.mkdir()
    gl.DataGadget(_table(4, 2), placement="cpu").save(e)
    np.testing.assert_array_equal(_read_zarr(e), _table(4, 2))
    f = tmp_path / "file.zarr"
    f.write_text("a regular file")
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(_table(4, 2), placement="cpu").save(f)
    assert f.read_text() == "a regular file"


def test_save_dataset_with_dot_parts_refused(tmp_path):
    g = gl.DataGadget(_table(4, 2), placement="cpu")
    for name in ("a/../b", "./x", "a/./b", ".."):
        with pytest.raises(gl.GadgetValueError):
            g.save(tmp_path / "d.h5", dataset=name)
    assert not (tmp_path / "d.h5").exists()


def test_file_table_saved_over_own_file_keeps_dataset_name(tmp_path):
    a = _table(10, 3)
    p = tmp_path / "own.h5"
    _write_h5(p, a, "emb/words", chunks=(3, 3))
    with gl.DataGadget(p, dataset="emb/words", placement="file") as g:
        g.insertData(torch.zeros(1, 3), [4])
        g.save(p, compression="gzip")
        # README: "it reads that file on"
        exp = a.copy()
        exp[4] = 0
        np.testing.assert_array_equal(_gadget_np(g), exp)
        g.insertData(torch.ones(1, 3), [0])
    exp[0] = 1
    with h5py.File(p, "r") as f:
        assert "emb/words" in f
        np.testing.assert_array_equal(f["emb/words"][()], exp)
        assert f["emb/words"].compression == "gzip"


def test_file_table_sees_replacement_as_error(tmp_path):
    a = _table(10, 3)
    p = tmp_path / "r.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement="file") as g:
        np.testing.assert_array_equal(g.getData([1]).numpy(), a[[1]])
        gl.DataGadget(_table(10, 3, seed=2), placement="cpu").save(p)
        with pytest.raises(gl.GadgetFileError):
            g.getData([1])
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.zeros(1, 3), [1])
        np.testing.assert_array_equal(np.load(p), _table(10, 3, seed=2))
        g.load(p)
        np.testing.assert_array_equal(g.getData([1]).numpy(), _table(10, 3, seed=2)[[1]])


def test_file_table_deleted_file_is_error(tmp_path):
    p = tmp_path / "del.h5"
    _write_h5(p, _table(10, 3), chunks=(2, 3))
    g = gl.DataGadget(p, placement="file", cache_bytes=0)
    try:
        os.remove(p)
        with pytest.raises(gl.GadgetFileError):
            g.getData([1])
    finally:
        g.close()


def test_save_cupy_appends_npy_and_load_cupy(tmp_path):
    a = _table(6, 2)
    g = gl.DataGadget(a, placement="cpu")
    g.saveCupy(str(tmp_path / "emb"))
    assert (tmp_path / "emb.npy").exists()
    h = gl.DataGadget(np.zeros((1, 1), np.float32), placement="cpu")
    h.loadCupy(tmp_path / "emb.npy")
    np.testing.assert_array_equal(_gadget_np(h), a)


def test_failed_load_leaves_table_unchanged(tmp_path):
    a = _table(6, 2)
    g = gl.DataGadget(a, placement="cpu")
    bad = tmp_path / "trunc.npy"
    np.save(bad, _table(100, 2))
    raw = bad.read_bytes()
    bad.write_bytes(raw[: len(raw) // 2])
    for call in (
        lambda: g.load(bad),
        lambda: g.loadCupy(bad),
        lambda: g.load(tmp_path / "none.npy"),
    ):
        with pytest.raises(gl.GadgetFileError):
            call()
        np.testing.assert_array_equal(_gadget_np(g), a)
        assert tuple(g.shape) == (6, 2)


# --------------------------------------------------------------------------- damaged files


def _truncate(p: pathlib.Path, keep: int):
    raw = p.read_bytes()
    p.write_bytes(raw[:keep])


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_missing_file_is_file_not_found(tmp_path, placement):
    for name in ("nope.npy", "nope.h5", "nope.zarr", "nope"):
        p = tmp_path / name
        with pytest.raises(gl.GadgetFileNotFoundError) as ei:
            gl.DataGadget(p, placement=placement)
        assert isinstance(ei.value, FileNotFoundError)
        assert isinstance(ei.value, gl.GadgetFileError)
        assert name in str(ei.value)


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("cut", ["body", "header", "empty"])
def test_truncated_npy_is_file_error(tmp_path, placement, cut):
    p = tmp_path / "t.npy"
    np.save(p, _table(100, 4))
    keep = {"body": 128 + 400, "header": 20, "empty": 0}[cut]
    _truncate(p, keep)
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(p, placement=placement)
    assert "t.npy" in str(ei.value)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_corrupted_npy_header_is_file_error(tmp_path, placement):
    p = tmp_path / "c.npy"
    np.save(p, _table(10, 4))
    raw = bytearray(p.read_bytes())
    raw[10:40] = b"#" * 30
    p.write_bytes(bytes(raw))
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(p, placement=placement)
    assert "c.npy" in str(ei.value)


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("name", ["junk.npy", "junk.h5", "junk.bin"])
def test_garbage_file_is_file_error(tmp_path, placement, name):
    p = tmp_path / name
    p.write_bytes(os.urandom(4096))
    # README: "non-array files ... are clear errors naming the file"; a file of known
    # extension is unreadable (GadgetFileError); one of no known format says so
    exc = gl.GadgetError if name.endswith(".bin") else gl.GadgetFileError
    with pytest.raises(exc) as ei:
        gl.DataGadget(p, placement=placement)
    assert name in str(ei.value)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_truncated_hdf5_is_file_error(tmp_path, placement):
    p = tmp_path / "t.h5"
    _write_h5(p, _table(2000, 8))  # contiguous: data at the end of the file
    size = p.stat().st_size
    _truncate(p, size - 20000)
    with pytest.raises(gl.GadgetFileError) as ei:
        g = gl.DataGadget(p, placement=placement)
        try:
            g.getData(torch.arange(2000))
        finally:
            g.close()
    assert "t.h5" in str(ei.value)


@needs_zarr3
def test_zarr_damaged_chunk_is_file_error_and_write_leaves_file(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "d.zarr"
    _zarr_array(p, a, chunks=(5, 3))
    chunk_files = sorted(
        q for q in p.rglob("*") if q.is_file() and q.name not in ("zarr.json", ".zarray", ".zattrs")
    )
    assert chunk_files
    victim = chunk_files[1]
    victim.write_bytes(b"\x00garbage\xff" * 3)
    snap = _snapshot(p)
    with gl.DataGadget(p, placement="file", cache_bytes=0) as g:
        with pytest.raises(gl.GadgetFileError):
            g.getData(torch.arange(20))
        # a write partly rewriting the damaged chunk (and a good one) must write nothing
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.zeros(2, 3), [0, 7])
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.zeros(2, 1), ([1, 8], slice(0, 1)))
        # rows of good chunks still read right
        np.testing.assert_array_equal(g.getData([0, 19]).numpy(), a[[0, 19]])
    assert _snapshot(p) == snap


def test_zarr_not_a_store_folder_is_error(tmp_path):
    d = tmp_path / "empty.zarr"
    d.mkdir()
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(d, placement="cpu")
    assert "empty.zarr" in str(ei.value)


def test_directory_as_npy_is_error(tmp_path):
    d = tmp_path / "folder.npy"
    d.mkdir()
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(d, placement="cpu")
    assert "folder.npy" in str(ei.value)


# --------------------------------------------------------------------------- paths


@pytest.mark.parametrize("fmt,ext", FORMATS)
@pytest.mark.parametrize("as_str", [True, False])
def test_str_path_and_unicode_names(tmp_path, fmt, ext, as_str):
    if fmt == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    d = tmp_path / "données ünï 表"
    d.mkdir()
    p = d / f"émb-ß 😀{ext}"
    a = _table(11, 3)
    target = str(p) if as_str else p
    gl.DataGadget(a, placement="cpu").save(target)
    assert p.exists()
    for placement in ("cpu", "file"):
        with gl.DataGadget(target, placement=placement) as g:
            np.testing.assert_array_equal(_gadget_np(g), a)
            if placement == "file":
                g.insertData(torch.zeros(1, 3), [2])
    a[2] = 0
    h = gl.DataGadget(np.zeros((1, 1), np.float32), placement="cpu")
    h.load(target)
    np.testing.assert_array_equal(_gadget_np(h), a)
    assert _leftovers(d, {p.name}) == []


def test_unicode_path_in_error_message(tmp_path):
    p = tmp_path / "fehlt-ä😀.npy"
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.DataGadget(p, placement="cpu")
    assert "fehlt-ä😀.npy" in str(ei.value)


def test_bytes_and_none_paths_refused(tmp_path):
    p = tmp_path / "b.npy"
    np.save(p, _table(3, 2))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(os.fsencode(str(p)), placement="cpu")
    g = gl.DataGadget(_table(3, 2), placement="cpu")
    for call in (
        lambda: g.save(None),
        lambda: g.load(None),
        lambda: g.saveCupy(None),
        lambda: g.save(os.fsencode(str(tmp_path / "x.npy"))),
    ):
        with pytest.raises(gl.GadgetTypeError):
            call()
    assert not (tmp_path / "x.npy").exists()


def test_os_pathlike_custom_object(tmp_path):
    class P:
        def __init__(self, s):
            self.s = s

        def __fspath__(self):
            return self.s

    a = _table(5, 2)
    gl.DataGadget(a, placement="cpu").save(P(str(tmp_path / "pl.h5")))
    with gl.DataGadget(P(str(tmp_path / "pl.h5")), placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)


# --------------------------------------------------------------------------- dtype conversion on load


def test_uint32_file_converts_with_dtype_and_refused_otherwise(tmp_path):
    a = np.array([[0, 1], [16777217, 4294967295]], dtype=np.uint32)
    p = tmp_path / "u.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement="cpu", dtype="int64") as g:
        assert g.dtype == torch.int64
        np.testing.assert_array_equal(_gadget_np(g), a.astype(np.int64))
    with gl.DataGadget(p, placement="cpu", dtype="float32") as g:
        assert _gadget_np(g)[1, 0] == np.float32(16777216)
    with pytest.raises(gl.GadgetError) as ei:
        gl.DataGadget(p, placement="cpu", dtype="int32")  # 4294967295 does not fit
    assert isinstance(ei.value, (ValueError, TypeError))
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(p, placement="file")
    assert "dtype" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="cpu")
    h = gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        h.load(p)
    np.testing.assert_array_equal(_gadget_np(h), np.ones((2, 2), np.float32))


def test_uint16_hdf5_converts_to_int32(tmp_path):
    a = np.array([[0, 65535], [3, 4]], dtype=np.uint16)
    p = tmp_path / "u16.h5"
    _write_h5(p, a, chunks=(1, 2))
    with gl.DataGadget(p, placement="cpu", dtype="int32") as g:
        assert g.dtype == torch.int32
        np.testing.assert_array_equal(_gadget_np(g), a.astype(np.int32))


def test_file_source_other_dtype_refused(tmp_path):
    p = tmp_path / "f64.npy"
    np.save(p, _table(4, 2, dtype=np.float64))
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(p, placement="file", dtype="float32")
    assert "float64" in str(ei.value)


# --------------------------------------------------------------------------- convert CLI
#
# Starting a Python that imports torch costs seconds on a busy 2-core machine, so the
# convert cases run in ONE subprocess (CUDA hidden) that runs ``python -m gadgetloader``'s
# module once per case through ``runpy`` (argv, stdout, stderr and the exit status exactly
# as ``python -m gadgetloader ...`` gives them); one case goes through a real
# ``sys.executable -m gadgetloader`` as well.

_BATCH_DRIVER = r"""
import contextlib, io, json, runpy, sys
cases_path, result_path = sys.argv[1], sys.argv[2]
cases = json.load(open(cases_path, encoding="utf-8"))
out = {}
for name, argv in cases:
    so, se = io.StringIO(), io.StringIO()
    sys.argv = ["gadgetloader", *argv]
    rc = 0
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        try:
            runpy.run_module("gadgetloader", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            rc = "raised " + type(e).__name__ + ": " + str(e)
    out[name] = [rc, so.getvalue(), se.getvalue()]
with open(result_path, "w", encoding="utf-8") as fh:
    json.dump(out, fh)
"""


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    """Builds every convert case's input, runs them all, returns (folder, results)."""
    import json

    d = tmp_path_factory.mktemp("convert")
    a = _table(45, 4)
    a[0, 0] = np.nan
    a[0, 1] = -0.0
    np.save(d / "quelle-ä 😀.npy", a)
    with h5py.File(d / "ziel-表.h5", "w") as f:  # an existing destination, replaced whole
        f.create_dataset("old1", data=np.zeros(4))
        f.create_dataset("old2", data=np.zeros(4))
    i16 = _table(30, 3, dtype=np.int16)
    with h5py.File(d / "data.h5", "w") as f:
        f.create_dataset("emb/words", data=i16)
        f.create_dataset("other", data=np.zeros(3))
    np.save(d / "s.npy", _table(5, 2))
    with h5py.File(d / "two.h5", "w") as f:
        f.create_dataset("a", data=_table(5, 2))
        f.create_dataset("b", data=_table(5, 2, seed=1))
    (d / "sl.h5").symlink_to(d / "two.h5")
    os.link(d / "two.h5", d / "hl.h5")
    np.save(d / "u32.npy", np.arange(6, dtype=np.uint32).reshape(3, 2))
    np.save(d / "z0.npy", np.zeros((0, 2), np.float32))
    bf = _random_torch("bfloat16")
    if ZARR3:
        gl.DataGadget(bf, placement="cpu").save(d / "bf.zarr")
    snap_two = (d / "two.h5").read_bytes()
    P = lambda n: str(d / n)  # noqa: E731
    NP = "--no-progress"
    cases = [
        (
            "npy_h5",
            [
                "convert",
                P("quelle-ä 😀.npy"),
                P("ziel-表.h5"),
                "--chunk-rows",
                "8",
                "--compression",
                "gzip",
                NP,
            ],
        ),
        ("h5_npy", ["convert", P("ziel-表.h5"), P("back.npy"), NP]),
        ("h5_zarr", ["convert", P("data.h5"), P("emb.zarr"), "--dataset", "emb/words", NP]),
        ("missing_ds", ["convert", P("data.h5"), P("o_missing.npy"), "--dataset", "nope", NP]),
        ("bad_comp_npy", ["convert", P("s.npy"), P("o_bad0.npy"), "--compression", "gzip", NP]),
        ("bad_comp_h5", ["convert", P("s.npy"), P("o_bad1.h5"), "--compression", "snappy", NP]),
        ("bad_to", ["convert", P("s.npy"), P("o_bad2.h5"), "--to", "parquet", NP]),
        ("bad_ds_npy_src", ["convert", P("s.npy"), P("o_bad3.h5"), "--dataset", "x", NP]),
        ("self", ["convert", P("two.h5"), P("two.h5"), "--dataset", "a", NP]),
        ("symlink", ["convert", P("two.h5"), P("sl.h5"), "--dataset", "a", NP]),
        ("hardlink", ["convert", P("two.h5"), P("hl.h5"), "--dataset", "a", NP]),
        ("missing_src", ["convert", P("none.npy"), P("o_none.h5"), NP]),
        ("dst_ds_npy", ["convert", P("s.npy"), P("o_dstds.npy"), "--dst-dataset", "x", NP]),
        ("u32", ["convert", P("u32.npy"), P("u32.h5"), NP]),
        ("zero", ["convert", P("z0.npy"), P("z0.h5"), NP]),
    ]
    if ZARR3:
        cases.append(("bf_zarr_h5", ["convert", P("bf.zarr"), P("bf.h5"), NP]))
    (d / "cases.json").write_text(json.dumps(cases), encoding="utf-8")
    r = subprocess.run(
        [sys.executable, "-c", _BATCH_DRIVER, str(d / "cases.json"), str(d / "res.json")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = {k: tuple(v) for k, v in json.loads((d / "res.json").read_text(encoding="utf-8")).items()}
    os.remove(d / "cases.json")
    os.remove(d / "res.json")
    return d, res, {"a": a, "i16": i16, "bf": bf, "two": snap_two}


def test_convert_real_subprocess_npy_to_zarr(tmp_path):
    a = _table(12, 3, dtype=np.float64)
    src = tmp_path / "s.npy"
    np.save(src, a)
    dst = tmp_path / "d.zarr" if ZARR3 else tmp_path / "d.h5"
    rc, out, err = _cli("convert", src, dst, "--chunk-rows", "5", "--no-progress")
    assert rc == 0, err
    with gl.DataGadget(dst, placement="cpu") as g:
        np.testing.assert_array_equal(_bits(_gadget_np(g)), _bits(a))


def test_convert_npy_to_hdf5_gzip_and_back(conv):
    """Unicode names, an existing destination replaced as a whole, bit-exact both ways."""
    d, res, data = conv
    a = data["a"]
    rc, out, err = res["npy_h5"]
    assert rc == 0, err
    with h5py.File(d / "ziel-表.h5", "r") as f:
        keys = list(f.keys())
        assert len(keys) == 1, keys
        ds = f[keys[0]]
        assert ds.compression == "gzip" and ds.chunks[0] == 8
        np.testing.assert_array_equal(_bits(ds[()]), _bits(a))
    rc, out, err = res["h5_npy"]
    assert rc == 0, err
    np.testing.assert_array_equal(_bits(np.load(d / "back.npy")), _bits(a))
    assert not [n for n in os.listdir(d) if n.startswith(".")]


@needs_zarr3
def test_convert_hdf5_dataset_to_zarr(conv):
    d, res, data = conv
    rc, out, err = res["h5_zarr"]
    assert rc == 0, err
    with gl.DataGadget(d / "emb.zarr", placement="file") as g:
        assert g.dtype == torch.int16
        np.testing.assert_array_equal(_gadget_np(g), data["i16"])


def test_convert_missing_dataset_exit_1_one_line(conv):
    d, res, _ = conv
    rc, out, err = res["missing_ds"]
    assert rc == 1, (rc, err)
    assert "nope" in err and "emb/words" in err
    assert "Traceback" not in err
    assert len([ln for ln in err.strip().splitlines() if ln.strip()]) == 1
    assert not (d / "o_missing.npy").exists()


@pytest.mark.parametrize("case", ["bad_comp_npy", "bad_comp_h5", "bad_to", "bad_ds_npy_src"])
def test_convert_bad_arguments_exit_2(conv, case):
    d, res, _ = conv
    rc, out, err = res[case]
    assert rc == 2, (rc, err)
    assert "convert" in err
    assert not list(d.glob("o_bad*"))


def test_convert_refuses_self_and_links(conv):
    d, res, data = conv
    for case in ("self", "symlink", "hardlink"):
        rc, out, err = res[case]
        assert rc in (1, 2), (case, rc, err)
        assert err.strip() and "Traceback" not in err
    assert (d / "two.h5").read_bytes() == data["two"]
    assert (d / "sl.h5").is_symlink()


def test_convert_missing_source_exit_1(conv):
    d, res, _ = conv
    rc, out, err = res["missing_src"]
    assert rc == 1, (rc, err)
    assert "none.npy" in err and "Traceback" not in err
    assert not (d / "o_none.h5").exists()


@needs_zarr3
def test_convert_zarr_bfloat16_to_hdf5_round_trip(conv):
    d, res, data = conv
    rc, out, err = res["bf_zarr_h5"]
    assert rc == 0, err
    with gl.DataGadget(d / "bf.h5", placement="cpu") as g:
        assert g.dtype == torch.bfloat16
        np.testing.assert_array_equal(_tbits(g.getData(torch.arange(len(g)))), _tbits(data["bf"]))


def test_convert_dst_dataset_for_npy_destination_exit_2(conv):
    """README: exit 2 for "a convert option the formats do not take" (``--dataset`` for a
    .npy source is listed); ``--dst-dataset`` for a .npy destination is the same case."""
    d, res, _ = conv
    rc, out, err = res["dst_ds_npy"]
    assert "dst-dataset" in err
    assert not (d / "o_dstds.npy").exists()
    assert rc == 2, (rc, err)


def test_convert_unsupported_dtype_and_zero_rows_exit_1(conv):
    d, res, _ = conv
    rc, out, err = res["u32"]
    assert rc == 1, (rc, err)
    assert "uint32" in err and "Traceback" not in err
    assert not (d / "u32.h5").exists()
    rc, out, err = res["zero"]
    assert rc == 1, (rc, err)
    assert "z0.npy" in err and "zero" in err
    assert not (d / "z0.h5").exists()


# --------------------------------------------------------------------------- failures part-way


_FSIZE_SCRIPT = r"""
import os, resource, signal, sys, warnings
warnings.simplefilter("error")
import numpy as np
import gadgetloader as gl
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
os.chdir(sys.argv[1])
old = np.ones((4, 2), np.float32)
big = gl.DataGadget(np.arange(400000 * 4, dtype=np.float32).reshape(400000, 4), placement="cpu")
for target, kw in (("a.npy", {}), ("b.h5", {"chunk_rows": 200000}),
                   ("c.zarr", {"chunk_rows": 200000, "compression": "none"})):
    gl.DataGadget(old, placement="cpu").save(target)
    before = sorted(os.listdir("."))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    try:
        big.save(target, progress=False, **kw)
        res = "no error"
    except gl.GadgetFileError as e:
        res = "GadgetFileError " + str(e).replace("\n", " ")
    except BaseException as e:
        res = "other " + type(e).__name__ + " " + str(e).replace("\n", " ")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    same = sorted(os.listdir(".")) == before
    h = gl.DataGadget(target, placement="cpu")
    intact = np.array_equal(h.getNumpyVersion(), old)
    h.close()
    print(f"{target}|{res[:300]}|{same}|{intact}")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE")
def test_save_failing_part_way_file_size_limit(tmp_path):
    """README: a save that fails part-way (a file size limit) is a GadgetFileError naming
    the target ("cannot save PATH: cannot write rows A:B (...)"), the partial file is
    removed and the old file stays."""
    pytest.importorskip("resource")
    work = tmp_path / "w"
    work.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", _FSIZE_SCRIPT, str(work)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if "|" in ln]
    assert len(lines) == 3, r.stdout
    for ln in lines:
        target, res, same, intact = ln.split("|")
        assert res.startswith("GadgetFileError"), ln
        assert f"cannot save {target}" in res and "cannot write rows" in res, ln
        assert same == "True", ln  # no partial file left
        assert intact == "True", ln  # old file whole


_INTR_SCRIPT = r"""
import os, signal, sys, threading, time, warnings
warnings.simplefilter("error")
import numpy as np
import gadgetloader as gl
signal.signal(signal.SIGINT, signal.default_int_handler)
os.chdir(sys.argv[1])
old = np.ones((4, 2), np.float32)
big = np.random.default_rng(0).standard_normal((500_000, 16)).astype(np.float32)
g = gl.DataGadget(big, placement="cpu")
for target, kw, delay in (("a.npy", {}, 0.02), ("b.h5", {"chunk_rows": 8192}, 0.05),
                          ("c.zarr", {"chunk_rows": 8192, "compression": "none"}, 0.05)):
    gl.DataGadget(old, placement="cpu").save(target)
    before = sorted(os.listdir("."))
    t = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
    t.start()
    try:
        g.save(target, progress=False, **kw)
        res = "completed"
        t.join()  # the interrupt may still come: wait for it here
        time.sleep(0.3)
    except KeyboardInterrupt as e:
        res = "KI " + str(e)
    t.join()
    same = sorted(os.listdir(".")) == before
    h = gl.DataGadget(target, placement="cpu")
    arr = h.getNumpyVersion()
    state = "old" if np.array_equal(arr, old) else ("new" if np.array_equal(arr, big) else "MIXED")
    h.close()
    print(f"{target}|{res[:200]}|{same}|{state}")
"""


def test_interrupted_save_leaves_old_or_new_file_and_no_partial(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", _INTR_SCRIPT, str(work)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if "|" in ln]
    assert len(lines) == 3, r.stdout
    for ln in lines:
        target, res, same, state = ln.split("|")
        assert same == "True", ln
        assert state in ("old", "new"), ln
        if res.startswith("KI") and "interrupted after" in res:
            assert state == "new" and target in res, ln


def test_save_is_a_rename_old_readers_keep_old_bytes(tmp_path):
    p = tmp_path / "atom.npy"
    a = _table(30, 4)
    np.save(p, a)
    ino = os.stat(p).st_ino
    with open(p, "rb") as fh:
        gl.DataGadget(_table(30, 4, seed=6), placement="cpu").save(p)
        assert os.stat(p).st_ino != ino  # a new file took the name
        np.testing.assert_array_equal(np.load(fh), a)  # the old file was not written in place
    np.testing.assert_array_equal(np.load(p), _table(30, 4, seed=6))


def test_save_through_dangling_symlink_creates_link_target(tmp_path):
    link = tmp_path / "dangling.npy"
    link.symlink_to("nowhere.npy")
    a = _table(5, 2)
    gl.DataGadget(a, placement="cpu").save(link)
    assert link.is_symlink()
    np.testing.assert_array_equal(np.load(tmp_path / "nowhere.npy"), a)


@needs_zarr3
def test_zarr_save_through_symlink_and_keeps_mode(tmp_path):
    real = tmp_path / "real.zarr"
    real.mkdir()
    link = tmp_path / "link.zarr"
    link.symlink_to(real)
    a = _table(9, 2)
    for k in range(2):
        gl.DataGadget(a + k, placement="cpu").save(link)
        assert link.is_symlink()
        np.testing.assert_array_equal(_read_zarr(real), a + k)
    os.chmod(real, 0o700)
    gl.DataGadget(a, placement="cpu").save(real)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o700
    assert _leftovers(tmp_path, {"real.zarr", "link.zarr"}) == []


def test_file_table_opened_through_symlink_saved_over_itself(tmp_path):
    real = tmp_path / "real.h5"
    a = _table(10, 3)
    gl.DataGadget(a, placement="cpu").save(real, dataset="x/y")
    link = tmp_path / "sl.h5"
    link.symlink_to(real)
    with gl.DataGadget(link, placement="file") as g:
        g.insertData(torch.zeros(1, 3), [0])
        g.save(link)
        assert link.is_symlink()
        g.insertData(torch.ones(1, 3), [9])
    exp = a.copy()
    exp[0] = 0
    exp[9] = 1
    np.testing.assert_array_equal(_read_h5(real, "x/y"), exp)


@needs_zarr3
def test_zarr_file_table_saved_over_own_group_keeps_name(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "g.zarr"
    root = zarr.open_group(str(p), mode="w")
    root.create_array("sub/e", shape=a.shape, chunks=(6, 3), dtype="f4")[...] = a
    root.create_array("other", shape=(2, 2), dtype="f4")
    with gl.DataGadget(p, dataset="sub/e", placement="file") as g:
        g.insertData(torch.zeros(1, 3), [1])
        g.save(p, compression="gzip", chunk_rows=5)
        g.insertData(torch.ones(1, 3), [19])
    exp = a.copy()
    exp[1] = 0
    exp[19] = 1
    np.testing.assert_array_equal(_read_zarr(p, "sub/e"), exp)
    with pytest.raises(KeyError):
        zarr.open_group(str(p), mode="r")["other"]
    assert _leftovers(tmp_path, {"g.zarr"}) == []


# --------------------------------------------------------------------------- HDF5 specials


def test_hdf5_external_link_reads_and_is_read_only_naming_target(tmp_path):
    a = _table(20, 3)
    target = tmp_path / "target.h5"
    _write_h5(target, a, "emb")
    linker = tmp_path / "linker.h5"
    with h5py.File(linker, "w") as f:
        f["ext"] = h5py.ExternalLink(str(target), "emb")
    before = target.read_bytes()
    with gl.DataGadget(linker, dataset="ext", placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
        with pytest.raises(gl.ReadOnlyError) as ei:
            g.insertData(torch.zeros(1, 3), [0])
        assert "target.h5" in str(ei.value) and "emb" in str(ei.value)
    assert target.read_bytes() == before
    with pytest.raises(gl.ReadOnlyError):
        gl.DataGadget(linker, dataset="ext", placement="file", writable=True)


def test_hdf5_virtual_dataset_missing_source_is_file_error(tmp_path):
    a = _table(20, 3)
    layout = h5py.VirtualLayout(shape=(20, 3), dtype="f4")
    layout[0:10] = h5py.VirtualSource(str(tmp_path / "src1.h5"), "d", shape=(10, 3))
    layout[10:20] = h5py.VirtualSource(str(tmp_path / "src2.h5"), "d", shape=(10, 3))
    _write_h5(tmp_path / "src1.h5", a[:10], "d")
    vds = tmp_path / "vds.h5"
    with h5py.File(vds, "w") as f:
        f.create_virtual_dataset("v", layout, fillvalue=0)
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError) as ei:
            gl.DataGadget(vds, placement=placement)
        assert "src2.h5" in str(ei.value)
    _write_h5(tmp_path / "src2.h5", a[10:], "d")
    with gl.DataGadget(vds, placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
        with pytest.raises(gl.ReadOnlyError):
            g.insertData(torch.zeros(1, 3), [0])


def test_hdf5_filters_and_unallocated_chunks(tmp_path):
    a = _table(20, 3)
    ints = np.arange(60).reshape(20, 3)
    p = tmp_path / "fl.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("fletcher", data=a, chunks=(4, 3), fletcher32=True)
        f.create_dataset("scaleoff", data=ints, chunks=(4, 3), scaleoffset=0)
        f.create_dataset("unalloc", shape=(20, 3), dtype="f4", chunks=(4, 3), fillvalue=7.0)
    expect = {"fletcher": a, "scaleoff": ints, "unalloc": np.full((20, 3), 7.0, np.float32)}
    for ds, exp in expect.items():
        with gl.DataGadget(p, dataset=ds, placement="file") as g:
            np.testing.assert_array_equal(g.getData([0, 19, 6]).numpy(), exp[[0, 19, 6]])
            g.insertData(torch.zeros(1, 3, dtype=g.dtype), [5])
            np.testing.assert_array_equal(
                g.getData([5, 6]).numpy(), np.stack([np.zeros(3), exp[6]])
            )
    with h5py.File(p, "r") as f:
        for ds, exp in expect.items():
            e = exp.copy()
            e[5] = 0
            np.testing.assert_array_equal(f[ds][()], e)


def test_hdf5_big_endian_write_keeps_file_dtype(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "be.h5"
    _write_h5(p, a.astype(">f4"), chunks=(3, 3))
    with gl.DataGadget(p, placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
        g.insertData(torch.full((1, 3), 9.0), [5])
    with h5py.File(p, "r") as f:
        assert f["data"].dtype == np.dtype(">f4")
        exp = a.copy()
        exp[5] = 9
        np.testing.assert_array_equal(f["data"][()].astype("=f4"), exp)


def test_hdf5_other_process_reading_blocks_writes_cleanly(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "h.h5"
    _write_h5(p, a, chunks=(4, 3))
    code = "import h5py,sys\nf=h5py.File(sys.argv[1],'r')\nprint('open',flush=True)\nsys.stdin.read()\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(p)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert proc.stdout.readline().strip() == "open"
        with gl.DataGadget(p, placement="file") as g:
            np.testing.assert_array_equal(g.getData([3, 19]).numpy(), a[[3, 19]])
            with pytest.raises(gl.GadgetFileError) as ei:
                g.insertData(torch.zeros(1, 3), [0])
            assert "h.h5" in str(ei.value)
            np.testing.assert_array_equal(g.getData([0]).numpy(), a[[0]])
        with gl.DataGadget(p, placement="cpu") as g:
            np.testing.assert_array_equal(_gadget_np(g), a)
    finally:
        proc.communicate("", timeout=60)
    np.testing.assert_array_equal(_read_h5(p), a)


def test_hdf5_damaged_compressed_chunk(tmp_path):
    a = _table(40, 3)
    p = tmp_path / "c.h5"
    _write_h5(p, a, chunks=(5, 3), compression="gzip")
    with h5py.File(p, "r") as f:
        info = f["data"].id.get_chunk_info(2)  # rows 10:15
    with open(p, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * info.size)
    before = p.read_bytes()
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(p, placement="cpu")
    assert "c.h5" in str(ei.value)
    with gl.DataGadget(p, placement="file", cache_bytes=0) as g:
        np.testing.assert_array_equal(g.getData([0, 39]).numpy(), a[[0, 39]])
        with pytest.raises(gl.GadgetFileError):
            g.getData([11])
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.zeros(2, 3), [0, 11])
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.zeros(1, 1), ([12], slice(0, 1)))
    assert p.read_bytes() == before


# --------------------------------------------------------------------------- more formats


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_header_versions(tmp_path, version):
    a = _table(20, 3)
    p = tmp_path / "v.npy"
    with open(p, "wb") as f:
        np.lib.format.write_array(f, a, version=version)
    with gl.DataGadget(p, placement="file") as g:
        np.testing.assert_array_equal(_gadget_np(g), a)
        g.insertData(torch.zeros(1, 3), [19])
    a[19] = 0
    np.testing.assert_array_equal(np.load(p), a)


@needs_zarr3
def test_zarr_v2_variants(tmp_path):
    import numcodecs

    a = _table(20, 3)
    z = zarr.create_array(
        str(tmp_path / "f.zarr"), shape=a.shape, chunks=(6, 3), dtype="f4", zarr_format=2, order="F"
    )
    z[...] = a
    z = zarr.create_array(
        str(tmp_path / "n.zarr"),
        shape=a.shape,
        chunks=(6, 3),
        dtype="f4",
        zarr_format=2,
        chunk_key_encoding={"name": "v2", "separator": "/"},
    )
    z[...] = a
    z = zarr.create_array(
        str(tmp_path / "be.zarr"), shape=a.shape, chunks=(6, 3), dtype=">f4", zarr_format=2
    )
    z[...] = a
    ints = np.arange(60, dtype=np.int32).reshape(20, 3)
    z = zarr.create_array(
        str(tmp_path / "d.zarr"),
        shape=ints.shape,
        chunks=(6, 3),
        dtype="i4",
        zarr_format=2,
        filters=[numcodecs.Delta(dtype="i4")],
    )
    z[...] = ints
    for name, exp in (("f.zarr", a), ("n.zarr", a), ("be.zarr", a), ("d.zarr", ints)):
        with gl.DataGadget(tmp_path / name, placement="file") as g:
            np.testing.assert_array_equal(_gadget_np(g), exp)
            g.insertData(torch.from_numpy(exp[[0]] + 1), [19])
        e = exp.copy()
        e[19] = exp[0] + 1
        np.testing.assert_array_equal(_read_zarr(tmp_path / name), e)


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_scalar_file_is_value_error(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    if kind == "npy":
        p = tmp_path / "sc.npy"
        np.save(p, np.float32(3))
    elif kind == "hdf5":
        p = tmp_path / "sc.h5"
        _write_h5(p, np.float32(3))
    else:
        p = tmp_path / "sc.zarr"
        zarr.create_array(str(p), shape=(), dtype="f4")
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.DataGadget(p, placement="file")
    assert "sc." in str(ei.value) and "scalar" in str(ei.value)


@pytest.mark.parametrize("fmt,ext", FORMATS)
@pytest.mark.parametrize("shape", [(20,), (4, 3, 5)])
def test_save_round_trip_other_ranks(tmp_path, fmt, ext, shape):
    if fmt == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    b = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    p = tmp_path / f"s{ext}"
    gl.DataGadget(b, placement="cpu").save(p)
    with gl.DataGadget(p, placement="file") as g:
        assert tuple(g.shape) == shape
        np.testing.assert_array_equal(_gadget_np(g), b)


@pytest.mark.parametrize("ext", [".h5", ".zarr"])
def test_save_unicode_and_odd_dataset_names(tmp_path, ext):
    if ext == ".zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(6, 2)
    for k, ds in enumerate(["émb/wörds", "/lead/x", "trail/"]):
        p = tmp_path / f"u{k}{ext}"
        gl.DataGadget(a, placement="cpu").save(p, dataset=ds)
        with gl.DataGadget(p, dataset=ds, placement="file") as g:
            np.testing.assert_array_equal(_gadget_np(g), a)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(a, placement="cpu").save(tmp_path / f"e{ext}", dataset="")


# --------------------------------------------------------------------------- file table behaviour


@pytest.mark.parametrize("kind", ["hdf5", "zarr"])
def test_block_cache_reads_each_chunk_once_per_call(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(2000, 8)
    if kind == "hdf5":
        p = tmp_path / "c.h5"
        _write_h5(p, a, chunks=(64, 8), compression="gzip")
    else:
        p = tmp_path / "c.zarr"
        _zarr_array(p, a, chunks=(64, 8))
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 2000, 300))
    n_chunks = len(np.unique(ids.numpy() // 64))
    with gl.DataGadget(p, placement="file", cache_bytes=0) as g:
        np.testing.assert_array_equal(g.getData(ids).numpy(), a[ids.numpy()])
        assert g.store.stats["misses"] == n_chunks
        assert g.store.cached_bytes == 0
    with gl.DataGadget(p, placement="file", cache_bytes=1 << 24) as g:
        g.getData(ids)
        m = g.store.stats["misses"]
        assert m == n_chunks
        np.testing.assert_array_equal(g.getData(ids).numpy(), a[ids.numpy()])
        assert g.store.stats["misses"] == m  # second call served from the cache
        assert g.store.stats["hits"] >= n_chunks
    with gl.DataGadget(p, placement="file", cache_bytes=20000) as g:
        g.getData(ids)
        assert 0 < g.store.cached_bytes <= 20000


def test_two_file_tables_of_one_file_see_each_others_writes(tmp_path):
    for kind in ("npy", "hdf5"):
        a = _table(20, 3)
        p, ds = _make_file(tmp_path, kind, a, name=f"two_{kind}")
        with (
            gl.DataGadget(p, dataset=ds, placement="file") as g1,
            gl.DataGadget(p, dataset=ds, placement="file") as g2,
        ):
            np.testing.assert_array_equal(g2.getData([1]).numpy(), a[[1]])  # g2 caches it
            g1.insertData(torch.full((1, 3), 4.0), [1])
            np.testing.assert_array_equal(g2.getData([1]).numpy(), np.full((1, 3), 4.0, np.float32))
            g2.insertData(torch.full((1, 3), 5.0), [2])
            np.testing.assert_array_equal(g1.getData([2]).numpy(), np.full((1, 3), 5.0, np.float32))


def test_threads_share_a_file_table(tmp_path):
    import threading

    p = tmp_path / "th.h5"
    _write_h5(p, np.zeros((200, 4), np.float32), chunks=(8, 4))
    errors = []
    with gl.DataGadget(p, placement="file", cache_bytes=1 << 12) as g:

        def work(k):
            try:
                for i in range(k, 200, 4):
                    g.insertData(torch.full((1, 4), float(i)), [i])
                    g.insertData(torch.full((1, 1), -float(i)), ([i], slice(3, 4)))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors
    back = _read_h5(p)
    np.testing.assert_array_equal(back[:, 0], np.arange(200, dtype=np.float32))
    np.testing.assert_array_equal(back[:, 3], -np.arange(200, dtype=np.float32))


def test_pickled_file_table_reopens_file(tmp_path):
    import pickle

    a = _table(20, 3)
    p = tmp_path / "pk.h5"
    _write_h5(p, a, "g/d", chunks=(4, 3))
    with gl.DataGadget(p, dataset="g/d", placement="file") as g:
        blob = pickle.dumps(g)
        assert len(blob) < 20 * 3 * 4 + 2000 or a.tobytes() not in blob
    h = pickle.loads(blob)
    try:
        assert h.placement == "file"
        np.testing.assert_array_equal(_gadget_np(h), a)
    finally:
        h.close()


def test_file_table_views_refused_and_copy(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "v.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement="file") as g:
        with pytest.raises(gl.GadgetTypeError):
            g.as_tensor()
        with pytest.raises(gl.GadgetValueError) as ei:
            np.asarray(g, copy=False)
        assert isinstance(ei.value, ValueError)
        v = g.getNumpyVersion(copy=False)
        v[2] = -5
        np.testing.assert_array_equal(g.getData([2]).numpy(), a[[2]])
        np.testing.assert_array_equal(np.asarray(g), a)
    np.testing.assert_array_equal(np.load(p), a)


def test_file_table_load_switches_file_keeps_placement(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "t.npy"
    q = tmp_path / "u.h5"
    np.save(p, a)
    _write_h5(q, a * 2, chunks=(4, 3))
    with gl.DataGadget(p, placement="file") as g:
        g.load(q)
        assert g.placement == "file"
        np.testing.assert_array_equal(g.getData([3]).numpy(), (a * 2)[[3]])
        g.insertData(torch.ones(1, 3), [0])
    np.testing.assert_array_equal(np.load(p), a)
    assert _read_h5(q)[0].tolist() == [1.0, 1.0, 1.0]


def test_file_table_sees_shrink_and_truncation(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "s.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement="file", cache_bytes=0) as g:
        g.getData([19])
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size - 24)
        for ids in ([19], [0]):
            with pytest.raises(gl.GadgetFileError) as ei:
                g.getData(ids)
            assert "s.npy" in str(ei.value)
    h = tmp_path / "t.h5"
    _write_h5(h, _table(3000, 8))
    with gl.DataGadget(h, placement="file", cache_bytes=0) as g:
        g.getData([0])
        with open(h, "r+b") as f:
            f.truncate(h.stat().st_size - 4000)
        with pytest.raises(gl.GadgetFileError):
            g.getData([2999])


# --------------------------------------------------------------------------- option checks


def test_save_option_errors_name_what_is_accepted(tmp_path):
    g = gl.DataGadget(_table(10, 2), placement="cpu")
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.save(tmp_path / "x.npy", compression="gzip")
    assert "compression" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.save(tmp_path / "x.h5", chunkrows=4)
    assert "chunkrows" in str(ei.value) and "chunk_rows" in str(ei.value)
    with pytest.raises(gl.GadgetValueError) as ei:
        g.save(tmp_path / "x.h5", compression="lzf", compression_level=3)
    assert "lzf" in str(ei.value)
    with pytest.raises(gl.GadgetValueError) as ei:
        g.save(tmp_path / "x.h5", compression="gzip", compression_level=10)
    assert "10" in str(ei.value)
    with pytest.raises(gl.GadgetKeyError) as ei:
        g.save(tmp_path / "x.h5", format="csv")
    assert "csv" in str(ei.value) and "hdf5" in str(ei.value)
    with pytest.raises(gl.GadgetError) as ei:
        g.save(tmp_path / "x.txt")
    assert "x.txt" in str(ei.value)
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        g.save(tmp_path / "nodir" / "x.npy")
    assert "nodir" in str(ei.value)
    assert _leftovers(tmp_path, set()) == []
    g.save(tmp_path / "forced.npy", format="hdf5")
    assert h5py.is_hdf5(tmp_path / "forced.npy")


@pytest.mark.parametrize(
    "kw,exc",
    [
        ({"cache_bytes": -1}, gl.GadgetValueError),
        ({"cache_bytes": "1G"}, gl.GadgetTypeError),
        ({"cache_bytes": True}, gl.GadgetTypeError),
        ({"block_rows": 0}, gl.GadgetValueError),
        ({"block_rows": 2.0}, gl.GadgetTypeError),
        ({"progress": "False"}, gl.GadgetTypeError),
        ({"bogus": 3}, gl.GadgetTypeError),
        ({"dataset": "x"}, gl.GadgetValueError),
    ],
)
def test_file_options_validated(tmp_path, kw, exc):
    p = tmp_path / "a.npy"
    np.save(p, _table(10, 2))
    with pytest.raises(exc) as ei:
        gl.DataGadget(p, placement="file", **kw)
    key = next(iter(kw))
    assert key in str(ei.value)


@pytest.mark.parametrize("block_rows", [1, 3, 1000])
def test_block_rows_any_value_same_rows(tmp_path, block_rows):
    a = _table(20, 3)
    p = tmp_path / "a.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement="file", block_rows=block_rows) as g:
        ids = [19, 0, 7, 7, 13]
        np.testing.assert_array_equal(g.getData(ids).numpy(), a[ids])
        g.insertData(torch.zeros(2, 3), [7, 8])
    a[[7, 8]] = 0
    np.testing.assert_array_equal(np.load(p), a)


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr"])
def test_bool_files_read_and_write(tmp_path, kind):
    if kind == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    b = _table(10, 3, dtype=np.bool_)
    p, ds = _make_file(tmp_path, kind, b)
    with gl.DataGadget(p, dataset=ds, placement="file") as g:
        assert g.dtype == torch.bool
        np.testing.assert_array_equal(_gadget_np(g), b)
        g.insertData(torch.tensor([[True, False, True]]), [9])
    b[9] = [True, False, True]
    back = _read_back(kind, p, ds)
    assert back.dtype == np.bool_
    np.testing.assert_array_equal(back, b)


@pytest.mark.parametrize("fmt,ext", FORMATS)
def test_other_file_tables_raise_after_a_save_until_load(tmp_path, fmt, ext):
    if fmt == "zarr" and not ZARR3:
        pytest.skip("zarr 3")
    a = _table(20, 3)
    p = tmp_path / f"so{ext}"
    gl.DataGadget(a, placement="cpu").save(p)
    with gl.DataGadget(p, placement="file") as g1, gl.DataGadget(p, placement="file") as g2:
        g2.getData([0])
        g1.insertData(torch.zeros(1, 3), [0])
        g1.save(p)
        with pytest.raises(gl.GadgetFileError) as ei:
            g2.getData([1])
        assert p.name in str(ei.value)
        with pytest.raises(gl.GadgetFileError):
            g2.insertData(torch.ones(1, 3), [1])
        np.testing.assert_array_equal(g1.getData([0, 1]).numpy(), np.stack([np.zeros(3), a[1]]))
        g2.load(p)
        np.testing.assert_array_equal(g2.getData([0, 1]).numpy(), np.stack([np.zeros(3), a[1]]))
    with gl.DataGadget(p, placement="cpu") as h:
        exp = a.copy()
        exp[0] = 0
        np.testing.assert_array_equal(_gadget_np(h), exp)


def test_file_table_out_checked(tmp_path):
    a = _table(20, 3)
    p = tmp_path / "o.npy"
    np.save(p, a)
    with gl.DataGadget(p, placement="file") as g:
        with pytest.raises(gl.GadgetTypeError) as ei:
            g.getData([0, 1], out=torch.empty(2, 3, dtype=torch.float64))
        assert "float32" in str(ei.value) and "float64" in str(ei.value)
        with pytest.raises(gl.GadgetValueError) as ei:
            g.getData([0, 1], out=torch.empty(3, 3))
        assert "(2, 3)" in str(ei.value) and "(3, 3)" in str(ei.value)
        with pytest.raises(gl.GadgetValueError):
            g.getData([0, 1], out=torch.empty(3, 2).t())


def test_bfloat16_file_table_round_trips_across_formats(tmp_path):
    t = _random_torch("bfloat16", shape=(20, 3))
    p = tmp_path / "bf.h5"
    gl.DataGadget(t, placement="cpu").save(p, chunk_rows=4)
    with h5py.File(p, "r") as f:
        assert f["data"].dtype == np.uint16
    exp = t.clone()
    exp[5] = 1
    with gl.DataGadget(p, placement="file") as g:
        assert g.dtype == torch.bfloat16
        np.testing.assert_array_equal(_tbits(g.getData(torch.arange(20))), _tbits(t))
        g.insertData(torch.ones(1, 3, dtype=torch.bfloat16), [5])
        np.testing.assert_array_equal(g.getNumpyVersion(), exp.float().numpy())
        if ZARR3:
            g.save(tmp_path / "bf.zarr")
    if ZARR3:
        with gl.DataGadget(tmp_path / "bf.zarr", placement="file") as h:
            assert h.dtype == torch.bfloat16
            np.testing.assert_array_equal(_tbits(h.getData(torch.arange(20))), _tbits(exp))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="cpu", dtype="float32")


@needs_zarr3
@pytest.mark.parametrize("damage", ["bad_json", "cut_json", "no_meta", "cut_chunk", "empty_chunk"])
def test_damaged_zarr_stores_are_file_errors(tmp_path, damage):
    a = _table(20, 3)
    p = tmp_path / "d.zarr"
    _zarr_array(p, a, chunks=(6, 3))
    meta = p / "zarr.json"
    chunk = sorted(q for q in p.rglob("*") if q.is_file() and q.name != "zarr.json")[1]
    if damage == "bad_json":
        meta.write_text("{ not json")
    elif damage == "cut_json":
        meta.write_text(meta.read_text()[: len(meta.read_text()) // 2])
    elif damage == "no_meta":
        meta.unlink()
    elif damage == "cut_chunk":
        chunk.write_bytes(chunk.read_bytes()[: len(chunk.read_bytes()) // 2])
    else:
        chunk.write_bytes(b"")
    with pytest.raises(gl.GadgetFileError) as ei:
        g = gl.DataGadget(p, placement="file")
        try:
            g.getData(torch.arange(20))
        finally:
            g.close()
    assert "d.zarr" in str(ei.value)
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(p, placement="cpu")


@pytest.mark.parametrize("keep", [0, 8, 512])
def test_cut_short_hdf5_is_file_error(tmp_path, keep):
    src = tmp_path / "full.h5"
    _write_h5(src, _table(20, 3))
    p = tmp_path / "cut.h5"
    p.write_bytes(src.read_bytes()[:keep])
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError) as ei:
            gl.DataGadget(p, placement=placement)
        assert "cut.h5" in str(ei.value)
