"""Review (session 13): the drop-in module and the switchers driven with ordinary torch
training habits, each against a dense reference.

The reference is a plain torch model (``F.embedding`` / ``F.embedding_bag`` over dense float64
tables, the same ``nn.Linear`` head) trained by the same torch optimizer with the same
hyper-parameters. README "Duplicates" gives the equivalence: "results equal training the whole
table as one parameter with lazy per-row updates (rows outside a batch untouched, one step
count per table as in torch's SparseAdam)", so after each reference step the rows outside the
step's ids get back their weights and row-shaped state (``LazyDense``). Where torch has sparse
optimizers (SparseAdam, Adagrad, SGD) torch's own sparse embeddings are a second reference.

Habits covered: LR schedulers (StepLR, LambdaLR, OneCycleLR, ReduceLROnPlateau,
CosineAnnealingWarmRestarts, ChainedScheduler), optimizer step / state-dict hooks, several param
groups mixing tables and a Linear, hyper-parameter flags, gradient accumulation, steps without
lookups, gradient clipping, ``torch.save`` / ``torch.load(weights_only=True)`` resume,
rollback to an earlier state dict, evaluation lookups between steps, the module called twice in
one forward, and bad ids / offsets / weights to the modules and the switchers.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gadgetloader as gl

N, D = 50, 8
B = 6  # rows per batch
F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def dev_of(placement: str) -> torch.device:
    return CPU if placement == "cpu" else torch.device("cuda")


def w0(seed: int, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=F64)


def off_emb(w: torch.Tensor, placement: str = "cpu") -> gl.OffloadedEmbedding:
    return gl.OffloadedEmbedding(
        w.shape[0],
        D,
        placement=placement,
        dtype=F64,
        device=dev_of(placement),
        init=lambda t: t.copy_(w.to(t.device)),
    )


def off_bag(w: torch.Tensor, mode: str, placement: str = "cpu") -> gl.OffloadedEmbeddingBag:
    return gl.OffloadedEmbeddingBag(
        w.shape[0],
        D,
        mode=mode,
        placement=placement,
        dtype=F64,
        device=dev_of(placement),
        init=lambda t: t.copy_(w.to(t.device)),
    )


def table(m) -> torch.Tensor:
    """An offloaded module's whole table, copied to the CPU."""
    return m.weight.as_tensor().detach().to("cpu", copy=True)


def state_tables(opt: gl.OffloadedOptimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().cpu().clone() for k, v in t.items()} for t in opt.state_dict()["tables"]]


def fresh_row(name: str, key: str, group: dict, like: torch.Tensor) -> torch.Tensor:
    """The state row torch gives a row that was never trained."""
    if name == "Adagrad" and key == "sum":
        return torch.full_like(like, float(group.get("initial_accumulator_value", 0.0)))
    if name == "Rprop" and key == "step_size":
        return torch.full_like(like, float(group["lr"]))
    return torch.zeros_like(like)


class LazyDense:
    """A torch optimizer over dense full tables (``tables``) and ordinary parameters; after each
    step the rows of each table outside that step's ids get back their weights and row state.
    ``used[i] is None`` means table ``i`` had no lookup: it is not stepped at all (its gradient
    is dropped first, so torch counts no step for it either)."""

    def __init__(self, name: str, opt: torch.optim.Optimizer, tables: list[torch.Tensor]):
        self.name, self.opt, self.tables = name, opt, tables

    def _group(self, p: torch.Tensor) -> dict:
        return next(g for g in self.opt.param_groups if any(q is p for q in g["params"]))

    def _rows(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.opt.state.get(p, {})
        return {
            k: v.detach().clone()
            for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        }

    def step(self, used: list[torch.Tensor | None]) -> None:
        for p, ids in zip(self.tables, used, strict=True):
            if ids is None:
                p.grad = None
        snaps = [(p.detach().clone(), self._rows(p), dict(self._group(p))) for p in self.tables]
        self.opt.step()
        with torch.no_grad():
            for p, ids, (w_before, st_before, group) in zip(self.tables, used, snaps, strict=True):
                if ids is None:
                    continue
                keep = torch.ones(p.shape[0], dtype=torch.bool)
                keep[torch.as_tensor(ids).reshape(-1).long()] = False
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

    def forward(self, ids, hist):
        return self.head(self.emb(ids).sum(1) * self.bag(hist)).squeeze(-1)


class Dense(nn.Module):
    """The reference: the same model over two dense float64 tables."""

    def __init__(self, we: torch.Tensor, wb: torch.Tensor, head: nn.Linear, mode: str) -> None:
        super().__init__()
        self.E = nn.Parameter(we.clone())
        self.B = nn.Parameter(wb.clone())
        self.head, self.mode = head, mode

    def forward(self, ids, hist):
        rows = F.embedding(ids, self.E).sum(1) * F.embedding_bag(hist, self.B, mode=self.mode)
        return self.head(rows).squeeze(-1)


def build(name: str, kw: dict, placement: str = "cpu", seed: int = 0, mode: str = "mean"):
    """(offloaded model, its OffloadedOptimizer, dense model, its LazyDense), two param groups:
    the embedding table with the head's bias (own lr and weight decay), and the bag table with
    the head's weight (the keyword options)."""
    dev = dev_of(placement)
    we, wb = w0(seed), w0(seed + 1)
    torch.manual_seed(seed + 100)
    head = nn.Linear(D, 1, dtype=F64)
    off = Mixed(off_emb(we, placement), off_bag(wb, mode, placement), copy.deepcopy(head).to(dev))
    ref = Dense(we, wb, copy.deepcopy(head), mode)
    cls = getattr(torch.optim, name)
    g0 = {"lr": kw["lr"] * 2}
    if name not in ("Rprop", "SparseAdam"):
        g0["weight_decay"] = 0.05
    opt = gl.OffloadedOptimizer(
        cls,
        [{"params": [off.emb, off.head.bias], **g0}, {"params": [off.bag, off.head.weight]}],
        **kw,
    )
    ropt = cls(
        [{"params": [ref.head.bias, ref.E], **g0}, {"params": [ref.head.weight, ref.B]}], **kw
    )
    return off, opt, ref, LazyDense(name, ropt, [ref.E, ref.B])


def data(seed: int, steps: int, n: int = N):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, n, (B, 2), generator=g)
        ids[1, 0] = ids[0, 0]  # repeats within the batch
        ids[2, 1] = ids[2, 0]
        hist = torch.randint(0, n, (B, 3), generator=g)
        hist[3, 2] = hist[3, 0]
        y = torch.randn(B, generator=g, dtype=F64)
        out.append((ids, hist, y))
    return out


