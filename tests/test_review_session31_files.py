"""Black-box review (session 31) of the README's "Files: .npy, HDF5 and zarr" section
(creating, opening, reading and writing file-backed tables, dtypes, 1-D / N-D arrays,
chunking and compression, dataset names, read-only files, atomic saves, conversion between
formats through the API and ``python -m gadgetloader convert``); written from README.md,
SPEC.md and the public docstrings only."""

from __future__ import annotations

import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


EXT = {"npy": ".npy", "hdf5": ".h5", "zarr": ".zarr"}
FORMATS = ["npy", "hdf5", "zarr"]
SINKS = {"npy": "NpySink", "hdf5": "Hdf5Sink", "zarr": "ZarrSink"}
NP_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _rng(seed=0):
    return np.random.default_rng(seed)


def make_array(dtype: str, shape, seed=0) -> np.ndarray:
    """Values covering the dtype's edges (nan, -0.0, inf, a NaN payload, min/max)."""
    rng = _rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("float"):
        a = rng.standard_normal(shape).astype(dtype).reshape(-1)
        a[:4] = [np.nan, -0.0, np.inf, -np.inf]
        if dtype == "float32":
            a[4] = np.array([0x7FC00123], np.uint32).view(np.float32)[0]
        return a.reshape(shape)
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    a.reshape(-1)[:2] = [info.min, info.max]
    return a


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def read_direct(path, fmt, dataset=None) -> np.ndarray:
    """Read a saved file with numpy / h5py / zarr, not with gadgetloader."""
    path = str(path)
    if fmt == "npy":
        return np.load(path)
    if fmt == "hdf5":
        with h5py.File(path, "r") as f:
            return f[dataset or "data"][()]
    if dataset is None:
        return zarr.open_array(path, mode="r")[...]
    return zarr.open_group(path, mode="r")[dataset][...]


def cpu(arr, **kw):
    return gl.DataGadget(arr, placement="cpu", **kw)


def save_opts(fmt, **kw):
    return {} if fmt == "npy" else kw


# --------------------------------------------------------------------------------------
# Round trips: every dtype, 1-D / 2-D / 3-D, every format, read back directly and through
# both a `cpu` and a `file` table.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_save_round_trip_bit_exact_all_dtypes(tmp_path, fmt, dtype):
    a = make_array(dtype, (19, 5))
    p = tmp_path / f"t{EXT[fmt]}"
    cpu(a).save(p, **save_opts(fmt, chunk_rows=4))
    assert same_bits(read_direct(p, fmt), a)
    for placement in ("cpu", "file"):
        g = gl.DataGadget(p, placement=placement)
        assert g.shape == a.shape and g.placement == placement
        assert same_bits(g.getData(torch.arange(19)).numpy(), a)
        ids = [18, 0, 3, 3, 7]
        assert same_bits(g.getData(ids).numpy(), a[ids])
        g.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(23,), (23, 2, 3), (9, 1), (5, 2, 2, 2)])
def test_save_round_trip_nd_and_1d(tmp_path, fmt, shape):
    a = make_array("float32", shape, seed=1)
    p = tmp_path / f"t{EXT[fmt]}"
    cpu(a).save(p, **save_opts(fmt, chunk_rows=3))
    assert same_bits(read_direct(p, fmt), a)
    f = gl.DataGadget(p, placement="file")
    assert f.shape == shape and len(f) == shape[0] and f.row_shape == shape[1:]
    ids = np.array([[shape[0] - 1, 0], [2, 2]])
    assert same_bits(f.getData(ids).numpy(), a[ids])
    # a plain int gives one row without a leading axis
    assert same_bits(f.getData(1).numpy(), a[1])
    f.close()


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_bfloat16_stored_as_uint16_bits_plus_attribute(tmp_path, fmt):
    t = torch.randn(11, 4).to(torch.bfloat16)
    t[0, 0] = float("nan")
    t[0, 1] = -0.0
    p = tmp_path / f"b{EXT[fmt]}"
    gl.DataGadget(t, placement="cpu").save(p, **save_opts(fmt, chunk_rows=4))
    raw = read_direct(p, fmt)
    assert raw.dtype == np.uint16
    assert np.array_equal(raw.view(np.int16), t.view(torch.int16).numpy())
    if fmt == "hdf5":
        with h5py.File(p, "r") as f:
            attrs = dict(f["data"].attrs)
    else:
        attrs = dict(zarr.open_array(str(p), mode="r").attrs)
    assert "bfloat16" in [str(v) for v in attrs.values()]
    for placement in ("cpu", "file"):
        g = gl.DataGadget(p, placement=placement)
        assert g.dtype == torch.bfloat16
        assert torch.equal(g.getData(torch.arange(11)).view(torch.int16), t.view(torch.int16))
        g.close()


def test_bfloat16_has_no_npy_form(tmp_path):
    g = gl.DataGadget(torch.ones(3, 2, dtype=torch.bfloat16), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
        g.save(tmp_path / "b.npy")
    assert not (tmp_path / "b.npy").exists()
    assert os.listdir(tmp_path) == []


def test_bfloat16_file_table_writes_bits(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(6, 2).to(torch.bfloat16)
    p = tmp_path / "b.h5"
    gl.DataGadget(t, placement="cpu").save(p, chunk_rows=2)
    f = gl.DataGadget(p, placement="file")
    new = torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16)
    f.insertData(new, [3])
    f.close()
    ref = t.clone()
    ref[3] = new[0]
    raw = read_direct(p, "hdf5")
    assert np.array_equal(raw.view(np.int16), ref.view(torch.int16).numpy())


# --------------------------------------------------------------------------------------
# Files written by numpy / h5py / zarr themselves.
# --------------------------------------------------------------------------------------


def test_h5py_written_nested_dataset_and_missing_name_lists_datasets(tmp_path):
    a = make_array("int64", (10, 3))
    p = tmp_path / "data.h5"
    with h5py.File(p, "w") as f:
        f["emb/words"] = a
        f["other"] = np.zeros((4, 2), np.float32)
    g = gl.DataGadget(p, dataset="emb/words", placement="cpu")
    assert same_bits(g.getNumpyVersion(), a)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, dataset="nope", placement="cpu")
    assert "emb/words" in str(ei.value) and "other" in str(ei.value)
    assert isinstance(ei.value, KeyError)
    # two datasets and no dataset= : an error that lists them
    with pytest.raises(gl.GadgetKeyError) as ei2:
        gl.DataGadget(p, placement="file")
    assert "emb/words" in str(ei2.value) and "other" in str(ei2.value)


@pytest.mark.parametrize(
    "layout",
    [
        {"chunks": None},
        {"chunks": (3, 4)},
        {"chunks": (2, 2), "compression": "gzip"},
        {"chunks": (4, 4), "compression": "lzf", "shuffle": True},
        {"chunks": (5, 1), "fletcher32": True},
    ],
)
def test_h5py_layouts_read_and_write_through(tmp_path, layout):
    a = make_array("float32", (13, 4), seed=3)
    p = tmp_path / "l.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("d", data=a, **layout)
    g = gl.DataGadget(p, placement="file")
    ids = np.array([12, 0, 5, 5, 6])
    assert same_bits(g.getData(ids).numpy(), a[ids])
    rows = torch.full((3, 4), -7.0)
    rows[2] = 9.0
    g.insertData(rows, [4, 11, 4])  # repeated id: the last occurrence wins
    g.close()
    ref = a.copy()
    ref[11] = -7.0
    ref[4] = 9.0
    assert same_bits(read_direct(p, "hdf5", "d"), ref)


def test_h5py_unallocated_chunks_read_as_fill_value(tmp_path):
    p = tmp_path / "fv.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("d", shape=(10, 2), chunks=(2, 2), dtype="f4", fillvalue=3.5)
        d[0:2] = 1.0
    for placement in ("cpu", "file"):
        g = gl.DataGadget(p, placement=placement)
        assert g.getData([0, 9]).tolist() == [[1.0, 1.0], [3.5, 3.5]]
        g.close()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zarr_written_by_zarr_reads_and_writes(tmp_path, zarr_format):
    a = make_array("int16", (11, 3), seed=4)
    p = tmp_path / "z.zarr"
    z = zarr.create_array(
        str(p), shape=a.shape, chunks=(4, 3), dtype="int16", zarr_format=zarr_format, fill_value=5
    )
    z[:7] = a[:7]
    ref = a.copy()
    ref[7:] = 5
    assert same_bits(gl.DataGadget(p, placement="cpu").getNumpyVersion(), ref)
    f = gl.DataGadget(p, placement="file")
    assert same_bits(f.getData([10, 0]).numpy(), ref[[10, 0]])
    f.insertData(torch.full((2, 3), 9, dtype=torch.int16), [8, 1])
    f.close()
    ref[[8, 1]] = 9
    assert same_bits(zarr.open_array(str(p), mode="r")[...], ref)


