"""Black-box review (session 34): training offloaded embedding tables with a broad
matrix of torch optimizers, options, LR schedulers, param groups and zero_grad modes.

Reference: a dense ``nn.Embedding`` trained with the same torch optimizer on the same
batches (README, "Training embeddings larger than GPU memory": "the result is
bit-identical to a dense ``nn.Embedding`` trained the same way on the rows a step looks
up"; "Updates are lazy, as torch's ``SparseAdam`` makes them").  Where every step looks up
every row, the whole table (and its optimizer state) must match a dense table trained on
the whole batch.  State tables are read through ``opt.pagers[i].tables`` (documented in
the ``OffloadedOptimizer`` docstring: "The state tables are ``self.pagers[i].tables``").
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import gadgetloader as gl

N, D = 60, 6
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# --------------------------------------------------------------------------- helpers


def _w0(n=N, d=D, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _emb(W0):
    emb = gl.OffloadedEmbedding(W0.shape[0], W0.shape[1], placement="cpu", device="cpu")
    emb.load_state_dict({"weight": W0.clone()})
    return emb


def _dense(W0, sparse=False):
    ref = torch.nn.Embedding(W0.shape[0], W0.shape[1], sparse=sparse)
    with torch.no_grad():
        ref.weight.copy_(W0)
    return ref


def _table(emb):
    return torch.from_numpy(np.array(emb.weight.getNumpyVersion(), copy=True))


def _state_tables(opt, i=0):
    return {
        k: torch.from_numpy(np.array(g.getNumpyVersion(), copy=True))
        for k, g in opt.pagers[i].tables.items()
    }


def _scalar_state(opt):
    """0-dim entries of the (single) state entry the wrapper shares with the inner optimizer."""
    out = {}
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == 0:
                out.setdefault(k, []).append(v.clone())
    return out


def _check_scalar(gscal, k, v, name):
    """The wrapper's state (shared with the inner optimizer) holds the table's scalar
    state (step count, NAdam's mu_product, ASGD's eta / mu) with torch's value."""
    assert k in gscal, f"{name}: scalar state {k!r} missing from opt.state: {gscal}"
    vals = [float(x) for x in gscal[k]]
    assert any(x == pytest.approx(float(v), rel=1e-5, abs=1e-7) for x in vals), (
        f"{name}: scalar {k!r} = {vals}, torch has {float(v)}"
    )


def _batches(steps, seed, n=N, full=True, extra=25, hi=None, d=D):
    """Full cover: a permutation of every row plus repeats, shuffled; else random ids
    below ``hi`` (rows >= hi are never looked up)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if full:
            ids = torch.cat(
                [torch.randperm(n, generator=g), torch.randint(0, n, (extra,), generator=g)]
            )
            ids = ids[torch.randperm(len(ids), generator=g)]
        else:
            ids = torch.randint(0, hi or n, (extra,), generator=g)
        c = torch.randn(len(ids), d, generator=g)
        out.append((ids, c))
    return out


def _loss(out, c):
    return (out * c).sum() + 0.3 * (out**2).sum()


def _train(lookup, opt, batches, set_to_none=True, sched=None):
    for ids, c in batches:
        opt.zero_grad(set_to_none=set_to_none)
        _loss(lookup(ids), c).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _make_ref_opt(cls, params, kw):
    try:
        return cls(params, **kw)
    except (TypeError, ValueError, RuntimeError) as e:  # option not in this torch
        pytest.skip(f"{cls.__name__}({kw}) not available in torch {torch.__version__}: {e}")


def _ref_train(lookup, opt, batches, **kw):
    """Train the torch reference; an option this torch cannot step with is a skip."""
    try:
        _train(lookup, opt, batches[:1], **kw)
    except (TypeError, ValueError, RuntimeError) as e:
        pytest.skip(
            f"{type(opt).__name__} cannot step with these options in torch {torch.__version__}: {e}"
        )
    _train(lookup, opt, batches[1:], **kw)


def _close(a, b, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


class LazyRef:
    """Dense nn.Embedding trained on the rows a step looks up (lazy updates): each step
    a dense table of the step's distinct rows takes their weights and optimizer state,
    one step count per table."""

    def __init__(self, cls, W0, kw, fill=None):
        self.cls, self.kw, self.W = cls, kw, W0.clone()
        self.state: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, torch.Tensor] = {}
        self.fill = fill or {}
        self.started = False

    def step(self, ids, c):
        uniq, inv = torch.unique(ids, return_inverse=True)
        sub = _dense(self.W[uniq])
        opt = _make_ref_opt(self.cls, sub.parameters(), self.kw)
        if self.started:
            st = {k: full[uniq].clone() for k, full in self.state.items()}
            st.update({k: v.clone() for k, v in self.scalars.items()})
            opt.state[sub.weight] = st
        opt.zero_grad()
        _loss(sub(inv), c).backward()
        opt.step()
        for k, v in opt.state[sub.weight].items():
            if not torch.is_tensor(v):
                continue
            if v.shape == sub.weight.shape:
                if k not in self.state:
                    self.state[k] = torch.full_like(self.W, float(self.fill.get(k, 0.0)))
                self.state[k][uniq] = v.detach()
            else:
                self.scalars[k] = v.detach().clone()
        with torch.no_grad():
            self.W[uniq] = sub.weight.detach()
        self.started = True


# --------------------------------------------------------------------------- the matrix

OPT = torch.optim
MATRIX = [
    ("sgd", OPT.SGD, dict(lr=0.1)),
    ("sgd-wd", OPT.SGD, dict(lr=0.1, weight_decay=0.05)),
    ("sgd-maximize", OPT.SGD, dict(lr=0.05, maximize=True)),
    ("sgd-mom", OPT.SGD, dict(lr=0.1, momentum=0.9)),
    ("sgd-nesterov", OPT.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd-mom-wd-max", OPT.SGD, dict(lr=0.05, momentum=0.8, weight_decay=0.01, maximize=True)),
    ("sgd-mom-foreach", OPT.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    ("adam", OPT.Adam, dict(lr=0.01)),
    (
        "adam-amsgrad-wd-foreach",
        OPT.Adam,
        dict(lr=0.01, amsgrad=True, weight_decay=0.1, foreach=True),
    ),
    ("adam-amsgrad-noforeach", OPT.Adam, dict(lr=0.01, amsgrad=True, foreach=False)),
    ("adam-maximize-foreach", OPT.Adam, dict(lr=0.01, maximize=True, foreach=True)),
    (
        "adam-maximize-noforeach",
        OPT.Adam,
        dict(lr=0.01, maximize=True, foreach=False, weight_decay=0.02),
    ),
    ("adam-betas-eps", OPT.Adam, dict(lr=0.02, betas=(0.5, 0.9), eps=1e-3)),
    ("adamw", OPT.AdamW, dict(lr=0.01)),
    (
        "adamw-amsgrad-wd-foreach",
        OPT.AdamW,
        dict(lr=0.01, amsgrad=True, weight_decay=0.1, foreach=True),
    ),
    (
        "adamw-wd-noforeach-max",
        OPT.AdamW,
        dict(lr=0.01, weight_decay=0.2, foreach=False, maximize=True),
    ),
    ("adagrad", OPT.Adagrad, dict(lr=0.1)),
    (
        "adagrad-lrdecay-init",
        OPT.Adagrad,
        dict(lr=0.1, lr_decay=0.05, initial_accumulator_value=0.3),
    ),
    (
        "adagrad-wd-eps-foreach",
        OPT.Adagrad,
        dict(lr=0.1, weight_decay=0.02, eps=1e-4, foreach=True),
    ),
    ("rmsprop", OPT.RMSprop, dict(lr=0.01)),
    ("rmsprop-centered", OPT.RMSprop, dict(lr=0.01, centered=True)),
    ("rmsprop-momentum", OPT.RMSprop, dict(lr=0.01, momentum=0.7)),
    (
        "rmsprop-centered-mom-wd",
        OPT.RMSprop,
        dict(lr=0.01, centered=True, momentum=0.5, weight_decay=0.1, alpha=0.9),
    ),
    ("adamax", OPT.Adamax, dict(lr=0.02)),
    ("adamax-wd-noforeach", OPT.Adamax, dict(lr=0.02, weight_decay=0.1, foreach=False)),
    ("nadam", OPT.NAdam, dict(lr=0.01)),
    ("nadam-momdecay-wd", OPT.NAdam, dict(lr=0.01, momentum_decay=0.01, weight_decay=0.05)),
    ("nadam-decoupled", OPT.NAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    ("radam", OPT.RAdam, dict(lr=0.01)),
    ("radam-decoupled", OPT.RAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    ("adadelta", OPT.Adadelta, dict(lr=1.0)),
    ("adadelta-rho-wd", OPT.Adadelta, dict(lr=0.5, rho=0.7, weight_decay=0.01, eps=1e-4)),
    ("rprop", OPT.Rprop, dict(lr=0.01)),
    ("rprop-etas", OPT.Rprop, dict(lr=0.02, etas=(0.3, 1.5), step_sizes=(1e-4, 0.5))),
    ("asgd", OPT.ASGD, dict(lr=0.01, t0=2)),
    ("asgd-lambd-wd", OPT.ASGD, dict(lr=0.01, lambd=1e-2, alpha=0.5, t0=1, weight_decay=0.01)),
    # maximize / foreach for the rest of the list
    ("adagrad-max", OPT.Adagrad, dict(lr=0.1, maximize=True)),
    (
        "rmsprop-max-foreach",
        OPT.RMSprop,
        dict(lr=0.01, maximize=True, centered=True, momentum=0.3, foreach=True),
    ),
    ("adadelta-max-foreach", OPT.Adadelta, dict(lr=1.0, maximize=True, foreach=True)),
    ("adamax-max-foreach", OPT.Adamax, dict(lr=0.01, maximize=True, foreach=True)),
    ("nadam-max-foreach", OPT.NAdam, dict(lr=0.01, maximize=True, foreach=True)),
    ("radam-max-foreach", OPT.RAdam, dict(lr=0.01, maximize=True, foreach=True)),
    ("rprop-max-foreach", OPT.Rprop, dict(lr=0.01, maximize=True, foreach=True)),
    ("asgd-max-foreach", OPT.ASGD, dict(lr=0.01, maximize=True, foreach=True)),
    # tensor learning rates (torch >= 2.2 with foreach=False) and newer options
    ("adam-tensor-lr", OPT.Adam, dict(lr=torch.tensor(0.01), foreach=False)),
    ("adamw-tensor-lr", OPT.AdamW, dict(lr=torch.tensor(0.01), foreach=False, weight_decay=0.05)),
    ("sgd-tensor-lr", OPT.SGD, dict(lr=torch.tensor(0.1), momentum=0.9, foreach=False)),
    ("adam-decoupled", OPT.Adam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
]

# RAdam needs > 5 steps before its rectified update starts; give it a few more.
_STEPS = {OPT.RAdam: 8}


@pytest.mark.parametrize("name,cls,kw", MATRIX, ids=[m[0] for m in MATRIX])
def test_full_cover_matches_dense_table_and_state(name, cls, kw):
    """Every step looks up every row (plus repeated ids): lazy and dense updates agree,
    so the whole table and its optimizer state equal a dense nn.Embedding's."""
    steps = _STEPS.get(cls, 4)
    batches = _batches(steps, seed=2)
    W0 = _w0()
    ref = _dense(W0)
    ropt = _make_ref_opt(cls, ref.parameters(), kw)
    _ref_train(ref, ropt, batches)

    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, batches)

    assert not torch.equal(ref.weight.detach(), W0), "reference did not move: the test is vacuous"
    _close(_table(emb), ref.weight.detach(), f"{name} weights")

    rstate = ropt.state[ref.weight]
    row_keys = {k for k, v in rstate.items() if torch.is_tensor(v) and v.shape == ref.weight.shape}
    tables = _state_tables(opt)
    assert set(tables) == row_keys, (
        f"{name}: state tables {sorted(tables)} != torch's row state {sorted(row_keys)}"
    )
    for k in row_keys:
        _close(tables[k], rstate[k], f"{name} state {k!r}")
    rscal = {k: v for k, v in rstate.items() if torch.is_tensor(v) and v.dim() == 0}
    gscal = _scalar_state(opt)
    for k, v in rscal.items():
        _check_scalar(gscal, k, v, name)


