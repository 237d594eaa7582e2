"""Review probes (session 17) of the sampler form's read-ahead (``GadgetSampler(coalesce=k)``).

Every probe asserts the documented behaviour: a batch handed out through a read-ahead
group is what ``ds.gather(ids)`` / NumPy indexing returns at the time it is asked for
(only rows written into the table after the group was read may be stale), and errors
are those of ``coalesce=1``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader.data._sampler import SEQUENTIAL_SEGMENT


def _ds(*cols: Any, **kw: Any) -> gl.GadgetDataset:
    kw.setdefault("placement", "cpu")
    kw.setdefault("device", "cpu")
    return gl.GadgetDataset(*cols, **kw)


def _snap(batch: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in batch]


def _check(batch: Any, arrays: list[np.ndarray], ids: np.ndarray) -> None:
    assert len(batch) == len(arrays)
    for t, a in zip(batch, arrays, strict=True):
        want = torch.from_numpy(np.ascontiguousarray(a[ids]))
        assert t.dtype == want.dtype
        assert tuple(t.shape) == tuple(want.shape)
        assert t.is_contiguous()
        assert torch.equal(t, want)


def _gathers(ds: gl.GadgetDataset, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    inner = ds._gather

    def counted(ids: Any, own: bool) -> Any:
        sizes.append(int(torch.as_tensor(ids).numel()))
        return inner(ids, own=own)

    monkeypatch.setattr(ds, "_gather", counted)
    return sizes


# ---- aliasing: a batch handed out twice is the same tensor -----------------------------------------
@pytest.mark.parametrize("k", [1, 8])
def test_same_batch_asked_twice_is_not_the_modified_tensor(k: int) -> None:
    """``ds[ids]`` twice for one batch inside a group: the second answer must be the
    table's rows, not the tensor handed out the first time (which the caller changed in
    place, as in-place normalisation / augmentation does)."""
    x = np.arange(64, dtype=np.float32)
    ds = _ds(x)
    batches = list(gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=k))
    ds[batches[0]]
    ds[batches[1]]  # starts a group of batches 1-4
    ds[batches[2]][0].mul_(0)  # caller's in-place work on its batch
    again = ds[batches[2]]
    _check(again, [x], batches[2].numpy())


@pytest.mark.parametrize("k", [1, 8])
def test_two_loaders_over_one_sampler_get_independent_batches(k: int) -> None:
    x = np.arange(96, dtype=np.float32)
    ds = _ds(x)
    s = gl.GadgetSampler(ds, batch_size=8, seed=3, coalesce=k)
    a, b = iter(DataLoader(ds, batch_sampler=s)), iter(DataLoader(ds, batch_sampler=s))
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=8, seed=3)]
    for i in range(12):
        xa = next(a)[0]
        xa.add_(1000)  # loader a's consumer changes its batch in place
        xb = next(b)[0]
        assert torch.equal(xb, torch.from_numpy(x[want[i]])), f"batch {i}"


def test_reiterating_after_early_break_with_inplace_batches() -> None:
    """Break mid-group, re-iterate the same DataLoader (same epoch, same order): the
    batches must again be the table's rows."""
    x = np.arange(80, dtype=np.float32)
    ds = _ds(x)
    s = gl.GadgetSampler(ds, batch_size=8, seed=1, coalesce=8)
    loader = DataLoader(ds, batch_sampler=s)
    for i, (xb,) in enumerate(loader):
        xb.sub_(xb)  # in place
        if i == 3:
            break
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=8, seed=1)]
    for i, (xb,) in enumerate(loader):
        assert torch.equal(xb, torch.from_numpy(x[want[i]])), f"batch {i}"


