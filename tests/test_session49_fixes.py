"""Session 49: sampler batches travel to DataLoader workers inline (not through shared
memory); a truncated HDF5 file is refused by a file table also for rows it has cached."""

from __future__ import annotations

import io
import os
import pickle
import warnings
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
def _h5_table(tmp_path, compression):
    h5py = pytest.importorskip("h5py")
    p = str(tmp_path / "t.h5")
    a = np.random.default_rng(1).standard_normal((1000, 4)).astype(np.float32)
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=a, chunks=(100, 4), compression=compression)
    return p, a


def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


@pytest.mark.parametrize("compression", ["gzip", None])
@pytest.mark.parametrize("forked", [False, True])
def test_truncated_hdf5_refused_for_cached_rows(tmp_path, compression, forked):
    p, a = _h5_table(tmp_path, compression)
    g = gl.DataGadget(p, placement="file")
    np.testing.assert_array_equal(g.getData(list(range(1000))).cpu().numpy(), a)
    np.testing.assert_array_equal(g.getData([950, 3]).cpu().numpy(), a[[950, 3]])  # cached
    if forked:  # a fork (a DataLoader worker) drops the parent's HDF5 handles
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    _truncate(p)
    for _ in range(2):  # for good, also for rows cached before
        with pytest.raises(gl.GadgetFileError, match="shrank from"):
            g.getData([950, 3])
    g.close()


@pytest.mark.parametrize("compression", ["gzip", None])
def test_hdf5_table_that_wrote_refuses_a_truncated_file_when_it_uses_it(tmp_path, compression):
    p, a = _h5_table(tmp_path, compression)
    g = gl.DataGadget(p, placement="file")
    ref = a.copy()
    rng = np.random.default_rng(2)
    for rows, val in (  # its own writes are no alarm
        (np.arange(900, 1000), np.zeros((100, 4), np.float32)),
        (np.arange(0, 100), rng.standard_normal((100, 4)).astype(np.float32)),
    ):
        g.insertData(torch.from_numpy(val), rows.tolist())
        ref[rows] = val
        np.testing.assert_array_equal(g.getData(list(range(1000))).cpu().numpy(), ref)
    g.close()
    g = gl.DataGadget(p, placement="file", cache_bytes=0)
    g.insertData(torch.ones(1, 4), [5])
    _truncate(p)
    with pytest.raises(gl.GadgetFileError, match="truncated"):
        g.getData([950])
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.ones(1, 4), [7])
    g.close()


# ---- a table that does not fit its placement's memory: GadgetMemoryError ----------------------
def _too_big(make):
    with pytest.raises(gl.GadgetMemoryError) as info:
        make()
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, gl.GadgetError)
    return str(err)


def test_host_table_too_big_for_ram():
    msg = _too_big(lambda: gl.DataGadget((10**12, 128), dtype="float32", placement="cpu"))
    assert "(1000000000000, 128) float32" in msg and "512,000,000,000,000 bytes" in msg
    assert "host RAM" in msg and "placement='file'" in msg
    msg = _too_big(lambda: gl.OffloadedEmbedding(10**12, 128, placement="cpu", device="cpu"))
    assert "512,000,000,000,000 bytes" in msg
    msg = _too_big(lambda: gl.DataGadget((10**11, 128), dtype="bfloat16", placement="cpu"))
    assert "bfloat16" in msg and "25,600,000,000,000 bytes" in msg
    # a table that fits is still made
    assert gl.DataGadget((4, 2), dtype="float32", placement="cpu").shape == (4, 2)


@pytest.mark.parametrize("placement", ["cpu", "pinned"])
def test_table_larger_than_the_machine_refused_before_allocating(monkeypatch, placement):
    # where the kernel overcommits, the allocation itself succeeds and zeroing or
    # page-locking the rows gets the process killed: the size is checked first
    import gadgetloader._errors as errors

    seen = []

    def fake(*, swap=True):
        seen.append(swap)
        return 1000

    monkeypatch.setattr(errors, "host_memory_bytes", fake)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)  # pinned on a machine without CUDA
        msg = _too_big(lambda: gl.DataGadget((100, 4), dtype="float32", placement=placement))
    assert "(100, 4) float32 table (1,600 bytes)" in msg and "1,000 bytes of" in msg
    assert "placement='file'" in msg
    # page-locked memory is never swapped: a pinned table is measured against RAM alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        g = gl.DataGadget((10, 4), dtype="float32", placement=placement)  # 160 bytes: made
    want_swap = g.placement == "cpu"  # (pinned falls back to cpu without CUDA)
    assert seen[-1] is want_swap
    assert ("RAM and swap" in msg) is want_swap
    assert g.shape == (10, 4) and not g.getNumpyVersion().any()
    g.close()


