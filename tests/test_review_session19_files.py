"""Session 19 review probes: README "Files: .npy, HDF5 and zarr", "Rows in and out", "Errors".

Written as an independent user from the README and docstrings; every value is checked
against NumPy / plain torch.
"""

from __future__ import annotations

import collections
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(autouse=True)
def _rows_delivered_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """These probes check a CPU machine's behaviour against NumPy: on a CUDA machine rows
    would arrive on the GPU by default (``device=None``), so the default is the CPU here."""
    import gadgetloader._device as _dev

    monkeypatch.setattr(_dev, "default_device", lambda: torch.device("cpu"))


h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

A = np.arange(40, dtype=np.float32).reshape(10, 4)
FORMATS = ["npy", "h5", "zarr"]


def _save(arr, path, **kw):
    gl.DataGadget(arr, placement="cpu").save(str(path), **kw)


def _read(path, **kw):
    return gl.DataGadget(str(path), placement="cpu", **kw).as_tensor().clone()


def _tree_bytes(path):
    """Every file's bytes under ``path`` (a file or a directory)."""
    path = str(path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": f.read()}
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def _hidden(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


# ---------------------------------------------------------------- round trips


_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_every_table_dtype_round_trips_bit_exactly(tmp_path, fmt, dtype):
    """README: "Every table dtype round-trips bit-exactly; bfloat16 is stored as uint16 bits
    plus an attribute (it has no .npy form)"."""
    if dtype.is_floating_point:
        t = torch.randn(13, 3, generator=torch.Generator().manual_seed(1)).to(dtype)
        t[0, 0] = float("nan")
        t[0, 1] = float("-inf")
        t[0, 2] = -0.0
    elif dtype == torch.bool:
        t = torch.arange(39).reshape(13, 3) % 3 == 0
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (13, 3), dtype=torch.int64).to(dtype)
        t[0, 0], t[0, 1] = info.min, info.max
    p = tmp_path / f"t.{fmt}"
    if fmt == "npy" and dtype == torch.bfloat16:
        with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
            gl.DataGadget(t, placement="cpu").save(str(p))
        assert not p.exists() and _hidden(tmp_path) == []
        return
    gl.DataGadget(t, placement="cpu").save(str(p))
    back = _read(p)
    assert back.dtype == dtype
    bits = {2: torch.int16, 1: torch.uint8, 4: torch.int32, 8: torch.int64}[t.element_size()]
    if dtype == torch.bool:
        assert torch.equal(back, t)
    else:
        assert torch.equal(back.view(bits), t.view(bits))
    f = gl.DataGadget(str(p), placement="file")
    ids = [12, 0, 5, 0]
    got = f.getData(ids)
    assert got.dtype == dtype
    if dtype == torch.bool:
        assert torch.equal(got, t[ids])
    else:
        assert torch.equal(got.view(bits), t[ids].view(bits))
    f.close()


def test_bfloat16_hdf5_keeps_uint16_bits_and_attribute(tmp_path):
    t = torch.tensor([[1.5, -2.25], [3.0, 1e30]], dtype=torch.bfloat16)
    p = tmp_path / "b.h5"
    gl.DataGadget(t, placement="cpu").save(str(p), dataset="emb")
    with h5py.File(p, "r") as f:
        ds = f["emb"]
        assert ds.dtype == np.uint16
        assert np.array_equal(ds[...], t.view(torch.int16).numpy().view(np.uint16))
        assert any("bfloat16" in str(v) for v in ds.attrs.values())


def test_save_options_reach_the_file(tmp_path):
    p = tmp_path / "o.h5"
    _save(A, p, dataset="g/emb", chunk_rows=3, compression="gzip")
    with h5py.File(p, "r") as f:
        assert list(f.keys()) == ["g"]
        assert f["g/emb"].chunks == (3, 4)
        assert f["g/emb"].compression == "gzip"
        assert np.array_equal(f["g/emb"][...], A)
    pz = tmp_path / "o.zarr"
    _save(A, pz, dataset="g/emb", chunk_rows=3, compression="blosc")
    z = zarr.open_array(str(pz / "g" / "emb"), mode="r")
    assert z.chunks[0] == 3
    assert np.array_equal(z[...], A)
    assert torch.equal(_read(pz, dataset="g/emb"), torch.from_numpy(A))


# ---------------------------------------------------------------- errors on open


def test_hdf5_wrong_dataset_name_lists_the_ones_there(tmp_path):
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f["x"] = A
        f["g/y"] = A * 2
        f.create_group("empty")
    with pytest.raises(gl.GadgetKeyError) as e:
        gl.DataGadget(str(p), dataset="nope", placement="cpu")
    assert "nope" in str(e.value) and "g/y" in str(e.value) and "'x'" in str(e.value)
    with pytest.raises(gl.GadgetKeyError) as e:  # two datasets, no name
        gl.DataGadget(str(p), placement="cpu")
    assert "g/y" in str(e.value) and str(p) in str(e.value)
    with pytest.raises(gl.GadgetKeyError):  # a group is not a dataset
        gl.DataGadget(str(p), dataset="g", placement="file")
    got = gl.DataGadget(str(p), dataset="/g/y", placement="file").getData([4, 0])
    assert torch.equal(got, torch.from_numpy(A[[4, 0]] * 2))


def test_zarr_wrong_array_name_lists_the_ones_there(tmp_path):
    p = tmp_path / "g.zarr"
    g = zarr.open_group(str(p), mode="w")
    g.create_array("p", shape=(5, 4), dtype="float32")[:] = A[:5]
    g.create_array("sub/q", shape=(3, 2), dtype="int64")[:] = 7
    with pytest.raises(gl.GadgetKeyError) as e:
        gl.DataGadget(str(p), dataset="zz", placement="cpu")
    assert "zz" in str(e.value) and "sub/q" in str(e.value) and "'p'" in str(e.value)
    with pytest.raises(gl.GadgetKeyError):
        gl.DataGadget(str(p), placement="cpu")
    assert gl.DataGadget(str(p), dataset="sub/q", placement="cpu").getData([2]).tolist() == [[7, 7]]


def test_npy_takes_no_dataset(tmp_path):
    p = tmp_path / "a.npy"
    np.save(p, A)
    with pytest.raises(gl.GadgetValueError, match="dataset"):
        gl.DataGadget(str(p), dataset="x", placement="cpu")


@pytest.mark.parametrize("name", ["nofile.npy", "nofile.h5", "nofile.zarr", "nofile"])
def test_missing_file_is_file_not_found(tmp_path, name):
    with pytest.raises(gl.GadgetFileNotFoundError) as e:
        gl.DataGadget(str(tmp_path / name), placement="cpu")
    assert isinstance(e.value, FileNotFoundError)
    assert name in str(e.value)


def test_truncated_and_non_array_files_name_the_file(tmp_path):
    np.save(tmp_path / "a.npy", A)
    raw = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(raw[:-10])
    (tmp_path / "txt.npy").write_text("hello")
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "txt.h5").write_text("hello")
    _save(A, tmp_path / "m.h5", dataset="x")
    h = (tmp_path / "m.h5").read_bytes()
    (tmp_path / "tm.h5").write_bytes(h[: len(h) // 2])
    os.mkdir(tmp_path / "empty.zarr")
    for name in ["t.npy", "txt.npy", "empty.npy", "txt.h5", "tm.h5", "empty.zarr"]:
        with pytest.raises(gl.GadgetFileError) as e:
            gl.DataGadget(str(tmp_path / name), placement="cpu")
        assert name in str(e.value), (name, str(e.value))


def test_unsupported_dtypes_and_shapes_are_clear_errors(tmp_path):
    np.save(tmp_path / "o.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    np.save(tmp_path / "s.npy", np.array([["a", "b"]]))
    np.save(tmp_path / "c.npy", np.zeros((3, 4), np.complex64))
    np.save(tmp_path / "sc.npy", np.float32(3))
    np.save(tmp_path / "z.npy", np.zeros((0, 4), np.float32))
    for name, cls in [
        ("o.npy", gl.GadgetTypeError),
        ("s.npy", gl.GadgetTypeError),
        ("c.npy", gl.GadgetTypeError),
        ("sc.npy", gl.GadgetValueError),
        ("z.npy", gl.GadgetValueError),
    ]:
        with pytest.raises(cls) as e:
            gl.DataGadget(str(tmp_path / name), placement="cpu")
        assert name in str(e.value)
    with pytest.raises(gl.GadgetValueError, match="zero rows"):
        gl.DataGadget((0, 4), placement="cpu").save(str(tmp_path / "z2.npy"))
    assert not (tmp_path / "z2.npy").exists() and _hidden(tmp_path) == []


def test_dtype_argument_must_match_file(tmp_path):
    """README Errors: a file that fits a table's shape but not its dtype: GadgetTypeError."""
    np.save(tmp_path / "a.npy", A)
    with pytest.raises(gl.GadgetTypeError, match="float64"):
        gl.DataGadget(str(tmp_path / "a.npy"), placement="cpu", dtype="float64")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(str(tmp_path / "a.npy"), placement="file", dtype="float64")


def test_format_from_content_and_forced(tmp_path):
    np.save(tmp_path / "n.npy", A)
    os.rename(tmp_path / "n.npy", tmp_path / "noext")
    assert torch.equal(_read(tmp_path / "noext"), torch.from_numpy(A))
    _save(A * 2, tmp_path / "x.h5")
    shutil.copy(tmp_path / "x.h5", tmp_path / "h5noext")
    assert torch.equal(_read(tmp_path / "h5noext"), torch.from_numpy(A * 2))
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(str(tmp_path / "x.h5"), format="npy", placement="cpu")
    with pytest.raises(gl.GadgetKeyError, match="xyz"):
        gl.DataGadget(str(tmp_path / "x.h5"), format="xyz", placement="cpu")
    _save(A, tmp_path / "o.bin", format="npy")
    assert np.array_equal(np.load(tmp_path / "o.bin"), A)
    with pytest.raises(gl.GadgetValueError, match="format"):
        _save(A, tmp_path / "o2.bin")


def test_file_only_options_refused_elsewhere(tmp_path):
    np.save(tmp_path / "a.npy", A)
    for kw in [{"writable": True}, {"cache_bytes": 1}]:
        with pytest.raises(gl.GadgetTypeError):
            gl.DataGadget(str(tmp_path / "a.npy"), placement="cpu", **kw)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(A, placement="cpu", writable=False)
    with pytest.raises(gl.GadgetTypeError, match="bogus"):
        gl.DataGadget(str(tmp_path / "a.npy"), placement="file", bogus=1)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(str(tmp_path / "a.npy"), placement="cpu", progress="False")


@pytest.mark.parametrize("value", [1, 0, "True", "no", 2])
def test_writable_takes_only_true_false_none(tmp_path, value):
    """README: `writable=` takes only `True`, `False` or `None`."""
    np.save(tmp_path / "a.npy", A)
    with pytest.raises(gl.GadgetTypeError, match="writable"):
        gl.DataGadget(str(tmp_path / "a.npy"), placement="file", writable=value)


# ---------------------------------------------------------------- file tables


def _file_path(tmp_path, fmt, arr=A, **kw):
    p = tmp_path / f"t.{fmt}"
    if fmt == "npy":
        np.save(p, arr)
    else:
        _save(arr, p, **kw)
    return p


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_reads_and_writes_through(tmp_path, fmt):
    kw = {} if fmt == "npy" else {"chunk_rows": 3}
    p = _file_path(tmp_path, fmt, **kw)
    g = gl.DataGadget(str(p), placement="file")
    ref = A.copy()
    assert g.shape == (10, 4) and len(g) == 10 and g.dtype == torch.float32 and g.nbytes == 160
    ids = torch.tensor([[9, 0], [3, 3]], dtype=torch.int32)
    assert torch.equal(g.getData(ids), torch.from_numpy(ref[ids.numpy()]))
    assert g.getData(np.array([], dtype=np.int64)).shape == (0, 4)
    assert torch.equal(g.getData(slice(2, 9, 3)), torch.from_numpy(ref[2:9:3]))
    assert torch.equal(g.getData((slice(0, 10), slice(1, 3))), torch.from_numpy(ref[:, 1:3]))
    # repeated ids: the last occurrence wins
    rows = torch.stack([torch.full((4,), float(i)) for i in range(4)])
    g.insertData(rows, [5, 1, 5, 9])
    ref[1], ref[5], ref[9] = 1.0, 2.0, 3.0
    # partial write through a tuple index
    g.insertData(torch.full((2, 2), -1.0), (slice(0, 2), slice(2, 4)))
    ref[0:2, 2:4] = -1.0
    g[[7]] = torch.full((1, 4), 7.0)
    ref[7] = 7.0
    assert torch.equal(g.getData(list(range(10))), torch.from_numpy(ref))
    assert np.array_equal(g.getNumpyVersion(), ref)
    g.flush()
    assert torch.equal(_read(p), torch.from_numpy(ref))
    g.close()
    assert torch.equal(_read(p), torch.from_numpy(ref))


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_bad_writes_leave_file_unchanged(tmp_path, fmt):
    p = _file_path(tmp_path, fmt)
    g = gl.DataGadget(str(p), placement="file")
    before = _read(p)
    bad = [
        (gl.GadgetIndexError, lambda: g.insertData(torch.ones(2, 4), [1, 10])),
        (gl.GadgetIndexError, lambda: g.insertData(torch.ones(2, 4), [1, -1])),
        (gl.GadgetValueError, lambda: g.insertData(torch.ones(2, 3), [1, 2])),
        (gl.GadgetValueError, lambda: g.insertData(torch.ones(3, 4), [1, 2])),
        (gl.GadgetTypeError, lambda: g.insertData(np.ones((2, 4)), [1, 2])),
        (gl.GadgetTypeError, lambda: g.insertData(torch.ones(1, 4, dtype=torch.float16), [1])),
        (gl.GadgetTypeError, lambda: g.insertData(torch.ones(1, 4), [1.0])),
        (gl.GadgetValueError, lambda: g.fill_(1e40)),
        (gl.GadgetValueError, lambda: g.normal_(0, -1)),
    ]
    for cls, call in bad:
        with pytest.raises(cls) as e:
            call()
        assert (
            "expected" in str(e.value)
            or "must" in str(e.value)
            or "needs" in str(e.value)
            or "overflows" in str(e.value)
        ), str(e.value)
    g.flush()
    assert torch.equal(_read(p), before)
    g.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_writable_false(tmp_path, fmt):
    p = _file_path(tmp_path, fmt)
    g = gl.DataGadget(str(p), placement="file", writable=False)
    before = _tree_bytes(p)
    for call in (lambda: g.insertData(torch.ones(1, 4), [0]), lambda: g.fill_(1.0), g.zero_):
        with pytest.raises(gl.ReadOnlyError) as e:
            call()
        assert isinstance(e.value, PermissionError) and "writable=False" in str(e.value)
    assert torch.equal(g.getData([3]), torch.from_numpy(A[[3]]))
    g.close()
    assert _tree_bytes(p) == before


def test_fortran_npy_reads_right_and_is_read_only_as_file_table(tmp_path):
    p = tmp_path / "fo.npy"
    np.save(p, np.asfortranarray(A))
    assert torch.equal(_read(p), torch.from_numpy(A))
    g = gl.DataGadget(str(p), placement="file")
    assert torch.equal(g.getData([3, 1]), torch.from_numpy(A[[3, 1]]))
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        g.insertData(torch.ones(1, 4), [0])
    g.close()
    assert np.array_equal(np.load(p), A)


def test_big_endian_npy_read_and_written_in_its_byte_order(tmp_path):
    p = tmp_path / "be.npy"
    np.save(p, A.astype(">f4"))
    assert torch.equal(_read(p), torch.from_numpy(A))
    g = gl.DataGadget(str(p), placement="file")
    assert torch.equal(g.getData([3, 1]), torch.from_numpy(A[[3, 1]]))
    g.insertData(torch.full((1, 4), 5.0), [0])
    g.close()
    back = np.load(p)
    assert back.dtype == np.dtype(">f4")
    ref = A.copy()
    ref[0] = 5.0
    assert np.array_equal(back, ref)


def test_hdf5_layouts_read_and_write_right(tmp_path):
    p = tmp_path / "v.h5"
    three = np.arange(60, dtype=np.float64).reshape(5, 3, 4)
    with h5py.File(p, "w") as f:
        f["one"] = np.arange(7, dtype=np.int16)
        f["three"] = three
        f.create_dataset("unalloc", shape=(6, 3), dtype="i4", fillvalue=7, chunks=(2, 3))
        f.create_dataset("colchunk", data=A, chunks=(3, 2))
        f.create_dataset(
            "filt", data=A, chunks=(3, 4), shuffle=True, fletcher32=True, compression="gzip"
        )
        f["soft"] = h5py.SoftLink("/colchunk")
    assert gl.DataGadget(str(p), dataset="one", placement="file").getData([[6, 0]]).tolist() == [
        [6, 0]
    ]
    assert gl.DataGadget(str(p), dataset="unalloc", placement="file").getData([5]).tolist() == [
        [7, 7, 7]
    ]
    assert torch.equal(
        gl.DataGadget(str(p), dataset="soft", placement="cpu").as_tensor(), torch.from_numpy(A)
    )
    g = gl.DataGadget(str(p), dataset="three", placement="file")
    assert torch.equal(g.getData([4, 0]), torch.from_numpy(three[[4, 0]]))
    g.insertData(torch.full((2, 3, 4), -1.0, dtype=torch.float64), [1, 3])
    g.close()
    for name in ("colchunk", "filt"):
        c = gl.DataGadget(str(p), dataset=name, placement="file")
        c.insertData(torch.full((2, 4), 5.0), [9, 0])
        c.close()
    ref3 = three.copy()
    ref3[[1, 3]] = -1
    ref = A.copy()
    ref[[0, 9]] = 5
    with h5py.File(p, "r") as f:
        assert np.array_equal(f["three"][...], ref3)
        assert np.array_equal(f["colchunk"][...], ref)
        assert np.array_equal(f["filt"][...], ref)


def test_zarr_v2_fill_value_and_shards(tmp_path):
    z2 = zarr.open_array(
        str(tmp_path / "v2.zarr"), mode="w", shape=(10, 4), chunks=(3, 4), dtype="f4", zarr_format=2
    )
    z2[:] = A
    g = gl.DataGadget(str(tmp_path / "v2.zarr"), placement="file")
    g.insertData(torch.full((2, 4), -2.0), [0, 9])
    g.close()
    ref = A.copy()
    ref[[0, 9]] = -2
    assert np.array_equal(zarr.open_array(str(tmp_path / "v2.zarr"), mode="r")[...], ref)

    zf = zarr.create_array(
        str(tmp_path / "fill.zarr"), shape=(10, 4), chunks=(3, 4), dtype="i4", fill_value=-5
    )
    zf[0:3] = 1
    g = gl.DataGadget(str(tmp_path / "fill.zarr"), placement="file")
    assert g.getData([0, 5, 9]).tolist() == [[1] * 4, [-5] * 4, [-5] * 4]
    g.insertData(torch.full((1, 4), 8, dtype=torch.int32), [7])
    g.close()
    assert zarr.open_array(str(tmp_path / "fill.zarr"), mode="r")[6:9].tolist() == [
        [-5] * 4,
        [8] * 4,
        [-5] * 4,
    ]

    b = np.arange(48, dtype="f4").reshape(12, 4)
    zs = zarr.create_array(
        str(tmp_path / "sh.zarr"), shape=(12, 4), chunks=(2, 4), shards=(6, 4), dtype="f4"
    )
    zs[:] = b
    g = gl.DataGadget(str(tmp_path / "sh.zarr"), placement="file")
    assert torch.equal(g.getData([11, 0]), torch.from_numpy(b[[11, 0]]))
    g.insertData(torch.full((1, 4), -1.0), [7])
    g.close()
    b[7] = -1
    assert np.array_equal(zarr.open_array(str(tmp_path / "sh.zarr"), mode="r")[...], b)


@pytest.mark.parametrize(
    "fmt,kw",
    [
        ("npy", {}),
        ("h5", {"chunk_rows": 7}),
        ("h5", {"chunk_rows": 16, "compression": "gzip"}),
        ("zarr", {"chunk_rows": 11}),
    ],
)
@pytest.mark.parametrize("cache", [0, 300])
def test_file_table_random_ops_match_numpy(tmp_path, fmt, kw, cache):
    rng = np.random.default_rng(hash((fmt, cache)) % 2**32)
    n, dim = 83, 3
    ref = rng.standard_normal((n, dim)).astype(np.float32)
    p = tmp_path / f"r.{fmt}"
    _save(ref.copy(), p, **kw)
    g = gl.DataGadget(str(p), placement="file", cache_bytes=cache)
    for _ in range(20):
        ids = rng.integers(0, n, rng.integers(0, 30))
        if rng.random() < 0.5:
            assert np.array_equal(g.getData(ids).numpy(), ref[ids])
        else:
            rows = rng.standard_normal((len(ids), dim)).astype(np.float32)
            g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
            for i, r in zip(ids, rows, strict=True):
                ref[i] = r
    g.close()
    assert np.array_equal(_read(p).numpy(), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_file_tables_of_one_file_see_each_others_writes(tmp_path, fmt):
    p = _file_path(tmp_path, fmt, **({} if fmt == "npy" else {"chunk_rows": 4}))
    a = gl.DataGadget(str(p), placement="file")
    b = gl.DataGadget(str(p), placement="file")
    assert torch.equal(b.getData([5]), torch.from_numpy(A[[5]]))  # cached in b
    a.insertData(torch.full((1, 4), -1.0), [5])
    assert b.getData([5]).tolist() == [[-1.0] * 4]
    b.insertData(torch.full((1, 4), -2.0), [5])
    assert a.getData([5]).tolist() == [[-2.0] * 4]
    a.close()
    b.close()


def test_hdf5_read_only_table_does_not_block_a_writer(tmp_path):
    p = tmp_path / "w.h5"
    _save(A, p, dataset="x")
    r = gl.DataGadget(str(p), placement="file", writable=False)
    w = gl.DataGadget(str(p), placement="file")
    assert torch.equal(r.getData([1]), torch.from_numpy(A[[1]]))
    w.insertData(torch.full((1, 4), 3.0), [1])
    assert r.getData([1]).tolist() == [[3.0] * 4]
    r.close()
    w.close()


def test_hdf5_external_link_is_read_only_file_table(tmp_path):
    """README: reached through an external link: read from the file the link names, and
    read-only as a `file` table (ReadOnlyError saying why)."""
    _save(A, tmp_path / "v.h5", dataset="x")
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f["e"] = h5py.ExternalLink("v.h5", "/x")
    e = gl.DataGadget(str(tmp_path / "ext.h5"), placement="file")
    assert torch.equal(e.getData([2, 7]), torch.from_numpy(A[[2, 7]]))
    with pytest.raises(gl.ReadOnlyError, match="external link"):
        e.insertData(torch.ones(1, 4), [0])
    e.close()
    assert torch.equal(_read(tmp_path / "v.h5"), torch.from_numpy(A))


def test_external_link_reader_does_not_block_a_writer_of_the_linked_file(tmp_path):
    """README: "Several `file` tables of one file in one process may all write, and see each
    other's writes"; a table reading the same rows through an external link is only a reader.
    A plain writable=False reader of v.h5 does not block the writer (test above), but a
    reader through ext.h5 -> v.h5 makes the writer's insertData fail."""
    _save(A, tmp_path / "v.h5", dataset="x")
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f["e"] = h5py.ExternalLink("v.h5", "/x")
    e = gl.DataGadget(str(tmp_path / "ext.h5"), placement="file")
    assert torch.equal(e.getData([1]), torch.from_numpy(A[[1]]))
    w = gl.DataGadget(str(tmp_path / "v.h5"), placement="file")
    try:
        w.insertData(torch.full((1, 4), 3.0), [1])
        assert w.getData([1]).tolist() == [[3.0] * 4]
        assert e.getData([1]).tolist() == [[3.0] * 4]
    finally:
        w.close()
        e.close()


def test_file_table_detects_replacement_deletion_and_shrink(tmp_path):
    for fmt in FORMATS:
        p = tmp_path / f"r.{fmt}"
        _save(A, p)
        g = gl.DataGadget(str(p), placement="file")
        g.getData([1])
        _save(A * 2, p)  # same shape, new file
        with pytest.raises(gl.GadgetFileError, match="replaced"):
            g.getData([1])
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.ones(1, 4), [0])
        g.close()
        assert torch.equal(_read(p), torch.from_numpy(A * 2))
        g = gl.DataGadget(str(p), placement="file")
        g.getData([1])
        (shutil.rmtree if fmt == "zarr" else os.remove)(p)
        with pytest.raises(gl.GadgetFileError):
            g.getData([1])
        g.close()
    p = tmp_path / "s.npy"
    np.save(p, A)
    g = gl.DataGadget(str(p), placement="file", cache_bytes=0)
    g.getData([9])
    os.truncate(p, os.path.getsize(p) - 16)
    with pytest.raises(gl.GadgetFileError, match="shrank"):
        g.getData([0])
    size = os.path.getsize(p)
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.ones(1, 4), [9])
    assert os.path.getsize(p) == size
    g.close()


def test_damaged_zarr_chunk_read_and_partial_write(tmp_path):
    p = tmp_path / "c.zarr"
    _save(A, p, chunk_rows=4)
    chunk = [os.path.join(r, f) for r, _, fs in os.walk(p) for f in fs if f != "zarr.json"]
    damaged = sorted(chunk)[1]  # rows 4..7
    with open(damaged, "wb") as f:
        f.write(b"garbage garbage garbage")
    with pytest.raises(gl.GadgetFileError) as e:
        gl.DataGadget(str(p), placement="cpu")
    assert str(p) in str(e.value)
    g = gl.DataGadget(str(p), placement="file")
    assert torch.equal(g.getData([0]), torch.from_numpy(A[[0]]))
    with pytest.raises(gl.GadgetFileError):
        g.getData([5])
    before = _tree_bytes(p)
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.ones(2, 4), [0, 5])  # row 0 is fine, but nothing may be written
    assert _tree_bytes(p) == before
    g.close()


def test_damaged_hdf5_chunk_partial_write_leaves_rows(tmp_path):
    p = tmp_path / "c.h5"
    _save(A, p, chunk_rows=4, compression="gzip", dataset="x")
    with h5py.File(p, "r") as f:
        info = f["x"].id.get_chunk_info(1)
    raw = bytearray(p.read_bytes())
    raw[info.byte_offset : info.byte_offset + info.size] = b"\xff" * info.size
    p.write_bytes(bytes(raw))
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetFileError):
        g.getData([5])
    before = p.read_bytes()
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.ones(2, 4), [0, 5])
    g.close()
    assert p.read_bytes() == before


