"""Black-box review (session 32) of the switcher API (ModelSwitch / OptimizerSwitch and
SpeedTorch's factories) with several tables, several optimizers, merged and separate
layouts, misuse errors and the tables' save / load round trips; written from README.md,
SPEC.md and the public docstrings only.

Reference: a dense ``nn.Embedding`` per table trained by the same torch optimizer with
lazy per-row updates (rows a step does not look up keep their values and optimizer
state; one step count per table), as README "Duplicates" promises: "results equal
training the whole table as one parameter with lazy per-row updates".
"""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl

_REAL_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


D = 3
NU, NI = 13, 17


def T(x):
    return torch.tensor(x, dtype=torch.long)


# --------------------------------------------------------------------------- model


class TwoTower(torch.nn.Module):
    """A user table, an item table and a dense head; every lookup goes through the
    embedding modules, so the switcher model (local ids) and the dense reference (global
    ids) run the same computation."""

    def __init__(self, nu, ni, dtype=torch.float32, sparse=False, padding_idx=None):
        super().__init__()
        self.user = torch.nn.Embedding(nu, D, dtype=dtype, sparse=sparse, padding_idx=padding_idx)
        self.item = torch.nn.Embedding(ni, D, dtype=dtype, sparse=sparse)
        self.head = torch.nn.Linear(D, 1, dtype=dtype)

    def forward(self, u=None, i=None, n=None, un=None):
        loss = 0
        if u is not None and i is not None:
            pu = self.user(u)
            pi = self.item(i)
            loss = loss + ((self.head(pu * pi).squeeze(-1) - 0.5) ** 2).sum()
            if n is not None:
                sn = (pu.unsqueeze(1) * self.item(n)).sum(-1)
                loss = loss + torch.nn.functional.softplus(sn).sum()
            if un is not None:
                loss = loss + (self.user(un) ** 2).sum() * 0.3
        elif i is not None:
            loss = loss + self.head(torch.tanh(self.item(i))).sum()
            if n is not None:
                loss = loss + (self.item(n) ** 3).sum() * 0.1
        elif u is not None:
            loss = loss + self.head(torch.sin(self.user(u))).sum()
            if un is not None:
                loss = loss + (self.user(un) ** 2).sum() * 0.3
        return loss


def _fresh_state(opt, name, p):
    g = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    if isinstance(opt, torch.optim.Rprop) and name == "step_size":
        return torch.full_like(p, g["lr"])
    if isinstance(opt, torch.optim.Adagrad) and name == "sum":
        return torch.full_like(p, g["initial_accumulator_value"])
    return torch.zeros_like(p)


def _row_state(opt, p):
    return {
        k: v for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v) and v.shape == p.shape
    }


def lazy_step(opt, used):
    """opt.step() on dense tables, then undo it for every row the step did not look up
    (values and per-row state): torch's lazy (SparseAdam-style) per-row update."""
    snaps = {
        p: (p.detach().clone(), {k: v.clone() for k, v in _row_state(opt, p).items()}) for p in used
    }
    opt.step()
    for p, ids in used.items():
        keep = torch.ones(p.shape[0], dtype=torch.bool)
        keep[ids] = False
        old, st = snaps[p]
        with torch.no_grad():
            p[keep] = old[keep]
        for k, v in _row_state(opt, p).items():
            src = st[k] if k in st else _fresh_state(opt, k, p)
            v[keep] = src[keep]


# steps with repeats, overlapping pos/neg ids, 2-D negatives, and steps where a table
# is not used at all (step 2: no user table; step 4: no item table)
STEPS = [
    dict(
        u=T([1, 3, 1, 12]),
        i=T([2, 2, 5, 16]),
        n=T([[5, 0], [2, 2], [16, 1], [3, 5]]),
        un=T([3, 3, 0]),
    ),
    dict(i=T([4, 4, 9]), n=T([[9, 4], [0, 0], [1, 4]])),
    dict(u=T([0, 1, 2, 1]), i=T([5, 6, 7, 5]), n=T([[5, 5], [6, 8], [8, 8], [7, 5]])),
    dict(u=T([12, 12]), un=T([12, 1])),
    dict(u=T([3, 4, 3, 4]), i=T([9, 9, 9, 10])),
]

CONV = {
    "torch": lambda x: x,
    "torch_int32": lambda x: x.to(torch.int32),
    "numpy": lambda x: x.numpy(),
    "numpy_int32": lambda x: x.numpy().astype(np.int32),
    "list": lambda x: x.tolist(),
}


def _make_switchers(kind, m, opt_u, opt_i, sd, od):
    """Model and optimizer switchers of both tables through the named API."""
    if kind == "switch":
        us = gl.ModelSwitch(m.user, NU, D, dtype=sd, placement="cpu")
        its = gl.ModelSwitch(m.item, NI, D, dtype=sd, placement="cpu")

        def mkopt(o, n, name):
            return gl.OptimizerSwitch(o, n, D, m, name, dtype=od, placement="cpu")

    elif kind == "factory":
        us = gl.ModelFactory(m.user, NU, D, sd, False, placement="cpu")
        its = gl.ModelFactory(m.item, NI, D, datatype=sd, placement="cpu")

        def mkopt(o, n, name):
            return gl.OptimizerFactory(o, n, D, m, name, od or "float32", placement="cpu")

    elif kind == "pytorch_factory":
        us = gl.PytorchModelFactory(m.user, NU, D, sd, "cpu")
        its = gl.PytorchModelFactory(m.item, NI, D, datatype=sd, deviceType=torch.device("cpu"))

        def mkopt(o, n, name):
            return gl.PytorchOptimizerFactory(o, n, D, m, name, od or "float32", deviceType="cpu")

    else:  # pragma: no cover
        raise AssertionError(kind)
    us.normalDistributionInit(0.0, 1.0)
    its.uniformDistributionInit(-1.0, 1.0)
    uo = mkopt(opt_u, NU, "user")
    io = mkopt(opt_i, NI, "item")
    uo.optInit()
    io.optInit()
    return us, its, uo, io