def test_host_memory_is_known_here():
    n = gl._errors.host_memory_bytes(swap=False)
    assert n is None or n >= 1 << 20
    m = gl._errors.host_memory_bytes()
    assert m is None or m >= n


@pytest.mark.gpu
def test_cuda_table_too_big_for_the_gpu():
    msg = _too_big(lambda: gl.DataGadget((10**12, 128), dtype="float32", placement="cuda"))
    assert "512,000,000,000,000 bytes" in msg and "placement='pinned'" in msg
    # a pinned table larger than RAM: refused before it is mapped and page-locked
    msg = _too_big(lambda: gl.DataGadget((10**11, 128), dtype="bfloat16", placement="pinned"))
    assert "25,600,000,000,000 bytes" in msg and "page-locked host RAM" in msg


# ---- messages ------------------------------------------------------------------------------------
def test_option_refused_by_the_optimizer_is_a_value_error():
    emb = gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")
    emb2 = gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    with pytest.raises(gl.GadgetValueError, match="could not build an Adam"):
        opt.add_param_group({"params": emb2, "lr": -1.0})
    sd = opt.state_dict()
    sd["inner"]["param_groups"][0]["lr"] = -1.0
    with pytest.raises(gl.GadgetValueError, match="could not build an Adam"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")
def test_switcher_id_mismatch_names_the_ids():
    model = torch.nn.Module()
    model.u = torch.nn.Embedding(4, 3)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    sw = gl.ModelFactory(model.u, 20, 3)
    sw.zerosInit()
    osw = gl.OptimizerFactory(opt, 20, 3, model, "u")
    osw.optInit()
    ids = torch.tensor([1, 2])
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    model.u(local).sum().backward()
    opt.step()
    with pytest.raises(
        gl.GadgetValueError, match=r"here 2 rows: ids \[7, 8\]; loaded 2 rows: ids \[1, 2\]"
    ):
        sw.afterOptimizerStep(torch.tensor([7, 8]))
    with pytest.raises(
        gl.GadgetValueError, match=r"here 8 rows: ids \[7, 8, 9, 10, 11, 12, \.\.\.\]"
    ):
        osw.afterOptimizerStep(torch.arange(7, 15))
    sw.afterOptimizerStep(ids)  # the right ids still go back
    osw.afterOptimizerStep(ids)


def test_dataset_with_a_reloaded_column_says_so_for_any_ids(tmp_path):
    np.save(tmp_path / "a12.npy", np.ones((12, 2), np.float32))
    col = gl.DataGadget(np.zeros((10, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(col, device="cpu")
    col.load(str(tmp_path / "a12.npy"))
    for idx in ([0, 11], [0, 1], 11, 0, torch.tensor([0, 11]), np.array([3])):
        with pytest.raises(
            gl.GadgetValueError, match="column 0 now has 12 rows but the dataset was built with 10"
        ):
            ds[idx]
    with pytest.raises(gl.GadgetValueError, match="now has 12 rows"):
        ds.__getitems__([0, 11])


# ---- command line: output paths checked before the run -------------------------------------------
@pytest.mark.parametrize("how", ["dotdot", "slash_missing", "slash_file"])
def test_json_target_refused_before_the_run(tmp_path, how, capsys):
    from gadgetloader.cli import main

    (tmp_path / "afile").write_text("x")
    target = {
        "dotdot": str(tmp_path / "nosuch" / ".." / "i.json"),
        "slash_missing": str(tmp_path / "sub") + "/",
        "slash_file": str(tmp_path / "afile") + "/",
    }[how]
    with pytest.raises(SystemExit) as info:
        main(["info", "--json", target])
    assert info.value.code == 2
    err = capsys.readouterr().err
    expect = {
        "dotdot": "no such directory",
        "slash_missing": "that directory does not exist",
        "slash_file": "is a file",
    }[how]
    assert expect in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written