def test_load_state_dict_on_same_sampler_mid_group_with_inplace_batches() -> None:
    x = np.arange(80, dtype=np.float32)
    ds = _ds(x)
    s = gl.GadgetSampler(ds, batch_size=8, seed=1, coalesce=8)
    it = iter(DataLoader(ds, batch_sampler=s))
    next(it), next(it)  # batch 1 started a group of batches 1-8
    state = s.state_dict()
    for _ in range(3):
        next(it)[0].fill_(-1.0)  # batches 2-4, changed in place by the consumer
    s.load_state_dict(state)
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=8, seed=1)]
    got = [b[0].clone() for b in DataLoader(ds, batch_sampler=s)]
    assert len(got) == 8
    for i, g in enumerate(got, start=2):
        assert torch.equal(g, torch.from_numpy(x[want[i]])), f"batch {i}"


def test_a_grouped_batch_shares_the_groups_memory_and_clone_frees_it() -> None:
    """Documented: a batch of a group is a view of the group's memory (keeping one keeps
    the group); ``clone()`` gives a batch of its own."""
    x = np.zeros((256, 16), dtype=np.float32)
    ds = _ds(x)
    s = gl.GadgetSampler(ds, batch_size=8, order="sequential", coalesce=16)
    it = iter(DataLoader(ds, batch_sampler=s))
    next(it)
    b = next(it)[0]
    assert b.untyped_storage().nbytes() == 16 * b.nbytes  # the group's 16 batches
    c = b.clone()
    assert c.untyped_storage().nbytes() == c.nbytes and torch.equal(b, c)


# ---- ids changed through NumPy (no version bump) ------------------------------------------------
def test_ids_changed_through_numpy_after_group_read_are_documented_unseen() -> None:
    """Documented: torch cannot see a change made through NumPy, so a batch already read
    ahead keeps the rows of its ids at the group's read; coalesce=1 sees the change."""
    x = np.arange(40, dtype=np.float32) * 10
    for k, want0 in [(8, 120.0), (1, 390.0)]:
        ds = _ds(x)
        batches = list(gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=k))
        ds[batches[0]]
        ds[batches[1]]  # with k=8: the group of batches 1-8 is read now
        batches[3].numpy()[0] = 39
        got = ds[batches[3]][0]
        assert got.tolist() == [want0, 130.0, 140.0, 150.0]


def test_out_of_range_id_written_through_numpy_after_group_read() -> None:
    """Such an id is never used to read (the rows were read with the ids of the group's
    read): nothing outside the table is touched; with coalesce=1 it raises."""
    x = np.arange(40, dtype=np.float32)
    ds = _ds(x)
    batches = list(gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=8))
    ds[batches[0]]
    ds[batches[1]]
    batches[3].numpy()[1] = 40  # out of range
    assert ds[batches[2]][0].tolist() == [8.0, 9.0, 10.0, 11.0]
    assert ds[batches[3]][0].tolist() == [12.0, 13.0, 14.0, 15.0]
    ds1 = _ds(x)
    plain = list(gl.GadgetSampler(ds1, batch_size=4, order="sequential", coalesce=1))
    plain[3].numpy()[1] = 40
    with pytest.raises(gl.GadgetIndexError):
        ds1[plain[3]]


@pytest.mark.parametrize("k", [1, 8])
def test_out_of_range_id_through_numpy_fails_at_its_own_batch(k: int) -> None:
    """With coalesce=1 the bad batch (3) raises and batches 1-2 are returned; the
    read-ahead must not fail batch 1 for an id in batch 3."""
    x = np.arange(40, dtype=np.float32)
    ds = _ds(x)
    batches = list(gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=k))
    batches[3].numpy()[1] = 40
    ds[batches[0]]
    _check(ds[batches[1]], [x], batches[1].numpy())
    _check(ds[batches[2]], [x], batches[2].numpy())
    with pytest.raises(gl.GadgetIndexError):
        ds[batches[3]]


# ---- multi-column shapes and dtypes ------------------------------------------------------------
def _columns(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((n, 5)).astype(np.float32),  # 2-D features
        np.arange(n, dtype=np.int64),  # 1-D labels
        rng.integers(-100, 100, size=n).astype(np.int32),  # int column
        rng.standard_normal((n, 2, 3)).astype(np.float64),  # 3-D rows
        (np.arange(n) % 3 == 0),  # bool
        rng.integers(0, 255, size=(n, 4)).astype(np.uint8),
    ]


