"""Black-box review (session 33): the input pipeline with torch DataLoader options.

GadgetDataset / GadgetSampler / GadgetLoader combined with what a user tries on a
DataLoader: num_workers 0/1/2, persistent_workers, prefetch_factor, pin_memory,
custom collate_fn, batch_size=None with a batch sampler, drop_last, generator=,
worker_init_fn, fork/spawn contexts, len(), iterating twice, set_epoch, state_dict /
load_state_dict mid-epoch with workers, file-backed columns (.npy, HDF5, zarr) mixed with
in-RAM columns and tensors, 1-D label columns and mixed dtypes.

Every test checks that each row is seen exactly once per epoch (where the docs promise
it) and that the values equal NumPy's indexing of the source arrays.
Written from README.md, SPEC.md and the public docstrings only.
"""

from __future__ import annotations

import functools
import gc
import inspect
import math
import multiprocessing
import os
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    ConcatDataset,
    DataLoader,
    RandomSampler,
    Subset,
    get_worker_info,
    random_split,
)

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
pytest.importorskip("zarr")

HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader).parameters


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# --------------------------------------------------------------------------------------
# data: 29 rows, columns of many dtypes, three of them file-backed
# --------------------------------------------------------------------------------------

N = 29
ID_COL = 3  # the int64 label column holds the row id: it tells which rows a batch holds


def _refs() -> list[np.ndarray]:
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3) + 0.5  # .npy file
    h = np.arange(N * 2, dtype=np.float64).reshape(N, 2) * 1.25  # HDF5 (gzip, chunks of 4)
    z = (np.arange(N * 2).reshape(N, 2) - 30).astype(np.int16)  # zarr (chunks of 6)
    y = np.arange(N, dtype=np.int64)  # 1-D labels = row ids
    w = (np.arange(N) / 4).astype(np.float16)  # 1-D float16
    b = np.arange(N) % 3 == 0  # 1-D bool
    t = (np.arange(N * 4) % 100).astype(np.int8).reshape(N, 2, 2)  # torch int8 tensor, 2-D rows
    return [x, h, z, y, w, b, t]


BF = (torch.arange(N, dtype=torch.float32) / 8).to(torch.bfloat16)  # bfloat16 tensor column


@pytest.fixture()
def files(tmp_path):
    refs = _refs()
    np.save(tmp_path / "x.npy", refs[0])
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f.create_dataset("grp/h", data=refs[1], chunks=(4, 2), compression="gzip")
    zsrc = gl.DataGadget(refs[2], placement="cpu")
    zsrc.save(str(tmp_path / "z.zarr"), chunk_rows=6)
    zsrc.close()
    return tmp_path, refs


def _mixed_dataset(tmp_path, *, via_paths: bool = False) -> gl.GadgetDataset:
    refs = _refs()
    y, w, b, t = refs[3], refs[4], refs[5], torch.from_numpy(refs[6].copy())
    if via_paths:
        # paths opened file-backed by the dataset itself; arrays/tensors take an in-memory placement
        return gl.GadgetDataset(
            str(tmp_path / "x.npy"),
            gl.DataGadget(str(tmp_path / "h.h5"), dataset="grp/h", placement="file"),
            gl.DataGadget(str(tmp_path / "z.zarr"), placement="file"),
            y,
            w,
            b,
            t,
            BF.clone(),
            placement="file",
            device="cpu",
        )
    return gl.GadgetDataset(
        gl.DataGadget(str(tmp_path / "x.npy"), placement="file"),
        gl.DataGadget(str(tmp_path / "h.h5"), dataset="grp/h", placement="file"),
        gl.DataGadget(str(tmp_path / "z.zarr"), placement="file"),
        gl.DataGadget(y, placement="cpu"),
        gl.DataGadget(w, placement="cpu"),
        gl.DataGadget(b, placement="cpu"),
        gl.DataGadget(t, placement="cpu"),
        gl.DataGadget(BF.clone(), placement="cpu"),
        device="cpu",
    )


def _ref_columns() -> list[torch.Tensor]:
    return [torch.from_numpy(r.copy()) for r in _refs()] + [BF.clone()]


def _check_batch(batch, refs=None) -> torch.Tensor:
    """Values of every column equal the source at the batch's ids; returns the ids."""
    refs = _ref_columns() if refs is None else refs
    assert len(batch) == len(refs)
    ids = batch[ID_COL]
    assert ids.dtype == torch.int64 and ids.dim() == 1
    for k, (col, ref) in enumerate(zip(batch, refs, strict=False)):
        assert col.dtype == ref.dtype, (k, col.dtype, ref.dtype)
        assert col.device.type == "cpu"
        assert tuple(col.shape) == (len(ids),) + tuple(ref.shape[1:]), (k, col.shape)
        assert torch.equal(col, ref[ids]), (
            f"column {k} differs from the source at ids {ids.tolist()}"
        )
    return ids


def _check_epoch(batches, n=N, refs=None) -> list[int]:
    """Every row exactly once, every value right; returns the ids in the order seen."""
    seen: list[int] = []
    for batch in batches:
        seen += _check_batch(batch, refs).tolist()
    assert sorted(seen) == list(range(n)), f"rows not seen exactly once: {sorted(seen)}"
    return seen


def _simple(n=N):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) * 2 + 1
    y = np.arange(n, dtype=np.int64)
    return x, y, gl.GadgetDataset(x, y, placement="cpu", device="cpu")


def _ids(batches, col=1) -> list[list[int]]:
    return [b[col].tolist() for b in batches]


def _flat(batches, col=1) -> list[int]:
    return [i for b in batches for i in b[col].tolist()]


