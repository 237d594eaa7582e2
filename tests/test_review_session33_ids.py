"""Black-box review (session 33): every form of ids and values a user may pass to the public API.

Written from README.md, /work/shared/SPEC.md and the public docstrings only. The reference is
NumPy's fancy indexing / sequential assignment (README: "ids of any integer dtype and shape; the
result has shape ``ids.shape + row_shape``", "a repeated id takes the row of its last occurrence
(like NumPy's sequential assignment)", "a slice of rows follows Python's rules"), torch's
``nn.Embedding`` for the drop-in module and a dense table for the switchers.
"""

from __future__ import annotations

import enum

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


ROWS, DIM = 10, 4
BASE = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) * 1.5 + 0.25


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------


def _make(kind, path_dir, base=BASE):
    """A table of ``base`` of the given kind: 'cpu', or a file table of .npy / HDF5 / zarr."""
    if kind == "cpu":
        return gl.DataGadget(base.copy(), placement="cpu", device="cpu")
    if kind == "npy":
        p = path_dir / "t.npy"
        np.save(p, base)
        return gl.DataGadget(str(p), placement="file", device="cpu")
    if kind == "h5":
        pytest.importorskip("h5py")
        p = path_dir / "t.h5"
        gl.DataGadget(base.copy(), placement="cpu", device="cpu").save(str(p), chunk_rows=3)
        return gl.DataGadget(str(p), placement="file", device="cpu")
    if kind == "zarr":
        pytest.importorskip("zarr")
        p = path_dir / "t.zarr"
        gl.DataGadget(base.copy(), placement="cpu", device="cpu").save(str(p), chunk_rows=3)
        return gl.DataGadget(str(p), placement="file", device="cpu")
    raise AssertionError(kind)


KINDS = ["cpu", "npy", "h5", "zarr"]


@pytest.fixture(scope="module")
def ro_tables(tmp_path_factory):
    """Read-only use: one table per kind, never written."""
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp("ro_" + kind)
        try:
            out[kind] = _make(kind, d)
        except pytest.skip.Exception:
            out[kind] = None
    yield out
    for t in out.values():
        if t is not None:
            t.close()


def _ro(ro_tables, kind):
    t = ro_tables[kind]
    if t is None:
        pytest.skip(f"{kind} support not installed")
    return t


def _snap(t):
    return np.array(t.getNumpyVersion(), copy=True)


# --------------------------------------------------------------------------------------------
# id forms: (label, factory, NumPy index giving the same rows)
# --------------------------------------------------------------------------------------------


def _torch_int_dtypes():
    out = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
    for name in ("uint16", "uint32", "uint64"):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        try:  # torch 2.3/2.4 only have "shell" support for these dtypes: guard
            t = torch.tensor([[9, 0], [3, 3]], dtype=dt)
            t.to(torch.int64)
            t.min()
            t.max()
        except Exception:
            continue
        out.append(dt)
    return out


class _Color(enum.IntEnum):
    GREEN = 6


_A2 = [[9, 0], [3, 3]]

ID_CASES = [
    ("py-int", lambda: 3, 3),
    ("py-int-0", lambda: 0, 0),
    ("py-int-last", lambda: 9, 9),
    ("IntEnum", lambda: _Color.GREEN, 6),
    ("0d-np-int64", lambda: np.array(7), np.array(7)),
    ("0d-np-uint8", lambda: np.array(7, dtype=np.uint8), np.array(7)),
    ("0d-torch-int16", lambda: torch.tensor(7, dtype=torch.int16), np.array(7)),
    ("0d-torch-uint8", lambda: torch.tensor(7, dtype=torch.uint8), np.array(7)),
    ("list", lambda: [1, 5, 1], np.array([1, 5, 1])),
    ("list-single", lambda: [8], np.array([8])),
    ("tuple-of-ints", lambda: (4, 0, 4), np.array([4, 0, 4])),
    ("nested-list-2d", lambda: [[1, 2], [3, 9]], np.array([[1, 2], [3, 9]])),
    ("list-of-np-scalars", lambda: [np.int64(1), np.uint8(2), np.int16(9)], np.array([1, 2, 9])),
    ("list-of-0d-tensors", lambda: [torch.tensor(1), torch.tensor(8)], np.array([1, 8])),
    ("range", lambda: range(1, 9, 3), np.array([1, 4, 7])),
    ("range-neg-step", lambda: range(9, -1, -4), np.array([9, 5, 1])),
    ("range-empty", lambda: range(5, 5), np.zeros(0, np.int64)),
    ("slice-step", lambda: slice(1, 9, 3), slice(1, 9, 3)),
    ("slice-neg-step", lambda: slice(8, None, -3), slice(8, None, -3)),
    ("slice-neg-start", lambda: slice(-3, None), slice(-3, None)),
    ("slice-oob", lambda: slice(-100, 100), slice(-100, 100)),
    ("slice-oob-neg-step", lambda: slice(100, -100, -4), slice(100, -100, -4)),
    ("slice-reverse", lambda: slice(None, None, -1), slice(None, None, -1)),
    ("slice-empty", lambda: slice(5, 2), slice(5, 2)),
    ("slice-huge", lambda: slice(2**70, None, -3), slice(2**70, None, -3)),
    ("slice-np-bounds", lambda: slice(np.int64(1), np.uint8(7), np.int16(2)), slice(1, 7, 2)),
    (
        "slice-tensor-bounds",
        lambda: slice(torch.tensor(7), None, torch.tensor(-2)),
        slice(7, None, -2),
    ),
    ("np-noncontig-neg-stride", lambda: np.arange(10)[::-3], np.array([9, 6, 3, 0])),
    ("np-noncontig-step", lambda: np.arange(10)[1::4], np.array([1, 5, 9])),
    ("np-transposed", lambda: np.arange(6).reshape(2, 3).T, np.arange(6).reshape(2, 3).T.copy()),
    (
        "np-broadcast-0-stride",
        lambda: np.broadcast_to(np.array([2, 7]), (3, 2)),
        np.array([[2, 7]] * 3),
    ),
    ("np-3d", lambda: np.arange(8).reshape(2, 2, 2), np.arange(8).reshape(2, 2, 2)),
    ("np-empty-2d", lambda: np.zeros((0, 3), np.int64), np.zeros((0, 3), np.int64)),
    ("np-empty-2d-b", lambda: np.zeros((2, 0), np.int32), np.zeros((2, 0), np.int64)),
    (
        "np-readonly",
        lambda: (lambda a: (a.setflags(write=False), a)[1])(np.array([3, 1])),
        np.array([3, 1]),
    ),
    ("torch-noncontig", lambda: torch.arange(10)[::3], np.array([0, 3, 6, 9])),
    (
        "torch-transposed",
        lambda: torch.arange(6).reshape(2, 3).t(),
        np.arange(6).reshape(2, 3).T.copy(),
    ),
    ("torch-expanded", lambda: torch.tensor([4]).expand(3), np.array([4, 4, 4])),
    ("torch-storage-offset", lambda: torch.arange(10)[5:8], np.array([5, 6, 7])),
    ("torch-empty", lambda: torch.zeros(0, dtype=torch.long), np.zeros(0, np.int64)),
    ("torch.Size", lambda: torch.Size([3, 3, 1]), np.array([3, 3, 1])),
]
for _dt in [
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    ">i2",
    ">i4",
    ">i8",
    ">u2",
    ">u4",
    ">u8",
    "<i4",
    "intc",
    "longlong",
    "uintp",
]:
    ID_CASES.append((f"np-{_dt}", (lambda dt=_dt: np.array(_A2, dtype=dt)), np.array(_A2)))
