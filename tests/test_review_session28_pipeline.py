"""Black-box review (session 28) of the input pipeline: GadgetDataset, GadgetSampler and
GadgetLoader with torch's DataLoader, written from README.md, SPEC.md and the public
docstrings alone, values checked against NumPy. CPU-only: datasets of a few hundred rows."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

import gadgetloader as gl

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # pragma: no cover - the test extra brings torchdata
    StatefulDataLoader = None

NEEDS_TORCHDATA = pytest.mark.skipif(StatefulDataLoader is None, reason="needs torchdata")


@pytest.fixture(autouse=True, scope="module")
def _a_cpu_only_machine():
    """This file was written for a CPU-only machine: on a CUDA machine torch sees no GPU
    for its tests (module scope, so its module fixtures are built that way too). The
    GPU behaviour is covered by tests/test_review_session28_gpu.py."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


N = 203  # rows: not a multiple of any batch size used below
B = 16


# ---------------------------------------------------------------------------------------------
# fixtures: one dataset holding every documented column kind
# ---------------------------------------------------------------------------------------------


def _reference_columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(28)
    cols = {
        "ids": np.arange(N, dtype=np.int64),  # 1-D label column, int64, identifies the row
        "gadget_f32": rng.standard_normal((N, 5)).astype(np.float32),
        "npy_f64": rng.standard_normal((N, 3)),
        "h5_i32": rng.integers(-(2**31), 2**31 - 1, (N, 2), dtype=np.int32),
        "zarr_i16": rng.integers(-(2**15), 2**15 - 1, (N,), dtype=np.int16),
        "np_u8": rng.integers(0, 256, (N, 4), dtype=np.uint8),
        "np_i8_3d": rng.integers(-128, 128, (N, 2, 3), dtype=np.int8),
        "t_f16_3d": rng.standard_normal((N, 2, 3)).astype(np.float16),
        "t_bool": rng.random(N) < 0.5,
        "t_f32_1d": rng.standard_normal(N).astype(np.float32),
        # bfloat16 has no NumPy dtype: the reference holds float32 values bf16 keeps exactly
        "t_bf16": torch.randn(N, 3).to(torch.bfloat16).float().numpy(),
        "zarr_f32_3d": rng.standard_normal((N, 2, 2)).astype(np.float32),
    }
    cols["h5_file_gadget"] = cols["h5_i32"]
    return cols


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    return _reference_columns()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, ref: dict[str, np.ndarray]) -> dict[str, str]:
    import h5py
    import zarr

    d = tmp_path_factory.mktemp("s28pipe")
    npy = str(d / "f64.npy")
    np.save(npy, ref["npy_f64"])
    h5 = str(d / "i32.h5")
    with h5py.File(h5, "w") as f:
        f.create_dataset("x", data=ref["h5_i32"], chunks=(10, 2))
    zp = str(d / "i16.zarr")
    z = zarr.open_array(zp, mode="w", shape=(N,), chunks=(20,), dtype="int16")
    z[:] = ref["zarr_i16"]
    z3 = str(d / "f32_3d.zarr")
    z = zarr.open_array(z3, mode="w", shape=(N, 2, 2), chunks=(16, 2, 2), dtype="float32")
    z[:] = ref["zarr_f32_3d"]
    return {"npy": npy, "h5": h5, "zarr": zp, "zarr3d": z3}


def _columns(ref: dict[str, np.ndarray], files: dict[str, str]) -> list:
    return [
        ref["ids"],
        gl.DataGadget(ref["gadget_f32"], placement="cpu"),
        files["npy"],
        files["h5"],
        files["zarr"],
        ref["np_u8"],
        ref["np_i8_3d"],
        torch.from_numpy(ref["t_f16_3d"].copy()),
        torch.from_numpy(ref["t_bool"].copy()),
        torch.from_numpy(ref["t_f32_1d"].copy()),
        torch.from_numpy(ref["t_bf16"].copy()).to(torch.bfloat16),
        files["zarr3d"],
        gl.DataGadget(files["h5"], placement="file"),
    ]


@pytest.fixture(scope="module", params=["memory", "file"])
def full_ds(request: pytest.FixtureRequest, ref, files) -> gl.GadgetDataset:
    placement = None if request.param == "memory" else "file"
    ds = gl.GadgetDataset(*_columns(ref, files), placement=placement)
    yield ds
    ds.close()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _check_batch(batch, ref: dict[str, np.ndarray]) -> np.ndarray:
    """Every column of ``batch`` equals the reference rows of its id column; returns the ids."""
    cols = list(batch)
    assert len(cols) == len(ref)
    ids = _np(cols[0])
    assert cols[0].dtype == torch.int64
    for t, (name, arr) in zip(cols, ref.items(), strict=True):
        assert isinstance(t, torch.Tensor), name
        assert t.device.type == "cpu", name
        expect = arr[ids]
        if name == "t_bf16":
            assert t.dtype == torch.bfloat16
            t = t.float()
        got = _np(t)
        assert got.dtype == expect.dtype, (name, got.dtype, expect.dtype)
        assert got.shape == expect.shape, (name, got.shape, expect.shape)
        np.testing.assert_array_equal(got, expect, err_msg=name)
    return ids


def _ids_of(batches) -> list[list[int]]:
    return [_np(b[0]).tolist() for b in batches]


def _torch_shuffle(seed: int, **kw) -> list[list[int]]:
    """The id batches torch's own DataLoader makes for a plain list dataset, same generator."""
    workers = kw.get("workers", 0)
    extra = {"num_workers": workers, "multiprocessing_context": kw["ctx"]} if workers else {}
    g = torch.Generator().manual_seed(seed)
    plain = DataLoader(list(range(N)), batch_size=B, shuffle=True, generator=g, **extra)
    return [b.tolist() for b in plain]


def _simple_ds(n: int = N) -> gl.GadgetDataset:
    x = (np.arange(n * 3, dtype=np.float32) * 0.5).reshape(n, 3)
    return gl.GadgetDataset(np.arange(n, dtype=np.int64), x)


# ---------------------------------------------------------------------------------------------
# default form: DataLoader(GadgetDataset, batch_size=B, shuffle=True)
# ---------------------------------------------------------------------------------------------


def test_dataset_basics_every_column_kind(full_ds, ref):
    assert len(full_ds) == N
    assert full_ds.device == torch.device("cpu")
    assert len(full_ds.columns) == len(ref)
    row = full_ds[7]
    assert isinstance(row, tuple) and len(row) == len(ref)
    for t, arr in zip(row, ref.values(), strict=True):
        np.testing.assert_array_equal(_np(torch.as_tensor(t).float()), arr[7].astype(np.float32))
    last = full_ds[-1]
    assert int(last[0]) == N - 1
    b = full_ds[-3:]
    assert isinstance(b, gl.GadgetBatch)
    assert _check_batch(b, ref).tolist() == [N - 3, N - 2, N - 1]
    ids = np.array([5, 5, 0, N - 1, 17])
    for kind in (ids, ids.tolist(), torch.from_numpy(ids), tuple(ids.tolist())):
        assert _check_batch(full_ds[kind], ref).tolist() == ids.tolist()
    assert _check_batch(full_ds[range(10, 20, 3)], ref).tolist() == [10, 13, 16, 19]
    nbytes = sum(a[0].nbytes for k, a in ref.items() if k != "t_bf16") + ref["t_bf16"][0].size * 2
    assert full_ds.row_nbytes == nbytes


