"""Session 10 review: systematic dtype and shape coverage, against NumPy as the reference.

Every supported table dtype (float16, bfloat16, float32, float64, int8-int64, uint8, bool)
through creation, ``getData`` / ``insertData``, initialisers, ``save`` / ``load`` in .npy,
HDF5 and zarr (v3 and v2, native and big-endian), ``file`` tables, and the CLI; and the
unsupported dtypes (complex, uint16/32/64, strings, ...) as clear errors.

Only CPU placements are used here ('cpu' and 'file').
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.cli import main as cli_main

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")
try:  # NumPy's bfloat16 (optional: without it the bfloat16 NumPy-source cases skip)
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None

pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")


@pytest.fixture(autouse=True)
def _deliver_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check host tables against NumPy: rows are delivered to the CPU on a CUDA
    machine too (where a table's default device would be the GPU)."""
    import gadgetloader._device as device

    monkeypatch.setattr(device, "default_device", lambda: torch.device("cpu"))


DTYPES = [
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
NP_DTYPES = [d for d in DTYPES if d != "bfloat16"]
MULTIBYTE = ["float16", "float32", "float64", "int16", "int32", "int64"]
FORMATS = {"npy": ".npy", "hdf5": ".h5", "zarr": ".zarr"}


# ---- helpers ----------------------------------------------------------------------------------
def tdt(name: str) -> torch.dtype:
    return getattr(torch, name)


def make(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Reference data: random values plus the dtype's special values (nan, inf, -0.0,
    a subnormal, min and max) at the front."""
    dt = tdt(dtype)
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(seed * 1000 + DTYPES.index(dtype))
    if dt == torch.bool:
        flat = torch.rand(n, generator=gen) > 0.5
    elif dt.is_floating_point:
        flat = (torch.randn(n, generator=gen, dtype=torch.float64) * 50).to(dt)
        fi = torch.finfo(dt)
        specials = [math.nan, math.inf, -math.inf, -0.0, fi.tiny / 4, fi.max, fi.min, 0.5]
        k = min(n, len(specials))
        flat[:k] = torch.tensor(specials[:k], dtype=torch.float64).to(dt)
    else:
        info = torch.iinfo(dt)
        flat = torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dt)
        specials = [info.min, info.max, 0, 1]
        k = min(n, len(specials))
        flat[:k] = torch.tensor(specials[:k], dtype=torch.int64).to(dt)
    return flat.reshape(shape)


def mild(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values every supported dtype holds exactly (0..100 / halves / bools)."""
    dt = tdt(dtype)
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(seed + 7)
    if dt == torch.bool:
        flat = torch.rand(n, generator=gen) > 0.5
    else:
        flat = torch.randint(0, 101, (n,), generator=gen, dtype=torch.int64)
        flat = flat.to(dt)
    return flat.reshape(shape)


def to_np(t: torch.Tensor) -> np.ndarray:
    """A tensor as NumPy (bfloat16 as float32, exactly)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def np_bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns of floating arrays (nan, -0.0 compare exactly); others as they are."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f":
        return a.view(f"u{a.dtype.itemsize}")
    if a.dtype.name == "bfloat16":
        return a.view(np.uint16)
    return a


def same(got: Any, expected: np.ndarray) -> bool:
    """Exact (bitwise for floats) equality of a result with a NumPy reference."""
    g = to_np(got) if isinstance(got, torch.Tensor) else np.asarray(got)
    if g.shape != expected.shape:
        return False
    if g.dtype != expected.dtype:
        return False
    return bool(np.array_equal(np_bits(g), np_bits(expected)))


def np_source(t: torch.Tensor) -> np.ndarray:
    """``t`` as a NumPy array of its own dtype (bfloat16: ml_dtypes.bfloat16)."""
    if t.dtype == torch.bfloat16:
        if ml_dtypes is None:
            pytest.skip("bfloat16 NumPy arrays need ml_dtypes")
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


def word(name: str, text: str) -> bool:
    """``name`` as a whole word ('float16' does not match inside 'bfloat16')."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def tree_hash(p: Path) -> str:
    h = hashlib.md5()
    if p.is_file():
        h.update(p.read_bytes())
        return h.hexdigest()
    for f in sorted(p.rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(p)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def read_native(path: Path, dataset: str | None = None) -> tuple[np.ndarray, str | None]:
    """What NumPy / h5py / zarr themselves read from ``path``, and the bfloat16 attribute."""
    s = str(path)
    if s.lower().endswith(".npy"):
        return np.load(s), None
    if s.lower().endswith((".h5", ".hdf5", ".hdf")):
        with h5py.File(s, "r") as f:
            if dataset is None:
                names: list[str] = []
                f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
                assert len(names) == 1, names
                dataset = names[0]
            ds = f[dataset]
            return ds[()], ds.attrs.get("gadgetloader_dtype")
    node = zarr.open(s, mode="r")
    arr = node[dataset] if dataset else node
    if isinstance(arr, zarr.Group):
        names = [n for n, m in arr.members(max_depth=None) if isinstance(m, zarr.Array)]
        assert len(names) == 1, names
        arr = arr[names[0]]
    return arr[...], arr.attrs.get("gadgetloader_dtype")


def native_as_table(arr: np.ndarray, attr: str | None) -> np.ndarray:
    """A natively read array as the reference form (bfloat16 bits -> float32)."""
    if attr == "bfloat16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    return arr.astype(arr.dtype.newbyteorder("=")) if arr.dtype.byteorder == ">" else arr


def np_dtype_of(dtype: str) -> np.dtype:
    return np.dtype(np.float32) if dtype == "bfloat16" else np.dtype(dtype)


def cpu_table(t: Any, **kw: Any) -> gl.DataGadget:
    return gl.DataGadget(t, placement="cpu", **kw)


SHAPES = [(7,), (7, 3), (7, 2, 3), (7, 0), (1, 3), (1,)]


def ids_for(rows: int) -> np.ndarray:
    """A 2-D id array with repeats, in range."""
    return np.array([[rows - 1, 0], [rows // 2, rows - 1], [0, 0]], dtype=np.int64)


# ---- 1. creation from NumPy arrays, tensors and lists: shape, dtype, values -------------------------
@pytest.mark.parametrize("source", ["numpy", "torch", "list+dtype", "wider+dtype"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_create_get_values_and_dtype(dtype: str, shape: tuple[int, ...], source: str) -> None:
    if source == "list+dtype" and math.prod(shape) == 0:
        pytest.skip("an empty nested list is float64 to NumPy, whatever dtype= says")
    ref = make(dtype, shape) if not source.endswith("+dtype") else mild(dtype, shape)
    ref_np = to_np(ref)
    if source == "numpy":
        g = cpu_table(np_source(ref))
    elif source == "torch":
        g = cpu_table(ref.clone())
    elif source == "list+dtype":
        g = cpu_table(ref.tolist(), dtype=dtype)
    else:  # a wider dtype of the same kind, narrowed by dtype= (documented)
        wide = (
            ref.to(torch.float64)
            if ref.dtype.is_floating_point
            else (ref if ref.dtype == torch.bool else ref.to(torch.int64))
        )
        g = cpu_table(wide, dtype=dtype)
    assert g.dtype == tdt(dtype)
    assert g.shape == shape and len(g) == shape[0] and g.row_shape == shape[1:]
    assert g.nbytes == math.prod(shape) * tdt(dtype).itemsize
    whole = g.getNumpyVersion()
    assert whole.dtype == np_dtype_of(dtype)
    assert same(whole, ref_np)
    assert g.as_tensor().dtype == tdt(dtype)
    assert same(g.as_tensor(), ref_np)
    ids = ids_for(shape[0])
    rows = g.getData(ids)
    assert rows.dtype == tdt(dtype) and rows.device.type == "cpu"
    assert tuple(rows.shape) == ids.shape + shape[1:]
    assert same(rows, ref_np[ids])
    one = g.getData(shape[0] - 1)  # a plain int: one row, no leading axis
    assert tuple(one.shape) == shape[1:] and one.dtype == tdt(dtype)
    assert same(one, ref_np[shape[0] - 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_creation_copies_the_source(dtype: str) -> None:
    ref = make(dtype, (5, 3))
    t = ref.clone()
    a = np_source(ref)
    g1, g2 = cpu_table(t), cpu_table(a)
    t.zero_()
    a[...] = 0
    assert same(g1.getNumpyVersion(), to_np(ref))
    assert same(g2.getNumpyVersion(), to_np(ref))


@pytest.mark.parametrize(
    "ids",
    [
        "np.int8",
        "np.uint8",
        "np.int16",
        "np.int32",
        "np.uint64",
        "torch.int8",
        "torch.uint8",
        "torch.int32",
        "list",
        "range",
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_with_every_integer_id_type(dtype: str, ids: str) -> None:
    ref = make(dtype, (9, 2))
    g = cpu_table(ref)
    raw = [8, 0, 3, 3, 1]
    if ids == "list":
        idx: Any = raw
    elif ids == "range":
        idx, raw = range(2, 7), list(range(2, 7))
    elif ids.startswith("np."):
        idx = np.array(raw, dtype=ids[3:])
    else:
        idx = torch.tensor(raw, dtype=tdt(ids[6:]))
    got = g.getData(idx)
    assert got.dtype == tdt(dtype)
    assert same(got, to_np(ref)[raw])


# ---- 2. unsupported dtypes: clear errors ---------------------------------------------------------
UNSUPPORTED_NP = [
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
    "U3",
    "S2",
    "O",
    "datetime64[s]",
    "timedelta64[s]",
    "V4",
]
UNSUPPORTED_TORCH = ["complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn"]


@pytest.mark.parametrize("dt", UNSUPPORTED_NP)
def test_unsupported_numpy_source_is_a_type_error_naming_it(dt: str) -> None:
    a = np.zeros((3, 2), dtype=dt)
    with pytest.raises(gl.GadgetTypeError) as exc:
        cpu_table(a)
    assert isinstance(exc.value, TypeError)
    msg = str(exc.value)
    assert str(a.dtype) in msg or a.dtype.name in msg


@pytest.mark.parametrize("dt", UNSUPPORTED_TORCH)
def test_unsupported_torch_source_is_a_type_error_naming_it(dt: str) -> None:
    t = torch.zeros((3, 2), dtype=tdt(dt))
    with pytest.raises(gl.GadgetTypeError) as exc:
        cpu_table(t)
    assert dt in str(exc.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((3, 2), dtype=dt, placement="cpu")


@pytest.mark.parametrize("dt", ["complex64", "uint16", "uint32", "float128", "str", "foo", "c8"])
def test_unsupported_dtype_for_a_new_table_lists_the_supported_ones(dt: str) -> None:
    if dt == "float128" and not hasattr(np, "float128"):
        pytest.skip("no float128 here")
    with pytest.raises(gl.GadgetTypeError) as exc:
        gl.DataGadget((3, 2), dtype=dt, placement="cpu")
    msg = str(exc.value)
    assert "float32" in msg and "int64" in msg and "uint8" in msg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("other", DTYPES)
def test_insert_of_another_supported_dtype_is_refused_and_named(
    dtype: str, other: str, kind: str
) -> None:
    if other == dtype:
        pytest.skip("same dtype")
    ref = make(dtype, (6, 3))
    g = cpu_table(ref)
    data = mild(other, (2, 3))
    src = np_source(data) if kind == "numpy" else data
    with pytest.raises(gl.GadgetTypeError) as exc:
        g.insertData(src, [1, 4])
    assert isinstance(exc.value, TypeError)
    msg = str(exc.value)
    assert word(dtype, msg), msg  # what was expected (the table's dtype)
    assert word(other, msg), msg  # and what arrived
    assert same(g.getNumpyVersion(), to_np(ref))  # nothing written


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool", "bfloat16"])
@pytest.mark.parametrize(
    "bad",
    ["np.complex64", "np.uint16", "np.uint32", "np.U3", "torch.complex64", "torch.uint16"],
)
def test_insert_of_an_unsupported_dtype_names_table_dtype_and_arrival(dtype: str, bad: str) -> None:
    """README 'Rules that hold on every placement': data of the wrong dtype raises an error
    'that says what was expected and what arrived'. What is expected is the table's dtype."""
    ref = make(dtype, (6, 3))
    g = cpu_table(ref)
    lib, name = bad.split(".")
    data: Any = (
        np.zeros((2, 3), dtype=name) if lib == "np" else torch.zeros((2, 3), dtype=tdt(name))
    )
    with pytest.raises(gl.GadgetTypeError) as exc:
        g.insertData(data, [0, 5])
    msg = str(exc.value)
    arrived = name if name != "U3" else "<U3"
    assert arrived in msg, msg
    # the table's dtype must be named as the expectation, not only inside the list of
    # every dtype a table may hold
    head = msg.split("tables hold")[0]
    assert word(dtype, head), msg
    assert same(g.getNumpyVersion(), to_np(ref))


# ---- 3. non-contiguous, negative-stride, Fortran-order and big-endian sources ------------------------
NP_VIEWS = {
    "fortran": lambda x: np.asfortranarray(x),
    "neg_rows": lambda x: x[::-1],
    "neg_cols": lambda x: x[:, ::-1],
    "neg_both": lambda x: x[::-1, ::-2],
    "step": lambda x: x[::2, ::3],
    "transposed": lambda x: x.T,
    "broadcast": lambda x: np.broadcast_to(x[:1], x.shape),
    "readonly": lambda x: _readonly(x),
}


def _readonly(x: np.ndarray) -> np.ndarray:
    y = x.copy()
    y.flags.writeable = False
    return y


TORCH_VIEWS = {
    "t": lambda x: x.t(),
    "step": lambda x: x[::2, ::3],
    "narrow": lambda x: x[:, 1:4],
    "expand": lambda x: x[:1].expand(x.shape[0], -1),
    "permute3d": lambda x: x.reshape(x.shape[0], 2, 3).permute(0, 2, 1),
}


@pytest.mark.parametrize("view", list(NP_VIEWS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_strided_sources_create_and_insert(dtype: str, view: str) -> None:
    base = np_source(make(dtype, (12, 6)))
    v = NP_VIEWS[view](base)
    expected = (
        to_np(torch.from_numpy(np.array(v).view(np.int16)).view(torch.bfloat16))
        if dtype == "bfloat16"
        else np.array(v)
    )
    g = cpu_table(v)
    assert g.shape == v.shape and g.dtype == tdt(dtype)
    assert same(g.getNumpyVersion(), expected)
    # the same view as insertData's rows, into a zeroed table of that shape
    h = gl.DataGadget(v.shape, dtype=dtype, placement="cpu")
    h.insertData(v, np.arange(v.shape[0])[::-1].copy())
    assert same(h.getNumpyVersion(), expected[::-1])


@pytest.mark.parametrize("view", list(TORCH_VIEWS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_strided_sources_create_and_insert(dtype: str, view: str) -> None:
    base = make(dtype, (12, 6))
    v = TORCH_VIEWS[view](base)
    assert not v.is_contiguous()
    expected = to_np(v.contiguous())
    g = cpu_table(v)
    assert g.shape == tuple(v.shape) and same(g.getNumpyVersion(), expected)
    h = gl.DataGadget(tuple(v.shape), dtype=dtype, placement="cpu")
    ids = torch.arange(v.shape[0]).flip(0)
    h.insertData(v, ids)
    assert same(h.getNumpyVersion(), expected[::-1])


@pytest.mark.parametrize("dtype", MULTIBYTE)
def test_big_endian_numpy_sources_create_and_insert(dtype: str) -> None:
    ref = to_np(make(dtype, (6, 4)))
    be = ref.astype(ref.dtype.newbyteorder(">"))
    g = cpu_table(be)
    assert g.dtype == tdt(dtype) and same(g.getNumpyVersion(), ref)
    h = gl.DataGadget((6, 4), dtype=dtype, placement="cpu")
    h.insertData(be[[5, 0]], [0, 5])
    exp = np.zeros_like(ref)
    exp[[0, 5]] = ref[[5, 0]]
    assert same(h.getNumpyVersion(), exp)


# ---- 4. insertData: values, repeats, shapes -------------------------------------------------------
@pytest.mark.parametrize("kind", ["numpy", "torch", "setitem"])
@pytest.mark.parametrize("shape", [(9,), (9, 3), (9, 2, 3), (9, 0), (1, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_insert_values_last_occurrence_wins(dtype: str, shape: tuple[int, ...], kind: str) -> None:
    ref = make(dtype, shape)
    g = cpu_table(ref)
    ids = ids_for(shape[0])
    rows = make(dtype, ids.shape + shape[1:], seed=3)
    expected = to_np(ref).copy()
    flat_rows = to_np(rows).reshape(ids.size, *shape[1:])
    for i, r in enumerate(ids.reshape(-1)):  # NumPy's sequential assignment
        expected[r] = flat_rows[i]
    if kind == "numpy":
        g.insertData(np_source(rows), ids)
    elif kind == "torch":
        g.insertData(rows, torch.from_numpy(ids))
    else:
        g[ids] = rows
    assert same(g.getNumpyVersion(), expected)
    assert same(g.getData(ids), expected[ids])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,bad",
    [
        ((6, 3), (2, 4)),
        ((6, 3), (2,)),
        ((6, 3), (2, 3, 1)),
        ((6,), (2, 1)),
        ((6, 2, 3), (2, 3, 2)),
        ((6, 0), (2, 1)),
        ((6, 3), (3, 3)),
    ],
    ids=str,
)
def test_insert_wrong_shape_is_a_value_error_naming_both(
    dtype: str, shape: tuple[int, ...], bad: tuple[int, ...]
) -> None:
    ref = make(dtype, shape)
    g = cpu_table(ref)
    with pytest.raises(gl.GadgetValueError) as exc:
        g.insertData(make(dtype, bad, seed=1), [0, 5])
    assert isinstance(exc.value, ValueError)
    msg = str(exc.value)
    assert str((2, *shape[1:])) in msg and str(bad) in msg, msg
    assert same(g.getNumpyVersion(), to_np(ref))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_ids_leave_every_dtype_unchanged(dtype: str) -> None:
    ref = make(dtype, (5, 2))
    g = cpu_table(ref)
    rows = make(dtype, (2, 2), seed=4)
    for bad, err in [
        ([0, 5], gl.GadgetIndexError),
        ([-1, 0], gl.GadgetIndexError),
        (np.array([0.0, 1.0]), gl.GadgetTypeError),
    ]:
        with pytest.raises(err):
            g.insertData(rows, bad)
        with pytest.raises(err):
            g.getData(bad)
    assert same(g.getNumpyVersion(), to_np(ref))


# ---- 5. zero rows, zero-width rows, one row --------------------------------------------------------
@pytest.mark.parametrize("how", ["shape", "numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_row_table(dtype: str, how: str, tmp_path: Path) -> None:
    if how == "shape":
        g = gl.DataGadget((0, 3), dtype=dtype, placement="cpu")
    elif how == "numpy":
        g = cpu_table(np_source(make(dtype, (0, 3))))
    else:
        g = cpu_table(make(dtype, (0, 3)))
    assert g.shape == (0, 3) and len(g) == 0 and g.dtype == tdt(dtype) and g.nbytes == 0
    empty = g.getData(np.zeros((0,), dtype=np.int64))
    assert tuple(empty.shape) == (0, 3) and empty.dtype == tdt(dtype)
    g.insertData(make(dtype, (0, 3)), [])
    assert g.getNumpyVersion().shape == (0, 3)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([0])
    for fmt, ext in FORMATS.items():  # a zero-row table is not saved (README, Files)
        p = tmp_path / f"z{ext}"
        with pytest.raises(gl.GadgetError) as exc:
            g.save(p)
        if not (fmt == "npy" and dtype == "bfloat16"):  # that one: "no .npy form"
            assert str(p) in str(exc.value) and "zero rows" in str(exc.value)
        assert not p.exists()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_row_files_are_refused_naming_the_file(dtype: str, fmt: str, tmp_path: Path) -> None:
    p = tmp_path / f"z{FORMATS[fmt]}"
    npd = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    if fmt == "npy":
        if dtype == "bfloat16":
            pytest.skip("bfloat16 has no .npy form")
        np.save(p, np.zeros((0, 3), dtype=npd))
    elif fmt == "hdf5":
        with h5py.File(p, "w") as f:
            ds = f.create_dataset("d", shape=(0, 3), dtype=npd)
            if dtype == "bfloat16":
                ds.attrs["gadgetloader_dtype"] = "bfloat16"
    else:
        z = zarr.create_array(store=str(p), shape=(0, 3), chunks=(1, 3), dtype=npd)
        if dtype == "bfloat16":
            z.attrs["gadgetloader_dtype"] = "bfloat16"
    for pl in ["cpu", "file"]:
        with pytest.raises(gl.GadgetValueError) as exc:
            gl.DataGadget(p, placement=pl)
        assert str(p) in str(exc.value) and "zero rows" in str(exc.value)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_width_rows_round_trip(dtype: str, fmt: str, tmp_path: Path) -> None:
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    g = gl.DataGadget((5, 0), dtype=dtype, placement="cpu")
    got = g.getData([[4, 0], [1, 1]])
    assert tuple(got.shape) == (2, 2, 0) and got.dtype == tdt(dtype)
    g.insertData(make(dtype, (3, 0)), [4, 4, 0])
    p = tmp_path / f"w{FORMATS[fmt]}"
    g.save(p)
    for pl in ["cpu", "file"]:
        h = gl.DataGadget(p, placement=pl)
        assert h.shape == (5, 0) and h.dtype == tdt(dtype)
        r = h.getData([4, 0, 2])
        assert tuple(r.shape) == (3, 0) and r.dtype == tdt(dtype)
        if pl == "file":
            h.insertData(make(dtype, (2, 0)), [1, 3])
        h.close()
    arr, _ = read_native(p)
    assert arr.shape == (5, 0)


# ---- 6. initialisers ------------------------------------------------------------------------------
FILL_OK: dict[str, list[Any]] = {
    "float16": [65504, -65504, 1.5, math.inf, -math.inf, math.nan, 1e-10, np.float32(2.5)],
    "bfloat16": [3.38e38, -2.0, math.inf, math.nan, 1],
    "float32": [3.4e38, -1.25, math.nan, np.float64(7.0), torch.tensor(3.0), True],
    "float64": [1.7976931348623157e308, -0.0, math.inf, 2**70],
    "int8": [-128, 127, 0, 5.0, np.int8(-3), True],
    "int16": [-32768, 32767],
    "int32": [-(2**31), 2**31 - 1],
    "int64": [-(2**63), 2**63 - 1, np.int64(9), torch.tensor(-4)],
    "uint8": [0, 255, 7.0, np.uint8(200)],
    "bool": [True, False, 0, 1, 1.0, np.bool_(True)],
}
FILL_BAD: dict[str, list[Any]] = {
    "float16": [65520, 70000, -1e6, 10**400, "1", 1 + 2j, None],
    "bfloat16": [3.4e38, 1e39, -1e39],
    "float32": [3.5e38, 1e300, np.float64(-1e300), np.array([1.0, 2.0])],
    "float64": [10**400],
    "int8": [128, -129, 0.5, math.nan, math.inf],
    "int16": [32768, -32769],
    "int32": [2**31, 1e10],
    "int64": [2**63, -(2**63) - 1, np.uint64(2**64 - 1), 1e19],
    "uint8": [256, -1, 3.5],
    "bool": [2, -1, 0.5, math.nan],
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_accepts_values_the_dtype_holds(dtype: str) -> None:
    for v in FILL_OK[dtype]:
        g = gl.DataGadget((3, 2), dtype=dtype, placement="cpu")
        g.fill_(v)
        pv = v.item() if isinstance(v, (np.generic, torch.Tensor)) else v
        if tdt(dtype).is_floating_point:
            pv = float(pv)
        expected = torch.full((3, 2), pv, dtype=tdt(dtype))
        assert same(g.getNumpyVersion(), to_np(expected)), (dtype, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_refuses_values_the_dtype_cannot_hold(dtype: str) -> None:
    for v in FILL_BAD[dtype]:
        ref = make(dtype, (3, 2))
        g = cpu_table(ref)
        with pytest.raises(gl.GadgetError) as exc:
            g.fill_(v)
        assert isinstance(exc.value, (TypeError, ValueError))
        assert dtype in str(exc.value), str(exc.value)
        assert same(g.getNumpyVersion(), to_np(ref)), (dtype, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_initialisers_only_for_floating_tables(dtype: str) -> None:
    g = gl.DataGadget((50, 4), dtype=dtype, placement="cpu")
    if tdt(dtype).is_floating_point:
        g.uniform_(-2.0, 3.0, generator=torch.Generator().manual_seed(0))
        a = g.getNumpyVersion()
        assert a.dtype == np_dtype_of(dtype) and (a >= -2).all() and (a <= 3).all()
        assert len(np.unique(a)) > 10
        g.normal_(generator=torch.Generator().manual_seed(0))
        assert np.isfinite(g.getNumpyVersion()).all()
        g.zero_()
        assert not g.getNumpyVersion().any()
    else:
        g.fill_(1)
        for fn in (g.uniform_, g.normal_):
            with pytest.raises(gl.GadgetTypeError) as exc:
                fn()
            assert dtype in str(exc.value)
        assert g.getNumpyVersion().all()
        g.zero_()
        assert not g.getNumpyVersion().any()


# ---- 7. dtype= conversion of an array source -------------------------------------------------------
def _kind_rank(dtype: str) -> int:
    dt = tdt(dtype)
    return 0 if dt == torch.bool else (2 if dt.is_floating_point else 1)


@pytest.mark.parametrize("target", DTYPES)
@pytest.mark.parametrize("src", DTYPES)
def test_dtype_conversion_of_an_array_source(src: str, target: str) -> None:
    """Docstring of DataGadget: dtype= converts within a kind or to a wider kind (values
    must fit), raises GadgetTypeError for a cast that would truncate (float -> int)."""
    data = mild(src, (6, 2))
    if _kind_rank(target) >= _kind_rank(src):
        g = cpu_table(data, dtype=target)
        assert g.dtype == tdt(target)
        assert same(g.getNumpyVersion(), to_np(data.to(tdt(target))))
        if src != "bfloat16":  # the same through a NumPy array
            h = cpu_table(np_source(data), dtype=target)
            assert same(h.getNumpyVersion(), to_np(data.to(tdt(target))))
    else:
        with pytest.raises(gl.GadgetTypeError) as exc:
            cpu_table(data, dtype=target)
        assert word(src, str(exc.value)) and word(target, str(exc.value))


@pytest.mark.parametrize(
    "src,target,value",
    [
        ("int16", "int8", 300),
        ("uint8", "int8", 200),
        ("int64", "uint8", -1),
        ("int64", "int32", 2**40),
        ("float64", "float32", 1e300),
        ("float32", "float16", 70000.0),
        ("float64", "bfloat16", 1e39),
        ("int64", "float16", 70000),
        ("bfloat16", "float16", 1e10),
        ("int32", "int16", -40000),
    ],
)
def test_dtype_conversion_out_of_range_is_a_value_error(src: str, target: str, value: Any) -> None:
    data = torch.tensor([[value, 1]], dtype=tdt(src))
    for source in (data, np_source(data)):
        with pytest.raises(gl.GadgetValueError):
            cpu_table(source, dtype=target)


@pytest.mark.parametrize("target", ["float32", "float64"])
def test_dtype_conversion_keeps_nan_and_inf(target: str) -> None:
    data = torch.tensor([math.nan, math.inf, -math.inf, 1.5], dtype=torch.float64)
    g = cpu_table(data, dtype=target)
    assert same(g.getNumpyVersion(), data.numpy().astype(target))


@pytest.mark.parametrize(
    "src,target,values,ok",
    [
        ("uint16", "int32", [0, 65535], True),
        ("uint16", "int16", [0, 40000], False),
        ("uint16", "float16", [0, 60000], True),
        ("uint16", "float16", [65535], False),
        ("uint32", "int64", [0, 2**32 - 1], True),
        ("uint32", "int32", [2**31], False),
        ("uint64", "int64", [2**63 - 1], True),
        ("uint64", "int64", [2**63], False),
        ("uint16", "uint8", [255], True),
        ("uint16", "uint8", [256], False),
        ("uint16", "bool", [1], False),
        ("uint16", "bfloat16", [0, 300, 65535], True),
        ("uint32", "bfloat16", [7, 2**32 - 1], True),
        ("uint16", "float32", [65535], True),
    ],
)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_wide_unsigned_sources_convert_with_dtype(
    src: str, target: str, values: list[int], ok: bool, lib: str
) -> None:
    a = np.array(values, dtype=src).reshape(-1, 1)
    source: Any = (
        a if lib == "numpy" else torch.from_numpy(a.view(f"i{a.dtype.itemsize}")).view(tdt(src))
    )
    if ok:
        g = cpu_table(source, dtype=target)
        assert g.dtype == tdt(target)
        if target == "bfloat16":  # int -> float widens the kind: converted, rounded
            exp = to_np(torch.from_numpy(a.astype(np.float64)).to(torch.bfloat16))
        else:
            exp = a.astype(np_dtype_of(target))
        assert same(g.getNumpyVersion(), exp)
    else:
        with pytest.raises(gl.GadgetError):
            cpu_table(source, dtype=target)


# ---- 8. pickling / getNumpyVersion(copy=False) -------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_table_pickles_by_value(dtype: str) -> None:
    ref = make(dtype, (4, 3))
    g = cpu_table(ref)
    h = pickle.loads(pickle.dumps(g))
    assert h.dtype == tdt(dtype) and same(h.getNumpyVersion(), to_np(ref))
    h.insertData(make(dtype, (1, 3), seed=9), [0])
    assert same(g.getNumpyVersion(), to_np(ref))  # its own rows


@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_numpy_version_without_copy_is_the_table(dtype: str) -> None:
    ref = make(dtype, (4, 3))
    g = cpu_table(ref)
    view = g.getNumpyVersion(copy=False)
    assert view.dtype == np.dtype(dtype) and same(view, to_np(ref))
    assert np.shares_memory(view, g.as_tensor().numpy())
    copy = g.getNumpyVersion()
    assert not np.shares_memory(copy, g.as_tensor().numpy())


# ---- 9. save / load round trips ------------------------------------------------------------------
RT_SHAPES = [(9,), (9, 3), (9, 2, 3), (1, 3)]


@pytest.mark.parametrize(
    "ext,shape",
    [(e, s) for e in [".npy", ".h5", ".zarr"] for s in RT_SHAPES]
    + [(".hdf5", (9, 3)), (".hdf", (9, 3)), (".HDF5", (9, 3))],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_save_load_round_trip_bit_exact(
    dtype: str, ext: str, shape: tuple[int, ...], tmp_path: Path
) -> None:
    ref = make(dtype, shape)
    g = cpu_table(ref)
    p = tmp_path / f"t{ext}"
    if ext == ".npy" and dtype == "bfloat16":
        # README: bfloat16 "has no .npy form"
        with pytest.raises(gl.GadgetTypeError) as exc:
            g.save(p)
        assert "bfloat16" in str(exc.value)
        assert not p.exists() and not list(tmp_path.iterdir())
        return
    g.save(p)
    ref_np = to_np(ref)
    for pl in ["cpu", "file"]:
        h = gl.DataGadget(p, placement=pl)
        assert h.shape == shape and h.dtype == tdt(dtype)
        assert same(h.getNumpyVersion(), ref_np)
        assert same(h.getData(ids_for(shape[0])), ref_np[ids_for(shape[0])])
        h.close()
    arr, attr = read_native(p)
    if dtype == "bfloat16":  # stored as uint16 bits plus an attribute (README)
        assert arr.dtype == np.uint16 and attr == "bfloat16"
    else:
        assert arr.dtype == np.dtype(dtype)
    assert same(native_as_table(arr, attr), ref_np)
    # load() into an existing table of another dtype and shape replaces it
    other = cpu_table(
        np.zeros((2, 5), dtype=np.int8) if dtype != "int8" else np.zeros(3, np.float32)
    )
    other.load(p)
    assert other.shape == shape and other.dtype == tdt(dtype) and other.placement == "cpu"
    assert same(other.getNumpyVersion(), ref_np)


@pytest.mark.parametrize(
    "ext,opts",
    [
        (".h5", {"compression": "gzip"}),
        (".h5", {"compression": "gzip", "compression_level": 9}),
        (".h5", {"compression": "lzf"}),
        (".h5", {"compression": "none"}),
        (".h5", {"chunk_rows": 1}),
        (".zarr", {}),
        (".zarr", {"compression": "zstd", "compression_level": 7}),
        (".zarr", {"compression": "gzip"}),
        (".zarr", {"compression": "blosc", "compression_level": 1}),
        (".zarr", {"compression": "none"}),
        (".zarr", {"compression": None, "chunk_rows": 1}),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compressed_and_chunked_round_trips(
    dtype: str, ext: str, opts: dict[str, Any], tmp_path: Path
) -> None:
    ref = make(dtype, (50, 3))
    g = cpu_table(ref)
    p = tmp_path / f"c{ext}"
    g.save(p, chunk_rows=opts.pop("chunk_rows", 8), **opts)
    ref_np = to_np(ref)
    for pl in ["cpu", "file"]:
        h = gl.DataGadget(p, placement=pl)
        assert h.dtype == tdt(dtype) and same(h.getNumpyVersion(), ref_np)
        ids = np.array([49, 0, 17, 17, 8, 7])
        assert same(h.getData(ids), ref_np[ids])
        if pl == "file":  # write through the compressed chunks
            rows = make(dtype, (3, 3), seed=5)
            h.insertData(rows, [9, 48, 9])
            exp = ref_np.copy()
            exp[48], exp[9] = to_np(rows)[1], to_np(rows)[2]
            assert same(h.getNumpyVersion(), exp)
            h.close()
            arr, attr = read_native(p)
            assert same(native_as_table(arr, attr), exp)
            ref_np = exp


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nested_dataset_names(dtype: str, fmt: str, tmp_path: Path) -> None:
    ref = make(dtype, (6, 2))
    p = tmp_path / f"n{FORMATS[fmt]}"
    cpu_table(ref).save(p, dataset="emb/words/v1")
    for ds in ["emb/words/v1", "/emb/words/v1", None]:
        for pl in ["cpu", "file"]:
            h = gl.DataGadget(p, dataset=ds, placement=pl)
            assert h.dtype == tdt(dtype) and same(h.getNumpyVersion(), to_np(ref))
            h.close()
    arr, attr = read_native(p, "emb/words/v1")
    assert same(native_as_table(arr, attr), to_np(ref))
    with pytest.raises(gl.GadgetKeyError) as exc:
        gl.DataGadget(p, dataset="emb/nope", placement="cpu")
    assert "emb/words/v1" in str(exc.value)
    for bad in ["a/../x", "..", "./a"]:
        with pytest.raises(gl.GadgetValueError):
            cpu_table(ref).save(tmp_path / f"bad{FORMATS[fmt]}", dataset=bad)
        assert not (tmp_path / f"bad{FORMATS[fmt]}").exists()


@pytest.mark.parametrize("dtype", DTYPES)
def test_hdf5_file_with_several_datasets_and_groups(dtype: str, tmp_path: Path) -> None:
    ref = make(dtype, (5, 3))
    p = tmp_path / "multi.h5"
    raw = np_source(ref).view(np.uint16) if dtype == "bfloat16" else to_np(ref)
    with h5py.File(p, "w") as f:
        f.create_dataset("a/b/table", data=raw, chunks=(2, 3))
        if dtype == "bfloat16":
            f["a/b/table"].attrs["gadgetloader_dtype"] = "bfloat16"
        f.create_dataset("other", data=np.arange(4))
        f.create_group("empty/group")
    with pytest.raises(gl.GadgetKeyError) as exc:
        gl.DataGadget(p, placement="cpu")
    assert "a/b/table" in str(exc.value) and "other" in str(exc.value)
    for pl in ["cpu", "file"]:
        h = gl.DataGadget(p, dataset="a/b/table", placement=pl)
        assert h.dtype == tdt(dtype) and same(h.getNumpyVersion(), to_np(ref))
        h.close()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_save_over_an_existing_file_replaces_it(fmt: str, tmp_path: Path) -> None:
    p = tmp_path / f"o{FORMATS[fmt]}"
    for i, (dtype, shape) in enumerate(
        [
            ("float32", (9, 3)),
            ("int8", (4,)),
            ("bool", (2, 2, 2)),
            ("float64", (3, 1)),
            ("uint8", (1, 5)),
        ]
    ):
        ref = make(dtype, shape, seed=i)
        cpu_table(ref).save(p, **({"dataset": f"d{i}"} if fmt != "npy" else {}))
        h = gl.DataGadget(p, placement="cpu")  # one array: no dataset= needed
        assert h.shape == shape and h.dtype == tdt(dtype)
        assert same(h.getNumpyVersion(), to_np(ref))
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_save_over_the_file_a_table_is_backed_by(dtype: str, fmt: str, tmp_path: Path) -> None:
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    ref = make(dtype, (20, 3))
    p = tmp_path / f"b{FORMATS[fmt]}"
    kw = {"dataset": "grp/emb"} if fmt != "npy" else {}
    cpu_table(ref).save(p, **kw)
    g = gl.DataGadget(p, placement="file")
    rows = make(dtype, (2, 3), seed=2)
    g.insertData(rows, [3, 19])
    exp = to_np(ref).copy()
    exp[[3, 19]] = to_np(rows)
    g.save(p)  # over itself
    assert same(g.getNumpyVersion(), exp)
    g.insertData(rows[:1], [0])  # still writable, now to the new file
    exp[0] = to_np(rows)[0]
    g.close()
    h = gl.DataGadget(p, placement="cpu", **kw)  # the dataset kept its name
    assert h.dtype == tdt(dtype) and same(h.getNumpyVersion(), exp)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_failed_load_leaves_the_table_unchanged(fmt: str, tmp_path: Path) -> None:
    ext = FORMATS[fmt]
    ref = make("float32", (30, 4))
    good = tmp_path / f"good{ext}"
    cpu_table(ref).save(good, **({"chunk_rows": 4} if fmt != "npy" else {}))
    trunc = tmp_path / f"trunc{ext}"
    if fmt == "zarr":
        shutil.copytree(good, trunc)
        chunk = sorted(f for f in trunc.rglob("*") if f.is_file() and f.name != "zarr.json")[2]
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    else:
        data = good.read_bytes()
        trunc.write_bytes(data[: len(data) // 2])
    wide = tmp_path / f"u16{ext}"
    # (beyond int16: an in-memory table converts a uint16 file into its own dtype, and
    # refuses values that do not fit it; a file table reads the file as it is and refuses it)
    u16 = (np.arange(12, dtype=np.uint16) + 40000).reshape(6, 2)
    if fmt == "npy":
        np.save(wide, u16)
    elif fmt == "hdf5":
        with h5py.File(wide, "w") as f:
            f["d"] = u16
    else:
        zarr.create_array(store=str(wide), data=u16)
    mine = make("int16", (3, 2))
    for bad, err in [
        (tmp_path / f"missing{ext}", gl.GadgetFileNotFoundError),
        (trunc, gl.GadgetFileError),
        (wide, (gl.GadgetTypeError, gl.GadgetValueError)),
    ]:
        for pl in ["cpu", "file"]:
            g = cpu_table(mine) if pl == "cpu" else None
            if g is None:
                cpu_table(mine).save(tmp_path / "mine.h5")
                g = gl.DataGadget(tmp_path / "mine.h5", placement="file")
            if pl == "file" and bad == trunc and fmt == "zarr":
                # a file table reads chunks on demand: the damaged chunk is found when read
                g.load(bad)
                with pytest.raises(gl.GadgetFileError) as exc:
                    g.getNumpyVersion()
                assert str(bad) in str(exc.value)
                g.close()
                continue
            with pytest.raises(err) as exc:
                g.load(bad)
            assert str(bad) in str(exc.value)
            assert g.shape == (3, 2) and g.dtype == torch.int16
            assert same(g.getNumpyVersion(), to_np(mine))
            g.close()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dt,hint", [("uint16", "int32"), ("uint32", "int64")])
def test_wide_unsigned_files_are_refused_with_advice(
    fmt: str, dt: str, hint: str, tmp_path: Path
) -> None:
    p = tmp_path / f"u{FORMATS[fmt]}"
    a = np.arange(8, dtype=dt).reshape(4, 2)
    if fmt == "npy":
        np.save(p, a)
    elif fmt == "hdf5":
        with h5py.File(p, "w") as f:
            f["x"] = a
    else:
        zarr.create_array(store=str(p), data=a)
    for pl in ["cpu", "file"]:
        with pytest.raises(gl.GadgetTypeError) as exc:
            gl.DataGadget(p, placement=pl)
        assert dt in str(exc.value) and hint in str(exc.value) and str(p) in str(exc.value)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", ["float32", "int8", "bool", "bfloat16"])
def test_file_source_with_another_dtype_requested_is_refused(
    dtype: str, fmt: str, tmp_path: Path
) -> None:
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    p = tmp_path / f"f{FORMATS[fmt]}"
    cpu_table(make(dtype, (4, 2))).save(p)
    other = "float64" if dtype != "float64" else "float32"
    for pl in ["cpu", "file"]:
        with pytest.raises(gl.GadgetTypeError) as exc:
            gl.DataGadget(p, placement=pl, dtype=other)
        assert word(dtype, str(exc.value)) and word(other, str(exc.value))
        h = gl.DataGadget(p, placement=pl, dtype=dtype)
        assert h.dtype == tdt(dtype)
        h.close()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_scalar_files_are_refused(fmt: str, tmp_path: Path) -> None:
    p = tmp_path / f"s{FORMATS[fmt]}"
    if fmt == "npy":
        np.save(p, np.float32(3.0))
    elif fmt == "hdf5":
        with h5py.File(p, "w") as f:
            f["x"] = np.float32(3.0)
    else:
        z = zarr.create_array(store=str(p), shape=(), dtype="f4")
        z[...] = 3.0
    with pytest.raises(gl.GadgetValueError) as exc:
        gl.DataGadget(p, placement="cpu")
    assert "scalar" in str(exc.value) or "axis" in str(exc.value)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dt", ["complex64", "S3", "datetime64[s]"])
def test_unsupported_file_dtypes_are_refused(fmt: str, dt: str, tmp_path: Path) -> None:
    p = tmp_path / f"x{FORMATS[fmt]}"
    a = np.zeros((4, 2), dtype=dt)
    try:
        if fmt == "npy":
            np.save(p, a)
        elif fmt == "hdf5":
            with h5py.File(p, "w") as f:
                f["x"] = a
        else:
            with warnings.catch_warnings():  # zarr's own NaT fill value warns on NumPy 2.x
                warnings.simplefilter("ignore", DeprecationWarning)
                zarr.create_array(store=str(p), data=a)
    except (TypeError, ValueError) as exc:  # the format itself cannot hold it
        pytest.skip(f"{fmt} cannot store {dt}: {exc}")
    with pytest.raises(gl.GadgetTypeError) as exc:
        gl.DataGadget(p, placement="cpu")
    assert str(p) in str(exc.value)


# ---- 10. big-endian files, zarr v2, Fortran order ------------------------------------------------
def _write_be(fmt: str, p: Path, ref: np.ndarray) -> None:
    be = ref.astype(ref.dtype.newbyteorder(">"))
    if fmt == "npy":
        np.save(p, be)
    elif fmt == "hdf5":
        with h5py.File(p, "w") as f:
            f.create_dataset("grp/be", data=be, chunks=(4, *be.shape[1:]))
    elif fmt == "zarr-v2":
        z = zarr.create_array(
            store=str(p), shape=be.shape, chunks=(4, *be.shape[1:]), dtype=be.dtype, zarr_format=2
        )
        z[...] = be
    else:  # zarr v3 with a big-endian bytes codec
        from zarr.codecs import BytesCodec

        z = zarr.create_array(
            store=str(p),
            shape=be.shape,
            chunks=(4, *be.shape[1:]),
            dtype=ref.dtype,
            serializer=BytesCodec(endian="big"),
        )
        z[...] = ref


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr-v2", "zarr-v3"])
@pytest.mark.parametrize("dtype", MULTIBYTE)
def test_big_endian_files_read_and_write(dtype: str, fmt: str, tmp_path: Path) -> None:
    ref = to_np(make(dtype, (10, 3)))
    p = tmp_path / f"be{'.npy' if fmt == 'npy' else '.h5' if fmt == 'hdf5' else '.zarr'}"
    _write_be(fmt, p, ref)
    ids = np.array([9, 0, 4, 4])
    for pl in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=pl)
        assert g.dtype == tdt(dtype)
        assert same(g.getNumpyVersion(), ref) and same(g.getData(ids), ref[ids])
        g.close()
    g = gl.DataGadget(p, placement="file")
    rows = to_np(make(dtype, (2, 3), seed=8))
    g.insertData(rows, [1, 8])
    exp = ref.copy()
    exp[[1, 8]] = rows
    assert same(g.getNumpyVersion(), exp)
    g.close()
    h = gl.DataGadget(p, placement="cpu")
    assert same(h.getNumpyVersion(), exp)
    arr, _ = read_native(p)
    assert same(native_as_table(arr, None), exp)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zarr_v2_store_read_write(dtype: str, tmp_path: Path) -> None:
    ref = make(dtype, (10, 3))
    raw = np_source(ref).view(np.uint16) if dtype == "bfloat16" else to_np(ref)
    p = tmp_path / "v2.zarr"
    z = zarr.create_array(
        store=str(p), shape=raw.shape, chunks=(3, 3), dtype=raw.dtype, zarr_format=2
    )
    z[...] = raw
    if dtype == "bfloat16":
        z.attrs["gadgetloader_dtype"] = "bfloat16"
    assert (p / ".zarray").is_file()
    for pl in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=pl)
        assert g.dtype == tdt(dtype) and same(g.getNumpyVersion(), to_np(ref))
        g.close()
    g = gl.DataGadget(p, placement="file")
    rows = make(dtype, (2, 3), seed=6)
    g.insertData(rows, [0, 7])
    g.close()
    exp = to_np(ref).copy()
    exp[[0, 7]] = to_np(rows)
    arr, attr = read_native(p)
    assert same(native_as_table(arr, attr), exp)
    assert same(gl.DataGadget(p, placement="cpu").getNumpyVersion(), exp)


@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_fortran_npy_file(dtype: str, tmp_path: Path) -> None:
    ref = to_np(make(dtype, (8, 3)))
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(ref))
    for pl in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=pl)
        assert same(g.getNumpyVersion(), ref) and same(g.getData([7, 1]), ref[[7, 1]])
    before = tree_hash(p)
    with pytest.raises(gl.ReadOnlyError) as exc:
        g.insertData(ref[:1], [0])
    assert "Fortran" in str(exc.value)
    with pytest.raises(gl.ReadOnlyError):
        gl.DataGadget(p, placement="file", writable=True)
    assert tree_hash(p) == before


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_truncated_files_name_the_file(fmt: str, tmp_path: Path) -> None:
    ref = make("int32", (100, 4))
    p = tmp_path / f"t{FORMATS[fmt]}"
    cpu_table(ref).save(p, **({"chunk_rows": 10, "compression": "none"} if fmt == "zarr" else {}))
    if fmt == "zarr":
        chunk = sorted(f for f in p.rglob("*") if f.is_file() and f.name != "zarr.json")[-1]
        chunk.write_bytes(chunk.read_bytes()[:10])
    else:
        p.write_bytes(p.read_bytes()[:-40])
    for pl in ["cpu", "file"]:
        with pytest.raises(gl.GadgetFileError) as exc:
            g = gl.DataGadget(p, placement=pl)
            g.getData(np.arange(100))
        assert str(p) in str(exc.value)


# ---- 11. file-backed tables per dtype and format ---------------------------------------------------
@pytest.mark.parametrize("shape", [(40,), (40, 3), (40, 2, 3)], ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_file_table_get_insert_persist(
    dtype: str, fmt: str, shape: tuple[int, ...], tmp_path: Path
) -> None:
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    ref = make(dtype, shape)
    p = tmp_path / f"ft{FORMATS[fmt]}"
    cpu_table(ref).save(p, **({"chunk_rows": 8} if fmt != "npy" else {}))
    # a second table of the same file without a cache sees the same rows and the writes
    nocache = gl.DataGadget(p, placement="file", cache_bytes=0)
    g = gl.DataGadget(p, placement="file")
    assert g.placement == "file" and g.dtype == tdt(dtype) and g.shape == shape
    exp = to_np(ref).copy()
    ids = np.array([[39, 0], [17, 39], [8, 8]])
    got = g.getData(ids)
    assert got.dtype == tdt(dtype) and same(got, exp[ids])
    rows = make(dtype, ids.shape + shape[1:], seed=11)
    for i, r in enumerate(ids.reshape(-1)):
        exp[r] = to_np(rows).reshape(ids.size, *shape[1:])[i]
    assert same(nocache.getData(ids), to_np(ref)[ids])
    g.insertData(rows, ids)
    assert same(g.getData(ids), exp[ids])
    assert same(g.getNumpyVersion(), exp)
    assert same(nocache.getData(ids), exp[ids])
    g.close()
    nocache.close()
    h = gl.DataGadget(p, placement="file")
    assert same(h.getNumpyVersion(), exp)
    h.close()
    arr, attr = read_native(p)
    assert same(native_as_table(arr, attr), exp)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_file_table_read_only_and_wrong_dtype_leave_file_unchanged(
    dtype: str, fmt: str, tmp_path: Path
) -> None:
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    ref = make(dtype, (12, 3))
    p = tmp_path / f"ro{FORMATS[fmt]}"
    cpu_table(ref).save(p)
    before = tree_hash(p)
    g = gl.DataGadget(p, placement="file", writable=False)
    assert same(g.getData([11, 0]), to_np(ref)[[11, 0]])
    with pytest.raises(gl.ReadOnlyError) as exc:
        g.insertData(make(dtype, (1, 3), seed=1), [0])
    assert isinstance(exc.value, PermissionError)  # README: ReadOnlyError is a PermissionError
    with pytest.raises(gl.ReadOnlyError):
        g.fill_(1)
    g.close()
    w = gl.DataGadget(p, placement="file")
    other = "float64" if dtype != "float64" else "float32"
    with pytest.raises(gl.GadgetTypeError) as exc2:
        w.insertData(mild(other, (1, 3)), [0])
    assert word(dtype, str(exc2.value)) and word(other, str(exc2.value))
    with pytest.raises(gl.GadgetValueError):
        w.insertData(make(dtype, (1, 4)), [0])
    with pytest.raises(gl.GadgetIndexError):
        w.insertData(make(dtype, (1, 3)), [12])
    w.close()
    assert tree_hash(p) == before


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_file_table_fill_persists_and_bad_fill_changes_nothing(
    dtype: str, fmt: str, tmp_path: Path
) -> None:
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    ref = make(dtype, (20, 2))
    p = tmp_path / f"fill{FORMATS[fmt]}"
    cpu_table(ref).save(p)
    before = tree_hash(p)
    g = gl.DataGadget(p, placement="file")
    with pytest.raises(gl.GadgetError):
        g.fill_(FILL_BAD[dtype][0])
    assert tree_hash(p) == before
    v = FILL_OK[dtype][1]
    g.fill_(v)
    g.close()
    pv = v.item() if isinstance(v, (np.generic, torch.Tensor)) else v
    exp = to_np(torch.full((20, 2), pv, dtype=tdt(dtype)))
    assert same(gl.DataGadget(p, placement="cpu").getNumpyVersion(), exp)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_file_table_one_row(dtype: str, fmt: str, tmp_path: Path) -> None:
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    ref = make(dtype, (1, 4))
    p = tmp_path / f"one{FORMATS[fmt]}"
    cpu_table(ref).save(p)
    g = gl.DataGadget(p, placement="file")
    assert same(g.getData([0, 0]), to_np(ref)[[0, 0]])
    rows = make(dtype, (2, 4), seed=3)
    g.insertData(rows, [0, 0])  # the last occurrence wins
    g.close()
    assert same(gl.DataGadget(p, placement="cpu").getNumpyVersion(), to_np(rows)[1:])


# ---- 12. the CLI -------------------------------------------------------------------------------------
PAIRS = [
    ("npy", "hdf5"),
    ("npy", "zarr"),
    ("hdf5", "npy"),
    ("hdf5", "zarr"),
    ("zarr", "npy"),
    ("zarr", "hdf5"),
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cli_convert_every_dtype(
    dtype: str, pair: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src_fmt, dst_fmt = pair
    if src_fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    ref = make(dtype, (33, 2, 3))
    src = tmp_path / f"s{FORMATS[src_fmt]}"
    dst = tmp_path / f"d{FORMATS[dst_fmt]}"
    cpu_table(ref).save(src)
    rc = cli_main(["convert", str(src), str(dst), "--no-progress"])
    out = capsys.readouterr()
    if dst_fmt == "npy" and dtype == "bfloat16":
        assert rc == 1 and "bfloat16" in out.err
        assert not dst.exists()
        assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]
        return
    assert rc == 0, out.err
    assert dtype in out.out and "(33, 2, 3)" in out.out
    arr, attr = read_native(dst)
    assert same(native_as_table(arr, attr), to_np(ref))
    h = gl.DataGadget(dst, placement="cpu")
    assert h.dtype == tdt(dtype) and same(h.getNumpyVersion(), to_np(ref))


@pytest.mark.parametrize(
    "args,dst_name,dataset",
    [
        (["--compression", "gzip", "--chunk-rows", "5"], "o.h5", None),
        (["--compression", "lzf", "--dst-dataset", "g/emb"], "o.h5", "g/emb"),
        (["--compression", "blosc", "--chunk-rows", "7"], "o.zarr", None),
        (["--compression", "none", "--dst-dataset", "a/b"], "o.zarr", "a/b"),
        (["--to", "hdf5"], "o.bin", None),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int64", "bool"])
def test_cli_convert_options(
    dtype: str,
    args: list[str],
    dst_name: str,
    dataset: str | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ref = make(dtype, (40, 3))
    src = tmp_path / "s.h5"
    cpu_table(ref).save(src, dataset="in/x")
    dst = tmp_path / dst_name
    rc = cli_main(["convert", str(src), str(dst), "--dataset", "in/x", "--no-progress", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    expect_ds = dataset if dataset is not None else "in/x"  # default: --dataset
    h = gl.DataGadget(
        dst,
        placement="cpu",
        dataset=expect_ds,
        **({"format": "hdf5"} if dst_name.endswith(".bin") else {}),
    )
    assert h.dtype == tdt(dtype) and same(h.getNumpyVersion(), to_np(ref))


@pytest.mark.parametrize("dtype", MULTIBYTE)
def test_cli_convert_big_endian_npy(
    dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = to_np(make(dtype, (11, 2)))
    src = tmp_path / "be.npy"
    np.save(src, ref.astype(ref.dtype.newbyteorder(">")))
    for dst in [tmp_path / "o.h5", tmp_path / "o.zarr"]:
        assert cli_main(["convert", str(src), str(dst), "--no-progress"]) == 0
        arr, _ = read_native(dst)
        assert same(native_as_table(arr, None), ref)
    capsys.readouterr()


def test_cli_convert_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "s.npy"
    np.save(src, np.zeros((0, 3), np.float32))
    assert cli_main(["convert", str(src), str(tmp_path / "o.h5"), "--no-progress"]) == 1
    assert "zero rows" in capsys.readouterr().err
    np.save(src, np.zeros((3, 3), np.uint16))
    assert cli_main(["convert", str(src), str(tmp_path / "o.h5"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "uint16" in err and "int32" in err
    assert not (tmp_path / "o.h5").exists()
    np.save(src, np.ones((3, 3), np.float32))
    # a compression the destination format does not take: a usage error (session 32)
    with pytest.raises(SystemExit) as info:
        cli_main(["convert", str(src), str(tmp_path / "o.h5"), "--compression", "zstd"])
    assert info.value.code == 2
    assert "zstd" in capsys.readouterr().err
    assert cli_main(["convert", str(src), str(src)]) == 1
    assert not (tmp_path / "o.h5").exists()


def test_cli_subprocess_convert_and_info(tmp_path: Path) -> None:
    ref = to_np(make("float16", (21, 4)))
    src = tmp_path / "s.npy"
    np.save(src, ref)
    dst = tmp_path / "d.zarr"
    r = subprocess.run(
        [sys.executable, "-m", "gadgetloader", "convert", str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "float16" in r.stdout
    arr, _ = read_native(dst)
    assert same(arr, ref)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gadgetloader",
            "info",
            "--no-measure",
            "--json",
            str(tmp_path / "i.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    import json

    data = json.loads((tmp_path / "i.json").read_text())
    assert data["numpy"] == np.__version__ and data["torch"] == torch.__version__
    assert data["h5py"] == h5py.__version__ and data["zarr"] == zarr.__version__


# ---- 13. files written by h5py / zarr themselves: fill values, filters, layouts ------------------
def _stored(dtype: str, t: torch.Tensor) -> np.ndarray:
    return np_source(t).view(np.uint16) if dtype == "bfloat16" else to_np(t)


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unwritten_chunks_read_as_the_fill_value(dtype: str, fmt: str, tmp_path: Path) -> None:
    fill = {"bool": True, "uint8": 9, "bfloat16": 16448}.get(dtype, -3 if "int" in dtype else 7.5)
    written = make(dtype, (2, 3), seed=1)
    raw = _stored(dtype, written)
    store_dt = raw.dtype
    p = tmp_path / f"fv{FORMATS[fmt]}"
    if fmt == "hdf5":
        with h5py.File(p, "w") as f:
            ds = f.create_dataset("x", shape=(10, 3), chunks=(2, 3), dtype=store_dt, fillvalue=fill)
            ds[4:6] = raw
            if dtype == "bfloat16":
                ds.attrs["gadgetloader_dtype"] = "bfloat16"
    else:
        z = zarr.create_array(
            store=str(p),
            shape=(10, 3),
            chunks=(2, 3),
            dtype=store_dt,
            fill_value=fill,
            attributes={"gadgetloader_dtype": "bfloat16"} if dtype == "bfloat16" else {},
        )
        z[4:6] = raw
    arr, attr = read_native(p)
    exp = native_as_table(arr, attr)
    ids = np.array([9, 0, 4, 5, 5])
    for pl in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=pl)
        assert g.dtype == tdt(dtype)
        assert same(g.getNumpyVersion(), exp) and same(g.getData(ids), exp[ids])
        g.close()


H5_LAYOUTS = {
    "shuffle+gzip": dict(chunks=(5, 3), shuffle=True, compression="gzip"),
    "column_chunks": dict(chunks=(5, 1), compression="gzip"),
    "fletcher32": dict(chunks=(5, 3), fletcher32=True),
    "lzf": dict(chunks=(4, 3), compression="lzf"),
    "contiguous": dict(),
    "one_chunk": dict(chunks=(37, 3)),
}


@pytest.mark.parametrize("layout", list(H5_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_hdf5_layouts_written_by_h5py(dtype: str, layout: str, tmp_path: Path) -> None:
    ref = make(dtype, (37, 3))
    p = tmp_path / "l.h5"
    with h5py.File(p, "w") as f:
        ds = f.create_dataset("g/x", data=_stored(dtype, ref), **H5_LAYOUTS[layout])
        if dtype == "bfloat16":
            ds.attrs["gadgetloader_dtype"] = "bfloat16"
    exp = to_np(ref)
    ids = np.array([36, 0, 17, 5, 5, 35])
    for pl in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=pl)
        assert same(g.getNumpyVersion(), exp) and same(g.getData(ids), exp[ids])
        g.close()
    g = gl.DataGadget(p, placement="file")
    rows = make(dtype, (3, 3), seed=4)
    g.insertData(rows, [3, 36, 3])
    exp = exp.copy()
    exp[36], exp[3] = to_np(rows)[1], to_np(rows)[2]
    assert same(g.getData(ids), exp[ids])
    g.close()
    arr, attr = read_native(p)
    assert same(native_as_table(arr, attr), exp)


ZARR_LAYOUTS = {
    "column_chunks": dict(chunks=(4, 1)),
    "sharded": dict(chunks=(2, 3), shards=(6, 3)),
    "v2_fortran": dict(chunks=(5, 3), zarr_format=2, order="F"),
    "v2_raw": dict(chunks=(5, 3), zarr_format=2, compressors=None),
    "v3_gzip": dict(chunks=(5, 3), compressors=[{"name": "gzip", "configuration": {"level": 1}}]),
}


@pytest.mark.parametrize("layout", list(ZARR_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_zarr_layouts_written_by_zarr(dtype: str, layout: str, tmp_path: Path) -> None:
    ref = make(dtype, (23, 3))
    raw = _stored(dtype, ref)
    p = tmp_path / "l.zarr"
    kw = dict(ZARR_LAYOUTS[layout])
    if dtype == "bfloat16":
        kw["attributes"] = {"gadgetloader_dtype": "bfloat16"}
    z = zarr.create_array(store=str(p), shape=raw.shape, dtype=raw.dtype, **kw)
    z[...] = raw
    exp = to_np(ref)
    ids = np.array([22, 0, 9, 9, 13])
    for pl in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=pl)
        assert same(g.getNumpyVersion(), exp) and same(g.getData(ids), exp[ids])
        g.close()
    g = gl.DataGadget(p, placement="file")
    rows = make(dtype, (2, 3), seed=4)
    g.insertData(rows, [3, 22])
    exp = exp.copy()
    exp[[3, 22]] = to_np(rows)
    g.close()
    arr, attr = read_native(p)
    assert same(native_as_table(arr, attr), exp)


@pytest.mark.parametrize("fmt", ["hdf5", "zarr-v2"])
def test_big_endian_bfloat16_bits(fmt: str, tmp_path: Path) -> None:
    ref = make("bfloat16", (9, 2))
    bits = np_source(ref).view(np.uint16).astype(">u2")
    if fmt == "hdf5":
        p = tmp_path / "b.h5"
        with h5py.File(p, "w") as f:
            f["x"] = bits
            f["x"].attrs["gadgetloader_dtype"] = "bfloat16"
    else:
        p = tmp_path / "b.zarr"
        z = zarr.create_array(
            store=str(p),
            shape=bits.shape,
            chunks=(4, 2),
            dtype=bits.dtype,
            zarr_format=2,
            attributes={"gadgetloader_dtype": "bfloat16"},
        )
        z[...] = bits
    for pl in ["cpu", "file"]:
        g = gl.DataGadget(p, placement=pl)
        assert g.dtype == torch.bfloat16 and same(g.getNumpyVersion(), to_np(ref))
        assert same(g.getData([8, 0]), to_np(ref)[[8, 0]])
        g.close()


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
@pytest.mark.parametrize("stored", ["float32", "int8", "uint32"])
def test_bfloat16_mark_on_a_wrong_storage_type_is_refused(
    fmt: str, stored: str, tmp_path: Path
) -> None:
    a = np.ones((4, 2), dtype=stored)
    p = tmp_path / f"m{FORMATS[fmt]}"
    if fmt == "hdf5":
        with h5py.File(p, "w") as f:
            f["x"] = a
            f["x"].attrs["gadgetloader_dtype"] = "bfloat16"
    else:
        zarr.create_array(store=str(p), data=a, attributes={"gadgetloader_dtype": "bfloat16"})
    with pytest.raises(gl.GadgetTypeError) as exc:
        gl.DataGadget(p, placement="cpu")
    assert "bfloat16" in str(exc.value) and stored in str(exc.value)


# ---- 14. several tables at once, out=, staging blocks, interleaved loads ---------------------------
def test_gather_and_scatter_many_with_mixed_dtypes() -> None:
    refs = [make(d, (8, 3), seed=i) for i, d in enumerate(DTYPES)]
    tabs = [cpu_table(r) for r in refs]
    ids = np.array([7, 0, 3, 3])
    got = gl.gather_many(tabs, ids)
    for d, r, t in zip(DTYPES, refs, got, strict=True):
        assert t.dtype == tdt(d) and same(t, to_np(r)[ids])
    rows = [make(d, (2, 3), seed=20 + i) for i, d in enumerate(DTYPES)]
    bad = list(rows)
    bad[5] = mild("float64" if DTYPES[5] != "float64" else "float32", (2, 3))
    with pytest.raises(gl.GadgetTypeError) as exc:
        gl.scatter_many(tabs, bad, [1, 6])
    assert "table 5" in str(exc.value) and word(DTYPES[5], str(exc.value))
    for r, t in zip(refs, tabs, strict=True):  # checked before anything is written
        assert same(t.getNumpyVersion(), to_np(r))
    gl.scatter_many(tabs, rows, [1, 6])
    for r, new, t in zip(refs, rows, tabs, strict=True):
        exp = to_np(r).copy()
        exp[[1, 6]] = to_np(new)
        assert same(t.getNumpyVersion(), exp)


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_data_into_out(dtype: str, placement: str, tmp_path: Path) -> None:
    ref = make(dtype, (6, 2, 2))
    if placement == "file":
        p = tmp_path / "o.h5"
        cpu_table(ref).save(p)
        g = gl.DataGadget(p, placement="file")
    else:
        g = cpu_table(ref)
    out = torch.empty((2, 2, 2), dtype=tdt(dtype))
    res = g.getData([5, 0], out=out)
    assert res.data_ptr() == out.data_ptr() and same(out, to_np(ref)[[5, 0]])
    other = "float64" if dtype != "float64" else "float32"
    with pytest.raises(gl.GadgetTypeError) as exc:
        g.getData([5, 0], out=torch.empty((2, 2, 2), dtype=tdt(other)))
    assert word(dtype, str(exc.value)) and word(other, str(exc.value))
    with pytest.raises(gl.GadgetValueError):
        g.getData([5, 0], out=torch.empty((2, 4), dtype=tdt(dtype)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int8", "int32", "bool"])
def test_many_staging_blocks_and_odd_chunks(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads, saves and converts run in blocks of STAGING_BYTES (64 MiB); with tiny blocks the
    block and chunk boundaries fall everywhere."""
    import gadgetloader.convert as conv
    import gadgetloader.io._hdf5 as h5mod
    import gadgetloader.io._npy as npymod
    import gadgetloader.io._stream as stream
    from gadgetloader.convert import convert

    monkeypatch.setattr(stream, "STAGING_BYTES", 1000)
    monkeypatch.setattr(conv, "STAGING_BYTES", 1000)
    monkeypatch.setattr(npymod, "NPY_BLOCK_BYTES", 500)
    monkeypatch.setattr(h5mod, "_CONTIGUOUS_BLOCK_BYTES", 300)
    ref = make(dtype, (1001, 3))
    exp = to_np(ref)
    g = cpu_table(ref)
    saves = [
        (".h5", {"chunk_rows": 7}),
        (".h5", {"chunk_rows": 1000, "compression": "gzip"}),
        (".zarr", {"chunk_rows": 13}),
        (".zarr", {"chunk_rows": 999, "compression": "none"}),
    ]
    if dtype != "bfloat16":
        saves.insert(0, (".npy", {}))
    for i, (ext, kw) in enumerate(saves):
        p = tmp_path / f"t{i}{ext}"
        g.save(p, **kw)
        for pl in ["cpu", "file"]:
            h = gl.DataGadget(p, placement=pl, **({"block_rows": 11} if pl == "file" else {}))
            assert same(h.getData(np.arange(1001)), exp), (ext, kw, pl)
            h.close()
        for ext2 in [".h5", ".zarr", ".npy"]:
            if ext2 == ext or (ext2 == ".npy" and dtype == "bfloat16"):
                continue
            q = tmp_path / f"c{i}{ext2}"
            convert(p, q, chunk_rows=5 if ext2 != ".npy" else None, progress=False)
            assert same(gl.DataGadget(q, placement="cpu").getNumpyVersion(), exp), (ext, ext2)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_interleaved_table_load_needs_the_same_shape_and_dtype(
    dtype: str, fmt: str, tmp_path: Path
) -> None:
    """load() docstring: a table interleaved with its optimizer states is overwritten in
    place, and then the file must hold the same shape and dtype."""
    if fmt == "npy" and dtype == "bfloat16":
        pytest.skip("bfloat16 has no .npy form")
    emb = gl.OffloadedEmbedding(20, 4, placement="cpu", dtype=tdt(dtype))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    t = emb.table
    t.insertData(make(dtype, (20, 4)), np.arange(20))
    before = t.getNumpyVersion()
    other = "float64" if dtype != "float64" else "float32"
    for i, (shape, dt) in enumerate([((20, 5), dtype), ((21, 4), dtype), ((20, 4), other)]):
        p = tmp_path / f"w{i}{FORMATS[fmt]}"
        cpu_table(mild(dt, shape)).save(p)
        with pytest.raises(gl.GadgetError) as exc:
            t.load(p)
        assert str(shape) in str(exc.value) and word(dt, str(exc.value))
        assert t.shape == (20, 4) and t.dtype == tdt(dtype)
        assert same(t.getNumpyVersion(), before)
    p = tmp_path / f"ok{FORMATS[fmt]}"
    new = make(dtype, (20, 4), seed=5)
    cpu_table(new).save(p)
    t.load(p)
    assert same(t.getNumpyVersion(), to_np(new))
    del opt


def test_save_option_errors(tmp_path: Path) -> None:
    g = cpu_table(make("float32", (9, 3)))
    bad: list[tuple[str, dict[str, Any], type[Exception]]] = [
        ("a.npy", {"chunk_rows": 4}, gl.GadgetTypeError),
        ("a.npy", {"compression": "gzip"}, gl.GadgetTypeError),
        ("a.npy", {"dataset": "x"}, gl.GadgetTypeError),
        ("a.h5", {"compression": "zstd"}, gl.GadgetKeyError),
        ("a.h5", {"compression": "gzip", "compression_level": 10}, gl.GadgetValueError),
        ("a.h5", {"compression": "lzf", "compression_level": 3}, gl.GadgetValueError),
        ("a.zarr", {"compression": "lzf"}, gl.GadgetKeyError),
        ("a.zarr", {"compression": "zstd", "compression_level": 23}, gl.GadgetValueError),
        ("a.h5", {"chunk_rows": 0}, gl.GadgetValueError),
        ("a.zarr", {"chunk_rows": 2.5}, gl.GadgetValueError),
        ("a.h5", {"chunk_rows": True}, gl.GadgetValueError),
    ]
    for name, kw, err in bad:
        with pytest.raises(err):
            g.save(tmp_path / name, **kw)
        assert not (tmp_path / name).exists(), (name, kw)
    assert not os.listdir(tmp_path)


# ---- 15. smaller API corners per dtype -------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_and_shape_forms(dtype: str) -> None:
    for g in [
        gl.DataGadget.zeros((3, 2), dtype, placement="cpu"),
        gl.DataGadget(shape=[3, 2], dtype=tdt(dtype), placement="cpu"),
        gl.DataGadget((np.int64(3), np.int32(2)), dtype=dtype, placement="cpu"),
        gl.DataGadget(torch.Size([3, 2]), dtype=dtype, placement="cpu"),
    ]:
        assert g.shape == (3, 2) and g.dtype == tdt(dtype)
        assert same(g.getNumpyVersion(), np.zeros((3, 2), dtype=np_dtype_of(dtype)))
    assert gl.DataGadget((3, 2), placement="cpu").dtype == torch.float32  # the default


def test_list_sources_take_numpy_default_dtypes() -> None:
    assert cpu_table([[True, False]]).dtype == torch.bool
    assert cpu_table([[1, 2]]).dtype == torch.int64
    assert cpu_table([[1.0, 2]]).dtype == torch.float64
    with pytest.raises(gl.GadgetTypeError):
        cpu_table([[1, 2], [3]])  # ragged
    with pytest.raises(gl.GadgetTypeError):
        cpu_table([[2**64]])  # object
    with pytest.raises(gl.GadgetValueError):
        cpu_table(np.float32(1.0))  # 0-d


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_rows_by_int_id(dtype: str) -> None:
    ref = make(dtype, (4, 3))
    g = cpu_table(ref)
    row = make(dtype, (3,), seed=2)
    g[2] = row  # an int id takes one row without a leading axis
    exp = to_np(ref).copy()
    exp[2] = to_np(row)
    assert same(g.getNumpyVersion(), exp) and same(g[2], exp[2])
    one = cpu_table(make(dtype, (4,)))
    v = np_source(make(dtype, (1,), seed=3))[0]  # a NumPy scalar
    one[1] = v
    assert same(one[1], to_np(make(dtype, (1,), seed=3))[0])


@pytest.mark.parametrize("dtype", ["float32", "bool", "int64"])
def test_ids_bool_refused_wide_unsigned_accepted(dtype: str) -> None:
    ref = make(dtype, (4, 2))
    g = cpu_table(ref)
    for bad in [torch.tensor([True, False, True, False]), np.array([True, False]), [True]]:
        with pytest.raises(gl.GadgetTypeError):
            g.getData(bad)
        with pytest.raises(gl.GadgetTypeError):
            g.insertData(make(dtype, (len(bad), 2)), bad)
    for ids in [
        torch.tensor([3, 0], dtype=torch.uint16),
        torch.tensor([3, 0], dtype=torch.uint32),
        torch.tensor([3, 0], dtype=torch.uint64),
        np.array([3, 0], dtype=np.uint32),
    ]:
        assert same(g.getData(ids), to_np(ref)[[3, 0]])
    with pytest.raises(gl.GadgetIndexError):
        g.getData(np.array([2**63 + 1], dtype=np.uint64))
    assert same(g.getNumpyVersion(), to_np(ref))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_save_over_a_multi_dataset_hdf5_file_keeps_only_the_table(
    dtype: str, tmp_path: Path
) -> None:
    """README: a save replaces 'an HDF5 file with all its datasets'; saving over the file
    the table reads keeps the dataset's name."""
    ref = make(dtype, (6, 2))
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("grp/t", data=_stored(dtype, ref))
        if dtype == "bfloat16":
            f["grp/t"].attrs["gadgetloader_dtype"] = "bfloat16"
        f["other"] = np.arange(3)
    g = gl.DataGadget(p, dataset="grp/t", placement="file")
    g.save(p)
    assert g.dtype == tdt(dtype) and same(g.getNumpyVersion(), to_np(ref))
    g.close()
    with h5py.File(p, "r") as f:
        names: list[str] = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    assert names == ["grp/t"]


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_cli_several_arrays_need_dataset_flag(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / f"m{FORMATS[fmt]}"
    if fmt == "hdf5":
        with h5py.File(src, "w") as f:
            f["a"] = np.ones((3, 2), np.float16)
            f["b/c"] = np.zeros((4,), np.int8)
    else:
        root = zarr.open_group(str(src), mode="w")
        root.create_array("a", data=np.ones((3, 2), np.float16))
        root.create_array("b/c", data=np.zeros((4,), np.int8))
    dst = tmp_path / "o.npy"
    assert cli_main(["convert", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert "--dataset" in err and "dataset=" not in err and "b/c" in err
    assert cli_main(["convert", str(src), str(dst), "--dataset", "b/c"]) == 0
    capsys.readouterr()
    got = np.load(dst)
    assert got.dtype == np.int8 and got.shape == (4,)
