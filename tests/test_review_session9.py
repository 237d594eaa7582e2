"""Defects found in session 9, each with a test that failed before its fix."""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

h5py = pytest.importorskip("h5py")

_FORK = "fork" in mp.get_all_start_methods()


@pytest.mark.skipif(not _FORK, reason="needs the fork start method")
def test_fork_while_another_thread_reads_an_hdf5_table(tmp_path):
    # A thread reading the file while DataLoader forks its workers used to leave the file
    # open in the child's copy of HDF5, and the worker's own (unlocked) open failed with
    # "file locking flag values don't match".
    n, width = 20_000, 8
    data = np.arange(n * width, dtype=np.float32).reshape(n, width)
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(512, width))
    g = gl.DataGadget(str(path), dataset="x", placement="file")
    rng = np.random.default_rng(0)
    g.getData(rng.integers(0, n, 100))  # first use (imports) before any thread starts
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        r = np.random.default_rng(1)
        try:
            while not stop.is_set():
                ids = r.integers(0, n, 3000)
                got = g.getData(ids).cpu().numpy()
                np.testing.assert_array_equal(got, data[ids])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        ds = gl.GadgetDataset(g)
        for epoch in range(8):
            loader = DataLoader(
                ds,
                batch_size=1000,
                shuffle=True,
                num_workers=2,
                multiprocessing_context="fork",
                timeout=120,
            )
            seen = []
            for (batch,) in loader:
                seen.append(batch.cpu().numpy())
            rows = np.concatenate(seen)
            order = np.argsort(rows[:, 0])
            np.testing.assert_array_equal(rows[order], data, err_msg=f"epoch {epoch}")
    finally:
        stop.set()
        th.join(30)
    assert not errors, errors


# ---- tables and ids ------------------------------------------------------------------------


def test_loading_a_parameter_leaves_the_table_out_of_autograd(tmp_path):
    model = torch.nn.Embedding(4, 2)
    sw = gl.PytorchModelFactory(model, 4, 2, deviceType="cpu")
    path = tmp_path / "w.pt"
    torch.save(torch.nn.Parameter(torch.ones(4, 2)), path)
    sw.loadTorch(str(path))
    np.testing.assert_array_equal(sw.getNumpyVersion(), np.ones((4, 2), np.float32))
    emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb.load_state_dict({"weight": torch.nn.Parameter(torch.full((4, 2), 2.0))})
    assert not emb.state_dict()["weight"].requires_grad
    np.testing.assert_array_equal(emb.table.getNumpyVersion(), np.full((4, 2), 2, np.float32))
    gl.save_checkpoint(tmp_path / "ck", {"m": emb, "o": opt})  # raised a raw RuntimeError


@pytest.mark.parametrize(
    ("dtype", "value", "error"),
    [
        (np.uint8, -1, gl.GadgetValueError),
        (np.uint8, 2.7, gl.GadgetValueError),
        (np.uint8, 300, gl.GadgetValueError),
        (np.int8, float("nan"), gl.GadgetValueError),
        (np.bool_, 2, gl.GadgetValueError),
        (np.float16, 1e5, gl.GadgetValueError),
        (np.float32, "1", gl.GadgetTypeError),
        (np.float32, [1.0], gl.GadgetTypeError),
    ],
)
def test_fill_refuses_values_the_dtype_cannot_hold(dtype, value, error):
    g = gl.DataGadget(np.arange(3).astype(dtype), placement="cpu")
    before = g.getNumpyVersion().copy()
    with pytest.raises(error, match="fill_"):
        g.fill_(value)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [
        (np.uint8, 255, 255),
        (np.uint8, 2.0, 2),
        (np.bool_, True, True),
        (np.float16, float("inf"), np.inf),
    ],
)
def test_fill_takes_values_the_dtype_holds(dtype, value, expected):
    g = gl.DataGadget(np.zeros(3, dtype), placement="cpu")
    g.fill_(value)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.full(3, expected, dtype))


def test_an_initializer_that_changes_shape_leaves_the_table_usable():
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(data, placement="cpu")
    g.init_(torch.Tensor.t_)
    np.testing.assert_array_equal(g.getData([0, 3]).cpu().numpy(), data[[0, 3]])


