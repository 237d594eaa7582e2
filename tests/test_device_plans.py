"""Row plans sized on the GPU (no synchronisation per lookup) and what uses them.

CPU tests force the device-plan path (``_plans_on_device``) so that the count-aware
store paths, the optimizer step and the merge of several lookups run in CI; the GPU
tests check the kernels (count, segment sum) bit for bit and that a drop-in training
step with CUDA ids runs no synchronising call.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from conftest import NEEDS_CUPY

import gadgetloader as gl
import gadgetloader.switching._embedding as emb_mod
from gadgetloader.stores._base import gather_many, scatter_many
from gadgetloader.switching._rows import exact_plan, plan_rows, plan_rows_async

N, D = 40, 6


def _ids(seed: int, shape: tuple[int, ...], high: int = 25) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1,), (2,), (7, 3), (200,), (5000,)])
def test_async_plan_equals_unique_plan(shape):
    ids = _ids(sum(shape), shape, high=3000 if shape == (5000,) else 25)
    want = plan_rows((ids,), "merge", N if max(shape) < 1000 else 3000)
    got = plan_rows_async((ids,), 3000)
    k = int(got.n_distinct)
    assert k == want.num_rows and got.num_rows == ids.numel()
    assert torch.equal(got.ids[:k], want.ids)
    assert torch.equal(got.local, want.local)
    assert bool((got.ids[k:] == want.ids[-1]).all())  # padding repeats the largest id
    assert torch.equal(got.ids[got.order_local], ids.reshape(-1)[got.order])
    assert torch.equal(exact_plan(got).ids, want.ids)


def test_async_plan_of_equal_ids_and_two_parts():
    same = torch.full((9,), 4)
    p = plan_rows_async((same,), N)
    assert int(p.n_distinct) == 1 and bool((p.local == 0).all()) and bool((p.ids == 4).all())
    a, b = _ids(1, (3,)), _ids(2, (2, 4))
    p2, want = plan_rows_async((a, b), N), plan_rows((a, b), "merge", N)
    assert torch.equal(p2.local, want.local) and int(p2.n_distinct) == want.num_rows


@pytest.fixture
def device_plans(monkeypatch):
    """Lookups build device-style plans even on the CPU."""
    monkeypatch.setattr(emb_mod, "_plans_on_device", lambda ids: True)


def test_count_limits_gather_and_scatter_of_host_stores():
    tables = [gl.DataGadget((N, D), dtype="float32", placement="cpu") for _ in range(2)]
    for k, t in enumerate(tables):
        t.init_(lambda x, k=k: x.copy_(torch.arange(N * D, dtype=torch.float32).view(N, D) + k))
    stores = [t.store for t in tables]
    ids = torch.tensor([3, 5, 9, 9, 9])
    count = torch.tensor([3])
    rows = gather_many(stores, ids, torch.device("cpu"), count=count)
    for k, r in enumerate(rows):
        want = torch.arange(N * D, dtype=torch.float32).view(N, D)[[3, 5, 9]] + k
        assert torch.equal(r[:3], want) and bool((r[3:] == 0).all())
    before = [torch.from_numpy(t.getNumpyVersion()).clone() for t in tables]
    new = [torch.full((5, D), -1.0), torch.full((5, D), -2.0)]
    new[0][3:] = 99.0  # rows past the count must not be written
    scatter_many(stores, ids, new, unique=True, count=torch.tensor([2]))
    for k, t in enumerate(tables):
        after = torch.from_numpy(t.getNumpyVersion())
        expect = before[k].clone()
        expect[[3, 5]] = -1.0 - k
        assert torch.equal(after, expect)


@pytest.mark.parametrize(
    ("opt_name", "kw"),
    [
        ("SGD", {"lr": 0.1}),
        ("Adam", {"lr": 0.05}),
        ("Rprop", {"lr": 0.05}),
        ("SparseAdam", {"lr": 0.05}),
    ],
)
def test_device_plans_train_exactly_like_unique_plans(device_plans, monkeypatch, opt_name, kw):
    """The padded plan (rows past the count zero, never written) trains bit-identically."""
    results = []
    for forced in (True, False):
        monkeypatch.setattr(emb_mod, "_plans_on_device", lambda ids, f=forced: f)
        init = torch.randn(N, D, generator=torch.Generator().manual_seed(0))
        emb = gl.OffloadedEmbedding(N, D, "cpu", device="cpu", init=lambda t, w=init: t.copy_(w))
        opt = gl.OffloadedOptimizer(getattr(torch.optim, opt_name), emb, **kw)
        for step in range(4):
            opt.zero_grad()
            ids = _ids(10 + step, (6, 4))
            (emb(ids).sin() * torch.arange(D)).sum().backward()
            opt.step()
        state = [torch.from_numpy(t.getNumpyVersion()) for t in opt.pagers[0].tables.values()]
        results.append((torch.from_numpy(emb.table.getNumpyVersion()), state))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


def test_device_plans_two_lookups_and_bags(device_plans):
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Parameter(init.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.1)
    emb = gl.OffloadedEmbedding(N, D, "cpu", device="cpu", init=lambda t: t.copy_(init))
    bag = gl.OffloadedEmbeddingBag(N, D, "sum", "cpu", device="cpu", init=lambda t: t.copy_(init))
    opt = gl.OffloadedOptimizer(torch.optim.SGD, [emb, bag], lr=0.1)
    ref_bag = torch.nn.Parameter(init.clone())
    ref_bag_opt = torch.optim.SGD([ref_bag], lr=0.1)
    for step in range(3):
        a, b = _ids(20 + step, (5,)), _ids(30 + step, (4, 3))
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_bag_opt.zero_grad()
        (emb(a).pow(2).sum() + emb(b).sum() + bag(b).pow(2).sum()).backward()
        (F.embedding(a, ref).pow(2).sum() + F.embedding(b, ref).sum()).backward()
        F.embedding_bag(b, ref_bag, mode="sum").pow(2).sum().backward()
        opt.step()
        ref_opt.step()
        ref_bag_opt.step()
    torch.testing.assert_close(torch.from_numpy(emb.table.getNumpyVersion()), ref.detach())
    torch.testing.assert_close(torch.from_numpy(bag.table.getNumpyVersion()), ref_bag.detach())


# ---- GPU --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [18, 1000, 3072, 3073, 24576])
@pytest.mark.gpu
@NEEDS_CUPY
def test_segment_sum_is_bit_identical_to_embedding_backward(n, dtype):
    from gadgetloader.transfer._kernels import launch_segment_sum

    g = torch.Generator(device="cuda").manual_seed(n)
    ranks = torch.arange(1, 5001, device="cuda", dtype=torch.float64)
    ids = torch.multinomial(ranks.pow(-1.1), n, replacement=True, generator=g)  # hot repeats
    grad = torch.randn(n, 37, device="cuda", dtype=dtype, generator=g)
    plan = plan_rows_async((ids,), 5000)
    out = torch.empty_like(grad)
    launch_segment_sum(grad, plan.order, plan.order_local, out)
    rows = torch.zeros(n, 37, device="cuda", dtype=dtype, requires_grad=True)
    F.embedding(plan.local, rows).backward(grad)
    assert torch.equal(out, rows.grad)
    k = int(plan.n_distinct)
    assert bool((out[k:] == 0).all())


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_count_in_gather_and_scatter_kernels(placement):
    table = gl.DataGadget((N, D), dtype="float32", placement=placement)
    state = gl.DataGadget((N, D), dtype="float32", placement=placement)
    base = torch.arange(N * D, dtype=torch.float32).view(N, D)
    table.init_(lambda x: x.copy_(base))
    state.init_(lambda x: x.copy_(-base))
    stores = [table.store, state.store]
    ids = torch.tensor([2, 7, 8, 8, 8], device="cuda")
    count = torch.tensor([3], device="cuda")
    rows, st = gather_many(stores, ids, torch.device("cuda"), ids_sorted=True, count=count)
    assert torch.equal(rows[:3].cpu(), base[[2, 7, 8]]) and bool((rows[3:] == 0).all())
    assert torch.equal(st[:3].cpu(), -base[[2, 7, 8]]) and bool((st[3:] == 0).all())
    new = torch.full((5, D), 5.0, device="cuda")
    new[3:] = 77.0  # past the count: must not land on row 8
    scatter_many(stores, ids, [new, -new], unique=True, count=torch.tensor([2], device="cuda"))
    got = torch.from_numpy(table.getNumpyVersion())
    want = base.clone()
    want[[2, 7]] = 5.0
    assert torch.equal(got, want)
    assert torch.equal(torch.from_numpy(state.getNumpyVersion()), -want)


def _drop_in(placement, n_rows=5000, opt=torch.optim.SGD, **kw):
    init = torch.randn(n_rows, 16, generator=torch.Generator().manual_seed(4))
    emb = gl.OffloadedEmbedding(n_rows, 16, placement, device="cuda", init=lambda t: t.copy_(init))
    return init, emb, gl.OffloadedOptimizer(opt, emb, **kw)


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("n", [300, 6000])
def test_drop_in_sgd_bit_identical_to_full_table_on_gpu(n):
    init, emb, opt = _drop_in("pinned", lr=0.1)
    W = torch.nn.Parameter(init.clone().cuda())
    ref_opt = torch.optim.SGD([W], lr=0.1)
    g = torch.Generator(device="cuda").manual_seed(n)
    probs = torch.arange(1, 5001, device="cuda", dtype=torch.float64).pow(-1.0)
    for _ in range(3):
        ids = torch.multinomial(probs, n, replacement=True, generator=g).view(-1, 3)
        w = torch.randn(16, device="cuda", generator=g)
        for lookup, o in ((emb, opt), (lambda i: F.embedding(i, W), ref_opt)):
            o.zero_grad()
            (lookup(ids).tanh() * w).sum().backward()
            o.step()
    assert torch.equal(torch.from_numpy(emb.table.getNumpyVersion()), W.detach().cpu())


@pytest.mark.gpu
@NEEDS_CUPY
def test_bad_cuda_id_in_training_is_reported_by_step_with_nothing_written():
    init, emb, opt = _drop_in("pinned", opt=torch.optim.Adam, lr=0.1)
    emb(torch.tensor([1, 2], device="cuda")).sum().backward()
    opt.step()
    table = torch.from_numpy(emb.table.getNumpyVersion()).clone()
    states = [torch.from_numpy(t.getNumpyVersion()).clone() for t in opt.pagers[0].tables.values()]
    step_before = opt.state[emb._slot.param]["step"].clone()
    opt.zero_grad()
    out = emb(torch.tensor([[3, 5000]], device="cuda"))  # 5000 is one past the end
    assert bool((out[0, 1] == 0).all())  # the kernel read nothing outside the table
    out.sum().backward()
    with pytest.raises(gl.GadgetIndexError, match="5000"):
        opt.step()
    assert torch.equal(torch.from_numpy(emb.table.getNumpyVersion()), table)
    for t, before in zip(opt.pagers[0].tables.values(), states, strict=True):
        assert torch.equal(torch.from_numpy(t.getNumpyVersion()), before)
    assert torch.equal(opt.state[emb._slot.param]["step"], step_before)
    # the next step trains normally
    opt.zero_grad()
    emb(torch.tensor([4], device="cuda")).sum().backward()
    opt.step()
    assert not torch.equal(torch.from_numpy(emb.table.getNumpyVersion())[4], table[4])
    with torch.no_grad(), pytest.raises(gl.GadgetIndexError, match="-1"):
        emb(torch.tensor([-1], device="cuda"))  # an eval lookup reports it at once
    # a training lookup abandoned without a step is reported by zero_grad()
    emb(torch.tensor([7, -3], device="cuda")).sum().backward()
    with pytest.raises(gl.GadgetIndexError, match="-3"):
        opt.zero_grad()
    opt.zero_grad()  # reported once; the lookups were dropped
    emb(torch.tensor([7], device="cuda")).sum().backward()
    opt.step()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("opt_name", ["Adam", "SparseAdam", "Adagrad"])
def test_drop_in_step_with_cuda_ids_never_synchronises(opt_name):
    _, emb, opt = _drop_in("pinned", n_rows=100_000, opt=getattr(torch.optim, opt_name), lr=0.01)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 100_000, (4096, 6), device="cuda", generator=g) for _ in range(3)]

    def step(ids):
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()

    step(batches[0])  # first step: state creation, kernel compilation
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # "a prototype feature": the mode itself warns
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        step(batches[1])
        step(batches[2])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("n", [1, 2, 1023, 1024, 1025, 5000, 24576, (1 << 18) + 5])
def test_plan_kernel_equals_the_torch_plan(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    high = max(2, n // 3)
    ids = torch.randint(0, high, (n,), device="cuda", generator=g)
    ends = torch.empty(2, dtype=torch.int64, pin_memory=True)
    got = plan_rows_async((ids,), high, ends)
    want = plan_rows_async((ids.cpu(),), high)  # the torch-operations form
    for a, b in zip(got[:2] + got[4:], want[:2] + want[4:], strict=True):
        assert torch.equal(a.cpu(), b)
    assert int(got.n_distinct) == int(want.n_distinct)
    torch.cuda.synchronize()
    assert ends.tolist() == [int(ids.min()), int(ids.max())]


def test_bags_and_large_lookups_take_exact_plans(device_plans, monkeypatch):
    """Padding costs one row per lookup position: bags, and lookups whose padded rows would
    pass DEVICE_PLAN_MAX_BYTES, use exact plans (one row per distinct id)."""
    bag = gl.OffloadedEmbeddingBag(N, D, "sum", "cpu", device="cpu")
    emb = gl.OffloadedEmbedding(N, D, "cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, [bag, emb], lr=0.1)  # noqa: F841 (kept alive)
    ids = torch.tensor([[1, 1, 2], [2, 3, 3]])
    bag(ids).sum().backward()
    emb(ids).sum().backward()
    (bag_plan, bag_rows), (emb_plan, emb_rows) = bag._pending[0], emb._pending[0]
    assert bag_plan.n_distinct is None and bag_rows.shape[0] == 3
    assert emb_plan.n_distinct is not None and emb_rows.shape[0] == ids.numel()
    monkeypatch.setattr(emb_mod, "DEVICE_PLAN_MAX_BYTES", ids.numel() * D * 4 - 1)
    emb(ids).sum().backward()
    plan, rows = emb._pending[1]
    assert plan.n_distinct is None and rows.shape[0] == 3


@pytest.mark.gpu
@NEEDS_CUPY
def test_bad_cuda_id_with_a_host_table_is_reported_by_the_forward():
    """A `cpu` table has no row kernel to keep a bad id inside it: the forward checks."""
    emb = gl.OffloadedEmbedding(N, D, "cpu", device="cuda")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    before = torch.from_numpy(emb.table.getNumpyVersion()).clone()
    with pytest.raises(gl.GadgetIndexError, match=str(N)):
        emb(torch.tensor([1, N], device="cuda"))
    opt.zero_grad()  # nothing left pending
    emb(torch.tensor([1, 2], device="cuda")).sum().backward()
    opt.step()
    after = torch.from_numpy(emb.table.getNumpyVersion())
    assert not torch.equal(after[1], before[1]) and torch.equal(after[5], before[5])


@pytest.mark.gpu
@NEEDS_CUPY
def test_moving_the_model_keeps_a_pending_range_check():
    emb = gl.OffloadedEmbedding(N, D, "pinned", device="cuda")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    before = torch.from_numpy(emb.table.getNumpyVersion()).clone()
    emb(torch.tensor([3, -2], device="cuda")).sum().backward()
    emb.cpu()  # drops the step's lookups
    with pytest.raises(gl.GadgetIndexError, match="-2"):
        opt.step()
    assert torch.equal(torch.from_numpy(emb.table.getNumpyVersion()), before)
