"""Black-box review (session 31) of DataGadget's core row API (getData / insertData /
indexing / initialisers / views / lifecycle) on ``cpu`` and ``file`` (.npy, HDF5, zarr)
tables; written from README.md, SPEC.md and the public docstrings only.

Every value is compared with NumPy doing the same on a copy of the table.
"""

from __future__ import annotations

import warnings

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


N, D = 23, 4  # 23 rows: several chunks of 5 rows in the HDF5 / zarr files
KINDS = ["cpu", "npy", "h5", "zarr"]
FILE_KINDS = ["npy", "h5", "zarr"]


def _base(dtype=np.float32, shape=(N, D)) -> np.ndarray:
    n = int(np.prod(shape))
    if np.dtype(dtype) == np.bool_:
        return (np.arange(n) % 3 == 0).reshape(shape)
    return (np.arange(n) % 97).astype(dtype).reshape(shape)


def _write_file(kind: str, path, arr: np.ndarray) -> None:
    if kind == "npy":
        np.save(path, arr)
    elif kind == "h5":
        with h5py.File(path, "w") as f:
            f.create_dataset("emb", data=arr, chunks=(5,) + arr.shape[1:])
    elif kind == "zarr":
        z = zarr.create_array(
            str(path), shape=arr.shape, chunks=(5,) + arr.shape[1:], dtype=arr.dtype
        )
        z[...] = arr
    else:  # pragma: no cover
        raise AssertionError(kind)


def _read_file(kind: str, path) -> np.ndarray:
    if kind == "npy":
        return np.load(path)
    if kind == "h5":
        with h5py.File(path, "r") as f:
            return f["emb"][...]
    return zarr.open_array(str(path), mode="r")[...]


class T:
    """A table under test plus its NumPy reference and (for files) its path."""

    def __init__(self, kind, tmp_path, arr, **options):
        self.kind = kind
        self.ref = arr.copy()
        self.path = None
        if kind == "cpu":
            self.g = gl.DataGadget(arr, placement="cpu", device="cpu")
        else:
            self.path = tmp_path / {"npy": "t.npy", "h5": "t.h5", "zarr": "t.zarr"}[kind]
            _write_file(kind, self.path, arr)
            self.g = gl.DataGadget(str(self.path), placement="file", device="cpu", **options)

    def check(self):
        """The table (and, for files, the file after close) equals the reference."""
        got = self.g.getNumpyVersion()
        np.testing.assert_array_equal(got, self.ref)
        if self.path is not None:
            self.g.close()
            np.testing.assert_array_equal(_read_file(self.kind, self.path), self.ref)


def _mk(kind, tmp_path, arr=None, **options) -> T:
    return T(kind, tmp_path, _base() if arr is None else arr, **options)


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _each(tmp_path, cases, body):
    """Run body(case, folder) for every case; report every failing case together."""
    errors = []
    for i, case in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        try:
            body(case, d)
        except (Exception, pytest.fail.Exception) as e:  # noqa: PERF203
            errors.append(f"{case!r}: {type(e).__name__}: {e}")
    assert not errors, "\n".join(errors)


# --------------------------------------------------------------------------------------
# index forms: (name, gadgetloader index, NumPy equivalent)
# --------------------------------------------------------------------------------------
_IDS = [9, 0, 9, 22, 4]  # with a repeat
INT_DTYPES_NP = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
INT_DTYPES_T = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]

READ_FORMS = (
    [
        ("int", 3, 3),
        ("int_last", N - 1, N - 1),
        ("np_int64_scalar", np.int64(3), 3),
        ("np_uint8_scalar", np.uint8(3), 3),
        ("torch_0d", torch.tensor(5), 5),
        ("np_0d", np.array(5), 5),
        ("list", list(_IDS), list(_IDS)),
        ("list_2d", [[1, 2], [3, 22]], np.array([[1, 2], [3, 22]])),
        ("list_np_scalars", [np.int64(1), np.int32(2)], [1, 2]),
        ("empty_list", [], np.array([], dtype=np.int64)),
        ("empty_np", np.array([], dtype=np.int64), np.array([], dtype=np.int64)),
        ("empty_torch_2d", torch.zeros(0, 3, dtype=torch.int64), np.zeros((0, 3), dtype=np.int64)),
        ("np_2d", np.array([[1, 22], [0, 1], [5, 5]]), np.array([[1, 22], [0, 1], [5, 5]])),
        ("torch_2d", torch.tensor([[1, 22], [0, 1]]), np.array([[1, 22], [0, 1]])),
        ("torch_strided", torch.arange(N)[::3], np.arange(N)[::3]),
        ("np_neg_strided", np.arange(N)[::-4], np.arange(N)[::-4]),
        ("np_bigendian", np.array([1, 20], dtype=">i4"), [1, 20]),
        ("range", range(1, 5), np.arange(1, 5)),
        ("range_neg_step", range(22, 0, -3), np.arange(22, 0, -3)),
        ("range_empty", range(0), np.array([], dtype=np.int64)),
        ("slice", slice(2, 5), slice(2, 5)),
        ("slice_neg_start", slice(-2, None), slice(-2, None)),
        ("slice_reverse", slice(None, None, -1), slice(None, None, -1)),
        ("slice_neg_step", slice(20, 2, -3), slice(20, 2, -3)),
        ("slice_neg_both", slice(-1, -6, -2), slice(-1, -6, -2)),
        ("slice_step", slice(None, None, 4), slice(None, None, 4)),
        ("slice_past_end", slice(20, 100), slice(20, 100)),
        ("slice_before_start", slice(-100, 3), slice(-100, 3)),
        ("slice_empty", slice(5, 5), slice(5, 5)),
        ("slice_np_bounds", slice(np.int64(1), np.int64(4)), slice(1, 4)),
        ("slice_huge_step", slice(None, None, 2**70), slice(None, None, 2**70)),
        ("slice_huge_neg_step", slice(None, None, -(2**70)), slice(None, None, -(2**70))),
        ("slice_huge_bounds", slice(-(2**70), 2**70), slice(-(2**70), 2**70)),
        ("slice_huge_start", slice(2**70, None), slice(2**70, None)),
        ("tuple_plain_ints", (3, 1), [3, 1]),
        ("tuple_one_int", (3,), [3]),
        ("tuple_np_ints", (np.int64(3), np.int64(1)), [3, 1]),
        ("ids_then_int", ([1, 2], 0), ([1, 2], 0)),
        ("ids_then_neg_int", ([1, 2], -1), ([1, 2], -1)),
        ("tupleids_then_int", ((1, 2), 3), ([1, 2], 3)),
        (
            "array_then_slice",
            (np.array([1, 22, 1]), slice(1, 3)),
            (np.array([1, 22, 1]), slice(1, 3)),
        ),
        ("slice_slice", (slice(0, 6), slice(0, 3)), (slice(0, 6), slice(0, 3))),
        ("slice_stepped_cols", (slice(0, 6), slice(0, 4, 2)), (slice(0, 6), slice(0, 4, 2))),
        ("revslice_int", (slice(None, None, -1), 2), (slice(None, None, -1), 2)),
        (
            "array2d_slice",
            (np.array([[1, 2], [3, 4]]), slice(1, 3)),
            (np.array([[1, 2], [3, 4]]), slice(1, 3)),
        ),
        (
            "tensor_stepslice",
            (torch.tensor([1, 9]), slice(0, 4, 2)),
            (np.array([1, 9]), slice(0, 4, 2)),
        ),
        ("int_then_slice", (1, slice(2, 4)), (1, slice(2, 4))),
        ("slice_negbound_cols", ([1, 2], slice(-2, None)), ([1, 2], slice(-2, None))),
        ("cols_huge_stop", ([1, 2], slice(1, 2**70)), ([1, 2], slice(1, 2**70))),
        ("cols_np_bounds", ([1, 2], slice(np.int64(1), np.int64(3))), ([1, 2], slice(1, 3))),
        ("cols_np_int", ([1, 2], np.int64(2)), ([1, 2], 2)),
        ("one_elem_tuple_slice", (slice(0, 3),), (slice(0, 3),)),
        ("one_elem_tuple_array", (np.array([1, 2]),), (np.array([1, 2]),)),
        ("range_then_int", (range(1, 3), 0), (np.arange(1, 3), 0)),
    ]
    + [(f"np_{d}", np.array(_IDS, dtype=d), list(_IDS)) for d in INT_DTYPES_NP]
    + [
        (f"torch_{str(d).split('.')[1]}", torch.tensor(_IDS, dtype=d), list(_IDS))
        for d in INT_DTYPES_T
    ]
)


