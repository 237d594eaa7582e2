"""Black-box review (session 32) of GadgetDataset and GadgetBatch in depth (mixed columns,
direct indexing, batches, placement/device on a CPU-only machine, closing, refusals and
DataLoader batches against NumPy); written from README.md, SPEC.md and the public docstrings only."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import (
    ConcatDataset,
    DataLoader,
    RandomSampler,
    StackDataset,
    Subset,
    random_split,
)

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


N = 23
RNG = np.random.default_rng(32)


def to_np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def src_np(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return to_np(a)
    return np.asarray(a)


def quiet_ds(*cols, **kw) -> gl.GadgetDataset:
    """Build a dataset, ignoring the (documented, once per process) FallbackWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        return gl.GadgetDataset(*cols, **kw)


@pytest.fixture
def src():
    """Source arrays of several kinds, dtypes and row shapes (same N rows)."""
    x = RNG.standard_normal((N, 4)).astype(np.float32)
    y = np.arange(N, dtype=np.int64) * 10
    w = torch.from_numpy(RNG.standard_normal(N)).to(torch.float64)
    img = RNG.integers(-100, 100, size=(N, 2, 3)).astype(np.int16)
    mask = RNG.integers(0, 2, size=N).astype(bool)
    return x, y, w, img, mask


@pytest.fixture
def files(tmp_path):
    """The same kinds of data in .npy, HDF5 and zarr files."""
    a = RNG.standard_normal((N, 3)).astype(np.float32)
    b = RNG.integers(0, 1000, size=(N, 2)).astype(np.int32)
    c = RNG.standard_normal(N).astype(np.float64)
    np.save(tmp_path / "a.npy", a)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f.create_dataset("data", data=b, chunks=(5, 2))
    z = zarr.open(str(tmp_path / "c.zarr"), mode="w", shape=(N,), chunks=(4,), dtype="float64")
    z[:] = c
    return {
        "npy": (str(tmp_path / "a.npy"), a),
        "h5": (str(tmp_path / "b.h5"), b),
        "zarr": (str(tmp_path / "c.zarr"), c),
    }


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize("placement", [None, "cpu", "file"])
def test_mixed_kinds_all_columns_match_numpy(src, files, placement):
    x, y, w, img, mask = src
    g_cpu = gl.DataGadget(img, placement="cpu")
    g_file = gl.DataGadget(files["npy"][0], placement="file")
    cols = [x, y, w, g_cpu, g_file, files["h5"][0], files["zarr"][0], mask]
    refs = [x, y, src_np(w), img, files["npy"][1], files["h5"][1], files["zarr"][1], mask]
    ds = quiet_ds(*cols, placement=placement, device="cpu")
    try:
        assert len(ds) == N
        assert len(ds.columns) == len(cols)
        assert ds.columns[3] is g_cpu and ds.columns[4] is g_file
        ids = np.array([5, 0, 22, 5, 11])
        b = ds[ids]
        assert isinstance(b, gl.GadgetBatch)
        assert len(b) == len(cols)
        for t, ref in zip(b, refs, strict=True):
            assert t.device.type == "cpu"
            assert tuple(t.shape) == ids.shape + ref.shape[1:]
            assert to_np(t).dtype == ref.dtype
            np.testing.assert_array_equal(to_np(t), ref[ids])
    finally:
        ds.close()
        g_cpu.close()
        g_file.close()


def test_file_placement_opens_paths_file_backed_and_arrays_in_memory(src, files):
    x = src[0]
    ds = gl.GadgetDataset(files["npy"][0], files["zarr"][0], x, placement="file", device="cpu")
    try:
        assert [c.placement for c in ds.columns] == ["file", "file", "cpu"]
    finally:
        ds.close()


def test_len_columns_and_shapes(src):
    x, y, w, img, mask = src
    ds = gl.GadgetDataset(x, y, w, img, mask, placement="cpu", device="cpu")
    assert len(ds) == N
    cols = ds.columns
    assert all(isinstance(c, gl.DataGadget) for c in cols)
    assert [tuple(c.shape) for c in cols] == [(N, 4), (N,), (N,), (N, 2, 3), (N,)]
    assert [c.dtype for c in cols] == [
        torch.float32,
        torch.int64,
        torch.float64,
        torch.int16,
        torch.bool,
    ]


def test_row_nbytes_sums_columns(src):
    x, y, w, img, mask = src
    ds = gl.GadgetDataset(x, y, w, img, mask, placement="cpu", device="cpu")
    assert ds.row_nbytes == 4 * 4 + 8 + 8 + 2 * 6 + 1


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_device_cpu_explicit(src, device):
    ds = gl.GadgetDataset(src[0], src[1], device=device)
    assert torch.device(ds.device) == torch.device("cpu")
    assert all(t.device.type == "cpu" for t in ds[[1, 2]])
    assert all(t.device.type == "cpu" for t in ds[1])


DTYPES = [
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


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_column_dtype_preserved(dtype, kind):
    a = (RNG.standard_normal((N, 3)) * 50).astype(dtype)
    col = a if kind == "numpy" else torch.from_numpy(a)
    ds = gl.GadgetDataset(col, np.arange(N), placement="cpu", device="cpu")
    ids = [3, 0, 22]
    b = ds[ids]
    assert to_np(b[0]).dtype == a.dtype
    np.testing.assert_array_equal(to_np(b[0]), a[ids])
    row = ds[7][0]
    assert to_np(row).dtype == a.dtype
    np.testing.assert_array_equal(to_np(row), a[7])


def test_bfloat16_tensor_column():
    t = torch.randn(N, 2).to(torch.bfloat16)
    ds = gl.GadgetDataset(t, placement="cpu", device="cpu")
    (got,) = ds[[4, 1]]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, t[[4, 1]])


