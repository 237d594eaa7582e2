"""Review session 15: the input pipeline used as a demanding PyTorch user would.

``DataLoader(GadgetDataset(...))`` with a custom ``collate_fn``, ``generator=``, worker
processes (persistent, pinned) over file-backed columns of mixed dtypes; ``GadgetSampler``
sharding / ``drop_last`` / ``pad`` / resume; ``GadgetLoader`` with mixed column sources,
early breaks and resumes into loaders built differently. Every check compares with NumPy
and counts rows per epoch; refused calls are checked for their error class and message.

Datasets are built with ``device="cpu"`` (and ``.cpu()`` before ``.numpy()``), so the file
runs the same on CPU-only and CUDA machines.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

ROWS = 37


def _columns(tmp: Path) -> tuple[list[Any], list[np.ndarray]]:
    """Columns of mixed sources and dtypes, and their NumPy references.

    float16 2-D features (an array), int64 1-D labels (a tensor), a float32 .npy path, an
    int32 HDF5 DataGadget (file-backed, gzip, chunks of 4) and a float64 zarr path."""
    rng = np.random.default_rng(15)
    feats = rng.standard_normal((ROWS, 3)).astype(np.float16)
    labels = rng.integers(-(2**40), 2**40, ROWS).astype(np.int64)
    npy = rng.standard_normal((ROWS, 2)).astype(np.float32)
    h5 = rng.integers(-1000, 1000, (ROWS, 2)).astype(np.int32)
    zr = rng.standard_normal(ROWS)
    np.save(tmp / "c.npy", npy)
    with h5py.File(tmp / "c.h5", "w") as f:
        f.create_dataset("h", data=h5, chunks=(4, 2), compression="gzip")
    z = zarr.open(str(tmp / "c.zarr"), mode="w", shape=(ROWS,), chunks=(5,), dtype="f8")
    z[:] = zr
    h5_gadget = gl.DataGadget(str(tmp / "c.h5"), placement="file", device="cpu")
    cols = [feats, torch.from_numpy(labels), str(tmp / "c.npy"), h5_gadget, tmp / "c.zarr"]
    return cols, [feats, labels, npy, h5, zr]


def _check_batch(batch: Any, refs: list[np.ndarray], ids: np.ndarray) -> None:
    assert len(batch) == len(refs)
    for col, ref in zip(batch, refs, strict=True):
        got = col.cpu().numpy()
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got, ref[ids])


# ---- defects -------------------------------------------------------------------------------------


# DEFECT: after epoch 2**64-1 the sampler advances by itself to epoch 2**64 and silently replays epoch 0's order (its own state_dict then cannot be loaded)
def test_the_epoch_after_the_last_64_bit_epoch_is_refused_not_wrapped() -> None:
    s = gl.GadgetSampler(10, batch_size=5, seed=1)
    epoch0 = [b.tolist() for b in s]
    s.set_epoch(2**64 - 1)  # accepted: the last epoch that is its own
    last = [b.tolist() for b in s]
    assert sorted(sum(last, [])) == list(range(10))
    # a state the sampler produced must load into a sampler of the same settings
    fresh = gl.GadgetSampler(10, batch_size=5, seed=1)
    fresh.load_state_dict(s.state_dict())
    # set_epoch(2**64) is refused as "mixed as 64 bits, a larger one would repeat an earlier
    # epoch's order"; running past the last epoch must not do that silently either
    with pytest.raises(gl.GadgetValueError, match="2\\*\\*64"):
        replay = [b.tolist() for b in s]
        print("replayed", replay, "epoch 0 was", epoch0)


# DEFECT: load_state_dict(None / a list / a path string) raises GadgetValueError; an argument of the wrong kind should be GadgetTypeError (README's error table; torch's load_state_dict raises TypeError)
@pytest.mark.parametrize("bad", [None, [1, 2], "ckpt/sampler.pt", 3])
def test_a_state_that_is_not_a_dict_is_a_type_error(bad: Any) -> None:
    ds = gl.GadgetDataset(np.arange(12), placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=4, seed=2)
    loader = gl.GadgetLoader(ds, batch_size=4, seed=2)
    s_state, l_state = s.state_dict(), loader.state_dict()
    for target in (s, loader):
        with pytest.raises(gl.GadgetTypeError) as info:
            target.load_state_dict(bad)
        assert isinstance(info.value, TypeError)
        assert "dict" in str(info.value) and type(bad).__name__ in str(info.value)
    assert s.state_dict() == s_state and loader.state_dict() == l_state


# DEFECT: load_state_dict refuses a read-only Mapping (types.MappingProxyType) holding a complete state, as "not a GadgetSampler state"; torch's load_state_dict takes any Mapping
def test_a_state_in_a_read_only_mapping_loads() -> None:
    ds = gl.GadgetDataset(np.arange(12), placement="cpu", device="cpu")
    src = gl.GadgetLoader(ds, batch_size=4, seed=2, order="sequential")
    it = iter(src)
    next(it)
    state = src.state_dict()
    s = gl.GadgetSampler(ds, batch_size=4, seed=2, order="sequential")
    s.load_state_dict(types.MappingProxyType(state["sampler"]))
    assert [b.tolist() for b in s] == [[4, 5, 6, 7], [8, 9, 10, 11]]
    loader = gl.GadgetLoader(ds, batch_size=4, seed=2, order="sequential")
    loader.load_state_dict(types.MappingProxyType({"sampler": dict(state["sampler"])}))
    assert [b[0].tolist() for b in loader] == [[4, 5, 6, 7], [8, 9, 10, 11]]


# DEFECT: GadgetBatch.to(torch.float16) (a dtype given to "to(device)") casts every column, so int64 labels silently become float16 and lose their values
def test_batch_to_a_dtype_does_not_cast_integer_labels() -> None:
    labels = np.array([2049, 65519, 3, 2**40 + 1], dtype=np.int64)
    ds = gl.GadgetDataset(np.ones((4, 2), np.float32), labels, placement="cpu", device="cpu")
    batch = ds[[0, 1, 2, 3]]
    try:
        out = batch.to(torch.float16)
    except TypeError:
        return  # refused: to() takes a device (acceptable)
    # else only what a dtype cast may touch changes (as PackedSequence.to keeps its indices)
    assert out[1].dtype == torch.int64
    np.testing.assert_array_equal(out[1].cpu().numpy(), labels)


# ---- verified behaviour ----------------------------------------------------------------------


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    bs=st.integers(1, 9),
    world=st.integers(1, 3),
    mode=st.sampled_from(["default", "drop_last", "pad"]),
    order=st.sampled_from(["random", "sequential", "chunk"]),
    coalesce=st.integers(1, 4),
)
def test_mixed_source_loader_over_ranks_every_row_and_len(
    tmp_path: Path, bs: int, world: int, mode: str, order: str, coalesce: int
) -> None:
    """Mixed sources and dtypes through GadgetLoader on every rank: len() equals the batches
    produced, every batch equals NumPy at the sampler's ids, and over the ranks each row
    comes once (default), at most once (drop_last) or at least once in full batches (pad)."""
    d = tmp_path / f"{bs}-{world}-{mode}-{order}-{coalesce}"
    d.mkdir()
    cols, refs = _columns(d)
    ds = gl.GadgetDataset(*cols, placement="file", device="cpu")
    try:
        seen: list[int] = []
        kw = {"drop_last": mode == "drop_last", "pad": mode == "pad"}
        lengths = set()
        for rank in range(world):
            sampler = gl.GadgetSampler(
                ds, batch_size=bs, order=order, seed=4, num_replicas=world, rank=rank, **kw
            )
            expected = [b.clone() for b in sampler]
            loader = gl.GadgetLoader(ds, sampler=sampler, coalesce=coalesce)
            sampler.set_epoch(0)
            batches = list(loader)
            assert len(batches) == len(loader) == len(sampler) == len(expected)
            lengths.add(len(batches))
            for ids, batch in zip(expected, batches, strict=True):
                _check_batch(batch, refs, ids.numpy())
                seen += ids.tolist()
                if mode != "default":
                    assert len(ids) == bs
        assert len(lengths) == 1  # every rank the same number of batches
        if mode == "default":
            assert sorted(seen) == list(range(ROWS))
        elif mode == "drop_last":
            assert len(set(seen)) == len(seen) > ROWS - world * bs
        else:
            assert set(seen) == set(range(ROWS)) and len(seen) < ROWS + world * bs
    finally:
        ds.close()
        cols[3].close()


def _collate(batch: list[Any]) -> dict[str, torch.Tensor]:
    (b,) = batch  # the documented one-element list
    return {"x": b[0], "y": b[1], "npy": b[2], "h5": b[3], "zr": b[4]}


def test_default_form_workers_generator_custom_collate_file_columns(tmp_path: Path) -> None:
    """DataLoader(GadgetDataset) with a seeded generator, a dict-building collate_fn, two
    persistent workers, pin_memory=True and file-backed .npy / HDF5 / zarr columns: over two
    epochs it yields exactly the batches torch's own DataLoader (same options, same seed)
    draws, each row once per epoch with NumPy's values, and the same again when rerun."""
    cols, refs = _columns(tmp_path)
    ds = gl.GadgetDataset(*cols, placement="file", device="cpu")
    keys = ["x", "y", "npy", "h5", "zr"]
    opts: dict[str, Any] = {
        "batch_size": 8,
        "shuffle": True,
        "num_workers": 2,
        "persistent_workers": True,
        "pin_memory": True,
    }

    def epochs(dataset: Any, **kw: Any) -> list[list[Any]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pin_memory without CUDA
            dl = DataLoader(dataset, generator=torch.Generator().manual_seed(123), **opts, **kw)
            out = [list(dl) for _ in range(2)]
        assert all(len(e) == len(dl) == 5 for e in out)
        return out

    try:
        rows = epochs(TensorDataset(torch.arange(ROWS)))
        ours = epochs(ds, collate_fn=_collate)
        again = epochs(ds, collate_fn=_collate)
        for ep_rows, ep, ep_again in zip(rows, ours, again, strict=True):
            ids = torch.cat([r[0] for r in ep_rows])
            assert sorted(ids.tolist()) == list(range(ROWS))
            for (r,), b, b2 in zip(ep_rows, ep, ep_again, strict=True):
                _check_batch([b[k] for k in keys], refs, r.numpy())
                assert all(torch.equal(b[k].cpu(), b2[k].cpu()) for k in keys)
        # the two epochs are shuffled differently
        assert not torch.equal(
            torch.cat([b["y"].cpu() for b in ours[0]]), torch.cat([b["y"].cpu() for b in ours[1]])
        )
    finally:
        ds.close()
        cols[3].close()


def test_resume_after_set_epoch_into_other_loaders(tmp_path: Path) -> None:
    """A loader broken mid-epoch (coalesced) after set_epoch resumes exactly in a loader of
    another seed / coalesce / worker count; a loader of another batch size refuses the state
    with a GadgetValueError naming batch_size and keeps its own position."""
    cols, refs = _columns(tmp_path)
    ds = gl.GadgetDataset(*cols, placement="file", device="cpu")
    try:
        ref = gl.GadgetLoader(ds, batch_size=5, seed=9, pad=True, coalesce=3)
        ref.set_epoch(6)
        epoch6 = [b[1].cpu().clone() for b in ref]
        epoch7 = [b[1].cpu().clone() for b in ref]
        assert len(epoch6) == len(ref) == 8

        first = gl.GadgetLoader(ds, batch_size=5, seed=9, pad=True, coalesce=3)
        first.set_epoch(6)
        for i, _batch in enumerate(first):
            if i == 3:
                break
        state = first.state_dict()
        assert state["sampler"]["epoch"] == 6 and state["sampler"]["position"] == 4

        other = gl.GadgetLoader(ds, batch_size=5, seed=0, pad=True, num_workers=1)
        other.load_state_dict(state)
        rest = list(other)
        assert len(rest) == 4
        for expected, batch in zip(epoch6[4:], rest, strict=True):
            assert torch.equal(batch[1].cpu(), expected)
        pos = {int(v): i for i, v in enumerate(refs[1])}
        for batch in rest:
            _check_batch(batch, refs, np.array([pos[int(v)] for v in batch[1].cpu()]))
        nxt = [b[1].cpu() for b in other]
        assert all(torch.equal(a, b) for a, b in zip(nxt, epoch7, strict=True))

        wrong = gl.GadgetLoader(ds, batch_size=4, seed=9, pad=True)
        before = wrong.state_dict()
        with pytest.raises(gl.GadgetValueError, match="batch_size=5.*batch_size=4"):
            wrong.load_state_dict(state)
        assert wrong.state_dict() == before
    finally:
        ds.close()
        cols[3].close()


def test_break_early_then_iterate_again_replays_the_epoch() -> None:
    """Breaking out of a coalescing loader replays the unfinished epoch from its start
    (every row once), the following pass is the next epoch; len() never changes."""
    x = np.arange(ROWS * 2, dtype=np.float16).reshape(ROWS, 2)
    ds = gl.GadgetDataset(x, torch.arange(ROWS), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, seed=5, coalesce=4)
    full0 = [b[1].clone() for b in gl.GadgetLoader(ds, batch_size=4, seed=5)]
    for i, _ in enumerate(loader):
        if i == 1:
            break
    again = [b[1].cpu() for b in loader]
    assert len(again) == len(loader) == len(full0) == 10
    assert all(torch.equal(a, b.cpu()) for a, b in zip(again, full0, strict=True))
    nxt = [b for b in loader]
    ids = torch.cat([b[1].cpu() for b in nxt])
    assert sorted(ids.tolist()) == list(range(ROWS))
    assert not torch.equal(ids, torch.cat(again))
    for b in nxt:
        np.testing.assert_array_equal(b[0].cpu().numpy(), x[b[1].cpu().numpy()])
