"""Black-box review (session 32) of object lifecycle and concurrency: close() / ``with``,
use after close, flushing to files, pickling / deepcopy, threads sharing tables,
DataLoader worker processes over file-backed datasets and clean interpreter exit;
written from README.md, SPEC.md and the public docstrings only."""

from __future__ import annotations

import copy
import gc
import hashlib
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading

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


ROWS, DIM = 96, 4
FORMATS = ["npy", "h5", "h5gz", "zarr"]


def _ref(rows=ROWS, dim=DIM, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def _write(path_base, fmt, arr, chunk=8):
    """Write ``arr`` in ``fmt`` with plain numpy / h5py / zarr; return the path."""
    if fmt == "npy":
        p = f"{path_base}.npy"
        np.save(p, arr)
    elif fmt in ("h5", "h5gz"):
        p = f"{path_base}.h5"
        with h5py.File(p, "w") as f:
            kw = {"compression": "gzip"} if fmt == "h5gz" else {}
            f.create_dataset("x", data=arr, chunks=(chunk,) + arr.shape[1:], **kw)
    else:
        p = f"{path_base}.zarr"
        z = zarr.create_array(p, shape=arr.shape, dtype=arr.dtype, chunks=(chunk,) + arr.shape[1:])
        z[:] = arr
    return p


def _read(p):
    """The whole array at ``p``, read with plain numpy / h5py / zarr."""
    if p.endswith(".npy"):
        return np.load(p)
    if p.endswith(".h5"):
        with h5py.File(p, "r") as f:
            return f["x"][:]
    return zarr.open_array(p, mode="r")[:]


def _digest(p):
    """A hash of every byte under ``p`` (file or directory)."""
    h = hashlib.sha256()
    if os.path.isdir(p):
        for root, dirs, files in sorted(os.walk(p)):
            dirs.sort()
            for n in sorted(files):
                fp = os.path.join(root, n)
                h.update(os.path.relpath(fp, p).encode())
                with open(fp, "rb") as f:
                    h.update(f.read())
    else:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _env():
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _gadget(kind, tmp_path, arr=None):
    arr = _ref() if arr is None else arr
    if kind == "cpu":
        return gl.DataGadget(arr.copy(), placement="cpu"), None
    if kind == "cpu_from_file":
        p = _write(str(tmp_path / "src"), "npy", arr)
        return gl.DataGadget(p, placement="cpu"), p
    fmt = kind.split("_", 1)[1]
    p = _write(str(tmp_path / "t"), fmt, arr)
    return gl.DataGadget(p, placement="file"), p


GADGET_KINDS = ["cpu", "cpu_from_file", "file_npy", "file_h5", "file_h5gz", "file_zarr"]


# ------------------------------------------------------------------------------------------
# close() / with
# ------------------------------------------------------------------------------------------

ROW_CALLS = {
    "getData": lambda g, d: g.getData([1, 2]),
    "gather": lambda g, d: g.gather([1]),
    "getData_slice": lambda g, d: g.getData(slice(0, 3)),
    "getitem_int": lambda g, d: g[1],
    "getitem_tuple": lambda g, d: g[[1, 2], 0:2],
    "setitem": lambda g, d: g.__setitem__([1], torch.zeros(1, DIM)),
    "insertData": lambda g, d: g.insertData(torch.zeros(2, DIM), [0, 5]),
    "insertData_part": lambda g, d: g.insertData(torch.zeros(2, 2), ([0, 5], slice(0, 2))),
    "scatter": lambda g, d: g.scatter([1], torch.zeros(1, DIM)),
    "load": lambda g, d: g.load(d["other"]),
    "loadCupy": lambda g, d: g.loadCupy(d["other"]),
    "save": lambda g, d: g.save(d["out"]),
    "saveCupy": lambda g, d: g.saveCupy(d["out"]),
    "flush": lambda g, d: g.flush(),
    "getNumpyVersion": lambda g, d: g.getNumpyVersion(),
    "getNumpyVersion_nocopy": lambda g, d: g.getNumpyVersion(copy=False),
    "asarray": lambda g, d: np.asarray(g),
    "as_tensor": lambda g, d: g.as_tensor(),
    "zero_": lambda g, d: g.zero_(),
    "fill_": lambda g, d: g.fill_(1.0),
    "uniform_": lambda g, d: g.uniform_(0.0, 1.0),
    "normal_": lambda g, d: g.normal_(0.0, 1.0),
    "init_": lambda g, d: g.init_(torch.nn.init.zeros_),
    "gadgetInit": lambda g, d: g.gadgetInit(),
    "gather_many": lambda g, d: gl.gather_many([g], [0, 1]),
    "scatter_many": lambda g, d: gl.scatter_many([g], [torch.zeros(2, DIM)], [0, 1]),
}


@pytest.mark.parametrize("call", sorted(ROW_CALLS))
@pytest.mark.parametrize("kind", ["cpu", "file_npy", "file_h5"])
def test_every_row_call_after_close_raises_closed(tmp_path, kind, call):
    g, p = _gadget(kind, tmp_path)
    before = _digest(p) if p else None
    g.close()
    other = _write(str(tmp_path / "other"), "npy", np.ones((ROWS, DIM), np.float32))
    out = str(tmp_path / "out.npy")
    with pytest.raises(gl.GadgetClosedError) as ei:
        ROW_CALLS[call](g, {"other": other, "out": out})
    assert isinstance(ei.value, RuntimeError) and isinstance(ei.value, gl.GadgetError)
    assert "closed" in str(ei.value).lower()
    # nothing written anywhere
    assert not os.path.exists(out)
    if p:
        assert _digest(p) == before
        np.testing.assert_array_equal(_read(p), _ref())


@pytest.mark.parametrize("kind", GADGET_KINDS)
def test_metadata_answers_after_close_and_double_close(tmp_path, kind):
    g, _ = _gadget(kind, tmp_path)
    g.close()
    g.close()  # idempotent
    assert g.shape == (ROWS, DIM)
    assert g.dtype == torch.float32
    assert len(g) == ROWS
    r = repr(g)
    assert str(ROWS) in r and str(DIM) in r
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])


@pytest.mark.parametrize("kind", GADGET_KINDS)
def test_with_block_returns_gadget_and_closes(tmp_path, kind):
    g0, _ = _gadget(kind, tmp_path)
    with g0 as g:
        assert g is g0
        np.testing.assert_array_equal(g.getData([3, 1]).numpy(), _ref()[[3, 1]])
    with pytest.raises(gl.GadgetClosedError):
        g0.getData([0])
    g0.close()  # harmless after the with block


@pytest.mark.parametrize("kind", ["cpu", "file_h5", "file_zarr"])
def test_with_block_closes_on_exception_and_does_not_swallow_it(tmp_path, kind):
    g, _ = _gadget(kind, tmp_path)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), g:
        raise Boom()
    with pytest.raises(gl.GadgetClosedError):
        g[0]