@pytest.mark.parametrize("row_shape", [(), (1,), (5,), (2, 3), (1, 1, 2)], ids=str)
def test_row_shapes(row_shape):
    a = np.arange(N * int(np.prod(row_shape, dtype=int)), dtype=np.float32).reshape((N, *row_shape))
    ds = gl.GadgetDataset(a, placement="cpu", device="cpu")
    ids = np.array([[1, 2], [22, 0]])
    (got,) = ds[ids]
    assert tuple(got.shape) == ids.shape + row_shape
    np.testing.assert_array_equal(to_np(got), a[ids])
    (row,) = ds[-1]
    assert tuple(row.shape) == row_shape
    np.testing.assert_array_equal(to_np(row), a[-1])


def test_label_column_gives_one_value_per_row():
    y = np.arange(N) * 3
    ds = gl.GadgetDataset(np.ones((N, 2), np.float32), y, placement="cpu", device="cpu")
    _, lab = ds[5]
    assert lab.dim() == 0 and int(lab) == 15
    _, labs = ds[[5, 6]]
    assert labs.shape == (2,) and labs.tolist() == [15, 18]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_sources_are_copied_in(kind):
    a = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    ref = a.copy()
    col = a if kind == "numpy" else torch.from_numpy(a)
    ds = gl.GadgetDataset(col, placement="cpu", device="cpu")
    a[:] = -1
    np.testing.assert_array_equal(to_np(ds[[0, 1, 22]][0]), ref[[0, 1, 22]])


