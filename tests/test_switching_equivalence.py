"""Switcher training equals full-table training with lazy per-row updates.

The reference keeps the whole table as one dense parameter, runs the *same* torch
optimizer on it, and afterwards restores every row outside the batch (weights and
row-shaped state): exactly "rows outside a batch are untouched". The switchers must
match it for every supported optimizer, on every placement, with repeated ids.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from torch import nn

import gadgetloader as gl
from gadgetloader.switching import ModelSwitch, OptimizerSwitch

N, D = 40, 6
STEPS = 5

#: (optimizer, hyper-parameters); every supported optimizer and its variants
CONFIGS = [
    ("SparseAdam", {"lr": 0.05}),
    ("Adam", {"lr": 0.05}),
    ("Adam", {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}),
    ("AdamW", {"lr": 0.05}),
    ("AdamW", {"lr": 0.05, "amsgrad": True}),
    ("Adamax", {"lr": 0.05}),
    ("Adadelta", {"lr": 0.5}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.9}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("Rprop", {"lr": 0.05}),
    ("ASGD", {"lr": 0.05}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}),
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.001}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("NAdam", {"lr": 0.05}),
    ("RAdam", {"lr": 0.05}),
]
IMPLS = ["single", "foreach", "fused"]


def _config_id(c: tuple[str, dict]) -> str:
    name, kw = c
    extra = ",".join(f"{k}={v}" for k, v in kw.items() if k != "lr")
    return f"{name}[{extra}]" if extra else name


def _make(name: str, params, kw: dict, impl: str) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, name)
    kw = dict(kw)
    params = list(params)
    if impl != "single":
        import inspect

        if impl not in inspect.signature(cls.__init__).parameters:
            pytest.skip(f"torch {torch.__version__} has no {impl} {name}")
        kw[impl] = True
    elif "foreach" in __import__("inspect").signature(cls.__init__).parameters:
        kw["foreach"] = False
    try:
        opt = cls(params, **kw)
        if impl == "fused":  # torch checks the device only at the first step
            probe = torch.zeros(1, device=params[0].device, requires_grad=True)
            probe.grad = torch.zeros_like(probe)
            cls([probe], **kw).step()
        return opt
    except (RuntimeError, ValueError) as exc:
        pytest.skip(f"{impl} {name} is not available here: {exc}")


def _batches(seed: int, steps: int = STEPS, device: torch.device | str = "cpu"):
    """Random ids with plenty of repeats, and targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, N, (8, 3), generator=g)
        ids[0, 1] = ids[0, 0]  # at least one repeat per batch
        coef = torch.randn(8, 3, D, generator=g)
        y = torch.randn(8, generator=g)
        out.append((ids.to(device), coef.to(device), y.to(device)))
    return out