for _sdt in ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]:
    ID_CASES.append((f"np-scalar-{_sdt}", (lambda dt=_sdt: getattr(np, dt)(5)), 5))
for _tdt in _torch_int_dtypes():
    ID_CASES.append(
        (f"torch-{str(_tdt)[6:]}", (lambda dt=_tdt: torch.tensor(_A2, dtype=dt)), np.array(_A2))
    )

ID_IDS = [c[0] for c in ID_CASES]
# forms that are a batch of ids (no scalars, no slices) -- what every API takes
ARRAY_CASES = [
    c for c in ID_CASES if not isinstance(c[2], (int, slice)) and c[0] not in ("0d-np-int64",)
]


def _is_slice(case):
    return isinstance(case[2], slice)


def _is_scalar(case):
    return isinstance(case[2], int)


# --------------------------------------------------------------------------------------------
# getData / __getitem__ / gather_many against NumPy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ID_CASES, ids=ID_IDS)
def test_getdata_matches_numpy(ro_tables, kind, case):
    g = _ro(ro_tables, kind)
    _, make, npidx = case
    exp = BASE[npidx]
    got = g.getData(make())
    assert isinstance(got, torch.Tensor)
    assert got.dtype == torch.float32
    assert tuple(got.shape) == exp.shape
    np.testing.assert_array_equal(got.numpy(), exp)


@pytest.mark.parametrize("kind", ["cpu", "npy"])
@pytest.mark.parametrize("case", ID_CASES, ids=ID_IDS)
def test_getitem_matches_numpy(ro_tables, kind, case):
    g = _ro(ro_tables, kind)
    _, make, npidx = case
    got = g[make()]
    assert tuple(got.shape) == BASE[npidx].shape
    np.testing.assert_array_equal(got.numpy(), BASE[npidx])


@pytest.mark.parametrize("case", ID_CASES, ids=ID_IDS)
def test_gather_many_matches_numpy(ro_tables, case):
    tabs = [_ro(ro_tables, "cpu"), _ro(ro_tables, "npy")]
    _, make, npidx = case
    outs = gl.gather_many(tabs, make(), device="cpu")
    assert len(outs) == 2
    for o in outs:
        assert tuple(o.shape) == BASE[npidx].shape
        np.testing.assert_array_equal(o.numpy(), BASE[npidx])


def test_result_shape_is_ids_shape_plus_row_shape_for_3d_table(tmp_path):
    base = np.arange(7 * 2 * 3, dtype=np.float64).reshape(7, 2, 3)
    for kind in ("cpu", "npy"):
        g = _make(kind, tmp_path, base)
        ids = np.array([[[6, 0, 6]], [[1, 2, 3]]], dtype=np.uint16)  # shape (2, 1, 3)
        got = g.getData(ids)
        assert tuple(got.shape) == (2, 1, 3, 2, 3)
        np.testing.assert_array_equal(got.numpy(), base[ids.astype(np.int64)])
        assert tuple(g.getData(np.array(4)).shape) == (2, 3)
        assert tuple(g.getData(torch.zeros((0, 5), dtype=torch.int32)).shape) == (0, 5, 2, 3)
        g.close()


def test_one_d_table_scalar_rows(tmp_path):
    base = np.arange(10, dtype=np.int64) * 3
    g = _make("cpu", tmp_path, base)
    assert tuple(g.getData(4).shape) == ()
    assert g.getData(4).item() == 12
    np.testing.assert_array_equal(
        g.getData(np.array([[1, 2], [9, 9]])).numpy(), base[[[1, 2], [9, 9]]]
    )
    g.insertData(torch.tensor(-5), np.int32(4))  # a 0-d value for a single id: shape () + ()
    g.insertData(np.array([7, 8]), torch.tensor([1, 2], dtype=torch.uint8))
    exp = base.copy()
    exp[4] = -5
    exp[[1, 2]] = [7, 8]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)


# --------------------------------------------------------------------------------------------
# insertData / __setitem__ / scatter / scatter_many against NumPy's sequential assignment
# --------------------------------------------------------------------------------------------

WRITE_CASES = ID_CASES + [
    ("repeats-1d", lambda: np.array([1, 5, 1, 5, 1]), np.array([1, 5, 1, 5, 1])),
    (
        "repeats-2d",
        lambda: torch.tensor([[2, 2], [2, 7]], dtype=torch.int16),
        np.array([[2, 2], [2, 7]]),
    ),
    ("repeats-list", lambda: [3, 3, 3], np.array([3, 3, 3])),
]
WRITE_IDS = [c[0] for c in WRITE_CASES]


def _expected_write(npidx, vals):
    exp = BASE.copy()
    if isinstance(npidx, np.ndarray) and npidx.ndim > 0:
        # sequential assignment: later positions win
        flat = npidx.reshape(-1)
        rows = vals.reshape((-1,) + BASE.shape[1:])
        for i, r in zip(flat, rows, strict=True):
            exp[int(i)] = r
    else:
        exp[npidx] = vals
    return exp


def _vals_for(npidx):
    shape = BASE[npidx].shape
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1000.0


@pytest.mark.parametrize(
    ("kind", "how"),
    [
        ("cpu", "insertData"),
        ("cpu", "setitem"),
        ("cpu", "scatter"),
        ("cpu", "scatter_many"),
        ("npy", "insertData"),
        ("npy", "scatter_many"),
    ],
)
@pytest.mark.parametrize("case", WRITE_CASES, ids=WRITE_IDS)
def test_write_matches_numpy(tmp_path, kind, how, case):
    _, make, npidx = case
    g = _make(kind, tmp_path)
    vals = _vals_for(npidx)
    v = torch.from_numpy(vals.copy())
    if how == "insertData":
        g.insertData(v, make())
    elif how == "setitem":
        g[make()] = v
    elif how == "scatter":
        g.scatter(make(), v)
    else:
        gl.scatter_many([g], [v], make())
    np.testing.assert_array_equal(g.getNumpyVersion(), _expected_write(npidx, vals))
    g.close()


@pytest.mark.parametrize("kind", ["h5", "zarr"])
@pytest.mark.parametrize(
    "case",
    [
        c
        for c in WRITE_CASES
        if c[0]
        in (
            "py-int",
            "0d-torch-uint8",
            "nested-list-2d",
            "slice-neg-step",
            "slice-oob-neg-step",
            "np->u8",
            "np-noncontig-neg-stride",
            "torch-transposed",
            "torch.Size",
            "repeats-2d",
            "np-empty-2d",
            "range-neg-step",
        )
    ],
    ids=lambda c: c[0],
)
def test_write_matches_numpy_chunked_files(tmp_path, kind, case):
    _, make, npidx = case
    g = _make(kind, tmp_path)
    vals = _vals_for(npidx)
    g.insertData(vals.copy(), make())
    np.testing.assert_array_equal(g.getNumpyVersion(), _expected_write(npidx, vals))
    g.close()


# --------------------------------------------------------------------------------------------
# refused ids: bools, floats, other types; out of range
# --------------------------------------------------------------------------------------------

