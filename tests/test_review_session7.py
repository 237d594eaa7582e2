"""Cases found by session 7's independent training review: each failed before its fix.

The reference is always plain torch: a dense ``nn.Embedding`` trained by the same optimizer
(and scheduler / scaler), with every row in every batch where lazy and dense updates must
agree, or the exact first-step arithmetic where they differ.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import gadgetloader as gl
from gadgetloader.switching import load_checkpoint, save_checkpoint

ROWS, DIM = 6, 3


def _w0() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(ROWS, DIM, generator=g)


def _offloaded(placement, device, w0):
    emb = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device)
    emb.load_state_dict({"weight": w0})
    return emb


def _dense(device, w0):
    emb = nn.Embedding(ROWS, DIM).to(device)
    with torch.no_grad():
        emb.weight.copy_(w0)
    return emb


def _weights(emb) -> torch.Tensor:
    if isinstance(emb, nn.Embedding):
        return emb.weight.detach().cpu().clone()
    return emb.weight.as_tensor().detach().cpu().clone()


SCHEDULED = [
    pytest.param(
        torch.optim.SGD,
        {"lr": 0.1},
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
        id="sgd-onecycle-momentum",
    ),
    pytest.param(
        torch.optim.RMSprop,
        {"lr": 0.05},
        lambda o: torch.optim.lr_scheduler.CyclicLR(
            o, 0.01, 0.1, cycle_momentum=True, base_momentum=0.5, max_momentum=0.9
        ),
        id="rmsprop-cyclic-momentum",
    ),
    pytest.param(
        torch.optim.Rprop,
        {"lr": 0.05},
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
        id="rprop-warmup",
    ),
    pytest.param(
        torch.optim.ASGD,
        {"lr": 0.05},
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
        id="asgd-warmup",
    ),
]


@pytest.mark.parametrize("opt_cls,kw,make_sched", SCHEDULED)
def test_schedulers_that_change_state_match_torch(placement, device, opt_cls, kw, make_sched):
    """Momentum turned on by a scheduler, and lr warmed up before the first step (Rprop's
    step_size, ASGD's eta start from it): every row in every batch, so lazy == dense."""
    w0 = _w0()
    ids = torch.arange(ROWS, device=device).repeat(2)
    results = []
    for off in (True, False):
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        opt = gl.OffloadedOptimizer(opt_cls, emb, **kw) if off else opt_cls(emb.parameters(), **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # schedulers' own warnings
            sched = make_sched(opt)
        for step in range(4):
            opt.zero_grad()
            (emb(ids) ** 2 * (step + 1)).sum().backward()
            opt.step()
            sched.step()
        results.append(_weights(emb))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_momentum_turned_on_later_is_paged_per_row(placement, device):
    """Rows first used after a scheduler turned momentum on start their own buffer (torch's
    first step: buf = grad), instead of reusing other rows' stale momentum."""
    w0 = _w0()
    emb = _offloaded(placement, device, w0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    lrs = []
    for ids in ([0, 1, 2], [3, 4, 5], [0, 1]):  # 3 then 2 distinct rows: no shape clash
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        emb(torch.tensor(ids, device=device)).sum().backward()
        opt.step()
        sched.step()
    moved = _weights(emb) - w0
    # rows 3-5: one step, their first with momentum: -lr * grad (grad = 1)
    torch.testing.assert_close(moved[3:], torch.full((3, DIM), -lrs[1]), rtol=0, atol=1e-6)
    # row 2: one step (the first)
    torch.testing.assert_close(moved[2], torch.full((DIM,), -lrs[0]), rtol=0, atol=1e-6)
    # rows 0-1: buf1 = 1, then buf = m * 1 + 1 with the third step's momentum
    m = opt.param_groups[0]["momentum"]
    assert "momentum_buffer" in opt.pagers[0].tables
    del m  # the scheduler moved it after the step; check against the table instead
    buf = opt.pagers[0].tables["momentum_buffer"].as_tensor().cpu()
    assert torch.all(buf[2:] == 1.0) and torch.all(buf[0:2] > 1.0)
    expect01 = -lrs[0] - lrs[2] * buf[0, 0].item()
    torch.testing.assert_close(moved[0], torch.full((DIM,), expect01), rtol=0, atol=1e-6)


def test_checkpoint_with_momentum_from_a_scheduler_resumes_exactly(tmp_path, placement, device):
    w0 = _w0()
    batches = [torch.tensor(b, device=device) for b in ([0, 1, 2], [2, 3], [4, 5, 0], [1, 4])]

    def build():
        emb = _offloaded(placement, device, w0)
        opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        return emb, opt, sched

    def train(emb, opt, sched, bs):
        for b in bs:
            opt.zero_grad()
            (emb(b) ** 2).sum().backward()
            opt.step()
            sched.step()

    ref = build()
    train(*ref, batches)
    first = build()
    train(*first, batches[:2])
    save_checkpoint(tmp_path / "ck", {"model": first[0], "opt": first[1]})
    sched_state = first[2].state_dict()
    second = build()  # momentum is 0 when the optimizer is built: the table appears on load
    second[2].load_state_dict(sched_state)
    load_checkpoint(tmp_path / "ck", {"model": second[0], "opt": second[1]})
    train(*second, batches[2:])
    assert torch.equal(_weights(second[0]), _weights(ref[0]))


def _scaled_setup(placement, device, w0, off, with_opt=True):
    emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
    torch.manual_seed(0)
    head = nn.Linear(DIM, 1).to(device)
    model = nn.ModuleDict({"emb": emb, "head": head})
    if not with_opt:
        return model, None
    opt = (
        gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.01)
        if off
        else torch.optim.SGD(model.parameters(), lr=0.01)
    )
    return model, opt


@pytest.mark.parametrize("order", ["scaler-step-only", "unscale-then-prepare", "prepare-first"])
def test_grad_scaler_unscales_table_gradients(placement, device, order):
    w0 = _w0()
    ids = torch.tensor([1, 2, 2], device=device)
    got = []
    for off in (True, False):
        model, opt = _scaled_setup(placement, device, w0, off)
        sc = torch.amp.GradScaler(device.type, init_scale=1024.0)
        sc.scale(model["head"](model["emb"](ids)).sum()).backward()
        if off and order == "prepare-first":
            opt.prepare_grads()
        if order != "scaler-step-only":
            sc.unscale_(opt)
            if off and order == "unscale-then-prepare":
                opt.prepare_grads()
            params = [p for g in opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, 1e6)
        sc.step(opt)
        sc.update()
        got.append(_weights(model["emb"]))
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-7)


def test_grad_scaler_skips_a_step_with_inf_only_in_a_table(placement, device):
    w0 = _w0()
    model, opt = _scaled_setup(placement, device, w0, True)
    sc = torch.amp.GradScaler(device.type, init_scale=1024.0)
    before_head = model["head"].weight.detach().clone()
    loss = (model["emb"](torch.tensor([1, 2], device=device)) * float("inf")).sum()
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    assert torch.equal(_weights(model["emb"]), w0)
    assert torch.equal(model["head"].weight.detach(), before_head)
    assert sc.get_scale() < 1024.0


def test_tables_take_their_param_group_options(placement, device):
    w0 = _w0()
    ids = torch.tensor([0, 3, 3], device=device)
    got = []
    for off in (True, False):
        model, _ = _scaled_setup(placement, device, w0, off, with_opt=False)
        groups = [
            {"params": model["emb"] if off else model["emb"].parameters(), "lr": 0.5},
            {"params": model["head"].parameters(), "lr": 0.01},
        ]
        opt = (
            gl.OffloadedOptimizer(torch.optim.SGD, groups, lr=0.1)
            if off
            else torch.optim.SGD(groups, lr=0.1)
        )
        opt.zero_grad()
        model["head"](model["emb"](ids)).sum().backward()
        opt.step()
        got.append((_weights(model["emb"]), model["head"].weight.detach().cpu().clone()))
    torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[0][1], got[1][1], rtol=1e-6, atol=1e-7)
    # a module beside a group that names some of its parameters: no duplicate error
    model, _ = _scaled_setup(placement, device, w0, True, with_opt=False)
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD, [model, {"params": model["head"].parameters(), "lr": 0.01}], lr=0.1
    )
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs == [0.01, 0.1]


