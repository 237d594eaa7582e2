"""Session 35 black-box review: threads, DataLoader workers and child processes.

Written from README.md, SPEC.md and the public docstrings only:

1. several threads calling ``getData`` / ``gather`` / indexing / ``insertData`` on one
   ``DataGadget`` (``cpu`` and ``file`` tables backed by .npy, HDF5 and zarr): results equal
   NumPy's, writes to disjoint rows all land, nothing deadlocks (every join has a timeout);
2. ``torch.utils.data.DataLoader(num_workers=2)`` over a ``GadgetDataset`` of file-backed
   columns, default form and ``batch_sampler=GadgetSampler`` form, ``fork`` and ``spawn``,
   ``persistent_workers`` and ``worker_init_fn``: every row exactly once an epoch, values
   equal to NumPy's;
3. ``GadgetLoader(num_workers=2)``: ``state_dict()`` / ``load_state_dict()`` mid-epoch resume
   equal to the uninterrupted run;
4. pickling ``DataGadget`` / ``GadgetDataset`` / ``GadgetSampler`` and using them in a
   ``spawn`` child; in-memory tables: ``cpu`` pickles by value, ``cuda`` / ``pinned`` refuse;
5. ``close()`` while other threads read or write: ``GadgetClosedError``, no crash.

Every table is ``placement='cpu'`` or ``'file'`` with ``device='cpu'``; child processes
hide CUDA (``CUDA_VISIBLE_DEVICES=''``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import multiprocessing as mp
import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

pytestmark = [
    # Python 3.12+ warns when a process with threads forks (torch's and zarr's pools
    # make every fork look like that): not gadgetloader's warning.
    pytest.mark.filterwarnings(r"ignore:.*fork\(\) may lead to deadlocks:DeprecationWarning"),
    pytest.mark.filterwarnings(r"ignore:This process .* is multi-threaded:DeprecationWarning"),
]

N = 300  # rows
D = 6  # row width
B = 32  # batch size
JOIN_S = 60.0  # no thread, worker or child may take longer than this
KINDS = ["cpu", "npy", "h5", "zarr"]
FILE_EXTS = ["npy", "h5", "zarr"]


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _need(kind: str) -> None:
    if kind == "h5":
        pytest.importorskip("h5py")
    elif kind == "zarr":
        pytest.importorskip("zarr")


def _ref(seed: int, n: int = N, d: int = D) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def _save(tmp_path, arr: np.ndarray, ext: str, name: str):
    """Write ``arr`` as a .npy / HDF5 / zarr file (HDF5 and zarr in chunks of 16 rows)."""
    _need(ext)
    path = tmp_path / f"{name}.{ext}"
    opts = {} if ext == "npy" else {"chunk_rows": 16}
    with gl.DataGadget(arr, placement="cpu", device="cpu") as src:
        src.save(str(path), **opts)
    return path


def _table(tmp_path, arr: np.ndarray, kind: str, name: str = "t") -> gl.DataGadget:
    if kind == "cpu":
        return gl.DataGadget(arr, placement="cpu", device="cpu")
    path = _save(tmp_path, arr, kind, name)
    return gl.DataGadget(str(path), placement="file", device="cpu")


def _reopen(g: gl.DataGadget) -> np.ndarray:
    """The rows a fresh table of ``g``'s file reads (``g`` is closed first)."""
    path = str(g.store.path)
    g.close()
    with gl.DataGadget(path, placement="file", device="cpu") as fresh:
        return fresh.getNumpyVersion()


def _run_threads(fns, timeout: float = JOIN_S) -> None:
    """Run every callable in its own thread; fail on a hang (deadlock) or on any error."""
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = sum(t.is_alive() for t in threads)
    assert alive == 0, f"{alive} thread(s) still running after {timeout} s (deadlock?)"
    if errors:
        raise errors[0]


def _file_dataset(tmp_path, ext: str, ref: np.ndarray, ids_ext: str | None = None):
    """A two-column dataset of file-backed columns: the rows and their own ids."""
    fp = _save(tmp_path, ref, ext, "feat")
    ip = _save(tmp_path, np.arange(len(ref), dtype=np.int64), ids_ext or ext, "ids")
    return gl.GadgetDataset(str(fp), str(ip), placement="file", device="cpu")


def _take(batches):
    """Features and ids of a pass over (features, ids) batches, as NumPy arrays (copied)."""
    xs, ys, sizes = [], [], []
    for b in batches:
        x, y = b[0], b[1]
        assert x.device.type == "cpu" and y.device.type == "cpu"
        xs.append(np.array(x.numpy(), copy=True))
        ys.append(np.array(y.numpy(), copy=True))
        sizes.append(len(y))
    if not xs:
        return np.zeros((0, D), np.float32), np.zeros(0, np.int64), []
    return np.concatenate(xs), np.concatenate(ys), sizes


def _check_epoch(x: np.ndarray, ids: np.ndarray, ref: np.ndarray) -> None:
    """Every row exactly once, each with its own values."""
    assert np.array_equal(np.sort(ids), np.arange(len(ref))), "rows missing or repeated"
    np.testing.assert_array_equal(x, ref[ids])


def _record_worker(outdir: str, worker_id: int) -> None:
    """worker_init_fn: note the worker and, for a GadgetDataset, what its first column
    reads in that worker."""
    info = torch.utils.data.get_worker_info()
    stem = os.path.join(outdir, f"w{worker_id}-{os.getpid()}")
    ds = info.dataset if info is not None else None
    if isinstance(ds, gl.GadgetDataset):
        col = ds.columns[0]
        rows = col.getData([0, len(col) - 1])
        np.save(stem + ".npy", rows.numpy())
        text = f"{col.placement} {rows.device.type}"
    else:
        text = "other"
    with open(stem + ".txt", "w") as f:
        f.write(text)


def _records(outdir) -> list[str]:
    return sorted(p for p in os.listdir(outdir) if p.endswith(".txt"))


@pytest.fixture
def closer():
    """Close what a test opened, whatever happens to it."""
    objs: list = []

    def keep(obj):
        objs.append(obj)
        return obj

    yield keep
    for obj in reversed(objs):
        with contextlib.suppress(Exception):
            obj.close()


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    _need(request.param)
    return request.param


@pytest.fixture(params=FILE_EXTS)
def fext(request) -> str:
    _need(request.param)
    return request.param


# ---------------------------------------------------------------------------------------
# 1. threads sharing one table
# ---------------------------------------------------------------------------------------