@pytest.mark.parametrize("form", READ_FORMS, ids=[f[0] for f in READ_FORMS])
def test_read_forms_match_numpy(form, tmp_path):
    _, idx, np_idx = form

    def body(kind, d):
        t = _mk(kind, d)
        want = t.ref[np_idx]
        for got in (t.g[idx], t.g.getData(idx)):
            assert isinstance(got, torch.Tensor)
            assert got.device.type == "cpu"
            assert got.dtype == torch.float32
            assert tuple(got.shape) == want.shape
            np.testing.assert_array_equal(_np(got), want)
        t.check()  # reads never change anything

    _each(tmp_path, KINDS, body)


# a one-element tuple holding an id *list* reads like the same tuple holding an array
# (NumPy: rows [1, 2]) or is refused as "a tuple of id lists"
def test_one_element_tuple_holding_ids(tmp_path):
    a = _base()
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    assert tuple(g[(np.array([1, 2]),)].shape) == (2, D)  # the array form: NumPy's rows [1, 2]

    def body(idx, d):
        try:
            got = g[idx]
        except gl.GadgetTypeError:
            return
        assert tuple(got.shape) == a[([1, 2],)].shape, (
            f"g[{idx!r}] has shape {tuple(got.shape)}; g[(np.array([1, 2]),)] gives (2, {D}) and "
            f"NumPy {a[([1, 2],)].shape}"
        )

    _each(tmp_path, [([1, 2],), ((1, 2),), (range(1, 3),)], body)


# Python's and NumPy's slice rules for the part of the row: any positive step, bounds
# clamped to the axis (a step past the axis selects its first element)
HUGE_COL_SLICES = [
    ("step_2**63", ([1, 2], slice(None, None, 2**63))),
    ("step_2**70", ([1, 2], slice(None, None, 2**70))),
    ("step_2**63_from_1", (slice(0, 3), slice(1, None, 2**63))),
]


def test_row_part_slice_with_huge_step(tmp_path):
    def body(case, d):
        kind, (_, idx) = case
        t = _mk(kind, d)
        want = t.ref[idx]
        got = t.g[idx]
        assert tuple(got.shape) == want.shape, (
            f"g[{idx}] -> shape {tuple(got.shape)}, NumPy {want.shape}"
        )
        np.testing.assert_array_equal(_np(got), want)
        data = _data_for(want.shape)
        t.g[idx] = torch.from_numpy(data)
        t.ref[idx] = data
        t.check()

    _each(tmp_path, [(k, c) for k in ("cpu", "npy") for c in HUGE_COL_SLICES], body)


def test_row_part_slice_with_huge_negative_start_no_foreign_warning(tmp_path):
    """A row-part slice is clamped as Python clamps it, with no warning from torch's
    internals ("Truncating the start/stop/step of slice")."""

    def body(case, d):
        kind, start = case
        t = _mk(kind, d)
        idx = ([1, 2], slice(start, None))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = t.g[idx]
        np.testing.assert_array_equal(_np(got), t.ref[idx])
        assert not w, [f"{x.category.__name__}: {x.message}" for x in w]

    _each(tmp_path, [(k, st) for k in ("cpu", "npy") for st in (-(2**63), -(2**70))], body)


def _data_for(shape, dtype=np.float32, offset=1000):
    n = int(np.prod(shape))
    return (np.arange(n) + offset).astype(dtype).reshape(shape)


WRITE_FORMS = READ_FORMS


@pytest.mark.parametrize("form", WRITE_FORMS, ids=[f[0] for f in WRITE_FORMS])
def test_write_forms_match_numpy(form, tmp_path):
    _, idx, np_idx = form

    def body(kind, d):
        t = _mk(kind, d)
        shape = t.ref[np_idx].shape
        data1 = _data_for(shape)
        t.g[idx] = torch.from_numpy(data1)
        t.ref[np_idx] = data1  # NumPy's sequential assignment: a repeated id's last row wins
        np.testing.assert_array_equal(t.g.getNumpyVersion(), t.ref)
        data2 = _data_for(shape, offset=5000)
        t.g.insertData(data2, idx)  # a NumPy array of the table's dtype is accepted too
        t.ref[np_idx] = data2
        t.check()

    _each(tmp_path, KINDS, body)


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_ids_last_occurrence_wins(kind, tmp_path):
    t = _mk(kind, tmp_path, block_rows=2, cache_bytes=0) if kind != "cpu" else _mk(kind, tmp_path)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, N, size=(6, 7))
    data = _data_for(ids.shape + (D,))
    t.g.insertData(torch.from_numpy(data), torch.from_numpy(ids))
    for flat_i, row in zip(
        ids.reshape(-1), data.reshape(-1, D), strict=True
    ):  # sequential, last wins
        t.ref[flat_i] = row
    t.check()


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_ids_partial_row_write_last_wins(kind, tmp_path):
    t = _mk(kind, tmp_path)
    ids = [7, 3, 7, 7, 21, 3]
    data = _data_for((len(ids), 2))
    t.g[ids, 1:3] = torch.from_numpy(data)
    for i, row in zip(ids, data, strict=True):
        t.ref[i, 1:3] = row
    t.check()


@pytest.mark.parametrize("kind", KINDS)
def test_scatter_is_insertdata_with_torch_order(kind, tmp_path):
    t = _mk(kind, tmp_path)
    ids = torch.tensor([2, 2, 11])
    rows = torch.from_numpy(_data_for((3, D)))
    t.g.scatter(ids, rows)
    t.ref[[2, 2, 11]] = rows.numpy()
    np.testing.assert_array_equal(_np(t.g.gather(ids)), t.ref[[2, 2, 11]])
    t.check()


