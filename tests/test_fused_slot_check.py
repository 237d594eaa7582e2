"""Session 25: the range check of a write's CUDA ids fused into the sort-free merge.

Where ``insertData`` scatters by the ``kernel`` strategy with the slot merge (small
tables, see ``_engine._slot_merge``), the merge's first launch flags any id outside the
table in an extra slot, the scatter (mode ``SCATTER_LAST_BY_SLOT_GUARDED``) then writes
nothing, and the merge's second launch copies the flag to the thread's page-locked word,
which the host reads: no reduction and no copy of the check's own. A bad id must still
raise the usual error with the table unchanged, the flag must never stay set for the next
write, and the kernels must stay inside the slot array.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader import _ids
from gadgetloader.transfer import _engine, _kernels

# --- on the CPU: the plumbing refuses what does not fit ------------------------------------


def test_a_flagged_slot_array_has_one_entry_more_than_the_table() -> None:
    table, ids = torch.zeros(10, 4), torch.zeros(3, dtype=torch.int64)
    _kernels._check_slot(torch.empty(11, dtype=torch.int32), table, ids, None, flagged=True)
    with pytest.raises(ValueError, match="11 entries .*and the flag"):
        _kernels._check_slot(torch.empty(10, dtype=torch.int32), table, ids, None, flagged=True)
    with pytest.raises(ValueError, match="10 entries"):
        _kernels._check_slot(torch.empty(11, dtype=torch.int32), table, ids, None)


def test_a_guarded_slot_scatter_refuses_slots_without_the_flag() -> None:
    t, i, r = torch.zeros(4, 2), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="and the flag"):
        _kernels.launch_scatter(
            t,
            i,
            r,
            None,
            _kernels.SCATTER_LAST_BY_SLOT_GUARDED,
            slot=torch.empty(4, dtype=torch.int32),
        )


def test_host_writes_check_cpu_ids_and_say_nothing_is_pending() -> None:
    g = gl.DataGadget(torch.zeros(6, 2), placement="cpu")
    data, ids, pending = g._insert_args(torch.ones(2, 2), [1, 5], True)
    assert pending is False and ids.tolist() == [1, 5]
    with pytest.raises(gl.GadgetIndexError, match="id 6 is out of range"):
        g._insert_args(torch.ones(2, 2), [1, 6], True)
    with pytest.raises(gl.GadgetIndexError, match="negative"):
        g._insert_args(torch.ones(2, 2), [-1, 0], False)  # CPU ids: checked regardless
    assert (g.getData(torch.arange(6)) == 0).all()


# --- on the GPU ---------------------------------------------------------------------------


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, for each slot merge, whether the check was fused into it."""
    calls: list[bool] = []
    real = _kernels.launch_last_slots

    def spy(ids: torch.Tensor, slot: torch.Tensor, *, flag_out: int = 0) -> None:
        calls.append(bool(flag_out))
        real(ids, slot, flag_out=flag_out)

    monkeypatch.setattr(_kernels, "launch_last_slots", spy)
    return calls


@pytest.mark.gpu
@NEEDS_CUPY
def test_the_flag_kernels_stay_inside_the_slots_and_report_bad_ids() -> None:
    rows, width = 100, 4
    pad = torch.full((rows + 3,), -7, dtype=torch.int32, device="cuda")
    slot = pad[1:-1]  # rows + 1 entries: the slots and the flag
    big = torch.zeros(rows + 2, width, device="cuda")  # guard rows around the table
    table = big[1:-1]
    flag = _ids.flag_word(torch.device("cuda"))
    assert flag
    new = torch.arange(8 * width, dtype=torch.float32, device="cuda").view(8, width) + 1
    for bad in ([-1, 5, 5, 9, 0, 1, 2, 3], [5, 5, rows, 9, 0, 1, 2, 3], [5] * 7 + [-100]):
        ids = torch.tensor(bad, device="cuda")
        _kernels.launch_last_slots(ids, slot, flag_out=flag)
        mode = _kernels.SCATTER_LAST_BY_SLOT_GUARDED
        _kernels.launch_scatter(table, ids, new, None, mode, slot=slot)
        torch.cuda.synchronize()
        assert _ids.read_flag() == 1
        assert pad[0].item() == -7 and pad[-1].item() == -7
        assert (big == 0).all()  # nothing written, inside or outside the table
    ids = torch.tensor([5, 5, 9, 0, 1, 2, 3, 99], device="cuda")
    _kernels.launch_last_slots(ids, slot, flag_out=flag)
    _kernels.launch_scatter(table, ids, new, None, _kernels.SCATTER_LAST_BY_SLOT_GUARDED, slot=slot)
    torch.cuda.synchronize()
    assert _ids.read_flag() == 0  # the flag was zeroed first, not left from the bad calls
    assert slot[rows].item() == 0 and pad[-1].item() == -7
    assert torch.equal(table[5], new[1]) and torch.equal(table[99], new[7])
    assert (big[0] == 0).all() and (big[-1] == 0).all()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