def test_sparse_id_tensors_are_a_type_error():
    g = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu")
    ids = torch.tensor([1]).to_sparse()
    with pytest.raises(gl.GadgetTypeError, match="dense"):
        g.getData(ids)
    with pytest.raises(gl.GadgetTypeError, match="dense"):
        g.insertData(torch.ones(1, 3), ids)
    with pytest.raises(gl.GadgetTypeError, match="dense"):
        gl.GadgetDataset(g)[ids]
    assert not g.getNumpyVersion().any()


def test_a_table_too_large_for_any_allocation_is_a_value_error():
    with pytest.raises(gl.GadgetValueError, match="bytes"):
        gl.DataGadget((2**62, 4), placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="bytes"):
        gl.OffloadedEmbedding(2**62, 4, placement="cpu", device="cpu")


def test_out_that_requires_grad_is_refused():
    g = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="require grad"):
        g.getData([1], out=torch.empty(1, 3, device=g.getData([0]).device, requires_grad=True))


# ---- training --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int32", "bool", torch.int64])
@pytest.mark.parametrize("factory", ["OptimizerFactory", "PytorchOptimizerFactory"])
def test_optimizer_factories_refuse_state_tables_that_cannot_hold_it(factory, dtype):
    model = torch.nn.Module()
    model.u = torch.nn.Embedding(2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    kw = {"CPUPinn": True} if factory == "OptimizerFactory" else {"deviceType": "cpu"}
    with pytest.raises(gl.GadgetTypeError, match="floating point"):
        getattr(gl, factory)(opt, 10, 4, model, "u", dtype=dtype, **kw)


def test_adagrad_sum_starts_from_the_constructors_value_as_torch_does():
    ref = torch.nn.Parameter(torch.zeros(4, 2))
    ref_opt = torch.optim.Adagrad(
        [{"params": [ref], "initial_accumulator_value": 0.5}], lr=0.1, initial_accumulator_value=0.1
    )
    emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu", init=torch.nn.init.zeros_)
    opt = gl.OffloadedOptimizer(
        torch.optim.Adagrad,
        [{"params": emb, "initial_accumulator_value": 0.5}],
        lr=0.1,
        initial_accumulator_value=0.1,
    )
    np.testing.assert_allclose(opt.pagers[0].tables["sum"].getNumpyVersion(), 0.1)
    grad = torch.tensor([[1.0, 2.0]])
    ref.grad = torch.zeros(4, 2)
    ref.grad[1] = grad
    ref_opt.step()
    opt.zero_grad()
    (emb(torch.tensor([1])) * grad).sum().backward()
    opt.step()
    np.testing.assert_array_equal(emb.table.getNumpyVersion()[1], ref.detach().numpy()[1])


def test_nadam_float64_resumes_bit_identically(tmp_path):
    def build():
        torch.manual_seed(0)
        emb = gl.OffloadedEmbedding(20, 3, placement="cpu", device="cpu", dtype=torch.float64)
        return emb, gl.OffloadedOptimizer(torch.optim.NAdam, emb, lr=0.01)

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 20, (6,), generator=g) for _ in range(6)]

    def train(emb, opt, bs):
        for ids in bs:
            opt.zero_grad()
            (emb(ids) ** 2).sum().backward()
            opt.step()

    full = build()
    train(*full, batches)
    part = build()
    train(*part, batches[:3])
    gl.save_checkpoint(tmp_path / "ck", {"m": part[0], "o": part[1]})
    sd = part[1].state_dict()
    for load in ("checkpoint", "state_dict"):
        resumed = build()
        if load == "checkpoint":
            gl.load_checkpoint(tmp_path / "ck", {"m": resumed[0], "o": resumed[1]})
        else:
            resumed[0].load_state_dict(part[0].state_dict())
            resumed[1].load_state_dict(sd)
        train(*resumed, batches[3:])
        np.testing.assert_array_equal(
            resumed[0].table.getNumpyVersion(), full[0].table.getNumpyVersion(), err_msg=load
        )


def test_offloaded_optimizer_given_an_instance_says_it_takes_a_class():
    emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")
    inst = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(gl.GadgetTypeError, match="optimizer class"):
        gl.OffloadedOptimizer(inst, emb)


# ---- pipeline --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option", [{"order": "random"}, {"seed": 0}, {"drop_last": False}, {"pad": False}]
)
def test_loader_refuses_sampler_options_beside_a_sampler_even_at_their_defaults(option):
    ds = gl.GadgetDataset(np.arange(20, dtype=np.float32), placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=5, order="sequential")
    with pytest.raises(gl.GadgetValueError, match="ignored"):
        gl.GadgetLoader(ds, sampler=s, **option)