def train_and_compare(
    opt_cls,
    kw,
    dtype=torch.float32,
    per_table=False,
    ids_kind="torch",
    kind="switch",
    opt_first=False,
    sparse=False,
    padding_idx=None,
    steps=STEPS,
    eval_between=False,
    tweak=None,
    groups=False,
):
    torch.manual_seed(0)
    sd = "float64" if dtype == torch.float64 else "float32"
    od = sd if dtype == torch.float64 else None
    m = TwoTower(4, 8, dtype, sparse=sparse, padding_idx=padding_idx)
    ref = TwoTower(NU, NI, dtype, sparse=sparse, padding_idx=padding_idx)

    def build(model):
        if per_table:
            a = opt_cls([model.user.weight], **kw)
            b = opt_cls([model.item.weight], **kw)
            c = torch.optim.Adam(model.head.parameters(), lr=0.03)
            return [a, b, c], a, b
        if groups:
            a = opt_cls(
                [
                    {"params": [model.user.weight]},
                    {"params": [model.item.weight], "lr": kw["lr"] * 3},
                    {"params": model.head.parameters(), "lr": kw["lr"] / 2},
                ],
                **kw,
            )
        else:
            a = opt_cls(model.parameters(), **kw)
        return [a], a, a

    opts, ou, oi = build(m)
    us, its, uo, io = _make_switchers(kind, m, ou, oi, sd, od)
    with torch.no_grad():
        ref.user.weight.copy_(torch.from_numpy(np.asarray(us.getNumpyVersion())))
        ref.item.weight.copy_(torch.from_numpy(np.asarray(its.getNumpyVersion())))
        ref.head.load_state_dict(m.head.state_dict())
    ropts, rou, roi = build(ref)
    if tweak is not None:
        for o in opts + ropts:
            tweak(o)
    conv = CONV[ids_kind]
    for st in steps:
        u, un, i, n = (st.get(k) for k in ("u", "un", "i", "n"))
        if eval_between:
            with torch.no_grad():
                us.beforeForwardPass(conv(T([0, 5, 5])))
                its.beforeForwardPass(conv(T([3])), conv(T([[3, 7]])))
        lu = lun = li = ln = None
        a = b = None
        if u is not None:
            a = (conv(u),) + ((conv(un),) if un is not None else ())
            if opt_first:
                uo.beforeForwardPass(*a)
            r = us.beforeForwardPass(*a)
            if not opt_first:
                uo.beforeForwardPass(*a)
            lu, lun = r if un is not None else (r, None)
        if i is not None:
            b = (conv(i),) + ((conv(n),) if n is not None else ())
            if opt_first:
                io.beforeForwardPass(*b)
            r = its.beforeForwardPass(*b)
            if not opt_first:
                io.beforeForwardPass(*b)
            li, ln = r if n is not None else (r, None)
        loss = m(lu, li, ln, lun)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        for sw, osw, args in ((us, uo, a), (its, io, b)):
            if args is None:
                continue
            if opt_first:
                osw.afterOptimizerStep(*args)
                sw.afterOptimizerStep(*args)
            else:
                sw.afterOptimizerStep(*args)
                osw.afterOptimizerStep(*args)
        # reference
        rloss = ref(u, i, n, un)
        for o in ropts:
            o.zero_grad()
        rloss.backward()
        used = {}
        if u is not None:
            used[ref.user.weight] = torch.cat(
                [u.reshape(-1)] + ([un.reshape(-1)] if un is not None else [])
            )
        if i is not None:
            used[ref.item.weight] = torch.cat(
                [i.reshape(-1)] + ([n.reshape(-1)] if n is not None else [])
            )
        for o in ropts:
            mine = {
                p: v
                for p, v in used.items()
                if any(p is q for g in o.param_groups for q in g["params"])
            }
            lazy_step(o, mine)
        torch.testing.assert_close(loss.detach(), rloss.detach(), rtol=0, atol=0)
    # final comparison, exact
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(us.getNumpyVersion())), ref.user.weight.detach(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(its.getNumpyVersion())),
        ref.item.weight.detach(),
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(m.head.weight, ref.head.weight, rtol=0, atol=0)
    torch.testing.assert_close(m.head.bias, ref.head.bias, rtol=0, atol=0)
    for osw, ro, rp in ((uo, rou, ref.user.weight), (io, roi, ref.item.weight)):
        got = osw.getNumpyVersion()
        exp = _row_state(ro, rp)
        assert set(got) == set(exp)
        for k in exp:
            torch.testing.assert_close(
                torch.from_numpy(np.asarray(got[k])),
                exp[k],
                rtol=0,
                atol=0,
                msg=lambda s, k=k: f"{k}: {s}",
            )
    return m, ref, (us, its, uo, io), (opts, ropts)


OPTIMIZERS = [
    pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
    pytest.param(
        torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, amsgrad=True), id="AdamW-amsgrad"
    ),
    pytest.param(torch.optim.SGD, dict(lr=0.05), id="SGD"),
    pytest.param(torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), id="SGD-nesterov"),
    pytest.param(
        torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True), id="RMSprop-centered"
    ),
    pytest.param(torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1), id="Adagrad"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0), id="Adadelta"),
    pytest.param(torch.optim.Adamax, dict(lr=0.05), id="Adamax"),
    pytest.param(torch.optim.NAdam, dict(lr=0.05), id="NAdam"),
    pytest.param(torch.optim.RAdam, dict(lr=0.05), id="RAdam"),
    pytest.param(torch.optim.Rprop, dict(lr=0.05), id="Rprop"),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=1), id="ASGD"),
]


# ------------------------------------------------------------ equivalence with dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS)
def test_two_tables_one_optimizer_equal_lazy_dense(opt_cls, kw, dtype):
    train_and_compare(opt_cls, kw, dtype)


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS)
def test_one_optimizer_per_table_equal_lazy_dense(opt_cls, kw):
    train_and_compare(opt_cls, kw, per_table=True)


@pytest.mark.parametrize("ids_kind", list(CONV))
def test_id_forms_give_same_results(ids_kind):
    train_and_compare(torch.optim.Adam, dict(lr=0.05), ids_kind=ids_kind)