def test_store_reports_closed(tmp_path):
    g, _ = _gadget("file_npy", tmp_path)
    st = g.store
    assert st.closed is False
    g.close()
    assert st.closed is True
    st.close()  # idempotent at the store level too


def test_insert_then_close_flushes_all_formats(tmp_path):
    arrs = {}
    for fmt in FORMATS:
        ref = _ref(seed=3)
        p = _write(str(tmp_path / fmt), fmt, ref)
        g = gl.DataGadget(p, placement="file")
        ids = np.array([0, 7, 8, 95, 40])
        rows = np.arange(5 * DIM, dtype=np.float32).reshape(5, DIM) - 100
        g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
        g[[41]] = torch.full((1, DIM), 7.5)
        g.insertData(torch.full((2, 2), -1.0), ([60, 61], slice(1, 3)))
        ref[ids] = rows
        ref[41] = 7.5
        ref[[60, 61], 1:3] = -1.0
        g.close()
        arrs[fmt] = (p, ref)
    for fmt, (p, ref) in arrs.items():
        np.testing.assert_array_equal(_read(p), ref, err_msg=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_write_reaches_file_before_close(tmp_path, fmt):
    """README: 'Each write reaches the file before it returns'; read by another process."""
    ref = _ref(seed=4)
    p = _write(str(tmp_path / "w"), fmt, ref)
    g = gl.DataGadget(p, placement="file")
    g.insertData(torch.full((2, DIM), -9.0), [5, 90])
    code = textwrap.dedent(
        """
        import sys, numpy as np
        p = sys.argv[1]
        if p.endswith('.h5'):
            import h5py
            with h5py.File(p, 'r') as f:
                a = f['x'][:]
        elif p.endswith('.zarr'):
            import zarr
            a = zarr.open_array(p, mode='r')[:]
        else:
            a = np.load(p)
        print(a[5].tolist(), a[90].tolist(), float(a[6, 0]))
        """
    )
    env = _env()
    env["HDF5_USE_FILE_LOCKING"] = "FALSE"  # the table holds HDF5's lock while open
    r = subprocess.run(
        [sys.executable, "-c", code, p], capture_output=True, text=True, env=env, timeout=60
    )
    g.close()
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{[-9.0] * DIM} {[-9.0] * DIM} {float(ref[6, 0])}"


def test_gc_flushes_file_table(tmp_path):
    """close() 'also happens on garbage collection'."""
    for fmt in ("h5", "zarr", "npy"):
        ref = _ref(seed=5)
        p = _write(str(tmp_path / f"gc{fmt}"), fmt, ref)
        g = gl.DataGadget(p, placement="file")
        g.insertData(torch.full((1, DIM), 3.25), [17])
        ref[17] = 3.25
        del g
        gc.collect()
        np.testing.assert_array_equal(_read(p), ref, err_msg=fmt)


H5_WRITE_PROBE = "import h5py, sys\nwith h5py.File(sys.argv[1], 'r+') as f: f['x'][0, 0] = 99\n"


def _h5_writable_elsewhere(p):
    r = subprocess.run(
        [sys.executable, "-c", H5_WRITE_PROBE, p],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    return r.returncode == 0


@pytest.mark.parametrize("how", ["close", "with", "gc", "dataset_close"])
@pytest.mark.parametrize("writable", [True, False])
def test_hdf5_lock_held_while_open_released_after_close(tmp_path, how, writable):
    """README: an open HDF5 file table, read-only ones too, holds the lock, so another
    process cannot open that file to write until the table is closed."""
    p = _write(str(tmp_path / "lk"), "h5", _ref())
    g = gl.DataGadget(p, placement="file", writable=writable)
    g.getData([1])
    assert not _h5_writable_elsewhere(p)
    if how == "close":
        g.close()
    elif how == "with":
        with g:
            pass
    elif how == "gc":
        del g
        gc.collect()
    else:
        g.close()
        ds = gl.GadgetDataset(p, placement="file", device="cpu")
        ds[[0, 1]]
        assert not _h5_writable_elsewhere(p)
        ds.close()
    assert _h5_writable_elsewhere(p)
    assert _read(p)[0, 0] == 99


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_closing_one_table_leaves_sibling_of_same_file_open(tmp_path, fmt):
    ref = _ref(seed=6)
    p = _write(str(tmp_path / "sib"), fmt, ref)
    a = gl.DataGadget(p, placement="file")
    b = gl.DataGadget(p, placement="file")
    a.getData([1])
    a.close()
    np.testing.assert_array_equal(b.getData([1, 50]).numpy(), ref[[1, 50]])
    b.insertData(torch.full((1, DIM), 2.0), [50])
    ref[50] = 2.0
    np.testing.assert_array_equal(b.getNumpyVersion(), ref)
    b.close()
    np.testing.assert_array_equal(_read(p), ref)


def test_refused_write_on_closed_file_table_keeps_file_bytes(tmp_path):
    for fmt in FORMATS:
        p = _write(str(tmp_path / f"k{fmt}"), fmt, _ref())
        g = gl.DataGadget(p, placement="file")
        g.getData([0])
        g.close()
        before = _digest(p)
        calls = (
            lambda g=g: g.insertData(torch.ones(1, DIM), [0]),
            lambda g=g: g.fill_(0.0),
            lambda g=g: g.zero_(),
            lambda g=g, p=p: g.save(p),
            lambda g=g: g.flush(),
            lambda g=g: gl.scatter_many([g], [torch.ones(1, DIM)], [0]),
        )
        for f in calls:
            with pytest.raises(gl.GadgetClosedError):
                f()
        assert _digest(p) == before, fmt
        np.testing.assert_array_equal(_read(p), _ref())


def test_scatter_many_with_one_closed_table_writes_nothing(tmp_path):
    ref = _ref()
    t1 = gl.DataGadget(ref.copy(), placement="cpu")
    p = _write(str(tmp_path / "sm"), "h5", ref)
    t2 = gl.DataGadget(p, placement="file")
    t3 = gl.DataGadget(ref.copy(), placement="cpu")
    t3.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.scatter_many([t1, t2, t3], [torch.zeros(2, DIM)] * 3, [0, 1])
    np.testing.assert_array_equal(t1.getNumpyVersion(), ref)
    np.testing.assert_array_equal(t2.getNumpyVersion(), ref)
    with pytest.raises(gl.GadgetClosedError):
        gl.gather_many([t1, t2, t3], [0, 1])
    t2.close()
    np.testing.assert_array_equal(_read(p), ref)


def test_load_after_close_does_not_reopen(tmp_path):
    g, _ = _gadget("cpu", tmp_path)
    g.close()
    p = _write(str(tmp_path / "l"), "npy", np.ones((3, 2), np.float32))
    with pytest.raises(gl.GadgetClosedError):
        g.load(p)
    # still closed, still the old metadata
    assert g.shape == (ROWS, DIM)
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])


