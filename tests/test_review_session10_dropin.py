"""Review (session 10): OffloadedEmbedding / OffloadedEmbeddingBag / OffloadedOptimizer used as a
drop-in for nn.Embedding / nn.EmbeddingBag in ordinary training code.

Every training test builds the same model twice: once with the offloaded module, once with a
plain ``nn.Embedding`` / ``nn.EmbeddingBag`` trained by the same torch optimizer with lazy-row
semantics (README "Duplicates": rows outside a batch untouched, weights and row state, one
step count per table). Values must match to float32 rounding.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gadgetloader as gl

N, D = 30, 5
TOL = {"rtol": 1e-5, "atol": 1e-6}


def half_tol(dtype: torch.dtype) -> dict[str, float]:
    """About one rounding step of a 16-bit dtype: torch's CPU kernels round a row differently
    depending on where it falls in a vectorised loop, so a subset of rows updated on its own can
    differ from the same rows updated inside the whole table by one ulp."""
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return {"rtol": 2 * eps, "atol": eps}
    return TOL


PLACEMENTS = [
    pytest.param("cpu", id="cpu"),
    # 'pinned' falls back to host RAM (with a FallbackWarning) where there is no GPU
    pytest.param(
        "pinned",
        id="pinned",
        marks=pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning"),
    ),
]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def weights(seed: int = 0, n: int = N, d: int = D, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)


def off_emb(w: torch.Tensor, placement: str = "cpu") -> gl.OffloadedEmbedding:
    return gl.OffloadedEmbedding(
        w.shape[0],
        w.shape[1],
        placement=placement,
        dtype=w.dtype,
        device="cpu",
        init=lambda t: t.copy_(w.to(t.dtype)),
    )


def off_bag(w: torch.Tensor, mode: str, placement: str = "cpu", **kw) -> gl.OffloadedEmbeddingBag:
    return gl.OffloadedEmbeddingBag(
        w.shape[0],
        w.shape[1],
        mode=mode,
        placement=placement,
        dtype=w.dtype,
        device="cpu",
        init=lambda t: t.copy_(w.to(t.dtype)),
        **kw,
    )


def ref_emb(w: torch.Tensor, **kw) -> nn.Embedding:
    e = nn.Embedding(w.shape[0], w.shape[1], dtype=w.dtype, **kw)
    with torch.no_grad():
        e.weight.copy_(w)
    return e


def ref_bag(w: torch.Tensor, mode: str, **kw) -> nn.EmbeddingBag:
    e = nn.EmbeddingBag(w.shape[0], w.shape[1], mode=mode, dtype=w.dtype, **kw)
    with torch.no_grad():
        e.weight.copy_(w)
    return e


def table(m) -> torch.Tensor:
    """The offloaded module's whole table (a copy, on the CPU: a ``pinned`` table's tensor is
    its CUDA view where there is a GPU)."""
    return m.weight.as_tensor().detach().to("cpu", copy=True)


class Net(nn.Module):
    def __init__(self, emb: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.emb = emb
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids))).sum(dim=-2).squeeze(-1)


def pair(seed: int = 0, placement: str = "cpu", dtype: torch.dtype = torch.float32):
    """(offloaded model, reference model) with identical weights."""
    w = weights(seed, dtype=dtype)
    torch.manual_seed(seed + 100)
    head = nn.Linear(D, 1, dtype=dtype)
    return Net(off_emb(w, placement), copy.deepcopy(head)), Net(ref_emb(w), copy.deepcopy(head))


def batches(seed: int, steps: int, shape=(6, 4), n: int = N):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, n, shape, generator=g)
        ids.view(-1)[1] = ids.view(-1)[0]  # a repeat in every batch
        y = torch.randn(shape[0], generator=g)
        out.append((ids, y))
    return out


def loss_of(model: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(ids) - y.to(model.head.weight.dtype)).pow(2).mean()


class LazyRef:
    """A torch optimizer over plain parameters; after each step, the rows of the ``lazy``
    (embedding) parameters outside that step's ids get their weights and row-shaped state
    back (a fresh state row is torch's zero)."""

    def __init__(
        self, opt: torch.optim.Optimizer, lazy: list[torch.Tensor], fresh: str = "zero"
    ) -> None:
        self.opt = opt
        self.lazy = lazy
        #: "zero": a state row created by this step but outside its ids is reset to zero;
        #: "keep": it keeps what torch made of it (Rprop's step_size starts at lr)
        self.fresh = fresh

    def _rows(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        if p not in self.opt.state:
            return {}
        return {
            k: v.detach().clone()
            for k, v in self.opt.state[p].items()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        }

    def step(self, used: list[torch.Tensor | None]) -> None:
        snaps = [(p.detach().clone(), self._rows(p)) for p in self.lazy]
        self.opt.step()
        with torch.no_grad():
            for p, ids, (w0, st0) in zip(self.lazy, used, snaps, strict=True):
                keep = torch.ones(p.shape[0], dtype=torch.bool)
                if ids is not None and ids.numel():
                    keep[ids.reshape(-1).long()] = False
                p[keep] = w0[keep]
                if p in self.opt.state:
                    for k, v in self.opt.state[p].items():
                        if isinstance(v, torch.Tensor) and v.shape == p.shape:
                            if k in st0:
                                v[keep] = st0[k][keep]
                            elif self.fresh == "zero":
                                v[keep] = 0


def assert_models_equal(off: nn.Module, ref: nn.Module, **tol) -> None:
    tol = tol or TOL
    torch.testing.assert_close(table(off.emb), ref.emb.weight.detach(), **tol)
    for (n1, p1), (n2, p2) in zip(
        off.head.named_parameters(), ref.head.named_parameters(), strict=True
    ):
        assert n1 == n2
        torch.testing.assert_close(p1.detach(), p2.detach(), **tol)


def state_rows(opt: gl.OffloadedOptimizer, i: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state_dict()["tables"][i].items()}


def snapshot(model: nn.Module, opt: gl.OffloadedOptimizer):
    return (
        {n: t.clone() for n, t in model.state_dict().items()},
        [{k: v.clone() for k, v in t.items()} for t in opt.state_dict()["tables"]],
        copy.deepcopy(opt.state_dict()["inner"]),
    )


def assert_snapshot_equal(a, b) -> None:
    (ma, ta, ia), (mb, tb, ib) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    for x, y in zip(ta, tb, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert repr(ia) == repr(ib)


def train_both(off, ref, opt_off, ref_opt: LazyRef, data, *, sched_off=None, sched_ref=None):
    for ids, y in data:
        opt_off.zero_grad()
        loss_of(off, ids, y).backward()
        opt_off.step()
        ref_opt.opt.zero_grad()
        loss_of(ref, ids, y).backward()
        ref_opt.step([ids])
        if sched_off is not None:
            sched_off.step()
            sched_ref.step()


# ---------------------------------------------------------------------------------------------
# basic equivalence, optimizer options
# ---------------------------------------------------------------------------------------------
OPT_CASES = [
    ("Adam", {"lr": 0.05}),
    ("Adam", {"lr": 0.05, "weight_decay": 0.1}),
    ("Adam", {"lr": 0.05, "amsgrad": True}),
    ("Adam", {"lr": 0.05, "maximize": True}),
    ("Adam", {"lr": 0.05, "foreach": True}),
    ("Adam", {"lr": 0.05, "fused": True}),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "maximize": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "fused": True}),
    ("Adagrad", {"lr": 0.1, "weight_decay": 0.01}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("NAdam", {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("RAdam", {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("Adamax", {"lr": 0.05, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("placement", ["cpu"])
@pytest.mark.parametrize(
    "name,kw",
    OPT_CASES,
    ids=[f"{n}-{'-'.join(k for k in kw if k != 'lr') or 'plain'}" for n, kw in OPT_CASES],
)
def test_training_matches_lazy_reference(placement, name, kw):
    off, ref = pair(1, placement)
    cls = getattr(torch.optim, name)
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    ropt = LazyRef(cls(ref.parameters(), **kw), [ref.emb.weight])
    train_both(off, ref, opt, ropt, batches(2, 5))
    assert_models_equal(off, ref)
    # the row state too (e.g. Adam's moments, AMSGrad's max)
    p = ref.emb.weight
    for k, v in state_rows(opt).items():
        torch.testing.assert_close(v, ropt.opt.state[p][k], **TOL)


def test_sparse_adam_matches_sparse_embedding():
    w = weights(3)
    off = off_emb(w)
    ref = ref_emb(w, sparse=True)
    opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, off, lr=0.05)
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    for ids, _ in batches(4, 4):
        for m, o in ((off, opt), (ref, ropt)):
            o.zero_grad()
            (m(ids).sum(-1) - 1).pow(2).sum().backward()
            o.step()
    torch.testing.assert_close(table(off), ref.weight.detach(), **TOL)


# ---------------------------------------------------------------------------------------------
# gradient accumulation, zero_grad, step without backward, retain_graph
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gradient_accumulation_three_micro_batches(placement):
    off, ref = pair(5, placement)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    data = batches(6, 9)
    for s in range(3):
        micro = data[3 * s : 3 * s + 3]
        opt.zero_grad()
        ropt.opt.zero_grad()
        for ids, y in micro:
            (loss_of(off, ids, y) / 3).backward()
            (loss_of(ref, ids, y) / 3).backward()
        opt.step()
        ropt.step([torch.cat([ids.reshape(-1) for ids, _ in micro])])
    assert_models_equal(off, ref)


def test_gradient_accumulation_with_groups_read_between_micro_batches():
    """README: 'a backward after such a merge (gradient accumulation) is merged in at the next
    one'. Clipping over param_groups between micro-batches (a no-op clip, max_norm huge)."""
    off, ref = pair(7)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    data = batches(8, 6)
    for s in range(2):
        micro = data[3 * s : 3 * s + 3]
        opt.zero_grad()
        ropt.opt.zero_grad()
        for ids, y in micro:
            loss_of(off, ids, y).backward()
            loss_of(ref, ids, y).backward()
            n_off = torch.nn.utils.clip_grad_norm_(
                [p for g in opt.param_groups for p in g["params"]], 1e9
            )
            n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            torch.testing.assert_close(n_off, n_ref, **TOL)
        opt.step()
        ropt.step([torch.cat([ids.reshape(-1) for ids, _ in micro])])
    assert_models_equal(off, ref)


def test_zero_grad_set_to_none_false_loop():
    off, ref = pair(9)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    for ids, y in batches(10, 4):
        opt.zero_grad(set_to_none=False)
        ropt.opt.zero_grad(set_to_none=False)
        loss_of(off, ids, y).backward()
        loss_of(ref, ids, y).backward()
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)
    # the head's grads were zeroed in place, not dropped
    opt.zero_grad(set_to_none=False)
    assert off.head.weight.grad is not None and not off.head.weight.grad.any()


def test_zero_grad_discards_gradient_before_step():
    off, _ = pair(11)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    before = snapshot(off, opt)
    ids, y = batches(12, 1)[0]
    loss_of(off, ids, y).backward()
    opt.zero_grad()
    opt.step()
    assert_snapshot_equal(snapshot(off, opt), before)


def test_second_step_without_backward_leaves_table_alone():
    off, _ = pair(13)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ids, y = batches(14, 1)[0]
    loss_of(off, ids, y).backward()
    opt.step()
    t1, s1 = table(off.emb), state_rows(opt)
    step1 = opt.state_dict()["inner"]["state"]
    opt.step()  # no new backward: README says the tables are left alone
    assert torch.equal(table(off.emb), t1)
    for k, v in state_rows(opt).items():
        assert torch.equal(v, s1[k])
    # the table's step count did not advance either
    emb_index = len(list(off.head.parameters()))
    assert opt.state_dict()["inner"]["state"][emb_index]["step"] == step1[emb_index]["step"]


def test_step_before_any_forward_is_a_no_op():
    off, _ = pair(15)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    before = snapshot(off, opt)
    opt.step()
    opt.zero_grad()
    opt.step()
    assert_snapshot_equal(snapshot(off, opt), before)


def test_backward_twice_with_retain_graph_doubles_gradient():
    off, ref = pair(17)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1, momentum=0.9)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), [ref.emb.weight])
    for ids, y in batches(18, 3):
        opt.zero_grad()
        ropt.opt.zero_grad()
        for m in (off, ref):
            loss = loss_of(m, ids, y)
            loss.backward(retain_graph=True)
            loss.backward()
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)


def test_late_backward_after_step_is_reported_and_not_applied():
    off, _ = pair(19)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    ids, y = batches(20, 1)[0]
    loss = off.emb(ids).pow(2).sum()  # no dense parameter in the graph (torch would refuse)
    loss.backward(retain_graph=True)
    opt.step()
    opt.zero_grad()
    loss.backward()  # reaches the lookup of the step that already ran
    t = table(off.emb)
    with pytest.raises(gl.GadgetValueError, match="after that step"):
        opt.step()
    assert torch.equal(table(off.emb), t)


def test_closure_step_returns_loss_and_matches():
    off, ref = pair(21)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    lazy = LazyRef(ropt, [ref.emb.weight])
    for ids, y in batches(22, 3):

        def closure_off(ids=ids, y=y):
            opt.zero_grad()
            loss = loss_of(off, ids, y)
            loss.backward()
            return loss

        def closure_ref(ids=ids, y=y):
            ropt.zero_grad()
            loss = loss_of(ref, ids, y)
            loss.backward()
            return loss

        l_off = opt.step(closure_off)
        closure_ref()
        lazy.step([ids])
        assert l_off is not None and torch.isfinite(l_off)
    assert_models_equal(off, ref)


# ---------------------------------------------------------------------------------------------
# clipping, schedulers, GradScaler
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["norm", "value"])
def test_clipping_over_param_groups(kind):
    off, ref = pair(23)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.3)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.3), [ref.emb.weight])
    for ids, y in batches(24, 4):
        opt.zero_grad()
        ropt.opt.zero_grad()
        (10 * loss_of(off, ids, y)).backward()
        (10 * loss_of(ref, ids, y)).backward()
        ps = [p for g in opt.param_groups for p in g["params"]]
        if kind == "norm":
            a = torch.nn.utils.clip_grad_norm_(ps, 0.5)
            b = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            torch.testing.assert_close(a, b, **TOL)
        else:
            torch.nn.utils.clip_grad_value_(ps, 0.05)
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.05)
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)


