"""Checkpoint and resume: tables and all optimizer state (step counts included) go
through the store's save; continued training is bit-identical."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from torch import nn

import gadgetloader as gl
from gadgetloader import io as gl_io

N, D = 40, 6


class Model(nn.Module):
    def __init__(self, placement: str, device, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        init = torch.randn(N, D, generator=g)
        self.emb = gl.OffloadedEmbeddingBag(
            N, D, "mean", placement, device=device, init=lambda t: t.copy_(init.to(t.device))
        )
        self.lin = nn.Linear(D, 1).to(device)

    def forward(self, ids):
        return self.lin(self.emb(ids)).squeeze(-1)


def _batches(device, seed, steps):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, N, (5, 3), generator=g).to(device),
            torch.randn(5, generator=g).to(device),
        )
        for _ in range(steps)
    ]


def _train(model, opt, batches):
    for ids, y in batches:
        opt.zero_grad()
        (model(ids) - y).pow(2).sum().backward()
        opt.step()


def _tables(model, opt):
    out = [
        torch.from_numpy(model.emb.table.getNumpyVersion()),
        model.lin.weight.detach().cpu().clone(),
    ]
    for pager in opt.pagers:
        out += [torch.from_numpy(t.getNumpyVersion()) for t in pager.tables.values()]
    return out


FORMATS = ["npy"] + [f for f in ("hdf5", "zarr") if f in gl_io.FORMATS]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("name", "kw"),
    [("Adam", {"lr": 0.05}), ("Rprop", {"lr": 0.02}), ("ASGD", {"lr": 0.05, "t0": 2})],
)
def test_dropin_resume_is_bit_identical(tmp_path, placement, device, name, kw, fmt):
    cls = getattr(torch.optim, name)
    first, second = _batches(device, 1, 3), _batches(device, 2, 3)
    a = Model(placement, device, 0)
    opt_a = gl.OffloadedOptimizer(cls, a, **kw)
    _train(a, opt_a, first)
    gl.save_checkpoint(tmp_path / "ck", {"model": a, "optimizer": opt_a}, format=fmt)
    _train(a, opt_a, second)

    b = Model(placement, device, 99)  # different init: everything must come from the checkpoint
    opt_b = gl.OffloadedOptimizer(cls, b, **kw)
    gl.load_checkpoint(tmp_path / "ck", {"model": b, "optimizer": opt_b})
    _train(b, opt_b, second)
    for x, y in zip(_tables(a, opt_a), _tables(b, opt_b), strict=False):
        assert torch.equal(x, y)
    sa = opt_a.inner.state[a.emb._slot.param]["step"]
    sb = opt_b.inner.state[b.emb._slot.param]["step"]
    assert float(sa) == float(sb) == 6


def test_speedtorch_switchers_resume_is_bit_identical(tmp_path, placement, device):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.ModuleDict({"u": nn.Embedding(1, D), "v": nn.Embedding(1, D)}).to(device)
        opt = torch.optim.Adamax(model.parameters(), lr=0.05)
        u = gl.ModelFactory(model["u"], N, D, placement=placement)
        v = gl.ModelFactory(model["v"], N, D, placement=placement)
        u.uniformDistributionInit(-0.5, 0.5)
        v.uniformDistributionInit(-0.5, 0.5)
        uo = gl.OptimizerFactory(opt, N, D, model, "u", placement=placement)
        vo = gl.OptimizerFactory(opt, N, D, model, "v", placement=placement)
        uo.optInit()
        vo.optInit()
        return model, opt, u, v, uo, vo

    def train(parts, seed, steps):
        model, opt, u, v, uo, vo = parts
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            c = torch.randint(0, N, (8,), generator=g).to(device)
            x = torch.randint(0, N, (8, 2), generator=g).to(device)
            lc, lx = u.beforeForwardPass(c), v.beforeForwardPass(x)
            uo.beforeForwardPass(c)
            vo.beforeForwardPass(x)
            opt.zero_grad()
            (-F.logsigmoid((model["u"](lc).unsqueeze(1) * model["v"](lx)).sum(-1)).sum()).backward()
            opt.step()
            u.afterOptimizerStep(c)
            v.afterOptimizerStep(x)
            uo.afterOptimizerStep(c)
            vo.afterOptimizerStep(x)

    def objects(parts):
        _, opt, u, v, uo, vo = parts
        return {"u": u, "v": v, "u_opt": uo, "v_opt": vo, "optimizer": opt}

    a = build(0)
    train(a, 1, 3)
    gl.save_checkpoint(tmp_path / "ck", objects(a))
    train(a, 2, 3)
    b = build(5)
    gl.load_checkpoint(tmp_path / "ck", objects(b))
    train(b, 2, 3)
    for x, y in zip((a[2], a[3]), (b[2], b[3]), strict=False):
        assert torch.equal(
            torch.from_numpy(x.getNumpyVersion()), torch.from_numpy(y.getNumpyVersion())
        )
    for x, y in zip((a[4], a[5]), (b[4], b[5]), strict=False):
        for k in x.tables:
            assert torch.equal(
                torch.from_numpy(x.tables[k].getNumpyVersion()),
                torch.from_numpy(y.tables[k].getNumpyVersion()),
            )
    assert (
        float(a[1].state[a[0]["u"].weight]["step"])
        == float(b[1].state[b[0]["u"].weight]["step"])
        == 6
    )


def test_checkpoint_errors(tmp_path, device):
    m = Model("cpu", device, 0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    with pytest.raises(gl.GadgetFileNotFoundError, match="meta.pt"):
        gl.load_checkpoint(tmp_path / "nothing", {"model": m})
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": opt})
    with pytest.raises(gl.GadgetKeyError, match="no object 'opt'"):
        gl.load_checkpoint(tmp_path / "ck", {"opt": opt})
    with pytest.raises(gl.GadgetValueError, match="is a module"):
        gl.load_checkpoint(tmp_path / "ck", {"model": opt})
    with pytest.raises(gl.GadgetKeyError, match="Unknown format"):
        gl.save_checkpoint(tmp_path / "ck2", {"model": m}, format="csv")
    with pytest.raises(gl.GadgetTypeError, match="save_checkpoint takes"):
        gl.save_checkpoint(tmp_path / "ck3", {"x": 3})
    small = nn.Module()
    small.emb = gl.OffloadedEmbedding(N + 1, D, "cpu", device=device)
    with pytest.raises(gl.GadgetValueError, match="expected"):
        gl.load_checkpoint(tmp_path / "ck", {"model": _Wrap(small)})


class _Wrap(nn.Module):
    """Same module structure as Model but a table of another size."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.emb = inner.emb
        self.lin = nn.Linear(D, 1)


