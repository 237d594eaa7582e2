"""Black-box review of the SpeedTorch-compatible switchers (session 28).

``ModelFactory`` / ``OptimizerFactory`` / ``PytorchModelFactory`` / ``PytorchOptimizerFactory``
as SPEC.md and the README describe them, checked against references written here:

* merged ids (the default): "results equal training the whole table as one parameter with
  lazy per-row updates (rows outside a batch untouched, one step count per table as in
  torch's SparseAdam)" -- the reference applies the same torch optimizer to a parameter
  holding just the batch's distinct rows, with their state rows, and writes both back;
* ``variableTransformer``'s dummies: "one row per id position: each copy is updated on its
  own and the copy written back last wins" -- the reference does exactly that.

Every test runs on the CPU: the module fixture hides CUDA, so a GPU machine behaves as a
CPU-only one (GPU placements fall back to ``cpu`` with one ``FallbackWarning``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import optim
from torch.nn.functional import embedding, logsigmoid

import gadgetloader as gl

N, D = 60, 4  # table rows, row width
B, C, K = 8, 2, 3  # batch, contexts per centre, negatives per centre
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def _no_cuda() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


@contextlib.contextmanager
def quiet_fallback() -> Iterator[None]:
    """GPU placements fall back to ``cpu`` here with a FallbackWarning (tested on its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        yield


# --------------------------------------------------------------------------- model, data


def w2v_loss(U: torch.Tensor, V: torch.Tensor, c: Any, p: Any, n: Any) -> torch.Tensor:
    """Skip-gram negative-sampling loss over weight tensors and (local) ids."""
    u = embedding(c, U)
    vp = embedding(p, V)
    vn = embedding(n, V)
    sp = torch.einsum("bd,bcd->bc", u, vp)
    sn = torch.einsum("bd,bkd->bk", u, vn)
    return -(logsigmoid(sp).sum() + logsigmoid(-sn).sum())


class W2V(torch.nn.Module):
    """SpeedTorch's word2vec shape: two embeddings with fewer rows than a batch has ids."""

    def __init__(self, rows: int = 5, sparse: bool = False) -> None:
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(rows, D, sparse=sparse)
        self.v_embeddings = torch.nn.Embedding(rows, D, sparse=sparse)

    def forward(self, c: Any, p: Any, n: Any) -> torch.Tensor:
        if self.u_embeddings.sparse:
            u = self.u_embeddings(c)
            sp = torch.einsum("bd,bcd->bc", u, self.v_embeddings(p))
            sn = torch.einsum("bd,bkd->bk", u, self.v_embeddings(n))
            return -(logsigmoid(sp).sum() + logsigmoid(-sn).sum())
        return w2v_loss(self.u_embeddings.weight, self.v_embeddings.weight, c, p, n)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def make_batches(steps: int = STEPS, seed: int = 1) -> list[Batch]:
    """Random (centre, ctx, neg) ids with repeats inside each tensor and across ctx / neg."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        c = torch.randint(0, N, (B,), generator=g)
        c[1] = c[0]
        p = torch.randint(0, N, (B, C), generator=g)
        p[2, 1] = p[2, 0]
        n = torch.randint(0, N, (B, K), generator=g)
        n[0, 0] = p[0, 0]
        n[3, 2] = p[5, 1]
        out.append((c, p, n))
    return out


def initial_tables(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    U0 = (torch.rand(N, D, generator=g, dtype=torch.float64) - 0.5).to(dtype)
    V0 = (torch.rand(N, D, generator=g, dtype=torch.float64) - 0.5).to(dtype)
    return U0, V0


# --------------------------------------------------------------------------- references

#: state that torch does not start at zero (value from the optimizer's options)
FILLS: dict[str, tuple[str, str, float]] = {
    "Rprop": ("step_size", "lr", 1e-2),
    "Adagrad": ("sum", "initial_accumulator_value", 0.0),
}


def write_last_wins(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """NumPy's sequential assignment: a repeated id keeps its last occurrence's row."""
    for i, r in zip(ids.tolist(), rows, strict=True):
        table[i] = r


class LazyTable:
    """One table trained as one parameter with lazy per-row updates: each step applies the
    optimizer class to a parameter holding just the step's rows (``ids``; repeats allowed
    for the separate layout) with their state rows and the table's scalar state."""

    def __init__(self, cls: type, table: torch.Tensor, kw: dict[str, Any], rows: int = 5) -> None:
        self.cls = cls
        self.W = table.clone()
        # the variable's documented shape (ModelSwitch.capacity_for): never fewer rows than
        # it had (the module's own ``rows`` at first), nor than the batch has id positions;
        # the rows past the step's ids are padding that nothing reads or writes back. The
        # reference pads alike, since torch's vectorised kernels may round an element
        # differently depending on where it lies in the tensor (fused SGD, float16).
        self.capacity = rows
        self.rows: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, Any] | None = None
        self.fill: dict[str, float] = {}
        name = next(c.__name__ for c in cls.__mro__ if c.__name__ in gl.SUPPORTED_OPTIMIZERS)
        if name in FILLS:
            key, option, default = FILLS[name]
            self.fill[key] = float(kw.get(option, default))

    def param(self, ids: torch.Tensor, positions: int | None = None) -> torch.nn.Parameter:
        self.capacity = max(self.capacity, len(ids) if positions is None else positions)
        pad = self.W.new_zeros(self.capacity - len(ids), self.W.shape[1])
        return torch.nn.Parameter(torch.cat([self.W[ids], pad]))

    def step(
        self, P: torch.nn.Parameter, ids: torch.Tensor, kw: dict[str, Any], prefill: tuple = ()
    ) -> None:
        opt = self.cls([P], **kw)
        for key in prefill:
            if key not in self.rows:
                self.rows[key] = torch.full_like(self.W, self.fill.get(key, 0.0))
        n = len(ids)
        if self.scalars is not None or prefill:
            st: dict[str, Any] = dict(self.scalars or {})
            for k, t in self.rows.items():
                pad = torch.full_like(P[n:], self.fill.get(k, 0.0))
                st[k] = torch.cat([t[ids], pad.detach()])
            opt.state[P] = st
        opt.step()
        st = opt.state[P]
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == P.shape and k not in self.rows:
                self.rows[k] = torch.full_like(self.W, self.fill.get(k, 0.0))
        for k, t in self.rows.items():
            write_last_wins(t, ids, st[k][:n])
        self.scalars = {k: v for k, v in st.items() if k not in self.rows}
        with torch.no_grad():
            write_last_wins(self.W, ids, P.detach()[:n])


def reference_w2v(
    cls: type,
    kw: dict[str, Any],
    U0: torch.Tensor,
    V0: torch.Tensor,
    batches: list[Batch],
    *,
    layout: str = "merge",
    kw_v: dict[str, Any] | None = None,
    kw_at: Callable[[int], dict[str, Any]] | None = None,
    prefill: tuple = (),
) -> tuple[LazyTable, LazyTable]:
    ru, rv = LazyTable(cls, U0, kw), LazyTable(cls, V0, kw_v or kw)
    for i, (c, p, n) in enumerate(batches):
        vids = torch.cat([p.flatten(), n.flatten()])
        if layout == "merge":
            uu, lc = torch.unique(c, return_inverse=True)
            vv, inv = torch.unique(vids, return_inverse=True)
            lp, ln = inv[: p.numel()].view(p.shape), inv[p.numel() :].view(n.shape)
        else:  # SpeedTorch: one row per id position, positives then negatives
            uu, vv = c.flatten(), vids
            lc = torch.arange(c.numel()).view(c.shape)
            lp = torch.arange(p.numel()).view(p.shape)
            ln = torch.arange(p.numel(), p.numel() + n.numel()).view(n.shape)
        PU, PV = ru.param(uu, c.numel()), rv.param(vv, vids.numel())
        w2v_loss(PU, PV, lc, lp, ln).backward()
        ku = kw_at(i) if kw_at else kw
        kv = kw_at(i) if kw_at else (kw_v or kw)
        ru.step(PU, uu, ku, prefill)
        rv.step(PV, vv, kv, prefill)
    return ru, rv


# --------------------------------------------------------------------------- the loop


def cpu_model_switch(var: Any) -> Any:
    return gl.ModelFactory(var, N, D, placement="cpu")


def cpu_opt_switch(opt: Any, model: Any, name: str) -> Any:
    return gl.OptimizerFactory(opt, N, D, model, name, placement="cpu")


class Run:
    """A SpeedTorch-style setup: two model switchers, two optimizer switchers, one torch
    optimizer over the model (the README's word2vec loop)."""

    def __init__(
        self,
        cls: type,
        kw: dict[str, Any],
        U0: torch.Tensor,
        V0: torch.Tensor,
        *,
        make_m: Callable[[Any], Any] = cpu_model_switch,
        make_o: Callable[[Any, Any, str], Any] = cpu_opt_switch,
        model: torch.nn.Module | None = None,
        opt_init: bool = True,
    ) -> None:
        self.model = model if model is not None else W2V()
        self.opt = cls(self.model.parameters(), **kw)
        self.u = make_m(self.model.u_embeddings)
        self.v = make_m(self.model.v_embeddings)
        self.u.customInit(lambda t: t.copy_(U0))
        self.v.customInit(lambda t: t.copy_(V0))
        self.uo = make_o(self.opt, self.model, "u_embeddings")
        self.vo = make_o(self.opt, self.model, "v_embeddings")
        if opt_init:
            self.uo.optInit()
            self.vo.optInit()

    def step(self, c: Any, p: Any, n: Any, *, dummies: Any = None, opt_first: bool = False) -> Any:
        if opt_first:
            self.uo.beforeForwardPass(c)
            self.vo.beforeForwardPass(p, n)
        lc = self.u.beforeForwardPass(c)
        lp, ln = self.v.beforeForwardPass(p, n)
        if not opt_first:
            self.uo.beforeForwardPass(c)
            self.vo.beforeForwardPass(p, n)
        if dummies is not None:
            lc, lp, ln = dummies
        loss = self.model(lc, lp, ln)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        if opt_first:
            self.uo.afterOptimizerStep(c)
            self.vo.afterOptimizerStep(p, n)
        self.u.afterOptimizerStep(c)
        self.v.afterOptimizerStep(p, n)
        if not opt_first:
            self.uo.afterOptimizerStep(c)
            self.vo.afterOptimizerStep(p, n)
        return loss

    def train(self, batches: list[Batch], **kw: Any) -> Run:
        for c, p, n in batches:
            self.step(c, p, n, **kw)
        return self

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.from_numpy(self.u.getNumpyVersion()),
            torch.from_numpy(self.v.getNumpyVersion()),
        )


