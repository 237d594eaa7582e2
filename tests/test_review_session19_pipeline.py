"""Review probes (session 19): README "Input pipeline: GPU batches from DataLoader".

An independent user's checks of GadgetDataset / GadgetSampler / GadgetLoader against
numpy references: every row exactly once per epoch, values equal to numpy, sharding,
resume equal to an uninterrupted run, and the documented errors for bad input.
"""

from __future__ import annotations

import itertools
import math
import pickle
import types
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, StackDataset, Subset, random_split

import gadgetloader as gl

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _ds(n: int = 23, width: int = 3, seed: int = 0) -> tuple[gl.GadgetDataset, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, width)).astype(np.float32)
    return gl.GadgetDataset(x, np.arange(n), placement="cpu", device="cpu"), x


def _ids(batches) -> list[list[int]]:
    return [b.tolist() for b in batches]


# ---------------------------------------------------------------------------------------------
# GadgetDataset indexing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index",
    [
        [1, 2],
        [0],
        np.array([4, 0, 4], dtype=np.int32),
        np.array([3, 1], dtype=np.int64),
        np.array([3, 1], dtype=np.uint8),
        torch.tensor([5, 2], dtype=torch.int32),
        torch.tensor([5, 2]),
        range(9, -1, -3),
        np.array([[0, 1], [2, 3]]),
        (3, 4),
        [np.int64(3), 4],
    ],
    ids=lambda v: type(v).__name__ + str(getattr(v, "dtype", "")),
)
def test_ds_ids_match_numpy(index) -> None:
    ds, x = _ds(10)
    b = ds[index]
    ref = np.asarray(list(index) if isinstance(index, (range, tuple, list)) else index).astype(
        np.int64
    )
    assert isinstance(b, gl.GadgetBatch) and len(b) == 2
    np.testing.assert_array_equal(b[0].numpy(), x[ref])
    np.testing.assert_array_equal(b[1].numpy(), np.arange(10)[ref])
    assert tuple(b[0].shape) == ref.shape + (3,)


def test_ds_single_int_and_slices_follow_python() -> None:
    ds, x = _ds(10)
    for i in (0, 3, 9, -1, -10):
        row, label = ds[i]
        np.testing.assert_array_equal(row.numpy(), x[i])
        assert label.shape == () and label.item() == np.arange(10)[i]
    for sl in (slice(None), slice(-3, None), slice(None, None, -1), slice(1, 9, 3), slice(5, 2)):
        b = ds[sl]
        np.testing.assert_array_equal(b[0].numpy(), x[sl])
        np.testing.assert_array_equal(b[1].numpy(), np.arange(10)[sl])


def test_ds_empty_ids_give_empty_batch() -> None:
    ds, _ = _ds(10)
    for empty in ([], np.array([], dtype=np.int64), torch.tensor([], dtype=torch.long)):
        b = ds[empty]
        assert tuple(b[0].shape) == (0, 3) and tuple(b[1].shape) == (0,)


@pytest.mark.parametrize(
    "index, exc, words",
    [
        (10, gl.GadgetIndexError, "10"),
        (-11, gl.GadgetIndexError, "-11"),
        ([10], gl.GadgetIndexError, "10"),
        ([0, -1], gl.GadgetIndexError, "-1"),
        (np.array([-1]), gl.GadgetIndexError, "-1"),
        (torch.tensor([10]), gl.GadgetIndexError, "10"),
        (np.array([10], dtype=np.int32), gl.GadgetIndexError, "10"),
        ([2**64], gl.GadgetIndexError, "2**63"),
        ([1.0], gl.GadgetTypeError, "integer"),
        ([True, 1], gl.GadgetTypeError, "bool"),
        (torch.tensor([True, False]), gl.GadgetTypeError, "bool"),
        (np.array([1.5]), gl.GadgetTypeError, "float"),
        (torch.tensor([3.0]), gl.GadgetTypeError, "float"),
        ("a", gl.GadgetTypeError, "str"),
        (3.0, gl.GadgetTypeError, "float"),
        ([3, [4]], gl.GadgetTypeError, "ragged"),
    ],
)
def test_ds_bad_ids_give_documented_errors(index, exc, words) -> None:
    ds, x = _ds(10)
    before = x.copy()
    with pytest.raises(exc) as ei:
        ds[index]
    assert words in str(ei.value)
    assert isinstance(ei.value, gl.GadgetError)
    np.testing.assert_array_equal(ds[range(10)][0].numpy(), before)


def test_ds_getitems_bad_ids_same_errors_as_getitem() -> None:
    """The default form's fast struct path must refuse what the general path refuses."""
    ds, _ = _ds(10)
    for bad, exc in [
        ([10], gl.GadgetIndexError),
        ([-1], gl.GadgetIndexError),
        ([2**63], gl.GadgetIndexError),
        ([2**70, -(2**70)], gl.GadgetIndexError),  # sum() in range, elements not
        ([True, 0], gl.GadgetTypeError),
        ([np.bool_(True)], gl.GadgetTypeError),
        ([0, 1.0], gl.GadgetTypeError),
    ]:
        with pytest.raises(exc):
            ds.__getitems__(bad)


def test_ds_getitems_returns_one_element_list_matching_numpy() -> None:
    ds, x = _ds(10)
    out = ds.__getitems__([9, 0, 9, 3])
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], gl.GadgetBatch)
    np.testing.assert_array_equal(out[0][0].numpy(), x[[9, 0, 9, 3]])


@pytest.mark.parametrize(
    "name",
    [
        "f64",
        "fortran",
        "strided",
        "neg_stride",
        "bool",
        "int32",
        "int8",
        "uint8",
        "3d_f16",
        "torch_strided",
        "bf16",
    ],
)
def test_ds_column_dtypes_and_layouts_match_numpy(name) -> None:
    rng = np.random.default_rng(1)
    base = rng.standard_normal((6, 8))
    cols = {
        "f64": base,
        "fortran": np.asfortranarray(base.astype(np.float32)),
        "strided": base.astype(np.float32)[:, ::2],
        "neg_stride": base[::-1],
        "bool": base > 0,
        "int32": (base * 10).astype(np.int32),
        "int8": (base * 10).astype(np.int8),
        "uint8": (np.abs(base) * 10).astype(np.uint8),
        "3d_f16": rng.standard_normal((6, 2, 3)).astype(np.float16),
        "torch_strided": torch.from_numpy(base.astype(np.float32)).t().contiguous().t()[:, 1::3],
        "bf16": torch.from_numpy(base.astype(np.float32)).to(torch.bfloat16),
    }
    col = cols[name]
    ref = col if isinstance(col, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(col))
    ds = gl.GadgetDataset(col, np.arange(6, dtype=np.int32), placement="cpu", device="cpu")
    ids = [5, 0, 3, 3]
    b = ds[ids]
    assert b[0].dtype == ref.dtype
    assert torch.equal(b[0], ref[ids])
    assert b[1].dtype == torch.int32
    assert torch.equal(ds[2][0], ref[2])