@pytest.mark.parametrize("name,cls,kw", MATRIX, ids=[m[0] for m in MATRIX])
def test_table_beside_dense_head_matches_dense_model(name, cls, kw):
    """README drop-in loop: ``OffloadedOptimizer(torch.optim.X, model, ...)`` over a model of
    a table and ordinary parameters ("ordinary params train too"); with full-cover batches
    both equal a dense model trained with torch's optimizer."""
    batches = _batches(_STEPS.get(cls, 4), seed=7)
    W0 = _w0()
    torch.manual_seed(0)
    head0 = torch.nn.Linear(D, 2)

    def model(table):
        head = torch.nn.Linear(D, 2)
        head.load_state_dict(head0.state_dict())
        return torch.nn.ModuleDict({"emb": table, "head": head})

    def run(m, o, bs):
        for ids, c in bs:
            o.zero_grad()
            x = m["emb"](ids)
            (_loss(x, c) + 0.1 * m["head"](x).pow(2).sum()).backward()
            o.step()

    ref = model(_dense(W0))
    ropt = _make_ref_opt(cls, ref.parameters(), kw)
    try:
        run(ref, ropt, batches[:1])
    except (TypeError, ValueError, RuntimeError) as e:
        pytest.skip(f"torch cannot step {name}: {e}")
    run(ref, ropt, batches[1:])
    mod = model(_emb(W0))
    opt = gl.OffloadedOptimizer(cls, mod, **kw)
    run(mod, opt, batches)
    _close(_table(mod["emb"]), ref["emb"].weight.detach(), f"{name} table")
    _close(mod["head"].weight.detach(), ref["head"].weight.detach(), f"{name} head weight")
    _close(mod["head"].bias.detach(), ref["head"].bias.detach(), f"{name} head bias")
    for k, v in opt.state[mod["head"].weight].items():
        rv = ropt.state[ref["head"].weight][k]
        if torch.is_tensor(v):
            _close(v.float(), rv.float(), f"{name} head state {k!r}")


BIT_EXACT = [
    m
    for m in MATRIX
    if m[0]
    in (
        "sgd-nesterov",
        "adam",
        "adamw-amsgrad-wd-foreach",
        "adagrad-lrdecay-init",
        "rmsprop-centered-mom-wd",
        "nadam",
        "adadelta",
    )
]


@pytest.mark.parametrize("name,cls,kw", BIT_EXACT, ids=[m[0] for m in BIT_EXACT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_full_cover_bit_identical(name, cls, kw, dtype):
    """README: "Bit-identical holds for float32 and float64 tables with torch's default
    (for-each) kernels"."""
    batches = [(ids, c.to(dtype)) for ids, c in _batches(3, seed=5)]
    W0 = _w0().to(dtype)
    ref = _dense(W0).to(dtype)
    ropt = _make_ref_opt(cls, ref.parameters(), kw)
    _train(ref, ropt, batches)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", dtype=dtype)
    emb.load_state_dict({"weight": W0.clone()})
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, batches)
    got = _table(emb)
    assert got.dtype == dtype
    diff = (got - ref.weight.detach()).abs().max().item()
    assert torch.equal(got, ref.weight.detach()), f"{name} {dtype}: max |diff| {diff}"


# --------------------------------------------------------------------------- lazy updates

LAZY = [
    m
    for m in MATRIX
    if m[0]
    in (
        "sgd-mom",
        "sgd-nesterov",
        "sgd-mom-wd-max",
        "adam",
        "adam-amsgrad-wd-foreach",
        "adam-maximize-noforeach",
        "adamw-wd-noforeach-max",
        "adagrad-lrdecay-init",
        "rmsprop-centered-mom-wd",
        "adamax-wd-noforeach",
        "nadam-momdecay-wd",
        "radam",
        "adadelta-rho-wd",
        "rprop",
        "asgd",
    )
]


@pytest.mark.parametrize("name,cls,kw", LAZY, ids=[m[0] for m in LAZY])
def test_partial_batches_lazy_updates_match_dense_on_looked_up_rows(name, cls, kw):
    """Steps look up different subsets: each step equals a dense nn.Embedding of that
    step's rows (with their state, one step count per table); rows never looked up
    keep their values and their initial optimizer state."""
    hi = 45  # rows 45.. are never looked up
    steps = _STEPS.get(cls, 5)
    batches = _batches(steps, seed=11, full=False, extra=30, hi=hi)
    W0 = _w0()
    fill = {"sum": kw.get("initial_accumulator_value", 0.0), "step_size": kw.get("lr")}
    lref = LazyRef(cls, W0, kw, fill=fill)
    for ids, c in batches:
        lref.step(ids, c)

    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, batches)
    got = _table(emb)

    assert torch.equal(got[hi:], W0[hi:]), f"{name}: rows never looked up moved"
    _close(got, lref.W, f"{name} weights")
    tables = _state_tables(opt)
    assert set(tables) == set(lref.state), f"{name}: {sorted(tables)} != {sorted(lref.state)}"
    for k, full in lref.state.items():
        _close(tables[k], full, f"{name} state {k!r}")
    gscal = _scalar_state(opt)
    for k, v in lref.scalars.items():
        _check_scalar(gscal, k, v, name)


SPARSE_REF = [
    ("sparseadam", OPT.SparseAdam, dict(lr=0.02)),
    ("sparseadam-betas", OPT.SparseAdam, dict(lr=0.02, betas=(0.5, 0.8), eps=1e-4)),
    ("sgd", OPT.SGD, dict(lr=0.1)),
    ("sgd-maximize", OPT.SGD, dict(lr=0.1, maximize=True)),
    ("adagrad", OPT.Adagrad, dict(lr=0.1, lr_decay=0.02, initial_accumulator_value=0.1)),
]


