"""Review probes (session 18): page-locked sampler orders, the default form's ``struct``
reading of a list of ids, and the fork registry (``gadgetloader._fork``).

Probes that pass are kept as regression tests. The review found five defects (bool and
one-element tensors read as ids, an ``__index__`` error escaping raw, copies of datasets
and loaders and a loader's passes not kept in forked children, tensors compared by the
registry's WeakSet) and an untrue note on how many orders are pinned; all were fixed in
session 18 and their probes are regression tests now. The error patterns of the default
form are those of the code before the change (``git show 5d2723d:gadgetloader/data/
_dataset.py``: a list that is not all plain ints took the general path, ``as_ids``).
On this CPU machine page-locking is simulated where a probe needs the pinned code path:
``_can_pin`` is patched to True and ``torch.empty(..., pin_memory=True)`` either fails as
it does here (the pageable fallback) or is made to succeed with a pageable tensor (so
that the registration in ``gadgetloader._fork`` runs).
"""

from __future__ import annotations

import copy
import enum
import gc
import os
import pickle
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gadgetloader as gl
from gadgetloader import GadgetIndexError, GadgetTypeError, GadgetValueError, _fork
from gadgetloader.data import _dataset as dmod
from gadgetloader.data import _sampler as smod

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")

N = 40
X = np.arange(N * 2, dtype=np.float32).reshape(N, 2)


@pytest.fixture
def ds() -> Iterator[gl.GadgetDataset]:
    d = gl.GadgetDataset(X, placement="cpu", device="cpu")
    yield d
    d.close()