def test_a_refused_loader_state_leaves_the_resume_position():
    ds = gl.GadgetDataset(np.arange(100, dtype=np.float32), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=10, coalesce=4, order="sequential")
    it = iter(loader)
    next(it)
    good = loader.state_dict()
    bad = {"sampler": {**good["sampler"], "batch_size": 7}}
    with pytest.raises(gl.GadgetValueError):
        loader.load_state_dict(bad)
    assert loader.state_dict() == good
    resumed = gl.GadgetLoader(ds, batch_size=10, coalesce=4, order="sequential")
    resumed.load_state_dict(loader.state_dict())
    assert next(iter(resumed))[0][0].item() == 10.0


def test_a_refused_loader_epoch_leaves_the_resume_position():
    ds = gl.GadgetDataset(np.arange(100, dtype=np.float32), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=10, coalesce=4, order="sequential")
    it = iter(loader)
    next(it)
    good = loader.state_dict()
    with pytest.raises(gl.GadgetValueError):
        loader.set_epoch(-1)
    assert loader.state_dict() == good


def test_chunk_order_reads_each_chunk_once_with_columns_of_different_chunkings(tmp_path):
    zarr = pytest.importorskip("zarr")
    n, d = 3000, 4
    data = np.arange(n * d, dtype=np.float32).reshape(n, d)
    paths = []
    for name, chunk in (("a", 96), ("b", 64)):
        z = zarr.open(
            str(tmp_path / f"{name}.zarr"),
            mode="w",
            shape=data.shape,
            chunks=(chunk, d),
            dtype="float32",
        )
        z[:] = data
        paths.append(str(tmp_path / f"{name}.zarr"))
    ds = gl.GadgetDataset(*paths, placement="file", cache_bytes=2 * 2 * 192 * d * 4, device="cpu")
    assert ds.chunk_rows == 192  # both chunkings line up with it
    s = gl.GadgetSampler(ds, batch_size=50, order="chunk", window_chunks=2, seed=0)
    seen = np.concatenate([b[1].numpy() for b in gl.GadgetLoader(ds, sampler=s)])
    np.testing.assert_array_equal(np.sort(seen[:, 0]), data[:, 0])
    for g in ds.columns:
        assert g.store.stats["misses"] == -(-n // g.store.block_rows)


# ---- rows that alias the table, and the CPU beside queued GPU work ------------------------


@pytest.mark.parametrize("strategy", ["auto", "kernel", "sorted", "torch"])
def test_scatter_of_the_tables_own_rows_reads_them_all_first(placement, strategy):
    n = 5000
    data = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    g = gl.DataGadget(data, placement=placement, strategy=strategy)
    view = g.as_tensor()
    g.insertData(view[0 : n - 1], torch.arange(1, n))  # shift every row down by one
    want = data.copy()
    want[1:] = data[:-1]
    np.testing.assert_array_equal(g.getNumpyVersion(), want)


@pytest.mark.parametrize("strategy", ["auto", "kernel", "sorted", "torch"])
def test_gather_into_the_tables_own_rows_reads_them_all_first(placement, strategy):
    n = 5000
    data = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    g = gl.DataGadget(data, placement=placement, strategy=strategy)
    view = g.as_tensor()
    g.getData(torch.arange(0, n - 1), device=view.device, out=view[1:n])
    want = data.copy()
    want[1:] = data[:-1]
    np.testing.assert_array_equal(g.getNumpyVersion(), want)


@pytest.mark.gpu
def test_cpu_reads_and_writes_of_a_pinned_table_follow_queued_gpu_writes():
    pytest.importorskip("cupy")
    n, d = 1 << 16, 64
    g = gl.DataGadget(np.zeros((n, d), np.float32), placement="pinned")
    ids = torch.arange(0, n, 7)
    for _ in range(3):
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # keep the stream busy so the scatter below stays queued
            busy = busy @ busy / 4096
        g.insertData(torch.full((ids.numel(), d), 1.0, device="cuda"), ids)
        got = g.getData(ids, device="cpu")  # CPU ids, CPU rows: the host path
        assert bool((got == 1.0).all())
        for _ in range(20):
            busy = busy @ busy / 4096
        g.insertData(torch.full((ids.numel(), d), 2.0, device="cuda"), ids)
        g.insertData(torch.full((ids.numel(), d), 3.0), ids)  # CPU rows: the later write wins
        torch.cuda.synchronize()
        assert bool((g.getData(ids, device="cpu") == 3.0).all())
        g.insertData(torch.zeros((ids.numel(), d)), ids)


# ---- a review of those fixes -------------------------------------------------------------


def test_fill_takes_the_whole_range_of_wide_floats_and_refuses_past_narrow_ones():
    g = gl.DataGadget(np.zeros(3, np.float64), placement="cpu")
    g.fill_(1e300)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.full(3, 1e300))
    h = gl.DataGadget(np.zeros(3, np.float16), placement="cpu")
    for bad in (65505.0, 10**400):
        with pytest.raises(gl.GadgetValueError, match="overflows"):
            h.fill_(bad)
    h.fill_(np.array([2.5]))  # one element, any shape
    np.testing.assert_array_equal(h.getNumpyVersion(), np.full(3, 2.5, np.float16))


