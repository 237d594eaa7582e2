"""GadgetSampler: partitions, ranks, determinism, chunk order, resume, bad input."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gadgetloader import GadgetKeyError, GadgetTypeError, GadgetValueError
from gadgetloader.data import ORDERS, GadgetSampler


def epoch_batches(sampler: GadgetSampler) -> list[torch.Tensor]:
    return list(sampler)


def flat(batches: list[torch.Tensor]) -> list[int]:
    return torch.cat(batches).tolist() if batches else []


def all_ranks(n: int, world: int, **kw: object) -> list[list[torch.Tensor]]:
    return [epoch_batches(GadgetSampler(n, num_replicas=world, rank=r, **kw)) for r in range(world)]  # type: ignore[arg-type]


# ---- partitions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("n", "batch"), [(1, 1), (10, 3), (100, 10), (1001, 64), (7, 100)])
def test_every_row_exactly_once_per_epoch(order: str, n: int, batch: int) -> None:
    s = GadgetSampler(n, batch_size=batch, order=order, chunk_rows=4)
    for _ in range(2):  # two epochs, different orders, each a permutation
        batches = epoch_batches(s)
        assert len(batches) == len(s) == -(-n // batch)
        assert sorted(flat(batches)) == list(range(n))
        assert all(b.dtype == torch.int64 and b.dim() == 1 for b in batches)
        assert all(len(b) == batch for b in batches[:-1]) and 1 <= len(batches[-1]) <= batch


def test_sequential_is_row_order() -> None:
    assert flat(epoch_batches(GadgetSampler(10, batch_size=4, order="sequential"))) == list(
        range(10)
    )


def test_drop_last_and_pad_single_rank() -> None:
    dropped = epoch_batches(GadgetSampler(10, batch_size=4, drop_last=True))
    assert [len(b) for b in dropped] == [4, 4] and len(set(flat(dropped))) == 8
    padded = epoch_batches(GadgetSampler(10, batch_size=4, pad=True))
    assert [len(b) for b in padded] == [4, 4, 4]
    assert set(flat(padded)) == set(range(10))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    ("n", "world", "batch"), [(10, 3, 2), (9, 2, 2), (100, 4, 8), (17, 4, 4), (4, 4, 3)]
)
def test_ranks_partition_rows_with_equal_batch_counts(
    order: str, n: int, world: int, batch: int
) -> None:
    ranks = all_ranks(n, world, batch_size=batch, order=order, chunk_rows=3, seed=5)
    assert len({len(r) for r in ranks}) == 1  # same number of batches on every rank
    rows = [i for r in ranks for i in flat(r)]
    assert sorted(rows) == list(range(n))  # every row once over all ranks
    q = n // world
    for r, batches in enumerate(ranks):
        assert len(flat(batches)) == q + (1 if r < n % world else 0)
        assert all(len(b) == batch for b in batches[:-1])
        limit = batch + 1 if (q % batch == 0 and r < n % world) else batch
        assert 1 <= len(batches[-1]) <= limit


def test_b_plus_one_case_is_exact() -> None:
    # n // R = 4 is a multiple of B = 2 and n % R = 1: rank 0's last batch holds 3 rows
    ranks = all_ranks(9, 2, batch_size=2, order="sequential")
    assert [[len(b) for b in r] for r in ranks] == [[2, 3], [2, 2]]


@pytest.mark.parametrize(("n", "world", "batch"), [(10, 3, 2), (100, 4, 8), (3, 4, 5)])
def test_ranks_pad(n: int, world: int, batch: int) -> None:
    ranks = all_ranks(n, world, batch_size=batch, pad=True)
    assert len({len(r) for r in ranks}) == 1
    assert all(len(b) == batch for r in ranks for b in r)
    rows = [i for r in ranks for i in flat(r)]
    assert set(rows) == set(range(n))
    assert len(rows) == world * batch * -(-n // (world * batch))


@pytest.mark.parametrize(("n", "world", "batch"), [(10, 3, 2), (100, 4, 8), (37, 2, 5)])
def test_ranks_drop_last(n: int, world: int, batch: int) -> None:
    ranks = all_ranks(n, world, batch_size=batch, drop_last=True)
    nb = n // (world * batch)
    assert all(len(r) == nb for r in ranks)
    assert all(len(b) == batch for r in ranks for b in r)
    rows = [i for r in ranks for i in flat(r)]
    assert len(rows) == len(set(rows)) == world * batch * nb


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 40),
    world=st.integers(1, 5),
    order=st.sampled_from(ORDERS),
    mode=st.sampled_from(["exact", "drop_last", "pad"]),
    seed=st.integers(0, 2**32),
)
def test_sharding_properties(
    n: int, batch: int, world: int, order: str, mode: str, seed: int
) -> None:
    kw = {"batch_size": batch, "order": order, "chunk_rows": 7, "seed": seed}
    kw.update({"drop_last": mode == "drop_last", "pad": mode == "pad"})
    if (mode == "exact" and n < world) or (mode == "drop_last" and n < world * batch):
        with pytest.raises(GadgetValueError):
            GadgetSampler(n, num_replicas=world, rank=0, **kw)  # type: ignore[arg-type]
        return
    ranks = all_ranks(n, world, **kw)
    assert len({len(r) for r in ranks}) == 1
    assert all(len(b) > 0 for r in ranks for b in r)
    rows = [i for r in ranks for i in flat(r)]
    assert all(0 <= i < n for i in rows)
    if mode == "exact":
        assert sorted(rows) == list(range(n))
    elif mode == "drop_last":
        assert len(rows) == len(set(rows)) and all(len(b) == batch for r in ranks for b in r)
    else:
        assert set(rows) == set(range(n)) and all(len(b) == batch for r in ranks for b in r)


def test_distributed_world_is_used(tmp_path: pytest.TempPathFactory) -> None:
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        s = GadgetSampler(10, batch_size=3)
        assert (s.num_replicas, s.rank) == (1, 0)
    finally:
        dist.destroy_process_group()


# ---- determinism ----------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["random", "chunk"])
def test_deterministic_for_a_seed_and_different_per_epoch_and_seed(order: str) -> None:
    def run(seed: int, epoch: int) -> list[int]:
        s = GadgetSampler(
            500, batch_size=32, order=order, seed=seed, chunk_rows=10, window_chunks=4
        )
        s.set_epoch(epoch)
        return flat(epoch_batches(s))

    assert run(1, 0) == run(1, 0)
    assert run(1, 0) != run(1, 1)
    assert run(1, 0) != run(2, 0)
    assert run(1, 0) != list(range(500))


def test_epoch_advances_after_a_full_pass_and_set_epoch_replays() -> None:
    s = GadgetSampler(100, batch_size=10, seed=3)
    first, second = flat(epoch_batches(s)), flat(epoch_batches(s))
    assert s.epoch == 2 and first != second
    s.set_epoch(0)
    assert flat(epoch_batches(s)) == first


def test_a_broken_pass_restarts_the_same_epoch() -> None:
    s = GadgetSampler(100, batch_size=10, seed=3)
    it = iter(s)
    head = [next(it), next(it)]
    assert s.epoch == 0
    full = flat(epoch_batches(s))
    assert full[:20] == flat(head)


def test_chunk_order_reads_each_chunk_within_one_window() -> None:
    n, chunk, window = 1000, 16, 4
    s = GadgetSampler(
        n, batch_size=50, order="chunk", chunk_rows=chunk, window_chunks=window, seed=9
    )
    order = s.epoch_order()
    assert sorted(order.tolist()) == list(range(n))
    pos = torch.empty(n, dtype=torch.int64)
    pos[order] = torch.arange(n)
    for c in range(-(-n // chunk)):
        p = pos[c * chunk : (c + 1) * chunk]
        # all rows of a chunk are requested within one window of window*chunk positions
        assert int(p.max()) - int(p.min()) < window * chunk
    chunk_seq = (order[:: chunk * window] // chunk).tolist()
    assert chunk_seq != sorted(chunk_seq)  # chunks are shuffled


def test_chunk_rows_come_from_the_data_source() -> None:
    class Src:
        chunk_rows = 25

        def __len__(self) -> int:
            return 100

    s = GadgetSampler(Src(), batch_size=10, order="chunk")
    assert s.chunk_rows == 25 and s.window_chunks == 8
    assert sorted(flat(epoch_batches(s))) == list(range(100))


# ---- resume ------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("world", [1, 3])
def test_resume_equals_uninterrupted_at_every_midpoint(order: str, world: int) -> None:
    kw = {"batch_size": 7, "order": order, "seed": 11, "chunk_rows": 5, "num_replicas": world}
    for rank in range(world):
        ref_sampler = GadgetSampler(103, rank=rank, **kw)  # type: ignore[arg-type]
        reference = epoch_batches(ref_sampler) + epoch_batches(ref_sampler)  # two epochs
        per_epoch = len(ref_sampler)
        for stop in [0, 1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 2]:
            s = GadgetSampler(103, rank=rank, **kw)  # type: ignore[arg-type]
            got: list[torch.Tensor] = []
            it = iter(s)
            for _ in range(stop):
                try:
                    got.append(next(it))
                except StopIteration:
                    it = iter(s)
                    got.append(next(it))
            state = pickle.loads(pickle.dumps(s.state_dict()))
            fresh = GadgetSampler(103, rank=rank, **kw)  # type: ignore[arg-type]
            fresh.load_state_dict(state)
            assert fresh.state_dict() == state
            while len(got) < 2 * per_epoch:
                got.extend(epoch_batches(fresh))
            assert [b.tolist() for b in got] == [b.tolist() for b in reference], stop


def test_resume_survives_repeated_iter_before_the_first_batch() -> None:
    # DataLoader (with workers) and StatefulDataLoader call iter() more than once
    s = GadgetSampler(50, batch_size=5, seed=2)
    reference = epoch_batches(GadgetSampler(50, batch_size=5, seed=2))
    it = iter(s)
    next(it), next(it), next(it)
    state = s.state_dict()
    fresh = GadgetSampler(50, batch_size=5, seed=2)
    fresh.load_state_dict(state)
    iter(fresh)
    rest = list(iter(fresh))
    assert [b.tolist() for b in rest] == [b.tolist() for b in reference[3:]]


def test_state_from_another_rank_loads() -> None:
    a = GadgetSampler(40, batch_size=4, num_replicas=2, rank=0)
    it = iter(a)
    next(it)
    b = GadgetSampler(40, batch_size=4, num_replicas=2, rank=1)
    b.load_state_dict(a.state_dict())
    assert len(list(b)) == len(b) - 1


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_protocol(workers: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata touches deprecated torch names on import
        sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from gadgetloader.data import GadgetDataset

    ds = GadgetDataset(torch.arange(60.0), device="cpu", placement="cpu")

    def make() -> object:
        s = GadgetSampler(ds, batch_size=7, seed=4)
        return sdl.StatefulDataLoader(ds, batch_sampler=s, num_workers=workers)

    ref = [b[0].tolist() for b in make()]  # type: ignore[attr-defined]
    loader = make()
    it = iter(loader)  # type: ignore[call-overload]
    head = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()  # type: ignore[attr-defined]
    loader2 = make()
    loader2.load_state_dict(state)  # type: ignore[attr-defined]
    assert head + [b[0].tolist() for b in loader2] == ref  # type: ignore[attr-defined]


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [0, -3])
def test_batch_size_must_be_positive(batch: int) -> None:
    with pytest.raises(GadgetValueError, match="batch_size must be >= 1"):
        GadgetSampler(10, batch_size=batch)


@pytest.mark.parametrize("batch", [2.0, True, "4"])
def test_batch_size_must_be_an_int(batch: object) -> None:
    with pytest.raises(GadgetTypeError, match="batch_size must be an int"):
        GadgetSampler(10, batch_size=batch)  # type: ignore[arg-type]


def test_empty_dataset() -> None:
    with pytest.raises(GadgetValueError, match="empty"):
        GadgetSampler(0, batch_size=4)
    with pytest.raises(GadgetValueError, match="empty"):
        GadgetSampler([], batch_size=4)


def test_bad_options() -> None:
    with pytest.raises(
        GadgetKeyError, match=r"Unknown order 'shuffle'; expected one of \['sequential'"
    ):
        GadgetSampler(10, batch_size=2, order="shuffle")
    with pytest.raises(GadgetValueError, match="exclusive"):
        GadgetSampler(10, batch_size=2, drop_last=True, pad=True)
    with pytest.raises(GadgetValueError, match="rank must be in"):
        GadgetSampler(10, batch_size=2, num_replicas=2, rank=2)
    with pytest.raises(GadgetValueError, match="pad=True"):
        GadgetSampler(3, batch_size=2, num_replicas=4, rank=0)
    with pytest.raises(GadgetValueError, match="drop_last=True leaves no batch"):
        GadgetSampler(10, batch_size=4, num_replicas=3, rank=0, drop_last=True)
    with pytest.raises(GadgetValueError, match="chunk_rows"):
        GadgetSampler(10, batch_size=2, order="chunk")
    with pytest.raises(GadgetTypeError, match="row count or have len"):
        GadgetSampler(object(), batch_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "other", "match"),
    [
        ("num_rows", {"data_source": 99}, "dataset of a different size: num_rows=100"),
        ("num_replicas", {"num_replicas": 2, "rank": 1}, "different world size: num_replicas=1"),
        ("batch_size", {"batch_size": 5}, "batch_size=4"),
        ("order", {"order": "sequential"}, "order='random'"),
    ],
)
def test_state_for_another_setup_is_refused(key: str, other: dict[str, object], match: str) -> None:
    state = GadgetSampler(100, batch_size=4).state_dict()
    kw: dict[str, object] = {"data_source": 100, "batch_size": 4, **other}
    target = GadgetSampler(**kw)  # type: ignore[arg-type]
    with pytest.raises(GadgetValueError, match=match):
        target.load_state_dict(state)


def test_junk_states_are_refused() -> None:
    s = GadgetSampler(100, batch_size=4)
    with pytest.raises(GadgetValueError, match="not a GadgetSampler state"):
        s.load_state_dict({"foo": 1})
    bad = s.state_dict() | {"position": 1000}
    with pytest.raises(GadgetValueError, match="beyond"):
        s.load_state_dict(bad)
    with pytest.raises(GadgetValueError, match="version"):
        s.load_state_dict(s.state_dict() | {"version": 99})


def test_pickles_mid_epoch() -> None:
    s = GadgetSampler(30, batch_size=4, seed=1)
    it = iter(s)
    next(it)
    copy = pickle.loads(pickle.dumps(s))
    assert copy.state_dict() == s.state_dict()
    # a copy is not a resume: a new pass starts the epoch from its first batch
    assert flat(list(copy))[4:] == flat(list(it))


def test_world_size_without_rank_is_refused_outside_distributed() -> None:
    """Without torch.distributed, num_replicas > 1 and no rank would give every process
    rank 0's share: refused, as torch's DistributedSampler refuses it; one replica and
    explicit ranks are fine."""
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    with pytest.raises(GadgetValueError, match=r"num_replicas=2 needs rank="):
        GadgetSampler(10, batch_size=2, num_replicas=2)
    assert GadgetSampler(10, batch_size=2, num_replicas=1).rank == 0
    s = GadgetSampler(10, batch_size=2, num_replicas=2, rank=1)
    assert (s.num_replicas, s.rank) == (2, 1)
    with pytest.raises(GadgetValueError, match="num_replicas"):
        GadgetSampler(10, batch_size=2, num_replicas=0)
