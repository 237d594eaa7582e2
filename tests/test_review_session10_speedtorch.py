"""Review (session 10): SpeedTorch's switcher API as its users write it, against references.

Every check here is a documented promise (README "Training embeddings larger than GPU
memory", SPEC.md "Names that users already write", the switcher docstrings):

* a word2vec loop (two tables, one optimizer) through ModelFactory / OptimizerFactory
  equals the same torch optimizer on two dense full tables with lazy per-row updates
  (rows outside a batch untouched, one step count per table), for every listed optimizer;
* SpeedTorch's ``variableTransformer`` dummies give one row per id position, the copy
  written back last wins;
* datatype / dtype forms, deviceType / pinType combinations, unsupported optimizers,
  bad ids that change nothing;
* saveCupy / loadCupy, save / load (.npy, .h5, .zarr), saveTorch / loadTorch, checkpoints
  and bit-identical resume.
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gadgetloader as gl

N, D = 48, 16  # D = 16: whole vectors, so CPU kernels round alike on any row count
B, K = 6, 3  # pairs per batch, negatives per pair
STEPS = 4

CONFIGS = [
    ("SGD", {"lr": 0.3}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SparseAdam", {"lr": 0.05}),
    ("Adam", {"lr": 0.05}),
    ("Adam", {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.05, "maximize": True}),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.1}),
    ("AdamW", {"lr": 0.05, "amsgrad": True}),
    ("Adamax", {"lr": 0.05, "weight_decay": 0.01}),
    ("Adadelta", {"lr": 1.0, "weight_decay": 0.01}),
    ("RMSprop", {"lr": 0.01}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.9}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.01}),
    ("Rprop", {"lr": 0.02, "etas": (0.4, 1.3), "step_sizes": (1e-4, 1.0)}),
    ("ASGD", {"lr": 0.05, "t0": 2, "lambd": 1e-3, "weight_decay": 0.01}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("NAdam", {"lr": 0.05, "weight_decay": 0.01}),
    ("NAdam", {"lr": 0.05, "decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("RAdam", {"lr": 0.05}),
    ("RAdam", {"lr": 0.05, "decoupled_weight_decay": True, "weight_decay": 0.01}),
]


def _cid(c):
    name, kw = c
    extra = ",".join(f"{k}={v}" for k, v in kw.items() if k != "lr")
    return f"{name}[{extra}]" if extra else name


def _opt(name, params, kw):
    cls = getattr(torch.optim, name)
    accepted = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in kw.items() if k in accepted}
    return cls(params, **kw)


class SkipGram(nn.Module):
    """word2vec skip-gram with negative sampling, on whatever rows the embeddings hold."""

    def __init__(self, rows_u: int, rows_v: int, sparse: bool = False) -> None:
        super().__init__()
        self.u_embeddings = nn.Embedding(rows_u, D, sparse=sparse)
        self.v_embeddings = nn.Embedding(rows_v, D, sparse=sparse)

    def forward(self, c, p, n):
        return _loss(self.u_embeddings(c), self.v_embeddings(p), self.v_embeddings(n))


def _loss(u, vp, vn):
    pos = F.logsigmoid((u * vp).sum(-1)).sum()
    neg = F.logsigmoid(-(u * vn).sum(-1)).sum()
    return -(pos + neg)


def _batches(seed, steps=STEPS, n=N):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        center = torch.randint(0, n, (B, 1), generator=g)
        ctx = torch.randint(0, n, (B, 1), generator=g)
        neg = torch.randint(0, n, (B, K), generator=g)
        center[1] = center[0]  # repeats inside a table's batch ...
        neg[0, 1] = neg[0, 0]
        neg[2, 0] = ctx[3, 0]  # ... and between the positives and negatives of one table
        out.append((center, ctx, neg))
    return out


def _fresh_rows(name, kw, dtype=torch.float32):
    """The row-shaped state torch gives a never-trained row (a step on a zero row with a
    zero gradient; what that row holds if it had never been touched)."""
    z = torch.zeros((1, D), dtype=dtype, requires_grad=True)
    o = _opt(name, [z], kw)
    if name == "SparseAdam":
        z.grad = torch.sparse_coo_tensor(
            torch.zeros((1, 0), dtype=torch.long), torch.zeros(0, D, dtype=dtype), (1, D)
        )
    else:
        z.grad = torch.zeros_like(z)
    o.step()
    return {
        k: v.detach().clone()
        for k, v in o.state[z].items()
        if torch.is_tensor(v) and v.shape == z.shape
    }


class Reference:
    """Two dense full tables trained by the same torch optimizer with lazy per-row updates:
    after each step every row outside the batch (weights and row-shaped state) is restored."""

    def __init__(self, name, kw, u0, v0, make_opt=None):
        self.U = nn.Parameter(u0.clone())
        self.V = nn.Parameter(v0.clone())
        self.sparse = name == "SparseAdam"
        self.name = name
        self.opt = make_opt(self.U, self.V) if make_opt else _opt(name, [self.U, self.V], kw)
        self.fresh = {}

    def _fresh(self, p):
        """A fresh row's state under p's group as it is now (used for state that appears at
        this step: torch's first step for rows that never had it)."""
        group = next(g for g in self.opt.param_groups if any(q is p for q in g["params"]))
        hyper = {k: v for k, v in group.items() if k != "params"}
        return _fresh_rows(self.name, hyper, p.dtype)

    def step(self, center, ctx, neg):
        emb = lambda i, w: F.embedding(i, w, sparse=self.sparse)  # noqa: E731
        loss = _loss(emb(center, self.U), emb(ctx, self.V), emb(neg, self.V))
        self.opt.zero_grad()
        loss.backward()
        touched = {
            self.U: torch.unique(center),
            self.V: torch.unique(torch.cat([ctx.reshape(-1), neg.reshape(-1)])),
        }
        before = {}
        for p in (self.U, self.V):
            st = self.opt.state.get(p, {})
            before[p] = (
                p.detach().clone(),
                {k: v.clone() for k, v in st.items() if torch.is_tensor(v) and v.shape == p.shape},
            )
        fresh = {p: self._fresh(p) for p in (self.U, self.V)}
        self.opt.step()
        for p, rows in touched.items():
            keep = torch.ones(p.shape[0], dtype=torch.bool)
            keep[rows] = False
            w, st = before[p]
            with torch.no_grad():
                p[keep] = w[keep]
            for k, v in self.opt.state[p].items():
                if not (torch.is_tensor(v) and v.shape == p.shape):
                    continue
                if k in st:
                    v[keep] = st[k][keep]
                else:
                    v[keep] = fresh[p][k].to(v.dtype).expand(int(keep.sum()), D)
        return float(loss.detach())

    def state(self, p, key):
        return self.opt.state[p][key]


def _build(name, kw, *, placement="cpu", datatype="float32", init=True, seed=0, order="readme"):
    torch.manual_seed(seed)
    model = SkipGram(B, B * (1 + K), sparse=(name == "SparseAdam"))
    if datatype in ("float64", torch.float64):
        model = model.double()
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, datatype=datatype, placement=placement)
    v_sw = gl.ModelFactory(model.v_embeddings, N, D, datatype=datatype, placement=placement)
    if init:
        u_sw.uniformDistributionInit(-0.5, 0.5)
        v_sw.normalDistributionInit(0.0, 0.3)
    optimizer = _opt(name, model.parameters(), kw)
    u_opt = gl.OptimizerFactory(
        optimizer, N, D, model, "u_embeddings", dtype=datatype, placement=placement
    )
    v_opt = gl.OptimizerFactory(
        optimizer, N, D, model, "v_embeddings", dtype=datatype, placement=placement
    )
    u_opt.optInit()
    v_opt.optInit()
    return model, optimizer, u_sw, v_sw, u_opt, v_opt


def _train(parts, batches, order="readme"):
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    losses = []
    for center, ctx, neg in batches:
        if order == "readme":
            lc = u_sw.beforeForwardPass(center)
            u_opt.beforeForwardPass(center)
            lp, ln = v_sw.beforeForwardPass(ctx, neg)
            v_opt.beforeForwardPass(ctx, neg)
        else:  # optimizer switchers first, then the model switchers (SpeedTorch left it open)
            u_opt.beforeForwardPass(center)
            v_opt.beforeForwardPass(ctx, neg)
            lc = u_sw.beforeForwardPass(center)
            lp, ln = v_sw.beforeForwardPass(ctx, neg)
        loss = model(lc, lp, ln)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if order == "readme":
            u_sw.afterOptimizerStep(center)
            u_opt.afterOptimizerStep(center)
            v_sw.afterOptimizerStep(ctx, neg)
            v_opt.afterOptimizerStep(ctx, neg)
        else:
            u_opt.afterOptimizerStep(center)
            v_opt.afterOptimizerStep(ctx, neg)
            u_sw.afterOptimizerStep(center)
            v_sw.afterOptimizerStep(ctx, neg)
        losses.append(float(loss.detach()))
    return losses


def _close(a, b, exact):
    a = torch.as_tensor(np.asarray(a)) if not torch.is_tensor(a) else a
    b = torch.as_tensor(np.asarray(b)) if not torch.is_tensor(b) else b
    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------------------------
