"""Session 22: a GPU gather's range check no longer runs ahead of its kernel.

``getData`` on a table the row kernels gather from uploads CPU ids unchecked and checks
them on the CPU while the GPU gathers; CUDA ids' check is one ``aminmax`` writing into
page-locked memory. Whatever the order, a bad id must still raise the library's error
before any rows are returned, leave the table unchanged, and leave the next call right.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader import _ids
from gadgetloader._errors import GadgetIndexError

pytestmark = [pytest.mark.gpu, NEEDS_CUPY]

ROWS, W = 5000, 24


def _table(placement: str, strategy: str = "auto") -> tuple[gl.DataGadget, torch.Tensor]:
    src = torch.arange(ROWS * W, dtype=torch.float32).reshape(ROWS, W)
    return gl.DataGadget(src, placement=placement, device="cuda", strategy=strategy), src


def _forms(ids: list[int]) -> list[object]:
    t = torch.tensor(ids)
    return [t, t.numpy(), list(ids), t.to(torch.int32), t.cuda(), t.cuda().to(torch.int16)]


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
@pytest.mark.parametrize("bad", [-1, ROWS, ROWS + 123, -(2**40)])
@pytest.mark.parametrize("form", range(6))
@pytest.mark.parametrize("with_out", [False, True])
def test_bad_id_raises_before_rows_are_returned(
    placement: str, bad: int, form: int, with_out: bool
) -> None:
    g, src = _table(placement)
    before = g.getData(torch.arange(ROWS)).cpu()
    ids = [3, 4999, 0, bad, 17]
    if form in (3, 5) and not -(2**15) <= bad < 2**15:
        pytest.skip("an int32 or int16 tensor cannot hold this id")
    idx = _forms(ids)[form]
    out = torch.full((len(ids), W), -5.0, device="cuda") if with_out else None
    with pytest.raises(GadgetIndexError) as err:
        g.getData(idx, out=out)
    msg = str(err.value)
    assert str(bad) in msg and f"[0, {ROWS - 1}]" in msg
    assert torch.equal(g.getData(torch.arange(ROWS)).cpu(), before)  # table unchanged
    good = [1, 4998, 2, 2]
    assert torch.equal(g.getData(_forms(good)[form]).cpu(), src[good])  # next call right


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
@pytest.mark.parametrize("on_gpu", [False, True])
def test_large_request_bad_id_at_the_end(placement: str, on_gpu: bool) -> None:
    g, src = _table(placement)
    ids = torch.randint(0, ROWS, (131_072,))
    ids[-1] = ROWS
    idx = ids.cuda() if on_gpu else ids
    with pytest.raises(GadgetIndexError, match=f"id {ROWS} is out of range"):
        g.getData(idx)
    ids[-1] = 7
    got = g.getData(ids.cuda() if on_gpu else ids.numpy())
    assert torch.equal(got.cpu(), src[ids])


@pytest.mark.parametrize("strategy", ["torch", "hybrid", "sorted", "kernel"])
@pytest.mark.parametrize("on_gpu", [False, True])
def test_every_strategy_refuses_bad_ids(strategy: str, on_gpu: bool) -> None:
    # `torch` (index_select would assert on the device) and `hybrid` (CPU indexing) must
    # see checked ids before they run; the row kernels may run first
    g, src = _table("pinned", strategy)
    ids = torch.tensor([5, ROWS + 1, 2] * 700)
    with pytest.raises(GadgetIndexError):
        g.getData(ids.cuda() if on_gpu else ids)
    ids[1::3] = 9
    assert torch.equal(g.getData(ids.cuda() if on_gpu else ids).cpu(), src[ids])


def test_cuda_ids_made_on_a_side_stream() -> None:
    g, src = _table("pinned")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the ids are written well after the call is queued
        ids = torch.arange(ROWS - 1, -1, -1, device="cuda")[:4096]
        got = g.getData(ids)
        bad = ids.clone()
        bad[4095] = ROWS
        with pytest.raises(GadgetIndexError, match=f"id {ROWS} is out of range"):
            g.getData(bad)
    side.synchronize()
    assert torch.equal(got.cpu(), src.flip(0)[:4096])


def test_check_set_up_in_inference_mode_works_outside_it() -> None:
    # the thread's page-locked pair (and its CUDA alias) is made on its first check; made
    # under inference mode it must still take writes outside it
    g, src = _table("pinned")
    ids = torch.tensor([4, 1, 4999], device="cuda")
    errors: list[BaseException] = []
    seen: list[object] = []

    def run() -> None:
        try:
            with torch.inference_mode():
                a = g.getData(ids)
            b = g.getData(ids)
            with pytest.raises(GadgetIndexError):
                g.getData(torch.tensor([ROWS], device="cuda"))
            seen.append(_ids._this_pair().mapped.get(torch.cuda.current_device()))
            assert torch.equal(a.cpu(), src[[4, 1, 4999]])
            assert torch.equal(b.cpu(), src[[4, 1, 4999]])
        except BaseException as e:  # reported to the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    # with CuPy the check's numbers are written by the GPU straight into the pinned pair
    pair = seen[0]
    assert pair is not None
    assert all(x.is_cuda and x.dtype == torch.int64 for x in pair)  # type: ignore[union-attr]


def test_mapped_pair_holds_the_last_checks_ends() -> None:
    g, _ = _table("pinned")
    ids = torch.tensor([17, 3, 4321, 99], device="cuda")
    g.getData(ids)
    torch.cuda.synchronize()
    assert _ids._this_pair().buf.tolist() == [3, 4321]


def test_numpy_readonly_and_uint_ids_checked_after_the_gather() -> None:
    g, src = _table("pinned")
    ro = np.array([1, 2, ROWS], dtype=np.uint32)
    ro.setflags(write=False)
    with pytest.raises(GadgetIndexError):
        g.getData(ro)
    ok = np.array([1, 2, ROWS - 1], dtype=np.uint64)
    assert torch.equal(g.getData(ok).cpu(), src[[1, 2, ROWS - 1]])


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((3000, 128), torch.float32),
        ((3000, 3), torch.float16),
        ((3000, 2, 4), torch.float64),
        ((3000,), torch.int64),
        ((3000, 5), torch.bfloat16),
        ((3000, 0), torch.float32),
    ],
)
@pytest.mark.parametrize("n", [0, 1, 4096])
def test_one_launch_lane_matches_numpy(
    placement: str, shape: tuple[int, ...], dtype: torch.dtype, n: int
) -> None:
    # 1-D ids on a small table take one row-kernel launch without the engine's
    # bookkeeping: the rows, their shape and dtype must be what NumPy gives
    src = (torch.arange(int(np.prod(shape))) % 251).reshape(shape).to(dtype)
    g = gl.DataGadget(src, placement=placement, device="cuda")
    ids = torch.randint(0, shape[0], (n,))
    want = src[ids]
    strided = torch.stack([ids, ids], 1).cuda()[:, 0]  # CUDA ids with a stride of 2
    for idx in (ids, ids.numpy(), ids.cuda(), strided):
        got = g.getData(idx)
        assert got.is_cuda and got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want)
        out = torch.full(want.shape, 3, dtype=dtype, device="cuda")
        assert g.getData(idx, out=out) is out
        assert torch.equal(out.cpu(), want)


def test_lane_out_inside_the_table() -> None:
    # rows gathered into the table itself: read apart first, then written (as the engine)
    src = torch.arange(3000 * 8, dtype=torch.float32).reshape(3000, 8)
    g = gl.DataGadget(src, placement="pinned", device="cuda")
    view = g.as_tensor()
    ids = torch.arange(50, 150)  # overlaps the rows it is written to
    g.getData(ids, out=view[100:200])
    want = src.clone()
    want[100:200] = src[50:150]
    assert torch.equal(g.getData(torch.arange(3000)).cpu(), want)


# ---- the in-order scatter ---------------------------------------------------------------


def _kernel_names(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the row kernels launched from now on (a list that fills as they are)."""
    from gadgetloader.transfer import _kernels

    names: list[str] = []
    real = _kernels._function

    def recording(idx: int, unroll: int, name: str) -> object:
        names.append(name)
        return real(idx, unroll, name)

    monkeypatch.setattr(_kernels, "_function", recording)
    return names


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
@pytest.mark.parametrize(
    "width,dtype",
    [
        (8, torch.float32),  # 32 B rows: 2 lanes of 16 B
        (100, torch.uint8),  # 4-byte vectors, 25 lanes
        (3, torch.int16),  # 6 B rows: 2-byte vectors
        (512, torch.float32),  # 2 KB rows: each lane moves 4 vectors
        (1, torch.float64),  # one 8-byte vector a row
    ],
)
@pytest.mark.parametrize("rows_per_block", [None, 3, 32])
def test_in_order_scatter_writes_what_the_grid_writes(
    placement: str,
    width: int,
    dtype: torch.dtype,
    rows_per_block: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The in-order scatter (one warp per row, ``rows_per_block`` rows a block) writes what
    NumPy's sequential assignment writes: repeats (the last occurrence wins, through
    ``pos``), ids outside the table skipped (nothing written outside), a device-side count,
    several tables in one launch, and an interleaved group's wide rows."""
    from gadgetloader.transfer import _kernels

    rows = 3000
    src = (torch.rand(rows, width) * 100).to(dtype)
    g = gl.DataGadget(src, placement=placement)
    t = g.as_tensor()
    gen = torch.Generator().manual_seed(width)
    ids = torch.randint(0, rows, (777,), generator=gen)
    ids[5] = ids[700]  # a repeat: entry 700 wins
    ids[9], ids[10] = -1, rows  # outside the table: skipped
    new = (torch.rand(777, width, generator=gen) * 100 + 200).to(dtype)
    expect = src.clone()
    inside = (ids >= 0) & (ids < rows)
    np_expect = expect.numpy()
    np_expect[ids[inside].numpy()] = new[inside].numpy()  # sequential: the last one wins
    kw = {"blocks_per_sm": _kernels.IN_ORDER, "rows_per_block": rows_per_block}
    s, perm = torch.sort(ids.cuda(), stable=True)
    names = _kernel_names(monkeypatch)
    _kernels.launch_scatter(t, s, new.cuda(), perm, _kernels.SCATTER_LAST_OF_RUN, **kw)
    assert names and all(n.startswith("gl_scatter_rows_") for n in names)  # the in-order one
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.from_numpy(np_expect))
    # distinct ids, every entry written, a device-side count of 400: only those
    t.copy_(src.to(t.device))
    uid = torch.randperm(rows, generator=gen)[:777]
    count = torch.tensor([400], device="cuda")
    _kernels.launch_scatter(t, uid.cuda(), new.cuda(), count=count, **kw)
    want = src.clone()
    want[uid[:400]] = new[:400]
    assert torch.equal(t.cpu(), want)
    # two tables in one launch
    t.copy_(src.to(t.device))
    other = gl.DataGadget(src.flip(0).contiguous(), placement=placement)
    _kernels.launch_scatter(
        [t, other.as_tensor()],
        uid.cuda(),
        [new.cuda(), -new.cuda()] if dtype.is_signed else [new.cuda(), new.cuda()],
        **kw,
    )
    want = src.clone()
    want[uid] = new
    assert torch.equal(t.cpu(), want)
    want2 = src.flip(0).clone()
    want2[uid] = -new if dtype.is_signed else new
    assert torch.equal(other.as_tensor().cpu(), want2)
    # an interleaved group: three slots of one buffer written as one wide row
    wide = gl.DataGadget((rows, 3, width), dtype=src.dtype, placement=placement)
    w = wide.as_tensor()
    w.zero_()
    slots = [w[:, j] for j in range(3)]
    assert _kernels.segments_of(slots)
    parts = [(new + j).cuda() for j in range(3)]
    _kernels.launch_scatter(slots, s, parts, perm, _kernels.SCATTER_LAST_OF_RUN, **kw)
    for j in range(3):
        got = w[:, j].cpu()
        touched = torch.zeros(rows, dtype=torch.bool)
        touched[ids[inside]] = True
        assert torch.equal(got[touched], torch.from_numpy(np_expect)[touched] + j)
        assert not got[~touched].any()
    for x in (g, other, wide):
        x.close()