def test_threads_read_one_table_at_once_match_numpy(tmp_path, kind, closer):
    """README: threads may read in-memory tables, and share a file table (each call holds
    the file's lock); ids of any shape give ``ids.shape + row_shape``. Six threads, two
    each through ``getData``, ``gather`` and indexing."""
    ref = _ref(1)
    g = closer(_table(tmp_path, ref, kind))
    barrier = threading.Barrier(6, timeout=JOIN_S)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        method = ("getData", "gather", "getitem")[seed % 3]
        barrier.wait()
        for _ in range(15):
            ids = rng.integers(0, N, size=(3, 11))
            if method == "getData":
                out = g.getData(ids)
            elif method == "gather":
                out = g.gather(torch.from_numpy(ids))
            else:
                out = g[torch.from_numpy(ids)]
            assert tuple(out.shape) == (3, 11, D)
            np.testing.assert_array_equal(out.numpy(), ref[ids])

    _run_threads([functools.partial(reader, s) for s in range(6)])
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_threads_write_disjoint_rows_all_land(tmp_path, kind, closer):
    """README: threads may write different rows of an in-memory table; file tables take a
    lock per call. Rows are interleaved between threads, so neighbours in one chunk belong
    to different threads; the threads write through ``insertData``, ``scatter`` and
    ``g[ids] = rows``. Every write must land (in the table and in the file)."""
    ref = _ref(2)
    g = closer(_table(tmp_path, ref, kind))
    expected = ref.copy()
    nthreads = 6
    barrier = threading.Barrier(nthreads, timeout=JOIN_S)

    def writer(t: int) -> None:
        rng = np.random.default_rng(100 + t)
        how = ("insertData", "scatter", "setitem")[t % 3]
        mine = np.arange(t, N, nthreads)
        barrier.wait()
        for _ in range(6):
            ids = rng.permutation(mine)[:15]
            rows = rng.standard_normal((15, D)).astype(np.float32)
            if how == "insertData":
                g.insertData(torch.from_numpy(rows), ids)
            elif how == "scatter":
                g.scatter(torch.from_numpy(ids), torch.from_numpy(rows))
            else:
                g[torch.from_numpy(ids)] = torch.from_numpy(rows)
            expected[ids] = rows

    _run_threads([functools.partial(writer, t) for t in range(nthreads)])
    np.testing.assert_array_equal(g.getNumpyVersion(), expected)
    if kind != "cpu":
        np.testing.assert_array_equal(_reopen(g), expected)


def test_threads_read_and_write_disjoint_rows_at_once(tmp_path, kind, closer):
    """Readers of rows [N/2, N) see the reference the whole time while writers rewrite rows
    [0, N/2); afterwards the writes are all there."""
    ref = _ref(3)
    g = closer(_table(tmp_path, ref, kind))
    half = N // 2
    final = ref.copy()
    done = threading.Event()
    barrier = threading.Barrier(4, timeout=JOIN_S)

    def writer(t: int) -> None:
        mine = np.arange(t, half, 2)
        barrier.wait()
        try:
            for r in range(8):
                rows = np.full((len(mine), D), 10.0 * t + r, np.float32)
                g.insertData(torch.from_numpy(rows), mine)
                final[mine] = rows
        finally:
            done.set()

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        barrier.wait()
        reads = 0
        while not done.is_set() or reads < 5:
            ids = rng.integers(half, N, size=17)
            np.testing.assert_array_equal(g.getData(ids).numpy(), ref[ids])
            reads += 1

    _run_threads(
        [functools.partial(writer, 0), functools.partial(writer, 1)]
        + [functools.partial(reader, s) for s in (7, 8)]
    )
    np.testing.assert_array_equal(g.getNumpyVersion(), final)


def test_threads_file_reads_of_rows_being_written_see_whole_writes(tmp_path, fext, closer):
    """README: threads sharing a file table hold the file's lock for each call, so a read
    of rows that another thread rewrites (one insertData of the whole block, across a
    chunk boundary) sees the block before or after that write, never a mix."""
    ref = _ref(4)
    g = closer(_table(tmp_path, ref, fext))
    ids = np.arange(40, 72)  # spans chunks of 16 rows
    blocks = [np.full((len(ids), D), v, np.float32) for v in (1.0, 2.0)]
    g.insertData(torch.from_numpy(blocks[0]), ids)
    stop = threading.Event()

    def writer() -> None:
        try:
            for i in range(40):
                g.insertData(torch.from_numpy(blocks[(i + 1) % 2]), ids)
        finally:
            stop.set()

    def reader() -> None:
        while not stop.is_set():
            out = g.getData(ids).numpy()
            v = float(out[0, 0])
            assert v in (1.0, 2.0), v
            np.testing.assert_array_equal(out, np.full_like(out, v), err_msg="torn read")
            np.testing.assert_array_equal(g.getData([0, 200]).numpy(), ref[[0, 200]])

    _run_threads([writer, reader, reader])
    np.testing.assert_array_equal(g.getData(ids).numpy(), blocks[0])


def test_threads_partial_writes_of_the_same_rows_on_a_file_table(tmp_path, fext, closer):
    """README: a write of part of rows, ``g.insertData(v, (ids, slice(0, 4)))``, reads and
    writes the rows back under the file's lock. Three threads write three different column
    pairs of the same rows over and over: each pair must hold its thread's last value."""
    ref = _ref(5)
    g = closer(_table(tmp_path, ref, fext))
    ids = np.arange(10, 60)
    barrier = threading.Barrier(3, timeout=JOIN_S)

    def writer(t: int) -> None:
        barrier.wait()
        for r in range(10):
            v = np.full((len(ids), 2), 100.0 * t + r, np.float32)
            g.insertData(torch.from_numpy(v), (torch.from_numpy(ids), slice(2 * t, 2 * t + 2)))

    _run_threads([functools.partial(writer, t) for t in range(3)])
    expected = ref.copy()
    for t in range(3):
        expected[ids, 2 * t : 2 * t + 2] = 100.0 * t + 9
    np.testing.assert_array_equal(g.getNumpyVersion(), expected)
    np.testing.assert_array_equal(_reopen(g), expected)


@pytest.mark.parametrize("pkind", ["cpu", "zarr"])
def test_threads_partial_writes_of_disjoint_rows(tmp_path, pkind, closer):
    """Partial-row writes (rows, then a slice into each row) to disjoint rows from several
    threads: every part lands and the rest of each row is unchanged."""
    _need(pkind)
    ref = _ref(6)
    g = closer(_table(tmp_path, ref, pkind))
    barrier = threading.Barrier(3, timeout=JOIN_S)

    def writer(t: int) -> None:
        mine = torch.arange(t, N, 3)
        barrier.wait()
        for r in range(5):
            v = torch.full((len(mine), 3), float(t * 10 + r))
            g.insertData(v, (mine, slice(1, 4)))

    _run_threads([functools.partial(writer, t) for t in range(3)])
    expected = ref.copy()
    for t in range(3):
        expected[t::3, 1:4] = t * 10 + 4
    np.testing.assert_array_equal(g.getNumpyVersion(), expected)


def test_threads_gather_many_and_scatter_many_disjoint_rows(tmp_path, kind, closer):
    """``gl.scatter_many`` / ``gl.gather_many`` over a table and a second table with the
    same rows, from threads owning disjoint rows: every write lands in both tables and
    every gather equals NumPy's."""
    a_ref, b_ref = _ref(7), _ref(8)
    a = closer(_table(tmp_path, a_ref, kind, "a"))
    b = closer(_table(tmp_path, b_ref, kind, "b"))
    ea, eb = a_ref.copy(), b_ref.copy()
    barrier = threading.Barrier(3, timeout=JOIN_S)

    def worker(t: int) -> None:
        rng = np.random.default_rng(300 + t)
        mine = np.arange(t, N, 3)
        barrier.wait()
        for r in range(5):
            ids = rng.permutation(mine)[:16]
            ra = np.full((16, D), t + r / 10, np.float32)
            rb = -ra
            gl.scatter_many([a, b], [torch.from_numpy(ra), torch.from_numpy(rb)], ids)
            ea[ids], eb[ids] = ra, rb
            got_a, got_b = gl.gather_many([a, b], ids)
            np.testing.assert_array_equal(got_a.numpy(), ra)
            np.testing.assert_array_equal(got_b.numpy(), rb)

    _run_threads([functools.partial(worker, t) for t in range(3)])
    np.testing.assert_array_equal(a.getNumpyVersion(), ea)
    np.testing.assert_array_equal(b.getNumpyVersion(), eb)


