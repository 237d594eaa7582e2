"""Session 33 black-box review: concurrency and process boundaries.

Written from README.md, SPEC.md and the public docstrings only: threads sharing one table
(cpu and file tables), close() racing other threads, use after close, context managers,
garbage collection, pickling / copying of the public objects and sending them to child
processes (fork and spawn, plain processes and DataLoader workers).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import io
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp_ = pytest.MonkeyPatch()
    mp_.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp_.undo()


FILE_EXTS = ["npy", "h5", "zarr"]
JOIN_S = 60


def _need(ext: str) -> None:
    if ext == "h5":
        pytest.importorskip("h5py")
    elif ext == "zarr":
        pytest.importorskip("zarr")


def _file_table(tmp_path, ref: np.ndarray, ext: str, name: str = "t", **options):
    """Save ``ref`` as a .npy / HDF5 / zarr file and open it as a ``file`` table."""
    _need(ext)
    path = tmp_path / f"{name}.{ext}"
    save_opts = {} if ext == "npy" else {"chunk_rows": 16}
    with gl.DataGadget(ref, placement="cpu", device="cpu") as src:
        src.save(path, **save_opts)
    return gl.DataGadget(path, placement="file", device="cpu", **options), path


def _table(tmp_path, ref: np.ndarray, kind: str, **options):
    if kind == "cpu":
        return gl.DataGadget(ref, placement="cpu", device="cpu"), None
    return _file_table(tmp_path, ref, kind, **options)


@contextlib.contextmanager
def _fork_ok():
    """Python 3.12+ warns (DeprecationWarning) when a multi-threaded process forks; torch's
    own thread pools make every fork look like that. Not gadgetloader's warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*fork\(\) may lead to deadlocks.*", category=DeprecationWarning
        )
        yield


def _run_threads(fns, timeout=JOIN_S):
    """Run each callable on its own thread (started together); return the exceptions."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(fns))

    def wrap(fn):
        def run():
            try:
                barrier.wait(timeout)
                fn()
            except BaseException as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def _name_of(kind: str, path) -> str:
    """What a message about this table should contain to name it."""
    return str(path) if kind != "cpu" else "cpu"


# ---------------------------------------------------------------------------------------
# child processes: functions live in a small module written to a temporary folder, so a
# spawned interpreter can import them whatever pytest's import mode
# ---------------------------------------------------------------------------------------

_CHILD_SRC = """
import numpy as np
import torch


def read_objects(conn, objs):
    out = {}
    try:
        g, f, h, ds, s, L, emb = objs
        out["g"] = g.getData([0, 3]).numpy()
        out["g_device"] = str(g.getData([0]).device)
        g.insertData(torch.full((1, 3), -1.0), [1])
        out["g_after"] = g.getNumpyVersion()
        out["f"] = f.getData([2, 0]).numpy()
        f.insertData(torch.full((1, 3), 50.0), [3])
        if h is not None:
            out["h"] = h.getData([3, 1]).numpy()
        out["ds"] = [t.numpy() for t in ds.gather([1, 2])]
        out["s_meta"] = (s.rank, s.num_replicas, s.seed, s.epoch)
        out["s"] = [b.tolist() for b in s]
        out["L"] = [[t.numpy() for t in b] for b in L]
        with torch.no_grad():
            out["emb"] = emb(torch.tensor([0, 2])).numpy()
        before = emb.weight.getNumpyVersion()
        emb.weight.insertData(torch.zeros(1, emb.weight.shape[1]), [0])
        out["emb_before"] = before
    except BaseException as e:
        out["error"] = repr(e)
    conn.send(out)
    conn.close()


def touch(conn, obj):
    try:
        table = obj.weight if hasattr(obj, "weight") else obj
        conn.send({"rows": table.getData([0, 2]).numpy()})
    except BaseException as e:
        conn.send({"error": repr(e)})
    conn.close()