def test_datagadget_columns_used_as_they_are():
    g = gl.DataGadget(np.zeros((N, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(g, np.arange(N), placement="cpu", device="cpu")
    g.insertData(torch.full((1, 2), 7.0), [4])
    assert ds[4][0].tolist() == [7.0, 7.0]
    assert ds[[4]][0].tolist() == [[7.0, 7.0]]


def test_requires_grad_tensor_is_detached():
    t = torch.randn(N, 3, requires_grad=True)
    ds = gl.GadgetDataset(t, placement="cpu", device="cpu")
    (got,) = ds[[1, 2]]
    assert not got.requires_grad
    assert torch.equal(got, t.detach()[[1, 2]])


@pytest.mark.parametrize("layout", ["fortran", "strided", "transposed_tensor"])
def test_non_contiguous_sources(layout):
    base = np.arange(N * 6, dtype=np.float32).reshape(N, 6)
    if layout == "fortran":
        a = np.asfortranarray(base)
        col = a
    elif layout == "strided":
        a = base[:, ::2]
        col = a
    else:
        t = torch.from_numpy(np.ascontiguousarray(base.T)).t()
        assert not t.is_contiguous()
        a = base
        col = t
    ds = gl.GadgetDataset(col, placement="cpu", device="cpu")
    ids = [22, 3, 3, 0]
    np.testing.assert_array_equal(to_np(ds[ids][0]), np.asarray(a)[ids])


def test_hdf5_dataset_option_selects_array(tmp_path):
    p = tmp_path / "m.h5"
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    with h5py.File(p, "w") as f:
        f["labels"] = np.arange(N)
        f["feat"] = x
    with pytest.raises(gl.GadgetKeyError, match="dataset="):
        gl.GadgetDataset(str(p), device="cpu")
    ds = gl.GadgetDataset(str(p), np.arange(N), dataset="feat", placement="file", device="cpu")
    try:
        np.testing.assert_array_equal(to_np(ds[[3, 1]][0]), x[[3, 1]])
    finally:
        ds.close()


@pytest.mark.parametrize("which", ["pathlib", "str"])
def test_path_like_columns(files, which):
    import pathlib

    p, ref = files["npy"]
    ds = gl.GadgetDataset(pathlib.Path(p) if which == "pathlib" else p, device="cpu")
    try:
        np.testing.assert_array_equal(to_np(ds[[0, 22]][0]), ref[[0, 22]])
    finally:
        ds.close()


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "other",
    [
        lambda: np.arange(N - 1),
        lambda: torch.zeros(N + 1, 2),
        lambda: gl.DataGadget(np.zeros((N + 2, 1), np.float32), placement="cpu"),
        lambda: gl.DataGadget((0, 4), dtype="float32", placement="cpu"),
    ],
    ids=["array-short", "tensor-long", "gadget-long", "gadget-empty"],
)
def test_columns_of_different_lengths_refused(src, other):
    col = other()
    with pytest.raises(gl.GadgetValueError, match="same number of rows") as ei:
        gl.GadgetDataset(src[0], col, placement="cpu", device="cpu")
    assert isinstance(ei.value, ValueError)
    assert str(N) in str(ei.value) and str(len(col)) in str(ei.value)


def test_file_column_of_different_length_refused(tmp_path, src):
    np.save(tmp_path / "short.npy", np.zeros((N - 3, 2), np.float32))
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetValueError, match="same number of rows"):
            gl.GadgetDataset(src[0], str(tmp_path / "short.npy"), placement=placement, device="cpu")


@pytest.mark.parametrize(
    "bad",
    [{"a": 1}, [1, 2, 3], 3, 2.5, None, {1, 2}, np.float32(3.0), b"bytes-not-a-path"],
    ids=["dict", "list", "int", "float", "None", "set", "npscalar", "bytes"],
)
def test_unsupported_column_type_refused(src, bad):
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.GadgetDataset(src[0], bad, placement="cpu", device="cpu")
    assert isinstance(ei.value, TypeError)
    assert "column 1" in str(ei.value)


def test_zero_d_column_refused():
    with pytest.raises(gl.GadgetValueError, match="0-d"):
        gl.GadgetDataset(np.array(3.0), placement="cpu", device="cpu")


def test_no_columns_refused():
    with pytest.raises(gl.GadgetValueError, match="at least one column"):
        gl.GadgetDataset(placement="cpu", device="cpu")


@pytest.mark.parametrize(
    "col",
    [
        np.zeros((0, 3), np.float32),
        torch.zeros(0),
        gl.DataGadget((0, 2), dtype="int64", placement="cpu"),
    ],
    ids=["array", "tensor", "gadget"],
)
def test_zero_rows_refused(col):
    with pytest.raises(gl.GadgetValueError, match="empty"):
        gl.GadgetDataset(col, placement="cpu", device="cpu")


@pytest.mark.parametrize(
    "arr",
    [np.zeros(N, complex), np.array(["a"] * N), np.array([object()] * N, dtype=object)],
    ids=["complex", "str", "object"],
)
def test_unsupported_dtype_refused(arr):
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetDataset(np.ones((N, 2), np.float32), arr, placement="cpu", device="cpu")


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_wide_unsigned_column_refused_naming_dtype_option(dtype):
    with pytest.raises(gl.GadgetTypeError, match="dtype="):
        gl.GadgetDataset(np.arange(N, dtype=dtype), placement="cpu", device="cpu")


def test_missing_path_refused(tmp_path, src):
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.GadgetDataset(src[0], str(tmp_path / "nope.npy"), device="cpu")
    assert isinstance(ei.value, FileNotFoundError)
    assert "nope.npy" in str(ei.value)


def test_damaged_file_refused(tmp_path):
    p = tmp_path / "junk.npy"
    p.write_bytes(b"garbage")
    with pytest.raises(gl.GadgetFileError, match="junk.npy"):
        gl.GadgetDataset(str(p), device="cpu")


@pytest.mark.parametrize("placement", ["bogus", "gpus", ""])
def test_unknown_placement_refused(src, placement):
    with pytest.raises(gl.GadgetKeyError, match="placement"):
        gl.GadgetDataset(src[0], placement=placement, device="cpu")


@pytest.mark.parametrize("device", ["bogus", "meta", 1.5])
def test_bad_device_refused(src, device):
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetDataset(src[0], placement="cpu", device=device)


@pytest.mark.parametrize("opt", [{"cache_bytes": 0}, {"dataset": "x"}, {"frobnicate": 1}])
def test_file_options_without_paths_refused(src, opt):
    with pytest.raises(gl.GadgetTypeError, match=list(opt)[0]):
        gl.GadgetDataset(src[0], src[1], placement="cpu", device="cpu", **opt)


# ------------------------------------------------------------------------------ indexing


@pytest.fixture
def ds_xy(src):
    x, y, w, img, mask = src
    ds = gl.GadgetDataset(x, y, img, placement="cpu", device="cpu")
    return ds, (x, y, img)


@pytest.mark.parametrize(
    "i",
    [0, 5, N - 1, -1, -N, np.int64(3), np.int32(-2), np.uint8(7)],
    ids=lambda v: f"{type(v).__name__}{v}",
)
def test_int_index_returns_tuple_of_rows(ds_xy, i):
    ds, refs = ds_xy
    r = ds[i]
    assert type(r) is tuple
    assert len(r) == 3
    for t, ref in zip(r, refs, strict=True):
        assert isinstance(t, torch.Tensor)
        assert tuple(t.shape) == ref.shape[1:]
        np.testing.assert_array_equal(to_np(t), ref[int(i)])


@pytest.mark.parametrize("i", [N, -N - 1, 10**12, np.int64(N)], ids=str)
def test_int_index_out_of_range(ds_xy, i):
    ds, _ = ds_xy
    with pytest.raises(gl.GadgetIndexError) as ei:
        ds[i]
    assert isinstance(ei.value, IndexError)


def test_python_iteration_protocol_stops_at_end(ds_xy):
    ds, (x, y, img) = ds_xy
    rows = list(ds)
    assert len(rows) == N
    np.testing.assert_array_equal(np.stack([to_np(r[0]) for r in rows]), x)
    assert [int(r[1]) for r in rows] == y.tolist()


ID_KINDS = {
    "list": lambda ids: list(ids),
    "tuple": lambda ids: tuple(int(i) for i in ids),
    "np_int64": lambda ids: np.array(ids, np.int64),
    "np_int32": lambda ids: np.array(ids, np.int32),
    "np_uint8": lambda ids: np.array(ids, np.uint8),
    "np_uint64": lambda ids: np.array(ids, np.uint64),
    "np_int8": lambda ids: np.array(ids, np.int8),
    "torch_int64": lambda ids: torch.tensor(ids, dtype=torch.int64),
    "torch_int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
    "torch_int16": lambda ids: torch.tensor(ids, dtype=torch.int16),
    "torch_uint8": lambda ids: torch.tensor(ids, dtype=torch.uint8),
    "np_list_of_npints": lambda ids: [np.int64(i) for i in ids],
    "np_strided": lambda ids: np.repeat(np.array(ids, np.int64), 2)[::2],
}


@pytest.mark.parametrize("kind", list(ID_KINDS))
def test_ids_kinds_give_batch_equal_to_numpy(ds_xy, kind):
    ds, refs = ds_xy
    ids = [22, 0, 7, 7, 3]
    b = ds[ID_KINDS[kind](ids)]
    assert isinstance(b, gl.GadgetBatch)
    for t, ref in zip(b, refs, strict=True):
        assert tuple(t.shape) == (5, *ref.shape[1:])
        np.testing.assert_array_equal(to_np(t), ref[ids])


def test_range_ids(ds_xy):
    ds, refs = ds_xy
    for r in (range(3), range(20, 4, -5), range(0)):
        b = ds[r]
        for t, ref in zip(b, refs, strict=True):
            np.testing.assert_array_equal(to_np(t), ref[list(r)].reshape((len(r), *ref.shape[1:])))


@pytest.mark.parametrize("shape", [(2, 3), (1, 1), (3, 1, 2)], ids=str)
def test_nd_ids_shape(ds_xy, shape):
    ds, refs = ds_xy
    ids = RNG.integers(0, N, size=shape)
    for idk in (ids, torch.from_numpy(ids), ids.tolist(), np.asfortranarray(ids)):
        b = ds[idk]
        for t, ref in zip(b, refs, strict=True):
            assert tuple(t.shape) == shape + ref.shape[1:]
            np.testing.assert_array_equal(to_np(t), ref[ids])


SLICES = [
    slice(2, 5),
    slice(-3, None),
    slice(None, None, -1),
    slice(8, 2, -2),
    slice(100, None),
    slice(5, 2),
    slice(-100, 100),
    slice(None, None, 3),
    slice(np.int64(1), np.int64(4)),
    slice(None, -20, -4),
]


@pytest.mark.parametrize("s", SLICES, ids=str)
def test_slices_follow_python(ds_xy, s):
    ds, refs = ds_xy
    b = ds[s]
    assert isinstance(b, gl.GadgetBatch)
    for t, ref in zip(b, refs, strict=True):
        exp = ref[s]
        assert tuple(t.shape) == exp.shape
        assert to_np(t).dtype == ref.dtype
        np.testing.assert_array_equal(to_np(t), exp)


def test_slice_step_zero_refused(ds_xy):
    ds, _ = ds_xy
    with pytest.raises(gl.GadgetValueError, match="step"):
        ds[::0]


@pytest.mark.parametrize("s", [slice(1.0, 3), slice("a", 3), slice(0, 3, 1.0)], ids=str)
def test_slice_non_integer_bounds_refused(ds_xy, s):
    ds, _ = ds_xy
    with pytest.raises(gl.GadgetTypeError):
        ds[s]


@pytest.mark.parametrize("kind", ["np", "torch"])
def test_zero_d_id_gives_unbatched_batch(ds_xy, kind):
    ds, refs = ds_xy
    i = np.array(4) if kind == "np" else torch.tensor(4)
    b = ds[i]
    assert isinstance(b, gl.GadgetBatch)
    for t, ref in zip(b, refs, strict=True):
        assert tuple(t.shape) == ref.shape[1:]
        np.testing.assert_array_equal(to_np(t), ref[4])


@pytest.mark.parametrize("kind", ["np", "torch"])
@pytest.mark.parametrize("val", [-1, N])
def test_zero_d_id_must_be_in_range(ds_xy, kind, val):
    ds, _ = ds_xy
    i = np.array(val) if kind == "np" else torch.tensor(val)
    with pytest.raises(gl.GadgetIndexError):
        ds[i]


@pytest.mark.parametrize(
    "ids,frag",
    [
        ([1, -1], "negative"),
        ([0, N], "out of range"),
        (np.array([N + 5]), "out of range"),
        (torch.tensor([-3, 2]), "negative"),
        (np.array([2**63], np.uint64), "2**63"),
    ],
    ids=["list-neg", "list-big", "np-big", "torch-neg", "uint64-huge"],
)
def test_ids_out_of_range_refused(ds_xy, ids, frag):
    ds, _ = ds_xy
    with pytest.raises(gl.GadgetIndexError, match=frag.replace("*", r"\*")):
        ds[ids]
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(ids)


@pytest.mark.parametrize(
    "ids",
    [
        [1.5],
        [1, 2.0],
        [True, False],
        np.array([1.0, 2.0]),
        torch.tensor([1.0]),
        np.arange(N) % 2 == 0,
        torch.zeros(N, dtype=torch.bool),
        "abc",
        None,
        1.0,
        ...,
        np.array([1, 2], dtype=object),
        [[1], [2, 3]],
        True,
    ],
    ids=[
        "float-list",
        "mixed-list",
        "bool-list",
        "np-float",
        "torch-float",
        "np-mask",
        "torch-mask",
        "str",
        "None",
        "float",
        "ellipsis",
        "object",
        "ragged",
        "bool",
    ],
)
def test_non_integer_ids_refused(ds_xy, ids):
    ds, _ = ds_xy
    with pytest.raises(gl.GadgetTypeError) as ei:
        ds[ids]
    assert isinstance(ei.value, TypeError)


@pytest.mark.parametrize(
    "empty",
    [[], np.array([], np.int64), torch.tensor([], dtype=torch.int64), range(0)],
    ids=["list", "np", "torch", "range"],
)
def test_empty_ids_give_empty_batch(ds_xy, empty):
    ds, refs = ds_xy
    b = ds[empty]
    assert isinstance(b, gl.GadgetBatch)
    for t, ref in zip(b, refs, strict=True):
        assert tuple(t.shape) == (0, *ref.shape[1:])
        assert to_np(t).dtype == ref.dtype


@pytest.mark.parametrize("how", ["int", "slice", "list", "zero_d", "gather"])
def test_returned_rows_do_not_alias_the_table(ds_xy, how):
    ds, (x, y, img) = ds_xy
    if how == "int":
        r = ds[3][0]
    elif how == "slice":
        r = ds[3:5][0]
    elif how == "list":
        r = ds[[3, 4]][0]
    elif how == "zero_d":
        r = ds[torch.tensor(3)][0]
    else:
        r = ds.gather([3, 4])[0]
    r.fill_(-123.0)
    np.testing.assert_array_equal(to_np(ds[3][0]), x[3])
    np.testing.assert_array_equal(to_np(ds.columns[0].getData([3, 4])), x[[3, 4]])


def test_gather_equals_getitem(ds_xy):
    ds, refs = ds_xy
    ids = np.array([[4, 2], [2, 22]])
    g = ds.gather(ids)
    b = ds[ids]
    assert isinstance(g, gl.GadgetBatch)
    for a, c, ref in zip(g, b, refs, strict=True):
        assert torch.equal(a, c)
        np.testing.assert_array_equal(to_np(a), ref[ids])


def test_getitems_returns_one_element_list(ds_xy):
    ds, refs = ds_xy
    out = ds.__getitems__([9, 1, 9])
    assert isinstance(out, list) and len(out) == 1
    assert isinstance(out[0], gl.GadgetBatch)
    for t, ref in zip(out[0], refs, strict=True):
        np.testing.assert_array_equal(to_np(t), ref[[9, 1, 9]])


@pytest.mark.parametrize(
    "ids,exc",
    [
        ([1, True], gl.GadgetTypeError),
        ([1, -1], gl.GadgetIndexError),
        ([N], gl.GadgetIndexError),
        ([1, 2.0], gl.GadgetTypeError),
    ],
)
def test_getitems_refuses_bad_lists(ds_xy, ids, exc):
    ds, _ = ds_xy
    with pytest.raises(exc):
        ds.__getitems__(ids)


# --------------------------------------------------------------------------- GadgetBatch


def test_batch_is_tuple_unpacks_and_iterates(ds_xy):
    ds, refs = ds_xy
    b = ds[[1, 2, 3]]
    assert isinstance(b, tuple)
    assert len(b) == 3
    x, y, img = b
    assert x.shape == (3, 4) and y.shape == (3,) and img.shape == (3, 2, 3)
    items = list(iter(b))
    assert len(items) == 3 and all(isinstance(t, torch.Tensor) for t in items)
    assert items[1].tolist() == refs[1][[1, 2, 3]].tolist()
    assert repr(b).startswith("GadgetBatch(")


@pytest.mark.parametrize("dev", ["cpu", torch.device("cpu")], ids=str)
def test_batch_to_cpu_no_copy(ds_xy, dev):
    ds, _ = ds_xy
    b = ds[[1, 2]]
    for nb in (False, True):
        moved = b.to(dev, non_blocking=nb)
        assert isinstance(moved, gl.GadgetBatch)
        assert len(moved) == len(b)
        assert all(m is t for m, t in zip(moved, b, strict=True))


@pytest.mark.parametrize(
    "arg",
    [torch.float16, "float16", torch.zeros(1), True, np.float32],
    ids=["torch-dtype", "dtype-str", "tensor", "bool", "np-dtype"],
)
def test_batch_to_refuses_dtype(ds_xy, arg):
    ds, _ = ds_xy
    b = ds[[1, 2]]
    with pytest.raises(gl.GadgetTypeError):
        b.to(arg)
    assert b[0].dtype == torch.float32 and b[1].dtype == torch.int64


def test_batch_to_cuda_index_behaves_like_cuda_device_string(ds_xy):
    """Docstring of GadgetBatch.to: 'Only a device is taken (a torch.device, a string such
    as 'cuda', or a CUDA index)'. So b.to(0) must do what b.to('cuda:0') does; it must not
    be refused as a wrong type. (Without CUDA both fall back to the CPU with the one-per-
    process FallbackWarning, ignored here; a negative index is refused.)"""
    ds, _ = ds_xy
    b = ds[[1, 2]]

    def outcome(dev):
        try:
            out = b.to(dev)
            return ("ok", [str(t.device) for t in out])
        except Exception as e:  # noqa: BLE001 - compare what each call does
            return ("raise", type(e).__name__)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        assert outcome(0) == outcome("cuda:0") == ("ok", ["cpu"] * len(b))
    with pytest.raises(gl.GadgetTypeError, match="CUDA index >= 0"):
        b.to(-1)
    with pytest.raises(gl.GadgetTypeError):
        b.to(None)


def test_batch_pin_memory(ds_xy):
    ds, refs = ds_xy
    b = ds[[1, 2]]
    try:
        torch.zeros(1).pin_memory()
        can_pin = True
    except RuntimeError:
        can_pin = False
    if not can_pin:
        pytest.skip("this machine cannot page-lock memory (torch's pin_memory raises)")
    p = b.pin_memory()
    assert isinstance(p, gl.GadgetBatch)
    for t, ref in zip(p, refs, strict=True):
        assert t.is_pinned()
        np.testing.assert_array_equal(to_np(t), ref[[1, 2]])


def test_batch_pickles_as_batch(ds_xy):
    ds, refs = ds_xy
    b = ds[[4, 0]]
    c = pickle.loads(pickle.dumps(b))
    assert isinstance(c, gl.GadgetBatch)
    for t, u in zip(b, c, strict=True):
        assert torch.equal(t, u)


# ------------------------------------------------------------------------------ closing


def test_close_frees_created_tables_only(src, files):
    x, y = src[0], src[1]
    g_cpu = gl.DataGadget(x, placement="cpu")
    g_file = gl.DataGadget(files["npy"][0], placement="file")
    ds = gl.GadgetDataset(
        g_cpu,
        g_file,
        y,
        torch.from_numpy(x),
        files["h5"][0],
        files["zarr"][0],
        placement="file",
        device="cpu",
    )
    cols = ds.columns
    ds.close()
    ds.close()  # idempotent
    # passed-in DataGadgets keep working
    np.testing.assert_array_equal(to_np(g_cpu.getData([1, 2])), x[[1, 2]])
    np.testing.assert_array_equal(to_np(g_file.getData([1, 2])), files["npy"][1][[1, 2]])
    # created tables are closed
    for c in cols[2:]:
        with pytest.raises(gl.GadgetClosedError):
            c.getData([0])
        assert len(c) == N  # still answers after close
    # the dataset's rows are gone, but len still answers
    assert len(ds) == N
    for idx in (1, [1], slice(0, 2)):
        with pytest.raises(gl.GadgetClosedError):
            ds[idx]
    # files are left as they were
    np.testing.assert_array_equal(np.load(files["npy"][0]), files["npy"][1])
    with h5py.File(files["h5"][0], "r") as f:
        np.testing.assert_array_equal(f["data"][...], files["h5"][1])
    g_cpu.close()
    g_file.close()


def test_with_block_closes(src):
    g = gl.DataGadget(src[0], placement="cpu")
    with gl.GadgetDataset(g, src[1], placement="cpu", device="cpu") as ds:
        assert int(ds[3][1]) == src[1][3]
    with pytest.raises(gl.GadgetClosedError):
        ds[[3]]
    np.testing.assert_array_equal(to_np(g.getData([3])), src[0][[3]])


def test_closed_gadget_column_raises_closed_on_use(src):
    g = gl.DataGadget(src[0], placement="cpu")
    g.close()
    try:
        ds = gl.GadgetDataset(g, placement="cpu", device="cpu")
    except gl.GadgetClosedError:
        return  # refusing at once is fine too
    with pytest.raises(gl.GadgetClosedError):
        ds[[0]]


@pytest.mark.parametrize(
    "idx", [1, [1], slice(0, 2), np.array(1)], ids=["int", "list", "slice", "0d"]
)
def test_column_reloaded_to_other_row_count_refused(tmp_path, src, idx):
    np.save(tmp_path / "five.npy", np.zeros((5, 4), np.float32))
    g = gl.DataGadget(src[0], placement="cpu")
    ds = gl.GadgetDataset(g, src[1], placement="cpu", device="cpu")
    g.load(str(tmp_path / "five.npy"))
    with pytest.raises(gl.GadgetValueError):
        ds[idx]


def test_column_reloaded_same_row_count_sees_new_rows(tmp_path, src):
    new = -np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    np.save(tmp_path / "new.npy", new)
    g = gl.DataGadget(src[0], placement="cpu")
    ds = gl.GadgetDataset(g, src[1], placement="cpu", device="cpu")
    g.load(str(tmp_path / "new.npy"))
    np.testing.assert_array_equal(to_np(ds[[2, 9]][0]), new[[2, 9]])


def test_dataset_pickles_by_value(src, files):
    x, y = src[0], src[1]
    ds = gl.GadgetDataset(x, y, files["npy"][0], placement="file", device="cpu")
    try:
        ds2 = pickle.loads(pickle.dumps(ds))
        assert len(ds2) == N
        b = ds2[[5, 1]]
        np.testing.assert_array_equal(to_np(b[0]), x[[5, 1]])
        np.testing.assert_array_equal(to_np(b[1]), y[[5, 1]])
        np.testing.assert_array_equal(to_np(b[2]), files["npy"][1][[5, 1]])
        ds2.close()
    finally:
        ds.close()


# ----------------------------------------------------------------------------- chunking


def test_chunk_rows(tmp_path):
    for name, n in (("a", 4), ("b", 6), ("c", 7)):
        z = zarr.open(
            str(tmp_path / f"{name}.zarr"), mode="w", shape=(24,), chunks=(n,), dtype="int32"
        )
        z[:] = np.arange(24)
    p = {k: str(tmp_path / f"{k}.zarr") for k in "abc"}
    assert gl.GadgetDataset(p["a"], placement="file", device="cpu").chunk_rows == 4
    assert gl.GadgetDataset(p["a"], p["b"], placement="file", device="cpu").chunk_rows == 12
    # lcm 28 is more than twice the largest (7): the largest
    assert gl.GadgetDataset(p["a"], p["c"], placement="file", device="cpu").chunk_rows == 7
    assert gl.GadgetDataset(p["a"], p["b"], placement="cpu", device="cpu").chunk_rows is None
    assert gl.GadgetDataset(np.arange(24), placement="cpu", device="cpu").chunk_rows is None


# ---------------------------------------------------------------------------- DataLoader


def _all_columns(placement, src, files):
    x, y, w, img, mask = src
    cols = [x, y, w, img, mask, files["npy"][0], files["h5"][0], files["zarr"][0]]
    refs = [x, y, src_np(w), img, mask, files["npy"][1], files["h5"][1], files["zarr"][1]]
    return gl.GadgetDataset(*cols, placement=placement, device="cpu"), refs


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize(
    "batch_size,drop_last",
    [(1, False), (4, False), (7, True), (N, False), (N + 3, False), (5, True)],
)
def test_dataloader_sequential_matches_numpy(src, files, placement, batch_size, drop_last):
    ds, refs = _all_columns(placement, src, files)
    try:
        batches = list(DataLoader(ds, batch_size=batch_size, drop_last=drop_last))
        order = np.arange(N)
        chunks = [order[i : i + batch_size] for i in range(0, N, batch_size)]
        if drop_last:
            chunks = [c for c in chunks if len(c) == batch_size]
        assert len(batches) == len(chunks)
        for b, ids in zip(batches, chunks, strict=True):
            assert isinstance(b, gl.GadgetBatch)
            for t, ref in zip(b, refs, strict=True):
                assert t.device.type == "cpu"
                np.testing.assert_array_equal(to_np(t), ref[ids])
    finally:
        ds.close()


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("seed", [0, 7])
def test_dataloader_random_sampler_matches_numpy(src, files, placement, seed):
    ds, refs = _all_columns(placement, src, files)
    try:
        order = list(RandomSampler(range(N), generator=torch.Generator().manual_seed(seed)))
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(seed))
        batches = list(DataLoader(ds, batch_size=5, sampler=sampler))
        assert len(batches) == 5
        for k, b in enumerate(batches):
            ids = np.array(order[5 * k : 5 * k + 5])
            for t, ref in zip(b, refs, strict=True):
                np.testing.assert_array_equal(to_np(t), ref[ids])
    finally:
        ds.close()


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_dataloader_shuffle_true_rows_stay_together(src, files, placement):
    ds, refs = _all_columns(placement, src, files)
    try:
        labels = []
        for b in DataLoader(
            ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(1)
        ):
            ids = to_np(b[1]) // 10  # y = arange * 10
            labels.extend(ids.tolist())
            for t, ref in zip(b, refs, strict=True):
                np.testing.assert_array_equal(to_np(t), ref[ids])
        assert sorted(labels) == list(range(N))
        assert labels != list(range(N))
    finally:
        ds.close()


