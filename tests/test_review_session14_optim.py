"""Review (session 14): offloaded tables and the switchers trained with torch optimizers under
options a demanding user sets, each against a dense reference.

The reference is a dense torch parameter holding the whole table, trained by the same torch
optimizer with the same options; README "Duplicates": "results equal training the whole table
as one parameter with lazy per-row updates (rows outside a batch untouched, one step count per
table as in torch's SparseAdam)". So after each reference step the rows outside the step's ids
get back their weights and row-shaped state (``LazyDense``), and a table without a lookup is not
stepped at all (its dense gradient is ``None``, so torch counts no step for it either).

Covered here, beyond the earlier review files: param groups whose *structural* options differ
per table (amsgrad, momentum, centered, etas, t0 ...), step counts that diverge between tables
(NAdam's ``mu_product``, ASGD's ``eta`` / ``mu``, Adagrad's ``lr_decay``, bias corrections),
hyper-parameters other than ``lr`` changed in ``param_groups`` mid-training (betas, maximize,
etas, momentum off and on), ``foreach`` on and off giving the same table, ``add_param_group``
with options that create state, ``clip_grad_norm_`` over ``model.parameters()`` (which README
says does not reach the tables), tables of two dtypes in one optimizer, state-dict round trips
mid-training with diverging step counts, empty batches, and the switchers (SpeedTorch names and
the ``Pytorch*`` faces) with the same options and groups.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gadgetloader as gl

N, D, B = 50, 4, 6
F32, F64 = torch.float32, torch.float64
TOL = {"rtol": 1e-5, "atol": 1e-6}
TOL64 = {"rtol": 1e-10, "atol": 1e-12}


def asgd_tol(name: str, placement: str, tol: dict[str, float]) -> dict[str, float]:
    """The tolerance against the CPU reference. torch's ASGD on CUDA computes its factors
    from ``eta`` / ``mu`` as float32 device tensors where its CPU path takes them as Python
    floats, so a CUDA run differs from the CPU reference by float32 rounding (measured on
    the H200: up to 7e-6 relative in float64 and 1e-4 in float32 on small values) --
    torch's own difference between its CPU and CUDA code, not the paging's."""
    if name == "ASGD" and placement != "cpu":
        return {"rtol": 3e-5, "atol": 2e-7} if tol is TOL64 else {"rtol": 2e-4, "atol": 5e-6}
    return tol


CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def dev_of(placement: str) -> torch.device:
    return CPU if placement == "cpu" else torch.device("cuda")


def tol_of(dtype: torch.dtype) -> dict[str, float]:
    return TOL64 if dtype == F64 else TOL


def w0(seed: int, dtype: torch.dtype = F32, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=F64).to(dtype)


def off_emb(w: torch.Tensor, placement: str = "cpu") -> gl.OffloadedEmbedding:
    return gl.OffloadedEmbedding(
        w.shape[0],
        D,
        placement=placement,
        dtype=w.dtype,
        device=dev_of(placement),
        init=lambda t: t.copy_(w.to(t.device)),
    )


def off_bag(w: torch.Tensor, mode: str = "sum", placement: str = "cpu") -> gl.OffloadedEmbeddingBag:
    return gl.OffloadedEmbeddingBag(
        w.shape[0],
        D,
        mode=mode,
        placement=placement,
        dtype=w.dtype,
        device=dev_of(placement),
        init=lambda t: t.copy_(w.to(t.device)),
    )


def table(m) -> torch.Tensor:
    """An offloaded module's whole table, copied to the CPU."""
    return m.weight.as_tensor().detach().to("cpu", copy=True)


def fresh_row(name: str, key: str, group: dict, like: torch.Tensor) -> torch.Tensor:
    """The state row torch gives a row that was never trained."""
    if name == "Rprop" and key == "step_size":
        return torch.full_like(like, float(group["lr"]))
    return torch.zeros_like(like)


class LazyDense:
    """A torch optimizer over dense full tables (``tables``) and ordinary parameters; after each
    step the rows of each table outside that step's ids get back their weights and row state.
    ``used[i] is None`` means table ``i`` had no lookup: its gradient is dropped, so torch does
    not step it (no step counted)."""

    def __init__(self, name: str, opt: torch.optim.Optimizer, tables: list[torch.Tensor]):
        self.name, self.opt, self.tables = name, opt, list(tables)

    def _group(self, p: torch.Tensor) -> dict:
        return next(g for g in self.opt.param_groups if any(q is p for q in g["params"]))

    def _rows(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.opt.state.get(p, {})
        return {
            k: v.detach().clone()
            for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        }

    def step(self, used: list, stepper=None) -> None:
        for p, ids in zip(self.tables, used, strict=True):
            if ids is None:
                p.grad = None
        snaps = [(p.detach().clone(), self._rows(p), dict(self._group(p))) for p in self.tables]
        if stepper is None:
            self.opt.step()
        else:
            stepper()
        with torch.no_grad():
            for p, ids, (w_before, st_before, group) in zip(self.tables, used, snaps, strict=True):
                if ids is None:
                    continue
                keep = torch.ones(p.shape[0], dtype=torch.bool)
                keep[torch.as_tensor(ids).reshape(-1).long().cpu()] = False
                p[keep] = w_before[keep]
                for k, v in self.opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        if k in st_before:
                            v[keep] = st_before[k][keep]
                        else:
                            v[keep] = fresh_row(self.name, k, group, v[keep])


class Mixed(nn.Module):
    """An offloaded embedding (2 ids per sample, summed), an offloaded bag and a Linear head."""

    def __init__(self, emb: nn.Module, bag: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.emb, self.bag, self.head = emb, bag, head

    def forward(self, ids, hist=None):
        x = self.emb(ids).sum(1)
        if hist is not None:
            x = x * self.bag(hist)
        return self.head(x).squeeze(-1)


class Dense(nn.Module):
    """The reference: the same model over two dense tables."""

    def __init__(self, we: torch.Tensor, wb: torch.Tensor, head: nn.Linear, mode: str) -> None:
        super().__init__()
        self.E = nn.Parameter(we.clone())
        self.B = nn.Parameter(wb.clone())
        self.head, self.mode = head, mode

    def forward(self, ids, hist=None):
        x = F.embedding(ids, self.E).sum(1)
        if hist is not None:
            x = x * F.embedding_bag(hist, self.B, mode=self.mode)
        return self.head(x).squeeze(-1)


def build(
    name: str,
    g0: dict,
    g1: dict,
    kw: dict,
    placement: str = "cpu",
    seed: int = 0,
    dtype: torch.dtype = F32,
    mode: str = "sum",
):
    """(offloaded model, its OffloadedOptimizer, dense model, its LazyDense) with two param
    groups: the embedding table with the head's bias (options ``g0``) and the bag table with the
    head's weight (options ``g1``); ``kw`` are the constructor's options."""
    dev = dev_of(placement)
    we, wb = w0(seed, dtype), w0(seed + 1, dtype)
    torch.manual_seed(seed + 100)
    head = nn.Linear(D, 1, dtype=dtype)
    off = Mixed(off_emb(we, placement), off_bag(wb, mode, placement), copy.deepcopy(head).to(dev))
    ref = Dense(we, wb, copy.deepcopy(head), mode)
    cls = getattr(torch.optim, name)
    opt = gl.OffloadedOptimizer(
        cls,
        [{"params": [off.emb, off.head.bias], **g0}, {"params": [off.bag, off.head.weight], **g1}],
        **copy.deepcopy(kw),
    )
    ropt = cls(
        [{"params": [ref.head.bias, ref.E], **g0}, {"params": [ref.head.weight, ref.B], **g1}],
        **copy.deepcopy(kw),
    )
    return off, opt, ref, LazyDense(name, ropt, [ref.E, ref.B])


def data(seed: int, steps: int, dtype: torch.dtype = F32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, N, (B, 2), generator=g)
        ids[1, 0] = ids[0, 0]  # repeats within the batch
        ids[2, 1] = ids[2, 0]
        hist = torch.randint(0, N, (B, 3), generator=g)
        hist[3, 2] = hist[3, 0]
        y = torch.randn(B, generator=g, dtype=F64).to(dtype)
        out.append((ids, hist, y))
    return out


def train_step(off, opt, ref, lazy, batch, dev=CPU, use_bag=True):
    """One step of both; ``use_bag=False`` leaves the bag table without a lookup."""
    ids, hist, y = batch
    h = hist if use_bag else None
    opt.zero_grad()
    lo = F.mse_loss(off(ids.to(dev), None if h is None else h.to(dev)), y.to(dev))
    lo.backward()
    opt.step()
    lazy.opt.zero_grad()
    lr_ = F.mse_loss(ref(ids, h), y)
    lr_.backward()
    lazy.step([ids, hist if use_bag else None])
    return lo.detach(), lr_.detach()


def dense_rows(lazy: LazyDense, P: torch.Tensor) -> dict[str, torch.Tensor]:
    st = lazy.opt.state.get(P, {})
    return {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape == P.shape}


def assert_match(off: Mixed, opt, ref: Dense, lazy: LazyDense, tol=TOL) -> None:
    torch.testing.assert_close(table(off.emb), ref.E.detach(), **tol)
    torch.testing.assert_close(table(off.bag), ref.B.detach(), **tol)
    torch.testing.assert_close(off.head.weight.detach().cpu(), ref.head.weight.detach(), **tol)
    torch.testing.assert_close(off.head.bias.detach().cpu(), ref.head.bias.detach(), **tol)
    for i, (rows, P) in enumerate(zip(opt.state_dict()["tables"], (ref.E, ref.B), strict=True)):
        dense = dense_rows(lazy, P)
        assert set(rows) == set(dense), (i, sorted(rows), sorted(dense))
        for k, v in rows.items():
            torch.testing.assert_close(v.cpu(), dense[k], **tol, msg=f"table {i} state {k}")


def snapshot(off: Mixed, opt) -> list[torch.Tensor]:
    out = [table(off.emb), table(off.bag)]
    out += [p.detach().cpu().clone() for p in off.head.parameters()]
    for t in opt.state_dict()["tables"]:
        out += [t[k].detach().cpu().clone() for k in sorted(t)]
    return out


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


# ---------------------------------------------------------------------------------------------
# param groups whose options differ per table, also in which state they keep
# ---------------------------------------------------------------------------------------------
GROUP_CASES = [
    # (optimizer, group 0 = embedding table, group 1 = bag table, constructor options)
    (
        "Adam",
        {"lr": 0.1, "amsgrad": True, "betas": (0.5, 0.8), "weight_decay": 0.1},
        {"amsgrad": False},
        {"lr": 0.05},
    ),
    ("AdamW", {"weight_decay": 0.3}, {"amsgrad": True, "weight_decay": 0.0}, {"lr": 0.05}),
    (
        "SGD",
        {"momentum": 0.9, "nesterov": True, "lr": 0.2},
        {"weight_decay": 0.05, "maximize": True},
        {"lr": 0.1},
    ),
    ("SGD", {"momentum": 0.0}, {"momentum": 0.5, "dampening": 0.0}, {"lr": 0.1, "momentum": 0.9}),
    (
        "RMSprop",
        {"centered": True, "momentum": 0.5},
        {"alpha": 0.9, "weight_decay": 0.1},
        {"lr": 0.01},
    ),
    (
        "Rprop",
        {"etas": (0.3, 1.5), "step_sizes": (1e-3, 0.2), "lr": 0.02},
        {"maximize": True},
        {"lr": 0.05},
    ),
    ("ASGD", {"t0": 1, "lambd": 0.01, "alpha": 0.5}, {"t0": 3, "weight_decay": 0.1}, {"lr": 0.05}),
    (
        "Adagrad",
        {"lr_decay": 0.1, "weight_decay": 0.1, "initial_accumulator_value": 0.9},
        {"maximize": True, "eps": 1e-3},
        {"lr": 0.1, "initial_accumulator_value": 0.3},
    ),
    ("Adadelta", {"rho": 0.5}, {"rho": 0.95, "weight_decay": 0.1}, {"lr": 0.5}),
    ("Adamax", {"betas": (0.3, 0.5)}, {"maximize": True, "weight_decay": 0.1}, {"lr": 0.05}),
    ("NAdam", {"momentum_decay": 0.01}, {"weight_decay": 0.1}, {"lr": 0.05}),
    ("RAdam", {"betas": (0.8, 0.9)}, {"weight_decay": 0.1}, {"lr": 0.05}),
]


def _gid(c) -> str:
    name, g0, g1, kw = c
    return f"{name}-" + "-".join(sorted(set(g0) | set(g1)))


@pytest.mark.parametrize("name,g0,g1,kw", GROUP_CASES, ids=[_gid(c) for c in GROUP_CASES])
def test_per_group_options_per_table_match_dense(name, g0, g1, kw):
    """README: 'A param-group dict may name offloaded modules ... to give tables their own
    options'. Options that decide which state torch keeps (amsgrad, momentum, centered) differ
    between the two tables: each table gets the state tables its group's optimizer keeps (no
    amsgrad table for the other one), and every weight and state row equals the dense model's.
    (torch's Adagrad fills every ``sum`` from the constructor's initial_accumulator_value, not
    the group's: the reference decides.)"""
    off, opt, ref, lazy = build(name, g0, g1, kw, seed=3)
    for batch in data(4, 5):
        train_step(off, opt, ref, lazy, batch)
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# step counts that diverge between tables
# ---------------------------------------------------------------------------------------------
SKIP_CASES = [
    ("NAdam", {"lr": 0.05, "momentum_decay": 0.02}),  # mu_product: scalar state per table
    ("ASGD", {"lr": 0.05, "t0": 2, "lambd": 0.05}),  # eta, mu: scalar state per table
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.2}),  # the step count scales the lr
    ("RAdam", {"lr": 0.05}),  # the rectification switches on after 5 steps
    ("Adam", {"lr": 0.05, "amsgrad": True}),  # bias corrections
    ("Adamax", {"lr": 0.05}),
    ("Rprop", {"lr": 0.05}),
]