def assert_matches(run: Run, ru: LazyTable, rv: LazyTable, *, scalars: bool = True) -> None:
    """Tables, state tables (names and values) and per-table scalar state, bit for bit."""
    lu, lv = run.tables()
    assert lu.dtype == ru.W.dtype
    torch.testing.assert_close(lu, ru.W, rtol=0, atol=0)
    torch.testing.assert_close(lv, rv.W, rtol=0, atol=0)
    for sw, ref in ((run.uo, ru), (run.vo, rv)):
        states = sw.getNumpyVersion()
        assert sorted(states) == sorted(ref.rows)
        for name, arr in states.items():
            torch.testing.assert_close(torch.from_numpy(arr), ref.rows[name], rtol=0, atol=0)
    if scalars:
        for var, ref in ((run.model.u_embeddings.weight, ru), (run.model.v_embeddings.weight, rv)):
            st = run.opt.state[var]
            assert ref.scalars is not None
            if "step" in ref.scalars:  # SPEC: SpeedTorch's Python-int step broke on torch 2
                assert torch.is_tensor(st["step"])
            for k, v in ref.scalars.items():
                torch.testing.assert_close(
                    torch.as_tensor(st[k]), torch.as_tensor(v), rtol=0, atol=0
                )


# --------------------------------------------------------------------------- optimizers

OPTIMIZERS = [
    pytest.param(optim.SGD, {"lr": 0.2}, id="sgd"),
    pytest.param(optim.SGD, {"lr": 0.1, "momentum": 0.9}, id="sgd-momentum"),
    pytest.param(optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, id="sgd-nesterov"),
    pytest.param(
        optim.SGD,
        {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.1, "foreach": True},
        id="sgd-foreach",
    ),
    pytest.param(optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}, id="sgd-fused"),
    pytest.param(optim.Adam, {"lr": 0.05}, id="adam"),
    pytest.param(optim.Adam, {"lr": 0.05, "foreach": True}, id="adam-foreach"),
    pytest.param(optim.Adam, {"lr": 0.05, "fused": True}, id="adam-fused"),
    pytest.param(
        optim.Adam, {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}, id="adam-amsgrad"
    ),
    pytest.param(optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}, id="adamw"),
    pytest.param(
        optim.AdamW, {"lr": 0.05, "amsgrad": True, "foreach": True}, id="adamw-amsgrad-fe"
    ),
    pytest.param(optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.2}, id="adagrad"),
    pytest.param(
        optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "foreach": True}, id="adagrad-foreach"
    ),
    pytest.param(optim.RMSprop, {"lr": 0.01}, id="rmsprop"),
    pytest.param(optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}, id="rmsprop-c-m"),
    pytest.param(
        optim.RMSprop,
        {"lr": 0.01, "centered": True, "momentum": 0.5, "foreach": True},
        id="rmsprop-fe",
    ),
    pytest.param(optim.Adadelta, {"lr": 1.0}, id="adadelta"),
    pytest.param(
        optim.Adadelta, {"lr": 1.0, "foreach": True, "weight_decay": 0.1}, id="adadelta-fe"
    ),
    pytest.param(optim.Adamax, {"lr": 0.05}, id="adamax"),
    pytest.param(optim.Adamax, {"lr": 0.05, "foreach": True}, id="adamax-foreach"),
    pytest.param(optim.Rprop, {"lr": 0.02}, id="rprop"),
    pytest.param(optim.Rprop, {"lr": 0.02, "foreach": True}, id="rprop-foreach"),
    pytest.param(optim.ASGD, {"lr": 0.05, "t0": 2}, id="asgd"),
    pytest.param(optim.ASGD, {"lr": 0.05, "t0": 2, "foreach": True}, id="asgd-foreach"),
    pytest.param(optim.NAdam, {"lr": 0.05}, id="nadam"),
    pytest.param(optim.RAdam, {"lr": 0.05, "foreach": True}, id="radam-foreach"),
]


@pytest.mark.parametrize(("cls", "kw"), OPTIMIZERS)
def test_every_optimizer_equals_lazy_per_row_reference(cls: type, kw: dict[str, Any]) -> None:
    """README: repeated ids merge; "results equal training the whole table as one parameter
    with lazy per-row updates (rows outside a batch untouched, one step count per table)"."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(cls, kw, U0, V0).train(batches)
    ru, rv = reference_w2v(cls, kw, U0, V0, batches)
    assert_matches(run, ru, rv)
    # rows never in any batch are untouched, and some rows did move
    seen = torch.unique(torch.cat([b[0] for b in batches]))
    lu, _ = run.tables()
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[seen] = False
    assert torch.equal(lu[untouched], U0[untouched])
    assert not torch.equal(lu[seen], U0[seen])


def test_sgd_dampening_starts_momentum_at_zero() -> None:
    """README: "SGD with dampening != 0 starts a row's momentum at zero, where torch starts
    it at the first gradient"."""
    kw = {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(optim.SGD, kw, U0, V0).train(batches)
    ru, rv = reference_w2v(optim.SGD, kw, U0, V0, batches, prefill=("momentum_buffer",))
    assert_matches(run, ru, rv)
    torch_like, _ = reference_w2v(optim.SGD, kw, U0, V0, batches)  # buffer = first gradient
    assert not torch.equal(run.tables()[0], torch_like.W)


PLACEMENTS = [
    pytest.param(lambda v: gl.ModelFactory(v, N, D, CPUPinn=True), {"CPUPinn": True}, id="pinn"),
    pytest.param(lambda v: gl.ModelFactory(v, N, D), {}, id="cuda-default"),
    pytest.param(
        lambda v: gl.PytorchModelFactory(v, N, D, deviceType="cpu"), "cpu", id="torch-cpu"
    ),
    pytest.param(
        lambda v: gl.PytorchModelFactory(v, N, D, deviceType="cpu", pinType=True),
        "cpu-pin",
        id="torch-cpu-pinned",
    ),
    pytest.param(
        lambda v: gl.PytorchModelFactory(v, N, D, deviceType=torch.device("cpu")),
        "cpu",
        id="torch-device-cpu",
    ),
    pytest.param(lambda v: gl.PytorchModelFactory(v, N, D), "cuda", id="torch-cuda-default"),
    pytest.param(
        lambda v: gl.PytorchModelFactory(v, N, D, deviceType="cuda:0"), "cuda:0", id="torch-cuda0"
    ),
]


def _opt_factory(spec: Any) -> Callable[[Any, Any, str], Any]:
    if isinstance(spec, dict):
        return lambda o, m, name: gl.OptimizerFactory(o, N, D, m, name, **spec)
    dev, pin = {
        "cpu": ("cpu", False),
        "cpu-pin": ("cpu", True),
        "cuda": ("cuda", False),
        "cuda:0": ("cuda:0", False),
    }[spec]
    return lambda o, m, name: gl.PytorchOptimizerFactory(
        o, N, D, m, name, deviceType=dev, pinType=pin
    )


@pytest.mark.parametrize(("make_m", "opt_spec"), PLACEMENTS)
@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, id="sgd-nesterov"),
        pytest.param(optim.Adam, {"lr": 0.05}, id="adam"),
    ],
)
def test_every_factory_and_placement_trains_the_same(
    make_m: Any, opt_spec: Any, cls: type, kw: dict[str, Any]
) -> None:
    """All four classes, every placement argument a CPU machine takes (GPU ones fall back
    to ``cpu``, "same results")."""
    U0, V0 = initial_tables()
    batches = make_batches()
    with quiet_fallback():
        run = Run(cls, kw, U0, V0, make_m=make_m, make_o=_opt_factory(opt_spec))
    assert run.u.placement == "cpu"
    run.train(batches)
    ru, rv = reference_w2v(cls, kw, U0, V0, batches)
    assert_matches(run, ru, rv)