@pytest.mark.parametrize("kind", KINDS)
def test_write_through_overlapping_table_view_is_numpy_like(kind, tmp_path):
    """Data that is itself read from the table (a copy on files, a view on cpu)."""
    t = _mk(kind, tmp_path)
    src = t.g.as_tensor()[0:3] if kind == "cpu" else t.g.getData(slice(0, 3))
    t.g.insertData(src, [1, 2, 3])
    t.ref[[1, 2, 3]] = t.ref[0:3].copy()
    t.check()


OVERLAP_WRITES = [
    ("reverse_all", slice(None, None, -1), lambda v: v, lambda a: a),
    ("shift_down", slice(1, None), lambda v: v[:-1], lambda a: a[:-1]),
    ("shift_up", slice(None, -1), lambda v: v[1:], lambda a: a[1:]),
    ("stepped", slice(0, N, 2), lambda v: v[0:12], lambda a: a[0:12]),
    ("ids_from_table", [5, 3, 1], lambda v: v[0:3], lambda a: a[0:3]),
]


def test_overlapping_in_table_writes_cpu(tmp_path):
    """Data that is a view of the same cpu table (as_tensor): the result is NumPy's
    (which copies overlapping data first)."""

    def body(case, d):
        _, idx, src, np_src = case
        a = _base()
        g = gl.DataGadget(a, placement="cpu", device="cpu")
        g[idx] = src(g.as_tensor())
        ref = a.copy()
        ref[idx] = np_src(ref).copy()
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)

    _each(tmp_path, OVERLAP_WRITES, body)


