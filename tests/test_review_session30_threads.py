"""Black-box review (session 30) of concurrent use from several Python threads in one
process (shared and separate ``file`` tables of .npy / HDF5 / zarr files, ``cpu`` tables,
``gather_many`` / ``scatter_many``, ``GadgetDataset`` / ``GadgetLoader``,
``OffloadedEmbedding`` and the switchers, ``flush`` / ``close``); written from README.md,
SPEC.md and the public docstrings only.

Documented claims exercised here (README, "Files: .npy, HDF5 and zarr"):

* "Several `file` tables of one file in one process may all write, and see each other's
  writes (each drops its cached blocks when another writes); threads may share a `file`
  table (each call holds a lock per file)."
* FileStore docstring: "Threads may share a store: every read and write holds a lock per
  file."
* "Each write reaches the file before it returns ...; `g.flush()` and `close()` push a
  `file` table's writes too."
* "after `close()` every call that touches rows, `load()` and `flush()` included, raises
  `GadgetClosedError`".
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _hide_cuda():
    """These tests check the behaviour on a machine without CUDA: on a GPU machine the
    library is made to see none (its defaults there differ: pinned tables, CUDA output)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

N = 96  # rows
D = 8  # row width
CH = 16  # chunk rows
NT = 4  # threads
TIMEOUT = 60

FILE_FORMATS = ["npy", "h5", "h5contig", "h5gzip", "zarr", "zarr_plain"]
WRITE_FORMATS = FILE_FORMATS
CORE_FORMATS = ["npy", "h5", "h5gzip", "zarr"]  # for the secondary claims


# ---------------------------------------------------------------------------------- helpers


def base_array(n: int = N, d: int = D) -> np.ndarray:
    return (np.arange(n * d, dtype=np.float32).reshape(n, d) / 7.0).astype(np.float32)


def make_file(tmp_path, fmt: str, arr: np.ndarray, name: str = "t") -> str:
    if fmt == "npy":
        p = tmp_path / f"{name}.npy"
        np.save(p, arr)
    elif fmt in ("h5", "h5contig", "h5gzip"):
        p = tmp_path / f"{name}.h5"
        with h5py.File(p, "w") as f:
            if fmt == "h5contig":
                f.create_dataset("emb", data=arr)
            elif fmt == "h5":
                f.create_dataset("emb", data=arr, chunks=(CH,) + arr.shape[1:])
            else:
                f.create_dataset("emb", data=arr, chunks=(CH,) + arr.shape[1:], compression="gzip")
    elif fmt == "zarr":
        p = tmp_path / f"{name}.zarr"
        gl.DataGadget(arr, placement="cpu").save(str(p), chunk_rows=CH)
    elif fmt == "zarr_plain":
        p = tmp_path / f"{name}.zarr"
        gl.DataGadget(arr, placement="cpu").save(str(p), chunk_rows=CH, compression="none")
    else:  # pragma: no cover
        raise AssertionError(fmt)
    return str(p)


def read_native(path: str) -> np.ndarray:
    """The file's rows read by numpy / h5py / zarr, not by gadgetloader."""
    if path.endswith(".npy"):
        return np.load(path)
    if path.endswith(".h5"):
        with h5py.File(path, "r") as f:
            return f["emb"][...]
    z = zarr.open(path, mode="r")
    if not hasattr(z, "shape"):
        (name,) = list(z.array_keys())
        z = z[name]
    return np.asarray(z[...])


def open_file(path: str, **kw) -> gl.DataGadget:
    return gl.DataGadget(path, placement="file", **kw)


def run_threads(fn, n: int = NT):
    """Run fn(0..n-1) in n threads at once; re-raise the first exception."""
    with ThreadPoolExecutor(max_workers=n) as ex:
        futs = [ex.submit(fn, i) for i in range(n)]
        return [f.result(timeout=TIMEOUT) for f in futs]


def const_rows(n: int, value: float, d: int = D) -> torch.Tensor:
    return torch.full((n, d), float(value), dtype=torch.float32)


def assert_rows_constant(a: np.ndarray) -> None:
    """Every row holds one value in all its elements (no torn rows)."""
    torn = np.nonzero((a != a[:, :1]).any(axis=1))[0]
    assert torn.size == 0, f"torn rows {torn.tolist()[:10]}: {a[torn[:3]]}"


# ----------------------------------------------------- file tables: disjoint concurrent writes


def _disjoint_plan(t: int, n: int = N, nt: int = NT):
    """Thread t owns rows r with r % nt == t: neighbouring rows (same chunk) belong to
    other threads, so every chunk is rewritten by every thread."""
    return np.arange(t, n, nt)


@pytest.mark.parametrize("cache", [None, 2 * CH * D * 4], ids=["defcache", "tinycache"])
@pytest.mark.parametrize("fmt", WRITE_FORMATS)
def test_shared_table_disjoint_interleaved_writes_exact(tmp_path, fmt, cache):
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path, **({} if cache is None else {"cache_bytes": cache}))
    rounds = 4
    barrier = threading.Barrier(NT, timeout=TIMEOUT)

    def work(t):
        ids = _disjoint_plan(t)
        barrier.wait()
        for k in range(rounds):
            g.insertData(const_rows(len(ids), 1000 * (t + 1) + k), ids)

    run_threads(work)
    exp = arr.copy()
    for t in range(NT):
        exp[_disjoint_plan(t)] = 1000 * (t + 1) + rounds - 1
    np.testing.assert_array_equal(g.getNumpyVersion(), exp)
    g.close()
    np.testing.assert_array_equal(read_native(path), exp)


