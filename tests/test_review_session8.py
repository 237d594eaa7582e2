"""Cases found by session 8's independent reviews: each failed before its fix.

References are plain torch / NumPy: a dense ``nn.Embedding`` trained by the same optimizer
on the same ids, or the array the table was built from.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings

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


# ---- drop-in module: checkpoints, copies, param groups --------------------------------------


def _model(cls, seed=0):
    torch.manual_seed(seed)
    m = nn.ModuleDict(
        {
            "emb": gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu"),
            "head": nn.Linear(3, 1),
        }
    )
    return m, gl.OffloadedOptimizer(cls, m, lr=0.01)


def _train(m, o, ids=(1, 2, 2)):
    o.zero_grad()
    m["head"](m["emb"](torch.tensor(ids))).sum().backward()
    o.step()


def _snapshot(m, o):
    return (
        m["emb"].table.getNumpyVersion().copy(),
        m["head"].weight.detach().clone(),
        {k: t.getNumpyVersion().copy() for k, t in o.pagers[0].tables.items()},
        copy.deepcopy(o.inner.state_dict()),
    )


def _assert_same(a, b):
    np.testing.assert_array_equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        np.testing.assert_array_equal(a[2][k], b[2][k])
    assert repr(a[3]) == repr(b[3])


@pytest.mark.parametrize("other", [torch.optim.NAdam, torch.optim.RAdam, torch.optim.AdamW])
def test_state_of_another_optimizer_class_is_refused_before_anything_changes(tmp_path, other):
    src, so = _model(torch.optim.Adam)
    _train(src, so)
    _train(src, so)
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": src, "optimizer": so})
    m, o = _model(other, seed=1)
    _train(m, o)
    before = _snapshot(m, o)
    with pytest.raises(gl.GadgetValueError, match="Adam optimizer; this optimizer is a"):
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": m, "optimizer": o})
    _assert_same(_snapshot(m, o), before)
    with pytest.raises(gl.GadgetValueError, match="Adam optimizer; this optimizer is a"):
        o.load_state_dict(so.state_dict())
    _assert_same(_snapshot(m, o), before)
    _train(m, o)  # still trains


def test_a_failing_inner_load_puts_the_optimizer_back():
    """A state dict without the class tag (as saved before it existed) that torch cannot
    load part-way (Adam's state into NAdam) leaves the optimizer as it was, usable."""
    src, so = _model(torch.optim.Adam)
    _train(src, so)
    sd = so.state_dict()
    del sd["optimizer"]
    # the table's own entry (its scalars: 'step') is checked before torch's load; without
    # it, torch's load fails on the head's state part-way
    sd["inner"]["state"] = {k: v for k, v in sd["inner"]["state"].items() if set(v) != {"step"}}
    m, o = _model(torch.optim.NAdam, seed=1)
    _train(m, o)
    before = _snapshot(m, o)
    with pytest.raises(gl.GadgetValueError, match="does not fit"):
        o.load_state_dict(sd)
    _assert_same(_snapshot(m, o), before)
    _train(m, o)


def test_model_with_an_optimizer_pickles_and_copies_without_its_state():
    emb = gl.OffloadedEmbedding(1000, 8, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)
    opt.zero_grad()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    rows = emb.table.getData(torch.arange(1000))
    for copied in (
        pickle.loads(pickle.dumps(emb)),
        copy.deepcopy(emb),
        _torch_roundtrip(emb),
    ):
        assert copied._state_pager is None and not copied._attached
        assert torch.equal(copied.table.getData(torch.arange(1000)), rows)
        # the copy takes a new optimizer and trains; the original is untouched
        o2 = gl.OffloadedOptimizer(torch.optim.SGD, copied, lr=1.0)
        o2.zero_grad()
        copied(torch.tensor([3])).sum().backward()
        o2.step()
        assert torch.equal(copied.table.getData(torch.tensor([3]))[0], rows[3] - 1.0)
        assert torch.equal(emb.table.getData(torch.arange(1000)), rows)


def _torch_roundtrip(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_add_param_group_takes_offloaded_tables_like_torch_takes_parameters():
    torch.manual_seed(0)
    e1 = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu")
    e2 = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu")
    r1, r2 = nn.Embedding(10, 3), nn.Embedding(12, 3)
    with torch.no_grad():
        r1.weight.copy_(e1.table.getData(torch.arange(10)))
        r2.weight.copy_(e2.table.getData(torch.arange(12)))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, e1, lr=0.01)
    ref = torch.optim.Adam(r1.parameters(), lr=0.01)
    a, b = torch.arange(10), torch.arange(12)  # every row each step: lazy == dense
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": e2, "lr": 0.1})
            ref.add_param_group({"params": r2.parameters(), "lr": 0.1})
        loss = e1(a).pow(2).sum() + (e2(b).pow(2).sum() if step >= 2 else 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rl = r1(a).pow(2).sum() + (r2(b).pow(2).sum() if step >= 2 else 0)
        ref.zero_grad()
        rl.backward()
        ref.step()
    torch.testing.assert_close(e1.table.getData(a), r1.weight.detach(), rtol=0, atol=1e-7)
    torch.testing.assert_close(e2.table.getData(b), r2.weight.detach(), rtol=0, atol=1e-7)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.1]
    with pytest.raises(gl.GadgetValueError, match="already belongs"):
        opt.add_param_group({"params": e2})
    with pytest.raises(gl.GadgetTypeError, match="dict"):
        opt.add_param_group([e2])


# ---- files: ranges, permissions, interrupts --------------------------------------------------


def test_empty_and_huge_ranges_and_slices_follow_python():
    g = gl.DataGadget(np.arange(20, dtype=np.float32).reshape(10, 2), placement="cpu")
    assert g.getData(range(5, 2)).shape == (0, 2)
    g.insertData(np.zeros((0, 2), np.float32), range(5, 2))  # nothing to write
    ds = gl.GadgetDataset(np.zeros((10, 2), np.float32), np.arange(10))
    for sl in (slice(5, 2), slice(3, 1, 1), slice(0, 10, -1)):
        x, y = ds[sl]
        assert x.shape == (0, 2) and y.shape == (0,)
    x, y = ds[8:2:-3]
    assert y.tolist() == [8, 5]
    for bad in (range(2**63 - 1, 2**63 + 1), range(-(2**70), -(2**70) + 2), range(3, -2, -1)):
        with pytest.raises(gl.GadgetIndexError):
            g.getData(bad)
    np.testing.assert_array_equal(
        g.getNumpyVersion(), np.arange(20, dtype=np.float32).reshape(10, 2)
    )


def test_a_range_far_past_the_table_is_refused_before_it_is_built(monkeypatch):
    g = gl.DataGadget(np.zeros((10, 2), np.float32), placement="cpu")
    import gadgetloader._ids as ids_mod

    def no_arange(*a, **k):
        raise AssertionError("the range was built before its check")

    monkeypatch.setattr(ids_mod.torch, "arange", no_arange)
    with pytest.raises(gl.GadgetIndexError, match="out of range"):
        g.getData(range(0, 2 * 10**8))


def test_int_index_out_of_range_names_pythons_bounds():
    ds = gl.GadgetDataset(np.zeros((103, 2), np.float32))
    with pytest.raises(gl.GadgetIndexError, match=r"\[-103, 102\]"):
        ds[-104]
    with pytest.raises(gl.GadgetIndexError, match=r"\[-103, 102\]"):
        ds[103]
    assert ds[-103][0].shape == (2,)


@pytest.mark.parametrize("ext", ["npy", "h5"])
def test_an_unreadable_file_is_reported_as_such(tmp_path, monkeypatch, ext):
    if ext == "h5":
        pytest.importorskip("h5py")
    path = tmp_path / f"a.{ext}"
    gl.DataGadget(np.ones((4, 2), np.float32), placement="cpu").save(str(path))
    import builtins

    import gadgetloader.io._hdf5 as h5mod
    import gadgetloader.io._npy as npymod

    real_open = builtins.open

    def denied(p, *a, **k):
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *a, **k)

    for mod in (h5mod, npymod):
        monkeypatch.setattr(mod, "open", denied, raising=False)
    with pytest.raises(gl.GadgetFileError, match="permission denied"):
        gl.DataGadget(str(path), placement="cpu")