# --------------------------------------------------------------------------------------
# dtypes: exact round trip; writes want the table's dtype exactly
# --------------------------------------------------------------------------------------
TABLE_DTYPES = ["int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_dtype_round_trip_with_repeats(dtype, tmp_path):
    def body(kind, d):
        arr = _base(dtype)
        t = _mk(kind, d, arr)
        assert t.g.dtype == torch.from_numpy(arr).dtype
        ids = np.array([5, 1, 5, 22])
        got = t.g.getData(ids)
        assert got.dtype == t.g.dtype
        np.testing.assert_array_equal(_np(got), arr[ids])
        if dtype == "bool":
            data = np.array([[True, False, True, True]] * 4)
            data[0] = ~data[0]
        else:
            data = _data_for((4, D), dtype, offset=3)
        t.g.insertData(torch.from_numpy(data), ids)
        t.ref[ids] = data
        t.check()

    _each(tmp_path, KINDS, body)


def test_bfloat16_round_trip_and_numpy_version_is_float32():
    src = torch.arange(N * D, dtype=torch.float32).reshape(N, D).div(7).to(torch.bfloat16)
    g = gl.DataGadget(src, placement="cpu", device="cpu")
    assert g.dtype == torch.bfloat16
    ids = [4, 4, 0]
    rows = torch.full((3, D), 0.1, dtype=torch.bfloat16) * torch.arange(1, 4).view(3, 1).to(
        torch.bfloat16
    )
    g.insertData(rows, ids)
    ref = src.clone()
    ref[ids] = rows  # torch's assignment: last wins here too (rows differ)
    ref[4] = rows[1]
    assert torch.equal(g.getData(slice(None)), ref)
    nv = g.getNumpyVersion()
    assert nv.dtype == np.float32
    np.testing.assert_array_equal(nv, ref.float().numpy())
    nv2 = g.getNumpyVersion(copy=False)  # no view of bfloat16: a copy all the same
    nv2[0, 0] = 123.0
    assert g[0][0].item() != 123.0


WRONG_DTYPE_WRITES = [
    ("float32", torch.float64),
    ("float32", torch.float16),
    ("float32", torch.int64),
    ("float32", torch.int32),
    ("float32", torch.bfloat16),
    ("float64", torch.float32),
    ("int32", torch.int64),
    ("int32", torch.float32),
    ("int64", torch.int32),
    ("uint8", torch.int8),
    ("bool", torch.uint8),
    ("int8", torch.bool),
]


@pytest.mark.parametrize(
    "tdt,ddt", WRONG_DTYPE_WRITES, ids=[f"{a}<-{str(b)[6:]}" for a, b in WRONG_DTYPE_WRITES]
)
def test_write_wrong_dtype_refused_unchanged(tdt, ddt, tmp_path):
    """insertData wants the table's dtype exactly: an error that says so, nothing written."""
    hows = ["insertData", "setitem", "partial"] + ([] if ddt == torch.bfloat16 else ["numpy"])
    cases = [(k, h) for k in KINDS for h in hows]

    def body(case, d):
        kind, how = case
        t = _mk(kind, d, _base(tdt))
        data = torch.ones(2, D, dtype=ddt)
        with pytest.raises(gl.GadgetTypeError) as ei:
            if how == "insertData":
                t.g.insertData(data, [1, 2])
            elif how == "setitem":
                t.g[[1, 2]] = data
            elif how == "partial":
                t.g[[1, 2], 1:3] = data[:, 1:3].contiguous()
            else:
                t.g.insertData(data.numpy(), [1, 2])
        assert isinstance(ei.value, TypeError)
        msg = str(ei.value)
        assert str(np.dtype(tdt)) in msg or str(t.g.dtype).split(".")[-1] in msg
        t.check()

    _each(tmp_path, cases, body)


BAD_SHAPES = [(D,), (1, D), (2, 1), (3, D), (2, D, 1), (2, D + 1)]


@pytest.mark.parametrize("kind", KINDS)
def test_no_broadcasting_on_write(kind, tmp_path):
    """Data must have shape ids.shape + row_shape: no broadcasting, nothing written."""

    def body(shape, d):
        t = _mk(kind, d)
        with pytest.raises(gl.GadgetValueError) as ei:
            t.g[[1, 2]] = torch.ones(shape)
        assert isinstance(ei.value, ValueError)
        assert f"(2, {D})" in str(ei.value)
        with pytest.raises(gl.GadgetValueError):
            t.g.insertData(torch.ones(shape).numpy(), np.array([1, 2]))
        t.check()

    _each(tmp_path, BAD_SHAPES, body)


SCALAR_VALUES = [
    1.0,
    0,
    np.float32(1.0),
    [[1.0] * D] * 2,
    torch.tensor(1.0),
    torch.ones(1, D).expand(2, D),
]


@pytest.mark.parametrize("kind", KINDS)
def test_scalar_list_or_expanded_value_on_write(kind, tmp_path):
    """A scalar, list or stride-0 value is either written as NumPy broadcasts it or
    refused with a GadgetError, the table unchanged."""

    def body(value, d):
        t = _mk(kind, d)
        try:
            t.g[[1, 2]] = value
        except gl.GadgetError:
            pass
        else:
            t.ref[[1, 2]] = np.asarray(value, dtype=np.float32)
        t.check()

    _each(tmp_path, SCALAR_VALUES, body)


@pytest.mark.parametrize("kind", KINDS)
def test_partial_write_shape_mismatch_refused(kind, tmp_path):
    t = _mk(kind, tmp_path)
    with pytest.raises(gl.GadgetValueError):
        t.g[[1, 2], 0:3] = torch.ones(2, D)
    with pytest.raises(gl.GadgetValueError):
        t.g[2:5] = torch.ones(2, D)
    with pytest.raises(gl.GadgetValueError):
        t.g[slice(None, None, -1)] = torch.ones(N - 1, D)
    t.check()


# --------------------------------------------------------------------------------------
# bad ids: refused before anything is read or written
# --------------------------------------------------------------------------------------
BAD_INDEX = [
    ("past_end", [1, N], gl.GadgetIndexError, IndexError),
    ("negative_in_list", [1, -1], gl.GadgetIndexError, IndexError),
    ("negative_int", -1, gl.GadgetIndexError, IndexError),
    ("int_past_end", N, gl.GadgetIndexError, IndexError),
    ("neg_np_scalar", np.int64(-1), gl.GadgetIndexError, IndexError),
    ("neg_in_tensor", torch.tensor([[0, 1], [-3, 2]]), gl.GadgetIndexError, IndexError),
    ("range_negative", range(-1, 2), gl.GadgetIndexError, IndexError),
    ("huge_int", 2**70, gl.GadgetIndexError, IndexError),
    ("uint64_max", np.array([2**64 - 1], dtype=np.uint64), gl.GadgetIndexError, IndexError),
    ("float_list", [1.0, 2.0], gl.GadgetTypeError, TypeError),
    ("float_tensor", torch.tensor([1.0]), gl.GadgetTypeError, TypeError),
    ("float_np", np.array([1.0]), gl.GadgetTypeError, TypeError),
    ("str", "1", gl.GadgetTypeError, TypeError),
    ("bool", True, gl.GadgetTypeError, TypeError),
    ("bool_list", [1, True], gl.GadgetTypeError, TypeError),
    ("pointwise_tuple", ([1, 2], [0, 1]), gl.GadgetTypeError, TypeError),
    ("ragged", [[1, 2], [3]], gl.GadgetError, Exception),
    ("zero_step", slice(None, None, 0), gl.GadgetValueError, ValueError),
    ("col_neg_step", ([1, 2], slice(None, None, -1)), gl.GadgetError, Exception),
    ("col_float_bound", ([1, 2], slice(0.0, 2)), gl.GadgetError, Exception),
    ("col_int_out_of_range", ([1, 2], D), gl.GadgetIndexError, IndexError),
    ("too_many_indices", ([1, 2], 0, 0), gl.GadgetIndexError, IndexError),
    ("none_in_tuple", (np.array([1]), None), gl.GadgetError, Exception),
]


@pytest.mark.parametrize("bad", BAD_INDEX, ids=[b[0] for b in BAD_INDEX])
def test_bad_index_refused_on_read_and_write(bad, tmp_path):
    _, idx, exc, builtin = bad

    def body(kind, d):
        t = _mk(kind, d)
        with pytest.raises(exc) as ei:
            t.g.getData(idx)
        assert isinstance(ei.value, builtin)
        with pytest.raises(exc):
            t.g[idx]
        with pytest.raises(exc):
            t.g[idx] = torch.ones(2, D)
        with pytest.raises(exc):
            t.g.insertData(torch.ones(2, D), idx)
        t.check()

    _each(tmp_path, KINDS, body)


@pytest.mark.parametrize("kind", KINDS)
def test_meta_device_ids_data_refused(kind, tmp_path):
    """Data or ids on a device that is neither the CPU nor CUDA: a GadgetError, nothing written."""
    t = _mk(kind, tmp_path)
    with pytest.raises(gl.GadgetTypeError):
        t.g.insertData(torch.empty(2, D, device="meta"), [1, 2])
    with pytest.raises(gl.GadgetTypeError):
        t.g[[1, 2]] = torch.empty(2, D, device="meta")
    with pytest.raises(gl.GadgetTypeError):
        t.g.getData(torch.tensor([1, 2], device="meta"))
    with pytest.raises(gl.GadgetTypeError):
        t.g.insertData(torch.ones(2, D), torch.tensor([1, 2], device="meta"))
    t.check()


@pytest.mark.parametrize("kind", KINDS)
def test_unusual_numpy_data_layouts_written_by_value(kind, tmp_path):
    """Fortran-ordered, negative-strided, non-native byte order and read-only arrays of
    the table's dtype: written by value (or the byte order refused), no warnings."""
    t = _mk(kind, tmp_path)
    base = _data_for((3, D))
    fort = np.asfortranarray(base)
    neg = base[::-1, ::-1]
    ro = base.copy()
    ro.setflags(write=False)
    ro_ids = np.array([20, 21, 22])
    ro_ids.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.g.insertData(fort, [0, 1, 2])
        t.ref[[0, 1, 2]] = fort
        t.g.insertData(neg, np.array([3, 4, 5]))
        t.ref[[3, 4, 5]] = neg
        t.g[ro_ids] = ro
        t.ref[ro_ids] = ro
        np.testing.assert_array_equal(_np(t.g[ro_ids]), t.ref[ro_ids])
        big = (base + 7).astype(">f4")
        try:
            t.g.insertData(big, [6, 7, 8])
        except gl.GadgetTypeError:
            pass
        else:
            t.ref[[6, 7, 8]] = big
    t.check()


def test_zero_row_table():
    g = gl.DataGadget((0, D), dtype="float32", placement="cpu", device="cpu")
    assert len(g) == 0 and tuple(g.shape) == (0, D)
    for idx in ([], slice(0, 5), slice(None, None, -1), range(0), np.zeros((2, 0), np.int64)):
        got = g.getData(idx)
        want = np.zeros((0, D), np.float32)[idx if not isinstance(idx, range) else slice(0, 0)]
        assert tuple(got.shape) == want.shape
    with pytest.raises(gl.GadgetIndexError):
        g.getData([0])
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.ones(1, D), [0])
    g.insertData(torch.ones(0, D), [])
    assert g.getNumpyVersion().shape == (0, D)


def test_bool_mask_message_points_to_nonzero():
    g = gl.DataGadget(_base(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="nonzero"):
        g.getData(torch.zeros(N, dtype=torch.bool))


@pytest.mark.parametrize("kind", KINDS)
def test_index_error_says_expected_and_arrived(kind, tmp_path):
    t = _mk(kind, tmp_path)
    with pytest.raises(gl.GadgetIndexError) as ei:
        t.g.getData([0, 57, 3])
    msg = str(ei.value)
    assert "57" in msg and str(N) in msg


@pytest.mark.parametrize("kind", KINDS)
def test_check_ids_false_still_checks_cpu_ids(kind, tmp_path):
    """CPU ids are always checked; check_ids=False only skips the CUDA-id check."""
    t = _mk(kind, tmp_path)
    with pytest.raises(gl.GadgetIndexError):
        t.g.getData([1, N + 3], check_ids=False)
    with pytest.raises(gl.GadgetIndexError):
        t.g.insertData(torch.ones(2, D), [1, N + 3], check_ids=False)
    np.testing.assert_array_equal(_np(t.g.getData([4, 1], check_ids=0)), t.ref[[4, 1]])
    t.check()


@pytest.mark.parametrize("flag", ["False", "True", 2, None, 0.0])
def test_check_ids_flag_type(flag):
    g = gl.DataGadget(_base(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1], check_ids=flag)
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.ones(1, D), [1], check_ids=flag)
    np.testing.assert_array_equal(g.getNumpyVersion(), _base())


