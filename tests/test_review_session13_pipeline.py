"""Session 13 review of the input pipeline as a demanding user drives it.

GadgetDataset, GadgetSampler, GadgetLoader and GadgetBatch, and plain torch ``DataLoader``
over a GadgetDataset, checked against independent references: the source NumPy arrays
indexed by the ids a batch carries (every dataset here has an ``arange(n)`` id column),
torch's own ``DataLoader`` over a ``TensorDataset`` with the same generator, the sampler's
``epoch_order`` and an uninterrupted run of the same sampler.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

N = 61


# ---- helpers ----------------------------------------------------------------------------------
def _np(t: Any) -> np.ndarray:
    """A batch column as a NumPy array (on the CPU: batches may arrive on CUDA)."""
    return torch.as_tensor(t).detach().cpu().numpy()


def _source(n: int = N) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(13)
    return {
        "f32": rng.standard_normal((n, 3)).astype(np.float32),
        "f16": rng.standard_normal((n, 2)).astype(np.float16),
        "i32": rng.integers(-1000, 1000, (n, 4)).astype(np.int32),
        "flag": rng.random(n) < 0.5,
        "u8": rng.integers(0, 256, n).astype(np.uint8),
        "lab": (np.arange(n) * 7 % 11).astype(np.int64),
        "ids": np.arange(n, dtype=np.int64),
    }


def _write(tmp_path: Any, src: dict[str, np.ndarray]) -> dict[str, str]:
    """f32 as .npy, f16 in an HDF5 group beside a decoy, i32 in a zarr group beside a decoy."""
    paths = {
        "npy": str(tmp_path / "f32.npy"),
        "h5": str(tmp_path / "mixed.h5"),
        "zarr": str(tmp_path / "mixed.zarr"),
    }
    np.save(paths["npy"], src["f32"])
    with h5py.File(paths["h5"], "w") as f:
        f.create_dataset("aaa_decoy", data=np.zeros_like(src["f16"]))
        f.create_dataset("grp/half", data=src["f16"], chunks=(8, 2), compression="gzip")
    g = zarr.open_group(paths["zarr"], mode="w")
    a = g.create_array("ints", shape=src["i32"].shape, chunks=(5, 4), dtype="int32")
    a[:] = src["i32"]
    d = g.create_array("decoy", shape=src["i32"].shape, chunks=(5, 4), dtype="int32")
    d[:] = -1
    return paths


#: column order of :func:`_mixed_dataset` (names in :func:`_source`)
MIXED = ("f32", "f16", "i32", "flag", "u8", "f32", "lab", "ids")


def _mixed_dataset(
    tmp_path: Any, placement: str, **kw: Any
) -> tuple[gl.GadgetDataset, dict[str, np.ndarray]]:
    """Every kind of column at once: a file-backed .npy DataGadget, an HDF5 path (with
    ``dataset=``) loaded at ``placement``, a file-backed zarr DataGadget from a group, a bool
    tensor, a uint8 array, a DataGadget of ``placement``, an int64 label tensor, the ids."""
    src = _source()
    p = _write(tmp_path, src)
    cols = [
        gl.DataGadget(p["npy"], placement="file"),
        p["h5"],
        gl.DataGadget(p["zarr"], dataset="ints", placement="file"),
        torch.from_numpy(src["flag"]),
        src["u8"],
        gl.DataGadget(src["f32"], placement=placement),
        torch.from_numpy(src["lab"]),
        src["ids"],
    ]
    ds = gl.GadgetDataset(*cols, placement=placement, dataset="grp/half", **kw)
    return ds, src


def _check_batch(batch: Any, src: dict[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray:
    """Every column equals the source rows at the batch's ids (its last column); the ids."""
    assert len(batch) == len(names)
    ids = _np(batch[-1])
    for col, name in zip(batch, names, strict=True):
        got = _np(col)
        ref = src[name][ids]
        assert got.dtype == ref.dtype, (name, got.dtype, ref.dtype)
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        assert np.array_equal(got, ref), name
    return ids


def _ids_of(batches: Any) -> list[list[int]]:
    return [_np(b[-1]).tolist() for b in batches]


def _one_col(n: int) -> gl.GadgetDataset:
    return gl.GadgetDataset(np.arange(n, dtype=np.int64), placement="cpu", device="cpu")


def _collate_double(batch: list[Any]) -> tuple[Any, ...]:
    """A user collate_fn (module level, picklable): README says it gets ``[GadgetBatch]``."""
    assert isinstance(batch, list) and len(batch) == 1
    assert isinstance(batch[0], gl.GadgetBatch)
    x, ids = batch[0]
    return ("mine", x * 2, ids)


