"""Black-box review (session 28) of ``DataGadget`` on a CPU-only machine.

Written from README.md, SPEC.md and the public docstrings only.
"""

import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(scope="module", autouse=True)
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


ROWS, DIM = 12, 4
PLACEMENTS = ["cpu", "pinned", "cuda", "file"]


def _ref():
    return np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) * 0.5 - 3.0


def _make(placement, tmp_path, ref=None, **kw):
    ref = _ref() if ref is None else ref
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if placement == "file":
            path = tmp_path / "t.npy"
            np.save(path, ref)
            return gl.DataGadget(str(path), placement="file", **kw)
        return gl.DataGadget(ref, placement=placement, **kw)


def _full(g):
    return np.array(g.getNumpyVersion(), copy=True)


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_gpu_placements_fall_back_to_cpu(placement):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = gl.DataGadget((5, 3), dtype="float32", placement=placement)
    assert g.placement == "cpu"
    out = g.getData([0, 4])
    assert out.device.type == "cpu"
    assert torch.equal(out, torch.zeros(2, 3))


@pytest.mark.parametrize("pin", [True, False, 1, 0])
def test_cpupinn_falls_back_to_cpu(pin):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = gl.DataGadget(_ref(), CPUPinn=pin)
    assert g.placement == "cpu"
    assert g.device == torch.device("cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), _ref())


def test_cpupinn_string_is_type_error():
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(_ref(), CPUPinn="False")


def test_shape_source_zero_filled():
    g = gl.DataGadget((7, 2, 3), dtype="float64", placement="cpu")
    assert g.shape == (7, 2, 3)
    assert g.dtype == torch.float64
    assert len(g) == 7
    assert g.nbytes == 7 * 6 * 8
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((7, 2, 3)))


def test_shape_source_default_dtype_float32():
    g = gl.DataGadget((3, 2), placement="cpu")
    assert g.dtype == torch.float32


@pytest.mark.parametrize("kind", ["numpy", "tensor", "list", "npy", "npy_file"])
def test_sources(kind, tmp_path):
    ref = _ref()
    if kind == "numpy":
        g = gl.DataGadget(ref, placement="cpu")
    elif kind == "tensor":
        g = gl.DataGadget(torch.from_numpy(ref), placement="cpu")
    elif kind == "list":
        g = gl.DataGadget(ref.tolist(), placement="cpu", dtype="float32")
    else:
        p = tmp_path / "x.npy"
        np.save(p, ref)
        g = gl.DataGadget(p, placement="file" if kind == "npy_file" else "cpu")
    assert g.shape == ref.shape
    assert g.dtype == torch.float32
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_source_is_copied_in():
    a = _ref()
    t = torch.from_numpy(_ref().copy()).requires_grad_(True)
    ga = gl.DataGadget(a, placement="cpu")
    gt = gl.DataGadget(t, placement="cpu")
    a[:] = 99
    with torch.no_grad():
        t.fill_(99)
    np.testing.assert_array_equal(ga.getNumpyVersion(), _ref())
    np.testing.assert_array_equal(gt.getNumpyVersion(), _ref())
    assert not gt.getData([0]).requires_grad


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
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        (np.float64, torch.float64),
        (np.dtype("int16"), torch.int16),
        (torch.uint8, torch.uint8),
    ],
)
def test_dtype_names(name, expected):
    g = gl.DataGadget((2, 2), dtype=name, placement="cpu")
    assert g.dtype == expected


def test_dtype_cast_rules():
    g = gl.DataGadget(np.ones((2, 2)), dtype="float32", placement="cpu")
    assert g.dtype == torch.float32
    g = gl.DataGadget(np.arange(4, dtype=np.int64).reshape(2, 2), dtype="float32", placement="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), [[0, 1], [2, 3]])
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.ones((2, 2)), dtype="int64", placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.array([[300, 1]]), dtype="int8", placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.array([[1e300, 1.0]]), dtype="float32", placement="cpu")


def test_bad_construction_args():
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.DataGadget(None)
    assert "shape" in str(ei.value)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget((2, 2), placement="gpu")
    for p in ("cpu", "cuda", "file", "pinned"):
        assert p in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(b"x.npy")
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.DataGadget("/nonexistent/definitely_not_here.npy", placement="cpu")


