"""Session 28 black-box review of the drop-in training module.

``OffloadedEmbedding`` / ``OffloadedEmbeddingBag`` / ``OffloadedOptimizer`` against a dense
reference: a ``torch.nn.Embedding`` / ``nn.EmbeddingBag`` with the same initial weights,
trained by the same torch optimizer with the README's "lazy per-row updates" (only the rows
looked up since the last step are stepped, one step count per table, as torch's
``SparseAdam``). For SGD without momentum that reference is plain dense training.

The README promises (section "Training embeddings larger than GPU memory"): several lookups
of a table in a step, and gradient accumulation over several backward passes, are
bit-identical to a dense ``nn.Embedding`` trained the same way; only where one lookup's
output gets gradient from several backward passes (``retain_graph=True``) are the sums exact
to rounding only. The usage patterns here: activation checkpointing, retain_graph, gradient
accumulation, ``zero_grad(set_to_none=False)``, repeated lookups, evaluation lookups,
autocast, several tables with dense parameters, state-dict round trips, LR schedulers and
bad input.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gadgetloader as gl

D = 8


@pytest.fixture(autouse=True, scope="module")
def _a_cpu_only_machine():
    """This file was written for a CPU-only machine: on a CUDA machine torch sees no GPU
    for its tests (module scope, so its module fixtures are built that way too). The
    CUDA lookups are covered by tests/test_review_session28_gpu.py and the suites that
    run over every placement."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


#: the per-row state tables torch's optimizers keep (all start at zero here)
_STATES = {
    torch.optim.Adam: ("exp_avg", "exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq"),
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.Adagrad: ("sum",),
    torch.optim.Adamax: ("exp_avg", "exp_inf"),
    torch.optim.RAdam: ("exp_avg", "exp_avg_sq"),
    torch.optim.Adadelta: ("square_avg", "acc_delta"),
    torch.optim.RMSprop: ("square_avg", "momentum_buffer", "grad_avg"),
}

_HYPER_SKIP = {
    "params",
    "initial_lr",
    "max_lr",
    "min_lr",
    "base_lr",
    "max_momentum",
    "base_momentum",
}


