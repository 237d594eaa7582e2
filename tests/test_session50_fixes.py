"""Session 50: no HDF5 handle opens between a fork's hook and the fork; a table larger
than the machine's memory is refused before it is allocated (see test_session49_fixes)."""

from __future__ import annotations

import copy
import os
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.io._hdf5 import Hdf5Source

h5py = pytest.importorskip("h5py")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_while_another_thread_opens_an_hdf5_table_for_writing(tmp_path):
    """A table opened for writing in another thread at the moment of a fork used to slip
    past the fork's hook: the child inherited its handle and HDF5's lock with it, and this
    process could no longer open the file for writing while the child lived."""
    p = str(tmp_path / "t.h5")
    ref = np.arange(400, dtype=np.float32).reshape(100, 4)
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=ref, chunks=(10, 4))
    stop = threading.Event()
    errs: list[BaseException] = []
    opened = [0]

    def opener():  # a new source opened for writing, again and again (as a table's first write)
        while not stop.is_set():
            try:
                src = Hdf5Source(p, dataset="x", mode="r+")
                src.close()
                opened[0] += 1
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
                return

    t = threading.Thread(target=opener, daemon=True)
    t.start()
    kids = []
    try:
        with warnings.catch_warnings():  # Python 3.12+: fork of a multi-threaded process
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            deadline = time.monotonic() + 20
            while len(kids) < 100 and not errs and time.monotonic() < deadline:
                pid = os.fork()
                if pid == 0:  # a child that outlives the parent's next opens
                    time.sleep(2.0)
                    os._exit(0)
                kids.append(pid)
    finally:
        stop.set()
        t.join(30)
    try:
        assert not errs, errs[:1]
        assert opened[0] > 0 and len(kids) >= 10
        # while every child lives, this process writes the file through a new table
        g = gl.DataGadget(p, placement="file", dataset="x", cache_bytes=0)
        g.insertData(torch.full((1, 4), 7.0), [3])
        np.testing.assert_array_equal(g.getData([3, 4]).cpu().numpy(), [[7.0] * 4, ref[4]])
        g.close()
    finally:
        codes = [os.waitpid(pid, 0)[1] for pid in kids]
    assert codes == [0] * len(kids)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_hdf5_save_in_a_thread_during_a_fork_leaves_the_file_openable(tmp_path):
    """A child forked while another thread saved a table to HDF5 inherited the new file's
    HDF5 lock and kept it after the file was renamed into place: the saved file could not
    be opened, even read-only, while the child lived."""
    src = gl.DataGadget((40_000, 64), dtype="float32", placement="cpu")
    src.normal_(generator=torch.Generator().manual_seed(0))
    want = src.getNumpyVersion()
    p = str(tmp_path / "ck.h5")
    kids = []
    try:
        for _ in range(4):
            done = threading.Event()
            errs: list[BaseException] = []

            def save(done=done, errs=errs):
                try:
                    src.save(p, chunk_rows=256, compression="gzip")
                except BaseException as e:  # noqa: BLE001
                    errs.append(e)
                finally:
                    done.set()

            t = threading.Thread(target=save, daemon=True)
            t.start()
            with warnings.catch_warnings():  # Python 3.12+: fork of a multi-threaded process
                warnings.filterwarnings("ignore", category=DeprecationWarning)
                while not done.is_set():  # fork again and again while the save runs
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(3.0)
                        os._exit(0)
                    kids.append(pid)
                    time.sleep(0.003)
            t.join(60)
            assert not errs, errs[:1]
            g = gl.DataGadget(p, placement="file")  # while the children live
            np.testing.assert_array_equal(g.getData([0, 39_999]).cpu().numpy(), want[[0, -1]])
            g.insertData(torch.full((1, 64), 2.0), [5])
            g.close()
            want[5] = 2.0
    finally:
        codes = [os.waitpid(pid, 0)[1] for pid in kids]
    assert kids and codes == [0] * len(kids)