def _sched(kind: str, opt):
    if kind == "StepLR":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    if kind == "LambdaLR":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    if kind == "CyclicLR":
        return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.2, step_size_up=2)
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=6)


@pytest.mark.parametrize("kind", ["StepLR", "LambdaLR", "OneCycleLR", "CyclicLR"])
@pytest.mark.parametrize(
    "name,kw",
    [("Adam", {"lr": 0.05}), ("SGD", {"lr": 0.1, "momentum": 0.9}), ("SGD", {"lr": 0.1})],
    ids=["Adam", "SGD-momentum", "SGD-no-momentum"],
)
def test_lr_schedulers(kind, name, kw):
    off, ref = pair(25)
    cls = getattr(torch.optim, name)
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    ropt = LazyRef(cls(ref.parameters(), **kw), [ref.emb.weight])
    s_off, s_ref = _sched(kind, opt), _sched(kind, ropt.opt)
    train_both(off, ref, opt, ropt, batches(26, 6), sched_off=s_off, sched_ref=s_ref)
    assert opt.param_groups[0]["lr"] == ropt.opt.param_groups[0]["lr"]
    assert_models_equal(off, ref)


def test_onecycle_turns_sgd_momentum_on():
    """README: schedulers that 'turn momentum on' (OneCycleLR on SGD without momentum... the
    scheduler cycles momentum, cycle_momentum needs momentum; here a LambdaLR-like manual
    change of momentum 0 -> 0.9 after two steps, as the paged state must follow)."""
    off, ref = pair(27)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1, momentum=0.0)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.0), [ref.emb.weight])
    data = batches(28, 5)
    for s, (ids, y) in enumerate(data):
        if s == 2:
            for g in opt.param_groups:
                g["momentum"] = 0.9
            for g in ropt.opt.param_groups:
                g["momentum"] = 0.9
        train_both(off, ref, opt, ropt, [(ids, y)])
    assert_models_equal(off, ref)