def test_saving_into_an_unwritable_folder_is_refused_before_writing(tmp_path, monkeypatch):
    import gadgetloader.io._chunks as chunks

    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access

    def access(p, mode, *a, **k):
        if os.fspath(p) == os.fspath(folder) and mode & os.W_OK:
            return False
        return real_access(p, mode, *a, **k)

    monkeypatch.setattr(chunks.os, "access", access)
    g = gl.DataGadget(np.ones((4, 2), np.float32), placement="cpu")
    for name in ("x.npy", "x.h5", "x.zarr"):
        with pytest.raises(gl.ReadOnlyError, match="not writable") as info:
            g.save(str(folder / name))
        assert isinstance(info.value, PermissionError)
    assert list(folder.iterdir()) == []


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals: main thread"
)
def test_ctrl_c_during_the_commit_is_raised_after_the_file_is_in_place(tmp_path, monkeypatch):
    import gadgetloader.io._npy as npymod

    path = tmp_path / "t.npy"
    np.save(path, np.zeros((6, 2), np.float32))
    real_commit = npymod.NpySink.commit

    def commit(self):
        os.kill(os.getpid(), signal.SIGINT)  # held by the save
        real_commit(self)

    monkeypatch.setattr(npymod.NpySink, "commit", commit)
    new = np.arange(12, dtype=np.float32).reshape(6, 2)
    with pytest.raises(KeyboardInterrupt, match="was written"):
        gl.DataGadget(new, placement="cpu").save(str(path))
    np.testing.assert_array_equal(np.load(path), new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npy"]


def test_hdf5_datasets_behind_external_links_are_listed(tmp_path):
    h5py = pytest.importorskip("h5py")
    target = tmp_path / "target.h5"
    with h5py.File(target, "w") as f:
        f.create_dataset("data", data=np.arange(40, dtype=np.float32).reshape(20, 2))
    only = tmp_path / "onlyext.h5"
    with h5py.File(only, "w") as f:
        f["ext"] = h5py.ExternalLink(str(target), "/data")
    g = gl.DataGadget(str(only), placement="cpu")  # its one dataset: no dataset= needed
    np.testing.assert_array_equal(g.getData([3]).cpu().numpy(), [[6.0, 7.0]])
    mixed = tmp_path / "mixed.h5"
    with h5py.File(mixed, "w") as f:
        f["ext"] = h5py.ExternalLink(str(target), "/data")
        f.create_dataset("local", data=np.ones((20, 2), np.float32))
    with pytest.raises(gl.GadgetKeyError, match=r"2 datasets: \['local', 'ext'\]"):
        gl.DataGadget(str(mixed), placement="cpu")  # two arrays: no silent choice
    dangling = tmp_path / "dangling.h5"
    with h5py.File(dangling, "w") as f:
        f["ext"] = h5py.ExternalLink(str(tmp_path / "nowhere.h5"), "/data")
    with pytest.raises(gl.GadgetFileError, match="external link to .*nowhere.h5"):
        gl.DataGadget(str(dangling), dataset="ext", placement="cpu")


def test_cli_json_checks_an_existing_file_and_names_each_suite(tmp_path, monkeypatch, capsys):
    from gadgetloader import cli

    ro = tmp_path / "ro.json"
    ro.write_text("{}")
    real_access = os.access
    monkeypatch.setattr(
        cli.os,
        "access",
        lambda p, mode, *a, **k: (
            False if os.fspath(p) == str(ro) and mode & os.W_OK else real_access(p, mode, *a, **k)
        ),
    )
    with pytest.raises(SystemExit) as info:
        cli.main(["info", "--no-measure", "--json", str(ro)])
    assert info.value.code == 2
    assert "not writable" in capsys.readouterr().err and ro.read_text() == "{}"
    with pytest.raises(SystemExit):
        cli.main(["bench", "seed", "--rows", "0"])
    err = capsys.readouterr().err
    assert err.startswith("usage: gadgetloader bench seed ") and "options of that suite" not in err


def test_cli_json_write_failure_after_the_run_is_one_line(tmp_path, monkeypatch, capsys):
    from gadgetloader import cli

    out = tmp_path / "x.json"
    real_open = open

    def failing(p, *a, **k):  # (the JSON is written beside, as .x.json.partial-..., then renamed)
        if os.fspath(p) == str(out) or os.path.basename(os.fspath(p)).startswith(".x.json."):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr(cli, "open", failing, raising=False)
    assert cli.main(["info", "--no-measure", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "--json" in err and "Permission denied" in err and "Traceback" not in err


# ---- second round: what the first fixes missed ------------------------------------------------


def test_unwritable_check_looks_at_the_folder_a_link_writes_into(tmp_path, monkeypatch):
    import gadgetloader.io._chunks as chunks

    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    real_access = os.access

    def access(p, mode, *a, **k):
        if os.path.realpath(p) == os.path.realpath(ro) and mode & os.W_OK:
            return False
        return real_access(p, mode, *a, **k)

    monkeypatch.setattr(chunks.os, "access", access)
    g = gl.DataGadget(np.arange(8, dtype=np.float32).reshape(4, 2), placement="cpu")
    (ro / "link.npy").symlink_to(rw / "real.npy")  # a link in the read-only folder ...
    g.save(str(ro / "link.npy"))  # ... writes the writable one
    np.testing.assert_array_equal(np.load(rw / "real.npy"), g.getNumpyVersion())
    (rw / "link2.npy").symlink_to(ro / "real2.npy")  # the other way round: refused
    with pytest.raises(gl.ReadOnlyError, match="not writable"):
        g.save(str(rw / "link2.npy"))
    assert sorted(p.name for p in ro.iterdir()) == ["link.npy"]


def test_an_unreadable_file_without_a_known_extension(tmp_path, monkeypatch):
    path = tmp_path / "u.bin"
    np.save(tmp_path / "u.npy", np.ones((3, 2), np.float32))
    os.replace(tmp_path / "u.npy", path)
    import builtins

    import gadgetloader.io._hdf5 as h5mod
    import gadgetloader.io._npy as npymod

    real_open = builtins.open

    def denied(p, *a, **k):
        if os.fspath(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *a, **k)

    for mod in (h5mod, npymod):
        monkeypatch.setattr(mod, "open", denied, raising=False)
    with pytest.raises(gl.GadgetFileError, match="permission denied"):
        gl.DataGadget(str(path), placement="cpu")


def test_a_failed_add_param_group_leaves_nothing_behind():
    a = gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")
    b = gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.1)
    with pytest.raises((gl.GadgetError, ValueError)):
        opt.add_param_group({"params": b, "lr": 0.1, "betas": (2.0, 0.9)})
    assert len(opt.param_groups) == 1 and len(opt.tables) == 1 and not b._attached
    opt.add_param_group({"params": b, "lr": 0.1})  # the corrected call works
    before = b.table.getData(torch.arange(20))
    opt.zero_grad()
    b(torch.tensor([3])).sum().backward()
    opt.step()
    assert not torch.equal(b.table.getData(torch.tensor([3]))[0], before[3])


def test_hdf5_datasets_under_externally_linked_groups_are_listed(tmp_path):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.create_group("grp")["y"] = np.ones((4, 3), np.float32)
        f["back"] = h5py.ExternalLink(str(tmp_path / "main.h5"), "/")  # a cycle
    with h5py.File(tmp_path / "main.h5", "w") as f:
        f["a"] = np.zeros((4, 3), np.float32)
        f["linked"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/grp")
    with pytest.raises(gl.GadgetKeyError, match=r"\['a', 'linked/y'\]"):
        gl.DataGadget(str(tmp_path / "main.h5"), placement="cpu")
    g = gl.DataGadget(str(tmp_path / "main.h5"), dataset="linked/y", placement="cpu")
    assert float(g.getData([1]).sum()) == 3.0


def test_untagged_state_of_another_class_is_still_refused_before_anything_changes(tmp_path):
    """Checkpoints and state dicts saved before the class was recorded: NAdam's load of
    Adam's state would fail part-way, after the model was loaded."""
    src, so = _model(torch.optim.Adam)
    _train(src, so)
    d = tmp_path / "ck"
    gl.save_checkpoint(str(d), {"model": src, "optimizer": so})
    meta = torch.load(d / "meta.pt", weights_only=True)
    del meta["objects"]["optimizer"]["meta"]["optimizer"]
    torch.save(meta, d / "meta.pt")
    m, o = _model(torch.optim.NAdam, seed=1)
    _train(m, o)
    before = _snapshot(m, o)
    with pytest.raises(gl.GadgetValueError, match="mu_product"):
        gl.load_checkpoint(str(d), {"model": m, "optimizer": o})
    _assert_same(_snapshot(m, o), before)
    sd = so.state_dict()
    del sd["optimizer"]
    with pytest.raises(gl.GadgetValueError, match="mu_product"):
        o.load_state_dict(sd)
    _assert_same(_snapshot(m, o), before)
    # untagged state of the same class still loads
    m2, o2 = _model(torch.optim.Adam, seed=2)
    o2.load_state_dict(sd)
    gl.load_checkpoint(str(d), {"model": m2, "optimizer": o2})
    np.testing.assert_array_equal(
        m2["emb"].table.getNumpyVersion(), src["emb"].table.getNumpyVersion()
    )


def test_the_class_tag_follows_the_class_name_not_its_module():
    src, so = _model(torch.optim.Adam)
    _train(src, so)
    sd = so.state_dict()
    sd["optimizer"] = "__main__.Adam"  # saved by a script whose class moved to a module
    m, o = _model(torch.optim.Adam, seed=1)
    o.load_state_dict(sd)
    sd["optimizer"] = "__main__.NAdam"
    with pytest.raises(gl.GadgetValueError, match="NAdam optimizer; this optimizer"):
        o.load_state_dict(sd)


def test_ranges_with_huge_steps_give_their_one_row():
    g = gl.DataGadget(np.arange(10, dtype=np.float32), placement="cpu")
    assert g.getData(range(0, 1, 2**64)).tolist() == [0.0]
    assert g.getData(range(9, 2**63 + 5, 2**63)).tolist() == [9.0]
    ds = gl.GadgetDataset(np.arange(10, dtype=np.float32))
    assert ds[:: 2**64][0].tolist() == [0.0] and ds[:: -(2**64)][0].tolist() == [9.0]


# ---- rows API and pipeline (third and fourth reviews) ---------------------------------------


def test_options_only_a_file_takes_are_refused_for_arrays_and_shapes():
    a = np.zeros((4, 2), np.float32)
    with pytest.raises(gl.GadgetTypeError, match="writable"):
        gl.DataGadget(a, writable=False, placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="plcement"):
        gl.DataGadget(a, plcement="file")
    with pytest.raises(gl.GadgetValueError, match="dataset="):
        gl.DataGadget(a, dataset="emb", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="format="):
        gl.DataGadget((3, 2), format="zarr", placement="cpu")


@pytest.mark.parametrize("shape", ["12", (2.9, 3), (True, 3), 5])
def test_the_shape_keyword_is_checked_like_a_shape_argument(shape):
    with pytest.raises(gl.GadgetTypeError, match="shape"):
        gl.DataGadget(shape=shape, placement="cpu")
    if isinstance(shape, tuple):
        with pytest.raises(gl.GadgetTypeError, match="shape"):
            gl.DataGadget.zeros(shape, placement="cpu")
    assert gl.DataGadget(shape=[2, 3], placement="cpu").shape == (2, 3)


@pytest.mark.parametrize("bad", [2**70, np.uint64(2**63), -(2**70)])
def test_a_scalar_id_beyond_int64_is_an_index_error(bad):
    g = gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetIndexError):
        g.getData(bad)
    with pytest.raises(gl.GadgetIndexError):
        g[bad] = torch.zeros(2)


def test_ml_dtypes_bfloat16_arrays_are_tables():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = np.array([[1.5, 2.0], [-3.0, 0.25]], dtype=ml_dtypes.bfloat16)
    g = gl.DataGadget(b, placement="cpu")
    assert g.dtype == torch.bfloat16
    assert g.getData([0, 1]).float().tolist() == [[1.5, 2.0], [-3.0, 0.25]]
    h = gl.DataGadget((2, 2), dtype="bfloat16", placement="cpu")
    h.insertData(b[::-1].copy(), [0, 1])
    assert h.getData([1]).float().tolist() == [[1.5, 2.0]]


def test_placement_names_are_case_insensitive_from_a_path(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(6, dtype=np.float32).reshape(3, 2))
    g = gl.DataGadget(str(path), placement="FILE", cache_bytes=1 << 20)
    assert g.placement == "file" and g.getData([2]).tolist() == [[4.0, 5.0]]
    g.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback of a CUDA index")
def test_a_cuda_index_falls_back_to_the_cpu_like_cuda_n():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)  # once per process
        g = gl.DataGadget(np.zeros((2, 2), np.float32), device=0, placement="cpu")
    assert g.device == torch.device("cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.zeros((2, 2), np.float32), device=-1, placement="cpu")


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_random_fills_need_a_float_table(dtype):
    g = gl.DataGadget((2, 2), dtype=dtype, placement="cpu")
    for fill in (g.normal_, g.uniform_):
        with pytest.raises(gl.GadgetTypeError, match="floating-point"):
            fill()
    assert not g.getNumpyVersion().any()


def test_zero_row_tables_say_so(tmp_path):
    z = gl.DataGadget((0, 4), placement="cpu")
    with pytest.raises(gl.GadgetIndexError, match="no rows"):
        z.getData([0])
    with pytest.raises(gl.GadgetValueError, match="zero rows"):
        z.save(str(tmp_path / "z.npy"))
    assert not (tmp_path / "z.npy").exists()


def test_loader_state_follows_the_sampler_moved_after_an_early_break():
    ds = gl.GadgetDataset(np.arange(40, dtype=np.float32))
    sampler = gl.GadgetSampler(ds, batch_size=4, seed=3)
    loader = gl.GadgetLoader(ds, sampler=sampler)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    sampler.set_epoch(1)  # a DistributedSampler-style loop
    state = loader.state_dict()
    assert state["sampler"] == sampler.state_dict()
    assert state["sampler"]["epoch"] == 1 and state["sampler"]["position"] == 0
    whole = [b[0].tolist() for b in loader]
    resumed = gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4, seed=3))
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == whole


