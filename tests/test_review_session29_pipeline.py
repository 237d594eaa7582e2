"""Black-box review (session 29) of the input pipeline (GadgetSampler, GadgetDataset,
GadgetLoader: orders, epochs, ranks, resume, DataLoader forms, bad input); written from
README.md, SPEC.md and the public docstrings only."""

from __future__ import annotations

import math
import types
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

import gadgetloader as gl

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


@pytest.fixture(scope="module", autouse=True)
def _hide_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


# ----------------------------------------------------------------------------- helpers

D = 3


def feats(n, d=D):
    return np.arange(n * d, dtype=np.float32).reshape(n, d) * 0.5 + 1.0


def make_ds(n, kind="memory", tmp_path=None, block_rows=8):
    """Features (n, D) float32 + labels arange(n) int64: a batch's labels are its row ids."""
    x = feats(n)
    y = np.arange(n, dtype=np.int64)
    if kind == "memory":
        return gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    path = tmp_path / f"x{n}.npy"
    np.save(path, x)
    g = gl.DataGadget(str(path), placement="file", block_rows=block_rows)
    return gl.GadgetDataset(g, y, device="cpu")


def ids(batches):
    return [b.tolist() for b in batches]


def flat(batches):
    return [i for b in batches for i in (b.tolist() if torch.is_tensor(b) else b)]


def sampler_kw(order, chunk_rows=4):
    kw = {"order": order, "seed": 7}
    if order == "chunk":
        kw["chunk_rows"] = chunk_rows
        kw["window_chunks"] = 2
    return kw


ORDERS = ["random", "sequential", "chunk"]


def check_batch_values(batch, n):
    x, y = batch
    assert y.dtype == torch.int64 and x.dtype == torch.float32
    assert x.shape == (len(y), D)
    np.testing.assert_array_equal(x.numpy(), feats(n)[y.numpy()])


# ----------------------------------------------------------------------------- docs examples


def test_sequential_docstring_example():
    assert ids(gl.GadgetSampler(10, batch_size=4, order="sequential")) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]


def test_rank_docstring_example():
    got = [
        ids(gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r))
        for r in (0, 1)
    ]
    assert got == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]


def test_loader_docstring_example():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert [b[0].tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]


# ----------------------------------------------------------------------------- orders, one rank


@pytest.mark.parametrize("order", ORDERS)
def test_every_row_once_per_epoch(order):
    for n, bs in [(n, bs) for n in (1, 7, 64, 101) for bs in (1, 4, 16)]:
        s = gl.GadgetSampler(n, batch_size=bs, **sampler_kw(order))
        for epoch in range(2):
            batches = list(s)
            assert len(batches) == len(s) == math.ceil(n / bs)
            assert all(b.dtype == torch.int64 for b in batches)
            sizes = [len(b) for b in batches]
            assert sizes[:-1] == [bs] * (len(sizes) - 1)
            assert 1 <= sizes[-1] <= bs
            assert sorted(flat(batches)) == list(range(n))
            assert flat(batches) == s.epoch_order(epoch).tolist()
        assert s.epoch == 2


@pytest.mark.parametrize("order", ORDERS)
def test_drop_last_one_rank(order):
    for n, bs in [(10, 3), (64, 8), (5, 5)]:
        _drop_last_case(order, n, bs)