@pytest.mark.parametrize("kind", ["factory", "pytorch_factory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_factories_equal_lazy_dense(kind, dtype):
    train_and_compare(torch.optim.AdamW, dict(lr=0.05, weight_decay=0.05), dtype, kind=kind)


@pytest.mark.parametrize("per_table", [False, True])
def test_optimizer_switcher_called_first(per_table):
    # README: "The two switchers of a variable may be called in either order within a step."
    train_and_compare(torch.optim.Adam, dict(lr=0.05), per_table=per_table, opt_first=True)


def test_sparse_adam_per_table_equal_dense_sparse_adam():
    # SparseAdam needs sparse gradients: one SparseAdam per table, Adam for the head.
    train_and_compare(torch.optim.SparseAdam, dict(lr=0.05), per_table=True, sparse=True)


def test_eval_lookups_between_steps_start_no_step():
    # README: "A lookup under torch.no_grad() starts no step"
    train_and_compare(torch.optim.Adam, dict(lr=0.05), eval_between=True)


def test_padding_idx_is_a_global_id_no_gradient():
    # README: padding_idx "taken as a global id of the table ... so that row gets no
    # gradient, as in a full-table embedding (weight decay still moves it when it is in a
    # batch, as there)"; ids 3 and 1 are in several batches.
    train_and_compare(torch.optim.AdamW, dict(lr=0.05, weight_decay=0.2), padding_idx=3)


def test_one_step_counter_per_table_not_advanced_when_unused():
    # README: "one step count per table as in torch's SparseAdam"; step 2 uses no user row
    m, ref, (us, its, uo, io), (opts, ropts) = train_and_compare(torch.optim.Adam, dict(lr=0.05))
    o = opts[0]
    su = o.state[m.user.weight]["step"]
    si = o.state[m.item.weight]["step"]
    assert float(su) == 4.0  # steps 1, 3, 4, 5
    assert float(si) == 4.0  # steps 1, 2, 3, 5


# ------------------------------------------------------------------- row layout


def _simple(n_rows=4, total=10, dtype=torch.float32, opt_cls=torch.optim.Adam, **kw):
    torch.manual_seed(1)
    m = torch.nn.Module()
    m.user = torch.nn.Embedding(n_rows, D, dtype=dtype)
    opt = opt_cls(m.parameters(), lr=0.1)
    us = gl.ModelSwitch(m.user, total, D, placement="cpu", dtype=dtype, **kw)
    us.normalDistributionInit(0.0, 1.0)
    uo = gl.OptimizerSwitch(opt, total, D, m, "user", placement="cpu")
    uo.optInit()
    return m, opt, us, uo


def test_merge_variable_holds_sorted_distinct_rows_then_zero_padding():
    m, opt, us, uo = _simple(n_rows=6)
    table = us.getNumpyVersion().copy()
    local = us.beforeForwardPass(T([7, 2, 7, 9]))
    assert local.tolist() == [1, 0, 1, 2]
    w = m.user.weight.detach()
    np.testing.assert_array_equal(w[:3].numpy(), table[[2, 7, 9]])
    assert torch.count_nonzero(w[3:]) == 0


@pytest.mark.parametrize(
    "pos_shape,neg_shape",
    [((5,), None), ((2, 3), None), ((4,), (4, 3)), ((2, 2), (2, 2, 3)), ((), None)],
)
def test_local_ids_shapes_and_rows(pos_shape, neg_shape):
    m, opt, us, uo = _simple()
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 10, pos_shape, generator=g)
    table = torch.from_numpy(us.getNumpyVersion().copy())
    if neg_shape is None:
        lp = us.beforeForwardPass(pos)
        assert lp.shape == pos.shape and lp.dtype == torch.int64
        torch.testing.assert_close(m.user(lp).detach(), table[pos], rtol=0, atol=0)
    else:
        neg = torch.randint(0, 10, neg_shape, generator=g)
        lp, ln = us.beforeForwardPass(pos, neg)
        assert lp.shape == pos.shape and ln.shape == neg.shape
        torch.testing.assert_close(m.user(lp).detach(), table[pos], rtol=0, atol=0)
        torch.testing.assert_close(m.user(ln).detach(), table[neg], rtol=0, atol=0)


def test_noncontiguous_ids():
    m, opt, us, uo = _simple()
    base = torch.arange(24).reshape(4, 6) % 10
    ids = base[:, ::2].t()
    table = torch.from_numpy(us.getNumpyVersion().copy())
    lp = us.beforeForwardPass(ids)
    assert lp.shape == ids.shape
    torch.testing.assert_close(m.user(lp).detach(), table[ids], rtol=0, atol=0)


def test_variable_capacity_never_shrinks():
    # docstring capacity_for: "never fewer than it had, nor than the batch has positions"
    m, opt, us, uo = _simple(n_rows=2)
    us.beforeForwardPass(torch.arange(7))
    assert m.user.weight.shape[0] >= 7
    big = m.user.weight.shape[0]
    us.beforeForwardPass(T([1]))
    assert m.user.weight.shape[0] == big


@pytest.mark.parametrize("b,p,n", [(2, 3, None), (2, 3, 4), (1, 1, 1), (3, 2, 5)])
def test_variableTransformer_values(b, p, n):
    m, opt, us, uo = _simple()
    r = us.variableTransformer(b, p, n) if n is not None else us.variableTransformer(b, p)
    if n is None:
        assert isinstance(r, np.ndarray) and r.dtype == np.int64
        np.testing.assert_array_equal(r, np.arange(b * p).reshape(b, p))
    else:
        pos, neg = r
        assert pos.dtype == np.int64 and neg.dtype == np.int64
        np.testing.assert_array_equal(pos, np.arange(b * p).reshape(b, p))
        np.testing.assert_array_equal(neg, np.arange(b * p, b * p + b * n).reshape(b, n))
    assert us.duplicates == "separate"


def test_variableTransformer_keeps_explicit_merge():
    # docstring: "Calling it selects duplicates='separate' (unless set explicitly)"
    m, opt, us, uo = _simple(duplicates="merge")
    us.variableTransformer(2, 2)
    assert us.duplicates == "merge"


def test_variableTransformer_only_changes_its_own_switcher():
    m = TwoTower(4, 4)
    us = gl.ModelSwitch(m.user, NU, D, placement="cpu")
    its = gl.ModelSwitch(m.item, NI, D, placement="cpu")
    us.variableTransformer(2, 2)
    assert us.duplicates == "separate" and its.duplicates == "merge"


def test_separate_dummies_distinct_ids_equal_lazy_dense():
    # With distinct ids SpeedTorch's dummy layout trains exactly like the dense table.
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.user = torch.nn.Embedding(2, D)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    us = gl.ModelFactory(m.user, NU, D, placement="cpu")
    us.normalDistributionInit(0.0, 1.0)
    uo = gl.OptimizerFactory(opt, NU, D, m, "user", placement="cpu")
    uo.optInit()
    ref = torch.nn.Embedding(NU, D)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(us.getNumpyVersion()))
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    dpos, dneg = us.variableTransformer(2, 2, 3)
    dpos, dneg = torch.from_numpy(dpos), torch.from_numpy(dneg)
    for pos, neg in [
        (T([[1, 5], [7, 2]]), T([[0, 3, 4], [6, 8, 9]])),
        (T([[12, 11], [10, 1]]), T([[2, 3, 4], [5, 6, 0]])),
    ]:
        us.beforeForwardPass(pos, neg)
        uo.beforeForwardPass(pos, neg)
        loss = (m.user(dpos).sum(-1) ** 2).sum() - m.user(dneg).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        us.afterOptimizerStep(pos, neg)
        uo.afterOptimizerStep(pos, neg)
        rloss = (ref(pos).sum(-1) ** 2).sum() - ref(neg).mean()
        ropt.zero_grad()
        rloss.backward()
        lazy_step(ropt, {ref.weight: torch.cat([pos.reshape(-1), neg.reshape(-1)])})
    torch.testing.assert_close(
        torch.from_numpy(us.getNumpyVersion()), ref.weight.detach(), rtol=0, atol=0
    )
    st = uo.getNumpyVersion()
    for k, v in _row_state(ropt, ref.weight).items():
        torch.testing.assert_close(torch.from_numpy(st[k]), v, rtol=0, atol=0)


def test_separate_repeats_last_copy_wins_with_state():
    # README: "each copy is updated on its own and the copy written back last wins"
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.user = torch.nn.Embedding(2, D)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    us = gl.ModelSwitch(m.user, NU, D, placement="cpu")
    us.normalDistributionInit(0.0, 1.0)
    uo = gl.OptimizerSwitch(opt, NU, D, m, "user", placement="cpu")
    uo.optInit()
    table0 = torch.from_numpy(us.getNumpyVersion().copy())
    pos = T([[4, 2], [4, 9]])
    neg = T([[2, 4, 0]])
    dpos, dneg = (torch.from_numpy(x) for x in us.variableTransformer(2, 2, 3))
    dneg = dneg[:1]  # this batch has one negative row of three: local rows 4, 5, 6
    assert dneg.tolist() == [[4, 5, 6]]
    us.beforeForwardPass(pos, neg)
    uo.beforeForwardPass(pos, neg)
    coef = torch.arange(1, 8, dtype=torch.float32).reshape(7, 1)

    def f(w_pos, w_neg):
        x = torch.cat([w_pos.reshape(-1, D), w_neg.reshape(-1, D)])
        return (x * coef).sum() + (x**2).sum()

    loss = f(m.user(dpos), m.user(dneg))
    opt.zero_grad()
    loss.backward()
    opt.step()
    us.afterOptimizerStep(pos, neg)
    uo.afterOptimizerStep(pos, neg)
    # reference: one row per position, fresh Adam, the last position of an id wins
    all_ids = torch.cat([pos.reshape(-1), neg.reshape(-1)])
    P = torch.nn.Parameter(table0[all_ids].clone())
    ropt = torch.optim.Adam([P], lr=0.05)
    f(P[:4], P[4:]).backward()
    ropt.step()
    exp = table0.clone()
    exp_m = torch.zeros_like(table0)
    for pos_i, gid in enumerate(all_ids.tolist()):
        exp[gid] = P.detach()[pos_i]
        exp_m[gid] = ropt.state[P]["exp_avg"][pos_i]
    torch.testing.assert_close(torch.from_numpy(us.getNumpyVersion()), exp, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.from_numpy(uo.getNumpyVersion()["exp_avg"]), exp_m, rtol=0, atol=0
    )


