"""Black-box review (session 31) of the README's "Errors" section and every documented
refusal on the placements available without a GPU ("cpu", and "file" with .npy, HDF5 and
zarr), across getData, insertData, part-of-rows writes, getNumpyVersion, save/load, the
drop-in embedding module, the optimizer/switchers and the data loader; written from
README.md, SPEC.md and the public docstrings only.

Every refusal is checked for its documented exception type (the gadgetloader class and
the matching builtin) and, where rows could have been touched, that the data is
unchanged afterwards (compared with a NumPy copy, and for file tables with the file on
disk).
"""

from __future__ import annotations

import copy
import math
import os
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


BASE = np.arange(60, dtype=np.float32).reshape(12, 5)
KINDS = ["cpu", "npy", "h5", "zarr"]
FILE_KINDS = ["npy", "h5", "zarr"]


def _write_source(kind: str, path: str, arr: np.ndarray = BASE, chunk_rows: int = 4) -> str:
    """Write ``arr`` in the format of ``kind`` without going through the library."""
    if kind == "npy":
        p = os.path.join(path, "t.npy")
        np.save(p, arr)
    elif kind == "h5":
        p = os.path.join(path, "t.h5")
        with h5py.File(p, "w") as f:
            f.create_dataset("emb", data=arr, chunks=(chunk_rows,) + arr.shape[1:])
    elif kind == "zarr":
        p = os.path.join(path, "t.zarr")
        z = zarr.open_array(
            p, mode="w", shape=arr.shape, dtype=arr.dtype, chunks=(chunk_rows,) + arr.shape[1:]
        )
        z[...] = arr
    else:  # pragma: no cover
        raise AssertionError(kind)
    return p


def _read_disk(kind: str, p: str) -> np.ndarray:
    if kind == "npy":
        return np.load(p)
    if kind == "h5":
        with h5py.File(p, "r") as f:
            return f["emb"][...]
    if kind == "zarr":
        return np.asarray(zarr.open_array(p, mode="r")[...])
    raise AssertionError(kind)  # pragma: no cover


class Table:
    """A table of ``BASE`` on one placement, with its file (if any) for checks."""

    def __init__(self, kind: str, tmp: str):
        self.kind = kind
        self.path = None
        if kind == "cpu":
            self.g = gl.DataGadget(BASE.copy(), placement="cpu", device="cpu")
        else:
            self.path = _write_source(kind, tmp)
            self.g = gl.DataGadget(self.path, placement="file", device="cpu")

    def assert_unchanged(self, ref: np.ndarray = BASE) -> None:
        np.testing.assert_array_equal(self.g.getNumpyVersion(), ref)
        if self.path is not None:
            self.g.close()
            np.testing.assert_array_equal(_read_disk(self.kind, self.path), ref)


@pytest.fixture(params=KINDS)
def table(request, tmp_path):
    t = Table(request.param, str(tmp_path))
    yield t
    t.g.close()


# ---------------------------------------------------------------------------------------
# the hierarchy the Errors section promises
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (gl.GadgetIndexError, IndexError),
        (gl.GadgetTypeError, TypeError),
        (gl.GadgetValueError, ValueError),
        (gl.GadgetKeyError, KeyError),
        (gl.GadgetFileNotFoundError, FileNotFoundError),
        (gl.GadgetFileError, OSError),
        (gl.ReadOnlyError, PermissionError),
        (gl.GadgetClosedError, Exception),
        (gl.MissingDependencyError, Exception),
    ],
)
def test_error_classes_derive_from_gadget_error_and_builtin(cls, builtin):
    assert issubclass(cls, gl.GadgetError)
    assert issubclass(cls, builtin)


# ---------------------------------------------------------------------------------------
# bad ids: getData, indexing and insertData on every CPU-reachable placement
# ---------------------------------------------------------------------------------------

BAD_IDS = {
    "negative-list": ([3, -1], gl.GadgetIndexError, "-1"),
    "past-end-list": ([0, 12], gl.GadgetIndexError, "12"),
    "negative-int": (-1, gl.GadgetIndexError, None),
    "past-end-int": (12, gl.GadgetIndexError, None),
    "past-end-0d-tensor": (torch.tensor(12), gl.GadgetIndexError, None),
    "past-end-2d-tensor": (torch.tensor([[0, 1], [2, 40]]), gl.GadgetIndexError, "40"),
    "negative-int8": (torch.tensor([1, -3], dtype=torch.int8), gl.GadgetIndexError, None),
    "uint64-above-int64": (np.array([2**63 + 1], dtype=np.uint64), gl.GadgetIndexError, None),
    "uint32-past-end": (np.array([4_000_000_000], dtype=np.uint32), gl.GadgetIndexError, None),
    "huge-python-int": ([2**70], gl.GadgetIndexError, None),
    "range-past-end": (range(8, 13), gl.GadgetIndexError, None),
    "float-tensor": (torch.tensor([1.0, 2.0]), gl.GadgetTypeError, "float"),
    "float-numpy": (np.array([1.0]), gl.GadgetTypeError, "float"),
    "float-list": ([1.0, 2.0], gl.GadgetTypeError, None),
    "float16-tensor": (torch.tensor([1], dtype=torch.float16), gl.GadgetTypeError, None),
    "bool-tensor": (torch.tensor([True, False]), gl.GadgetTypeError, "nonzero"),
    "bool-scalar": (True, gl.GadgetTypeError, None),
    "bool-in-list": ([1, True], gl.GadgetTypeError, None),
    "numpy-bool-array": (np.array([True, False]), gl.GadgetTypeError, None),
    "string": ("1", gl.GadgetTypeError, None),
    "none": (None, gl.GadgetTypeError, None),
    "complex": (np.array([1j]), gl.GadgetTypeError, None),
    "ragged-list": ([[1, 2], [3]], gl.GadgetTypeError, None),
    "float-slice-bound": (slice(0.0, 2), gl.GadgetTypeError, None),
    "zero-step-slice": (slice(0, 4, 0), gl.GadgetValueError, None),
    "pointwise-tuple": (([1, 2], [0, 1]), gl.GadgetTypeError, None),
    "row-int-past-width": (([1, 2], 5), gl.GadgetIndexError, None),
    "too-many-indices": (([1, 2], 0, 0), gl.GadgetIndexError, None),
    "row-slice-negative-step": ((slice(0, 2), slice(None, None, -1)), gl.GadgetValueError, None),
    "row-slice-float": ((slice(0, 2), slice(0, 2.0)), gl.GadgetTypeError, None),
    "row-index-float": (([1, 2], 1.0), gl.GadgetTypeError, None),
}


@pytest.mark.parametrize("case", sorted(BAD_IDS))
def test_getData_refuses_bad_ids(table, case):
    ids, exc, fragment = BAD_IDS[case]
    with pytest.raises(exc) as info:
        table.g.getData(ids)
    assert isinstance(info.value, gl.GadgetError)
    if fragment is not None:
        assert fragment in str(info.value)
    table.assert_unchanged()


@pytest.mark.parametrize(
    "case",
    [
        "negative-list",
        "past-end-list",
        "float-tensor",
        "bool-tensor",
        "past-end-int",
        "pointwise-tuple",
        "row-int-past-width",
    ],
)
def test_indexing_refuses_bad_ids(table, case):
    ids, exc, _ = BAD_IDS[case]
    with pytest.raises(exc):
        table.g[ids]
    table.assert_unchanged()


def test_index_error_says_expected_and_arrived(table):
    with pytest.raises(gl.GadgetIndexError) as info:
        table.g.getData([3, 12])
    msg = str(info.value)
    assert "12" in msg and "11" in msg  # what arrived, and the last valid id


def _shape_of_part(g, ids):
    """Shape of what getData(ids) would return, computed with NumPy on the reference."""
    if isinstance(ids, tuple) and not all(isinstance(i, int) for i in ids):
        rows = ids[0]
        return np.empty_like(BASE)[
            (np.asarray(rows) if not isinstance(rows, slice) else rows,) + tuple(ids[1:])
        ].shape
    return tuple(np.asarray(ids).shape) + tuple(g.shape[1:])


INSERT_BAD_IDS = {
    "negative": ([3, -1], gl.GadgetIndexError),
    "past-end": ([0, 12], gl.GadgetIndexError),
    "valid-then-past-end": ([0, 1, 2, 3, 4, 5, 6, 7, 8, 100], gl.GadgetIndexError),
    "past-end-2d": (np.array([[0, 1], [2, 12]]), gl.GadgetIndexError),
    "uint64-above-int64": (np.array([2**63 + 1], dtype=np.uint64), gl.GadgetIndexError),
    "float": (np.array([1.0, 2.0]), gl.GadgetTypeError),
    "bool": (torch.tensor([True, False]), gl.GadgetTypeError),
    "check-ids-false-still-checks-cpu-ids": ([0, 12], gl.GadgetIndexError),
}


@pytest.mark.parametrize("case", sorted(INSERT_BAD_IDS))
def test_insertData_refuses_bad_ids_before_writing(table, case):
    ids, exc = INSERT_BAD_IDS[case]
    shape = tuple(np.asarray(ids).shape) + (5,)
    kw = {"check_ids": False} if case.startswith("check-ids-false") else {}
    with pytest.raises(exc):
        table.g.insertData(torch.full(shape, -9.0), ids, **kw)
    table.assert_unchanged()