def _drop_last_case(order, n, bs):
    s = gl.GadgetSampler(n, batch_size=bs, drop_last=True, **sampler_kw(order))
    batches = list(s)
    assert len(batches) == len(s) == n // bs
    assert all(len(b) == bs for b in batches)
    f = flat(batches)
    assert len(set(f)) == len(f)
    # the last n % bs rows of the epoch order are the ones dropped
    assert f == s.epoch_order(0)[: (n // bs) * bs].tolist()


def test_sequential_is_row_order():
    s = gl.GadgetSampler(23, batch_size=5, order="sequential")
    assert flat(list(s)) == list(range(23))
    assert flat(list(s)) == list(range(23))  # every epoch


def test_random_is_shuffled_and_seeded():
    a = gl.GadgetSampler(64, batch_size=8, order="random", seed=3)
    b = gl.GadgetSampler(64, batch_size=8, order="random", seed=3)
    c = gl.GadgetSampler(64, batch_size=8, order="random", seed=4)
    ea, eb, ec = flat(list(a)), flat(list(b)), flat(list(c))
    assert ea == eb
    assert ea != ec
    assert ea != list(range(64))
    # next epoch differs from the first but is equally reproducible
    ea1, eb1 = flat(list(a)), flat(list(b))
    assert ea1 == eb1 and ea1 != ea


@pytest.mark.parametrize("order", ORDERS)
def test_set_epoch_matches_natural_advance(order):
    a = gl.GadgetSampler(37, batch_size=4, **sampler_kw(order))
    natural = [ids(a) for _ in range(4)]
    b = gl.GadgetSampler(37, batch_size=4, **sampler_kw(order))
    b.set_epoch(3)
    assert b.epoch == 3
    assert ids(b) == natural[3]
    b.set_epoch(1)
    assert ids(b) == natural[1]
    if order != "sequential":
        assert natural[0] != natural[1]


@pytest.mark.parametrize("order", ORDERS)
def test_partial_pass_restarts_same_epoch(order):
    s = gl.GadgetSampler(30, batch_size=4, **sampler_kw(order))
    full = ids(gl.GadgetSampler(30, batch_size=4, **sampler_kw(order)))
    it = iter(s)
    next(it), next(it)
    assert ids(s) == full  # new iter() before the end: the same epoch anew
    assert s.epoch == 1


def test_set_epoch_mid_pass_restarts_from_first_batch():
    s = gl.GadgetSampler(30, batch_size=4, order="random", seed=1)
    ref = gl.GadgetSampler(30, batch_size=4, order="random", seed=1)
    ref.set_epoch(2)
    e2 = ids(ref)
    it = iter(s)
    next(it)
    s.set_epoch(2)
    assert ids(s) == e2


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_chunk_options_do_not_change_other_orders(order):
    plain = gl.GadgetSampler(50, batch_size=6, order=order, seed=2)
    opts = gl.GadgetSampler(50, batch_size=6, order=order, seed=2, window_chunks=3, chunk_rows=5)
    assert [ids(plain) for _ in range(2)] == [ids(opts) for _ in range(2)]
    # and a state of one loads into the other
    opts = gl.GadgetSampler(50, batch_size=6, order=order, seed=2, window_chunks=3, chunk_rows=5)
    it = iter(opts)
    next(it)
    plain2 = gl.GadgetSampler(50, batch_size=6, order=order, seed=2)
    plain2.load_state_dict(opts.state_dict())
    assert ids(plain2) == ids(gl.GadgetSampler(50, batch_size=6, order=order, seed=2))[1:]


def test_order_independent_of_data_source_kind(tmp_path):
    ds = make_ds(40, "file", tmp_path)
    for order in ("random", "sequential"):
        a = gl.GadgetSampler(ds, batch_size=6, order=order, seed=9)
        b = gl.GadgetSampler(40, batch_size=6, order=order, seed=9)
        assert ids(a) == ids(b)


# ----------------------------------------------------------------------------- chunk order


def check_chunk_windows(order, n, chunk_rows, window_chunks):
    order = list(order)
    assert sorted(order) == list(range(n))
    pos = {r: p for p, r in enumerate(order)}
    span = window_chunks * chunk_rows
    nchunks = math.ceil(n / chunk_rows)
    for c in range(nchunks):
        ps = [pos[r] for r in range(c * chunk_rows, min(n, (c + 1) * chunk_rows))]
        assert max(ps) - min(ps) < span, f"chunk {c} spread over {min(ps)}..{max(ps)}"
    # windows: consecutive segments each made of window_chunks whole chunks
    seen = []
    for r in order:
        c = r // chunk_rows
        if c not in seen:
            seen.append(c)
    start = 0
    for w in range(0, len(seen), window_chunks):
        chunks = seen[w : w + window_chunks]
        rows = {r for c in chunks for r in range(c * chunk_rows, min(n, (c + 1) * chunk_rows))}
        seg = order[start : start + len(rows)]
        assert set(seg) == rows
        start += len(rows)
    assert start == n


@pytest.mark.parametrize("window_chunks", [1, 2, 3, 100])
def test_chunk_order_file_backed(tmp_path, window_chunks):
    for n in (100, 96):
        _chunk_file_case(tmp_path, n, window_chunks)


def _chunk_file_case(tmp_path, n, window_chunks):
    ds = make_ds(n, "file", tmp_path, block_rows=8)
    assert ds.chunk_rows == 8
    s = gl.GadgetSampler(ds, batch_size=5, order="chunk", window_chunks=window_chunks, seed=1)
    assert s.chunk_rows == 8 and s.window_chunks == window_chunks
    for _epoch in range(2):
        batches = list(s)
        check_chunk_windows(flat(batches), n, 8, window_chunks)
        for b in batches[:3]:
            check_batch_values(ds[b], n)


def test_chunk_order_actually_shuffles_chunks(tmp_path):
    ds = make_ds(96, "file", tmp_path, block_rows=8)
    s = gl.GadgetSampler(ds, batch_size=5, order="chunk", window_chunks=2, seed=1)
    e0, e1 = flat(list(s)), flat(list(s))
    assert e0 != e1
    assert e0 != list(range(96))
    s2 = gl.GadgetSampler(ds, batch_size=5, order="chunk", window_chunks=2, seed=1)
    assert flat(list(s2)) == e0


@pytest.mark.parametrize("window_chunks", [1, 3])
def test_chunk_order_in_memory_with_chunk_rows(window_chunks):
    ds = make_ds(50)
    s = gl.GadgetSampler(
        ds, batch_size=4, order="chunk", chunk_rows=6, window_chunks=window_chunks, seed=5
    )
    check_chunk_windows(flat(list(s)), 50, 6, window_chunks)


def test_chunk_order_in_memory_needs_chunk_rows():
    ds = make_ds(50)
    assert ds.chunk_rows is None
    with pytest.raises(gl.GadgetValueError, match="chunk_rows"):
        gl.GadgetSampler(ds, batch_size=4, order="chunk")


@pytest.mark.parametrize("blocks,expect", [((4, 6), 12), ((4, 8), 8), ((5, 7), 7), ((8, 8), 8)])
def test_chunk_rows_of_mixed_file_columns(tmp_path, blocks, expect):
    n = 70
    cols = []
    for i, b in enumerate(blocks):
        p = tmp_path / f"c{i}.npy"
        np.save(p, feats(n))
        cols.append(gl.DataGadget(str(p), placement="file", block_rows=b))
    ds = gl.GadgetDataset(*cols, np.arange(n), device="cpu")
    assert ds.chunk_rows == expect
    s = gl.GadgetSampler(ds, batch_size=4, order="chunk", window_chunks=2)
    assert s.chunk_rows == expect
    check_chunk_windows(flat(list(s)), n, expect, 2)


# ----------------------------------------------------------------------------- ranks


def shares(n, R):
    q, m = divmod(n, R)
    out, start = [], 0
    for r in range(R):
        size = q + (1 if r < m else 0)
        out.append((start, size))
        start += size
    return out


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5])
def test_ranks_default(R):
    for order, n, bs in [(o, n, bs) for o in ORDERS for n in [5, 13, 23, 40] for bs in (1, 3, 4)]:
        samplers = [
            gl.GadgetSampler(n, batch_size=bs, num_replicas=R, rank=r, **sampler_kw(order))
            for r in range(R)
        ]
        expect_len = math.ceil((n // R) / bs)
        assert [len(s) for s in samplers] == [expect_len] * R
        per_rank = [list(s) for s in samplers]
        assert [len(p) for p in per_rank] == [expect_len] * R
        full = samplers[0].epoch_order(0).tolist()
        assert sorted(full) == list(range(n))
        allrows = []
        for r, (p, (start, size)) in enumerate(zip(per_rank, shares(n, R), strict=True)):
            f = flat(p)
            assert f == full[start : start + size], (bs, r)
            assert all(len(b) == bs for b in p[:-1])
            assert 1 <= len(p[-1]) <= bs + 1
            allrows += f
        assert sorted(allrows) == list(range(n))


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5])
def test_ranks_drop_last(R):
    for order, n, bs in [(o, n, bs) for o in ORDERS for n in [13, 23, 40] for bs in (1, 3, 4)]:
        mk = [
            lambda r=r, n=n, bs=bs, order=order: gl.GadgetSampler(
                n, batch_size=bs, num_replicas=R, rank=r, drop_last=True, **sampler_kw(order)
            )
            for r in range(R)
        ]
        if n < R * bs:
            with pytest.raises(gl.GadgetValueError):
                mk[0]()
            continue
        samplers = [m() for m in mk]
        k = n // (R * bs)
        per_rank = [list(s) for s in samplers]
        assert [len(s) for s in samplers] == [k] * R
        assert [len(p) for p in per_rank] == [k] * R
        assert all(len(b) == bs for p in per_rank for b in p)
        allrows = flat([b for p in per_rank for b in p])
        assert len(set(allrows)) == len(allrows) == R * k * bs
        assert sorted(allrows) == sorted(samplers[0].epoch_order(0)[: R * k * bs].tolist())


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5])
def test_ranks_pad(R):
    for order, n, bs in [(o, n, bs) for o in ORDERS for n in [3, 13, 40] for bs in (1, 3, 4)]:
        samplers = [
            gl.GadgetSampler(
                n,
                batch_size=bs,
                num_replicas=R,
                rank=r,
                pad=True,
                **sampler_kw(order if n > 3 else "random"),
            )
            for r in range(R)
        ]
        k = math.ceil(n / (R * bs))
        per_rank = [list(s) for s in samplers]
        assert [len(s) for s in samplers] == [k] * R
        assert [len(p) for p in per_rank] == [k] * R
        assert all(len(b) == bs for p in per_rank for b in p)
        full = samplers[0].epoch_order(0).tolist()
        total = R * bs * k
        expect = [full[i % n] for i in range(total)]
        allrows = flat([b for p in per_rank for b in p])
        assert Counter(allrows) == Counter(expect)
        assert set(allrows) == set(range(n))


def test_pad_exact_multiple_equals_default():
    for r in range(2):
        a = ids(gl.GadgetSampler(24, batch_size=4, num_replicas=2, rank=r, pad=True, seed=3))
        b = ids(gl.GadgetSampler(24, batch_size=4, num_replicas=2, rank=r, seed=3))
        assert a == b


def test_pad_batches_are_usable_by_dataset():
    ds = make_ds(10)
    s = gl.GadgetSampler(ds, batch_size=4, pad=True, num_replicas=2, rank=1, seed=0)
    for b in DataLoader(ds, batch_sampler=s):
        check_batch_values(b, 10)


