"""Black-box review (session 33): the SpeedTorch-compatible names of SPEC.md.

ModelFactory / OptimizerFactory / PytorchModelFactory / PytorchOptimizerFactory /
DataGadget on CPU placements: argument forms, initialisers, a full SpeedTorch-style
training loop against a reference that runs the same dense torch optimizer over just
each batch's distinct rows (lazy per-row updates, one step count per table), the
duplicate caveat of ``variableTransformer``, saving / loading, and bad inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch.nn import functional as tnf

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


N, D = 24, 5


def _quiet():
    """Silence the (once per process) FallbackWarning of GPU placements asked for by name."""
    cm = warnings.catch_warnings()
    cm.__enter__()
    warnings.simplefilter("ignore", gl.FallbackWarning)
    return cm


def _err_mentions(exc: BaseException, *parts: str) -> None:
    msg = str(exc)
    for p in parts:
        assert p in msg, f"error message {msg!r} does not mention {p!r}"


# --------------------------------------------------------------------------------------
# the skip-gram style model of the README's switcher loop
# --------------------------------------------------------------------------------------


class SkipGram(torch.nn.Module):
    def __init__(self, rows: int = 3, dim: int = D, sparse: bool = False, dtype=torch.float32):
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(rows, dim, sparse=sparse, dtype=dtype)
        self.v_embeddings = torch.nn.Embedding(rows, dim, sparse=sparse, dtype=dtype)

    def forward(self, c, p, n):
        return skipgram_loss(self.u_embeddings(c), self.v_embeddings(p), self.v_embeddings(n))


def skipgram_loss(uc, vp, vn):
    pos = tnf.logsigmoid((uc * vp).sum(-1)).sum()
    neg = tnf.logsigmoid(-(uc.unsqueeze(1) * vn).sum(-1)).sum()
    return -(pos + neg)


def make_batches(steps=6, batch=7, neg=3, rows=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        c = torch.randint(0, rows, (batch,), generator=g)
        p = torch.randint(0, rows, (batch,), generator=g)
        n = torch.randint(0, rows, (batch, neg), generator=g)
        # guaranteed repeats: within an id tensor and between positives and negatives
        c[1] = c[0]
        n[0, 1] = n[0, 0]
        n[2, 0] = p[2]
        out.append((c, p, n))
    return out


def fresh_state_rows(opt_cls, kw, dim, dtype):
    """What torch's optimizer holds for a fresh parameter row (by state name)."""
    if opt_cls is torch.optim.SparseAdam:
        return {
            "exp_avg": torch.zeros(dim, dtype=dtype),
            "exp_avg_sq": torch.zeros(dim, dtype=dtype),
        }
    if opt_cls is torch.optim.Adamax:  # its zero-gradient step would move exp_inf to eps
        return {"exp_avg": torch.zeros(dim, dtype=dtype), "exp_inf": torch.zeros(dim, dtype=dtype)}
    probe = torch.nn.Parameter(torch.zeros(1, dim, dtype=dtype))
    o = opt_cls([probe], **kw)
    probe.grad = torch.zeros_like(probe)
    o.step()  # a zero gradient on a zero row leaves every state at its initial value
    return {
        k: v[0].clone() for k, v in o.state[probe].items() if torch.is_tensor(v) and v.dim() == 2
    }


class Reference:
    """Each step: the same dense torch optimizer over parameters holding just the batch's
    distinct rows of each table, with their state rows; rows outside the batch untouched;
    one step count per table."""

    def __init__(self, tables, opt_cls, kw, sparse=False):
        self.T = {k: v.clone() for k, v in tables.items()}
        self.opt_cls, self.kw, self.sparse = opt_cls, kw, sparse
        dtype = next(iter(tables.values())).dtype
        fresh = fresh_state_rows(opt_cls, kw, D, dtype)
        self.S = {
            k: {name: row.expand(N, D).clone() for name, row in fresh.items()} for k in tables
        }
        self.scalars = {k: {} for k in tables}

    def step(self, c, p, n):
        ids = {"u": c.reshape(-1), "v": torch.cat([p.reshape(-1), n.reshape(-1)])}
        uniq, params, local = {}, {}, {}
        for k in ("u", "v"):
            uq, inv = torch.unique(ids[k], return_inverse=True)
            uniq[k] = uq
            params[k] = torch.nn.Parameter(self.T[k][uq].clone())
            local[k] = inv
        opt = self.opt_cls([params["u"], params["v"]], **self.kw)
        for k in ("u", "v"):
            st = dict(opt.state[params[k]]) if params[k] in opt.state else {}
            if self.scalars[k]:
                for name, val in self.scalars[k].items():
                    st[name] = val.clone() if torch.is_tensor(val) else val
                for name, full in self.S[k].items():
                    st[name] = full[uniq[k]].clone()
            elif st:  # state made by the constructor (Adagrad): rows from our tables
                for name, full in self.S[k].items():
                    st[name] = full[uniq[k]].clone()
            if st:
                opt.state[params[k]] = st
        lc = local["u"].reshape(c.shape)
        lv = local["v"]
        lp = lv[: p.numel()].reshape(p.shape)
        ln = lv[p.numel() :].reshape(n.shape)
        loss = skipgram_loss(
            tnf.embedding(lc, params["u"], sparse=self.sparse),
            tnf.embedding(lp, params["v"], sparse=self.sparse),
            tnf.embedding(ln, params["v"], sparse=self.sparse),
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        for k in ("u", "v"):
            self.T[k][uniq[k]] = params[k].detach()
            scal = {}
            for name, val in opt.state[params[k]].items():
                if torch.is_tensor(val) and val.shape == params[k].shape:
                    self.S[k][name][uniq[k]] = val
                else:
                    scal[name] = val.clone() if torch.is_tensor(val) else val
            self.scalars[k] = scal or {"_stepped": True}


OPTIMIZERS = [
    pytest.param(torch.optim.SGD, dict(lr=0.5), id="SGD"),
    pytest.param(torch.optim.SGD, dict(lr=0.2, momentum=0.9, weight_decay=0.01), id="SGD-momentum"),
    pytest.param(torch.optim.SGD, dict(lr=0.2, momentum=0.8, nesterov=True), id="SGD-nesterov"),
    pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
    pytest.param(torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1), id="AdamW"),
    pytest.param(
        torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, amsgrad=True), id="AdamW-amsgrad"
    ),
    pytest.param(torch.optim.Adagrad, dict(lr=0.1), id="Adagrad"),
    pytest.param(
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.05, initial_accumulator_value=0.1),
        id="Adagrad-decay-init",
    ),
    pytest.param(torch.optim.RMSprop, dict(lr=0.01), id="RMSprop"),
    pytest.param(
        torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True), id="RMSprop-centered-mom"
    ),
    pytest.param(torch.optim.Rprop, dict(lr=0.01), id="Rprop"),
    pytest.param(torch.optim.SparseAdam, dict(lr=0.05), id="SparseAdam"),
    pytest.param(torch.optim.Adamax, dict(lr=0.05), id="Adamax"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0), id="Adadelta"),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=2), id="ASGD"),
    pytest.param(torch.optim.NAdam, dict(lr=0.05), id="NAdam"),
    pytest.param(torch.optim.RAdam, dict(lr=0.05), id="RAdam"),
]


def build_switchers(kind, model, opt, dtype="float32"):
    if kind == "cupy-names":
        us = gl.ModelFactory(model.u_embeddings, N, D, datatype=dtype, placement="cpu")
        vs = gl.ModelFactory(model.v_embeddings, N, D, datatype=dtype, placement="cpu")
    else:
        us = gl.PytorchModelFactory(model.u_embeddings, N, D, datatype=dtype, deviceType="cpu")
        vs = gl.PytorchModelFactory(model.v_embeddings, N, D, datatype=dtype, deviceType="cpu")
    us.uniformDistributionInit(-0.5, 0.5)
    vs.normalDistributionInit(0.0, 0.3)
    if kind == "cupy-names":
        uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", dtype=dtype, placement="cpu")
        vo = gl.OptimizerFactory(opt, N, D, model, "v_embeddings", dtype=dtype, placement="cpu")
    else:
        uo = gl.PytorchOptimizerFactory(
            opt, N, D, model, "u_embeddings", dtype=dtype, deviceType="cpu"
        )
        vo = gl.PytorchOptimizerFactory(
            opt, N, D, model, "v_embeddings", dtype=dtype, deviceType="cpu"
        )
    uo.optInit()
    vo.optInit()
    return us, vs, uo, vo


