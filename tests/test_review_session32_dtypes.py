"""Black-box review (session 32) of dtypes and interop (SUPPORTED_DTYPES end to end through
DataGadget, OffloadedEmbedding and the SpeedTorch switchers, the .npy / HDF5 / zarr formats,
dtype conversion and refusal, every kind of id and row input); written from README.md,
SPEC.md and the public docstrings only."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


DTYPES = list(gl.SUPPORTED_DTYPES)
NP_DTYPES = [d for d in DTYPES if d is not torch.bfloat16]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
FORMATS = ["npy", "h5", "zarr"]


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def _need_fmt(fmt: str) -> None:
    if fmt == "h5":
        pytest.importorskip("h5py")
    elif fmt == "zarr":
        pytest.importorskip("zarr")


def ref_tensor(dt: torch.dtype, shape=(9, 3), seed: int = 0) -> torch.Tensor:
    """Values that cover the dtype: extremes, signed zeros, inf/nan, subnormals."""
    g = torch.Generator().manual_seed(seed)
    if dt == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dt.is_floating_point:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dt)
        fi = torch.finfo(dt)
        flat = t.view(-1)
        specials = [
            fi.max,
            -fi.max,
            fi.tiny,
            fi.tiny / 4,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
        ]
        for i, v in enumerate(specials[: flat.numel()]):
            flat[i] = v
        return t
    ii = torch.iinfo(dt)
    t = torch.randint(ii.min, ii.max, shape, generator=g, dtype=torch.int64).to(dt)
    t.view(-1)[0] = ii.min
    t.view(-1)[1] = ii.max
    return t


_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(t) -> np.ndarray:
    """Bit pattern of a tensor (CPU numpy), so nan/-0.0 compare exactly."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    t = t.detach().cpu().contiguous()
    if t.dtype in _BITS:
        t = t.view(_BITS[t.dtype])
    return t.numpy().copy()


def npref(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()


def cpu_table(src, **kw) -> gl.DataGadget:
    return gl.DataGadget(src, placement="cpu", device="cpu", **kw)


def write_file(tmp_path, arr, fmt: str, name: str = "t"):
    """Write a NumPy array as .npy / HDF5 / zarr with the formats' own libraries."""
    p = tmp_path / f"{name}.{fmt}"
    if fmt == "npy":
        np.save(p, arr)
    elif fmt == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(p, "w") as f:
            f.create_dataset("data", data=arr)
    else:
        zarr = pytest.importorskip("zarr")
        z = zarr.open_array(
            str(p), mode="w", shape=arr.shape, dtype=arr.dtype, chunks=(4,) + arr.shape[1:]
        )
        z[...] = arr
    return str(p)


def read_file(path: str, fmt: str) -> np.ndarray:
    if fmt == "npy":
        return np.load(path)
    if fmt == "h5":
        import h5py

        with h5py.File(path, "r") as f:
            (name,) = list(f.keys())
            return f[name][...]
    import zarr

    return zarr.open_array(path, mode="r")[...]


# ---------------------------------------------------------------------------------------
# SUPPORTED_DTYPES, in memory
# ---------------------------------------------------------------------------------------


def test_supported_dtypes_is_the_documented_list():
    # README: "Tables hold float16, bfloat16, float32, float64, int8-int64, uint8 and bool"
    assert set(gl.SUPPORTED_DTYPES) == {
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
    }


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_tensor_source_round_trips_exactly(dt):
    t = ref_tensor(dt)
    g = cpu_table(t)
    assert g.dtype == dt and tuple(g.shape) == tuple(t.shape)
    assert g.nbytes == t.numel() * t.element_size()
    ids = torch.tensor([[8, 0, 3], [3, 3, 1]])
    out = g.getData(ids)
    assert out.dtype == dt and tuple(out.shape) == (2, 3, 3)
    np.testing.assert_array_equal(bits(out), bits(t[ids]))
    assert g.as_tensor().dtype == dt
    np.testing.assert_array_equal(bits(g.as_tensor()), bits(t))
    arr = g.getNumpyVersion()
    if dt == torch.bfloat16:
        # docstring: "bfloat16 tables come back as float32 (exact)"
        assert arr.dtype == np.float32
        np.testing.assert_array_equal(bits(arr), bits(t.float()))
    else:
        assert arr.dtype == t.numpy().dtype
        np.testing.assert_array_equal(bits(arr), bits(t))
    # "Data is always copied in"
    before = bits(t)
    t.view(-1)[5] = t.view(-1)[6]
    np.testing.assert_array_equal(bits(g.as_tensor()), before)


@pytest.mark.parametrize("dt", NP_DTYPES, ids=_name)
def test_numpy_source_round_trips_exactly(dt):
    a = ref_tensor(dt, seed=1).numpy()
    orig = a.copy()
    g = cpu_table(a)
    assert g.dtype == dt
    ids = np.array([5, 1, 5, 0], dtype=np.int32)
    np.testing.assert_array_equal(bits(g.getData(ids)), bits(a[ids]))
    np.testing.assert_array_equal(bits(np.asarray(g)), bits(a))
    a[...] = a[::-1].copy()  # copied in: the table does not follow the source
    np.testing.assert_array_equal(bits(g.getNumpyVersion()), bits(orig))


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_insert_same_dtype_last_occurrence_wins(dt):
    src = ref_tensor(dt, shape=(6, 3), seed=2)
    g = cpu_table(torch.zeros(6, 3, dtype=dt))
    ids = np.array([4, 1, 4, 0, 1], dtype=np.int16)
    rows = ref_tensor(dt, shape=(5, 3), seed=3)
    g.insertData(rows, ids)
    expect = torch.zeros(6, 3, dtype=dt)
    for k, i in enumerate(ids.tolist()):  # NumPy's sequential assignment
        expect[i] = rows[k]
    np.testing.assert_array_equal(bits(g.as_tensor()), bits(expect))
    g[[2]] = src[2:3]
    expect[2] = src[2]
    np.testing.assert_array_equal(bits(g.as_tensor()), bits(expect))


# ---------------------------------------------------------------------------------------
# files: save / reopen / load / file placement
# ---------------------------------------------------------------------------------------

SAVE_CASES = [
    (dt, fmt) for dt in DTYPES for fmt in FORMATS if not (dt == torch.bfloat16 and fmt == "npy")
]


@pytest.mark.parametrize(
    "dt,fmt", SAVE_CASES, ids=lambda v: _name(v) if isinstance(v, torch.dtype) else v
)
def test_save_reopen_load_keeps_dtype_and_bits(tmp_path, dt, fmt):
    _need_fmt(fmt)
    t = ref_tensor(dt, shape=(10, 3), seed=4)
    path = str(tmp_path / f"tab.{fmt}")
    cpu_table(t).save(path)
    for pl in ("cpu", "file"):
        h = gl.DataGadget(path, placement=pl, device="cpu")
        try:
            assert h.dtype == dt, pl
            np.testing.assert_array_equal(bits(h.getData(slice(None))), bits(t), err_msg=pl)
            np.testing.assert_array_equal(
                bits(h.getData([9, 2, 9])), bits(t[[9, 2, 9]]), err_msg=pl
            )
        finally:
            h.close()
    # load() takes the file's shape and dtype
    other = torch.float64 if dt != torch.float64 else torch.int8
    g2 = cpu_table((2, 2), dtype=other)
    g2.load(path)
    assert g2.dtype == dt and tuple(g2.shape) == (10, 3)
    np.testing.assert_array_equal(bits(g2.as_tensor()), bits(t))


@pytest.mark.parametrize("how", ["save", "saveCupy"])
def test_bfloat16_npy_refused_before_writing(tmp_path, how):
    g = cpu_table(ref_tensor(torch.bfloat16))
    target = tmp_path / "b.npy"
    with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
        getattr(g, how)(str(target))
    assert not target.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_bfloat16_stored_as_uint16_bits(tmp_path, fmt):
    # README: "bfloat16 is stored as uint16 bits plus an attribute"
    _need_fmt(fmt)
    t = ref_tensor(torch.bfloat16, shape=(5, 2))
    path = str(tmp_path / f"b.{fmt}")
    cpu_table(t).save(path)
    raw = read_file(path, fmt)
    assert raw.dtype == np.uint16
    np.testing.assert_array_equal(raw.view(np.int16), bits(t))


FILE_WRITE_CASES = [(dt, "npy") for dt in NP_DTYPES] + [
    (dt, fmt)
    for fmt in ("h5", "zarr")
    for dt in (torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.float64)
]


@pytest.mark.parametrize(
    "dt,fmt", FILE_WRITE_CASES, ids=lambda v: _name(v) if isinstance(v, torch.dtype) else v
)
def test_file_placement_write_through_per_dtype(tmp_path, dt, fmt):
    _need_fmt(fmt)
    t = ref_tensor(dt, shape=(12, 3), seed=5)
    path = str(tmp_path / f"w.{fmt}")
    cpu_table(t).save(path)
    rows = ref_tensor(dt, shape=(3, 3), seed=6)
    ids = torch.tensor([11, 0, 11], dtype=torch.int32)
    expect = t.clone()
    for k, i in enumerate(ids.tolist()):
        expect[i] = rows[k]
    with gl.DataGadget(path, placement="file", device="cpu") as g:
        g.insertData(rows, ids)
        np.testing.assert_array_equal(bits(g.getData(slice(None))), bits(expect))
    with gl.DataGadget(path, placement="cpu", device="cpu") as h:
        assert h.dtype == dt
        np.testing.assert_array_equal(bits(h.as_tensor()), bits(expect))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("npdt", ["<f4", ">f4", ">i2", "<f2", "|b1", ">f8"])
def test_foreign_files_any_byte_order_read_and_written(tmp_path, fmt, npdt):
    _need_fmt(fmt)
    a = (np.arange(24).reshape(8, 3) - 5).astype(npdt)
    path = write_file(tmp_path, a, fmt)
    for pl in ("cpu", "file"):
        with gl.DataGadget(path, placement=pl, device="cpu") as g:
            assert g.dtype == torch.from_numpy(a.astype(a.dtype.newbyteorder("="))).dtype
            np.testing.assert_array_equal(g.getNumpyVersion(), a)
            np.testing.assert_array_equal(g.getData(np.array([7, 0])).numpy(), a[[7, 0]])
    # a file table writes rows of the table's dtype into the file's byte order
    with gl.DataGadget(path, placement="file", device="cpu") as g:
        new = np.ones((1, 3), dtype=a.dtype.newbyteorder("="))
        g.insertData(new, [2])
    expect = a.copy()
    expect[2] = 1
    got = read_file(path, fmt)
    if fmt != "zarr":  # zarr 3 hands back native byte order whatever the codec
        assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, expect)