def _iterate_expecting_error(loader):
    """Iterate ``loader`` to its end; return (type, message) of the error it raised.

    The traceback is dropped at once: torch's re-raise puts the failed multi-process
    iterator in a reference cycle through it, and an iterator destroyed by the garbage
    collector later waits 5 s per worker to shut down (or is destroyed in a later fork)."""
    try:
        for _ in loader:
            pass
    except Exception as e:  # noqa: BLE001 - the caller checks the type
        e.__traceback__ = None
        kind, msg = type(e), str(e)
        del e
        gc.collect()
        return kind, msg
    return None, None


# module-level helpers (picklable for worker processes)


def _collate_to_dict(batch):
    assert isinstance(batch, list) and len(batch) == 1, type(batch)
    b = batch[0]
    assert isinstance(b, gl.GadgetBatch)
    return {"x": b[0], "y": b[1], "n_items": len(batch)}


def _collate_describe(batch):
    return len(batch), type(batch[0]).__name__, [tuple(t.shape) for t in batch[0]], batch


def _stash_probe(worker_id):
    info = get_worker_info()
    ds = info.dataset
    first = ds[0]
    ds._probe = (
        worker_id,
        info.num_workers,
        [float(v) for v in first[0].tolist()],
        int(first[ID_COL]),
        ds[[1, 2]][0].device.type,
    )


def _collate_with_probe(batch):
    return batch[0], get_worker_info().dataset._probe


def _record_seed(folder, tag, worker_id):
    with open(os.path.join(folder, f"{tag}-{worker_id}"), "w") as f:
        f.write(str(torch.initial_seed()))


class _StorageProbe(gl.GadgetDataset):
    """Adds a column holding the byte size of the storage of the ids the worker received."""

    def __getitems__(self, ids):
        batch = super().__getitems__(ids)[0]
        nbytes = ids.untyped_storage().nbytes() if torch.is_tensor(ids) else -1
        return [gl.GadgetBatch(tuple(batch) + (torch.tensor(nbytes),))]


class _SlowWorkerZero(gl.GadgetDataset):
    """Worker 0 answers slowly, so that batches finish out of order."""

    def __getitems__(self, ids):
        info = get_worker_info()
        if info is not None and info.id == 0:
            time.sleep(0.15)
        return super().__getitems__(ids)


# ======================================================================================
# the default form: DataLoader(ds, batch_size=..., shuffle=True)
# ======================================================================================


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("via_paths", [False, True], ids=["gadgets", "paths"])
def test_default_form_mixed_columns_every_row_once(files, num_workers, via_paths):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path, via_paths=via_paths)
    assert len(ds) == N
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=num_workers)
    assert len(dl) == math.ceil(N / 4)
    batches = list(dl)
    assert len(batches) == len(dl)
    assert all(isinstance(b, gl.GadgetBatch) for b in batches)
    _check_epoch(batches)
    # iterating twice: a second epoch, again every row once
    _check_epoch(list(dl))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_form_generator_gives_torch_order(num_workers):
    x, y, ds = _simple()
    got = list(
        DataLoader(
            ds,
            batch_size=4,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(7),
        )
    )
    want = list(
        DataLoader(range(N), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    )
    assert len(got) == len(want)
    for b, ids in zip(got, want, strict=False):
        assert torch.equal(b[1], ids)
        assert torch.equal(b[0], torch.from_numpy(x)[ids])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_form_drop_last(num_workers):
    x, y, ds = _simple()
    dl = DataLoader(ds, batch_size=4, shuffle=True, drop_last=True, num_workers=num_workers)
    assert len(dl) == N // 4
    batches = list(dl)
    assert len(batches) == N // 4
    assert all(len(b[1]) == 4 for b in batches)
    seen = _flat(batches)
    assert len(set(seen)) == len(seen) == (N // 4) * 4
    for b in batches:
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])


def test_default_form_persistent_workers_epochs_differ(files):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)
    dl = DataLoader(
        ds,
        batch_size=5,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        prefetch_factor=1,
        generator=torch.Generator().manual_seed(3),
    )
    e0 = _check_epoch(list(dl))
    e1 = _check_epoch(list(dl))
    assert e0 != e1  # a fresh shuffle each epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_form_batch_size_none_gives_single_rows(num_workers):
    x, y, ds = _simple()
    out = list(DataLoader(ds, batch_size=None, num_workers=num_workers))
    assert len(out) == N
    for i, (row, label) in enumerate(out):
        assert torch.equal(row, torch.from_numpy(x[i]))
        assert label.dim() == 0 and int(label) == i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate_fn_gets_one_element_list(num_workers):
    x, y, ds = _simple()
    out = list(
        DataLoader(
            ds, batch_size=6, shuffle=True, num_workers=num_workers, collate_fn=_collate_to_dict
        )
    )
    seen = []
    for d in out:
        assert d["n_items"] == 1
        assert torch.equal(d["x"], torch.from_numpy(x)[d["y"]])
        seen += d["y"].tolist()
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate_fn_sampler_forms(num_workers):
    x, y, ds = _simple()
    s = gl.GadgetSampler(ds, batch_size=6, seed=2)
    out = list(
        DataLoader(ds, batch_sampler=s, num_workers=num_workers, collate_fn=_collate_describe)
    )
    assert [o[0] for o in out] == [1] * len(s)
    assert all(o[1] == "GadgetBatch" for o in out)
    assert [o[2][0][0] for o in out] == [6, 6, 6, 6, 5]
    got = [i for o in out for i in o[3][0][1].tolist()]
    assert got == s.epoch_order(0).tolist()


