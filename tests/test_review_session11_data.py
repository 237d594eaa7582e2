"""Session 11 review of the input pipeline: GadgetDataset, GadgetSampler, GadgetLoader and
GadgetBatch inside torch's DataLoader (workers, pinning, collate, samplers, resume).

Every check compares against an independent reference: the source tensors indexed by the
ids each batch carries (the last column of every dataset here is ``arange(n)``), torch's own
samplers, or an uninterrupted run of the same sampler.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import os
import pickle
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    StackDataset,
    Subset,
    TensorDataset,
    default_collate,
    random_split,
)

import gadgetloader as gl
import gadgetloader.data._sampler as sampler_module

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

N = 37


# ---- helpers ----------------------------------------------------------------------------------
def _columns(n: int = N) -> list[torch.Tensor]:
    """Columns of mixed dtypes and row shapes; the last one is the row id."""
    g = torch.Generator(device="cpu").manual_seed(0)
    return [
        torch.randn(n, 2, 3, generator=g, device="cpu"),
        torch.arange(n, device="cpu") % 3 == 0,
        (torch.arange(n, device="cpu") % 251).to(torch.uint8),
        torch.randn(n, generator=g, device="cpu").to(torch.float16),
        torch.randn(n, 4, generator=g, device="cpu").to(torch.bfloat16),
        (torch.arange(n, device="cpu") - 20).to(torch.int8),
        torch.arange(n, dtype=torch.int64, device="cpu"),
    ]


def _check(batch: Any, cols: list[Any]) -> list[int]:
    """Every column of ``batch`` equals the reference rows at the batch's ids (last column)."""
    assert len(batch) == len(cols)
    ids = torch.as_tensor(batch[-1]).cpu()
    for t, c in zip(batch, cols, strict=True):
        t = torch.as_tensor(t).cpu()
        if isinstance(c, torch.Tensor):
            ref = c[ids]
        else:
            ref = torch.from_numpy(np.ascontiguousarray(np.asarray(c)[ids.numpy()]))
        assert t.dtype == ref.dtype
        assert torch.equal(t, ref)
    return ids.tolist()


def _ids(batches: Any) -> list[list[int]]:
    return [torch.as_tensor(b[-1]).cpu().tolist() for b in batches]


def _sampler_ids(sampler: gl.GadgetSampler) -> list[list[int]]:
    return [b.tolist() for b in sampler]


def _write_files(tmp_path: Any, x: np.ndarray) -> dict[str, str]:
    paths = {
        "npy": str(tmp_path / "x.npy"),
        "h5": str(tmp_path / "x.h5"),
        "zarr": str(tmp_path / "x.zarr"),
    }
    np.save(paths["npy"], x)
    with h5py.File(paths["h5"], "w") as f:
        f.create_dataset("x", data=x, chunks=(4,) + x.shape[1:], compression="gzip")
    z = zarr.open_array(
        paths["zarr"], mode="w", shape=x.shape, chunks=(6,) + x.shape[1:], dtype=x.dtype
    )
    z[:] = x
    return paths


def _collate_report(batch: list[Any]) -> dict[str, Any]:
    """A user collate_fn (module level: picklable for spawn workers)."""
    return {
        "items": len(batch),
        "kind": type(batch[0]).__name__,
        "x2": batch[0][0] * 2,
        "ids": batch[0][-1],
    }


class _FailOnRow(gl.GadgetDataset):
    """Raises while ``flag`` (a file, so that worker processes see it too) exists and the
    request holds row ``bad``."""

    flag = ""
    bad = 13

    def gather(self, indices: Any) -> gl.GadgetBatch:
        if os.path.exists(self.flag) and self.bad in torch.as_tensor(indices).reshape(-1).tolist():
            raise gl.GadgetValueError("injected failure")
        return super().gather(indices)


