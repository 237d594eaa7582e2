"""Black-box review (session 32) of unusual but valid files (.npy byte orders, memory orders
and format versions, 1-D / 3-D / zero-row tables, nested and differently stored HDF5
datasets, zarr v2 / v3 stores with various chunkings and codecs, odd paths, read-only files,
atomic saves and the ``convert`` command); written from README.md, SPEC.md and the public
docstrings only."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr", minversion="3")


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
PLACEMENTS = ["cpu", "file"]
RNG = np.random.default_rng(32)
A = RNG.standard_normal((37, 5)).astype("<f4")


def _rows(g, ids):
    return g.getData(ids).cpu().numpy()


def _whole(g):
    return np.asarray(g.getNumpyVersion())


def _eq(x, y):
    x, y = np.asarray(x), np.asarray(y)
    nan = x.dtype.kind == "f" and y.dtype.kind == "f"
    return x.shape == y.shape and np.array_equal(x, y, equal_nan=nan)


def _check_values(path, ref, placement, **kw):
    """Open ``path`` and compare whole table, a gather with repeats, a slice and a row part."""
    g = gl.DataGadget(path, placement=placement, **kw)
    try:
        n = ref.shape[0]
        assert tuple(g.shape) == ref.shape
        assert g.dtype == torch.from_numpy(ref.astype(ref.dtype.newbyteorder("="))).dtype
        assert _eq(_whole(g), ref)
        ids = np.array([n - 1, 0, n // 2, n // 2, 1])
        assert _eq(_rows(g, ids), ref[ids])
        assert _eq(_rows(g, torch.tensor([[n - 1, 0], [2, 2]])), ref[[[n - 1, 0], [2, 2]]])
        assert _eq(g[n - 3 :].cpu().numpy(), ref[n - 3 :])
        if ref.ndim >= 2 and ref.shape[1] >= 2:
            assert _eq(g[[1, n - 1], 1:].cpu().numpy(), ref[[1, n - 1], 1:])
    finally:
        g.close()


@contextlib.contextmanager
def _quiet():
    """Third-party writers (h5py, zarr) may warn while the test files are made."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _write_npy(path, arr, version=None):
    with open(path, "wb") as fh:
        np.lib.format.write_array(fh, arr, version=version)


def _craft_npy(path, data: bytes, header: str, *, version=(1, 0), align=16, trailing=b""):
    """A .npy written by hand, as other writers (cnpy, old NumPy) do: other key order,
    spacing and header alignment than NumPy's own writer."""
    magic = b"\x93NUMPY" + bytes(version)
    lenfmt = "<H" if version[0] == 1 else "<I"
    base = len(magic) + struct.calcsize(lenfmt)
    h = header.encode("latin1")
    h = h + b" " * ((-(base + len(h) + 1)) % align) + b"\n"
    with open(path, "wb") as fh:
        fh.write(magic + struct.pack(lenfmt, len(h)) + h + data + trailing)


def _tree_bytes(path):
    """Every byte of a file or a directory tree, to prove it unchanged."""
    p = pathlib.Path(path)
    if p.is_file():
        return {"": p.read_bytes()}
    return {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file()}


def _hidden(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith("."))


# --------------------------------------------------------------------------------------
# .npy: byte order, memory order, format versions, header spellings
# --------------------------------------------------------------------------------------

BE_DTYPES = [">f4", ">f8", ">i8", ">i2", ">f2", ">i4"]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dt", BE_DTYPES)
def test_big_endian_npy_reads_like_numpy(tmp_path, dt, placement):
    ref = (A * 1000).astype(dt) if dt[1] == "i" else A.astype(dt)
    p = tmp_path / "be.npy"
    np.save(p, ref)
    _check_values(p, np.load(p), placement)


@pytest.mark.parametrize("dt", [">f4", ">i8"])
def test_big_endian_npy_file_table_writes_through_in_file_byte_order(tmp_path, dt):
    ref = (A * 100).astype(dt)
    p = tmp_path / "be.npy"
    np.save(p, ref)
    g = gl.DataGadget(p, placement="file")
    native = ref.dtype.newbyteorder("=")
    new = torch.from_numpy(np.full((2, 5), 7, dtype=native))
    g.insertData(new, [36, 3])
    g.close()
    back = np.load(p)
    assert back.dtype == np.dtype(dt)  # still the file's own byte order
    exp = ref.copy()
    exp[[36, 3]] = 7
    assert _eq(back, exp)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("shape", [(37, 5), (9, 3, 4)])
def test_fortran_order_npy_reads_like_numpy(tmp_path, shape, placement):
    ref = np.asfortranarray(RNG.standard_normal(shape).astype("<f8"))
    p = tmp_path / "f.npy"
    np.save(p, ref)
    assert np.load(p).flags.f_contiguous and not np.load(p).flags.c_contiguous
    _check_values(p, ref, placement)


def test_fortran_order_npy_many_rows_random_gather(tmp_path):
    ref = np.asfortranarray(RNG.standard_normal((3001, 3)).astype("f4"))
    p = tmp_path / "fbig.npy"
    np.save(p, ref)
    g = gl.DataGadget(p, placement="file", cache_bytes=4096)
    ids = RNG.integers(0, 3001, (50, 4))
    assert _eq(_rows(g, ids), ref[ids])


def test_fortran_order_npy_file_table_write_is_read_only_error(tmp_path):
    ref = np.asfortranarray(A)
    p = tmp_path / "f.npy"
    np.save(p, ref)
    before = p.read_bytes()
    g = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.ReadOnlyError, match="(?i)fortran"):
        g.insertData(torch.zeros(1, 5), [0])
    with pytest.raises(gl.ReadOnlyError):
        g[2] = torch.zeros(5)
    g.close()
    assert p.read_bytes() == before


def test_fortran_order_npy_writable_true_is_refused(tmp_path):
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(A))
    before = p.read_bytes()
    with pytest.raises(gl.ReadOnlyError):
        gl.DataGadget(p, placement="file", writable=True)
    assert p.read_bytes() == before


def test_fortran_order_npy_saved_over_itself_becomes_c_order_and_writable(tmp_path):
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(A))
    g = gl.DataGadget(p, placement="file")
    g.save(p)  # the README's advice: "save it again in C order"
    back = np.load(p)
    assert back.flags.c_contiguous and _eq(back, A)
    g2 = gl.DataGadget(p, placement="file")
    g2.insertData(torch.full((1, 5), 3.0), [4])
    g2.close()
    exp = A.copy()
    exp[4] = 3.0
    assert _eq(np.load(p), exp)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_format_versions(tmp_path, version, placement):
    p = tmp_path / f"v{version[0]}.npy"
    _write_npy(p, A, version=version)
    assert p.read_bytes()[6] == version[0]
    _check_values(p, A, placement)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_format_versions_file_writes(tmp_path, version):
    p = tmp_path / f"v{version[0]}.npy"
    _write_npy(p, A, version=version)
    g = gl.DataGadget(p, placement="file")
    g.insertData(torch.full((2, 5), -1.0), [0, 36])
    g.close()
    exp = A.copy()
    exp[[0, 36]] = -1.0
    assert _eq(np.load(p), exp)