@pytest.mark.parametrize("fmt", WRITE_FORMATS)
def test_separate_tables_same_file_disjoint_writes_exact(tmp_path, fmt):
    """README: several `file` tables of one file in one process may all write."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    tables = [open_file(path) for _ in range(NT)]
    rounds = 4
    barrier = threading.Barrier(NT, timeout=TIMEOUT)

    def work(t):
        ids = _disjoint_plan(t)
        barrier.wait()
        for k in range(rounds):
            tables[t].insertData(const_rows(len(ids), 1000 * (t + 1) + k), ids)

    run_threads(work)
    exp = arr.copy()
    for t in range(NT):
        exp[_disjoint_plan(t)] = 1000 * (t + 1) + rounds - 1
    # every table sees every other table's writes
    for t, g in enumerate(tables):
        np.testing.assert_array_equal(g.getNumpyVersion(), exp, err_msg=f"table {t}")
    for g in tables:
        g.close()
    np.testing.assert_array_equal(read_native(path), exp)


@pytest.mark.parametrize("fmt", ["npy", "h5gzip", "zarr"])
def test_separate_tables_disjoint_writes_with_repeated_ids_last_wins(tmp_path, fmt):
    """Repeated ids inside each thread's call: the last occurrence wins, per call."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    tables = [open_file(path) for _ in range(NT)]

    def work(t):
        ids = _disjoint_plan(t)
        rep = np.concatenate([ids, ids[::-1]])  # every id twice; last occurrence = 2nd half
        rows = torch.cat([const_rows(len(ids), -1.0), const_rows(len(ids), t + 0.5)])
        for _ in range(3):
            tables[t].insertData(rows, rep)

    run_threads(work)
    exp = arr.copy()
    for t in range(NT):
        exp[_disjoint_plan(t)] = t + 0.5
    for g in tables:
        g.close()
    np.testing.assert_array_equal(read_native(path), exp)


@pytest.mark.parametrize("fmt", WRITE_FORMATS)
def test_shared_table_disjoint_contiguous_slices_exact(tmp_path, fmt):
    """Each thread writes its own block of rows via a slice (g[a:b] = rows)."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    per = N // NT  # 24 rows: blocks straddle chunk borders (16-row chunks)

    def work(t):
        for k in range(3):
            g[t * per : (t + 1) * per] = const_rows(per, 10 * t + k)

    run_threads(work)
    exp = arr.copy()
    for t in range(NT):
        exp[t * per : (t + 1) * per] = 10 * t + 2
    g.close()
    np.testing.assert_array_equal(read_native(path), exp)


def _column_race(tables, rounds):
    """Two threads write disjoint column halves of all rows, starting each round
    together; after each round thread 0 checks both halves. Stops at the first loss."""
    half = D // 2
    ids = np.arange(N)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    lost = []

    def work(t):
        cols = slice(0, half) if t == 0 else slice(half, D)
        for k in range(rounds):
            barrier.wait()
            tables[t].insertData(torch.full((N, half), float(100 * (t + 1) + k)), (ids, cols))
            barrier.wait()
            if t == 0:
                got = tables[0].getData(ids).numpy()
                if not ((got[:, :half] == 100 + k).all() and (got[:, half:] == 200 + k).all()):
                    lost.append((k, got[0].tolist()))
            barrier.wait()
            if lost:
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more chances to interleave
    try:
        run_threads(work, 2)
    finally:
        sys.setswitchinterval(old)
    return lost


@pytest.mark.parametrize("fmt", WRITE_FORMATS)
def test_partial_row_writes_of_disjoint_columns_no_lost_update(tmp_path, fmt):
    """A tuple index writes part of each row ("insertData with such an index writes
    only that part"; the docstring: "the rows are read, changed and written back").
    With each call holding the file's lock, two threads writing different columns of
    the same rows -- through one shared table, then through two tables of the file --
    must never lose each other's columns."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    lost_shared = _column_race([g, g], 300)
    g2 = open_file(path)
    lost_sep = _column_race([g, g2], 300)
    g.close()
    g2.close()
    assert lost_shared == [] and lost_sep == [], (
        f"lost columns: shared table {lost_shared[:1]}, two tables {lost_sep[:1]} "
        "(round, row 0 after the round; expected [100+k]*4 + [200+k]*4)"
    )


# ------------------------------------------------- file tables: overlapping concurrent writes


OVERLAP_IDS = np.array([3, 4, 17, 18, 19, 40, 41, 63, 64, 65, 90, 95])


def _overlap_writes(tables, rounds=5):
    barrier = threading.Barrier(NT, timeout=TIMEOUT)
    written = set()
    for t in range(NT):
        for k in range(rounds):
            written.add(float(1000 * (t + 1) + k))

    def work(t):
        g = tables[t % len(tables)]
        barrier.wait()
        for k in range(rounds):
            g.insertData(const_rows(len(OVERLAP_IDS), 1000 * (t + 1) + k), OVERLAP_IDS)

    run_threads(work)
    return written


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_overlapping_writes_rows_never_torn(tmp_path, fmt, shared):
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    tables = [open_file(path)] if shared else [open_file(path) for _ in range(NT)]
    written = _overlap_writes(tables)
    for g in tables:
        g.close()
    got = read_native(path)
    rows = got[OVERLAP_IDS]
    assert_rows_constant(rows)
    assert set(rows[:, 0].tolist()) <= written
    others = np.setdiff1d(np.arange(N), OVERLAP_IDS)
    np.testing.assert_array_equal(got[others], arr[others])


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_overlapping_writes_whole_call_wins(tmp_path, fmt, shared):
    """Each call holds the file's lock, so calls do not interleave: the final rows are
    all from one call (the last one to run)."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    tables = [open_file(path)] if shared else [open_file(path) for _ in range(NT)]
    _overlap_writes(tables)
    for g in tables:
        g.close()
    rows = read_native(path)[OVERLAP_IDS]
    assert np.unique(rows).size == 1, np.unique(rows[:, 0])


# --------------------------------------------------------- file tables: readers and writers


@pytest.mark.parametrize("cache", [0, 4 * CH * D * 4], ids=["nocache", "tinycache"])
@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_concurrent_readers_random_ids_match_numpy(tmp_path, fmt, cache):
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    kw = {} if cache is None else {"cache_bytes": cache}
    g = open_file(path, **kw)

    def work(t):
        rng = np.random.default_rng(t)
        for _ in range(15):
            ids = rng.integers(0, N, size=int(rng.integers(1, 40)))
            got = g.getData(torch.from_numpy(ids))
            np.testing.assert_array_equal(got.numpy(), arr[ids])
            two = rng.integers(0, N, size=(3, 5))  # any shape of ids
            np.testing.assert_array_equal(g.getData(two).numpy(), arr[two])
        return True

    assert all(run_threads(work))
    g.close()


@pytest.mark.parametrize("shared", [True, False, "ro"], ids=["shared", "separate", "readonly"])
@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_reader_sees_whole_calls_while_writer_writes(tmp_path, fmt, shared):
    """A read runs under the same per-file lock as a write: a reader of rows that one
    writer rewrites with a new constant each call sees all rows of one call, never
    rows of two calls or a torn row, and versions never go back."""
    arr = np.zeros((N, D), np.float32)
    path = make_file(tmp_path, fmt, arr)
    w = open_file(path)
    r = w if shared is True else open_file(path, **({"writable": False} if shared == "ro" else {}))
    ids = np.arange(5, 85)  # spans several chunks
    stop = threading.Event()
    seen = []

    def writer(_):
        try:
            for k in range(1, 25):
                w.insertData(const_rows(len(ids), k), ids)
        finally:
            stop.set()

    def reader(_):
        last = 0.0
        while True:
            done = stop.is_set()  # one more read after the writer has finished
            got = r.getData(ids).numpy()
            vals = np.unique(got)
            seen.append(vals.tolist())
            assert vals.size == 1, f"mixed rows of calls {vals.tolist()}"
            assert vals[0] >= last, (vals[0], last)
            last = float(vals[0])
            if done:
                return last

    def work(i):
        return writer(i) if i == 0 else reader(i)

    res = run_threads(work, 3)
    assert res[1] == 24.0 and res[2] == 24.0
    np.testing.assert_array_equal(r.getData(ids).numpy(), np.full((len(ids), D), 24.0, np.float32))


@pytest.mark.parametrize("reader_kw", [{}, {"writable": False}], ids=["rw", "ro"])
@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_other_table_sees_write_as_soon_as_call_returns(tmp_path, fmt, reader_kw):
    """Ping-pong between a writer thread (table A) and a reader thread (table B of the
    same file, its blocks cached before each write): once A's insertData has returned,
    B's next read must show it (B drops its cached blocks; a read-only HDF5 handle
    reopens a changed file)."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    a = open_file(path)
    b = open_file(path, **reader_kw)
    ids = np.array([1, 2, 20, 33, 60, 95])
    wrote = threading.Event()
    read_done = threading.Event()
    rounds = 6
    failures = []

    def writer(_):
        for k in range(rounds):
            assert read_done.wait(TIMEOUT)
            read_done.clear()
            a.insertData(const_rows(len(ids), 7 + k), ids)
            wrote.set()

    def reader(_):
        b.getData(ids)  # prime the cache
        read_done.set()
        for k in range(rounds):
            assert wrote.wait(TIMEOUT)
            wrote.clear()
            got = b.getData(ids).numpy()
            if not (got == 7 + k).all():
                failures.append((k, np.unique(got).tolist()))
            read_done.set()

    run_threads(lambda i: writer(i) if i == 0 else reader(i), 2)
    assert failures == []
    a.close()
    b.close()