# ---------------------------------------------------------------------------------------------
# GadgetDataset construction errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cols, exc, words",
    [
        ((np.zeros((5, 2), np.float32), np.zeros(4)), gl.GadgetValueError, "5"),
        ((np.zeros((0, 2), np.float32),), gl.GadgetValueError, "0 rows"),
        ((np.zeros((0, 2), np.float32), np.zeros(0)), gl.GadgetValueError, "0 rows"),
        ((), gl.GadgetValueError, "column"),
        ((None,), gl.GadgetTypeError, "NoneType"),
        (([1, 2, 3],), gl.GadgetTypeError, "list"),
        ((torch.tensor(3.0),), gl.GadgetValueError, "0-d"),
        ((np.array(["a", "b"]),), gl.GadgetTypeError, "dtype"),
        ((np.zeros(3, np.complex64),), gl.GadgetTypeError, "complex"),
        (("/nonexistent/dir/x.npy",), gl.GadgetFileNotFoundError, "x.npy"),
    ],
)
def test_ds_bad_columns(cols, exc, words) -> None:
    with pytest.raises(exc) as ei:
        gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    assert words in str(ei.value)


def test_ds_mismatch_message_names_both_counts() -> None:
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetDataset(np.zeros((5, 2), np.float32), np.zeros(4), placement="cpu", device="cpu")
    assert "5" in str(ei.value) and "4" in str(ei.value)


def test_ds_mismatched_datagadget_refused() -> None:
    g = gl.DataGadget(np.zeros((10, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(g, np.arange(9), device="cpu")
    # the gadget is untouched
    assert g.shape == (10, 2)


def test_ds_column_reloaded_to_other_row_count_raises(tmp_path) -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "small.npy", x[:7])
    g = gl.DataGadget(str(tmp_path / "x.npy"), placement="cpu")
    ds = gl.GadgetDataset(g, np.arange(10), device="cpu")
    np.testing.assert_array_equal(ds[[1, 9]][0].numpy(), x[[1, 9]])
    g.load(str(tmp_path / "small.npy"))
    with pytest.raises(gl.GadgetValueError):
        ds[[1]]
    with pytest.raises(gl.GadgetValueError):
        ds.__getitems__([1, 2])


def test_ds_paths_and_arrays_mix(tmp_path) -> None:
    """README: ``gl.GadgetDataset("features.npy", labels)``."""
    x = np.random.default_rng(3).standard_normal((12, 5)).astype(np.float32)
    np.save(tmp_path / "features.npy", x)
    labels = np.arange(12) % 3
    ds = gl.GadgetDataset(str(tmp_path / "features.npy"), labels, placement="cpu", device="cpu")
    assert len(ds) == 12
    seen = []
    for xb, yb in DataLoader(ds, batch_size=5, shuffle=True):
        assert xb.shape[1:] == (5,)
        # find rows by value: every row exactly once, labels aligned
        for row, lab in zip(xb.numpy(), yb.numpy(), strict=True):
            i = int(np.flatnonzero((x == row).all(1))[0])
            assert labels[i] == lab
            seen.append(i)
    assert sorted(seen) == list(range(12))


def test_ds_file_placement_column(tmp_path) -> None:
    x = np.random.default_rng(4).standard_normal((30, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), np.arange(30), placement="file", device="cpu")
    assert ds.columns[0].placement == "file"
    seen = []
    for xb, yb in DataLoader(ds, batch_size=7, shuffle=True):
        np.testing.assert_array_equal(xb.numpy(), x[yb.numpy()])
        seen += yb.tolist()
    assert sorted(seen) == list(range(30))


def test_ds_close_frees_owned_only() -> None:
    g = gl.DataGadget(np.arange(6, dtype=np.float32).reshape(3, 2), placement="cpu")
    own = np.ones((3, 1), np.float32)
    ds = gl.GadgetDataset(g, own, device="cpu")
    ds.close()
    ds.close()  # idempotent
    assert torch.equal(g.getData(torch.tensor([2])).cpu(), torch.tensor([[4.0, 5.0]]))
    with pytest.raises(gl.GadgetClosedError):
        ds[[0]]


# ---------------------------------------------------------------------------------------------
# DataLoader: default form and torch wrappers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_default_form_every_row_once_values_equal(drop_last) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((23, 4)).astype(np.float32)
    y = np.arange(23) * 10
    w = rng.random(23)
    ds = gl.GadgetDataset(x, y, w, placement="cpu", device="cpu")
    seen = []
    nb = 0
    for bx, by, bw in DataLoader(ds, batch_size=5, shuffle=True, drop_last=drop_last):
        ids = by.numpy() // 10
        assert bx.dtype == torch.float32 and bw.dtype == torch.float64 and by.dtype == torch.int64
        np.testing.assert_array_equal(bx.numpy(), x[ids])
        np.testing.assert_array_equal(bw.numpy(), w[ids])
        seen += ids.tolist()
        nb += 1
    if drop_last:
        assert nb == 4 and len(set(seen)) == 20
    else:
        assert sorted(seen) == list(range(23))


def test_default_form_batch_is_gadget_batch_and_custom_collate_gets_list() -> None:
    ds, x = _ds(10)
    b = next(iter(DataLoader(ds, batch_size=4)))
    assert isinstance(b, gl.GadgetBatch)
    np.testing.assert_array_equal(b[0].numpy(), x[:4])
    got = []

    def collate(batch):
        got.append(batch)
        return batch[0]

    b = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate)))
    assert isinstance(got[0], list) and len(got[0]) == 1
    np.testing.assert_array_equal(b[0].numpy(), x[:4])


def test_default_form_single_row_and_batch_larger_than_dataset() -> None:
    x = np.array([[1.5, 2.5]], np.float32)
    ds = gl.GadgetDataset(x, np.array([7]), placement="cpu", device="cpu")
    out = list(DataLoader(ds, batch_size=4096, shuffle=True))
    assert len(out) == 1
    np.testing.assert_array_equal(out[0][0].numpy(), x)
    assert out[0][1].tolist() == [7]
    s = gl.GadgetSampler(ds, batch_size=4096)
    assert _ids(s) == [[0]]
    assert [b[1].tolist() for b in gl.GadgetLoader(ds, batch_size=3)] == [[7]]