def test_in_order_scatter_through_insert_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned table whose sparse scatters of 512 B rows take the in-order launch (64 KB of
    table per id), through ``insertData`` of CUDA rows with repeated CPU and CUDA ids and a
    fused scatter of two tables: the in-order kernel runs, and the table ends as NumPy's
    sequential assignment leaves it."""
    from gadgetloader.transfer import _engine, _kernels

    rows, width = 1 << 18, 128  # 128 MiB of 512 B rows
    src = torch.randn(rows, width)
    g = gl.DataGadget(src, placement="pinned", strategy="sorted")
    ids = torch.randint(0, rows, (2048,))
    ids[7] = ids[2000]
    assert _kernels._ordered_launch(
        [g.as_tensor()], [torch.empty(2048, width, device="cuda")],
        _kernels.group_geometry([g.as_tensor()]), ids.numel(), scatter=True,
    ) == (_kernels.IN_ORDER, 16)  # fmt: skip
    new = torch.randn(2048, width)
    expect = src.numpy().copy()
    expect[ids.numpy()] = new.numpy()
    names = _kernel_names(monkeypatch)
    g.insertData(new.cuda(), ids)
    assert any(n.startswith("gl_scatter_rows_") for n in names)
    assert np.array_equal(g.getData(torch.arange(rows)).cpu().numpy(), expect)
    new2 = torch.randn(2048, width)
    expect[ids.numpy()] = new2.numpy()
    g.insertData(new2.cuda(), ids.cuda())
    assert np.array_equal(g.getData(torch.arange(rows)).cpu().numpy(), expect)
    other = gl.DataGadget(-src, placement="pinned")
    u = torch.unique(ids).cuda()
    rows_u = torch.randn(u.numel(), width, device="cuda")
    _engine.scatter_many(
        [g.as_tensor(), other.as_tensor()], u, [rows_u, -rows_u], strategy="sorted"
    )
    assert torch.equal(g.getData(u).cpu(), rows_u.cpu())
    assert torch.equal(other.getData(u).cpu(), -rows_u.cpu())
    g.close()
    other.close()


@pytest.mark.parametrize("on_gpu", [False, True])
def test_out_inside_the_table_with_a_bad_id_leaves_the_table_unchanged(on_gpu: bool) -> None:
    # an `out` that is part of the table is written by the gather itself, so its ids are
    # checked before it (the table must stay unchanged when an id is refused)
    src = torch.arange(3000 * 8, dtype=torch.float32).reshape(3000, 8)
    g = gl.DataGadget(src, placement="pinned", device="cuda")
    ids = torch.arange(50, 150)
    ids[-1] = 3000
    with pytest.raises(GadgetIndexError, match="id 3000 is out of range"):
        g.getData(ids.cuda() if on_gpu else ids, out=g.as_tensor()[100:200])
    assert torch.equal(g.getData(torch.arange(3000)).cpu(), src)


def test_unchecked_cupy_ids_are_not_checked() -> None:
    # check_ids=False skips the check of CUDA ids, CuPy's as torch's: an id outside the
    # table yields a zero row (nothing outside the table is read)
    cp = pytest.importorskip("cupy")
    g, src = _table("pinned")
    got = g.getData(cp.asarray([1, ROWS, 2]), check_ids=False)
    assert torch.equal(got[0].cpu(), src[1]) and torch.equal(got[2].cpu(), src[2])
    assert not got[1].any()
    with pytest.raises(GadgetIndexError):
        g.getData(cp.asarray([1, ROWS]))
