"""A GadgetSampler's read-ahead: batches read through a dataset's indexing in the
sampler's order may come from one gather of several batches, and are then exactly the
batches of ``coalesce=1`` (only rows written into the table meanwhile can differ)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

HAS_CUDA = torch.cuda.is_available()


def _count_gathers(ds: gl.GadgetDataset, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the row count of every gather the dataset makes."""
    sizes: list[int] = []
    inner = ds._gather

    def counted(ids: Any, own: bool) -> Any:
        sizes.append(int(torch.as_tensor(ids).numel()))
        return inner(ids, own=own)

    monkeypatch.setattr(ds, "_gather", counted)
    return sizes


def _as_lists(loader: Any) -> list[list[torch.Tensor]]:
    return [[t.detach().cpu().clone() for t in b] for b in loader]


def _loader(ds: gl.GadgetDataset, sampler: gl.GadgetSampler, form: str) -> DataLoader[Any]:
    if form == "batch_sampler":
        return DataLoader(ds, batch_sampler=sampler)
    return DataLoader(ds, sampler=sampler, batch_size=None)


@pytest.mark.parametrize("form", ["batch_sampler", "sampler"])
@pytest.mark.parametrize("k", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("order", ["sequential", "random"])
def test_read_ahead_equals_numpy(
    placement: str,
    device: torch.device,
    form: str,
    k: int,
    order: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((203, 7)).astype(np.float32)
    y = np.arange(203, dtype=np.int64)
    ds = gl.GadgetDataset(x, y, placement=placement, device=device)
    sizes = _count_gathers(ds, monkeypatch)
    sampler = gl.GadgetSampler(ds, batch_size=16, order=order, seed=5, coalesce=k)
    batches = _as_lists(_loader(ds, sampler, form))
    assert len(batches) == 13  # 12 full batches and one of 11 rows
    assert [b[1].numel() for b in batches] == [16] * 12 + [11]
    for xb, yb in batches:
        assert torch.equal(xb, torch.from_numpy(x[yb.numpy()]))
    assert sorted(torch.cat([b[1] for b in batches]).tolist()) == list(range(203))
    # the same batches as the sampler's order, and as coalesce=1
    expect = [list(b) for b in gl.GadgetSampler(ds, batch_size=16, order=order, seed=5)]
    assert [b[1].tolist() for b in batches] == expect
    if k == 1:
        assert sizes == [16] * 12 + [11]
    else:  # the first batch alone, then groups of up to k batches (the last one short)
        assert sizes[0] == 16 and len(sizes) < 13 and sum(sizes) == 203
        assert max(sizes) == min(k * 16, 203 - 16)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_read_ahead_with_ranks_and_drop_last(world: int, drop_last: bool) -> None:
    x = torch.arange(250.0).reshape(125, 2)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    seen: list[int] = []
    for rank in range(world):
        kw = dict(batch_size=8, seed=2, num_replicas=world, rank=rank, drop_last=drop_last)
        plain = _as_lists(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, **kw)))
        ahead = _as_lists(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, coalesce=4, **kw)))
        assert len(plain) == len(ahead)
        for p, a in zip(plain, ahead, strict=True):
            assert torch.equal(p[0], a[0])
        seen += [int(v) // 2 for b in ahead for v in b[0][:, 0].tolist()]
    assert len(seen) == len(set(seen))  # no row twice, across ranks too
    if not drop_last:
        assert sorted(seen) == list(range(125))


def test_read_ahead_with_padding_is_exact() -> None:
    x = torch.arange(50.0)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    for rank in range(3):
        kw = dict(batch_size=4, seed=1, num_replicas=3, rank=rank, pad=True)
        plain = _as_lists(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, **kw)))
        ahead = _as_lists(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, coalesce=5, **kw)))
        assert [b[0].tolist() for b in plain] == [b[0].tolist() for b in ahead]