# ---------------------------------------------------------------- getData ids

INT_NP = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
INT_TORCH = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dt", INT_NP, ids=lambda d: np.dtype(d).name)
def test_getdata_numpy_int_dtypes(placement, dt, tmp_path):
    g = _make(placement, tmp_path)
    ids = np.array([[3, 0, 11], [3, 3, 7]], dtype=dt)
    out = g.getData(ids)
    assert tuple(out.shape) == (2, 3, DIM)
    np.testing.assert_array_equal(out.numpy(), _ref()[ids.astype(np.int64)])


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dt", INT_TORCH, ids=str)
def test_getdata_torch_int_dtypes(placement, dt, tmp_path):
    g = _make(placement, tmp_path)
    ids = torch.tensor([5, 1, 5, 11, 0], dtype=dt)
    out = g.getData(ids)
    np.testing.assert_array_equal(out.numpy(), _ref()[ids.long().numpy()])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_getdata_other_id_forms(placement, tmp_path):
    g = _make(placement, tmp_path)
    ref = _ref()
    np.testing.assert_array_equal(g.getData([2, 2, 9]).numpy(), ref[[2, 2, 9]])
    np.testing.assert_array_equal(g.getData((2, 9)).numpy(), ref[[2, 9]])
    np.testing.assert_array_equal(g.getData(range(3, 8, 2)).numpy(), ref[3:8:2])
    np.testing.assert_array_equal(g.getData(slice(1, 10, 3)).numpy(), ref[1:10:3])
    np.testing.assert_array_equal(g.getData(slice(None)).numpy(), ref)
    r = g.getData(4)
    assert tuple(r.shape) == (DIM,)
    np.testing.assert_array_equal(r.numpy(), ref[4])
    r = g.getData(np.array(6, dtype=np.int16))
    assert tuple(r.shape) == (DIM,)
    np.testing.assert_array_equal(r.numpy(), ref[6])
    r = g.getData(torch.tensor(7))
    assert tuple(r.shape) == (DIM,)
    np.testing.assert_array_equal(r.numpy(), ref[7])
    np.testing.assert_array_equal(g.getData(np.int32(8)).numpy(), ref[8])
    for empty in ([], np.array([], dtype=np.int64), torch.empty(0, dtype=torch.long)):
        r = g.getData(empty)
        assert tuple(r.shape) == (0, DIM)
    r = g.getData(np.empty((2, 0), dtype=np.int32))
    assert tuple(r.shape) == (2, 0, DIM)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_getitem_forms(placement, tmp_path):
    g = _make(placement, tmp_path)
    ref = _ref()
    np.testing.assert_array_equal(g[2:5].numpy(), ref[2:5])
    np.testing.assert_array_equal(g[[1, 4]].numpy(), ref[[1, 4]])
    np.testing.assert_array_equal(g[[1, 4], 0].numpy(), ref[[1, 4], 0])
    np.testing.assert_array_equal(g[np.array([1, 4]), 1:3].numpy(), ref[[1, 4], 1:3])
    np.testing.assert_array_equal(g.getData((slice(0, 6), slice(0, 3))).numpy(), ref[0:6, 0:3])
    np.testing.assert_array_equal(g[torch.tensor([3, 3]), ::2].numpy(), ref[[3, 3], ::2])
    np.testing.assert_array_equal(g[5].numpy(), ref[5])


def test_tuple_of_id_lists_refused():
    g = gl.DataGadget(_ref(), placement="cpu")
    before = _full(g)
    with pytest.raises(gl.GadgetTypeError):
        g[[1, 2], [0, 1]]
    with pytest.raises(gl.GadgetTypeError):
        g[[1, 2], [0, 1]] = torch.zeros(2)
    np.testing.assert_array_equal(_full(g), before)


def test_row_slice_bad_step_refused():
    g = gl.DataGadget(_ref(), placement="cpu")
    with pytest.raises(gl.GadgetError):
        g[[1, 2], ::-1]
    with pytest.raises(gl.GadgetError):
        g[[1, 2], 0.5:2]