def switcher_step(model, opt, sw, batch, model_first=True):
    us, vs, uo, vo = sw
    c, p, n = batch
    if model_first:
        lc = us.beforeForwardPass(c)
        uo.beforeForwardPass(c)
        lp, ln = vs.beforeForwardPass(p, n)
        vo.beforeForwardPass(p, n)
    else:
        uo.beforeForwardPass(c)
        lc = us.beforeForwardPass(c)
        vo.beforeForwardPass(p, n)
        lp, ln = vs.beforeForwardPass(p, n)
    loss = model(lc, lp, ln)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if model_first:
        us.afterOptimizerStep(c)
        uo.afterOptimizerStep(c)
        vs.afterOptimizerStep(p, n)
        vo.afterOptimizerStep(p, n)
    else:
        uo.afterOptimizerStep(c)
        us.afterOptimizerStep(c)
        vo.afterOptimizerStep(p, n)
        vs.afterOptimizerStep(p, n)
    return loss.detach()


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------------------
# the full training loop against the reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cupy-names", "pytorch-names"])
@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS)
def test_training_loop_matches_dense_optimizer_on_batch_rows(kind, opt_cls, kw):
    torch.manual_seed(1)
    sparse = opt_cls is torch.optim.SparseAdam
    model = SkipGram(sparse=sparse)
    opt = opt_cls(model.parameters(), **kw)
    sw = build_switchers(kind, model, opt)
    us, vs, uo, vo = sw
    ref = Reference(
        {
            "u": torch.from_numpy(us.getNumpyVersion()).clone(),
            "v": torch.from_numpy(vs.getNumpyVersion()).clone(),
        },
        opt_cls,
        kw,
        sparse=sparse,
    )
    # optInit fills the state tables as torch initialises a fresh parameter's state
    for k, o in (("u", uo), ("v", vo)):
        st = o.getNumpyVersion()
        assert isinstance(st, dict)
        assert set(st) == set(ref.S[k]), (set(st), set(ref.S[k]))
        for name, arr in st.items():
            torch.testing.assert_close(
                torch.from_numpy(np.asarray(arr)), ref.S[k][name], rtol=0, atol=0
            )
    # the model switcher first in some runs, the optimizer switcher first in others
    model_first = opt_cls not in (torch.optim.Adam, torch.optim.RMSprop)
    start_u = us.getNumpyVersion().copy()
    for batch in make_batches():
        switcher_step(model, opt, sw, batch, model_first=model_first)
        ref.step(*batch)
    tol = _tol(torch.float32)
    assert (ref.T["u"] - torch.from_numpy(start_u)).abs().max() > 1e-3  # training moved the rows
    torch.testing.assert_close(torch.from_numpy(us.getNumpyVersion()), ref.T["u"], **tol)
    torch.testing.assert_close(torch.from_numpy(vs.getNumpyVersion()), ref.T["v"], **tol)
    for k, o in (("u", uo), ("v", vo)):
        st = o.getNumpyVersion()
        for name in ref.S[k]:
            torch.testing.assert_close(
                torch.from_numpy(np.asarray(st[name])),
                ref.S[k][name],
                **tol,
                msg=lambda m, name=name, k=k: f"state {name} of {k}: {m}",
            )


@pytest.mark.parametrize(
    "opt_cls,kw",
    [
        pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
        pytest.param(torch.optim.SGD, dict(lr=0.2, momentum=0.9), id="SGD-momentum"),
    ],
)
def test_training_loop_float64_tables_match_tightly(opt_cls, kw):
    torch.manual_seed(2)
    model = SkipGram(dtype=torch.float64)
    opt = opt_cls(model.parameters(), **kw)
    sw = build_switchers("cupy-names", model, opt, dtype=torch.float64)
    us, vs, uo, vo = sw
    assert us.getNumpyVersion().dtype == np.float64
    ref = Reference(
        {
            "u": torch.from_numpy(us.getNumpyVersion()).clone(),
            "v": torch.from_numpy(vs.getNumpyVersion()).clone(),
        },
        opt_cls,
        kw,
    )
    for batch in make_batches(seed=3):
        switcher_step(model, opt, sw, batch)
        ref.step(*batch)
    tol = _tol(torch.float64)
    torch.testing.assert_close(torch.from_numpy(us.getNumpyVersion()), ref.T["u"], **tol)
    torch.testing.assert_close(torch.from_numpy(vs.getNumpyVersion()), ref.T["v"], **tol)
    for name, arr in vo.getNumpyVersion().items():
        assert arr.dtype == np.float64, name
        torch.testing.assert_close(torch.from_numpy(arr), ref.S["v"][name], **tol)


class GenericRef:
    """Like :class:`Reference`, for any set of lookups per step: only the tables a step
    looks up are stepped (their step counts move), the others keep rows and state."""

    def __init__(self, tables, opt_cls, kw, group_kw=None):
        self.T = {k: v.clone() for k, v in tables.items()}
        self.opt_cls, self.kw = opt_cls, kw
        self.group_kw = group_kw or {k: {} for k in tables}
        self.S = {}
        for k in tables:
            fresh = fresh_state_rows(opt_cls, {**kw, **self.group_kw[k]}, D, torch.float32)
            self.S[k] = {name: row.expand(N, D).clone() for name, row in fresh.items()}
        self.scalars = {k: {} for k in tables}

    def step(self, lookups, loss_fn):
        names = [k for k in self.T if k in lookups]
        uniq, params, local = {}, {}, {}
        for k in names:
            flat = torch.cat([i.reshape(-1) for i in lookups[k]])
            uq, inv = torch.unique(flat, return_inverse=True)
            uniq[k], params[k] = uq, torch.nn.Parameter(self.T[k][uq].clone())
            parts, at = [], 0
            for i in lookups[k]:
                parts.append(inv[at : at + i.numel()].reshape(i.shape))
                at += i.numel()
            local[k] = parts
        opt = self.opt_cls([{"params": [params[k]], **self.group_kw[k]} for k in names], **self.kw)
        for k in names:
            st = dict(opt.state[params[k]]) if params[k] in opt.state else {}
            if not (st or self.scalars[k]):
                continue  # never stepped: torch initialises the state (all rows fresh)
            for name, val in self.scalars[k].items():
                st[name] = val.clone() if torch.is_tensor(val) else val
            for name, full in self.S[k].items():
                st[name] = full[uniq[k]].clone()
            opt.state[params[k]] = st
        embs = {k: [tnf.embedding(li, params[k]) for li in local[k]] for k in names}
        opt.zero_grad()
        loss_fn(embs).backward()
        opt.step()
        for k in names:
            self.T[k][uniq[k]] = params[k].detach()
            for name, val in opt.state[params[k]].items():
                if torch.is_tensor(val) and val.shape == params[k].shape:
                    self.S[k][name][uniq[k]] = val
                else:
                    self.scalars[k][name] = val.clone() if torch.is_tensor(val) else val
            self.scalars[k].setdefault("_stepped", True)


_W = torch.linspace(-1.0, 1.0, 4 * D).reshape(4, D)


def generic_loss(embs):
    total = 0.0
    for k, lst in embs.items():
        for j, e in enumerate(lst):
            w = _W[(j + (2 if k == "v" else 0)) % 4]
            total = total + torch.sin(e @ w).sum() + 0.1 * e.pow(2).sum()
    return total