def test_threads_gather_from_one_dataset(tmp_path, kind, closer):
    """``GadgetDataset.gather`` and ``ds[ids]`` from several threads at once on a dataset of
    a (shared) table and a label column: every batch equals NumPy's rows."""
    ref = _ref(9)
    labels = np.arange(N, dtype=np.int64) * 3
    g = closer(_table(tmp_path, ref, kind))
    lab = closer(gl.DataGadget(labels, placement="cpu", device="cpu"))
    ds = closer(gl.GadgetDataset(g, lab, device="cpu"))
    barrier = threading.Barrier(4, timeout=JOIN_S)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        barrier.wait()
        for i in range(20):
            ids = rng.integers(0, N, size=25)
            x, y = ds.gather(ids) if i % 2 else ds[torch.from_numpy(ids)]
            np.testing.assert_array_equal(x.numpy(), ref[ids])
            np.testing.assert_array_equal(y.numpy(), labels[ids])

    _run_threads([functools.partial(reader, s) for s in range(4)])


def test_threads_two_tables_of_one_file_write_and_read_each_other(tmp_path, fext, closer):
    """README: several file tables of one file in one process may all write and see each
    other's writes (one lock for the file under any name). Two threads, one table each,
    write interleaved rows; both tables then read every write."""
    ref = _ref(10)
    path = _save(tmp_path, ref, fext, "shared")
    t1 = closer(gl.DataGadget(str(path), placement="file", device="cpu"))
    t2 = closer(gl.DataGadget(str(path), placement="file", device="cpu"))
    # warm both tables' caches with the old rows first
    np.testing.assert_array_equal(t1.getNumpyVersion(), ref)
    np.testing.assert_array_equal(t2.getNumpyVersion(), ref)
    expected = ref.copy()
    barrier = threading.Barrier(2, timeout=JOIN_S)

    def writer(table: gl.DataGadget, t: int) -> None:
        mine = np.arange(t, N, 2)
        barrier.wait()
        for r in range(4):
            sel = mine[r::4]
            rows = np.full((len(sel), D), 1000.0 * (t + 1) + r, np.float32)
            table.insertData(torch.from_numpy(rows), sel)
            expected[sel] = rows

    _run_threads([functools.partial(writer, t1, 0), functools.partial(writer, t2, 1)])
    np.testing.assert_array_equal(t1.getNumpyVersion(), expected)
    np.testing.assert_array_equal(t2.getNumpyVersion(), expected)


def test_threads_each_with_own_loader_over_one_dataset(tmp_path, closer):
    """Two threads, each with its own DataLoader + GadgetSampler (read-ahead on) over the
    same dataset: README says batches not read in order (another loader interleaved on the
    same dataset) are gathered one by one; each thread's epoch has every row once."""
    ref = _ref(11)
    g = closer(_table(tmp_path, ref, "npy"))
    ids_col = closer(gl.DataGadget(np.arange(N, dtype=np.int64), placement="cpu", device="cpu"))
    ds = closer(gl.GadgetDataset(g, ids_col, device="cpu"))
    results: dict[int, tuple] = {}
    barrier = threading.Barrier(2, timeout=JOIN_S)

    def run(t: int) -> None:
        sampler = gl.GadgetSampler(ds, batch_size=B, seed=t, coalesce=4)
        dl = DataLoader(ds, batch_sampler=sampler)
        barrier.wait()
        epochs = []
        for _ in range(2):
            x, y, _sizes = _take(dl)
            epochs.append((x, y, sampler))
        results[t] = epochs

    _run_threads([functools.partial(run, t) for t in range(2)])
    for t in range(2):
        for e, (x, y, sampler) in enumerate(results[t]):
            _check_epoch(x, y, ref)
            assert np.array_equal(y, sampler.epoch_order(e).numpy())


@pytest.mark.parametrize("ext, compression", [("h5", "gzip"), ("zarr", "zstd")])
def test_threads_compressed_file_with_a_tiny_cache(tmp_path, ext, compression):
    """A compressed file table whose block cache holds about one chunk (``cache_bytes=``),
    shared by two writers of disjoint rows and two readers of other rows: every read right,
    every write in the table and in the file."""
    _need(ext)
    ref = _ref(15, n=400)
    path = tmp_path / f"c.{ext}"
    with gl.DataGadget(ref, placement="cpu", device="cpu") as src:
        src.save(str(path), chunk_rows=16, compression=compression)
    g = gl.DataGadget(str(path), placement="file", device="cpu", cache_bytes=16 * D * 4 + 64)
    expected = ref.copy()

    def writer(t: int) -> None:
        rng = np.random.default_rng(400 + t)
        mine = np.arange(t, 400, 4)  # rows 0, 1 mod 4
        for _ in range(12):
            ids = rng.permutation(mine)[:10]
            rows = rng.standard_normal((10, D)).astype(np.float32)
            g.insertData(torch.from_numpy(rows), ids)
            expected[ids] = rows
            np.testing.assert_array_equal(g.getData(ids).numpy(), rows)

    def reader(t: int) -> None:
        rng = np.random.default_rng(500 + t)
        for _ in range(40):
            ids = rng.integers(0, 100, 12) * 4 + 2 + t  # rows 2, 3 mod 4: never written
            np.testing.assert_array_equal(g.getData(ids).numpy(), ref[ids])

    try:
        _run_threads([functools.partial(f, t) for f in (writer, reader) for t in (0, 1)])
        np.testing.assert_array_equal(g.getNumpyVersion(), expected)
    finally:
        got = _reopen(g)
    np.testing.assert_array_equal(got, expected)


def test_threads_calls_overtaken_by_a_load_read_one_whole_file(tmp_path, fext, closer):
    """README: a call that another thread's ``load()`` overtakes is made on the loaded file.
    Readers of a file table that a third thread reloads with one file, then another, each
    get the rows of one file, whole."""
    old, new = _ref(12), _ref(13)
    g = closer(_table(tmp_path, old, fext))
    p_old = str(g.store.path)
    p_new = str(_save(tmp_path, new, fext, "new"))
    stop = threading.Event()

    def loader() -> None:
        try:
            for i in range(6):
                g.load(p_new if i % 2 == 0 else p_old)
        finally:
            stop.set()

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            ids = rng.integers(0, N, size=40)
            out = g.getData(ids).numpy()
            if not np.array_equal(out, old[ids]):
                np.testing.assert_array_equal(out, new[ids], err_msg="rows of neither file")

    _run_threads([loader, functools.partial(reader, 1), functools.partial(reader, 2)])
    np.testing.assert_array_equal(g.getNumpyVersion(), old)


