"""Session 52's fixes.

- An HDF5 ``file`` table memory-mapped its rows by path. A save that replaced the file
  after the table's check at the start of a call, but before the map was made, had the
  call return the new file's rows (seen once in ~330 runs of a thread test). The map and
  the raw descriptor are now made from the file HDF5 has open, checked by inode.
"""

from __future__ import annotations

import os
import traceback

import h5py
import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.io import _hdf5


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "contiguous"])
def test_hdf5_file_replaced_while_rows_are_mapped_never_reads_new_file(
    tmp_path, monkeypatch, chunked
):
    """A file table reads its rows as they were when it opened the file, or raises
    GadgetFileError saying the file was replaced; never rows of the file saved over it."""
    arr = np.arange(96 * 8, dtype=np.float32).reshape(96, 8)
    path = str(tmp_path / "t.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("emb", data=arr, chunks=(16, 8) if chunked else None)
    g = gl.DataGadget(path, placement="file")
    name = "_chunk_table" if chunked else "_dataset"
    orig = getattr(_hdf5.Hdf5Source, name)
    replaced = []

    def replace_inside_row_map(self, *a, **k):
        out = orig(self, *a, **k)
        if not replaced and traceback.extract_stack()[-2].name == "_row_map":
            replaced.append(1)  # after the call's checks, before the rows are mapped
            gl.DataGadget(arr + 1000, placement="cpu").save(path, dataset="emb")
        return out

    monkeypatch.setattr(_hdf5.Hdf5Source, name, replace_inside_row_map)
    ids = np.arange(0, 96, 3)
    try:
        got = g.getData(ids).numpy()
    except gl.GadgetFileError as exc:
        assert "replaced" in str(exc)
    else:
        np.testing.assert_array_equal(got, arr[ids])
    assert replaced, "the read did not map the file's rows"
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.getData(ids)
    g.close()
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["emb"][...], arr + 1000)


@pytest.mark.parametrize("order", ["C", "F", "big-endian"])
def test_npy_file_replaced_before_rows_are_mapped_never_reads_new_file(
    tmp_path, monkeypatch, order
):
    """The same for .npy tables: the rows are mapped (or read) from the file the table
    parsed, so a save over it between the call's check and the read is refused."""
    from gadgetloader.io import _npy

    arr = np.arange(96 * 8, dtype=np.float32).reshape(96, 8)
    stored = arr.astype(">f4") if order == "big-endian" else arr
    if order == "F":
        stored = np.asfortranarray(arr)
    path = str(tmp_path / "t.npy")
    np.save(path, stored)
    g = gl.DataGadget(path, placement="file")
    replaced = []

    def hook(name):
        orig = getattr(_npy.NpySource, name)

        def wrapped(self, *a, **k):
            if not replaced:
                replaced.append(1)  # after the call's checks, before the rows are read
                np.save(str(tmp_path / "new.npy"), stored + 1000)
                os.replace(tmp_path / "new.npy", path)
            return orig(self, *a, **k)

        monkeypatch.setattr(_npy.NpySource, name, wrapped)

    hook("memmap")
    hook("read_into")
    ids = np.arange(0, 96, 3)
    try:
        got = g.getData(ids).numpy()
    except gl.GadgetFileError as exc:
        assert "replaced" in str(exc)
    else:
        np.testing.assert_array_equal(got, arr[ids])
    assert replaced, "the read did not touch the file"
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.getData(ids)
    g.close()


@pytest.mark.parametrize("cls", ["OffloadedEmbedding", "OffloadedEmbeddingBag"])
def test_shallow_copy_of_offloaded_embedding_is_refused(cls):
    """README: a table belongs to one OffloadedOptimizer at a time. copy.copy shared the
    table yet looked unowned, so a second optimizer could take the same rows; it is a
    GadgetTypeError now, and deepcopy still gives a separate table with no optimizer."""
    import copy

    import torch

    torch.manual_seed(0)
    emb = getattr(gl, cls)(20, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    ids = torch.arange(5)
    out = emb(ids) if cls == "OffloadedEmbedding" else emb(ids.view(1, -1))
    out.sum().backward()
    opt.step()
    before = emb.state_dict()["weight"].clone()
    with pytest.raises(gl.GadgetTypeError, match="copy.copy.*share its table"):
        copy.copy(emb)
    twin = copy.deepcopy(emb)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, twin, lr=0.1)
    out = twin(ids) if cls == "OffloadedEmbedding" else twin(ids.view(1, -1))
    out.sum().backward()
    opt2.step()
    assert torch.equal(emb.state_dict()["weight"], before)
    assert not torch.equal(twin.state_dict()["weight"], before)
    with pytest.raises(gl.GadgetValueError, match="already belongs"):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)


