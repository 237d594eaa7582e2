"""Session 38's fixes.

- ``cpu`` tables pickle by value under every pickler, ``multiprocessing``'s included: a
  table sent to a spawned worker used to go through torch's shared memory, which moved the
  parent's rows (leaving a ``getNumpyVersion(copy=False)`` view on freed memory) and shared
  them with the worker.
- A forked child forgets the epoch orders a sampler's background thread was computing in
  the parent (that thread does not exist in the child: the child waited for it forever).
- An id past int64 is refused with a message naming the id and the valid range.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import signal
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.data import _sampler

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]


def _rows(dtype: torch.dtype, n: int = 7, d: int = 3) -> torch.Tensor:
    return (torch.arange(n * d).reshape(n, d) % 120).to(dtype)


def _forking_roundtrip(obj):
    """What a spawned worker receives: multiprocessing's pickler (with torch's reductions
    registered, as torch.multiprocessing does) and an unpickle."""
    import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions

    buf = io.BytesIO()
    ForkingPickler(buf, 2).dump(obj)
    return pickle.loads(buf.getvalue())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("how", ["forking", "pickle", "deepcopy"])
def test_cpu_table_pickles_by_value_and_leaves_the_parent_in_place(dtype, how):
    rows = _rows(dtype)
    g = gl.DataGadget(rows.clone(), placement="cpu", device="cpu")
    view = g.getNumpyVersion(copy=False)
    ptr = g.as_tensor().data_ptr()
    if how == "forking":
        copy_ = _forking_roundtrip(g)
    elif how == "pickle":
        copy_ = pickle.loads(pickle.dumps(g))
    else:
        copy_ = copy.deepcopy(g)
    # the parent's rows did not move (torch's sharing would have moved them) ...
    assert g.as_tensor().data_ptr() == ptr
    assert not g.as_tensor().is_shared()
    # ... and the copy is its own table with the same rows, dtype and shape
    got = copy_.as_tensor()
    assert got.dtype == dtype and tuple(got.shape) == tuple(rows.shape)
    assert torch.equal(got, rows)
    assert not got.is_shared()
    copy_.insertData(torch.full((1, 3), 9).to(dtype), [2])
    assert torch.equal(g.as_tensor(), rows)  # the copy's write stays there
    g.insertData(torch.full((1, 3), 5).to(dtype), [0])
    want = rows.clone()
    want[0] = 5
    assert torch.equal(copy_.getData([0], device="cpu"), rows[:1])
    if dtype != torch.bfloat16:  # (NumPy has no bfloat16: getNumpyVersion refuses it)
        np.testing.assert_array_equal(view, want.numpy())
    copy_.close()
    g.close()


def test_closed_cpu_table_pickles_as_closed():
    g = gl.DataGadget(_rows(torch.float32), placement="cpu", device="cpu")
    g.close()
    for c in (_forking_roundtrip(g), copy.deepcopy(g)):
        with pytest.raises(gl.GadgetClosedError):
            c.getData([0])


def test_table_interleaved_with_optimizer_state_pickles_by_value():
    """A table that shares one buffer with its optimizer state (built by the optimizer)
    pickles as an ordinary cpu table of its own rows, also through multiprocessing."""
    from gadgetloader.stores import SlotStore

    emb = gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    table = emb.weight
    assert isinstance(table.store, SlotStore)
    emb(torch.tensor([1, 2, 2, 5])).sum().backward()
    opt.step()
    before = table.as_tensor().clone()
    for c in (_forking_roundtrip(table), copy.deepcopy(table)):
        assert not isinstance(c.store, SlotStore)
        assert torch.equal(c.as_tensor(), before)
        assert c.as_tensor().is_contiguous()
        c.insertData(torch.zeros(1, 4), [1])
        assert torch.equal(table.as_tensor(), before)
    emb(torch.tensor([3])).sum().backward()  # the original still trains
    opt.step()
    assert not torch.equal(table.as_tensor()[3], before[3])


def test_forked_child_forgets_orders_its_parent_was_computing():
    s = gl.GadgetSampler(1000, batch_size=100, seed=4)
    want = s.epoch_order(1).clone()
    # an order another thread of the parent was making when the fork came: in the child
    # that thread is gone, so the future never completes
    with s._lock:
        s._orders[1] = Future()
    held = s._lock
    held.acquire()  # and a lock that thread held at the fork
    try:
        _sampler._forget_orders_in_child()  # what the at-fork hook runs in the child
        assert s._orders == {}
        assert s._lock is not held
        assert torch.equal(s.epoch_order(1), want)  # computed again, the same
    finally:
        held.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sampler_in_a_forked_child_with_an_order_pending():
    """End to end: a sampler whose next epoch's order is still pending at the fork gives
    the child every row once per epoch."""
    s = gl.GadgetSampler(1000, batch_size=250, seed=5)
    fut: Future = Future()  # a background order that will not finish before the fork
    with s._lock:
        s._orders[1] = fut
    want = [s.epoch_order(0).clone(), None]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            signal.alarm(30)  # a child left waiting for the parent's thread dies instead
            os.close(r)
            s.set_epoch(1)
            got = torch.cat(list(s))
            ok = sorted(got.tolist()) == list(range(1000))
            os.write(w, b"ok" if ok else b"bad")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert msg == b"ok"
    fut.set_result(torch.randperm(1000))  # the parent's own thread would finish it
    assert torch.equal(torch.cat(list(s)), want[0])


@pytest.mark.parametrize(
    "ids, shown",
    [([1, 2**63], 2**63), (2**70, 2**70), (np.array([2**64 - 1], dtype=np.uint64), 2**64 - 1)],
)
def test_ids_past_int64_name_the_id_and_the_range(ids, shown):
    g = gl.DataGadget(np.ones((10, 2), np.float32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetIndexError, match=rf"id {shown} is out of range.*\[0, 2\*\*63-1\]"):
        g.getData(ids)
    with pytest.raises(gl.GadgetIndexError, match=rf"id {shown}"):
        g.insertData(np.zeros((1, 2), np.float32), ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.ones((10, 2), np.float32))


def test_chunk_reads_end_before_a_failed_call_returns(monkeypatch):
    """A chunk that fails to read (a truncated file) ends the call only once every other
    reading thread has stopped: none may go on writing into the caller's buffer, or
    reading a descriptor the caller closes, after the call has raised."""
    import threading
    import time

    from gadgetloader.io import _chunks

    monkeypatch.setattr(_chunks, "_concurrency", lambda nbytes: 4)
    lock = threading.Lock()
    running = [0]
    calls = []

    def fn(k: int, s: int) -> None:
        with lock:
            running[0] += 1
            calls.append(k)
        try:
            if k == 0:
                raise gl.GadgetFileError("chunk 0 is cut short")
            time.sleep(0.02)
        finally:
            with lock:
                running[0] -= 1

    n = 64
    with pytest.raises(gl.GadgetFileError, match="chunk 0"):
        _chunks.for_each_chunk(fn, list(range(n)), list(range(n)), chunk_nbytes=1 << 20)
    assert running[0] == 0
    settled = len(calls)
    time.sleep(0.1)
    assert len(calls) == settled  # nothing started after the call returned
    assert settled < n  # the failure stopped the other threads early


def test_chunk_reads_all_run_when_none_fails(monkeypatch):
    from gadgetloader.io import _chunks

    monkeypatch.setattr(_chunks, "_concurrency", lambda nbytes: 4)
    out = np.zeros(64, np.int64)

    def fn(k: int, s: int) -> None:
        out[s] = k + 1

    _chunks.for_each_chunk(fn, list(range(64)), list(range(63, -1, -1)), chunk_nbytes=1 << 20)
    np.testing.assert_array_equal(out, np.arange(64, 0, -1))
