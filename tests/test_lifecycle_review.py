"""Lifecycle and concurrency cases found by a review: threads sharing a file table, several
tables of one file, a file replaced or rewritten under an open table, interrupted saves,
copies of an OffloadedOptimizer. Each failed before its fix."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import threading

import numpy as np
import pytest
import torch

import gadgetloader as gl

FORMATS = ["npy", "h5", "zarr"]


def _save(a: np.ndarray, path: str, ext: str, **kw) -> None:
    if ext != "npy":
        pytest.importorskip("h5py" if ext == "h5" else "zarr")
        kw.setdefault("chunk_rows", 64)
    gl.DataGadget(a, placement="cpu").save(path, **kw)


@pytest.mark.parametrize("ext", FORMATS + ["h5gz"])
def test_threads_share_a_file_table(tmp_path, ext):
    rng = np.random.default_rng(0)
    a = rng.random((4000, 8), dtype=np.float32)
    real = "h5" if ext == "h5gz" else ext
    path = str(tmp_path / f"t.{real}")
    _save(a, path, real, **({"compression": "gzip"} if ext == "h5gz" else {}))
    g = gl.DataGadget(path, placement="file", cache_bytes=64 << 10)  # a small, busy cache
    ref = a.copy()
    errors: list[str] = []

    def reader(seed: int) -> None:
        r = np.random.default_rng(seed)
        for _ in range(40):
            ids = r.integers(0, 4000, 300)
            got = g.getData(ids, device="cpu").numpy()
            if not np.array_equal(got, a[ids]):
                errors.append("wrong rows")

    def writer(k: int) -> None:
        rows = np.arange(k, 4000, 4)[:200]
        for chunk in np.array_split(rows, 10):
            vals = -np.ones((chunk.size, 8), np.float32) * (k + 1)
            g.insertData(torch.from_numpy(vals), chunk)
            ref[chunk] = vals

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(g.getData(np.arange(4000), device="cpu").numpy(), ref)
    g.close()
    again = gl.DataGadget(path, placement="file")
    np.testing.assert_array_equal(again.getData(np.arange(4000), device="cpu").numpy(), ref)


@pytest.mark.parametrize("ext", FORMATS)
def test_two_tables_of_one_file_see_each_others_writes(tmp_path, ext):
    path = str(tmp_path / f"two.{ext}")
    _save(np.zeros((1000, 8), np.float32), path, ext)
    a = gl.DataGadget(path, placement="file")
    b = gl.DataGadget(path, placement="file")
    a.getData([0], device="cpu")
    b.getData([0], device="cpu")  # both caches warm
    a.insertData(torch.full((1, 8), 1.0), [0])
    b.insertData(torch.full((1, 8), 2.0), [1])
    a.insertData(torch.full((1, 8), 3.0), [2])
    assert b.getData([0, 1, 2], device="cpu")[:, 0].tolist() == [1.0, 2.0, 3.0]
    a.close()
    b.close()
    c = gl.DataGadget(path, placement="file")
    assert c.getData([0, 1, 2], device="cpu")[:, 0].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("ext", FORMATS)
def test_a_file_replaced_under_an_open_table_is_an_error(tmp_path, ext):
    a = np.zeros((2000, 4), np.float32)
    b = a + 10
    path = str(tmp_path / f"r.{ext}")
    _save(a, path, ext)
    g = gl.DataGadget(path, placement="file")
    g.getData([0, 100], device="cpu")
    _save(b, path, ext)  # another table's save replaces the file
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.insertData(torch.full((1, 4), -1.0), [3])
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        g.getData([3], device="cpu")
    fresh = gl.DataGadget(path, placement="file")
    np.testing.assert_array_equal(fresh.getData(np.arange(2000), device="cpu").numpy(), b)
    g.load(path)  # load() follows the new file
    np.testing.assert_array_equal(g.getData([3], device="cpu").numpy(), b[[3]])


def test_a_npy_rewritten_shorter_is_an_error_not_a_crash(tmp_path):
    path = str(tmp_path / "bus.npy")
    a = np.random.default_rng(0).random((200000, 16), dtype=np.float32)
    np.save(path, a)
    g = gl.DataGadget(path, placement="file")
    g.getData([5], device="cpu")
    np.save(path, a[:10])  # same inode, truncated: reading the old map would be SIGBUS
    with pytest.raises(gl.GadgetFileError, match="shrank"):
        g.getData([150000], device="cpu")


def test_a_deleted_file_is_an_error(tmp_path):
    path = str(tmp_path / "gone.npy")
    np.save(path, np.zeros((10, 2), np.float32))
    g = gl.DataGadget(path, placement="file")
    os.remove(path)
    with pytest.raises(gl.GadgetFileError, match="gone"):
        g.getData([1], device="cpu")


@pytest.mark.parametrize("ext", ["zarr", "npy", "h5"])
# an interrupt may land inside a finalizer (h5py's, the progress bar's): reported as unraisable
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupted_save_leaves_no_partial_file(tmp_path, ext):
    if ext != "npy":
        pytest.importorskip("zarr" if ext == "zarr" else "h5py")
    big = gl.DataGadget(np.ones((1_000_000, 32), np.float32), placement="cpu")
    target = tmp_path / f"t.{ext}"
    _save(np.full((10, 32), 5.0, np.float32), str(target), ext)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    interrupted = 0
    try:
        for delay in (0.02, 0.05, 0.1):
            signal.setitimer(signal.ITIMER_REAL, delay)
            try:
                big.save(target, progress=False)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if interrupted:
                break
    finally:
        signal.signal(signal.SIGALRM, old)
    if not interrupted:
        pytest.skip("every save finished before the interrupt on this machine")
    import time

    time.sleep(0.3)  # anything still writing in the background would show up now
    assert sorted(os.listdir(tmp_path)) == [f"t.{ext}"]
    # the old file, or (an interrupt after the rename) the whole new one, never a mix
    kept = gl.DataGadget(str(target), placement="cpu").getNumpyVersion()
    assert (kept.shape == (10, 32) and (kept == 5).all()) or (
        kept.shape == (1_000_000, 32) and (kept == 1).all()
    )


def test_offloaded_optimizer_refuses_copies_with_a_clear_error():
    emb = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    for make_copy in (copy.deepcopy, pickle.dumps, lambda o: copy.deepcopy((emb, o))):
        with pytest.raises(gl.GadgetTypeError, match="state_dict"):
            make_copy(opt)
    emb(torch.tensor([1])).sum().backward()
    opt.step()  # the original still works
    assert copy.deepcopy(emb).weight.shape == (10, 4)  # the model alone copies


def test_a_relative_path_survives_a_change_of_directory(tmp_path, monkeypatch):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    monkeypatch.chdir(tmp_path)
    np.save("rel.npy", a)
    g = gl.DataGadget("rel.npy", placement="file")
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    np.testing.assert_array_equal(g.getData([1, 9], device="cpu").numpy(), a[[1, 9]])
    g.insertData(torch.full((1, 4), -1.0), [2])
    np.testing.assert_array_equal(np.load(tmp_path / "rel.npy")[2], [-1.0] * 4)


@pytest.mark.parametrize("ext", ["npy", "h5"])
def test_ctrl_c_after_a_save_over_itself_committed_keeps_the_table_usable(
    tmp_path, ext, monkeypatch
):
    if ext == "h5":
        pytest.importorskip("h5py")
    from gadgetloader.io import _hdf5, _npy

    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    path = str(tmp_path / f"own.{ext}")
    _save(a, path, ext)
    t = gl.DataGadget(path, placement="file")
    t.insertData(torch.full((1, 4), -1.0), [3])
    sink = _npy.NpySink if ext == "npy" else _hdf5.Hdf5Sink
    real = sink.commit

    def commit_then_ctrl_c(self):
        real(self)
        os.kill(os.getpid(), signal.SIGINT)  # pressed while the new file took its place

    monkeypatch.setattr(sink, "commit", commit_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        t.save(path, progress=False)
    expect = a.copy()
    expect[3] = -1.0
    np.testing.assert_array_equal(t.getData(np.arange(10), device="cpu").numpy(), expect)
    t.insertData(torch.full((1, 4), -2.0), [4])  # and it still writes its file
    expect[4] = -2.0
    np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), expect)
