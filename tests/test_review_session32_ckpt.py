"""Black-box review (session 32) of checkpoints and resume (save_checkpoint / load_checkpoint,
module and optimizer state dicts, the switchers' saveTorch / loadTorch / saveCupy / loadCupy,
DataGadget save / load) across placements and formats; written from README.md, SPEC.md and
the public docstrings only."""

from __future__ import annotations

import copy
import os
import pathlib
import shutil
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


FORMATS = ["npy", "hdf5", "zarr"]
R_E, R_B, D = 23, 17, 4


def _need(fmt):
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")


# ---------------------------------------------------------------- helpers


def _same(a, b, path="root"):
    """Exact recursive equality of nested dicts / lists / tensors / arrays / scalars."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.cpu(), b.cpu()), path
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a.keys()) == list(b.keys()), (path, list(a.keys()), list(b.keys()))
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _dropin(
    seed,
    opt_cls=torch.optim.Adam,
    placement="cpu",
    dtype=torch.float32,
    head=True,
    with_opt=True,
    **kw,
):
    torch.manual_seed(seed)
    mods = {
        "e": gl.OffloadedEmbedding(R_E, D, placement=placement, device="cpu", dtype=dtype),
        "b": gl.OffloadedEmbeddingBag(
            R_B, D, mode="sum", placement=placement, device="cpu", dtype=dtype
        ),
    }
    if head:
        mods["h"] = torch.nn.Linear(D, 1, dtype=dtype)
    model = torch.nn.ModuleDict(mods)
    if not with_opt:
        return model, None
    kw.setdefault("lr", 0.05)
    opt = gl.OffloadedOptimizer(opt_cls, model, **kw)
    return model, opt


def _batch(i, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(0, R_E, (3, 2), generator=g)
    bags = torch.randint(0, R_B, (3, 4), generator=g)
    y = torch.randn(3, generator=g).to(dtype)
    return ids, bags, y


def _loss(model, i):
    ids, bags, y = _batch(i, model["e"](torch.tensor([0])).dtype)
    x = model["e"](ids).sum(1) * model["b"](bags)
    pred = model["h"](x).squeeze(-1) if "h" in model else x.sum(-1)
    return ((pred - y) ** 2).mean()


def _train(model, opt, steps):
    for i in steps:
        opt.zero_grad()
        _loss(model, i).backward()
        opt.step()


def _snap(model, opt=None):
    s = {
        "e": model["e"].weight.getNumpyVersion(),
        "b": model["b"].weight.getNumpyVersion(),
    }
    if "h" in model:
        s["h"] = {k: v.detach().clone() for k, v in model["h"].state_dict().items()}
    if opt is not None:
        s["opt"] = _clone(opt.state_dict())
    return s


def _p(tmp_path, name, as_path):
    p = tmp_path / name
    return p if as_path else str(p)


def _listing(d):
    return sorted(os.listdir(d))


# ------------------------------------------------ resume: drop-in modules, every optimizer

OPTS = [
    (torch.optim.Adam, {}),
    (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.01}),
    (torch.optim.Adamax, {}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True, "lr": 0.01}),
    (torch.optim.Rprop, {}),
    (torch.optim.ASGD, {}),
    (torch.optim.Adagrad, {"initial_accumulator_value": 0.1}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    (torch.optim.NAdam, {}),
    (torch.optim.RAdam, {}),
]


_RESUME_CASES = [pytest.param("npy", c, k, id=f"npy-{c.__name__}") for c, k in OPTS] + [
    pytest.param(f, c, k, id=f"{f}-{c.__name__}")
    for f in ("hdf5", "zarr")
    for c, k in OPTS
    if c in (torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Rprop)
]


@pytest.mark.parametrize("fmt,opt_cls,kw", _RESUME_CASES)
def test_dropin_resume_is_bit_identical(tmp_path, fmt, opt_cls, kw):
    _need(fmt)
    N, M = 3, 3
    ma, oa = _dropin(0, opt_cls, **kw)
    _train(ma, oa, range(N))
    ck = _p(tmp_path, "ck", fmt != "npy")  # str for npy, pathlib for the others
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    _train(ma, oa, range(N, N + M))
    ref = _snap(ma, oa)

    mb, ob = _dropin(7, opt_cls, **kw)  # other init: everything must come from the checkpoint
    gl.load_checkpoint(ck, {"model": mb, "optimizer": ob})
    _train(mb, ob, range(N, N + M))
    _same(ref, _snap(mb, ob))


@pytest.mark.parametrize("fmt", FORMATS)
def test_sparseadam_tables_only_resume(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0, torch.optim.SparseAdam, head=False)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"m": ma, "o": oa}, format=fmt)
    _train(ma, oa, range(2, 5))
    mb, ob = _dropin(3, torch.optim.SparseAdam, head=False)
    gl.load_checkpoint(tmp_path / "ck", {"m": mb, "o": ob})
    _train(mb, ob, range(2, 5))
    _same(_snap(ma, oa), _snap(mb, ob))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dropin_state_right_after_load_equals_saved(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(4))
    ref = _snap(ma, oa)
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": ma, "optimizer": oa}, format=fmt)
    mb, ob = _dropin(5)
    gl.load_checkpoint(str(tmp_path / "ck"), {"model": mb, "optimizer": ob})
    _same(ref, _snap(mb, ob))


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_bfloat16_tables_resume_in_hdf5_zarr(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0, dtype=torch.bfloat16, head=False)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"m": ma, "o": oa}, format=fmt)
    _train(ma, oa, range(2, 4))
    mb, ob = _dropin(1, dtype=torch.bfloat16, head=False)
    gl.load_checkpoint(tmp_path / "ck", {"m": mb, "o": ob})
    _train(mb, ob, range(2, 4))
    _same(_snap(ma, oa), _snap(mb, ob))


def test_bfloat16_npy_refused_before_writing(tmp_path):
    ma, oa = _dropin(0, dtype=torch.bfloat16, head=False)
    _train(ma, oa, range(1))
    ck = tmp_path / "ck"
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(ck, {"m": ma, "o": oa}, format="npy")
    assert not ck.exists() or _listing(ck) == []


def test_float64_tables_resume(tmp_path):
    ma, oa = _dropin(0, dtype=torch.float64)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})
    _train(ma, oa, range(2, 4))
    mb, ob = _dropin(1, dtype=torch.float64)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    _train(mb, ob, range(2, 4))
    _same(_snap(ma, oa), _snap(mb, ob))


def test_default_format_is_npy(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})
    names = _listing(tmp_path / "ck")
    assert "meta.pt" in names
    tables = [n for n in names if n != "meta.pt"]
    assert tables and all(n.endswith(".npy") for n in tables)
    assert any(n.startswith("model.") for n in tables) and any(
        n.startswith("optimizer.") for n in tables
    )


# ------------------------------------------------ placements / layouts crossed


@pytest.mark.parametrize("fmt", ["npy"])
def test_cpu_checkpoint_loads_into_pinned_requested_model(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0, placement="cpu")
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa}, format=fmt)
    _train(ma, oa, range(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        mb, ob = _dropin(4, placement="pinned")
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    _train(mb, ob, range(2, 4))
    _same(_snap(ma, oa), _snap(mb, ob))


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_only_checkpoint_from_interleaved_into_plain_and_back(tmp_path, fmt):
    _need(fmt)
    # saved from a model whose tables are interleaved with optimizer state ...
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "a", {"model": ma}, format=fmt)
    ref = _snap(ma)
    # ... into a model with no optimizer yet (plain tables)
    mb, _ = _dropin(9, with_opt=False)
    gl.load_checkpoint(tmp_path / "a", {"model": mb})
    _same(ref, _snap(mb))
    # and a model-only checkpoint of plain tables into a model whose optimizer interleaved them
    gl.save_checkpoint(tmp_path / "b", {"model": mb}, format=fmt)
    mc, oc = _dropin(11)
    gl.load_checkpoint(tmp_path / "b", {"model": mc})
    _same(ref, _snap(mc))
    # mc now trains from those rows exactly like a fresh optimizer over mb
    ob = gl.OffloadedOptimizer(torch.optim.Adam, mb, lr=0.05)
    _train(mb, ob, range(5, 7))
    _train(mc, oc, range(5, 7))
    _same(_snap(mb), _snap(mc))


def test_checkpoint_holding_scheduler_momentum_loads_into_optimizer_without_it(tmp_path):
    ma, oa = _dropin(0, torch.optim.SGD, momentum=0.0)
    _train(ma, oa, range(1))
    for g in oa.param_groups:
        g["momentum"] = 0.9  # as a scheduler (OneCycleLR) would turn it on
    _train(ma, oa, range(1, 3))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})
    _train(ma, oa, range(3, 6))
    mb, ob = _dropin(3, torch.optim.SGD, momentum=0.0)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    assert all(g["momentum"] == 0.9 for g in ob.param_groups)
    _train(mb, ob, range(3, 6))
    _same(_snap(ma, oa), _snap(mb, ob))


def test_numpy_option_comes_back_with_numpy_type(tmp_path):
    ma, oa = _dropin(0, lr=np.float64(0.05))
    _train(ma, oa, range(1))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})
    mb, ob = _dropin(0, lr=0.05)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    assert all(type(g["lr"]) is np.float64 and g["lr"] == 0.05 for g in ob.param_groups)


# ------------------------------------------------ switchers


class _SwModel(torch.nn.Module):
    def __init__(self, rows=6):
        super().__init__()
        self.u = torch.nn.Embedding(rows, D)
        self.lin = torch.nn.Linear(D, 1)

    def forward(self, local):
        return self.lin(self.u(local)).pow(2).mean()


def _switchers(seed, kind="speedtorch", opt_cls=torch.optim.Adam, rows=6, **kw):
    torch.manual_seed(seed)
    model = _SwModel(rows)
    optimizer = opt_cls(model.parameters(), lr=0.05, **kw)
    if kind == "speedtorch":
        sw = gl.ModelFactory(model.u, R_E, D, placement="cpu")
        osw = gl.OptimizerFactory(optimizer, R_E, D, model, "u", placement="cpu")
    else:
        sw = gl.PytorchModelFactory(model.u, R_E, D, deviceType="cpu")
        osw = gl.PytorchOptimizerFactory(optimizer, R_E, D, model, "u", deviceType="cpu")
    sw.uniformDistributionInit(-0.5, 0.5)
    osw.optInit()
    return model, optimizer, sw, osw


def _sw_ids(i):
    g = torch.Generator().manual_seed(500 + i)
    return torch.randint(0, R_E, (5,), generator=g)


def _sw_train(model, optimizer, sw, osw, steps):
    for i in steps:
        ids = _sw_ids(i)
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        loss = model(local)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)


def _sw_snap(model, optimizer, sw, osw):
    st = optimizer.state_dict()
    lin_ids = [i for i, p in enumerate(model.parameters()) if p is not model.u.weight]
    return {
        "table": sw.getNumpyVersion(),
        "state": {k: v.copy() for k, v in osw.getNumpyVersion().items()},
        "lin": {k: v.detach().clone() for k, v in model.lin.state_dict().items()},
        "lin_opt": {i: _clone(st["state"].get(i)) for i in lin_ids},
    }


def _sw_objs(model, optimizer, sw, osw):
    return {"model": model, "u": sw, "u_opt": osw, "opt": optimizer}


@pytest.mark.parametrize("kind", ["speedtorch", "pytorch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_switchers_resume_is_bit_identical(tmp_path, fmt, kind):
    _need(fmt)
    a = _switchers(0, kind)
    _sw_train(*a, range(3))
    gl.save_checkpoint(tmp_path / "ck", _sw_objs(*a), format=fmt)
    _sw_train(*a, range(3, 6))
    b = _switchers(4, kind)
    gl.load_checkpoint(tmp_path / "ck", _sw_objs(*b))
    _sw_train(*b, range(3, 6))
    _same(_sw_snap(*a), _sw_snap(*b))


@pytest.mark.parametrize(
    "opt_cls,kw",
    [
        (torch.optim.SGD, {"momentum": 0.9}),
        (torch.optim.Adagrad, {}),
        (torch.optim.RMSprop, {"centered": True}),
    ],
    ids=["SGD", "Adagrad", "RMSprop"],
)
def test_switchers_resume_other_optimizers(tmp_path, opt_cls, kw):
    a = _switchers(0, "speedtorch", opt_cls, **kw)
    _sw_train(*a, range(2))
    gl.save_checkpoint(tmp_path / "ck", _sw_objs(*a))
    _sw_train(*a, range(2, 5))
    b = _switchers(2, "speedtorch", opt_cls, **kw)
    gl.load_checkpoint(tmp_path / "ck", _sw_objs(*b))
    _sw_train(*b, range(2, 5))
    _same(_sw_snap(*a), _sw_snap(*b))


def test_switcher_momentum_from_checkpoint_loads_into_switchers_built_without_it(tmp_path):
    a = _switchers(0, "speedtorch", torch.optim.SGD, momentum=0.0)
    _sw_train(*a, range(1))
    for g in a[1].param_groups:
        g["momentum"] = 0.9
    _sw_train(*a, range(1, 3))
    gl.save_checkpoint(tmp_path / "ck", _sw_objs(*a))
    _sw_train(*a, range(3, 5))
    b = _switchers(1, "speedtorch", torch.optim.SGD, momentum=0.0)
    gl.load_checkpoint(tmp_path / "ck", _sw_objs(*b))
    _sw_train(*b, range(3, 5))
    _same(_sw_snap(*a), _sw_snap(*b))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_kind_in_one_checkpoint(tmp_path, fmt):
    _need(fmt)

    def build(seed):
        m, o = _dropin(seed)
        s = _switchers(seed + 1)
        torch.manual_seed(seed + 2)
        plain = torch.nn.Linear(3, 2)
        popt = torch.optim.Adam(plain.parameters(), lr=0.1)
        objs = {"dropin": m, "optimizer": o, **_sw_objs(*s), "plain": plain, "popt": popt}
        assert len(objs) == 8
        return m, o, s, plain, popt, objs

    def plain_step(plain, popt, i):
        g = torch.Generator().manual_seed(i)
        popt.zero_grad()
        plain(torch.randn(4, 3, generator=g)).pow(2).sum().backward()
        popt.step()

    def run(m, o, s, plain, popt, steps):
        for i in steps:
            _train(m, o, [i])
            _sw_train(*s, [i])
            plain_step(plain, popt, i)

    def snap(m, o, s, plain, popt):
        return {
            "d": _snap(m, o),
            "s": _sw_snap(*s),
            "p": _clone(plain.state_dict()),
            "po": _clone(popt.state_dict()),
        }

    A = build(0)
    run(*A[:5], range(2))
    gl.save_checkpoint(tmp_path / "ck", A[5], format=fmt)
    run(*A[:5], range(2, 4))
    B = build(10)
    gl.load_checkpoint(tmp_path / "ck", B[5])
    run(*B[:5], range(2, 4))
    _same(snap(*A[:5]), snap(*B[:5]))


def test_model_with_switchers_saved_without_them_is_refused(tmp_path):
    a = _switchers(0)
    _sw_train(*a, range(1))
    gl.save_checkpoint(tmp_path / "ck", _sw_objs(*a))
    before = _listing(tmp_path / "ck")
    model, optimizer, _sw, _osw = a
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(tmp_path / "ck", {"model": model, "opt": optimizer})
    assert _listing(tmp_path / "ck") == before
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(tmp_path / "fresh", {"model": model})
    assert not (tmp_path / "fresh").exists() or _listing(tmp_path / "fresh") == []


def test_switchers_checkpoint_refused_mid_step(tmp_path):
    a = _switchers(0)
    _sw_train(*a, range(1))
    gl.save_checkpoint(tmp_path / "ck", _sw_objs(*a))
    b = _switchers(3)
    ids = _sw_ids(9)
    b[2].beforeForwardPass(ids)
    b[3].beforeForwardPass(ids)
    before = _sw_snap(*b)
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(tmp_path / "ck", _sw_objs(*b))
    _same(before, _sw_snap(*b))
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(tmp_path / "ck2", _sw_objs(*b))
    np.save(tmp_path / "fits.npy", np.ones((R_E, D), np.float32))
    with pytest.raises(gl.GadgetValueError):
        b[2].loadCupy(str(tmp_path / "fits.npy"))
    _same(before, _sw_snap(*b))


# ------------------------------------------------ switcher file methods


@pytest.mark.parametrize("kind,as_path", [("speedtorch", False), ("pytorch", True)])
def test_switcher_savecupy_appends_npy_and_loadcupy_roundtrips(tmp_path, kind, as_path):
    a = _switchers(0, kind)
    _sw_train(*a, range(2))
    sw = a[2]
    target = tmp_path / "emb"
    sw.saveCupy(target if as_path else str(target))
    assert (tmp_path / "emb.npy").exists() and not target.exists()
    arr = np.load(tmp_path / "emb.npy")
    np.testing.assert_array_equal(arr, sw.getNumpyVersion())
    b = _switchers(5, kind)
    b[2].loadCupy(tmp_path / "emb.npy" if as_path else str(tmp_path / "emb.npy"))
    np.testing.assert_array_equal(b[2].getNumpyVersion(), arr)


@pytest.mark.parametrize("bad", ["shape", "dtype", "truncated", "missing"])
def test_switcher_loadcupy_refuses_and_keeps_table(tmp_path, bad):
    a = _switchers(0)
    sw = a[2]
    before = sw.getNumpyVersion()
    p = tmp_path / "x.npy"
    if bad == "shape":
        np.save(p, np.zeros((R_E + 1, D), np.float32))
        exc = gl.GadgetValueError
    elif bad == "dtype":
        np.save(p, np.zeros((R_E, D), np.float64))
        exc = gl.GadgetTypeError
    elif bad == "truncated":
        np.save(p, np.ones((R_E, D), np.float32))
        data = p.read_bytes()
        p.write_bytes(data[:-7])
        exc = gl.GadgetFileError
    else:
        exc = gl.GadgetFileNotFoundError
    with pytest.raises(exc):
        sw.loadCupy(str(p))
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


@pytest.mark.parametrize("kind", ["speedtorch", "pytorch"])
def test_switcher_savetorch_loadtorch(tmp_path, kind):
    a = _switchers(0, kind)
    _sw_train(*a, range(2))
    p = tmp_path / "t.pt"
    a[2].saveTorch(str(p))
    t = torch.load(p, weights_only=True)
    assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
    np.testing.assert_array_equal(t.numpy(), a[2].getNumpyVersion())
    b = _switchers(3, kind)
    b[2].loadTorch(p)
    np.testing.assert_array_equal(b[2].getNumpyVersion(), t.numpy())


def test_switcher_loadtorch_exact_float64_accepted_inexact_refused(tmp_path):
    a = _switchers(0)
    sw = a[2]
    exact = torch.from_numpy(np.arange(R_E * D, dtype=np.float64).reshape(R_E, D) / 4)
    torch.save(exact, tmp_path / "ok.pt")
    sw.loadTorch(tmp_path / "ok.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), exact.numpy().astype(np.float32))
    before = sw.getNumpyVersion()
    inexact = exact.clone()
    inexact[-1, -1] = 0.1  # not a float32 value
    torch.save(inexact, tmp_path / "bad.pt")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(tmp_path / "bad.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)
    torch.save(torch.zeros(R_E, D + 1), tmp_path / "shape.pt")
    with pytest.raises(gl.GadgetValueError):
        sw.loadTorch(tmp_path / "shape.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


@pytest.mark.parametrize("kind", ["speedtorch", "pytorch"])
def test_optimizer_switcher_savetorch_dict_and_list(tmp_path, kind):
    a = _switchers(0, kind)
    _sw_train(*a, range(3))
    osw = a[3]
    p = tmp_path / "s.pt"
    osw.saveTorch(p)
    saved = torch.load(p, weights_only=True)
    state = osw.getNumpyVersion()
    assert isinstance(saved, dict) and set(saved) == set(state)
    assert {"exp_avg", "exp_avg_sq"} <= set(saved)
    for k in saved:
        np.testing.assert_array_equal(saved[k].numpy(), state[k])
    b = _switchers(5, kind)
    b[3].loadTorch(str(p))
    _same({k: v for k, v in b[3].getNumpyVersion().items()}, state)
    # SpeedTorch's list of tensors, in tables order
    names = list(state)
    c = _switchers(6, kind)
    torch.save([saved[k] for k in names], tmp_path / "l.pt")
    c[3].loadTorch(tmp_path / "l.pt")
    _same(c[3].getNumpyVersion(), state)


@pytest.mark.parametrize("bad", ["name", "shape_of_last", "missing_entry"])
def test_optimizer_switcher_loadtorch_refuses_before_writing(tmp_path, bad):
    a = _switchers(0)
    _sw_train(*a, range(2))
    osw = a[3]
    good = {k: torch.from_numpy(v.copy()) + 1 for k, v in osw.getNumpyVersion().items()}
    before = osw.getNumpyVersion()
    d = dict(good)
    if bad == "name":
        k = list(d)[-1]
        d["not_a_state"] = d.pop(k)
    elif bad == "shape_of_last":
        k = list(d)[-1]
        d[k] = torch.zeros(R_E + 1, D)
    else:
        d.pop(list(d)[-1])
    torch.save(d, tmp_path / "s.pt")
    with pytest.raises(gl.GadgetError):
        osw.loadTorch(tmp_path / "s.pt")
    _same(osw.getNumpyVersion(), before)


# ------------------------------------------------ refusals of load_checkpoint leave everything unchanged


@pytest.fixture
def saved_dropin(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    return ck


def _victim(seed=21, **kw):
    m, o = _dropin(seed, **kw)
    _train(m, o, range(10, 11))
    return m, o


def test_subset_of_saved_objects_loads_only_those(saved_dropin):
    # Not documented either way; the library accepts a subset: check it is exact.
    ref_m, ref_o = _dropin(50)
    gl.load_checkpoint(saved_dropin, {"model": ref_m, "optimizer": ref_o})
    m, o = _victim()
    before = _snap(m, o)
    gl.load_checkpoint(saved_dropin, {"model": m})
    after = _snap(m, o)
    _same(_snap(ref_m), {k: after[k] for k in ("e", "b", "h")})
    _same(before["opt"], after["opt"])


def test_extra_object_name_refused(saved_dropin):
    m, o = _victim()
    extra = torch.nn.Linear(2, 2)
    extra_before = _clone(extra.state_dict())
    before = _snap(m, o)
    with pytest.raises((gl.GadgetKeyError, gl.GadgetValueError)):
        gl.load_checkpoint(saved_dropin, {"model": m, "optimizer": o, "zzz": extra})
    _same(before, _snap(m, o))
    _same(extra_before, extra.state_dict())


def test_swapped_kinds_refused(saved_dropin):
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises((gl.GadgetKeyError, gl.GadgetValueError)):
        gl.load_checkpoint(saved_dropin, {"model": o, "optimizer": m})
    _same(before, _snap(m, o))


@pytest.mark.parametrize("order", ["bad_last", "bad_first"])
@pytest.mark.parametrize("what", ["rows_e", "dim_b", "head_shape", "no_head", "opt_class", "dtype"])
def test_mismatching_object_refused_leaves_all_unchanged(saved_dropin, what, order):
    # a good model-shaped victim, and a mismatching one, in either order
    if what == "rows_e":
        torch.manual_seed(21)
        m = torch.nn.ModuleDict(
            {
                "e": gl.OffloadedEmbedding(R_E + 1, D, placement="cpu", device="cpu"),
                "b": gl.OffloadedEmbeddingBag(R_B, D, mode="sum", placement="cpu", device="cpu"),
                "h": torch.nn.Linear(D, 1),
            }
        )
        exc = (gl.GadgetValueError, gl.GadgetKeyError)
    elif what == "dim_b":
        torch.manual_seed(21)
        m = torch.nn.ModuleDict(
            {
                "e": gl.OffloadedEmbedding(R_E, D, placement="cpu", device="cpu"),
                "b": gl.OffloadedEmbeddingBag(
                    R_B, D + 1, mode="sum", placement="cpu", device="cpu"
                ),
                "h": torch.nn.Linear(D, 1),
            }
        )
        exc = (gl.GadgetValueError, gl.GadgetKeyError)
    elif what == "head_shape":
        torch.manual_seed(21)
        m = torch.nn.ModuleDict(
            {
                "e": gl.OffloadedEmbedding(R_E, D, placement="cpu", device="cpu"),
                "b": gl.OffloadedEmbeddingBag(R_B, D, mode="sum", placement="cpu", device="cpu"),
                "h": torch.nn.Linear(D, 2),
            }
        )
        exc = (gl.GadgetValueError, gl.GadgetKeyError)
    elif what == "no_head":
        m, _ = _dropin(21, head=False, with_opt=False)
        exc = (gl.GadgetValueError, gl.GadgetKeyError)
    elif what == "dtype":
        m, _ = _dropin(21, dtype=torch.float64, with_opt=False)
        exc = (gl.GadgetTypeError,)
    else:
        m = None
        exc = (gl.GadgetValueError,)
    if m is not None:
        o = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    else:
        m, o = _dropin(21, torch.optim.NAdam)  # Adam's state into NAdam
    if what not in ("head_shape", "no_head", "rows_e", "dim_b", "dtype"):
        _train(m, o, range(10, 11))
    before = _snap(m, o)
    objs = {"model": m, "optimizer": o}
    if order == "bad_first":
        objs = {"optimizer": o, "model": m} if what == "opt_class" else objs
    else:
        objs = {"optimizer": o, "model": m} if what != "opt_class" else objs
    with pytest.raises(exc):
        gl.load_checkpoint(saved_dropin, objs)
    _same(before, _snap(m, o))


def test_wrong_shape_in_one_of_two_models_keeps_the_good_one(tmp_path):
    ma, oa = _dropin(0)
    mb, ob = _dropin(1)
    _train(ma, oa, range(2))
    _train(mb, ob, range(3))
    gl.save_checkpoint(tmp_path / "ck", {"a": ma, "ao": oa, "b": mb, "bo": ob})
    good_m, good_o = _victim(30)
    torch.manual_seed(1)
    bad_m = torch.nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(R_E, D, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbeddingBag(R_B - 1, D, mode="sum", placement="cpu", device="cpu"),
            "h": torch.nn.Linear(D, 1),
        }
    )
    bad_o = gl.OffloadedOptimizer(torch.optim.Adam, bad_m, lr=0.05)
    _train(bad_m, bad_o, range(1))
    b1, b2 = _snap(good_m, good_o), _snap(bad_m, bad_o)
    with pytest.raises((gl.GadgetValueError, gl.GadgetKeyError)):
        gl.load_checkpoint(tmp_path / "ck", {"a": good_m, "ao": good_o, "b": bad_m, "bo": bad_o})
    _same(b1, _snap(good_m, good_o))
    _same(b2, _snap(bad_m, bad_o))


def test_closed_table_refused_nothing_loaded(saved_dropin):
    m, o = _victim()
    before = _snap(m, o)
    m["b"].weight.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.load_checkpoint(saved_dropin, {"model": m, "optimizer": o})
    np.testing.assert_array_equal(m["e"].weight.getNumpyVersion(), before["e"])
    _same(before["h"], m["h"].state_dict())


def test_pending_lookup_gradient_refuses_load(saved_dropin):
    m, o = _victim()
    before = _snap(m, o)
    _loss(m, 3).backward()  # a lookup with a gradient waiting for its step
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(saved_dropin, {"model": m, "optimizer": o})
    _same(before, _snap(m, o))


@pytest.mark.parametrize("objs", [None, [("model", 1)]])
def test_load_objects_not_a_mapping(saved_dropin, objs):
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(saved_dropin, objs)


def test_load_non_str_name_refused(saved_dropin):
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(saved_dropin, {"model": m, 1: o})
    _same(before, _snap(m, o))


@pytest.mark.parametrize("directory", [None, b"ck"])
def test_load_directory_not_a_path(directory):
    m, o = _victim()
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(directory, {"model": m, "optimizer": o})


def test_load_missing_or_incomplete_checkpoint(tmp_path):
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "nope", {"model": m, "optimizer": o})
    (tmp_path / "empty").mkdir()
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(str(tmp_path / "empty"), {"model": m, "optimizer": o})
    _same(before, _snap(m, o))


# ------------------------------------------------ damaged checkpoints


def _table_file(ck, prefix):
    hits = [n for n in _listing(ck) if n.startswith(prefix)]
    assert len(hits) == 1, hits
    return pathlib.Path(ck) / hits[0]


def _zarr_chunks(store):
    out = []
    for root, _dirs, files in os.walk(store):
        for f in files:
            if not f.startswith(".") and f not in ("zarr.json", ".zarray", ".zattrs", ".zgroup"):
                out.append(pathlib.Path(root) / f)
    return sorted(out)


def _damage(ck, fmt, how, prefix):
    f = _table_file(ck, prefix)
    if how == "delete":
        if f.is_dir():
            shutil.rmtree(f)
        else:
            f.unlink()
        return
    if fmt == "zarr":
        chunks = _zarr_chunks(f)
        assert chunks
        f = chunks[0]
    data = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flip":
        # npy: the magic string; hdf5: the superblock signature; zarr: the compressed
        # chunk's frame header -- damage any reader must notice
        for i in range(0, 4):
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("prefix", ["model.b.", "optimizer."])
@pytest.mark.parametrize("how", ["truncate", "flip"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_table_file_refused_with_nothing_changed(tmp_path, fmt, how, prefix):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    if prefix == "optimizer.":
        prefix = [n for n in _listing(ck) if n.startswith("optimizer.")][-1].rsplit(".", 2)[0] + "."
    _damage(ck, fmt, how, prefix)
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(before, _snap(m, o))


@pytest.mark.parametrize("fmt", FORMATS)
def test_deleted_table_file_refused_with_nothing_changed(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    _damage(ck, fmt, "delete", "model.b.")
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises((gl.GadgetFileError, gl.GadgetFileNotFoundError)):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(before, _snap(m, o))


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_table_refused_even_without_verify(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    _damage(ck, fmt, "truncate", "model.b.")
    m, o = _victim()
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o}, verify=False)


def test_truncated_npy_without_verify_changes_nothing(tmp_path):
    # .npy files need only their header checked against the file size: that check is cheap
    # and documented for every .npy table file, so the truncation is seen before any load.
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format="npy")
    last = [n for n in _listing(ck) if n.startswith("optimizer.")][-1]
    p = ck / last
    p.write_bytes(p.read_bytes()[:-5])
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o}, verify=False)
    _same(before, _snap(m, o))


@pytest.mark.parametrize("verify", [True, False])
def test_zarr_missing_chunk_reads_as_zeros(tmp_path, verify):
    _need("zarr")
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format="zarr")
    ref = _snap(ma, oa)
    f = _table_file(ck, "model.e.")
    chunks = _zarr_chunks(f)
    assert len(chunks) >= 1
    for c in chunks:
        c.unlink()
    m, o = _victim()
    gl.load_checkpoint(ck, {"model": m, "optimizer": o}, verify=verify)
    np.testing.assert_array_equal(m["e"].weight.getNumpyVersion(), np.zeros((R_E, D), np.float32))
    np.testing.assert_array_equal(m["b"].weight.getNumpyVersion(), ref["b"])


@pytest.mark.parametrize("how", ["truncate", "garbage", "empty", "not_a_checkpoint"])
def test_damaged_meta_refused_with_nothing_changed(tmp_path, how):
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    meta = ck / "meta.pt"
    data = meta.read_bytes()
    if how == "truncate":
        meta.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        meta.write_bytes(b"\x00garbage" * 50)
    elif how == "empty":
        meta.write_bytes(b"")
    else:
        torch.save({"hello": torch.zeros(2)}, meta)
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(before, _snap(m, o))


def test_deleted_meta_is_file_not_found(tmp_path):
    ma, oa = _dropin(0)
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})
    (tmp_path / "ck" / "meta.pt").unlink()
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m, "optimizer": o})
    _same(before, _snap(m, o))


# ------------------------------------------------ saving: arguments, names, atomic overwrite


class _Unsaveable(torch.nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self._exc = exc

    def state_dict(self, *args, **kwargs):
        raise self._exc


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "exc",
    [RuntimeError("cannot save me"), KeyboardInterrupt()],
    ids=["RuntimeError", "KeyboardInterrupt"],
)
def test_failed_overwrite_keeps_old_checkpoint(tmp_path, fmt, exc):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    old = _snap(ma, oa)
    old_listing = _listing(ck)
    _train(ma, oa, range(2, 4))  # new state, tables written first, then the bad object
    bad = _Unsaveable(exc)
    with pytest.raises(type(exc)):
        gl.save_checkpoint(ck, {"model": ma, "optimizer": oa, "zbad": bad}, format=fmt)
    assert _listing(ck) == old_listing
    m, o = _dropin(8)
    gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(old, _snap(m, o))


def test_function_in_param_group_refused_before_writing(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    old = _snap(ma, oa)
    old_listing = _listing(ck)
    _train(ma, oa, range(1, 2))
    oa.param_groups[0]["fn"] = lambda x: x
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    assert _listing(ck) == old_listing
    m, o = _dropin(8)
    gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(old, _snap(m, o))


@pytest.mark.parametrize("fmt", FORMATS)
def test_overwrite_replaces_tables_and_removes_old_files(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    first = set(_listing(ck))
    _train(ma, oa, range(1, 3))
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    second = set(_listing(ck))
    assert len(second) == len(first)
    assert (first & second) == {"meta.pt"}
    m, o = _dropin(8)
    gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(_snap(ma, oa), _snap(m, o))


def test_overwrite_with_other_format_and_names(tmp_path):
    _need("hdf5")
    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format="npy")
    _train(ma, oa, range(1, 2))
    gl.save_checkpoint(ck, {"net": ma, "adam": oa}, format="hdf5")
    names = _listing(ck)
    assert not any(n.endswith(".npy") for n in names)
    assert not any(n.startswith(("model.", "optimizer.")) for n in names)
    m, o = _dropin(8)
    with pytest.raises((gl.GadgetKeyError, gl.GadgetValueError)):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    gl.load_checkpoint(ck, {"net": m, "adam": o})
    _same(_snap(ma, oa), _snap(m, o))


@pytest.mark.parametrize("name", ["", "a/b", "a\\b", "a\0b", ".", ".."])
def test_bad_object_names_refused(tmp_path, name):
    ma, oa = _dropin(0)
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    listing = _listing(ck)
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(ck, {name: ma, "optimizer": oa})
    assert _listing(ck) == listing
    assert _listing(tmp_path) == ["ck"]


def test_colliding_table_file_names_refused(tmp_path):
    def emb(n):
        return gl.OffloadedEmbedding(n, D, placement="cpu", device="cpu")

    a = torch.nn.ModuleDict({"e": torch.nn.ModuleDict({"x": emb(6)})})
    b = torch.nn.ModuleDict({"x": emb(5)})  # "a" + "e.x.weight" == "a.e" + "x.weight"
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(tmp_path / "ck", {"a": a, "a.e": b})
    assert not (tmp_path / "ck").exists() or _listing(tmp_path / "ck") == []


def test_unknown_format_is_key_error(tmp_path):
    ma, oa = _dropin(0)
    with pytest.raises(gl.GadgetKeyError):
        gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa}, format="parquet")
    assert not (tmp_path / "ck").exists() or _listing(tmp_path / "ck") == []


@pytest.mark.parametrize("obj", ["datagadget", "sampler", "tensor", "int"])
def test_objects_of_other_kinds_refused(tmp_path, obj):
    ma, oa = _dropin(0)
    if obj == "datagadget":
        x = gl.DataGadget((4, 2), dtype="float32", placement="cpu")
    elif obj == "sampler":
        x = gl.GadgetSampler(10, batch_size=2)
    elif obj == "tensor":
        x = torch.zeros(3)
    else:
        x = 5
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa, "x": x})
    assert not (tmp_path / "ck").exists() or _listing(tmp_path / "ck") == []


@pytest.mark.parametrize("objs", [None, [1, 2]])
def test_save_objects_not_a_mapping(tmp_path, objs):
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", objs)


def test_save_directory_is_a_file(tmp_path):
    ma, oa = _dropin(0)
    f = tmp_path / "file"
    f.write_bytes(b"keep me")
    with pytest.raises(gl.GadgetFileError):
        gl.save_checkpoint(f, {"model": ma, "optimizer": oa})
    assert f.read_bytes() == b"keep me"


def test_save_creates_missing_parents(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    ck = tmp_path / "a" / "b" / "ck"
    gl.save_checkpoint(str(ck), {"model": ma, "optimizer": oa})
    m, o = _dropin(3)
    gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(_snap(ma, oa), _snap(m, o))


def test_save_closed_table_refused_old_checkpoint_kept(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    old = _snap(ma, oa)
    listing = _listing(ck)
    ma["b"].weight.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    assert _listing(ck) == listing
    m, o = _dropin(4)
    gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(old, _snap(m, o))


# ------------------------------------------------ state dicts


def test_module_and_optimizer_state_dict_resume(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(3))
    torch.save({"m": ma.state_dict(), "o": oa.state_dict()}, tmp_path / "sd.pt")
    _train(ma, oa, range(3, 6))
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    mb, ob = _dropin(6)
    mb.load_state_dict(sd["m"])
    ob.load_state_dict(sd["o"])
    _train(mb, ob, range(3, 6))
    _same(_snap(ma, oa), _snap(mb, ob))


def test_module_state_dict_weight_is_whole_table():
    ma, _ = _dropin(0, with_opt=False)
    sd = ma.state_dict()
    assert torch.equal(sd["e.weight"], torch.from_numpy(ma["e"].weight.getNumpyVersion()))
    assert torch.equal(sd["b.weight"], torch.from_numpy(ma["b"].weight.getNumpyVersion()))


def test_module_load_state_dict_partial_as_torch(tmp_path):
    ma, _ = _dropin(0, with_opt=False)
    mb, _ = _dropin(1, with_opt=False)
    sd = ma.state_dict()
    sd["b.weight"] = torch.zeros(R_B + 2, D)
    b_before = mb["b"].weight.getNumpyVersion()
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        mb.load_state_dict(sd)
    np.testing.assert_array_equal(
        mb["e"].weight.getNumpyVersion(), ma["e"].weight.getNumpyVersion()
    )
    np.testing.assert_array_equal(mb["b"].weight.getNumpyVersion(), b_before)
    assert torch.equal(mb["h"].weight, ma["h"].weight)


def test_module_load_state_dict_float64_rounds_and_numpy_accepted():
    emb = gl.OffloadedEmbedding(5, 3, placement="cpu", device="cpu")
    w = torch.randn(5, 3, dtype=torch.float64)
    emb.load_state_dict({"weight": w})
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), w.numpy().astype(np.float32))
    arr = np.arange(15, dtype=np.float32).reshape(5, 3)
    emb.load_state_dict({"weight": arr})
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), arr)


def test_module_load_state_dict_integer_refused_unchanged():
    emb = gl.OffloadedEmbedding(5, 3, placement="cpu", device="cpu")
    before = emb.weight.getNumpyVersion()
    with pytest.raises((RuntimeError, gl.GadgetError)):
        emb.load_state_dict({"weight": torch.ones(5, 3, dtype=torch.int64)})
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)


def test_optimizer_load_state_dict_wrong_class_refused():
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    sd = oa.state_dict()
    mb, ob = _dropin(1, torch.optim.NAdam)
    _train(mb, ob, range(1))
    before = _snap(mb, ob)
    with pytest.raises(gl.GadgetValueError):
        ob.load_state_dict(sd)
    _same(before, _snap(mb, ob))


def test_optimizer_load_state_dict_other_structure_refused():
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    sd = oa.state_dict()
    torch.manual_seed(0)
    mb = torch.nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(R_E + 3, D, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbeddingBag(R_B, D, mode="sum", placement="cpu", device="cpu"),
            "h": torch.nn.Linear(D, 1),
        }
    )
    ob = gl.OffloadedOptimizer(torch.optim.Adam, mb, lr=0.05)
    _train(mb, ob, range(1))
    before = _snap(mb, ob)
    with pytest.raises(gl.GadgetError):
        ob.load_state_dict(sd)
    _same(before, _snap(mb, ob))


def test_optimizer_load_state_dict_converts_float64_state():
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    sd = oa.state_dict()

    def to64(x):
        if isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() == 2:
            return x.double()
        if isinstance(x, dict):
            return {k: to64(v) for k, v in x.items()}
        if isinstance(x, list):
            return [to64(v) for v in x]
        return x

    mb, ob = _dropin(1)
    mb.load_state_dict(ma.state_dict())
    ob.load_state_dict(to64(sd))
    _same(_clone(sd), ob.state_dict())


def test_optimizer_load_state_dict_allowed_with_pending_lookup():
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    sd = _clone(oa.state_dict())
    mb, ob = _dropin(0)
    _train(mb, ob, range(2))
    _train(mb, ob, range(5, 6))  # move mb's rows and optimizer state away
    mb.load_state_dict(ma.state_dict())  # rows back (no lookup pending)
    ob.zero_grad()
    _loss(mb, 2).backward()
    ob.load_state_dict(sd)  # accepted: the next step starts from it
    ob.step()
    oa.zero_grad()
    _loss(ma, 2).backward()
    oa.step()
    _same(_snap(ma, oa), _snap(mb, ob))


def test_offloaded_optimizer_not_picklable():
    _ma, oa = _dropin(0)
    with pytest.raises(gl.GadgetTypeError):
        copy.deepcopy(oa)


# ------------------------------------------------ DataGadget save / load across formats and placements

EXT = {"npy": ".npy", "hdf5": ".h5", "zarr": ".zarr"}


@pytest.mark.parametrize("dst", FORMATS)
@pytest.mark.parametrize("src", FORMATS)
def test_datagadget_cpu_to_file_to_cpu_roundtrip(tmp_path, src, dst):
    _need(src)
    _need(dst)
    rng = np.random.default_rng(0)
    arr = rng.standard_normal((37, 3)).astype(np.float32)
    g = gl.DataGadget(arr, placement="cpu")
    p1 = tmp_path / f"a{EXT[src]}"
    g.save(p1)
    f = gl.DataGadget(str(p1), placement="file")
    assert f.placement == "file"
    np.testing.assert_array_equal(f.getNumpyVersion(), arr)
    p2 = tmp_path / f"b{EXT[dst]}"
    f.save(str(p2))
    f.close()
    h = gl.DataGadget(np.zeros((2, 2), np.float64), placement="cpu")
    h.load(p2)
    assert h.placement == "cpu" and h.dtype == torch.float32 and h.shape == (37, 3)
    np.testing.assert_array_equal(h.getNumpyVersion(), arr)


@pytest.mark.parametrize(
    "fmt,dtype",
    [("npy", "int64"), ("hdf5", "bool"), ("zarr", "float16"), ("npy", "bool"), ("zarr", "int64")],
)
def test_datagadget_dtypes_roundtrip(tmp_path, fmt, dtype):
    _need(fmt)
    rng = np.random.default_rng(1)
    arr = (rng.standard_normal((11, 2, 2)) * 50).astype(dtype)
    g = gl.DataGadget(arr, placement="cpu")
    p = tmp_path / f"t{EXT[fmt]}"
    g.save(p)
    h = gl.DataGadget(p, placement="cpu")
    np.testing.assert_array_equal(h.getNumpyVersion(), arr)
    assert h.getNumpyVersion().dtype == arr.dtype


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_datagadget_bfloat16_roundtrip(tmp_path, fmt):
    _need(fmt)
    t = torch.randn(9, 3).to(torch.bfloat16)
    g = gl.DataGadget(t, placement="cpu")
    p = tmp_path / f"t{EXT[fmt]}"
    g.save(p)
    h = gl.DataGadget(p, placement="cpu")
    assert h.dtype == torch.bfloat16
    assert torch.equal(h.getData(slice(0, 9)), t)


def test_datagadget_file_table_load_keeps_placement(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    b = -np.arange(20, dtype=np.float32).reshape(10, 2)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    f = gl.DataGadget(tmp_path / "a.npy", placement="file")
    f.load(tmp_path / "b.npy")
    assert f.placement == "file" and f.shape == (10, 2)
    np.testing.assert_array_equal(f.getNumpyVersion(), b)
    f.close()


@pytest.mark.parametrize("as_path", [False, True])
def test_datagadget_savecupy_loadcupy_takes_files_shape_dtype(tmp_path, as_path):
    g = gl.DataGadget(np.arange(10, dtype=np.int32).reshape(5, 2), placement="cpu")
    target = tmp_path / "emb"
    g.saveCupy(target if as_path else str(target))
    assert (tmp_path / "emb.npy").exists()
    h = gl.DataGadget((3, 7), dtype="float64", placement="cpu")
    h.loadCupy(tmp_path / "emb.npy" if as_path else str(tmp_path / "emb.npy"))
    assert h.shape == (5, 2) and h.dtype == torch.int32
    np.testing.assert_array_equal(h.getNumpyVersion(), np.arange(10, dtype=np.int32).reshape(5, 2))


@pytest.mark.parametrize("bad", ["truncated", "missing", "uint32", "flipped_magic"])
@pytest.mark.parametrize("method", ["load", "loadCupy"])
def test_datagadget_bad_file_leaves_table(tmp_path, bad, method):
    g = gl.DataGadget(np.arange(8, dtype=np.float32).reshape(4, 2), placement="cpu")
    before = g.getNumpyVersion()
    p = tmp_path / "x.npy"
    if bad == "truncated":
        np.save(p, np.ones((50, 2), np.float32))
        p.write_bytes(p.read_bytes()[:-9])
        exc = gl.GadgetFileError
    elif bad == "missing":
        exc = gl.GadgetFileNotFoundError
    elif bad == "uint32":
        np.save(p, np.ones((4, 2), np.uint32))
        exc = gl.GadgetTypeError
    else:
        np.save(p, np.ones((4, 2), np.float32))
        data = bytearray(p.read_bytes())
        data[1] ^= 0xFF
        p.write_bytes(bytes(data))
        exc = gl.GadgetFileError
    with pytest.raises(exc):
        getattr(g, method)(str(p))
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    assert g.shape == (4, 2)


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_datagadget_load_damaged_hdf5_zarr_leaves_table(tmp_path, fmt):
    _need(fmt)
    src = gl.DataGadget(np.ones((64, 4), np.float32), placement="cpu")
    p = tmp_path / f"x{EXT[fmt]}"
    src.save(p)
    target = _zarr_chunks(p)[0] if fmt == "zarr" else p
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    g = gl.DataGadget(np.arange(8, dtype=np.float32).reshape(4, 2), placement="cpu")
    before = g.getNumpyVersion()
    with pytest.raises(gl.GadgetFileError):
        g.load(p)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


def test_interleaved_table_load_other_shape_refused(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    before = _snap(ma, oa)
    np.save(tmp_path / "w.npy", np.zeros((R_E + 1, D), np.float32))
    np.save(tmp_path / "d.npy", np.zeros((R_E, D), np.float64))
    with pytest.raises(gl.GadgetError):
        ma["e"].weight.load(tmp_path / "w.npy")
    with pytest.raises(gl.GadgetError):
        ma["e"].weight.load(tmp_path / "d.npy")
    _same(before, _snap(ma, oa))
    # a fitting file refills the interleaved table in place; the optimizer state stays
    new = np.full((R_E, D), 0.25, np.float32)
    np.save(tmp_path / "ok.npy", new)
    ma["e"].weight.load(tmp_path / "ok.npy")
    np.testing.assert_array_equal(ma["e"].weight.getNumpyVersion(), new)
    _same(before["opt"], _clone(oa.state_dict()))


def test_datagadget_save_bad_compression_keeps_old_file(tmp_path):
    _need("hdf5")
    p = tmp_path / "t.h5"
    gl.DataGadget(np.ones((5, 2), np.float32), placement="cpu").save(p)
    old = p.read_bytes()
    g = gl.DataGadget(np.zeros((5, 2), np.float32), placement="cpu")
    with pytest.raises((gl.GadgetValueError, gl.GadgetKeyError)):
        g.save(p, compression="nope")
    assert p.read_bytes() == old
    assert _listing(tmp_path) == ["t.h5"]


# ------------------------------------------------ sampler / loader state beside a checkpoint


def test_sampler_state_resumes_through_torch_save(tmp_path):
    s = gl.GadgetSampler(50, batch_size=7, order="random", seed=3)
    it = iter(s)
    first = [next(it).clone() for _ in range(3)]
    torch.save(s.state_dict(), tmp_path / "s.pt")
    rest_ref = [b.clone() for b in it]
    s2 = gl.GadgetSampler(50, batch_size=7, order="random", seed=99)
    s2.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    rest = [b.clone() for b in s2]
    assert len(rest) == len(rest_ref) and len(first) == 3
    for x, y in zip(rest, rest_ref, strict=True):
        assert torch.equal(x, y)


def test_sampler_state_for_other_batch_size_refused():
    s = gl.GadgetSampler(50, batch_size=7, seed=3)
    it = iter(s)
    next(it)
    sd = s.state_dict()
    s2 = gl.GadgetSampler(50, batch_size=8, seed=3)
    before = s2.state_dict()
    with pytest.raises(gl.GadgetValueError):
        s2.load_state_dict(sd)
    _same(before, s2.state_dict())


def test_loader_state_resumes(tmp_path):
    arr = np.arange(60, dtype=np.float32).reshape(30, 2)
    ds = gl.GadgetDataset(arr, device="cpu", placement="cpu")
    ld = gl.GadgetLoader(ds, batch_size=4, seed=1, order="random")
    it = iter(ld)
    for _ in range(3):
        next(it)
    torch.save(ld.state_dict(), tmp_path / "l.pt")
    ref = [b[0].clone() if isinstance(b, (list, tuple)) else b.clone() for b in it]
    ld2 = gl.GadgetLoader(ds, batch_size=4, seed=1, order="random")
    ld2.load_state_dict(torch.load(tmp_path / "l.pt", weights_only=True))
    got = [b[0].clone() if isinstance(b, (list, tuple)) else b.clone() for b in ld2]
    assert len(got) == len(ref) > 0
    for x, y in zip(got, ref, strict=True):
        assert torch.equal(x, y)


# ------------------------------------------------ more resume edges


def test_fresh_checkpoint_resets_a_trained_optimizer(tmp_path):
    ma, oa = _dropin(0)
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})  # no step yet
    _train(ma, oa, range(3))
    ref = _snap(ma, oa)
    mb, ob = _dropin(5)
    _train(mb, ob, range(10, 14))  # state and step counts that must all go
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    _train(mb, ob, range(3))
    _same(ref, _snap(mb, ob))


def test_tables_with_different_step_counts_resume(tmp_path):
    def only_e(model, opt, steps):
        for i in steps:
            ids, _bags, _y = _batch(i)
            opt.zero_grad()
            model["e"](ids).pow(2).sum().backward()
            opt.step()

    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    only_e(ma, oa, range(1, 4))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa}, format="npy")
    _train(ma, oa, range(4, 6))
    mb, ob = _dropin(2)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    _train(mb, ob, range(4, 6))
    _same(_snap(ma, oa), _snap(mb, ob))


def _grouped(seed):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(R_E, D, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbeddingBag(R_B, D, mode="sum", placement="cpu", device="cpu"),
            "h": torch.nn.Linear(D, 1),
        }
    )
    opt = gl.OffloadedOptimizer(
        torch.optim.Adam,
        [
            {"params": model["e"], "lr": 0.2},
            {"params": model["h"].parameters(), "lr": 0.01},
            model["b"],
        ],
        lr=0.05,
    )
    return model, opt


@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_param_groups_with_table_options_resume(tmp_path, fmt):
    _need(fmt)
    ma, oa = _grouped(0)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa}, format=fmt)
    _train(ma, oa, range(2, 4))
    mb, ob = _grouped(3)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    _train(mb, ob, range(2, 4))
    _same(_snap(ma, oa), _snap(mb, ob))


def test_add_param_group_resume_and_refusal_without_it(tmp_path):
    def build(seed, extra):
        m, o = _dropin(seed)
        torch.manual_seed(seed + 100)
        e2 = gl.OffloadedEmbedding(9, D, placement="cpu", device="cpu")
        if extra:
            o.add_param_group({"params": e2, "lr": 0.3})
        return m, o, e2

    def run(m, o, e2, steps):
        for i in steps:
            o.zero_grad()
            (_loss(m, i) + e2(torch.tensor([i % 9, (i * 5) % 9])).pow(2).sum()).backward()
            o.step()

    ma, oa, ea = build(0, True)
    run(ma, oa, ea, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "e2": ea, "optimizer": oa})
    run(ma, oa, ea, range(2, 4))
    mb, ob, eb = build(4, True)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "e2": eb, "optimizer": ob})
    run(mb, ob, eb, range(2, 4))
    _same(_snap(ma, oa), _snap(mb, ob))
    np.testing.assert_array_equal(ea.weight.getNumpyVersion(), eb.weight.getNumpyVersion())
    # an optimizer without that group does not fit the checkpoint: nothing changes
    mc, oc, ec = build(7, False)
    _train(mc, oc, range(1))
    before, e_before = _snap(mc, oc), ec.weight.getNumpyVersion()
    with pytest.raises((gl.GadgetValueError, gl.GadgetKeyError)):
        gl.load_checkpoint(tmp_path / "ck", {"model": mc, "e2": ec, "optimizer": oc})
    _same(before, _snap(mc, oc))
    np.testing.assert_array_equal(ec.weight.getNumpyVersion(), e_before)


def test_frozen_table_resume(tmp_path):
    def build(seed):
        m, o = _dropin(seed)
        m["b"].requires_grad_(False)
        return m, o

    ma, oa = build(0)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})
    _train(ma, oa, range(2, 4))
    mb, ob = build(1)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    _train(mb, ob, range(2, 4))
    _same(_snap(ma, oa), _snap(mb, ob))


def test_lookup_waiting_for_backward_is_retired_by_load(tmp_path):
    # tables only: a dense head's in-place load would break torch's own backward
    ma, oa = _dropin(0, head=False)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa})
    ref = _snap(ma, oa)
    mb, ob = _dropin(3, head=False)
    ob.zero_grad()
    loss = _loss(mb, 7)  # forward with grad, no backward yet
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    loss.backward()
    with pytest.raises(gl.GadgetValueError, match="before its rows were loaded"):
        ob.step()
    _same({k: ref[k] for k in ("e", "b")}, {k: v for k, v in _snap(mb).items() if k in ("e", "b")})


def test_switcher_checkpoint_other_optimizer_class_refused(tmp_path):
    a = _switchers(0)
    _sw_train(*a, range(2))
    gl.save_checkpoint(tmp_path / "ck", _sw_objs(*a))
    b = _switchers(3, "speedtorch", torch.optim.NAdam)
    _sw_train(*b, range(1))
    before = _sw_snap(*b)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(tmp_path / "ck", _sw_objs(*b))
    _same(before, _sw_snap(*b))


def test_switcher_checkpoint_other_dtype_refused(tmp_path):
    a = _switchers(0)
    _sw_train(*a, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"u": a[2]})
    torch.manual_seed(0)
    model = _SwModel()
    sw = gl.ModelFactory(model.u, R_E, D, datatype="float64", placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion()
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(tmp_path / "ck", {"u": sw})
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_unrelated_files_in_checkpoint_dir_survive_overwrite(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "notes.txt").write_text("mine")
    (ck / "model.e.weight.backup.npy").write_bytes(b"not a table of this checkpoint")
    ma, oa = _dropin(0)
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    _train(ma, oa, range(1))
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa})
    assert (ck / "notes.txt").read_text() == "mine"
    assert (ck / "model.e.weight.backup.npy").read_bytes() == b"not a table of this checkpoint"
    m, o = _dropin(2)
    gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(_snap(ma, oa), _snap(m, o))


def test_load_twice_is_idempotent(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": ma, "optimizer": oa}, format="npy")
    mb, ob = _dropin(1)
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    gl.load_checkpoint(tmp_path / "ck", {"model": mb, "optimizer": ob})
    _train(ma, oa, range(2, 3))
    _train(mb, ob, range(2, 3))
    _same(_snap(ma, oa), _snap(mb, ob))


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_damaged_chunk_without_verify_still_raises(tmp_path, fmt):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    _damage(ck, fmt, "flip", "model.b.")
    m, o = _victim()
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o}, verify=False)


def test_checkpoint_of_module_with_buffers(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.ModuleDict(
            {
                "e": gl.OffloadedEmbedding(R_E, D, placement="cpu", device="cpu"),
                "bn": torch.nn.BatchNorm1d(D),
            }
        )
        return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)

    def run(m, o, steps):
        for i in steps:
            ids, _b, _y = _batch(i)
            o.zero_grad()
            m["bn"](m["e"](ids.view(-1))).pow(2).mean().backward()
            o.step()

    ma, oa = build(0)
    run(ma, oa, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"m": ma, "o": oa})
    run(ma, oa, range(2, 4))
    mb, ob = build(1)
    gl.load_checkpoint(tmp_path / "ck", {"m": mb, "o": ob})
    run(mb, ob, range(2, 4))
    _same(_clone(ma["bn"].state_dict()), _clone(mb["bn"].state_dict()))
    _same(_clone(oa.state_dict()), _clone(ob.state_dict()))
    np.testing.assert_array_equal(
        ma["e"].weight.getNumpyVersion(), mb["e"].weight.getNumpyVersion()
    )


@pytest.mark.parametrize(
    "bad", ["shape", "missing_state", "extra_state", "dtype_int", "one_table_less", "params_ids"]
)
def test_optimizer_load_state_dict_bad_entry_refused_unchanged(bad):
    ma, oa = _dropin(0)
    _train(ma, oa, range(3))
    sd = _clone(oa.state_dict())
    t = sd["tables"][-1]
    if bad == "shape":
        t["exp_avg_sq"] = torch.zeros(R_B + 1, D)
    elif bad == "missing_state":
        del t["exp_avg_sq"]
    elif bad == "extra_state":
        t["momentum_buffer"] = torch.zeros(R_B, D)
    elif bad == "dtype_int":
        t["exp_avg_sq"] = torch.zeros(R_B, D, dtype=torch.int32)
    elif bad == "one_table_less":
        sd["tables"] = sd["tables"][:-1]
    else:
        sd["inner"]["param_groups"][0]["params"] = sd["inner"]["param_groups"][0]["params"][:-1]
    mb, ob = _dropin(1)
    _train(mb, ob, range(10, 11))
    before = _snap(mb, ob)
    with pytest.raises(gl.GadgetError):
        ob.load_state_dict(sd)
    _same(before, _snap(mb, ob))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_replaced_table_file_of_other_shape_or_dtype_refused(tmp_path, fmt, bad):
    _need(fmt)
    ma, oa = _dropin(0)
    _train(ma, oa, range(2))
    ck = tmp_path / "ck"
    gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, format=fmt)
    f = _table_file(ck, "model.e.")
    arr = np.zeros((R_E + 2, D), np.float32) if bad == "shape" else np.zeros((R_E, D), np.float64)
    if f.is_dir():
        shutil.rmtree(f)
    else:
        f.unlink()
    gl.DataGadget(arr, placement="cpu").save(f, format=fmt)
    m, o = _victim()
    before = _snap(m, o)
    exc = gl.GadgetTypeError if bad == "dtype" else (gl.GadgetValueError, gl.GadgetKeyError)
    with pytest.raises(exc):
        gl.load_checkpoint(ck, {"model": m, "optimizer": o})
    _same(before, _snap(m, o))


def test_fresh_switcher_model_with_other_variable_rows_loads(tmp_path):
    a = _switchers(0, rows=6)
    _sw_train(*a, range(2))
    gl.save_checkpoint(tmp_path / "ck", _sw_objs(*a))
    _sw_train(*a, range(2, 4))
    b = _switchers(3, rows=11)  # per-step variable of another size: not saved, not checked
    gl.load_checkpoint(tmp_path / "ck", _sw_objs(*b))
    _sw_train(*b, range(2, 4))
    sa, sb = _sw_snap(*a), _sw_snap(*b)
    _same(sa["table"], sb["table"])
    _same(sa["state"], sb["state"])
    _same(sa["lin"], sb["lin"])


def test_save_checkpoint_bad_progress_refused_before_anything_is_made(tmp_path):
    # README: "Bad arguments (progress="False", ...) are refused before any file is made";
    # every other refused argument of save_checkpoint leaves no directory behind.
    ma, oa = _dropin(0)
    ck = tmp_path / "ck"
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(ck, {"model": ma, "optimizer": oa}, progress="False")
    assert not ck.exists()


@pytest.mark.parametrize("verify", ["no", None])
def test_load_checkpoint_verify_must_be_bool(saved_dropin, verify):
    m, o = _victim()
    before = _snap(m, o)
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(saved_dropin, {"model": m, "optimizer": o}, verify=verify)
    _same(before, _snap(m, o))


class _PathLike:
    def __init__(self, p):
        self.p = p

    def __fspath__(self):
        return str(self.p)


def test_custom_pathlike_and_bytes_paths(tmp_path):
    ma, oa = _dropin(0)
    _train(ma, oa, range(1))
    gl.save_checkpoint(_PathLike(tmp_path / "ck"), {"model": ma, "optimizer": oa})
    mb, ob = _dropin(1)
    gl.load_checkpoint(_PathLike(tmp_path / "ck"), {"model": mb, "optimizer": ob})
    _same(_snap(ma, oa), _snap(mb, ob))
    with pytest.raises(gl.GadgetTypeError, match="fsdecode"):
        gl.save_checkpoint(os.fsencode(str(tmp_path / "ck2")), {"model": ma, "optimizer": oa})
    assert not (tmp_path / "ck2").exists()


@pytest.mark.parametrize("layout", ["fortran", "big_endian", "non_contiguous_torch"])
def test_switcher_and_gadget_loads_of_other_layouts(tmp_path, layout):
    arr = np.random.default_rng(2).standard_normal((R_E, D)).astype(np.float32)
    a = _switchers(0)
    sw = a[2]
    g = gl.DataGadget((2, 2), dtype="float32", placement="cpu")
    if layout == "non_contiguous_torch":
        torch.save(torch.from_numpy(arr).T.contiguous().T, tmp_path / "t.pt")
        sw.loadTorch(tmp_path / "t.pt")
        np.testing.assert_array_equal(sw.getNumpyVersion(), arr)
        return
    p = tmp_path / "t.npy"
    np.save(p, np.asfortranarray(arr) if layout == "fortran" else arr.astype(">f4"))
    sw.loadCupy(p)
    g.loadCupy(p)
    np.testing.assert_array_equal(sw.getNumpyVersion(), arr)
    np.testing.assert_array_equal(g.getNumpyVersion(), arr)


def test_model_switcher_loadtorch_of_a_dict_refused(tmp_path):
    a = _switchers(0)
    before = a[2].getNumpyVersion()
    torch.save({"weight": torch.zeros(R_E, D)}, tmp_path / "d.pt")
    with pytest.raises(gl.GadgetValueError):
        a[2].loadTorch(tmp_path / "d.pt")
    np.testing.assert_array_equal(a[2].getNumpyVersion(), before)


def test_savecupy_suffix_follows_numpy(tmp_path):
    a = _switchers(0)
    a[2].saveCupy(str(tmp_path / "x.npy"))
    a[2].saveCupy(str(tmp_path / "y.NPY"))
    np.save(tmp_path / "ref.NPY", np.zeros(1))
    names = _listing(tmp_path)
    assert "x.npy" in names and "x.npy.npy" not in names
    # numpy.save appends to a name not ending in ".npy" exactly
    assert ("ref.NPY.npy" in names) == ("y.NPY.npy" in names)