BOOL_IDS = [
    ("True", lambda: True),
    ("False", lambda: False),
    ("np.bool_", lambda: np.bool_(True)),
    ("0d-np-bool", lambda: np.array(True)),
    ("0d-torch-bool", lambda: torch.tensor(True)),
    ("torch-bool-mask", lambda: torch.tensor([True, False] * 5)),
    ("np-bool-mask", lambda: np.array([True, False] * 5)),
    ("list-of-bools", lambda: [True, False]),
    ("list-int-and-bool", lambda: [1, True]),
    ("tuple-of-bools", lambda: (True, False)),
    ("list-of-np-bools", lambda: [np.bool_(True), np.bool_(False)]),
]
FLOAT_IDS = [
    ("py-float", lambda: 3.0),
    ("nan", lambda: float("nan")),
    ("np.float64", lambda: np.float64(3)),
    ("np.float32", lambda: np.float32(3)),
    ("0d-torch-float", lambda: torch.tensor(3.0)),
    ("torch-float", lambda: torch.tensor([1.0, 2.0])),
    ("torch-float-requires-grad", lambda: torch.tensor([1.0, 2.0], requires_grad=True)),
    ("torch-float16", lambda: torch.tensor([1, 2], dtype=torch.float16)),
    ("torch-bfloat16", lambda: torch.tensor([1, 2], dtype=torch.bfloat16)),
    ("np-float64", lambda: np.array([1.0, 2.0])),
    ("np-float16", lambda: np.array([1, 2], np.float16)),
    ("list-of-floats", lambda: [1.0, 2.0]),
    ("list-int-and-float", lambda: [1, 2.0]),
    ("empty-np-float", lambda: np.array([])),
]
OTHER_IDS = [
    ("str", lambda: "1"),
    ("None", lambda: None),
    ("Ellipsis", lambda: Ellipsis),
    ("set", lambda: {1, 2}),
    ("dict", lambda: {1: 2}),
    ("bytes", lambda: b"\x01\x02"),
    ("generator", lambda: (i for i in [1, 2])),
    ("complex-tensor", lambda: torch.tensor([1 + 0j])),
    ("ragged-list", lambda: [[1], [2, 3]]),
    ("object-array", lambda: np.array([1, "a"], dtype=object)),
    ("timedelta-array", lambda: np.array([1], "timedelta64[ns]")),
    ("meta-tensor", lambda: torch.tensor([1, 2], device="meta")),
]


def _api_calls(g, ds=None):
    """Every way of handing ids to a table, each returning a callable(ids)."""
    calls = {
        "getData": lambda ids: g.getData(ids),
        "getitem": lambda ids: g[ids],
        "insertData": lambda ids: g.insertData(torch.zeros(2, DIM), ids),
        "setitem": lambda ids: g.__setitem__(ids, torch.zeros(2, DIM)),
        "gather_many": lambda ids: gl.gather_many([g], ids, device="cpu"),
        "scatter_many": lambda ids: gl.scatter_many([g], [torch.zeros(2, DIM)], ids),
    }
    return calls


API_NAMES = ["getData", "getitem", "insertData", "setitem", "gather_many", "scatter_many"]
# every API on an in-memory table; the file table through its reads and writes
KIND_API = [("cpu", a) for a in API_NAMES] + [
    ("npy", "getData"),
    ("npy", "insertData"),
    ("npy", "scatter_many"),
]


@pytest.mark.parametrize(("kind", "api"), KIND_API)
@pytest.mark.parametrize("case", BOOL_IDS, ids=[c[0] for c in BOOL_IDS])
def test_bool_ids_refused(tmp_path, kind, api, case):
    g = _make(kind, tmp_path)
    before = _snap(g)
    with pytest.raises(gl.GadgetTypeError) as ei:
        _api_calls(g)[api](case[1]())
    assert isinstance(ei.value, TypeError)
    assert "bool" in str(ei.value).lower(), str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.close()


def test_bool_tensor_message_points_to_nonzero():
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="nonzero"):
        g.getData(torch.zeros(ROWS, dtype=torch.bool))


@pytest.mark.parametrize(("kind", "api"), KIND_API)
@pytest.mark.parametrize("case", FLOAT_IDS, ids=[c[0] for c in FLOAT_IDS])
def test_float_ids_refused(tmp_path, kind, api, case):
    g = _make(kind, tmp_path)
    before = _snap(g)
    with pytest.raises(gl.GadgetTypeError) as ei:
        _api_calls(g)[api](case[1]())
    assert isinstance(ei.value, TypeError)
    assert "float" in str(ei.value).lower(), str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.close()


@pytest.mark.parametrize("api", API_NAMES)
@pytest.mark.parametrize("case", OTHER_IDS, ids=[c[0] for c in OTHER_IDS])
def test_other_id_types_refused(tmp_path, api, case):
    g = _make("cpu", tmp_path)
    before = _snap(g)
    with pytest.raises(gl.GadgetTypeError) as ei:
        _api_calls(g)[api](case[1]())
    assert isinstance(ei.value, TypeError)
    assert len(str(ei.value)) > 20
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


RANGE_IDS = [
    ("py-neg", lambda: -1, "-1"),
    ("np-scalar-neg", lambda: np.int64(-1), "-1"),
    ("0d-np-neg", lambda: np.array(-2), "-2"),
    ("0d-torch-neg", lambda: torch.tensor(-3), "-3"),
    ("list-neg", lambda: [1, -1], "-1"),
    ("py-len", lambda: 10, "10"),
    ("list-len", lambda: [0, 10], "10"),
    ("np-2d-oob", lambda: np.array([[0], [11]]), "11"),
    ("torch-uint8-oob", lambda: torch.tensor([0, 200], dtype=torch.uint8), "200"),
    ("np-int8-neg", lambda: np.array([0, -128], np.int8), "-128"),
    ("be-oob", lambda: np.array([1, 300], ">i2"), "300"),
    ("torch-int64-min", lambda: torch.tensor([-(2**63)]), None),
    ("py-huge", lambda: 2**70, None),
    ("list-2**63", lambda: [2**63], None),
    ("np-uint64-max", lambda: np.array([2**64 - 1], np.uint64), None),
    ("np-uint64-scalar-max", lambda: np.uint64(2**64 - 1), None),
]


@pytest.mark.parametrize(("kind", "api"), KIND_API)
@pytest.mark.parametrize("case", RANGE_IDS, ids=[c[0] for c in RANGE_IDS])
def test_out_of_range_ids_refused(tmp_path, kind, api, case):
    g = _make(kind, tmp_path)
    before = _snap(g)
    ids = case[1]()
    call = _api_calls(g)[api]
    if api in ("insertData", "setitem", "scatter_many"):
        shape = (
            tuple(ids.shape)
            if isinstance(ids, (torch.Tensor, np.ndarray))
            else tuple(np.shape(ids))
        )
        data = torch.zeros(shape + (DIM,))  # the right shape and dtype: only the ids are wrong
        if api == "insertData":
            call = lambda i: g.insertData(data, i)  # noqa: E731
        elif api == "setitem":
            call = lambda i: g.__setitem__(i, data)  # noqa: E731
        else:
            call = lambda i: gl.scatter_many([g], [data], i)  # noqa: E731
    with pytest.raises(gl.GadgetIndexError) as ei:
        call(ids)
    assert isinstance(ei.value, IndexError)
    msg = str(ei.value)
    if case[2] is not None:
        assert case[2] in msg, msg
        assert "10" in msg, msg  # the table's size is named
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.close()


@pytest.mark.parametrize(
    "api", ["getData", "getitem", "insertData", "setitem", "gather_many", "scatter_many"]
)
def test_slice_step_zero_refused_like_python(tmp_path, api):
    g = _make("cpu", tmp_path)
    before = _snap(g)
    with pytest.raises(gl.GadgetValueError) as ei:
        _api_calls(g)[api](slice(None, None, 0))
    assert isinstance(ei.value, ValueError)
    assert "step" in str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


@pytest.mark.parametrize(
    "bad",
    [slice(1.0, 3), slice(0, 3.5), slice("a", 3), slice(0, 4, 1.0)],
    ids=["float-start", "float-stop", "str-start", "float-step"],
)
def test_slice_with_non_integer_bounds_refused(bad):
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.getData(bad)
    assert isinstance(ei.value, TypeError)
    with pytest.raises(TypeError):
        list(range(10))[bad]  # Python refuses them too