def test_cpupinn_string_refused():
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(_base(), CPUPinn="False", placement="cpu")


# --------------------------------------------------------------------------------------
# out=, device=, copy=
# --------------------------------------------------------------------------------------
OUT_FORMS = [
    ("list", [3, 3, 0], [3, 3, 0]),
    ("2d", np.array([[1, 2], [2, 1]]), np.array([[1, 2], [2, 1]])),
    ("slice", slice(20, 2, -5), slice(20, 2, -5)),
    ("int", 7, 7),
    ("range", range(4), np.arange(4)),
    ("empty", [], np.array([], dtype=np.int64)),
    ("tensor_u8", torch.tensor([4, 0], dtype=torch.uint8), [4, 0]),
]


@pytest.mark.parametrize("kind", KINDS)
def test_out_is_filled_and_returned(kind, tmp_path):
    def body(form, d):
        _, idx, np_idx = form
        t = _mk(kind, d)
        want = t.ref[np_idx]
        out = torch.full(want.shape, -1.0)
        got = t.g.getData(idx, out=out)
        assert got is out
        np.testing.assert_array_equal(out.numpy(), want)
        t.check()

    _each(tmp_path, OUT_FORMS, body)


OUT_BAD = [
    ("shape", lambda: torch.empty(3, D + 1), gl.GadgetValueError),
    ("rows", lambda: torch.empty(2, D), gl.GadgetValueError),
    ("dtype", lambda: torch.empty(3, D, dtype=torch.float64), gl.GadgetTypeError),
    ("noncontig", lambda: torch.empty(D, 3).t(), gl.GadgetValueError),
    ("numpy", lambda: np.empty((3, D), np.float32), gl.GadgetTypeError),
    ("meta", lambda: torch.empty(3, D, device="meta"), gl.GadgetTypeError),
]


@pytest.mark.parametrize("kind", KINDS)
def test_out_wrong_refused(kind, tmp_path):
    def body(bad, d):
        _, mk_out, exc = bad
        t = _mk(kind, d)
        with pytest.raises(exc):
            t.g.getData([1, 2, 3], out=mk_out())

    _each(tmp_path, OUT_BAD, body)


@pytest.mark.parametrize("kind", KINDS)
def test_out_refused_with_tuple_index(kind, tmp_path):
    t = _mk(kind, tmp_path)
    with pytest.raises(gl.GadgetError):
        t.g.getData(([1, 2], slice(0, 2)), out=torch.empty(2, 2))
    with pytest.raises(gl.GadgetError):
        t.g.getData((slice(0, 6), slice(0, 3)), out=torch.empty(6, 3))


def test_out_inside_table_with_bad_id_leaves_table_unchanged():
    a = _base()
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    view = g.as_tensor()
    with pytest.raises(gl.GadgetIndexError):
        g.getData([0, 1, N], out=view[5:8])
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


def test_out_overlapping_the_rows_read():
    """out= a part of the table that overlaps the rows being read: NumPy semantics
    (the old rows) or a GadgetError with the table unchanged."""
    a = _base()
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    view = g.as_tensor()
    ref = a.copy()
    try:
        g.getData([0, 1, 2], out=view[1:4])
    except gl.GadgetError:
        pass
    else:
        ref[1:4] = a[[0, 1, 2]]
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dev", ["cpu", torch.device("cpu")], ids=["str", "device"])
def test_device_cpu(kind, dev, tmp_path):
    t = _mk(kind, tmp_path)
    got = t.g.getData([2, 5], device=dev)
    assert got.device.type == "cpu"
    np.testing.assert_array_equal(got.numpy(), t.ref[[2, 5]])