@pytest.mark.parametrize(
    "opt_cls,kw",
    [
        pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
        pytest.param(torch.optim.AdamW, dict(lr=0.05, weight_decay=0.2), id="AdamW"),
        pytest.param(torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.1), id="Adagrad-decay"),
        pytest.param(
            torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True), id="RMSprop-centered"
        ),
        pytest.param(
            torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.05), id="SGD-momentum"
        ),
    ],
)
def test_shared_optimizer_with_skipped_tables_eval_lookups_and_varying_batches(opt_cls, kw):
    """Two tables under one optimizer; some steps look up only one of them (the other is
    not stepped, its step count does not move), evaluation lookups under no_grad come in
    between, and batch sizes vary (the variable keeps its capacity, padding rows)."""
    torch.manual_seed(5)
    model = SkipGram()
    opt = opt_cls(model.parameters(), **kw)
    us, vs, uo, vo = build_switchers("pytorch-names", model, opt)
    mods = {"u": (model.u_embeddings, us, uo), "v": (model.v_embeddings, vs, vo)}
    ref = GenericRef(
        {
            "u": torch.from_numpy(us.getNumpyVersion()).clone(),
            "v": torch.from_numpy(vs.getNumpyVersion()).clone(),
        },
        opt_cls,
        kw,
    )
    g = torch.Generator().manual_seed(9)

    def ids(*shape):
        return torch.randint(0, N, shape, generator=g)

    plan = [
        {"u": [ids(9)], "v": [ids(9), ids(9, 2)]},
        {"u": [ids(3)]},  # v skipped
        "eval",
        {"u": [ids(12)], "v": [ids(2)]},
        {"v": [ids(5), ids(5, 3)]},  # u skipped
        {"u": [torch.tensor([4, 4, 4])], "v": [torch.tensor([4]), torch.tensor([[4, 4]])]},
        "eval",
        {"u": [ids(1)], "v": [ids(14), ids(1, 1)]},
    ]
    for entry in plan:
        if entry == "eval":
            with torch.no_grad():
                lv = vs.beforeForwardPass(ids(20))
                lu = us.beforeForwardPass(ids(6))
                model.v_embeddings(lv).sum() + model.u_embeddings(lu).sum()
            continue
        local = {}
        for k, lst in entry.items():
            _, msw, osw = mods[k]
            out = msw.beforeForwardPass(*lst)
            osw.beforeForwardPass(*lst)
            local[k] = list(out) if isinstance(out, tuple) else [out]
        embs = {k: [mods[k][0](li) for li in local[k]] for k in local}
        loss = generic_loss(embs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for k, lst in entry.items():
            _, msw, osw = mods[k]
            msw.afterOptimizerStep(*lst)
            osw.afterOptimizerStep(*lst)
        ref.step(entry, generic_loss)
    tol = _tol(torch.float32)
    for k, (_, msw, osw) in mods.items():
        torch.testing.assert_close(
            torch.from_numpy(msw.getNumpyVersion()),
            ref.T[k],
            **tol,
            msg=lambda m, k=k: f"table {k}: {m}",
        )
        st = osw.getNumpyVersion()
        for name in ref.S[k]:
            torch.testing.assert_close(
                torch.from_numpy(st[name]),
                ref.S[k][name],
                **tol,
                msg=lambda m, k=k, name=name: f"state {name} of {k}: {m}",
            )


@pytest.mark.parametrize(
    "opt_cls,kw,groups",
    [
        pytest.param(
            torch.optim.Adam,
            dict(lr=0.05),
            {"u": dict(lr=0.2), "v": dict(lr=0.01, betas=(0.5, 0.9))},
            id="Adam",
        ),
        pytest.param(
            torch.optim.SGD, dict(lr=0.1), {"u": dict(momentum=0.9), "v": dict(lr=0.3)}, id="SGD"
        ),
        pytest.param(
            torch.optim.Adagrad,
            dict(lr=0.1),
            {"u": dict(lr=0.5), "v": dict(weight_decay=0.1)},
            id="Adagrad",
        ),
    ],
)
def test_shared_optimizer_param_groups_with_own_options(opt_cls, kw, groups):
    """Each table's options come from its own param group of the shared optimizer."""
    torch.manual_seed(8)
    model = SkipGram()
    opt = opt_cls(
        [
            {"params": model.u_embeddings.parameters(), **groups["u"]},
            {"params": model.v_embeddings.parameters(), **groups["v"]},
        ],
        **kw,
    )
    us, vs, uo, vo = sw = build_switchers("cupy-names", model, opt)
    ref = GenericRef(
        {
            "u": torch.from_numpy(us.getNumpyVersion()).clone(),
            "v": torch.from_numpy(vs.getNumpyVersion()).clone(),
        },
        opt_cls,
        kw,
        group_kw=groups,
    )
    for c, p, n in make_batches(steps=5, seed=17):
        switcher_step(model, opt, sw, (c, p, n))
        ref.step({"u": [c], "v": [p, n]}, lambda e: skipgram_loss(e["u"][0], e["v"][0], e["v"][1]))
    tol = _tol(torch.float32)
    for k, msw, osw in (("u", us, uo), ("v", vs, vo)):
        torch.testing.assert_close(torch.from_numpy(msw.getNumpyVersion()), ref.T[k], **tol)
        st = osw.getNumpyVersion()
        assert set(st) == set(ref.S[k]), (k, set(st), set(ref.S[k]))
        for name in ref.S[k]:
            torch.testing.assert_close(torch.from_numpy(st[name]), ref.S[k][name], **tol)


@pytest.mark.parametrize("merge_steps_first", [False, True])
@pytest.mark.parametrize(
    "opt_cls,kw",
    [
        pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
        pytest.param(torch.optim.RMSprop, dict(lr=0.01, momentum=0.5), id="RMSprop-momentum"),
    ],
)
def test_variable_transformer_dummies_with_distinct_ids_train_exactly(
    opt_cls, kw, merge_steps_first
):
    """SpeedTorch's own loop (dummy inputs of variableTransformer, one row per position)
    is exact when no id repeats within a table's batch; also when the layout changes
    after some merged steps (the optimizer switcher follows the model switcher)."""
    torch.manual_seed(6)
    batch, negs = 4, 2
    model = SkipGram()
    opt = opt_cls(model.parameters(), **kw)
    sw = build_switchers("cupy-names", model, opt)
    us, vs, uo, vo = sw
    ref = Reference(
        {
            "u": torch.from_numpy(us.getNumpyVersion()).clone(),
            "v": torch.from_numpy(vs.getNumpyVersion()).clone(),
        },
        opt_cls,
        kw,
    )
    if merge_steps_first:
        for b in make_batches(steps=2, seed=30):
            switcher_step(model, opt, sw, b)
            ref.step(*b)
    dc = torch.from_numpy(us.variableTransformer(batch, 1)).reshape(batch)
    dp, dn = vs.variableTransformer(batch, 1, negs)
    dp, dn = torch.from_numpy(dp).reshape(batch), torch.from_numpy(dn)
    assert us.duplicates == vs.duplicates == "separate"
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        c = torch.randperm(N, generator=g)[:batch]
        pv = torch.randperm(N, generator=g)[: batch * (1 + negs)]
        p, n = pv[:batch], pv[batch:].reshape(batch, negs)
        us.beforeForwardPass(c)
        uo.beforeForwardPass(c)
        vs.beforeForwardPass(p, n)
        vo.beforeForwardPass(p, n)
        loss = model(dc, dp, dn)
        opt.zero_grad()
        loss.backward()
        opt.step()
        us.afterOptimizerStep(c)
        uo.afterOptimizerStep(c)
        vs.afterOptimizerStep(p, n)
        vo.afterOptimizerStep(p, n)
        ref.step(c, p, n)
    tol = _tol(torch.float32)
    torch.testing.assert_close(torch.from_numpy(us.getNumpyVersion()), ref.T["u"], **tol)
    torch.testing.assert_close(torch.from_numpy(vs.getNumpyVersion()), ref.T["v"], **tol)
    for name, arr in vo.getNumpyVersion().items():
        torch.testing.assert_close(torch.from_numpy(arr), ref.S["v"][name], **tol)


def test_plain_sgd_switchers_equal_whole_table_dense_training():
    """Plain SGD: lazy and dense updates agree, so the whole table matches one dense
    nn.Embedding-style parameter trained on the global ids (repeated ids summed)."""
    torch.manual_seed(3)
    model = SkipGram()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    sw = build_switchers("cupy-names", model, opt)
    us, vs, _, _ = sw
    U = torch.nn.Parameter(torch.from_numpy(us.getNumpyVersion()).clone())
    V = torch.nn.Parameter(torch.from_numpy(vs.getNumpyVersion()).clone())
    ref_opt = torch.optim.SGD([U, V], lr=0.3)
    losses, ref_losses = [], []
    for c, p, n in make_batches(seed=5):
        losses.append(switcher_step(model, opt, sw, (c, p, n)))
        loss = skipgram_loss(tnf.embedding(c, U), tnf.embedding(p, V), tnf.embedding(n, V))
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.from_numpy(us.getNumpyVersion()), U.detach(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.from_numpy(vs.getNumpyVersion()), V.detach(), rtol=1e-5, atol=1e-6
    )


def test_sparse_adam_switchers_equal_full_sparse_embedding():
    """SparseAdam's lazy updates with one step count per table are exactly what the
    switchers promise: compare with full-table sparse embeddings trained by SparseAdam."""
    torch.manual_seed(4)
    model = SkipGram(sparse=True)
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.05)
    sw = build_switchers("pytorch-names", model, opt)
    us, vs, uo, vo = sw
    full_u = torch.nn.Embedding(N, D, sparse=True)
    full_v = torch.nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        full_u.weight.copy_(torch.from_numpy(us.getNumpyVersion()))
        full_v.weight.copy_(torch.from_numpy(vs.getNumpyVersion()))
    ref_opt = torch.optim.SparseAdam(list(full_u.parameters()) + list(full_v.parameters()), lr=0.05)
    for c, p, n in make_batches(seed=7):
        switcher_step(model, opt, sw, (c, p, n))
        loss = skipgram_loss(full_u(c), full_v(p), full_v(n))
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    torch.testing.assert_close(
        torch.from_numpy(us.getNumpyVersion()), full_u.weight.detach(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.from_numpy(vs.getNumpyVersion()), full_v.weight.detach(), rtol=1e-5, atol=1e-6
    )
    ref_state = ref_opt.state[full_v.weight]
    for name, arr in vo.getNumpyVersion().items():
        torch.testing.assert_close(torch.from_numpy(arr), ref_state[name], rtol=1e-5, atol=1e-6)


def test_repeated_ids_in_one_batch_are_summed_not_lost():
    """SPEC: 'Repeated ids in one batch ... gadgetloader gives exact results'."""
    emb = torch.nn.Embedding(2, 3)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    sw = gl.ModelFactory(emb, 10, 3, placement="cpu")
    sw.zerosInit()
    _osw = gl.OptimizerFactory(opt, 10, 3, torch.nn.ModuleDict({"e": emb}), "e", placement="cpu")
    _osw.optInit()
    ids = torch.tensor([4, 7, 4, 4])
    local = sw.beforeForwardPass(ids)
    _osw.beforeForwardPass(ids)
    assert local.shape == ids.shape and local.dtype == torch.int64
    assert local[0] == local[2] == local[3] and local[0] != local[1]
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    loss = (emb(local).sum(-1) * w).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    _osw.afterOptimizerStep(ids)
    table = sw.getNumpyVersion()
    np.testing.assert_allclose(table[4], np.full(3, -(1.0 + 3.0 + 4.0)))
    np.testing.assert_allclose(table[7], np.full(3, -2.0))
    untouched = np.delete(table, [4, 7], axis=0)
    assert (untouched == 0).all()


def test_merge_layout_holds_distinct_ids_ascending_and_local_ids_address_them():
    emb = torch.nn.Embedding(4, D)
    sw = gl.PytorchModelFactory(emb, N, D, deviceType="cpu")
    sw.customInit(torch.nn.init.normal_)
    table = sw.getNumpyVersion()
    pos = torch.tensor([[9, 3], [3, 17]])
    neg = torch.tensor([[1, 9, 20]])
    lp, ln = sw.beforeForwardPass(pos, neg)
    assert lp.shape == pos.shape and ln.shape == neg.shape
    distinct = torch.unique(torch.cat([pos.reshape(-1), neg.reshape(-1)]))
    w = emb.weight.detach()
    np.testing.assert_array_equal(w[: len(distinct)].numpy(), table[distinct.numpy()])
    np.testing.assert_array_equal(w[lp].numpy(), table[pos.numpy()])
    np.testing.assert_array_equal(w[ln].numpy(), table[neg.numpy()])
    # an evaluation lookup: writing back unchanged rows changes nothing
    sw.afterOptimizerStep(pos, neg)
    np.testing.assert_array_equal(sw.getNumpyVersion(), table)


def test_ids_as_numpy_list_and_tensor_give_the_same_local_ids():
    emb = torch.nn.Embedding(3, D)
    sw = gl.ModelFactory(emb, N, D, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    ids = [5, 2, 5, 11]
    expected = torch.tensor([1, 0, 1, 2])
    for form in (
        torch.tensor(ids),
        np.array(ids, dtype=np.int32),
        ids,
        torch.tensor(ids, dtype=torch.int16),
        torch.tensor(ids, dtype=torch.uint8),
        np.array(ids, dtype=np.uint16),
        tuple(ids),
    ):
        with torch.no_grad():
            local = sw.beforeForwardPass(form)
        assert torch.equal(local.cpu().long(), expected), (type(form), local)


def test_variable_follows_the_factory_datatype_while_paged():
    """README: 'A datatype other than the model variable's ... makes the variable that
    dtype while it is paged'."""
    for dt in ("float64", torch.float64, "double"):
        emb = torch.nn.Embedding(3, D)  # float32 module
        sw = gl.ModelFactory(emb, N, D, dt, placement="cpu")
        sw.normalDistributionInit(0.0, 1.0)
        assert sw.getNumpyVersion().dtype == np.float64
        with torch.no_grad():
            sw.beforeForwardPass(torch.tensor([1, 2]))
        assert emb.weight.dtype == torch.float64, dt
        np.testing.assert_array_equal(emb.weight.detach()[:2].numpy(), sw.getNumpyVersion()[[1, 2]])


# --------------------------------------------------------------------------------------
# argument forms of the constructors and methods, as SPEC writes them
# --------------------------------------------------------------------------------------


def test_model_factory_positional_and_keyword_forms():
    emb = torch.nn.Embedding(3, D)
    cm = _quiet()
    try:
        a = gl.ModelFactory(emb, N, D, "float32", True)  # SpeedTorch's positional form
        b = gl.ModelFactory(
            model_variable=emb,
            total_classes=N,
            embed_dimension=D,
            datatype=torch.float32,
            CPUPinn=False,
        )
        c = gl.ModelFactory(emb.weight, N, D)  # the Parameter itself
    finally:
        cm.__exit__(None, None, None)
    for sw in (a, b, c):
        assert sw.placement == "cpu"  # CUDA hidden: the GPU placements fall back
        arr = sw.getNumpyVersion()
        assert isinstance(arr, np.ndarray) and arr.shape == (N, D) and arr.dtype == np.float32


def test_pytorch_model_factory_positional_and_keyword_forms():
    emb = torch.nn.Embedding(3, D)
    a = gl.PytorchModelFactory(emb, N, D, "float32", "cpu", False)
    b = gl.PytorchModelFactory(
        model_variable=emb,
        total_classes=N,
        embed_dimension=D,
        datatype=torch.float64,
        deviceType=torch.device("cpu"),
        pinType=False,
    )
    assert a.placement == "cpu" and b.placement == "cpu"
    assert a.getNumpyVersion().dtype == np.float32
    assert b.getNumpyVersion().dtype == np.float64
    assert a.getNumpyVersion().shape == (N, D) == b.getNumpyVersion().shape
    assert str(a.device) == "cpu"


def test_optimizer_factories_positional_and_keyword_forms():
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    _vs = gl.PytorchModelFactory(model.v_embeddings, N, D, deviceType="cpu")
    cm = _quiet()
    try:
        uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", "float32", True)
        uo.optInit()  # the placement may be resolved here
    finally:
        cm.__exit__(None, None, None)
    vo = gl.PytorchOptimizerFactory(
        given_optimizer=opt,
        total_classes=N,
        embed_dimension=D,
        model=model,
        variable_name="v_embeddings",
        dtype=torch.float32,
        deviceType="cpu",
        pinType=False,
    )
    vo.optInit()
    for o in (uo, vo):
        st = o.getNumpyVersion()
        assert set(st) == {"exp_avg", "exp_avg_sq"}
        for arr in st.values():
            assert arr.shape == (N, D) and arr.dtype == np.float32 and (arr == 0).all()
        assert set(o.tables) == {"exp_avg", "exp_avg_sq"}


def test_optimizer_factory_kw_dtype_float64_state_tables():
    model = SkipGram(dtype=torch.float64)
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5)
    _us = gl.ModelFactory(model.u_embeddings, N, D, datatype="float64", placement="cpu")
    uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", dtype=torch.float64, placement="cpu")
    uo.optInit()
    st = uo.getNumpyVersion()
    assert set(st) == {"square_avg", "momentum_buffer"}
    assert all(a.dtype == np.float64 for a in st.values())


def test_datatype_numpy_and_python_forms():
    for dt, expected in (
        (np.float64, np.float64),
        (np.dtype("float32"), np.float32),
        (float, np.float64),
        ("float", np.float32),
        ("double", np.float64),
        (torch.float16, np.float16),
    ):
        sw = gl.ModelFactory(torch.nn.Embedding(3, D), N, D, dt, placement="cpu")
        assert sw.getNumpyVersion().dtype == expected, dt
    sw = gl.ModelFactory(torch.nn.Embedding(3, D), np.int64(N), np.int32(D), placement="cpu")
    assert sw.getNumpyVersion().shape == (N, D)


def test_pin_type_on_a_machine_without_cuda_falls_back_to_cpu():
    cm = _quiet()
    try:
        sw = gl.PytorchModelFactory(torch.nn.Embedding(3, D), N, D, "float32", "cpu", True)
        sw.zerosInit()
    finally:
        cm.__exit__(None, None, None)
    assert sw.placement == "cpu"
    assert (sw.getNumpyVersion() == 0).all()


def test_get_numpy_version_is_a_copy():
    model, opt, us, uo = _adam_opt_switcher()
    before = us.getNumpyVersion().copy()
    a = us.getNumpyVersion()
    a[:] = 123.0
    np.testing.assert_array_equal(us.getNumpyVersion(), before)
    st = uo.getNumpyVersion()
    for v in st.values():
        v[:] = 9.0
    assert all((v == 0).all() for v in uo.getNumpyVersion().values())


def test_optimizer_switcher_calls_before_opt_init_name_it(tmp_path):
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement="cpu")
    for call in (
        uo.getNumpyVersion,
        lambda: uo.saveTorch(tmp_path / "s.pt"),
        lambda: uo.customInit(torch.nn.init.zeros_),
    ):
        with pytest.raises(gl.GadgetError) as ei:
            call()
        _err_mentions(ei.value, "optInit")
    assert not (tmp_path / "s.pt").exists()