@pytest.mark.parametrize("name,cls,kw", SPARSE_REF, ids=[s[0] for s in SPARSE_REF])
def test_partial_batches_match_sparse_embedding(name, cls, kw):
    """README: "plain SGD and a sparse nn.Embedding leave them alone too, so there the
    whole table matches" -- with torch's sparse-gradient optimizers the whole table of a
    sparse=True nn.Embedding is the reference (to rounding: sparse sums follow another order)."""
    batches = _batches(5, seed=3, full=False, extra=30, hi=50)
    W0 = _w0()
    ref = _dense(W0, sparse=True)
    ropt = _make_ref_opt(cls, ref.parameters(), kw)
    _train(ref, ropt, batches)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, batches)
    assert not torch.equal(ref.weight.detach(), W0)
    _close(_table(emb), ref.weight.detach(), f"{name} weights", rtol=1e-5, atol=1e-5)
    rstate = ropt.state[ref.weight]
    tables = _state_tables(opt)
    for k, v in rstate.items():
        if torch.is_tensor(v) and v.shape == ref.weight.shape:
            _close(tables[k], v.to_dense() if v.is_sparse else v, f"{name} state {k!r}", atol=1e-5)


# --------------------------------------------------------------------------- repeated ids


@pytest.mark.parametrize(
    "cls,kw",
    [
        (OPT.Adam, dict(lr=0.05)),
        (OPT.SGD, dict(lr=0.1, momentum=0.9)),
        (OPT.Adagrad, dict(lr=0.1)),
        (OPT.RMSprop, dict(lr=0.01, centered=True)),
    ],
    ids=["adam", "sgd-mom", "adagrad", "rmsprop"],
)
def test_heavily_repeated_ids_sum_gradients(cls, kw):
    """README "Duplicates": a repeated id maps to one local row, so its gradients add up:
    results equal training the whole table as one parameter with lazy per-row updates."""
    g = torch.Generator().manual_seed(4)
    batches = []
    for s in range(3):
        ids = torch.tensor([[3] * 10 + [7, 3, 7], [7] * 6 + [s + 10] * 7])  # 2-D input
        batches.append((ids, torch.randn(2, 13, D, generator=g)))
    W0 = _w0()
    lref = LazyRef(cls, W0, kw)
    for ids, c in batches:
        lref.step(ids.reshape(-1), c.reshape(-1, D))
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, batches)
    got = _table(emb)
    _close(got, lref.W, "weights")
    untouched = [i for i in range(N) if i not in (3, 7, 10, 11, 12)]
    assert torch.equal(got[untouched], W0[untouched])
    for k, full in lref.state.items():
        _close(_state_tables(opt)[k], full, f"state {k!r}")


def test_several_lookups_of_one_table_in_a_step_match_dense():
    """README: "A table may be looked up several times in a step (a skip-gram's context
    and negatives ...): the step sums their gradients ... bit-identical to a dense
    nn.Embedding trained the same way"."""
    W0 = _w0()
    g = torch.Generator().manual_seed(8)
    steps = []
    for _ in range(3):
        a = torch.cat([torch.randperm(N, generator=g), torch.tensor([1, 1, 2])])
        b = torch.randint(0, N, (2, 9), generator=g)
        steps.append((a, b, torch.randn(len(a), D, generator=g), torch.randn(2, 9, D, generator=g)))

    def run(lookup, opt):
        for a, b, ca, cb in steps:
            opt.zero_grad()
            loss = _loss(lookup(a), ca) + (lookup(b) * cb).sum() * 0.5 + lookup(a[:5]).pow(3).sum()
            loss.backward()
            opt.step()

    ref = _dense(W0)
    ropt = OPT.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    run(ref, ropt)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.AdamW, emb, lr=0.01, weight_decay=0.1)
    run(emb, opt)
    _close(_table(emb), ref.weight.detach(), "weights")
    _close(_state_tables(opt)["exp_avg_sq"], ropt.state[ref.weight]["exp_avg_sq"], "exp_avg_sq")


# --------------------------------------------------------------------------- SGD dampening / fused


def test_sgd_dampening_starts_momentum_at_zero_as_documented():
    """README: "SGD with dampening != 0 starts a row's momentum at zero, where torch starts
    it at the first gradient." Reference: torch's SGD with a zero momentum buffer put in
    before its first step."""
    kw = dict(lr=0.1, momentum=0.9, dampening=0.3)
    batches = _batches(4, seed=6)
    W0 = _w0()
    ref = _dense(W0)
    ropt = OPT.SGD(ref.parameters(), **kw)
    ropt.state[ref.weight]["momentum_buffer"] = torch.zeros_like(ref.weight)
    _train(ref, ropt, batches)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.SGD, emb, **kw)
    _train(emb, opt, batches)
    _close(_table(emb), ref.weight.detach(), "weights")
    _close(
        _state_tables(opt)["momentum_buffer"], ropt.state[ref.weight]["momentum_buffer"], "momentum"
    )


def _fused_ok(cls, **kw):
    p = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.ones(2, 2)
    try:
        cls([p], fused=True, **kw).step()
    except (RuntimeError, TypeError, ValueError) as e:
        pytest.skip(f"fused {cls.__name__} on CPU not in torch {torch.__version__}: {e}")


@pytest.mark.parametrize(
    "cls,kw",
    [
        (OPT.SGD, dict(lr=0.1, momentum=0.9)),
        (OPT.Adam, dict(lr=0.01)),
        (OPT.AdamW, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
        (OPT.Adagrad, dict(lr=0.1)),
    ],
    ids=["sgd-mom", "adam", "adamw-amsgrad", "adagrad"],
)
def test_fused_variants_with_a_dense_head_match_to_rounding(cls, kw):
    """README: fused CPU kernels "round some values differently ... so there results match a
    dense table to rounding"; fused SGD with momentum trains tables beside ordinary
    parameters (dampening 0)."""
    _fused_ok(cls, **{k: v for k, v in kw.items() if k != "lr"})
    batches = _batches(4, seed=9)
    W0 = _w0()
    torch.manual_seed(0)
    head0 = torch.nn.Linear(D, 1)

    def run(table):
        head = torch.nn.Linear(D, 1)
        head.load_state_dict(head0.state_dict())
        model = torch.nn.ModuleDict({"emb": table, "head": head})
        return model

    ref = run(_dense(W0))
    ropt = cls(ref.parameters(), fused=True, **kw)
    mod = run(_emb(W0))
    opt = gl.OffloadedOptimizer(cls, mod, fused=True, **kw)
    for ids, c in batches:
        for m, o in ((ref, ropt), (mod, opt)):
            o.zero_grad()
            out = m["emb"](ids)
            (_loss(out, c) + m["head"](out).pow(2).sum()).backward()
            o.step()
    _close(_table(mod["emb"]), ref["emb"].weight.detach(), "weights", rtol=1e-5, atol=1e-5)
    _close(mod["head"].weight.detach(), ref["head"].weight.detach(), "head", rtol=1e-5, atol=1e-5)


def test_fused_sgd_dampening_with_dense_params_refused_unchanged():
    """README: "with dampening != 0 that mix is refused by the first step() (a
    GadgetValueError; nothing is changed)"."""
    _fused_ok(OPT.SGD, momentum=0.9)
    W0 = _w0()
    model = torch.nn.ModuleDict({"emb": _emb(W0), "head": torch.nn.Linear(D, 1)})
    head_before = {k: v.clone() for k, v in model["head"].state_dict().items()}
    opt = gl.OffloadedOptimizer(OPT.SGD, model, lr=0.1, momentum=0.9, dampening=0.5, fused=True)
    ids = torch.arange(N)
    model["head"](model["emb"](ids)).sum().backward()
    with pytest.raises(gl.GadgetValueError) as ei:
        opt.step()
    assert "dampening" in str(ei.value)
    assert torch.equal(_table(model["emb"]), W0)
    for k, v in model["head"].state_dict().items():
        assert torch.equal(v, head_before[k])
    for k, t in _state_tables(opt).items():
        assert not t.any(), f"state table {k} written by a refused step"


# --------------------------------------------------------------------------- LR schedulers


def _sched_pair(make_sched, cls, kw, steps=6, seed=12):
    batches = _batches(steps, seed=seed)
    W0 = _w0()
    ref = _dense(W0)
    ropt = cls(ref.parameters(), **kw)
    rs = make_sched(ropt)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    gs = make_sched(opt)
    lrs_ref, lrs_got = [], []
    for ids, c in batches:
        for m, o, s, lrs in ((ref, ropt, rs, lrs_ref), (emb, opt, gs, lrs_got)):
            o.zero_grad()
            _loss(m(ids), c).backward()
            o.step()
            s.step()
            lrs.append(o.param_groups[0]["lr"])
    return ref, ropt, emb, opt, lrs_ref, lrs_got


@pytest.mark.parametrize(
    "kind", ["step", "lambda", "exponential", "multistep", "cosine", "warmup-sequential"]
)
@pytest.mark.parametrize(
    "cls,kw",
    [
        (OPT.Adam, dict(lr=0.05)),
        (OPT.SGD, dict(lr=0.1, momentum=0.9)),
        (OPT.Adagrad, dict(lr=0.2, lr_decay=0.01)),
    ],
    ids=["adam", "sgd-mom", "adagrad"],
)
def test_lr_schedulers_step_the_wrapped_optimizer(kind, cls, kw):
    """README: "LR schedulers work"; docstring: the wrapper shares param_groups with the
    inner optimizer, "so learning-rate schedulers work"."""
    makers = {
        "step": lambda o: OPT.lr_scheduler.StepLR(o, step_size=2, gamma=0.3),
        "lambda": lambda o: OPT.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + 2 * e)),
        "exponential": lambda o: OPT.lr_scheduler.ExponentialLR(o, gamma=0.5),
        "multistep": lambda o: OPT.lr_scheduler.MultiStepLR(o, milestones=[1, 3], gamma=0.2),
        "cosine": lambda o: OPT.lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=0.0),
        "warmup-sequential": lambda o: OPT.lr_scheduler.SequentialLR(
            o,
            [
                OPT.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2),
                OPT.lr_scheduler.ExponentialLR(o, gamma=0.4),
            ],
            milestones=[2],
        ),
    }
    ref, ropt, emb, opt, lref, lgot = _sched_pair(makers[kind], cls, kw)
    assert lgot == pytest.approx(lref)
    assert lgot[-1] < kw["lr"] * 0.5, "scheduler did not lower lr"
    _close(_table(emb), ref.weight.detach(), "weights")