def test_file_table_pickles_as_its_name(tmp_path):
    p = _file_path(tmp_path, "h5")
    g = gl.DataGadget(str(p), placement="file")
    blob = pickle.dumps(g)
    assert len(blob) < 2000  # a name, not the rows
    g.insertData(torch.full((1, 4), 9.0), [1])
    g2 = pickle.loads(blob)
    assert g2.placement == "file"
    assert g2.getData([1]).tolist() == [[9.0] * 4]
    g.close()
    g2.close()


def test_cpu_table_pickles_by_value():
    g = gl.DataGadget(A, placement="cpu")
    g2 = pickle.loads(pickle.dumps(g))
    g.insertData(torch.zeros(1, 4), [0])
    assert torch.equal(g2.as_tensor(), torch.from_numpy(A))


def test_closed_file_table(tmp_path):
    p = _file_path(tmp_path, "npy")
    g = gl.DataGadget(str(p), placement="file")
    g.close()
    g.close()  # idempotent
    for call in (
        lambda: g.getData([0]),
        lambda: g.insertData(torch.ones(1, 4), [0]),
        g.flush,
        lambda: g.load(str(p)),
        lambda: g.save(str(tmp_path / "o.npy")),
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert g.shape == (10, 4) and len(g) == 10 and g.dtype == torch.float32
    assert "closed" in repr(g)
    assert not (tmp_path / "o.npy").exists()


# ---------------------------------------------------------------- saving


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "exc",
    [OSError(28, "No space left on device"), KeyboardInterrupt()],
    ids=["oserror", "interrupt"],
)
def test_failed_save_keeps_old_file_and_leaves_no_partial(tmp_path, monkeypatch, fmt, exc):
    from gadgetloader.io import _hdf5, _npy, _zarr

    cls = {"npy": _npy.NpySink, "h5": _hdf5.Hdf5Sink, "zarr": _zarr.ZarrSink}[fmt]
    p = tmp_path / f"at.{fmt}"
    _save(A * 2, p)

    def boom(self, start, rows):
        raise exc

    monkeypatch.setattr(cls, "write", boom)
    with pytest.raises(type(exc)):
        _save(A, p)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [p.name]
    assert torch.equal(_read(p), torch.from_numpy(A * 2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_ctrl_c_during_save_and_during_commit(tmp_path, monkeypatch, fmt):
    from gadgetloader.io import _hdf5, _npy, _zarr

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("Python's SIGINT handler is not installed")
    cls = {"npy": _npy.NpySink, "h5": _hdf5.Hdf5Sink, "zarr": _zarr.ZarrSink}[fmt]
    p = tmp_path / f"s.{fmt}"
    _save(A * 2, p)
    orig_write, orig_commit = cls.write, cls.commit

    def write(self, start, rows):
        os.kill(os.getpid(), signal.SIGINT)
        return orig_write(self, start, rows)

    monkeypatch.setattr(cls, "write", write)
    with pytest.raises(KeyboardInterrupt):
        _save(A, p)
    monkeypatch.setattr(cls, "write", orig_write)
    assert sorted(os.listdir(tmp_path)) == [p.name]
    assert torch.equal(_read(p), torch.from_numpy(A * 2))

    def commit(self):
        os.kill(os.getpid(), signal.SIGINT)
        return orig_commit(self)

    monkeypatch.setattr(cls, "commit", commit)
    with pytest.raises(KeyboardInterrupt, match="interrupted after"):
        _save(A, p)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [p.name]
    assert torch.equal(_read(p), torch.from_numpy(A))


def test_killed_save_leaves_hidden_partial_and_old_file(tmp_path):
    p = tmp_path / "k.npy"
    np.save(p, A)
    code = (
        "import os, numpy as np, gadgetloader as gl\n"
        "from gadgetloader.io import _npy\n"
        "orig = _npy.NpySink.write\n"
        "def w(self, start, rows):\n"
        "    orig(self, start, rows); os._exit(9)\n"
        "_npy.NpySink.write = w\n"
        f"gl.DataGadget(np.ones((10, 4), np.float32), placement='cpu').save({str(p)!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == 9
    hidden = _hidden(tmp_path)
    assert len(hidden) == 1 and hidden[0].startswith(".k.npy.partial-")
    assert np.array_equal(np.load(p), A)


def test_zarr_second_rename_failure_moves_old_store_back(tmp_path, monkeypatch):
    pz = tmp_path / "r.zarr"
    _save(A, pz)
    real = os.replace

    def fake(src, dst):
        if ".partial-" in os.path.basename(str(src)) and str(dst) == str(pz):
            raise OSError(5, "simulated")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fake)
    with pytest.raises(OSError, match="simulated"):
        _save(A * 7, pz)
    monkeypatch.undo()
    assert torch.equal(_read(pz), torch.from_numpy(A))
    assert _hidden(tmp_path) == []


def test_free_space_checked_before_uncompressed_saves(tmp_path, monkeypatch):
    np.save(tmp_path / "s.npy", A * 2)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100, 100, 0))
    g = gl.DataGadget(A, placement="cpu")
    for target, kw in [("s.npy", {}), ("s.h5", {})]:
        with pytest.raises(gl.GadgetFileError, match="not enough space"):
            g.save(str(tmp_path / target), **kw)
    g.save(str(tmp_path / "c.h5"), compression="gzip")  # compressed: size unknown, not checked
    g.save(str(tmp_path / "c.zarr"))
    monkeypatch.undo()
    assert np.array_equal(np.load(tmp_path / "s.npy"), A * 2)
    assert not (tmp_path / "s.h5").exists() and _hidden(tmp_path) == []
    assert torch.equal(_read(tmp_path / "c.h5"), torch.from_numpy(A))