# ---------------------------------------------------------------------------------------
# writes of another dtype are refused, naming both dtypes, before anything changes
# ---------------------------------------------------------------------------------------

BAD_PAIRS = [
    (torch.float32, torch.float64),
    (torch.float32, torch.float16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
    (torch.int32, torch.int64),
    (torch.int64, torch.int32),
    (torch.uint8, torch.int8),
    (torch.bool, torch.uint8),
    (torch.int8, torch.bool),
    (torch.float32, torch.int32),
    (torch.int64, torch.float64),
    (torch.float64, torch.float32),
]


def _bad_rows(data_dt, kind, shape):
    t = torch.ones(shape, dtype=data_dt)
    return t if kind == "torch" else t.numpy()


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("table_dt,data_dt", BAD_PAIRS, ids=lambda d: _name(d))
def test_insert_wrong_dtype_refused_table_unchanged(table_dt, data_dt, kind):
    if kind == "numpy" and data_dt == torch.bfloat16:
        pytest.skip("NumPy has no bfloat16")
    t = ref_tensor(table_dt, shape=(5, 2), seed=7)
    g = cpu_table(t)
    rows = _bad_rows(data_dt, kind, (2, 2))
    for call in (
        lambda: g.insertData(rows, [0, 4]),
        lambda: g.scatter([0, 4], rows),
        lambda: g.__setitem__([0, 4], rows),
    ):
        with pytest.raises(gl.GadgetTypeError) as ei:
            call()
        assert isinstance(ei.value, TypeError)
        msg = str(ei.value)
        assert _name(table_dt) in msg and _name(data_dt) in msg, msg
    np.testing.assert_array_equal(bits(g.as_tensor()), bits(t))


@pytest.mark.parametrize("table_dt,data_dt", BAD_PAIRS[:8], ids=lambda d: _name(d))
def test_file_table_wrong_dtype_refused_file_unchanged(tmp_path, table_dt, data_dt):
    fmt = "h5" if torch.bfloat16 in (table_dt,) else "npy"
    _need_fmt(fmt)
    t = ref_tensor(table_dt, shape=(6, 2), seed=8)
    path = str(tmp_path / f"f.{fmt}")
    cpu_table(t).save(path)
    with gl.DataGadget(path, placement="file", device="cpu") as g:
        with pytest.raises(gl.GadgetTypeError) as ei:
            g.insertData(torch.ones(2, 2, dtype=data_dt), [1, 3])
        assert _name(table_dt) in str(ei.value) and _name(data_dt) in str(ei.value)
        np.testing.assert_array_equal(bits(g.getData(slice(None))), bits(t))
    with gl.DataGadget(path, placement="cpu", device="cpu") as h:
        np.testing.assert_array_equal(bits(h.as_tensor()), bits(t))


@pytest.mark.parametrize(
    "table_dt,data,ok",
    [
        (torch.float64, [[1.5, -2.0]], True),
        (torch.float32, [[1.5, -2.0]], False),  # NumPy reads Python floats as float64
        (torch.int64, [[3, -4]], True),
        (torch.int32, [[3, -4]], False),  # ... and Python ints as int64
        (torch.bool, [[True, False]], True),
        (torch.uint8, [[True, False]], False),
    ],
)
def test_list_rows_read_as_numpy_reads_them(table_dt, data, ok):
    g = cpu_table(torch.zeros(3, 2, dtype=table_dt))
    before = bits(g.as_tensor())
    if ok:
        g.insertData(data, [1])
        np.testing.assert_array_equal(g.getNumpyVersion()[1], np.asarray(data)[0])
    else:
        with pytest.raises(gl.GadgetTypeError, match=_name(table_dt)):
            g.insertData(data, [1])
        np.testing.assert_array_equal(bits(g.as_tensor()), before)


def test_scatter_many_mixed_dtypes_one_wrong_changes_no_table():
    a = cpu_table(ref_tensor(torch.float32, shape=(6, 2), seed=9))
    b = cpu_table(ref_tensor(torch.float16, shape=(6, 2), seed=10))
    c = cpu_table(ref_tensor(torch.int64, shape=(6, 2), seed=11))
    before = [bits(x.as_tensor()) for x in (a, b, c)]
    ids = np.array([5, 0], dtype=np.uint8)
    good = [
        torch.ones(2, 2),
        torch.ones(2, 2, dtype=torch.float16),
        torch.ones(2, 2, dtype=torch.int64),
    ]
    bad = good[:2] + [torch.ones(2, 2, dtype=torch.int32)]
    with pytest.raises(gl.GadgetTypeError, match="int64"):
        gl.scatter_many([a, b, c], bad, ids)
    for x, bb in zip((a, b, c), before, strict=True):
        np.testing.assert_array_equal(bits(x.as_tensor()), bb)
    gl.scatter_many([a, b, c], good, ids)
    outs = gl.gather_many([a, b, c], torch.tensor([0, 5, 1], dtype=torch.int32))
    for x, o, bb in zip((a, b, c), outs, before, strict=True):
        assert o.dtype == x.dtype
        ref = (
            torch.from_numpy(bb).view(x.dtype)
            if x.dtype.is_floating_point
            else torch.from_numpy(bb)
        )
        ref[[5, 0]] = 1
        np.testing.assert_array_equal(bits(o), bits(ref[[0, 5, 1]]))


# ---------------------------------------------------------------------------------------
# dtype= conversion on the way in, dtype names
# ---------------------------------------------------------------------------------------

CONVERT_OK = [
    (np.array([[0.1, -1e10, 3.5]], dtype=np.float64), "float32"),
    (np.array([[2**40 + 1, -7, 0]], dtype=np.int64), "float32"),
    (np.array([[2**53, -7, 0]], dtype=np.int64), "float64"),
    (np.array([[-128, 0, 127]], dtype=np.int8), "int64"),
    (np.array([[0, 200, 255]], dtype=np.uint8), "int16"),
    (np.array([[1e-8, 1.0, -65504.0]], dtype=np.float32), "float16"),
    (np.array([[np.inf, np.nan, -np.inf]], dtype=np.float64), "float32"),
    (np.array([[1.0, 3.0e38, 1.0e-40]], dtype=np.float32), "float64"),
]


@pytest.mark.parametrize(
    "src,dt", CONVERT_OK, ids=lambda v: v if isinstance(v, str) else str(v.dtype)
)
def test_dtype_converts_like_numpy_astype(src, dt):
    g = cpu_table(src, dtype=dt)
    assert g.dtype == getattr(torch, dt)
    np.testing.assert_array_equal(g.getNumpyVersion(), src.astype(dt))


@pytest.mark.parametrize("src_dt", [torch.float32, torch.float64, torch.float16])
def test_dtype_bfloat16_conversion_matches_torch(src_dt):
    t = ref_tensor(src_dt, shape=(4, 3), seed=12).clamp(-1e4, 1e4)
    g = cpu_table(t, dtype="bfloat16")
    assert g.dtype == torch.bfloat16
    np.testing.assert_array_equal(bits(g.as_tensor()), bits(t.to(torch.bfloat16)))
    # and back: bfloat16 -> float32 is exact
    h = cpu_table(g.as_tensor(), dtype="float32")
    np.testing.assert_array_equal(bits(h.as_tensor()), bits(t.to(torch.bfloat16).float()))


@pytest.mark.parametrize(
    "src,dt,exc",
    [
        (
            np.array([[1.5]], dtype=np.float64),
            "int64",
            gl.GadgetTypeError,
        ),  # float -> int truncates
        (np.array([[1.0]], dtype=np.float32), "int32", gl.GadgetTypeError),
        (torch.tensor([[0.5]], dtype=torch.bfloat16), "int16", gl.GadgetTypeError),
        (np.array([[300]], dtype=np.int64), "int8", gl.GadgetValueError),
        (np.array([[-1]], dtype=np.int8), "uint8", gl.GadgetValueError),
        (np.array([[1e300]], dtype=np.float64), "float32", gl.GadgetValueError),
        (np.array([[70000]], dtype=np.int64), "float16", gl.GadgetValueError),
        (np.array([[2**63]], dtype=np.uint64), "int64", gl.GadgetValueError),
        (np.array([[1 + 2j]]), None, gl.GadgetTypeError),
        (np.array([[1 + 2j]]), "float64", gl.GadgetTypeError),
    ],
)
def test_dtype_conversion_refused(src, dt, exc):
    kw = {} if dt is None else {"dtype": dt}
    with pytest.raises(exc):
        cpu_table(src, **kw)


@pytest.mark.parametrize(
    "npdt,dt",
    [("uint16", "int32"), ("uint32", "int64"), ("uint64", "int64"), ("uint32", "float64")],
)
def test_wide_unsigned_arrays_need_dtype(npdt, dt):
    a = np.array([[0, 1, np.iinfo(np.int32).max if npdt != "uint16" else 65535]], dtype=npdt)
    with pytest.raises(gl.GadgetTypeError, match="dtype="):
        cpu_table(a)
    g = cpu_table(a, dtype=dt)
    np.testing.assert_array_equal(g.getNumpyVersion(), a.astype(dt))


def test_uint32_to_float32_rounds_as_documented(tmp_path):
    # README: "uint32 16777217 becomes 16777216 in float32"
    a = np.array([[16777217, 3]], dtype=np.uint32)
    assert cpu_table(a, dtype="float32").getNumpyVersion()[0, 0] == 16777216.0
    p = write_file(tmp_path, a, "npy")
    assert (
        gl.DataGadget(p, placement="cpu", device="cpu", dtype="float32").getNumpyVersion()[0, 0]
        == 16777216.0
    )


@pytest.mark.parametrize("tname", ["uint16", "uint32", "uint64"])
def test_wide_unsigned_torch_tensor_needs_dtype(tname):
    tdt = getattr(torch, tname, None)
    if tdt is None:
        pytest.skip(f"torch {torch.__version__} has no {tname}")
    try:
        t = torch.tensor([[0, 7, 60000]], dtype=tdt)
    except Exception:  # pragma: no cover - old torch
        pytest.skip("cannot build such a tensor on this torch")
    with pytest.raises(gl.GadgetTypeError):
        cpu_table(t)
    g = cpu_table(t, dtype="int32" if tname == "uint16" else "int64")
    assert g.getNumpyVersion().tolist() == [[0, 7, 60000]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_uint16_file_converts_in_memory_refused_as_file_and_by_load(tmp_path, fmt):
    _need_fmt(fmt)
    a = (np.arange(12, dtype=np.uint16).reshape(4, 3) * 5000).astype(np.uint16)
    p = write_file(tmp_path, a, fmt)
    g = gl.DataGadget(p, placement="cpu", device="cpu", dtype="int32")
    assert g.dtype == torch.int32
    np.testing.assert_array_equal(g.getNumpyVersion(), a.astype(np.int32))
    with pytest.raises(gl.GadgetTypeError, match="dtype="):
        gl.DataGadget(p, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="file", device="cpu")
    h = cpu_table(np.full((2, 2), 3.0, dtype=np.float32))
    with pytest.raises(gl.GadgetTypeError):
        h.load(p)
    assert h.dtype == torch.float32 and tuple(h.shape) == (2, 2)
    np.testing.assert_array_equal(h.getNumpyVersion(), np.full((2, 2), 3.0, dtype=np.float32))


@pytest.mark.parametrize("pl", ["cpu", "file"])
def test_file_source_must_already_hold_dtype(tmp_path, pl):
    # docstring: "A file source must already hold ``dtype``"
    p = write_file(tmp_path, np.ones((3, 2), np.float32), "npy")
    with pytest.raises(gl.GadgetTypeError, match="float64"):
        gl.DataGadget(p, placement=pl, device="cpu", dtype="float64")
    assert gl.DataGadget(p, placement=pl, device="cpu", dtype="float32").dtype == torch.float32


@pytest.mark.parametrize(
    "given,expected",
    [
        ("float", torch.float32),
        ("int", torch.int32),
        ("byte", torch.uint8),
        ("char", torch.int8),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        (np.dtype("int16"), torch.int16),
        (np.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
        ("uint8", torch.uint8),
        ("bool", torch.bool),
    ],
    ids=str,
)
def test_dtype_names(given, expected):
    g = cpu_table((3, 2), dtype=given)
    assert g.dtype == expected
    assert g.as_tensor().dtype == expected
    assert not g.as_tensor().any()


@pytest.mark.parametrize(
    "given", ["uint16", "complex64", "float8", torch.complex64, np.uint32, "object"], ids=str
)
def test_unsupported_dtype_names_refused(given):
    with pytest.raises(gl.GadgetTypeError):
        cpu_table((3, 2), dtype=given)


# ---------------------------------------------------------------------------------------
# ids: every kind, width, layout
# ---------------------------------------------------------------------------------------

REF = np.arange(40, dtype=np.float32).reshape(10, 4) * 1.5 - 7


@pytest.fixture
def table():
    return cpu_table(REF)


NP_ID_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("idt", NP_ID_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_ids_every_width(table, idt):
    ids = np.array([[9, 0, 3], [3, 3, 7]], dtype=idt)
    out = table.getData(ids)
    assert tuple(out.shape) == (2, 3, 4)
    np.testing.assert_array_equal(out.numpy(), REF[ids])
    np.testing.assert_array_equal(table[ids].numpy(), REF[ids])


@pytest.mark.parametrize(
    "tdt", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8], ids=_name
)
def test_torch_ids_every_width(table, tdt):
    ids = torch.tensor([[9, 0], [3, 3]], dtype=tdt)
    np.testing.assert_array_equal(table.getData(ids).numpy(), REF[ids.numpy()])


@pytest.mark.parametrize(
    "ids",
    [
        [4, 1, 4],
        [[1, 2], [3, 9]],
        (4, 1, 4),
        range(2, 9, 3),
        range(8, 2, -2),
        [np.int64(3), np.int32(1)],
        [np.uint8(9)],
    ],
    ids=["list", "nested", "tuple", "range", "range_neg_step", "list_np_scalars", "list_np_uint8"],
)
def test_python_ids(table, ids):
    expect = REF[np.array(list(ids) if isinstance(ids, range) else ids, dtype=np.int64)]
    np.testing.assert_array_equal(table.getData(ids).numpy(), expect)


@pytest.mark.parametrize(
    "idx",
    [
        3,
        np.int64(3),
        np.uint16(3),
        np.array(3, dtype=np.int8),
        np.array(3, dtype=np.uint64),
        torch.tensor(3),
        torch.tensor(3, dtype=torch.int32),
        torch.tensor(3, dtype=torch.uint8),
    ],
    ids=[
        "int",
        "np_int64",
        "np_uint16",
        "np0d_int8",
        "np0d_uint64",
        "t0d_int64",
        "t0d_int32",
        "t0d_uint8",
    ],
)
def test_zero_d_ids_give_one_row(table, idx):
    out = table.getData(idx)
    assert tuple(out.shape) == (4,)
    np.testing.assert_array_equal(out.numpy(), REF[3])


@pytest.mark.parametrize(
    "ids,shape",
    [
        ([], (0,)),
        (np.array([], dtype=np.int64), (0,)),
        (np.array([], dtype=np.uint32), (0,)),
        (torch.empty(0, dtype=torch.int32), (0,)),
        (range(0), (0,)),
        (np.empty((0, 3), dtype=np.int16), (0, 3)),
        (torch.empty(2, 0, dtype=torch.int64), (2, 0)),
    ],
    ids=["list", "np_i64", "np_u32", "t_i32", "range", "np_0x3", "t_2x0"],
)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.bool], ids=_name)
def test_empty_ids(ids, shape, dt):
    g = cpu_table(ref_tensor(dt, shape=(5, 4)))
    before = bits(g.as_tensor())
    out = g.getData(ids)
    assert tuple(out.shape) == shape + (4,) and out.dtype == dt
    g.insertData(torch.zeros(shape + (4,), dtype=dt), ids)
    np.testing.assert_array_equal(bits(g.as_tensor()), before)


BAD_IDS = [
    torch.tensor([1, 0], dtype=torch.bool),
    np.array([True, False]),
    [True, False],
    [1, True],
    True,
    np.bool_(True),
    torch.tensor(True),
    torch.tensor([1.0, 2.0]),
    torch.tensor(2.0),
    np.array([1.0, 2.0]),
    np.array([1.0], dtype=np.float16),
    [1.0, 2.0],
    2.0,
    np.float64(2.0),
    torch.tensor([1.0], dtype=torch.bfloat16),
    torch.empty(0, dtype=torch.float32),
]


@pytest.mark.parametrize(
    "ids", BAD_IDS, ids=lambda v: f"{type(v).__name__}-{getattr(v, 'dtype', v)}"
)
def test_bool_and_float_ids_refused_everywhere(table, ids):
    for call in (
        lambda: table.getData(ids),
        lambda: table[ids],
        lambda: table.insertData(torch.zeros(np.shape(ids) + (4,)), ids),
    ):
        with pytest.raises(gl.GadgetTypeError) as ei:
            call()
        assert isinstance(ei.value, TypeError)
    np.testing.assert_array_equal(table.getNumpyVersion(), REF)


def test_bool_tensor_message_points_to_nonzero(table):
    with pytest.raises(gl.GadgetTypeError, match=r"nonzero"):
        table.getData(torch.tensor([True, False, True]))


@pytest.mark.parametrize(
    "ids",
    [
        np.array([2**63], dtype=np.uint64),
        np.array([2**64 - 1], dtype=np.uint64),
        np.array([-1], dtype=np.int8),
        np.array([10], dtype=np.uint8),
        torch.tensor([-128], dtype=torch.int8),
        torch.tensor([255], dtype=torch.uint8),
        np.array([1, 10], dtype=">i4"),
    ],
    ids=["u64_2^63", "u64_max", "i8_-1", "u8_10", "t_i8_-128", "t_u8_255", "be_i4_10"],
)
def test_out_of_range_ids_any_width(table, ids):
    for call in (
        lambda: table.getData(ids),
        lambda: table.insertData(np.zeros(tuple(ids.shape) + (4,), np.float32), ids),
    ):
        with pytest.raises(gl.GadgetIndexError) as ei:
            call()
        assert isinstance(ei.value, IndexError)
    np.testing.assert_array_equal(table.getNumpyVersion(), REF)


_A = np.array([1, 9, 4, 1, 0, 7, 3, 3], dtype=np.int64)
STRIDED_IDS = {
    "np_neg_stride": _A[::-1],
    "np_neg_stride3": _A[::-3],
    "np_step2_i16": _A.astype(np.int16)[1::2],
    "np_fortran_2d": np.asfortranarray(_A.reshape(2, 4).astype(np.int32)),
    "np_transposed": _A.reshape(2, 4).T,
    "np_neg_2d": _A.reshape(2, 4)[::-1, ::-1].astype(np.uint16),
    "np_broadcast": np.broadcast_to(np.array([7], dtype=np.int64), (3, 2)),
    "np_bigendian_i4": _A.astype(">i4"),
    "np_bigendian_i8_neg": _A.astype(">i8")[::-2],
    "t_step3": torch.from_numpy(_A)[::3],
    "t_transposed_i32": torch.from_numpy(_A.reshape(2, 4)).t().to(torch.int32),
    "t_expand": torch.tensor([5]).expand(4),
    "t_narrow_2d": torch.from_numpy(_A.reshape(2, 4))[:, 1:3],
    "t_flipped_u8": torch.from_numpy(_A).flip(0).to(torch.uint8)[::2],
}


@pytest.mark.parametrize("name", list(STRIDED_IDS))
@pytest.mark.parametrize("pl", ["cpu", "file"])
def test_non_contiguous_ids_gather(tmp_path, name, pl):
    ids = STRIDED_IDS[name]
    if pl == "cpu":
        g = cpu_table(REF)
    else:
        g = gl.DataGadget(write_file(tmp_path, REF, "npy"), placement="file", device="cpu")
    npids = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    out = g.getData(ids)
    assert tuple(out.shape) == npids.shape + (4,)
    np.testing.assert_array_equal(out.numpy(), REF[npids])
    g.close()


@pytest.mark.parametrize(
    "name",
    ["np_neg_stride", "np_neg_2d", "np_transposed", "t_transposed_i32", "np_bigendian_i8_neg"],
)
def test_non_contiguous_ids_insert_last_occurrence_in_view_order(name):
    ids = STRIDED_IDS[name]
    npids = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    g = cpu_table(REF)
    rows = np.arange(npids.size * 4, dtype=np.float32).reshape(npids.shape + (4,)) + 1000
    g.insertData(rows, ids)
    expect = REF.copy()
    for i, r in zip(npids.reshape(-1).tolist(), rows.reshape(-1, 4), strict=True):  # NumPy's order
        expect[i] = r
    np.testing.assert_array_equal(g.getNumpyVersion(), expect)


def test_zero_d_ids_insert(table):
    table.insertData(torch.full((4,), 2.5), np.array(6, dtype=np.uint8))
    table.insertData(np.full((4,), 3.5, np.float32), torch.tensor(2, dtype=torch.int16))
    table[8] = torch.full((4,), 4.5)
    expect = REF.copy()
    expect[6], expect[2], expect[8] = 2.5, 3.5, 4.5
    np.testing.assert_array_equal(table.getNumpyVersion(), expect)
    with pytest.raises(gl.GadgetValueError):  # not broadcast: a scalar is not a row
        table.insertData(np.float32(1.0), 3)
    np.testing.assert_array_equal(table.getNumpyVersion(), expect)


# ---------------------------------------------------------------------------------------
# rows from views: non-contiguous tensors, NumPy views, Fortran order
# ---------------------------------------------------------------------------------------

_BIG = np.arange(200, dtype=np.float32).reshape(10, 20) / 4


def _rows_sources():
    return {
        "t_col_step": torch.from_numpy(_BIG)[:3, ::5],
        "t_transposed": torch.from_numpy(_BIG[:4, :3].copy()).t(),
        "t_expand": torch.arange(4, dtype=torch.float32).expand(3, 4),
        "t_neg_as_flip": torch.from_numpy(_BIG[:3, :4].copy()).flip(0)[:, :],
        "np_neg_stride": _BIG[8::-3, 2:6],
        "np_fortran": np.asfortranarray(_BIG[:3, :4]),
        "np_transposed": _BIG[:4, :3].T,
        "np_broadcast": np.broadcast_to(_BIG[0, :4], (3, 4)),
        "np_bigendian": _BIG[:3, :4].astype(">f4"),
        "np_col_step": _BIG[1:4, ::5],
    }


@pytest.mark.parametrize("name", list(_rows_sources()))
@pytest.mark.parametrize("how", ["insertData", "scatter", "setitem"])
def test_non_contiguous_rows_written_exactly(name, how):
    rows = _rows_sources()[name]
    npr = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    assert npr.shape[0] == 3 and npr.shape[1:] == (4,), npr.shape
    g = cpu_table(REF)
    ids = torch.tensor([8, 1, 5], dtype=torch.int32)
    if how == "insertData":
        g.insertData(rows, ids)
    elif how == "scatter":
        g.scatter(ids, rows)
    else:
        g[ids] = rows
    expect = REF.copy()
    expect[[8, 1, 5]] = npr
    np.testing.assert_array_equal(g.getNumpyVersion(), expect)


@pytest.mark.parametrize(
    "name", ["t_col_step", "np_neg_stride", "np_fortran", "np_bigendian", "t_expand"]
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_rows_into_file_table(tmp_path, name, fmt):
    _need_fmt(fmt)
    rows = _rows_sources()[name]
    npr = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    p = str(tmp_path / f"r.{fmt}")
    cpu_table(REF).save(p)
    with gl.DataGadget(p, placement="file", device="cpu") as g:
        g.insertData(rows, np.array([9, 0, 4])[::-1])  # ids 4, 0, 9
    expect = REF.copy()
    expect[[4, 0, 9]] = npr
    np.testing.assert_array_equal(read_file(p, fmt), expect)


@pytest.mark.parametrize("name", list(_rows_sources()))
def test_view_sources_copied_in_exactly(name):
    src = _rows_sources()[name]
    npr = (src.numpy() if isinstance(src, torch.Tensor) else np.asarray(src)).copy()
    g = cpu_table(src)
    assert g.dtype == torch.float32 and tuple(g.shape) == npr.shape
    np.testing.assert_array_equal(g.getNumpyVersion(), npr)
    np.testing.assert_array_equal(g.getData([2, 0]).numpy(), npr[[2, 0]])


def test_fortran_npy_file_reads_exactly_and_file_table_is_read_only(tmp_path):
    F = np.asfortranarray((np.arange(24, dtype=np.float64).reshape(6, 4) - 3) / 8)
    p = str(tmp_path / "fort.npy")
    np.save(p, F)
    for pl in ("cpu", "file"):
        with gl.DataGadget(p, placement=pl, device="cpu") as g:
            np.testing.assert_array_equal(g.getNumpyVersion(), F)
            np.testing.assert_array_equal(g.getData(np.array([5, 0, 5])).numpy(), F[[5, 0, 5]])
    with (
        gl.DataGadget(p, placement="file", device="cpu") as g,
        pytest.raises(gl.ReadOnlyError, match="Fortran"),
    ):
        g.insertData(np.zeros((1, 4)), [0])
    np.testing.assert_array_equal(np.load(p), F)


def test_bfloat16_non_contiguous_source_and_rows():
    base = ref_tensor(torch.bfloat16, shape=(6, 8), seed=13)
    src = base[::2, 1::2]
    g = cpu_table(src)
    np.testing.assert_array_equal(bits(g.as_tensor()), bits(src))
    rows = base.t()[:2, :4]  # (2, 4) transposed view
    g.insertData(rows, torch.tensor([2, 0]))
    expect = src.clone()
    expect[[2, 0]] = rows
    np.testing.assert_array_equal(bits(g.as_tensor()), bits(expect))


# ---------------------------------------------------------------------------------------
# NumPy's array protocol and views per dtype
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_array_protocol_per_dtype(dt):
    t = ref_tensor(dt, shape=(4, 2), seed=14)
    g = cpu_table(t)
    a = np.asarray(g)
    ref = t.float() if dt == torch.bfloat16 else t
    np.testing.assert_array_equal(bits(a), bits(ref))
    if dt == torch.bfloat16:
        # "for any other table that request raises GadgetValueError (a ValueError)"
        if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
            with pytest.raises(gl.GadgetValueError):
                np.asarray(g, copy=False)
        c = g.getNumpyVersion(copy=False)  # a copy all the same
        c[...] = 0
        np.testing.assert_array_equal(bits(g.as_tensor()), bits(t))
    else:
        v = g.getNumpyVersion(copy=False)
        assert v.dtype == t.numpy().dtype
        v[0] = v[1]  # a view: the table changes
        np.testing.assert_array_equal(bits(g.getData(0)), bits(t[1]))


# ---------------------------------------------------------------------------------------
# OffloadedEmbedding
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dt", FLOATS, ids=_name)
def test_offloaded_embedding_lookups_per_dtype(dt):
    emb = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu", dtype=dt)
    assert emb.weight.dtype == dt
    W = emb.weight.as_tensor().clone()
    for ids in (
        torch.tensor([1, 2, 1], dtype=torch.int32),
        torch.tensor([[3, 11]]),
        torch.tensor(5),
        torch.empty(0, dtype=torch.int64),
        torch.arange(12)[::5],
        torch.tensor([4, 0], dtype=torch.uint8),
        torch.arange(12).reshape(3, 4).t(),
    ):
        with torch.no_grad():
            out = emb(ids)
        assert out.dtype == dt and tuple(out.shape) == tuple(ids.shape) + (3,)
        np.testing.assert_array_equal(bits(out), bits(W[ids.long()]))
    for bad in (torch.tensor([1.0]), torch.tensor([True])):
        with pytest.raises(gl.GadgetTypeError):
            emb(bad)


@pytest.mark.parametrize("dt", FLOATS, ids=_name)
def test_offloaded_embedding_sgd_matches_dense_torch(dt):
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu", dtype=dt)
    ref = torch.nn.Parameter(emb.weight.as_tensor().clone())
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    ropt = torch.optim.SGD([ref], lr=0.1)
    c = torch.linspace(-1, 1, 4, dtype=dt)
    for ids in (
        torch.tensor([[1, 5, 1], [7, 5, 11]], dtype=torch.int32),
        torch.arange(12).flip(0)[::4],
    ):
        (emb(ids) * c).sum().backward()
        opt.step()
        opt.zero_grad()
        (torch.nn.functional.embedding(ids.long(), ref) * c).sum().backward()
        ropt.step()
        ropt.zero_grad()
    got = emb.weight.as_tensor()
    assert got.dtype == dt
    if dt in (torch.float32, torch.float64):  # README: bit-identical for float32 / float64
        np.testing.assert_array_equal(bits(got), bits(ref.detach()))
    else:  # "float16 / bfloat16 arithmetic ... match a dense table to rounding"
        torch.testing.assert_close(
            got, ref.detach(), rtol=2 * torch.finfo(dt).eps, atol=2 * torch.finfo(dt).eps
        )


def test_offloaded_embedding_load_state_dict_dtypes():
    emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")
    w64 = torch.arange(8, dtype=torch.float64).reshape(4, 2) / 3
    emb.load_state_dict({"weight": w64})  # converted as torch converts it
    assert emb.weight.dtype == torch.float32
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), w64.float().numpy())
    before = emb.weight.getNumpyVersion().copy()
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        emb.load_state_dict({"weight": torch.arange(8).reshape(4, 2)})  # integers refused
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)
    emb.load_state_dict({"weight": np.full((4, 2), 0.25, np.float32)})  # NumPy array taken
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), np.full((4, 2), 0.25, np.float32))
    ebf = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu", dtype="bfloat16")
    assert ebf.state_dict()["weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "conv,out_dt", [("half", torch.float16), ("double", torch.float64), ("bf16", torch.bfloat16)]
)
def test_offloaded_embedding_module_cast_changes_lookups_not_table(conv, out_dt):
    emb = gl.OffloadedEmbedding(6, 3, placement="cpu", device="cpu")
    W = emb.weight.as_tensor().clone()
    emb = emb.to(torch.bfloat16) if conv == "bf16" else getattr(emb, conv)()
    assert emb.weight.dtype == torch.float32
    with torch.no_grad():
        out = emb(torch.tensor([5, 0]))
    assert out.dtype == out_dt
    np.testing.assert_array_equal(bits(out), bits(W[[5, 0]].to(out_dt)))