def test_subset_and_random_split_pass_batches() -> None:
    ds, x = _ds(15)
    sub = Subset(ds, np.array([3, 1, 7]))
    b = next(iter(DataLoader(sub, batch_size=3)))
    np.testing.assert_array_equal(b[0].numpy(), x[[3, 1, 7]])
    a, _ = random_split(ds, [6, 9], generator=torch.Generator().manual_seed(0))
    seen = []
    for bx, by in DataLoader(a, batch_size=4):
        np.testing.assert_array_equal(bx.numpy(), x[by.numpy()])
        seen += by.tolist()
    assert sorted(seen) == sorted(a.indices)


def test_concat_dataset_gives_stacked_batches() -> None:
    ds, x = _ds(5)
    b = next(iter(DataLoader(ConcatDataset([ds, ds]), batch_size=4, shuffle=False)))
    assert len(b) == 2
    np.testing.assert_array_equal(b[0].numpy(), x[:4])
    assert b[1].tolist() == [0, 1, 2, 3]


def test_stack_dataset_refused_with_output_size_mismatch() -> None:
    ds, _ = _ds(5)
    with pytest.raises(ValueError, match="output size mismatch"):
        next(iter(DataLoader(StackDataset(ds, ds), batch_size=4)))


def test_gadget_batch_to_dtype_refused_and_device_kept() -> None:
    ds, x = _ds(5)
    b = ds[[0, 1]]
    with pytest.raises(gl.GadgetTypeError):
        b.to(torch.float16)
    moved = b.to("cpu")
    assert isinstance(moved, gl.GadgetBatch)
    assert moved[1].dtype == torch.int64
    np.testing.assert_array_equal(moved[0].numpy(), x[:2])


# ---------------------------------------------------------------------------------------------
# Sampler form
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["batch_sampler", "sampler_none"])
@pytest.mark.parametrize("coalesce", [1, 4])
def test_sampler_form_every_row_once(form, coalesce) -> None:
    ds, x = _ds(50)
    s = gl.GadgetSampler(ds, batch_size=6, seed=1, coalesce=coalesce)
    kw = {"batch_sampler": s} if form == "batch_sampler" else {"sampler": s, "batch_size": None}
    ref = gl.GadgetSampler(50, batch_size=6, seed=1)
    for _epoch in range(2):
        want = _ids(ref)
        got = []
        for bx, by in DataLoader(ds, **kw):
            np.testing.assert_array_equal(bx.numpy(), x[by.numpy()])
            got.append(by.tolist())
        assert got == want
        assert sorted(itertools.chain(*got)) == list(range(50))


def test_dataloader_sampler_without_batch_size_none_refused() -> None:
    ds, _ = _ds(10)
    s = gl.GadgetSampler(ds, batch_size=4)
    with pytest.raises(gl.GadgetValueError, match="batch_sampler"):
        next(iter(DataLoader(ds, sampler=s)))


def test_sampler_docstring_examples() -> None:
    assert _ids(gl.GadgetSampler(10, batch_size=4, order="sequential")) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert [
        _ids(gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r))
        for r in (0, 1)
    ] == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert [b[0].tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]


def test_sampler_batches_are_int64() -> None:
    for order in ("random", "sequential"):
        b = next(iter(gl.GadgetSampler(10, batch_size=3, order=order)))
        assert b.dtype == torch.int64 and b.device.type == "cpu"


def test_sampler_orders_depend_only_on_seed_and_epoch() -> None:
    a = gl.GadgetSampler(40, batch_size=7, seed=11)
    b = gl.GadgetSampler(40, batch_size=7, seed=11)
    c = gl.GadgetSampler(40, batch_size=7, seed=12)
    ea = [_ids(a) for _ in range(3)]
    eb = [_ids(b) for _ in range(3)]
    ec = _ids(c)
    assert ea == eb
    assert ea[0] != ea[1] != ea[2]
    assert ea[0] != ec
    for e in ea:
        assert sorted(itertools.chain(*e)) == list(range(40))


_SHARD_CASES = list(
    itertools.product(
        [1, 2, 3, 7, 8, 9, 16, 17, 33],  # rows
        [1, 2, 3, 4],  # ranks
        [1, 2, 4],  # batch size
    )
)


@pytest.mark.parametrize("order", ["random", "sequential"])
@pytest.mark.parametrize("mode", ["default", "drop_last", "pad"])
def test_sampler_sharding_rules(order, mode) -> None:
    """Ranks: equal batch counts, every row once (default), no duplicates (drop_last),
    full batches covering every row (pad); counts as in the docstring formulas."""
    for n, R, B in _SHARD_CASES:
        kw = {"drop_last": mode == "drop_last", "pad": mode == "pad"}
        if (mode == "default" and n < R) or (mode == "drop_last" and n < R * B):
            with pytest.raises(gl.GadgetValueError):
                gl.GadgetSampler(n, batch_size=B, order=order, num_replicas=R, rank=0, **kw)
            continue
        samplers = [
            gl.GadgetSampler(n, batch_size=B, order=order, num_replicas=R, rank=r, seed=3, **kw)
            for r in range(R)
        ]
        outs = [_ids(s) for s in samplers]
        lens = {len(o) for o in outs} | {len(s) for s in samplers}
        assert len(lens) == 1, (n, R, B, lens)
        flat = [i for o in outs for b in o for i in b]
        case = (n, R, B)
        if mode == "default":
            assert sorted(flat) == list(range(n)), case
            assert lens == {math.ceil((n // R) / B)}, case
            for o in outs:
                assert all(len(b) == B for b in o[:-1]), case
                assert 1 <= len(o[-1]) <= B + 1, case
        elif mode == "drop_last":
            assert lens == {n // (R * B)}, case
            assert len(set(flat)) == len(flat), case
            assert all(len(b) == B for o in outs for b in o), case
            assert n - len(flat) < R * B, case
        else:
            assert lens == {math.ceil(n / (R * B))}, case
            assert set(flat) == set(range(n)), case
            assert all(len(b) == B for o in outs for b in o), case
            eo = samplers[0].epoch_order(0).tolist()
            assert flat == [eo[i % n] for i in range(len(flat))], case


def test_sampler_shares_are_contiguous_in_epoch_order() -> None:
    n, B, R = 23, 2, 3
    ss = [gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, seed=1) for r in range(R)]
    flat = [i for s in ss for b in s for i in b.tolist()]
    assert flat == ss[0].epoch_order(0).tolist() == ss[2].epoch_order(0).tolist()


def test_sampler_last_batch_b_plus_one() -> None:
    # n // R == 4 is a multiple of B == 2, n % R == 1: rank 0 ends with a batch of 3
    outs = [
        _ids(gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r))
        for r in range(2)
    ]
    assert [len(b) for b in outs[0]] == [2, 3]
    assert [len(b) for b in outs[1]] == [2, 2]


def test_sampler_drop_last_drops_a_different_set_each_epoch() -> None:
    s = gl.GadgetSampler(23, batch_size=4, drop_last=True, seed=0)
    dropped = [frozenset(set(range(23)) - set(torch.cat(list(s)).tolist())) for _ in range(4)]
    assert all(len(d) == 3 for d in dropped)
    assert len(set(dropped)) > 1


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"batch_size": 0}, gl.GadgetValueError),
        ({"batch_size": -1}, gl.GadgetValueError),
        ({"batch_size": 2.0}, gl.GadgetTypeError),
        ({"batch_size": True}, gl.GadgetTypeError),
        ({"batch_size": 2, "order": "shuffle"}, gl.GadgetKeyError),
        ({"batch_size": 2, "pad": True, "drop_last": True}, gl.GadgetValueError),
        ({"batch_size": 2, "num_replicas": 2, "rank": 2}, gl.GadgetValueError),
        ({"batch_size": 2, "num_replicas": 2, "rank": -1}, gl.GadgetValueError),
        ({"batch_size": 2, "num_replicas": 0, "rank": 0}, gl.GadgetValueError),
        ({"batch_size": 2, "seed": -1}, gl.GadgetValueError),
        ({"batch_size": 2, "seed": 1.5}, gl.GadgetTypeError),
        ({"batch_size": 2, "coalesce": 0}, gl.GadgetValueError),
        ({"batch_size": 2, "drop_last": 1}, gl.GadgetTypeError),
        ({"batch_size": 2, "order": "chunk"}, gl.GadgetValueError),  # no chunk size known
        (
            {"batch_size": 2, "order": "chunk", "chunk_rows": 2, "window_chunks": 0},
            gl.GadgetValueError,
        ),
    ],
)
def test_sampler_bad_arguments(kwargs, exc) -> None:
    with pytest.raises(exc):
        gl.GadgetSampler(10, **kwargs)