def test_optimizer_switcher_first_in_each_step_gives_the_same_result() -> None:
    """README: "The two switchers of a variable may be called in either order within a step"."""
    kw = {"lr": 0.05, "amsgrad": True}
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(optim.Adam, kw, U0, V0).train(batches, opt_first=True)
    ru, rv = reference_w2v(optim.Adam, kw, U0, V0, batches)
    assert_matches(run, ru, rv)


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(optim.SGD, {"lr": 0.3}, id="sgd"),
        pytest.param(optim.Adagrad, {"lr": 0.3, "initial_accumulator_value": 0.1}, id="adagrad"),
    ],
)
def test_equals_whole_table_as_one_dense_parameter(cls: type, kw: dict[str, Any]) -> None:
    """For SGD and Adagrad (no weight decay) a dense optimizer over the whole table leaves
    rows without gradient alone, so the literal "whole table as one parameter" reference
    applies, bit for bit."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(cls, kw, U0, V0).train(batches)
    full = W2V(rows=N)
    with torch.no_grad():
        full.u_embeddings.weight.copy_(U0)
        full.v_embeddings.weight.copy_(V0)
    fopt = cls(full.parameters(), **kw)
    for c, p, n in batches:
        loss = full(c, p, n)
        fopt.zero_grad()
        loss.backward()
        fopt.step()
    lu, lv = run.tables()
    torch.testing.assert_close(lu, full.u_embeddings.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(lv, full.v_embeddings.weight.detach(), rtol=0, atol=0)


def _sparse_adam_full(U0: torch.Tensor, V0: torch.Tensor, batches: list[Batch]) -> W2V:
    full = W2V(rows=N, sparse=True)
    with torch.no_grad():
        full.u_embeddings.weight.copy_(U0)
        full.v_embeddings.weight.copy_(V0)
    fopt = optim.SparseAdam(list(full.parameters()), lr=0.05)
    for c, p, n in batches:
        loss = full(c, p, n)
        fopt.zero_grad()
        loss.backward()
        fopt.step()
    return full


def test_sparse_adam_through_switchers_equals_full_table_sparse_adam() -> None:
    """SparseAdam is supported; with sparse embeddings it must equal torch's SparseAdam over
    the whole table (the very definition of lazy per-row updates)."""
    U0, V0 = initial_tables()
    batches = make_batches()
    model = W2V(sparse=True)
    run = Run(optim.SparseAdam, {"lr": 0.05}, U0, V0, model=model)
    assert sorted(run.uo.tables) == ["exp_avg", "exp_avg_sq"]
    run.train(batches)
    full = _sparse_adam_full(U0, V0, batches)
    lu, lv = run.tables()
    torch.testing.assert_close(lu, full.u_embeddings.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(lv, full.v_embeddings.weight.detach(), rtol=0, atol=0)


def test_dense_adam_through_switchers_is_sparse_adam_to_float_tolerance() -> None:
    """SPEC: the switchers let dense Adam train sparse embeddings; lazily, that is
    SparseAdam's update (computed in another order, so to float tolerance)."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0).train(batches)
    full = _sparse_adam_full(U0, V0, batches)
    lu, lv = run.tables()
    torch.testing.assert_close(lu, full.u_embeddings.weight.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lv, full.v_embeddings.weight.detach(), rtol=1e-4, atol=1e-4)
    assert not torch.equal(lu, U0)


def test_param_groups_per_table_options_and_extra_dense_parameter() -> None:
    """Two tables in two param groups (own lr) of one optimizer, beside an ordinary
    parameter that the same optimizer trains as torch would."""

    class Scaled(W2V):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(1.5))

        def forward(self, c: Any, p: Any, n: Any) -> torch.Tensor:
            U = self.u_embeddings.weight * self.scale
            return w2v_loss(U, self.v_embeddings.weight, c, p, n)

    U0, V0 = initial_tables()
    batches = make_batches()
    model = Scaled()
    opt = optim.Adam(
        [
            {"params": model.u_embeddings.parameters(), "lr": 0.08},
            {"params": model.v_embeddings.parameters(), "lr": 0.01},
            {"params": [model.scale], "lr": 0.02},
        ]
    )
    u, v = cpu_model_switch(model.u_embeddings), cpu_model_switch(model.v_embeddings)
    u.customInit(lambda t: t.copy_(U0))
    v.customInit(lambda t: t.copy_(V0))
    uo, vo = cpu_opt_switch(opt, model, "u_embeddings"), cpu_opt_switch(opt, model, "v_embeddings")
    uo.optInit()
    vo.optInit()
    for c, p, n in batches:
        lc = u.beforeForwardPass(c)
        uo.beforeForwardPass(c)
        lp, ln = v.beforeForwardPass(p, n)
        vo.beforeForwardPass(p, n)
        loss = model(lc, lp, ln)
        opt.zero_grad()
        loss.backward()
        opt.step()
        u.afterOptimizerStep(c)
        uo.afterOptimizerStep(c)
        v.afterOptimizerStep(p, n)
        vo.afterOptimizerStep(p, n)

    ru, rv = LazyTable(optim.Adam, U0, {}), LazyTable(optim.Adam, V0, {})
    scale = torch.nn.Parameter(torch.tensor(1.5))
    sopt = optim.Adam([scale], lr=0.02)
    for c, p, n in batches:
        uu, lc = torch.unique(c, return_inverse=True)
        vv, inv = torch.unique(torch.cat([p.flatten(), n.flatten()]), return_inverse=True)
        PU, PV = ru.param(uu, c.numel()), rv.param(vv, p.numel() + n.numel())
        sopt.zero_grad()
        w2v_loss(
            PU * scale, PV, lc, inv[: p.numel()].view(p.shape), inv[p.numel() :].view(n.shape)
        ).backward()
        ru.step(PU, uu, {"lr": 0.08})
        rv.step(PV, vv, {"lr": 0.01})
        sopt.step()
    torch.testing.assert_close(torch.from_numpy(u.getNumpyVersion()), ru.W, rtol=0, atol=0)
    torch.testing.assert_close(torch.from_numpy(v.getNumpyVersion()), rv.W, rtol=0, atol=0)
    torch.testing.assert_close(model.scale.detach(), scale.detach(), rtol=0, atol=0)


def test_momentum_turned_on_mid_training_with_numpy_number_adds_its_table() -> None:
    """README: "options given as NumPy numbers count as their values (turning momentum on
    with np.float32(0.9) adds its table)"."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(optim.SGD, {"lr": 0.1}, U0, V0)
    assert list(run.uo.tables) == []
    run.train(batches[:3])
    for group in run.opt.param_groups:
        group["momentum"] = np.float32(0.9)
    run.train(batches[3:])
    assert list(run.uo.tables) == ["momentum_buffer"]

    def kw_at(i: int) -> dict[str, Any]:
        return {"lr": 0.1, "momentum": 0.0 if i < 3 else 0.9}

    ru, rv = reference_w2v(optim.SGD, {"lr": 0.1}, U0, V0, batches, kw_at=kw_at)
    assert_matches(run, ru, rv, scalars=False)


def test_optimizer_subclass_passing_kwargs_is_paged_like_its_base() -> None:
    class MyAdam(optim.Adam):
        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__(params, **kwargs)

    kw = {"lr": 0.05, "amsgrad": True}
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(MyAdam, kw, U0, V0).train(batches)
    ru, rv = reference_w2v(optim.Adam, kw, U0, V0, batches)
    assert_matches(run, ru, rv)


def test_ids_as_numpy_int32_and_lists_train_like_int64_tensors() -> None:
    """SPEC: indexes may be a torch tensor, a NumPy array or a list (any integer dtype)."""
    U0, V0 = initial_tables()
    batches = make_batches(4)
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0)
    for i, (c, p, n) in enumerate(batches):
        if i % 2:
            run.step(c.numpy().astype(np.int32), p.numpy().astype(np.int16), n.tolist())
        else:
            run.step(c.tolist(), p.numpy(), n.numpy().astype(np.uint8))
    ru, rv = reference_w2v(optim.Adam, {"lr": 0.05}, U0, V0, batches)
    assert_matches(run, ru, rv)


def test_local_ids_address_the_distinct_ids_in_ascending_order() -> None:
    """README: a switcher without variableTransformer "holds the batch's distinct ids in
    ascending order, which only the local ids its beforeForwardPass returns address"."""
    U0, _ = initial_tables()
    emb = torch.nn.Embedding(3, D)
    sw = cpu_model_switch(emb)
    sw.customInit(lambda t: t.copy_(U0))
    pos = torch.tensor([[41, 7], [7, 13]])
    neg = torch.tensor([[13, 59, 0]])
    lp, ln = sw.beforeForwardPass(pos, neg)
    uniq, inv = torch.unique(torch.cat([pos.flatten(), neg.flatten()]), return_inverse=True)
    assert lp.shape == pos.shape and ln.shape == neg.shape
    assert torch.equal(lp, inv[:4].view(2, 2)) and torch.equal(ln, inv[4:].view(1, 3))
    assert torch.equal(emb.weight.detach()[: len(uniq)], U0[uniq])
    assert torch.equal(emb(lp).detach(), U0[pos]) and torch.equal(emb(ln).detach(), U0[neg])
    assert sw.duplicates == "merge"


# --------------------------------------------------------------------------- variableTransformer