@pytest.mark.parametrize("fmt", ["npy", "zarr", "zarr_plain"])
def test_write_reaches_file_before_call_returns_threads(tmp_path, fmt):
    """README: each write reaches the file before it returns. A thread that learns that
    another thread's insertData returned reads the rows with numpy / zarr directly."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    done = threading.Event()

    def writer(_):
        g.insertData(const_rows(3, 42.0), [0, 50, 95])
        done.set()

    def reader(_):
        assert done.wait(TIMEOUT)
        return read_native(path)

    got = run_threads(lambda i: writer(i) if i == 0 else reader(i), 2)[1]
    exp = arr.copy()
    exp[[0, 50, 95]] = 42.0
    np.testing.assert_array_equal(got, exp)
    g.close()


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_flush_from_other_thread_while_writing(tmp_path, fmt):
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    stop = threading.Event()

    def writer(t):
        ids = _disjoint_plan(t, nt=2)
        try:
            for k in range(6):
                g.insertData(const_rows(len(ids), 10 * t + k), ids)
        finally:
            if t == 1:
                stop.set()

    def flusher(_):
        n = 0
        while not stop.is_set():
            g.flush()
            n += 1
        g.flush()
        return n + 1

    res = run_threads(lambda i: writer(i) if i < 2 else flusher(i), 3)
    assert res[2] >= 1
    exp = arr.copy()
    exp[_disjoint_plan(0, nt=2)] = 5
    exp[_disjoint_plan(1, nt=2)] = 15
    # written and flushed: a fresh table of the same file (own handle) reads it
    with open_file(path, writable=False) as fresh:
        np.testing.assert_array_equal(fresh.getNumpyVersion(), exp)
    g.close()
    np.testing.assert_array_equal(read_native(path), exp)


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_getNumpyVersion_during_disjoint_writes_rows_old_or_new(tmp_path, fmt):
    """A whole-table read while other threads write: untouched rows are exact, written
    rows are whole rows of one version (never torn)."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    ids = np.arange(0, N, 2)
    stop = threading.Event()

    def writer(_):
        try:
            for k in range(8):
                g.insertData(const_rows(len(ids), 500 + k), ids)
        finally:
            stop.set()

    def reader(_):
        snaps = []
        while not stop.is_set() or not snaps:
            snaps.append(g.getNumpyVersion())
        return snaps

    snaps = run_threads(lambda i: writer(i) if i == 0 else reader(i), 2)[1]
    others = np.arange(1, N, 2)
    versions = {float(500 + k) for k in range(8)}
    for s in snaps:
        np.testing.assert_array_equal(s[others], arr[others])
        w = s[ids]
        for i, row in zip(ids, w, strict=False):
            assert (row == arr[i]).all() or ((row == row[0]).all() and float(row[0]) in versions), (
                i,
                row,
            )
    g.close()


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_concurrent_fill_and_reads_rows_never_torn(tmp_path, fmt):
    """fill_ on a file table (filled block by block) while another thread reads."""
    arr = np.zeros((N, D), np.float32)
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    stop = threading.Event()

    def filler(_):
        try:
            for k in range(1, 6):
                g.fill_(float(k))
        finally:
            stop.set()

    def reader(_):
        out = []
        while not stop.is_set() or not out:
            out.append(g.getData(np.arange(N)).numpy())
        return out

    snaps = run_threads(lambda i: filler(i) if i == 0 else reader(i), 2)[1]
    for s in snaps:
        assert_rows_constant(s)
        assert set(np.unique(s).tolist()) <= {0.0, 1.0, 2.0, 3.0, 4.0, 5.0}
    g.close()
    np.testing.assert_array_equal(read_native(path), np.full((N, D), 5.0, np.float32))


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_concurrent_open_of_same_file_in_threads(tmp_path, fmt):
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)

    def work(t):
        with open_file(path, writable=False) as g:
            ids = np.arange(t, N, 3)
            return bool(np.array_equal(g.getData(ids).numpy(), arr[ids]))

    assert all(run_threads(work, 6))


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_readonly_table_refuses_writes_from_threads_file_unchanged(tmp_path, fmt):
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path, writable=False)

    def work(t):
        try:
            g.insertData(const_rows(2, 1.0), [t, t + 1])
        except gl.ReadOnlyError as e:
            return e
        return None

    errs = run_threads(work)
    assert all(isinstance(e, gl.ReadOnlyError) for e in errs), errs
    g.close()
    np.testing.assert_array_equal(read_native(path), arr)