def test_dataloader_custom_collate_gets_one_element_list(ds_xy):
    ds, refs = ds_xy
    seen = []

    def collate(batch):
        seen.append((type(batch), len(batch), type(batch[0])))
        return batch[0]

    b = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate)))
    assert seen == [(list, 1, gl.GadgetBatch)]
    np.testing.assert_array_equal(to_np(b[0]), refs[0][:4])


def test_dataloader_batch_size_none_gives_samples(ds_xy):
    ds, refs = ds_xy
    out = list(DataLoader(ds, batch_size=None))
    assert len(out) == N
    np.testing.assert_array_equal(to_np(out[5][0]), refs[0][5])
    assert int(out[5][1]) == refs[1][5]


def test_subset_and_random_split_batches(ds_xy):
    ds, refs = ds_xy
    sub = Subset(ds, [20, 3, 3, 11, 0])
    batches = list(DataLoader(sub, batch_size=2))
    assert all(isinstance(b, gl.GadgetBatch) for b in batches)
    got = np.concatenate([to_np(b[0]) for b in batches])
    np.testing.assert_array_equal(got, refs[0][[20, 3, 3, 11, 0]])
    a, c = random_split(ds, [10, N - 10], generator=torch.Generator().manual_seed(0))
    for part in (a, c):
        for b in DataLoader(part, batch_size=4):
            ids = to_np(b[1]) // 10
            np.testing.assert_array_equal(to_np(b[0]), refs[0][ids])
            np.testing.assert_array_equal(to_np(b[2]), refs[2][ids])