# ---------------------------------------------------------------- insertData


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_insert_repeated_last_wins(placement, tmp_path):
    g = _make(placement, tmp_path)
    ref = _ref()
    ids = np.array([3, 5, 3, 0, 5, 3])
    rows = np.arange(len(ids) * DIM, dtype=np.float32).reshape(-1, DIM) + 100
    for form in (ids.tolist(), ids, torch.from_numpy(ids), ids.astype(np.uint8)):
        g.insertData(torch.from_numpy(rows), form)
        exp = ref.copy()
        for i, r in zip(ids, rows, strict=True):  # sequential assignment: last wins
            exp[i] = r
        np.testing.assert_array_equal(_full(g), exp)
    # 2-D ids, last occurrence in row-major order wins
    ids2 = np.array([[1, 2], [1, 1]])
    rows2 = np.arange(4 * DIM, dtype=np.float32).reshape(2, 2, DIM) - 50
    g.insertData(rows2, ids2)
    exp[1] = rows2[1, 1]
    exp[2] = rows2[0, 1]
    np.testing.assert_array_equal(_full(g), exp)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_insert_id_forms_and_setitem(placement, tmp_path):
    g = _make(placement, tmp_path)
    exp = _ref()
    g.insertData(torch.full((DIM,), 7.0), 4)
    exp[4] = 7
    g.insertData(torch.full((DIM,), 8.0), np.array(5, dtype=np.int8))
    exp[5] = 8
    g.insertData(torch.full((2, DIM), 9.0), range(6, 8))
    exp[6:8] = 9
    g.insertData(np.full((3, DIM), 10.0, np.float32), slice(8, 11))
    exp[8:11] = 10
    g.insertData(torch.empty(0, DIM), [])
    g[0:2] = torch.full((2, DIM), 11.0)
    exp[0:2] = 11
    g[[2, 3], 1:3] = torch.full((2, 2), 12.0)
    exp[[2, 3], 1:3] = 12
    g[[9, 11], 0] = torch.tensor([13.0, 14.0])
    exp[[9, 11], 0] = [13, 14]
    g.insertData(torch.full((2, 2), 15.0), (slice(0, 2), slice(2, 4)))
    exp[0:2, 2:4] = 15
    g.scatter(torch.tensor([1]), torch.full((1, DIM), 16.0))
    exp[1] = 16
    np.testing.assert_array_equal(_full(g), exp)


def test_insert_tuple_index_repeated_rows_last_wins():
    g = gl.DataGadget(_ref(), placement="cpu")
    exp = _ref()
    g[[4, 4], 0] = torch.tensor([1.0, 2.0])
    exp[4, 0] = 2.0
    np.testing.assert_array_equal(_full(g), exp)


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float64", "int64", "uint8", "bool"])
def test_dtype_roundtrip(dt):
    tdt = getattr(torch, dt)
    g = gl.DataGadget((6, 3), dtype=dt, placement="cpu")
    assert g.dtype == tdt
    rows = (torch.arange(6).reshape(2, 3) % 2).to(tdt)
    g.insertData(rows, [1, 4])
    got = g.getData([4, 1, 0])
    assert got.dtype == tdt
    assert torch.equal(got, torch.stack([rows[1], rows[0], torch.zeros(3, dtype=tdt)]))
    npv = g.getNumpyVersion()
    if dt == "bfloat16":
        assert npv.dtype == np.float32
    else:
        assert npv.dtype == np.dtype(dt)
    np.testing.assert_array_equal(npv[1].astype(np.float64), rows[0].double().numpy())


# ---------------------------------------------------------------- errors