def test_rank_epochs_stay_consistent():
    n, R = 29, 3
    samplers = [gl.GadgetSampler(n, batch_size=2, num_replicas=R, rank=r, seed=4) for r in range(R)]
    for epoch in range(3):
        rows = flat([b for s in samplers for b in list(s)])
        assert sorted(rows) == list(range(n))
        assert all(s.epoch == epoch + 1 for s in samplers)


# ----------------------------------------------------------------------------- sampler resume


def run_epochs(mk, epochs):
    s = mk()
    return [ids(s) for _ in range(epochs)]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("where", ["zero", "one", "mid", "last"])
def test_sampler_resume(order, where):
    for R in (1, 3):
        _sampler_resume_case(order, where, R)


def _sampler_resume_case(order, where, R):
    n, bs = 41, 4
    rank = R - 1

    def mk(seed=7):
        kw = sampler_kw(order)
        kw["seed"] = seed
        return gl.GadgetSampler(n, batch_size=bs, num_replicas=R, rank=rank, **kw)

    ref = run_epochs(mk, 2)
    L = len(ref[0])
    k = {"zero": 0, "one": 1, "mid": L // 2, "last": L}[where]
    s = mk()
    it = iter(s)
    for _ in range(k):
        next(it)
    st = s.state_dict()
    r = mk(seed=12345)  # the state brings its own seed
    r.load_state_dict(st)
    rest = ids(r)
    if where == "last":
        assert rest == []  # one empty pass ...
        assert ids(r) == ref[1]  # ... then the next epoch
    else:
        assert rest == ref[0][k:]
        assert ids(r) == ref[1]


@pytest.mark.parametrize("order", ORDERS)
def test_sampler_resume_across_epoch_boundary(order):
    mk = lambda: gl.GadgetSampler(33, batch_size=5, **sampler_kw(order))  # noqa: E731
    ref = run_epochs(mk, 3)
    s = mk()
    list(s)
    it = iter(s)
    next(it), next(it)
    st = s.state_dict()
    assert st["epoch"] == 1 if "epoch" in st else True
    r = mk()
    r.load_state_dict(st)
    assert ids(r) == ref[1][2:]
    assert ids(r) == ref[2]


@pytest.mark.parametrize("order", ORDERS)
def test_sampler_resume_after_set_epoch(order):
    mk = lambda: gl.GadgetSampler(33, batch_size=5, **sampler_kw(order))  # noqa: E731
    ref = mk()
    ref.set_epoch(5)
    e5 = ids(ref)
    e6 = ids(ref)
    s = mk()
    s.set_epoch(5)
    it = iter(s)
    for _ in range(3):
        next(it)
    st = s.state_dict()
    r = mk()
    r.load_state_dict(st)
    r.set_epoch(5)  # DistributedSampler loop: keeps the loaded position
    assert ids(r) == e5[3:]
    assert ids(r) == e6
    r2 = mk()
    r2.load_state_dict(st)
    r2.set_epoch(6)  # another epoch: from its first batch
    assert ids(r2) == e6


def test_state_loads_on_another_rank_same_world():
    mk = lambda r: gl.GadgetSampler(50, batch_size=3, num_replicas=4, rank=r, seed=2)  # noqa: E731
    s0 = mk(0)
    it = iter(s0)
    next(it), next(it)
    st = s0.state_dict()
    s2 = mk(2)
    s2.load_state_dict(st)
    assert ids(s2) == ids(mk(2))[2:]


def test_state_of_fresh_sampler_resumes_at_start():
    s = gl.GadgetSampler(20, batch_size=3, seed=11)
    st = s.state_dict()
    r = gl.GadgetSampler(20, batch_size=3, seed=0)
    r.load_state_dict(st)
    assert ids(r) == ids(gl.GadgetSampler(20, batch_size=3, seed=11))


def test_load_state_accepts_read_only_mapping():
    s = gl.GadgetSampler(20, batch_size=3, seed=11)
    it = iter(s)
    next(it)
    r = gl.GadgetSampler(20, batch_size=3)
    r.load_state_dict(types.MappingProxyType(s.state_dict()))
    assert ids(r) == ids(gl.GadgetSampler(20, batch_size=3, seed=11))[1:]


def test_load_state_not_a_mapping():
    s = gl.GadgetSampler(20, batch_size=3)
    for bad in [[1, 2], None, "state", 3]:
        with pytest.raises(gl.GadgetTypeError):
            s.load_state_dict(bad)


BASE = dict(n=24, batch_size=4, order="random", drop_last=False, pad=False, num_replicas=2, rank=0)


@pytest.mark.parametrize(
    "change",
    [
        {"n": 25},
        {"batch_size": 3},
        {"num_replicas": 3},
        {"order": "sequential"},
        {"drop_last": True},
        {"pad": True},
    ],
)
def test_load_state_mismatch_refused_and_sampler_unchanged(change):
    def mk(**kw):
        p = dict(BASE, **kw)
        n = p.pop("n")
        return gl.GadgetSampler(n, seed=1, **p)

    src = mk()
    it = iter(src)
    next(it)
    st = src.state_dict()
    dst = mk(**change)
    it = iter(dst)
    next(it)  # dst mid-epoch too
    before = dst.state_dict()
    with pytest.raises(gl.GadgetValueError):
        dst.load_state_dict(st)
    assert dst.state_dict() == before
    assert ids(it) == ids(mk(**change))[1:]  # the running pass goes on as before


def test_load_state_mismatch_chunk_layout():
    a = gl.GadgetSampler(40, batch_size=4, order="chunk", chunk_rows=4, window_chunks=2)
    next(iter(a))
    for kw in ({"chunk_rows": 5, "window_chunks": 2}, {"chunk_rows": 4, "window_chunks": 3}):
        b = gl.GadgetSampler(40, batch_size=4, order="chunk", **kw)
        before = b.state_dict()
        with pytest.raises(gl.GadgetValueError):
            b.load_state_dict(a.state_dict())
        assert b.state_dict() == before


# ----------------------------------------------------------------------------- DataLoader forms


@pytest.mark.parametrize("order", ORDERS)
def test_dataloader_batch_sampler_values(order):
    n = 37
    ds = make_ds(n)
    s = gl.GadgetSampler(ds, batch_size=5, **sampler_kw(order))
    ref = ids(gl.GadgetSampler(ds, batch_size=5, **sampler_kw(order)))
    got = []
    for b in DataLoader(ds, batch_sampler=s):
        check_batch_values(b, n)
        got.append(b[1].tolist())
    assert got == ref


def test_dataloader_sampler_batch_size_none():
    n = 23
    ds = make_ds(n)
    s = gl.GadgetSampler(ds, batch_size=4, seed=3)
    ref = ids(gl.GadgetSampler(ds, batch_size=4, seed=3))
    got = []
    for b in DataLoader(ds, sampler=s, batch_size=None):
        assert len(b) == 2
        check_batch_values(tuple(b), n)
        got.append(b[1].tolist())
    assert got == ref


def test_dataloader_sampler_without_batch_size_none_refused():
    ds = make_ds(10)
    loader = DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4))
    with pytest.raises(gl.GadgetValueError):
        list(loader)


@pytest.mark.parametrize("n,bs", [(10, 4), (37, 8), (16, 4), (3, 5)])
def test_default_form(n, bs):
    for shuffle in (True, False):
        _default_form_case(n, bs, shuffle)


