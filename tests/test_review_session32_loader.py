"""Black-box review (session 32) of the input pipeline (GadgetDataset, GadgetSampler,
GadgetLoader, GadgetBatch and torch DataLoader integration); written from README.md,
SPEC.md and the public docstrings only."""

from __future__ import annotations

import itertools
import math
import pickle
import types
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import (
    ConcatDataset,
    DataLoader,
    SequentialSampler,
    Subset,
    TensorDataset,
    random_split,
)

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


# ---------------------------------------------------------------------------------------------
# helpers / plain references
# ---------------------------------------------------------------------------------------------

D = 3


def _arrays(n):
    x = np.arange(n * D, dtype=np.float32).reshape(n, D)  # row i starts with i * D
    y = np.arange(n, dtype=np.int64) * 7 + 1  # labels
    w = np.arange(n, dtype=np.float64) / 4.0  # weights
    return x, y, w


def _ds(n, **kw):
    x, y, w = _arrays(n)
    kw.setdefault("placement", "cpu")
    kw.setdefault("device", "cpu")
    return gl.GadgetDataset(x, y, w, **kw), (x, y, w)


def _ids_of(batch):
    """Row ids recovered from the feature column (row i's first value is i * D)."""
    xb = batch[0]
    return (xb[:, 0] / D).to(torch.int64).tolist()


def _check_aligned(batch, arrays, ids=None):
    x, y, w = arrays
    got = _ids_of(batch) if ids is None else list(ids)
    np.testing.assert_array_equal(batch[0].numpy(), x[got])
    np.testing.assert_array_equal(batch[1].numpy(), y[got])
    np.testing.assert_array_equal(batch[2].numpy(), w[got])
    return got


def _ref_positions(n, R, B, mode):
    """Per rank, the list of batches of *positions* in the epoch order (SPEC of the docstring)."""
    out = []
    if mode == "default":
        q, rem = divmod(n, R)
        k = math.ceil(q / B)
        for r in range(R):
            start = r * q + min(r, rem)
            size = q + (1 if r < rem else 0)
            pos = list(range(start, start + size))
            batches = [pos[i * B : (i + 1) * B] for i in range(k - 1)]
            batches.append(pos[(k - 1) * B :])
            out.append(batches)
    elif mode == "drop_last":
        k = n // (R * B)
        for r in range(R):
            base = r * k * B
            out.append([list(range(base + i * B, base + (i + 1) * B)) for i in range(k)])
    elif mode == "pad":
        k = math.ceil(n / (R * B))
        for r in range(R):
            base = r * k * B
            out.append([[(base + i * B + j) % n for j in range(B)] for i in range(k)])
    return out


def _mode_kw(mode):
    return {"default": {}, "drop_last": {"drop_last": True}, "pad": {"pad": True}}[mode]


def _batches(sampler):
    return [b.tolist() for b in sampler]


# ---------------------------------------------------------------------------------------------
# docstring examples
# ---------------------------------------------------------------------------------------------


def test_docstring_examples():
    assert _batches(gl.GadgetSampler(10, batch_size=4, order="sequential")) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert [
        _batches(gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r))
        for r in (0, 1)
    ] == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert [b[0].tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]
    x, y = np.ones((10, 4), np.float32), np.arange(10)
    ds = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    assert [tuple(t.shape) for t in next(iter(DataLoader(ds, batch_size=4)))] == [(4, 4), (4,)]


# ---------------------------------------------------------------------------------------------
# GadgetSampler: len and batches against the documented layout, every rank
# ---------------------------------------------------------------------------------------------

SHARD_CASES = [
    # (n, R, B)
    (1, 1, 1),
    (1, 1, 5),
    (7, 1, 3),
    (8, 1, 4),
    (9, 1, 4),
    (12, 1, 20),
    (9, 2, 2),
    (8, 2, 2),
    (10, 3, 3),
    (11, 3, 3),
    (12, 4, 3),
    (13, 4, 3),
    (17, 4, 4),
    (5, 5, 1),
    (6, 4, 2),
]


@pytest.mark.parametrize("n,R,B", SHARD_CASES)
def test_sampler_layout_matches_documented_shares(n, R, B):
    for mode in ("default", "drop_last", "pad"):
        _check_layout(n, R, B, mode)


def _check_layout(n, R, B, mode):
    if mode == "drop_last" and n < R * B:
        with pytest.raises(gl.GadgetValueError, match="drop_last"):
            gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=0, drop_last=True)
        return
    ref = _ref_positions(n, R, B, mode)
    for order in ("sequential", "random"):
        all_rows = []
        lens = set()
        for r in range(R):
            s = gl.GadgetSampler(
                n, batch_size=B, order=order, seed=11, num_replicas=R, rank=r, **_mode_kw(mode)
            )
            perm = s.epoch_order(0).tolist()
            assert sorted(perm) == list(range(n))
            if order == "sequential":
                assert perm == list(range(n))
            got = _batches(s)
            want = [[perm[p] for p in b] for b in ref[r]]
            assert got == want, (mode, order, r)
            assert len(s) == len(got)
            lens.add(len(s))
            for b in got:
                all_rows.extend(b)
        assert len(lens) == 1  # every rank the same number of batches
        counts = np.bincount(all_rows, minlength=n)
        if mode == "default":
            assert counts.tolist() == [1] * n
        elif mode == "drop_last":
            assert counts.max() == 1 and counts.sum() == n - n % (R * B)
            assert n % (R * B) < R * B
        else:
            assert counts.min() >= 1 and counts.sum() == R * B * math.ceil(n / (R * B))


def test_sampler_batches_are_int64():
    for n, B in [(10, 3), (16, 4), (5, 9)]:
        for b in gl.GadgetSampler(n, batch_size=B, seed=3):
            assert b.dtype == torch.int64
        for b in gl.GadgetSampler(n, batch_size=B, order="sequential", pad=True):
            assert b.dtype == torch.int64 and len(b) == B


def test_sampler_pad_fewer_rows_than_ranks():
    # "pad=True ... rows are seen twice that epoch (or more often where the missing rows outnumber the rows)"
    n, R, B = 3, 4, 2
    rows = []
    for r in range(R):
        s = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, pad=True, order="sequential")
        got = _batches(s)
        assert len(s) == 1 and [len(b) for b in got] == [B]
        rows += got[0]
    assert rows == [0, 1, 2, 0, 1, 2, 0, 1]


def test_sampler_refuses_fewer_rows_than_ranks_without_pad():
    with pytest.raises(gl.GadgetValueError, match="4 ranks"):
        gl.GadgetSampler(3, batch_size=2, num_replicas=4, rank=0)


def test_sampler_accepts_sized_objects_and_numpy_ints():
    ds, _ = _ds(11)
    for src in (ds, ds.columns[0], np.int64(11), 11):
        s = gl.GadgetSampler(src, batch_size=np.int64(4), order="sequential")
        assert s.num_rows == 11 and s.batch_size == 4 and len(s) == 3
        assert _batches(s)[-1] == [8, 9, 10]


def test_sampler_refuses_path():
    with pytest.raises(gl.GadgetTypeError, match="path"):
        gl.GadgetSampler("features.npy", batch_size=2)


def test_sampler_pickle_keeps_rank_and_batches():
    s = gl.GadgetSampler(10, batch_size=3, num_replicas=2, rank=1, seed=8)
    s2 = pickle.loads(pickle.dumps(s))
    assert (s2.rank, s2.num_replicas, s2.seed) == (1, 2, 8)
    assert _batches(s2) == _batches(
        gl.GadgetSampler(10, batch_size=3, num_replicas=2, rank=1, seed=8)
    )


def test_sampler_one_replica_hands_all_rows():
    s = gl.GadgetSampler(10, batch_size=4, num_replicas=1, rank=0)
    assert sorted(sum(_batches(s), [])) == list(range(10))