BAD_IDS = [
    ("negative", [-1], gl.GadgetIndexError, IndexError),
    ("negative_np", np.array([0, -2]), gl.GadgetIndexError, IndexError),
    ("too_big", [ROWS], gl.GadgetIndexError, IndexError),
    ("too_big_tensor", torch.tensor([1, ROWS + 5]), gl.GadgetIndexError, IndexError),
    ("too_big_int", ROWS, gl.GadgetIndexError, IndexError),
    ("neg_int", -1, gl.GadgetIndexError, IndexError),
    ("float_list", [1.0], gl.GadgetTypeError, TypeError),
    ("float_np", np.array([1.0, 2.0]), gl.GadgetTypeError, TypeError),
    ("float_tensor", torch.tensor([1.0]), gl.GadgetTypeError, TypeError),
    ("float_scalar", 1.5, gl.GadgetTypeError, TypeError),
    ("bool_list", [True, False], gl.GadgetTypeError, TypeError),
    ("bool_tensor", torch.ones(ROWS, dtype=torch.bool), gl.GadgetTypeError, TypeError),
    ("bool_np", np.ones(ROWS, dtype=bool), gl.GadgetTypeError, TypeError),
    ("bool_scalar", True, gl.GadgetTypeError, TypeError),
    ("str", "3", gl.GadgetTypeError, TypeError),
]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name,ids,err,builtin", BAD_IDS, ids=[b[0] for b in BAD_IDS])
def test_bad_ids(placement, name, ids, err, builtin, tmp_path):
    g = _make(placement, tmp_path)
    before = _full(g)
    with pytest.raises(err) as ei:
        g.getData(ids)
    assert isinstance(ei.value, builtin) and isinstance(ei.value, gl.GadgetError)
    if err is gl.GadgetIndexError:
        msg = str(ei.value)
        assert str(ROWS) in msg or str(ROWS - 1) in msg  # what was expected
    with pytest.raises(err):
        g[ids]
    n = 1 if np.ndim(ids) == 0 else len(ids)
    shape = (DIM,) if np.ndim(ids) == 0 else (n, DIM)
    with pytest.raises(err):
        g.insertData(torch.full(shape, 77.0), ids)
    with pytest.raises(err):
        g[ids] = torch.full(shape, 77.0)
    np.testing.assert_array_equal(_full(g), before)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bad_id_among_good_writes_nothing(placement, tmp_path):
    g = _make(placement, tmp_path)
    before = _full(g)
    for ids in ([0, 1, 2, ROWS], [5, 5, -1], np.array([3, 100], dtype=np.uint8)):
        with pytest.raises(gl.GadgetIndexError) as ei:
            g.insertData(torch.full((len(ids), DIM), 55.0), ids)
        assert "nothing" in str(ei.value) or "range" in str(ei.value)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.full((len(ids), 2), 55.0), (ids, slice(0, 2)))
    np.testing.assert_array_equal(_full(g), before)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_insert_wrong_dtype(placement, tmp_path):
    g = _make(placement, tmp_path)
    before = _full(g)
    for data in (
        np.ones((2, DIM)),
        torch.ones(2, DIM, dtype=torch.float64),
        torch.ones(2, DIM, dtype=torch.int64),
        torch.ones(2, DIM, dtype=torch.float16),
    ):
        with pytest.raises(gl.GadgetTypeError) as ei:
            g.insertData(data, [1, 2])
        assert isinstance(ei.value, TypeError)
        msg = str(ei.value)
        assert "float32" in msg
        assert str(data.dtype).replace("torch.", "") in msg
    np.testing.assert_array_equal(_full(g), before)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_insert_wrong_shape(placement, tmp_path):
    g = _make(placement, tmp_path)
    before = _full(g)
    for data, ids in (
        (torch.ones(2, DIM + 1), [1, 2]),
        (torch.ones(3, DIM), [1, 2]),
        (torch.ones(DIM), [1, 2]),
        (torch.ones(2, DIM), 1),
        (torch.ones(2, 2, DIM), [1, 2]),
    ):
        with pytest.raises(gl.GadgetValueError) as ei:
            g.insertData(data, ids)
        assert isinstance(ei.value, ValueError)
        assert str(tuple(data.shape)) in str(ei.value)
    np.testing.assert_array_equal(_full(g), before)


def test_insert_wrong_device():
    g = gl.DataGadget(_ref(), placement="cpu")
    before = _full(g)
    with pytest.raises(gl.GadgetError) as ei:
        g.insertData(torch.ones(2, DIM, device="meta"), [1, 2])
    assert isinstance(ei.value, gl.GadgetTypeError)
    assert "meta" in str(ei.value)
    np.testing.assert_array_equal(_full(g), before)


def test_insert_non_array_data_refused():
    g = gl.DataGadget(_ref(), placement="cpu")
    before = _full(g)
    with pytest.raises(gl.GadgetTypeError):
        g.insertData("rows", [1])
    np.testing.assert_array_equal(_full(g), before)


