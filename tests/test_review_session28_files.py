"""Session 28 black-box review: file-backed tables (.npy, HDF5, zarr) and their errors.

Written from README.md ("Files: .npy, HDF5 and zarr", "Errors", "Rows in and out"),
shared/SPEC.md and the public docstrings only. Every value is compared with what
numpy / h5py / zarr read from the same file. Tables stay small; everything lives
under pytest's ``tmp_path``.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import resource
import shutil
import signal
import struct
import subprocess
import sys
import warnings
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

EXTS = ["npy", "h5", "zarr"]
CPU = {"device": "cpu"}


# ----------------------------------------------------------------------------- helpers


def _write(path: pathlib.Path, arr: np.ndarray, *, chunks: int | None = None, **kw: Any) -> None:
    """Write ``arr`` with the format's own library (dataset 'e' for HDF5)."""
    if path.suffix == ".npy":
        np.save(path, arr)
    elif path.suffix in (".h5", ".hdf5", ".hdf"):
        with h5py.File(path, "w") as f:
            if chunks:
                f.create_dataset("e", data=arr, chunks=(chunks,) + arr.shape[1:], **kw)
            else:
                f.create_dataset("e", data=arr, **kw)
    else:
        c = (chunks or max(1, len(arr))) if arr.ndim else ()
        z = zarr.create_array(
            str(path),
            overwrite=True,
            shape=arr.shape,
            chunks=(c,) + arr.shape[1:],
            dtype=arr.dtype,
            **kw,
        )
        z[...] = arr


def _read(path: pathlib.Path, dataset: str | None = None) -> np.ndarray:
    """Read a file back with numpy / h5py / zarr (not with gadgetloader)."""
    if path.suffix == ".npy" or dataset == "#npy":
        return np.load(path)
    if path.suffix in (".h5", ".hdf5", ".hdf"):
        with h5py.File(path, "r") as f:
            if dataset is None:
                names: list[str] = []
                f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
                assert len(names) == 1, names
                dataset = names[0]
            return f[dataset][...]
    node = zarr.open(str(path), mode="r")
    if dataset is not None:
        node = node[dataset]
    return node[...]


def _snapshot(path: pathlib.Path) -> dict[str, bytes]:
    """Every byte of a file, or of every file in a directory (zarr store)."""
    if path.is_file():
        return {"": path.read_bytes()}
    out = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = pathlib.Path(root) / name
            out[str(p.relative_to(path))] = p.read_bytes()
    return out


def _open_fds_and_maps(path: pathlib.Path) -> tuple[int, int]:
    """(descriptors, memory maps) of this process that refer to ``path``."""
    p = str(path)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(p):
                n += 1
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if p in line)
    return n, maps


def _h5_writable_by_another_process(path: pathlib.Path) -> bool:
    code = f"import h5py; h5py.File({str(path)!r}, 'a').close()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    return r.returncode == 0


def _damage_zarr_chunk(store: pathlib.Path, k: int) -> None:
    p = store / "c" / str(k) / "0"
    p.write_bytes(p.read_bytes()[:-4])


def _expect(exc_info: pytest.ExceptionInfo[BaseException], *parts: str) -> None:
    msg = str(exc_info.value)
    for part in parts:
        assert part in msg, (part, msg)


@pytest.fixture
def table() -> np.ndarray:
    return np.arange(40, dtype=np.float32).reshape(10, 4)


@pytest.fixture
def files(tmp_path: pathlib.Path, table: np.ndarray) -> dict[str, pathlib.Path]:
    """The same (10, 4) float32 table as .npy, chunked HDF5 and zarr (chunks of 2 rows)."""
    out = {}
    for ext in EXTS:
        p = tmp_path / f"t.{ext}"
        _write(p, table, chunks=None if ext == "npy" else 2)
        out[ext] = p
    return out


# ------------------------------------------------------------------ missing / broken files


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("kind", [str, pathlib.Path])
def test_missing_file_is_file_not_found_naming_it(tmp_path, ext, placement, kind):
    path = tmp_path / "sub" / f"missing.{ext}"
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.DataGadget(kind(path), placement=placement, **CPU)
    assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, gl.GadgetError)
    _expect(ei, str(path))


@pytest.mark.parametrize("cut", [1, 4, 39, 160])
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_truncated_npy_is_a_file_error_naming_file_and_sizes(tmp_path, table, cut, placement):
    good = tmp_path / "good.npy"
    np.save(good, table)
    raw = good.read_bytes()
    bad = tmp_path / "cut.npy"
    bad.write_bytes(raw[:-cut])
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(bad, placement=placement, **CPU)
    assert isinstance(ei.value, OSError)
    # names the file, what the header promises and what is there
    _expect(ei, str(bad), str(len(raw)), str(len(raw) - cut))
    assert bad.read_bytes() == raw[:-cut]  # a read never "repairs" the file


@pytest.mark.parametrize("keep", [0, 5, 9, 40])
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_npy_cut_inside_its_header_is_a_file_error(tmp_path, table, keep, placement):
    good = tmp_path / "good.npy"
    np.save(good, table)
    bad = tmp_path / "cut.npy"
    bad.write_bytes(good.read_bytes()[:keep])
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(bad, placement=placement, **CPU)
    _expect(ei, str(bad))


def _npy_with_header(path: pathlib.Path, header: str, data: bytes) -> pathlib.Path:
    h = header + " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + data)
    return path


@pytest.mark.parametrize(
    "header",
    [
        "{'descr': 'zz9', 'fortran_order': False, 'shape': (10, 4), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (-10, 4), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': 'x', }",
        "{'descr': '<f4', 'fortran_order': 'no', 'shape': (10, 4), }",
        "{'descr': '<f4', 'shape': (10, 4), }",
        "[1, 2, 3]",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (10, 4)",
    ],
)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_corrupt_npy_header_is_a_file_error_naming_the_file(tmp_path, table, header, placement):
    bad = _npy_with_header(tmp_path / "bad.npy", header, table.tobytes())
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(bad, placement=placement, **CPU)
    _expect(ei, str(bad))


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_npy_header_is_never_executed(tmp_path, table, placement):
    marker = tmp_path / "PWNED"
    header = f"__import__('os').system('touch {marker}')"
    bad = _npy_with_header(tmp_path / "evil.npy", header, table.tobytes())
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(bad, placement=placement, **CPU)
    assert not marker.exists()


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_format_versions_read_and_write_at_the_right_offset(tmp_path, version, placement):
    a = np.arange(30, dtype=np.int16).reshape(10, 3)
    p = tmp_path / "v.npy"
    with open(p, "wb") as f:
        np.lib.format.write_array(f, a, version=version)
    g = gl.DataGadget(p, placement=placement, **CPU)
    assert np.array_equal(g.getNumpyVersion(), a)
    g.insertData(np.full((2, 3), -5, np.int16), [9, 0])
    g.close()
    expect = a.copy()
    expect[[9, 0]] = -5
    assert np.array_equal(np.load(p), expect if placement == "file" else a)