@pytest.mark.parametrize("source", [0, -1, True, 9.0, "abc.npy"])
def test_sampler_bad_data_source(source) -> None:
    with pytest.raises(gl.GadgetError) as ei:
        gl.GadgetSampler(source, batch_size=2)
    assert isinstance(ei.value, (TypeError, ValueError))


def test_sampler_empty_dataset_message() -> None:
    with pytest.raises(gl.GadgetValueError, match="empty"):
        gl.GadgetSampler(0, batch_size=4)


def test_sampler_too_few_rows_for_ranks_and_drop_last() -> None:
    with pytest.raises(gl.GadgetValueError, match="pad=True"):
        gl.GadgetSampler(2, batch_size=2, num_replicas=3, rank=0)
    # pad makes it possible: every rank one full batch
    outs = [
        _ids(gl.GadgetSampler(2, batch_size=1, num_replicas=3, rank=r, pad=True)) for r in range(3)
    ]
    assert [len(o) for o in outs] == [1, 1, 1]
    assert set(i for o in outs for b in o for i in b) == {0, 1}
    with pytest.raises(gl.GadgetValueError, match="drop_last"):
        gl.GadgetSampler(3, batch_size=4, drop_last=True)


def test_set_epoch_bad_values() -> None:
    s = gl.GadgetSampler(10, batch_size=3)
    before = s.state_dict()
    with pytest.raises(gl.GadgetValueError):
        s.set_epoch(-1)
    with pytest.raises(gl.GadgetTypeError):
        s.set_epoch(1.0)
    assert s.state_dict() == before


def test_epochs_advance_by_themselves_and_restart_after_break() -> None:
    ref = gl.GadgetSampler(13, batch_size=3, seed=2)
    e0, e1 = _ids(ref), _ids(ref)
    s = gl.GadgetSampler(13, batch_size=3, seed=2)
    it = iter(s)
    next(it)
    next(it)
    del it
    assert _ids(s) == e0  # early break: the same epoch anew
    assert _ids(s) == e1  # full pass: the next epoch
    # calling set_epoch every epoch gives the same result
    s2 = gl.GadgetSampler(13, batch_size=3, seed=2)
    got = []
    for e in range(2):
        s2.set_epoch(e)
        got.append(_ids(s2))
    assert got == [e0, e1]


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"order": "random"},
        {"order": "sequential"},
        {"order": "chunk", "chunk_rows": 4, "window_chunks": 3},
        {"order": "random", "num_replicas": 3, "rank": 1},
        {"order": "random", "num_replicas": 2, "rank": 0, "pad": True},
        {"order": "sequential", "num_replicas": 2, "rank": 1, "drop_last": True},
    ],
    ids=str,
)
def test_sampler_resume_equals_uninterrupted(kw) -> None:
    n, B = 50, 3

    def mk(seed=5):
        return gl.GadgetSampler(n, batch_size=B, seed=seed, **kw)

    ref = mk()
    full = [_ids(ref) for _ in range(3)]
    for ep in range(2):
        for k in range(len(full[ep]) + 1):
            s = mk()
            for _ in range(ep):
                _ids(s)
            it = iter(s)
            part = [next(it).tolist() for _ in range(k)]
            state = pickle.loads(pickle.dumps(s.state_dict()))
            s2 = mk(seed=99)  # the state brings its seed
            s2.load_state_dict(state)
            rest = _ids(s2)
            assert part + rest == full[ep], (ep, k)
            assert [_ids(s2) for _ in range(ep + 1, 3)] == full[ep + 1 :], (ep, k)


def test_state_saved_on_one_rank_loads_on_another() -> None:
    n, B, R = 23, 2, 3
    s0 = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=0, seed=1)
    it = iter(s0)
    next(it)
    next(it)
    s1 = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=1, seed=9)
    s1.load_state_dict(s0.state_dict())
    full = _ids(gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=1, seed=1))
    assert _ids(s1) == full[2:]


def test_state_after_last_batch_gives_empty_pass_then_next_epoch() -> None:
    ref = gl.GadgetSampler(13, batch_size=3, seed=2)
    _ids(ref)
    e1 = _ids(ref)
    s = gl.GadgetSampler(13, batch_size=3, seed=2)
    states = []
    for _b in s:
        states.append(s.state_dict())
    s2 = gl.GadgetSampler(13, batch_size=3, seed=2)
    s2.load_state_dict(states[-1])
    assert _ids(s2) == []
    assert _ids(s2) == e1


def test_set_epoch_after_load_keeps_position() -> None:
    ref = gl.GadgetSampler(13, batch_size=3, seed=2)
    e0, e1 = _ids(ref), _ids(ref)
    s = gl.GadgetSampler(13, batch_size=3, seed=2)
    it = iter(s)
    next(it)
    next(it)
    st = s.state_dict()
    s3 = gl.GadgetSampler(13, batch_size=3, seed=2)
    s3.load_state_dict(st)
    s3.set_epoch(0)
    assert _ids(s3) == e0[2:]
    s4 = gl.GadgetSampler(13, batch_size=3, seed=2)
    s4.load_state_dict(st)
    s4.set_epoch(1)
    assert _ids(s4) == e1