def test_lr_scheduler_changes_apply_the_same_step():
    """An lr changed by hand in param_groups between steps is the lr the next step uses
    (a torch optimizer reads param_groups at each step)."""
    W0 = _w0()
    ids = torch.arange(N)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.SGD, emb, lr=0.5)
    for g in opt.param_groups:
        g["lr"] = 0.0
    emb(ids).sum().backward()
    opt.step()
    assert torch.equal(_table(emb), W0), "lr=0 set on the wrapper's param_groups was not used"
    opt.param_groups[0]["lr"] = 0.25
    emb(ids).sum().backward()
    opt.step()
    _close(_table(emb), W0 - 0.25, "weights after lr 0.25 step")


def test_onecycle_warmup_before_first_step_and_beta_cycling():
    """README: schedulers "that warm lr up before the first step or turn momentum on
    (OneCycleLR, CyclicLR)" work; OneCycleLR cycles Adam's betas too."""
    mk = lambda o: OPT.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8, pct_start=0.4)  # noqa: E731
    ref, ropt, emb, opt, lref, lgot = _sched_pair(mk, OPT.Adam, dict(lr=0.01), steps=7)
    assert lgot == pytest.approx(lref)
    assert opt.param_groups[0]["betas"] == pytest.approx(ropt.param_groups[0]["betas"])
    _close(_table(emb), ref.weight.detach(), "weights")
    _close(_state_tables(opt)["exp_avg"], ropt.state[ref.weight]["exp_avg"], "exp_avg")


def test_cyclic_lr_turns_sgd_momentum_on():
    """README: a scheduler that turns momentum on: "the paged state follows the
    hyper-parameters as torch's would (state that appears gets its own table)"."""

    def mk(o):
        return OPT.lr_scheduler.CyclicLR(
            o,
            base_lr=0.01,
            max_lr=0.1,
            step_size_up=2,  # noqa: E731
            base_momentum=0.8,
            max_momentum=0.9,
        )

    ref, ropt, emb, opt, lref, lgot = _sched_pair(mk, OPT.SGD, dict(lr=0.1, momentum=0.0), steps=5)
    assert ropt.param_groups[0]["momentum"] > 0
    assert opt.param_groups[0]["momentum"] == pytest.approx(ropt.param_groups[0]["momentum"])
    assert lgot == pytest.approx(lref)
    _close(_table(emb), ref.weight.detach(), "weights")
    tables = _state_tables(opt)
    assert "momentum_buffer" in tables, (
        f"no momentum table after CyclicLR turned momentum on: {sorted(tables)}"
    )
    _close(tables["momentum_buffer"], ropt.state[ref.weight]["momentum_buffer"], "momentum_buffer")


def test_momentum_turned_on_by_hand_midway_partial_rows():
    """Momentum switched on after two plain-SGD steps: its table appears, rows not looked
    up since stay zero, and the result equals the lazy dense reference."""
    W0 = _w0()
    batches = _batches(5, seed=21, full=False, extra=20, hi=40)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.SGD, emb, lr=0.1, momentum=0.0)
    lref0 = LazyRef(OPT.SGD, W0, dict(lr=0.1))
    for ids, c in batches[:2]:
        lref0.step(ids, c)
    lref = LazyRef(OPT.SGD, lref0.W, dict(lr=0.1, momentum=0.9))
    for ids, c in batches[2:]:
        lref.step(ids, c)
    _train(emb, opt, batches[:2])
    for g in opt.param_groups:
        g["momentum"] = 0.9
    _train(emb, opt, batches[2:])
    _close(_table(emb), lref.W, "weights")
    _close(_state_tables(opt)["momentum_buffer"], lref.state["momentum_buffer"], "momentum_buffer")


# --------------------------------------------------------------------------- param groups


def _two_table_model(W0a, W0b, head_seed=0):
    torch.manual_seed(head_seed)
    return torch.nn.ModuleDict({"a": _emb(W0a), "b": _emb(W0b), "head": torch.nn.Linear(D, 1)})


def _two_dense_model(W0a, W0b, head_seed=0):
    torch.manual_seed(head_seed)
    return torch.nn.ModuleDict({"a": _dense(W0a), "b": _dense(W0b), "head": torch.nn.Linear(D, 1)})


def _two_table_steps(model, opt, batches, sched=None):
    for (ia, ca), (ib, cb) in batches:
        opt.zero_grad()
        xa, xb = model["a"](ia), model["b"](ib)
        loss = (
            _loss(xa, ca)
            + _loss(xb, cb)
            + model["head"](xa).pow(2).mean()
            + model["head"](xb).sum()
        )
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize(
    "cls,kw",
    [(OPT.Adam, {}), (OPT.SGD, dict(momentum=0.9)), (OPT.RMSprop, dict(centered=True))],
    ids=["adam", "sgd-mom", "rmsprop"],
)
def test_param_groups_with_different_lrs_and_options(cls, kw):
    """README: "A param-group dict may name offloaded modules ... to give tables their
    own options"; docstring: "everything not named by a dict shares one group with the
    keyword options"."""
    Wa, Wb = _w0(seed=31), _w0(seed=32)
    batches = list(zip(_batches(4, seed=13), _batches(4, seed=14), strict=False))
    ref = _two_dense_model(Wa, Wb)
    ropt = cls(
        [
            {"params": ref["a"].parameters(), "lr": 0.05, "weight_decay": 0.1},
            {"params": ref["head"].parameters(), "lr": 0.001},
            {"params": ref["b"].parameters()},
        ],
        lr=0.01,
        **kw,
    )
    mod = _two_table_model(Wa, Wb)
    opt = gl.OffloadedOptimizer(
        cls,
        [
            {"params": mod["a"], "lr": 0.05, "weight_decay": 0.1},
            {"params": mod["head"].parameters(), "lr": 0.001},
            mod,
        ],
        lr=0.01,
        **kw,
    )
    assert sorted(g["lr"] for g in opt.param_groups) == [0.001, 0.01, 0.05]
    _two_table_steps(ref, ropt, batches)
    _two_table_steps(mod, opt, batches)
    _close(_table(mod["a"]), ref["a"].weight.detach(), "table a")
    _close(_table(mod["b"]), ref["b"].weight.detach(), "table b")
    _close(mod["head"].weight.detach(), ref["head"].weight.detach(), "head")


def test_per_group_lambda_schedulers():
    """A LambdaLR with one lambda per param group drives each table's lr."""
    Wa, Wb = _w0(seed=41), _w0(seed=42)
    batches = list(zip(_batches(5, seed=15), _batches(5, seed=16), strict=False))
    lams = [lambda e: 0.5**e, lambda e: 1.0 + e, lambda e: 1.0]
    ref = _two_dense_model(Wa, Wb)
    ropt = OPT.Adam(
        [
            {"params": ref["a"].parameters(), "lr": 0.02},
            {"params": ref["b"].parameters(), "lr": 0.005},
            {"params": ref["head"].parameters()},
        ],
        lr=0.01,
    )
    mod = _two_table_model(Wa, Wb)
    opt = gl.OffloadedOptimizer(
        OPT.Adam,
        [
            {"params": mod["a"], "lr": 0.02},
            {"params": mod["b"], "lr": 0.005},
            {"params": mod["head"].parameters()},
        ],
        lr=0.01,
    )
    _two_table_steps(ref, ropt, batches, OPT.lr_scheduler.LambdaLR(ropt, lams))
    _two_table_steps(mod, opt, batches, OPT.lr_scheduler.LambdaLR(opt, lams))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(
        [g["lr"] for g in ropt.param_groups]
    )
    _close(_table(mod["a"]), ref["a"].weight.detach(), "table a")
    _close(_table(mod["b"]), ref["b"].weight.detach(), "table b")