# ---- every README form over mixed columns ------------------------------------------------------
@pytest.mark.parametrize(
    "dl_kw",
    [dict(shuffle=True), dict(shuffle=False), dict(shuffle=True, drop_last=True)],
    ids=["shuffle", "sequential", "shuffle-drop_last"],
)
def test_default_form_equals_torch_tensor_dataset(
    tmp_path: Any, placement: str, dl_kw: dict[str, Any]
) -> None:
    ds, src = _mixed_dataset(tmp_path, placement)
    assert len(ds) == N
    ref_ds = TensorDataset(*(torch.from_numpy(np.ascontiguousarray(src[k])) for k in MIXED))
    got = list(DataLoader(ds, batch_size=8, generator=torch.Generator().manual_seed(4), **dl_kw))
    ref = list(
        DataLoader(ref_ds, batch_size=8, generator=torch.Generator().manual_seed(4), **dl_kw)
    )
    assert len(got) == len(ref) == (N // 8 if dl_kw.get("drop_last") else math.ceil(N / 8))
    for g, r in zip(got, ref, strict=True):
        assert isinstance(g, gl.GadgetBatch)
        _check_batch(g, src, MIXED)
        assert np.array_equal(_np(g[-1]), r[-1].numpy())  # torch's own batch order
    seen = np.concatenate([_np(b[-1]) for b in got])
    if dl_kw.get("drop_last"):
        assert len(seen) == N - N % 8 and len(set(seen.tolist())) == len(seen)
    else:
        assert sorted(seen.tolist()) == list(range(N))
    ds.close()


@pytest.mark.parametrize("order", ["sequential", "random", "chunk"])
def test_sampler_forms_cover_every_row_once_in_the_sampler_order(
    tmp_path: Any, placement: str, order: str
) -> None:
    ds, src = _mixed_dataset(tmp_path, placement)
    kw: dict[str, Any] = dict(batch_size=7, order=order, seed=11)
    if order == "chunk":
        kw["chunk_rows"] = 5
        kw["window_chunks"] = 2
    s1 = gl.GadgetSampler(ds, **kw)
    expected = _np(s1.epoch_order(0))
    assert sorted(expected.tolist()) == list(range(N))
    if order == "sequential":
        assert expected.tolist() == list(range(N))

    a = list(DataLoader(ds, batch_sampler=s1))
    s2 = gl.GadgetSampler(ds, **kw)
    b = list(DataLoader(ds, sampler=s2, batch_size=None))
    assert len(a) == len(b) == len(s1) == math.ceil(N / 7)
    for x in a:
        assert isinstance(x, gl.GadgetBatch)
    for y in b:
        # README: default_convert turns the tuple into a list of the same tensors
        assert isinstance(y, list)
    for batches in (a, b):
        ids = np.concatenate([_check_batch(x, src, MIXED) for x in batches])
        assert np.array_equal(ids, expected)
        assert [len(x[0]) for x in batches] == [7] * (N // 7) + [N % 7]
    ds.close()


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("coalesce", [None, 1, 3])
def test_gadget_loader_forms_match_the_sampler(
    tmp_path: Any, placement: str, prefetch: int, coalesce: int | None
) -> None:
    ds, src = _mixed_dataset(tmp_path, placement)
    ref = gl.GadgetSampler(ds, batch_size=6, seed=3)
    orders = [_np(ref.epoch_order(e)) for e in range(2)]
    loader = gl.GadgetLoader(ds, batch_size=6, seed=3, prefetch=prefetch, coalesce=coalesce)
    assert len(loader) == len(ref) == math.ceil(N / 6)
    for e in range(2):
        batches = list(loader)
        assert all(isinstance(b, gl.GadgetBatch) for b in batches)
        assert all(b[0].device.type == ds.device.type for b in batches)
        ids = np.concatenate([_check_batch(b, src, MIXED) for b in batches])
        assert np.array_equal(ids, orders[e])
        assert [len(b[0]) for b in batches] == [6] * (N // 6) + [N % 6]
    assert not np.array_equal(orders[0], orders[1])
    ds.close()


# ---- coverage, drop_last, epochs ----------------------------------------------------------------
@pytest.mark.parametrize("order", ["sequential", "random", "chunk"])
@pytest.mark.parametrize("n,bs", [(1, 1), (1, 4), (7, 3), (64, 8), (1001, 64)])
def test_every_row_once_and_last_partial_batch(order: str, n: int, bs: int) -> None:
    kw: dict[str, Any] = dict(batch_size=bs, order=order, seed=5)
    if order == "chunk":
        kw["chunk_rows"] = 4
    s = gl.GadgetSampler(n, **kw)
    for epoch in range(2):
        batches = [_np(b) for b in s]
        sizes = [len(b) for b in batches]
        assert sizes == [bs] * (n // bs) + ([n % bs] if n % bs else [])
        flat = np.concatenate(batches)
        assert sorted(flat.tolist()) == list(range(n)), epoch
        assert all(b.dtype == np.int64 for b in batches)
    d = gl.GadgetSampler(n, drop_last=True, **kw) if n >= bs else None
    if d is None:
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetSampler(n, drop_last=True, **kw)
    else:
        batches = [_np(b) for b in d]
        assert [len(b) for b in batches] == [bs] * (n // bs)
        flat = np.concatenate(batches)
        assert len(set(flat.tolist())) == len(flat) == n - n % bs
        # the rows dropped are the last n % bs of the epoch order
        assert np.array_equal(flat, _np(d.epoch_order(0))[: n - n % bs])


def test_epochs_change_by_themselves_and_replay_with_set_epoch_and_seed() -> None:
    n = 97
    a = gl.GadgetSampler(n, batch_size=10, seed=21)
    runs = [np.concatenate([_np(b) for b in a]) for _ in range(3)]
    assert a.epoch == 3
    for r in runs:
        assert sorted(r.tolist()) == list(range(n))
    assert not np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[1], runs[2])
    # same seed, another object: the same epochs; set_epoch jumps straight to one
    b = gl.GadgetSampler(n, batch_size=10, seed=21)
    b.set_epoch(2)
    assert np.array_equal(np.concatenate([_np(x) for x in b]), runs[2])
    b.set_epoch(0)
    assert np.array_equal(np.concatenate([_np(x) for x in b]), runs[0])
    # set_epoch every epoch (DistributedSampler loop) gives the same as letting it advance
    c = gl.GadgetSampler(n, batch_size=10, seed=21)
    for e in range(3):
        c.set_epoch(e)
        assert np.array_equal(np.concatenate([_np(x) for x in c]), runs[e])
    # another seed: another order
    d = gl.GadgetSampler(n, batch_size=10, seed=22)
    assert not np.array_equal(np.concatenate([_np(x) for x in d]), runs[0])
    # an early break restarts the same epoch
    e_ = gl.GadgetSampler(n, batch_size=10, seed=21)
    next(iter(e_))
    assert np.array_equal(np.concatenate([_np(x) for x in e_]), runs[0])


def test_dataloader_with_sampler_follows_epochs_and_set_epoch() -> None:
    ds = _one_col(50)
    s = gl.GadgetSampler(ds, batch_size=8, seed=9)
    orders = [_np(s.epoch_order(e)) for e in range(3)]
    dl = DataLoader(ds, batch_sampler=s)
    for e in range(3):
        assert np.array_equal(np.concatenate([_np(b[0]) for b in dl]), orders[e])
    s.set_epoch(1)
    assert np.array_equal(np.concatenate([_np(b[0]) for b in dl]), orders[1])


# ---- ranks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 1001])
@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("mode", ["default", "drop_last", "pad"])
def test_sharding_over_simulated_ranks(n: int, world: int, mode: str) -> None:
    bs = 4
    kw: dict[str, Any] = dict(batch_size=bs, seed=2, num_replicas=world)
    if mode != "default":
        kw[mode] = True
    refused = (mode == "default" and n < world) or (mode == "drop_last" and n < world * bs)
    if refused:
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetSampler(n, rank=0, **kw)
        return
    samplers = [gl.GadgetSampler(n, rank=r, **kw) for r in range(world)]
    per_rank = [[_np(b) for b in s] for s in samplers]
    counts = {len(p) for p in per_rank}
    assert counts == {len(samplers[0])}, "every rank must get the same number of batches"
    order = _np(samplers[0].epoch_order(0))
    flat = np.concatenate([np.concatenate(p) for p in per_rank])
    if mode == "default":
        assert sorted(flat.tolist()) == list(range(n))  # every row once, no duplicates
        assert all(1 <= len(b) <= bs + 1 for p in per_rank for b in p)
        assert all(len(b) == bs for p in per_rank for b in p[:-1])
    elif mode == "drop_last":
        assert len(set(flat.tolist())) == len(flat)
        assert 0 <= n - len(flat) < world * bs
        assert all(len(b) == bs for p in per_rank for b in p)
    else:
        nb = math.ceil(n / (world * bs))
        assert counts == {nb}
        assert all(len(b) == bs for p in per_rank for b in p)
        assert set(flat.tolist()) == set(range(n))
        # the missing rows repeat the start of the epoch order, cyclically
        assert np.array_equal(flat, order[np.arange(world * bs * nb) % n])


def test_ranks_through_gadget_loaders_read_their_rows(tmp_path: Any) -> None:
    n, world = 1001, 3
    x = np.random.default_rng(0).standard_normal((n, 2)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), np.arange(n), placement="file")
    seen = []
    lens = set()
    for r in range(world):
        loader = gl.GadgetLoader(ds, batch_size=32, num_replicas=world, rank=r, seed=4)
        lens.add(len(loader))
        for xb, ib in loader:
            ids = _np(ib)
            assert np.array_equal(_np(xb), x[ids])
            seen.extend(ids.tolist())
    assert len(lens) == 1
    assert sorted(seen) == list(range(n))
    ds.close()


# ---- resume ------------------------------------------------------------------------------------
def _drain(sampler: gl.GadgetSampler, ds: gl.GadgetDataset, total: int) -> list[list[int]]:
    """Batches (ids) from fresh DataLoader passes over ``sampler`` until ``total``."""
    out: list[list[int]] = []
    for _ in range(total + 2):
        if len(out) >= total:
            break
        out.extend(_ids_of(DataLoader(ds, batch_sampler=sampler)))
    return out[:total]


@pytest.mark.parametrize(
    "kw",
    [
        dict(order="random"),
        dict(order="sequential"),
        dict(order="chunk", chunk_rows=4, window_chunks=3),
        dict(order="random", pad=True, num_replicas=3, rank=1),
        dict(order="random", drop_last=True, num_replicas=2, rank=1),
    ],
    ids=["random", "sequential", "chunk", "pad-ranks", "drop_last-ranks"],
)
def test_sampler_resume_anywhere_equals_the_uninterrupted_run(kw: dict[str, Any]) -> None:
    n = 43
    ds = _one_col(n)
    ref = gl.GadgetSampler(ds, batch_size=5, seed=17, **kw)
    nb = len(ref)
    full = _drain(ref, ds, 3 * nb)
    for k in range(0, 2 * nb + 1):
        s = gl.GadgetSampler(ds, batch_size=5, seed=17, **kw)
        got: list[list[int]] = []
        while len(got) < k:  # k batches through DataLoader, passes as they come
            for b in DataLoader(ds, batch_sampler=s):
                got.append(_np(b[0]).tolist())
                if len(got) == k:
                    break
        state = s.state_dict()
        fresh = gl.GadgetSampler(ds, batch_size=5, seed=999, **kw)  # the state brings its seed
        fresh.load_state_dict(state)
        rest = _drain(fresh, ds, 3 * nb - k)
        assert got + rest == full, k


@pytest.mark.parametrize("coalesce", [1, 3])
def test_loader_resume_across_epoch_boundaries(coalesce: int) -> None:
    n = 29
    ds = _one_col(n)
    ref = gl.GadgetLoader(ds, batch_size=4, seed=8, coalesce=coalesce, prefetch=0)
    nb = len(ref)
    full = [b for _ in range(3) for b in _ids_of(ref)]
    for k in (nb - 1, nb, nb + 1, 2 * nb):
        loader = gl.GadgetLoader(ds, batch_size=4, seed=8, coalesce=coalesce, prefetch=0)
        got: list[list[int]] = []
        while len(got) < k:
            for b in loader:
                got.append(_np(b[0]).tolist())
                if len(got) == k:
                    break
        state = loader.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        again = gl.GadgetLoader(ds, batch_size=4, seed=1, coalesce=coalesce, prefetch=0)
        again.load_state_dict(state)
        rest: list[list[int]] = []
        while len(got) + len(rest) < 3 * nb:
            rest.extend(_ids_of(again))
        assert got + rest == full, k


def test_state_after_the_last_batch_gives_one_empty_pass_then_the_next_epoch() -> None:
    ds = _one_col(40)
    s = gl.GadgetSampler(ds, batch_size=4, seed=3)
    orders = [_np(s.epoch_order(e)) for e in range(2)]
    state = None
    for i, _ in enumerate(DataLoader(ds, batch_sampler=s)):
        if i == len(s) - 1:
            state = s.state_dict()
    assert state is not None and (state["epoch"], state["position"]) == (0, len(s))
    t = gl.GadgetSampler(ds, batch_size=4, seed=0)
    t.load_state_dict(state)
    assert list(DataLoader(ds, batch_sampler=t)) == []
    nxt = np.concatenate([_np(b[0]) for b in DataLoader(ds, batch_sampler=t)])
    assert np.array_equal(nxt, orders[1])


def test_distributed_style_loop_resumes_the_loaded_position() -> None:
    n, world = 50, 3
    ds = _one_col(n)
    full = []  # full[rank][epoch]
    for rank in range(world):
        ref = gl.GadgetSampler(ds, batch_size=4, seed=6, num_replicas=world, rank=rank)
        per = []
        for e in range(3):
            ref.set_epoch(e)
            per.append(_ids_of(DataLoader(ds, batch_sampler=ref)))
        full.append(per)
    for rank in range(world):
        s = gl.GadgetSampler(ds, batch_size=4, seed=6, num_replicas=world, rank=rank)
        s.set_epoch(1)
        it = iter(DataLoader(ds, batch_sampler=s))
        first = [_np(next(it)[0]).tolist() for _ in range(2)]
        assert first == full[rank][1][:2]
        state = s.state_dict()
        # the docstring: a state saved on one rank loads on any rank of the same world size
        for other in range(world):
            t = gl.GadgetSampler(ds, batch_size=4, seed=0, num_replicas=world, rank=other)
            t.load_state_dict(state)
            got = []
            for e in range(1, 3):
                t.set_epoch(e)  # the loop calls set_epoch for the resumed epoch too
                got.append(_ids_of(DataLoader(ds, batch_sampler=t)))
            assert got[0] == full[other][1][2:]
            assert got[1] == full[other][2]


def test_a_state_with_another_seed_is_followed() -> None:
    n = 33
    a = gl.GadgetSampler(n, batch_size=4, seed=123)
    it = iter(a)
    for _ in range(2):
        next(it)
    state = a.state_dict()
    rest_a = [_np(b).tolist() for b in it] + [_np(b).tolist() for b in a]
    b = gl.GadgetSampler(n, batch_size=4, seed=7)
    b.load_state_dict(state)
    assert b.seed == 123
    rest_b = [_np(x).tolist() for x in b] + [_np(x).tolist() for x in b]
    assert rest_b == rest_a


def _base_kw() -> dict[str, Any]:
    return dict(batch_size=4, order="chunk", chunk_rows=3, window_chunks=2, seed=1)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(n=41), "different size"),
        (dict(num_replicas=3), "world size"),
        (dict(batch_size=5), "batch_size"),
        (dict(order="random"), "order"),
        (dict(drop_last=True), "drop_last"),
        (dict(pad=True), "pad"),
        (dict(chunk_rows=5), "chunk_rows"),
        (dict(window_chunks=3), "window_chunks"),
    ],
)
def test_states_of_other_settings_are_refused_and_change_nothing(
    change: dict[str, Any], words: str
) -> None:
    base = _base_kw()
    base.update(num_replicas=2, rank=0)
    other = dict(base)
    n_other = change.pop("n", 40)
    other.update(change)
    if other["order"] != "chunk":
        other.pop("chunk_rows")
        other.pop("window_chunks")
    saver = gl.GadgetSampler(n_other, **other)
    it = iter(saver)
    next(it)
    state = saver.state_dict()

    s = gl.GadgetSampler(40, **base)
    it2 = iter(s)
    next(it2)
    before = s.state_dict()
    ref = gl.GadgetSampler(40, **base)
    ref.load_state_dict(before)
    with pytest.raises(gl.GadgetValueError, match=words):
        s.load_state_dict(state)
    assert s.state_dict() == before
    assert [_np(b).tolist() for b in it2] == [_np(b).tolist() for b in ref]


