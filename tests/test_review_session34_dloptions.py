"""Review (session 34): torch DataLoader options combined with gadgetloader's input pipeline.

Black-box tests from README "Input pipeline" and the docstrings of GadgetDataset,
GadgetSampler, GadgetLoader and GadgetBatch: the default form, the two sampler forms and
GadgetLoader, each with DataLoader options (workers, start methods, persistent workers,
prefetch_factor, worker_init_fn, generator, timeout, collate_fn, drop_last, pin_memory) over
columns from arrays, tensors and .npy / HDF5 / zarr files.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, random_split

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


N = 103  # rows: not a multiple of any batch size used below
B = 16  # batch size: 6 full batches and one of 7 rows
HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters


# ---- helpers --------------------------------------------------------------------------------


def _arrays(n: int = N) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {
        "x": rng.standard_normal((n, 3, 2)).astype(np.float32),  # multi-dim features
        "y": np.arange(n, dtype=np.int64),  # 1-D labels: the row id itself
        "w": rng.standard_normal(n),  # 1-D float64 weights
    }


def _dataset(a: dict[str, np.ndarray]) -> gl.GadgetDataset:
    return gl.GadgetDataset(a["x"], a["y"], a["w"], placement="cpu", device="cpu")


def _labels(batches) -> list[int]:
    return torch.cat([torch.as_tensor(b[1]).reshape(-1) for b in batches]).tolist()


def _check_batches(batches, a, *, sizes=None, every_row_once=True):
    """Each batch: 3 CPU columns, right shapes and dtypes, values equal to NumPy's rows."""
    seen: list[int] = []
    for b in batches:
        assert len(b) == 3
        xb, yb, wb = b
        for t in (xb, yb, wb):
            assert isinstance(t, torch.Tensor)
            assert t.device.type == "cpu"
        assert xb.dtype == torch.float32 and yb.dtype == torch.int64 and wb.dtype == torch.float64
        k = yb.shape[0]
        assert tuple(xb.shape) == (k, 3, 2) and tuple(yb.shape) == (k,) and tuple(wb.shape) == (k,)
        ids = yb.numpy()
        np.testing.assert_array_equal(ids, a["y"][ids])
        np.testing.assert_array_equal(xb.numpy(), a["x"][ids])
        np.testing.assert_array_equal(wb.numpy(), a["w"][ids])
        seen.extend(ids.tolist())
    if sizes is not None:
        assert [len(b[1]) for b in batches] == sizes
    if every_row_once:
        assert sorted(seen) == list(range(len(a["y"])))
    return seen


FULL_SIZES = [B] * (N // B) + [N % B]
DROP_SIZES = [B] * (N // B)


def _ignore_pin_warning():
    """torch warns that pin_memory has no accelerator to pin for on a CPU-only machine
    (and not on a GPU machine): tolerate that one torch warning, nothing else."""
    cm = warnings.catch_warnings()
    cm.__enter__()
    warnings.filterwarnings("ignore", message=r".*pin_memory.*", category=UserWarning)
    return cm


def _record_worker(tag_dir: str, worker_id: int) -> None:
    """worker_init_fn (module level, so spawn can pickle it): write what the worker sees."""
    info = torch.utils.data.get_worker_info()
    ds = info.dataset
    with open(os.path.join(tag_dir, f"w{worker_id}-{os.getpid()}.txt"), "w") as f:
        f.write(
            f"{info.id} {info.num_workers} {torch.initial_seed()} {type(ds).__name__} {len(ds)}"
        )


def _read_records(d) -> list[tuple[int, int, int, str, int]]:
    out = []
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name)) as f:
            i, nw, seed, kind, n = f.read().split()
        out.append((int(i), int(nw), int(seed), kind, int(n)))
    return sorted(out)


def _collect(loader) -> list:
    return [tuple(t.clone() for t in b) for b in loader]


def _write_files(tmp_path, a):
    """Features in a .npy, labels in an HDF5 file, weights in a zarr store."""
    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    npy = tmp_path / "x.npy"
    np.save(npy, a["x"])
    h5 = tmp_path / "y.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("labels", data=a["y"], chunks=(16,))
    zp = tmp_path / "w.zarr"
    z = zarr.open(str(zp), mode="w", shape=a["w"].shape, chunks=(16,), dtype="float64")
    z[:] = a["w"]
    return str(npy), str(h5), str(zp)


