"""Input pipeline: cases found by session 7's independent review. Each failed before its fix."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reducers)
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader.data import GadgetDataset, GadgetLoader, GadgetSampler


def _ds(placement, device, n=40, width=2):
    table = np.arange(n * width, dtype=np.float32).reshape(n, width)
    return GadgetDataset(table, np.arange(n), placement=placement, device=device), table


# ---- workers: a batch is sent as its own ids, not its whole epoch order -----------------------
def test_sampler_batches_pickle_compactly_without_sharing_the_order():
    n = 1 << 20
    ds = GadgetDataset(torch.arange(n, dtype=torch.float32), placement="cpu", device="cpu")
    batch = next(iter(GadgetSampler(ds, batch_size=4096, seed=1)))
    assert batch._base is not None and batch._base.numel() == n  # a view of the order
    data = ForkingPickler.dumps(batch)
    assert len(data) < 64 << 10  # 4096 ids, not the 8 MiB order
    assert not batch._base.untyped_storage().is_shared()
    back = ForkingPickler.loads(data)
    assert type(back) is torch.Tensor and torch.equal(back, batch)
    assert type(batch + 0) is torch.Tensor  # operations give plain tensors


@pytest.mark.parametrize("form", ["batch_sampler", "loader"])
def test_worker_forms_give_the_same_batches(form):
    ds, table = _ds("cpu", "cpu", n=1000)
    if form == "batch_sampler":
        make = lambda w: DataLoader(  # noqa: E731
            ds, batch_sampler=GadgetSampler(ds, batch_size=64, seed=3), num_workers=w
        )
    else:
        make = lambda w: GadgetLoader(ds, batch_size=64, seed=3, num_workers=w)  # noqa: E731
    ref = [b[1].clone() for b in make(0)]
    got = [b[1] for b in make(2)]
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    np.testing.assert_array_equal(np.sort(torch.cat(got).numpy()), np.arange(1000))


# ---- prefetch=0 reads rows written before each batch is asked for ------------------------------
def test_prefetch_zero_sees_writes_made_between_batches(placement, device):
    g = gl.DataGadget(np.zeros((12, 1), np.float32), placement=placement, device=device)
    ds = GadgetDataset(g)
    seen = []
    for step, (x,) in enumerate(GadgetLoader(ds, batch_size=4, order="sequential", prefetch=0)):
        seen.append(x.flatten().tolist())
        g.insertData(torch.full((12, 1), step + 1.0), torch.arange(12))
    assert seen == [[0.0] * 4, [1.0] * 4, [2.0] * 4]


# ---- set_epoch at the top of every epoch keeps a loaded position --------------------------------
def _loop(loader, e0, stop=None):
    out = []
    for e in range(e0, 2):
        loader.set_epoch(e)
        for i, b in enumerate(loader):
            out.append(b[1].tolist())
            if (e, i) == stop:
                return out, loader.state_dict()
    return out, None


def test_set_epoch_after_load_state_dict_resumes(placement, device):
    ds, _ = _ds(placement, device)
    full, _ = _loop(GadgetLoader(ds, batch_size=5), 0)
    first, state = _loop(GadgetLoader(ds, batch_size=5), 0, stop=(0, 2))
    resumed = GadgetLoader(ds, batch_size=5)
    resumed.load_state_dict(state)
    rest, _ = _loop(resumed, state["sampler"]["epoch"])
    assert first + rest == full
    # a bare sampler: the same habit
    s = GadgetSampler(ds, batch_size=5)
    it = iter(s)
    head = [next(it).tolist() for _ in range(3)]
    s2 = GadgetSampler(ds, batch_size=5)
    s2.load_state_dict(s.state_dict())
    s2.set_epoch(0)
    assert (
        head + [b.tolist() for b in s2]
        == [b[1].tolist() for b in GadgetLoader(ds, batch_size=5)][:8]
    )
    s2.set_epoch(1)  # another epoch: starts at its first batch
    assert len(list(s2)) == 8


# ---- bad combinations are errors, not silent surprises -----------------------------------------
def test_a_column_reloaded_to_another_row_count_is_an_error(tmp_path, placement, device):
    g = gl.DataGadget(np.zeros((20, 2), np.float32), placement=placement, device=device)
    ds = GadgetDataset(g, np.arange(20))
    assert tuple(ds[[15]][0].shape) == (1, 2)
    np.save(tmp_path / "small.npy", np.ones((10, 2), np.float32))
    g.loadCupy(str(tmp_path / "small.npy"))
    with pytest.raises(gl.GadgetValueError, match="now has 10 rows"):
        ds[[1]]


def test_sampler_given_as_sampler_with_a_batch_size_is_refused(placement, device):
    ds, _ = _ds(placement, device)
    with pytest.raises(gl.GadgetValueError, match="batch_size=None"):
        next(iter(DataLoader(ds, sampler=GadgetSampler(ds, batch_size=4))))
    batch = next(iter(DataLoader(ds, sampler=GadgetSampler(ds, batch_size=4), batch_size=None)))
    assert tuple(batch[0].shape) == (4, 2)


def test_sampler_options_beside_a_sampler_are_refused(placement, device):
    ds, _ = _ds(placement, device)
    s = GadgetSampler(ds, batch_size=5, order="sequential")
    with pytest.raises(gl.GadgetValueError, match="order, drop_last, seed"):
        GadgetLoader(ds, sampler=s, order="sequential", drop_last=True, seed=3)
    with pytest.raises(gl.GadgetValueError, match="num_replicas, rank"):
        GadgetLoader(ds, sampler=s, num_replicas=2, rank=1)
    assert len(list(GadgetLoader(ds, sampler=s))) == 8


def test_negative_single_index_counts_from_the_end(placement, device):
    ds, table = _ds(placement, device)
    row, label = ds[-1]
    np.testing.assert_array_equal(row.cpu().numpy(), table[-1])
    assert int(label) == 39
    np.testing.assert_array_equal(ds[-3:][0].cpu().numpy(), table[-3:])
    with pytest.raises(gl.GadgetIndexError):
        ds[-41]
    with pytest.raises(gl.GadgetIndexError, match="negative"):
        ds[[-1]]


def test_sampler_batches_copy_and_save_as_plain_tensors(tmp_path):
    import copy

    ds = GadgetDataset(torch.arange(100, dtype=torch.float32), placement="cpu", device="cpu")
    batch = next(iter(GadgetSampler(ds, batch_size=8, seed=2)))
    dup = copy.deepcopy(batch)
    assert type(dup) is torch.Tensor and torch.equal(dup, batch)
    torch.save({"ids": batch}, tmp_path / "b.pt")
    back = torch.load(tmp_path / "b.pt", weights_only=True)["ids"]
    assert type(back) is torch.Tensor and torch.equal(back, batch)


def test_sampler_as_sampler_with_workers_is_refused():
    ds, _ = _ds("cpu", "cpu")
    loader = DataLoader(ds, sampler=GadgetSampler(ds, batch_size=4), num_workers=1)
    with pytest.raises(gl.GadgetValueError, match="batch_size=None"):
        next(iter(loader))