"""


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    folder = tmp_path_factory.mktemp("children")
    (folder / "_gl_s33_children.py").write_text(_CHILD_SRC)
    mpatch = pytest.MonkeyPatch()
    mpatch.syspath_prepend(str(folder))
    mod = importlib.import_module("_gl_s33_children")
    yield mod
    sys.modules.pop("_gl_s33_children", None)
    mpatch.undo()


def _run_child(method, target, args, timeout=120):
    """Start ``target(conn, *args)`` in a ``method`` process; return (message or None, exit code)."""
    ctx = mp.get_context(method)
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(writer, *args))
    try:
        with _fork_ok():
            proc.start()
        writer.close()
        out = None
        if reader.poll(timeout):
            try:
                out = reader.recv()
            except EOFError:
                out = None
    finally:
        writer.close()
        reader.close()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return out, proc.exitcode


def _no_gpu_env(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# =======================================================================================
# threads sharing one table
# =======================================================================================


@pytest.mark.parametrize("kind", ["cpu", *FILE_EXTS])
def test_threads_gather_and_scatter_disjoint_rows_match_numpy(tmp_path, kind):
    """README: threads may share a file table (a lock per file); in-memory tables take no
    locks: threads may read them and write different rows. Rows of different threads share
    chunks here (ids interleaved), and every id kind is used."""
    n, d, nthreads = 256, 6, 4
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((n, d)).astype(np.float32)
    g, path = _table(tmp_path, ref, kind)
    expected = ref.copy()
    owned = [np.arange(i, n, nthreads) for i in range(nthreads)]
    rounds = 3 if kind == "zarr" else 6
    finals = {}
    for i, ids in enumerate(owned):
        for r in range(rounds):
            finals[(i, r)] = np.full((len(ids), d), 1000 * i + r, np.float32)
        expected[ids] = finals[(i, rounds - 1)]

    def worker(i):
        def run():
            ids = owned[i]
            wr = np.random.default_rng(10 + i)
            for r in range(rounds):
                rows = finals[(i, r)]
                how = r % 4
                if how == 0:
                    g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
                elif how == 1:
                    g.insertData(rows, ids.astype(np.int32))
                elif how == 2:
                    g[ids.tolist()] = torch.from_numpy(rows)
                else:
                    g.scatter(torch.from_numpy(ids), torch.from_numpy(rows))
                # own rows read back exactly as written
                assert np.array_equal(g.getData(ids).numpy(), rows)
                # any row: the original or one of its owner's writes
                probe = wr.integers(0, n, 48)
                got = g[torch.from_numpy(probe)].numpy()
                owner = probe % nthreads
                for k, row in enumerate(probe):
                    v = got[k]
                    ok = np.array_equal(v, ref[row]) or (
                        np.all(v == v[0]) and int(v[0]) // 1000 == owner[k]
                    )
                    assert ok, f"row {row} read {v} mid-run"

        return run

    errors = _run_threads([worker(i) for i in range(nthreads)])
    assert not errors, errors
    assert np.array_equal(g.getNumpyVersion(), expected)
    g.close()
    if path is not None:
        with gl.DataGadget(path, placement="cpu", device="cpu") as back:
            assert np.array_equal(back.getNumpyVersion(), expected)


def test_threads_gather_many_scatter_many_disjoint_rows(tmp_path):
    """gl.gather_many / gl.scatter_many from several threads over the same tables (an
    in-memory table, a file table and a label table), each thread its own rows."""
    n, nthreads = 120, 4
    a_ref = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    b_ref = -np.arange(n * 2, dtype=np.float64).reshape(n, 2)
    c_ref = np.arange(n, dtype=np.int64) - 1000
    a = gl.DataGadget(a_ref, placement="cpu", device="cpu")
    b, _ = _file_table(tmp_path, b_ref, "npy", name="b")
    c = gl.DataGadget(c_ref, placement="cpu", device="cpu")
    exp = [a_ref.copy(), b_ref.copy(), c_ref.copy()]
    owned = [np.arange(i, n, nthreads) for i in range(nthreads)]
    for i, ids in enumerate(owned):
        exp[0][ids] = i + 0.5
        exp[1][ids] = i + 0.25
        exp[2][ids] = 100 + i

    def worker(i):
        def run():
            ids = owned[i]
            for _ in range(5):
                ra, rb, rc = gl.gather_many([a, b, c], torch.from_numpy(ids))
                assert np.array_equal(rc.numpy(), np.where(rc.numpy() >= 100, 100 + i, c_ref[ids]))
                gl.scatter_many(
                    [a, b, c],
                    [
                        torch.full((len(ids), 3), i + 0.5),
                        torch.full((len(ids), 2), i + 0.25, dtype=torch.float64),
                        torch.full((len(ids),), 100 + i, dtype=torch.int64),
                    ],
                    ids,
                )

        return run

    errors = _run_threads([worker(i) for i in range(nthreads)])
    assert not errors, errors
    got = gl.gather_many([a, b, c], slice(0, n))
    for g_, e_ in zip(got, exp, strict=False):
        assert np.array_equal(g_.numpy(), e_)
    for t in (a, b, c):
        t.close()


@pytest.mark.parametrize("ext", FILE_EXTS)
def test_threads_partial_row_writes_of_the_same_rows_on_a_file_table(tmp_path, ext):
    """README: a write of part of rows, g.insertData(v, (ids, slice(0, 4))), reads and writes
    the rows back under the file's lock: threads writing different columns of the same rows
    lose no update."""
    n, d, nthreads = 48, 8, 4
    g, path = _file_table(tmp_path, np.zeros((n, d), np.float32), ext)
    rounds = 4 if ext == "zarr" else 10

    def worker(i):
        def run():
            ids = np.arange(n)
            for r in range(rounds):
                g.insertData(torch.full((n, 2), float(100 * i + r)), (ids, slice(2 * i, 2 * i + 2)))

        return run

    errors = _run_threads([worker(i) for i in range(nthreads)])
    assert not errors, errors
    want = np.repeat(np.array([100 * i + rounds - 1 for i in range(nthreads)], np.float32), 2)
    got = g.getNumpyVersion()
    assert np.array_equal(got, np.broadcast_to(want, (n, d))), got[:2]
    g.close()
    with gl.DataGadget(path, placement="cpu", device="cpu") as back:
        assert np.array_equal(back.getNumpyVersion(), np.broadcast_to(want, (n, d)))


def test_threads_partial_row_writes_of_disjoint_rows_on_a_cpu_table():
    n, d, nthreads = 64, 6, 4
    ref = np.arange(n * d, dtype=np.float64).reshape(n, d)
    g = gl.DataGadget(ref, placement="cpu", device="cpu")
    exp = ref.copy()
    owned = [np.arange(i, n, nthreads) for i in range(nthreads)]
    for i, ids in enumerate(owned):
        exp[ids, 1:4] = -i - 1
        exp[ids, -1] = 7 * (i + 1)

    def worker(i):
        def run():
            ids = owned[i]
            for _ in range(20):
                g[ids.tolist(), 1:4] = torch.full((len(ids), 3), -i - 1.0, dtype=torch.float64)
                g.insertData(torch.full((len(ids),), 7.0 * (i + 1), dtype=torch.float64), (ids, -1))

        return run

    errors = _run_threads([worker(i) for i in range(nthreads)])
    assert not errors, errors
    assert np.array_equal(g.getNumpyVersion(), exp)


@pytest.mark.parametrize("ext", FILE_EXTS)
def test_threads_on_two_file_tables_of_one_file(tmp_path, ext):
    """README: several file tables of one file in one process may all write and see each
    other's writes; one lock for the file under any name."""
    n, d = 96, 4
    ref = np.zeros((n, d), np.float32)
    g1, path = _file_table(tmp_path, ref, ext)
    g2 = gl.DataGadget(path, placement="file", device="cpu")
    g1.getData([0]), g2.getData([0])
    rounds = 3 if ext == "zarr" else 6

    def writer(table, parity):
        def run():
            ids = np.arange(parity, n, 2)
            for r in range(rounds):
                table.insertData(torch.full((len(ids), d), float(10 * parity + r + 1)), ids)

        return run

    errors = _run_threads([writer(g1, 0), writer(g2, 1)])
    assert not errors, errors
    exp = np.empty((n, d), np.float32)
    exp[0::2] = rounds
    exp[1::2] = 10 + rounds
    assert np.array_equal(g1.getNumpyVersion(), exp)
    assert np.array_equal(g2.getNumpyVersion(), exp)
    g1.close()
    g2.close()


def test_threads_read_one_dataset_through_independent_loaders():
    """A GadgetDataset read at once by DataLoader + GadgetSampler (with read-ahead),
    GadgetLoader and plain indexing on four threads: every batch holds its ids' rows and
    every epoch covers every row once."""
    n = 397
    ref = np.random.default_rng(0).standard_normal((n, 5)).astype(np.float32)
    ds = gl.GadgetDataset(ref, np.arange(n) * 3, placement="cpu", device="cpu")

    def worker(i):
        def run():
            for epoch in range(2):
                if i < 2:
                    it = DataLoader(
                        ds, batch_sampler=gl.GadgetSampler(ds, batch_size=7, seed=i, coalesce=4)
                    )
                elif i == 2:
                    it = gl.GadgetLoader(ds, batch_size=9, seed=i, coalesce=3)
                else:
                    s = gl.GadgetSampler(ds, batch_size=11, seed=i, coalesce=5)
                    it = (ds[b] for b in s)
                seen = []
                for x, y in it:
                    ids = y.numpy() // 3
                    assert np.array_equal(x.numpy(), ref[ids]), (i, epoch)
                    seen.append(ids)
                assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(n)), (i, epoch)

        return run

    errors = _run_threads([worker(i) for i in range(4)])
    assert not errors, errors