@pytest.mark.parametrize(
    "edit",
    [
        dict(version=2),
        dict(position=-1),
        dict(position=99),
        dict(epoch=-1),
        dict(seed=-5),
        dict(seed=2**64),
        dict(position=1.5),
        dict(position=True),
    ],
    ids=str,
)
def test_damaged_states_are_refused_and_change_nothing(edit: dict[str, Any]) -> None:
    s = gl.GadgetSampler(30, batch_size=4, seed=4)
    it = iter(s)
    next(it)
    good = s.state_dict()
    bad = dict(good, **edit)
    with pytest.raises(gl.GadgetError):
        s.load_state_dict(bad)
    assert s.state_dict() == good
    for missing in ("seed", "epoch", "position"):
        with pytest.raises(gl.GadgetValueError):
            s.load_state_dict({k: v for k, v in good.items() if k != missing})
    assert s.state_dict() == good
    # a loader state is not a sampler state, and the other way round
    with pytest.raises(gl.GadgetValueError):
        s.load_state_dict({"sampler": good})
    loader = gl.GadgetLoader(_one_col(30), batch_size=4, seed=4)
    with pytest.raises(gl.GadgetValueError):
        loader.load_state_dict(good)


def test_loader_refuses_a_state_of_another_world_size_and_keeps_its_own() -> None:
    ds = _one_col(40)
    other = gl.GadgetLoader(ds, batch_size=4, num_replicas=2, rank=0)
    next(iter(other))
    loader = gl.GadgetLoader(ds, batch_size=4, seed=5, prefetch=0)
    it = iter(loader)
    first = [_np(next(it)[0]).tolist() for _ in range(2)]
    before = loader.state_dict()
    with pytest.raises(gl.GadgetValueError, match="world size"):
        loader.load_state_dict(other.state_dict())
    assert loader.state_dict() == before
    rest = [_np(b[0]).tolist() for b in it]
    ref = gl.GadgetLoader(ds, batch_size=4, seed=5, prefetch=0)
    assert first + rest == _ids_of(ref)