# ---- the transfer engine's scatter checks the rows' shape, not only their element count --------
@pytest.mark.parametrize("many", [False, True])
def test_engine_scatter_refuses_rows_of_another_shape(many):
    from gadgetloader import transfer
    from gadgetloader.transfer import _engine

    table = torch.arange(40.0).reshape(10, 4)
    before = table.clone()
    ids = torch.tensor([1, 2])
    good = torch.arange(8.0).reshape(2, 4) + 100

    def scatter(rows, i=ids):
        if many:
            _engine.scatter_many([table], i, [rows])
        else:
            transfer.scatter(table, i, rows)

    for bad in (good.t(), good.reshape(-1), good.reshape(1, 2, 4), torch.ones(2, 5)):
        with pytest.raises(gl.GadgetValueError, match=r"must have shape \(2, 4\)"):
            scatter(bad)
        assert torch.equal(table, before)
    scatter(good)  # ids.shape + row shape
    assert torch.equal(table[1:3], good) and torch.equal(table[3:], before[3:])
    scatter(good + 1, ids.reshape(1, 2))  # (ids.numel(),) + row shape, for 2-D ids
    assert torch.equal(table[1:3], good + 1)
    scatter((good + 2).reshape(1, 2, 4), ids.reshape(1, 2))  # ids.shape + row shape
    assert torch.equal(table[1:3], good + 2) and torch.equal(table[0], before[0])


# ---- checkpoints (from a black-box review of checkpoint and resume) -----------------------------
def _adam_table(seed=0, cls=torch.optim.Adam, **kw):
    torch.manual_seed(seed)
    emb = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu")
    return emb, gl.OffloadedOptimizer(cls, emb, lr=0.1, **kw)


def _train(emb, opt, steps):
    for _ in range(steps):
        opt.zero_grad()
        emb(torch.arange(10)).pow(2).sum().backward()
        opt.step()


def _snapshot(emb, opt):
    return emb.weight.getNumpyVersion().copy(), copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize(
    ("cls", "edit"),
    [
        (torch.optim.Adam, "entry"),
        (torch.optim.Rprop, "step"),
        (torch.optim.ASGD, "entry"),
        (torch.optim.ASGD, "step"),
    ],
)
def test_table_state_without_its_step_is_refused(tmp_path, cls, edit):
    emb, opt = _adam_table(0, cls)
    _train(emb, opt, 5)
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    if edit == "entry":
        bad["inner"]["state"][0] = {}
    else:
        del bad["inner"]["state"][0]["step"]
    emb2, opt2 = _adam_table(1, cls)
    _train(emb2, opt2, 2)
    before = _snapshot(emb2, opt2)
    with pytest.raises(gl.GadgetValueError, match=r"lacks \[.*'step'.*\].*step count"):
        opt2.load_state_dict(bad)
    after = _snapshot(emb2, opt2)
    np.testing.assert_array_equal(after[0], before[0])
    assert str(after[1]) == str(before[1])
    # the same edit inside a checkpoint's meta.pt
    d = str(tmp_path / "ck")
    gl.save_checkpoint(d, {"o": opt}, progress=False)
    meta = torch.load(os.path.join(d, "meta.pt"), weights_only=True)
    inner = meta["objects"]["o"]["meta"]["inner"]["state"]
    if edit == "entry":
        inner[0] = {}
    else:
        del inner[0]["step"]
    torch.save(meta, os.path.join(d, "meta.pt"))
    with pytest.raises(gl.GadgetValueError, match="lacks"):
        gl.load_checkpoint(d, {"o": opt2})
    after = _snapshot(emb2, opt2)
    np.testing.assert_array_equal(after[0], before[0])
    assert str(after[1]) == str(before[1])
    # the unedited state loads, never-stepped state too
    opt2.load_state_dict(sd)
    assert float(opt2.state_dict()["inner"]["state"][0]["step"]) == 5
    emb3, opt3 = _adam_table(2, cls)
    opt2.load_state_dict(opt3.state_dict())
    assert float(opt2.state_dict()["inner"]["state"][0]["step"]) == 0