@pytest.mark.parametrize("ext", FILE_EXTS)
def test_calls_overtaken_by_another_threads_load_see_one_whole_file(tmp_path, ext):
    """README: a call (getData, getNumpyVersion, ...) that another thread's load() overtakes
    is made on the loaded file (gather_many / scatter_many raise GadgetClosedError
    instead)."""
    _need(ext)
    n, d = 600, 8
    g, path_a = _file_table(tmp_path, np.zeros((n, d), np.float32), ext, name="a")
    with gl.DataGadget(np.ones((n, d), np.float32), placement="cpu") as src:
        path_b = tmp_path / f"b.{ext}"
        src.save(path_b)
    stop = threading.Event()
    seen = {"old": 0, "new": 0}
    mixed, bad = [], []

    def reader(kind):
        def run():
            rng = np.random.default_rng()
            while not stop.is_set():
                ids = rng.integers(0, n, 200)
                try:
                    if kind == "get":
                        v = g.getData(ids).numpy()
                    elif kind == "numpy":
                        v = g.getNumpyVersion()
                    else:
                        v = gl.gather_many([g], ids)[0].numpy()
                except gl.GadgetClosedError as e:
                    if kind != "many":
                        bad.append(e)
                    continue
                except BaseException as e:  # noqa: BLE001
                    bad.append(e)
                    return
                if (v == 0).all():
                    seen["old"] += 1
                elif (v == 1).all():
                    seen["new"] += 1
                else:
                    mixed.append(v)

        return run

    threads = [threading.Thread(target=reader(k), daemon=True) for k in ("get", "numpy", "many")]
    for t in threads:
        t.start()
    time.sleep(0.05)
    for k in range(4):
        g.load(path_b if k % 2 == 0 else path_a)
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(JOIN_S)
    assert not bad, bad[:3]
    assert not mixed, f"{len(mixed)} reads mixed the old and the loaded file"
    assert seen["old"] + seen["new"] > 0
    assert np.array_equal(g.getNumpyVersion(), np.zeros((n, d), np.float32))
    g.close()


# =======================================================================================
# close() while other threads use the table
# =======================================================================================


@pytest.mark.parametrize("kind", ["cpu", *FILE_EXTS])
def test_close_while_threads_read_and_write(tmp_path, kind):
    """close() from another thread: every call then raises GadgetClosedError (no crash, no
    other error, no wrong rows before it); the error names the table."""
    n, d = 1500, 8
    ref = np.random.default_rng(1).standard_normal((n, d)).astype(np.float32)
    g, path = _table(tmp_path, ref, kind)
    started = threading.Event()
    outcome: dict[int, object] = {}

    def worker(i):
        rng = np.random.default_rng(i)
        calls = 0
        while True:
            ids = rng.integers(0, n, 128)
            try:
                if i % 3 == 0:
                    got = g.getData(ids).numpy()
                    assert np.array_equal(got, ref[ids])
                elif i % 3 == 1:
                    g.insertData(torch.from_numpy(ref[ids]), ids)
                else:
                    got = gl.gather_many([g], ids)[0].numpy()
                    assert np.array_equal(got, ref[ids])
                calls += 1
                started.set()
            except gl.GadgetClosedError as e:
                outcome[i] = e
                return
            except BaseException as e:  # noqa: BLE001
                outcome[i] = e
                return

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    assert started.wait(JOIN_S)
    time.sleep(0.03)
    g.close()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    for i, e in outcome.items():
        assert isinstance(e, gl.GadgetClosedError), (i, repr(e))
        assert _name_of(kind, path) in str(e), str(e)
        if kind == "cpu":
            assert f"({n}, {d})" in str(e), str(e)
    assert len(outcome) == 4
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    assert g.shape == (n, d) and len(g) == n and "closed" in repr(g)


def test_close_while_a_thread_iterates_a_loader():
    n = 4000
    ref = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    ds = gl.GadgetDataset(ref, placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=16, seed=0)
    started = threading.Event()
    result: list[object] = []

    def run():
        try:
            for _ in range(1000):
                for (x,) in loader:
                    started.set()
                    assert x.shape[1] == 4
            result.append("finished")
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(JOIN_S)
    ds.close()
    t.join(JOIN_S)
    assert not t.is_alive()
    assert len(result) == 1 and isinstance(result[0], gl.GadgetClosedError), result


@pytest.mark.parametrize("kind", ["cpu", "npy"])
@pytest.mark.parametrize("target_ext", FILE_EXTS)
def test_close_while_another_thread_saves(tmp_path, kind, target_ext):
    """A save racing close(): either the save completes (the file holds the table) or it
    raises GadgetClosedError and, being atomic, leaves the previous file whole and no
    partial file behind."""
    _need(target_ext)
    n = 120_000
    ref = np.random.default_rng(2).standard_normal((n, 8)).astype(np.float32)
    g, _ = _table(tmp_path, ref, kind)
    out = tmp_path / "out"
    out.mkdir()
    target = out / f"o.{target_ext}"
    old = np.full((3, 2), 7.0, np.float32)
    with gl.DataGadget(old, placement="cpu") as o:
        o.save(target)
    result: list[object] = []

    def run():
        try:
            g.save(target, **({} if target_ext == "npy" else {"compression": "none"}))
            result.append("saved")
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.005)
    g.close()
    t.join(JOIN_S)
    assert not t.is_alive()
    with gl.DataGadget(target, placement="cpu", device="cpu") as back:
        arr = back.getNumpyVersion()
    if result == ["saved"]:
        assert np.array_equal(arr, ref)
    else:
        assert isinstance(result[0], gl.GadgetClosedError), repr(result[0])
        assert np.array_equal(arr, old)
    assert sorted(p.name for p in out.iterdir()) == [target.name]


