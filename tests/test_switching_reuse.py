"""A reused id buffer modified in place must not reuse the previous step's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl


@pytest.mark.parametrize("kind", ["numpy", "torch", "torch_from_numpy", "optimizer_only"])
def test_in_place_modified_ids_get_a_new_plan(
    placement: str, device: torch.device, kind: str
) -> None:
    torch.manual_seed(0)
    m = nn.Module()
    m.u = nn.Embedding(1, 2).to(device)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    sw = gl.ModelFactory(m.u, 10, 2, placement=placement)
    sw.zerosInit()
    osw = gl.OptimizerFactory(opt, 10, 2, m, "u", placement=placement)
    osw.optInit()
    buf = np.array([1, 2])
    if kind == "numpy":
        ids: object = buf
    elif kind in ("torch_from_numpy", "optimizer_only"):
        ids = torch.from_numpy(buf)  # refilled through NumPy: torch's version counter stays
    else:
        ids = torch.tensor([1, 2], device=device)

    def step() -> None:
        if kind == "optimizer_only":  # the optimizer switch asks first this time
            osw.beforeForwardPass(ids)
            local = sw.beforeForwardPass(ids)
        else:
            local = sw.beforeForwardPass(ids)
            osw.beforeForwardPass(ids)
        opt.zero_grad()
        m.u(local).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)

    step()
    if kind == "torch":
        assert isinstance(ids, torch.Tensor)
        ids.copy_(torch.tensor([5, 6]))
    else:
        buf[:] = [5, 6]
    step()
    table = sw.getNumpyVersion()
    moved = sorted(np.nonzero(table.any(axis=1))[0].tolist())
    assert moved == [1, 2, 5, 6]  # each pair updated once, in its own step
    np.testing.assert_allclose(np.abs(table[[1, 2]]), 0.1, rtol=1e-4)  # Adam's first step: lr