def test_separate_local_ids_are_positions():
    m, opt, us, uo = _simple(duplicates="separate")
    lp, ln = us.beforeForwardPass(T([[3, 3], [1, 3]]), T([[3, 5, 5]]))
    assert lp.tolist() == [[0, 1], [2, 3]] and ln.tolist() == [[4, 5, 6]]
    table = us.getNumpyVersion()
    np.testing.assert_array_equal(m.user.weight.detach()[:7].numpy(), table[[3, 3, 1, 3, 3, 5, 5]])


def test_datatype_other_than_variable_makes_variable_that_dtype():
    # README: "A datatype other than the model variable's ... makes the variable that dtype
    # while it is paged"
    m, opt, us, uo = _simple(dtype=torch.float32)
    m2 = torch.nn.Module()
    m2.user = torch.nn.Embedding(4, D)
    sw = gl.ModelSwitch(m2.user, 10, D, dtype="float64", placement="cpu")
    sw.uniformDistributionInit(-1.0, 1.0)
    sw.beforeForwardPass(T([1, 2]))
    assert m2.user.weight.dtype == torch.float64
    np.testing.assert_array_equal(m2.user.weight.detach()[:2].numpy(), sw.getNumpyVersion()[[1, 2]])


def test_optimizer_factory_state_dtype_default_float32_switch_default_own():
    m = torch.nn.Module()
    m.user = torch.nn.Embedding(4, D, dtype=torch.float64)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    _us = gl.ModelSwitch(m.user, 10, D, dtype="float64", placement="cpu")
    a = gl.OptimizerFactory(opt, 10, D, m, "user", placement="cpu")
    a.optInit()
    assert {v.dtype for v in a.getNumpyVersion().values()} == {np.dtype(np.float32)}


# --------------------------------------------------------------------- misuse


def _state(us, uo):
    return us.getNumpyVersion().copy(), {k: v.copy() for k, v in uo.getNumpyVersion().items()}


def _assert_same(before, us, uo):
    t, st = before
    np.testing.assert_array_equal(us.getNumpyVersion(), t)
    got = uo.getNumpyVersion()
    for k in st:
        np.testing.assert_array_equal(got[k], st[k])


def _train_fwd(m, opt, us, uo, ids):
    local = us.beforeForwardPass(ids)
    uo.beforeForwardPass(ids)
    opt.zero_grad()
    (m.user(local) ** 2).sum().backward()
    opt.step()
    return local


@pytest.mark.parametrize("which", ["model", "optimizer"])
def test_after_without_before_refused(which):
    m, opt, us, uo = _simple()
    before = _state(us, uo)
    sw = us if which == "model" else uo
    with pytest.raises(gl.GadgetValueError, match="beforeForwardPass"):
        sw.afterOptimizerStep(T([1, 2]))
    _assert_same(before, us, uo)


@pytest.mark.parametrize("which", ["model", "optimizer"])
@pytest.mark.parametrize(
    "other", [[1, 2, 1, 3], [1, 2, 3, 4, 5], [5]], ids=["same-count", "more", "fewer"]
)
def test_after_with_other_ids_refused_then_right_ids_work(which, other):
    m, opt, us, uo = _simple()
    ids = T([5, 2, 5, 7])
    before = _state(us, uo)
    _train_fwd(m, opt, us, uo, ids)
    sw = us if which == "model" else uo
    with pytest.raises(gl.GadgetValueError, match="same ids"):
        sw.afterOptimizerStep(T(other))
    _assert_same(before, us, uo)
    assert us.step_under_way()
    us.afterOptimizerStep(ids)
    uo.afterOptimizerStep(ids)
    assert not us.step_under_way()
    after = us.getNumpyVersion()
    assert not np.array_equal(after[[2, 5, 7]], before[0][[2, 5, 7]])
    np.testing.assert_array_equal(after[[0, 1, 3, 4, 6, 8, 9]], before[0][[0, 1, 3, 4, 6, 8, 9]])
    assert (uo.getNumpyVersion()["exp_avg_sq"][[2, 5, 7]] > 0).all()


@pytest.mark.parametrize("form", ["clone", "numpy", "list", "int32"])
def test_after_accepts_equal_ids_in_other_objects(form):
    m, opt, us, uo = _simple()
    ids = T([5, 2, 5, 7])
    local = _train_fwd(m, opt, us, uo, ids)
    expect = m.user.weight.detach()[local].clone()
    other = {
        "clone": ids.clone(),
        "numpy": ids.numpy().copy(),
        "list": ids.tolist(),
        "int32": ids.int(),
    }[form]
    us.afterOptimizerStep(other)
    uo.afterOptimizerStep(other)
    np.testing.assert_array_equal(us.getNumpyVersion()[ids.numpy()], expect.numpy())


def test_ids_buffer_changed_in_place_refused():
    # CPU ids' plan is reused while "the values" are unchanged; a refilled buffer is other ids
    m, opt, us, uo = _simple()
    ids = T([5, 2, 5, 7])
    before = _state(us, uo)
    _train_fwd(m, opt, us, uo, ids)
    ids[0] = 9
    with pytest.raises(gl.GadgetValueError):
        us.afterOptimizerStep(ids)
    _assert_same(before, us, uo)


@pytest.mark.parametrize(
    "bad,exc",
    [
        (T([1, 10]), gl.GadgetIndexError),
        (T([-1, 2]), gl.GadgetIndexError),
        (torch.tensor([1.0, 2.0]), gl.GadgetTypeError),
        (torch.tensor([True, False]), gl.GadgetTypeError),
        (["a", "b"], gl.GadgetTypeError),
        (np.array([0.5]), gl.GadgetTypeError),
    ],
    ids=["past-end", "negative", "float", "bool", "str", "np-float"],
)
@pytest.mark.parametrize("which", ["model", "optimizer"])
def test_bad_ids_refused_and_step_under_way_kept(bad, exc, which):
    # README: "a beforeForwardPass that fails leaves the step under way as it was"
    m, opt, us, uo = _simple()
    ids = T([3, 1, 3])
    before = _state(us, uo)
    local = _train_fwd(m, opt, us, uo, ids)
    w = m.user.weight.detach().clone()
    sw = us if which == "model" else uo
    with pytest.raises(exc):
        sw.beforeForwardPass(bad)
    torch.testing.assert_close(m.user.weight.detach(), w, rtol=0, atol=0)
    _assert_same(before, us, uo)
    assert us.step_under_way()
    us.afterOptimizerStep(ids)
    uo.afterOptimizerStep(ids)
    np.testing.assert_array_equal(us.getNumpyVersion()[[1, 3]], w[local[[1, 0]]].numpy())


@pytest.mark.parametrize("bad", [T([0, 10]), T([-3])], ids=["past-end", "negative"])
def test_bad_negative_ids_refused(bad):
    m, opt, us, uo = _simple()
    before = _state(us, uo)
    with pytest.raises(gl.GadgetIndexError):
        us.beforeForwardPass(T([1, 2]), bad)
    assert not us.step_under_way()
    _assert_same(before, us, uo)