def test_zarr_column_chunks_and_shards(tmp_path):
    a = np.arange(64.0).reshape(16, 4)
    p = tmp_path / "s.zarr"
    z = zarr.create_array(str(p), shape=(16, 4), chunks=(2, 2), shards=(8, 4), dtype="float64")
    z[:] = a
    f = gl.DataGadget(p, placement="file")
    assert same_bits(f.getData([15, 0, 9]).numpy(), a[[15, 0, 9]])
    f.insertData(torch.full((1, 4), -1.0, dtype=torch.float64), [9])
    f.close()
    a[9] = -1.0
    assert same_bits(zarr.open_array(str(p), mode="r")[...], a)


def test_zarr_group_dataset_names(tmp_path):
    a = make_array("float32", (8, 3))
    p = tmp_path / "g.zarr"
    root = zarr.open_group(str(p), mode="w")
    root.create_array("x/y", data=a)
    root.create_array("z", data=a * 2)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, placement="cpu")
    assert "x/y" in str(ei.value) and "z" in str(ei.value)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, dataset="q", placement="cpu")
    assert "x/y" in str(ei.value)
    g = gl.DataGadget(p, dataset="x/y", placement="file")
    assert same_bits(g.getData([7]).numpy(), a[[7]])


def test_zarr_group_with_one_array_needs_no_dataset(tmp_path):
    a = make_array("int32", (6, 2))
    p = tmp_path / "one.zarr"
    zarr.open_group(str(p), mode="w").create_array("only/arr", data=a)
    assert same_bits(gl.DataGadget(p, placement="cpu").getNumpyVersion(), a)


def test_npy_fortran_order_reads_right_and_is_read_only_as_file_table(tmp_path):
    a = make_array("float32", (8, 3))
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(a))
    assert same_bits(gl.DataGadget(p, placement="cpu").getNumpyVersion(), a)
    f = gl.DataGadget(p, placement="file")
    assert same_bits(f.getData([7, 1]).numpy(), a[[7, 1]])
    before = p.read_bytes()
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        f.insertData(torch.zeros(1, 3), [0])
    assert p.read_bytes() == before


def test_npy_big_endian_values_are_right_or_refused(tmp_path):
    a = make_array("float32", (8, 3))
    p = tmp_path / "be.npy"
    np.save(p, a.astype(">f4"))
    for placement in ("cpu", "file"):
        try:
            g = gl.DataGadget(p, placement=placement)
        except gl.GadgetError:
            continue
        assert same_bits(g.getData([1, 7]).numpy(), a[[1, 7]])
        if placement == "file":
            try:
                g.insertData(torch.full((1, 3), 7.0), [0])
            except gl.ReadOnlyError:
                pass
            else:
                g.close()
                assert np.array_equal(np.load(p)[0], [7.0, 7.0, 7.0])
                assert same_bits(np.load(p)[1:].astype("<f4"), a[1:])


# --------------------------------------------------------------------------------------
# Format detection, format=, dataset= on save.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, name", [("npy", "x.dat"), ("hdf5", "x.bin"), ("zarr", "store")])
def test_format_from_content_when_extension_says_nothing(tmp_path, fmt, name):
    a = make_array("int32", (5, 2))
    src = tmp_path / f"s{EXT[fmt]}"
    cpu(a).save(src)
    os.rename(src, tmp_path / name)
    assert same_bits(gl.DataGadget(tmp_path / name, placement="cpu").getNumpyVersion(), a)


@pytest.mark.parametrize("ext", [".h5", ".hdf5", ".hdf"])
def test_hdf5_extensions(tmp_path, ext):
    a = make_array("float64", (4, 2))
    p = tmp_path / f"x{ext}"
    cpu(a).save(p)
    assert h5py.is_hdf5(p)
    assert same_bits(read_direct(p, "hdf5"), a)


def test_format_forces_on_save_and_load(tmp_path):
    a = make_array("float32", (6, 2))
    p = tmp_path / "odd.npy"
    cpu(a).save(p, format="hdf5")
    assert h5py.is_hdf5(p)
    assert same_bits(gl.DataGadget(p, format="hdf5", placement="cpu").getNumpyVersion(), a)
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(tmp_path / "odd.npy", format="npy", placement="cpu")


def test_unknown_format_name_lists_valid_ones(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, np.zeros((2, 2), np.float32))
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, format="parquet", placement="cpu")
    for name in ("npy", "hdf5", "zarr"):
        assert name in str(ei.value)


def test_save_without_extension_or_format_is_refused(tmp_path):
    with pytest.raises(gl.GadgetError):
        cpu(np.zeros((2, 2), np.float32)).save(tmp_path / "noext")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_save_dataset_name_and_reopen(tmp_path, fmt):
    a = make_array("float32", (7, 3))
    p = tmp_path / f"d{EXT[fmt]}"
    cpu(a).save(p, dataset="emb/words", chunk_rows=2)
    assert same_bits(read_direct(p, fmt, "emb/words"), a)
    # the only array: dataset= optional when opening
    assert same_bits(gl.DataGadget(p, placement="cpu").getNumpyVersion(), a)
    assert same_bits(
        gl.DataGadget(p, dataset="emb/words", placement="file").getData([6]).numpy(), a[[6]]
    )


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
@pytest.mark.parametrize("bad", ["../a", "a/./b"])
def test_save_dataset_with_dot_parts_is_value_error(tmp_path, fmt, bad):
    with pytest.raises(gl.GadgetValueError):
        cpu(np.zeros((2, 2), np.float32)).save(tmp_path / f"x{EXT[fmt]}", dataset=bad)
    assert os.listdir(tmp_path) == []


def test_save_replaces_whole_hdf5_file_with_all_its_datasets(tmp_path):
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f["a"] = np.zeros((3, 2))
        f["b/c"] = np.ones((3, 2))
    new = make_array("int8", (4, 2))
    cpu(new).save(p, dataset="only")
    with h5py.File(p, "r") as f:
        names = []
        f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
        assert names == ["only"]
        assert same_bits(f["only"][()], new)


def test_save_replaces_whole_zarr_group(tmp_path):
    p = tmp_path / "m.zarr"
    root = zarr.open_group(str(p), mode="w")
    root.create_array("a", data=np.zeros((3, 2)))
    root.create_array("b", data=np.ones((3, 2)))
    new = make_array("int8", (4, 2))
    cpu(new).save(p, dataset="only")
    grp = zarr.open_group(str(p), mode="r")
    assert sorted(k for k, _ in grp.arrays()) == ["only"]
    assert same_bits(grp["only"][...], new)


# --------------------------------------------------------------------------------------
# Chunking and compression options.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "comp, expect", [(None, None), ("none", None), ("gzip", "gzip"), ("lzf", "lzf")]
)
def test_hdf5_compression_and_chunk_rows(tmp_path, comp, expect):
    a = make_array("float32", (20, 2, 3))
    p = tmp_path / "c.h5"
    cpu(a).save(p, chunk_rows=4, compression=comp)
    with h5py.File(p, "r") as f:
        d = f["data"]
        assert d.chunks == (4, 2, 3)  # chunks span whole rows
        assert d.compression == expect
        assert same_bits(d[()], a)


def test_hdf5_default_is_uncompressed_and_gzip_level(tmp_path):
    a = make_array("float32", (20, 3))
    cpu(a).save(tmp_path / "d.h5")
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert f["data"].compression is None
    cpu(a).save(tmp_path / "g.h5", compression="gzip", compression_level=7)
    with h5py.File(tmp_path / "g.h5", "r") as f:
        assert f["data"].compression == "gzip" and f["data"].compression_opts == 7