# ---------------------------------------------------------------------------------------
# SpeedTorch switchers
# ---------------------------------------------------------------------------------------

FACTORIES = {
    "ModelFactory": lambda m, dt: gl.ModelFactory(m, 20, 4, datatype=dt, placement="cpu"),
    "PytorchModelFactory": lambda m, dt: gl.PytorchModelFactory(
        m, 20, 4, datatype=dt, deviceType="cpu"
    ),
}


@pytest.mark.parametrize("fac", list(FACTORIES))
@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float64"])
def test_switcher_datatype_variable_follows_and_rows_exact(fac, dt):
    m = torch.nn.Embedding(3, 4)  # float32 variable
    sw = FACTORIES[fac](m, dt)
    sw.uniformDistributionInit(-1, 1)
    T = torch.from_numpy(np.asarray(sw.getNumpyVersion())).to(getattr(torch, dt))
    ids = np.array([9, 4, 9, 17], dtype=np.int32)
    local = sw.beforeForwardPass(ids)
    assert m.weight.dtype == getattr(
        torch, dt
    )  # README: "makes the variable that dtype while it is paged"
    np.testing.assert_array_equal(bits(m.weight.detach()[local.long()]), bits(T[ids]))
    with torch.no_grad():
        m.weight[local.long()] += 1
    sw.afterOptimizerStep(ids)
    expect = T.clone()
    expect[[4, 9, 17]] += 1
    got = torch.from_numpy(np.asarray(sw.getNumpyVersion())).to(expect.dtype)
    np.testing.assert_array_equal(bits(got), bits(expect))