def test_variable_transformer_dummy_inputs_are_speedtorchs() -> None:
    emb = torch.nn.Embedding(4, D)
    sw = cpu_model_switch(emb)
    assert sw.duplicates == "merge"
    one = sw.variableTransformer(5, 3)
    assert isinstance(one, np.ndarray) and one.dtype == np.int64
    np.testing.assert_array_equal(one, np.arange(15).reshape(5, 3))
    assert sw.duplicates == "separate"
    pos, neg = sw.variableTransformer(4, 2, 3)
    assert pos.dtype == np.int64 and neg.dtype == np.int64
    np.testing.assert_array_equal(pos, np.arange(8).reshape(4, 2))
    np.testing.assert_array_equal(neg, np.arange(8, 20).reshape(4, 3))
    # explicit duplicates= is kept
    sw2 = gl.ModelFactory(torch.nn.Embedding(4, D), N, D, placement="cpu", duplicates="merge")
    sw2.variableTransformer(2, 2)
    assert sw2.duplicates == "merge"


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(optim.SGD, {"lr": 0.5}, id="sgd"),
        pytest.param(optim.Adam, {"lr": 0.05}, id="adam"),
        pytest.param(optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}, id="rmsprop"),
        pytest.param(optim.Rprop, {"lr": 0.05}, id="rprop"),
        pytest.param(optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.3}, id="adagrad"),
    ],
)
def test_variable_transformer_dummies_update_each_copy_and_last_write_wins(
    cls: type, kw: dict[str, Any]
) -> None:
    """README/docstring: with the dummies each position is its own row, "a repeated id is
    then updated once per copy and the copy written back last wins" (state rows too)."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(cls, kw, U0, V0)
    du = torch.from_numpy(run.u.variableTransformer(B, 1)).view(B)
    dp, dn = (torch.from_numpy(a) for a in run.v.variableTransformer(B, C, K))
    run.train(batches, dummies=(du, dp, dn))
    ru, rv = reference_w2v(cls, kw, U0, V0, batches, layout="separate")
    assert_matches(run, ru, rv)
    # and that is not what merging repeats gives (the batches repeat ids)
    mu, mv = reference_w2v(cls, kw, U0, V0, batches)
    assert not torch.equal(run.tables()[1], mv.W)


# --------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_mid_training_resumes_bit_identically(tmp_path: Any, fmt: str) -> None:
    """README: save_checkpoint with the switchers and the torch optimizer;
    load_checkpoint "resumes bit-identically" (Adam: step counts matter)."""
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    kw = {"lr": 0.05, "amsgrad": True}
    U0, V0 = initial_tables()
    batches = make_batches(8)
    whole = Run(optim.Adam, kw, U0, V0).train(batches)
    first = Run(optim.Adam, kw, U0, V0).train(batches[:4])

    def objects(r: Run) -> dict[str, Any]:
        return {"u": r.u, "v": r.v, "uo": r.uo, "vo": r.vo, "opt": r.opt}

    gl.save_checkpoint(tmp_path / "ck", objects(first), format=fmt)
    # a fresh process's objects, with other initial values
    fresh = Run(optim.Adam, kw, V0, U0)
    gl.load_checkpoint(tmp_path / "ck", objects(fresh))
    torch.testing.assert_close(fresh.tables()[0], first.tables()[0], rtol=0, atol=0)
    fresh.train(batches[4:])
    for a, b in zip(fresh.tables(), whole.tables(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for sa, sb in ((fresh.uo, whole.uo), (fresh.vo, whole.vo)):
        sa_np, sb_np = sa.getNumpyVersion(), sb.getNumpyVersion()
        assert sorted(sa_np) == sorted(sb_np)
        for k in sa_np:
            np.testing.assert_array_equal(sa_np[k], sb_np[k])
    st = fresh.opt.state[fresh.model.u_embeddings.weight]["step"]
    assert float(st) == float(whole.opt.state[whole.model.u_embeddings.weight]["step"]) == 8


def test_speedtorch_save_methods_resume_sgd_momentum_bit_identically(tmp_path: Any) -> None:
    """saveCupy / save(.h5) / saveTorch of the tables and the optimizer switchers' saveTorch
    hold everything SGD with momentum needs (no scalar state): loading them into fresh
    objects and training on equals training without the interruption."""
    pytest.importorskip("h5py")
    kw = {"lr": 0.05, "momentum": 0.9}
    U0, V0 = initial_tables()
    batches = make_batches(8)
    whole = Run(optim.SGD, kw, U0, V0).train(batches)
    first = Run(optim.SGD, kw, U0, V0).train(batches[:4])
    first.u.saveCupy(str(tmp_path / "u"))  # numpy.save appends .npy
    assert (tmp_path / "u.npy").exists()
    np.testing.assert_array_equal(np.load(tmp_path / "u.npy"), first.u.getNumpyVersion())
    first.v.save(tmp_path / "v.h5")
    first.uo.saveTorch(tmp_path / "uo.pt")
    saved = torch.load(tmp_path / "uo.pt", weights_only=True)
    assert isinstance(saved, dict) and list(saved) == ["momentum_buffer"]
    assert saved["momentum_buffer"].shape == (N, D)
    # SpeedTorch's layout: a list of tensors in state order
    first.vo.saveTorch(tmp_path / "vo_dict.pt")
    torch.save(
        list(torch.load(tmp_path / "vo_dict.pt", weights_only=True).values()), tmp_path / "vo.pt"
    )

    fresh = Run(optim.SGD, kw, V0, U0)
    fresh.u.loadCupy(str(tmp_path / "u.npy"))
    fresh.v.load(tmp_path / "v.h5")
    fresh.uo.loadTorch(tmp_path / "uo.pt")
    fresh.vo.loadTorch(tmp_path / "vo.pt")
    fresh.train(batches[4:])
    for a, b in zip(fresh.tables(), whole.tables(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    np.testing.assert_array_equal(
        fresh.vo.getNumpyVersion()["momentum_buffer"],
        whole.vo.getNumpyVersion()["momentum_buffer"],
    )


@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr", ".pt"])
def test_model_table_round_trips_through_every_save_method(tmp_path: Any, ext: str) -> None:
    if ext == ".h5":
        pytest.importorskip("h5py")
    if ext == ".zarr":
        pytest.importorskip("zarr")
    U0, _ = initial_tables()
    src = gl.PytorchModelFactory(torch.nn.Embedding(3, D), N, D, deviceType="cpu")
    src.customInit(lambda t: t.copy_(U0))
    dst = gl.PytorchModelFactory(torch.nn.Embedding(3, D), N, D, deviceType="cpu")
    dst.zerosInit()
    path = tmp_path / f"t{ext}"
    if ext == ".pt":
        src.saveTorch(path)
        assert torch.equal(torch.load(path, weights_only=True), U0)
        dst.loadTorch(path)
    else:
        src.save(path)
        dst.load(path)
    np.testing.assert_array_equal(dst.getNumpyVersion(), U0.numpy())


def test_load_of_wrong_shape_or_dtype_is_refused_and_changes_nothing(tmp_path: Any) -> None:
    U0, _ = initial_tables()
    run = Run(optim.SGD, {"lr": 0.1, "momentum": 0.9}, U0, U0).train(make_batches(2))
    before = run.u.getNumpyVersion().copy()
    state_before = run.uo.getNumpyVersion()["momentum_buffer"].copy()
    np.save(tmp_path / "rows.npy", np.zeros((N + 1, D), np.float32))
    np.save(tmp_path / "f64.npy", np.zeros((N, D), np.float64))
    torch.save(torch.zeros(N, D + 1), tmp_path / "shape.pt")
    torch.save(torch.from_numpy(before).double() + 1e-12, tmp_path / "inexact.pt")
    torch.save({"exp_avg": torch.zeros(N, D)}, tmp_path / "names.pt")
    torch.save({"momentum_buffer": torch.zeros(N - 1, D)}, tmp_path / "state_shape.pt")

    with pytest.raises(gl.GadgetValueError, match=r"\(61, 4\).*expected \(60, 4\)"):
        run.u.loadCupy(str(tmp_path / "rows.npy"))
    with pytest.raises(gl.GadgetTypeError, match=r"float64.*expected.*float32"):
        run.u.loadCupy(str(tmp_path / "f64.npy"))
    with pytest.raises(gl.GadgetValueError, match=r"\(60, 5\).*\(60, 4\)"):
        run.u.loadTorch(tmp_path / "shape.pt")
    with pytest.raises(gl.GadgetTypeError, match="float64.*float32"):
        run.u.loadTorch(tmp_path / "inexact.pt")
    with pytest.raises(gl.GadgetFileNotFoundError):
        run.u.loadCupy(str(tmp_path / "missing.npy"))
    with pytest.raises(gl.GadgetValueError, match="exp_avg.*momentum_buffer"):
        run.uo.loadTorch(tmp_path / "names.pt")
    with pytest.raises(gl.GadgetValueError, match=r"\(59, 4\).*\(60, 4\)"):
        run.uo.loadTorch(tmp_path / "state_shape.pt")
    np.testing.assert_array_equal(run.u.getNumpyVersion(), before)
    np.testing.assert_array_equal(run.uo.getNumpyVersion()["momentum_buffer"], state_before)
    # a float64 file whose values are float32 values converts exactly and loads
    torch.save(torch.from_numpy(before).double() * 0 + 0.25, tmp_path / "exact.pt")
    run.u.loadTorch(tmp_path / "exact.pt")
    assert (run.u.getNumpyVersion() == 0.25).all()


def test_changing_tables_mid_step_is_refused_and_changes_nothing(tmp_path: Any) -> None:
    """README: between a training beforeForwardPass and its afterOptimizerStep, loads,
    initialisers, customInit and checkpoints are refused with GadgetValueError."""
    U0, V0 = initial_tables()
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0)
    run.u.saveCupy(str(tmp_path / "u"))
    run.uo.saveTorch(tmp_path / "uo.pt")
    c, p, n = make_batches(1)[0]
    run.u.beforeForwardPass(c)
    run.uo.beforeForwardPass(c)
    table = run.u.getNumpyVersion().copy()
    for call in (
        lambda: run.u.loadCupy(str(tmp_path / "u.npy")),
        lambda: run.u.zerosInit(),
        lambda: run.u.uniformDistributionInit(-1.0, 1.0),
        lambda: run.u.customInit(torch.nn.init.zeros_),
        lambda: run.uo.loadTorch(tmp_path / "uo.pt"),
        lambda: run.uo.customInit(torch.nn.init.constant_, 0.5),
        lambda: gl.save_checkpoint(tmp_path / "ck", {"u": run.u, "uo": run.uo}),
        lambda: gl.save_checkpoint(tmp_path / "ck2", {"opt": run.opt}),
    ):
        with pytest.raises(gl.GadgetValueError, match="under way"):
            call()
    np.testing.assert_array_equal(run.u.getNumpyVersion(), table)
    assert not (tmp_path / "ck" / "meta.pt").exists()
    # the step completes normally and matches the reference
    lc = run.u.beforeForwardPass(c)
    loss = (run.model.u_embeddings(lc) ** 2).sum()
    run.opt.zero_grad()
    loss.backward()
    run.opt.step()
    run.u.afterOptimizerStep(c)
    run.uo.afterOptimizerStep(c)
    ref = LazyTable(optim.Adam, U0, {})
    uu, lref = torch.unique(c, return_inverse=True)
    P = ref.param(uu, c.numel())
    (embedding(lref, P) ** 2).sum().backward()
    ref.step(P, uu, {"lr": 0.05})
    torch.testing.assert_close(run.tables()[0], ref.W, rtol=0, atol=0)
    run.u.loadCupy(str(tmp_path / "u.npy"))  # allowed again
    np.testing.assert_array_equal(run.u.getNumpyVersion(), U0.numpy())


# --------------------------------------------------------------------------- initialisers, dtypes


def test_initialisers_fill_the_whole_table() -> None:
    emb = torch.nn.Embedding(3, D)
    sw = gl.PytorchModelFactory(emb, 2000, D, deviceType="cpu")
    sw.uniformDistributionInit(-0.25, 0.5)
    a = sw.getNumpyVersion()
    assert a.shape == (2000, D) and a.dtype == np.float32
    assert a.min() >= -0.25 and a.max() <= 0.5 and a.min() < -0.2 and a.max() > 0.45
    sw.normalDistributionInit(3.0, 0.5)
    a = sw.getNumpyVersion()
    assert abs(a.mean() - 3.0) < 0.05 and abs(a.std() - 0.5) < 0.05
    sw.customInit(torch.nn.init.xavier_uniform_)
    a = sw.getNumpyVersion()
    bound = np.sqrt(6.0 / (2000 + D))
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
    sw.customInit(torch.nn.init.constant_, 0.75)
    assert (sw.getNumpyVersion() == 0.75).all()
    sw.zerosInit()
    assert (sw.getNumpyVersion() == 0).all()


def test_bad_initialiser_arguments_raise_and_change_nothing() -> None:
    sw = cpu_model_switch(torch.nn.Embedding(3, D))
    sw.uniformDistributionInit(-1.0, 1.0)
    before = sw.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError, match="std"):
        sw.normalDistributionInit(0.0, -1.0)
    with pytest.raises(gl.GadgetValueError, match="low <= high"):
        sw.uniformDistributionInit(1.0, -1.0)
    with pytest.raises(gl.GadgetValueError):
        sw.uniformDistributionInit(0.0, float("inf"))
    with pytest.raises(gl.GadgetTypeError, match="int"):
        sw.customInit(3)
    with pytest.raises(gl.GadgetTypeError, match="str"):
        sw.normalDistributionInit("0", 1.0)
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_optimizer_custom_init_sets_the_starting_state() -> None:
    """Docstring: ``customInit(torch.nn.init.constant_, 0.1)`` for an Adagrad accumulator
    equals Adagrad(initial_accumulator_value=0.1)."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(optim.Adagrad, {"lr": 0.1}, U0, V0)
    run.uo.customInit(torch.nn.init.constant_, 0.1)
    run.vo.customInit(torch.nn.init.constant_, 0.1)
    assert (run.uo.getNumpyVersion()["sum"] == np.float32(0.1)).all()
    run.train(batches)
    ref_kw = {"lr": 0.1, "initial_accumulator_value": 0.1}
    ru, rv = reference_w2v(optim.Adagrad, ref_kw, U0, V0, batches)
    assert_matches(run, ru, rv)