def test_state_follows_latest_pass() -> None:
    s = gl.GadgetSampler(30, batch_size=3, seed=1)
    it1 = iter(s)
    for _ in range(3):
        next(it1)
    it2 = iter(s)
    next(it2)
    assert s.state_dict()["position"] == 1
    next(it1)
    assert s.state_dict()["position"] == 1


@pytest.mark.parametrize(
    "other",
    [
        {"n": 21},
        {"num_replicas": 2, "rank": 0},
        {"batch_size": 4},
        {"order": "sequential"},
        {"drop_last": True},
        {"pad": True},
    ],
    ids=str,
)
def test_state_for_other_settings_refused_and_sampler_unchanged(other) -> None:
    src = gl.GadgetSampler(20, batch_size=3, seed=5)
    it = iter(src)
    next(it)
    next(it)
    state = src.state_dict()
    other = dict(other)
    n = other.pop("n", 20)
    kw = {"batch_size": 3, "seed": 7, **other}
    s = gl.GadgetSampler(n, **kw)
    full = _ids(gl.GadgetSampler(n, **kw))
    it = iter(s)
    first = next(it).tolist()
    before = s.state_dict()
    with pytest.raises(gl.GadgetValueError) as ei:
        s.load_state_dict(state)
    assert "saved for" in str(ei.value)
    assert s.state_dict() == before
    # the pass goes on as if nothing happened
    assert [first] + [b.tolist() for b in it] == full


def test_chunk_layout_mismatch_refused() -> None:
    src = gl.GadgetSampler(40, batch_size=3, order="chunk", chunk_rows=4, window_chunks=3)
    st = src.state_dict()
    for kw in ({"chunk_rows": 5, "window_chunks": 3}, {"chunk_rows": 4, "window_chunks": 2}):
        s = gl.GadgetSampler(40, batch_size=3, order="chunk", **kw)
        before = s.state_dict()
        with pytest.raises(gl.GadgetValueError):
            s.load_state_dict(st)
        assert s.state_dict() == before


def test_malformed_states_refused_and_unchanged() -> None:
    src = gl.GadgetSampler(20, batch_size=3, seed=5)
    st = src.state_dict()
    s = gl.GadgetSampler(20, batch_size=3, seed=7)
    bad = [
        (None, gl.GadgetTypeError),
        ([], gl.GadgetTypeError),
        ("x", gl.GadgetTypeError),
        ({}, gl.GadgetValueError),
        ({**st, "position": 100}, gl.GadgetValueError),
        ({**st, "position": -1}, gl.GadgetValueError),
        ({**st, "position": "1"}, gl.GadgetTypeError),
        ({**st, "epoch": -1}, gl.GadgetValueError),
        ({**st, "seed": -3}, gl.GadgetValueError),
        ({**st, "epoch": 2**64}, gl.GadgetValueError),
        ({**st, "version": 99}, gl.GadgetValueError),
        ({k: v for k, v in st.items() if k != "seed"}, gl.GadgetValueError),
    ]
    want = _ids(gl.GadgetSampler(20, batch_size=3, seed=7))
    for state, exc in bad:
        before = s.state_dict()
        with pytest.raises(exc):
            s.load_state_dict(state)
        assert s.state_dict() == before
    assert _ids(s) == want
    # a read-only mapping is accepted
    s.load_state_dict(types.MappingProxyType(st))
    assert _ids(s) == _ids(gl.GadgetSampler(20, batch_size=3, seed=5))


def test_stateful_dataloader_resumes_exactly() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds, x = _ds(29)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")

        def mk():
            return sdl.StatefulDataLoader(
                ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, seed=3)
            )

        ref = mk()
        e0 = [b[1].tolist() for b in ref]
        e1 = [b[1].tolist() for b in ref]
        for k in range(len(e0) + 1):
            dl = mk()
            it = iter(dl)
            got = [next(it)[1].tolist() for _ in range(k)]
            st = dl.state_dict()
            dl2 = mk()
            dl2.load_state_dict(st)
            assert got + [b[1].tolist() for b in dl2] == e0
            assert [b[1].tolist() for b in dl2] == e1


# ---------------------------------------------------------------------------------------------
# Chunk order
# ---------------------------------------------------------------------------------------------


