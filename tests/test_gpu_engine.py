"""GPU-only behaviour of the pinned placement and the transfer engine."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader.transfer import STRATEGIES, _kernels

pytestmark = [pytest.mark.gpu, NEEDS_CUPY]


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_pinned_store_costs_its_own_size_in_host_ram() -> None:
    # the CUDA context and CuPy's first use add to the process's RSS on their own: start
    # them first (this test may run first in its process)
    gl.DataGadget((16, 64), dtype="float32", placement="pinned").close()
    gc.collect()
    before = _rss()
    g = gl.DataGadget((1 << 20, 64), dtype="float32", placement="pinned")  # 256 MiB
    after = _rss()
    assert g.placement == "pinned"
    assert g.store.host_bytes <= 1.02 * g.nbytes
    grown = after - before
    assert 0.9 * g.nbytes <= grown <= 1.02 * g.nbytes + (16 << 20), grown / g.nbytes
    g.close()
    gc.collect()
    assert _rss() < after - 0.8 * g.nbytes  # freed deterministically on close


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES])
@pytest.mark.parametrize(
    "width,dtype",
    [
        (128, torch.float32),
        (3, torch.float16),
        (8, torch.float64),
        (5, torch.uint8),
        (17, torch.bfloat16),
    ],
)
def test_every_strategy_gives_identical_results(
    strategy: str, width: int, dtype: torch.dtype
) -> None:
    rows = 5000
    src = torch.randn(rows, width).to(dtype)
    ids = torch.randint(0, rows, (4096,), device="cuda")
    new = torch.randn(4096, width).to(dtype).cuda()
    for placement in ("pinned", "cuda"):
        g = gl.DataGadget(src, placement=placement, strategy=strategy)
        assert torch.equal(g.getData(ids).cpu(), src[ids.cpu()])
        g.insertData(new, ids)
        ref = src.clone()
        for i, r in enumerate(ids.cpu().tolist()):
            ref[r] = new[i].cpu()
        assert torch.equal(g.getData(torch.arange(rows)).cpu(), ref)


def test_kernel_never_touches_rows_outside_the_table() -> None:
    g = gl.DataGadget(torch.arange(40, dtype=torch.float32).reshape(10, 4), placement="pinned")
    view = g.as_tensor()
    ids = torch.tensor([1, 10, -1, 1 << 40, 3], device="cuda")  # bypasses the host-side check
    out = torch.full((5, 4), -7.0, device="cuda")
    _kernels.launch_gather(view, ids, out)
    torch.cuda.synchronize()
    got = out.cpu()
    assert torch.equal(got[0], torch.arange(4, 8.0)) and torch.equal(got[4], torch.arange(12, 16.0))
    assert got[1:4].eq(0).all()  # out-of-range ids give zero rows: nothing outside was read
    before = g.getNumpyVersion()
    _kernels.launch_scatter(view, ids, torch.zeros(5, 4, device="cuda"))
    torch.cuda.synchronize()
    after = g.getNumpyVersion()
    changed = np.nonzero((before != after).any(axis=1))[0].tolist()
    assert changed == [1, 3]


def test_work_is_ordered_on_the_current_stream() -> None:
    g = gl.DataGadget((100_000, 64), dtype="float32", placement="pinned")
    s = torch.cuda.Stream()
    ids = torch.randint(0, 100_000, (65_536,), device="cuda")
    with torch.cuda.stream(s):
        vals = torch.randn(65_536, 64, device="cuda")
        g.insertData(vals, ids)
        out = g.getData(ids)
    s.synchronize()
    # every id's last occurrence wins; gathering the same ids back must agree with the table
    table = g.getNumpyVersion()
    np.testing.assert_array_equal(out.cpu().numpy(), table[ids.cpu().numpy()])


def test_exit_without_close_is_silent() -> None:
    code = (
        "import gadgetloader as gl, torch\n"
        "g = gl.DataGadget((1000, 8), placement='pinned')\n"
        "h = gl.DataGadget((1000, 8), placement='pinned')\n"
        "v = g.as_tensor()\n"
        "g.insertData(torch.ones(2, 8, device='cuda'), [0, 1])\n"
        "print(float(g.getData([0]).sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8.0"
    assert "Error" not in out.stderr and "Exception" not in out.stderr


def test_view_outlives_close_safely() -> None:
    g = gl.DataGadget(torch.ones(100, 4), placement="pinned")
    view = g.as_tensor()
    g.close()
    assert float(view.sum()) == 400.0  # memory stays registered while a view exists
    del view
    gc.collect()


def test_getdata_accepts_cupy_ids_and_insert_cupy_data() -> None:
    import cupy

    src = torch.randn(50, 6)
    g = gl.DataGadget(src, placement="pinned")
    ids = cupy.asarray([3, 1, 3])
    assert torch.equal(g.getData(ids).cpu(), src[[3, 1, 3]])
    g.insertData(cupy.zeros((2, 6), dtype=cupy.float32), cupy.asarray([0, 49]))
    assert float(g.getData([0, 49]).abs().sum()) == 0.0


def test_wrong_cuda_device_data_is_refused_when_several_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    g = gl.DataGadget((10, 2), placement="pinned")
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.ones(1, 2, device="cuda:1"), [0])


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("strategy", ["kernel", "sorted", "torch"])
def test_strided_cuda_ids_gather_and_scatter_the_right_rows(strategy: str) -> None:
    """A strided view of CUDA ids (every other id) must move the rows it names: the
    kernels read ids densely, so the engine makes them contiguous first."""
    src = np.random.default_rng(2).standard_normal((500, 16)).astype(np.float32)
    g = gl.DataGadget(src, placement="pinned", strategy=strategy)
    ids = torch.randperm(500, device="cuda")[:200]
    strided = ids[::2]
    assert not strided.is_contiguous()
    np.testing.assert_array_equal(g.getData(strided).cpu().numpy(), src[strided.cpu().numpy()])
    rows = torch.full((100, 16), 3.0, device="cuda")
    g.insertData(rows, strided)
    want = src.copy()
    want[strided.cpu().numpy()] = 3.0
    np.testing.assert_array_equal(g.numpy(), want)


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("strategy", ["auto", "kernel", "sorted", "torch", "hybrid"])
def test_bad_cuda_ids_raise_the_library_error_for_every_strategy(strategy: str) -> None:
    """getData checks CUDA ids alongside the gather only where the gather is the bounds-
    checking row kernel; index_select (torch) and CPU indexing (hybrid) get checked ids."""
    src = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    g = gl.DataGadget(src, placement="pinned", strategy=strategy)
    for bad in ([3, 64], [-1, 2]):
        with pytest.raises(gl.GadgetIndexError):
            g.getData(torch.tensor(bad, device="cuda"))
    np.testing.assert_array_equal(
        g.getData(torch.tensor([5, 63], device="cuda")).cpu().numpy(), src[[5, 63]]
    )
    np.testing.assert_array_equal(g.numpy(), src)


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_fresh_thread_launches_without_any_cuda_call_of_its_own() -> None:
    """cuLaunchKernel needs a current context; a new thread whose only CUDA work is our
    launch (ids and output made elsewhere, no check) must still get its rows."""
    import threading

    src = np.random.default_rng(4).standard_normal((300, 32)).astype(np.float32)
    g = gl.DataGadget(src, placement="pinned", strategy="kernel")
    ids = torch.tensor([7, 0, 299, 7], device="cuda")
    out = torch.empty(4, 32, device="cuda")
    torch.cuda.synchronize()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            g.getData(ids, check_ids=False, out=out)
            torch.cuda.synchronize()
        except BaseException as exc:  # reported below
            errors.append(exc)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errors, errors
    np.testing.assert_array_equal(out.cpu().numpy(), src[[7, 0, 299, 7]])


@pytest.mark.parametrize(
    "width,dtype",
    [
        (128, torch.float32),
        (256, torch.float16),
        (256, torch.float32),
        (1024, torch.uint8),
        (129, torch.float32),  # 516 B rows: 4-byte vectors at most
        (384, torch.float32),
        (8, torch.float32),  # 32 B rows
        (32, torch.float16),  # 64 B rows
        (33, torch.float32),  # 132 B rows
        (100, torch.uint8),  # 100 B rows: 4-byte vectors
        (33, torch.uint8),  # 33 B rows: 1-byte vectors only, so the default grid
        (33, torch.float16),  # 66 B rows: 2-byte vectors only, so the default grid
    ],
)
@pytest.mark.parametrize("n_ids", [4, 300, 3000])
def test_sparse_ordered_launches_move_the_same_rows(
    width: int, dtype: torch.dtype, n_ids: int
) -> None:
    """Ascending ids through a 64 MiB table (22 KB to 16 MB of table per id: the sparse launch
    shape of ``ordered_shape``); rows, repeats and counts must come out as with the default
    grid."""
    row_bytes = width * torch.empty((), dtype=dtype).element_size()
    rows = (64 << 20) // row_bytes
    src = (torch.rand(rows, width) * 100).to(dtype)
    g = gl.DataGadget(src, placement="pinned", strategy="sorted")
    table = g.as_tensor()
    # a sparse shape: in-order blocks for narrow rows at 22 KB per id, one block per SM else
    assert _kernels.ordered_shape(row_bytes, rows * row_bytes, n_ids)[0] in (1, _kernels.IN_ORDER)
    ids = torch.randint(0, rows, (n_ids,), device="cuda")
    ids[-1] = ids[0]  # a repeat
    s, perm = torch.sort(ids, stable=True)
    out = torch.zeros(n_ids, width, dtype=dtype, device="cuda")
    _kernels.launch_gather(table, s, out, perm, ordered=True)
    assert torch.equal(out.cpu(), src[ids.cpu()])
    # a plan's distinct ascending ids with a device-side count: rows past it are zeros
    u = torch.unique(ids)
    count = torch.tensor([max(1, u.numel() - 1)], device="cuda")
    got = torch.full((u.numel(), width), 7, dtype=dtype, device="cuda")
    _kernels.launch_gather(table, u, got, count=count, ordered=True)
    k = int(count)
    assert torch.equal(got[:k].cpu(), src[u[:k].cpu()])
    assert not got[k:].any()
    # scatter of sorted ids, last occurrence wins
    new = (torch.rand(n_ids, width) * 100).to(dtype)
    _kernels.launch_scatter(table, s, new.cuda(), perm, _kernels.SCATTER_LAST_OF_RUN, ordered=True)
    torch.cuda.synchronize()

    def last_wins(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # each id's last occurrence (torch's own index_put leaves repeats unordered)
        last = {i: j for j, i in enumerate(ids.tolist())}
        out = table.clone()
        out[list(last)] = rows[list(last.values())]
        return out

    expect = last_wins(src, new)
    assert torch.equal(g.as_tensor().cpu(), expect)
    # and through the engine's sorted strategy
    assert torch.equal(g.getData(ids).cpu(), expect[ids.cpu()])
    more = (torch.rand(n_ids, width) * 100).to(dtype)
    g.insertData(more.cuda(), ids)
    expect = last_wins(expect, more)
    assert torch.equal(g.as_tensor().cpu(), expect)
    g.close()


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
def test_in_order_launch_moves_the_same_rows(
    placement: str, width: int, dtype: torch.dtype, rows_per_block: int | None
) -> None:
    """The in-order gather (one warp per row, a block per ``rows_per_block`` rows) moves
    rows exactly as the default grid does: repeats, ``pos``, ids outside the table (zero
    rows, nothing read outside), a device-side count (rows past it zeros), several tables
    in one launch, and an interleaved group's wide rows."""
    rows = 5000
    src = (torch.rand(rows, width) * 100).to(dtype)
    g = gl.DataGadget(src, placement=placement)
    t = g.as_tensor()
    gen = torch.Generator().manual_seed(width)
    ids = torch.randint(0, rows, (777,), generator=gen)
    ids[5] = ids[700]  # a repeat
    ids[9], ids[10] = -1, rows  # outside the table: zero rows
    expect = src[ids.clamp(0, rows - 1)].clone()
    expect[9:11] = 0
    s, perm = torch.sort(ids.cuda(), stable=True)
    kw = {"blocks_per_sm": _kernels.IN_ORDER, "rows_per_block": rows_per_block}
    out = torch.full((777, width), 3, dtype=dtype, device="cuda")
    _kernels.launch_gather(t, s, out, perm, **kw)
    assert torch.equal(out.cpu(), expect)
    # unsorted ids, no pos; a device-side count of 400: rows past it are zeros
    out.fill_(3)
    _kernels.launch_gather(t, ids.cuda(), out, count=torch.tensor([400], device="cuda"), **kw)
    assert torch.equal(out[:400].cpu(), expect[:400])
    assert not out[400:].any()
    # two tables in one launch
    other = gl.DataGadget(src.flip(0).contiguous(), placement=placement)
    outs = [torch.empty(777, width, dtype=dtype, device="cuda") for _ in range(2)]
    _kernels.launch_gather([t, other.as_tensor()], ids.cuda(), outs, **kw)
    assert torch.equal(outs[0].cpu(), expect)
    flipped = src.flip(0)[ids.clamp(0, rows - 1)]
    flipped[9:11] = 0
    assert torch.equal(outs[1].cpu(), flipped)
    # an interleaved group: three slots of one buffer move as one wide row
    wide = gl.DataGadget((rows, 3, width), dtype=src.dtype, placement=placement)
    w = wide.as_tensor()
    w.copy_(torch.stack([src, src + 1, src + 2], 1).to(w.device))
    slots = [w[:, j] for j in range(3)]
    assert _kernels.segments_of(slots)
    outs = [torch.empty(777, width, dtype=dtype, device="cuda") for _ in range(3)]
    _kernels.launch_gather(slots, s, outs, perm, **kw)
    for j in range(3):
        want = (src + j)[ids.clamp(0, rows - 1)]
        want[9:11] = 0
        assert torch.equal(outs[j].cpu(), want)
    for x in (g, other, wide):
        x.close()


