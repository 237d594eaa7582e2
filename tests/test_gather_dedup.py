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

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader.transfer import _engine, _kernels

# --- on the CPU: the plumbing refuses what does not fit ------------------------------------


def test_no_slots_for_a_table_outside_the_gpu_or_a_small_request() -> None:
    assert _kernels.dedup_slots(torch.zeros(100, 4), 1 << 20) is None  # a CPU table
    assert _kernels.DEDUP_MIN_IDS > 1 and _kernels.DEDUP_MAX_ROWS == 1 << 24


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


# --- on the GPU ---------------------------------------------------------------------------


def _slot_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the number of ids of each slot fill (one per deduplicated gather)."""
    calls: list[int] = []
    real = _kernels.launch_gather_slots

    def spy(ids: torch.Tensor, slot: torch.Tensor) -> None:
        calls.append(ids.numel())
        real(ids, slot)

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