@pytest.mark.parametrize(
    "ids",
    [
        np.array([7, 2, 7], dtype=np.int16),
        torch.tensor([7, 2, 7], dtype=torch.int32),
        [7, 2, 7],
        torch.tensor([7, 2, 7], dtype=torch.uint8),
        np.array([7, 0, 2, 0, 7], dtype=np.uint64)[::-2],
        torch.tensor([[7, 2], [2, 19]]).t(),
        np.asfortranarray(np.array([[7, 2], [2, 19]], dtype=np.int64)),
    ],
    ids=["np_i16", "t_i32", "list", "t_u8", "np_u64_neg_stride", "t_transposed", "np_fortran"],
)
def test_switcher_id_kinds(ids):
    m = torch.nn.Embedding(2, 4)
    sw = gl.ModelFactory(m, 20, 4, placement="cpu")
    sw.normalDistributionInit(0, 1)
    T = np.asarray(sw.getNumpyVersion()).copy()
    local = sw.beforeForwardPass(ids)
    npids = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    assert tuple(local.shape) == npids.shape
    np.testing.assert_array_equal(
        m.weight.detach()[local.long()].numpy(), T[npids.astype(np.int64)]
    )


@pytest.mark.parametrize(
    "bad",
    [torch.tensor([1.0, 2.0]), np.array([True, False]), [0.5]],
    ids=["float", "bool", "list_float"],
)
def test_switcher_refuses_bool_and_float_ids(bad):
    m = torch.nn.Embedding(2, 4)
    sw = gl.ModelFactory(m, 20, 4, placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        sw.beforeForwardPass(bad)


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float64"])
def test_switcher_save_load_every_format_keeps_dtype(tmp_path, dt):
    sw = gl.PytorchModelFactory(torch.nn.Embedding(3, 4), 6, 4, datatype=dt, deviceType="cpu")
    sw.normalDistributionInit(0, 1)
    T = np.asarray(sw.getNumpyVersion()).copy()
    for fmt in FORMATS:
        if fmt != "npy":
            pytest.importorskip("h5py" if fmt == "h5" else "zarr")
        p = str(tmp_path / f"s.{fmt}")
        if dt == "bfloat16" and fmt == "npy":
            with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
                sw.save(p)
            assert not os.path.exists(p)
            continue
        sw.save(p)
        sw2 = gl.PytorchModelFactory(torch.nn.Embedding(3, 4), 6, 4, datatype=dt, deviceType="cpu")
        sw2.load(p)
        np.testing.assert_array_equal(bits(np.asarray(sw2.getNumpyVersion())), bits(T), err_msg=fmt)
    tp = str(tmp_path / "s.pt")
    sw.saveTorch(tp)
    saved = torch.load(tp, weights_only=True)
    assert saved.dtype == getattr(torch, dt) and saved.device.type == "cpu"
    sw3 = gl.PytorchModelFactory(torch.nn.Embedding(3, 4), 6, 4, datatype=dt, deviceType="cpu")
    sw3.loadTorch(tp)
    np.testing.assert_array_equal(bits(np.asarray(sw3.getNumpyVersion())), bits(T))


def test_switcher_load_of_other_dtype_refused_unchanged(tmp_path):
    sw = gl.ModelFactory(torch.nn.Embedding(3, 4), 6, 4, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    T = np.asarray(sw.getNumpyVersion()).copy()
    np.save(tmp_path / "f64.npy", np.ones((6, 4)))
    torch.save(torch.full((6, 4), 0.1, dtype=torch.float64), tmp_path / "inexact.pt")
    torch.save(torch.full((6, 4), 2, dtype=torch.int64), tmp_path / "int.pt")
    torch.save(torch.full((6, 4), 0.5, dtype=torch.float64), tmp_path / "exact.pt")
    for call in (
        lambda: sw.loadCupy(str(tmp_path / "f64.npy")),
        lambda: sw.loadTorch(str(tmp_path / "inexact.pt")),
        lambda: sw.loadTorch(str(tmp_path / "int.pt")),
    ):
        with pytest.raises(gl.GadgetTypeError) as ei:
            call()
        assert "float32" in str(ei.value)
        np.testing.assert_array_equal(np.asarray(sw.getNumpyVersion()), T)
    # "unless every value converts exactly (a float64 file of float32 values)"
    sw.loadTorch(str(tmp_path / "exact.pt"))
    got = np.asarray(sw.getNumpyVersion())
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.full((6, 4), 0.5, np.float32))


@pytest.mark.parametrize("dt", ["float64", "float16"])
def test_switcher_sgd_training_matches_dense_torch(dt):
    torch.manual_seed(1)
    tdt = getattr(torch, dt)
    m = torch.nn.Embedding(4, 3)
    sw = gl.ModelFactory(m, 15, 3, datatype=dt, placement="cpu")
    sw.normalDistributionInit(0, 1)
    ref = torch.nn.Parameter(torch.from_numpy(np.asarray(sw.getNumpyVersion()).copy()).to(tdt))
    ropt = torch.optim.SGD([ref], lr=0.5)
    c = torch.linspace(-1, 2, 3, dtype=tdt)
    batches = [
        np.array([3, 14, 3, 0], dtype=np.int32),
        torch.tensor([14, 2, 2, 9], dtype=torch.int16),
        [0, 1, 2, 3],
    ]
    for ids in batches:
        local = sw.beforeForwardPass(ids)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        (m(local) * c).sum().backward()
        opt.step()
        opt.zero_grad()
        sw.afterOptimizerStep(ids)
        rid = torch.as_tensor(
            np.asarray(ids if not isinstance(ids, torch.Tensor) else ids.numpy()), dtype=torch.int64
        )
        (torch.nn.functional.embedding(rid, ref) * c).sum().backward()
        ropt.step()
        ropt.zero_grad()
    got = torch.from_numpy(np.asarray(sw.getNumpyVersion()).copy())
    assert got.dtype == tdt
    if dt == "float64":
        np.testing.assert_array_equal(bits(got), bits(ref.detach()))
    else:
        torch.testing.assert_close(got, ref.detach(), rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------
# value-range checks per dtype (fill_)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dt,value,ok",
    [
        (torch.int8, 127, True),
        (torch.int8, 128, False),
        (torch.uint8, -1, False),
        (torch.uint8, 255, True),
        (torch.float16, 65504.0, True),
        (torch.float16, 70000.0, False),
        (torch.float16, float("inf"), True),
        (torch.bool, 1, True),
        (torch.bool, 2, False),
        (torch.int32, 1.5, False),
        (torch.bfloat16, 1e38, True),
        (torch.float32, np.float64(1e39), False),
    ],
    ids=str,
)
def test_fill_respects_dtype_range(dt, value, ok):
    t = ref_tensor(dt, shape=(3, 2), seed=15)
    g = cpu_table(t)
    if ok:
        g.fill_(value)
        np.testing.assert_array_equal(
            bits(g.as_tensor()), bits(torch.full((3, 2), value, dtype=dt))
        )
    else:
        with pytest.raises(gl.GadgetError):
            g.fill_(value)
        np.testing.assert_array_equal(bits(g.as_tensor()), bits(t))


def test_no_warnings_for_cpu_and_file_placements(tmp_path):
    p = write_file(tmp_path, REF, "npy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for pl in ("cpu", "file"):
            with gl.DataGadget(p, placement=pl, device="cpu") as g:
                np.testing.assert_array_equal(g.getData([1]).numpy(), REF[[1]])


# ---------------------------------------------------------------------------------------
# more interop edges
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src,dt",
    [
        ([[1.5, -2.0]], torch.float64),
        ([[1, -2]], torch.int64),
        ([[True, False]], torch.bool),
        ([0.5, 1.0, 2.0], torch.float64),
    ],
    ids=["floats", "ints", "bools", "1d"],
)
def test_list_source_takes_numpys_dtype(src, dt):
    # "a (nested) list"; "a list is read as NumPy reads it"
    g = cpu_table(src)
    assert g.dtype == dt
    np.testing.assert_array_equal(g.getNumpyVersion(), np.asarray(src))
    h = cpu_table(src, dtype="float32")
    assert h.dtype == torch.float32
    np.testing.assert_array_equal(h.getNumpyVersion(), np.asarray(src).astype(np.float32))


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(7,), (5, 2, 3)], ids=["labels_1d", "rows_3d"])
def test_scalar_and_block_rows_per_dtype_through_files(tmp_path, dt, shape):
    t = ref_tensor(dt, shape=shape, seed=16)
    g = cpu_table(t)
    ids = np.array([[4, 0], [4, 1]], dtype=np.uint8)
    out = g.getData(ids)
    assert tuple(out.shape) == (2, 2) + tuple(shape[1:])
    np.testing.assert_array_equal(bits(out), bits(t[torch.from_numpy(ids.astype(np.int64))]))
    for fmt in ("h5", "zarr") if dt == torch.bfloat16 else FORMATS:
        if fmt != "npy":
            pytest.importorskip("h5py" if fmt == "h5" else "zarr")
        p = str(tmp_path / f"b.{fmt}")
        g.save(p)
        with gl.DataGadget(p, placement="file", device="cpu") as h:
            assert h.dtype == dt and tuple(h.shape) == shape
            np.testing.assert_array_equal(bits(h.getData(ids)), bits(out), err_msg=fmt)


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_pickle_and_deepcopy_keep_dtype_and_bits(dt):
    import copy
    import pickle

    t = ref_tensor(dt, shape=(4, 3), seed=17)
    g = cpu_table(t)
    for h in (pickle.loads(pickle.dumps(g)), copy.deepcopy(g)):
        assert h.dtype == dt
        np.testing.assert_array_equal(bits(h.as_tensor()), bits(t))