@pytest.mark.parametrize("compression", ["default", "none"])
@pytest.mark.parametrize("how", ["gather", "read"])
def test_zarr_store_replaced_during_a_read_raises(tmp_path, monkeypatch, compression, how):
    """A zarr table reads each chunk file by its path: a save that replaced the store
    while a call read its chunks gave a mix of the two arrays' rows. The call now checks
    the store after reading and raises GadgetFileError saying it was replaced."""
    from gadgetloader.io import _zarr

    arr = np.arange(96 * 8, dtype=np.float32).reshape(96, 8)
    path = str(tmp_path / "t.zarr")
    kw = {} if compression == "default" else {"compression": compression}
    gl.DataGadget(arr, placement="cpu").save(path, chunk_rows=16, **kw)
    g = gl.DataGadget(path, placement="file")
    orig = _zarr.ZarrSource._read_chunk
    calls = []

    def read_chunk(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # half-way through the call's chunks
            gl.DataGadget(arr + 1000, placement="cpu").save(path, chunk_rows=16, **kw)
        return orig(self, *a, **k)

    monkeypatch.setattr(_zarr.ZarrSource, "_read_chunk", read_chunk)
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        if how == "gather":
            g.getData(np.arange(0, 96, 3))
        else:
            g.getNumpyVersion()
    assert len(calls) >= 2
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.getData(np.arange(3))
    g.close()


# ---- convert (black-box review) -------------------------------------------------------------


def _cli(*args, cwd=None):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "gadgetloader", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_convert_refuses_npy_source_inside_destination_store(tmp_path):
    """A .npy source inside the zarr store named as the destination was deleted with the
    store it replaced; it is refused like an HDF5 or zarr source there, nothing changed."""
    from gadgetloader.convert import convert

    arr = np.arange(24, dtype=np.float32).reshape(6, 4)
    store = tmp_path / "store.zarr"
    gl.DataGadget(arr, placement="cpu").save(str(store))
    src = store / "emb.npy"
    np.save(src, arr * 2)
    before = sorted(p.name for p in store.iterdir())
    with pytest.raises(gl.GadgetValueError, match="would replace"):
        convert(str(src), str(store))
    r = _cli("convert", str(src), str(store))
    assert r.returncode == 1 and "would replace" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in store.iterdir()) == before
    np.testing.assert_array_equal(np.load(src), arr * 2)


@pytest.mark.parametrize("ext", [".npy", ".h5"])
def test_save_and_convert_refuse_a_file_name_ending_in_slash(tmp_path, ext):
    """'out.npy/' names a directory: it was written as the file 'out.npy'."""
    from gadgetloader.convert import convert

    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "a.npy", arr)
    dst = str(tmp_path / f"out{ext}") + "/"
    with pytest.raises(gl.GadgetValueError, match="ends with '/'"):
        convert(str(tmp_path / "a.npy"), dst)
    with pytest.raises(gl.GadgetValueError, match="ends with '/'"):
        gl.DataGadget(arr, placement="cpu").save(dst)
    r = _cli("convert", "a.npy", f"out{ext}/", cwd=tmp_path)
    assert r.returncode == 1 and "ends with '/'" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]
    # a zarr store is a directory: the slash is fine there
    gl.DataGadget(arr, placement="cpu").save(str(tmp_path / "z.zarr") + "/")
    np.testing.assert_array_equal(
        gl.DataGadget(str(tmp_path / "z.zarr"), placement="cpu").getNumpyVersion(), arr
    )