def test_add_param_group_table_starts_fresh_state():
    """README: "opt.add_param_group({"params": new_emb, "lr": 1e-2}) adds a table later
    (with fresh state, as torch gives a parameter added to its optimizer)"."""
    Wa, Wb = _w0(seed=51), _w0(seed=52)
    ba, bb = _batches(5, seed=17), _batches(5, seed=18)
    ra, rb = _dense(Wa), _dense(Wb)
    ropt = OPT.Adam(ra.parameters(), lr=0.01)
    ea, eb = _emb(Wa), _emb(Wb)
    opt = gl.OffloadedOptimizer(OPT.Adam, ea, lr=0.01)
    for step in range(5):
        if step == 2:
            ropt.add_param_group({"params": rb.parameters(), "lr": 0.03})
            opt.add_param_group({"params": eb, "lr": 0.03})
        for a, b, o in ((ra, rb, ropt), (ea, eb, opt)):
            o.zero_grad()
            loss = _loss(a(ba[step][0]), ba[step][1])
            if step >= 2:
                loss = loss + _loss(b(bb[step][0]), bb[step][1])
            loss.backward()
            o.step()
    _close(_table(ea), ra.weight.detach(), "first table")
    _close(_table(eb), rb.weight.detach(), "added table")
    assert ropt.state[rb.weight]["step"].item() == 3


# --------------------------------------------------------------------------- zero_grad


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize(
    "cls,kw",
    [(OPT.Adam, dict(lr=0.02)), (OPT.SGD, dict(lr=0.1, momentum=0.9, nesterov=True))],
    ids=["adam", "sgd-nesterov"],
)
def test_zero_grad_modes_full_cover(set_to_none, cls, kw):
    batches = _batches(4, seed=19)
    W0 = _w0()
    ref = _dense(W0)
    ropt = cls(ref.parameters(), **kw)
    _train(ref, ropt, batches, set_to_none=set_to_none)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, batches, set_to_none=set_to_none)
    _close(_table(emb), ref.weight.detach(), "weights")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_discards_earlier_backward(set_to_none):
    """README: "The optimizer's zero_grad() ... throws away the gradients of the lookups
    since the last step"."""
    W0 = _w0()
    (i1, c1), (i2, c2) = _batches(2, seed=20)
    ref = _dense(W0)
    ropt = OPT.Adam(ref.parameters(), lr=0.05)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.Adam, emb, lr=0.05)
    for m, o in ((ref, ropt), (emb, opt)):
        _loss(m(i1), c1).backward()
        o.zero_grad(set_to_none=set_to_none)
        _loss(m(i2), c2).backward()
        o.step()
    _close(_table(emb), ref.weight.detach(), "weights")


@pytest.mark.parametrize(
    "cls,kw",
    [
        (OPT.Adam, dict(lr=0.02)),
        (OPT.Adagrad, dict(lr=0.1)),
        (OPT.RMSprop, dict(lr=0.01, momentum=0.5)),
    ],
    ids=["adam", "adagrad", "rmsprop"],
)
def test_gradient_accumulation_without_zero_grad(cls, kw):
    """Two backward passes before a step sum their gradients, as torch accumulates them."""
    W0 = _w0()
    bs = _batches(6, seed=22)
    ref = _dense(W0)
    ropt = cls(ref.parameters(), **kw)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    for m, o in ((ref, ropt), (emb, opt)):
        for k in range(0, 6, 2):
            o.zero_grad()
            _loss(m(bs[k][0]), bs[k][1]).backward()
            _loss(m(bs[k + 1][0]), bs[k + 1][1]).backward()
            o.step()
    _close(_table(emb), ref.weight.detach(), "weights")


def test_table_without_lookup_is_not_stepped_even_with_set_to_none_false():
    """README: "a table with no lookup since the last step is not stepped and its step
    count does not move (torch's SparseAdam would count a step for a parameter whose
    gradient zero_grad(set_to_none=False) zeroed)". Reference: the table's dense twin
    stepped only on the steps that look it up."""
    W0 = _w0()
    bs = _batches(4, seed=23)
    torch.manual_seed(3)
    head = torch.nn.Linear(D, 1)
    model = torch.nn.ModuleDict({"emb": _emb(W0), "head": head})
    opt = gl.OffloadedOptimizer(OPT.Adam, model, lr=0.02)
    ref = _dense(W0)
    ropt = OPT.Adam(ref.parameters(), lr=0.02)
    uses = [True, False, False, True]
    snap = None
    for (ids, c), use in zip(bs, uses, strict=False):
        opt.zero_grad(set_to_none=False)
        if use:
            loss = _loss(model["emb"](ids), c) + head(torch.ones(2, D)).sum()
            ropt.zero_grad()
            _loss(ref(ids), c).backward()
            ropt.step()
        else:
            loss = head(torch.ones(2, D)).pow(2).sum()
        loss.backward()
        opt.step()
        if use and snap is None:
            snap = (_table(model["emb"]), _state_tables(opt))
        elif not use:
            assert torch.equal(_table(model["emb"]), snap[0]), "table moved without a lookup"
            for k, v in _state_tables(opt).items():
                assert torch.equal(v, snap[1][k]), f"state {k} moved without a lookup"
    _close(_table(model["emb"]), ref.weight.detach(), "weights (step count 2, not 4)")


def test_second_step_without_backward_leaves_table_alone():
    """README: "step() consumes the tables' gradients: a second step() with no new
    backward leaves the tables alone"."""
    W0 = _w0()
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.Adam, emb, lr=0.05)
    ((ids, c),) = _batches(1, seed=24)
    _loss(emb(ids), c).backward()
    opt.step()
    t1, s1 = _table(emb), _state_tables(opt)
    steps1 = _scalar_state(opt)["step"]
    opt.step()
    assert torch.equal(_table(emb), t1)
    for k, v in _state_tables(opt).items():
        assert torch.equal(v, s1[k])
    assert sorted(float(s) for s in _scalar_state(opt)["step"]) == sorted(float(s) for s in steps1)


# --------------------------------------------------------------------------- misc documented behaviour


def test_step_closure_returns_loss_and_trains():
    """README: "step(closure) runs the closure with grad enabled first and returns its loss"."""
    W0 = _w0()
    ((ids, c),) = _batches(1, seed=25)
    ref = _dense(W0)
    ropt = OPT.RMSprop(ref.parameters(), lr=0.01)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.RMSprop, emb, lr=0.01)

    def closure_for(m, o):
        def closure():
            o.zero_grad()
            loss = _loss(m(ids), c)
            loss.backward()
            return loss

        return closure

    rl = ropt.step(closure_for(ref, ropt))
    with torch.no_grad():
        gl_loss = opt.step(closure_for(emb, opt))
    assert torch.is_tensor(gl_loss) and gl_loss.item() == pytest.approx(rl.item(), rel=1e-6)
    _close(_table(emb), ref.weight.detach(), "weights")


def test_clip_grad_norm_over_param_groups_matches_dense():
    """README: clip over the optimizer's groups:
    clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)."""
    W0 = _w0()
    bs = _batches(3, seed=26)
    ref = _dense(W0)
    ropt = OPT.SGD(ref.parameters(), lr=0.5, momentum=0.5)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.SGD, emb, lr=0.5, momentum=0.5)
    for m, o in ((ref, ropt), (emb, opt)):
        norms = []
        for ids, c in bs:
            o.zero_grad()
            _loss(m(ids), c).backward()
            norms.append(
                float(
                    torch.nn.utils.clip_grad_norm_(
                        [p for g in o.param_groups for p in g["params"]], 1.0
                    )
                )
            )
            o.step()
        m.norms = norms
    assert emb.norms == pytest.approx(ref.norms, rel=1e-5)
    assert max(ref.norms) > 1.0, "clipping never active: vacuous"
    _close(_table(emb), ref.weight.detach(), "weights")


def test_numpy_option_values_count_as_values():
    """README: "options given as NumPy numbers count as their values (turning momentum on
    with np.float32(0.9) adds its table)"."""
    W0 = _w0()
    bs = _batches(3, seed=27)
    ref = _dense(W0)
    ropt = OPT.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train(ref, ropt, bs)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.SGD, emb, lr=np.float64(0.1), momentum=np.float32(0.0))
    opt.param_groups[0]["momentum"] = np.float32(0.9)
    _train(emb, opt, bs)
    assert "momentum_buffer" in _state_tables(opt)
    _close(_table(emb), ref.weight.detach(), "weights", rtol=1e-5, atol=1e-5)


def test_subclass_with_kwargs_is_probed_with_group_options():
    """README: "A subclass of one of them is probed with its group's options, also when
    its __init__ passes them on as **kwargs"."""

    class MyAdam(OPT.Adam):
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)

    W0 = _w0()
    bs = _batches(3, seed=28)
    ref = _dense(W0)
    ropt = MyAdam(ref.parameters(), lr=0.01, amsgrad=True)
    _train(ref, ropt, bs)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(MyAdam, emb, lr=0.01, amsgrad=True)
    _train(emb, opt, bs)
    assert "max_exp_avg_sq" in _state_tables(opt)
    _close(_table(emb), ref.weight.detach(), "weights")
    _close(
        _state_tables(opt)["max_exp_avg_sq"],
        ropt.state[ref.weight]["max_exp_avg_sq"],
        "max_exp_avg_sq",
    )