def off_loss(off: Mixed, batch, dev: torch.device) -> torch.Tensor:
    ids, hist, y = batch
    return F.mse_loss(off(ids, hist), y.to(dev))


def ref_loss(ref: Dense, batch) -> torch.Tensor:
    ids, hist, y = batch
    return F.mse_loss(ref(ids, hist), y)


def train_step(off, opt, ref, lazy, batch, dev=CPU):
    opt.zero_grad()
    lo = off_loss(off, batch, dev)
    lo.backward()
    opt.step()
    lazy.opt.zero_grad()
    lr_ = ref_loss(ref, batch)
    lr_.backward()
    lazy.step([batch[0], batch[1]])
    return float(lo.detach()), float(lr_.detach())


def assert_match(off: Mixed, opt, ref: Dense, lazy: LazyDense, tol=TOL) -> None:
    torch.testing.assert_close(table(off.emb), ref.E.detach(), **tol)
    torch.testing.assert_close(table(off.bag), ref.B.detach(), **tol)
    torch.testing.assert_close(off.head.weight.detach().cpu(), ref.head.weight.detach(), **tol)
    torch.testing.assert_close(off.head.bias.detach().cpu(), ref.head.bias.detach(), **tol)
    for rows, P in zip(opt.state_dict()["tables"], (ref.E, ref.B), strict=True):
        dense = {
            k: v for k, v in lazy.opt.state[P].items() if torch.is_tensor(v) and v.shape == P.shape
        }
        assert set(rows) == set(dense)
        for k, v in rows.items():
            torch.testing.assert_close(v.cpu(), dense[k], **tol)


def snapshot(off: Mixed, opt) -> list[torch.Tensor]:
    out = [table(off.emb), table(off.bag), off.head.weight.detach().cpu().clone()]
    out += [off.head.bias.detach().cpu().clone()]
    for t in state_tables(opt):
        out += [t[k] for k in sorted(t)]
    return out


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