def test_check_ids_false_still_checks_cpu_ids(tmp_path):
    for kind in ("cpu", "npy"):
        g = _make(kind, tmp_path)
        before = _snap(g)
        with pytest.raises(gl.GadgetIndexError):
            g.getData([1, 10], check_ids=False)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.zeros(2, DIM), np.array([1, -1]), check_ids=False)
        with pytest.raises(gl.GadgetIndexError):
            gl.scatter_many([g], [torch.zeros(2, DIM)], [1, 10], check_ids=False)
        np.testing.assert_array_equal(g.getNumpyVersion(), before)
        g.close()


@pytest.mark.parametrize("flag", ["False", 2, None, 1.5])
def test_check_ids_flag_type_refused(flag):
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="check_ids"):
        g.getData([1], check_ids=flag)
    with pytest.raises(gl.GadgetTypeError, match="check_ids"):
        g.insertData(torch.zeros(1, DIM), [1], check_ids=flag)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)


# --------------------------------------------------------------------------------------------
# values: dtypes, scalars, broadcasting, shapes, layouts
# --------------------------------------------------------------------------------------------

WRONG_DTYPE_VALUES = [
    ("np-float64", lambda: np.zeros((2, DIM)), "float64"),
    ("torch-float64", lambda: torch.zeros(2, DIM, dtype=torch.float64), "float64"),
    ("torch-float16", lambda: torch.zeros(2, DIM, dtype=torch.float16), "float16"),
    ("torch-bfloat16", lambda: torch.zeros(2, DIM, dtype=torch.bfloat16), "bfloat16"),
    ("torch-int64", lambda: torch.zeros(2, DIM, dtype=torch.int64), "int64"),
    ("torch-int32", lambda: torch.zeros(2, DIM, dtype=torch.int32), "int32"),
    ("torch-bool", lambda: torch.zeros(2, DIM, dtype=torch.bool), "bool"),
    ("np-int64", lambda: np.zeros((2, DIM), np.int64), "int64"),
    ("np-uint16", lambda: np.zeros((2, DIM), np.uint16), "uint16"),
    ("list-of-floats", lambda: [[0.0] * DIM] * 2, "float64"),  # NumPy reads it as float64
    ("list-of-ints", lambda: [[0] * DIM] * 2, "int64"),
]


@pytest.mark.parametrize("how", ["insertData", "setitem", "scatter_many"])
@pytest.mark.parametrize("kind", ["cpu", "npy"])
@pytest.mark.parametrize("case", WRONG_DTYPE_VALUES, ids=[c[0] for c in WRONG_DTYPE_VALUES])
def test_wrong_value_dtype_refused_not_cast(tmp_path, kind, how, case):
    g = _make(kind, tmp_path)
    before = _snap(g)
    v = case[1]()
    with pytest.raises(gl.GadgetTypeError) as ei:
        if how == "insertData":
            g.insertData(v, [1, 2])
        elif how == "setitem":
            g[[1, 2]] = v
        else:
            gl.scatter_many([g], [v], [1, 2])
    assert isinstance(ei.value, TypeError)
    msg = str(ei.value)
    assert "float32" in msg and case[2] in msg, msg
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.close()


def test_list_values_read_as_numpy_reads_them(tmp_path):
    g64 = gl.DataGadget(BASE.astype(np.float64), placement="cpu", device="cpu")
    g64.insertData([[1.0, 2.0, 3.0, 4.0]], [5])
    assert g64.getData(5).tolist() == [1.0, 2.0, 3.0, 4.0]
    gi = gl.DataGadget(np.zeros((4, 2), np.int64), placement="cpu", device="cpu")
    gi[[0, 3]] = [[1, 2], [3, 4]]
    assert gi.getNumpyVersion().tolist() == [[1, 2], [0, 0], [0, 0], [3, 4]]
    gb = gl.DataGadget(np.zeros((3, 2), bool), placement="cpu", device="cpu")
    gb[[2]] = [[True, False]]
    assert gb.getNumpyVersion().tolist() == [[False, False], [False, False], [True, False]]
    gi32 = gl.DataGadget(np.zeros((4, 2), np.int32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="int32"):
        gi32[[0]] = [[1, 2]]  # NumPy reads it as int64
    assert not gi32.getNumpyVersion().any()


SCALAR_VALUES = [
    ("py-float", lambda: 0.0),
    ("py-int", lambda: 0),
    ("np-float32-scalar", lambda: np.float32(0)),
    ("0d-tensor", lambda: torch.tensor(0.0)),
    ("0d-np", lambda: np.array(0.0, np.float32)),
    ("None", lambda: None),
    ("str", lambda: "0"),
]


@pytest.mark.parametrize("kind", ["cpu", "npy"])
@pytest.mark.parametrize("case", SCALAR_VALUES, ids=[c[0] for c in SCALAR_VALUES])
def test_scalar_values_are_not_broadcast(tmp_path, kind, case):
    g = _make(kind, tmp_path)
    before = _snap(g)
    for call in (
        lambda v: g.insertData(v, [1, 2]),
        lambda v: g.__setitem__(slice(0, 3), v),
        lambda v: gl.scatter_many([g], [v], [1, 2]),
    ):
        with pytest.raises(gl.GadgetError) as ei:
            call(case[1]())
        assert isinstance(ei.value, (TypeError, ValueError))
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.close()


BAD_SHAPES = [
    ("one-row-for-two-ids", lambda: torch.ones(1, DIM), [1, 2], (2, DIM)),
    ("row-for-two-ids", lambda: torch.ones(DIM), [1, 2], (2, DIM)),
    ("narrow-rows", lambda: torch.ones(2, DIM - 1), [1, 2], (2, DIM)),
    ("too-many-rows", lambda: torch.ones(3, DIM), [1, 2], (2, DIM)),
    ("flat-for-2d-ids", lambda: torch.ones(4, DIM), np.array([[1, 2], [3, 4]]), (2, 2, DIM)),
    ("leading-1-for-0d-id", lambda: torch.ones(1, DIM), np.array(3), (DIM,)),
    ("leading-1-for-int-id", lambda: torch.ones(1, DIM), 3, (DIM,)),
    ("wrong-count-for-slice", lambda: torch.ones(2, DIM), slice(1, 7, 2), (3, DIM)),
    ("rows-for-empty-ids", lambda: torch.ones(1, DIM), [], (0, DIM)),
    ("np-broadcastable", lambda: np.ones((1, DIM), np.float32), [4, 5, 6], (3, DIM)),
]


@pytest.mark.parametrize("kind", ["cpu", "npy"])
@pytest.mark.parametrize("case", BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_wrong_value_shapes_refused_with_both_shapes(tmp_path, kind, case):
    g = _make(kind, tmp_path)
    before = _snap(g)
    _, mk, ids, expected_shape = case
    v = mk()
    with pytest.raises(gl.GadgetValueError) as ei:
        g.insertData(v, ids)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert str(tuple(expected_shape)) in msg, msg
    assert str(tuple(v.shape)) in msg, msg
    with pytest.raises(gl.GadgetValueError):
        g[ids] = v
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many([g], [v], ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.close()


def _value_layouts(src):
    s = src
    return {
        "np-neg-stride": s[::-1][:2],
        "np-0-stride": np.broadcast_to(s[0], (2, DIM)),
        "np-big-endian": s[:2].astype(s.dtype.newbyteorder(">")),
        "np-fortran": np.asfortranarray(s[:2]),
        "np-col-step": np.ascontiguousarray(np.repeat(s[:2], 2, axis=1))[:, ::2],
        "np-readonly": (lambda a: (a.setflags(write=False), a)[1])(s[:2].copy()),
        "torch-transposed": torch.from_numpy(np.ascontiguousarray(s[:2].T)).T,
        "torch-expanded": torch.from_numpy(s[:1].copy()).expand(2, DIM),
        "torch-requires-grad": torch.from_numpy(s[:2].copy()).requires_grad_(True),
        "torch-storage-offset": torch.from_numpy(s.copy())[3:5],
    }


LAYOUT_NAMES = list(_value_layouts(np.zeros((6, DIM), np.float32)).keys())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_value_layouts_written_exactly(tmp_path, kind, layout):
    g = _make(kind, tmp_path)
    src = (np.random.default_rng(3).standard_normal((6, DIM)) * 100).astype(np.float32)
    v = _value_layouts(src)[layout]
    ref = np.array(v.detach().numpy() if isinstance(v, torch.Tensor) else v, dtype=np.float32)
    g.insertData(v, np.array([7, 2], ">i4"))
    exp = BASE.copy()
    exp[[7, 2]] = ref
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)
    g[torch.tensor([[1], [3]], dtype=torch.uint8)] = v[:, None]
    exp[[1, 3]] = ref
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)
    if isinstance(v, torch.Tensor) and v.requires_grad:
        assert v.grad is None
    g.close()


def test_values_from_requires_grad_tensor_are_detached():
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    w = torch.ones(2, DIM, requires_grad=True)
    v = w * 3
    g.insertData(v, [0, 1])
    out = g.getData([0, 1])
    assert not out.requires_grad
    np.testing.assert_array_equal(out.numpy(), np.full((2, DIM), 3, np.float32))
    with torch.no_grad():
        w.add_(1)  # changing the source afterwards does not reach the table
    np.testing.assert_array_equal(g.getData([0, 1]).numpy(), np.full((2, DIM), 3, np.float32))


def test_value_aliasing_the_table_reads_before_writes():
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    g.insertData(g.as_tensor()[0:3], [1, 2, 3])
    exp = BASE.copy()
    exp[[1, 2, 3]] = BASE[0:3]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)
    g2 = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    g2[slice(None, None, -1)] = g2.as_tensor()
    np.testing.assert_array_equal(g2.getNumpyVersion(), BASE[::-1])