@pytest.mark.parametrize(
    "comp, codec",
    [(None, "Zstd"), ("zstd", "Zstd"), ("gzip", "Gzip"), ("blosc", "Blosc"), ("none", None)],
)
def test_zarr_compression_and_chunk_rows(tmp_path, comp, codec):
    a = make_array("int64", (21, 3))
    p = tmp_path / "c.zarr"
    cpu(a).save(p, chunk_rows=5, compression=comp)
    z = zarr.open_array(str(p), mode="r")
    assert z.chunks == (5, 3)
    names = [type(c).__name__ for c in z.compressors]
    if codec is None:
        assert names == []
    else:
        assert len(names) == 1 and names[0].startswith(codec)
    assert same_bits(z[...], a)


def test_zarr_compression_level_reaches_codec(tmp_path):
    p = tmp_path / "c.zarr"
    cpu(np.arange(40, dtype=np.int32).reshape(10, 4)).save(
        p, compression="gzip", compression_level=9
    )
    (codec,) = zarr.open_array(str(p), mode="r").compressors
    assert codec.level == 9


@pytest.mark.parametrize(
    "fmt, opts, exc",
    [
        ("hdf5", {"compression": "zstd"}, gl.GadgetKeyError),
        ("hdf5", {"compression": "bogus"}, gl.GadgetKeyError),
        ("zarr", {"compression": "lzf"}, gl.GadgetKeyError),
        ("hdf5", {"compression": "gzip", "compression_level": 12}, gl.GadgetValueError),
        ("zarr", {"compression_level": 23}, gl.GadgetValueError),
        ("zarr", {"compression": "blosc", "compression_level": -1}, gl.GadgetValueError),
        ("hdf5", {"chunk_rows": 0}, gl.GadgetValueError),
        ("zarr", {"chunk_rows": -3}, gl.GadgetValueError),
        ("hdf5", {"chunk_rows": 2.5}, gl.GadgetValueError),
        ("npy", {"progress": "False"}, gl.GadgetTypeError),
        ("hdf5", {"progress": "False"}, gl.GadgetTypeError),
    ],
)
def test_bad_save_options_refused_before_any_file(tmp_path, fmt, opts, exc):
    p = tmp_path / f"x{EXT[fmt]}"
    with pytest.raises(exc):
        cpu(np.zeros((4, 2), np.float32)).save(p, **opts)
    assert os.listdir(tmp_path) == []


def test_bad_option_keeps_existing_file(tmp_path):
    p = tmp_path / "x.h5"
    old = make_array("float32", (3, 2))
    cpu(old).save(p)
    before = p.read_bytes()
    with pytest.raises(gl.GadgetKeyError):
        cpu(np.zeros((4, 2), np.float32)).save(p, compression="nope")
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ["x.h5"]


@pytest.mark.parametrize("opt", [{"chunk_rows": 4}, {"compression": "gzip"}, {"dataset": "d"}])
def test_npy_refuses_options(tmp_path, opt):
    with pytest.raises(gl.GadgetError):
        cpu(np.zeros((4, 2), np.float32)).save(tmp_path / "x.npy", **opt)
    assert os.listdir(tmp_path) == []


def test_progress_false_is_silent_and_true_shows_bar(tmp_path, capsys):
    a = np.zeros((50, 4), np.float32)
    cpu(a).save(tmp_path / "q.h5", progress=False)
    gl.DataGadget(tmp_path / "q.h5", placement="cpu", progress=False)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""
    cpu(a).save(tmp_path / "r.h5", progress=True)
    assert capsys.readouterr().err != ""


# --------------------------------------------------------------------------------------
# Errors when opening.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_missing_file_is_file_not_found(tmp_path, placement):
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.DataGadget(tmp_path / "missing.npy", placement=placement)
    assert isinstance(ei.value, FileNotFoundError)
    assert "missing.npy" in str(ei.value)


def test_truncated_and_garbage_npy_are_file_errors_naming_the_file(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, np.arange(300, dtype=np.float32).reshape(100, 3))
    cut = tmp_path / "cut.npy"
    cut.write_bytes(p.read_bytes()[:400])
    junk = tmp_path / "junk.npy"
    junk.write_text("hello")
    for bad in (cut, junk):
        for placement in ("cpu", "file"):
            with pytest.raises(gl.GadgetFileError) as ei:
                gl.DataGadget(bad, placement=placement)
            assert bad.name in str(ei.value)


def test_non_hdf5_file_with_h5_extension(tmp_path):
    p = tmp_path / "fake.h5"
    p.write_bytes(b"not an hdf5 file at all" * 10)
    with pytest.raises(gl.GadgetFileError, match="fake.h5"):
        gl.DataGadget(p, placement="cpu")


@pytest.mark.parametrize(
    "arr",
    [np.array([[1, "a"]], dtype=object), np.array([["ab", "c"]]), np.zeros((3, 2), np.complex64)],
)
def test_object_string_complex_npy_refused(tmp_path, arr):
    p = tmp_path / "o.npy"
    np.save(p, arr, allow_pickle=True)
    with pytest.raises(gl.GadgetTypeError, match="o.npy"):
        gl.DataGadget(p, placement="cpu")


def test_hdf5_string_compound_scalar_refused(tmp_path):
    p = tmp_path / "h.h5"
    with h5py.File(p, "w") as f:
        f["str"] = np.array([b"ab", b"cd"])
        f.create_dataset("cmp", data=np.zeros(3, dtype=[("a", "i4"), ("b", "f4")]))
        f["s"] = np.float32(3)
    for ds in ("str", "cmp"):
        with pytest.raises(gl.GadgetTypeError):
            gl.DataGadget(p, dataset=ds, placement="cpu")
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(p, dataset="s", placement="cpu")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_zero_row_file_is_error_naming_file(tmp_path, fmt, placement):
    p = tmp_path / f"emptytbl{EXT[fmt]}"
    empty = np.zeros((0, 3), np.float32)
    if fmt == "npy":
        np.save(p, empty)
    elif fmt == "hdf5":
        with h5py.File(p, "w") as f:
            f.create_dataset("d", data=empty)
    else:
        zarr.create_array(str(p), shape=(0, 3), chunks=(1, 3), dtype="float32")
    with pytest.raises(gl.GadgetError) as ei:
        gl.DataGadget(p, placement=placement)
    assert "emptytbl" in str(ei.value) and "zero rows" in str(ei.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_row_in_memory_table_is_not_saved(tmp_path, fmt):
    g = cpu(np.zeros((0, 3), np.float32))
    assert len(g) == 0
    with pytest.raises(gl.GadgetError):
        g.save(tmp_path / f"z{EXT[fmt]}")
    assert os.listdir(tmp_path) == []


def test_file_of_other_dtype_refused_with_dtype(tmp_path):
    p = tmp_path / "f64.npy"
    np.save(p, np.zeros((3, 2), np.float64))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, dtype="float32", placement="cpu")


# --------------------------------------------------------------------------------------
# Unsigned files and dtype=.
# --------------------------------------------------------------------------------------


def _write_any(path, fmt, arr):
    if fmt == "npy":
        np.save(path, arr)
    elif fmt == "hdf5":
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=arr, chunks=(2,) + arr.shape[1:])
    else:
        z = zarr.create_array(
            str(path), shape=arr.shape, chunks=(2,) + arr.shape[1:], dtype=arr.dtype
        )
        z[...] = arr


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "src_dtype, values, dtype, expect",
    [
        ("uint16", [0, 1, 65535, 40000], "int32", [0, 1, 65535, 40000]),
        ("uint32", [1, 16777217, 2**32 - 1, 7], "int64", [1, 16777217, 2**32 - 1, 7]),
        ("uint32", [1, 16777217, 3, 7], "float32", [1.0, 16777216.0, 3.0, 7.0]),
        ("uint64", [0, 2**40, 5, 2**63 - 1], "int64", [0, 2**40, 5, 2**63 - 1]),
    ],
)
def test_unsigned_file_converts_with_dtype(tmp_path, fmt, src_dtype, values, dtype, expect):
    p = tmp_path / f"u{EXT[fmt]}"
    _write_any(p, fmt, np.array(values, dtype=src_dtype))
    g = gl.DataGadget(p, dtype=dtype, placement="cpu")
    assert g.dtype == getattr(torch, dtype)
    assert g.getNumpyVersion().tolist() == expect