def test_out_tensor_dtype_and_layout_checked(table):
    with pytest.raises(gl.GadgetTypeError, match="float32"):
        table.getData([1], out=torch.empty(1, 4, dtype=torch.float64))
    with pytest.raises(gl.GadgetValueError, match="contiguous"):
        table.getData([1, 2], out=torch.empty(2, 8)[:, ::2])
    out = torch.empty(2, 4)
    assert table.getData(np.array([9, 3], dtype=np.uint16), out=out) is out
    np.testing.assert_array_equal(out.numpy(), REF[[9, 3]])


@pytest.mark.parametrize("npdt", [np.float64, np.float16, np.int16])
def test_array_protocol_dtype_argument(table, npdt):
    np.testing.assert_array_equal(np.asarray(table, dtype=npdt), REF.astype(npdt))
    assert np.array(table, dtype=npdt).dtype == npdt


def test_rows_requiring_grad_are_copied_detached():
    x = torch.full((2, 4), 1.5, requires_grad=True)
    g = cpu_table(x)
    assert not g.as_tensor().requires_grad
    g.insertData((x * 2)[:1], [1])
    np.testing.assert_array_equal(g.getNumpyVersion(), np.array([[1.5] * 4, [3.0] * 4], np.float32))
    assert not g.getData([0, 1]).requires_grad


