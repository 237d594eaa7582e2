"""Session 26: gathers from a table in host memory read each distinct row once.

Repeated ids in a zero-copy gather cost the link their bytes again (the H200's cache does
not keep them). Where ``_kernels.dedup_slots`` says it pays (a ``pinned`` table of at most
``DEDUP_MAX_ROWS`` rows, at least ``DEDUP_MIN_IDS`` ids that may repeat), a slot per table
row takes one position naming it (``launch_gather_slots``), only that entry reads the host,
and ``gl_gather_repeats`` copies its row to the entries that repeat it. The result must be
the plain gather's, bit for bit, on every route that takes it (``getData`` with CPU or CUDA
ids, ``Store.gather`` by the ``kernel`` strategy, fused tables, ``GadgetDataset``), bad ids
must still give zero rows (unchecked) or the usual error, and no kernel may touch memory
outside the table, the slots or the output.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY
from test_review_session15_kernels import emu  # noqa: F401  (the emulated launches)

import gadgetloader as gl
from gadgetloader.transfer import _engine, _kernels

# --- on the CPU: the plumbing refuses what does not fit ------------------------------------


class _FakeCudaTable:
    """What :func:`_kernels.dedup_slots` asks of a table, for a CUDA table on the CPU."""

    def __init__(self, rows: int, host_memory: bool = True) -> None:
        self.shape, self.is_cuda, self.device = (rows, 4), True, torch.device("cpu")
        self.host_memory = host_memory

    def dim(self) -> int:
        return 2


def test_slots_only_where_they_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "in_host_memory", lambda t: t.host_memory)
    low, per_id, top = _kernels.DEDUP_MIN_IDS, _kernels.DEDUP_ROWS_PER_ID, _kernels.DEDUP_MAX_ROWS
    assert (low, per_id, top) == (1 << 16, 16, 1 << 24)  # as README and DESIGN say

    def slots(rows: int, n: int, host: bool = True) -> torch.Tensor | None:
        return _kernels.dedup_slots(_FakeCudaTable(rows, host), n)  # type: ignore[arg-type]

    got = slots(1_000_000, 131_072)  # the seed's request
    assert got is not None and got.dtype == torch.int32 and got.shape == (1_000_000,)
    assert slots(1_000_000, low - 1) is None  # too few ids to pay for the launches
    assert slots(low * per_id, low) is not None
    assert slots(low * per_id + 1, low) is None  # too sparse: few repeats to save
    assert slots(8_000_000, 131_072) is None  # (measured 5% slower with the slots)
    assert slots(top + 1, 2**24) is None and slots(top, 2**24) is not None
    assert slots(1_000_000, 2**31) is None
    assert slots(1_000_000, 131_072, host=False) is None  # a table in GPU memory
    assert slots(0, 131_072) is None
    assert _kernels.dedup_slots(torch.zeros(100, 4), 1 << 20) is None  # a CPU table


def test_a_gather_that_reads_rows_once_refuses_pos_count_and_bad_slots() -> None:
    table, out = torch.zeros(10, 4), torch.zeros(3, 4)
    ids = torch.tensor([1, 1, 2])
    slot = torch.empty(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="no pos"):
        _kernels.launch_gather(table, ids, out, torch.tensor([2, 1, 0]), slot=slot)
    with pytest.raises(ValueError, match="takes no count"):
        _kernels.launch_gather(table, ids, out, slot=slot, count=torch.ones(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="10 entries"):
        _kernels.launch_gather(table, ids, out, slot=torch.empty(11, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        _kernels.launch_gather(table, ids, out, slot=torch.empty(10, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D int64"):
        _kernels.launch_gather_slots(ids.int(), slot)
    with pytest.raises(ValueError, match="int32"):
        _kernels.launch_gather_slots(ids, slot.long())
    for how in ({"ordered": True}, {"blocks_per_sm": 0}, {"rows_per_block": 1}):
        with pytest.raises(ValueError, match="grid-stride launch"):
            _kernels.launch_gather(table, ids, out, slot=slot, **how)  # type: ignore[arg-type]


# --- emulated on the CPU: the kernels as transcribed in test_review_session15_kernels ------


def test_emulated_slots_repeats_views_and_bad_ids_stay_inside(emu: Any) -> None:  # noqa: F811
    """The words of the three launches are packed right: a column slice (pitch != row,
    4-byte vectors), interleaved slots moved as one wide row, several tables in one launch,
    bad ids; the emulator refuses any access outside the tensors given."""
    base = torch.arange(40 * 9, dtype=torch.float32).reshape(40, 9)
    view = base[:, 1:5]
    ids = torch.tensor([3, -1, 39, 3, 40, 2**63 - 1, 3, 0, 39, 0])
    inside = (ids >= 0) & (ids < 40)
    slot = torch.full((40,), -5, dtype=torch.int32)
    _kernels.launch_gather_slots(ids, slot)
    assert slot[3].item() in (0, 3, 6) and slot[39].item() in (2, 8) and slot[1].item() == -5
    out = torch.full((10, 4), -7.0)
    _kernels.launch_gather(view, ids, out, slot=slot)
    want = torch.zeros(10, 4)
    want[inside] = view[ids[inside]]
    assert torch.equal(out, want)
    last = emu.launches[-3:]
    assert last[0] == "gl_last_slot" and last[2] == last[1].replace("gather", "gather_repeats")
    inter = torch.arange(30 * 3 * 4, dtype=torch.float32).reshape(30, 3, 4)
    parts = [inter[:, k] for k in range(3)]
    assert _kernels.group_geometry(parts)[2] == 3
    sid = torch.tensor([1, 29, 1, 30, -5, 29, 29])
    ok = (sid >= 0) & (sid < 30)
    islot = torch.empty(30, dtype=torch.int32)
    _kernels.launch_gather_slots(sid, islot)
    outs = [torch.full((7, 4), -1.0) for _ in parts]
    _kernels.launch_gather(parts, sid, outs, slot=islot)
    for k, o in enumerate(outs):
        assert torch.equal(o[ok], inter[sid[ok], k]) and bool((o[~ok] == 0).all())
    separate = [torch.randn(30, 4) for _ in range(2)]
    outs = [torch.empty(7, 4) for _ in separate]
    _kernels.launch_gather(separate, sid, outs, slot=islot)
    for t, o in zip(separate, outs, strict=True):
        assert torch.equal(o[ok], t[sid[ok]]) and bool((o[~ok] == 0).all())


def test_emulated_slots_that_name_no_entry_of_the_id_still_give_the_right_rows(
    emu: Any,  # noqa: F811
) -> None:
    """Slots not filled for these ids (or ids changed between the launches): the repeats
    launch then reads the table, never another place of the output or outside it."""
    table = torch.randn(20, 8)
    ids = torch.tensor([4, 4, 7, 19, 0, 7, 4, -2, 25])
    inside = (ids >= 0) & (ids < 20)
    gen = torch.Generator().manual_seed(1)
    for fill in (
        torch.full((20,), 2**31 - 1, dtype=torch.int32),  # past the output
        torch.full((20,), -(2**31), dtype=torch.int32),  # negative
        torch.randint(0, 9, (20,), generator=gen, dtype=torch.int32),  # entries of other ids
        torch.randint(-(2**31), 2**31 - 1, (20,), generator=gen, dtype=torch.int32),
    ):
        out = torch.full((9, 8), 3.0)
        _kernels.launch_gather(table, ids, out, slot=fill.clone())
        assert torch.equal(out[inside], table[ids[inside]])
        assert bool((out[~inside] == 0).all())


def test_emulated_prepared_gather_reads_rows_once(
    emu: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = torch.randn(50, 6)
    slot = torch.full((50,), -1, dtype=torch.int32)
    monkeypatch.setattr(_kernels, "dedup_slots", lambda t, n: slot)
    emu.ranges.append(emu.given("slots", slot))  # (gather_rows makes them itself)
    ids = torch.tensor([9, 9, 49, 0, 9, 51, -1, 0])
    inside = (ids >= 0) & (ids < 50)
    out = torch.full((8, 6), 2.0)
    _kernels.gather_rows(table, ids, out, dedup=True)
    assert emu.launches[-3:] == ["gl_last_slot", "gl_gather_8", "gl_gather_repeats_8"]
    assert torch.equal(out[inside], table[ids[inside]]) and bool((out[~inside] == 0).all())
    _kernels.gather_rows(table, ids[::2], out[:4], dedup=True)  # strided ids: densified
    assert torch.equal(out[:4][inside[::2]], table[ids[::2][inside[::2]]])
    n = len(emu.launches)
    _kernels.gather_rows(table, ids, out, dedup=False)
    assert emu.launches[n:] == ["gl_gather_8"]


# --- on the GPU ---------------------------------------------------------------------------


def _slot_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the number of ids of each slot fill (one per deduplicated gather)."""
    calls: list[int] = []
    real = _kernels.launch_gather_slots

    def spy(ids: torch.Tensor, slot: torch.Tensor, *, flag_out: int = 0) -> None:
        calls.append(ids.numel())
        real(ids, slot, flag_out=flag_out)

    monkeypatch.setattr(_kernels, "launch_gather_slots", spy)
    return calls