# ---------------------------------------------------------------- out= / check_ids


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_out(placement, tmp_path):
    g = _make(placement, tmp_path)
    out = torch.empty(3, DIM)
    res = g.getData([4, 0, 4], out=out)
    np.testing.assert_array_equal(out.numpy(), _ref()[[4, 0, 4]])
    np.testing.assert_array_equal(res.numpy(), _ref()[[4, 0, 4]])
    with pytest.raises(gl.GadgetValueError) as ei:
        g.getData([1, 2], out=torch.empty(2, DIM + 1))
    assert str((2, DIM)) in str(ei.value) and str((2, DIM + 1)) in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.getData([1, 2], out=torch.empty(2, DIM, dtype=torch.float64))
    assert "float32" in str(ei.value) and "float64" in str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        g.getData([1, 2], out=torch.empty(DIM, 2).t())
    with pytest.raises(gl.GadgetError):
        g.getData((slice(0, 2), slice(0, 2)), out=torch.empty(2, 2))


def test_out_aliasing_table_bad_id_keeps_table():
    g = gl.DataGadget(_ref(), placement="cpu")
    view = g.as_tensor()
    before = _full(g)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([5, ROWS + 3], out=view[0:2])
    np.testing.assert_array_equal(_full(g), before)


def test_out_aliasing_table_good_ids():
    g = gl.DataGadget(_ref(), placement="cpu")
    view = g.as_tensor()
    g.getData([5, 6], out=view[0:2])
    exp = _ref()
    exp[0:2] = _ref()[5:7]
    np.testing.assert_array_equal(_full(g), exp)


@pytest.mark.parametrize("flag", [True, False, 1, 0])
def test_check_ids_flags(flag):
    g = gl.DataGadget(_ref(), placement="cpu")
    np.testing.assert_array_equal(g.getData([1, 3], check_ids=flag).numpy(), _ref()[[1, 3]])
    g.insertData(torch.zeros(1, DIM), [2], check_ids=flag)
    assert torch.equal(g.getData(2), torch.zeros(DIM))
    # CPU ids are always checked
    with pytest.raises(gl.GadgetIndexError):
        g.getData([ROWS], check_ids=flag)
    before = _full(g)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.ones(1, DIM), [ROWS], check_ids=flag)
    np.testing.assert_array_equal(_full(g), before)


@pytest.mark.parametrize("flag", ["False", "True", None, 2, 0.0])
def test_check_ids_bad_values(flag):
    g = gl.DataGadget(_ref(), placement="cpu")
    before = _full(g)
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1], check_ids=flag)
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.ones(1, DIM), [1], check_ids=flag)
    np.testing.assert_array_equal(_full(g), before)


# ---------------------------------------------------------------- initialisers


@pytest.mark.parametrize("placement", ["cpu", "pinned", "file"])
def test_initialisers(placement, tmp_path):
    g = _make(placement, tmp_path)
    assert g.zero_() is g
    np.testing.assert_array_equal(_full(g), 0)
    assert g.fill_(2.5) is g
    np.testing.assert_array_equal(_full(g), 2.5)
    assert g.uniform_(-2.0, 3.0) is g
    a = _full(g)
    assert a.min() >= -2.0 and a.max() <= 3.0 and a.std() > 0.5
    g.uniform_(torch.tensor(1.0), torch.tensor(1.0))
    np.testing.assert_array_equal(_full(g), 1.0)
    assert g.normal_(5.0, 0.0) is g
    np.testing.assert_array_equal(_full(g), 5.0)
    g.normal_(torch.tensor(0.0), torch.tensor(1.0))
    assert np.abs(_full(g)).max() > 0
    assert g.gadgetInit() is g


def test_normal_and_uniform_stats():
    g = gl.DataGadget((4000, 25), dtype="float64", placement="cpu")
    g.normal_(3.0, 2.0)
    a = _full(g)
    assert abs(a.mean() - 3.0) < 0.05 and abs(a.std() - 2.0) < 0.05
    g.uniform_(10.0, 12.0)
    a = _full(g)
    assert abs(a.mean() - 11.0) < 0.02 and a.min() >= 10.0 and a.max() <= 12.0


def test_generator_reproducible():
    g = gl.DataGadget((50, 4), placement="cpu")
    g.uniform_(0, 1, generator=torch.Generator().manual_seed(3))
    a = _full(g)
    g.uniform_(0, 1, generator=torch.Generator().manual_seed(3))
    np.testing.assert_array_equal(_full(g), a)
    g.normal_(0, 1, generator=torch.Generator().manual_seed(4))
    b = _full(g)
    g.normal_(0, 1, generator=torch.Generator().manual_seed(4))
    np.testing.assert_array_equal(_full(g), b)