def _default_form_case(n, bs, shuffle):
    ds = make_ds(n)
    torch.manual_seed(0)
    batches = list(DataLoader(ds, batch_size=bs, shuffle=shuffle))
    assert len(batches) == math.ceil(n / bs)
    for b in batches:
        assert isinstance(b, (tuple, list)) and len(b) == 2
        check_batch_values(tuple(b), n)
    sizes = [len(b[1]) for b in batches]
    assert sizes[-1] == (n % bs or bs)
    assert sum(sizes) == n
    rows = flat([b[1] for b in batches])
    assert sorted(rows) == list(range(n))
    if not shuffle:
        assert rows == list(range(n))


def test_default_form_drop_last():
    ds = make_ds(10)
    batches = list(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True))
    assert [len(b[1]) for b in batches] == [4, 4]
    for b in batches:
        check_batch_values(tuple(b), 10)


def test_default_form_yields_gadget_batches_and_custom_collate():
    ds = make_ds(10)
    b = next(iter(DataLoader(ds, batch_size=4)))
    assert isinstance(b, gl.GadgetBatch)
    seen = []

    def collate(batch):
        seen.append((type(batch), len(batch)))
        return batch[0]

    b2 = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate)))
    assert seen == [(list, 1)]
    check_batch_values(b2, 10)


def test_subset_batches_are_right_rows():
    ds = make_ds(30)
    idx = [29, 3, 17, 0, 8, 12, 25]
    got = flat([b[1] for b in DataLoader(Subset(ds, idx), batch_size=3)])
    assert got == idx
    for b in DataLoader(Subset(ds, idx), batch_size=3):
        check_batch_values(tuple(b), 30)


def test_dataloader_resume_via_sampler_state():
    n = 30
    ds = make_ds(n)
    mk = lambda: gl.GadgetSampler(ds, batch_size=4, seed=6)  # noqa: E731
    ref = ids(mk())
    s = mk()
    got = []
    for i, b in enumerate(DataLoader(ds, batch_sampler=s)):
        got.append(b[1].tolist())
        if i == 2:
            break
    st = s.state_dict()
    r = mk()
    r.load_state_dict(st)
    rest = [b[1].tolist() for b in DataLoader(ds, batch_sampler=r)]
    assert got + rest == ref


@pytest.mark.parametrize("where", ["zero", "one", "mid", "last"])
def test_stateful_dataloader_resume(where):
    for order in ORDERS:
        _sdl_resume_case(where, order)


def _sdl_resume_case(where, order):
    n, bs = 27, 4
    ds = make_ds(n)
    mk = lambda seed=7: gl.GadgetSampler(ds, batch_size=bs, **dict(sampler_kw(order), seed=seed))  # noqa: E731
    ref_s = mk()
    ref = [ids(ref_s) for _ in range(2)]
    L = len(ref[0])
    k = {"zero": 0, "one": 1, "mid": L // 2, "last": L}[where]
    dl = StatefulDataLoader(ds, batch_sampler=mk())
    got = []
    st = dl.state_dict()
    it = iter(dl)
    for _ in range(k):
        b = next(it)
        got.append(b[1].tolist())
        st = dl.state_dict()
    assert got == ref[0][:k]
    dl2 = StatefulDataLoader(ds, batch_sampler=mk(seed=999))
    dl2.load_state_dict(st)
    rest = []
    for b in dl2:
        check_batch_values(b, n)
        rest.append(b[1].tolist())
    if where == "last":
        assert rest == []
    else:
        assert rest == ref[0][k:]
    assert [b[1].tolist() for b in dl2] == ref[1]


def test_stateful_dataloader_resume_across_epoch_and_set_epoch():
    n, bs = 22, 3
    ds = make_ds(n)
    mk = lambda: gl.GadgetSampler(ds, batch_size=bs, seed=1)  # noqa: E731
    ref_s = mk()
    ref = {e: None for e in range(4)}
    for e in range(4):
        ref_s.set_epoch(e)
        ref[e] = ids(ref_s)
    s = mk()
    dl = StatefulDataLoader(ds, batch_sampler=s)
    s.set_epoch(2)
    it = iter(dl)
    next(it), next(it)
    st = dl.state_dict()
    s2 = mk()
    dl2 = StatefulDataLoader(ds, batch_sampler=s2)
    dl2.load_state_dict(st)
    s2.set_epoch(2)  # the DistributedSampler loop
    assert [b[1].tolist() for b in dl2] == ref[2][2:]
    s2.set_epoch(3)
    assert [b[1].tolist() for b in dl2] == ref[3]


def test_stateful_dataloader_with_workers():
    n, bs = 26, 4
    ds = make_ds(n)
    mk = lambda: gl.GadgetSampler(ds, batch_size=bs, seed=2)  # noqa: E731
    ref = ids(mk())
    dl = StatefulDataLoader(ds, batch_sampler=mk(), num_workers=2, multiprocessing_context="fork")
    got = []
    it = iter(dl)
    for _ in range(3):
        b = next(it)
        got.append(b[1].tolist())
    st = dl.state_dict()
    del it
    dl2 = StatefulDataLoader(ds, batch_sampler=mk(), num_workers=2, multiprocessing_context="fork")
    dl2.load_state_dict(st)
    rest = []
    for b in dl2:
        check_batch_values(tuple(b), n)
        rest.append(b[1].tolist())
    assert got + rest == ref


# ----------------------------------------------------------------------------- GadgetLoader


@pytest.mark.parametrize("order", ORDERS)
def test_loader_matches_sampler(order):
    for coalesce, prefetch in [(None, 2), (1, 0), (3, 2)]:
        _loader_matches_case(order, coalesce, prefetch)


def _loader_matches_case(order, coalesce, prefetch):
    n, bs = 29, 4
    ds = make_ds(n)
    kw = sampler_kw(order)
    ref_s = gl.GadgetSampler(ds, batch_size=bs, **kw)
    ref = [ids(ref_s) for _ in range(2)]
    loader = gl.GadgetLoader(ds, batch_size=bs, prefetch=prefetch, coalesce=coalesce, **kw)
    assert len(loader) == len(ref_s)
    for e in range(2):
        got = []
        for b in loader:
            assert isinstance(b, gl.GadgetBatch)
            check_batch_values(b, n)
            got.append(b[1].tolist())
        assert got == ref[e]


@pytest.mark.parametrize("R", [2, 3])
def test_loader_ranks(R):
    n = 23
    ds = make_ds(n)
    rows = []
    lens = set()
    for r in range(R):
        loader = gl.GadgetLoader(ds, batch_size=3, num_replicas=R, rank=r, seed=4, coalesce=2)
        ref = ids(gl.GadgetSampler(ds, batch_size=3, num_replicas=R, rank=r, seed=4))
        got = [b[1].tolist() for b in loader]
        assert got == ref
        lens.add(len(got))
        rows += flat(got)
    assert len(lens) == 1
    assert sorted(rows) == list(range(n))


@pytest.mark.parametrize("where", ["zero", "one", "mid", "last"])
def test_loader_resume(where):
    for coalesce in (1, 3):
        _loader_resume_case(where, coalesce)


def _loader_resume_case(where, coalesce):
    n, bs = 31, 4
    ds = make_ds(n)
    mk = lambda seed=5: gl.GadgetLoader(ds, batch_size=bs, seed=seed, coalesce=coalesce)  # noqa: E731
    ref_s = gl.GadgetSampler(ds, batch_size=bs, seed=5)
    ref = [ids(ref_s) for _ in range(2)]
    L = len(ref[0])
    k = {"zero": 0, "one": 1, "mid": L // 2, "last": L}[where]
    loader = mk()
    st = loader.state_dict()
    got = []
    it = iter(loader)
    for _ in range(k):
        got.append(next(it)[1].tolist())
        st = loader.state_dict()  # saved inside the loop
    assert got == ref[0][:k]
    r = mk(seed=77)
    r.load_state_dict(st)
    rest = [b[1].tolist() for b in r]
    if where == "last":
        assert rest == []
    else:
        assert rest == ref[0][k:]
    assert [b[1].tolist() for b in r] == ref[1]


def test_loader_state_after_loop_points_at_next_epoch():
    ds = make_ds(18)
    mk = lambda: gl.GadgetLoader(ds, batch_size=4, seed=3)  # noqa: E731
    ref_s = gl.GadgetSampler(ds, batch_size=4, seed=3)
    ref = [ids(ref_s) for _ in range(2)]
    loader = mk()
    assert [b[1].tolist() for b in loader] == ref[0]
    st = loader.state_dict()
    r = mk()
    r.load_state_dict(st)
    assert [b[1].tolist() for b in r] == ref[1]


def test_loader_resume_across_epoch_and_set_epoch():
    ds = make_ds(26)
    mk = lambda: gl.GadgetLoader(ds, batch_size=4, seed=8, order="random")  # noqa: E731
    ref_s = gl.GadgetSampler(ds, batch_size=4, seed=8)
    ref_s.set_epoch(4)
    e4 = ids(ref_s)
    e5 = ids(ref_s)
    loader = mk()
    loader.set_epoch(4)
    it = iter(loader)
    next(it), next(it), next(it)
    st = loader.state_dict()
    r = mk()
    r.load_state_dict(st)
    r.set_epoch(4)
    assert [b[1].tolist() for b in r] == e4[3:]
    assert [b[1].tolist() for b in r] == e5


def test_loader_early_break_restarts_same_epoch():
    ds = make_ds(12)
    loader = gl.GadgetLoader(ds, batch_size=4, seed=2, prefetch=2, coalesce=3)
    ref = ids(gl.GadgetSampler(ds, batch_size=4, seed=2))
    got = []
    for i, b in enumerate(loader):
        got.append(b[1].tolist())
        if i == 1:
            break
    assert got == ref[:2]
    st = loader.state_dict()
    r = gl.GadgetLoader(ds, batch_size=4, seed=0)
    r.load_state_dict(st)
    assert [b[1].tolist() for b in r] == ref[2:]  # counts handed-out batches only
    assert [b[1].tolist() for b in loader] == ref  # same epoch anew


def test_loader_follows_sampler_set_epoch_and_state():
    ds = make_ds(20)
    s = gl.GadgetSampler(ds, batch_size=3, seed=1)
    loader = gl.GadgetLoader(ds, sampler=s)
    ref_s = gl.GadgetSampler(ds, batch_size=3, seed=1)
    ref_s.set_epoch(3)
    e3 = ids(ref_s)
    s.set_epoch(3)
    assert [b[1].tolist() for b in loader] == e3
    src = gl.GadgetSampler(ds, batch_size=3, seed=1)
    src.set_epoch(3)
    it = iter(src)
    next(it)
    s.load_state_dict(src.state_dict())
    assert [b[1].tolist() for b in loader] == e3[1:]


def test_loader_state_mismatch_refused():
    ds = make_ds(20)
    a = gl.GadgetLoader(ds, batch_size=4, seed=1)
    next(iter(a))
    st = a.state_dict()
    b = gl.GadgetLoader(ds, batch_size=5, seed=1)
    before = b.state_dict()
    with pytest.raises(gl.GadgetValueError):
        b.load_state_dict(st)
    assert b.state_dict() == before
    assert [x[1].tolist() for x in b] == ids(gl.GadgetSampler(ds, batch_size=5, seed=1))


def test_loader_refuses_dataloader_kwargs():
    ds = make_ds(10)
    for kw in [
        {"shuffle": True},
        {"batch_sampler": None},
        {"collate_fn": None},
        {"shuffle": False},
    ]:
        with pytest.raises(gl.GadgetTypeError):
            gl.GadgetLoader(ds, batch_size=4, **kw)


def test_loader_with_sampler_refuses_sampler_options():
    ds = make_ds(10)
    for kw in [
        {"order": "random"},
        {"seed": 0},
        {"drop_last": False},
        {"pad": False},
        {"num_replicas": 1},
        {"batch_size": 4},
        {"window_chunks": 2},
    ]:
        with pytest.raises(gl.GadgetError):
            gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4), **kw)