@pytest.mark.parametrize("name,kw", SKIP_CASES, ids=[c[0] for c in SKIP_CASES])
def test_table_without_lookup_keeps_its_own_step_count(placement, name, kw):
    """The bag is looked up only every third step: OffloadedOptimizer docstring 'each table
    keeps one step count, as torch's SparseAdam (a table with no lookup since the last step is
    not stepped)'. Step-count-dependent updates (NAdam's mu_product, ASGD's eta and mu,
    Adagrad's lr_decay, RAdam's rectification, bias corrections) then follow each table's own
    count, as torch's dense optimizer does for a parameter without a gradient."""
    off, opt, ref, lazy = build(name, {}, {}, kw, placement, seed=5)
    for s, batch in enumerate(data(6, 8)):
        train_step(off, opt, ref, lazy, batch, dev_of(placement), use_bag=s % 3 == 0)
    assert_match(off, opt, ref, lazy)
    counts = [
        float(v["step"])
        for v in opt.state_dict()["inner"]["state"].values()
        if isinstance(v, dict) and "step" in v
    ]
    ref_counts = [float(lazy.opt.state[p]["step"]) for p in (ref.head.bias, ref.E)]
    ref_counts += [float(lazy.opt.state[p]["step"]) for p in (ref.head.weight, ref.B)]
    assert sorted(counts) == sorted(ref_counts)
    assert sorted(set(counts)) == [3.0, 8.0]


# ---------------------------------------------------------------------------------------------
# options other than lr changed in param_groups mid-training
# ---------------------------------------------------------------------------------------------
CHANGE_CASES = [
    # (optimizer, constructor options, {step: {group index: {option: value}}})
    ("Adam", {"lr": 0.05}, {2: {0: {"betas": (0.5, 0.7), "eps": 1e-2}, 1: {"maximize": True}}}),
    ("AdamW", {"lr": 0.05}, {1: {0: {"weight_decay": 0.5}}, 3: {1: {"weight_decay": 0.0}}}),
    (
        "Rprop",
        {"lr": 0.05},
        {2: {0: {"etas": (0.2, 2.0), "step_sizes": (1e-2, 0.06)}, 1: {"maximize": True}}},
    ),
    ("ASGD", {"lr": 0.05, "t0": 100}, {2: {0: {"t0": 1, "lambd": 0.1}, 1: {"alpha": 0.3}}}),
    ("Adagrad", {"lr": 0.1}, {2: {0: {"lr_decay": 0.5}, 1: {"eps": 0.1, "weight_decay": 0.2}}}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5}, {2: {0: {"alpha": 0.5}, 1: {"momentum": 0.9}}}),
    # momentum off, then on again: torch keeps the buffer rows and uses them again
    ("SGD", {"lr": 0.1, "momentum": 0.9}, {2: {0: {"momentum": 0.0}}, 4: {0: {"momentum": 0.9}}}),
    ("SGD", {"lr": 0.1}, {2: {1: {"momentum": 0.8, "nesterov": True}}}),
    ("NAdam", {"lr": 0.05}, {2: {0: {"momentum_decay": 0.5, "betas": (0.6, 0.99)}}}),
]


@pytest.mark.parametrize(
    "name,kw,changes", CHANGE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CHANGE_CASES)]
)
def test_options_changed_in_param_groups_mid_training(name, kw, changes):
    """README: 'OffloadedOptimizer is a torch.optim.Optimizer' sharing param_groups with the
    inner optimizer: a user (or a scheduler) writing betas, eps, weight_decay, maximize, Rprop's
    etas, ASGD's t0, momentum ... into a group between steps changes the next step of that
    group's table exactly as torch's dense optimizer does."""
    off, opt, ref, lazy = build(name, {}, {}, kw, seed=7)
    for s, batch in enumerate(data(8, 6)):
        for gi, opts in changes.get(s, {}).items():
            for o in (opt, lazy.opt):
                o.param_groups[gi].update(copy.deepcopy(opts))
        train_step(off, opt, ref, lazy, batch)
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# gradient clipping over model.parameters(): README says it does not reach the tables
# ---------------------------------------------------------------------------------------------
def test_clip_over_model_parameters_clips_only_the_ordinary_parameters():
    """README: 'Clip over the optimizer's groups, not model.parameters(), which does not reach
    the tables'. So clip_grad_norm_(model.parameters()) returns the head's norm alone and scales
    only the head's gradients; the tables step with their full gradients. Reference: the dense
    model clipping just its head."""
    off, opt, ref, lazy = build("SGD", {}, {}, {"lr": 0.1, "momentum": 0.5}, seed=9)
    assert {id(p) for p in off.parameters()} == {id(p) for p in off.head.parameters()}
    for batch in data(10, 4):
        ids, hist, y = batch
        opt.zero_grad()
        (10 * F.mse_loss(off(ids, hist), y)).backward()
        n_off = torch.nn.utils.clip_grad_norm_(off.parameters(), 0.05)
        opt.step()
        lazy.opt.zero_grad()
        (10 * F.mse_loss(ref(ids, hist), y)).backward()
        n_ref = torch.nn.utils.clip_grad_norm_(ref.head.parameters(), 0.05)
        lazy.step([ids, hist])
        torch.testing.assert_close(n_off, n_ref, **TOL)
        assert float(n_ref) > 0.05  # clipping did happen
    assert_match(off, opt, ref, lazy)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_over_param_groups_with_table_and_head_like_dense(norm_type):
    """Clipping over the optimizer's groups (README's form) after two micro-batches, with
    norm types 1 and inf besides 2, on tables whose groups differ (Adam with amsgrad in one)."""
    off, opt, ref, lazy = build("Adam", {"amsgrad": True, "lr": 0.1}, {}, {"lr": 0.05}, seed=11)
    batches = data(12, 6)
    for s in range(3):
        micro = batches[2 * s : 2 * s + 2]
        opt.zero_grad()
        lazy.opt.zero_grad()
        for ids, hist, y in micro:
            (5 * F.mse_loss(off(ids, hist), y)).backward()
            (5 * F.mse_loss(ref(ids, hist), y)).backward()
        ps = [p for g in opt.param_groups for p in g["params"]]
        rps = [p for g in lazy.opt.param_groups for p in g["params"]]
        a = torch.nn.utils.clip_grad_norm_(ps, 0.2, norm_type=norm_type)
        b = torch.nn.utils.clip_grad_norm_(rps, 0.2, norm_type=norm_type)
        torch.testing.assert_close(a, b, **TOL)
        assert float(b) > 0.2
        opt.step()
        lazy.step(
            [
                torch.cat([m[0].reshape(-1) for m in micro]),
                torch.cat([m[1].reshape(-1) for m in micro]),
            ]
        )
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# foreach on and off
# ---------------------------------------------------------------------------------------------
FOREACH_CASES = [
    ("Adam", {"lr": 0.05, "amsgrad": True, "weight_decay": 0.1}),
    ("AdamW", {"lr": 0.05, "maximize": True}),
    ("RMSprop", {"lr": 0.01, "centered": True, "momentum": 0.5}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("NAdam", {"lr": 0.05}),
    ("ASGD", {"lr": 0.05, "t0": 1}),
    ("Rprop", {"lr": 0.05}),
    ("Adadelta", {"lr": 0.5}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.1}),
]