def _loss(rows: torch.Tensor, coef: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((0.1 * (rows * coef).sum(dim=(1, 2))).tanh() - y).pow(2).sum()


def _fresh_row_value(key: str, kw: dict) -> float:
    """What torch gives a fresh parameter's state (written out here by hand, so the
    switchers' own discovery of it is checked independently)."""
    return kw["lr"] if key == "step_size" else 0.0


class DenseReference:
    """The whole table as one parameter; rows outside a batch restored after each step."""

    def __init__(
        self, tables: list[torch.Tensor], name: str, kw: dict, impl: str, sparse: bool = False
    ):
        self.params = [nn.Parameter(t.clone()) for t in tables]
        self.sparse = sparse
        self.opt = _make(name, self.params, kw, impl)
        self.kw = kw

    def step(self, loss_fn, batch_ids: list[torch.Tensor]) -> None:
        self.opt.zero_grad()
        loss_fn(*self.params).backward()
        before = [p.detach().clone() for p in self.params]
        state_before = [
            {
                k: v.clone()
                for k, v in self.opt.state[p].items()
                if isinstance(v, torch.Tensor) and v.shape == p.shape
            }
            for p in self.params
        ]
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            self.opt.step()
        with torch.no_grad():
            for p, b, sb, ids in zip(self.params, before, state_before, batch_ids, strict=False):
                outside = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
                outside[ids.reshape(-1)] = False
                p[outside] = b[outside]
                for k, v in self.opt.state[p].items():
                    if not (isinstance(v, torch.Tensor) and v.shape == p.shape):
                        continue
                    if k in sb:
                        v[outside] = sb[k][outside]
                    else:  # created by this (first) step: rows outside start fresh
                        v[outside] = _fresh_row_value(k, self.kw)


def _switch_model(placement: str, device: torch.device, init: torch.Tensor, sparse: bool = False):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1, D, sparse=sparse).to(device)

    model = Model()
    sw = ModelSwitch(model.emb, N, D, placement=placement)
    sw.table.insertData(init.to(device), torch.arange(N))
    return model, sw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_every_optimizer_matches_dense_reference(placement, device, config, impl):
    name, kw = config
    sparse = name == "SparseAdam"
    if sparse and impl != "single":
        pytest.skip("SparseAdam has no foreach / fused variants")
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(0))
    ref = DenseReference([init.to(device)], name, kw, impl, sparse=sparse)
    model, sw = _switch_model(placement, device, init, sparse=sparse)
    opt = _make(name, model.parameters(), kw, impl)
    osw = OptimizerSwitch(opt, N, D, model, "emb", placement=placement)
    osw.optInit()
    touched = torch.zeros(N, dtype=torch.bool)
    for ids, coef, y in _batches(1, device=device):
        ref.step(
            lambda W, ids=ids, coef=coef, y=y: _loss(F.embedding(ids, W, sparse=sparse), coef, y),
            [ids],
        )
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        opt.zero_grad()
        _loss(model.emb(local), coef, y).backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        touched[ids.reshape(-1).cpu()] = True
    got = torch.from_numpy(sw.getNumpyVersion())
    want = ref.params[0].detach().cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[~touched], init[~touched]), "rows outside every batch must be untouched"
    ref_state = ref.opt.state[ref.params[0]]
    for key, table in osw.tables.items():
        torch.testing.assert_close(
            torch.from_numpy(table.getNumpyVersion())[touched],
            ref_state[key].cpu()[touched],
            rtol=1e-5,
            atol=1e-6,
        )
    for key, value in opt.state[model.emb.weight].items():
        if key not in osw.tables:
            assert float(value) == pytest.approx(float(ref_state[key])), key


def test_sgd_is_exact_against_full_table(placement, device):
    """Plain SGD: bit-identical to a dense full-table parameter (no restore needed)."""
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    W = nn.Parameter(init.clone().to(device))
    ref_opt = torch.optim.SGD([W], lr=0.1)
    model, sw = _switch_model(placement, device, init)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for ids, coef, y in _batches(2, steps=8, device=device):
        ref_opt.zero_grad()
        _loss(F.embedding(ids, W), coef, y).backward()
        ref_opt.step()
        local = sw.beforeForwardPass(ids)
        opt.zero_grad()
        _loss(model.emb(local), coef, y).backward()
        opt.step()
        sw.afterOptimizerStep(ids)
    assert torch.equal(torch.from_numpy(sw.getNumpyVersion()), W.detach().cpu())