def test_concat_dataset_batches_are_per_sample():
    x, y, ds = _simple()
    ds2 = gl.GadgetDataset(x + 100, y + 100, placement="cpu", device="cpu")
    cds = ConcatDataset([ds, ds2])
    out = list(DataLoader(cds, batch_size=4, num_workers=2, collate_fn=_collate_describe))
    n_items, kind, shapes, _ = out[0]
    assert (n_items, kind, shapes) == (4, "tuple", [(3,), ()])  # one tuple per sample
    got = list(DataLoader(cds, batch_size=6, shuffle=True, num_workers=2))
    seen = _flat(got)
    assert sorted(seen) == list(range(N)) + list(range(100, 100 + N))
    xx = np.concatenate([x, x + 100])
    yy = np.concatenate([y, y + 100])
    for b in got:
        pos = torch.from_numpy(np.searchsorted(yy, b[1].numpy()))
        assert torch.equal(b[0], torch.from_numpy(xx)[pos])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_subset_and_random_split_with_workers(num_workers):
    x, y, ds = _simple()
    sub = Subset(ds, list(range(3, N, 2)))
    got = list(DataLoader(sub, batch_size=4, shuffle=True, num_workers=num_workers))
    assert all(isinstance(b, gl.GadgetBatch) for b in got)  # a batch is still one gather
    assert sorted(_flat(got)) == list(range(3, N, 2))
    for b in got:
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])
    train, val = random_split(ds, [20, N - 20], generator=torch.Generator().manual_seed(0))
    got = list(DataLoader(val, batch_size=3, num_workers=num_workers))
    assert _flat(got) == list(val.indices)


def test_stackdataset_refused_as_documented():
    x, y, ds = _simple()
    st = torch.utils.data.StackDataset(ds, ds)
    with pytest.raises(ValueError, match="size mismatch"):
        next(iter(DataLoader(st, batch_size=4)))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("form", ["default", "batch_sampler", "sampler"])
def test_pin_memory_true_gives_same_batches(num_workers, form):
    x, y, ds = _simple()

    def make(pin):
        if form == "default":
            return DataLoader(
                ds,
                batch_size=4,
                shuffle=True,
                num_workers=num_workers,
                pin_memory=pin,
                generator=torch.Generator().manual_seed(1),
            )
        s = gl.GadgetSampler(ds, batch_size=4, seed=1)
        if form == "batch_sampler":
            return DataLoader(ds, batch_sampler=s, num_workers=num_workers, pin_memory=pin)
        return DataLoader(ds, sampler=s, batch_size=None, num_workers=num_workers, pin_memory=pin)

    plain = list(make(False))
    with warnings.catch_warnings():
        # torch warns where there is no accelerator to pin for; not the library's concern
        warnings.filterwarnings("ignore", message=".*pin_memory.*", category=UserWarning)
        pinned = list(make(True))
    assert len(plain) == len(pinned) == math.ceil(N / 4)
    for a, b in zip(plain, pinned, strict=False):
        assert len(a) == len(b) == 2
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])


@pytest.mark.parametrize("num_workers", [1, 2])
def test_worker_init_fn_sees_a_working_dataset_copy(files, num_workers):
    tmp_path, refs = files
    ds = _mixed_dataset(tmp_path)
    out = list(
        DataLoader(
            ds,
            batch_size=5,
            shuffle=True,
            num_workers=num_workers,
            worker_init_fn=_stash_probe,
            collate_fn=_collate_with_probe,
        )
    )
    _check_epoch([b for b, _ in out])
    probes = sorted(set((p[0], p[1], tuple(p[2]), p[3], p[4]) for _, p in out))
    # each worker ran worker_init_fn once, and its copy of the dataset reads the file right
    assert [p[0] for p in probes] == list(range(num_workers))
    for p in probes:
        assert p[1] == num_workers
        assert list(p[2]) == refs[0][0].tolist()
        assert p[3] == 0
        assert p[4] == "cpu"  # rows gathered in a worker are CPU tensors


@pytest.mark.skipif(not HAS_IN_ORDER, reason="DataLoader(in_order=...) needs torch >= 2.6")
def test_default_and_sampler_form_in_order_false():
    x, y, ds = _simple()
    got = list(DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, in_order=False))
    assert sorted(_flat(got)) == list(range(N))
    s = gl.GadgetSampler(ds, batch_size=4, seed=4)
    got = list(DataLoader(ds, batch_sampler=s, num_workers=2, in_order=False))
    assert sorted(_flat(got)) == list(range(N))
    for b in got:
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])


# ======================================================================================
# the sampler forms: DataLoader(ds, batch_sampler=s) / DataLoader(ds, sampler=s, batch_size=None)
# ======================================================================================


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("coalesce", [None, 1, 3])
def test_batch_sampler_form_follows_epoch_order(files, num_workers, coalesce):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)
    s = gl.GadgetSampler(ds, batch_size=4, seed=11, coalesce=coalesce)
    dl = DataLoader(ds, batch_sampler=s, num_workers=num_workers)
    assert len(dl) == len(s) == math.ceil(N / 4)
    batches = list(dl)
    assert len(batches) == len(s)
    seen = _check_epoch(batches)
    assert seen == s.epoch_order(0).tolist()
    assert s.epoch == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_batch_size_none_form(files, num_workers):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)
    s = gl.GadgetSampler(ds, batch_size=4, seed=11)
    dl = DataLoader(ds, sampler=s, batch_size=None, num_workers=num_workers)
    assert len(dl) == len(s)
    batches = list(dl)
    # torch's default_convert turns the tuple into a list of the same tensors
    assert all(isinstance(b, list) for b in batches)
    seen = _check_epoch(batches)
    assert seen == s.epoch_order(0).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_without_batch_size_none_is_refused(num_workers):
    x, y, ds = _simple()
    s = gl.GadgetSampler(ds, batch_size=4)
    kind, msg = _iterate_expecting_error(DataLoader(ds, sampler=s, num_workers=num_workers))
    assert kind is not None and issubclass(kind, gl.GadgetValueError), kind
    assert "batch_sampler" in msg and "batch_size=None" in msg, msg


