"""Session 40's fixes.

- A thread's page-locked id pair (range checks, the gather's bad-id flag) outlives the
  thread: a thread may end with a check unfinished while the GPU's write into the pair,
  through a CUDA alias torch does not know of, is still queued. The pair goes to a spare
  list instead of back to torch's allocator, and the next thread that takes it first
  waits for the devices it is mapped into.
- A failed zarr read or write waits for zarr's other chunk tasks however long they take
  (it used to give up after 60 s and return while they still wrote into the buffer),
  warning while it waits.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader import _ids


def _in_thread(fn):
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


def test_an_ended_threads_pair_is_kept_and_reused_after_its_devices_are_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[torch.Tensor] = []

    def fake_pinned(n, dtype):
        made.append(torch.zeros(n, dtype=dtype))
        return made[-1]

    synced: list[int] = []
    monkeypatch.setattr(_ids, "pinned_empty", fake_pinned)
    monkeypatch.setattr(_ids, "_SPARE", [])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: synced.append(index))

    def first():
        pair = _ids._this_pair()
        pair.mapped[3] = (pair.buf[0], pair.buf[1])  # (as if aliased on device 3)
        pair.mapped[5] = None  # (a device it is not mapped into: nothing to wait for)
        return pair

    pair = _in_thread(first)
    assert len(made) == 1
    assert [pair] == _ids._SPARE  # kept, not freed, when its thread ended
    assert synced == []
    # the next thread takes it, once the device with its alias has finished its work
    again = _in_thread(lambda: _ids._this_pair())
    assert again is pair and len(made) == 1 and synced == [3]
    assert [pair] == _ids._SPARE  # and it is spare again
    # two threads at once: the second one gets a new pair
    ready, go = threading.Barrier(2), threading.Event()
    got: list = []

    def hold():
        got.append(_ids._this_pair())
        ready.wait()
        go.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    while len(got) < 2:
        time.sleep(0.01)
    go.set()
    for t in threads:
        t.join()
    assert got[0] is not got[1] and pair in got and len(made) == 2
    assert sorted(map(id, _ids._SPARE)) == sorted(map(id, got))
    # a thread's own pair is the same at every call
    assert _in_thread(lambda: _ids._this_pair() is _ids._this_pair())


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_thread_ending_with_a_check_unfinished_leaves_its_pair_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = torch.randint(0, 1000, (1 << 20,), device="cuda")
    # no spare pair from an earlier test in this process: the first thread makes its own
    # (with one there, it took that one and the count did not grow: a flaky failure)
    monkeypatch.setattr(_ids, "_SPARE", [])
    before = len(_ids._SPARE)

    def start_and_leave():
        check = _ids.start_range_check(ids, 1000)  # never finished
        pair = _ids._this_pair()
        assert pair.mapped.get(ids.device.index) is not None  # the aliased form
        return pair, check

    pair, check = _in_thread(start_and_leave)
    del check
    assert len(_ids._SPARE) == before + 1 and _ids._SPARE[-1] is pair
    ptr = pair.buf.data_ptr()

    def next_thread():
        p = _ids._this_pair()
        bad = ids.clone()
        bad[7] = 1000
        with pytest.raises(gl.GadgetIndexError, match="id 1000 is out of range"):
            _ids.start_range_check(bad, 1000)()
        _ids.start_range_check(ids, 1000)()  # passes
        return p

    assert _in_thread(next_thread) is pair and pair.buf.data_ptr() == ptr
    assert pair.buf.tolist() == [int(ids.min()), int(ids.max())]


zarr = pytest.importorskip("zarr", minversion="3")


def test_a_failed_zarr_read_waits_for_slow_chunk_tasks_past_the_warning_time(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from zarr.codecs import BytesCodec, Crc32cCodec

    from gadgetloader.io import _zarr
    from gadgetloader.io._zarr import ZarrSource

    data = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    path = tmp_path / "c.zarr"
    z = zarr.create_array(
        str(path),
        shape=data.shape,
        chunks=(4, 8),
        dtype="float32",
        serializer=BytesCodec(),
        compressors=[Crc32cCodec()],
    )
    z[:] = data
    with open(os.path.join(str(path), "c", "0", "0"), "r+b") as f:  # chunk 0's checksum fails
        f.seek(3)
        f.write(b"\xff\xff\xff")
    original = Crc32cCodec._decode_single
    done: list[float] = []

    async def slow(self, chunk_bytes, chunk_spec):
        out = await original(self, chunk_bytes, chunk_spec)
        await asyncio.sleep(0.6)
        done.append(time.monotonic())
        return out

    monkeypatch.setattr(Crc32cCodec, "_decode_single", slow)
    monkeypatch.setattr(_zarr, "_DRAIN_S", 0.2)  # (60 s in use)
    src = ZarrSource(str(path))
    out = np.zeros_like(data)
    with (
        pytest.warns(RuntimeWarning, match="chunk tasks of a failed call are still running") as rec,
        pytest.raises(gl.GadgetFileError, match="cannot read rows 0:16"),
    ):
        src.read_into(0, 16, out)
    returned = time.monotonic()
    seen = out.copy()
    assert "after 0.2 s" in str(rec[0].message)
    time.sleep(0.8)
    assert len(done) == 3 and max(done) <= returned  # all waited for, past the warning time
    np.testing.assert_array_equal(out, seen)
    np.testing.assert_array_equal(out[4:], data[4:])