def test_abandoned_step_replaced_by_next_before():
    # README: "the next successful one replaces an abandoned step"
    m, opt, us, uo = _simple()
    before = _state(us, uo)
    us.beforeForwardPass(T([1, 2]))
    uo.beforeForwardPass(T([1, 2]))
    ids = T([4, 4, 6])
    local = _train_fwd(m, opt, us, uo, ids)
    expect = m.user.weight.detach()[local].clone()
    with pytest.raises(gl.GadgetValueError):
        us.afterOptimizerStep(T([1, 2]))
    us.afterOptimizerStep(ids)
    uo.afterOptimizerStep(ids)
    t = us.getNumpyVersion()
    np.testing.assert_array_equal(t[[4, 4, 6]], expect.numpy())
    np.testing.assert_array_equal(t[[0, 1, 2, 3, 5, 7, 8, 9]], before[0][[0, 1, 2, 3, 5, 7, 8, 9]])


def test_second_after_changes_nothing():
    m, opt, us, uo = _simple()
    ids = T([5, 2, 5])
    _train_fwd(m, opt, us, uo, ids)
    us.afterOptimizerStep(ids)
    uo.afterOptimizerStep(ids)
    snap = _state(us, uo)
    try:
        us.afterOptimizerStep(ids)
        uo.afterOptimizerStep(ids)
    except gl.GadgetValueError:
        pass
    _assert_same(snap, us, uo)


def test_second_after_never_overwrites_a_later_change():
    # README: afterOptimizerStep "never [writes] over a change made to the table after that
    # lookup read them ... then it raises GadgetValueError and writes nothing"
    m, opt, us, uo = _simple()
    ids = T([5, 2, 5])
    _train_fwd(m, opt, us, uo, ids)
    us.afterOptimizerStep(ids)
    uo.afterOptimizerStep(ids)
    us.zerosInit()
    uo.customInit(torch.nn.init.constant_, 0.25)
    with contextlib.suppress(gl.GadgetValueError):
        us.afterOptimizerStep(ids)
    with contextlib.suppress(gl.GadgetValueError):
        uo.afterOptimizerStep(ids)
    assert not us.getNumpyVersion().any()
    for v in uo.getNumpyVersion().values():
        assert (v == 0.25).all()


def test_eval_lookup_then_change_then_after_refused():
    m, opt, us, uo = _simple()
    ids = T([5, 2])
    with torch.no_grad():
        us.beforeForwardPass(ids)
    assert not us.step_under_way()
    us.uniformDistributionInit(2.0, 3.0)
    snap = us.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError):
        us.afterOptimizerStep(ids)
    np.testing.assert_array_equal(us.getNumpyVersion(), snap)


def test_eval_lookup_hand_update_written_back():
    # README: afterOptimizerStep writes back "also an evaluation lookup's, for updates made
    # by hand under torch.no_grad()"
    m, opt, us, uo = _simple()
    ids = T([5, 2, 5])
    snap = us.getNumpyVersion().copy()
    with torch.no_grad():
        local = us.beforeForwardPass(ids)
        m.user.weight[local[0]] = 7.0
    us.afterOptimizerStep(ids)
    t = us.getNumpyVersion()
    assert (t[5] == 7.0).all()
    np.testing.assert_array_equal(t[2], snap[2])
    np.testing.assert_array_equal(np.delete(t, [5], 0), np.delete(snap, [5], 0))


def _mid_ops(tmp_path, us, uo):
    np.save(tmp_path / "t.npy", np.zeros((10, D), np.float32))
    torch.save(torch.zeros(10, D), tmp_path / "t.pt")
    torch.save({k: torch.zeros(10, D) for k in uo.getNumpyVersion()}, tmp_path / "o.pt")
    return {
        "loadCupy": lambda: us.loadCupy(str(tmp_path / "t.npy")),
        "loadTorch": lambda: us.loadTorch(str(tmp_path / "t.pt")),
        "zerosInit": us.zerosInit,
        "uniformDistributionInit": lambda: us.uniformDistributionInit(0.0, 1.0),
        "normalDistributionInit": lambda: us.normalDistributionInit(0.0, 1.0),
        "customInit": lambda: us.customInit(torch.nn.init.xavier_uniform_),
        "opt.customInit": lambda: uo.customInit(torch.nn.init.constant_, 0.5),
        "opt.loadTorch": lambda: uo.loadTorch(str(tmp_path / "o.pt")),
    }


MID_OPS = [
    "loadCupy",
    "loadTorch",
    "zerosInit",
    "uniformDistributionInit",
    "normalDistributionInit",
    "customInit",
    "opt.customInit",
    "opt.loadTorch",
]


@pytest.mark.parametrize("op", MID_OPS)
def test_table_changes_refused_during_a_step(op, tmp_path):
    # README: between a training beforeForwardPass and its afterOptimizerStep, loads,
    # initialisers and customInit are "refused with GadgetValueError and change nothing"
    m, opt, us, uo = _simple()
    ops = _mid_ops(tmp_path, us, uo)
    ids = T([5, 2, 5])
    before = _state(us, uo)
    local = _train_fwd(m, opt, us, uo, ids)
    expect = m.user.weight.detach()[local].clone()
    with pytest.raises(gl.GadgetValueError):
        ops[op]()
    _assert_same(before, us, uo)
    us.afterOptimizerStep(ids)
    uo.afterOptimizerStep(ids)
    np.testing.assert_array_equal(us.getNumpyVersion()[ids.numpy()], expect.numpy())
    # after the step the same call is accepted
    ops[op]()


def test_wrong_variable_name():
    m = TwoTower(4, 4)
    opt = torch.optim.Adam(m.parameters())
    _us = gl.ModelSwitch(m.user, NU, D, placement="cpu")
    with pytest.raises(gl.GadgetKeyError, match="usr") as ei:
        gl.OptimizerFactory(opt, NU, D, m, "usr", placement="cpu")
    assert isinstance(ei.value, KeyError)


def test_optimizer_without_the_variable():
    m = TwoTower(4, 4)
    opt = torch.optim.Adam(list(m.item.parameters()) + list(m.head.parameters()))
    _us = gl.ModelSwitch(m.user, NU, D, placement="cpu")
    with pytest.raises(gl.GadgetError):
        o = gl.OptimizerSwitch(opt, NU, D, m, "user", placement="cpu")
        o.optInit()


def test_optimizer_switch_before_optInit_refused():
    m, opt, us, uo = _simple()
    o2 = gl.OptimizerSwitch(opt, 10, D, m, "user", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="optInit"):
        o2.beforeForwardPass(T([1]))


def test_optimizer_total_classes_mismatch_refused():
    m, opt, us, uo = _simple()
    m2 = torch.nn.Module()
    m2.user = torch.nn.Embedding(4, D)
    opt2 = torch.optim.Adam(m2.parameters())
    _us = gl.ModelSwitch(m2.user, 10, D, placement="cpu")
    o = gl.OptimizerSwitch(opt2, 11, D, m2, "user", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="11"):
        o.optInit()