# ---------------------------------------------------------------------------------------------
# epochs, seeds, determinism
# ---------------------------------------------------------------------------------------------


def test_same_seed_same_order_different_seed_different_order():
    a = _batches(gl.GadgetSampler(50, batch_size=7, seed=123))
    b = _batches(gl.GadgetSampler(50, batch_size=7, seed=123))
    c = _batches(gl.GadgetSampler(50, batch_size=7, seed=124))
    assert a == b
    assert a != c
    assert sorted(sum(c, [])) == list(range(50))


def test_epochs_advance_by_themselves_and_match_set_epoch():
    s = gl.GadgetSampler(40, batch_size=6, seed=5)
    e0, e1, e2 = _batches(s), _batches(s), _batches(s)
    assert s.epoch == 3
    assert e0 != e1 and e1 != e2
    for e, want in enumerate([e0, e1, e2]):
        t = gl.GadgetSampler(40, batch_size=6, seed=5)
        t.set_epoch(e)
        assert _batches(t) == want
        flat = sum(want, [])
        assert flat == t.epoch_order(e).tolist()
        assert sorted(flat) == list(range(40))


def test_set_epoch_every_epoch_equals_auto_advance():
    a = gl.GadgetSampler(30, batch_size=4, seed=2)
    b = gl.GadgetSampler(30, batch_size=4, seed=2)
    for e in range(3):
        b.set_epoch(e)
        assert _batches(a) == _batches(b)


def test_random_order_is_not_identity_and_sequential_is():
    s = gl.GadgetSampler(64, batch_size=8, seed=0)
    assert s.epoch_order(0).tolist() != list(range(64))
    q = gl.GadgetSampler(64, batch_size=8, order="sequential", seed=0)
    assert sum(_batches(q), []) == list(range(64))
    assert sum(_batches(q), []) == list(range(64))  # every epoch


def test_break_restarts_current_epoch():
    s = gl.GadgetSampler(20, batch_size=3, seed=4)
    full = _batches(gl.GadgetSampler(20, batch_size=3, seed=4))
    it = iter(s)
    first = [next(it).tolist() for _ in range(2)]
    assert first == full[:2]
    del it
    assert s.epoch == 0
    assert _batches(s) == full
    assert s.epoch == 1


def test_largest_seed_accepted():
    s = gl.GadgetSampler(10, batch_size=3, seed=2**64 - 1)
    assert sorted(s.epoch_order().tolist()) == list(range(10))


@pytest.mark.parametrize(
    "seed,exc,frag",
    [
        (-1, gl.GadgetValueError, "got -1"),
        (2**64, gl.GadgetValueError, "2**64"),
        (1.5, gl.GadgetTypeError, "float"),
        ("1", gl.GadgetTypeError, "str"),
    ],
)
def test_sampler_bad_seed(seed, exc, frag):
    with pytest.raises(exc, match="seed") as ei:
        gl.GadgetSampler(10, batch_size=3, seed=seed)
    assert frag in str(ei.value)


@pytest.mark.parametrize(
    "epoch,exc",
    [(-1, gl.GadgetValueError), (2**64, gl.GadgetValueError), (1.0, gl.GadgetTypeError)],
)
def test_set_epoch_bad_value_changes_nothing(epoch, exc):
    s = gl.GadgetSampler(10, batch_size=3, seed=1)
    s.set_epoch(2)
    before = s.state_dict()
    with pytest.raises(exc, match="epoch"):
        s.set_epoch(epoch)
    assert s.state_dict() == before and s.epoch == 2


# ---------------------------------------------------------------------------------------------
# DataLoader default form (torch's sampler) against torch's own index reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 8, 9])
def test_dataloader_default_form(n):
    ds, arrays = _ds(n)
    for B, drop_last, shuffle in itertools.product([1, 4, 20], [False, True], [False, True]):
        g1 = torch.Generator().manual_seed(1234)
        g2 = torch.Generator().manual_seed(1234)
        dl = DataLoader(ds, batch_size=B, shuffle=shuffle, drop_last=drop_last, generator=g1)
        # plain torch reference: the same DataLoader over a dataset of row numbers
        ref_dl = DataLoader(
            TensorDataset(torch.arange(n)),
            batch_size=B,
            shuffle=shuffle,
            drop_last=drop_last,
            generator=g2,
        )
        ref = [b[0].tolist() for b in ref_dl]
        assert len(dl) == len(ref_dl) == len(ref) == (n // B if drop_last else math.ceil(n / B))
        got = []
        for batch in dl:
            assert isinstance(batch, gl.GadgetBatch) and len(batch) == 3
            got.append(_check_aligned(batch, arrays))
        assert got == ref, (B, drop_last, shuffle)


def test_dataloader_generator_determinism_and_epochs_differ():
    ds, arrays = _ds(40)

    def run(seed, epochs=2):
        dl = DataLoader(
            ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
        return [[_ids_of(b) for b in dl] for _ in range(epochs)]

    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c
    assert a[0] != a[1]
    for ep in a:
        assert sorted(sum(ep, [])) == list(range(40))


def test_dataloader_default_placement_is_cpu_without_cuda():
    x, y, _ = _arrays(9)
    ds = gl.GadgetDataset(x, y)
    assert ds.device == torch.device("cpu") or str(ds.device) == "cpu"
    got = []
    for xb, yb in DataLoader(ds, batch_size=4, shuffle=True):
        assert xb.device.type == "cpu" and yb.device.type == "cpu"
        ids = _ids_of((xb,))
        np.testing.assert_array_equal(yb.numpy(), y[ids])
        got += ids
    assert sorted(got) == list(range(9))


def test_dataloader_custom_collate_gets_one_element_list():
    ds, arrays = _ds(10)
    seen = []

    def collate(batch):
        seen.append(len(batch))
        return batch[0]

    out = list(DataLoader(ds, batch_size=4, collate_fn=collate))
    assert seen == [1, 1, 1]
    assert [_check_aligned(b, arrays) for b in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_dataloader_workers_every_row_once():
    ds, arrays = _ds(13)
    got = []
    for batch in DataLoader(
        ds, batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0)
    ):
        assert all(t.device.type == "cpu" for t in batch)
        got += _check_aligned(batch, arrays)
    assert sorted(got) == list(range(13))


# ---------------------------------------------------------------------------------------------
# DataLoader fast forms with GadgetSampler
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,B,mode",
    [
        (10, 3, "default"),
        (10, 3, "drop_last"),
        (10, 3, "pad"),
        (8, 4, "default"),
        (5, 9, "default"),
        (5, 9, "pad"),
    ],
)
def test_dataloader_batch_sampler_form(n, B, mode):
    ds, arrays = _ds(n)
    s = gl.GadgetSampler(ds, batch_size=B, seed=3, coalesce=1, **_mode_kw(mode))
    ref = gl.GadgetSampler(n, batch_size=B, seed=3, **_mode_kw(mode))
    want = _batches(ref)
    dl = DataLoader(ds, batch_sampler=s)
    assert len(dl) == len(s) == len(want)
    got = [_check_aligned(b, arrays, None) for b in dl]
    # with pad the feature-derived ids still identify rows (repeats included)
    assert got == want


@pytest.mark.parametrize("coalesce", [1, 3, None])
def test_dataloader_sampler_batch_size_none_form(coalesce):
    ds, arrays = _ds(11)
    s = gl.GadgetSampler(ds, batch_size=4, seed=9, coalesce=coalesce)
    want = _batches(gl.GadgetSampler(11, batch_size=4, seed=9))
    dl = DataLoader(ds, sampler=s, batch_size=None)
    assert len(dl) == 3
    got = []
    for b in dl:
        assert len(b) == 3
        got.append(_check_aligned(b, arrays))
    assert got == want


def test_dataloader_sampler_without_batch_size_none_refused():
    ds, _ = _ds(10)
    s = gl.GadgetSampler(ds, batch_size=3)
    dl = DataLoader(ds, sampler=s)
    with pytest.raises(gl.GadgetValueError, match="batch_sampler"):
        list(dl)


def test_dataloader_batch_sampler_epochs_advance():
    ds, arrays = _ds(24)
    s = gl.GadgetSampler(ds, batch_size=5, seed=1)
    dl = DataLoader(ds, batch_sampler=s)
    e0 = [_ids_of(b) for b in dl]
    e1 = [_ids_of(b) for b in dl]
    assert e0 != e1
    assert sum(e0, []) == s.epoch_order(0).tolist()
    assert sum(e1, []) == s.epoch_order(1).tolist()


def test_dataloader_batch_sampler_with_workers():
    ds, arrays = _ds(14)
    s = gl.GadgetSampler(ds, batch_size=4, seed=6)
    want = _batches(gl.GadgetSampler(14, batch_size=4, seed=6))
    got = [_check_aligned(b, arrays) for b in DataLoader(ds, batch_sampler=s, num_workers=2)]
    assert got == want


# ---------------------------------------------------------------------------------------------
# GadgetLoader
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 8, 9])
def test_gadgetloader_len_and_batches(n):
    ds, arrays = _ds(n)
    for B, drop_last in itertools.product([1, 4, 10], [False, True]):
        _check_loader(ds, arrays, n, B, drop_last)