@pytest.mark.parametrize("fmt", ["npy", "h5gzip", "zarr"])
def test_bad_ids_in_one_thread_do_not_disturb_others(tmp_path, fmt):
    """A refused call (id out of range) raises GadgetIndexError before anything is
    written, while other threads' valid writes go through exactly."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)

    def work(t):
        if t % 2:
            errs = 0
            for _ in range(5):
                with pytest.raises(gl.GadgetIndexError):
                    g.insertData(const_rows(3, -9.0), [t, t + 1, N + t])
                with pytest.raises(gl.GadgetIndexError):
                    g.getData([0, N])
                errs += 1
            return errs
        ids = _disjoint_plan(t)
        for k in range(4):
            g.insertData(const_rows(len(ids), t * 10 + k), ids)
        return 0

    run_threads(work)
    exp = arr.copy()
    for t in (0, 2):
        exp[_disjoint_plan(t)] = t * 10 + 3
    g.close()
    np.testing.assert_array_equal(read_native(path), exp)


# ------------------------------------------------------------ close while another thread uses


def _reader_until_closed(g, ids, ref_rows, started, deadline=20.0):
    """Read until the table is closed; return (good reads, the exception that ended it)."""
    good = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline:
        try:
            got = g.getData(ids)
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            return good, e
        np.testing.assert_array_equal(got.numpy(), ref_rows)
        good += 1
        started.set()
    return good, None


@pytest.mark.parametrize("fmt", CORE_FORMATS + ["cpu"])
def test_close_while_other_thread_reads_raises_closed_error(tmp_path, fmt):
    """README: after close() every call that touches rows raises GadgetClosedError. A
    thread reading in a loop while another thread closes the table gets correct rows,
    then GadgetClosedError -- not another exception."""
    arr = base_array()
    if fmt == "cpu":
        g = gl.DataGadget(arr, placement="cpu")
    else:
        g = open_file(make_file(tmp_path, fmt, arr))
    ids = np.arange(0, N, 5)
    started = threading.Event()

    def closer(_):
        assert started.wait(TIMEOUT)
        time.sleep(0.01)
        g.close()

    res = run_threads(
        lambda i: _reader_until_closed(g, ids, arr[ids], started) if i == 0 else closer(i), 2
    )
    good, exc = res[0]
    assert good >= 1
    assert isinstance(exc, gl.GadgetClosedError), repr(exc)
    assert len(g) == N and g.shape == (N, D)  # still answer after close
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_close_with_many_reader_threads_only_closed_errors(tmp_path, fmt):
    arr = base_array()
    g = open_file(make_file(tmp_path, fmt, arr), cache_bytes=0)
    started = threading.Event()
    n_readers = 3

    def work(i):
        if i < n_readers:
            ids = np.arange(i, N, 7)
            return _reader_until_closed(g, ids, arr[ids], started)
        assert started.wait(TIMEOUT)
        time.sleep(0.02)
        g.close()
        return None

    res = run_threads(work, n_readers + 1)
    for _good, exc in res[:n_readers]:
        assert isinstance(exc, gl.GadgetClosedError), repr(exc)


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_close_while_other_thread_writes(tmp_path, fmt):
    """A writer thread gets GadgetClosedError once the table is closed; every write that
    returned reached the file (close flushes), and no row is torn."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    ids = np.arange(0, N, 2)
    started = threading.Event()

    def writer(_):
        k = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            try:
                g.insertData(const_rows(len(ids), 1000 + k), ids)
            except Exception as e:  # noqa: BLE001
                return k, e
            k += 1
            started.set()
        return k, None

    def closer(_):
        assert started.wait(TIMEOUT)
        time.sleep(0.01)
        g.close()

    (n_ok, exc), _ = run_threads(lambda i: writer(i) if i == 0 else closer(i), 2)
    assert isinstance(exc, gl.GadgetClosedError), repr(exc)
    assert n_ok >= 1
    got = read_native(path)
    w = got[ids]
    assert_rows_constant(w)
    vals = np.unique(w)
    # the last write that returned is in the file (a later one may have gone through
    # before the close)
    assert vals.size == 1 and vals[0] in (1000 + n_ok - 1, 1000 + n_ok), (vals, n_ok)
    others = np.arange(1, N, 2)
    np.testing.assert_array_equal(got[others], arr[others])