def test_npy_with_a_legacy_16_byte_aligned_header(tmp_path):
    """numpy < 1.9 padded headers to 16 bytes: the data starts at byte 80, not 128."""
    a = np.arange(30, dtype=np.int16).reshape(10, 3)
    hdr = "{'descr': '<i2', 'fortran_order': False, 'shape': (10, 3), }"
    pad = (16 - (10 + len(hdr) + 1) % 16) % 16
    h = hdr + " " * pad + "\n"
    assert (10 + len(h)) % 64 != 0
    p = tmp_path / "legacy.npy"
    p.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + a.tobytes())
    assert np.array_equal(np.load(p), a)
    assert np.array_equal(gl.DataGadget(p, placement="cpu").getNumpyVersion(), a)
    g = gl.DataGadget(p, placement="file", **CPU)
    assert np.array_equal(g.getData([3, 7]).numpy(), a[[3, 7]])
    g.insertData(np.full((2, 3), 7, np.int16), [0, 5])
    g.close()
    expect = a.copy()
    expect[[0, 5]] = 7
    assert np.array_equal(np.load(p), expect)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_hdf5_wrong_dataset_name_lists_the_nested_datasets(tmp_path, table, placement):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f["emb/words"] = table
        f["emb/ctx"] = table[:, :2]
        f["labels"] = np.arange(10)
        f.create_group("empty")
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, dataset="emb/nope", placement=placement, **CPU)
    assert isinstance(ei.value, KeyError)
    _expect(ei, str(p), "emb/nope", "emb/words", "emb/ctx", "labels")
    # without dataset= and several datasets: the choice is listed too
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, placement=placement, **CPU)
    _expect(ei, "emb/words", "emb/ctx", "labels")
    g = gl.DataGadget(p, dataset="emb/ctx", placement=placement, **CPU)
    with h5py.File(p) as f:
        assert np.array_equal(g.getNumpyVersion(), f["emb/ctx"][...])


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_hdf5_single_nested_dataset_needs_no_name(tmp_path, table, placement):
    p = tmp_path / "one.h5"
    with h5py.File(p, "w") as f:
        f["g/h/e"] = table
    g = gl.DataGadget(p, placement=placement, **CPU)
    assert np.array_equal(g.getNumpyVersion(), table)


def test_hdf5_without_datasets_and_non_numeric_datasets_are_clear(tmp_path):
    empty = tmp_path / "empty.h5"
    with h5py.File(empty, "w"):
        pass
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(empty, placement="cpu")
    _expect(ei, str(empty))
    p = tmp_path / "odd.h5"
    with h5py.File(p, "w") as f:
        f["s"] = np.array([b"ab", b"cd"])
        f["c"] = np.zeros(3, dtype=[("a", "i4"), ("b", "f4")])
        f["sc"] = 3.0
        f["u"] = np.arange(4, dtype=np.uint16)
    for name, exc in [
        ("s", gl.GadgetTypeError),
        ("c", gl.GadgetTypeError),
        ("sc", gl.GadgetValueError),
        ("u", gl.GadgetTypeError),
    ]:
        with pytest.raises(exc) as ei:
            gl.DataGadget(p, dataset=name, placement="file")
        _expect(ei, str(p))


def test_not_an_hdf5_file_is_a_file_error(tmp_path, table):
    p = tmp_path / "fake.h5"
    p.write_text("this is not hdf5 at all")
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(p, placement="cpu")
    _expect(ei, str(p))
    npy = tmp_path / "real.npy"
    np.save(npy, table)
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(npy, format="hdf5", placement="cpu")


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_zarr_group_wrong_name_lists_arrays(tmp_path, table, placement):
    p = tmp_path / "g.zarr"
    grp = zarr.open_group(str(p), mode="w")
    grp.create_array("x", shape=table.shape, dtype="float32")[...] = table
    grp.create_array("y", shape=(10,), dtype="int64")[...] = np.arange(10)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, dataset="q", placement=placement, **CPU)
    _expect(ei, str(p), "'q'", "x", "y")
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, placement=placement, **CPU)
    _expect(ei, "x", "y")
    g = gl.DataGadget(p, dataset="y", placement=placement, **CPU)
    assert np.array_equal(g.getData([3, 4]).numpy(), [3, 4])


def test_zarr_damaged_chunk_names_store_and_chunk(tmp_path, table):
    p = tmp_path / "d.zarr"
    _write(p, table, chunks=2)
    _damage_zarr_chunk(p, 2)
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(p, placement="cpu")
    _expect(ei, str(p), "chunk 2")
    g = gl.DataGadget(p, placement="file", **CPU)
    assert np.array_equal(g.getData([0, 9]).numpy(), table[[0, 9]])  # other chunks still read
    with pytest.raises(gl.GadgetFileError) as ei:
        g.getData([5])
    _expect(ei, "chunk 2")


def test_zarr_damaged_chunk_refuses_a_partial_write_and_leaves_the_store(tmp_path, table):
    p = tmp_path / "d.zarr"
    _write(p, table, chunks=2)
    _damage_zarr_chunk(p, 3)
    before = _snapshot(p)
    g = gl.DataGadget(p, placement="file", **CPU)
    # row 0 (a good chunk) and row 6 (half of the damaged chunk): nothing may be written
    with pytest.raises(gl.GadgetFileError):
        g.insertData(np.full((2, 4), -1, np.float32), [0, 6])
    g.close()
    assert _snapshot(p) == before


def test_zarr_missing_chunk_reads_as_zarrs_fill_value(tmp_path, table):
    p = tmp_path / "m.zarr"
    _write(p, table, chunks=2, fill_value=-3.0)
    os.remove(p / "c" / "2" / "0")
    ref = zarr.open_array(str(p))[...]
    assert np.all(ref[4:6] == -3.0)
    for placement in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=placement, **CPU)
        assert np.array_equal(g.getNumpyVersion(), ref)
    g = gl.DataGadget(p, placement="file", **CPU)
    g.insertData(np.full((1, 4), 9, np.float32), [5])
    g.close()
    ref[5] = 9
    assert np.array_equal(zarr.open_array(str(p))[...], ref)


def test_zarr_metadata_with_a_wider_dtype_than_its_chunks_is_a_file_error(tmp_path, table):
    p = tmp_path / "lie.zarr"
    _write(p, table, chunks=2, compressors=None)
    meta = json.loads((p / "zarr.json").read_text())
    meta["data_type"] = "float64"
    (p / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(p, placement="cpu")
    _expect(ei, str(p))
    g = gl.DataGadget(p, placement="file", **CPU)
    with pytest.raises(gl.GadgetFileError):
        g.getData([0])


@pytest.mark.parametrize(
    "dtype,exc",
    [("uint16", gl.GadgetTypeError), ("complex64", gl.GadgetTypeError), (str, gl.GadgetTypeError)],
)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_zarr_unsupported_dtypes_are_type_errors_naming_the_store(tmp_path, dtype, exc, placement):
    p = tmp_path / "u.zarr"
    zarr.create_array(str(p), shape=(4,), chunks=(2,), dtype=dtype)
    with pytest.raises(exc) as ei:
        gl.DataGadget(p, placement=placement)
    _expect(ei, str(p))


def test_zarr_corrupt_metadata_and_plain_directories(tmp_path, table):
    p = tmp_path / "j.zarr"
    _write(p, table, chunks=2)
    (p / "zarr.json").write_text("{not json")
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(p, placement="file")
    _expect(ei, str(p))
    d = tmp_path / "plain.zarr"
    d.mkdir()
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(d, placement="cpu")
    _expect(ei, str(d))


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_file_dtype_argument_must_match_the_file(files, placement):
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(files["h5"], dtype="float64", placement=placement)
    _expect(ei, "float32", "float64")


def test_uint32_file_converts_with_dtype_only_into_memory(tmp_path):
    p = tmp_path / "counts.npy"
    a = np.array([0, 1, 2**31 + 5, 16777217], np.uint32)
    np.save(p, a)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="cpu")
    g = gl.DataGadget(p, dtype="int64", placement="cpu")
    assert g.dtype == torch.int64
    assert np.array_equal(g.getNumpyVersion(), a.astype(np.int64))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, dtype="int64", placement="file")


# ------------------------------------------------------- bad rows and ids: nothing written