# DEFECT: load_state_dict() while an earlier pass is still being consumed is overwritten
# when that pass ends: the loaded (epoch 0, position 1) becomes (epoch 1, position 1), so
# the next iter() resumes in the wrong epoch. README/docstring: "Continue from a
# state_dict: the next iter() resumes mid-epoch".
def test_load_state_dict_is_not_overwritten_by_a_pass_still_running() -> None:
    n = 30
    ref = gl.GadgetSampler(n, batch_size=4, seed=7)
    epoch0 = _np(ref.epoch_order(0))
    s = gl.GadgetSampler(n, batch_size=4, seed=7)
    it = iter(s)
    next(it)
    next(it)
    state = dict(s.state_dict(), position=1)  # rewind to after the first batch
    s.load_state_dict(state)
    for _ in it:  # the old pass is drained (e.g. the loop kept going)
        pass
    assert (s.state_dict()["epoch"], s.state_dict()["position"]) == (0, 1)
    got = np.concatenate([_np(b) for b in s])
    assert np.array_equal(got, epoch0[4:])


# DEFECT: the same through GadgetLoader: GadgetLoader.load_state_dict mid-pass, then the
# pass is consumed to its end; the next pass runs epoch 1 from position 1.
def test_loader_load_state_dict_mid_pass_is_kept() -> None:
    n = 30
    ds = _one_col(n)
    epoch0 = _np(gl.GadgetSampler(n, batch_size=4, seed=7).epoch_order(0))
    loader = gl.GadgetLoader(ds, batch_size=4, seed=7, prefetch=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.load_state_dict(state)
    for _ in it:
        pass
    got = np.concatenate([_np(b[0]) for b in loader])
    assert np.array_equal(got, epoch0[4:])


# DEFECT: set_epoch(e) for the epoch of a pass still running is undone when that pass
# ends: the next iter() starts epoch e + 1. Docstring: "Start epoch ``epoch`` from its
# first batch at the next iter()".
def test_set_epoch_is_not_overwritten_by_a_pass_still_running() -> None:
    n = 30
    epoch0 = _np(gl.GadgetSampler(n, batch_size=4, seed=7).epoch_order(0))
    s = gl.GadgetSampler(n, batch_size=4, seed=7)
    it = iter(s)
    next(it)
    s.set_epoch(0)
    for _ in it:
        pass
    got = np.concatenate([_np(b) for b in s])
    assert np.array_equal(got, epoch0)


# ---- workers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_over_file_columns(tmp_path: Any, persistent: bool) -> None:
    src = _source()
    p = _write(tmp_path, src)
    cols = [
        gl.DataGadget(p["npy"], placement="file"),
        gl.DataGadget(p["h5"], dataset="grp/half", placement="file"),
        gl.DataGadget(p["zarr"], dataset="ints", placement="file"),
        gl.DataGadget(src["flag"], placement="cpu"),
        src["ids"],
    ]
    names = ("f32", "f16", "i32", "flag", "ids")
    ds = gl.GadgetDataset(*cols, placement="cpu")  # device: the GPU where present
    dl = DataLoader(
        ds,
        batch_size=9,
        shuffle=True,
        num_workers=2,
        persistent_workers=persistent,
        generator=torch.Generator().manual_seed(0),
    )
    ref = TensorDataset(torch.arange(N))
    for epoch in range(2):
        got = list(dl)
        # README: "batches gathered in worker processes come as CPU tensors"
        assert all(t.device.type == "cpu" for b in got for t in b)
        ids = [_check_batch(b, src, names).tolist() for b in got]
        assert sorted(i for b in ids for i in b) == list(range(N)), epoch
    # the same generator seed gives torch's own order
    dl2 = DataLoader(ds, batch_size=9, shuffle=True, num_workers=2)
    ref_dl = DataLoader(ref, batch_size=9, shuffle=True)
    torch.manual_seed(5)
    a = _ids_of(dl2)
    torch.manual_seed(5)
    b = [x[0].tolist() for x in ref_dl]
    assert a == b
    del dl, dl2
    ds.close()


def test_workers_with_the_sampler_forms_and_gadget_loader(tmp_path: Any) -> None:
    src = _source()
    p = _write(tmp_path, src)
    ds = gl.GadgetDataset(p["h5"], src["ids"], placement="file", dataset="grp/half")
    names = ("f16", "ids")
    s = gl.GadgetSampler(ds, batch_size=8, seed=12)
    orders = [_np(s.epoch_order(e)) for e in range(2)]
    dl = DataLoader(ds, batch_sampler=s, num_workers=2, persistent_workers=True)
    for e in range(2):
        ids = np.concatenate([_check_batch(b, src, names) for b in dl])
        assert np.array_equal(ids, orders[e])
    s2 = gl.GadgetSampler(ds, batch_size=8, seed=12)
    ids = np.concatenate(
        [_check_batch(b, src, names) for b in DataLoader(ds, sampler=s2, batch_size=None)]
    )
    assert np.array_equal(ids, orders[0])
    # GadgetLoader with workers: batches on the dataset's device, resumable
    loader = gl.GadgetLoader(ds, batch_size=8, seed=12, num_workers=2)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    assert all(t.device.type == ds.device.type for b in first for t in b)
    state = loader.state_dict()
    assert state["sampler"]["position"] == 3
    del it
    again = gl.GadgetLoader(ds, batch_size=8, seed=0, num_workers=2)
    again.load_state_dict(state)
    rest = list(again)
    ids = np.concatenate([_check_batch(b, src, names) for b in first + rest])
    assert np.array_equal(ids, orders[0])
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=8, num_workers=2, coalesce=2)
    del dl
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_custom_collate_fn_gets_the_one_element_list(tmp_path: Any, workers: int) -> None:
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    np.save(tmp_path / "x.npy", x)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), np.arange(20), placement="file")
    dl = DataLoader(ds, batch_size=6, shuffle=True, num_workers=workers, collate_fn=_collate_double)
    seen = []
    for tag, x2, ids in dl:
        assert tag == "mine"
        assert np.array_equal(_np(x2), 2 * x[_np(ids)])
        seen.extend(_np(ids).tolist())
    assert sorted(seen) == list(range(20))
    ds.close()