def test_embed_dimension_mismatch_refused():
    m = TwoTower(4, 4)
    opt = torch.optim.Adam(m.parameters())
    with pytest.raises(gl.GadgetValueError):
        gl.ModelSwitch(m.user, NU, D + 1, placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.OptimizerSwitch(opt, NU, D + 1, m, "user", placement="cpu")


def test_unsupported_optimizer_lists_supported():
    m = TwoTower(4, 4)
    _us = gl.ModelSwitch(m.user, NU, D, placement="cpu")
    opt = torch.optim.LBFGS(m.parameters())
    with pytest.raises(gl.GadgetTypeError, match="RMSprop") as ei:
        gl.OptimizerSwitch(opt, NU, D, m, "user", placement="cpu").optInit()
    assert isinstance(ei.value, TypeError)


@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(duplicates="last"), gl.GadgetValueError),
        (dict(placement="gpu"), gl.GadgetKeyError),
        (dict(placement="file"), gl.GadgetKeyError),
    ],
)
def test_bad_switch_options(kw, exc):
    m = TwoTower(4, 4)
    kw = {"placement": "cpu", **kw}
    with pytest.raises(exc):
        gl.ModelSwitch(m.user, NU, D, **kw)


# ----------------------------------------------------------------- round trips


@pytest.fixture(params=["plain", "interleaved"])
def trained(request):
    m, opt, us, uo = _simple()
    if request.param == "plain":
        # a model switcher alone (no optInit on a host table of its own)
        m2 = torch.nn.Module()
        m2.user = torch.nn.Embedding(4, D)
        us = gl.ModelSwitch(m2.user, 10, D, placement="cpu")
        us.normalDistributionInit(0.0, 1.0)
        return m2, None, us, None
    _train_fwd(m, opt, us, uo, T([5, 2, 5, 9]))
    us.afterOptimizerStep(T([5, 2, 5, 9]))
    uo.afterOptimizerStep(T([5, 2, 5, 9]))
    return m, opt, us, uo