@pytest.mark.parametrize("name,kw", FOREACH_CASES, ids=[c[0] for c in FOREACH_CASES])
def test_foreach_true_and_false_give_the_same_table(name, kw):
    """The same run with foreach=False and foreach=True: both equal the dense reference (run
    with the same flag) and each other, tables and state (where torch's own two
    implementations agree on the dense model)."""
    runs, dense = [], []
    for foreach in (False, True):
        off, opt, ref, lazy = build(
            name, {"lr": kw["lr"] * 2}, {}, {**kw, "foreach": foreach}, seed=13
        )
        for batch in data(14, 4):
            train_step(off, opt, ref, lazy, batch)
        assert_match(off, opt, ref, lazy)
        runs.append(snapshot(off, opt))
        dense.append([ref.E.detach().clone(), ref.B.detach().clone()])
    if not all(torch.allclose(a, b, **TOL) for a, b in zip(*dense, strict=True)):
        pytest.skip(f"this torch's foreach and single-tensor {name} differ on the dense model")
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------------------------------------
# add_param_group with options that create state
# ---------------------------------------------------------------------------------------------
ADD_CASES = [
    ("SGD", {"lr": 0.1}, {"lr": 0.2, "momentum": 0.9, "nesterov": True}),
    ("RMSprop", {"lr": 0.01}, {"centered": True, "momentum": 0.5, "alpha": 0.9}),
    ("Adam", {"lr": 0.05}, {"amsgrad": True, "betas": (0.6, 0.9), "weight_decay": 0.1}),
    ("Rprop", {"lr": 0.05}, {"lr": 0.01, "etas": (0.4, 1.3)}),
]


@pytest.mark.parametrize("name,kw,extra", ADD_CASES, ids=[c[0] for c in ADD_CASES])
def test_add_param_group_table_with_its_own_state_options(name, kw, extra):
    """README: 'opt.add_param_group({"params": new_emb, "lr": 1e-2}) adds a table later (with
    fresh state, as torch gives a parameter added to its optimizer)'. The added group turns on
    state the first group does not keep (momentum, centered, amsgrad); the dense reference adds
    its table with torch's add_param_group at the same step."""
    we, wb = w0(15), w0(16)
    torch.manual_seed(17)
    head = nn.Linear(D, 1)
    off = Mixed(off_emb(we), off_bag(wb), copy.deepcopy(head))
    ref = Dense(we, wb, copy.deepcopy(head), "sum")
    cls = getattr(torch.optim, name)
    opt = gl.OffloadedOptimizer(cls, [off.emb, off.head], **kw)
    ropt = cls([ref.E, *ref.head.parameters()], **kw)
    lazy = LazyDense(name, ropt, [ref.E])
    for s, (ids, hist, y) in enumerate(data(18, 6)):
        if s == 2:
            opt.add_param_group({"params": off.bag, **extra})
            ropt.add_param_group({"params": [ref.B], **extra})
            lazy.tables.append(ref.B)
        h = hist if s >= 2 else None
        opt.zero_grad()
        F.mse_loss(off(ids, h), y).backward()
        opt.step()
        ropt.zero_grad()
        F.mse_loss(ref(ids, h), y).backward()
        lazy.step([ids, hist] if s >= 2 else [ids])
    assert_match(off, opt, ref, lazy)
    assert len(opt.param_groups) == 2


# ---------------------------------------------------------------------------------------------
# tables of two dtypes in one optimizer; float64 tables
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(
    "name,kw", [("Adam", {"lr": 0.05}), ("RMSprop", {"lr": 0.01, "momentum": 0.5})]
)
def test_float32_and_float64_tables_in_one_optimizer(foreach, name, kw):
    """A float32 embedding and a float64 bag in one optimizer (torch's foreach path groups
    tensors by dtype): each table and its state keep their dtype and equal the dense tables of
    the same dtypes trained by one torch optimizer."""
    we, wb = w0(19, F32), w0(20, F64)
    e, b = off_emb(we), off_bag(wb)
    E, Bw = nn.Parameter(we.clone()), nn.Parameter(wb.clone())
    cls = getattr(torch.optim, name)
    opt = gl.OffloadedOptimizer(cls, [e, b], foreach=foreach, **kw)
    lazy = LazyDense(name, cls([E, Bw], foreach=foreach, **kw), [E, Bw])
    for ids, hist, y in data(21, 4):
        opt.zero_grad()
        ((e(ids).sum(1).double() * b(hist)).sum(-1) - y.double()).pow(2).sum().backward()
        opt.step()
        lazy.opt.zero_grad()
        x = F.embedding(ids, E).sum(1).double() * F.embedding_bag(hist, Bw, mode="sum")
        (x.sum(-1) - y.double()).pow(2).sum().backward()
        lazy.step([ids, hist])
    assert table(e).dtype == F32 and table(b).dtype == F64
    torch.testing.assert_close(table(e), E.detach(), **TOL)
    torch.testing.assert_close(table(b), Bw.detach(), **TOL64)
    for rows, P, tol in zip(opt.state_dict()["tables"], (E, Bw), (TOL, TOL64), strict=True):
        dense = dense_rows(lazy, P)
        assert set(rows) == set(dense)
        for k, v in rows.items():
            assert v.dtype == P.dtype, k
            torch.testing.assert_close(v.cpu(), dense[k], **tol)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("Adam", {"lr": 0.05, "amsgrad": True, "maximize": True, "weight_decay": 0.1}),
        ("ASGD", {"lr": 0.05, "t0": 1, "lambd": 0.01}),
        ("Rprop", {"lr": 0.05, "etas": (0.4, 1.1)}),
    ],
    ids=["Adam", "ASGD", "Rprop"],
)
def test_float64_tables_with_groups_match_dense_tightly(placement, name, kw):
    """float64 tables and head: the same run agrees with the dense float64 reference to ~1e-10."""
    off, opt, ref, lazy = build(name, {"lr": kw["lr"] * 2}, {}, kw, placement, seed=22, dtype=F64)
    for batch in data(23, 5, dtype=F64):
        train_step(off, opt, ref, lazy, batch, dev_of(placement))
    assert_match(off, opt, ref, lazy, tol=asgd_tol(name, placement, TOL64))


# ---------------------------------------------------------------------------------------------
# state_dict round trip mid-training: bit-identical continuation
# ---------------------------------------------------------------------------------------------
ROUND_CASES = [
    ("NAdam", {"momentum_decay": 0.02}, {"weight_decay": 0.1}, {"lr": 0.05}),
    ("ASGD", {"t0": 1, "lambd": 0.05}, {"t0": 2}, {"lr": 0.05}),
    ("Adagrad", {"lr_decay": 0.2}, {}, {"lr": 0.1, "initial_accumulator_value": 0.2}),
    ("RAdam", {}, {"weight_decay": 0.1}, {"lr": 0.05}),
    ("Adam", {"amsgrad": True}, {"betas": (0.5, 0.9)}, {"lr": 0.05}),
    ("SGD", {"momentum": 0.9, "nesterov": True}, {}, {"lr": 0.1}),
    ("Rprop", {"etas": (0.3, 1.5)}, {}, {"lr": 0.05}),
]


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("name,g0,g1,kw", ROUND_CASES, ids=[c[0] for c in ROUND_CASES])
def test_state_dict_round_trip_mid_training_is_bit_identical(
    tmp_path, placement, name, g0, g1, kw, how
):
    """Model and optimizer state dicts through torch.save / torch.load(weights_only=True) (or
    save_checkpoint / load_checkpoint) into freshly built objects (other initial weights, other
    lr), after steps in which the two tables' step counts diverged: README 'resumes
    bit-identically'. The continued run equals the uninterrupted one bit for bit, tables, head
    and state."""
    dev = dev_of(placement)
    batches = data(24, 7)

    def run(off, opt, part, start):
        for s, (ids, hist, y) in enumerate(part, start):
            opt.zero_grad()
            h = hist.to(dev) if s % 3 == 0 else None
            F.mse_loss(off(ids.to(dev), h), y.to(dev)).backward()
            opt.step()

    a_off, a_opt, _, _ = build(name, g0, g1, kw, placement, seed=25)
    run(a_off, a_opt, batches, 0)
    b_off, b_opt, _, _ = build(name, g0, g1, kw, placement, seed=25)
    run(b_off, b_opt, batches[:4], 0)
    buf = io.BytesIO()
    if how == "checkpoint":
        gl.save_checkpoint(tmp_path / "ck", {"model": b_off, "opt": b_opt})
    else:
        torch.save({"model": b_off.state_dict(), "opt": b_opt.state_dict()}, buf)
    del b_off, b_opt
    other = {**kw, "lr": kw["lr"] * 3}
    c_off, c_opt, _, _ = build(name, g0, g1, other, placement, seed=77)
    if how == "checkpoint":
        gl.load_checkpoint(tmp_path / "ck", {"model": c_off, "opt": c_opt})
    else:
        buf.seek(0)
        ck = torch.load(buf, weights_only=True)
        c_off.load_state_dict(ck["model"])
        c_opt.load_state_dict(ck["opt"])
    run(c_off, c_opt, batches[4:], 4)
    assert_same(snapshot(c_off, c_opt), snapshot(a_off, a_opt))


@pytest.mark.parametrize("name,kw", [("NAdam", {"lr": 0.05}), ("ASGD", {"lr": 0.05, "t0": 1})])
def test_rollback_mid_training_restores_scalar_state(name, kw):
    """Loading a state dict saved after step 2 into the same optimizer after step 5 (a rollback,
    model state dict too): the next steps equal a run that went on from step 2 directly, so the
    per-table scalar state (NAdam's mu_product, ASGD's eta / mu) and step counts come back too."""
    batches = data(26, 7)
    off, opt, _, _ = build(name, {}, {}, kw, seed=27)
    twin, topt, _, _ = build(name, {}, {}, kw, seed=27)

    def step(m, o, batch, use_bag=True):
        ids, hist, y = batch
        o.zero_grad()
        F.mse_loss(m(ids, hist if use_bag else None), y).backward()
        o.step()

    for batch in batches[:2]:
        step(off, opt, batch)
        step(twin, topt, batch)
    msd, osd = copy.deepcopy(off.state_dict()), copy.deepcopy(opt.state_dict())
    for batch in batches[2:5]:
        step(off, opt, batch, use_bag=False)
    off.load_state_dict(msd)
    opt.load_state_dict(osd)
    for batch in batches[5:]:
        step(off, opt, batch)
        step(twin, topt, batch)
    assert_same(snapshot(off, opt), snapshot(twin, topt))