# 1. the README's word2vec loop equals lazy dense training, for every listed optimizer
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["readme", "optimizer-first"])
@pytest.mark.parametrize("config", CONFIGS, ids=_cid)
def test_word2vec_switchers_equal_lazy_dense_reference(config, order):
    name, kw = config
    parts = _build(name, kw)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    ref = Reference(
        name, kw, torch.from_numpy(u_sw.getNumpyVersion()), torch.from_numpy(v_sw.getNumpyVersion())
    )
    batches = _batches(1)
    losses = _train(parts, batches, order=order)
    ref_losses = [ref.step(*b) for b in batches]
    exact = name == "SGD" and not kw.get("momentum")
    _close(u_sw.getNumpyVersion(), ref.U.detach(), exact)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), exact)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for sw_opt, p in ((u_opt, ref.U), (v_opt, ref.V)):
        tables = sw_opt.getNumpyVersion()
        ref_keys = {
            k for k, v in ref.opt.state[p].items() if torch.is_tensor(v) and v.shape == p.shape
        }
        assert set(tables) == ref_keys, (set(tables), ref_keys)
        for k in ref_keys:
            _close(tables[k], ref.state(p, k), exact)
    # one step count per table, as torch keeps it for a parameter stepped every batch
    for sw_p, p in ((model.u_embeddings.weight, ref.U), (model.v_embeddings.weight, ref.V)):
        for k, v in ref.opt.state[p].items():
            if torch.is_tensor(v) and v.shape == p.shape:
                continue
            got = optimizer.state[sw_p][k]
            assert float(got) == pytest.approx(float(v)), k


def test_word2vec_exact_sgd_with_numpy_int32_ids_and_zeros_init():
    """SpeedTorch fed NumPy int32 ids; zerosInit as in SpeedTorch's example (v table)."""
    name, kw = "SGD", {"lr": 0.5}
    parts = _build(name, kw, init=False)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    u_sw.uniformDistributionInit(-0.5, 0.5)
    v_sw.zerosInit()
    assert not v_sw.getNumpyVersion().any()
    ref = Reference(
        name, kw, torch.from_numpy(u_sw.getNumpyVersion()), torch.from_numpy(v_sw.getNumpyVersion())
    )
    batches = _batches(2, steps=5)
    np_batches = [tuple(x.numpy().astype(np.int32) for x in b) for b in batches]
    _train(parts, np_batches)
    for b in batches:
        ref.step(*b)
    _close(u_sw.getNumpyVersion(), ref.U.detach(), True)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), True)
    assert v_sw.getNumpyVersion().any()


# ---------------------------------------------------------------------------------------
# 2. SpeedTorch's variableTransformer dummies: one row per id position, last copy wins
# ---------------------------------------------------------------------------------------
def _separate_reference(name, kw, u0, v0, batches):
    """SpeedTorch's protocol: per-position copies, each trained on its own, written back
    in position order (the last copy wins), state likewise; one step count per table."""
    U, V = u0.clone(), v0.clone()
    fresh = _fresh_rows(name, kw)
    pu = nn.Parameter(torch.zeros(B, D))
    pv = nn.Parameter(torch.zeros(B * (1 + K), D))
    opt = _opt(name, [pu, pv], kw)
    tables = {pu: {}, pv: {}}
    for center, ctx, neg in batches:
        ids = {pu: center.reshape(-1), pv: torch.cat([ctx.reshape(-1), neg.reshape(-1)])}
        full = {pu: U, pv: V}
        with torch.no_grad():
            for p in (pu, pv):
                p.copy_(full[p][ids[p]])
                for k, t in tables[p].items():
                    opt.state[p][k] = t[ids[p]].clone()
        loss = _loss(
            pu[torch.arange(B).reshape(B, 1)],
            pv[torch.arange(B).reshape(B, 1)],
            pv[torch.arange(B, B * (1 + K)).reshape(B, K)],
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for p in (pu, pv):
                for j, i in enumerate(ids[p].tolist()):
                    full[p][i] = p[j]
                for k, v in opt.state[p].items():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        if k not in tables[p]:
                            tables[p][k] = fresh[k].expand(N, D).clone()
                        for j, i in enumerate(ids[p].tolist()):
                            tables[p][k][i] = v[j]
    return U, V, tables[pu], tables[pv]


@pytest.mark.parametrize("config", [("SGD", {"lr": 0.3}), ("Adam", {"lr": 0.05})], ids=_cid)
def test_variable_transformer_dummies_follow_speedtorch_protocol(config):
    name, kw = config
    model, optimizer, u_sw, v_sw, u_opt, v_opt = _build(name, kw)
    u0 = torch.from_numpy(u_sw.getNumpyVersion())
    v0 = torch.from_numpy(v_sw.getNumpyVersion())
    du = u_sw.variableTransformer(B, 1)
    dp, dn = v_sw.variableTransformer(B, 1, K)
    assert isinstance(du, np.ndarray) and du.dtype == np.int64 and du.shape == (B, 1)
    assert dp.shape == (B, 1) and dn.shape == (B, K)
    assert dn.min() == B and dn.max() == B * (1 + K) - 1
    assert u_sw.duplicates == v_sw.duplicates == "separate"
    du_t, dp_t, dn_t = (torch.LongTensor(x) for x in (du, dp, dn))
    batches = _batches(3)
    for center, ctx, neg in batches:
        u_sw.beforeForwardPass(center)
        v_sw.beforeForwardPass(ctx, neg)
        u_opt.beforeForwardPass(center)
        v_opt.beforeForwardPass(ctx, neg)
        loss = model(du_t, dp_t, dn_t)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_sw.afterOptimizerStep(center)
        v_sw.afterOptimizerStep(ctx, neg)
        u_opt.afterOptimizerStep(center)
        v_opt.afterOptimizerStep(ctx, neg)
    U, V, su, sv = _separate_reference(name, kw, u0, v0, batches)
    exact = name == "SGD"
    _close(u_sw.getNumpyVersion(), U, exact)
    _close(v_sw.getNumpyVersion(), V, exact)
    for k in su:
        _close(u_opt.getNumpyVersion()[k], su[k], exact)
        _close(v_opt.getNumpyVersion()[k], sv[k], exact)


def test_variable_transformer_without_repeats_equals_merge():
    """Without repeated ids both layouts are the same training."""
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        perm = torch.randperm(N, generator=g)
        batches.append(
            (
                perm[:B].reshape(B, 1),
                perm[B : 2 * B].reshape(B, 1),
                perm[2 * B : 2 * B + B * K].reshape(B, K),
            )
        )
    outs = []
    for dummies in (False, True):
        model, optimizer, u_sw, v_sw, u_opt, v_opt = _build("Adam", {"lr": 0.05}, seed=9)
        if dummies:
            du = torch.from_numpy(u_sw.variableTransformer(B, 1))
            dp, dn = (torch.from_numpy(x) for x in v_sw.variableTransformer(B, 1, K))
        for center, ctx, neg in batches:
            lc = u_sw.beforeForwardPass(center)
            u_opt.beforeForwardPass(center)
            lp, ln = v_sw.beforeForwardPass(ctx, neg)
            v_opt.beforeForwardPass(ctx, neg)
            loss = model(du, dp, dn) if dummies else model(lc, lp, ln)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            u_sw.afterOptimizerStep(center)
            u_opt.afterOptimizerStep(center)
            v_sw.afterOptimizerStep(ctx, neg)
            v_opt.afterOptimizerStep(ctx, neg)
        outs.append(
            (u_sw.getNumpyVersion(), v_sw.getNumpyVersion(), v_opt.getNumpyVersion()["exp_avg_sq"])
        )
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------
# 3. datatype / dtype forms, deviceType / pinType, unsupported optimizers
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "datatype", ["float32", torch.float32, "float64", torch.float64, np.float64]
)
def test_datatype_strings_and_dtypes(datatype):
    emb = nn.Embedding(4, D)
    sw = gl.ModelFactory(emb, N, D, datatype=datatype, placement="cpu")
    want = torch.float64 if "64" in str(datatype) else torch.float32
    assert sw.table.dtype == want
    assert sw.getNumpyVersion().dtype == np.dtype(str(want).replace("torch.", ""))
    opt = torch.optim.Adam(nn.ModuleDict({"e": emb}).parameters(), lr=0.1)
    o = gl.OptimizerFactory(
        opt, N, D, nn.ModuleDict({"e": emb}), "e", dtype=datatype, placement="cpu"
    )
    o.optInit()
    assert {a.dtype for a in o.getNumpyVersion().values()} == {sw.getNumpyVersion().dtype}


def test_float16_table_makes_variable_and_state_rows_float16():
    """README: "A datatype other than the model variable's (e.g. float16 tables for a float32
    nn.Embedding) makes the variable that dtype while it is paged, and the optimizer's state
    rows follow it." """
    model = SkipGram(B, B * (1 + K))
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, datatype="float16", placement="cpu")
    v_sw = gl.ModelFactory(model.v_embeddings, N, D, datatype=torch.float16, placement="cpu")
    u_sw.uniformDistributionInit(-0.5, 0.5)
    v_sw.normalDistributionInit(0, 0.3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    u_opt = gl.OptimizerFactory(optimizer, N, D, model, "u_embeddings", placement="cpu")
    v_opt = gl.OptimizerFactory(optimizer, N, D, model, "v_embeddings", placement="cpu")
    u_opt.optInit()
    v_opt.optInit()
    before = u_sw.getNumpyVersion().copy()
    ((center, ctx, neg),) = _batches(4, steps=1)
    lc = u_sw.beforeForwardPass(center)
    u_opt.beforeForwardPass(center)
    lp, ln = v_sw.beforeForwardPass(ctx, neg)
    v_opt.beforeForwardPass(ctx, neg)
    assert model.u_embeddings.weight.dtype == torch.float16
    loss = model(lc, lp, ln)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    assert optimizer.state[model.u_embeddings.weight]["exp_avg"].dtype == torch.float16
    u_sw.afterOptimizerStep(center)
    u_opt.afterOptimizerStep(center)
    v_sw.afterOptimizerStep(ctx, neg)
    v_opt.afterOptimizerStep(ctx, neg)
    after = u_sw.getNumpyVersion()
    assert after.dtype == np.float16
    changed = np.flatnonzero((after != before).any(1))
    assert set(changed.tolist()) == set(torch.unique(center).tolist())


@pytest.mark.parametrize("datatype", ["int32", torch.int64, "bool"])
def test_integer_datatype_refused(datatype):
    with pytest.raises(gl.GadgetError):
        gl.ModelFactory(nn.Embedding(4, D), N, D, datatype=datatype, placement="cpu")


def _pytorch_parts(deviceType, pinType):
    torch.manual_seed(0)
    model = SkipGram(B, B * (1 + K))
    u_sw = gl.PytorchModelFactory(model.u_embeddings, N, D, deviceType=deviceType, pinType=pinType)
    v_sw = gl.PytorchModelFactory(model.v_embeddings, N, D, "float32", deviceType, pinType)
    u_sw.customInit(torch.nn.init.xavier_uniform_)
    v_sw.customInit(torch.nn.init.normal_, 0.0, 0.3)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5)
    u_opt = gl.PytorchOptimizerFactory(
        optimizer, N, D, model, "u_embeddings", deviceType=deviceType, pinType=pinType
    )
    v_opt = gl.PytorchOptimizerFactory(
        optimizer, N, D, model, "v_embeddings", "float32", deviceType, pinType
    )
    u_opt.optInit()
    v_opt.optInit()
    return model, optimizer, u_sw, v_sw, u_opt, v_opt