def test_rprop_needs_no_warmup_step():
    """SPEC: 'SpeedTorch needed one training step before it could switch Rprop;
    gadgetloader should not.'"""
    model = SkipGram()
    opt = torch.optim.Rprop(model.parameters(), lr=0.02)
    _us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement="cpu")
    uo.optInit()
    st = uo.getNumpyVersion()
    assert set(st) == {"prev", "step_size"}
    assert (st["prev"] == 0).all()
    np.testing.assert_allclose(st["step_size"], np.full((N, D), 0.02, dtype=np.float32))


# --------------------------------------------------------------------------------------
# initialisers
# --------------------------------------------------------------------------------------


def _sw(rows=400, dim=8, **kw):
    emb = torch.nn.Embedding(3, dim)
    return gl.ModelFactory(emb, rows, dim, placement="cpu", **kw)


def test_zeros_uniform_normal_init():
    sw = _sw()
    sw.uniformDistributionInit(low=-0.25, high=0.75)
    a = sw.getNumpyVersion()
    assert a.min() >= -0.25 and a.max() <= 0.75
    assert abs(a.mean() - 0.25) < 0.03 and a.std() > 0.2
    sw.zerosInit()
    assert (sw.getNumpyVersion() == 0).all()
    sw.normalDistributionInit(mean=2.0, stdDev=0.5)
    b = sw.getNumpyVersion()
    assert abs(b.mean() - 2.0) < 0.03 and abs(b.std() - 0.5) < 0.03
    sw.normalDistributionInit(-1.0, 0.0)
    assert (sw.getNumpyVersion() == -1.0).all()


def test_custom_init_with_torch_initialisers():
    sw = _sw(rows=50, dim=6)
    sw.customInit(torch.nn.init.constant_, 0.25)
    assert (sw.getNumpyVersion() == 0.25).all()
    sw.customInit(torch.nn.init.xavier_uniform_)
    a = sw.getNumpyVersion()
    bound = (6.0 / (50 + 6)) ** 0.5
    assert np.abs(a).max() <= bound + 1e-6 and a.std() > bound / 4
    sw.customInit(torch.nn.init.uniform_, a=2.0, b=3.0)
    a = sw.getNumpyVersion()
    assert a.min() >= 2.0 and a.max() <= 3.0


def test_optimizer_custom_init_fills_every_state_table():
    model = SkipGram()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    _us = gl.PytorchModelFactory(model.u_embeddings, N, D, deviceType="cpu")
    uo = gl.PytorchOptimizerFactory(opt, N, D, model, "u_embeddings", deviceType="cpu")
    uo.optInit()
    uo.customInit(torch.nn.init.constant_, 0.1)
    st = uo.getNumpyVersion()
    assert set(st) == {"sum"}
    np.testing.assert_allclose(st["sum"], np.full((N, D), 0.1, dtype=np.float32))


# --------------------------------------------------------------------------------------
# variableTransformer and its duplicate caveat
# --------------------------------------------------------------------------------------


def test_variable_transformer_outputs():
    sw = _sw(rows=N, dim=D)
    assert sw.duplicates == "merge"
    x = sw.variableTransformer(3, 2)
    assert isinstance(x, np.ndarray) and x.dtype == np.int64
    np.testing.assert_array_equal(x, np.arange(6).reshape(3, 2))
    assert sw.duplicates == "separate"
    pos, neg = sw.variableTransformer(batchSize=2, posPerBatch=3, negPerBatch=4)
    assert pos.dtype == np.int64 and neg.dtype == np.int64
    np.testing.assert_array_equal(pos, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(neg, np.arange(6, 14).reshape(2, 4))
    # SpeedTorch-style consumers keep working
    assert torch.LongTensor(pos).dtype == torch.int64 and torch.from_numpy(neg).shape == (2, 4)


def test_variable_transformer_keeps_an_explicit_merge():
    sw = _sw(rows=N, dim=D, duplicates="merge")
    sw.variableTransformer(2, 2)
    assert sw.duplicates == "merge"


def test_variable_transformer_layout_one_row_per_position():
    emb = torch.nn.Embedding(3, D)
    sw = gl.ModelFactory(emb, N, D, placement="cpu")
    sw.customInit(torch.nn.init.normal_)
    table = sw.getNumpyVersion()
    dpos, dneg = sw.variableTransformer(2, 2, 3)
    pos = torch.tensor([[4, 4], [9, 1]])
    neg = torch.tensor([[4, 0, 0], [23, 1, 4]])
    with torch.no_grad():
        sw.beforeForwardPass(pos, neg)
    w = emb.weight.detach().numpy()
    np.testing.assert_array_equal(w[dpos], table[pos.numpy()])
    np.testing.assert_array_equal(w[dneg], table[neg.numpy()])


def test_variable_transformer_duplicate_caveat_last_copy_wins():
    """README: 'each copy is updated on its own and the copy written back last wins'."""
    emb = torch.nn.Embedding(3, 2)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    holder = torch.nn.ModuleDict({"emb": emb})
    sw = gl.ModelFactory(emb, 10, 2, placement="cpu")
    sw.customInit(torch.nn.init.constant_, 5.0)
    osw = gl.OptimizerFactory(opt, 10, 2, holder, "emb", placement="cpu")
    osw.optInit()
    dummy = torch.from_numpy(sw.variableTransformer(1, 4))  # [[0, 1, 2, 3]]
    ids = torch.tensor([[2, 6, 2, 6]])
    sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    weights = torch.tensor([[1.0, 10.0, 100.0, 1000.0]])
    loss = (emb(dummy).sum(-1) * weights).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)
    t = sw.getNumpyVersion()
    # last copies: position 2 (weight 100) for id 2, position 3 (weight 1000) for id 6
    np.testing.assert_allclose(t[2], [5.0 - 100.0] * 2)
    np.testing.assert_allclose(t[6], [5.0 - 1000.0] * 2)
    assert (np.delete(t, [2, 6], axis=0) == 5.0).all()