# ---------------------------------------------------------------------------------------------
# empty batches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,kw", [("Adam", {"lr": 0.05}), ("NAdam", {"lr": 0.05}), ("ASGD", {"lr": 0.05, "t0": 1})]
)
def test_empty_batch_mid_training_moves_no_row(placement, name, kw):
    """A step whose batch is empty (ids of shape (0, 2), bags of shape (0, 3)) between ordinary
    steps: no table row and no state row moves at that step (README: 'rows outside a batch
    untouched'), the head trains on, and the whole run equals the dense model with lazy updates,
    where an empty lookup still gives the table a (zero) gradient, as torch's sparse embedding
    does."""
    dev = dev_of(placement)
    off, opt, ref, lazy = build(name, {}, {"lr": kw["lr"] * 2}, kw, placement, seed=28)
    batches = data(29, 5)
    batches[2] = (
        torch.empty(0, 2, dtype=torch.long),
        torch.empty(0, 3, dtype=torch.long),
        torch.empty(0, dtype=F32),
    )
    ones = torch.ones(1, D)
    for s, (ids, hist, y) in enumerate(batches):
        before = snapshot(off, opt)
        opt.zero_grad()
        lo = F.mse_loss(off(ids.to(dev), hist.to(dev)), y.to(dev), reduction="sum")
        (lo + off.head(ones.to(dev)).sum() * 0.1).backward()
        opt.step()
        lazy.opt.zero_grad()
        lr_ = F.mse_loss(ref(ids, hist), y, reduction="sum")
        (lr_ + ref.head(ones).sum() * 0.1).backward()
        lazy.step([ids, hist])
        if s == 2:
            after = snapshot(off, opt)
            for i in (0, 1, *range(4, len(after))):  # tables and state rows, not the head
                assert torch.equal(after[i], before[i]), i
            assert not torch.equal(after[2], before[2])  # the head did train
    assert_match(off, opt, ref, lazy, tol=asgd_tol(name, placement, TOL))


# ---------------------------------------------------------------------------------------------
# SparseAdam with per-table groups against torch's own sparse embeddings
# ---------------------------------------------------------------------------------------------
def test_sparse_adam_groups_with_own_options_match_torch_sparse_embeddings():
    """SparseAdam is lazy per row by construction: the embedding and the bag in two groups
    (own lr, betas, eps, maximize), the bag skipped every other step, equal torch's
    nn.Embedding / nn.EmbeddingBag(sparse=True) trained by torch's SparseAdam with the same
    groups, with a change of betas mid-training."""
    we, wb = w0(30), w0(31)
    e, b = off_emb(we), off_bag(wb)
    g0 = {"lr": 0.1, "betas": (0.5, 0.8)}
    g1 = {"eps": 1e-3, "maximize": True}
    opt = gl.OffloadedOptimizer(
        torch.optim.SparseAdam, [{"params": e, **g0}, {"params": b, **g1}], lr=0.05
    )
    re_, rb = nn.Embedding(N, D, sparse=True), nn.EmbeddingBag(N, D, mode="sum", sparse=True)
    with torch.no_grad():
        re_.weight.copy_(we)
        rb.weight.copy_(wb)
    ropt = torch.optim.SparseAdam(
        [{"params": [re_.weight], **g0}, {"params": [rb.weight], **g1}], lr=0.05
    )

    def loss(emb, bag, ids, hist, y, s):
        x = emb(ids).sum(1)
        if s % 2 == 0:
            x = x * bag(hist)
        return (x.sum(-1) - y).pow(2).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's sparse invariant-check notice
        for s, (ids, hist, y) in enumerate(data(32, 6)):
            if s == 3:
                for o in (opt, ropt):
                    o.param_groups[1]["betas"] = (0.7, 0.95)
            opt.zero_grad()
            loss(e, b, ids, hist, y, s).backward()
            opt.step()
            ropt.zero_grad()
            loss(re_, rb, ids, hist, y, s).backward()
            ropt.step()
    torch.testing.assert_close(table(e), re_.weight.detach(), **TOL)
    torch.testing.assert_close(table(b), rb.weight.detach(), **TOL)
    for rows, P in zip(opt.state_dict()["tables"], (re_.weight, rb.weight), strict=True):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(rows[k].cpu(), ropt.state[P][k], **TOL)
        assert float(ropt.state[P]["step"]) in (6.0, 3.0)


# ---------------------------------------------------------------------------------------------
# schedulers cycling betas / momentum over groups whose state differs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,g0,g1,kw",
    [
        ("Adam", {"amsgrad": True}, {"weight_decay": 0.1}, {"lr": 0.05}),
        ("SGD", {"nesterov": True, "momentum": 0.9}, {"momentum": 0.0}, {"lr": 0.1}),
        ("RMSprop", {"centered": True}, {}, {"lr": 0.01, "momentum": 0.5}),
    ],
    ids=["Adam-amsgrad-in-one-group", "SGD-momentum-in-one-group", "RMSprop-centered-in-one"],
)
def test_one_cycle_over_groups_with_different_state(name, g0, g1, kw):
    """OneCycleLR cycles lr and beta1 / momentum per group (and turns SGD's momentum on for the
    group that had none): each table follows its own group, like the dense model."""
    off, opt, ref, lazy = build(name, g0, g1, kw, seed=33)
    lrs = torch.optim.lr_scheduler
    s_off = lrs.OneCycleLR(opt, max_lr=[0.2, 0.1], total_steps=8)
    s_ref = lrs.OneCycleLR(lazy.opt, max_lr=[0.2, 0.1], total_steps=8)
    for batch in data(34, 7):
        train_step(off, opt, ref, lazy, batch)
        s_off.step()
        s_ref.step()
    for g, rg in zip(opt.param_groups, lazy.opt.param_groups, strict=True):
        assert float(g["lr"]) == pytest.approx(float(rg["lr"]), rel=1e-12)
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# the switchers (ModelFactory / OptimizerFactory and the Pytorch* faces) with the same options
# ---------------------------------------------------------------------------------------------
def face_kwargs(face: str, placement: str) -> tuple[dict, dict]:
    """Constructor keywords of (model switcher, optimizer switcher) giving ``placement``."""
    if face == "cupy":
        return {"placement": placement}, {"placement": placement}
    if placement == "cuda":
        kw = {"deviceType": "cuda"}
    else:
        kw = {"deviceType": "cpu", "pinType": placement == "pinned"}
    return dict(kw), dict(kw)


def switch_pair(face: str, model_var: nn.Module, w: torch.Tensor, placement: str):
    """A model switcher over ``model_var`` with table ``w``."""
    mk, _ = face_kwargs(face, placement)
    cls = gl.ModelFactory if face == "cupy" else gl.PytorchModelFactory
    dtype = "float64" if w.dtype == F64 else "float32"
    sw = cls(model_var, w.shape[0], D, datatype=dtype, **mk)
    sw.customInit(lambda t: t.copy_(w.to(t.device)))
    return sw


def opt_switch(face: str, opt, model: nn.Module, name: str, placement: str, dtype=F32):
    _, ok = face_kwargs(face, placement)
    cls = gl.OptimizerFactory if face == "cupy" else gl.PytorchOptimizerFactory
    osw = cls(opt, N, D, model, name, dtype="float64" if dtype == F64 else "float32", **ok)
    osw.optInit()
    return osw


class TwoVars(nn.Module):
    """word2vec-like: two switched variables and a Linear head."""

    def __init__(self, dtype: torch.dtype = F32) -> None:
        super().__init__()
        self.u = nn.Embedding(3, D, dtype=dtype)
        self.v = nn.Embedding(3, D, dtype=dtype)
        self.head = nn.Linear(D, 1, dtype=dtype)


def switched_setup(name, gu, gv, kw, face, placement, seed, dtype=F32):
    """(model, torch optimizer, [u switchers], [v switchers], dense (U, V, head), LazyDense):
    group 0 = u with its options, group 1 = v and the head."""
    dev = dev_of(placement)
    torch.manual_seed(seed)
    model = TwoVars(dtype).to(dev)
    wu, wv = w0(seed, dtype), w0(seed + 1, dtype)
    cls = getattr(torch.optim, name)
    groups = [
        {"params": model.u.parameters(), **gu},
        {"params": [*model.v.parameters(), *model.head.parameters()], **gv},
    ]
    opt = cls(groups, **copy.deepcopy(kw))
    su = switch_pair(face, model.u, wu, placement)
    sv = switch_pair(face, model.v, wv, placement)
    ou = opt_switch(face, opt, model, "u", placement, dtype)
    ov = opt_switch(face, opt, model, "v", placement, dtype)
    U, V = nn.Parameter(wu.clone()), nn.Parameter(wv.clone())
    rhead = copy.deepcopy(model.head).to(CPU)
    ropt = cls(
        [{"params": [U], **gu}, {"params": [V, *rhead.parameters()], **gv}], **copy.deepcopy(kw)
    )
    return model, opt, (su, ou), (sv, ov), (U, V, rhead), LazyDense(name, ropt, [U, V])


def switched_step(model, opt, us, vs, ids, ctx, y, dev, use_v=True):
    """SpeedTorch's loop: both switchers of each variable before the forward, the user's own
    optimizer, both switchers after the step. ``use_v=False``: v has no lookup this step."""
    su, ou = us
    sv, ov = vs
    lu = su.beforeForwardPass(ids)
    ou.beforeForwardPass(ids)
    x = model.u(lu).sum(1)
    if use_v:
        lv = sv.beforeForwardPass(ctx)
        ov.beforeForwardPass(ctx)
        x = x * model.v(lv).sum(1)
    opt.zero_grad()
    F.mse_loss(model.head(x).squeeze(-1), y.to(dev)).backward()
    opt.step()
    su.afterOptimizerStep(ids)
    ou.afterOptimizerStep(ids)
    if use_v:
        sv.afterOptimizerStep(ctx)
        ov.afterOptimizerStep(ctx)


def ref_switched_step(dense, lazy, ids, ctx, y, use_v=True):
    U, V, rhead = dense
    x = F.embedding(ids, U).sum(1)
    if use_v:
        x = x * F.embedding(ctx, V).sum(1)
    lazy.opt.zero_grad()
    F.mse_loss(rhead(x).squeeze(-1), y).backward()
    lazy.step([ids, ctx if use_v else None])


def assert_switched_match(model, us, vs, dense, lazy, tol=TOL) -> None:
    U, V, rhead = dense
    for (sw, osw), P in ((us, U), (vs, V)):
        torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), P.detach(), **tol)
        got = osw.getNumpyVersion()
        want = dense_rows(lazy, P)
        assert set(got) == set(want), (sorted(got), sorted(want))
        for k, v in got.items():
            torch.testing.assert_close(torch.from_numpy(v), want[k], **tol, msg=k)
    torch.testing.assert_close(model.head.weight.detach().cpu(), rhead.weight.detach(), **tol)
    torch.testing.assert_close(model.head.bias.detach().cpu(), rhead.bias.detach(), **tol)