def _check_loader(ds, arrays, n, B, drop_last):
    if drop_last and n < B:
        with pytest.raises(gl.GadgetValueError, match="drop_last"):
            gl.GadgetLoader(ds, batch_size=B, drop_last=True)
        return
    for order in ("sequential", "random"):
        L = gl.GadgetLoader(ds, batch_size=B, drop_last=drop_last, order=order, seed=21)
        want = _batches(
            gl.GadgetSampler(n, batch_size=B, drop_last=drop_last, order=order, seed=21)
        )
        assert len(L) == len(want) == (n // B if drop_last else math.ceil(n / B))
        got = []
        for b in L:
            assert isinstance(b, gl.GadgetBatch)
            got.append(_check_aligned(b, arrays))
        assert got == want


@pytest.mark.parametrize("prefetch,coalesce", [(0, None), (2, 1), (2, 3), (5, 4)])
def test_gadgetloader_prefetch_coalesce_same_batches(prefetch, coalesce):
    ds, arrays = _ds(23)
    want = _batches(gl.GadgetSampler(23, batch_size=4, seed=2))
    L = gl.GadgetLoader(ds, batch_size=4, seed=2, prefetch=prefetch, coalesce=coalesce)
    assert [_check_aligned(b, arrays) for b in L] == want


@pytest.mark.parametrize("R", [2, 3])
def test_gadgetloader_ranks(R):
    n, B = 11, 2
    ds, arrays = _ds(n)
    rows, lens = [], set()
    for r in range(R):
        L = gl.GadgetLoader(ds, batch_size=B, num_replicas=R, rank=r, seed=4)
        want = _batches(gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, seed=4))
        got = [_check_aligned(b, arrays) for b in L]
        assert got == want and len(L) == len(got)
        lens.add(len(L))
        rows += sum(got, [])
    assert len(lens) == 1 and sorted(rows) == list(range(n))


def test_gadgetloader_epochs_advance_and_break_restarts():
    ds, arrays = _ds(20)
    L = gl.GadgetLoader(ds, batch_size=3, seed=4)
    s = gl.GadgetSampler(20, batch_size=3, seed=4)
    e0, e1 = _batches(s), _batches(s)
    it = iter(L)
    assert [_ids_of(next(it)) for _ in range(2)] == e0[:2]
    del it
    assert [_ids_of(b) for b in L] == e0  # broken pass: same epoch anew
    assert [_ids_of(b) for b in L] == e1


def test_gadgetloader_over_sampler_follows_set_epoch():
    ds, arrays = _ds(20)
    s = gl.GadgetSampler(ds, batch_size=3, seed=4)
    L = gl.GadgetLoader(ds, sampler=s)
    s.set_epoch(3)
    ref = gl.GadgetSampler(20, batch_size=3, seed=4)
    ref.set_epoch(3)
    assert [_ids_of(b) for b in L] == _batches(ref)


def test_gadgetloader_wraps_plain_array():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    L = gl.GadgetLoader(x, batch_size=4, order="sequential")
    got = [b[0].numpy() for b in L]
    assert len(L) == 2
    np.testing.assert_array_equal(np.concatenate(got), x)


def test_gadgetloader_sampler_plus_option_refused():
    ds, _ = _ds(10)
    s = gl.GadgetSampler(ds, batch_size=3)
    for kw in [
        {"order": "random"},
        {"seed": 0},
        {"drop_last": False},
        {"pad": False},
        {"num_replicas": 1},
        {"rank": 0},
        {"window_chunks": 2},
    ]:
        with pytest.raises(gl.GadgetValueError, match=next(iter(kw))):
            gl.GadgetLoader(ds, sampler=s, **kw)


@pytest.mark.parametrize(
    "name,value", [("shuffle", True), ("collate_fn", lambda b: b), ("batch_sampler", None)]
)
def test_gadgetloader_dataloader_owned_kwargs_refused(name, value):
    ds, _ = _ds(10)
    if name == "batch_sampler":
        value = gl.GadgetSampler(ds, batch_size=3)
    with pytest.raises(gl.GadgetTypeError, match=name):
        gl.GadgetLoader(ds, batch_size=3, **{name: value})


def test_gadgetloader_sampler_must_be_gadget_sampler():
    ds, _ = _ds(10)
    with pytest.raises(gl.GadgetTypeError, match="SequentialSampler"):
        gl.GadgetLoader(ds, sampler=SequentialSampler(range(10)))


def test_gadgetloader_needs_batch_size_or_sampler():
    ds, _ = _ds(10)
    with pytest.raises(gl.GadgetValueError, match="batch_size"):
        gl.GadgetLoader(ds)


@pytest.mark.parametrize(
    "kw,exc,frag",
    [
        ({"prefetch": -1}, gl.GadgetValueError, "prefetch"),
        ({"prefetch": 1.5}, gl.GadgetTypeError, "prefetch"),
        ({"coalesce": 0}, gl.GadgetValueError, "coalesce"),
        ({"num_workers": -1}, gl.GadgetValueError, "num_workers"),
    ],
)
def test_gadgetloader_bad_options(kw, exc, frag):
    ds, _ = _ds(10)
    with pytest.raises(exc, match=frag):
        gl.GadgetLoader(ds, batch_size=3, **kw)


def test_gadgetloader_with_workers():
    ds, arrays = _ds(13)
    want = _batches(gl.GadgetSampler(13, batch_size=4, seed=3))
    L = gl.GadgetLoader(ds, batch_size=4, seed=3, num_workers=1)
    assert [_check_aligned(b, arrays) for b in L] == want


# ---------------------------------------------------------------------------------------------
# invalid arguments: batch_size and friends
# ---------------------------------------------------------------------------------------------

BAD_BATCH = [
    (0, gl.GadgetValueError, "got 0"),
    (-3, gl.GadgetValueError, "got -3"),
    (2.0, gl.GadgetTypeError, "float"),
    (True, gl.GadgetTypeError, "bool"),
    ("4", gl.GadgetTypeError, "str"),
]


@pytest.mark.parametrize("bad,exc,frag", BAD_BATCH)
def test_bad_batch_size_sampler_and_loader(bad, exc, frag):
    with pytest.raises(exc, match="batch_size") as ei:
        gl.GadgetSampler(10, batch_size=bad)
    assert frag in str(ei.value)
    assert ("int" in str(ei.value)) or (">= 1" in str(ei.value)) or ("> 0" in str(ei.value))
    ds, _ = _ds(10)
    with pytest.raises(exc, match="batch_size") as ei:
        gl.GadgetLoader(ds, batch_size=bad)
    assert frag in str(ei.value)


