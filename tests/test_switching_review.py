"""Training, cases found in review: fused SGD with momentum beside ordinary parameters, a new
optimizer for a table whose optimizer is gone, copies, model.parameters(), late gradients."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl

W0 = torch.tensor([[0.3, -0.2, 0.1, 0.5]])
B0 = torch.tensor([0.05])
IDS = ([1, 2, 2], [2, 7], [1, 5, 5, 9])


def _fused_sgd_works(device: torch.device) -> bool:
    p = torch.zeros(2, device=device, requires_grad=True)
    try:
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
        p.grad = torch.ones_like(p)
        opt.step()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def _table(t: torch.Tensor) -> None:
    t.copy_(torch.arange(40.0).view(10, 4) / 40)


def _train(model: nn.ModuleDict, opt: torch.optim.Optimizer, device: torch.device) -> None:
    for ids in IDS:
        opt.zero_grad()
        model["lin"](model["e"](torch.tensor(ids, device=device))).sum().backward()
        opt.step()


def _mixed(placement: str, device: torch.device) -> nn.ModuleDict:
    model = nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(10, 4, placement=placement, device=device, init=_table),
            "lin": nn.Linear(4, 1),
        }
    ).to(device)
    with torch.no_grad():
        model["lin"].weight.copy_(W0)
        model["lin"].bias.copy_(B0)
    return model


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_momentum_beside_ordinary_parameters_trains_like_unfused(
    placement: str, device: torch.device, nesterov: bool
) -> None:
    if not _fused_sgd_works(device):
        pytest.skip(f"this torch has no fused SGD on {device.type}")
    results = []
    for fused in (True, False):
        model = _mixed(placement, device)
        kw = dict(lr=0.1, momentum=0.9, nesterov=nesterov, fused=fused)
        _train(model, gl.OffloadedOptimizer(torch.optim.SGD, model, **kw), device)
        results.append((model["e"].table.getNumpyVersion().copy(), model["lin"].weight.detach()))
    (t_fused, w_fused), (t_plain, w_plain) = results
    np.testing.assert_allclose(t_fused, t_plain, rtol=0, atol=1e-6)
    assert torch.allclose(w_fused, w_plain, rtol=0, atol=1e-6)
    init = (torch.arange(40.0).view(10, 4) / 40).numpy()
    untouched = [0, 3, 4, 6, 8]
    np.testing.assert_array_equal(t_fused[untouched], init[untouched])
    assert not np.array_equal(t_fused[[1, 2, 5, 7, 9]], init[[1, 2, 5, 7, 9]])


def test_fused_sgd_momentum_first_steps_are_exact(placement: str, device: torch.device) -> None:
    """With the same ids every step, lazy and dense SGD coincide: results are bit-identical."""
    if not _fused_sgd_works(device):
        pytest.skip(f"this torch has no fused SGD on {device.type}")
    kw = dict(lr=0.1, momentum=0.9, fused=True)
    ours = nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(10, 4, placement=placement, device=device, init=_table),
            "lin": nn.Linear(4, 1),
        }
    ).to(device)
    ref = nn.ModuleDict({"e": nn.Embedding(10, 4), "lin": nn.Linear(4, 1)}).to(device)
    with torch.no_grad():
        for m in (ours, ref):
            m["lin"].weight.copy_(W0)
            m["lin"].bias.copy_(B0)
        _table(ref["e"].weight)
    for model, opt in (
        (ours, gl.OffloadedOptimizer(torch.optim.SGD, ours, **kw)),
        (ref, torch.optim.SGD(ref.parameters(), **kw)),
    ):
        for _ in range(3):
            opt.zero_grad()
            model["lin"](model["e"](torch.tensor([1, 2, 2], device=device))).sum().backward()
            opt.step()
    np.testing.assert_array_equal(
        ours["e"].table.getNumpyVersion(), ref["e"].weight.detach().cpu().numpy()
    )
    assert torch.equal(ours["lin"].weight, ref["lin"].weight)


def test_fused_sgd_with_dampening_beside_ordinary_parameters_is_refused(
    device: torch.device,
) -> None:
    if not _fused_sgd_works(device):
        pytest.skip(f"this torch has no fused SGD on {device.type}")
    model = nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(10, 4, placement="cpu", device=device, init=_table),
            "lin": nn.Linear(4, 1),
        }
    ).to(device)
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD, model, lr=0.1, momentum=0.9, dampening=0.1, fused=True
    )
    before = model["e"].table.getNumpyVersion().copy()
    model["lin"](model["e"](torch.tensor([1], device=device))).sum().backward()
    with pytest.raises(gl.GadgetValueError, match="dampening"):
        opt.step()
    np.testing.assert_array_equal(model["e"].table.getNumpyVersion(), before)


def test_a_table_takes_a_new_optimizer_once_the_old_one_is_gone() -> None:
    e = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu", init=_table)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    e(torch.tensor([1, 2])).sum().backward()
    opt.step()
    with pytest.raises(gl.GadgetValueError, match="already belongs"):
        gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.1)
    del opt
    gc.collect()
    sgd = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.5)
    before = e.table.getData([1, 3]).clone()
    e(torch.tensor([1])).sum().backward()
    sgd.step()
    after = e.table.getData([1, 3])
    assert torch.equal(after[0], before[0] - 0.5)  # plain SGD: fresh state, grad of ones
    assert torch.equal(after[1], before[1])


def test_a_deep_copy_is_a_separate_table_without_an_optimizer() -> None:
    e = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu", init=_table)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    e(torch.tensor([1, 2])).sum().backward()
    opt.step()
    twin = copy.deepcopy(e)
    assert torch.equal(twin.table.getData([1, 2]), e.table.getData([1, 2]))
    sgd = gl.OffloadedOptimizer(torch.optim.SGD, twin, lr=0.5)
    kept = e.table.getData([1]).clone()
    twin(torch.tensor([1])).sum().backward()
    sgd.step()
    assert torch.equal(e.table.getData([1]), kept)
    assert torch.equal(twin.table.getData([1]), kept - 0.5)


def test_model_parameters_without_tables_warns() -> None:
    model = nn.ModuleDict(
        {"e": gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu"), "lin": nn.Linear(2, 1)}
    )
    with pytest.warns(UserWarning, match="model.parameters"):
        gl.OffloadedOptimizer(torch.optim.Adam, model.parameters(), lr=0.1)


def test_a_gradient_after_the_step_for_an_earlier_lookup_is_reported() -> None:
    e = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu", init=_table)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.1)
    late = e(torch.tensor([5])).sum()
    e(torch.tensor([1])).sum().backward()
    opt.step()
    late.backward()
    before = e.table.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError, match="after that step"):
        opt.step()
    np.testing.assert_array_equal(e.table.getNumpyVersion(), before)
    e(torch.tensor([2])).sum().backward()
    opt.step()  # reported once; training goes on
    assert not np.array_equal(e.table.getNumpyVersion()[2], before[2])


def test_fused_sgd_momentum_with_switchers_beside_ordinary_parameters(device: torch.device) -> None:
    if not _fused_sgd_works(device):
        pytest.skip(f"this torch has no fused SGD on {device.type}")

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.u_embeddings = nn.Embedding(6, 4)
            self.lin = nn.Linear(4, 1)

        def forward(self, local: torch.Tensor) -> torch.Tensor:
            return self.lin(self.u_embeddings(local)).sum()

    results = []
    for fused in (True, False):
        model = Model().to(device)
        with torch.no_grad():
            model.lin.weight.copy_(W0)
            model.lin.bias.copy_(B0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
        sw = gl.PytorchModelFactory(model.u_embeddings, 20, 4, deviceType="cpu")
        sw.customInit(_table20)
        osw = gl.PytorchOptimizerFactory(opt, 20, 4, model, "u_embeddings", deviceType="cpu")
        osw.optInit()
        for ids in ([1, 2, 2], [3, 7], [1, 19]):
            ids_t = torch.tensor(ids, device=device)
            local = sw.beforeForwardPass(ids_t)
            osw.beforeForwardPass(ids_t)
            opt.zero_grad()
            model(local).backward()
            opt.step()
            sw.afterOptimizerStep(ids_t)
            osw.afterOptimizerStep(ids_t)
        results.append((sw.getNumpyVersion().copy(), model.lin.weight.detach().clone()))
    (t_fused, w_fused), (t_plain, w_plain) = results
    np.testing.assert_allclose(t_fused, t_plain, rtol=0, atol=1e-6)
    assert torch.allclose(w_fused, w_plain, rtol=0, atol=1e-6)
    assert not np.array_equal(t_fused[[1, 2, 3, 7, 19]], _start20()[[1, 2, 3, 7, 19]])


def _start20() -> np.ndarray:
    return (torch.arange(80.0).view(20, 4) / 80).numpy()


def _table20(t: torch.Tensor) -> None:
    t.copy_(torch.arange(80.0).view(20, 4) / 80)


def test_a_released_table_leaves_its_old_state_buffer() -> None:
    from gadgetloader.stores._interleaved import SlotStore, slot_info

    e = gl.OffloadedEmbedding(1000, 8, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    e(torch.tensor([1, 2])).sum().backward()
    opt.step()
    group = slot_info(e.table.store)[0]
    assert group.parent.shape == (1000, 3, 8)  # the table and Adam's two moments
    rows = e.table.getNumpyVersion().copy()
    del opt
    gc.collect()
    assert group.open == {0}  # the state tables went with the optimizer
    sgd = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.5)  # no row state
    assert not isinstance(e.table.store, SlotStore)  # a buffer of its own again
    assert group.parent.closed  # the old (1000, 3, 8) buffer is freed
    np.testing.assert_array_equal(e.table.getNumpyVersion(), rows)
    del sgd
    gc.collect()
    ada = gl.OffloadedOptimizer(torch.optim.Adagrad, e, lr=0.5)
    assert slot_info(e.table.store)[0].parent.shape == (1000, 2, 8)
    np.testing.assert_array_equal(e.table.getNumpyVersion(), rows)
    e(torch.tensor([3])).sum().backward()
    ada.step()
    assert not np.array_equal(e.table.getNumpyVersion()[3], rows[3])