@pytest.mark.parametrize("placement", ["cpu", "pinned"])
def test_init_fn(placement, tmp_path):
    g = _make(placement, tmp_path)
    torch.manual_seed(0)
    assert g.init_(torch.nn.init.xavier_uniform_) is g
    a = _full(g)
    bound = np.sqrt(6.0 / (ROWS + DIM))
    assert np.abs(a).max() <= bound + 1e-6 and a.std() > 0
    g.init_(torch.nn.init.constant_, 4.0)
    np.testing.assert_array_equal(_full(g), 4.0)
    g.init_(torch.nn.init.constant_, val=-1.0)
    np.testing.assert_array_equal(_full(g), -1.0)
    g.init_(torch.nn.init.orthogonal_)
    q = _full(g)
    np.testing.assert_allclose(q.T @ q, np.eye(DIM), atol=1e-5)


def test_init_fn_on_file_table(tmp_path):
    g = _make("file", tmp_path)
    g.init_(torch.nn.init.constant_, 3.0)
    np.testing.assert_array_equal(_full(g), 3.0)
    before = _full(g)
    with pytest.raises(gl.GadgetTypeError):
        g.init_(torch.nn.init.orthogonal_)
    np.testing.assert_array_equal(_full(g), before)


def test_torch_init_through_size_api():
    g = gl.DataGadget((ROWS, DIM), placement="cpu")
    torch.nn.init.xavier_uniform_(g)
    a = _full(g)
    assert a.std() > 0 and np.abs(a).max() <= np.sqrt(6.0 / (ROWS + DIM)) + 1e-6
    before = _full(g)
    with pytest.raises(gl.GadgetTypeError):
        torch.nn.init.trunc_normal_(g)
    np.testing.assert_array_equal(_full(g), before)


BAD_INITS = [
    ("uniform_low_gt_high", lambda g: g.uniform_(1.0, 0.0), gl.GadgetValueError),
    ("uniform_inf", lambda g: g.uniform_(0.0, float("inf")), gl.GadgetValueError),
    ("uniform_nan", lambda g: g.uniform_(float("nan"), 1.0), gl.GadgetValueError),
    ("uniform_big", lambda g: g.uniform_(0.0, 1e39), gl.GadgetValueError),
    ("uniform_span", lambda g: g.uniform_(-3e38, 3e38), gl.GadgetValueError),
    ("uniform_str", lambda g: g.uniform_("0", 1.0), gl.GadgetTypeError),
    ("uniform_1d", lambda g: g.uniform_(torch.zeros(2), 1.0), gl.GadgetError),
    ("normal_neg_std", lambda g: g.normal_(0.0, -1.0), gl.GadgetValueError),
    ("normal_nan_mean", lambda g: g.normal_(float("nan"), 1.0), gl.GadgetValueError),
    ("normal_inf_std", lambda g: g.normal_(0.0, float("inf")), gl.GadgetValueError),
    ("normal_big_mean", lambda g: g.normal_(1e39, 1.0), gl.GadgetValueError),
    ("normal_none", lambda g: g.normal_(None, 1.0), gl.GadgetTypeError),
    ("fill_overflow", lambda g: g.fill_(1e39), gl.GadgetValueError),
    ("fill_str", lambda g: g.fill_("1"), gl.GadgetTypeError),
    ("fill_none", lambda g: g.fill_(None), gl.GadgetTypeError),
    ("init_not_callable", lambda g: g.init_(3), gl.GadgetTypeError),
    ("init_none", lambda g: g.init_(None), gl.GadgetTypeError),
]


@pytest.mark.parametrize("name,call,err", BAD_INITS, ids=[b[0] for b in BAD_INITS])
def test_bad_initialiser_args(name, call, err):
    g = gl.DataGadget(_ref(), placement="cpu")
    before = _full(g)
    with pytest.raises(err):
        call(g)
    np.testing.assert_array_equal(_full(g), before)