@pytest.mark.parametrize("deviceType,pinType", [("cpu", False), ("cpu", True), ("cuda", False)])
def test_pytorch_factories_device_and_pin_types(deviceType, pinType):
    needs_fallback = not torch.cuda.is_available() and (deviceType == "cuda" or pinType)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        parts = _pytorch_parts(deviceType, pinType)
    fallbacks = [
        w for w in rec if "cpu" in str(w.message).lower() or "cuda" in str(w.message).lower()
    ]
    if needs_fallback:
        assert len(fallbacks) >= 1  # "with one warning"
    else:
        assert not rec, [str(w.message) for w in rec]
    if not torch.cuda.is_available():
        assert parts[2].placement == parts[4].tables["square_avg"].placement == "cpu"
    u0 = torch.from_numpy(parts[2].getNumpyVersion())
    v0 = torch.from_numpy(parts[3].getNumpyVersion())
    ref = Reference("RMSprop", {"lr": 0.01, "momentum": 0.5}, u0, v0)
    batches = _batches(6)
    _train(parts, batches)
    for b in batches:
        ref.step(*b)
    _close(parts[2].getNumpyVersion(), ref.U.detach(), False)
    _close(parts[3].getNumpyVersion(), ref.V.detach(), False)


def test_pytorch_factory_unknown_device_type():
    with pytest.raises(gl.GadgetError) as ei:
        gl.PytorchModelFactory(nn.Embedding(4, D), N, D, deviceType="tpu")
    assert "cpu" in str(ei.value) and "cuda" in str(ei.value)


@pytest.mark.parametrize("factory", ["OptimizerFactory", "PytorchOptimizerFactory"])
@pytest.mark.parametrize("bad", ["LBFGS", "Adafactor"])
def test_unsupported_optimizer_lists_supported(factory, bad):
    cls = getattr(torch.optim, bad, None)
    if cls is None:
        pytest.skip(f"torch has no {bad}")
    model = SkipGram(B, B * (1 + K))
    opt = cls(model.parameters(), lr=0.1)
    kwargs = {"placement": "cpu"}
    with pytest.raises(TypeError) as ei:
        getattr(gl, factory)(opt, N, D, model, "u_embeddings", **kwargs)
    assert isinstance(ei.value, gl.GadgetError)
    msg = str(ei.value)
    for listed in (
        "SparseAdam",
        "Adam",
        "AdamW",
        "Adamax",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
        "Adagrad",
        "SGD",
        "NAdam",
        "RAdam",
    ):
        assert listed in msg, listed
    assert bad in msg


def test_subclass_of_supported_optimizer_is_accepted():
    class MyAdam(torch.optim.Adam):
        pass

    model = SkipGram(B, B * (1 + K))
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    opt = MyAdam(model.parameters(), lr=0.1)
    o = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement="cpu")
    o.optInit()
    assert set(o.getNumpyVersion()) == {"exp_avg", "exp_avg_sq"}
    assert u_sw.table.shape == (N, D)


# ---------------------------------------------------------------------------------------
# 4. bad ids change nothing
# ---------------------------------------------------------------------------------------
def _snapshot(parts):
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    snap = [u_sw.getNumpyVersion().copy(), v_sw.getNumpyVersion().copy()]
    for o in (u_opt, v_opt):
        snap += [a.copy() for _, a in sorted(o.getNumpyVersion().items())]
    for p in model.parameters():
        for _k, v in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(v) and v.dim() == 0:
                snap.append(v.clone().numpy())
    return snap


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


BAD_IDS = {
    "negative": lambda: (torch.tensor([[1], [-1], [2], [3], [4], [5]]), None),
    "out_of_range": lambda: (torch.tensor([[1], [N], [2], [3], [4], [5]]), None),
    "float": lambda: (torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]]), None),
    "numpy_float": lambda: (np.arange(6, dtype=np.float32).reshape(6, 1), None),
    "neg_out_of_range": lambda: (torch.arange(6).reshape(6, 1), torch.full((B, K), N + 3)),
}


@pytest.mark.parametrize("kind", list(BAD_IDS))
def test_bad_ids_change_nothing_and_training_continues(kind):
    name, kw = "Adam", {"lr": 0.05}
    parts = _build(name, kw)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    warm = _batches(7, steps=2)
    _train(parts, warm)
    snap = _snapshot(parts)
    pos, neg = BAD_IDS[kind]()
    sw, osw = (v_sw, v_opt) if neg is not None else (u_sw, u_opt)
    for call in (sw.beforeForwardPass, osw.beforeForwardPass):
        with pytest.raises(gl.GadgetError) as ei:
            call(pos, neg) if neg is not None else call(pos)
        assert isinstance(ei.value, (IndexError, TypeError))
        _same(snap, _snapshot(parts))
    # training carries on as if the bad call had never happened
    ref_parts = _build(name, kw)
    _train(ref_parts, warm)
    more = _batches(8, steps=2)
    _train(parts, more)
    _train(ref_parts, more)
    _same(_snapshot(parts), _snapshot(ref_parts))


def test_after_optimizer_step_with_other_ids_writes_nothing():
    parts = _build("Adam", {"lr": 0.05})
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    ((center, ctx, neg),) = _batches(9, steps=1)
    lc = u_sw.beforeForwardPass(center)
    u_opt.beforeForwardPass(center)
    lp, ln = v_sw.beforeForwardPass(ctx, neg)
    v_opt.beforeForwardPass(ctx, neg)
    loss = model(lc, lp, ln)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    snap = _snapshot(parts)
    other = (center + 1) % N
    with pytest.raises(gl.GadgetError):
        u_sw.afterOptimizerStep(other)
    with pytest.raises(gl.GadgetError):
        u_opt.afterOptimizerStep(other)
    with pytest.raises(gl.GadgetError):
        u_sw.afterOptimizerStep(torch.full_like(center, -1))
    _same(snap, _snapshot(parts))


# ---------------------------------------------------------------------------------------
# 5. save / load and resume
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr"])
def test_model_switch_save_load_roundtrip(tmp_path, ext):
    parts = _build("SGD", {"lr": 0.1})
    _train(parts, _batches(10, steps=2))
    u_sw = parts[2]
    want = u_sw.getNumpyVersion().copy()
    path = tmp_path / f"u{ext}"
    u_sw.save(path)
    u_sw.zerosInit()
    assert not u_sw.getNumpyVersion().any()
    u_sw.load(path)
    np.testing.assert_array_equal(u_sw.getNumpyVersion(), want)


def test_save_cupy_appends_npy_and_load_cupy_roundtrip(tmp_path):
    parts = _build("Adagrad", {"lr": 0.1})
    _train(parts, _batches(11, steps=2))
    v_sw = parts[3]
    want = v_sw.getNumpyVersion().copy()
    v_sw.saveCupy(str(tmp_path / "vemb"))
    assert (tmp_path / "vemb.npy").exists()
    np.testing.assert_array_equal(np.load(tmp_path / "vemb.npy"), want)
    v_sw.normalDistributionInit(0, 1)
    v_sw.loadCupy(str(tmp_path / "vemb.npy"))
    np.testing.assert_array_equal(v_sw.getNumpyVersion(), want)


def test_load_cupy_wrong_shape_or_dtype_changes_nothing(tmp_path):
    parts = _build("SGD", {"lr": 0.1})
    u_sw = parts[2]
    want = u_sw.getNumpyVersion().copy()
    np.save(tmp_path / "small.npy", np.zeros((N - 1, D), np.float32))
    np.save(tmp_path / "f64.npy", np.zeros((N, D), np.float64))
    for f in ("small.npy", "f64.npy"):
        with pytest.raises(gl.GadgetError):
            u_sw.loadCupy(str(tmp_path / f))
        np.testing.assert_array_equal(u_sw.getNumpyVersion(), want)