def test_sampler_flags_must_be_bools_and_bad_states_say_what_is_missing():
    with pytest.raises(gl.GadgetTypeError, match="drop_last"):
        gl.GadgetSampler(10, batch_size=2, drop_last="no")
    with pytest.raises(gl.GadgetTypeError, match="pad"):
        gl.GadgetSampler(10, batch_size=2, pad=1)
    s = gl.GadgetSampler(10, batch_size=2)
    with pytest.raises(gl.GadgetValueError, match="without 'position'"):
        s.load_state_dict({"epoch": 1})


# ---- fifth review: what the fourth round's fixes missed -------------------------------------


def test_naming_a_dataset_does_not_list_the_file(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    import gadgetloader.io._hdf5 as h5mod

    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        f["local"] = np.ones((3, 2), np.float32)
        f["other"] = np.zeros((3, 2), np.float32)

    def no_listing(*a, **k):
        raise AssertionError("the file was listed although dataset= named the array")

    monkeypatch.setattr(h5mod, "_datasets_in", no_listing)
    assert gl.DataGadget(str(path), dataset="local", placement="cpu").shape == (3, 2)


def test_aliases_through_external_links_are_listed_once(tmp_path):
    h5py = pytest.importorskip("h5py")
    own = tmp_path / "self.h5"
    with h5py.File(own, "w") as f:
        f.create_dataset("data/emb", data=np.ones((3, 2), np.float32))
        f["alias"] = h5py.ExternalLink(str(own), "/data")
    assert gl.DataGadget(str(own), placement="cpu").shape == (3, 2)  # one dataset
    with h5py.File(tmp_path / "shared.h5", "w") as f:
        f.create_dataset("g/x", data=np.ones((4, 2), np.float32))
    two = tmp_path / "two.h5"
    with h5py.File(two, "w") as f:
        f["a"] = h5py.ExternalLink(str(tmp_path / "shared.h5"), "/g")
        f["b"] = h5py.ExternalLink(str(tmp_path / "shared.h5"), "/g")
    assert gl.DataGadget(str(two), placement="cpu").shape == (4, 2)
    assert gl.DataGadget(str(two), dataset="b/x", placement="cpu").shape == (4, 2)


class Adam(torch.optim.NAdam):
    """Named like torch's Adam, but NAdam underneath."""


def test_a_same_named_class_of_another_optimizer_is_refused(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    o = torch.optim.Adam(lin.parameters(), lr=0.1)
    lin(torch.ones(2, 3)).sum().backward()
    o.step()
    gl.save_checkpoint(str(tmp_path / "ck"), {"m": lin, "o": o})
    lin2 = nn.Linear(3, 1)
    w = lin2.weight.detach().clone()
    o2 = Adam(lin2.parameters(), lr=0.1)
    with pytest.raises(gl.GadgetValueError, match="torch.optim.adam.Adam optimizer"):
        gl.load_checkpoint(str(tmp_path / "ck"), {"m": lin2, "o": o2})
    assert torch.equal(lin2.weight, w)


def test_a_link_into_a_missing_folder_is_not_found(tmp_path):
    link = tmp_path / "dangling.npy"
    link.symlink_to(tmp_path / "nodir" / "x.npy")
    with pytest.raises(gl.GadgetFileNotFoundError, match="does not exist"):
        gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu").save(str(link))


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), 1.0])
def test_device_bools_and_floats_are_type_errors(bad):
    with pytest.raises(gl.GadgetTypeError, match="device"):
        gl.DataGadget((2, 2), placement="cpu", device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback of a CUDA index")
def test_a_numpy_cuda_index_is_a_cuda_index():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        assert gl.DataGadget((2, 2), placement="cpu", device=np.int64(0)).device.type == "cpu"


def test_ranges_longer_than_sys_maxsize_are_index_errors():
    g = gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu")
    for r in (range(0, 2**64), range(0, 2**63)):
        with pytest.raises(gl.GadgetIndexError):
            g.getData(r)
    assert g.getData(range(3, -1, -1)).shape == (4, 2)


def test_dataset_placement_names_are_case_insensitive():
    ds = gl.GadgetDataset(np.arange(8, dtype=np.float32).reshape(4, 2), placement="CPU")
    assert ds[[1]][0].tolist() == [[2.0, 3.0]]
    ds2 = gl.GadgetDataset(np.arange(4), placement="FILE")  # arrays go to memory
    assert ds2[[3]][0].tolist() == [3]


# ---- sixth review ----------------------------------------------------------------------------


def test_ranges_match_python_near_the_int64_limits():
    from gadgetloader._ids import _to_tensor

    top = 2**63 - 1
    rng = np.random.default_rng(0)
    cases = [
        range(2**62 + 1, -1, -(2**62 + 1)),
        range(0, 2**62 + 1, 2**62 - 1),
        range(top - 4, top + 1),
        range(top - 11, top + 1, 3),
        range(top, -1, -(2**62)),
    ]
    for _ in range(300):
        step = int(rng.choice([1, -1, 3, -7, 2**61, -(2**61), 2**62 + 3, -(2**62 + 3)]))
        start = int(rng.integers(0, top, dtype=np.int64, endpoint=True))
        cases.append(range(start, start + step * int(rng.integers(-1, 4)), step))
    for r in cases:
        expected = [i for i in r]
        if expected and (max(expected) > top or min(expected) < 0):
            with pytest.raises(gl.GadgetIndexError):
                _to_tensor(r)
        else:
            assert _to_tensor(r).tolist() == expected, r
    with pytest.raises(gl.GadgetValueError, match="more than 2"):
        _to_tensor(range(top, -1, -1))


def test_state_tagged_without_the_torch_base_still_loads_into_a_moved_class():
    src, so = _model(torch.optim.Adam)
    _train(src, so)
    sd = so.state_dict()
    del sd["optimizer_base"]  # as saved before the base was recorded
    sd["optimizer"] = "__main__.Adam"
    m, o = _model(torch.optim.Adam, seed=1)
    o.load_state_dict(sd)


def test_saving_under_a_file_says_it_is_not_a_directory(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(gl.GadgetFileError, match="not a directory"):
        gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu").save(
            str(tmp_path / "afile" / "x.npy")
        )


def test_zeros_takes_any_int_sequence_and_refuses_the_rest():
    assert gl.DataGadget.zeros(np.array([3, 2]), placement="cpu").shape == (3, 2)
    assert gl.DataGadget.zeros(torch.Size([2, 2]), placement="cpu").shape == (2, 2)
    for bad in (10, "12"):
        with pytest.raises(gl.GadgetTypeError, match="shape"):
            gl.DataGadget.zeros(bad, placement="cpu")


# ---- lifecycle and processes ----------------------------------------------------------------


@pytest.mark.parametrize("ext", [".h5", ".zarr"])
def test_closing_a_file_table_while_threads_read_it(tmp_path, ext):
    """A call that overlaps close() finishes or raises GadgetClosedError, nothing else."""
    pytest.importorskip("h5py" if ext == ".h5" else "zarr")
    path = tmp_path / f"t{ext}"
    gl.DataGadget(np.ones((20_000, 16), np.float32), placement="cpu").save(
        str(path), chunk_rows=64, compression="gzip"
    )
    errors: dict[str, str] = {}
    for trial in range(20):
        g = gl.DataGadget(str(path), placement="file", device="cpu", cache_bytes=1 << 20)

        def read(g=g):
            try:
                while True:
                    got = g.getData(torch.randint(0, 20_000, (2000,)))
                    assert bool((got == 1).all())
            except gl.GadgetClosedError:
                pass
            except BaseException as exc:  # anything else is the defect
                errors[type(exc).__name__] = str(exc)[:90]

        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.003 * (trial % 7))
        g.close()
        for t in threads:
            t.join()
    assert errors == {}