def test_convert_bfloat16_to_npy_names_the_files(tmp_path):
    import torch

    src = tmp_path / "bf.h5"
    gl.DataGadget(torch.randn(10, 4).to(torch.bfloat16), placement="cpu").save(str(src))
    r = _cli("convert", "bf.h5", "bf.npy", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "bf.h5" in r.stderr and "bf.npy" in r.stderr and "HDF5 or zarr" in r.stderr
    assert "table.as_tensor()" not in r.stderr
    assert not (tmp_path / "bf.npy").exists()
    with pytest.raises(gl.GadgetTypeError, match="out.npy"):
        gl.DataGadget(torch.zeros(2, 2, dtype=torch.bfloat16), placement="cpu").save(
            str(tmp_path / "out.npy")
        )


def test_empty_paths_are_refused_naming_which(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((2, 2), np.float32))
    r = _cli("convert", "", "x.npy", cwd=tmp_path)
    assert r.returncode == 1 and "source path is an empty string" in r.stderr
    r = _cli("convert", "a.npy", "", cwd=tmp_path)
    assert r.returncode == 1 and "destination path is an empty string" in r.stderr
    with pytest.raises(gl.GadgetValueError, match="empty string"):
        gl.DataGadget("", placement="file")
    with pytest.raises(gl.GadgetValueError, match="empty string"):
        gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu").save("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]


def test_hdf5_writer_opens_when_a_reader_closed_its_handle_meanwhile(tmp_path, monkeypatch):
    """A write to one dataset of an HDF5 file failed ("already open for read-only") when the
    table of another dataset, read in another thread, closed its handle (to reopen it)
    just before the writer looked for read handles to release: none was found, and the
    writer gave up without trying again. Seen ~1 in 70 runs of a thread test; here the
    reader's thread is played by the release itself."""
    arr = np.arange(96 * 8, dtype=np.float32).reshape(96, 8)
    path = str(tmp_path / "two.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=arr, chunks=(16, 8))
        f.create_dataset("b", data=arr * 2, chunks=(16, 8))
    a = gl.DataGadget(path, dataset="a", placement="file")
    b = gl.DataGadget(path, dataset="b", placement="file")
    np.testing.assert_array_equal(a.getData(np.arange(4)).numpy(), arr[:4])  # 'a' open, 'r'
    real = _hdf5._release_readers

    def closed_meanwhile(writer):
        for src in list(_hdf5._OPEN):  # the other thread closes its handle first...
            if src is not writer and src._mode == "r" and src._file is not None:
                src._file.close()
                src._file = src._ds = None
                _hdf5._OPEN.discard(src)
        return real(writer)  # ...so this finds none open

    monkeypatch.setattr(_hdf5, "_release_readers", closed_meanwhile)
    b.insertData(torch.full((2, 8), 7.0), [0, 5])
    monkeypatch.undo()
    b.flush()
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["b"][[0, 5]], np.full((2, 8), 7.0, np.float32))
        np.testing.assert_array_equal(f["a"][...], arr)
    np.testing.assert_array_equal(a.getData(np.arange(96)).numpy(), arr)
    a.close()
    b.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("order", ["C", "F", "big-endian"])
def test_npy_file_table_keeps_no_extra_descriptor_for_its_map(tmp_path, order):
    """The inode check of the .npy map (above) kept a second descriptor open per table
    beside the one the map holds: 400 open tables ran out of a 1024-descriptor limit."""
    arr = np.arange(40, dtype=np.float32).reshape(10, 4)
    stored = {"C": arr, "F": np.asfortranarray(arr), "big-endian": arr.astype(">f4")}[order]
    tabs = []
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        np.save(tmp_path / f"c{i}.npy", stored)
        g = gl.DataGadget(str(tmp_path / f"c{i}.npy"), placement="file")
        np.testing.assert_array_equal(g.getData([1, 3]).numpy(), arr[[1, 3]])
        tabs.append(g)
    per_table = (len(os.listdir("/proc/self/fd")) - before) / len(tabs)
    assert per_table <= (1 if order == "F" else 2), per_table
    for g in tabs:
        g.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_checkpoint_directory_empty_string_is_the_working_directory(tmp_path, monkeypatch):
    """``load_checkpoint(os.path.dirname("meta.pt"), ...)`` -- an empty string -- loads
    from the working directory, as before the empty-path refusal; so does the save."""
    monkeypatch.chdir(tmp_path)
    emb = gl.OffloadedEmbedding(8, 4, placement="cpu", device="cpu")
    gl.save_checkpoint("", {"emb": emb})
    assert (tmp_path / "meta.pt").exists()
    twin = gl.OffloadedEmbedding(8, 4, placement="cpu", device="cpu")
    gl.load_checkpoint(os.path.dirname("meta.pt"), {"emb": twin})
    assert torch.equal(twin.state_dict()["weight"], emb.state_dict()["weight"])