# ------------------------------------------------------------------------------------------
# GadgetDataset close
# ------------------------------------------------------------------------------------------


def test_dataset_close_frees_only_tables_it_created(tmp_path):
    ref = _ref()
    mine = gl.DataGadget(ref.copy(), placement="cpu")
    p = _write(str(tmp_path / "d"), "h5", ref)
    ds = gl.GadgetDataset(
        mine, p, np.arange(ROWS), torch.arange(ROWS) * 2, placement="file", device="cpu"
    )
    cols = ds.columns
    assert cols[0] is mine
    ds.close()
    ds.close()  # idempotent
    np.testing.assert_array_equal(mine.getData([4]).numpy(), ref[[4]])
    for c in cols[1:]:
        with pytest.raises(gl.GadgetClosedError):
            c.getData([0])
    for f in (
        lambda: ds[[0, 1]],
        lambda: ds.gather([0]),
        lambda: ds.__getitems__([0, 1]),
        lambda: ds[0],
    ):
        with pytest.raises(gl.GadgetClosedError):
            f()
    mine.close()


def test_dataset_with_block(tmp_path):
    p = _write(str(tmp_path / "dw"), "zarr", _ref())
    with gl.GadgetDataset(p, placement="file", device="cpu") as ds:
        x = ds[[3, 4]][0]
        col = ds.columns[0]
    np.testing.assert_array_equal(x.numpy(), _ref()[[3, 4]])
    with pytest.raises(gl.GadgetClosedError):
        col.getData([0])


def test_gadget_loader_over_closed_dataset_raises_closed():
    ds = gl.GadgetDataset(_ref(), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=16, order="sequential")
    first = next(iter(loader))
    np.testing.assert_array_equal(first[0].numpy(), _ref()[:16])
    ds.close()
    with pytest.raises(gl.GadgetClosedError):
        for _ in loader:
            pass


def test_dataloader_over_dataset_with_closed_column_raises_closed():
    g = gl.DataGadget(_ref(), placement="cpu")
    ds = gl.GadgetDataset(g, device="cpu")
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        next(iter(DataLoader(ds, batch_size=8)))


# ------------------------------------------------------------------------------------------
# pickle / deepcopy
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_cpu_gadget_copies_by_value(how):
    ref = _ref()
    g = gl.DataGadget(ref.copy(), placement="cpu")
    c = pickle.loads(pickle.dumps(g)) if how == "pickle" else copy.deepcopy(g)
    assert c.placement == "cpu" and c.shape == g.shape and c.dtype == g.dtype
    np.testing.assert_array_equal(c.getNumpyVersion(), ref)
    c.insertData(torch.zeros(1, DIM), [2])
    g.insertData(torch.ones(1, DIM), [3])
    np.testing.assert_array_equal(g.getData([2]).numpy(), ref[[2]])
    np.testing.assert_array_equal(c.getData([3]).numpy(), ref[[3]])
    g.close()
    np.testing.assert_array_equal(
        c.getData([0]).numpy(), ref[[0]]
    )  # the copy outlives the original


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_file_gadget_pickles_as_its_file(tmp_path, fmt, how):
    ref = _ref(rows=4096, seed=7)
    p = _write(str(tmp_path / "pf"), fmt, ref, chunk=64)
    g = gl.DataGadget(p, placement="file")
    blob = pickle.dumps(g)
    assert len(blob) < ref.nbytes // 4  # the file's name and options, not the rows
    c = pickle.loads(blob) if how == "pickle" else copy.deepcopy(g)
    assert c.placement == "file" and c.shape == g.shape
    np.testing.assert_array_equal(c.getData([5, 4000]).numpy(), ref[[5, 4000]])
    # several tables of one file in one process see each other's writes
    c.insertData(torch.full((1, DIM), 11.0), [9])
    np.testing.assert_array_equal(g.getData([9]).numpy(), np.full((1, DIM), 11.0, np.float32))
    g.insertData(torch.full((1, DIM), 12.0), [10])
    np.testing.assert_array_equal(c.getData([10]).numpy(), np.full((1, DIM), 12.0, np.float32))
    g.close()
    np.testing.assert_array_equal(
        c.getData([9, 10]).numpy(), np.array([[11.0] * DIM, [12.0] * DIM], np.float32)
    )
    c.close()
    ref[9], ref[10] = 11.0, 12.0
    np.testing.assert_array_equal(_read(p), ref)


def test_closed_gadget_copies_stay_closed():
    g = gl.DataGadget(_ref(), placement="cpu")
    g.close()
    for c in (copy.copy(g), copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
        with pytest.raises(gl.GadgetClosedError):
            c.getData([0])


def test_dataset_pickle_roundtrip(tmp_path):
    ref = _ref()
    p = _write(str(tmp_path / "dp"), "h5", ref)
    ds = gl.GadgetDataset(p, np.arange(ROWS), placement="file", device="cpu")
    c = pickle.loads(pickle.dumps(ds))
    x, y = c[[5, 1, 5]]
    np.testing.assert_array_equal(x.numpy(), ref[[5, 1, 5]])
    assert y.tolist() == [5, 1, 5]
    assert len(c) == ROWS
    c.close()
    ds.close()


def test_sampler_pickle_keeps_rank_and_order():
    s = gl.GadgetSampler(50, batch_size=4, order="random", seed=9, num_replicas=3, rank=2)
    c = pickle.loads(pickle.dumps(s))
    d = copy.deepcopy(s)
    assert (c.rank, c.num_replicas, c.seed, c.batch_size) == (2, 3, 9, 4)
    first = [b.tolist() for b in s]
    assert [b.tolist() for b in c] == first
    assert [b.tolist() for b in d] == first
    # the original moved on to epoch 1; a copy taken now starts there too
    e = pickle.loads(pickle.dumps(s))
    assert e.epoch == s.epoch == 1
    assert [b.tolist() for b in e] == [b.tolist() for b in s] != first


def test_batch_pickles_as_tuple_of_tensors():
    ds = gl.GadgetDataset(_ref(), np.arange(ROWS), placement="cpu", device="cpu")
    b = ds[[1, 2]]
    c = pickle.loads(pickle.dumps(b))
    assert len(c) == 2
    assert torch.equal(c[0], b[0]) and torch.equal(c[1], b[1])


def _trained_pair(opt_cls=torch.optim.Adam, **kw):
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(30, DIM, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(opt_cls, emb, lr=0.1, **kw)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    opt.step()
    return emb, opt


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_offloaded_optimizer_cannot_be_copied(how):
    import io

    emb, opt = _trained_pair()
    before = emb.weight.getNumpyVersion()
    f = {
        "deepcopy": lambda: copy.deepcopy(opt),
        "copy": lambda: copy.copy(opt),
        "pickle": lambda: pickle.dumps(opt),
        "torch.save": lambda: torch.save(opt, io.BytesIO()),
    }[how]
    with pytest.raises(gl.GadgetTypeError, match="state_dict"):
        f()
    # and it keeps working
    emb(torch.tensor([3])).sum().backward()
    opt.step()
    after = emb.weight.getNumpyVersion()
    assert not np.array_equal(after[3], before[3])
    np.testing.assert_array_equal(np.delete(after, 3, 0), np.delete(before, 3, 0))


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "bag"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_embedding_is_a_separate_table_without_optimizer(how, bag):
    if bag:
        torch.manual_seed(0)
        emb = gl.OffloadedEmbeddingBag(30, DIM, mode="sum", placement="cpu", device="cpu")
        opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
        emb(torch.tensor([[1, 2]])).sum().backward()
        opt.step()
    else:
        emb, opt = _trained_pair()
    look = (lambda m, i: m(torch.tensor([[i]]))) if bag else (lambda m, i: m(torch.tensor([i])))
    orig = emb.weight.getNumpyVersion()
    c = copy.deepcopy(emb) if how == "deepcopy" else pickle.loads(pickle.dumps(emb))
    np.testing.assert_array_equal(c.weight.getNumpyVersion(), orig)
    # the copy has no optimizer: a new one may take it while the original's lives
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, c, lr=1.0)
    look(c, 4).sum().backward()
    opt2.step()
    exp = orig[4] - 1.0
    np.testing.assert_allclose(c.weight.getData([4]).numpy()[0], exp, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), orig)
    # the original still trains with its own optimizer
    look(emb, 5).sum().backward()
    opt.step()
    assert not np.array_equal(emb.weight.getData([5]).numpy()[0], orig[5])
    np.testing.assert_allclose(c.weight.getData([5]).numpy()[0], orig[5])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_interleaved_table_copy_is_ordinary_with_own_rows(how):
    emb, _opt = _trained_pair()
    w = emb.weight
    c = copy.deepcopy(w) if how == "deepcopy" else pickle.loads(pickle.dumps(w))
    orig = w.getNumpyVersion()
    np.testing.assert_array_equal(c.getNumpyVersion(), orig)
    c.insertData(torch.zeros(2, DIM), [1, 2])
    np.testing.assert_array_equal(w.getNumpyVersion(), orig)
    assert c.as_tensor().is_contiguous()