PART_BAD = {
    "row-id-past-end": (([0, 12], slice(0, 2)), (2, 2), gl.GadgetIndexError),
    "row-id-negative": (([0, -1], slice(0, 2)), (2, 2), gl.GadgetIndexError),
    "column-past-width": (([0, 1], 5), (2,), gl.GadgetIndexError),
    "pointwise": (([0, 1], [0, 1]), (2,), gl.GadgetTypeError),
    "negative-step": (([0, 1], slice(3, 0, -1)), (2, 3), gl.GadgetValueError),
    "float-bound": (([0, 1], slice(0, 2.0)), (2, 2), gl.GadgetTypeError),
    "wrong-part-shape": (([0, 1], slice(0, 2)), (2, 3), gl.GadgetValueError),
    "full-row-shape-for-part": (([0, 1], slice(0, 2)), (2, 5), gl.GadgetValueError),
}


@pytest.mark.parametrize("case", sorted(PART_BAD))
def test_part_of_rows_write_refusals(table, case):
    index, shape, exc = PART_BAD[case]
    with pytest.raises(exc):
        table.g.insertData(torch.full(shape, -9.0), index)
    with pytest.raises(exc):
        table.g[index] = torch.full(shape, -9.0)
    table.assert_unchanged()


def test_part_of_rows_write_wrong_dtype(table):
    with pytest.raises(gl.GadgetTypeError):
        table.g.insertData(torch.zeros(2, 2, dtype=torch.float64), ([0, 1], slice(0, 2)))
    table.assert_unchanged()


def test_part_of_rows_write_that_succeeds_matches_numpy(table):
    ref = BASE.copy()
    table.g.insertData(torch.full((2, 2), -1.0), ([0, 9], slice(1, 3)))
    ref[[0, 9], 1:3] = -1.0
    table.g[[3, 3], 4] = torch.tensor([7.0, 8.0])  # repeated id: last occurrence wins
    ref[3, 4] = 8.0
    table.g.insertData(torch.full((2, 3), -2.0), (slice(10, 12), slice(0, 5, 2)))
    ref[10:12, 0:5:2] = -2.0
    table.assert_unchanged(ref)


# ---------------------------------------------------------------------------------------
# rows of the wrong dtype / shape / kind
# ---------------------------------------------------------------------------------------

BAD_ROWS = {
    "float64": (lambda: torch.zeros(2, 5, dtype=torch.float64), gl.GadgetTypeError),
    "float64-numpy": (lambda: np.zeros((2, 5)), gl.GadgetTypeError),
    "float16": (lambda: torch.zeros(2, 5, dtype=torch.float16), gl.GadgetTypeError),
    "int32": (lambda: torch.zeros(2, 5, dtype=torch.int32), gl.GadgetTypeError),
    "bool": (lambda: torch.zeros(2, 5, dtype=torch.bool), gl.GadgetTypeError),
    "nested-list": (lambda: [[0.0] * 5, [0.0] * 5], gl.GadgetTypeError),
    "python-float": (lambda: 1.0, gl.GadgetTypeError),
    "none": (lambda: None, gl.GadgetTypeError),
    "narrow-rows": (lambda: torch.zeros(2, 4), gl.GadgetValueError),
    "too-many-rows": (lambda: torch.zeros(3, 5), gl.GadgetValueError),
    "one-broadcastable-row": (lambda: torch.zeros(5), gl.GadgetValueError),
    "flat": (lambda: torch.zeros(10), gl.GadgetValueError),
    "extra-axis": (lambda: torch.zeros(2, 1, 5), gl.GadgetValueError),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_insertData_refuses_bad_rows(table, case):
    make, exc = BAD_ROWS[case]
    with pytest.raises(exc) as info:
        table.g.insertData(make(), [1, 2])
    assert isinstance(info.value, gl.GadgetError)
    table.assert_unchanged()


def test_insertData_dtype_error_names_both_dtypes(table):
    with pytest.raises(gl.GadgetTypeError) as info:
        table.g.insertData(np.zeros((1, 5)), [0])
    assert "float32" in str(info.value) and "float64" in str(info.value)


def test_empty_insert_still_checks_shape_and_dtype(table):
    with pytest.raises(gl.GadgetValueError):
        table.g.insertData(torch.zeros(0, 4), [])
    with pytest.raises(gl.GadgetTypeError):
        table.g.insertData(torch.zeros(0, 5, dtype=torch.float64), [])
    table.g.insertData(torch.zeros(0, 5), [])
    table.g.insertData(torch.zeros(0, 5), torch.empty(0, dtype=torch.long))
    table.assert_unchanged()


# ---------------------------------------------------------------------------------------
# non-contiguous and unusual-but-valid inputs, and empty requests
# ---------------------------------------------------------------------------------------


def test_non_contiguous_ids_give_numpy_rows(table):
    g = table.g
    cases = [
        np.arange(12)[::-1],
        np.arange(12)[::-3],
        np.asfortranarray(np.array([[1, 2, 3], [4, 5, 6]])),
        torch.tensor([[1, 2], [3, 4]]).t(),
        torch.tensor([7]).expand(3),
        np.array([3, 11], dtype=">i8"),
        torch.arange(12)[1::4],
    ]
    for ids in cases:
        ref = BASE[np.asarray(ids)]
        np.testing.assert_array_equal(g.getData(ids).numpy(), ref)


def test_non_contiguous_rows_are_written_as_numpy_would(table):
    ref = BASE.copy()
    d1 = np.flip(np.arange(10, dtype=np.float32).reshape(2, 5) + 100, 0)
    table.g.insertData(d1, [0, 1])
    ref[[0, 1]] = d1
    d2 = (np.arange(10, dtype=np.float32).reshape(5, 2) + 200).T
    table.g.insertData(d2, [2, 3])
    ref[[2, 3]] = d2
    d3 = torch.arange(20, dtype=torch.float32).reshape(4, 5)[::2] + 300
    table.g.insertData(d3, [4, 5])
    ref[[4, 5]] = d3.numpy()
    d4 = torch.arange(5, dtype=torch.float32).expand(2, 5)
    table.g.insertData(d4, torch.tensor([[6], [7]]).t()[0])
    ref[[6, 7]] = d4.numpy()
    table.assert_unchanged(ref)


@pytest.mark.parametrize(
    "ids, shape",
    [
        ([], (0, 5)),
        (torch.empty(0, dtype=torch.long), (0, 5)),
        (np.empty((0, 3), dtype=np.int64), (0, 3, 5)),
        (slice(5, 5), (0, 5)),
        (range(0), (0, 5)),
    ],
)
def test_empty_requests_return_empty_rows(table, ids, shape):
    out = table.g.getData(ids)
    assert tuple(out.shape) == shape
    assert out.dtype == torch.float32
    table.assert_unchanged()


def test_slices_of_rows_follow_python(table):
    np.testing.assert_array_equal(table.g[-2:].numpy(), BASE[-2:])
    np.testing.assert_array_equal(table.g.getData(slice(8, 100)).numpy(), BASE[8:100])
    np.testing.assert_array_equal(table.g.getData(slice(None, None, -2)).numpy(), BASE[::-2])


# ---------------------------------------------------------------------------------------
# flags that take True/False or 1/0 only
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["False", "True", 2, None, 0.5])
def test_check_ids_flag_refuses_non_bools(table, bad):
    with pytest.raises(gl.GadgetTypeError):
        table.g.getData([1], check_ids=bad)
    with pytest.raises(gl.GadgetTypeError):
        table.g.insertData(torch.zeros(1, 5), [1], check_ids=bad)
    table.assert_unchanged()


@pytest.mark.parametrize("bad", ["False", 2, None])
def test_getNumpyVersion_copy_flag_refuses_non_bools(table, bad):
    with pytest.raises(gl.GadgetTypeError):
        table.g.getNumpyVersion(copy=bad)


@pytest.mark.parametrize("ok", [True, False, 1, 0, np.bool_(True), np.bool_(False)])
def test_flags_accept_bools_and_0_1(table, ok):
    assert tuple(table.g.getData([1], check_ids=ok).shape) == (1, 5)
    np.testing.assert_array_equal(table.g.getNumpyVersion(copy=ok), BASE)


@pytest.mark.parametrize("bad", ["False", 2])
def test_CPUPinn_refuses_non_bools(bad):
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(BASE, bad, placement="cpu", device="cpu")


@pytest.mark.parametrize("bad", ["yes", 1, 0, "False"])
def test_writable_takes_only_bools_or_none(tmp_path, bad):
    p = _write_source("npy", str(tmp_path))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="file", device="cpu", writable=bad)
    g = gl.DataGadget(p, placement="file", device="cpu", writable=np.bool_(False))
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.zeros(1, 5), [0])
    g.close()


def test_copy_false_on_file_table_is_a_copy(tmp_path):
    p = _write_source("npy", str(tmp_path))
    g = gl.DataGadget(p, placement="file", device="cpu")
    a = g.getNumpyVersion(copy=False)
    a[...] = -1
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    with pytest.raises(ValueError):
        np.asarray(g, copy=False)
    with pytest.raises(gl.GadgetTypeError):
        g.as_tensor()
    g.close()
    np.testing.assert_array_equal(np.load(p), BASE)