# ---- DataLoader, default form -----------------------------------------------------------------
def test_default_form_mixed_dtypes_every_row_once(placement: str, device: torch.device) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement=placement, device=device)
    for _ in range(2):
        seen = []
        batches = list(DataLoader(ds, batch_size=5, shuffle=True))
        assert len(batches) == -(-N // 5)
        for b in batches:
            assert isinstance(b, gl.GadgetBatch)
            assert all(t.device.type == device.type for t in b)  # GPU batches where CUDA is
            seen += _check(b, cols)
        assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("workers", [0, 2])
def test_default_form_follows_torch_samplers_drop_last_and_generator(workers: int) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    ref_ds = TensorDataset(torch.arange(N, device="cpu"))
    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "fork"
    for drop_last in (False, True):

        def make(d: Any, seed: int, drop: bool = drop_last) -> DataLoader:
            g = torch.Generator(device="cpu").manual_seed(seed)
            return DataLoader(d, batch_size=6, shuffle=True, drop_last=drop, generator=g, **kw)

        got = [_check(b, cols) for b in make(ds, 11)]
        want = [b[0].tolist() for b in make(ref_ds, 11)]
        assert got == want  # the same batches as torch's own samplers
        assert got == [_check(b, cols) for b in make(ds, 11)]  # reproducible
        assert got != [_check(b, cols) for b in make(ds, 12)]
        assert len(make(ds, 0)) == len(got) == (N // 6 if drop_last else -(-N // 6))
        if drop_last:
            assert all(len(b) == 6 for b in got)


@pytest.mark.parametrize("workers", [0, 2])
def test_user_collate_fn_gets_the_one_element_list(workers: int) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    kw: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
    dl = DataLoader(
        ds, batch_size=8, shuffle=True, collate_fn=_collate_report, num_workers=workers, **kw
    )
    seen = []
    for out in dl:
        # "A custom collate_fn receives that one-element list (take batch[0])"
        assert out["items"] == 1 and out["kind"] == "GadgetBatch"
        ids = out["ids"].cpu()
        assert torch.equal(out["x2"].cpu(), cols[0][ids] * 2)
        seen += ids.tolist()
    assert sorted(seen) == list(range(N))


def test_subset_and_random_split_read_the_right_rows(placement: str, device: torch.device) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement=placement, device=device)
    picks = [3, 5, 36, 0, 11]
    for indices in (picks, np.array(picks), torch.tensor(picks, device="cpu")):
        got = [_check(b, cols) for b in DataLoader(Subset(ds, indices), batch_size=2)]
        assert got == [[3, 5], [36, 0], [11]]
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = random_split(ds, [0.6, 0.4], generator=g)
    seen_a = [i for x in DataLoader(a, batch_size=4, shuffle=True) for i in _check(x, cols)]
    seen_b = [i for x in DataLoader(b, batch_size=4) for i in _check(x, cols)]
    assert sorted(seen_a) == sorted(a.indices) and seen_b == list(b.indices)
    assert sorted(seen_a + seen_b) == list(range(N))


def test_stack_dataset_limit_and_its_replacement() -> None:
    """README: ``__getitems__`` returns one batch per call (a one-element list), so torch's
    ``StackDataset``, which wants one sample per index from it, refuses a GadgetDataset;
    the documented replacement -- the extra column in the same GadgetDataset -- yields what
    StackDataset over per-sample datasets would."""
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    weights = torch.arange(N, dtype=torch.float64, device="cpu") / 7
    with pytest.raises(ValueError, match="size mismatch"):
        list(DataLoader(StackDataset(ds, TensorDataset(weights)), batch_size=4))
    both = gl.GadgetDataset(*cols, weights, placement="cpu", device="cpu")
    plain = StackDataset(*(TensorDataset(c) for c in cols))
    ref = list(DataLoader(StackDataset(plain, TensorDataset(weights)), batch_size=4))
    got = list(DataLoader(both, batch_size=4))
    assert len(got) == len(ref) == -(-N // 4)
    for k, (mine, (r_cols, (w,))) in enumerate(zip(got, ref, strict=True)):
        ids = list(range(4 * k, min(4 * k + 4, N)))
        assert _check(mine[:-1], cols) == ids
        for m, (r,) in zip(mine[:-1], r_cols, strict=True):
            assert m.dtype == r.dtype and torch.equal(m.cpu(), r)
        assert torch.equal(mine[-1].cpu(), w)


def test_concat_dataset_of_gadget_datasets() -> None:
    cols = _columns()
    a = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    both = a + a  # torch's ConcatDataset: per-sample rows, stacked by default_collate
    got = list(DataLoader(both, batch_size=5, shuffle=False))
    assert len(got) == -(-2 * N // 5)
    flat = [i for b in got for i in _check(b, cols)]
    assert flat == list(range(N)) * 2


def test_close_frees_own_columns_only_and_reads_then_fail_clearly() -> None:
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    user = gl.DataGadget(x, placement="cpu", device="cpu")
    with gl.GadgetDataset(user, np.arange(10, dtype=np.int16), device="cpu") as ds:
        assert ds.row_nbytes == 4 * 4 + 2
        own = ds.columns[1]
    ds.close()  # idempotent
    assert ds.columns[0] is user
    assert torch.equal(user.getData([1]).cpu(), torch.from_numpy(x[[1]]))  # still open
    with pytest.raises(gl.GadgetClosedError):
        own.getData([1])
    with pytest.raises(gl.GadgetClosedError):
        ds[[1]]
    with pytest.raises(gl.GadgetClosedError):
        list(DataLoader(ds, batch_size=4))
    with pytest.raises(gl.GadgetClosedError):
        list(gl.GadgetLoader(ds, batch_size=4))


def test_pin_memory_true_gives_the_same_batches(device: torch.device) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device=device)
    for workers in (0, 2):
        kw: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
        with warnings.catch_warnings():
            # torch warns that pin_memory is moot where no accelerator is found
            warnings.simplefilter("ignore", UserWarning)
            dl = DataLoader(ds, batch_size=7, pin_memory=True, num_workers=workers, **kw)
            got = list(dl)
        assert _ids(got) == [list(range(i, min(i + 7, N))) for i in range(0, N, 7)]
        for b in got:
            assert isinstance(b, (list, tuple))
            _check(b, cols)
            if device.type == "cuda" and workers:  # CPU batches from workers, pinned
                assert all(t.device.type == "cpu" and t.is_pinned() for t in b)
            elif device.type == "cuda":  # GPU batches pass through unchanged
                assert all(t.is_cuda for t in b)


# ---- DataLoader workers -----------------------------------------------------------------------
def test_fork_workers_by_placement(placement: str) -> None:
    """Workers gather on the CPU (pinned and cpu columns); cuda columns are a clear error."""
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement=placement)
    workers = 1 if placement == "cuda" else 2  # torch waits 5 s per worker after an error
    dl = DataLoader(
        ds, batch_size=6, shuffle=True, num_workers=workers, multiprocessing_context="fork"
    )
    if placement == "cuda":
        with pytest.raises(gl.GadgetTypeError):
            list(dl)
        return
    seen = []
    for b in dl:
        assert all(t.device.type == "cpu" for t in b)  # CUDA is never used in a worker
        seen += _check(b, cols)
    assert sorted(seen) == list(range(N))


def test_spawn_persistent_workers_file_and_memory_columns(tmp_path: Any) -> None:
    """spawn pickles the dataset: .npy / HDF5 / zarr file columns reopen in the worker, a
    memory-mapped array and in-RAM tensors travel by value; two epochs on one worker."""
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    paths = _write_files(tmp_path, x)
    mm = np.load(paths["npy"], mmap_mode="r")
    cols = _columns()
    file_cols = [
        gl.DataGadget(paths[k], placement="file", device="cpu") for k in ("npy", "h5", "zarr")
    ]
    ds = gl.GadgetDataset(*file_cols, mm, *cols, device="cpu")
    refs = [x, x, x, x, *cols]
    dl = DataLoader(
        ds,
        batch_size=8,
        shuffle=True,
        num_workers=1,
        multiprocessing_context="spawn",
        persistent_workers=True,
    )
    for _ in range(2):
        seen = [i for b in dl for i in _check(b, refs)]
        assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("fmt", ["cpu", "npy", "h5", "zarr"])
def test_non_persistent_workers_see_writes_made_between_epochs(tmp_path: Any, fmt: str) -> None:
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    paths = _write_files(tmp_path, x)
    if fmt == "cpu":
        g = gl.DataGadget(x.copy(), placement="cpu", device="cpu")
    else:
        g = gl.DataGadget(paths[fmt], placement="file", device="cpu")
    ds = gl.GadgetDataset(g, np.arange(N), device="cpu")
    dl = DataLoader(ds, batch_size=7, shuffle=True, num_workers=1, multiprocessing_context="fork")
    ref = x.copy()
    for epoch in range(3):
        seen = [i for b in dl for i in _check(b, [ref, np.arange(N)])]
        assert sorted(seen) == list(range(N))
        rows = np.array([1, 5, N - 1])
        new = np.full((3, 3), -(epoch + 1), np.float32)
        g.insertData(torch.from_numpy(new), torch.from_numpy(rows))
        ref[rows] = new
    g.close()


def test_sampler_form_batch_size_none_with_workers() -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=5, seed=4, num_replicas=2, rank=1)
    ref = gl.GadgetSampler(N, batch_size=5, seed=4, num_replicas=2, rank=1)
    dl = DataLoader(ds, sampler=s, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert len(dl) == len(s) == len(ref)
    for _ in range(2):
        got = []
        for b in dl:
            assert isinstance(b, (list, tuple)) and len(b) == len(cols)
            got.append(_check(b, cols))
        assert got == _sampler_ids(ref)


# ---- pickling ---------------------------------------------------------------------------------
def test_dataset_pickles_for_spawn_by_placement(placement: str, tmp_path: Any) -> None:
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    paths = _write_files(tmp_path, x)
    cols = _columns()
    ds = gl.GadgetDataset(paths["h5"], paths["zarr"], placement="file", device="cpu")
    mem = gl.GadgetDataset(*cols, placement=placement)
    if placement in ("cuda", "pinned"):
        with pytest.raises(gl.GadgetTypeError):
            pickle.dumps(mem)
        return
    ids = [36, 0, 5, 5]
    for d, refs in ((ds, [torch.from_numpy(x)] * 2), (mem, cols)):
        want = d[ids]
        d[[1, 2]]  # a plan and order windows exist: they stay behind
        back = pickle.loads(pickle.dumps(d))
        assert len(back) == N
        for a, b, r in zip(back[ids], want, refs, strict=True):
            assert torch.equal(a.cpu(), b.cpu())
            assert torch.equal(a.cpu(), r[ids])
    ds.close()


def test_gadget_batch_pickle_to_and_default_collate() -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    b = ds[[4, 2]]
    back = pickle.loads(pickle.dumps(b))
    assert type(back) is gl.GadgetBatch
    assert all(torch.equal(u, v) for u, v in zip(back, b, strict=True))
    moved = b.to("cpu")
    assert type(moved) is gl.GadgetBatch
    assert all(u.data_ptr() == v.data_ptr() for u, v in zip(moved, b, strict=True))  # no copy
    assert default_collate([b]) is b  # passed through unchanged
    x, *_rest, ids = b
    assert ids.tolist() == [4, 2] and torch.equal(x, cols[0][[4, 2]])


def test_sampler_pickle_and_deepcopy_mid_epoch() -> None:
    s = gl.GadgetSampler(N, batch_size=4, seed=9, order="chunk", chunk_rows=5, window_chunks=3)
    ref = gl.GadgetSampler(N, batch_size=4, seed=9, order="chunk", chunk_rows=5, window_chunks=3)
    full = _sampler_ids(ref)
    it = iter(s)
    assert [next(it).tolist() for _ in range(3)] == full[:3]
    for twin in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert twin.state_dict() == s.state_dict()
        fresh = gl.GadgetSampler(N, batch_size=4, order="chunk", chunk_rows=5, window_chunks=3)
        fresh.load_state_dict(twin.state_dict())
        assert _sampler_ids(fresh) == full[3:]  # resumes where the original stands
        assert _sampler_ids(twin) == full  # a new iter() restarts the unfinished epoch
    assert [b.tolist() for b in it] == full[3:]  # the original is unaffected


# ---- dataset columns and ids ------------------------------------------------------------------
def test_non_contiguous_memmap_and_read_only_columns(tmp_path: Any) -> None:
    x = np.arange(N * 6, dtype=np.float32).reshape(N, 6)
    np.save(tmp_path / "x.npy", x)
    raw = np.memmap(tmp_path / "r.bin", dtype=np.int16, mode="w+", shape=(N, 3))
    raw[:] = np.arange(N * 3).reshape(N, 3)
    raw.flush()
    ro = x.copy()
    ro.flags.writeable = False
    t = torch.from_numpy(x.copy())
    sources = [
        x[::-1],  # negative strides
        np.asfortranarray(x),
        t[:, ::2],
        t[:, 1:4],
        torch.from_numpy(np.arange(2 * N * 2, dtype=np.float64).reshape(2 * N, 2))[::2],
        np.load(tmp_path / "x.npy", mmap_mode="r"),
        np.memmap(tmp_path / "r.bin", dtype=np.int16, mode="r", shape=(N, 3)),
        ro,
        torch.arange(3 * N, device="cpu")[::3],  # 1-D strided labels
    ]
    ds = gl.GadgetDataset(*sources, torch.arange(N), placement="cpu", device="cpu")
    refs = [np.ascontiguousarray(np.asarray(s)) for s in sources] + [np.arange(N)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in DataLoader(ds, batch_size=6, shuffle=True):
            _check(b, refs)
    assert ds.columns[6].dtype == torch.int16


def test_index_forms(placement: str, device: torch.device) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement=placement, device=device)
    row = ds[-1]
    assert isinstance(row, tuple) and len(row) == len(cols)
    for t, c in zip(row, cols, strict=True):
        assert torch.equal(t.cpu(), c[N - 1])  # 1-D columns give 0-d values
    assert int(ds[np.int64(2)][-1]) == 2
    assert _check(ds[::-5], cols) == list(range(N - 1, -1, -5))
    assert _check(ds[-3:], cols) == [N - 3, N - 2, N - 1]
    empty = ds[5:2]
    assert [tuple(t.shape) for t in empty] == [(0, *c.shape[1:]) for c in cols]
    grid = ds[torch.tensor([[1, 2], [3, 36]], device="cpu")]
    for t, c in zip(grid, cols, strict=True):
        assert t.shape == (2, 2, *c.shape[1:])
        assert torch.equal(t.cpu().reshape(4, *c.shape[1:]), c[[1, 2, 3, 36]])
    assert _check(ds[range(30, 10, -7)], cols) == [30, 23, 16]
    with pytest.raises(gl.GadgetIndexError):
        ds[N]
    with pytest.raises(gl.GadgetIndexError):
        ds[-N - 1]
    with pytest.raises(gl.GadgetIndexError):
        ds[[0, -1]]  # ids in lists must lie in [0, len)
    with pytest.raises(gl.GadgetTypeError):
        ds[True]
    with pytest.raises(gl.GadgetTypeError):
        ds.__getitems__([True, False])
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__([1, N])


@pytest.mark.parametrize("where", ["cpu", "file"])
def test_changed_sampler_batch_is_checked_for_host_and_file_columns(
    tmp_path: Any, where: str
) -> None:
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    np.save(tmp_path / "x.npy", x)
    src = str(tmp_path / "x.npy") if where == "file" else x
    ds = gl.GadgetDataset(src, np.arange(N), placement=where, device="cpu")
    s = gl.GadgetSampler(ds, batch_size=4, seed=0)
    b = next(iter(s))
    b.numpy()[0] = N + 3  # through NumPy: the tag stays, the value is out of range
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(b)
    b.numpy()[0] = 7  # in range again: the rows of the new ids
    assert _check(ds.gather(b), [x, np.arange(N)])[0] == 7
    c = next(iter(gl.GadgetSampler(ds, batch_size=4, seed=0)))
    c[1] = 30  # through torch: the tag is lost, the ids are checked like any other
    assert _check(ds.gather(c), [x, np.arange(N)])[1] == 30


def test_sampler_for_a_larger_table_is_refused_per_batch() -> None:
    ds = gl.GadgetDataset(torch.arange(20, device="cpu"), placement="cpu", device="cpu")
    s = gl.GadgetSampler(50, batch_size=7, order="sequential")
    with pytest.raises(gl.GadgetIndexError):
        list(DataLoader(ds, batch_sampler=s))
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(50, batch_size=7))