@pytest.mark.parametrize("form", ["batch_sampler", "sampler", "index"])
@pytest.mark.parametrize("k", [2, 5, 100])
def test_multi_column_values_shapes_dtypes(form: str, k: int) -> None:
    cols = _columns(157)
    ds = _ds(*cols)
    s = gl.GadgetSampler(ds, batch_size=10, seed=7, coalesce=k)
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=10, seed=7)]
    if form == "batch_sampler":
        got = [_snap(b) for b in DataLoader(ds, batch_sampler=s)]
    elif form == "sampler":
        got = [_snap(b) for b in DataLoader(ds, sampler=s, batch_size=None)]
    else:
        got = [_snap(ds[ids]) for ids in s]
    assert len(got) == len(want) == 16
    for g, ids in zip(got, want, strict=True):
        _check(g, cols, ids)


def test_zero_width_column() -> None:
    x = np.zeros((40, 0), dtype=np.float32)
    y = np.arange(40)
    ds = _ds(x, y)
    s = gl.GadgetSampler(ds, batch_size=4, seed=0, coalesce=4)
    for ids in s:
        _check(ds[ids], [x, y], ids.numpy())


# ---- file-backed columns --------------------------------------------------------------------------
def _write(fmt: str, path: str, x: np.ndarray) -> dict[str, str]:
    if fmt == "npy":
        np.save(path, x)
        return {}
    if fmt == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=x, chunks=(16, x.shape[1]))
        return {"dataset": "x"}
    zarr = pytest.importorskip("zarr")
    z = zarr.create_array(path, shape=x.shape, chunks=(24, x.shape[1]), dtype=x.dtype)
    z[:] = x
    return {}


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
@pytest.mark.parametrize("where", ["file", "cpu"])
@pytest.mark.parametrize("order", ["chunk", "random", "sequential"])
def test_file_columns(fmt: str, where: str, order: str, tmp_path: Any) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((203, 6)).astype(np.float32)
    y = np.arange(203, dtype=np.int64)
    path = os.path.join(str(tmp_path), f"x.{fmt}")
    opts = _write(fmt, path, x)
    col = gl.DataGadget(path, placement=where, device="cpu", **opts)
    try:
        ds = _ds(col, y)
        if order == "chunk" and ds.chunk_rows is None:
            pytest.skip("no chunk layout")
        s = gl.GadgetSampler(ds, batch_size=9, order=order, seed=2, coalesce=4)
        plain = gl.GadgetSampler(ds, batch_size=9, order=order, seed=2)
        want = [o.numpy().copy() for o in plain]
        got = [_snap(b) for b in DataLoader(ds, batch_sampler=s)]
        assert len(got) == len(want)
        for g, ids in zip(got, want, strict=True):
            _check(g, [x, y], ids)
        ds.close()
    finally:
        col.close()


# ---- ranks, drop_last, pad, sequential segments -------------------------------------------------
@pytest.mark.parametrize("order", ["sequential", "random"])
@pytest.mark.parametrize("mode", ["plain", "drop_last", "pad"])
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("k", [3, 40, 100])
def test_ranks_modes_segments(order: str, mode: str, world: int, k: int) -> None:
    # B=3: > 64 batches a rank, so sequential passes cross segment boundaries
    n = 3 * 3 * (SEQUENTIAL_SEGMENT * 2 + 7) + 2
    x = np.arange(n, dtype=np.float32) * 2
    ds = _ds(x, np.arange(n))
    for rank in range(world):
        kw: dict[str, Any] = dict(
            batch_size=3, order=order, seed=4, num_replicas=world, rank=rank,
            drop_last=mode == "drop_last", pad=mode == "pad",
        )  # fmt: skip
        want = [o.numpy().copy() for o in gl.GadgetSampler(ds, **kw)]
        s = gl.GadgetSampler(ds, coalesce=k, **kw)
        got = [_snap(b) for b in DataLoader(ds, batch_sampler=s)]
        assert len(got) == len(want)
        for g, ids in zip(got, want, strict=True):
            _check(g, [x, np.arange(n)], ids)