def test_repeated_ids_last_occurrence_wins_on_every_kind(tmp_path):
    ids = np.array([[4, 1], [4, 4]], np.uint8)
    vals = np.stack([np.full((2, DIM), 1.0), np.full((2, DIM), 2.0)]).astype(np.float32)
    vals[1, 1] = 3.0  # the last occurrence of 4
    for kind in KINDS:
        d = tmp_path / kind
        d.mkdir()
        try:
            g = _make(kind, d)
        except pytest.skip.Exception:
            continue
        g.insertData(vals, ids)
        got = g.getNumpyVersion()
        np.testing.assert_array_equal(got[4], np.full(DIM, 3.0, np.float32))
        np.testing.assert_array_equal(got[1], np.full(DIM, 1.0, np.float32))
        g.close()


# --------------------------------------------------------------------------------------------
# NumPy-style tuple indexes (rows, then slices or ints into each row)
# --------------------------------------------------------------------------------------------

BASE3 = np.arange(6 * 2 * 3, dtype=np.float32).reshape(6, 2, 3)
TUPLE_CASES = [
    ("ids-int", lambda: ([1, 2], 0), ([1, 2], 0)),
    ("ids-neg-int", lambda: ([1, 2], -1), ([1, 2], -1)),
    ("ids-int-int", lambda: ([1, 2], 1, -1), ([1, 2], 1, -1)),
    ("ids-int-slice", lambda: ([1, 2], 0, slice(1, None)), ([1, 2], 0, slice(1, None))),
    (
        "2d-ids-slices",
        lambda: (np.array([[1], [4]], np.uint16), slice(None), slice(0, 3, 2)),
        (np.array([[1], [4]]), slice(None), slice(0, 3, 2)),
    ),
    ("row-slice-neg-step", lambda: (slice(None, None, -2), 1), (slice(None, None, -2), 1)),
    ("0d-id", lambda: (np.array(5), 1, 2), (np.array(5), 1, 2)),
    ("slices", lambda: (slice(1, 3), slice(0, 1), 2), (slice(1, 3), slice(0, 1), 2)),
    (
        "tensor-ids",
        lambda: (torch.tensor([5, 0], dtype=torch.int8), slice(1, 2)),
        ([5, 0], slice(1, 2)),
    ),
    (
        "slice-clipped",
        lambda: ([3, 1], slice(-100, 100), slice(2, 99)),
        ([3, 1], slice(-100, 100), slice(2, 99)),
    ),
    ("int-row-slice", lambda: (3, slice(0, 1)), (3, slice(0, 1))),
    ("np-int-col", lambda: ([1, 2], np.int64(1)), ([1, 2], 1)),
    ("0d-tensor-col", lambda: ([1, 2], torch.tensor(1)), ([1, 2], 1)),
    ("ids-alone", lambda: ([1, 2],), ([1, 2],)),
    ("empty-ids", lambda: (np.zeros(0, np.int64), 0), (np.zeros(0, np.int64), 0)),
    ("repeats", lambda: (np.array([4, 4]), slice(0, 2)), (np.array([4, 4]), slice(0, 2))),
]


@pytest.mark.parametrize("kind", ["cpu", "npy", "h5"])
@pytest.mark.parametrize("case", TUPLE_CASES, ids=[c[0] for c in TUPLE_CASES])
def test_tuple_index_matches_numpy(tmp_path, kind, case):
    g = _make(kind, tmp_path, BASE3)
    _, make, npidx = case
    exp = BASE3[npidx]
    got = g.getData(make())
    assert tuple(got.shape) == exp.shape
    np.testing.assert_array_equal(got.numpy(), exp)
    np.testing.assert_array_equal(g[make()].numpy(), exp)
    vals = np.arange(exp.size, dtype=np.float32).reshape(exp.shape) + 500
    g.insertData(vals, make())
    ref = BASE3.copy()
    ref[npidx] = vals
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    g.close()


TUPLE_REFUSED = [
    ("pointwise", lambda: ([1, 2], [0, 1]), gl.GadgetTypeError),
    ("ids-then-ellipsis", lambda: ([1, 2], Ellipsis), gl.GadgetTypeError),
    ("ids-then-None", lambda: ([1, 2], None), gl.GadgetTypeError),
    ("ids-then-bool", lambda: ([1, 2], True), gl.GadgetTypeError),
    ("ids-then-float-slice", lambda: ([1], slice(0.0, 2)), gl.GadgetTypeError),
    ("ids-then-neg-step", lambda: ([1, 2], slice(None, None, -1)), gl.GadgetValueError),
    ("ids-then-zero-step", lambda: ([1, 2], slice(None, None, 0)), gl.GadgetValueError),
    ("too-many", lambda: ([1], 0, 0, 0), gl.GadgetIndexError),
    ("col-oob", lambda: ([1], 2), gl.GadgetIndexError),
    ("col-neg-oob", lambda: ([1], -3), gl.GadgetIndexError),
    ("inner-oob", lambda: ([1], 0, 3), gl.GadgetIndexError),
    ("row-id-neg", lambda: (np.array([-1]), 0), gl.GadgetIndexError),
    ("row-id-oob", lambda: (np.array([6]), 0), gl.GadgetIndexError),
    ("row-id-float", lambda: (np.array([1.0]), 0), gl.GadgetTypeError),
]


