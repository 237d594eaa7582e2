"""Interleaved tables: a table and its optimizer states with row ``i`` side by side in one
buffer (``stores.SlotStore``), moved as one wide row per id by the GPU kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader._errors import GadgetIndexError, GadgetValueError
from gadgetloader.stores import SlotStore, interleaved_stores
from gadgetloader.stores._base import gather_many, scatter_many
from gadgetloader.switching import OffloadedEmbedding, OffloadedOptimizer
from gadgetloader.transfer import _engine

HOST_PLACEMENTS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("pinned", id="pinned", marks=[pytest.mark.gpu, NEEDS_CUPY]),
]
GPU_STRATEGIES = ["kernel", "sorted", "hybrid", "torch"]


def _slots(
    placement: str, rows: int = 257, width: int = 6, nslots: int = 3
) -> tuple[list[gl.DataGadget], np.ndarray]:
    """``nslots`` interleaved gadgets filled with distinct values; the reference (rows, slots, width)."""
    dev = torch.device("cuda") if torch.cuda.is_available() else None
    stores = interleaved_stores(placement, rows, (width,), torch.float32, nslots, dev)
    ref = np.random.default_rng(1).standard_normal((rows, nslots, width)).astype(np.float32)
    gadgets = []
    for k, s in enumerate(stores):
        s.write_block(0, torch.from_numpy(ref[:, k].copy()))
        s.synchronize()
        gadgets.append(gl.DataGadget._of_store(s, device=dev))
    return gadgets, ref


@pytest.fixture(params=HOST_PLACEMENTS)
def host_placement(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_slots_are_strided_views_of_one_buffer(host_placement: str) -> None:
    gadgets, ref = _slots(host_placement)
    stores = [g.store for g in gadgets]
    assert all(isinstance(s, SlotStore) for s in stores)
    hv = [s.host_view() for s in stores]
    assert hv[0] is not None and hv[1] is not None
    assert hv[1].data_ptr() - hv[0].data_ptr() == 6 * 4  # one row of the slot apart
    assert hv[0].stride(0) == 3 * 6  # the pitch is the whole block
    for k, g in enumerate(gadgets):
        np.testing.assert_array_equal(g.numpy(), ref[:, k])


def test_gather_and_scatter_of_one_slot_match_numpy(host_placement: str) -> None:
    gadgets, ref = _slots(host_placement)
    ids = np.array([[3, 0, 256], [3, 9, 100]])
    got = gadgets[1].getData(ids)
    np.testing.assert_array_equal(got.cpu().numpy(), ref[:, 1][ids])
    rows = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) + 1000
    gadgets[1].insertData(rows, np.array([7, 250, 7, 0]))  # repeated id: the last one wins
    want = ref.copy()
    want[[7, 250, 7, 0], 1] = rows
    for k, g in enumerate(gadgets):  # the neighbouring slots are untouched
        np.testing.assert_array_equal(g.numpy(), want[:, k])


@pytest.mark.parametrize("group", [(0, 1, 2), (1, 2), (0, 2), (2, 0)])
def test_moving_several_slots_matches_numpy(host_placement: str, group: tuple[int, ...]) -> None:
    gadgets, ref = _slots(host_placement)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    stores = [gadgets[k].store for k in group]
    ids = torch.tensor([5, 0, 256, 5, 31], device=dev)
    out = gather_many(stores, ids.to(stores[0].ids_device(dev)), dev)
    for k, o in zip(group, out, strict=True):
        np.testing.assert_array_equal(o.cpu().numpy(), ref[:, k][ids.cpu().numpy()])
    new = [o + 100 * (i + 1) for i, o in enumerate(out)]
    scatter_many(stores, ids.to(stores[0].ids_device(dev)), new)
    want = ref.copy()
    for i, k in enumerate(group):
        # id 5 appears at positions 0 and 3 with equal rows, so either write gives the same
        want[ids.cpu().numpy(), k] = new[i].cpu().numpy()
    for k, g in enumerate(gadgets):
        np.testing.assert_array_equal(g.numpy(), want[:, k])


def test_bad_ids_leave_every_slot_unchanged(host_placement: str) -> None:
    gadgets, ref = _slots(host_placement)
    with pytest.raises(GadgetIndexError):
        gadgets[1].insertData(np.ones((2, 6), np.float32), np.array([3, 257]))
    with pytest.raises(GadgetIndexError):
        gadgets[0].getData(np.array([-1]))
    for k, g in enumerate(gadgets):
        np.testing.assert_array_equal(g.numpy(), ref[:, k])


def test_closing_every_slot_frees_the_buffer(host_placement: str) -> None:
    gadgets, _ = _slots(host_placement)
    group = gadgets[0].store._group
    assert group is not None
    gadgets[0].close()
    assert not group.parent.closed  # the other slots still use it
    gadgets[1].close()
    gadgets[2].close()
    assert group.parent.closed


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("strategy", GPU_STRATEGIES)
@pytest.mark.parametrize("group", [(0, 1, 2), (1, 2), (0,), (2, 1)])
def test_every_strategy_moves_slots_exactly(strategy: str, group: tuple[int, ...]) -> None:
    gadgets, ref = _slots("pinned", rows=1000, width=32, nslots=4)
    views = [gadgets[k].store.device_view() for k in group]
    hosts = [gadgets[k].store.host_view() for k in group]
    assert all(v is not None for v in views)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (3000,), generator=gen)
    out = _engine.gather_many(views, ids.cuda(), None, strategy, hosts)  # type: ignore[arg-type]
    for k, o in zip(group, out, strict=True):
        np.testing.assert_array_equal(o.cpu().numpy(), ref[:, k][ids.numpy()])
    rows = [torch.randn(3000, 32, device="cuda") for _ in group]
    _engine.scatter_many(views, ids.cuda(), rows, strategy, hosts)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    want = ref.copy()
    last = {int(r): j for j, r in enumerate(ids.tolist())}  # the last occurrence wins
    sel_ids = np.array(sorted(last))
    sel_pos = np.array([last[i] for i in sel_ids])
    for i, k in enumerate(group):
        want[sel_ids, k] = rows[i].cpu().numpy()[sel_pos]
    for k, g in enumerate(gadgets):
        np.testing.assert_array_equal(g.numpy(), want[:, k])


@pytest.mark.gpu
@NEEDS_CUPY
def test_kernel_never_touches_neighbouring_slots_for_bad_ids() -> None:
    from gadgetloader.transfer import _kernels

    gadgets, ref = _slots("pinned", rows=100, width=8, nslots=3)
    views = [g.store.device_view() for g in gadgets[1:]]
    ids = torch.tensor([4, 100, -1, 7], device="cuda")  # two bad ids slip past (no host check)
    outs = [torch.full((4, 8), 7.0, device="cuda") for _ in views]
    _kernels.launch_gather(views, ids, outs)  # type: ignore[arg-type]
    for o, k in zip(outs, (1, 2), strict=True):
        got = o.cpu().numpy()
        np.testing.assert_array_equal(got[[0, 3]], ref[[4, 7], k])
        assert (got[[1, 2]] == 0).all()  # a zero row, nothing read outside
    rows = [torch.full((4, 8), 5.0, device="cuda") for _ in views]
    _kernels.launch_scatter(views, ids, rows)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    want = ref.copy()
    want[[4, 7], 1:] = 5.0
    for k, g in enumerate(gadgets):
        np.testing.assert_array_equal(g.numpy(), want[:, k])


# ---- the optimizer moves a table in with its states -----------------------------------------
def test_offloaded_optimizer_interleaves_table_and_state(host_placement: str) -> None:
    torch.manual_seed(0)
    emb = OffloadedEmbedding(50, 4, placement=host_placement)
    before = emb.table.numpy().copy()
    opt = OffloadedOptimizer(torch.optim.Adam, [emb], lr=0.1)
    pager = opt.pagers[0]
    assert pager.interleaved
    assert isinstance(emb.table.store, SlotStore) and emb.table.store.slot == 0
    assert [t.store.slot for t in pager.tables.values()] == [1, 2]
    np.testing.assert_array_equal(emb.table.numpy(), before)  # moved, not changed
    dev = emb.compute_device
    ids = torch.tensor([3, 3, 8], device=dev)
    emb(ids).sum().backward()
    opt.step()
    # Adam's first step moves every touched row by lr against the gradient's sign
    after = emb.table.numpy()
    np.testing.assert_allclose(after[[3, 8]], before[[3, 8]] - 0.1, rtol=0, atol=1e-6)
    untouched = np.setdiff1d(np.arange(50), [3, 8])
    np.testing.assert_array_equal(after[untouched], before[untouched])
    exp_avg = pager.tables["exp_avg"].numpy()
    np.testing.assert_allclose(exp_avg[3], 0.2, atol=1e-6)  # two lookups: gradient 2
    np.testing.assert_allclose(exp_avg[8], 0.1, atol=1e-6)
    assert (exp_avg[untouched] == 0).all()


def test_no_interleaving_without_row_state_or_on_request(host_placement: str) -> None:
    emb = OffloadedEmbedding(20, 4, placement=host_placement)
    OffloadedOptimizer(torch.optim.SGD, [emb], lr=0.1)  # plain SGD keeps no row state
    assert not isinstance(emb.table.store, SlotStore)
    from gadgetloader.switching._optim import StatePager

    emb2 = OffloadedEmbedding(20, 4, placement=host_placement)
    opt = torch.optim.Adam([emb2._slot.param], lr=0.1)
    pager = StatePager(
        opt, emb2._slot.param, 20, placement=host_placement, table=emb2.table, interleave=False
    )
    assert not pager.interleaved and not isinstance(emb2.table.store, SlotStore)


def test_interleaved_table_saves_and_loads_in_place(host_placement: str, tmp_path) -> None:
    torch.manual_seed(0)
    emb = OffloadedEmbedding(30, 4, placement=host_placement)
    opt = OffloadedOptimizer(torch.optim.Adam, [emb], lr=0.1)
    saved = emb.table.numpy().copy()
    path = tmp_path / "t.npy"
    emb.table.save(path)
    np.testing.assert_array_equal(np.load(path), saved)
    emb.table.fill_(0.0)
    emb.table.load(path)
    assert isinstance(emb.table.store, SlotStore)  # still shares rows with its states
    np.testing.assert_array_equal(emb.table.numpy(), saved)
    np.testing.assert_array_equal(opt.pagers[0].tables["exp_avg"].numpy(), 0)
    np.save(tmp_path / "wrong.npy", np.zeros((31, 4), np.float32))
    with pytest.raises(GadgetValueError, match="30, 4"):
        emb.table.load(tmp_path / "wrong.npy")
    np.testing.assert_array_equal(emb.table.numpy(), saved)


def _switcher_run(placement: str, order: str, steps: int = 4) -> list[np.ndarray]:
    """Train one word2vec-like table with SpeedTorch's protocol; return table and states."""
    from gadgetloader.switching import ModelFactory, OptimizerFactory

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(1, 4)}).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sw = ModelFactory(model["u"], 40, 4, placement=placement, duplicates="merge")
    sw.uniformDistributionInit(-1.0, 1.0)
    osw = OptimizerFactory(opt, 40, 4, model, "u", placement=placement)
    osw.optInit()
    gen = torch.Generator().manual_seed(5)
    same = torch.randint(0, 40, (12,), generator=gen).to(dev)
    for _ in range(steps):
        # "optimizer-before": the optimizer switcher's before-call comes first and the same
        # id tensor returns every step (a cached plan must not revive stale state rows)
        ids = (
            same
            if order == "optimizer-before"
            else torch.randint(0, 40, (12,), generator=gen).to(dev)
        )
        if order == "optimizer-before":
            osw.beforeForwardPass(ids)
            local = sw.beforeForwardPass(ids)
        else:
            local = sw.beforeForwardPass(ids)
            osw.beforeForwardPass(ids)
        opt.zero_grad()
        (model["u"](local) ** 2).sum().backward()
        opt.step()
        if order == "model-first":
            sw.afterOptimizerStep(ids)
            osw.afterOptimizerStep(ids)
        else:
            osw.afterOptimizerStep(ids)
            sw.afterOptimizerStep(ids)
    out = [sw.table.numpy().copy(), *(t.numpy().copy() for t in osw.tables.values())]
    out.append(np.array([isinstance(sw.table.store, SlotStore)]))
    return out