HEADER = "{{'descr': '{d}', 'fortran_order': False, 'shape': (37, 5), }}"
CRAFTED = {
    "cnpy_16byte_aligned": dict(header=HEADER.format(d="<f4"), align=16),
    "unaligned_header": dict(header=HEADER.format(d="<f4"), align=1),
    "keys_in_other_order": dict(
        header="{'shape': (37, 5), 'fortran_order': False, 'descr': '<f4'}", align=64
    ),
    "odd_spacing_v2": dict(
        header="{ 'descr' : '<f4' ,'fortran_order':False,'shape':( 37 ,5 ) }", version=(2, 0)
    ),
    "descr_native_eq": dict(header=HEADER.format(d="=f4")),
    "descr_no_byteorder": dict(header=HEADER.format(d="f4")),
    "descr_dtype_name": dict(header=HEADER.format(d="float32")),
    "trailing_bytes": dict(header=HEADER.format(d="<f4"), trailing=b"TRAILING-BYTES"),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_hand_written_npy_headers(tmp_path, name, placement):
    spec = dict(CRAFTED[name])
    p = tmp_path / f"{name}.npy"
    _craft_npy(p, A.tobytes(), spec.pop("header"), **spec)
    assert _eq(np.load(p), A)  # valid for NumPy
    _check_values(p, A, placement)


@pytest.mark.parametrize("name", ["cnpy_16byte_aligned", "unaligned_header", "trailing_bytes"])
def test_hand_written_npy_headers_file_writes(tmp_path, name):
    spec = dict(CRAFTED[name])
    p = tmp_path / f"{name}.npy"
    _craft_npy(p, A.tobytes(), spec.pop("header"), **spec)
    g = gl.DataGadget(p, placement="file")
    g.insertData(torch.from_numpy(A[[5]].copy()), [6])
    g.close()
    exp = A.copy()
    exp[6] = A[5]
    assert _eq(np.load(p), exp)
    if spec.get("trailing"):
        assert p.read_bytes().endswith(spec["trailing"])


# --------------------------------------------------------------------------------------
# dimensions: 1-D, 3-D, 0-D, zero rows, zero-width rows
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_one_dimensional_npy_is_a_table_of_scalars(tmp_path, placement):
    ref = np.arange(40, dtype=np.int64) * 3
    p = tmp_path / "labels.npy"
    np.save(p, ref)
    g = gl.DataGadget(p, placement=placement)
    assert tuple(g.shape) == (40,) and len(g) == 40 and g.row_shape == ()
    ids = torch.tensor([[39, 0], [7, 7]])
    out = g.getData(ids).cpu()
    assert out.shape == (2, 2) and _eq(out.numpy(), ref[ids.numpy()])
    assert _eq(g[5:9].cpu().numpy(), ref[5:9])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_three_dimensional_npy_rows_are_blocks(tmp_path, placement):
    ref = RNG.standard_normal((11, 3, 4)).astype("f4")
    p = tmp_path / "cube.npy"
    np.save(p, ref)
    g = gl.DataGadget(p, placement=placement)
    assert g.row_shape == (3, 4)
    ids = np.array([[10, 1, 1]])
    assert g.getData(ids).shape == (1, 3, 3, 4)
    assert _eq(_rows(g, ids), ref[ids])
    assert _eq(g[[1, 2], 1].cpu().numpy(), ref[[1, 2], 1])
    assert _eq(g.getData((slice(0, 6), slice(0, 2))).cpu().numpy(), ref[0:6, 0:2])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_three_dimensional_file_write_then_numpy(tmp_path, placement):
    ref = RNG.standard_normal((11, 3, 4)).astype("f4")
    p = tmp_path / "cube.npy"
    np.save(p, ref)
    g = gl.DataGadget(p, placement=placement)
    new = torch.full((2, 3, 4), 9.0)
    g.insertData(new, [10, 0])
    exp = ref.copy()
    exp[[10, 0]] = 9.0
    assert _eq(_whole(g), exp)
    g.close()
    assert _eq(np.load(p), exp if placement == "file" else ref)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_zero_dimensional_npy_is_refused_naming_the_file(tmp_path, placement):
    p = tmp_path / "scalar_value.npy"
    np.save(p, np.array(3.0))
    with pytest.raises(gl.GadgetError, match="scalar_value.npy"):
        gl.DataGadget(p, placement=placement)


ZERO_ROW = {
    "2d": np.zeros((0, 4), np.float32),
    "1d": np.zeros((0,), np.int64),
    "3d": np.zeros((0, 2, 2)),
    "fortran": np.asfortranarray(np.zeros((0, 3), np.float32)),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", sorted(ZERO_ROW))
def test_zero_row_npy_is_a_clear_error_naming_the_file(tmp_path, kind, placement):
    p = tmp_path / f"empty_{kind}.npy"
    np.save(p, ZERO_ROW[kind])
    with pytest.raises(gl.GadgetError, match=f"empty_{kind}.npy") as ei:
        gl.DataGadget(p, placement=placement)
    assert "zero rows" in str(ei.value)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_zero_row_hdf5_and_zarr_are_clear_errors(tmp_path, fmt, placement):
    p = tmp_path / f"empty.{fmt}"
    with _quiet():
        if fmt == "h5":
            with h5py.File(p, "w") as f:
                f.create_dataset("a/b", shape=(0, 4), maxshape=(None, 4), chunks=(8, 4), dtype="i2")
        else:
            zarr.create_array(store=str(p), shape=(0, 3), dtype="f8", chunks=(5, 3), zarr_format=2)
    with pytest.raises(gl.GadgetError, match=f"empty.{fmt}") as ei:
        gl.DataGadget(p, placement=placement)
    assert "zero rows" in str(ei.value)


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_zero_row_in_memory_table_exists_but_is_not_saved(tmp_path, fmt):
    target = tmp_path / f"old.{fmt}"
    gl.DataGadget(A, placement="cpu").save(target)
    before = _tree_bytes(target)
    g = gl.DataGadget(np.zeros((0, 5), np.float32), placement="cpu")
    assert tuple(g.shape) == (0, 5) and len(g) == 0
    with pytest.raises(gl.GadgetError, match="zero rows"):
        g.save(target)
    assert _tree_bytes(target) == before
    assert _hidden(tmp_path) == []


# --------------------------------------------------------------------------------------
# HDF5: nested groups, storage layouts, filters, links
# --------------------------------------------------------------------------------------


def _h5_layouts(path):
    """name -> reference array, each dataset stored differently."""
    b = (A * 100).astype("i4")
    refs = {}
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "a/b/c",
            data=A,
            chunks=(5, 3),
            compression="gzip",
            compression_opts=4,
            shuffle=True,
            fletcher32=True,
        )
        refs["a/b/c"] = A
        f.create_dataset("contiguous", data=A)
        refs["contiguous"] = A
        f.create_dataset("g/lzf", data=A, chunks=(4, 5), compression="lzf")
        refs["g/lzf"] = A
        f.create_dataset(
            "g/one_row_chunks", data=A, chunks=(1, 5), compression="gzip", compression_opts=9
        )
        refs["g/one_row_chunks"] = A
        f.create_dataset("g/chunk_bigger_than_data", data=A, chunks=(100, 5), maxshape=(None, 5))
        refs["g/chunk_bigger_than_data"] = A
        f.create_dataset("g/scaleoffset", data=b, chunks=(8, 5), scaleoffset=0)
        refs["g/scaleoffset"] = b
        f.create_dataset(
            "g/big_endian_gzip",
            data=A.astype(">f8"),
            chunks=(6, 2),
            compression="gzip",
            shuffle=True,
        )
        refs["g/big_endian_gzip"] = A.astype(">f8")
        f.create_dataset("g/big_endian_contiguous", data=b.astype(">i4"))
        refs["g/big_endian_contiguous"] = b.astype(">i4")
        d = f.create_dataset("g/grown", data=A, chunks=(4, 5), maxshape=(None, 5))
        d.resize((40, 5))
        refs["g/grown"] = d[()]
        d = f.create_dataset(
            "g/fill_unallocated", shape=(20, 4), dtype="f4", chunks=(4, 4), fillvalue=-3.5
        )
        d[4:8] = 1.0
        refs["g/fill_unallocated"] = d[()]
        f.create_dataset("g/bool", data=A > 0, chunks=(4, 5))
        refs["g/bool"] = A > 0
        f.create_dataset(
            "g/cube", data=np.stack([A, -A], axis=2), chunks=(5, 2, 1), compression="gzip"
        )
        refs["g/cube"] = np.stack([A, -A], axis=2)
        f.create_dataset("g/vector", data=np.arange(37, dtype=np.int16), chunks=(4,))
        refs["g/vector"] = np.arange(37, dtype=np.int16)
        # compact layout (data inside the object header) through the low-level API
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple((4, 5))
        h5py.h5d.create(f["g"].id, b"compact", h5py.h5t.IEEE_F32LE, space, dcpl=dcpl)
        f["g/compact"][...] = A[:4]
        refs["g/compact"] = A[:4].copy()
    return refs


@pytest.fixture(scope="module")
def h5_layouts(tmp_path_factory):
    p = tmp_path_factory.mktemp("h5") / "layouts.h5"
    with _quiet():
        refs = _h5_layouts(p)
    return p, refs


H5_NAMES = [
    "a/b/c",
    "contiguous",
    "g/lzf",
    "g/one_row_chunks",
    "g/chunk_bigger_than_data",
    "g/scaleoffset",
    "g/big_endian_gzip",
    "g/big_endian_contiguous",
    "g/grown",
    "g/fill_unallocated",
    "g/bool",
    "g/cube",
    "g/vector",
    "g/compact",
]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", H5_NAMES)
def test_hdf5_layouts_read_like_h5py(h5_layouts, name, placement):
    path, refs = h5_layouts
    _check_values(path, refs[name], placement, dataset=name)


@pytest.mark.parametrize("name", ["/a/b/c", "a/b/c"])
def test_hdf5_nested_dataset_with_and_without_leading_slash(h5_layouts, name):
    path, refs = h5_layouts
    _check_values(path, refs["a/b/c"], "file", dataset=name)


@pytest.mark.parametrize(
    "name",
    [
        "a/b/c",
        "contiguous",
        "g/one_row_chunks",
        "g/big_endian_gzip",
        "g/big_endian_contiguous",
        "g/grown",
        "g/fill_unallocated",
        "g/compact",
        "g/scaleoffset",
        "g/cube",
    ],
)
def test_hdf5_file_table_writes_through(tmp_path, h5_layouts, name):
    src, refs = h5_layouts
    p = tmp_path / "copy.h5"
    shutil.copy(src, p)
    ref = refs[name]
    g = gl.DataGadget(p, dataset=name, placement="file")
    native = ref.dtype.newbyteorder("=")
    new = np.ascontiguousarray(ref[[1, 2]][::-1]).astype(native)
    g.insertData(torch.from_numpy(new), [1, 3])
    g.close()
    exp = ref.copy()
    exp[[1, 3]] = new
    with h5py.File(p, "r") as f:
        back = f[name][()]
        assert f[name].dtype == ref.dtype
        other = f["contiguous"][()] if name != "contiguous" else f["a/b/c"][()]
    assert _eq(back, exp)
    assert _eq(other, A)


@pytest.mark.parametrize("link", ["soft", "g/hard"])
def test_hdf5_soft_and_hard_link_names(tmp_path, link):
    p = tmp_path / "links.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x/y/z", data=A, chunks=(6, 5), compression="gzip")
        f["soft"] = h5py.SoftLink("/x/y/z")
        f["g/hard"] = f["x/y/z"]
    for placement in PLACEMENTS:
        _check_values(p, A, placement, dataset=link)