def test_grad_scaler_cpu():
    off, ref = pair(29)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    lazy = LazyRef(ropt, [ref.emb.weight])
    sc_off = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sc_ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for ids, y in batches(30, 3):
        opt.zero_grad()
        ropt.zero_grad()
        sc_off.scale(loss_of(off, ids, y)).backward()
        sc_ref.scale(loss_of(ref, ids, y)).backward()
        sc_off.unscale_(opt)
        sc_ref.unscale_(ropt)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        sc_off.step(opt)
        snaps = [(p.detach().clone(), lazy._rows(p)) for p in lazy.lazy]
        sc_ref.step(ropt)
        # restore unused rows (lazy semantics) by hand, as LazyRef.step would
        with torch.no_grad():
            keep = torch.ones(N, dtype=torch.bool)
            keep[ids.reshape(-1)] = False
            ref.emb.weight[keep] = snaps[0][0][keep]
            for k, v in ropt.state[ref.emb.weight].items():
                if isinstance(v, torch.Tensor) and v.shape == ref.emb.weight.shape:
                    v[keep] = snaps[0][1][k][keep] if k in snaps[0][1] else 0
        sc_off.update()
        sc_ref.update()
    assert_models_equal(off, ref)


def test_grad_scaler_skips_step_on_inf_in_table_grad():
    off, _ = pair(31)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = table(off.emb)
    ids, _ = batches(32, 1)[0]
    out = off.emb(ids)
    # an inf reaches only the table's gradient
    sc.scale(out.abs().sum() * torch.tensor(float("inf"))).backward()
    sc.step(opt)
    sc.update()
    assert torch.equal(table(off.emb), before)
    assert sc.get_scale() < 1024.0


# ---------------------------------------------------------------------------------------------
# param groups, add_param_group, optimizer state_dict
# ---------------------------------------------------------------------------------------------
def test_param_groups_with_own_lr_and_weight_decay():
    off, ref = pair(33)
    opt = gl.OffloadedOptimizer(
        torch.optim.AdamW,
        [{"params": off.emb, "lr": 0.2, "weight_decay": 0.5}, {"params": off.head.parameters()}],
        lr=0.01,
        weight_decay=0.0,
    )
    ropt = LazyRef(
        torch.optim.AdamW(
            [
                {"params": [ref.emb.weight], "lr": 0.2, "weight_decay": 0.5},
                {"params": ref.head.parameters()},
            ],
            lr=0.01,
            weight_decay=0.0,
        ),
        [ref.emb.weight],
    )
    train_both(off, ref, opt, ropt, batches(34, 4))
    assert_models_equal(off, ref)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.01]


def test_model_plus_dict_group_for_head():
    """Docstring: '[model, {"params": model.head.parameters(), "lr": 0.01}] works'."""
    off, ref = pair(35)
    opt = gl.OffloadedOptimizer(
        torch.optim.Adam, [off, {"params": off.head.parameters(), "lr": 0.01}], lr=0.1
    )
    ropt = LazyRef(
        torch.optim.Adam(
            [{"params": ref.head.parameters(), "lr": 0.01}, {"params": [ref.emb.weight]}], lr=0.1
        ),
        [ref.emb.weight],
    )
    train_both(off, ref, opt, ropt, batches(36, 4))
    assert_models_equal(off, ref)


def test_add_param_group_with_new_embedding_later():
    off, ref = pair(37)
    w2 = weights(38)
    e2_off, e2_ref = off_emb(w2), ref_emb(w2)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    lazy = LazyRef(ropt, [ref.emb.weight])
    data = batches(39, 5)
    for s, (ids, y) in enumerate(data):
        if s == 2:
            opt.add_param_group({"params": e2_off, "lr": 0.2})
            ropt.add_param_group({"params": [e2_ref.weight], "lr": 0.2})
            lazy.lazy.append(e2_ref.weight)
        opt.zero_grad()
        ropt.zero_grad()
        extra = [(e2_off, e2_ref)] if s >= 2 else []
        for m, e2 in ((off, extra[0][0] if extra else None), (ref, extra[0][1] if extra else None)):
            loss = loss_of(m, ids, y)
            if e2 is not None:
                loss = loss + e2(ids).pow(2).mean()
            loss.backward()
        opt.step()
        lazy.step([ids, ids] if s >= 2 else [ids])
    assert_models_equal(off, ref)
    torch.testing.assert_close(table(e2_off), e2_ref.weight.detach(), **TOL)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.2


def test_add_param_group_refuses_attached_table_and_changes_nothing():
    off, _ = pair(41)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    n = len(opt.param_groups)
    with pytest.raises(gl.GadgetValueError, match="already belongs"):
        opt.add_param_group({"params": off.emb, "lr": 0.1})
    assert len(opt.param_groups) == n


def test_optimizer_state_dict_round_trip_resumes_exactly():
    data = batches(43, 6)
    # uninterrupted
    a, _ = pair(42)
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05, amsgrad=True)
    for ids, y in data:
        oa.zero_grad()
        loss_of(a, ids, y).backward()
        oa.step()
    # interrupted after 3 steps; model + optimizer state through torch.save
    b, _ = pair(42)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05, amsgrad=True)
    for ids, y in data[:3]:
        ob.zero_grad()
        loss_of(b, ids, y).backward()
        ob.step()
    buf = io.BytesIO()
    torch.save({"model": b.state_dict(), "opt": ob.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    c, _ = pair(99)  # other weights
    c.load_state_dict(ck["model"])
    oc = gl.OffloadedOptimizer(torch.optim.Adam, c, lr=0.05, amsgrad=True)
    oc.load_state_dict(ck["opt"])
    for ids, y in data[3:]:
        oc.zero_grad()
        loss_of(c, ids, y).backward()
        oc.step()
    assert torch.equal(table(c.emb), table(a.emb))
    assert torch.equal(c.head.weight, a.head.weight)


def test_optimizer_load_state_dict_of_other_class_refused_unchanged():
    off, _ = pair(45)
    adam = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ids, y = batches(46, 1)[0]
    loss_of(off, ids, y).backward()
    adam.step()
    sd = adam.state_dict()
    other, _ = pair(45)
    nadam = gl.OffloadedOptimizer(torch.optim.NAdam, other, lr=0.05)
    loss_of(other, ids, y).backward()
    nadam.step()
    before = snapshot(other, nadam)
    with pytest.raises(gl.GadgetValueError, match="Adam"):
        nadam.load_state_dict(sd)
    assert_snapshot_equal(snapshot(other, nadam), before)


def test_optimizer_load_state_dict_wrong_table_count_refused_unchanged():
    off, _ = pair(47)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ids, y = batches(48, 1)[0]
    loss_of(off, ids, y).backward()
    opt.step()
    sd = opt.state_dict()
    sd_bad = {**sd, "tables": sd["tables"] + sd["tables"]}
    before = snapshot(off, opt)
    with pytest.raises(gl.GadgetValueError, match="offloaded tables"):
        opt.load_state_dict(sd_bad)
    assert_snapshot_equal(snapshot(off, opt), before)


def test_optimizer_cannot_be_deepcopied_clear_error():
    off, _ = pair(49)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    with pytest.raises(gl.GadgetTypeError, match="cannot be copied or pickled"):
        copy.deepcopy(opt)


def test_plain_parameters_warns_no_table():
    off, _ = pair(51)
    with pytest.warns(UserWarning, match="model.parameters"):
        gl.OffloadedOptimizer(torch.optim.Adam, off.parameters(), lr=0.05)


# ---------------------------------------------------------------------------------------------
# module state_dict, copies, pickling
# ---------------------------------------------------------------------------------------------
def test_state_dict_interchangeable_with_nn_embedding_model():
    off, ref = pair(53)
    sd_off, sd_ref = off.state_dict(), ref.state_dict()
    assert sd_off.keys() == sd_ref.keys()
    torch.testing.assert_close(sd_off["emb.weight"], sd_ref["emb.weight"], rtol=0, atol=0)
    # a plain model's checkpoint loads into the offloaded model (strict) and back
    other, plain = pair(54)
    other.load_state_dict(sd_ref)
    assert torch.equal(table(other.emb), ref.emb.weight.detach())
    plain.load_state_dict(off.state_dict())
    assert torch.equal(plain.emb.weight.detach(), table(off.emb))


def test_load_state_dict_wrong_shape_refused_table_unchanged():
    off, _ = pair(55)
    t = table(off.emb)
    sd = off.state_dict()
    sd["emb.weight"] = torch.zeros(N + 1, D)
    with pytest.raises(RuntimeError, match="size mismatch"):
        off.load_state_dict(sd)
    assert torch.equal(table(off.emb), t)


def test_load_state_dict_while_gradient_waits_refused():
    off, _ = pair(57)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    ids, y = batches(58, 1)[0]
    loss_of(off, ids, y).backward()
    t = table(off.emb)
    with pytest.raises(RuntimeError, match="waits for"):
        off.load_state_dict({k: torch.zeros_like(v) for k, v in off.state_dict().items()})
    assert torch.equal(table(off.emb), t)
    opt.step()  # the step still runs from the rows it read
    assert not torch.equal(table(off.emb), t)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_of_module_is_separate_table_without_optimizer(how):
    off, _ = pair(59)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ids, y = batches(60, 2)[0]
    loss_of(off, ids, y).backward()
    opt.step()
    if how == "deepcopy":
        cp = copy.deepcopy(off)
    elif how == "pickle":
        cp = pickle.loads(pickle.dumps(off))
    else:
        buf = io.BytesIO()
        torch.save(off, buf)
        buf.seek(0)
        cp = torch.load(buf, weights_only=False)
    assert torch.equal(table(cp.emb), table(off.emb))
    t_orig = table(off.emb)
    # the copy trains under its own optimizer; the original's table is not touched
    ocp = gl.OffloadedOptimizer(torch.optim.SGD, cp, lr=0.5)
    loss_of(cp, ids, y).backward()
    ocp.step()
    assert torch.equal(table(off.emb), t_orig)
    assert not torch.equal(table(cp.emb), t_orig)
    # and the original keeps training with its optimizer
    opt.zero_grad()
    loss_of(off, ids, y).backward()
    opt.step()
    assert not torch.equal(table(off.emb), t_orig)


def test_second_optimizer_on_attached_table_refused():
    off, _ = pair(61)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)  # noqa: F841 (kept alive)
    with pytest.raises(gl.GadgetValueError, match="already belongs"):
        gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.05)