def test_save_torch_load_torch_model_and_optimizer(tmp_path):
    parts = _build("RMSprop", {"lr": 0.01, "momentum": 0.9, "centered": True})
    _train(parts, _batches(12, steps=2))
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    want_u = u_sw.getNumpyVersion().copy()
    want_s = {k: a.copy() for k, a in u_opt.getNumpyVersion().items()}
    assert set(want_s) == {"square_avg", "momentum_buffer", "grad_avg"}
    u_sw.saveTorch(tmp_path / "u.pt")
    u_opt.saveTorch(tmp_path / "uopt.pt")
    saved = torch.load(tmp_path / "uopt.pt", weights_only=True)
    assert isinstance(saved, dict) and set(saved) == set(want_s)
    # SpeedTorch's layout: a list of tensors in state order
    torch.save([saved[k] for k in u_opt.tables], tmp_path / "uopt_list.pt")
    u_sw.zerosInit()
    u_opt.customInit(torch.nn.init.constant_, 0.25)
    assert all((a == 0.25).all() for a in u_opt.getNumpyVersion().values())
    u_sw.loadTorch(tmp_path / "u.pt")
    u_opt.loadTorch(tmp_path / "uopt.pt")
    np.testing.assert_array_equal(u_sw.getNumpyVersion(), want_u)
    for k, a in u_opt.getNumpyVersion().items():
        np.testing.assert_array_equal(a, want_s[k])
    u_opt.customInit(torch.nn.init.zeros_)
    u_opt.loadTorch(tmp_path / "uopt_list.pt")
    for k, a in u_opt.getNumpyVersion().items():
        np.testing.assert_array_equal(a, want_s[k])


def test_load_torch_wrong_shape_changes_nothing(tmp_path):
    parts = _build("Adam", {"lr": 0.05})
    _train(parts, _batches(13, steps=1))
    u_opt = parts[4]
    want = {k: a.copy() for k, a in u_opt.getNumpyVersion().items()}
    torch.save(
        {"exp_avg": torch.ones(N, D), "exp_avg_sq": torch.ones(N + 1, D)}, tmp_path / "bad.pt"
    )
    with pytest.raises(gl.GadgetError):
        u_opt.loadTorch(tmp_path / "bad.pt")
    for k, a in u_opt.getNumpyVersion().items():
        np.testing.assert_array_equal(a, want[k])


def _objects(parts):
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    return {"model": model, "u": u_sw, "v": v_sw, "u_opt": u_opt, "v_opt": v_opt, "opt": optimizer}


def _full_state(parts):
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    out = {"u": u_sw.getNumpyVersion().copy(), "v": v_sw.getNumpyVersion().copy()}
    for n, o in (("u", u_opt), ("v", v_opt)):
        for k, a in o.getNumpyVersion().items():
            out[f"{n}.{k}"] = a.copy()
    for n, p in (("u", model.u_embeddings.weight), ("v", model.v_embeddings.weight)):
        for k, v in optimizer.state[p].items():
            if torch.is_tensor(v) and v.dim() == 0:
                out[f"{n}.scalar.{k}"] = v.clone().numpy()
            elif not torch.is_tensor(v):
                out[f"{n}.scalar.{k}"] = np.asarray(v)
    return out


RESUME = [
    ("Adam", {"lr": 0.05, "amsgrad": True}),
    ("ASGD", {"lr": 0.05, "t0": 2}),
    ("Rprop", {"lr": 0.02}),
    ("NAdam", {"lr": 0.05}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("SparseAdam", {"lr": 0.05}),
]


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
@pytest.mark.parametrize("config", RESUME, ids=_cid)
def test_checkpoint_resume_bit_identical(tmp_path, config, fmt):
    name, kw = config
    first, second = _batches(14, steps=3), _batches(15, steps=3)
    run = _build(name, kw, seed=1)
    _train(run, first)
    gl.save_checkpoint(tmp_path / "ckpt", _objects(run), format=fmt)
    _train(run, second)
    want = _full_state(run)

    # a fresh process: new model (another per-step size), switchers and optimizer, then load
    resumed = _build(name, kw, seed=2)
    assert not np.array_equal(resumed[2].getNumpyVersion(), run[2].getNumpyVersion())
    gl.load_checkpoint(tmp_path / "ckpt", _objects(resumed))
    _train(resumed, second)
    got = _full_state(resumed)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_checkpoint_with_switchers_only_and_optimizer(tmp_path):
    """The docstring's form: {"u": u_switch, "u_opt": u_opt_switch, "opt": optimizer}."""
    name, kw = "Adamax", {"lr": 0.05}
    first, second = _batches(16, steps=2), _batches(17, steps=2)
    run = _build(name, kw, seed=1)
    _train(run, first)
    objs = {k: v for k, v in _objects(run).items() if k != "model"}
    gl.save_checkpoint(tmp_path / "ck", objs)
    _train(run, second)
    resumed = _build(name, kw, seed=3)
    gl.load_checkpoint(
        tmp_path / "ck", {k: v for k, v in _objects(resumed).items() if k != "model"}
    )
    _train(resumed, second)
    a, b = _full_state(run), _full_state(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_checkpoint_mismatch_changes_nothing(tmp_path):
    run = _build("Adam", {"lr": 0.05}, seed=1)
    _train(run, _batches(18, steps=2))
    gl.save_checkpoint(tmp_path / "ck", _objects(run))
    other = _build("Adagrad", {"lr": 0.1}, seed=4)
    before = _full_state(other)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(tmp_path / "ck", _objects(other))
    after = _full_state(other)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_optinit_before_first_step_needs_no_rprop_warmup():
    """SPEC: "SpeedTorch needed one training step before it could switch Rprop;
    gadgetloader should not." -- fresh rows start with step_size = lr."""
    model = SkipGram(B, B * (1 + K))
    gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    opt = torch.optim.Rprop(model.parameters(), lr=0.037)
    o = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement="cpu")
    o.optInit()
    tables = o.getNumpyVersion()
    assert set(tables) == {"prev", "step_size"}
    np.testing.assert_allclose(tables["step_size"], np.full((N, D), 0.037, np.float32))
    assert not tables["prev"].any()


# ---------------------------------------------------------------------------------------
# 6. more loops users write: fresh id objects per call, param groups, schedulers,
#    batches of varying size, SpeedTorch's CPUPinn=True example as printed
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config", [("SGD", {"lr": 0.3}), ("Adam", {"lr": 0.05}), ("Rprop", {"lr": 0.02})], ids=_cid
)
def test_fresh_id_objects_on_every_call(config):
    """SpeedTorch users convert their NumPy ids anew for each call (lists, new arrays)."""
    name, kw = config
    parts = _build(name, kw)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    ref = Reference(
        name, kw, torch.from_numpy(u_sw.getNumpyVersion()), torch.from_numpy(v_sw.getNumpyVersion())
    )
    batches = _batches(21)
    for center, ctx, neg in batches:
        lc = u_sw.beforeForwardPass(center.tolist())
        u_opt.beforeForwardPass(center.numpy().astype(np.int32))
        lp, ln = v_sw.beforeForwardPass(ctx.numpy().copy(), neg.tolist())
        v_opt.beforeForwardPass(ctx.clone(), neg.clone())
        loss = model(lc, lp, ln)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_sw.afterOptimizerStep(center.clone())
        u_opt.afterOptimizerStep(center.tolist())
        v_sw.afterOptimizerStep(ctx.tolist(), neg.numpy().astype(np.int16))
        v_opt.afterOptimizerStep(ctx.numpy(), neg.numpy())
        ref.step(center, ctx, neg)
    exact = name == "SGD"
    _close(u_sw.getNumpyVersion(), ref.U.detach(), exact)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), exact)
    for k, a in v_opt.getNumpyVersion().items():
        _close(a, ref.state(ref.V, k), exact)


@pytest.mark.parametrize("name", ["Rprop", "Adagrad", "Adam"])
def test_param_groups_per_table(name):
    """One optimizer, one param group per table with its own options."""
    kws = {
        "Rprop": ({"lr": 0.1}, {"lr": 0.003}),
        "Adagrad": ({"lr": 0.2, "lr_decay": 0.1}, {"lr": 0.05}),
        "Adam": ({"lr": 0.05, "betas": (0.5, 0.9)}, {"lr": 0.01, "weight_decay": 0.1}),
    }[name]
    cls = getattr(torch.optim, name)
    extra = {"initial_accumulator_value": 0.3} if name == "Adagrad" else {}

    def make(u, v):
        return cls([{"params": [u], **kws[0]}, {"params": [v], **kws[1]}], **extra)

    torch.manual_seed(0)
    model = SkipGram(B, B * (1 + K))
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    v_sw = gl.ModelFactory(model.v_embeddings, N, D, placement="cpu")
    u_sw.uniformDistributionInit(-0.5, 0.5)
    v_sw.normalDistributionInit(0, 0.3)
    optimizer = make(model.u_embeddings.weight, model.v_embeddings.weight)
    u_opt = gl.OptimizerFactory(optimizer, N, D, model, "u_embeddings", placement="cpu")
    v_opt = gl.OptimizerFactory(optimizer, N, D, model, "v_embeddings", placement="cpu")
    u_opt.optInit()
    v_opt.optInit()
    if name == "Rprop":
        np.testing.assert_allclose(u_opt.getNumpyVersion()["step_size"], 0.1, rtol=1e-6)
        np.testing.assert_allclose(v_opt.getNumpyVersion()["step_size"], 0.003, rtol=1e-6)
    if name == "Adagrad":
        np.testing.assert_allclose(v_opt.getNumpyVersion()["sum"], 0.3, rtol=1e-6)
    ref = Reference(
        name,
        {},
        torch.from_numpy(u_sw.getNumpyVersion()),
        torch.from_numpy(v_sw.getNumpyVersion()),
        make_opt=make,
    )
    batches = _batches(22)
    _train((model, optimizer, u_sw, v_sw, u_opt, v_opt), batches)
    for b in batches:
        ref.step(*b)
    _close(u_sw.getNumpyVersion(), ref.U.detach(), False)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), False)
    for o, p in ((u_opt, ref.U), (v_opt, ref.V)):
        for k, a in o.getNumpyVersion().items():
            _close(a, ref.state(p, k), False)