@pytest.mark.parametrize(
    "datatype",
    ["float64", torch.float64, "double", np.float64, float],
    ids=["str", "torch", "double", "numpy", "pyfloat"],
)
def test_float64_tables_from_every_dtype_spelling(datatype: Any) -> None:
    """SPEC: datatype/dtype as strings or torch dtypes; README: Python's ``float`` means
    float64. A table dtype other than the variable's makes the variable (and the optimizer's
    state rows) that dtype while paged; results equal a float64 reference."""
    U0, V0 = initial_tables(torch.float64)
    batches = make_batches()
    kw = {"lr": 0.05}
    seen: list[torch.dtype] = []
    run = Run(
        optim.Adam,
        kw,
        U0,
        V0,
        make_m=lambda v: gl.PytorchModelFactory(v, N, D, datatype=datatype, deviceType="cpu"),
        make_o=lambda o, m, name: gl.PytorchOptimizerFactory(
            o, N, D, m, name, dtype=datatype, deviceType="cpu"
        ),
    )
    for c, p, n in batches:
        run.step(c, p, n)
        seen.append(run.opt.state[run.model.u_embeddings.weight]["exp_avg"].dtype)
    assert run.model.u_embeddings.weight.dtype == torch.float64
    assert set(seen) == {torch.float64}
    assert {a.dtype for a in run.uo.getNumpyVersion().values()} == {np.dtype(np.float64)}
    ru, rv = reference_w2v(optim.Adam, kw, U0, V0, batches)
    assert_matches(run, ru, rv)


@pytest.mark.parametrize(
    ("datatype", "expected"),
    [("float", torch.float32), (torch.float32, torch.float32), ("half", torch.float16)],
)
def test_other_dtype_spellings(datatype: Any, expected: torch.dtype) -> None:
    """README: ``"float"`` is float32 (torch's name wins); ``half`` is float16; results
    equal the reference in that dtype."""
    U0, V0 = initial_tables(expected)
    batches = make_batches()
    kw = {"lr": 0.05, "momentum": 0.9}
    run = Run(
        optim.SGD,
        kw,
        U0,
        V0,
        make_m=lambda v: gl.ModelFactory(v, N, D, datatype=datatype, placement="cpu"),
        make_o=lambda o, m, name: gl.OptimizerFactory(
            o, N, D, m, name, dtype=datatype, placement="cpu"
        ),
    )
    run.train(batches)
    assert run.model.u_embeddings.weight.dtype == expected
    ru, rv = reference_w2v(optim.SGD, kw, U0, V0, batches)
    lu, lv = run.tables()
    assert lu.dtype == expected
    tol = 0.0
    torch.testing.assert_close(lu, ru.W, rtol=0, atol=tol)
    torch.testing.assert_close(lv, rv.W, rtol=0, atol=tol)
    assert not torch.equal(lu, U0)


def test_bfloat16_table_reads_back_as_float32() -> None:
    """DataGadget.getNumpyVersion: bfloat16 tables come back as float32 (exact)."""
    U0, _ = initial_tables(torch.bfloat16)
    sw = gl.ModelFactory(torch.nn.Embedding(3, D), N, D, datatype=torch.bfloat16, placement="cpu")
    sw.customInit(lambda t: t.copy_(U0))
    a = sw.getNumpyVersion()
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, U0.float().numpy())
    local = sw.beforeForwardPass(torch.tensor([4, 4, 1]))
    assert sw.device.type == "cpu"
    assert local.tolist() == [1, 1, 0]


def test_get_numpy_version_is_a_copy() -> None:
    U0, V0 = initial_tables()
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0).train(make_batches(1))
    a = run.u.getNumpyVersion()
    a[:] = 9.0
    states = run.uo.getNumpyVersion()
    states["exp_avg"][:] = 9.0
    assert not (run.u.getNumpyVersion() == 9.0).any()
    assert not (run.uo.getNumpyVersion()["exp_avg"] == 9.0).any()


# --------------------------------------------------------------------------- fallback, eval, padding


def test_gpu_placements_fall_back_once_with_a_warning() -> None:
    """README: "a table ... asked for a GPU placement by name falls back with one warning"."""
    with pytest.warns(gl.FallbackWarning, match="pinned") as rec:
        sw = gl.ModelFactory(torch.nn.Embedding(3, D), N, D, CPUPinn=True)
    assert len([w for w in rec if issubclass(w.category, gl.FallbackWarning)]) == 1
    assert sw.placement == "cpu" and sw.device.type == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = gl.ModelFactory(torch.nn.Embedding(3, D), N, D, CPUPinn=True)
    assert again.placement == "cpu"