def test_read_only_and_offset_sources():
    ro = np.arange(12, dtype=np.float32).reshape(6, 2)
    ro.flags.writeable = False
    g = cpu_table(ro[2:])
    np.testing.assert_array_equal(g.getNumpyVersion(), ro[2:])
    g.insertData(ro[:1], np.array([3]))
    np.testing.assert_array_equal(g.getData(3).numpy(), ro[0])
    t = torch.arange(24, dtype=torch.int16).reshape(12, 2)[5:9]  # storage offset
    h = cpu_table(t)
    np.testing.assert_array_equal(h.getNumpyVersion(), t.numpy())


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.bool])
def test_zero_row_in_memory_table(dt):
    z = cpu_table((0, 3), dtype=dt)
    assert tuple(z.shape) == (0, 3) and z.dtype == dt
    out = z.getData(np.array([], dtype=np.int32))
    assert tuple(out.shape) == (0, 3) and out.dtype == dt
    with pytest.raises(gl.GadgetIndexError):
        z.getData([0])


@pytest.mark.parametrize("dt", FLOATS, ids=_name)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_offloaded_embedding_bag_per_dtype_matches_torch(dt, mode):
    bag = gl.OffloadedEmbeddingBag(10, 3, mode=mode, placement="cpu", device="cpu", dtype=dt)
    assert bag.weight.dtype == dt
    W = bag.weight.as_tensor().clone()
    inp = torch.tensor([[1, 2, 2], [9, 0, 4]], dtype=torch.int32)
    flat, offs = inp.reshape(-1), torch.tensor([0, 3], dtype=torch.int32)
    with torch.no_grad():
        out2d = bag(inp)
        out1d = bag(flat, offs)
    ref = torch.nn.functional.embedding_bag(inp.long(), W, mode=mode)
    assert out2d.dtype == dt
    np.testing.assert_array_equal(bits(out2d), bits(ref))
    np.testing.assert_array_equal(bits(out1d), bits(ref))