@pytest.mark.parametrize("k", [3, 64, 65])
def test_sequential_resume_across_segment_boundary(k: int) -> None:
    n = 5 * 200 + 3
    x = np.arange(n, dtype=np.float32)
    ds = _ds(x)
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=5, order="sequential")]
    for stop in (1, 2, 63, 64, 65, 66, 127, 128, 129):
        s = gl.GadgetSampler(ds, batch_size=5, order="sequential", coalesce=k)
        it = iter(DataLoader(ds, batch_sampler=s))
        head = [next(it)[0].clone() for _ in range(stop)]
        state = s.state_dict()
        s2 = gl.GadgetSampler(ds, batch_size=5, order="sequential", coalesce=k)
        s2.load_state_dict(state)
        tail = [b[0].clone() for b in DataLoader(ds, batch_sampler=s2)]
        got = head + tail
        assert len(got) == len(want)
        for g, ids in zip(got, want, strict=True):
            assert torch.equal(g, torch.from_numpy(x[ids]))


# ---- lifecycle mid-group ----------------------------------------------------------------------
def test_column_closed_mid_group_raises() -> None:
    col = gl.DataGadget(np.arange(64, dtype=np.float32), placement="cpu", device="cpu")
    ds = _ds(col)
    it = iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, coalesce=8)))
    next(it), next(it), next(it)
    col.close()
    with pytest.raises(gl.GadgetError):
        next(it)


def test_column_reloaded_mid_group(tmp_path: Any) -> None:
    x = np.arange(64, dtype=np.float32)
    new = x + 1000
    path = os.path.join(str(tmp_path), "new.npy")
    np.save(path, new)
    col = gl.DataGadget(x, placement="cpu", device="cpu")
    ds = _ds(col)
    s = gl.GadgetSampler(ds, batch_size=4, seed=5, coalesce=8)
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=4, seed=5)]
    it = iter(DataLoader(ds, batch_sampler=s))
    next(it), next(it), next(it)
    col.load(path)
    for i in range(3, 16):
        assert torch.equal(next(it)[0], torch.from_numpy(new[want[i]])), f"batch {i}"
    col.close()


def test_column_reloaded_with_other_row_count_mid_group_raises(tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "short.npy")
    np.save(path, np.arange(10, dtype=np.float32))
    col = gl.DataGadget(np.arange(64, dtype=np.float32), placement="cpu", device="cpu")
    ds = _ds(col)
    it = iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, coalesce=8)))
    next(it), next(it), next(it)
    col.load(path)
    with pytest.raises(gl.GadgetValueError):
        next(it)
    col.close()


def test_dataset_closed_mid_group_raises() -> None:
    ds = _ds(np.arange(64, dtype=np.float32), np.arange(64))
    it = iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, coalesce=8)))
    next(it), next(it), next(it)
    ds.close()
    with pytest.raises(gl.GadgetError):
        next(it)


def test_writes_before_group_are_seen_and_first_batch_fresh() -> None:
    x = np.zeros((64, 1), dtype=np.float32)
    ds = _ds(x.copy())
    s = gl.GadgetSampler(ds, batch_size=8, order="sequential", coalesce=3)
    got = []
    for i, (b,) in enumerate(DataLoader(ds, batch_sampler=s)):
        got.append(float(b[0, 0]))
        ds.columns[0][torch.arange(64)] = torch.full((64, 1), float(i + 1))
    # groups: 0 alone, 1-3, 4-6, 7: each group's first batch is fresh
    assert got == [0.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 7.0]