def switch_data(seed: int, steps: int, dtype: torch.dtype = F32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, N, (B, 2), generator=g)
        ids[1, 1] = ids[0, 0]  # repeats
        ctx = torch.randint(0, N, (B, 3), generator=g)
        ctx[2, 2] = ctx[2, 0]
        out.append((ids, ctx, torch.randn(B, generator=g, dtype=F64).to(dtype)))
    return out


SWITCH_CASES = [
    (
        "Adagrad",
        {"lr_decay": 0.1, "weight_decay": 0.1},
        {"maximize": True},
        {"lr": 0.1, "initial_accumulator_value": 0.3},
    ),
    (
        "Rprop",
        {"etas": (0.3, 1.5), "step_sizes": (1e-3, 0.2)},
        {"maximize": True, "lr": 0.02},
        {"lr": 0.05},
    ),
    ("ASGD", {"t0": 1, "lambd": 0.05, "alpha": 0.5}, {"t0": 2, "weight_decay": 0.1}, {"lr": 0.05}),
    ("Adadelta", {"rho": 0.5, "maximize": True}, {"weight_decay": 0.1}, {"lr": 0.5}),
    ("Adamax", {"maximize": True}, {"weight_decay": 0.1, "betas": (0.5, 0.9)}, {"lr": 0.05}),
    ("NAdam", {"momentum_decay": 0.02}, {"weight_decay": 0.1}, {"lr": 0.05}),
    ("RAdam", {"weight_decay": 0.1}, {}, {"lr": 0.05}),
    ("Adam", {"amsgrad": True, "lr": 0.1}, {"weight_decay": 0.1}, {"lr": 0.05, "foreach": False}),
    ("AdamW", {}, {"amsgrad": True, "maximize": True}, {"lr": 0.05, "foreach": True}),
    ("SGD", {"momentum": 0.9, "nesterov": True}, {"momentum": 0.0, "maximize": True}, {"lr": 0.1}),
    ("RMSprop", {"centered": True, "momentum": 0.5}, {"alpha": 0.9}, {"lr": 0.01}),
]


@pytest.mark.parametrize("face", ["cupy", "torch"])
@pytest.mark.parametrize("name,gu,gv,kw", SWITCH_CASES, ids=[c[0] for c in SWITCH_CASES])
def test_switchers_with_group_options_match_dense(name, gu, gv, kw, face):
    """SpeedTorch's loop on the user's optimizer with two groups whose options differ (also in
    which state torch keeps): each optimizer switcher keeps the state tables its variable's
    group keeps (README: 'State is found from the optimizer itself and starts as torch starts
    it'), v is left out of every third step, and everything equals the dense model."""
    model, opt, us, vs, dense, lazy = switched_setup(name, gu, gv, kw, face, "cpu", seed=40)
    for s, (ids, ctx, y) in enumerate(switch_data(41, 6)):
        switched_step(model, opt, us, vs, ids, ctx, y, CPU, use_v=s % 3 != 1)
        ref_switched_step(dense, lazy, ids, ctx, y, use_v=s % 3 != 1)
    assert_switched_match(model, us, vs, dense, lazy)


@pytest.mark.parametrize("face", ["cupy", "torch"])
@pytest.mark.parametrize("case", [0, 1, 7, 9], ids=["Adagrad", "Rprop", "Adam", "SGD"])
def test_switchers_with_group_options_on_every_placement(placement, face, case):
    """The same on every in-memory placement (the per-step variables on the GPU there)."""
    name, gu, gv, kw = SWITCH_CASES[case]
    dev = dev_of(placement)
    model, opt, us, vs, dense, lazy = switched_setup(name, gu, gv, kw, face, placement, seed=42)
    for s, (ids, ctx, y) in enumerate(switch_data(43, 5)):
        switched_step(model, opt, us, vs, ids.to(dev), ctx.to(dev), y, dev, use_v=s != 2)
        ref_switched_step(dense, lazy, ids, ctx, y, use_v=s != 2)
    assert_switched_match(model, us, vs, dense, lazy)


SWITCH_CHANGES = [
    ("SGD", {"lr": 0.1, "momentum": 0.9}, {2: {0: {"momentum": 0.0}}, 4: {0: {"momentum": 0.9}}}),
    ("SGD", {"lr": 0.1}, {2: {1: {"momentum": 0.8, "nesterov": True}}}),
    ("Adam", {"lr": 0.05}, {2: {0: {"betas": (0.5, 0.7)}, 1: {"maximize": True}}}),
    ("Rprop", {"lr": 0.05}, {2: {0: {"etas": (0.2, 2.0), "step_sizes": (1e-2, 0.06)}}}),
    ("ASGD", {"lr": 0.05, "t0": 100}, {2: {0: {"t0": 1, "lambd": 0.1}}}),
    ("Adagrad", {"lr": 0.1}, {2: {0: {"lr_decay": 0.5}, 1: {"weight_decay": 0.2}}}),
]


@pytest.mark.parametrize("face", ["cupy", "torch"])
@pytest.mark.parametrize(
    "name,kw,changes", SWITCH_CHANGES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SWITCH_CHANGES)]
)
def test_switchers_follow_options_changed_mid_training(name, kw, changes, face):
    """Options written into the user's param_groups between steps (momentum off and on again,
    momentum turned on for a group that had none, betas, maximize, etas, t0, lr_decay): the
    switched tables and their state follow them as torch's dense optimizer does."""
    model, opt, us, vs, dense, lazy = switched_setup(name, {}, {}, kw, face, "cpu", seed=44)
    for s, (ids, ctx, y) in enumerate(switch_data(45, 6)):
        for gi, opts in changes.get(s, {}).items():
            for o in (opt, lazy.opt):
                o.param_groups[gi].update(copy.deepcopy(opts))
        switched_step(model, opt, us, vs, ids, ctx, y, CPU)
        ref_switched_step(dense, lazy, ids, ctx, y)
    assert_switched_match(model, us, vs, dense, lazy)


@pytest.mark.parametrize("face", ["cupy", "torch"])
@pytest.mark.parametrize("name,kw", [("Adam", {"lr": 0.05}), ("SGD", {"lr": 0.1, "momentum": 0.9})])
def test_switchers_empty_batch_mid_training_moves_no_row(name, kw, face):
    """An empty batch (ids (0, 2) and (0, 3)) between ordinary steps through both switchers:
    no table or state row changes at that step, the head trains on, and the run equals the
    dense model with lazy updates (the empty lookup gives the table a zero gradient)."""
    model, opt, us, vs, dense, lazy = switched_setup(name, {}, {}, kw, face, "cpu", seed=46)
    batches = switch_data(47, 5)
    batches[2] = (
        torch.empty(0, 2, dtype=torch.long),
        torch.empty(0, 3, dtype=torch.long),
        torch.empty(0),
    )
    ones = torch.ones(1, D)
    U, V, rhead = dense
    for s, (ids, ctx, y) in enumerate(batches):
        before = [us[0].getNumpyVersion().copy(), vs[0].getNumpyVersion().copy()]
        before += [v.copy() for o in (us[1], vs[1]) for _, v in sorted(o.getNumpyVersion().items())]
        (su, ou), (sv, ov) = us, vs
        lu = su.beforeForwardPass(ids)
        ou.beforeForwardPass(ids)
        lv = sv.beforeForwardPass(ctx)
        ov.beforeForwardPass(ctx)
        x = model.u(lu).sum(1) * model.v(lv).sum(1)
        opt.zero_grad()
        loss = F.mse_loss(model.head(x).squeeze(-1), y, reduction="sum")
        (loss + 0.1 * model.head(ones).sum()).backward()
        opt.step()
        for sw, i in ((su, ids), (ou, ids), (sv, ctx), (ov, ctx)):
            sw.afterOptimizerStep(i)
        x = F.embedding(ids, U).sum(1) * F.embedding(ctx, V).sum(1)
        lazy.opt.zero_grad()
        loss = F.mse_loss(rhead(x).squeeze(-1), y, reduction="sum")
        (loss + 0.1 * rhead(ones).sum()).backward()
        lazy.step([ids, ctx])
        if s == 2:
            after = [us[0].getNumpyVersion(), vs[0].getNumpyVersion()]
            after += [v for o in (us[1], vs[1]) for _, v in sorted(o.getNumpyVersion().items())]
            for a, b in zip(after, before, strict=True):
                assert (a == b).all()
    assert_switched_match(model, us, vs, dense, lazy)


@pytest.mark.parametrize("face", ["cupy", "torch"])
@pytest.mark.parametrize(
    "name,kw,extra",
    [
        ("SGD", {"lr": 0.1}, {"lr": 0.2, "momentum": 0.9, "nesterov": True}),
        ("Adam", {"lr": 0.05}, {"amsgrad": True, "betas": (0.6, 0.9)}),
        ("RMSprop", {"lr": 0.01}, {"centered": True, "momentum": 0.5}),
    ],
    ids=["SGD", "Adam", "RMSprop"],
)
def test_switchers_variable_added_with_add_param_group_later(name, kw, extra, face):
    """The user's optimizer first trains u and the head; after two steps the v embedding joins
    through torch's add_param_group with options that keep more state, and its optimizer
    switcher is built then (optInit). Both tables equal the dense model whose optimizer got V
    the same way."""
    torch.manual_seed(48)
    model = TwoVars()
    wu, wv = w0(48), w0(49)
    cls = getattr(torch.optim, name)
    opt = cls([*model.u.parameters(), *model.head.parameters()], **kw)
    su = switch_pair(face, model.u, wu, "cpu")
    sv = switch_pair(face, model.v, wv, "cpu")
    ou = opt_switch(face, opt, model, "u", "cpu")
    U, V = nn.Parameter(wu.clone()), nn.Parameter(wv.clone())
    rhead = copy.deepcopy(model.head)
    ropt = cls([U, *rhead.parameters()], **kw)
    lazy = LazyDense(name, ropt, [U])
    ov = None
    for s, (ids, ctx, y) in enumerate(switch_data(50, 6)):
        if s == 2:
            opt.add_param_group({"params": model.v.parameters(), **extra})
            ov = opt_switch(face, opt, model, "v", "cpu")
            ropt.add_param_group({"params": [V], **extra})
            lazy.tables.append(V)
        if ov is None:
            lu = su.beforeForwardPass(ids)
            ou.beforeForwardPass(ids)
            opt.zero_grad()
            F.mse_loss(model.head(model.u(lu).sum(1)).squeeze(-1), y).backward()
            opt.step()
            su.afterOptimizerStep(ids)
            ou.afterOptimizerStep(ids)
            lazy.opt.zero_grad()
            F.mse_loss(rhead(F.embedding(ids, U).sum(1)).squeeze(-1), y).backward()
            lazy.step([ids])
        else:
            switched_step(model, opt, (su, ou), (sv, ov), ids, ctx, y, CPU)
            ref_switched_step((U, V, rhead), lazy, ids, ctx, y)
    assert_switched_match(model, (su, ou), (sv, ov), (U, V, rhead), lazy)


