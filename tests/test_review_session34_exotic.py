"""Session 34 black-box review: unusual but legitimate files a user brings.

README, "Files: .npy, HDF5 and zarr": files are built with numpy / h5py / zarr directly and
opened through every documented path (``DataGadget(path, placement=...)`` in memory and
file-backed, ``dataset=``, ``GadgetDataset`` columns, ``load()`` / ``loadCupy()``,
``gadgetloader convert``); what gadgetloader reads is compared with what the format's own
library reads, writes through ``file`` tables are read back with that library, and
refusals must be clear ``GadgetError`` subclasses that name the file.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# --------------------------------------------------------------------------- helpers

#: the placements every read is checked on: in memory, file-backed (writable) and
#: file-backed read-only (README: read-only .npy / uncompressed HDF5 go through a memory map)
READ_WAYS = [("cpu", {}), ("file", {}), ("file", {"writable": False})]


def _h5py():
    return pytest.importorskip("h5py")


def _zarr():
    return pytest.importorskip("zarr", minversion="3")


def _np(t):
    return t.detach().cpu().numpy()


def _native(a):
    a = np.asarray(a)
    return np.ascontiguousarray(a.astype(a.dtype.newbyteorder("="), copy=False))


def _tdtype(npdt):
    return torch.from_numpy(np.zeros(1, np.dtype(npdt).newbyteorder("="))).dtype


def _same(got, expected):
    """Bit-exact equality (NaN, -0.0 and byte order included), after going native."""
    got, expected = _native(got), _native(expected)
    assert got.shape == expected.shape, f"shape {got.shape} != {expected.shape}"
    assert got.dtype == expected.dtype, f"dtype {got.dtype} != {expected.dtype}"
    assert got.tobytes() == expected.tobytes(), f"values differ:\n{got}\nexpected\n{expected}"


def _check_reads(path, expected, ways=READ_WAYS, **kw):
    """Every documented read of ``path`` equals ``expected`` (what numpy/h5py/zarr read)."""
    expected = np.asarray(expected)
    n = expected.shape[0]
    ids = [n - 1, 0, n - 1, n // 2]
    for placement, extra in ways:
        with gl.DataGadget(path, placement=placement, progress=False, **extra, **kw) as g:
            label = f"{placement} {extra}"
            assert g.placement == placement, label
            assert tuple(g.shape) == expected.shape, label
            assert len(g) == n, label
            assert g.dtype == _tdtype(expected.dtype), label
            _same(g.getNumpyVersion(), expected)
            _same(np.asarray(g), expected)
            _same(_np(g.getData(np.array(ids))), expected[ids])
            _same(_np(g.getData(torch.tensor(ids))), expected[ids])
            _same(_np(g[ids]), expected[ids])
            _same(_np(g[1:n]), expected[1:n])


def _write_rows(path, ids, rows, **kw):
    with gl.DataGadget(path, placement="file", progress=False, **kw) as g:
        assert g.placement == "file"
        g.insertData(torch.from_numpy(_native(rows)), ids)


def _rows_for(expected, k, seed=0):
    """``k`` rows of ``expected``'s row shape and dtype that differ from its values."""
    rng = np.random.default_rng(seed)
    shape = (k,) + expected.shape[1:]
    dt = np.dtype(expected.dtype).newbyteorder("=")
    if dt == np.bool_:
        return ~np.zeros(shape, bool) if not expected.all() else np.zeros(shape, bool)
    if dt.kind in "iu":
        return rng.integers(-100 if dt.kind == "i" else 0, 100, size=shape).astype(dt)
    return (rng.standard_normal(shape) * 1000 + 12345).astype(dt)


def _zarr_read(path, dataset=None):
    zarr = _zarr()
    if dataset is None:
        return zarr.open_array(str(path), mode="r")[...]
    return zarr.open_group(str(path), mode="r")[dataset][...]


def _zarr_meta(path, dataset=None):
    zarr = _zarr()
    node = (
        zarr.open_array(str(path), mode="r")
        if dataset is None
        else zarr.open_group(str(path), mode="r")[dataset]
    )
    return node.metadata


def _tree_bytes(path):
    """Every file under a path (a file itself, or a zarr directory) with its bytes."""
    p = Path(path)
    if p.is_file():
        return {".": p.read_bytes()}
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def _env():
    env = os.environ.copy()
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _convert(*args, cwd=None):
    r = subprocess.run(
        [sys.executable, "-m", "gadgetloader", "convert", *map(str, args), "--no-progress"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=120,
    )
    return r.returncode, r.stdout, r.stderr


def _write_npy_raw(path, arr, header, align, version=(1, 0)):
    """A .npy file as other writers (cnpy, older numpy, ...) make it: ``header`` is the
    dict literal as written, padded so that the data starts at a multiple of ``align``."""
    h = header.encode("latin1")
    pre = 8 + (2 if version[0] == 1 else 4)
    pad = (-(pre + len(h) + 1)) % align
    h = h + b" " * pad + b"\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY" + bytes(version))
        f.write(struct.pack("<H" if version[0] == 1 else "<I", len(h)))
        f.write(h)
        f.write(np.ascontiguousarray(arr).tobytes())


A = np.arange(40, dtype=np.float32).reshape(10, 4) * 1.5 - 7


# =========================================================================== .npy


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)], ids=["v1", "v2", "v3"])
def test_npy_header_versions_read_and_write(tmp_path, version):
    p = tmp_path / "t.npy"
    with open(p, "wb") as f:
        np.lib.format.write_array(f, A, version=version)
    _check_reads(p, np.load(p))
    rows = _rows_for(A, 2)
    _write_rows(p, [7, 2], rows)
    exp = A.copy()
    exp[[7, 2]] = rows
    _same(np.load(p), exp)
    with open(p, "rb") as f:
        assert np.lib.format.read_magic(f) == version, "an in-place write changed the header"


@pytest.mark.parametrize(
    "header,align",
    [
        ("{'descr': '<f8', 'fortran_order': False, 'shape': (10, 4), }", 16),  # cnpy / old numpy
        ("{'descr': '<f8', 'fortran_order': False, 'shape': (10, 4), }", 1),  # unaligned data
        ("{'shape': (10, 4), 'fortran_order': False, 'descr': '<f8'}", 64),  # other key order
    ],
    ids=["align16", "unaligned", "keys-reordered"],
)
def test_npy_headers_from_other_writers(tmp_path, header, align):
    a = A.astype(np.float64)
    p = tmp_path / "o.npy"
    _write_npy_raw(p, a, header, align)
    _same(np.load(p), a)  # numpy reads it
    _check_reads(p, a)
    rows = _rows_for(a, 1)
    _write_rows(p, [9], rows)
    exp = a.copy()
    exp[9] = rows[0]
    _same(np.load(p), exp)


@pytest.mark.parametrize("shape", [(10, 4), (6, 4, 5)], ids=["2d", "3d"])
def test_npy_fortran_order_reads_and_refuses_writes(tmp_path, shape):
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 3
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(a))
    assert np.load(p).flags.f_contiguous
    _check_reads(p, a)
    # a partial-row read through the NumPy-style index
    with gl.DataGadget(p, placement="file") as g:
        _same(_np(g[[4, 1], 1:3]), a[[4, 1], 1:3])
    before = p.read_bytes()
    # README: "read-only sources raise ReadOnlyError saying why, e.g. a Fortran-ordered .npy"
    with gl.DataGadget(p, placement="file") as g:
        with pytest.raises(gl.ReadOnlyError, match="(?i)fortran"):
            g.insertData(torch.zeros((1,) + shape[1:]), [0])
        with pytest.raises(gl.ReadOnlyError):
            g[0:2] = torch.zeros((2,) + shape[1:])
        _same(g.getNumpyVersion(), a)
    with pytest.raises(gl.ReadOnlyError, match="(?i)fortran"):
        gl.DataGadget(p, placement="file", writable=True)
    assert p.read_bytes() == before
    # an in-memory table of it is writable and leaves the file alone
    with gl.DataGadget(p, placement="cpu") as g:
        g.insertData(torch.zeros((1,) + shape[1:]), [0])
        assert float(_np(g.getData([0])).sum()) == 0.0
    assert p.read_bytes() == before