def test_dataset_columns_keep_their_dtypes():
    cols = [
        ref_tensor(torch.bfloat16, shape=(8, 2), seed=18),
        np.arange(8, dtype=np.int64) - 3,
        np.arange(8) % 3 == 0,
        np.arange(16, dtype=np.uint8).reshape(8, 2),
        np.linspace(0, 1, 8).astype(np.float16),
    ]
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    ids = np.array([7, 1, 1], dtype=np.uint16)
    batch = ds[ids]
    for col, got in zip(cols, batch, strict=True):
        ref = col if isinstance(col, torch.Tensor) else torch.from_numpy(col)
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(bits(got), bits(ref[ids.astype(np.int64)]))


@pytest.mark.parametrize("dt", ["float64", "float32", "float16", "bfloat16"])
def test_switchers_adam_with_state_tables_of_that_dtype_match_dense_torch(dt):
    # batches cover every row, so lazy per-row Adam equals dense Adam on the whole table
    tdt = getattr(torch, dt)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.u = torch.nn.Embedding(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sw = gl.ModelFactory(model.u, 6, 3, datatype=dt, placement="cpu")
    sw.normalDistributionInit(0, 1)
    osw = gl.OptimizerFactory(opt, 6, 3, model, "u", dtype=dt, placement="cpu")
    osw.optInit()
    ref = torch.nn.Parameter(torch.from_numpy(np.asarray(sw.getNumpyVersion()).copy()).to(tdt))
    ropt = torch.optim.Adam([ref], lr=0.1)
    c = torch.linspace(-1, 2, 3, dtype=tdt)
    batches = [
        np.array([3, 5, 3, 0, 1, 2, 4], dtype=np.int32),
        torch.tensor([5, 4, 3, 2, 1, 0, 0], dtype=torch.int16),
        [0, 1, 2, 3, 4, 5],
        np.array([5, 0, 1, 2, 3, 4, 5, 5], dtype=np.uint64)[::-1],
    ]
    for ids in batches:
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        assert model.u.weight.dtype == tdt
        (model.u(local) * c).sum().backward()
        opt.step()
        opt.zero_grad()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        rid = torch.as_tensor(
            np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids).astype(np.int64)
        )
        (torch.nn.functional.embedding(rid, ref) * c).sum().backward()
        ropt.step()
        ropt.zero_grad()
    got = torch.from_numpy(np.asarray(sw.getNumpyVersion()).copy()).to(tdt)
    np.testing.assert_array_equal(bits(got), bits(ref.detach()))
    state = osw.getNumpyVersion()
    assert set(state) == {"exp_avg", "exp_avg_sq"}
    for k, v in state.items():
        np.testing.assert_array_equal(
            bits(torch.from_numpy(np.asarray(v).copy()).to(tdt)),
            bits(ropt.state[ref][k]),
            err_msg=k,
        )