BAD_WRITES = [
    (
        "float64 tensor",
        lambda: (torch.ones(2, 4, dtype=torch.float64), [0, 1]),
        gl.GadgetTypeError,
        ("float32", "float64"),
    ),
    (
        "float64 array",
        lambda: (np.ones((2, 4)), [0, 1]),
        gl.GadgetTypeError,
        ("float32", "float64"),
    ),
    (
        "float16 array",
        lambda: (np.ones((2, 4), np.float16), [0, 1]),
        gl.GadgetTypeError,
        ("float32", "float16"),
    ),
    (
        "too many rows",
        lambda: (torch.ones(3, 4), [0, 1]),
        gl.GadgetValueError,
        ("(2, 4)", "(3, 4)"),
    ),
    (
        "wrong row shape",
        lambda: (torch.ones(2, 5), [0, 1]),
        gl.GadgetValueError,
        ("(2, 4)", "(2, 5)"),
    ),
    ("out of range id", lambda: (torch.ones(2, 4), [0, 10]), gl.GadgetIndexError, ("10",)),
    ("negative id", lambda: (torch.ones(2, 4), [3, -1]), gl.GadgetIndexError, ("-1",)),
    ("huge id", lambda: (torch.ones(1, 4), np.array([2**40])), gl.GadgetIndexError, (str(2**40),)),
    (
        "float tensor ids",
        lambda: (torch.ones(2, 4), torch.tensor([0.0, 1.0])),
        gl.GadgetTypeError,
        ("float",),
    ),
    (
        "float array ids",
        lambda: (torch.ones(2, 4), np.array([0.0, 1.0])),
        gl.GadgetTypeError,
        ("float64",),
    ),
    ("float list ids", lambda: (torch.ones(2, 4), [0.0, 1.0]), gl.GadgetTypeError, ("float",)),
    (
        "bool mask ids",
        lambda: (torch.ones(2, 4), torch.tensor([True, False] * 5)),
        gl.GadgetTypeError,
        ("bool",),
    ),
    ("not an array", lambda: (5, 1), gl.GadgetTypeError, ("int",)),
]


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("case", BAD_WRITES, ids=[c[0] for c in BAD_WRITES])
def test_bad_insert_raises_before_writing_anything(files, table, ext, placement, case):
    _name, make, exc, parts = case
    before = _snapshot(files[ext])
    g = gl.DataGadget(files[ext], placement=placement, **CPU)
    data, ids = make()
    with pytest.raises(exc) as ei:
        g.insertData(data, ids)
    assert isinstance(ei.value, gl.GadgetError)
    _expect(ei, *parts)
    assert np.array_equal(g.getNumpyVersion(), table)
    g.close()
    assert _snapshot(files[ext]) == before
    assert np.array_equal(_read(files[ext]), table)


BAD_READS = [
    ("out of range", [11], gl.GadgetIndexError, ("11", "10 rows")),
    ("negative", [-1], gl.GadgetIndexError, ("-1", "10 rows")),
    ("negative int", -1, gl.GadgetIndexError, ("-1", "10 rows")),
    ("mixed", [0, 3, 10], gl.GadgetIndexError, ("10", "10 rows")),
    ("float array", np.array([1.0]), gl.GadgetTypeError, ("float64",)),
    ("float tensor", torch.tensor([1.0]), gl.GadgetTypeError, ("float32",)),
    ("float scalar", 2.0, gl.GadgetTypeError, ("float",)),
    ("bool list", [True, False], gl.GadgetTypeError, ("bool",)),
    ("strings", ["1"], gl.GadgetTypeError, ("integers",)),
    ("None", None, gl.GadgetTypeError, ("NoneType",)),
    ("uint64 too large", np.array([2**63], np.uint64), gl.GadgetIndexError, ("2**63",)),
]


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize("case", BAD_READS, ids=[c[0] for c in BAD_READS])
def test_bad_ids_in_a_file_table_gather_are_gadget_errors(files, ext, case):
    _name, ids, exc, parts = case
    g = gl.DataGadget(files[ext], placement="file", **CPU)
    with pytest.raises(exc) as ei:
        g.getData(ids)
    assert isinstance(ei.value, gl.GadgetError)
    _expect(ei, *parts)  # says what arrived and what was expected


@pytest.mark.parametrize("ext", EXTS)
def test_bad_ids_in_a_partial_row_write_leave_the_file(files, table, ext):
    before = _snapshot(files[ext])
    g = gl.DataGadget(files[ext], placement="file", **CPU)
    with pytest.raises(gl.GadgetIndexError):
        g[[1, 12], 0:2] = np.zeros((2, 2), np.float32)
    with pytest.raises(gl.GadgetTypeError):
        g[[1, 2], 0:2] = np.zeros((2, 2), np.float64)
    with pytest.raises(gl.GadgetValueError):
        g[[1, 2], 0:2] = np.zeros((2, 3), np.float32)
    g.close()
    assert _snapshot(files[ext]) == before


@pytest.mark.parametrize("ext", EXTS)
def test_read_only_file_table_refuses_writes_and_leaves_the_file(files, table, ext):
    before = _snapshot(files[ext])
    g = gl.DataGadget(files[ext], placement="file", writable=False, **CPU)
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.zeros(1, 4), [0])
    assert np.array_equal(g.getData([0, 9]).numpy(), table[[0, 9]])
    g.close()
    assert _snapshot(files[ext]) == before


# --------------------------------------------------------- reads and writes match numpy


@pytest.mark.parametrize("ext", ["npy", "h5", "h5gzip", "zarr"])
@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.uint8, np.bool_, np.int8, np.float64])
def test_file_table_random_reads_and_writes_match_numpy_and_the_file(tmp_path, ext, dtype):
    rng = np.random.default_rng(hash((ext, np.dtype(dtype).str)) % 2**32)
    a = (rng.standard_normal((50, 3, 2)) * 10).astype(dtype)
    p = tmp_path / f"t.{'h5' if ext == 'h5gzip' else ext}"
    kw = {"compression": "gzip"} if ext == "h5gzip" else {}
    _write(p, a, chunks=None if ext == "npy" else 8, **kw)
    g = gl.DataGadget(p, placement="file", cache_bytes=256, **CPU)
    assert g.dtype == torch.from_numpy(a[:1]).dtype and g.shape == a.shape
    ref = a.copy()
    for it in range(4):
        ids = rng.integers(0, 50, size=int(rng.integers(1, 20)))
        rows = (rng.standard_normal((len(ids), 3, 2)) * 10).astype(dtype)
        if it % 2:
            rows = np.asfortranarray(rows)
        g.insertData(rows, ids)
        for i, r in zip(ids, rows, strict=True):  # NumPy's sequential assignment: last wins
            ref[i] = r
        ids2 = rng.integers(0, 50, size=(3, 4))
        got = g.getData(ids2)
        assert got.shape == (3, 4, 3, 2)
        assert np.array_equal(got.numpy(), ref[ids2])
    g[[1, 4, 1], 0:2, 1] = np.ones((3, 2), dtype)
    ref[[1, 4], 0:2, 1] = 1
    assert np.array_equal(g.getNumpyVersion(), ref)
    g.flush()
    assert np.array_equal(_read(p), ref)  # each write reached the file
    g.close()
    disk = _read(p)
    assert disk.dtype == a.dtype and np.array_equal(disk, ref)


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize(
    "layout", ["fortran", "strided", "negative", "broadcast", "transposed", "readonly", "unaligned"]
)
def test_odd_numpy_and_torch_layouts_write_the_right_rows(tmp_path, table, ext, layout):
    base = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    if layout == "fortran":
        data: Any = np.asfortranarray(base[:3, :4])
    elif layout == "strided":
        data = base[::2, ::2][:3]
    elif layout == "negative":
        data = base[::-1, ::-1][:3, :4]
    elif layout == "broadcast":
        data = np.broadcast_to(base[0, :4], (3, 4))
    elif layout == "transposed":
        data = torch.from_numpy(base.copy()).t()[:3, :4]
    elif layout == "readonly":
        data = base[:3, :4].copy()
        data.setflags(write=False)
    else:
        buf = bytearray(b"\x00" + base[:3, :4].tobytes())
        data = np.ndarray((3, 4), np.float32, buffer=buf, offset=1)
    values = data.numpy() if isinstance(data, torch.Tensor) else np.array(data)
    p = tmp_path / f"t.{ext}"
    _write(p, table, chunks=None if ext == "npy" else 2)
    ids = [7, 2, 5]
    g = gl.DataGadget(p, placement="file", **CPU)
    g.insertData(data, ids)
    g.close()
    expect = table.copy()
    expect[ids] = values
    assert np.array_equal(_read(p), expect)