@pytest.mark.parametrize("kind", ["cpu", "file"])
def test_close_during_another_threads_load_leaves_the_table_closed(tmp_path, kind):
    """After close() has returned the table is closed: 'after close() every call that touches
    rows, load() and flush() included, raises GadgetClosedError'. A load() that another
    thread started just before must not bring the table back to life."""
    pytest.importorskip("h5py")
    n = 300_000
    ref = np.random.default_rng(3).standard_normal((n, 16)).astype(np.float32)
    with gl.DataGadget(ref, placement="cpu") as src:
        src.save(tmp_path / "big.h5")
        src.save(tmp_path / "big.npy")
    revived = []
    for delay in (0.0, 0.002, 0.005, 0.01):
        if kind == "cpu":
            g = gl.DataGadget(np.zeros((4, 16), np.float32), placement="cpu", device="cpu")
        else:
            g = gl.DataGadget(tmp_path / "big.npy", placement="file", device="cpu")
        result: list[object] = []

        def run(g=g, result=result):
            try:
                g.load(tmp_path / "big.h5")
                result.append("loaded")
            except BaseException as e:  # noqa: BLE001
                result.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        time.sleep(delay)
        g.close()
        t.join(JOIN_S)
        assert not t.is_alive()
        assert result == ["loaded"] or isinstance(result[0], gl.GadgetClosedError), repr(result[0])
        try:
            g.getData([0])
            revived.append((delay, result[0], repr(g)))
        except gl.GadgetClosedError:
            pass
        g.close()
    assert not revived, (
        f"close() returned, yet a load() that raced it left the table open and usable: {revived}"
    )


def _h5_write_probe(path) -> subprocess.CompletedProcess:
    code = "import h5py, sys; f = h5py.File(sys.argv[1], 'r+'); f.close()"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_hdf5_lock_released_by_close_with_busy_readers_and_by_garbage_collection(tmp_path):
    """README: an open HDF5 file table holds HDF5's file lock, so another process cannot open
    the file to write until the table is closed. close() with readers in other threads,
    and collecting a table that was never closed, both let the other process in."""
    pytest.importorskip("h5py")
    ref = np.random.default_rng(4).standard_normal((2000, 8)).astype(np.float32)
    g, path = _file_table(tmp_path, ref, "h5", cache_bytes=0)
    g.getData([0])
    if _h5_write_probe(path).returncode == 0:
        g.close()
        pytest.skip("HDF5 file locking is not enforced on this file system")
    stop = threading.Event()
    errs: list[BaseException] = []

    def reader():
        rng = np.random.default_rng()
        while not stop.is_set():
            try:
                g.getData(rng.integers(0, 2000, 300))
            except gl.GadgetClosedError:
                return
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
                return

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    g.close()
    stop.set()
    for t in threads:
        t.join(JOIN_S)
    assert not errs, errs
    r = _h5_write_probe(path)
    assert r.returncode == 0, r.stderr[-400:]

    g2 = gl.DataGadget(path, placement="file", device="cpu", writable=False)
    g2.getData([1, 2])
    assert _h5_write_probe(path).returncode != 0
    ref2 = weakref.ref(g2)
    del g2
    gc.collect()
    assert ref2() is None
    r = _h5_write_probe(path)
    assert r.returncode == 0, r.stderr[-400:]


# =======================================================================================
# use after close
# =======================================================================================

_AFTER_CLOSE = {
    "getData": lambda g, d: g.getData([0]),
    "gather": lambda g, d: g.gather([0, 1]),
    "getitem": lambda g, d: g[1],
    "getitem_slice": lambda g, d: g[0:2],
    "getitem_tuple": lambda g, d: g[[0, 1], 0:2],
    "insertData": lambda g, d: g.insertData(torch.zeros(1, 3), [0]),
    "setitem": lambda g, d: g.__setitem__([0], torch.zeros(1, 3)),
    "scatter": lambda g, d: g.scatter([0], torch.zeros(1, 3)),
    "getNumpyVersion": lambda g, d: g.getNumpyVersion(),
    "getNumpyVersion_view": lambda g, d: g.getNumpyVersion(copy=False),
    "asarray": lambda g, d: np.asarray(g),
    "zero_": lambda g, d: g.zero_(),
    "fill_": lambda g, d: g.fill_(1.0),
    "uniform_": lambda g, d: g.uniform_(),
    "normal_": lambda g, d: g.normal_(),
    "init_": lambda g, d: g.init_(torch.nn.init.zeros_),
    "save": lambda g, d: g.save(d / "saved.npy"),
    "saveCupy": lambda g, d: g.saveCupy(d / "saved2.npy"),
    "load": lambda g, d: g.load(d / "other.npy"),
    "loadCupy": lambda g, d: g.loadCupy(d / "other.npy"),
    "flush": lambda g, d: g.flush(),
    "gadgetInit": lambda g, d: g.gadgetInit(),
    "gather_many": lambda g, d: gl.gather_many([g], [0]),
    "scatter_many": lambda g, d: gl.scatter_many([g], [torch.zeros(1, 3)], [0]),
}


@pytest.mark.parametrize("call", sorted(_AFTER_CLOSE))
@pytest.mark.parametrize("kind", ["cpu", "npy", "h5"])
def test_every_row_call_after_close_raises_closed_error_naming_the_table(tmp_path, kind, call):
    ref = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "other.npy", ref * 2)
    g, path = _table(tmp_path, ref, kind)
    g.close()
    g.close()  # idempotent
    with pytest.raises(gl.GadgetClosedError) as ei:
        _AFTER_CLOSE[call](g, tmp_path)
    msg = str(ei.value)
    assert "closed" in msg
    assert _name_of(kind, path) in msg, msg
    if kind == "cpu":
        assert "(4, 3)" in msg, msg
    assert not (tmp_path / "saved.npy").exists() and not (tmp_path / "saved2.npy").exists()
    # metadata still answers
    assert g.shape == (4, 3) and g.dtype == torch.float32 and len(g) == 4
    assert "closed" in repr(g)
    if path is not None:  # the file itself is untouched
        with gl.DataGadget(path, placement="cpu", device="cpu") as back:
            assert np.array_equal(back.getNumpyVersion(), ref)


def test_which_closed_table_is_named_by_gather_many_as_by_scatter_many():
    """With several tables of the same shape, the error must say which one is closed;
    scatter_many does ('table 1 of 2: ...'), gather_many should too."""
    a = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu", device="cpu")
    b = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu", device="cpu")
    b.close()
    with pytest.raises(gl.GadgetClosedError) as es:
        gl.scatter_many([a, b], [torch.ones(1, 3), torch.ones(1, 3)], [0])
    assert "1 of 2" in str(es.value)
    assert np.array_equal(a.getNumpyVersion(), np.zeros((4, 3), np.float32))
    with pytest.raises(gl.GadgetClosedError) as eg:
        gl.gather_many([a, b], [0])
    assert "1 of 2" in str(eg.value), str(eg.value)