def test_npy_fortran_resave_advice_makes_it_writable(tmp_path):
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(A))
    with gl.DataGadget(p, placement="file") as g, pytest.raises(gl.ReadOnlyError) as ei:
        g.insertData(torch.zeros(1, 4), [0])
    assert str(p) in str(ei.value)
    # the advice in the message: save it again in C order
    with gl.DataGadget(p, placement="cpu") as g:
        g.save(p)
    back = np.load(p)
    assert back.flags.c_contiguous and not np.isfortran(back)
    _same(back, A)
    _write_rows(p, [3], np.full((1, 4), 2.5, np.float32))
    exp = A.copy()
    exp[3] = 2.5
    _same(np.load(p), exp)


@pytest.mark.parametrize(
    "dt", [">f4", ">f8", ">i2", ">i8", ">f2", ">i4"], ids=lambda d: d.replace(">", "be-")
)
@pytest.mark.parametrize("fortran", [False, True], ids=["C", "F"])
def test_npy_big_endian(tmp_path, dt, fortran):
    a = (np.arange(24).reshape(6, 4) * 3 - 20).astype(dt)
    p = tmp_path / "be.npy"
    np.save(p, np.asfortranarray(a) if fortran else a)
    assert np.load(p).dtype == np.dtype(dt)
    _check_reads(p, np.load(p))
    if fortran:
        return  # read-only, checked above
    rows = _rows_for(a, 2, seed=3)
    _write_rows(p, [5, 0], rows)
    back = np.load(p)
    assert back.dtype == np.dtype(dt), "an in-place write changed the file's byte order"
    exp = _native(a).copy()
    exp[[5, 0]] = rows
    _same(back, exp)


def test_npy_big_endian_dtype_argument(tmp_path):
    p = tmp_path / "be.npy"
    np.save(p, A.astype(">f4"))
    for placement in ("cpu", "file"):
        for dt in ("float32", torch.float32, np.float32):
            with gl.DataGadget(p, placement=placement, dtype=dt) as g:
                assert g.dtype == torch.float32
                _same(g.getNumpyVersion(), A)
        # "A file source must already hold dtype": float64 is refused, naming both
        with pytest.raises(gl.GadgetTypeError) as ei:
            gl.DataGadget(p, placement=placement, dtype="float64")
        assert "float64" in str(ei.value) and "float32" in str(ei.value)


def test_npy_one_dimensional_rows(tmp_path):
    a = np.array([5, -3, 2**40, 7, 0], dtype=np.int64)
    p = tmp_path / "l.npy"
    np.save(p, a)
    _check_reads(p, a)
    with gl.DataGadget(p, placement="file") as g:
        assert tuple(g.getData(torch.tensor([[0, 1], [2, 2]])).shape) == (2, 2)
        g.insertData(torch.tensor([11, 12]), [4, 1])
        with pytest.raises(gl.GadgetValueError):
            g.insertData(torch.tensor([[1], [2]]), [0, 3])  # (2, 1) is not ids.shape
    exp = a.copy()
    exp[[4, 1]] = [11, 12]
    _same(np.load(p), exp)


def test_npy_three_dimensional_rows_and_partial_writes(tmp_path):
    a = np.arange(5 * 3 * 4, dtype=np.float64).reshape(5, 3, 4)
    p = tmp_path / "c.npy"
    np.save(p, a)
    _check_reads(p, a)
    with gl.DataGadget(p, placement="file") as g:
        assert tuple(g.getData([[1, 2]]).shape) == (1, 2, 3, 4)
        _same(_np(g[[4, 0], 1:3]), a[[4, 0], 1:3])
        g.insertData(torch.full((2, 2, 4), -1.0, dtype=torch.float64), ([3, 1], slice(1, 3)))
        g.insertData(torch.full((1, 3, 4), 9.0, dtype=torch.float64), [0])
    exp = a.copy()
    exp[[3, 1], 1:3] = -1.0
    exp[0] = 9.0
    _same(np.load(p), exp)


def test_npy_one_row(tmp_path):
    a = np.array([[1.5, -2.0, 3.25]], np.float32)
    p = tmp_path / "one.npy"
    np.save(p, a)
    _check_reads(p, a)
    before = p.read_bytes()
    with gl.DataGadget(p, placement="file") as g:
        _same(_np(g.getData([0, 0, 0])), a[[0, 0, 0]])
        with pytest.raises(gl.GadgetIndexError):
            g.getData([1])
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.zeros(2, 3), [0, 1])
    assert p.read_bytes() == before, "a refused write changed the file"
    _write_rows(p, [0], np.zeros((1, 3), np.float32))
    _same(np.load(p), np.zeros((1, 3), np.float32))


@pytest.mark.parametrize("shape", [(0, 4), (0,), (0, 2, 3)], ids=["2d", "1d", "3d"])
def test_npy_zero_rows_refused_naming_file(tmp_path, shape):
    p = tmp_path / "empty_rows.npy"
    np.save(p, np.zeros(shape, np.float32))
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetValueError) as ei:
            gl.DataGadget(p, placement=placement)
        msg = str(ei.value)
        assert "empty_rows.npy" in msg and "zero rows" in msg, msg
    with pytest.raises(gl.GadgetValueError, match="empty_rows.npy"):
        gl.GadgetDataset(p, device="cpu")
    g = gl.DataGadget(np.ones((2, 4), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetError, match="empty_rows.npy"):
        g.load(p)
    _same(g.getNumpyVersion(), np.ones((2, 4), np.float32))


@pytest.mark.parametrize(
    "arr",
    [
        np.array([[True, False, True], [False, False, True]]),
        np.array([[-128, 127, 0], [1, -1, 5]], np.int8),
        np.array([[0, 255, 7], [128, 1, 2]], np.uint8),
        np.array([[0.5, -0.0, 6e-8], [65504, np.inf, np.nan]], np.float16),
    ],
    ids=["bool", "int8", "uint8", "float16"],
)
def test_npy_small_dtypes_bit_exact(tmp_path, arr):
    p = tmp_path / "s.npy"
    np.save(p, arr)
    _check_reads(p, arr)
    rows = _rows_for(arr, 1)
    _write_rows(p, [1], rows)
    exp = arr.copy()
    exp[1] = rows[0]
    back = np.load(p)
    assert back.dtype == arr.dtype
    _same(back, exp)


def test_npy_uint16_refused_then_converted(tmp_path):
    u = np.array([[0, 65535], [300, 7]], np.uint16)
    p = tmp_path / "u.npy"
    np.save(p, np.asfortranarray(u.astype(">u2")))
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetTypeError) as ei:
            gl.DataGadget(p, placement=placement)
        msg = str(ei.value)
        assert "uint16" in msg and "int32" in msg and str(p) in msg, msg
    # README: DataGadget(path, dtype=...) converts a uint file loaded into memory
    with gl.DataGadget(p, placement="cpu", dtype="int32") as g:
        assert g.dtype == torch.int32
        _same(g.getNumpyVersion(), u.astype(np.int32))
    with pytest.raises(gl.GadgetValueError, match="65535"):
        gl.DataGadget(p, placement="cpu", dtype="int16")
    # "a file table reads its file as it is, so such a file is refused there"
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="file", dtype="int32")