def test_evaluation_lookups_under_no_grad_do_not_disturb_training() -> None:
    """README: a lookup under torch.no_grad() starts no step."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0)
    probe = torch.tensor([0, 5, 5, N - 1])
    for c, p, n in batches:
        run.step(c, p, n)
        with torch.no_grad():
            local = run.u.beforeForwardPass(probe)
            got = run.model.u_embeddings(local)
        assert torch.equal(got, run.tables()[0][probe])
    ru, rv = reference_w2v(optim.Adam, {"lr": 0.05}, U0, V0, batches)
    assert_matches(run, ru, rv)


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adagrad], ids=["sgd", "adagrad"])
@pytest.mark.parametrize(
    ("bag", "opts"),
    [
        pytest.param(False, {"padding_idx": 3}, id="padding_idx"),
        pytest.param(False, {"max_norm": 1.0}, id="max_norm"),
        pytest.param(False, {"scale_grad_by_freq": True}, id="scale_grad_by_freq"),
        pytest.param(True, {"mode": "mean"}, id="bag-mean"),
        pytest.param(True, {"mode": "max"}, id="bag-max"),
        pytest.param(True, {"mode": "sum", "padding_idx": 3}, id="bag-sum-padding_idx"),
    ],
)
def test_embedding_module_options_equal_a_full_table_module(
    bag: bool, opts: dict[str, Any], cls: type
) -> None:
    """README: an nn.Embedding / nn.EmbeddingBag with padding_idx has it taken as a global id
    of the table (that row gets no gradient, as in a full-table embedding); in general the
    merged layout equals "training the whole table as one parameter". For SGD and Adagrad a
    dense full-table module is that reference, bit for bit."""
    U0, _ = initial_tables()
    U0 = U0 * 4  # rows with norms above max_norm
    make = torch.nn.EmbeddingBag if bag else torch.nn.Embedding

    class One(torch.nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.emb = make(rows, D, **opts)

    model, full = One(5), One(N)
    with torch.no_grad():
        full.emb.weight.copy_(U0)
    opt, fopt = cls(model.parameters(), lr=0.2), cls(full.parameters(), lr=0.2)
    sw = cpu_model_switch(model.emb)
    sw.customInit(lambda t: t.copy_(U0))
    so = cpu_opt_switch(opt, model, "emb")
    so.optInit()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, D, generator=g)
    offsets = torch.tensor([0, 1, 4, 6, 7, 9])  # six bags, one of them empty
    for step in range(5):
        ids = torch.randint(0, N, (9 if bag else 6,), generator=g)
        ids[3] = ids[1]
        if step % 2 == 0:
            ids[2] = ids[4] = 3
        local = sw.beforeForwardPass(ids)
        so.beforeForwardPass(ids)
        out = model.emb(local, offsets) if bag else model.emb(local)
        opt.zero_grad()
        (out * w).pow(2).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        so.afterOptimizerStep(ids)
        fout = full.emb(ids, offsets) if bag else full.emb(ids)
        fopt.zero_grad()
        (fout * w).pow(2).sum().backward()
        fopt.step()
    got = torch.from_numpy(sw.getNumpyVersion())
    torch.testing.assert_close(got, full.emb.weight.detach(), rtol=0, atol=0)
    assert not torch.equal(got, U0)
    if "padding_idx" in opts:
        assert torch.equal(got[3], U0[3])


@pytest.mark.parametrize("kind", ["torch", "numpy-view-of-torch", "numpy", "list"])
def test_id_buffers_refilled_in_place_between_steps(kind: str) -> None:
    """README: the row plan is reused while the id objects are unchanged ("the values for
    CPU ids"); a loader that refills one buffer each step must get each step's rows, with
    either switcher called first."""
    U0, V0 = initial_tables()
    batches = make_batches()
    ru, rv = reference_w2v(optim.Adam, {"lr": 0.05}, U0, V0, batches)
    for opt_first in (False, True):
        run = Run(optim.Adam, {"lr": 0.05}, U0, V0)
        bufs: list[Any] = [t.clone() for t in batches[0]]
        if kind == "numpy":
            bufs = [b.numpy() for b in bufs]
        elif kind == "list":
            bufs = [b.tolist() for b in bufs]
        for batch in batches:
            for buf, new in zip(bufs, batch, strict=True):
                if kind == "torch":
                    buf.copy_(new)
                elif kind == "numpy-view-of-torch":
                    buf.numpy()[...] = new.numpy()  # torch's version counter does not move
                elif kind == "numpy":
                    buf[...] = new.numpy()
                else:
                    buf[:] = new.tolist()
            run.step(*bufs, opt_first=opt_first)
        assert_matches(run, ru, rv)


# --------------------------------------------------------------------------- errors

SUPPORTED_SPEC = [
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
]


class _NoState(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        return None


@pytest.mark.parametrize(
    "make_opt",
    [
        pytest.param(lambda ps: optim.LBFGS(ps), id="lbfgs"),
        pytest.param(lambda ps: _NoState(ps), id="custom"),
    ],
)
def test_optimizer_that_cannot_be_paged_names_the_supported_ones(make_opt: Any) -> None:
    model = W2V()
    u = cpu_model_switch(model.u_embeddings)
    u.uniformDistributionInit(-1.0, 1.0)
    before = u.getNumpyVersion().copy()
    opt = make_opt(model.parameters())
    with pytest.raises(gl.GadgetTypeError) as info:
        sw = cpu_opt_switch(opt, model, "u_embeddings")
        sw.optInit()
    msg = str(info.value)
    assert type(opt).__name__ in msg
    for name in SUPPORTED_SPEC:
        assert name in msg
    np.testing.assert_array_equal(u.getNumpyVersion(), before)


def test_differentiable_optimizer_is_refused() -> None:
    model = W2V()
    cpu_model_switch(model.u_embeddings)
    opt = optim.Adam(model.parameters(), differentiable=True)
    with pytest.raises(gl.GadgetTypeError, match="differentiable"):
        cpu_opt_switch(opt, model, "u_embeddings").optInit()


@pytest.mark.parametrize(
    ("pos", "neg", "error", "pattern"),
    [
        (torch.tensor([1, N]), None, gl.GadgetIndexError, r"60.*\[0, 59\]"),
        (torch.tensor([1, -1]), None, gl.GadgetIndexError, r"-1.*\[0, 59\]"),
        (torch.tensor([1]), torch.tensor([[2, N + 5]]), gl.GadgetIndexError, r"65.*\[0, 59\]"),
        (torch.tensor([1.0, 2.0]), None, gl.GadgetTypeError, "integer.*float32"),
        (np.array([1.0, 2.0]), None, gl.GadgetTypeError, "integer.*float64"),
        (torch.tensor([True, False]), None, gl.GadgetTypeError, "bool"),
    ],
    ids=["out-of-range", "negative", "neg-out-of-range", "float", "numpy-float", "bool"],
)
def test_bad_ids_raise_before_anything_changes(
    pos: Any, neg: Any, error: type, pattern: str
) -> None:
    U0, V0 = initial_tables()
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0).train(make_batches(2))
    table = run.v.getNumpyVersion().copy()
    states = {k: a.copy() for k, a in run.vo.getNumpyVersion().items()}
    var = run.model.v_embeddings.weight.detach().clone()
    with pytest.raises(error, match=pattern):
        run.v.beforeForwardPass(pos, neg)
    with pytest.raises(error, match=pattern):
        run.vo.beforeForwardPass(pos, neg)
    np.testing.assert_array_equal(run.v.getNumpyVersion(), table)
    for k, a in run.vo.getNumpyVersion().items():
        np.testing.assert_array_equal(a, states[k])
    assert torch.equal(run.model.v_embeddings.weight.detach(), var)
    assert not run.v.step_under_way()
    # training goes on as if nothing happened
    batches = make_batches(2)
    more = make_batches(2, seed=9)
    run.train(more)
    ru, rv = reference_w2v(optim.Adam, {"lr": 0.05}, U0, V0, batches + more)
    assert_matches(run, ru, rv)


def test_constructor_arguments_are_checked() -> None:
    model = W2V()
    opt = optim.Adam(model.parameters())
    emb = model.u_embeddings
    with pytest.raises(gl.GadgetValueError, match=r"embed_dimension=5.*\(4,\)"):
        gl.ModelFactory(emb, N, D + 1, placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="total_classes.*0"):
        gl.ModelFactory(emb, 0, D, placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="total_classes"):
        gl.ModelFactory(emb, "60", D, placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="float32"):
        gl.ModelFactory(emb, N, D, datatype="floaty", placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="floating point"):
        gl.ModelFactory(emb, N, D, datatype="int32", placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="CPUPinn.*'False'"):
        gl.ModelFactory(emb, N, D, CPUPinn="False")
    with pytest.raises(gl.GadgetTypeError, match="pinType.*'False'"):
        gl.PytorchModelFactory(emb, N, D, deviceType="cpu", pinType="False")
    with pytest.raises(gl.GadgetValueError, match="'tpu'.*'cuda', 'cpu'"):
        gl.PytorchModelFactory(emb, N, D, deviceType="tpu")
    with pytest.raises(gl.GadgetTypeError, match="deviceType.*int"):
        gl.PytorchModelFactory(emb, N, D, deviceType=3)
    with pytest.raises(gl.GadgetKeyError, match="'gpu'.*cpu"):
        gl.ModelFactory(emb, N, D, placement="gpu")
    with pytest.raises(gl.GadgetValueError, match="'x'.*merge.*separate"):
        gl.ModelFactory(emb, N, D, placement="cpu", duplicates="x")
    with pytest.raises(gl.GadgetValueError, match=r"embed_dimension=5.*\(4,\)"):
        gl.OptimizerFactory(opt, N, D + 1, model, "u_embeddings", placement="cpu")
    with pytest.raises(gl.GadgetKeyError, match="'nope'.*u_embeddings.*v_embeddings"):
        gl.OptimizerFactory(opt, N, D, model, "nope", placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="CPUPinn.*'True'"):
        gl.OptimizerFactory(opt, N, D, model, "u_embeddings", CPUPinn="True")
    with pytest.raises(gl.GadgetTypeError, match="floating point"):
        gl.OptimizerFactory(opt, N, D, model, "u_embeddings", dtype="int64", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="'tpu'"):
        gl.PytorchOptimizerFactory(opt, N, D, model, "u_embeddings", deviceType="tpu")
    other = optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    cpu_model_switch(emb)
    with pytest.raises(gl.GadgetKeyError, match="not among the optimizer's parameters"):
        cpu_opt_switch(other, model, "u_embeddings").optInit()


def test_row_count_mismatch_between_model_and_optimizer_factory() -> None:
    model = W2V()
    opt = optim.Adam(model.parameters())
    u = cpu_model_switch(model.u_embeddings)
    u.uniformDistributionInit(-1.0, 1.0)
    before = u.getNumpyVersion().copy()
    uo = gl.OptimizerFactory(opt, N + 1, D, model, "u_embeddings", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="61.*60"):
        uo.optInit()
    np.testing.assert_array_equal(u.getNumpyVersion(), before)


def test_methods_called_in_the_wrong_order() -> None:
    U0, V0 = initial_tables()
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0, opt_init=False)
    ids = torch.tensor([3, 4, 3])
    for call in (
        lambda: run.uo.beforeForwardPass(ids),
        lambda: run.uo.afterOptimizerStep(ids),
        lambda: run.uo.getNumpyVersion(),
    ):
        with pytest.raises(gl.GadgetValueError, match=r"optInit\(\)"):
            call()
    run.uo.optInit()
    run.vo.optInit()
    before = run.u.getNumpyVersion().copy()
    # afterOptimizerStep with no beforeForwardPass: nothing to write back
    with pytest.raises(gl.GadgetValueError, match="same ids"):
        run.u.afterOptimizerStep(ids)
    # afterOptimizerStep with other ids than the step's
    local = run.u.beforeForwardPass(ids)
    run.uo.beforeForwardPass(ids)
    run.model.u_embeddings(local).sum().backward()
    run.opt.step()
    other = torch.tensor([5, 6])
    with pytest.raises(gl.GadgetValueError, match="same ids"):
        run.u.afterOptimizerStep(other)
    with pytest.raises(gl.GadgetValueError, match="same ids"):
        run.uo.afterOptimizerStep(other)
    np.testing.assert_array_equal(run.u.getNumpyVersion(), before)
    # the right ids (a new tensor with equal values) then write the step back
    run.u.afterOptimizerStep(torch.tensor([3, 4, 3]))
    run.uo.afterOptimizerStep(torch.tensor([3, 4, 3]))
    ref = LazyTable(optim.Adam, U0, {})
    uu, lref = torch.unique(ids, return_inverse=True)
    P = ref.param(uu, ids.numel())
    embedding(lref, P).sum().backward()
    ref.step(P, uu, {"lr": 0.05})
    torch.testing.assert_close(run.tables()[0], ref.W, rtol=0, atol=0)
    np.testing.assert_array_equal(run.uo.getNumpyVersion()["exp_avg"], ref.rows["exp_avg"].numpy())


# --------------------------------------------------------------------------- more protocol


def test_speedtorch_argument_names_positional_and_keyword() -> None:
    """SPEC: the signatures users already write, positionally and by SpeedTorch's names."""
    U0, V0 = initial_tables()
    batches = make_batches(3)
    kw = {"lr": 0.05}
    # positional, as in SpeedTorch's examples
    pos = Run(
        optim.Adam,
        kw,
        U0,
        V0,
        make_m=lambda v: gl.PytorchModelFactory(v, N, D, "float32", "cpu", False),
        make_o=lambda o, m, name: gl.PytorchOptimizerFactory(
            o, N, D, m, name, "float32", "cpu", False
        ),
    )
    with quiet_fallback():
        key = Run(
            optim.Adam,
            kw,
            U0,
            V0,
            make_m=lambda v: gl.ModelFactory(
                model_variable=v,
                total_classes=N,
                embed_dimension=D,
                datatype="float32",
                CPUPinn=True,
            ),
            make_o=lambda o, m, name: gl.OptimizerFactory(
                given_optimizer=o,
                total_classes=N,
                embed_dimension=D,
                model=m,
                variable_name=name,
                dtype="float32",
                CPUPinn=True,
            ),
        )
    pos.train(batches)
    for c, p, n in batches:
        lc = key.u.beforeForwardPass(retrievedPosIndexes=c)
        key.uo.beforeForwardPass(retrievedPosIndexes=c)
        lp, ln = key.v.beforeForwardPass(retrievedPosIndexes=p, retrievedNegIndexes=n)
        key.vo.beforeForwardPass(retrievedPosIndexes=p, retrievedNegIndexes=n)
        loss = key.model(lc, lp, ln)
        key.opt.zero_grad()
        loss.backward()
        key.opt.step()
        key.u.afterOptimizerStep(retrievedPosIndexes=c)
        key.uo.afterOptimizerStep(retrievedPosIndexes=c)
        key.v.afterOptimizerStep(retrievedPosIndexes=p, retrievedNegIndexes=n)
        key.vo.afterOptimizerStep(retrievedPosIndexes=p, retrievedNegIndexes=n)
    ru, rv = reference_w2v(optim.Adam, kw, U0, V0, batches)
    assert_matches(pos, ru, rv)
    assert_matches(key, ru, rv)
    sw = gl.PytorchModelFactory(torch.nn.Embedding(2, D), N, D, deviceType="cpu")
    sw.uniformDistributionInit(low=-0.5, high=0.5)
    sw.normalDistributionInit(mean=0.0, stdDev=0.1)
    sw.customInit(initFunction=torch.nn.init.constant_, val=0.5)
    assert (sw.getNumpyVersion() == 0.5).all()
    a, b = sw.variableTransformer(batchSize=2, posPerBatch=3, negPerBatch=1)
    assert a.shape == (2, 3) and b.shape == (2, 1)


@pytest.mark.parametrize(
    ("cls", "kw", "expected"),
    [
        pytest.param(optim.Rprop, {"lr": 0.03}, {"prev": 0.0, "step_size": 0.03}, id="rprop"),
        pytest.param(optim.Adagrad, {"initial_accumulator_value": 0.4}, {"sum": 0.4}, id="adagrad"),
        pytest.param(
            optim.Adam,
            {"amsgrad": True},
            dict.fromkeys(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), 0.0),
            id="adam",
        ),
        pytest.param(optim.ASGD, {}, {"ax": 0.0}, id="asgd"),
        pytest.param(optim.SGD, {"lr": 0.1}, {}, id="sgd-no-state"),
    ],
)
def test_state_tables_start_as_torch_starts_them(
    cls: type, kw: dict[str, Any], expected: dict[str, float]
) -> None:
    """README: "State is found from the optimizer itself and starts as torch starts it (no
    Rprop warm-up step)"; SPEC: SpeedTorch needed one step before switching Rprop."""
    model = W2V()
    opt = cls(model.parameters(), **kw)
    cpu_model_switch(model.u_embeddings)
    sw = cpu_opt_switch(opt, model, "u_embeddings")
    sw.optInit()
    states = sw.getNumpyVersion()
    assert sorted(states) == sorted(expected)
    for name, value in expected.items():
        assert states[name].shape == (N, D) and states[name].dtype == np.float32
        assert (states[name] == np.float32(value)).all(), name