# ---------------------------------------------------------------------------------------------
# train / eval, no_grad, inference_mode, freezing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode", "eval_with_grad"])
def test_eval_lookups_equal_reference_and_do_not_train(ctx):
    off, ref = pair(63)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    data = batches(64, 3)
    ev = torch.arange(N).reshape(5, 6)
    for ids, y in data:
        train_both(off, ref, opt, ropt, [(ids, y)])
        off.eval()
        ref.eval()
        if ctx == "no_grad":
            with torch.no_grad():
                a, b = off(ev), ref(ev)
        elif ctx == "inference_mode":
            with torch.inference_mode():
                a, b = off(ev), ref(ev)
        else:
            a, b = off(ev).detach(), ref(ev).detach()
        torch.testing.assert_close(a, b, **TOL)
        off.train()
        ref.train()
    assert_models_equal(off, ref)


def test_requires_grad_false_freezes_table_head_still_trains():
    off, ref = pair(65)
    off.emb.requires_grad_(False)
    ref.emb.requires_grad_(False)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    t = table(off.emb)
    ids, _ = batches(66, 1)[0]
    assert not off.emb(ids).requires_grad
    train_both(off, ref, opt, ropt, batches(66, 3))
    assert torch.equal(table(off.emb), t)
    assert_models_equal(off, ref)
    # unfreeze: training resumes, as for nn.Embedding
    off.emb.requires_grad_(True)
    ref.emb.requires_grad_(True)
    train_both(off, ref, opt, ropt, batches(67, 3))
    assert not torch.equal(table(off.emb), t)
    assert_models_equal(off, ref)


def test_double_conversion_returns_float64_and_trains():
    """README: '.half() / .double() / .to(dtype) make lookups return that dtype while the table
    keeps its own'."""
    off, ref = pair(69)
    off.double()
    ref.double()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)
    ids, _ = batches(70, 1)[0]
    assert off.emb(ids).dtype == torch.float64
    assert off.emb.weight.dtype == torch.float32
    with torch.no_grad():
        ref.emb.weight.copy_(ref.emb.weight.float().double())
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.1), [ref.emb.weight])
    train_both(off, ref, opt, ropt, batches(71, 3))
    torch.testing.assert_close(table(off.emb), ref.emb.weight.detach().float(), **TOL)


# ---------------------------------------------------------------------------------------------
# nn.Embedding features
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw", ["padding_idx", "max_norm", "scale_grad_by_freq", "sparse", "_weight"]
)
def test_unsupported_nn_embedding_options_clear_error(kw):
    value = {
        "padding_idx": 0,
        "max_norm": 1.0,
        "scale_grad_by_freq": True,
        "sparse": True,
        "_weight": torch.zeros(N, D),
    }[kw]
    with pytest.raises(TypeError, match=kw):
        gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", **{kw: value})


def test_positional_padding_idx_like_nn_embedding_is_clear_error():
    # nn.Embedding(N, D, 0) means padding_idx=0; here the third argument is the placement
    with pytest.raises(gl.GadgetError, match="placement"):
        gl.OffloadedEmbedding(N, D, 0)


def test_pretrained_weights_via_init_and_load_state_dict():
    w = weights(73)
    a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=lambda t: t.copy_(w))
    assert torch.equal(table(a), w)
    b = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    b.load_state_dict({"weight": w.double()})
    assert torch.equal(table(b), w)
    ref = nn.Embedding.from_pretrained(w)
    ids = torch.tensor([[3, 1], [1, 29]])
    torch.testing.assert_close(a(ids), ref(ids), rtol=0, atol=0)


def test_init_with_nn_init_xavier_matches_nn_embedding():
    torch.manual_seed(0)
    a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=nn.init.xavier_uniform_)
    torch.manual_seed(0)
    ref = torch.empty(N, D)
    nn.init.xavier_uniform_(ref)
    torch.testing.assert_close(table(a), ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_table_dtypes_train_like_reference(dtype):
    off, ref = pair(75, dtype=dtype)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05, foreach=False)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05, foreach=False), [ref.emb.weight])
    train_both(off, ref, opt, ropt, batches(76, 3))
    assert table(off.emb).dtype == dtype
    assert_models_equal(off, ref, **half_tol(dtype))


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4)])
def test_id_shapes_and_int32(shape):
    off, ref = pair(77)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    g = torch.Generator().manual_seed(78)
    for _ in range(3):
        ids = torch.randint(0, N, shape, generator=g, dtype=torch.int32)
        a, b = off.emb(ids), ref.emb(ids)
        assert a.shape == b.shape == (*shape, D)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        opt.zero_grad()
        ropt.opt.zero_grad()
        (off.emb(ids) * torch.arange(D)).sum().backward()
        (ref.emb(ids) * torch.arange(D)).sum().backward()
        opt.step()
        ropt.step([ids])
    torch.testing.assert_close(table(off.emb), ref.emb.weight.detach(), **TOL)


def test_empty_id_tensors_in_a_training_step():
    off, ref = pair(79)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    empty = torch.empty(0, 3, dtype=torch.long)
    assert off.emb(empty).shape == ref.emb(empty).shape == (0, 3, D)
    for ids, y in batches(80, 3):
        opt.zero_grad()
        ropt.opt.zero_grad()
        for m in (off, ref):
            (loss_of(m, ids, y) + m.emb(empty).sum()).backward()
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)


def test_only_empty_lookup_then_step_changes_nothing():
    off, _ = pair(81)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off.emb, lr=0.05)
    t = table(off.emb)
    off.emb(torch.empty(0, dtype=torch.long)).sum().backward()
    opt.step()
    assert torch.equal(table(off.emb), t)


@pytest.mark.parametrize("bad", [N, -1])
def test_out_of_range_id_error_leaves_state_unchanged(bad):
    off, _ = pair(83)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ids, y = batches(84, 1)[0]
    loss_of(off, ids, y).backward()
    opt.step()
    before = snapshot(off, opt)
    with pytest.raises(IndexError, match="out of range|negative"):
        off(torch.tensor([[1, bad]]))
    assert_snapshot_equal(snapshot(off, opt), before)
    # the next good step is unaffected by the refused lookup
    opt.zero_grad()
    loss_of(off, ids, y).backward()
    opt.step()
    assert not torch.equal(table(off.emb), before[0]["emb.weight"])