def test_save_keeps_mode_and_follows_links(tmp_path):
    p = tmp_path / "perm.npy"
    _save(A, p)
    os.chmod(p, 0o640)
    _save(A * 3, p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    assert np.array_equal(np.load(p), A * 3)
    os.symlink(p, tmp_path / "link.npy")
    _save(A * 4, tmp_path / "link.npy")
    assert os.path.islink(tmp_path / "link.npy") and np.array_equal(np.load(p), A * 4)
    os.link(p, tmp_path / "hard.npy")
    _save(A * 5, p)
    assert np.array_equal(np.load(p), A * 5)
    assert np.array_equal(np.load(tmp_path / "hard.npy"), A * 4)  # other hard links keep old data
    _save(A, tmp_path / "real.zarr")
    os.symlink(tmp_path / "real.zarr", tmp_path / "link.zarr")
    _save(A * 6, tmp_path / "link.zarr")
    assert os.path.islink(tmp_path / "link.zarr")
    assert torch.equal(_read(tmp_path / "real.zarr"), torch.from_numpy(A * 6))


def test_save_refuses_what_it_must_not_replace(tmp_path):
    g = gl.DataGadget(A, placement="cpu")
    os.mkdir(tmp_path / "dir.npy")
    os.mkdir(tmp_path / "dir.h5")
    os.mkdir(tmp_path / "dir.zarr")
    (tmp_path / "dir.zarr" / "mine.txt").write_text("keep")
    (tmp_path / "file.zarr").write_text("keep")
    for name in ["dir.npy", "dir.h5", "dir.zarr", "file.zarr"]:
        with pytest.raises(gl.GadgetFileError):
            g.save(str(tmp_path / name))
    assert (tmp_path / "dir.zarr" / "mine.txt").read_text() == "keep"
    assert (tmp_path / "file.zarr").read_text() == "keep"
    with pytest.raises(gl.GadgetFileNotFoundError):
        g.save(str(tmp_path / "nodir" / "x.npy"))


def test_save_option_errors(tmp_path):
    g = gl.DataGadget(A, placement="cpu")
    with pytest.raises(gl.GadgetValueError, match=r"\.\."):
        g.save(str(tmp_path / "o.h5"), dataset="a/../b")
    with pytest.raises(gl.GadgetValueError):
        g.save(str(tmp_path / "o.zarr"), dataset="./b")
    with pytest.raises(gl.GadgetKeyError, match="zstd"):
        g.save(str(tmp_path / "o.h5"), compression="zstd")
    with pytest.raises(gl.GadgetKeyError, match="lzf"):
        g.save(str(tmp_path / "o.zarr"), compression="lzf")
    with pytest.raises(gl.GadgetValueError, match="chunk_rows"):
        g.save(str(tmp_path / "o.h5"), chunk_rows=0)
    with pytest.raises(gl.GadgetValueError):
        g.save(str(tmp_path / "o.h5"), compression="gzip", compression_level=12)
    with pytest.raises(gl.GadgetTypeError):
        g.save(str(tmp_path / "o.npy"), compression="gzip")
    assert sorted(os.listdir(tmp_path)) == []


def test_save_replaces_the_whole_file_or_group(tmp_path):
    p = tmp_path / "multi.h5"
    with h5py.File(p, "w") as f:
        f["a"] = A
        f["b"] = A
    _save(A * 3, p, dataset="c")
    with h5py.File(p, "r") as f:
        assert list(f.keys()) == ["c"]
    pz = tmp_path / "multi.zarr"
    grp = zarr.open_group(str(pz), mode="w")
    grp.create_array("a", shape=(2, 2), dtype="f4")
    grp.create_array("b", shape=(2, 2), dtype="f4")
    _save(A * 3, pz, dataset="c")
    assert sorted(zarr.open_group(str(pz), mode="r").array_keys()) == ["c"]
    assert torch.equal(_read(pz, dataset="c"), torch.from_numpy(A * 3))


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_table_saved_over_itself_keeps_working(tmp_path, fmt):
    kw = {} if fmt == "npy" else {"dataset": "grp/emb"}
    p = tmp_path / f"self.{fmt}"
    _save(A, p, **kw)
    g = gl.DataGadget(str(p), placement="file", **kw)
    g.insertData(torch.full((1, 4), -3.0), [2])
    g.save(str(p))
    assert g.getData([2]).tolist() == [[-3.0] * 4]
    g.insertData(torch.full((1, 4), -4.0), [3])
    g.close()
    ref = A.copy()
    ref[2], ref[3] = -3, -4
    assert torch.equal(_read(p, **kw), torch.from_numpy(ref))


def test_savecupy_appends_npy_and_loadcupy_reads_only_npy(tmp_path):
    g = gl.DataGadget(A, placement="cpu")
    g.saveCupy(str(tmp_path / "emb"))
    assert np.array_equal(np.load(tmp_path / "emb.npy"), A)
    _save(A * 2, tmp_path / "o.h5")
    with pytest.raises(gl.GadgetFileError):
        g.loadCupy(str(tmp_path / "o.h5"))
    assert torch.equal(g.as_tensor(), torch.from_numpy(A))
    g2 = gl.DataGadget((2, 2), placement="cpu")
    g2.loadCupy(str(tmp_path / "emb.npy"))
    assert g2.shape == (10, 4) and torch.equal(g2.as_tensor(), torch.from_numpy(A))


def test_load_failures_leave_table_unchanged(tmp_path):
    np.save(tmp_path / "t.npy", A)
    raw = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "tr.npy").write_bytes(raw[:-3])
    np.save(tmp_path / "u32.npy", np.ones((2, 2), np.uint32))
    g = gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu")
    for name, cls in [
        ("tr.npy", gl.GadgetFileError),
        ("missing.npy", gl.GadgetFileNotFoundError),
        ("u32.npy", gl.GadgetTypeError),
    ]:
        with pytest.raises(cls):
            g.load(str(tmp_path / name))
        assert g.shape == (2, 2) and torch.equal(g.as_tensor(), torch.ones(2, 2))
    g.load(str(tmp_path / "t.npy"))
    assert torch.equal(g.as_tensor(), torch.from_numpy(A))