def test_abandoned_step_is_replaced_by_the_next_before_forward_pass() -> None:
    """README: "the next successful [beforeForwardPass] replaces an abandoned step"."""
    U0, V0 = initial_tables()
    batches = make_batches(3)
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0)
    c, p, n = batches[2]
    run.u.beforeForwardPass(c)
    run.uo.beforeForwardPass(c)
    run.v.beforeForwardPass(p, n)
    run.vo.beforeForwardPass(p, n)
    run.train(batches[:2])
    ru, rv = reference_w2v(optim.Adam, {"lr": 0.05}, U0, V0, batches[:2])
    assert_matches(run, ru, rv)


def test_batches_of_changing_size_grow_the_variable() -> None:
    """The variable grows to the largest batch (capacity_for) and results stay exact."""
    U0, V0 = initial_tables()
    g = torch.Generator().manual_seed(3)
    batches = []
    for size in (3, 12, 5, 20, 2):
        batches.append(
            (
                torch.randint(0, N, (size,), generator=g),
                torch.randint(0, N, (size, C), generator=g),
                torch.randint(0, N, (size, K), generator=g),
            )
        )
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0).train(batches)
    ru, rv = reference_w2v(optim.Adam, {"lr": 0.05}, U0, V0, batches)
    assert_matches(run, ru, rv)
    assert run.model.u_embeddings.weight.shape[0] >= 20


def test_lr_scheduler_drives_the_paged_optimizer() -> None:
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0)
    sched = torch.optim.lr_scheduler.StepLR(run.opt, 2, gamma=0.5)
    for b in batches:
        run.step(*b)
        sched.step()
    ru, rv = reference_w2v(
        optim.Adam, {"lr": 0.05}, U0, V0, batches, kw_at=lambda i: {"lr": 0.05 * 0.5 ** (i // 2)}
    )
    assert_matches(run, ru, rv)


def test_float64_state_tables_for_a_float32_variable_change_nothing() -> None:
    """State rows follow the variable's dtype while paged; float64 state tables hold the
    float32 values exactly, so results equal the float32 reference."""
    U0, V0 = initial_tables()
    batches = make_batches()
    run = Run(
        optim.Adam,
        {"lr": 0.05},
        U0,
        V0,
        make_o=lambda o, m, name: gl.OptimizerFactory(
            o, N, D, m, name, dtype="float64", placement="cpu"
        ),
    ).train(batches)
    ru, _ = reference_w2v(optim.Adam, {"lr": 0.05}, U0, V0, batches)
    states = run.uo.getNumpyVersion()
    assert states["exp_avg"].dtype == np.float64
    torch.testing.assert_close(run.tables()[0], ru.W, rtol=0, atol=0)
    np.testing.assert_array_equal(states["exp_avg"], ru.rows["exp_avg"].double().numpy())


def test_manual_update_of_an_evaluation_lookup_is_written_back() -> None:
    """README: afterOptimizerStep writes back the rows its last beforeForwardPass loaded,
    "also an evaluation lookup's, for updates made by hand under torch.no_grad()", but never
    over a change made to the table after that lookup read them."""
    U0, _ = initial_tables()
    emb = torch.nn.Embedding(4, D)
    sw = cpu_model_switch(emb)
    sw.customInit(lambda t: t.copy_(U0))
    ids = torch.tensor([2, 9, 2])
    with torch.no_grad():
        local = sw.beforeForwardPass(ids)
        emb.weight[local] += 1.0
    sw.afterOptimizerStep(ids)
    expected = U0.clone()
    expected[[2, 9]] += 1.0  # a repeated id is one row: +1 once
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), expected, rtol=0, atol=0)
    with torch.no_grad():
        sw.beforeForwardPass(ids)
    sw.zerosInit()
    with pytest.raises(gl.GadgetValueError, match="changed"):
        sw.afterOptimizerStep(ids)
    assert (sw.getNumpyVersion() == 0).all()