def test_sampler_batch_size_none_refused():
    with pytest.raises(gl.GadgetTypeError, match="batch_size"):
        gl.GadgetSampler(10, batch_size=None)


@pytest.mark.parametrize(
    "kw,exc,frag",
    [
        ({"num_replicas": 2}, gl.GadgetValueError, "rank"),
        ({"num_replicas": 2, "rank": 2}, gl.GadgetValueError, "rank"),
        ({"num_replicas": 2, "rank": -1}, gl.GadgetValueError, "rank"),
        ({"num_replicas": 0, "rank": 0}, gl.GadgetValueError, "num_replicas"),
        ({"num_replicas": 2.0, "rank": 0}, gl.GadgetTypeError, "num_replicas"),
        ({"drop_last": True, "pad": True}, gl.GadgetValueError, "exclusive"),
        ({"drop_last": "yes"}, gl.GadgetTypeError, "drop_last"),
        ({"coalesce": 0}, gl.GadgetValueError, "coalesce"),
        ({"window_chunks": 0}, gl.GadgetValueError, "window_chunks"),
        ({"chunk_rows": 1.0}, gl.GadgetTypeError, "chunk_rows"),
    ],
)
def test_sampler_bad_options(kw, exc, frag):
    with pytest.raises(exc, match=frag):
        gl.GadgetSampler(10, batch_size=2, **kw)


def test_sampler_bad_order_names_choices():
    with pytest.raises(gl.GadgetError) as ei:
        gl.GadgetSampler(10, batch_size=2, order="shuffle")
    msg = str(ei.value)
    assert "shuffle" in msg and "random" in msg and "sequential" in msg


def test_window_options_do_not_change_random_or_sequential():
    for order in ("random", "sequential"):
        a = _batches(gl.GadgetSampler(30, batch_size=4, order=order, seed=3))
        b = _batches(
            gl.GadgetSampler(30, batch_size=4, order=order, seed=3, window_chunks=2, chunk_rows=5)
        )
        assert a == b


def test_drop_last_refused_when_no_batch_left_names_sizes():
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetSampler(7, batch_size=4, drop_last=True, num_replicas=2, rank=0)
    assert "7" in str(ei.value) and "4" in str(ei.value)


# ---------------------------------------------------------------------------------------------
# empty dataset, mismatched columns, batch larger than dataset
# ---------------------------------------------------------------------------------------------


def test_empty_dataset_refused():
    with pytest.raises(gl.GadgetValueError, match="0 rows"):
        gl.GadgetDataset(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))


def test_empty_sampler_refused():
    with pytest.raises(gl.GadgetValueError, match="0 rows"):
        gl.GadgetSampler(0, batch_size=2)


def test_empty_loader_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(np.zeros((0, 2), np.float32), batch_size=2)


def test_columns_with_different_rows_refused():
    x, y, _ = _arrays(10)
    with pytest.raises(gl.GadgetValueError, match="rows"):
        gl.GadgetDataset(x, y[:9])


def test_batch_larger_than_dataset_all_forms():
    ds, arrays = _ds(5)
    (b,) = list(DataLoader(ds, batch_size=64))
    assert _check_aligned(b, arrays) == [0, 1, 2, 3, 4]
    assert list(DataLoader(ds, batch_size=64, drop_last=True)) == []
    s = gl.GadgetSampler(ds, batch_size=64, order="sequential")
    assert len(s) == 1 and _batches(s) == [[0, 1, 2, 3, 4]]
    s = gl.GadgetSampler(ds, batch_size=64, order="sequential", pad=True)
    (only,) = _batches(s)
    assert len(only) == 64 and only == [i % 5 for i in range(64)]
    L = gl.GadgetLoader(ds, batch_size=64, order="sequential")
    (b,) = list(L)
    assert _check_aligned(b, arrays) == [0, 1, 2, 3, 4]


def test_column_reloaded_to_other_row_count(tmp_path):
    x, y, _ = _arrays(10)
    g = gl.DataGadget(x, placement="cpu")
    ds = gl.GadgetDataset(g, y, placement="cpu", device="cpu")
    np.save(tmp_path / "a.npy", np.zeros((5, D), np.float32))
    g.loadCupy(str(tmp_path / "a.npy"))
    with pytest.raises(gl.GadgetValueError):
        ds[[0, 1]]


# ---------------------------------------------------------------------------------------------
# indexing the dataset
# ---------------------------------------------------------------------------------------------


def test_dataset_python_indexing():
    ds, (x, y, w) = _ds(10)
    r = ds[-1]
    assert r[0].tolist() == x[9].tolist() and int(r[1]) == y[9]
    b = ds[-3:]
    assert _check_aligned(b, (x, y, w)) == [7, 8, 9]
    b = ds[np.int64(3)]
    assert b[0].tolist() == x[3].tolist() and int(b[1]) == y[3]
    b = ds[range(2, 5)]
    assert _check_aligned(b, (x, y, w)) == [2, 3, 4]
    b = ds[::3]
    assert _check_aligned(b, (x, y, w)) == [0, 3, 6, 9]
    b = ds[torch.tensor(4)]
    assert isinstance(b, gl.GadgetBatch) and b[0].tolist() == x[4].tolist() and b[1].shape == ()
    b = ds[np.array([[0, 1], [2, 3]])]
    assert tuple(b[0].shape) == (2, 2, D)
    np.testing.assert_array_equal(b[1].numpy(), y[[[0, 1], [2, 3]]])


@pytest.mark.parametrize(
    "ids,exc",
    [
        ([10], gl.GadgetIndexError),
        ([-1], gl.GadgetIndexError),
        (10, gl.GadgetIndexError),
        (-11, gl.GadgetIndexError),
        (torch.tensor(10), gl.GadgetIndexError),
        (np.array([0, 12]), gl.GadgetIndexError),
        ([1.5], gl.GadgetTypeError),
        ([True, False], gl.GadgetTypeError),
        (torch.tensor([0.0]), gl.GadgetTypeError),
        (1.0, gl.GadgetTypeError),
    ],
)
def test_dataset_bad_ids(ids, exc):
    ds, arrays = _ds(10)
    with pytest.raises(exc):
        ds[ids]
    if not isinstance(ids, (int, float)):
        with pytest.raises(exc):
            ds.gather(ids)
    # data unchanged after the refusal
    _check_aligned(ds[list(range(10))], arrays, list(range(10)))


def test_getitems_returns_one_element_list():
    ds, arrays = _ds(10)
    out = ds.__getitems__([4, 1, 7])
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], gl.GadgetBatch)
    _check_aligned(out[0], arrays, [4, 1, 7])


# ---------------------------------------------------------------------------------------------
# Subset / random_split / ConcatDataset / StackDataset
# ---------------------------------------------------------------------------------------------


def test_subset_and_random_split():
    ds, arrays = _ds(20)
    idx = [3, 17, 5, 0, 11]
    sub = Subset(ds, idx)
    got = [_check_aligned(b, arrays) for b in DataLoader(sub, batch_size=2)]
    assert got == [[3, 17], [5, 0], [11]]
    a, b = random_split(ds, [12, 8], generator=torch.Generator().manual_seed(0))
    rows = []
    for part in (a, b):
        for batch in DataLoader(part, batch_size=5):
            assert isinstance(batch, gl.GadgetBatch)
            rows += _check_aligned(batch, arrays)
    assert sorted(rows) == list(range(20))


def test_concat_dataset_stacks_samples():
    ds, arrays = _ds(5)
    cat = ConcatDataset([ds, ds])
    got = []
    for batch in DataLoader(cat, batch_size=3):
        assert isinstance(batch, list) and len(batch) == 3
        got += _check_aligned(batch, arrays)
    assert got == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_stack_dataset_refused():
    if not hasattr(torch.utils.data, "StackDataset"):
        pytest.skip("torch without StackDataset")
    ds, _ = _ds(5)
    with pytest.raises(ValueError, match="output size mismatch"):
        list(DataLoader(torch.utils.data.StackDataset(ds, ds), batch_size=2))