def test_param_group_with_a_non_parameter_is_a_gadget_error(placement, device):
    emb = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device)
    with pytest.raises(gl.GadgetTypeError, match="param group 0"):
        gl.OffloadedOptimizer(torch.optim.SGD, [{"params": [emb, "x"], "lr": 0.5}], lr=0.1)


def test_requires_grad_false_freezes_the_table(placement, device):
    w0 = _w0()
    emb = _offloaded(placement, device, w0)
    head = nn.Linear(DIM, 1).to(device)
    model = nn.Sequential(emb, head)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.1)
    emb.requires_grad_(False)
    out = emb(torch.tensor([1, 2], device=device))
    assert not out.requires_grad
    head_before = head.weight.detach().clone()
    opt.zero_grad()
    model(torch.tensor([1, 2], device=device)).sum().backward()
    opt.step()
    assert torch.equal(_weights(emb), w0)
    assert not torch.equal(head.weight.detach(), head_before)
    emb.requires_grad_(True)
    opt.zero_grad()
    model(torch.tensor([1, 2], device=device)).sum().backward()
    opt.step()
    moved = (_weights(emb) - w0).abs().sum(1)
    assert moved[1] > 0 and moved[2] > 0 and moved[0] == 0


def test_module_dtype_conversion_sets_the_lookup_dtype(placement, device):
    w0 = _w0()
    emb = _offloaded(placement, device, w0)
    model = nn.Sequential(emb, nn.Linear(DIM, 1)).to(device).double()
    assert emb.table.dtype == torch.float32
    ids = torch.tensor([1, 4], device=device)
    out = emb(ids)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), w0[[1, 4]].double())
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.1)
    opt.zero_grad()
    emb(ids).sum().backward()
    opt.step()
    torch.testing.assert_close(_weights(emb)[[1, 4]], w0[[1, 4]] - 0.1)
    model.float()
    assert emb(ids).dtype == torch.float32
    bag = gl.OffloadedEmbeddingBag(ROWS, DIM, mode="sum", placement=placement, device=device)
    bag.half()
    w = torch.ones(2, 2, dtype=torch.float16, device=device)
    assert bag(torch.tensor([[0, 1], [2, 3]], device=device), per_sample_weights=w).dtype == (
        torch.float16
    )