@pytest.mark.parametrize("persistent", [False, True])
def test_sampler_epochs_advance_with_workers(persistent):
    x, y, ds = _simple()
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    dl = DataLoader(ds, batch_sampler=s, num_workers=2, persistent_workers=persistent)
    for e in range(3):
        got = list(dl)
        assert _flat(got) == s.epoch_order(e).tolist()
        for b in got:
            assert torch.equal(b[0], torch.from_numpy(x)[b[1]])
    assert s.epoch == 3
    assert s.epoch_order(0).tolist() != s.epoch_order(1).tolist()


@pytest.mark.parametrize("persistent", [False, True])
def test_set_epoch_between_epochs_with_workers(persistent):
    x, y, ds = _simple()
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    dl = DataLoader(ds, batch_sampler=s, num_workers=2, persistent_workers=persistent)
    first = list(dl)
    s.set_epoch(3)
    assert _flat(list(dl)) == s.epoch_order(3).tolist()
    s.set_epoch(0)
    replay = list(dl)
    assert len(replay) == len(first)
    for a, b in zip(first, replay, strict=False):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_early_break_then_set_epoch_with_workers():
    # "DataLoader workers draw ahead of the loop, so after an early break call set_epoch"
    x, y, ds = _simple(11)  # 3 batches: the workers draw all of them ahead
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    want = [t.tolist() for t in gl.GadgetSampler(11, batch_size=4, seed=5)]
    dl = DataLoader(ds, batch_sampler=s, num_workers=2)
    it = iter(dl)
    assert next(it)[1].tolist() == want[0]
    del it
    s.set_epoch(0)
    assert _ids(list(dl)) == want


def test_sampler_state_counts_batches_drawn_ahead_by_workers():
    x, y, ds = _simple()
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    it = iter(DataLoader(ds, batch_sampler=s, num_workers=2))
    next(it)
    pos = s.state_dict()["position"]
    del it
    assert 1 < pos <= len(s)


def test_sampler_order_ignores_global_rng_and_worker_count():
    x, y, ds = _simple()
    out = []
    for seed, nw in [(0, 0), (1, 2), (2, 1)]:
        torch.manual_seed(seed)
        np.random.seed(seed)
        s = gl.GadgetSampler(ds, batch_size=4, seed=8)
        out.append(_ids(list(DataLoader(ds, batch_sampler=s, num_workers=nw))))
    assert out[0] == out[1] == out[2]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_drop_last_and_pad_with_workers(num_workers):
    x, y, ds = _simple()
    s = gl.GadgetSampler(ds, batch_size=4, seed=6, drop_last=True)
    got = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
    assert len(got) == len(s) == N // 4
    assert all(len(b[1]) == 4 for b in got)
    assert _flat(got) == s.epoch_order(0).tolist()[: (N // 4) * 4]
    s = gl.GadgetSampler(ds, batch_size=4, seed=6, pad=True)
    got = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
    assert len(got) == len(s) == math.ceil(N / 4)
    assert all(len(b[1]) == 4 for b in got)
    order = s.epoch_order(0).tolist()
    missing = 4 * math.ceil(N / 4) - N
    assert _flat(got) == order + order[:missing]
    for b in got:
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_ranks_with_workers_cover_all_rows_once(num_workers):
    x, y, ds = _simple()
    seen, lens = [], []
    for r in (0, 1):
        s = gl.GadgetSampler(ds, batch_size=4, num_replicas=2, rank=r, seed=3)
        got = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
        lens.append(len(got))
        assert len(got) == len(s)
        seen += _flat(got)
        for b in got:
            assert torch.equal(b[0], torch.from_numpy(x)[b[1]])
    assert lens[0] == lens[1]
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize(
    "kw",
    [dict(order="random"), dict(order="sequential"), dict(order="random", pad=True)],
    ids=["random", "sequential", "pad"],
)
def test_sampler_batch_travels_to_worker_as_its_own_ids(kw):
    n = 50_000
    ds = _StorageProbe(np.arange(n, dtype=np.int64), placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=7, seed=0, **kw)
    it = iter(DataLoader(ds, batch_sampler=s, num_workers=1))
    got = [next(it) for _ in range(3)]
    del it
    want = [
        t.tolist()
        for _, t in zip(range(3), gl.GadgetSampler(n, batch_size=7, seed=0, **kw), strict=False)
    ]
    assert [b[0].tolist() for b in got] == want
    # the worker received 7 ids (56 bytes), not the epoch's whole order
    assert [int(b[1]) for b in got] == [7 * 8] * 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_chunk_order_over_file_columns_with_workers(files, num_workers):
    tmp_path, refs = files
    h = gl.DataGadget(str(tmp_path / "h.h5"), dataset="grp/h", placement="file")
    z = gl.DataGadget(str(tmp_path / "z.zarr"), placement="file")
    ds = gl.GadgetDataset(h, z, gl.DataGadget(refs[3], placement="cpu"), device="cpu")
    # chunks of 4 (HDF5) and 6 (zarr): least common multiple 12 <= 2 * 6
    assert ds.chunk_rows == 12
    s = gl.GadgetSampler(ds, batch_size=5, order="chunk", seed=2)
    assert s.chunk_rows == 12
    col_refs = [torch.from_numpy(refs[1]), torch.from_numpy(refs[2]), torch.from_numpy(refs[3])]
    for e in range(2):
        got = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
        assert len(got) == len(s)
        seen = []
        for b in got:
            ids = b[2]
            assert torch.equal(b[0], col_refs[0][ids]) and torch.equal(b[1], col_refs[1][ids])
            seen += ids.tolist()
        assert sorted(seen) == list(range(N))
        assert seen == s.epoch_order(e).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("form", ["batch_sampler", "sampler"])
def test_stateful_dataloader_resumes_with_workers(num_workers, form):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    x, y, ds = _simple()
    want = gl.GadgetSampler(N, batch_size=4, seed=3)
    e0, e1 = want.epoch_order(0).tolist(), want.epoch_order(1).tolist()

    def make(seed):
        d = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
        s = gl.GadgetSampler(d, batch_size=4, seed=seed)
        kw = dict(batch_sampler=s) if form == "batch_sampler" else dict(sampler=s, batch_size=None)
        return sdl.StatefulDataLoader(d, num_workers=num_workers, **kw)

    dl = make(3)
    it = iter(dl)
    head = [next(it) for _ in range(3)]
    state = dl.state_dict()
    del it
    dl2 = make(99)  # the loaded state brings its seed with it
    dl2.load_state_dict(state)
    tail = list(dl2)
    assert _flat(head + tail) == e0
    for b in head + tail:
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])
    assert _flat(list(dl2)) == e1