def test_adagrad_initial_accumulator_from_constructor_only():
    """README: "as in torch, Adagrad's initial_accumulator_value is taken from the
    constructor only, not from a param group". Compared with the installed torch."""
    W0 = _w0()
    bs = _batches(3, seed=29)
    ref = _dense(W0)
    ropt = OPT.Adagrad(
        [{"params": ref.parameters(), "initial_accumulator_value": 5.0}],
        lr=0.1,
        initial_accumulator_value=0.2,
    )
    _train(ref, ropt, bs)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(
        OPT.Adagrad,
        [{"params": emb, "initial_accumulator_value": 5.0}],
        lr=0.1,
        initial_accumulator_value=0.2,
    )
    _train(emb, opt, bs)
    _close(_table(emb), ref.weight.detach(), "weights")
    _close(_state_tables(opt)["sum"], ropt.state[ref.weight]["sum"], "sum")


def test_state_dict_round_trip_resumes_like_uninterrupted_training():
    """state_dict() / load_state_dict() into a new optimizer over a copied model resumes
    training exactly (README: "save it with state_dict() ... and load that into a new one
    built over the copied model")."""
    W0 = _w0()
    bs = _batches(5, seed=30)
    kw = dict(lr=0.02, amsgrad=True, weight_decay=0.01)
    ref = _dense(W0)
    ropt = OPT.AdamW(ref.parameters(), **kw)
    _train(ref, ropt, bs)

    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.AdamW, emb, **kw)
    _train(emb, opt, bs[:3])
    sd_model, sd_opt = emb.state_dict(), opt.state_dict()
    emb2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    emb2.load_state_dict(sd_model)
    opt2 = gl.OffloadedOptimizer(OPT.AdamW, emb2, **kw)
    opt2.load_state_dict(sd_opt)
    _train(emb2, opt2, bs[3:])
    _close(_table(emb2), ref.weight.detach(), "resumed weights")
    _close(
        _state_tables(opt2)["max_exp_avg_sq"],
        ropt.state[ref.weight]["max_exp_avg_sq"],
        "max_exp_avg_sq",
    )


def test_state_dict_of_another_class_refused_unchanged():
    """README: "state saved by another class (Adam's into NAdam) is refused before anything
    changes (GadgetValueError)"."""
    W0 = _w0()
    bs = _batches(2, seed=31)
    e1 = _emb(W0)
    o1 = gl.OffloadedOptimizer(OPT.Adam, e1, lr=0.01)
    _train(e1, o1, bs)
    e2 = _emb(W0)
    o2 = gl.OffloadedOptimizer(OPT.NAdam, e2, lr=0.01)
    _train(e2, o2, bs[:1])
    before_t, before_s = _state_tables(o2), _scalar_state(o2)
    with pytest.raises(gl.GadgetValueError) as ei:
        o2.load_state_dict(o1.state_dict())
    msg = str(ei.value)
    assert "Adam" in msg and "NAdam" in msg, msg
    for k, v in _state_tables(o2).items():
        assert torch.equal(v, before_t[k])
    assert {k: [float(x) for x in v] for k, v in _scalar_state(o2).items()} == {
        k: [float(x) for x in v] for k, v in before_s.items()
    }


# --------------------------------------------------------------------------- refusals


class _NotPageable(OPT.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):  # pragma: no cover - never reached
        return None


def _refused_leaves_table_free(make_bad, exc):
    W0 = _w0()
    emb = _emb(W0)
    with pytest.raises(exc) as ei:
        make_bad(emb)
    assert torch.equal(_table(emb), W0)
    gc.collect()
    # the refused optimizer did not take the table: a valid one may
    opt = gl.OffloadedOptimizer(OPT.SGD, emb, lr=1.0)
    emb(torch.tensor([0])).sum().backward()
    opt.step()
    _close(_table(emb)[0], W0[0] - 1.0, "row 0 after a valid step")
    return str(ei.value)


@pytest.mark.parametrize("cls", [OPT.LBFGS, _NotPageable], ids=["LBFGS", "custom"])
def test_unsupported_optimizer_class_refused_with_list(cls):
    """README: others are "refused with this list (a GadgetTypeError)"."""
    msg = _refused_leaves_table_free(
        lambda e: gl.OffloadedOptimizer(cls, e, lr=0.1), gl.GadgetTypeError
    )
    assert cls.__name__ in msg, msg
    for name in gl.SUPPORTED_OPTIMIZERS:
        assert name in msg, f"{name} not listed in: {msg}"


def test_adafactor_refused_if_present():
    if not hasattr(OPT, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    msg = _refused_leaves_table_free(
        lambda e: gl.OffloadedOptimizer(OPT.Adafactor, e, lr=0.01), gl.GadgetTypeError
    )
    assert "Adafactor" in msg


@pytest.mark.parametrize("cls", [OPT.Adam, OPT.SGD, OPT.RMSprop], ids=["adam", "sgd", "rmsprop"])
def test_differentiable_true_refused(cls):
    """README: "differentiable=True is refused (paged rows are updated in place outside
    autograd)"; Errors: options that cannot be paged are a GadgetTypeError."""
    msg = _refused_leaves_table_free(
        lambda e: gl.OffloadedOptimizer(cls, e, lr=0.1, differentiable=True), gl.GadgetTypeError
    )
    assert "differentiable" in msg, msg


def test_option_with_which_step_fails_refused():
    """README: "any option with which a step fails on a one-row probe" is refused (here:
    nesterov without momentum, which torch refuses in its constructor too)."""
    with pytest.raises(ValueError):
        OPT.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, nesterov=True)
    _refused_leaves_table_free(
        lambda e: gl.OffloadedOptimizer(OPT.SGD, e, lr=0.1, nesterov=True), ValueError
    )


def test_params_mistakes_refused_clearly():
    W0 = _w0()
    emb = _emb(W0)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.OffloadedOptimizer(OPT.Adam, emb.weight, lr=0.01)
    assert "OffloadedEmbedding" in str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(OPT.Adam, [{"params": emb}, {"params": [emb], "lr": 1.0}])
    with pytest.raises(TypeError) as ei:
        gl.OffloadedOptimizer(OPT.Adam, [{"params": {emb}}])
    assert "set" in str(ei.value) or "ordered" in str(ei.value)
    gc.collect()
    assert torch.equal(_table(emb), W0)
    opt = gl.OffloadedOptimizer(OPT.Adam, [emb], lr=0.01)  # still free to be taken
    assert len(opt.pagers) == 1


def test_model_parameters_without_tables_warns():
    """README: "it warns when it finds no table" (model.parameters() does not reach the tables)."""
    model = torch.nn.ModuleDict({"emb": _emb(_w0()), "head": torch.nn.Linear(D, 1)})
    with pytest.warns(UserWarning):
        _opt = gl.OffloadedOptimizer(OPT.Adam, model.parameters(), lr=0.01)
    assert len(_opt.pagers) == 0