def test_load_into_file_table_keeps_its_options(tmp_path):
    np.save(tmp_path / "a.npy", A)
    _save(A * 2, tmp_path / "b.h5")
    g = gl.DataGadget(str(tmp_path / "a.npy"), placement="file", writable=False)
    g.load(str(tmp_path / "b.h5"))
    assert g.placement == "file"
    assert torch.equal(g.getData([9]), torch.from_numpy(A[[9]] * 2))
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.ones(1, 4), [0])
    g.close()


# ---------------------------------------------------------------- unsigned files


def test_unsigned_files_convert_with_dtype(tmp_path):
    p = tmp_path / "u32.npy"
    np.save(p, np.array([[1, 2], [16777217, 4000000000]], dtype=np.uint32))
    with pytest.raises(gl.GadgetTypeError, match="dtype="):
        gl.DataGadget(str(p), placement="cpu")
    g = gl.DataGadget(str(p), placement="cpu", dtype="int64")
    assert g.dtype == torch.int64 and g.as_tensor().tolist() == [[1, 2], [16777217, 4000000000]]
    f32 = gl.DataGadget(str(p), placement="cpu", dtype="float32").as_tensor()
    assert f32[1, 0].item() == 16777216.0  # rounds as an int64 array cast would
    with pytest.raises(gl.GadgetValueError, match="4000000000"):
        gl.DataGadget(str(p), placement="cpu", dtype="int32")
    for kw in ({}, {"dtype": "int64"}):
        with pytest.raises(gl.GadgetTypeError):
            gl.DataGadget(str(p), placement="file", **kw)
    u16 = tmp_path / "u16.h5"
    with h5py.File(u16, "w") as fh:
        fh["u"] = np.array([[1, 65535]], dtype=np.uint16)
    assert gl.DataGadget(str(u16), placement="cpu", dtype="int32").as_tensor().tolist() == [
        [1, 65535]
    ]
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(str(u16), placement="cpu", dtype="int16")
    uz = tmp_path / "u.zarr"
    z = zarr.create_array(str(uz), shape=(2, 2), dtype="uint32")
    z[:] = np.array([[1, 2], [3, 70000]])
    assert gl.DataGadget(str(uz), placement="cpu", dtype="int64").as_tensor().tolist() == [
        [1, 2],
        [3, 70000],
    ]
    i8 = tmp_path / "i8.npy"
    np.save(i8, np.ones((2, 2), np.int8))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(str(i8), placement="cpu", dtype="int64")