def test_closed_dataset_raises_for_its_own_tables_and_keeps_passed_ones_open():
    mine = gl.DataGadget(
        np.arange(20, dtype=np.float32).reshape(10, 2), placement="cpu", device="cpu"
    )
    ds = gl.GadgetDataset(mine, np.arange(10), placement="cpu", device="cpu")
    labels = ds.columns[1]
    ds.close()
    ds.close()
    for f in (lambda: ds.gather([0, 1]), lambda: ds[0], lambda: ds[1:3], lambda: ds[[1, 2]]):
        with pytest.raises(gl.GadgetClosedError, match="closed"):
            f()
    with pytest.raises(gl.GadgetClosedError):
        list(gl.GadgetLoader(ds, batch_size=4))
    with pytest.raises(gl.GadgetClosedError):
        labels.getData([0])
    assert mine.getData([3]).tolist() == [[6.0, 7.0]]
    mine.close()


def test_dataloader_worker_over_a_closed_dataset_raises_closed_error():
    ds = gl.GadgetDataset(np.ones((8, 2), np.float32), placement="cpu", device="cpu")
    ds.close()
    with _fork_ok(), pytest.raises(gl.GadgetClosedError):
        list(DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork"))


def test_offloaded_embedding_with_closed_table_raises_closed_error():
    emb = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    emb.weight.close()
    with pytest.raises(gl.GadgetClosedError):
        opt.step()
    with pytest.raises(gl.GadgetClosedError):
        emb(torch.tensor([1]))
    with pytest.raises(gl.GadgetClosedError):
        emb.state_dict()


def test_concurrent_close_calls_are_idempotent(tmp_path):
    for kind in ("cpu", "npy"):
        g, _ = _table(tmp_path, np.ones((100, 4), np.float32), kind)
        g.getData([0])
        errors = _run_threads([g.close for _ in range(6)])
        assert not errors, errors
        with pytest.raises(gl.GadgetClosedError):
            g.getData([0])


# =======================================================================================
# context managers
# =======================================================================================


@pytest.mark.parametrize("kind", ["cpu", "npy", "h5"])
def test_with_block_returns_the_table_closes_it_and_propagates_errors(tmp_path, kind):
    ref = np.arange(12, dtype=np.float32).reshape(4, 3)
    g, path = _table(tmp_path, ref, kind)
    with g as inner:
        assert inner is g
        assert np.array_equal(inner.getData([2]).numpy(), ref[[2]])
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    if path is None:
        g2 = gl.DataGadget(ref, placement="cpu", device="cpu")
    else:
        g2 = gl.DataGadget(path, placement="file", device="cpu")

    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="inside"), g2:
        raise Boom("inside")
    assert "closed" in repr(g2)
    with pytest.raises(gl.GadgetClosedError):
        g2[0]


def test_dataset_with_block_closes_only_the_tables_it_created(tmp_path):
    ref = np.arange(20, dtype=np.float32).reshape(10, 2)
    np.save(tmp_path / "f.npy", ref)
    mine = gl.DataGadget(ref, placement="cpu", device="cpu")
    with gl.GadgetDataset(
        mine, tmp_path / "f.npy", np.arange(10), placement="file", device="cpu"
    ) as ds:
        created = ds.columns[1:]
        assert [c.placement for c in ds.columns] == ["cpu", "file", "cpu"]
        assert ds.gather([3])[2].tolist() == [3]
    for c in created:
        with pytest.raises(gl.GadgetClosedError):
            c.getData([0])
    assert mine.getData([1]).tolist() == [[2.0, 3.0]]


# =======================================================================================
# pickling and copying
# =======================================================================================


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool]
)
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_cpu_table_pickles_and_deep_copies_by_value(dtype, how):
    """README: cpu gadgets pickle by value; a copy has its own rows."""
    src = (torch.arange(60).reshape(5, 4, 3) % 3).to(dtype)
    g = gl.DataGadget(src, placement="cpu", device="cpu")
    if how == "pickle":
        blob = pickle.dumps(g)
        assert len(blob) >= g.nbytes
        c = pickle.loads(blob)
    else:
        c = copy.deepcopy(g)
    assert c is not g
    assert (c.shape, c.dtype, c.placement, c.device) == (g.shape, g.dtype, g.placement, g.device)
    assert torch.equal(c.getData(slice(0, 5)), src)
    one = torch.ones(1, 4, 3, dtype=dtype)
    c.insertData(one, [2])
    assert torch.equal(g.getData(slice(0, 5)), src)
    g.insertData(one, [4])
    assert torch.equal(c.getData([4]), src[[4]])
    g.close()
    assert torch.equal(c.getData([2]), one)
    c.close()


@pytest.mark.parametrize("ext", FILE_EXTS)
def test_file_table_pickles_as_its_name_and_reopens_the_same_file(tmp_path, ext):
    """README: a file gadget pickles as its file name; the copy reopens the file itself.
    Tables of one file in one process see each other's writes."""
    n, d = 2048, 16
    ref = np.random.default_rng(5).standard_normal((n, d)).astype(np.float32)
    f, path = _file_table(tmp_path, ref, ext)
    f.getData([0, 100])
    blob = pickle.dumps(f)
    assert len(blob) < 4096 < ref.nbytes, len(blob)
    c = pickle.loads(blob)
    assert (c.shape, c.dtype, c.placement) == (f.shape, f.dtype, "file")
    assert np.array_equal(c.getData([5, 0, 2047]).numpy(), ref[[5, 0, 2047]])
    f.insertData(torch.full((1, d), 9.0), [7])
    assert c.getData([7]).tolist() == [[9.0] * d]
    c.insertData(torch.full((1, d), 4.0), [8])
    assert f.getData([8]).tolist() == [[4.0] * d]
    d_ = copy.deepcopy(f)
    f.close()
    assert np.array_equal(c.getData([1]).numpy(), ref[[1]])
    assert d_.getData([7, 8]).numpy()[:, 0].tolist() == [9.0, 4.0]
    c.close()
    d_.close()


def test_file_table_pickle_keeps_its_options_and_absolute_path(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "two.h5", "w") as h:
        h["a"] = np.zeros((3, 2), np.float32)
        h["b"] = np.arange(20, dtype=np.float32).reshape(5, 4)
    monkeypatch.chdir(tmp_path)
    f = gl.DataGadget("two.h5", placement="file", dataset="b", writable=False, device="cpu")
    blob = pickle.dumps(f)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with h5py.File(elsewhere / "two.h5", "w") as h:
        h["b"] = np.full((5, 4), -1, np.float32)
    monkeypatch.chdir(elsewhere)
    for c in (pickle.loads(blob), copy.deepcopy(f)):
        assert c.shape == (5, 4)
        assert c.getData([1]).tolist() == [[4.0, 5.0, 6.0, 7.0]]
        with pytest.raises(gl.ReadOnlyError):
            c.insertData(torch.zeros(1, 4), [0])
        assert c.getData([0]).tolist() == [[0.0, 1.0, 2.0, 3.0]]
        c.close()
    f.close()