def test_a_bad_id_in_a_worker_is_a_gadget_index_error() -> None:
    ds = _one_col(10)
    with pytest.raises(gl.GadgetIndexError):
        list(DataLoader(ds, batch_sampler=[[0, 1], [2, 10]], num_workers=1))
    with pytest.raises(gl.GadgetIndexError):
        list(DataLoader(ds, batch_sampler=[[0, -1]]))
    with pytest.raises(gl.GadgetTypeError):
        list(DataLoader(ds, batch_sampler=[[0.0, 1.0]]))


# ---- torch's helpers over a GadgetDataset ------------------------------------------------------
def test_random_split_and_torch_samplers_read_the_right_rows() -> None:
    n = 50
    x = np.random.default_rng(1).standard_normal((n, 3)).astype(np.float32)
    ds = gl.GadgetDataset(x, np.arange(n), placement="cpu")
    parts = random_split(ds, [0.6, 0.4], generator=torch.Generator().manual_seed(0))
    seen = []
    for part in parts:
        for xb, ib in DataLoader(part, batch_size=7, shuffle=True):
            assert np.array_equal(_np(xb), x[_np(ib)])
            seen.extend(_np(ib).tolist())
    assert sorted(seen) == list(range(n))
    sub = torch.utils.data.SubsetRandomSampler(np.array([3, 9, 1, 40, 41, 7]))
    got = [i for _, ib in DataLoader(ds, batch_size=4, sampler=sub) for i in _np(ib).tolist()]
    assert sorted(got) == [1, 3, 7, 9, 40, 41]
    w = torch.utils.data.WeightedRandomSampler(
        np.ones(n), 40, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    for xb, ib in DataLoader(ds, batch_size=16, sampler=w):  # repeats inside a batch
        assert np.array_equal(_np(xb), x[_np(ib)])


def test_gadget_batch_pickles_moves_and_collates() -> None:
    ds = gl.GadgetDataset(np.arange(10.0), np.arange(10), placement="cpu")
    b = ds[[4, 1]]
    c = pickle.loads(pickle.dumps(b))
    assert isinstance(c, gl.GadgetBatch)
    assert [_np(t).tolist() for t in c] == [[4.0, 1.0], [4, 1]]
    moved = b.to("cpu")
    assert isinstance(moved, gl.GadgetBatch) and moved[0].device.type == "cpu"
    x, y = b
    assert _np(y).tolist() == [4, 1]
    joined = torch.utils.data.default_collate([b, ds[[7]]])
    assert isinstance(joined, gl.GadgetBatch)
    assert [_np(t).tolist() for t in joined] == [[4.0, 1.0, 7.0], [4, 1, 7]]


def test_a_sampler_batch_pickles_as_its_own_ids() -> None:
    s = gl.GadgetSampler(4000, batch_size=4, seed=1)
    b = next(iter(s))
    small = pickle.dumps(b)
    assert len(small) < len(pickle.dumps(s.epoch_order())) // 8
    back = pickle.loads(small)
    assert torch.equal(back, b.clone())


# ---- chunk order over file columns --------------------------------------------------------------
@pytest.mark.parametrize("chunks, expected", [((4, 6), 12), ((4, 5), 5), ((8, 8), 8)])
def test_chunk_order_follows_the_file_chunks(
    tmp_path: Any, chunks: tuple[int, int], expected: int
) -> None:
    n = 100
    x = np.arange(n, dtype=np.float32)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(chunks[0],))
    z = zarr.open_array(
        str(tmp_path / "b.zarr"), mode="w", shape=(n,), chunks=(chunks[1],), dtype="float32"
    )
    z[:] = x
    a = gl.DataGadget(tmp_path / "a.h5", placement="file")
    b = gl.DataGadget(tmp_path / "b.zarr", placement="file")
    ds = gl.GadgetDataset(a, b, np.arange(n), placement="cpu")
    assert ds.chunk_rows == expected
    for world in (1, 3):
        samplers = [
            gl.GadgetSampler(
                ds, batch_size=5, order="chunk", window_chunks=2, num_replicas=world, rank=r
            )
            for r in range(world)
        ]
        assert samplers[0].chunk_rows == expected
        order = _np(samplers[0].epoch_order(0))
        for c in range(math.ceil(n / expected)):  # a chunk's rows stay inside one window
            pos = np.nonzero(order // expected == c)[0]
            assert pos.max() - pos.min() < 2 * expected
        seen = []
        for s in samplers:
            for xa, xb, ib in DataLoader(ds, batch_sampler=s):
                ids = _np(ib)
                assert np.array_equal(_np(xa), x[ids]) and np.array_equal(_np(xb), x[ids])
                seen.extend(ids.tolist())
        assert sorted(seen) == list(range(n))
    ds.close()
    a.close()
    b.close()


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_datasets_are_clear_errors(tmp_path: Any) -> None:
    x = np.zeros((10, 2), np.float32)
    with pytest.raises(gl.GadgetValueError, match="same number of rows"):
        gl.GadgetDataset(x, np.arange(9), placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(np.zeros((0, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(placement="cpu")
    np.save(tmp_path / "empty.npy", np.zeros((0, 3), np.float32))
    with pytest.raises(gl.GadgetError, match="empty.npy"):
        gl.GadgetDataset(str(tmp_path / "empty.npy"), placement="cpu")
    with pytest.raises(gl.GadgetFileNotFoundError, match="missing.npy"):
        gl.GadgetDataset(str(tmp_path / "missing.npy"), np.arange(3), placement="cpu")
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.GadgetDataset(str(tmp_path / "missing.h5"), placement="file", dataset="x")
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f.create_dataset("alpha", data=x)
        f.create_dataset("grp/beta", data=x)
    with pytest.raises(gl.GadgetKeyError, match="alpha") as err:
        gl.GadgetDataset(str(tmp_path / "two.h5"), placement="file", dataset="gamma")
    assert "grp/beta" in str(err.value)
    # without dataset= a file of two arrays cannot be guessed
    with pytest.raises(gl.GadgetError, match="alpha"):
        gl.GadgetDataset(str(tmp_path / "two.h5"), placement="file")
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    g.create_array("ints", shape=(5,), chunks=(2,), dtype="int32")[:] = 1
    g.create_array("sub/more", shape=(5,), chunks=(2,), dtype="int32")[:] = 2
    for where in ("file", "cpu"):
        with pytest.raises(gl.GadgetKeyError, match="sub/more"):
            gl.GadgetDataset(str(tmp_path / "g.zarr"), placement=where, dataset="nope")
        with pytest.raises(gl.GadgetKeyError, match="ints"):
            gl.GadgetDataset(str(tmp_path / "g.zarr"), placement=where)
        ok = gl.GadgetDataset(str(tmp_path / "g.zarr"), placement=where, dataset="sub/more")
        assert _np(ok[[0, 4]][0]).tolist() == [2, 2]
        ok.close()
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.GadgetDataset(str(tmp_path / "nothere.zarr"), placement="file")
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetDataset([1, 2, 3], placement="cpu")
    with pytest.raises(gl.GadgetTypeError):  # file options without a file column
        gl.GadgetDataset(x, placement="cpu", dataset="alpha")
    # a refused dataset leaves the HDF5 file it opened closed (writable again)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(str(tmp_path / "two.h5"), np.arange(3), placement="file", dataset="alpha")
    with h5py.File(tmp_path / "two.h5", "a") as f:
        f["alpha"][0, 0] = 1.0


@pytest.mark.parametrize("bs", [0, -1, 2.0, True, "4", None])
def test_bad_batch_sizes(bs: Any) -> None:
    ds = _one_col(10)
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(ds, batch_size=bs)
    with pytest.raises(gl.GadgetError):
        gl.GadgetLoader(ds, batch_size=bs)


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(window_chunks=0), gl.GadgetValueError),
        (dict(window_chunks=-2), gl.GadgetValueError),
        (dict(window_chunks=1.5), gl.GadgetTypeError),
        (dict(window_chunks=True), gl.GadgetTypeError),
        (dict(chunk_rows=0), gl.GadgetValueError),
        (dict(order="shuffled"), gl.GadgetKeyError),
        (dict(num_replicas=0), gl.GadgetValueError),
        (dict(num_replicas=2, rank=2), gl.GadgetValueError),
        (dict(rank=-1), gl.GadgetValueError),
        (dict(seed=-1), gl.GadgetValueError),
        (dict(seed=1.0), gl.GadgetTypeError),
        (dict(drop_last=True, pad=True), gl.GadgetValueError),
        (dict(drop_last=1), gl.GadgetTypeError),
    ],
    ids=str,
)
def test_bad_sampler_options(kw: dict[str, Any], err: type) -> None:
    kw = dict(kw)
    kw.setdefault("order", "chunk")
    kw.setdefault("chunk_rows", 4)
    with pytest.raises(err):
        gl.GadgetSampler(20, batch_size=4, **kw)


def test_chunk_order_without_file_columns_asks_for_chunk_rows() -> None:
    with pytest.raises(gl.GadgetValueError, match="chunk_rows"):
        gl.GadgetSampler(_one_col(20), batch_size=4, order="chunk")


def test_ids_to_ds_getitem(placement: str) -> None:
    n = 11
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    ds = gl.GadgetDataset(x, np.arange(n), placement=placement)
    # an int and a slice follow Python
    assert _np(ds[-1][0]).tolist() == x[-1].tolist()
    assert _np(ds[-n][1]).item() == 0
    assert _np(ds[-3:][1]).tolist() == [8, 9, 10]
    assert _np(ds[::-4][1]).tolist() == [10, 6, 2]
    with pytest.raises(gl.GadgetIndexError):
        ds[n]
    with pytest.raises(gl.GadgetIndexError):
        ds[-n - 1]
    # ids in lists, arrays and tensors must lie in [0, len(ds))
    for bad in ([n], [-1], np.array([0, -1]), torch.tensor([n + 5]), np.array([2**40])):
        with pytest.raises(gl.GadgetIndexError):
            ds[bad]
    for bad in ([0.0], np.array([1.0]), torch.tensor([1.0]), [True, False], np.array([True]), 1.5):
        with pytest.raises(gl.GadgetTypeError):
            ds[bad]
    # ids of any integer dtype and shape; repeats allowed
    for ids in (np.array([3, 3, 0], np.uint8), torch.tensor([[1, 2], [2, 1]], dtype=torch.int16)):
        b = ds[ids]
        ref = np.asarray(ids)
        assert np.array_equal(_np(b[0]), x[ref]) and np.array_equal(_np(b[1]), ref)
    empty = ds[[]]
    assert _np(empty[0]).shape == (0, 2)


def test_a_sampler_handed_to_sampler_without_batch_size_none_is_refused() -> None:
    ds = _one_col(12)
    s = gl.GadgetSampler(ds, batch_size=4)
    with pytest.raises(gl.GadgetValueError, match="batch_sampler"):
        list(DataLoader(ds, sampler=s))


def test_gadget_loader_argument_errors() -> None:
    ds = _one_col(12)
    s = gl.GadgetSampler(ds, batch_size=4)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=s, batch_size=4)
    with pytest.raises(gl.GadgetValueError, match="seed"):
        gl.GadgetLoader(ds, sampler=s, seed=0)
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetLoader(ds, batch_size=4, shuffle=True)
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetLoader(ds, batch_size=4, collate_fn=_collate_double)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(13, batch_size=4))
    for bad in (dict(prefetch=-1), dict(coalesce=0), dict(num_workers=-1)):
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetLoader(ds, batch_size=4, **bad)
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetLoader(ds, batch_size=4, prefetch=1.0)