@pytest.mark.parametrize("ext", ["h5", "zarr"])
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_big_endian_hdf5_and_zarr_read_and_write_values(tmp_path, table, ext, placement):
    p = tmp_path / f"be.{ext}"
    if ext == "h5":
        with h5py.File(p, "w") as f:
            f.create_dataset("e", data=table.astype(">f4"), chunks=(2, 4))
    else:
        z = zarr.create_array(
            str(p),
            shape=table.shape,
            chunks=(2, 4),
            dtype="float32",
            serializer=zarr.codecs.BytesCodec(endian="big"),
        )
        z[...] = table
    g = gl.DataGadget(p, placement=placement, **CPU)
    assert g.dtype == torch.float32
    assert np.array_equal(g.getNumpyVersion(), table)
    g.insertData(np.full((1, 4), 100, "<f4"), [2])
    g.insertData(np.full((1, 4), 200, ">f4"), [0])
    expect = table.copy()
    expect[2], expect[0] = 100, 200
    assert np.array_equal(g.getNumpyVersion(), expect)
    g.close()
    assert np.array_equal(_read(p), expect if placement == "file" else table)


@pytest.mark.parametrize("ext", EXTS)
def test_file_table_results_are_copies_not_views_of_the_file(files, table, ext):
    g = gl.DataGadget(files[ext], placement="file", **CPU)
    got = [g.getData(slice(0, 3)), g.getData(1), g[0:3], g.getData([1, 2]), np.asarray(g)]
    g.insertData(torch.full((3, 4), -1.0), [0, 1, 2])
    g.close()
    assert torch.equal(got[0], torch.from_numpy(table[0:3]))
    assert torch.equal(got[1], torch.from_numpy(table[1]))
    assert torch.equal(got[2], torch.from_numpy(table[0:3]))
    assert torch.equal(got[3], torch.from_numpy(table[[1, 2]]))
    assert np.array_equal(got[4], table)


@pytest.mark.parametrize("ext", EXTS)
def test_empty_ids_and_scalar_ids_on_file_tables(files, table, ext):
    g = gl.DataGadget(files[ext], placement="file", **CPU)
    assert g.getData([]).shape == (0, 4)
    assert g.getData(np.zeros((2, 0), np.int64)).shape == (2, 0, 4)
    g.insertData(np.zeros((0, 4), np.float32), [])
    assert torch.equal(g.getData(np.int64(3)), torch.from_numpy(table[3]))
    assert torch.equal(g.getData(np.array(3)), torch.from_numpy(table[3]))
    assert torch.equal(g.getData(slice(-2, None)), torch.from_numpy(table[-2:]))
    g.close()
    assert np.array_equal(_read(files[ext]), table)


# ------------------------------------------------------------------------- round trips


ROUND_TRIP_DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.bool_,
]


def _sample(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
        a.flat[0], a.flat[-1] = info.min, info.max
        return a
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    special = np.array(
        [np.nan, np.inf, -np.inf, -0.0, np.finfo(dtype).tiny, np.finfo(dtype).max], dtype
    )
    a.flat[: len(special)] = special
    return a


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(7, 3), (1, 5), (6,), (4, 3, 2), (1,)], ids=str)
def test_save_then_load_is_bit_exact(tmp_path, ext, dtype, shape):
    a = _sample(dtype, shape)
    p = tmp_path / f"r.{ext}"
    gl.DataGadget(a, placement="cpu").save(p)
    disk = _read(p)
    assert disk.dtype == a.dtype and disk.shape == a.shape
    assert disk.tobytes() == a.tobytes()
    for placement in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=placement, **CPU)
        assert g.shape == a.shape and g.getNumpyVersion().dtype == a.dtype
        assert g.getNumpyVersion().tobytes() == a.tobytes()
        g.close()


@pytest.mark.parametrize("src", EXTS)
@pytest.mark.parametrize("dst", EXTS)
def test_file_table_saves_its_written_rows_to_every_format(tmp_path, table, src, dst):
    sp = tmp_path / f"s.{src}"
    _write(sp, table, chunks=None if src == "npy" else 3)
    g = gl.DataGadget(sp, placement="file", **CPU)
    g.insertData(np.full((2, 4), -7, np.float32), [9, 4])
    dp = tmp_path / f"d.{dst}"
    g.save(dp, **({} if dst == "npy" else {"chunk_rows": 4}))
    expect = table.copy()
    expect[[9, 4]] = -7
    assert np.array_equal(_read(dp), expect)
    assert np.array_equal(g.getData([4, 9]).numpy(), expect[[4, 9]])  # still usable


@pytest.mark.parametrize("ext", EXTS)
def test_file_table_saved_over_itself_keeps_its_writes(tmp_path, table, ext):
    p = tmp_path / f"self.{ext}"
    _write(p, table, chunks=None if ext == "npy" else 2)
    g = gl.DataGadget(p, placement="file", **CPU)
    g.insertData(np.full((1, 4), 5, np.float32), [3])
    g.save(p)
    expect = table.copy()
    expect[3] = 5
    assert np.array_equal(_read(p), expect)
    assert np.array_equal(g.getNumpyVersion(), expect)
    assert sorted(os.listdir(tmp_path)) == [p.name]


@pytest.mark.parametrize("ext", ["h5", "zarr"])
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_bfloat16_round_trips_as_uint16_bits_with_an_attribute(tmp_path, ext, placement):
    t = (torch.randn(5, 3) * 1000).to(torch.bfloat16)
    t[0, 0], t[0, 1] = float("inf"), float("-0.0")
    g = gl.DataGadget(t, placement="cpu")
    p = tmp_path / f"b.{ext}"
    g.save(p)
    disk = _read(p)
    assert disk.dtype == np.uint16
    assert np.array_equal(disk, t.view(torch.int16).numpy().view(np.uint16))
    if ext == "h5":
        with h5py.File(p) as f:
            (name,) = list(f)
            assert len(f[name].attrs) >= 1
    else:
        assert len(dict(zarr.open_array(str(p)).attrs)) >= 1
    h = gl.DataGadget(p, placement=placement, **CPU)
    assert h.dtype == torch.bfloat16
    assert torch.equal(h.getData(range(5)).view(torch.int16), t.view(torch.int16))