def test_hdf5_writes_reach_the_file_for_other_processes(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "w.h5"
    gl.DataGadget(np.zeros((100, 2), np.float32), placement="cpu").save(str(path))
    g = gl.DataGadget(str(path), placement="file")
    g.insertData(np.full((2, 2), 7.0, np.float32), [3, 50])
    code = (
        "import h5py, sys; f = h5py.File(sys.argv[1], 'r', locking=False); "
        "d = f['data']; print(float(d[3, 0]), float(d[50, 1]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["7.0", "7.0"]
    g.close()
    del h5py


def test_info_json_is_written_even_when_stdout_is_a_closed_pipe(tmp_path, monkeypatch):
    from gadgetloader import cli

    class ClosedPipe(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    out = tmp_path / "i.json"
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["info", "--no-measure", "--json", str(out)]) == 1
    monkeypatch.undo()
    assert "torch" in out.read_text()


# ---- word2vec example and the EmbeddingBag ---------------------------------------------------


def test_word2vec_chunks_give_each_pair_once():
    from datasets.word2vec import skipgram_pairs

    ids = np.arange(100)  # ids are positions: a pair names its two positions
    rng = np.random.default_rng(0)
    window, chunk, pairs = 3, 10, []
    for start in range(0, ids.shape[0], chunk):
        first = max(0, start - window)
        part = ids[first : start + chunk + window]
        core = (start - first, start - first + min(chunk, ids.shape[0] - start))
        c, x = skipgram_pairs(part, window, rng, centers_in=core)
        pairs += list(zip(c.tolist(), x.tolist(), strict=True))
    assert len(pairs) == len(set(pairs))
    assert all(0 < abs(c - x) <= window for c, x in pairs)
    assert {c for c, _ in pairs} == set(range(100))  # every center, in its own chunk


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr", "inf"], "finite"),
        (["--seed", "-1"], "at least 0"),
        (["--out", "DIR/"], "file name prefix"),
        (["--out", "DIR/vec"], "is a directory"),
    ],
)
def test_word2vec_bad_arguments_are_one_line_errors_before_training(
    tmp_path, capsys, extra, message
):
    from datasets import word2vec

    corpus = tmp_path / "c.txt"
    corpus.write_text("a b c d e f g " * 50)
    (tmp_path / "vec.npy").mkdir()  # OUT.npy taken by a folder
    args = [str(corpus), *[a.replace("DIR", str(tmp_path)) for a in extra]]
    with pytest.raises(SystemExit) as info:
        word2vec.main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "epoch" not in err