def _rows(batch: Any) -> list[int]:
    """The row ids a batch of X holds (X[i] = [2i, 2i + 1])."""
    return [int(v) // 2 for v in batch[0][..., 0].reshape(-1).tolist()]


def _one(d: gl.GadgetDataset, ids: Any) -> Any:
    out = d.__getitems__(ids)
    assert isinstance(out, list) and len(out) == 1
    return out[0]


class Color(enum.IntEnum):
    RED = 4
    BLUE = 0


class Idx:
    """Not an int, but has ``__index__``."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


class BadIdx:
    """``__index__`` fails with an exception that is not TypeError / OverflowError."""

    def __index__(self) -> int:
        raise ValueError("no index for this one")


class MyList(list):  # type: ignore[type-arg]
    pass


def _fake_pinning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``_id_buffer`` takes its page-locked branch here: ``_can_pin`` is True and
    ``torch.empty(pin_memory=True)`` returns a pageable tensor (each such call counted)."""
    calls: list[int] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.pop("pin_memory", False):
            calls.append(1)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(smod, "_can_pin", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    return calls


def _force_list_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default form asks for page-locked ids (as for a CUDA dataset)."""
    real = smod._id_buffer
    monkeypatch.setattr(dmod, "_id_buffer", lambda n, dtype, pin: real(n, dtype, True))


def _registered(obj: Any) -> bool:
    """Whether ``obj`` is in the fork registry (by identity: ``tensor in WeakSet`` compares
    tensors with ``==``, see the latent probe below)."""
    return any(o is obj for o in list(_fork._HOLDERS.values()))


class _PinSource:
    """A data source whose sampler asks for page-locked orders (as a CUDA dataset does)."""

    def __init__(self, n: int, chunk_rows: int | None = None) -> None:
        self.n = n
        if chunk_rows is not None:
            self.chunk_rows = chunk_rows

    def __len__(self) -> int:
        return self.n

    def _pin_sampler_ids(self) -> bool:
        return True


# =============================================================================================
# 1. the default form: a list of ids through __getitems__
# =============================================================================================
GOOD_LISTS: list[tuple[str, list[Any], list[int]]] = [
    ("ints", [3, 1, 3], [3, 1, 3]),
    ("first_row", [0], [0]),
    ("last_row", [N - 1], [N - 1]),
    ("both_ends", [N - 1, 0, N - 1], [N - 1, 0, N - 1]),
    ("zero_one", [1, 0, 1], [1, 0, 1]),
    ("np_int64", [np.int64(7), 3], [7, 3]),
    ("np_mixed", [np.int8(2), np.uint16(5), np.int32(0), np.uint64(39)], [2, 5, 0, 39]),
    ("np_after_int", [3, np.int64(0)], [3, 0]),
    ("intenum", [Color.RED, 0], [4, 0]),
    ("intenum_zero", [5, Color.BLUE], [5, 0]),
    ("tensor0d", [torch.tensor(5), 2], [5, 2]),
    ("tensor0d_after", [2, torch.tensor(5)], [2, 5]),
    ("tensor0d_uint8", [2, torch.tensor(1, dtype=torch.uint8)], [2, 1]),
    ("np0d", [np.array(5), 2], [5, 2]),
    ("np0d_after", [2, np.array(0)], [2, 0]),
]


@pytest.mark.parametrize(("name", "ids", "want"), GOOD_LISTS, ids=[c[0] for c in GOOD_LISTS])
def test_default_form_lists_equal_numpy(
    ds: gl.GadgetDataset, name: str, ids: list[Any], want: list[int]
) -> None:
    batch = _one(ds, list(ids))
    assert isinstance(batch, gl.GadgetBatch)
    np.testing.assert_array_equal(batch[0].numpy(), X[want])
    assert batch[0].dtype == torch.float32 and batch[0].shape == (len(want), 2)


def test_default_form_random_lists_equal_numpy(ds: gl.GadgetDataset) -> None:
    rng = np.random.default_rng(18)
    for _ in range(300):
        k = int(rng.integers(1, 60))
        raw = rng.integers(0, N, size=k)
        kind = int(rng.integers(0, 3))
        ids: list[Any] = [int(v) for v in raw]
        if kind == 1:  # a few NumPy scalars among the ints
            ids = [np.int64(v) if j % 3 == 0 else int(v) for j, v in enumerate(raw)]
        elif kind == 2:  # 0-d tensors among them
            ids = [torch.tensor(int(v)) if j % 4 == 1 else int(v) for j, v in enumerate(raw)]
        batch = _one(ds, ids)
        np.testing.assert_array_equal(batch[0].numpy(), X[raw])


def test_default_form_through_dataloader_equals_numpy() -> None:
    y = np.arange(1000, dtype=np.int64)
    x = np.random.default_rng(3).standard_normal((1000, 3)).astype(np.float32)
    d = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    seen: list[int] = []
    for xb, yb in DataLoader(d, batch_size=37, shuffle=True):
        np.testing.assert_array_equal(xb.numpy(), x[yb.numpy()])
        seen.extend(yb.tolist())
    assert sorted(seen) == list(range(1000))
    d.close()


def test_list_ids_returns_checked_int64(ds: gl.GadgetDataset) -> None:
    got = ds._list_ids([5, 0, 39, 5])
    assert got is not None
    assert got.dtype == torch.int64 and got.device.type == "cpu" and got.is_contiguous()
    assert got.tolist() == [5, 0, 39, 5]
    assert not got.is_pinned()  # a CPU dataset: pageable
    # a list struct refuses, or one with a bool: the general path (None), never partial ids
    for bad in ([5, 1.5], [5, "x"], [5, None], [2, True], [False], [3, 2**63]):
        assert ds._list_ids(list(bad)) is None


def test_empty_list_and_list_subclass(ds: gl.GadgetDataset) -> None:
    empty = _one(ds, [])
    assert empty[0].shape == (0, 2)
    sub = _one(ds, MyList([3, 1, 39]))
    np.testing.assert_array_equal(sub[0].numpy(), X[[3, 1, 39]])
    with pytest.raises(GadgetTypeError, match=r"got a MyList holding bools"):
        ds.__getitems__(MyList([3, True]))
    with pytest.raises(GadgetIndexError, match=r"id 40 is out of range"):
        ds.__getitems__(MyList([3, 40]))


def test_list_of_id_batches_still_refused(ds: gl.GadgetDataset) -> None:
    with pytest.raises(GadgetValueError, match="list of id batches"):
        ds.__getitems__([torch.tensor([1, 2]), torch.tensor([3, 4])])
    with pytest.raises(GadgetValueError, match="list of id batches"):
        ds.__getitems__([torch.tensor([5]), 2])


# errors as before the change: (ids, error type, message pattern of the old general path)
BOOLS = r"ids must be integers; got a list holding bools \(True / False are not row ids\)"
BAD_LISTS: list[tuple[str, list[Any], type[Exception], str]] = [
    ("bool_first", [True, 3], GadgetTypeError, BOOLS),
    ("bool_last", [3, True], GadgetTypeError, BOOLS),
    ("bool_mid", [5, False, 6], GadgetTypeError, BOOLS),
    ("bool_only", [False], GadgetTypeError, r"ids must be integers; got a list holding bool "),
    ("bool_two", [True, False], GadgetTypeError, r"got a list holding bool values"),
    ("bool_with_big", [30, True], GadgetTypeError, BOOLS),
    ("bool_with_oob", [400, True], GadgetTypeError, BOOLS),
    ("bool_with_neg", [-5, True], GadgetTypeError, BOOLS),
    ("bool_with_np", [np.int64(3), True], GadgetTypeError, BOOLS),
    ("np_bool", [2, np.True_], GadgetTypeError, BOOLS),
    ("np_bool_first", [np.True_, 2], GadgetTypeError, BOOLS),
    ("np_bool_false", [5, np.False_], GadgetTypeError, BOOLS),
    ("np0d_bool", [2, np.array(True)], GadgetTypeError, BOOLS),
    ("float", [5, 1.0], GadgetTypeError, r"ids must be integers; got a list holding float64"),
    ("float_only", [5.0], GadgetTypeError, r"ids must be integers; got a list holding float64"),
    ("np_float", [np.float64(3), 2], GadgetTypeError, r"holding float64 values"),
    ("tensor0d_float", [2, torch.tensor(5.0)], GadgetTypeError, r"holding float64 values"),
    ("complex", [1j], GadgetTypeError, r"holding complex128 values"),
    ("string", [5, "6"], GadgetTypeError, r"ids must be integers; got a list holding <U"),
    ("bytes", [b"a"], GadgetTypeError, r"ids must be integers; got a list holding \|S1"),
    ("none", [5, None], GadgetTypeError, r"ids must be integers; got a list holding (object|None)"),
    ("index_too_big", [Idx(2**64), 2], GadgetTypeError, r"holding object values"),
    ("np1d_one", [2, np.array([5])], GadgetTypeError, r"rectangular array of integers"),
    (
        "huge",
        [3, 2**63],
        GadgetIndexError,
        r"id 9223372036854775808 is out of range: ids must be in \[0, 2\*\*63-1\]",
    ),
    (
        "huge_first",
        [2**64, 3],
        GadgetIndexError,
        r"is out of range: ids must be in \[0, 2\*\*63-1\]",
    ),
    (
        "np_uint64_huge",
        [np.uint64(2**63), 3],
        GadgetIndexError,
        r"is out of range: ids must be in \[0, 2\*\*63-1\]",
    ),
    (
        "huge_negative",
        [3, -(2**63) - 1],
        GadgetIndexError,
        r"id -9223372036854775809 is negative: ids address rows from 0",
    ),
    (
        "negative",
        [3, -2],
        GadgetIndexError,
        r"id -2 is negative: this table has 40 rows, so ids must be in \[0, 39\] "
        r"\(ids seen: min -2, max 3\); nothing was read or written",
    ),
    ("int64_min", [-(2**63), 3], GadgetIndexError, r"id -9223372036854775808 is negative"),
    ("minus_one", [-1], GadgetIndexError, r"id -1 is negative"),
    (
        "one_past",
        [0, N],
        GadgetIndexError,
        r"id 40 is out of range: this table has 40 rows, so ids must be in \[0, 39\] "
        r"\(ids seen: min 0, max 40\); nothing was read or written",
    ),
    ("int64_max", [2**63 - 1], GadgetIndexError, r"id 9223372036854775807 is out of range"),
]


@pytest.mark.parametrize(
    ("name", "ids", "exc", "pattern"), BAD_LISTS, ids=[c[0] for c in BAD_LISTS]
)
def test_default_form_errors_unchanged(
    ds: gl.GadgetDataset, name: str, ids: list[Any], exc: type[Exception], pattern: str
) -> None:
    with pytest.raises(exc, match=pattern):
        ds.__getitems__(list(ids))


def test_index_objects_take_the_general_path(ds: gl.GadgetDataset) -> None:
    """Only lists of Python ints take the struct path (their sum is an int): a list with
    any other ``__index__`` object is refused as before the change, 'object values'."""
    with pytest.raises(GadgetTypeError, match="integers"):
        ds.__getitems__([Idx(3), 2])


# ---- defects: what the general path refused before, the struct path now lets through -------
@pytest.mark.parametrize(
    "ids",
    [
        [2, torch.tensor(True)],
        [torch.tensor(True), 2],
        [5, torch.tensor(False)],
        [2, torch.tensor([True])],
    ],
    ids=["after", "first", "false", "one_element"],
)
def test_bool_tensors_in_a_list_are_refused(ds: gl.GadgetDataset, ids: list[Any]) -> None:
    with pytest.raises(GadgetTypeError, match="bools|rectangular"):
        ds.__getitems__(list(ids))


def test_bool_tensors_refused_by_indexing(ds: gl.GadgetDataset) -> None:
    """The general path (ds[...]) refuses the same lists: the two paths should agree."""
    for ids in ([2, torch.tensor(True)], [torch.tensor(True), 2]):
        with pytest.raises(GadgetTypeError, match="bools"):
            ds[list(ids)]


def test_one_element_1d_tensor_after_an_int_is_refused(ds: gl.GadgetDataset) -> None:
    with pytest.raises(GadgetTypeError, match="rectangular"):
        ds.__getitems__([2, torch.tensor([5])])


def test_failing_index_gives_the_library_error(ds: gl.GadgetDataset) -> None:
    with pytest.raises(GadgetTypeError, match="ids must be integers"):
        ds.__getitems__([BadIdx(), 2])


def test_default_form_under_inference_mode_and_threads(ds: gl.GadgetDataset) -> None:
    with torch.inference_mode():
        np.testing.assert_array_equal(_one(ds, [3, 1])[0].numpy(), X[[3, 1]])
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                raw = rng.integers(0, N, size=int(rng.integers(1, 30)))
                got = _one(ds, [int(v) for v in raw])[0].numpy()
                if not np.array_equal(got, X[raw]):
                    raise AssertionError(f"wrong rows for {raw.tolist()}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_pinned_list_ids_registered_and_equal(
    ds: gl.GadgetDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page-locked branch (a CUDA dataset's): same ids, the buffer registered."""
    calls = _fake_pinning(monkeypatch)
    _force_list_pinning(monkeypatch)
    got = ds._list_ids([7, 0, 39])
    assert got is not None and got.tolist() == [7, 0, 39] and got.dtype == torch.int64
    assert calls == [1]
    assert _registered(got)
    np.testing.assert_array_equal(_one(ds, [7, 0, 39])[0].numpy(), X[[7, 0, 39]])
    for bad, exc in (([2, True], GadgetTypeError), ([0, 40], GadgetIndexError)):
        with pytest.raises(exc):
            ds.__getitems__(list(bad))


def test_pin_refused_list_ids_fall_back(
    ds: gl.GadgetDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_can_pin`` True but page-locking refused (as on a CPU build, or under a memlock
    limit): the ids are pageable and right."""
    monkeypatch.setattr(smod, "_can_pin", lambda: True)
    _force_list_pinning(monkeypatch)
    real_empty = torch.empty

    def refusing(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("pin_memory"):
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refusing)
    got = ds._list_ids([1, 2, 3])
    assert got is not None and got.tolist() == [1, 2, 3] and not got.is_pinned()
    np.testing.assert_array_equal(_one(ds, [9, 8])[0].numpy(), X[[9, 8]])


# =============================================================================================
# 2. sampler orders: identical with and without page-locking
# =============================================================================================
def _batches(s: gl.GadgetSampler, epochs: int = 3) -> list[list[int]]:
    return [b.tolist() for _ in range(epochs) for b in s]


SAMPLER_CASES: list[dict[str, Any]] = [
    {"order": "random"},
    {"order": "random", "drop_last": True},
    {"order": "random", "pad": True, "num_replicas": 3, "rank": 2},
    {"order": "random", "num_replicas": 4, "rank": 1},
    {"order": "sequential"},
    {"order": "sequential", "coalesce": 1},
    {"order": "sequential", "coalesce": 5},
    {"order": "sequential", "pad": True, "num_replicas": 3, "rank": 1},
    {"order": "chunk", "chunk_rows": 16},
    {"order": "chunk", "chunk_rows": 16, "window_chunks": 3, "drop_last": True},
]


@pytest.mark.parametrize("mode", ["fake_pinned", "pin_refused"])
@pytest.mark.parametrize("kw", SAMPLER_CASES, ids=[str(c) for c in SAMPLER_CASES])
def test_sampler_orders_identical_with_pinning(
    kw: dict[str, Any], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, bs = 1003, 16
    ref = gl.GadgetSampler(n, batch_size=bs, seed=11, **kw)
    assert ref._pin is False
    want = _batches(ref)
    want_bounds = [smod.sampler_ids_bound(b) for b in ref]
    if mode == "fake_pinned":
        calls = _fake_pinning(monkeypatch)
    else:
        calls = []
        monkeypatch.setattr(smod, "_can_pin", lambda: True)  # pinning then fails here
    s = gl.GadgetSampler(_PinSource(n), batch_size=bs, seed=11, **kw)
    assert s._pin is True
    assert _batches(s) == want
    assert [smod.sampler_ids_bound(b) for b in s] == want_bounds
    for e in range(3):
        assert torch.equal(s.epoch_order(e), ref.epoch_order(e))
    if mode == "fake_pinned" and not (kw["order"] == "sequential" and kw.get("coalesce") == 1):
        assert calls, "the page-locked branch was not taken"


@pytest.mark.parametrize("order", ["random", "chunk"])
def test_epoch_order_pinned_matches_under_inference_mode(
    order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_pinning(monkeypatch)
    want = smod._epoch_order(777, order, 5, 2, 10, 3, False)
    with torch.inference_mode():
        got = smod._epoch_order(777, order, 5, 2, 10, 3, True)
    assert not got.is_inference() and torch.equal(got, want)
    assert smod.sampler_ids_bound(got) == 777
    assert _registered(got)


def test_pinned_sampler_resume_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pinning(monkeypatch)
    s = gl.GadgetSampler(_PinSource(500), batch_size=32, seed=4)
    it = iter(s)
    head = [next(it).tolist() for _ in range(5)]
    state = s.state_dict()
    rest = [b.tolist() for b in it]
    t = gl.GadgetSampler(_PinSource(500), batch_size=32, seed=0)
    t.load_state_dict(state)
    assert [b.tolist() for b in t] == rest
    assert head + rest == [b.tolist() for b in gl.GadgetSampler(500, batch_size=32, seed=4)]


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_pinned_sampler_pickles(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pinning(monkeypatch)
    s = gl.GadgetSampler(_PinSource(300), batch_size=16, order=order, seed=8)
    batch = next(iter(s))
    t = pickle.loads(pickle.dumps(s))
    assert t._pin is True and t._orders == {}
    assert _batches(t, 2) == _batches(s, 2)
    u = copy.deepcopy(s)
    assert _batches(u, 1) == _batches(s, 1)
    # a batch (a view of a page-locked order) pickles as a compact plain tensor
    back = pickle.loads(pickle.dumps(batch))
    assert type(back) is torch.Tensor and back.tolist() == batch.tolist()
    assert back.untyped_storage().nbytes() == 8 * batch.numel()


def test_pinned_sampler_iterates_in_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Orders made page-locked on the background threads, several samplers at once."""
    _fake_pinning(monkeypatch)
    out: dict[int, list[list[int]]] = {}

    def work(seed: int) -> None:
        s = gl.GadgetSampler(_PinSource(400), batch_size=50, seed=seed)
        out[seed] = _batches(s, 4)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        assert out[k] == _batches(gl.GadgetSampler(400, batch_size=50, seed=k), 4)


def test_dataset_sampler_over_cpu_dataset_unchanged() -> None:
    y = np.arange(300)
    d = gl.GadgetDataset(X.repeat(8, axis=0)[:300], y, placement="cpu", device="cpu")
    s = gl.GadgetSampler(d, batch_size=32, seed=3)
    ref = gl.GadgetSampler(300, batch_size=32, seed=3)
    got = [yb.tolist() for _, yb in DataLoader(d, batch_sampler=s)]
    assert got == [b.tolist() for b in ref]
    d.close()


def test_pinned_orders_kept_as_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PIN_ORDER_ROWS note: a pass keeps the orders of up to three epochs; an
    ``epoch_order`` of another epoch adds one (the note says so)."""
    _fake_pinning(monkeypatch)
    n = 4099
    s = gl.GadgetSampler(_PinSource(n), batch_size=64, seed=1)
    for _ in range(3):  # three whole epochs
        for _b in s:
            pass
        assert len(s._orders) <= 3
    for fut in list(s._orders.values()):
        fut.result()
    s.epoch_order(10)
    assert len(s._orders) <= 4
    import gadgetloader.data._sampler as smod

    with open(smod.__file__) as f:
        src = f.read()
    assert "at most three alive" not in src
    assert "plus any asked for through" in src


# =============================================================================================
# 3. the fork registry
# =============================================================================================
def test_registry_bounded_over_many_default_form_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every page-locked list buffer is registered; the parent frees them as usual, so the
    registry stays small over thousands of batches."""
    calls = _fake_pinning(monkeypatch)
    _force_list_pinning(monkeypatch)
    d = gl.GadgetDataset(np.zeros((5000, 1), np.float32), placement="cpu", device="cpu")
    gc.collect()
    base = len(_fork._HOLDERS)
    peak = base
    batches = 0
    for _ in range(3):
        for _batch in DataLoader(d, batch_size=4, shuffle=True):
            batches += 1
            peak = max(peak, len(_fork._HOLDERS))
    assert len(calls) >= batches == 3 * 1250
    assert peak <= base + 4, (base, peak)
    d.close()
    del d, _batch
    gc.collect()
    assert len(_fork._HOLDERS) <= base


def test_registry_bounded_over_many_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_pinning(monkeypatch)
    gc.collect()
    base = len(_fork._HOLDERS)
    peak = base
    for order in ("random", "sequential"):
        s = gl.GadgetSampler(_PinSource(2000), batch_size=7, order=order, seed=2)
        for _ in range(40):
            for _b in s:
                pass
            peak = max(peak, len(_fork._HOLDERS))
        del s, _b
    assert len(calls) > 80
    assert peak <= base + 8, (base, peak)
    gc.collect()
    for _ in range(50):  # background threads finishing an order they were computing
        if len(_fork._HOLDERS) <= base:
            break
        threading.Event().wait(0.02)
        gc.collect()
    assert len(_fork._HOLDERS) <= base


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


@contextmanager
def _gc_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _fork_and_report(child: Callable[[], bytes]) -> bytes:
    """Run ``child`` in a forked process; return what it returned (through a pipe)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:
        try:
            try:
                out = child()
            except BaseException as exc:  # report, never return into pytest
                out = b"E" + repr(exc).encode()[:200]
            os.write(w, out)
        finally:
            os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return got


@needs_fork
def test_fork_keeps_registered_objects_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pinning(monkeypatch)
    # the registry alone: no freeze of the collector for the fork (which a process that
    # started CUDA gets, and which keeps the unregistered object too: test_session37_fork)
    monkeypatch.setattr(_fork, "_cuda_started", lambda: False)
    kept_before = len(_fork._KEPT)
    with _gc_off():
        d = gl.GadgetDataset(np.zeros((64, 2), np.float32), placement="cpu", device="cpu")
        buf = smod._id_buffer(16, torch.int64, True)  # "page-locked": registered
        plain = torch.empty(16, dtype=torch.int64)  # not registered
        assert _registered(d) and _registered(buf) and not _registered(plain)
        refs = {k: weakref.ref(v) for k, v in (("d", d), ("buf", buf), ("plain", plain))}
        junk: list[Any] = [d, buf, plain, _Cyclic()]
        junk.append(junk)
        del d, buf, plain, junk

        def child() -> bytes:
            gc.collect()
            alive = "".join(k for k in ("d", "buf", "plain") if refs[k]() is not None)
            kept = {id(o) for o in _fork._KEPT}
            ok = all(id(refs[k]()) in kept for k in ("d", "buf"))
            later = gl.GadgetDataset(np.zeros((8, 1), np.float32), placement="cpu", device="cpu")
            later_kept = any(o is later for o in _fork._KEPT)  # registered after the fork
            return f"{alive}|{ok}|{later_kept}".encode()

        got = _fork_and_report(child)
    assert got == b"dbuf|True|False", got
    assert len(_fork._KEPT) == kept_before  # nothing held in the parent
    gc.collect()
    assert all(r() is None for r in refs.values())  # the parent frees all three


@needs_fork
def test_forked_dataloader_workers_with_registered_garbage() -> None:
    """Workers forked beside registered cyclic garbage collect and finish normally."""

    class Collecting(Dataset[int]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> int:
            gc.collect()
            return i

    with _gc_off():
        d = gl.GadgetDataset(np.zeros((64, 2), np.float32), placement="cpu", device="cpu")
        loader = gl.GadgetLoader(d, batch_size=8, seed=1)
        first = next(iter(loader))
        junk: list[Any] = [d, loader, first]
        junk.append(junk)
        del d, loader, first, junk
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            out = list(
                DataLoader(
                    Collecting(), batch_size=2, num_workers=2, multiprocessing_context="fork"
                )
            )
    assert torch.cat(out).tolist() == list(range(6))


@needs_fork
def test_fork_keeps_an_abandoned_loader_iterator() -> None:
    with _gc_off():
        d = gl.GadgetDataset(np.zeros((64, 2), np.float32), placement="cpu", device="cpu")
        loader = gl.GadgetLoader(d, batch_size=8, seed=1)
        it = iter(loader)
        next(it)
        ref = weakref.ref(it)
        junk: list[Any] = [it]
        junk.append(junk)
        del it, junk

        def child() -> bytes:
            gc.collect()
            return b"K" if ref() is not None else b"D"

        got = _fork_and_report(child)
        assert loader is not None  # (the loader itself stays reachable here)
    assert got == b"K", got


def test_copies_of_datasets_and_loaders_are_registered() -> None:
    d = gl.GadgetDataset(np.zeros((64, 2), np.float32), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(d, batch_size=8)
    copies = [pickle.loads(pickle.dumps(d)), copy.copy(d), copy.deepcopy(d), copy.deepcopy(loader)]
    assert [_registered(c) for c in copies] == [True] * 4


def test_registering_a_tensor_twice_is_harmless() -> None:
    t = torch.zeros(4, dtype=torch.int64)
    assert _fork.keep_in_forked_child(t) is t
    assert _fork.keep_in_forked_child(t) is t
    assert _registered(t)


def test_registry_holds_weakly() -> None:
    t = _fork.keep_in_forked_child(torch.zeros(3))
    d = gl.GadgetDataset(np.zeros((8, 1), np.float32), placement="cpu", device="cpu")
    refs: list[weakref.ref[Any]] = [weakref.ref(t), weakref.ref(d)]
    assert _registered(t) and _registered(d)
    del t, d
    gc.collect()
    assert all(r() is None for r in refs)


# =============================================================================================
# 4. on the GPU (skipped here; reasoned from the code)
# =============================================================================================
@pytest.mark.gpu
@needs_fork
def test_worker_survives_an_abandoned_cuda_loader_iterator(device: torch.device) -> None:
    pytest.importorskip("cupy")
    x = np.random.default_rng(0).standard_normal((4096, 8)).astype(np.float32)

    class Collecting(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            gc.collect()
            return i

    with _gc_off():
        d = gl.GadgetDataset(x, placement="pinned", device=device)
        for coalesce in (1, 4):  # _prefetched and _grouped generators
            loader = gl.GadgetLoader(d, batch_size=256, seed=2, coalesce=coalesce)
            it = iter(loader)
            next(it)
            junk: list[Any] = [it]
            junk.append(junk)
            del it, junk
        torch.cuda.synchronize()
        out = list(
            DataLoader(Collecting(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        )
    assert torch.cat(out).tolist() == list(range(8))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [
        {"order": "random", "pad": True, "num_replicas": 3, "rank": 1},
        {"order": "chunk", "chunk_rows": 64},
        {"order": "sequential", "coalesce": 3},
    ],
    ids=["random_pad", "chunk", "sequential"],
)
def test_cuda_pinned_orders_give_numpy_rows(device: torch.device, kw: dict[str, Any]) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1500, 4)).astype(np.float32)
    d = gl.GadgetDataset(x, np.arange(1500), placement="cuda", device=device)
    s = gl.GadgetSampler(d, batch_size=64, seed=5, **kw)
    assert s._pin is True
    ref = gl.GadgetSampler(1500, batch_size=64, seed=5, **kw)
    for _ in range(2):
        got = [(xb.cpu(), yb.cpu()) for xb, yb in DataLoader(d, batch_sampler=s)]
        want = [b.clone() for b in ref]
        assert len(got) == len(want)
        for (xb, yb), ids in zip(got, want, strict=True):
            assert torch.equal(yb, ids)
            assert torch.equal(xb, torch.from_numpy(x[ids.numpy()]))
    d.close()


@pytest.mark.gpu
def test_cuda_default_form_bool_tensor_refused(device: torch.device) -> None:
    """As on the CPU: a bool tensor in the default form's list is not row 1."""
    d = gl.GadgetDataset(X, placement="cuda", device=device)
    with pytest.raises(GadgetTypeError, match="bools"):
        d.__getitems__([2, torch.tensor(True)])
    d.close()