def test_table_belongs_to_one_optimizer_at_a_time():
    W0 = _w0()
    emb = _emb(W0)
    _opt = gl.OffloadedOptimizer(OPT.Adam, emb, lr=0.01)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(OPT.SGD, emb, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    _opt.step()
    assert set(_state_tables(_opt)) == {"exp_avg", "exp_avg_sq"}


# --------------------------------------------------------------------------- more groups / schedulers / state


@pytest.mark.parametrize(
    "cls,ga,gb",
    [
        (OPT.Adam, dict(amsgrad=True), dict(amsgrad=False)),
        (OPT.SGD, dict(momentum=0.9), dict(momentum=0.0)),
        (OPT.SGD, dict(momentum=0.0), dict(momentum=0.9, nesterov=True)),
        (OPT.RMSprop, dict(centered=True), dict(momentum=0.5)),
        (OPT.Adam, dict(foreach=True, maximize=True), dict(foreach=False)),
        (OPT.Rprop, dict(lr=0.05), dict(lr=0.001)),
        (OPT.Adagrad, dict(lr_decay=0.1), dict(eps=1e-3)),
    ],
    ids=[
        "adam-amsgrad-one-group",
        "sgd-mom-a",
        "sgd-nesterov-b",
        "rmsprop-centered-vs-mom",
        "adam-foreach-maximize",
        "rprop-lrs",
        "adagrad-lrdecay-eps",
    ],
)
def test_groups_whose_options_change_the_state_layout(cls, ga, gb):
    """Per-group options that give one table more state than the other (amsgrad, momentum,
    centered) each follow torch's per-group behaviour."""
    Wa, Wb = _w0(seed=61), _w0(seed=62)
    batches = list(zip(_batches(4, seed=63), _batches(4, seed=64), strict=False))
    ref = _two_dense_model(Wa, Wb)
    ropt = cls(
        [
            dict(params=ref["a"].parameters(), **ga),
            dict(params=ref["b"].parameters(), **gb),
            {"params": ref["head"].parameters()},
        ],
        lr=0.01,
    )
    mod = _two_table_model(Wa, Wb)
    opt = gl.OffloadedOptimizer(
        cls,
        [
            dict(params=mod["a"], **ga),
            dict(params=mod["b"], **gb),
            {"params": mod["head"].parameters()},
        ],
        lr=0.01,
    )
    _two_table_steps(ref, ropt, batches)
    _two_table_steps(mod, opt, batches)
    _close(_table(mod["a"]), ref["a"].weight.detach(), "table a")
    _close(_table(mod["b"]), ref["b"].weight.detach(), "table b")
    _close(mod["head"].weight.detach(), ref["head"].weight.detach(), "head")
    got_keys = sorted(sorted(p.tables) for p in opt.pagers)
    want_keys = sorted(
        sorted(
            k
            for k, v in ropt.state[r.weight].items()
            if torch.is_tensor(v) and v.shape == r.weight.shape
        )
        for r in (ref["a"], ref["b"])
    )
    assert got_keys == want_keys


@pytest.mark.parametrize(
    "cls,kw",
    [
        (OPT.Rprop, dict(lr=0.01)),
        (OPT.ASGD, dict(lr=0.01, t0=1)),
        (OPT.Adagrad, dict(lr=0.1, lr_decay=0.1)),
        (OPT.Adadelta, dict(lr=1.0)),
        (OPT.RAdam, dict(lr=0.01)),
    ],
    ids=["rprop", "asgd", "adagrad", "adadelta", "radam"],
)
def test_onecycle_warmup_lr_before_first_step(cls, kw):
    """README: "before the first step Rprop's step_size and ASGD's eta start from the first
    step's lr" (a scheduler that sets lr before the first step)."""

    def mk(o):
        return OPT.lr_scheduler.OneCycleLR(
            o,
            max_lr=0.2,
            total_steps=8,
            pct_start=0.5,  # noqa: E731
            cycle_momentum=False,
        )

    ref, ropt, emb, opt, lref, lgot = _sched_pair(mk, cls, kw, steps=6)
    assert lgot == pytest.approx(lref)
    _close(_table(emb), ref.weight.detach(), "weights")
    for k, v in _state_tables(opt).items():
        _close(v, ropt.state[ref.weight][k], f"state {k!r}")
    for k, v in ropt.state[ref.weight].items():
        if torch.is_tensor(v) and v.dim() == 0:
            _check_scalar(_scalar_state(opt), k, v, "onecycle")


def test_rprop_lazy_rows_first_seen_later_with_changing_lr():
    """Rows first looked up after the lr changed start from the step size torch gave every
    row at the first step (dense Rprop sets all step sizes then)."""
    W0 = _w0()
    bs = _batches(5, seed=40, full=False, extra=15, hi=50)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.Rprop, emb, lr=0.01)
    lrs = [0.01, 0.05, 0.02, 0.03, 0.04]
    lref = LazyRef(OPT.Rprop, W0, dict(lr=0.01), fill={"step_size": 0.01})
    for (ids, c), lr in zip(bs, lrs, strict=False):
        lref.kw = dict(lr=lr)
        lref.step(ids, c)
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        _loss(emb(ids), c).backward()
        opt.step()
    _close(_table(emb), lref.W, "weights")
    for k, v in _state_tables(opt).items():
        _close(v, lref.state[k], f"state {k!r}")


def test_state_dict_with_momentum_loads_into_optimizer_without_it():
    """README: "A state dict or checkpoint holding state the optimizer has not turned on yet
    (a scheduler's momentum) loads, and that state is paged from then on"."""
    W0 = _w0()
    bs = _batches(6, seed=41)
    ref = _dense(W0)
    ropt = OPT.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train(ref, ropt, bs)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.SGD, emb, lr=0.1, momentum=0.0)
    opt.param_groups[0]["momentum"] = 0.9
    _train(emb, opt, bs[:3])
    emb2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    emb2.load_state_dict(emb.state_dict())
    opt2 = gl.OffloadedOptimizer(OPT.SGD, emb2, lr=0.1, momentum=0.0)
    assert "momentum_buffer" not in _state_tables(opt2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["momentum"] == 0.9
    _close(
        _state_tables(opt2)["momentum_buffer"],
        _state_tables(opt)["momentum_buffer"],
        "loaded momentum",
    )
    _train(emb2, opt2, bs[3:])
    _close(_table(emb2), ref.weight.detach(), "resumed weights")
    _close(
        _state_tables(opt2)["momentum_buffer"],
        ropt.state[ref.weight]["momentum_buffer"],
        "momentum",
    )


def test_scheduler_state_survives_optimizer_state_dict_round_trip():
    """A StepLR rebuilt over a restored optimizer (scheduler.state_dict saved beside it, as the
    README says) continues the same lr schedule and weights."""
    W0 = _w0()
    bs = _batches(6, seed=43)
    ref = _dense(W0)
    ropt = OPT.Adam(ref.parameters(), lr=0.05)
    rs = OPT.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    _train(ref, ropt, bs, sched=rs)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.Adam, emb, lr=0.05)
    s1 = OPT.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(emb, opt, bs[:3], sched=s1)
    emb2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    emb2.load_state_dict(emb.state_dict())
    opt2 = gl.OffloadedOptimizer(OPT.Adam, emb2, lr=0.05)
    opt2.load_state_dict(opt.state_dict())
    s2 = OPT.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    s2.load_state_dict(s1.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    _train(emb2, opt2, bs[3:], sched=s2)
    assert opt2.param_groups[0]["lr"] == pytest.approx(ropt.param_groups[0]["lr"])
    _close(_table(emb2), ref.weight.detach(), "weights")


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize(
    "cls,kw",
    [(OPT.Adam, dict(lr=0.02)), (OPT.RMSprop, dict(lr=0.01, centered=True))],
    ids=["adam", "rmsprop"],
)
def test_embedding_bag_full_cover_matches_dense_bag(mode, cls, kw):
    """OffloadedEmbeddingBag ("nn.EmbeddingBag (mode 'sum', 'mean' or 'max') with its table
    in a store"), repeated ids inside and across bags, an empty bag, 1-D input + offsets."""
    W0 = _w0()
    ref = torch.nn.EmbeddingBag(N, D, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(W0)
    bag = gl.OffloadedEmbeddingBag(N, D, mode=mode, placement="cpu", device="cpu")
    bag.load_state_dict({"weight": W0.clone()})
    ropt = cls(ref.parameters(), **kw)
    opt = gl.OffloadedOptimizer(cls, bag, **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        inp = torch.cat([torch.randperm(N, generator=g), torch.randint(0, N, (20,), generator=g)])
        off = torch.tensor([0, 10, 10, 33, 50])
        c = torch.randn(5, D, generator=g)
        for m, o in ((ref, ropt), (bag, opt)):
            o.zero_grad()
            (m(inp, off) * c).sum().backward()
            o.step()
    assert not torch.equal(ref.weight.detach(), W0)
    _close(_table(bag), ref.weight.detach(), f"bag {mode} weights")


def test_grad_scaler_skips_overflowing_steps_like_dense():
    """README: GradScaler ("unscale_, step: scaled, unscaled and checked for inf like any
    gradient"): steps whose scaled gradients overflow are skipped, for tables too."""
    amp = getattr(torch, "amp", None)
    if amp is None or not hasattr(amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler missing")
    W0 = _w0()
    bs = _batches(6, seed=42)
    res = {}
    for kind in ("dense", "gl"):
        m = _dense(W0) if kind == "dense" else _emb(W0)
        o = (
            OPT.Adam(m.parameters(), lr=0.01)
            if kind == "dense"
            else gl.OffloadedOptimizer(OPT.Adam, m, lr=0.01)
        )
        try:
            sc = amp.GradScaler("cpu", init_scale=2.0**124, growth_interval=1)
        except (TypeError, RuntimeError, ValueError) as e:
            pytest.skip(f"no CPU GradScaler in torch {torch.__version__}: {e}")
        scales = []
        for i, (ids, c) in enumerate(bs):
            o.zero_grad()
            sc.scale(_loss(m(ids), c)).backward()
            if kind == "dense" and i == 0:
                try:
                    sc.unscale_(o)
                except RuntimeError as e:
                    pytest.skip(f"CPU grad unscaling not in torch {torch.__version__}: {e}")
            else:
                sc.unscale_(o)
            sc.step(o)
            sc.update()
            scales.append(sc.get_scale())
        w = m.weight.detach() if kind == "dense" else _table(m)
        steps = [o.state[m.weight]["step"]] if kind == "dense" else _scalar_state(o)["step"]
        res[kind] = (w, scales, max(float(x) for x in steps))
    assert res["dense"][2] < len(bs), "no step overflowed: the test is vacuous"
    assert res["gl"][1] == res["dense"][1]
    assert res["gl"][2] == res["dense"][2], "step count differs: skipped steps not skipped"
    _close(res["gl"][0], res["dense"][0], "weights")


def test_capturable_on_cpu_refused_like_torch():
    """README: "any option with which a step fails on a one-row probe" is refused (Errors:
    options that cannot be paged are a GadgetTypeError), before the table is taken."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.ones(2, 2)
    try:
        OPT.Adam([p], lr=0.01, capturable=True).step()
    except (RuntimeError, AssertionError, ValueError, TypeError):
        pass
    else:
        pytest.skip("this torch steps capturable Adam on the CPU")
    msg = _refused_leaves_table_free(
        lambda e: gl.OffloadedOptimizer(OPT.Adam, e, lr=0.01, capturable=True), gl.GadgetTypeError
    )
    assert "Adam" in msg


def test_sparseadam_with_dense_head_fails_without_changes():
    """Docstring: "for SparseAdam the ordinary parameters must have sparse gradients too";
    a step that fails changes nothing ("Refused calls change nothing")."""
    W0 = _w0()
    model = torch.nn.ModuleDict({"emb": _emb(W0), "head": torch.nn.Linear(D, 1)})
    head_before = {k: v.clone() for k, v in model["head"].state_dict().items()}
    opt = gl.OffloadedOptimizer(OPT.SparseAdam, model, lr=0.01)
    model["head"](model["emb"](torch.arange(5))).sum().backward()
    with pytest.raises((RuntimeError, ValueError, TypeError)) as ei:
        opt.step()
    assert "dense" in str(ei.value).lower() or "sparse" in str(ei.value).lower()
    assert torch.equal(_table(model["emb"]), W0)
    for k, v in model["head"].state_dict().items():
        assert torch.equal(v, head_before[k])
    for k, t in _state_tables(opt).items():
        assert not t.any(), f"state table {k} written by a failed step"


def test_step_hooks_run_as_torch_runs_them():
    """README: "hooks registered on it (step ...) run as torch runs them, and torch's global
    step hooks see both it and the optimizer it wraps step"."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    emb = _emb(_w0())
    opt = gl.OffloadedOptimizer(OPT.Adam, emb, lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt)))
    gh = register_optimizer_step_post_hook(
        lambda o, a, k: calls.append(("global", type(o).__name__))
    )
    try:
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
    finally:
        gh.remove()
    assert calls.count(("pre", True)) == 1 and calls.count(("post", True)) == 1
    assert ("global", "OffloadedOptimizer") in calls and ("global", "Adam") in calls
    assert calls.index(("pre", True)) < calls.index(("post", True))


def test_empty_lookup_counts_a_step_and_changes_no_row():
    """README: "An empty lookup (no ids) with a backward is a lookup: the next step() counts a
    step for its table, as SparseAdam counts one for an empty sparse gradient, and changes no
    row"."""
    W0 = _w0()
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(OPT.Adam, emb, lr=0.05)
    ref = _dense(W0)
    ropt = OPT.Adam(ref.parameters(), lr=0.05)
    ids = torch.arange(N)
    _loss(emb(ids), torch.ones(N, D)).backward()
    opt.step()
    emb(torch.tensor([], dtype=torch.long)).sum().backward()
    opt.step()
    t_after_empty = _table(emb)
    # dense twin: step 1 with the gradient, step 2 counted but no row stepped (lazy)
    _loss(ref(ids), torch.ones(N, D)).backward()
    ropt.step()
    assert torch.equal(t_after_empty, ref.weight.detach())
    _check_scalar(_scalar_state(opt), "step", torch.tensor(2.0), "empty lookup")
    opt.zero_grad()
    _loss(emb(ids), torch.ones(N, D)).backward()
    opt.step()
    ropt.state[ref.weight]["step"] += 1  # the empty step counted
    ropt.zero_grad()
    _loss(ref(ids), torch.ones(N, D)).backward()
    ropt.step()
    _close(_table(emb), ref.weight.detach(), "weights with step count 3")


def test_reduce_lr_on_plateau_drives_table_lr():
    """ReduceLROnPlateau (stepped with a metric) lowers the lr the tables train with."""
    W0 = _w0()
    bs = _batches(6, seed=44)
    res = []
    for kind in ("dense", "gl"):
        m = _dense(W0) if kind == "dense" else _emb(W0)
        o = (
            OPT.SGD(m.parameters(), lr=0.2, momentum=0.5)
            if kind == "dense"
            else gl.OffloadedOptimizer(OPT.SGD, m, lr=0.2, momentum=0.5)
        )
        sch = OPT.lr_scheduler.ReduceLROnPlateau(o, mode="min", factor=0.5, patience=0)
        lrs = []
        for ids, c in bs:
            o.zero_grad()
            loss = _loss(m(ids), c)
            loss.backward()
            o.step()
            sch.step(1.0)  # a flat metric: every step after the first is a plateau
            lrs.append(o.param_groups[0]["lr"])
        res.append((m.weight.detach() if kind == "dense" else _table(m), lrs))
    assert res[1][1] == pytest.approx(res[0][1])
    assert res[1][1][-1] < 0.2 * 0.1
    _close(res[1][0], res[0][0], "weights")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "cls,kw",
    [
        (OPT.SGD, dict(lr=0.1, momentum=0.9)),
        (OPT.Adam, dict(lr=0.01, eps=1e-3)),
        (OPT.Adagrad, dict(lr=0.1)),
        (OPT.RMSprop, dict(lr=0.01, eps=1e-3)),
    ],
    ids=["sgd-mom", "adam", "adagrad", "rmsprop"],
)
def test_low_precision_tables_match_dense_to_rounding(dtype, cls, kw):
    """README: "its float16 / bfloat16 arithmetic round some values differently on a tensor of
    a step's rows than on a whole table, so there results match a dense table to rounding"."""
    W0 = _w0().to(dtype)
    bs = [(i, c.to(dtype)) for i, c in _batches(3, seed=5)]
    ref = _dense(W0).to(dtype)
    ropt = cls(ref.parameters(), **kw)
    _ref_train(ref, ropt, bs)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", dtype=dtype)
    emb.load_state_dict({"weight": W0.clone()})
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, bs)
    w = emb.state_dict()["weight"]
    assert w.dtype == dtype
    assert torch.isfinite(ref.weight.float()).all()
    assert not torch.equal(ref.weight.detach(), W0)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    _close(w.float(), ref.weight.detach().float(), f"{dtype} weights", rtol=tol, atol=tol)