def test_docstring_rank_example_and_the_extra_row_rule() -> None:
    got = [
        [
            _np(b).tolist()
            for b in gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r)
        ]
        for r in (0, 1)
    ]
    assert got == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]


@pytest.mark.parametrize("bs, cr", [(5, 4), (1, 3), (64, 7)])
def test_default_window_holds_sixteen_batches_and_eight_chunks(bs: int, cr: int) -> None:
    s = gl.GadgetSampler(1000, batch_size=bs, order="chunk", chunk_rows=cr)
    w = s.window_chunks
    assert w >= 8 and w * cr >= 16 * bs
    assert w == 8 or (w - 1) * cr < 16 * bs  # no more than needed


def test_a_reloaded_or_closed_column_is_a_clear_error(tmp_path: Any) -> None:
    n = 20
    np.save(tmp_path / "same.npy", np.arange(n, dtype=np.float32) * 2)
    np.save(tmp_path / "longer.npy", np.arange(n + 10, dtype=np.float32))
    g = gl.DataGadget(np.arange(n, dtype=np.float32), placement="cpu")
    ds = gl.GadgetDataset(g, np.arange(n), device="cpu")
    s = gl.GadgetSampler(ds, batch_size=4, seed=0)
    g.load(tmp_path / "same.npy")  # same rows: the new values are read
    for xb, ib in DataLoader(ds, batch_sampler=s):
        assert np.array_equal(_np(xb), 2 * _np(ib).astype(np.float32))
    g.load(tmp_path / "longer.npy")
    for read in (
        lambda: ds[[1, 2]],
        lambda: ds[3],
        lambda: list(DataLoader(ds, batch_sampler=s)),
        lambda: list(DataLoader(ds, batch_size=3)),
        lambda: list(gl.GadgetLoader(ds, batch_size=4)),
    ):
        with pytest.raises(gl.GadgetValueError, match="rows"):
            read()
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        ds[[1, 2]]
    with pytest.raises(gl.GadgetClosedError):
        list(gl.GadgetLoader(ds, batch_size=4))


def test_per_sample_dataloader_and_row_bytes(tmp_path: Any) -> None:
    ds, src = _mixed_dataset(tmp_path, "cpu")
    assert ds.row_nbytes == 3 * 4 + 2 * 2 + 4 * 4 + 1 + 1 + 3 * 4 + 8 + 8
    assert len(ds.columns) == len(MIXED)
    g = torch.Generator().manual_seed(2)
    seen = []
    for row in DataLoader(ds, batch_size=None, shuffle=True, generator=g):
        i = int(_np(row[-1]))
        for col, name in zip(row, MIXED, strict=True):
            assert np.array_equal(_np(col), src[name][i]), name
        seen.append(i)
    assert sorted(seen) == list(range(N))
    ds.close()