# ---- multi-thread and lifetime review ----------------------------------------------------------


def _make(tmp_path, fmt, arr):
    if fmt == "npy":
        path = str(tmp_path / "t.npy")
        np.save(path, arr)
    elif fmt == "h5":
        path = str(tmp_path / "t.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=arr, chunks=(16, arr.shape[1]))
    else:
        path = str(tmp_path / "t.zarr")
        gl.DataGadget(arr, placement="cpu").save(path, chunk_rows=16)
    return path


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_save_over_own_file_while_another_thread_writes_loses_no_write(tmp_path, fmt):
    """README: a file table saved over its own file reads that file on, and each write
    reaches the file before it returns. A write another thread made while the save ran
    went to the old file after the save had read its rows and was lost; a call between
    the rename and the reload raised "replaced". Both threads' calls now succeed and
    every acknowledged write is in the table and the file."""
    import threading

    arr = np.zeros((64, 4), dtype=np.float32)
    path = _make(tmp_path, fmt, arr)
    g = gl.DataGadget(path, placement="file")
    stop = threading.Event()
    errors, last = [], {}

    def writer():
        k = 0
        while not stop.is_set():
            k += 1
            row = k % 64
            try:
                g.insertData(torch.full((1, 4), float(k)), [row])
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(repr(exc))
                return
            last[row] = float(k)

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(8):
            g.save(path)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors[:3]
    assert last, "the writer made no write"
    got = g.getNumpyVersion()
    for row, value in last.items():
        assert got[row, 0] == value, (row, value, got[row, 0])
    g.close()
    back = gl.DataGadget(path, placement="cpu").getNumpyVersion()
    for row, value in last.items():
        assert back[row, 0] == value, (row, value, back[row, 0])


def test_hdf5_table_that_wrote_keeps_refusing_a_truncated_file(tmp_path):
    """README: once the file is refused, the table's reads and writes keep raising
    GadgetFileError. A written HDF5 table's write found the truncation, but its next
    reads served the cached rows."""
    arr = np.arange(1000 * 8, dtype=np.float32).reshape(1000, 8)
    path = str(tmp_path / "t.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=arr, chunks=(64, 8))
    g = gl.DataGadget(path, placement="file")
    g.insertData(torch.from_numpy(arr[:10].copy()), torch.arange(10))  # it has written
    np.testing.assert_array_equal(g.getData(torch.arange(1000)).numpy(), arr)  # cached
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(gl.GadgetFileError, match="truncated"):
        g.insertData(torch.zeros(2, 8), torch.arange(2))
    for call in (
        lambda: g.getData([5]),
        lambda: g.getData(torch.arange(1000)),
        lambda: g.insertData(torch.zeros(2, 8), torch.arange(2)),
    ):
        with pytest.raises(gl.GadgetFileError, match="truncated"):
            call()
    g.close()


def test_save_over_own_file_waits_without_blocking_other_tables(tmp_path):
    """The self-save waits for the file's lock without holding the lock that swaps a
    table's store: a thread holding the file's lock (``store.exclusive()``) may still
    close another table meanwhile, then the save goes on. (Holding the swap lock for the
    whole save hung both threads, and every other table's close() and load() waited.)"""
    import threading
    import time

    arr = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    path = _make(tmp_path, "npy", arr)
    g = gl.DataGadget(path, placement="file")
    other = gl.DataGadget(arr.copy(), placement="cpu")
    holding, done = threading.Event(), {}

    def hold_then_close_other():
        with g.store.exclusive():
            holding.set()
            time.sleep(0.3)  # the save below is waiting for this lock now
            other.close()
        done["closer"] = True

    def save_over_itself():
        assert holding.wait(30)
        g.save(path)
        done["saver"] = True

    ts = [
        threading.Thread(target=f, daemon=True) for f in (hold_then_close_other, save_over_itself)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert done == {"closer": True, "saver": True}, done
    np.testing.assert_array_equal(g.getNumpyVersion(), arr)
    g.close()


@pytest.mark.parametrize("link", [False, True], ids=["one-name", "hard-link"])
@pytest.mark.parametrize("compression", ["gzip", None])
def test_two_hdf5_datasets_written_from_two_threads_never_look_truncated(
    tmp_path, compression, link
):
    """Tables of two datasets of one HDF5 file, written from two threads: a table's check
    of its file's end took the space HDF5 had allocated for the other table's unflushed
    writes (the handles share it) for a truncation -- a false GadgetFileError, which is
    now also final. The other table's writes no longer count."""
    import threading

    path = str(tmp_path / "two.h5")
    with h5py.File(path, "w") as f:
        for name in "ab":
            f.create_dataset(
                name, shape=(4096, 16), dtype="f4", chunks=(64, 16), compression=compression
            )
            f[name][...] = 0
    other = path
    if link:  # the second table reaches the file by another name (HDF5 shares the file)
        other = str(tmp_path / "linked.h5")
        os.link(path, other)
    tabs = [gl.DataGadget(p, dataset=n, placement="file") for p, n in ((path, "a"), (other, "b"))]
    errors, last = [], [{}, {}]

    def work(k):
        g, rng = tabs[k], np.random.default_rng(k)
        for _ in range(150):
            ids = rng.choice(4096, 32, replace=False)
            rows = rng.random((32, 16), dtype=np.float32)
            try:
                g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
                np.testing.assert_array_equal(g.getData(torch.from_numpy(ids)).numpy(), rows)
                g.getData(torch.from_numpy(rng.choice(4096, 256, replace=False)))
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(f"{'ab'[k]}: {type(exc).__name__}: {exc}")
                return
            last[k].update(zip(ids.tolist(), rows, strict=True))

    ts = [threading.Thread(target=work, args=(k,), daemon=True) for k in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors[:2]
    for g in tabs:
        g.close()
    with h5py.File(path, "r") as f:
        for k, name in enumerate("ab"):
            got = f[name][...]
            for row, values in last[k].items():
                np.testing.assert_array_equal(got[row], values)


def test_hdf5_source_lists_survive_sources_opened_in_other_threads():
    """The HDF5 code lists its open sources (a writer's check of other writers on every
    write, the release of readers, the fork hook) from weak sets, whose iteration raised
    RuntimeError when another thread opened a source meanwhile."""
    import sys
    import threading
    import weakref

    class Item:
        pass

    items = [Item() for _ in range(200)]
    ws = weakref.WeakSet(items[:100])
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            for o in items[100:]:
                ws.add(o)
            for o in items[100:]:
                ws.discard(o)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(5000):
            got = _hdf5._listed(ws)
            assert set(items[:100]) <= set(got)
    finally:
        stop.set()
        t.join(30)
        sys.setswitchinterval(old)


def test_retried_call_and_self_save_take_locks_in_one_order(tmp_path, monkeypatch):
    """A call overtaken by loads often enough is made again holding the swap lock; it
    took that lock before the file's, while a save over the table's own file holds the
    file's lock and then reloads (taking the swap lock): both hung. Made likely here by
    retrying under the lock after one retirement instead of several."""
    import threading
    import time

    from gadgetloader import gadget as _gadget

    monkeypatch.setattr(_gadget, "_RETRIES", 1)  # (the lock-holding retry, often)
    arr = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    path = _make(tmp_path, "npy", arr)
    g = gl.DataGadget(path, placement="file")
    stop, counts, errors = threading.Event(), {"saves": 0, "reads": 0}, []

    def saver():
        while not stop.is_set():
            try:
                g.save(path)
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(repr(exc))
                return
            counts["saves"] += 1

    def reader():
        ids = torch.tensor([3, 7])
        while not stop.is_set():
            try:
                got = g.getData(ids, device="cpu")
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))
                return
            counts["reads"] += 1
        np.testing.assert_array_equal(got.numpy(), arr[[3, 7]])

    ts = [threading.Thread(target=f, daemon=True) for f in (saver, reader)]
    for t in ts:
        t.start()
    time.sleep(5)
    before = dict(counts)
    time.sleep(1)
    stop.set()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), f"hung: {counts}"
    assert not errors, errors[:2]
    assert counts["saves"] > before["saves"] and counts["reads"] > before["reads"], counts
    g.close()


def test_self_save_reload_does_not_undo_another_threads_load(tmp_path, monkeypatch):
    """A load() another thread made after a save over the table's own file had read its
    rows was undone when the save reloaded its file; the later load now stands."""
    import threading
    import time

    from gadgetloader import io as _io

    own, other = str(tmp_path / "own.npy"), str(tmp_path / "other.npy")
    np.save(own, np.zeros((64, 4), np.float32))
    np.save(other, np.full((64, 4), 9.0, np.float32))
    g = gl.DataGadget(own, placement="file")
    real = _io.save_from
    committed = threading.Event()

    def slow_save_from(*a, **k):
        out = real(*a, **k)  # rows read, the new file renamed into place
        committed.set()
        time.sleep(0.5)
        return out

    monkeypatch.setattr(_io, "save_from", slow_save_from)
    res = {}

    def saver():
        g.save(own)
        res["save"] = True

    def loader():
        assert committed.wait(30)
        g.load(other)
        res["load"] = True

    ts = [threading.Thread(target=f, daemon=True) for f in (saver, loader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert res == {"save": True, "load": True}, res
    assert os.path.basename(g.store.path) == "other.npy"
    np.testing.assert_array_equal(g.getNumpyVersion(), np.full((64, 4), 9.0, np.float32))
    g.close()


def test_truncation_is_found_with_two_written_tables_of_one_hdf5_file(tmp_path):
    """The check of the file's end stood aside whenever another table of the file was
    open for writing -- for good, once both had written -- so rows cut off by another
    program read as zeros. It stands aside only while another table's write is in
    flight now."""
    path = str(tmp_path / "two.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("a", shape=(4096, 16), dtype="f4", chunks=(64, 16), compression="gzip")
        f["a"][...] = 0
        f.create_dataset("b", shape=(4096, 16), dtype="f4", chunks=(64, 16))
        f["b"][...] = 3.0
    ta = gl.DataGadget(path, dataset="a", placement="file")
    tb = gl.DataGadget(path, dataset="b", placement="file")
    ta.insertData(torch.ones(1, 16), torch.tensor([640]))  # a's chunk moves to the end
    tb.insertData(torch.full((1, 16), 2.0), torch.tensor([0]))
    ta.flush()
    tb.flush()
    with h5py.File(path, "r") as f:
        ds = f["b"]
        last = max(
            (ds.id.get_chunk_info(i) for i in range(ds.id.get_num_chunks())),
            key=lambda info: info.byte_offset,
        )
    os.truncate(path, last.byte_offset)  # b's last chunk is cut off
    row = last.chunk_offset[0] + 5
    rows = torch.from_numpy(np.random.default_rng(0).random((64, 16), dtype=np.float32))
    with pytest.raises(gl.GadgetFileError, match="truncated"):
        ta.insertData(rows, torch.arange(64, 128))  # (would write past the cut)
    with pytest.raises(gl.GadgetFileError, match="truncated"):
        tb.getData(torch.tensor([row]))
    with pytest.raises(gl.GadgetFileError, match="truncated"):
        ta.getData(torch.tensor([1]))
    ta.close()
    tb.close()