def test_bfloat16_has_no_npy_form_and_the_old_file_stays(tmp_path):
    p = tmp_path / "b.npy"
    np.save(p, np.arange(3))
    before = p.read_bytes()
    g = gl.DataGadget(torch.ones(2, 2, dtype=torch.bfloat16), placement="cpu")
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.save(p)
    _expect(ei, "bfloat16")
    with pytest.raises(gl.GadgetTypeError):
        g.saveCupy(tmp_path / "b")
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["b.npy"]


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize("source", ["fortran", "noncontig", "tensor_t"])
def test_non_contiguous_sources_save_in_logical_order(tmp_path, ext, source):
    base = np.arange(48, dtype=np.int64).reshape(6, 8)
    if source == "fortran":
        src: Any = np.asfortranarray(base)
        expect = base
    elif source == "noncontig":
        src = base[::2, 1::3]
        expect = base[::2, 1::3]
    else:
        src = torch.from_numpy(base.copy()).t()
        expect = base.T
    p = tmp_path / f"n.{ext}"
    gl.DataGadget(src, placement="cpu").save(p)
    assert np.array_equal(_read(p), expect)
    g = gl.DataGadget(p, placement="file", **CPU)
    assert np.array_equal(g.getData([0, len(expect) - 1]).numpy(), expect[[0, -1]])


def test_fortran_npy_loads_right_and_is_read_only_as_a_file_table(tmp_path):
    a = np.asfortranarray(np.arange(12, dtype=np.int64).reshape(4, 3))
    p = tmp_path / "f.npy"
    np.save(p, a)
    assert np.array_equal(gl.DataGadget(p, placement="cpu").getNumpyVersion(), a)
    g = gl.DataGadget(p, placement="file", **CPU)
    assert np.array_equal(g.getData([1, 3]).numpy(), a[[1, 3]])
    before = p.read_bytes()
    with pytest.raises(gl.ReadOnlyError) as ei:
        g.insertData(np.zeros((1, 3), np.int64), [0])
    _expect(ei, str(p))
    assert p.read_bytes() == before


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_save_with_a_nested_dataset_name(tmp_path, table, ext):
    p = tmp_path / f"n.{ext}"
    gl.DataGadget(table, placement="cpu").save(p, dataset="emb/words")
    assert np.array_equal(_read(p, "emb/words"), table)
    for kw in [{}, {"dataset": "emb/words"}]:
        g = gl.DataGadget(p, placement="file", **kw, **CPU)
        assert np.array_equal(g.getNumpyVersion(), table)
        g.close()
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(p, dataset="emb/other", placement="cpu")
    _expect(ei, "emb/words")


def test_save_forced_format_and_content_detection(tmp_path, table):
    g = gl.DataGadget(table, placement="cpu")
    with pytest.raises(gl.GadgetValueError) as ei:
        g.save(tmp_path / "o.txt")
    _expect(ei, "o.txt", ".npy")
    assert not (tmp_path / "o.txt").exists()
    for fmt in ["npy", "hdf5"]:
        p = tmp_path / f"o_{fmt}.bin"
        g.save(p, format=fmt)
        assert np.array_equal(gl.DataGadget(p, placement="cpu").getNumpyVersion(), table)
    assert np.array_equal(np.load(tmp_path / "o_npy.bin"), table)


def test_savecupy_appends_npy_and_loadcupy_reads_it(tmp_path, table):
    g = gl.DataGadget(table, placement="cpu")
    g.saveCupy(tmp_path / "emb")
    g.saveCupy(str(tmp_path / "emb2.npy"))
    assert sorted(os.listdir(tmp_path)) == ["emb.npy", "emb2.npy"]
    assert np.array_equal(np.load(tmp_path / "emb.npy"), table)
    h = gl.DataGadget((2, 2), dtype="float32", placement="cpu")
    h.loadCupy(tmp_path / "emb.npy")
    assert h.shape == table.shape and np.array_equal(h.getNumpyVersion(), table)


# ---------------------------------------------------------- failing saves keep the old file


def _old_targets(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    old = np.full((3, 2), 7, np.int64)
    out = {}
    for ext in EXTS:
        p = tmp_path / f"target.{ext}"
        _write(p, old)
        out[ext] = p
    return out


def _assert_old_intact(targets, snaps, tmp_path, entries):
    for ext, p in targets.items():
        assert _snapshot(p) == snaps[ext], ext
        assert np.array_equal(_read(p), np.full((3, 2), 7, np.int64))
    assert sorted(os.listdir(tmp_path)) == entries  # no partial files or directories


@pytest.mark.parametrize("ext", EXTS)
def test_save_failing_on_a_damaged_source_keeps_the_old_target(tmp_path, ext):
    targets = _old_targets(tmp_path)
    snaps = {e: _snapshot(p) for e, p in targets.items()}
    src = tmp_path / "src.zarr"
    _write(src, np.arange(400, dtype=np.float32).reshape(100, 4), chunks=10)
    _damage_zarr_chunk(src, 5)
    entries = sorted(os.listdir(tmp_path))
    g = gl.DataGadget(src, placement="file", **CPU)
    with pytest.raises(gl.GadgetFileError) as ei:
        g.save(targets[ext])
    _expect(ei, str(src))
    _assert_old_intact(targets, snaps, tmp_path, entries)


@pytest.mark.parametrize("ext", EXTS)
def test_save_over_itself_failing_part_way_keeps_the_source(tmp_path, ext):
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    p = tmp_path / f"self.{ext}"
    if ext == "zarr":
        _write(p, a, chunks=10)
        _damage_zarr_chunk(p, 7)
    elif ext == "h5":
        _write(p, a, chunks=10, compression="gzip")
        with h5py.File(p) as f:
            info = f["e"].id.get_chunk_info(5)
        with open(p, "r+b") as f:
            f.seek(info.byte_offset)
            f.write(b"\x00" * info.size)
    else:
        np.save(p, a)
    before = _snapshot(p)
    g = gl.DataGadget(p, placement="file", cache_bytes=0, **CPU)
    if ext == "npy":  # shrink the source under the table
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size - 100)
        before = _snapshot(p)
    with pytest.raises(gl.GadgetFileError) as ei:
        g.save(p)
    _expect(ei, str(p))
    assert _snapshot(p) == before
    assert sorted(os.listdir(tmp_path)) == [p.name]


@pytest.mark.parametrize("ext", EXTS)
def test_save_whose_rename_fails_keeps_the_old_target(tmp_path, ext):
    targets = _old_targets(tmp_path)
    snaps = {e: _snapshot(p) for e, p in targets.items()}
    entries = sorted(os.listdir(tmp_path))
    g = gl.DataGadget(np.arange(40, dtype=np.float32).reshape(10, 4), placement="cpu")
    boom = OSError(5, "simulated I/O error")
    with (
        mock.patch("os.replace", side_effect=boom),
        mock.patch("os.rename", side_effect=boom),
        pytest.raises(OSError) as ei,
    ):
        g.save(targets[ext])
    if ext != "zarr":  # README: "(else GadgetFileError) and keeps the old file"
        assert isinstance(ei.value, gl.GadgetFileError)
        _expect(ei, str(targets[ext]))
    _assert_old_intact(targets, snaps, tmp_path, entries)