# ---------------------------------------------------------------------------------------------
# GadgetBatch
# ---------------------------------------------------------------------------------------------


def test_gadget_batch_tuple_and_to():
    ds, arrays = _ds(6)
    b = ds[[1, 2]]
    x, y, w = b
    assert isinstance(b, tuple) and len(b) == 3
    moved = b.to("cpu")
    assert isinstance(moved, gl.GadgetBatch)
    assert all(m is t or m.data_ptr() == t.data_ptr() for m, t in zip(moved, b, strict=True))
    with pytest.raises(gl.GadgetTypeError, match="device"):
        b.to(torch.float16)
    assert b[1].dtype == torch.int64 and b[0].dtype == torch.float32 and b[2].dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# resume: sampler state_dict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["default", "drop_last", "pad"])
def test_sampler_resume_mid_epoch(mode):
    for cut in (0, 1, 3):
        _check_resume(mode, cut)


def _check_resume(mode, cut):
    kw = dict(batch_size=3, **_mode_kw(mode))
    a = gl.GadgetSampler(20, seed=9, **kw)
    _batches(a)  # epoch 0 done
    ref = gl.GadgetSampler(20, seed=9, **kw)
    ref.set_epoch(1)
    full = _batches(ref)
    it = iter(a)
    head = [next(it).tolist() for _ in range(cut)]
    state = a.state_dict()
    b = gl.GadgetSampler(20, seed=12345, **kw)  # a different seed: the state's seed wins
    b.load_state_dict(state)
    assert b.seed == 9 and b.epoch == 1
    rest = _batches(b)
    assert head + rest == full
    assert b.epoch == 2


def test_sampler_state_after_last_batch_gives_empty_pass():
    a = gl.GadgetSampler(10, batch_size=3, seed=1)
    states = []
    for _ in a:
        states.append(a.state_dict())
    b = gl.GadgetSampler(10, batch_size=3, seed=1)
    b.load_state_dict(states[-1])
    assert _batches(b) == []
    ref = gl.GadgetSampler(10, batch_size=3, seed=1)
    ref.set_epoch(1)
    assert _batches(b) == _batches(ref)


def test_sampler_state_survives_torch_save(tmp_path):
    a = gl.GadgetSampler(15, batch_size=4, seed=3)
    it = iter(a)
    head = [next(it).tolist()]
    torch.save(a.state_dict(), tmp_path / "s.pt")
    b = gl.GadgetSampler(15, batch_size=4, seed=0)
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert head + _batches(b) == _batches(gl.GadgetSampler(15, batch_size=4, seed=3))


def test_sampler_state_accepts_readonly_mapping_and_refuses_non_mapping():
    a = gl.GadgetSampler(15, batch_size=4, seed=3)
    it = iter(a)
    next(it)
    st = types.MappingProxyType(a.state_dict())
    b = gl.GadgetSampler(15, batch_size=4)
    b.load_state_dict(st)
    assert len(_batches(b)) == 3
    with pytest.raises(gl.GadgetTypeError, match="list"):
        b.load_state_dict([("epoch", 0)])


def test_sampler_state_loads_on_other_rank_same_world():
    a = gl.GadgetSampler(21, batch_size=2, seed=3, num_replicas=3, rank=0)
    it = iter(a)
    next(it), next(it)
    st = a.state_dict()
    b = gl.GadgetSampler(21, batch_size=2, num_replicas=3, rank=2)
    b.load_state_dict(st)
    full = _batches(gl.GadgetSampler(21, batch_size=2, seed=3, num_replicas=3, rank=2))
    assert _batches(b) == full[2:]


def test_sampler_state_mismatch_refused_and_unchanged():
    for other in [
        dict(num_rows=21),
        dict(batch_size=4),
        dict(order="sequential"),
        dict(drop_last=True),
        dict(pad=True),
        dict(num_replicas=2, rank=0),
    ]:
        _check_mismatch(other)


def _check_mismatch(other):
    base = dict(num_rows=20, batch_size=3, order="random")
    a = gl.GadgetSampler(base["num_rows"], batch_size=3, seed=2)
    it = iter(a)
    next(it)
    st = a.state_dict()
    kw = dict(base, **other)
    n = kw.pop("num_rows")
    b = gl.GadgetSampler(n, seed=5, **kw)
    b.set_epoch(4)
    before = b.state_dict()
    with pytest.raises(gl.GadgetValueError):
        b.load_state_dict(st)
    assert b.state_dict() == before
    ref = gl.GadgetSampler(n, seed=5, **kw)
    ref.set_epoch(4)
    assert _batches(b) == _batches(ref)


def test_set_epoch_of_loaded_epoch_keeps_position():
    a = gl.GadgetSampler(20, batch_size=3, seed=2)
    a.set_epoch(5)
    it = iter(a)
    head = [next(it).tolist() for _ in range(2)]
    st = a.state_dict()
    b = gl.GadgetSampler(20, batch_size=3)
    b.load_state_dict(st)
    b.set_epoch(5)  # the DistributedSampler loop does this
    ref = gl.GadgetSampler(20, batch_size=3, seed=2)
    ref.set_epoch(5)
    full = _batches(ref)
    assert head + _batches(b) == full
    c = gl.GadgetSampler(20, batch_size=3)
    c.load_state_dict(st)
    c.set_epoch(6)  # another epoch: from its first batch
    ref.set_epoch(6)
    assert _batches(c) == _batches(ref)


# ---------------------------------------------------------------------------------------------
# resume: GadgetLoader state_dict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("cut", [1, 4])
def test_loader_resume_counts_handed_out(prefetch, cut):
    ds, arrays = _ds(23)
    want = _batches(gl.GadgetSampler(23, batch_size=4, seed=7))
    L = gl.GadgetLoader(ds, batch_size=4, seed=7, prefetch=prefetch)
    it = iter(L)
    head = [_ids_of(next(it)) for _ in range(cut)]
    st = L.state_dict()
    del it
    L2 = gl.GadgetLoader(ds, batch_size=4, seed=0, prefetch=prefetch)
    L2.load_state_dict(st)
    assert head + [_check_aligned(b, arrays) for b in L2] == want


def test_loader_state_after_loop_points_at_next_epoch():
    ds, arrays = _ds(10)
    L = gl.GadgetLoader(ds, batch_size=3, seed=1)
    inside = None
    for _ in L:
        inside = L.state_dict()
    after = L.state_dict()
    ref = gl.GadgetSampler(10, batch_size=3, seed=1)
    ref.set_epoch(1)
    e1 = _batches(ref)
    L2 = gl.GadgetLoader(ds, batch_size=3)
    L2.load_state_dict(after)
    assert [_ids_of(b) for b in L2] == e1
    L3 = gl.GadgetLoader(ds, batch_size=3)
    L3.load_state_dict(inside)
    assert [_ids_of(b) for b in L3] == []
    assert [_ids_of(b) for b in L3] == e1


def test_loader_set_epoch():
    ds, arrays = _ds(17)
    L = gl.GadgetLoader(ds, batch_size=5, seed=3)
    L.set_epoch(4)
    ref = gl.GadgetSampler(17, batch_size=5, seed=3)
    ref.set_epoch(4)
    assert [_ids_of(b) for b in L] == _batches(ref)
    with pytest.raises(gl.GadgetValueError):
        L.set_epoch(-1)
    ref.set_epoch(5)
    assert [_ids_of(b) for b in L] == _batches(ref)  # refused epoch changed nothing


def test_loader_load_state_refuses_non_mapping():
    ds, _ = _ds(10)
    L = gl.GadgetLoader(ds, batch_size=3)
    with pytest.raises(gl.GadgetTypeError):
        L.load_state_dict(["not", "a", "mapping"])