def test_float_ids_refused_with_type_error():
    off, _ = pair(85)
    with pytest.raises(TypeError, match="integers"):
        off.emb(torch.tensor([1.0, 2.0]))


def test_ids_on_unsupported_device_refused():
    off, _ = pair(87)
    with pytest.raises(TypeError, match="device"):
        off.emb(torch.tensor([1, 2], device="meta"))


# ---------------------------------------------------------------------------------------------
# EmbeddingBag
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_2d_input_trains_like_reference(placement, mode):
    w = weights(89)
    off, ref = off_bag(w, mode, placement), ref_bag(w, mode)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.weight])
    for ids, y in batches(90, 4, shape=(5, 4)):
        a, b = off(ids), ref(ids)
        torch.testing.assert_close(a, b, **TOL)
        opt.zero_grad()
        ropt.opt.zero_grad()
        (a.sum(-1) - y).pow(2).sum().backward()
        (b.sum(-1) - y).pow(2).sum().backward()
        opt.step()
        ropt.step([ids])
    torch.testing.assert_close(table(off), ref.weight.detach(), **TOL)


@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_offsets_with_empty_bags(mode, include_last_offset):
    w = weights(91)
    off = off_bag(w, mode, include_last_offset=include_last_offset)
    ref = ref_bag(w, mode, include_last_offset=include_last_offset)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.5), [ref.weight])
    inp = torch.tensor([4, 4, 7, 1, 9, 4, 2])
    offsets = torch.tensor([0, 2, 2, 5, 7] if include_last_offset else [0, 2, 2, 5, 7])
    for _ in range(2):
        a, b = off(inp, offsets), ref(inp, offsets)
        torch.testing.assert_close(a, b, **TOL)
        opt.zero_grad()
        ropt.opt.zero_grad()
        (a * torch.arange(1.0, D + 1)).sum().backward()
        (b * torch.arange(1.0, D + 1)).sum().backward()
        opt.step()
        ropt.step([inp])
    torch.testing.assert_close(table(off), ref.weight.detach(), **TOL)


def test_bag_int32_offsets_and_ids():
    w = weights(93)
    off, ref = off_bag(w, "mean"), ref_bag(w, "mean")
    inp = torch.tensor([3, 5, 5, 8], dtype=torch.int32)
    offs = torch.tensor([0, 1], dtype=torch.int32)
    torch.testing.assert_close(off(inp, offs), ref(inp, offs), **TOL)


def test_bag_per_sample_weights_values_and_gradients():
    w = weights(95)
    off, ref = off_bag(w, "sum"), ref_bag(w, "sum")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.weight])
    inp = torch.tensor([2, 9, 9, 4, 0, 2])
    offs = torch.tensor([0, 3, 3])
    for s in range(3):
        psw_a = torch.linspace(-1, 2, 6).add(s).requires_grad_(True)
        psw_b = psw_a.detach().clone().requires_grad_(True)
        a, b = off(inp, offs, per_sample_weights=psw_a), ref(inp, offs, per_sample_weights=psw_b)
        torch.testing.assert_close(a, b, **TOL)
        opt.zero_grad()
        ropt.opt.zero_grad()
        a.pow(2).sum().backward()
        b.pow(2).sum().backward()
        torch.testing.assert_close(psw_a.grad, psw_b.grad, **TOL)
        opt.step()
        ropt.step([inp])
    torch.testing.assert_close(table(off), ref.weight.detach(), **TOL)


def test_bag_per_sample_weights_with_mean_refused():
    w = weights(97)
    off = off_bag(w, "mean")
    with pytest.raises(ValueError, match="per_sample_weights"):
        off(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))


def test_bag_padding_idx_clear_error():
    with pytest.raises(TypeError, match="padding_idx"):
        gl.OffloadedEmbeddingBag(N, D, mode="sum", placement="cpu", device="cpu", padding_idx=0)


def test_bag_bad_offsets_refused_and_nothing_pending():
    w = weights(99)
    off = off_bag(w, "sum")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    t = table(off)
    with pytest.raises(gl.GadgetValueError, match="offsets"):
        off(torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
    with pytest.raises(gl.GadgetValueError, match="offsets"):
        off(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    opt.step()
    assert torch.equal(table(off), t)


def test_bag_empty_input_with_offsets():
    w = weights(101)
    off, ref = off_bag(w, "sum"), ref_bag(w, "sum")
    inp = torch.empty(0, dtype=torch.long)
    offs = torch.tensor([0, 0])
    torch.testing.assert_close(off(inp, offs), ref(inp, offs), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# several modules, shared tables, mixing with dense layers
# ---------------------------------------------------------------------------------------------
class TwoTower(nn.Module):
    def __init__(self, item: nn.Module, user: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.item = item
        self.user = user
        self.head = head

    def forward(self, items, history):
        return self.head(self.item(items) * self.user(history)).squeeze(-1)


def test_readme_two_tower_model_matches_reference():
    wi, wu = weights(103), weights(104, n=20)
    torch.manual_seed(105)
    head = nn.Linear(D, 1)
    off = TwoTower(off_emb(wi), off_bag(wu, "mean"), copy.deepcopy(head))
    ref = TwoTower(ref_emb(wi), ref_bag(wu, "mean"), copy.deepcopy(head))
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, off, lr=1e-2, weight_decay=0.01)
    ropt = LazyRef(
        torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01),
        [ref.item.weight, ref.user.weight],
    )
    g = torch.Generator().manual_seed(106)
    for _ in range(4):
        items = torch.randint(0, N, (8,), generator=g)
        history = torch.randint(0, 20, (8, 3), generator=g)
        y = torch.randn(8, generator=g)
        opt.zero_grad()
        ropt.opt.zero_grad()
        F.mse_loss(off(items, history), y).backward()
        F.mse_loss(ref(items, history), y).backward()
        opt.step()
        ropt.step([items, history])
    torch.testing.assert_close(table(off.item), ref.item.weight.detach(), **TOL)
    torch.testing.assert_close(table(off.user), ref.user.weight.detach(), **TOL)
    torch.testing.assert_close(off.head.weight, ref.head.weight, **TOL)


def test_step_where_one_of_two_tables_gets_no_gradient():
    wi, wu = weights(107), weights(108)
    a_off, b_off, a_ref, b_ref = off_emb(wi), off_emb(wu), ref_emb(wi), ref_emb(wu)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, [a_off, b_off], lr=0.05)
    ropt = LazyRef(
        torch.optim.Adam([a_ref.weight, b_ref.weight], lr=0.05), [a_ref.weight, b_ref.weight]
    )
    for s, (ids, _) in enumerate(batches(109, 5)):
        use_b = s % 2 == 0
        opt.zero_grad()
        ropt.opt.zero_grad()
        for a, b in ((a_off, b_off), (a_ref, b_ref)):
            loss = a(ids).pow(2).sum()
            if use_b:
                loss = loss + (b(ids) - 1).pow(2).sum()
            loss.backward()
        opt.step()
        ropt.step([ids, ids if use_b else None])
    torch.testing.assert_close(table(a_off), a_ref.weight.detach(), **TOL)
    torch.testing.assert_close(table(b_off), b_ref.weight.detach(), **TOL)


def test_one_table_looked_up_twice_per_forward_tied():
    w = weights(111)
    off, ref = off_emb(w), ref_emb(w)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.weight])
    for ids, _ in batches(112, 4):
        other = (ids * 7 + 3) % N
        opt.zero_grad()
        ropt.opt.zero_grad()
        (off(ids) * off(other)).sum(-1).sigmoid().log().neg().sum().backward()
        (ref(ids) * ref(other)).sum(-1).sigmoid().log().neg().sum().backward()
        opt.step()
        ropt.step([torch.cat([ids.reshape(-1), other.reshape(-1)])])
    torch.testing.assert_close(table(off), ref.weight.detach(), **TOL)