def test_bag_weights_with_mean_are_refused_before_the_lookup_is_recorded():
    bag = gl.OffloadedEmbeddingBag(10, 3, mode="mean", placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=1.0)
    before = bag.table.getData(torch.arange(10))
    with pytest.raises(gl.GadgetValueError, match="mode='sum'"):
        bag(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))
    opt.step()  # nothing pending: nothing written
    assert torch.equal(bag.table.getData(torch.arange(10)), before)
    bag(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    assert not torch.equal(bag.table.getData(torch.tensor([1])), before[1:2])


# ---- last review -------------------------------------------------------------------------------


def test_close_never_waits_forever_for_a_call_that_waits_for_it(tmp_path):
    """A close from a finalizer on one of a call's own I/O threads: the call holds the
    file's lock and waits for that thread. The close gives up waiting; the call releases
    the table on its way out."""
    pytest.importorskip("zarr")
    path = tmp_path / "t.zarr"
    gl.DataGadget(np.ones((100, 4), np.float32), placement="cpu").save(str(path), chunk_rows=10)
    g = gl.DataGadget(str(path), placement="file", device="cpu")
    g.getData([1, 50])
    store = g.store
    with store._guard():  # the call in progress
        closer = threading.Thread(target=g.close)
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive()  # returned although the lock is held
        assert store.closed
    assert store._src is None and store._slab is None  # released when the call ended
    with pytest.raises(gl.GadgetClosedError):
        g.getData([1])


def test_a_closed_pipe_found_when_flushing_stdout_ends_quietly(monkeypatch):
    from gadgetloader import cli

    class PipeClosedAtFlush(io.StringIO):
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", PipeClosedAtFlush())
    assert cli.main(["info", "--no-measure"]) == 1


def test_zeros_of_a_0d_array_is_a_gadget_error():
    for bad in (np.array(10), torch.tensor(5)):
        with pytest.raises(gl.GadgetTypeError, match="shape"):
            gl.DataGadget.zeros(bad, placement="cpu")


def test_word2vec_chunk_and_seed_bounds(tmp_path, capsys):
    from datasets import word2vec

    corpus = tmp_path / "c.txt"
    corpus.write_text("a b c d e f g " * 20)
    with pytest.raises(ValueError, match="chunk_tokens"):
        word2vec.train(str(corpus), chunk_tokens=-5, placement="cpu", device="cpu")
    with pytest.raises(SystemExit) as info:
        word2vec.main([str(corpus), "--seed", str(2**64)])
    assert info.value.code == 2 and "at most" in capsys.readouterr().err