@pytest.mark.parametrize(
    "name,gu,gv,kw",
    [SWITCH_CASES[i] for i in (0, 2, 5, 7, 9)],
    ids=[SWITCH_CASES[i][0] for i in (0, 2, 5, 7, 9)],
)
def test_switchers_checkpoint_mid_training_is_bit_identical(tmp_path, name, gu, gv, kw):
    """save_checkpoint of the model, the four switchers and the user's optimizer after steps in
    which the two variables' step counts diverged (v left out of some steps), loaded into
    freshly built objects (other weights, other lr): README 'load_checkpoint ... resumes
    bit-identically'. The continued run equals the uninterrupted one bit for bit."""
    batches = switch_data(52, 7)

    def run(parts, part, start):
        model, opt, us, vs = parts[:4]
        for s, (ids, ctx, y) in enumerate(part, start):
            switched_step(model, opt, us, vs, ids, ctx, y, CPU, use_v=s % 3 != 1)

    def objects(parts):
        model, opt, (su, ou), (sv, ov) = parts[:4]
        return {"model": model, "opt": opt, "su": su, "ou": ou, "sv": sv, "ov": ov}

    def result(parts):
        model, _, us, vs = parts[:4]
        out = [torch.from_numpy(us[0].getNumpyVersion()), torch.from_numpy(vs[0].getNumpyVersion())]
        for o in (us[1], vs[1]):
            out += [torch.from_numpy(v) for _, v in sorted(o.getNumpyVersion().items())]
        return out + [p.detach().clone() for p in model.head.parameters()]

    a = switched_setup(name, gu, gv, kw, "cupy", "cpu", seed=53)
    run(a, batches, 0)
    b = switched_setup(name, gu, gv, kw, "cupy", "cpu", seed=53)
    run(b, batches[:4], 0)
    gl.save_checkpoint(tmp_path / "ck", objects(b))
    del b
    c = switched_setup(name, gu, gv, {**kw, "lr": kw["lr"] * 3}, "cupy", "cpu", seed=99)
    gl.load_checkpoint(tmp_path / "ck", objects(c))
    run(c, batches[4:], 4)
    assert_same(result(c), result(a))
    assert [g["lr"] for g in c[1].param_groups] == [g["lr"] for g in a[1].param_groups]


# DEFECT (Rprop, Adagrad cases): with float64 tables behind a float32 nn.Embedding, the state
# rows a fresh row starts from are float32-rounded: Rprop's step_size starts at
# 0.05000000074505806 instead of lr=0.05 and Adagrad's sum at 0.30000001192092896 instead of
# initial_accumulator_value=0.3 (torch's float64 parameter starts at 0.05 / 0.3), so the table
# drifts from the float64 reference by ~1e-8 relative. The state is probed on the float32
# variable. (A float64 nn.Embedding gives the exact values.)
@pytest.mark.parametrize("face", ["cupy", "torch"])
@pytest.mark.parametrize(
    "name,kw",
    [
        ("Adam", {"lr": 0.05, "amsgrad": True}),
        ("Rprop", {"lr": 0.05, "etas": (0.4, 1.3)}),
        ("Adagrad", {"lr": 0.05, "initial_accumulator_value": 0.3}),
    ],
)
def test_switchers_float64_tables_for_a_float32_variable(name, kw, face):
    """README: 'A datatype other than the model variable's ... makes the variable that dtype
    while it is paged, and the optimizer's state rows follow it'. float64 tables behind a float32
    nn.Embedding train like a dense float64 table, to ~1e-10, state tables float64 too."""
    model = nn.Module()
    model.u = nn.Embedding(3, D)  # float32
    w = w0(54, F64)
    opt = getattr(torch.optim, name)(model.parameters(), **kw)
    sw = switch_pair(face, model.u, w, "cpu")
    osw = opt_switch(face, opt, model, "u", "cpu", dtype=F64)
    U = nn.Parameter(w.clone())
    lazy = LazyDense(name, getattr(torch.optim, name)([U], **kw), [U])
    for ids, _ctx, y in switch_data(55, 5, dtype=F64):
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        rows = model.u(local)
        assert rows.dtype == F64
        opt.zero_grad()
        ((rows.sum(1).sum(-1) - y) ** 2).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        lazy.opt.zero_grad()
        ((F.embedding(ids, U).sum(1).sum(-1) - y) ** 2).sum().backward()
        lazy.step([ids])
    got = sw.getNumpyVersion()
    assert got.dtype.name == "float64"
    torch.testing.assert_close(torch.from_numpy(got), U.detach(), **TOL64)
    states = osw.getNumpyVersion()
    assert set(states) == set(dense_rows(lazy, U))
    for k, v in states.items():
        assert v.dtype.name == "float64", k
        torch.testing.assert_close(torch.from_numpy(v), lazy.opt.state[U][k], **TOL64)


@pytest.mark.parametrize("face", ["cupy", "torch"])
def test_switchers_grad_scaler_unscale_and_clip_over_model_parameters(face):
    """GradScaler on the CPU around the user's optimizer (scale, unscale_, clip_grad_norm_ over
    model.parameters(), which holds the per-step variables, step, update), with an inf in one
    step that makes the scaler skip it: the switched tables equal the dense model driven the
    same way, skipped step included (the lazy reference then restores every row)."""
    if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
        pytest.skip("this torch has no torch.amp.GradScaler")
    name, kw = "Adam", {"lr": 0.05}
    model, opt, us, vs, dense, lazy = switched_setup(
        name, {"amsgrad": True}, {}, kw, face, "cpu", seed=56
    )
    U, V, rhead = dense
    sc, rsc = (
        torch.amp.GradScaler("cpu", init_scale=512.0),
        torch.amp.GradScaler("cpu", init_scale=512.0),
    )
    for s, (ids, ctx, y) in enumerate(switch_data(57, 5)):
        bad = torch.tensor(float("inf") if s == 2 else 1.0)
        (su, ou), (sv, ov) = us, vs
        lu, lv = su.beforeForwardPass(ids), sv.beforeForwardPass(ctx)
        ou.beforeForwardPass(ids)
        ov.beforeForwardPass(ctx)
        opt.zero_grad()
        x = model.u(lu).sum(1) * model.v(lv).sum(1)
        loss = F.mse_loss(model.head(x).squeeze(-1), y) * 20 + model.head.bias.sum() * bad
        sc.scale(loss).backward()
        sc.unscale_(opt)
        n1 = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        sc.step(opt)
        sc.update()
        for sw, i in ((su, ids), (ou, ids), (sv, ctx), (ov, ctx)):
            sw.afterOptimizerStep(i)
        lazy.opt.zero_grad()
        x = F.embedding(ids, U).sum(1) * F.embedding(ctx, V).sum(1)
        loss = F.mse_loss(rhead(x).squeeze(-1), y) * 20 + rhead.bias.sum() * bad
        rsc.scale(loss).backward()
        rsc.unscale_(lazy.opt)
        n2 = torch.nn.utils.clip_grad_norm_([U, V, *rhead.parameters()], 0.5)

        def stepper(r=rsc):
            r.step(lazy.opt)

        lazy.step([ids, ctx], stepper=stepper)
        rsc.update()
        if s != 2:
            torch.testing.assert_close(n1, n2, **TOL)
    assert sc.get_scale() == rsc.get_scale() < 512.0
    assert_switched_match(model, us, vs, dense, lazy)


# ---------------------------------------------------------------------------------------------
# accumulation with zero_grad(set_to_none=False); bags in max / mean mode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,g0,kw",
    [
        ("NAdam", {"weight_decay": 0.1}, {"lr": 0.05}),
        ("Adagrad", {"lr_decay": 0.1}, {"lr": 0.1, "initial_accumulator_value": 0.2}),
        ("RMSprop", {"centered": True}, {"lr": 0.01, "momentum": 0.5}),
    ],
    ids=["NAdam", "Adagrad", "RMSprop"],
)
def test_accumulation_set_to_none_false_bag_only_in_second_micro_batch(name, g0, kw):
    """Two micro-batches per step with zero_grad(set_to_none=False); the bag is looked up only
    in the second micro-batch of every other step. Gradients of both micro-batches add up; on
    steps without a bag lookup the bag is not stepped (docstring: 'even where
    zero_grad(set_to_none=False) would have left torch a zero gradient to count a step for'),
    while the head (an ordinary parameter) gets torch's zero-gradient step."""
    off, opt, ref, lazy = build(name, g0, {}, kw, seed=58)
    batches = data(59, 8)
    for s in range(4):
        micro = batches[2 * s : 2 * s + 2]
        with_bag = s % 2 == 0
        opt.zero_grad(set_to_none=False)
        lazy.opt.zero_grad(set_to_none=False)
        for i, (ids, hist, y) in enumerate(micro):
            h = hist if (with_bag and i == 1) else None
            (F.mse_loss(off(ids, h), y) / 2).backward()
            (F.mse_loss(ref(ids, h), y) / 2).backward()
        used_e = torch.cat([m[0].reshape(-1) for m in micro])
        lazy.step([used_e, micro[1][1] if with_bag else None])
        opt.step()
    assert_match(off, opt, ref, lazy)


@pytest.mark.parametrize("mode", ["max", "mean"])
def test_bag_modes_with_group_weight_decay_match_dense(mode):
    """An EmbeddingBag in 'max' mode gives gradient only to each bag's maximum, yet every row
    looked up is in the batch: with Adam and weight decay in its group, the other rows move by
    the decay and their moments exactly as the dense table's looked-up rows do."""
    off, opt, ref, lazy = build(
        "Adam", {}, {"weight_decay": 0.2, "lr": 0.1}, {"lr": 0.05}, seed=60, mode=mode
    )
    for batch in data(61, 5):
        train_step(off, opt, ref, lazy, batch)
    assert_match(off, opt, ref, lazy)


