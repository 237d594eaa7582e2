"""Black-box review (session 29) of the file-backed stores and file I/O (.npy, HDF5, zarr:
opening as ``DataGadget`` / ``GadgetDataset`` columns and ``file`` placements, writes
through to the file, ``save`` / ``load`` / ``convert`` between formats, read-only opens,
bad and damaged files, atomic saves); written from README.md, SPEC.md and the public
docstrings only."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

import gadgetloader as gl  # noqa: E402
from gadgetloader.cli import main as cli_main  # noqa: E402
from gadgetloader.convert import convert  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _hide_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


EXT = {"npy": ".npy", "hdf5": ".h5", "zarr": ".zarr"}
FORMATS = list(EXT)


# ----------------------------------------------------------------------------- helpers
def _tree_digest(path) -> str:
    """A digest of a file, or of every file (name and bytes) under a directory."""
    h = hashlib.sha256()
    path = str(path)
    if os.path.isdir(path):
        for root, dirs, files in sorted(os.walk(path)):
            dirs.sort()
            for f in sorted(files):
                p = os.path.join(root, f)
                h.update(os.path.relpath(p, path).encode())
                with open(p, "rb") as fh:
                    h.update(fh.read())
    else:
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _leftovers(folder) -> list[str]:
    """Hidden partial / old names a save may leave beside its target."""
    return [n for n in os.listdir(folder) if ".partial-" in n or ".old-" in n]


def _write_native(path, fmt, arr, *, dataset=None, layout="chunked"):
    """Write ``arr`` with numpy / h5py / zarr directly (not through gadgetloader)."""
    path = str(path)
    if fmt == "npy":
        np.save(path, arr)
    elif fmt == "hdf5":
        name = dataset or "x"
        with h5py.File(path, "w") as f:
            if layout == "contiguous":
                f.create_dataset(name, data=arr)
            elif layout == "gzip":
                f.create_dataset(name, data=arr, chunks=(3,) + arr.shape[1:], compression="gzip")
            elif layout == "lzf":
                f.create_dataset(name, data=arr, chunks=(4,) + arr.shape[1:], compression="lzf")
            else:
                f.create_dataset(name, data=arr, chunks=(5,) + arr.shape[1:])
    else:
        chunks = (3,) + arr.shape[1:]
        kw = {}
        if layout == "sharded":
            kw["shards"] = (6,) + arr.shape[1:]
        if layout == "v2":
            kw["zarr_format"] = 2
        if dataset:
            grp = zarr.open_group(path, mode="w")
            z = grp.create_array(dataset, shape=arr.shape, chunks=chunks, dtype=arr.dtype, **kw)
        else:
            z = zarr.create_array(store=path, shape=arr.shape, chunks=chunks, dtype=arr.dtype, **kw)
        z[...] = arr


def _read_native(path, fmt, dataset=None) -> np.ndarray:
    path = str(path)
    if fmt == "npy":
        return np.load(path)
    if fmt == "hdf5":
        with h5py.File(path, "r") as f:
            if dataset is None:
                names = []
                f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
                dataset = names[0]
            return f[dataset][...]
    if dataset is None:
        return zarr.open_array(path, mode="r")[...]
    return zarr.open_group(path, mode="r")[dataset][...]


def _ref_table(dtype: torch.dtype, shape=(9, 3), seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen) * 100).to(dtype)
        flat = t.view(-1)
        flat[0] = float("nan")
        flat[1] = float("-inf")
        flat[2] = -0.0
        flat[3] = float("inf")
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(
        max(info.min, -(2**62)), min(info.max, 2**62), shape, generator=gen, dtype=torch.int64
    )
    t = t.to(dtype)
    t.view(-1)[0] = info.min
    t.view(-1)[1] = info.max
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bit-exact comparison, NaN payloads and -0.0 included)."""
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def _has_chattr() -> bool:
    return shutil.which("chattr") is not None and os.geteuid() == 0


# ----------------------------------------------------------------------------- A. reading
NATIVE_LAYOUTS = [
    ("npy", "plain", None),
    ("hdf5", "contiguous", None),
    ("hdf5", "chunked", None),
    ("hdf5", "gzip", None),
    ("hdf5", "lzf", None),
    ("hdf5", "chunked", "grp/sub/emb"),
    ("hdf5", "gzip", "a/b/c/d"),
    ("zarr", "chunked", None),
    ("zarr", "sharded", None),
    ("zarr", "v2", None),
    ("zarr", "chunked", "grp/emb"),
]
LAYOUT_IDS = [f"{f}-{lay}-{ds or 'root'}" for f, lay, ds in NATIVE_LAYOUTS]


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("fmt,layout,dataset", NATIVE_LAYOUTS, ids=LAYOUT_IDS)
def test_read_native_files_against_numpy(tmp_path, fmt, layout, dataset, placement):
    arr = np.arange(17 * 4, dtype=np.float32).reshape(17, 4) * 1.5 - 7
    p = tmp_path / f"t{EXT[fmt]}"
    _write_native(p, fmt, arr, dataset=dataset, layout=layout)
    kw = {"dataset": dataset} if dataset else {}
    g = gl.DataGadget(str(p), placement=placement, **kw)
    assert g.shape == (17, 4) and g.dtype == torch.float32 and len(g) == 17
    ids = np.array([[16, 0, 5], [5, 5, 12]])
    got = g.getData(torch.from_numpy(ids))
    assert got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got.numpy(), arr[ids])
    np.testing.assert_array_equal(g.getData(slice(2, 15, 4)).numpy(), arr[2:15:4])
    np.testing.assert_array_equal(np.asarray(g), arr)
    g.close()


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_dataset_name_not_in_file_lists_existing(tmp_path, fmt):
    arr = np.ones((4, 2), np.float32)
    p = tmp_path / f"t{EXT[fmt]}"
    if fmt == "hdf5":
        with h5py.File(p, "w") as f:
            f["grp/emb"] = arr
            f["other"] = arr
    else:
        grp = zarr.open_group(str(p), mode="w")
        grp.create_array("grp/emb", shape=arr.shape, dtype=arr.dtype)[...] = arr
        grp.create_array("other", shape=arr.shape, dtype=arr.dtype)[...] = arr
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetKeyError) as ei:
            gl.DataGadget(str(p), placement=placement, dataset="grp/nope")
        assert isinstance(ei.value, KeyError)
        msg = str(ei.value)
        assert "grp/nope" in msg and "grp/emb" in msg and "other" in msg
    # two arrays and no name: refused, listing both
    with pytest.raises(gl.GadgetKeyError, match="other"):
        gl.DataGadget(str(p), placement="file")


def test_hdf5_group_name_is_not_a_dataset(tmp_path):
    p = tmp_path / "g.h5"
    with h5py.File(p, "w") as f:
        f["grp/x"] = np.ones((3, 2))
        f["grp/y"] = np.ones((3, 2))
    with pytest.raises(gl.GadgetKeyError, match="grp/x"):
        gl.DataGadget(str(p), placement="cpu", dataset="grp")


def test_dataset_on_npy_is_refused(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, np.ones((3, 2), np.float32))
    with pytest.raises(gl.GadgetValueError, match="dataset"):
        gl.DataGadget(str(p), placement="file", dataset="x")


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_from_content_without_extension(tmp_path, fmt):
    arr = np.arange(12, dtype=np.int16).reshape(4, 3)
    src = tmp_path / f"t{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(src))
    noext = tmp_path / "noext"
    if fmt == "zarr":
        shutil.copytree(src, noext)
    else:
        shutil.copy(src, noext)
    for placement in ("cpu", "file"):
        g = gl.DataGadget(str(noext), placement=placement)
        np.testing.assert_array_equal(g.getNumpyVersion(), arr)


def test_npy_named_h5_and_h5_named_npy(tmp_path):
    arr = np.arange(6, dtype=np.float64).reshape(2, 3)
    fake_h5 = tmp_path / "fake.h5"
    np.save(tmp_path / "a.npy", arr)
    shutil.copy(tmp_path / "a.npy", fake_h5)
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(str(fake_h5), placement="cpu")
    assert str(fake_h5) in str(ei.value) and "HDF5" in str(ei.value)
    # format= forces it
    np.testing.assert_array_equal(
        gl.DataGadget(str(fake_h5), placement="cpu", format="npy").getNumpyVersion(), arr
    )

    fake_npy = tmp_path / "fake.npy"
    with h5py.File(tmp_path / "r.h5", "w") as f:
        f["x"] = arr
    shutil.copy(tmp_path / "r.h5", fake_npy)
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError) as ei:
            gl.DataGadget(str(fake_npy), placement=placement)
        assert isinstance(ei.value, OSError)
        assert str(fake_npy) in str(ei.value) and "NUMPY" in str(ei.value)