def test_copy_false_on_cpu_table_is_a_view_and_bfloat16_cannot_be():
    g = gl.DataGadget(BASE, placement="cpu", device="cpu")
    v = g.getNumpyVersion(copy=False)
    v[0, 0] = 123.0
    assert g.getData([0])[0, 0].item() == 123.0
    b = gl.DataGadget((3, 2), dtype="bfloat16", placement="cpu", device="cpu")
    with pytest.raises(ValueError):
        np.asarray(b, copy=False)
    c = b.getNumpyVersion(copy=False)
    assert c.dtype == np.float32
    c[...] = 5
    assert b.getData([0]).float().sum().item() == 0.0


# ---------------------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------------------


def test_out_refusals(table):
    g = table.g
    with pytest.raises(gl.GadgetValueError):
        g.getData([1, 2], out=torch.empty(3, 5))
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1, 2], out=torch.empty(2, 5, dtype=torch.float64))
    with pytest.raises(gl.GadgetValueError):
        g.getData([1, 2], out=torch.empty(5, 2).t())
    with pytest.raises(gl.GadgetValueError):
        g.getData((slice(0, 2), slice(0, 2)), out=torch.empty(2, 2))
    out = torch.full((2, 5), -4.0)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([1, 12], out=out)
    table.assert_unchanged()


def test_out_that_is_part_of_the_table_and_a_bad_id_leaves_table_unchanged():
    g = gl.DataGadget(BASE, placement="cpu", device="cpu")
    view = g.as_tensor()
    with pytest.raises(gl.GadgetIndexError):
        g.getData([5, 100], out=view[0:2])
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)


# ---------------------------------------------------------------------------------------
# closed tables
# ---------------------------------------------------------------------------------------

CLOSED_CALLS = {
    "getData": lambda g, d: g.getData([1]),
    "getData-empty": lambda g, d: g.getData([]),
    "getData-slice": lambda g, d: g.getData(slice(0, 2)),
    "getitem": lambda g, d: g[0:2],
    "insertData": lambda g, d: g.insertData(torch.zeros(1, 5), [1]),
    "insertData-empty": lambda g, d: g.insertData(torch.zeros(0, 5), []),
    "part-write": lambda g, d: g.insertData(torch.zeros(1, 2), ([1], slice(0, 2))),
    "setitem": lambda g, d: g.__setitem__([1], torch.zeros(1, 5)),
    "getNumpyVersion": lambda g, d: g.getNumpyVersion(),
    "np.asarray": lambda g, d: np.asarray(g),
    "as_tensor": lambda g, d: g.as_tensor(),
    "load": lambda g, d: g.load(os.path.join(d, "src.npy")),
    "loadCupy": lambda g, d: g.loadCupy(os.path.join(d, "src.npy")),
    "save": lambda g, d: g.save(os.path.join(d, "out.npy")),
    "saveCupy": lambda g, d: g.saveCupy(os.path.join(d, "out.npy")),
    "flush": lambda g, d: g.flush(),
    "fill_": lambda g, d: g.fill_(1.0),
    "zero_": lambda g, d: g.zero_(),
    "normal_": lambda g, d: g.normal_(),
    "init_": lambda g, d: g.init_(torch.nn.init.zeros_),
    "gadgetInit": lambda g, d: g.gadgetInit(),
    "gather_many": lambda g, d: gl.gather_many([g], [1]),
    "scatter_many": lambda g, d: gl.scatter_many([g], [torch.zeros(1, 5)], [1]),
}


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_closed_table_refuses_row_calls(table, tmp_path, call):
    d = str(tmp_path / "closed_io")
    os.makedirs(d)
    np.save(os.path.join(d, "src.npy"), np.ones((3, 5), np.float32))
    table.g.close()
    with pytest.raises(gl.GadgetClosedError):
        CLOSED_CALLS[call](table.g, d)
    assert not os.path.exists(os.path.join(d, "out.npy"))
    if table.path is not None:
        np.testing.assert_array_equal(_read_disk(table.kind, table.path), BASE)


def test_closed_table_still_answers_shape_dtype_len_repr(table):
    table.g.close()
    table.g.close()  # idempotent
    assert tuple(table.g.shape) == (12, 5)
    assert table.g.dtype == torch.float32
    assert len(table.g) == 12
    assert isinstance(repr(table.g), str)


# ---------------------------------------------------------------------------------------
# files: missing, truncated, unreadable, wrong dataset names
# ---------------------------------------------------------------------------------------


@pytest.fixture()
def bad_files(tmp_path):
    d = tmp_path
    np.save(d / "good.npy", BASE)
    raw = (d / "good.npy").read_bytes()
    (d / "trunc.npy").write_bytes(raw[:-20])
    (d / "junk.npy").write_bytes(b"this is not an npy file at all" * 4)
    np.save(d / "obj.npy", np.array([object(), 1], dtype=object), allow_pickle=True)
    np.save(d / "str.npy", np.array(["a", "b"]))
    np.save(d / "zero.npy", np.zeros((0, 5), np.float32))
    np.save(d / "u32.npy", np.arange(12, dtype=np.uint32))
    np.save(d / "cplx.npy", np.zeros((3, 2), np.complex64))
    with h5py.File(d / "two.h5", "w") as f:
        f.create_dataset("emb", data=BASE)
        f.create_dataset("grp/other", data=BASE[:5])
    with h5py.File(d / "one.h5", "w") as f:
        f.create_dataset("emb", data=BASE)
    (d / "trunc.h5").write_bytes((d / "one.h5").read_bytes()[:1000])
    grp = zarr.open_group(str(d / "grp.zarr"), mode="w")
    grp.create_array("a", shape=(12, 5), dtype="float32")[...] = BASE
    grp.create_array("b", shape=(3, 5), dtype="float32")[...] = 1
    z = zarr.open_array(str(d / "single.zarr"), mode="w", shape=(12, 5), dtype="float32")
    z[...] = BASE
    return d


OPEN_REFUSALS = {
    "missing-npy": ("nope.npy", {}, gl.GadgetFileNotFoundError, "nope.npy"),
    "missing-h5": ("nope.h5", {}, gl.GadgetFileNotFoundError, "nope.h5"),
    "missing-zarr": ("nope.zarr", {}, gl.GadgetFileNotFoundError, "nope.zarr"),
    "truncated-npy": ("trunc.npy", {}, gl.GadgetFileError, "trunc.npy"),
    "junk-npy": ("junk.npy", {}, gl.GadgetFileError, "junk.npy"),
    "truncated-h5": ("trunc.h5", {}, gl.GadgetFileError, "trunc.h5"),
    "object-dtype": ("obj.npy", {}, gl.GadgetError, "obj.npy"),
    "string-dtype": ("str.npy", {}, gl.GadgetError, "str.npy"),
    "zero-rows": ("zero.npy", {}, gl.GadgetError, "zero.npy"),
    "complex": ("cplx.npy", {}, gl.GadgetTypeError, "cplx.npy"),
    "h5-wrong-dataset": ("two.h5", {"dataset": "nope"}, gl.GadgetKeyError, "grp/other"),
    "h5-group-as-dataset": ("two.h5", {"dataset": "grp"}, gl.GadgetKeyError, "emb"),
    "h5-ambiguous": ("two.h5", {}, gl.GadgetKeyError, "grp/other"),
    "zarr-group-wrong-name": ("grp.zarr", {"dataset": "c"}, gl.GadgetKeyError, "'b'"),
    "zarr-group-ambiguous": ("grp.zarr", {}, gl.GadgetKeyError, "'a'"),
    "zarr-array-with-dataset": ("single.zarr", {"dataset": "x"}, gl.GadgetKeyError, "single.zarr"),
    "unknown-format": ("good.npy", {"format": "csv"}, gl.GadgetKeyError, "npy"),
    "directory-as-npy": (".", {"format": "npy"}, gl.GadgetFileError, None),
}


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("case", sorted(OPEN_REFUSALS))
def test_opening_bad_files_is_refused_naming_the_file(bad_files, placement, case):
    name, kw, exc, fragment = OPEN_REFUSALS[case]
    with pytest.raises(exc) as info:
        gl.DataGadget(str(bad_files / name), placement=placement, **kw)
    if fragment is not None:
        assert fragment in str(info.value)