# ---------------------------------------------------------------------------------------------
# LR schedulers on the wrapper, two param groups, tables and a Linear mixed
# ---------------------------------------------------------------------------------------------
SCHEDULERS = [
    ("StepLR", "AdamW", {"lr": 0.05, "amsgrad": True}),
    ("LambdaLR", "Adam", {"lr": 0.05}),
    ("OneCycleLR", "SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("ReduceLROnPlateau", "RMSprop", {"lr": 0.01, "centered": True}),
    ("CosineAnnealingWarmRestarts", "Adagrad", {"lr": 0.1, "lr_decay": 0.05}),
    ("ChainedScheduler", "NAdam", {"lr": 0.05}),
]


def make_sched(kind: str, opt):
    lrs = torch.optim.lr_scheduler
    if kind == "StepLR":
        return lrs.StepLR(opt, step_size=2, gamma=0.3)
    if kind == "LambdaLR":
        return lrs.LambdaLR(opt, [lambda k: 1.0 / (k + 1), lambda k: 0.5 + 0.5 * k])
    if kind == "OneCycleLR":
        return lrs.OneCycleLR(opt, max_lr=[0.3, 0.1], total_steps=7)
    if kind == "ReduceLROnPlateau":
        return lrs.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
    if kind == "CosineAnnealingWarmRestarts":
        return lrs.CosineAnnealingWarmRestarts(opt, T_0=4)
    return lrs.ChainedScheduler([lrs.ExponentialLR(opt, 0.8), lrs.StepLR(opt, 2, 0.5)])


@pytest.mark.parametrize("kind,name,kw", SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_scheduler_on_mixed_groups_matches_dense(kind, name, kw):
    """README: 'OffloadedOptimizer is a torch.optim.Optimizer. LR schedulers work'; every lr a
    scheduler sets reaches the tables at the next step, per group, and torch's order check sees
    a proper loop (no 'lr_scheduler.step() before optimizer.step()' warning)."""
    off, opt, ref, lazy = build(name, kw, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s_off, s_ref = make_sched(kind, opt), make_sched(kind, lazy.opt)
        history = []
        for batch in data(2, 6):
            history.append(tuple(float(g["lr"]) for g in opt.param_groups))
            assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx(
                [float(g["lr"]) for g in lazy.opt.param_groups], rel=1e-12
            )
            _, l_ref = train_step(off, opt, ref, lazy, batch)
            if kind == "ReduceLROnPlateau":
                s_off.step(l_ref)  # the same metric for both: the same decisions
                s_ref.step(l_ref)
            else:
                s_off.step()
                s_ref.step()
    order = [w for w in caught if "lr_scheduler" in str(w.message)]
    assert not order, [str(w.message) for w in order]
    lrs = [float(g["lr"]) for g in opt.param_groups]
    assert lrs == pytest.approx([float(g["lr"]) for g in lazy.opt.param_groups], rel=1e-12)
    assert len(set(history)) > 1  # the scheduler did move them
    assert_match(off, opt, ref, lazy)


def test_lr_zero_from_scheduler_freezes_the_next_step_exactly(placement):
    """An lr the scheduler sets takes effect on the very next step: lr 0 leaves every table
    row as it was (plain SGD, no weight decay), lr back to 1x moves them again."""
    dev = dev_of(placement)
    w = w0(3)
    emb = off_emb(w, placement)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.0 if k == 2 else 1.0)
    W = nn.Parameter(w.clone())
    ref = torch.optim.SGD([W], lr=0.2)
    rsched = torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 0.0 if k == 2 else 1.0)
    for k, (ids, _, y) in enumerate(data(4, 4)):
        before = table(emb)
        opt.zero_grad()
        (emb(ids).sum(-1).sum(-1) - y.to(dev)).pow(2).sum().backward()
        opt.step()
        sched.step()
        ref.zero_grad()
        (F.embedding(ids, W).sum(-1).sum(-1) - y).pow(2).sum().backward()
        ref.step()
        rsched.step()
        if k == 2:
            assert torch.equal(table(emb), before)
        else:
            assert not torch.equal(table(emb)[ids.unique()], before[ids.unique()])
    torch.testing.assert_close(table(emb), W.detach(), **TOL)


# ---------------------------------------------------------------------------------------------
# optimizer hooks
# ---------------------------------------------------------------------------------------------
def test_step_hooks_run_once_per_step_and_pre_hook_lr_reaches_tables():
    """torch's step hooks on the wrapper: a pre-hook that lowers every group's lr changes this
    very step's table update; a post-hook already sees the rows written back."""
    off, opt, ref, lazy = build("Adam", {"lr": 0.05}, seed=5)
    seen: dict[str, list] = {"pre": [], "post": [], "ref_post": []}

    def lower(o, args, kwargs) -> None:
        if o is opt:
            seen["pre"].append(1)
        for g in o.param_groups:
            g["lr"] = g["lr"] * 0.7

    opt.register_step_pre_hook(lower)
    opt.register_step_post_hook(lambda o, a, k: seen["post"].append(table(off.emb)))
    lazy.opt.register_step_pre_hook(lower)
    for batch in data(6, 4):
        train_step(off, opt, ref, lazy, batch)
        seen["ref_post"].append(ref.E.detach().clone())
    assert len(seen["pre"]) == 4 and len(seen["post"]) == 4
    for a, b in zip(seen["post"], seen["ref_post"], strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.7**4)
    assert_match(off, opt, ref, lazy)


# DEFECT: state-dict hooks registered on the wrapper (torch.optim.Optimizer's
# register_state_dict_pre/post_hook, register_load_state_dict_pre/post_hook) never run:
# OffloadedOptimizer.state_dict / load_state_dict bypass them, so an extra entry a post-hook
# adds is missing and a load pre-hook cannot strip it again.
def test_state_dict_hooks_registered_on_the_wrapper_run():
    emb = off_emb(w0(7))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    if not hasattr(opt, "register_load_state_dict_post_hook"):
        pytest.skip("this torch has no optimizer state-dict hooks")
    calls: list[str] = []

    def sd_post(o, sd):
        calls.append("state_dict_post")
        sd["epoch"] = 7
        return sd

    def load_pre(o, sd):
        calls.append("load_pre")
        sd = dict(sd)
        sd.pop("epoch", None)
        return sd

    opt.register_state_dict_pre_hook(lambda o: calls.append("state_dict_pre"))
    opt.register_state_dict_post_hook(sd_post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    emb(torch.tensor([1, 2, 2])).pow(2).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert calls == ["state_dict_pre", "state_dict_post"]
    assert sd.get("epoch") == 7
    opt.load_state_dict(sd)
    assert calls == ["state_dict_pre", "state_dict_post", "load_pre", "load_post"]


# ---------------------------------------------------------------------------------------------
# hyper-parameter flags, on a model mixing tables and a Linear
# ---------------------------------------------------------------------------------------------
FLAGS = [
    ("Adam", {"lr": 0.05, "amsgrad": True, "maximize": True, "foreach": False}),
    ("AdamW", {"lr": 0.05, "amsgrad": True, "weight_decay": 0.2, "foreach": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.8, "nesterov": True, "foreach": False}),
    ("SGD", {"lr": 0.1, "momentum": 0.8, "maximize": True, "foreach": True}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True, "foreach": True}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.1, "initial_accumulator_value": 0.3}),
    ("Adamax", {"lr": 0.05, "maximize": True}),
    ("RAdam", {"lr": 0.05, "decoupled_weight_decay": True}),
]


def _flag_id(case) -> str:
    name, kw = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in kw.items() if k != "lr")


@pytest.mark.parametrize("name,kw", FLAGS, ids=[_flag_id(c) for c in FLAGS])
def test_flags_on_mixed_model_match_dense(placement, name, kw):
    if "decoupled_weight_decay" in kw and "decoupled_weight_decay" not in (
        inspect.signature(getattr(torch.optim, name)).parameters
    ):
        pytest.skip("this torch's RAdam has no decoupled_weight_decay")
    dev = dev_of(placement)
    off, opt, ref, lazy = build(name, kw, placement, seed=8)
    for batch in data(9, 4):
        train_step(off, opt, ref, lazy, batch, dev)
    assert_match(off, opt, ref, lazy)