# ---------------------------------------------------------------- CLI convert


def _cli(argv, capsys):
    from gadgetloader.cli import main

    rc = main(argv)
    return rc, capsys.readouterr()


def test_cli_convert_round_trip_and_errors(tmp_path, capsys):
    src = tmp_path / "a.npy"
    np.save(src, A)
    rc, out = _cli(
        [
            "convert",
            str(src),
            str(tmp_path / "a.h5"),
            "--chunk-rows",
            "4",
            "--compression",
            "gzip",
            "--no-progress",
        ],
        capsys,
    )
    assert rc == 0
    with h5py.File(tmp_path / "a.h5", "r") as f:
        (name,) = list(f.keys())
        assert f[name].chunks[0] == 4 and f[name].compression == "gzip"
        assert np.array_equal(f[name][...], A)
    m = tmp_path / "m.h5"
    with h5py.File(m, "w") as f:
        f["emb/words"] = A * 2
        f["other"] = A
    rc, out = _cli(
        ["convert", str(m), str(tmp_path / "e.zarr"), "--dataset", "emb/words", "--no-progress"],
        capsys,
    )
    assert rc == 0
    assert torch.equal(_read(tmp_path / "e.zarr", dataset="emb/words"), torch.from_numpy(A * 2))
    rc, out = _cli(["convert", str(m), str(tmp_path / "x.zarr")], capsys)
    assert rc == 1 and "emb/words" in out.err and "--dataset" in out.err
    assert not (tmp_path / "x.zarr").exists()
    os.link(src, tmp_path / "hl.npy")
    os.symlink(src, tmp_path / "sl.npy")
    for dst in ["a.npy", "hl.npy", "sl.npy"]:
        rc, out = _cli(["convert", str(src), str(tmp_path / dst)], capsys)
        assert rc == 1 and "same file" in out.err
    assert np.array_equal(np.load(src), A)
    rc, out = _cli(["convert", str(tmp_path / "missing.npy"), str(tmp_path / "y.h5")], capsys)
    assert rc == 1 and "missing.npy" in out.err
    # a usage error since session 31 (argparse checks --chunk-rows): exit status 2
    from gadgetloader.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(src), str(tmp_path / "y.h5"), "--chunk-rows", "0"])
    assert exit_info.value.code == 2 and "--chunk-rows" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a usage error, as --dataset of a .npy source
        main(["convert", str(src), str(tmp_path / "y.npy"), "--dst-dataset", "q"])
    assert exit_info.value.code == 2 and "--dst-dataset" in capsys.readouterr().err
    assert not (tmp_path / "y.h5").exists() and not (tmp_path / "y.npy").exists()
    assert _hidden(tmp_path) == []