def test_uint32_file_converts_with_dtype_but_not_as_file_table(bad_files):
    g = gl.DataGadget(str(bad_files / "u32.npy"), dtype="int64", placement="cpu", device="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), np.arange(12))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(str(bad_files / "u32.npy"), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(str(bad_files / "u32.npy"), placement="file", device="cpu")


def test_wrong_dataset_names_work_when_right(bad_files):
    g = gl.DataGadget(
        str(bad_files / "two.h5"), dataset="grp/other", placement="file", device="cpu"
    )
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE[:5])
    g.close()
    g = gl.DataGadget(str(bad_files / "grp.zarr"), dataset="a", placement="file", device="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    g.close()


LOAD_REFUSALS = {
    "missing": ("load", "nope.npy", {}, gl.GadgetFileNotFoundError),
    "missing-loadCupy": ("loadCupy", "nope.npy", {}, gl.GadgetFileNotFoundError),
    "truncated": ("load", "trunc.npy", {}, gl.GadgetFileError),
    "truncated-loadCupy": ("loadCupy", "trunc.npy", {}, gl.GadgetFileError),
    "junk": ("load", "junk.npy", {}, gl.GadgetFileError),
    "uint32": ("load", "u32.npy", {}, gl.GadgetTypeError),
    "uint32-loadCupy": ("loadCupy", "u32.npy", {}, gl.GadgetTypeError),
    "object": ("load", "obj.npy", {}, gl.GadgetError),
    "zero-rows": ("load", "zero.npy", {}, gl.GadgetError),
    "h5-wrong-dataset": ("load", "two.h5", {"dataset": "nope"}, gl.GadgetKeyError),
    "h5-truncated": ("load", "trunc.h5", {}, gl.GadgetFileError),
    "zarr-wrong-name": ("load", "grp.zarr", {"dataset": "zz"}, gl.GadgetKeyError),
    "none-path": ("load", None, {}, gl.GadgetTypeError),
    "none-path-loadCupy": ("loadCupy", None, {}, gl.GadgetTypeError),
    "bytes-path": ("load", b"good.npy", {}, gl.GadgetTypeError),
}


@pytest.mark.parametrize("case", sorted(LOAD_REFUSALS))
def test_failed_load_leaves_table_unchanged(table, bad_files, case):
    method, name, kw, exc = LOAD_REFUSALS[case]
    if isinstance(name, str):
        arg = str(bad_files / name)
    elif isinstance(name, bytes):
        arg = os.fsencode(str(bad_files)) + b"/" + name
    else:
        arg = name
    with pytest.raises(exc) as info:
        getattr(table.g, method)(arg, **kw)
    if isinstance(name, bytes):
        assert "fsdecode" in str(info.value)
    table.assert_unchanged()


# ---------------------------------------------------------------------------------------
# save refusals: nothing made, the old target kept
# ---------------------------------------------------------------------------------------

SAVE_REFUSALS = {
    "none": (lambda g, d: g.save(None), gl.GadgetTypeError),
    "none-saveCupy": (lambda g, d: g.saveCupy(None), gl.GadgetTypeError),
    "bytes": (lambda g, d: g.save(os.fsencode(os.path.join(d, "x.npy"))), gl.GadgetTypeError),
    "directory-npy": (lambda g, d: g.save(os.path.join(d, "adir.npy")), gl.GadgetFileError),
    "directory-h5": (lambda g, d: g.save(os.path.join(d, "adir.h5")), gl.GadgetFileError),
    "zarr-over-regular-file": (
        lambda g, d: g.save(os.path.join(d, "old.npy"), format="zarr"),
        gl.GadgetFileError,
    ),
    "h5-unknown-compression": (
        lambda g, d: g.save(os.path.join(d, "old.h5"), compression="zstd"),
        (gl.GadgetKeyError, gl.GadgetValueError),
    ),
    "zarr-unknown-compression": (
        lambda g, d: g.save(os.path.join(d, "x.zarr"), compression="lz4"),
        (gl.GadgetKeyError, gl.GadgetValueError),
    ),
    "gzip-level-out-of-range": (
        lambda g, d: g.save(os.path.join(d, "old.h5"), compression="gzip", compression_level=42),
        (gl.GadgetKeyError, gl.GadgetValueError),
    ),
    "progress-string": (
        lambda g, d: g.save(os.path.join(d, "old.npy"), progress="False"),
        gl.GadgetTypeError,
    ),
    "dataset-dotdot": (
        lambda g, d: g.save(os.path.join(d, "old.h5"), dataset="../a"),
        gl.GadgetValueError,
    ),
    "unknown-format": (
        lambda g, d: g.save(os.path.join(d, "x.bin"), format="csv"),
        gl.GadgetKeyError,
    ),
    "npy-takes-no-chunk-rows": (
        lambda g, d: g.save(os.path.join(d, "old.npy"), chunk_rows=4),
        gl.GadgetError,
    ),
    "chunk-rows-zero": (
        lambda g, d: g.save(os.path.join(d, "old.h5"), chunk_rows=0),
        gl.GadgetValueError,
    ),
}


@pytest.mark.parametrize("case", sorted(SAVE_REFUSALS))
def test_refused_save_makes_nothing_and_keeps_old_target(table, tmp_path, case):
    d = str(tmp_path / "save_target")
    os.makedirs(os.path.join(d, "adir.npy"))
    os.makedirs(os.path.join(d, "adir.h5"))
    old = np.full((2, 2), 7.0, np.float32)
    np.save(os.path.join(d, "old.npy"), old)
    with h5py.File(os.path.join(d, "old.h5"), "w") as f:
        f.create_dataset("keep", data=old)
    before = sorted(os.listdir(d))
    fn, exc = SAVE_REFUSALS[case]
    with pytest.raises(exc):
        fn(table.g, d)
    assert sorted(os.listdir(d)) == before
    np.testing.assert_array_equal(np.load(os.path.join(d, "old.npy")), old)
    with h5py.File(os.path.join(d, "old.h5"), "r") as f:
        assert list(f.keys()) == ["keep"]
    table.assert_unchanged()


def test_zero_row_table_is_not_saved(tmp_path):
    g = gl.DataGadget((0, 5), dtype="float32", placement="cpu", device="cpu")
    assert tuple(g.getData([]).shape) == (0, 5)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([0])
    for name in ("z.npy", "z.h5", "z.zarr"):
        with pytest.raises(gl.GadgetError):
            g.save(str(tmp_path / name))
        assert not os.path.exists(tmp_path / name)


def test_bfloat16_table_refuses_npy_before_writing(tmp_path):
    g = gl.DataGadget((3, 2), dtype="bfloat16", placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.saveCupy(str(tmp_path / "bf"))
    with pytest.raises(gl.GadgetTypeError):
        g.save(str(tmp_path / "bf.npy"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.ones(1, 2), [0])


# ---------------------------------------------------------------------------------------
# a file table whose file changed, and damaged chunks
# ---------------------------------------------------------------------------------------


def _file_table(kind, tmp, **kw):
    p = _write_source(kind, tmp)
    return p, gl.DataGadget(p, placement="file", device="cpu", **kw)


def test_npy_shrunk_in_place_is_a_file_error(tmp_path):
    p, g = _file_table("npy", str(tmp_path))
    with open(p, "r+b") as f:
        f.truncate(200)
    for call in (
        lambda: g.getData([11]),
        lambda: g.getData([0]),
        lambda: g.insertData(torch.zeros(1, 5), [11]),
    ):
        with pytest.raises(gl.GadgetFileError):
            call()
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5"])
def test_replaced_file_is_a_file_error_and_new_file_is_untouched(tmp_path, kind):
    p, g = _file_table(kind, str(tmp_path))
    new = BASE * 2
    tmp2 = tmp_path / "other"
    tmp2.mkdir()
    q = _write_source(kind, str(tmp2), new)
    os.replace(q, p)
    with pytest.raises(gl.GadgetFileError):
        g.getData([1])
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.zeros(1, 5), [1])
    g.close()
    np.testing.assert_array_equal(_read_disk(kind, p), new)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_deleted_file_is_a_file_error(tmp_path, kind):
    p, g = _file_table(kind, str(tmp_path), cache_bytes=0)
    if os.path.isdir(p):
        shutil.rmtree(p)
    else:
        os.remove(p)
    with pytest.raises(gl.GadgetFileError):
        g.getData([1])
    g.close()


def test_h5_truncated_after_open_is_a_file_error(tmp_path):
    p, g = _file_table("h5", str(tmp_path))
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(gl.GadgetFileError):
        g.getData([11])
    g.close()


def _damage_zarr_chunk(p, chunk):
    files = [
        os.path.join(r, f)
        for r, _, fs in os.walk(p)
        for f in fs
        if not f.endswith(".json") and not f.startswith(".z")
    ]
    target = [
        f
        for f in files
        if os.path.relpath(f, p).replace(os.sep, "/").split("/")[-2:] == [str(chunk), "0"]
    ]
    assert target, files
    with open(target[0], "wb") as f:
        f.write(b"garbage!" * 3)


def _damage_h5_chunk(p, chunk):
    with h5py.File(p, "r") as f:
        info = f["emb"].id.get_chunk_info(chunk)
    with open(p, "r+b") as f:
        f.seek(info.byte_offset)
        f.write(b"\xff" * info.size)


@pytest.fixture(params=["zarr", "h5"])
def damaged(request, tmp_path):
    kind = request.param
    if kind == "zarr":
        p = str(tmp_path / "d.zarr")
        gl.DataGadget(BASE, placement="cpu").save(p, chunk_rows=4)  # zstd by default
        _damage_zarr_chunk(p, 1)
    else:
        p = str(tmp_path / "d.h5")
        with h5py.File(p, "w") as f:
            f.create_dataset("emb", data=BASE, chunks=(4, 5), compression="gzip")
        _damage_h5_chunk(p, 1)
    return kind, p


def test_damaged_chunk_read_is_a_file_error(damaged):
    kind, p = damaged
    g = gl.DataGadget(p, placement="file", device="cpu", cache_bytes=0)
    with pytest.raises(gl.GadgetFileError):
        g.getData([5])
    np.testing.assert_array_equal(g.getData([0, 9]).numpy(), BASE[[0, 9]])
    g.close()


@pytest.mark.parametrize("ids", [[0, 5], [0, 1, 2, 3, 5], [0, 1, 2, 3, 4, 8, 9, 10, 11]])
def test_write_touching_damaged_chunk_changes_nothing(damaged, ids):
    kind, p = damaged
    g = gl.DataGadget(p, placement="file", device="cpu", cache_bytes=0)
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.full((len(ids), 5), -7.0), ids)
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.full((len(ids), 2), -7.0), (ids, slice(0, 2)))
    g.close()
    g = gl.DataGadget(p, placement="file", device="cpu", cache_bytes=0)
    np.testing.assert_array_equal(g.getData(slice(0, 4)).numpy(), BASE[0:4])
    np.testing.assert_array_equal(g.getData(slice(8, 12)).numpy(), BASE[8:12])
    g.close()