@pytest.mark.parametrize("kind", ["cpu", "npy"])
@pytest.mark.parametrize("case", TUPLE_REFUSED, ids=[c[0] for c in TUPLE_REFUSED])
def test_tuple_index_refusals_leave_table_unchanged(tmp_path, kind, case):
    g = _make(kind, tmp_path, BASE3)
    _, make, err = case
    with pytest.raises(err):
        g.getData(make())
    with pytest.raises(err):
        g[make()] = torch.zeros(1)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE3)
    g.close()


def test_tuple_of_plain_ints_is_a_list_of_ids_for_writes_too():
    """README: "a tuple of plain ints stays a list of ids" -- ``g[1, 2] = rows`` writes rows 1 and 2."""
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    assert tuple(g[1, 2].shape) == (2, DIM)
    g[1, 2] = torch.full((2, DIM), -1.0)
    exp = BASE.copy()
    exp[[1, 2]] = -1.0
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)
    with pytest.raises(gl.GadgetError):
        g[1, 2] = torch.tensor(5.0)  # not NumPy's element assignment, and no broadcast
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)


def test_tuple_index_refused_by_many_and_out():
    g = gl.DataGadget(BASE3.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([g], ([1, 2], 0))
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many([g], [torch.zeros(2, 3)], ([1, 2], 0))
    with pytest.raises(gl.GadgetError):
        g.getData(([1, 2], 0), out=torch.empty(2, 3))
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE3)


def test_tuple_part_value_shape_checked():
    g = gl.DataGadget(BASE3.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError) as ei:
        g.insertData(torch.zeros(2, 2, 3), ([1, 2], 0))
    assert "(2, 3)" in str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE3)


@pytest.mark.parametrize(
    "ix", [(Ellipsis, 0), (None, 0)], ids=["ellipsis-then-int", "None-then-int"]
)
def test_ellipsis_and_none_refusal_names_them(ix):
    """README: "`Ellipsis` and `None` are not indexes here (`GadgetTypeError`)"; an error must say
    what arrived. ``g[..., 0]`` / ``g[None, 0]`` are the NumPy idioms a user would try."""
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.getData(ix)
    msg = str(ei.value).lower()
    assert "ellipsis" in msg or "none" in msg, str(ei.value)


# --------------------------------------------------------------------------------------------
# out= with id forms
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cpu", "npy"])
def test_out_with_id_forms(ro_tables, kind):
    g = _ro(ro_tables, kind)
    for ids, npidx in [
        (np.array(3), 3),
        (3, 3),
        (slice(8, None, -3), slice(8, None, -3)),
        (np.array([[1, 2], [3, 4]], ">u2"), np.array([[1, 2], [3, 4]])),
        (torch.tensor([9, 9], dtype=torch.uint8), [9, 9]),
    ]:
        exp = BASE[npidx]
        out = torch.full(exp.shape, -1.0)
        r = g.getData(ids, out=out)
        assert r.data_ptr() == out.data_ptr()
        np.testing.assert_array_equal(out.numpy(), exp)
    with pytest.raises(gl.GadgetValueError):
        g.getData(3, out=torch.empty(1, DIM))
    with pytest.raises(gl.GadgetValueError):
        g.getData(np.array([[1, 2], [3, 4]]), out=torch.empty(4, DIM))


def test_out_part_of_table_with_bad_id_leaves_table_unchanged():
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetIndexError):
        g.getData([3, 10], out=g.as_tensor()[0:2])
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    g.getData([1, 0], out=g.as_tensor()[0:2])  # a swap through out=
    exp = BASE.copy()
    exp[[0, 1]] = BASE[[1, 0]]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)


# --------------------------------------------------------------------------------------------
# gather_many / scatter_many: argument checks leave every table unchanged
# --------------------------------------------------------------------------------------------


def _three(tmp_path):
    a = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    np.save(tmp_path / "b.npy", BASE * 2)
    b = gl.DataGadget(str(tmp_path / "b.npy"), placement="file", device="cpu")
    c = gl.DataGadget(np.arange(ROWS, dtype=np.int64), placement="cpu", device="cpu")
    return [a, b, c]


def test_scatter_many_id_forms_match_numpy(tmp_path):
    tabs = _three(tmp_path)
    refs = [t.getNumpyVersion().copy() for t in tabs]
    ids = np.array([[7, 0], [7, 3]], ">i8")
    rows = [
        torch.full((2, 2, DIM), 5.0),
        torch.full((2, 2, DIM), 6.0),
        torch.tensor([[1, 2], [3, 4]]),
    ]
    rows[0][1, 0] = 9.0  # last occurrence of 7
    gl.scatter_many(tabs, rows, ids)
    for t, ref, r in zip(tabs, refs, rows, strict=True):
        exp = ref.copy()
        for i, row in zip(ids.reshape(-1), r.reshape((4,) + ref.shape[1:]).numpy(), strict=True):
            exp[int(i)] = row
        np.testing.assert_array_equal(t.getNumpyVersion(), exp)
    got = gl.gather_many(tabs, slice(7, None, -7), device="cpu")
    np.testing.assert_array_equal(got[2].numpy(), tabs[2].getNumpyVersion()[7::-7])


SCATTER_MANY_BAD = [
    (
        "one-wrong-dtype",
        lambda: [
            torch.zeros(2, DIM),
            torch.zeros(2, DIM, dtype=torch.float64),
            torch.zeros(2, dtype=torch.int64),
        ],
        [1, 2],
        gl.GadgetTypeError,
    ),
    (
        "last-wrong-shape",
        lambda: [torch.zeros(2, DIM), torch.zeros(2, DIM), torch.zeros(3, dtype=torch.int64)],
        [1, 2],
        gl.GadgetValueError,
    ),
    (
        "too-few-rows",
        lambda: [torch.zeros(2, DIM), torch.zeros(2, DIM)],
        [1, 2],
        gl.GadgetValueError,
    ),
    (
        "too-many-rows",
        lambda: [torch.zeros(2, DIM)] * 3 + [torch.zeros(2, DIM)],
        [1, 2],
        gl.GadgetValueError,
    ),
    (
        "bad-id",
        lambda: [torch.zeros(2, DIM), torch.zeros(2, DIM), torch.zeros(2, dtype=torch.int64)],
        [1, 10],
        gl.GadgetIndexError,
    ),
    (
        "float-ids",
        lambda: [torch.zeros(2, DIM), torch.zeros(2, DIM), torch.zeros(2, dtype=torch.int64)],
        [1.0, 2.0],
        gl.GadgetTypeError,
    ),
    (
        "bool-mask",
        lambda: [torch.zeros(2, DIM), torch.zeros(2, DIM), torch.zeros(2, dtype=torch.int64)],
        np.array([True, False] * 5),
        gl.GadgetTypeError,
    ),
    (
        "broadcast-row",
        lambda: [torch.zeros(1, DIM), torch.zeros(1, DIM), torch.zeros(1, dtype=torch.int64)],
        [1, 2],
        gl.GadgetValueError,
    ),
    ("scalar-row", lambda: [0.0, 0.0, 0], [1, 2], gl.GadgetTypeError),
]


@pytest.mark.parametrize("case", SCATTER_MANY_BAD, ids=[c[0] for c in SCATTER_MANY_BAD])
def test_scatter_many_refusals_change_no_table(tmp_path, case):
    tabs = _three(tmp_path)
    before = [_snap(t) for t in tabs]
    _, mk, ids, err = case
    with pytest.raises(err):
        gl.scatter_many(tabs, mk(), ids)
    for t, b in zip(tabs, before, strict=True):
        np.testing.assert_array_equal(t.getNumpyVersion(), b)


