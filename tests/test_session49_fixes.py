"""Session 49: sampler batches travel to DataLoader workers inline (not through shared
memory); a truncated HDF5 file is refused by a file table also for rows it has cached."""

from __future__ import annotations

import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader.data._sampler import _as_batch


def _dumps(obj):
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


@pytest.mark.parametrize("batch_size", [1, 7, 4096])
def test_batch_goes_through_a_queue_inline(batch_size):
    s = gl.GadgetSampler(100_000, batch_size=batch_size, seed=3)
    b = next(iter(s))
    blob = _dumps(b)
    # the ids themselves are in the message (8 bytes each), and nothing was moved into
    # shared memory for them
    assert b.numpy().tobytes() in blob
    assert not b.untyped_storage().is_shared()
    back = ForkingPickler.loads(blob)
    assert type(back) is torch.Tensor and back.dtype == torch.int64
    assert not back.untyped_storage().is_shared()
    assert torch.equal(back, b)
    back[0] = -1  # a copy of its own, writable
    assert int(b[0]) != -1


def test_shapes_and_strided_views_keep_their_values():
    base = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    for t in (base, base[:, ::2], base.t(), base[1:3]):
        back = ForkingPickler.loads(_dumps(_as_batch(t)))
        assert back.shape == t.shape
        assert torch.equal(back, t)


def test_other_dtypes_fall_back_to_torch():
    t = _as_batch(torch.arange(6, dtype=torch.int32))
    back = ForkingPickler.loads(_dumps(t))
    assert back.dtype == torch.int32 and torch.equal(back, t)


def test_torch_save_still_writes_a_plain_tensor():
    b = next(iter(gl.GadgetSampler(1000, batch_size=10, seed=0)))
    buf = io.BytesIO()
    torch.save(b, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back) is torch.Tensor and torch.equal(back, b)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_receive_the_sampler_batches(context):
    a = np.arange(200 * 3, dtype=np.float32).reshape(200, 3)
    ds = gl.GadgetDataset(a, np.arange(200), placement="cpu", device="cpu")

    def batches(workers):
        kw = {"multiprocessing_context": context} if workers else {}
        dl = DataLoader(
            ds, batch_sampler=gl.GadgetSampler(ds, batch_size=16, seed=5), num_workers=workers, **kw
        )
        return [(x.clone(), y.clone()) for x, y in dl]

    ref = batches(0)
    got = batches(2)
    assert len(got) == len(ref) == 13
    for (x0, y0), (x1, y1) in zip(ref, got, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
        np.testing.assert_array_equal(x1.numpy(), a[y1.numpy()])


# ---- HDF5 file tables: a truncated file is refused even when the rows are cached ------------
@pytest.mark.parametrize("compression", ["gzip", None])
@pytest.mark.parametrize("wrote", [False, True])
def test_truncated_hdf5_refused_for_cached_rows(tmp_path, compression, wrote):
    h5py = pytest.importorskip("h5py")
    p = str(tmp_path / "t.h5")
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1000, 4)).astype(np.float32)
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=a, chunks=(100, 4), compression=compression)
    g = gl.DataGadget(p, placement="file")
    ref = a.copy()
    if wrote:  # the table's handle is open for writing: its own writes are no alarm
        for rows, val in (
            (np.arange(900, 1000), np.zeros((100, 4), np.float32)),
            (np.arange(0, 100), rng.standard_normal((100, 4)).astype(np.float32)),
        ):
            g.insertData(torch.from_numpy(val), rows.tolist())
            ref[rows] = val
    np.testing.assert_array_equal(g.getData(list(range(1000))).numpy(), ref)
    np.testing.assert_array_equal(g.getData([950, 3]).numpy(), ref[[950, 3]])  # cached
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    for _ in range(2):  # for good, also for rows cached before
        with pytest.raises(gl.GadgetFileError, match="shr|shorter"):
            g.getData([950, 3])
    g.close()