def test_sgd_dampening_starts_row_momentum_at_zero_as_readme_says():
    """README: 'SGD with dampening != 0 starts a row's momentum at zero, where torch starts it
    at the first gradient.' The reference: torch's SGD with every momentum buffer seeded zero."""
    kw = {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}
    w = w0(10)
    emb = off_emb(w)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, **kw)
    W = nn.Parameter(w.clone())
    lazy = LazyDense("SGD", torch.optim.SGD([W], **kw), [W])
    lazy.opt.state[W]["momentum_buffer"] = torch.zeros_like(W)
    for ids, _, y in data(11, 4):
        opt.zero_grad()
        (emb(ids).sum((1, 2)) - y).pow(2).sum().backward()
        opt.step()
        lazy.opt.zero_grad()
        (F.embedding(ids, W).sum((1, 2)) - y).pow(2).sum().backward()
        lazy.step([ids])
    torch.testing.assert_close(table(emb), W.detach(), **TOL)
    torch.testing.assert_close(
        opt.state_dict()["tables"][0]["momentum_buffer"].cpu(),
        lazy.opt.state[W]["momentum_buffer"],
        **TOL,
    )


SPARSE = [
    ("SparseAdam", {"lr": 0.05, "maximize": True}),
    ("SparseAdam", {"lr": 0.05, "betas": (0.5, 0.9)}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.1, "initial_accumulator_value": 0.3}),
    ("SGD", {"lr": 0.1, "maximize": True}),
]


@pytest.mark.parametrize("name,kw", SPARSE, ids=[_flag_id(c) for c in SPARSE])
def test_torch_sparse_optimizers_as_reference(name, kw):
    """torch's own sparse embeddings (sparse=True) with SparseAdam / Adagrad / SGD are lazy per
    row by construction: an embedding looked up twice per forward and a bag must equal them."""
    we, wb = w0(12), w0(13)
    emb, bag = off_emb(we), off_bag(wb, "sum")
    opt = gl.OffloadedOptimizer(getattr(torch.optim, name), [emb, bag], **kw)
    remb = nn.Embedding(N, D, sparse=True, dtype=F64)
    rbag = nn.EmbeddingBag(N, D, mode="sum", sparse=True, dtype=F64)
    with torch.no_grad():
        remb.weight.copy_(we)
        rbag.weight.copy_(wb)
    ropt = getattr(torch.optim, name)([remb.weight, rbag.weight], **kw)

    def loss(e, b, ids, hist, y):
        x = e(ids).sum(1) + e(ids[:2].flip(0)).sum(1).sum(0) * b(hist)
        return (x.sum(-1) - y).pow(2).sum() + x.pow(3).sum() * 0.01

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's sparse invariant-check notice
        for ids, hist, y in data(14, 5):
            opt.zero_grad()
            loss(emb, bag, ids, hist, y).backward()
            opt.step()
            ropt.zero_grad()
            loss(remb, rbag, ids, hist, y).backward()
            ropt.step()
    torch.testing.assert_close(table(emb), remb.weight.detach(), **TOL)
    torch.testing.assert_close(table(bag), rbag.weight.detach(), **TOL)


# ---------------------------------------------------------------------------------------------
# gradient accumulation, zero_grad forms, steps without lookups
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_two_micro_batches(placement, set_to_none):
    """Two forward/backward calls before one step(), with things users do between them:
    reading the lr from param_groups (which merges the gradients so far), an evaluation lookup
    under no_grad and a training lookup whose output is never used."""
    dev = dev_of(placement)
    off, opt, ref, lazy = build("Adam", {"lr": 0.05}, placement, seed=15)
    batches = data(16, 6)
    for s in range(3):
        micro = batches[2 * s : 2 * s + 2]
        opt.zero_grad(set_to_none=set_to_none)
        lazy.opt.zero_grad(set_to_none=set_to_none)
        for i, batch in enumerate(micro):
            (off_loss(off, batch, dev) / 2).backward()
            (ref_loss(ref, batch) / 2).backward()
            if i == 0:
                assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.1)
                with torch.no_grad():
                    seen = off.emb(micro[1][0])
                torch.testing.assert_close(
                    seen.cpu(), F.embedding(micro[1][0], ref.E.detach()), **TOL
                )
                off.bag(micro[1][1])  # looked up with gradients on, never used
        opt.step()
        used = [
            torch.cat([b[0].reshape(-1) for b in micro]),
            torch.cat([b[1].reshape(-1) for b in micro]),
        ]
        lazy.step(used)
    assert_match(off, opt, ref, lazy)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_step_without_lookups_moves_dense_params_like_torch_and_leaves_tables(set_to_none):
    """README: 'a table with no lookup since the last step is not stepped and its step count
    does not move'; the ordinary parameters do what torch does (with set_to_none=False Adam
    moves the head by its moments on a zero gradient)."""
    off, opt, ref, lazy = build("Adam", {"lr": 0.05}, seed=17)
    b = data(18, 3)
    train_step(off, opt, ref, lazy, b[0])
    tables_before = [table(off.emb), table(off.bag)]
    states_before = state_tables(opt)
    head_before = off.head.weight.detach().clone()
    opt.zero_grad(set_to_none=set_to_none)
    opt.step()  # no forward since the last step
    lazy.opt.zero_grad(set_to_none=set_to_none)
    lazy.step([None, None])
    assert torch.equal(table(off.emb), tables_before[0])
    assert torch.equal(table(off.bag), tables_before[1])
    for a, bb in zip(state_tables(opt), states_before, strict=True):
        for k in a:
            assert torch.equal(a[k], bb[k])
    assert torch.equal(off.head.weight.detach(), head_before) == set_to_none
    train_step(off, opt, ref, lazy, b[1])  # the tables' bias correction counts 2 steps, not 3
    train_step(off, opt, ref, lazy, b[2])
    assert_match(off, opt, ref, lazy)