@pytest.mark.parametrize("n", [1, 3, 5000])
def test_insert_fuses_the_check_and_refuses_every_bad_id(
    placement: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    width = 16  # 64 B rows: the slot merge takes at most 16 KB of table per id
    rows = min(2000, n * _kernels.SPARSE_GAP_BYTES // 64)
    gen = torch.Generator().manual_seed(n)
    base = torch.randn(rows, width, generator=gen)
    g = gl.DataGadget(base.clone(), placement=placement)
    calls = _fused_calls(monkeypatch)
    new = torch.randn(n, width, generator=gen).cuda()
    ids = torch.randint(0, rows, (n,), generator=gen)
    for pos in sorted({0, n // 2, n - 1}):
        for bad, what in ((rows, "out of range"), (rows + 12345, "out of range"), (-1, "negative")):
            wrong = ids.clone()
            wrong[pos] = bad
            with pytest.raises(gl.GadgetIndexError, match=f"id {bad} is {what}"):
                g.insertData(new, wrong.cuda())
    assert calls and all(calls)  # every write above went through the fused check
    assert torch.equal(g.getData(torch.arange(rows)).cpu(), base)
    g.insertData(new, ids.cuda())  # the flag of the last bad write is not seen again
    want = base.numpy().copy()
    for j, r in enumerate(ids.tolist()):
        want[r] = new[j].cpu().numpy()
    np.testing.assert_array_equal(g.getData(torch.arange(rows)).cpu().numpy(), want)
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_failed_fused_write_leaves_the_table_unchanged_and_later_writes_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows, width = 300, 8
    g = gl.DataGadget((rows, width), dtype="float32", placement="pinned")

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("launch failed (test)")

    with monkeypatch.context() as m:
        m.setattr(_kernels, "launch_scatter", broken)
        for ids in ([1, 1, 2], [1, rows, 2]):  # a good and a bad request: the launch fails first
            with pytest.raises(RuntimeError, match="launch failed"):
                g.insertData(torch.ones(3, width, device="cuda"), torch.tensor(ids, device="cuda"))
    assert (g.getData(torch.arange(rows)) == 0).all()
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
    assert (g.getData([4]) == 2).all()
    assert int(torch.count_nonzero(g.getData(torch.arange(rows)))) == width
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("shift", [1, 3000])
def test_rows_read_from_the_table_itself_are_read_before_the_write(
    shift: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rows k..k+n-1 take the old rows 0..n-1: many blocks read rows that others write, so
    # without the copy of the source the result would depend on the blocks' timing
    rows, width, n = 40_000, 32, 30_000
    base = torch.arange(rows * width, dtype=torch.float32).view(rows, width)
    g = gl.DataGadget(base.clone(), placement="cuda")
    calls = _fused_calls(monkeypatch)
    src = g.as_tensor()[0:n]
    g.insertData(src, torch.arange(shift, shift + n, device="cuda"))
    assert calls == [True]  # the fused path
    want = base.clone()
    want[shift : shift + n] = base[0:n]
    assert torch.equal(g.getData(torch.arange(rows)).cpu(), want)
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_without_a_mapped_check_word_the_write_keeps_the_guarded_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gadgetloader.gadget as gadget_mod

    rows, width = 500, 8
    base = torch.randn(rows, width)
    g = gl.DataGadget(base.clone(), placement="pinned")
    monkeypatch.setattr(_engine, "flag_word", lambda device: None)
    calls = _fused_calls(monkeypatch)
    guarded = []
    real = gadget_mod.start_guarded_check
    monkeypatch.setattr(
        gadget_mod, "start_guarded_check", lambda *a: (guarded.append(1), real(*a))[1]
    )
    new = torch.randn(3, width, device="cuda")
    with pytest.raises(gl.GadgetIndexError, match="out of range"):
        g.insertData(new, torch.tensor([1, rows, 1], device="cuda"))
    assert torch.equal(g.getData(torch.arange(rows)).cpu(), base)
    g.insertData(new, torch.tensor([1, 7, 1], device="cuda"))
    assert torch.equal(g.getData([1, 7]), new[[2, 1]])
    # the engine's slot merge served both, guarded by the (smallest, largest) pair
    assert calls == [False, False] and guarded == [1, 1]
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_the_in_order_launch_honours_the_flag_too() -> None:
    rows, width = 64, 128  # 512 B rows: the in-order scatter's shape
    big = torch.zeros(rows + 2, width, device="cuda")
    table = big[1:-1]
    slot = torch.empty(rows + 1, dtype=torch.int32, device="cuda")
    flag = _ids.flag_word(torch.device("cuda"))
    assert flag
    new = torch.ones(4, width, device="cuda")
    mode = _kernels.SCATTER_LAST_BY_SLOT_GUARDED
    for ids, bad in (([3, 9, rows, 3], 1), ([3, 9, 5, 3], 0)):
        t = torch.tensor(ids, device="cuda")
        _kernels.launch_last_slots(t, slot, flag_out=flag)
        _kernels.launch_scatter(
            table, t, new, None, mode, slot=slot, blocks_per_sm=_kernels.IN_ORDER
        )
        torch.cuda.synchronize()
        assert _ids.read_flag() == bad
        assert int(torch.count_nonzero(big.sum(1))) == (0 if bad else 3)
    assert (big[0] == 0).all() and (big[-1] == 0).all()


def test_an_empty_request_is_a_no_op_that_reads_no_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*a: object, **k: object) -> None:
        raise AssertionError("nothing may be launched or read for no ids")

    monkeypatch.setattr(_engine, "flag_word", no)
    monkeypatch.setattr(_engine, "read_flag", no)
    table = torch.zeros(4, 2)
    assert _engine.slot_scatter(table, torch.zeros(0, dtype=torch.int64), table[:0], check=True)
    assert (table == 0).all()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("strategy", ["sorted", "torch"])
def test_other_strategies_keep_their_own_check(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, width = 500, 8
    base = torch.randn(rows, width)
    g = gl.DataGadget(base.clone(), placement="pinned", strategy=strategy)
    calls = _fused_calls(monkeypatch)
    new = torch.randn(3, width, device="cuda")
    with pytest.raises(gl.GadgetIndexError, match="out of range"):
        g.insertData(new, torch.tensor([1, rows, 1], device="cuda"))
    assert torch.equal(g.getData(torch.arange(rows)).cpu(), base)
    g.insertData(new, torch.tensor([1, 7, 1], device="cuda"))
    assert torch.equal(g.getData([1, 7]), new[[2, 1]])
    assert calls == []  # no slot merge, so no fused check
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_huge_requests_and_large_tables_keep_the_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, width = 1000, 8
    g = gl.DataGadget((rows, width), dtype="float32", placement="pinned")
    calls = _fused_calls(monkeypatch)
    monkeypatch.setattr(_engine, "SLOT_MERGE_MAX_ROWS", rows - 1)  # this table is "large"
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.ones(2, width, device="cuda"), torch.tensor([3, rows], device="cuda"))
    g.insertData(torch.ones(2, width, device="cuda"), torch.tensor([3, 3], device="cuda"))
    assert calls == [] and (g.getData([3]) == 1).all()
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_unchecked_cuda_ids_gather_by_one_kernel_launch(
    placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, width = 1000, 8
    base = torch.randn(rows, width)
    g = gl.DataGadget(base.clone(), placement=placement)
    launches = []
    real = _kernels.gather_rows
    monkeypatch.setattr(
        _kernels, "gather_rows", lambda *a, **k: (launches.append(1), real(*a, **k))[1]
    )
    ids = torch.tensor([5, 999, 5, 0, rows, -4], device="cuda")
    got = g.getData(ids, check_ids=False)
    assert launches == [1]
    assert torch.equal(got[:4].cpu(), base[[5, 999, 5, 0]])
    assert (got[4:] == 0).all()  # unchecked ids outside the table: zero rows, nothing read
    out = torch.full((6, width), 3.0, device="cuda")
    assert g.getData(ids, out=out, check_ids=False) is out
    assert torch.equal(out[:4].cpu(), base[[5, 999, 5, 0]]) and (out[4:] == 0).all()
    with pytest.raises(gl.GadgetIndexError):
        g.getData(ids)  # checked by default
    g.close()