def test_hdf5_one_dataset_with_link_aliases_needs_no_name(tmp_path):
    p = tmp_path / "aliases.h5"
    with h5py.File(p, "w") as f:
        f["x/d"] = A
        f["s"] = h5py.SoftLink("/x/d")
        f["h"] = f["x/d"]
    _check_values(p, A, "file")


def test_hdf5_external_link_reads_and_is_read_only(tmp_path):
    (tmp_path / "sub dir").mkdir()
    real = tmp_path / "sub dir" / "réal.h5"
    with h5py.File(real, "w") as f:
        f.create_dataset("x/d", data=A, chunks=(4, 5))
    p = tmp_path / "ext.h5"
    with h5py.File(p, "w") as f:
        f["e"] = h5py.ExternalLink(str(real), "/x/d")
    before = real.read_bytes()
    _check_values(p, A, "cpu")
    g = gl.DataGadget(p, placement="file")
    assert _eq(_rows(g, [36, 1]), A[[36, 1]])
    with pytest.raises(gl.ReadOnlyError, match="réal.h5"):
        g.insertData(torch.zeros(1, 5), [0])
    g.close()
    assert real.read_bytes() == before


def test_hdf5_file_with_userblock(tmp_path):
    p = tmp_path / "ub.h5"
    with h5py.File(p, "w", userblock_size=1024) as f:
        f.create_dataset("d", data=A, chunks=(8, 5))
    with open(p, "r+b") as fh:
        fh.write(b"not hdf5 text in the user block")
    for placement in PLACEMENTS:
        _check_values(p, A, placement)


def test_hdf5_extension_less_file_found_by_content(tmp_path):
    p = tmp_path / "table.dat"
    with h5py.File(p, "w") as f:
        f["q/r"] = A
    _check_values(p, A, "file")
    _check_values(p, A, "cpu", format="hdf5", dataset="/q/r")


def test_hdf5_several_datasets_need_a_name_and_wrong_name_lists_them(h5_layouts):
    path, _ = h5_layouts
    with pytest.raises(gl.GadgetKeyError, match="a/b/c"):
        gl.DataGadget(path, placement="cpu")
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(path, dataset="a/b/nope", placement="file")
    assert "a/b/nope" in str(ei.value) and "g/lzf" in str(ei.value)
    assert isinstance(ei.value, KeyError)