@pytest.mark.parametrize(
    "name,saved,built",
    [
        ("Adam", {"amsgrad": True, "betas": (0.5, 0.9)}, {}),
        ("SGD", {"momentum": 0.9, "nesterov": True}, {}),
        ("RMSprop", {"centered": True, "momentum": 0.5}, {}),
    ],
    ids=["Adam-amsgrad-saved", "SGD-momentum-saved", "RMSprop-centered-saved"],
)
def test_load_state_dict_brings_the_saved_groups_options(name, saved, built):
    """torch's load_state_dict takes every group's options from the state dict. An optimizer
    rebuilt with other structural options (amsgrad, momentum, centered off where the saved run
    had them on, or on where it had them off) continues exactly like the saved run: README 'A
    state dict or checkpoint holding state the optimizer has not turned on yet ... loads, and
    that state is paged from then on'."""
    kw = {"lr": 0.05}
    batches = data(62, 6)
    a_off, a_opt, _, _ = build(name, saved, {}, kw, seed=63)
    b_off, b_opt, _, _ = build(name, saved, {}, kw, seed=63)

    def run(off, opt, part):
        for ids, hist, y in part:
            opt.zero_grad()
            F.mse_loss(off(ids, hist), y).backward()
            opt.step()

    run(a_off, a_opt, batches)
    run(b_off, b_opt, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": b_off.state_dict(), "opt": b_opt.state_dict()}, buf)
    c_off, c_opt, _, _ = build(name, built, {}, kw, seed=64)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    c_off.load_state_dict(ck["model"])
    c_opt.load_state_dict(ck["opt"])
    for k, v in saved.items():
        assert c_opt.param_groups[0][k] == v
    run(c_off, c_opt, batches[3:])
    assert_same(snapshot(c_off, c_opt), snapshot(a_off, a_opt))


def test_state_dict_without_state_the_rebuilt_optimizer_keeps_loads_as_torch_does():
    """The other direction: a state dict saved without amsgrad, loaded into an optimizer built
    with amsgrad=True. torch's plain Adam takes the saved options (amsgrad off) and drops the
    state they do not keep; so does the wrapper since session 48 (it refused this before): its
    ``max_exp_avg_sq`` tables start afresh (zeros), and training goes on exactly as the run
    that saved the state dict."""
    batches = data(65, 4)
    a_off, a_opt, _, _ = build("Adam", {}, {}, {"lr": 0.05}, seed=66)
    for ids, hist, y in batches[:2]:
        a_opt.zero_grad()
        F.mse_loss(a_off(ids, hist), y).backward()
        a_opt.step()
    sd = a_opt.state_dict()
    c_off, c_opt, _, _ = build("Adam", {"amsgrad": True}, {}, {"lr": 0.05}, seed=67)
    ids, hist, y = batches[2]
    c_opt.zero_grad()
    F.mse_loss(c_off(ids, hist), y).backward()
    c_opt.step()
    assert c_opt.state_dict()["tables"][0]["max_exp_avg_sq"].any()  # group 0: amsgrad
    c_opt.load_state_dict(sd)
    c_off.load_state_dict(a_off.state_dict())
    assert [g["amsgrad"] for g in c_opt.param_groups] == [False, False]
    tables = c_opt.state_dict()["tables"]
    assert not tables[0]["max_exp_avg_sq"].any()  # started afresh
    for saved, now, more in zip(sd["tables"], tables, ({"max_exp_avg_sq"}, set()), strict=True):
        assert set(now) - set(saved) == more
        for k in saved:
            assert torch.equal(saved[k], now[k])
    for ids, hist, y in batches[2:]:
        for off, opt in ((a_off, a_opt), (c_off, c_opt)):
            opt.zero_grad()
            F.mse_loss(off(ids, hist), y).backward()
            opt.step()
    a, c = snapshot(a_off, a_opt), snapshot(c_off, c_opt)
    n = len(a) - len(a_opt.state_dict()["tables"][0]) - len(a_opt.state_dict()["tables"][1])
    assert_same(a[:n], c[:n])  # tables and head
    c_tables = c_opt.state_dict()["tables"]
    for t_a, t_c in zip(a_opt.state_dict()["tables"], c_tables, strict=True):
        for k in t_a:
            assert torch.equal(t_a[k], t_c[k])
    assert not c_tables[0]["max_exp_avg_sq"].any()  # amsgrad stays off: never written


def torch_steps(name: str, kw: dict) -> bool:
    """Whether this torch builds and steps ``name(**kw)`` on a CPU parameter."""
    p = torch.zeros(2, 2, requires_grad=True)
    try:
        o = getattr(torch.optim, name)([p], **kw)
        p.grad = torch.ones_like(p)
        o.step()
    except Exception:  # noqa: BLE001 - any refusal by torch itself
        return False
    return True


FUSED_CASES = [
    ("Adam", {"amsgrad": True, "lr": 0.1}, {"weight_decay": 0.1, "maximize": True}, {"lr": 0.05}),
    ("AdamW", {}, {"amsgrad": True}, {"lr": 0.05}),
    ("SGD", {"momentum": 0.9, "nesterov": True}, {"momentum": 0.5}, {"lr": 0.1}),
    ("Adagrad", {"lr_decay": 0.1}, {"weight_decay": 0.1}, {"lr": 0.1}),
]


@pytest.mark.parametrize("name,g0,g1,kw", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_with_per_group_options_matches_dense(name, g0, g1, kw):
    """fused=True (where this torch has it on the CPU) with groups that differ per table: the
    same as the dense model stepped by the fused torch optimizer."""
    kw = {**kw, "fused": True}
    if not torch_steps(name, kw):
        pytest.skip(f"this torch has no CPU fused {name}")
    off, opt, ref, lazy = build(name, g0, g1, kw, seed=68)
    for s, batch in enumerate(data(69, 5)):
        train_step(off, opt, ref, lazy, batch, use_bag=s != 2)
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# structural options set before a table's first step
# ---------------------------------------------------------------------------------------------
FIRST_CASES = [
    ("Adam", {"lr": 0.05}, {"amsgrad": True}),
    ("RMSprop", {"lr": 0.01}, {"centered": True, "momentum": 0.5}),
    ("SGD", {"lr": 0.1}, {"momentum": 0.9, "nesterov": True}),
    ("Rprop", {"lr": 0.05}, {"lr": 0.01, "step_sizes": (1e-3, 0.02)}),
    ("ASGD", {"lr": 0.05}, {"lr": 0.02, "t0": 1}),
]


@pytest.mark.parametrize("when", ["before-any-step", "after-other-tables-stepped"])
@pytest.mark.parametrize("name,kw,opts", FIRST_CASES, ids=[c[0] for c in FIRST_CASES])
def test_structural_options_set_before_a_tables_first_step(name, kw, opts, when):
    """torch creates a parameter's state at its first step, from the group's options then:
    amsgrad / centered / momentum switched on in the bag's group before the bag's first step
    (also after the embedding and the head have stepped twice without the bag) give the bag
    the state torch gives it, and the same weights. The bag has a group of its own."""
    we, wb = w0(70), w0(71)
    torch.manual_seed(72)
    head = nn.Linear(D, 1)
    off = Mixed(off_emb(we), off_bag(wb), copy.deepcopy(head))
    ref = Dense(we, wb, copy.deepcopy(head), "sum")
    cls = getattr(torch.optim, name)
    opt = gl.OffloadedOptimizer(
        cls, [{"params": [off.emb, off.head]}, {"params": off.bag}], **copy.deepcopy(kw)
    )
    ropt = cls([{"params": [ref.E, *ref.head.parameters()]}, {"params": [ref.B]}], **kw)
    lazy = LazyDense(name, ropt, [ref.E, ref.B])
    first = 0 if when == "before-any-step" else 2
    for s, batch in enumerate(data(71, 5)):
        if s == first:
            for o in (opt, lazy.opt):
                o.param_groups[1].update(copy.deepcopy(opts))
        train_step(off, opt, ref, lazy, batch, use_bag=s >= first)
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# schedulers on the user's optimizer behind the switchers
# ---------------------------------------------------------------------------------------------
SWITCH_SCHED = [
    ("Rprop", {"lr": 0.05}, "LambdaLR"),  # lowers lr before the first step: step_size follows
    ("ASGD", {"lr": 0.05, "t0": 1}, "LambdaLR"),  # eta follows the first step's lr
    ("Adam", {"lr": 0.05, "amsgrad": True}, "OneCycleLR"),  # cycles beta1 per group
    ("SGD", {"lr": 0.1}, "OneCycleLR"),  # turns momentum on before the first step
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.1}, "StepLR"),
]


@pytest.mark.parametrize("face", ["cupy", "torch"])
@pytest.mark.parametrize("name,kw,kind", SWITCH_SCHED, ids=[f"{c[0]}-{c[2]}" for c in SWITCH_SCHED])
def test_switchers_scheduler_with_per_group_schedules(name, kw, kind, face):
    """A scheduler with one schedule per group on the user's optimizer (built after optInit,
    as SpeedTorch code does): README 'before the first step Rprop's step_size and ASGD's eta
    start from the first step's lr', OneCycleLR's beta1 / momentum per group; the switched
    tables equal the dense model driven by the same scheduler."""
    model, opt, us, vs, dense, lazy = switched_setup(name, {}, {}, kw, face, "cpu", seed=73)
    lrs = torch.optim.lr_scheduler

    def sched(o):
        if kind == "LambdaLR":
            return lrs.LambdaLR(o, [lambda k: 0.2 * (k + 1), lambda k: 1.0 / (k + 1)])
        if kind == "OneCycleLR":
            return lrs.OneCycleLR(o, max_lr=[0.2, 0.1], total_steps=7)
        return lrs.StepLR(o, step_size=2, gamma=0.5)

    s1, s2 = sched(opt), sched(lazy.opt)
    for s, (ids, ctx, y) in enumerate(switch_data(74, 6)):
        switched_step(model, opt, us, vs, ids, ctx, y, CPU, use_v=s != 1)
        ref_switched_step(dense, lazy, ids, ctx, y, use_v=s != 1)
        s1.step()
        s2.step()
    for g, rg in zip(opt.param_groups, lazy.opt.param_groups, strict=True):
        assert float(g["lr"]) == pytest.approx(float(rg["lr"]), rel=1e-12)
    assert_switched_match(model, us, vs, dense, lazy)


# ---------------------------------------------------------------------------------------------
# a table's own dict beside the whole model; a scheduler before a table's first step
# ---------------------------------------------------------------------------------------------
def test_table_dict_beside_the_model_gets_its_own_options():
    """OffloadedOptimizer docstring: 'What a dict names is left out of the modules given beside
    it ... everything not named by a dict shares one group with the keyword options'. The bag
    named in a dict with amsgrad and its own lr; the embedding and the head from the model."""
    we, wb = w0(75), w0(76)
    torch.manual_seed(77)
    head = nn.Linear(D, 1)
    off = Mixed(off_emb(we), off_bag(wb), copy.deepcopy(head))
    ref = Dense(we, wb, copy.deepcopy(head), "sum")
    extra = {"lr": 0.2, "amsgrad": True, "weight_decay": 0.1}
    opt = gl.OffloadedOptimizer(torch.optim.Adam, [off, {"params": off.bag, **extra}], lr=0.05)
    ropt = torch.optim.Adam(
        [{"params": [ref.E, *ref.head.parameters()]}, {"params": [ref.B], **extra}], lr=0.05
    )
    lazy = LazyDense("Adam", ropt, [ref.E, ref.B])
    assert len(opt.param_groups) == 2
    for batch in data(78, 4):
        train_step(off, opt, ref, lazy, batch)
    torch.testing.assert_close(table(off.emb), ref.E.detach(), **TOL)
    torch.testing.assert_close(table(off.bag), ref.B.detach(), **TOL)
    torch.testing.assert_close(off.head.weight.detach(), ref.head.weight.detach(), **TOL)
    # the state tables in some order: the bag's are the ones with amsgrad's table
    by_keys = {len(t): t for t in opt.state_dict()["tables"]}
    for rows, P in ((by_keys[2], ref.E), (by_keys[3], ref.B)):
        dense = dense_rows(lazy, P)
        assert set(rows) == set(dense)
        for k, v in rows.items():
            torch.testing.assert_close(v.cpu(), dense[k], **TOL)