def test_writes_after_a_group_is_read_are_not_seen_by_it() -> None:
    """The documented trade: rows read ahead are those of the group's first batch's time."""
    x = torch.zeros(64, 1)
    for k, stale in [(4, True), (1, False)]:
        ds = gl.GadgetDataset(x.clone(), placement="cpu", device="cpu")
        sampler = gl.GadgetSampler(ds, batch_size=8, order="sequential", coalesce=k)
        got = []
        for i, (b,) in enumerate(DataLoader(ds, batch_sampler=sampler)):
            got.append(b[:, 0].clone())
            ds.columns[0][torch.arange(64)] = torch.full((64, 1), float(i + 1))
        # batch 0 alone; batch 1 starts a group of 4 (batches 1-4), batch 5 another
        fresh = [float(i) for i in range(8)]
        old = [0.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0]
        assert [float(g[0]) for g in got] == (old if stale else fresh)
        assert all(bool((g == g[0]).all()) for g in got)


def test_interleaved_samplers_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.arange(96.0)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    a = iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8, seed=1, coalesce=3)))
    b = iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8, seed=2, coalesce=3)))
    got_a, got_b = [], []
    for _ in range(12):
        got_a.append(next(a)[0].tolist())
        got_b.append(next(b)[0].tolist())
    want_a = [[float(i) for i in s] for s in gl.GadgetSampler(ds, batch_size=8, seed=1)]
    want_b = [[float(i) for i in s] for s in gl.GadgetSampler(ds, batch_size=8, seed=2)]
    assert got_a == want_a and got_b == want_b


def test_resume_mid_group_equals_uninterrupted() -> None:
    x = torch.arange(300.0)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    full = [
        b[0].tolist()
        for b in DataLoader(
            ds, batch_sampler=gl.GadgetSampler(ds, batch_size=16, seed=9, coalesce=4)
        )
    ]
    sampler = gl.GadgetSampler(ds, batch_size=16, seed=9, coalesce=4)
    it = iter(DataLoader(ds, batch_sampler=sampler))
    head = [next(it)[0].tolist() for _ in range(3)]  # inside the first group
    state = sampler.state_dict()
    again = gl.GadgetSampler(ds, batch_size=16, seed=9, coalesce=4)
    again.load_state_dict(state)
    tail = [b[0].tolist() for b in DataLoader(ds, batch_sampler=again)]
    assert head + tail == full


def test_second_epoch_and_set_epoch_are_exact() -> None:
    x = torch.arange(100.0)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    sampler = gl.GadgetSampler(ds, batch_size=8, seed=4, coalesce=4)
    loader = DataLoader(ds, batch_sampler=sampler)
    epochs = [[b[0].tolist() for b in loader] for _ in range(2)]
    plain = gl.GadgetSampler(ds, batch_size=8, seed=4)
    for e in range(2):
        plain.set_epoch(e)
        assert epochs[e] == [[float(i) for i in s] for s in plain]
    assert epochs[0] != epochs[1]


def test_changed_ids_are_gathered_as_given() -> None:
    """A batch changed in place (or replaced) by a user's batch sampler wrapper is read
    as it now is, not from the group read before the change."""
    x = torch.arange(40.0)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    sampler = gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=8)
    got = []
    for i, ids in enumerate(sampler):
        if i == 3:
            ids[0] = 39  # in place: the version counter moves
        got.append(ds[ids][0].tolist())
    assert got[3] == [39.0, 13.0, 14.0, 15.0]
    assert got[4] == [16.0, 17.0, 18.0, 19.0]
    with pytest.raises(gl.GadgetError):
        for i, ids in enumerate(gl.GadgetSampler(ds, batch_size=4, coalesce=8)):
            if i == 2:
                ids[1] = 40  # out of range: checked as any ids would be
            ds[ids]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_coalesce_is_refused(bad: object) -> None:
    with pytest.raises(gl.GadgetError, match="coalesce"):
        gl.GadgetSampler(10, batch_size=2, coalesce=bad)  # type: ignore[arg-type]