def _weights(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _ids(n: int, size, seed: int) -> torch.Tensor:
    return torch.randint(0, n, size, generator=torch.Generator().manual_seed(seed))


class LazyTable:
    """A dense ``nn.Embedding``'s weight stepped by torch's optimizer over the rows looked up
    since the last step only (the README's lazy per-row updates, one step count per table)."""

    def __init__(self, weight: nn.Parameter, cls: type) -> None:
        self.weight, self.cls = weight, cls
        self.state = {n: torch.zeros_like(weight.detach()) for n in _STATES[cls]}
        self.state["max_exp_avg_sq"] = torch.zeros_like(weight.detach())  # used with amsgrad
        self.count = 0
        self.rows: list[torch.Tensor] = []

    def note(self, ids: torch.Tensor) -> None:
        self.rows.append(ids.detach().reshape(-1).to(torch.int64))

    def discard(self) -> None:
        self.rows = []
        self.weight.grad = None

    def step(self, opts: dict) -> None:
        if not self.rows:
            self.weight.grad = None
            return
        rows = torch.unique(torch.cat(self.rows))
        self.rows = []
        p = nn.Parameter(self.weight.detach()[rows].clone())
        g = self.weight.grad
        p.grad = torch.zeros_like(p) if g is None else g[rows].clone()
        accepted = inspect.signature(self.cls.__init__).parameters
        opt = self.cls([p], **{k: v for k, v in opts.items() if k in accepted})
        st = {n: t[rows].clone() for n, t in self.state.items()}
        if not opts.get("momentum", 0) and self.cls in (torch.optim.SGD, torch.optim.RMSprop):
            st.pop("momentum_buffer")
        if not opts.get("centered", False):
            st.pop("grad_avg", None)
        if not opts.get("amsgrad", False):
            st.pop("max_exp_avg_sq")
        st["step"] = torch.tensor(float(self.count))
        opt.state[p] = st
        opt.step()
        with torch.no_grad():
            self.weight[rows] = p.detach()
        for n in self.state:
            if n in opt.state[p]:
                self.state[n][rows] = opt.state[p][n]
        self.count += 1
        self.weight.grad = None


class Side:
    """One side of a comparison: calling it looks a table up (the reference notes the ids)."""

    def __init__(self, mods: nn.ModuleDict, lazy: dict | None) -> None:
        self.mods, self.lazy = mods, lazy

    def __call__(self, name: str, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.lazy is not None and torch.is_grad_enabled():
            self.lazy[name].note(ids)
        return self.mods[name](ids, *args, **kwargs)

    @property
    def head(self) -> nn.Module:
        return self.mods["head"]


class Pair:
    """An offloaded model and its dense reference with the same initial weights.

    ``tables``: ``{name: rows}`` of ``OffloadedEmbedding`` tables; ``bags``:
    ``{name: (rows, mode)}`` of ``OffloadedEmbeddingBag`` tables; plus a ``head``
    ``nn.Linear(D, 1)`` trained by the same optimizer.
    """

    def __init__(
        self,
        cls: type = torch.optim.Adam,
        opts: dict | None = None,
        tables: dict | None = None,
        bags: dict | None = None,
        seed: int = 0,
        placement: str = "cpu",
        groups=None,
    ) -> None:
        self.cls = cls
        self.opts = dict(opts or {"lr": 0.05})
        tables = {"a": 64} if tables is None and bags is None else (tables or {})
        bags = bags or {}
        torch.manual_seed(seed)
        self.ref, self.off = nn.ModuleDict(), nn.ModuleDict()
        for k, (name, n) in enumerate(tables.items()):
            w = _weights(n, D, seed * 100 + k)
            r = nn.Embedding(n, D)
            with torch.no_grad():
                r.weight.copy_(w)
            o = gl.OffloadedEmbedding(n, D, placement=placement)
            o.load_state_dict({"weight": w})
            self.ref[name], self.off[name] = r, o
        for k, (name, (n, mode)) in enumerate(bags.items()):
            w = _weights(n, D, seed * 100 + 50 + k)
            r = nn.EmbeddingBag(n, D, mode=mode)
            with torch.no_grad():
                r.weight.copy_(w)
            o = gl.OffloadedEmbeddingBag(n, D, mode=mode, placement=placement)
            o.load_state_dict({"weight": w})
            self.ref[name], self.off[name] = r, o
        head = nn.Linear(D, 1)
        self.ref["head"], self.off["head"] = head, copy.deepcopy(head)
        self.names = list(tables) + list(bags)
        self.lazy = {nm: LazyTable(self.ref[nm].weight, cls) for nm in self.names}
        self.table_lr: dict[str, float] = {}
        if groups is None:
            self.opt = gl.OffloadedOptimizer(cls, self.off, **self.opts)
        else:
            self.opt = gl.OffloadedOptimizer(cls, groups(self), **self.opts)
        self.ref_opt = cls(self.ref["head"].parameters(), **self.opts)
        self.o = Side(self.off, None)
        self.r = Side(self.ref, self.lazy)

    # reference side -----------------------------------------------------------------
    def hyper(self) -> dict:
        g = self.ref_opt.param_groups[0]
        return {k: v for k, v in g.items() if k not in _HYPER_SKIP}

    def ref_step(self) -> None:
        self.ref_opt.step()
        hyper = self.hyper()
        for nm, lz in self.lazy.items():
            h = dict(hyper)
            if nm in self.table_lr:
                h["lr"] = self.table_lr[nm]
            lz.step(h)

    def ref_zero_grad(self, set_to_none: bool = True) -> None:
        self.ref_opt.zero_grad(set_to_none=set_to_none)
        for lz in self.lazy.values():
            lz.discard()

    def both_steps(self) -> None:
        self.opt.step()
        self.ref_step()

    def both_zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        self.ref_zero_grad(set_to_none)

    # comparison ---------------------------------------------------------------------
    def table(self, name: str) -> torch.Tensor:
        return self.off[name].state_dict()["weight"].clone()

    def assert_same(self, exact: bool = True) -> None:
        check = _equal if exact else torch.testing.assert_close
        for nm in self.names:
            check(self.table(nm), self.ref[nm].weight.detach())
        for a, b in zip(self.off["head"].parameters(), self.ref["head"].parameters(), strict=True):
            check(a.detach(), b.detach())


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs()
        raise AssertionError(
            f"not bit-identical: {int((diff > 0).sum())} of {a.numel()} values differ, max {diff.max().item():.3e}"
        )


def _loss(side: Side, ids: torch.Tensor, name: str = "a") -> torch.Tensor:
    return side.head(side(name, ids)).square().mean()


# ------------------------------------------------------------------------------------
# baseline: the harness itself reproduces plain training
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,opts",
    [
        (torch.optim.SGD, {"lr": 0.1}),
        (torch.optim.Adam, {"lr": 0.05}),
        (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
        (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.Adam, {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}),
        (torch.optim.Adamax, {"lr": 0.05}),
        (torch.optim.RAdam, {"lr": 0.05}),
        (torch.optim.Adadelta, {"lr": 1.0}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ],
)
def test_plain_training_matches_lazy_dense_reference(cls, opts) -> None:
    p = Pair(cls, opts)
    for step in range(4):
        ids = _ids(64, (6, 3), step)
        for side in (p.o, p.r):
            _loss(side, ids).backward()
        p.both_steps()
        p.both_zero_grad()
    p.assert_same()


def test_sgd_matches_plain_dense_embedding_without_emulation() -> None:
    """For SGD without momentum the lazy reference is ordinary dense training: check against a
    dense ``nn.Embedding`` and ``torch.optim.SGD`` over all of ``model.parameters()``."""
    p = Pair(torch.optim.SGD, {"lr": 0.2})
    dense = copy.deepcopy(p.ref)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.2)
    for step in range(4):
        ids = _ids(64, (5, 4), 10 + step)
        _loss(p.o, ids).backward()
        p.opt.step()
        p.opt.zero_grad()
        dense["head"](dense["a"](ids)).square().mean().backward()
        dense_opt.step()
        dense_opt.zero_grad()
    _equal(p.table("a"), dense["a"].weight.detach())
    _equal(p.off["head"].weight.detach(), dense["head"].weight.detach())


# ------------------------------------------------------------------------------------
# activation checkpointing
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_checkpoint_non_reentrant_matches_dense(cls) -> None:
    p = Pair(cls, {"lr": 0.05}, tables={"a": 80, "b": 60})
    for step in range(4):
        ia, ib = _ids(80, (5, 3), step), _ids(60, (5, 2), 50 + step)

        for side in (p.o, p.r):

            def block(x, y, side=side):
                return side.head(side("a", x).sum(1) * side("b", y).mean(1))

            out = checkpoint(block, ia, ib, use_reentrant=False)
            out.square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_checkpoint_reentrant_matches_dense(cls) -> None:
    """``use_reentrant=True`` runs the forward under no_grad and the lookups again inside
    the backward; a float input that requires grad keeps the output in the graph."""
    p = Pair(cls, {"lr": 0.05})
    for step in range(4):
        ids = _ids(64, (6, 2), step)
        scale = torch.linspace(0.5, 1.5, D)
        for side in (p.o, p.r):
            x = scale.clone().requires_grad_(True)

            def block(i, x, side=side):
                return side.head(side("a", i) * x)

            out = checkpoint(block, ids, x, use_reentrant=True)
            out.square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_checkpoint_lookup_outside_and_inside_mixed() -> None:
    """A lookup outside the checkpointed block feeding it, and one inside it, same table."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for step in range(3):
        i1, i2 = _ids(64, (4, 3), step), _ids(64, (4, 3), 20 + step)
        for side in (p.o, p.r):
            e = side("a", i1)

            def block(e, i, side=side):
                return side.head(e * side("a", i)).sum()

            checkpoint(block, e, i2, use_reentrant=False).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


# ------------------------------------------------------------------------------------
# several backward passes, accumulation, zero_grad
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_retain_graph_second_backward_before_step(cls) -> None:
    """One lookup's output gets gradient from two backward passes: exact to rounding."""
    p = Pair(cls, {"lr": 0.05})
    for step in range(3):
        ids = _ids(64, (6, 3), step)
        for side in (p.o, p.r):
            h = side.head(side("a", ids))
            h.square().mean().backward(retain_graph=True)
            (h * 0.3).sin().sum().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same(exact=False)


def test_retain_graph_two_lookups_second_backward_reaches_only_one() -> None:
    """Two lookups; the second backward reaches only the second lookup."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for step in range(3):
        i1, i2 = _ids(64, (5,), step), _ids(64, (5,), 30 + step)
        for side in (p.o, p.r):
            e1 = side("a", i1)
            e2 = side("a", i2)
            (e1 * e2).sum().backward(retain_graph=True)
            e2.square().sum().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same(exact=False)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad])
def test_gradient_accumulation_micro_batches_bit_identical(cls) -> None:
    p = Pair(cls, {"lr": 0.05}, tables={"a": 64, "b": 100})
    for step in range(3):
        for micro in range(4):
            ia = _ids(64, (4, 3), 10 * step + micro)  # overlapping across micro-batches
            ib = _ids(100, (4,), 100 + 10 * step + micro)
            for side in (p.o, p.r):
                (side.head(side("a", ia).sum(1) + side("b", ib)).square().mean() / 4).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_zero_grad_set_to_none_false_and_untouched_table() -> None:
    """After ``zero_grad(set_to_none=False)`` a table with no lookup is not stepped and its
    step count does not move (Adam's bias correction then shows it), while the dense head
    is stepped with its zeroed gradient as torch does."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64, "b": 64})
    schedule = [("a", "b"), ("a",), ("a",), ("a", "b"), ("b",)]
    for step, names in enumerate(schedule):
        for side in (p.o, p.r):
            x = sum(side(nm, _ids(64, (6,), 7 * step + k)) for k, nm in enumerate(names))
            side.head(x).square().mean().backward()
        p.both_steps()
        p.both_zero_grad(set_to_none=False)
        p.assert_same()
    for prm in p.off["head"].parameters():
        assert prm.grad is not None and not prm.grad.any()


def test_zero_grad_discards_pending_lookups() -> None:
    """``zero_grad()`` between a backward and the step throws that backward's gradient away
    (also with set_to_none=False); the rows of the discarded lookup are not stepped."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    # train the rows first so that a wrongly stepped row would move (momentum)
    for side in (p.o, p.r):
        _loss(side, torch.arange(64)).backward()
    p.both_steps()
    p.both_zero_grad()
    for step, none in enumerate((False, True)):
        for side in (p.o, p.r):
            _loss(side, torch.arange(0, 32)).backward()
        p.both_zero_grad(set_to_none=none)
        for side in (p.o, p.r):
            _loss(side, _ids(64, (5,), step) % 32 + 32).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_step_without_backward_of_new_lookup_after_zero_grad() -> None:
    """A second ``step()`` with no new backward leaves tables alone (as the README says)."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for side in (p.o, p.r):
        _loss(side, torch.tensor([1, 2, 3])).backward()
    p.both_steps()
    before = p.table("a")
    p.opt.step()
    _equal(p.table("a"), before)


# ------------------------------------------------------------------------------------
# several lookups in one forward
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", ["overlapping", "disjoint", "identical"])
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_module_used_twice_in_one_forward(overlap, cls) -> None:
    p = Pair(cls, {"lr": 0.05}, tables={"a": 100})
    for step in range(3):
        i1 = _ids(100, (8, 2), step)
        if overlap == "overlapping":
            i2 = torch.cat([i1[:4], _ids(100, (4, 2), 40 + step)])
        elif overlap == "disjoint":
            i1 = i1 % 50
            i2 = _ids(50, (8, 2), 40 + step) + 50
        else:
            i2 = i1.clone()
        for side in (p.o, p.r):
            u, v = side("a", i1), side("a", i2)
            side.head(u.sum(1) * v.sum(1) + u.mean(1)).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_three_lookups_different_shapes_with_repeats() -> None:
    """Skip-gram shape: center, context, negatives of one table, heavy repeats."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 40})
    for step in range(3):
        c = _ids(10, (16,), step)  # many repeats
        ctx = _ids(10, (16,), 10 + step)
        neg = _ids(40, (16, 5), 20 + step)
        for side in (p.o, p.r):
            ec, ep, en = side("a", c), side("a", ctx), side("a", neg)
            pos = (ec * ep).sum(-1)
            ng = torch.bmm(en, ec.unsqueeze(-1)).squeeze(-1)
            loss = -nn.functional.logsigmoid(pos).mean() - nn.functional.logsigmoid(-ng).mean()
            (loss + side.head(ec).mean()).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


# ------------------------------------------------------------------------------------
# evaluation lookups
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode"])
def test_eval_lookup_between_steps(ctx) -> None:
    manager = torch.no_grad if ctx == "no_grad" else torch.inference_mode
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    probe = torch.arange(64).reshape(8, 8)
    for step in range(4):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            _loss(side, ids).backward()
        p.both_steps()
        p.both_zero_grad()
        with manager():
            got = p.off["a"](probe)
            want = p.ref["a"](probe)
        assert not got.requires_grad
        _equal(got, want)
    p.assert_same()


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode"])
def test_eval_lookup_between_forward_and_backward_is_not_stepped(ctx) -> None:
    """An evaluation lookup of already-trained rows (non-zero momentum) made while a training
    lookup waits for its backward must not make those rows part of the step."""
    manager = torch.no_grad if ctx == "no_grad" else torch.inference_mode
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for side in (p.o, p.r):
        _loss(side, torch.arange(64)).backward()
    p.both_steps()
    p.both_zero_grad()
    for step in range(3):
        train_ids = _ids(32, (5,), step)  # rows 0..31
        for side in (p.o, p.r):
            h = side.head(side("a", train_ids))
            with manager():
                e = side.mods["a"](torch.arange(32, 64))
                assert not e.requires_grad
            h.square().mean().backward()
        _equal(p.off["a"](torch.arange(32, 64)).detach(), p.ref["a"].weight.detach()[32:])
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_model_eval_mode_lookups_and_training_in_eval_mode() -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64}, bags={"bag": (48, "mean")})
    for step in range(3):
        p.off.train()
        p.ref.train()
        ids, bag_ids = _ids(64, (5,), step), _ids(48, (5, 3), 9 + step)
        for side in (p.o, p.r):
            side.head(side("a", ids) + side("bag", bag_ids)).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.off.eval()
        p.ref.eval()
        with torch.no_grad():
            _equal(p.off["a"](torch.arange(64)), p.ref["a"](torch.arange(64)))
            b = torch.arange(48).reshape(12, 4)
            _equal(p.off["bag"](b), p.ref["bag"](b))
        # training in eval mode (eval only changes dropout / batch norm) is training
        for side in (p.o, p.r):
            side.head(side("a", ids.flip(0)) * 2).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


# ------------------------------------------------------------------------------------
# autocast
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_autocast_bfloat16_matches_dense_under_same_autocast(cls) -> None:
    p = Pair(cls, {"lr": 0.05}, tables={"a": 64}, bags={"bag": (64, "sum")})
    for step in range(3):
        ids, bag_ids = _ids(64, (6,), step), _ids(64, (6, 4), 30 + step)
        outs = []
        for side in (p.o, p.r):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                e = side("a", ids)
                b = side("bag", bag_ids)
                out = side.head(e * b)
            outs.append((e, b, out))
            out.float().square().mean().backward()
        (eo, bo, oo), (er, br, orf) = outs
        assert eo.dtype == er.dtype and bo.dtype == br.dtype and oo.dtype == orf.dtype
        _equal(eo.detach(), er.detach())
        _equal(bo.detach(), br.detach())
        _equal(oo.detach(), orf.detach())
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


# ------------------------------------------------------------------------------------
# several tables and dense parameters in one model
# ------------------------------------------------------------------------------------


def test_several_tables_bag_and_linear_one_optimizer() -> None:
    """README example shape: item + user bag + head, ``OffloadedOptimizer(AdamW, model)``."""
    p = Pair(
        torch.optim.AdamW,
        {"lr": 0.01, "weight_decay": 0.01},
        tables={"item": 120, "extra": 30},
        bags={"user": (90, "mean")},
    )
    for step in range(4):
        items = _ids(120, (8,), step)
        extra = _ids(30, (8,), 40 + step)
        hist = _ids(90, (8, 5), 80 + step)
        y = torch.randn(8, generator=torch.Generator().manual_seed(step))
        for side in (p.o, p.r):
            pred = side.head(side("item", items) * side("user", hist) + side("extra", extra))
            nn.functional.mse_loss(pred.squeeze(-1), y).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_param_group_dicts_give_tables_their_own_lr() -> None:
    """``[model, {"params": model.head.parameters(), "lr": ...}]`` and a dict naming a table."""

    def groups(pair: Pair):
        pair.table_lr = {"a": 0.2}
        return [{"params": pair.off["a"], "lr": 0.2}, pair.off]

    p = Pair(torch.optim.Adam, {"lr": 0.02}, tables={"a": 64, "b": 64}, groups=groups)
    for step in range(3):
        ia, ib = _ids(64, (6,), step), _ids(64, (6,), 10 + step)
        for side in (p.o, p.r):
            side.head(side("a", ia) - side("b", ib)).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_head_in_own_group_with_lr() -> None:
    def groups(pair: Pair):
        return [pair.off, {"params": pair.off["head"].parameters(), "lr": 0.3}]

    p = Pair(torch.optim.SGD, {"lr": 0.05}, groups=groups)
    p.ref_opt = torch.optim.SGD(p.ref["head"].parameters(), lr=0.3)
    p.table_lr = {"a": 0.05}
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            _loss(side, ids).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


# ------------------------------------------------------------------------------------
# state dicts mid-training
# ------------------------------------------------------------------------------------


def _train(pair: Pair, steps: range, sched=None, ref_sched=None, only_off: bool = False) -> None:
    for step in steps:
        ia, ib = _ids(64, (5, 2), step), _ids(48, (5, 3), 70 + step)
        sides = (pair.o,) if only_off else (pair.o, pair.r)
        for side in sides:
            (side.head(side("a", ia).sum(1) + side("bag", ib)).square().mean()).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        if sched is not None:
            sched.step()
        if not only_off:
            pair.ref_step()
            pair.ref_zero_grad()
            if ref_sched is not None:
                ref_sched.step()


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.Adagrad, torch.optim.SGD])
def test_state_dict_resume_into_fresh_objects_bit_identical(cls) -> None:
    opts = {"lr": 0.05, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 0.05}
    tables, bags = {"a": 64}, {"bag": (48, "sum")}
    straight = Pair(cls, opts, tables=tables, bags=bags)
    _train(straight, range(6), only_off=True)

    first = Pair(cls, opts, tables=tables, bags=bags)
    _train(first, range(3), only_off=True)
    model_sd = copy.deepcopy(first.off.state_dict())
    opt_sd = copy.deepcopy(first.opt.state_dict())
    del first

    resumed = Pair(cls, opts, tables=tables, bags=bags, seed=7)  # other initial weights
    resumed.off.load_state_dict(model_sd)
    resumed.opt.load_state_dict(opt_sd)
    _train(resumed, range(3, 6), only_off=True)
    for nm in ("a", "bag"):
        _equal(resumed.table(nm), straight.table(nm))
    for a, b in zip(
        resumed.off["head"].parameters(), straight.off["head"].parameters(), strict=True
    ):
        _equal(a.detach(), b.detach())


def test_state_dict_rewind_same_objects_then_retrain() -> None:
    """Snapshot mid-training, train on, load the snapshot into the same objects: training
    again from there reproduces the first continuation exactly."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64}, bags={"bag": (48, "mean")})
    _train(p, range(2), only_off=True)
    model_sd = copy.deepcopy(p.off.state_dict())
    opt_sd = copy.deepcopy(p.opt.state_dict())
    _train(p, range(2, 5), only_off=True)
    after = {nm: p.table(nm) for nm in ("a", "bag")}
    head = [t.detach().clone() for t in p.off["head"].parameters()]
    p.off.load_state_dict(model_sd)
    p.opt.load_state_dict(opt_sd)
    _equal(p.table("a"), model_sd["a.weight"])
    _train(p, range(2, 5), only_off=True)
    for nm in ("a", "bag"):
        _equal(p.table(nm), after[nm])
    for a, b in zip(p.off["head"].parameters(), head, strict=True):
        _equal(a.detach(), b)


def test_state_dict_resume_with_scheduler_matches_reference() -> None:
    opts = {"lr": 0.05}
    tables, bags = {"a": 64}, {"bag": (48, "sum")}
    ref = Pair(torch.optim.Adam, opts, tables=tables, bags=bags)
    sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.ref_opt, step_size=2, gamma=0.5)
    _train(ref, range(6), sched, ref_sched)
    ref.assert_same()

    first = Pair(torch.optim.Adam, opts, tables=tables, bags=bags)
    s1 = torch.optim.lr_scheduler.StepLR(first.opt, step_size=2, gamma=0.5)
    _train(first, range(3), s1, only_off=True)
    saved = copy.deepcopy(
        {"m": first.off.state_dict(), "o": first.opt.state_dict(), "s": s1.state_dict()}
    )
    resumed = Pair(torch.optim.Adam, opts, tables=tables, bags=bags, seed=3)
    s2 = torch.optim.lr_scheduler.StepLR(resumed.opt, step_size=2, gamma=0.5)
    resumed.off.load_state_dict(saved["m"])
    resumed.opt.load_state_dict(saved["o"])
    s2.load_state_dict(saved["s"])
    assert resumed.opt.param_groups[0]["lr"] == first.opt.param_groups[0]["lr"]
    _train(resumed, range(3, 6), s2, only_off=True)
    for nm in ("a", "bag"):
        _equal(resumed.table(nm), ref.table(nm))
    assert resumed.opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]


# ------------------------------------------------------------------------------------
# learning-rate schedulers
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3),
        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
    ],
    ids=["StepLR", "ExponentialLR", "LambdaLR", "LinearLR-warmup"],
)
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_lr_scheduler_matches_reference(make, cls) -> None:
    p = Pair(cls, {"lr": 0.1}, tables={"a": 64}, bags={"bag": (48, "mean")})
    sched, ref_sched = make(p.opt), make(p.ref_opt)
    assert p.opt.param_groups[0]["lr"] == p.ref_opt.param_groups[0]["lr"]
    _train(p, range(6), sched, ref_sched)
    assert p.opt.param_groups[0]["lr"] == p.ref_opt.param_groups[0]["lr"]
    p.assert_same()