def test_loader_without_batch_size_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(make_ds(10))


def test_loader_pad_and_drop_last():
    ds = make_ds(10)
    pad = [b[1].tolist() for b in gl.GadgetLoader(ds, batch_size=4, pad=True, seed=1)]
    assert [len(b) for b in pad] == [4, 4, 4]
    drop = [b[1].tolist() for b in gl.GadgetLoader(ds, batch_size=4, drop_last=True, seed=1)]
    assert [len(b) for b in drop] == [4, 4]
    assert len(set(flat(drop))) == 8


# ----------------------------------------------------------------------------- GadgetDataset


@pytest.fixture
def mixed(tmp_path):
    n = 12
    a = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    t = torch.arange(n * 3, dtype=torch.float64).reshape(n, 3) * -1
    g_src = np.arange(n * 4, dtype=np.int32).reshape(n, 4) * 7
    g = gl.DataGadget(g_src, placement="cpu")
    p = tmp_path / "p.npy"
    p_src = np.arange(n * 2, dtype=np.int16).reshape(n, 2) + 100
    np.save(p, p_src)
    lab = np.arange(n, dtype=np.int64)[::-1].copy()
    flags = np.arange(n) % 3 == 0
    ds = gl.GadgetDataset(a, t, g, str(p), lab, flags, placement="cpu", device="cpu")
    refs = [a, t.numpy(), g_src, p_src, lab, flags]
    return ds, refs, g


def test_mixed_columns_len_and_dtypes(mixed):
    ds, refs, _ = mixed
    assert len(ds) == 12
    b = ds[[0, 1]]
    assert [c.dtype for c in b] == [
        torch.float32,
        torch.float64,
        torch.int32,
        torch.int16,
        torch.int64,
        torch.bool,
    ]
    assert ds.row_nbytes == 2 * 4 + 3 * 8 + 4 * 4 + 2 * 2 + 8 + 1


def test_mixed_single_row(mixed):
    ds, refs, _ = mixed
    for index in [0, 5, 11, -1, -12, np.int64(4)]:
        row = ds[index]
        assert isinstance(row, tuple) and len(row) == len(refs)
        for got, ref in zip(row, refs, strict=True):
            np.testing.assert_array_equal(np.asarray(got), ref[int(index)])
        assert row[4].dim() == 0  # 1-D label column: one value per row


@pytest.mark.parametrize(
    "index",
    [
        [3, 1, 3, 0],
        np.array([11, 2]),
        torch.tensor([5, 6, 7]),
        range(2, 9, 3),
        slice(2, 7),
        slice(-3, None),
        slice(None, None, -2),
        torch.tensor([[0, 1], [2, 3]]),
        np.array([4], dtype=np.int32),
        torch.tensor([9, 1], dtype=torch.int16),
    ],
)
def test_mixed_batch_index(mixed, index):
    ds, refs, _ = mixed
    b = ds[index]
    assert isinstance(b, gl.GadgetBatch) and len(b) == len(refs)
    if isinstance(index, slice):
        sel = np.arange(12)[index]
    elif isinstance(index, range):
        sel = np.array(list(index))
    else:
        sel = np.asarray(index)
    for got, ref in zip(b, refs, strict=True):
        np.testing.assert_array_equal(got.numpy(), ref[sel.astype(np.int64)])