def test_stateful_dataloader_resume():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds, arrays = _ds(19)
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    dl = sdl.StatefulDataLoader(ds, batch_sampler=s)
    it = iter(dl)
    head = [_ids_of(next(it)) for _ in range(2)]
    st = dl.state_dict()
    s2 = gl.GadgetSampler(ds, batch_size=4, seed=0)
    dl2 = sdl.StatefulDataLoader(ds, batch_sampler=s2)
    dl2.load_state_dict(st)
    want = _batches(gl.GadgetSampler(19, batch_size=4, seed=5))
    assert head + [_ids_of(b) for b in dl2] == want


# ---------------------------------------------------------------------------------------------
# chunk order over file-backed columns
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chunked_h5(tmp_path_factory):
    h5py = pytest.importorskip("h5py")
    n = 103
    x, y, _ = _arrays(n)
    path = tmp_path_factory.mktemp("chunk") / "f.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(8, D))
    return str(path), x, y


@pytest.mark.parametrize("R", [1, 2, 3])
def test_chunk_order_covers_rows_once_and_keeps_chunks_in_windows(chunked_h5, R):
    path, x, y = chunked_h5
    ds = gl.GadgetDataset(path, y, placement="file", device="cpu")
    try:
        assert ds.chunk_rows == 8
        n, B, W = len(ds), 5, 2
        rows, lens = [], set()
        for r in range(R):
            kw = dict(batch_size=B, order="chunk", window_chunks=W, num_replicas=R, rank=r, seed=3)
            s = gl.GadgetSampler(ds, **kw)
            want = _batches(gl.GadgetSampler(ds, **kw))
            got = []
            for b in DataLoader(ds, batch_sampler=s):
                ids = _ids_of(b)
                np.testing.assert_array_equal(b[0].numpy(), x[ids])
                np.testing.assert_array_equal(b[1].numpy(), y[ids])
                got.append(ids)
            assert got == want and len(s) == len(got)
            lens.add(len(s))
            rows += sum(got, [])
        assert len(lens) == 1
        assert sorted(rows) == list(range(n))
        order = gl.GadgetSampler(
            ds, batch_size=B, order="chunk", window_chunks=W, seed=3
        ).epoch_order(0)
        order = order.tolist()
        assert sorted(order) == list(range(n)) and order != list(range(n))
        pos = {}
        for p, row in enumerate(order):
            pos.setdefault(row // 8, []).append(p)
        for c, ps in pos.items():
            # "All rows of a chunk are therefore requested within one window
            #  (window_chunks * chunk_rows consecutive positions)"
            assert max(ps) - min(ps) < W * 8, c
    finally:
        ds.close()


def test_chunk_order_loader_and_state_layout(chunked_h5):
    path, x, y = chunked_h5
    ds = gl.GadgetDataset(path, y, placement="file", device="cpu")
    try:
        kw = dict(batch_size=5, order="chunk", window_chunks=2, seed=3)
        want = _batches(gl.GadgetSampler(ds, **kw))
        L = gl.GadgetLoader(ds, **kw)
        got = []
        for b in L:
            ids = _ids_of(b)
            np.testing.assert_array_equal(b[1].numpy(), y[ids])
            got.append(ids)
        assert got == want
        st = gl.GadgetSampler(ds, **kw).state_dict()
        for other in (dict(kw, window_chunks=3), dict(kw, chunk_rows=4)):
            s = gl.GadgetSampler(ds, **other)
            before = s.state_dict()
            with pytest.raises(gl.GadgetValueError):
                s.load_state_dict(st)
            assert s.state_dict() == before
    finally:
        ds.close()


def test_random_state_loads_into_sampler_with_other_window_options():
    a = gl.GadgetSampler(30, batch_size=4, seed=3, window_chunks=5, chunk_rows=7)
    it = iter(a)
    head = [next(it).tolist()]
    b = gl.GadgetSampler(30, batch_size=4)
    b.load_state_dict(a.state_dict())
    assert head + _batches(b) == _batches(gl.GadgetSampler(30, batch_size=4, seed=3))


def test_npy_path_column_file_placement(tmp_path):
    x, y, w = _arrays(21)
    np.save(tmp_path / "x.npy", x)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), y, w, placement="file", device="cpu")
    try:
        got = []
        for b in DataLoader(
            ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
        ):
            got += _check_aligned(b, (x, y, w))
        assert sorted(got) == list(range(21))
    finally:
        ds.close()


# ---------------------------------------------------------------------------------------------
# batches changed in place, read-ahead, writes, passes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["torch", "numpy"])
def test_changed_sampler_batch_is_range_checked_for_cpu_columns(via):
    ds, arrays = _ds(40)
    s = gl.GadgetSampler(ds, batch_size=4, seed=1)
    b = next(iter(s))
    if via == "torch":
        b[0] = 100
    else:
        b.numpy()[0] = 100
    with pytest.raises(gl.GadgetIndexError, match="100"):
        ds[b]
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(b)
    _check_aligned(ds[list(range(40))], arrays, list(range(40)))


def test_interleaved_coalesced_loaders_give_right_rows():
    ds, arrays = _ds(40)
    s1 = gl.GadgetSampler(ds, batch_size=3, seed=1, coalesce=4)
    s2 = gl.GadgetSampler(ds, batch_size=3, seed=2, coalesce=4)
    w1 = _batches(gl.GadgetSampler(40, batch_size=3, seed=1))
    w2 = _batches(gl.GadgetSampler(40, batch_size=3, seed=2))
    g1, g2 = [], []
    for a, c in zip(
        DataLoader(ds, batch_sampler=s1), DataLoader(ds, batch_sampler=s2), strict=True
    ):
        g1.append(_check_aligned(a, arrays))
        g2.append(_check_aligned(c, arrays))
    assert g1 == w1 and g2 == w2


@pytest.mark.parametrize("coalesce", [1, 4])
def test_changing_yielded_rows_in_place_changes_nothing_else(coalesce):
    ds, arrays = _ds(40)
    s = gl.GadgetSampler(ds, batch_size=3, seed=1, coalesce=coalesce)
    want = _batches(gl.GadgetSampler(40, batch_size=3, seed=1))
    got = []
    for b in DataLoader(ds, batch_sampler=s):
        got.append(_check_aligned(b, arrays))
        for t in b:
            t.zero_()
    assert got == want
    _check_aligned(ds[list(range(40))], arrays, list(range(40)))


def test_writes_seen_with_coalesce_1_and_prefetch_0():
    n = 16
    x, y, _ = _arrays(n)
    for form in ("sampler", "loader"):
        g = gl.DataGadget(x.copy(), placement="cpu")
        ds = gl.GadgetDataset(g, y, placement="cpu", device="cpu")
        if form == "sampler":
            it = DataLoader(
                ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=1)
            )
        else:
            it = gl.GadgetLoader(ds, batch_size=4, order="sequential", prefetch=0)
        seen = []
        for i, b in enumerate(it):
            seen.append(b[0][:, 0].tolist())
            nxt = list(range((i + 1) * 4, min(n, (i + 2) * 4)))
            if nxt:
                g.insertData(torch.full((len(nxt), D), -5.0), nxt)
        assert seen[0] == [0.0, 3.0, 6.0, 9.0]
        assert all(v == [-5.0] * 4 for v in seen[1:]), (form, seen)


def test_older_pass_no_longer_moves_state():
    s = gl.GadgetSampler(20, batch_size=3, seed=1)
    full = _batches(gl.GadgetSampler(20, batch_size=3, seed=1))
    it1 = iter(s)
    assert next(it1).tolist() == full[0]
    it2 = iter(s)
    assert s.state_dict()["position"] == 0 and s.state_dict()["epoch"] == 0
    assert next(it1).tolist() == full[1]  # still yields its batches
    assert s.state_dict()["position"] == 0
    assert next(it2).tolist() == full[0]
    assert s.state_dict()["position"] == 1