@pytest.mark.parametrize("suffix", ["", ".npy"])
def test_saveCupy_loadCupy_round_trip(trained, tmp_path, suffix):
    m, opt, us, uo = trained
    saved = us.getNumpyVersion().copy()
    us.saveCupy(str(tmp_path / ("emb" + suffix)))
    assert os.path.exists(tmp_path / "emb.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), saved)
    us.zerosInit()
    us.loadCupy(str(tmp_path / "emb.npy"))
    np.testing.assert_array_equal(us.getNumpyVersion(), saved)


def test_saveTorch_loadTorch_round_trip(trained, tmp_path):
    m, opt, us, uo = trained
    saved = us.getNumpyVersion().copy()
    us.saveTorch(tmp_path / "emb.pt")
    t = torch.load(tmp_path / "emb.pt", weights_only=True)
    assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
    np.testing.assert_array_equal(t.numpy(), saved)
    us.zerosInit()
    us.loadTorch(tmp_path / "emb.pt")
    np.testing.assert_array_equal(us.getNumpyVersion(), saved)


@pytest.mark.parametrize(
    "arr,exc",
    [
        (np.zeros((11, D), np.float32), gl.GadgetValueError),
        (np.zeros((10, D + 1), np.float32), gl.GadgetValueError),
        (np.zeros((10 * D,), np.float32), gl.GadgetValueError),
        (np.zeros((10, D), np.float64), gl.GadgetTypeError),
        (np.zeros((10, D), np.int32), gl.GadgetTypeError),
    ],
    ids=["rows", "cols", "flat", "float64", "int32"],
)
def test_loadCupy_refuses_other_shape_or_dtype(trained, tmp_path, arr, exc):
    # README: "A switcher's loadCupy refuses a file of another shape or dtype before
    # writing anything"; Errors: GadgetTypeError for "a file ... that fits a table's shape
    # but not its dtype"
    m, opt, us, uo = trained
    snap = us.getNumpyVersion().copy()
    np.save(tmp_path / "bad.npy", arr + 1)
    with pytest.raises(exc):
        us.loadCupy(str(tmp_path / "bad.npy"))
    np.testing.assert_array_equal(us.getNumpyVersion(), snap)


@pytest.mark.parametrize(
    "tensor,exc",
    [
        (torch.ones(11, D), gl.GadgetValueError),
        (torch.ones(10, D + 1), gl.GadgetValueError),
        (torch.ones(D, 10), gl.GadgetValueError),
        (torch.full((10, D), 0.1, dtype=torch.float64), gl.GadgetTypeError),
        (torch.full((10, D), 0.5, dtype=torch.float16), None),
        (torch.full((10, D), 0.25, dtype=torch.float64), None),
    ],
    ids=["rows", "cols", "transposed", "f64-inexact", "f16-exact", "f64-exact"],
)
def test_loadTorch_shape_and_exact_dtype_rules(trained, tmp_path, tensor, exc):
    # README: "loadTorch refuses a file of another shape, or of another dtype unless every
    # value converts exactly (a float64 file of float32 values), before writing anything"
    m, opt, us, uo = trained
    snap = us.getNumpyVersion().copy()
    torch.save(tensor, tmp_path / "x.pt")
    if exc is None:
        us.loadTorch(tmp_path / "x.pt")
        np.testing.assert_array_equal(us.getNumpyVersion(), tensor.float().numpy())
    else:
        with pytest.raises(exc):
            us.loadTorch(tmp_path / "x.pt")
        np.testing.assert_array_equal(us.getNumpyVersion(), snap)


def test_loaded_table_is_what_the_next_step_reads(tmp_path):
    m, opt, us, uo = _simple()
    new = np.arange(10 * D, dtype=np.float32).reshape(10, D)
    np.save(tmp_path / "n.npy", new)
    us.loadCupy(str(tmp_path / "n.npy"))
    local = us.beforeForwardPass(T([7, 3]))
    np.testing.assert_array_equal(m.user(local).detach().numpy(), new[[7, 3]])


@pytest.fixture
def trained_opt():
    m, opt, us, uo = _simple()
    for ids in (T([5, 2, 5, 9]), T([1, 2])):
        _train_fwd(m, opt, us, uo, ids)
        us.afterOptimizerStep(ids)
        uo.afterOptimizerStep(ids)
    return m, opt, us, uo


def test_optimizer_saveTorch_loadTorch_round_trip(trained_opt, tmp_path):
    m, opt, us, uo = trained_opt
    snap = _state(us, uo)
    uo.saveTorch(tmp_path / "o.pt")
    d = torch.load(tmp_path / "o.pt", weights_only=True)
    assert isinstance(d, dict) and set(d) == {"exp_avg", "exp_avg_sq"}
    for k, v in d.items():
        assert v.device.type == "cpu"
        np.testing.assert_array_equal(v.numpy(), snap[1][k])
    uo.customInit(torch.nn.init.zeros_)
    uo.loadTorch(tmp_path / "o.pt")
    _assert_same(snap, us, uo)


def test_optimizer_loadTorch_speedtorch_list(trained_opt, tmp_path):
    m, opt, us, uo = trained_opt
    names = list(uo.tables)
    vals = [torch.full((10, D), float(j + 1)) for j in range(len(names))]
    torch.save(vals, tmp_path / "l.pt")
    uo.loadTorch(tmp_path / "l.pt")
    got = uo.getNumpyVersion()
    for j, k in enumerate(names):
        np.testing.assert_array_equal(got[k], vals[j].numpy())


@pytest.mark.parametrize(
    "content",
    [
        {"exp_avg": torch.ones(10, D), "exp_avgsq": torch.ones(10, D)},
        {"exp_avg": torch.ones(10, D)},
        {"exp_avg": torch.ones(10, D), "exp_avg_sq": torch.ones(10, D), "extra": torch.ones(10, D)},
        {"exp_avg": torch.ones(10, D), "exp_avg_sq": torch.ones(11, D)},
        {"exp_avg": torch.ones(10, D), "exp_avg_sq": torch.ones(10, D + 1)},
        [torch.ones(10, D)],
        [torch.ones(10, D), torch.ones(10, D), torch.ones(10, D)],
        [torch.ones(10, D), torch.ones(9, D)],
    ],
    ids=[
        "misnamed",
        "missing",
        "extra",
        "2nd-rows",
        "2nd-cols",
        "short-list",
        "long-list",
        "list-2nd-shape",
    ],
)
def test_optimizer_loadTorch_refuses_before_writing(trained_opt, tmp_path, content):
    m, opt, us, uo = trained_opt
    snap = _state(us, uo)
    torch.save(content, tmp_path / "bad.pt")
    with pytest.raises(gl.GadgetValueError):
        uo.loadTorch(tmp_path / "bad.pt")
    _assert_same(snap, us, uo)


def test_optimizer_loadTorch_inexact_dtype_refused(trained_opt, tmp_path):
    m, opt, us, uo = trained_opt
    snap = _state(us, uo)
    torch.save(
        {"exp_avg": torch.ones(10, D), "exp_avg_sq": torch.full((10, D), 0.1, dtype=torch.float64)},
        tmp_path / "b.pt",
    )
    with pytest.raises(gl.GadgetTypeError):
        uo.loadTorch(tmp_path / "b.pt")
    _assert_same(snap, us, uo)


def test_resume_through_switcher_files_equals_uninterrupted(tmp_path):
    # save tables and state, rebuild everything, load, train on: same as never stopping
    batches = [T([5, 2, 5, 9]), T([1, 2, 2]), T([9, 0]), T([2, 5, 8, 8])]

    def build():
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.user = torch.nn.Embedding(4, D)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        us = gl.ModelSwitch(m.user, 10, D, placement="cpu")
        us.normalDistributionInit(0.0, 1.0)
        uo = gl.OptimizerSwitch(opt, 10, D, m, "user", placement="cpu")
        uo.optInit()
        return m, opt, us, uo

    def run(m, opt, us, uo, bs):
        for ids in bs:
            _train_fwd(m, opt, us, uo, ids)
            us.afterOptimizerStep(ids)
            uo.afterOptimizerStep(ids)

    a = build()
    run(*a, batches)
    b = build()
    run(*b, batches[:2])
    b[2].saveCupy(str(tmp_path / "emb"))
    b[3].saveTorch(tmp_path / "st.pt")
    c = build()
    c[2].zerosInit()
    c[2].loadCupy(str(tmp_path / "emb.npy"))
    c[3].loadTorch(tmp_path / "st.pt")
    run(*c, batches[2:])
    np.testing.assert_array_equal(c[2].getNumpyVersion(), a[2].getNumpyVersion())
    for k, v in a[3].getNumpyVersion().items():
        np.testing.assert_array_equal(c[3].getNumpyVersion()[k], v)


@pytest.mark.skipif(_REAL_CUDA, reason="checks the no-CUDA fallback of CPUPinn=True")
def test_cpupinn_factory_falls_back_and_trains_like_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        m = torch.nn.Module()
        m.user = torch.nn.Embedding(4, D)
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        us = gl.ModelFactory(m.user, 10, D, CPUPinn=True)
        uo = gl.OptimizerFactory(opt, 10, D, m, "user", CPUPinn=True)
    assert us.placement == "cpu"
    us.uniformDistributionInit(-1.0, 1.0)
    uo.optInit()
    t0 = us.getNumpyVersion().copy()
    ids = T([3, 3, 8])
    local = _train_fwd(m, opt, us, uo, ids)
    exp = m.user.weight.detach()[local].clone()
    us.afterOptimizerStep(ids)
    uo.afterOptimizerStep(ids)
    t = us.getNumpyVersion()
    np.testing.assert_array_equal(t[[3, 3, 8]], exp.numpy())
    np.testing.assert_array_equal(np.delete(t, [3, 8], 0), np.delete(t0, [3, 8], 0))


# ------------------------------------------------ reused id buffers, other variables


@pytest.mark.parametrize(
    "kind,opt_first,eval_first,same_obj",
    [
        ("torch", False, False, False),
        ("torch", True, True, False),
        ("torch", True, False, True),
        ("numpy", False, True, False),
        ("numpy", True, True, True),
        ("numpy", True, False, False),
    ],
)
def test_id_buffers_refilled_in_place_each_step(kind, opt_first, eval_first, same_obj):
    # README: "The row plan of a step's ids is made once and reused while the id objects
    # are unchanged (... the values for CPU ids); the first beforeForwardPass of a step
    # makes it afresh" -- a DataLoader-style buffer refilled in place between steps (and
    # after an evaluation lookup of the old contents) must train the new ids.
    torch.manual_seed(0)
    m = TwoTower(4, 8)
    ref = TwoTower(NU, NI)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    us = gl.ModelSwitch(m.user, NU, D, placement="cpu")
    us.normalDistributionInit(0.0, 1.0)
    its = gl.ModelSwitch(m.item, NI, D, placement="cpu")
    its.normalDistributionInit(0.0, 1.0)
    uo = gl.OptimizerSwitch(opt, NU, D, m, "user", placement="cpu")
    uo.optInit()
    io = gl.OptimizerSwitch(opt, NI, D, m, "item", placement="cpu")
    io.optInit()
    with torch.no_grad():
        ref.user.weight.copy_(torch.from_numpy(us.getNumpyVersion()))
        ref.item.weight.copy_(torch.from_numpy(its.getNumpyVersion()))
        ref.head.load_state_dict(m.head.state_dict())
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(5)
    ub = torch.zeros(4, dtype=torch.long)
    ib = torch.zeros(4, dtype=torch.long)
    nb = torch.zeros(4, 2, dtype=torch.long)
    bufs = (ub.numpy(), ib.numpy(), nb.numpy()) if kind == "numpy" else (ub, ib, nb)
    for _ in range(5):
        uv = torch.randint(0, 6, (4,), generator=g)
        iv = torch.randint(0, 6, (4,), generator=g)
        nv = torch.randint(0, 6, (4, 2), generator=g)
        if eval_first:
            with torch.no_grad():
                us.beforeForwardPass(bufs[0])
                its.beforeForwardPass(bufs[1], bufs[2])
        ub.copy_(uv)
        ib.copy_(iv)
        nb.copy_(nv)
        pa = (bufs[0], bufs[0]) if same_obj else (bufs[0],)
        pb = (bufs[1], bufs[1]) if same_obj else (bufs[1], bufs[2])
        if opt_first:
            uo.beforeForwardPass(*pa)
            io.beforeForwardPass(*pb)
        r1 = us.beforeForwardPass(*pa)
        r2 = its.beforeForwardPass(*pb)
        if not opt_first:
            uo.beforeForwardPass(*pa)
            io.beforeForwardPass(*pb)
        if same_obj:
            (lu, lun), (li, ln) = r1, r2
            loss = m(lu, li, None, lun) + (m.item(ln) ** 2).sum()
        else:
            lu, (li, ln) = r1, r2
            loss = m(lu, li, ln)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if opt_first:
            uo.afterOptimizerStep(*pa)
            io.afterOptimizerStep(*pb)
        us.afterOptimizerStep(*pa)
        its.afterOptimizerStep(*pb)
        if not opt_first:
            uo.afterOptimizerStep(*pa)
            io.afterOptimizerStep(*pb)
        if same_obj:
            rl = ref(uv, iv, None, uv) + (ref.item(iv) ** 2).sum()
            used = {ref.user.weight: uv, ref.item.weight: iv}
        else:
            rl = ref(uv, iv, nv)
            used = {ref.user.weight: uv, ref.item.weight: torch.cat([iv, nv.reshape(-1)])}
        ropt.zero_grad()
        rl.backward()
        lazy_step(ropt, used)
    torch.testing.assert_close(
        torch.from_numpy(us.getNumpyVersion()), ref.user.weight.detach(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        torch.from_numpy(its.getNumpyVersion()), ref.item.weight.detach(), rtol=0, atol=0
    )
    for o, rp in ((uo, ref.user.weight), (io, ref.item.weight)):
        for k, v in _row_state(ropt, rp).items():
            torch.testing.assert_close(torch.from_numpy(o.getNumpyVersion()[k]), v, rtol=0, atol=0)


def _setg(**kw):
    def f(o):
        for g in o.param_groups:
            g.update(kw)

    return f


@pytest.mark.parametrize(
    "opt_cls,kw,tweak",
    [
        (torch.optim.SGD, dict(lr=0.05), _setg(momentum=0.9)),
        (torch.optim.RMSprop, dict(lr=0.01), _setg(momentum=0.5, centered=True)),
        (torch.optim.Rprop, dict(lr=0.05), _setg(lr=0.2)),
        (torch.optim.Adam, dict(lr=0.05), _setg(amsgrad=True)),
    ],
    ids=[
        "SGD-momentum-on",
        "RMSprop-momentum-centered-on",
        "Rprop-lr-before-first-step",
        "Adam-amsgrad-on",
    ],
)
def test_options_changed_after_optInit_follow_torch(opt_cls, kw, tweak):
    # README: "State is found from the optimizer itself and starts as torch starts it";
    # a scheduler turning momentum on adds state (its checkpoint "loads into switchers
    # built before that option was on")
    train_and_compare(opt_cls, kw, tweak=tweak)


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.Rprop, torch.optim.Adagrad])
def test_param_groups_with_own_lr(opt_cls):
    train_and_compare(opt_cls, dict(lr=0.05), groups=True)