@pytest.mark.parametrize("fmt", FORMATS)
def test_unsigned_value_out_of_range_stops_load(tmp_path, fmt):
    p = tmp_path / f"u{EXT[fmt]}"
    _write_any(p, fmt, np.array([1, 2, 40000, 3], np.uint16))
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(p, dtype="int16", placement="cpu")


@pytest.mark.parametrize("fmt", FORMATS)
def test_unsigned_file_refused_without_dtype_and_on_file_placement(tmp_path, fmt):
    p = tmp_path / f"u{EXT[fmt]}"
    _write_any(p, fmt, np.array([[1, 2], [3, 4]], np.uint32))
    with pytest.raises(gl.GadgetTypeError, match="dtype="):
        gl.DataGadget(p, placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, dtype="int64", placement="file")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="file")


@pytest.mark.parametrize("method", ["load", "loadCupy"])
def test_load_refuses_unsigned_file_and_keeps_table(tmp_path, method):
    p = tmp_path / "u.npy"
    np.save(p, np.array([[1, 2]], np.uint32))
    a = make_array("float32", (4, 2))
    g = cpu(a.copy())
    with pytest.raises(gl.GadgetTypeError):
        getattr(g, method)(p)
    assert g.shape == (4, 2) and same_bits(g.getNumpyVersion(), a)


# --------------------------------------------------------------------------------------
# load() / loadCupy().
# --------------------------------------------------------------------------------------


def test_load_replaces_table_keeps_placement(tmp_path):
    a = make_array("int64", (9, 2))
    p = tmp_path / "d.h5"
    with h5py.File(p, "w") as f:
        f["emb/words"] = a
        f["x"] = np.zeros(3)
    g = cpu(np.zeros((2, 5), np.float32))
    g.load(p, dataset="emb/words")
    assert g.placement == "cpu" and g.shape == (9, 2) and g.dtype == torch.int64
    assert same_bits(g.getNumpyVersion(), a)


@pytest.mark.parametrize(
    "name, kw, exc",
    [
        ("missing.npy", {}, gl.GadgetFileNotFoundError),
        ("multi.h5", {}, gl.GadgetKeyError),
        ("multi.h5", {"dataset": "nope"}, gl.GadgetKeyError),
        ("cut.npy", {}, gl.GadgetFileError),
    ],
)
def test_failed_load_leaves_table_unchanged(tmp_path, name, kw, exc):
    with h5py.File(tmp_path / "multi.h5", "w") as f:
        f["a"] = np.zeros((2, 2))
        f["b"] = np.zeros((2, 2))
    np.save(tmp_path / "full.npy", np.zeros((100, 4), np.float32))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "full.npy").read_bytes()[:300])
    a = make_array("float32", (5, 3))
    g = cpu(a.copy())
    with pytest.raises(exc):
        g.load(tmp_path / name, **kw)
    assert g.shape == (5, 3) and same_bits(g.getNumpyVersion(), a)


def test_load_into_file_table_opens_new_file_for_writes(tmp_path):
    a = make_array("float32", (6, 3))
    cpu(a).save(tmp_path / "one.zarr")
    b = make_array("float32", (4, 3), seed=9)
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f["emb"] = b
    g = gl.DataGadget(tmp_path / "one.zarr", placement="file")
    g.load(tmp_path / "two.h5")
    assert g.placement == "file" and g.shape == (4, 3)
    assert same_bits(g.getData([3]).numpy(), b[[3]])
    g.insertData(torch.full((1, 3), 2.0), [0])
    g.close()
    b[0] = 2.0
    assert same_bits(read_direct(tmp_path / "two.h5", "hdf5", "emb"), b)
    assert same_bits(read_direct(tmp_path / "one.zarr", "zarr"), a)


def test_savecupy_appends_npy_and_loadcupy_round_trip(tmp_path):
    a = make_array("int16", (7, 3))
    g = cpu(a)
    g.saveCupy(str(tmp_path / "emb"))
    assert (tmp_path / "emb.npy").exists() and not (tmp_path / "emb").exists()
    assert same_bits(np.load(tmp_path / "emb.npy"), a)
    h = cpu(np.zeros((1, 1), np.float32))
    h.loadCupy(tmp_path / "emb.npy")
    assert same_bits(h.getNumpyVersion(), a)