def test_concat_dataset_stacks_samples(ds_xy):
    ds, refs = ds_xy
    cat = ConcatDataset([ds, ds])
    batches = list(DataLoader(cat, batch_size=5))
    assert isinstance(batches[0], list)
    got = np.concatenate([to_np(b[0]) for b in batches])
    np.testing.assert_array_equal(got, np.concatenate([refs[0], refs[0]]))


def test_stack_dataset_refused(ds_xy):
    ds, _ = ds_xy
    with pytest.raises(ValueError, match="output size mismatch"):
        next(iter(DataLoader(StackDataset(ds, ds), batch_size=2)))


@pytest.mark.parametrize("order", ["sequential", "random"])
def test_gadget_sampler_forms_match_numpy(ds_xy, order):
    ds, refs = ds_xy
    ref_batches = [
        np.asarray(b).copy() for b in gl.GadgetSampler(ds, batch_size=4, order=order, seed=3)
    ]
    assert sorted(np.concatenate(ref_batches).tolist()) == list(range(N))
    s1 = gl.GadgetSampler(ds, batch_size=4, order=order, seed=3)
    s2 = gl.GadgetSampler(ds, batch_size=4, order=order, seed=3)
    via_bs = list(DataLoader(ds, batch_sampler=s1))
    via_s = list(DataLoader(ds, sampler=s2, batch_size=None))
    assert len(via_bs) == len(via_s) == len(ref_batches)
    for b1, b2, ids in zip(via_bs, via_s, ref_batches, strict=True):
        assert isinstance(b1, gl.GadgetBatch)
        assert isinstance(b2, list)  # default_convert turns the tuple into a list
        for t1, t2, ref in zip(b1, b2, refs, strict=True):
            np.testing.assert_array_equal(to_np(t1), ref[ids])
            np.testing.assert_array_equal(to_np(t2), ref[ids])