def test_chunk_order_windows_hold_whole_chunks() -> None:
    n, C, W, B = 50, 4, 3, 5
    s = gl.GadgetSampler(n, batch_size=B, order="chunk", chunk_rows=C, window_chunks=W, seed=1)
    o = torch.cat(list(s)).tolist()
    assert sorted(o) == list(range(n))
    assert o == s.epoch_order(0).tolist()

    # walk the order: each window is the rows of at most W whole chunks
    def size(c):
        return min(C, n - c * C)

    pos = 0
    while pos < n:
        chunks: set[int] = set()
        end = pos
        while end < n:
            chunks.add(o[end] // C)
            end += 1
            assert len(chunks) <= W
            if len(chunks) == W and end - pos == sum(size(c) for c in chunks):
                break
        assert end - pos == sum(size(c) for c in chunks)
        pos = end


def test_chunk_order_ranks_share_at_most_one_window() -> None:
    n, C, W, B, R = 120, 5, 3, 4, 3
    ss = [
        gl.GadgetSampler(
            n,
            batch_size=B,
            order="chunk",
            chunk_rows=C,
            window_chunks=W,
            num_replicas=R,
            rank=r,
            seed=1,
        )
        for r in range(R)
    ]
    ch = [{i // C for i in torch.cat(list(s)).tolist()} for s in ss]
    assert len(ch[0] & ch[1]) <= W and len(ch[1] & ch[2]) <= W
    assert not ch[0] & ch[2]


def test_chunk_rows_from_file_columns(tmp_path) -> None:
    h5py = pytest.importorskip("h5py")
    n = 100
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(6, 2))
        f.create_dataset("y", data=np.arange(n), chunks=(4,))
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f.create_dataset("z", data=x, chunks=(7, 2))
    ga = gl.DataGadget(str(tmp_path / "a.h5"), dataset="x", placement="file")
    gy = gl.DataGadget(str(tmp_path / "a.h5"), dataset="y", placement="file")
    gz = gl.DataGadget(str(tmp_path / "b.h5"), placement="file")
    cases = [((ga,), 6), ((ga, gy), 12), ((ga, gz), 7), ((ga, np.arange(n)), 6)]
    for cols, want in cases:
        ds = gl.GadgetDataset(*cols, device="cpu")
        s = gl.GadgetSampler(ds, batch_size=5, order="chunk", seed=0)
        assert s.chunk_rows == want
        # default window: enough chunks for 16 batches, at least 8
        assert s.window_chunks == max(8, math.ceil(16 * 5 / want))
        seen = []
        for b in gl.GadgetLoader(ds, sampler=s):
            ids = (b[0][:, 0] / 2).long().numpy()
            np.testing.assert_array_equal(b[0].numpy(), x[ids])
            seen += ids.tolist()
        assert sorted(seen) == list(range(n))


def test_chunk_order_reads_each_chunk_once_per_epoch(tmp_path) -> None:
    h5py = pytest.importorskip("h5py")
    n, C, W = 400, 8, 4
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(C, 4), compression="gzip")
    for B in (8, 32):  # 32 == a window
        g = gl.DataGadget(str(tmp_path / "a.h5"), placement="file", cache_bytes=2 * W * C * 16)
        ds = gl.GadgetDataset(g, device="cpu")
        g.store.stats.update(hits=0, misses=0, reads=0)
        s = gl.GadgetSampler(ds, batch_size=B, order="chunk", window_chunks=W, seed=2)
        seen = []
        for b in gl.GadgetLoader(ds, sampler=s):
            np.testing.assert_array_equal(b[0].numpy(), x[(b[0][:, 0] / 4).long().numpy()])
            seen += (b[0][:, 0] / 4).long().tolist()
        assert sorted(seen) == list(range(n))
        assert g.store.stats["misses"] == n // C
        g.close()


# ---------------------------------------------------------------------------------------------
# Sampler ids: tags and in-place changes
# ---------------------------------------------------------------------------------------------


def test_changed_sampler_ids_are_range_checked() -> None:
    ds, x = _ds(13)
    s = gl.GadgetSampler(ds, batch_size=3, seed=2)
    b = next(iter(s))
    b.numpy()[0] = 10**6  # through NumPy: host columns check anyway
    with pytest.raises(gl.GadgetIndexError):
        ds[b]
    s = gl.GadgetSampler(ds, batch_size=3, seed=2)
    b = next(iter(s))
    b[0] = -1  # through torch: the tag is lost
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__(b)
    b2 = next(iter(gl.GadgetSampler(ds, batch_size=3, seed=2)))
    with pytest.raises(gl.GadgetIndexError):
        ds[b2 + 100]
    c = b2.clone()
    c[0] = 13
    with pytest.raises(gl.GadgetIndexError):
        ds[c]


def test_in_place_change_shows_in_replay_of_epoch() -> None:
    """README: changing a batch in place changes that epoch's cached order."""
    s = gl.GadgetSampler(12, batch_size=3, seed=4)
    it = iter(s)
    b = next(it)
    original = b.tolist()
    b[0] = b[1]
    del it
    replay = next(iter(s))  # early break: the same epoch again
    assert replay.tolist() != original
    assert replay.tolist() == b.tolist()


def test_sampler_batch_pickles_as_its_own_ids() -> None:
    s = gl.GadgetSampler(1000, batch_size=4, seed=1)
    b = next(iter(s))
    back = pickle.loads(pickle.dumps(b))
    assert back.tolist() == b.tolist()
    assert back.untyped_storage().nbytes() == 4 * 8


# ---------------------------------------------------------------------------------------------
# GadgetLoader
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inp", ["array", "tensor", "gadget"])
def test_loader_inputs_become_one_column(inp) -> None:
    x = np.random.default_rng(0).standard_normal((21, 3)).astype(np.float32)
    src = {"array": x, "tensor": torch.from_numpy(x), "gadget": gl.DataGadget(x, placement="cpu")}[
        inp
    ]
    out = list(gl.GadgetLoader(src, batch_size=8, order="sequential"))
    assert all(isinstance(b, gl.GadgetBatch) and len(b) == 1 for b in out)
    np.testing.assert_array_equal(torch.cat([b[0] for b in out]).cpu().numpy(), x)


@pytest.mark.parametrize("coalesce", [1, 3, 8])
@pytest.mark.parametrize("mode", ["default", "drop_last", "pad"])
def test_loader_ranks_and_values(coalesce, mode) -> None:
    ds, x = _ds(101)
    kw = {"drop_last": mode == "drop_last", "pad": mode == "pad"}
    R, B = 3, 8
    flat = []
    counts = set()
    for r in range(R):
        L = gl.GadgetLoader(
            ds, batch_size=B, coalesce=coalesce, num_replicas=R, rank=r, seed=5, **kw
        )
        out = list(L)
        counts |= {len(out), len(L)}
        for bx, by in out:
            np.testing.assert_array_equal(bx.numpy(), x[by.numpy()])
            if mode != "default":
                assert len(by) == B
            flat += by.tolist()
    assert len(counts) == 1
    if mode == "default":
        assert sorted(flat) == list(range(101))
    elif mode == "pad":
        assert set(flat) == set(range(101))
    else:
        assert len(set(flat)) == len(flat)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("coalesce", [None, 4])
def test_loader_resume_equals_uninterrupted(num_workers, coalesce) -> None:
    ds, x = _ds(29)
    if num_workers and coalesce:
        pytest.skip("coalesce applies without workers")

    def mk():
        return gl.GadgetLoader(ds, batch_size=4, seed=3, num_workers=num_workers, coalesce=coalesce)

    ref = mk()
    e0 = [b[1].tolist() for b in ref]
    e1 = [b[1].tolist() for b in ref]
    assert e0 != e1
    for k in (0, 1, 3, len(e0) - 1, len(e0)):
        L = mk()
        it = iter(L)
        got = []
        for _ in range(k):
            bx, by = next(it)
            np.testing.assert_array_equal(bx.numpy(), x[by.numpy()])
            got.append(by.tolist())
        st = L.state_dict()
        del it
        L2 = mk()
        L2.load_state_dict(st)
        rest = [b[1].tolist() for b in L2]
        if k == len(e0):
            assert rest == []  # saved after the last batch: an empty pass
        assert got + rest == e0, k
        assert [b[1].tolist() for b in L2] == e1, k


def test_loader_over_sampler_follows_sampler() -> None:
    ds, _ = _ds(29)
    s = gl.GadgetSampler(29, batch_size=4, seed=3)
    L = gl.GadgetLoader(ds, sampler=s)
    s.set_epoch(5)
    ref = gl.GadgetSampler(29, batch_size=4, seed=3)
    ref.set_epoch(5)
    assert [b[1].tolist() for b in L] == _ids(ref)
    assert len(L) == len(s)
    # load_state_dict on the sampler
    src = gl.GadgetSampler(29, batch_size=4, seed=8)
    it = iter(src)
    next(it)
    s.load_state_dict(src.state_dict())
    full = _ids(gl.GadgetSampler(29, batch_size=4, seed=8))
    assert [b[1].tolist() for b in L] == full[1:]


@pytest.mark.parametrize(
    "kw",
    [
        {"seed": 0},
        {"order": "random"},
        {"drop_last": False},
        {"pad": False},
        {"num_replicas": 1},
        {"batch_size": 4},
    ],
    ids=str,
)
def test_loader_sampler_options_with_sampler_refused(kw) -> None:
    ds, _ = _ds(10)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4), **kw)