def test_bfloat16_state_dicts_keep_bfloat16(placement, device):
    emb = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device, dtype="bfloat16")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2], device=device)).float().sum().backward()
    opt.step()
    assert emb.state_dict()["weight"].dtype == torch.bfloat16
    tables = opt.state_dict()["tables"][0]
    assert tables and all(t.dtype == torch.bfloat16 for t in tables.values())
    fresh = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device, dtype="bfloat16")
    fresh.load_state_dict(emb.state_dict())
    assert torch.equal(fresh.weight.as_tensor().cpu(), emb.weight.as_tensor().cpu())


# ---- session 7's review of the fixes above -------------------------------------------------------
def _torch_rprop_warmup(w0, ids, device, steps=3, between=None):
    emb = _dense(device, w0)
    opt = torch.optim.Rprop(emb.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    for step in range(steps):
        opt.zero_grad()
        (emb(ids) ** 2 * (step + 1)).sum().backward()
        opt.step()
        sched.step()
    return _weights(emb)


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
def test_switchers_rprop_warmup_after_opt_init_matches_torch(placement, device, order):
    w0 = _w0()
    ids = torch.arange(ROWS, device=device)
    model = nn.ModuleDict({"u": nn.Embedding(1, DIM)}).to(device)
    opt = torch.optim.Rprop(model.parameters(), lr=0.05)
    sw = gl.ModelFactory(model["u"], ROWS, DIM, placement=placement, duplicates="merge")
    sw.table.init_(lambda t: t.copy_(w0.to(t.device)))
    osw = gl.OptimizerFactory(opt, ROWS, DIM, model, "u", placement=placement)
    osw.optInit()
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    for step in range(3):
        if order == "model-first":
            local = sw.beforeForwardPass(ids)
            osw.beforeForwardPass(ids)
        else:
            osw.beforeForwardPass(ids)
            local = sw.beforeForwardPass(ids)
        opt.zero_grad()
        (model["u"](local) ** 2 * (step + 1)).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        sched.step()
    got = torch.from_numpy(sw.table.getNumpyVersion())
    torch.testing.assert_close(got, _torch_rprop_warmup(w0, ids, device), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("between", ["state_dict", "saved-before-any-step"])
def test_rprop_warmup_survives_state_dict_calls(placement, device, between):
    w0 = _w0()
    ids = torch.arange(ROWS, device=device)
    emb = _offloaded(placement, device, w0)
    opt = gl.OffloadedOptimizer(torch.optim.Rprop, emb, lr=0.05)
    if between == "saved-before-any-step":
        fresh_sd = opt.state_dict()
        emb = _offloaded(placement, device, w0)
        opt = gl.OffloadedOptimizer(torch.optim.Rprop, emb, lr=0.05)
        opt.load_state_dict(fresh_sd)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    for step in range(3):
        opt.zero_grad()
        loss = (emb(ids) ** 2 * (step + 1)).sum()
        if between == "state_dict":
            opt.state_dict()  # between the forward (states gathered) and the step
        loss.backward()
        opt.step()
        sched.step()
    torch.testing.assert_close(
        _weights(emb), _torch_rprop_warmup(w0, ids, device), rtol=1e-5, atol=1e-6
    )


def test_clipping_over_indexed_groups_sees_table_gradients(placement, device):
    w0 = _w0()
    ids = torch.tensor([1, 2, 2, 5], device=device)
    norms, weights = [], []
    for off in (True, False):
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        opt = (
            gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
            if off
            else torch.optim.SGD(emb.parameters(), lr=0.1)
        )
        (emb(ids) * 3).sum().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 0.01)))
        opt.step()
        weights.append(_weights(emb))
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 1
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-6, atol=1e-7)