def test_threads_save_and_read_whole_of_a_file_table_during_writes(tmp_path, fext, closer):
    """README: each call on a shared file table holds the file's lock, so a ``save()`` or a
    ``getNumpyVersion()`` made while another thread rewrites a block of rows (one call per
    rewrite, every row of it set to the call's number) holds each block from one call."""
    ref = _ref(14)
    g = closer(_table(tmp_path, ref, fext))
    ids = np.arange(8, 56)  # three chunks of 16 rows
    stop = threading.Event()
    snaps: list[np.ndarray] = []

    def writer() -> None:
        try:
            for v in range(1, 31):
                g.insertData(torch.full((len(ids), D), float(v)), ids)
        finally:
            stop.set()

    def snapshotter() -> None:
        k = 0
        while not stop.is_set() or k == 0:
            if k % 2 == 0:
                snaps.append(g.getNumpyVersion())
            else:
                target = tmp_path / f"snap{k}.npy"
                g.save(str(target))
                snaps.append(np.load(target))
            k += 1

    _run_threads([writer, snapshotter])
    assert snaps
    others = np.setdiff1d(np.arange(N), ids)
    for snap in snaps:
        np.testing.assert_array_equal(snap[others], ref[others])
        block = snap[ids]
        if not np.array_equal(block, ref[ids]):
            np.testing.assert_array_equal(block, np.full_like(block, block[0, 0]), err_msg="torn")
    np.testing.assert_array_equal(g.getData(ids).numpy(), np.full((len(ids), D), 30.0))


# ---------------------------------------------------------------------------------------
# 2. DataLoader worker processes
# ---------------------------------------------------------------------------------------


def test_fork_workers_default_form_every_row_once(tmp_path, fext, closer):
    """README: the default form ``DataLoader(GadgetDataset(...), batch_size=, shuffle=)``;
    each worker reopens a file table itself and batches from workers come as CPU tensors."""
    ref = _ref(20)
    ds = closer(_file_dataset(tmp_path, fext, ref))
    dl = DataLoader(
        ds,
        batch_size=B,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=JOIN_S,
    )
    x, ids, sizes = _take(dl)
    _check_epoch(x, ids, ref)
    assert sizes == [B] * (N // B) + [N % B]


def test_fork_workers_batch_sampler_form_follows_the_sampler(tmp_path, fext, closer):
    """``DataLoader(ds, batch_sampler=GadgetSampler(...), num_workers=2)``: every row once,
    in the sampler's epoch order (workers' batches arrive in order; README: batches read in
    worker processes are gathered one by one, whatever ``coalesce``)."""
    ref = _ref(21)
    ds = closer(_file_dataset(tmp_path, fext, ref))
    sampler = gl.GadgetSampler(ds, batch_size=B, order="random", seed=4, coalesce=4)
    dl = DataLoader(
        ds, batch_sampler=sampler, num_workers=2, multiprocessing_context="fork", timeout=JOIN_S
    )
    x, ids, sizes = _take(dl)
    _check_epoch(x, ids, ref)
    assert np.array_equal(ids, sampler.epoch_order(0).numpy())
    assert len(sizes) == len(sampler)


def test_fork_workers_sampler_with_batch_size_none(tmp_path, closer):
    """README: ``DataLoader(ds, sampler=sampler, batch_size=None)`` is the other spelling of
    the sampler form."""
    ref = _ref(22)
    ds = closer(_file_dataset(tmp_path, "npy", ref))
    sampler = gl.GadgetSampler(ds, batch_size=B, seed=2)
    dl = DataLoader(
        ds,
        sampler=sampler,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=JOIN_S,
    )
    x, ids, _ = _take(dl)
    _check_epoch(x, ids, ref)
    assert np.array_equal(ids, sampler.epoch_order(0).numpy())


def test_fork_workers_chunk_order(tmp_path, closer):
    """``order='chunk'`` over chunked file columns, gathered in two workers: every row once."""
    _need("zarr")
    ref = _ref(23)
    ds = closer(_file_dataset(tmp_path, "zarr", ref))
    sampler = gl.GadgetSampler(ds, batch_size=B, order="chunk", seed=9)
    dl = DataLoader(
        ds, batch_sampler=sampler, num_workers=2, multiprocessing_context="fork", timeout=JOIN_S
    )
    x, ids, _ = _take(dl)
    _check_epoch(x, ids, ref)
    assert np.array_equal(ids, sampler.epoch_order(0).numpy())


def test_fork_persistent_workers_two_epochs(tmp_path, fext, closer):
    """``persistent_workers=True`` over two epochs: each epoch has every row once, in that
    epoch's sampler order (the epochs advance by themselves, shuffled differently)."""
    ref = _ref(24)
    ds = closer(_file_dataset(tmp_path, fext, ref))
    sampler = gl.GadgetSampler(ds, batch_size=B, seed=6)
    dl = DataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
        timeout=JOIN_S,
    )
    orders = []
    for e in range(2):
        x, ids, _ = _take(dl)
        _check_epoch(x, ids, ref)
        assert np.array_equal(ids, sampler.epoch_order(e).numpy())
        orders.append(ids)
    assert not np.array_equal(orders[0], orders[1])
    del dl


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_fork_worker_init_fn_sees_reopened_file_tables(tmp_path, ext, closer):
    """A ``worker_init_fn`` runs once in each of the two workers, and there the dataset's
    file column (reopened by the worker) reads its rows on the CPU."""
    _need(ext)
    ref = _ref(25)
    ds = closer(_file_dataset(tmp_path, ext, ref))
    outdir = tmp_path / "workers"
    outdir.mkdir()
    dl = DataLoader(
        ds,
        batch_size=B,
        shuffle=True,
        num_workers=2,
        worker_init_fn=functools.partial(_record_worker, str(outdir)),
        multiprocessing_context="fork",
        timeout=JOIN_S,
    )
    x, ids, _ = _take(dl)
    _check_epoch(x, ids, ref)
    recs = _records(outdir)
    assert [r.split("-")[0] for r in recs] == ["w0", "w1"]
    for r in recs:
        assert (outdir / r).read_text() == "file cpu"
        rows = np.load(outdir / r.replace(".txt", ".npy"))
        np.testing.assert_array_equal(rows, ref[[0, N - 1]])


def test_fork_workers_read_rows_the_main_process_wrote_between_epochs(tmp_path, fext, closer):
    """README: each write reaches the file before it returns, so workers started later read
    it (non-persistent workers start again every epoch)."""
    ref = _ref(26)
    ds = closer(_file_dataset(tmp_path, fext, ref))
    sampler = gl.GadgetSampler(ds, batch_size=B, seed=1)
    dl = DataLoader(
        ds, batch_sampler=sampler, num_workers=2, multiprocessing_context="fork", timeout=JOIN_S
    )
    x, ids, _ = _take(dl)
    _check_epoch(x, ids, ref)
    new = ref.copy()
    changed = np.array([0, 15, 16, 17, 150, N - 1])
    new[changed] = np.arange(len(changed) * D, dtype=np.float32).reshape(-1, D) + 500
    ds.columns[0].insertData(torch.from_numpy(new[changed]), changed)
    x, ids, _ = _take(dl)
    _check_epoch(x, ids, new)