def test_unknown_extension_and_unknown_format(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.DataGadget(str(p), placement="cpu")
    assert "notes.txt" in str(ei.value) and ".npy" in str(ei.value) and "format=" in str(ei.value)
    np.save(tmp_path / "a.npy", np.ones((2, 2)))
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(str(tmp_path / "a.npy"), placement="cpu", format="parquet")
    assert "parquet" in str(ei.value) and "hdf5" in str(ei.value) and "zarr" in str(ei.value)


def test_directory_without_zarr_metadata(tmp_path):
    d = tmp_path / "empty.zarr"
    d.mkdir()
    with pytest.raises(gl.GadgetFileError, match="zarr"):
        gl.DataGadget(str(d), placement="file")


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_file(tmp_path, fmt):
    for placement in ("cpu", "file"):
        p = tmp_path / f"missing{EXT[fmt]}"
        with pytest.raises(gl.GadgetFileNotFoundError) as ei:
            gl.DataGadget(str(p), placement=placement)
        assert isinstance(ei.value, FileNotFoundError)
        assert str(p) in str(ei.value)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_truncated_npy_data(tmp_path, placement):
    p = tmp_path / "t.npy"
    np.save(p, np.zeros((10, 4), np.float32))
    size = os.path.getsize(p)
    os.truncate(p, size - 10)
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(str(p), placement=placement)
    msg = str(ei.value)
    assert str(p) in msg and "truncated" in msg
    # says what was expected (the header's shape / size) and what arrived (the file's size)
    assert "(10, 4)" in msg and str(size - 10) in msg


def test_truncated_npy_header(tmp_path):
    p = tmp_path / "t.npy"
    for cut in (0, 5, 20):
        np.save(p, np.zeros((10, 4), np.float32))
        os.truncate(p, cut)
        with pytest.raises(gl.GadgetFileError) as ei:
            gl.DataGadget(str(p), placement="cpu")
        assert str(p) in str(ei.value), cut


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_truncated_hdf5(tmp_path, placement):
    p = tmp_path / "t.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(400, dtype=np.float64).reshape(100, 4)
    os.truncate(p, os.path.getsize(p) // 2)
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(str(p), placement=placement)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_row_file_is_refused_naming_it(tmp_path, fmt):
    for placement in ("cpu", "file"):
        p = tmp_path / f"z{EXT[fmt]}"
        arr = np.zeros((0, 3), np.float32)
        if fmt == "npy":
            np.save(p, arr)
        elif fmt == "hdf5":
            with h5py.File(p, "w") as f:
                f["x"] = arr
        else:
            zarr.create_array(store=str(p), shape=(0, 3), chunks=(1, 3), dtype="f4", overwrite=True)
        with pytest.raises(gl.GadgetValueError) as ei:
            gl.DataGadget(str(p), placement=placement)
        assert str(p) in str(ei.value) and "zero rows" in str(ei.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row_table(tmp_path, fmt):
    for placement in ("cpu", "file"):
        arr = np.array([[1.5, -2.5, 3.25]], np.float64)
        p = tmp_path / f"one{EXT[fmt]}"
        gl.DataGadget(arr, placement="cpu").save(str(p))
        g = gl.DataGadget(str(p), placement=placement)
        assert g.shape == (1, 3)
        np.testing.assert_array_equal(g.getData([0, 0, 0]).numpy(), arr[[0, 0, 0]])
        np.testing.assert_array_equal(g.getData(0).numpy(), arr[0])
        with pytest.raises(gl.GadgetIndexError):
            g.getData([1])
        if placement == "file":
            g.insertData(torch.tensor([[9.0, 8.0, 7.0]], dtype=torch.float64), [0])
            g.close()
            np.testing.assert_array_equal(_read_native(p, fmt), [[9.0, 8.0, 7.0]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_1d_labels_and_3d_rows(tmp_path, fmt):
    labels = np.arange(7, dtype=np.int64) * 3 - 5
    cube = np.arange(5 * 2 * 3, dtype=np.int8).reshape(5, 2, 3)
    for name, arr in (("lab", labels), ("cube", cube)):
        p = tmp_path / f"{name}{EXT[fmt]}"
        gl.DataGadget(arr, placement="cpu").save(str(p))
        g = gl.DataGadget(str(p), placement="file")
        assert g.shape == arr.shape and g.row_shape == arr.shape[1:]
        np.testing.assert_array_equal(g.getData([4, 0, 4]).numpy(), arr[[4, 0, 4]])
        new = torch.from_numpy(np.full((1,) + arr.shape[1:], -1, arr.dtype))
        g.insertData(new, [2])
        g.close()
        ref = arr.copy()
        ref[2] = -1
        np.testing.assert_array_equal(gl.DataGadget(str(p), placement="cpu").getNumpyVersion(), ref)


def test_scalar_npy_is_refused(tmp_path):
    p = tmp_path / "s.npy"
    np.save(p, np.float32(3))
    with pytest.raises(gl.GadgetValueError, match="scalar"):
        gl.DataGadget(str(p), placement="cpu")


@pytest.mark.parametrize(
    "arr,frag",
    [
        (np.ones((3, 2), np.complex64), "complex"),
        (np.array([["a", "b"]]), "<U1"),
        (np.array([[1, "a"]], dtype=object), "object"),
    ],
    ids=["complex", "str", "object"],
)
def test_unsupported_npy_dtypes(tmp_path, arr, frag):
    p = tmp_path / "bad.npy"
    np.save(p, arr, allow_pickle=True)
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetTypeError) as ei:
            gl.DataGadget(str(p), placement=placement)
        assert str(p) in str(ei.value) and frag in str(ei.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_dtype_expectation(tmp_path, fmt):
    for placement in ("cpu", "file"):
        p = tmp_path / f"t{EXT[fmt]}"
        gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu").save(str(p))
        with pytest.raises(gl.GadgetTypeError) as ei:
            gl.DataGadget(str(p), placement=placement, dtype="float64")
        assert isinstance(ei.value, TypeError)
        msg = str(ei.value)
        assert "float32" in msg and "float64" in msg and str(p) in msg
        # the right dtype is accepted
        assert (
            gl.DataGadget(str(p), placement=placement, dtype=torch.float32).dtype == torch.float32
        )


def test_shape_with_a_file_source_is_refused(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, np.ones((3, 2), np.float32))
    with pytest.raises(gl.GadgetValueError, match="shape"):
        gl.DataGadget(str(p), placement="cpu", shape=(3, 2))


def test_unsigned_files_convert_with_dtype(tmp_path):
    p16 = tmp_path / "u16.npy"
    np.save(p16, np.array([[65535, 0], [1, 2]], np.uint16))
    g = gl.DataGadget(str(p16), placement="cpu", dtype="int32")
    assert g.dtype == torch.int32
    np.testing.assert_array_equal(g.getNumpyVersion(), [[65535, 0], [1, 2]])
    # beyond the dtype's range: refused, nothing loaded
    with pytest.raises(gl.GadgetValueError, match="65535"):
        gl.DataGadget(str(p16), placement="cpu", dtype="int16")
    # a float dtype rounds, as an int64 cast would
    p32 = tmp_path / "u32.npy"
    np.save(p32, np.array([[16777217]], np.uint32))
    assert (
        gl.DataGadget(str(p32), placement="cpu", dtype="float32").getNumpyVersion()[0, 0]
        == 16777216.0
    )
    # without dtype= (and for a file table) refused with the advice
    for kw in (
        {"placement": "cpu"},
        {"placement": "file"},
        {"placement": "file", "dtype": "int64"},
    ):
        with pytest.raises(gl.GadgetTypeError, match="int64"):
            gl.DataGadget(str(p32), **kw)


def test_load_refuses_unsigned_file_and_keeps_table(tmp_path):
    p = tmp_path / "u32.npy"
    np.save(p, np.array([[1, 2]], np.uint32))
    g = gl.DataGadget(np.arange(6, dtype=np.int64).reshape(3, 2), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="dtype="):
        g.load(str(p))
    np.testing.assert_array_equal(g.getNumpyVersion(), np.arange(6).reshape(3, 2))


def test_hdf5_uint64_to_int64_range_check(tmp_path):
    p = tmp_path / "u.h5"
    with h5py.File(p, "w") as f:
        f["ok"] = np.array([[1, 2]], np.uint64)
        f["big"] = np.array([[2**63 + 5]], np.uint64)
    np.testing.assert_array_equal(
        gl.DataGadget(str(p), placement="cpu", dataset="ok", dtype="int64").getNumpyVersion(),
        [[1, 2]],
    )
    with pytest.raises(gl.GadgetValueError, match="int64"):
        gl.DataGadget(str(p), placement="cpu", dataset="big", dtype="int64")


@pytest.mark.parametrize("fmt", FORMATS)
def test_big_endian_files(tmp_path, fmt):
    arr = (np.arange(24, dtype=np.float32).reshape(8, 3) - 3.5).astype(">f4")
    p = tmp_path / f"be{EXT[fmt]}"
    _write_native(p, fmt, arr, layout="v2" if fmt == "zarr" else "chunked")
    for placement in ("cpu", "file"):
        g = gl.DataGadget(str(p), placement=placement)
        assert g.dtype == torch.float32
        np.testing.assert_array_equal(g.getData([7, 0]).numpy(), arr[[7, 0]].astype("<f4"))
    g = gl.DataGadget(str(p), placement="file")
    g.insertData(torch.tensor([[100.0, 200.0, 300.0]]), [5])
    g.close()
    ref = arr.astype("<f4")
    ref[5] = [100, 200, 300]
    np.testing.assert_array_equal(_read_native(p, fmt).astype("<f4"), ref)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_unwritten_chunks_read_as_fill_value(tmp_path, placement):
    ph = tmp_path / "fv.h5"
    with h5py.File(ph, "w") as f:
        ds = f.create_dataset("x", shape=(10, 3), dtype="i4", chunks=(2, 3), fillvalue=-5)
        ds[4:6] = 7
    pz = tmp_path / "fv.zarr"
    z = zarr.create_array(store=str(pz), shape=(10, 3), chunks=(3, 2), dtype="i8", fill_value=-9)
    z[4:5] = 1
    assert gl.DataGadget(str(ph), placement=placement).getData([0, 4, 9]).tolist() == [
        [-5] * 3,
        [7] * 3,
        [-5] * 3,
    ]
    assert gl.DataGadget(str(pz), placement=placement).getData([0, 4, 9]).tolist() == [
        [-9] * 3,
        [1] * 3,
        [-9] * 3,
    ]


# ----------------------------------------------------------------------------- B. writes
WRITE_LAYOUTS = [
    ("npy", "plain"),
    ("hdf5", "contiguous"),
    ("hdf5", "chunked"),
    ("hdf5", "gzip"),
    ("hdf5", "lzf"),
    ("zarr", "chunked"),
    ("zarr", "sharded"),
    ("zarr", "v2"),
]


@pytest.mark.parametrize("fmt,layout", WRITE_LAYOUTS, ids=[f"{a}-{b}" for a, b in WRITE_LAYOUTS])
def test_file_writes_reach_the_file_and_survive_reopen(tmp_path, fmt, layout):
    arr = np.arange(20 * 3, dtype=np.int32).reshape(20, 3)
    p = tmp_path / f"w{EXT[fmt]}"
    _write_native(p, fmt, arr, layout=layout)
    ref = arr.copy()
    g = gl.DataGadget(str(p), placement="file")
    assert g.placement == "file"
    # repeated ids: the last occurrence wins
    g.insertData(
        torch.tensor([[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]], dtype=torch.int32), [7, 19, 7, 0]
    )
    ref[7] = 3
    ref[19] = 2
    ref[0] = 4
    g[[2, 5], 1:3] = torch.tensor([[-1, -2], [-3, -4]], dtype=torch.int32)
    ref[[2, 5], 1:3] = [[-1, -2], [-3, -4]]
    g[10:13] = torch.full((3, 3), 55, dtype=torch.int32)
    ref[10:13] = 55
    np.testing.assert_array_equal(g.getData(torch.arange(20)).numpy(), ref)
    # "Each write reaches the file before it returns"
    if fmt != "hdf5":  # (an HDF5 file held open for writing is read after close below)
        np.testing.assert_array_equal(_read_native(p, fmt), ref)
    g.flush()
    g.close()
    np.testing.assert_array_equal(_read_native(p, fmt), ref)
    np.testing.assert_array_equal(gl.DataGadget(str(p), placement="cpu").getNumpyVersion(), ref)


def test_hdf5_write_visible_to_another_process_before_close(tmp_path):
    arr = np.arange(12, dtype=np.float64).reshape(4, 3)
    p = tmp_path / "w.h5"
    gl.DataGadget(arr, placement="cpu").save(str(p), chunk_rows=2)
    g = gl.DataGadget(str(p), placement="file")
    g.insertData(torch.full((1, 3), -1.0, dtype=torch.float64), [3])
    code = f"import h5py; f = h5py.File({str(p)!r}, 'r'); print(f['data'][3].tolist())"
    env = dict(os.environ, HDF5_USE_FILE_LOCKING="FALSE")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    g.close()
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [-1.0, -1.0, -1.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_elementwise_initialisers_write_through(tmp_path, fmt):
    p = tmp_path / f"i{EXT[fmt]}"
    gl.DataGadget(np.zeros((11, 2), np.float32), placement="cpu").save(str(p))
    with gl.DataGadget(str(p), placement="file") as g:
        g.fill_(2.5)
    np.testing.assert_array_equal(_read_native(p, fmt), np.full((11, 2), 2.5, np.float32))
    with gl.DataGadget(str(p), placement="file") as g:
        g.uniform_(3.0, 4.0)
    got = _read_native(p, fmt)
    assert ((got >= 3.0) & (got <= 4.0)).all() and got.std() > 0
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetTypeError):
        g.init_(torch.nn.init.xavier_uniform_)
    g.close()
    np.testing.assert_array_equal(_read_native(p, fmt), got)


READ_ONLY_CALLS = {
    "insertData": lambda g: g.insertData(torch.zeros(1, 3, dtype=torch.int64), [1]),
    "setitem": lambda g: g.__setitem__(slice(0, 2), torch.zeros(2, 3, dtype=torch.int64)),
    "scatter": lambda g: g.scatter([2], torch.zeros(1, 3, dtype=torch.int64)),
    "fill_": lambda g: g.fill_(1),
    "zero_": lambda g: g.zero_(),
    "scatter_many": lambda g: gl.scatter_many([g], [torch.zeros(1, 3, dtype=torch.int64)], [0]),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_writable_false_refuses_writes_and_keeps_data(tmp_path, fmt):
    arr = np.arange(15, dtype=np.int64).reshape(5, 3) + 100
    p = tmp_path / f"ro{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    before = _tree_digest(p)
    g = gl.DataGadget(str(p), placement="file", writable=False)
    for name, call in READ_ONLY_CALLS.items():
        with pytest.raises(gl.ReadOnlyError) as ei:
            call(g)
        assert isinstance(ei.value, PermissionError), name
        assert str(p) in str(ei.value) and "writable=False" in str(ei.value), name
        np.testing.assert_array_equal(g.getData(torch.arange(5)).numpy(), arr)
    g.flush()
    g.close()
    assert _tree_digest(p) == before


def test_read_only_copy_stays_read_only_after_pickle(tmp_path):
    p = tmp_path / "ro.h5"
    gl.DataGadget(np.ones((4, 3), np.int64), placement="cpu").save(str(p))
    g = gl.DataGadget(str(p), placement="file", writable=False)
    copy = pickle.loads(pickle.dumps(g))
    assert copy.placement == "file"
    with pytest.raises(gl.ReadOnlyError):
        copy.insertData(torch.zeros(1, 3, dtype=torch.int64), [0])
    copy.close()
    g.close()
    np.testing.assert_array_equal(_read_native(p, "hdf5"), np.ones((4, 3)))


def test_writable_takes_only_true_false_none(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, np.ones((3, 2), np.float32))
    for value in (1, 0, "no", "True", 1.0):
        with pytest.raises(gl.GadgetTypeError, match="writable"):
            gl.DataGadget(str(p), placement="file", writable=value)
    assert gl.DataGadget(str(p), placement="file", writable=None).placement == "file"


@pytest.mark.parametrize("value", [np.True_, np.False_], ids=["np.True_", "np.False_"])
def test_writable_takes_numpy_bools_as_bools(tmp_path, value):
    """README: "`writable=` takes only `True`, `False` (NumPy's bools too) or `None`" (the
    review's reading of the old wording, that NumPy bools were refused, was the docs'
    ambiguity: session 29 reworded them)."""
    p = tmp_path / "a.npy"
    np.save(p, np.ones((3, 2), np.float32))
    g = gl.DataGadget(str(p), placement="file", writable=value)
    if value:
        g.insertData(np.full((1, 2), 7.0, np.float32), [1])
        g.close()
        assert np.load(p)[1].tolist() == [7.0, 7.0]
    else:
        with pytest.raises(gl.ReadOnlyError):
            g.insertData(np.full((1, 2), 7.0, np.float32), [1])
        g.close()
        assert np.load(p).tolist() == [[1.0, 1.0]] * 3


def test_file_options_refused_for_memory_placements(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, np.ones((3, 2), np.float32))
    for opt in ({"writable": False}, {"cache_bytes": 0}, {"block_rows": 4}):
        with pytest.raises(gl.GadgetTypeError, match=next(iter(opt))):
            gl.DataGadget(str(p), placement="cpu", **opt)


@pytest.mark.parametrize("cache_bytes,block_rows", [(0, None), (0, 1), (64, 3), (None, 7)])
def test_cache_and_block_options_give_same_rows(tmp_path, cache_bytes, block_rows):
    arr = np.arange(200, dtype=np.float32).reshape(50, 4)
    p = tmp_path / "c.h5"
    gl.DataGadget(arr, placement="cpu").save(str(p), chunk_rows=6, compression="gzip")
    kw = {}
    if cache_bytes is not None:
        kw["cache_bytes"] = cache_bytes
    if block_rows is not None:
        kw["block_rows"] = block_rows
    g = gl.DataGadget(str(p), placement="file", **kw)
    ids = torch.tensor([49, 0, 13, 13, 27, 6])
    np.testing.assert_array_equal(g.getData(ids).numpy(), arr[ids.numpy()])
    g.insertData(torch.full((2, 4), -1.0), [13, 48])
    g.close()
    ref = arr.copy()
    ref[[13, 48]] = -1
    np.testing.assert_array_equal(_read_native(p, "hdf5"), ref)


@pytest.mark.parametrize("opt", [{"cache_bytes": -1}, {"block_rows": 0}, {"block_rows": -3}])
def test_bad_file_store_options(tmp_path, opt):
    p = tmp_path / "a.npy"
    np.save(p, np.ones((3, 2), np.float32))
    with pytest.raises(gl.GadgetValueError, match=next(iter(opt))):
        gl.DataGadget(str(p), placement="file", **opt)


def test_fortran_npy_reads_but_refuses_writes(tmp_path):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(arr))
    before = _tree_digest(p)
    g = gl.DataGadget(str(p), placement="file")
    np.testing.assert_array_equal(g.getData([3, 0, 2]).numpy(), arr[[3, 0, 2]])
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        g.insertData(torch.zeros(1, 3), [1])
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        gl.DataGadget(str(p), placement="file", writable=True)
    g.close()
    assert _tree_digest(p) == before
    np.testing.assert_array_equal(gl.DataGadget(str(p), placement="cpu").getNumpyVersion(), arr)


def test_hdf5_external_link_is_read_only_and_names_target(tmp_path):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    with h5py.File(tmp_path / "target.h5", "w") as f:
        f["d"] = arr
    with h5py.File(tmp_path / "link.h5", "w") as f:
        f["lnk"] = h5py.ExternalLink("target.h5", "d")
    g = gl.DataGadget(str(tmp_path / "link.h5"), placement="file")
    np.testing.assert_array_equal(g.getData([3, 1]).numpy(), arr[[3, 1]])
    with pytest.raises(gl.ReadOnlyError) as ei:
        g.insertData(torch.zeros(1, 3), [0])
    assert "target.h5" in str(ei.value) and "'d'" in str(ei.value)
    g.close()
    np.testing.assert_array_equal(_read_native(tmp_path / "target.h5", "hdf5", "d"), arr)


def test_hdf5_virtual_dataset(tmp_path):
    arr = np.arange(24, dtype=np.float32).reshape(8, 3)
    lay = h5py.VirtualLayout(shape=(8, 3), dtype="f4")
    for i in range(2):
        src = tmp_path / f"src{i}.h5"
        with h5py.File(src, "w") as f:
            f["x"] = arr[i * 4 : (i + 1) * 4]
        lay[i * 4 : (i + 1) * 4] = h5py.VirtualSource(str(src), "x", shape=(4, 3))
    with h5py.File(tmp_path / "vds.h5", "w") as f:
        f.create_virtual_dataset("v", lay, fillvalue=-1)
    g = gl.DataGadget(str(tmp_path / "vds.h5"), placement="file")
    np.testing.assert_array_equal(g.getData(torch.arange(8)).numpy(), arr)
    with pytest.raises(gl.ReadOnlyError, match="virtual"):
        g.insertData(torch.zeros(1, 3), [0])
    g.close()
    os.remove(tmp_path / "src1.h5")
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError, match="src1.h5"):
            gl.DataGadget(str(tmp_path / "vds.h5"), placement=placement)


def test_bad_inserts_on_file_table_leave_file_unchanged(tmp_path):
    arr = np.arange(30, dtype=np.int16).reshape(10, 3)
    p = tmp_path / "b.h5"
    gl.DataGadget(arr, placement="cpu").save(str(p), chunk_rows=4, compression="gzip")
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetTypeError, match="int16"):
        g.insertData(torch.zeros(1, 3, dtype=torch.int32), [1])
    with pytest.raises(gl.GadgetValueError, match=r"\(1, 3\)"):
        g.insertData(torch.zeros(1, 4, dtype=torch.int16), [1])
    with pytest.raises(gl.GadgetIndexError, match="10"):
        g.insertData(torch.zeros(2, 3, dtype=torch.int16), [0, 10])
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.zeros(2, 3, dtype=torch.int16), [0, -1])
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.zeros(1, 3, dtype=torch.int16), torch.tensor([1.0]))
    np.testing.assert_array_equal(g.getData(torch.arange(10)).numpy(), arr)
    g.close()
    np.testing.assert_array_equal(_read_native(p, "hdf5"), arr)


def test_partial_write_into_damaged_zarr_chunk_changes_nothing(tmp_path):
    arr = np.arange(60, dtype=np.float64).reshape(20, 3)
    p = tmp_path / "c.zarr"
    z = zarr.create_array(store=str(p), shape=arr.shape, chunks=(4, 3), dtype="f8")
    z[...] = arr
    chunk = p / "c" / "3" / "0"
    assert chunk.exists()
    chunk.write_bytes(b"garbage")
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetFileError, match="damaged"):
        g.getData([13])
    # a write touching rows 0 and 13 (only part of chunk 3): refused before its first write
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.zeros(2, 3, dtype=torch.float64), [0, 13])
    np.testing.assert_array_equal(g.getData([0, 1, 19]).numpy(), arr[[0, 1, 19]])
    g.close()
    assert chunk.read_bytes() == b"garbage"
    np.testing.assert_array_equal(zarr.open_array(str(p), mode="r")[0:12], arr[0:12])