@pytest.mark.parametrize("fmt", ["npy", "h5gzip", "zarr"])
def test_close_concurrently_from_many_threads_is_idempotent(tmp_path, fmt):
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    g.insertData(const_rows(1, 3.0), [7])
    barrier = threading.Barrier(NT, timeout=TIMEOUT)

    def work(_):
        barrier.wait()
        g.close()
        return True

    assert all(run_threads(work))
    calls = (
        lambda: g.flush(),
        lambda: g.getData([0]),
        lambda: g.insertData(const_rows(1, 1.0), [0]),
    )
    for call in calls:
        with pytest.raises(gl.GadgetClosedError):
            call()
    exp = arr.copy()
    exp[7] = 3.0
    np.testing.assert_array_equal(read_native(path), exp)


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_flush_in_thread_after_close_raises_closed(tmp_path, fmt):
    g = open_file(make_file(tmp_path, fmt, base_array()))
    g.close()

    def work(_):
        try:
            g.flush()
        except gl.GadgetClosedError as e:
            return e
        return None

    assert all(isinstance(e, gl.GadgetClosedError) for e in run_threads(work, 2))


# ------------------------------------------------------------------------------- cpu tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool])
def test_cpu_table_disjoint_concurrent_writes_exact(dtype):
    ref = torch.zeros((N, D), dtype=dtype)
    g = gl.DataGadget(ref.clone(), placement="cpu")
    barrier = threading.Barrier(NT, timeout=TIMEOUT)

    def val(t, k):
        if dtype == torch.bool:
            return (
                torch.ones((len(_disjoint_plan(t)), D), dtype=dtype)
                if (t + k) % 2
                else torch.zeros((len(_disjoint_plan(t)), D), dtype=dtype)
            )
        return torch.full((len(_disjoint_plan(t)), D), 10 * (t + 1) + k).to(dtype)

    def work(t):
        ids = torch.from_numpy(_disjoint_plan(t))
        barrier.wait()
        for k in range(50):
            g.insertData(val(t, k), ids)

    run_threads(work)
    exp = ref.clone()
    for t in range(NT):
        exp[torch.from_numpy(_disjoint_plan(t))] = val(t, 49)
    assert torch.equal(torch.from_numpy(g.getNumpyVersion()), exp)


def test_cpu_table_readers_of_untouched_rows_while_others_write():
    arr = base_array()
    g = gl.DataGadget(arr, placement="cpu")
    stop = threading.Event()
    ro = np.arange(0, N, 2)
    rw = np.arange(1, N, 2)

    def work(t):
        if t == 0:
            try:
                for k in range(200):
                    g.insertData(const_rows(len(rw), k), rw)
            finally:
                stop.set()
            return 0
        n = 0
        while not stop.is_set() or n == 0:
            np.testing.assert_array_equal(g.getData(ro).numpy(), arr[ro])
            n += 1
        return n

    assert all(n >= 1 for n in run_threads(work, 3)[1:])
    np.testing.assert_array_equal(g.getNumpyVersion()[rw], np.full((len(rw), D), 199, np.float32))


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_scatter_many_gather_many_disjoint_threads(tmp_path, placement):
    """scatter_many over a table and two state tables from several threads, each on its
    own rows; then gather_many from several threads."""
    arrs = [base_array(), base_array() * 2, base_array() * 3]
    if placement == "cpu":
        tabs = [gl.DataGadget(a, placement="cpu") for a in arrs]
    else:
        tabs = [
            open_file(make_file(tmp_path, f, a, name=f"s{i}"))
            for i, (f, a) in enumerate(zip(["npy", "h5gzip", "zarr"], arrs, strict=False))
        ]

    def write(t):
        ids = _disjoint_plan(t)
        for k in range(5):
            gl.scatter_many(
                tabs, [const_rows(len(ids), 100 * j + 10 * t + k) for j in range(3)], ids
            )

    run_threads(write)
    exps = [a.copy() for a in arrs]
    for t in range(NT):
        for j in range(3):
            exps[j][_disjoint_plan(t)] = 100 * j + 10 * t + 4

    def read(t):
        rng = np.random.default_rng(t)
        for _ in range(10):
            ids = rng.integers(0, N, 17)
            outs = gl.gather_many(tabs, ids)
            for j in range(3):
                np.testing.assert_array_equal(outs[j].numpy(), exps[j][ids])
        return True

    assert all(run_threads(read))
    for g in tabs:
        g.close()


# --------------------------------------------------------------- GadgetDataset / GadgetLoader


def _dataset_columns(tmp_path, fmt):
    x = base_array()
    y = np.arange(N, dtype=np.int64) * 3
    if fmt == "cpu":
        return x, y, gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    path = make_file(tmp_path, fmt, x)
    return x, y, gl.GadgetDataset(path, y, placement="file", device="cpu")


@pytest.mark.parametrize("fmt", ["cpu", "npy", "h5", "h5gzip", "zarr"])
def test_dataset_getitem_from_threads(tmp_path, fmt):
    x, y, ds = _dataset_columns(tmp_path, fmt)

    def work(t):
        rng = np.random.default_rng(100 + t)
        for _ in range(12):
            ids = rng.integers(0, N, int(rng.integers(1, 30)))
            bx, by = ds[torch.from_numpy(ids)]
            np.testing.assert_array_equal(bx.numpy(), x[ids])
            np.testing.assert_array_equal(by.numpy(), y[ids])
            gx, gy = ds.gather(ids.tolist())
            np.testing.assert_array_equal(gx.numpy(), x[ids])
            np.testing.assert_array_equal(gy.numpy(), y[ids])
            i = int(rng.integers(-N, N))
            sx, sy = ds[i]
            np.testing.assert_array_equal(sx.numpy(), x[i])
            assert int(sy) == int(y[i])
        return True

    assert all(run_threads(work))
    ds.close()


def _loader_epoch(loader):
    return [tuple(t.clone() for t in b) for b in loader]