def test_duplicates_separate_by_argument_without_variable_transformer():
    emb = torch.nn.Embedding(3, 2)
    sw = gl.ModelFactory(emb, 10, 2, placement="cpu", duplicates="separate")
    assert sw.duplicates == "separate"
    sw.customInit(torch.nn.init.normal_)
    ids = torch.tensor([3, 3, 1])
    with torch.no_grad():
        local = sw.beforeForwardPass(ids)
    # one row per position: the local ids are the positions
    assert torch.equal(local.cpu().long(), torch.tensor([0, 1, 2]))
    np.testing.assert_array_equal(emb.weight.detach()[:3].numpy(), sw.getNumpyVersion()[[3, 3, 1]])


# --------------------------------------------------------------------------------------
# saving and loading
# --------------------------------------------------------------------------------------


def test_model_switcher_save_cupy_appends_npy_and_round_trips(tmp_path):
    sw = _sw(rows=N, dim=D)
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    sw.saveCupy(str(tmp_path / "emb"))
    assert (tmp_path / "emb.npy").exists() and not (tmp_path / "emb").exists()
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), before)
    sw.saveCupy(tmp_path / "other.npy")  # a PathLike, already ending in .npy
    assert (tmp_path / "other.npy").exists() and not (tmp_path / "other.npy.npy").exists()
    sw.zerosInit()
    sw.loadCupy(str(tmp_path / "emb.npy"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_model_switcher_load_cupy_refuses_other_shape_or_dtype(tmp_path):
    sw = _sw(rows=N, dim=D)
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    np.save(tmp_path / "shape.npy", np.zeros((N + 1, D), np.float32))
    np.save(tmp_path / "dtype.npy", np.zeros((N, D), np.float64))
    with pytest.raises(gl.GadgetValueError) as ei:
        sw.loadCupy(tmp_path / "shape.npy")
    _err_mentions(ei.value, str(N + 1))
    with pytest.raises(gl.GadgetTypeError) as ei:
        sw.loadCupy(tmp_path / "dtype.npy")
    _err_mentions(ei.value, "float64")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_model_switcher_save_torch_load_torch(tmp_path):
    sw = gl.PytorchModelFactory(torch.nn.Embedding(3, D), N, D, deviceType="cpu")
    sw.normalDistributionInit(0.0, 1.0)
    before = sw.getNumpyVersion().copy()
    f = tmp_path / "emb.pt"
    sw.saveTorch(str(f))
    t = torch.load(f, weights_only=True)
    assert torch.is_tensor(t) and t.device.type == "cpu" and t.shape == (N, D)
    np.testing.assert_array_equal(t.numpy(), before)
    sw.zerosInit()
    sw.loadTorch(f)
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)
    # a float64 file whose values are all float32 values loads (exact conversion)
    torch.save(torch.from_numpy(before).double() * 2, tmp_path / "f64.pt")
    sw.loadTorch(tmp_path / "f64.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before * 2)


def test_model_switcher_loads_fortran_npy_and_non_contiguous_tensor(tmp_path):
    sw = gl.PytorchModelFactory(torch.nn.Embedding(3, D), N, D, deviceType="cpu")
    data = np.random.default_rng(0).standard_normal((N, D)).astype(np.float32)
    np.save(tmp_path / "f.npy", np.asfortranarray(data))
    sw.loadCupy(tmp_path / "f.npy")
    np.testing.assert_array_equal(sw.getNumpyVersion(), data)
    sw.zerosInit()
    torch.save(torch.from_numpy(data.T.copy()).T, tmp_path / "nc.pt")
    sw.loadTorch(tmp_path / "nc.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), data)


def test_model_switcher_load_torch_takes_float_dtypes_that_convert_exactly(tmp_path):
    """README: 'loadTorch refuses a file of another shape, or of another dtype unless both
    are floating point and every value converts exactly (a float64 file of float32 values;
    an integer file is refused)'."""
    sw = gl.PytorchModelFactory(torch.nn.Embedding(3, D), N, D, deviceType="cpu")
    halfs = torch.linspace(-2, 2, N * D).reshape(N, D).half()
    torch.save(halfs, tmp_path / "h.pt")
    sw.loadTorch(tmp_path / "h.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), halfs.float().numpy())
    ints = torch.arange(N * D, dtype=torch.int64).reshape(N, D)
    torch.save(ints, tmp_path / "i.pt")
    with pytest.raises(gl.GadgetTypeError) as ei:
        sw.loadTorch(tmp_path / "i.pt")
    _err_mentions(ei.value, "int64")
    _err_mentions(ei.value, "float32")
    np.testing.assert_array_equal(sw.getNumpyVersion(), halfs.float().numpy())


def test_model_switcher_load_torch_refusals_leave_table_unchanged(tmp_path):
    sw = gl.PytorchModelFactory(torch.nn.Embedding(3, D), N, D, deviceType="cpu")
    sw.normalDistributionInit(0.0, 1.0)
    before = sw.getNumpyVersion().copy()
    torch.save(torch.zeros(N, D + 1), tmp_path / "shape.pt")
    torch.save(torch.full((N, D), 0.1, dtype=torch.float64), tmp_path / "inexact.pt")
    with pytest.raises(gl.GadgetValueError) as ei:
        sw.loadTorch(tmp_path / "shape.pt")
    _err_mentions(ei.value, str(D + 1))
    with pytest.raises(gl.GadgetTypeError) as ei:
        sw.loadTorch(tmp_path / "inexact.pt")
    _err_mentions(ei.value, "float64")
    with pytest.raises(gl.GadgetFileNotFoundError):
        sw.loadTorch(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError):
        sw.loadCupy(tmp_path / "missing.npy")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr"])
def test_model_switcher_save_load_formats(tmp_path, ext):
    if ext == ".h5":
        pytest.importorskip("h5py")
    if ext == ".zarr":
        pytest.importorskip("zarr")
    sw = _sw(rows=N, dim=D)
    sw.uniformDistributionInit(-3, 3)
    before = sw.getNumpyVersion().copy()
    path = tmp_path / f"table{ext}"
    sw.save(path)
    sw.zerosInit()
    sw.load(path)
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def _adam_opt_switcher(model=None):
    model = model or SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    us.uniformDistributionInit(-1, 1)
    uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement="cpu")
    uo.optInit()
    return model, opt, us, uo


def test_optimizer_switcher_save_torch_dict_and_list_forms(tmp_path):
    model, opt, us, uo = _adam_opt_switcher()
    c = torch.tensor([1, 4, 4, 9])
    lc = us.beforeForwardPass(c)
    uo.beforeForwardPass(c)
    loss = model.u_embeddings(lc).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    us.afterOptimizerStep(c)
    uo.afterOptimizerStep(c)
    st = {k: v.copy() for k, v in uo.getNumpyVersion().items()}
    assert (st["exp_avg"][[1, 4, 9]] != 0).any() and (st["exp_avg"][0] == 0).all()
    f = tmp_path / "state.pt"
    uo.saveTorch(f)
    saved = torch.load(f, weights_only=True)
    assert isinstance(saved, dict) and set(saved) == {"exp_avg", "exp_avg_sq"}
    for k, v in saved.items():
        assert v.device.type == "cpu"
        np.testing.assert_array_equal(v.numpy(), st[k])
    uo.customInit(torch.nn.init.zeros_)
    assert all((a == 0).all() for a in uo.getNumpyVersion().values())
    uo.loadTorch(str(f))
    for k, v in uo.getNumpyVersion().items():
        np.testing.assert_array_equal(v, st[k])
    # SpeedTorch's layout: a list of tensors in state order
    order = list(uo.tables)
    torch.save([torch.from_numpy(st[k]) * 3 for k in order], tmp_path / "list.pt")
    uo.loadTorch(tmp_path / "list.pt")
    for k, v in uo.getNumpyVersion().items():
        np.testing.assert_array_equal(v, st[k] * 3)
    # no .npy forms on the optimizer switchers (several tables)
    assert not hasattr(uo, "saveCupy") and not hasattr(uo, "loadCupy")


def test_optimizer_switcher_load_torch_refusals_change_nothing(tmp_path):
    model, opt, us, uo = _adam_opt_switcher()
    uo.customInit(torch.nn.init.constant_, 0.5)
    before = {k: v.copy() for k, v in uo.getNumpyVersion().items()}
    good = torch.ones(N, D)
    cases = {
        "missing_name.pt": {"exp_avg": good},
        "extra_name.pt": {"exp_avg": good, "exp_avg_sq": good, "bogus": good},
        "shape.pt": {"exp_avg": good, "exp_avg_sq": torch.ones(N, D + 2)},
        "list_short.pt": [good],
        "not_a_table.pt": "hello",
    }
    for name, obj in cases.items():
        torch.save(obj, tmp_path / name)
        with pytest.raises(gl.GadgetError) as ei:
            uo.loadTorch(tmp_path / name)
        assert isinstance(ei.value, (ValueError, TypeError)), (name, ei.value)
        for k, v in uo.getNumpyVersion().items():
            np.testing.assert_array_equal(v, before[k], err_msg=name)
    # the first table fits, the second does not: nothing written at all
    torch.save(
        {"exp_avg": good * 7, "exp_avg_sq": torch.ones(N, D, dtype=torch.float64) * 0.1},
        tmp_path / "half.pt",
    )
    with pytest.raises(gl.GadgetTypeError):
        uo.loadTorch(tmp_path / "half.pt")
    for k, v in uo.getNumpyVersion().items():
        np.testing.assert_array_equal(v, before[k])


def test_resume_through_save_torch_matches_uninterrupted_training(tmp_path):
    """SGD with momentum (no step count): save the tables with saveTorch, build a new
    model and switchers, load, continue: the same tables as uninterrupted training."""
    batches = make_batches(steps=6, seed=11)
    kw = dict(lr=0.2, momentum=0.9)

    def fresh(seed_tables=None):
        model = SkipGram()
        opt = torch.optim.SGD(model.parameters(), **kw)
        sw = build_switchers("cupy-names", model, opt)
        return model, opt, sw

    torch.manual_seed(0)
    m1, o1, sw1 = fresh()
    start = [sw1[0].getNumpyVersion().copy(), sw1[1].getNumpyVersion().copy()]
    for b in batches[:3]:
        switcher_step(m1, o1, sw1, b)
    for i, s in enumerate(sw1):
        s.saveTorch(tmp_path / f"s{i}.pt")
    for b in batches[3:]:
        switcher_step(m1, o1, sw1, b)

    m2, o2, sw2 = fresh()
    for i, s in enumerate(sw2):
        s.loadTorch(tmp_path / f"s{i}.pt")
    assert not np.array_equal(sw2[0].getNumpyVersion(), start[0])
    for b in batches[3:]:
        switcher_step(m2, o2, sw2, b)
    np.testing.assert_allclose(
        sw2[0].getNumpyVersion(), sw1[0].getNumpyVersion(), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        sw2[1].getNumpyVersion(), sw1[1].getNumpyVersion(), rtol=1e-6, atol=1e-7
    )
    for k, v in sw2[3].getNumpyVersion().items():
        np.testing.assert_allclose(v, sw1[3].getNumpyVersion()[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_of_switchers_resumes_adam_training_exactly(tmp_path, fmt):
    """README: save_checkpoint of the switchers and their optimizer (step counts
    included); load_checkpoint into freshly built switchers resumes bit-identically."""
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    batches = make_batches(steps=6, seed=21)

    def fresh():
        model = SkipGram()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        return model, opt, build_switchers("cupy-names", model, opt)

    def objects(model, opt, sw):
        us, vs, uo, vo = sw
        return {"model": model, "u": us, "v": vs, "u_opt": uo, "v_opt": vo, "opt": opt}

    torch.manual_seed(0)
    m1, o1, sw1 = fresh()
    for b in batches[:3]:
        switcher_step(m1, o1, sw1, b)
    gl.save_checkpoint(tmp_path / "ckpt", objects(m1, o1, sw1), format=fmt)
    for b in batches[3:]:
        switcher_step(m1, o1, sw1, b)

    torch.manual_seed(123)
    m2, o2, sw2 = fresh()
    gl.load_checkpoint(tmp_path / "ckpt", objects(m2, o2, sw2))
    for b in batches[3:]:
        switcher_step(m2, o2, sw2, b)
    for a, b in ((sw1[0], sw2[0]), (sw1[1], sw2[1])):
        np.testing.assert_array_equal(b.getNumpyVersion(), a.getNumpyVersion())
    for a, b in ((sw1[2], sw2[2]), (sw1[3], sw2[3])):
        sa, sb = a.getNumpyVersion(), b.getNumpyVersion()
        assert set(sa) == set(sb)
        for k in sa:
            np.testing.assert_array_equal(sb[k], sa[k])


@pytest.mark.parametrize("padding_idx", [2, -1])
def test_padding_idx_is_a_global_id_of_the_table(padding_idx):
    """README: an nn.Embedding with padding_idx has it taken as a global id of the table;
    that row gets no gradient, as in a full-table nn.Embedding(padding_idx=...)."""
    rows = 6
    emb = torch.nn.Embedding(4, 3, padding_idx=padding_idx)  # -1 -> 3, resolved by torch
    gid = padding_idx % 4
    holder = torch.nn.ModuleDict({"e": emb})
    opt = torch.optim.SGD(holder.parameters(), lr=0.5)
    sw = gl.ModelFactory(emb, rows, 3, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    osw = gl.OptimizerFactory(opt, rows, 3, holder, "e", placement="cpu")
    osw.optInit()
    full = torch.nn.Embedding(rows, 3, padding_idx=gid)
    with torch.no_grad():
        full.weight.copy_(torch.from_numpy(sw.getNumpyVersion()))
    ref_opt = torch.optim.SGD(full.parameters(), lr=0.5)
    w = torch.tensor([0.3, -1.0, 2.0])
    for ids in (torch.tensor([gid, 5, 0, gid]), torch.tensor([1, 5]), torch.tensor([gid])):
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        if gid in ids.tolist():
            assert emb.padding_idx == int(local[(ids == gid).nonzero()[0, 0]])
        else:
            assert emb.padding_idx is None
        opt.zero_grad()
        torch.sin(emb(local) @ w).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        ref_opt.zero_grad()
        torch.sin(full(ids) @ w).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(
        torch.from_numpy(sw.getNumpyVersion()), full.weight.detach(), rtol=1e-6, atol=1e-7
    )


def test_id_buffers_refilled_in_place_each_step():
    """A loader that refills the same CPU id tensors every step: each step must use the
    new values (the row plan is reused only while the ids are unchanged)."""
    torch.manual_seed(12)
    kw = dict(lr=0.05)
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), **kw)
    sw = build_switchers("pytorch-names", model, opt)
    us, vs, _, _ = sw
    ref = Reference(
        {
            "u": torch.from_numpy(us.getNumpyVersion()).clone(),
            "v": torch.from_numpy(vs.getNumpyVersion()).clone(),
        },
        torch.optim.Adam,
        kw,
    )
    batches = make_batches(steps=5, seed=13)
    cb, pb, nb = (torch.empty_like(t) for t in batches[0])
    for c, p, n in batches:
        cb.copy_(c)
        pb.copy_(p)
        nb.copy_(n)
        switcher_step(model, opt, sw, (cb, pb, nb))
        ref.step(c, p, n)
    tol = _tol(torch.float32)
    torch.testing.assert_close(torch.from_numpy(us.getNumpyVersion()), ref.T["u"], **tol)
    torch.testing.assert_close(torch.from_numpy(vs.getNumpyVersion()), ref.T["v"], **tol)


def test_ids_changed_in_place_between_before_and_after_are_refused():
    model, opt, us, uo = _adam_opt_switcher()
    table = us.getNumpyVersion().copy()
    c = torch.tensor([3, 4, 3])
    lc = us.beforeForwardPass(retrievedPosIndexes=c)
    uo.beforeForwardPass(retrievedPosIndexes=c)
    opt.zero_grad()
    model.u_embeddings(lc).sum().backward()
    opt.step()
    c[0] = 10  # the caller's buffer changes under the step
    with pytest.raises(gl.GadgetValueError):
        us.afterOptimizerStep(c)
    with pytest.raises(gl.GadgetValueError):
        uo.afterOptimizerStep(c)
    np.testing.assert_array_equal(us.getNumpyVersion(), table)
    assert all((a == 0).all() for a in uo.getNumpyVersion().values())
    c[0] = 3
    us.afterOptimizerStep(retrievedPosIndexes=c, retrievedNegIndexes=None)
    uo.afterOptimizerStep(retrievedPosIndexes=c, retrievedNegIndexes=None)
    assert (us.getNumpyVersion()[[3, 4]] != table[[3, 4]]).all()


def test_hand_update_after_evaluation_lookup_is_written_back():
    """README: afterOptimizerStep writes back the rows its last beforeForwardPass loaded
    (also an evaluation lookup's, for updates made by hand under torch.no_grad())."""
    emb = torch.nn.Embedding(2, 3)
    sw = gl.ModelFactory(emb, 10, 3, placement="cpu")
    sw.customInit(torch.nn.init.constant_, 1.0)
    pos, neg = torch.tensor([7, 2]), torch.tensor([[7, 7, 5]])
    with torch.no_grad():
        lp, ln = sw.beforeForwardPass(pos, neg)
        emb.weight[lp[0]] += 1.0  # row of id 7, once (its copies share one row)
        emb.weight[ln[0, 2]] *= 4.0  # row of id 5
    sw.afterOptimizerStep(pos, neg)
    t = sw.getNumpyVersion()
    np.testing.assert_array_equal(t[7], [2.0] * 3)
    np.testing.assert_array_equal(t[5], [4.0] * 3)
    np.testing.assert_array_equal(t[2], [1.0] * 3)
    assert (np.delete(t, [2, 5, 7], 0) == 1.0).all()


def test_write_back_never_overwrites_a_later_change():
    """README: afterOptimizerStep never writes over a change made to the table after the
    lookup read the rows: it raises GadgetValueError and writes nothing."""
    emb = torch.nn.Embedding(2, 3)
    sw = gl.ModelFactory(emb, 10, 3, placement="cpu")
    sw.customInit(torch.nn.init.constant_, 1.0)
    ids = torch.tensor([1, 4])
    with torch.no_grad():
        sw.beforeForwardPass(ids)
        emb.weight.add_(5.0)
    sw.zerosInit()  # no step under way: allowed
    with pytest.raises(gl.GadgetValueError):
        sw.afterOptimizerStep(ids)
    assert (sw.getNumpyVersion() == 0).all()


def test_non_interleaved_float64_state_for_float32_tables_trains_like_float32_state():
    """State tables of another dtype than the model table (not interleaved): the state
    rows follow the variable during the step; float32 values are kept exactly."""
    torch.manual_seed(14)
    kw = dict(lr=0.05)
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), **kw)
    us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    vs = gl.ModelFactory(model.v_embeddings, N, D, placement="cpu")
    us.uniformDistributionInit(-0.5, 0.5)
    vs.uniformDistributionInit(-0.5, 0.5)
    uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", dtype="float64", placement="cpu")
    vo = gl.OptimizerFactory(opt, N, D, model, "v_embeddings", dtype="float64", placement="cpu")
    uo.optInit()
    vo.optInit()
    ref = Reference(
        {
            "u": torch.from_numpy(us.getNumpyVersion()).clone(),
            "v": torch.from_numpy(vs.getNumpyVersion()).clone(),
        },
        torch.optim.Adam,
        kw,
    )
    for b in make_batches(steps=5, seed=15):
        switcher_step(model, opt, (us, vs, uo, vo), b)
        ref.step(*b)
    tol = _tol(torch.float32)
    torch.testing.assert_close(torch.from_numpy(us.getNumpyVersion()), ref.T["u"], **tol)
    torch.testing.assert_close(torch.from_numpy(vs.getNumpyVersion()), ref.T["v"], **tol)
    for name, arr in vo.getNumpyVersion().items():
        assert arr.dtype == np.float64
        torch.testing.assert_close(torch.from_numpy(arr).float(), ref.S["v"][name], **tol)


# --------------------------------------------------------------------------------------
# refusals in the middle of a step, and bad inputs of the step calls
# --------------------------------------------------------------------------------------


def test_changes_between_before_and_after_are_refused(tmp_path):
    model, opt, us, uo = _adam_opt_switcher()
    np.save(tmp_path / "t.npy", np.zeros((N, D), np.float32))
    torch.save(torch.zeros(N, D), tmp_path / "t.pt")
    before = us.getNumpyVersion().copy()
    c = torch.tensor([2, 3])
    lc = us.beforeForwardPass(c)
    uo.beforeForwardPass(c)
    assert us.step_under_way()
    for call in (
        us.zerosInit,
        lambda: us.uniformDistributionInit(0, 1),
        lambda: us.normalDistributionInit(0, 1),
        lambda: us.customInit(torch.nn.init.zeros_),
        lambda: us.loadCupy(tmp_path / "t.npy"),
        lambda: us.loadTorch(tmp_path / "t.pt"),
        lambda: uo.customInit(torch.nn.init.ones_),
        lambda: uo.tables["exp_avg"].insertData(torch.ones(1, D), [2]),
        lambda: gl.scatter_many([uo.tables["exp_avg_sq"]], [torch.ones(1, D)], [3]),
    ):
        with pytest.raises(gl.GadgetValueError):
            call()
    np.testing.assert_array_equal(us.getNumpyVersion(), before)
    assert all((a == 0).all() for a in uo.getNumpyVersion().values())
    loss = model.u_embeddings(lc).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    us.afterOptimizerStep(c)
    uo.afterOptimizerStep(c)
    assert not us.step_under_way()
    after = us.getNumpyVersion()
    assert (after[[2, 3]] != before[[2, 3]]).all()
    np.testing.assert_array_equal(np.delete(after, [2, 3], 0), np.delete(before, [2, 3], 0))


@pytest.mark.parametrize(
    "bad,exc,parts",
    [
        (torch.tensor([3, N]), gl.GadgetIndexError, [str(N)]),
        (torch.tensor([-1, 2]), gl.GadgetIndexError, ["-1"]),
        (torch.tensor([1.0, 2.0]), gl.GadgetTypeError, ["float"]),
        (torch.tensor([True, False]), gl.GadgetTypeError, ["bool"]),
        ("1,2", gl.GadgetTypeError, ["str"]),
        (np.array([0.5]), gl.GadgetTypeError, ["float"]),
    ],
)
def test_before_forward_pass_bad_ids(bad, exc, parts):
    model, opt, us, uo = _adam_opt_switcher()
    table = us.getNumpyVersion().copy()
    state = {k: v.copy() for k, v in uo.getNumpyVersion().items()}
    for call in (us.beforeForwardPass, uo.beforeForwardPass):
        with pytest.raises(exc) as ei:
            call(bad)
        _err_mentions(ei.value, *parts)
    with pytest.raises(exc):
        us.beforeForwardPass(torch.tensor([1, 2]), bad)
    assert not us.step_under_way()
    np.testing.assert_array_equal(us.getNumpyVersion(), table)
    for k, v in uo.getNumpyVersion().items():
        np.testing.assert_array_equal(v, state[k])
    # the switchers still work after the refusals
    c = torch.tensor([5, 6])
    lc = us.beforeForwardPass(c)
    uo.beforeForwardPass(c)
    opt.zero_grad()
    model.u_embeddings(lc).sum().backward()
    opt.step()
    us.afterOptimizerStep(c)
    uo.afterOptimizerStep(c)
    assert (us.getNumpyVersion()[[5, 6]] != table[[5, 6]]).all()


def test_after_optimizer_step_with_other_ids_is_refused_and_writes_nothing():
    model, opt, us, uo = _adam_opt_switcher()
    table = us.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError):
        us.afterOptimizerStep(torch.tensor([1, 2]))  # no beforeForwardPass yet
    c = torch.tensor([1, 2])
    lc = us.beforeForwardPass(c)
    uo.beforeForwardPass(c)
    opt.zero_grad()
    model.u_embeddings(lc).sum().backward()
    opt.step()
    with pytest.raises(gl.GadgetValueError) as ei:
        us.afterOptimizerStep(torch.tensor([7, 8, 9]))
    _err_mentions(ei.value, "beforeForwardPass")
    with pytest.raises(gl.GadgetValueError):
        uo.afterOptimizerStep(torch.tensor([7, 8]))
    np.testing.assert_array_equal(us.getNumpyVersion(), table)
    assert all((a == 0).all() for a in uo.getNumpyVersion().values())
    us.afterOptimizerStep(c)
    uo.afterOptimizerStep(c)
    assert (us.getNumpyVersion()[[1, 2]] != table[[1, 2]]).all()
    assert (uo.getNumpyVersion()["exp_avg"][[1, 2]] != 0).all()


def test_initialiser_bad_values_leave_table_unchanged():
    sw = _sw(rows=N, dim=D)
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    cases = [
        (lambda: sw.uniformDistributionInit(1.0, 0.0), gl.GadgetValueError, ["1.0", "0.0"]),
        (lambda: sw.uniformDistributionInit(float("nan"), 1.0), gl.GadgetValueError, ["nan"]),
        (lambda: sw.uniformDistributionInit(0.0, float("inf")), gl.GadgetValueError, ["inf"]),
        (lambda: sw.uniformDistributionInit("0", 1.0), gl.GadgetTypeError, ["str"]),
        (lambda: sw.normalDistributionInit(0.0, -1.0), gl.GadgetValueError, ["-1.0"]),
        (lambda: sw.normalDistributionInit(None, 1.0), gl.GadgetTypeError, ["None"]),
        (lambda: sw.normalDistributionInit(0.0, float("nan")), gl.GadgetValueError, ["nan"]),
        (lambda: sw.customInit("xavier"), gl.GadgetTypeError, ["str"]),
        (lambda: sw.customInit(None), gl.GadgetTypeError, ["None"]),
    ]
    for call, exc, parts in cases:
        with pytest.raises(exc) as ei:
            call()
        _err_mentions(ei.value, *parts)
        np.testing.assert_array_equal(sw.getNumpyVersion(), before)


@pytest.mark.parametrize(
    "args,exc,part",
    [
        ((0, 3), gl.GadgetValueError, "0"),
        ((-2, 3), gl.GadgetValueError, "-2"),
        ((2.5, 3), gl.GadgetValueError, "2.5"),
        (("2", 3), gl.GadgetTypeError, "'2'"),
        ((2, 0), gl.GadgetValueError, "posPerBatch"),
        ((2, 3, -1), gl.GadgetValueError, "negPerBatch"),
        ((2, None), gl.GadgetTypeError, "posPerBatch"),
    ],
)
def test_variable_transformer_bad_arguments(args, exc, part):
    sw = _sw(rows=N, dim=D)
    with pytest.raises(exc) as ei:
        sw.variableTransformer(*args)
    _err_mentions(ei.value, part)
    assert sw.duplicates == "merge"  # a refused call selects nothing


def test_model_factory_bad_constructor_arguments():
    emb = torch.nn.Embedding(3, D)
    cases = [
        (
            lambda: gl.ModelFactory(torch.nn.Embedding(3, D + 1), N, D, placement="cpu"),
            gl.GadgetValueError,
            [str(D), str(D + 1)],
        ),
        (lambda: gl.ModelFactory(emb, 0, D, placement="cpu"), gl.GadgetValueError, ["0"]),
        (lambda: gl.ModelFactory(emb, -4, D, placement="cpu"), gl.GadgetValueError, ["-4"]),
        (lambda: gl.ModelFactory(emb, 10.5, D, placement="cpu"), gl.GadgetValueError, ["10.5"]),
        (lambda: gl.ModelFactory(emb, "10", D, placement="cpu"), gl.GadgetTypeError, ["'10'"]),
        (lambda: gl.ModelFactory(emb, N, "5", placement="cpu"), gl.GadgetTypeError, ["'5'"]),
        (
            lambda: gl.ModelFactory(emb, N, D, "float33", placement="cpu"),
            gl.GadgetTypeError,
            ["float33"],
        ),
        (
            lambda: gl.ModelFactory(emb, N, D, torch.int64, placement="cpu"),
            gl.GadgetTypeError,
            ["int64"],
        ),
        (
            lambda: gl.ModelFactory(emb, N, D, CPUPinn="False"),
            gl.GadgetTypeError,
            ["CPUPinn", "'False'"],
        ),
        (lambda: gl.ModelFactory(emb, N, D, CPUPinn=2), gl.GadgetTypeError, ["CPUPinn"]),
        (lambda: gl.ModelFactory(emb, N, D, placement="file"), gl.GadgetKeyError, ["file"]),
        (lambda: gl.ModelFactory(emb, N, D, placement="gpu"), gl.GadgetKeyError, ["gpu", "pinned"]),
        (
            lambda: gl.ModelFactory(emb, N, D, placement="cpu", duplicates="both"),
            gl.GadgetError,
            ["both", "merge"],
        ),
        (lambda: gl.ModelFactory("emb", N, D, placement="cpu"), gl.GadgetTypeError, ["str"]),
        (
            lambda: gl.ModelFactory(torch.zeros(3, D), N, D, placement="cpu"),
            gl.GadgetTypeError,
            ["Tensor"],
        ),
        (lambda: gl.PytorchModelFactory(emb, N, D, deviceType="tpu"), gl.GadgetValueError, ["tpu"]),
        (lambda: gl.PytorchModelFactory(emb, N, D, deviceType=3), gl.GadgetTypeError, ["3"]),
        (
            lambda: gl.PytorchModelFactory(emb, N, D, deviceType="cpu", pinType="False"),
            gl.GadgetTypeError,
            ["pinType"],
        ),
    ]
    w_before = emb.weight.detach().clone()
    for call, exc, parts in cases:
        with pytest.raises(exc) as ei:
            call()
        _err_mentions(ei.value, *parts)
    assert torch.equal(emb.weight.detach(), w_before)


def test_optimizer_factory_bad_arguments():
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    with pytest.raises(gl.GadgetError) as ei:
        gl.OptimizerFactory(opt, N, D, model, "nope", placement="cpu").optInit()
    _err_mentions(ei.value, "nope")
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.OptimizerFactory(lbfgs, N, D, model, "u_embeddings", placement="cpu").optInit()
    _err_mentions(ei.value, "LBFGS", "Adam")
    with pytest.raises(gl.GadgetTypeError):
        gl.OptimizerFactory("adam", N, D, model, "u_embeddings", placement="cpu").optInit()
    other = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(gl.GadgetError) as ei:
        gl.OptimizerFactory(other, N, D, model, "u_embeddings", placement="cpu").optInit()
    _err_mentions(ei.value, "optimizer")
    with pytest.raises(gl.GadgetTypeError):
        gl.OptimizerFactory(opt, N, D, model, "u_embeddings", CPUPinn="yes")
    with pytest.raises(gl.GadgetTypeError):
        gl.PytorchOptimizerFactory(opt, N, D, model, "u_embeddings", deviceType="cpu", pinType="no")
    with pytest.raises(gl.GadgetError):
        gl.PytorchOptimizerFactory(opt, N, D, model, "u_embeddings", deviceType="tpu")
    diff = torch.optim.Adam(model.parameters(), lr=0.01, differentiable=True)
    with pytest.raises(gl.GadgetError):
        gl.OptimizerFactory(diff, N, D, model, "u_embeddings", placement="cpu").optInit()


def test_optimizer_factory_shape_must_match_model_switcher():
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.OptimizerFactory(opt, N + 3, D, model, "u_embeddings", placement="cpu").optInit()
    _err_mentions(ei.value, str(N + 3), str(N))


def test_optimizer_switcher_before_opt_init_is_an_error():
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    us = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    uo = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement="cpu")
    with pytest.raises(gl.GadgetError) as ei:
        uo.beforeForwardPass(torch.tensor([1]))
    _err_mentions(ei.value, "optInit")
    assert not us.step_under_way()