def test_a_parameter_as_model_variable() -> None:
    """ModelSwitch: model_variable is an nn.Module or an nn.Parameter."""

    class PM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(5, D))

    U0, _ = initial_tables()
    model = PM()
    opt = optim.Adam(model.parameters(), lr=0.05)
    sw = gl.PytorchModelFactory(model.w, N, D, deviceType="cpu")
    sw.customInit(lambda t: t.copy_(U0))
    so = gl.PytorchOptimizerFactory(opt, N, D, model, "w", deviceType="cpu")
    so.optInit()
    ref = LazyTable(optim.Adam, U0, {})
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(0, N, (8,), generator=g)
        ids[3] = ids[0]
        local = sw.beforeForwardPass(ids)
        so.beforeForwardPass(ids)
        opt.zero_grad()
        embedding(local, model.w).pow(2).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        so.afterOptimizerStep(ids)
        uu, lref = torch.unique(ids, return_inverse=True)
        P = ref.param(uu, ids.numel())
        embedding(lref, P).pow(2).sum().backward()
        ref.step(P, uu, {"lr": 0.05})
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), ref.W, rtol=0, atol=0)


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(torch.tensor([[7, 8], [8, 9]]), id="2d"),
        pytest.param(torch.tensor(7), id="0d"),
        pytest.param(torch.tensor([], dtype=torch.long), id="empty"),
        pytest.param(range(3, 6), id="range"),
    ],
)
def test_id_shapes_give_local_ids_of_the_same_shape(ids: Any) -> None:
    """Local ids come back "same shapes" as the ids given."""
    U0, _ = initial_tables()
    emb = torch.nn.Embedding(3, D)
    sw = cpu_model_switch(emb)
    sw.customInit(lambda t: t.copy_(U0))
    t = torch.as_tensor(list(ids)) if isinstance(ids, range) else ids
    local = sw.beforeForwardPass(ids)
    assert local.shape == t.shape and local.dtype == torch.int64
    assert torch.equal(emb(local).detach(), U0[t])
    sw.afterOptimizerStep(ids)
    torch.testing.assert_close(torch.from_numpy(sw.getNumpyVersion()), U0, rtol=0, atol=0)


def test_checkpoint_with_the_model_and_refusals(tmp_path: Any) -> None:
    """README: a model passed without the switchers that page it is refused before anything
    is written; with them it is saved and resumes; a checkpoint of another optimizer class
    is refused before anything changes."""
    U0, V0 = initial_tables()
    batches = make_batches()
    whole = Run(optim.Adam, {"lr": 0.05}, U0, V0).train(batches)
    run = Run(optim.Adam, {"lr": 0.05}, U0, V0).train(batches[:3])
    with pytest.raises(gl.GadgetError, match="switchers"):
        gl.save_checkpoint(tmp_path / "bad", {"model": run.model, "opt": run.opt})
    assert not (tmp_path / "bad" / "meta.pt").exists()

    def objects(r: Run) -> dict[str, Any]:
        return {"model": r.model, "u": r.u, "v": r.v, "uo": r.uo, "vo": r.vo, "opt": r.opt}

    gl.save_checkpoint(tmp_path / "ck", objects(run))
    other = Run(optim.NAdam, {"lr": 0.05}, V0, U0)
    before = other.u.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError, match="Adam.*NAdam"):
        gl.load_checkpoint(tmp_path / "ck", objects(other))
    np.testing.assert_array_equal(other.u.getNumpyVersion(), before)
    fresh = Run(optim.Adam, {"lr": 0.05}, V0, U0)
    gl.load_checkpoint(tmp_path / "ck", objects(fresh))
    fresh.train(batches[3:])
    for a, b in zip(fresh.tables(), whole.tables(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_initialisers_after_opt_init_touch_only_their_own_table(tmp_path: Any) -> None:
    """README: optInit moves a host table into one buffer with its state tables;
    initialisers then run on the table's strided view -- they must not reach the state
    columns, nor the state initialisers the table."""
    U0, V0 = initial_tables()
    np.save(tmp_path / "v.npy", V0.numpy())
    run = Run(optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.3}, U0, V0)
    for call in (
        lambda: run.u.uniformDistributionInit(-1.0, 1.0),
        lambda: run.u.normalDistributionInit(0.0, 2.0),
        lambda: run.u.customInit(torch.nn.init.xavier_uniform_),
        lambda: run.u.customInit(torch.nn.init.constant_, 2.0),
        lambda: run.u.loadCupy(str(tmp_path / "v.npy")),
        lambda: run.u.zerosInit(),
    ):
        call()
        assert (run.uo.getNumpyVersion()["sum"] == np.float32(0.3)).all()
    assert (run.u.getNumpyVersion() == 0).all()
    run.uo.customInit(torch.nn.init.uniform_, 5.0, 6.0)
    s = run.uo.getNumpyVersion()["sum"]
    assert s.min() >= 5.0 and s.max() <= 6.0
    assert (run.u.getNumpyVersion() == 0).all()
    np.testing.assert_array_equal(run.v.getNumpyVersion(), V0.numpy())


@pytest.mark.parametrize(
    ("dtype", "cls", "kw"),
    [
        pytest.param(torch.float16, optim.Adam, {"lr": 0.05, "eps": 1e-4}, id="f16-adam"),
        pytest.param(torch.bfloat16, optim.Adam, {"lr": 0.05}, id="bf16-adam"),
        pytest.param(torch.bfloat16, optim.RMSprop, {"lr": 0.01, "momentum": 0.5}, id="bf16-rms"),
    ],
)
def test_half_tables_for_a_float32_embedding_with_float32_state_tables(
    dtype: torch.dtype, cls: type, kw: dict[str, Any]
) -> None:
    """README: "A datatype other than the model variable's (e.g. float16 tables for a float32
    nn.Embedding) makes the variable that dtype while it is paged, and the optimizer's state
    rows follow it" -- float32 state tables (OptimizerFactory's default dtype) hold those
    rows exactly, so results equal the reference in the table's dtype."""
    U0, V0 = initial_tables(dtype)
    batches = make_batches()
    run = Run(
        cls,
        kw,
        U0,
        V0,
        make_m=lambda v: gl.ModelFactory(v, N, D, datatype=dtype, placement="cpu"),
    )
    assert run.model.u_embeddings.weight.dtype == torch.float32  # until the first lookup
    run.train(batches)
    assert run.model.u_embeddings.weight.dtype == dtype
    states = run.uo.getNumpyVersion()
    assert {a.dtype for a in states.values()} == {np.dtype(np.float32)}
    ru, rv = reference_w2v(cls, kw, U0, V0, batches)
    lu, lv = run.tables()  # bfloat16 reads back as float32, exactly
    torch.testing.assert_close(lu, ru.W.to(lu.dtype), rtol=0, atol=0)
    torch.testing.assert_close(lv, rv.W.to(lv.dtype), rtol=0, atol=0)
    for k, a in states.items():
        torch.testing.assert_close(torch.from_numpy(a), ru.rows[k].float(), rtol=0, atol=0)


def test_bfloat16_table_saves_to_hdf5_zarr_torch_but_not_npy(tmp_path: Any) -> None:
    """README: bfloat16 has no .npy form; HDF5 / zarr round-trip it bit-exactly."""
    pytest.importorskip("h5py")
    pytest.importorskip("zarr")
    U0, _ = initial_tables(torch.bfloat16)
    src = gl.ModelFactory(torch.nn.Embedding(2, D), N, D, datatype="bfloat16", placement="cpu")
    src.customInit(lambda t: t.copy_(U0))
    with pytest.raises(gl.GadgetTypeError, match="bfloat16.*(HDF5|zarr)"):
        src.saveCupy(str(tmp_path / "bf"))
    assert not list(tmp_path.iterdir())
    src.save(tmp_path / "bf.h5")
    src.save(tmp_path / "bf.zarr")
    src.saveTorch(tmp_path / "bf.pt")
    assert torch.equal(torch.load(tmp_path / "bf.pt", weights_only=True), U0)
    dst = gl.ModelFactory(torch.nn.Embedding(2, D), N, D, datatype="bfloat16", placement="cpu")
    for load in (
        lambda: dst.load(tmp_path / "bf.h5"),
        lambda: dst.load(tmp_path / "bf.zarr"),
        lambda: dst.loadTorch(tmp_path / "bf.pt"),
    ):
        dst.zerosInit()
        load()
        np.testing.assert_array_equal(dst.getNumpyVersion(), U0.float().numpy())
    f32 = gl.ModelFactory(torch.nn.Embedding(2, D), N, D, placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="bfloat16.*float32"):
        f32.load(tmp_path / "bf.h5")


def test_save_cupy_appends_npy_to_a_path_object(tmp_path: Any) -> None:
    U0, _ = initial_tables()
    sw = cpu_model_switch(torch.nn.Embedding(2, D))
    sw.customInit(lambda t: t.copy_(U0))
    sw.saveCupy(tmp_path / "emb")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emb.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), U0.numpy())
    with pytest.raises(gl.GadgetTypeError, match="NoneType"):
        sw.saveCupy(None)


def test_separate_layout_explicitly_and_switching_layout_mid_training() -> None:
    """ModelSwitch: ``duplicates='separate'`` is SpeedTorch's layout (the local ids returned
    then address one row per position); calling variableTransformer after some merged steps
    switches the layout, and the optimizer switchers follow it."""
    U0, V0 = initial_tables()
    batches = make_batches()
    kw = {"lr": 0.05}
    sep = Run(
        optim.Adam,
        kw,
        U0,
        V0,
        make_m=lambda v: gl.ModelFactory(v, N, D, placement="cpu", duplicates="separate"),
    ).train(batches)
    assert sep.u.duplicates == "separate"
    assert_matches(sep, *reference_w2v(optim.Adam, kw, U0, V0, batches, layout="separate"))

    run = Run(optim.Adam, kw, U0, V0).train(batches[:3])
    du = torch.from_numpy(run.u.variableTransformer(B, 1)).view(B)
    dp, dn = (torch.from_numpy(a) for a in run.v.variableTransformer(B, C, K))
    run.train(batches[3:], dummies=(du, dp, dn))
    ru, rv = reference_w2v(optim.Adam, kw, U0, V0, batches[:3])
    for c, p, n in batches[3:]:
        vids = torch.cat([p.flatten(), n.flatten()])
        PU, PV = ru.param(c, c.numel()), rv.param(vids, vids.numel())
        w2v_loss(PU, PV, du, dp, dn).backward()
        ru.step(PU, c, kw)
        rv.step(PV, vids, kw)
    assert_matches(run, ru, rv)