# ---- default form: DataLoader(GadgetDataset, batch_size=B, shuffle=True) ---------------------


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_default_form_workers_every_row_once(num_workers):
    a = _arrays()
    ds = _dataset(a)
    batches = list(DataLoader(ds, batch_size=B, shuffle=True, num_workers=num_workers))
    assert all(isinstance(b, gl.GadgetBatch) for b in batches)
    _check_batches(batches, a, sizes=FULL_SIZES)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_form_drop_last(num_workers):
    a = _arrays()
    batches = list(
        DataLoader(_dataset(a), batch_size=B, shuffle=True, drop_last=True, num_workers=num_workers)
    )
    seen = _check_batches(batches, a, sizes=DROP_SIZES, every_row_once=False)
    assert len(set(seen)) == len(seen) == B * (N // B)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_form_sequential_equals_numpy_slices(num_workers):
    a = _arrays()
    batches = list(DataLoader(_dataset(a), batch_size=B, shuffle=False, num_workers=num_workers))
    _check_batches(batches, a, sizes=FULL_SIZES)
    for i, b in enumerate(batches):
        np.testing.assert_array_equal(b[0].numpy(), a["x"][i * B : (i + 1) * B])
        np.testing.assert_array_equal(b[1].numpy(), np.arange(i * B, min(N, (i + 1) * B)))


def test_default_form_generator_same_seed_same_order_across_workers():
    """A seeded generator fixes torch's RandomSampler: the dataset must deliver exactly the
    rows torch's sampler picked, whatever the worker count."""
    a = _arrays()
    ds = _dataset(a)

    def order(seed, nw):
        g = torch.Generator().manual_seed(seed)
        return _labels(DataLoader(ds, batch_size=B, shuffle=True, generator=g, num_workers=nw))

    ref = torch.cat(
        list(
            DataLoader(
                list(range(N)),
                batch_size=B,
                shuffle=True,
                generator=torch.Generator().manual_seed(7),
            )
        )
    ).tolist()
    o0 = order(7, 0)
    assert o0 == ref
    assert order(7, 0) == o0
    assert order(7, 2) == o0
    assert order(8, 0) != o0
    assert sorted(o0) == list(range(N))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_form_custom_collate_gets_one_element_list(num_workers):
    """README: "a custom collate_fn takes batch[0]" (the dataset returns [GadgetBatch])."""
    a = _arrays()

    def collate(batch):
        assert isinstance(batch, list) and len(batch) == 1, (type(batch), len(batch))
        assert isinstance(batch[0], gl.GadgetBatch)
        x, y, w = batch[0]
        return {"x": x * 2, "y": y, "w": w, "n": len(batch)}

    out = list(
        DataLoader(
            _dataset(a), batch_size=B, shuffle=True, collate_fn=collate, num_workers=num_workers
        )
    )
    assert [d["n"] for d in out] == [1] * len(FULL_SIZES)
    ys = torch.cat([d["y"] for d in out]).numpy()
    assert sorted(ys.tolist()) == list(range(N))
    np.testing.assert_array_equal(torch.cat([d["x"] for d in out]).numpy(), a["x"][ys] * 2)
    np.testing.assert_array_equal(torch.cat([d["w"] for d in out]).numpy(), a["w"][ys])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_subset_and_random_split_keep_one_gather_per_batch(num_workers):
    """README: torch's Subset (and so random_split) passes a batch's ids on: a custom
    collate_fn still gets the one-element list."""
    a = _arrays()
    ds = _dataset(a)
    part, rest = random_split(ds, [60, N - 60], generator=torch.Generator().manual_seed(3))
    kinds = []

    def collate(batch):
        if num_workers == 0:
            kinds.append((len(batch), type(batch[0]).__name__))
        assert len(batch) == 1 and isinstance(batch[0], gl.GadgetBatch)
        return batch[0]

    for sub in (part, rest, Subset(ds, [5, 3, 100, 0])):
        batches = list(
            DataLoader(
                sub, batch_size=B, shuffle=False, collate_fn=collate, num_workers=num_workers
            )
        )
        got = _labels(batches)
        assert got == list(sub.indices)
        _check_batches(batches, a, every_row_once=False)
    if num_workers == 0:
        assert kinds and set(kinds) == {(1, "GadgetBatch")}


def test_concat_dataset_collate_gets_one_tuple_per_sample():
    """README: ConcatDataset indexes sample by sample (a collate_fn gets one tuple per sample)."""
    a = _arrays()
    ds = _dataset(a)
    cat = ConcatDataset([ds, ds])
    lens = []

    def collate(batch):
        lens.append(len(batch))
        assert all(isinstance(s, tuple) and len(s) == 3 for s in batch)
        return torch.stack([s[1] for s in batch])

    got = torch.cat(list(DataLoader(cat, batch_size=10, collate_fn=collate))).tolist()
    assert got == list(range(N)) * 2
    assert lens[0] == 10 and sum(lens) == 2 * N
    # default collate stacks them into the same shapes as a GadgetDataset batch
    b = next(iter(DataLoader(cat, batch_size=5)))
    assert tuple(b[0].shape) == (5, 3, 2) and b[1].tolist() == [0, 1, 2, 3, 4]


# ---- fast forms: batch_sampler=GadgetSampler / sampler=..., batch_size=None -----------------


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_batch_sampler_workers_follow_sampler_order(num_workers):
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, order="random", seed=3)
    expected = s.epoch_order(0).tolist()
    batches = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
    assert all(isinstance(b, gl.GadgetBatch) for b in batches)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == expected
    # a fresh sampler with the same seed, in a fresh dataset, gives the same batches
    s2 = gl.GadgetSampler(_dataset(a), batch_size=B, order="random", seed=3)
    assert [b.tolist() for b in s2] == [b[1].tolist() for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_with_batch_size_none(num_workers):
    """Docstring: with sampler=GadgetSampler(...), batch_size=None torch's default_convert
    turns the tuple into a list of the same tensors."""
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=11)
    batches = list(DataLoader(ds, sampler=s, batch_size=None, num_workers=num_workers))
    assert all(isinstance(b, list) and len(b) == 3 for b in batches)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == s.epoch_order(0).tolist()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_sampler_without_batch_size_none_is_refused(num_workers):
    """README: DataLoader(ds, sampler=sampler) without batch_size=None is refused with a
    GadgetValueError when the loader is iterated."""
    a = _arrays()
    ds = _dataset(a)
    loader = DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=B), num_workers=num_workers)
    with pytest.raises(gl.GadgetValueError, match="batch_size=None"):
        list(loader)
    del loader
    gc.collect()  # torch joins an errored worker here (up to 5 s), not in a later test
    # the dataset still works as before
    np.testing.assert_array_equal(ds[[4, 2]][0].numpy(), a["x"][[4, 2]])