@pytest.mark.parametrize(
    "dt",
    [
        [("a", "<f4"), ("b", "<i4")],
        [("a", "<f4", (2,))],
        [("x", "<f8")],
        [("a", ">i2"), ("b", [("c", "<f4")])],
    ],
    ids=["two-fields", "subarray-field", "one-field", "nested"],
)
def test_npy_structured_refused_clearly(tmp_path, dt):
    p = tmp_path / "rec.npy"
    np.save(p, np.zeros(4, dtype=dt))
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetTypeError) as ei:
            gl.DataGadget(p, placement=placement)
        msg = str(ei.value)
        assert str(p) in msg and "numeric or bool" in msg, msg
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetDataset(p, device="cpu")
    g = gl.DataGadget(np.arange(6, dtype=np.float32).reshape(3, 2), placement="cpu")
    for call in (g.load, g.loadCupy):
        with pytest.raises(gl.GadgetTypeError):
            call(p)
        _same(g.getNumpyVersion(), np.arange(6, dtype=np.float32).reshape(3, 2))


@pytest.mark.parametrize(
    "arr,err",
    [
        (np.ones((3, 2), np.complex64), gl.GadgetTypeError),
        (np.array(["2020-01-01"] * 3, "M8[D]"), gl.GadgetTypeError),
        (np.array(["ab", "c"]), gl.GadgetTypeError),
        (np.zeros(3, "V4"), gl.GadgetTypeError),
        (np.array(3.0, np.float32), gl.GadgetValueError),
    ],
    ids=["complex", "datetime", "unicode", "void", "scalar"],
)
def test_npy_non_tables_refused(tmp_path, arr, err):
    p = tmp_path / "bad.npy"
    np.save(p, arr)
    for placement in ("cpu", "file"):
        with pytest.raises(err) as ei:
            gl.DataGadget(p, placement=placement)
        assert str(p) in str(ei.value)


def test_npy_format_from_content_and_forced(tmp_path):
    h5py = _h5py()
    p = tmp_path / "rows.dat"
    with open(p, "wb") as f:
        np.save(f, A)
    _check_reads(p, A)  # no known extension: format from the content
    q = tmp_path / "really_hdf5.npy"
    with h5py.File(q, "w") as f:
        f.create_dataset("x", data=A)
    # the extension wins: a clear file error, not a crash
    with pytest.raises(gl.GadgetFileError, match="really_hdf5.npy"):
        gl.DataGadget(q, placement="cpu")
    _check_reads(q, A, format="hdf5")
    with pytest.raises(gl.GadgetKeyError, match="npy"):
        gl.DataGadget(p, placement="cpu", format="parquet")


# =========================================================================== HDF5


def _h5_cases():
    ai = np.arange(40, dtype=np.int32).reshape(10, 4) * 1000 - 7000
    return {
        "contiguous": (dict(), A),
        "chunked": (dict(chunks=(3, 4)), A),
        "gzip9": (dict(chunks=(3, 4), compression="gzip", compression_opts=9), A),
        "lzf": (dict(chunks=(3, 2), compression="lzf"), A),
        "shuffle-only": (dict(chunks=(2, 4), shuffle=True), A),
        "shuffle-gzip-fletcher32": (
            dict(chunks=(4, 4), shuffle=True, fletcher32=True, compression="gzip"),
            A,
        ),
        "fletcher32-only": (dict(chunks=(4, 4), fletcher32=True), A),
        "scaleoffset-int": (dict(chunks=(2, 4), scaleoffset=0), ai),
        "chunks-larger-than-table": (dict(chunks=(64, 4), maxshape=(None, 4)), A),
        "chunks-larger-gzip": (dict(chunks=(100, 8), maxshape=(None, None), compression="gzip"), A),
        "chunks-split-columns": (dict(chunks=(3, 1), compression="gzip"), A),
        "big-endian-contiguous": (dict(dtype=">f4"), A),
        "big-endian-chunked-f8": (dict(dtype=">f8", chunks=(3, 4)), A.astype(np.float64)),
        "big-endian-i2-lzf": (
            dict(dtype=">i2", chunks=(4, 4), compression="lzf"),
            A.astype(np.int16),
        ),
    }


@pytest.mark.parametrize("case", list(_h5_cases()))
def test_hdf5_layouts_and_filters(tmp_path, case):
    h5py = _h5py()
    kw, a = _h5_cases()[case]
    p = tmp_path / "t.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("x", data=a, **kw)
        props = (
            d.dtype,
            d.chunks,
            d.compression,
            d.compression_opts,
            d.shuffle,
            d.fletcher32,
            d.scaleoffset,
            d.maxshape,
        )
    with h5py.File(p, "r") as f:
        ref = f["x"][()]
    _check_reads(p, ref)
    rows = _rows_for(ref, 3, seed=7)
    _write_rows(p, [9, 0, 4], rows)
    exp = _native(ref).copy()
    exp[[9, 0, 4]] = rows
    with h5py.File(p, "r") as f:
        d = f["x"]
        _same(d[()], exp)
        assert (
            d.dtype,
            d.chunks,
            d.compression,
            d.compression_opts,
            d.shuffle,
            d.fletcher32,
            d.scaleoffset,
            d.maxshape,
        ) == props, "the dataset's layout changed"
    # a partial-row write, read back by h5py
    _write_rows(p, ([2, 7], slice(1, 3)), exp[[2, 7], 1:3] * 0 + 1)
    exp[[2, 7], 1:3] = 1
    with h5py.File(p, "r") as f:
        _same(f["x"][()], exp)


def test_hdf5_compact_layout(tmp_path):
    h5py = _h5py()
    p = tmp_path / "compact.h5"
    a = A[:3, :2].copy()
    with h5py.File(p, "w") as f:
        sid = h5py.h5s.create_simple(a.shape)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        dsid = h5py.h5d.create(f.id, b"x", h5py.h5t.NATIVE_FLOAT, sid, dcpl=dcpl)
        h5py.Dataset(dsid)[...] = a
    _check_reads(p, a)
    _write_rows(p, [1], np.array([[5.0, 6.0]], np.float32))
    a[1] = [5, 6]
    with h5py.File(p, "r") as f:
        _same(f["x"][()], a)


def test_hdf5_nested_groups(tmp_path):
    h5py = _h5py()
    p = tmp_path / "n.h5"
    other = np.arange(6, dtype=np.int64).reshape(3, 2)
    with h5py.File(p, "w") as f:
        f.create_dataset("a/b/c", data=A, chunks=(4, 4), compression="gzip")
        f.create_dataset("a/other", data=other)
    _check_reads(p, A, dataset="a/b/c")
    _check_reads(p, A, dataset="/a/b/c", ways=[("cpu", {})])
    _write_rows(p, [5], np.full((1, 4), -1, np.float32), dataset="a/b/c")
    exp = A.copy()
    exp[5] = -1
    with h5py.File(p, "r") as f:
        _same(f["a/b/c"][()], exp)
        _same(f["a/other"][()], other)
    # a wrong name, a group's name and no name list what exists
    for ds in ("a/b/nope", "a/b"):
        with pytest.raises(gl.GadgetKeyError) as ei:
            gl.DataGadget(p, placement="file", dataset=ds)
        assert "a/b/c" in str(ei.value) and "a/other" in str(ei.value), str(ei.value)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, placement="cpu")
    assert "a/b/c" in str(ei.value) and "dataset" in str(ei.value)
    assert isinstance(ei.value, KeyError)