@pytest.mark.parametrize("kind", ["scalar", "null", "compound", "strings"])
def test_hdf5_non_table_datasets_are_refused_naming_the_file(tmp_path, kind):
    p = tmp_path / f"odd_{kind}.h5"
    with h5py.File(p, "w") as f:
        if kind == "scalar":
            f["d"] = 3.0
        elif kind == "null":
            f.create_dataset("d", data=h5py.Empty("f4"))
        elif kind == "compound":
            f["d"] = np.zeros(4, dtype=[("x", "f4"), ("y", "i4")])
        else:
            f["d"] = np.array([b"ab", b"cd"])
    with pytest.raises(gl.GadgetError, match=f"odd_{kind}.h5"):
        gl.DataGadget(p, placement="file")


# --------------------------------------------------------------------------------------
# zarr v2 / v3: chunk shapes and codecs
# --------------------------------------------------------------------------------------


def _zarr_variants(root):
    import numcodecs
    from zarr.codecs import (
        BloscCodec,
        BytesCodec,
        Crc32cCodec,
        GzipCodec,
        TransposeCodec,
        ZstdCodec,
    )

    b = (A * 100).astype("i8")
    specs = {
        "v3_zstd_split_cols": (
            A,
            dict(zarr_format=3, chunks=(5, 2), compressors=ZstdCodec(level=3)),
        ),
        "v3_blosc_bitshuffle": (
            A,
            dict(
                zarr_format=3,
                chunks=(7, 5),
                compressors=BloscCodec(cname="lz4", shuffle="bitshuffle"),
            ),
        ),
        "v3_gzip_crc32c": (
            A,
            dict(zarr_format=3, chunks=(6, 5), compressors=[GzipCodec(level=1), Crc32cCodec()]),
        ),
        "v3_raw_one_chunk": (A, dict(zarr_format=3, chunks=(37, 5), compressors=None)),
        "v3_chunk_bigger_than_data": (A, dict(zarr_format=3, chunks=(100, 10))),
        "v3_sharded": (A, dict(zarr_format=3, chunks=(2, 5), shards=(8, 5))),
        "v3_transposed": (
            A,
            dict(zarr_format=3, chunks=(6, 5), filters=[TransposeCodec(order=(1, 0))]),
        ),
        "v3_big_endian": (
            A,
            dict(zarr_format=3, chunks=(5, 5), serializer=BytesCodec(endian="big")),
        ),
        "v3_dot_keys": (
            A,
            dict(
                zarr_format=3,
                chunks=(6, 5),
                chunk_key_encoding={"name": "default", "separator": "."},
            ),
        ),
        "v3_1d": (np.arange(37, dtype=np.int16), dict(zarr_format=3, chunks=(8,))),
        "v3_3d": (np.stack([A, -A], axis=2).astype("f8"), dict(zarr_format=3, chunks=(4, 3, 1))),
        "v3_bool": (A > 0, dict(zarr_format=3, chunks=(7, 2))),
        "v2_zlib": (A, dict(zarr_format=2, chunks=(5, 4), compressors=numcodecs.Zlib(level=5))),
        "v2_blosc_zstd": (
            A,
            dict(zarr_format=2, chunks=(3, 5), compressors=numcodecs.Blosc(cname="zstd")),
        ),
        "v2_raw": (A, dict(zarr_format=2, chunks=(10, 5), compressors=None)),
        "v2_slash_keys": (
            A,
            dict(zarr_format=2, chunks=(6, 5), chunk_key_encoding={"name": "v2", "separator": "/"}),
        ),
        "v2_delta_filter": (
            b,
            dict(zarr_format=2, chunks=(6, 5), filters=[numcodecs.Delta(dtype="i8")]),
        ),
        "v2_fortran_order": (A, dict(zarr_format=2, chunks=(5, 4), order="F")),
        "v2_big_endian": (A.astype(">f4"), dict(zarr_format=2, chunks=(5, 5))),
        "v2_chunk_bigger_than_data": (A, dict(zarr_format=2, chunks=(100, 10))),
    }
    out = {}
    for name, (arr, kw) in specs.items():
        p = root / f"{name}.zarr"
        z = zarr.create_array(store=str(p), shape=arr.shape, dtype=arr.dtype, **kw)
        z[...] = arr
        out[name] = (p, zarr.open_array(str(p), mode="r")[...])
    # fill values with chunks that were never written
    p = root / "v3_fill_missing_chunks.zarr"
    z = zarr.create_array(store=str(p), shape=(20, 4), dtype="i4", chunks=(3, 4), fill_value=-7)
    z[6:9] = 5
    out["v3_fill_missing_chunks"] = (p, z[...])
    p = root / "v2_nan_fill_missing_chunks.zarr"
    z = zarr.create_array(
        store=str(p), shape=(30, 4), dtype="f4", chunks=(4, 4), fill_value=np.nan, zarr_format=2
    )
    z[8:12] = 1.5
    out["v2_nan_fill_missing_chunks"] = (p, z[...])
    return out


@pytest.fixture(scope="module")
def zarr_variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("zarr")
    with _quiet():
        return _zarr_variants(root)


ZARR_NAMES = [
    "v3_zstd_split_cols",
    "v3_blosc_bitshuffle",
    "v3_gzip_crc32c",
    "v3_raw_one_chunk",
    "v3_chunk_bigger_than_data",
    "v3_sharded",
    "v3_transposed",
    "v3_big_endian",
    "v3_dot_keys",
    "v3_1d",
    "v3_3d",
    "v3_bool",
    "v2_zlib",
    "v2_blosc_zstd",
    "v2_raw",
    "v2_slash_keys",
    "v2_delta_filter",
    "v2_fortran_order",
    "v2_big_endian",
    "v2_chunk_bigger_than_data",
    "v3_fill_missing_chunks",
    "v2_nan_fill_missing_chunks",
]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", ZARR_NAMES)
def test_zarr_variants_read_like_zarr(zarr_variants, name, placement):
    path, ref = zarr_variants[name]
    _check_values(path, ref, placement)


@pytest.mark.parametrize(
    "name",
    [
        "v3_zstd_split_cols",
        "v3_sharded",
        "v3_transposed",
        "v3_big_endian",
        "v2_zlib",
        "v2_fortran_order",
        "v2_big_endian",
        "v2_delta_filter",
        "v3_fill_missing_chunks",
        "v2_nan_fill_missing_chunks",
    ],
)
def test_zarr_file_table_writes_through(tmp_path, zarr_variants, name):
    src, ref = zarr_variants[name]
    p = tmp_path / src.name
    shutil.copytree(src, p)
    g = gl.DataGadget(p, placement="file")
    n = ref.shape[0]
    new = np.full((2,) + ref.shape[1:], 2, dtype=ref.dtype.newbyteorder("="))
    g.insertData(torch.from_numpy(new), [n - 1, 13])  # 13: a never-written chunk in the fill cases
    g.close()
    exp = ref.copy()
    exp[[n - 1, 13]] = new
    with _quiet():
        back = zarr.open_array(str(p), mode="r")[...]
    assert _eq(back, exp)


def test_zarr_group_with_nested_array(tmp_path):
    p = tmp_path / "grp.zarr"
    with _quiet():
        root = zarr.open_group(str(p), mode="w")
        arr = root.create_array("a/b/c", shape=A.shape, dtype="f4", chunks=(4, 5))
        arr[:] = A
        root.create_array("other", shape=(3,), dtype="i8")
    for name in ["a/b/c", "/a/b/c"]:
        _check_values(p, A, "file", dataset=name)
    with pytest.raises(gl.GadgetKeyError, match="a/b/c"):
        gl.DataGadget(p, placement="cpu")
    with pytest.raises(gl.GadgetKeyError, match="other"):
        gl.DataGadget(p, dataset="nope", placement="cpu")