def test_state_dict_between_micro_batches_keeps_accumulating(placement, device):
    w0 = _w0()
    got = []
    for read_between in (True, False):
        emb = _offloaded(placement, device, w0)
        opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
        emb(torch.tensor([1, 2], device=device)).sum().backward()
        if read_between:
            opt.state_dict()
            assert opt.param_groups[0]["lr"] == 0.1  # reading the groups merges; fine
        (emb(torch.tensor([2, 3], device=device)) ** 2).sum().backward()
        opt.step()
        got.append(_weights(emb))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_momentum_table_from_a_scheduler_loads_before_the_scheduler(
    tmp_path, placement, device, how
):
    """Saved after OneCycleLR turned momentum on; loaded into a fresh optimizer (momentum 0,
    no momentum table) before its scheduler is rebuilt: as plain torch, the same sequence."""
    w0 = _w0()
    ids = torch.arange(ROWS, device=device).repeat(2)  # every row: lazy == dense

    def run(off):
        def build():
            emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
            opt = (
                gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
                if off
                else torch.optim.SGD(emb.parameters(), lr=0.1)
            )
            return emb, opt

        def train(emb, opt, sched, steps):
            for step in range(steps):
                opt.zero_grad()
                (emb(ids) ** 2 * (step + 1)).sum().backward()
                opt.step()
                sched.step()

        emb, opt = build()
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        train(emb, opt, sched, 2)
        emb2, opt2 = build()
        if how == "checkpoint" and off:
            save_checkpoint(tmp_path / "ck", {"model": emb, "opt": opt})
            load_checkpoint(tmp_path / "ck", {"model": emb2, "opt": opt2})
        else:
            emb2.load_state_dict(emb.state_dict())
            opt2.load_state_dict(opt.state_dict())
        if off:
            assert "momentum_buffer" in opt2.pagers[0].tables
        sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=10)
        sched2.load_state_dict(sched.state_dict())
        train(emb2, opt2, sched2, 2)
        return _weights(emb2)

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-6)