def test_hdf5_resizable_datasets(tmp_path):
    h5py = _h5py()
    p = tmp_path / "r.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("grown", data=A[:4], maxshape=(None, 4), chunks=(3, 4))
        d.resize((10, 4))
        d[4:] = A[4:]
        d = f.create_dataset(
            "shrunk", data=A, maxshape=(None, 4), chunks=(3, 4), compression="gzip"
        )
        d.resize((5, 4))
        d = f.create_dataset(
            "shrink-grow", data=A, maxshape=(None, None), chunks=(4, 4), fillvalue=-1
        )
        d.resize((5, 4))
        d.resize((12, 4))
        d = f.create_dataset(
            "grown-unwritten", data=A[:3], maxshape=(None, 4), chunks=(2, 4), fillvalue=8
        )
        d.resize((9, 4))
    for name in ("grown", "shrunk", "shrink-grow", "grown-unwritten"):
        with h5py.File(p, "r") as f:
            ref = f[name][()]
        _check_reads(p, ref, dataset=name)
        n = ref.shape[0]
        _write_rows(p, [n - 1], np.full((1, 4), 3.5, np.float32), dataset=name)
        exp = ref.copy()
        exp[n - 1] = 3.5
        with h5py.File(p, "r") as f:
            _same(f[name][()], exp)


@pytest.mark.parametrize(
    "chunks", [None, (2, 4), (4, 2)], ids=["contiguous", "chunks", "split-chunks"]
)
def test_hdf5_fillvalue_unwritten_storage(tmp_path, chunks):
    h5py = _h5py()
    p = tmp_path / "fv.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("x", shape=(10, 4), dtype="f4", chunks=chunks, fillvalue=-3.5)
        if chunks:
            d[0:2] = A[0:2]
            d[8:10] = A[8:10]
    with h5py.File(p, "r") as f:
        ref = f["x"][()]
    assert (ref[4] == -3.5).all()
    _check_reads(p, ref)
    _write_rows(p, [5], np.ones((1, 4), np.float32))
    exp = ref.copy()
    exp[5] = 1
    with h5py.File(p, "r") as f:
        _same(f["x"][()], exp)  # row 4 / 6 still read as the fill value


def test_hdf5_scalar_and_null_datasets_refused(tmp_path):
    h5py = _h5py()
    p = tmp_path / "sc.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("scalar", data=3.0)
        f.create_dataset("null", data=h5py.Empty("f4"))
        f.create_dataset("ok", data=A)
    for name in ("scalar", "null"):
        for placement in ("cpu", "file"):
            with pytest.raises(gl.GadgetValueError) as ei:
                gl.DataGadget(p, placement=placement, dataset=name)
            msg = str(ei.value)
            assert str(p) in msg and name in msg and "axis" in msg, msg
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(p, dataset="scalar", device="cpu")
    _check_reads(p, A, dataset="ok", ways=[("file", {})])


@pytest.mark.parametrize(
    "build",
    ["compound", "string", "vlen", "complex", "zero-rows"],
)
def test_hdf5_non_tables_refused(tmp_path, build):
    h5py = _h5py()
    p = tmp_path / "bad.h5"
    with h5py.File(p, "w") as f:
        if build == "compound":
            f.create_dataset("x", data=np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")]))
        elif build == "string":
            f.create_dataset("x", data=np.array([b"ab", b"cd"]))
        elif build == "vlen":
            f.create_dataset("x", shape=(3,), dtype=h5py.vlen_dtype("f4"))
        elif build == "complex":
            f.create_dataset("x", data=np.ones((3, 2), np.complex64))
        else:
            f.create_dataset("x", shape=(0, 4), dtype="f4", maxshape=(None, 4))
    err = gl.GadgetValueError if build == "zero-rows" else gl.GadgetTypeError
    for placement in ("cpu", "file"):
        with pytest.raises(err) as ei:
            gl.DataGadget(p, placement=placement)
        assert "bad.h5" in str(ei.value), str(ei.value)


def test_hdf5_soft_and_hard_links(tmp_path):
    h5py = _h5py()
    p = tmp_path / "l.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("grp/real", data=A, chunks=(5, 4))
        f["soft"] = h5py.SoftLink("/grp/real")
        f["hard"] = f["grp/real"]
        f["grp_alias"] = h5py.SoftLink("/grp")
    for name in ("soft", "hard", "grp_alias/real"):
        _check_reads(p, A, dataset=name)
    _write_rows(p, [2], np.full((1, 4), 42.0, np.float32), dataset="soft")
    _write_rows(p, [3], np.full((1, 4), 43.0, np.float32), dataset="grp_alias/real")
    exp = A.copy()
    exp[2] = 42
    exp[3] = 43
    with h5py.File(p, "r") as f:
        _same(f["grp/real"][()], exp)
        _same(f["hard"][()], exp)
    # one dataset under several names is one table: no dataset= needed
    q = tmp_path / "one.h5"
    with h5py.File(q, "w") as f:
        f.create_dataset("real", data=A)
        f["alias"] = h5py.SoftLink("/real")
    _check_reads(q, A, ways=[("cpu", {})])


def test_hdf5_dangling_soft_link(tmp_path):
    h5py = _h5py()
    p = tmp_path / "d.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("real", data=A)
        f["dangling"] = h5py.SoftLink("/nothere")
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, placement="cpu", dataset="dangling")
    assert "real" in str(ei.value)


def test_hdf5_external_link(tmp_path):
    h5py = _h5py()
    target = tmp_path / "target.h5"
    links = tmp_path / "links.h5"
    with h5py.File(target, "w") as f:
        f.create_dataset("grp/d", data=A, chunks=(3, 4), compression="gzip")
    with h5py.File(links, "w") as f:
        f["ext"] = h5py.ExternalLink(str(target), "/grp/d")
        f.create_dataset("local", data=A[:2])
    _check_reads(links, A, dataset="ext")
    before = target.read_bytes()
    with gl.DataGadget(links, placement="file", dataset="ext") as g:
        with pytest.raises(gl.ReadOnlyError) as ei:
            g.insertData(torch.zeros(1, 4), [0])
        msg = str(ei.value)
        assert "target.h5" in msg and "grp/d" in msg, msg
        _same(g.getNumpyVersion(), A)
    with pytest.raises(gl.ReadOnlyError, match="target.h5"):
        gl.DataGadget(links, placement="file", dataset="ext", writable=True)
    assert target.read_bytes() == before
    # the advice: open the target itself to write
    _write_rows(target, [1], np.zeros((1, 4), np.float32), dataset="grp/d")
    exp = A.copy()
    exp[1] = 0
    with h5py.File(links, "r") as f:
        _same(f["ext"][()], exp)


def test_hdf5_external_link_to_missing_file(tmp_path):
    h5py = _h5py()
    p = tmp_path / "el.h5"
    with h5py.File(p, "w") as f:
        f["e"] = h5py.ExternalLink("nothere.h5", "/d")
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetError) as ei:
            gl.DataGadget(p, placement=placement, dataset="e")
        assert "nothere.h5" in str(ei.value)


