"""Review (session 10, late): ae82021's padding_idx, checkpoint and waiting-lookup changes.

Each test here failed on the reviewed commit; each docstring names the defect.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl

N, D = 30, 5


def _w(seed=0):
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed))


def _off(seed=0):
    w = _w(seed)
    emb = gl.OffloadedEmbedding(
        N, D, placement="cpu", device="cpu", init=lambda t: t.copy_(w.to(t.dtype))
    )
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    return emb, opt


def _dense_step(ids, seed=0):
    """The same step on a plain full table: the rows every test expects after step()."""
    w = nn.Parameter(_w(seed))
    opt = torch.optim.SGD([w], lr=0.1)
    torch.nn.functional.embedding(ids, w).sum().backward()
    opt.step()
    return w.detach()


# ---------------------------------------------------------------------------------------
# gadget.py: _check_no_waiting_lookup
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad_write",
    [
        # wrong dtype: insertData says "checked before anything is written"
        lambda emb, tmp: emb.weight.insertData(np.zeros((1, D), np.float64), [3]),
        lambda emb, tmp: emb.weight.insertData(torch.zeros(1, D), [N]),  # id out of range
        lambda emb, tmp: emb.weight.load(tmp / "missing.npy"),  # no such file
    ],
    ids=["insert-dtype", "insert-id", "load-missing"],
)
def test_failed_write_does_not_retire_a_training_lookup(bad_write, tmp_path):
    """gadget.py:527 / :860 -- the waiting-lookup check runs before the arguments are
    checked, and its ``_blocks_load()`` retires the step's lookups that have no gradient
    yet. A write that then fails (wrong dtype, bad id, missing file) has changed nothing
    in the table, but the forward already made is now 'retired': its backward marks the
    table late and the next step() raises and drops the whole step's gradient."""
    emb, opt = _off()
    ids = torch.tensor([1, 2])
    loss = emb(ids).sum()  # a training forward, backward not run yet
    with pytest.raises(gl.GadgetError):
        bad_write(emb, tmp_path)
    loss.backward()
    opt.step()  # raised GadgetValueError("... made before a step() got (more) gradient ...")
    torch.testing.assert_close(emb.weight.as_tensor(), _dense_step(ids))


def test_write_between_forward_and_backward_is_refused_or_kept():
    """gadget.py:527 with _embedding.py:412 -- insertData of an unrelated row between a
    training forward and its backward is accepted (the lookup has no gradient yet, so it
    is silently retired), and then the ordinary backward + step() fails with the
    misleading 'made before a step()' error and the step's gradient is dropped. Either
    the write should be refused at once (as with a gradient) or the step should run."""
    emb, opt = _off()
    ids = torch.tensor([1, 2])
    loss = emb(ids).sum()
    try:
        emb.weight.insertData(torch.zeros(1, D), [3])
    except gl.GadgetValueError:
        return  # refused up front: acceptable
    loss.backward()
    opt.step()
    want = _dense_step(ids)
    want[3] = 0
    torch.testing.assert_close(emb.weight.as_tensor(), want)


def test_load_of_another_shape_into_an_embedding_table_is_refused(tmp_path):
    """gadget.py:869 (pre-existing, on the path this diff guards) -- ``emb.weight.load`` of a
    file with another row count replaces an OffloadedEmbedding's table with it: the table
    then has N+1 rows while the module says num_embeddings=N (ModelSwitch.load refuses)."""
    emb, _opt = _off()
    f = tmp_path / "other.npy"
    np.save(f, np.zeros((N + 1, D), np.float32))
    with pytest.raises(gl.GadgetError):
        emb.weight.load(f)
    assert emb.weight.shape == (N, D)