@pytest.mark.parametrize(
    "path,exc",
    [(None, gl.GadgetTypeError), (b"emb.npy", gl.GadgetTypeError), (12, gl.GadgetTypeError)],
)
def test_save_load_bad_paths(tmp_path, path, exc):
    sw = _sw(rows=N, dim=D)
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    model, opt, _us, uo = _adam_opt_switcher()
    for call in (sw.saveCupy, sw.loadCupy, sw.saveTorch, sw.loadTorch, uo.saveTorch, uo.loadTorch):
        with pytest.raises(exc):
            call(path)
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_load_of_a_corrupt_file_is_a_file_error_and_changes_nothing(tmp_path):
    sw = _sw(rows=N, dim=D)
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    np.save(tmp_path / "ok.npy", np.zeros((N, D), np.float32))
    raw = (tmp_path / "ok.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "junk.pt").write_bytes(b"not a torch file at all")
    with pytest.raises(gl.GadgetFileError):
        sw.loadCupy(tmp_path / "cut.npy")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(tmp_path / "junk.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


# --------------------------------------------------------------------------------------
# DataGadget with SpeedTorch's names
# --------------------------------------------------------------------------------------


def test_data_gadget_from_npy_file_speedtorch_forms(tmp_path):
    arr = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.save(tmp_path / "t.npy", arr)
    cm = _quiet()
    try:
        g1 = gl.DataGadget(str(tmp_path / "t.npy"))  # CPUPinn=False -> cuda -> cpu fallback
        g2 = gl.DataGadget(fileName=tmp_path / "t.npy", CPUPinn=True)
    finally:
        cm.__exit__(None, None, None)
    g3 = gl.DataGadget(tmp_path / "t.npy", placement="cpu")
    for g in (g1, g2, g3):
        assert (
            g.placement == "cpu"
            and g.shape == (10, 4)
            and g.dtype == torch.float32
            and len(g) == 10
        )
        np.testing.assert_array_equal(g.getNumpyVersion(), arr)
        for ids in (torch.tensor([7, 2, 7]), np.array([7, 2, 7]), [7, 2, 7]):
            out = g.getData(ids)
            assert torch.is_tensor(out) and out.device.type == "cpu"
            np.testing.assert_array_equal(out.numpy(), arr[[7, 2, 7]])


def test_data_gadget_insert_data_last_occurrence_wins():
    g = gl.DataGadget(np.zeros((6, 2), np.float32), placement="cpu")
    rows = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    g.insertData(rows, torch.tensor([4, 1, 4]))
    t = g.getNumpyVersion()
    np.testing.assert_array_equal(t[4], [3.0, 3.0])
    np.testing.assert_array_equal(t[1], [2.0, 2.0])
    assert (t[[0, 2, 3, 5]] == 0).all()
    g.insertData(dataObject=torch.full((1, 2), 9.0), indexes=[0])
    np.testing.assert_array_equal(g.getData([0]).numpy(), [[9.0, 9.0]])


def test_data_gadget_save_load_cupy(tmp_path):
    g = gl.DataGadget(np.arange(12, dtype=np.float32).reshape(6, 2), placement="cpu")
    g.saveCupy(str(tmp_path / "g"))
    assert (tmp_path / "g.npy").exists()
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), g.getNumpyVersion())
    other = np.arange(9, dtype=np.float64).reshape(3, 3)
    np.save(tmp_path / "o.npy", other)
    g.loadCupy(str(tmp_path / "o.npy"))  # takes the file's shape and dtype
    assert g.shape == (3, 3) and g.dtype == torch.float64 and g.placement == "cpu"
    np.testing.assert_array_equal(g.getNumpyVersion(), other)
    g.loadCupy(loadFileName=tmp_path / "g.npy")
    np.testing.assert_array_equal(
        g.getNumpyVersion(), np.arange(12, dtype=np.float32).reshape(6, 2)
    )