def test_out_that_requires_grad_is_filled_under_no_grad():
    g = gl.DataGadget(np.arange(6, dtype=np.float32).reshape(3, 2), placement="cpu")
    dev = g.getData([0]).device
    out = torch.nn.Parameter(torch.zeros(1, 2, device=dev))
    with torch.no_grad():
        g.getData([2], out=out)
    np.testing.assert_array_equal(out.detach().cpu().numpy(), [[4.0, 5.0]])


def test_scatter_many_reads_rows_aliasing_another_table_before_writing():
    a = gl.DataGadget(torch.arange(8.0).reshape(4, 2), placement="cpu")
    b = gl.DataGadget(torch.zeros(4, 2), placement="cpu")
    gl.scatter_many([a, b], [torch.full((2, 2), -1.0), a.as_tensor()[0:2]], [0, 1])
    np.testing.assert_array_equal(b.getNumpyVersion()[:2], [[0.0, 1.0], [2.0, 3.0]])


def test_saved_scalar_dtypes_follow_the_saved_parameter_ids():
    from gadgetloader.switching._optim import keep_saved_scalar_dtypes

    a = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.NAdam([a, b])
    for p in (a, b):
        p.grad = torch.ones(2, dtype=torch.float64)
    opt.step()
    sd = opt.state_dict()
    renumbered = {
        "state": {
            0: dict(sd["state"][1], mu_product=torch.tensor(0.25)),
            1: dict(sd["state"][0], mu_product=torch.tensor(0.5)),
        },
        "param_groups": [dict(sd["param_groups"][0], params=[1, 0])],
    }
    again = torch.optim.NAdam([a, b])
    again.load_state_dict(renumbered)
    keep_saved_scalar_dtypes(again, renumbered)
    got = [
        (again.state[p]["mu_product"].item(), again.state[p]["mu_product"].dtype) for p in (a, b)
    ]
    assert got == [(0.5, torch.float32), (0.25, torch.float32)]


def test_an_axis_longer_than_int64_is_a_value_error():
    with pytest.raises(gl.GadgetValueError, match="2\\*\\*63"):
        gl.DataGadget((0, 2**70), placement="cpu")


def test_chunk_order_keeps_the_largest_chunk_where_the_common_multiple_is_large(tmp_path):
    zarr = pytest.importorskip("zarr")
    paths = []
    for name, chunk in (("a", 96), ("b", 100)):
        z = zarr.open(
            str(tmp_path / f"{name}.zarr"),
            mode="w",
            shape=(1000, 2),
            chunks=(chunk, 2),
            dtype="float32",
        )
        z[:] = 0
        paths.append(str(tmp_path / f"{name}.zarr"))
    assert gl.GadgetDataset(*paths, placement="file", device="cpu").chunk_rows == 100


@pytest.mark.skipif(not _FORK, reason="needs os.fork")
def test_a_fork_during_chunked_hdf5_reads_never_breaks_them(tmp_path):
    # the fork hook closes the file between two guarded steps of a read, which then used
    # the closed dataset handle (raw h5py errors, ~5% of reads)
    import os
    import time

    path = tmp_path / "t.h5"
    data = np.random.default_rng(0).random((20_000, 16)).astype(np.float32)
    with h5py.File(path, "w") as f:  # 20,000 % 256 != 0: a partial last chunk
        f.create_dataset("data", data=data, chunks=(256, 16), compression="gzip")
    g = gl.DataGadget(str(path), placement="file", cache_bytes=0)
    stop = threading.Event()
    errors: list[str] = []
    calls = [0]

    def reader() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            ids = rng.integers(0, 20_000, 64)
            try:
                np.testing.assert_array_equal(g.getData(ids).cpu().numpy(), data[ids])
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                errors.append(f"{type(exc).__name__}: {exc}")
            calls[0] += 1

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    time.sleep(0.2)
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.03)
    stop.set()
    th.join(30)
    assert calls[0] > 20
    assert not errors, errors[:3]