def test_interleaving_views_load_in_place_and_release(tmp_path):
    """README: views taken before the optimizer is built no longer see the table; load()
    refills an interleaved table in place (a view taken after it stays the table); a failed
    load leaves it unchanged; rows survive the optimizer's collection."""
    torch.manual_seed(1)
    emb = gl.OffloadedEmbedding(20, DIM, placement="cpu", device="cpu")
    w = emb.weight
    early = w.as_tensor()
    before = w.getNumpyVersion()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    np.testing.assert_array_equal(early.numpy(), before)  # the old storage, unchanged
    assert not np.array_equal(w.getNumpyVersion()[1], before[1])
    late = w.as_tensor()
    p3 = _write(str(tmp_path / "three"), "npy", np.full((20, DIM), 3.0, np.float32))
    w.load(p3)
    assert torch.all(late == 3.0)
    bad = _write(str(tmp_path / "bad"), "npy", np.ones((21, DIM), np.float32))
    with pytest.raises(gl.GadgetValueError):
        w.load(bad)
    assert np.all(w.getNumpyVersion() == 3.0)
    del opt
    gc.collect()
    assert np.all(w.getNumpyVersion() == 3.0)
    with torch.no_grad():
        assert torch.all(emb(torch.tensor([0, 19])) == 3.0)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_file_gadget_copy_keeps_dataset_format_and_writable(tmp_path, how):
    p = str(tmp_path / "m.h5")
    with h5py.File(p, "w") as f:
        f.create_dataset("a", data=np.zeros((10, 2), np.float32))
        f.create_dataset("grp/b", data=np.arange(20, dtype=np.float32).reshape(10, 2))
    g = gl.DataGadget(p, dataset="grp/b", placement="file", writable=False)
    c = pickle.loads(pickle.dumps(g)) if how == "pickle" else copy.deepcopy(g)
    np.testing.assert_array_equal(c.getData([3]).numpy(), [[6.0, 7.0]])
    with pytest.raises(gl.ReadOnlyError):
        c.insertData(torch.zeros(1, 2), [0])
    q = str(tmp_path / "noext")
    np.save(q + ".npy", np.full((4, 2), 5.0, np.float32))
    os.rename(q + ".npy", q)
    h = gl.DataGadget(q, format="npy", placement="file")
    hc = pickle.loads(pickle.dumps(h)) if how == "pickle" else copy.deepcopy(h)
    np.testing.assert_array_equal(hc.getData([2]).numpy(), [[5.0, 5.0]])
    for t in (g, c, h, hc):
        t.close()
    with h5py.File(p, "r") as f:
        assert np.all(f["a"][:] == 0)


def test_relative_path_gadget_copy_after_chdir(tmp_path, monkeypatch):
    """A file gadget pickles as its file: the copy must open the same file even when the
    process has changed directory since (DataLoader spawn workers start in the parent's cwd)."""
    sub = tmp_path / "sub"
    sub.mkdir()
    np.save(sub / "r.npy", np.full((4, 2), 4.0, np.float32))
    (tmp_path / "r.npy").write_bytes(b"not this one")
    monkeypatch.chdir(sub)
    g = gl.DataGadget("r.npy", placement="file")
    monkeypatch.chdir(tmp_path)
    c = pickle.loads(pickle.dumps(g))
    np.testing.assert_array_equal(c.getData([1]).numpy(), [[4.0, 4.0]])
    c.close()
    g.close()


def test_garbage_collection_in_process_is_silent(tmp_path):
    """Objects dropped mid-use are collected without warnings or unraisable errors."""
    unraisable = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(repr(u.exc_value))
    try:
        import warnings

        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            ref = _ref()
            paths = [_write(str(tmp_path / f"gc{f}"), f, ref) for f in FORMATS]
            objs = [gl.DataGadget(p, placement="file") for p in paths]
            for o in objs:
                o.insertData(torch.zeros(1, DIM), [0])
            objs.append(gl.DataGadget(ref, placement="cpu"))
            ds = gl.GadgetDataset(*paths, placement="file", device="cpu")
            it = iter(gl.GadgetLoader(ds, batch_size=8))
            next(it)
            s = gl.GadgetSampler(ds, batch_size=8)
            it2 = iter(DataLoader(ds, batch_sampler=s))
            next(it2)
            emb, opt = _trained_pair()
            emb(torch.tensor([3])).sum().backward()
            cyc = [objs, ds, it, it2, emb, opt]
            cyc.append(cyc)
            del objs, ds, it, it2, emb, opt, s, cyc
            gc.collect()
            gc.collect()
        assert [str(w.message) for w in rec] == []
    finally:
        sys.unraisablehook = old_hook
    assert unraisable == []
    for p in paths:
        got = _read(p)
        np.testing.assert_array_equal(got[0], np.zeros(DIM, np.float32))
        np.testing.assert_array_equal(got[1:], ref[1:])