def test_gadget_sampler_as_sampler_without_batch_size_none_refused(ds_xy):
    ds, _ = ds_xy
    s = gl.GadgetSampler(ds, batch_size=4, order="sequential")
    with pytest.raises(gl.GadgetValueError, match="batch_sampler"):
        next(iter(DataLoader(ds, sampler=s)))


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_dataloader_worker_matches_numpy(src, files, placement):
    x, y = src[0], src[1]
    ds = gl.GadgetDataset(x, y, files["h5"][0], files["zarr"][0], placement=placement, device="cpu")
    refs = [x, y, files["h5"][1], files["zarr"][1]]
    try:
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(5))
        order = list(RandomSampler(range(N), generator=torch.Generator().manual_seed(5)))
        batches = list(DataLoader(ds, batch_size=8, sampler=sampler, num_workers=1))
        assert len(batches) == 3
        for k, b in enumerate(batches):
            assert isinstance(b, gl.GadgetBatch)
            ids = np.array(order[8 * k : 8 * k + 8])
            for t, ref in zip(b, refs, strict=True):
                assert t.device.type == "cpu"
                np.testing.assert_array_equal(to_np(t), ref[ids])
    finally:
        ds.close()


# ------------------------------------------------------- placement / device without CUDA

_SUB = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np, torch, gadgetloader as gl
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    y = np.arange(6)
    kw = json.loads(sys.argv[1])
    out = {}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ds = gl.GadgetDataset(x, y, **kw)
        ds2 = gl.GadgetDataset(x, y, **kw)  # a second one: the warning is given once a process
        b = ds[[5, 0]]
        r = ds[2]
    out["warnings"] = [[w.category.__name__, str(w.message)] for w in rec]
    out["placements"] = [c.placement for c in ds.columns] + [c.placement for c in ds2.columns]
    out["device"] = str(ds.device)
    out["batch_devices"] = [t.device.type for t in b] + [t.device.type for t in r]
    out["ok"] = bool(np.array_equal(b[0].numpy(), x[[5, 0]]) and b[1].tolist() == [5, 0]
                     and np.array_equal(r[0].numpy(), x[2]))
    print(json.dumps(out))
    """
)


def _run_cpu_only(kw: dict) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(
        [sys.executable, "-c", _SUB, json.dumps(kw)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_default_placement_is_cpu_silently_without_cuda():
    out = _run_cpu_only({})
    assert out["warnings"] == []
    assert out["placements"] == ["cpu"] * 4
    assert out["device"] == "cpu"
    assert out["batch_devices"] == ["cpu"] * 4
    assert out["ok"]


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_gpu_placement_falls_back_with_one_warning(placement):
    out = _run_cpu_only({"placement": placement})
    cats = [c for c, _ in out["warnings"]]
    assert cats == ["FallbackWarning"], out["warnings"]
    assert placement in out["warnings"][0][1]
    assert out["placements"] == ["cpu"] * 4
    assert out["batch_devices"] == ["cpu"] * 4
    assert out["ok"]


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_falls_back_with_one_warning(device):
    out = _run_cpu_only({"device": device, "placement": "cpu"})
    cats = [c for c, _ in out["warnings"]]
    assert cats == ["FallbackWarning"], out["warnings"]
    assert out["device"] == "cpu"
    assert out["batch_devices"] == ["cpu"] * 4
    assert out["ok"]


def test_explicit_cpu_is_silent():
    out = _run_cpu_only({"device": "cpu", "placement": "cpu"})
    assert out["warnings"] == []
    assert out["placements"] == ["cpu"] * 4
    assert out["ok"]


def test_quiet_ds_gpu_placement_values_in_process(src):
    """In-process: a GPU placement asked for by name still gives the right rows."""
    ds = quiet_ds(src[0], src[1], placement="pinned", device="cpu")
    b = ds[[3, 2]]
    np.testing.assert_array_equal(to_np(b[0]), src[0][[3, 2]])
    assert b[1].tolist() == src[1][[3, 2]].tolist()
    ds.close()


# ------------------------------------------------------------------------- more edges


@pytest.mark.parametrize("i", [2**70, -(2**70), np.int64(2**40)], ids=str)
def test_huge_int_index_is_index_error(ds_xy, i):
    ds, _ = ds_xy
    with pytest.raises(gl.GadgetIndexError):
        ds[i]


@pytest.mark.parametrize("ids", [[2**70], [2**63], [-(2**63) - 1], torch.tensor([2**40])], ids=str)
def test_huge_ids_in_list_are_index_errors(ds_xy, ids):
    ds, _ = ds_xy
    with pytest.raises(gl.GadgetIndexError):
        ds[ids]


@pytest.mark.parametrize(
    "ids,exp",
    [
        (torch.arange(N)[::3], np.arange(N)[::3]),
        (torch.tensor([1, 2]).expand(2, 2), np.array([[1, 2], [1, 2]])),
        (np.array([1, 2]).astype(">i8"), np.array([1, 2])),
        (np.array([[1, 2]]).T, np.array([[1], [2]])),
    ],
    ids=["torch-strided", "torch-expanded", "big-endian", "np-transposed"],
)
def test_unusual_id_layouts(ds_xy, ids, exp):
    ds, refs = ds_xy
    b = ds[ids]
    for t, ref in zip(b, refs, strict=True):
        assert tuple(t.shape) == exp.shape + ref.shape[1:]
        np.testing.assert_array_equal(to_np(t), ref[exp])


def test_int_enum_index(ds_xy):
    import enum

    class E(enum.IntEnum):
        A = 3

    ds, refs = ds_xy
    r = ds[E.A]
    assert type(r) is tuple
    np.testing.assert_array_equal(to_np(r[0]), refs[0][3])


def test_one_row_dataset():
    a = np.arange(3, dtype=np.float64).reshape(1, 3)
    ds = gl.GadgetDataset(a, np.array([7]), placement="cpu", device="cpu")
    assert len(ds) == 1
    for i in (0, -1):
        assert to_np(ds[i][0]).tolist() == [0.0, 1.0, 2.0] and int(ds[i][1]) == 7
    with pytest.raises(gl.GadgetIndexError):
        ds[1]
    (b,) = list(DataLoader(ds, batch_size=4, shuffle=True))
    assert tuple(b[0].shape) == (1, 3) and b[1].tolist() == [7]


def test_same_gadget_twice_not_closed(src):
    g = gl.DataGadget(src[0], placement="cpu")
    ds = gl.GadgetDataset(g, g, placement="cpu", device="cpu")
    b = ds[[2, 4]]
    assert torch.equal(b[0], b[1])
    ds.close()
    np.testing.assert_array_equal(to_np(g.getData([2])), src[0][[2]])
    g.close()


def test_pickled_closed_dataset_stays_closed(src):
    ds = gl.GadgetDataset(src[0], src[1], placement="cpu", device="cpu")
    ds.close()
    d2 = pickle.loads(pickle.dumps(ds))
    assert len(d2) == N
    with pytest.raises(gl.GadgetClosedError):
        d2[[1]]