def test_sequential_with_linear_and_separate_dense_optimizer():
    """Offloaded optimizer for the table, a plain torch optimizer for the dense layers."""
    w = weights(113)
    torch.manual_seed(114)
    lin = nn.Linear(D, 3)
    off = nn.Sequential(off_emb(w), copy.deepcopy(lin))
    ref = nn.Sequential(ref_emb(w), copy.deepcopy(lin))
    opt_t = gl.OffloadedOptimizer(torch.optim.Adagrad, off[0], lr=0.1)
    opt_d = torch.optim.SGD(off[1].parameters(), lr=0.1)
    ropt_t = LazyRef(torch.optim.Adagrad([ref[0].weight], lr=0.1), [ref[0].weight])
    ropt_d = torch.optim.SGD(ref[1].parameters(), lr=0.1)
    for ids, _ in batches(115, 4):
        for m, ot, od in ((off, opt_t, opt_d), (ref, ropt_t.opt, ropt_d)):
            ot.zero_grad()
            od.zero_grad()
            m(ids).pow(2).mean().backward()
        opt_t.step()
        opt_d.step()
        ropt_t.step([ids])
        ropt_d.step()
    torch.testing.assert_close(table(off[0]), ref[0].weight.detach(), **TOL)
    torch.testing.assert_close(off[1].weight, ref[1].weight, **TOL)


def test_module_dict_readme_construction_and_repr():
    md = nn.ModuleDict(
        {
            "item": gl.OffloadedEmbedding(100, 8, placement="cpu", device="cpu"),
            "user": gl.OffloadedEmbeddingBag(50, 8, mode="mean", placement="cpu", device="cpu"),
            "head": nn.Linear(8, 1),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, md, lr=1e-3, weight_decay=0.01)
    assert len(opt.tables) == 2
    assert "OffloadedEmbedding(100, 8" in repr(md)
    items, history = torch.tensor([1, 2]), torch.tensor([[1, 2], [3, 3]])
    pred = md["head"](md["item"](items) * md["user"](history)).squeeze(-1)
    F.mse_loss(pred, torch.zeros(2)).backward()
    t = table(md["item"])
    opt.step()
    changed = (table(md["item"]) != t).any(dim=1)
    assert changed.nonzero().reshape(-1).tolist() == [1, 2]


# ---------------------------------------------------------------------------------------------
# more: module-level zero_grad, step counts, warm-ups, re-attaching, conversions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["embedding", "optimizer"])
def test_zero_grad_discards_table_gradient_like_nn_embedding(how):
    """README: the optimizer's zero_grad() (or the embedding's own emb.zero_grad()) throws away
    the gradients of the lookups since the last step, as nn.Embedding.zero_grad() does its
    weight's; a micro-batch thrown away that way is not applied."""
    off, ref = pair(117)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.5), [ref.emb.weight])
    (ids_a, y_a), (ids_b, y_b) = batches(118, 2)
    loss_of(off, ids_a, y_a).backward()  # a micro-batch to throw away
    if how == "embedding":
        off.emb.zero_grad()
        for p in off.parameters():  # the dense part, as a parent's zero_grad() would
            p.grad = None
    else:
        opt.zero_grad()
    loss_of(ref, ids_a, y_a).backward()
    ref.zero_grad()
    for m in (off, ref):
        loss_of(m, ids_b, y_b).backward()
    opt.step()
    ropt.step([torch.cat([ids_a.reshape(-1), ids_b.reshape(-1)])])
    assert_models_equal(off, ref)


def test_parent_zero_grad_does_not_reach_waiting_lookups_as_documented():
    """README: a parent module's model.zero_grad() does not reach the lookups (they are not
    parameters): their gradient is applied at the next step."""
    emb = gl.OffloadedEmbedding(10, 2, placement="cpu", device="cpu", init=nn.init.zeros_)
    model = nn.Sequential(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=1.0)
    emb(torch.tensor([1])).sum().backward()
    model.zero_grad()
    opt.step()
    assert emb.weight.getNumpyVersion()[1].tolist() == [-1.0, -1.0]


def test_sparse_adam_step_count_moves_only_for_tables_looked_up():
    """README: a table with no lookup since the last step is not stepped and its step count does
    not move (torch's SparseAdam would count a step for a gradient zeroed in place). Each table
    equals a SparseAdam reference stepped only on the steps that looked it up."""
    wa, wb = weights(119), weights(120)
    a_off, b_off = off_emb(wa), off_emb(wb)
    a_ref, b_ref = ref_emb(wa, sparse=True), ref_emb(wb, sparse=True)
    opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, [a_off, b_off], lr=0.05)
    ra = torch.optim.SparseAdam([a_ref.weight], lr=0.05)
    rb = torch.optim.SparseAdam([b_ref.weight], lr=0.05)
    for s, (ids, _) in enumerate(batches(121, 5)):
        opt.zero_grad(set_to_none=False)
        loss = a_off(ids).pow(2).sum()
        if s % 2 == 0:
            loss = loss + (b_off(ids) - 1).pow(2).sum()
        loss.backward()
        opt.step()
        ra.zero_grad()
        a_ref(ids).pow(2).sum().backward()
        ra.step()
        if s % 2 == 0:
            rb.zero_grad()
            (b_ref(ids) - 1).pow(2).sum().backward()
            rb.step()
    steps_off = [int(opt.state_dict()["inner"]["state"][i]["step"]) for i in (0, 1)]
    assert steps_off == [5, 3]
    torch.testing.assert_close(table(a_off), a_ref.weight.detach(), **TOL)
    torch.testing.assert_close(table(b_off), b_ref.weight.detach(), **TOL)


@pytest.mark.parametrize(
    "name,kw", [("Rprop", {"lr": 0.05}), ("ASGD", {"lr": 0.05}), ("Adam", {"lr": 0.05})]
)
def test_lr_warmup_before_first_step(name, kw):
    """README: schedulers 'that warm lr up before the first step' work; Rprop's step_size and
    ASGD's eta start from the first step's lr."""
    off, ref = pair(123)
    cls = getattr(torch.optim, name)
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    ropt = LazyRef(
        cls(ref.parameters(), **kw), [ref.emb.weight], fresh="keep" if name == "Rprop" else "zero"
    )
    lam = lambda s: 0.1 * (s + 1) if s < 3 else 1.0  # noqa: E731
    s_off = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    s_ref = torch.optim.lr_scheduler.LambdaLR(ropt.opt, lam)
    train_both(off, ref, opt, ropt, batches(124, 6), sched_off=s_off, sched_ref=s_ref)
    assert_models_equal(off, ref)


def test_new_optimizer_after_old_one_is_gone_starts_fresh():
    off, ref = pair(125)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    train_both(off, ref, opt, ropt, batches(126, 2))
    del opt
    gc.collect()
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.02)
    ropt2 = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.02), [ref.emb.weight])
    train_both(off, ref, opt2, ropt2, batches(127, 3))
    assert_models_equal(off, ref)


def test_fused_sgd_dampening_with_dense_params_refused_cleanly():
    """README: 'with dampening != 0 that mix is refused'."""
    off, _ = pair(129)
    t, h = table(off.emb), off.head.weight.detach().clone()
    try:
        opt = gl.OffloadedOptimizer(
            torch.optim.SGD, off, lr=0.1, momentum=0.9, dampening=0.5, fused=True
        )
    except gl.GadgetError as exc:
        assert "dampening" in str(exc)
    else:
        ids, y = batches(130, 1)[0]
        loss_of(off, ids, y).backward()
        with pytest.raises(gl.GadgetError, match="dampening"):
            opt.step()
    assert torch.equal(table(off.emb), t)
    assert torch.equal(off.head.weight, h)


def test_half_conversion_lookups_float16_table_keeps_float32():
    w = weights(131)
    off = off_emb(w).half()
    ref = ref_emb(w)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.5), [ref.weight])
    for ids, _ in batches(132, 3):
        a = off(ids)
        b = ref(ids).half()
        assert a.dtype == torch.float16 and off.weight.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        opt.zero_grad()
        ropt.opt.zero_grad()
        a.float().pow(2).sum().backward()
        b.float().pow(2).sum().backward()
        opt.step()
        ropt.step([ids])
    torch.testing.assert_close(table(off), ref.weight.detach(), **TOL)