# ======================================================================================
# GadgetLoader
# ======================================================================================


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_gadgetloader_mixed_columns_two_epochs(files, num_workers):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)
    loader = gl.GadgetLoader(ds, batch_size=4, seed=13, num_workers=num_workers)
    assert len(loader) == math.ceil(N / 4)
    for e in range(2):
        batches = list(loader)
        assert len(batches) == len(loader)
        assert all(isinstance(b, gl.GadgetBatch) for b in batches)
        assert _check_epoch(batches) == loader.sampler.epoch_order(e).tolist()


def test_gadgetloader_persistent_workers_prefetch_factor(files):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)
    loader = gl.GadgetLoader(
        ds, batch_size=5, seed=13, num_workers=2, persistent_workers=True, prefetch_factor=3
    )
    assert loader.dataloader.persistent_workers is True
    assert loader.dataloader.prefetch_factor == 3
    for e in range(3):
        assert _check_epoch(list(loader)) == loader.sampler.epoch_order(e).tolist()
    assert loader.sampler.epoch == 3


@pytest.mark.parametrize("persistent", [False, True])
def test_gadgetloader_early_break_restarts_the_epoch_with_workers(persistent):
    # "or use GadgetLoader, which counts the batches it handed out"
    x, y, ds = _simple(11)  # 3 batches, all drawn ahead by the workers
    want = [t.tolist() for t in gl.GadgetSampler(11, batch_size=4, seed=5)]
    loader = gl.GadgetLoader(ds, batch_size=4, seed=5, num_workers=2, persistent_workers=persistent)
    for i, b in enumerate(loader):
        assert b[1].tolist() == want[i]
        if i == 0:
            break
    assert _ids(list(loader)) == want  # the same epoch again, from its start
    assert loader.sampler.epoch == 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_workers=0),
        dict(num_workers=2),
        dict(num_workers=2, persistent_workers=True),
        dict(num_workers=1, prefetch_factor=1),
    ],
    ids=["w0", "w2", "w2-persistent", "w1-pf1"],
)
def test_gadgetloader_resume_mid_epoch_with_workers(kw):
    x, y, ds = _simple()
    want = gl.GadgetSampler(N, batch_size=4, seed=21)
    e0, e1 = want.epoch_order(0).tolist(), want.epoch_order(1).tolist()
    loader = gl.GadgetLoader(ds, batch_size=4, seed=21, **kw)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    del it
    assert state["sampler"]["position"] == 3  # handed out, not prefetched
    loader2 = gl.GadgetLoader(
        gl.GadgetDataset(x, y, placement="cpu", device="cpu"), batch_size=4, seed=0, **kw
    )
    loader2.load_state_dict(state)
    tail = list(loader2)
    assert _flat(head + tail) == e0
    for b in head + tail:
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])
    assert _flat(list(loader2)) == e1


def test_gadgetloader_state_saved_at_epoch_end_inside_loop_with_workers():
    x, y, ds = _simple()
    e1 = gl.GadgetSampler(N, batch_size=4, seed=21).epoch_order(1).tolist()
    loader = gl.GadgetLoader(ds, batch_size=4, seed=21, num_workers=2)
    for i, _ in enumerate(loader):
        if i == len(loader) - 1:
            state = loader.state_dict()
    loader2 = gl.GadgetLoader(ds, batch_size=4, seed=0, num_workers=2)
    loader2.load_state_dict(state)
    assert list(loader2) == []  # one empty pass ...
    assert _flat(list(loader2)) == e1  # ... then the next epoch
    after = loader.state_dict()["sampler"]
    assert (after["epoch"], after["position"]) == (1, 0)