def test_module_called_twice_per_forward_with_overlapping_ids(placement):
    """The same embedding and bag called twice in one forward (the same id tensor object, and
    overlapping ids): gradients of both calls add up, as with nn.Embedding."""
    dev = dev_of(placement)
    off, opt, ref, lazy = build("AdamW", {"lr": 0.05}, placement, seed=19)
    for ids, hist, y in data(20, 4):
        other = torch.cat([ids[:, :1], (ids[:, 1:] + 1) % N], 1)
        a = off.emb(ids).sum(1) * off.emb(ids).sum(1) + off.emb(other).sum(1)
        a = a * off.bag(hist) - off.bag(hist[:, :2])
        opt.zero_grad()
        F.mse_loss(off.head(a).squeeze(-1), y.to(dev)).backward()
        opt.step()
        E, Bw = ref.E, ref.B
        r = F.embedding(ids, E).sum(1) * F.embedding(ids, E).sum(1) + F.embedding(other, E).sum(1)
        r = r * F.embedding_bag(hist, Bw, mode="mean") - F.embedding_bag(
            hist[:, :2], Bw, mode="mean"
        )
        lazy.opt.zero_grad()
        F.mse_loss(ref.head(r).squeeze(-1), y).backward()
        lazy.step([torch.cat([ids.reshape(-1), other.reshape(-1)]), hist])
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# gradient clipping between backward and step
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clip", ["norm-foreach", "norm-loop", "value", "norm-inf"])
def test_clipping_over_param_groups_with_accumulation(clip):
    """README: clip over the optimizer's groups. With two micro-batches and an lr read between
    them, the clipped gradients (and the returned total norm) equal the dense model's: the dense
    tables' gradients outside the batch are zero, so the norms agree."""
    off, opt, ref, lazy = build("SGD", {"lr": 0.2, "momentum": 0.5}, seed=21)
    batches = data(22, 6)
    for s in range(3):
        micro = batches[2 * s : 2 * s + 2]
        opt.zero_grad()
        lazy.opt.zero_grad()
        for batch in micro:
            (5 * off_loss(off, batch, CPU)).backward()
            (5 * ref_loss(ref, batch)).backward()
            _ = opt.param_groups[1]["lr"]
        ps = [p for g in opt.param_groups for p in g["params"]]
        rps = [p for g in lazy.opt.param_groups for p in g["params"]]
        if clip == "value":
            torch.nn.utils.clip_grad_value_(ps, 0.05)
            torch.nn.utils.clip_grad_value_(rps, 0.05)
        else:
            kind = {"norm-foreach": {"foreach": True}, "norm-loop": {"foreach": False}}
            extra = kind.get(clip, {"norm_type": float("inf")})
            a = torch.nn.utils.clip_grad_norm_(ps, 0.3, **extra)
            b = torch.nn.utils.clip_grad_norm_(rps, 0.3, **extra)
            torch.testing.assert_close(a, b, **TOL)
            assert float(a) > 0.3  # clipping did happen
        opt.step()
        lazy.step(
            [
                torch.cat([b[0].reshape(-1) for b in micro]),
                torch.cat([b[1].reshape(-1) for b in micro]),
            ]
        )
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# state_dict resume and rollback
# ---------------------------------------------------------------------------------------------
def test_torch_save_weights_only_resume_is_bit_identical(placement, tmp_path):
    """The usual checkpoint: torch.save of model / optimizer / scheduler state dicts, read back
    with torch.load(weights_only=True) into freshly built objects (other initial weights, other
    lr); README: 'resumes bit-identically'. Continued training equals uninterrupted training."""
    dev = dev_of(placement)
    kw = {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}
    batches = data(23, 6)

    def make(seed, lr):
        off, opt, _, _ = build("AdamW", {**kw, "lr": lr}, placement, seed=seed)
        return off, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def run(off, opt, sched, part):
        for batch in part:
            opt.zero_grad()
            off_loss(off, batch, dev).backward()
            opt.step()
            sched.step()

    a = make(24, 0.05)
    run(*a, batches)
    b = make(24, 0.05)
    run(*b, batches[:3])
    path = tmp_path / "ck.pt"
    torch.save(
        {"model": b[0].state_dict(), "opt": b[1].state_dict(), "sched": b[2].state_dict()}, path
    )
    del b
    c = make(99, 0.5)
    ck = torch.load(path, weights_only=True)
    c[0].load_state_dict(ck["model"])
    c[1].load_state_dict(ck["opt"])
    c[2].load_state_dict(ck["sched"])
    run(*c, batches[3:])
    assert_same(snapshot(c[0], c[1]), snapshot(a[0], a[1]))
    assert [g["lr"] for g in c[1].param_groups] == [g["lr"] for g in a[1].param_groups]


def test_rollback_to_state_dict_saved_before_first_step(placement):
    """Loading the state dict an optimizer had before its first step into the trained one
    starts its state afresh (as torch's load does): zero moments and step counts, so the next
    steps equal a fresh optimizer built over the same weights."""
    dev = dev_of(placement)
    batches = data(25, 5)
    off, opt, _, _ = build("Adam", {"lr": 0.05}, placement, seed=26)
    sd0 = copy.deepcopy(opt.state_dict())
    for batch in batches[:3]:
        opt.zero_grad()
        off_loss(off, batch, dev).backward()
        opt.step()
    opt.load_state_dict(sd0)
    for t in state_tables(opt):
        for v in t.values():
            assert not v.any()
    fresh, fopt, _, _ = build("Adam", {"lr": 0.05}, placement, seed=26)
    fresh.load_state_dict(off.state_dict())
    for batch in batches[3:]:
        for m, o in ((off, opt), (fresh, fopt)):
            o.zero_grad()
            off_loss(m, batch, dev).backward()
            o.step()
    assert_same(snapshot(off, opt), snapshot(fresh, fopt))


