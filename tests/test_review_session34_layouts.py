"""Black-box review (session 34): memory layouts and input types.

Every public entry point that takes arrays / tensors is fed non-contiguous inputs
(transposed, stepped, negative-stride, Fortran-order, memmaps, read-only arrays,
0-stride expanded tensors, tensors with storage offsets, big-endian arrays) and id
objects of every accepted kind. Results are compared with a NumPy reference; bad
input must raise a clear ``GadgetError`` naming what was expected and what arrived,
and must leave the table unchanged. Returned tensors must not alias caller inputs
or the table unexpectedly.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


REF = np.arange(60, dtype=np.float32).reshape(10, 6)


def _g(src=None, **kw):
    kw.setdefault("placement", "cpu")
    kw.setdefault("device", "cpu")
    return gl.DataGadget(REF.copy() if src is None else src, **kw)


def _np_ids(ids):
    """The NumPy int64 reference for an id object."""
    if isinstance(ids, torch.Tensor):
        return ids.long().numpy()
    if isinstance(ids, range):
        return np.array(list(ids), dtype=np.int64)
    return np.asarray(ids).astype(np.int64)


def _readonly(a):
    a = np.array(a)
    a.setflags(write=False)
    return a


def _subprocess_env():
    env = os.environ.copy()
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# --------------------------------------------------------------------------------------
# Table creation from arrays / tensors of every layout
# --------------------------------------------------------------------------------------


def _sources(tmp_path):
    big = np.arange(120, dtype=np.float32).reshape(20, 6)
    mm = np.memmap(str(tmp_path / "src.dat"), dtype=np.float32, mode="w+", shape=(10, 6))
    mm[:] = REF
    mm.flush()
    np.save(tmp_path / "src.npy", REF)
    return {
        "np_fortran": np.asfortranarray(REF),
        "np_neg_rows": REF[::-1],
        "np_neg_cols": REF[:, ::-1],
        "np_stepped": big[::2],
        "np_transposed": np.ascontiguousarray(REF.T).T,
        "np_readonly": _readonly(REF),
        "np_memmap_rw": mm,
        "np_memmap_r_neg": np.load(tmp_path / "src.npy", mmap_mode="r")[::-1],
        "np_broadcast_0stride": np.broadcast_to(np.arange(6, dtype=np.float32), (10, 6)),
        "np_big_endian": REF.astype(">f4"),
        "t_transposed": torch.from_numpy(REF.T.copy()).t(),
        "t_stepped": torch.from_numpy(big)[::2],
        "t_storage_offset": torch.from_numpy(big)[7:17],
        "t_expanded": torch.arange(6, dtype=torch.float32).expand(10, 6),
        "t_requires_grad_T": torch.from_numpy(REF.T.copy()).requires_grad_(True).t(),
    }


SOURCE_NAMES = [
    "np_fortran",
    "np_neg_rows",
    "np_neg_cols",
    "np_stepped",
    "np_transposed",
    "np_readonly",
    "np_memmap_rw",
    "np_memmap_r_neg",
    "np_broadcast_0stride",
    "np_big_endian",
    "t_transposed",
    "t_stepped",
    "t_storage_offset",
    "t_expanded",
    "t_requires_grad_T",
]


def _as_np(src):
    if isinstance(src, torch.Tensor):
        return src.detach().numpy()
    return np.asarray(src)


@pytest.mark.parametrize("name", SOURCE_NAMES)
def test_create_table_from_layout_matches_numpy(tmp_path, name):
    src = _sources(tmp_path)[name]
    expected = _as_np(src).astype(np.float32)
    g = _g(src)
    assert g.shape == (10, 6)
    assert g.dtype == torch.float32
    np.testing.assert_array_equal(g.getNumpyVersion(), expected)
    # gathers by ids land on the right rows too
    np.testing.assert_array_equal(g.getData([9, 0, 4]).numpy(), expected[[9, 0, 4]])


@pytest.mark.parametrize(
    "name", ["np_fortran", "np_neg_rows", "np_memmap_rw", "t_transposed", "t_storage_offset"]
)
def test_create_copies_source_no_alias(tmp_path, name):
    src = _sources(tmp_path)[name]
    expected = _as_np(src).copy()
    g = _g(src)
    # mutate the caller's buffer after the table was built
    if isinstance(src, torch.Tensor):
        src.fill_(-123.0)
    else:
        src[...] = -123.0
    np.testing.assert_array_equal(g.getNumpyVersion(), expected)


def test_create_other_dtypes_from_noncontiguous():
    src = np.asfortranarray(np.linspace(0, 1, 60).reshape(10, 6))
    g = _g(src, dtype="float32")
    np.testing.assert_array_equal(g.getNumpyVersion(), src.astype(np.float32))

    src = torch.arange(60).reshape(6, 10).t()
    g = _g(src, dtype=torch.float32)
    np.testing.assert_array_equal(g.getNumpyVersion(), src.numpy().astype(np.float32))

    src = torch.randn(6, 10).to(torch.bfloat16).t()
    g = _g(src)
    assert g.dtype == torch.bfloat16
    assert torch.equal(g.getData(range(10)), src)

    src = (np.arange(60).reshape(10, 6) % 3 == 0)[::-1]
    g = _g(src)
    assert g.dtype == torch.bool
    np.testing.assert_array_equal(g.getNumpyVersion(), src)

    src = np.arange(60, dtype=np.uint16).reshape(6, 10).T
    g = _g(src, dtype="int32")
    np.testing.assert_array_equal(g.getNumpyVersion(), src.astype(np.int32))

    src = np.arange(60, dtype=np.float16).reshape(10, 6)[:, ::-1]
    g = _g(src)
    assert g.dtype == torch.float16
    np.testing.assert_array_equal(g.getNumpyVersion(), src)

    x = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    g = _g(x)
    assert torch.equal(torch.from_numpy(g.getNumpyVersion()), x)

    g = _g(np.arange(10)[::-1])
    assert g.shape == (10,)
    assert g.getData([0, 9]).tolist() == [9, 0]


def test_create_refuses_unusable_sources_clearly():
    sp = torch.tensor([[1.0, 0, 0], [0, 0, 2.0]]).to_sparse()
    with pytest.raises(gl.GadgetTypeError, match="dense"):
        _g(sp)
    with pytest.raises(gl.GadgetTypeError, match="complex64"):
        _g(torch.zeros(3, 2, dtype=torch.complex64))
    with pytest.raises(gl.GadgetValueError, match="0-d"):
        _g(np.array(5.0))
    with pytest.raises(gl.GadgetTypeError, match="memoryview"):
        _g(memoryview(REF))


# --------------------------------------------------------------------------------------
# getData with ids of every kind
# --------------------------------------------------------------------------------------


def _id_kinds(tmp_path):
    mi = np.memmap(str(tmp_path / "ids.dat"), dtype=np.int64, mode="w+", shape=(3,))
    mi[:] = [9, 0, 4]
    return {
        "np_neg_stride": np.array([1, 3, 5, 7])[::-1],
        "np_stepped": np.arange(10)[::3],
        "np_fortran_2d": np.asfortranarray(np.array([[1, 2], [3, 4]])),
        "np_readonly": _readonly([2, 4]),
        "np_memmap": mi,
        "np_big_endian": np.array([3, 1], dtype=">i8"),
        "np_int32": np.array([7, 1], np.int32),
        "np_int16": np.array([7, 1], np.int16),
        "np_uint8": np.array([7, 1], np.uint8),
        "np_uint16": np.array([7, 1], np.uint16),
        "np_uint32": np.array([7, 1], np.uint32),
        "np_uint64": np.array([7, 1], np.uint64),
        "np_intc": np.array([3], np.intc),
        "np_0d": np.array(3),
        "np_scalar_int64": np.int64(4),
        "np_scalar_int32": np.int32(4),
        "np_scalar_uint8": np.uint8(4),
        "t_transposed": torch.tensor([[1, 2], [3, 4]]).t(),
        "t_stepped": torch.arange(10)[::4],
        "t_expanded": torch.tensor([3]).expand(4),
        "t_storage_offset": torch.arange(10)[5:8],
        "t_flipped": torch.arange(10).flip(0),
        "t_int32": torch.tensor([1, 2], dtype=torch.int32),
        "t_int16": torch.tensor([1, 2], dtype=torch.int16),
        "t_int8": torch.tensor([1, 2], dtype=torch.int8),
        "t_uint8": torch.tensor([1, 2], dtype=torch.uint8),
        "t_0d": torch.tensor(3),
        "t_0d_offset": torch.tensor([8, 3])[1],
        "int": 4,
        "list": [1, 2],
        "nested_list": [[1, 2], [3, 4]],
        "list_of_np_ints": [np.int32(3), np.uint8(1), np.int64(9)],
        "list_of_0d_tensors": [torch.tensor(3), torch.tensor(1)],
        "tuple": (1, 2),
        "tuple_of_np_ints": (np.int16(3), np.int64(1)),
        "range": range(2, 8, 2),
        "range_neg_step": range(9, -1, -2),
        "empty_list": [],
        "empty_tensor": torch.empty(0, dtype=torch.long),
        "empty_expanded": torch.tensor([1]).expand(0),
    }


ID_NAMES = [
    "np_neg_stride",
    "np_stepped",
    "np_fortran_2d",
    "np_readonly",
    "np_memmap",
    "np_big_endian",
    "np_int32",
    "np_int16",
    "np_uint8",
    "np_uint16",
    "np_uint32",
    "np_uint64",
    "np_intc",
    "np_0d",
    "np_scalar_int64",
    "np_scalar_int32",
    "np_scalar_uint8",
    "t_transposed",
    "t_stepped",
    "t_expanded",
    "t_storage_offset",
    "t_flipped",
    "t_int32",
    "t_int16",
    "t_int8",
    "t_uint8",
    "t_0d",
    "t_0d_offset",
    "int",
    "list",
    "nested_list",
    "list_of_np_ints",
    "list_of_0d_tensors",
    "tuple",
    "tuple_of_np_ints",
    "range",
    "range_neg_step",
    "empty_list",
    "empty_tensor",
    "empty_expanded",
]


@pytest.mark.parametrize("name", ID_NAMES)
def test_getData_id_kinds_match_numpy(tmp_path, name):
    ids = _id_kinds(tmp_path)[name]
    ref_ids = _np_ids(ids)
    g = _g()
    out = g.getData(ids)
    expected = REF[ref_ids]
    assert tuple(out.shape) == expected.shape
    np.testing.assert_array_equal(out.numpy(), expected)
    # indexing form agrees
    if not isinstance(ids, tuple):
        np.testing.assert_array_equal(g[ids].numpy(), expected)


@pytest.mark.parametrize(
    "name",
    [
        "np_neg_stride",
        "t_transposed",
        "t_expanded",
        "range",
        "tuple",
        "np_scalar_int64",
        "t_uint8",
        "np_big_endian",
    ],
)
@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_file_table_id_kinds_match_numpy(tmp_path, name, fmt):
    if fmt == "h5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    p = str(tmp_path / f"t.{fmt}")
    _g().save(p)
    ids = _id_kinds(tmp_path)[name]
    with gl.DataGadget(p, placement="file", device="cpu") as g:
        np.testing.assert_array_equal(g.getData(ids).numpy(), REF[_np_ids(ids)])


@pytest.mark.parametrize(
    "kind", ["slice", "int", "list", "range", "tuple_index", "np_0d", "getitem_slice"]
)
def test_getData_result_does_not_alias_table(kind):
    g = _g()
    ids = {
        "slice": slice(0, 3),
        "int": 2,
        "list": [1],
        "range": range(0, 3),
        "tuple_index": (slice(0, 3), slice(0, 2)),
        "np_0d": np.array(2),
    }.get(kind)
    r = g[0:3] if kind == "getitem_slice" else g.getData(ids)
    r.fill_(-7)
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
@pytest.mark.parametrize("writable", [True, False])
def test_file_getData_result_does_not_alias_file(tmp_path, fmt, writable):
    if fmt == "h5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    p = str(tmp_path / f"t.{fmt}")
    _g().save(p)
    with gl.DataGadget(p, placement="file", device="cpu", writable=writable) as g:
        for ids in (slice(2, 5), 3, [1, 2], range(0, 4), (slice(0, 3), slice(0, 2))):
            g.getData(ids).fill_(-9)
        a = g.getNumpyVersion(copy=False)
        a[...] = -1  # a copy for a file table: must not reach it
        np.testing.assert_array_equal(g.getNumpyVersion(), REF)
    np.testing.assert_array_equal(np.asarray(gl.DataGadget(p, placement="cpu", device="cpu")), REF)


def test_numpy_views_and_copies():
    g = _g()
    for a in (g.getNumpyVersion(), np.asarray(g), np.array(g), g.numpy()):
        a[0] = -1
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)
    v = g.getNumpyVersion(copy=False)  # documented view of a host table
    v[1] = -2
    assert g.getData(1).tolist() == [-2.0] * 6


# --------------------------------------------------------------------------------------
# insertData / setitem with non-contiguous data and ids
# --------------------------------------------------------------------------------------

_BIG = torch.arange(200, dtype=torch.float32).reshape(20, 10)

DATA_KINDS = {
    "t_transposed": lambda: torch.arange(18, dtype=torch.float32).reshape(6, 3).t(),
    "t_stepped": lambda: _BIG[::7, :6],
    "t_storage_offset": lambda: _BIG[5:8, 2:8],
    "t_expanded": lambda: torch.arange(6, dtype=torch.float32).expand(3, 6),
    "t_channels_like_odd_strides": lambda: (
        torch.arange(18, dtype=torch.float32).reshape(3, 6, 1).permute(0, 2, 1)[:, 0]
    ),
    "t_requires_grad": lambda: (
        torch.arange(18, dtype=torch.float32).reshape(3, 6).requires_grad_(True)
    ),
    "np_fortran": lambda: np.asfortranarray(np.arange(18, dtype=np.float32).reshape(3, 6)),
    "np_neg_rows": lambda: np.arange(18, dtype=np.float32).reshape(3, 6)[::-1],
    "np_neg_cols": lambda: np.arange(18, dtype=np.float32).reshape(3, 6)[:, ::-1],
    "np_readonly": lambda: _readonly(np.arange(18, dtype=np.float32).reshape(3, 6)),
    "np_big_endian": lambda: np.arange(18, dtype=np.float32).reshape(3, 6).astype(">f4"),
    "np_broadcast": lambda: np.broadcast_to(np.arange(6, dtype=np.float32), (3, 6)),
    "np_overlapping_rows": lambda: np.lib.stride_tricks.as_strided(
        np.arange(20, dtype=np.float32), shape=(3, 6), strides=(8, 4)
    ),
}

IDS3 = {
    "list": [7, 1, 4],
    "np_neg_stride": np.array([4, 1, 7])[::-1],
    "t_stepped": torch.tensor([7, 0, 1, 0, 4])[::2],
    "range_desc": range(7, 0, -3),
    "tuple": (7, 1, 4),
    "np_int32": np.array([7, 1, 4], np.int32),
    "t_uint8": torch.tensor([7, 1, 4], dtype=torch.uint8),
    "np_readonly": _readonly([7, 1, 4]),
}


@pytest.mark.parametrize("ids_name", list(IDS3))
@pytest.mark.parametrize("data_name", list(DATA_KINDS))
def test_insertData_noncontiguous_lands_in_right_rows(data_name, ids_name):
    data = DATA_KINDS[data_name]()
    ids = IDS3[ids_name]
    g = _g()
    expected = REF.copy()
    expected[_np_ids(ids)] = _as_np(data).astype(np.float32)
    g.insertData(data, ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), expected)


NO_ALIAS_DATA = {
    "t_transposed": lambda: torch.arange(18, dtype=torch.float32).reshape(6, 3).t(),
    "t_storage_offset": lambda: torch.arange(60, dtype=torch.float32).reshape(10, 6)[4:7],
    "np_fortran": lambda: np.asfortranarray(np.arange(18, dtype=np.float32).reshape(3, 6)),
    "np_neg_rows": lambda: np.arange(18, dtype=np.float32).reshape(3, 6)[::-1],
}


@pytest.mark.parametrize("data_name", list(NO_ALIAS_DATA))
def test_insertData_copies_data_no_alias(data_name):
    data = NO_ALIAS_DATA[data_name]()
    ids = torch.tensor([2, 5, 8])
    g = _g()
    g.insertData(data, ids)
    snapshot = g.getNumpyVersion()
    np.testing.assert_array_equal(snapshot[[2, 5, 8]], _as_np(data))
    if isinstance(data, torch.Tensor):
        data.fill_(-55.0)
    else:
        data[...] = -55.0
    ids.fill_(0)
    np.testing.assert_array_equal(g.getNumpyVersion(), snapshot)


def test_setitem_and_scatter_noncontiguous():
    g = _g()
    exp = REF.copy()
    g[torch.tensor([0, 9, 1])[::2]] = torch.ones(6).expand(2, 6)
    exp[[0, 1]] = 1
    g.scatter(np.array([5, 3])[::-1], torch.arange(12, dtype=torch.float32).reshape(6, 2).t())
    exp[[3, 5]] = np.arange(12, dtype=np.float32).reshape(6, 2).T
    g[np.int32(2)] = np.full(6, 5, np.float32)[::-1]
    exp[2] = 5
    g.insertData(torch.arange(12, dtype=torch.float32)[::2], 7)
    exp[7] = np.arange(12, dtype=np.float32)[::2]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)


def test_insertData_overlapping_with_table_itself():
    # source is a view of the table: NumPy semantics (the right-hand side is read first)
    g = _g()
    g.insertData(g.as_tensor()[0:3], [1, 2, 3])
    exp = REF.copy()
    exp[[1, 2, 3]] = REF[0:3]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)

    g = _g()
    g.insertData(g.getNumpyVersion(copy=False)[::-1], range(10))
    np.testing.assert_array_equal(g.getNumpyVersion(), REF[::-1])

    g = _g()
    g.insertData(g.as_tensor()[::2], [1, 3, 5, 7, 9])
    exp = REF.copy()
    exp[[1, 3, 5, 7, 9]] = REF[::2]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)

    g = _g()
    g[[2, 3]] = g[[3, 2]]
    exp = REF.copy()
    exp[[2, 3]] = REF[[3, 2]]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)

    g = _g()
    g.insertData(g.as_tensor()[4:7, 0:3], (slice(5, 8), slice(1, 4)))
    exp = REF.copy()
    exp[5:8, 1:4] = REF[4:7, 0:3]
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)


def test_partial_writes_and_reads_with_noncontiguous_pieces():
    g = _g()
    exp = REF.copy()
    d = torch.arange(6, dtype=torch.float32).reshape(3, 2).t() + 100  # (2, 3), transposed
    ids = np.array([7, 2])[::-1]
    g.insertData(d, (ids, slice(0, 3)))
    exp[ids, 0:3] = d.numpy()
    d2 = np.asfortranarray(np.full((4, 3), 5, np.float32) * np.arange(3, dtype=np.float32))
    g.insertData(d2, (slice(1, 9, 2), slice(0, 6, 2)))
    exp[1:9:2, 0:6:2] = d2
    d3 = torch.tensor([9.0, 8.0]).flip(0)
    g[[4, 5], -1] = d3
    exp[[4, 5], -1] = d3.numpy()
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)
    ids2d = torch.tensor([[3, 1], [0, 2]]).t()
    np.testing.assert_array_equal(
        g.getData((ids2d, slice(1, 5, 2))).numpy(), exp[ids2d.numpy()][:, :, 1:5:2]
    )


def test_three_d_table_noncontiguous_rows():
    ref3 = np.arange(10 * 3 * 4, dtype=np.float64).reshape(10, 3, 4)
    g = _g(np.asfortranarray(ref3))
    exp = ref3.copy()
    d = torch.arange(24, dtype=torch.float64).reshape(2, 4, 3).transpose(1, 2)
    g.insertData(d, [8, 1])
    exp[[8, 1]] = d.numpy()
    d = np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::-1, ::-1]
    g.insertData(d, torch.tensor([2, 5], dtype=torch.int16))
    exp[[2, 5]] = d
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)
    np.testing.assert_array_equal(
        g.getData(torch.tensor([[9, 2]]).t()).numpy(), exp[np.array([[9], [2]])]
    )


def test_zero_sized_noncontiguous_inputs():
    g = _g()
    g.insertData(torch.empty(6, 0).t(), torch.empty(0, dtype=torch.long))
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)
    assert g.getData(torch.tensor([1]).expand(0)).shape == (0, 6)
    g0 = _g(np.zeros((10, 0), np.float32))
    assert tuple(g0.getData(np.array([1, 2])[::-1]).shape) == (2, 0)
    g0.insertData(torch.empty(0, 2).t(), [3, 4])
    assert g0.shape == (10, 0)


# --------------------------------------------------------------------------------------
# Errors with non-contiguous inputs: clear message, table unchanged
# --------------------------------------------------------------------------------------

BAD_WRITES = {
    "transposed_wrong_shape": (
        lambda: torch.zeros(3, 6).t(),
        [1, 2, 3],
        gl.GadgetValueError,
        r"\(3, 6\).*\(6, 3\)",
    ),
    "fortran_float64": (
        lambda: np.asfortranarray(np.zeros((3, 6))),
        [1, 2, 3],
        gl.GadgetTypeError,
        r"float32.*float64",
    ),
    "expanded_too_few_rows": (
        lambda: torch.zeros(1, 6).expand(2, 6),
        [1, 2, 3],
        gl.GadgetValueError,
        r"\(3, 6\).*\(2, 6\)",
    ),
    "scalar_not_broadcast": (lambda: torch.tensor(1.0), [1], gl.GadgetValueError, r"\(1, 6\)"),
    "negative_id_in_negstride": (
        lambda: torch.zeros(3, 6),
        np.array([1, -2, 3])[::-1],
        gl.GadgetIndexError,
        r"-2",
    ),
    "oob_id_in_expanded": (
        lambda: torch.zeros(3, 6),
        torch.tensor([10]).expand(3),
        gl.GadgetIndexError,
        r"10",
    ),
    "float_ids_transposed": (
        lambda: torch.zeros(2, 2, 6),
        torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t(),
        gl.GadgetTypeError,
        r"integer",
    ),
    "bool_ids": (
        lambda: torch.zeros(2, 6),
        torch.tensor([True, False]),
        gl.GadgetTypeError,
        r"nonzero",
    ),
    "np_float_scalar_id": (lambda: torch.zeros(6), np.float64(2.0), gl.GadgetTypeError, r"float64"),
    "np_bool_scalar_id": (lambda: torch.zeros(6), np.bool_(True), gl.GadgetTypeError, r"bool"),
    "python_bool_id": (lambda: torch.zeros(6), True, gl.GadgetTypeError, r"bool"),
    "object_ids": (
        lambda: torch.zeros(2, 6),
        np.array([1, None], dtype=object),
        gl.GadgetTypeError,
        r"object",
    ),
    "list_with_np_float": (
        lambda: torch.zeros(2, 6),
        [1, np.float32(2)],
        gl.GadgetTypeError,
        r"float",
    ),
    "sparse_data": (
        lambda: torch.tensor([[1.0, 0, 0, 0, 0, 0], [0, 0, 2.0, 0, 0, 0]]).to_sparse(),
        [1, 2],
        gl.GadgetTypeError,
        r"dense",
    ),
    "sparse_ids": (
        lambda: torch.zeros(1, 2, 6),
        torch.tensor([[0, 1]]).to_sparse(),
        gl.GadgetTypeError,
        r"dense",
    ),
    "meta_ids": (
        lambda: torch.zeros(2, 6),
        torch.empty(2, dtype=torch.long, device="meta"),
        gl.GadgetTypeError,
        r"meta",
    ),
    "float_list_data": (lambda: REF[:2].tolist(), [1, 2], gl.GadgetTypeError, r"float32.*float64"),
    "ragged_ids": (lambda: torch.zeros(3, 6), [[1, 2], [3]], gl.GadgetTypeError, r"ragged"),
    "array_array_ids": (
        lambda: torch.zeros(2, 6),
        __import__("array").array("q", [1, 2]),
        gl.GadgetTypeError,
        r"array",
    ),
}


@pytest.mark.parametrize("name", list(BAD_WRITES))
def test_bad_insert_is_clear_and_leaves_table_unchanged(name):
    make, ids, exc, pattern = BAD_WRITES[name]
    g = _g()
    with pytest.raises(exc, match=pattern) as ei:
        g.insertData(make(), ids)
    assert isinstance(ei.value, gl.GadgetError)
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)


@pytest.mark.parametrize(
    "name",
    [
        "negative_id_in_negstride",
        "oob_id_in_expanded",
        "float_ids_transposed",
        "bool_ids",
        "np_float_scalar_id",
        "np_bool_scalar_id",
        "python_bool_id",
        "object_ids",
        "sparse_ids",
        "meta_ids",
        "ragged_ids",
    ],
)
def test_bad_ids_in_getData_are_clear(name):
    _, ids, exc, pattern = BAD_WRITES[name]
    g = _g()
    with pytest.raises(exc, match=pattern):
        g.getData(ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)


def test_uint64_ids_beyond_int64_are_index_errors():
    g = _g()
    with pytest.raises(gl.GadgetIndexError):
        g.getData(np.array([2**63 + 5], np.uint64))
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.zeros(1, 6), np.array([2**63 + 5], np.uint64))
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)


# --------------------------------------------------------------------------------------
# out=
# --------------------------------------------------------------------------------------


def test_out_with_storage_offset_fills_only_its_rows():
    g = _g()
    base = torch.full((10, 6), -1.0)
    r = g.getData([3, 1, 8], out=base[2:5])
    assert r.data_ptr() == base[2:5].data_ptr()
    np.testing.assert_array_equal(base[2:5].numpy(), REF[[3, 1, 8]])
    assert (base[:2] == -1).all() and (base[5:] == -1).all()


def test_out_size_one_dims_with_odd_strides_are_contiguous_enough():
    g = _g(REF.reshape(10, 1, 6).copy())
    o = torch.empty(2, 6, 1).permute(0, 2, 1)
    assert o.is_contiguous()
    r = g.getData([3, 5], out=o)
    np.testing.assert_array_equal(r.numpy(), REF.reshape(10, 1, 6)[[3, 5]])


@pytest.mark.parametrize(
    "kind", ["transposed", "stepped", "expanded", "col_slice", "channels_last"]
)
def test_out_noncontiguous_refused_clearly_and_untouched(kind):
    if kind == "channels_last":
        g = _g(np.arange(10 * 3 * 2 * 2, dtype=np.float32).reshape(10, 3, 2, 2))
        ids = [1, 2]
        o = torch.full((2, 3, 2, 2), -4.0).to(memory_format=torch.channels_last)
    else:
        g = _g()
        ids = [3, 1, 8]
        o = {
            "transposed": torch.full((6, 3), -4.0).t(),
            "stepped": torch.full((6, 6), -4.0)[::2],
            "expanded": torch.full((1, 6), -4.0).expand(3, 6),
            "col_slice": torch.full((3, 12), -4.0)[:, :6],
        }[kind]
    before = g.getNumpyVersion()
    with pytest.raises(gl.GadgetValueError, match="contiguous"):
        g.getData(ids, out=o)
    assert (o == -4.0).all()
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


def test_out_wrong_kind_refused_clearly():
    g = _g()
    with pytest.raises(gl.GadgetTypeError, match=r"float32.*float64"):
        g.getData([1, 2], out=torch.empty(2, 6, dtype=torch.float64))
    with pytest.raises(gl.GadgetTypeError, match="ndarray"):
        g.getData([1, 2], out=np.empty((2, 6), np.float32))
    with pytest.raises(gl.GadgetValueError, match=r"\(2, 6\).*\(12,\)"):
        g.getData([1, 2], out=torch.empty(12))
    with pytest.raises(gl.GadgetValueError, match="grad"):
        g.getData([1, 2], out=torch.empty(2, 6, requires_grad=True))


def test_out_that_is_part_of_the_table():
    g = _g()
    t = g.as_tensor()
    r = g.getData([5, 0, 9], out=t[0:3])
    np.testing.assert_array_equal(r.numpy(), REF[[5, 0, 9]])
    g = _g()
    t = g.as_tensor()
    r = g.getData([2, 0, 1], out=t[1:4])
    np.testing.assert_array_equal(r.numpy(), REF[[2, 0, 1]])
    g = _g()
    t = g.as_tensor()
    with pytest.raises(gl.GadgetIndexError, match="10"):
        g.getData([5, 10], out=t[0:2])
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_out_aliasing_the_ids(tmp_path, placement):
    lab = np.arange(100, 110, dtype=np.int64)[::-1].copy()
    p = str(tmp_path / "l.npy")
    np.save(p, lab)
    with gl.DataGadget(p, placement=placement, device="cpu") as g:
        ids = torch.tensor([0, 9, 3, 3, 1, 2, 5, 7, 8])
        exp = lab[ids.numpy()].copy()
        r = g.getData(ids, out=ids)
        assert r is ids
        np.testing.assert_array_equal(r.numpy(), exp)
        buf = torch.tensor([0, 1, 2, 3, 4, 5])
        r = g.getData(buf[0:4], out=buf[2:6])
        np.testing.assert_array_equal(r.numpy(), lab[[0, 1, 2, 3]])


# --------------------------------------------------------------------------------------
# gather_many / scatter_many
# --------------------------------------------------------------------------------------


def test_gather_scatter_many_noncontiguous():
    g, h = _g(), _g(REF * 2)
    r = gl.gather_many([g, h], np.array([9, 0, 4])[::-1])
    np.testing.assert_array_equal(r[0].numpy(), REF[[4, 0, 9]])
    np.testing.assert_array_equal(r[1].numpy(), 2 * REF[[4, 0, 9]])
    a = torch.arange(12, dtype=torch.float32).reshape(6, 2).t()
    b = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(2, 6))[::-1]
    gl.scatter_many([g, h], [a, b], torch.tensor([8, 0, 1])[::2])
    e1, e2 = REF.copy(), 2 * REF
    e1[[8, 1]] = a.numpy()
    e2[[8, 1]] = b
    np.testing.assert_array_equal(g.getNumpyVersion(), e1)
    np.testing.assert_array_equal(h.getNumpyVersion(), e2)
    r = gl.gather_many([g, h], slice(8, 2, -2))
    np.testing.assert_array_equal(r[0].numpy(), e1[8:2:-2])


def test_scatter_many_bad_noncontiguous_piece_writes_nothing():
    g, h = _g(), _g()
    with pytest.raises(gl.GadgetValueError, match=r"\(2, 6\).*\(1, 6\)"):
        gl.scatter_many([g, h], [torch.zeros(2, 6), torch.zeros(6, 2).t()[:1]], [1, 2])
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)
    np.testing.assert_array_equal(h.getNumpyVersion(), REF)


# --------------------------------------------------------------------------------------
# Initialisers with view scalars
# --------------------------------------------------------------------------------------


def test_initialisers_take_view_scalars():
    g = _g((5, 3))
    g.fill_(torch.tensor([1.0, 2.5])[1])
    assert (g.getNumpyVersion() == 2.5).all()
    g.fill_(torch.tensor([7.0]).expand(1))
    assert (g.getNumpyVersion() == 7.0).all()
    g.fill_(np.array([1.0, 4.0])[::-1][:1])
    assert (g.getNumpyVersion() == 4.0).all()
    with pytest.raises(gl.GadgetTypeError, match=r"\(2,\)"):
        g.fill_(torch.tensor([1.0, 2.0]))
    assert (g.getNumpyVersion() == 4.0).all()
    g.uniform_(torch.tensor([0.0, 5.0])[1], torch.tensor([6.0, 0.0])[0])
    a = g.getNumpyVersion()
    assert a.min() >= 5 and a.max() <= 6
    g.normal_(torch.tensor([0.0, 100.0])[1], torch.tensor([1.0, 0.0])[1])
    assert (g.getNumpyVersion() == 100.0).all()


# --------------------------------------------------------------------------------------
# Files: non-contiguous writes, Fortran / big-endian / F-order sources, saves
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_file_table_noncontiguous_writes_land_and_persist(tmp_path, fmt):
    if fmt == "h5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    p = str(tmp_path / f"t.{fmt}")
    _g().save(p)
    exp = REF.copy()
    with gl.DataGadget(p, placement="file", device="cpu") as g:
        data = torch.arange(18, dtype=torch.float32).reshape(6, 3).t() + 100
        ids = np.array([8, 2, 5])[::-1]
        g.insertData(data, ids)
        exp[ids] = data.numpy()
        data2 = np.asfortranarray(np.full((2, 6), 7, np.float32) + np.arange(6, dtype=np.float32))
        g.insertData(data2, torch.tensor([0, 9, 1, 9])[::2])
        exp[[0, 1]] = data2
        data3 = torch.arange(6, dtype=torch.float32).expand(2, 6) * -1
        g.insertData(data3, range(3, 5))
        exp[[3, 4]] = data3.numpy()
        d4 = torch.tensor([9.0, 8.0, 7.0]).flip(0)
        g.insertData(d4, (np.array([6, 7, 9])[::-1], 1))
        exp[[9, 7, 6], 1] = d4.numpy()
        np.testing.assert_array_equal(g.getNumpyVersion(), exp)
        o = torch.empty(12, 6)[3:6]
        g.getData([9, 0, 5], out=o)
        np.testing.assert_array_equal(o.numpy(), exp[[9, 0, 5]])
    np.testing.assert_array_equal(
        gl.DataGadget(p, placement="cpu", device="cpu").getNumpyVersion(), exp
    )


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
@pytest.mark.parametrize(
    "src_name", ["np_fortran", "np_neg_rows", "t_transposed", "t_expanded", "np_big_endian"]
)
def test_save_from_noncontiguous_source_roundtrips(tmp_path, fmt, src_name):
    if fmt == "h5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    src = _sources(tmp_path)[src_name]
    p = str(tmp_path / f"out.{fmt}")
    _g(src).save(p)
    back = gl.DataGadget(p, placement="cpu", device="cpu").getNumpyVersion()
    np.testing.assert_array_equal(back, _as_np(src).astype(np.float32))


def test_fortran_npy_file_reads_right_and_refuses_writes(tmp_path):
    p = str(tmp_path / "f.npy")
    np.save(p, np.asfortranarray(REF))
    np.testing.assert_array_equal(
        gl.DataGadget(p, placement="cpu", device="cpu").getNumpyVersion(), REF
    )
    with open(p, "rb") as fh:
        raw = fh.read()
    with gl.DataGadget(p, placement="file", device="cpu") as g:
        np.testing.assert_array_equal(g.getNumpyVersion(), REF)
        np.testing.assert_array_equal(g.getData([9, 0, 3]).numpy(), REF[[9, 0, 3]])
        np.testing.assert_array_equal(g[2:5].numpy(), REF[2:5])
        np.testing.assert_array_equal(g.getData((slice(1, 4), 2)).numpy(), REF[1:4, 2])
        with pytest.raises(gl.ReadOnlyError, match="Fortran"):
            g.insertData(torch.zeros(1, 6), [0])
    with open(p, "rb") as fh:
        assert fh.read() == raw
    g = _g((10, 6))
    g.load(p)
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)
    g = _g((10, 6))
    g.loadCupy(p)
    np.testing.assert_array_equal(g.getNumpyVersion(), REF)
    ref3 = np.arange(120, dtype=np.int32).reshape(5, 4, 6)
    p3 = str(tmp_path / "f3.npy")
    np.save(p3, np.asfortranarray(ref3))
    with gl.DataGadget(p3, placement="file", device="cpu") as g3:
        np.testing.assert_array_equal(g3.getData([4, 1]).numpy(), ref3[[4, 1]])
    np.testing.assert_array_equal(
        gl.DataGadget(p3, placement="cpu", device="cpu").getNumpyVersion(), ref3
    )


def test_big_endian_npy_and_hdf5_files(tmp_path):
    p = str(tmp_path / "be.npy")
    np.save(p, REF.astype(">f4"))
    np.testing.assert_array_equal(
        gl.DataGadget(p, placement="cpu", device="cpu").getNumpyVersion(), REF
    )
    with gl.DataGadget(p, placement="file", device="cpu") as g:
        np.testing.assert_array_equal(g.getData([9, 2]).numpy(), REF[[9, 2]])
        g.insertData(np.full((1, 6), 3, np.float32), [4])
    on_disk = np.load(p)
    exp = REF.copy()
    exp[4] = 3
    np.testing.assert_array_equal(on_disk, exp)
    h5py = pytest.importorskip("h5py")
    hp = str(tmp_path / "be.h5")
    with h5py.File(hp, "w") as f:
        f.create_dataset("data", data=REF.astype(">f4"), chunks=(3, 6))
    with gl.DataGadget(hp, placement="file", device="cpu") as g:
        np.testing.assert_array_equal(g.getData([9, 1]).numpy(), REF[[9, 1]])
        g.insertData(np.asfortranarray(np.full((2, 6), 3, np.float32)), np.array([5, 0])[::-1])
    exp = REF.copy()
    exp[[0, 5]] = 3
    with h5py.File(hp, "r") as f:
        np.testing.assert_array_equal(f["data"][:], exp)


def test_zarr_v2_fortran_order_array(tmp_path):
    zarr = pytest.importorskip("zarr")
    zp = str(tmp_path / "f.zarr")
    try:
        z = zarr.open_array(
            zp, mode="w", shape=(10, 6), chunks=(3, 4), dtype="f4", order="F", zarr_format=2
        )
    except TypeError:
        pytest.skip("this zarr cannot write a v2 F-order array")
    z[:] = REF
    np.testing.assert_array_equal(
        gl.DataGadget(zp, placement="cpu", device="cpu").getNumpyVersion(), REF
    )
    exp = REF.copy()
    with gl.DataGadget(zp, placement="file", device="cpu") as g:
        np.testing.assert_array_equal(g.getData(np.array([9, 0, 4])[::-1]).numpy(), REF[[4, 0, 9]])
        data = torch.arange(12, dtype=torch.float32).reshape(6, 2).t() + 100
        g.insertData(data, [2, 7])
        exp[[2, 7]] = data.numpy()
    np.testing.assert_array_equal(zarr.open_array(zp, mode="r")[:], exp)


# --------------------------------------------------------------------------------------
# GadgetDataset columns
# --------------------------------------------------------------------------------------


def _ds_parts():
    X = np.arange(80, dtype=np.float32).reshape(8, 10).T.copy()
    y = np.arange(20)[::2][::-1]
    w = torch.arange(30, dtype=torch.float64).reshape(3, 10).t()
    return X, y, w


DS_IDS = {
    "list": [3, 1],
    "np_neg": np.array([1, 3, 5])[::-1],
    "t_transposed": torch.tensor([[1, 2], [3, 9]]).t(),
    "range": range(9, 0, -3),
    "tuple": (1, 0),
    "t_0d": torch.tensor(4),
    "slice_neg": slice(None, None, -3),
    "t_expanded": torch.tensor([7]).expand(3),
    "t_uint8": torch.tensor([0, 9], dtype=torch.uint8),
    "np_int32": np.array([2, 3], np.int32),
    "np_big_endian": np.array([1, 2], ">i8"),
    "np_readonly": _readonly([4, 4, 0]),
}


@pytest.mark.parametrize("name", list(DS_IDS))
def test_dataset_noncontiguous_columns_and_id_kinds(name):
    X, y, w = _ds_parts()
    ds = gl.GadgetDataset(np.asfortranarray(X), y, w, placement="cpu", device="cpu")
    ids = DS_IDS[name]
    b = ds[ids]
    assert isinstance(b, gl.GadgetBatch)
    ii = np.arange(10)[ids] if isinstance(ids, slice) else _np_ids(ids)
    np.testing.assert_array_equal(b[0].numpy(), X[ii])
    np.testing.assert_array_equal(b[1].numpy(), y[ii])
    np.testing.assert_array_equal(b[2].numpy(), w.numpy()[ii])


def test_dataset_single_rows_and_scalar_ids():
    X, y, w = _ds_parts()
    ds = gl.GadgetDataset(X[:, ::-1], y, placement="cpu", device="cpu")
    for i in (np.int64(-1), -2, np.int32(3)):
        row = ds[i]
        np.testing.assert_array_equal(row[0].numpy(), X[:, ::-1][int(i)])
        assert int(row[1]) == y[int(i)]


def test_dataset_copies_sources_and_batches_do_not_alias():
    X, y, w = _ds_parts()
    Xf = np.asfortranarray(X)
    t = torch.arange(20.0)[::2]
    ds = gl.GadgetDataset(Xf, t, placement="cpu", device="cpu")
    Xf[...] = -1
    t.zero_()
    b = ds[[3, 0]]
    np.testing.assert_array_equal(b[0].numpy(), X[[3, 0]])
    assert b[1].tolist() == [6.0, 0.0]
    b[0].fill_(-5)
    ds[0:3][0].fill_(-5)
    ds[2][0].fill_(-5)
    np.testing.assert_array_equal(ds.columns[0].getNumpyVersion(), X)
    np.testing.assert_array_equal(ds.gather(np.array([5, 6, 7])[::-1])[0].numpy(), X[[7, 6, 5]])


def test_dataset_bad_noncontiguous_ids_are_clear():
    X, y, w = _ds_parts()
    ds = gl.GadgetDataset(X, y, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetIndexError, match="-1"):
        ds[[1, -1]]
    with pytest.raises(gl.GadgetIndexError, match="10"):
        ds[torch.tensor([[1, 2], [3, 10]]).t()]
    with pytest.raises(gl.GadgetTypeError, match="float64"):
        ds[np.array([1.0, 2.0])[::-1]]


def test_dataset_file_column_and_loaders(tmp_path):
    from torch.utils.data import DataLoader

    X, y, w = _ds_parts()
    p = str(tmp_path / "x.npy")
    np.save(p, np.asfortranarray(X))
    ds = gl.GadgetDataset(p, y, placement="file", device="cpu")
    try:
        assert [c.placement for c in ds.columns] == ["file", "cpu"]
        b = ds[np.array([1, 4, 9])[::-1]]
        np.testing.assert_array_equal(b[0].numpy(), X[[9, 4, 1]])
        np.testing.assert_array_equal(b[1].numpy(), y[[9, 4, 1]])
        xs, ys = [], []
        for bx, by in DataLoader(ds, batch_size=4, shuffle=False):
            xs.append(bx)
            ys.append(by)
        np.testing.assert_array_equal(torch.cat(xs).numpy(), X)
        np.testing.assert_array_equal(torch.cat(ys).numpy(), y)
        loader = gl.GadgetLoader(ds, batch_size=3, order="sequential", prefetch=0)
        got = [(bx.clone(), by.clone()) for bx, by in loader]
        np.testing.assert_array_equal(torch.cat([a for a, _ in got]).numpy(), X)
        np.testing.assert_array_equal(torch.cat([b for _, b in got]).numpy(), y)
    finally:
        ds.close()


# --------------------------------------------------------------------------------------
# OffloadedEmbedding / OffloadedEmbeddingBag inputs
# --------------------------------------------------------------------------------------

EMB_INPUTS = {
    "t_transposed": torch.tensor([[1, 2, 3], [4, 5, 11]]).t(),
    "t_stepped": torch.arange(12)[::3],
    "t_expanded": torch.tensor([[5]]).expand(3, 4),
    "t_storage_offset": torch.arange(12)[7:10],
    "t_flipped": torch.arange(12).flip(0),
    "t_int32": torch.tensor([1, 2], dtype=torch.int32),
    "t_int16": torch.tensor([1, 2], dtype=torch.int16),
    "t_uint8": torch.tensor([1, 2], dtype=torch.uint8),
    "t_0d": torch.tensor(3),
    "np_neg": np.array([1, 5, 7])[::-1],
    "np_fortran": np.asfortranarray(np.array([[1, 2], [3, 4]])),
    "np_readonly": _readonly([0, 11]),
    "np_big_endian": np.array([1, 2], ">i8"),
    "list": [1, 2, 3],
    "tuple": (1, 2),
    "range": range(3),
    "int": 3,
    "np_scalar": np.int64(3),
}


@pytest.mark.parametrize("name", list(EMB_INPUTS))
def test_embedding_forward_input_kinds_match_F_embedding(name):
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
    W = torch.from_numpy(emb.weight.getNumpyVersion())
    inp = EMB_INPUTS[name]
    with torch.no_grad():
        out = emb(inp)
    ref = F.embedding(torch.from_numpy(_np_ids(inp)), W)
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


def test_embedding_bad_inputs_are_clear():
    emb = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
    with torch.no_grad():
        with pytest.raises(gl.GadgetIndexError, match="-1"):
            emb(torch.tensor([1, -1]).flip(0))
        with pytest.raises(gl.GadgetIndexError, match="12"):
            emb(torch.tensor([12]).expand(2))
        with pytest.raises(gl.GadgetTypeError, match="float32"):
            emb(torch.tensor([1.0, 2.0]))
        with pytest.raises(gl.GadgetTypeError, match="nonzero"):
            emb(torch.tensor([True]))


def _emb_pair():
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
    dense = torch.nn.Embedding(12, 4)
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(emb.weight.getNumpyVersion()))
    return emb, dense


@pytest.mark.parametrize("name", ["transposed", "expanded", "stepped", "int32_flipped"])
def test_embedding_training_with_noncontiguous_ids_matches_dense(name):
    ids = {
        "transposed": torch.tensor([[1, 2, 3], [4, 1, 11]]).t(),
        "expanded": torch.tensor([[5, 2]]).expand(3, 2),
        "stepped": torch.arange(12)[::5],
        "int32_flipped": torch.tensor([3, 3, 0], dtype=torch.int32).flip(0),
    }[name]
    emb, dense = _emb_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    dopt = torch.optim.SGD(dense.parameters(), lr=0.5)
    torch.manual_seed(1)
    tgt = torch.randn(*ids.shape, 4)
    for _ in range(2):
        opt.zero_grad()
        ((emb(ids) - tgt) ** 2).sum().backward()
        opt.step()
        dopt.zero_grad()
        ((dense(ids.long()) - tgt) ** 2).sum().backward()
        dopt.step()
    assert torch.equal(torch.from_numpy(emb.weight.getNumpyVersion()), dense.weight.detach())


def test_embedding_ids_mutated_after_forward_update_the_looked_up_rows():
    emb, _ = _emb_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    ids = torch.tensor([1, 2])
    before = emb.weight.getNumpyVersion()
    out = emb(ids)
    ids[:] = torch.tensor([7, 8])  # the caller reuses its buffer
    out.sum().backward()
    opt.step()
    after = emb.weight.getNumpyVersion()
    assert np.nonzero((after != before).any(1))[0].tolist() == [1, 2]
    np.testing.assert_allclose(after[[1, 2]], before[[1, 2]] - 0.5)


def test_embedding_outputs_do_not_alias_table():
    emb, _ = _emb_pair()
    before = emb.weight.getNumpyVersion()
    with torch.no_grad():
        emb(torch.tensor([1, 2])).fill_(99)
    o = emb(torch.tensor([1, 2]))
    with torch.no_grad():
        o.fill_(99)
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)
    sd = emb.state_dict()
    sd["weight"].fill_(5)
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)


def test_embedding_bag_noncontiguous_inputs_match_torch():
    torch.manual_seed(0)
    bag = gl.OffloadedEmbeddingBag(12, 4, mode="sum", placement="cpu", device="cpu")
    W = torch.from_numpy(bag.weight.getNumpyVersion())
    flat = torch.arange(12).flip(0)
    offs = torch.tensor([0, 9, 3, 9, 7, 9])[::2]
    psw = torch.arange(24, dtype=torch.float32).reshape(2, 12).t()[:, 0]
    inp2 = torch.tensor([[1, 2, 3], [4, 5, 11]]).t()
    with torch.no_grad():
        assert torch.equal(bag(inp2), F.embedding_bag(inp2.contiguous(), W, mode="sum"))
        assert torch.equal(bag(inp2.int()), F.embedding_bag(inp2.contiguous(), W, mode="sum"))
        assert torch.equal(bag(flat, offs), F.embedding_bag(flat, W, offs.contiguous(), mode="sum"))
        assert torch.equal(
            bag(flat, offs, psw),
            F.embedding_bag(
                flat, W, offs.contiguous(), mode="sum", per_sample_weights=psw.contiguous()
            ),
        )
        offs32 = torch.tensor([0, 3, 7], dtype=torch.int32).flip(0).flip(0)
        assert torch.equal(bag(flat, offs32), F.embedding_bag(flat, W, offs32.long(), mode="sum"))
        e = torch.tensor([[5]]).expand(2, 3)
        assert torch.equal(bag(e), F.embedding_bag(e.contiguous(), W, mode="sum"))
        assert torch.equal(
            bag(np.array([[1, 2], [3, 4]])[::-1]),
            F.embedding_bag(torch.tensor([[3, 4], [1, 2]]), W, mode="sum"),
        )
        with pytest.raises(gl.GadgetTypeError, match="int16"):
            bag(flat, torch.tensor([0, 3], dtype=torch.int16))
        with pytest.raises(gl.GadgetValueError, match=r"\(12,\).*\(5,\)"):
            bag(flat, offs, psw[:5])


# --------------------------------------------------------------------------------------
# load_state_dict with arrays / tensors of every layout ("also takes a NumPy array")
# --------------------------------------------------------------------------------------

_W = np.arange(48, dtype=np.float32).reshape(12, 4)

LSD_SOURCES = {
    "t_transposed": lambda: torch.from_numpy(_W.T.copy()).t(),
    "t_expanded": lambda: torch.arange(4, dtype=torch.float32).expand(12, 4),
    "t_storage_offset": lambda: torch.from_numpy(np.concatenate([_W, _W]))[12:],
    "np_fortran": lambda: np.asfortranarray(_W),
    "np_float64": lambda: _W.astype(np.float64),
    "np_neg_rows": lambda: _W[::-1],
    "np_neg_cols": lambda: _W[:, ::-1],
    "np_big_endian": lambda: _W.astype(">f4"),
    "np_broadcast": lambda: np.broadcast_to(np.arange(4, dtype=np.float32), (12, 4)).copy()[::-1][
        ::-1
    ],
}


@pytest.mark.parametrize("cls", ["embedding", "bag"])
@pytest.mark.parametrize("name", list(LSD_SOURCES))
def test_embedding_load_state_dict_any_layout(cls, name):
    if cls == "embedding":
        emb = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
    else:
        emb = gl.OffloadedEmbeddingBag(12, 4, mode="sum", placement="cpu", device="cpu")
    W = LSD_SOURCES[name]()
    expected = _as_np(W).astype(np.float32).copy()
    emb.load_state_dict({"weight": W})
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), expected)
    # the load copied: changing the caller's array later does not reach the table
    if isinstance(W, torch.Tensor):
        if W.stride(0) != 0:
            W.fill_(-1)
    elif W.flags.writeable:
        W[...] = -1
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), expected)


def test_embedding_load_state_dict_bad_layouts_are_clear_and_change_nothing():
    emb = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
    before = emb.weight.getNumpyVersion()
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict"):
        emb.load_state_dict({"weight": torch.zeros(4, 12).t()[:, :3]})
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict"):
        emb.load_state_dict({"weight": _W.astype(np.int64)})
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)


def test_embedding_load_state_dict_readonly_numpy_warns_nothing():
    # a read-only array (e.g. np.load(mmap_mode='r')) is data to copy in: no torch
    # "non-writable" UserWarning may escape. Fresh process: torch warns only once per process.
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import numpy as np, gadgetloader as gl\n"
        "W = np.arange(48, dtype=np.float32).reshape(12, 4); W.setflags(write=False)\n"
        "e = gl.OffloadedEmbedding(12, 4, placement='cpu', device='cpu')\n"
        "e.load_state_dict({'weight': W})\n"
        "assert (e.weight.getNumpyVersion() == W).all()\n"
        "print('OK')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_subprocess_env(),
        timeout=120,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-1500:]


def test_readonly_inputs_warn_nothing_across_entry_points():
    # the other entry points copy read-only arrays in without torch's warning
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import numpy as np, torch, gadgetloader as gl\n"
        "def ro(a):\n a = np.array(a); a.setflags(write=False); return a\n"
        "X = ro(np.arange(60, dtype=np.float32).reshape(10, 6))\n"
        "g = gl.DataGadget(X, placement='cpu', device='cpu')\n"
        "assert (g.getData(ro([1, 2])).numpy() == X[[1, 2]]).all()\n"
        "assert (g.getData(ro(3)).numpy() == X[3]).all()\n"
        "g.insertData(ro(X[[5, 6]] * 2), ro([1, 2]))\n"
        "assert (g.getData([1, 2]).numpy() == X[[5, 6]] * 2).all()\n"
        "g[ro([3, 4]), 0:3] = ro(X[[0, 1], 0:3])\n"
        "h = gl.DataGadget(X, placement='cpu', device='cpu')\n"
        "gl.scatter_many([g, h], [ro(X[:2]), ro(X[:2])], ro([8, 9]))\n"
        "gl.gather_many([g, h], ro([8, 9]))\n"
        "ds = gl.GadgetDataset(X, ro(np.arange(10)), placement='cpu', device='cpu')\n"
        "b = ds[ro([1, 2])]; assert b[1].tolist() == [1, 2]\n"
        "e = gl.OffloadedEmbedding(10, 6, placement='cpu', device='cpu'); e(ro([1, 2]))\n"
        "m = torch.nn.Embedding(3, 6); s = gl.ModelSwitch(m, 10, 6, placement='cpu'); s.beforeForwardPass(ro([1, 2]))\n"
        "g.fill_(ro([2.0]))\n"
        "print('OK')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_subprocess_env(),
        timeout=120,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-1500:]


# --------------------------------------------------------------------------------------
# OffloadedOptimizer state dicts
# --------------------------------------------------------------------------------------


def _adam():
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    return emb, opt


def test_optimizer_state_dict_noncontiguous_load_and_no_alias():
    emb, opt = _adam()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    ea = sd["tables"][0]["exp_avg"].clone()
    eas = sd["tables"][0]["exp_avg_sq"].clone()
    sd["tables"][0]["exp_avg"].fill_(123.0)  # returned state does not alias the tables
    assert torch.equal(opt.state_dict()["tables"][0]["exp_avg"], ea)

    emb2, opt2 = _adam()
    sdn = copy.deepcopy(opt.state_dict())
    sdn["tables"][0]["exp_avg"] = ea.t().contiguous().t()
    sdn["tables"][0]["exp_avg_sq"] = torch.cat([torch.zeros(3, 4), eas])[3:]
    opt2.load_state_dict(sdn)
    s = opt2.state_dict()["tables"][0]
    assert torch.equal(s["exp_avg"], ea) and torch.equal(s["exp_avg_sq"], eas)
    sdn["tables"][0]["exp_avg"].fill_(7.0)  # the load copied
    assert torch.equal(opt2.state_dict()["tables"][0]["exp_avg"], ea)

    emb3, opt3 = _adam()
    bad = copy.deepcopy(opt.state_dict())
    bad["tables"][0]["exp_avg"] = torch.zeros(4, 10).t()[:, :3]
    with pytest.raises(gl.GadgetValueError, match=r"\(10, 4\).*\(10, 3\)"):
        opt3.load_state_dict(bad)
    assert torch.equal(opt3.state_dict()["tables"][0]["exp_avg"], torch.zeros(10, 4))


# --------------------------------------------------------------------------------------
# Switchers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["transposed", "np_neg", "expanded", "int32_stepped"])
def test_switchers_noncontiguous_ids_page_right_rows(name):
    ids = {
        "transposed": torch.tensor([[1, 2, 3], [4, 1, 11]]).t(),
        "np_neg": np.array([7, 3, 3, 0])[::-1],
        "expanded": torch.tensor([9]).expand(3),
        "int32_stepped": torch.arange(12, dtype=torch.int32)[::5],
    }[name]
    torch.manual_seed(0)
    m = torch.nn.Embedding(5, 4)
    sw = gl.ModelSwitch(m, 12, 4, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    osw = gl.OptimizerSwitch(opt, 12, 4, m, "weight", placement="cpu")
    osw.optInit()
    T0 = sw.getNumpyVersion().copy()
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    gids = _np_ids(ids)
    np.testing.assert_array_equal(m(local).detach().numpy(), T0[gids])
    opt.zero_grad()
    m(local).sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)
    exp = T0.copy()
    np.add.at(exp, gids.reshape(-1), -0.5)
    np.testing.assert_allclose(sw.getNumpyVersion(), exp, rtol=0, atol=1e-6)


def test_switcher_loadTorch_of_tensor_views(tmp_path):
    m = torch.nn.Embedding(3, 4)
    sw = gl.ModelSwitch(m, 10, 4, placement="cpu")
    big = torch.arange(200, dtype=torch.float32).reshape(50, 4)
    views = {
        "offset": big[5:15],
        "transposed": torch.arange(40, dtype=torch.float32).reshape(4, 10).t(),
        "stepped": big[::5],
        "expanded": torch.arange(4.0).expand(10, 4),
        "f64_transposed": torch.arange(40, dtype=torch.float64).reshape(4, 10).t(),
    }
    for k, v in views.items():
        p = str(tmp_path / f"{k}.pt")
        torch.save(v, p)
        sw.loadTorch(p)
        np.testing.assert_array_equal(sw.getNumpyVersion(), v.numpy().astype(np.float32), err_msg=k)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    osw = gl.OptimizerSwitch(opt, 10, 4, m, "weight", placement="cpu")
    osw.optInit()
    ea = torch.arange(40, dtype=torch.float32).reshape(4, 10).t()
    eas = big[10:20]
    p = str(tmp_path / "st.pt")
    torch.save({"exp_avg": ea, "exp_avg_sq": eas}, p)
    osw.loadTorch(p)
    s = osw.getNumpyVersion()
    np.testing.assert_array_equal(s["exp_avg"], ea.numpy())
    np.testing.assert_array_equal(s["exp_avg_sq"], eas.numpy())
    torch.save([eas, ea], p)
    osw.loadTorch(p)
    s = osw.getNumpyVersion()
    np.testing.assert_array_equal(s["exp_avg"], eas.numpy())
    np.testing.assert_array_equal(s["exp_avg_sq"], ea.numpy())
    q = str(tmp_path / "f.npy")
    X = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.save(q, np.asfortranarray(X))
    sw.loadCupy(q)
    np.testing.assert_array_equal(sw.getNumpyVersion(), X)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_of_table_loaded_from_noncontiguous(tmp_path, fmt):
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    emb = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu")
    W = torch.arange(40, dtype=torch.float32).reshape(4, 10).t()
    emb.load_state_dict({"weight": W})
    c = str(tmp_path / "ck")
    gl.save_checkpoint(c, {"m": emb}, format=fmt)
    e2 = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu")
    gl.load_checkpoint(c, {"m": e2})
    np.testing.assert_array_equal(e2.weight.getNumpyVersion(), W.numpy())