def test_in_order_launch_through_the_sorted_strategy() -> None:
    """A pinned table whose sparse requests of narrow rows take the in-order launch (64 KB of
    table per id), through the engine's ``sorted`` strategy, a fused gather of two tables
    and a plan's ascending ids with a device-side count."""
    rows, width = 1 << 20, 32  # 128 MiB of 128 B rows
    src = torch.randn(rows, width)
    g = gl.DataGadget(src, placement="pinned", strategy="sorted")
    ids = torch.randint(0, rows, (2048,))
    assert _kernels._ordered_launch(
        [g.as_tensor()], [torch.empty(2048, width, device="cuda")],
        _kernels.group_geometry([g.as_tensor()]), ids.numel(),
    ) == (_kernels.IN_ORDER, 16)  # fmt: skip
    assert torch.equal(g.getData(ids.cuda()).cpu(), src[ids])
    assert torch.equal(g.getData(ids).cpu(), src[ids])
    from gadgetloader.transfer import _engine

    other = gl.DataGadget(-src, placement="pinned")
    got = _engine.gather_many([g.as_tensor(), other.as_tensor()], ids.cuda(), strategy="sorted")
    assert torch.equal(got[0].cpu(), src[ids]) and torch.equal(got[1].cpu(), -src[ids])
    u = torch.unique(ids).cuda()
    count = torch.tensor([u.numel() - 5], device="cuda")
    got = _engine.gather_many(
        [g.as_tensor(), other.as_tensor()], u, strategy="sorted", ids_sorted=True, count=count
    )
    k = u.numel() - 5
    assert torch.equal(got[1][:k].cpu(), -src[u[:k].cpu()])
    assert not got[0][k:].any() and not got[1][k:].any()
    g.close()
    other.close()