def test_one_cycle_lr_turns_sgd_momentum_on() -> None:
    """OneCycleLR warms lr up before the first step and turns SGD's momentum on: the README
    says the paged state follows the hyper-parameters as torch's would."""
    p = Pair(torch.optim.SGD, {"lr": 0.1}, tables={"a": 64}, bags={"bag": (48, "sum")})

    def make(o):
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=8)

    sched, ref_sched = make(p.opt), make(p.ref_opt)
    assert p.opt.param_groups[0]["momentum"] == p.ref_opt.param_groups[0]["momentum"] > 0
    _train(p, range(6), sched, ref_sched)
    p.assert_same()


def test_scheduler_and_param_group_lr_for_table_group() -> None:
    """A scheduler scales every group, a table's own group included."""

    def groups(pair: Pair):
        return [{"params": pair.off["a"], "lr": 0.3}, pair.off]

    p = Pair(
        torch.optim.SGD, {"lr": 0.1}, tables={"a": 64}, bags={"bag": (48, "sum")}, groups=groups
    )
    sched = torch.optim.lr_scheduler.StepLR(p.opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(p.ref_opt, step_size=1, gamma=0.5)
    for step in range(4):
        p.table_lr = {"a": 0.3 * 0.5**step}
        _train(p, range(step, step + 1), sched, ref_sched)
    p.assert_same()
    lrs = sorted(g["lr"] for g in p.opt.param_groups)
    assert lrs == pytest.approx(sorted([0.3 * 0.5**4, 0.1 * 0.5**4]))


# ------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------

_BAD = [
    pytest.param(torch.tensor([3, -1, 5]), gl.GadgetIndexError, id="negative"),
    pytest.param(torch.tensor([3, 64, 5]), gl.GadgetIndexError, id="too-large"),
    pytest.param(torch.tensor([[1, 2], [10**9, 0]]), gl.GadgetIndexError, id="huge"),
    pytest.param(torch.tensor([1.0, 2.0]), gl.GadgetTypeError, id="float"),
    pytest.param(torch.tensor([True, False]), gl.GadgetTypeError, id="bool"),
    pytest.param(torch.tensor([1, 2], device="meta"), gl.GadgetTypeError, id="meta-device"),
]


def _snapshot(p: Pair) -> tuple:
    return copy.deepcopy(p.off.state_dict()), copy.deepcopy(p.opt.state_dict())


def _assert_snapshot(p: Pair, snap: tuple) -> None:
    m, o = snap
    for k, v in p.off.state_dict().items():
        _equal(v, m[k])
    _assert_nested_equal(p.opt.state_dict(), o)


def _assert_nested_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        _equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_nested_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_nested_equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("bad,err", _BAD)
def test_bad_ids_mid_step_raise_and_change_nothing(bad, err) -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for side in (p.o, p.r):
        _loss(side, torch.arange(64)).backward()
    p.both_steps()
    p.both_zero_grad()
    good = _ids(64, (6,), 1)
    for side in (p.o, p.r):
        loss = _loss(side, good)
        if side is p.o:
            snap = _snapshot(p)
            with pytest.raises(err):
                p.off["a"](bad)
            _assert_snapshot(p, snap)
        loss.backward()
    p.both_steps()
    p.both_zero_grad()
    p.assert_same()
    # and the table keeps training normally afterwards
    for side in (p.o, p.r):
        _loss(side, _ids(64, (6,), 2)).backward()
    p.both_steps()
    p.assert_same()


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("bad,err", _BAD)
def test_bad_ids_under_no_grad_raise(bad, err, ctx) -> None:
    manager = torch.no_grad if ctx == "no_grad" else torch.inference_mode
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    snap = _snapshot(p)
    with manager(), pytest.raises(err):
        p.off["a"](bad)
    _assert_snapshot(p, snap)


@pytest.mark.parametrize(
    "kwargs,err",
    [
        pytest.param(
            {"input": torch.tensor([1, 2, 70]), "offsets": torch.tensor([0, 2])},
            gl.GadgetIndexError,
            id="id-out-of-range",
        ),
        pytest.param(
            {"input": torch.tensor([1, 2, 3]), "offsets": torch.tensor([1, 2])},
            ValueError,
            id="offsets-not-from-0",
        ),
        pytest.param(
            {"input": torch.tensor([1, 2, 3]), "offsets": torch.tensor([0, 2, 1])},
            ValueError,
            id="offsets-decrease",
        ),
        pytest.param(
            {"input": torch.tensor([1, 2, 3]), "offsets": torch.tensor([0, 5])},
            ValueError,
            id="offsets-past-end",
        ),
        pytest.param(
            {
                "input": torch.tensor([1, 2, 3]),
                "offsets": torch.tensor([0, 1]),
                "per_sample_weights": torch.ones(2),
            },
            ValueError,
            id="weights-shape",
        ),
        pytest.param(
            {"input": torch.tensor([[1.0, 2.0]])},
            gl.GadgetTypeError,
            id="float-2d",
        ),
        pytest.param(
            {"input": torch.tensor([1, 2, 3]), "offsets": torch.tensor([0, 1], device="meta")},
            TypeError,
            id="offsets-meta-device",
        ),
        pytest.param(
            {"input": torch.tensor([1, 2, 3]), "offsets": torch.tensor([0.0, 1.0])},
            TypeError,
            id="offsets-float",
        ),
        pytest.param(
            {
                "input": torch.tensor([1, 2, 3]),
                "offsets": torch.tensor([0, 1]),
                "per_sample_weights": torch.ones(3, dtype=torch.int64),
            },
            TypeError,
            id="weights-int",
        ),
    ],
)
def test_bad_bag_call_mid_step_leaves_nothing_for_the_step(kwargs, err) -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05}, bags={"bag": (48, "sum")})
    for side in (p.o, p.r):
        side.head(side("bag", torch.arange(48).reshape(12, 4))).square().mean().backward()
    p.both_steps()
    p.both_zero_grad()
    good = _ids(48, (4, 3), 5)
    for side in (p.o, p.r):
        loss = side.head(side("bag", good)).square().mean()
        if side is p.o:
            snap = _snapshot(p)
            with pytest.raises(err) as info:
                p.off["bag"](**kwargs)
            assert isinstance(info.value, gl.GadgetError)
            _assert_snapshot(p, snap)
        loss.backward()
    p.both_steps()
    p.both_zero_grad()
    p.assert_same()