def test_hdf5_attributes_and_track_order_survive_writes(tmp_path):
    h5py = _h5py()
    p = tmp_path / "at.h5"
    with h5py.File(p, "w", track_order=True) as f:
        f.attrs["created_by"] = "me"
        g = f.create_group("g", track_order=True)
        for name in ("zz", "aa", "mm"):
            d = g.create_dataset(name, data=A + len(name), chunks=(5, 4))
            d.attrs["units"] = "m"
            d.attrs["scale"] = np.arange(3)
    with h5py.File(p, "r") as f:
        order = list(f["g"])
    assert order == ["zz", "aa", "mm"]
    _check_reads(p, A + 2, dataset="g/aa")
    _write_rows(p, [0], np.full((1, 4), -9.0, np.float32), dataset="g/aa")
    with h5py.File(p, "r") as f:
        assert list(f["g"]) == order
        assert f.attrs["created_by"] == "me"
        d = f["g/aa"]
        assert d.attrs["units"] == "m"
        _same(d.attrs["scale"], np.arange(3))
        assert float(d[0, 0]) == -9.0
        _same(f["g/zz"][()], A + 2)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, placement="cpu")
    for name in ("g/zz", "g/aa", "g/mm"):
        assert name in str(ei.value)


def test_hdf5_bool_and_float16(tmp_path):
    h5py = _h5py()
    p = tmp_path / "bf.h5"
    b = np.array([[True, False, True], [False, False, True], [True, True, True]])
    h = np.array([[0.5, 6e-8], [65504, -2], [np.nan, -0.0]], np.float16)
    with h5py.File(p, "w") as f:
        f.create_dataset("b", data=b, chunks=(2, 3))
        f.create_dataset("h", data=h, chunks=(1, 2), compression="gzip")
    _check_reads(p, b, dataset="b")
    _check_reads(p, h, dataset="h")
    _write_rows(p, [2], np.array([[False, True, False]]), dataset="b")
    _write_rows(p, [1], np.array([[1.5, -0.0]], np.float16), dataset="h")
    b[2] = [False, True, False]
    h[1] = [1.5, -0.0]
    with h5py.File(p, "r") as f:
        assert f["b"].dtype == np.bool_
        _same(f["b"][()], b)
        assert f["h"].dtype == np.float16
        _same(f["h"][()], h)


def test_hdf5_userblock_and_unknown_extension(tmp_path):
    h5py = _h5py()
    for ub in (512, 1024):
        p = tmp_path / f"ub{ub}.h5"
        with h5py.File(p, "w", userblock_size=ub) as f:
            f.create_dataset("x", data=A)  # contiguous: read-only tables map it
        with open(p, "r+b") as fh:
            fh.write(b"a user block header")
        _check_reads(p, A)
        q = tmp_path / f"ub{ub}.bin"
        os.replace(p, q)
        _check_reads(q, A)  # format from the content, signature at 512 / 1024
        _write_rows(q, [6], np.full((1, 4), 0.25, np.float32))
        exp = A.copy()
        exp[6] = 0.25
        with h5py.File(q, "r") as f:
            _same(f["x"][()], exp)
        with open(q, "rb") as fh:
            assert fh.read(19) == b"a user block header"


def test_hdf5_virtual_dataset_is_read_only(tmp_path):
    h5py = _h5py()
    srcs = []
    for i in range(2):
        s = tmp_path / f"src{i}.h5"
        with h5py.File(s, "w") as f:
            f.create_dataset("d", data=A[i * 5 : (i + 1) * 5])
        srcs.append(s)
    lay = h5py.VirtualLayout(shape=(10, 4), dtype="f4")
    for i, s in enumerate(srcs):
        lay[i * 5 : (i + 1) * 5] = h5py.VirtualSource(str(s), "d", shape=(5, 4))
    p = tmp_path / "vds.h5"
    with h5py.File(p, "w") as f:
        f.create_virtual_dataset("v", lay, fillvalue=-9)
    _check_reads(p, A)
    before = srcs[0].read_bytes()
    with (
        gl.DataGadget(p, placement="file") as g,
        pytest.raises(gl.ReadOnlyError, match="(?i)virtual"),
    ):
        g.insertData(torch.zeros(1, 4), [0])
    assert srcs[0].read_bytes() == before
    os.replace(srcs[1], tmp_path / "moved.h5")
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError, match="src1.h5"):
            gl.DataGadget(p, placement=placement)


def test_hdf5_external_raw_storage(tmp_path):
    h5py = _h5py()
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"HEAD" + A.tobytes())
    p = tmp_path / "er.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", shape=A.shape, dtype="f4", external=[(str(raw), 4, A.nbytes)])
    _check_reads(p, A)
    with gl.DataGadget(p, placement="file") as g, pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.zeros(1, 4), [0])
    assert raw.read_bytes() == b"HEAD" + A.tobytes()
    with open(raw, "r+b") as fh:
        fh.truncate(4 + A.nbytes - 8)
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError, match="raw.bin"):
            gl.DataGadget(p, placement=placement)


def test_hdf5_file_held_open_read_only_by_h5py(tmp_path):
    """A notebook holds the file open in h5py ('r') and then writes through a file table:
    whatever happens must be a GadgetError naming the file, with the file unchanged."""
    h5py = _h5py()
    p = tmp_path / "held.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=A)
    f = h5py.File(p, "r")
    wrote = False
    try:
        try:
            with gl.DataGadget(p, placement="file") as g:
                _same(g.getNumpyVersion(), A)
                g.insertData(torch.zeros(1, 4), [0])
                wrote = True
        except gl.GadgetError as e:
            assert str(p) in str(e), str(e)
        _same(f["x"][()], np.vstack([np.zeros((1, 4), np.float32), A[1:]]) if wrote else A)
    finally:
        f.close()


# =========================================================================== zarr