def test_only_host_tables_get_the_sparse_shape() -> None:
    """A table in GPU memory keeps the default grid whatever the ids: the sparse shape helps
    only host memory, whose pages the GPU must translate."""
    host = gl.DataGadget((1 << 16, 128), dtype="float32", placement="pinned")
    dev = torch.zeros(1 << 16, 128, device="cuda")
    assert _kernels.in_host_memory(host.as_tensor())
    assert not _kernels.in_host_memory(dev)
    geom = _kernels.group_geometry([dev])
    out = torch.empty(4, 128, device="cuda")
    assert _kernels._ordered_launch([dev], [out], geom, 16) == (None, 16)
    assert _kernels._ordered_launch([host.as_tensor()], [out], geom, 16) == (1, 8)
    dev.copy_(torch.randn(1 << 16, 128))
    ids = torch.tensor([3, 900, 40_000, 65_000], device="cuda")
    _kernels.launch_gather(dev, ids, out, ordered=True)
    assert torch.equal(out, dev[ids])
    host.close()


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
@pytest.mark.parametrize("width", [16, 64, 128])
def test_ordered_launches_of_clustered_ids_move_the_same_rows(placement: str, width: int) -> None:
    """Ids packed in a corner of a table that is large for their number (the table's bytes
    per id say sparse, the ids are dense), and a dense head with a sparse tail: through the
    sorted strategy's gathers and scatters, the rows come out right."""
    rows = (64 << 20) // (width * 4)
    src = torch.randn(rows, width)
    g = gl.DataGadget(src, placement=placement, strategy="sorted")
    gen = torch.Generator().manual_seed(5)
    for ids in (
        torch.randint(0, 2000, (3000,), generator=gen),  # clustered, with repeats
        torch.cat(
            [
                torch.randint(0, 500, (2000,), generator=gen),
                torch.randint(0, rows, (1000,), generator=gen),
            ]
        ),
    ):
        assert (rows * width * 4) // ids.numel() > _kernels.SPARSE_GAP_BYTES
        assert torch.equal(g.getData(ids.cuda()).cpu(), src[ids])
        u = torch.unique(ids)
        new = torch.randn(u.numel(), width)
        g.insertData(new.cuda(), u.cuda())
        src[u] = new
        assert torch.equal(g.as_tensor().cpu(), src)
    g.close()