def test_fork_workers_cpu_and_file_columns_together(tmp_path, closer):
    """A dataset of a file column and ``cpu`` columns (fork workers inherit the ``cpu``
    rows): both right in every worker batch; rows the main process writes between epochs
    reach the next epoch's (non-persistent) workers, in both kinds of column."""
    ref = _ref(27)
    fp = _save(tmp_path, ref, "npy", "feat")
    labels = (np.arange(N, dtype=np.int64) * 7) % 101
    col = closer(gl.DataGadget(str(fp), placement="file", device="cpu"))
    lab = closer(gl.DataGadget(labels, placement="cpu", device="cpu"))
    ids_col = closer(gl.DataGadget(np.arange(N, dtype=np.int64), placement="cpu", device="cpu"))
    ds = closer(gl.GadgetDataset(col, ids_col, lab, device="cpu"))
    dl = DataLoader(
        ds,
        batch_size=B,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=JOIN_S,
    )
    for epoch in range(2):
        seen = []
        for x, ids, y in dl:
            np.testing.assert_array_equal(x.numpy(), ref[ids.numpy()])
            np.testing.assert_array_equal(y.numpy(), labels[ids.numpy()])
            seen.append(ids.numpy().copy())
        assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(N))
        if epoch == 0:
            changed = np.array([3, 4, 200])
            ref = ref.copy()
            ref[changed] = -1.0
            labels = labels.copy()
            labels[changed] = 1000
            col.insertData(torch.from_numpy(ref[changed]), changed)
            lab.insertData(torch.from_numpy(labels[changed]), changed)


def test_spawn_workers_default_form_npy_hdf5_and_cpu_columns(tmp_path, closer):
    """``spawn`` workers (a fresh interpreter each): file columns travel as file names and
    are reopened there, a ``cpu`` column travels by value (README: through torch's shared
    memory); a dataset of a .npy column, an HDF5 column and a ``cpu`` column."""
    _need("h5")
    ref = _ref(28)
    fp = _save(tmp_path, ref, "npy", "feat")
    ip = _save(tmp_path, np.arange(N, dtype=np.int64), "h5", "ids")
    labels = np.arange(N, dtype=np.float64) / 4
    cols = [
        closer(gl.DataGadget(str(fp), placement="file", device="cpu")),
        closer(gl.DataGadget(str(ip), placement="file", device="cpu")),
        closer(gl.DataGadget(labels, placement="cpu", device="cpu")),
    ]
    ds = closer(gl.GadgetDataset(*cols, device="cpu"))
    dl = DataLoader(
        ds,
        batch_size=B,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="spawn",
        timeout=JOIN_S,
    )
    xs, ids, ys = [], [], []
    for x, i, y in dl:
        xs.append(x.numpy().copy())
        ids.append(i.numpy().copy())
        ys.append(y.numpy().copy())
    assert len(ids) == -(-N // B)
    x, i, y = np.concatenate(xs), np.concatenate(ids), np.concatenate(ys)
    _check_epoch(x, i, ref)
    np.testing.assert_array_equal(y, labels[i])


def test_spawn_persistent_workers_sampler_form_with_worker_init_fn(tmp_path, closer):
    """``spawn`` + ``persistent_workers=True`` + ``worker_init_fn`` over zarr columns, two
    epochs: each has every row once in the sampler's order, and each of the two workers
    ran ``worker_init_fn`` once, reading its reopened file table on the CPU."""
    _need("zarr")
    ref = _ref(29)
    ds = closer(_file_dataset(tmp_path, "zarr", ref))
    outdir = tmp_path / "workers"
    outdir.mkdir()
    sampler = gl.GadgetSampler(ds, batch_size=B, seed=12)
    dl = DataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=functools.partial(_record_worker, str(outdir)),
        multiprocessing_context="spawn",
        timeout=JOIN_S,
    )
    for e in range(2):
        x, ids, _ = _take(dl)
        _check_epoch(x, ids, ref)
        assert np.array_equal(ids, sampler.epoch_order(e).numpy())
    del dl
    recs = _records(outdir)
    assert [r.split("-")[0] for r in recs] == ["w0", "w1"]
    for r in recs:
        assert (outdir / r).read_text() == "file cpu"
        np.testing.assert_array_equal(np.load(outdir / r.replace(".txt", ".npy")), ref[[0, N - 1]])


def test_fork_workers_while_another_thread_reads_the_hdf5_table(tmp_path, closer):
    """README: HDF5 handles do not cross a fork: a fork waits for each HDF5 table another
    thread is using, then closes its handles, and the child opens its own. A thread reads
    the table the whole time the DataLoader forks its workers: both get the right rows."""
    _need("h5")
    ref = _ref(38)
    ds = closer(_file_dataset(tmp_path, "h5", ref))
    table = ds.columns[0]
    stop = threading.Event()

    def reader() -> None:
        rng = np.random.default_rng(0)
        while not stop.is_set():
            ids = rng.integers(0, N, size=30)
            np.testing.assert_array_equal(table.getData(ids).numpy(), ref[ids])

    def epochs() -> None:
        try:
            for _ in range(2):
                dl = DataLoader(
                    ds,
                    batch_size=B,
                    shuffle=True,
                    num_workers=2,
                    multiprocessing_context="fork",
                    timeout=JOIN_S,
                )
                x, ids, _ = _take(dl)
                _check_epoch(x, ids, ref)
        finally:
            stop.set()

    _run_threads([reader, epochs])


# ---------------------------------------------------------------------------------------
# 3. GadgetLoader with workers: resume
# ---------------------------------------------------------------------------------------


def _loader(ds, workers: int, seed: int = 5, **kw) -> gl.GadgetLoader:
    if workers:
        kw.setdefault("multiprocessing_context", "fork")
        kw.setdefault("timeout", JOIN_S)
    return gl.GadgetLoader(ds, batch_size=B, num_workers=workers, seed=seed, **kw)


def _batches(it, k: int | None = None) -> list[np.ndarray]:
    """The ids column of the next ``k`` batches (all when ``k`` is None), copied."""
    out = []
    for b in it:
        out.append(np.array(b[1].numpy(), copy=True))
        if k is not None and len(out) == k:
            break
    return out


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_gadget_loader_workers_give_the_batches_of_no_workers(tmp_path, fext, closer):
    """``GadgetLoader(num_workers=2)``: the order comes from ``seed=`` alone, so the batches
    are those of ``num_workers=0``; every row once with its values, two epochs. Then, with
    workers drawing ahead: a pass left after 3 batches is restarted by the next ``iter()``
    (the loader counts the batches it handed out), and ``set_epoch`` picks an epoch."""
    ref = _ref(30)
    ds = closer(_file_dataset(tmp_path, fext, ref))
    plain = _loader(ds, 0)
    workers = _loader(ds, 2)
    epochs = []
    for _ in range(3):
        epochs.append(_batches(plain))
    for e in range(2):
        x, ids, _ = _take(workers)
        _check_epoch(x, ids, ref)
        got = np.split(ids, np.cumsum([len(b) for b in epochs[e]])[:-1])
        assert _same(got, epochs[e])
    again = _loader(ds, 2)
    assert _same(_batches(again, 3), epochs[0][:3])
    assert _same(_batches(again), epochs[0])
    assert _same(_batches(again), epochs[1])
    again.set_epoch(2)
    assert _same(_batches(again), epochs[2])