# ---- sampler: every row once, ranks, drop_last, pad ---------------------------------------------
def _sampler_cases() -> list[tuple[Any, ...]]:
    grid = []
    for n, b, r in itertools.product((1, 2, 7, 31, 64, 65), (1, 3, 8), (1, 2, 3, 4)):
        for mode in ("default", "drop_last", "pad"):
            grid.append((n, b, r, mode, "sequential", None, None))
            grid.append((n, b, r, mode, "random", None, None))
            for cr, wc in ((1, 1), (3, 2), (7, None), (7, 3), (64, 1)):
                grid.append((n, b, r, mode, "chunk", cr, wc))
    return random.Random(11).sample(grid, 140)


@pytest.mark.parametrize("wide", [True, False], ids=["int64-order", "int32-order"])
def test_every_row_once_per_epoch_for_every_order(
    monkeypatch: pytest.MonkeyPatch, wide: bool
) -> None:
    if not wide:  # orders kept as int32 (batches are converted copies), as for >2**27 rows
        monkeypatch.setattr(sampler_module, "WIDE_ORDER_ROWS", 4)
    for n, bs, nr, mode, order, cr, wc in _sampler_cases():
        kw = dict(batch_size=bs, order=order, seed=5, num_replicas=nr, chunk_rows=cr)
        kw.update(window_chunks=wc, drop_last=mode == "drop_last", pad=mode == "pad")
        case = (n, kw)
        if (mode == "drop_last" and n < nr * bs) or (mode == "default" and n < nr):
            with pytest.raises(gl.GadgetValueError):
                gl.GadgetSampler(n, rank=0, **kw)
            continue
        ranks = [gl.GadgetSampler(n, rank=r, **kw) for r in range(nr)]
        nb = len(ranks[0])
        for epoch in range(2):
            full = ranks[0].epoch_order(epoch).tolist()
            assert sorted(full) == list(range(n)), case
            if order == "sequential":
                assert full == list(range(n)), case
            per_rank = [_sampler_ids(s) for s in ranks]
            assert all(len(p) == nb for p in per_rank), case  # the same count on every rank
            flat = [i for p in per_rank for b in p for i in b]
            sizes = [len(b) for p in per_rank for b in p]
            if mode == "default":
                assert flat == full, case  # every row once, ranks in order
                for p in per_rank:
                    assert all(len(b) == bs for b in p[:-1]), case
                    assert 1 <= len(p[-1]) <= bs + 1, case
            elif mode == "drop_last":
                assert nb == n // (nr * bs) and set(sizes) == {bs}, case
                assert flat == full[: len(flat)] and n - len(flat) < nr * bs, case
            else:
                assert nb == -(-n // (nr * bs)) and set(sizes) == {bs}, case
                assert flat == [full[i % n] for i in range(len(flat))], case
            for s in ranks:
                assert s.epoch == epoch + 1, case  # a full pass advances the epoch


def test_order_depends_only_on_seed_and_epoch() -> None:
    a = gl.GadgetSampler(N, batch_size=3, seed=8)
    b = gl.GadgetSampler(N, batch_size=5, seed=8, num_replicas=2, rank=1, drop_last=True)
    c = gl.GadgetSampler(N, batch_size=3, seed=9)
    for e in range(3):
        assert torch.equal(a.epoch_order(e), b.epoch_order(e))
        assert not torch.equal(a.epoch_order(e), c.epoch_order(e))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    mine = a.epoch_order(0)
    mine[:] = 0  # a copy: the sampler's own order is untouched
    assert sorted(a.epoch_order(0).tolist()) == list(range(N))
    a.set_epoch(0)
    assert [i for x in _sampler_ids(a) for i in x] == b.epoch_order(0).tolist()


def test_chunk_rows_of_mixed_file_columns(tmp_path: Any) -> None:
    x = np.arange(120 * 2, dtype=np.float32).reshape(120, 2)
    y = np.arange(120)

    def zarr_col(name: str, arr: np.ndarray, chunk: int) -> gl.DataGadget:
        z = zarr.open_array(
            str(tmp_path / name), mode="w", shape=arr.shape, chunks=(chunk,) + arr.shape[1:]
        )
        z[:] = arr
        return gl.DataGadget(str(tmp_path / name), placement="file", device="cpu")

    lcm = gl.GadgetDataset(zarr_col("a.zarr", x, 6), zarr_col("b.zarr", y, 4), device="cpu")
    assert lcm.chunk_rows == 12  # lcm(6, 4) <= 2 * 6
    assert gl.GadgetSampler(lcm, batch_size=4, order="chunk").chunk_rows == 12
    big = gl.GadgetDataset(zarr_col("c.zarr", x, 7), zarr_col("d.zarr", y, 5), device="cpu")
    assert big.chunk_rows == 7  # lcm 35 > 2 * 7: the largest
    mem = gl.GadgetDataset(x, placement="cpu", device="cpu")
    assert mem.chunk_rows is None
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(mem, batch_size=4, order="chunk")


@pytest.mark.parametrize(("n", "cr", "wc", "bs"), [(101, 7, 3, 5), (64, 5, 2, 10), (50, 64, 1, 7)])
def test_chunk_rows_stay_inside_one_window(n: int, cr: int, wc: int, bs: int) -> None:
    s = gl.GadgetSampler(n, batch_size=bs, order="chunk", chunk_rows=cr, window_chunks=wc, seed=3)
    for e in range(3):
        order = s.epoch_order(e).numpy()
        assert sorted(order.tolist()) == list(range(n))
        pos = np.empty(n, np.int64)
        pos[order] = np.arange(n)
        for c in range(-(-n // cr)):
            p = pos[c * cr : (c + 1) * cr]
            assert p.max() - p.min() < wc * cr  # all rows of a chunk within one window


@pytest.mark.parametrize(("bs", "wc"), [(5, None), (17, 3), (96, 8)])
def test_chunk_order_reads_each_chunk_once_with_a_two_window_cache(
    tmp_path: Any, bs: int, wc: int | None
) -> None:
    n = 1000
    x = np.random.default_rng(0).random((n, 4)).astype(np.float32)
    y = np.arange(n, dtype=np.int64)
    for name, arr, chunk in (("x", x, 6), ("y", y, 4)):
        z = zarr.open_array(
            str(tmp_path / f"{name}.zarr"),
            mode="w",
            shape=arr.shape,
            chunks=(chunk,) + arr.shape[1:],
            dtype=arr.dtype,
        )
        z[:] = arr
    probe = gl.GadgetDataset(str(tmp_path / "x.zarr"), str(tmp_path / "y.zarr"), placement="file")
    s = gl.GadgetSampler(probe, batch_size=bs, order="chunk", seed=1, window_chunks=wc)
    window_rows = s.window_chunks * s.chunk_rows
    assert s.chunk_rows == 12 and bs <= window_rows
    probe.close()
    cols = [
        gl.DataGadget(
            str(tmp_path / f"{name}.zarr"),
            placement="file",
            device="cpu",
            cache_bytes=2 * window_rows * arr[:1].nbytes,
        )
        for name, arr in (("x", x), ("y", y))
    ]
    ds = gl.GadgetDataset(*cols, device="cpu")
    for epoch in range(2):
        for c in cols:
            c.store.stats.update(hits=0, misses=0, reads=0)
        seen = [i for b in DataLoader(ds, batch_sampler=s) for i in _check(b, [x, y])]
        assert sorted(seen) == list(range(n))
        for c, chunk in zip(cols, (6, 4), strict=True):
            blocks = -(-n // chunk)
            if epoch == 0:
                assert c.store.stats["misses"] == blocks
            assert c.store.stats["misses"] <= blocks  # no chunk is read twice


# ---- sampler: resume, set_epoch, refused states ------------------------------------------------
def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    state = json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    "kw",
    [
        dict(order="random"),
        dict(order="sequential", pad=True, num_replicas=3, rank=2),
        dict(order="chunk", chunk_rows=4, window_chunks=3, num_replicas=2, rank=1),
        dict(order="random", drop_last=True, num_replicas=2, rank=0),
    ],
    ids=["random", "sequential-pad", "chunk-ranks", "random-drop_last"],
)
def test_resume_at_every_position_equals_uninterrupted(kw: dict[str, Any]) -> None:
    ref = gl.GadgetSampler(N, batch_size=3, seed=21, **kw)
    epochs = [_sampler_ids(ref) for _ in range(3)]
    nb = len(epochs[0])
    for k in range(nb + 1):
        s = gl.GadgetSampler(N, batch_size=3, seed=21, **kw)
        _sampler_ids(s)  # epoch 0 done: the saved state is in epoch 1
        it = iter(s)
        head = [next(it).tolist() for _ in range(k)]
        state = _roundtrip(s.state_dict())
        other = gl.GadgetSampler(N, batch_size=3, seed=1234, **kw)  # the state's seed wins
        other.load_state_dict(state)
        assert other.state_dict() == state
        rest = _sampler_ids(other)
        assert head + rest == epochs[1], k
        assert _sampler_ids(other) == epochs[2], k  # then the next epoch


def test_state_loads_on_another_rank_of_the_same_world_size() -> None:
    kw = dict(batch_size=4, seed=2, num_replicas=3, order="random")
    s0 = gl.GadgetSampler(N, rank=0, **kw)
    it = iter(s0)
    next(it), next(it)
    s2 = gl.GadgetSampler(N, rank=2, **kw)
    s2.load_state_dict(s0.state_dict())
    assert _sampler_ids(s2) == _sampler_ids(gl.GadgetSampler(N, rank=2, **kw))[2:]


def test_set_epoch_semantics() -> None:
    ref = gl.GadgetSampler(N, batch_size=4, seed=6)
    epochs = [_sampler_ids(ref) for _ in range(5)]
    s = gl.GadgetSampler(N, batch_size=4, seed=6)
    s.set_epoch(3)
    assert _sampler_ids(s) == epochs[3] and s.epoch == 4
    it = iter(s)
    next(it)
    state = s.state_dict()  # epoch 4, position 1
    t = gl.GadgetSampler(N, batch_size=4, seed=6)
    t.load_state_dict(state)
    t.set_epoch(4)  # the loaded epoch: the loaded position stays
    assert _sampler_ids(t) == epochs[4][1:]
    u = gl.GadgetSampler(N, batch_size=4, seed=6)
    u.load_state_dict(state)
    u.set_epoch(2)  # another epoch: from its first batch
    assert _sampler_ids(u) == epochs[2]
    before = s.state_dict()
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(gl.GadgetError):
            s.set_epoch(bad)  # type: ignore[arg-type]
        assert s.state_dict() == before


def test_distributed_style_loop_resumes_exactly() -> None:
    """``for e: sampler.set_epoch(e); for b in DataLoader(ds, batch_sampler=sampler)``, stopped
    mid-epoch 1, then restarted from the saved state with the same loop."""
    ds = gl.GadgetDataset(torch.arange(N, device="cpu"), placement="cpu", device="cpu")

    def make() -> gl.GadgetSampler:
        return gl.GadgetSampler(ds, batch_size=4, seed=3, num_replicas=2, rank=1)

    s = make()
    full = []
    for e in range(3):
        s.set_epoch(e)
        full += [b[0].tolist() for b in DataLoader(ds, batch_sampler=s)]
    s = make()
    got, state = [], None
    for e in range(3):
        s.set_epoch(e)
        for i, b in enumerate(DataLoader(ds, batch_sampler=s)):
            got.append(b[0].tolist())
            if e == 1 and i == 2:
                state = s.state_dict()
                break
        if state is not None:
            break
    s = make()
    s.load_state_dict(_roundtrip(state))  # type: ignore[arg-type]
    for e in range(state["epoch"], 3):  # type: ignore[index]
        s.set_epoch(e)
        got += [b[0].tolist() for b in DataLoader(ds, batch_sampler=s)]
    assert got == full


def _bad_states(state: dict[str, Any]) -> list[Any]:
    changed = [
        ("num_rows", N + 1),
        ("num_replicas", 3),
        ("batch_size", 5),
        ("order", "random"),
        ("drop_last", True),
        ("pad", True),
        ("chunk_rows", 5),
        ("window_chunks", 2),
        ("position", 10**6),
        ("position", -1),
        ("position", True),
        ("epoch", -1),
        ("seed", -1),
        ("seed", "0"),
        ("version", 99),
    ]
    out: list[Any] = [dict(state, **{k: v}) for k, v in changed]
    out += [{k: v for k, v in state.items() if k != key} for key in ("seed", "epoch", "position")]
    out += [None, [("position", 1)], {"sampler": state}]
    return out


def test_refused_states_change_nothing() -> None:
    kw = dict(batch_size=4, order="chunk", chunk_rows=4, window_chunks=3, seed=7)
    ref = gl.GadgetSampler(N, **kw)
    epochs = [_sampler_ids(ref) for _ in range(2)]
    s = gl.GadgetSampler(N, **kw)
    it = iter(s)
    head = [next(it).tolist() for _ in range(3)]
    good = s.state_dict()
    for bad in _bad_states(good):
        with pytest.raises(gl.GadgetError):
            s.load_state_dict(bad)
        assert s.state_dict() == good, bad
    for key, value in (
        ("num_rows", N + 1),
        ("num_replicas", 2),
        ("batch_size", 5),
        ("order", "random"),
        ("drop_last", True),
        ("pad", True),
        ("chunk_rows", 8),
    ):
        with pytest.raises(gl.GadgetValueError, match=f"{key}={value!r}.*{key}={good[key]!r}"):
            s.load_state_dict(dict(good, **{key: value}))  # names the setting and both values
    assert s.state_dict() == good
    assert head + [b.tolist() for b in it] == epochs[0]  # the pass goes on as before
    assert _sampler_ids(s) == epochs[1]


def test_loader_refused_states_change_nothing() -> None:
    ds = gl.GadgetDataset(torch.arange(N, device="cpu"), placement="cpu", device="cpu")
    kw = dict(batch_size=4, order="chunk", chunk_rows=4, window_chunks=3, seed=7)
    ref = gl.GadgetSampler(N, **kw)
    epochs = [_sampler_ids(ref) for _ in range(2)]
    loader = gl.GadgetLoader(ds, coalesce=3, **kw)
    it = iter(loader)
    head = [next(it)[0].tolist() for _ in range(2)]
    good = loader.state_dict()
    assert good["sampler"]["position"] == 2
    for bad in [*_bad_states(good["sampler"]), {"sampler": None}, good["sampler"]]:
        if bad is good["sampler"]:
            bad = dict(bad)  # a bare sampler state is not a loader state
        elif not (isinstance(bad, dict) and "sampler" in bad):
            bad = {"sampler": bad}
        if bad == good:
            continue
        with pytest.raises(gl.GadgetError):
            loader.load_state_dict(bad)
        assert loader.state_dict() == good, bad
    with pytest.raises(gl.GadgetError):
        loader.set_epoch(-1)
    assert loader.state_dict() == good
    assert head + [b[0].tolist() for b in it] == epochs[0]
    assert _ids(loader) == epochs[1]


# ---- GadgetLoader ------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("coalesce", [None, 1, 2, 5])
def test_loader_epochs_breaks_and_len(prefetch: int, coalesce: int | None) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    kw = dict(batch_size=4, seed=3, num_replicas=2, rank=1, pad=True)
    ref = gl.GadgetSampler(N, **kw)
    epochs = [_sampler_ids(ref) for _ in range(4)]
    loader = gl.GadgetLoader(ds, prefetch=prefetch, coalesce=coalesce, **kw)
    assert len(loader) == len(epochs[0])
    assert [_check(b, cols) for b in loader] == epochs[0]  # iterated twice: two epochs
    assert [_check(b, cols) for b in loader] == epochs[1]
    for b, _ in zip(loader, range(2), strict=False):  # a break mid-epoch ...
        _check(b, cols)
    assert [_check(b, cols) for b in loader] == epochs[2]  # ... restarts that epoch
    it = iter(loader)
    last = [_check(next(it), cols) for _ in range(len(loader))]  # every batch, no StopIteration
    assert last == epochs[3]
    del it
    assert _ids(loader) == _sampler_ids(ref)  # then the next epoch


@pytest.mark.parametrize(
    ("workers", "coalesce", "persistent"),
    [(0, 1, False), (0, 3, False), (2, 1, False), (2, 1, True)],
)
def test_loader_resume_and_rewind(workers: int, coalesce: int, persistent: bool) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement="cpu", device="cpu")
    kw: dict[str, Any] = dict(batch_size=4, seed=3, coalesce=coalesce, num_workers=workers)
    if workers:
        kw.update(multiprocessing_context="fork", persistent_workers=persistent)
    ref = gl.GadgetSampler(N, batch_size=4, seed=3)
    epochs = [_sampler_ids(ref) for _ in range(2)]
    loader = gl.GadgetLoader(ds, **kw)
    it = iter(loader)
    head = [_check(next(it), cols) for _ in range(3)]
    state = loader.state_dict()
    assert state["sampler"]["position"] == 3  # handed out, not prefetched
    other = gl.GadgetLoader(ds, **dict(kw, seed=99))
    other.load_state_dict(_roundtrip(state))
    assert other.state_dict() == state
    assert head + [_check(b, cols) for b in other] == epochs[0]
    assert _ids(other) == epochs[1]
    more = [_check(next(it), cols) for _ in range(2)]  # the first loader goes on ...
    assert head + more == epochs[0][:5]
    loader.load_state_dict(state)  # ... and is rewound to its saved position
    assert head + _ids(loader) == epochs[0]
    assert _ids(loader) == epochs[1]


@pytest.mark.parametrize(
    ("workers", "coalesce", "persistent"),
    [(0, 1, False), (0, 3, False), (1, 1, False), (1, 1, True)],
)
def test_loader_exception_inside_iteration(
    tmp_path: Any, workers: int, coalesce: int, persistent: bool
) -> None:
    flag = tmp_path / "fail"
    flag.touch()
    ds = _FailOnRow(torch.arange(N, device="cpu"), placement="cpu", device="cpu")
    ds.flag = str(flag)
    kw: dict[str, Any] = dict(batch_size=4, seed=1, coalesce=coalesce, num_workers=workers)
    if workers:
        kw.update(multiprocessing_context="fork", persistent_workers=persistent)
    ref = gl.GadgetSampler(N, batch_size=4, seed=1)
    epochs = [_sampler_ids(ref) for _ in range(2)]
    bad = next(i for i, b in enumerate(epochs[0]) if ds.bad in b)
    loader = gl.GadgetLoader(ds, **kw)
    got = []
    with pytest.raises(gl.GadgetValueError, match="injected failure"):
        for b in loader:
            got.append(b[0].tolist())
    assert got == epochs[0][: len(got)] and len(got) <= bad
    assert loader.state_dict()["sampler"]["position"] == len(got)
    flag.unlink()
    assert _ids(loader) == epochs[0]  # the failed epoch starts again
    assert _ids(loader) == epochs[1]


def test_loader_state_after_the_last_batch_gives_an_empty_pass() -> None:
    ds = gl.GadgetDataset(torch.arange(N, device="cpu"), placement="cpu", device="cpu")
    ref = gl.GadgetSampler(N, batch_size=5, seed=4)
    epochs = [_sampler_ids(ref) for _ in range(2)]
    for coalesce in (1, 3):
        loader = gl.GadgetLoader(ds, batch_size=5, seed=4, coalesce=coalesce)
        it = iter(loader)
        assert [next(it)[0].tolist() for _ in range(len(loader))] == epochs[0]
        state = loader.state_dict()
        assert state["sampler"]["position"] == len(loader)
        other = gl.GadgetLoader(ds, batch_size=5, seed=0, coalesce=coalesce)
        other.load_state_dict(state)
        assert _ids(other) == []
        assert _ids(other) == epochs[1]


def test_loader_set_epoch_after_load_state_dict() -> None:
    ds = gl.GadgetDataset(torch.arange(N, device="cpu"), placement="cpu", device="cpu")
    ref = gl.GadgetSampler(N, batch_size=4, seed=5)
    epochs = [_sampler_ids(ref) for _ in range(4)]
    src = gl.GadgetLoader(ds, batch_size=4, seed=5, coalesce=2)
    src.set_epoch(2)
    it = iter(src)
    next(it), next(it), next(it)
    state = src.state_dict()
    assert (state["sampler"]["epoch"], state["sampler"]["position"]) == (2, 3)
    loader = gl.GadgetLoader(ds, batch_size=4, seed=0, coalesce=2)
    loader.load_state_dict(state)
    loader.set_epoch(2)  # the loaded epoch: from the loaded position
    assert _ids(loader) == epochs[2][3:]
    loader.load_state_dict(state)
    loader.set_epoch(1)  # another epoch: from its first batch
    assert _ids(loader) == epochs[1]
    assert _ids(loader) == epochs[2]


def test_loader_follows_its_samplers_set_epoch_and_load_state_dict() -> None:
    ds = gl.GadgetDataset(torch.arange(N, device="cpu"), placement="cpu", device="cpu")
    ref = gl.GadgetSampler(N, batch_size=4, seed=5)
    epochs = [_sampler_ids(ref) for _ in range(6)]
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    loader = gl.GadgetLoader(ds, sampler=s, coalesce=2)
    it = iter(loader)
    next(it), next(it)
    s.set_epoch(4)
    assert loader.state_dict()["sampler"]["epoch"] == 4
    assert loader.state_dict()["sampler"]["position"] == 0
    assert _ids(loader) == epochs[4]
    saved = gl.GadgetSampler(N, batch_size=4, seed=5)
    saved.set_epoch(2)
    sit = iter(saved)
    next(sit), next(sit), next(sit)
    s.load_state_dict(saved.state_dict())
    assert loader.state_dict() == {"sampler": saved.state_dict()}
    assert _ids(loader) == epochs[2][3:]
    assert _ids(loader) == epochs[3]


def test_loader_with_workers_by_placement(placement: str, device: torch.device) -> None:
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement=placement, device=device)
    loader = gl.GadgetLoader(
        ds,
        batch_size=6,
        seed=2,
        num_workers=1 if placement == "cuda" else 2,
        multiprocessing_context="fork",
    )
    if placement == "cuda":
        with pytest.raises(gl.GadgetTypeError):
            list(loader)
        return
    ref = gl.GadgetSampler(N, batch_size=6, seed=2)
    got = []
    for b in loader:
        assert all(t.device.type == ds.device.type for t in b)  # moved to the dataset's device
        got.append(_check(b, cols))
    assert got == _sampler_ids(ref)


def test_loader_over_a_tensor_or_gadget() -> None:
    x = torch.arange(N * 2, dtype=torch.float32, device="cpu").reshape(N, 2)
    for src in (x, x.numpy(), gl.DataGadget(x, placement="cpu", device="cpu")):
        loader = gl.GadgetLoader(src, batch_size=10, order="sequential")
        got = [b[0].cpu() for b in loader]
        assert [len(g) for g in got] == [10, 10, 10, 7]
        assert torch.equal(torch.cat(got), x)
    g = gl.DataGadget(x, placement="cpu", device="cpu")
    assert gl.GadgetLoader(g, batch_size=4).dataset.columns[0] is g


def test_loader_argument_errors() -> None:
    ds = gl.GadgetDataset(torch.arange(N, device="cpu"), placement="cpu", device="cpu")
    for kw in (
        dict(prefetch=-1),
        dict(prefetch=True),
        dict(coalesce=0),
        dict(coalesce=2.0),
        dict(num_workers=-1),
        dict(coalesce=2, num_workers=1),
        dict(collate_fn=_collate_report),
        dict(shuffle=True),
    ):
        with pytest.raises(gl.GadgetError):
            gl.GadgetLoader(ds, batch_size=4, **kw)


class _CountingDataset(gl.GadgetDataset):
    """Counts the gathers a loader asks for."""

    calls = 0

    def gather(self, indices: Any) -> gl.GadgetBatch:
        self.calls += 1
        return super().gather(indices)


def test_loader_coalesce_is_one_gather_per_group(placement: str, device: torch.device) -> None:
    x = torch.arange(N * 2, dtype=torch.float32, device="cpu").reshape(N, 2)
    ref = gl.GadgetSampler(N, batch_size=4, seed=8)
    want = _sampler_ids(ref)
    nb = len(want)
    cases: list[tuple[dict[str, Any], int]] = [
        (dict(coalesce=3), -(-nb // 3)),
        (dict(coalesce=1), nb),
        (dict(prefetch=0), nb),  # prefetch=0 makes the default coalesce 1
    ]
    if device.type == "cpu":
        cases.append(({}, nb))  # "1 on the CPU"
    elif placement in ("cuda", "pinned"):
        cases.append(({}, 1))  # 10 small batches: one group (up to 32 on CUDA)
    for kw, calls in cases:
        ds = _CountingDataset(x, torch.arange(N), placement=placement, device=device)
        loader = gl.GadgetLoader(ds, batch_size=4, seed=8, **kw)
        got = list(loader)
        assert [_check(b, [x, torch.arange(N)]) for b in got] == want, kw
        assert ds.calls == calls, kw
        k = kw.get("coalesce", 1)
        if k > 1:  # a group's batches are views of one gathered tensor
            ptrs = [b[0].untyped_storage().data_ptr() for b in got]
            assert len(set(ptrs)) == calls


@pytest.mark.parametrize("wide", [True, False], ids=["int64-order", "int32-order"])
def test_sampler_batches_on_every_placement_with_small_order_windows(
    monkeypatch: pytest.MonkeyPatch, placement: str, device: torch.device, wide: bool
) -> None:
    """GPU columns take a sampler's ids from an upload of its order: small upload windows
    (re-uploaded often), two samplers in turn, groups across windows, pad and ranks."""
    import gadgetloader.data._dataset as dataset_module

    monkeypatch.setattr(dataset_module, "WINDOW_IDS", 8)
    if not wide:
        monkeypatch.setattr(sampler_module, "WIDE_ORDER_ROWS", 4)
    cols = _columns()
    ds = gl.GadgetDataset(*cols, placement=placement, device=device)
    for kw in (
        dict(seed=1),
        dict(seed=2, pad=True, num_replicas=3, rank=1),
        dict(seed=3, order="chunk", chunk_rows=5, window_chunks=2, drop_last=True),
    ):
        s1 = gl.GadgetSampler(ds, batch_size=3, **kw)
        s2 = gl.GadgetSampler(ds, batch_size=5, **dict(kw, seed=kw["seed"] + 10))
        r1 = gl.GadgetSampler(N, batch_size=3, **kw)
        r2 = gl.GadgetSampler(N, batch_size=5, **dict(kw, seed=kw["seed"] + 10))
        for _ in range(2):
            got1: list[list[int]] = []
            got2: list[list[int]] = []
            for a, b in itertools.zip_longest(
                DataLoader(ds, batch_sampler=s1), gl.GadgetLoader(ds, sampler=s2, coalesce=3)
            ):
                if a is not None:
                    got1.append(_check(a, cols))
                if b is not None:
                    got2.append(_check(b, cols))
            assert got1 == _sampler_ids(r1), kw
            assert got2 == _sampler_ids(r2), kw
        direct = [_check(ds.gather(b), cols) for b in s1]
        assert direct == _sampler_ids(r1), kw


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("prefetch", "coalesce", "workers"), [(1, 1, 0), (3, 4, 0), (2, None, 0), (2, 1, 1)]
)
def test_loader_batches_survive_slow_consumers_on_changing_streams(
    placement: str, device: torch.device, prefetch: int, coalesce: int | None, workers: int
) -> None:
    """Each batch is asked for and read on another stream that first sleeps, so the consumer
    lags behind the side-stream gathers: events and record_stream must keep batches intact."""
    n = 4096
    x = torch.randn(n, 64, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    ds = gl.GadgetDataset(x, torch.arange(n), placement=placement, device=device)
    kw: dict[str, Any] = dict(batch_size=256, seed=1, prefetch=prefetch, coalesce=coalesce)
    if workers:
        kw.update(num_workers=workers, multiprocessing_context="fork")
    loader = gl.GadgetLoader(ds, **kw)
    if workers and placement == "cuda":  # cuda columns cannot be read in a worker
        with pytest.raises(gl.GadgetTypeError):
            list(loader)
        return
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device), None]
    copies = []
    it = iter(loader)
    for i in itertools.count():
        # the consuming stream is the one current when a batch is asked for
        with torch.cuda.stream(streams[i % 3] or torch.cuda.current_stream(device)):
            b = next(it, None)
            if b is None:
                break
            torch.cuda._sleep(2_000_000)
            copies.append((b[0] + 0, b[1] + 0))
        del b
    torch.cuda.synchronize(device)
    want = _sampler_ids(gl.GadgetSampler(n, batch_size=256, seed=1))
    assert [c[1].cpu().tolist() for c in copies] == want
    for rows, ids in copies:
        assert torch.equal(rows.cpu(), x[ids.cpu()])


@pytest.mark.gpu
def test_sampler_batches_on_changing_streams_with_small_order_windows(
    monkeypatch: pytest.MonkeyPatch, placement: str, device: torch.device
) -> None:
    """DataLoader(batch_sampler=...) and ds.gather of sampler batches, each asked for on
    another stream: an order window uploaded on one stream is sliced on the others."""
    import gadgetloader.data._dataset as dataset_module

    monkeypatch.setattr(dataset_module, "WINDOW_IDS", 600)  # a new upload every few batches
    n = 4096
    x = torch.randn(n, 32, generator=torch.Generator(device="cpu").manual_seed(1), device="cpu")
    ds = gl.GadgetDataset(x, torch.arange(n), placement=placement, device=device)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device), None]
    for form in ("batch_sampler", "gather"):
        s = gl.GadgetSampler(ds, batch_size=256, seed=4)
        source = iter(DataLoader(ds, batch_sampler=s)) if form == "batch_sampler" else iter(s)
        copies = []
        for i in itertools.count():
            with torch.cuda.stream(streams[i % 3] or torch.cuda.current_stream(device)):
                item = next(source, None)
                if item is None:
                    break
                b = item if form == "batch_sampler" else ds.gather(item)
                torch.cuda._sleep(1_000_000)
                copies.append((b[0] + 0, b[1] + 0))
            del b, item
        torch.cuda.synchronize(device)
        want = _sampler_ids(gl.GadgetSampler(n, batch_size=256, seed=4))
        assert [c[1].cpu().tolist() for c in copies] == want, form
        for rows, ids in copies:
            assert torch.equal(rows.cpu(), x[ids.cpu()]), form