def test_coalesce_property_and_pickle() -> None:
    assert gl.GadgetSampler(10, batch_size=2).coalesce is None
    s = gl.GadgetSampler(10, batch_size=2, coalesce=3)
    assert s.coalesce == 3
    assert pickle.loads(pickle.dumps(s)).coalesce == 3


def test_cpu_default_does_not_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = gl.GadgetDataset(torch.arange(64.0), placement="cpu", device="cpu")
    sizes = _count_gathers(ds, monkeypatch)
    list(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8)))
    assert sizes == [8] * 8


def test_workers_read_batches_exactly() -> None:
    x = torch.arange(96.0)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=8, seed=3, coalesce=4)
    got = [b[0].tolist() for b in DataLoader(ds, batch_sampler=s, num_workers=2)]
    assert got == [[float(i) for i in b] for b in gl.GadgetSampler(ds, batch_size=8, seed=3)]


def test_close_drops_the_group() -> None:
    ds = gl.GadgetDataset(torch.arange(64.0), placement="cpu", device="cpu")
    it = iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8, coalesce=4)))
    next(it), next(it)
    assert ds._group is not None
    state = ds.__getstate__()
    assert state["_group"] is None and state["_expect"] is None
    ds.close()
    assert ds._group is None


@pytest.mark.gpu
def test_gpu_default_reads_ahead_on_kernel_tables(
    placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5000, 32)).astype(np.float32)
    ds = gl.GadgetDataset(x, placement=placement, device="cuda")
    sizes = _count_gathers(ds, monkeypatch)
    sampler = gl.GadgetSampler(ds, batch_size=256, seed=1)
    batches = [b[0].cpu() for b in DataLoader(ds, batch_sampler=sampler)]
    order = [list(b) for b in gl.GadgetSampler(ds, batch_size=256, seed=1)]
    assert all(torch.equal(b, torch.from_numpy(x[o])) for b, o in zip(batches, order, strict=True))
    if ds._routes() == ("kernel",):  # cuda / pinned tables with CuPy present
        assert len(sizes) == 2  # the first batch alone, then one group of the rest
    else:
        assert len(sizes) == len(batches)


@pytest.mark.gpu
def test_gpu_group_used_on_another_stream() -> None:
    """A batch of a group asked for on another stream waits for the group's gather."""
    x = torch.randn(4096, 64)
    ds = gl.GadgetDataset(x, placement="cuda", device="cuda")
    order = [list(b) for b in gl.GadgetSampler(ds, batch_size=256, seed=2)]
    for trial in range(3):
        sampler = gl.GadgetSampler(ds, batch_size=256, seed=2, coalesce=8)
        it = iter(DataLoader(ds, batch_sampler=sampler))
        got = [next(it)[0].clone()]
        torch.cuda._sleep(20_000_000 * (trial + 1))  # the group's gather starts late
        got.append(next(it)[0].clone())  # starts a group of batches 1-8 on this stream
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for _ in range(2, 16):
                got.append(next(it)[0].clone())  # read on the side stream at once
        torch.cuda.synchronize()
        assert all(torch.equal(g.cpu(), x[o]) for g, o in zip(got, order, strict=True))


def test_other_views_of_a_grouped_batch_are_gathered_as_given() -> None:
    x = torch.arange(80.0) * 10
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    sampler = gl.GadgetSampler(ds, batch_size=8, seed=6, coalesce=8)
    for i, ids in enumerate(sampler):
        assert torch.equal(ds[ids][0], x[ids])
        if i >= 2:  # inside a group: its views must not answer for other shapes or strides
            assert torch.equal(ds[ids[::2]][0], x[ids[::2]])
            assert torch.equal(ds[ids[1:]][0], x[ids[1:]])
            assert ds[ids.view(-1, 1)][0].shape == (8, 1)
            assert torch.equal(ds.__getitems__(ids[:4])[0][0], x[ids[:4]])