@pytest.mark.parametrize(
    ("switch_name", "sparse_name", "kw"),
    [("Adam", "SparseAdam", {"lr": 0.05}), ("Adagrad", "Adagrad", {"lr": 0.1})],
)
def test_dense_optimizers_match_torch_sparse_training(
    placement, device, switch_name, sparse_name, kw
):
    """Adam vs torch SparseAdam, Adagrad vs sparse Adagrad on nn.Embedding(sparse=True)."""
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(4))
    full = nn.Embedding(N, D, sparse=True).to(device)
    with torch.no_grad():
        full.weight.copy_(init)
    ref_opt = getattr(torch.optim, sparse_name)(full.parameters(), **kw)
    model, sw = _switch_model(placement, device, init)
    opt = getattr(torch.optim, switch_name)(model.parameters(), **kw)
    osw = OptimizerSwitch(opt, N, D, model, "emb", placement=placement)
    osw.optInit()
    for ids, coef, y in _batches(5, steps=8, device=device):
        ref_opt.zero_grad()
        _loss(full(ids), coef, y).backward()
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            ref_opt.step()
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        opt.zero_grad()
        _loss(model.emb(local), coef, y).backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
    # SparseAdam adds eps to sqrt(v) before bias correction, Adam after: float tolerance
    torch.testing.assert_close(
        torch.from_numpy(sw.getNumpyVersion()), full.weight.detach().cpu(), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    ("name", "kw"),
    [("Adam", {"lr": 0.05}), ("Rprop", {"lr": 0.05}), ("SGD", {"lr": 0.1, "momentum": 0.9})],
)
def test_two_tables_share_one_optimizer(placement, device, name, kw):
    """word2vec: input and output embeddings, positives and negatives, one optimizer."""
    g = torch.Generator().manual_seed(6)
    u0, v0 = torch.randn(N, D, generator=g) * 0.3, torch.randn(N, D, generator=g) * 0.3

    def w2v_loss(u_rows, v_pos, v_neg):
        pos = (u_rows * v_pos).sum(-1)
        neg = torch.bmm(v_neg, u_rows.unsqueeze(2)).squeeze(2)
        return -(F.logsigmoid(pos).sum() + F.logsigmoid(-neg).sum())

    ref = DenseReference([u0.to(device), v0.to(device)], name, kw, "single")

    class W2V(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.u_embeddings = nn.Embedding(1, D).to(device)
            self.v_embeddings = nn.Embedding(1, D).to(device)

    model = W2V()
    opt = _make(name, model.parameters(), kw, "single")
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, placement=placement)
    v_sw = gl.PytorchModelFactory(model.v_embeddings, N, D, placement=placement)
    u_sw.table.insertData(u0.to(device), torch.arange(N))
    v_sw.table.insertData(v0.to(device), torch.arange(N))
    u_opt = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement=placement)
    v_opt = gl.PytorchOptimizerFactory(opt, N, D, model, "v_embeddings", placement=placement)
    u_opt.optInit()
    v_opt.optInit()
    for _ in range(STEPS):
        center = torch.randint(0, N, (16,), generator=g).to(device)
        ctx = torch.randint(0, N, (16,), generator=g).to(device)
        neg = torch.randint(0, N, (16, 4), generator=g).to(device)
        ref.step(
            lambda U, V, c=center, x=ctx, n=neg: w2v_loss(
                F.embedding(c, U), F.embedding(x, V), F.embedding(n, V)
            ),
            [center, torch.cat([ctx, neg.reshape(-1)])],
        )
        lu = u_sw.beforeForwardPass(center)
        lctx, lneg = v_sw.beforeForwardPass(ctx, neg)
        u_opt.beforeForwardPass(center)
        v_opt.beforeForwardPass(ctx, neg)
        opt.zero_grad()
        w2v_loss(
            model.u_embeddings(lu), model.v_embeddings(lctx), model.v_embeddings(lneg)
        ).backward()
        opt.step()
        u_sw.afterOptimizerStep(center)
        v_sw.afterOptimizerStep(ctx, neg)
        u_opt.afterOptimizerStep(center)
        v_opt.afterOptimizerStep(ctx, neg)
    torch.testing.assert_close(
        torch.from_numpy(u_sw.getNumpyVersion()), ref.params[0].detach().cpu(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.from_numpy(v_sw.getNumpyVersion()), ref.params[1].detach().cpu(), rtol=1e-5, atol=1e-6
    )
