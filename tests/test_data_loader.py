"""GadgetLoader: same batches as the plain form, prefetch on CUDA, resume, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gadgetloader import GadgetTypeError, GadgetValueError
from gadgetloader.data import GadgetBatch, GadgetDataset, GadgetLoader, GadgetSampler

N = 157


@pytest.fixture
def table() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((N, 5)).astype(np.float32)


def dataset(placement: str, device: torch.device, table: np.ndarray) -> GadgetDataset:
    return GadgetDataset(table, np.arange(N), placement=placement, device=device)


def as_lists(batches: list[GadgetBatch]) -> list[list[list[float]]]:
    return [[t.cpu().tolist() for t in b] for b in batches]


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_same_batches_as_the_plain_form(
    placement: str, device: torch.device, table: np.ndarray, prefetch: int
) -> None:
    ds = dataset(placement, device, table)
    plain = list(DataLoader(ds, batch_sampler=GadgetSampler(ds, batch_size=16, seed=3)))
    loader = GadgetLoader(ds, batch_size=16, seed=3, prefetch=prefetch)
    assert len(loader) == len(plain) == 10
    got = list(loader)
    assert all(isinstance(b, GadgetBatch) for b in got)
    assert all(t.device.type == device.type for b in got for t in b)
    assert as_lists(got) == as_lists(plain)
    for x, ids in got:
        np.testing.assert_array_equal(x.cpu().numpy(), table[ids.cpu().numpy()])
    assert loader.sampler.epoch == 1  # the pass completed


def test_epochs_differ_and_set_epoch_replays(table: np.ndarray) -> None:
    ds = dataset("cpu", torch.device("cpu"), table)
    loader = GadgetLoader(ds, batch_size=20)
    e0, e1 = as_lists(list(loader)), as_lists(list(loader))
    assert e0 != e1
    loader.set_epoch(0)
    assert as_lists(list(loader)) == e0


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_equals_uninterrupted(
    placement: str, device: torch.device, table: np.ndarray, prefetch: int
) -> None:
    ds = dataset(placement, device, table)
    ref_loader = GadgetLoader(ds, batch_size=12, seed=7, prefetch=prefetch)
    reference = as_lists(list(ref_loader) + list(ref_loader))
    per_epoch = len(ref_loader)
    for stop in [0, 1, 5, per_epoch - 1, per_epoch, per_epoch + 3]:
        loader = GadgetLoader(ds, batch_size=12, seed=7, prefetch=prefetch)
        got: list[GadgetBatch] = []
        it = iter(loader)
        while len(got) < stop:
            try:
                got.append(next(it))
            except StopIteration:
                it = iter(loader)
        state = loader.state_dict()  # counts handed-out batches, not prefetched ones
        assert state["sampler"]["position"] == (stop if stop <= per_epoch else stop - per_epoch)
        fresh = GadgetLoader(ds, batch_size=12, seed=7, prefetch=prefetch)
        fresh.load_state_dict(state)
        assert fresh.state_dict() == state
        while len(got) < 2 * per_epoch:
            got.extend(fresh)
        assert as_lists(got) == reference, stop


def test_shared_sampler_ranks_and_options(table: np.ndarray) -> None:
    ds = dataset("cpu", torch.device("cpu"), table)
    ranks = [
        GadgetLoader(ds, batch_size=8, num_replicas=3, rank=r, order="chunk", chunk_rows=10)
        for r in range(3)
    ]
    assert len({len(r) for r in ranks}) == 1
    rows = sorted(i for r in ranks for b in r for i in b[1].tolist())
    assert rows == list(range(N))
    sampler = GadgetSampler(ds, batch_size=50, order="sequential", drop_last=True)
    loader = GadgetLoader(ds, sampler=sampler)
    assert loader.sampler is sampler and loader.dataset is ds
    assert isinstance(loader.dataloader, DataLoader) and loader.device == ds.device
    assert [b[1].tolist() for b in loader] == [list(range(i, i + 50)) for i in (0, 50, 100)]


def test_plain_inputs_are_wrapped() -> None:
    loader = GadgetLoader(torch.arange(10.0), batch_size=4, order="sequential")
    assert [b[0].tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]


def test_workers(table: np.ndarray) -> None:
    ds = dataset("cpu", torch.device("cpu"), table)
    plain = as_lists(list(GadgetLoader(ds, batch_size=30, seed=2)))
    with_workers = GadgetLoader(ds, batch_size=30, seed=2, num_workers=2)
    assert as_lists(list(with_workers)) == plain


def test_bad_input(table: np.ndarray) -> None:
    ds = dataset("cpu", torch.device("cpu"), table)
    with pytest.raises(GadgetValueError, match="batch_size"):
        GadgetLoader(ds)
    with pytest.raises(GadgetValueError, match="batch_size must be >= 1"):
        GadgetLoader(ds, batch_size=0)
    with pytest.raises(GadgetValueError, match="not both"):
        GadgetLoader(ds, batch_size=4, sampler=GadgetSampler(ds, batch_size=4))
    with pytest.raises(GadgetValueError, match="sampler is for 10 rows but the dataset has 157"):
        GadgetLoader(ds, sampler=GadgetSampler(10, batch_size=4))
    with pytest.raises(GadgetTypeError, match="must be a GadgetSampler"):
        GadgetLoader(ds, sampler=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(GadgetTypeError, match="'shuffle'"):
        GadgetLoader(ds, batch_size=4, shuffle=True)
    with pytest.raises(GadgetValueError, match="prefetch must be >= 0"):
        GadgetLoader(ds, batch_size=4, prefetch=-1)
    loader = GadgetLoader(ds, batch_size=4)
    with pytest.raises(GadgetValueError, match="not a GadgetLoader state"):
        loader.load_state_dict({"position": 3})
    other = GadgetLoader(GadgetDataset(table[:100], placement="cpu", device="cpu"), batch_size=4)
    with pytest.raises(GadgetValueError, match="different size"):
        loader.load_state_dict(other.state_dict())


@pytest.mark.gpu
def test_prefetch_overlaps_and_protects_buffers(table: np.ndarray) -> None:
    """Batches consumed on another stream stay intact while later gathers run."""
    ds = GadgetDataset(table, np.arange(N), device="cuda")
    loader = GadgetLoader(ds, batch_size=16, seed=1, prefetch=3)
    expected = as_lists(
        list(DataLoader(ds, batch_sampler=GadgetSampler(ds, batch_size=16, seed=1)))
    )
    consumer = torch.cuda.Stream()
    kept = []
    with torch.cuda.stream(consumer):
        for x, ids in loader:
            torch.cuda._sleep(1_000_000)  # a slow "training step" on the consumer stream
            kept.append(GadgetBatch([x.clone(), ids.clone()]))
            del x, ids
    torch.cuda.synchronize()
    assert as_lists(kept) == expected


@pytest.mark.parametrize(("coalesce", "workers"), [(1, 0), (4, 0), (8, 0), (1, 2)])
def test_leaving_a_pass_early_restarts_that_epoch_whatever_the_read_ahead(
    coalesce: int, workers: int
) -> None:
    n = 40
    ds = GadgetDataset(np.arange(n, dtype=np.float32), placement="cpu", device="cpu")
    ref = GadgetSampler(n, batch_size=5, seed=0)
    epoch0, epoch1 = [b.tolist() for b in ref], [b.tolist() for b in ref]
    loader = GadgetLoader(ds, batch_size=5, coalesce=coalesce, num_workers=workers, seed=0)
    for i, _ in enumerate(loader):
        if i == 6:  # 7 of 8 batches taken: read-ahead has already drained the sampler
            break
    assert loader.state_dict()["sampler"]["epoch"] == 0
    again = [b[0].long().tolist() for b in loader]
    assert again == epoch0  # like a bare sampler: the unfinished epoch restarts
    assert [b[0].long().tolist() for b in loader] == epoch1  # a finished one moves on


class _NoIter:
    def __iter__(self) -> None:
        raise AssertionError("the DataLoader was iterated")


@pytest.mark.parametrize("coalesce", [1, 3])
def test_without_workers_the_sampler_is_read_directly(table: np.ndarray, coalesce: int) -> None:
    ds = dataset("cpu", torch.device("cpu"), table)
    ref = as_lists(list(DataLoader(ds, batch_sampler=GadgetSampler(ds, batch_size=16, seed=8))))
    loader = GadgetLoader(ds, batch_size=16, seed=8, coalesce=coalesce)
    loader._dataloader = _NoIter()  # type: ignore[assignment]
    assert as_lists(list(loader)) == ref  # DataLoader's batches, without DataLoader
    pinned = GadgetLoader(ds, batch_size=16, seed=8, pin_memory=True)
    pinned._dataloader = _NoIter()  # type: ignore[assignment]
    with pytest.raises(AssertionError, match="iterated"):
        list(pinned)  # pinning is DataLoader's work: it stays in the loop


@pytest.mark.gpu
@pytest.mark.parametrize("coalesce", [1, 4])
def test_consumer_may_switch_streams_within_a_group(table: np.ndarray, coalesce: int) -> None:
    """Each stream that takes a batch waits for its gather and guards its memory, also when
    the consumer changes streams between the views of one coalesced gather."""
    ds = GadgetDataset(table, np.arange(N), device="cuda")
    expected = as_lists(list(DataLoader(ds, batch_sampler=GadgetSampler(ds, batch_size=8, seed=4))))
    streams = [torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.current_stream()]
    kept = []
    loader = GadgetLoader(ds, batch_size=8, seed=4, prefetch=2, coalesce=coalesce)
    it = iter(loader)
    for k in range(len(expected)):
        stream = streams[k % 3]
        with torch.cuda.stream(stream):
            x, ids = next(it)
            torch.cuda._sleep(200_000)  # a slow step: later gathers run meanwhile
            kept.append(GadgetBatch([x.clone(), ids.clone()]))
            del x, ids
    with pytest.raises(StopIteration):
        next(it)
    torch.cuda.synchronize()
    assert as_lists(kept) == expected