def test_save_torch_failing_part_way_is_a_file_error(tmp_path, monkeypatch):
    emb = torch.nn.Embedding(4, 8)
    sw = gl.PytorchModelFactory(emb, 100, 8, deviceType="cpu", pinType=False)
    sw.zerosInit()
    target = tmp_path / "t.pt"
    sw.saveTorch(target)
    good = target.read_bytes()

    def full_disk(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(gl.GadgetFileError, match=r"cannot save .*t\.pt.*unexpected pos"):
        sw.saveTorch(target)
    assert target.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["t.pt"]  # no partial file left


def test_checkpoint_save_removes_partials_of_dead_saves_and_warns_on_leftovers(
    tmp_path, monkeypatch
):
    import subprocess
    import sys

    from gadgetloader.switching import _checkpoint

    emb, opt = _adam_table(0)
    _train(emb, opt, 1)
    d = tmp_path / "ck"
    gl.save_checkpoint(str(d), {"e": emb, "o": opt}, progress=False)
    first = sorted(f for f in os.listdir(d) if not f.startswith(".") and f != "meta.pt")
    token = next(f for f in first if f.startswith("e.")).split(".")[-2]
    # partial table files a killed save left: one of a process that is gone, one of a live one
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    dead = f".e.weight.{'0' * 8}.npy.partial-{dead_pid}-0123abcd"
    live = f".e.weight.{'1' * 8}.npy.partial-{os.getpid()}-0123abcd"
    for name in (dead, live):
        (d / name).write_bytes(b"\x93NUMPY half")
    _train(emb, opt, 1)
    gl.save_checkpoint(str(d), {"e": emb, "o": opt}, progress=False)
    names = os.listdir(d)
    assert dead not in names and live in names
    assert not set(first) & set(names)  # the previous checkpoint's tables are gone
    # an old table that cannot be removed once meta.pt names the new ones: a warning
    real_remove = _checkpoint._remove
    second = sorted(f for f in names if not f.startswith(".") and f != "meta.pt")

    def refuse_old(path):
        if os.path.basename(path) in second and token not in path:
            raise PermissionError(1, "Operation not permitted", path)
        real_remove(path)

    monkeypatch.setattr(_checkpoint, "_remove", refuse_old)
    _train(emb, opt, 1)
    want = _snapshot(emb, opt)
    with pytest.warns(
        UserWarning, match=r"wrote the checkpoint .* could not remove .*Operation not permitted"
    ):
        gl.save_checkpoint(str(d), {"e": emb, "o": opt}, progress=False)
    emb2, opt2 = _adam_table(5)
    gl.load_checkpoint(str(d), {"e": emb2, "o": opt2})
    got = _snapshot(emb2, opt2)
    np.testing.assert_array_equal(got[0], want[0])
    assert str(got[1]) == str(want[1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_two_threads_forking_at_once_leave_hdf5_opens_working(tmp_path, monkeypatch):
    """Two forks at once, while tables were busy in other threads: the second fork's hook
    gave up on the open lock the first one held and cleared its note of it, so the first
    never released it and every later HDF5 open waited for good."""
    from gadgetloader.io import _hdf5

    monkeypatch.setattr(_hdf5, "_FORK_WAIT_S", 0.5)
    p1, p2 = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    for p in (p1, p2):
        with h5py.File(p, "w") as f:
            f["x"] = np.arange(40, dtype=np.float32).reshape(10, 4)
    busy_src = [_hdf5.Hdf5Source(p1, dataset="x") for _ in range(2)]
    busy_until = time.monotonic() + 3.0

    def busy(src):  # a long read in another thread (simulated by holding the table's lock)
        with src._guard():
            while time.monotonic() < busy_until:
                time.sleep(0.01)

    def forker():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    threads = [threading.Thread(target=busy, args=(s,), daemon=True) for s in busy_src]
    for t in threads:
        t.start()
    time.sleep(0.1)
    with warnings.catch_warnings():  # Python 3.12+: fork of a multi-threaded process
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        forkers = [threading.Thread(target=forker, daemon=True) for _ in range(2)]
        forkers[0].start()
        time.sleep(0.2)  # the first fork's hook holds the open lock, waiting for busy tables
        forkers[1].start()
        for t in forkers:
            t.join(30)
    for t in threads:
        t.join(30)
    assert not _hdf5._OPEN_GATE[0].locked()
    out = []
    t = threading.Thread(target=lambda: out.append(_hdf5.Hdf5Source(p2, dataset="x").shape))
    t.daemon = True
    t.start()
    t.join(20)
    assert out == [(10, 4)], "opening an HDF5 file hung after two forks at once"
    for s in busy_src:
        s.close()
