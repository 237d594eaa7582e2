"""Session 11 fixes: which scatters get the launch shape of ascending ids, and checkpoint meta.

A row plan's write-back has distinct ascending ids (``unique=True``, ``ids_sorted=True``);
a caller's distinct ids need not ascend (``unique=True`` alone); ids with repeats are
sorted by the engine. The kernels are replaced by a recorder, so these run on any machine;
``tests/test_gpu_engine.py`` checks on a GPU that every shape moves the same rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gadgetloader as gl
from gadgetloader.stores import _base
from gadgetloader.transfer import _engine, _kernels


def _recorder(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []

    def record(table, ids, rows, pos=None, *args, **kw):
        calls.append({"ids": ids.clone(), **kw})

    monkeypatch.setattr(_kernels, "launch_scatter", record)
    monkeypatch.setattr(_engine, "cupy_available", lambda: True)
    monkeypatch.setattr(_engine, "_gpu_addressable", lambda t: True)  # CPU stand-ins
    return calls


@pytest.mark.parametrize(
    "ids,unique,ids_sorted,ordered",
    [
        ([40, 3, 17, 60], True, False, False),  # distinct, in the caller's order
        ([3, 17, 40, 60], True, True, True),  # a plan's: distinct and ascending
        ([40, 3, 17, 3, 60], False, False, True),  # repeats: the engine sorts them
    ],
)
def test_scatter_launch_shape_follows_the_ids_order(
    monkeypatch: pytest.MonkeyPatch, ids: list[int], unique: bool, ids_sorted: bool, ordered: bool
) -> None:
    calls = _recorder(monkeypatch)
    table = torch.zeros(64, 8)
    idx = torch.tensor(ids)
    _engine.scatter_many(
        [table], idx, [torch.ones(len(ids), 8)], "kernel", unique=unique, ids_sorted=ids_sorted
    )
    assert len(calls) == 1
    assert calls[0].get("ordered") is ordered
    launched = calls[0]["ids"]
    if ordered:
        assert bool((launched[1:] >= launched[:-1]).all())


def test_model_switcher_write_back_says_its_ids_ascend(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelFactory's write-back (no optimizer state: plain SGD) passes its plan's distinct
    ascending ids with ``ids_sorted=True``, and the table still equals a dense reference."""
    seen: list[dict] = []
    real = _base.Store.scatter

    def spy(self, ids, rows, strategy="auto", **kw):
        seen.append({"ids": ids.detach().cpu().clone(), **kw})
        return real(self, ids, rows, strategy, **kw)

    monkeypatch.setattr(_base.Store, "scatter", spy)
    n, d = 40, 3
    emb = nn.Embedding(1, d)
    sw = gl.ModelFactory(emb, n, d, placement="cpu")
    start = torch.randn(n, d)
    sw.customInit(lambda t: t.copy_(start.to(t.device)))
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    ids = torch.tensor([9, 2, 31, 2, 17])
    local = sw.beforeForwardPass(ids)
    opt.zero_grad()
    (emb(local) ** 2).sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    backs = [c for c in seen if c.get("unique")]
    assert backs, seen
    assert all(c.get("ids_sorted") is True for c in backs)
    assert all(bool((c["ids"][1:] > c["ids"][:-1]).all()) for c in backs)
    # the dense reference: the same loss on the full table, plain SGD
    ref = start.clone().requires_grad_(True)
    (ref[ids] ** 2).sum().backward()
    with torch.no_grad():
        ref -= 0.5 * ref.grad
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), ref.detach())


def test_checkpoint_refuses_state_it_could_not_load_before_writing(tmp_path) -> None:
    """A param-group value that a weights-only read refuses (here a function) is refused by
    save_checkpoint before any file is written; NumPy numbers are kept with their type."""
    import numpy as np

    emb = gl.OffloadedEmbedding(20, 3, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=np.float32(0.1))
    emb(torch.tensor([1, 4])).sum().backward()
    opt.step()
    opt.param_groups[0]["note"] = len  # not a tensor, number, string or container
    d = tmp_path / "ck"
    with pytest.raises(gl.GadgetTypeError, match="cannot keep"):
        gl.save_checkpoint(d, {"emb": emb, "opt": opt})
    assert not d.exists() or not any(d.iterdir())
    del opt.param_groups[0]["note"]
    gl.save_checkpoint(d, {"emb": emb, "opt": opt})
    emb2 = gl.OffloadedEmbedding(20, 3, placement="cpu", device="cpu")
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb2, lr=np.float32(0.5))
    gl.load_checkpoint(d, {"emb": emb2, "opt": opt2})
    lr = opt2.param_groups[0]["lr"]
    assert type(lr) is np.float32 and lr == np.float32(0.1)
    assert np.array_equal(emb2.table.getNumpyVersion(), emb.table.getNumpyVersion())


@pytest.mark.parametrize("make", [set, frozenset, lambda gs: {i: g for i, g in enumerate(gs)}])
def test_unordered_table_collections_are_refused(make) -> None:
    """A set (or dict) of tables has no order to pair rows with: refused, nothing written."""
    a = gl.DataGadget(torch.zeros(5, 2), placement="cpu", device="cpu")
    b = gl.DataGadget(torch.ones(5, 2), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="list"):
        gl.gather_many(make([a, b]), [1])
    with pytest.raises(gl.GadgetTypeError, match="list"):
        gl.scatter_many(make([a, b]), [torch.full((1, 2), 7.0)] * 2, [1])
    with pytest.raises(gl.GadgetTypeError, match="list"):
        gl.scatter_many([a, b], {0: torch.full((1, 2), 7.0), 1: torch.full((1, 2), 8.0)}, [1])
    assert not a.getNumpyVersion().any() and (b.getNumpyVersion() == 1).all()


def test_numpy_complex_options_round_trip_on_every_torch(tmp_path) -> None:
    """NumPy complex numbers are kept as their two parts: torch 2.4's weights-only read
    refuses a Python complex, so they must not become one."""
    import numpy as np

    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    values = [np.complex64(1.5 - 2j), np.complex128(complex(-0.0, float("inf")))]
    opt.param_groups[0]["note"] = values
    gl.save_checkpoint(tmp_path / "ck", {"emb": emb, "opt": opt})
    emb2 = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb2, lr=0.1)
    gl.load_checkpoint(tmp_path / "ck", {"emb": emb2, "opt": opt2})
    got = opt2.param_groups[0]["note"]
    assert [type(v) for v in got] == [np.complex64, np.complex128]
    for a, b in zip(got, values, strict=True):
        assert a.tobytes() == b.tobytes()  # bit-exact, the sign of -0.0 and inf included