def test_convert_function_returns_info(tmp_path):
    from gadgetloader.convert import convert

    np.save(tmp_path / "t.npy", A)
    info = convert(str(tmp_path / "t.npy"), str(tmp_path / "t.zarr"), progress=False)
    assert info["shape"] == (10, 4) and info["dst_format"] == "zarr" and info["dtype"] == "float32"
    assert torch.equal(_read(tmp_path / "t.zarr"), torch.from_numpy(A))


# ---------------------------------------------------------------- rows in and out


@pytest.mark.parametrize(
    "name,expected",
    [
        ("float", torch.float32),
        ("int", torch.int32),
        ("byte", torch.uint8),
        ("char", torch.int8),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        (np.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        ("float64", torch.float64),
    ],
)
def test_dtype_names(name, expected):
    assert gl.DataGadget((2, 3), dtype=name, placement="cpu").dtype == expected


def test_pinned_on_a_cpu_machine_falls_back_with_a_warning(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: no fallback")
    np.save(tmp_path / "e.npy", A)
    with pytest.warns(gl.FallbackWarning):
        g = gl.DataGadget(str(tmp_path / "e.npy"), CPUPinn=True)
    assert g.placement == "cpu"
    ids = torch.randint(0, len(g), (64,))
    rows = g.getData(ids)
    assert torch.equal(rows, torch.from_numpy(A)[ids])
    g.insertData(rows * 0.5, ids)
    ref = A.copy()
    ref[ids.numpy()] *= 0.5
    g.saveCupy(str(tmp_path / "e.npy"))
    assert np.array_equal(np.load(tmp_path / "e.npy"), ref)


def test_source_is_copied_in_and_detached():
    src = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(src, placement="cpu")
    src[0, 0] = 99
    assert g.getData([0])[0, 0].item() == 0
    t = torch.arange(12.0).reshape(4, 3).requires_grad_()
    g = gl.DataGadget(t, placement="cpu")
    assert not g.as_tensor().requires_grad
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget([[1, 2], [3]], placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="CPUPinn"):
        gl.DataGadget((2, 3), CPUPinn="False")


def test_id_kinds_match_numpy():
    ref = np.arange(30, dtype=np.int64).reshape(10, 3)
    g = gl.DataGadget(ref, placement="cpu")
    cases = [
        ([1, 2], [1, 2]),
        ((1, 2), [1, 2]),  # a tuple of plain ints stays a list of ids
        (np.array([3, 1], dtype=np.int32), [3, 1]),
        (np.array([3, 1], dtype=np.uint8), [3, 1]),
        (torch.tensor([[3], [1]]), [[3], [1]]),
        (range(8, 2, -2), [8, 6, 4]),
        (np.array([1, 2, 5])[::-1], [5, 2, 1]),
        (torch.arange(10)[::3], [0, 3, 6, 9]),
        (3, 3),
    ]
    for ids, want in cases:
        assert np.array_equal(g.getData(ids).numpy(), ref[np.asarray(want)]), ids
    assert np.array_equal(g.getData(slice(2, 9, 3)).numpy(), ref[2:9:3])
    assert np.array_equal(g[[1, 2], 0].numpy(), ref[[1, 2], 0])
    assert np.array_equal(g[2:5, 1:3].numpy(), ref[2:5, 1:3])
    with pytest.raises(gl.GadgetTypeError):
        g.getData(([1, 2], [0, 1]))  # NumPy's pointwise index: refused
    for bad, cls in [
        ([10], gl.GadgetIndexError),
        ([-1], gl.GadgetIndexError),
        ([1.0], gl.GadgetTypeError),
        (np.array([True, False] * 5), gl.GadgetTypeError),
        (torch.tensor([1.0]), gl.GadgetTypeError),
        ((slice(0, 6), slice(0, 3, -1)), gl.GadgetValueError),
    ]:
        with pytest.raises(cls):
            g.getData(bad)


def test_insert_repeated_ids_last_wins_and_dtype_exact():
    g = gl.DataGadget(np.zeros((5, 2), np.float32), placement="cpu")
    g.insertData(torch.tensor([[1.0, 1], [2, 2], [3, 3]]), [4, 0, 4])
    assert g.as_tensor().tolist() == [[2, 2], [0, 0], [0, 0], [0, 0], [3, 3]]
    before = g.as_tensor().clone()
    with pytest.raises(gl.GadgetTypeError, match="float64"):
        g.insertData(np.ones((1, 2)), [1])
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.ones(2, 2), [1, 5])
    assert torch.equal(g.as_tensor(), before)
    g.insertData(torch.full((2, 1), 7.0), (slice(1, 3), slice(1, 2)))
    assert g.as_tensor()[1:3].tolist() == [[0, 7], [0, 7]]


def test_none_path_is_a_type_error(tmp_path):
    """README Errors: GadgetTypeError for "a path that is `None`"."""
    from gadgetloader.convert import convert

    g = gl.DataGadget(A, placement="cpu")
    for call in (
        lambda: g.save(None),
        lambda: g.load(None),
        lambda: g.saveCupy(None),
        lambda: convert(None, str(tmp_path / "x.h5")),
    ):
        with pytest.raises(gl.GadgetTypeError, match="NoneType"):
            call()
    assert torch.equal(g.as_tensor(), torch.from_numpy(A))
    assert os.listdir(tmp_path) == []


def test_hdf5_null_dataspace_is_named_as_such(tmp_path):
    """A dataset with no dataspace (h5py ``shape=None``) is empty, not a scalar: the error
    says which, names the file, and is a GadgetValueError."""
    p = tmp_path / "null.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("empty", shape=None, dtype="f4")
        f["scalar"] = np.float32(1.0)
    with pytest.raises(gl.GadgetValueError, match=r"null\.h5.*empty \(null\) dataspace"):
        gl.DataGadget(str(p), placement="file", dataset="empty")
    with pytest.raises(gl.GadgetValueError, match=r"null\.h5.*holds a scalar"):
        gl.DataGadget(str(p), placement="file", dataset="scalar")