def test_load_of_damaged_file_leaves_table_unchanged(damaged):
    _, p = damaged
    g = gl.DataGadget(BASE * 3, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetFileError):
        g.load(p)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE * 3)
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(p, placement="cpu", device="cpu")


# ---------------------------------------------------------------------------------------
# read-only file tables
# ---------------------------------------------------------------------------------------

RO_CALLS = {
    "insertData": lambda g: g.insertData(torch.zeros(1, 5), [0]),
    "setitem": lambda g: g.__setitem__(slice(0, 1), torch.zeros(1, 5)),
    "part-write": lambda g: g.insertData(torch.zeros(1, 2), ([0], slice(0, 2))),
    "fill_": lambda g: g.fill_(0.0),
    "zero_": lambda g: g.zero_(),
    "uniform_": lambda g: g.uniform_(0, 1),
    "scatter_many": lambda g: gl.scatter_many([g], [torch.zeros(1, 5)], [0]),
}


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("call", sorted(RO_CALLS))
def test_read_only_file_table_refuses_writes(tmp_path, kind, call):
    p, g = _file_table(kind, str(tmp_path), writable=False)
    with pytest.raises(gl.ReadOnlyError) as info:
        RO_CALLS[call](g)
    assert isinstance(info.value, PermissionError)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    g.close()
    np.testing.assert_array_equal(_read_disk(kind, p), BASE)


def test_fortran_npy_is_read_only_saying_why(tmp_path):
    p = str(tmp_path / "f.npy")
    np.save(p, np.asfortranarray(BASE))
    g = gl.DataGadget(p, placement="file", device="cpu")
    np.testing.assert_array_equal(g.getData([3, 1]).numpy(), BASE[[3, 1]])
    with pytest.raises(gl.ReadOnlyError) as info:
        g.insertData(torch.zeros(1, 5), [0])
    assert "Fortran" in str(info.value)
    g.close()
    np.testing.assert_array_equal(np.load(p), BASE)


def test_scatter_many_with_read_only_second_table_writes_no_table(tmp_path):
    a = gl.DataGadget(BASE, placement="cpu", device="cpu")
    p, ro = _file_table("npy", str(tmp_path), writable=False)
    with pytest.raises(gl.ReadOnlyError):
        gl.scatter_many([a, ro], [torch.zeros(1, 5), torch.zeros(1, 5)], [1])
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
    ro.close()
    np.testing.assert_array_equal(np.load(p), BASE)


# ---------------------------------------------------------------------------------------
# initialisers and file-only refusals
# ---------------------------------------------------------------------------------------

FILL_BAD = [
    ("int8", 200, gl.GadgetValueError),
    ("int8", -129, gl.GadgetValueError),
    ("int8", 1.5, gl.GadgetValueError),
    ("int8", "1", gl.GadgetTypeError),
    ("uint8", -1, gl.GadgetValueError),
    ("uint8", 256, gl.GadgetValueError),
    ("bool", 2, gl.GadgetValueError),
    ("bool", 0.5, gl.GadgetValueError),
    ("float16", 1e6, gl.GadgetValueError),
    ("float32", 1e39, gl.GadgetValueError),
    ("int64", 2**63, gl.GadgetValueError),
    ("float32", "x", gl.GadgetTypeError),
]


@pytest.mark.parametrize("dtype, value, exc", FILL_BAD)
def test_fill_refuses_values_the_dtype_cannot_hold(dtype, value, exc):
    g = gl.DataGadget((4, 3), dtype=dtype, placement="cpu", device="cpu")
    g.fill_(1)
    ref = g.getNumpyVersion().copy()
    with pytest.raises(exc):
        g.fill_(value)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


@pytest.mark.parametrize(
    "dtype, value",
    [
        ("float32", math.inf),
        ("float16", -math.inf),
        ("float32", math.nan),
        ("bool", True),
        ("int8", -128),
    ],
)
def test_fill_accepts_documented_special_values(dtype, value):
    g = gl.DataGadget((2, 2), dtype=dtype, placement="cpu", device="cpu")
    g.fill_(value)
    ref = np.full((2, 2), value, dtype=g.getNumpyVersion().dtype)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


INIT_BAD = {
    "uniform-high-below-low": (lambda g: g.uniform_(1, 0), gl.GadgetValueError),
    "uniform-inf": (lambda g: g.uniform_(0, math.inf), gl.GadgetValueError),
    "uniform-nan": (lambda g: g.uniform_(math.nan, 1), gl.GadgetValueError),
    "uniform-span-overflows-fp16": (lambda g: g.uniform_(-60000, 60000), gl.GadgetValueError),
    "uniform-1d-tensor": (lambda g: g.uniform_(torch.tensor([0.0]), 1), gl.GadgetTypeError),
    "normal-negative-std": (lambda g: g.normal_(0, -1), gl.GadgetValueError),
    "normal-inf-mean": (lambda g: g.normal_(math.inf, 1), gl.GadgetValueError),
    "normal-nan-std": (lambda g: g.normal_(0, math.nan), gl.GadgetValueError),
    "normal-string": (lambda g: g.normal_("0", 1), gl.GadgetTypeError),
    "init-not-callable": (lambda g: g.init_(5), gl.GadgetTypeError),
}


@pytest.mark.parametrize("case", sorted(INIT_BAD))
def test_initialiser_refusals_leave_table_unchanged(case):
    g = gl.DataGadget((4, 3), dtype="float16", placement="cpu", device="cpu")
    g.fill_(2.0)
    fn, exc = INIT_BAD[case]
    with pytest.raises(exc):
        fn(g)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.full((4, 3), 2.0, np.float16))


def test_initialisers_accept_zero_d_tensors():
    g = gl.DataGadget((50, 3), dtype="float32", placement="cpu", device="cpu")
    g.uniform_(torch.tensor(2.0), torch.tensor(3.0))
    a = g.getNumpyVersion()
    assert a.min() >= 2.0 and a.max() <= 3.0


def test_random_initialisers_refuse_integer_tables():
    g = gl.DataGadget((4, 3), dtype="int32", placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.uniform_(0, 1)
    with pytest.raises(gl.GadgetTypeError):
        g.normal_()
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((4, 3), np.int32))


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("fn", [torch.nn.init.xavier_uniform_, torch.nn.init.orthogonal_])
def test_file_table_refuses_non_elementwise_initialisers(tmp_path, kind, fn):
    p, g = _file_table(kind, str(tmp_path))
    with pytest.raises(gl.GadgetTypeError):
        g.init_(fn)
    g.close()
    np.testing.assert_array_equal(_read_disk(kind, p), BASE)


# ---------------------------------------------------------------------------------------
# constructor refusals
# ---------------------------------------------------------------------------------------


def test_constructor_refusals(tmp_path):
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(None, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetKeyError) as info:
        gl.DataGadget(BASE, placement="gpu")
    assert "cpu" in str(info.value) and "file" in str(info.value)
    with pytest.raises(gl.GadgetKeyError) as info:
        gl.DataGadget(BASE, placement="cpu", device="cpu", strategy="fast")
    assert "kernel" in str(info.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(BASE, placement="cpu", device="cpu", cache_bytes=10)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(BASE.astype(np.float64), dtype="int32", placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.array([[1e300]]), dtype="float32", placement="cpu", device="cpu")
    np.save(tmp_path / "a.npy", BASE)
    with pytest.raises(gl.GadgetTypeError) as info:
        gl.DataGadget(os.fsencode(str(tmp_path / "a.npy")), placement="cpu", device="cpu")
    assert "fsdecode" in str(info.value)


# ---------------------------------------------------------------------------------------
# gather_many / scatter_many
# ---------------------------------------------------------------------------------------


def test_gather_many_refusals():
    a = gl.DataGadget(BASE, placement="cpu", device="cpu")
    b = gl.DataGadget(BASE[:, :2].copy(), placement="cpu", device="cpu")
    c = gl.DataGadget(BASE[:5].copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.gather_many([a, c], [1])
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many([a, b], [12])
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([a, b], [1.0])
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([], [1])
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([a, BASE], [1])
    ra, rb = gl.gather_many([a, b], slice(10, 12))
    np.testing.assert_array_equal(ra.numpy(), BASE[10:12])
    np.testing.assert_array_equal(rb.numpy(), BASE[10:12, :2])


SCATTER_MANY_BAD = {
    "second-dtype": (
        lambda: [torch.zeros(1, 5), torch.zeros(1, 2, dtype=torch.float64)],
        [1],
        gl.GadgetTypeError,
    ),
    "second-shape": (lambda: [torch.zeros(1, 5), torch.zeros(1, 3)], [1], gl.GadgetValueError),
    "count": (lambda: [torch.zeros(1, 5)], [1], gl.GadgetValueError),
    "negative-id": (lambda: [torch.zeros(1, 5), torch.zeros(1, 2)], [-1], gl.GadgetIndexError),
    "past-end": (lambda: [torch.zeros(2, 5), torch.zeros(2, 2)], [0, 12], gl.GadgetIndexError),
    "float-id": (lambda: [torch.zeros(1, 5), torch.zeros(1, 2)], [1.0], gl.GadgetTypeError),
}


@pytest.mark.parametrize("case", sorted(SCATTER_MANY_BAD))
def test_scatter_many_refusals_write_no_table(case):
    a = gl.DataGadget(BASE, placement="cpu", device="cpu")
    b = gl.DataGadget(BASE[:, :2].copy(), placement="cpu", device="cpu")
    rows, ids, exc = SCATTER_MANY_BAD[case]
    with pytest.raises(exc):
        gl.scatter_many([a, b], rows(), ids)
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
    np.testing.assert_array_equal(b.getNumpyVersion(), BASE[:, :2])


def test_scatter_many_across_file_and_cpu_bad_second_table(tmp_path):
    p, f = _file_table("h5", str(tmp_path))
    a = gl.DataGadget(BASE, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many([f, a], [torch.zeros(1, 5), torch.zeros(1, 5, dtype=torch.float64)], [3])
    f.close()
    np.testing.assert_array_equal(_read_disk("h5", p), BASE)
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)


# ---------------------------------------------------------------------------------------
# the drop-in module and its optimizer
# ---------------------------------------------------------------------------------------


def _emb(n=12, d=5, bag=False, **kw):
    torch.manual_seed(0)
    if bag:
        return gl.OffloadedEmbeddingBag(n, d, placement="cpu", device="cpu", **kw)
    return gl.OffloadedEmbedding(n, d, placement="cpu", device="cpu", **kw)


LOOKUP_BAD = {
    "past-end": (torch.tensor([1, 12]), gl.GadgetIndexError),
    "negative": (torch.tensor([-1]), gl.GadgetIndexError),
    "past-end-2d": (torch.tensor([[0, 1], [12, 2]]), gl.GadgetIndexError),
    "float": (torch.tensor([1.0]), gl.GadgetTypeError),
    "bool": (torch.tensor([True]), gl.GadgetTypeError),
}


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("case", sorted(LOOKUP_BAD))
def test_offloaded_embedding_refuses_bad_ids_before_forward_returns(case, grad):
    emb = _emb()
    _opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    ref = emb.weight.getNumpyVersion().copy()
    ids, exc = LOOKUP_BAD[case]
    with torch.set_grad_enabled(grad), pytest.raises(exc):
        emb(ids)
    _opt.step()  # nothing to step: the refused lookup left nothing behind
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), ref)
    out = emb(torch.tensor([1, 1, 2]))
    np.testing.assert_array_equal(out.detach().numpy(), ref[[1, 1, 2]])