def _requests(rows: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen)
    perm = torch.randperm(rows, generator=gen)
    return {
        "uniform": torch.randint(0, rows, (n,), generator=gen),
        "skewed": perm[(u**4 * rows).long().clamp_(max=rows - 1)],
        "one id": torch.full((n,), rows - 1, dtype=torch.int64),
        "distinct": torch.randperm(rows, generator=gen)[: min(n, rows)],
    }


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("where", ["cpu ids", "cuda ids", "cuda ids unchecked"])
def test_get_data_with_repeats_reads_each_row_once_and_matches_numpy(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, width, n = 200_000, 32, _kernels.DEDUP_MIN_IDS * 2
    base = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    g = gl.DataGadget(base.copy(), placement="pinned")
    calls = _slot_calls(monkeypatch)
    for name, ids in _requests(rows, n, 1).items():
        arg = ids if where == "cpu ids" else ids.cuda()
        got = g.getData(arg, check_ids=where != "cuda ids unchecked")
        assert np.array_equal(got.cpu().numpy(), base[ids.numpy()]), name
        out = torch.full((n, width), 7.0, device="cuda")
        assert g.getData(arg, out=out) is out
        assert np.array_equal(out.cpu().numpy(), base[ids.numpy()]), name
    assert calls == [n] * 8
    ids2 = _requests(rows, n, 2)["skewed"].view(64, -1)  # 2-D ids: the store's path
    got = g.getData(ids2.cuda())
    assert got.shape == (64, n // 64, width)
    assert np.array_equal(got.cpu().numpy(), base[ids2.numpy()])
    assert calls[-1] == n
    calls.clear()
    g.getData(torch.randint(0, rows, (_kernels.DEDUP_MIN_IDS - 1,)))  # too few to pay
    got = g.getData(slice(1000, 1000 + n))  # a slice of rows holds no repeats
    assert np.array_equal(got.cpu().numpy(), base[1000 : 1000 + n])
    assert calls == []
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_table_in_gpu_memory_gathers_without_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, n = 20_000, _kernels.DEDUP_MIN_IDS
    base = torch.randn(rows, 16)
    g = gl.DataGadget(base.clone(), placement="cuda")
    calls = _slot_calls(monkeypatch)
    ids = torch.randint(0, rows, (n,))
    assert torch.equal(g.getData(ids).cpu(), base[ids])
    assert calls == []  # repeats cost no link bytes there
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_unchecked_bad_ids_give_zero_rows_and_nothing_outside_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kernels, "DEDUP_MIN_IDS", 1)
    rows, width = 300, 8
    g = gl.DataGadget(torch.randn(rows, width), placement="pinned")
    table = g.as_tensor()
    ref = table.cpu()
    pad = torch.full((rows + 2,), -7, dtype=torch.int32, device="cuda")
    slot = pad[1:-1]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, rows, (5000,), generator=gen)
    ids[::7] = -1
    ids[3::11] = rows
    ids[5::13] = -(10**12)
    ids[1::17] = 10**12
    cids = ids.cuda()
    big = torch.full((5002, width), 5.0, device="cuda")  # guard rows around the output
    out = big[1:-1]
    _kernels.launch_gather_slots(cids, slot)
    _kernels.launch_gather(table, cids, out, slot=slot)
    torch.cuda.synchronize()
    assert pad[0].item() == -7 and pad[-1].item() == -7
    assert (big[0] == 5).all() and (big[-1] == 5).all()
    inside = (ids >= 0) & (ids < rows)
    assert torch.equal(out[inside].cpu(), ref[ids[inside]])
    assert (out[~inside] == 0).all()
    # the same through getData without a check, and its check raising with a bad id
    got = g.getData(cids, check_ids=False)
    assert torch.equal(got.cpu()[inside], ref[ids[inside]]) and (got[~inside.cuda()] == 0).all()
    with pytest.raises(gl.GadgetIndexError):
        g.getData(cids)
    with pytest.raises(gl.GadgetIndexError):
        g.getData(ids)
    # slots not filled for these ids: the rows are still right, nothing outside is touched
    for fill in (2**31 - 1, -(2**31), 7):
        slot.fill_(fill)
        big.fill_(5.0)
        _kernels.launch_gather(table, cids, out, slot=slot)
        torch.cuda.synchronize()
        assert torch.equal(out[inside].cpu(), ref[ids[inside]]) and (out[~inside.cuda()] == 0).all()
        assert (big[0] == 5).all() and (big[-1] == 5).all()
        assert pad[0].item() == -7 and pad[-1].item() == -7
    assert torch.equal(table.cpu(), ref)  # a gather never writes the table
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize(
    "dtype,row_shape",
    [
        (torch.float32, (16,)),  # 64 B: 16-byte vectors
        (torch.float32, (3,)),  # 12 B: 4-byte vectors
        (torch.int16, (3,)),  # 6 B: 2-byte vectors
        (torch.uint8, (3,)),  # 3 B: 1-byte vectors
        (torch.float64, (2, 5)),
        (torch.bool, (7,)),
    ],
)
def test_every_vector_width_and_dtype_matches_the_plain_gather(
    dtype: torch.dtype, row_shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_kernels, "DEDUP_MIN_IDS", 1)
    rows, n = 1000, 4000
    gen = torch.Generator().manual_seed(rows)
    base = (torch.randn(rows, *row_shape, generator=gen) * 50).to(dtype)
    g = gl.DataGadget(base.clone(), placement="pinned")
    calls = _slot_calls(monkeypatch)
    table = g.as_tensor()
    for ids in _requests(rows, n, 4).values():
        cids = ids.cuda()
        plain = torch.empty(ids.numel(), *row_shape, dtype=dtype, device="cuda")
        _kernels.launch_gather(table, cids, plain)
        got = g.getData(cids)
        assert torch.equal(got, plain) and torch.equal(got.cpu(), base[ids])
    assert len(calls) == 4
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_fused_tables_and_an_interleaved_slot_by_the_kernel_strategy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kernels, "DEDUP_MIN_IDS", 1)
    rows, n = 2000, 6000
    wide = gl.DataGadget(torch.randn(rows, 24), placement="pinned").as_tensor()
    # three tables sharing rows: slots of one wide row (pitch 96 B, rows of 32 B)
    tables = [wide[:, 0:8], wide[:, 8:16], wide[:, 16:24]]
    calls = _slot_calls(monkeypatch)
    requests = _requests(rows, n, 5)
    for ids in requests.values():
        cids = ids.cuda()
        got = _engine.gather_many(tables, cids, strategy="kernel")
        for t, r in zip(tables, got, strict=True):
            assert torch.equal(r.cpu(), t.cpu()[ids])
        one = _engine.gather(tables[1], cids, strategy="kernel")
        assert torch.equal(one.cpu(), tables[1].cpu()[ids])
        # sorted ids of a row plan are distinct: no slots
        plan = torch.unique(cids)
        got = _engine.gather_many(tables, plan, strategy="kernel", ids_sorted=True)
        assert torch.equal(got[2].cpu(), tables[2].cpu()[plan.cpu()])
    assert calls == [m for ids in requests.values() for m in (ids.numel(),) * 2]
    separate = [gl.DataGadget(torch.randn(rows, 8), placement="pinned") for _ in range(3)]
    views = [s.as_tensor() for s in separate]
    ids = _requests(rows, n, 6)["skewed"]
    got = _engine.gather_many(views, ids.cuda(), strategy="kernel")
    for v, r in zip(views, got, strict=True):
        assert torch.equal(r.cpu(), v.cpu()[ids])