# ------------------------------------------------------------------------------------
# EmbeddingBag forms
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_offsets_and_weights_train_like_dense_bag(mode) -> None:
    cls = torch.optim.SGD if mode == "max" else torch.optim.Adam
    p = Pair(cls, {"lr": 0.05}, bags={"bag": (60, mode)})
    for step in range(3):
        flat = _ids(60, (14,), step)
        offsets = torch.tensor([0, 3, 3, 7, 12])  # one empty bag
        psw = None
        if mode == "sum":
            psw = torch.rand(14, generator=torch.Generator().manual_seed(step))
        for side in (p.o, p.r):
            out = side("bag", flat, offsets, per_sample_weights=psw)
            side.head(out).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_bag_and_embedding_of_checkpointed_block_with_accumulation() -> None:
    """Everything at once: non-reentrant checkpoint, two micro-batches, bag + embedding."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64}, bags={"bag": (48, "mean")})
    for step in range(3):
        for micro in range(2):
            ia, ib = _ids(64, (4,), 10 * step + micro), _ids(48, (4, 3), 50 + 10 * step + micro)
            for side in (p.o, p.r):

                def block(x, y, side=side):
                    return side.head(side("a", x) * side("bag", y))

                checkpoint(block, ia, ib, use_reentrant=False).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


# ------------------------------------------------------------------------------------
# placements available without a GPU
# ------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback of 'pinned'")
def test_pinned_placement_falls_back_and_trains_identically() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback is said once per process
        p = Pair(torch.optim.Adam, {"lr": 0.05}, placement="pinned")
    assert p.off["a"].weight.placement == "cpu"
    for step in range(3):
        ids = _ids(64, (6, 2), step)
        for side in (p.o, p.r):
            _loss(side, ids).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


# ------------------------------------------------------------------------------------
# more patterns
# ------------------------------------------------------------------------------------


def test_retained_graph_backward_after_step_is_reported_not_applied() -> None:
    """README: a gradient that reaches a lookup after a ``step()`` that read it is reported
    by the next ``step()`` (``GadgetValueError``), not applied; ``zero_grad()`` discards it."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    coef = torch.linspace(-1, 1, D)

    def late_loss(side: Side, ids: torch.Tensor) -> torch.Tensor:
        return (side("a", ids) * coef).sum()  # saves no tensor that the step changes

    ids = _ids(64, (6,), 0)
    loss = late_loss(p.o, ids)
    loss.backward(retain_graph=True)
    late_loss(p.r, ids).backward()
    p.both_steps()
    p.both_zero_grad()
    snap = _snapshot(p)
    loss.backward()  # late gradient for the stepped lookup
    with pytest.raises(gl.GadgetValueError):
        p.opt.step()
    _assert_snapshot(p, snap)
    p.assert_same()
    # the same again, but discarded by zero_grad: then training goes on normally
    loss2 = late_loss(p.o, ids)
    loss2.backward(retain_graph=True)
    late_loss(p.r, ids).backward()
    p.both_steps()
    p.both_zero_grad()
    loss2.backward()
    p.opt.zero_grad()
    for side in (p.o, p.r):
        _loss(side, _ids(64, (6,), 1)).backward()
    p.both_steps()
    p.assert_same()