def test_offloaded_embedding_constructor_refusals():
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedEmbedding(0, 4, placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedEmbedding(4, 0, placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedEmbedding(3.5, 4, placement="cpu")
    with pytest.raises(TypeError):
        gl.OffloadedEmbedding(3, 4, placement="cpu", padding_idx=0)
    with pytest.raises(gl.GadgetKeyError):
        gl.OffloadedEmbedding(3, 4, placement="file")
    with pytest.raises(gl.GadgetKeyError):
        gl.OffloadedEmbedding(3, 4, placement="gpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedEmbedding(3, 4, placement="cpu", dtype=torch.int64)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedEmbedding(3, 4, placement="cpu", init=3)


LSD_BAD = {
    "shape": lambda: {"weight": torch.zeros(11, 5)},
    "numpy-shape": lambda: {"weight": np.zeros((12, 4), np.float32)},
    "integer-values": lambda: {"weight": torch.zeros(12, 5, dtype=torch.int64)},
    "missing": lambda: {},
    "unexpected": lambda: {"weight": torch.zeros(12, 5), "x": torch.zeros(1)},
}


@pytest.mark.parametrize("case", sorted(LSD_BAD))
def test_module_load_state_dict_refusals_are_torch_style(case):
    emb = _emb()
    ref = emb.weight.getNumpyVersion().copy()
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict"):
        emb.load_state_dict(LSD_BAD[case]())
    if case == "unexpected":
        # as torch: the fitting table is loaded, then the unexpected key is reported
        lin = torch.nn.Linear(2, 2)
        with pytest.raises(RuntimeError):
            lin.load_state_dict(
                {"weight": torch.zeros(2, 2), "bias": torch.zeros(2), "x": torch.zeros(1)}
            )
        assert not lin.weight.detach().any()
        ref = np.zeros_like(ref)
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), ref)


def test_table_changes_refused_while_training_lookup_waits():
    emb = _emb()
    _opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    ref = emb.weight.getNumpyVersion().copy()
    out = emb(torch.tensor([1, 2])).sum()
    for call in (
        lambda: emb.weight.fill_(0.0),
        lambda: emb.weight.insertData(torch.zeros(1, 5), [3]),
        lambda: emb.weight.zero_(),
        lambda: emb.weight.uniform_(0, 1),
    ):
        with pytest.raises(gl.GadgetError):
            call()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), ref)
    out.backward()
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict"):
        emb.load_state_dict({"weight": torch.zeros(12, 5)})
    with pytest.raises(gl.GadgetError):
        emb.weight.fill_(0.0)
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), ref)
    _opt.step()
    changed = emb.weight.getNumpyVersion()
    assert not np.array_equal(changed[[1, 2]], ref[[1, 2]])
    np.testing.assert_array_equal(changed[[0, 3, 4]], ref[[0, 3, 4]])
    emb.weight.fill_(0.0)  # allowed again after the step
    assert not emb.weight.getNumpyVersion().any()


def test_gradient_after_step_is_reported_not_applied():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    y = emb(torch.tensor([3])).sum()
    opt.step()
    y.backward()
    ref = emb.weight.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError):
        opt.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), ref)
    opt.zero_grad()
    opt.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), ref)


def test_embedding_bag_refusals():
    bag = _emb(bag=True, mode="sum")
    ref = bag.weight.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetIndexError):
        bag(torch.tensor([[1, 12]]))
    with pytest.raises(gl.GadgetValueError):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 5]))
    with pytest.raises(gl.GadgetValueError):
        bag(torch.tensor([1, 2, 3]), torch.tensor([2, 0]))
    with pytest.raises(gl.GadgetTypeError):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0.0, 1.0]))
    with pytest.raises(gl.GadgetValueError):
        bag(torch.tensor([1, 2, 3]))
    with pytest.raises(gl.GadgetValueError):
        bag(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(3))
    with pytest.raises(gl.GadgetError):
        gl.OffloadedEmbeddingBag(10, 4, mode="median", placement="cpu")
    np.testing.assert_array_equal(bag.weight.getNumpyVersion(), ref)
    out = bag(torch.tensor([[1, 2], [2, 2]]))
    np.testing.assert_allclose(out.detach().numpy(), np.stack([ref[1] + ref[2], 2 * ref[2]]))


class _Net(torch.nn.Module):
    def __init__(self, n=12):
        super().__init__()
        torch.manual_seed(0)
        self.emb = gl.OffloadedEmbedding(n, 5, placement="cpu", device="cpu")
        self.head = torch.nn.Linear(5, 1)