def _zarr_build(kind, path):
    """Build the array ``kind`` at ``path`` with zarr itself; return (expected, dataset)."""
    zarr = _zarr()
    from zarr import codecs as zc

    a = A
    ds = None
    try:
        if kind == "v3":
            z = zarr.create_array(str(path), shape=a.shape, chunks=(3, 4), dtype="f4")
        elif kind == "v2":
            z = zarr.create_array(
                str(path), shape=a.shape, chunks=(3, 4), dtype="f4", zarr_format=2
            )
        elif kind == "v2-slash":
            z = zarr.create_array(
                str(path),
                shape=a.shape,
                chunks=(3, 2),
                dtype="f4",
                zarr_format=2,
                chunk_key_encoding={"name": "v2", "separator": "/"},
            )
        elif kind == "v3-dot-keys":
            z = zarr.create_array(
                str(path),
                shape=a.shape,
                chunks=(3, 2),
                dtype="f4",
                chunk_key_encoding={"name": "default", "separator": "."},
            )
        elif kind == "blosc":
            z = zarr.create_array(
                str(path),
                shape=a.shape,
                chunks=(3, 4),
                dtype="f4",
                compressors=zc.BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"),
            )
        elif kind == "zstd":
            z = zarr.create_array(
                str(path),
                shape=a.shape,
                chunks=(3, 4),
                dtype="f4",
                compressors=zc.ZstdCodec(level=3),
            )
        elif kind == "gzip":
            z = zarr.create_array(
                str(path),
                shape=a.shape,
                chunks=(3, 4),
                dtype="f4",
                compressors=zc.GzipCodec(level=6),
            )
        elif kind == "raw":
            z = zarr.create_array(
                str(path), shape=a.shape, chunks=(3, 4), dtype="f4", compressors=None
            )
        elif kind == "crc32c":
            z = zarr.create_array(
                str(path),
                shape=a.shape,
                chunks=(3, 4),
                dtype="f4",
                compressors=[zc.ZstdCodec(), zc.Crc32cCodec()],
            )
        elif kind in ("v2-blosc", "v2-gzip", "v2-delta"):
            numcodecs = pytest.importorskip("numcodecs")
            extra = {
                "v2-blosc": dict(compressors=numcodecs.Blosc(cname="zstd")),
                "v2-gzip": dict(compressors=numcodecs.GZip(5)),
                "v2-delta": dict(
                    filters=[numcodecs.Delta(dtype="f4")], compressors=numcodecs.Zlib(3)
                ),
            }[kind]
            z = zarr.create_array(
                str(path), shape=a.shape, chunks=(3, 2), dtype="f4", zarr_format=2, **extra
            )
        elif kind == "chunks-split-rows":
            z = zarr.create_array(str(path), shape=a.shape, chunks=(3, 1), dtype="f4")
        elif kind == "chunks-larger-than-table":
            z = zarr.create_array(str(path), shape=a.shape, chunks=(100, 8), dtype="f4")
        elif kind == "sharded":
            z = zarr.create_array(
                str(path), shape=a.shape, chunks=(2, 2), shards=(4, 4), dtype="f4"
            )
        elif kind == "sharded-index-start":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                z = zarr.create_array(
                    str(path),
                    shape=a.shape,
                    chunks=(6, 4),
                    dtype="f4",
                    compressors=None,
                    serializer=zc.ShardingCodec(
                        chunk_shape=(2, 2),
                        codecs=[zc.BytesCodec(), zc.ZstdCodec()],
                        index_location="start",
                    ),
                )
        elif kind == "sharded-v3-larger-than-table":
            z = zarr.create_array(
                str(path), shape=a.shape, chunks=(4, 4), shards=(16, 4), dtype="f4"
            )
        elif kind == "big-endian-v3":
            z = zarr.create_array(str(path), shape=a.shape, chunks=(3, 4), dtype=">f4")
        elif kind == "big-endian-v2":
            z = zarr.create_array(
                str(path), shape=a.shape, chunks=(3, 4), dtype=">f4", zarr_format=2
            )
        elif kind == "v2-order-F":
            z = zarr.create_array(
                str(path), shape=a.shape, chunks=(3, 4), dtype="f4", zarr_format=2, order="F"
            )
        elif kind == "transpose-codec":
            z = zarr.create_array(
                str(path),
                shape=a.shape,
                chunks=(3, 4),
                dtype="f4",
                filters=[zc.TransposeCodec(order=(1, 0))],
            )
        elif kind == "3d-int16":
            a = np.arange(60, dtype=np.int16).reshape(5, 3, 4) - 30
            z = zarr.create_array(str(path), shape=a.shape, chunks=(2, 2, 3), dtype="i2")
        elif kind == "1d-int64":
            a = np.arange(7, dtype=np.int64) * 2**33
            z = zarr.create_array(str(path), shape=a.shape, chunks=(3,), dtype="i8")
        elif kind == "group":
            g = zarr.open_group(str(path), mode="w")
            z = g.create_array("sub/arr", shape=a.shape, chunks=(4, 4), dtype="f4")
            g.create_array("other", shape=(3,), dtype="i4")[...] = 1
            ds = "sub/arr"
        elif kind == "v2-group-slash":
            g = zarr.open_group(str(path), mode="w", zarr_format=2)
            z = g.create_array(
                "emb",
                shape=a.shape,
                chunks=(4, 3),
                dtype="f4",
                chunk_key_encoding={"name": "v2", "separator": "/"},
            )
            ds = "emb"
        else:  # pragma: no cover
            raise AssertionError(kind)
        z[...] = a
    except (TypeError, ValueError, ImportError, AttributeError, NotImplementedError) as e:
        pytest.skip(f"this zarr cannot build {kind}: {e}")
    return a, ds


ZARR_KINDS = [
    "v3",
    "v2",
    "v2-slash",
    "v3-dot-keys",
    "blosc",
    "zstd",
    "gzip",
    "raw",
    "crc32c",
    "v2-blosc",
    "v2-gzip",
    "v2-delta",
    "chunks-split-rows",
    "chunks-larger-than-table",
    "sharded",
    "sharded-index-start",
    "sharded-v3-larger-than-table",
    "big-endian-v3",
    "big-endian-v2",
    "v2-order-F",
    "transpose-codec",
    "3d-int16",
    "1d-int64",
    "group",
    "v2-group-slash",
]


@pytest.mark.parametrize("kind", ZARR_KINDS)
def test_zarr_layouts_and_codecs(tmp_path, kind):
    p = tmp_path / "t.zarr"
    a, ds = _zarr_build(kind, p)
    ref = _zarr_read(p, ds)
    _same(ref, a)
    meta = _zarr_meta(p, ds)
    _check_reads(p, ref, dataset=ds)
    n = ref.shape[0]
    rows = _rows_for(ref, 2, seed=11)
    _write_rows(p, [n - 1, 1], rows, dataset=ds)
    exp = _native(ref).copy()
    exp[[n - 1, 1]] = rows
    _same(_zarr_read(p, ds), exp)
    assert _zarr_meta(p, ds) == meta, "the array's metadata changed"
    if ref.ndim >= 2 and ref.shape[1] >= 3:
        # a write of part of rows (chunks may split the rows): the rest of each row stays
        part = _rows_for(exp[:2, 1:3], 2, seed=12)
        _write_rows(p, ([4, 0], slice(1, 3)), part, dataset=ds)
        exp[[4, 0], 1:3] = part
        _same(_zarr_read(p, ds), exp)


def test_zarr_group_other_arrays_untouched_and_names_listed(tmp_path):
    zarr = _zarr()
    p = tmp_path / "g.zarr"
    g = zarr.open_group(str(p), mode="w")
    g.create_array("a/b/c", shape=A.shape, chunks=(3, 4), dtype="f4")[...] = A
    other = g.create_array("labels", shape=(10,), chunks=(4,), dtype="i8")
    other[...] = np.arange(10)
    _write_rows(p, [3], np.zeros((1, 4), np.float32), dataset="a/b/c")
    _same(_zarr_read(p, "labels"), np.arange(10))
    for bad in ("a/b", "nope"):
        with pytest.raises(gl.GadgetKeyError) as ei:
            gl.DataGadget(p, placement="file", dataset=bad)
        assert "a/b/c" in str(ei.value) and "labels" in str(ei.value), str(ei.value)
    with pytest.raises(gl.GadgetKeyError, match="a/b/c"):
        gl.DataGadget(p, placement="cpu")
    _check_reads(p, np.arange(10), dataset="labels")


@pytest.mark.parametrize("fill", [-2.0, float("nan")], ids=["minus2", "nan"])
@pytest.mark.parametrize("sharded", [False, True], ids=["chunks", "shards"])
def test_zarr_missing_chunks_read_as_fill_value(tmp_path, fill, sharded):
    zarr = _zarr()
    p = tmp_path / "m.zarr"
    kw = dict(chunks=(2, 2), shards=(4, 4)) if sharded else dict(chunks=(2, 4))
    try:
        z = zarr.create_array(str(p), shape=A.shape, dtype="f4", fill_value=fill, **kw)
    except TypeError as e:
        pytest.skip(f"this zarr has no shards=: {e}")
    z[0:2] = A[0:2]
    z[6, 0:2] = A[6, 0:2]  # a shard / chunk partly written
    ref = _zarr_read(p)
    assert np.isnan(ref[4]).all() if fill != fill else (ref[4] == fill).all()
    _check_reads(p, ref)
    _write_rows(p, [5], np.ones((1, 4), np.float32))  # into a missing chunk / shard
    _write_rows(p, ([7], slice(2, 4)), np.full((1, 2), 3.0, np.float32))
    exp = ref.copy()
    exp[5] = 1
    exp[7, 2:4] = 3
    _same(_zarr_read(p), exp)


def test_zarr_v2_fill_value_none(tmp_path):
    zarr = _zarr()
    p = tmp_path / "n.zarr"
    z = zarr.create_array(
        str(p), shape=A.shape, chunks=(3, 4), dtype="f4", zarr_format=2, fill_value=None
    )
    z[0:3] = A[0:3]
    ref = _zarr_read(p)
    _check_reads(p, ref)