def test_fast_forms_custom_collate_fn():
    a = _arrays()
    ds = _dataset(a)
    got_bs, got_s = [], []

    def c_bs(batch):
        got_bs.append(type(batch))
        assert isinstance(batch, list) and len(batch) == 1
        assert isinstance(batch[0], gl.GadgetBatch)
        return batch[0]

    def c_s(batch):  # no auto-collation: the GadgetBatch itself
        got_s.append(type(batch))
        assert isinstance(batch, gl.GadgetBatch)
        return batch

    s = gl.GadgetSampler(ds, batch_size=B, seed=2)
    b1 = list(DataLoader(ds, batch_sampler=s, collate_fn=c_bs))
    s = gl.GadgetSampler(ds, batch_size=B, seed=2)
    b2 = list(DataLoader(ds, sampler=s, batch_size=None, collate_fn=c_s))
    assert len(got_bs) == len(got_s) == len(FULL_SIZES)
    _check_batches(b1, a, sizes=FULL_SIZES)
    _check_batches(b2, a, sizes=FULL_SIZES)
    assert _labels(b1) == _labels(b2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_sampler_drop_last_and_pad(num_workers):
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, drop_last=True, seed=5)
    order = s.epoch_order(0).tolist()
    batches = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
    seen = _check_batches(batches, a, sizes=DROP_SIZES, every_row_once=False)
    assert seen == order[: B * (N // B)]  # the last N % B rows of the order are dropped

    s = gl.GadgetSampler(ds, batch_size=B, pad=True, seed=5)
    order = s.epoch_order(0).tolist()
    batches = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
    seen = _check_batches(batches, a, sizes=[B] * -(-N // B), every_row_once=False)
    missing = B * -(-N // B) - N
    assert seen == order + order[:missing]


def test_batch_sampler_generator_does_not_change_order():
    """The batch order comes from the GadgetSampler's seed alone; DataLoader's generator
    only seeds the workers."""
    a = _arrays()
    ds = _dataset(a)
    orders = []
    for gseed, nw in ((1, 0), (2, 0), (3, 2)):
        s = gl.GadgetSampler(ds, batch_size=B, seed=9)
        g = torch.Generator().manual_seed(gseed)
        orders.append(_labels(DataLoader(ds, batch_sampler=s, generator=g, num_workers=nw)))
    assert orders[0] == orders[1] == orders[2]
    assert orders[0] == gl.GadgetSampler(ds, batch_size=B, seed=9).epoch_order(0).tolist()


def test_batch_sampler_persistent_workers_epochs_advance():
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=4)
    loader = DataLoader(
        ds, batch_sampler=s, num_workers=2, persistent_workers=True, prefetch_factor=1
    )
    epochs = [list(loader) for _ in range(3)]
    orders = [_labels(e) for e in epochs]
    for e, batches in enumerate(epochs):
        _check_batches(batches, a, sizes=FULL_SIZES)
        assert orders[e] == s.epoch_order(e).tolist()
    assert orders[0] != orders[1] != orders[2]
    del loader, epochs
    gc.collect()


@pytest.mark.skipif(not HAS_IN_ORDER, reason="DataLoader(in_order=) needs torch >= 2.6")
def test_batch_sampler_in_order_false_every_row_once():
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=6)
    batches = list(DataLoader(ds, batch_sampler=s, num_workers=2, in_order=False))
    _check_batches(batches, a)
    assert sorted(len(b[1]) for b in batches) == sorted(FULL_SIZES)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_out_of_range_ids_raise_index_error_through_dataloader(num_workers):
    a = _arrays()
    ds = _dataset(a)
    with pytest.raises(IndexError, match="500") as ei:
        list(DataLoader(ds, batch_sampler=[[0, 1, 500]], num_workers=num_workers))
    assert isinstance(ei.value, gl.GadgetIndexError)
    del ei
    gc.collect()
    # the dataset still reads right afterwards
    np.testing.assert_array_equal(ds[[102]][0].numpy(), a["x"][[102]])


# ---- GadgetLoader with DataLoader options ---------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_loader_workers_give_the_same_batches(num_workers):
    a = _arrays()
    ref = gl.GadgetSampler(N, batch_size=B, seed=5)
    loader = gl.GadgetLoader(_dataset(a), batch_size=B, seed=5, num_workers=num_workers)
    assert len(loader) == len(FULL_SIZES)
    batches = list(loader)
    assert all(isinstance(b, gl.GadgetBatch) for b in batches)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == ref.epoch_order(0).tolist()
    assert _labels(batches) == loader.sampler.epoch_order(0).tolist()


def test_loader_persistent_workers_prefetch_factor_epochs():
    a = _arrays()
    loader = gl.GadgetLoader(
        _dataset(a), batch_size=B, seed=8, num_workers=2, persistent_workers=True, prefetch_factor=1
    )
    orders = []
    for e in range(3):
        batches = _collect(loader)
        _check_batches(batches, a, sizes=FULL_SIZES)
        orders.append(_labels(batches))
        assert orders[-1] == loader.sampler.epoch_order(e).tolist()
    assert orders[0] != orders[1] and orders[1] != orders[2]
    del loader
    gc.collect()


def test_loader_persistent_workers_older_pass_raises_closed():
    """Docstring: with persistent_workers=True, once a newer iter() has started, reading an
    older pass raises GadgetClosedError."""
    a = _arrays()
    loader = gl.GadgetLoader(
        _dataset(a), batch_size=B, seed=1, num_workers=2, persistent_workers=True
    )
    it1 = iter(loader)
    first = next(it1)
    it2 = iter(loader)
    b = next(it2)
    with pytest.raises(gl.GadgetClosedError):
        next(it1)
    rest = [b] + list(it2)
    _check_batches(rest, a, sizes=FULL_SIZES)
    # the older pass had started the same epoch: same first batch
    assert first[1].tolist() == b[1].tolist()
    del it1, it2, loader
    gc.collect()


def test_loader_generator_seeds_workers_only(tmp_path):
    """Docstring: a generator given here seeds only the workers' random state, as in
    DataLoader; the batch order comes from seed= alone."""
    a = _arrays()
    ds = _dataset(a)
    runs = {}
    for tag, gseed in (("a", 11), ("b", 11), ("c", 12)):
        d = tmp_path / tag
        d.mkdir()
        loader = gl.GadgetLoader(
            ds,
            batch_size=B,
            seed=2,
            num_workers=2,
            generator=torch.Generator().manual_seed(gseed),
            worker_init_fn=functools.partial(_record_worker, str(d)),
        )
        batches = list(loader)
        _check_batches(batches, a, sizes=FULL_SIZES)
        runs[tag] = (_labels(batches), _read_records(d))
    assert runs["a"][0] == runs["b"][0] == runs["c"][0]
    recs = runs["a"][1]
    assert [r[0] for r in recs] == [0, 1]  # worker_init_fn ran once in each worker
    assert all(r[1] == 2 and r[3] == "GadgetDataset" and r[4] == N for r in recs)
    seeds = lambda t: [r[2] for r in runs[t][1]]  # noqa: E731
    assert seeds("a") == seeds("b")
    assert seeds("a") != seeds("c")
    assert seeds("a")[1] == seeds("a")[0] + 1  # DataLoader: base seed + worker id
    # without workers the generator is accepted and changes nothing either
    l0 = gl.GadgetLoader(ds, batch_size=B, seed=2, generator=torch.Generator().manual_seed(99))
    assert _labels(list(l0)) == runs["a"][0]


def test_loader_timeout_with_workers_sequential():
    a = _arrays()
    loader = gl.GadgetLoader(
        _dataset(a), batch_size=B, order="sequential", num_workers=2, timeout=30
    )
    batches = list(loader)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == list(range(N))
    np.testing.assert_array_equal(batches[-1][0].numpy(), a["x"][B * (N // B) :])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_drop_last_and_pad(num_workers):
    a = _arrays()
    loader = gl.GadgetLoader(
        _dataset(a), batch_size=B, seed=3, drop_last=True, num_workers=num_workers
    )
    assert len(loader) == N // B
    batches = list(loader)
    seen = _check_batches(batches, a, sizes=DROP_SIZES, every_row_once=False)
    assert seen == loader.sampler.epoch_order(0).tolist()[: B * (N // B)]

    loader = gl.GadgetLoader(_dataset(a), batch_size=B, seed=3, pad=True, num_workers=num_workers)
    batches = list(loader)
    seen = _check_batches(batches, a, sizes=[B] * -(-N // B), every_row_once=False)
    assert set(seen) == set(range(N))


def test_loader_resume_with_workers():
    """state_dict counts batches handed out, not those workers fetched ahead."""
    a = _arrays()
    full = _labels(list(gl.GadgetLoader(_dataset(a), batch_size=B, seed=21)))
    loader = gl.GadgetLoader(_dataset(a), batch_size=B, seed=21, num_workers=2, prefetch_factor=2)
    head = []
    for i, b in enumerate(loader):
        head.append(tuple(t.clone() for t in b))
        if i == 2:
            state = loader.state_dict()
            break
    del loader
    gc.collect()
    resumed = gl.GadgetLoader(_dataset(a), batch_size=B, seed=0, num_workers=2)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert _labels(head) + _labels(tail) == full
    _check_batches(head + tail, a, sizes=FULL_SIZES)


@pytest.mark.parametrize("option", ["shuffle", "batch_sampler", "collate_fn"])
def test_loader_refuses_options_it_sets(option):
    a = _arrays()
    ds = _dataset(a)
    value = {
        "shuffle": True,
        "batch_sampler": gl.GadgetSampler(ds, batch_size=B),
        "collate_fn": lambda b: b,
    }[option]
    with pytest.raises(gl.GadgetTypeError, match=option):
        gl.GadgetLoader(ds, batch_size=B, **{option: value})
    assert isinstance(gl.GadgetTypeError("x"), TypeError)


@pytest.mark.parametrize(
    "option, value",
    [
        ("order", "random"),
        ("seed", 0),
        ("drop_last", False),
        ("pad", False),
        ("window_chunks", 4),
        ("chunk_rows", 8),
        ("num_replicas", 1),
        ("rank", 0),
    ],
)
def test_loader_refuses_sampler_options_with_sampler(option, value):
    """Docstring: with sampler= giving any of them, even at its default value, is an error."""
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=3)
    with pytest.raises(gl.GadgetValueError, match=option):
        gl.GadgetLoader(ds, sampler=s, **{option: value})
    # the sampler is untouched and still usable
    assert s.seed == 3 and s.epoch == 0
    assert _labels(list(gl.GadgetLoader(ds, sampler=s))) == s.epoch_order(0).tolist()


def test_loader_refuses_torch_samplers():
    a = _arrays()
    ds = _dataset(a)
    for bad in (
        torch.utils.data.RandomSampler(ds),
        torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), B, False),
    ):
        with pytest.raises(gl.GadgetTypeError, match=type(bad).__name__) as ei:
            gl.GadgetLoader(ds, sampler=bad)
        assert "GadgetSampler" in str(ei.value)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"persistent_workers": True}, ValueError, ["persistent_workers", "num_workers"]),
        ({"prefetch_factor": 2}, ValueError, ["prefetch_factor", "num_workers"]),
        ({"timeout": -1}, ValueError, ["timeout"]),
        (
            {"num_workers": 1, "multiprocessing_context": "nope"},
            ValueError,
            ["multiprocessing_context", "nope"],
        ),
        ({"num_worker": 2}, TypeError, ["num_worker"]),
    ],
)
def test_loader_dataloader_refusals_are_clear(kwargs, exc, words):
    a = _arrays()
    ds = _dataset(a)
    with pytest.raises(exc) as ei:
        gl.GadgetLoader(ds, batch_size=B, **kwargs)
    assert isinstance(ei.value, gl.GadgetError)
    for w in words:
        assert w in str(ei.value)
    np.testing.assert_array_equal(ds[[0, 102]][0].numpy(), a["x"][[0, 102]])


def test_loader_zero_row_dataset_refused():
    with pytest.raises(gl.GadgetValueError, match="0 rows|empty"):
        gl.GadgetLoader(
            gl.DataGadget(np.zeros((0, 3), np.float32), placement="cpu"),
            batch_size=4,
            num_workers=1,
        )


@pytest.mark.skipif(not HAS_IN_ORDER, reason="DataLoader(in_order=) needs torch >= 2.6")
def test_loader_in_order_false_refused_in_order_true_accepted():
    a = _arrays()
    ds = _dataset(a)
    with pytest.raises(gl.GadgetValueError, match="in_order"):
        gl.GadgetLoader(ds, batch_size=B, num_workers=2, in_order=False)
    batches = list(gl.GadgetLoader(ds, batch_size=B, seed=4, num_workers=2, in_order=True))
    assert _labels(batches) == gl.GadgetSampler(N, batch_size=B, seed=4).epoch_order(0).tolist()


# ---- pin_memory on a machine without CUDA ---------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_does_not_break(num_workers):
    a = _arrays()
    ds = _dataset(a)
    cm = _ignore_pin_warning()
    try:
        d = list(
            DataLoader(ds, batch_size=B, shuffle=True, pin_memory=True, num_workers=num_workers)
        )
        s = gl.GadgetSampler(ds, batch_size=B, seed=1)
        f = list(DataLoader(ds, batch_sampler=s, pin_memory=True, num_workers=num_workers))
        g = list(
            gl.GadgetLoader(ds, batch_size=B, seed=1, pin_memory=True, num_workers=num_workers)
        )
    finally:
        cm.__exit__(None, None, None)
    for batches in (d, f, g):
        _check_batches(batches, a, sizes=FULL_SIZES)
    assert (
        _labels(f)
        == _labels(g)
        == gl.GadgetSampler(N, batch_size=B, seed=1).epoch_order(0).tolist()
    )


def test_gadget_batch_pin_memory_keeps_values():
    """GadgetBatch.pin_memory: CPU columns pinned (torch raises RuntimeError where it cannot
    pin); either way the batch's values stay those of the table."""
    a = _arrays()
    ids = [3, 1, 4]
    b = _dataset(a)[ids]
    try:
        p = b.pin_memory()
    except RuntimeError:
        p = b
    assert isinstance(p, gl.GadgetBatch)
    for t, u in zip(p, b, strict=True):
        assert torch.equal(t, u)
    np.testing.assert_array_equal(b[0].numpy(), a["x"][ids])


# ---- column kinds: tensors, dtypes, files ---------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_tensor_columns_and_dtypes_through_workers(num_workers):
    rng = np.random.default_rng(5)
    cols_np = [
        rng.standard_normal((N, 4)).astype(np.float16),
        rng.integers(-100, 100, (N, 2, 2), dtype=np.int8),
        rng.integers(0, 2, N).astype(bool),
        rng.integers(0, 1 << 30, N, dtype=np.int32),
    ]
    bf = torch.randn(N, 3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    lab = torch.arange(N, dtype=torch.int64)
    ds = gl.GadgetDataset(*cols_np, bf, lab, placement="cpu", device="cpu")
    want = [torch.from_numpy(c) for c in cols_np] + [bf, lab]
    for form in ("default", "sampler", "loader"):
        if form == "default":
            batches = list(DataLoader(ds, batch_size=B, shuffle=True, num_workers=num_workers))
        elif form == "sampler":
            batches = list(
                DataLoader(
                    ds, batch_sampler=gl.GadgetSampler(ds, batch_size=B), num_workers=num_workers
                )
            )
        else:
            batches = list(gl.GadgetLoader(ds, batch_size=B, num_workers=num_workers))
        assert [len(b[-1]) for b in batches] == FULL_SIZES
        ids = torch.cat([b[-1] for b in batches])
        assert sorted(ids.tolist()) == list(range(N))
        for j, w in enumerate(want):
            got = torch.cat([b[j] for b in batches])
            assert got.dtype == w.dtype, (form, j)
            assert got.shape == (N,) + tuple(w.shape[1:])
            assert torch.equal(got, w[ids]), (form, j)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_file_columns_npy_hdf5_zarr_fork(tmp_path, num_workers):
    a = _arrays()
    npy, h5, zp = _write_files(tmp_path, a)
    ds = gl.GadgetDataset(npy, h5, zp, placement="file", device="cpu")
    assert len(ds) == N
    d = list(
        DataLoader(
            ds,
            batch_size=B,
            shuffle=True,
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
        )
    )
    _check_batches(d, a, sizes=FULL_SIZES)
    s = gl.GadgetSampler(ds, batch_size=B, order="chunk", seed=2)
    f = list(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
    _check_batches(f, a, sizes=FULL_SIZES)
    assert _labels(f) == s.epoch_order(0).tolist()
    loader = gl.GadgetLoader(
        ds, batch_size=B, seed=2, num_workers=num_workers, persistent_workers=bool(num_workers)
    )
    for e in range(2):
        g = _collect(loader)
        _check_batches(g, a, sizes=FULL_SIZES)
        assert _labels(g) == loader.sampler.epoch_order(e).tolist()
    del loader
    gc.collect()
    # the files are unchanged by reading them through workers
    np.testing.assert_array_equal(np.load(npy), a["x"])


def test_spawn_loader_file_and_cpu_columns(tmp_path):
    a = _arrays()
    npy = tmp_path / "x.npy"
    np.save(npy, a["x"])
    rec = tmp_path / "rec"
    rec.mkdir()
    ds = gl.GadgetDataset(
        str(npy), a["y"], torch.from_numpy(a["w"]), placement="file", device="cpu"
    )
    loader = gl.GadgetLoader(
        ds,
        batch_size=B,
        seed=13,
        num_workers=2,
        multiprocessing_context="spawn",
        worker_init_fn=functools.partial(_record_worker, str(rec)),
        generator=torch.Generator().manual_seed(5),
    )
    batches = list(loader)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == gl.GadgetSampler(N, batch_size=B, seed=13).epoch_order(0).tolist()
    recs = _read_records(rec)
    assert [r[0] for r in recs] == [0, 1]
    assert all(r[3] == "GadgetDataset" and r[4] == N for r in recs)


def test_spawn_default_form_hdf5_persistent(tmp_path):
    a = _arrays()
    npy, h5, zp = _write_files(tmp_path, a)
    ds = gl.GadgetDataset(npy, h5, zp, placement="file", device="cpu")
    g = torch.Generator().manual_seed(17)
    loader = DataLoader(
        ds,
        batch_size=B,
        shuffle=True,
        generator=g,
        num_workers=1,
        multiprocessing_context="spawn",
        persistent_workers=True,
        timeout=60,
    )
    orders = []
    for _ in range(2):
        batches = list(loader)
        _check_batches(batches, a, sizes=FULL_SIZES)
        orders.append(_labels(batches))
    assert orders[0] != orders[1]
    del loader
    gc.collect()


def test_writes_between_epochs_seen_by_non_persistent_workers(tmp_path):
    """README: use non-persistent workers when the main process writes the table it reads;
    each write reaches the file before it returns, so workers started later read it."""
    a = _arrays()
    npy = tmp_path / "x.npy"
    np.save(npy, a["x"])
    fcol = gl.DataGadget(str(npy), placement="file")
    ccol = gl.DataGadget(a["w"], placement="cpu")
    ds = gl.GadgetDataset(fcol, ccol, a["y"], placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=B, order="sequential", num_workers=2)
    first = _collect(loader)
    np.testing.assert_array_equal(torch.cat([b[0] for b in first]).numpy(), a["x"])
    ids = torch.tensor([0, 50, 102])
    new_x = np.full((3, 3, 2), 7.5, np.float32)
    new_w = np.array([-1.0, -2.0, -3.0])
    fcol.insertData(torch.from_numpy(new_x), ids)
    ccol.insertData(torch.from_numpy(new_w), ids)
    x2, w2 = a["x"].copy(), a["w"].copy()
    x2[ids.numpy()] = new_x
    w2[ids.numpy()] = new_w
    for nw in (2, 0):
        loader = gl.GadgetLoader(ds, batch_size=B, order="sequential", num_workers=nw)
        second = _collect(loader)
        np.testing.assert_array_equal(torch.cat([b[0] for b in second]).numpy(), x2)
        np.testing.assert_array_equal(torch.cat([b[1] for b in second]).numpy(), w2)
        np.testing.assert_array_equal(torch.cat([b[2] for b in second]).numpy(), a["y"])
    fcol.close()
    np.testing.assert_array_equal(np.load(npy), x2)


# ---- more combinations ----------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_sampler_early_break_then_set_epoch(num_workers):
    """README: DataLoader workers draw ahead of the loop, so after an early break call
    set_epoch; the next pass then starts that epoch from its first batch."""
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=14)
    loader = DataLoader(ds, batch_sampler=s, num_workers=num_workers)
    for i, _b in enumerate(loader):
        if i == 1:
            break
    s.set_epoch(0)
    batches = list(loader)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == s.epoch_order(0).tolist()
    assert _labels(list(loader)) == s.epoch_order(1).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_early_break_restarts_the_same_epoch(num_workers):
    """GadgetLoader counts the batches it handed out: a pass left early (even with workers
    that drew ahead) is restarted by the next iter(); only a full pass moves to the next epoch."""
    a = _arrays()
    loader = gl.GadgetLoader(_dataset(a), batch_size=B, seed=15, num_workers=num_workers)
    e0 = loader.sampler.epoch_order(0).tolist()
    e1 = loader.sampler.epoch_order(1).tolist()
    for i, _b in enumerate(loader):
        if i == 2:
            break
    assert _labels(_collect(loader)) == e0
    assert _labels(_collect(loader)) == e1
    loader.set_epoch(7)
    batches = _collect(loader)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == loader.sampler.epoch_order(7).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_form_weighted_sampler_repeated_ids(num_workers):
    """A torch sampler that repeats rows (WeightedRandomSampler with replacement): every
    repeated id gets its own row, as NumPy's fancy indexing gives."""
    a = _arrays()
    ds = _dataset(a)
    weights = torch.zeros(N, dtype=torch.float64)
    weights[[2, 40, 99]] = 1.0
    ws = torch.utils.data.WeightedRandomSampler(
        weights, num_samples=64, replacement=True, generator=torch.Generator().manual_seed(1)
    )
    batches = list(DataLoader(ds, batch_size=B, sampler=ws, num_workers=num_workers))
    seen = _check_batches(batches, a, sizes=[B] * 4, every_row_once=False)
    assert len(seen) == 64 and set(seen) <= {2, 40, 99}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_batch_sampler_of_arrays_and_tensors(num_workers):
    a = _arrays()
    ds = _dataset(a)
    batches_ids = [
        np.array([5, 5, 0], dtype=np.int32),
        torch.tensor([102, 1], dtype=torch.int16),
        [7],
        range(10, 13),
        torch.tensor([3, 4], dtype=torch.uint8),
    ]
    batches = list(DataLoader(ds, batch_sampler=batches_ids, num_workers=num_workers))
    got = [b[1].tolist() for b in batches]
    assert got == [[5, 5, 0], [102, 1], [7], [10, 11, 12], [3, 4]]
    _check_batches(batches, a, every_row_once=False)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_per_sample_loading_batch_size_none(num_workers):
    """DataLoader(ds, batch_size=None) asks ds[i] for each sample: one row per column."""
    a = _arrays(20)
    ds = _dataset(a)
    samples = list(DataLoader(ds, batch_size=None, num_workers=num_workers))
    assert len(samples) == 20
    for i, s in enumerate(samples):
        assert len(s) == 3
        assert tuple(s[0].shape) == (3, 2) and s[1].shape == () and s[2].shape == ()
        np.testing.assert_array_equal(s[0].numpy(), a["x"][i])
        assert int(s[1]) == i and float(s[2]) == a["w"][i]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_coalesce_changes_nothing_but_timing(num_workers):
    """Docstrings: order, contents and resume positions are exactly those of coalesce=1."""
    a = _arrays()
    ds = _dataset(a)
    ref = _collect(gl.GadgetLoader(ds, batch_size=B, seed=19, coalesce=1))
    if num_workers:
        # documented for num_workers=0 only; with workers it is refused, clearly
        with pytest.raises(gl.GadgetValueError, match="num_workers"):
            gl.GadgetLoader(ds, batch_size=B, seed=19, coalesce=4, num_workers=num_workers)
        got = _collect(gl.GadgetLoader(ds, batch_size=B, seed=19, num_workers=num_workers))
    else:
        got = _collect(gl.GadgetLoader(ds, batch_size=B, seed=19, coalesce=4))
    assert len(got) == len(ref)
    for r, g in zip(ref, got, strict=True):
        for t, u in zip(r, g, strict=True):
            assert torch.equal(t, u)
    s = gl.GadgetSampler(ds, batch_size=B, seed=19, coalesce=3)
    f = _collect(DataLoader(ds, batch_sampler=s, num_workers=num_workers))
    assert _labels(f) == _labels(ref)
    _check_batches(f, a, sizes=FULL_SIZES)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_larger_than_dataset(num_workers):
    a = _arrays()
    ds = _dataset(a)
    d = list(DataLoader(ds, batch_size=500, shuffle=True, num_workers=num_workers))
    _check_batches(d, a, sizes=[N])
    g = list(gl.GadgetLoader(ds, batch_size=500, seed=1, num_workers=num_workers))
    _check_batches(g, a, sizes=[N])
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=500, drop_last=True, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_over_sampler_follows_its_set_epoch(num_workers):
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=23, order="random")
    loader = gl.GadgetLoader(ds, sampler=s, num_workers=num_workers)
    s.set_epoch(3)
    batches = list(loader)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == s.epoch_order(3).tolist()
    assert s.epoch == 4


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resume_with_workers(num_workers):
    """README: StatefulDataLoader(ds, batch_sampler=sampler) resumes mid-epoch exactly."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=31)
    full = s.epoch_order(0).tolist()
    loader = sdl.StatefulDataLoader(ds, batch_sampler=s, num_workers=num_workers)
    head = []
    for i, b in enumerate(loader):
        head.append(tuple(t.clone() for t in b))
        if i == 2:
            state = loader.state_dict()
            break
    del loader
    gc.collect()
    s2 = gl.GadgetSampler(ds, batch_size=B, seed=0)
    loader2 = sdl.StatefulDataLoader(ds, batch_sampler=s2, num_workers=num_workers)
    loader2.load_state_dict(state)
    tail = [tuple(t.clone() for t in b) for b in loader2]
    assert _labels(head) + _labels(tail) == full
    _check_batches(head + tail, a, sizes=FULL_SIZES)
    assert _labels(list(loader2)) == s.epoch_order(1).tolist()


def test_persistent_workers_break_then_set_epoch():
    a = _arrays()
    ds = _dataset(a)
    s = gl.GadgetSampler(ds, batch_size=B, seed=32)
    loader = DataLoader(ds, batch_sampler=s, num_workers=2, persistent_workers=True)
    for i, _b in enumerate(loader):
        if i == 1:
            break
    s.set_epoch(0)
    batches = list(loader)
    _check_batches(batches, a, sizes=FULL_SIZES)
    assert _labels(batches) == s.epoch_order(0).tolist()
    assert _labels(list(loader)) == s.epoch_order(1).tolist()
    del loader
    gc.collect()


def test_loader_ranks_with_workers_cover_every_row_once():
    """Docstring: rank r takes n // R rows plus one for the first n % R ranks; every rank
    yields the same number of batches."""
    a = _arrays()
    ds = _dataset(a)
    per_rank = []
    for r in (0, 1):
        loader = gl.GadgetLoader(ds, batch_size=B, num_replicas=2, rank=r, seed=33, num_workers=2)
        batches = list(loader)
        assert len(batches) == len(loader) == 4
        _check_batches(batches, a, every_row_once=False)
        per_rank.append(_labels(batches))
    assert [len(p) for p in per_rank] == [52, 51]
    order = gl.GadgetSampler(N, batch_size=B, seed=33).epoch_order(0).tolist()
    assert per_rank[0] + per_rank[1] == order


def test_loader_persistent_workers_resume_after_an_epoch():
    a = _arrays()
    loader = gl.GadgetLoader(
        _dataset(a), batch_size=B, seed=34, num_workers=2, persistent_workers=True
    )
    assert _labels(_collect(loader)) == loader.sampler.epoch_order(0).tolist()
    head = []
    for i, b in enumerate(loader):  # epoch 1, left after 3 batches
        head.append(tuple(t.clone() for t in b))
        if i == 2:
            state = loader.state_dict()
            break
    other = gl.GadgetLoader(
        _dataset(a), batch_size=B, seed=1, num_workers=2, persistent_workers=True
    )
    _collect(other)  # a pass of its own first: the persistent workers are running
    other.load_state_dict(state)
    tail = _collect(other)
    assert _labels(head) + _labels(tail) == loader.sampler.epoch_order(1).tolist()
    _check_batches(head + tail, a, sizes=FULL_SIZES)
    del loader, other
    gc.collect()


def test_fork_while_another_thread_reads_hdf5_and_zarr_columns(tmp_path):
    """README: HDF5 handles do not cross a fork (a fork waits for a table another thread is
    using); workers reopen file columns. Rows read in workers and in the reading thread must
    both stay right."""
    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    a = _arrays()
    h5 = tmp_path / "x.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("x", data=a["x"], chunks=(8, 3, 2), compression="gzip")
    zp = tmp_path / "y.zarr"
    z = zarr.open(str(zp), mode="w", shape=(N,), chunks=(16,), dtype="int64")
    z[:] = a["y"]
    gx = gl.DataGadget(str(h5), placement="file")
    gy = gl.DataGadget(str(zp), placement="file")
    ds = gl.GadgetDataset(gx, gy, a["w"], placement="cpu", device="cpu")
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def reader():
        rng = np.random.default_rng(1)
        try:
            while not stop.is_set():
                ids = rng.integers(0, N, 20)
                b = ds[ids]
                if not (
                    np.array_equal(b[0].numpy(), a["x"][ids]) and np.array_equal(b[1].numpy(), ids)
                ):
                    bad.append(repr(ids))
                reads[0] += 1
        except Exception as e:  # pragma: no cover - reported below
            bad.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        t0 = time.monotonic()
        d = list(DataLoader(ds, batch_size=B, shuffle=True, num_workers=2))
        g = list(gl.GadgetLoader(ds, batch_size=B, seed=3, num_workers=2))
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    _check_batches(d, a, sizes=FULL_SIZES)
    _check_batches(g, a, sizes=FULL_SIZES)
    assert not bad, bad[:3]
    assert reads[0] > 0
    assert elapsed < 30
    gx.close()
    gy.close()


def test_hdf5_writes_between_epochs_seen_by_new_workers(tmp_path):
    h5py = pytest.importorskip("h5py")
    a = _arrays()
    h5 = tmp_path / "x.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("x", data=a["x"])
    gx = gl.DataGadget(str(h5), placement="file")
    ds = gl.GadgetDataset(gx, a["y"], a["w"], placement="cpu", device="cpu")
    _check_batches(
        list(DataLoader(ds, batch_size=B, shuffle=True, num_workers=2)), a, sizes=FULL_SIZES
    )
    ids = np.array([1, 64, 101])
    new = np.arange(18, dtype=np.float32).reshape(3, 3, 2)
    gx.insertData(torch.from_numpy(new), torch.from_numpy(ids))
    a2 = dict(a, x=a["x"].copy())
    a2["x"][ids] = new
    _check_batches(
        list(DataLoader(ds, batch_size=B, shuffle=True, num_workers=2)), a2, sizes=FULL_SIZES
    )
    _check_batches(list(gl.GadgetLoader(ds, batch_size=B, num_workers=2)), a2, sizes=FULL_SIZES)
    gx.close()
    with h5py.File(h5, "r") as f:
        np.testing.assert_array_equal(f["x"][...], a2["x"])


def test_loader_hands_dataloader_kwargs_through():
    """Docstring: **dataloader_kwargs are passed to torch.utils.data.DataLoader."""
    a = _arrays()
    ds = _dataset(a)
    g = torch.Generator().manual_seed(1)

    def init(_i):
        return None

    loader = gl.GadgetLoader(
        ds,
        batch_size=B,
        num_workers=2,
        timeout=30,
        prefetch_factor=1,
        persistent_workers=True,
        generator=g,
        worker_init_fn=init,
        multiprocessing_context="fork",
    )
    dl = loader.dataloader
    assert isinstance(dl, DataLoader)
    assert dl.num_workers == 2 and dl.timeout == 30 and dl.prefetch_factor == 1
    assert dl.persistent_workers is True
    assert dl.generator is g and dl.worker_init_fn is init
    assert dl.batch_sampler is loader.sampler and dl.dataset is loader.dataset
    _check_batches(list(loader), a, sizes=FULL_SIZES)
    del loader, dl
    gc.collect()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_column_shapes_n_by_1_and_1d_kept(num_workers):
    """1-D columns give one value per row; an (n, 1) column keeps its trailing axis."""
    a = _arrays()
    col = a["w"][:, None].copy()
    ds = gl.GadgetDataset(col, a["y"], torch.from_numpy(a["x"]), placement="cpu", device="cpu")
    for batches in (
        list(DataLoader(ds, batch_size=B, shuffle=True, num_workers=num_workers)),
        list(gl.GadgetLoader(ds, batch_size=B, num_workers=num_workers)),
    ):
        for b in batches:
            k = len(b[1])
            assert tuple(b[0].shape) == (k, 1) and tuple(b[1].shape) == (k,)
            assert tuple(b[2].shape) == (k, 3, 2)
            np.testing.assert_array_equal(b[0].numpy(), col[b[1].numpy()])
            np.testing.assert_array_equal(b[2].numpy(), a["x"][b[1].numpy()])
        assert sorted(_labels(batches)) == list(range(N))