def test_getitems_returns_one_batch(mixed):
    ds, refs, _ = mixed
    out = ds.__getitems__([7, 0, 7])
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], gl.GadgetBatch)
    for got, ref in zip(out[0], refs, strict=True):
        np.testing.assert_array_equal(got.numpy(), ref[[7, 0, 7]])


def test_dataset_bad_ids(mixed):
    ds, _, _ = mixed
    for bad, exc in [
        ([-1], gl.GadgetIndexError),
        ([12], gl.GadgetIndexError),
        (12, IndexError),
        (-13, IndexError),
        ([1.0], gl.GadgetTypeError),
        (np.array([0.5]), gl.GadgetTypeError),
        ("a", gl.GadgetTypeError),
        (torch.tensor([13]), gl.GadgetIndexError),
    ]:
        with pytest.raises(exc):
            ds[bad]


@pytest.mark.parametrize("bad", [[True, 1], [1, 2.0], [1, "x"], [1, None]])
def test_getitems_bad_lists(mixed, bad):
    ds, _, _ = mixed
    with pytest.raises(gl.GadgetTypeError):
        ds.__getitems__(bad)


def test_getitems_out_of_range_list(mixed):
    ds, _, _ = mixed
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__([0, 12])
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__([-1, 2])


def test_datagadget_column_is_shared_arrays_are_copied():
    n = 6
    src = np.zeros((n, 2), np.float32)
    g = gl.DataGadget(np.ones((n, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(src, g, placement="cpu", device="cpu")
    src[:] = 5.0  # copied in: no effect
    g.insertData(torch.full((1, 2), 9.0), torch.tensor([3]))  # used as is: seen
    x, y = ds[[2, 3]]
    np.testing.assert_array_equal(x.numpy(), np.zeros((2, 2), np.float32))
    np.testing.assert_array_equal(y.numpy(), np.array([[1, 1], [9, 9]], np.float32))
    ds.close()
    assert g.getData([3]).tolist() == [[9.0, 9.0]]  # not closed by the dataset


def test_file_column_dataset_values(tmp_path):
    n = 33
    ds = gl.GadgetDataset(
        *(lambda p: (np.save(p, feats(n)), str(p))[1:])(tmp_path / "f.npy"),
        np.arange(n),
        placement="file",
        block_rows=4,
        device="cpu",
    )
    assert [c.placement for c in ds.columns] == ["file", "cpu"]
    for b in DataLoader(ds, batch_size=5, shuffle=True):
        check_batch_values(tuple(b), n)
    for b in gl.GadgetLoader(ds, batch_size=5, order="chunk", window_chunks=2):
        check_batch_values(b, n)


@pytest.mark.parametrize(
    "cols,exc,frag",
    [
        ((), gl.GadgetValueError, "column"),
        ((np.zeros((3, 2)), np.zeros(4)), gl.GadgetValueError, "rows"),
        ((np.zeros((0, 2)),), gl.GadgetValueError, None),
        ((object(),), gl.GadgetTypeError, None),
        ((None,), gl.GadgetTypeError, None),
        ((np.zeros(3), 5), gl.GadgetTypeError, None),
    ],
)
def test_dataset_bad_columns(cols, exc, frag):
    with pytest.raises(exc, match=frag):
        gl.GadgetDataset(*cols, placement="cpu", device="cpu")


def test_dataset_missing_file(tmp_path):
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.GadgetDataset(str(tmp_path / "nope.npy"))


def test_column_reloaded_to_other_row_count(tmp_path):
    p = tmp_path / "small.npy"
    np.save(p, np.zeros((4, 2), np.float32))
    g = gl.DataGadget(np.ones((6, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(g, np.arange(6), device="cpu", placement="cpu")
    g.load(str(p))
    with pytest.raises(gl.GadgetValueError):
        ds[[0, 1]]


# ----------------------------------------------------------------------------- sampler bad input

BAD_SAMPLER_OPTIONS = [
    ({"batch_size": 0}, gl.GadgetValueError),
    ({"batch_size": -3}, gl.GadgetValueError),
    ({"batch_size": 2.0}, gl.GadgetTypeError),
    ({"batch_size": "4"}, gl.GadgetTypeError),
    ({"batch_size": 2, "order": "shuffle"}, gl.GadgetKeyError),
    ({"batch_size": 2, "pad": True, "drop_last": True}, gl.GadgetValueError),
    ({"batch_size": 2, "num_replicas": 2}, gl.GadgetValueError),
    ({"batch_size": 2, "num_replicas": 2, "rank": 2}, gl.GadgetValueError),
    ({"batch_size": 2, "num_replicas": 0, "rank": 0}, gl.GadgetValueError),
    ({"batch_size": 2, "window_chunks": 0}, gl.GadgetValueError),
    ({"batch_size": 2, "window_chunks": 1.5}, gl.GadgetTypeError),
    ({"batch_size": 2, "chunk_rows": 0}, gl.GadgetValueError),
    ({"batch_size": 2, "seed": "s"}, gl.GadgetTypeError),
    ({"batch_size": 2, "drop_last": "yes"}, gl.GadgetTypeError),
]


@pytest.mark.parametrize("kind", ["value", "type", "key"])
def test_sampler_bad_options(kind):
    want = {"value": gl.GadgetValueError, "type": gl.GadgetTypeError, "key": gl.GadgetKeyError}[
        kind
    ]
    cases = [kw for kw, exc in BAD_SAMPLER_OPTIONS if exc is want]
    assert cases
    for kw in cases:
        with pytest.raises(want):
            gl.GadgetSampler(10, **kw)


def test_sampler_bad_data_source():
    for src, exc in [
        (0, gl.GadgetValueError),
        ("/tmp/x.npy", gl.GadgetTypeError),
        (3.5, gl.GadgetTypeError),
        (-4, gl.GadgetValueError),
    ]:
        with pytest.raises(exc):
            gl.GadgetSampler(src, batch_size=2)


def test_sampler_more_ranks_than_rows():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(3, batch_size=2, num_replicas=4, rank=0)


def test_sampler_set_epoch_negative_refused_and_unchanged():
    s = gl.GadgetSampler(10, batch_size=3, seed=1)
    s.set_epoch(2)
    with pytest.raises(gl.GadgetValueError):
        s.set_epoch(-1)
    assert s.epoch == 2
    ref = gl.GadgetSampler(10, batch_size=3, seed=1)
    ref.set_epoch(2)
    assert ids(s) == ids(ref)


def test_sampler_batches_are_views_clone_safe():
    s = gl.GadgetSampler(12, batch_size=4, order="random", seed=0)
    first = [b.clone() for b in s]
    s.set_epoch(0)
    again = [b.clone() for b in s]
    assert ids(first) == ids(again)


# ----------------------------------------------------------------------------- passes and state


def test_state_after_new_iter_matches_new_pass():
    # "Starting a new iter() before the pass ends restarts the current epoch" and
    # state_dict(): "load it into a fresh sampler to continue from the next batch".
    s = gl.GadgetSampler(20, batch_size=3, seed=1)
    it1 = iter(s)
    next(it1), next(it1)  # an early break after two batches
    it2 = iter(s)  # the next loop starts
    st = s.state_dict()  # checkpoint before its first batch
    fresh = gl.GadgetSampler(20, batch_size=3, seed=1)
    fresh.load_state_dict(st)
    assert ids(fresh) == ids(it2)


def test_stateful_dataloader_state_at_start_of_pass_after_break():
    ds = make_ds(20)
    mk = lambda: gl.GadgetSampler(ds, batch_size=3, seed=1)  # noqa: E731
    dl = StatefulDataLoader(ds, batch_sampler=mk())
    for i, _ in enumerate(dl):
        if i == 1:
            break
    it = iter(dl)  # next epoch loop: the same epoch anew
    st = dl.state_dict()
    rest = [b[1].tolist() for b in it]
    assert rest == ids(mk())
    dl2 = StatefulDataLoader(ds, batch_sampler=mk())
    dl2.load_state_dict(st)
    assert [b[1].tolist() for b in dl2] == rest


def test_gadget_loader_state_at_start_of_pass_after_break():
    ds = make_ds(20)
    mk = lambda: gl.GadgetLoader(ds, batch_size=3, seed=1, coalesce=2)  # noqa: E731
    loader = mk()
    for i, _ in enumerate(loader):
        if i == 1:
            break
    it = iter(loader)
    st = loader.state_dict()
    rest = [b[1].tolist() for b in it]
    assert rest == ids(gl.GadgetSampler(ds, batch_size=3, seed=1))
    l2 = mk()
    l2.load_state_dict(st)
    assert [b[1].tolist() for b in l2] == rest


def test_older_pass_no_longer_moves_state_after_new_pass_starts():
    s = gl.GadgetSampler(20, batch_size=3, seed=1)
    ref = ids(gl.GadgetSampler(20, batch_size=3, seed=1))
    it1 = iter(s)
    next(it1)
    it2 = iter(s)
    assert next(it2).tolist() == ref[0]
    assert next(it1).tolist() == ref[1]  # the old pass still yields its batches
    assert next(it1).tolist() == ref[2]
    st = s.state_dict()
    f = gl.GadgetSampler(20, batch_size=3)
    f.load_state_dict(st)
    assert ids(f) == ref[1:]  # but the state follows it2 (1 batch drawn)


def test_older_pass_after_load_and_set_epoch():
    s = gl.GadgetSampler(20, batch_size=3, seed=1)
    ref = ids(gl.GadgetSampler(20, batch_size=3, seed=1))
    it1 = iter(s)
    next(it1)
    src = gl.GadgetSampler(20, batch_size=3, seed=1)
    i2 = iter(src)
    for _ in range(4):
        next(i2)
    s.load_state_dict(src.state_dict())
    assert next(it1).tolist() == ref[1]
    assert ids(s) == ref[4:]
    s2 = gl.GadgetSampler(20, batch_size=3, seed=1)
    it = iter(s2)
    next(it)
    s2.set_epoch(3)
    next(it)
    e3 = gl.GadgetSampler(20, batch_size=3, seed=1)
    e3.set_epoch(3)
    assert ids(s2) == ids(e3)


def test_state_roundtrip_after_load():
    s = gl.GadgetSampler(20, batch_size=3, seed=1, num_replicas=2, rank=1)
    it = iter(s)
    next(it), next(it)
    st = s.state_dict()
    r = gl.GadgetSampler(20, batch_size=3, num_replicas=2, rank=1)
    r.load_state_dict(st)
    assert r.state_dict() == st
    assert r.seed == 1 and r.epoch == st.get("epoch", 0)


def test_stateful_dataloader_last_batch_then_set_epoch():
    ds = make_ds(20)
    mk = lambda: gl.GadgetSampler(ds, batch_size=3, seed=1)  # noqa: E731
    ref_s = mk()
    r0, r1 = ids(ref_s), ids(ref_s)
    dl = StatefulDataLoader(ds, batch_sampler=mk())
    st = None
    for _ in dl:
        st = dl.state_dict()
    s2 = mk()
    dl2 = StatefulDataLoader(ds, batch_sampler=s2)
    dl2.load_state_dict(st)
    s2.set_epoch(0)
    assert [b[1].tolist() for b in dl2] == []
    s2.set_epoch(1)
    assert [b[1].tolist() for b in dl2] == r1
    assert r0 != r1


def test_stateful_dataloader_sampler_batch_size_none():
    ds = make_ds(20)
    mk = lambda: gl.GadgetSampler(ds, batch_size=3, seed=1)  # noqa: E731
    ref = ids(mk())
    dl = StatefulDataLoader(ds, sampler=mk(), batch_size=None)
    it = iter(dl)
    got = [next(it)[1].tolist() for _ in range(2)]
    st = dl.state_dict()
    dl2 = StatefulDataLoader(ds, sampler=mk(), batch_size=None)
    dl2.load_state_dict(st)
    assert got + [b[1].tolist() for b in dl2] == ref


def test_gadget_loader_with_workers_resume():
    ds = make_ds(20)

    def mk():
        return gl.GadgetLoader(
            ds,
            batch_size=3,
            seed=1,
            num_workers=1,
            multiprocessing_context="fork",
        )

    ref = ids(gl.GadgetSampler(ds, batch_size=3, seed=1))
    loader = mk()
    it = iter(loader)
    got = []
    for _ in range(3):
        b = next(it)
        check_batch_values(b, 20)
        got.append(b[1].tolist())
    st = loader.state_dict()
    del it
    l2 = mk()
    l2.load_state_dict(st)
    assert got + [b[1].tolist() for b in l2] == ref


@pytest.mark.parametrize("mode", [{"pad": True}, {"drop_last": True}])
def test_resume_with_pad_or_drop_last_on_ranks(mode):
    mk = lambda r: gl.GadgetSampler(23, batch_size=3, num_replicas=2, rank=r, seed=2, **mode)  # noqa: E731
    for r in range(2):
        ref = ids(mk(r))
        s = mk(r)
        it = iter(s)
        next(it), next(it)
        f = mk(r)
        f.load_state_dict(s.state_dict())
        assert ids(f) == ref[2:]


# ----------------------------------------------------------------------------- small cases


def test_pad_fewer_rows_than_ranks():
    got = [
        ids(gl.GadgetSampler(3, batch_size=2, num_replicas=4, rank=r, pad=True, seed=0))
        for r in range(4)
    ]
    assert all(len(g) == 1 and len(g[0]) == 2 for g in got)
    c = Counter(flat([b for g in got for b in g]))
    assert sorted(c) == [0, 1, 2] and sum(c.values()) == 8


def test_pad_single_row():
    assert ids(gl.GadgetSampler(1, batch_size=4, pad=True)) == [[0, 0, 0, 0]]


def test_drop_last_exactly_one_batch_per_rank():
    got = [
        ids(gl.GadgetSampler(8, batch_size=4, num_replicas=2, rank=r, drop_last=True))
        for r in range(2)
    ]
    assert [len(g) for g in got] == [1, 1]
    assert sorted(flat([g[0] for g in got])) == list(range(8))


@pytest.mark.parametrize("src", [np.int64(10), "gadget", "dataset"])
def test_sampler_data_source_kinds(src):
    if src == "gadget":
        src = gl.DataGadget(np.zeros((10, 2), np.float32), placement="cpu")
    elif src == "dataset":
        src = make_ds(10)
    s = gl.GadgetSampler(src, batch_size=3, order="sequential")
    assert s.num_rows == 10 and len(s) == 4
    assert flat(list(s)) == list(range(10))


def test_large_seed_is_deterministic():
    a = ids(gl.GadgetSampler(30, batch_size=4, seed=2**40))
    b = ids(gl.GadgetSampler(30, batch_size=4, seed=2**40))
    c = ids(gl.GadgetSampler(30, batch_size=4, seed=2**40 + 1))
    assert a == b and a != c


@pytest.mark.parametrize("data", ["gadget", "array"])
def test_loader_on_non_dataset(data):
    src = np.arange(10, dtype=np.float32) * 2
    obj = gl.DataGadget(src, placement="cpu") if data == "gadget" else src
    out = [b[0].tolist() for b in gl.GadgetLoader(obj, batch_size=4, order="sequential")]
    assert out == [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0], [16.0, 18.0]]


def test_loader_len_matches_sampler_modes():
    ds = make_ds(23)
    for kw in ({}, {"drop_last": True}, {"pad": True}, {"num_replicas": 3, "rank": 2}):
        assert len(gl.GadgetLoader(ds, batch_size=3, **kw)) == len(
            gl.GadgetSampler(ds, batch_size=3, **kw)
        )


def test_dataloader_second_loop_after_break_is_full_epoch():
    ds = make_ds(20)
    s = gl.GadgetSampler(ds, batch_size=3, seed=4)
    ref = ids(gl.GadgetSampler(ds, batch_size=3, seed=4))
    dl = DataLoader(ds, batch_sampler=s)
    for i, _ in enumerate(dl):
        if i == 2:
            break
    assert [b[1].tolist() for b in dl] == ref
    e1 = gl.GadgetSampler(ds, batch_size=3, seed=4)
    e1.set_epoch(1)
    assert [b[1].tolist() for b in dl] == ids(e1)


# ----------------------------------------------------------------------------- more edges


def test_corrupt_states_refused_sampler_unchanged():
    src = gl.GadgetSampler(20, batch_size=3, seed=1)
    st = src.state_dict()
    bad = [
        dict(st, position=99),
        dict(st, position=8),
        dict(st, position=-1),
        dict(st, epoch=-1),
        dict(st, version=99),
        dict(st, position="a"),
        {k: v for k, v in st.items() if k != "position"},
    ]
    for d in bad:
        r = gl.GadgetSampler(20, batch_size=3, seed=4)
        before = r.state_dict()
        with pytest.raises(gl.GadgetError):
            r.load_state_dict(d)
        assert r.state_dict() == before
        assert ids(r) == ids(gl.GadgetSampler(20, batch_size=3, seed=4))


def test_loader_refused_state_and_epoch_change_nothing():
    ds = make_ds(20)
    L = gl.GadgetLoader(ds, batch_size=3, seed=1)
    it = iter(L)
    next(it)
    before = L.state_dict()
    with pytest.raises(gl.GadgetValueError):
        L.set_epoch(-1)
    with pytest.raises(gl.GadgetTypeError):
        L.set_epoch(1.5)
    with pytest.raises(gl.GadgetValueError):
        L.load_state_dict(
            gl.GadgetSampler(20, batch_size=3).state_dict()
        )  # a sampler's, not a loader's
    assert L.state_dict() == before


@pytest.mark.parametrize("R", [2, 3, 5])
def test_chunk_order_ranks_share_at_most_one_window(tmp_path, R):
    n, cr, wc = 160, 8, 2
    ds = make_ds(n, "file", tmp_path, block_rows=cr)
    chunks = []
    rows = []
    for r in range(R):
        s = gl.GadgetSampler(
            ds, batch_size=4, order="chunk", window_chunks=wc, seed=3, num_replicas=R, rank=r
        )
        f = flat(list(s))
        rows += f
        chunks.append({i // cr for i in f})
    assert sorted(rows) == list(range(n))
    for r in range(R - 1):
        assert len(chunks[r] & chunks[r + 1]) <= wc
        for q in range(r + 2, R):
            assert not (chunks[r] & chunks[q])


def test_sampler_on_file_gadget_takes_its_chunk_rows(tmp_path):
    p = tmp_path / "g.npy"
    np.save(p, feats(40))
    g = gl.DataGadget(str(p), placement="file", block_rows=5)
    s = gl.GadgetSampler(g, batch_size=3, order="chunk", window_chunks=2, seed=0)
    assert s.chunk_rows == 5
    check_chunk_windows(flat(list(s)), 40, 5, 2)


def test_dataloader_batch_sampler_with_workers():
    n = 26
    ds = make_ds(n)
    s = gl.GadgetSampler(ds, batch_size=4, seed=3)
    ref = ids(gl.GadgetSampler(ds, batch_size=4, seed=3))
    got = []
    for b in DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork"):
        check_batch_values(tuple(b), n)
        got.append(b[1].tolist())
    assert got == ref


@pytest.mark.parametrize(
    "kw",
    [
        {"pad": True},
        {"drop_last": True},
        {"num_replicas": 3, "rank": 1, "pad": True},
        {"num_replicas": 2, "rank": 1},
    ],
)
def test_loader_coalesced_modes_match_sampler(kw):
    n = 23
    ds = make_ds(n)
    ref_s = gl.GadgetSampler(ds, batch_size=3, seed=5, **kw)
    ref = [ids(ref_s) for _ in range(2)]
    L = gl.GadgetLoader(ds, batch_size=3, seed=5, coalesce=4, **kw)
    for e in range(2):
        got = []
        for b in L:
            check_batch_values(b, n)
            got.append(b[1].tolist())
        assert got == ref[e]


def test_loader_chunk_file_backed_resume(tmp_path):
    n = 64
    ds = make_ds(n, "file", tmp_path, block_rows=4)
    mk = lambda: gl.GadgetLoader(ds, batch_size=5, order="chunk", window_chunks=3, seed=2)  # noqa: E731
    ref_s = gl.GadgetSampler(ds, batch_size=5, order="chunk", window_chunks=3, seed=2)
    ref = ids(ref_s)
    L = mk()
    it = iter(L)
    got = [next(it)[1].tolist() for _ in range(6)]
    st = L.state_dict()
    L2 = mk()
    L2.load_state_dict(st)
    rest = []
    for b in L2:
        check_batch_values(b, n)
        rest.append(b[1].tolist())
    assert got + rest == ref
    check_chunk_windows(flat(ref), n, 4, 3)


def test_dataset_column_layouts_and_dtypes():
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    t = torch.arange(60.0).reshape(3, 20).T  # non-contiguous tensor
    c3 = np.arange(20 * 6, dtype=np.int64).reshape(20, 2, 3)
    bf = torch.arange(20, dtype=torch.bfloat16)
    w = torch.ones(20, requires_grad=True)
    ds = gl.GadgetDataset(np.asfortranarray(x), t, c3, bf, w, placement="cpu", device="cpu")
    sel = [3, 19, 0, 3]
    b = ds[sel]
    np.testing.assert_array_equal(b[0].numpy(), x[sel])
    np.testing.assert_array_equal(b[1].numpy(), t.numpy()[sel])
    np.testing.assert_array_equal(b[2].numpy(), c3[sel])
    assert b[3].dtype == torch.bfloat16 and b[3].tolist() == [3.0, 19.0, 0.0, 3.0]
    assert not b[4].requires_grad and b[4].tolist() == [1.0] * 4
    assert tuple(ds[5][2].shape) == (2, 3)