def test_last_epoch_then_refused():
    s = gl.GadgetSampler(5, batch_size=3, seed=1)
    s.set_epoch(2**64 - 1)
    assert sorted(sum(_batches(s), [])) == list(range(5))
    with pytest.raises(gl.GadgetValueError, match="epoch"):
        list(s)


def test_sampler_batch_pickles_as_its_own_ids():
    s = gl.GadgetSampler(2**16, batch_size=4, seed=1)
    b = next(iter(s))
    data = pickle.dumps(b)
    assert len(data) < 4096 < b.untyped_storage().nbytes()
    assert pickle.loads(data).tolist() == b.tolist()


def test_loader_over_shared_sampler_follows_its_load_state_dict():
    ds, arrays = _ds(50)
    want = _batches(gl.GadgetSampler(50, batch_size=3, seed=5))
    a = gl.GadgetSampler(ds, batch_size=3, seed=5)
    it = iter(a)
    for _ in range(4):
        next(it)
    st = a.state_dict()
    s2 = gl.GadgetSampler(ds, batch_size=3, seed=0)
    L = gl.GadgetLoader(ds, sampler=s2)
    s2.load_state_dict(st)
    assert [_check_aligned(b, arrays) for b in L] == want[4:]


def test_loader_properties_and_pad_ranks():
    ds, arrays = _ds(10)
    L = gl.GadgetLoader(ds, batch_size=3, pad=True, num_replicas=2, rank=1, order="sequential")
    assert (
        L.dataset is ds
        and isinstance(L.dataloader, DataLoader)
        and isinstance(L.sampler, gl.GadgetSampler)
    )
    assert len(L) == 2
    assert [_check_aligned(b, arrays) for b in L] == [[6, 7, 8], [9, 0, 1]]
    with pytest.raises(gl.GadgetValueError, match="exclusive"):
        gl.GadgetLoader(ds, batch_size=3, pad=True, drop_last=True)
    with pytest.raises(gl.GadgetValueError, match="chunk"):
        gl.GadgetLoader(ds, batch_size=3, order="chunk")


# ---------------------------------------------------------------------------------------------
# tampered / foreign states, odd constructor arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mod,exc",
    [
        ({"position": 5}, gl.GadgetValueError),
        ({"position": -1}, gl.GadgetValueError),
        ({"position": 1.0}, gl.GadgetTypeError),
        ({"epoch": 2**64}, gl.GadgetValueError),
        ({"epoch": -1}, gl.GadgetValueError),
        ({"seed": -1}, gl.GadgetValueError),
        ({"version": 99}, gl.GadgetValueError),
        ("drop_position", gl.GadgetValueError),
    ],
)
def test_sampler_tampered_state_refused_unchanged(mod, exc):
    st = gl.GadgetSampler(10, batch_size=3, seed=5).state_dict()
    if mod == "drop_position":
        st.pop("position")
    else:
        st.update(mod)
    s = gl.GadgetSampler(10, batch_size=3, seed=7)
    s.set_epoch(2)
    before = s.state_dict()
    with pytest.raises(exc):
        s.load_state_dict(st)
    assert s.state_dict() == before


def test_loader_state_for_other_size_refused():
    ds, _ = _ds(10)
    st = gl.GadgetLoader(_ds(11)[0], batch_size=3).state_dict()
    L = gl.GadgetLoader(ds, batch_size=3, seed=2)
    before = L.state_dict()
    with pytest.raises(gl.GadgetValueError, match="size"):
        L.load_state_dict(st)
    assert L.state_dict() == before
    with pytest.raises(gl.GadgetValueError):
        L.load_state_dict({})


@pytest.mark.parametrize("src", [True, 10.0, "10"])
def test_sampler_bad_data_source(src):
    with pytest.raises(gl.GadgetTypeError, match="data_source"):
        gl.GadgetSampler(src, batch_size=2)


def test_sampler_rank_without_num_replicas():
    with pytest.raises(gl.GadgetValueError, match="rank"):
        gl.GadgetSampler(10, batch_size=2, rank=1)
    assert gl.GadgetSampler(10, batch_size=2, rank=0).num_replicas == 1


def test_dataset_constructor_errors():
    with pytest.raises(gl.GadgetValueError, match="column"):
        gl.GadgetDataset()
    with pytest.raises(gl.GadgetError) as ei:
        gl.GadgetDataset(np.zeros((4, 2)), placement="bogus")
    assert "bogus" in str(ei.value) and "cpu" in str(ei.value)


def test_dataset_properties_close_and_pickle():
    x, y, w = _arrays(6)
    g = gl.DataGadget(x, placement="cpu")
    with gl.GadgetDataset(g, y, w, placement="cpu", device="cpu") as ds:
        assert isinstance(ds, gl.GadgetDataset)
        assert len(ds) == 6 and len(ds.columns) == 3 and ds.chunk_rows is None
        assert ds.row_nbytes == D * 4 + 8 + 8
        ds2 = pickle.loads(pickle.dumps(ds))
        _check_aligned(ds2[[5, 0, 2]], (x, y, w), [5, 0, 2])
        b = ds[[]]
        assert tuple(b[0].shape) == (0, D) and tuple(b[1].shape) == (0,)
    ds.close()  # idempotent
    # a DataGadget passed in is not freed
    np.testing.assert_array_equal(g.getData([1, 4]).numpy(), x[[1, 4]])


def test_dataset_explicit_cuda_device_falls_back_on_cpu():
    x, y, _ = _arrays(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        ds = gl.GadgetDataset(x, y, device="cuda")
    b = ds[[3, 1]]
    assert b[0].device.type == "cpu"
    np.testing.assert_array_equal(b[0].numpy(), x[[3, 1]])


def test_tensor_columns_and_2d_labels():
    x = torch.arange(24.0).reshape(8, 3)
    lab = torch.arange(8).reshape(8, 1) * 2
    flags = torch.arange(8) % 2 == 0
    ds = gl.GadgetDataset(x, lab, flags, placement="cpu", device="cpu")
    got = []
    for bx, bl, bf in DataLoader(
        ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3)
    ):
        ids = (bx[:, 0] / 3).long()
        assert torch.equal(bx, x[ids]) and torch.equal(bl, lab[ids]) and torch.equal(bf, flags[ids])
        assert bf.dtype == torch.bool and tuple(bl.shape[1:]) == (1,)
        got += ids.tolist()
    assert sorted(got) == list(range(8))


# ---------------------------------------------------------------------------------------------
# more epoch / pass semantics
# ---------------------------------------------------------------------------------------------


def test_epoch_order_depends_only_on_seed_and_epoch():
    n = 37
    base = gl.GadgetSampler(n, batch_size=1, seed=9).epoch_order(2).tolist()
    for B in (1, 3, 40):
        for kw in ({}, {"drop_last": True}, {"pad": True}):
            for R in (1, 3):
                if kw.get("drop_last") and n < R * B:
                    continue
                for r in range(R):
                    s = gl.GadgetSampler(n, batch_size=B, seed=9, num_replicas=R, rank=r, **kw)
                    assert s.epoch_order(2).tolist() == base, (B, kw, R, r)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_gadgetloader_break_restarts_epoch_even_with_workers(num_workers):
    ds, arrays = _ds(12)
    ref = gl.GadgetSampler(12, batch_size=4, seed=1)
    e0, e1 = _batches(ref), _batches(ref)
    L = gl.GadgetLoader(ds, batch_size=4, seed=1, num_workers=num_workers)
    it = iter(L)
    assert _ids_of(next(it)) == e0[0]
    del it
    # "use GadgetLoader, which counts the batches it handed out"
    assert [_check_aligned(b, arrays) for b in L] == e0
    assert [_check_aligned(b, arrays) for b in L] == e1