def test_load_state_dict_strict_false_reports_missing_like_torch():
    off, ref = pair(133)
    r_off = off.load_state_dict({"head.weight": off.head.weight.detach()}, strict=False)
    r_ref = ref.load_state_dict({"head.weight": ref.head.weight.detach()}, strict=False)
    assert sorted(r_off.missing_keys) == sorted(r_ref.missing_keys)
    assert r_off.unexpected_keys == r_ref.unexpected_keys == []


@pytest.mark.parametrize("shape", [(0, 3), (4, 0)])
def test_bag_2d_degenerate_shapes(shape):
    w = weights(135)
    for mode in ("sum", "mean", "max"):
        off, ref = off_bag(w, mode), ref_bag(w, mode)
        ids = torch.zeros(shape, dtype=torch.long)
        try:
            b = ref(ids)
        except RuntimeError:  # torch's 2-D path fails on bags of length 0 (an arange of step 0)
            # ours gives them as torch gives empty bags through offsets: zeros
            b = ref(ids.reshape(-1), torch.zeros(shape[0], dtype=torch.long))
            assert b.shape == (shape[0], w.shape[1]) and not b.any()
        a = off(ids)
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bag_2d_per_sample_weights():
    w = weights(137)
    off, ref = off_bag(w, "sum"), ref_bag(w, "sum")
    ids = torch.tensor([[1, 2, 2], [5, 6, 1]])
    psw = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, 3.0]])
    torch.testing.assert_close(
        off(ids, per_sample_weights=psw), ref(ids, per_sample_weights=psw), **TOL
    )


def test_frozen_table_step_count_and_state_untouched():
    off, _ = pair(139)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ids, y = batches(140, 1)[0]
    loss_of(off, ids, y).backward()
    opt.step()
    t, st = table(off.emb), state_rows(opt)
    emb_index = len(list(off.head.parameters()))
    step0 = opt.state_dict()["inner"]["state"][emb_index]["step"]
    off.emb.requires_grad_(False)
    for ids, y in batches(141, 2):
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
    assert torch.equal(table(off.emb), t)
    for k, v in state_rows(opt).items():
        assert torch.equal(v, st[k])
    assert opt.state_dict()["inner"]["state"][emb_index]["step"] == step0


def test_optimizer_load_state_dict_between_backward_and_step():
    """The forward gathered this step's state rows with the table rows; a state load before
    step() must win over those stale rows (as torch: load, then step)."""
    data = batches(143, 4)
    src, _ = pair(142)
    osrc = gl.OffloadedOptimizer(torch.optim.Adam, src, lr=0.05)
    for ids, y in data[:2]:
        osrc.zero_grad()
        loss_of(src, ids, y).backward()
        osrc.step()
    sd = osrc.state_dict()
    ids, y = data[2]
    # A: load, then forward/backward/step
    a, _ = pair(142)
    a.load_state_dict(src.state_dict())
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    oa.load_state_dict(copy.deepcopy(sd))  # (torch's load aliases the dict's tensors)
    loss_of(a, ids, y).backward()
    oa.step()
    # B: forward/backward, then load, then step
    b, _ = pair(142)
    b.load_state_dict(src.state_dict())
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    ob.zero_grad()
    loss_of(b, ids, y).backward()
    ob.load_state_dict(copy.deepcopy(sd))
    ob.step()
    assert torch.equal(table(a.emb), table(b.emb))
    for k, v in state_rows(oa).items():
        assert torch.equal(v, state_rows(ob)[k]), k


def test_add_param_group_with_plain_linear_later():
    off, ref = pair(145)
    torch.manual_seed(146)
    extra = nn.Linear(D, 1)
    extra_off, extra_ref = copy.deepcopy(extra), copy.deepcopy(extra)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    data = batches(147, 4)
    for s, (ids, y) in enumerate(data):
        if s == 1:
            opt.add_param_group({"params": extra_off.parameters(), "lr": 0.3})
            ropt.opt.add_param_group({"params": extra_ref.parameters(), "lr": 0.3})
        opt.zero_grad()
        ropt.opt.zero_grad()
        for m, ex in ((off, extra_off), (ref, extra_ref)):
            (loss_of(m, ids, y) + ex(m.emb(ids)).pow(2).mean()).backward()
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)
    torch.testing.assert_close(extra_off.weight, extra_ref.weight, **TOL)


def test_explicit_prepare_grads_then_manual_grad_scaling():
    """prepare_grads() merges the rows; scaling every gradient in place over param_groups
    (as a user's own unscale would) must reach the table's update."""
    off, ref = pair(149)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.2)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.2), [ref.emb.weight])
    for ids, y in batches(150, 3):
        opt.zero_grad()
        ropt.opt.zero_grad()
        loss_of(off, ids, y).backward()
        loss_of(ref, ids, y).backward()
        opt.prepare_grads()
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.25)
        for p in ref.parameters():
            p.grad.mul_(0.25)
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)


def test_manual_lr_change_in_param_groups():
    off, ref = pair(151)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    for s, batch in enumerate(batches(152, 4)):
        for o in (opt, ropt.opt):
            for g in o.param_groups:
                g["lr"] = 0.05 / (s + 1)
        train_both(off, ref, opt, ropt, [batch])
    assert_models_equal(off, ref)


# torch 2.4's checkpoint calls its own deprecated torch.cpu.amp.autocast
@pytest.mark.filterwarnings("ignore:`torch.cpu.amp.autocast:FutureWarning")
def test_activation_checkpoint_around_embedding():
    from torch.utils.checkpoint import checkpoint

    off, ref = pair(153)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = LazyRef(torch.optim.Adam(ref.parameters(), lr=0.05), [ref.emb.weight])
    for ids, y in batches(154, 3):
        opt.zero_grad()
        ropt.opt.zero_grad()
        for m in (off, ref):
            out = checkpoint(m, ids, use_reentrant=False)
            (out - y).pow(2).mean().backward()
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)


def test_adagrad_initial_accumulator_value():
    off, ref = pair(155)
    kw = {"lr": 0.1, "initial_accumulator_value": 0.3}
    opt = gl.OffloadedOptimizer(torch.optim.Adagrad, off, **kw)
    ropt = LazyRef(torch.optim.Adagrad(ref.parameters(), **kw), [ref.emb.weight], fresh="keep")
    train_both(off, ref, opt, ropt, batches(156, 4))
    assert_models_equal(off, ref)
    torch.testing.assert_close(state_rows(opt)["sum"], ropt.opt.state[ref.emb.weight]["sum"], **TOL)


def test_state_dict_with_momentum_turned_on_loads_into_fresh_optimizer():
    """README: 'A state dict or checkpoint holding state the optimizer has not turned on yet
    (a scheduler's momentum) loads, and that state is paged from then on.'"""
    data = batches(158, 6)

    def run(model, opt, part):
        for ids, y in part:
            opt.zero_grad()
            loss_of(model, ids, y).backward()
            opt.step()

    a, _ = pair(157)
    oa = gl.OffloadedOptimizer(torch.optim.SGD, a, lr=0.1, momentum=0.0)
    run(a, oa, data[:2])
    for g in oa.param_groups:
        g["momentum"] = 0.9
    run(a, oa, data[2:4])
    sd = copy.deepcopy(oa.state_dict())
    msd = {k: v.clone() for k, v in a.state_dict().items()}
    run(a, oa, data[4:])
    b, _ = pair(0)
    b.load_state_dict(msd)
    ob = gl.OffloadedOptimizer(torch.optim.SGD, b, lr=0.1, momentum=0.0)
    ob.load_state_dict(sd)
    assert ob.param_groups[0]["momentum"] == 0.9
    run(b, ob, data[4:])
    assert torch.equal(table(b.emb), table(a.emb))
    assert torch.equal(b.head.weight, a.head.weight)


def test_weight_requires_grad_false_freezes_or_is_refused():
    """The usual freezing idiom for nn.Embedding is ``emb.weight.requires_grad = False``. On the
    drop-in it must either freeze the table or fail loudly, never be silently ignored."""
    off, _ = pair(159)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    t = table(off.emb)
    assert off.emb.weight.requires_grad
    off.emb.weight.requires_grad = False  # freezes, as emb.requires_grad_(False)
    assert not off.emb.weight.requires_grad and off.emb._frozen
    for ids, y in batches(160, 2):
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
    assert torch.equal(table(off.emb), t), "the table trained after weight.requires_grad = False"
    off.emb.weight.requires_grad_(True)
    assert off.emb.weight.requires_grad and not off.emb._frozen