LAZY_EXACT = [
    m
    for m in MATRIX
    if m[0] in ("adam", "rmsprop-centered-mom-wd", "sgd-nesterov", "adagrad-lrdecay-init")
]


@pytest.mark.parametrize("name,cls,kw", LAZY_EXACT, ids=[m[0] for m in LAZY_EXACT])
def test_partial_batches_bit_identical_to_dense_on_looked_up_rows(name, cls, kw):
    """README: "the result is bit-identical to a dense nn.Embedding trained the same way on
    the rows a step looks up" (float32, default kernels)."""
    W0 = _w0()
    batches = _batches(4, seed=45, full=False, extra=30, hi=50)
    lref = LazyRef(cls, W0, kw, fill={"sum": kw.get("initial_accumulator_value", 0.0)})
    for ids, c in batches:
        lref.step(ids, c)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    _train(emb, opt, batches)
    got = _table(emb)
    assert torch.equal(got, lref.W), f"{name}: max |diff| {(got - lref.W).abs().max().item()}"


TOGGLES = [
    (
        "adam-maximize-wd-betas",
        OPT.Adam,
        dict(lr=0.01),
        {2: dict(maximize=True, weight_decay=0.1, betas=(0.5, 0.9))},
    ),
    (
        "sgd-nesterov-then-wd",
        OPT.SGD,
        dict(lr=0.1, momentum=0.9),
        {2: dict(nesterov=True, maximize=True), 3: dict(momentum=0.5, weight_decay=0.2)},
    ),
    ("sgd-momentum-off", OPT.SGD, dict(lr=0.1, momentum=0.9), {2: dict(momentum=0.0)}),
    (
        "rmsprop-momentum-off-on",
        OPT.RMSprop,
        dict(lr=0.01, momentum=0.5),
        {2: dict(momentum=0.0), 3: dict(momentum=0.9)},
    ),
    ("adagrad-lrdecay-wd", OPT.Adagrad, dict(lr=0.1), {2: dict(lr_decay=0.3, weight_decay=0.1)}),
    ("adadelta-rho-lr", OPT.Adadelta, dict(lr=1.0), {2: dict(rho=0.5, lr=0.5)}),
    ("asgd-t0-lambd", OPT.ASGD, dict(lr=0.01), {2: dict(t0=0, lambd=0.1)}),
    ("rprop-etas", OPT.Rprop, dict(lr=0.01), {2: dict(etas=(0.1, 2.0), step_sizes=(0.001, 0.002))}),
]


@pytest.mark.parametrize("name,cls,kw,changes", TOGGLES, ids=[t[0] for t in TOGGLES])
def test_hyper_parameters_changed_mid_training_follow_torch(name, cls, kw, changes):
    """README: "the paged state follows the hyper-parameters as torch's would"; an evaluation
    lookup under torch.no_grad() between backward and step leaves the step alone."""
    W0 = _w0()
    bs = _batches(5, seed=50)
    ref = _dense(W0)
    ropt = cls(ref.parameters(), **kw)
    emb = _emb(W0)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    for i, (ids, c) in enumerate(bs):
        for m, o in ((ref, ropt), (emb, opt)):
            if i in changes:
                for g in o.param_groups:
                    g.update(changes[i])
            o.zero_grad()
            _loss(m(ids), c).backward()
            if i == 2:
                with torch.no_grad():
                    m(torch.arange(N))
            o.step()
    _close(_table(emb), ref.weight.detach(), f"{name} weights")
    for k, v in _state_tables(opt).items():
        if k in ropt.state[ref.weight]:
            _close(v, ropt.state[ref.weight][k], f"{name} state {k!r}")