def test_zarr_v2_consolidated_group(tmp_path):
    p = tmp_path / "cons.zarr"
    with _quiet():
        root = zarr.open_group(str(p), mode="w", zarr_format=2)
        arr = root.create_array("x/y", shape=A.shape, dtype="f4", chunks=(5, 5))
        arr[:] = A
        zarr.consolidate_metadata(str(p))
    for placement in PLACEMENTS:
        _check_values(p, A, placement, dataset="x/y")
        _check_values(p, A, placement)  # the group holds one array


def test_zarr_store_without_extension_and_with_trailing_slash(tmp_path):
    p = tmp_path / "rawstore"
    with _quiet():
        z = zarr.create_array(store=str(p), shape=A.shape, dtype="f4", chunks=(4, 5), zarr_format=2)
        z[:] = A
    _check_values(p, A, "file")
    _check_values(str(p) + "/", A, "cpu")


# --------------------------------------------------------------------------------------
# paths: str, pathlib, os.PathLike, spaces, non-ASCII, symlinks, working directory
# --------------------------------------------------------------------------------------


class _PathLike:
    def __init__(self, p):
        self._p = os.fspath(p)

    def __fspath__(self):
        return self._p


ODD_DIR = "dir with spaces/ünïcödé 日本 ü"


@pytest.mark.parametrize("kind", ["str", "pathlib", "pathlike"])
@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_odd_paths_save_open_write(tmp_path, fmt, kind):
    d = tmp_path / ODD_DIR
    d.mkdir(parents=True)
    p = d / f"tä ble ß.{fmt}"
    wrap = {"str": str, "pathlib": pathlib.Path, "pathlike": _PathLike}[kind]
    gl.DataGadget(A, placement="cpu").save(wrap(p))
    assert p.exists()
    for placement in PLACEMENTS:
        _check_values(wrap(p), A, placement)
    g = gl.DataGadget(wrap(p), placement="file")
    g.insertData(torch.full((1, 5), 4.0), [2])
    g.close()
    exp = A.copy()
    exp[2] = 4.0
    assert _eq(_whole(gl.DataGadget(wrap(p), placement="cpu")), exp)
    assert _hidden(d) == []


def test_odd_path_savecupy_and_loadcupy(tmp_path):
    d = tmp_path / ODD_DIR
    d.mkdir(parents=True)
    g = gl.DataGadget(A, placement="cpu")
    g.saveCupy(str(d / "emb ü"))  # numpy.save's rule: ".npy" appended
    assert (d / "emb ü.npy").exists()
    t = gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu")
    t.loadCupy(d / "emb ü.npy")
    assert _eq(_whole(t), A)


def test_bytes_path_is_refused_with_fsdecode_advice(tmp_path):
    p = tmp_path / "ü.npy"
    np.save(p, A)
    with pytest.raises(gl.GadgetTypeError, match="fsdecode"):
        gl.DataGadget(os.fsencode(p), placement="cpu")


def test_relative_path_survives_chdir(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    np.save(tmp_path / "a" / "t.npy", A)
    monkeypatch.chdir(tmp_path / "a")
    g = gl.DataGadget("t.npy", placement="file")
    monkeypatch.chdir(tmp_path / "b")
    assert _eq(_rows(g, [3, 1]), A[[3, 1]])
    g.insertData(torch.ones(1, 5), [0])
    g.close()
    assert not (tmp_path / "b" / "t.npy").exists()
    assert _eq(np.load(tmp_path / "a" / "t.npy")[0], np.ones(5))


def test_symlinked_file_reads_and_writes_the_target(tmp_path):
    real = tmp_path / "real.npy"
    np.save(real, A)
    (tmp_path / "sub").mkdir()
    link = tmp_path / "sub" / "link.npy"
    link.symlink_to(real)
    g = gl.DataGadget(link, placement="file")
    assert _eq(_rows(g, [4]), A[[4]])
    g.insertData(torch.zeros(1, 5), [4])
    g.close()
    assert _eq(np.load(real)[4], np.zeros(5))
    gl.DataGadget(A, placement="cpu").save(link)  # a save through a link replaces the target
    assert link.is_symlink() and _eq(np.load(real), A)


@pytest.mark.parametrize(
    "name,kw", [("noext", {}), ("weird.bin", {}), ("misnamed.h5", {"format": "npy"})]
)
def test_npy_found_by_content_or_forced_format(tmp_path, name, kw):
    p = tmp_path / name
    np.save(tmp_path / "x.npy", A)
    shutil.copy(tmp_path / "x.npy", p)
    for placement in PLACEMENTS:
        _check_values(p, A, placement, **kw)


def test_npy_misnamed_h5_without_format_is_a_file_error(tmp_path):
    p = tmp_path / "misnamed.h5"
    np.save(tmp_path / "x.npy", A)
    shutil.copy(tmp_path / "x.npy", p)
    with pytest.raises(gl.GadgetFileError, match="misnamed.h5"):
        gl.DataGadget(p, placement="cpu")


# --------------------------------------------------------------------------------------
# read-only files
# --------------------------------------------------------------------------------------


def _make(fmt, p, arr=A):
    gl.DataGadget(arr, placement="cpu").save(p, **({"chunk_rows": 8} if fmt != "npy" else {}))


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_writable_false_refuses_every_write_and_leaves_file(tmp_path, fmt):
    p = tmp_path / f"ro.{fmt}"
    _make(fmt, p)
    before = _tree_bytes(p)
    g = gl.DataGadget(p, placement="file", writable=False)
    assert _eq(_rows(g, [36, 0]), A[[36, 0]])
    with pytest.raises(gl.ReadOnlyError, match="writable=False"):
        g.insertData(torch.zeros(1, 5), [0])
    with pytest.raises(gl.ReadOnlyError):
        g[[1, 2]] = torch.zeros(2, 5)
    with pytest.raises(gl.ReadOnlyError):
        g.fill_(1.0)
    with pytest.raises(gl.ReadOnlyError):
        g.zero_()
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.zeros(2, 2), ([0, 1], slice(0, 2)))
    assert _eq(_whole(g), A)
    g.close()
    assert _tree_bytes(p) == before


@pytest.mark.parametrize("value", ["False", 0, 1, "yes"])
def test_writable_takes_only_bools_or_none(tmp_path, value):
    p = tmp_path / "t.npy"
    np.save(p, A)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="file", writable=value)


def test_writable_accepts_numpy_bool(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, A)
    g = gl.DataGadget(p, placement="file", writable=np.bool_(False))
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.zeros(1, 5), [0])