def test_partial_write_into_damaged_hdf5_chunk_changes_nothing(tmp_path):
    arr = np.arange(60, dtype=np.float64).reshape(20, 3)
    p = tmp_path / "h.h5"
    with h5py.File(p, "w") as f:
        ds = f.create_dataset("x", data=arr, chunks=(4, 3), compression="gzip")
        info = ds.id.get_chunk_info(2)
    raw = bytearray(p.read_bytes())
    raw[info.byte_offset : info.byte_offset + info.size] = b"\xff" * info.size
    p.write_bytes(bytes(raw))
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetFileError, match=str(p)):
        g.getData([9])
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.zeros(2, 3, dtype=torch.float64), [0, 9])
    g.close()
    with h5py.File(p, "r") as f:
        np.testing.assert_array_equal(f["x"][0:8], arr[0:8])


@pytest.mark.parametrize("fmt", FORMATS)
def test_closed_file_table(tmp_path, fmt):
    p = tmp_path / f"c{EXT[fmt]}"
    gl.DataGadget(np.ones((4, 2), np.float32), placement="cpu").save(str(p))
    g = gl.DataGadget(str(p), placement="file")
    g.close()
    g.close()  # idempotent
    for call in (
        lambda: g.getData([0]),
        lambda: g.insertData(torch.zeros(1, 2), [0]),
        lambda: g.flush(),
        lambda: g.load(str(p)),
        lambda: g.save(str(tmp_path / f"o{EXT[fmt]}")),
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert g.shape == (4, 2) and len(g) == 4 and g.dtype == torch.float32
    assert "closed" in repr(g)
    assert not os.path.exists(tmp_path / f"o{EXT[fmt]}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_replaced_by_another_save_then_load(tmp_path, fmt):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / f"r{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    g = gl.DataGadget(str(p), placement="file")
    assert g.getData([1]).tolist() == [arr[1].tolist()]
    gl.DataGadget(arr * 10, placement="cpu").save(str(p))
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.getData([1])
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.insertData(torch.zeros(1, 3), [1])
    np.testing.assert_array_equal(_read_native(p, fmt), arr * 10)
    g.load(str(p))
    assert g.placement == "file"
    np.testing.assert_array_equal(g.getData(torch.arange(4)).numpy(), arr * 10)
    g.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_deleted_under_table(tmp_path, fmt):
    p = tmp_path / f"d{EXT[fmt]}"
    gl.DataGadget(np.ones((4, 3), np.float32), placement="cpu").save(str(p))
    g = gl.DataGadget(str(p), placement="file")
    if fmt == "zarr":
        shutil.rmtree(p)
    else:
        os.remove(p)
    with pytest.raises(gl.GadgetFileError, match=str(p)):
        g.getData([0])


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_file_shrunk_under_table(tmp_path, fmt):
    p = tmp_path / f"s{EXT[fmt]}"
    gl.DataGadget(np.ones((500, 3), np.float32), placement="cpu").save(
        str(p), **({"chunk_rows": 10} if fmt == "hdf5" else {})
    )
    g = gl.DataGadget(str(p), placement="file", cache_bytes=0)
    assert g.getData([499]).tolist() == [[1.0, 1.0, 1.0]]
    os.truncate(p, os.path.getsize(p) // 2)
    with pytest.raises(gl.GadgetFileError):
        g.getData([499])
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.zeros(1, 3), [499])


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_tables_of_one_file_see_each_others_writes(tmp_path, fmt):
    arr = np.arange(200, dtype=np.int32).reshape(50, 4)
    p = tmp_path / f"x{EXT[fmt]}"
    kw = {} if fmt == "npy" else {"chunk_rows": 8, "compression": "gzip"}
    gl.DataGadget(arr, placement="cpu").save(str(p), **kw)
    g1 = gl.DataGadget(str(p), placement="file")
    g2 = gl.DataGadget(str(p), placement="file")
    g2.getData(torch.arange(50))  # fill g2's cache
    g1.insertData(torch.full((1, 4), -5, dtype=torch.int32), [10])
    assert g2.getData([10]).tolist() == [[-5] * 4]
    g2.insertData(torch.full((1, 4), -6, dtype=torch.int32), [11])
    assert g1.getData([11]).tolist() == [[-6] * 4]
    g1.close()
    g2.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_pickles_as_its_file(tmp_path, fmt):
    arr = np.arange(24, dtype=np.float64).reshape(8, 3)
    p = tmp_path / f"p{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    g = gl.DataGadget(str(p), placement="file")
    blob = pickle.dumps(g)
    assert len(blob) < arr.nbytes + 4096 or arr.tobytes() not in blob
    copy = pickle.loads(blob)
    assert copy.placement == "file" and copy.shape == (8, 3)
    np.testing.assert_array_equal(copy.getData(torch.arange(8)).numpy(), arr)
    copy.close()
    g.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_has_no_tensor_view(tmp_path, fmt):
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    p = tmp_path / f"v{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetTypeError):
        g.as_tensor()
    with pytest.raises(ValueError):
        np.asarray(g, copy=False)
    np.testing.assert_array_equal(np.asarray(g), arr)
    np.testing.assert_array_equal(g.getNumpyVersion(), arr)
    g.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_self_save_of_file_table(tmp_path, fmt):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / f"self{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    g = gl.DataGadget(str(p), placement="file")
    g.insertData(torch.full((1, 3), -1.0), [2])
    g.save(str(p))
    ref = arr.copy()
    ref[2] = -1
    np.testing.assert_array_equal(_read_native(p, fmt), ref)
    assert _leftovers(tmp_path) == []
    g.close()


@pytest.mark.skipif(not _has_chattr(), reason="needs chattr and root")
@pytest.mark.parametrize("fmt", FORMATS)
def test_immutable_file_opens_read_only(tmp_path, fmt):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / f"imm{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    subprocess.run(["chattr", "-R", "+i", str(p)], check=True)
    try:
        g = gl.DataGadget(str(p), placement="file")
        np.testing.assert_array_equal(g.getData([3]).numpy(), arr[[3]])
        with pytest.raises(gl.ReadOnlyError, match=str(p)):
            g.insertData(torch.zeros(1, 3), [1])
        g.close()
        with pytest.raises(gl.ReadOnlyError, match="writable=True"):
            gl.DataGadget(str(p), placement="file", writable=True)
    finally:
        subprocess.run(["chattr", "-R", "-i", str(p)], check=True)
    np.testing.assert_array_equal(_read_native(p, fmt), arr)


# ----------------------------------------------------------------------------- C. save / load / convert
ALL_DTYPES = list(gl.SUPPORTED_DTYPES)
DTYPE_IDS = [str(d).replace("torch.", "") for d in ALL_DTYPES]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_round_trip_bit_exact(tmp_path, fmt, dtype):
    ref = _ref_table(dtype)
    g = gl.DataGadget(ref, placement="cpu")
    p = tmp_path / f"t{EXT[fmt]}"
    if dtype == torch.bfloat16 and fmt == "npy":
        with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
            g.save(str(p))
        assert not os.path.exists(p) and _leftovers(tmp_path) == []
        return
    kw = {} if fmt == "npy" else {"chunk_rows": 4}
    g.save(str(p), **kw)
    for placement in ("cpu", "file"):
        h = gl.DataGadget(str(p), placement=placement)
        got = h.getData(torch.arange(len(ref)))
        assert got.dtype == dtype
        assert torch.equal(_bits(got), _bits(ref))
        h.close()
    # a cpu table loading it back
    back = gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu")
    back.load(str(p))
    assert back.dtype == dtype and back.shape == tuple(ref.shape)
    assert torch.equal(_bits(back.as_tensor()), _bits(ref))


CONVERT_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.uint8,
    torch.bool,
]


CONVERT_CASES = [
    (f, d) for f in FORMATS for d in CONVERT_DTYPES if not (f == "npy" and d == torch.bfloat16)
]


@pytest.mark.parametrize(
    "src_fmt,dtype",
    CONVERT_CASES,
    ids=[f"{f}-{str(d).replace('torch.', '')}" for f, d in CONVERT_CASES],
)
def test_convert_every_pair(tmp_path, src_fmt, dtype):
    ref = _ref_table(dtype, shape=(11, 2, 2), seed=3)
    src = tmp_path / f"src{EXT[src_fmt]}"
    gl.DataGadget(ref, placement="cpu").save(str(src))
    for dst_fmt in FORMATS:
        dst = tmp_path / f"dst_{dst_fmt}{EXT[dst_fmt]}"
        if dtype == torch.bfloat16 and dst_fmt == "npy":
            with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
                convert(str(src), str(dst), progress=False)
            assert not os.path.exists(dst)
            continue
        kw = {} if dst_fmt == "npy" else {"chunk_rows": 3}
        info = convert(str(src), str(dst), progress=False, **kw)
        assert (
            info["shape"] == (11, 2, 2)
            and info["dst_format"] == dst_fmt
            and info["src_format"] == src_fmt
        )
        for placement in ("cpu", "file"):
            h = gl.DataGadget(str(dst), placement=placement)
            got = h.getData(slice(0, 11))
            assert got.dtype == dtype, (dst_fmt, placement)
            assert torch.equal(_bits(got), _bits(ref)), (dst_fmt, placement)
            h.close()
    assert _leftovers(tmp_path) == []


def test_zarr_negative_zero_and_nan_chunks_round_trip(tmp_path):
    """zarr skips chunks holding only the fill value: -0.0 / NaN chunks must still come back bit-exact."""
    arr = np.full((8, 4), -0.0, np.float32)
    arr[4:] = np.nan
    arr.view(np.uint32)[5, 0] |= 1  # a NaN payload
    for comp in (None, "none", "gzip"):
        p = tmp_path / f"z_{comp}.zarr"
        kw = {"chunk_rows": 2}
        if comp:
            kw["compression"] = comp
        gl.DataGadget(arr, placement="cpu").save(str(p), **kw)
        for placement in ("cpu", "file"):
            got = gl.DataGadget(str(p), placement=placement).getData(slice(0, 8)).numpy()
            assert got.view(np.uint32).tolist() == arr.view(np.uint32).tolist(), (comp, placement)


@pytest.mark.parametrize(
    "fmt,options,check",
    [
        (
            "hdf5",
            {"chunk_rows": 4, "compression": "gzip", "compression_level": 9},
            ((4, 3), "gzip", 9),
        ),
        ("hdf5", {"chunk_rows": 3, "compression": "lzf"}, ((3, 3), "lzf", None)),
        ("hdf5", {"chunk_rows": 5}, ((5, 3), None, None)),
        ("hdf5", {"chunk_rows": 5, "compression": "none"}, ((5, 3), None, None)),
        ("zarr", {"chunk_rows": 4}, ((4, 3), "zstd", None)),
        ("zarr", {"chunk_rows": 4, "compression": None}, ((4, 3), "zstd", None)),
        (
            "zarr",
            {"chunk_rows": 2, "compression": "gzip", "compression_level": 7},
            ((2, 3), "gzip", 7),
        ),
        ("zarr", {"chunk_rows": 3, "compression": "blosc"}, ((3, 3), "blosc", None)),
        ("zarr", {"chunk_rows": 6, "compression": "none"}, ((6, 3), None, None)),
        (
            "zarr",
            {"chunk_rows": 4, "compression": "zstd", "compression_level": 22},
            ((4, 3), "zstd", 22),
        ),
    ],
)
def test_save_options_are_applied(tmp_path, fmt, options, check):
    arr = np.arange(30, dtype=np.float32).reshape(10, 3)
    p = tmp_path / f"o{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p), dataset="grp/emb", **options)
    chunks, comp, level = check
    if fmt == "hdf5":
        with h5py.File(p, "r") as f:
            assert list(f.keys()) == ["grp"]
            ds = f["grp/emb"]
            assert ds.chunks == chunks and ds.compression == comp
            if level is not None:
                assert ds.compression_opts == level
            np.testing.assert_array_equal(ds[...], arr)
    else:
        z = zarr.open_group(str(p), mode="r")["grp/emb"]
        assert z.chunks == chunks
        codecs = z.metadata.to_dict()["codecs"]
        names = [c["name"] for c in codecs]
        if comp is None:
            assert names == ["bytes"]
        else:
            assert names[-1] == comp
            if level is not None:
                cfg = codecs[-1]["configuration"]
                assert cfg.get("level", cfg.get("clevel")) == level
        np.testing.assert_array_equal(z[...], arr)
    np.testing.assert_array_equal(
        gl.DataGadget(str(p), placement="file", dataset="grp/emb").getNumpyVersion(), arr
    )


BAD_SAVES = [
    ("hdf5", {"compression": "bogus"}, gl.GadgetKeyError, "bogus"),
    ("zarr", {"compression": "lz4hc"}, gl.GadgetKeyError, "lz4hc"),
    ("hdf5", {"compression": "zstd"}, gl.GadgetKeyError, "zstd"),
    (
        "hdf5",
        {"compression": "gzip", "compression_level": 10},
        gl.GadgetValueError,
        "compression_level",
    ),
    ("zarr", {"compression": "zstd", "compression_level": 23}, gl.GadgetValueError, "22"),
    (
        "zarr",
        {"compression": "blosc", "compression_level": -1},
        gl.GadgetValueError,
        "compression_level",
    ),
    ("hdf5", {"compression": "lzf", "compression_level": 3}, gl.GadgetValueError, "lzf"),
    ("zarr", {"compression": "none", "compression_level": 3}, gl.GadgetValueError, "none"),
    ("hdf5", {"chunk_rows": 0}, gl.GadgetValueError, "chunk_rows"),
    ("zarr", {"chunk_rows": -4}, gl.GadgetValueError, "chunk_rows"),
    ("zarr", {"chunk_rows": 2.5}, gl.GadgetValueError, "chunk_rows"),
    ("hdf5", {"progress": "False"}, gl.GadgetTypeError, "progress"),
    ("npy", {"progress": 2}, gl.GadgetTypeError, "progress"),
    ("npy", {"compression": "gzip"}, gl.GadgetTypeError, "compression"),
    ("npy", {"chunk_rows": 4}, gl.GadgetTypeError, "chunk_rows"),
    ("hdf5", {"dataset": "../x"}, gl.GadgetValueError, ".."),
    ("zarr", {"dataset": "a/./b"}, gl.GadgetValueError, "a/./b"),
    ("hdf5", {"dataset": ""}, gl.GadgetValueError, "dataset"),
    ("zarr", {"foo": 1}, gl.GadgetTypeError, "foo"),
    ("npy", {"format": "parquet"}, gl.GadgetKeyError, "parquet"),
]


@pytest.mark.parametrize(
    "fmt,options,exc,frag",
    BAD_SAVES,
    ids=[f"{f}-{'-'.join(map(str, o.items()))}" for f, o, _, _ in BAD_SAVES],
)
def test_bad_save_over_good_file_leaves_it_intact(tmp_path, fmt, options, exc, frag):
    good = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / f"good{EXT[fmt]}"
    gl.DataGadget(good, placement="cpu").save(str(p))
    before = _tree_digest(p)
    other = gl.DataGadget(np.ones((7, 2), np.float64), placement="cpu")
    with pytest.raises(exc) as ei:
        other.save(str(p), **options)
    assert frag in str(ei.value)
    assert _tree_digest(p) == before
    assert sorted(os.listdir(tmp_path)) == [p.name]
    np.testing.assert_array_equal(gl.DataGadget(str(p), placement="cpu").getNumpyVersion(), good)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_row_table_is_not_saved(tmp_path, fmt):
    good = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / f"good{EXT[fmt]}"
    gl.DataGadget(good, placement="cpu").save(str(p))
    before = _tree_digest(p)
    empty = gl.DataGadget(np.zeros((0, 3), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError) as ei:
        empty.save(str(p))
    assert str(p) in str(ei.value) and "zero rows" in str(ei.value)
    assert _tree_digest(p) == before and sorted(os.listdir(tmp_path)) == [p.name]
    with pytest.raises(gl.GadgetValueError):
        empty.save(str(tmp_path / f"new{EXT[fmt]}"))
    assert not os.path.exists(tmp_path / f"new{EXT[fmt]}")


@pytest.mark.parametrize("dst_fmt", FORMATS)
def test_save_failing_midway_keeps_old_target(tmp_path, dst_fmt):
    """A save whose source fails part-way (a damaged chunk of a file table's zarr store)."""
    arr = np.arange(60, dtype=np.float64).reshape(20, 3)
    src = tmp_path / "src.zarr"
    z = zarr.create_array(store=str(src), shape=arr.shape, chunks=(4, 3), dtype="f8")
    z[...] = arr
    (src / "c" / "3" / "0").write_bytes(b"garbage")
    g = gl.DataGadget(str(src), placement="file")
    dst = tmp_path / f"good{EXT[dst_fmt]}"
    gl.DataGadget(np.full((5, 3), 7.0), placement="cpu").save(str(dst))
    before = _tree_digest(dst)
    with pytest.raises(gl.GadgetFileError, match="damaged"):
        g.save(str(dst))
    assert _tree_digest(dst) == before
    assert _leftovers(tmp_path) == []
    # convert too
    with pytest.raises(gl.GadgetFileError):
        convert(str(src), str(dst), progress=False)
    assert _tree_digest(dst) == before and _leftovers(tmp_path) == []
    g.close()


def test_save_write_failure_under_file_size_limit(tmp_path):
    """RLIMIT_FSIZE makes the writes fail part-way (README: "a file size limit")."""
    script = textwrap.dedent(
        f"""
        import json, os, resource, signal, numpy as np, torch
        torch.cuda.is_available = lambda: False
        import gadgetloader as gl
        d = {str(tmp_path)!r}
        small = np.arange(6, dtype=np.float32).reshape(2, 3)
        for ext in ("npy", "h5", "zarr"):
            gl.DataGadget(small, placement="cpu").save(f"{{d}}/t.{{ext}}")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
        big = gl.DataGadget(np.ones((100_000, 8), np.float32), placement="cpu")
        out = {{}}
        for ext in ("npy", "h5", "zarr"):
            try:
                big.save(f"{{d}}/t.{{ext}}", **({{"compression": "none"}} if ext == "zarr" else {{}}))
                err = None
            except Exception as e:
                err = [[c.__name__ for c in type(e).__mro__], str(e)]
            same = np.array_equal(gl.DataGadget(f"{{d}}/t.{{ext}}", placement="cpu").getNumpyVersion(), small)
            out[ext] = [err, same, sorted(os.listdir(d))]
        print(json.dumps(out))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for ext in ("npy", "h5", "zarr"):
        err, same, listing = out[ext]
        assert err is not None, ext
        assert same, ext  # the old file is intact
        assert listing == ["t.h5", "t.npy", "t.zarr"], (ext, listing)  # no partial file left
    for ext in ("npy", "h5"):
        names, msg = out[ext][0]
        assert "GadgetFileError" in names
        assert f"t.{ext}" in msg and "cannot write rows" in msg
    assert "OSError" in out["zarr"][0][0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_onto_a_directory_is_refused(tmp_path, fmt):
    target = tmp_path / f"dir{EXT[fmt]}"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    with pytest.raises(gl.GadgetFileError, match="dir"):
        gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu").save(str(target))
    assert (target / "keep.txt").read_text() == "keep"
    assert sorted(os.listdir(target)) == ["keep.txt"]


def test_save_zarr_onto_a_regular_file_is_refused(tmp_path):
    target = tmp_path / "file.zarr"
    target.write_text("not a store")
    with pytest.raises(gl.GadgetFileError, match="zarr"):
        gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu").save(str(target))
    assert target.read_text() == "not a store"


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_into_missing_folder(tmp_path, fmt):
    p = tmp_path / "nodir" / f"x{EXT[fmt]}"
    with pytest.raises(gl.GadgetFileNotFoundError, match="nodir"):
        gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu").save(str(p))
    assert not os.path.exists(tmp_path / "nodir")


@pytest.mark.parametrize("path", [None, b"/tmp/x.npy", 3])
def test_save_and_load_path_types(tmp_path, path):
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.save(path)
    with pytest.raises(gl.GadgetTypeError):
        g.load(path)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.ones((3, 2)))


def test_save_and_open_pathlike(tmp_path):
    arr = np.arange(6, dtype=np.int8).reshape(3, 2)
    for fmt in FORMATS:
        p = tmp_path / f"pl{EXT[fmt]}"
        gl.DataGadget(arr, placement="cpu").save(p)
        np.testing.assert_array_equal(gl.DataGadget(p, placement="file").getNumpyVersion(), arr)


def test_save_through_symlink_and_hard_link(tmp_path):
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    real = tmp_path / "real.npy"
    gl.DataGadget(arr, placement="cpu").save(str(real))
    os.symlink(real, tmp_path / "sl.npy")
    os.link(real, tmp_path / "hl.npy")
    gl.DataGadget(arr + 1, placement="cpu").save(str(tmp_path / "sl.npy"))
    assert os.path.islink(tmp_path / "sl.npy")
    np.testing.assert_array_equal(np.load(real), arr + 1)
    np.testing.assert_array_equal(np.load(tmp_path / "hl.npy"), arr)


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_save_keeps_permission_bits(tmp_path, fmt):
    p = tmp_path / f"perm{EXT[fmt]}"
    gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu").save(str(p))
    os.chmod(p, 0o640)
    gl.DataGadget(np.zeros((3, 2), np.float32), placement="cpu").save(str(p))
    assert os.stat(p).st_mode & 0o777 == 0o640
    np.testing.assert_array_equal(_read_native(p, fmt), np.zeros((3, 2)))


def test_save_replaces_whole_hdf5_and_zarr_group(tmp_path):
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    ph = tmp_path / "multi.h5"
    with h5py.File(ph, "w") as f:
        f["a"] = arr
        f["b/c"] = arr
    gl.DataGadget(arr * 2, placement="cpu").save(str(ph), dataset="emb")
    with h5py.File(ph, "r") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    assert names == ["emb"]
    pz = tmp_path / "multi.zarr"
    grp = zarr.open_group(str(pz), mode="w")
    grp.create_array("a", shape=arr.shape, dtype=arr.dtype)[...] = arr
    grp.create_array("b", shape=arr.shape, dtype=arr.dtype)[...] = arr
    gl.DataGadget(arr * 3, placement="cpu").save(str(pz), dataset="emb")
    # the store now holds only the one array, so dataset= is optional again
    np.testing.assert_array_equal(
        gl.DataGadget(str(pz), placement="cpu").getNumpyVersion(), arr * 3
    )
    with pytest.raises(gl.GadgetKeyError, match="emb"):
        gl.DataGadget(str(pz), placement="cpu", dataset="a")


def test_savecupy_appends_npy_and_loadcupy(tmp_path):
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    g = gl.DataGadget(arr, placement="cpu")
    g.saveCupy(str(tmp_path / "emb"))
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), arr)
    h = gl.DataGadget(np.zeros((1, 5), np.float64), placement="cpu")
    h.loadCupy(str(tmp_path / "emb.npy"))
    assert h.shape == (3, 2) and h.dtype == torch.float32
    np.testing.assert_array_equal(h.getNumpyVersion(), arr)


def test_save_with_forced_format_then_detect_by_content(tmp_path):
    arr = np.arange(6, dtype=np.int32).reshape(3, 2)
    g = gl.DataGadget(arr, placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="format"):
        g.save(str(tmp_path / "x.bin"))
    assert not os.path.exists(tmp_path / "x.bin")
    for fmt, name in (("hdf5", "x.bin"), ("zarr", "zd"), ("npy", "np_noext")):
        g.save(str(tmp_path / name), format=fmt)
        np.testing.assert_array_equal(
            gl.DataGadget(str(tmp_path / name), placement="file").getNumpyVersion(), arr
        )
    assert not os.path.exists(tmp_path / "np_noext.npy")


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_failed_load_leaves_table_unchanged(tmp_path, placement):
    arr = np.arange(12, dtype=np.float64).reshape(4, 3)
    p = tmp_path / "good.npy"
    np.save(p, arr)
    g = gl.DataGadget(str(p), placement=placement)
    trunc = tmp_path / "trunc.npy"
    np.save(trunc, np.ones((50, 3)))
    os.truncate(trunc, 200)
    for call in (lambda: g.load(str(trunc)), lambda: g.loadCupy(str(trunc))):
        with pytest.raises(gl.GadgetFileError, match="truncated"):
            call()
        assert g.shape == (4, 3)
        np.testing.assert_array_equal(g.getData(torch.arange(4)).numpy(), arr)
    with pytest.raises(gl.GadgetFileNotFoundError):
        g.load(str(tmp_path / "missing.h5"))
    with pytest.raises(gl.GadgetValueError, match="dataset"):
        g.load(str(p), dataset="x")
    np.testing.assert_array_equal(g.getData(torch.arange(4)).numpy(), arr)


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_replaces_shape_and_dtype_keeping_placement(tmp_path, fmt):
    arr = np.arange(10, dtype=np.int16).reshape(5, 2)
    p = tmp_path / f"l{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    for placement in ("cpu", "file"):
        np.save(tmp_path / "start.npy", np.ones((2, 7), np.float32))
        g = gl.DataGadget(str(tmp_path / "start.npy"), placement=placement)
        g.load(str(p))
        assert g.placement == placement and g.shape == (5, 2) and g.dtype == torch.int16
        np.testing.assert_array_equal(g.getData(torch.arange(5)).numpy(), arr)
        g.close()


# ----------------------------------------------------------------------------- convert specifics
def test_convert_refuses_its_own_source(tmp_path):
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    src = tmp_path / "a.npy"
    np.save(src, arr)
    os.symlink(src, tmp_path / "link.npy")
    os.link(src, tmp_path / "hard.npy")
    before = _tree_digest(src)
    for dst in ("a.npy", "link.npy", "hard.npy"):
        with pytest.raises(gl.GadgetValueError, match="same file"):
            convert(str(src), str(tmp_path / dst), progress=False)
    assert _tree_digest(src) == before


def test_convert_one_dataset_onto_its_own_hdf5_file_is_refused(tmp_path):
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f["a"] = arr
        f["b"] = arr * 2
    before = _tree_digest(p)
    with pytest.raises(gl.GadgetValueError):
        convert(str(p), str(p), dataset="a", dst_dataset="c", progress=False)
    assert _tree_digest(p) == before


def test_convert_missing_source_and_bad_dataset(tmp_path):
    with pytest.raises(gl.GadgetFileNotFoundError, match="nope.npy"):
        convert(str(tmp_path / "nope.npy"), str(tmp_path / "out.h5"), progress=False)
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f["p/q"] = np.ones((3, 2))
        f["r"] = np.ones((3, 2))
    with pytest.raises(gl.GadgetKeyError, match="p/q"):
        convert(str(p), str(tmp_path / "out.zarr"), progress=False)
    with pytest.raises(gl.GadgetKeyError, match="zz"):
        convert(str(p), str(tmp_path / "out.zarr"), dataset="zz", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["m.h5"]


def test_convert_dataset_names(tmp_path):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f["p/q"] = arr
        f["r"] = arr * 2
    convert(str(p), str(tmp_path / "o.zarr"), dataset="p/q", progress=False)
    np.testing.assert_array_equal(
        gl.DataGadget(str(tmp_path / "o.zarr"), placement="cpu", dataset="p/q").getNumpyVersion(),
        arr,
    )
    convert(str(p), str(tmp_path / "o2.h5"), dataset="r", dst_dataset="new/name", progress=False)
    np.testing.assert_array_equal(_read_native(tmp_path / "o2.h5", "hdf5", "new/name"), arr * 2)
    with pytest.raises(gl.GadgetValueError, match="npy"):
        convert(str(p), str(tmp_path / "o3.npy"), dataset="r", dst_dataset="x", progress=False)
    assert not os.path.exists(tmp_path / "o3.npy")


def test_convert_bad_options_before_any_file(tmp_path):
    src = tmp_path / "a.npy"
    np.save(src, np.ones((3, 2), np.float32))
    good = tmp_path / "good.h5"
    convert(str(src), str(good), progress=False)
    before = _tree_digest(good)
    with pytest.raises(gl.GadgetKeyError, match="zstd"):
        convert(str(src), str(good), compression="zstd", progress=False)
    with pytest.raises(gl.GadgetTypeError, match="progress"):
        convert(str(src), str(good), progress="False")
    with pytest.raises(gl.GadgetValueError, match="chunk_rows"):
        convert(str(src), str(good), chunk_rows=0, progress=False)
    assert _tree_digest(good) == before
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "good.h5"]


def test_convert_cli_exit_status(tmp_path, capsys):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    src = tmp_path / "a.npy"
    np.save(src, arr)
    dst = tmp_path / "c.h5"
    rc = cli_main(
        [
            "convert",
            str(src),
            str(dst),
            "--chunk-rows",
            "2",
            "--compression",
            "gzip",
            "--no-progress",
        ]
    )
    assert rc == 0
    with h5py.File(dst, "r") as f:
        ds = f[list(f.keys())[0]]
        assert ds.chunks == (2, 3) and ds.compression == "gzip"
        np.testing.assert_array_equal(ds[...], arr)
    capsys.readouterr()
    rc = cli_main(["convert", str(tmp_path / "nope.npy"), str(tmp_path / "x.h5"), "--no-progress"])
    assert rc != 0
    out = capsys.readouterr()
    assert "nope.npy" in out.err + out.out
    assert not os.path.exists(tmp_path / "x.h5")
    rc = cli_main(["convert", str(src), str(src), "--no-progress"])
    assert rc != 0
    np.testing.assert_array_equal(np.load(src), arr)


# ----------------------------------------------------------------------------- immutable targets
@pytest.mark.skipif(not _has_chattr(), reason="needs chattr and root")
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_into_unwritable_folder(tmp_path, fmt):
    folder = tmp_path / "lock"
    folder.mkdir()
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    p = folder / f"t{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    before = _tree_digest(p)
    subprocess.run(["chattr", "+i", str(folder)], check=True)
    try:
        for target in (p, folder / f"new{EXT[fmt]}"):
            with pytest.raises(gl.ReadOnlyError) as ei:
                gl.DataGadget(arr + 1, placement="cpu").save(str(target))
            assert isinstance(ei.value, PermissionError)
            assert str(folder) in str(ei.value)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert _tree_digest(p) == before
    assert sorted(os.listdir(folder)) == [p.name]


@pytest.mark.skipif(not _has_chattr(), reason="needs chattr and root")
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_over_immutable_target(tmp_path, fmt):
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    p = tmp_path / f"t{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    before = _tree_digest(p)
    subprocess.run(["chattr", "+i", str(p)], check=True)
    try:
        with pytest.raises(gl.ReadOnlyError, match="old"):
            gl.DataGadget(arr + 1, placement="cpu").save(str(p))
    finally:
        subprocess.run(["chattr", "-i", str(p)], check=True)
    assert _tree_digest(p) == before
    assert _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- datasets / DataLoader
def test_gadget_dataset_file_columns(tmp_path):
    from torch.utils.data import DataLoader

    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    y = np.arange(16, dtype=np.int64)
    w = x[:, 0].copy()
    gl.DataGadget(x, placement="cpu").save(str(tmp_path / "x.h5"), chunk_rows=4, compression="lzf")
    gl.DataGadget(y, placement="cpu").save(str(tmp_path / "y.zarr"), chunk_rows=4)
    np.save(tmp_path / "w.npy", w)
    ds = gl.GadgetDataset(
        str(tmp_path / "x.h5"),
        str(tmp_path / "y.zarr"),
        str(tmp_path / "w.npy"),
        placement="file",
        device="cpu",
    )
    assert len(ds) == 16
    b = ds[[3, 1, 3]]
    np.testing.assert_array_equal(b[0].numpy(), x[[3, 1, 3]])
    np.testing.assert_array_equal(b[1].numpy(), y[[3, 1, 3]])
    np.testing.assert_array_equal(b[2].numpy(), w[[3, 1, 3]])
    for nw in (0, 2):
        got = list(DataLoader(ds, batch_size=5, num_workers=nw))
        np.testing.assert_array_equal(torch.cat([g[0] for g in got]).numpy(), x)
        np.testing.assert_array_equal(torch.cat([g[1] for g in got]).numpy(), y)
        np.testing.assert_array_equal(torch.cat([g[2] for g in got]).numpy(), w)
    ds.close()


def test_gadget_dataset_passes_dataset_option(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f["emb/words"] = x
        f["other"] = np.zeros((6, 2))
    ds = gl.GadgetDataset(str(p), placement="file", device="cpu", dataset="emb/words")
    np.testing.assert_array_equal(ds[[5, 0]][0].numpy(), x[[5, 0]])
    with pytest.raises(gl.GadgetKeyError, match="emb/words"):
        gl.GadgetDataset(str(p), placement="file", device="cpu")
    short = tmp_path / "short.h5"
    with h5py.File(short, "w") as f:
        f["emb/words"] = np.zeros((5, 2), np.float32)
    with pytest.raises(gl.GadgetValueError, match="rows"):
        gl.GadgetDataset(str(p), str(short), placement="file", device="cpu", dataset="emb/words")


def test_workers_see_writes_made_between_epochs(tmp_path):
    from torch.utils.data import DataLoader

    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    p = tmp_path / "x.h5"
    gl.DataGadget(x, placement="cpu").save(str(p), chunk_rows=4)
    g = gl.DataGadget(str(p), placement="file")
    ds = gl.GadgetDataset(g, device="cpu")
    dl = DataLoader(ds, batch_size=8, num_workers=2)
    e1 = torch.cat([b[0] for b in dl])
    np.testing.assert_array_equal(e1.numpy(), x)
    g.insertData(torch.full((2, 4), -1.0), [0, 15])
    e2 = torch.cat([b[0] for b in dl])
    ref = x.copy()
    ref[[0, 15]] = -1
    np.testing.assert_array_equal(e2.numpy(), ref)
    g.close()


def test_pinned_request_falls_back_to_cpu_with_file_rows(tmp_path):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / "a.h5"
    gl.DataGadget(arr, placement="cpu").save(str(p))
    import warnings

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        g = gl.DataGadget(str(p), placement="pinned")
    # "falls back with one warning" (at most one: the library says it once)
    assert len(rec) <= 1 and all(issubclass(r.category, gl.FallbackWarning) for r in rec)
    assert g.placement == "cpu"
    np.testing.assert_array_equal(g.getData([3, 0]).numpy(), arr[[3, 0]])


# ----------------------------------------------------------------------------- more edges
def test_bfloat16_is_stored_as_uint16_bits_plus_attribute(tmp_path):
    ref = (torch.randn(5, 3) * 100).to(torch.bfloat16)
    for fmt in ("hdf5", "zarr"):
        p = tmp_path / f"b{EXT[fmt]}"
        gl.DataGadget(ref, placement="cpu").save(str(p))
        if fmt == "hdf5":
            with h5py.File(p, "r") as f:
                ds = f[list(f.keys())[0]]
                assert ds.dtype == np.uint16 and len(ds.attrs) >= 1
                raw = ds[...]
        else:
            z = zarr.open_array(str(p), mode="r")
            assert z.dtype == np.uint16 and len(dict(z.attrs)) >= 1
            raw = z[...]
        np.testing.assert_array_equal(raw, ref.view(torch.int16).numpy().view(np.uint16))
        g = gl.DataGadget(str(p), placement="file")
        assert g.dtype == torch.bfloat16
        # getNumpyVersion: "bfloat16 tables come back as float32 (exact)"
        v = g.getNumpyVersion()
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, ref.float().numpy())
        g.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_ids_of_any_integer_dtype(tmp_path, fmt):
    arr = np.arange(30, dtype=np.float32).reshape(10, 3)
    p = tmp_path / f"i{EXT[fmt]}"
    gl.DataGadget(arr, placement="cpu").save(str(p), **({} if fmt == "npy" else {"chunk_rows": 3}))
    g = gl.DataGadget(str(p), placement="file")
    for ids in (
        np.array([9, 1], np.uint8),
        np.array([9, 1], np.int16),
        torch.tensor([9, 1], dtype=torch.int32),
        range(8, 10),
    ):
        np.testing.assert_array_equal(g.getData(ids).numpy(), arr[np.asarray(list(ids))])
    assert g.getData(torch.tensor([], dtype=torch.int64)).shape == (0, 3)
    for bad in ([True, False], torch.tensor([True, False]), torch.tensor([1.0])):
        with pytest.raises(gl.GadgetTypeError):
            g.getData(bad)
    g.insertData(torch.full((1, 3), -2.0), np.array([3], np.uint8))
    g.close()
    ref = arr.copy()
    ref[3] = -2
    np.testing.assert_array_equal(_read_native(p, fmt), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_relative_path_survives_chdir(tmp_path, fmt, monkeypatch):
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    gl.DataGadget(arr, placement="cpu").save(str(tmp_path / "a" / f"t{EXT[fmt]}"))
    gl.DataGadget(arr * 100, placement="cpu").save(str(tmp_path / "b" / f"t{EXT[fmt]}"))
    monkeypatch.chdir(tmp_path / "a")
    g = gl.DataGadget(f"t{EXT[fmt]}", placement="file", cache_bytes=0)
    monkeypatch.chdir(tmp_path / "b")
    np.testing.assert_array_equal(g.getData([1]).numpy(), arr[[1]])
    g.insertData(torch.full((1, 3), -1.0), [0])
    g.close()
    np.testing.assert_array_equal(
        _read_native(tmp_path / "a" / f"t{EXT[fmt]}", fmt)[0], [-1, -1, -1]
    )
    np.testing.assert_array_equal(_read_native(tmp_path / "b" / f"t{EXT[fmt]}", fmt), arr * 100)


def test_npy_header_versions_and_hdf5_userblock(tmp_path):
    arr = np.arange(30, dtype=np.float32).reshape(10, 3)
    paths = []
    for v in ((1, 0), (2, 0), (3, 0)):
        p = tmp_path / f"v{v[0]}.npy"
        with open(p, "wb") as fh:
            np.lib.format.write_array(fh, arr, version=v)
        paths.append((p, "npy"))
    ub = tmp_path / "ub.h5"
    with h5py.File(ub, "w", userblock_size=512) as f:
        f["x"] = arr
    shutil.copy(ub, tmp_path / "ub_noext")
    paths += [(ub, "hdf5"), (tmp_path / "ub_noext", "hdf5")]
    for p, fmt in paths:
        for placement in ("cpu", "file"):
            np.testing.assert_array_equal(
                gl.DataGadget(str(p), placement=placement).getData(slice(0, 10)).numpy(), arr
            )
        g = gl.DataGadget(str(p), placement="file")
        g.insertData(torch.tensor([[7.0, 8.0, 9.0]]), [5])
        g.close()
        ref = arr.copy()
        ref[5] = [7, 8, 9]
        np.testing.assert_array_equal(_read_native(p, fmt), ref)


def test_zarr_v2_fortran_order_chunks(tmp_path):
    arr = np.arange(30, dtype=np.float32).reshape(10, 3)
    p = tmp_path / "f.zarr"
    z = zarr.create_array(
        store=str(p), shape=arr.shape, chunks=(4, 3), dtype=arr.dtype, zarr_format=2, order="F"
    )
    z[...] = arr
    for placement in ("cpu", "file"):
        np.testing.assert_array_equal(
            gl.DataGadget(str(p), placement=placement).getData(slice(0, 10)).numpy(), arr
        )
    g = gl.DataGadget(str(p), placement="file")
    g.insertData(torch.tensor([[7.0, 8.0, 9.0]]), [5])
    g.close()
    assert zarr.open_array(str(p), mode="r")[5].tolist() == [7.0, 8.0, 9.0]


def test_corrupt_zarr_metadata(tmp_path):
    p = tmp_path / "cj.zarr"
    gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu").save(str(p))
    (p / "zarr.json").write_text("{not json")
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError, match="cj.zarr"):
            gl.DataGadget(str(p), placement=placement)


def test_ctrl_c_during_save_leaves_old_file_and_no_partial(tmp_path):
    """README: "An interrupt (Ctrl-C) during a save ... removes the partial file; one that comes
    while the finished file replaces the target is held until it is in place"."""
    script = textwrap.dedent(
        f"""
        import json, os, signal, threading, numpy as np, torch
        torch.cuda.is_available = lambda: False
        import gadgetloader as gl
        signal.signal(signal.SIGINT, signal.default_int_handler)
        d = {str(tmp_path)!r}
        small = np.arange(6, dtype=np.float32).reshape(2, 3)
        big = gl.DataGadget(np.ones((1 << 20, 32), np.float32), placement="cpu")
        out = {{}}
        for ext in ("npy", "h5", "zarr"):
            p = f"{{d}}/t.{{ext}}"
            gl.DataGadget(small, placement="cpu").save(p)
            timer = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                big.save(p)
                res = None
            except KeyboardInterrupt as e:
                res = str(e)
            timer.join()
            shape = list(gl.DataGadget(p, placement="cpu").shape)
            out[ext] = [res, shape, sorted(os.listdir(d))]
        print(json.dumps(out))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for ext, (res, shape, listing) in out.items():
        assert res is not None, f"{ext}: the interrupt was lost"
        if "interrupted after" in res:
            assert shape == [1 << 20, 32], ext
        else:
            assert shape == [2, 3], ext  # the old file is intact
        assert not [n for n in listing if ".partial-" in n or ".old-" in n], (ext, listing)