class _FileSizeLimit:
    """Make every write past ``limit`` bytes of one file fail with EFBIG (a full disk, as
    far as the writer can tell), without touching the file system."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> None:
        self.sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))

    def __exit__(self, *exc: Any) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
        signal.signal(signal.SIGXFSZ, self.sig)


SAVE_OPTS = {
    "npy": {},
    "h5": {},
    "h5_chunked_gzip": {"chunk_rows": 64, "compression": "gzip"},
    "zarr": {"chunk_rows": 4096, "compression": "none"},
}


@pytest.mark.parametrize("case", list(SAVE_OPTS))
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_save_failing_mid_write_keeps_the_old_file_and_leaves_no_partial(tmp_path, case, placement):
    ext = case.split("_")[0]
    targets = _old_targets(tmp_path)
    snaps = {e: _snapshot(p) for e, p in targets.items()}
    a = np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32)  # 1 MiB
    if placement == "file":
        np.save(tmp_path / "src.npy", a)
        g = gl.DataGadget(tmp_path / "src.npy", placement="file", **CPU)
    else:
        g = gl.DataGadget(a, placement="cpu")
    entries = sorted(os.listdir(tmp_path))
    with _FileSizeLimit(64 << 10), pytest.raises(OSError):
        g.save(targets[ext], **SAVE_OPTS[case])
    _assert_old_intact(targets, snaps, tmp_path, entries)
    g.save(targets[ext], **SAVE_OPTS[case])  # and the next save, with room, works
    assert np.array_equal(_read(targets[ext]), a)


@pytest.mark.parametrize(
    "ext",
    [
        "npy",
        "h5",
    ],
)
def test_save_write_failure_is_a_gadget_file_error_naming_the_target(tmp_path, ext):
    """README, Errors: "Every error derives from gl.GadgetError and the matching builtin";
    the project's standard: an error says what was expected and names the file."""
    targets = _old_targets(tmp_path)
    g = gl.DataGadget(np.zeros((4096, 64), np.float32), placement="cpu")
    with _FileSizeLimit(64 << 10), pytest.raises(OSError) as ei:
        g.save(targets[ext])
    assert isinstance(ei.value, gl.GadgetFileError)
    _expect(ei, str(targets[ext]))


@pytest.mark.parametrize(
    "ext,opts,exc",
    [
        ("h5", {"compression": "zstd"}, gl.GadgetKeyError),
        ("zarr", {"compression": "lzf"}, gl.GadgetKeyError),
        ("npy", {"chunk_rows": 4}, gl.GadgetTypeError),
        ("npy", {"dataset": "x"}, gl.GadgetTypeError),
        ("h5", {"chunk_rows": 0}, gl.GadgetValueError),
        ("zarr", {"compression_level": 99}, gl.GadgetValueError),
        ("h5", {"bogus": 1}, gl.GadgetTypeError),
        ("h5", {"dataset": "../up"}, gl.GadgetValueError),
        ("zarr", {"dataset": "a/./b"}, gl.GadgetValueError),
        ("h5", {"dataset": 3}, gl.GadgetTypeError),
    ],
)
def test_bad_save_options_are_refused_before_touching_the_target(tmp_path, ext, opts, exc):
    targets = _old_targets(tmp_path)
    snaps = {e: _snapshot(p) for e, p in targets.items()}
    entries = sorted(os.listdir(tmp_path))
    g = gl.DataGadget(np.ones((5, 2), np.float32), placement="cpu")
    with pytest.raises(exc):
        g.save(targets[ext], **opts)
    _assert_old_intact(targets, snaps, tmp_path, entries)


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_save_with_a_bad_progress_flag_leaves_nothing_behind(tmp_path, ext, placement):
    """README: `progress` is True/False or 1/0, "a string such as "False" is a
    GadgetTypeError"; a refused call must leave the disk as it was (only a *killed*
    save leaves a hidden partial file, "delete it by hand")."""
    targets = _old_targets(tmp_path)
    snaps = {e: _snapshot(p) for e, p in targets.items()}
    np.save(tmp_path / "src.npy", np.ones((5, 2), np.float32))
    entries = sorted(os.listdir(tmp_path))
    if placement == "file":
        g = gl.DataGadget(tmp_path / "src.npy", placement="file", **CPU)
    else:
        g = gl.DataGadget(np.ones((5, 2), np.float32), placement="cpu")
    msg = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            g.save(targets[ext], progress="False")
        except gl.GadgetTypeError as e:
            msg = str(e)
        gc.collect()
    assert msg is not None and "progress" in msg
    snaps_after = {e: _snapshot(p) for e, p in targets.items()}
    assert snaps_after == snaps
    assert sorted(os.listdir(tmp_path)) == entries


@pytest.mark.parametrize("ext", EXTS)
def test_convert_with_a_bad_progress_flag_leaves_nothing_behind(tmp_path, ext):
    """The same flag of ``gadgetloader.convert.convert``: refused before any file is made."""
    from gadgetloader.convert import convert

    targets = _old_targets(tmp_path)
    snaps = {e: _snapshot(p) for e, p in targets.items()}
    np.save(tmp_path / "src.npy", np.ones((5, 2), np.float32))
    entries = sorted(os.listdir(tmp_path))
    with pytest.raises(gl.GadgetTypeError, match="progress"):
        convert(tmp_path / "src.npy", targets[ext], progress="yes")
    assert {e: _snapshot(p) for e, p in targets.items()} == snaps
    assert sorted(os.listdir(tmp_path)) == entries