def test_gadgetloader_set_epoch_mid_epoch_with_persistent_workers():
    x, y, ds = _simple()
    loader = gl.GadgetLoader(ds, batch_size=4, seed=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    next(it)
    del it
    loader.set_epoch(4)
    assert _flat(list(loader)) == loader.sampler.epoch_order(4).tolist()
    assert loader.sampler.epoch == 5


def test_gadgetloader_generator_seeds_workers_not_the_order(tmp_path):
    x, y, ds = _simple()
    want = [t.tolist() for t in gl.GadgetSampler(N, batch_size=4, seed=7)]
    runs = {}
    for tag, gseed in [("a", 1), ("b", 1), ("c", 2)]:
        loader = gl.GadgetLoader(
            ds,
            batch_size=4,
            seed=7,
            num_workers=2,
            generator=torch.Generator().manual_seed(gseed),
            worker_init_fn=functools.partial(_record_seed, str(tmp_path), tag),
        )
        assert _ids(list(loader)) == want
        runs[tag] = [(tmp_path / f"{tag}-{w}").read_text() for w in range(2)]
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_gadgetloader_drop_last_pad_len(num_workers):
    x, y, ds = _simple()
    for kw, n_batches in [
        (dict(drop_last=True), N // 4),
        (dict(pad=True), math.ceil(N / 4)),
        (dict(), math.ceil(N / 4)),
    ]:
        loader = gl.GadgetLoader(ds, batch_size=4, seed=2, num_workers=num_workers, **kw)
        got = list(loader)
        assert len(loader) == len(got) == n_batches, kw
        order = loader.sampler.epoch_order(0).tolist()
        if kw.get("drop_last"):
            assert _flat(got) == order[: n_batches * 4]
        elif kw.get("pad"):
            assert _flat(got) == order + order[: n_batches * 4 - N]
        else:
            assert _flat(got) == order
        for b in got:
            assert torch.equal(b[0], torch.from_numpy(x)[b[1]])


def test_gadgetloader_with_given_sampler_and_workers():
    x, y, ds = _simple()
    s = gl.GadgetSampler(ds, batch_size=4, seed=9, num_replicas=2, rank=1)
    loader = gl.GadgetLoader(ds, sampler=s, num_workers=2)
    assert len(loader) == len(s)
    ref = gl.GadgetSampler(N, batch_size=4, seed=9, num_replicas=2, rank=1)
    assert _ids(list(loader)) == [t.tolist() for t in ref]
    s.set_epoch(5)  # a GadgetLoader over the sampler follows the sampler's own set_epoch
    ref.set_epoch(5)
    assert _ids(list(loader)) == [t.tolist() for t in ref]


def test_gadgetloader_refuses_what_it_sets_itself():
    x, y, ds = _simple()
    for k, v in [("shuffle", True), ("batch_sampler", None), ("collate_fn", _collate_to_dict)]:
        with pytest.raises(gl.GadgetTypeError, match=k):
            gl.GadgetLoader(ds, batch_size=4, **{k: v})
    s = gl.GadgetSampler(ds, batch_size=4)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=s, order="random")
    with pytest.raises(gl.GadgetValueError, match="rows"):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(N + 1, batch_size=4))
    with pytest.raises(gl.GadgetTypeError, match="GadgetSampler"):
        gl.GadgetLoader(ds, sampler=BatchSampler(RandomSampler(range(N)), 4, False))
    with pytest.raises(gl.GadgetValueError, match="num_workers"):
        gl.GadgetLoader(ds, batch_size=4, num_workers=2, coalesce=4)
    # DataLoader's own checks still apply to the options passed through
    with pytest.raises(ValueError, match="persistent_workers"):
        gl.GadgetLoader(ds, batch_size=4, num_workers=0, persistent_workers=True)
    with pytest.raises(ValueError, match="prefetch_factor"):
        gl.GadgetLoader(ds, batch_size=4, num_workers=0, prefetch_factor=2)


def test_gadgetloader_refused_set_epoch_and_state_leave_it_unchanged_with_workers():
    x, y, ds = _simple()
    want = [t.tolist() for t in gl.GadgetSampler(N, batch_size=4, seed=3)]
    loader = gl.GadgetLoader(ds, batch_size=4, seed=3, num_workers=2)
    it = iter(loader)
    head = [next(it)[1].tolist() for _ in range(2)]
    del it
    assert head == want[:2]
    state = loader.state_dict()
    for bad in (-1, 2**70):
        with pytest.raises(gl.GadgetValueError, match="epoch"):
            loader.set_epoch(bad)
    for bad in (1.5, "2", True):
        with pytest.raises(gl.GadgetTypeError, match="epoch"):
            loader.set_epoch(bad)
    with pytest.raises(gl.GadgetValueError, match="batch_size"):
        loader.load_state_dict(gl.GadgetLoader(ds, batch_size=5, seed=3).state_dict())
    with pytest.raises(gl.GadgetTypeError):
        loader.load_state_dict([])
    with pytest.raises(gl.GadgetValueError, match="sampler"):
        loader.load_state_dict({})
    assert loader.state_dict() == state
    # the loader carries on as if nothing had been asked: the break restarts epoch 0
    assert _ids(list(loader)) == want


@pytest.mark.parametrize("num_workers", [0, 2])
def test_gadgetloader_pin_memory_resume(num_workers):
    x, y, ds = _simple()
    want = gl.GadgetSampler(N, batch_size=4, seed=9)
    e0, e1 = want.epoch_order(0).tolist(), want.epoch_order(1).tolist()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*", category=UserWarning)
        loader = gl.GadgetLoader(
            ds,
            sampler=gl.GadgetSampler(ds, batch_size=4, seed=9, coalesce=3),
            pin_memory=True,
            num_workers=num_workers,
        )
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
        del it
        loader2 = gl.GadgetLoader(
            ds,
            sampler=gl.GadgetSampler(ds, batch_size=4, seed=1, coalesce=3),
            pin_memory=True,
            num_workers=num_workers,
        )
        loader2.load_state_dict(state)
        tail = list(loader2)
        nxt = list(loader2)
    assert _flat(head + tail) == e0
    assert _flat(nxt) == e1
    for b in head + tail + nxt:
        assert torch.equal(b[0], torch.from_numpy(x)[b[1]])