def _chmod_ro(p):
    p = pathlib.Path(p)
    if p.is_dir():
        for q in p.rglob("*"):
            if q.is_file():
                q.chmod(0o444)
    else:
        p.chmod(0o444)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_chmod_read_only_file_reads(tmp_path, fmt, placement):
    p = tmp_path / f"ro.{fmt}"
    _make(fmt, p)
    _chmod_ro(p)
    _check_values(p, A, placement)


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_chmod_read_only_file_refuses_writes(tmp_path, fmt):
    p = tmp_path / f"ro.{fmt}"
    _make(fmt, p)
    _chmod_ro(p)
    probe = p if p.is_file() else next(q for q in p.rglob("*") if q.is_file())
    if os.access(probe, os.W_OK):
        pytest.skip("running as root: a 0o444 file is writable for this user")
    before = _tree_bytes(p)
    g = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.zeros(1, 5), [0])
    g.close()
    with pytest.raises(gl.ReadOnlyError):
        gl.DataGadget(p, placement="file", writable=True)
    assert _tree_bytes(p) == before


@pytest.mark.parametrize("fmt", ["npy", "h5"])
def test_save_over_read_only_file_keeps_its_mode(tmp_path, fmt):
    p = tmp_path / f"ro.{fmt}"
    _make(fmt, p)
    p.chmod(0o444)
    b = A[:10] * 2
    gl.DataGadget(b, placement="cpu").save(p)
    assert (p.stat().st_mode & 0o777) == 0o444
    assert _eq(_whole(gl.DataGadget(p, placement="cpu")), b)
    assert _hidden(tmp_path) == []


# --------------------------------------------------------------------------------------
# atomic saves and loads
# --------------------------------------------------------------------------------------


@pytest.fixture()
def damaged_zarr(tmp_path):
    p = tmp_path / "damaged.zarr"
    ref = RNG.standard_normal((40, 6)).astype("f4")
    with _quiet():
        z = zarr.create_array(store=str(p), shape=ref.shape, dtype="f4", chunks=(4, 6))
        z[:] = ref
    chunk = p / "c" / "7" / "0"
    assert chunk.is_file()
    with open(chunk, "r+b") as fh:
        fh.write(b"garbage!garbage!")
    return p, ref


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_failing_save_keeps_old_file_and_leaves_no_partial(tmp_path, damaged_zarr, fmt):
    src, ref = damaged_zarr
    g = gl.DataGadget(src, placement="file")
    assert _eq(_rows(g, [0, 39]), ref[[0, 39]])  # undamaged chunks read
    out = tmp_path / "out"
    out.mkdir()
    target = out / f"t.{fmt}"
    old = np.arange(12, dtype=np.int16).reshape(3, 4)
    gl.DataGadget(old, placement="cpu").save(target)
    before = _tree_bytes(target)
    with pytest.raises(gl.GadgetFileError, match="damaged.zarr"):
        g.save(target)
    assert _tree_bytes(target) == before
    assert sorted(os.listdir(out)) == [f"t.{fmt}"]
    assert _eq(_whole(gl.DataGadget(target, placement="cpu")), old)


def test_failing_load_leaves_table_unchanged(damaged_zarr):
    src, _ = damaged_zarr
    old = np.arange(12, dtype=np.int16).reshape(3, 4)
    t = gl.DataGadget(old, placement="cpu")
    with pytest.raises(gl.GadgetFileError):
        t.load(src)
    assert tuple(t.shape) == (3, 4) and _eq(_whole(t), old)


@pytest.mark.parametrize(
    "fmt,opts",
    [
        ("h5", {"compression": "zstd"}),
        ("zarr", {"compression": "bogus"}),
        ("h5", {"progress": "False"}),
    ],
)
def test_bad_save_options_refused_before_any_file(tmp_path, fmt, opts):
    target = tmp_path / f"t.{fmt}"
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(A, placement="cpu").save(target, **opts)
    assert os.listdir(tmp_path) == []
    _make(fmt, target)
    before = _tree_bytes(target)
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(A[:3], placement="cpu").save(target, **opts)
    assert _tree_bytes(target) == before and _hidden(tmp_path) == []