def test_the_fork_hook_survives_a_broken_source_and_releases_every_lock(tmp_path):
    from gadgetloader.io import _hdf5

    paths = []
    for name in ("a", "b"):
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            f.create_dataset("d", data=np.zeros((4, 2), np.float32))
        paths.append(str(tmp_path / f"{name}.h5"))
    good = gl.DataGadget(paths[0], placement="file")
    bad = gl.DataGadget(paths[1], placement="file")
    good.getData([1])
    bad.getData([1])
    broken = bad.store._source()
    del broken._lock  # as a source caught half-built by the fork
    try:
        _hdf5._before_fork()
        _hdf5._after_fork_in_parent()
    finally:
        broken._lock = threading.RLock()
    lock = good.store._source()._guard()
    assert lock.acquire(timeout=1)
    lock.release()
    np.testing.assert_array_equal(good.getData([1]).cpu().numpy(), [[0.0, 0.0]])


@pytest.mark.gpu
def test_auto_measures_sorted_against_hybrid_once_and_keeps_the_rows_exact():
    pytest.importorskip("cupy")
    from gadgetloader.transfer import _engine

    rows, width = 8 << 20, 128  # 4 GB: sparse requests go to hybrid or sorted
    g = gl.DataGadget((rows, width), dtype="float32", placement="pinned")
    try:
        host = g.store.host_view()
        host[:, 0] = torch.arange(rows, dtype=torch.float32)
        ids = torch.randint(0, rows, (70_000,), device="cuda")
        before = dict(_engine._TUNED)
        first = g.getData(ids)
        tuned = {k: v for k, v in _engine._TUNED.items() if k not in before}
        assert len(tuned) == 1 and set(tuned.values()) <= {"hybrid", "sorted"}
        second = g.getData(ids)
        want = ids.to(torch.float32)
        assert torch.equal(first[:, 0], want) and torch.equal(second[:, 0], want)
        assert dict(_engine._TUNED) == {**before, **tuned}  # measured once
    finally:
        g.close()


# ---- auto's measured choice between sorted and hybrid (CuPy and CUDA simulated) -------------