def test_parameter_as_model_variable():
    # docstring: model_variable "nn.Module or nn.Parameter"
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(4, D))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    us = gl.ModelSwitch(m.w, 10, D, placement="cpu")
    us.normalDistributionInit(0.0, 1.0)
    uo = gl.OptimizerSwitch(opt, 10, D, m, "w", placement="cpu")
    uo.optInit()
    ref = torch.nn.Parameter(torch.from_numpy(us.getNumpyVersion().copy()))
    ropt = torch.optim.Adam([ref], lr=0.1)
    for ids in (T([3, 1, 3]), T([0, 9, 9, 1])):
        local = us.beforeForwardPass(ids)
        uo.beforeForwardPass(ids)
        opt.zero_grad()
        (torch.nn.functional.embedding(local, m.w) ** 3).sum().backward()
        opt.step()
        us.afterOptimizerStep(ids)
        uo.afterOptimizerStep(ids)
        ropt.zero_grad()
        (torch.nn.functional.embedding(ids, ref) ** 3).sum().backward()
        lazy_step(ropt, {ref: ids})
    torch.testing.assert_close(torch.from_numpy(us.getNumpyVersion()), ref.detach(), rtol=0, atol=0)


def test_embedding_bag_as_model_variable():
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.bag = torch.nn.EmbeddingBag(4, D, mode="mean")
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
    us = gl.ModelSwitch(m.bag, 10, D, placement="cpu")
    us.normalDistributionInit(0.0, 1.0)
    uo = gl.OptimizerSwitch(opt, 10, D, m, "bag", placement="cpu")
    uo.optInit()
    rb = torch.nn.EmbeddingBag(10, D, mode="mean")
    with torch.no_grad():
        rb.weight.copy_(torch.from_numpy(us.getNumpyVersion()))
    ropt = torch.optim.Adagrad(rb.parameters(), lr=0.1)
    for ids in (T([[3, 1, 3], [2, 2, 9]]), T([[0, 9, 9], [1, 1, 1]])):
        local = us.beforeForwardPass(ids)
        uo.beforeForwardPass(ids)
        opt.zero_grad()
        (m.bag(local) ** 3).sum().backward()
        opt.step()
        us.afterOptimizerStep(ids)
        uo.afterOptimizerStep(ids)
        ropt.zero_grad()
        (rb(ids) ** 3).sum().backward()
        lazy_step(ropt, {rb.weight: ids.reshape(-1)})
    torch.testing.assert_close(
        torch.from_numpy(us.getNumpyVersion()), rb.weight.detach(), rtol=0, atol=0
    )


# ------------------------------- table and state tables stay apart (interleaved buffer)


@pytest.mark.parametrize(
    "op",
    ["zerosInit", "normal", "xavier", "orthogonal", "loadCupy", "loadTorch"],
)
def test_table_changes_leave_state_tables_alone(trained_opt, tmp_path, op):
    m, opt, us, uo = trained_opt
    st = {k: v.copy() for k, v in uo.getNumpyVersion().items()}
    new = np.arange(10 * D, dtype=np.float32).reshape(10, D) / 7
    np.save(tmp_path / "n.npy", new)
    torch.save(torch.from_numpy(new), tmp_path / "n.pt")
    {
        "zerosInit": us.zerosInit,
        "normal": lambda: us.normalDistributionInit(0.0, 1.0),
        "xavier": lambda: us.customInit(torch.nn.init.xavier_uniform_),
        "orthogonal": lambda: us.customInit(torch.nn.init.orthogonal_),
        "loadCupy": lambda: us.loadCupy(str(tmp_path / "n.npy")),
        "loadTorch": lambda: us.loadTorch(tmp_path / "n.pt"),
    }[op]()
    t = us.getNumpyVersion()
    if op in ("loadCupy", "loadTorch"):
        np.testing.assert_array_equal(t, new)
    elif op == "zerosInit":
        assert not t.any()
    elif op == "xavier":
        bound = float(np.sqrt(6.0 / (10 + D)))
        assert np.abs(t).max() <= bound and np.unique(t).size > D
    elif op == "orthogonal":
        np.testing.assert_allclose(t.T @ t, np.eye(D), atol=1e-5)
    for k in st:
        np.testing.assert_array_equal(uo.getNumpyVersion()[k], st[k])


def test_state_changes_leave_table_alone(trained_opt, tmp_path):
    m, opt, us, uo = trained_opt
    t = us.getNumpyVersion().copy()
    uo.customInit(torch.nn.init.constant_, 0.3)
    np.testing.assert_array_equal(us.getNumpyVersion(), t)
    for v in uo.getNumpyVersion().values():
        assert (v == np.float32(0.3)).all()
    torch.save({k: torch.full((10, D), 2.0) for k in uo.tables}, tmp_path / "s.pt")
    uo.loadTorch(tmp_path / "s.pt")
    np.testing.assert_array_equal(us.getNumpyVersion(), t)


def test_customInit_refuses_non_callable():
    m, opt, us, uo = _simple()
    snap = _state(us, uo)
    with pytest.raises(gl.GadgetTypeError):
        us.customInit(3)
    with pytest.raises(gl.GadgetTypeError):
        uo.customInit("zeros")
    _assert_same(snap, us, uo)
