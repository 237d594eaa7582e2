"""Black-box review (session 29) of ``gl.OffloadedOptimizer`` with torch optimizers' hyper-parameter
options over ``gl.OffloadedEmbedding`` tables (placement "cpu"); written from README.md, SPEC.md and
the public docstrings only.

Reference: README "Duplicates": "results equal training the whole table as one parameter with lazy
per-row updates (rows outside a batch untouched, one step count per table as in torch's
SparseAdam)".  ``LazyRef`` below applies the same torch optimizer class with the same options to a
dense ``nn.Parameter`` holding only the batch's distinct rows (ascending), with per-row state kept
in full tables and scalar state (step, eta, mu, mu_product) kept once per table.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)

import gadgetloader as gl

N, D = 12, 5


@pytest.fixture(autouse=True, scope="module")
def _hide_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


# ----------------------------------------------------------------------------- helpers


def _w0(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g)


def _batches(seed, steps=4, n=N, lookups=2, size=9):
    """Per step: a list of id tensors (several lookups, repeated ids) and loss coefficients."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(steps):
        ids = [torch.randint(0, n // 2 + 2, (size,), generator=g) for _ in range(lookups)]
        ids[0][:3] = ids[0][0]  # certain repeats
        coef = [(torch.randn(size, D, generator=g), torch.randn(size, D, generator=g)) for _ in ids]
        out.append((ids, coef))
    return out


def _all_rows_batches(seed, steps=4, n=N):
    """Every step's ids cover every row (so lazy == dense), with repeats."""
    g = torch.Generator().manual_seed(2000 + seed)
    out = []
    for _ in range(steps):
        ids = torch.cat([torch.randperm(n, generator=g), torch.randint(0, n, (5,), generator=g)])
        coef = [
            (torch.randn(ids.numel(), D, generator=g), torch.randn(ids.numel(), D, generator=g))
        ]
        out.append(([ids], coef))
    return out


def _loss(outs, coef):
    total = 0
    for o, (a, b) in zip(outs, coef, strict=True):
        total = total + (o * o * a).sum() + (o * b).sum()
    return total


def _row_init(key, group, like):
    if key == "step_size":  # Rprop
        return torch.full_like(like, group["lr"])
    if key == "sum":  # Adagrad
        return torch.full_like(like, group["initial_accumulator_value"])
    return torch.zeros_like(like)


class LazyRef:
    """Plain torch: the same optimizer class/options stepped on only the batch's distinct rows."""

    def __init__(self, w0, cls, group=None, **opts):
        self.W = w0.clone()
        self.cls = cls
        self.group = group  # options given in a param-group dict (torch's semantics)
        self.opts = dict(opts)
        self.rows = {}
        self.scalars = None
        self.seen = torch.zeros(w0.shape[0], dtype=torch.bool)

    def step(self, ids_list, coef, opts=None):
        if opts is not None:
            self.opts = dict(opts)
        u = torch.unique(torch.cat([i.reshape(-1) for i in ids_list]))
        p = torch.nn.Parameter(self.W[u].clone())
        if self.group is None:
            opt = self.cls([p], **self.opts)
        else:
            opt = self.cls([{"params": [p], **self.group}], **self.opts)
        group = opt.param_groups[0]
        pre = {k: v.clone() for k, v in opt.state[p].items()}  # state torch makes in __init__
        if (
            self.cls is torch.optim.SGD
            and group["momentum"] != 0
            and "momentum_buffer" not in self.rows
        ):
            # README: the paged momentum starts at zero (== torch's first step when dampening == 0)
            self.rows["momentum_buffer"] = torch.zeros_like(self.W)
            if self.scalars is None:
                self.scalars = {}
        if self.scalars is not None:
            st = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.scalars.items()}
            st.update({k: t[u].clone() for k, t in self.rows.items()})
            opt.state[p] = st
        outs = [F.embedding(torch.searchsorted(u, i), p) for i in ids_list]
        _loss(outs, coef).backward()
        if self.cls is torch.optim.SparseAdam:
            g = p.grad
            p.grad = torch.sparse_coo_tensor(torch.arange(len(u))[None], g, g.shape)
        opt.step()
        if self.scalars is None:
            self.scalars = {}
        for k, v in opt.state[p].items():
            if torch.is_tensor(v) and v.shape == p.shape:
                if k not in self.rows:
                    if k in pre and pre[k].shape == p.shape:
                        self.rows[k] = torch.full_like(self.W, pre[k].reshape(-1)[0].item())
                    else:
                        self.rows[k] = _row_init(k, group, self.W)
                self.rows[k][u] = v.detach()
            else:
                self.scalars[k] = v.clone() if torch.is_tensor(v) else v
        self.W[u] = p.detach()
        self.seen[u] = True


def _emb(w0):
    emb = gl.OffloadedEmbedding(w0.shape[0], D, placement="cpu", device="cpu")
    emb.load_state_dict({"weight": w0.clone()})
    return emb


def _weight(emb):
    return emb.state_dict()["weight"].detach().clone()


def _lib_step(emb, opt, ids_list, coef):
    opt.zero_grad()
    outs = [emb(i) for i in ids_list]
    _loss(outs, coef).backward()
    opt.step()


def _assert_same(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if not torch.equal(a, b):
        diff = (a - b).abs().max().item()
        raise AssertionError(f"{what}: not bit-identical, max abs diff {diff:.3e}")


def _tables(opt):
    return opt.state_dict()["tables"]


def _compare_state(opt, ref, table_index=0):
    """State tables of the rows that were ever stepped equal the reference."""
    tabs = _tables(opt)[table_index]
    seen = ref.seen
    assert seen.any()
    for k, t in ref.rows.items():
        assert k in tabs, f"state table {k!r} missing: {sorted(tabs)}"
        _assert_same(tabs[k][seen].float(), t[seen], f"state {k}")


@pytest.fixture(autouse=True)
def _torch_takes_the_options(request):
    """Skip a case whose options this torch's optimizer does not have (e.g. Adam's
    ``decoupled_weight_decay``, new in torch 2.6): what is reviewed is the paging of options
    torch offers."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    case = params.get("case")
    cls, opts = (case[0], case[1]) if case is not None else (params.get("cls"), params.get("opts"))
    if not (isinstance(cls, type) and isinstance(opts, dict)):
        return
    try:
        cls([torch.zeros(2, requires_grad=True)], **opts)
    except TypeError as exc:
        if "unexpected keyword" in str(exc):
            pytest.skip(f"torch {torch.__version__}: {exc}")
    except Exception:
        pass  # the test itself checks what happens


A, AW, NA, RA, AM = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
)
SGD, AG, RMS, RP, ASGD, AD, SA = (
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    torch.optim.Adadelta,
    torch.optim.SparseAdam,
)

CASES = [
    (A, dict(lr=0.05)),
    (A, dict(lr=0.05, amsgrad=True)),
    (A, dict(lr=0.05, betas=(0.5, 0.9), eps=1e-3)),
    (A, dict(lr=0.05, foreach=True, amsgrad=True, weight_decay=0.05)),
    (A, dict(lr=0.05, fused=True, amsgrad=True)),
    (A, dict(lr=0.05, weight_decay=0.1, decoupled_weight_decay=True)),
    (AW, dict(lr=0.05, weight_decay=0.3, maximize=True, foreach=True)),
    (AW, dict(lr=0.05, betas=(0.8, 0.95), fused=True, weight_decay=0.2)),
    (NA, dict(lr=0.05, momentum_decay=0.01, weight_decay=0.1)),
    (NA, dict(lr=0.05, weight_decay=0.1, decoupled_weight_decay=True, foreach=True)),
    (NA, dict(lr=0.05, betas=(0.7, 0.9), maximize=True)),
    (RA, dict(lr=0.05, weight_decay=0.1, foreach=True, betas=(0.6, 0.8))),
    (AM, dict(lr=0.05, weight_decay=0.1, betas=(0.5, 0.7), maximize=True)),
    (SGD, dict(lr=0.05)),
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),
    (SGD, dict(lr=0.05, momentum=0.5, foreach=True, maximize=True)),
    (SGD, dict(lr=0.05, momentum=0.9, fused=True, nesterov=True)),
    (AG, dict(lr=0.1)),
    (AG, dict(lr=0.1, initial_accumulator_value=0.5, eps=1e-3)),
    (AG, dict(lr=0.1, weight_decay=0.1, lr_decay=0.01, maximize=True, foreach=True)),
    (AG, dict(lr=0.1, initial_accumulator_value=0.2, fused=True)),
    (RMS, dict(lr=0.01)),
    (RMS, dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1, foreach=True)),
    (RMS, dict(lr=0.01, maximize=True, alpha=0.9, eps=1e-4)),
    (RP, dict(lr=0.01)),
    (RP, dict(lr=0.02, etas=(0.3, 1.5), step_sizes=(1e-4, 0.05))),
    (RP, dict(lr=0.02, foreach=True, maximize=True)),
    (ASGD, dict(lr=0.05, lambd=0.01, alpha=0.5, t0=2.0, weight_decay=0.1)),
    (ASGD, dict(lr=0.05, t0=1.0, foreach=True, maximize=True)),
    (AD, dict(lr=0.5, rho=0.5, weight_decay=0.1, eps=1e-3)),
    (SA, dict(lr=0.05, betas=(0.5, 0.9), eps=1e-3)),
    (SA, dict(lr=0.05, maximize=True)),
    (A, dict(lr=torch.tensor(0.05), weight_decay=0.1)),
    (AW, dict(lr=torch.tensor(0.05), amsgrad=True, foreach=False)),
]


def _case_id(c):
    cls, kw = c
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


def _train_both(cls, opts, batches, w0=None):
    w0 = _w0() if w0 is None else w0
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    ref = LazyRef(w0, cls, **opts)
    for ids, coef in batches:
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef)
    return emb, opt, ref


# ----------------------------------------------------------------------------- tests


def test_supported_optimizers_matches_readme():
    # README: "**Optimizers**: SparseAdam, Adam, AdamW (amsgrad), Adamax, Adadelta, RMSprop (momentum,
    # centered), Rprop, ASGD, Adagrad, SGD (momentum, nesterov), NAdam, RAdam"
    assert tuple(gl.SUPPORTED_OPTIMIZERS) == (
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
    )
    for name in gl.SUPPORTED_OPTIMIZERS:
        assert issubclass(getattr(torch.optim, name), torch.optim.Optimizer)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lazy_rows_bit_identical_to_torch(case):
    """Several steps, several lookups per step, repeated ids: weights and state equal LazyRef."""
    cls, opts = case
    emb, opt, ref = _train_both(cls, opts, _batches(hash(_case_id(case)) % 997))
    _assert_same(_weight(emb), ref.W, "weights")
    _compare_state(opt, ref)


DENSE_CASES = [
    (A, dict(lr=0.05, amsgrad=True, weight_decay=0.1)),
    (AW, dict(lr=0.05, weight_decay=0.3, maximize=True)),
    (NA, dict(lr=0.05, momentum_decay=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (AG, dict(lr=0.1, lr_decay=0.05, initial_accumulator_value=0.3, weight_decay=0.1)),
    (RMS, dict(lr=0.01, momentum=0.9, centered=True, alpha=0.8)),
    (RP, dict(lr=0.02, etas=(0.4, 1.3), step_sizes=(1e-4, 0.05))),
    (ASGD, dict(lr=0.05, lambd=0.01, alpha=0.5, t0=2.0, weight_decay=0.1)),
    (AD, dict(lr=0.5, rho=0.7, weight_decay=0.1)),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=_case_id)
def test_all_rows_each_step_equals_dense_nn_embedding(case):
    """When every step uses every row, lazy == dense: compare with nn.Embedding + torch optimizer."""
    cls, opts = case
    w0 = _w0(3)
    batches = _all_rows_batches(7)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    dense = torch.nn.Embedding(N, D)
    with torch.no_grad():
        dense.weight.copy_(w0)
    dopt = cls(dense.parameters(), **opts)
    for ids, coef in batches:
        _lib_step(emb, opt, ids, coef)
        dopt.zero_grad()
        _loss([dense(i) for i in ids], coef).backward()
        dopt.step()
    _assert_same(_weight(emb), dense.weight.detach(), "weights vs dense nn.Embedding")


@pytest.mark.parametrize(
    "cls,opts",
    [
        (AW, dict(lr=0.1, weight_decay=0.5)),
        (SGD, dict(lr=0.1, weight_decay=0.5, momentum=0.9)),
        (AG, dict(lr=0.1, weight_decay=0.5)),
        (ASGD, dict(lr=0.1, weight_decay=0.5)),
        (RMS, dict(lr=0.1, weight_decay=0.5, momentum=0.5)),
    ],
)
def test_rows_outside_batches_untouched_even_with_weight_decay(cls, opts):
    w0 = _w0(4)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    for ids, coef in _batches(5, steps=3, n=6):  # ids < 5
        _lib_step(emb, opt, ids, coef)
    w = _weight(emb)
    _assert_same(w[5:], w0[5:], "unused rows")
    assert not torch.equal(w[:5], w0[:5])
    for name, t in _tables(opt)[0].items():
        if name not in ("step_size",):
            assert torch.count_nonzero(t[5:]) == 0, name


@pytest.mark.parametrize(
    "cls,opts",
    [
        (A, dict(lr=0.05)),
        (SA, dict(lr=0.05)),
        (AG, dict(lr=0.1, lr_decay=0.1)),
        (NA, dict(lr=0.05)),
        (ASGD, dict(lr=0.05, t0=1.0)),
    ],
)
def test_one_step_count_per_table(cls, opts):
    """Two tables; the second is not looked up in step 2 -> its count does not move."""
    w1, w2 = _w0(1), _w0(2)
    e1, e2 = _emb(w1), _emb(w2)
    model = torch.nn.ModuleDict({"a": e1, "b": e2})
    opt = gl.OffloadedOptimizer(cls, model, **opts)
    r1, r2 = LazyRef(w1, cls, **opts), LazyRef(w2, cls, **opts)
    bs = _batches(11, steps=4)
    plan = [(True, True), (True, False), (True, False), (False, True)]
    for (ids, coef), (use1, use2) in zip(bs, plan, strict=True):
        opt.zero_grad()
        outs = []
        if use1:
            outs.append(e1(ids[0]))
            r1.step(ids[:1], coef[:1])
        if use2:
            outs.append(e2(ids[1]))
            r2.step(ids[1:2], coef[1:2])
        co = ([coef[0]] if use1 else []) + ([coef[1]] if use2 else [])
        _loss(outs, co).backward()
        opt.step()
    _assert_same(_weight(e1), r1.W, "table a")
    _assert_same(_weight(e2), r2.W, "table b")
    steps = sorted(
        float(s["step"]) for s in opt.state_dict()["inner"]["state"].values() if "step" in s
    )
    assert steps == [2.0, 3.0]


def test_second_step_without_backward_changes_nothing():
    emb = _emb(_w0())
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05, weight_decay=0.1)
    ids, coef = _batches(3, steps=1)[0]
    _lib_step(emb, opt, ids, coef)
    w, sd = _weight(emb), copy.deepcopy(opt.state_dict())
    opt.step()
    _assert_same(_weight(emb), w)
    sd2 = opt.state_dict()
    for k, t in sd["tables"][0].items():
        _assert_same(sd2["tables"][0][k], t, k)
    assert [float(s["step"]) for s in sd2["inner"]["state"].values()] == [1.0]


# ---------------------------------------------------------------- options changed mid-training


MID_CASES = [
    (A, dict(lr=0.05), {1: dict(lr=0.2), 2: dict(betas=(0.5, 0.8)), 3: dict(weight_decay=0.3)}),
    (
        AW,
        dict(lr=0.05, amsgrad=True),
        {1: dict(weight_decay=0.0), 2: dict(lr=0.001, betas=(0.95, 0.9))},
    ),
    (NA, dict(lr=0.05), {2: dict(weight_decay=0.2, lr=0.1), 3: dict(betas=(0.6, 0.7))}),
    (RA, dict(lr=0.05), {1: dict(weight_decay=0.1), 2: dict(betas=(0.5, 0.6))}),
    (AM, dict(lr=0.05), {1: dict(lr=0.5), 3: dict(betas=(0.1, 0.2))}),
    (SGD, dict(lr=0.05), {1: dict(momentum=0.9), 3: dict(nesterov=True, lr=0.01)}),
    (SGD, dict(lr=0.05, momentum=0.9), {2: dict(weight_decay=0.2, maximize=True)}),
    (AG, dict(lr=0.1), {1: dict(lr=0.3, weight_decay=0.1), 2: dict(lr_decay=0.2)}),
    (RMS, dict(lr=0.01, centered=True), {1: dict(alpha=0.5), 2: dict(lr=0.1, weight_decay=0.1)}),
    (RP, dict(lr=0.01), {1: dict(etas=(0.1, 3.0)), 2: dict(step_sizes=(0.01, 0.02))}),
    (ASGD, dict(lr=0.05), {1: dict(lr=0.2, lambd=0.1), 2: dict(weight_decay=0.2)}),
    (AD, dict(lr=1.0), {1: dict(rho=0.5), 2: dict(lr=0.1, weight_decay=0.2)}),
    (SA, dict(lr=0.05), {1: dict(lr=0.5), 2: dict(betas=(0.5, 0.5))}),
    (
        A,
        dict(lr=0.05, foreach=True, amsgrad=True),
        {1: dict(maximize=True), 2: dict(foreach=False, eps=1e-2)},
    ),
    (
        NA,
        dict(lr=0.05),
        {1: dict(momentum_decay=0.1), 2: dict(decoupled_weight_decay=True, weight_decay=0.2)},
    ),
]


@pytest.mark.parametrize(
    "case",
    MID_CASES,
    ids=lambda c: c[0].__name__ + "-" + str(sorted(k for ch in c[2].values() for k in ch)),
)
def test_param_groups_changed_mid_training(case):
    cls, opts, changes = case
    w0 = _w0(8)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    ref = LazyRef(w0, cls, **opts)
    cur = dict(opts)
    for i, (ids, coef) in enumerate(_batches(21, steps=5)):
        if i in changes:
            for k, v in changes[i].items():
                opt.param_groups[0][k] = v
            cur.update(changes[i])
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef, cur)
    _assert_same(_weight(emb), ref.W, "weights")
    _compare_state(opt, ref)


def test_numpy_momentum_turned_on_adds_table_and_matches():
    # README: "options given as NumPy numbers count as their values (turning momentum on with
    # np.float32(0.9) adds its table)"
    w0 = _w0(9)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=np.float64(0.05))
    ref = LazyRef(w0, SGD, lr=0.05)
    bs = _batches(22, steps=4)
    _lib_step(emb, opt, *bs[0])
    ref.step(*bs[0])
    assert "momentum_buffer" not in _tables(opt)[0]
    opt.param_groups[0]["momentum"] = np.float32(0.9)
    for ids, coef in bs[1:]:
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef, dict(lr=0.05, momentum=float(np.float32(0.9))))
    assert "momentum_buffer" in _tables(opt)[0]
    _assert_same(_weight(emb), ref.W)
    _compare_state(opt, ref)


@pytest.mark.parametrize(
    "cls,opts",
    [
        (
            A,
            dict(
                lr=np.float32(0.05),
                betas=(np.float64(0.8), np.float64(0.9)),
                weight_decay=np.float64(0.1),
            ),
        ),
        (SGD, dict(lr=np.float64(0.05), momentum=np.float32(0.9), dampening=np.float64(0.0))),
        (RMS, dict(lr=np.float32(0.01), alpha=np.float64(0.9), momentum=np.float32(0.5))),
    ],
)
def test_numpy_number_options_count_as_values(cls, opts):
    plain = {
        k: (tuple(float(x) for x in v) if isinstance(v, tuple) else float(v))
        for k, v in opts.items()
    }
    w0 = _w0(10)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    ref = LazyRef(w0, cls, **plain)
    for ids, coef in _batches(23, steps=3):
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef)
    _assert_same(_weight(emb), ref.W)


# ------------------------------------------------------------------------------ LR schedulers


def _sched_run(cls, opts, make_sched, steps=5, seed=31):
    w0 = _w0(seed)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    sched = make_sched(opt)
    dummy_p = torch.nn.Parameter(torch.zeros(1))
    dummy = cls([dummy_p], **opts)
    dsched = make_sched(dummy)
    ref = LazyRef(w0, cls, **opts)
    lrs = []
    for ids, coef in _batches(seed, steps=steps):
        cur = {
            k: v
            for k, v in dummy.param_groups[0].items()
            if k in opts or k in ("lr", "betas", "momentum")
        }
        cur = {
            k: v
            for k, v in cur.items()
            if k
            not in ("initial_lr", "max_lr", "min_lr", "base_lr", "max_momentum", "base_momentum")
        }
        assert opt.param_groups[0]["lr"] == cur["lr"]
        lrs.append(cur["lr"])
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef, cur)
        sched.step()
        dummy.step()
        dsched.step()
    _assert_same(_weight(emb), ref.W, "weights")
    _compare_state(opt, ref)
    assert len(set(lrs)) > 1
    return opt


SCHED_CASES = [
    (
        "StepLR-Adam",
        A,
        dict(lr=0.05, amsgrad=True),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.1),
    ),
    (
        "Exp-AdamW",
        AW,
        dict(lr=0.05, weight_decay=0.1),
        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.5),
    ),
    (
        "Lambda-Adagrad",
        AG,
        dict(lr=0.1, lr_decay=0.01),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    ),
    (
        "Cosine-RMSprop",
        RMS,
        dict(lr=0.02, momentum=0.5, centered=True),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
    ),
    (
        "LinearWarmup-Rprop",
        RP,
        dict(lr=0.02),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
    ),
    (
        "LinearWarmup-ASGD",
        ASGD,
        dict(lr=0.05, t0=1.0),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
    ),
    (
        "OneCycle-Adam",
        A,
        dict(lr=0.05),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6),
    ),
    (
        "OneCycle-NAdam",
        NA,
        dict(lr=0.05),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6),
    ),
    (
        "OneCycle-SGD-momentum-off",
        SGD,
        dict(lr=0.05),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6),
    ),
    (
        "CyclicLR-SGD",
        SGD,
        dict(lr=0.05, momentum=0.9),
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=2),
    ),
    (
        "OneCycle-RMSprop-momentum-off",
        RMS,
        dict(lr=0.01, centered=True),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6),
    ),
    ("Exp-SparseAdam", SA, dict(lr=0.05), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.7)),
    ("Step-Adadelta", AD, dict(lr=1.0), lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)),
]


@pytest.mark.parametrize("name,cls,opts,mk", SCHED_CASES, ids=[c[0] for c in SCHED_CASES])
def test_lr_scheduler_matches_reference(name, cls, opts, mk):
    _sched_run(cls, opts, mk)


def test_onecycle_turns_sgd_momentum_on_and_pages_it():
    opt = _sched_run(
        SGD,
        dict(lr=0.05),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6),
    )
    assert "momentum_buffer" in _tables(opt)[0]
    assert opt.param_groups[0]["momentum"] > 0


def test_rprop_step_size_starts_from_first_steps_lr():
    # README: "before the first step Rprop's step_size and ASGD's eta start from the first step's lr"
    emb = _emb(_w0())
    opt = gl.OffloadedOptimizer(torch.optim.Rprop, emb, lr=1.0)
    opt.param_groups[0]["lr"] = 0.125
    ids, coef = _batches(4, steps=1)[0]
    _lib_step(emb, opt, ids, coef)
    t = _tables(opt)[0]["step_size"]
    used = torch.unique(torch.cat(ids))
    assert torch.all(t[used] == 0.125)


def test_asgd_eta_starts_from_first_steps_lr():
    w0 = _w0(12)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(torch.optim.ASGD, emb, lr=1.0, lambd=0.5)
    opt.param_groups[0]["lr"] = 0.25
    ref = LazyRef(w0, ASGD, lr=0.25, lambd=0.5)
    for ids, coef in _batches(6, steps=2):
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef)
    eta = [s["eta"] for s in opt.state_dict()["inner"]["state"].values()]
    assert len(eta) == 1
    _assert_same(torch.as_tensor(eta[0]), ref.scalars["eta"], "eta")
    _assert_same(_weight(emb), ref.W)


# ------------------------------------------------------------------------ groups and subclasses


@pytest.mark.parametrize(
    "cls,opts,g1",
    [
        (A, dict(lr=0.01), dict(lr=0.2, weight_decay=0.1, amsgrad=True)),
        (SGD, dict(lr=0.01), dict(lr=0.2, momentum=0.9, nesterov=True)),
        (RMS, dict(lr=0.01), dict(momentum=0.9, centered=True)),
        (AG, dict(lr=0.1), dict(initial_accumulator_value=1.0, lr_decay=0.1)),
        (AG, dict(lr=0.1), dict(lr_decay=0.1, eps=1e-3)),
        (RP, dict(lr=0.01), dict(lr=0.05, etas=(0.3, 1.5))),
        (ASGD, dict(lr=0.05), dict(lr=0.2, t0=1.0, lambd=0.01)),
        (SA, dict(lr=0.05), dict(lr=0.3, betas=(0.5, 0.8))),
        (
            NA,
            dict(lr=0.05),
            dict(momentum_decay=0.1, decoupled_weight_decay=True, weight_decay=0.1),
        ),
    ],
)
def test_table_in_own_param_group_uses_its_options(cls, opts, g1):
    w1, w2 = _w0(13), _w0(14)
    e1, e2 = _emb(w1), _emb(w2)
    opt = gl.OffloadedOptimizer(cls, [{"params": e1, **g1}, {"params": e2}], **opts)
    r1, r2 = LazyRef(w1, cls, group=g1, **opts), LazyRef(w2, cls, **opts)
    for ids, coef in _batches(15, steps=4):
        opt.zero_grad()
        _loss([e1(ids[0]), e2(ids[1])], coef).backward()
        opt.step()
        r1.step(ids[:1], coef[:1])
        r2.step(ids[1:], coef[1:])
    _assert_same(_weight(e1), r1.W, "group table")
    _assert_same(_weight(e2), r2.W, "default table")
    for k, v in g1.items():
        assert opt.param_groups[0][k] == v


@pytest.mark.parametrize(
    "cls,opts",
    [
        (A, dict(lr=0.05, amsgrad=True)),
        (AG, dict(lr=0.1, initial_accumulator_value=0.3)),
        (RP, dict(lr=0.03)),
    ],
)
def test_add_param_group_table_starts_fresh(cls, opts):
    w1, w2 = _w0(16), _w0(17)
    e1, e2 = _emb(w1), _emb(w2)
    opt = gl.OffloadedOptimizer(cls, e1, **opts)
    r1 = LazyRef(w1, cls, **opts)
    bs = _batches(18, steps=4)
    for ids, coef in bs[:2]:
        _lib_step(e1, opt, ids[:1], coef[:1])
        r1.step(ids[:1], coef[:1])
    opt.add_param_group({"params": e2, "lr": 0.2})
    r2 = LazyRef(w2, cls, **{**opts, "lr": 0.2})
    for ids, coef in bs[2:]:
        opt.zero_grad()
        _loss([e1(ids[0]), e2(ids[1])], coef).backward()
        opt.step()
        r1.step(ids[:1], coef[:1])
        r2.step(ids[1:], coef[1:])
    _assert_same(_weight(e1), r1.W, "first table")
    _assert_same(_weight(e2), r2.W, "added table")


@pytest.mark.parametrize(
    "cls,opts",
    [
        (A, dict(lr=0.05, betas=(0.7, 0.9), amsgrad=True)),
        (RMS, dict(lr=0.01, momentum=0.9, centered=True)),
    ],
)
def test_subclass_passing_kwargs_is_probed_with_its_options(cls, opts):
    # README: "A subclass of one of them is probed with its group's options, also when its
    # __init__ passes them on as **kwargs"
    class Sub(cls):
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)

    w0 = _w0(19)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(Sub, emb, **opts)
    ref = LazyRef(w0, cls, **opts)
    for ids, coef in _batches(19, steps=3):
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef)
    _assert_same(_weight(emb), ref.W)
    _compare_state(opt, ref)


def test_table_with_ordinary_parameters_in_same_group():
    w0 = _w0(20)
    torch.manual_seed(0)
    head = torch.nn.Linear(D, 1)
    head_ref = copy.deepcopy(head)
    emb = _emb(w0)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opts = dict(lr=0.05, weight_decay=0.1, amsgrad=True)
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, **opts)
    ref_opt = torch.optim.AdamW(head_ref.parameters(), **opts)
    ref = LazyRef(w0, AW, **opts)
    for ids, _coef in _batches(24, steps=3):
        opt.zero_grad()
        head(emb(ids[0])).pow(2).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        u = torch.unique(ids[0])
        pu = torch.nn.Parameter(ref.W[u].clone())
        head_ref(F.embedding(torch.searchsorted(u, ids[0]), pu)).pow(2).sum().backward()
        ref_opt.step()
        # the table's rows with the head's gradient
        ref_coef_grad = pu.grad.clone()
        sub = AW([pu], **opts)
        if ref.scalars:
            sub.state[pu] = {
                **{k: v.clone() for k, v in ref.scalars.items()},
                **{k: t[u].clone() for k, t in ref.rows.items()},
            }
        sub.step()
        for k, v in sub.state[pu].items():
            if v.shape == pu.shape:
                ref.rows.setdefault(k, torch.zeros_like(ref.W))[u] = v
            else:
                ref.scalars = ref.scalars or {}
                ref.scalars[k] = v.clone()
        ref.W[u] = pu.detach()
        assert ref_coef_grad.abs().sum() > 0
    _assert_same(_weight(emb), ref.W, "table")
    for a, b in zip(head.parameters(), head_ref.parameters(), strict=True):
        _assert_same(a.detach(), b.detach(), "head")


# ------------------------------------------------------------------------- state_dict round trips


RT_CASES = [
    (A, dict(lr=0.05, amsgrad=True, weight_decay=0.1, betas=(0.8, 0.9))),
    (NA, dict(lr=0.05, momentum_decay=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    (RA, dict(lr=0.05, decoupled_weight_decay=True, weight_decay=0.1)),
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (AG, dict(lr=0.1, lr_decay=0.05, initial_accumulator_value=0.3)),
    (RMS, dict(lr=0.01, momentum=0.9, centered=True, alpha=0.8)),
    (RP, dict(lr=0.02, etas=(0.4, 1.3), step_sizes=(1e-4, 0.05))),
    (ASGD, dict(lr=0.05, lambd=0.01, alpha=0.5, t0=2.0)),
    (AD, dict(lr=0.5, rho=0.7, weight_decay=0.1)),
    (SA, dict(lr=0.05, betas=(0.7, 0.95))),
]


@pytest.mark.parametrize("case", RT_CASES, ids=_case_id)
def test_state_dict_round_trip_preserves_options_and_continues_identically(case):
    cls, opts = case
    w0 = _w0(25)
    bs = _batches(26, steps=5)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    for ids, coef in bs[:3]:
        _lib_step(emb, opt, ids, coef)
    sd = copy.deepcopy(opt.state_dict())
    wsd = copy.deepcopy(emb.state_dict())
    # a fresh model built with other options; loading restores the saved ones
    other = dict(opts, lr=opts["lr"] * 7)
    emb2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt2 = gl.OffloadedOptimizer(cls, emb2, **other)
    emb2.load_state_dict(wsd)
    opt2.load_state_dict(sd)
    for k, v in opts.items():
        assert opt2.param_groups[0][k] == v, k
    assert opt2.param_groups[0]["lr"] == opts["lr"]
    for ids, coef in bs[3:]:
        _lib_step(emb, opt, ids, coef)
        _lib_step(emb2, opt2, ids, coef)
    _assert_same(_weight(emb2), _weight(emb), "weights after resume")
    t1, t2 = _tables(opt)[0], _tables(opt2)[0]
    assert sorted(t1) == sorted(t2)
    for k in t1:
        _assert_same(t2[k], t1[k], k)
    s1 = opt.state_dict()["inner"]["state"]
    s2 = opt2.state_dict()["inner"]["state"]
    assert len(s1) == len(s2)
    for a, b in zip(s1.values(), s2.values(), strict=True):
        for k in a:
            _assert_same(torch.as_tensor(b[k]), torch.as_tensor(a[k]), k)


def test_state_dict_round_trip_after_scheduler_changed_options():
    w0 = _w0(27)
    bs = _batches(28, steps=5)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8)
    for ids, coef in bs[:3]:
        _lib_step(emb, opt, ids, coef)
        sched.step()
    sd, ssd, wsd = (
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(sched.state_dict()),
        copy.deepcopy(emb.state_dict()),
    )
    emb2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.05)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=8)
    emb2.load_state_dict(wsd)
    opt2.load_state_dict(sd)
    sched2.load_state_dict(ssd)
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for ids, coef in bs[3:]:
        _lib_step(emb, opt, ids, coef)
        sched.step()
        _lib_step(emb2, opt2, ids, coef)
        sched2.step()
    _assert_same(_weight(emb2), _weight(emb))


def test_state_dict_with_momentum_loads_into_optimizer_without_it():
    # README: "A state dict or checkpoint holding state the optimizer has not turned on yet (a
    # scheduler's momentum) loads, and that state is paged from then on."
    w0 = _w0(29)
    bs = _batches(30, steps=4)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.05, momentum=0.9)
    for ids, coef in bs[:2]:
        _lib_step(emb, opt, ids, coef)
    sd, wsd = copy.deepcopy(opt.state_dict()), copy.deepcopy(emb.state_dict())
    emb2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb2, lr=0.05)
    emb2.load_state_dict(wsd)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["momentum"] == 0.9
    for ids, coef in bs[2:]:
        _lib_step(emb, opt, ids, coef)
        _lib_step(emb2, opt2, ids, coef)
    _assert_same(_weight(emb2), _weight(emb))
    _assert_same(_tables(opt2)[0]["momentum_buffer"], _tables(opt)[0]["momentum_buffer"])


@pytest.mark.parametrize("src,dst", [(A, NA), (A, AW), (AW, A), (SGD, RMS), (AG, RP), (SA, A)])
def test_state_dict_of_other_class_refused_and_nothing_changes(src, dst):
    # README: "state saved by another class (Adam's into NAdam) is refused before anything changes"
    bs = _batches(31, steps=2)
    e1 = _emb(_w0(32))
    o1 = gl.OffloadedOptimizer(src, e1, lr=0.05)
    _lib_step(e1, o1, *bs[0])
    e2 = _emb(_w0(33))
    o2 = gl.OffloadedOptimizer(dst, e2, lr=0.01)
    _lib_step(e2, o2, *bs[1])
    before = copy.deepcopy(o2.state_dict())
    w_before = _weight(e2)
    with pytest.raises(gl.GadgetError):
        o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    after = o2.state_dict()
    assert after["inner"]["param_groups"] == before["inner"]["param_groups"]
    for k, t in before["tables"][0].items():
        _assert_same(after["tables"][0][k], t, k)
    _assert_same(_weight(e2), w_before)


# ------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("cls", [A, SGD, RMS, AG, RP, ASGD])
def test_differentiable_true_refused_with_gadget_type_error(cls):
    # README: "`differentiable=True` is refused (paged rows are updated in place outside autograd)";
    # Errors: GadgetTypeError for "optimizer options that cannot be paged"
    w0 = _w0(34)
    emb = _emb(w0)
    with pytest.raises(gl.GadgetTypeError, match="differentiable"):
        gl.OffloadedOptimizer(cls, emb, lr=0.01, differentiable=True)
    _assert_same(_weight(emb), w0)
    # the table is still free for an optimizer
    opt = gl.OffloadedOptimizer(cls, emb, lr=0.01)
    ref = LazyRef(w0, cls, lr=0.01)
    ids, coef = _batches(35, steps=1)[0]
    _lib_step(emb, opt, ids, coef)
    ref.step(ids, coef)
    _assert_same(_weight(emb), ref.W)


@pytest.mark.parametrize("cls", [A, NA, RA, ASGD])
def test_capturable_on_cpu_refused_as_failing_probe(cls):
    # README: "... as is any option with which a step fails on a one-row probe" (torch's capturable
    # step asserts on CPU tensors); Errors: GadgetTypeError for options that cannot be paged.
    w0 = _w0(36)
    emb = _emb(w0)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(cls, emb, lr=0.01, capturable=True)
    _assert_same(_weight(emb), w0)


def test_differentiable_set_later_through_param_groups_refused():
    w0 = _w0(37)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)
    bs = _batches(38, steps=2)
    _lib_step(emb, opt, *bs[0])
    w, tabs = _weight(emb), copy.deepcopy(_tables(opt))
    opt.param_groups[0]["differentiable"] = True
    opt.zero_grad()
    _loss([emb(i) for i in bs[1][0]], bs[1][1]).backward()
    with pytest.raises(gl.GadgetTypeError):
        opt.step()
    _assert_same(_weight(emb), w)
    for k, t in tabs[0].items():
        _assert_same(_tables(opt)[0][k], t, k)


class _MyOpt(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-g["lr"])


#: Adafactor arrived in torch 2.5
_UNSUPPORTED = [
    c for c in (torch.optim.LBFGS, getattr(torch.optim, "Adafactor", None), _MyOpt) if c is not None
]


@pytest.mark.parametrize("cls", _UNSUPPORTED, ids=[c.__name__ for c in _UNSUPPORTED])
def test_unsupported_optimizer_refused_naming_supported_list(cls):
    # README: "others are refused with this list"
    w0 = _w0(39)
    emb = _emb(w0)
    with pytest.raises(gl.GadgetError) as ei:
        gl.OffloadedOptimizer(cls, emb, lr=0.01)
    msg = str(ei.value)
    for name in gl.SUPPORTED_OPTIMIZERS:
        assert name in msg, (name, msg)
    _assert_same(_weight(emb), w0)
    # the refusal did not keep the table: a supported optimizer can take it
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    ids, coef = _batches(40, steps=1)[0]
    _lib_step(emb, opt, ids, coef)
    ref = LazyRef(w0, SGD, lr=0.1)
    ref.step(ids, coef)
    _assert_same(_weight(emb), ref.W)


@pytest.mark.parametrize("cls", _UNSUPPORTED, ids=[c.__name__ for c in _UNSUPPORTED])
def test_unsupported_optimizer_error_is_type_error(cls):
    # Errors section: GadgetTypeError covers "optimizer options that cannot be paged"; an
    # unsupported optimizer class is the same kind of refusal (the docs name no other type).
    emb = _emb(_w0(41))
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(cls, emb, lr=0.01)


def test_sgd_dampening_refused_with_ordinary_params_when_fused():
    # README: "Fused SGD with momentum trains tables beside ordinary parameters with dampening=0
    # (exactly as torch); with dampening != 0 that mix is refused by the first step() (a
    # GadgetValueError; nothing is changed)."
    w0 = _w0(42)
    emb = _emb(w0)
    torch.manual_seed(1)
    head = torch.nn.Linear(D, 1)
    hw = [p.detach().clone() for p in head.parameters()]
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD, model, lr=0.1, momentum=0.9, dampening=0.5, fused=True
    )
    ids = torch.tensor([1, 2, 2, 5])
    head(emb(ids)).sum().backward()
    with pytest.raises(gl.GadgetValueError):
        opt.step()
    _assert_same(_weight(emb), w0)
    for a, b in zip(head.parameters(), hw, strict=True):
        _assert_same(a.detach(), b)
    assert all(torch.count_nonzero(t) == 0 for t in _tables(opt)[0].values())


def test_fused_sgd_momentum_with_ordinary_params_dampening_zero_exact():
    w0 = _w0(43)
    emb = _emb(w0)
    torch.manual_seed(2)
    head = torch.nn.Linear(D, 1)
    head_ref = copy.deepcopy(head)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opts = dict(lr=0.1, momentum=0.9, fused=True)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, **opts)
    dense = torch.nn.Embedding(N, D)
    with torch.no_grad():
        dense.weight.copy_(w0)
    ref_opt = torch.optim.SGD(list(head_ref.parameters()) + [dense.weight], **opts)
    for ids, _ in _all_rows_batches(44, steps=3):
        opt.zero_grad()
        head(emb(ids[0])).pow(2).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        head_ref(dense(ids[0])).pow(2).sum().backward()
        ref_opt.step()
    _assert_same(_weight(emb), dense.weight.detach())
    for a, b in zip(head.parameters(), head_ref.parameters(), strict=True):
        _assert_same(a.detach(), b.detach())


@pytest.mark.parametrize("how", ["constructor-dict", "add_param_group"])
def test_adagrad_initial_accumulator_value_from_param_group_as_torch(how):
    # docstring: a param-group dict naming an offloaded module: "their tables then take that
    # group's options"; torch's own Adagrad starts `sum` from its constructor argument (not the
    # group's initial_accumulator_value) -- the paged state must start as torch's does.
    w1, w2 = _w0(45), _w0(46)
    e1, e2 = _emb(w1), _emb(w2)
    if how == "constructor-dict":
        opt = gl.OffloadedOptimizer(
            torch.optim.Adagrad,
            [{"params": e2, "initial_accumulator_value": 2.0}, {"params": e1}],
            lr=0.1,
        )
    else:
        opt = gl.OffloadedOptimizer(torch.optim.Adagrad, e1, lr=0.1)
        opt.add_param_group({"params": e2, "initial_accumulator_value": 2.0})
    p = torch.nn.Parameter(w2.clone())
    tref = torch.optim.Adagrad([{"params": [p], "initial_accumulator_value": 2.0}], lr=0.1)
    sums = [t["sum"] for t in _tables(opt) if "sum" in t]
    assert len(sums) == 2
    assert any(torch.equal(s, tref.state[p]["sum"]) for s in sums), [s[0] for s in sums]


@pytest.mark.parametrize(
    "cls,opts",
    [
        (A, dict(lr=0.05, amsgrad=True)),
        (RMS, dict(lr=0.01, centered=True)),
        (SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    ],
)
def test_zero_grad_discards_lookups_before_step(cls, opts):
    w0 = _w0(47)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    ref = LazyRef(w0, cls, **opts)
    bs = _batches(48, steps=4)
    for k in range(0, 4, 2):
        (ids_a, coef_a), (ids_b, coef_b) = bs[k], bs[k + 1]
        _loss([emb(i) for i in ids_a], coef_a).backward()  # discarded
        _lib_step(emb, opt, ids_b, coef_b)  # zero_grad first, then this lookup
        ref.step(ids_b, coef_b)
    _assert_same(_weight(emb), ref.W)
    _compare_state(opt, ref)


@pytest.mark.parametrize(
    "cls,opts",
    [
        (A, dict(lr=0.05, weight_decay=0.1)),
        (AD, dict(lr=0.5, rho=0.6)),
        (ASGD, dict(lr=0.05, t0=1.0)),
    ],
)
def test_gradient_accumulation_two_backwards_matches_reference(cls, opts):
    # README: gradients of several backward passes are summed as torch's autograd sums them
    # ("bit-identical to a dense nn.Embedding trained the same way")
    w0 = _w0(49)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(cls, emb, **opts)
    W = w0.clone()
    rows, scal = {}, None
    for ids, coef in _batches(50, steps=3):
        opt.zero_grad()
        for i, c in zip(ids, coef, strict=True):
            _loss([emb(i)], [c]).backward()
        opt.step()
        u = torch.unique(torch.cat(ids))
        p = torch.nn.Parameter(W[u].clone())
        o = cls([p], **opts)
        if scal is not None:
            o.state[p] = {
                **{k: v.clone() for k, v in scal.items()},
                **{k: t[u].clone() for k, t in rows.items()},
            }
        for i, c in zip(ids, coef, strict=True):
            _loss([F.embedding(torch.searchsorted(u, i), p)], [c]).backward()
        o.step()
        scal = {}
        for k, v in o.state[p].items():
            if v.shape == p.shape:
                rows.setdefault(k, torch.zeros_like(W))[u] = v
            else:
                scal[k] = v.clone()
        W[u] = p.detach()
    _assert_same(_weight(emb), W)


def test_state_tables_are_pagers_tables_and_match_state_dict():
    emb = _emb(_w0(51))
    opt = gl.OffloadedOptimizer(torch.optim.RMSprop, emb, lr=0.01, momentum=0.9, centered=True)
    ids, coef = _batches(52, steps=1)[0]
    _lib_step(emb, opt, ids, coef)
    tabs = opt.pagers[0].tables
    assert sorted(tabs) == sorted(["square_avg", "momentum_buffer", "grad_avg"])
    sd = _tables(opt)[0]
    for k, g in tabs.items():
        _assert_same(torch.as_tensor(g.numpy()), sd[k], k)
    assert gl.SUPPORTED_OPTIMIZERS == gl.switching.SUPPORTED_OPTIMIZERS


@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(cls=SGD, lr=0.1, nesterov=True), ValueError),
        (dict(cls=A, lr=-1.0), ValueError),
        (dict(cls=A, lr=0.1, foreach=True, fused=True), RuntimeError),
        (dict(cls=SA, lr=0.1, weight_decay=0.1), TypeError),
    ],
)
def test_torch_option_errors_leave_table_free(kw, exc):
    """An option torch itself rejects raises torch's error; the table is not kept by the failed build."""
    kw = dict(kw)
    cls = kw.pop("cls")
    w0 = _w0(53)
    emb = _emb(w0)
    with pytest.raises(exc):
        gl.OffloadedOptimizer(cls, emb, **kw)
    _assert_same(_weight(emb), w0)
    opt = gl.OffloadedOptimizer(cls, emb, lr=0.1)
    ref = LazyRef(w0, cls, lr=0.1)
    ids, coef = _batches(54, steps=1)[0]
    _lib_step(emb, opt, ids, coef)
    ref.step(ids, coef)
    _assert_same(_weight(emb), ref.W)


@pytest.mark.parametrize(
    "cls,opts",
    [
        (A, dict(lr=0.05, amsgrad=True, betas=(0.7, 0.9))),
        (RMS, dict(lr=0.01, momentum=0.9, centered=True)),
        (ASGD, dict(lr=0.05, t0=1.0, lambd=0.01)),
    ],
)
def test_checkpoint_round_trip_keeps_options_and_continues(cls, opts, tmp_path):
    w0 = _w0(55)
    bs = _batches(56, steps=5)
    model = torch.nn.ModuleDict({"emb": _emb(w0)})
    opt = gl.OffloadedOptimizer(cls, model, **opts)
    for ids, coef in bs[:3]:
        _lib_step(model["emb"], opt, ids, coef)
    gl.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt}, format="npy")
    model2 = torch.nn.ModuleDict(
        {"emb": gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")}
    )
    opt2 = gl.OffloadedOptimizer(cls, model2, **dict(opts, lr=1.0))
    gl.load_checkpoint(tmp_path / "ck", {"model": model2, "optimizer": opt2})
    for k, v in opts.items():
        assert opt2.param_groups[0][k] == v, k
    for ids, coef in bs[3:]:
        _lib_step(model["emb"], opt, ids, coef)
        _lib_step(model2["emb"], opt2, ids, coef)
    _assert_same(_weight(model2["emb"]), _weight(model["emb"]))


def test_state_dict_round_trip_two_tables_two_groups():
    w1, w2 = _w0(57), _w0(58)
    bs = _batches(59, steps=5)

    def build(lr_scale):
        e1 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
        e2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
        o = gl.OffloadedOptimizer(
            torch.optim.NAdam,
            [{"params": e1, "lr": 0.2 * lr_scale, "momentum_decay": 0.01}, {"params": e2}],
            lr=0.05 * lr_scale,
            weight_decay=0.1,
        )
        return e1, e2, o

    e1, e2, o = build(1)
    e1.load_state_dict({"weight": w1})
    e2.load_state_dict({"weight": w2})
    for ids, coef in bs[:3]:
        o.zero_grad()
        _loss([e1(ids[0]), e2(ids[1])], coef).backward()
        o.step()
    sd = copy.deepcopy(o.state_dict())
    f1, f2, p = build(3)
    f1.load_state_dict(copy.deepcopy(e1.state_dict()))
    f2.load_state_dict(copy.deepcopy(e2.state_dict()))
    p.load_state_dict(sd)
    assert [g["lr"] for g in p.param_groups] == [0.2, 0.05]
    assert p.param_groups[0]["momentum_decay"] == 0.01
    for ids, coef in bs[3:]:
        for a, b, oo in ((e1, e2, o), (f1, f2, p)):
            oo.zero_grad()
            _loss([a(ids[0]), b(ids[1])], coef).backward()
            oo.step()
    _assert_same(_weight(f1), _weight(e1), "table 1")
    _assert_same(_weight(f2), _weight(e2), "table 2")


def test_state_dict_with_other_group_layout_refused_nothing_changes():
    e1, e2 = _emb(_w0(60)), _emb(_w0(61))
    o = gl.OffloadedOptimizer(
        torch.optim.Adam, [{"params": e1, "lr": 0.2}, {"params": e2}], lr=0.05
    )
    bs = _batches(62, steps=1)
    o.zero_grad()
    _loss([e1(bs[0][0][0]), e2(bs[0][0][1])], bs[0][1]).backward()
    o.step()
    f1, f2 = _emb(_w0(63)), _emb(_w0(64))
    p = gl.OffloadedOptimizer(torch.optim.Adam, torch.nn.ModuleList([f1, f2]), lr=0.01)
    p.zero_grad()
    _loss([f1(bs[0][0][0]), f2(bs[0][0][1])], bs[0][1]).backward()
    p.step()
    before = copy.deepcopy(p.state_dict())
    with pytest.raises(gl.GadgetError):
        p.load_state_dict(copy.deepcopy(o.state_dict()))
    after = p.state_dict()
    assert after["inner"]["param_groups"] == before["inner"]["param_groups"]
    for i in range(2):
        for k, t in before["tables"][i].items():
            _assert_same(after["tables"][i][k], t, k)


def test_tensor_lr_changed_in_place_mid_training():
    w0 = _w0(65)
    emb = _emb(w0)
    lr = torch.tensor(0.05)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=lr, weight_decay=0.1)
    ref = LazyRef(w0, A, lr=torch.tensor(0.05), weight_decay=0.1)
    for i, (ids, coef) in enumerate(_batches(66, steps=4)):
        if i == 2:
            opt.param_groups[0]["lr"].fill_(0.2)
            ref.opts["lr"] = torch.tensor(0.2)
        _lib_step(emb, opt, ids, coef)
        ref.step(ids, coef)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.2)
    _assert_same(_weight(emb), ref.W)
    _compare_state(opt, ref)