def test_fused_sgd_with_momentum_from_a_scheduler(placement, device):
    w0 = _w0()
    ids = torch.arange(ROWS, device=device)
    got = []
    for off in (True, False):
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        torch.manual_seed(0)
        head = nn.Linear(DIM, 1).to(device)
        model = nn.ModuleDict({"emb": emb, "head": head})
        try:
            opt = (
                gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.1, fused=True)
                if off
                else torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
            )
        except (RuntimeError, ValueError) as exc:  # no fused SGD on this device / torch
            pytest.skip(f"fused SGD unavailable: {exc}")
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        for _ in range(3):
            opt.zero_grad()
            head(emb(ids)).sum().backward()
            opt.step()
            sched.step()
        got.append((_weights(emb), head.weight.detach().cpu().clone()))
    torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0][1], got[1][1], rtol=1e-5, atol=1e-6)


# ---- session 7's second review of the fixes ---------------------------------------------------
def test_tensor_hyper_parameters_changed_in_place_are_followed(placement, device):
    w0 = _w0()
    ids = torch.arange(ROWS, device=device)
    out = []
    for off in (True, False):  # Rprop, tensor lr lowered in place before the first step
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        kw = {"lr": torch.tensor(0.05)}
        opt = (
            gl.OffloadedOptimizer(torch.optim.Rprop, emb, **kw)
            if off
            else torch.optim.Rprop(emb.parameters(), **kw)
        )
        opt.param_groups[0]["lr"].fill_(0.01)
        for _ in range(2):
            opt.zero_grad()
            (emb(ids) ** 2).sum().backward()
            opt.step()
        out.append(_weights(emb))
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)
    out = []
    for as_tensor in (False, True):  # SGD momentum 0 -> 0.9, as a float or a tensor in place
        emb = _offloaded(placement, device, w0)
        momentum = torch.tensor(0.0) if as_tensor else 0.0
        opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1, momentum=momentum)
        for step, batch in enumerate(([0, 1, 2], [3, 4, 5], [0, 1, 2])):
            if step == 1:
                if as_tensor:
                    opt.param_groups[0]["momentum"].fill_(0.9)
                else:
                    opt.param_groups[0]["momentum"] = 0.9
            opt.zero_grad()
            (emb(torch.tensor(batch, device=device)) ** 2).sum().backward()
            opt.step()
        assert "momentum_buffer" in opt.pagers[0].tables
        out.append(_weights(emb))
    assert torch.equal(out[0], out[1])


def test_a_read_before_a_refill_does_not_keep_stale_state_rows(placement, device):
    w0 = _w0()
    ids = torch.arange(ROWS, device=device)
    emb = _offloaded(placement, device, w0)
    opt = gl.OffloadedOptimizer(torch.optim.Rprop, emb, lr=0.05)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    for step in range(3):
        opt.zero_grad()
        (emb(ids) ** 2 * (step + 1)).sum().backward()
        assert opt.param_groups[0]["lr"] > 0  # a read merges the gradients
        opt.state_dict()  # refills the fresh state tables from the warmed-up lr
        opt.step()
        sched.step()
    torch.testing.assert_close(
        _weights(emb), _torch_rprop_warmup(w0, ids, device), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("read_between", [False, True])
def test_a_second_backward_through_merged_lookups_counts(placement, device, read_between):
    w0 = _w0()
    got = []
    for off in (True, False):
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        opt = (
            gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
            if off
            else torch.optim.SGD(emb.parameters(), lr=0.1)
        )
        opt.zero_grad()
        out = (
            emb(torch.tensor([0, 1, 2], device=device))
            + emb(torch.tensor([2, 3], device=device))[:1]
        )
        (out**2).sum().backward(retain_graph=True)
        if read_between:
            assert opt.param_groups[0]["lr"] == 0.1
        (out * 3).sum().backward()
        opt.step()
        got.append(_weights(emb))
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-6)