@pytest.mark.parametrize("name,kw", [("Rprop", {"lr": 0.05}), ("ASGD", {"lr": 0.05, "t0": 1})])
def test_scheduler_moves_lr_before_the_bags_first_step(name, kw):
    """The bag is first looked up at step 3 while a LambdaLR has moved its group's lr every
    step: torch starts the bag's Rprop step_size / ASGD eta from the lr of the bag's own first
    step, and so must the bag's state tables."""
    off, opt, ref, lazy = build(name, {}, {}, kw, seed=79)
    s1 = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    s2 = torch.optim.lr_scheduler.LambdaLR(lazy.opt, lambda k: 1.0 / (k + 1))
    for s, batch in enumerate(data(80, 6)):
        train_step(off, opt, ref, lazy, batch, use_bag=s >= 3)
        s1.step()
        s2.step()
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# autocast around the forward
# ---------------------------------------------------------------------------------------------
def test_cpu_autocast_bfloat16_forward_trains_like_dense():
    """A mixed-precision loop on the CPU (torch.autocast bfloat16 around the forward, loss and
    backward outside): lookups keep the table's float32 as F.embedding does, the head runs in
    bfloat16, and the float32 tables equal the dense model run under the same autocast."""
    off, opt, ref, lazy = build("AdamW", {"weight_decay": 0.1}, {}, {"lr": 0.05}, seed=81)
    for ids, hist, y in data(82, 4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rows = off.emb(ids)
            pred = off(ids, hist)
            rpred = ref(ids, hist)
        assert rows.dtype == F32
        opt.zero_grad()
        F.mse_loss(pred.float(), y).backward()
        opt.step()
        lazy.opt.zero_grad()
        F.mse_loss(rpred.float(), y).backward()
        lazy.step([torch.cat([ids.reshape(-1), ids.reshape(-1)]), hist])
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# a regulariser written over param_groups between backward and step
# ---------------------------------------------------------------------------------------------
def test_manual_l2_over_param_groups_reaches_the_table_rows(placement):
    """A user's own L2 term applied to every gradient in param_groups before step()
    (``p.grad.add_(p, alpha=wd)``): README 'The tables' row gradients join param_groups as soon
    as anything walks the groups'; the parameters walked hold the batch's rows, so the result
    equals the dense model with the same manual L2 (and torch's weight_decay option)."""
    dev = dev_of(placement)
    off, opt, ref, lazy = build("Adam", {}, {}, {"lr": 0.05}, placement, seed=83)
    wd = 0.3
    for ids, hist, y in data(84, 4):
        opt.zero_grad()
        F.mse_loss(off(ids.to(dev), hist.to(dev)), y.to(dev)).backward()
        with torch.no_grad():
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.add_(p, alpha=wd)
        opt.step()
        lazy.opt.zero_grad()
        F.mse_loss(ref(ids, hist), y).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.grad.add_(p, alpha=wd)
        lazy.step([ids, hist])
    assert_match(off, opt, ref, lazy)


@pytest.mark.parametrize("how", ["uninterrupted", "state_dict", "checkpoint"])
@pytest.mark.parametrize("name,kw", [("Rprop", {"lr": 0.05}), ("ASGD", {"lr": 0.05, "t0": 1})])
def test_resume_before_the_bags_first_step_then_lr_moves(tmp_path, name, kw, how):
    """The bag has not been stepped when the state dict is saved (step 2); after the resume a
    LambdaLR keeps moving lr and the bag is first looked up at step 4. torch's saved state has
    no entry for the bag, so its state starts at the bag's first step from the lr then (Rprop's
    step_size, ASGD's eta); the resumed run must equal the dense model as the uninterrupted one
    does."""
    off, opt, ref, lazy = build(name, {}, {}, kw, seed=85)
    lam = lambda k: 1.0 / (k + 1)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    rs = torch.optim.lr_scheduler.LambdaLR(lazy.opt, lam)
    batches = data(86, 6)
    for s, batch in enumerate(batches):
        if s == 2 and how != "uninterrupted":
            buf = io.BytesIO()
            torch.save({"m": off.state_dict(), "o": opt.state_dict(), "s": sched.state_dict()}, buf)
            if how == "checkpoint":
                gl.save_checkpoint(tmp_path / "ck", {"m": off, "o": opt})
            off, opt, _, _ = build(name, {}, {}, kw, seed=87)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
            buf.seek(0)
            ck = torch.load(buf, weights_only=True)
            if how == "checkpoint":
                gl.load_checkpoint(tmp_path / "ck", {"m": off, "o": opt})
            else:
                off.load_state_dict(ck["m"])
                opt.load_state_dict(ck["o"])
            sched.load_state_dict(ck["s"])
        train_step(off, opt, ref, lazy, batch, use_bag=s >= 4)
        sched.step()
        rs.step()
    assert_match(off, opt, ref, lazy)


# DEFECT (Rprop-checkpoint case): see test_switchers_checkpoint_rprop_keeps_trained_step_sizes;
# load_checkpoint resets the Rprop step_size tables of the switchers to the checkpoint's lr.
@pytest.mark.parametrize("how", ["uninterrupted", "checkpoint"])
@pytest.mark.parametrize("name,kw", [("Rprop", {"lr": 0.05}), ("ASGD", {"lr": 0.05, "t0": 1})])
def test_switchers_resume_before_vs_first_step_then_lr_moves(tmp_path, name, kw, how):
    """The switchers' form of the test above: v is first looked up at step 4, the checkpoint
    (model, switchers, the user's optimizer) is taken at step 2 and loaded into fresh objects,
    a LambdaLR moves lr every step: v's state starts from the lr of its first step, as in the
    dense model."""
    lam = lambda k: 1.0 / (k + 1)  # noqa: E731
    parts = switched_setup(name, {}, {}, kw, "cupy", "cpu", seed=88)
    model, opt, us, vs, dense, lazy = parts
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    rs = torch.optim.lr_scheduler.LambdaLR(lazy.opt, lam)
    for s, (ids, ctx, y) in enumerate(switch_data(89, 6)):
        if s == 2 and how == "checkpoint":
            objs = {"model": model, "opt": opt, "su": us[0], "ou": us[1], "sv": vs[0], "ov": vs[1]}
            gl.save_checkpoint(tmp_path / "ck", objs)
            buf = io.BytesIO()
            torch.save(sched.state_dict(), buf)
            model, opt, us, vs, _, _ = switched_setup(name, {}, {}, kw, "cupy", "cpu", seed=90)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
            objs = {"model": model, "opt": opt, "su": us[0], "ou": us[1], "sv": vs[0], "ov": vs[1]}
            gl.load_checkpoint(tmp_path / "ck", objs)
            buf.seek(0)
            sched.load_state_dict(torch.load(buf, weights_only=True))
        switched_step(model, opt, us, vs, ids, ctx, y, CPU, use_v=s >= 4)
        ref_switched_step(dense, lazy, ids, ctx, y, use_v=s >= 4)
        sched.step()
        rs.step()
    assert_switched_match(model, us, vs, dense, lazy)


# DEFECT: load_checkpoint into switchers whose optimizer was built with another lr than the
# checkpoint holds (here: an LR scheduler had moved it, the usual case) overwrites the loaded
# Rprop step_size table with a fresh row's value at the loaded lr: every row's trained step size
# is lost. It happens when the torch optimizer comes before its optimizer switcher in the
# objects dict: the switcher's tables are loaded, then _need_pager() runs follow_hyper() while
# the pager still counts as fresh, sees the loaded lr and refills the tables. (With the
# optimizer after the switcher, or save/loadTorch plus load_state_dict, they are kept.)
@pytest.mark.parametrize("face", ["cupy", "torch"])
def test_switchers_checkpoint_rprop_keeps_trained_step_sizes(tmp_path, face):
    """Rprop behind the switchers with a LambdaLR; checkpoint after 3 steps (model, switchers,
    optimizer), fresh objects built with the constructor's lr, load_checkpoint and the
    scheduler's state: README 'load_checkpoint ... resumes bit-identically'. The state tables
    equal the saved ones right after the load, and the continued run equals the uninterrupted
    one bit for bit."""
    lam = lambda k: 1.0 / (k + 1)  # noqa: E731
    batches = switch_data(91, 6)

    def objects(parts):
        model, opt, (su, ou), (sv, ov) = parts[:4]
        return {"model": model, "opt": opt, "su": su, "ou": ou, "sv": sv, "ov": ov}

    def tables(parts):
        us, vs = parts[2], parts[3]
        out = [torch.from_numpy(us[0].getNumpyVersion()), torch.from_numpy(vs[0].getNumpyVersion())]
        for o in (us[1], vs[1]):
            out += [torch.from_numpy(v.copy()) for _, v in sorted(o.getNumpyVersion().items())]
        return out

    a = switched_setup("Rprop", {}, {}, {"lr": 0.05}, face, "cpu", seed=92)
    sa = torch.optim.lr_scheduler.LambdaLR(a[1], lam)
    b = switched_setup("Rprop", {}, {}, {"lr": 0.05}, face, "cpu", seed=92)
    sb = torch.optim.lr_scheduler.LambdaLR(b[1], lam)
    for s, (ids, ctx, y) in enumerate(batches):
        switched_step(*a[:4], ids, ctx, y, CPU)
        sa.step()
        if s < 3:
            switched_step(*b[:4], ids, ctx, y, CPU)
            sb.step()
    gl.save_checkpoint(tmp_path / "ck", objects(b))
    saved = tables(b)
    sched_state = sb.state_dict()
    c = switched_setup("Rprop", {}, {}, {"lr": 0.05}, face, "cpu", seed=93)
    sc = torch.optim.lr_scheduler.LambdaLR(c[1], lam)
    gl.load_checkpoint(tmp_path / "ck", objects(c))
    sc.load_state_dict(sched_state)
    assert_same(tables(c), saved)
    for ids, ctx, y in batches[3:]:
        switched_step(*c[:4], ids, ctx, y, CPU)
        sc.step()
    assert_same(tables(c), tables(a))