def test_data_gadget_bad_inputs_leave_data_unchanged(tmp_path):
    base = np.arange(12, dtype=np.float32).reshape(6, 2)
    g = gl.DataGadget(base, placement="cpu")
    cases = [
        (lambda: g.getData(torch.tensor([0, 6])), gl.GadgetIndexError, ["6"]),
        (lambda: g.getData([-1]), gl.GadgetIndexError, ["-1"]),
        (lambda: g.getData(torch.tensor([0.0])), gl.GadgetTypeError, ["float"]),
        (
            lambda: g.insertData(torch.zeros(2, 2, dtype=torch.float64), [0, 1]),
            gl.GadgetTypeError,
            ["float64", "float32"],
        ),
        (lambda: g.insertData(torch.zeros(3, 2), [0, 1]), gl.GadgetValueError, ["3"]),
        (lambda: g.insertData(torch.zeros(2, 2), [0, 6]), gl.GadgetIndexError, ["6"]),
        (lambda: g.insertData(5.0, [0]), gl.GadgetError, []),
        (lambda: g.saveCupy(None), gl.GadgetTypeError, ["None"]),
        (lambda: g.loadCupy(tmp_path / "nope.npy"), gl.GadgetFileNotFoundError, ["nope.npy"]),
    ]
    for call, exc, parts in cases:
        with pytest.raises(exc) as ei:
            call()
        _err_mentions(ei.value, *parts)
        np.testing.assert_array_equal(g.getNumpyVersion(), base)
    assert g.shape == (6, 2) and g.dtype == torch.float32
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(base, CPUPinn="False")
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(None)
    with pytest.raises(FileNotFoundError):
        gl.DataGadget(str(tmp_path / "missing.npy"), placement="cpu")