def test_state_of_another_optimizer_or_unknown_tables_is_refused(tmp_path, placement, device):
    emb = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device)
    adam = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    adam.step()
    sd = adam.state_dict()
    save_checkpoint(tmp_path / "ck", {"opt": adam})
    emb2 = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device)
    sgd = gl.OffloadedOptimizer(torch.optim.SGD, emb2, lr=0.1)
    with pytest.raises(gl.GadgetValueError, match="do not match|Adam optimizer; this optimizer"):
        sgd.load_state_dict(sd)
    with pytest.raises(gl.GadgetValueError, match="tables"):
        load_checkpoint(tmp_path / "ck", {"opt": sgd})
    assert sgd.pagers[0].tables == {} and sgd.param_groups[0].get("betas") is None
    emb3 = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device)
    adam3 = gl.OffloadedOptimizer(torch.optim.Adam, emb3, lr=0.1)
    bogus = {"inner": sd["inner"], "tables": [dict(sd["tables"][0], bogus=torch.zeros(ROWS, DIM))]}
    with pytest.raises(gl.GadgetValueError, match="bogus"):
        adam3.load_state_dict(bogus)
    assert set(adam3.pagers[0].tables) == {"exp_avg", "exp_avg_sq"}


def test_state_tables_added_by_a_load_are_gathered_with_the_rows(placement, device):
    w0 = _w0()
    emb = _offloaded(placement, device, w0)
    opt = gl.OffloadedOptimizer(torch.optim.RMSprop, emb, lr=0.01)
    opt.param_groups[0]["momentum"] = 0.9
    for _ in range(2):
        opt.zero_grad()
        emb(torch.arange(ROWS, device=device)).sum().backward()
        opt.step()
    emb2 = _offloaded(placement, device, w0)
    opt2 = gl.OffloadedOptimizer(torch.optim.RMSprop, emb2, lr=0.01)
    emb2.load_state_dict(emb.state_dict())
    opt2.load_state_dict(opt.state_dict())
    assert set(opt2.pagers[0].tables) == {"square_avg", "momentum_buffer"}
    opt2.zero_grad()
    emb2(torch.arange(ROWS, device=device)).sum().backward()
    opt2.step()
    if opt2.pagers[0].interleaved:
        assert len(emb2._state_stores) == 2


# ---- session 7's third review -----------------------------------------------------------------
@pytest.mark.parametrize("edit", ["scaler", "clip", "replace"])
def test_the_step_keeps_gradient_edits_of_a_two_lookup_step(placement, device, edit):
    w0 = _w0()
    got = []
    for off in (True, False):
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        opt = (
            gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
            if off
            else torch.optim.SGD(emb.parameters(), lr=1.0)
        )
        loss = (emb(torch.tensor([0, 1, 2], device=device)) * 50).sum() + (
            emb(torch.tensor([2, 3, 4], device=device)) * 50
        ).sum()
        if edit == "scaler":
            sc = torch.amp.GradScaler(device.type, init_scale=1024.0)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        else:
            loss.backward()
            params = [p for g in opt.param_groups for p in g["params"]]
            if edit == "clip":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            else:
                for p in params:
                    p.grad = p.grad * 0.5
            opt.step()
        got.append(_weights(emb))
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_a_load_between_forward_and_step_uses_the_loaded_state(tmp_path, placement, device, how):
    w0 = _w0()
    ids = torch.arange(ROWS, device=device)
    got = []
    for off in (True, False):
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        opt = (
            gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
            if off
            else torch.optim.Adam(emb.parameters(), lr=0.1)
        )
        for step in range(6):
            if step == 3:
                saved = copy.deepcopy(opt.state_dict())
                if off and how == "checkpoint":
                    save_checkpoint(tmp_path / "ck", {"opt": opt})
            opt.zero_grad()
            (emb(ids) ** 2).sum().backward()
            opt.step()
        opt.zero_grad()
        out = emb(ids)  # a training forward (its state rows gathered) ...
        if off and how == "checkpoint":
            load_checkpoint(tmp_path / "ck", {"opt": opt})  # ... then the load
        else:
            opt.load_state_dict(saved)
        (out**2).sum().backward()
        opt.step()
        got.append(_weights(emb))
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["more-after-step", "two-steps-late"])
def test_late_gradients_are_reported_whenever_they_come(placement, device, case):
    w0 = _w0()
    emb = _offloaded(placement, device, w0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    ids = torch.arange(ROWS, device=device)
    if case == "more-after-step":
        out = emb(ids).sum()
        out.backward(retain_graph=True)
        opt.step()
        after_first = _weights(emb)
        out.backward()
    else:
        out = emb(ids).sum()
        opt.step()
        opt.step()
        after_first = _weights(emb)
        out.backward()
    with pytest.raises(gl.GadgetValueError, match="after that step"):
        opt.step()
    assert torch.equal(_weights(emb), after_first)


def test_a_momentum_buffer_kept_after_momentum_went_off_loads(placement, device):
    w0 = _w0()
    emb = _offloaded(placement, device, w0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1, momentum=0.9)
    for momentum in (0.9, 0.0):
        opt.param_groups[0]["momentum"] = momentum
        opt.zero_grad()
        emb(torch.arange(ROWS, device=device)).sum().backward()
        opt.step()
    sd = opt.state_dict()
    assert "momentum_buffer" in sd["tables"][0]
    emb2 = _offloaded(placement, device, w0)
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb2, lr=0.1)
    opt2.load_state_dict(sd)
    buf = opt2.pagers[0].tables["momentum_buffer"].as_tensor().cpu()
    assert torch.equal(buf, sd["tables"][0]["momentum_buffer"])