def test_dataset_pickle_and_deepcopy(tmp_path):
    ref = np.arange(40, dtype=np.float32).reshape(20, 2)
    np.save(tmp_path / "x.npy", ref)
    labels = gl.DataGadget(np.arange(20), placement="cpu", device="cpu")
    ds = gl.GadgetDataset(tmp_path / "x.npy", labels, placement="file", device="cpu")
    blob = pickle.dumps(ds)
    assert len(blob) < ref.nbytes + labels.nbytes + 8192
    for c in (pickle.loads(blob), copy.deepcopy(ds)):
        assert len(c) == 20
        assert [col.placement for col in c.columns] == ["file", "cpu"]
        x, y = c.gather([3, 19])
        assert np.array_equal(x.numpy(), ref[[3, 19]]) and y.tolist() == [3, 19]
        c.columns[1].insertData(torch.tensor([-5]), [0])
        assert labels.getData([0]).tolist() == [0]
        c.close()
    assert ds.gather([0])[1].tolist() == [0]


def test_sampler_pickle_and_copy_keep_rank_seed_epoch_and_position():
    """README: a pickled sampler keeps its rank."""
    s = gl.GadgetSampler(50, batch_size=4, seed=3, num_replicas=3, rank=2)
    first = [b.tolist() for b in s]
    assert s.epoch == 1
    for c in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s), copy.copy(s)):
        assert (c.rank, c.num_replicas, c.seed, c.epoch, c.batch_size) == (2, 3, 3, 1, 4)
        assert c.state_dict() == s.state_dict()
    c = pickle.loads(pickle.dumps(s))
    nxt = [b.tolist() for b in c]
    assert nxt == [b.tolist() for b in s]
    assert nxt != first
    it = iter(s)
    next(it)
    next(it)
    mid = pickle.loads(pickle.dumps(s))
    assert mid.state_dict() == s.state_dict()
    assert mid.state_dict()["position"] == 2


def test_sampler_batch_travels_as_its_own_ids():
    """README: sent to a DataLoader worker, a batch travels as its own ids, not the whole
    order it is a view of."""
    from multiprocessing.reduction import ForkingPickler

    s = gl.GadgetSampler(1_000_000, batch_size=10, seed=1)
    b = next(iter(s))
    assert len(pickle.dumps(b)) < 4096
    assert len(bytes(ForkingPickler.dumps(b))) < 4096
    buf = io.BytesIO()
    torch.save(b, buf)
    assert len(buf.getvalue()) < 8192
    buf.seek(0)
    assert torch.load(buf, weights_only=True).tolist() == b.tolist()
    c = copy.deepcopy(b)
    assert c.tolist() == b.tolist() and c.untyped_storage().nbytes() == 10 * 8


def test_loader_pickle_and_deepcopy_follow_the_original():
    ds = gl.GadgetDataset(
        np.arange(40, dtype=np.float32).reshape(20, 2), np.arange(20), placement="cpu", device="cpu"
    )
    loader = gl.GadgetLoader(ds, batch_size=3, seed=4)
    it = iter(loader)
    next(it)
    next(it)
    copies = [copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))]
    for c in copies:
        assert c.state_dict() == loader.state_dict()
        assert len(c) == len(loader)
    # a new pass of the original (left mid-epoch: the same epoch anew) and of each copy
    # yields the same batches
    del it
    want = [b[1].tolist() for b in loader]
    assert len(want) == len(loader)
    for c in copies:
        assert [b[1].tolist() for b in c] == want


def _train_one_step(emb, opt, ids):
    opt.zero_grad()
    (emb(torch.tensor(ids)) ** 2).sum().backward()
    opt.step()


def test_offloaded_embedding_copies_are_separate_tables_without_optimizer_state():
    """README: a copy.deepcopy of a model (or a pickled one) is a separate table with no
    optimizer and none of its state."""
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    _train_one_step(emb, opt, [1, 2, 2])
    w = emb.weight.getNumpyVersion()
    for c in (copy.deepcopy(emb), pickle.loads(pickle.dumps(emb))):
        assert c.weight is not emb.weight
        assert np.array_equal(c.weight.getNumpyVersion(), w)
        # a fresh optimizer takes the copy: fresh state, as a new table loaded with w
        opt_c = gl.OffloadedOptimizer(torch.optim.Adam, c, lr=0.1)
        fresh = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
        fresh.weight.insertData(torch.from_numpy(w), slice(0, 12))
        opt_f = gl.OffloadedOptimizer(torch.optim.Adam, fresh, lr=0.1)
        _train_one_step(c, opt_c, [1, 5])
        _train_one_step(fresh, opt_f, [1, 5])
        assert np.array_equal(c.weight.getNumpyVersion(), fresh.weight.getNumpyVersion())
        assert np.array_equal(emb.weight.getNumpyVersion(), w)
        del opt_c, opt_f
    # the original goes on training with its own state, unchanged by the copies
    torch.manual_seed(0)
    ref = gl.OffloadedEmbedding(12, 4, placement="cpu", device="cpu")
    opt_r = gl.OffloadedOptimizer(torch.optim.Adam, ref, lr=0.1)
    _train_one_step(ref, opt_r, [1, 2, 2])
    _train_one_step(ref, opt_r, [1, 5])
    _train_one_step(emb, opt, [1, 5])
    assert np.array_equal(emb.weight.getNumpyVersion(), ref.weight.getNumpyVersion())