def test_fallback_warning_once_for_speedtorch_defaults_in_a_fresh_process(tmp_path):
    """Without CUDA, the SpeedTorch defaults (CPUPinn=False -> cuda, CPUPinn=True ->
    pinned) fall back to cpu with one FallbackWarning per process, and still train."""
    code = textwrap.dedent("""
        import warnings, torch, gadgetloader as gl
        torch.cuda.is_available = lambda: False
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            emb = torch.nn.Embedding(2, 3)
            a = gl.ModelFactory(emb, 10, 3)
            b = gl.ModelFactory(torch.nn.Embedding(2, 3), 10, 3, CPUPinn=True)
            m = torch.nn.ModuleDict({"e": emb})
            opt = torch.optim.SGD(m.parameters(), lr=1.0)
            o = gl.OptimizerFactory(opt, 10, 3, m, "e")
            o.optInit()
            a.zerosInit()
            ids = torch.tensor([3, 3])
            l = a.beforeForwardPass(ids); o.beforeForwardPass(ids)
            opt.zero_grad(); emb(l).sum().backward(); opt.step()
            a.afterOptimizerStep(ids); o.afterOptimizerStep(ids)
        fb = [w for w in rec if issubclass(w.category, gl.FallbackWarning)]
        other = [str(w.message) for w in rec if not issubclass(w.category, gl.FallbackWarning)]
        print("FB", len(fb), a.placement, b.placement, float(a.getNumpyVersion()[3, 0]), other)
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FB")][-1]
    assert line == "FB 1 cpu cpu -2.0 []", line
