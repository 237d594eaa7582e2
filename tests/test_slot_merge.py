"""Session 24: the sort-free merge of repeated ids in a scatter, and the range check of a
write's CUDA ids finished after the merge is queued.

A ``kernel`` scatter with repeats into a table of at most ``SLOT_MERGE_MAX_ROWS`` rows
marks each id's last position in a slot array (``_kernels.launch_last_slots``) and writes
only that entry; every other case sorts. Both must write exactly what numpy's
last-writer rule gives, never outside the table, and a bad id must leave the table as
it was. The CPU tests below cover the check's plumbing through every store.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader._ids import GuardedCheck
from gadgetloader.transfer import _engine, _kernels


def _last_writer(table: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """numpy's reference: entries in order, so a repeated id keeps its last row."""
    out = table.copy()
    for j, r in enumerate(ids.tolist()):
        if 0 <= r < len(out):
            out[r] = rows[j]
    return out


def _ids(kind: str, n: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "distinct":
        return torch.randperm(rows, generator=gen)[:n]
    if kind == "some":
        return torch.randint(0, rows, (n,), generator=gen)  # birthday repeats
    ids = torch.randint(0, rows, (n,), generator=gen)  # one hot id, a third of the entries
    ids[torch.randperm(n, generator=gen)[: n // 3]] = 7
    return ids


def _raiser() -> None:
    raise gl.GadgetIndexError("bad ids (test)")


# --- on the CPU: a pending check runs before any write, on every store ---------------------


@pytest.mark.parametrize("where", ["cpu", "npy", "h5"])
def test_a_pending_check_that_raises_leaves_the_store_unchanged(where: str, tmp_path: Path) -> None:
    base = np.arange(40, dtype=np.float32).reshape(10, 4)
    if where == "cpu":
        g = gl.DataGadget(torch.from_numpy(base.copy()), placement="cpu")
    else:
        path = tmp_path / f"t.{where}"
        dataset = None
        if where == "npy":
            np.save(path, base)
        else:
            h5py = pytest.importorskip("h5py")
            with h5py.File(path, "w") as f:
                f["x"] = base
            dataset = "x"
        g = gl.DataGadget(path, placement="file", dataset=dataset, writable=True)
    ids = torch.tensor([1, 1, 3])
    with pytest.raises(gl.GadgetIndexError, match="bad ids"):
        g.store.scatter(ids, torch.full((3, 4), -1.0), check=_raiser)
    np.testing.assert_array_equal(g.getData(torch.arange(10)).cpu().numpy(), base)
    called = []
    g.store.scatter(ids, torch.full((3, 4), -1.0), check=lambda: called.append(1))
    assert called == [1]
    assert (g.getData([1, 3]).cpu() == -1).all()
    g.close()


def test_the_engine_calls_the_check_before_writing_on_the_torch_path() -> None:
    table = torch.zeros(8, 2)
    with pytest.raises(gl.GadgetIndexError):
        _engine.scatter(table, torch.tensor([2, 2]), torch.ones(2, 2), "torch", check=_raiser)
    assert (table == 0).all()
    _engine.scatter(table, torch.tensor([2, 5, 2]), torch.arange(6.0).view(3, 2), "torch")
    assert table[2].tolist() == [4.0, 5.0] and table[5].tolist() == [2.0, 3.0]


def test_launch_last_slots_refuses_what_does_not_fit() -> None:
    slot = torch.empty(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        _kernels.launch_last_slots(torch.zeros(3, dtype=torch.int32), slot)
    with pytest.raises(ValueError, match="int32"):
        _kernels.launch_last_slots(torch.zeros(3, dtype=torch.int64), slot.long())
    with pytest.raises(ValueError, match="one per table row"):
        _kernels._check_slot(slot[:5], torch.zeros(10, 4), torch.zeros(3, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="one per table row"):
        _kernels._check_slot(None, torch.zeros(10, 4), torch.zeros(3, dtype=torch.int64), None)


def test_a_guarded_check_runs_before_a_torch_write() -> None:
    table = torch.zeros(8, 2)
    check = GuardedCheck(torch.tensor([0, 99]), _raiser)
    with pytest.raises(gl.GadgetIndexError):
        _engine.scatter(table, torch.tensor([2, 2]), torch.ones(2, 2), "torch", check=check)
    assert (table == 0).all()


def test_launch_scatter_refuses_an_unknown_mode_and_a_count_with_slots() -> None:
    t, i, r = torch.zeros(4, 2), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown scatter mode 4"):
        _kernels.launch_scatter(t, i, r, None, 4)
    count = torch.ones(1, dtype=torch.int64)
    for mode in (_kernels.SCATTER_LAST_BY_SLOT, _kernels.SCATTER_LAST_BY_SLOT_GUARDED):
        with pytest.raises(ValueError, match="count"):
            _kernels.launch_scatter(t, i, r, None, mode, count=count)
    with pytest.raises(ValueError, match="count"):
        _kernels.launch_scatter(t, i, r, count=count, guard=torch.zeros(2, dtype=torch.int64))


def test_a_scatter_guard_must_be_two_int64_on_the_device() -> None:
    dev = torch.device("cpu")
    assert _kernels._guard_ptr(None, dev) == 0
    with pytest.raises(ValueError, match="2-element int64"):
        _kernels._guard_ptr(torch.zeros(3, dtype=torch.int64), dev)
    with pytest.raises(ValueError, match="2-element int64"):
        _kernels._guard_ptr(torch.zeros(2, dtype=torch.int32), dev)
    ok = torch.zeros(2, dtype=torch.int64)
    assert _kernels._guard_ptr(ok, dev) == ok.data_ptr()


# --- on the GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
@pytest.mark.parametrize("ids_on", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", ["distinct", "some", "hot"])
@pytest.mark.parametrize(
    "width,dtype", [(128, torch.float32), (3, torch.float16), (5, torch.uint8)]
)
@pytest.mark.parametrize("n", [1, 1000, 70_000])
def test_insert_with_repeats_writes_each_ids_last_row(
    placement: str,
    ids_on: str,
    kind: str,
    width: int,
    dtype: torch.dtype,
    n: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row_bytes = width * torch.empty((), dtype=dtype).element_size()
    # as many rows as the slot merge takes for n ids (at most 16 KB of table per id)
    rows = max(n, min(100_000, n * _kernels.SPARSE_GAP_BYTES // row_bytes))
    gen = torch.Generator().manual_seed(n + width)
    base = (torch.randn(rows, width, generator=gen) * 50).to(dtype)
    g = gl.DataGadget(base.clone(), placement=placement)
    ids = _ids(kind, n, rows, gen)
    new = (torch.randn(n, width, generator=gen) * 50).to(dtype)
    merges = []
    real = _kernels.launch_last_slots
    monkeypatch.setattr(
        _kernels, "launch_last_slots", lambda *a, **k: (merges.append(1), real(*a, **k))
    )
    g.insertData(new.cuda(), ids.to(ids_on))
    assert merges == [1]  # this test is about the slot merge
    want = _last_writer(base.numpy(), ids.numpy(), new.numpy())
    got = g.getData(torch.arange(rows)).cpu().numpy()
    np.testing.assert_array_equal(got, want)
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("way", ["slot merge", "sort merge", "sorted", "torch", "auto"])
def test_every_merge_writes_the_same_bytes(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rows, width, n = 20_000, 16, 60_000
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(rows, width, generator=gen)
    ids = torch.randint(0, rows, (n,), generator=gen).cuda()
    new = torch.randn(n, width, generator=gen).cuda()
    want = torch.from_numpy(_last_writer(base.numpy(), ids.cpu().numpy(), new.cpu().numpy()))
    table = base.cuda()
    merges = []
    real = _kernels.launch_last_slots
    monkeypatch.setattr(
        _kernels, "launch_last_slots", lambda *a, **k: (merges.append(1), real(*a, **k))
    )
    if way == "sort merge":
        monkeypatch.setattr(_engine, "SLOT_MERGE_MAX_ROWS", 0)
    strategy = "kernel" if way.endswith("merge") else way
    _engine.scatter(table, ids, new, strategy)
    assert merges == ([1] if way in ("slot merge", "auto") else [])
    assert torch.equal(table.cpu(), want)


@pytest.mark.gpu
@NEEDS_CUPY
def test_the_slot_kernels_stay_inside_the_slot_array() -> None:
    rows = 100
    pad = torch.full((rows + 2,), -7, dtype=torch.int32, device="cuda")
    slot = pad[1:-1]
    ids = torch.tensor([-1, 5, rows, 5, 99, rows + 3, 0, -100], device="cuda")
    _kernels.launch_last_slots(ids, slot)
    assert pad[0].item() == -7 and pad[-1].item() == -7
    assert slot[[5, 99, 0]].tolist() == [3, 4, 6]
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[[0, 5, 99]] = False
    assert (slot[untouched.cuda()] == -7).all()


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_failed_guarded_write_still_finishes_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import gadgetloader.gadget as gadget_mod

    rows, width = 300, 8
    # (`sorted`: the guarded check; `auto` fuses the check into the slot merge, see
    # test_fused_slot_check.py)
    g = gl.DataGadget((rows, width), dtype="float32", placement="pinned", strategy="sorted")
    checks = []
    real_start = gadget_mod.start_guarded_check

    def spy(ids: torch.Tensor, num_rows: int):  # type: ignore[no-untyped-def]
        checks.append(real_start(ids, num_rows))
        return checks[-1]

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("launch failed (test)")

    monkeypatch.setattr(gadget_mod, "start_guarded_check", spy)
    with monkeypatch.context() as m:
        m.setattr(_kernels, "launch_scatter", broken)
        with pytest.raises(RuntimeError, match="launch failed"):
            g.insertData(
                torch.ones(3, width, device="cuda"), torch.tensor([1, 1, 2], device="cuda")
            )
    assert len(checks) == 1 and checks[0].done
    assert (g.getData(torch.arange(rows)) == 0).all()
    # the thread's pair serves the next checks as usual, on another stream too
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(
                torch.ones(2, width, device="cuda"), torch.tensor([4, rows], device="cuda")
            )
        g.insertData(
            torch.full((2, width), 2.0, device="cuda"), torch.tensor([4, 4], device="cuda")
        )
    side.synchronize()
    assert (g.getData([4]) == 2).all() and int(
        torch.count_nonzero(g.getData(torch.arange(rows)))
    ) == width
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_slot_merge_into_an_interleaved_group_writes_every_slot() -> None:
    from gadgetloader.stores import interleaved_stores
    from gadgetloader.stores._base import scatter_many

    rows, width, nslots, n = 400, 8, 3, 900
    stores = interleaved_stores(
        "pinned", rows, (width,), torch.float32, nslots, torch.device("cuda")
    )
    gen = torch.Generator().manual_seed(8)
    ref = torch.randn(rows, nslots, width, generator=gen)
    for k, st in enumerate(stores):
        st.write_block(0, ref[:, k].contiguous())
        st.synchronize()
    ids = torch.randint(0, rows, (n,), generator=gen)
    new = [torch.randn(n, width, generator=gen) for _ in stores]
    assert _engine._slot_merge(stores[0].device_view(), n)
    scatter_many(stores, ids.cuda(), [x.cuda() for x in new])
    for k, st in enumerate(stores):
        want = _last_writer(ref[:, k].numpy(), ids.numpy(), new[k].numpy())
        got = st.gather(torch.arange(rows).cuda(), torch.device("cuda")).cpu().numpy()
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@NEEDS_CUPY
def test_unchecked_out_of_range_ids_are_skipped_and_nothing_outside_is_written() -> None:
    rows, width = 1000, 8
    big = torch.zeros(rows + 2, width, device="cuda")  # guard rows around the table
    table = big[1 : rows + 1]
    ids = torch.tensor([5, -1, rows, 5, rows + 7, 999, -3, 0, 999], device="cuda")
    new = torch.arange(ids.numel() * width, dtype=torch.float32, device="cuda").view(-1, width)
    new += 1
    assert _engine._slot_merge(table, ids.numel())
    _engine.scatter(table, ids, new)
    assert (big[0] == 0).all() and (big[rows + 1] == 0).all()
    assert torch.equal(table[5], new[3]) and torch.equal(table[999], new[8])
    assert torch.equal(table[0], new[7])
    written = torch.zeros(rows, dtype=torch.bool)
    written[[0, 5, 999]] = True
    assert (table[~written.cuda()] == 0).all()
    # the same through the public API, with the range check off
    g = gl.DataGadget((rows, width), dtype="float32", placement="pinned")
    g.insertData(new, ids, check_ids=False)
    assert torch.equal(g.getData([0, 5, 999]), new[[7, 3, 8]])
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("merge", ["slot", "sort"])
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_bad_cuda_ids_raise_after_the_merge_and_leave_the_table_unchanged(
    placement: str, merge: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if merge == "sort":
        monkeypatch.setattr(_engine, "SLOT_MERGE_MAX_ROWS", 0)
    rows, width = 400, 32  # 4 ids: at most 64 KB of table for the slot merge
    base = torch.randn(rows, width)
    g = gl.DataGadget(base.clone(), placement=placement)
    new = torch.randn(4, width, device="cuda")
    for bad in ([1, 1, rows, 2], [-1, 3, 3, 4]):
        with pytest.raises(gl.GadgetIndexError, match="out of range|negative"):
            g.insertData(new, torch.tensor(bad, device="cuda"))
        assert torch.equal(g.getData(torch.arange(rows)).cpu(), base)
    # a bad id and a wrong shape: the id is reported, as for CPU ids
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(new[:3], torch.tensor([1, 1, rows, 2], device="cuda"))
    with pytest.raises(gl.GadgetValueError, match="shape"):
        g.insertData(new[:3], torch.tensor([1, 1, 0, 2], device="cuda"))
    assert torch.equal(g.getData(torch.arange(rows)).cpu(), base)
    # the check passes: written, repeats merged
    g.insertData(new, torch.tensor([9, 4, 9, 4], device="cuda"))
    assert torch.equal(g.getData([4, 9]), new[[3, 2]])
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_fused_scatter_many_with_repeats_merges_for_every_table() -> None:
    rows, n = 30_000, 40_000
    gen = torch.Generator().manual_seed(11)
    bases = [torch.randn(rows, w, generator=gen) for w in (32, 32, 32)]
    gs = [gl.DataGadget(b.clone(), placement="pinned") for b in bases]
    ids = torch.randint(0, rows, (n,), generator=gen)
    news = [torch.randn(n, 32, generator=gen) for _ in gs]
    gl.scatter_many(gs, [x.cuda() for x in news], ids.cuda())
    for g, b, x in zip(gs, bases, news, strict=True):
        want = _last_writer(b.numpy(), ids.numpy(), x.numpy())
        np.testing.assert_array_equal(g.getData(torch.arange(rows)).cpu().numpy(), want)
        g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_large_request_still_sorts_and_matches() -> None:
    rows, width = 300_000, 4
    n = _engine.SORT_FROM_IDS + 5
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(rows, width, generator=gen)
    table = base.cuda()
    ids = torch.randint(0, rows, (n,), generator=gen)
    new = torch.randn(n, width, generator=gen)
    assert not _engine._slot_merge(table, n)
    _engine.scatter(table, ids.cuda(), new.cuda())
    np.testing.assert_array_equal(
        table.cpu().numpy(), _last_writer(base.numpy(), ids.numpy(), new.numpy())
    )


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_table_past_the_slot_limit_sorts_and_matches() -> None:
    rows = _engine.SLOT_MERGE_MAX_ROWS + 1  # 1-byte rows: 16 MiB
    table = torch.zeros(rows, 1, dtype=torch.uint8, device="cuda")
    n = 2048  # 8 KB of table per id: dense enough for the slot merge
    ids = torch.zeros(n, dtype=torch.int64, device="cuda")
    ids[:5] = torch.tensor([rows - 1, 3, rows - 1, 3, 0])
    new = torch.zeros(n, 1, dtype=torch.uint8, device="cuda")
    new[:5, 0] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    new[-1, 0] = 9  # the last occurrence of id 0
    assert not _engine._slot_merge(table, n)
    assert _engine._slot_merge(table[:-1], n)
    _engine.scatter(table, ids, new)
    assert table[[rows - 1, 3, 0]].flatten().tolist() == [3, 4, 9]
    assert int(table.sum()) == 16


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_sparse_request_keeps_the_sort() -> None:
    rows, width = 100_000, 32  # 12.8 MB
    table = torch.zeros(rows, width, device="cuda")
    ids = torch.tensor([7, 99_999, 7], device="cuda")  # 4 MB of table per id
    assert not _engine._slot_merge(table, ids.numel())
    new = torch.arange(3 * width, dtype=torch.float32, device="cuda").view(3, width)
    _engine.scatter(table, ids, new)
    assert torch.equal(table[7], new[2]) and torch.equal(table[99_999], new[1])


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("shape", ["grid", "in_order"])
@pytest.mark.parametrize("mode", ["all", "last_of_run", "last_by_slot"])
def test_a_guarded_scatter_kernel_writes_nothing_when_an_end_is_outside(
    mode: str, shape: str
) -> None:
    rows, width = 4000, 24
    table = torch.zeros(rows, width, device="cuda")
    ids = torch.tensor([3, 10, 10, 77, 3999], device="cuda")
    new = torch.arange(5 * width, dtype=torch.float32, device="cuda").view(5, width) + 1
    kw: dict = {}
    pos = None
    if mode == "last_of_run":
        ids, pos = torch.sort(ids, stable=True)
        kw["mode"] = _kernels.SCATTER_LAST_OF_RUN
    elif mode == "last_by_slot":
        slot = torch.empty(rows, dtype=torch.int32, device="cuda")
        _kernels.launch_last_slots(ids, slot)
        kw.update(mode=_kernels.SCATTER_LAST_BY_SLOT, slot=slot)
    else:
        ids, new = ids[[0, 1, 3, 4]], new[[0, 1, 3, 4]]  # distinct
    if shape == "in_order":
        kw.update(ordered=True, blocks_per_sm=_kernels.IN_ORDER)
    for bad in ([-1, 3999], [3, rows], [-5, rows + 5]):
        guard = torch.tensor(bad, device="cuda")
        _kernels.launch_scatter(table, ids, new, pos, guard=guard, **kw)
        assert int(torch.count_nonzero(table)) == 0, bad
    guard = torch.tensor([3, 3999], device="cuda")
    _kernels.launch_scatter(table, ids, new, pos, guard=guard, **kw)
    assert int(torch.count_nonzero(table.abs().sum(1))) == 4
    assert torch.equal(table[10], new[2] if mode != "all" else new[1])
