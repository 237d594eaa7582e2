"""Black-box review (session 31) of the input pipeline (README "Input pipeline: GPU batches
from DataLoader": GadgetDataset, GadgetSampler, GadgetLoader with torch's DataLoader; batches
on the CPU as documented for a machine without CUDA); written from README.md, SPEC.md and the
public docstrings only."""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    ConcatDataset,
    DataLoader,
    DistributedSampler,
    StackDataset,
    Subset,
    SubsetRandomSampler,
    WeightedRandomSampler,
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


N = 24  # rows of the shared test table
D = 3


def _x(n=N, d=D):
    return (np.arange(n * d, dtype=np.float32).reshape(n, d) * 0.5 - 7.0).astype(np.float32)


def _y(n=N):
    return (np.arange(n, dtype=np.int64) * 7 + 3) % 101


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rev31_pipeline")
    x = _x()
    paths = {}
    paths["npy"] = d / "x.npy"
    np.save(paths["npy"], x)
    paths["h5"] = d / "x.h5"
    with h5py.File(paths["h5"], "w") as f:
        f.create_dataset("grp/feat", data=x, chunks=(5, D))  # the only dataset: dataset= optional
    paths["h5multi"] = d / "multi.h5"
    with h5py.File(paths["h5multi"], "w") as f:
        f.create_dataset("feat", data=x, chunks=(4, D), compression="gzip")
        f.create_dataset("lab", data=_y())
    paths["zarr"] = d / "x.zarr"
    z = zarr.open_array(str(paths["zarr"]), mode="w", shape=x.shape, chunks=(6, D), dtype="float32")
    z[:] = x
    return d, paths


def _source(kind, files):
    """(column, kwargs for GadgetDataset) for one documented source kind."""
    _, p = files
    x = _x()
    if kind == "array":
        return x, {}
    if kind == "tensor":
        return torch.from_numpy(x.copy()), {}
    if kind == "gadget":
        return gl.DataGadget(x, placement="cpu"), {}
    if kind == "npy":
        return str(p["npy"]), {}
    if kind == "npy_file":
        return p["npy"], {"placement": "file"}
    if kind == "h5":
        return str(p["h5"]), {}
    if kind == "h5_file":
        return str(p["h5multi"]), {"placement": "file", "dataset": "feat"}
    if kind == "zarr":
        return str(p["zarr"]), {}
    if kind == "zarr_file":
        return str(p["zarr"]), {"placement": "file"}
    raise AssertionError(kind)


SOURCES = ["array", "tensor", "gadget", "npy", "npy_file", "h5", "h5_file", "zarr", "zarr_file"]


def _ds(kind, files):
    col, kw = _source(kind, files)
    return gl.GadgetDataset(col, _y(), **kw)


def _check_batch(b, ids, x=None, y=None):
    x = _x() if x is None else x
    y = _y() if y is None else y
    ids = np.asarray(ids, dtype=np.int64)
    assert isinstance(b, gl.GadgetBatch)
    assert len(b) == 2
    assert b[0].device.type == "cpu" and b[1].device.type == "cpu"
    assert b[0].dtype == torch.float32 and b[1].dtype == torch.int64
    np.testing.assert_array_equal(b[0].numpy(), x[ids])
    np.testing.assert_array_equal(b[1].numpy(), y[ids])


def _ids_of(b):
    """Row ids of a batch whose first column is _x(): its first value is 1.5 * id - 7."""
    first = b[0][:, 0].numpy().astype(np.float64)
    return ((first + 7.0) / (0.5 * D)).round().astype(np.int64).tolist()


# --------------------------------------------------------------------------------------
# every documented source, batch sizes that do / do not divide the length, drop_last, len()
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs,drop_last", [(4, False), (5, False), (5, True), (30, True)])
@pytest.mark.parametrize("kind", SOURCES)
def test_default_form_sequential_matches_numpy(files, kind, bs, drop_last):
    ds = _ds(kind, files)
    assert len(ds) == N
    loader = DataLoader(ds, batch_size=bs, drop_last=drop_last)
    expect_len = N // bs if drop_last else math.ceil(N / bs)
    assert len(loader) == expect_len
    batches = list(loader)
    assert len(batches) == expect_len
    for k, b in enumerate(batches):
        _check_batch(b, range(k * bs, min((k + 1) * bs, N)))
    seen = sum(len(b[1]) for b in batches)
    assert seen == (N - N % bs if drop_last else N)