def test_requires_grad_of_a_table_no_module_trains_is_refused_clearly():
    g = gl.DataGadget((4, 2), placement="cpu")
    assert g.requires_grad is False
    with pytest.raises(gl.GadgetTypeError, match="not an autograd tensor"):
        g.requires_grad = False
    assert "requires_grad" not in g.__dict__
    emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="True or False"):
        emb.weight.requires_grad = 0
    import copy
    import pickle

    twin = copy.deepcopy(emb)  # the copy's table answers for the copy
    emb.requires_grad_(False)
    assert twin.weight.requires_grad and not emb.weight.requires_grad
    pickle.loads(pickle.dumps(emb.weight))  # the module reference is not pickled


def test_sparse_adam_with_dense_params_error_leaves_everything_unchanged():
    off, _ = pair(161)
    opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, off, lr=0.05)
    before = snapshot(off, opt)
    ids, y = batches(162, 1)[0]
    loss_of(off, ids, y).backward()
    with pytest.raises(RuntimeError, match="dense gradients"):
        opt.step()
    assert_snapshot_equal(snapshot(off, opt), before)


def test_gradient_accumulation_with_grad_scaler_and_clipping():
    off, ref = pair(163)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    lazy = LazyRef(ropt, [ref.emb.weight])
    sc_off = torch.amp.GradScaler("cpu", init_scale=256.0)
    sc_ref = torch.amp.GradScaler("cpu", init_scale=256.0)
    data = batches(164, 4)
    for s in range(2):
        micro = data[2 * s : 2 * s + 2]
        opt.zero_grad()
        ropt.zero_grad()
        for ids, y in micro:
            sc_off.scale(loss_of(off, ids, y) / 2).backward()
            sc_ref.scale(loss_of(ref, ids, y) / 2).backward()
        sc_off.unscale_(opt)
        sc_ref.unscale_(ropt)
        a = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.3)
        b = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        torch.testing.assert_close(a, b, **TOL)
        sc_off.step(opt)
        used = torch.cat([ids.reshape(-1) for ids, _ in micro])
        snaps = [(p.detach().clone(), lazy._rows(p)) for p in lazy.lazy]
        sc_ref.step(ropt)
        with torch.no_grad():
            keep = torch.ones(N, dtype=torch.bool)
            keep[used] = False
            ref.emb.weight[keep] = snaps[0][0][keep]
            for k, v in ropt.state[ref.emb.weight].items():
                if isinstance(v, torch.Tensor) and v.shape == ref.emb.weight.shape:
                    v[keep] = snaps[0][1][k][keep] if k in snaps[0][1] else 0
        sc_off.update()
        sc_ref.update()
    assert_models_equal(off, ref)


@pytest.mark.parametrize("which", ["table", "plain", "model-and-table"])
def test_same_params_in_two_groups_refused_like_torch(which):
    """torch: 'some parameters appear in more than one parameter group' (ValueError). Silently
    keeping only the first group would drop the second group's options."""
    off, _ = pair(165)
    if which == "table":
        groups = [{"params": off.emb, "lr": 0.1}, {"params": off.emb, "lr": 0.5}]
    elif which == "plain":
        groups = [
            {"params": off.head.parameters(), "lr": 0.1},
            {"params": off.head.parameters(), "lr": 0.5},
        ]
    else:  # 'the model at 0.1, its embedding at 0.5'
        groups = [{"params": off, "lr": 0.1}, {"params": off.emb, "lr": 0.5}]
    with pytest.raises(ValueError, match="more than one"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'found no OffloadedEmbedding' for 'plain'
        gl.OffloadedOptimizer(torch.optim.SGD, groups, lr=0.3)


def test_readme_loop_order_forward_zero_grad_backward_step():
    """README loop: pred = model(...); loss = ...; opt.zero_grad(); loss.backward(); opt.step()."""
    off, ref = pair(167)
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, off, lr=1e-2, weight_decay=0.01)
    ropt = LazyRef(
        torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01), [ref.emb.weight]
    )
    for ids, y in batches(168, 4):
        for m, o in ((off, opt), (ref, ropt.opt)):
            loss = loss_of(m, ids, y)
            o.zero_grad()
            loss.backward()
        opt.step()
        ropt.step([ids])
    assert_models_equal(off, ref)


def test_rollback_with_model_and_optimizer_state_dicts():
    """Save both state dicts, train, restore both into the same objects, train the same
    batches again: identical to the first time (a 'skip a bad stretch' rollback)."""
    off, _ = pair(169)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    data = batches(170, 4)
    for ids, y in data[:2]:
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
    msd = {k: v.clone() for k, v in off.state_dict().items()}
    osd = copy.deepcopy(opt.state_dict())
    for ids, y in data[2:]:
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
    first = table(off.emb), off.head.weight.detach().clone()
    off.load_state_dict(msd)
    opt.load_state_dict(copy.deepcopy(osd))
    for ids, y in data[2:]:
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
    assert torch.equal(table(off.emb), first[0])
    assert torch.equal(off.head.weight, first[1])


def test_unsupported_optimizer_refused_with_list_subclass_accepted():
    off, _ = pair(171)
    with pytest.raises(gl.GadgetTypeError, match="SparseAdam, Adam"):
        gl.OffloadedOptimizer(torch.optim.LBFGS, off, lr=0.1)

    class MyAdam(torch.optim.Adam):
        pass

    opt = gl.OffloadedOptimizer(MyAdam, off, lr=0.05)
    ids, y = batches(172, 1)[0]
    t = table(off.emb)
    loss_of(off, ids, y).backward()
    opt.step()
    changed = (table(off.emb) != t).any(dim=1)
    assert set(changed.nonzero().reshape(-1).tolist()) == set(ids.reshape(-1).tolist())


@pytest.mark.parametrize("mode", ["sum", "max"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_bag_table_dtypes(dtype, mode):
    w = weights(173, dtype=dtype)
    off, ref = off_bag(w, mode), ref_bag(w, mode)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.05, momentum=0.9)
    ropt = LazyRef(torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), [ref.weight])
    for ids, _ in batches(174, 3, shape=(4, 3)):
        a, b = off(ids), ref(ids)
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **half_tol(dtype))
        opt.zero_grad()
        ropt.opt.zero_grad()
        a.float().pow(2).sum().backward()
        b.float().pow(2).sum().backward()
        opt.step()
        ropt.step([ids])
    torch.testing.assert_close(table(off), ref.weight.detach(), **half_tol(dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for CUDA ids")
def test_cuda_ids_for_a_cpu_device_table():
    """ids on another device than the module's: nn.Embedding raises; the drop-in must either
    look them up correctly or raise a clear TypeError."""
    off, ref = pair(175)
    ids = torch.tensor([[1, 2], [3, 1]])
    try:
        out = off.emb(ids.cuda())
    except TypeError as exc:
        assert "device" in str(exc) or "cuda" in str(exc)
    else:
        torch.testing.assert_close(out.cpu(), ref.emb(ids), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["load", "loadCupy", "insertData", "setitem", "fill_", "init_"])
def test_changing_rows_while_a_lookup_waits_is_refused(how, tmp_path):
    """README: changing a table's rows while a lookup with a gradient waits for its step is
    refused (the step would write the rows it read over the change); after step() it works."""
    f = tmp_path / "zeros.npy"
    np.save(f, np.zeros((N, D), np.float32))
    emb = off_emb(weights(170))
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    before = table(emb)
    change = {
        "load": lambda: emb.weight.load(f),
        "loadCupy": lambda: emb.weight.loadCupy(f),
        "insertData": lambda: emb.weight.insertData(torch.zeros(1, D), [3]),
        "setitem": lambda: emb.weight.__setitem__([3], torch.zeros(1, D)),
        "fill_": lambda: emb.weight.fill_(0.0),
        "init_": lambda: emb.weight.init_(nn.init.zeros_),
    }[how]
    with pytest.raises(gl.GadgetValueError, match="waits for backward"):
        change()
    assert torch.equal(table(emb), before)
    opt.step()
    change()  # no lookup waits now
    assert not table(emb)[3].any()