# ---------------------------------------------------------------------------------------------
# evaluation lookups between training steps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["eval-no_grad", "inference_mode", "eval-with-grad-no-backward"])
def test_eval_lookups_between_steps_change_nothing(placement, how):
    """Validation between training steps (ids overlapping the next batch): the results equal a
    run without it bit for bit, and what it sees equals the dense model's rows at that time.
    The last form is the habit of validating with model.eval() but without no_grad."""
    dev = dev_of(placement)
    batches = data(27, 5)
    a_off, a_opt, ref, lazy = build("RMSprop", {"lr": 0.01, "momentum": 0.5}, placement, seed=28)
    b_off, b_opt, _, _ = build("RMSprop", {"lr": 0.01, "momentum": 0.5}, placement, seed=28)
    for k, batch in enumerate(batches):
        train_step(a_off, a_opt, ref, lazy, batch, dev)
        b_opt.zero_grad()
        off_loss(b_off, batch, dev).backward()
        b_opt.step()
        if k + 1 < len(batches):
            nxt = batches[k + 1]
            b_off.eval()
            if how == "inference_mode":
                with torch.inference_mode():
                    pred = b_off(nxt[0], nxt[1])
            elif how == "eval-no_grad":
                with torch.no_grad():
                    pred = b_off(nxt[0], nxt[1])
            else:
                pred = b_off(nxt[0], nxt[1])
                float(F.mse_loss(pred, nxt[2].to(dev)).detach())  # a validation loss, no backward
            b_off.train()
            with torch.no_grad():
                torch.testing.assert_close(pred.detach().cpu(), ref(nxt[0], nxt[1]), **TOL)
    assert_same(snapshot(b_off, b_opt), snapshot(a_off, a_opt))
    assert_match(b_off, b_opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# bad input: refused with a GadgetError, nothing changed, earlier micro-batches kept
# ---------------------------------------------------------------------------------------------
BAD_IDS = {
    "out_of_range": (lambda: torch.tensor([[1, N + 7]]), IndexError, ["57", "50"]),
    "negative": (lambda: torch.tensor([[-3, 1]]), IndexError, ["-3"]),
    "float_tensor": (lambda: torch.tensor([[1.0, 2.0]]), TypeError, ["float"]),
    "bool_tensor": (lambda: torch.tensor([[True, False]]), TypeError, ["bool"]),
    "numpy_float": (lambda: np.array([[1.5, 2.0]]), TypeError, ["float"]),
    "ragged_list": (lambda: [[1, 2], [3]], TypeError, ["ragged"]),
    "none": (lambda: None, TypeError, ["NoneType"]),
    "huge_uint64": (lambda: np.array([[2**63 + 5, 1]], dtype=np.uint64), IndexError, []),
    "int8_negative": (lambda: np.array([[-1, 2]], dtype=np.int8), IndexError, ["-1"]),
}


@pytest.mark.parametrize("bad", list(BAD_IDS))
def test_bad_ids_in_second_micro_batch_refused_first_kept(placement, bad):
    """README: bad ids 'raise a gl.GadgetError subclass (also an IndexError / TypeError /
    ValueError) that says what was expected and what arrived, before anything is written';
    CPU ids are checked before the forward returns. The first micro-batch's gradient survives
    and the step equals the dense model trained on that micro-batch alone."""
    dev = dev_of(placement)
    make, builtin, words = BAD_IDS[bad]
    off, opt, ref, lazy = build("Adam", {"lr": 0.05}, placement, seed=29)
    batches = data(30, 2)
    train_step(off, opt, ref, lazy, batches[0], dev)
    before = snapshot(off, opt)
    opt.zero_grad()
    off_loss(off, batches[1], dev).backward()
    with pytest.raises(gl.GadgetError) as ei:
        off.emb(make())
    assert isinstance(ei.value, builtin)
    for w in words:
        assert w in str(ei.value)
    assert_same(snapshot(off, opt), before)
    opt.step()
    lazy.opt.zero_grad()
    ref_loss(ref, batches[1]).backward()
    lazy.step([batches[1][0], batches[1][1]])
    assert_match(off, opt, ref, lazy)


BAD_BAG = {
    "offsets_float": (lambda i: (i, torch.tensor([0.0, 2.0])), {}, TypeError),
    "offsets_not_at_zero": (lambda i: (i, torch.tensor([1, 3])), {}, ValueError),
    "offsets_decreasing": (lambda i: (i, torch.tensor([0, 4, 2])), {}, ValueError),
    "offsets_past_end": (lambda i: (i, torch.tensor([0, 99])), {}, ValueError),
    "offsets_2d": (lambda i: (i, torch.tensor([[0, 2]])), {}, ValueError),  # as torch
    "offsets_with_2d_input": (lambda i: (i.reshape(2, -1), torch.tensor([0, 1])), {}, ValueError),
    "ids_out_of_range": (
        lambda i: (torch.cat([i, torch.tensor([N])]), torch.tensor([0, 2])),
        {},
        IndexError,
    ),
    "psw_shape": (lambda i: (i, torch.tensor([0, 2])), {"psw": "short"}, (TypeError, ValueError)),
    "psw_int": (lambda i: (i, torch.tensor([0, 2])), {"psw": "int"}, (TypeError, ValueError)),
}


@pytest.mark.parametrize("bad", list(BAD_BAG))
def test_bag_bad_arguments_in_second_micro_batch_refused_first_kept(placement, bad):
    """OffloadedEmbeddingBag docstring: offsets and per_sample_weights 'are checked before the
    lookup is recorded ... so a bad call leaves nothing for the step'."""
    dev = dev_of(placement)
    make, extra, builtin = BAD_BAG[bad]
    off, opt, ref, lazy = build("Adam", {"lr": 0.05}, placement, seed=31, mode="sum")
    batches = data(32, 2)
    train_step(off, opt, ref, lazy, batches[0], dev)
    before = snapshot(off, opt)
    opt.zero_grad()
    off_loss(off, batches[1], dev).backward()
    ids, offsets = make(torch.tensor([3, 4, 4, 9, 11, 12]))
    kwargs = {}
    if extra.get("psw") == "short":
        kwargs["per_sample_weights"] = torch.ones(ids.numel() - 1, dtype=F64, device=dev)
    elif extra.get("psw") == "int":
        kwargs["per_sample_weights"] = torch.ones(ids.numel(), dtype=torch.int64, device=dev)
    with pytest.raises(gl.GadgetError) as ei:
        off.bag(ids, offsets, **kwargs)
    assert isinstance(ei.value, builtin)
    assert_same(snapshot(off, opt), before)
    opt.step()
    lazy.opt.zero_grad()
    ref_loss(ref, batches[1]).backward()
    lazy.step([batches[1][0], batches[1][1]])
    assert_match(off, opt, ref, lazy)


# DEFECT: offsets or per_sample_weights on a device torch cannot read (here 'meta') escape as
# a bare RuntimeError ("Tensor.item() cannot be called on meta tensors") / NotImplementedError
# ("Cannot copy out of meta tensor") instead of the GadgetTypeError that ids on the same device
# get ("ids must be on the CPU or a CUDA device; got meta").
@pytest.mark.parametrize("where", ["offsets", "per_sample_weights"])
def test_bag_arguments_on_an_unsupported_device_refused_with_gadget_error(where):
    off, opt, ref, lazy = build("SGD", {"lr": 0.1}, seed=36, mode="sum")
    ids, offsets, psw = torch.tensor([3, 4, 4, 9]), torch.tensor([0, 2]), None
    if where == "offsets":
        offsets = offsets.to("meta")
    else:
        psw = torch.ones(4, dtype=F64, device="meta")
    before = snapshot(off, opt)
    with pytest.raises(gl.GadgetError) as ei:
        off.bag(ids, offsets, per_sample_weights=psw)
    assert isinstance(ei.value, TypeError)
    assert "meta" in str(ei.value)
    assert_same(snapshot(off, opt), before)
    train_step(off, opt, ref, lazy, data(37, 1)[0])  # nothing of the refused call is stepped
    assert_match(off, opt, ref, lazy)


def test_reused_id_buffer_refilled_between_micro_batches(placement):
    """A loader that refills one id buffer in place for every micro-batch (and once more before
    the step): each lookup keeps the ids it was called with, as nn.Embedding's does."""
    dev = dev_of(placement)
    off, opt, ref, lazy = build("Adam", {"lr": 0.05}, placement, seed=38)
    batches = data(39, 4)
    ids_buf, hist_buf = batches[0][0].clone(), batches[0][1].clone()
    for s in range(2):
        micro = batches[2 * s : 2 * s + 2]
        opt.zero_grad()
        lazy.opt.zero_grad()
        for ids, hist, y in micro:
            ids_buf.copy_(ids)
            hist_buf.copy_(hist)
            (off_loss(off, (ids_buf, hist_buf, y), dev) / 2).backward()
            (ref_loss(ref, (ids, hist, y)) / 2).backward()
        ids_buf.random_(0, N)
        hist_buf.random_(0, N)
        opt.step()
        lazy.step(
            [
                torch.cat([b[0].reshape(-1) for b in micro]),
                torch.cat([b[1].reshape(-1) for b in micro]),
            ]
        )
    assert_match(off, opt, ref, lazy)


# ---------------------------------------------------------------------------------------------
# the switchers with ordinary torch habits
# ---------------------------------------------------------------------------------------------
def _switched(name: str, kw: dict, placement: str):
    """A model with a switched nn.Embedding (float64) and a Linear head, one torch optimizer
    with two groups (the embedding with its own lr and weight decay), and the dense reference."""
    dev = dev_of(placement)
    torch.manual_seed(33)
    model = nn.ModuleDict(
        {"emb": nn.Embedding(3, D, dtype=F64), "head": nn.Linear(D, 1, dtype=F64)}
    ).to(dev)
    sw = gl.ModelFactory(model["emb"], N, D, datatype="float64", placement=placement)
    sw.normalDistributionInit(0.0, 1.0)
    cls = getattr(torch.optim, name)
    groups = [
        {"params": model["emb"].parameters(), "weight_decay": 0.05, "lr": kw["lr"] * 2},
        {"params": model["head"].parameters()},
    ]
    opt = cls(groups, **kw)
    osw = gl.OptimizerFactory(opt, N, D, model, "emb", dtype="float64", placement=placement)
    osw.optInit()
    W = nn.Parameter(torch.from_numpy(sw.getNumpyVersion().copy()))
    rhead = copy.deepcopy(model["head"]).to(CPU)
    ropt = cls(
        [
            {"params": [W], "weight_decay": 0.05, "lr": kw["lr"] * 2},
            {"params": rhead.parameters()},
        ],
        **kw,
    )
    return model, opt, sw, osw, W, rhead, LazyDense(name, ropt, [W])


def _switched_step(model, opt, sw, osw, ids, y, dev, clip=None):
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    opt.zero_grad(set_to_none=False)
    F.mse_loss(model["head"](model["emb"](local).sum(1)).squeeze(-1), y.to(dev)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
    opt.step()
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)
    return norm


@pytest.mark.parametrize(
    "name,kw",
    [
        ("Adam", {"lr": 0.05, "amsgrad": True}),
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("RMSprop", {"lr": 0.01, "centered": True, "momentum": 0.5}),
    ],
    ids=["Adam-amsgrad", "SGD-nesterov", "RMSprop-centered"],
)
def test_switchers_with_groups_clipping_scheduler_match_dense(placement, name, kw):
    """SpeedTorch's loop with torch habits on the user's own optimizer: two param groups,
    zero_grad(set_to_none=False), clip_grad_norm_ over model.parameters() (the per-step variable
    holds the batch's rows, so the norm equals the full table's) and a StepLR."""
    dev = dev_of(placement)
    model, opt, sw, osw, W, rhead, lazy = _switched(name, kw, placement)
    s1 = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    s2 = torch.optim.lr_scheduler.StepLR(lazy.opt, 2, 0.5)
    for ids, _, y in data(34, 5):
        n1 = _switched_step(model, opt, sw, osw, ids, y, dev, clip=0.5)
        s1.step()
        lazy.opt.zero_grad(set_to_none=False)
        F.mse_loss(rhead(F.embedding(ids, W).sum(1)).squeeze(-1), y).backward()
        n2 = torch.nn.utils.clip_grad_norm_([W, *rhead.parameters()], 0.5)
        lazy.step([ids])
        s2.step()
        torch.testing.assert_close(n1.cpu(), n2, **TOL)
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), W.detach(), **TOL)
    torch.testing.assert_close(model["head"].weight.detach().cpu(), rhead.weight.detach(), **TOL)
    for k, v in osw.getNumpyVersion().items():
        torch.testing.assert_close(torch.from_numpy(v), lazy.opt.state[W][k], **TOL)