@pytest.mark.parametrize(
    "case",
    ["rprop-warmup", "asgd-warmup", "adam-onecycle", "sgd-momentum-on"],
)
def test_lr_schedulers_with_switchers(case):
    """README: schedulers work, also ones that warm lr up before the first step or turn
    momentum on; Rprop's step_size and ASGD's eta start from the first step's lr."""
    name, kw = {
        "rprop-warmup": ("Rprop", {"lr": 0.05}),
        "asgd-warmup": ("ASGD", {"lr": 0.05, "t0": 2}),
        "adam-onecycle": ("Adam", {"lr": 0.05}),
        "sgd-momentum-on": ("SGD", {"lr": 0.1, "momentum": 0.0}),
    }[case]

    def sched(opt):
        if case in ("rprop-warmup", "asgd-warmup"):
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.2 * (s + 1))
        if case == "adam-onecycle":
            return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

        # momentum 0 for the first two steps, then 0.9 (a user-written schedule)
        class Mom:
            def __init__(self, o):
                self.o, self.n = o, 0

            def step(self):
                self.n += 1
                if self.n == 2:
                    for g in self.o.param_groups:
                        g["momentum"] = 0.9

        return Mom(opt)

    parts = _build(name, kw)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    s1 = sched(optimizer)
    ref = Reference(
        name, kw, torch.from_numpy(u_sw.getNumpyVersion()), torch.from_numpy(v_sw.getNumpyVersion())
    )
    s2 = sched(ref.opt)
    for b in _batches(23, steps=5):
        _train(parts, [b])
        s1.step()
        ref.step(*b)
        s2.step()
    _close(u_sw.getNumpyVersion(), ref.U.detach(), False)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), False)
    for o, p in ((u_opt, ref.U), (v_opt, ref.V)):
        tables = o.getNumpyVersion()
        for k, v in ref.opt.state[p].items():
            if torch.is_tensor(v) and v.shape == p.shape:
                _close(tables[k], v, False)
    for sw_p, p in ((model.u_embeddings.weight, ref.U), (model.v_embeddings.weight, ref.V)):
        for k, v in ref.opt.state[p].items():
            if not (torch.is_tensor(v) and v.shape == p.shape):
                assert float(optimizer.state[sw_p][k]) == pytest.approx(float(v), rel=1e-6), k


@pytest.mark.parametrize(
    "config",
    [
        ("Adam", {"lr": 0.05, "weight_decay": 0.1}),
        ("SGD", {"lr": 0.3}),
        ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.5}),
    ],
    ids=_cid,
)
def test_batches_of_varying_size(config):
    """A DataLoader's last batch is smaller; the next epoch's are full again (and larger
    than the variables were built for)."""
    name, kw = config
    parts = _build(name, kw)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    ref = Reference(
        name, kw, torch.from_numpy(u_sw.getNumpyVersion()), torch.from_numpy(v_sw.getNumpyVersion())
    )
    g = torch.Generator().manual_seed(24)
    batches = []
    for b in (6, 2, 1, 11, 3, 6):
        c = torch.randint(0, N, (b, 1), generator=g)
        p = torch.randint(0, N, (b, 1), generator=g)
        n = torch.randint(0, N, (b, K), generator=g)
        c[-1] = c[0]
        batches.append((c, p, n))
    _train(parts, batches)
    for bt in batches:
        ref.step(*bt)
    exact = name == "SGD"
    _close(u_sw.getNumpyVersion(), ref.U.detach(), exact)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), exact)
    for o, p in ((u_opt, ref.U), (v_opt, ref.V)):
        for k, a in o.getNumpyVersion().items():
            _close(a, ref.state(p, k), exact)


def test_readme_example_verbatim_cpupinn_true_one_warning():
    """README's switcher example, as printed (CPUPinn=True; positional args); without CUDA
    everything runs on the CPU "with one warning"."""
    total_words = N
    torch.manual_seed(0)
    model = SkipGram(B, B * (1 + K))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        u_switch = gl.ModelFactory(model.u_embeddings, total_words, D, CPUPinn=True)
        v_switch = gl.ModelFactory(model.v_embeddings, total_words, D, CPUPinn=True)
        u_switch.uniformDistributionInit(-0.01, 0.01)
        v_switch.zerosInit()
        optimizer = torch.optim.Adamax(model.parameters(), lr=0.05)
        u_opt = gl.OptimizerFactory(optimizer, total_words, D, model, "u_embeddings", CPUPinn=True)
        v_opt = gl.OptimizerFactory(optimizer, total_words, D, model, "v_embeddings", CPUPinn=True)
        u_opt.optInit()
        v_opt.optInit()
        ref = Reference(
            "Adamax",
            {"lr": 0.05},
            torch.from_numpy(u_switch.getNumpyVersion()),
            torch.from_numpy(v_switch.getNumpyVersion()),
        )
        batches = _batches(25)
        for center, ctx, neg in batches:
            lcenter = u_switch.beforeForwardPass(center)
            u_opt.beforeForwardPass(center)
            lpos, lneg = v_switch.beforeForwardPass(ctx, neg)
            v_opt.beforeForwardPass(ctx, neg)
            loss = model(lcenter, lpos, lneg)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            u_switch.afterOptimizerStep(center)
            u_opt.afterOptimizerStep(center)
            v_switch.afterOptimizerStep(ctx, neg)
            v_opt.afterOptimizerStep(ctx, neg)
    if not torch.cuda.is_available():
        assert len(rec) == 1, [str(w.message) for w in rec]
    else:
        assert not rec
    for b in batches:
        ref.step(*b)
    _close(u_switch.getNumpyVersion(), ref.U.detach(), False)
    _close(v_switch.getNumpyVersion(), ref.V.detach(), False)


def test_initialisers_distributions():
    model = nn.Embedding(4, 8)
    sw = gl.PytorchModelFactory(model, 20000, 8, deviceType="cpu")
    sw.uniformDistributionInit(-0.25, 0.75)
    a = sw.getNumpyVersion()
    assert a.min() >= -0.25 and a.max() <= 0.75
    assert abs(a.mean() - 0.25) < 0.01
    sw.normalDistributionInit(2.0, 0.5)
    a = sw.getNumpyVersion()
    assert abs(a.mean() - 2.0) < 0.01 and abs(a.std() - 0.5) < 0.01
    sw.zerosInit()
    assert not sw.getNumpyVersion().any()
    sw.customInit(torch.nn.init.constant_, 3.0)
    assert (sw.getNumpyVersion() == 3.0).all()


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_checkpoint_half_precision_tables(tmp_path, fmt):
    """float16 tables checkpoint in any format; bfloat16 needs hdf5/zarr ("npy" refuses it
    before writing anything)."""
    for datatype in ("float16", "bfloat16"):
        torch.manual_seed(0)
        model = SkipGram(B, B * (1 + K))
        u_sw = gl.ModelFactory(model.u_embeddings, N, D, datatype=datatype, placement="cpu")
        v_sw = gl.ModelFactory(model.v_embeddings, N, D, datatype=datatype, placement="cpu")
        u_sw.uniformDistributionInit(-0.5, 0.5)
        v_sw.normalDistributionInit(0, 0.3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        d = tmp_path / f"{datatype}-{fmt}"
        objs = {"u": u_sw, "v": v_sw, "opt": optimizer}
        if datatype == "bfloat16" and fmt == "npy":
            with pytest.raises(gl.GadgetError):
                gl.save_checkpoint(d, objs, format=fmt)
            assert not d.exists() or not any(d.iterdir())
            continue
        gl.save_checkpoint(d, objs, format=fmt)
        want = u_sw.table.as_tensor().clone()
        u_sw.zerosInit()
        gl.load_checkpoint(d, objs)
        assert torch.equal(u_sw.table.as_tensor(), want)


# ---------------------------------------------------------------------------------------
# 7. other construction orders and layouts, in-place reloads
# ---------------------------------------------------------------------------------------
LAYOUT_CONFIGS = [
    ("SGD", {"lr": 0.3}),
    ("Adam", {"lr": 0.05, "amsgrad": True}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("Rprop", {"lr": 0.02}),
    ("ASGD", {"lr": 0.05, "t0": 2}),
    ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1}),
    ("SparseAdam", {"lr": 0.05}),
]


@pytest.mark.parametrize(
    "layout", ["state-float64", "optimizer-switchers-first", "float64-model", "optinit-twice"]
)
@pytest.mark.parametrize("config", LAYOUT_CONFIGS, ids=_cid)
def test_other_layouts_equal_reference(config, layout):
    """State tables in another dtype than the table (not interleaved), optimizer switchers
    built before the model switchers, a float64 model, optInit called again."""
    name, kw = config
    torch.manual_seed(0)
    dt = torch.float64 if layout == "float64-model" else torch.float32
    model = SkipGram(B, B * (1 + K), sparse=(name == "SparseAdam")).to(dt)
    optimizer = _opt(name, model.parameters(), kw)
    sdt = {"state-float64": "float64", "float64-model": torch.float64}.get(layout, "float32")

    def mk_opt(v):
        return gl.PytorchOptimizerFactory(optimizer, N, D, model, v, dtype=sdt, deviceType="cpu")

    if layout == "optimizer-switchers-first":
        u_opt, v_opt = mk_opt("u_embeddings"), mk_opt("v_embeddings")
        u_opt.optInit()
        v_opt.optInit()
    u_sw = gl.PytorchModelFactory(model.u_embeddings, N, D, datatype=dt, deviceType="cpu")
    v_sw = gl.PytorchModelFactory(model.v_embeddings, N, D, datatype=dt, deviceType="cpu")
    u_sw.uniformDistributionInit(-0.5, 0.5)
    v_sw.normalDistributionInit(0.0, 0.3)
    if layout != "optimizer-switchers-first":
        u_opt, v_opt = mk_opt("u_embeddings"), mk_opt("v_embeddings")
        u_opt.optInit()
        v_opt.optInit()
        if layout == "optinit-twice":
            u_opt.optInit()
            v_opt.optInit()
    ref = Reference(
        name, kw, torch.from_numpy(u_sw.getNumpyVersion()), torch.from_numpy(v_sw.getNumpyVersion())
    )
    batches = _batches(31)
    _train((model, optimizer, u_sw, v_sw, u_opt, v_opt), batches)
    for b in batches:
        ref.step(*b)
    exact = name == "SGD"
    _close(u_sw.getNumpyVersion(), ref.U.detach(), exact)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), exact)
    for o, p in ((u_opt, ref.U), (v_opt, ref.V)):
        tables = o.getNumpyVersion()
        for k, v in ref.opt.state[p].items():
            if torch.is_tensor(v) and v.shape == p.shape:
                _close(torch.from_numpy(tables[k]).to(v.dtype), v, exact)