@pytest.mark.parametrize("kind", ["array", "npy_file", "h5_file", "zarr_file", "h5", "zarr"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffle_generator_reproducible_and_exact(files, kind, drop_last):
    ds = _ds(kind, files)
    bs = 5

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return list(DataLoader(ds, batch_size=bs, shuffle=True, generator=g, drop_last=drop_last))

    a, b = run(123), run(123)
    # torch's own reference: the same DataLoader arguments over a plain list of ids
    ref = [
        t.tolist()
        for t in DataLoader(
            list(range(N)),
            batch_size=bs,
            shuffle=True,
            generator=torch.Generator().manual_seed(123),
            drop_last=drop_last,
        )
    ]
    assert len(a) == len(ref) == len(b)
    for ba, bb, r in zip(a, b, ref, strict=True):
        _check_batch(ba, r)
        assert torch.equal(ba[0], bb[0]) and torch.equal(ba[1], bb[1])
    flat = sum(ref, [])
    if drop_last:
        assert len(flat) == N - N % bs and len(set(flat)) == len(flat)
    else:
        assert sorted(flat) == list(range(N))
    other = [_ids_of(t) for t in run(124)]
    assert other != ref


def test_shuffle_global_seed_reproducible_and_epochs_differ():
    ds = gl.GadgetDataset(_x(), _y())
    loader = DataLoader(ds, batch_size=7, shuffle=True)
    torch.manual_seed(7)
    e1 = [_ids_of(b) for b in loader]
    e2 = [_ids_of(b) for b in loader]
    torch.manual_seed(7)
    again = [_ids_of(b) for b in loader]
    assert e1 == again
    assert e1 != e2
    for e in (e1, e2):
        assert sorted(sum(e, [])) == list(range(N))
        assert [len(b) for b in e] == [7, 7, 7, 3]


# --------------------------------------------------------------------------------------
# columns: labels, several arrays, dtypes, row shapes
# --------------------------------------------------------------------------------------

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
def test_column_dtypes_and_row_shapes_kept(dtype):
    n = 13
    rng = np.random.default_rng(0)
    a = (rng.integers(0, 100, size=(n, 2, 3)) % (2 if dtype is np.bool_ else 100)).astype(dtype)
    lab = rng.integers(0, 5, size=n).astype(dtype)
    w = rng.standard_normal(n).astype(np.float64)
    ds = gl.GadgetDataset(a, lab, w)
    g = torch.Generator().manual_seed(1)
    ids_ref = [
        t.tolist()
        for t in DataLoader(
            list(range(n)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
    ]
    got = list(DataLoader(ds, batch_size=4, shuffle=True, generator=g))
    assert len(got) == 4
    for b, ids in zip(got, ids_ref, strict=True):
        xa, xl, xw = b
        assert xa.dtype == torch.from_numpy(a).dtype and tuple(xa.shape) == (len(ids), 2, 3)
        assert xl.dtype == torch.from_numpy(lab).dtype and tuple(xl.shape) == (len(ids),)
        assert xw.dtype == torch.float64
        np.testing.assert_array_equal(xa.numpy(), a[ids])
        np.testing.assert_array_equal(xl.numpy(), lab[ids])
        np.testing.assert_array_equal(xw.numpy(), w[ids])


def test_bfloat16_tensor_column():
    t = torch.randn(10, 4).to(torch.bfloat16)
    ds = gl.GadgetDataset(t, torch.arange(10))
    b = next(iter(DataLoader(ds, batch_size=6)))
    assert b[0].dtype == torch.bfloat16
    assert torch.equal(b[0], t[:6]) and torch.equal(b[1], torch.arange(6))


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
@pytest.mark.parametrize("placement", [None, "file"])
@pytest.mark.parametrize("dtype", [np.float16, np.uint8, np.bool_], ids=lambda d: np.dtype(d).name)
def test_file_column_dtypes(tmp_path, fmt, placement, dtype):
    n = 11
    a = (np.arange(n * 4).reshape(n, 2, 2) % (2 if dtype is np.bool_ else 120)).astype(dtype)
    p = tmp_path / f"a.{fmt}"
    if fmt == "npy":
        np.save(p, a)
    elif fmt == "h5":
        with h5py.File(p, "w") as f:
            f.create_dataset("a", data=a, chunks=(3, 2, 2))
    else:
        z = zarr.open_array(str(p), mode="w", shape=a.shape, chunks=(4, 2, 2), dtype=a.dtype)
        z[:] = a
    ds = gl.GadgetDataset(str(p), np.arange(n), placement=placement)
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    for b in DataLoader(ds, batch_sampler=s):
        ids = b[1].numpy()
        assert b[0].dtype == torch.from_numpy(a).dtype
        np.testing.assert_array_equal(b[0].numpy(), a[ids])


def test_columns_must_share_row_count():
    with pytest.raises(gl.GadgetValueError, match="same number of rows"):
        gl.GadgetDataset(_x(), _y(N - 1))
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset()


def test_placement_file_leaves_array_columns_in_memory(files):
    _, p = files
    ds = gl.GadgetDataset(str(p["npy"]), _y(), placement="file")
    assert [c.placement for c in ds.columns] == ["file", "cpu"]
    for b in DataLoader(ds, batch_size=9):
        assert b[0].shape[0] == b[1].shape[0]
    _check_batch(ds[[3, 0, 23]], [3, 0, 23])


def test_hdf5_dataset_option_and_wrong_name(files):
    _, p = files
    ds = gl.GadgetDataset(str(p["h5multi"]), dataset="lab")
    np.testing.assert_array_equal(ds[2:7][0].numpy(), _y()[2:7])
    with pytest.raises(gl.GadgetKeyError, match="feat"):
        gl.GadgetDataset(str(p["h5multi"]), dataset="nope")
    with pytest.raises(gl.GadgetKeyError, match="lab"):
        gl.GadgetDataset(str(p["h5multi"]))


def test_zarr_group_dataset_option(tmp_path):
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    a = g.create_array("a", shape=(9,), dtype="int64")
    a[:] = np.arange(9) * 3
    b = g.create_array("b", shape=(9, 2), dtype="float32")
    b[:] = np.arange(18, dtype=np.float32).reshape(9, 2)
    ds = gl.GadgetDataset(str(tmp_path / "g.zarr"), dataset="b", placement="file")
    got = torch.cat([t[0] for t in DataLoader(ds, batch_size=4)])
    np.testing.assert_array_equal(got.numpy(), np.arange(18, dtype=np.float32).reshape(9, 2))
    with pytest.raises(gl.GadgetKeyError, match="'a'"):
        gl.GadgetDataset(str(tmp_path / "g.zarr"))


# --------------------------------------------------------------------------------------
# dtype conversions (dtype= for paths)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_uint16_file_converts_with_dtype(tmp_path, fmt):
    a = (np.arange(15, dtype=np.uint16) * 4000 + 5).astype(np.uint16)  # values above int16
    p = tmp_path / f"u.{fmt}"
    if fmt == "npy":
        np.save(p, a)
    elif fmt == "h5":
        with h5py.File(p, "w") as f:
            f.create_dataset("u", data=a)
    else:
        z = zarr.open_array(str(p), mode="w", shape=a.shape, chunks=(4,), dtype="uint16")
        z[:] = a
    with pytest.raises(gl.GadgetTypeError, match="int32"):
        gl.GadgetDataset(str(p))
    ds = gl.GadgetDataset(str(p), np.arange(15), dtype="int32")
    assert ds.columns[0].dtype == torch.int32
    got = list(
        DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    )
    for b in got:
        assert b[0].dtype == torch.int32
        np.testing.assert_array_equal(b[0].numpy(), a[b[1].numpy()].astype(np.int64))
    # a file table reads the file as it is: refused there, with that advice
    with pytest.raises(gl.GadgetTypeError, match="file"):
        gl.GadgetDataset(str(p), dtype="int32", placement="file")


def test_uint32_file_to_float32_rounds_and_overflow_refused(tmp_path):
    a = np.array([0, 16777217, 4294967295, 5, 7], dtype=np.uint32)
    p = tmp_path / "u32.npy"
    np.save(p, a)
    ds = gl.GadgetDataset(str(p), dtype="float32")
    got = torch.cat([b[0] for b in DataLoader(ds, batch_size=2)])
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), a.astype(np.int64).astype(np.float32))
    assert got[1].item() == 16777216.0
    ds64 = gl.GadgetDataset(str(p), dtype="int64")
    np.testing.assert_array_equal(ds64[:][0].numpy(), a.astype(np.int64))
    with pytest.raises(gl.GadgetValueError, match="int32"):
        gl.GadgetDataset(str(p), dtype="int32")


def test_dtype_option_must_match_non_uint_file(tmp_path):
    p = tmp_path / "f64.npy"
    np.save(p, np.arange(6, dtype=np.float64))
    with pytest.raises(gl.GadgetTypeError, match="float64"):
        gl.GadgetDataset(str(p), dtype="float32")
    ds = gl.GadgetDataset(str(p), dtype="float64", placement="file")
    assert ds[[5]][0].item() == 5.0


def test_dtype_option_applies_to_paths_only(tmp_path):
    p = tmp_path / "u.npy"
    np.save(p, np.arange(6, dtype=np.uint16))
    lab = np.arange(6, dtype=np.int16)
    ds = gl.GadgetDataset(str(p), lab, dtype="int64")
    b = ds[[1, 4]]
    assert b[0].dtype == torch.int64 and b[1].dtype == torch.int16
    assert b[0].tolist() == [1, 4] and b[1].tolist() == [1, 4]
    with pytest.raises(gl.GadgetTypeError, match="file-path"):
        gl.GadgetDataset(lab, dtype="int64")


@pytest.mark.parametrize(
    "bad",
    [np.arange(5, dtype=np.uint16), np.arange(5, dtype=np.complex64), np.array(list("abcde"))],
    ids=["uint16", "complex", "str"],
)
def test_unsupported_array_dtypes_refused(bad):
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetDataset(bad)


# --------------------------------------------------------------------------------------
# indexing: ds[i], ds[ids], __getitems__ and the documented errors
# --------------------------------------------------------------------------------------


def test_indexing_forms():
    x, y = _x(), _y()
    ds = gl.GadgetDataset(x, y)
    r = ds[-1]
    assert type(r) is tuple and r[0].tolist() == x[-1].tolist() and r[1].item() == y[-1]
    _check_batch(ds[-3:], [21, 22, 23])
    _check_batch(ds[2:20:5], [2, 7, 12, 17])
    _check_batch(ds[range(20, 2, -6)], [20, 14, 8])
    _check_batch(ds[np.array([5, 5, 0], dtype=np.int16)], [5, 5, 0])
    _check_batch(ds[torch.tensor([23, 1], dtype=torch.uint8)], [23, 1])
    z = ds[torch.tensor(4)]
    assert isinstance(z, gl.GadgetBatch) and z[0].shape == (D,) and z[1].shape == ()
    assert z[0].tolist() == x[4].tolist()
    two = ds.gather(np.array([[1, 2], [3, 4]]))
    assert tuple(two[0].shape) == (2, 2, D) and two[1].tolist() == y[[[1, 2], [3, 4]]].tolist()
    items = ds.__getitems__([9, 0, 9])
    assert isinstance(items, list) and len(items) == 1
    _check_batch(items[0], [9, 0, 9])


_BAD_IDS = [
    ("oor", [0, N], gl.GadgetIndexError, IndexError, "out of range"),
    ("neg", [0, -1], gl.GadgetIndexError, IndexError, "negative"),
    ("huge", [0, 2**64], gl.GadgetIndexError, IndexError, r"2\*\*63"),
    ("float", [0.0, 1.0], gl.GadgetTypeError, TypeError, "integers"),
    ("bool-in-list", [1, True], gl.GadgetTypeError, TypeError, "bool"),
    ("str-in-list", ["a", 1], gl.GadgetTypeError, TypeError, "integers"),
    ("float-tensor", torch.tensor([1.0]), gl.GadgetTypeError, TypeError, "integers"),
    ("mask", torch.ones(N, dtype=torch.bool), gl.GadgetTypeError, TypeError, "nonzero"),
    ("np-bool", np.ones(N, dtype=bool), gl.GadgetTypeError, TypeError, "integers"),
    ("0d-oor", torch.tensor(N), gl.GadgetIndexError, IndexError, "out of range"),
    ("0d-neg", np.array(-2), gl.GadgetIndexError, IndexError, "negative"),
]
_BAD_CASES = [
    pytest.param(via, ids, exc, builtin, frag, id=f"{via}-{name}")
    for via in ("getitem", "getitems")
    for name, ids, exc, builtin, frag in _BAD_IDS
    if via != "getitems" or isinstance(ids, list)  # torch hands __getitems__ lists
]


@pytest.mark.parametrize("via,ids,exc,builtin,frag", _BAD_CASES)
def test_bad_ids_refused(via, ids, exc, builtin, frag):
    ds = gl.GadgetDataset(_x(), _y())
    f = {"getitem": ds.__getitem__, "getitems": ds.__getitems__, "gather": ds.gather}[via]
    with pytest.raises(exc, match=frag) as ei:
        f(ids)
    assert isinstance(ei.value, builtin) and isinstance(ei.value, gl.GadgetError)


def test_unusual_id_arrays():
    ds = gl.GadgetDataset(_x(), _y())
    _check_batch(ds[np.arange(N)[::-1][:4]], [23, 22, 21, 20])  # negative strides
    _check_batch(ds.gather(np.arange(N)[::-5]), [23, 18, 13, 8, 3])
    _check_batch(ds[np.broadcast_to(np.array(3), (4,))], [3, 3, 3, 3])  # read-only view
    ro = np.array([1, 2, 3])
    ro.flags.writeable = False
    _check_batch(ds[ro], [1, 2, 3])
    _check_batch(ds[torch.arange(N)[::7]], [0, 7, 14, 21])
    t = torch.arange(10).view(2, 5).t()
    b = ds[t]
    np.testing.assert_array_equal(b[1].numpy(), _y()[t.numpy()])


def test_unusual_column_arrays(tmp_path):
    x = _x()
    np.save(tmp_path / "mm.npy", x)
    ro = x.copy()
    ro.flags.writeable = False
    cols = [
        x[::-1],
        ro,
        np.load(tmp_path / "mm.npy", mmap_mode="r"),
        np.asfortranarray(x),
        torch.from_numpy(x.T.copy()).t(),
    ]
    refs = [x[::-1], x, x, x, x]
    for c, ref in zip(cols, refs, strict=True):
        ds = gl.GadgetDataset(c, _y())
        got = torch.cat([b[0] for b in DataLoader(ds, batch_size=7)]).numpy()
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("kind", ["array", "npy_file", "h5_file", "zarr_file"])
@pytest.mark.parametrize("order", ["sequential", "random"])
def test_sampler_for_more_rows_than_dataset_refused(files, kind, order):
    ds = _ds(kind, files)
    s = gl.GadgetSampler(N + 16, batch_size=N + 16, order=order)
    with pytest.raises(gl.GadgetIndexError, match="out of range"):
        list(DataLoader(ds, batch_sampler=s))
    s = gl.GadgetSampler(N + 16, batch_size=N + 16, order=order)
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(next(iter(s)))
    with pytest.raises(gl.GadgetValueError):
        list(gl.GadgetLoader(ds, sampler=gl.GadgetSampler(N + 16, batch_size=4, order=order)))


@pytest.mark.parametrize("i", [N, -N - 1])
def test_int_index_out_of_range(i):
    ds = gl.GadgetDataset(_x(), _y())
    with pytest.raises(gl.GadgetIndexError):
        ds[i]


def test_bad_ids_through_dataloader_sampler():
    ds = gl.GadgetDataset(_x(), _y())
    loader = DataLoader(ds, sampler=[0, 1, N + 5, 2], batch_size=2)
    it = iter(loader)
    _check_batch(next(it), [0, 1])
    with pytest.raises(gl.GadgetIndexError):
        next(it)


def test_batch_to_takes_device_only():
    ds = gl.GadgetDataset(_x(), _y())
    b = ds[[1, 2]]
    with pytest.raises(gl.GadgetTypeError, match="device"):
        b.to(torch.float16)
    c = b.to("cpu")
    assert isinstance(c, gl.GadgetBatch)
    assert c[0].data_ptr() == b[0].data_ptr() and c[1].data_ptr() == b[1].data_ptr()
    xb, yb = c
    assert yb.dtype == torch.int64


# --------------------------------------------------------------------------------------
# torch datasets / samplers around a GadgetDataset
# --------------------------------------------------------------------------------------


def test_custom_collate_gets_one_element_list():
    ds = gl.GadgetDataset(_x(), _y())
    seen = []

    def collate(batch):
        seen.append((type(batch), len(batch)))
        return batch[0]

    out = list(DataLoader(ds, batch_size=10, collate_fn=collate))
    assert seen == [(list, 1)] * 3
    for k, b in enumerate(out):
        _check_batch(b, range(k * 10, min(k * 10 + 10, N)))


def test_subset_and_random_split_one_gather_values():
    ds = gl.GadgetDataset(_x(), _y())
    sub = Subset(ds, [5, 3, 23, 0, 11])
    got = list(DataLoader(sub, batch_size=2))
    assert [len(b[1]) for b in got] == [2, 2, 1]
    for b, ids in zip(got, [[5, 3], [23, 0], [11]], strict=True):
        _check_batch(b, ids)
    a, b = random_split(ds, [16, 8], generator=torch.Generator().manual_seed(3))
    ids = [int(i) for i in a.indices]
    got = torch.cat([t[1] for t in DataLoader(a, batch_size=5)]).numpy()
    np.testing.assert_array_equal(got, _y()[ids])


def test_concat_dataset_stacks_samples():
    x, y = _x(), _y()
    c = ConcatDataset([gl.GadgetDataset(x[:10], y[:10]), gl.GadgetDataset(x[10:], y[10:])])
    got = list(DataLoader(c, batch_size=7))
    assert len(got) == 4
    for k, b in enumerate(got):
        assert isinstance(b, list) and len(b) == 2
        ids = list(range(k * 7, min(k * 7 + 7, N)))
        np.testing.assert_array_equal(b[0].numpy(), x[ids])
        np.testing.assert_array_equal(b[1].numpy(), y[ids])


def test_stack_dataset_refused_with_documented_message():
    ds = gl.GadgetDataset(_x(), _y())
    with pytest.raises(ValueError, match="output size mismatch"):
        list(DataLoader(StackDataset(ds, ds), batch_size=4))


def test_subset_random_sampler():
    ds = gl.GadgetDataset(_x(), _y())
    pool = [2, 4, 6, 8, 10, 12, 14]
    s = SubsetRandomSampler(pool, generator=torch.Generator().manual_seed(9))
    ref = list(
        BatchSampler(
            SubsetRandomSampler(pool, generator=torch.Generator().manual_seed(9)), 3, False
        )
    )
    got = list(DataLoader(ds, sampler=s, batch_size=3))
    assert len(got) == len(ref) == 3
    for b, ids in zip(got, ref, strict=True):
        _check_batch(b, ids)


def test_weighted_random_sampler_repeats():
    ds = gl.GadgetDataset(_x(), _y())
    w = [0.0] * N
    w[3], w[17] = 1.0, 3.0
    ref = list(
        BatchSampler(
            WeightedRandomSampler(w, 20, generator=torch.Generator().manual_seed(2)), 6, False
        )
    )
    got = list(
        DataLoader(
            ds,
            batch_size=6,
            sampler=WeightedRandomSampler(w, 20, generator=torch.Generator().manual_seed(2)),
        )
    )
    assert len(got) == 4
    for b, ids in zip(got, ref, strict=True):
        _check_batch(b, ids)
    assert set(sum(ref, [])) <= {3, 17}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_distributed_sampler(rank):
    ds = gl.GadgetDataset(_x(), _y())
    ref = list(DistributedSampler(range(N), num_replicas=3, rank=rank, shuffle=True, seed=4))
    got = list(
        DataLoader(
            ds,
            batch_size=3,
            sampler=DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=4),
        )
    )
    assert sum(len(b[1]) for b in got) == len(ref) == 8
    for k, b in enumerate(got):
        _check_batch(b, ref[k * 3 : k * 3 + 3])


# --------------------------------------------------------------------------------------
# GadgetSampler
# --------------------------------------------------------------------------------------


def test_sampler_docstring_examples():
    assert [b.tolist() for b in gl.GadgetSampler(10, batch_size=4, order="sequential")] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert [
        [
            b.tolist()
            for b in gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r)
        ]
        for r in (0, 1)
    ] == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]