def test_set_epoch_mid_epoch_and_mid_group() -> None:
    x = np.arange(100, dtype=np.float32)
    ds = _ds(x)
    s = gl.GadgetSampler(ds, batch_size=8, seed=2, coalesce=4)
    loader = DataLoader(ds, batch_sampler=s)
    it = iter(loader)
    next(it), next(it), next(it)
    for e in (3, 0):
        s.set_epoch(e)
        plain = gl.GadgetSampler(ds, batch_size=8, seed=2)
        plain.set_epoch(e)
        want = [o.numpy().copy() for o in plain]
        got = [b[0].clone() for b in loader]
        assert len(got) == len(want)
        for g, ids in zip(got, want, strict=True):
            assert torch.equal(g, torch.from_numpy(x[ids]))


def test_two_loaders_different_samplers_interleaved_multi_column() -> None:
    cols = _columns(120)
    ds = _ds(*cols)
    sa = gl.GadgetSampler(ds, batch_size=7, seed=1, coalesce=5)
    sb = gl.GadgetSampler(ds, batch_size=7, order="sequential", coalesce=3)
    wa = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=7, seed=1)]
    wb = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=7, order="sequential")]
    a, b = iter(DataLoader(ds, batch_sampler=sa)), iter(DataLoader(ds, batch_sampler=sb))
    pattern = [a, a, a, b, a, b, b, b, a] * 4
    ia = ib = 0
    for which in pattern:
        if which is a and ia < len(wa):
            _check(_snap(next(a)), cols, wa[ia])
            ia += 1
        elif which is b and ib < len(wb):
            _check(_snap(next(b)), cols, wb[ib])
            ib += 1


def test_pickle_dataset_mid_group() -> None:
    x = np.arange(64, dtype=np.float32)
    ds = _ds(x)
    batches = list(gl.GadgetSampler(ds, batch_size=4, seed=8, coalesce=8))
    ds[batches[0]], ds[batches[1]], ds[batches[2]]
    copy = pickle.loads(pickle.dumps(ds))
    for i in range(3, 16):
        _check(ds[batches[i]], [x], batches[i].numpy())
        _check(copy[batches[i]], [x], batches[i].numpy())


def test_gather_interleaved_with_group() -> None:
    x = np.arange(64, dtype=np.float32)
    ds = _ds(x)
    for i, ids in enumerate(gl.GadgetSampler(ds, batch_size=4, seed=8, coalesce=8)):
        _check(ds[ids], [x], ids.numpy())
        _check(ds.gather(ids), [x], ids.numpy())
        if i % 3 == 0:
            _check(ds[torch.arange(3)], [x], np.arange(3))


def test_workers_fork() -> None:
    cols = _columns(120)
    ds = _ds(*cols)
    # the parent holds a group when the workers fork
    warm = list(gl.GadgetSampler(ds, batch_size=6, seed=9, coalesce=4))
    ds[warm[0]], ds[warm[1]]
    s = gl.GadgetSampler(ds, batch_size=6, seed=9, coalesce=4)
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=6, seed=9)]
    loader = DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork")
    got = [_snap(b) for b in loader]
    for g, ids in zip(got, want, strict=True):
        _check(g, cols, ids)


def test_stateful_dataloader_resume_mid_group() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    x = np.arange(120, dtype=np.float32)
    ds = _ds(x)
    want = [o.numpy().copy() for o in gl.GadgetSampler(ds, batch_size=8, seed=3)]
    loader = sdl.StatefulDataLoader(
        ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8, seed=3, coalesce=4)
    )
    it = iter(loader)
    head = [next(it)[0].clone() for _ in range(3)]
    state = loader.state_dict()
    again = sdl.StatefulDataLoader(
        ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8, seed=3, coalesce=4)
    )
    again.load_state_dict(state)
    got = head + [b[0].clone() for b in again]
    assert len(got) == len(want)
    for g, ids in zip(got, want, strict=True):
        assert torch.equal(g, torch.from_numpy(x[ids]))