def test_fill_float_special_values():
    g = gl.DataGadget((3, 2), placement="cpu")
    g.fill_(float("inf"))
    assert np.isposinf(_full(g)).all()
    g.fill_(float("nan"))
    assert np.isnan(_full(g)).all()
    g.fill_(3.4e38)
    assert np.isfinite(_full(g)).all()
    h = gl.DataGadget((3, 2), dtype="float16", placement="cpu")
    before = _full(h)
    with pytest.raises(gl.GadgetValueError):
        h.fill_(70000.0)
    np.testing.assert_array_equal(_full(h), before)
    with pytest.raises(gl.GadgetValueError):
        h.uniform_(-60000.0, 60000.0)  # high - low overflows float16
    np.testing.assert_array_equal(_full(h), before)
    h.fill_(0.1)
    assert _full(h)[0, 0] == np.float16(0.1)


@pytest.mark.parametrize(
    "dt,good,bad",
    [
        ("uint8", [0, 255, np.uint8(7)], [256, -1, 0.5, float("nan")]),
        ("int8", [-128, 127], [128, -129, 1.5]),
        ("int64", [2**63 - 1, -(2**63)], [2**63, 1.5, float("inf")]),
        ("bool", [True, False, 0, 1], [2, -1, 0.5]),
    ],
)
def test_fill_integer_and_bool(dt, good, bad):
    g = gl.DataGadget((3, 2), dtype=dt, placement="cpu")
    for v in good:
        g.fill_(v)
        assert (g.as_tensor() == torch.tensor(v, dtype=getattr(torch, dt))).all()
    before = _full(g)
    for v in bad:
        with pytest.raises((gl.GadgetValueError, gl.GadgetTypeError)):
            g.fill_(v)
        np.testing.assert_array_equal(_full(g), before)


@pytest.mark.parametrize("dt", ["int32", "uint8", "bool"])
def test_random_inits_refused_on_non_float(dt):
    g = gl.DataGadget((3, 2), dtype=dt, placement="cpu")
    g.fill_(1)
    before = _full(g)
    with pytest.raises(gl.GadgetError):
        g.uniform_(0.0, 1.0)
    with pytest.raises(gl.GadgetError):
        g.normal_(0.0, 1.0)
    np.testing.assert_array_equal(_full(g), before)


# ---------------------------------------------------------------- views and copies


def test_as_tensor_zero_copy():
    g = gl.DataGadget(_ref(), placement="cpu")
    t = g.as_tensor()
    assert tuple(t.shape) == (ROWS, DIM)
    t[3] = -9
    np.testing.assert_array_equal(g.getData(3).numpy(), np.full(DIM, -9.0))
    g.insertData(torch.full((1, DIM), 4.0), [0])
    assert (t[0] == 4).all()


def test_as_tensor_file_table_refused(tmp_path):
    g = _make("file", tmp_path)
    with pytest.raises(gl.GadgetTypeError):
        g.as_tensor()


def test_get_numpy_version_copy_semantics():
    g = gl.DataGadget(_ref(), placement="cpu")
    c = g.getNumpyVersion()
    c[:] = 0
    np.testing.assert_array_equal(g.getNumpyVersion(), _ref())
    v = g.getNumpyVersion(copy=False)
    v[1] = 42
    np.testing.assert_array_equal(g.getData(1).numpy(), np.full(DIM, 42.0))
    c = g.getNumpyVersion(copy=True)
    assert not np.shares_memory(c, v)
    v0 = g.getNumpyVersion(copy=0)
    assert np.shares_memory(v0, v)
    with pytest.raises(gl.GadgetTypeError):
        g.getNumpyVersion(copy="False")
    a = np.asarray(g)
    assert not np.shares_memory(a, v)
    np.testing.assert_array_equal(a, g.getNumpyVersion())
    assert np.shares_memory(np.asarray(g, copy=False), v)


def test_get_numpy_version_file_table(tmp_path):
    g = _make("file", tmp_path)
    np.testing.assert_array_equal(g.getNumpyVersion(), _ref())
    with pytest.raises(ValueError):
        np.asarray(g, copy=False)


def test_properties(tmp_path):
    g = _make("file", tmp_path)
    assert g.shape == (ROWS, DIM) and len(g) == ROWS and g.dtype == torch.float32
    assert g.placement == "file"
    assert g.nbytes == ROWS * DIM * 4
    h = gl.DataGadget((5, 2, 3), dtype="int16", placement="cpu")
    assert h.size() == torch.Size([5, 2, 3]) and h.size(1) == 2
    assert h.numel() == 30 and h.dim() == 3 and h.ndim == 3
    assert tuple(h.row_shape) == (2, 3)