def test_zarr_resized_arrays(tmp_path):
    zarr = _zarr()
    p = tmp_path / "rs.zarr"
    z = zarr.create_array(str(p), shape=A.shape, chunks=(4, 4), dtype="f4", fill_value=-1)
    z[...] = A
    z.resize((5, 4))
    z.resize((12, 4))
    ref = _zarr_read(p)
    assert ref.shape == (12, 4)
    _check_reads(p, ref)
    _write_rows(p, [11, 6], np.full((2, 4), 5.0, np.float32))
    exp = ref.copy()
    exp[[11, 6]] = 5
    _same(_zarr_read(p), exp)


def test_zarr_consolidated_group(tmp_path):
    zarr = _zarr()
    p = tmp_path / "c.zarr"
    g = zarr.open_group(str(p), mode="w")
    g.create_array("emb", shape=A.shape, chunks=(3, 4), dtype="f4")[...] = A
    g.create_array("lab", shape=(10,), chunks=(5,), dtype="i4")[...] = np.arange(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr's own note on consolidated metadata
        zarr.consolidate_metadata(str(p))
    _check_reads(p, A, dataset="emb")
    _write_rows(p, [0], np.zeros((1, 4), np.float32), dataset="emb")
    exp = A.copy()
    exp[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(zarr.open_group(str(p), mode="r")["emb"][...], exp)


@pytest.mark.parametrize("what", ["scalar", "zero-rows", "structured", "string", "uint16"])
def test_zarr_non_tables_refused(tmp_path, what):
    zarr = _zarr()
    p = tmp_path / "bad.zarr"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if what == "scalar":
                zarr.create_array(str(p), shape=(), dtype="f4")[...] = 3
            elif what == "zero-rows":
                zarr.create_array(str(p), shape=(0, 4), chunks=(2, 4), dtype="f4")
            elif what == "structured":
                zarr.create_array(
                    str(p), shape=(3,), dtype=[("a", "<f4"), ("b", "<i4")], zarr_format=2
                )
            elif what == "string":
                zarr.create_array(str(p), shape=(3,), dtype=str)[...] = np.array(["a", "bb", "c"])
            else:
                zarr.create_array(str(p), shape=(3, 2), chunks=(2, 2), dtype="u2")[...] = [
                    [0, 65535],
                    [1, 2],
                    [3, 4],
                ]
    except (TypeError, ValueError, NotImplementedError) as e:
        pytest.skip(f"this zarr cannot build {what}: {e}")
    err = gl.GadgetValueError if what in ("scalar", "zero-rows") else gl.GadgetTypeError
    for placement in ("cpu", "file"):
        with pytest.raises(err) as ei:
            gl.DataGadget(p, placement=placement)
        assert "bad.zarr" in str(ei.value), str(ei.value)
    if what == "uint16":
        with gl.DataGadget(p, placement="cpu", dtype="int32") as g:
            _same(g.getNumpyVersion(), np.array([[0, 65535], [1, 2], [3, 4]], np.int32))


# =========================================================================== all formats


def _three_exotic_files(tmp_path):
    """A Fortran big-endian .npy, a gzip dataset deep in an HDF5 file beside another one,
    and a sharded zarr array with a missing shard -- all holding the same rows."""
    h5py = _h5py()
    zarr = _zarr()
    n = 23
    x = np.arange(n * 3, dtype=np.float64).reshape(n, 3) * 0.5
    npy = tmp_path / "x.npy"
    np.save(npy, np.asfortranarray(x.astype(">f8")))
    h5 = tmp_path / "x.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("deep/in/here", data=x, chunks=(5, 3), compression="gzip", shuffle=True)
        f.create_dataset("labels", data=np.arange(n))
    zp = tmp_path / "x.zarr"
    try:
        z = zarr.create_array(
            str(zp), shape=x.shape, chunks=(2, 3), shards=(6, 3), dtype="f8", fill_value=0.0
        )
    except TypeError as e:
        pytest.skip(f"this zarr has no shards=: {e}")
    z[:18] = x[:18]
    xz = x.copy()
    xz[18:] = 0.0
    return npy, h5, zp, x, xz


def test_gadget_dataset_columns_from_exotic_files(tmp_path):
    npy, h5, zp, x, xz = _three_exotic_files(tmp_path)
    n = len(x)
    labels = np.arange(n) * 10
    for placement in ("cpu", "file"):
        cols = [
            npy,
            gl.DataGadget(h5, dataset="deep/in/here", placement=placement),
            zp,
            labels,
        ]
        ds = gl.GadgetDataset(*cols, placement=placement, device="cpu")
        assert len(ds) == n
        assert [c.placement for c in ds.columns][:3] == [placement] * 3
        ids = [22, 0, 5, 5, 17, 18]
        a, b, c, lab = ds[ids]
        _same(_np(a), x[ids])
        _same(_np(b), x[ids])
        _same(_np(c), xz[ids])
        _same(_np(lab), labels[ids])
        # a DataLoader pass (chunk order for file columns) sees every row once, all columns agreeing
        seen = []
        order = "chunk" if placement == "file" else "random"
        sampler = gl.GadgetSampler(ds, batch_size=4, order=order, seed=3)
        for a, b, c, lab in torch.utils.data.DataLoader(ds, batch_sampler=sampler):
            rows = _np(lab) // 10
            _same(_np(a), x[rows])
            _same(_np(b), x[rows])
            _same(_np(c), xz[rows])
            seen.extend(rows.tolist())
        assert sorted(seen) == list(range(n))


def test_gadget_dataset_paths_with_dataset_option(tmp_path):
    h5py = _h5py()
    p = tmp_path / "d.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("a/b/c", data=A, chunks=(64, 4), maxshape=(None, 4), compression="lzf")
        f.create_dataset("a/lab", data=np.arange(10))
    for placement in (None, "cpu", "file"):
        ds = gl.GadgetDataset(
            p, np.arange(10) * 2, dataset="a/b/c", placement=placement, device="cpu"
        )
        x, y = ds[[9, 0, 9]]
        _same(_np(x), A[[9, 0, 9]])
        _same(_np(y), np.array([18, 0, 18]))
        batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
        _same(_np(batch[0]), A[:4])
    with pytest.raises(gl.GadgetKeyError, match="a/b/c"):
        gl.GadgetDataset(p, device="cpu")


def test_load_and_loadcupy_from_exotic_files(tmp_path):
    npy, h5, zp, x, xz = _three_exotic_files(tmp_path)
    g = gl.DataGadget((2, 3), dtype="float64", placement="cpu")
    g.load(h5, dataset="deep/in/here")
    assert g.placement == "cpu" and tuple(g.shape) == x.shape
    _same(g.getNumpyVersion(), x)
    g.load(zp)
    _same(g.getNumpyVersion(), xz)
    g.loadCupy(npy)
    _same(g.getNumpyVersion(), x)
    # a refused load leaves the table as it was
    with pytest.raises(gl.GadgetKeyError):
        g.load(h5)  # two datasets, no name
    with pytest.raises(gl.GadgetKeyError):
        g.load(h5, dataset="deep/in")
    _same(g.getNumpyVersion(), x)
    # a file table follows load() onto the new file
    f = gl.DataGadget(npy, placement="file")
    f.load(zp)
    assert f.placement == "file"
    _same(_np(f.getData([20, 1])), xz[[20, 1]])
    f.insertData(torch.full((1, 3), 7.0, dtype=torch.float64), [20])
    f.close()
    exp = xz.copy()
    exp[20] = 7
    _same(_zarr_read(zp), exp)
    _same(np.load(npy), x)


def test_pickled_file_tables_reopen_the_same_array(tmp_path):
    """README: "a `file` gadget pickles as its file name; each DataLoader worker reopens the
    file itself" -- with the dataset, the forced format and the options it was opened with."""
    h5py = _h5py()
    npy, h5, zp, x, xz = _three_exotic_files(tmp_path)
    odd = tmp_path / "odd_name.npy"  # an HDF5 file under a .npy name: format= forced
    with h5py.File(odd, "w") as f:
        f.create_dataset("a/b/c", data=x, chunks=(4, 3), compression="gzip")
        f.create_dataset("other", data=x[:2])
    tables = [
        (gl.DataGadget(npy, placement="file"), x),
        (
            gl.DataGadget(
                h5, placement="file", dataset="deep/in/here", block_rows=3, cache_bytes=0
            ),
            x,
        ),
        (gl.DataGadget(zp, placement="file"), xz),
        (gl.DataGadget(odd, placement="file", format="hdf5", dataset="a/b/c", writable=False), x),
    ]
    for g, exp in tables:
        with g:
            g2 = pickle.loads(pickle.dumps(g))
            with g2:
                assert g2.placement == "file" and tuple(g2.shape) == exp.shape
                _same(g2.getNumpyVersion(), exp)
                _same(_np(g2.getData([22, 3])), exp[[22, 3]])
    before = odd.read_bytes()
    g = gl.DataGadget(odd, placement="file", format="hdf5", dataset="a/b/c", writable=False)
    g2 = pickle.loads(pickle.dumps(g))
    g.close()
    with g2, pytest.raises(gl.ReadOnlyError):
        g2.insertData(torch.zeros(1, 3, dtype=torch.float64), [0])
    assert odd.read_bytes() == before


def test_refused_writes_leave_exotic_files_unchanged(tmp_path):
    h5py = _h5py()
    zarr = _zarr()
    be = tmp_path / "be.npy"
    np.save(be, A.astype(">f4"))
    h5 = tmp_path / "g.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("x", data=A, chunks=(3, 1), compression="gzip", shuffle=True)
    zs = tmp_path / "s.zarr"
    try:
        zarr.create_array(str(zs), shape=A.shape, chunks=(2, 2), shards=(4, 4), dtype="f4")[...] = A
    except TypeError:
        zarr.create_array(str(zs), shape=A.shape, chunks=(2, 2), dtype="f4")[...] = A
    z2 = tmp_path / "v2.zarr"
    _zarr_build("v2-slash", z2)
    for p in (be, h5, zs, z2):
        before = _tree_bytes(p)
        with gl.DataGadget(p, placement="file") as g:
            with pytest.raises(gl.GadgetTypeError) as ei:
                g.insertData(torch.zeros(2, 4, dtype=torch.float64), [0, 9])
            assert "float64" in str(ei.value) and "float32" in str(ei.value)
            with pytest.raises(gl.GadgetValueError):
                g.insertData(torch.zeros(2, 3), [0, 9])
            with pytest.raises(gl.GadgetIndexError):
                g.insertData(torch.zeros(2, 4), [0, 10])
            with pytest.raises(gl.GadgetIndexError):
                g.insertData(torch.zeros(2, 4), [-1, 3])
            with pytest.raises(gl.GadgetTypeError):
                g.insertData(torch.zeros(2, 4), torch.tensor([0.0, 1.0]))
            _same(g.getNumpyVersion(), A)
        assert _tree_bytes(p) == before, f"a refused write changed {p.name}"


def test_repeated_ids_last_wins_in_compressed_files(tmp_path):
    h5py = _h5py()
    zarr = _zarr()
    h5 = tmp_path / "r.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("x", data=A, chunks=(4, 2), compression="lzf")
    zp = tmp_path / "r.zarr"
    try:
        zarr.create_array(str(zp), shape=A.shape, chunks=(2, 2), shards=(4, 4), dtype="f4")[...] = A
    except TypeError:
        zarr.create_array(str(zp), shape=A.shape, chunks=(2, 2), dtype="f4")[...] = A
    rows = np.arange(16, dtype=np.float32).reshape(4, 4) + 100
    ids = [3, 8, 3, 3]
    exp = A.copy()
    for i, r in zip(ids, rows, strict=False):
        exp[i] = r  # NumPy's sequential assignment: the last occurrence wins
    _write_rows(h5, ids, rows)
    _write_rows(zp, ids, rows)
    with h5py.File(h5, "r") as f:
        _same(f["x"][()], exp)
    _same(_zarr_read(zp), exp)


# =========================================================================== convert


def test_convert_exotic_sources(tmp_path):
    """Three conversions (each `gadgetloader convert` process costs seconds of imports)."""
    h5py = _h5py()
    zarr = _zarr()
    # a version 3.0 header, Fortran-ordered, big-endian .npy -> HDF5 (lzf, 3-row chunks)
    src = tmp_path / "fbe3.npy"
    with open(src, "wb") as f:
        np.lib.format.write_array(f, np.asfortranarray(A.astype(">f8")), version=(3, 0))
    rc, out, err = _convert(src, tmp_path / "a.h5", "--chunk-rows", "3", "--compression", "lzf")
    assert rc == 0, err
    with h5py.File(tmp_path / "a.h5", "r") as f:
        (name,) = list(f)
        d = f[name]
        assert d.chunks[0] == 3 and d.compression == "lzf"
        _same(d[()], A.astype(np.float64))
    # a filtered dataset deep in an HDF5 file beside another -> a zarr group, under a new name
    nest = tmp_path / "nest.h5"
    with h5py.File(nest, "w") as f:
        f.create_dataset(
            "a/b/c", data=A, chunks=(3, 4), compression="gzip", shuffle=True, fletcher32=True
        )
        f.create_dataset("o", data=A[:2])
    rc, out, err = _convert(
        nest,
        tmp_path / "b.zarr",
        "--dataset",
        "a/b/c",
        "--dst-dataset",
        "x/y",
        "--compression",
        "blosc",
    )
    assert rc == 0, err
    _same(_zarr_read(tmp_path / "b.zarr", "x/y"), A)
    # a sharded zarr with missing chunks -> .npy: missing rows are the fill value, as zarr reads
    sh = tmp_path / "sh.zarr"
    try:
        z = zarr.create_array(
            str(sh), shape=A.shape, chunks=(2, 2), shards=(4, 4), dtype="f4", fill_value=-1.0
        )
    except TypeError:
        z = zarr.create_array(str(sh), shape=A.shape, chunks=(2, 2), dtype="f4", fill_value=-1.0)
    z[0:3] = A[0:3]
    rc, out, err = _convert(sh, tmp_path / "c.npy")
    assert rc == 0, err
    _same(np.load(tmp_path / "c.npy"), _zarr_read(sh))


def test_convert_refuses_non_tables_with_one_line(tmp_path):
    h5py = _h5py()
    st = tmp_path / "rec.npy"
    np.save(st, np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")]))
    sc = tmp_path / "sc.h5"
    with h5py.File(sc, "w") as f:
        f.create_dataset("s", data=1.0)
        f.create_dataset("t", data=A)
    cases = [
        ((st, tmp_path / "o1.h5"), "rec.npy"),
        ((sc, tmp_path / "o3.npy", "--dataset", "s"), "sc.h5"),
    ]
    for args, needle in cases:
        rc, out, err = _convert(*args)
        assert rc == 1, (args, rc, out, err)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0], (args, err)
        assert "Traceback" not in err
        assert not os.path.exists(args[1]), f"{args[1]} was written"