# ---------------------------------------------------------------------------------------
# _model.py: padding_idx as a global id
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("second", ["PytorchModelFactory", "ModelFactory"])
def test_padding_id_is_not_lost_by_a_forward(second):
    """_model.py:308 -- beforeForwardPass overwrites the *module's* padding_idx with a local
    row (or None), and __init__ (_model.py:143) reads that attribute as the global id. Any
    switcher built on the module later (a second table sharing the module, a switcher
    rebuilt after an error, a deepcopy / torch.save of the model) takes the last batch's
    local row -- or no padding at all -- as the padding id and freezes the wrong row."""
    emb = nn.Embedding(6, D, padding_idx=5)
    a = gl.ModelFactory(emb, N, D, placement="cpu")
    a.beforeForwardPass(torch.tensor([3, 5, 9]))  # global 5 -> local row 1
    b = getattr(gl, second)(emb, N, D, placement="cpu")
    b.normalDistributionInit(0.0, 1.0)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    before = b.getNumpyVersion().copy()
    ids = torch.tensor([1, 5])
    local = b.beforeForwardPass(ids)
    emb(local).sum().backward()
    opt.step()
    b.afterOptimizerStep(ids)
    after = b.getNumpyVersion()
    np.testing.assert_array_equal(after[5], before[5])  # the padding id: got trained
    assert not np.array_equal(after[1], before[1])  # an ordinary id: got frozen
    a.beforeForwardPass(torch.tensor([3, 9]))  # a batch without the padding id -> None
    c = getattr(gl, second)(emb, N, D, placement="cpu")
    assert c._padding_id == 5  # got None: no padding at all


# ---------------------------------------------------------------------------------------
# _checkpoint.py: optimizer-switch checkpoints with extra state tables
# ---------------------------------------------------------------------------------------
def _switch_run(opt_dtype, cls=torch.optim.SGD, **kw):
    torch.manual_seed(0)
    emb = nn.Embedding(4, D)
    model = nn.ModuleDict({"e": emb})
    sw = gl.ModelFactory(emb, N, D, placement="cpu")
    sw.normalDistributionInit(0.0, 1.0)
    opt = cls(model.parameters(), **kw)
    osw = gl.OptimizerFactory(opt, N, D, model, "e", dtype=opt_dtype, placement="cpu")
    osw.optInit()
    return model, opt, sw, osw


def _switch_step(parts, ids):
    model, opt, sw, osw = parts
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    loss = model.e(local).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)


def test_extra_state_table_keeps_the_switchers_dtype(tmp_path):
    """_checkpoint.py:591 -- a state table added on load (a scheduler's momentum) is checked
    for shape and 'floating point' only, then DataGadget.load replaces its store with the
    file's: a float64 checkpoint loaded into float32 optimizer switchers leaves a float64
    state table, where the same mismatch on a table that exists is refused (_check_table)."""
    run = _switch_run("float64", lr=0.1, momentum=0.0)
    _switch_step(run, torch.tensor([1, 2]))
    run[1].param_groups[0]["momentum"] = 0.9  # a scheduler turns momentum on
    _switch_step(run, torch.tensor([2, 3]))
    assert run[3].tables["momentum_buffer"].dtype == torch.float64
    gl.save_checkpoint(tmp_path / "ck", {"e": run[2], "eo": run[3], "opt": run[1]})
    res = _switch_run("float32", lr=0.1, momentum=0.0)
    try:
        gl.load_checkpoint(tmp_path / "ck", {"e": res[2], "eo": res[3], "opt": res[1]})
    except (gl.GadgetValueError, gl.GadgetTypeError):  # (a dtype-only mismatch: TypeError)
        assert "momentum_buffer" not in res[3].pager.tables  # refused, nothing added: fine
        return
    assert res[3].tables["momentum_buffer"].dtype == torch.float32  # got float64


def test_untagged_switcher_checkpoint_of_another_class_is_refused(tmp_path):
    """_checkpoint.py:579 (lower severity: checkpoints written before this commit) -- an
    optimizer-switch entry without the class tag is let through unchecked; the
    OffloadedOptimizer path checks such state with ``_check_untagged`` (saved scalars
    against the ones this optimizer keeps). Adam switcher state (``step`` only) thus loads
    into NAdam switchers, which go on with step=2 and a fresh ``mu_product`` of 1."""
    run = _switch_run(None, torch.optim.Adam, lr=0.01)
    _switch_step(run, torch.tensor([1, 2]))
    _switch_step(run, torch.tensor([2, 3]))
    gl.save_checkpoint(tmp_path / "ck", {"e": run[2], "eo": run[3]})
    meta = torch.load(tmp_path / "ck" / "meta.pt", weights_only=True)
    for entry in meta["objects"].values():  # as written before the tag was recorded
        if isinstance(entry["meta"], dict):
            entry["meta"].pop("optimizer", None)
            entry["meta"].pop("optimizer_base", None)
    torch.save(meta, tmp_path / "ck" / "meta.pt")
    other = _switch_run(None, torch.optim.NAdam, lr=0.01)
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(tmp_path / "ck", {"e": other[2], "eo": other[3]})