@pytest.mark.gpu
@NEEDS_CUPY
def test_dataset_reads_user_ids_once_and_leaves_sampler_batches_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kernels, "DEDUP_MIN_IDS", 64)
    rows = 4096
    x = np.random.default_rng(7).standard_normal((rows, 16)).astype(np.float32)
    y = np.arange(rows, dtype=np.int64)
    ds = gl.GadgetDataset(
        gl.DataGadget(x, placement="pinned"), gl.DataGadget(y, placement="pinned")
    )
    calls = _slot_calls(monkeypatch)
    ids = _requests(rows, 1000, 8)["skewed"]
    fx, fy = ds[ids]
    assert np.array_equal(fx.cpu().numpy(), x[ids.numpy()])
    assert np.array_equal(fy.cpu().numpy(), y[ids.numpy()])
    assert calls == [1000, 1000]
    calls.clear()
    seen = []
    for batch in gl.GadgetSampler(ds, batch_size=512, seed=1, coalesce=1):
        bx, by = ds.gather(batch)
        assert np.array_equal(bx.cpu().numpy(), x[by.cpu().numpy()])
        seen.append(by.cpu())
    assert calls == []  # a sampler's batch holds no repeats
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(rows))


# --- session 27: the range check of CUDA ids rides on the slots launch ----------------------