def test_gadget_loader_workers_resume_mid_epoch(tmp_path, fext, closer):
    """``state_dict()`` after 3 batches of a loader with workers (which prefetch ahead: the
    state counts batches handed out), loaded into a fresh loader built with another seed:
    the rest of the epoch and the next epoch equal the uninterrupted run's."""
    ref = _ref(31)
    ds = closer(_file_dataset(tmp_path, fext, ref))
    full = _loader(ds, 2)
    epoch0, epoch1 = _batches(full), _batches(full)
    run = _loader(ds, 2)
    it = iter(run)
    head = _batches(it, 3)
    state = run.state_dict()
    tail = _batches(it)  # the same run goes on uninterrupted
    del it
    assert _same(head + tail, epoch0)
    resumed = _loader(ds, 2, seed=999)
    resumed.load_state_dict(state)
    rest = []
    for b in resumed:
        rest.append(np.array(b[1].numpy(), copy=True))
        np.testing.assert_array_equal(b[0].numpy(), ref[b[1].numpy()])
    assert _same(rest, tail)
    assert _same(_batches(resumed), epoch1)


def test_gadget_loader_persistent_workers_resume_mid_epoch(tmp_path, closer):
    """The same resume with ``persistent_workers=True`` (HDF5 columns)."""
    _need("h5")
    ref = _ref(32)
    ds = closer(_file_dataset(tmp_path, "h5", ref))
    epoch0 = _batches(_loader(ds, 0))
    run = _loader(ds, 2, persistent_workers=True)
    it = iter(run)
    head = _batches(it, 5)
    state = run.state_dict()
    del it
    resumed = _loader(ds, 2, seed=1, persistent_workers=True)
    resumed.load_state_dict(state)
    assert _same(head + _batches(resumed), epoch0)


@pytest.mark.parametrize("saved, loaded", [(2, 0), (0, 2)])
def test_gadget_loader_state_moves_between_worker_counts(tmp_path, saved, loaded, closer):
    """A state is a count of batches handed out: saved by a loader with workers it resumes
    one without, and the other way round."""
    ref = _ref(33)
    ds = closer(_file_dataset(tmp_path, "npy", ref))
    epoch0 = _batches(_loader(ds, 0))
    run = _loader(ds, saved)
    it = iter(run)
    head = _batches(it, 4)
    state = run.state_dict()
    del it
    resumed = _loader(ds, loaded, seed=77)
    resumed.load_state_dict(state)
    assert _same(head + _batches(resumed), epoch0)


def test_gadget_loader_workers_state_saved_after_the_last_batch(tmp_path, closer):
    """README: a state saved after an epoch's last batch, inside the loop, resumes with one
    empty pass, then the next epoch."""
    ref = _ref(34)
    ds = closer(_file_dataset(tmp_path, "npy", ref))
    full = _loader(ds, 0)
    _batches(full)
    epoch1 = _batches(full)
    run = _loader(ds, 2)
    n = len(run)
    state = None
    for i, _b in enumerate(run):
        if i == n - 1:
            state = run.state_dict()
    resumed = _loader(ds, 2, seed=3)
    resumed.load_state_dict(state)
    assert _batches(resumed) == []
    assert _same(_batches(resumed), epoch1)


def test_gadget_loader_passes_worker_init_fn_and_context_to_dataloader(tmp_path, closer):
    """GadgetLoader docstring: ``**dataloader_kwargs`` go to DataLoader: a ``worker_init_fn``
    runs once in each of the two (non-persistent) workers per epoch."""
    ref = _ref(35)
    ds = closer(_file_dataset(tmp_path, "npy", ref))
    outdir = tmp_path / "workers"
    outdir.mkdir()
    loader = _loader(ds, 2, worker_init_fn=functools.partial(_record_worker, str(outdir)))
    for _ in range(2):
        x, ids, _ = _take(loader)
        _check_epoch(x, ids, ref)
    recs = _records(outdir)
    assert sorted(r.split("-")[0] for r in recs) == ["w0", "w0", "w1", "w1"]


def test_gadget_loader_spawn_workers_resume(tmp_path, closer):
    """A loader with ``spawn`` workers resumed from a state saved by a loader with ``fork``
    workers: the rest of the epoch equals the uninterrupted run's, values included."""
    ref = _ref(36)
    ds = closer(_file_dataset(tmp_path, "npy", ref))
    epoch0 = _batches(_loader(ds, 0))
    run = _loader(ds, 2)
    it = iter(run)
    head = _batches(it, 2)
    state = run.state_dict()
    del it
    resumed = _loader(ds, 2, seed=8, multiprocessing_context="spawn")
    resumed.load_state_dict(state)
    rest = []
    for b in resumed:
        np.testing.assert_array_equal(b[0].numpy(), ref[b[1].numpy()])
        rest.append(np.array(b[1].numpy(), copy=True))
    assert _same(head + rest, epoch0)


def test_gadget_loader_refuses_out_of_order_workers(tmp_path, closer):
    """README: GadgetLoader refuses DataLoader's ``in_order=False`` (a GadgetValueError)."""
    ds = closer(_file_dataset(tmp_path, "npy", _ref(39)))
    with pytest.raises(gl.GadgetValueError):
        _loader(ds, 2, in_order=False)


def test_stateful_dataloader_with_workers_resumes_the_sampler_form(tmp_path, closer):
    """README: ``StatefulDataLoader(ds, batch_sampler=sampler)`` resumes mid-epoch exactly;
    here with two fork workers."""
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")
    ref = _ref(37)
    ds = closer(_file_dataset(tmp_path, "npy", ref))

    def make(seed):
        sampler = gl.GadgetSampler(ds, batch_size=B, seed=seed)
        return sdl_mod.StatefulDataLoader(
            ds,
            batch_sampler=sampler,
            num_workers=2,
            multiprocessing_context="fork",
            timeout=JOIN_S,
        )

    dl = make(4)
    it = iter(dl)
    head = _batches(it, 3)
    state = dl.state_dict()
    tail = _batches(it)
    del it
    next_epoch = _batches(dl)
    resumed = make(50)
    resumed.load_state_dict(state)
    assert _same(_batches(resumed), tail)
    assert _same(_batches(resumed), next_epoch)
    assert np.array_equal(np.sort(np.concatenate(head + tail)), np.arange(N))
    # README: a state saved after an epoch's last batch, inside the loop, resumes with one
    # empty pass, then the next epoch
    dl = make(4)
    last = None
    for i, _b in enumerate(dl):
        if i == len(dl) - 1:
            last = dl.state_dict()
    second = _batches(dl)
    resumed = make(60)
    resumed.load_state_dict(last)
    assert _batches(resumed) == []
    assert _same(_batches(resumed), second)


# ---------------------------------------------------------------------------------------
# 4. pickling, and use in a spawned child
# ---------------------------------------------------------------------------------------


def _child_init() -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _child_read(blob: bytes, ids: list[int]):
    g = pickle.loads(blob)
    try:
        return g.placement, tuple(g.shape), g.getData(ids).numpy().copy(), g.getNumpyVersion()
    finally:
        g.close()


def _child_write(blob: bytes, ids: list[int], value: float) -> str:
    g = pickle.loads(blob)
    try:
        g.insertData(torch.full((len(ids), *g.shape[1:]), value, dtype=g.dtype), ids)
        return g.placement
    finally:
        g.close()


def _child_epoch(blob: bytes):
    ds, sampler = pickle.loads(blob)
    try:
        batches, xs = [], []
        for b in sampler:
            x, y = ds.gather(b)
            batches.append(b.numpy().copy())
            xs.append(x.numpy().copy())
            assert np.array_equal(y.numpy(), b.numpy())
        return (sampler.rank, sampler.num_replicas, sampler.seed), batches, xs
    finally:
        ds.close()