# ---- session 7's fourth review ----------------------------------------------------------------
def test_kept_outputs_leave_no_growing_bookkeeping(placement, device):
    emb = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)
    kept = []
    for _ in range(200):
        opt.zero_grad()
        loss = emb(torch.tensor([1, 2, 4], device=device)).pow(2).sum()
        loss.backward()
        opt.step()
        kept.append(loss)  # the "keep the loss" habit keeps every lookup alive
    sizes = {
        k: len(v)
        for k, v in vars(emb).items()
        if isinstance(v, (list, dict)) and not k.startswith("_modules")
    }
    assert max(sizes.values(), default=0) <= 8, sizes


def test_a_stray_gradient_discarded_by_zero_grad_is_not_an_error(placement, device):
    w0 = _w0()
    got = []
    for off in (True, False):
        emb = _offloaded(placement, device, w0) if off else _dense(device, w0)
        torch.manual_seed(0)
        head = nn.Linear(DIM, 1).to(device)
        opt = (
            gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
            if off
            else torch.optim.SGD(emb.parameters(), lr=0.1)
        )
        opt_h = torch.optim.SGD(head.parameters(), lr=0.1)
        ids = torch.tensor([[0, 1, 2]], device=device)
        for _ in range(3):
            opt.zero_grad()
            opt_h.zero_grad()
            out = emb(ids)
            out.sum().backward(retain_graph=True)
            opt.step()
            head(out).sum().backward()  # a second loss for the other optimizer
            opt_h.step()
        got.append(_weights(emb))
    torch.testing.assert_close(got[0], got[1], rtol=1e-6, atol=1e-7)


def test_every_late_gradient_is_reported(placement, device):
    emb = gl.OffloadedEmbedding(ROWS, DIM, placement=placement, device=device)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    ids = torch.arange(ROWS, device=device)
    loss = emb(ids).sum()
    loss.backward(retain_graph=True)
    opt.step()
    for _ in range(2):
        loss.backward(retain_graph=True)  # late, twice: reported both times
        before = _weights(emb)
        with pytest.raises(gl.GadgetValueError, match="after that step"):
            emb(ids).sum().backward()
            opt.step()
        assert torch.equal(_weights(emb), before)
        opt.zero_grad()


def test_loading_rows_while_a_step_waits_is_refused(tmp_path, placement, device):
    w0 = _w0()
    emb = _offloaded(placement, device, w0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    save_checkpoint(tmp_path / "ck", {"model": emb})
    (emb(torch.arange(ROWS, device=device)) ** 2).sum().backward()
    with pytest.raises(RuntimeError, match="waits for"):
        emb.load_state_dict({"weight": w0 + 1})
    with pytest.raises(gl.GadgetValueError, match="wait for step"):
        load_checkpoint(tmp_path / "ck", {"model": emb})
    assert torch.equal(_weights(emb), w0)
    opt.step()
    emb.load_state_dict({"weight": w0 + 1})  # after the step: fine
    assert torch.equal(_weights(emb), w0 + 1)
    emb(torch.arange(ROWS, device=device))  # a forward without a backward does not block
    emb.load_state_dict({"weight": w0})
    assert torch.equal(_weights(emb), w0)