SWITCH_BAD = {
    "out_of_range": (lambda: torch.tensor([[1, N]]), IndexError),
    "negative": (lambda: torch.tensor([[2, -1]]), IndexError),
    "float": (lambda: torch.tensor([[1.0, 2.0]]), TypeError),
    "bool": (lambda: torch.tensor([[True, False]]), TypeError),
    "numpy_float": (lambda: np.array([[1.0, 2.0]]), TypeError),
}


@pytest.mark.parametrize("bad", list(SWITCH_BAD))
def test_switchers_bad_ids_mid_training_change_nothing(placement, bad):
    """Bad ids to either switcher's beforeForwardPass raise a GadgetError subclass (and the
    builtin) before anything is written: the table and the state tables stay as they were, and
    training continues exactly like the dense model that never saw the bad call."""
    dev = dev_of(placement)
    make, builtin = SWITCH_BAD[bad]
    name, kw = "RMSprop", {"lr": 0.01, "centered": True, "momentum": 0.5}
    model, opt, sw, osw, W, rhead, lazy = _switched(name, kw, placement)
    batches = data(35, 3)

    def ref_step(ids, y):
        lazy.opt.zero_grad(set_to_none=False)
        F.mse_loss(rhead(F.embedding(ids, W).sum(1)).squeeze(-1), y).backward()
        lazy.step([ids])

    ids, _, y = batches[0]
    _switched_step(model, opt, sw, osw, ids, y, dev)
    ref_step(ids, y)
    t0 = sw.getNumpyVersion().copy()
    s0 = {k: v.copy() for k, v in osw.getNumpyVersion().items()}
    for call in (sw.beforeForwardPass, osw.beforeForwardPass):
        with pytest.raises(gl.GadgetError) as ei:
            call(make())
        assert isinstance(ei.value, builtin)
        np.testing.assert_array_equal(sw.getNumpyVersion(), t0)
        for k, v in osw.getNumpyVersion().items():
            np.testing.assert_array_equal(v, s0[k])
    for ids, _, y in batches[1:]:
        _switched_step(model, opt, sw, osw, ids, y, dev)
        ref_step(ids, y)
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), W.detach(), **TOL)
    for k, v in osw.getNumpyVersion().items():
        torch.testing.assert_close(torch.from_numpy(v), lazy.opt.state[W][k], **TOL)