# ---------------------------------------------------------------- close


@pytest.mark.parametrize("placement", ["cpu", "pinned", "file"])
def test_close_and_context_manager(placement, tmp_path):
    with _make(placement, tmp_path) as g:
        np.testing.assert_array_equal(g.getData([1]).numpy(), _ref()[[1]])
    calls = [
        lambda: g.getData([0]),
        lambda: g[0],
        lambda: g.insertData(torch.zeros(1, DIM), [0]),
        lambda: g.__setitem__(0, torch.zeros(DIM)),
        lambda: g.getNumpyVersion(),
        lambda: g.as_tensor(),
        lambda: g.zero_(),
        lambda: g.fill_(1.0),
        lambda: g.uniform_(),
        lambda: g.normal_(),
        lambda: g.init_(torch.nn.init.zeros_),
        lambda: g.gadgetInit(),
        lambda: g.flush(),
        lambda: g.load(str(tmp_path / "t.npy")),
        lambda: g.saveCupy(str(tmp_path / "o.npy")),
        lambda: np.asarray(g),
    ]
    for c in calls:
        with pytest.raises(gl.GadgetClosedError):
            c()
    assert g.shape == (ROWS, DIM)
    assert g.dtype == torch.float32
    assert len(g) == ROWS
    assert isinstance(repr(g), str) and len(repr(g)) > 0
    g.close()  # idempotent


def test_error_hierarchy():
    assert issubclass(gl.GadgetIndexError, IndexError)
    assert issubclass(gl.GadgetTypeError, TypeError)
    assert issubclass(gl.GadgetValueError, ValueError)
    assert issubclass(gl.GadgetKeyError, KeyError)
    for e in (gl.GadgetIndexError, gl.GadgetTypeError, gl.GadgetValueError, gl.GadgetClosedError):
        assert issubclass(e, gl.GadgetError)


# ---------------------------------------------------------------- more id edge cases


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_more_id_edge_cases(placement, tmp_path):
    g = _make(placement, tmp_path)
    ref = _ref()
    for dt in (torch.uint16, torch.uint32, torch.uint64):
        np.testing.assert_array_equal(
            g.getData(torch.tensor([1, 2], dtype=dt)).numpy(), ref[[1, 2]]
        )
    np.testing.assert_array_equal(g.getData(np.array([1, 2, 5])[::-1]).numpy(), ref[[5, 2, 1]])
    np.testing.assert_array_equal(g.getData(torch.arange(ROWS)[::3]).numpy(), ref[::3])
    ids2 = np.array([[1, 2], [3, 4]]).T
    np.testing.assert_array_equal(g.getData(ids2).numpy(), ref[ids2])
    np.testing.assert_array_equal(g.getData([[1, 2], [3, 4]]).numpy(), ref[[[1, 2], [3, 4]]])
    before = _full(g)
    for bad in (
        [2**70],
        2**70,
        np.array([2**64 - 1], dtype=np.uint64),
        range(ROWS - 2, ROWS + 2),
        range(-1, 2),
    ):
        with pytest.raises(gl.GadgetIndexError):
            g.getData(bad)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.ones(np.asarray(bad).shape + (DIM,)), bad)
    for bad in (slice(0.0, 5), [1, True]):
        with pytest.raises(gl.GadgetTypeError):
            g.getData(bad)
    with pytest.raises(gl.GadgetIndexError):
        g[[1, 2], DIM]
    with pytest.raises(gl.GadgetIndexError):
        g[[1, 2], 0, 0]
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1], device="meta")
    with pytest.raises(gl.GadgetValueError):
        g.insertData(torch.ones(5, DIM), slice(ROWS - 2, ROWS + 3))
    np.testing.assert_array_equal(_full(g), before)
    # non-contiguous data is accepted
    data = torch.arange(2 * DIM, dtype=torch.float32).reshape(DIM, 2).t()
    g.insertData(data, [1, 2])
    before[[1, 2]] = data.numpy()
    np.testing.assert_array_equal(_full(g), before)