@pytest.fixture(scope="module")
def spawn_pool():
    """One ``spawn`` child for the module (started once: spawning costs seconds), with CUDA
    hidden in it."""
    pool = mp.get_context("spawn").Pool(1, initializer=_child_init)
    yield pool
    pool.terminate()
    pool.join()


def test_cpu_table_pickles_by_value_into_an_independent_table(closer):
    """README: ``cpu`` gadgets pickle by value: the copy has the rows, and writes on either
    side stay there."""
    ref = _ref(40)
    g = closer(gl.DataGadget(ref, placement="cpu", device="cpu"))
    c = closer(pickle.loads(pickle.dumps(g)))
    assert c.placement == "cpu" and c.shape == g.shape and c.dtype == g.dtype
    np.testing.assert_array_equal(c.getNumpyVersion(), ref)
    c.insertData(torch.zeros(2, D), [0, 1])
    np.testing.assert_array_equal(g.getData([0, 1]).numpy(), ref[:2])
    g.insertData(torch.ones(1, D), [5])
    np.testing.assert_array_equal(c.getData([5]).numpy(), ref[[5]])
    g.close()
    np.testing.assert_array_equal(c.getData([7]).numpy(), ref[[7]])


def test_file_table_pickles_as_its_name_and_reopens_the_file(tmp_path, fext, closer):
    """README: a ``file`` gadget pickles as its file name (no rows: the pickle is far
    smaller than the table); the copy reads the file, and its writes go to that file."""
    ref = _ref(41, n=2000, d=16)
    g = closer(_table(tmp_path, ref, fext))
    g.insertData(torch.full((1, 16), 5.0), [1234])  # written before the pickle: in the file
    ref[1234] = 5.0
    blob = pickle.dumps(g)
    assert len(blob) < ref.nbytes // 10, len(blob)
    c = closer(pickle.loads(blob))
    assert c.placement == "file" and c.shape == g.shape
    np.testing.assert_array_equal(c.getData([0, 1234, 1999]).numpy(), ref[[0, 1234, 1999]])
    c.insertData(torch.full((2, 16), 9.0), [3, 1500])
    np.testing.assert_array_equal(g.getData([3, 1500]).numpy(), np.full((2, 16), 9.0))


def test_dataset_pickle_copies_cpu_columns_and_reopens_file_columns(tmp_path, closer):
    """GadgetDataset.close docstring: pickles copy ``cpu`` columns and reopen ``file`` ones,
    and own what they made (closing the copy leaves the original working)."""
    ref = _ref(42)
    fp = _save(tmp_path, ref, "npy", "feat")
    labels = np.arange(N, dtype=np.int64) * 2
    ds = closer(gl.GadgetDataset(str(fp), labels, placement="file", device="cpu"))
    c = pickle.loads(pickle.dumps(ds))
    ids = np.array([5, 0, N - 1, 77])
    x, y = c.gather(ids)
    np.testing.assert_array_equal(x.numpy(), ref[ids])
    np.testing.assert_array_equal(y.numpy(), labels[ids])
    assert [col.placement for col in c.columns] == [col.placement for col in ds.columns]
    c.close()
    x, y = ds.gather(ids)
    np.testing.assert_array_equal(x.numpy(), ref[ids])
    np.testing.assert_array_equal(y.numpy(), labels[ids])


def test_sampler_pickle_keeps_rank_seed_and_batches():
    """README: a pickled sampler keeps its rank; its order depends only on (seed, epoch)."""
    s = gl.GadgetSampler(N, batch_size=B, seed=7, num_replicas=2, rank=1)
    c = pickle.loads(pickle.dumps(s))
    assert (c.rank, c.num_replicas, c.seed, c.epoch) == (1, 2, 7, 0)
    assert _same([b.numpy() for b in c], [b.numpy() for b in s])
    assert _same([b.numpy() for b in c], [b.numpy() for b in s])  # the next epoch too


def test_spawn_child_reads_a_pickled_table(tmp_path, kind, spawn_pool, closer):
    """A pickled table used in a ``spawn`` process: the same rows there."""
    ref = _ref(43)
    g = closer(_table(tmp_path, ref, kind))
    ids = [0, 299, 17, 17, 150]
    placement, shape, rows, whole = spawn_pool.apply_async(_child_read, (pickle.dumps(g), ids)).get(
        JOIN_S
    )
    assert placement == ("cpu" if kind == "cpu" else "file")
    assert shape == (N, D)
    np.testing.assert_array_equal(rows, ref[ids])
    np.testing.assert_array_equal(whole, ref)


def test_spawn_child_writes_through_a_pickled_file_table(tmp_path, fext, spawn_pool, closer):
    """A ``spawn`` child writes rows through a pickled ``file`` table: they are in the file
    (the original is closed first: HDF5's lock lets one process write a file)."""
    ref = _ref(44)
    g = _table(tmp_path, ref, fext)
    path = str(g.store.path)
    blob = pickle.dumps(g)
    g.close()
    placement = spawn_pool.apply_async(_child_write, (blob, [1, 16, 299], -3.0)).get(JOIN_S)
    assert placement == "file"
    expected = ref.copy()
    expected[[1, 16, 299]] = -3.0
    with gl.DataGadget(path, placement="file", device="cpu") as fresh:
        np.testing.assert_array_equal(fresh.getNumpyVersion(), expected)


def test_spawn_child_iterates_a_pickled_sampler_over_a_pickled_dataset(
    tmp_path, spawn_pool, closer
):
    """Dataset and sampler pickled together and used in a ``spawn`` child: the child's
    batches are the parent's (same seed, rank), and its rows equal NumPy's."""
    _need("zarr")
    ref = _ref(45)
    ds = closer(_file_dataset(tmp_path, "zarr", ref))
    sampler = gl.GadgetSampler(ds, batch_size=B, seed=21, num_replicas=2, rank=1)
    blob = pickle.dumps((ds, sampler))
    meta, batches, xs = spawn_pool.apply_async(_child_epoch, (blob,)).get(JOIN_S)
    assert meta == (1, 2, 21)
    assert _same(batches, [b.numpy() for b in sampler])
    for b, x in zip(batches, xs, strict=True):
        np.testing.assert_array_equal(x, ref[b])