def test_switchers_interleave_and_match_separate_tables(
    host_placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _switcher_run(host_placement, "model-first")
    b = _switcher_run(host_placement, "optimizer-first")
    assert a[-1][0] and b[-1][0]  # both interleaved
    from gadgetloader.switching import _optim

    monkeypatch.setattr(_optim, "interleave_ok", lambda *args, **kw: False)
    c = _switcher_run(host_placement, "model-first")
    assert not c[-1][0]
    for x, y, z in zip(a[:-1], b[:-1], c[:-1], strict=True):
        np.testing.assert_array_equal(x, z)
        np.testing.assert_array_equal(y, z)
    assert not np.array_equal(c[1], np.zeros_like(c[1]))  # the states were trained


@pytest.mark.parametrize("optimizer", ["Adam", "Adagrad", "RMSprop"])
def test_switchers_optimizer_switcher_first_with_the_same_ids_every_step(
    host_placement: str, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model switcher prefetches state rows; with the optimizer switcher's before-call
    first they are never taken, and must not be used a step later (they are stale)."""
    from gadgetloader.switching import _optim

    monkeypatch.setattr(torch.optim, "Adam", getattr(torch.optim, optimizer))
    a = _switcher_run(host_placement, "optimizer-before", steps=4)
    monkeypatch.setattr(_optim, "interleave_ok", lambda *args, **kw: False)
    c = _switcher_run(host_placement, "optimizer-before", steps=4)
    assert a[-1][0] and not c[-1][0]
    for x, z in zip(a[:-1], c[:-1], strict=True):
        np.testing.assert_array_equal(x, z)


def test_a_launch_never_mixes_row_pitches() -> None:
    """Tables fused into one launch share one row pitch: a slot of an interleaved table
    beside ordinary tables goes in a launch of its own (the kernel takes one pitch)."""
    from gadgetloader.transfer import _kernels

    wide = torch.zeros(10, 3, 4)
    a, b = torch.zeros(10, 4), torch.zeros(10, 4)
    assert _engine._groups([wide[:, 0], a, b]) == [slice(0, 1), slice(1, 3)]
    assert _engine._groups([a, b, wide[:, 1], wide[:, 2]]) == [slice(0, 2), slice(2, 4)]
    assert _engine._groups([wide[:, 0], wide[:, 1], wide[:, 2]]) == [slice(0, 3)]
    with pytest.raises(ValueError, match="not overlap"):
        _kernels.pitch_nbytes(torch.zeros(1, 8).expand(10, 8))  # rows alias each other


def test_interleaved_cpu_table_pickles_and_deep_copies_by_value() -> None:
    import copy
    import pickle

    torch.manual_seed(0)
    emb = OffloadedEmbedding(30, 4, placement="cpu", device="cpu")
    OffloadedOptimizer(torch.optim.Adam, [emb], lr=0.1)
    assert isinstance(emb.table.store, SlotStore)
    want = emb.table.numpy().copy()
    again = pickle.loads(pickle.dumps(emb.table))
    np.testing.assert_array_equal(again.numpy(), want)
    twin = copy.deepcopy(emb)
    np.testing.assert_array_equal(twin.table.numpy(), want)
    twin.table.fill_(0.0)  # a copy by value: the original keeps its rows
    np.testing.assert_array_equal(emb.table.numpy(), want)


def test_a_failed_load_leaves_an_interleaved_table_unchanged(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that fails part-way (a damaged chunk near its end) must not leave the
    table half-overwritten: the rows are staged first, as a fresh store would be."""
    import os

    from gadgetloader.io import _stream

    monkeypatch.setattr(_stream, "STAGING_BYTES", 8 << 10)  # many blocks: the last one fails
    torch.manual_seed(0)
    emb = OffloadedEmbedding(4096, 8, placement="cpu", device="cpu")
    OffloadedOptimizer(torch.optim.Adam, [emb], lr=0.1)
    src = np.random.default_rng(0).standard_normal((4096, 8)).astype(np.float32)
    path = tmp_path / "t.zarr"
    gl.DataGadget(src, placement="cpu").save(path, chunk_rows=256)
    chunks = sorted(
        (os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f != "zarr.json"),
        key=lambda f: [int(x) for x in os.path.relpath(f, path).split(os.sep) if x.isdigit()],
    )
    assert len(chunks) == 16
    with open(chunks[-1], "wb") as f:
        f.write(b"damaged")
    before = emb.table.numpy().copy()
    with pytest.raises(gl.GadgetError):
        emb.table.load(path)
    np.testing.assert_array_equal(emb.table.numpy(), before)
    assert isinstance(emb.table.store, SlotStore)