def test_offloaded_optimizer_cannot_be_copied_or_pickled():
    emb = gl.OffloadedEmbedding(6, 3, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    for f in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(gl.GadgetTypeError, match="state_dict"):
            f(opt)
    buf = io.BytesIO()
    with pytest.raises(gl.GadgetTypeError):
        torch.save(opt, buf)


def test_interleaved_table_pickles_into_an_ordinary_table_with_its_own_rows():
    """README: a pickled or deep-copied cpu table (interleaved with its optimizer states)
    becomes an ordinary table with its own rows."""
    emb = gl.OffloadedEmbedding(8, 3, placement="cpu", device="cpu")
    _opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    _train_one_step(emb, _opt, [0, 3])
    w = emb.weight.getNumpyVersion()
    for c in (pickle.loads(pickle.dumps(emb.weight)), copy.deepcopy(emb.weight)):
        assert c.shape == (8, 3) and c.placement == "cpu"
        assert np.array_equal(c.getNumpyVersion(), w)
        t = c.as_tensor()
        assert t.is_contiguous() and t.shape == (8, 3)
        c.insertData(torch.zeros(1, 3), [3])
        assert np.array_equal(emb.weight.getNumpyVersion(), w)
        c.close()
    _train_one_step(emb, _opt, [3])
    assert not np.array_equal(emb.weight.getNumpyVersion()[3], w[3])


# =======================================================================================
# child processes
# =======================================================================================


def _objects_for_child(tmp_path, with_h5=True):
    ref = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(ref, placement="cpu", device="cpu")
    np.save(tmp_path / "f.npy", ref * 2)
    f = gl.DataGadget(tmp_path / "f.npy", placement="file", device="cpu")
    h = None
    if with_h5:
        with gl.DataGadget(ref * 3, placement="cpu") as src:
            src.save(tmp_path / "h.h5")
        h = gl.DataGadget(tmp_path / "h.h5", placement="file", device="cpu")
        h.getData([0])
    ds = gl.GadgetDataset(g, np.arange(4) * 10, placement="cpu", device="cpu")
    s = gl.GadgetSampler(9, batch_size=2, seed=7, num_replicas=2, rank=1)
    loader = gl.GadgetLoader(ds, batch_size=3, order="sequential")
    emb = gl.OffloadedEmbedding(5, 3, placement="cpu", device="cpu")
    return ref, (g, f, h, ds, s, loader, emb)


def _check_child_output(out, ref, objs, tmp_path, with_h5, emb_table, batches):
    g, f, h, ds, s, loader, emb = objs
    assert out is not None, "the child died before answering"
    assert "error" not in out, out["error"]
    assert np.array_equal(out["g"], ref[[0, 3]])
    assert out["g_device"] == "cpu"
    assert out["g_after"][1].tolist() == [-1.0] * 3
    assert np.array_equal(out["f"], 2 * ref[[2, 0]])
    if with_h5:
        assert np.array_equal(out["h"], 3 * ref[[3, 1]])
    # the file table reopened the same file: the child's write is in it
    assert np.load(tmp_path / "f.npy")[3].tolist() == [50.0] * 3
    assert out["s_meta"] == (1, 2, 7, 0)
    assert out["s"] == batches
    assert [[b[1].tolist() for b in out["L"]]] == [[[0, 10, 20], [30]]]
    assert np.array_equal(out["emb"], emb_table[[0, 2]])
    assert np.array_equal(out["emb_before"], emb_table)


def test_fork_child_gets_copies_of_memory_tables_and_reopens_files(tmp_path, children):
    """README: with fork a cpu table is the child's copy (its writes stay there); a file
    table reopens its file; HDF5 handles do not cross the fork."""
    pytest.importorskip("h5py")
    ref, objs = _objects_for_child(tmp_path)
    emb_table = objs[-1].weight.getNumpyVersion()
    batches = [b.tolist() for b in copy.deepcopy(objs[4])]
    out, code = _run_child("fork", children.read_objects, (objs,))
    _check_child_output(out, ref, objs, tmp_path, True, emb_table, batches)
    assert code == 0
    g, f, h, ds, *_ = objs
    # the child's writes stayed in the child
    assert np.array_equal(g.getNumpyVersion(), ref)
    assert np.array_equal(objs[-1].weight.getNumpyVersion(), emb_table)
    assert np.array_equal(h.getData([1, 2]).numpy(), 3 * ref[[1, 2]])
    for t in (g, f, h):
        t.close()


def test_spawn_child_receives_tables_dataset_sampler_loader_and_embedding(
    tmp_path, children, monkeypatch
):
    pytest.importorskip("h5py")
    _no_gpu_env(monkeypatch)
    ref, objs = _objects_for_child(tmp_path)
    emb_table = objs[-1].weight.getNumpyVersion()
    batches = [b.tolist() for b in copy.deepcopy(objs[4])]
    out, code = _run_child("spawn", children.read_objects, (objs,))
    _check_child_output(out, ref, objs, tmp_path, True, emb_table, batches)
    assert code == 0
    g, f, h, *_ = objs
    assert np.array_equal(h.getData([1, 2]).numpy(), 3 * ref[[1, 2]])
    for t in (g, f, h):
        t.close()


def test_spawn_child_receives_an_embedding_that_has_an_optimizer(tmp_path, children, monkeypatch):
    """A trained OffloadedEmbedding (its cpu table interleaved with Adam's states) sent to
    a spawned process: README says such a table pickles into an ordinary table with its
    own rows, and cpu gadgets pickle by value (through torch's shared memory when sent to
    workers)."""
    _no_gpu_env(monkeypatch)
    emb = gl.OffloadedEmbedding(5, 3, placement="cpu", device="cpu")
    _opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    _train_one_step(emb, _opt, [0, 2])
    out, code = _run_child("spawn", children.touch, (emb,))
    assert out is not None, f"the spawned child died (exit code {code}) receiving the embedding"
    assert "error" not in out, out["error"]
    assert np.array_equal(out["rows"], emb.weight.getData([0, 2]).numpy())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_read_file_and_memory_columns(tmp_path, method, monkeypatch):
    """README: each DataLoader worker (spawn or fork) reopens a file table itself; batches
    gathered in workers come as CPU tensors. With non-persistent workers, rows the main
    process writes between epochs are read by the next epoch."""
    pytest.importorskip("h5py")
    _no_gpu_env(monkeypatch)
    n = 20
    ref = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    with gl.DataGadget(ref, placement="cpu") as src:
        src.save(tmp_path / "d.h5", chunk_rows=4)
    np.save(tmp_path / "d.npy", 2 * ref)
    labels = gl.DataGadget(np.arange(n), placement="cpu", device="cpu")
    ds = gl.GadgetDataset(
        tmp_path / "d.h5", tmp_path / "d.npy", labels, placement="file", device="cpu"
    )
    sampler = gl.GadgetSampler(ds, batch_size=6, seed=1)
    dl = DataLoader(ds, batch_sampler=sampler, num_workers=1, multiprocessing_context=method)

    def epoch():
        with _fork_ok():
            return [[t.clone() for t in b] for b in dl]

    first = epoch()
    assert sorted(i for b in first for i in b[2].tolist()) == list(range(n))
    for x, x2, y in first:
        assert x.device.type == "cpu"
        assert np.array_equal(x.numpy(), ref[y.numpy()])
        assert np.array_equal(x2.numpy(), 2 * ref[y.numpy()])
    if method == "spawn":
        return  # keep the spawn case short
    ds.columns[0].insertData(torch.full((1, 2), -5.0), [0])
    ds.columns[1].insertData(torch.full((1, 2), -7.0), [0])
    labels.insertData(torch.tensor([100]), [0])
    second = epoch()
    rows = {int(y): (x.tolist(), x2.tolist()) for b in second for x, x2, y in zip(*b, strict=False)}
    assert rows[100] == ([-5.0, -5.0], [-7.0, -7.0])
    assert rows[1] == (ref[1].tolist(), (2 * ref[1]).tolist())


def test_persistent_workers_older_pass_raises_closed_error():
    """GadgetLoader docstring: with persistent_workers=True, once a newer iter() has
    started, reading an older pass raises GadgetClosedError."""
    ds = gl.GadgetDataset(
        np.arange(80, dtype=np.float32).reshape(40, 2), placement="cpu", device="cpu"
    )
    loader = gl.GadgetLoader(
        ds,
        batch_size=4,
        order="sequential",
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    with _fork_ok():
        old = iter(loader)
        assert next(old)[0][0].tolist() == [0.0, 1.0]
        new = iter(loader)
        assert next(new)[0][0].tolist() == [0.0, 1.0]
        with pytest.raises(gl.GadgetClosedError, match="newer"):
            next(old)
        rest = list(new)
    assert len(rest) == 9
    assert rest[-1][0][-1].tolist() == [78.0, 79.0]
    del old, new, loader


def test_fork_while_other_threads_read_and_write_an_hdf5_table(tmp_path):
    """README: a fork waits for each HDF5 table another thread is using, then closes its
    handles; DataLoader workers read the file right. (The writer thread writes the rows'
    own values, so every read must equal the reference.)"""
    pytest.importorskip("h5py")
    n = 3000
    ref = np.random.default_rng(7).standard_normal((n, 8)).astype(np.float32)
    g, _ = _file_table(tmp_path, ref, "h5", cache_bytes=0)
    ds = gl.GadgetDataset(g, np.arange(n), placement="cpu", device="cpu")
    stop = threading.Event()
    errs: list[object] = []

    def reader():
        rng = np.random.default_rng(1)
        while not stop.is_set():
            ids = rng.integers(0, n, 400)
            try:
                if not np.array_equal(g.getData(ids).numpy(), ref[ids]):
                    errs.append("thread read wrong rows")
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
                return

    def writer():
        rng = np.random.default_rng(2)
        while not stop.is_set():
            ids = rng.integers(0, n, 100)
            try:
                g.insertData(torch.from_numpy(ref[ids]), ids)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
                return

    threads = [
        threading.Thread(target=reader, daemon=True),
        threading.Thread(target=writer, daemon=True),
    ]
    for t in threads:
        t.start()
    time.sleep(0.05)
    try:
        sampler = gl.GadgetSampler(ds, batch_size=500, seed=0)
        total = 0
        with _fork_ok():
            for x, y in DataLoader(
                ds, batch_sampler=sampler, num_workers=2, multiprocessing_context="fork"
            ):
                assert np.array_equal(x.numpy(), ref[y.numpy()])
                total += len(y)
    finally:
        stop.set()
        for t in threads:
            t.join(JOIN_S)
    assert total == n
    assert not errs, errs[:3]
    g.close()


# =======================================================================================
# garbage collection
# =======================================================================================


def _gone(*refs):
    gc.collect()
    return [r() is None for r in refs]


@pytest.mark.parametrize("kind", ["cpu", *FILE_EXTS])
def test_tables_used_from_threads_are_freed_when_deleted(tmp_path, kind):
    ref = np.random.default_rng(8).standard_normal((200, 4)).astype(np.float32)
    box = {
        "g": _table(tmp_path, ref, kind)[0],
        "other": gl.DataGadget(ref, placement="cpu", device="cpu"),
    }

    def use(i):
        def run():
            g, other = box["g"], box["other"]
            ids = np.arange(i, 200, 4)
            g.getData(ids)
            g.insertData(torch.from_numpy(ref[ids]), ids)
            gl.gather_many([g, other], ids)
            gl.scatter_many([g, other], [torch.from_numpy(ref[ids])] * 2, ids)
            g[ids[:3], 0:2] = torch.zeros(3, 2)

        return run

    assert not _run_threads([use(i) for i in range(4)])
    refs = (weakref.ref(box["g"]), weakref.ref(box["other"]), weakref.ref(box["g"].store))
    box.clear()
    assert _gone(*refs) == [True, True, True]


def test_pipeline_objects_are_freed_mid_pass():
    ref = np.arange(400, dtype=np.float32).reshape(200, 2)
    ds = gl.GadgetDataset(ref, np.arange(200), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4)
    it = iter(loader)
    next(it)
    refs = tuple(weakref.ref(x) for x in (ds, loader, ds.columns[0], ds.columns[1], loader.sampler))
    del ds, loader, it
    assert _gone(*refs) == [True] * 5

    s = gl.GadgetSampler(200_000, batch_size=10)
    it = iter(s)
    next(it)
    r = weakref.ref(s)
    del s, it
    assert _gone(r) == [True]

    ds = gl.GadgetDataset(ref, placement="cpu", device="cpu")
    sampler = gl.GadgetSampler(ds, batch_size=8)
    with _fork_ok():
        dl_it = iter(
            DataLoader(ds, batch_sampler=sampler, num_workers=1, multiprocessing_context="fork")
        )
        next(dl_it)
    refs = (weakref.ref(ds), weakref.ref(sampler), weakref.ref(ds.columns[0]))
    del ds, sampler, dl_it
    assert _gone(*refs) == [True] * 3


def test_embedding_and_optimizer_are_freed_and_a_new_optimizer_may_take_the_table():
    """README: a table belongs to one OffloadedOptimizer at a time; once that one is gone
    (deleted and collected) a new one may take the table. Modules and optimizers are freed
    when collected."""
    emb = gl.OffloadedEmbedding(50, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    _train_one_step(emb, opt, [1, 2])
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    r_opt = weakref.ref(opt)
    del opt
    assert _gone(r_opt) == [True]
    before = emb.weight.getNumpyVersion()
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    emb(torch.tensor([3])).sum().backward()
    opt2.step()
    after = emb.weight.getNumpyVersion()
    assert np.allclose(after[3], before[3] - 1.0)
    assert np.array_equal(np.delete(after, 3, 0), np.delete(before, 3, 0))
    refs = (weakref.ref(emb), weakref.ref(emb.weight), weakref.ref(opt2))
    del emb, opt2
    assert _gone(*refs) == [True] * 3