def test_accumulation_across_a_param_groups_merge() -> None:
    """Walking ``param_groups`` after a backward merges the table gradients; a further
    micro-batch's backward is merged at the next walk / step (README)."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64, "b": 64})
    for step in range(3):
        for micro in range(3):
            ia, ib = _ids(64, (5,), 10 * step + micro), _ids(64, (5,), 70 + 10 * step + micro)
            for side in (p.o, p.r):
                side.head(side("a", ia) * side("b", ib)).square().mean().backward()
            n = sum(1 for g in p.opt.param_groups for _ in g["params"])
            assert n >= 2
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_clip_grad_norm_over_param_groups_matches_dense_clip() -> None:
    """Clipping over the optimizer's groups (as the README says) equals clipping the dense
    reference's parameters (the unused rows' zero gradients add nothing to the norm)."""
    p = Pair(torch.optim.SGD, {"lr": 0.5}, tables={"a": 64, "b": 64})
    for step in range(3):
        ia, ib = _ids(64, (6, 2), step), _ids(64, (6,), 40 + step)
        for side in (p.o, p.r):
            (10 * side.head(side("a", ia).sum(1) + side("b", ib))).square().mean().backward()
        n_off = torch.nn.utils.clip_grad_norm_(
            [q for g in p.opt.param_groups for q in g["params"]], 0.5
        )
        ref_params = [p.ref["a"].weight, p.ref["b"].weight, *p.ref["head"].parameters()]
        n_ref = torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
        torch.testing.assert_close(n_off, n_ref)
        assert n_ref > 0.5  # the clip does something
        p.both_steps()
        p.both_zero_grad()
        p.assert_same(exact=False)


def test_model_zero_grad_does_not_reach_tables_but_emb_zero_grad_does() -> None:
    """``model.zero_grad()`` zeroes only ordinary parameters (the lookups' gradients stay and
    are stepped); ``emb.zero_grad()`` discards that embedding's lookups."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64, "b": 64})
    for side in (p.o, p.r):
        side.head(side("a", torch.arange(64)) + side("b", torch.arange(64))).sum().backward()
    p.both_steps()
    p.both_zero_grad()
    for step in range(2):
        ia, ib = _ids(64, (6,), step), _ids(64, (6,), 9 + step)
        for side in (p.o, p.r):
            side.head(side("a", ia) + side("b", ib)).square().mean().backward()
        p.off.zero_grad()  # head only
        p.ref["head"].zero_grad()
        p.off["b"].zero_grad()  # discards b's lookups
        p.lazy["b"].discard()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_module_load_state_dict_refused_while_lookup_waits() -> None:
    """README: loading a table's rows while a lookup with a gradient waits for its step is
    refused; refused calls change nothing, and the step then goes on as usual."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    ids = _ids(64, (6,), 0)
    for side in (p.o, p.r):
        _loss(side, ids).backward()
    snap = _snapshot(p)
    with pytest.raises(RuntimeError, match="waits for step"):  # torch's load_state_dict wraps it
        p.off["a"].load_state_dict({"weight": torch.zeros(64, D)})
    _assert_snapshot(p, snap)
    p.both_steps()
    p.assert_same()


def test_add_param_group_table_mid_training() -> None:
    """``opt.add_param_group({"params": new_emb, "lr": ...})`` adds a table with fresh state."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64})
    for side in (p.o, p.r):
        _loss(side, _ids(64, (6,), 0)).backward()
    p.both_steps()
    p.both_zero_grad()
    w = _weights(40, D, 99)
    new_off = gl.OffloadedEmbedding(40, D, placement="cpu")
    new_off.load_state_dict({"weight": w})
    new_ref = nn.Embedding(40, D)
    with torch.no_grad():
        new_ref.weight.copy_(w)
    p.off["new"], p.ref["new"] = new_off, new_ref
    p.opt.add_param_group({"params": new_off, "lr": 0.2})
    p.lazy["new"] = LazyTable(new_ref.weight, torch.optim.Adam)
    p.names.append("new")
    p.table_lr["new"] = 0.2
    for step in range(1, 4):
        ia, inew = _ids(64, (6,), step), _ids(40, (6,), 50 + step)
        for side in (p.o, p.r):
            side.head(side("a", ia) + side("new", inew)).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_frozen_table_beside_trained_one() -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64, "b": 64})
    p.off["b"].requires_grad_(False)
    p.ref["b"].requires_grad_(False)
    p.names.remove("b")
    del p.lazy["b"]
    b0 = p.table("b")
    for step in range(3):
        ia, ib = _ids(64, (6,), step), _ids(64, (6,), 20 + step)
        for side in (p.o, p.r):
            eb = side.mods["b"](ib)
            assert not eb.requires_grad
            side.head(side("a", ia) * eb).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()
    _equal(p.table("b"), b0)


@pytest.mark.parametrize(
    "cls,opts,make",
    [
        pytest.param(
            torch.optim.Adam,
            {"lr": 0.01},
            lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8),
            id="OneCycleLR-Adam-betas",
        ),
        pytest.param(
            torch.optim.SGD,
            {"lr": 0.01, "momentum": 0.9},
            lambda o: torch.optim.lr_scheduler.CyclicLR(
                o, base_lr=0.01, max_lr=0.1, step_size_up=2, base_momentum=0.8, max_momentum=0.95
            ),
            id="CyclicLR-SGD-momentum",
        ),
    ],
)
def test_cycling_schedulers_move_betas_and_momentum(cls, opts, make) -> None:
    p = Pair(cls, opts, tables={"a": 64}, bags={"bag": (48, "sum")})
    sched, ref_sched = make(p.opt), make(p.ref_opt)
    _train(p, range(6), sched, ref_sched)
    assert p.opt.param_groups[0]["lr"] == p.ref_opt.param_groups[0]["lr"]
    p.assert_same()