def test_optimizer_constructor_refusals():
    m = _Net()
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, [m.emb.weight], lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.LBFGS, m, lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1, differentiable=True)
    with pytest.raises(TypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, {m.emb}, lr=0.1)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.Adam, [{"params": m.emb}, {"params": m.emb}], lr=0.1)

    class OnlyTables(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")

    with pytest.raises(gl.GadgetError) as info:
        gl.OffloadedOptimizer(torch.optim.Adam, OnlyTables().parameters(), lr=0.1)
    assert "parameters()" in str(info.value)
    with pytest.warns(UserWarning):
        gl.OffloadedOptimizer(torch.optim.Adam, m.head.parameters(), lr=0.1)


def test_optimizer_load_state_dict_refusals_change_nothing():
    m = _Net()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    m.head(m.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    m2 = _Net()
    opt2 = gl.OffloadedOptimizer(torch.optim.NAdam, m2, lr=0.1)
    st2 = {k: t.getNumpyVersion().copy() for k, t in opt2.pagers[0].tables.items()}
    with pytest.raises(gl.GadgetValueError):
        opt2.load_state_dict(sd)
    for k, t in opt2.pagers[0].tables.items():
        np.testing.assert_array_equal(t.getNumpyVersion(), st2[k])
    st = {k: t.getNumpyVersion().copy() for k, t in opt.pagers[0].tables.items()}
    with pytest.raises(gl.GadgetError):
        opt.load_state_dict({"foo": 1})
    for k, t in opt.pagers[0].tables.items():
        np.testing.assert_array_equal(t.getNumpyVersion(), st[k])


def test_interleaved_table_load_refusals_keep_rows_and_state(tmp_path):
    m = _Net()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    m.emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    opt.zero_grad()
    w = m.emb.weight.getNumpyVersion().copy()
    st = {k: t.getNumpyVersion().copy() for k, t in opt.pagers[0].tables.items()}
    np.save(tmp_path / "e11.npy", np.zeros((11, 5), np.float32))
    np.save(tmp_path / "e64.npy", np.zeros((12, 5), np.float64))
    np.save(tmp_path / "ok.npy", np.ones((12, 5), np.float32))
    raw = (tmp_path / "ok.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[:-4])
    for name, exc in (
        ("e11.npy", gl.GadgetValueError),
        ("e64.npy", gl.GadgetTypeError),
        ("cut.npy", gl.GadgetFileError),
        ("nope.npy", gl.GadgetFileNotFoundError),
    ):
        for method in ("load", "loadCupy"):
            with pytest.raises(exc):
                getattr(m.emb.weight, method)(str(tmp_path / name))
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many([m.emb.weight] + list(opt.pagers[0].tables.values()), [12])
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(
            [m.emb.weight] + list(opt.pagers[0].tables.values()),
            [torch.ones(1, 5), torch.ones(1, 5), torch.ones(1, 5, dtype=torch.float64)],
            [1],
        )
    np.testing.assert_array_equal(m.emb.weight.getNumpyVersion(), w)
    for k, t in opt.pagers[0].tables.items():
        np.testing.assert_array_equal(t.getNumpyVersion(), st[k])
    m.emb.weight.load(str(tmp_path / "ok.npy"))
    np.testing.assert_array_equal(m.emb.weight.getNumpyVersion(), np.ones((12, 5), np.float32))
    for k, t in opt.pagers[0].tables.items():
        np.testing.assert_array_equal(t.getNumpyVersion(), st[k])


# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------


def test_checkpoint_refusals(tmp_path):
    m = _Net()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    d = str(tmp_path / "ck")
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(d, [m])
    for bad in ("a/b", "..", ".", "", "a\x00b"):
        with pytest.raises(gl.GadgetValueError):
            gl.save_checkpoint(d, {bad: m})
    with pytest.raises(gl.GadgetKeyError):
        gl.save_checkpoint(d, {"m": m}, format="csv")
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(gl.GadgetFileError):
        gl.save_checkpoint(str(tmp_path / "afile"), {"m": m, "o": opt})
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(str(tmp_path / "nock"), {"m": m, "o": opt})


@pytest.mark.parametrize(
    "damage", ["wrong-names", "wrong-shape", "truncated-table", "missing-table", "closed-table"]
)
def test_load_checkpoint_refusals_leave_objects_unchanged(tmp_path, damage):
    m = _Net()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    m.head(m.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    opt.zero_grad()
    d = str(tmp_path / "ck")
    gl.save_checkpoint(d, {"m": m, "o": opt})
    n = 13 if damage == "wrong-shape" else 12
    m2 = _Net(n)
    with torch.no_grad():
        m2.head.weight.fill_(0.25)
    o2 = gl.OffloadedOptimizer(torch.optim.Adam, m2, lr=0.1)
    w2 = m2.emb.weight.getNumpyVersion().copy()
    tables = sorted(f for f in os.listdir(d) if f.endswith(".npy"))
    objects = {"m": m2, "o": o2}
    exc = gl.GadgetError
    if damage == "wrong-names":
        objects = {"model": m2, "o": o2}
        exc = gl.GadgetKeyError
    elif damage == "wrong-shape":
        exc = gl.GadgetValueError
    elif damage == "truncated-table":
        p = os.path.join(d, tables[-1])
        with open(p, "rb") as f:
            raw = f.read()
        with open(p, "wb") as f:
            f.write(raw[:-8])
        exc = gl.GadgetFileError
    elif damage == "missing-table":
        os.remove(os.path.join(d, tables[-1]))
        exc = gl.GadgetFileNotFoundError
    elif damage == "closed-table":
        m2.emb.weight.close()
        exc = gl.GadgetClosedError
    with pytest.raises(exc):
        gl.load_checkpoint(d, objects)
    assert torch.all(m2.head.weight == 0.25)
    if damage != "closed-table":
        np.testing.assert_array_equal(m2.emb.weight.getNumpyVersion(), w2)
        for t in o2.pagers[0].tables.values():
            assert not t.getNumpyVersion().any()


# ---------------------------------------------------------------------------------------
# SpeedTorch's switchers
# ---------------------------------------------------------------------------------------


class _W2V(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.u = torch.nn.Embedding(4, 3)

    def forward(self, x):
        return self.u(x).sum()


def _switchers(factory="pytorch"):
    m = _W2V()
    optim = torch.optim.Adam(m.parameters(), lr=0.1)
    if factory == "pytorch":
        sw = gl.PytorchModelFactory(m.u, 12, 3, deviceType="cpu")
        osw = gl.PytorchOptimizerFactory(optim, 12, 3, m, "u", deviceType="cpu")
    else:
        sw = gl.ModelFactory(m.u, 12, 3, placement="cpu")
        osw = gl.OptimizerFactory(optim, 12, 3, m, "u", placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    osw.optInit()
    return m, optim, sw, osw


def _snap(sw, osw):
    return sw.getNumpyVersion().copy(), {k: v.copy() for k, v in osw.getNumpyVersion().items()}


def _assert_snap(sw, osw, snap):
    np.testing.assert_array_equal(sw.getNumpyVersion(), snap[0])
    cur = osw.getNumpyVersion()
    assert sorted(cur) == sorted(snap[1])
    for k in cur:
        np.testing.assert_array_equal(cur[k], snap[1][k])


SWITCH_BAD_IDS = {
    "past-end": ((torch.tensor([1, 12]),), gl.GadgetIndexError),
    "negative": ((torch.tensor([-1, 2]),), gl.GadgetIndexError),
    "negatives-past-end": ((torch.tensor([1]), torch.tensor([12])), gl.GadgetIndexError),
    "float": ((torch.tensor([1.0]),), gl.GadgetTypeError),
    "bool": ((torch.tensor([True]),), gl.GadgetTypeError),
    "string": (("1",), gl.GadgetTypeError),
}


@pytest.mark.parametrize("factory", ["pytorch", "speedtorch"])
@pytest.mark.parametrize("case", sorted(SWITCH_BAD_IDS))
def test_switchers_refuse_bad_ids(factory, case):
    m, optim, sw, osw = _switchers(factory)
    snap = _snap(sw, osw)
    var = m.u.weight.detach().clone()
    args, exc = SWITCH_BAD_IDS[case]
    with pytest.raises(exc):
        sw.beforeForwardPass(*args)
    with pytest.raises(exc):
        osw.beforeForwardPass(*args)
    assert not sw.step_under_way()
    assert torch.equal(m.u.weight.detach(), var)
    _assert_snap(sw, osw, snap)


def test_switchers_refuse_changes_while_step_under_way(tmp_path):
    m, optim, sw, osw = _switchers()
    sw.saveTorch(str(tmp_path / "t.pt"))
    sw.saveCupy(str(tmp_path / "t"))
    osw.saveTorch(str(tmp_path / "s.pt"))
    ids = torch.tensor([1, 2, 1])
    loc = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    snap = _snap(sw, osw)
    calls = [
        lambda: sw.zerosInit(),
        lambda: sw.uniformDistributionInit(0, 1),
        lambda: sw.normalDistributionInit(0, 1),
        lambda: sw.customInit(torch.nn.init.zeros_),
        lambda: osw.customInit(torch.nn.init.zeros_),
        lambda: sw.loadCupy(str(tmp_path / "t.npy")),
        lambda: sw.loadTorch(str(tmp_path / "t.pt")),
        lambda: osw.loadTorch(str(tmp_path / "s.pt")),
        lambda: sw.table.insertData(torch.ones(1, 3), [5]),
        lambda: gl.scatter_many([sw.table], [torch.ones(1, 3)], [5]),
    ]
    for call in calls:
        with pytest.raises(gl.GadgetValueError):
            call()
    _assert_snap(sw, osw, snap)
    m(loc).backward()
    optim.step()
    with pytest.raises(gl.GadgetValueError):
        sw.afterOptimizerStep(torch.tensor([1, 3, 1]))
    _assert_snap(sw, osw, snap)
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)
    after = sw.getNumpyVersion()
    assert not np.array_equal(after[[1, 2]], snap[0][[1, 2]])
    np.testing.assert_array_equal(after[[0, 3]], snap[0][[0, 3]])
    sw.zerosInit()  # allowed again
    assert not sw.getNumpyVersion().any()


def test_switcher_file_refusals_change_nothing(tmp_path):
    m, optim, sw, osw = _switchers()
    snap = _snap(sw, osw)
    torch.save(torch.zeros(11, 3), tmp_path / "shape.pt")
    np.save(tmp_path / "shape.npy", np.zeros((11, 3), np.float32))
    np.save(tmp_path / "f64.npy", np.zeros((12, 3), np.float64))
    torch.save(torch.full((12, 3), 0.1, dtype=torch.float64), tmp_path / "inexact.pt")
    torch.save(
        {"exp_avg": torch.zeros(11, 3), "exp_avg_sq": torch.zeros(11, 3)}, tmp_path / "s_shape.pt"
    )
    torch.save({"exp_avg": torch.zeros(12, 3)}, tmp_path / "s_missing.pt")
    torch.save(
        {"exp_avg": torch.ones(12, 3), "exp_avg_sq": torch.zeros(12, 3, dtype=torch.int64)},
        tmp_path / "s_int.pt",
    )
    torch.save(
        {"exp_avg": torch.ones(12, 3), "exp_avg_sq": torch.zeros(12, 4)}, tmp_path / "s_second.pt"
    )
    torch.save([torch.ones(12, 3)], tmp_path / "s_list.pt")
    cases = [
        (lambda: sw.loadTorch(str(tmp_path / "shape.pt")), gl.GadgetValueError),
        (lambda: sw.loadCupy(str(tmp_path / "shape.npy")), gl.GadgetValueError),
        (lambda: sw.loadCupy(str(tmp_path / "f64.npy")), gl.GadgetTypeError),
        (lambda: sw.loadTorch(str(tmp_path / "inexact.pt")), gl.GadgetTypeError),
        (lambda: sw.loadTorch(str(tmp_path / "nope.pt")), gl.GadgetFileNotFoundError),
        (lambda: sw.loadCupy(str(tmp_path / "nope.npy")), gl.GadgetFileNotFoundError),
        (lambda: sw.saveCupy(None), gl.GadgetTypeError),
        (lambda: sw.saveTorch(None), gl.GadgetTypeError),
        (lambda: osw.loadTorch(str(tmp_path / "s_shape.pt")), gl.GadgetValueError),
        (lambda: osw.loadTorch(str(tmp_path / "s_missing.pt")), gl.GadgetError),
        (lambda: osw.loadTorch(str(tmp_path / "s_int.pt")), gl.GadgetTypeError),
        (lambda: osw.loadTorch(str(tmp_path / "s_second.pt")), gl.GadgetValueError),
        (lambda: osw.loadTorch(str(tmp_path / "s_list.pt")), gl.GadgetError),
        (lambda: osw.saveTorch(None), gl.GadgetTypeError),
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
        _assert_snap(sw, osw, snap)


def test_switcher_constructor_refusals():
    emb = torch.nn.Embedding(4, 3)
    with pytest.raises(gl.GadgetValueError):
        gl.PytorchModelFactory(torch.nn.Embedding(4, 5), 12, 3, deviceType="cpu")
    with pytest.raises(gl.GadgetError):
        gl.PytorchModelFactory(emb, 12, 3, deviceType="tpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.PytorchModelFactory(emb, 12, 3, deviceType="cpu", pinType="False")
    with pytest.raises(gl.GadgetTypeError):
        gl.ModelFactory(emb, 12, 3, CPUPinn="False", placement="cpu")
    with pytest.raises(gl.GadgetKeyError):
        gl.ModelFactory(emb, 12, 3, placement="file")
    with pytest.raises(gl.GadgetError):
        gl.ModelFactory(emb, 12, 3, placement="cpu", duplicates="x")
    with pytest.raises(gl.GadgetValueError):
        gl.ModelFactory(emb, 0, 3, placement="cpu")
    m = _W2V()
    optim = torch.optim.Adam(m.parameters(), lr=0.1)
    with pytest.raises(gl.GadgetKeyError):
        gl.OptimizerFactory(optim, 12, 3, m, "nope", placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.OptimizerFactory(torch.optim.LBFGS(m.parameters()), 12, 3, m, "u", placement="cpu")


# ---------------------------------------------------------------------------------------
# the data pipeline
# ---------------------------------------------------------------------------------------


@pytest.fixture()
def ds():
    x = BASE.copy()
    y = np.arange(12)
    return gl.GadgetDataset(x, y, placement="cpu", device="cpu")


DS_BAD = {
    "list-past-end": ([12], gl.GadgetIndexError),
    "list-negative": ([-1], gl.GadgetIndexError),
    "int-past-end": (12, gl.GadgetIndexError),
    "int-below-minus-len": (-13, gl.GadgetIndexError),
    "0d-tensor-negative": (torch.tensor(-1), gl.GadgetIndexError),
    "0d-array-past-end": (np.array(12), gl.GadgetIndexError),
    "range-past-end": (range(10, 13), gl.GadgetIndexError),
    "float-list": ([1.0], gl.GadgetTypeError),
    "float": (1.0, gl.GadgetTypeError),
    "bool-list": ([True, False], gl.GadgetTypeError),
    "bool": (True, gl.GadgetTypeError),
    "bool-tensor": (torch.tensor([True]), gl.GadgetTypeError),
    "string": ("a", gl.GadgetTypeError),
    "uint64-huge": (np.array([2**63], dtype=np.uint64), gl.GadgetIndexError),
}


@pytest.mark.parametrize("case", sorted(DS_BAD))
def test_dataset_refuses_bad_ids(ds, case):
    ids, exc = DS_BAD[case]
    with pytest.raises(exc):
        ds[ids]
    x, y = ds[-1]
    np.testing.assert_array_equal(x.numpy(), BASE[-1])
    assert int(y) == 11


@pytest.mark.parametrize(
    "ids, exc",
    [
        ([1, 12], gl.GadgetIndexError),
        ([1, -1], gl.GadgetIndexError),
        ([1, True], gl.GadgetTypeError),
        ([1, 2.0], gl.GadgetTypeError),
    ],
)
def test_dataset_getitems_default_form_refusals(ds, ids, exc):
    with pytest.raises(exc):
        ds.__getitems__(ids)
    with pytest.raises(exc):
        ds.gather(ids)


def test_dataset_construction_refusals(tmp_path):
    x = BASE.copy()
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(x, np.arange(5), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(placement="cpu")
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.GadgetDataset(str(tmp_path / "nope.npy"), placement="cpu")
    with pytest.raises(gl.GadgetKeyError):
        gl.GadgetDataset(x, placement="gpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(np.zeros((0, 4), np.float32), placement="cpu")
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("emb", data=x)
    with pytest.raises(gl.GadgetKeyError) as info:
        gl.GadgetDataset(str(tmp_path / "d.h5"), dataset="nope", placement="file")
    assert "emb" in str(info.value)


def test_dataset_column_reloaded_to_other_row_count(tmp_path):
    g = gl.DataGadget(BASE, placement="cpu", device="cpu")
    d = gl.GadgetDataset(g, device="cpu")
    np.save(tmp_path / "five.npy", BASE[:5])
    g.load(str(tmp_path / "five.npy"))
    with pytest.raises(gl.GadgetValueError):
        d[[1]]
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.GadgetDataset(g, device="cpu")[[0]]


SAMPLER_BAD = {
    "batch-size-0": (dict(batch_size=0), gl.GadgetValueError),
    "batch-size-float": (dict(batch_size=2.0), gl.GadgetTypeError),
    "order": (dict(batch_size=2, order="shuffle"), gl.GadgetKeyError),
    "seed-negative": (dict(batch_size=2, seed=-1), gl.GadgetValueError),
    "seed-2**64": (dict(batch_size=2, seed=2**64), gl.GadgetValueError),
    "drop-last-no-batch": (dict(batch_size=20, drop_last=True), gl.GadgetValueError),
    "drop-last-and-pad": (dict(batch_size=2, drop_last=True, pad=True), gl.GadgetValueError),
    "replicas-without-rank": (dict(batch_size=2, num_replicas=2), gl.GadgetValueError),
    "rank-out-of-range": (dict(batch_size=2, num_replicas=2, rank=2), gl.GadgetValueError),
    "window-chunks-0": (dict(batch_size=2, window_chunks=0), gl.GadgetValueError),
    "chunk-rows-float": (dict(batch_size=2, chunk_rows=2.5), gl.GadgetTypeError),
    "coalesce-0": (dict(batch_size=2, coalesce=0), gl.GadgetValueError),
    "drop-last-string": (dict(batch_size=2, drop_last="False"), gl.GadgetTypeError),
}


@pytest.mark.parametrize("case", sorted(SAMPLER_BAD))
def test_sampler_refusals(ds, case):
    kw, exc = SAMPLER_BAD[case]
    with pytest.raises(exc):
        gl.GadgetSampler(ds, **kw)


def test_sampler_refuses_a_path(tmp_path):
    np.save(tmp_path / "a.npy", BASE)
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetSampler(str(tmp_path / "a.npy"), batch_size=2)


def test_sampler_state_refusals_leave_sampler_unchanged(ds):
    s = gl.GadgetSampler(ds, batch_size=3, seed=1)
    it = iter(s)
    next(it)
    saved = s.state_dict()
    s2 = gl.GadgetSampler(ds, batch_size=4, seed=5)
    before = s2.state_dict()
    expected = [b.tolist() for b in gl.GadgetSampler(ds, batch_size=4, seed=5)]
    with pytest.raises(gl.GadgetValueError):
        s2.load_state_dict(saved)
    with pytest.raises(gl.GadgetTypeError):
        s2.load_state_dict([1])
    with pytest.raises(gl.GadgetValueError):
        s2.load_state_dict({"x": 1})
    assert s2.state_dict() == before
    assert [b.tolist() for b in s2] == expected


def test_loader_refusals(ds):
    sampler = gl.GadgetSampler(ds, batch_size=2)
    with pytest.raises(gl.GadgetValueError):
        next(iter(DataLoader(ds, sampler=sampler)))
    for kw in (
        {"shuffle": True},
        {"shuffle": False},
        {"collate_fn": None},
        {"batch_sampler": None},
    ):
        with pytest.raises(gl.GadgetTypeError):
            gl.GadgetLoader(ds, batch_size=2, **kw)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=2), order="random")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=2), seed=0)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=0)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=2, prefetch=-1)
    with pytest.raises(gl.GadgetKeyError):
        gl.GadgetLoader(ds, batch_size=2, order="x")
    with pytest.raises(gl.GadgetTypeError):
        ds[[1, 2]].to(torch.float16)
    batches = [b[0].tolist() for b in gl.GadgetLoader(ds, batch_size=5, order="sequential")]
    assert batches == [BASE[0:5].tolist(), BASE[5:10].tolist(), BASE[10:12].tolist()]


def test_loader_over_file_columns_reports_bad_data(tmp_path):
    p = _write_source("npy", str(tmp_path))
    d = gl.GadgetDataset(p, placement="file", device="cpu")
    with pytest.raises(gl.GadgetIndexError):
        d[[0, 12]]
    os.remove(p)
    with pytest.raises(gl.GadgetFileError):
        d[[0, 1]]