@pytest.mark.parametrize("width", [128, 4])
def test_ordered_launch_of_an_interleaved_group_moves_whole_rows(width: int) -> None:
    """Slots of one interleaved buffer move as one wide row; the sparse shape is sized by it
    (3 x 512 B, and 3 x 16 B: a 48 B wide row, which takes the narrow-row shape)."""
    rows = 40_000 if width == 128 else 1_000_000  # 61 MB, 48 MB
    buf = torch.randn(rows, 3, width).pin_memory()
    gpu_view = buf.cuda()  # reference copy
    host = gl.DataGadget(buf.numpy(), placement="pinned")
    t = host.as_tensor()
    tables = [t[:, k] for k in range(3)]
    assert _kernels.segments_of(tables)
    ids = torch.unique(torch.randint(0, rows, (200,), device="cuda"))
    outs = [torch.empty(ids.numel(), width, device="cuda") for _ in range(3)]
    geom = _kernels.group_geometry(tables)
    assert _kernels._ordered_launch(tables, outs, geom, ids.numel()) == (
        1,
        8 if width == 128 else 4,
    )
    _kernels.launch_gather(tables, ids, outs, ordered=True)
    for k in range(3):
        assert torch.equal(outs[k], gpu_view[ids, k])
    news = [torch.randn(ids.numel(), width, device="cuda") for _ in range(3)]
    _kernels.launch_scatter(tables, ids, news, ordered=True)
    torch.cuda.synchronize()
    for k in range(3):
        assert torch.equal(t[:, k][ids].cuda(), news[k])
    host.close()