def test_reduce_lr_on_plateau() -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.1}, tables={"a": 64}, bags={"bag": (48, "sum")})
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(p.opt, factor=0.5, patience=0)
    ref_sched = torch.optim.lr_scheduler.ReduceLROnPlateau(p.ref_opt, factor=0.5, patience=0)
    for step in range(5):
        _train(p, range(step, step + 1))
        sched.step(1.0)  # never improves after the first
        ref_sched.step(1.0)
    assert p.opt.param_groups[0]["lr"] == p.ref_opt.param_groups[0]["lr"] < 0.1
    p.assert_same()


def test_state_dicts_through_torch_save_weights_only() -> None:
    """A usual checkpoint: ``torch.save`` of both state dicts, ``torch.load(weights_only=True)``."""
    import io

    tables, bags = {"a": 64}, {"bag": (48, "sum")}
    straight = Pair(torch.optim.Adam, {"lr": 0.05}, tables=tables, bags=bags)
    _train(straight, range(5), only_off=True)
    first = Pair(torch.optim.Adam, {"lr": 0.05}, tables=tables, bags=bags)
    _train(first, range(2), only_off=True)
    buf = io.BytesIO()
    torch.save({"model": first.off.state_dict(), "opt": first.opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    resumed = Pair(torch.optim.Adam, {"lr": 0.05}, tables=tables, bags=bags, seed=5)
    resumed.off.load_state_dict(ck["model"])
    resumed.opt.load_state_dict(ck["opt"])
    _train(resumed, range(2, 5), only_off=True)
    for nm in ("a", "bag"):
        _equal(resumed.table(nm), straight.table(nm))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_table_dtypes_train_like_dense(dtype) -> None:
    w = _weights(64, D, 0).to(dtype)
    off = gl.OffloadedEmbedding(64, D, placement="cpu", dtype=dtype)
    off.load_state_dict({"weight": w})
    ref = nn.Embedding(64, D, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    lazy = LazyTable(ref.weight, torch.optim.Adam)
    for step in range(3):
        ids = _ids(64, (6, 2), step)
        out = off(ids)
        assert out.dtype == dtype
        out.float().square().sum().backward()
        lazy.note(ids)
        ref(ids).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        lazy.step({"lr": 0.05})
        _equal(off.state_dict()["weight"], ref.weight.detach())


def test_tensor_hook_on_lookup_output_scales_gradient() -> None:
    """A user's ``out.register_hook`` (gradient scaling / clipping per lookup) changes the
    gradient that reaches a dense ``nn.Embedding``'s weight: it must reach the table too."""
    p = Pair(torch.optim.SGD, {"lr": 0.1})
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            out = side("a", ids)
            out.register_hook(lambda g: g * 3.0)
            _ = out.register_hook(lambda g: g.clamp(-0.05, 0.05))
            side.head(out).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_autograd_grad_wrt_lookup_output_does_not_train_table() -> None:
    """``torch.autograd.grad(loss, out)`` (adversarial / FGM-style perturbations) computes a
    gradient for the caller only: a dense embedding's weight gets nothing from it."""
    p = Pair(torch.optim.SGD, {"lr": 0.1})
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            out = side("a", ids)
            loss = side.head(out).square().mean()
            (g,) = torch.autograd.grad(loss, out, retain_graph=True)
            # FGM: a perturbed second forward from the same rows
            adv = side.head(out + 0.1 * g / (g.norm() + 1e-12)).square().mean()
            (loss + adv).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_autograd_grad_only_then_step_changes_nothing() -> None:
    p = Pair(torch.optim.SGD, {"lr": 0.1})
    ids = _ids(64, (6,), 0)
    before = p.table("a")
    out = p.off["a"](ids)
    torch.autograd.grad(p.off["head"](out).sum(), out)
    p.opt.step()
    _equal(p.table("a"), before)


@pytest.mark.parametrize("kind", ["mul_", "slice-zero", "dropout-inplace", "relu_"])
def test_in_place_ops_on_lookup_output(kind) -> None:
    p = Pair(torch.optim.SGD, {"lr": 0.1})
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            out = side("a", ids)
            if kind == "mul_":
                out.mul_(2.5)
            elif kind == "slice-zero":
                out[:, 0] = 0.0
                out[1].zero_()
            elif kind == "dropout-inplace":
                torch.manual_seed(step)
                nn.functional.dropout(out, 0.5, training=True, inplace=True)
            else:
                out.relu_()
            side.head(out).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_autograd_backward_of_several_losses_at_once() -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64})
    for step in range(3):
        i1, i2 = _ids(64, (5,), step), _ids(64, (5,), 10 + step)
        for side in (p.o, p.r):
            l1 = side.head(side("a", i1)).square().mean()
            l2 = side.head(side("a", i2)).abs().mean()
            torch.autograd.backward([l1, l2])
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_tied_module_under_two_names_is_one_table() -> None:
    """One ``OffloadedEmbedding`` reachable under two names of the model (weight tying): the
    optimizer steps it once with the summed gradient, as torch treats a shared parameter."""
    w = _weights(64, D, 3)
    off_emb = gl.OffloadedEmbedding(64, D, placement="cpu")
    off_emb.load_state_dict({"weight": w})
    ref_emb = nn.Embedding(64, D)
    with torch.no_grad():
        ref_emb.weight.copy_(w)
    head = nn.Linear(D, 1)
    off = nn.ModuleDict({"enc": off_emb, "dec": off_emb, "head": copy.deepcopy(head)})
    ref = nn.ModuleDict({"enc": ref_emb, "dec": ref_emb, "head": head})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ref_opt = torch.optim.Adam(ref["head"].parameters(), lr=0.05)
    lazy = LazyTable(ref_emb.weight, torch.optim.Adam)
    for step in range(3):
        i1, i2 = _ids(64, (5,), step), _ids(64, (5,), 20 + step)
        for m in (off, ref):
            m["head"](m["enc"](i1) * m["dec"](i2)).square().mean().backward()
        lazy.note(i1)
        lazy.note(i2)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        lazy.step({"lr": 0.05})
        _equal(off_emb.state_dict()["weight"], ref_emb.weight.detach())
        _equal(off["head"].weight.detach(), ref["head"].weight.detach())


@pytest.mark.parametrize("form", ["int32", "int16", "uint8", "transposed", "strided", "0-d"])
def test_id_dtypes_and_layouts_train_like_int64(form) -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for step in range(3):
        base = _ids(64, (4, 6), step)
        ids = {
            "int32": base.to(torch.int32),
            "int16": base.to(torch.int16),
            "uint8": base.to(torch.uint8),
            "transposed": base.t(),
            "strided": base[:, ::2],
            "0-d": base[0, 0],
        }[form]
        out = p.o("a", ids)
        assert out.shape == (*ids.shape, D)
        p.o.head(out).square().mean().backward()
        p.r.head(p.r("a", ids.long())).square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_empty_lookup_beside_others() -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            e0 = side("a", torch.empty(0, dtype=torch.int64))
            assert e0.shape == (0, D)
            (side.head(side("a", ids)).square().mean() + e0.sum()).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_cpu_other_dtypes_with_bag_max(dtype) -> None:
    p = Pair(torch.optim.SGD, {"lr": 0.1}, tables={"a": 64}, bags={"bag": (64, "max")})
    for step in range(3):
        ids, bag_ids = _ids(64, (6,), step), _ids(64, (6, 4), 30 + step)
        outs = []
        for side in (p.o, p.r):
            with torch.autocast("cpu", dtype=dtype):
                out = side.head(side("a", ids) + side("bag", bag_ids))
            outs.append(out)
            out.float().square().mean().backward()
        assert outs[0].dtype == outs[1].dtype
        _equal(outs[0].detach(), outs[1].detach())
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_module_hooks_forward_and_full_backward() -> None:
    """Module hooks on the embedding: a forward hook that rescales the output and a full
    backward pre-hook that rescales grad_output act as on ``nn.Embedding``."""
    p = Pair(torch.optim.SGD, {"lr": 0.1})
    for mods in (p.off, p.ref):
        mods["a"].register_forward_hook(lambda m, i, o: o * 1.5)
        mods["a"].register_full_backward_pre_hook(lambda m, go: (go[0] * 4.0,))
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            _loss(side, ids).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_backward_with_inputs_restricted_to_head() -> None:
    """``loss.backward(inputs=[head params])`` gives the dense weight no gradient: with Adam
    and rows that already have momentum, stepping them anyway would move them."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for side in (p.o, p.r):
        _loss(side, torch.arange(64)).backward()
    p.both_steps()
    p.both_zero_grad()
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            _loss(side, ids).backward(inputs=list(side.head.parameters()))
        p.lazy["a"].discard()  # the reference table got no gradient: nothing to step
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_gradient_penalty_create_graph() -> None:
    p = Pair(torch.optim.SGD, {"lr": 0.1})
    for step in range(3):
        ids = _ids(64, (6,), step)
        for side in (p.o, p.r):
            out = side("a", ids)
            loss = side.head(out).square().mean()
            (g,) = torch.autograd.grad(loss, out, create_graph=True)
            (loss + 10.0 * g.square().sum()).backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_checkpoint_inside_autocast() -> None:
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64}, bags={"bag": (48, "sum")})
    for step in range(3):
        ia, ib = _ids(64, (6,), step), _ids(48, (6, 3), 10 + step)
        for side in (p.o, p.r):

            def block(x, y, side=side):
                return side.head(side("a", x) * side("bag", y))

            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = checkpoint(block, ia, ib, use_reentrant=False)
            out.float().square().mean().backward()
        p.both_steps()
        p.both_zero_grad()
        p.assert_same()


def test_offloaded_optimizers_per_table_and_torch_optimizer_for_dense() -> None:
    """Adagrad for one table, Adam for another (two ``OffloadedOptimizer``s), and a plain
    torch SGD for the dense head."""
    w_a, w_b = _weights(64, D, 1), _weights(48, D, 2)
    off = nn.ModuleDict(
        {
            "a": gl.OffloadedEmbedding(64, D, placement="cpu"),
            "b": gl.OffloadedEmbedding(48, D, placement="cpu"),
            "head": nn.Linear(D, 1),
        }
    )
    off["a"].load_state_dict({"weight": w_a})
    off["b"].load_state_dict({"weight": w_b})
    ref = nn.ModuleDict(
        {"a": nn.Embedding(64, D), "b": nn.Embedding(48, D), "head": copy.deepcopy(off["head"])}
    )
    with torch.no_grad():
        ref["a"].weight.copy_(w_a)
        ref["b"].weight.copy_(w_b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each optimizer finds its table
        opt_a = gl.OffloadedOptimizer(torch.optim.Adagrad, off["a"], lr=0.1)
        opt_b = gl.OffloadedOptimizer(torch.optim.Adam, [off["b"]], lr=0.05)
    opt_h = torch.optim.SGD(off["head"].parameters(), lr=0.1)
    lazy_a = LazyTable(ref["a"].weight, torch.optim.Adagrad)
    lazy_b = LazyTable(ref["b"].weight, torch.optim.Adam)
    ref_h = torch.optim.SGD(ref["head"].parameters(), lr=0.1)
    for step in range(3):
        ia, ib = _ids(64, (6,), step), _ids(48, (6,), 30 + step)
        for m in (off, ref):
            m["head"](m["a"](ia) - m["b"](ib)).square().mean().backward()
        lazy_a.note(ia)
        lazy_b.note(ib)
        for o in (opt_a, opt_b, opt_h):
            o.step()
            o.zero_grad()
        lazy_a.step({"lr": 0.1})
        lazy_b.step({"lr": 0.05})
        ref_h.step()
        ref_h.zero_grad()
        _equal(off["a"].state_dict()["weight"], ref["a"].weight.detach())
        _equal(off["b"].state_dict()["weight"], ref["b"].weight.detach())
        _equal(off["head"].weight.detach(), ref["head"].weight.detach())


def test_optimizer_load_state_dict_mismatch_changes_nothing() -> None:
    """A state dict from a model whose second table has another row count is refused before
    any table changes (README: every object is checked first)."""
    src = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64, "b": 48})
    dst = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64, "b": 50})
    for pair, nb in ((src, 48), (dst, 50)):
        for step in range(2):
            pair.o.head(
                pair.o("a", _ids(64, (6,), step + 5 * (nb == 50)))
                + pair.o("b", _ids(nb, (6,), step))
            ).sum().backward()
            pair.opt.step()
            pair.opt.zero_grad()
    snap = _snapshot(dst)
    with pytest.raises((gl.GadgetError, ValueError, KeyError)):
        dst.opt.load_state_dict(copy.deepcopy(src.opt.state_dict()))
    _assert_snapshot(dst, snap)


def _cancelling(seed: int, n: int, rows: int = 3) -> list[torch.Tensor]:
    """Coefficients whose float32 sum depends on the order they are added in (pairs of huge
    values that cancel, plus small ones)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n // 2):
        c = torch.randn(rows, D, generator=g) * 1e8
        out += [c, -c + torch.randn(rows, D, generator=g) * 10]
    return [out[0], out[2], out[1], out[3], *out[4:]]


@pytest.mark.parametrize(
    "topo",
    [
        "plain",
        "ckpt-reentrant",
        "ckpt-non-reentrant",
        "accumulate",
        "paths",
        "duplicates",
        "passes-out-of-order",
    ],
)
def test_rounding_sensitive_sum_order_bit_identical(topo) -> None:
    """Gradients chosen so that the float32 sum of several lookups depends on the order of
    the additions: the README promises torch's order (bit-identical to a dense table), also
    where a reentrant checkpoint adds its lookups' sum in a nested backward pass."""
    off = gl.OffloadedEmbedding(8, D, placement="cpu")
    off.load_state_dict({"weight": torch.zeros(8, D)})
    ref = nn.Embedding(8, D)
    with torch.no_grad():
        ref.weight.zero_()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=1.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    ids = torch.tensor([1, 2, 3])
    c = _cancelling(0, 6)
    for m in (off, ref):
        x = torch.ones(1, requires_grad=True)

        def block(i, x, k0, m=m):
            return (m(i) * c[k0] * x).sum() + (m(i) * c[k0 + 1] * x).sum()

        if topo == "plain":
            sum((m(ids) * ck).sum() for ck in c).backward()
        elif topo.startswith("ckpt"):
            r = topo == "ckpt-reentrant"
            loss = (m(ids) * c[0]).sum() + checkpoint(block, ids, x, 1, use_reentrant=r)
            loss = loss + (m(ids) * c[3]).sum() + checkpoint(block, ids, x, 4, use_reentrant=r)
            loss.backward()
        elif topo == "accumulate":
            for k in range(0, 6, 2):
                ((m(ids) * c[k]).sum() + (m(ids) * c[k + 1]).sum()).backward()
        elif topo == "paths":
            terms = [m(ids) * c[k] for k in range(6)]
            terms[0] = (terms[0] * 0.5).mul(2.0).neg().neg()
            terms[4] = terms[4] + 0.0
            sum(t.sum() for t in reversed(terms)).backward()
        elif topo == "passes-out-of-order":  # forwards first, backwards in another order
            losses = [(m(ids) * ck).sum() for ck in c]
            for k in (4, 0, 5, 2, 1, 3):
                losses[k].backward()
        else:  # repeated ids inside lookups, F.embedding's order
            rep = torch.tensor([1, 1, 2, 1, 2, 3])
            cc = torch.cat([c[0], c[1]])
            ((m(rep) * cc).sum() + (m(rep.flip(0)) * torch.cat([c[2], c[3]])).sum()).backward()
    opt.step()
    ref_opt.step()
    _equal(off.state_dict()["weight"], ref.weight.detach())


def test_momentum_turned_on_mid_training_then_state_dict_resume() -> None:
    """SGD built without momentum, momentum turned on by hand mid-training (what a scheduler
    does); the state dict then holds momentum state a fresh optimizer has not turned on:
    README says it loads and is paged from then on."""
    tables, bags = {"a": 64}, {"bag": (48, "sum")}
    straight = Pair(torch.optim.SGD, {"lr": 0.05}, tables=tables, bags=bags)
    first = Pair(torch.optim.SGD, {"lr": 0.05}, tables=tables, bags=bags)
    for pair in (straight, first):
        _train(pair, range(2))
        for o in (pair.opt, pair.ref_opt):
            for g in o.param_groups:
                g["momentum"] = 0.9
    _train(straight, range(2, 6))
    straight.assert_same()
    _train(first, range(2, 4), only_off=True)
    saved = copy.deepcopy({"m": first.off.state_dict(), "o": first.opt.state_dict()})
    resumed = Pair(torch.optim.SGD, {"lr": 0.05}, tables=tables, bags=bags, seed=4)
    resumed.off.load_state_dict(saved["m"])
    resumed.opt.load_state_dict(saved["o"])
    assert resumed.opt.param_groups[0]["momentum"] == 0.9
    _train(resumed, range(4, 6), only_off=True)
    for nm in ("a", "bag"):
        _equal(resumed.table(nm), straight.table(nm))
    for a, b in zip(
        resumed.off["head"].parameters(), straight.off["head"].parameters(), strict=True
    ):
        _equal(a.detach(), b.detach())


def test_double_model_lookups_return_float64_table_stays_float32() -> None:
    """``model.double()`` makes lookups float64 while the table keeps float32 (README): it
    trains as a float32 ``nn.Embedding`` whose output is cast with ``.double()``."""
    w = _weights(16, D, 0)
    off = gl.OffloadedEmbedding(16, D, placement="cpu")
    off.load_state_dict({"weight": w})
    m = nn.ModuleDict({"e": off, "h": nn.Linear(D, 1)}).double()
    ref = nn.Embedding(16, D)
    with torch.no_grad():
        ref.weight.copy_(w)
    rh = copy.deepcopy(m["h"])
    opt = gl.OffloadedOptimizer(torch.optim.SGD, m, lr=0.1)
    ref_opt = torch.optim.SGD([ref.weight, *rh.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 16, (20,), generator=g)
        c = torch.randn(20, D, generator=g, dtype=torch.float64) * 1e3
        out = m["e"](ids)
        assert out.dtype == torch.float64
        m["h"](out * c).sum().backward()
        rh(ref(ids).double() * c).sum().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert off.state_dict()["weight"].dtype == torch.float32
    _equal(off.state_dict()["weight"], ref.weight.detach())
    _equal(m["h"].weight.detach(), rh.weight.detach())


@pytest.mark.parametrize("bad,err", _BAD)
def test_bad_ids_after_backward_before_step(bad, err) -> None:
    """A bad lookup after the step's backward (a second micro-batch that fails) leaves the
    pending gradient as it was."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    for side in (p.o, p.r):
        _loss(side, _ids(64, (6,), 3)).backward()
    with pytest.raises(err), torch.autocast("cpu", dtype=torch.bfloat16):
        p.off["a"](bad)
    p.both_steps()
    p.assert_same()


def test_reentrant_checkpoint_between_two_outer_lookups_sum_order() -> None:
    """Minimal form: ``loss = L_a + ckpt(L_1) + L_b + ckpt(L_2)`` (reentrant). Dense torch
    gives ``(c2 + c1) + (cb + ca)``: each nested pass adds to ``.grad`` when it runs, the
    outer pass adds its sum at its end. README: 'bit-identical to a dense nn.Embedding'."""
    torch.manual_seed(0)
    ids = torch.tensor([1, 2, 3])
    big = torch.randn(3, 16) * 1e8
    ca, cb, c1, c2 = torch.randn(3, 16), torch.randn(3, 16), -big + torch.randn(3, 16), big
    assert not torch.equal((c2 + c1) + (cb + ca), (c2 + (cb + ca)) + c1)  # order-sensitive
    res = []
    for emb in (gl.OffloadedEmbedding(8, 16, placement="cpu"), nn.Embedding(8, 16)):
        emb.load_state_dict({"weight": torch.zeros(8, 16)})
        if isinstance(emb, gl.OffloadedEmbedding):
            opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
        else:
            opt = torch.optim.SGD(emb.parameters(), lr=1.0)
        x = torch.ones(1, requires_grad=True)

        def f(i, x, c, emb=emb):
            return (emb(i) * c * x).sum()

        loss = (emb(ids) * ca).sum() + checkpoint(f, ids, x, c1, use_reentrant=True)
        loss = loss + (emb(ids) * cb).sum() + checkpoint(f, ids, x, c2, use_reentrant=True)
        loss.backward()
        opt.step()
        res.append(emb.state_dict()["weight"][1:4])
    off, dense = res
    _equal(dense, -((c2 + c1) + (cb + ca)))  # torch's order (the reference itself)
    _equal(off, dense)


def test_grad_scaler_cpu_scales_unscales_and_skips_inf_steps() -> None:
    """``torch.amp.GradScaler('cpu')``: a power-of-two scale unscales exactly, so training
    equals unscaled training; an inf in a *table* gradient alone makes the scaler skip the
    step (README: table gradients are checked for inf like any gradient)."""
    p = Pair(torch.optim.Adam, {"lr": 0.05}, tables={"a": 64}, bags={"bag": (48, "sum")})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    for step in range(5):
        ia, ib = _ids(64, (6,), step), _ids(48, (6, 3), 20 + step)
        poison = step == 2
        ea, eb = p.o("a", ia), p.o("bag", ib)
        loss = p.o.head(ea + eb).square().mean()
        if poison:
            loss = loss + ea[0, 0] * 1e38  # finite, but its scaled gradient overflows
        assert torch.isfinite(loss)
        scale_before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(p.opt)
        scaler.update()
        p.opt.zero_grad()
        if poison:
            assert scaler.get_scale() < scale_before  # the inf was found: step skipped
            continue
        p.r.head(p.r("a", ia) + p.r("bag", ib)).square().mean().backward()
        p.ref_step()
        p.ref_zero_grad()
        p.assert_same()
    p.assert_same()


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_step_with_closure(cls) -> None:
    """``opt.step(closure)`` as for any torch optimizer: the closure's loss is returned and
    its backward is what the step applies."""
    p = Pair(cls, {"lr": 0.05})
    for step in range(3):
        ids = _ids(64, (6,), step)

        def closure(ids=ids):
            p.opt.zero_grad()
            loss = _loss(p.o, ids)
            loss.backward()
            return loss

        got = p.opt.step(closure)
        _loss(p.r, ids).backward()
        p.ref_step()
        p.ref_zero_grad()
        assert got is not None and torch.is_tensor(got)
        p.assert_same()


def test_model_parameters_instead_of_model_warns_and_tables_stay() -> None:
    """README: pass the model, not ``model.parameters()`` (it warns when it finds no table;
    a model of tables only is an error that says so; ``emb.weight`` is a GadgetTypeError)."""
    p = Pair(torch.optim.Adam, {"lr": 0.05})
    with pytest.warns(UserWarning, match="model.parameters"):
        opt = gl.OffloadedOptimizer(torch.optim.Adam, p.off.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(p.ref["head"].parameters(), lr=0.05)
    a0 = p.table("a")
    for step in range(2):
        ids = _ids(64, (6,), step)
        _loss(p.o, ids).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            e = p.ref["a"](ids)
        p.ref["head"](e).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _equal(p.off["head"].weight.detach(), p.ref["head"].weight.detach())
    tables_only = nn.ModuleDict({"t": gl.OffloadedEmbedding(10, D, placement="cpu")})
    with pytest.raises(gl.GadgetValueError, match="model.parameters"):
        gl.OffloadedOptimizer(torch.optim.Adam, tables_only.parameters(), lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, tables_only["t"].weight, lr=0.1)
    _equal(p.table("a"), a0)  # the tables were not reached


def test_module_load_state_dict_between_forward_and_backward_never_overwrites_load() -> None:
    """README: a training lookup still waiting for its backward is retired by a load, and a
    gradient that reaches it afterwards is reported by the next step() ("made before its
    rows were loaded"), not applied: the rows read before the load are never written back."""
    w, w2 = _weights(8, D, 0), _weights(8, D, 1)
    off = gl.OffloadedEmbedding(8, D, placement="cpu")
    off.load_state_dict({"weight": w})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)
    ids = torch.tensor([1, 2, 2])
    loss = off(ids).square().sum()
    off.load_state_dict({"weight": w2})
    loss.backward()
    with pytest.raises(gl.GadgetValueError, match="before its rows were loaded"):
        opt.step()
    _equal(off.state_dict()["weight"], w2)
    # and training goes on from the loaded rows
    off(ids).square().sum().backward()
    opt.step()
    ref = nn.Embedding(8, D)
    with torch.no_grad():
        ref.weight.copy_(w2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(ids).square().sum().backward()
    ref_opt.step()
    _equal(off.state_dict()["weight"], ref.weight.detach())