@pytest.mark.parametrize(
    "config",
    [("Adam", {"lr": 0.05}), ("Rprop", {"lr": 0.02}), ("SGD", {"lr": 0.1, "momentum": 0.9})],
    ids=_cid,
)
@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_checkpoint_rollback_into_same_objects(tmp_path, config, fmt):
    """Load a checkpoint back into the objects that saved it (after more training), then
    train the same batches again: bit-identical to the first time."""
    name, kw = config
    parts = _build(name, kw, seed=1)
    _train(parts, _batches(32, steps=2))
    gl.save_checkpoint(tmp_path / "ck", _objects(parts), format=fmt)
    again = _batches(33, steps=3)
    _train(parts, again)
    want = _full_state(parts)
    _train(parts, _batches(34, steps=2))  # wander off
    gl.load_checkpoint(tmp_path / "ck", _objects(parts))
    _train(parts, again)
    got = _full_state(parts)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_checkpoint_into_model_with_other_per_step_sizes(tmp_path):
    """README: "A model passed with the switchers is saved without their per-step variables
    ..., so a freshly built model loads it, once its switchers are built and passed too."""
    name, kw = "Adam", {"lr": 0.05}
    run = _build(name, kw, seed=1)
    _train(run, _batches(35, steps=2))
    gl.save_checkpoint(tmp_path / "ck", _objects(run), format="hdf5")
    second = _batches(36, steps=2)
    _train(run, second)
    want = _full_state(run)

    torch.manual_seed(7)
    model = SkipGram(1, 2)
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    v_sw = gl.ModelFactory(model.v_embeddings, N, D, placement="cpu")
    optimizer = _opt(name, model.parameters(), kw)
    u_opt = gl.OptimizerFactory(optimizer, N, D, model, "u_embeddings", placement="cpu")
    v_opt = gl.OptimizerFactory(optimizer, N, D, model, "v_embeddings", placement="cpu")
    u_opt.optInit()
    v_opt.optInit()
    resumed = (model, optimizer, u_sw, v_sw, u_opt, v_opt)
    gl.load_checkpoint(tmp_path / "ck", _objects(resumed))
    _train(resumed, second)
    got = _full_state(resumed)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("how", ["loadCupy", "load-h5", "loadTorch"])
def test_reload_table_after_optinit_keeps_state_and_training(tmp_path, how):
    """The table lives in one buffer with its state after optInit; reloading the table
    refills it in place and leaves the state tables alone; training then goes on exactly."""
    name, kw = "Adam", {"lr": 0.05}
    parts = _build(name, kw, seed=1)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    _train(parts, _batches(37, steps=2))
    saved_u = u_sw.getNumpyVersion().copy()
    if how == "loadCupy":
        u_sw.saveCupy(str(tmp_path / "u"))
        path = str(tmp_path / "u.npy")
    elif how == "load-h5":
        path = tmp_path / "u.h5"
        u_sw.save(path)
    else:
        path = tmp_path / "u.pt"
        u_sw.saveTorch(path)
    _train(parts, _batches(38, steps=1))
    state_now = {k: a.copy() for k, a in u_opt.getNumpyVersion().items()}
    assert not np.array_equal(u_sw.getNumpyVersion(), saved_u)
    {"loadCupy": u_sw.loadCupy, "load-h5": u_sw.load, "loadTorch": u_sw.loadTorch}[how](path)
    np.testing.assert_array_equal(u_sw.getNumpyVersion(), saved_u)
    for k, a in u_opt.getNumpyVersion().items():
        np.testing.assert_array_equal(a, state_now[k])
    # the next step reads the reloaded rows
    ref = Reference(name, kw, torch.from_numpy(saved_u), torch.from_numpy(v_sw.getNumpyVersion()))
    for p, o in ((ref.U, u_opt), (ref.V, v_opt)):
        ref.opt.state[p]["step"] = optimizer.state[o.param]["step"].clone()
        for k, a in o.getNumpyVersion().items():
            ref.opt.state[p][k] = torch.from_numpy(a.copy())
    b = _batches(39, steps=1)
    _train(parts, b)
    ref.step(*b[0])
    _close(u_sw.getNumpyVersion(), ref.U.detach(), False)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), False)


@pytest.mark.parametrize("kind", ["negative", "out_of_range", "float", "neg_out_of_range"])
def test_bad_ids_separate_layout_change_nothing(kind):
    parts = _build("RMSprop", {"lr": 0.01, "momentum": 0.9})
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    du = torch.from_numpy(u_sw.variableTransformer(B, 1))
    dp, dn = (torch.from_numpy(x) for x in v_sw.variableTransformer(B, 1, K))
    for center, ctx, neg in _batches(40, steps=2):
        u_sw.beforeForwardPass(center)
        v_sw.beforeForwardPass(ctx, neg)
        u_opt.beforeForwardPass(center)
        v_opt.beforeForwardPass(ctx, neg)
        loss = model(du, dp, dn)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_sw.afterOptimizerStep(center)
        v_sw.afterOptimizerStep(ctx, neg)
        u_opt.afterOptimizerStep(center)
        v_opt.afterOptimizerStep(ctx, neg)
    snap = _snapshot(parts)
    pos, neg = BAD_IDS[kind]()
    sw, osw = (v_sw, v_opt) if neg is not None else (u_sw, u_opt)
    for call in (sw.beforeForwardPass, osw.beforeForwardPass):
        with pytest.raises(gl.GadgetError):
            call(pos, neg) if neg is not None else call(pos)
    _same(snap, _snapshot(parts))


# ---------------------------------------------------------------------------------------
# 8. nn.Embedding options, dense parameters beside the tables, SGD dampening, sparse grads
# ---------------------------------------------------------------------------------------
def _one_table_loop(emb_kwargs, name, kw, steps=4, seed=41, ids_fn=None):
    """One table (an nn.Embedding with options) through the switchers, and the same torch
    module options on a dense full table (lazy per-row updates)."""
    torch.manual_seed(0)
    emb = nn.Embedding(8, D, **emb_kwargs)
    model = nn.ModuleDict({"emb": emb})
    sw = gl.ModelFactory(emb, N, D, placement="cpu")
    sw.normalDistributionInit(0.0, 1.0)
    optimizer = _opt(name, model.parameters(), kw)
    osw = gl.OptimizerFactory(optimizer, N, D, model, "emb", placement="cpu")
    osw.optInit()
    W = nn.Parameter(torch.from_numpy(sw.getNumpyVersion().copy()))
    ref_opt = _opt(name, [W], kw)
    target = torch.randn(D, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = ids_fn(g) if ids_fn else torch.randint(0, N, (5, 2), generator=g)
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        loss = ((emb(local) - target) ** 2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        # reference
        ref_kw = {
            k: v
            for k, v in emb_kwargs.items()
            if k in ("padding_idx", "max_norm", "scale_grad_by_freq", "sparse")
        }
        before = W.detach().clone()
        st_before = {
            k: v.clone()
            for k, v in ref_opt.state.get(W, {}).items()
            if torch.is_tensor(v) and v.shape == W.shape
        }
        rloss = ((F.embedding(ids, W, **ref_kw) - target) ** 2).sum()
        ref_opt.zero_grad()
        rloss.backward()
        ref_opt.step()
        keep = torch.ones(N, dtype=torch.bool)
        keep[torch.unique(ids)] = False
        with torch.no_grad():
            W[keep] = before[keep]
            for k, v in ref_opt.state[W].items():
                if torch.is_tensor(v) and v.shape == W.shape:
                    v[keep] = st_before[k][keep] if k in st_before else 0
    return sw, W


def test_embedding_padding_idx_refers_to_global_id():
    """README: "results equal training the whole table as one parameter with lazy per-row
    updates". With nn.Embedding(padding_idx=0) in the user's model the whole-table reference
    never trains global row 0 and trains every other looked-up row; the switcher's variable
    has the batch's smallest id at local row 0, which padding_idx then freezes."""
    g0 = lambda g: torch.cat([torch.tensor([[7, 7]]), torch.randint(1, N, (4, 2), generator=g)])  # noqa: E731
    sw, W = _one_table_loop({"padding_idx": 0}, "SGD", {"lr": 0.1}, ids_fn=g0)
    table = sw.getNumpyVersion()
    torch.testing.assert_close(torch.from_numpy(table), W.detach())


def test_embedding_max_norm_and_scale_grad_by_freq():
    sw, W = _one_table_loop({"max_norm": 1.0, "scale_grad_by_freq": True}, "SGD", {"lr": 0.1})
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), W.detach())


@pytest.mark.parametrize(
    "config", [("SGD", {"lr": 0.1}), ("Adagrad", {"lr": 0.1, "lr_decay": 0.01})], ids=_cid
)
def test_sparse_embedding_with_sparse_capable_optimizers(config):
    """SpeedTorch-era models keep nn.Embedding(sparse=True); SGD / Adagrad take sparse grads."""
    name, kw = config
    sw, W = _one_table_loop({"sparse": True}, name, kw)
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), W.detach())