@pytest.mark.parametrize(
    "src,dt,ok",
    [
        (np.array([[65519.0]]), "float16", True),  # rounds to 65504, finite
        (np.array([[65520.0]]), "float16", False),  # would become inf
        (np.array([[65519]], dtype=np.int64), "float16", True),
        (np.array([[-65520]], dtype=np.int64), "float16", False),
        (np.array([[3.39e38]]), "bfloat16", True),
        (np.array([[3.3961775e38]]), "bfloat16", False),
        (np.array([[2**64 - 1]], dtype=np.uint64), "float32", True),
        (np.array([[2**31 - 1, -(2**31)]], dtype=np.int64), "int32", True),
        (np.array([[2**31]], dtype=np.int64), "int32", False),
    ],
    ids=str,
)
def test_dtype_conversion_range_edges(src, dt, ok):
    # docstring: "a finite value that would become ``inf``, raises ``GadgetValueError``"
    if ok:
        got = cpu_table(src, dtype=dt).as_tensor()
        if dt == "bfloat16":
            ref = torch.from_numpy(src.astype(np.float64)).to(torch.bfloat16)
        else:
            ref = torch.from_numpy(src.astype(dt))
        np.testing.assert_array_equal(bits(got), bits(ref))
        assert torch.isfinite(got.float()).all()
    else:
        with pytest.raises(gl.GadgetValueError):
            cpu_table(src, dtype=dt)


def test_fill_value_that_rounds_to_max_is_refused():
    # "a value past its largest finite number, even one that would round to it, is refused"
    g = cpu_table(np.ones((2, 2), np.float16))
    with pytest.raises(gl.GadgetValueError):
        g.fill_(65519.0)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.ones((2, 2), np.float16))


def test_longdouble_array_converts_with_dtype_within_its_kind():
    # docstring: "With an array or tensor source, ``dtype`` converts it when the cast keeps its
    # kind or widens it (float64 -> float32 ...)"; float128 -> float64 keeps the float kind
    a = np.array([[1.5, -2.25], [1e300, 0.0]], dtype=np.longdouble)
    g = cpu_table(a, dtype="float64")
    assert g.dtype == torch.float64
    np.testing.assert_array_equal(g.getNumpyVersion(), a.astype(np.float64))