def test_default_form_shuffle_covers_every_row_with_partial_last_batch(full_ds, ref):
    g = torch.Generator().manual_seed(11)
    loader = DataLoader(full_ds, batch_size=B, shuffle=True, generator=g)
    assert len(loader) == -(-N // B)
    seen = []
    sizes = []
    for batch in loader:
        assert isinstance(batch, gl.GadgetBatch)
        seen.append(_check_batch(batch, ref))
        sizes.append(len(batch[0]))
    assert sizes == [B] * (N // B) + [N % B]
    allids = np.concatenate(seen)
    assert sorted(allids.tolist()) == list(range(N))
    # the batches follow torch's own sampler exactly (same generator seed)
    assert [s.tolist() for s in seen] == _torch_shuffle(11)


def test_default_form_drop_last(full_ds, ref):
    loader = DataLoader(full_ds, batch_size=B, shuffle=True, drop_last=True)
    batches = list(loader)
    assert len(batches) == len(loader) == N // B
    ids = np.concatenate([_check_batch(b, ref) for b in batches])
    assert len(ids) == (N // B) * B
    assert len(set(ids.tolist())) == len(ids)


def test_default_form_user_collate_fn_gets_one_element_list(full_ds, ref):
    calls = []

    def collate(batch):
        calls.append(batch)
        assert isinstance(batch, list) and len(batch) == 1
        assert isinstance(batch[0], gl.GadgetBatch)
        return {"ids": batch[0][0], "cols": batch[0]}

    out = list(DataLoader(full_ds, batch_size=B, shuffle=True, collate_fn=collate))
    assert len(calls) == len(out) == -(-N // B)
    ids = np.concatenate([_check_batch(d["cols"], ref) for d in out])
    assert sorted(ids.tolist()) == list(range(N))


def test_default_form_pin_memory_true_on_cpu(full_ds, ref):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: no accelerator, pin_memory is ignored
        loader = DataLoader(full_ds, batch_size=B, shuffle=False, pin_memory=True)
        batches = list(loader)
    ids = np.concatenate([_check_batch(b, ref) for b in batches])
    assert ids.tolist() == list(range(N))


def test_default_form_subset_and_random_split(full_ds, ref):
    pick = [3, 190, 44, 44, 0, 101, 7]
    sub = Subset(full_ds, pick)
    assert all(isinstance(b, gl.GadgetBatch) for b in DataLoader(sub, batch_size=3))
    got = np.concatenate([_check_batch(b, ref) for b in DataLoader(sub, batch_size=3)])
    assert got.tolist() == pick
    a, b = torch.utils.data.random_split(full_ds, [100, N - 100], torch.Generator().manual_seed(1))
    ida = np.concatenate([_check_batch(x, ref) for x in DataLoader(a, batch_size=32)])
    idb = np.concatenate([_check_batch(x, ref) for x in DataLoader(b, batch_size=32)])
    assert ida.tolist() == list(a.indices) and idb.tolist() == list(b.indices)
    assert sorted(ida.tolist() + idb.tolist()) == list(range(N))


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_default_form_workers(full_ds, ref, ctx):
    workers = 2 if ctx == "fork" else 1
    loader = DataLoader(
        full_ds,
        batch_size=B,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context=ctx,
        generator=torch.Generator().manual_seed(5),
    )
    seen = [_check_batch(b, ref) for b in loader]
    assert [len(s) for s in seen] == [B] * (N // B) + [N % B]
    assert [s.tolist() for s in seen] == _torch_shuffle(5, workers=workers, ctx=ctx)


def test_default_form_persistent_workers_two_epochs(ref, files):
    ds = gl.GadgetDataset(*_columns(ref, files), placement="file")
    loader = DataLoader(
        ds,
        batch_size=B,
        shuffle=True,
        drop_last=True,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    epochs = []
    for _ in range(2):
        ids = np.concatenate([_check_batch(b, ref) for b in loader])
        assert len(ids) == (N // B) * B and len(set(ids.tolist())) == len(ids)
        epochs.append(ids.tolist())
    assert epochs[0] != epochs[1]
    ds.close()


# ---------------------------------------------------------------------------------------------
# fast forms: batch_sampler=GadgetSampler and sampler=GadgetSampler, batch_size=None
# ---------------------------------------------------------------------------------------------


def test_docstring_examples_hold():
    assert [b.tolist() for b in gl.GadgetSampler(10, batch_size=4, order="sequential")] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    got = [
        [
            b.tolist()
            for b in gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r)
        ]
        for r in (0, 1)
    ]
    assert got == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert [b[0].tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]


@pytest.mark.parametrize("form", ["batch_sampler", "sampler"])
@pytest.mark.parametrize("order", ["sequential", "random"])
def test_fast_forms_every_row_once_per_epoch(full_ds, ref, form, order):
    s = gl.GadgetSampler(full_ds, batch_size=B, order=order, seed=4)
    if form == "batch_sampler":
        loader = DataLoader(full_ds, batch_sampler=s)
    else:
        loader = DataLoader(full_ds, sampler=s, batch_size=None)
    assert len(loader) == len(s) == -(-N // B)
    epochs = []
    for e in range(3):
        assert s.epoch == e
        order_e = _np(s.epoch_order(e)).tolist()
        batches = list(loader)
        if form == "sampler":
            assert all(isinstance(b, list) for b in batches)  # default_convert: tuple -> list
        ids = [_check_batch(b, ref) for b in batches]
        assert [len(i) for i in ids] == [B] * (N // B) + [N % B]
        flat = np.concatenate(ids).tolist()
        assert flat == order_e
        assert sorted(flat) == list(range(N))
        epochs.append(flat)
    if order == "sequential":
        assert epochs == [list(range(N))] * 3
    else:
        assert epochs[0] != epochs[1] != epochs[2] != epochs[0]


def test_sampler_without_batch_size_none_is_refused():
    ds = _simple_ds()
    s = gl.GadgetSampler(ds, batch_size=B)
    loader = DataLoader(ds, sampler=s)  # torch builds it without asking the dataset
    with pytest.raises(gl.GadgetValueError, match="batch_sampler"):
        next(iter(loader))


def test_set_epoch_is_deterministic_and_matches_epoch_order():
    a = gl.GadgetSampler(N, batch_size=B, seed=9)
    b = gl.GadgetSampler(N, batch_size=B, seed=9)
    c = gl.GadgetSampler(N, batch_size=B, seed=10)
    a.set_epoch(3)
    b.set_epoch(3)
    c.set_epoch(3)
    la = [t.tolist() for t in a]
    lb = [t.tolist() for t in b]
    lc = [t.tolist() for t in c]
    assert la == lb
    assert la != lc
    assert sum(la, []) == a.epoch_order(3).tolist()
    assert sorted(sum(la, [])) == list(range(N))
    b.set_epoch(4)
    assert [t.tolist() for t in b] != la
    # calling set_epoch every epoch gives what advancing by itself gives
    d = gl.GadgetSampler(N, batch_size=B, seed=9)
    auto = [[t.tolist() for t in d] for _ in range(4)]
    e = gl.GadgetSampler(N, batch_size=B, seed=9)
    manual = []
    for ep in range(4):
        e.set_epoch(ep)
        manual.append([t.tolist() for t in e])
    assert auto == manual and auto[3] == la


def test_set_epoch_mid_pass_restarts_and_new_iter_restarts_same_epoch():
    s = gl.GadgetSampler(N, batch_size=B, seed=2)
    full0 = [t.tolist() for t in gl.GadgetSampler(N, batch_size=B, seed=2)]
    it = iter(s)
    first = [next(it).tolist() for _ in range(3)]
    assert first == full0[:3]
    # a new iter() before the pass ends restarts the current epoch
    assert [t.tolist() for t in s] == full0
    assert s.epoch == 1
    # all batches drawn (without exhausting the generator) -> next pass is the next epoch
    s2 = gl.GadgetSampler(N, batch_size=B, seed=2)
    drawn = [t.tolist() for t in itertools.islice(iter(s2), len(s2))]
    assert drawn == full0
    assert s2.epoch == 1
    assert sum([t.tolist() for t in s2], []) == s2.epoch_order(1).tolist()


def test_same_seed_same_order_in_fresh_process():
    code = (
        "import json, gadgetloader as gl\n"
        "s = gl.GadgetSampler(157, batch_size=10, order='random', seed=1234)\n"
        "out = [[b.tolist() for b in s] for _ in range(2)]\n"
        "c = gl.GadgetSampler(157, batch_size=10, order='chunk', chunk_rows=8, window_chunks=3,"
        " seed=1234)\n"
        "out.append([b.tolist() for b in c])\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    s = gl.GadgetSampler(157, batch_size=10, order="random", seed=1234)
    mine = [[b.tolist() for b in s] for _ in range(2)]
    c = gl.GadgetSampler(
        157, batch_size=10, order="chunk", chunk_rows=8, window_chunks=3, seed=1234
    )
    mine.append([b.tolist() for b in c])
    assert theirs == mine
    assert sorted(sum(mine[0], [])) == list(range(157))


def _assert_chunk_windows(order: list[int], chunk_rows: int, window_chunks: int, n: int) -> None:
    """Chunks shuffled, taken ``window_chunks`` at a time, rows shuffled within each window:
    every window is a contiguous run of positions holding whole chunks."""
    assert sorted(order) == list(range(n))
    pos = np.empty(n, dtype=np.int64)
    pos[np.asarray(order)] = np.arange(n)
    n_chunks = -(-n // chunk_rows)
    spans = []
    for ch in range(n_chunks):
        p = pos[ch * chunk_rows : min(n, (ch + 1) * chunk_rows)]
        assert p.max() - p.min() < chunk_rows * window_chunks, ch
        spans.append((int(p.min()), ch))
    by_first = [ch for _, ch in sorted(spans)]
    start = 0
    for g in range(0, n_chunks, window_chunks):
        chunks = by_first[g : g + window_chunks]
        p = np.concatenate([pos[c * chunk_rows : min(n, (c + 1) * chunk_rows)] for c in chunks])
        assert sorted(p.tolist()) == list(range(start, start + len(p))), chunks
        start += len(p)
    assert start == n


def test_chunk_order_on_file_backed_dataset(ref, files):
    ds = gl.GadgetDataset(ref["ids"], files["h5"], placement="file")
    assert ds.chunk_rows == 10
    s = gl.GadgetSampler(ds, batch_size=7, order="chunk", window_chunks=3, seed=1)
    assert s.chunk_rows == 10 and s.window_chunks == 3
    loader = DataLoader(ds, batch_sampler=s)
    e0 = _ids_of(loader)
    e1 = _ids_of(loader)
    for e in (e0, e1):
        flat = sum(e, [])
        _assert_chunk_windows(flat, 10, 3, N)
        assert [len(b) for b in e] == [7] * (N // 7) + ([N % 7] if N % 7 else [])
    assert e0 != e1
    # the order depends only on the layout, the seed and the epoch
    s2 = gl.GadgetSampler(N, batch_size=7, order="chunk", chunk_rows=10, window_chunks=3, seed=1)
    assert [b.tolist() for b in s2] == e0
    # rows come with their own values
    batch = ds[torch.tensor(e0[0])]
    np.testing.assert_array_equal(_np(batch[1]), ref["h5_i32"][e0[0]])
    # a chunk order is not the sequential order, and a window >= all chunks is a full shuffle
    assert sum(e0, []) != list(range(N))
    full = gl.GadgetSampler(
        N, batch_size=7, order="chunk", chunk_rows=10, window_chunks=100, seed=1
    )
    flat = sum([b.tolist() for b in full], [])
    assert sorted(flat) == list(range(N))
    ds.close()


def test_chunk_rows_of_mixed_file_columns(tmp_path):
    import h5py

    n = 120
    paths = {}
    for c in (10, 4, 3):
        p = str(tmp_path / f"c{c}.h5")
        with h5py.File(p, "w") as f:
            f.create_dataset("x", data=np.arange(n, dtype=np.float32), chunks=(c,))
        paths[c] = p
    a = gl.GadgetDataset(paths[10], paths[4], placement="file")
    assert a.chunk_rows == 20  # lcm(10, 4) = 20 <= 2 * 10
    b = gl.GadgetDataset(paths[10], paths[3], placement="file")
    assert b.chunk_rows == 10  # lcm(10, 3) = 30 > 2 * 10: the largest
    c = gl.GadgetDataset(np.arange(n))
    assert c.chunk_rows is None
    for ds in (a, b):
        s = gl.GadgetSampler(ds, batch_size=8, order="chunk", window_chunks=2, seed=3)
        _assert_chunk_windows(sum([t.tolist() for t in s], []), ds.chunk_rows, 2, n)
        ds.close()


def test_window_and_chunk_rows_do_not_change_random_or_sequential():
    for order in ("random", "sequential"):
        plain = gl.GadgetSampler(N, batch_size=B, order=order, seed=6)
        opts = gl.GadgetSampler(N, batch_size=B, order=order, seed=6, window_chunks=2, chunk_rows=5)
        assert [t.tolist() for t in plain] == [t.tolist() for t in opts]
        # and a state loads across them
        it = iter(opts)
        next(it)
        fresh = gl.GadgetSampler(N, batch_size=B, order=order, seed=6)
        fresh.load_state_dict(opts.state_dict())
        assert [t.tolist() for t in fresh] == [t.tolist() for t in plain][1:]


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["random", "sequential", "chunk"])
@pytest.mark.parametrize("k", [0, 1, 5, 12, 13])
def test_sampler_resume_equals_uninterrupted(order, k):
    opts = dict(batch_size=B, order=order, seed=21)
    if order == "chunk":
        opts.update(chunk_rows=8, window_chunks=2)
    ref_s = gl.GadgetSampler(N, **opts)
    ref_s.set_epoch(2)
    run = [[t.tolist() for t in ref_s] for _ in range(2)]  # epochs 2 and 3
    assert len(run[0]) == 13
    s = gl.GadgetSampler(N, **opts)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it).tolist() for _ in range(k)]
    assert head == run[0][:k]
    state = s.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain data
    fresh = gl.GadgetSampler(
        N,
        batch_size=B,
        order=order,
        seed=999,
        **({"chunk_rows": 8, "window_chunks": 2} if order == "chunk" else {}),
    )
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # DistributedSampler loop: set_epoch of the loaded epoch keeps the position
    rest = [t.tolist() for t in fresh]
    if k == len(run[0]):
        assert rest == []  # saved after the last batch: one empty pass
        rest = [t.tolist() for t in fresh]
        assert rest == run[1]
    else:
        assert head + rest == run[0]
        assert [t.tolist() for t in fresh] == run[1]


def test_sampler_state_after_epoch_end_inside_loop():
    s = gl.GadgetSampler(N, batch_size=B, seed=8)
    full = gl.GadgetSampler(N, batch_size=B, seed=8)
    e0 = [t.tolist() for t in full]
    e1 = [t.tolist() for t in full]
    got = []
    state = None
    for t in s:
        got.append(t.tolist())
        state = s.state_dict()  # saved inside the loop, the last one after the last batch
    assert got == e0
    fresh = gl.GadgetSampler(N, batch_size=B, seed=8)
    fresh.load_state_dict(state)
    assert [t.tolist() for t in fresh] == []
    assert [t.tolist() for t in fresh] == e1


def test_failed_load_leaves_sampler_unchanged_and_mapping_required():
    s = gl.GadgetSampler(N, batch_size=B, seed=3)
    it = iter(s)
    next(it)
    next(it)
    before = s.state_dict()
    other = gl.GadgetSampler(N, batch_size=B + 1, seed=3).state_dict()
    with pytest.raises(gl.GadgetValueError, match="batch"):
        s.load_state_dict(other)
    assert s.state_dict() == before
    for bad_cfg in (
        dict(num_rows=N + 1),
        dict(order="sequential"),
        dict(drop_last=True),
        dict(pad=True),
    ):
        n = bad_cfg.pop("num_rows", N)
        st = gl.GadgetSampler(n, batch_size=B, seed=3, **bad_cfg).state_dict()
        with pytest.raises(gl.GadgetValueError):
            s.load_state_dict(st)
        assert s.state_dict() == before
    with pytest.raises(gl.GadgetTypeError, match="list"):
        s.load_state_dict([("epoch", 0)])
    assert s.state_dict() == before


@NEEDS_TORCHDATA
@pytest.mark.parametrize("form", ["batch_sampler", "sampler"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [3, 13])
def test_stateful_dataloader_resume(form, workers, k):
    ds = _simple_ds()

    def make():
        s = gl.GadgetSampler(ds, batch_size=B, seed=17)
        kw = dict(num_workers=workers)
        if workers:
            kw["multiprocessing_context"] = "fork"
        if form == "batch_sampler":
            return StatefulDataLoader(ds, batch_sampler=s, **kw)
        return StatefulDataLoader(ds, sampler=s, batch_size=None, **kw)

    base = make()
    run = [_ids_of(base) for _ in range(2)]
    assert len(run[0]) == 13
    assert sorted(sum(run[0], [])) == list(range(N))
    assert run[0] != run[1]
    a = make()
    it = iter(a)
    head = [_np(next(it)[0]).tolist() for _ in range(k)]
    assert head == run[0][:k]
    state = a.state_dict()
    del it
    b = make()
    b.load_state_dict(state)
    rest = _ids_of(b)
    assert head + rest == run[0]
    assert _ids_of(b) == run[1]


@NEEDS_TORCHDATA
def test_stateful_dataloader_resume_values_and_set_epoch(full_ds, ref):
    def make():
        return StatefulDataLoader(
            full_ds, batch_sampler=gl.GadgetSampler(full_ds, batch_size=B, seed=2)
        )

    base = make()
    base.batch_sampler.set_epoch(4)
    run = [_check_batch(b, ref).tolist() for b in base]
    a = make()
    a.batch_sampler.set_epoch(4)
    it = iter(a)
    head = [_check_batch(next(it), ref).tolist() for _ in range(6)]
    state = a.state_dict()
    del it
    b = make()
    b.load_state_dict(state)
    b.batch_sampler.set_epoch(4)
    rest = [_check_batch(x, ref).tolist() for x in b]
    assert head + rest == run


# ---------------------------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,R,bs", [(N, 3, 8), (50, 3, 8), (9, 2, 2), (64, 4, 4), (7, 7, 3)])
@pytest.mark.parametrize("order", ["random", "sequential"])
def test_ranks_default_disjoint_full_coverage(n, R, bs, order):
    samplers = [
        gl.GadgetSampler(n, batch_size=bs, order=order, seed=5, num_replicas=R, rank=r)
        for r in range(R)
    ]
    lens = {len(s) for s in samplers}
    assert len(lens) == 1
    per_rank = [[t.tolist() for t in s] for s in samplers]
    assert all(len(p) == len(samplers[0]) for p in per_rank)
    order_ = samplers[0].epoch_order(0).tolist()
    assert all(s.epoch_order(0).tolist() == order_ for s in samplers)
    flat = [sum(p, []) for p in per_rank]
    assert sum(flat, []) == order_  # contiguous shares in rank order
    assert sorted(sum(flat, [])) == list(range(n))
    for r, f in enumerate(flat):
        assert len(f) == n // R + (1 if r < n % R else 0)
        sizes = [len(b) for b in per_rank[r]]
        assert all(sz == bs for sz in sizes[:-1])
        assert 1 <= sizes[-1] <= bs + 1


def test_ranks_last_batch_can_hold_b_plus_one():
    sizes = [
        [
            len(t)
            for t in gl.GadgetSampler(50, batch_size=8, order="sequential", num_replicas=3, rank=r)
        ]
        for r in range(3)
    ]
    assert sizes == [[8, 9], [8, 9], [8, 8]]


@pytest.mark.parametrize("n,R,bs", [(N, 3, 8), (11, 3, 3), (24, 3, 8)])
def test_ranks_pad_full_batches(n, R, bs):
    samplers = [
        gl.GadgetSampler(n, batch_size=bs, seed=7, pad=True, num_replicas=R, rank=r)
        for r in range(R)
    ]
    nb = -(-n // (R * bs))
    per_rank = [[t.tolist() for t in s] for s in samplers]
    for s, p in zip(samplers, per_rank, strict=True):
        assert len(s) == len(p) == nb
        assert all(len(b) == bs for b in p)
    flat = sum([sum(p, []) for p in per_rank], [])
    order_ = samplers[0].epoch_order(0).tolist()
    assert flat == (order_ * 2)[: R * bs * nb]
    assert set(flat) == set(range(n))


@pytest.mark.parametrize("n,R,bs", [(N, 3, 8), (11, 3, 2), (48, 3, 8)])
def test_ranks_drop_last(n, R, bs):
    samplers = [
        gl.GadgetSampler(n, batch_size=bs, seed=7, drop_last=True, num_replicas=R, rank=r)
        for r in range(R)
    ]
    per_rank = [[t.tolist() for t in s] for s in samplers]
    for s, p in zip(samplers, per_rank, strict=True):
        assert len(s) == len(p) == n // (R * bs)
        assert all(len(b) == bs for b in p)
    flat = sum([sum(p, []) for p in per_rank], [])
    assert len(set(flat)) == len(flat) == R * bs * (n // (R * bs))
    assert n - len(flat) < R * bs
    assert set(flat) == set(samplers[0].epoch_order(0).tolist()[: len(flat)])


def test_ranks_errors_and_world_size_state():
    with pytest.raises(gl.GadgetValueError, match="rank"):
        gl.GadgetSampler(N, batch_size=B, num_replicas=2)
    with pytest.raises(gl.GadgetValueError, match="no batch"):
        gl.GadgetSampler(20, batch_size=8, drop_last=True, num_replicas=3, rank=0)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(N, batch_size=B, num_replicas=2, rank=2)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(N, batch_size=B, num_replicas=2, rank=-1)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(2, batch_size=B, num_replicas=3, rank=0)  # needs n >= R
    with pytest.raises(gl.GadgetValueError, match="exclusive"):
        gl.GadgetSampler(N, batch_size=B, pad=True, drop_last=True)
    two = gl.GadgetSampler(N, batch_size=B, seed=1, num_replicas=2, rank=1)
    it = iter(two)
    next(it)
    state = two.state_dict()
    three = gl.GadgetSampler(N, batch_size=B, seed=1, num_replicas=3, rank=1)
    before = three.state_dict()
    with pytest.raises(gl.GadgetValueError, match="world size") as ei:
        three.load_state_dict(state)
    assert "2" in str(ei.value) and "3" in str(ei.value)
    assert three.state_dict() == before
    # a state of one rank loads on another rank of the same world size
    zero = gl.GadgetSampler(N, batch_size=B, seed=55, num_replicas=2, rank=0)
    zero.load_state_dict(state)
    ref0 = gl.GadgetSampler(N, batch_size=B, seed=1, num_replicas=2, rank=0)
    assert [t.tolist() for t in zero] == [t.tolist() for t in ref0][1:]


def test_ranks_through_dataloader_values(full_ds, ref):
    R = 2
    got = []
    for r in range(R):
        s = gl.GadgetSampler(full_ds, batch_size=B, seed=3, num_replicas=R, rank=r)
        ids = [_check_batch(b, ref) for b in DataLoader(full_ds, batch_sampler=s)]
        assert len(ids) == len(s)
        got.append(np.concatenate(ids))
    assert len(got[0]) == (N + 1) // 2 and len(got[1]) == N // 2
    assert sorted(np.concatenate(got).tolist()) == list(range(N))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_bad_dataset_input_errors(ref):
    with pytest.raises(gl.GadgetValueError, match="same number of rows") as ei:
        gl.GadgetDataset(ref["gadget_f32"], ref["ids"][:50])
    assert "203" in str(ei.value) and "50" in str(ei.value)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset()
    with pytest.raises(gl.GadgetValueError, match="0 rows|empty"):
        gl.GadgetDataset(np.zeros((0, 3), np.float32))
    with pytest.raises(gl.GadgetError) as ei:
        gl.GadgetDataset(np.zeros((0,), np.int64), np.zeros((0, 2), np.float32))
    assert isinstance(ei.value, ValueError)
    with pytest.raises(gl.GadgetTypeError, match="int") as ei:
        gl.GadgetDataset(42)
    assert isinstance(ei.value, TypeError)
    with pytest.raises(gl.GadgetTypeError, match="NoneType|None"):
        gl.GadgetDataset(ref["ids"], None)
    with pytest.raises((gl.GadgetFileNotFoundError, FileNotFoundError)):
        gl.GadgetDataset("/nonexistent/s28/nothing.npy")


def test_bad_ids_errors():
    ds = _simple_ds()
    with pytest.raises(gl.GadgetIndexError, match="out of range") as ei:
        ds[[0, N]]
    msg = str(ei.value)
    assert str(N) in msg and str(N - 1) in msg
    assert isinstance(ei.value, IndexError)
    with pytest.raises(gl.GadgetIndexError, match="negative"):
        ds[[-1, 1]]
    with pytest.raises(gl.GadgetIndexError):
        ds[np.array([5, N + 100])]
    with pytest.raises(gl.GadgetIndexError):
        ds[torch.tensor([N])]
    with pytest.raises(gl.GadgetIndexError):
        ds[N]
    with pytest.raises(gl.GadgetIndexError):
        ds[-N - 1]
    np.testing.assert_array_equal(_np(ds[-N][1]), _np(ds[0][1]))
    with pytest.raises(gl.GadgetTypeError, match="float") as ei:
        ds[[0.5, 1]]
    assert isinstance(ei.value, TypeError)
    with pytest.raises(gl.GadgetTypeError):
        ds[torch.tensor([0.0, 1.0])]
    with pytest.raises(gl.GadgetTypeError, match="str"):
        ds["0"]
    with pytest.raises(gl.GadgetIndexError):
        ds.gather([N])
    # the default form surfaces the same error for a bad Subset index
    with pytest.raises(gl.GadgetIndexError):
        list(DataLoader(Subset(ds, [0, N + 5]), batch_size=2))


def test_bad_sampler_arguments():
    for bs in (0, -1):
        with pytest.raises(gl.GadgetValueError, match=f"got {bs}") as ei:
            gl.GadgetSampler(N, batch_size=bs)
        assert "batch_size" in str(ei.value)
    for bs in (2.5, "4", None):
        with pytest.raises(gl.GadgetTypeError, match="batch_size"):
            gl.GadgetSampler(N, batch_size=bs)
    for w in (0, -3):
        with pytest.raises(gl.GadgetValueError, match="window_chunks"):
            gl.GadgetSampler(N, batch_size=B, order="chunk", chunk_rows=8, window_chunks=w)
        with pytest.raises(gl.GadgetValueError, match="window_chunks"):
            gl.GadgetSampler(N, batch_size=B, order="random", window_chunks=w)
    with pytest.raises(gl.GadgetTypeError, match="window_chunks"):
        gl.GadgetSampler(N, batch_size=B, order="chunk", chunk_rows=8, window_chunks=1.5)
    with pytest.raises(gl.GadgetValueError, match="chunk_rows"):
        gl.GadgetSampler(N, batch_size=B, order="chunk", chunk_rows=0)
    with pytest.raises(gl.GadgetKeyError, match="sequential") as ei:
        gl.GadgetSampler(N, batch_size=B, order="shuffled")
    assert isinstance(ei.value, KeyError)
    with pytest.raises(gl.GadgetTypeError, match="path"):
        gl.GadgetSampler("x.npy", batch_size=B)
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(0, batch_size=B)
    with pytest.raises(gl.GadgetValueError, match="chunk"):
        gl.GadgetSampler(N, batch_size=B, order="chunk")  # no chunk size known


def test_gadget_batch_to_refuses_dtype():
    ds = _simple_ds()
    b = ds[[0, 1, 2]]
    with pytest.raises(gl.GadgetTypeError, match="float16"):
        b.to(torch.float16)
    moved = b.to("cpu")
    assert isinstance(moved, gl.GadgetBatch)
    assert moved[0].dtype == torch.int64 and moved[1].dtype == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(moved, b, strict=True))


# ---------------------------------------------------------------------------------------------
# GadgetLoader on a CPU-only machine
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_gadget_loader_equals_plain_loader(full_ds, ref, order):
    loader = gl.GadgetLoader(full_ds, batch_size=B, order=order, seed=31)
    assert loader.device == torch.device("cpu")
    assert len(loader) == -(-N // B)
    plain = DataLoader(
        full_ds, batch_sampler=gl.GadgetSampler(full_ds, batch_size=B, order=order, seed=31)
    )
    for _ in range(2):  # iterating twice: two epochs, same as the plain loader's two epochs
        mine = [_check_batch(b, ref).tolist() for b in loader]
        theirs = [_check_batch(b, ref).tolist() for b in plain]
        assert mine == theirs
        assert len(mine) == len(loader)
        assert sorted(sum(mine, [])) == list(range(N))
    if order == "random":
        s = gl.GadgetSampler(N, batch_size=B, seed=31)
        assert sum(mine, []) == s.epoch_order(1).tolist()


def test_gadget_loader_break_then_iterate_again():
    ds = _simple_ds()
    loader = gl.GadgetLoader(ds, batch_size=B, seed=12)
    s = gl.GadgetSampler(N, batch_size=B, seed=12)
    e0 = [t.tolist() for t in s]
    e1 = [t.tolist() for t in s]
    for i, _b in enumerate(loader):
        if i == 2:
            break
    # broken mid-epoch: the next pass is the same epoch anew
    assert _ids_of(loader) == e0
    assert _ids_of(loader) == e1
    # every batch handed out (no StopIteration seen): the next pass is the next epoch
    loader2 = gl.GadgetLoader(ds, batch_size=B, seed=12)
    first = _ids_of(itertools.islice(iter(loader2), len(loader2)))
    assert first == e0
    assert _ids_of(loader2) == e1


@pytest.mark.parametrize("k", [0, 4, 13])
def test_gadget_loader_resume(k):
    ds = _simple_ds()
    base = gl.GadgetLoader(ds, batch_size=B, seed=40)
    run = [_ids_of(base) for _ in range(2)]
    a = gl.GadgetLoader(ds, batch_size=B, seed=40)
    it = iter(a)
    head = [_np(next(it)[0]).tolist() for _ in range(k)]
    state = a.state_dict()
    del it
    b = gl.GadgetLoader(ds, batch_size=B, seed=1)
    b.load_state_dict(state)
    rest = _ids_of(b)
    if k == len(run[0]):
        assert rest == []
        rest = _ids_of(b)
        assert rest == run[1]
    else:
        assert head + rest == run[0]
        assert _ids_of(b) == run[1]


def test_gadget_loader_state_after_loop_points_at_next_epoch():
    ds = _simple_ds()
    base = gl.GadgetLoader(ds, batch_size=B, seed=41)
    run = [_ids_of(base) for _ in range(2)]
    a = gl.GadgetLoader(ds, batch_size=B, seed=41)
    assert _ids_of(a) == run[0]
    state = a.state_dict()
    b = gl.GadgetLoader(ds, batch_size=B, seed=41)
    b.load_state_dict(state)
    assert _ids_of(b) == run[1]


def test_gadget_loader_over_sampler_follows_set_epoch_and_refuses_options():
    ds = _simple_ds()
    s = gl.GadgetSampler(ds, batch_size=B, seed=13, num_replicas=2, rank=1)
    loader = gl.GadgetLoader(ds, sampler=s)
    assert len(loader) == len(s)
    s.set_epoch(6)
    ref_s = gl.GadgetSampler(N, batch_size=B, seed=13, num_replicas=2, rank=1)
    ref_s.set_epoch(6)
    assert _ids_of(loader) == [t.tolist() for t in ref_s]
    loader.set_epoch(2)
    ref_s.set_epoch(2)
    assert _ids_of(loader) == [t.tolist() for t in ref_s]
    for kw in (dict(seed=0), dict(order="random"), dict(drop_last=False), dict(batch_size=B)):
        with pytest.raises(gl.GadgetError):
            gl.GadgetLoader(ds, sampler=s, **kw)
    with pytest.raises(gl.GadgetValueError, match="batch_size"):
        gl.GadgetLoader(ds)
    with pytest.raises(gl.GadgetValueError, match="batch_size"):
        gl.GadgetLoader(ds, batch_size=0)


def test_gadget_loader_with_workers_and_persistent(ref, files):
    ds = gl.GadgetDataset(*_columns(ref, files), placement="file")
    plain = gl.GadgetLoader(ds, batch_size=B, seed=50)
    want = [[_check_batch(b, ref).tolist() for b in plain] for _ in range(2)]
    loader = gl.GadgetLoader(
        ds,
        batch_size=B,
        seed=50,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    got = [[_check_batch(b, ref).tolist() for b in loader] for _ in range(2)]
    assert got == want
    ds.close()


def test_gadget_loader_accepts_array_and_tensor():
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    for src in (x, torch.from_numpy(x), gl.DataGadget(x, placement="cpu")):
        loader = gl.GadgetLoader(src, batch_size=6, order="sequential")
        batches = list(loader)
        assert len(batches) == len(loader) == 4
        assert all(len(b) == 1 for b in batches)
        np.testing.assert_array_equal(np.concatenate([_np(b[0]) for b in batches]), x)


# ---------------------------------------------------------------------------------------------
# more edges
# ---------------------------------------------------------------------------------------------


def _expected_rank_batches(
    n: int, R: int, bs: int, mode: str, order: list[int]
) -> list[list[list[int]]]:
    """The per-rank batches the GadgetSampler docstring's *Ranks* section describes."""
    if mode == "pad":
        nb = -(-n // (R * bs))
        cyc = [order[i % n] for i in range(R * bs * nb)]
        return [
            [cyc[(r * nb + j) * bs : (r * nb + j + 1) * bs] for j in range(nb)] for r in range(R)
        ]
    if mode == "drop_last":
        nb = n // (R * bs)
        return [
            [order[(r * nb + j) * bs : (r * nb + j + 1) * bs] for j in range(nb)] for r in range(R)
        ]
    out = []
    start = 0
    base = n // R
    nb = -(-base // bs)
    for r in range(R):
        share = base + (1 if r < n % R else 0)
        rows = order[start : start + share]
        start += share
        batches = [rows[j * bs : (j + 1) * bs] for j in range(nb - 1)]
        batches.append(rows[(nb - 1) * bs :])
        out.append(batches)
    return out


def test_ranks_exhaustive_small_against_docstring_formulas():
    checked = 0
    for n in range(1, 31):
        for R in range(1, 5):
            for bs in range(1, 7):
                for mode in ("default", "pad", "drop_last"):
                    kw = {mode: True} if mode != "default" else {}
                    if (mode == "default" and n < R) or (mode == "drop_last" and n < R * bs):
                        with pytest.raises(gl.GadgetValueError):
                            gl.GadgetSampler(n, batch_size=bs, num_replicas=R, rank=0, **kw)
                        continue
                    order = list(range(n))
                    expect = _expected_rank_batches(n, R, bs, mode, order)
                    for r in range(R):
                        s = gl.GadgetSampler(
                            n, batch_size=bs, order="sequential", num_replicas=R, rank=r, **kw
                        )
                        batches = list(s)
                        assert all(t.dtype == torch.int64 and t.dim() == 1 for t in batches)
                        got = [t.tolist() for t in batches]
                        assert got == expect[r], (n, R, bs, mode, r)
                        assert len(s) == len(expect[0])
                        checked += 1
    assert checked > 2000


def test_ranks_random_order_matches_formulas_over_epochs():
    n, R, bs = 97, 3, 5
    for mode in ("default", "pad", "drop_last"):
        kw = {mode: True} if mode != "default" else {}
        samplers = [
            gl.GadgetSampler(n, batch_size=bs, seed=77, num_replicas=R, rank=r, **kw)
            for r in range(R)
        ]
        for epoch in range(3):
            order = samplers[0].epoch_order(epoch).tolist()
            assert sorted(order) == list(range(n))
            expect = _expected_rank_batches(n, R, bs, mode, order)
            for r, s in enumerate(samplers):
                assert s.epoch == epoch
                assert [t.tolist() for t in s] == expect[r], (mode, epoch, r)


@NEEDS_TORCHDATA
def test_stateful_dataloader_every_step_with_persistent_workers():
    n = 50
    ds = _simple_ds(n)

    def make(workers: int, persistent: bool = False):
        s = gl.GadgetSampler(ds, batch_size=8, seed=3)
        kw = dict(num_workers=workers, persistent_workers=persistent)
        if workers:
            kw["multiprocessing_context"] = "fork"
        return StatefulDataLoader(ds, batch_sampler=s, **kw)

    base = make(0)
    run = [_ids_of(base) for _ in range(3)]
    nb = len(run[0])
    flat = run[0] + run[1] + run[2]
    a = make(2, persistent=True)
    states, got = [], []
    for _ in range(2):
        for b in a:
            got.append(_np(b[0]).tolist())
            states.append(a.state_dict())
    assert got == run[0] + run[1]
    for k, st in enumerate(states):
        r = make(2)
        r.load_state_dict(st)
        done = k + 1
        expect = flat[done : (done // nb) * nb + nb] if done % nb else []
        assert _ids_of(r) == expect, k
        if not done % nb:  # saved after an epoch's last batch: empty pass, then the next epoch
            assert _ids_of(r) == run[done // nb]


def test_dataloader_workers_early_break_then_set_epoch():
    ds = _simple_ds()
    s = gl.GadgetSampler(ds, batch_size=B, seed=3)
    e0 = [t.tolist() for t in gl.GadgetSampler(N, batch_size=B, seed=3)]
    loader = DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork")
    for i, b in enumerate(loader):
        assert _np(b[0]).tolist() == e0[i]
        if i == 1:
            break
    s.set_epoch(0)  # README: after an early break with workers, call set_epoch
    assert _ids_of(loader) == e0


def test_sampler_form_spawn_worker(ref, files):
    ds = gl.GadgetDataset(*_columns(ref, files), placement="file")
    s = gl.GadgetSampler(ds, batch_size=B, seed=8, pad=True)
    ref_s = gl.GadgetSampler(N, batch_size=B, seed=8, pad=True)
    want = [[t.tolist() for t in ref_s] for _ in range(2)]
    assert want[0] != want[1]
    loader = DataLoader(
        ds, batch_sampler=s, num_workers=1, multiprocessing_context="spawn", persistent_workers=True
    )
    for e in range(2):
        got = [_check_batch(b, ref).tolist() for b in loader]
        assert got == want[e]
        assert all(len(g) == B for g in got)
    ds.close()


def test_state_follows_latest_pass():
    s = gl.GadgetSampler(N, batch_size=B, seed=3)
    e0 = [t.tolist() for t in gl.GadgetSampler(N, batch_size=B, seed=3)]
    it1 = iter(s)
    assert next(it1).tolist() == e0[0]
    it2 = iter(s)
    for j in range(3):
        assert next(it2).tolist() == e0[j]
    # the older pass still yields its batches but no longer moves the state
    assert [next(it1).tolist() for _ in range(5)] == e0[1:6]
    assert s.state_dict()["position"] == 3
    fresh = gl.GadgetSampler(N, batch_size=B, seed=3)
    fresh.load_state_dict(s.state_dict())
    assert [t.tolist() for t in fresh] == e0[3:]


def test_changed_batch_loses_tag_and_is_checked():
    n = 50
    ds = _simple_ds(n)
    s = gl.GadgetSampler(ds, batch_size=8, seed=3)
    e0 = [t.tolist() for t in gl.GadgetSampler(n, batch_size=8, seed=3)]
    it = iter(s)
    b = next(it)
    b[1] = n + 5  # through torch
    with pytest.raises(gl.GadgetIndexError, match=str(n + 5)):
        ds[b]
    b2 = next(it)
    b2.numpy()[0] = n + 7  # through NumPy: host columns check anyway
    with pytest.raises(gl.GadgetIndexError, match=str(n + 7)):
        ds[b2]
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(b2)
    # the change is in the epoch's cached order: a replay sees it (documented)
    s.set_epoch(0)
    replay = [t.tolist() for t in s]
    assert replay[0][1] == n + 5 and replay[0][0] == e0[0][0]
    assert replay[1][0] == n + 7
    assert replay[2:] == e0[2:]


@pytest.mark.parametrize("coalesce", [1, 3, 32])
def test_sampler_coalesce_changes_nothing_on_cpu(coalesce):
    n = 90
    ds = _simple_ds(n)
    x = _np(ds[:][1])
    run = [[t.tolist() for t in gl.GadgetSampler(n, batch_size=8, seed=3)]]
    s = gl.GadgetSampler(ds, batch_size=8, seed=3, coalesce=coalesce)
    assert s.coalesce == coalesce
    out = list(DataLoader(ds, batch_sampler=s))
    assert [_np(o[0]).tolist() for o in out] == run[0]
    for o in out:
        np.testing.assert_array_equal(_np(o[1]), x[_np(o[0])])
    g = gl.GadgetLoader(ds, batch_size=8, seed=3, coalesce=coalesce)
    it = iter(g)
    head = [_np(next(it)[0]).tolist() for _ in range(4)]
    st = g.state_dict()
    del it
    g2 = gl.GadgetLoader(ds, batch_size=8, seed=3, coalesce=coalesce)
    g2.load_state_dict(st)
    assert head + _ids_of(g2) == run[0]


def test_gadget_loader_with_workers_state_counts_handed_out_and_break():
    n = 50
    ds = _simple_ds(n)
    run = [t.tolist() for t in gl.GadgetSampler(n, batch_size=8, seed=3)]
    g = gl.GadgetLoader(ds, batch_size=8, seed=3, num_workers=2, multiprocessing_context="fork")
    it = iter(g)
    head = [_np(next(it)[0]).tolist() for _ in range(3)]
    st = g.state_dict()
    del it
    assert st["sampler"]["position"] == 3 if "sampler" in st else True
    g2 = gl.GadgetLoader(ds, batch_size=8, seed=3)
    g2.load_state_dict(st)
    assert head + _ids_of(g2) == run
    # broken mid-epoch (workers drew ahead): the next pass is the same epoch anew
    assert _ids_of(g) == run


def test_gadget_loader_sampler_options_len_and_set_epoch_errors():
    ds = _simple_ds(50)
    g = gl.GadgetLoader(ds, batch_size=8, seed=3, num_replicas=2, rank=1, pad=True)
    assert len(g) == 4 and [len(b[0]) for b in g] == [8, 8, 8, 8]
    g = gl.GadgetLoader(ds, batch_size=8, seed=3, drop_last=True)
    assert len(g) == 6 and all(len(b[0]) == 8 for b in g)
    g = gl.GadgetLoader(ds, batch_size=8, seed=3)
    it = iter(g)
    next(it)
    before = g.state_dict()
    with pytest.raises(gl.GadgetValueError, match="-1"):
        g.set_epoch(-1)
    with pytest.raises(gl.GadgetTypeError, match="str"):
        g.set_epoch("1")
    assert g.state_dict() == before
    for bad in (dict(coalesce=0), dict(prefetch=-1)):
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetLoader(ds, batch_size=8, **bad)


def test_sampler_flag_and_seed_types():
    for v in ("False", None):
        with pytest.raises(gl.GadgetTypeError, match="drop_last"):
            gl.GadgetSampler(N, batch_size=B, drop_last=v)
        with pytest.raises(gl.GadgetTypeError, match="pad"):
            gl.GadgetSampler(N, batch_size=B, pad=v)
    with pytest.raises(gl.GadgetTypeError, match="batch_size"):
        gl.GadgetSampler(N, batch_size=True)
    with pytest.raises(gl.GadgetValueError, match="seed"):
        gl.GadgetSampler(N, batch_size=B, seed=-1)
    with pytest.raises(gl.GadgetTypeError, match="seed"):
        gl.GadgetSampler(N, batch_size=B, seed=1.0)
    s = gl.GadgetSampler(np.int64(N), batch_size=np.int64(B))
    assert len(s) == -(-N // B)
    s = gl.GadgetSampler(N, batch_size=10 * N)
    assert len(s) == 1 and sorted(next(iter(s)).tolist()) == list(range(N))
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(N, batch_size=10 * N, drop_last=True)


def test_single_row_dataset_every_form():
    one = gl.GadgetDataset(np.array([7]), np.ones((1, 3), np.float32))
    assert len(one) == 1
    for batches in (
        list(DataLoader(one, batch_size=4, shuffle=True)),
        list(DataLoader(one, batch_sampler=gl.GadgetSampler(one, batch_size=4))),
        list(gl.GadgetLoader(one, batch_size=4)),
    ):
        assert len(batches) == 1
        assert _np(batches[0][0]).tolist() == [7]
        assert tuple(batches[0][1].shape) == (1, 3)
    row = one[0]
    assert int(row[0]) == 7 and row[0].dim() == 0


def test_default_form_general_id_paths():
    ds = _simple_ds()
    x = _np(ds[:][1])
    rev = np.arange(N)[::-1].copy()
    got = list(DataLoader(ds, batch_size=B, sampler=rev))  # lists of NumPy ints
    ids = np.concatenate([_np(b[0]) for b in got])
    assert ids.tolist() == rev.tolist()
    for b in got:
        np.testing.assert_array_equal(_np(b[1]), x[_np(b[0])])
    with pytest.raises(gl.GadgetTypeError, match="bool"):
        ds.__getitems__([True, 1])
    with pytest.raises(gl.GadgetTypeError):
        ds.__getitems__([1, "2"])
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__([1, N])
    # per-sample form (batch_size=None): one row per step
    rows = list(DataLoader(ds, batch_size=None))
    assert len(rows) == N
    assert [int(r[0]) for r in rows] == list(range(N))
    np.testing.assert_array_equal(np.stack([_np(r[1]) for r in rows]), x)


def test_concat_and_stack_datasets():
    ds = _simple_ds(20)
    x = _np(ds[:][1])
    cd = torch.utils.data.ConcatDataset([ds, ds])
    batches = list(DataLoader(cd, batch_size=6))
    ids = np.concatenate([_np(b[0]) for b in batches])
    assert ids.tolist() == list(range(20)) * 2
    for b in batches:
        np.testing.assert_array_equal(_np(b[1]), x[_np(b[0])])
    with pytest.raises(ValueError, match="size mismatch"):
        next(iter(DataLoader(torch.utils.data.StackDataset(ds, ds), batch_size=4)))


def test_pinned_placement_falls_back_once_and_reloaded_column_is_refused(tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = gl.GadgetDataset(np.arange(20), x, placement="pinned")
    fallback = [i for i in w if issubclass(i.category, gl.FallbackWarning)]
    assert len(fallback) == 1
    assert [c.placement for c in ds.columns] == ["cpu", "cpu"]
    np.testing.assert_array_equal(_np(ds[[3, 4]][1]), x[[3, 4]])
    g = gl.DataGadget(x, placement="cpu")
    d2 = gl.GadgetDataset(g)
    p = str(tmp_path / "seven.npy")
    np.save(p, np.zeros((7, 2), np.float32))
    g.load(p)
    with pytest.raises(gl.GadgetValueError, match="7") as ei:
        d2[[0, 1]]
    assert "20" in str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        list(DataLoader(d2, batch_size=4))


def test_sampler_on_file_gadget_takes_its_chunk_size(files):
    g = gl.DataGadget(files["h5"], placement="file")
    s = gl.GadgetSampler(g, batch_size=4, order="chunk", window_chunks=2, seed=0)
    assert s.chunk_rows == 10
    _assert_chunk_windows(sum([t.tolist() for t in s], []), 10, 2, N)
    g.close()


def test_chunk_order_file_variant_of_full_dataset(ref, files):
    ds = gl.GadgetDataset(*_columns(ref, files), placement="file")
    cr = ds.chunk_rows
    assert isinstance(cr, int) and cr >= 20
    s = gl.GadgetSampler(ds, batch_size=B, order="chunk", window_chunks=2, seed=4)
    got = [_check_batch(b, ref).tolist() for b in DataLoader(ds, batch_sampler=s)]
    _assert_chunk_windows(sum(got, []), cr, 2, N)
    ds.close()


_DIST_SCRIPT = """
import json, sys, torch.distributed as dist, gadgetloader as gl
rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
s = gl.GadgetSampler(103, batch_size=8, seed=5)
s2 = gl.GadgetSampler(103, batch_size=8, seed=5, num_replicas=world)  # rank from torch.distributed
out = {"nr": s.num_replicas, "rank": s.rank, "len": len(s),
       "b": [[b.tolist() for b in s] for _ in range(2)], "b2": [b.tolist() for b in s2]}
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_ranks_from_torch_distributed(tmp_path):
    script = tmp_path / "dist_ranks.py"
    script.write_text(_DIST_SCRIPT)
    init = f"file://{tmp_path / 'init'}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", init], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for r, o in enumerate(outs):
        assert (o["nr"], o["rank"]) == (2, r)
        ref_s = gl.GadgetSampler(103, batch_size=8, seed=5, num_replicas=2, rank=r)
        assert o["len"] == len(ref_s)
        assert o["b"] == [[t.tolist() for t in ref_s] for _ in range(2)]
        assert o["b2"] == o["b"][0]
    assert sorted(sum(outs[0]["b"][0] + outs[1]["b"][0], [])) == list(range(103))


@pytest.mark.parametrize("mode", ["pad", "drop_last", "ranks"])
def test_sampler_resume_every_position_other_modes(mode):
    n = 61
    kw = {
        "pad": dict(pad=True),
        "drop_last": dict(drop_last=True),
        "ranks": dict(num_replicas=3, rank=2),
    }[mode]
    ref_s = gl.GadgetSampler(n, batch_size=5, seed=14, **kw)
    run = [[t.tolist() for t in ref_s] for _ in range(2)]
    nb = len(run[0])
    assert nb == len(ref_s) >= 3
    for k in range(nb + 1):
        s = gl.GadgetSampler(n, batch_size=5, seed=14, **kw)
        it = iter(s)
        head = [next(it).tolist() for _ in range(k)]
        fresh = gl.GadgetSampler(n, batch_size=5, seed=0, **kw)
        fresh.load_state_dict(s.state_dict())
        assert fresh.state_dict() == s.state_dict()
        rest = [t.tolist() for t in fresh]
        if k == nb:
            assert rest == [] and [t.tolist() for t in fresh] == run[1]
        else:
            assert head + rest == run[0], k
            assert [t.tolist() for t in fresh] == run[1], k


def test_chunk_order_ranks_share_at_most_one_window_per_boundary():
    n, cr, wc, R = 240, 8, 3, 3
    samplers = [
        gl.GadgetSampler(
            n,
            batch_size=6,
            order="chunk",
            chunk_rows=cr,
            window_chunks=wc,
            seed=2,
            num_replicas=R,
            rank=r,
        )
        for r in range(R)
    ]
    per = [sum([t.tolist() for t in s], []) for s in samplers]
    order = samplers[0].epoch_order(0).tolist()
    assert sum(per, []) == order
    _assert_chunk_windows(order, cr, wc, n)
    chunks = [{row // cr for row in p} for p in per]
    pos = {row: i for i, row in enumerate(order)}
    win = cr * wc
    for a in range(R):
        for b in range(a + 1, R):
            shared = chunks[a] & chunks[b]
            if b > a + 1:
                assert not shared
            windows = {pos[c * cr] // win for c in shared}
            assert len(windows) <= 1


def test_chunk_state_refused_for_other_layout():
    s = gl.GadgetSampler(80, batch_size=8, seed=3, order="chunk", chunk_rows=5, window_chunks=2)
    it = iter(s)
    next(it)
    st = s.state_dict()
    for kw in (dict(chunk_rows=5, window_chunks=3), dict(chunk_rows=10, window_chunks=2)):
        f = gl.GadgetSampler(80, batch_size=8, seed=3, order="chunk", **kw)
        before = f.state_dict()
        with pytest.raises(gl.GadgetValueError, match="window_chunks|chunk_rows"):
            f.load_state_dict(st)
        assert f.state_dict() == before


def test_sampler_for_other_row_count_is_caught():
    ds = _simple_ds()
    with pytest.raises(gl.GadgetIndexError):
        list(
            DataLoader(ds, batch_sampler=gl.GadgetSampler(N + 97, batch_size=B, order="sequential"))
        )
    with pytest.raises(gl.GadgetValueError, match=str(N)):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(N + 97, batch_size=B))
    with pytest.raises(gl.GadgetValueError, match=str(N)):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(N - 3, batch_size=B))


@NEEDS_TORCHDATA
def test_stateful_dataloader_default_form_resume(full_ds, ref):
    def make():
        return StatefulDataLoader(
            full_ds, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    run = [_check_batch(b, ref).tolist() for b in make()]
    a = make()
    it = iter(a)
    head = [_check_batch(next(it), ref).tolist() for _ in range(5)]
    st = a.state_dict()
    del it
    b = make()
    b.load_state_dict(st)
    assert head + [_check_batch(x, ref).tolist() for x in b] == run


def test_gadget_loader_spawn_worker(ref, files):
    ds = gl.GadgetDataset(*_columns(ref, files), placement="file")
    want = [_check_batch(b, ref).tolist() for b in gl.GadgetLoader(ds, batch_size=B, seed=9)]
    loader = gl.GadgetLoader(
        ds, batch_size=B, seed=9, num_workers=1, multiprocessing_context="spawn"
    )
    assert isinstance(loader.dataloader, DataLoader)
    assert loader.dataloader.num_workers == 1
    got = [_check_batch(b, ref).tolist() for b in loader]
    assert got == want
    ds.close()


def test_gadget_loader_refuses_dataloader_args_it_sets():
    ds = _simple_ds(20)
    for kw in (dict(collate_fn=lambda b: b), dict(shuffle=True), dict(batch_sampler=None)):
        with pytest.raises(gl.GadgetTypeError, match=next(iter(kw))):
            gl.GadgetLoader(ds, batch_size=4, **kw)


@pytest.mark.parametrize("name", ["a.npy", "a.h5", "c.h5"])
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_see_file_writes_between_epochs(tmp_path, name, persistent):
    import h5py

    n = 64
    a = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    path = str(tmp_path / name)
    if name.endswith(".npy"):
        np.save(path, a)
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset(
                "x", data=a, chunks=(8, 2), compression="gzip" if name == "c.h5" else None
            )
    ds = gl.GadgetDataset(np.arange(n), path, placement="file")
    loader = DataLoader(
        ds,
        batch_size=16,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=persistent,
    )
    np.testing.assert_array_equal(torch.cat([b[1] for b in loader]).numpy(), a)
    ds.columns[1].insertData(torch.full((3, 2), -1.0), [0, 2, n - 1])
    expect = a.copy()
    expect[[0, 2, n - 1]] = -1.0
    got = torch.cat([b[1] for b in loader]).numpy()
    if persistent and name == "c.h5":
        # README: persistent workers keep a compressed HDF5 column's block cache
        assert got[[0, 2, n - 1]].tolist() in (
            a[[0, 2, n - 1]].tolist(),
            expect[[0, 2, n - 1]].tolist(),
        )
    else:
        np.testing.assert_array_equal(got, expect)
    ds.close()


def _loop_with_set_epoch(kind: str, workers: int):
    ds = _simple_ds(77)
    s = gl.GadgetSampler(ds, batch_size=6, seed=4, num_replicas=2, rank=1)
    kw = dict(num_workers=workers)
    if workers:
        kw["multiprocessing_context"] = "fork"
    if kind == "batch_sampler":
        return s, StatefulDataLoader(ds, batch_sampler=s, **kw)
    if kind == "sampler":
        return s, StatefulDataLoader(ds, sampler=s, batch_size=None, **kw)
    loader = gl.GadgetLoader(ds, sampler=s, **kw)
    return loader, loader


@NEEDS_TORCHDATA
@pytest.mark.parametrize("kind", ["batch_sampler", "sampler", "gadget_loader"])
@pytest.mark.parametrize("workers", [0, 2])
def test_distributed_style_loop_resume(kind, workers):
    """The DistributedSampler loop (set_epoch at the top of every epoch, the resumed one
    included), interrupted anywhere and resumed in a fresh loader, gives the uninterrupted run."""
    epochs = 3
    s, loader = _loop_with_set_epoch(kind, workers)
    full = []
    for e in range(epochs):
        s.set_epoch(e)
        full += [(e, _np(b[0]).tolist()) for b in loader]
    nb = len(loader)
    assert nb == 7 and len(full) == epochs * nb
    assert full[:nb] != full[nb : 2 * nb]
    for stop_e, stop_k in ((0, 0), (0, 1), (1, 4), (1, nb), (2, 3)):
        s, loader = _loop_with_set_epoch(kind, workers)
        got = []
        state = None
        for e in range(epochs):
            s.set_epoch(e)
            if (e, 0) == (stop_e, stop_k):
                state = loader.state_dict()
                break
            for k, b in enumerate(loader):
                got.append((e, _np(b[0]).tolist()))
                if (e, k + 1) == (stop_e, stop_k):
                    state = loader.state_dict()
                    break
            if state is not None:
                break
        s2, loader2 = _loop_with_set_epoch(kind, workers)
        loader2.load_state_dict(state)
        for e in range(stop_e, epochs):
            s2.set_epoch(e)
            got += [(e, _np(b[0]).tolist()) for b in loader2]
        assert got == full, (stop_e, stop_k)


def test_gadget_loader_latest_pass_owns_the_state():
    ds = _simple_ds()
    e0 = [t.tolist() for t in gl.GadgetSampler(N, batch_size=B, seed=6)]
    g = gl.GadgetLoader(ds, batch_size=B, seed=6)
    it1 = iter(g)
    assert _np(next(it1)[0]).tolist() == e0[0]
    it2 = iter(g)
    assert [_np(next(it2)[0]).tolist() for _ in range(3)] == e0[:3]
    assert [_np(next(it1)[0]).tolist() for _ in range(4)] == e0[1:5]
    st = g.state_dict()
    g2 = gl.GadgetLoader(ds, batch_size=B, seed=6)
    g2.load_state_dict(st)
    assert _ids_of(g2) == e0[3:]
    # set_epoch on the sampler of a loader left mid-epoch wins
    s = gl.GadgetSampler(ds, batch_size=B, seed=6)
    g3 = gl.GadgetLoader(ds, sampler=s)
    it = iter(g3)
    next(it)
    next(it)
    s.set_epoch(5)
    assert sum(_ids_of(g3), []) == s.epoch_order(5).tolist()


def test_writes_between_batches_are_seen_without_read_ahead():
    n = 203
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    g = gl.DataGadget(x.copy(), placement="cpu")
    ds = gl.GadgetDataset(np.arange(n), g)
    loaders = {
        "sampler coalesce=1": DataLoader(
            ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8, order="sequential", coalesce=1)
        ),
        "GadgetLoader prefetch=0": gl.GadgetLoader(
            ds, batch_size=8, order="sequential", prefetch=0
        ),
        "GadgetLoader default on the CPU": gl.GadgetLoader(ds, batch_size=8, order="sequential"),
    }
    for name, loader in loaders.items():
        g.insertData(torch.from_numpy(x), np.arange(n))
        for i, b in enumerate(loader):
            if i < 24:  # write the next batch's rows
                g.insertData(torch.full((8, 2), -5.0 - i), list(range((i + 1) * 8, (i + 2) * 8)))
            if 1 <= i <= 24:
                assert (b[1] == -5.0 - (i - 1)).all(), (name, i)
            if i == 0:
                np.testing.assert_array_equal(_np(b[1]), x[:8])


def test_interleaved_read_ahead_loaders_and_in_place_changes():
    n = 203
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    ds = gl.GadgetDataset(np.arange(n), x)
    sa = gl.GadgetSampler(ds, batch_size=8, seed=1, coalesce=4)
    sb = gl.GadgetSampler(ds, batch_size=8, seed=2, coalesce=4)
    count = 0
    for a, b in zip(
        DataLoader(ds, batch_sampler=sa), DataLoader(ds, batch_sampler=sb), strict=True
    ):
        for t in (a, b):
            np.testing.assert_array_equal(_np(t[1]), x[_np(t[0])])
            t[1].add_(1000.0)  # a batch changed in place changes no other request's rows
            count += 1
    assert count == 2 * len(sa)
    s = gl.GadgetSampler(ds, batch_size=8, seed=1, coalesce=4)
    l1 = iter(DataLoader(ds, batch_sampler=s))
    l2 = iter(DataLoader(ds, batch_sampler=s))
    for _ in range(10):
        for it in (l1, l2):
            t = next(it)
            np.testing.assert_array_equal(_np(t[1]), x[_np(t[0])])
            t[1].mul_(-1.0)


def test_concat_dataset_collate_fn_gets_one_tuple_per_sample():
    ds = _simple_ds(12)
    x = _np(ds[:][1])
    seen = []

    def collate(samples):
        seen.append(samples)
        return samples

    out = list(
        DataLoader(torch.utils.data.ConcatDataset([ds, ds]), batch_size=5, collate_fn=collate)
    )
    assert [len(o) for o in out] == [5, 5, 5, 5, 4]
    for batch in out:
        for sample in batch:
            assert isinstance(sample, tuple) and len(sample) == 2
            np.testing.assert_array_equal(_np(sample[1]), x[int(sample[0])])


def test_dataset_and_loaders_warn_nothing_on_cpu():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = gl.GadgetDataset(np.arange(30), np.ones((30, 2), np.float32), torch.ones(30))
        assert [c.placement for c in ds.columns] == ["cpu"] * 3
        loader = gl.GadgetLoader(ds, batch_size=4, prefetch=3)
        assert len(list(loader)) == 8 and len(list(loader)) == 8
        assert len(list(DataLoader(ds, batch_size=4, shuffle=True))) == 8
        assert len(list(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4)))) == 8
    assert [str(i.message) for i in w] == []


def test_gadget_loader_persistent_workers_break_and_iterate_again():
    ds = _simple_ds()
    ref_s = gl.GadgetSampler(N, batch_size=8, seed=6)
    run = [[t.tolist() for t in ref_s] for _ in range(3)]
    g = gl.GadgetLoader(
        ds,
        batch_size=8,
        seed=6,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    for i, _b in enumerate(g):
        if i == 1:
            break
    assert _ids_of(g) == run[0]  # broken mid-epoch: the same epoch anew, from its first batch
    for i, _b in enumerate(g):
        if i == 5:
            break
    assert _ids_of(g) == run[1]
    assert _ids_of(g) == run[2]
    s = gl.GadgetSampler(ds, batch_size=8, seed=6)
    loader = DataLoader(
        ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork", persistent_workers=True
    )
    for i, _b in enumerate(loader):
        if i == 2:
            break
    s.set_epoch(0)
    assert _ids_of(loader) == run[0]
    assert _ids_of(loader) == run[1]


def test_states_round_trip_and_corrupted_states_are_refused():
    import io
    import types

    s = gl.GadgetSampler(50, batch_size=8, seed=3)
    it = iter(s)
    next(it)
    st = s.state_dict()
    buf = io.BytesIO()
    torch.save(st, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == st
    f = gl.GadgetSampler(50, batch_size=8)
    f.load_state_dict(types.MappingProxyType(st))  # any read-only mapping
    assert f.state_dict() == st
    for bad in (
        {},
        dict(st, version=2),
        dict(st, position=99),
        dict(st, position=-1),
        dict(st, epoch=-1),
        dict(st, position="3"),
        dict(st, seed=1.5),
    ):
        f = gl.GadgetSampler(50, batch_size=8, seed=11)
        before = f.state_dict()
        with pytest.raises(gl.GadgetError):
            f.load_state_dict(bad)
        assert f.state_dict() == before
    g = gl.GadgetLoader(_simple_ds(50), batch_size=8, seed=3)
    it = iter(g)
    next(it)
    gst = g.state_dict()
    assert json.loads(json.dumps(gst)) == gst
    for bad in ({}, st, {"sampler": {}}):
        with pytest.raises(gl.GadgetValueError):
            g.load_state_dict(bad)
    assert g.state_dict() == gst


def test_order_depends_only_on_seed_epoch_and_layout():
    ds = gl.GadgetDataset(np.arange(N))
    base = gl.GadgetSampler(N, batch_size=8, seed=5).epoch_order(2).tolist()
    assert sorted(base) == list(range(N))
    for kw in (
        dict(batch_size=13),
        dict(batch_size=8, num_replicas=3, rank=1),
        dict(batch_size=8, pad=True),
        dict(batch_size=8, drop_last=True),
        dict(batch_size=8, coalesce=3),
    ):
        assert gl.GadgetSampler(N, seed=5, **kw).epoch_order(2).tolist() == base, kw
        assert gl.GadgetSampler(ds, seed=5, **kw).epoch_order(2).tolist() == base, kw
    assert gl.GadgetSampler(N, batch_size=8, seed=6).epoch_order(2).tolist() != base
    assert gl.GadgetSampler(N, batch_size=8, seed=5).epoch_order(3).tolist() != base


@pytest.mark.parametrize("bs,cr,expect", [(7, 10, 12), (2, 10, 8), (16, 10, 26), (5, 1, 80)])
def test_default_window_chunks_hold_16_batches(bs, cr, expect):
    s = gl.GadgetSampler(1000, batch_size=bs, order="chunk", chunk_rows=cr)
    assert s.window_chunks == expect  # enough chunks for 16 batches, at least 8
    _assert_chunk_windows(sum([t.tolist() for t in s], []), cr, expect, 1000)


def test_large_batches_default_and_sampler_form():
    n = 100_003
    y = (np.arange(n) % 251).astype(np.uint8)
    ds = gl.GadgetDataset(np.arange(n), y)
    for loader in (
        DataLoader(ds, batch_size=70_000, shuffle=True),
        DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=70_000)),
    ):
        got = list(loader)
        assert [len(b[0]) for b in got] == [70_000, n - 70_000]
        for b in got:
            np.testing.assert_array_equal(_np(b[1]), y[_np(b[0])])
        ids = np.concatenate([_np(b[0]) for b in got])
        assert np.array_equal(np.sort(ids), np.arange(n))