@pytest.mark.parametrize("kind", ["cpu", "file"])
def test_save_racing_load_writes_one_file_whole(tmp_path, kind):
    """README: a save that another thread's load() overtakes is made on the loaded file."""
    one = _write(str(tmp_path / "one"), "npy", np.ones((ROWS, DIM), np.float32))
    two = _write(str(tmp_path / "two"), "npy", np.full((ROWS, DIM), 2.0, np.float32))
    g = gl.DataGadget(one, placement=kind)
    stop = threading.Event()
    bad = []

    def saver(t):
        k = 0
        while not stop.is_set():
            out = str(tmp_path / f"s{t}_{k % 3}.npy")
            g.save(out)
            u = np.unique(np.load(out))
            if len(u) != 1 or u[0] not in (1.0, 2.0):
                bad.append(u.tolist())
            k += 1

    th = threading.Thread(target=lambda: _guard(saver, 0, bad))
    th.start()
    try:
        for i in range(10):
            g.load(two if i % 2 == 0 else one)
            stop.wait(0.01)
    finally:
        stop.set()
        th.join(30)
    assert bad == []
    np.testing.assert_array_equal(_read(one), np.ones((ROWS, DIM), np.float32))
    np.testing.assert_array_equal(_read(two), np.full((ROWS, DIM), 2.0, np.float32))
    g.close()


def test_threads_share_dataset_gathers_exact(tmp_path):
    refs = [_ref(rows=256, seed=40 + i) for i in range(3)]
    paths = [
        _write(str(tmp_path / f"ds{i}"), f, r, chunk=16)
        for i, (f, r) in enumerate(zip(["npy", "h5", "zarr"], refs, strict=True))
    ]
    ds = gl.GadgetDataset(*paths, refs[0] * 2, placement="file", device="cpu")
    bad = []

    def work(t):
        rng = np.random.default_rng(t)
        for _ in range(15):
            ids = rng.integers(0, 256, 24)
            b = ds[torch.from_numpy(ids)]
            exp = [r[ids] for r in refs] + [refs[0][ids] * 2]
            if not all(np.array_equal(x.numpy(), e) for x, e in zip(b, exp, strict=True)):
                bad.append(t)

    assert _run_threads(work, 4) == [] and bad == []
    ds.close()