@pytest.mark.skipif(not HAS_IN_ORDER, reason="DataLoader(in_order=...) needs torch >= 2.6")
def test_gadgetloader_in_order_false_resume_repeats_and_skips_nothing():
    # GadgetLoader docstring: "state_dict() counts the batches *handed out*, not those
    # prefetched, so resuming from it repeats and skips nothing."  With in_order=False
    # (passed through to DataLoader) the batches handed out are not the first ones of the
    # order; the loader must then either refuse the option or resume exactly.
    n = 40
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n, dtype=np.int64)
    ds = _SlowWorkerZero(x, y, placement="cpu", device="cpu")
    try:
        loader = gl.GadgetLoader(ds, batch_size=4, seed=5, num_workers=2, in_order=False)
    except gl.GadgetError as e:
        assert "in_order" in str(e)
        return
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    del it, loader  # shut the workers down before any assertion can fail
    gc.collect()
    loader2 = gl.GadgetLoader(
        gl.GadgetDataset(x, y, placement="cpu", device="cpu"), batch_size=4, seed=0
    )
    loader2.load_state_dict(state)
    tail = list(loader2)
    seen = _flat(head + tail)
    assert sorted(seen) == list(range(n)), (
        f"handed out before the save: {_ids(head)}; after resume {len(tail)} batches; "
        f"rows repeated: {sorted(i for i in set(seen) if seen.count(i) > 1)}, "
        f"rows skipped: {sorted(set(range(n)) - set(seen))}"
    )


def test_gadgetloader_overlapping_passes_with_persistent_workers():
    # README (Resume): "an older pass that is still read yields its batches but no longer
    # moves the state"; "Starting a new iter() before the pass ends restarts the current
    # epoch".  Without workers (and with non-persistent ones) this holds; check it with
    # persistent workers too.
    x, y, ds = _simple(23)
    want = [t.tolist() for t in gl.GadgetSampler(23, batch_size=4, seed=11)]
    for kw in [
        dict(num_workers=0),
        dict(num_workers=2),
        dict(num_workers=2, persistent_workers=True),
    ]:
        loader = gl.GadgetLoader(ds, batch_size=4, seed=11, **kw)
        it1 = iter(loader)
        first = [next(it1)]
        it2 = iter(loader)
        if kw.get("persistent_workers"):
            # README: with persistent workers an older pass raises GadgetClosedError once a
            # newer iter() has started (the workers serve one pass at a time)
            with pytest.raises(gl.GadgetClosedError, match="persistent_workers"):
                next(it1)
            older = want
        else:
            older = _ids(first + list(it1))
        newer = _ids(list(it2))
        del it1, it2, loader  # shut the workers down before any assertion can fail
        gc.collect()
        assert older == want, f"{kw}: the older pass yielded {len(older)} batches: {older}"
        assert newer == want, f"{kw}: the new pass yielded {len(newer)} batches: {newer}"


# ======================================================================================
# file-backed columns, writes between epochs, fork / spawn
# ======================================================================================


def test_non_persistent_workers_see_writes_between_epochs(files):
    tmp_path, refs = files
    x = refs[0]
    np.save(tmp_path / "xw.npy", x)
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f.create_dataset("d", data=x)
    with h5py.File(tmp_path / "gz.h5", "w") as f:
        f.create_dataset("d", data=x, chunks=(4, 3), compression="gzip")
    gl.DataGadget(x, placement="cpu").save(str(tmp_path / "xw.zarr"), chunk_rows=5)
    tables = [
        gl.DataGadget(str(tmp_path / name), placement="file")
        for name in ("xw.npy", "plain.h5", "gz.h5", "xw.zarr")
    ]
    tables.append(gl.DataGadget(x.copy(), placement="cpu"))
    ds = gl.GadgetDataset(*tables, gl.DataGadget(refs[3], placement="cpu"), device="cpu")
    for epoch in range(3):
        for loader in (
            DataLoader(ds, batch_size=6, shuffle=True, num_workers=2),
            gl.GadgetLoader(ds, batch_size=6, num_workers=2),
        ):
            seen = []
            for b in loader:
                ids = b[-1]
                want = torch.from_numpy(x + epoch)[ids]
                for k in range(len(tables)):
                    assert torch.equal(b[k], want), (epoch, k)
                seen += ids.tolist()
            assert sorted(seen) == list(range(N))
        new = torch.from_numpy(x + epoch + 1)
        for t in tables:
            t.insertData(new, torch.arange(N))