@pytest.mark.parametrize("ext", EXTS)
def test_zero_row_table_is_not_saved_and_the_old_file_stays(tmp_path, ext):
    targets = _old_targets(tmp_path)
    snaps = {e: _snapshot(p) for e, p in targets.items()}
    entries = sorted(os.listdir(tmp_path))
    g = gl.DataGadget(np.ones((0, 3), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError) as ei:
        g.save(targets[ext])
    _expect(ei, str(targets[ext]), "zero rows")
    _assert_old_intact(targets, snaps, tmp_path, entries)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_zero_row_file_is_a_clear_error(tmp_path, placement):
    p = tmp_path / "zero.npy"
    np.save(p, np.ones((0, 3), np.float32))
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.DataGadget(p, placement=placement)
    _expect(ei, str(p))


@pytest.mark.parametrize("ext", EXTS)
def test_save_into_a_missing_directory_names_it(tmp_path, table, ext):
    p = tmp_path / "nodir" / f"x.{ext}"
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.DataGadget(table, placement="cpu").save(p)
    _expect(ei, str(tmp_path / "nodir"))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------- load() keeps a good table


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_failed_loads_leave_the_table_and_its_file_working(tmp_path, table, placement):
    mine = tmp_path / "mine.npy"
    np.save(mine, table * 2)
    g = gl.DataGadget(mine, placement=placement, **CPU)
    bad_zarr = tmp_path / "bad.zarr"
    _write(bad_zarr, table, chunks=2)
    _damage_zarr_chunk(bad_zarr, 1)
    two = tmp_path / "two.h5"
    with h5py.File(two, "w") as f:
        f["p/q"] = table
        f["p/r"] = table[:, :1]
    cut = tmp_path / "cut.npy"
    cut.write_bytes(mine.read_bytes()[:-3])
    failures = [
        (lambda: g.load(tmp_path / "missing.h5"), gl.GadgetFileNotFoundError),
        (lambda: g.load(two), gl.GadgetKeyError),
        (lambda: g.load(two, dataset="p/zz"), gl.GadgetKeyError),
        (lambda: g.load(cut), gl.GadgetFileError),
        (lambda: g.loadCupy(cut), gl.GadgetFileError),
    ]
    if placement == "cpu":  # a file table reads chunks only when asked
        failures.append((lambda: g.load(bad_zarr), gl.GadgetFileError))
    for call, exc in failures:
        with pytest.raises(exc):
            call()
        assert g.shape == table.shape
        assert np.array_equal(g.getNumpyVersion(), table * 2)
    g.load(two, dataset="p/r")
    assert g.shape == (10, 1) and np.array_equal(g.getNumpyVersion(), table[:, :1])
    assert np.array_equal(np.load(mine), table * 2)


# --------------------------------------------------------- replaced files and close()


@pytest.mark.parametrize("ext", EXTS)
def test_a_file_table_whose_file_is_replaced_by_a_save_refuses_to_mix_files(tmp_path, table, ext):
    p = tmp_path / f"t.{ext}"
    gl.DataGadget(table, placement="cpu").save(p)
    old = gl.DataGadget(p, placement="file", **CPU)
    assert np.array_equal(old.getData([1]).numpy(), table[[1]])
    gl.DataGadget(-table, placement="cpu").save(p)
    with pytest.raises(gl.GadgetFileError) as ei:
        old.getData([2])
    _expect(ei, str(p))
    with pytest.raises(gl.GadgetFileError):
        old.insertData(torch.zeros(1, 4), [3])
    old.close()
    assert np.array_equal(_read(p), -table)  # the refused write did not reach the new file


CLOSED_CALLS = {
    "getData": lambda g, d: g.getData([0]),
    "getitem": lambda g, d: g[0],
    "setitem": lambda g, d: g.__setitem__([0], torch.zeros(1, 4)),
    "insertData": lambda g, d: g.insertData(torch.zeros(1, 4), [0]),
    "getNumpyVersion": lambda g, d: g.getNumpyVersion(),
    "asarray": lambda g, d: np.asarray(g),
    "save": lambda g, d: g.save(d / "x.npy"),
    "saveCupy": lambda g, d: g.saveCupy(d / "y"),
    "load": lambda g, d: g.load(d / "t.npy"),
    "loadCupy": lambda g, d: g.loadCupy(d / "t.npy"),
    "flush": lambda g, d: g.flush(),
    "fill_": lambda g, d: g.fill_(1.0),
    "zero_": lambda g, d: g.zero_(),
    "gadgetInit": lambda g, d: g.gadgetInit(),
}


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_every_row_call_after_close_is_a_closed_error(files, table, ext, placement):
    g = gl.DataGadget(files[ext], placement=placement, **CPU)
    g.close()
    g.close()  # idempotent
    before = {e: _snapshot(p) for e, p in files.items()}
    d = files["npy"].parent
    entries = sorted(os.listdir(d))
    for name, call in CLOSED_CALLS.items():
        with pytest.raises(gl.GadgetClosedError):
            call(g, d)
        assert sorted(os.listdir(d)) == entries, name
    assert g.shape == table.shape and g.dtype == torch.float32 and len(g) == 10
    assert "closed" in repr(g)
    assert {e: _snapshot(p) for e, p in files.items()} == before


@pytest.mark.parametrize("ext", EXTS)
def test_close_releases_descriptors_and_maps_so_the_file_can_be_replaced(files, table, ext):
    p = files[ext]
    g = gl.DataGadget(p, placement="file", **CPU)
    g.getData([1, 9])
    g.insertData(torch.ones(1, 4), [7])
    g.close()
    assert _open_fds_and_maps(p) == (0, 0)
    expect = table.copy()
    expect[7] = 1
    assert np.array_equal(_read(p), expect)  # close() pushed the write
    # the path can be deleted and written anew by another library
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink()
    _write(p, table[:3], chunks=None if ext == "npy" else 1)
    assert np.array_equal(gl.DataGadget(p, placement="cpu").getNumpyVersion(), table[:3])


@pytest.mark.parametrize("how", ["close", "with", "gc", "dataset_close", "dataset_with"])
def test_hdf5_lock_is_released_after_the_table_goes(tmp_path, table, how):
    p = tmp_path / "lock.h5"
    _write(p, table, chunks=2)
    if how.startswith("dataset"):
        ds = gl.GadgetDataset(p, placement="file", device="cpu")
        g = ds.columns[0]
    else:
        g = gl.DataGadget(p, placement="file", **CPU)
    g.insertData(torch.ones(1, 4), [0])  # a writable HDF5 file table holds HDF5's lock
    assert not _h5_writable_by_another_process(p)
    if how == "close":
        g.close()
    elif how == "with":
        with g:
            pass
    elif how == "gc":
        del g
        gc.collect()
    elif how == "dataset_close":
        ds.close()
    else:
        with ds:
            pass
    if how != "gc":
        with pytest.raises(gl.GadgetClosedError):
            g.getData([0])
    assert _open_fds_and_maps(p) == (0, 0)
    assert _h5_writable_by_another_process(p)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: gl.DataGadget(p, placement="file", dataset="nope"),
        lambda p: gl.DataGadget(p, placement="file", dataset="u"),
        lambda p: gl.DataGadget(p, placement="file", dataset="e", dtype="float64"),
        lambda p: gl.DataGadget(p, placement="cpu", dataset="nope"),
        lambda p: gl.GadgetDataset(p, p.parent / "missing.npy", dataset="e", placement="file"),
    ],
    ids=["file-name", "file-dtype", "file-dtype-arg", "cpu-name", "dataset-missing-column"],
)
def test_a_failed_open_leaves_no_handle_on_the_hdf5_file(tmp_path, table, make):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f["e"] = table
        f["u"] = np.arange(10, dtype=np.uint16)
    with pytest.raises(gl.GadgetError):
        make(p)
    gc.collect()
    assert _open_fds_and_maps(p) == (0, 0)
    assert _h5_writable_by_another_process(p)


def test_dataset_close_spares_gadgets_passed_in(tmp_path, table):
    np.save(tmp_path / "x.npy", table)
    np.save(tmp_path / "y.npy", np.arange(10))
    mine = gl.DataGadget(tmp_path / "x.npy", placement="file", **CPU)
    ds = gl.GadgetDataset(mine, tmp_path / "y.npy", placement="file", device="cpu")
    created = ds.columns[1]
    ds.close()
    assert np.array_equal(mine.getData([2]).numpy(), table[[2]])
    with pytest.raises(gl.GadgetClosedError):
        created.getData([0])
    with pytest.raises(gl.GadgetClosedError):
        ds[[0]]


# ------------------------------------------------------------------------------ paths


class _PathLike:
    def __init__(self, p: pathlib.Path) -> None:
        self.p = p

    def __fspath__(self) -> str:
        return str(self.p)


@pytest.mark.parametrize("kind", [str, pathlib.Path, _PathLike], ids=["str", "Path", "PathLike"])
@pytest.mark.parametrize("ext", EXTS)
def test_every_file_call_takes_str_path_and_pathlike(tmp_path, table, kind, ext):
    g = gl.DataGadget(table, placement="cpu")
    p = tmp_path / f"p.{ext}"
    g.save(kind(p))
    assert np.array_equal(_read(p), table)
    f = gl.DataGadget(kind(p), placement="file", **CPU)
    assert np.array_equal(f.getNumpyVersion(), table)
    f.close()
    h = gl.DataGadget((1, 1), dtype="float32", placement="cpu")
    h.load(kind(p))
    assert np.array_equal(h.getNumpyVersion(), table)
    ds = gl.GadgetDataset(kind(p), placement="file", device="cpu")
    assert torch.equal(ds[[3]][0], torch.from_numpy(table[[3]]))
    ds.close()
    if ext == "npy":
        g.saveCupy(kind(tmp_path / "sc"))
        h.loadCupy(kind(tmp_path / "sc.npy"))
        assert np.array_equal(np.load(tmp_path / "sc.npy"), table)


def test_bytes_paths_are_type_errors_that_say_what_to_do(tmp_path, table):
    p = tmp_path / "b.npy"
    np.save(p, table)
    g = gl.DataGadget(table, placement="cpu")
    for call in [
        lambda: gl.DataGadget(bytes(p), placement="cpu"),
        lambda: g.save(bytes(p)),
        lambda: g.load(bytes(p)),
        lambda: g.saveCupy(bytes(p)),
        lambda: gl.GadgetDataset(bytes(p), placement="file"),
        lambda: g.save(None),
    ]:
        with pytest.raises(gl.GadgetTypeError) as ei:
            call()
        assert isinstance(ei.value, TypeError)
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.save(bytes(p))
    _expect(ei, "fsdecode")
    assert np.array_equal(np.load(p), table)