class _Event:
    """Stands in for the CUDA event a flagged slots launch records (CPU runs)."""

    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


class _Stream:
    def __init__(self) -> None:
        self.events: list[_Event] = []

    def record_event(self) -> _Event:
        self.events.append(_Event())
        return self.events[-1]


def test_emulated_slots_launch_sets_the_flag_for_bad_ids_only(
    emu: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    table = torch.randn(40, 4)
    slot = torch.full((40,), -1, dtype=torch.int32)
    monkeypatch.setattr(_kernels, "dedup_slots", lambda t, n: slot)
    flag = torch.zeros(3, dtype=torch.int64)  # the word, between two guards
    emu.ranges.append(emu.given("slots and flag", [slot, flag[1:2]]))
    word = flag[1:2].data_ptr()
    out = torch.full((6, 4), 3.0)
    good = torch.tensor([5, 5, 39, 0, 5, 39])
    event = _kernels.gather_rows(table, good, out, dedup=True, flag_out=word)
    assert event is stream.events[-1]  # recorded after the slots launch, before the rows
    last = emu.launches[-3:]
    assert last[0] == "gl_last_slot" and last[2] == last[1].replace("gather", "gather_repeats")
    assert flag.tolist() == [0, 0, 0] and torch.equal(out, table[good])
    for bad in ([5, -1, 0, 5, 2, 3], [0, 1, 2, 3, 4, 40], [-(2**62)] * 6):
        ids = torch.tensor(bad)
        inside = (ids >= 0) & (ids < 40)
        flag.zero_()
        _kernels.gather_rows(table, ids, out.fill_(3.0), dedup=True, flag_out=word)
        assert flag.tolist() == [0, 1, 0], bad
        assert torch.equal(out[inside], table[ids[inside]]) and bool((out[~inside] == 0).all())
    # without slots the flag is not written and no event is recorded
    n = len(stream.events)
    flag.zero_()
    assert _kernels.gather_rows(table, torch.tensor([1, -1]), out[:2], flag_out=word) is None
    assert flag.tolist() == [0, 0, 0] and len(stream.events) == n
    # no flag asked for: no event either
    assert _kernels.gather_rows(table, good, out, dedup=True) is None
    assert len(stream.events) == n


def test_a_flag_check_raises_the_usual_error_and_falls_back_without_an_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gadgetloader import _ids

    pair = _ids._Pair.__new__(_ids._Pair)  # (the thread's page-locked pair on a GPU host)
    pair.buf = torch.zeros(2, dtype=torch.int64)
    pair.host, pair.mapped = pair.buf.numpy(), {}
    monkeypatch.setattr(_ids, "_this_pair", lambda: pair)
    ids = torch.tensor([0, 4, 9])
    check = _ids.FlagCheck(1, ids, 10)
    event = _Event()
    check.event = event
    pair.host[0] = 0
    check()  # flag clear: passes, having waited for the launch
    assert event.waited == 1
    bad = torch.tensor([0, 12, 3])
    check = _ids.FlagCheck(1, bad, 10)
    check.event = _Event()
    pair.host[0] = 1
    with pytest.raises(gl.GadgetIndexError, match="id 12 is out of range"):
        check()
    # the flag set although the ids are fine now (they changed after the read): still an error
    check = _ids.FlagCheck(1, ids, 10)
    check.event = _Event()
    with pytest.raises(gl.GadgetIndexError, match="outside the table"):
        check()
    pair.host[0] = 0
    # the gather took no slots (no event): the ordinary check runs
    with pytest.raises(gl.GadgetIndexError, match="id 12 is out of range"):
        _ids.FlagCheck(1, bad, 10)()
    _ids.FlagCheck(1, ids, 10)()
    with pytest.raises(gl.GadgetIndexError, match="id -1 is negative"):
        _ids.FlagCheck(1, torch.tensor([-1]), 10)()


def _flag_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, per slots launch, whether it carried a flag word."""
    calls: list[bool] = []
    real = _kernels.launch_gather_slots

    def spy(ids: torch.Tensor, slot: torch.Tensor, *, flag_out: int = 0) -> None:
        calls.append(bool(flag_out))
        real(ids, slot, flag_out=flag_out)

    monkeypatch.setattr(_kernels, "launch_gather_slots", spy)
    return calls


@pytest.mark.gpu
@NEEDS_CUPY
def test_checked_cuda_ids_are_checked_by_the_slots_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows, width, n = 100_000, 8, _kernels.DEDUP_MIN_IDS
    base = torch.randn(rows, width)
    g = gl.DataGadget(base.clone(), placement="pinned")
    calls = _flag_calls(monkeypatch)
    reductions: list[int] = []
    real_aminmax = torch.aminmax

    def aminmax(*a: Any, **k: Any) -> Any:
        reductions.append(1)
        return real_aminmax(*a, **k)

    monkeypatch.setattr(torch, "aminmax", aminmax)
    ids = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(9))
    cids = ids.cuda()
    assert torch.equal(g.getData(cids).cpu(), base[ids])
    calls.clear()  # (the thread's first check maps its pair with a test reduction)
    reductions.clear()
    assert torch.equal(g.getData(cids).cpu(), base[ids])
    assert calls == [True] and reductions == []  # no reduction of its own
    for where, value in ((0, -1), (n - 1, rows), (n // 2, 2**40), (slice(None), -5)):
        bad = cids.clone()
        bad[where] = value
        out = torch.full((n, width), 4.0, device="cuda")
        with pytest.raises(gl.GadgetIndexError, match=f"id {value} is (out of range|negative)"):
            g.getData(bad, out=out)
        # the next call's flag starts clear, and the table is untouched
        assert torch.equal(g.getData(cids).cpu(), base[ids])
    assert calls[-1] is True and all(calls)
    assert torch.equal(g.as_tensor().cpu(), base)
    # unchecked ids, CPU ids and too few ids take no flag
    calls.clear()
    g.getData(cids, check_ids=False)
    g.getData(ids)
    assert calls == [False, False]
    g.getData(cids[: n - 1])
    assert calls == [False, False]
    # a second thread has its own flag word
    import threading

    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(3):
                assert torch.equal(g.getData(cids).cpu(), base[ids])
                bad = cids.clone()
                bad[7] = rows + 3
                with pytest.raises(gl.GadgetIndexError):
                    g.getData(bad)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    g.close()
