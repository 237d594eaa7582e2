"""Cases found by session 8's independent reviews: each failed before its fix.

References are plain torch / NumPy: a dense ``nn.Embedding`` trained by the same optimizer
on the same ids, or the array the table was built from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl

# ---- switchers ---------------------------------------------------------------------------


def _switchers(rows=20, dim=3, optimizer=torch.optim.Adam, **kw):
    m = nn.Module()
    m.u = nn.Embedding(2, dim)
    opt = optimizer(m.parameters(), lr=0.1, **kw)
    s = gl.ModelFactory(m.u, rows, dim, placement="cpu")
    s.uniformDistributionInit(-1, 1)
    o = gl.OptimizerFactory(opt, rows, dim, m, "u", placement="cpu")
    o.optInit()
    return m, opt, s, o


def test_optimizer_switch_refuses_other_ids_after_step_and_writes_nothing():
    m, opt, s, o = _switchers()
    ids = torch.tensor([4, 5])
    local = s.beforeForwardPass(ids)
    o.beforeForwardPass(ids)
    opt.zero_grad()
    m.u(local).sum().backward()
    opt.step()
    before = {k: v.copy() for k, v in o.getNumpyVersion().items()}
    with pytest.raises(gl.GadgetValueError, match="other than those"):
        o.afterOptimizerStep(torch.tensor([6, 7]))
    after = o.getNumpyVersion()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    # the right ids still store the step's state on the rows it was read from
    s.afterOptimizerStep(ids)
    o.afterOptimizerStep(ids)
    ea = o.getNumpyVersion()["exp_avg"]
    assert np.abs(ea[4:6]).sum() > 0 and np.abs(ea[6:8]).sum() == 0


def test_optimizer_switch_refuses_ids_other_than_the_model_switchers():
    m, opt, s, o = _switchers()
    s.beforeForwardPass(torch.tensor([1, 2]))
    o.beforeForwardPass(torch.tensor([3, 9]))  # either order is allowed: checked at the end
    opt.zero_grad()
    m.u(torch.tensor([0, 1])).sum().backward()
    opt.step()
    with pytest.raises(gl.GadgetValueError, match="model switcher"):
        o.afterOptimizerStep(torch.tensor([3, 9]))


def test_switcher_batches_may_grow_while_the_last_loss_is_alive():
    """An ordinary loop keeps the last ``loss`` (and its graph) until the next is built:
    a batch with more positions than any before must still train (exactly, SGD)."""
    rows, dim = 30, 4
    e = nn.Embedding(1, dim)
    opt = torch.optim.SGD(e.parameters(), lr=0.1)
    s = gl.ModelFactory(e, rows, dim, placement="cpu")
    w0 = torch.randn(rows, dim)
    s.table.insertData(w0, torch.arange(rows))
    ref = nn.Embedding(rows, dim)
    with torch.no_grad():
        ref.weight.copy_(w0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    loss = ref_loss = None
    for n in (2, 5, 3, 9, 9, 1, 12):
        ids = torch.randint(0, rows, (n,), generator=g)
        local = s.beforeForwardPass(ids)
        loss = e(local).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        s.afterOptimizerStep(ids)
        ref_loss = ref(ids).pow(2).sum()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss.detach(), ref_loss.detach())
    torch.testing.assert_close(s.table.getData(torch.arange(rows)), ref.weight.detach())


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool", "uint8"])
def test_model_factory_refuses_a_table_that_cannot_train(dtype):
    with pytest.raises(gl.GadgetTypeError, match="floating point"):
        gl.ModelFactory(nn.Embedding(2, 3), 10, 3, dtype, placement="cpu")


def test_save_torch_into_a_missing_folder_is_a_gadget_error(tmp_path):
    s = gl.ModelFactory(nn.Embedding(2, 3), 10, 3, placement="cpu")
    with pytest.raises(gl.GadgetFileNotFoundError, match="does not exist"):
        s.saveTorch(str(tmp_path / "nodir" / "x.pt"))
    assert not (tmp_path / "nodir").exists()


def test_initialisers_refuse_bad_arguments_and_leave_the_table():
    s = gl.ModelFactory(nn.Embedding(2, 3), 10, 3, placement="cpu")
    s.uniformDistributionInit(-1, 1)
    before = s.table.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError, match="low <= high"):
        s.uniformDistributionInit(1, -1)
    with pytest.raises(gl.GadgetValueError, match="std >= 0"):
        s.normalDistributionInit(0, -1)
    with pytest.raises(gl.GadgetValueError, match="std >= 0"):
        s.table.normal_(0.0, float("nan"))
    np.testing.assert_array_equal(s.table.getNumpyVersion(), before)


# ---- files -------------------------------------------------------------------------------


def test_file_table_of_scalars_gives_one_value_for_one_id(tmp_path):
    path = tmp_path / "labels.npy"
    np.save(path, np.arange(5, dtype=np.float32))
    g = gl.DataGadget(str(path), placement="file")
    for i in (3, np.int64(3), torch.tensor(3)):
        got = g.getData(i)
        assert got.shape == () and float(got) == 3.0
    assert float(g[4]) == 4.0
    g.close()