def test_bfloat16_checkpoint_needs_hdf5_or_zarr(tmp_path) -> None:
    import os

    m = torch.nn.ModuleDict(
        {"e": gl.OffloadedEmbedding(10, 4, placement="cpu", dtype=torch.bfloat16)}
    )
    with pytest.raises(gl.GadgetTypeError, match="format='hdf5'"):
        gl.save_checkpoint(tmp_path / "c", {"model": m})
    assert not os.path.exists(tmp_path / "c")  # refused before writing anything
    gl.save_checkpoint(tmp_path / "z", {"model": m}, format="zarr")
    before = m["e"].table.getNumpyVersion()
    m["e"].table.zero_()
    gl.load_checkpoint(tmp_path / "z", {"model": m})
    assert (m["e"].table.getNumpyVersion() == before).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_save_killed_part_way_leaves_the_previous_checkpoint_whole(
    tmp_path, device, fmt, monkeypatch
):
    import os

    first, second = _batches(device, 1, 3), _batches(device, 2, 3)
    a = Model("cpu", device, 0)
    opt_a = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    _train(a, opt_a, first)
    gl.save_checkpoint(tmp_path / "ck", {"model": a, "optimizer": opt_a}, format=fmt)
    saved = _tables(a, opt_a)
    files_before = sorted(os.listdir(tmp_path / "ck"))
    _train(a, opt_a, second)

    calls = {"n": 0}
    real_save = gl.DataGadget.save

    def dying_save(self, *args, **kwargs):  # the second table file never completes
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(gl.DataGadget, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        gl.save_checkpoint(tmp_path / "ck", {"model": a, "optimizer": opt_a}, format=fmt)
    monkeypatch.setattr(gl.DataGadget, "save", real_save)

    b = Model("cpu", device, 99)
    opt_b = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    gl.load_checkpoint(tmp_path / "ck", {"model": b, "optimizer": opt_b})
    for x, y in zip(saved, _tables(b, opt_b), strict=True):
        assert torch.equal(x, y)  # the first checkpoint, not a mix with the second

    # a completed overwrite removes the previous checkpoint's table files
    gl.save_checkpoint(tmp_path / "ck", {"model": a, "optimizer": opt_a}, format=fmt)
    left = set(os.listdir(tmp_path / "ck"))
    assert len(left) == len(files_before), (files_before, left)


def test_switchers_resume_with_the_model_in_the_checkpoint(tmp_path, placement, device):
    """The model's per-step variables (one batch's rows) are left out of the checkpoint, so a
    freshly built model of the original size loads it and continues bit-identically."""

    def build(seed):
        torch.manual_seed(seed)
        model = nn.ModuleDict(
            {"u": nn.Embedding(1, D), "v": nn.Embedding(1, D), "head": nn.Linear(D, 1)}
        ).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        u = gl.ModelFactory(model["u"], N, D, placement=placement)
        v = gl.ModelFactory(model["v"], N, D, placement=placement)
        u.uniformDistributionInit(-0.5, 0.5)
        v.uniformDistributionInit(-0.5, 0.5)
        uo = gl.OptimizerFactory(opt, N, D, model, "u", placement=placement)
        vo = gl.OptimizerFactory(opt, N, D, model, "v", placement=placement)
        uo.optInit()
        vo.optInit()
        return model, opt, u, v, uo, vo

    def train(parts, seed, steps):
        model, opt, u, v, uo, vo = parts
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            c = torch.randint(0, N, (8,), generator=g).to(device)
            x = torch.randint(0, N, (8, 2), generator=g).to(device)
            lc, lx = u.beforeForwardPass(c), v.beforeForwardPass(x)
            uo.beforeForwardPass(c)
            vo.beforeForwardPass(x)
            opt.zero_grad()
            uc = model["u"](lc)
            loss = -F.logsigmoid((uc.unsqueeze(1) * model["v"](lx)).sum(-1)).sum()
            (loss + model["head"](uc).pow(2).sum()).backward()
            opt.step()
            u.afterOptimizerStep(c)
            v.afterOptimizerStep(x)
            uo.afterOptimizerStep(c)
            vo.afterOptimizerStep(x)

    def objects(parts):
        model, opt, u, v, uo, vo = parts
        return {"model": model, "u": u, "v": v, "u_opt": uo, "v_opt": vo, "optimizer": opt}

    a = build(0)
    train(a, 1, 3)
    gl.save_checkpoint(tmp_path / "ck", objects(a))
    train(a, 2, 3)
    b = build(5)  # per-step variables of one row again
    gl.load_checkpoint(tmp_path / "ck", objects(b))
    train(b, 2, 3)
    assert torch.equal(a[0]["head"].weight, b[0]["head"].weight)
    assert torch.equal(a[0]["head"].bias, b[0]["head"].bias)
    for x, y in ((a[2], b[2]), (a[3], b[3])):
        assert torch.equal(
            torch.from_numpy(x.getNumpyVersion()), torch.from_numpy(y.getNumpyVersion())
        )