def test_save_failing_on_file_size_limit_keeps_old_files(tmp_path):
    """A save that fails part-way (a file size limit) is a GadgetFileError naming the
    target, and the partial file is removed (README, "Saving")."""
    script = textwrap.dedent(
        """
        import json, resource, signal, sys, warnings
        import numpy as np
        import gadgetloader as gl
        warnings.simplefilter("ignore")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        g = gl.DataGadget(np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32),
                          placement="cpu")
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        res = {}
        for t in sys.argv[1:]:
            kw = {"compression": "none", "chunk_rows": 4096} if t.endswith(".zarr") else {}
            try:
                g.save(t, progress=False, **kw)
                res[t] = ["saved", ""]
            except Exception as e:
                res[t] = [type(e).__name__, str(e)]
        print(json.dumps(res))
        """
    )
    old = np.arange(6, dtype=np.int32).reshape(3, 2)
    targets = [tmp_path / f"t ü.{f}" for f in ("npy", "h5", "zarr")]
    for t in targets:
        gl.DataGadget(old, placement="cpu").save(t)
    r = subprocess.run(
        [sys.executable, "-c", script, *map(str, targets)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for t in targets:
        kind, msg = res[str(t)]
        assert kind == "GadgetFileError", (t, kind, msg)
        assert "cannot save" in msg and t.name in msg
        assert _eq(_whole(gl.DataGadget(t, placement="cpu")), old)
    assert _hidden(tmp_path) == []


_KILL_SAVE = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import gadgetloader as gl
    g = gl.DataGadget((250_000, 256), dtype="float32", placement="cpu")
    g.fill_(1.0)
    print("start", flush=True)
    t = sys.argv[1]
    g.save(t, progress=False, **({"compression": "none"} if t.endswith(".zarr") else {}))
    print("done", flush=True)
    """
)


def _interrupt_save(folder, target, sig):
    p = subprocess.Popen(
        [sys.executable, "-c", _KILL_SAVE, str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert p.stdout.readline().strip() == "start"
    t0 = time.time()
    while not any(".partial" in f for f in os.listdir(folder)) and time.time() - t0 < 30:
        time.sleep(0.002)
    time.sleep(0.02)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


@pytest.mark.parametrize("fmt,sig", [("npy", signal.SIGKILL), ("zarr", signal.SIGINT)])
def test_interrupted_save_leaves_old_file_whole(tmp_path, fmt, sig):
    target = tmp_path / f"t.{fmt}"
    old = np.arange(12, dtype=np.int32).reshape(4, 3)
    gl.DataGadget(old, placement="cpu").save(target)
    rc, out, err = _interrupt_save(tmp_path, target, sig)
    got = gl.DataGadget(target, placement="cpu")
    if "done" in out:  # the save won the race: then the new file is whole
        assert tuple(got.shape) == (250_000, 256)
        return
    assert rc != 0
    assert _eq(_whole(got), old)
    leftovers = [f for f in os.listdir(tmp_path) if f != target.name]
    if sig == signal.SIGKILL:  # documented: a hidden .NAME.partial-PID-XXXXXXXX stays
        assert all(f.startswith(f".{target.name}.partial-") for f in leftovers)
    else:  # Ctrl-C removes the partial file
        assert "KeyboardInterrupt" in err
        assert leftovers == []


# --------------------------------------------------------------------------------------
# saves and loads of unusual sources
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
@pytest.mark.parametrize("source", ["big_endian", "fortran", "cube", "vector"])
def test_unusual_sources_round_trip_through_every_format(tmp_path, source, fmt):
    ref = {
        "big_endian": A.astype(">f8"),
        "fortran": np.asfortranarray(A),
        "cube": np.stack([A, -A], axis=2),
        "vector": np.arange(37, dtype=np.int16)[::-1].copy(),
    }[source]
    src = tmp_path / "src.npy"
    np.save(src, ref)
    g = gl.DataGadget(src, placement="file")
    dst = tmp_path / f"dst.{fmt}"
    g.save(dst, **({"dataset": "x/y/z", "chunk_rows": 5} if fmt != "npy" else {}))
    back = gl.DataGadget(dst, placement="cpu", **({"dataset": "x/y/z"} if fmt != "npy" else {}))
    assert _eq(_whole(back), ref)
    assert back.dtype == torch.from_numpy(ref.astype(ref.dtype.newbyteorder("="))).dtype


def test_nested_hdf5_file_table_saved_over_itself_keeps_dataset_name(tmp_path):
    p = tmp_path / "self.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("a/b/c", data=A, chunks=(5, 5), compression="gzip")
    g = gl.DataGadget(p, dataset="a/b/c", placement="file")
    g.insertData(torch.ones(1, 5), [3])
    g.save(p)
    with h5py.File(p, "r") as f:
        assert "a/b/c" in f
        back = f["a/b/c"][()]
    exp = A.copy()
    exp[3] = 1.0
    assert _eq(back, exp)
    assert _eq(_rows(g, [3, 4]), exp[[3, 4]])  # it reads that file on


@pytest.mark.parametrize("name", ["be", "fortran", "v3", "cnpy"])
def test_loadcupy_and_load_of_unusual_npy(tmp_path, name):
    p = tmp_path / f"{name}.npy"
    if name == "be":
        np.save(p, A.astype(">f4"))
    elif name == "fortran":
        np.save(p, np.asfortranarray(A.astype("f8")))
    elif name == "v3":
        _write_npy(p, A, version=(3, 0))
    else:
        _craft_npy(p, A.tobytes(), HEADER.format(d="<f4"), align=16)
    ref = np.load(p)
    t = gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu")
    t.loadCupy(p)
    assert _eq(_whole(t), ref)
    t2 = gl.DataGadget(np.zeros((3, 3), np.int8), placement="cpu")
    t2.load(str(p))
    assert _eq(_whole(t2), ref)


def test_load_nested_hdf5_and_v2_zarr(h5_layouts, zarr_variants):
    path, refs = h5_layouts
    t = gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu")
    t.load(path, dataset="/g/big_endian_gzip")
    assert _eq(_whole(t), refs["g/big_endian_gzip"])
    zp, zref = zarr_variants["v2_delta_filter"]
    t.load(zp)
    assert t.dtype == torch.int64 and _eq(_whole(t), zref)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_big_endian_uint16_file_converts_with_dtype_or_is_refused(tmp_path, placement):
    ref = RNG.integers(0, 65535, (20, 3)).astype(">u2")
    p = tmp_path / "u16be.npy"
    np.save(p, ref)
    if placement == "file":  # a file table reads its file as it is
        with pytest.raises(gl.GadgetTypeError, match="int32"):
            gl.DataGadget(p, placement="file", dtype="int32")
    else:
        g = gl.DataGadget(p, placement=placement, dtype="int32")
        assert g.dtype == torch.int32 and _eq(_whole(g), ref.astype(np.int32))


def test_gadget_dataset_over_unusual_files(tmp_path, h5_layouts):
    fx = np.asfortranarray(A)
    np.save(tmp_path / "x.npy", fx)
    y = (np.arange(37) % 3).astype(">i8")
    np.save(tmp_path / "y.npy", y)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), tmp_path / "y.npy")
    ((bx, by),) = ds.__getitems__([36, 0, 5])
    assert _eq(bx.cpu().numpy(), fx[[36, 0, 5]]) and _eq(by.cpu().numpy(), y[[36, 0, 5]])
    path, refs = h5_layouts
    g = gl.DataGadget(path, dataset="g/one_row_chunks", placement="file")
    ds2 = gl.GadgetDataset(g, y.astype("<i8"))
    ((bx, by),) = ds2.__getitems__([1, 2])
    assert _eq(bx.cpu().numpy(), refs["g/one_row_chunks"][[1, 2]])


@pytest.mark.parametrize(
    "dt,shape,fortran",
    [
        (">f8", (301, 3), False),
        ("<f2", (301, 3), False),
        (">i2", (301, 3, 1), False),
        (">f8", (301, 3), True),
        ("|b1", (301, 7), False),
    ],
)
def test_unaligned_header_with_odd_row_sizes(tmp_path, dt, shape, fortran):
    arr = RNG.standard_normal(shape).astype(dt)
    arr = np.asfortranarray(arr) if fortran else arr
    hdr = f"{{'descr': '{arr.dtype.str}', 'fortran_order': {fortran}, 'shape': {shape}, }}"
    p = tmp_path / "odd.npy"
    _craft_npy(p, arr.tobytes(order="A"), hdr, align=1)
    ref = np.load(p)
    assert _eq(ref, arr)
    g = gl.DataGadget(p, placement="file", cache_bytes=0)
    ids = RNG.integers(0, shape[0], 50)
    assert _eq(_rows(g, ids), ref[ids]) and _eq(_whole(g), ref)
    if not fortran:
        g.insertData(torch.from_numpy(ref[[7, 8]].astype(ref.dtype.newbyteorder("="))), [8, 7])
        g.close()
        exp = ref.copy()
        exp[[8, 7]] = ref[[7, 8]]
        assert _eq(np.load(p), exp)


def test_file_table_numpy_views_are_copies(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, A.astype(">f4"))
    g = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.GadgetValueError):
        np.asarray(g, copy=False)
    v = g.getNumpyVersion(copy=False)
    v[0] = 99.0
    assert _eq(_rows(g, [0]), A[[0]]) and _eq(np.load(p), A)


def test_pickled_file_table_keeps_path_dataset_and_read_only(tmp_path):
    import pickle

    p = tmp_path / "pk ü.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("a/b/c", data=A, chunks=(2, 5))
        f["other"] = np.zeros(3)
    g = gl.DataGadget(p, dataset="/a/b/c", placement="file", writable=False, cache_bytes=0)
    g2 = pickle.loads(pickle.dumps(g))
    g.close()
    assert g2.placement == "file" and tuple(g2.shape) == A.shape
    assert _eq(_rows(g2, [36, 1]), A[[36, 1]])
    with pytest.raises(gl.ReadOnlyError):
        g2.insertData(torch.zeros(1, 5), [0])
    g2.close()
    with h5py.File(p, "r") as f:
        assert _eq(f["a/b/c"][()], A)


def test_load_into_file_table_follows_the_new_file(tmp_path):
    np.save(tmp_path / "c.npy", A)
    np.save(tmp_path / "f.npy", np.asfortranarray(A * 3))
    np.save(tmp_path / "be.npy", (A * 2).astype(">f4"))
    g = gl.DataGadget(tmp_path / "c.npy", placement="file")
    g.load(tmp_path / "f.npy")
    assert g.placement == "file" and _eq(_whole(g), A * 3)
    with pytest.raises(gl.ReadOnlyError):  # the Fortran file cannot be written in place
        g.insertData(torch.zeros(1, 5), [0])
    g.load(tmp_path / "be.npy")
    g.insertData(torch.zeros(1, 5), [0])
    g.close()
    exp = (A * 2).astype(">f4")
    exp[0] = 0
    assert _eq(np.load(tmp_path / "be.npy"), exp) and _eq(np.load(tmp_path / "c.npy"), A)


# --------------------------------------------------------------------------------------
# the io / store constructors named by the docstrings
# --------------------------------------------------------------------------------------


def test_open_source_reads_nested_big_endian_hdf5(h5_layouts):
    path, refs = h5_layouts
    src = gl.io.open_source(path, dataset="/g/big_endian_gzip")
    try:
        assert tuple(src.shape) == (37, 5) and src.dtype == torch.float64
        out = np.empty((4, 5), np.float64)
        src.read_into(30, 34, out)
        assert _eq(out, refs["g/big_endian_gzip"][30:34])
    finally:
        src.close()


@pytest.mark.parametrize("kind", ["fortran", "big_endian", "v2_zarr"])
def test_file_store_gathers_from_unusual_sources(tmp_path, zarr_variants, kind):
    if kind == "v2_zarr":
        p, ref = zarr_variants["v2_big_endian"]
    else:
        ref = np.asfortranarray(A) if kind == "fortran" else A.astype(">f4")
        p = tmp_path / "s.npy"
        np.save(p, ref)
    st = gl.stores.file_store(p, cache_bytes=0)
    try:
        assert tuple(st.shape) == ref.shape
        ids = torch.tensor([36, 2, 2, 0])
        assert _eq(st.gather(ids, torch.device("cpu")).numpy(), ref[ids.numpy()])
        assert _eq(st.read_block(3, 9).numpy(), ref[3:9])
    finally:
        st.close()


def test_file_store_refuses_unknown_option(tmp_path):
    p = tmp_path / "s.npy"
    np.save(p, A)
    with pytest.raises(gl.GadgetTypeError, match="cache_bytes"):
        gl.stores.file_store(p, cache_size=10)


# --------------------------------------------------------------------------------------
# the convert command
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Runs every convert case at once (each is a fresh interpreter)."""
    root = tmp_path_factory.mktemp("cli")
    d = root / ODD_DIR
    d.mkdir(parents=True)
    be_f = np.asfortranarray(A.astype(">f8"))
    np.save(d / "bé f.npy", be_f)
    with h5py.File(root / "n.h5", "w") as f:
        f.create_dataset("a/b/c", data=A, chunks=(5, 3), compression="gzip", shuffle=True)
        f.create_dataset("other", data=np.zeros(3))
    with _quiet():
        z = zarr.create_array(
            store=str(root / "v2.zarr"), shape=A.shape, dtype=">f4", chunks=(6, 2), zarr_format=2
        )
        z[:] = A
    np.save(root / "empty.npy", np.zeros((0, 4), np.float32))
    np.save(root / "plain.npy", A)
    os.link(root / "plain.npy", root / "plain_hard.npy")
    jobs = {
        "be_fortran_to_h5": [
            str(d / "bé f.npy"),
            str(d / "oüt.h5"),
            "--dst-dataset",
            "x/y",
            "--compression",
            "gzip",
        ],
        "nested_h5_to_zarr": [
            str(root / "n.h5"),
            str(root / "n.zarr"),
            "--dataset",
            "/a/b/c",
            "--chunk-rows",
            "4",
        ],
        "v2_zarr_to_npy": [str(root / "v2.zarr"), str(root / "v2.npy")],
        "zero_rows": [str(root / "empty.npy"), str(root / "empty.h5")],
        "same_file": [str(root / "plain.npy"), str(root / "plain.npy")],
        "same_file_hard_link": [str(root / "plain.npy"), str(root / "plain_hard.npy")],
        "bad_compression": [
            str(root / "plain.npy"),
            str(root / "bad1.h5"),
            "--compression",
            "bogus",
        ],
        "bad_to": [str(root / "plain.npy"), str(root / "bad2.h5"), "--to", "bogus"],
    }
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-m", "gadgetloader", "convert", *v, "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for k, v in jobs.items()
    }
    res = {}
    for k, p in procs.items():
        out, err = p.communicate(timeout=120)
        res[k] = (p.returncode, out, err)
    return root, d, be_f, res


def test_convert_big_endian_fortran_non_ascii_path(cli):
    root, d, be_f, res = cli
    rc, out, err = res["be_fortran_to_h5"]
    assert rc == 0, err
    with h5py.File(d / "oüt.h5", "r") as f:
        assert list(f.keys()) == ["x"]
        assert _eq(f["x/y"][()], be_f)
    assert _hidden(d) == []


def test_convert_nested_hdf5_dataset_to_zarr(cli):
    root, _, _, res = cli
    rc, out, err = res["nested_h5_to_zarr"]
    assert rc == 0, err
    _check_values(root / "n.zarr", A, "file", dataset="a/b/c")  # default name: --dataset


def test_convert_v2_big_endian_zarr_to_npy(cli):
    root, _, _, res = cli
    rc, out, err = res["v2_zarr_to_npy"]
    assert rc == 0, err
    assert _eq(np.load(root / "v2.npy"), A)


def test_convert_zero_row_source_is_one_line_exit_1(cli):
    root, _, _, res = cli
    rc, out, err = res["zero_rows"]
    assert rc == 1
    assert len(err.strip().splitlines()) == 1 and "empty.npy" in err and "zero rows" in err
    assert not (root / "empty.h5").exists()


@pytest.mark.parametrize("case", ["same_file", "same_file_hard_link"])
def test_convert_refuses_its_own_source(cli, case):
    root, _, _, res = cli
    rc, out, err = res[case]
    assert rc != 0 and "same file" in err
    assert _eq(np.load(root / "plain.npy"), A)


@pytest.mark.parametrize("case,dst", [("bad_compression", "bad1.h5"), ("bad_to", "bad2.h5")])
def test_convert_unknown_option_value_exits_2(cli, case, dst):
    """README: every command exits "2 for a bad argument (... also for values checked after
    parsing, such as unknown names in a list ...)", 1 for other errors."""
    root, _, _, res = cli
    rc, out, err = res[case]
    assert not (root / dst).exists()
    assert "bogus" in err
    assert rc == 2, (rc, err)


def test_convert_interrupted_exits_130_and_writes_nothing(tmp_path):
    src = tmp_path / "big.npy"
    np.save(src, np.ones((200_000, 256), np.float32))
    dst = tmp_path / "out.h5"
    p = subprocess.Popen(
        [sys.executable, "-m", "gadgetloader", "convert", str(src), str(dst), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    t0 = time.time()
    while not any(".partial" in f for f in os.listdir(tmp_path)) and time.time() - t0 < 60:
        if p.poll() is not None:
            break
        time.sleep(0.002)
    time.sleep(0.02)
    if p.poll() is not None:
        p.communicate()  # close its pipes
        pytest.skip("convert finished before it could be interrupted")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    if p.returncode == 0:
        pytest.skip("convert finished before the interrupt arrived")
    assert p.returncode == 130, err
    assert "not written" in err
    assert not dst.exists()
    assert _hidden(tmp_path) == []