def test_gather_many_bad_ids_and_tables(tmp_path):
    tabs = _three(tmp_path)
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many(tabs, np.array([[1], [10]]))
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many(tabs, torch.tensor([1.0]))
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many(tabs[0], [1])  # one table, not a list of them
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([], [1])
    other = gl.DataGadget(np.zeros((5, DIM), np.float32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.gather_many([tabs[0], other], [1])


# --------------------------------------------------------------------------------------------
# GadgetDataset
# --------------------------------------------------------------------------------------------

LABELS = np.arange(ROWS, dtype=np.int64) * 10


@pytest.fixture(scope="module")
def ds_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    np.save(d / "x.npy", BASE)
    mem = gl.GadgetDataset(BASE, LABELS, placement="cpu", device="cpu")
    fil = gl.GadgetDataset(str(d / "x.npy"), LABELS, placement="file", device="cpu")
    yield {"cpu": mem, "file": fil}
    mem.close()
    fil.close()


def _check_batch(batch, npidx):
    x, y = batch
    assert tuple(x.shape) == BASE[npidx].shape
    assert tuple(y.shape) == LABELS[npidx].shape
    np.testing.assert_array_equal(x.numpy(), BASE[npidx])
    np.testing.assert_array_equal(y.numpy(), LABELS[npidx])


@pytest.mark.parametrize("which", ["cpu", "file"])
@pytest.mark.parametrize(
    "case",
    [c for c in ID_CASES if not _is_scalar(c)],
    ids=[c[0] for c in ID_CASES if not _is_scalar(c)],
)
def test_dataset_getitem_id_forms(ds_pair, which, case):
    ds = ds_pair[which]
    _, make, npidx = case
    _check_batch(ds[make()], npidx)
    if not _is_slice(case):
        _check_batch(ds.gather(make()), npidx)
        (b,) = ds.__getitems__(make())
        _check_batch(b, npidx)


@pytest.mark.parametrize(
    "i",
    [0, 3, -1, -10, np.int64(-2), np.uint8(9), np.int8(-3), _Color.GREEN],
    ids=["0", "3", "-1", "-10", "np-2", "npu9", "npi8-3", "IntEnum"],
)
def test_dataset_single_int_follows_python(ds_pair, i):
    for ds in ds_pair.values():
        x, y = ds[i]
        j = int(i)
        assert tuple(x.shape) == (DIM,)
        np.testing.assert_array_equal(x.numpy(), BASE[j])
        assert int(y) == LABELS[j]


@pytest.mark.parametrize(
    "i",
    [10, -11, np.int64(10), np.uint64(2**64 - 1), 2**70],
    ids=["10", "-11", "np10", "npu64max", "2**70"],
)
def test_dataset_single_int_out_of_range(ds_pair, i):
    for ds in ds_pair.values():
        with pytest.raises(gl.GadgetIndexError) as ei:
            ds[i]
        assert isinstance(ei.value, IndexError)


def test_dataset_tuple_is_list_of_ids_and_0d_is_unbatched(ds_pair):
    for ds in ds_pair.values():
        _check_batch(ds[1, 0], [1, 0])
        x, y = ds[torch.tensor(4, dtype=torch.int16)]
        assert tuple(x.shape) == (DIM,) and tuple(y.shape) == ()
        np.testing.assert_array_equal(x.numpy(), BASE[4])
        with pytest.raises(gl.GadgetIndexError):
            ds[np.array(-1)]  # a 0-d array is an id, not an int
        with pytest.raises(gl.GadgetIndexError):
            ds[[0, -1]]


_DS_BAD = BOOL_IDS + FLOAT_IDS + [c for c in OTHER_IDS if c[0] != "meta-tensor"]


@pytest.mark.parametrize("case", _DS_BAD, ids=[c[0] for c in _DS_BAD])
def test_dataset_refuses_non_integer_ids(ds_pair, case):
    ds = ds_pair["cpu"]
    for call in (lambda v: ds[v], lambda v: ds.gather(v), lambda v: ds.__getitems__(v)):
        with pytest.raises(gl.GadgetTypeError) as ei:
            call(case[1]())
        assert isinstance(ei.value, TypeError)


@pytest.mark.parametrize("shape", [(2,), ()], ids=["1d", "0d"])
def test_dataset_meta_device_ids_refused_clearly(ds_pair, shape):
    """README: ids of "the wrong ... device raise a `gl.GadgetError` subclass ... that says what was
    expected and what arrived"; DataGadget.getData, the drop-in module and the switchers say
    "ids must be on the CPU or a CUDA device; got meta" -- the dataset should too."""
    ds = ds_pair["cpu"]
    ids = torch.ones(shape, dtype=torch.int64, device="meta")
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="meta"):
        g.getData(ids)  # the table's own answer
    for name, call in (
        ("ds[ids]", lambda v: ds[v]),
        ("ds.gather", ds.gather),
        ("ds.__getitems__", ds.__getitems__),
    ):
        try:
            call(ids)
        except gl.GadgetError as e:
            assert isinstance(e, TypeError) and "meta" in str(e), (name, str(e))
        except Exception as e:  # noqa: BLE001
            pytest.fail(
                f"{name} with meta-device ids raised {type(e).__name__}: {e} (not a GadgetError)"
            )
        else:
            pytest.fail(f"{name} accepted meta-device ids")


@pytest.mark.parametrize(
    "ids",
    [
        [1, 2**63],
        [2**64],
        [-(2**63) - 1],
        [3, -1],
        [3, 10],
        [True, 1],
        [1, 2.0],
        [1, np.int64(2)],
        [np.uint8(1)],
    ],
    ids=["2**63", "2**64", "below-int64", "neg", "oob", "bool", "float", "np-mixed", "np-only"],
)
def test_dataset_getitems_list_of_python_ints(ds_pair, ids):
    """The default form's ``BatchSampler`` list: fast path for Python ints, general path otherwise."""
    ds = ds_pair["cpu"]
    ok = all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= int(i) < ROWS
        for i in ids
    )
    if ok:
        (b,) = ds.__getitems__(ids)
        _check_batch(b, np.array([int(i) for i in ids]))
    else:
        with pytest.raises(gl.GadgetError) as ei:
            ds.__getitems__(ids)
        assert isinstance(ei.value, (IndexError, TypeError))


# --------------------------------------------------------------------------------------------
# OffloadedEmbedding forward
# --------------------------------------------------------------------------------------------

W0 = torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(7))


def _emb():
    return gl.OffloadedEmbedding(ROWS, 3, placement="cpu", device="cpu", init=lambda t: t.copy_(W0))


EMB_CASES = [c for c in ID_CASES if not _is_slice(c)]


@pytest.mark.parametrize("case", EMB_CASES, ids=[c[0] for c in EMB_CASES])
def test_offloaded_embedding_forward_id_forms(case):
    emb = _emb()
    _, make, npidx = case
    exp = W0.numpy()[npidx]
    with torch.no_grad():
        out = emb(make())
    assert tuple(out.shape) == exp.shape
    np.testing.assert_array_equal(out.numpy(), exp)
    # with gradients and an optimizer attached, the output takes part in autograd
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    out2 = emb(make())
    assert tuple(out2.shape) == exp.shape
    assert out2.requires_grad
    np.testing.assert_array_equal(out2.detach().numpy(), exp)
    out2.sum().backward()
    opt.step()
    ref = W0.numpy().copy()
    counts = np.bincount(np.asarray(npidx, dtype=np.int64).reshape(-1), minlength=ROWS).astype(
        np.float32
    )
    ref -= 0.5 * counts[:, None]
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    BOOL_IDS + FLOAT_IDS + OTHER_IDS[:7],
    ids=[c[0] for c in BOOL_IDS + FLOAT_IDS + OTHER_IDS[:7]],
)
def test_offloaded_embedding_refuses_non_integer_ids(case):
    emb = _emb()
    with pytest.raises(gl.GadgetTypeError) as ei:
        emb(case[1]())
    assert isinstance(ei.value, TypeError)
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), W0.numpy())