@pytest.mark.parametrize("order", ["sequential", "random"])
@pytest.mark.parametrize("fmt", ["cpu", "npy", "h5gzip", "zarr"])
def test_two_gadget_loaders_in_threads_over_one_dataset(tmp_path, fmt, order):
    """Two loaders (each with its own sampler) iterated at once in two threads over one
    dataset yield exactly what each yields alone."""
    x, y, ds = _dataset_columns(tmp_path, fmt)

    def mk(seed):
        return gl.GadgetLoader(ds, batch_size=10, order=order, seed=seed, prefetch=0)

    alone = [_loader_epoch(mk(s)) for s in (1, 2)]
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def work(t):
        loader = mk(t + 1)
        barrier.wait()
        return [_loader_epoch(loader) for _ in range(2)]

    res = run_threads(work, 2)
    for t in range(2):
        for epoch in res[t]:
            assert len(epoch) == len(alone[t])
            seen = []
            for bx, by in epoch:
                np.testing.assert_array_equal(bx.numpy(), x[by.numpy() // 3])
                seen.extend((by.numpy() // 3).tolist())
            assert sorted(seen) == list(range(N))
        # first epoch identical to the loader run alone
        for a, b in zip(res[t][0], alone[t], strict=False):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ds.close()


@pytest.mark.parametrize("fmt", ["cpu", "npy", "zarr"])
def test_dataloader_with_gadget_sampler_per_thread(tmp_path, fmt):
    from torch.utils.data import DataLoader

    x, y, ds = _dataset_columns(tmp_path, fmt)

    def work(t):
        sampler = gl.GadgetSampler(ds, batch_size=8, order="random", seed=t)
        out = []
        for bx, by in DataLoader(ds, batch_sampler=sampler):
            ids = by.numpy() // 3
            np.testing.assert_array_equal(bx.numpy(), x[ids])
            out.extend(ids.tolist())
        return sorted(out) == list(range(N))

    assert all(run_threads(work, 3))
    ds.close()


@pytest.mark.parametrize("fmt", ["npy", "h5", "h5gzip", "zarr"])
def test_dataset_readers_while_other_thread_writes_the_file_table(tmp_path, fmt):
    """A file column written by one thread through its DataGadget while another thread
    gathers batches: each batch row is a whole row of one version."""
    x = np.zeros((N, D), np.float32)
    path = make_file(tmp_path, fmt, x)
    col = open_file(path)
    y = np.arange(N, dtype=np.int64)
    ds = gl.GadgetDataset(col, y, device="cpu")
    stop = threading.Event()

    def work(t):
        if t == 0:
            try:
                for k in range(1, 10):
                    col.insertData(const_rows(N, k), np.arange(N))
            finally:
                stop.set()
            return 0
        n = 0
        while True:
            done = stop.is_set()
            bx, by = ds[np.arange(0, N, 3)]
            a = bx.numpy()
            assert_rows_constant(a)
            assert np.unique(a).size == 1  # one call's rows (the per-file lock)
            n += 1
            if done:
                assert (a == 9).all()
                return n

    run_threads(work, 2)
    col.close()


# ------------------------------------------------------------ OffloadedEmbedding / switchers


V, DM = 60, 4


def _w0(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, DM, generator=g)


def test_offloaded_embedding_eval_lookups_from_threads():
    w0 = _w0(0)
    emb = gl.OffloadedEmbedding(V, DM, placement="cpu", device="cpu", init=lambda t: t.copy_(w0))

    def work(t):
        rng = np.random.default_rng(t)
        with torch.no_grad():  # grad mode is per thread
            for _ in range(20):
                ids = torch.from_numpy(rng.integers(0, V, size=(3, 7)))
                out = emb(ids)
                assert torch.equal(out, torch.nn.functional.embedding(ids, w0))
        return True

    assert all(run_threads(work))


def _train_offloaded(seed: int, steps: int = 8):
    w0 = _w0(seed)
    emb = gl.OffloadedEmbedding(V, DM, placement="cpu", device="cpu", init=lambda t: t.copy_(w0))
    head = torch.nn.Linear(DM, 1)
    with torch.no_grad():
        head.weight.fill_(0.5)
        head.bias.fill_(0.1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        ids = torch.randint(0, V, (12,), generator=gen)  # repeats included
        y = torch.randn(12, generator=gen)
        pred = model["head"](model["emb"](ids)).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return emb.weight.getNumpyVersion(), head.weight.detach().clone()


def test_independent_offloaded_models_trained_in_threads_match_sequential():
    """Two models, each with its own OffloadedEmbedding and OffloadedOptimizer, trained
    at the same time in two threads end bit-identical to training them one by one."""
    seq = [_train_offloaded(s) for s in (3, 4)]
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def work(t):
        barrier.wait()
        return _train_offloaded(3 + t)

    par = run_threads(work, 2)
    for (sw, sh), (pw, ph) in zip(seq, par, strict=False):
        np.testing.assert_array_equal(pw, sw)
        assert torch.equal(ph, sh)


class _SkipGram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.u = torch.nn.Embedding(3, DM)
        self.v = torch.nn.Embedding(3, DM)

    def forward(self, c, p):
        return -torch.nn.functional.logsigmoid((self.u(c) * self.v(p)).sum(-1)).mean()


def _train_switchers(seed: int, factory: str, steps: int = 6):
    model = _SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    w0 = _w0(seed)
    if factory == "speedtorch":
        us = gl.ModelFactory(model.u, V, DM, placement="cpu")
        vs = gl.ModelFactory(model.v, V, DM, placement="cpu")
        uo = gl.OptimizerFactory(opt, V, DM, model, "u", placement="cpu")
        vo = gl.OptimizerFactory(opt, V, DM, model, "v", placement="cpu")
    else:
        us = gl.PytorchModelFactory(model.u, V, DM, deviceType="cpu")
        vs = gl.PytorchModelFactory(model.v, V, DM, deviceType="cpu")
        uo = gl.PytorchOptimizerFactory(opt, V, DM, model, "u", deviceType="cpu")
        vo = gl.PytorchOptimizerFactory(opt, V, DM, model, "v", deviceType="cpu")
    us.customInit(lambda t: t.copy_(w0))
    vs.customInit(lambda t: t.copy_(w0.flip(0)))
    uo.optInit()
    vo.optInit()
    gen = torch.Generator().manual_seed(seed + 7)
    for _ in range(steps):
        c = torch.randint(0, V, (10,), generator=gen)
        p = torch.randint(0, V, (10,), generator=gen)
        lc = us.beforeForwardPass(c)
        uo.beforeForwardPass(c)
        lp = vs.beforeForwardPass(p)
        vo.beforeForwardPass(p)
        loss = model(lc, lp)
        opt.zero_grad()
        loss.backward()
        opt.step()
        us.afterOptimizerStep(c)
        uo.afterOptimizerStep(c)
        vs.afterOptimizerStep(p)
        vo.afterOptimizerStep(p)
    return us.getNumpyVersion(), vs.getNumpyVersion(), uo.getNumpyVersion()


@pytest.mark.parametrize("factory", ["speedtorch", "pytorch"])
def test_independent_switchers_in_threads_match_sequential(factory):
    seq = [_train_switchers(s, factory) for s in (5, 6)]
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def work(t):
        barrier.wait()
        return _train_switchers(5 + t, factory)

    par = run_threads(work, 2)
    for s, p in zip(seq, par, strict=False):
        np.testing.assert_array_equal(p[0], s[0])
        np.testing.assert_array_equal(p[1], s[1])
        assert p[2].keys() == s[2].keys()
        for k in s[2]:
            np.testing.assert_array_equal(p[2][k], s[2][k])


# --------------------------------------------------------------------- fork with busy threads


def _child_read(g, ids, q):
    try:
        q.put(("ok", g.getData(ids).numpy()))
    except BaseException as e:  # noqa: BLE001
        q.put(("err", repr(e)))


@pytest.mark.parametrize("fmt", ["h5", "h5gzip"])
def test_fork_while_another_thread_reads_hdf5_table(tmp_path, fmt):
    """README: "a fork waits up to 5 s for each HDF5 table another thread is using, then
    closes its handles ... the child opens its own handle". A thread reads the table in
    a loop while the main thread forks a child that reads it too."""
    arr = base_array()
    g = open_file(make_file(tmp_path, fmt, arr))
    stop = threading.Event()
    started = threading.Event()
    errors = []

    def reader():
        ids = np.arange(0, N, 2)
        while not stop.is_set():
            try:
                np.testing.assert_array_equal(g.getData(ids).numpy(), arr[ids])
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))
                return
            started.set()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        assert started.wait(TIMEOUT)
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        ids = np.array([1, 17, 50, 95])
        t0 = time.monotonic()
        p = ctx.Process(target=_child_read, args=(g, ids, q))
        p.start()
        kind, val = q.get(timeout=30)
        p.join(30)
        took = time.monotonic() - t0
    finally:
        stop.set()
        th.join(30)
    assert kind == "ok", val
    np.testing.assert_array_equal(val, arr[ids])
    assert p.exitcode == 0
    assert took < 10
    assert errors == []
    # the parent's table still reads right after the fork
    np.testing.assert_array_equal(g.getData(np.arange(N)).numpy(), arr)
    g.close()


# -------------------------------------------------- file replaced / load / save under threads


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_file_replaced_while_threads_read_raises_file_error(tmp_path, fmt):
    """README: once another save replaces the file, the table's reads raise
    GadgetFileError. Reader threads never get the new file's rows."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    started = threading.Event()

    def work(i):
        if i < 2:
            ids = np.arange(i, N, 3)
            return _reader_until_closed(g, ids, arr[ids], started)
        assert started.wait(TIMEOUT)
        fmt_kw = {"dataset": "emb"} if path.endswith(".h5") else {}
        gl.DataGadget(arr + 1000, placement="cpu").save(path, **fmt_kw)
        return None

    res = run_threads(work, 3)
    for _good, exc in res[:2]:
        assert isinstance(exc, gl.GadgetFileError), repr(exc)
        assert "replaced" in str(exc)
    g.close()


@pytest.mark.parametrize("fmt", ["npy", "h5", "h5gzip", "zarr"])
def test_load_other_file_while_threads_read(tmp_path, fmt):
    """load() replaces a file table's rows with another file's ("Replace the table with a
    file's contents, keeping the placement"). While one thread loads two files in turn,
    a reader thread sharing the (open) table gets whole results of one file or the
    other -- not an error saying the table is closed -- and the last file's rows at the
    end."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    new_path = make_file(tmp_path, fmt, arr + 1000, name="new")
    g = open_file(path)
    stop = threading.Event()
    started = threading.Event()
    ids = np.arange(0, N, 4)

    failed = threading.Event()
    last = []

    def work(i):
        if i == 0:
            assert started.wait(TIMEOUT)
            try:
                for k in range(301):  # stops at the first bad read
                    g.load(new_path if k % 2 == 0 else path)
                    last.append("new" if k % 2 == 0 else "old")
                    if failed.is_set():
                        break
            finally:
                stop.set()
            return None
        outs = []
        while True:
            done = stop.is_set()
            try:
                got = g.getData(ids).numpy()
            except gl.GadgetError as e:
                outs.append(f"{type(e).__name__}: {e}")
                failed.set()
                got = None
            if got is not None:
                ok_old = np.array_equal(got, arr[ids])
                ok_new = np.array_equal(got, arr[ids] + 1000)
                outs.append("old" if ok_old else "new" if ok_new else "mixed")
                if outs[-1] == "mixed":
                    failed.set()
            started.set()
            if done:
                return outs

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more chances to interleave
    try:
        res = run_threads(work, 3)
    finally:
        sys.setswitchinterval(old)
    outs = res[1] + res[2]
    bad = [o for o in outs if o not in ("old", "new")]
    assert bad == [], f"{len(bad)} of {len(outs)} reads: {bad[:2]}"
    assert res[1][-1] == res[2][-1] == last[-1]  # the file loaded last
    g.close()


@pytest.mark.parametrize("fmt", CORE_FORMATS)
def test_save_copy_while_other_thread_writes_rows_whole(tmp_path, fmt):
    """save() of a file table (streamed block by block) while another thread writes:
    the copy holds whole rows of one version each, untouched rows exact."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    g = open_file(path)
    ids = np.arange(0, N, 2)
    stop = threading.Event()
    out = str(tmp_path / "copy.npy")

    def work(i):
        if i == 0:
            try:
                for k in range(30):
                    g.insertData(const_rows(len(ids), 500 + k), ids)
            finally:
                stop.set()
            return None
        n = 0
        while not stop.is_set() or n == 0:
            g.save(out)
            c = np.load(out)
            others = np.arange(1, N, 2)
            np.testing.assert_array_equal(c[others], arr[others])
            for i_, row in zip(ids, c[ids], strict=False):
                assert (row == arr[i_]).all() or ((row == row[0]).all() and 500 <= row[0] < 530), (
                    i_,
                    row,
                )
            n += 1
        return n

    assert run_threads(work, 2)[1] >= 1
    g.close()


# ----------------------------------------- one file under several names / several datasets


def _alt_name(tmp_path, path: str, kind: str) -> str:
    import os

    ext = os.path.splitext(path)[1]
    alt = str(tmp_path / f"alt{ext}")
    if kind == "symlink":
        os.symlink(path, alt)
    elif kind == "hardlink":
        os.link(path, alt)
    else:
        alt = os.path.relpath(path)
    return alt


@pytest.mark.parametrize(
    "fmt,kind",
    [(f, "symlink") for f in CORE_FORMATS] + [(f, "relative") for f in ("npy", "h5gzip", "zarr")],
)
def test_tables_of_one_file_under_other_names_write_from_threads(tmp_path, fmt, kind):
    """README: "Several `file` tables of one file in one process may all write, and see
    each other's writes". One table opened by the file's path, one through another name
    of the same file (a symbolic link, a relative path, a hard link), written from two
    threads on interleaved rows (same chunks)."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    alt = _alt_name(tmp_path, path, kind)
    tabs = [open_file(path), open_file(alt)]
    for g in tabs:  # both have read before the threads write
        np.testing.assert_array_equal(g.getData([0, N - 1]).numpy(), arr[[0, N - 1]])
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def work(t):
        ids = _disjoint_plan(t, nt=2)
        barrier.wait()
        for k in range(5):
            tabs[t].insertData(const_rows(len(ids), 100 * (t + 1) + k), ids)

    run_threads(work, 2)
    exp = arr.copy()
    exp[0::2] = 104
    exp[1::2] = 204
    for t, g in enumerate(tabs):
        np.testing.assert_array_equal(g.getNumpyVersion(), exp, err_msg=f"table {t}")
    for g in tabs:
        g.close()
    np.testing.assert_array_equal(read_native(path), exp)


@pytest.mark.parametrize("fmt", ["npy", "h5", "h5contig", "h5gzip"])
def test_tables_of_one_file_via_hard_link_both_write(tmp_path, fmt):
    """The same claim for a hard link (another name of the same file; the README knows
    hard links: "other hard links keep the old data", `convert` refuses its source
    "also through a symbolic or hard link"). No threads needed: one write through each
    table, then each table and the file hold both."""
    arr = base_array()
    path = make_file(tmp_path, fmt, arr)
    alt = _alt_name(tmp_path, path, "hardlink")
    a, b = open_file(path), open_file(alt)
    a.insertData(const_rows(1, 5.0), [0])
    b.insertData(const_rows(1, 6.0), [1])
    exp = arr.copy()
    exp[0], exp[1] = 5.0, 6.0
    np.testing.assert_array_equal(a.getNumpyVersion(), exp)
    np.testing.assert_array_equal(b.getNumpyVersion(), exp)
    a.close()
    b.close()
    np.testing.assert_array_equal(read_native(path), exp)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_two_datasets_of_one_file_written_from_threads(tmp_path, fmt):
    """Tables of two arrays of one HDF5 file / zarr group, written at once."""
    arr = base_array()
    if fmt == "h5":
        path = str(tmp_path / "two.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("a", data=arr, chunks=(CH, D), compression="gzip")
            f.create_dataset("b", data=arr * 2, chunks=(CH, D))
    else:
        path = str(tmp_path / "two.zarr")
        grp = zarr.open_group(path, mode="w")
        grp.create_array("a", data=arr, chunks=(CH, D))
        grp.create_array("b", data=arr * 2, chunks=(CH, D))
    tabs = {n: gl.DataGadget(path, dataset=n, placement="file") for n in ("a", "b")}

    def work(t):
        g = tabs["ab"[t % 2]]
        ids = np.arange(t // 2, N, 2)
        for k in range(6):
            g.insertData(const_rows(len(ids), 100 * t + k), ids)

    run_threads(work)
    for g in tabs.values():
        g.close()
    if fmt == "h5":
        with h5py.File(path, "r") as f:
            a, b = f["a"][...], f["b"][...]
    else:
        grp = zarr.open_group(path, mode="r")
        a, b = grp["a"][...], grp["b"][...]
    assert (a[0::2] == 5).all() and (a[1::2] == 205).all()
    assert (b[0::2] == 105).all() and (b[1::2] == 305).all()


def test_fallback_warning_once_when_threads_build_gpu_tables():
    """Without CUDA, a table asked for `pinned` falls back to `cpu` "with a
    FallbackWarning, given once per process": tables built from several threads at once
    still give it at most once, and hold the right rows."""
    if gl.cuda_available():
        pytest.skip("CPU-only behaviour")
    import warnings

    arr = base_array()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")

        def work(t):
            g = gl.DataGadget(arr + t, placement="pinned")
            return g.placement, np.array_equal(g.getNumpyVersion(), arr + t)

        res = run_threads(work, 6)
    assert all(p == "cpu" and ok for p, ok in res), res
    fb = [w for w in rec if issubclass(w.category, gl.FallbackWarning)]
    assert len(fb) <= 1, [str(w.message) for w in fb]