# ----------------------------------------------------------- GadgetDataset file columns


@pytest.mark.parametrize("fext", EXTS)
@pytest.mark.parametrize("lext", EXTS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_dataset_of_file_paths_matches_numpy(tmp_path, fext, lext, placement):
    x = np.random.default_rng(1).standard_normal((37, 3, 2)).astype(np.float32)
    y = (np.arange(37) % 5).astype(np.int64)
    xp, yp = tmp_path / f"x.{fext}", tmp_path / f"y.{lext}"
    _write(xp, x, chunks=None if fext == "npy" else 8)
    _write(yp, y, chunks=None if lext == "npy" else 6)
    ds = gl.GadgetDataset(str(xp), yp, placement=placement, device="cpu")
    assert len(ds) == 37
    assert [c.placement for c in ds.columns] == [placement, placement]
    ids = [36, 0, 5, 5, 17]
    bx, by = ds[ids]
    assert bx.shape == (5, 3, 2) and by.shape == (5,)  # labels: one value per row
    assert np.array_equal(bx.numpy(), x[ids]) and np.array_equal(by.numpy(), y[ids])
    sx, sy = ds[-1]
    assert np.array_equal(sx.numpy(), x[-1]) and int(sy) == y[-1]
    seen = []
    for bx, by in DataLoader(ds, batch_size=8, shuffle=True):
        rows = np.array([np.flatnonzero((x == r).all(axis=(1, 2)))[0] for r in bx.numpy()])
        assert np.array_equal(by.numpy(), y[rows])
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(37))
    with pytest.raises(gl.GadgetIndexError):
        ds[[37]]
    with pytest.raises(gl.GadgetIndexError):
        ds[[-1]]
    with pytest.raises(gl.GadgetTypeError):
        ds[np.array([1.0])]
    ds.close()


def test_dataset_file_columns_chunk_order_covers_every_row(tmp_path):
    x = np.arange(120 * 10, dtype=np.float32).reshape(120, 10)
    y = np.arange(120, dtype=np.int64)
    for hc, zc, expect in [(8, 12, 24), (8, 20, 40), (7, 20, 20), (12, 12, 12)]:
        _write(tmp_path / "x.h5", x, chunks=hc)
        _write(tmp_path / "y.zarr", y, chunks=zc)
        ds = gl.GadgetDataset(
            tmp_path / "x.h5", tmp_path / "y.zarr", placement="file", device="cpu"
        )
        assert ds.chunk_rows == expect
        seen = []
        for b in gl.GadgetSampler(ds, batch_size=16, order="chunk", seed=1):
            bx, by = ds[b]
            assert torch.equal(bx[:, 0].long() // 10, by) and torch.equal(by, torch.as_tensor(b))
            seen.append(by)
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(120))
        ds.close()


def test_dataset_path_errors_are_clear(tmp_path, table):
    np.save(tmp_path / "x.npy", table)
    np.save(tmp_path / "short.npy", np.arange(4))
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f["a"] = table
        f["b"] = np.arange(10)
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.GadgetDataset(tmp_path / "x.npy", tmp_path / "nope.npy", placement="file")
    _expect(ei, "nope.npy")
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetDataset(tmp_path / "x.npy", tmp_path / "short.npy", placement="file")
    _expect(ei, "10", "4")
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.GadgetDataset(tmp_path / "two.h5", placement="file")
    _expect(ei, "'a'", "'b'")
    ds = gl.GadgetDataset(tmp_path / "two.h5", dataset="b", placement="file", device="cpu")
    assert np.array_equal(ds[[2, 3]][0].numpy(), [2, 3])
    ds.close()
    for name in ["x.npy", "short.npy"]:
        assert _open_fds_and_maps(tmp_path / name) == (0, 0)


def test_dataset_with_a_file_column_and_an_array_column(tmp_path, table):
    np.save(tmp_path / "x.npy", table)
    labels = np.arange(10, dtype=np.int64) * 3
    ds = gl.GadgetDataset(tmp_path / "x.npy", labels, placement="file", device="cpu")
    assert ds.columns[0].placement == "file" and ds.columns[1].placement != "file"
    bx, by = ds[[9, 1]]
    assert np.array_equal(bx.numpy(), table[[9, 1]]) and np.array_equal(by.numpy(), labels[[9, 1]])
    # a file column reloaded to another row count is refused
    np.save(tmp_path / "short.npy", table[:4])
    ds.columns[0].load(tmp_path / "short.npy")
    with pytest.raises(gl.GadgetValueError):
        ds[[0]]
    ds.close()


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_writes_to_one_array_leave_the_others_in_the_file(tmp_path, table, ext):
    p = tmp_path / f"two.{ext}"
    other = np.arange(10, dtype=np.int64) * 11
    if ext == "h5":
        with h5py.File(p, "w") as f:
            f.create_dataset("grp/x", data=table, chunks=(2, 4))
            f["y"] = other
    else:
        grp = zarr.open_group(str(p), mode="w")
        grp.create_array("grp/x", shape=table.shape, chunks=(2, 4), dtype="float32")[...] = table
        grp.create_array("y", shape=(10,), chunks=(5,), dtype="int64")[...] = other
    y_before = _snapshot(p / "y") if ext == "zarr" else None
    g = gl.DataGadget(p, dataset="grp/x", placement="file", **CPU)
    g.insertData(np.full((2, 4), -2, np.float32), [0, 9])
    g.close()
    expect = table.copy()
    expect[[0, 9]] = -2
    assert np.array_equal(_read(p, "grp/x"), expect)
    assert np.array_equal(_read(p, "y"), other)
    if ext == "zarr":
        assert _snapshot(p / "y") == y_before


@pytest.mark.parametrize("ext", EXTS)
def test_speedtorch_names_over_every_file_format(tmp_path, table, ext):
    p = tmp_path / f"st.{ext}"
    _write(p, table, chunks=None if ext == "npy" else 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)  # no CUDA here: cpu, said once
        pinned = gl.DataGadget(str(p), CPUPinn=True)
        gpu = gl.DataGadget(p)
    expected = {"pinned", "cpu"} if torch.cuda.is_available() else {"cpu"}
    assert pinned.placement in expected
    for g in (pinned, gpu):
        assert g.gadgetInit() is g
        assert np.array_equal(g.getNumpyVersion(), table)
        assert np.array_equal(g.getData([4, 1]).cpu().numpy(), table[[4, 1]])
        g.insertData(torch.full((1, 4), 3.0, device=g.device), [2])
        g.saveCupy(tmp_path / "out")
        expect = table.copy()
        expect[2] = 3
        assert np.array_equal(np.load(tmp_path / "out.npy"), expect)
    assert np.array_equal(_read(p), table)  # in-memory copies never write the source
    for bad in ["False", 2, None]:
        with pytest.raises(gl.GadgetTypeError) as ei:
            gl.DataGadget(p, CPUPinn=bad)
        _expect(ei, "CPUPinn")


@pytest.mark.parametrize("ext", EXTS)
def test_file_table_gather_into_out(files, table, ext):
    g = gl.DataGadget(files[ext], placement="file", **CPU)
    out = torch.empty(2, 4)
    res = g.getData([9, 2], out=out)
    assert np.array_equal(out.numpy(), table[[9, 2]])
    assert res.data_ptr() == out.data_ptr()
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.getData([1, 2], out=torch.empty(2, 4, dtype=torch.float64))
    _expect(ei, "float32", "float64")
    with pytest.raises(gl.GadgetValueError) as ei:
        g.getData([1, 2], out=torch.empty(3, 4))
    _expect(ei, "(2, 4)", "(3, 4)")
    keep = torch.full((2, 4), 5.0)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([1, 10], out=keep)