# --------------------------------------------------------------------------------------
# `file` tables: reads, writes, options.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_file_table_insert_writes_through_to_file(tmp_path, fmt, cache_bytes):
    a = make_array("float32", (30, 4))
    p = tmp_path / f"w{EXT[fmt]}"
    cpu(a).save(p, **save_opts(fmt, chunk_rows=4, compression="gzip" if fmt == "hdf5" else None))
    f = gl.DataGadget(p, placement="file", cache_bytes=cache_bytes)
    f.getData(torch.arange(30))  # fill any cache first
    ids = torch.tensor([29, 0, 13, 13, 5])
    rows = torch.arange(20, dtype=torch.float32).reshape(5, 4) + 100
    f.insertData(rows, ids)
    ref = a.copy()
    for i, r in zip(ids.tolist(), rows.numpy(), strict=True):
        ref[i] = r
    assert same_bits(f.getData(torch.arange(30)).numpy(), ref)
    if fmt != "hdf5":  # "Each write reaches the file before it returns"
        assert same_bits(read_direct(p, fmt), ref)
    f.close()
    assert same_bits(read_direct(p, fmt), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_partial_row_writes_and_tuple_index(tmp_path, fmt):
    a = make_array("int32", (12, 2, 3))
    p = tmp_path / f"p{EXT[fmt]}"
    cpu(a).save(p, **save_opts(fmt, chunk_rows=5))
    f = gl.DataGadget(p, placement="file")
    assert same_bits(f[[1, 2], 0].numpy(), a[[1, 2], 0])
    assert same_bits(f.getData((slice(0, 6), slice(0, 1))).numpy(), a[0:6, 0:1])
    f.insertData(torch.full((2, 3), -1, dtype=torch.int32), ([4, 9], 1))
    f[2:4] = torch.zeros(2, 2, 3, dtype=torch.int32)
    f.close()
    ref = a.copy()
    ref[[4, 9], 1] = -1
    ref[2:4] = 0
    assert same_bits(read_direct(p, fmt), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_refused_writes_leave_file_unchanged(tmp_path, fmt):
    a = make_array("float32", (8, 3))
    p = tmp_path / f"r{EXT[fmt]}"
    cpu(a).save(p, **save_opts(fmt, chunk_rows=2))
    f = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.GadgetTypeError):
        f.insertData(torch.zeros(1, 3, dtype=torch.float64), [0])
    with pytest.raises(gl.GadgetValueError):
        f.insertData(torch.zeros(2, 3), [0])
    with pytest.raises(gl.GadgetIndexError):
        f.insertData(torch.zeros(2, 3), [0, 8])
    with pytest.raises(gl.GadgetIndexError):
        f.insertData(torch.zeros(1, 3), [-1])
    with pytest.raises(gl.GadgetTypeError):
        f.insertData(torch.zeros(1, 3), [0.0])
    f.close()
    assert same_bits(read_direct(p, fmt), a)


@pytest.mark.parametrize("fmt", FORMATS)
def test_writable_false_is_read_only(tmp_path, fmt):
    a = make_array("float32", (8, 3))
    p = tmp_path / f"r{EXT[fmt]}"
    cpu(a).save(p)
    for flag in (False, np.False_):
        f = gl.DataGadget(p, placement="file", writable=flag)
        assert same_bits(f.getData([7]).numpy(), a[[7]])
        with pytest.raises(gl.ReadOnlyError) as ei:
            f.insertData(torch.zeros(1, 3), [0])
        assert isinstance(ei.value, PermissionError)
        with pytest.raises(gl.ReadOnlyError):
            f.fill_(1.0)
        f.close()
    assert same_bits(read_direct(p, fmt), a)


@pytest.mark.parametrize("bad", [1, "False", 1.0])
def test_writable_takes_only_bools_or_none(tmp_path, bad):
    p = tmp_path / "a.npy"
    np.save(p, np.zeros((2, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="file", writable=bad)


@pytest.mark.parametrize("opt", [{"cache_bytes": 1 << 20}, {"writable": False}, {"block_rows": 4}])
def test_file_options_refused_on_in_memory_placement(tmp_path, opt):
    p = tmp_path / "a.npy"
    np.save(p, np.zeros((2, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="cpu", **opt)


def test_negative_cache_bytes_refused(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, np.zeros((2, 2), np.float32))
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(p, placement="file", cache_bytes=-1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_rows_option_gives_same_rows(tmp_path, fmt):
    a = make_array("float64", (37, 2))
    p = tmp_path / f"b{EXT[fmt]}"
    cpu(a).save(p, **save_opts(fmt, chunk_rows=8))
    f = gl.DataGadget(p, placement="file", block_rows=3, cache_bytes=64)
    ids = _rng(2).integers(0, 37, 50)
    assert same_bits(f.getData(ids).numpy(), a[ids])


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_file_tables_see_each_others_writes(tmp_path, fmt):
    a = make_array("float32", (16, 2))
    p = tmp_path / f"two{EXT[fmt]}"
    cpu(a).save(p, **save_opts(fmt, chunk_rows=4))
    t1 = gl.DataGadget(p, placement="file")
    t2 = gl.DataGadget(p, placement="file")
    assert same_bits(t2.getData([5]).numpy(), a[[5]])  # cached now
    t1.insertData(torch.full((1, 2), 3.0), [5])
    assert t2.getData([5]).tolist() == [[3.0, 3.0]]
    t1.close()
    t2.close()


def test_file_table_initialisers_write_file_and_refuse_shape_aware(tmp_path):
    p = tmp_path / "i.h5"
    cpu(np.zeros((10, 4), np.float32)).save(p, chunk_rows=3)
    f = gl.DataGadget(p, placement="file")
    f.fill_(2.5)
    with pytest.raises(gl.GadgetTypeError):
        f.init_(torch.nn.init.xavier_uniform_)
    assert f.getData(torch.arange(10)).eq(2.5).all()
    f.init_(torch.nn.init.constant_, -1.0)
    f.close()
    assert np.all(read_direct(p, "hdf5") == -1.0)


def test_file_table_views_refused_and_numpy_copies(tmp_path):
    a = make_array("float32", (6, 2))
    p = tmp_path / "v.npy"
    np.save(p, a)
    f = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.GadgetTypeError):
        f.as_tensor()
    with pytest.raises(ValueError):
        np.asarray(f, copy=False)
    arr = f.getNumpyVersion(copy=False)
    assert same_bits(arr, a)
    arr[:] = 0  # a copy: writes do not reach the table
    assert same_bits(f.getData(torch.arange(6)).numpy(), a)
    assert same_bits(np.asarray(f), a)


def test_closed_file_table(tmp_path):
    p = tmp_path / "c.zarr"
    cpu(np.ones((4, 2), np.float32)).save(p)
    with gl.DataGadget(p, placement="file") as f:
        assert f.getData([0]).tolist() == [[1.0, 1.0]]
    for call in (
        lambda: f.getData([0]),
        lambda: f.insertData(torch.zeros(1, 2), [0]),
        f.flush,
        lambda: f.load(p),
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert f.shape == (4, 2) and len(f) == 4 and "file" in repr(f)


def test_file_table_pickles_as_file_name(tmp_path):
    a = make_array("float32", (2000, 8))
    p = tmp_path / "big.npy"
    np.save(p, a)
    f = gl.DataGadget(p, placement="file")
    blob = pickle.dumps(f)
    assert len(blob) < a.nbytes // 4
    g = pickle.loads(blob)
    assert g.placement == "file"
    assert same_bits(g.getData([1999, 3]).numpy(), a[[1999, 3]])


def test_file_table_out_tensor(tmp_path):
    a = make_array("float32", (9, 3))
    p = tmp_path / "o.h5"
    cpu(a).save(p, chunk_rows=2)
    f = gl.DataGadget(p, placement="file")
    out = torch.empty(2, 3)
    res = f.getData([8, 1], out=out)
    assert res.data_ptr() == out.data_ptr()
    assert same_bits(out.numpy(), a[[8, 1]])


# --------------------------------------------------------------------------------------
# A file table keeps the file it opened.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_replaced_by_save_is_detected(tmp_path, fmt):
    p = tmp_path / f"r{EXT[fmt]}"
    cpu(np.zeros((6, 2), np.float32)).save(p)
    f = gl.DataGadget(p, placement="file")
    f.getData([0])
    cpu(np.ones((6, 2), np.float32)).save(p)
    with pytest.raises(gl.GadgetFileError):
        f.getData([0])
    with pytest.raises(gl.GadgetFileError):
        f.insertData(torch.zeros(1, 2), [0])
    assert np.all(read_direct(p, fmt) == 1.0)


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_file_deleted_is_detected(tmp_path, fmt):
    p = tmp_path / f"d{EXT[fmt]}"
    cpu(np.zeros((6, 2), np.float32)).save(p)
    f = gl.DataGadget(p, placement="file")
    f.getData([0])
    os.remove(p)
    with pytest.raises(gl.GadgetFileError):
        f.getData([5])


def test_npy_shrunk_in_place_is_detected(tmp_path):
    p = tmp_path / "s.npy"
    np.save(p, np.zeros((60, 2), np.float32))
    f = gl.DataGadget(p, placement="file", cache_bytes=0)
    f.getData([59])
    os.truncate(p, os.path.getsize(p) - 64)
    with pytest.raises(gl.GadgetFileError):
        f.getData([0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_saved_onto_its_own_path(tmp_path, fmt):
    a = make_array("float32", (8, 3))
    p = tmp_path / f"self{EXT[fmt]}"
    cpu(a).save(p)
    f = gl.DataGadget(p, placement="file")
    f.save(p)
    assert same_bits(read_direct(p, fmt), a)


# --------------------------------------------------------------------------------------
# HDF5 external links and virtual datasets.
# --------------------------------------------------------------------------------------


def test_external_link_read_only_and_names_target(tmp_path):
    a = make_array("float32", (8, 3))
    with h5py.File(tmp_path / "tgt.h5", "w") as f:
        f["grp/emb"] = a
    with h5py.File(tmp_path / "lnk.h5", "w") as f:
        f["e"] = h5py.ExternalLink("tgt.h5", "grp/emb")
    f = gl.DataGadget(tmp_path / "lnk.h5", placement="file")
    assert same_bits(f.getData([7, 0]).numpy(), a[[7, 0]])
    with pytest.raises(gl.ReadOnlyError) as ei:
        f.insertData(torch.zeros(1, 3), [0])
    assert "tgt.h5" in str(ei.value) and "grp/emb" in str(ei.value)
    with pytest.raises(gl.ReadOnlyError):
        gl.DataGadget(tmp_path / "lnk.h5", placement="file", writable=True)
    f.close()
    assert same_bits(read_direct(tmp_path / "tgt.h5", "hdf5", "grp/emb"), a)
    assert same_bits(gl.DataGadget(tmp_path / "lnk.h5", placement="cpu").getNumpyVersion(), a)


def test_virtual_dataset_read_only_and_missing_source_is_file_error(tmp_path):
    a = make_array("float32", (8, 3))
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f["x"] = a
    lay = h5py.VirtualLayout(shape=(8, 3), dtype="f4")
    lay[:] = h5py.VirtualSource("src.h5", "x", shape=(8, 3))
    with h5py.File(tmp_path / "vds.h5", "w") as f:
        f.create_virtual_dataset("v", lay)
    f = gl.DataGadget(tmp_path / "vds.h5", placement="file")
    assert same_bits(f.getData([5]).numpy(), a[[5]])
    with pytest.raises(gl.ReadOnlyError):
        f.insertData(torch.zeros(1, 3), [0])
    f.close()
    os.rename(tmp_path / "src.h5", tmp_path / "gone.h5")
    for placement in ("file", "cpu"):
        with pytest.raises(gl.GadgetFileError):
            gl.DataGadget(tmp_path / "vds.h5", placement=placement)


# --------------------------------------------------------------------------------------
# Damaged chunks: a write reads what it partly rewrites first.
# --------------------------------------------------------------------------------------


def test_damaged_zarr_chunk_partial_write_leaves_store_unchanged(tmp_path):
    a = make_array("float32", (16, 3))
    p = tmp_path / "c.zarr"
    cpu(a).save(p, chunk_rows=4)
    chunk = p / "c" / "1" / "0"
    assert chunk.is_file()
    chunk.write_bytes(b"\x00garbage" + chunk.read_bytes()[8:])
    snap = {q: q.read_bytes() for q in (p / "c").rglob("*") if q.is_file()}
    f = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.GadgetFileError):
        f.insertData(torch.zeros(2, 3), [0, 5])  # row 5 lies in the damaged chunk 1
    assert {q: q.read_bytes() for q in (p / "c").rglob("*") if q.is_file()} == snap
    assert same_bits(f.getData([0]).numpy(), a[[0]])
    with pytest.raises(gl.GadgetFileError):
        f.getData([5])


def test_damaged_hdf5_chunk_partial_write_leaves_file_unchanged(tmp_path):
    a = make_array("float32", (16, 3))
    p = tmp_path / "c.h5"
    cpu(a).save(p, chunk_rows=4, compression="gzip")
    with h5py.File(p, "r") as h:
        info = h["data"].id.get_chunk_info(1)
    raw = bytearray(p.read_bytes())
    raw[info.byte_offset : info.byte_offset + 8] = b"\xff" * 8
    p.write_bytes(bytes(raw))
    before = p.read_bytes()
    f = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.GadgetFileError):
        f.insertData(torch.zeros(2, 3), [0, 5])
    f.close()
    assert p.read_bytes() == before


# --------------------------------------------------------------------------------------
# Atomic saves.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_failing_sink_write_keeps_old_file_and_leaves_nothing(tmp_path, fmt, monkeypatch):
    p = tmp_path / f"old{EXT[fmt]}"
    old = make_array("float64", (5, 2))
    cpu(old).save(p)

    def boom(self, start, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(getattr(gl.io, SINKS[fmt]), "write", boom)
    with pytest.raises(OSError):
        cpu(make_array("float32", (100, 3))).save(p)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [p.name]
    assert same_bits(read_direct(p, fmt), old)


@pytest.mark.parametrize("fmt", FORMATS)
def test_keyboard_interrupt_in_save_removes_partial(tmp_path, fmt, monkeypatch):
    p = tmp_path / f"old{EXT[fmt]}"
    old = make_array("int32", (5, 2))
    cpu(old).save(p)

    def ctrl_c(self, start, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(getattr(gl.io, SINKS[fmt]), "write", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        cpu(make_array("int32", (50, 2))).save(p)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [p.name]
    assert same_bits(read_direct(p, fmt), old)


@pytest.mark.parametrize("fmt", FORMATS)
def test_interrupt_during_final_rename_is_held_until_in_place(tmp_path, fmt, monkeypatch):
    p = tmp_path / f"o{EXT[fmt]}"
    cpu(np.zeros((4, 2), np.float32)).save(p)
    new = make_array("float32", (6, 2))
    fired = []

    def wrap(orig):
        def f(src, dst, *a, **k):
            # one Ctrl-C, at the rename that puts the finished file in place
            if not fired and os.path.basename(os.fspath(dst)) == p.name:
                fired.append(1)
                signal.raise_signal(signal.SIGINT)
            return orig(src, dst, *a, **k)

        return f

    monkeypatch.setattr(os, "replace", wrap(os.replace))
    monkeypatch.setattr(os, "rename", wrap(os.rename))
    with pytest.raises(KeyboardInterrupt, match="interrupted after"):
        cpu(new).save(p)
    monkeypatch.undo()
    assert fired
    assert same_bits(read_direct(p, fmt), new)
    assert os.listdir(tmp_path) == [p.name]


@pytest.mark.parametrize(
    "fmt, kw", [("npy", {}), ("hdf5", {}), ("hdf5", {"compression": "gzip", "chunk_rows": 64})]
)
def test_file_size_limit_part_way_is_file_error_and_old_kept(tmp_path, fmt, kw):
    p = tmp_path / f"old{EXT[fmt]}"
    old = make_array("float32", (10, 3))
    cpu(old).save(p)
    big = cpu(_rng(0).standard_normal((2048, 256)).astype(np.float32))  # 2 MiB
    prev = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, hard))
    try:
        with pytest.raises(gl.GadgetFileError) as ei:
            big.save(p, **kw)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, prev)
    msg = str(ei.value)
    assert "cannot save" in msg and p.name in msg and "cannot write rows" in msg
    assert os.listdir(tmp_path) == [p.name]
    assert same_bits(read_direct(p, fmt), old)


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_not_enough_space_checked_before_writing(tmp_path, fmt, monkeypatch):
    p = tmp_path / f"old{EXT[fmt]}"
    old = make_array("float32", (10, 3))
    cpu(old).save(p)
    real = os.statvfs

    def tiny(path):
        s = real(path)
        return os.statvfs_result(
            (
                s.f_bsize,
                s.f_frsize,
                s.f_blocks,
                1,
                1,
                s.f_files,
                s.f_ffree,
                s.f_favail,
                s.f_flag,
                s.f_namemax,
            )
        )

    monkeypatch.setattr(os, "statvfs", tiny)
    with pytest.raises(gl.GadgetFileError, match="not enough space: need"):
        cpu(np.zeros((1000, 16), np.float32)).save(p)
    with pytest.raises(gl.GadgetFileError, match="not enough space"):
        cpu(np.zeros((1000, 16), np.float32)).save(tmp_path / f"new{EXT[fmt]}")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [p.name]
    assert same_bits(read_direct(p, fmt), old)


def test_save_keeps_permission_bits(tmp_path):
    for fmt in ("npy", "hdf5"):
        p = tmp_path / f"m{EXT[fmt]}"
        cpu(np.zeros((3, 2), np.float32)).save(p)
        os.chmod(p, 0o640)
        cpu(np.ones((4, 2), np.float32)).save(p)
        assert (os.stat(p).st_mode & 0o777) == 0o640
        assert np.all(read_direct(p, fmt) == 1.0)


def test_save_through_symlink_replaces_target_and_hard_links_keep_old(tmp_path):
    real = tmp_path / "real.npy"
    old = make_array("float32", (3, 2))
    np.save(real, old)
    link = tmp_path / "link.npy"
    link.symlink_to("real.npy")
    hard = tmp_path / "hard.npy"
    os.link(real, hard)
    new = make_array("float32", (5, 2), seed=7)
    cpu(new).save(link)
    assert link.is_symlink() and os.readlink(link) == "real.npy"
    assert same_bits(np.load(real), new)
    assert same_bits(np.load(hard), old)


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_save_refuses_directory_target(tmp_path, fmt):
    d = tmp_path / f"dir{EXT[fmt]}"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    with pytest.raises(gl.GadgetFileError):
        cpu(np.zeros((2, 2), np.float32)).save(d)
    assert (d / "keep.txt").read_text() == "x"


def test_zarr_save_refuses_non_zarr_target(tmp_path):
    d = tmp_path / "plain.zarr"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    f = tmp_path / "file.zarr"
    f.write_text("y")
    for target in (d, f):
        with pytest.raises(gl.GadgetFileError):
            cpu(np.zeros((2, 2), np.float32)).save(target)
    assert (d / "keep.txt").read_text() == "x" and f.read_text() == "y"


@pytest.mark.parametrize("bad", [None, b"x.npy", 3])
def test_save_path_must_be_str_or_pathlike(tmp_path, bad):
    g = cpu(np.zeros((2, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError):
        g.save(bad)


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import gadgetloader as gl
    fmt, target = sys.argv[1], sys.argv[2]
    cls = getattr(gl.io, {"npy": "NpySink", "hdf5": "Hdf5Sink", "zarr": "ZarrSink"}[fmt])
    orig = cls.write
    def die(self, start, rows):
        orig(self, start, rows)
        os._exit(7)
    cls.write = die
    g = gl.DataGadget(np.arange(3000, dtype=np.float32).reshape(1000, 3), placement="cpu")
    g.save(target)
    """
)


@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_killed_save_leaves_hidden_partial_and_old_file(tmp_path, fmt):
    p = tmp_path / f"old{EXT[fmt]}"
    old = make_array("float64", (4, 2))
    cpu(old).save(p)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, fmt, str(p)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    left = sorted(os.listdir(tmp_path))
    pat = re.compile(rf"^\.{re.escape(p.name)}\.partial-{proc.pid}-[0-9A-Za-z]{{8}}$")
    assert len(left) == 2 and p.name in left
    assert any(pat.match(n) for n in left), left
    assert same_bits(read_direct(p, fmt), old)


# --------------------------------------------------------------------------------------
# Read-only folders, immutable targets and full disks (need root's mount / chattr here;
# a plain user gets a chmod'ed folder).
# --------------------------------------------------------------------------------------


def _run(*cmd):
    return subprocess.run(list(cmd), capture_output=True, text=True).returncode == 0


@pytest.fixture
def small_mount(tmp_path):
    """A 256 KiB tmpfs (root only); yields (dir, make_read_only)."""
    d = tmp_path / "mnt"
    d.mkdir()
    if (
        os.geteuid() != 0
        or not shutil.which("mount")
        or not _run("mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d))
    ):
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield d, lambda: _run("mount", "-o", "remount,ro", str(d))
    finally:
        if not _run("umount", str(d)):
            _run("umount", "-l", str(d))


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder whose files can be read but not written; yields (dir, make_read_only)."""
    if os.geteuid() == 0:
        d = tmp_path / "ro"
        d.mkdir()
        if not shutil.which("mount") or not _run(
            "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)
        ):
            pytest.skip("root without mount: cannot make a read-only folder")
        try:
            yield d, lambda: _run("mount", "-o", "remount,ro", str(d))
        finally:
            if not _run("umount", str(d)):
                _run("umount", "-l", str(d))
    else:
        d = tmp_path / "ro"
        d.mkdir()

        def make_ro():
            for q in d.iterdir():
                if q.is_file():
                    os.chmod(q, 0o444)
            os.chmod(d, 0o555)
            return True

        try:
            yield d, make_ro
        finally:
            os.chmod(d, 0o755)


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_into_read_only_folder_is_read_only_error(read_only_dir, fmt):
    d, make_ro = read_only_dir
    a = make_array("float32", (10, 3))
    p = d / f"a{EXT[fmt]}"
    cpu(a).save(p)
    assert make_ro()
    for target in (p, d / f"new{EXT[fmt]}"):
        with pytest.raises(gl.ReadOnlyError) as ei:
            cpu(np.zeros((3, 3), np.float32)).save(target)
        assert isinstance(ei.value, PermissionError)
    assert same_bits(read_direct(p, fmt), a)
    assert not (d / f"new{EXT[fmt]}").exists()


@pytest.mark.parametrize("fmt", ["npy", "hdf5"] if os.geteuid() != 0 else FORMATS)
def test_read_only_file_table_defaults_to_read_only(read_only_dir, fmt):
    d, make_ro = read_only_dir
    a = make_array("float32", (10, 3))
    p = d / f"a{EXT[fmt]}"
    cpu(a).save(p)
    assert make_ro()
    f = gl.DataGadget(p, placement="file")
    assert same_bits(f.getData([9, 0]).numpy(), a[[9, 0]])
    with pytest.raises(gl.ReadOnlyError):
        f.insertData(torch.zeros(1, 3), [0])
    with pytest.raises(gl.ReadOnlyError):
        gl.DataGadget(p, placement="file", writable=True)
    f.close()
    assert same_bits(read_direct(p, fmt), a)


@pytest.mark.parametrize(
    "fmt, kw, exc",
    [
        ("npy", {}, gl.GadgetFileError),
        ("hdf5", {}, gl.GadgetFileError),
        ("hdf5", {"compression": "gzip", "chunk_rows": 16}, gl.GadgetFileError),
        ("zarr", {"chunk_rows": 16}, OSError),
    ],
)
def test_full_disk_save_keeps_old_and_removes_partial(small_mount, fmt, kw, exc):
    d, _ = small_mount
    p = d / f"old{EXT[fmt]}"
    old = make_array("float32", (10, 3))
    cpu(old).save(p)
    big = cpu(_rng(1).standard_normal((512, 256)).astype(np.float32))  # 512 KiB, random
    with pytest.raises(exc):
        big.save(p, **kw)
    assert os.listdir(d) == [p.name]
    assert same_bits(read_direct(p, fmt), old)


@pytest.mark.parametrize("fmt", FORMATS)
def test_immutable_target_rename_refused_is_read_only_error(tmp_path, fmt):
    p = tmp_path / f"imm{EXT[fmt]}"
    old = make_array("float32", (5, 2))
    cpu(old).save(p)
    if not shutil.which("chattr") or not _run("chattr", "+i", str(p)):
        pytest.skip("chattr +i not available here")
    try:
        with pytest.raises(gl.ReadOnlyError, match="kept"):
            cpu(np.ones((6, 2), np.float32)).save(p)
    finally:
        _run("chattr", "-i", str(p))
    assert os.listdir(tmp_path) == [p.name]
    assert same_bits(read_direct(p, fmt), old)


# --------------------------------------------------------------------------------------
# Conversion: API (open + save) and the CLI.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("dst", FORMATS)
def test_api_conversion_between_formats(tmp_path, src, dst):
    placement = "file" if src != dst else "cpu"
    a = make_array("int16", (17, 2, 2))
    sp = tmp_path / f"src{EXT[src]}"
    dp = tmp_path / f"dst{EXT[dst]}"
    cpu(a).save(sp, **save_opts(src, chunk_rows=4))
    g = gl.DataGadget(sp, placement=placement)
    g.save(dp, **save_opts(dst, chunk_rows=5))
    assert same_bits(read_direct(dp, dst), a)


def test_api_conversion_bfloat16_hdf5_to_zarr(tmp_path):
    t = torch.randn(9, 3).to(torch.bfloat16)
    gl.DataGadget(t, placement="cpu").save(tmp_path / "b.h5", chunk_rows=2)
    gl.DataGadget(tmp_path / "b.h5", placement="file").save(tmp_path / "b.zarr")
    g = gl.DataGadget(tmp_path / "b.zarr", placement="cpu")
    assert g.dtype == torch.bfloat16
    assert torch.equal(g.getData(torch.arange(9)).view(torch.int16), t.view(torch.int16))


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "gadgetloader", "convert", *map(str, args)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_convert_npy_to_hdf5_chunks_and_gzip(tmp_path):
    a = make_array("float32", (10, 4))
    np.save(tmp_path / "emb.npy", a)
    r = _cli(
        "emb.npy",
        "emb.h5",
        "--chunk-rows",
        "4",
        "--compression",
        "gzip",
        "--no-progress",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "emb.h5", "r") as f:
        (name,) = list(f)
        d = f[name]
        assert d.chunks == (4, 4) and d.compression == "gzip"
        assert same_bits(d[()], a)


def test_cli_convert_hdf5_dataset_to_zarr_and_dst_dataset(tmp_path):
    a = make_array("int64", (10, 3))
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["emb/words"] = a
        f["other"] = np.zeros((2, 2))
    r = _cli("data.h5", "emb.zarr", "--dataset", "emb/words", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert same_bits(gl.DataGadget(tmp_path / "emb.zarr", placement="cpu").getNumpyVersion(), a)
    r = _cli("data.h5", "out.zarr", "--dataset", "emb/words", "--dst-dataset", "a/b", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert same_bits(read_direct(tmp_path / "out.zarr", "zarr", "a/b"), a)
    # two datasets, no --dataset: refused, nothing written
    r = _cli("data.h5", "x.npy", cwd=tmp_path)
    assert r.returncode != 0 and "emb/words" in r.stderr
    assert not (tmp_path / "x.npy").exists()


def test_cli_convert_refuses_its_source_also_through_links(tmp_path):
    a = make_array("float32", (6, 2))
    np.save(tmp_path / "emb.npy", a)
    (tmp_path / "sym.npy").symlink_to("emb.npy")
    os.link(tmp_path / "emb.npy", tmp_path / "hard.npy")
    before = (tmp_path / "emb.npy").read_bytes()
    for src, dst in (("emb.npy", "emb.npy"), ("emb.npy", "sym.npy"), ("hard.npy", "emb.npy")):
        r = _cli(src, dst, cwd=tmp_path)
        assert r.returncode != 0 and "same file" in r.stderr
    assert (tmp_path / "emb.npy").read_bytes() == before


def test_cli_convert_bad_compression_and_missing_source(tmp_path):
    np.save(tmp_path / "emb.npy", np.zeros((3, 2), np.float32))
    r = _cli("emb.npy", "x.h5", "--compression", "zstd", cwd=tmp_path)
    assert r.returncode != 0 and "zstd" in r.stderr
    r2 = _cli("missing.npy", "y.h5", cwd=tmp_path)
    assert r2.returncode != 0 and "missing.npy" in r2.stderr
    assert sorted(os.listdir(tmp_path)) == ["emb.npy"]


def test_cli_convert_forced_formats(tmp_path):
    a = make_array("uint8", (5, 3))
    np.save(tmp_path / "emb.npy", a)
    os.rename(tmp_path / "emb.npy", tmp_path / "emb.bin")
    r = _cli("emb.bin", "out.dat", "--format", "npy", "--to", "hdf5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert h5py.is_hdf5(tmp_path / "out.dat")
    g = gl.DataGadget(tmp_path / "out.dat", placement="cpu")
    assert same_bits(g.getNumpyVersion(), a)


def test_api_conversion_of_damaged_source_keeps_destination(tmp_path):
    src = tmp_path / "src.zarr"
    cpu(np.arange(3000, dtype=np.float32).reshape(1000, 3)).save(src, chunk_rows=100)
    chunk = src / "c" / "5" / "0"
    chunk.write_bytes(b"\x00garbage" + chunk.read_bytes()[8:])
    dst = tmp_path / "dst.h5"
    old = make_array("float32", (4, 3))
    cpu(old).save(dst)
    before = dst.read_bytes()
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(src, placement="file").save(dst)
    assert dst.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["dst.h5", "src.zarr"]


def test_cli_convert_failures_keep_destination(tmp_path):
    src = tmp_path / "src.zarr"
    cpu(np.arange(3000, dtype=np.float32).reshape(1000, 3)).save(src, chunk_rows=100)
    chunk = src / "c" / "5" / "0"
    chunk.write_bytes(b"\x00garbage" + chunk.read_bytes()[8:])
    cpu(make_array("float32", (4, 3))).save(tmp_path / "dst.h5")
    gl.DataGadget(torch.ones(4, 2, dtype=torch.bfloat16), placement="cpu").save(tmp_path / "b.h5")
    before = (tmp_path / "dst.h5").read_bytes()
    r = _cli("src.zarr", "dst.h5", cwd=tmp_path)
    assert r.returncode != 0 and "src.zarr" in r.stderr
    r2 = _cli("b.h5", "b.npy", cwd=tmp_path)  # bfloat16 has no .npy form
    assert r2.returncode != 0 and "bfloat16" in r2.stderr
    assert (tmp_path / "dst.h5").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["b.h5", "dst.h5", "src.zarr"]


def test_threads_and_hard_link_names_share_one_lock(tmp_path):
    import threading

    n = 48
    for fmt in ("hdf5", "zarr"):
        p = tmp_path / f"t{EXT[fmt]}"
        cpu(np.zeros((n, 4), np.float32)).save(p, chunk_rows=8, compression="gzip")
        names = [p, p]
        if fmt == "hdf5":
            os.link(p, tmp_path / "hl.h5")
            names = [p, tmp_path / "hl.h5"]
        tabs = [gl.DataGadget(names[k % 2], placement="file") for k in range(4)]
        errs = []

        def work(k, tabs=tabs, errs=errs):
            try:
                for rep in range(6):
                    for i in range(k, n, 4):  # rows of one chunk come from all threads
                        tabs[k].insertData(torch.full((1, 4), float(rep * 1000 + i)), [i])
                    tabs[k].insertData(torch.full((1, 2), -float(k + 1)), ([k], slice(2, 4)))
            except Exception as e:  # pragma: no cover - reported below
                errs.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in tabs:
            t.close()
        assert errs == []
        exp = np.array([[5000.0 + i] * 4 for i in range(n)], np.float32)
        for k in range(4):
            exp[k, 2:] = -(k + 1)
        assert same_bits(read_direct(p, fmt), exp), fmt


def test_zarr_save_keeps_dir_mode_and_symlink(tmp_path):
    a = make_array("float32", (5, 2))
    p = tmp_path / "p.zarr"
    cpu(a).save(p)
    os.chmod(p, 0o750)
    cpu(a * 2).save(p)
    assert (os.stat(p).st_mode & 0o777) == 0o750
    (tmp_path / "real").mkdir()
    cpu(a).save(tmp_path / "real" / "s.zarr")
    (tmp_path / "s.zarr").symlink_to("real/s.zarr")
    cpu(a * 3).save(tmp_path / "s.zarr")
    assert (tmp_path / "s.zarr").is_symlink()
    assert same_bits(read_direct(tmp_path / "real" / "s.zarr", "zarr"), a * 3)
    assert os.listdir(tmp_path / "real") == ["s.zarr"]


def test_zarr_second_rename_failure_moves_old_store_back(tmp_path, monkeypatch):
    a = make_array("float32", (5, 2))
    p = tmp_path / "m.zarr"
    cpu(a).save(p)
    orig = os.replace

    def failing(src, dst, *x, **k):
        if os.path.basename(os.fspath(dst)) == "m.zarr" and "partial" in os.fspath(src):
            raise OSError(5, "Input/output error")
        return orig(src, dst, *x, **k)

    monkeypatch.setattr(os, "replace", failing)
    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(gl.GadgetFileError):
        cpu(a * 2).save(p)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["m.zarr"]
    assert same_bits(read_direct(p, "zarr"), a)


def test_external_link_target_replaced_is_detected(tmp_path):
    a = make_array("float32", (8, 3))
    with h5py.File(tmp_path / "tgt.h5", "w") as f:
        f["grp/emb"] = a
    with h5py.File(tmp_path / "lnk.h5", "w") as f:
        f["e"] = h5py.ExternalLink("tgt.h5", "grp/emb")
    t = gl.DataGadget(tmp_path / "lnk.h5", placement="file")
    t.getData([0])
    with h5py.File(tmp_path / "new.h5", "w") as f:
        f["grp/emb"] = a * 5
    os.replace(tmp_path / "new.h5", tmp_path / "tgt.h5")
    with pytest.raises(gl.GadgetFileError):
        t.getData([1])


def test_external_raw_storage_read_only_and_short_file_is_error(tmp_path):
    a = make_array("float32", (8, 3))
    a.tofile(tmp_path / "raw.bin")
    p = tmp_path / "ext.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset(
            "d", shape=(8, 3), dtype="f4", external=[(str(tmp_path / "raw.bin"), 0, 96)]
        )
    t = gl.DataGadget(p, placement="file")
    assert same_bits(t.getData([7, 0]).numpy(), a[[7, 0]])
    with pytest.raises(gl.ReadOnlyError):
        t.insertData(torch.zeros(1, 3), [0])
    t.close()
    os.truncate(tmp_path / "raw.bin", 50)
    for placement in ("file", "cpu"):
        with pytest.raises(gl.GadgetFileError):
            gl.DataGadget(p, placement=placement)
    os.remove(tmp_path / "raw.bin")
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(p, placement="file")


def test_hdf5_truncated_under_file_table(tmp_path):
    p = tmp_path / "tr.h5"
    cpu(np.arange(3000, dtype=np.float32).reshape(1000, 3)).save(p, chunk_rows=100)
    t = gl.DataGadget(p, placement="file", cache_bytes=0)
    t.getData([999])
    os.truncate(p, os.path.getsize(p) // 2)
    with pytest.raises(gl.GadgetFileError):
        t.getData([999])
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(p, placement="cpu")


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_into_missing_folder_is_file_not_found(tmp_path, fmt):
    with pytest.raises(gl.GadgetFileNotFoundError):
        cpu(np.zeros((2, 2), np.float32)).save(tmp_path / "nodir" / f"x{EXT[fmt]}")
    assert os.listdir(tmp_path) == []


def test_relative_path_file_table_survives_chdir(tmp_path, monkeypatch):
    a = make_array("float32", (6, 2))
    (tmp_path / "sub").mkdir()
    np.save(tmp_path / "sub" / "r.npy", a)
    monkeypatch.chdir(tmp_path / "sub")
    t = gl.DataGadget("r.npy", placement="file")
    monkeypatch.chdir(tmp_path)
    assert same_bits(t.getData([5]).numpy(), a[[5]])
    t.insertData(torch.ones(1, 2), [0])
    t.close()
    assert np.load(tmp_path / "sub" / "r.npy")[0].tolist() == [1.0, 1.0]
    assert not (tmp_path / "r.npy").exists()
