"""Review of session 10's library diff (4f8ac1b..HEAD): launch shapes for ascending requests,
DataGadget.requires_grad, the embedding module's zero_grad, duplicate param groups.

Every test here failed on the reviewed HEAD (cc20223); each docstring says what is wrong.
GPU launches are replaced by recorders, so the tests run on a CPU-only torch build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl
from gadgetloader.transfer import _engine, _kernels


# ---------------------------------------------------------------------------------------------
# switching/_embedding.py: the module's own zero_grad() after the optimizer merged the lookups
# ---------------------------------------------------------------------------------------------
def _after_discarded_merge(optimizer, ids_first, ids_second, **kw):
    """One real step, then a lookup whose gradient is merged (reading opt.param_groups, as
    logging the lr, GradScaler.unscale_ or clipping over the groups does) and then thrown away
    with emb.zero_grad(); returns (emb, opt, table before the discarded step, step before)."""
    emb = gl.OffloadedEmbedding(10, 2, placement="cpu", device="cpu", init=nn.init.zeros_)
    opt = gl.OffloadedOptimizer(optimizer, emb, lr=1.0, **kw)
    emb(torch.tensor(ids_first)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = emb.weight.getNumpyVersion().copy()
    step = opt.inner.state.get(emb._slot.param, {}).get("step")
    step = None if step is None else float(step)
    emb(torch.tensor(ids_second)).sum().backward()
    _ = opt.param_groups[0]["lr"]  # merges the lookups into the per-step parameter
    emb.zero_grad()  # README: throws away the gradients of the lookups since the last step
    return emb, opt, before, step


def test_module_zero_grad_after_merge_then_step_does_not_raise():
    """_embedding.py:226 ``_OffloadedTable.zero_grad`` clears the lookups' gradients but not the
    per-step parameter's ``.grad`` (set by the merge) nor the optimizer's ``_prepared``; the
    next ``step()`` finds no lookup gradient (plan None, nothing paged in) yet runs the inner
    optimizer on the stale ``_slot.param.grad`` against the previous step's state rows:
    RuntimeError (shape [1, 2] vs [2, 2]). OffloadedOptimizer.zero_grad clears both."""
    emb, opt, before, _ = _after_discarded_merge(torch.optim.SGD, [1, 2], [5], momentum=0.9)
    opt.step()  # raised RuntimeError on the reviewed HEAD
    assert (emb.weight.getNumpyVersion() == before).all()


def test_module_zero_grad_after_merge_does_not_count_an_adam_step():
    """Same defect with equal row counts: no error, but Adam's step count for the table moves
    (1 -> 2) for a gradient the user discarded, so every later bias correction is off (and the
    inner optimizer updates the previous step's state rows in memory)."""
    emb, opt, before, step = _after_discarded_merge(torch.optim.Adam, [1, 2], [5, 6])
    opt.step()
    assert (emb.weight.getNumpyVersion() == before).all()
    assert float(opt.inner.state[emb._slot.param]["step"]) == step  # was 2.0 against 1.0


# ---------------------------------------------------------------------------------------------
# gadget.py: DataGadget.requires_grad depends on who last read ``.weight``
# ---------------------------------------------------------------------------------------------
def test_table_requires_grad_does_not_depend_on_weight_having_been_read():
    """gadget.py:602 / _embedding.py:223: the owner is recorded only inside the ``weight``
    getter, so the module's own table (``emb.table``, the same object ``emb.weight`` returns,
    and what a pickled / deep-copied module comes back with) answers False and refuses the
    setter until someone has read ``emb.weight`` once; afterwards it answers True."""
    emb = gl.OffloadedEmbedding(10, 2, placement="cpu", device="cpu")
    assert emb.table is emb.__dict__["table"]
    assert emb.table.requires_grad is True  # False on the reviewed HEAD
    emb.table.requires_grad = False  # GadgetTypeError on the reviewed HEAD
    assert emb._frozen


def test_weight_requires_grad_freezes_its_own_module_when_a_gadget_is_shared():
    """The owner is *the module whose ``.weight`` was read last*: with one gadget in two modules
    (``b.table = a.table``), ``w = a.weight`` followed by any read of ``b.weight`` makes
    ``w.requires_grad = False`` freeze b and leave a training."""
    a = gl.OffloadedEmbedding(10, 2, placement="cpu", device="cpu")
    b = gl.OffloadedEmbedding(10, 2, placement="cpu", device="cpu")
    b.table = a.table
    w = a.weight
    _ = b.weight
    w.requires_grad = False
    assert a._frozen and not b._frozen  # (False, True) on the reviewed HEAD


# ---------------------------------------------------------------------------------------------
# transfer/_engine.py: which launches get ordered=True
# ---------------------------------------------------------------------------------------------
def _recorder(monkeypatch: pytest.MonkeyPatch, name: str) -> list[dict]:
    calls: list[dict] = []

    def record(table, ids, buf, pos=None, *args, **kw):
        calls.append({"ids": ids.clone(), **kw})

    monkeypatch.setattr(_kernels, name, record)
    monkeypatch.setattr(_engine, "cupy_available", lambda: True)
    monkeypatch.setattr(_engine, "_gpu_addressable", lambda t: True)  # CPU stand-ins
    return calls


def test_hybrid_scatter_gpu_share_of_sorted_ids_is_launched_ordered(monkeypatch):
    """_engine.py:551 ``_hybrid_scatter`` launches its GPU share with the default shape although
    a scatter with repeats reaches it with ids the engine itself sorted (``sorted_ids[sel]``,
    ascending): DESIGN's rule ("the hybrid GPU share and sorted scatters") misses it. A
    ``unique=True`` caller's ids need not ascend, so the flag must come from scatter_many."""
    calls = _recorder(monkeypatch, "launch_scatter")
    monkeypatch.setitem(_engine._hybrid, "fraction", 0.0)  # all of it on the GPU share
    table = torch.zeros(64, 8)
    ids = torch.tensor([40, 3, 17, 3, 60])
    _engine.scatter_many([table], ids, [torch.ones(5, 8)], "hybrid", [table], unique=False)
    assert len(calls) == 1
    assert bool((calls[0]["ids"][1:] > calls[0]["ids"][:-1]).all())  # ascending, distinct
    assert calls[0].get("ordered") is True  # not passed on the reviewed HEAD


def test_count_gather_with_sorted_strategy_and_unsorted_ids_is_not_ordered(monkeypatch):
    """_engine.py:330-337: with ``count`` the ``sorted`` strategy launches the ids as given (no
    sort) but passes ``ordered = how == "sorted" or ids_sorted``: unsorted ids get the
    ascending launch shape. Latent: the library's callers pass ``count`` only with plan ids
    (``ids_sorted=True``); gather_many's docstring asks for that but does not enforce it."""
    calls = _recorder(monkeypatch, "launch_gather")
    table = torch.zeros(64, 8)
    ids = torch.tensor([40, 3, 17, 60])
    out = torch.empty(4, 8)
    _engine._run_gather("sorted", [table], [None], ids, [out], False, torch.tensor([4]))
    assert torch.equal(calls[0]["ids"], ids)  # launched unsorted
    assert calls[0].get("ordered") is False  # True on the reviewed HEAD


# ---------------------------------------------------------------------------------------------
# gadget.py: insertData messages
# ---------------------------------------------------------------------------------------------
def test_insert_numpy_scalar_of_other_dtype_message_fits_numpy():
    """gadget.py:536: the new NumPy message covers ``np.ndarray`` only; a NumPy scalar (or a
    list) of another dtype still gets "convert it with .to(torch.float32)", a method NumPy
    scalars and lists do not have."""
    g = gl.DataGadget(shape=(4,), dtype="float32", placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError) as err:
        g.insertData(np.float64(3.0), 1)
    assert ".to(" not in str(err.value)