@pytest.mark.parametrize(
    "kw, exc",
    [
        ({"batch_size": 0}, gl.GadgetValueError),
        ({"batch_size": -2}, gl.GadgetValueError),
        ({"batch_size": 2.0}, gl.GadgetTypeError),
        ({}, gl.GadgetValueError),
        ({"batch_size": 2, "prefetch": -1}, gl.GadgetValueError),
        ({"batch_size": 2, "prefetch": True}, gl.GadgetTypeError),
        ({"batch_size": 2, "coalesce": 0}, gl.GadgetValueError),
        ({"batch_size": 2, "num_workers": -1}, gl.GadgetValueError),
        ({"batch_size": 2, "order": "x"}, gl.GadgetKeyError),
        ({"batch_size": 2, "shuffle": True}, gl.GadgetTypeError),
    ],
    ids=str,
)
def test_loader_bad_arguments(kw, exc) -> None:
    with pytest.raises(exc):
        gl.GadgetLoader(np.zeros((3, 1), np.float32), **kw)


def test_loader_empty_dataset_refused() -> None:
    with pytest.raises(gl.GadgetValueError, match="empty"):
        gl.GadgetLoader(np.zeros((0, 2), np.float32), batch_size=2)


def test_loader_state_for_other_dataset_refused_and_unchanged() -> None:
    ds, _ = _ds(13)
    L = gl.GadgetLoader(ds, batch_size=3, seed=2)
    it = iter(L)
    next(it)
    st = L.state_dict()
    ds12, _ = _ds(12)
    L2 = gl.GadgetLoader(ds12, batch_size=3, seed=2)
    before = L2.state_dict()
    with pytest.raises(gl.GadgetValueError):
        L2.load_state_dict(st)
    assert L2.state_dict() == before
    L3 = gl.GadgetLoader(ds, batch_size=3, seed=2, num_replicas=2, rank=0)
    before = L3.state_dict()
    with pytest.raises(gl.GadgetValueError):
        L3.load_state_dict(st)
    assert L3.state_dict() == before
    before2 = L2.state_dict()
    with pytest.raises(gl.GadgetValueError):
        L2.set_epoch(-1)
    assert L2.state_dict() == before2


