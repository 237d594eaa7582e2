"""Several tables moved at once (a table and its optimizer states): ``gather_many`` /
``scatter_many`` on every placement, and the one-read unique plan of the switchers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader._errors import GadgetIndexError, GadgetTypeError, GadgetValueError
from gadgetloader.switching._rows import plan_rows
from gadgetloader.transfer import STRATEGIES, _engine


def _tables(placement: str, rows: int = 300) -> tuple[list[gl.DataGadget], list[np.ndarray]]:
    """Four tables with the same row size in bytes (16) and different dtypes, and a fifth
    with another row size (so the fused path must split the group)."""
    gen = np.random.default_rng(0)
    arrays = [
        gen.standard_normal((rows, 4)).astype(np.float32),
        gen.integers(-9, 9, (rows, 4)).astype(np.int32),
        gen.standard_normal((rows, 8)).astype(np.float16),
        gen.standard_normal((rows, 2)).astype(np.float64),
        gen.integers(0, 255, (rows, 3)).astype(np.uint8),
    ]
    return [gl.DataGadget(a, placement=placement) for a in arrays], arrays


def test_gather_many_equals_numpy(placement: str, device: torch.device) -> None:
    gadgets, arrays = _tables(placement)
    ids = np.array([[5, 0, 299], [5, 17, 17]])
    got = gl.gather_many(gadgets, ids)
    assert len(got) == len(arrays)
    for g, a in zip(got, arrays, strict=True):
        assert g.device.type == device.type
        assert tuple(g.shape) == (2, 3, a.shape[1])
        np.testing.assert_array_equal(g.cpu().numpy(), a[ids])


def test_scatter_many_last_occurrence_wins_in_every_table(
    placement: str, device: torch.device
) -> None:
    gadgets, arrays = _tables(placement)
    ids = torch.tensor([7, 3, 7, 299, 3, 0])
    gen = np.random.default_rng(1)
    new = [gen.standard_normal((6, a.shape[1])).astype(a.dtype) for a in arrays]
    gl.scatter_many(gadgets, [torch.from_numpy(n).to(device) for n in new], ids.to(device))
    for g, a, n in zip(gadgets, arrays, new, strict=True):
        ref = a.copy()
        for i, r in enumerate(ids.tolist()):
            ref[r] = n[i]  # sequential assignment: the last occurrence wins
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_bad_input_to_many_changes_no_table(placement: str, device: torch.device) -> None:
    gadgets, arrays = _tables(placement)
    rows = [
        torch.zeros((2, a.shape[1]), dtype=g.dtype, device=device)
        for g, a in zip(gadgets, arrays, strict=True)
    ]
    with pytest.raises(GadgetIndexError, match="300 rows"):
        gl.scatter_many(gadgets, rows, torch.tensor([1, 300], device=device))
    bad = list(rows)
    bad[3] = torch.zeros((2, 5), dtype=torch.float64, device=device)  # wrong row shape
    with pytest.raises(GadgetValueError, match="table 3 of 5: .*shape"):
        gl.scatter_many(gadgets, bad, [1, 2])
    with pytest.raises(GadgetValueError, match="5 tables but 4"):
        gl.scatter_many(gadgets, rows[:4], [1, 2])
    for g, a in zip(gadgets, arrays, strict=True):
        np.testing.assert_array_equal(g.getNumpyVersion(), a)
    other = gl.DataGadget((10, 4), placement=placement)
    with pytest.raises(GadgetValueError, match="same number of rows"):
        gl.gather_many([gadgets[0], other], [1])
    with pytest.raises(GadgetTypeError, match="DataGadget"):
        gl.gather_many([], [1])
    with pytest.raises(GadgetIndexError):
        gl.gather_many(gadgets, [-1])


def test_merge_plan_checks_the_range_and_is_distinct() -> None:
    with pytest.raises(GadgetIndexError, match="out of range"):
        plan_rows((torch.tensor([3, 1, 10]),), "merge", 10)
    with pytest.raises(GadgetIndexError, match="negative"):
        plan_rows((torch.tensor([3, -1]),), "merge", 10)
    plan = plan_rows((torch.tensor([4, 2, 4]),), "merge", 10)
    assert plan.distinct and plan.ids.tolist() == [2, 4] and plan.local.tolist() == [1, 0, 1]
    assert not plan_rows((torch.tensor([4, 2, 4]),), "separate", 10).distinct


# ---- GPU: the fused launches themselves -------------------------------------------------
@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fused_engine_every_strategy(strategy: str) -> None:
    rows = 20_000
    tabs = [torch.randn(rows, 32) for _ in range(5)]  # five: two fused launches
    gadgets = [gl.DataGadget(t, placement="pinned") for t in tabs]
    views = [g.as_tensor() for g in gadgets]
    hosts = [g.store.host_view() for g in gadgets]
    ids = torch.randint(0, rows, (3000,), device="cuda")
    got = _engine.gather_many(views, ids, strategy=strategy, hosts=hosts)
    for g, t in zip(got, tabs, strict=True):
        assert torch.equal(g.cpu(), t[ids.cpu()])
    new = [torch.randn(3000, 32, device="cuda") for _ in tabs]
    _engine.scatter_many(views, ids, new, strategy=strategy, hosts=hosts)
    torch.cuda.synchronize()
    order = ids.cpu().tolist()
    for g, t, n in zip(gadgets, tabs, new, strict=True):
        ref = t.clone()
        for i, r in enumerate(order):
            ref[r] = n[i].cpu()
        assert torch.equal(torch.from_numpy(g.getNumpyVersion()), ref)


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement_", ["pinned", "cuda"])
def test_unique_scatter_writes_distinct_ids_in_order(placement_: str) -> None:
    src = torch.randn(1000, 16)
    g = gl.DataGadget(src, placement=placement_)
    ids = torch.randperm(1000, device="cuda")[:400].sort().values
    new = torch.randn(400, 16, device="cuda")
    g.store.scatter(ids, new, unique=True)
    ref = src.clone()
    ref[ids.cpu()] = new.cpu()
    assert torch.equal(torch.from_numpy(g.getNumpyVersion()), ref)


@pytest.mark.gpu
@NEEDS_CUPY
def test_merge_plan_on_gpu_checks_within_one_synchronisation() -> None:
    ids = torch.randint(0, 5000, (30_000,), device="cuda")
    plan = plan_rows((ids,), "merge", 5000)
    ref_u, ref_inv = torch.unique(ids, sorted=True, return_inverse=True)
    assert plan.distinct and torch.equal(plan.ids, ref_u) and torch.equal(plan.local, ref_inv)
    with pytest.raises(GadgetIndexError, match="out of range"):
        plan_rows((torch.tensor([0, 5000], device="cuda"),), "merge", 5000)
    with pytest.raises(GadgetIndexError, match="negative"):
        plan_rows((torch.tensor([-3, 2], device="cuda"),), "merge", 5000)