@pytest.mark.parametrize("grad", ["enabled", "no_grad"])
def test_switchers_validation_lookups_between_steps_change_nothing(grad):
    """Validation between steps through the switchers (beforeForwardPass of both switchers, a
    forward, no step and no afterOptimizerStep), with model.eval() and gradients on or off: the
    next training steps equal a run without validation bit for bit."""
    name, kw = "Adam", {"lr": 0.05}
    a = _switched(name, kw, "cpu")
    b = _switched(name, kw, "cpu")
    batches = data(40, 4)
    for k, (ids, _, y) in enumerate(batches):
        _switched_step(*a[:4], ids, y, CPU)
        _switched_step(*b[:4], ids, y, CPU)
        model, _, sw, osw = b[:4]
        vids = batches[(k + 1) % len(batches)][0]
        model.eval()
        with torch.set_grad_enabled(grad == "enabled"):
            local = sw.beforeForwardPass(vids)
            osw.beforeForwardPass(vids)
            pred = model["head"](model["emb"](local).sum(1)).squeeze(-1)
        model.train()
        W = torch.from_numpy(a[2].getNumpyVersion())
        with torch.no_grad():
            expect = a[0]["head"](F.embedding(vids, W).sum(1)).squeeze(-1)
        torch.testing.assert_close(pred.detach(), expect, **TOL)
    np.testing.assert_array_equal(b[2].getNumpyVersion(), a[2].getNumpyVersion())
    for k, v in a[3].getNumpyVersion().items():
        np.testing.assert_array_equal(b[3].getNumpyVersion()[k], v)
    assert torch.equal(b[0]["head"].weight, a[0]["head"].weight)