def test_sgd_dampening_starts_momentum_at_zero():
    """README: "SGD with dampening != 0 starts a row's momentum at zero, where torch starts it
    at the first gradient." """
    kw = {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}
    parts = _build("SGD", kw)
    model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
    ref = Reference(
        "SGD",
        kw,
        torch.from_numpy(u_sw.getNumpyVersion()),
        torch.from_numpy(v_sw.getNumpyVersion()),
    )
    for p in (ref.U, ref.V):
        ref.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    batches = _batches(42)
    _train(parts, batches)
    for b in batches:
        ref.step(*b)
    _close(u_sw.getNumpyVersion(), ref.U.detach(), False)
    _close(v_sw.getNumpyVersion(), ref.V.detach(), False)
    _close(v_opt.getNumpyVersion()["momentum_buffer"], ref.state(ref.V, "momentum_buffer"), False)


class SkipGramHead(SkipGram):
    def __init__(self, ru, rv):
        super().__init__(ru, rv)
        self.scale = nn.Parameter(torch.tensor([0.7]))
        self.proj = nn.Linear(D, D)

    def forward(self, c, p, n):
        u = self.proj(self.u_embeddings(c)) * self.scale
        return _loss(u, self.v_embeddings(p), self.v_embeddings(n))


@pytest.mark.parametrize(
    "config",
    [("Adam", {"lr": 0.05, "weight_decay": 0.01}), ("RMSprop", {"lr": 0.01, "momentum": 0.9})],
    ids=_cid,
)
def test_dense_parameters_beside_switched_tables_and_resume(tmp_path, config):
    name, kw = config

    def build(seed):
        torch.manual_seed(seed)
        model = SkipGramHead(B, B * (1 + K))
        u_sw = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
        v_sw = gl.ModelFactory(model.v_embeddings, N, D, placement="cpu")
        u_sw.uniformDistributionInit(-0.5, 0.5)
        v_sw.normalDistributionInit(0.0, 0.3)
        optimizer = _opt(name, model.parameters(), kw)
        u_opt = gl.OptimizerFactory(optimizer, N, D, model, "u_embeddings", placement="cpu")
        v_opt = gl.OptimizerFactory(optimizer, N, D, model, "v_embeddings", placement="cpu")
        u_opt.optInit()
        v_opt.optInit()
        return model, optimizer, u_sw, v_sw, u_opt, v_opt

    run = build(0)
    model = run[0]
    # reference: the same head, dense tables with lazy row updates
    U = nn.Parameter(torch.from_numpy(run[2].getNumpyVersion().copy()))
    V = nn.Parameter(torch.from_numpy(run[3].getNumpyVersion().copy()))
    head = SkipGramHead(1, 1)
    head.load_state_dict(
        {k: v for k, v in model.state_dict().items() if "embeddings" not in k}, strict=False
    )
    ref_opt = _opt(name, [U, V, head.scale, head.proj.weight, head.proj.bias], kw)
    first, second = _batches(43, steps=3), _batches(44, steps=2)
    _train(run, first)
    for c, p, n in first:
        loss = _loss(
            head.proj(F.embedding(c, U)) * head.scale, F.embedding(p, V), F.embedding(n, V)
        )
        ref_opt.zero_grad()
        loss.backward()
        snap = {
            t: (
                t.detach().clone(),
                {
                    k: v.clone()
                    for k, v in ref_opt.state.get(t, {}).items()
                    if torch.is_tensor(v) and v.dim() == 2
                },
            )
            for t in (U, V)
        }
        ref_opt.step()
        for t, rows in (
            (U, torch.unique(c)),
            (V, torch.unique(torch.cat([p.reshape(-1), n.reshape(-1)]))),
        ):
            keep = torch.ones(N, dtype=torch.bool)
            keep[rows] = False
            with torch.no_grad():
                t[keep] = snap[t][0][keep]
            for k, v in ref_opt.state[t].items():
                if torch.is_tensor(v) and v.dim() == 2:
                    v[keep] = snap[t][1][k][keep] if k in snap[t][1] else 0
    _close(run[2].getNumpyVersion(), U.detach(), False)
    _close(run[3].getNumpyVersion(), V.detach(), False)
    _close(model.proj.weight.detach(), head.proj.weight.detach(), False)
    _close(model.scale.detach(), head.scale.detach(), False)
    # resume with the head's parameters and optimizer state
    gl.save_checkpoint(tmp_path / "ck", _objects(run))
    _train(run, second)
    resumed = build(5)
    gl.load_checkpoint(tmp_path / "ck", _objects(resumed))
    _train(resumed, second)
    a, b = _full_state(run), _full_state(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    for (k1, v1), (_k2, v2) in zip(
        run[0].named_parameters(), resumed[0].named_parameters(), strict=True
    ):
        if "embeddings" not in k1:
            assert torch.equal(v1, v2), k1


# ---------------------------------------------------------------------------------------
# 9. DataGadget under SpeedTorch's names
# ---------------------------------------------------------------------------------------
def test_datagadget_speedtorch_names(tmp_path):
    arr = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    np.save(tmp_path / "t.npy", arr)
    g = gl.DataGadget(str(tmp_path / "t.npy"), placement="cpu")
    assert g.gadgetInit() is g
    ids = [3, 3, 0, N - 1]
    np.testing.assert_array_equal(g.getData(ids).cpu().numpy(), arr[ids])
    np.testing.assert_array_equal(g.getData(np.array(ids, np.int32)).cpu().numpy(), arr[ids])
    rows = torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4, [4.0] * 4])
    g.insertData(rows, torch.tensor(ids))
    got = g.getNumpyVersion()
    np.testing.assert_array_equal(got[3], [2.0] * 4)  # last occurrence wins
    np.testing.assert_array_equal(got[0], [3.0] * 4)
    with pytest.raises(gl.GadgetError):
        g.insertData(rows.double(), torch.tensor(ids))
    before = g.getNumpyVersion()
    for bad in ([0, N], [-1, 0], torch.tensor([0.0, 1.0])):
        with pytest.raises(gl.GadgetError):
            g.insertData(rows[:2], bad)
        with pytest.raises(gl.GadgetError):
            g.getData(bad)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.saveCupy(str(tmp_path / "out"))
    g2 = gl.DataGadget(str(tmp_path / "out.npy"), CPUPinn=False, placement="cpu")
    np.testing.assert_array_equal(g2.getNumpyVersion(), before)
    g2.zero_()
    g2.loadCupy(str(tmp_path / "out.npy"))
    np.testing.assert_array_equal(g2.getNumpyVersion(), before)


# ---------------------------------------------------------------------------------------
# 10. more save/load promises
# ---------------------------------------------------------------------------------------
def test_merge_layout_local_ids_ascending():
    """README: a switcher without variableTransformer "holds the batch's distinct ids in
    ascending order"."""
    emb = nn.Embedding(2, D)
    sw = gl.ModelFactory(emb, N, D, placement="cpu")
    sw.normalDistributionInit(0, 1)
    table = sw.getNumpyVersion()
    local = sw.beforeForwardPass(torch.tensor([9, 3, 9, 5]))
    assert local.tolist() == [2, 0, 2, 1]
    np.testing.assert_array_equal(emb.weight.detach()[:3].numpy(), table[[3, 5, 9]])
    lp, ln = sw.beforeForwardPass(np.array([[7], [1]]), [[7, 40], [1, 2]])
    assert lp.tolist() == [[2], [0]] and ln.tolist() == [[2, 3], [0, 1]]


def test_load_torch_dtype_rules(tmp_path):
    """README: loadTorch refuses "another dtype unless every value converts exactly (a float64
    file of float32 values), before writing anything"."""
    parts = _build("Adam", {"lr": 0.05})
    _train(parts, _batches(50, steps=1))
    u_sw, u_opt = parts[2], parts[4]
    want = u_sw.getNumpyVersion().copy()
    exact64 = torch.from_numpy(want).double() * 0.5  # float32 values, stored as float64
    torch.save(exact64, tmp_path / "ok.pt")
    u_sw.loadTorch(tmp_path / "ok.pt")
    np.testing.assert_array_equal(u_sw.getNumpyVersion(), want * 0.5)
    inexact = torch.full((N, D), 0.1, dtype=torch.float64)
    torch.save(inexact, tmp_path / "bad.pt")
    with pytest.raises(gl.GadgetError):
        u_sw.loadTorch(tmp_path / "bad.pt")
    np.testing.assert_array_equal(u_sw.getNumpyVersion(), want * 0.5)
    states = {k: a.copy() for k, a in u_opt.getNumpyVersion().items()}
    torch.save({k: torch.from_numpy(a).double() for k, a in states.items()}, tmp_path / "s_ok.pt")
    u_opt.customInit(torch.nn.init.zeros_)
    u_opt.loadTorch(tmp_path / "s_ok.pt")
    for k, a in u_opt.getNumpyVersion().items():
        np.testing.assert_array_equal(a, states[k])
    torch.save(
        {
            "exp_avg": torch.full((N, D), 0.1, dtype=torch.float64),
            "exp_avg_sq": torch.zeros(N, D, dtype=torch.float64),
        },
        tmp_path / "s_bad.pt",
    )
    with pytest.raises(gl.GadgetError):
        u_opt.loadTorch(tmp_path / "s_bad.pt")
    for k, a in u_opt.getNumpyVersion().items():
        np.testing.assert_array_equal(a, states[k])


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_resume_after_scheduler_turned_momentum_on(tmp_path, fmt):
    """README: a checkpoint holding state the optimizer has not turned on yet (a scheduler's
    momentum) loads, and that state is paged from then on."""
    kw = {"lr": 0.1, "momentum": 0.0}

    def turn_on(opt):
        for g in opt.param_groups:
            g["momentum"] = 0.9

    run = _build("SGD", kw, seed=1)
    first, second = _batches(51, steps=2), _batches(52, steps=3)
    _train(run, first[:1])
    turn_on(run[1])
    _train(run, first[1:])
    assert "momentum_buffer" in run[5].getNumpyVersion()
    gl.save_checkpoint(tmp_path / "ck", _objects(run), format=fmt)
    _train(run, second)
    want = _full_state(run)
    resumed = _build("SGD", kw, seed=2)  # built with momentum 0, as the script starts
    gl.load_checkpoint(tmp_path / "ck", _objects(resumed))
    assert resumed[1].param_groups[0]["momentum"] == 0.9
    _train(resumed, second)
    got = _full_state(resumed)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("name", ["Rprop", "ASGD"])