def test_table_taken_again_after_optimizer_is_collected():
    emb, opt = _trained_pair()
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    del opt
    gc.collect()
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    row = emb.weight.getData([7]).clone()
    emb(torch.tensor([7])).sum().backward()
    opt2.step()
    # fresh state: a first Adam step moves every element by lr (gradient 1)
    ref = torch.nn.Parameter(row.clone())
    tadam = torch.optim.Adam([ref], lr=0.1)
    ref.sum().backward()
    tadam.step()
    torch.testing.assert_close(emb.weight.getData([7]), ref.detach(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# threads
# ------------------------------------------------------------------------------------------


def _run_threads(fn, n):
    errs = []

    def wrap(t):
        try:
            fn(t)
        except BaseException as e:  # noqa: BLE001 - report every failure
            errs.append(repr(e))

    ths = [threading.Thread(target=wrap, args=(t,)) for t in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not any(t.is_alive() for t in ths), "a thread hung"
    return errs


@pytest.mark.parametrize("kind", ["cpu", "file_npy", "file_h5", "file_h5gz", "file_zarr"])
def test_threads_disjoint_rows_exact(tmp_path, kind):
    g, p = _gadget(kind, tmp_path)
    if kind.startswith("file"):
        g.close()
        g = gl.DataGadget(p, placement="file", cache_bytes=1024)  # small cache: evictions race
    ref = _ref()
    nthreads, iters = 4, 15
    mismatches = []

    def work(t):
        rng = np.random.default_rng(100 + t)
        mine = np.arange(t, ROWS, nthreads)
        for it in range(iters):
            ids = rng.choice(mine, 6, replace=False)
            rows = rng.standard_normal((6, DIM)).astype(np.float32)
            if it % 2:
                g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
            else:
                g[torch.from_numpy(ids)] = torch.from_numpy(rows)
            ref[ids] = rows
            back = g.getData(torch.from_numpy(ids)).numpy()
            if not np.array_equal(back, rows):
                mismatches.append((t, it))
            other = rng.integers(0, ROWS, 8)  # rows of other threads: read, never written now
            g.getData(torch.from_numpy(other))

    errs = _run_threads(work, nthreads)
    assert errs == [] and mismatches == []
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    g.close()
    if p and kind.startswith("file"):
        np.testing.assert_array_equal(_read(p), ref)


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_threads_same_rows_readers_exact(tmp_path, fmt):
    ref = _ref(rows=512, seed=11)
    p = _write(str(tmp_path / "r"), fmt, ref, chunk=16)
    g = gl.DataGadget(p, placement="file", cache_bytes=2048)
    bad = []

    def work(t):
        rng = np.random.default_rng(t)
        for _ in range(25):
            ids = rng.integers(0, 512, 40)
            if not np.array_equal(g.getData(torch.from_numpy(ids)).numpy(), ref[ids]):
                bad.append(t)

    assert _run_threads(work, 4) == [] and bad == []
    g.close()


@pytest.mark.parametrize("fmt", ["npy", "h5", "h5gz", "zarr"])
@pytest.mark.parametrize("tables", ["one", "two", "hardlink"])
def test_threads_partial_row_writes_same_rows_file_lock(tmp_path, fmt, tables):
    """README: threads may share a file table; a write of part of rows reads and writes the
    rows back under the file's lock (one lock for the file under any name, hard links
    included), so two threads writing different columns of the same rows both land."""
    p = _write(str(tmp_path / "pr"), fmt, np.zeros((64, 8), np.float32), chunk=16)
    if tables == "hardlink":
        if fmt == "zarr":
            pytest.skip("a zarr store is a directory: no hard link")
        q = str(tmp_path / ("link" + os.path.splitext(p)[1]))
        os.link(p, q)
    else:
        q = p
    a = gl.DataGadget(p, placement="file")
    b = a if tables == "one" else gl.DataGadget(q, placement="file")
    ids = torch.arange(64)

    def work(t):
        tab, lo, base = (a, 0, 0.0) if t == 0 else (b, 4, 100.0)
        for it in range(20):
            tab.insertData(torch.full((64, 4), base + it), (ids, slice(lo, lo + 4)))

    assert _run_threads(work, 2) == []
    full = a.getNumpyVersion()
    assert np.all(full[:, :4] == 19.0) and np.all(full[:, 4:] == 119.0)
    a.close()
    b.close()
    disk = _read(p)
    assert np.all(disk[:, :4] == 19.0) and np.all(disk[:, 4:] == 119.0)


@pytest.mark.parametrize("kind", ["cpu", "file_h5"])
def test_threads_gather_many_scatter_many_disjoint(tmp_path, kind):
    refs = [_ref(seed=s) for s in (1, 2, 3)]
    if kind == "cpu":
        tabs = [gl.DataGadget(r.copy(), placement="cpu") for r in refs]
    else:
        tabs = [
            gl.DataGadget(_write(str(tmp_path / f"m{i}"), "h5", r), placement="file")
            for i, r in enumerate(refs)
        ]
    nthreads = 3
    bad = []

    def work(t):
        rng = np.random.default_rng(t)
        mine = np.arange(t, ROWS, nthreads)
        for it in range(12):
            ids = rng.choice(mine, 5, replace=False)
            rows = [rng.standard_normal((5, DIM)).astype(np.float32) for _ in tabs]
            gl.scatter_many(tabs, [torch.from_numpy(r) for r in rows], torch.from_numpy(ids))
            for r, new in zip(refs, rows, strict=True):
                r[ids] = new
            got = gl.gather_many(tabs, torch.from_numpy(ids))
            if not all(np.array_equal(x.numpy(), y) for x, y in zip(got, rows, strict=True)):
                bad.append((t, it))

    assert _run_threads(work, nthreads) == [] and bad == []
    for tab, r in zip(tabs, refs, strict=True):
        np.testing.assert_array_equal(tab.getNumpyVersion(), r)
        tab.close()


@pytest.mark.parametrize("kind", ["cpu", "file"])
def test_reads_racing_load_see_one_file_whole(tmp_path, kind):
    """README: a call that another thread's load() overtakes is made on the loaded file;
    never a mix, never an error."""
    one = _write(str(tmp_path / "one"), "npy", np.ones((ROWS, DIM), np.float32))
    two = _write(str(tmp_path / "two"), "npy", np.full((ROWS, DIM), 2.0, np.float32))
    g = gl.DataGadget(one, placement=kind)
    stop = threading.Event()
    seen, bad = set(), []

    def reader(t):
        ids = torch.arange(ROWS)
        while not stop.is_set():
            u = torch.unique(g.getData(ids)).tolist()
            seen.add(tuple(u))
            if len(u) != 1:
                bad.append(u)
            n = g.getNumpyVersion()
            if len(np.unique(n)) != 1:
                bad.append("numpy mix")

    ths = [threading.Thread(target=lambda t=t: _guard(reader, t, bad)) for t in range(2)]
    for t in ths:
        t.start()
    try:
        for i in range(16):
            g.load(two if i % 2 == 0 else one)
            stop.wait(0.005)
    finally:
        stop.set()
        for t in ths:
            t.join(30)
    assert bad == []
    assert seen <= {(1.0,), (2.0,)}
    np.testing.assert_array_equal(g.getNumpyVersion(), np.ones((ROWS, DIM), np.float32))
    g.close()


def _guard(fn, t, bad):
    try:
        fn(t)
    except BaseException as e:  # noqa: BLE001
        bad.append(repr(e))


def test_gather_many_racing_load_raises_closed_or_succeeds(tmp_path):
    one = _write(str(tmp_path / "o"), "npy", np.ones((ROWS, DIM), np.float32))
    two = _write(str(tmp_path / "t"), "npy", np.full((ROWS, DIM), 2.0, np.float32))
    g = gl.DataGadget(one, placement="file")
    h = gl.DataGadget(np.zeros((ROWS, DIM), np.float32), placement="cpu")
    stop = threading.Event()
    bad = []

    def reader(t):
        while not stop.is_set():
            try:
                x, y = gl.gather_many([g, h], torch.arange(ROWS))
            except gl.GadgetClosedError:
                continue
            if len(torch.unique(x)) != 1 or torch.count_nonzero(y):
                bad.append("mix")

    th = threading.Thread(target=lambda: _guard(reader, 0, bad))
    th.start()
    try:
        for i in range(12):
            g.load(two if i % 2 == 0 else one)
            stop.wait(0.005)
    finally:
        stop.set()
        th.join(30)
    assert bad == []
    g.close()
    h.close()


# ------------------------------------------------------------------------------------------
# DataLoader worker processes over file-backed datasets
# ------------------------------------------------------------------------------------------

N_DL = 150


def _collect(loader):
    xs, ys = [], []
    for b in loader:
        xs.append(b[0])
        ys.append(b[1])
    return torch.cat(xs), torch.cat(ys)


def _file_ds(tmp_path, fmt, ref, chunk=16):
    p = _write(str(tmp_path / f"dl_{fmt}"), fmt, ref, chunk=chunk)
    return gl.GadgetDataset(p, np.arange(len(ref)), placement="file", device="cpu"), p


@pytest.mark.parametrize("form", ["sampler", "default", "gadgetloader", "chunk"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dataloader_two_workers_default_start_every_row_once(tmp_path, fmt, form):
    ref = _ref(rows=N_DL, dim=3, seed=21)
    ds, _ = _file_ds(tmp_path, fmt, ref)
    if form == "sampler":
        loader = DataLoader(
            ds, batch_sampler=gl.GadgetSampler(ds, batch_size=32, seed=1), num_workers=2
        )
    elif form == "chunk":
        loader = DataLoader(
            ds,
            batch_sampler=gl.GadgetSampler(ds, batch_size=16, order="chunk", seed=2),
            num_workers=2,
        )
    elif form == "default":
        loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
    else:
        loader = gl.GadgetLoader(ds, batch_size=32, num_workers=2)
    orders = []
    for _ in range(2):
        x, y = _collect(loader)
        assert x.device.type == "cpu"
        assert sorted(y.tolist()) == list(range(N_DL))
        np.testing.assert_array_equal(x.numpy(), ref[y.numpy()])
        orders.append(y)
    assert not torch.equal(orders[0], orders[1])  # shuffled anew each epoch
    ds.close()


def test_dataloader_spawn_persistent_two_epochs_all_formats(tmp_path):
    """One spawn DataLoader (persistent workers, two epochs) over a dataset whose columns
    are an .npy, an HDF5, a gzip HDF5 and a zarr file (plus in-memory labels)."""
    refs = [_ref(rows=N_DL, dim=3, seed=30 + i) for i in range(len(FORMATS))]
    paths = [
        _write(str(tmp_path / f"sp{i}"), fmt, r, chunk=16)
        for i, (fmt, r) in enumerate(zip(FORMATS, refs, strict=True))
    ]
    ds = gl.GadgetDataset(*paths, np.arange(N_DL), placement="file", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=32, seed=5)
    loader = DataLoader(
        ds, batch_sampler=s, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
    )
    seen = []
    for _ in range(2):
        cols = [[] for _ in range(len(FORMATS) + 1)]
        for b in loader:
            for c, t in zip(cols, b, strict=True):
                c.append(t)
        cols = [torch.cat(c) for c in cols]
        y = cols[-1]
        assert sorted(y.tolist()) == list(range(N_DL))
        for fmt, x, r in zip(FORMATS, cols[:-1], refs, strict=True):
            assert x.device.type == "cpu"
            np.testing.assert_array_equal(x.numpy(), r[y.numpy()], err_msg=fmt)
        seen.append(y)
    assert not torch.equal(seen[0], seen[1])
    del loader
    ds.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dataloader_workers_see_writes_made_between_epochs(tmp_path, fmt):
    """README: each write reaches the file before it returns, so workers started later
    read it; writes between epochs are fine (non-persistent workers), compressed HDF5 too."""
    ref = _ref(rows=N_DL, dim=3, seed=24)
    p = _write(str(tmp_path / "wb"), fmt, ref, chunk=16)
    g = gl.DataGadget(p, placement="file")
    ds = gl.GadgetDataset(g, np.arange(N_DL), device="cpu")
    loader = DataLoader(
        ds, batch_sampler=gl.GadgetSampler(ds, batch_size=25, seed=3), num_workers=2
    )
    for ep in range(3):
        x, y = _collect(loader)
        assert sorted(y.tolist()) == list(range(N_DL))
        np.testing.assert_array_equal(x.numpy(), ref[y.numpy()], err_msg=f"epoch {ep}")
        rng = np.random.default_rng(ep)
        ids = rng.choice(N_DL, 30, replace=False)
        rows = rng.standard_normal((30, 3)).astype(np.float32)
        g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
        ref[ids] = rows
    g.close()
    ds.close()
    np.testing.assert_array_equal(_read(p), ref)


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_fork_workers_while_another_thread_reads_hdf5_table(tmp_path, compression):
    """README: HDF5 handles do not cross a fork: a fork waits for an HDF5 table another
    thread is using, then closes its handles; workers reopen the file themselves."""
    ref = _ref(rows=300, dim=3, seed=50)
    p = str(tmp_path / "f.h5")
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=ref, chunks=(16, 3), compression=compression)
    g = gl.DataGadget(p, placement="file", cache_bytes=512)
    ds = gl.GadgetDataset(g, np.arange(300), device="cpu")
    stop = threading.Event()
    bad = []

    def reader(t):
        rng = np.random.default_rng(t)
        while not stop.is_set():
            ids = rng.integers(0, 300, 50)
            if not np.array_equal(g.getData(torch.from_numpy(ids)).numpy(), ref[ids]):
                bad.append("thread rows")

    th = threading.Thread(target=lambda: _guard(reader, 0, bad))
    th.start()
    try:
        for ep in range(2):
            x, y = _collect(
                DataLoader(
                    ds, batch_sampler=gl.GadgetSampler(ds, batch_size=32, seed=ep), num_workers=2
                )
            )
            assert sorted(y.tolist()) == list(range(300))
            np.testing.assert_array_equal(x.numpy(), ref[y.numpy()])
    finally:
        stop.set()
        th.join(30)
    assert bad == []
    g.close()


def test_main_writes_while_persistent_workers_read_uncompressed_hdf5(tmp_path):
    """README: the main process can write rows while workers (persistent ones too) read an
    uncompressed HDF5 file; rows not written meanwhile read right."""
    ref = _ref(rows=N_DL, dim=3, seed=51)
    p = _write(str(tmp_path / "pw"), "h5", ref, chunk=16)
    g = gl.DataGadget(p, placement="file")
    ds = gl.GadgetDataset(g, np.arange(N_DL), device="cpu")
    loader = DataLoader(
        ds,
        batch_sampler=gl.GadgetSampler(ds, batch_size=10, seed=6),
        num_workers=2,
        persistent_workers=True,
    )
    written = np.arange(0, 10)
    for ep in range(2):
        xs, ys = [], []
        for k, (x, y) in enumerate(loader):
            xs.append(x)
            ys.append(y)
            g.insertData(torch.full((10, 3), float(ep * 100 + k)), torch.from_numpy(written))
        x, y = torch.cat(xs), torch.cat(ys)
        assert sorted(y.tolist()) == list(range(N_DL))
        keep = ~np.isin(y.numpy(), written)
        np.testing.assert_array_equal(x.numpy()[keep], ref[y.numpy()[keep]])
    del loader
    g.close()
    np.testing.assert_array_equal(_read(p)[10:], ref[10:])


def test_dataloader_two_workers_cpu_dataset():
    ref = _ref(rows=N_DL, dim=3, seed=25)
    ds = gl.GadgetDataset(ref, np.arange(N_DL), placement="cpu", device="cpu")
    loader = DataLoader(
        ds, batch_sampler=gl.GadgetSampler(ds, batch_size=32, seed=4), num_workers=2
    )
    x, y = _collect(loader)
    assert sorted(y.tolist()) == list(range(N_DL))
    np.testing.assert_array_equal(x.numpy(), ref[y.numpy()])
    ds.close()


def test_dataloader_workers_ranks_partition(tmp_path):
    ref = _ref(rows=N_DL, dim=3, seed=26)
    ds, _ = _file_ds(tmp_path, "zarr", ref)
    got = []
    for r in range(2):
        s = gl.GadgetSampler(ds, batch_size=16, seed=8, num_replicas=2, rank=r)
        x, y = _collect(DataLoader(ds, batch_sampler=s, num_workers=2))
        np.testing.assert_array_equal(x.numpy(), ref[y.numpy()])
        got.append(y)
    assert sorted(torch.cat(got).tolist()) == list(range(N_DL))
    ds.close()


# ------------------------------------------------------------------------------------------
# clean interpreter exit (subprocess with -W error)
# ------------------------------------------------------------------------------------------

EXIT_PRELUDE = textwrap.dedent(
    """
    import sys, gc, numpy as np, torch, h5py, zarr
    import gadgetloader as gl
    from torch.utils.data import DataLoader
    d = sys.argv[1]
    a = np.arange(80, dtype=np.float32).reshape(20, 4)
    np.save(d + "/a.npy", a)
    with h5py.File(d + "/a.h5", "w") as f:
        f.create_dataset("x", data=a, chunks=(4, 4))
    with h5py.File(d + "/c.h5", "w") as f:
        f.create_dataset("x", data=a, chunks=(4, 4), compression="gzip")
    z = zarr.create_array(d + "/a.zarr", shape=a.shape, dtype=a.dtype, chunks=(4, 4))
    z[:] = a
    """
)

EXIT_SCENARIOS = {
    "file_tables_written_not_closed": """
        keep = []
        for p in ("a.npy", "a.h5", "c.h5", "a.zarr"):
            g = gl.DataGadget(d + "/" + p, placement="file")
            g.insertData(torch.full((1, 4), -7.0), [5])
            g.insertData(torch.full((1, 2), -8.0), ([6], slice(0, 2)))
            keep.append(g)
        """,
    "cycles": """
        c = gl.DataGadget(a, placement="cpu")
        f = gl.DataGadget(d + "/a.h5", placement="file")
        f.insertData(torch.full((1, 4), -7.0), [5])
        f.insertData(torch.full((1, 2), -8.0), ([6], slice(0, 2)))
        holder = {"c": c, "f": f}
        holder["me"] = holder
        ds = gl.GadgetDataset(d + "/a.zarr", np.arange(20), placement="file", device="cpu")
        ds.cycle = ds
        del holder, ds, c, f
        """,
    "closed_and_double_closed": """
        for p in ("a.npy", "a.h5", "a.zarr"):
            g = gl.DataGadget(d + "/" + p, placement="file")
            g.insertData(torch.full((1, 4), -7.0), [5])
            g.insertData(torch.full((1, 2), -8.0), ([6], slice(0, 2)))
            g.close(); g.close()
        ds = gl.GadgetDataset(d + "/c.h5", placement="file", device="cpu")
        ds.columns[0].insertData(torch.full((1, 4), -7.0), [5])
        ds.columns[0].insertData(torch.full((1, 2), -8.0), ([6], slice(0, 2)))
        ds.close(); ds.close()
        """,
    "dataloader_fork_workers_mid_epoch": """
        ds = gl.GadgetDataset(d + "/a.h5", np.arange(20), placement="file", device="cpu")
        it = iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, seed=0), num_workers=2))
        next(it)
        it2 = iter(DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, persistent_workers=True))
        next(it2)
        """,
    "dataloader_spawn_workers_mid_epoch": """
        ds = gl.GadgetDataset(d + "/a.zarr", np.arange(20), placement="file", device="cpu")
        dl = DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, seed=0), num_workers=2,
                        multiprocessing_context="spawn", persistent_workers=True)
        it = iter(dl)
        next(it)
        # the second batch comes from the second worker: both have installed torch's worker
        # signal handlers, so the SIGTERM of multiprocessing's exit ends them cleanly (a
        # worker still starting up dies of it, which torch reports as a worker failure)
        next(it)
        """,
    "gadgetloader_mid_epoch": """
        ds = gl.GadgetDataset(d + "/a.npy", np.arange(20), placement="file", device="cpu")
        it = iter(gl.GadgetLoader(ds, batch_size=4))
        next(it)
        it2 = iter(gl.GadgetLoader(ds, batch_size=4, num_workers=2))
        next(it2)
        cds = gl.GadgetDataset(a, placement="cpu", device="cpu")
        it3 = iter(DataLoader(cds, batch_sampler=gl.GadgetSampler(cds, batch_size=4)))
        next(it3)
        """,
    "offloaded_training_pending_grad": """
        emb = gl.OffloadedEmbedding(30, 4, placement="cpu", device="cpu")
        bag = gl.OffloadedEmbeddingBag(30, 4, mode="sum", placement="cpu", device="cpu")
        opt = gl.OffloadedOptimizer(torch.optim.Adam, torch.nn.ModuleList([emb, bag]), lr=0.1)
        (emb(torch.tensor([1, 2])).sum() + bag(torch.tensor([[1, 2]])).sum()).backward()
        opt.step()
        emb(torch.tensor([3])).sum().backward()   # a gradient waiting for its step at exit
        out = emb(torch.tensor([4]))              # a lookup waiting for its backward
        cp = __import__("copy").deepcopy(emb)
        """,
    "switchers_mid_step": """
        m = torch.nn.Embedding(4, 4)
        sw = gl.ModelFactory(m, 30, 4, placement="cpu")
        sw.uniformDistributionInit(-1, 1)
        to = torch.optim.Adam(m.parameters(), lr=0.1)
        osw = gl.OptimizerFactory(to, 30, 4, m, "weight", placement="cpu")
        osw.optInit()
        local = sw.beforeForwardPass(torch.tensor([1, 2, 2]))
        osw.beforeForwardPass(torch.tensor([1, 2, 2]))
        m(local).sum().backward()
        to.step()
        """,
    "threads_done": """
        import threading
        g = gl.DataGadget(d + "/a.h5", placement="file")
        def w(t):
            for i in range(5):
                g.getData([t, t + 4])
        ths = [threading.Thread(target=w, args=(t,)) for t in range(3)]
        [t.start() for t in ths]; [t.join() for t in ths]
        g.insertData(torch.full((1, 4), -7.0), [5])
        g.insertData(torch.full((1, 2), -8.0), ([6], slice(0, 2)))
        """,
}

EXIT_GROUPS = {
    "tables": [
        "file_tables_written_not_closed",
        "cycles",
        "closed_and_double_closed",
        "threads_done",
    ],
    "training": ["offloaded_training_pending_grad", "switchers_mid_step"],
    "loaders_fork": ["dataloader_fork_workers_mid_epoch", "gadgetloader_mid_epoch"],
    "loaders_spawn": ["dataloader_spawn_workers_mid_epoch"],
}


def _only_torn_worker_reports(stderr: str) -> bool:
    """Whether ``stderr`` holds nothing but the first lines of worker exception reports
    (``Process SpawnProcess-N:``), each cut off before its traceback."""
    lines = stderr.splitlines()
    return bool(lines) and all(re.fullmatch(r"Process SpawnProcess-\d+:", ln) for ln in lines)


@pytest.mark.parametrize("group", sorted(EXIT_GROUPS))
def test_clean_exit_with_warnings_as_errors(tmp_path, group):
    """Objects left for the interpreter's exit (and its garbage collection) go without an
    error or warning (``-X dev -W error``: stderr empty, exit 0), and rows written to file
    tables that were never closed are in the files afterwards."""
    body = EXIT_PRELUDE + "".join(textwrap.dedent(EXIT_SCENARIOS[n]) for n in EXIT_GROUPS[group])
    body += "\nprint('END')\n"
    # module-level objects (kept until interpreter exit), guarded for spawn's re-import
    script = "if __name__ == '__main__':\n" + textwrap.indent(body, "    ")
    sp = tmp_path / "script.py"
    sp.write_text(script)
    args = [sys.executable, "-X", "dev", "-W", "error", str(sp), str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=120)
    if group == "loaders_spawn" and r.returncode == 0 and _only_torn_worker_reports(r.stderr):
        # once in CI (session 48): a spawn worker's report cut off after its first line by
        # the parent's exit (multiprocessing ends daemon workers with SIGTERM), so nothing
        # says what it was; not reproduced in 110 runs since. The scenario runs once more,
        # and that run must be clean: an error of this library's objects would repeat.
        r = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "END"
    assert r.stderr == "", r.stderr[-3000:]
    if group == "tables":
        exp = np.arange(80, dtype=np.float32).reshape(20, 4)
        exp[5] = -7.0
        exp[6, :2] = -8.0
        for p in ("a.npy", "a.h5", "c.h5", "a.zarr"):
            np.testing.assert_array_equal(_read(str(tmp_path / p)), exp, err_msg=p)