def test_loader_prefetch_zero_sees_writes() -> None:
    g = gl.DataGadget(np.zeros((8, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(g, device="cpu")
    L = gl.GadgetLoader(ds, batch_size=2, order="sequential", prefetch=0)
    seen = []
    for k, (b,) in enumerate(L):
        seen.append(b.clone())
        if k < 3:  # write the rows of the next batch before asking for it
            g.insertData(torch.full((2, 2), float(k + 1)), torch.tensor([2 * k + 2, 2 * k + 3]))
    assert len(seen) == 4
    for k in range(1, 4):
        assert torch.equal(seen[k], torch.full((2, 2), float(k)))


# ---------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("column", ["cpu", "file"])
def test_workers_every_row_once(tmp_path, column) -> None:
    x = np.random.default_rng(0).standard_normal((37, 3)).astype(np.float32)
    if column == "file":
        np.save(tmp_path / "x.npy", x)
        ds = gl.GadgetDataset(
            str(tmp_path / "x.npy"), np.arange(37), placement="file", device="cpu"
        )
    else:
        ds = gl.GadgetDataset(x, np.arange(37), placement="cpu", device="cpu")
    makers = [
        lambda: DataLoader(ds, batch_size=5, shuffle=True, num_workers=2),
        lambda: DataLoader(
            ds, batch_sampler=gl.GadgetSampler(ds, batch_size=5, seed=1), num_workers=2
        ),
        lambda: gl.GadgetLoader(ds, batch_size=5, num_workers=2),
    ]
    for mk in makers:
        seen = []
        for bx, by in mk():
            assert bx.device.type == "cpu"
            np.testing.assert_array_equal(bx.numpy(), x[by.numpy()])
            seen += by.tolist()
        assert sorted(seen) == list(range(37))


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_follow_sampler_epochs(persistent) -> None:
    ds, _ = _ds(29)
    ref = gl.GadgetSampler(29, batch_size=4, seed=3)
    want = [_ids(ref) for _ in range(3)]
    s = gl.GadgetSampler(ds, batch_size=4, seed=3)
    dl = DataLoader(ds, batch_sampler=s, num_workers=2, persistent_workers=persistent)
    assert [[b[1].tolist() for b in dl] for _ in range(3)] == want
    L = gl.GadgetLoader(ds, batch_size=4, seed=3, num_workers=2, persistent_workers=persistent)
    assert [[b[1].tolist() for b in L] for _ in range(3)] == want


# ---------------------------------------------------------------------------------------------
# GPU (run on a CUDA machine)
# ---------------------------------------------------------------------------------------------


def _gpu_placements() -> list[str]:
    out = ["cuda"]
    try:
        from gadgetloader._device import cupy_available

        if cupy_available():
            out.append("pinned")
    except Exception:  # pragma: no cover
        pass
    return out


@gpu
@needs_cuda
def test_gpu_default_form_batches_on_gpu_and_equal_numpy() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1000, 16)).astype(np.float32)
    y = np.arange(1000)
    for placement in _gpu_placements():
        ds = gl.GadgetDataset(x, y, placement=placement)
        seen = []
        for bx, by in DataLoader(ds, batch_size=128, shuffle=True):
            assert bx.is_cuda and by.is_cuda
            np.testing.assert_array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
            seen += by.tolist()
        assert sorted(seen) == list(range(1000)), placement


@gpu
@needs_cuda
@pytest.mark.parametrize("coalesce", [None, 1, 5])
@pytest.mark.parametrize("order", ["random", "sequential"])
def test_gpu_sampler_form_read_ahead_values(coalesce, order) -> None:
    rng = np.random.default_rng(8)
    n = 5000
    x = rng.standard_normal((n, 8)).astype(np.float32)
    for placement in _gpu_placements():
        ds = gl.GadgetDataset(x, np.arange(n), placement=placement)
        s = gl.GadgetSampler(ds, batch_size=64, order=order, seed=1, coalesce=coalesce)
        ref = gl.GadgetSampler(n, batch_size=64, order=order, seed=1)
        for _ in range(2):
            want = _ids(ref)
            got = []
            for bx, by in DataLoader(ds, batch_sampler=s):
                assert bx.is_cuda
                np.testing.assert_array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
                got.append(by.tolist())
            assert got == want, (placement, order, coalesce)


@gpu
@needs_cuda
@pytest.mark.parametrize("prefetch", [0, 2])
def test_gpu_loader_values_and_resume(prefetch) -> None:
    rng = np.random.default_rng(9)
    n = 3000
    x = rng.standard_normal((n, 8)).astype(np.float32)
    for placement in _gpu_placements():
        ds = gl.GadgetDataset(x, np.arange(n), placement=placement)

        def mk(ds=ds):
            return gl.GadgetLoader(ds, batch_size=100, seed=2, prefetch=prefetch)

        e0 = []
        for bx, by in mk():
            assert bx.is_cuda
            np.testing.assert_array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
            e0.append(by.tolist())
        assert sorted(itertools.chain(*e0)) == list(range(n))
        for k in (1, 7, 29):
            L = mk()
            it = iter(L)
            got = [next(it)[1].tolist() for _ in range(k)]
            st = L.state_dict()
            del it
            L2 = mk()
            L2.load_state_dict(st)
            assert got + [b[1].tolist() for b in L2] == e0, (placement, k)


@gpu
@needs_cuda
def test_gpu_workers_give_cpu_batches_for_pinned_and_refuse_cuda_columns() -> None:
    x = np.random.default_rng(10).standard_normal((50, 4)).astype(np.float32)
    if "pinned" in _gpu_placements():
        ds = gl.GadgetDataset(x, np.arange(50), placement="pinned")
        seen = []
        for bx, by in DataLoader(
            ds, batch_sampler=gl.GadgetSampler(ds, batch_size=8), num_workers=2
        ):
            assert bx.device.type == "cpu"
            np.testing.assert_array_equal(bx.numpy(), x[by.numpy()])
            seen += by.tolist()
        assert sorted(seen) == list(range(50))
        L = gl.GadgetLoader(ds, batch_size=8, num_workers=2)
        seen = []
        for bx, by in L:
            assert bx.is_cuda  # moved to the GPU by the loader
            np.testing.assert_array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
            seen += by.tolist()
        assert sorted(seen) == list(range(50))
    dsc = gl.GadgetDataset(x, placement="cuda")
    with pytest.raises(Exception) as ei:
        list(DataLoader(dsc, batch_size=8, num_workers=1))
    assert "GPU" in str(ei.value) or "cuda" in str(ei.value)


@gpu
@needs_cuda
def test_gpu_changed_batch_is_checked_on_gpu_columns() -> None:
    x = np.random.default_rng(11).standard_normal((40, 4)).astype(np.float32)
    for placement in _gpu_placements():
        ds = gl.GadgetDataset(x, placement=placement)
        b = next(iter(gl.GadgetSampler(ds, batch_size=4, seed=0)))
        b[0] = 40
        with pytest.raises(gl.GadgetIndexError):
            ds.__getitems__(b)
        ok = next(iter(gl.GadgetSampler(ds, batch_size=4, seed=0))).clone()
        np.testing.assert_array_equal(ds[ok][0].cpu().numpy(), x[ok.numpy()])


@gpu
@needs_cuda
def test_gpu_cuda_ids_checked_and_int32_ids() -> None:
    n = 64
    x = np.random.default_rng(12).standard_normal((n, 4)).astype(np.float32)
    for placement in _gpu_placements():
        ds = gl.GadgetDataset(x, np.arange(n), placement=placement)
        for bad in ([n], [-1]):
            for dtype in (torch.int64, torch.int32):
                with pytest.raises(gl.GadgetIndexError):
                    ds[torch.tensor(bad, dtype=dtype, device="cuda")]
        ids = torch.tensor([5, 0, 63, 5], dtype=torch.int32, device="cuda")
        b = ds[ids]
        assert b[0].is_cuda
        np.testing.assert_array_equal(b[0].cpu().numpy(), x[[5, 0, 63, 5]])
        np.testing.assert_array_equal(ds[np.array([1, 2], np.int32)][1].cpu().numpy(), [1, 2])
        row, label = ds[-1]
        np.testing.assert_array_equal(row.cpu().numpy(), x[-1])
        assert label.item() == n - 1


@gpu
@needs_cuda
def test_gpu_pin_memory_with_workers_and_default_form() -> None:
    x = np.random.default_rng(13).standard_normal((40, 4)).astype(np.float32)
    for placement in _gpu_placements():
        if placement == "cuda":
            ds = gl.GadgetDataset(x, np.arange(40), placement="cuda")
            seen = []
            for bx, by in DataLoader(ds, batch_size=8, shuffle=True, pin_memory=True):
                assert bx.is_cuda
                np.testing.assert_array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
                seen += by.tolist()
            assert sorted(seen) == list(range(40))
            continue
        ds = gl.GadgetDataset(x, np.arange(40), placement=placement)
        seen = []
        dl = DataLoader(
            ds,
            batch_sampler=gl.GadgetSampler(ds, batch_size=8, seed=0),
            num_workers=2,
            pin_memory=True,
        )
        for bx, by in dl:
            assert bx.device.type == "cpu" and bx.is_pinned()
            np.testing.assert_array_equal(bx.numpy(), x[by.numpy()])
            seen += by.tolist()
        assert sorted(seen) == list(range(40))


@gpu
@needs_cuda
def test_gpu_sampler_form_ranks_and_pad_values() -> None:
    n = 1001
    x = np.random.default_rng(14).standard_normal((n, 4)).astype(np.float32)
    for placement in _gpu_placements():
        ds = gl.GadgetDataset(x, np.arange(n), placement=placement)
        for kw in ({}, {"pad": True}, {"drop_last": True}):
            flat, counts = [], set()
            for r in range(3):
                s = gl.GadgetSampler(ds, batch_size=16, num_replicas=3, rank=r, seed=4, **kw)
                out = list(DataLoader(ds, batch_sampler=s))
                counts.add(len(out))
                for bx, by in out:
                    np.testing.assert_array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
                    flat += by.tolist()
            assert len(counts) == 1
            if not kw:
                assert sorted(flat) == list(range(n))
            elif "pad" in kw:
                assert set(flat) == set(range(n))
            else:
                assert len(set(flat)) == len(flat)


@gpu
@needs_cuda
def test_gpu_kept_batches_stay_correct_after_later_groups() -> None:
    """Read-ahead batches are views of a group's memory: batches kept past the loop (and
    past later groups' gathers) must still hold their own rows."""
    n = 20000
    x = np.random.default_rng(15).standard_normal((n, 32)).astype(np.float32)
    for placement in _gpu_placements():
        ds = gl.GadgetDataset(x, np.arange(n), placement=placement)
        for kept in (
            list(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=100, seed=1))),
            list(gl.GadgetLoader(ds, batch_size=100, seed=1, prefetch=2)),
        ):
            torch.cuda.synchronize()
            for bx, by in kept:
                np.testing.assert_array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
            ids = torch.cat([by for _, by in kept]).cpu()
            assert torch.equal(ids.sort().values, torch.arange(n))