@pytest.mark.parametrize("form", ["batch_sampler", "sampler"])
@pytest.mark.parametrize("kind", ["array", "npy_file", "h5_file", "zarr_file"])
def test_sampler_random_epochs_exact(files, form, kind):
    ds = _ds(kind, files)
    s = gl.GadgetSampler(ds, batch_size=5, order="random", seed=11)
    if form == "batch_sampler":
        loader = DataLoader(ds, batch_sampler=s)
    else:
        loader = DataLoader(ds, sampler=s, batch_size=None)
    assert len(loader) == len(s) == 5
    epochs = []
    for e in range(3):
        assert s.epoch == e
        batches = list(loader)
        ids = []
        for b in batches:
            if form == "sampler":
                assert isinstance(b, list)  # default_convert turns the tuple into a list
                b = gl.GadgetBatch(b)
            bid = _ids_of(b)
            _check_batch(b, bid)
            ids.append(bid)
        assert [len(i) for i in ids] == [5, 5, 5, 5, 4]
        flat = sum(ids, [])
        assert sorted(flat) == list(range(N))  # every row exactly once
        assert flat == s.epoch_order(e).tolist()
        epochs.append(flat)
    assert s.epoch == 3
    assert epochs[0] != epochs[1] != epochs[2]
    # same seed, fresh sampler: the same epochs; set_epoch every epoch gives the same result
    s2 = gl.GadgetSampler(N, batch_size=5, seed=11)
    for e in range(3):
        s2.set_epoch(e)
        assert sum((b.tolist() for b in s2), []) == epochs[e]
    s3 = gl.GadgetSampler(N, batch_size=5, seed=12)
    assert sum((b.tolist() for b in s3), []) != epochs[0]