@pytest.fixture
def simulated_engine(monkeypatch):
    """``auto`` sends every request to its sorted/hybrid trial; the two strategies are CPU
    stand-ins of which ``sorted`` takes less time on a simulated clock; records every run."""
    import types

    from gadgetloader.transfer import _engine, _kernels

    runs: list[str] = []
    clock = [0.0]
    took = {"hybrid": 0.010, "sorted": 0.002}

    def fake_hybrid(table, host, flat, out):
        runs.append("hybrid")
        clock[0] += took["hybrid"]
        torch.index_select(host, 0, flat.cpu(), out=out)

    def fake_launch(tables, ids, outs, pos=None, count=None, **kw):
        runs.append("sorted")
        clock[0] += took["sorted"]
        tables = tables if isinstance(tables, list) else [tables]
        outs = outs if isinstance(outs, list) else [outs]
        n = ids.numel() if count is None else int(count)
        for t, o in zip(tables, outs, strict=True):
            if pos is None:
                o[:n] = t[ids[:n]]
                o[n:] = 0
            else:
                o[pos] = t[ids]

    monkeypatch.setattr(_engine, "cupy_available", lambda: True)
    monkeypatch.setattr(_engine, "_gpu_addressable", lambda t: True)  # CPU stand-ins
    monkeypatch.setattr(_engine, "SORT_ABOVE_BYTES", 0)
    monkeypatch.setattr(_engine, "HYBRID_GAP_BYTES", 0)
    monkeypatch.setattr(_engine, "HYBRID_MIN_IDS", 1)
    monkeypatch.setattr(_engine, "_hybrid_gather", fake_hybrid)
    monkeypatch.setattr(_kernels, "launch_gather", fake_launch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(_engine, "_TUNED", {})
    monkeypatch.setattr(_engine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return _engine, runs


def test_auto_trial_runs_once_per_class_and_later_requests_follow_it(simulated_engine):
    engine, runs = simulated_engine
    table = torch.randn(50_000, 8)
    ids = torch.randint(0, 50_000, (3000,))
    got = engine.gather_many([table], ids, None, "auto", [table])[0]
    assert torch.equal(got, table[ids])
    assert sorted(runs) == ["hybrid"] * 4 + ["sorted"] * 4
    assert list(engine._TUNED.values()) == ["sorted"]
    runs.clear()
    assert torch.equal(engine.gather_many([table], ids, None, "auto", [table])[0], table[ids])
    assert runs == ["sorted"]
    plan = ids.unique()  # count-limited requests of sorted ids: a class of their own
    count = torch.tensor([plan.numel() - 5])
    for trial in (True, False):
        runs.clear()
        got = engine.gather_many(
            [table], plan, None, "auto", [table], ids_sorted=True, count=count
        )[0]
        assert torch.equal(got[: plan.numel() - 5], table[plan[:-5]]) and not got[-5:].any()
        assert len(runs) == (8 if trial else 1)
    assert runs == ["sorted"]


def test_auto_trial_classes_follow_the_hybrid_share_and_threads_share_one_trial(simulated_engine):
    engine, runs = simulated_engine
    table = torch.randn(50_000, 8)
    ids = torch.randint(0, 50_000, (3000,))
    barrier = threading.Barrier(2)

    def work():
        barrier.wait()
        engine.gather_many([table], ids, None, "auto", [table])

    threads = [threading.Thread(target=work) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(runs) == 9  # one trial (8 runs) and one run of its choice
    old = engine._hybrid["fraction"]
    try:
        engine.set_hybrid_fraction(0.3)
        runs.clear()
        engine.gather_many([table], ids, None, "auto", [table])
        assert len(runs) == 8  # another class: measured again
    finally:
        engine.set_hybrid_fraction(old)


@pytest.mark.parametrize("op", ["getData", "insertData", "gather_many", "scatter_many"])
def test_a_close_between_the_open_check_and_the_read_is_a_closed_error(op):
    # another thread's close() landing after the store's open check used to fail an assert
    g = gl.DataGadget(np.zeros((10, 4), np.float32), placement="cpu", device="cpu")
    store = g.store
    original = type(store).device_view
    fired: list[int] = []

    def closing_view(self=store):
        if not fired:
            fired.append(1)
            th = threading.Thread(target=g.close)
            th.start()
            th.join()
        return original(self)

    store.device_view = closing_view
    with pytest.raises(gl.GadgetClosedError):
        if op == "getData":
            g.getData([1, 2])
        elif op == "insertData":
            g.insertData(torch.ones(2, 4), [1, 2])
        elif op == "gather_many":
            gl.gather_many([g], [1, 2])
        else:
            gl.scatter_many([g], [torch.ones(2, 4)], [1, 2])


def test_a_close_that_gives_up_waiting_is_finished_by_the_other_tables_call(tmp_path):
    # a.close() while another table of the same file holds the file's lock for > 1 s gave
    # up and left a's (read-write) handle open until garbage collection
    import time

    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((64, 4), np.float32), chunks=(8, 4), compression="gzip")
    a = gl.DataGadget(str(path), placement="file", dataset="x", device="cpu", cache_bytes=0)
    b = gl.DataGadget(str(path), placement="file", dataset="x", device="cpu", cache_bytes=0)
    a.insertData(torch.ones(1, 4), [0])  # a holds an 'r+' handle
    src = b.store._source()
    for name in ("read_into", "read_chunks"):
        original = getattr(src, name)

        def slowly(*args, _original=original, **kwargs):
            time.sleep(1.6)
            return _original(*args, **kwargs)

        setattr(src, name, slowly)
    th = threading.Thread(target=lambda: b.getData([5]))
    th.start()
    time.sleep(0.2)
    start = time.perf_counter()
    a.close()  # gives up after a second: b's call holds the lock
    assert time.perf_counter() - start >= 0.9
    th.join(30)
    assert a.store._src is None  # released by b's call on its way out
    b.close()
    with h5py.File(path, "r+") as f:  # nothing in this process holds the file now
        assert f["x"][0, 0] == 1.0