def test_pinned_table_cannot_be_pickled():
    """README: ``cuda`` / ``pinned`` gadgets cannot be pickled (DataGadget.__getstate__: their
    rows live in this process's GPU mappings); a library error is a GadgetError."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device for a pinned table")
    try:
        g = gl.DataGadget(_ref(46), placement="pinned", device="cpu")
    except gl.MissingDependencyError:
        pytest.skip("pinned tables need CuPy")
    try:
        assert g.placement == "pinned"
        with pytest.raises(gl.GadgetError):
            pickle.dumps(g)
        with pytest.raises(gl.GadgetError):
            copy.deepcopy(g)
    finally:
        g.close()


def test_pinned_request_without_cuda_falls_back_to_cpu_and_pickles_by_value():
    """README: without CUDA a ``pinned`` request falls back to ``cpu`` with a
    FallbackWarning, and ``cpu`` gadgets pickle by value."""
    if torch.cuda.is_available():
        pytest.skip("the fallback happens only without CUDA")
    ref = _ref(47)
    with pytest.warns(gl.FallbackWarning):
        g = gl.DataGadget(ref, placement="pinned", device="cpu")
    try:
        assert g.placement == "cpu"
        with pickle.loads(pickle.dumps(g)) as c:
            np.testing.assert_array_equal(c.getNumpyVersion(), ref)
    finally:
        g.close()


# ---------------------------------------------------------------------------------------
# 5. close() while other threads use the table
# ---------------------------------------------------------------------------------------


def _race_close(target_close, calls, check, n_threads: int = 3) -> None:
    """Threads loop ``calls(rng)`` (checking each result with ``check``) until they get
    GadgetClosedError; the main thread calls ``target_close`` once every thread has made a
    few calls. A call started after close() returned must raise; any other error fails."""
    closed = threading.Event()
    warm = [threading.Event() for _ in range(n_threads)]
    outcome: dict[int, str] = {}

    def loop(t: int) -> None:
        rng = np.random.default_rng(t)
        deadline = time.monotonic() + JOIN_S / 2
        n = 0
        while time.monotonic() < deadline:
            after = closed.is_set()
            try:
                res = calls(rng)
            except gl.GadgetClosedError:
                outcome[t] = "closed"
                return
            assert not after, "a call made after close() returned succeeded"
            check(res)
            n += 1
            if n >= 3:
                warm[t].set()
        outcome[t] = "never refused"

    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            loop(t)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            warm[t].set()

    threads = [
        threading.Thread(target=functools.partial(guarded, t), daemon=True)
        for t in range(n_threads)
    ]
    for th in threads:
        th.start()
    for w in warm:
        assert w.wait(JOIN_S), "threads made no calls"
    target_close()
    closed.set()
    for th in threads:
        th.join(JOIN_S)
    assert not any(th.is_alive() for th in threads), "a thread hangs after close()"
    if errors:
        raise errors[0]
    assert outcome == dict.fromkeys(range(n_threads), "closed")


def test_close_while_threads_read(tmp_path, kind):
    """README: after ``close()`` every call that touches rows raises GadgetClosedError.
    Threads reading the table when another thread closes it get that error (reads before
    it are right), and the process goes on."""
    ref = _ref(50)
    g = _table(tmp_path, ref, kind)

    def call(rng):
        ids = rng.integers(0, N, 40)
        return ids, g.getData(ids)

    def check(res):
        ids, rows = res
        np.testing.assert_array_equal(rows.numpy(), ref[ids])

    _race_close(g.close, call, check)
    # README: after close() every call that touches rows -- load() and flush() included --
    # raises GadgetClosedError (a GadgetError); shape, dtype, len() and repr() still
    # answer; close() is idempotent, from several threads too.
    _run_threads([g.close, g.close])
    assert issubclass(gl.GadgetClosedError, gl.GadgetError)
    assert g.shape == (N, D) and len(g) == N and g.dtype == torch.float32
    assert isinstance(repr(g), str)
    for refused in (
        lambda: g.getData([0]),
        lambda: g[1:3],
        lambda: g.insertData(torch.zeros(1, D), [0]),
        lambda: g.getNumpyVersion(),
        lambda: g.flush(),
        lambda: g.zero_(),
        lambda: g.load(str(tmp_path / "absent.npy")),
        lambda: gl.gather_many([g], [0]),
    ):
        with pytest.raises(gl.GadgetClosedError):
            refused()


def test_close_while_threads_write(tmp_path, kind):
    """Threads writing (each its own rows) while another thread closes the table: the
    writers get GadgetClosedError, nothing else."""
    ref = _ref(51)
    g = _table(tmp_path, ref, kind)
    path = None if kind == "cpu" else str(g.store.path)

    def call(rng):
        ids = rng.choice(N, 10, replace=False)
        g.insertData(torch.full((10, D), 4.0), ids)

    _race_close(g.close, call, lambda _res: None)
    with pytest.raises(gl.GadgetClosedError):
        g.insertData(torch.zeros(1, D), [0])
    if path is not None:  # the file is whole: every row the reference's or a written one
        with gl.DataGadget(path, placement="file", device="cpu") as fresh:
            rows = fresh.getNumpyVersion()
        written = np.all(rows == 4.0, axis=1)
        np.testing.assert_array_equal(rows[~written], ref[~written])


def test_close_dataset_while_threads_gather(tmp_path):
    """``GadgetDataset.close()`` frees the tables it created: threads gathering from it
    then get GadgetClosedError."""
    ref = _ref(52)
    ds = gl.GadgetDataset(str(_save(tmp_path, ref, "npy", "feat")), placement="file", device="cpu")

    def call(rng):
        ids = rng.integers(0, N, 33)
        return ids, ds.gather(ids)

    def check(res):
        ids, (x,) = res
        np.testing.assert_array_equal(x.numpy(), ref[ids])

    _race_close(ds.close, call, check)


def test_close_table_while_a_thread_iterates_a_loader(tmp_path):
    """A GadgetLoader iterated in one thread over a table another thread closes: the loop
    ends with GadgetClosedError."""
    ref = _ref(53)
    path = _save(tmp_path, ref, "npy", "feat")
    g = gl.DataGadget(str(path), placement="file", device="cpu")
    ids_col = gl.DataGadget(np.arange(N, dtype=np.int64), placement="cpu", device="cpu")
    ds = gl.GadgetDataset(g, ids_col, device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=8, seed=1)
    its = {}

    def call(rng):
        it = its.get(threading.get_ident())
        if it is None:
            it = its[threading.get_ident()] = iter(loader)
        try:
            return next(it)
        except StopIteration:
            its.pop(threading.get_ident())
            return None

    def check(b):
        if b is not None:
            np.testing.assert_array_equal(b[0].numpy(), ref[b[1].numpy()])

    _race_close(g.close, call, check, n_threads=1)
    ids_col.close()


def test_close_while_a_thread_moves_rows_of_several_tables(tmp_path):
    """``gather_many`` / ``scatter_many`` in threads while one of the tables is closed:
    GadgetClosedError."""
    _need("h5")
    a_ref = _ref(54)
    a = _table(tmp_path, a_ref, "h5", "a")
    b = gl.DataGadget(np.zeros((N, D), np.float32), placement="cpu", device="cpu")

    def call(rng):
        ids = rng.choice(N, 12, replace=False)
        if rng.random() < 0.5:
            return ids, gl.gather_many([a, b], ids)
        gl.scatter_many([a, b], [torch.from_numpy(a_ref[ids]), torch.zeros(12, D)], ids)
        return None

    def check(res):
        if res is not None:
            ids, (ra, rb) = res
            np.testing.assert_array_equal(ra.numpy(), a_ref[ids])
            np.testing.assert_array_equal(rb.numpy(), np.zeros((12, D), np.float32))

    _race_close(a.close, call, check)
    b.close()


@pytest.mark.parametrize("tkind", ["cpu", "npy"])
def test_close_while_another_thread_loads(tmp_path, tkind):
    """DataGadget.close docstring: a ``load()`` that another thread is making meanwhile
    raises GadgetClosedError and leaves the table closed; loads made after close() raise
    it too (README)."""
    src = _ref(55, n=20000, d=32)
    other = tmp_path / "other.npy"
    np.save(other, src)
    g = _table(tmp_path, _ref(56, n=20000, d=32), tkind)

    def call(rng):
        g.load(str(other))
        return None

    _race_close(g.close, call, lambda _r: None, n_threads=2)
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    with pytest.raises(gl.GadgetClosedError):
        g.load(str(other))
    assert g.shape[1:] == (32,)