def test_sampler_batches_are_int64_tensors():
    s = gl.GadgetSampler(N, batch_size=5, seed=1)
    for b in s:
        assert isinstance(b, torch.Tensor) and b.dtype == torch.int64 and b.dim() == 1


def test_epoch_order_depends_only_on_seed_and_epoch():
    def order(**kw):
        return gl.GadgetSampler(N, **kw).epoch_order(2).tolist()

    base = order(batch_size=3, seed=5)
    assert sorted(base) == list(range(N))
    assert base == order(batch_size=7, seed=5)
    assert base == order(batch_size=7, seed=5, drop_last=True)
    assert base == order(batch_size=2, seed=5, pad=True)
    assert base == order(batch_size=3, seed=5, num_replicas=3, rank=2)
    assert base == order(batch_size=3, seed=5, coalesce=4)
    assert base != order(batch_size=3, seed=6)
    assert base != gl.GadgetSampler(N, batch_size=3, seed=5).epoch_order(1).tolist()


def test_sampler_seed_bounds():
    gl.GadgetSampler(10, batch_size=2, seed=2**64 - 1)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(10, batch_size=2, seed=2**64)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(10, batch_size=2, seed=-1)


@pytest.mark.parametrize(
    "n,R,B",
    [(21, 2, 3), (13, 2, 3), (10, 3, 4), (7, 7, 1), (50, 4, 5), (9, 2, 2), (24, 1, 5), (24, 1, 24)],
)
def test_sampler_ranks_default_formula(n, R, B):
    samplers = [gl.GadgetSampler(n, batch_size=B, seed=3, num_replicas=R, rank=r) for r in range(R)]
    order = samplers[0].epoch_order(0).tolist()
    lens = {len(s) for s in samplers}
    assert lens == {math.ceil((n // R) / B)}
    allb = []
    for r, s in enumerate(samplers):
        batches = [b.tolist() for b in s]
        assert len(batches) == len(s)
        share = n // R + (1 if r < n % R else 0)
        assert sum(len(b) for b in batches) == share
        assert all(len(b) == B for b in batches[:-1])
        assert 1 <= len(batches[-1]) <= B + 1
        if len(batches[-1]) == B + 1:
            assert (n // R) % B == 0 and r < n % R
        allb.extend(batches)
    assert sum(allb, []) == order  # contiguous shares in rank order, every row once


@pytest.mark.parametrize("n,R,B", [(21, 2, 3), (10, 3, 3), (50, 4, 5), (24, 1, 5), (24, 1, 24)])
def test_sampler_ranks_drop_last_formula(n, R, B):
    samplers = [
        gl.GadgetSampler(n, batch_size=B, seed=3, num_replicas=R, rank=r, drop_last=True)
        for r in range(R)
    ]
    order = samplers[0].epoch_order(0).tolist()
    allb = []
    for s in samplers:
        batches = [b.tolist() for b in s]
        assert len(s) == len(batches) == n // (R * B)
        assert all(len(b) == B for b in batches)
        allb.extend(batches)
    flat = sum(allb, [])
    assert flat == order[: R * B * (n // (R * B))]


@pytest.mark.parametrize("n,R,B", [(21, 2, 3), (10, 3, 4), (5, 1, 12), (50, 4, 5), (3, 2, 4)])
def test_sampler_ranks_pad_formula(n, R, B):
    samplers = [
        gl.GadgetSampler(n, batch_size=B, seed=3, num_replicas=R, rank=r, pad=True)
        for r in range(R)
    ]
    order = samplers[0].epoch_order(0).tolist()
    k = math.ceil(n / (R * B))
    allb = []
    for s in samplers:
        batches = [b.tolist() for b in s]
        assert len(s) == len(batches) == k
        assert all(len(b) == B for b in batches)
        allb.extend(batches)
    flat = sum(allb, [])
    assert flat == [order[i % n] for i in range(R * B * k)]


def test_drop_last_refused_without_a_full_batch():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(10, batch_size=11, drop_last=True)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(10, batch_size=3, drop_last=True, num_replicas=4, rank=0)
    s = gl.GadgetSampler(10, batch_size=10, drop_last=True)
    assert len(s) == 1


def test_drop_last_drops_different_rows_each_epoch():
    s = gl.GadgetSampler(N, batch_size=5, drop_last=True, seed=0)
    dropped = []
    for e in range(4):
        flat = sum((b.tolist() for b in s), [])
        assert len(flat) == 20 and len(set(flat)) == 20
        assert flat == s.epoch_order(e).tolist()[:20]
        dropped.append(frozenset(range(N)) - set(flat))
    assert len(set(dropped)) > 1


@pytest.mark.parametrize(
    "kwargs,exc,frag",
    [
        (dict(batch_size=0), gl.GadgetValueError, "batch_size"),
        (dict(batch_size=2.0), gl.GadgetTypeError, "batch_size"),
        (dict(batch_size=2, order="shuffle"), gl.GadgetKeyError, "sequential"),
        (dict(batch_size=2, drop_last=True, pad=True), gl.GadgetValueError, "exclusive"),
        (dict(batch_size=2, num_replicas=2), gl.GadgetValueError, "rank"),
        (dict(batch_size=2, window_chunks=0), gl.GadgetValueError, "window_chunks"),
        (dict(batch_size=2, window_chunks="8"), gl.GadgetTypeError, "window_chunks"),
        (dict(batch_size=2, chunk_rows=0), gl.GadgetValueError, "chunk_rows"),
        (dict(batch_size=2, coalesce=0), gl.GadgetValueError, "coalesce"),
        (dict(batch_size=2, order="chunk"), gl.GadgetValueError, "chunk"),
    ],
)
def test_sampler_bad_arguments(kwargs, exc, frag):
    with pytest.raises(exc, match=frag):
        gl.GadgetSampler(10, **kwargs)


def test_sampler_refuses_path_and_empty():
    with pytest.raises(gl.GadgetTypeError, match="path"):
        gl.GadgetSampler("features.npy", batch_size=2)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(0, batch_size=2)


def test_sampler_window_chunks_chunk_rows_do_not_change_random_order():
    a = gl.GadgetSampler(N, batch_size=4, seed=8)
    b = gl.GadgetSampler(N, batch_size=4, seed=8, window_chunks=3, chunk_rows=5)
    for _ in range(2):
        assert [t.tolist() for t in a] == [t.tolist() for t in b]
    st = b.state_dict()
    c = gl.GadgetSampler(N, batch_size=4, seed=1)
    c.load_state_dict(st)  # random-order states ignore window_chunks / chunk_rows
    assert c.epoch == b.epoch


def test_sampler_on_gadget_and_numpy_int():
    g = gl.DataGadget(_x(), placement="cpu")
    assert len(gl.GadgetSampler(g, batch_size=5)) == 5
    assert gl.GadgetSampler(np.int64(N), batch_size=5).num_rows == N


def _chunk_windows_ok(order, n, cr, wc):
    """Chunks (cr rows) shuffled, taken wc at a time, rows shuffled within each window."""
    chunk_of = [i // cr for i in range(n)]
    sizes = {}
    for i in range(n):
        sizes[chunk_of[i]] = sizes.get(chunk_of[i], 0) + 1
    window, left = set(), 0
    for row in order:
        c = chunk_of[row]
        if c not in window:
            if len(window) == wc:
                if left:
                    return False
                window = set()
            window.add(c)
            left += sizes[c]
        left -= 1
    return left == 0


@pytest.mark.parametrize("wc", [1, 2, 3, 100])
@pytest.mark.parametrize("kind", ["h5_file", "zarr_file"])
def test_chunk_order_windows(files, kind, wc):
    ds = _ds(kind, files)
    cr = ds.chunk_rows
    assert cr == {"h5_file": 4, "zarr_file": 6}[kind]
    s = gl.GadgetSampler(ds, batch_size=3, order="chunk", window_chunks=wc, seed=2)
    assert s.chunk_rows == cr and s.window_chunks == wc
    loader = DataLoader(ds, batch_sampler=s)
    orders = []
    for e in range(2):
        ids = []
        for b in loader:
            bid = _ids_of(b)
            _check_batch(b, bid)
            ids += bid
        assert sorted(ids) == list(range(N))
        assert ids == s.epoch_order(e).tolist()
        assert _chunk_windows_ok(ids, N, cr, wc), ids
        orders.append(ids)
    assert orders[0] != orders[1]


def test_chunk_order_with_ranks_and_explicit_chunk_rows():
    n, R = 40, 2
    ss = [
        gl.GadgetSampler(
            n,
            batch_size=4,
            order="chunk",
            chunk_rows=5,
            window_chunks=2,
            seed=1,
            num_replicas=R,
            rank=r,
        )
        for r in range(R)
    ]
    flat = sum((b.tolist() for s in ss for b in s), [])
    assert flat == ss[0].epoch_order(0).tolist()
    assert sorted(flat) == list(range(n))
    assert _chunk_windows_ok(flat, n, 5, 2)


def test_chunk_rows_lcm_of_file_columns(tmp_path):
    n = 17

    def h5(name, chunk):
        p = tmp_path / name
        with h5py.File(p, "w") as f:
            f.create_dataset("a", data=np.arange(n, dtype=np.float32), chunks=(chunk,))
        return str(p)

    def zr(name, chunk):
        p = tmp_path / name
        z = zarr.open_array(str(p), mode="w", shape=(n,), chunks=(chunk,), dtype="int64")
        z[:] = np.arange(n)
        return str(p)

    assert gl.GadgetDataset(h5("a.h5", 4), zr("b.zarr", 6), placement="file").chunk_rows == 12
    assert gl.GadgetDataset(h5("c.h5", 4), zr("d.zarr", 5), placement="file").chunk_rows == 5
    assert gl.GadgetDataset(np.arange(n)).chunk_rows is None


# ---- epochs, early breaks, resume --------------------------------------------------------


def test_early_break_restarts_same_epoch_without_workers():
    ds = gl.GadgetDataset(_x(), _y())
    s = gl.GadgetSampler(ds, batch_size=5, seed=4)
    loader = DataLoader(ds, batch_sampler=s)
    it = iter(loader)
    first = [_ids_of(next(it)) for _ in range(2)]
    del it
    assert s.epoch == 0
    full = [_ids_of(b) for b in loader]
    assert full[:2] == first and sum(full, []) == s.epoch_order(0).tolist()
    assert s.epoch == 1


def test_state_dict_resume_mid_epoch_and_refusals():
    s = gl.GadgetSampler(N, batch_size=5, seed=21)
    list(s)  # epoch 0 done
    it = iter(s)
    head = [next(it).tolist() for _ in range(2)]
    st = s.state_dict()
    rest = [b.tolist() for b in it]
    assert head + rest == [s.epoch_order(1)[i : i + 5].tolist() for i in range(0, N, 5)]
    fresh = gl.GadgetSampler(N, batch_size=5, seed=999)
    fresh.load_state_dict(st)
    assert fresh.seed == 21 and fresh.epoch == 1
    assert [b.tolist() for b in fresh] == rest
    assert sum((b.tolist() for b in fresh), []) == s.epoch_order(2).tolist()
    # refusals leave the sampler unchanged
    other = gl.GadgetSampler(N, batch_size=4, seed=3)
    before = other.state_dict()
    with pytest.raises(gl.GadgetValueError, match="batch_size"):
        other.load_state_dict(st)
    assert other.state_dict() == before
    for kw in (
        dict(batch_size=5, order="sequential"),
        dict(batch_size=5, drop_last=True),
        dict(batch_size=5, pad=True),
        dict(batch_size=5, num_replicas=2, rank=0),
    ):
        o = gl.GadgetSampler(N, seed=3, **kw)
        b0 = o.state_dict()
        with pytest.raises(gl.GadgetValueError):
            o.load_state_dict(st)
        assert o.state_dict() == b0
    o = gl.GadgetSampler(N + 1, batch_size=5)
    with pytest.raises(gl.GadgetValueError):
        o.load_state_dict(st)
    with pytest.raises(gl.GadgetTypeError):
        o.load_state_dict([("epoch", 1)])


def test_state_saved_after_last_batch_gives_empty_pass_then_next_epoch():
    s = gl.GadgetSampler(N, batch_size=5, seed=6)
    it = iter(s)
    for _ in range(len(s)):
        next(it)
    st = s.state_dict()
    f = gl.GadgetSampler(N, batch_size=5)
    f.load_state_dict(st)
    assert [b.tolist() for b in f] == []
    assert sum((b.tolist() for b in f), []) == s.epoch_order(1).tolist()


def test_stateful_dataloader_resume():
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")
    ds = gl.GadgetDataset(_x(), _y())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*set_vital.*")
        s = gl.GadgetSampler(ds, batch_size=5, seed=13)
        a = sdl_mod.StatefulDataLoader(ds, batch_sampler=s)
        it = iter(a)
        head = [_ids_of(next(it)) for _ in range(3)]
        st = a.state_dict()
        rest = [_ids_of(b) for b in it]
        s2 = gl.GadgetSampler(ds, batch_size=5, seed=0)
        b = sdl_mod.StatefulDataLoader(ds, batch_sampler=s2)
        b.load_state_dict(st)
        resumed = [_ids_of(t) for t in b]
    assert resumed == rest
    assert sum(head + rest, []) == s.epoch_order(0).tolist()


def test_in_place_changed_ids_are_checked():
    ds = gl.GadgetDataset(_x(), _y())
    s = gl.GadgetSampler(ds, batch_size=5, seed=0)
    b = next(iter(s))
    b[0] = 10**6  # through torch: loses the tag
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(b)
    s = gl.GadgetSampler(ds, batch_size=5, seed=0)
    b = next(iter(s))
    b.numpy()[1] = N  # through NumPy: host columns check anyway
    with pytest.raises(gl.GadgetIndexError):
        ds[b]


def test_in_place_change_is_seen_by_replay_of_epoch():
    s = gl.GadgetSampler(N, batch_size=5, seed=0)
    it = iter(s)
    b = next(it)
    b[1] = b[0]
    changed = b.tolist()
    list(it)
    s.set_epoch(0)
    assert next(iter(s)).tolist() == changed


def test_sampler_without_batch_size_none_refused_when_iterated():
    ds = gl.GadgetDataset(_x(), _y())
    s = gl.GadgetSampler(ds, batch_size=4)
    loader = DataLoader(ds, sampler=s)  # built without complaint (torch does not ask)
    with pytest.raises(gl.GadgetValueError, match="batch_sampler"):
        list(loader)


def test_pickled_sampler_keeps_rank_and_order():
    s = gl.GadgetSampler(N, batch_size=3, seed=5, num_replicas=3, rank=2)
    t = pickle.loads(pickle.dumps(s))
    assert t.rank == 2 and t.num_replicas == 3
    assert [b.tolist() for b in t] == [b.tolist() for b in s]


# --------------------------------------------------------------------------------------
# read-ahead (coalesce) gives the batches of coalesce=1
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["random", "sequential"])
@pytest.mark.parametrize("coalesce", [3, 7])
def test_coalesced_batches_equal_plain(order, coalesce):
    n = 300  # 150 batches of 2: more than one 64-batch sequential segment
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    ds = gl.GadgetDataset(x, np.arange(n))
    s1 = gl.GadgetSampler(ds, batch_size=2, order=order, seed=1, coalesce=1)
    sk = gl.GadgetSampler(ds, batch_size=2, order=order, seed=1, coalesce=coalesce)
    for _ in range(2):
        a = [b for b in DataLoader(ds, batch_sampler=s1)]
        b = [b for b in DataLoader(ds, batch_sampler=sk)]
        assert len(a) == len(b) == 150
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
            np.testing.assert_array_equal(q[0].numpy(), x[q[1].numpy()])
        assert sorted(torch.cat([t[1] for t in b]).tolist()) == list(range(n))


def test_interleaved_loaders_on_one_dataset():
    x = _x()
    ds = gl.GadgetDataset(x, _y())
    s1 = gl.GadgetSampler(ds, batch_size=3, seed=1, coalesce=4)
    s2 = gl.GadgetSampler(ds, batch_size=3, seed=2, coalesce=4)
    for b1, b2 in zip(
        DataLoader(ds, batch_sampler=s1), DataLoader(ds, batch_sampler=s2), strict=True
    ):
        _check_batch(b1, _ids_of(b1))
        _check_batch(b2, _ids_of(b2))
    assert s1.epoch == 1 and s2.epoch == 1


def test_coalesce_one_sees_writes_into_the_table():
    n = 12
    g = gl.DataGadget(np.zeros((n, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(g, np.arange(n))
    s = gl.GadgetSampler(ds, batch_size=3, order="sequential", coalesce=1)
    for k, b in enumerate(DataLoader(ds, batch_sampler=s)):
        assert b[0].tolist() == [[float(k)] * 2] * 3
        nxt = list(range((k + 1) * 3, min((k + 2) * 3, n)))
        if nxt:
            g.insertData(torch.full((len(nxt), 2), float(k + 1)), nxt)


# --------------------------------------------------------------------------------------
# GadgetLoader
# --------------------------------------------------------------------------------------


def test_loader_docstring_example_and_array_input():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert [b[0].tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]
    assert len(loader) == 3
    arr = np.arange(7, dtype=np.int32)
    got = [b for b in gl.GadgetLoader(arr, batch_size=3, order="sequential")]
    assert [len(b) for b in got] == [1, 1, 1]
    assert [b[0].tolist() for b in got] == [[0, 1, 2], [3, 4, 5], [6]]
    assert got[0][0].dtype == torch.int32


@pytest.mark.parametrize(
    "kw,nb,sizes",
    [
        (dict(batch_size=5), 5, [5, 5, 5, 5, 4]),
        (dict(batch_size=5, drop_last=True), 4, [5] * 4),
        (dict(batch_size=5, pad=True), 5, [5] * 5),
        (dict(batch_size=6), 4, [6] * 4),
        (dict(batch_size=50), 1, [24]),
        (dict(batch_size=5, num_replicas=2, rank=1), 3, [5, 5, 2]),
    ],
)
@pytest.mark.parametrize("kind", ["array", "h5_file"])
def test_loader_len_and_contents(files, kind, kw, nb, sizes):
    ds = _ds(kind, files)
    loader = gl.GadgetLoader(ds, seed=9, **kw)
    assert len(loader) == nb
    for e in range(2):
        got = list(loader)
        assert [len(b[1]) for b in got] == sizes
        order = loader.sampler.epoch_order(e).tolist()
        flat = []
        for b in got:
            bid = _ids_of(b)
            _check_batch(b, bid)
            flat += bid
        if kw.get("pad"):
            assert flat == [order[i % N] for i in range(len(flat))]
        elif "rank" in kw:
            assert flat == order[12:]
        else:
            assert flat == order[: len(flat)]


def test_loader_several_epochs_and_same_seed():
    ds = gl.GadgetDataset(_x(), _y())
    a = gl.GadgetLoader(ds, batch_size=7, seed=3)
    b = gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=7, seed=3))
    ea = [[_ids_of(t) for t in a] for _ in range(3)]
    eb = [[_ids_of(t) for t in b] for _ in range(3)]
    assert ea == eb
    assert ea[0] != ea[1] != ea[2]
    for e in ea:
        assert sorted(sum(e, [])) == list(range(N))


def test_loader_state_dict_resume_and_early_break():
    ds = gl.GadgetDataset(_x(), _y())
    L = gl.GadgetLoader(ds, batch_size=4, seed=2)
    it = iter(L)
    head = [_ids_of(next(it)) for _ in range(2)]
    st = L.state_dict()
    rest = [_ids_of(b) for b in it]
    M = gl.GadgetLoader(ds, batch_size=4, seed=77)
    M.load_state_dict(st)
    assert [_ids_of(b) for b in M] == rest
    # early break: the loader counts what it handed out; the next pass redoes the epoch
    N2 = gl.GadgetLoader(ds, batch_size=4, seed=2)
    it = iter(N2)
    next(it)
    del it
    assert sum(([_ids_of(b)] for b in N2), []) == head + rest


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_on_cpu_sees_writes(prefetch):
    n = 12
    g = gl.DataGadget(np.zeros((n, 1), np.float32), placement="cpu")
    L = gl.GadgetLoader(
        gl.GadgetDataset(g, np.arange(n)), batch_size=3, order="sequential", prefetch=prefetch
    )
    for k, b in enumerate(L):
        assert b[0].flatten().tolist() == [float(k)] * 3
        nxt = list(range((k + 1) * 3, min((k + 2) * 3, n)))
        if nxt:
            g.insertData(torch.full((len(nxt), 1), float(k + 1)), nxt)


@pytest.mark.parametrize(
    "kw,exc,frag",
    [
        (dict(order="random"), gl.GadgetValueError, "order"),
        (dict(seed=0), gl.GadgetValueError, "seed"),
        (dict(drop_last=False), gl.GadgetValueError, "drop_last"),
        (dict(pad=False), gl.GadgetValueError, "pad"),
        (dict(batch_size=4), gl.GadgetValueError, "batch_size"),
        (dict(shuffle=True), gl.GadgetTypeError, "shuffle"),
        (dict(batch_sampler=None), gl.GadgetTypeError, "batch_sampler"),
        (dict(collate_fn=None), gl.GadgetTypeError, "collate_fn"),
    ],
)
def test_loader_refuses_options_with_sampler(kw, exc, frag):
    ds = gl.GadgetDataset(_x(), _y())
    with pytest.raises(exc, match=frag):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4), **kw)


def test_loader_other_refusals():
    ds = gl.GadgetDataset(_x(), _y())
    with pytest.raises(gl.GadgetValueError, match="batch_size"):
        gl.GadgetLoader(ds)
    with pytest.raises(gl.GadgetTypeError, match="shuffle"):
        gl.GadgetLoader(ds, batch_size=4, shuffle=False)
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetLoader(ds, sampler=torch.utils.data.RandomSampler(ds))
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=4, prefetch=-1)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=4, coalesce=0)


def test_loader_refused_set_epoch_changes_nothing():
    ds = gl.GadgetDataset(_x(), _y())
    L = gl.GadgetLoader(ds, batch_size=5, seed=1)
    list(L)
    before = L.state_dict()
    with pytest.raises(gl.GadgetValueError):
        L.set_epoch(-1)
    assert L.state_dict() == before
    assert sum((_ids_of(b) for b in L), []) == L.sampler.epoch_order(1).tolist()


# --------------------------------------------------------------------------------------
# copies, reloads, close, fallback
# --------------------------------------------------------------------------------------


def test_arrays_are_copied_in_and_gadgets_used_as_they_are():
    t = torch.arange(N, dtype=torch.float32, requires_grad=True)
    ds = gl.GadgetDataset(t)
    with torch.no_grad():
        t[0] = 100.0
    b = ds[[0, 1]][0]
    assert b.tolist() == [0.0, 1.0] and not b.requires_grad
    g = gl.DataGadget(_x(), placement="cpu")
    ds2 = gl.GadgetDataset(g, _y())
    g.insertData(torch.full((1, D), -1.0), [3])
    assert ds2[3][0].tolist() == [-1.0] * D


def test_reloaded_column_with_other_row_count_refused(tmp_path):
    g = gl.DataGadget(_x(), placement="cpu")
    ds = gl.GadgetDataset(g, _y())
    p = tmp_path / "more.npy"
    np.save(p, np.zeros((N + 3, D), np.float32))
    g.load(str(p))
    with pytest.raises(gl.GadgetValueError, match="rows"):
        ds[[0]]
    with pytest.raises(gl.GadgetValueError):
        list(DataLoader(ds, batch_size=4))


def test_close_frees_created_tables_not_passed_ones():
    g = gl.DataGadget(_x(), placement="cpu")
    ds = gl.GadgetDataset(g, _y())
    created = ds.columns[1]
    ds.close()
    ds.close()  # idempotent
    assert g.getData([2]).tolist() == [_x()[2].tolist()]
    with pytest.raises(gl.GadgetClosedError):
        created.getData([0])


def test_explicit_pinned_placement_falls_back_to_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        ds = gl.GadgetDataset(_x(), _y(), placement="pinned")
    assert {c.placement for c in ds.columns} == {"cpu"}
    _check_batch(next(iter(DataLoader(ds, batch_size=6))), range(6))


def test_default_dataset_placement_is_silent_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = gl.GadgetDataset(_x(), _y())
    assert ds.device.type == "cpu"
    assert {c.placement for c in ds.columns} == {"cpu"}


@pytest.mark.parametrize(
    "bad,exc",
    [
        (None, gl.GadgetTypeError),
        (b"x.npy", gl.GadgetTypeError),
        ("/nonexistent/rev31/x.npy", gl.GadgetFileNotFoundError),
    ],
)
def test_bad_column_sources(bad, exc):
    with pytest.raises(exc):
        gl.GadgetDataset(bad)


def test_bad_placement_name():
    with pytest.raises(gl.GadgetKeyError, match="pinned"):
        gl.GadgetDataset(_x(), placement="gpu")


def test_pickle_cpu_by_value_file_by_name(files):
    _, p = files
    ds = gl.GadgetDataset(_x(), _y())
    cp = pickle.loads(pickle.dumps(ds))
    ds.columns[0].insertData(torch.zeros(1, D), [0])
    _check_batch(cp[[0, 5]], [0, 5])  # a copy of the rows
    # a file column pickles as its file name: the copy reads the file
    src = files[0] / "pick.npy"
    np.save(src, _x())
    g = gl.DataGadget(str(src), placement="file")
    fds = gl.GadgetDataset(g, _y())
    fcp = pickle.loads(pickle.dumps(fds))
    g.insertData(torch.full((1, D), 9.0), [4])
    assert fcp[[4]][0].tolist() == [[9.0] * D]
    assert fcp.columns[0].placement == "file"


# --------------------------------------------------------------------------------------
# DataLoader worker processes (fork and spawn)
# --------------------------------------------------------------------------------------


@pytest.fixture
def _no_cuda_env(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.parametrize("kind", ["array", "npy_file", "h5_file", "zarr_file", "h5"])
def test_fork_workers_default_form_shuffle(files, kind, _no_cuda_env):
    ds = _ds(kind, files)
    ds[[0, 1]]  # the parent has used (opened) the tables before the fork
    g = torch.Generator().manual_seed(31)
    loader = DataLoader(
        ds, batch_size=5, shuffle=True, generator=g, num_workers=2, multiprocessing_context="fork"
    )
    ref = [
        t.tolist()
        for t in DataLoader(
            list(range(N)), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(31)
        )
    ]
    got = list(loader)
    assert len(got) == len(ref) == len(loader) == 5
    for b, ids in zip(got, ref, strict=True):
        _check_batch(b, ids)
    assert sorted(sum(ref, [])) == list(range(N))


@pytest.mark.parametrize("kind", ["array", "h5_file", "zarr_file"])
def test_fork_workers_sampler_persistent_epochs(files, kind, _no_cuda_env):
    ds = _ds(kind, files)
    s = gl.GadgetSampler(ds, batch_size=5, seed=17)
    loader = DataLoader(
        ds, batch_sampler=s, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    for e in range(3):
        got = list(loader)
        flat = []
        for b in got:
            bid = _ids_of(b)
            _check_batch(b, bid)
            flat += bid
        assert flat == s.epoch_order(e).tolist()
    assert s.epoch == 3


def test_fork_workers_early_break_then_set_epoch(_no_cuda_env):
    ds = gl.GadgetDataset(_x(), _y())
    s = gl.GadgetSampler(ds, batch_size=3, seed=2)
    loader = DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    head = [_ids_of(next(it)) for _ in range(2)]
    del it
    s.set_epoch(0)
    full = [_ids_of(b) for b in loader]
    assert full[:2] == head
    assert sum(full, []) == s.epoch_order(0).tolist()


@pytest.mark.parametrize("kind", ["array", "npy_file"])
def test_gadgetloader_with_fork_workers(files, kind, _no_cuda_env):
    ds = _ds(kind, files)
    plain = gl.GadgetLoader(ds, batch_size=5, seed=8)
    work = gl.GadgetLoader(ds, batch_size=5, seed=8, num_workers=2, multiprocessing_context="fork")
    assert len(work) == 5
    for _ in range(2):
        a, b = list(plain), list(work)
        assert len(a) == len(b) == 5
        for p, q in zip(a, b, strict=True):
            assert q[0].device.type == "cpu"
            assert torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
    # early break with workers: the loader counts batches handed out, the epoch is redone
    it = iter(work)
    first = _ids_of(next(it))
    del it
    again = [_ids_of(t) for t in work]
    assert again[0] == first and sum(again, []) == work.sampler.epoch_order(2).tolist()


@pytest.mark.parametrize("fmt", ["npy", "h5"])
def test_workers_started_later_see_main_process_writes(tmp_path, fmt, _no_cuda_env):
    x = _x()
    p = tmp_path / f"w.{fmt}"
    if fmt == "npy":
        np.save(p, x)
    else:
        with h5py.File(p, "w") as f:
            f.create_dataset("a", data=x)
    g = gl.DataGadget(str(p), placement="file")
    ds = gl.GadgetDataset(g, _y())
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="fork")
    np.testing.assert_array_equal(torch.cat([b[0] for b in loader]).numpy(), x)
    g.insertData(torch.full((2, D), -5.0), [0, N - 1])
    x2 = x.copy()
    x2[[0, N - 1]] = -5.0
    np.testing.assert_array_equal(torch.cat([b[0] for b in loader]).numpy(), x2)


def test_spawn_workers_all_file_formats(files, _no_cuda_env):
    d, p = files
    x = _x()
    ds = gl.GadgetDataset(
        gl.DataGadget(str(p["npy"]), placement="file"),
        gl.DataGadget(str(p["h5multi"]), dataset="feat", placement="file"),
        gl.DataGadget(str(p["zarr"]), placement="file"),
        gl.DataGadget(x * 2, placement="cpu"),
        _y(),
    )
    s = gl.GadgetSampler(ds, batch_size=7, seed=5)
    loader = DataLoader(
        ds, batch_sampler=s, num_workers=1, persistent_workers=True, multiprocessing_context="spawn"
    )
    for e in range(2):
        flat = []
        for b in loader:
            assert isinstance(b, gl.GadgetBatch) and len(b) == 5
            ids = _ids_of(b)
            for col in b[:3]:
                assert col.device.type == "cpu"
                np.testing.assert_array_equal(col.numpy(), x[ids])
            np.testing.assert_array_equal(b[3].numpy(), 2 * x[ids])
            np.testing.assert_array_equal(b[4].numpy(), _y()[ids])
            flat += ids
        assert flat == s.epoch_order(e).tolist()


def test_spawn_gadgetloader_default_form(files, _no_cuda_env):
    _, p = files
    ds = gl.GadgetDataset(str(p["h5multi"]), _y(), dataset="feat", placement="file")
    L = gl.GadgetLoader(
        ds, batch_size=6, order="sequential", num_workers=1, multiprocessing_context="spawn"
    )
    got = list(L)
    assert len(got) == len(L) == 4
    for k, b in enumerate(got):
        _check_batch(b, range(k * 6, k * 6 + 6))


# --------------------------------------------------------------------------------------
# more epochs / resume / defaults
# --------------------------------------------------------------------------------------


def test_loader_state_after_loop_end_points_at_next_epoch():
    ds = gl.GadgetDataset(_x(), _y())
    L = gl.GadgetLoader(ds, batch_size=5, seed=3)
    list(L)
    M = gl.GadgetLoader(ds, batch_size=5, seed=9)
    M.load_state_dict(L.state_dict())
    assert sum((_ids_of(b) for b in M), []) == L.sampler.epoch_order(1).tolist()
    # saved inside the loop after the last batch: one empty pass, then the next epoch
    L = gl.GadgetLoader(ds, batch_size=5, seed=3)
    for _ in L:
        st = L.state_dict()
    M = gl.GadgetLoader(ds, batch_size=5, seed=9)
    M.load_state_dict(st)
    assert list(M) == []
    assert sum((_ids_of(b) for b in M), []) == L.sampler.epoch_order(1).tolist()


def test_loader_follows_sampler_set_epoch_and_load_state_dict():
    ds = gl.GadgetDataset(_x(), _y())
    s = gl.GadgetSampler(ds, batch_size=5, seed=3)
    L = gl.GadgetLoader(ds, sampler=s)
    it = iter(L)
    next(it)
    next(it)
    s.set_epoch(5)  # this call wins over the loader left mid-epoch
    assert sum((_ids_of(b) for b in L), []) == s.epoch_order(5).tolist()
    other = gl.GadgetSampler(N, batch_size=5, seed=3)
    it = iter(other)
    next(it)
    st = other.state_dict()
    rest = [b.tolist() for b in it]
    s.load_state_dict(st)
    assert [_ids_of(b) for b in L] == rest


@pytest.mark.parametrize("B,cr,expect", [(10, 7, 23), (10, 100, 8), (3, 1, 48), (64, 10, 103)])
def test_chunk_window_default(B, cr, expect):
    # "Default: enough chunks to hold 16 batches, and at least 8."
    s = gl.GadgetSampler(1000, batch_size=B, order="chunk", chunk_rows=cr)
    assert s.window_chunks == expect == max(8, math.ceil(16 * B / cr))


def test_row_nbytes_and_len():
    ds = gl.GadgetDataset(_x(), _y(), np.zeros((N, 2, 2), np.int8))
    assert ds.row_nbytes == D * 4 + 8 + 4
    assert len(ds) == N
    assert len(ds.columns) == 3


def test_fork_workers_pad_sampler_batch_size_none(_no_cuda_env):
    ds = gl.GadgetDataset(_x(), _y())
    s = gl.GadgetSampler(ds, batch_size=5, seed=1, pad=True)
    got = list(
        DataLoader(ds, sampler=s, batch_size=None, num_workers=2, multiprocessing_context="fork")
    )
    assert len(got) == 5
    flat = []
    for b in got:
        b = gl.GadgetBatch(b)
        bid = _ids_of(b)
        _check_batch(b, bid)
        flat += bid
    o = s.epoch_order(0).tolist()
    assert flat == [o[i % N] for i in range(25)]


def test_fork_workers_out_of_order_still_exact(_no_cuda_env):
    import inspect

    if "in_order" not in inspect.signature(DataLoader.__init__).parameters:
        pytest.skip("DataLoader(in_order=) is torch >= 2.6's")
    ds = gl.GadgetDataset(_x(), _y())
    s = gl.GadgetSampler(ds, batch_size=5, seed=3)
    got = list(
        DataLoader(
            ds, batch_sampler=s, num_workers=2, in_order=False, multiprocessing_context="fork"
        )
    )
    ids = []
    for b in got:
        bid = _ids_of(b)
        _check_batch(b, bid)
        ids += bid
    assert sorted(ids) == list(range(N))


def test_stateful_dataloader_resume_with_fork_workers(_no_cuda_env):
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")
    ds = gl.GadgetDataset(_x(), _y())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*set_vital.*")
        s = gl.GadgetSampler(ds, batch_size=3, seed=13)
        a = sdl_mod.StatefulDataLoader(
            ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork"
        )
        it = iter(a)
        head = [_ids_of(next(it)) for _ in range(3)]
        st = a.state_dict()
        rest = [_ids_of(b) for b in it]
        b = sdl_mod.StatefulDataLoader(
            ds,
            batch_sampler=gl.GadgetSampler(ds, batch_size=3, seed=0),
            num_workers=2,
            multiprocessing_context="fork",
        )
        b.load_state_dict(st)
        resumed = [_ids_of(t) for t in b]
    assert resumed == rest
    assert sum(head + rest, []) == s.epoch_order(0).tolist()


def test_gadgetloader_workers_resume(_no_cuda_env):
    ds = gl.GadgetDataset(_x(), _y())
    L = gl.GadgetLoader(ds, batch_size=3, seed=4, num_workers=2, multiprocessing_context="fork")
    it = iter(L)
    head = [_ids_of(next(it)) for _ in range(3)]
    st = L.state_dict()
    rest = [_ids_of(b) for b in it]
    M = gl.GadgetLoader(ds, batch_size=3, seed=0, num_workers=2, multiprocessing_context="fork")
    M.load_state_dict(st)
    assert [_ids_of(b) for b in M] == rest
    assert sum(head + rest, []) == L.sampler.epoch_order(0).tolist()


def test_sampler_batch_pickles_as_its_own_ids():
    s = gl.GadgetSampler(200_000, batch_size=4, seed=0)
    b = next(iter(s))
    blob = pickle.dumps(b)
    assert len(blob) < 10_000  # not the 1.6 MB order it is a view of
    assert pickle.loads(blob).tolist() == b.tolist()


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
@pytest.mark.parametrize("cache_bytes", [1, 1000])
def test_file_column_tiny_cache_all_orders(tmp_path, fmt, cache_bytes):
    n = 120
    x = np.random.default_rng(0).standard_normal((n, 5)).astype(np.float32)
    p = tmp_path / f"c.{fmt}"
    if fmt == "h5":
        with h5py.File(p, "w") as f:
            f.create_dataset("a", data=x, chunks=(7, 5), compression="gzip")
    else:
        z = zarr.open_array(str(p), mode="w", shape=x.shape, chunks=(9, 5), dtype="float32")
        z[:] = x
    ds = gl.GadgetDataset(str(p), np.arange(n), placement="file", cache_bytes=cache_bytes)
    for order in ("random", "chunk"):
        s = gl.GadgetSampler(ds, batch_size=16, order=order, seed=1, window_chunks=2)
        for _ in range(2):
            seen = []
            for b in DataLoader(ds, batch_sampler=s):
                np.testing.assert_array_equal(b[0].numpy(), x[b[1].numpy()])
                seen += b[1].tolist()
            assert sorted(seen) == list(range(n))
        for b in gl.GadgetLoader(ds, batch_size=16, order=order, window_chunks=2, coalesce=4):
            np.testing.assert_array_equal(b[0].numpy(), x[b[1].numpy()])