def test_all_batches_drawn_without_stopiteration_advances_epoch():
    ref = gl.GadgetSampler(12, batch_size=4, seed=1)
    e0, e1 = _batches(ref), _batches(ref)
    s = gl.GadgetSampler(12, batch_size=4, seed=1)
    it = iter(s)
    assert [next(it).tolist() for _ in range(3)] == e0
    del it
    assert _batches(s) == e1
    ds, arrays = _ds(12)
    L = gl.GadgetLoader(ds, batch_size=4, seed=1)
    it = iter(L)
    assert [_ids_of(next(it)) for _ in range(3)] == e0
    del it
    assert [_ids_of(b) for b in L] == e1


def test_gadgetloader_persistent_workers_epochs():
    ds, arrays = _ds(10)
    ref = gl.GadgetSampler(10, batch_size=4, seed=2)
    e0, e1 = _batches(ref), _batches(ref)
    L = gl.GadgetLoader(ds, batch_size=4, seed=2, num_workers=1, persistent_workers=True)
    assert [_check_aligned(b, arrays) for b in L] == e0
    assert [_check_aligned(b, arrays) for b in L] == e1


def test_single_index_is_tuple_and_batch_size_none_is_list():
    ds, (x, y, w) = _ds(6)
    r = ds[2]
    assert type(r) is tuple or isinstance(r, tuple)
    assert r[0].tolist() == x[2].tolist() and int(r[1]) == y[2] and float(r[2]) == w[2]
    s = gl.GadgetSampler(ds, batch_size=4, order="sequential")
    out = list(DataLoader(ds, sampler=s, batch_size=None))
    assert all(isinstance(b, list) and len(b) == 3 for b in out)
    assert [_check_aligned(b, (x, y, w)) for b in out] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        ({"timeout": -1}, gl.GadgetValueError),
        ({"prefetch_factor": 2}, gl.GadgetValueError),
        ({"no_such_option": 1}, gl.GadgetTypeError),
    ],
)
def test_gadgetloader_dataloader_refusals_are_gadget_errors(kwargs, exc):
    ds, _ = _ds(10)
    with pytest.raises(exc, match=next(iter(kwargs))):
        gl.GadgetLoader(ds, batch_size=3, **kwargs)


def test_sampler_for_other_size_refused_by_dataset():
    ds, _ = _ds(10)
    s = gl.GadgetSampler(20, batch_size=4, seed=1)
    with pytest.raises((gl.GadgetIndexError, gl.GadgetValueError)):
        list(DataLoader(ds, batch_sampler=s))
    with pytest.raises(gl.GadgetValueError, match="20"):
        list(gl.GadgetLoader(ds, sampler=gl.GadgetSampler(20, batch_size=4)))


# ---------------------------------------------------------------------------------------------
# torch.distributed: ranks read from the group (two gloo processes on the CPU)
# ---------------------------------------------------------------------------------------------

_DIST_SCRIPT = r"""
import os, sys, json
import torch.distributed as dist, torch.multiprocessing as mp

def work(rank, world, init, out):
    import gadgetloader as gl
    before = gl.GadgetSampler(11, batch_size=2, order="sequential")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    res = {}
    s = gl.GadgetSampler(11, batch_size=2, order="sequential")
    res["nr"] = [s.num_replicas, s.rank]
    res["batches"] = [b.tolist() for b in s]
    res["before"] = [before.num_replicas, before.rank, len(before)]
    try:
        gl.GadgetSampler(11, batch_size=2, num_replicas=1)
        res["nr1"] = "ok"
    except Exception as e:
        res["nr1"] = type(e).__name__
    s1 = gl.GadgetSampler(11, batch_size=2, num_replicas=1, rank=0, order="sequential")
    res["all"] = [b.tolist() for b in s1]
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    out = sys.argv[1]
    mp.spawn(work, args=(2, "file://" + os.path.join(out, "init"), out), nprocs=2)
"""


def test_ranks_from_torch_distributed(tmp_path):
    import json
    import os
    import subprocess
    import sys

    if not torch.distributed.is_available():
        pytest.skip("torch without torch.distributed")
    script = tmp_path / "d.py"
    script.write_text(_DIST_SCRIPT)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
    )
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert [r["nr"] for r in res] == [[2, 0], [2, 1]]
    ref = _ref_positions(11, 2, 2, "default")
    assert [r["batches"] for r in res] == ref
    # built before init_process_group: one rank, every row
    assert [r["before"] for r in res] == [[1, 0, 6], [1, 0, 6]]
    # num_replicas=1 without rank takes the rank from the group: refused on rank 1
    assert res[0]["nr1"] == "ok" and res[1]["nr1"] == "GadgetValueError"
    assert res[0]["all"] == res[1]["all"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10]]


# ---------------------------------------------------------------------------------------------
# last edges
# ---------------------------------------------------------------------------------------------


def test_numpy_scalar_and_zero_d_indexing():
    ds, (x, y, w) = _ds(10)
    assert ds[np.int64(-1)][0].tolist() == x[9].tolist()
    assert ds[np.int32(-10)][0].tolist() == x[0].tolist()
    with pytest.raises(gl.GadgetIndexError):
        ds[np.int64(-11)]
    with pytest.raises(gl.GadgetIndexError):
        ds[torch.tensor(-1)]  # a 0-d tensor is an id: [0, len(ds))
    b = ds[np.array(3)]
    assert isinstance(b, gl.GadgetBatch) and b[0].tolist() == x[3].tolist()
    with pytest.raises(gl.GadgetValueError):
        ds[::0]
    assert tuple(ds[8:2][0].shape) == (0, D)


@pytest.mark.parametrize("coalesce", [1, 4])
def test_dataloader_sampler_form_resume(coalesce):
    ds, arrays = _ds(31)
    want = _batches(gl.GadgetSampler(31, batch_size=3, seed=8))
    s = gl.GadgetSampler(ds, batch_size=3, seed=8, coalesce=coalesce)
    it = iter(DataLoader(ds, batch_sampler=s))
    head = [_check_aligned(next(it), arrays) for _ in range(5)]
    st = s.state_dict()
    assert st["position"] == 5 and st["epoch"] == 0
    del it
    s2 = gl.GadgetSampler(ds, batch_size=3, seed=0, coalesce=coalesce)
    s2.load_state_dict(st)
    assert head + [_check_aligned(b, arrays) for b in DataLoader(ds, batch_sampler=s2)] == want


def test_set_epoch_wins_over_loader_left_mid_epoch():
    ds, arrays = _ds(10)
    s = gl.GadgetSampler(ds, batch_size=3, seed=4)
    L = gl.GadgetLoader(ds, sampler=s)
    it = iter(L)
    next(it)
    del it
    s.set_epoch(5)
    assert s.state_dict()["epoch"] == 5 and s.state_dict()["position"] == 0
    ref = gl.GadgetSampler(10, batch_size=3, seed=4)
    ref.set_epoch(5)
    assert [_check_aligned(b, arrays) for b in L] == _batches(ref)


def test_chunk_rows_of_two_file_columns(tmp_path):
    pytest.importorskip("h5py")
    for a, b, want in [(6, 4, 12), (8, 6, 8), (8, 16, 16), (3, 5, 5)]:
        _check_two_chunks(tmp_path, a, b, want)


def _check_two_chunks(tmp_path, a, b, want):
    import h5py

    n = 48
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x", data=np.zeros((n, 2), np.float32), chunks=(a, 2))
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f.create_dataset("y", data=np.zeros(n), chunks=(b,))
    ds = gl.GadgetDataset(
        str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), placement="file", device="cpu"
    )
    try:
        # least common multiple when at most twice the largest, else the largest
        assert ds.chunk_rows == want
        assert gl.GadgetSampler(ds, batch_size=4, order="chunk").chunk_rows == want
    finally:
        ds.close()