def test_persistent_workers_see_npy_and_uncompressed_h5_writes(files):
    tmp_path, refs = files
    x = refs[0]
    np.save(tmp_path / "pw.npy", x)
    with h5py.File(tmp_path / "pw.h5", "w") as f:
        f.create_dataset("d", data=x)
    a = gl.DataGadget(str(tmp_path / "pw.npy"), placement="file")
    h = gl.DataGadget(str(tmp_path / "pw.h5"), placement="file")
    ds = gl.GadgetDataset(a, h, gl.DataGadget(refs[3], placement="cpu"), device="cpu")
    s = gl.GadgetSampler(ds, batch_size=5, seed=0)
    dl = DataLoader(ds, batch_sampler=s, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        got = list(dl)
        assert _flat(got, col=2) == s.epoch_order(epoch).tolist()
        for b in got:
            want = torch.from_numpy(x + epoch)[b[2]]
            assert torch.equal(b[0], want) and torch.equal(b[1], want), epoch
        a.insertData(torch.from_numpy(x + epoch + 1), torch.arange(N))
        h.insertData(torch.from_numpy(x + epoch + 1), torch.arange(N))


def test_hdf5_open_for_writing_in_main_while_workers_read(files):
    tmp_path, refs = files
    h = gl.DataGadget(str(tmp_path / "h.h5"), dataset="grp/h", placement="file")
    h.insertData(torch.from_numpy(refs[1][:3] * 2), torch.arange(3))  # the main process has written
    want = refs[1].copy()
    want[:3] *= 2
    assert torch.equal(h.getData(torch.arange(N)), torch.from_numpy(want))
    ds = gl.GadgetDataset(h, gl.DataGadget(refs[3], placement="cpu"), device="cpu")
    got = list(DataLoader(ds, batch_size=4, shuffle=True, num_workers=2))
    seen = []
    for b in got:
        assert torch.equal(b[0], torch.from_numpy(want)[b[1]])
        seen += b[1].tolist()
    assert sorted(seen) == list(range(N))
    # and the main process still reads (and writes) after the fork
    h.insertData(torch.from_numpy(refs[1][3:4]), torch.tensor([3]))
    assert torch.equal(ds[[0, 3]][0], torch.from_numpy(want[[0, 3]]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_replaced_file_raises_in_workers_too(tmp_path, num_workers):
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    np.save(tmp_path / "r.npy", x)
    ds = gl.GadgetDataset(str(tmp_path / "r.npy"), np.arange(N), placement="file", device="cpu")
    assert torch.equal(ds[0][0], torch.from_numpy(x[0]))
    np.save(tmp_path / "other.npy", x + 500)
    os.replace(tmp_path / "other.npy", tmp_path / "r.npy")  # same shape and dtype, new file
    kind, msg = _iterate_expecting_error(DataLoader(ds, batch_size=5, num_workers=num_workers))
    assert kind is not None and issubclass(kind, gl.GadgetFileError), kind
    assert "replaced" in msg and "r.npy" in msg, msg


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("closed", ["dataset", "gadget"])
def test_closed_file_table_raises_in_workers_too(tmp_path, num_workers, closed):
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    np.save(tmp_path / "c.npy", x)
    if closed == "dataset":
        ds = gl.GadgetDataset(str(tmp_path / "c.npy"), np.arange(N), placement="file", device="cpu")
        ds.close()
    else:
        g = gl.DataGadget(str(tmp_path / "c.npy"), placement="file")
        ds = gl.GadgetDataset(g, gl.DataGadget(np.arange(N), placement="cpu"), device="cpu")
        g.close()
    for loader in (
        DataLoader(ds, batch_size=5, num_workers=num_workers),
        gl.GadgetLoader(ds, batch_size=5, num_workers=num_workers),
    ):
        kind, msg = _iterate_expecting_error(loader)
        assert kind is not None and issubclass(kind, gl.GadgetClosedError), kind
        assert "closed" in msg and "c.npy" in msg, msg


def test_relative_path_then_chdir_workers_read_the_opened_file(tmp_path, monkeypatch):
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    np.save(tmp_path / "a" / "r.npy", x)
    np.save(tmp_path / "b" / "r.npy", x + 1000)  # same name, other rows
    monkeypatch.chdir(tmp_path / "a")
    ds = gl.GadgetDataset("r.npy", np.arange(N), placement="file", device="cpu")
    monkeypatch.chdir(tmp_path / "b")
    for nw in (0, 2):
        got = list(DataLoader(ds, batch_size=5, shuffle=True, num_workers=nw))
        assert sorted(_flat(got)) == list(range(N))
        for b in got:
            assert torch.equal(b[0], torch.from_numpy(x)[b[1]]), nw


def test_bfloat16_file_columns_in_workers(tmp_path):
    src = (torch.arange(N * 2, dtype=torch.float32).reshape(N, 2) / 16).to(torch.bfloat16)
    g = gl.DataGadget(src, placement="cpu")
    g.save(str(tmp_path / "bf.h5"))
    g.save(str(tmp_path / "bf.zarr"), chunk_rows=4)
    ds = gl.GadgetDataset(
        gl.DataGadget(str(tmp_path / "bf.h5"), placement="file"),
        gl.DataGadget(str(tmp_path / "bf.zarr"), placement="file"),
        np.arange(N),
        device="cpu",
    )
    for loader in (
        DataLoader(ds, batch_size=4, shuffle=True, num_workers=2),
        gl.GadgetLoader(ds, batch_size=4, num_workers=2, order="chunk"),
    ):
        seen = []
        for b in loader:
            assert b[0].dtype == b[1].dtype == torch.bfloat16
            assert torch.equal(b[0], src[b[2]]) and torch.equal(b[1], src[b[2]])
            seen += b[2].tolist()
        assert sorted(seen) == list(range(N))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_fork_context_explicit(files):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="fork")
    _check_epoch(list(dl))
    loader = gl.GadgetLoader(
        ds, batch_size=4, seed=1, num_workers=2, multiprocessing_context="fork"
    )
    assert _check_epoch(list(loader)) == loader.sampler.epoch_order(0).tolist()


def test_spawn_context_default_form(files):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)
    dl = DataLoader(ds, batch_size=6, shuffle=True, num_workers=1, multiprocessing_context="spawn")
    _check_epoch(list(dl))


def test_spawn_context_gadgetloader_persistent_two_epochs(files):
    tmp_path, _ = files
    ds = _mixed_dataset(tmp_path)  # explicit placements: the dataset is pickled for spawn
    loader = gl.GadgetLoader(
        ds,
        batch_size=6,
        seed=4,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="spawn",
    )
    for e in range(2):
        assert _check_epoch(list(loader)) == loader.sampler.epoch_order(e).tolist()