def _sparse_ids(layout):
    import warnings

    t = torch.tensor([[1, 2]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "beta" notice on first compressed-sparse use
        try:
            if layout == "coo":
                return t.to_sparse()
            if layout == "csr":
                return t.to_sparse_csr()
            if layout == "csc":
                return t.to_sparse_csc()
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"this torch cannot make {layout} int tensors: {e}")
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_sparse_ids_refused_with_gadget_error_everywhere(layout):
    """A sparse id tensor is refused by every API with "ids must be a dense (strided) tensor;
    got layout ... (use .to_dense())" -- the drop-in module included."""
    g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
    ds = gl.GadgetDataset(BASE, placement="cpu", device="cpu")
    emb = _emb()
    _e, sw = _switch()
    calls = {
        "getData": g.getData,
        "insertData": lambda v: g.insertData(torch.zeros(1, 2, DIM), v),
        "gather_many": lambda v: gl.gather_many([g], v),
        "ds[ids]": lambda v: ds[v],
        "emb(ids)": emb,
        "emb(ids) no_grad": lambda v: _no_grad_call(emb, v),
        "beforeForwardPass": sw.beforeForwardPass,
    }
    problems = []
    for name, call in calls.items():
        try:
            call(_sparse_ids(layout))
        except gl.GadgetError as e:
            if not (isinstance(e, TypeError) and "dense" in str(e)):
                problems.append(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: {type(e).__name__}: {e}")
        else:
            problems.append(f"{name}: accepted")
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    assert not problems, problems


def _no_grad_call(f, v):
    with torch.no_grad():
        return f(v)


@pytest.mark.parametrize("case", RANGE_IDS, ids=[c[0] for c in RANGE_IDS])
def test_offloaded_embedding_refuses_out_of_range_ids(case):
    emb = _emb()
    with pytest.raises(gl.GadgetIndexError), torch.no_grad():
        emb(case[1]())
    with pytest.raises(gl.GadgetIndexError):
        emb(case[1]())


@pytest.mark.parametrize(
    "form", ["uint8", "np-big-endian", "list", "np-uint64", "int16-noncontig", "torch.Size"]
)
def test_offloaded_embedding_training_matches_nn_embedding(form):
    ids64 = torch.tensor([[1, 5], [5, 9]])
    make = {
        "uint8": lambda: ids64.to(torch.uint8),
        "np-big-endian": lambda: ids64.numpy().astype(">i4"),
        "list": lambda: ids64.tolist(),
        "np-uint64": lambda: ids64.numpy().astype(np.uint64),
        "int16-noncontig": lambda: torch.tensor([[1, 0, 5], [5, 0, 9]], dtype=torch.int16)[:, ::2],
        "torch.Size": None,
    }[form]
    if make is None:
        make = lambda: torch.Size([1, 5, 5, 9])  # noqa: E731
        ids64 = ids64.reshape(-1)
    g = torch.arange(float(ids64.numel() * 3)).reshape(tuple(ids64.shape) + (3,))
    ref = torch.nn.Embedding(ROWS, 3)
    with torch.no_grad():
        ref.weight.copy_(W0)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.1)
    (ref(ids64) * g).sum().backward()
    ropt.step()
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    (emb(make()) * g).sum().backward()
    opt.step()
    torch.testing.assert_close(
        emb.weight.getData(range(ROWS), device="cpu"), ref.weight.detach(), rtol=0, atol=0
    )


def test_offloaded_embedding_bad_forward_does_not_disturb_step():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(np.array([1, 2], np.uint16))
    for bad in ([1, ROWS], torch.tensor([1.0]), [-1], torch.tensor([True]), "x"):
        with pytest.raises(gl.GadgetError):
            emb(bad)
    out.sum().backward()
    opt.step()
    exp = W0.clone()
    exp[[1, 2]] -= 1.0
    torch.testing.assert_close(emb.weight.getData(range(ROWS), device="cpu"), exp, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# switchers' beforeForwardPass
# --------------------------------------------------------------------------------------------


def _switch(capacity=3):
    e = torch.nn.Embedding(capacity, 3)
    sw = gl.ModelFactory(e, total_classes=ROWS, embed_dimension=3, placement="cpu")
    sw.customInit(lambda t: t.copy_(W0))
    return e, sw


SW_CASES = [c for c in ID_CASES if not _is_slice(c)]


@pytest.mark.parametrize("case", SW_CASES, ids=[c[0] for c in SW_CASES])
def test_switcher_before_forward_pass_id_forms(case):
    e, sw = _switch()
    _, make, npidx = case
    exp_rows = W0.numpy()[npidx]
    with torch.no_grad():
        local = sw.beforeForwardPass(make())
    assert isinstance(local, torch.Tensor)
    assert tuple(local.shape) == np.shape(exp_rows)[:-1]  # same shape as the ids
    np.testing.assert_array_equal(e.weight.detach()[local].numpy(), exp_rows)
    # as a negatives argument too
    with torch.no_grad():
        lp, ln = sw.beforeForwardPass([0, 1], make())
    assert tuple(lp.shape) == (2,) and tuple(ln.shape) == np.shape(exp_rows)[:-1]
    np.testing.assert_array_equal(e.weight.detach()[ln].numpy(), exp_rows)
    np.testing.assert_array_equal(e.weight.detach()[lp].numpy(), W0.numpy()[[0, 1]])


@pytest.mark.parametrize(
    "case",
    BOOL_IDS + FLOAT_IDS + OTHER_IDS[:7] + [(c[0], c[1]) for c in RANGE_IDS],
    ids=[c[0] for c in BOOL_IDS + FLOAT_IDS + OTHER_IDS[:7] + RANGE_IDS],
)
def test_switcher_refuses_bad_ids_and_keeps_variable(case):
    e, sw = _switch()
    to = torch.optim.SGD(e.parameters(), lr=1.0)
    of = gl.OptimizerFactory(to, ROWS, 3, torch.nn.ModuleDict({"e": e}), "e", placement="cpu")
    of.optInit()
    local = sw.beforeForwardPass(np.array([4, 7, 4], np.uint16))
    of.beforeForwardPass(np.array([4, 7, 4], np.uint16))
    w = e.weight.detach().clone()
    with pytest.raises(gl.GadgetError) as ei:
        sw.beforeForwardPass(case[1]())
    assert isinstance(ei.value, (TypeError, IndexError))
    assert torch.equal(e.weight.detach(), w)
    with pytest.raises(gl.GadgetError):
        of.beforeForwardPass(case[1]())
    # the step under way is unchanged: finishing it trains rows 4 and 7 only
    e(local).sum().backward()
    to.step()
    sw.afterOptimizerStep(torch.tensor([4, 7, 4], dtype=torch.uint8))
    of.afterOptimizerStep([4, 7, 4])
    exp = W0.clone()
    exp[4] -= 2.0
    exp[7] -= 1.0
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), exp, rtol=0, atol=0)


def test_switcher_after_step_refuses_other_ids_and_writes_nothing():
    e, sw = _switch()
    sw.beforeForwardPass([5, 9, 5])
    with torch.no_grad():
        e.weight.add_(100.0)
    with pytest.raises(gl.GadgetValueError):
        sw.afterOptimizerStep([5, 9, 6])
    np.testing.assert_array_equal(sw.getNumpyVersion(), W0.numpy())