@pytest.mark.parametrize("kind", KINDS)
def test_device_cuda_falls_back_to_cpu(kind, tmp_path):
    """A call asked for device='cuda' rows falls back to the CPU (FallbackWarning, once)."""
    t = _mk(kind, tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = t.g.getData([2, 5], device="cuda")
    assert all(issubclass(x.category, gl.FallbackWarning) for x in w), [str(x.message) for x in w]
    assert got.device.type == "cpu"
    np.testing.assert_array_equal(got.numpy(), t.ref[[2, 5]])


@pytest.mark.parametrize("dev", ["meta", "tpu", 3.5])
def test_device_unknown_refused(dev):
    g = gl.DataGadget(_base(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetError):
        g.getData([1], device=dev)


def test_default_device_is_cpu_without_cuda():
    g = gl.DataGadget(_base(), placement="cpu")
    assert torch.device(g.device).type == "cpu"
    assert g.getData([1]).device.type == "cpu"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g2 = gl.DataGadget(_base(), CPUPinn=True)  # pinned -> cpu fallback without CUDA
    assert all(issubclass(x.category, gl.FallbackWarning) for x in w)
    assert g2.placement == "cpu"
    np.testing.assert_array_equal(_np(g2.getData([3, 1])), _base()[[3, 1]])


def test_numpy_version_copy_semantics_cpu():
    a = _base()
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    c = g.getNumpyVersion()  # copy
    c[0, 0] = -5
    assert g[0][0].item() == a[0, 0]
    v = g.getNumpyVersion(copy=False)  # view of the table
    v[1, 1] = -7
    assert g[1][1].item() == -7
    g.insertData(torch.full((1, D), 42.0), [2])
    assert (v[2] == 42).all()
    v0 = g.getNumpyVersion(copy=0)
    assert np.shares_memory(v0, v)
    np.testing.assert_array_equal(g.numpy(), g.getNumpyVersion())
    arr = np.asarray(g)
    arr[3, 3] = -9
    assert g[3][3].item() != -9
    view = np.asarray(g, copy=False)
    view[4, 0] = -11
    assert g[4][0].item() == -11


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_numpy_version_copy_false_on_file_is_a_copy(kind, tmp_path):
    t = _mk(kind, tmp_path)
    c = t.g.getNumpyVersion(copy=False)
    np.testing.assert_array_equal(c, t.ref)
    c[0, 0] = -5
    with pytest.raises(gl.GadgetValueError) as ei:
        np.asarray(t.g, copy=False)
    assert isinstance(ei.value, ValueError)
    t.check()


@pytest.mark.parametrize("flag", ["False", "True", 2, None])
def test_numpy_version_copy_flag_type(flag):
    g = gl.DataGadget(_base(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.getNumpyVersion(copy=flag)


def test_numpy_version_3d_and_1d_tables():
    for shape in [(N,), (N, 2, 3)]:
        a = _base(np.int16, shape)
        g = gl.DataGadget(a, placement="cpu", device="cpu")
        np.testing.assert_array_equal(g.getNumpyVersion(), a)
        assert g.getNumpyVersion().dtype == np.int16


# --------------------------------------------------------------------------------------
# as_tensor
# --------------------------------------------------------------------------------------
def test_as_tensor_is_zero_copy_view_on_cpu():
    a = _base()
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    v = g.as_tensor()
    assert v.shape == (N, D) and v.dtype == torch.float32 and v.device.type == "cpu"
    np.testing.assert_array_equal(v.numpy(), a)
    v[3] = 77.0
    np.testing.assert_array_equal(_np(g[3]), np.full(D, 77.0, np.float32))
    g[[5]] = torch.full((1, D), 5.5)
    assert (v[5] == 5.5).all()
    assert v.data_ptr() == g.as_tensor().data_ptr()
    a[0, 0] = 999  # the source array was copied in
    assert g[0][0].item() != 999


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_as_tensor_refused_on_file(kind, tmp_path):
    t = _mk(kind, tmp_path)
    with pytest.raises(gl.GadgetTypeError):
        t.g.as_tensor()


# --------------------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------------------
def _gen(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


FILL_OK = [
    ("int8", 127),
    ("int8", -128),
    ("uint8", 255),
    ("int64", 2**63 - 1),
    ("int32", 2.0),
    ("int32", np.int64(5)),
    ("bool", True),
    ("bool", 0),
    ("bool", 1),
    ("float16", 65504),
    ("float16", float("inf")),
    ("float32", float("nan")),
    ("float32", 0.1),
    ("float32", -float("inf")),
    ("float64", 1e39),
    ("float32", torch.tensor(2.5)),
]


def test_fill_valid_values(tmp_path):
    def body(case, d):
        dtype, value = case
        g = gl.DataGadget(_base(dtype), placement="cpu", device="cpu")
        assert g.fill_(value) is g
        v = value.item() if isinstance(value, torch.Tensor) else value
        np.testing.assert_array_equal(g.getNumpyVersion(), np.full((N, D), v, dtype=dtype))

    _each(tmp_path, FILL_OK, body)


def test_fill_bfloat16_rounds_like_torch():
    g = gl.DataGadget((N, D), dtype="bfloat16", placement="cpu", device="cpu")
    g.fill_(0.1)
    assert torch.equal(g.getData(slice(None)), torch.full((N, D), 0.1, dtype=torch.bfloat16))


FILL_BAD = [
    ("int8", 128),
    ("int8", -129),
    ("uint8", -1),
    ("uint8", 256),
    ("int64", 2**63),
    ("int32", 1.5),
    ("int32", float("nan")),
    ("bool", 2),
    ("bool", 0.5),
    ("float16", 70000),
    ("float32", 1e39),
    ("float32", "1"),
    ("float32", None),
    ("int32", float("inf")),
    ("float32", 1j),
    ("int8", torch.tensor(300)),
    ("int64", np.uint64(2**64 - 1)),
]


def test_fill_invalid_values_refused_unchanged(tmp_path):
    def body(case, d):
        dtype, value = case
        a = _base(dtype)
        g = gl.DataGadget(a, placement="cpu", device="cpu")
        with pytest.raises(gl.GadgetError) as ei:
            g.fill_(value)
        assert isinstance(ei.value, (ValueError, TypeError))
        np.testing.assert_array_equal(g.getNumpyVersion(), a)

    _each(tmp_path, FILL_BAD, body)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_fill_and_zero_on_file_persist(kind, tmp_path):
    t = _mk(kind, tmp_path)
    assert t.g.fill_(0.1) is t.g
    t.ref[...] = np.float32(0.1)
    np.testing.assert_array_equal(t.g.getNumpyVersion(), t.ref)
    with pytest.raises(gl.GadgetValueError):
        t.g.fill_(1e39)
    assert t.g.zero_() is t.g
    t.ref[...] = 0
    t.check()


@pytest.mark.parametrize("kind", KINDS)
def test_uniform_reproducible_with_generator(kind, tmp_path):
    t = _mk(kind, tmp_path)
    t.g.uniform_(-1.0, 2.0, generator=_gen(3))
    first = t.g.getNumpyVersion()
    assert first.min() >= -1.0 and first.max() < 2.0
    assert len(np.unique(first)) > N * D // 2
    t.g.uniform_(-1.0, 2.0, generator=_gen(3))
    np.testing.assert_array_equal(t.g.getNumpyVersion(), first)
    t.g.uniform_(-1.0, 2.0, generator=_gen(4))
    assert not np.array_equal(t.g.getNumpyVersion(), first)
    t.g.uniform_(-1.0, 2.0, generator=_gen(3))
    t.ref[...] = first
    t.check()


@pytest.mark.parametrize("kind", KINDS)
def test_normal_reproducible_with_generator(kind, tmp_path):
    arr = np.zeros((400, 5), np.float64)
    t = _mk(kind, tmp_path, arr)
    t.g.normal_(1.5, 2.0, generator=_gen(11))
    first = t.g.getNumpyVersion()
    assert abs(first.mean() - 1.5) < 0.25 and abs(first.std() - 2.0) < 0.25
    t.g.normal_(1.5, 2.0, generator=_gen(11))
    np.testing.assert_array_equal(t.g.getNumpyVersion(), first)
    t.ref[...] = first
    t.check()


def test_global_seed_reproducible():
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        g = gl.DataGadget((N, D), dtype="float32", placement="cpu", device="cpu")
        g.uniform_()
        g2 = gl.DataGadget((N, D), dtype="float64", placement="cpu", device="cpu").normal_()
        outs.append((g.getNumpyVersion(), g2.getNumpyVersion()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_uniform_normal_degenerate_and_tensor_args():
    g = gl.DataGadget((N, D), dtype="float32", placement="cpu", device="cpu")
    g.uniform_(2, 2)
    assert (g.getNumpyVersion() == 2).all()
    g.normal_(torch.tensor(-3.0), torch.tensor(0.0))
    assert (g.getNumpyVersion() == -3).all()
    g.uniform_(torch.tensor(0.0), torch.tensor(0.5))
    v = g.getNumpyVersion()
    assert v.min() >= 0 and v.max() < 0.5


INIT_BAD = [
    ("float32", "uniform_", (1.0, 0.0), gl.GadgetValueError),
    ("float32", "uniform_", (0.0, float("inf")), gl.GadgetValueError),
    ("float32", "uniform_", (float("nan"), 1.0), gl.GadgetValueError),
    ("float32", "uniform_", (-3e38, 3e38), gl.GadgetValueError),
    ("float16", "uniform_", (-60000.0, 60000.0), gl.GadgetValueError),
    ("float16", "uniform_", (0.0, 70000.0), gl.GadgetValueError),
    ("float32", "normal_", (0.0, -1.0), gl.GadgetValueError),
    ("float32", "normal_", (float("nan"), 1.0), gl.GadgetValueError),
    ("float32", "normal_", (0.0, float("inf")), gl.GadgetValueError),
    ("float16", "normal_", (1e5, 1.0), gl.GadgetValueError),
    ("int32", "uniform_", (0.0, 1.0), gl.GadgetTypeError),
    ("int64", "normal_", (0.0, 1.0), gl.GadgetTypeError),
    ("bool", "uniform_", (0.0, 1.0), gl.GadgetTypeError),
]


def test_random_initialiser_arguments_refused_unchanged(tmp_path):
    def body(case, d):
        dtype, fn, args, exc = case
        a = _base(dtype)
        g = gl.DataGadget(a, placement="cpu", device="cpu")
        with pytest.raises(exc):
            getattr(g, fn)(*args)
        np.testing.assert_array_equal(g.getNumpyVersion(), a)

    _each(tmp_path, INIT_BAD, body)


@pytest.mark.parametrize(
    "fn,kwargs",
    [
        (torch.nn.init.xavier_uniform_, {}),
        (torch.nn.init.kaiming_normal_, {}),
        (torch.nn.init.orthogonal_, {}),
        (torch.nn.init.trunc_normal_, {"std": 0.02}),
        (torch.nn.init.uniform_, {"a": -0.5, "b": 0.5}),
    ],
    ids=["xavier_uniform", "kaiming_normal", "orthogonal", "trunc_normal", "uniform"],
)
def test_init_on_cpu_equals_torch_initialiser(fn, kwargs):
    """init_(fn) fills the table in place as fn fills a tensor of the same shape."""
    g = gl.DataGadget((N, D), dtype="float32", placement="cpu", device="cpu")
    assert g.init_(fn, generator=_gen(7), **kwargs) is g
    ref = fn(torch.empty(N, D), generator=_gen(7), **kwargs)
    assert torch.equal(g.getData(slice(None)), ref)


def test_torch_nn_init_directly_on_gadget():
    g = gl.DataGadget((N, D), dtype="float32", placement="cpu", device="cpu")
    torch.nn.init.xavier_uniform_(g, generator=_gen(2))
    ref = torch.nn.init.xavier_uniform_(torch.empty(N, D), generator=_gen(2))
    assert torch.equal(g.getData(slice(None)), ref)
    with pytest.raises(gl.GadgetTypeError):
        torch.nn.init.orthogonal_(g)


@pytest.mark.parametrize("bad", [5, "xavier", None])
def test_init_non_callable_refused(bad):
    a = _base()
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.init_(bad)
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_init_on_file_elementwise_only(kind, tmp_path):
    t = _mk(kind, tmp_path)
    for fn in (torch.nn.init.orthogonal_, torch.nn.init.xavier_uniform_):
        with pytest.raises(gl.GadgetTypeError):
            t.g.init_(fn)
    np.testing.assert_array_equal(t.g.getNumpyVersion(), t.ref)
    t.g.init_(torch.nn.init.constant_, 3.25)
    t.ref[...] = 3.25
    t.check()


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_init_uniform_on_file_reproducible(kind, tmp_path):
    t = _mk(kind, tmp_path)
    t.g.init_(torch.nn.init.uniform_, a=-2.0, b=-1.0, generator=_gen(5))
    first = t.g.getNumpyVersion()
    assert first.min() >= -2.0 and first.max() < -1.0
    t.g.init_(torch.nn.init.uniform_, a=-2.0, b=-1.0, generator=_gen(5))
    np.testing.assert_array_equal(t.g.getNumpyVersion(), first)
    t.ref[...] = first
    t.check()


# --------------------------------------------------------------------------------------
# construction dtype conversions (documented: keep-kind / widening casts, range checked)
# --------------------------------------------------------------------------------------
CONVERT_OK = [
    (np.array([0.1, 3.3, -1e-40, 1e30]), "float32"),
    (np.array([2**24 + 1, -(2**24) - 1, 7]), "float32"),
    (np.array([1.5, 65504.0]), "float16"),
    (np.array([1, 2], np.int64), "int8"),
    (np.array([70000], np.int32), "int64"),
    (np.array([True, False]), "bool"),
]


def test_construct_conversion_rounds_like_numpy(tmp_path):
    def body(case, d):
        arr, dtype = case
        g = gl.DataGadget(arr, dtype=dtype, placement="cpu", device="cpu")
        np.testing.assert_array_equal(g.getNumpyVersion(), arr.astype(dtype))

    _each(tmp_path, CONVERT_OK, body)


CONVERT_BAD = [
    (np.array([1.5]), "int32", gl.GadgetTypeError),
    (np.array([1.0]), "int64", gl.GadgetTypeError),
    (np.array([300]), "int8", gl.GadgetValueError),
    (np.array([-1]), "uint8", gl.GadgetValueError),
    (np.array([1e39]), "float32", gl.GadgetValueError),
    (np.array([70000.0]), "float16", gl.GadgetValueError),
]


def test_construct_conversion_refused(tmp_path):
    def body(case, d):
        arr, dtype, exc = case
        with pytest.raises(exc):
            gl.DataGadget(arr, dtype=dtype, placement="cpu", device="cpu")

    _each(tmp_path, CONVERT_BAD, body)


DTYPE_NAMES = [
    ("float", torch.float32),
    ("int", torch.int32),
    ("byte", torch.uint8),
    ("char", torch.int8),
    (float, torch.float64),
    (int, torch.int64),
    (bool, torch.bool),
    (np.float16, torch.float16),
    (torch.int16, torch.int16),
    ("float64", torch.float64),
]


def test_dtype_names(tmp_path):
    def body(case, d):
        name, want = case
        g = gl.DataGadget((3, 2), dtype=name, placement="cpu", device="cpu")
        assert g.dtype == want
        assert g.getData([0, 2]).dtype == want

    _each(tmp_path, DTYPE_NAMES, body)


# --------------------------------------------------------------------------------------
# len / shape / dtype / repr, close, context manager, read-only files
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_metadata(kind, tmp_path):
    _each(tmp_path, [(N,), (N, D), (N, 2, 3)], lambda shape, d: _check_metadata(kind, shape, d))


def _check_metadata(kind, shape, tmp_path):
    a = _base(np.int32, shape)
    t = _mk(kind, tmp_path, a)
    g = t.g
    assert len(g) == N
    assert tuple(g.shape) == shape
    assert tuple(g.row_shape) == shape[1:]
    assert g.dtype == torch.int32
    assert g.nbytes == a.nbytes
    assert g.ndim == len(shape) and g.dim() == len(shape)
    assert g.numel() == a.size
    assert tuple(g.size()) == shape and g.size(0) == N
    assert g.placement == ("cpu" if kind == "cpu" else "file")
    r = repr(g)
    assert str(shape) in r and "int32" in r and g.placement in r
    np.testing.assert_array_equal(_np(g[3]), a[3])
    assert tuple(g[3].shape) == shape[1:]
    np.testing.assert_array_equal(_np(g[[3, 3]]), a[[3, 3]])


ROW_CALLS = [
    ("getData", lambda g: g.getData([1])),
    ("getitem", lambda g: g[1]),
    ("setitem", lambda g: g.__setitem__([1], torch.zeros(1, D))),
    ("insertData", lambda g: g.insertData(torch.zeros(1, D), [1])),
    ("getNumpyVersion", lambda g: g.getNumpyVersion()),
    ("asarray", lambda g: np.asarray(g)),
    ("fill_", lambda g: g.fill_(1.0)),
    ("zero_", lambda g: g.zero_()),
    ("uniform_", lambda g: g.uniform_()),
    ("normal_", lambda g: g.normal_()),
    ("init_", lambda g: g.init_(torch.nn.init.zeros_)),
    ("flush", lambda g: g.flush()),
    ("gadgetInit", lambda g: g.gadgetInit()),
]


@pytest.mark.parametrize("call", ROW_CALLS, ids=[c[0] for c in ROW_CALLS])
def test_closed_table_refuses_row_calls(call, tmp_path):
    def body(kind, d):
        t = _mk(kind, d)
        t.g.close()
        t.g.close()  # idempotent
        with pytest.raises(gl.GadgetClosedError):
            call[1](t.g)
        assert len(t.g) == N and tuple(t.g.shape) == (N, D) and t.g.dtype == torch.float32
        assert "DataGadget" in repr(t.g)
        if t.path is not None:
            np.testing.assert_array_equal(_read_file(kind, t.path), t.ref)

    _each(tmp_path, KINDS, body)


@pytest.mark.parametrize("kind", KINDS)
def test_closed_table_refuses_load_and_as_tensor(kind, tmp_path):
    t = _mk(kind, tmp_path)
    other = tmp_path / "other.npy"
    np.save(other, _base())
    t.g.close()
    with pytest.raises(gl.GadgetClosedError):
        t.g.load(str(other))
    if kind == "cpu":
        with pytest.raises(gl.GadgetClosedError):
            t.g.as_tensor()


@pytest.mark.parametrize("kind", KINDS)
def test_context_manager_closes_and_keeps_writes(kind, tmp_path):
    t = _mk(kind, tmp_path)
    with t.g as g:
        assert g is t.g
        g[[0, 22]] = torch.full((2, D), 9.0)
        t.ref[[0, 22]] = 9.0
        np.testing.assert_array_equal(g.getNumpyVersion(), t.ref)
    with pytest.raises(gl.GadgetClosedError):
        t.g.getData([0])
    if t.path is not None:
        np.testing.assert_array_equal(_read_file(kind, t.path), t.ref)


@pytest.mark.parametrize("kind", KINDS)
def test_context_manager_closes_on_exception(kind, tmp_path):
    t = _mk(kind, tmp_path)
    with pytest.raises(KeyError), t.g:
        raise KeyError("boom")
    with pytest.raises(gl.GadgetClosedError):
        t.g[0]


def test_npy_write_reaches_file_before_return(tmp_path):
    t = _mk("npy", tmp_path)
    t.g[[4, 4, 1]] = torch.from_numpy(_data_for((3, D)))
    t.ref[[4, 4, 1]] = _data_for((3, D))
    np.testing.assert_array_equal(np.load(t.path), t.ref)  # before close / flush
    t.check()


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_read_only_file_table(kind, tmp_path):
    t = _mk(kind, tmp_path, writable=False)
    np.testing.assert_array_equal(_np(t.g[[3, 1]]), t.ref[[3, 1]])
    for call in (
        lambda: t.g.insertData(torch.zeros(1, D), [1]),
        lambda: t.g.__setitem__(([1, 2], 0), torch.zeros(2)),
        lambda: t.g.fill_(0.0),
        lambda: t.g.uniform_(),
    ):
        with pytest.raises(gl.ReadOnlyError):
            call()
    t.check()


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize(
    "opts", [{"cache_bytes": 0, "block_rows": 2}, {"block_rows": 7}], ids=["nocache", "block7"]
)
def test_file_options_same_values(kind, opts, tmp_path):
    t = _mk(kind, tmp_path, **opts)
    idx = np.array([[22, 0, 13], [13, 5, 21]])
    np.testing.assert_array_equal(_np(t.g[idx]), t.ref[idx])
    np.testing.assert_array_equal(_np(t.g[21:2:-4, 1:3]), t.ref[21:2:-4, 1:3])
    data = _data_for((8, D))
    t.g[22:6:-2] = torch.from_numpy(data)
    t.ref[22:6:-2] = data
    np.testing.assert_array_equal(_np(t.g[idx]), t.ref[idx])
    t.check()


def _layout_file(layout, path, arr):
    if layout == "h5_contiguous":
        with h5py.File(path, "w") as f:
            f.create_dataset("emb", data=arr)
    elif layout == "h5_gzip":
        with h5py.File(path, "w") as f:
            f.create_dataset("emb", data=arr, chunks=(4,) + arr.shape[1:], compression="gzip")
    elif layout == "zarr_v2":
        z = zarr.create_array(
            str(path), shape=arr.shape, chunks=(4,) + arr.shape[1:], dtype=arr.dtype, zarr_format=2
        )
        z[...] = arr
    elif layout == "zarr_sharded":
        z = zarr.create_array(
            str(path),
            shape=arr.shape,
            chunks=(2,) + arr.shape[1:],
            shards=(6,) + arr.shape[1:],
            dtype=arr.dtype,
        )
        z[...] = arr
    else:
        np.save(path, arr)


def _layout_read(layout, path):
    if layout.startswith("h5"):
        with h5py.File(path, "r") as f:
            return f["emb"][...]
    if layout.startswith("zarr"):
        return zarr.open_array(str(path), mode="r")[...]
    return np.load(path)


LAYOUTS = ["h5_contiguous", "h5_gzip", "zarr_v2", "zarr_sharded", "npy"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(N,), (N, 3, 2)], ids=["1d", "3d"])
def test_file_layouts_rows_and_parts(layout, shape, tmp_path):
    arr = (np.arange(int(np.prod(shape))) % 50).astype(np.int16).reshape(shape)
    path = tmp_path / (
        "t.h5" if layout.startswith("h5") else "t.zarr" if layout.startswith("zarr") else "t.npy"
    )
    _layout_file(layout, path, arr)
    ref = arr.copy()
    g = gl.DataGadget(str(path), placement="file", device="cpu")
    if len(shape) == 1:
        ops = [
            ([5, 5, 22], np.array([1, 2, 3], np.int16)),
            (slice(None, None, -3), np.arange(8, dtype=np.int16) + 100),
            (7, np.array(9, np.int16)),
            ((slice(0, 4),), np.arange(4, dtype=np.int16) - 5),
        ]
    else:
        ops = [
            (([5, 5, 22], 1), np.arange(6, dtype=np.int16).reshape(3, 2) + 200),
            (([3, 9], slice(None), 1), np.arange(6, dtype=np.int16).reshape(2, 3) + 300),
            ((slice(20, 0, -7), 2, slice(1, 2)), np.arange(3, dtype=np.int16).reshape(3, 1) + 400),
            (np.array([[0, 1], [1, 0]]), np.arange(24, dtype=np.int16).reshape(2, 2, 3, 2)),
        ]
    for idx, data in ops:
        np.testing.assert_array_equal(_np(g[idx]), ref[idx])
        g[idx] = torch.from_numpy(data.copy())
        ref[idx] = data
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    g.close()
    np.testing.assert_array_equal(_layout_read(layout, path), ref)