def test_checkpoint_before_first_step_then_warmup(tmp_path, name):
    """A checkpoint of never-stepped switchers (fresh state), resumed, then an LR warm-up:
    Rprop's step_size / ASGD's eta start from the first step's lr, as without the resume."""
    kw = {"lr": 0.05}
    batches = _batches(53, steps=3)

    def go(parts, resume_dir=None):
        if resume_dir is not None:
            gl.load_checkpoint(resume_dir, _objects(parts))
        s = torch.optim.lr_scheduler.LambdaLR(parts[1], lambda e: 0.25 * (e + 1))
        for b in batches:
            _train(parts, [b])
            s.step()
        return _full_state(parts)

    a = _build(name, kw, seed=1)
    gl.save_checkpoint(tmp_path / "ck", _objects(a))
    want = go(a)
    b = _build(name, kw, seed=2)
    got = go(b, tmp_path / "ck")
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_switcher_checkpoint_refuses_another_optimizer_class(tmp_path):
    """README: "state_dict() and checkpoints record the optimizer's class: state saved by
    another class (Adam's into NAdam) is refused before anything changes" -- here a
    checkpoint of the switchers (their tables and step counts), as save_checkpoint's
    docstring lists them."""
    run = _build("Adam", {"lr": 0.05}, seed=1)
    _train(run, _batches(60, steps=2))
    objs = lambda p: {"u": p[2], "v": p[3], "u_opt": p[4], "v_opt": p[5]}  # noqa: E731
    gl.save_checkpoint(tmp_path / "ck", objs(run))
    other = _build("NAdam", {"lr": 0.05}, seed=2)
    before = _full_state(other)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(tmp_path / "ck", objs(other))
    after = _full_state(other)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_checkpoint_one_object_mismatch_changes_no_object(tmp_path):
    run = _build("Adam", {"lr": 0.05}, seed=1)
    _train(run, _batches(61, steps=2))
    gl.save_checkpoint(tmp_path / "ck", _objects(run))
    other = _build("Adam", {"lr": 0.05}, seed=2)
    objs = _objects(other)
    bigger = gl.ModelFactory(nn.Embedding(B * (1 + K), D), N + 1, D, placement="cpu")
    objs["v"] = bigger  # the last table does not fit
    before = _full_state(other)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(tmp_path / "ck", objs)
    after = _full_state(other)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


@pytest.mark.parametrize("datatype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "config", [("SGD", {"lr": 0.1}), ("Adam", {"lr": 0.01, "eps": 1e-3})], ids=_cid
)
def test_half_precision_tables_equal_half_precision_reference(datatype, config):
    """float16 / bfloat16 tables for a float32 nn.Embedding: the variable (and the optimizer's
    state rows) take the table's dtype, so training equals the same optimizer on a dense
    table of that dtype."""
    name, kw = config
    td = getattr(torch, datatype)
    torch.manual_seed(0)
    model = SkipGram(B, B * (1 + K))
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, datatype=datatype, placement="cpu")
    v_sw = gl.ModelFactory(model.v_embeddings, N, D, datatype=datatype, placement="cpu")
    u_sw.uniformDistributionInit(-0.5, 0.5)
    v_sw.normalDistributionInit(0.0, 0.3)
    optimizer = _opt(name, model.parameters(), kw)
    u_opt = gl.OptimizerFactory(optimizer, N, D, model, "u_embeddings", placement="cpu")
    v_opt = gl.OptimizerFactory(optimizer, N, D, model, "v_embeddings", placement="cpu")
    u_opt.optInit()
    v_opt.optInit()
    ref = Reference(name, kw, u_sw.table.as_tensor().clone(), v_sw.table.as_tensor().clone())
    assert ref.U.dtype == td
    batches = _batches(62)
    _train((model, optimizer, u_sw, v_sw, u_opt, v_opt), batches)
    for b in batches:
        ref.step(*b)
    tol = {"float16": 2e-3, "bfloat16": 2e-2}[datatype]
    torch.testing.assert_close(u_sw.table.as_tensor(), ref.U.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(v_sw.table.as_tensor(), ref.V.detach(), rtol=tol, atol=tol)


def test_speedtorch_protocol_resume_bit_identical(tmp_path):
    """The variableTransformer loop, checkpointed and resumed in a new set of objects."""
    name, kw = "Adamax", {"lr": 0.05}

    def build(seed):
        parts = _build(name, kw, seed=seed)
        du = torch.from_numpy(parts[2].variableTransformer(B, 1))
        dp, dn = (torch.from_numpy(x) for x in parts[3].variableTransformer(B, 1, K))
        return parts, (du, dp, dn)

    def train(parts, dummies, batches):
        model, optimizer, u_sw, v_sw, u_opt, v_opt = parts
        for center, ctx, neg in batches:
            u_sw.beforeForwardPass(center)
            v_sw.beforeForwardPass(ctx, neg)
            u_opt.beforeForwardPass(center)
            v_opt.beforeForwardPass(ctx, neg)
            loss = model(*dummies)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            u_sw.afterOptimizerStep(center)
            v_sw.afterOptimizerStep(ctx, neg)
            u_opt.afterOptimizerStep(center)
            v_opt.afterOptimizerStep(ctx, neg)

    run, d1 = build(1)
    train(run, d1, _batches(70, steps=2))
    gl.save_checkpoint(tmp_path / "ck", _objects(run), format="zarr")
    second = _batches(71, steps=2)
    train(run, d1, second)
    resumed, d2 = build(2)
    gl.load_checkpoint(tmp_path / "ck", _objects(resumed))
    train(resumed, d2, second)
    a, b = _full_state(run), _full_state(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_one_optimizer_per_table_and_resume(tmp_path):
    """SpeedTorch code sometimes gives each table its own optimizer (here of another class)."""

    def build(seed):
        torch.manual_seed(seed)
        model = SkipGram(B, B * (1 + K))
        u_sw = gl.PytorchModelFactory(model.u_embeddings, N, D, deviceType="cpu")
        v_sw = gl.PytorchModelFactory(model.v_embeddings, N, D, deviceType="cpu")
        u_sw.uniformDistributionInit(-0.5, 0.5)
        v_sw.normalDistributionInit(0.0, 0.3)
        ou = torch.optim.Adagrad(model.u_embeddings.parameters(), lr=0.1)
        ov = torch.optim.RMSprop(model.v_embeddings.parameters(), lr=0.01, centered=True)
        u_opt = gl.PytorchOptimizerFactory(ou, N, D, model, "u_embeddings", deviceType="cpu")
        v_opt = gl.PytorchOptimizerFactory(ov, N, D, model, "v_embeddings", deviceType="cpu")
        u_opt.optInit()
        v_opt.optInit()
        return model, (ou, ov), u_sw, v_sw, u_opt, v_opt

    def train(parts, batches):
        model, (ou, ov), u_sw, v_sw, u_opt, v_opt = parts
        for center, ctx, neg in batches:
            lc = u_sw.beforeForwardPass(center)
            u_opt.beforeForwardPass(center)
            lp, ln = v_sw.beforeForwardPass(ctx, neg)
            v_opt.beforeForwardPass(ctx, neg)
            loss = model(lc, lp, ln)
            ou.zero_grad()
            ov.zero_grad()
            loss.backward()
            ou.step()
            ov.step()
            u_sw.afterOptimizerStep(center)
            u_opt.afterOptimizerStep(center)
            v_sw.afterOptimizerStep(ctx, neg)
            v_opt.afterOptimizerStep(ctx, neg)

    def objs(p):
        return {"u": p[2], "v": p[3], "u_opt": p[4], "v_opt": p[5], "ou": p[1][0], "ov": p[1][1]}

    run = build(1)
    first, second = _batches(72, steps=2), _batches(73, steps=2)
    train(run, first)
    gl.save_checkpoint(tmp_path / "ck", objs(run))
    train(run, second)
    res = build(2)
    gl.load_checkpoint(tmp_path / "ck", objs(res))
    train(res, second)
    for a, b in ((run[2], res[2]), (run[3], res[3])):
        np.testing.assert_array_equal(a.getNumpyVersion(), b.getNumpyVersion())
    for a, b in ((run[4], res[4]), (run[5], res[5])):
        sa, sb = a.getNumpyVersion(), b.getNumpyVersion()
        assert set(sa) == set(sb)
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k])


def test_checkpoint_of_a_switched_model_without_its_switchers_is_refused(tmp_path):
    """The model's state leaves the switcher-paged variables out (they hold one batch's
    rows), so a checkpoint without the switchers would save no table: refused, nothing
    written; with the switchers it saves."""
    emb = torch.nn.Embedding(4, 2)
    model = torch.nn.ModuleDict({"emb": emb})
    sw = gl.ModelFactory(emb, 10, 2, placement="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = tmp_path / "ck"
    with pytest.raises(gl.GadgetValueError, match="switchers"):
        gl.save_checkpoint(d, {"model": model, "opt": opt})
    assert not d.exists()
    gl.save_checkpoint(d, {"model": model, "emb": sw, "opt": opt})
    assert (d / "meta.pt").exists()
