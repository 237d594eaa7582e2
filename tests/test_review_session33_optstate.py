"""Session 33 black-box review: the offloaded optimizer as a torch optimizer.

OffloadedOptimizer (and the optimizer switchers) checked from the README and the
docstrings only: state_dict() / load_state_dict() round trips (in memory and through
torch.save / torch.load(weights_only=True)), resuming into a fresh model and optimizer
bit-identically, param_groups editing, LR schedulers against a dense (or lazy per-row)
torch reference, add_param_group, zero_grad, hooks, gradient clipping, mixed models,
several optimizers over one model, and bad states refused with nothing changed.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import gadgetloader as gl

N, D = 12, 4


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# --------------------------------------------------------------------------- helpers


def _weights(seed, n=N, d=D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, d, generator=g, dtype=dtype)
    hw = torch.randn(1, d, generator=g, dtype=dtype)
    hb = torch.randn(1, generator=g, dtype=dtype)
    return w, hw, hb


def _head(hw, hb):
    head = torch.nn.Linear(hw.shape[1], 1, dtype=hw.dtype)
    with torch.no_grad():
        head.weight.copy_(hw)
        head.bias.copy_(hb)
    return head


def _emb(w):
    emb = gl.OffloadedEmbedding(
        w.shape[0], w.shape[1], placement="cpu", device="cpu", dtype=w.dtype
    )
    emb.weight.insertData(w.clone(), torch.arange(w.shape[0]))
    return emb


def make_pair(seed=0, n=N, d=D, dtype=torch.float32):
    """An offloaded model and a dense twin with identical weights."""
    w, hw, hb = _weights(seed, n, d, dtype)
    off = torch.nn.ModuleDict({"emb": _emb(w), "head": _head(hw, hb)})
    ref = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding.from_pretrained(w.clone(), freeze=False), "head": _head(hw, hb)}
    )
    return off, ref


def make_off(seed=0, n=N, d=D):
    return make_pair(seed, n, d)[0]


def loss_of(model, ids, y):
    return (model["head"](torch.tanh(model["emb"](ids))).squeeze(-1) - y).pow(2).mean()


def full_batches(k, seed=1, n=N, extra=5):
    """Batches that look up every row (plus repeats): lazy updates equal dense ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ids = torch.cat(
            [torch.randperm(n, generator=g), torch.randint(0, n, (extra,), generator=g)]
        )
        ids = ids[torch.randperm(len(ids), generator=g)]
        out.append((ids, torch.randn(len(ids), generator=g)))
    return out


def partial_batches(k, seed=2, n=N, size=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ids = torch.randint(0, n // 2 + 2, (size,), generator=g)  # rows >= n//2+2 never looked up
        out.append((ids, torch.randn(size, generator=g)))
    return out


def train(model, opt, batches, sched=None, sched_each=None):
    for i, (ids, y) in enumerate(batches):
        opt.zero_grad()
        loss = loss_of(model, ids, y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step() if sched_each is None else sched.step(sched_each[i])


def table(mod):
    return torch.from_numpy(mod.weight.getNumpyVersion()).clone()


def assert_models_equal(a, b, what=""):
    for name in a:
        ma, mb = a[name], b[name]
        if isinstance(ma, (gl.OffloadedEmbedding, gl.OffloadedEmbeddingBag)):
            ta = table(ma)
            tb = (
                table(mb)
                if isinstance(mb, (gl.OffloadedEmbedding, gl.OffloadedEmbeddingBag))
                else mb.weight.detach()
            )
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), (
                f"{what} table {name!r} differs: max |diff| {(ta.double() - tb.double()).abs().max().item()}"
            )
        else:
            for (n1, p1), (_, p2) in zip(
                ma.named_parameters(), mb.named_parameters(), strict=False
            ):
                assert torch.equal(p1.detach(), p2.detach()), (
                    f"{what} {name}.{n1} differs: max |diff| {(p1 - p2).abs().max().item()}"
                )


def assert_sd_equal(a, b, path="sd"):
    """Deep equality of state dicts (tensors bitwise, same dtypes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b)) if isinstance(b, dict) else b}"
        )
        for k in a:
            assert_sd_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a} vs {b}"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_sd_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def snapshot(model, opt):
    """Everything a refused load must leave as it was."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }


def assert_unchanged(model, opt, snap):
    now = snapshot(model, opt)
    assert_sd_equal(snap["model"], now["model"], "model")
    assert_sd_equal(snap["opt"], now["opt"], "opt")
    assert snap["groups"] == now["groups"]


class LazyRef:
    """The README's lazy per-row updates, with plain torch: a table of ``w`` plus a
    Linear head in one torch optimizer; each step trains a fresh parameter holding
    only the looked-up rows (distinct, ascending), whose state rows are gathered from
    and scattered back to full state tables; non-row state (``step``) is per table."""

    def __init__(self, cls, w, hw, hb, fills=None, **kw):
        self.W = w.clone()
        self.head = _head(hw, hb)
        self.P = torch.nn.Parameter(torch.zeros(0, w.shape[1], dtype=w.dtype))
        self.opt = cls([self.head.weight, self.head.bias, self.P], **kw)
        self.full: dict = {}
        self.scalars: dict = {}
        self.fills = fills or {}

    def step(self, ids, y):
        u, inv = torch.unique(ids, return_inverse=True)
        P = torch.nn.Parameter(self.W[u].clone())
        self.opt.state.pop(self.P, None)
        self.opt.param_groups[0]["params"][-1] = P
        self.P = P
        if self.full or self.scalars:
            st = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.scalars.items()}
            st.update({k: v[u].clone() for k, v in self.full.items()})
            self.opt.state[P] = st
        elif isinstance(self.opt, torch.optim.Adagrad):
            # torch before 2.12 fills Adagrad's state in __init__ only (later ones on the
            # first step): give the fresh parameter the state __init__ would have
            iav = self.opt.defaults["initial_accumulator_value"]
            self.opt.state[P] = {"step": torch.tensor(0.0), "sum": torch.full_like(P, iav)}
        self.opt.zero_grad()
        loss = (self.head(torch.tanh(F.embedding(inv, P))).squeeze(-1) - y).pow(2).mean()
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.W[u] = P.detach()
        for k, v in self.opt.state[P].items():
            if torch.is_tensor(v) and v.shape == P.shape:
                if k not in self.full:
                    self.full[k] = torch.full_like(self.W, self.fills.get(k, 0.0))
                self.full[k][u] = v
            else:
                self.scalars[k] = v.clone() if torch.is_tensor(v) else v
        return loss

    def assert_matches(self, off, what=""):
        t = table(off["emb"])
        assert torch.equal(t, self.W), (
            f"{what} table differs: max |diff| {(t - self.W).abs().max().item()}"
        )
        for a, b in zip(off["head"].parameters(), self.head.parameters(), strict=False):
            assert torch.equal(a.detach(), b.detach()), f"{what} head differs"


OPTIMIZERS = [
    pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
    pytest.param(
        torch.optim.AdamW, dict(lr=0.05, amsgrad=True, weight_decay=0.1), id="AdamW-amsgrad"
    ),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9), id="SGD-momentum"),
    pytest.param(torch.optim.Adagrad, dict(lr=0.1), id="Adagrad"),
    pytest.param(
        torch.optim.RMSprop, dict(lr=0.01, centered=True, momentum=0.5), id="RMSprop-centered"
    ),
    pytest.param(torch.optim.Rprop, dict(lr=0.01), id="Rprop"),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=2), id="ASGD"),
]


# ------------------------------------------------------------------ round trips / resume


@pytest.mark.parametrize("cls, kw", OPTIMIZERS)
def test_resume_through_torch_save_weights_only_is_bit_identical(tmp_path, cls, kw):
    bs = full_batches(6) if cls is not torch.optim.Adagrad else partial_batches(6)
    a = make_off(0)
    oa = gl.OffloadedOptimizer(cls, a, **kw)
    train(a, oa, bs[:3])
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)

    b = make_off(7)  # other weights: all must come from the saved state
    ob = gl.OffloadedOptimizer(cls, b, **kw)
    b.load_state_dict(saved["model"])
    ob.load_state_dict(saved["opt"])
    assert_sd_equal(
        roundtrip(oa.state_dict()), roundtrip(ob.state_dict()), "state right after load"
    )

    train(a, oa, bs[3:])
    train(b, ob, bs[3:])
    assert_models_equal(a, b, f"{cls.__name__} resumed")
    assert_sd_equal(
        roundtrip(oa.state_dict()), roundtrip(ob.state_dict()), "state after resumed training"
    )


@pytest.mark.parametrize("cls, kw", OPTIMIZERS)
def test_dense_reference_when_every_row_is_looked_up(cls, kw):
    # every step looks up every row: lazy per-row updates equal a dense optimizer's
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    ropt = cls(ref.parameters(), **kw)
    for ids, y in full_batches(4):
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ropt.zero_grad()
        loss_of(ref, ids, y).backward()
        ropt.step()
    assert_models_equal(off, ref, cls.__name__)


def test_state_dict_in_memory_deepcopy_round_trip_and_load_before_first_step():
    bs = full_batches(4)
    a = make_off(0)
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    sd0 = copy.deepcopy(oa.state_dict())  # before any step
    b = make_off(0)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.5)  # other lr: the dict's comes back
    ob.load_state_dict(sd0)
    assert ob.param_groups[0]["lr"] == 0.05
    train(a, oa, bs)
    train(b, ob, bs)
    assert_models_equal(a, b, "loaded before first step")


def test_load_restores_param_group_options_of_the_saved_optimizer():
    a = make_off(0)
    oa = gl.OffloadedOptimizer(torch.optim.AdamW, a, lr=0.03, weight_decay=0.2, betas=(0.8, 0.9))
    train(a, oa, full_batches(2))
    oa.param_groups[0]["lr"] = 0.011
    sd = roundtrip(oa.state_dict())
    b = make_off(0)
    ob = gl.OffloadedOptimizer(torch.optim.AdamW, b, lr=1.0, weight_decay=0.0)
    ob.load_state_dict(sd)
    g = ob.param_groups[0]
    assert g["lr"] == 0.011 and g["weight_decay"] == 0.2 and tuple(g["betas"]) == (0.8, 0.9)


def test_reloading_an_earlier_state_into_the_same_optimizer_rolls_back_exactly():
    bs = full_batches(5)
    m = make_off(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    train(m, opt, bs[:2])
    saved = roundtrip({"model": m.state_dict(), "opt": opt.state_dict()})
    train(m, opt, bs[2:])
    after_once = (table(m["emb"]), [p.detach().clone() for p in m["head"].parameters()])
    m.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(m, opt, bs[2:])
    assert torch.equal(table(m["emb"]), after_once[0])
    for p, q in zip(m["head"].parameters(), after_once[1], strict=False):
        assert torch.equal(p.detach(), q)


def test_state_tables_of_another_float_dtype_are_converted_on_load():
    # README: OffloadedOptimizer.load_state_dict converts state tables as torch converts
    bs = full_batches(4)
    a = make_off(0)
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    train(a, oa, bs[:2])
    sd = copy.deepcopy(oa.state_dict())
    sd["tables"] = [{k: v.double() for k, v in t.items()} for t in sd["tables"]]
    b = make_off(0)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    b.load_state_dict(a.state_dict())
    ob.load_state_dict(sd)
    for k, v in ob.state_dict()["tables"][0].items():
        assert v.dtype == torch.float32
        assert torch.equal(v, oa.state_dict()["tables"][0][k])
    train(a, oa, bs[2:])
    train(b, ob, bs[2:])
    assert_models_equal(a, b)


def test_state_dict_is_a_snapshot_holding_full_state_tables():
    m = make_off(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adagrad, m, lr=0.1, initial_accumulator_value=0.25)
    ids = torch.tensor([1, 3, 3])
    loss_of(m, ids, torch.ones(3)).backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["tables"] and set(sd["tables"][0]) == {"sum"}
    s = sd["tables"][0]["sum"]
    assert s.shape == (N, D) and s.device.type == "cpu"
    untouched = [i for i in range(N) if i not in (1, 3)]
    assert torch.all(s[untouched] == 0.25), (
        "rows never looked up keep Adagrad's initial accumulator"
    )
    assert torch.all(s[[1, 3]] > 0.25)


# ------------------------------------------------------------------ param_groups editing


def test_lr_edit_in_param_groups_reaches_tables_and_dense_params():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for i, (ids, y) in enumerate(full_batches(4)):
        if i == 2:
            for g in opt.param_groups:
                g["lr"] = 0.3
            for g in ropt.param_groups:
                g["lr"] = 0.3
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ropt.zero_grad()
        loss_of(ref, ids, y).backward()
        ropt.step()
    assert_models_equal(off, ref, "after lr edit")


def test_weight_decay_edit_with_lazy_rows():
    w, hw, hb = _weights(0)
    off = torch.nn.ModuleDict({"emb": _emb(w), "head": _head(hw, hb)})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1, momentum=0.9)
    ref = LazyRef(torch.optim.SGD, w, hw, hb, lr=0.1, momentum=0.9)
    for i, (ids, y) in enumerate(partial_batches(5)):
        if i == 2:
            opt.param_groups[0]["weight_decay"] = 0.5
            ref.opt.param_groups[0]["weight_decay"] = 0.5
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ref.step(ids, y)
    ref.assert_matches(off, "weight decay edit")
    never = list(range(N // 2 + 2, N))
    assert torch.equal(table(off["emb"])[never], w[never]), "rows never looked up must not decay"


def test_lazy_rows_keep_values_and_state_with_adam_weight_decay():
    w, hw, hb = _weights(0)
    off = torch.nn.ModuleDict({"emb": _emb(w), "head": _head(hw, hb)})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05, weight_decay=0.1)
    ref = LazyRef(torch.optim.Adam, w, hw, hb, lr=0.05, weight_decay=0.1)
    bs = [
        (torch.tensor([0, 2, 2]), torch.ones(3)),
        (torch.tensor([5, 0]), -torch.ones(2)),
        (torch.tensor([2]), torch.ones(1)),
    ]
    for ids, y in bs:
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ref.step(ids, y)
    ref.assert_matches(off, "lazy Adam")
    st = opt.state_dict()["tables"][0]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(st[k], ref.full[k]), k
        assert torch.all(st[k][[1, 3, 4] + list(range(6, N))] == 0)


# ------------------------------------------------------------------ LR schedulers


def _run_with_scheduler(cls, kw, make_sched, batches, metrics=None):
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    ropt = cls(ref.parameters(), **kw)
    s, rs = make_sched(opt), make_sched(ropt)
    lrs = []
    for i, (ids, y) in enumerate(batches):
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ropt.zero_grad()
        loss_of(ref, ids, y).backward()
        ropt.step()
        if metrics is None:
            s.step()
            rs.step()
        else:
            s.step(metrics[i])
            rs.step(metrics[i])
        lrs.append((opt.param_groups[0]["lr"], ropt.param_groups[0]["lr"]))
    return off, ref, opt, ropt, lrs


def test_steplr_matches_dense_reference():
    off, ref, _, _, lrs = _run_with_scheduler(
        torch.optim.Adam,
        dict(lr=0.1),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5),
        full_batches(5),
    )
    assert [a for a, _ in lrs] == [b for _, b in lrs]
    assert lrs[-1][0] == pytest.approx(0.025)
    assert_models_equal(off, ref, "StepLR")


def test_onecycle_turning_sgd_momentum_on_matches_dense_reference():
    # SGD built without momentum; OneCycleLR turns it on before the first step
    off, ref, opt, _, _ = _run_with_scheduler(
        torch.optim.SGD,
        dict(lr=0.1),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=6),
        full_batches(5),
    )
    assert opt.param_groups[0]["momentum"] > 0
    assert "momentum_buffer" in opt.state_dict()["tables"][0]
    assert_models_equal(off, ref, "OneCycleLR SGD")


def test_onecycle_with_adam_betas_matches_dense_reference():
    off, ref, _, _, _ = _run_with_scheduler(
        torch.optim.Adam,
        dict(lr=0.1),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=6),
        full_batches(5),
    )
    assert_models_equal(off, ref, "OneCycleLR Adam")


@pytest.mark.parametrize(
    "cls, kw",
    [
        pytest.param(torch.optim.Rprop, dict(lr=0.02), id="Rprop"),
        pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=1), id="ASGD"),
        pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
    ],
)
def test_lambdalr_warmup_matches_dense_reference(cls, kw):
    # README: before the first step Rprop's step_size and ASGD's eta start from the
    # first step's lr (here a warm-up lr set by the scheduler at construction)
    off, ref, _, _, _ = _run_with_scheduler(
        cls,
        kw,
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: (e + 1) / 4),
        full_batches(5),
    )
    assert_models_equal(off, ref, f"LambdaLR {cls.__name__}")


def test_reduce_lr_on_plateau_matches_dense_reference():
    off, ref, opt, _, lrs = _run_with_scheduler(
        torch.optim.Adagrad,
        dict(lr=0.2),
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
        full_batches(5),
        metrics=[1.0, 1.0, 1.0, 0.5, 0.5],
    )
    assert opt.param_groups[0]["lr"] < 0.2, "the plateau must have reduced lr"
    assert [a for a, _ in lrs] == [b for _, b in lrs]
    assert_models_equal(off, ref, "ReduceLROnPlateau")


def test_steplr_with_lazy_per_row_updates():
    w, hw, hb = _weights(0)
    off = torch.nn.ModuleDict({"emb": _emb(w), "head": _head(hw, hb)})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.1)
    ref = LazyRef(torch.optim.Adam, w, hw, hb, lr=0.1)
    s = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.3)
    rs = torch.optim.lr_scheduler.StepLR(ref.opt, 2, gamma=0.3)
    for ids, y in partial_batches(6):
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ref.step(ids, y)
        s.step()
        rs.step()
    ref.assert_matches(off, "StepLR lazy")
    assert torch.equal(opt.state_dict()["tables"][0]["exp_avg"], ref.full["exp_avg"])


def test_scheduler_and_optimizer_resume_together(tmp_path):
    bs = full_batches(6)
    a = make_off(0)
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.1)
    sa = torch.optim.lr_scheduler.StepLR(oa, 2, gamma=0.5)
    train(a, oa, bs[:3], sched=sa)
    torch.save({"m": a.state_dict(), "o": oa.state_dict(), "s": sa.state_dict()}, tmp_path / "c.pt")
    ck = torch.load(tmp_path / "c.pt", weights_only=True)
    b = make_off(3)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.1)
    sb = torch.optim.lr_scheduler.StepLR(ob, 2, gamma=0.5)
    b.load_state_dict(ck["m"])
    ob.load_state_dict(ck["o"])
    sb.load_state_dict(ck["s"])
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"]
    train(a, oa, bs[3:], sched=sa)
    train(b, ob, bs[3:], sched=sb)
    assert_models_equal(a, b, "scheduler resume")
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"]


def test_state_a_scheduler_turned_on_loads_into_an_optimizer_without_it():
    # README: a state dict holding state the optimizer has not turned on yet (a
    # scheduler's momentum) loads, and that state is paged from then on
    bs = full_batches(6)
    a = make_off(0)
    oa = gl.OffloadedOptimizer(torch.optim.SGD, a, lr=0.1)
    sa = torch.optim.lr_scheduler.OneCycleLR(oa, max_lr=0.3, total_steps=10)
    train(a, oa, bs[:3], sched=sa)
    saved = roundtrip({"m": a.state_dict(), "o": oa.state_dict()})
    assert "momentum_buffer" in saved["o"]["tables"][0]
    b = make_off(0)
    ob = gl.OffloadedOptimizer(torch.optim.SGD, b, lr=0.1)  # momentum 0: no buffer table yet
    b.load_state_dict(saved["m"])
    ob.load_state_dict(saved["o"])
    assert ob.param_groups[0]["momentum"] == oa.param_groups[0]["momentum"] > 0
    train(a, oa, bs[3:])  # no further scheduler steps on either side
    train(b, ob, bs[3:])
    assert_models_equal(a, b, "momentum turned on by a scheduler, then resumed")
    assert_sd_equal(roundtrip(oa.state_dict())["tables"], roundtrip(ob.state_dict())["tables"])


# ------------------------------------------------------------------ add_param_group


def _two_table_pair(seed=0):
    w, hw, hb = _weights(seed)
    w2 = _weights(seed + 100, n=8)[0]
    off = torch.nn.ModuleDict({"emb": _emb(w), "head": _head(hw, hb), "emb2": _emb(w2)})
    ref = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding.from_pretrained(w.clone(), freeze=False),
            "head": _head(hw, hb),
            "emb2": torch.nn.Embedding.from_pretrained(w2.clone(), freeze=False),
        }
    )
    return off, ref


def _loss2(m, ids, ids2, y):
    return (m["head"](torch.tanh(m["emb"](ids)) + m["emb2"](ids2)).squeeze(-1) - y).pow(2).mean()


def _batches2(k, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ids = torch.cat([torch.randperm(N, generator=g), torch.randint(0, N, (4,), generator=g)])
        ids2 = torch.cat([torch.randperm(8, generator=g), torch.randint(0, 8, (8,), generator=g)])
        out.append((ids, ids2, torch.randn(16, generator=g)))
    return out


def test_add_param_group_table_later_matches_dense_reference():
    off, ref = _two_table_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, [off["emb"], off["head"]], lr=0.05)
    ropt = torch.optim.Adam([ref["emb"].weight, *ref["head"].parameters()], lr=0.05)
    for i, (ids, ids2, y) in enumerate(_batches2(5)):
        if i == 2:
            opt.add_param_group({"params": off["emb2"], "lr": 0.2})
            ropt.add_param_group({"params": [ref["emb2"].weight], "lr": 0.2})
        opt.zero_grad()
        _loss2(off, ids, ids2, y).backward()
        opt.step()
        ropt.zero_grad()
        _loss2(ref, ids, ids2, y).backward()
        ropt.step()
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.2
    assert opt.param_groups[1]["betas"] == (0.9, 0.999), "defaults fill the new group"
    # emb2 was trained (by the dense twin too) only from step 2, with fresh state
    assert_models_equal(off, ref, "after add_param_group")


def test_add_param_group_then_state_dict_round_trip():
    bs = _batches2(5)
    a, _ = _two_table_pair()
    oa = gl.OffloadedOptimizer(torch.optim.Adam, [a["emb"], a["head"]], lr=0.05)
    oa.add_param_group({"params": a["emb2"], "lr": 0.2})
    for ids, ids2, y in bs[:2]:
        oa.zero_grad()
        _loss2(a, ids, ids2, y).backward()
        oa.step()
    saved = roundtrip({"m": a.state_dict(), "o": oa.state_dict()})
    b, _ = _two_table_pair(seed=9)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, [b["emb"], b["head"]], lr=0.05)
    ob.add_param_group({"params": b["emb2"], "lr": 0.9})
    b.load_state_dict(saved["m"])
    ob.load_state_dict(saved["o"])
    assert ob.param_groups[1]["lr"] == 0.2
    for o, m in ((oa, a), (ob, b)):
        for ids, ids2, y in bs[2:]:
            o.zero_grad()
            _loss2(m, ids, ids2, y).backward()
            o.step()
    assert_models_equal(a, b, "two groups resumed")


def test_add_param_group_with_a_table_already_in_the_optimizer_is_refused():
    m = make_off(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    train(m, opt, full_batches(1))
    snap = snapshot(m, opt)
    with pytest.raises(gl.GadgetValueError):
        opt.add_param_group({"params": m["emb"], "lr": 0.3})
    assert len(opt.param_groups) == 1
    assert_unchanged(m, opt, snap)


def test_state_dict_of_two_groups_into_one_group_optimizer_is_refused_unchanged():
    a, _ = _two_table_pair()
    oa = gl.OffloadedOptimizer(torch.optim.Adam, [a["emb"], a["head"]], lr=0.05)
    oa.add_param_group({"params": a["emb2"], "lr": 0.2})
    sd = roundtrip(oa.state_dict())
    b = make_off(0)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    train(b, ob, full_batches(1))
    snap = snapshot(b, ob)
    with pytest.raises(gl.GadgetError) as ei:
        ob.load_state_dict(sd)
    assert isinstance(ei.value, ValueError)
    assert_unchanged(b, ob, snap)


# ------------------------------------------------------------------ zero_grad


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_discards_lookups_and_step_leaves_tables_alone(set_to_none):
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(list(ref["head"].parameters()), lr=0.05)
    ids, y = full_batches(1)[0]
    train(off, opt, [(ids, y)])
    loss_of(ref, ids, y).backward()
    ropt.step()
    t_before = table(off["emb"])
    st_before = copy.deepcopy(opt.state_dict()["tables"])

    def table_steps():
        return {
            k: float(v["step"])
            for k, v in opt.state_dict()["inner"]["state"].items()
            if set(v) == {"step"}
        }

    steps_before = table_steps()
    assert list(steps_before.values()) == [1.0], steps_before

    loss_of(off, ids, y).backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in off["head"].parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    opt.step()
    ropt.zero_grad(set_to_none=set_to_none)
    ropt.step()
    assert torch.equal(table(off["emb"]), t_before), (
        "a step after zero_grad must not move the table"
    )
    assert_sd_equal(st_before, opt.state_dict()["tables"], "state tables")
    assert table_steps() == steps_before, "the table's step count must not move (README)"
    for p, q in zip(off["head"].parameters(), ref["head"].parameters(), strict=False):
        assert torch.equal(p, q), "dense parameters follow torch's zero_grad semantics"


def test_zero_grad_between_backwards_keeps_only_the_later_gradient():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    (i1, y1), (i2, y2) = full_batches(2)
    loss_of(off, i1, y1).backward()
    opt.zero_grad()
    loss_of(off, i2, y2).backward()
    opt.step()
    ropt.zero_grad()
    loss_of(ref, i2, y2).backward()
    ropt.step()
    assert_models_equal(off, ref, "zero_grad between backwards")


def test_table_step_count_moves_only_for_looked_up_tables():
    off, _ = _two_table_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)

    def steps():
        return sorted(
            float(v["step"]) for v in opt.state_dict()["inner"]["state"].values() if "step" in v
        )

    # only emb is looked up: emb2's table must not count steps
    for _ in range(3):
        opt.zero_grad()
        loss_of(off, torch.arange(N), torch.zeros(N)).backward()
        opt.step()
    assert steps().count(3.0) >= 3, steps()  # head weight, head bias, emb
    st2 = opt.state_dict()["tables"]
    assert any(torch.count_nonzero(t["exp_avg"]) == 0 for t in st2), (
        "emb2's state must stay untouched"
    )


# ------------------------------------------------------------------ hooks


def test_step_pre_and_post_hooks_run_around_the_paged_step():
    m = make_off(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    seen = []
    t0 = table(m["emb"])

    def pre(o, args, kwargs):
        seen.append(("pre", o is opt, torch.equal(table(m["emb"]), t0)))

    def post(o, args, kwargs):
        seen.append(("post", o is opt, torch.equal(table(m["emb"]), t0)))

    h1 = opt.register_step_pre_hook(pre)
    h2 = opt.register_step_post_hook(post)
    train(m, opt, full_batches(1))
    assert seen == [("pre", True, True), ("post", True, False)], seen
    h1.remove()
    h2.remove()
    train(m, opt, full_batches(1, seed=5))
    assert len(seen) == 2, "removed hooks must not run"


def test_step_pre_hook_changing_lr_applies_to_the_tables():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)

    def pre(o, args, kwargs):
        for g in o.param_groups:
            g["lr"] = 0.4

    _h = opt.register_step_pre_hook(pre)
    _rh = ropt.register_step_pre_hook(pre)
    for ids, y in full_batches(3):
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ropt.zero_grad()
        loss_of(ref, ids, y).backward()
        ropt.step()
    assert_models_equal(off, ref, "lr set in a step pre-hook")


def test_global_step_hooks_see_the_wrapper_and_the_wrapped_optimizer():
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    m = make_off(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    pre, post = [], []
    h1 = register_optimizer_step_pre_hook(lambda o, a, k: pre.append(type(o)))
    h2 = register_optimizer_step_post_hook(lambda o, a, k: post.append(type(o)))
    try:
        train(m, opt, full_batches(1))
    finally:
        h1.remove()
        h2.remove()
    assert gl.OffloadedOptimizer in pre and torch.optim.Adam in pre, pre
    assert gl.OffloadedOptimizer in post and torch.optim.Adam in post, post


def test_state_dict_and_load_state_dict_hooks_run_as_torch_runs_them():
    bs = full_batches(4)
    a = make_off(0)
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    calls = []
    _h1 = oa.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))

    def sd_post(o, sd):
        calls.append("sd_post")
        sd = dict(sd)
        sd["my_extra"] = torch.tensor(7)
        return sd

    _h2 = oa.register_state_dict_post_hook(sd_post)
    train(a, oa, bs[:2])
    sd = roundtrip(oa.state_dict())
    assert calls == ["sd_pre", "sd_post"] and int(sd["my_extra"]) == 7

    b = make_off(0)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    got = []

    def ld_pre(o, sd):
        got.append(int(sd["my_extra"]))
        sd = dict(sd)
        del sd["my_extra"]
        return sd

    _h3 = ob.register_load_state_dict_pre_hook(ld_pre)
    _h4 = ob.register_load_state_dict_post_hook(lambda o: got.append("post"))
    b.load_state_dict(a.state_dict())
    ob.load_state_dict(sd)
    assert got == [7, "post"]
    train(a, oa, bs[2:])
    train(b, ob, bs[2:])
    assert_models_equal(a, b, "round trip through hooks")


# ------------------------------------------------------------------ closure, clipping


def test_step_with_closure_returns_loss_with_grad_enabled():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    ids, y = full_batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = loss_of(off, ids, y)
        loss.backward()
        return loss

    with torch.no_grad():
        out = opt.step(closure)
    ropt.zero_grad()
    rl = loss_of(ref, ids, y)
    rl.backward()
    ropt.step()
    assert torch.equal(out.detach(), rl.detach())
    assert_models_equal(off, ref, "closure step")


def _ordered_ref_params(opt, off, ref):
    """The dense twin's parameters in the order of the optimizer's group."""
    dense = {id(p): name for name, p in off.named_parameters()}
    refp = dict(ref.named_parameters())
    out = []
    for p in opt.param_groups[0]["params"]:
        out.append(refp[dense[id(p)]] if id(p) in dense else ref["emb"].weight)
    return out


@pytest.mark.parametrize("how", ["norm", "value"])
def test_gradient_clipping_over_param_groups_matches_dense_reference(how):
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5, momentum=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.5)
    norms = []
    for ids, y in full_batches(3):
        opt.zero_grad()
        (10 * loss_of(off, ids, y)).backward()
        ps = [p for g in opt.param_groups for p in g["params"]]
        assert len(ps) == 3, "the table's rows join the groups after a backward"
        rps = _ordered_ref_params(opt, off, ref)
        ropt.zero_grad()
        (10 * loss_of(ref, ids, y)).backward()
        if how == "norm":
            n1 = torch.nn.utils.clip_grad_norm_(ps, 0.5)
            n2 = torch.nn.utils.clip_grad_norm_(rps, 0.5)
            norms.append((n1, n2))
        else:
            torch.nn.utils.clip_grad_value_(ps, 0.01)
            torch.nn.utils.clip_grad_value_(rps, 0.01)
        opt.step()
        ropt.step()
    for n1, n2 in norms:
        assert torch.equal(n1, n2) and n1 > 0.5
    assert_models_equal(off, ref, f"clip_grad_{how}")


def test_gradient_accumulation_with_groups_read_between_micro_batches():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    (i1, y1), (i2, y2) = full_batches(2)
    opt.zero_grad()
    loss_of(off, i1, y1).backward()
    _ = [p for g in opt.param_groups for p in g["params"]]  # merges the first micro-batch
    loss_of(off, i2, y2).backward()
    opt.prepare_grads()
    opt.step()
    ropt.zero_grad()
    loss_of(ref, i1, y1).backward()
    loss_of(ref, i2, y2).backward()
    ropt.step()
    assert_models_equal(
        off,
        ref,
        "accumulation",
    )


# ------------------------------------------------------------------ mixed models, two optimizers


def test_embedding_bag_embedding_and_dense_layer_in_one_optimizer():
    w, hw, hb = _weights(0)
    wb = _weights(50, n=10)[0]
    bag = gl.OffloadedEmbeddingBag(10, D, mode="mean", placement="cpu", device="cpu")
    bag.weight.insertData(wb.clone(), torch.arange(10))
    off = torch.nn.ModuleDict({"emb": _emb(w), "bag": bag, "head": _head(hw, hb)})
    ref = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding.from_pretrained(w.clone(), freeze=False),
            "bag": torch.nn.EmbeddingBag.from_pretrained(wb.clone(), freeze=False, mode="mean"),
            "head": _head(hw, hb),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.RMSprop, off, lr=0.01, momentum=0.3)
    ropt = torch.optim.RMSprop(ref.parameters(), lr=0.01, momentum=0.3)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randperm(N, generator=g)
        hist = torch.cat(
            [torch.randperm(10, generator=g), torch.randint(0, 10, (14,), generator=g)]
        ).view(N, 2)
        y = torch.randn(N, generator=g)
        for m, o in ((off, opt), (ref, ropt)):
            o.zero_grad()
            pred = m["head"](torch.tanh(m["emb"](ids)) * m["bag"](hist)).squeeze(-1)
            F.mse_loss(pred, y).backward()
            o.step()
    assert_models_equal(off, ref, "bag + embedding + linear")


def test_offloaded_optimizer_for_tables_and_torch_optimizer_for_dense_part():
    off, ref = make_pair(0)
    o1 = gl.OffloadedOptimizer(torch.optim.Adagrad, off["emb"], lr=0.1)
    o2 = torch.optim.SGD(off["head"].parameters(), lr=0.1, momentum=0.9)
    r1 = torch.optim.Adagrad(ref["emb"].parameters(), lr=0.1)
    r2 = torch.optim.SGD(ref["head"].parameters(), lr=0.1, momentum=0.9)
    for ids, y in full_batches(4):
        for m, opts in ((off, (o1, o2)), (ref, (r1, r2))):
            for o in opts:
                o.zero_grad()
            loss_of(m, ids, y).backward()
            for o in opts:
                o.step()
    assert_models_equal(off, ref, "two optimizers")


def test_two_offloaded_optimizers_over_two_tables_resume_together():
    bs = _batches2(5)

    def build(seed):
        m, _ = _two_table_pair(seed)
        o1 = gl.OffloadedOptimizer(torch.optim.Adam, [m["emb"], m["head"]], lr=0.05)
        o2 = gl.OffloadedOptimizer(torch.optim.SGD, m["emb2"], lr=0.1, momentum=0.9)
        return m, o1, o2

    def run(m, o1, o2, batches):
        for ids, ids2, y in batches:
            o1.zero_grad()
            o2.zero_grad()
            _loss2(m, ids, ids2, y).backward()
            o1.step()
            o2.step()

    a, a1, a2 = build(0)
    run(a, a1, a2, bs[:2])
    saved = roundtrip({"m": a.state_dict(), "o1": a1.state_dict(), "o2": a2.state_dict()})
    b, b1, b2 = build(4)
    b.load_state_dict(saved["m"])
    b1.load_state_dict(saved["o1"])
    b2.load_state_dict(saved["o2"])
    run(a, a1, a2, bs[2:])
    run(b, b1, b2, bs[2:])
    assert_models_equal(a, b, "two offloaded optimizers")
    # the two optimizers' states cannot be swapped
    snap = snapshot(b, b2)
    with pytest.raises(gl.GadgetError):
        b2.load_state_dict(roundtrip(b1.state_dict()))
    assert_unchanged(b, b2, snap)


def test_a_table_already_owned_by_an_optimizer_is_refused():
    m = make_off(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    snap = snapshot(m, opt)
    with pytest.raises(gl.GadgetValueError, match="already belongs"):
        gl.OffloadedOptimizer(torch.optim.SGD, m["emb"], lr=0.1)
    assert_unchanged(m, opt, snap)
    train(m, opt, full_batches(1))
    assert not torch.equal(table(m["emb"]), snap["model"]["emb.weight"])


def test_two_param_group_dicts_naming_the_same_table_are_refused():
    m = make_off(0)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(
            torch.optim.Adam, [{"params": m["emb"]}, {"params": m["emb"], "lr": 1.0}], lr=0.1
        )
    # nothing was taken: a correct optimizer may still be built over the table
    _opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    assert len(_opt.param_groups) == 1


# ------------------------------------------------------------------ bad states


def _trained(cls=torch.optim.Adam, seed=0, n=N, d=D, **kw):
    kw = kw or dict(lr=0.05)
    m = make_off(seed, n, d)
    opt = gl.OffloadedOptimizer(cls, m, **kw)
    train(m, opt, full_batches(2, n=n))
    return m, opt


def _refused(target_m, target_o, sd, exc=gl.GadgetError, match=None):
    snap = snapshot(target_m, target_o)
    with pytest.raises(exc, match=match) as ei:
        target_o.load_state_dict(sd)
    assert_unchanged(target_m, target_o, snap)
    return ei.value


@pytest.mark.parametrize("other", [torch.optim.NAdam, torch.optim.SGD, torch.optim.Adagrad])
def test_state_of_another_optimizer_class_is_refused_unchanged(other):
    _, oa = _trained(torch.optim.Adam)
    sd = roundtrip(oa.state_dict())
    b, ob = _trained(other, lr=0.05)
    err = _refused(b, ob, sd, gl.GadgetValueError)
    msg = str(err)
    assert "Adam" in msg and other.__name__ in msg, msg
    # still trains as an untouched twin does
    c, oc = _trained(other, lr=0.05)
    train(b, ob, full_batches(2, seed=9))
    train(c, oc, full_batches(2, seed=9))
    assert_models_equal(b, c, "after a refused load")


@pytest.mark.parametrize("n, d", [(N + 3, D), (N, D + 1)])
def test_state_of_another_table_shape_is_refused_unchanged(n, d):
    _, oa = _trained(n=n, d=d)
    sd = roundtrip(oa.state_dict())
    b, ob = _trained()
    err = _refused(b, ob, sd, gl.GadgetValueError)
    msg = str(err)
    assert str(n if n != N else d) in msg and str(N if n != N else D) in msg, (
        f"the error should say the expected and the given shape: {msg}"
    )


def test_state_table_of_wrong_shape_with_other_param_group_options_changes_nothing():
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    sd["inner"]["param_groups"][0]["lr"] = 123.0
    sd["tables"][0]["exp_avg_sq"] = sd["tables"][0]["exp_avg_sq"][:-1]
    b, ob = _trained()
    _refused(b, ob, sd, gl.GadgetValueError)
    assert ob.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize(
    "damage",
    [
        "no_tables",
        "no_inner",
        "no_state_table",
        "unknown_optimizer_name",
        "empty_tables",
        "extra_table",
        "no_param_groups",
        "missing_param_id",
        "state_table_not_tensor",
        "tables_not_list",
    ],
)
def test_state_dict_with_missing_or_extra_entries_is_refused_unchanged(damage):
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    if damage == "no_tables":
        del sd["tables"]
    elif damage == "no_inner":
        del sd["inner"]
    elif damage == "no_state_table":
        del sd["tables"][0]["exp_avg"]
    elif damage == "unknown_optimizer_name":
        sd["optimizer"] = "mypackage.optim.Foo"
        sd.pop("optimizer_base", None)
    elif damage == "state_table_not_tensor":
        sd["tables"][0]["exp_avg"] = sd["tables"][0]["exp_avg"].tolist()
    elif damage == "tables_not_list":
        sd["tables"] = sd["tables"][0]
    elif damage == "empty_tables":
        sd["tables"] = []
    elif damage == "extra_table":
        sd["tables"].append(copy.deepcopy(sd["tables"][0]))
    elif damage == "no_param_groups":
        del sd["inner"]["param_groups"]
    elif damage == "missing_param_id":
        sd["inner"]["param_groups"][0]["params"] = sd["inner"]["param_groups"][0]["params"][:-1]
    b, ob = _trained()
    err = _refused(b, ob, sd)
    assert isinstance(err, (ValueError, KeyError, TypeError))
    assert len(str(err)) > 15


@pytest.mark.parametrize("bad", [None, [1, 2], "state", 3])
def test_load_state_dict_of_a_non_dict_is_a_type_error(bad):
    b, ob = _trained()
    err = _refused(b, ob, bad, gl.GadgetTypeError)
    assert "dict" in str(err).lower(), str(err)


def test_plain_torch_optimizer_state_dict_is_refused_unchanged():
    off, ref = make_pair(0)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    train(ref, ropt, full_batches(1))
    sd = roundtrip(ropt.state_dict())
    b, ob = _trained()
    err = _refused(b, ob, sd)
    assert isinstance(err, (ValueError, KeyError))


def test_integer_state_table_is_refused_unchanged():
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    sd["tables"][0]["exp_avg"] = torch.zeros(N, D, dtype=torch.int64)
    b, ob = _trained()
    _refused(b, ob, sd, gl.GadgetTypeError)


def test_state_of_a_model_with_more_tables_is_refused_unchanged():
    a, _ = _two_table_pair()
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    sd = roundtrip(oa.state_dict())
    b, ob = _trained()
    _refused(b, ob, sd, gl.GadgetValueError)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_optimizer_itself_cannot_be_copied_or_pickled(how):
    m = make_off(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    with pytest.raises(gl.GadgetTypeError, match="state_dict"):
        if how == "deepcopy":
            copy.deepcopy(opt)
        elif how == "pickle":
            pickle.dumps(opt)
        else:
            torch.save(opt, io.BytesIO())


# ------------------------------------------------------------------ switchers


class _SwModel(torch.nn.Module):
    def __init__(self, hw, hb):
        super().__init__()
        self.u = torch.nn.Embedding(N, D)
        self.head = _head(hw, hb)

    def forward(self, local):
        return self.head(torch.tanh(self.u(local))).squeeze(-1)


def _switched(seed=0, cls=torch.optim.Adam, **kw):
    w, hw, hb = _weights(seed)
    model = _SwModel(hw, hb)
    sw = gl.ModelSwitch(model.u, N, D, placement="cpu")
    sw.customInit(lambda t: t.copy_(w))
    optimizer = cls(model.parameters(), **kw)
    osw = gl.OptimizerSwitch(optimizer, N, D, model, "u", placement="cpu")
    osw.optInit()
    return w, hw, hb, model, sw, optimizer, osw


def _sw_step(model, sw, optimizer, osw, ids, y):
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    loss = (model(local) - y).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)


def test_switchers_with_steplr_match_dense_reference():
    w, hw, hb, model, sw, optimizer, osw = _switched(lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    ref = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding.from_pretrained(w.clone(), freeze=False), "head": _head(hw, hb)}
    )
    ropt = torch.optim.Adam(ref.parameters(), lr=0.1)
    rs = torch.optim.lr_scheduler.StepLR(ropt, 2, gamma=0.5)
    for ids, y in full_batches(5):
        _sw_step(model, sw, optimizer, osw, ids, y)
        sched.step()
        ropt.zero_grad()
        loss_of(ref, ids, y).backward()
        ropt.step()
        rs.step()
    got = torch.from_numpy(sw.getNumpyVersion())
    assert torch.equal(got, ref["emb"].weight.detach()), (got - ref["emb"].weight).abs().max()
    for p, q in zip(model.head.parameters(), ref["head"].parameters(), strict=False):
        assert torch.equal(p, q)
    st = osw.getNumpyVersion()
    rst = ropt.state[ref["emb"].weight]
    assert torch.equal(torch.from_numpy(st["exp_avg"]), rst["exp_avg"])


def test_switchers_checkpoint_resume_is_bit_identical(tmp_path):
    bs = full_batches(5)
    _, _, _, ma, swa, oa, osa = _switched(0, lr=0.05)
    for ids, y in bs[:2]:
        _sw_step(ma, swa, oa, osa, ids, y)
    gl.save_checkpoint(tmp_path / "ck", {"u": swa, "u_opt": osa, "opt": oa, "model": ma})
    _, _, _, mb, swb, ob, osb = _switched(6, lr=0.5)
    gl.load_checkpoint(tmp_path / "ck", {"u": swb, "u_opt": osb, "opt": ob, "model": mb})
    assert ob.param_groups[0]["lr"] == 0.05
    for ids, y in bs[2:]:
        _sw_step(ma, swa, oa, osa, ids, y)
        _sw_step(mb, swb, ob, osb, ids, y)
    assert torch.equal(
        torch.from_numpy(swa.getNumpyVersion()), torch.from_numpy(swb.getNumpyVersion())
    )
    for k, v in osa.getNumpyVersion().items():
        assert (v == osb.getNumpyVersion()[k]).all(), k
    for p, q in zip(ma.head.parameters(), mb.head.parameters(), strict=False):
        assert torch.equal(p, q)


def test_switchers_checkpoint_of_another_optimizer_class_is_refused_unchanged(tmp_path):
    _, _, _, ma, swa, oa, osa = _switched(0, lr=0.05)
    for ids, y in full_batches(1):
        _sw_step(ma, swa, oa, osa, ids, y)
    gl.save_checkpoint(tmp_path / "ck", {"u": swa, "u_opt": osa, "opt": oa, "model": ma})
    _, _, _, mb, swb, ob, osb = _switched(6, cls=torch.optim.Adagrad, lr=0.5)
    t0, s0 = swb.getNumpyVersion().copy(), {k: v.copy() for k, v in osb.getNumpyVersion().items()}
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(tmp_path / "ck", {"u": swb, "u_opt": osb, "opt": ob, "model": mb})
    assert (swb.getNumpyVersion() == t0).all()
    for k, v in osb.getNumpyVersion().items():
        assert (v == s0[k]).all()
    assert ob.param_groups[0]["lr"] == 0.5


def test_optimizer_switch_save_load_torch_round_trip_and_wrong_shape_refused(tmp_path):
    _, _, _, ma, swa, oa, osa = _switched(0, lr=0.05)
    for ids, y in full_batches(2):
        _sw_step(ma, swa, oa, osa, ids, y)
    osa.saveTorch(tmp_path / "st.pt")
    saved = torch.load(tmp_path / "st.pt", weights_only=True)
    assert set(saved) == {"exp_avg", "exp_avg_sq"}
    _, _, _, mb, swb, ob, osb = _switched(3, lr=0.05)
    osb.loadTorch(tmp_path / "st.pt")
    for k, v in osa.getNumpyVersion().items():
        assert (v == osb.getNumpyVersion()[k]).all(), k
    bad = {k: v[:-1].clone() for k, v in saved.items()}
    torch.save(bad, tmp_path / "bad.pt")
    before = {k: v.copy() for k, v in osb.getNumpyVersion().items()}
    with pytest.raises(gl.GadgetValueError) as ei:
        osb.loadTorch(tmp_path / "bad.pt")
    assert str(N) in str(ei.value) and str(N - 1) in str(ei.value), str(ei.value)
    for k, v in osb.getNumpyVersion().items():
        assert (v == before[k]).all(), k


# ------------------------------------------------------------------ more lazy references


def _warm(o):
    return torch.optim.lr_scheduler.LambdaLR(o, lambda e: (e + 1) / 4)


LAZY_CASES = [
    pytest.param(torch.optim.Rprop, dict(lr=0.02), _warm, {"step_size": 0.005}, id="Rprop-warmup"),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=1), _warm, None, id="ASGD-warmup"),
    pytest.param(
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.3),
        None,
        {"sum": 0.3},
        id="Adagrad-iav",
    ),
    pytest.param(
        torch.optim.RMSprop, dict(lr=0.01, centered=True, momentum=0.5), None, None, id="RMSprop"
    ),
    pytest.param(
        torch.optim.SGD,
        dict(lr=0.1),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=8),
        None,
        id="SGD-OneCycle",
    ),
    pytest.param(torch.optim.AdamW, dict(lr=0.05, amsgrad=True), None, None, id="AdamW-amsgrad"),
    pytest.param(torch.optim.NAdam, dict(lr=0.05), None, None, id="NAdam"),
    pytest.param(torch.optim.RAdam, dict(lr=0.05, weight_decay=0.1), None, None, id="RAdam"),
    pytest.param(torch.optim.Adamax, dict(lr=0.05), None, None, id="Adamax"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0), None, None, id="Adadelta"),
    pytest.param(
        torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), None, None, id="SGD-nesterov"
    ),
]


@pytest.mark.parametrize("cls, kw, sched, fills", LAZY_CASES)
def test_lazy_per_row_updates_match_reference_with_rows_seen_late(cls, kw, sched, fills):
    # rows first looked up after several steps start from the state torch gives a
    # fresh parameter (Rprop's step_size from the first step's lr), step counts per table
    w, hw, hb = _weights(0)
    off = torch.nn.ModuleDict({"emb": _emb(w), "head": _head(hw, hb)})
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    ref = LazyRef(cls, w, hw, hb, fills=fills, **kw)
    s = sched(opt) if sched else None
    rs = sched(ref.opt) if sched else None
    for ids, y in partial_batches(6):
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ref.step(ids, y)
        if s is not None:
            s.step()
            rs.step()
    ref.assert_matches(off, cls.__name__)
    for k, v in opt.state_dict()["tables"][0].items():
        assert torch.equal(v, ref.full[k]), k


def test_momentum_turned_on_by_hand_mid_training_lazy():
    w, hw, hb = _weights(0)
    off = torch.nn.ModuleDict({"emb": _emb(w), "head": _head(hw, hb)})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)
    ref = LazyRef(torch.optim.SGD, w, hw, hb, lr=0.1)
    for i, (ids, y) in enumerate(partial_batches(6)):
        if i == 2:
            opt.param_groups[0]["momentum"] = 0.9
            ref.opt.param_groups[0]["momentum"] = 0.9
        opt.zero_grad()
        loss_of(off, ids, y).backward()
        opt.step()
        ref.step(ids, y)
    ref.assert_matches(off, "momentum on by hand")
    assert "momentum_buffer" in opt.state_dict()["tables"][0]


def test_cycliclr_turning_momentum_on_matches_dense_reference():
    off, ref, opt, _, _ = _run_with_scheduler(
        torch.optim.SGD,
        dict(lr=0.1),
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.3, step_size_up=2),
        full_batches(5),
    )
    assert_models_equal(off, ref, "CyclicLR")


def test_tensor_lr_matches_dense_reference_and_round_trips():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=torch.tensor(0.05))
    ropt = torch.optim.Adam(ref.parameters(), lr=torch.tensor(0.05))
    bs = full_batches(4)
    for ids, y in bs[:2]:
        for m, o in ((off, opt), (ref, ropt)):
            o.zero_grad()
            loss_of(m, ids, y).backward()
            o.step()
    saved = roundtrip({"m": off.state_dict(), "o": opt.state_dict()})
    b = make_off(5)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=torch.tensor(0.5))
    b.load_state_dict(saved["m"])
    ob.load_state_dict(saved["o"])
    for ids, y in bs[2:]:
        for m, o in ((off, opt), (ref, ropt), (b, ob)):
            o.zero_grad()
            loss_of(m, ids, y).backward()
            o.step()
    assert_models_equal(off, ref, "tensor lr")
    assert_models_equal(off, b, "tensor lr resumed")


def test_float64_model_resume_and_dense_reference():
    off, ref = make_pair(0, dtype=torch.float64)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    bs = [(i, y.double()) for i, y in full_batches(4)]
    train(off, opt, bs[:2])
    train(ref, ropt, bs[:2])
    saved = roundtrip({"m": off.state_dict(), "o": opt.state_dict()})
    assert saved["o"]["tables"][0]["exp_avg"].dtype == torch.float64
    b = make_pair(3, dtype=torch.float64)[0]
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    b.load_state_dict(saved["m"])
    ob.load_state_dict(saved["o"])
    for m, o in ((off, opt), (ref, ropt), (b, ob)):
        train(m, o, bs[2:])
    assert_models_equal(off, ref, "float64")
    assert_models_equal(off, b, "float64 resumed")


def test_load_state_dict_while_a_lookup_waits_for_its_step():
    # docstring: this optimizer's own load_state_dict is taken then; the next step
    # starts from the loaded state
    bs = full_batches(4)
    a = make_off(0)
    oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    train(a, oa, bs[:2])
    saved = roundtrip({"m": a.state_dict(), "o": oa.state_dict()})
    b = make_off(0)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    b.load_state_dict(saved["m"])
    ids, y = bs[2]
    ob.zero_grad()
    loss_of(b, ids, y).backward()
    ob.load_state_dict(saved["o"])
    ob.step()
    train(a, oa, [bs[2]])
    assert_models_equal(a, b, "load between backward and step")


def test_grad_scaler_skips_inf_steps_and_matches_dense_reference():
    try:
        sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        rsc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    except (AttributeError, RuntimeError, TypeError) as e:  # pragma: no cover - old torch
        pytest.skip(f"no CPU GradScaler here: {e}")
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for i, (ids, y) in enumerate(full_batches(4)):
        if i == 1:
            y = y * float("inf")
            t_before = table(off["emb"])
        for m, o, s in ((off, opt, sc), (ref, ropt, rsc)):
            o.zero_grad()
            s.scale(loss_of(m, ids, y)).backward()
            s.step(o)
            s.update()
        if i == 1:
            assert torch.equal(table(off["emb"]), t_before), (
                "an inf step must be skipped for the tables"
            )
    assert sc.get_scale() == rsc.get_scale() < 2.0**10
    assert_models_equal(off, ref, "GradScaler")


def test_step_pre_hook_that_raises_leaves_the_step_to_be_done_again():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    ids, y = full_batches(1)[0]
    loss_of(off, ids, y).backward()
    t0 = table(off["emb"])

    def bad(o, a, k):
        raise RuntimeError("boom")

    h = opt.register_step_pre_hook(bad)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    h.remove()
    assert torch.equal(table(off["emb"]), t0)
    opt.step()
    loss_of(ref, ids, y).backward()
    ropt.step()
    assert_models_equal(off, ref, "step after a raising pre-hook")


def test_load_post_hook_sees_loaded_state_and_the_given_dict_is_not_mutated():
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    keep = copy.deepcopy(sd)
    b, ob = _trained(seed=3)
    seen = []
    _h = ob.register_load_state_dict_post_hook(lambda o: seen.append(copy.deepcopy(o.state_dict())))
    ob.load_state_dict(sd)
    assert_sd_equal(keep, sd, "the caller's dict")
    assert_sd_equal(keep, roundtrip(seen[0]), "state seen by the post hook")


def test_group_dict_giving_a_table_its_own_options_matches_dense_reference_and_resumes():
    off, ref = make_pair(0)
    opt = gl.OffloadedOptimizer(
        torch.optim.Adam, [{"params": off["emb"], "lr": 0.2, "weight_decay": 0.3}, off], lr=0.05
    )
    ropt = torch.optim.Adam(
        [
            {"params": ref["emb"].parameters(), "lr": 0.2, "weight_decay": 0.3},
            {"params": ref["head"].parameters()},
        ],
        lr=0.05,
    )
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.05]
    bs = full_batches(4)
    train(off, opt, bs[:2])
    train(ref, ropt, bs[:2])
    saved = roundtrip({"m": off.state_dict(), "o": opt.state_dict()})
    b = make_off(2)
    ob = gl.OffloadedOptimizer(torch.optim.Adam, [{"params": b["emb"], "lr": 1.0}, b], lr=1.0)
    b.load_state_dict(saved["m"])
    ob.load_state_dict(saved["o"])
    assert [g["lr"] for g in ob.param_groups] == [0.2, 0.05]
    for m, o in ((off, opt), (ref, ropt), (b, ob)):
        train(m, o, bs[2:])
    assert_models_equal(off, ref, "table group options")
    assert_models_equal(off, b, "table group options resumed")


# ------------------------------------------------------------------ bad states: beyond the tables


def _head2_state():
    """State of an optimizer over the same table but a Linear(D, 2) head."""
    w = _weights(0)[0]
    m = torch.nn.ModuleDict({"emb": _emb(w), "head": torch.nn.Linear(D, 2)})
    o = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)
    o.zero_grad()
    m["head"](m["emb"](torch.arange(N))).sum().backward()
    o.step()
    return m, o


def test_state_of_a_model_whose_dense_layer_has_another_shape_is_refused_unchanged():
    # docstring: "same model structure and optimizer class; anything else is refused
    # before any state changes"; README: load_state_dict checks shapes before changing any
    _, o2 = _head2_state()
    sd = roundtrip(o2.state_dict())
    b, ob = _trained(seed=3)
    _refused(b, ob, sd, gl.GadgetValueError)


def test_checkpoint_of_a_model_whose_dense_layer_has_another_shape_is_refused_unchanged(tmp_path):
    _, o2 = _head2_state()
    gl.save_checkpoint(tmp_path / "ck", {"optimizer": o2})
    b, ob = _trained(seed=3)
    snap = snapshot(b, ob)
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(tmp_path / "ck", {"optimizer": ob})
    assert_unchanged(b, ob, snap)


def test_inner_state_that_is_not_a_dict_is_a_clear_gadget_error():
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    sd["inner"] = [1, 2]
    b, ob = _trained(seed=3)
    err = _refused(b, ob, sd, Exception)
    assert isinstance(err, gl.GadgetError), f"{type(err).__name__}: {err}"


def test_param_group_missing_an_option_is_refused_unchanged():
    # a saved param group without 'lr' is a missing entry; accepting it leaves an
    # optimizer whose next step() raises KeyError('lr')
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    del sd["inner"]["param_groups"][0]["lr"]
    b, ob = _trained(seed=3)
    _refused(b, ob, sd, gl.GadgetError)


def test_param_group_with_a_non_number_lr_does_not_break_state_dict():
    # torch itself takes such a dict, but its state_dict() keeps working; here either
    # the load must refuse it or state_dict() must still answer
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    sd["inner"]["param_groups"][0]["lr"] = "fast"
    b, ob = _trained(seed=3)
    snap = snapshot(b, ob)
    try:
        ob.load_state_dict(sd)
    except gl.GadgetError:
        assert_unchanged(b, ob, snap)
        return
    out = ob.state_dict()  # raised GadgetTypeError: "could not build a Adam like the given one"
    assert out["inner"]["param_groups"][0]["lr"] == "fast"


def test_state_table_whose_copy_fails_leaves_everything_unchanged():
    # a sparse state table has the right shape and dtype but cannot be copied into the
    # dense store: the load must fail as a GadgetError with nothing changed
    _, oa = _trained()
    sd = roundtrip(oa.state_dict())
    sd["tables"][0]["exp_avg_sq"] = sd["tables"][0]["exp_avg_sq"].to_sparse()
    b, ob = _trained(seed=3)
    snap = snapshot(b, ob)
    with pytest.raises(Exception) as ei:
        ob.load_state_dict(sd)
    problems = []
    if not isinstance(ei.value, gl.GadgetError):
        problems.append(f"raised {type(ei.value).__name__}: {ei.value}")
    try:
        assert_unchanged(b, ob, snap)
    except AssertionError as e:
        problems.append(f"state changed by the failed load: {e}")
    assert not problems, problems


# ------------------------------------------------------------------ switchers, more


def test_switchers_checkpoint_with_scheduler_momentum_into_switchers_built_before(tmp_path):
    bs = full_batches(6)
    _, _, _, ma, swa, oa, osa = _switched(0, cls=torch.optim.SGD, lr=0.1)
    sa = torch.optim.lr_scheduler.OneCycleLR(oa, max_lr=0.3, total_steps=10)
    for ids, y in bs[:3]:
        _sw_step(ma, swa, oa, osa, ids, y)
        sa.step()
    assert "momentum_buffer" in osa.getNumpyVersion()
    gl.save_checkpoint(tmp_path / "ck", {"u": swa, "u_opt": osa, "opt": oa, "model": ma})
    _, _, _, mb, swb, ob, osb = _switched(6, cls=torch.optim.SGD, lr=0.1)  # momentum 0
    gl.load_checkpoint(tmp_path / "ck", {"u": swb, "u_opt": osb, "opt": ob, "model": mb})
    assert ob.param_groups[0]["momentum"] == oa.param_groups[0]["momentum"] > 0
    for ids, y in bs[3:]:
        _sw_step(ma, swa, oa, osa, ids, y)
        _sw_step(mb, swb, ob, osb, ids, y)
    assert (swa.getNumpyVersion() == swb.getNumpyVersion()).all()
    assert (
        osa.getNumpyVersion()["momentum_buffer"] == osb.getNumpyVersion()["momentum_buffer"]
    ).all()


def test_switchers_rprop_with_warmup_match_dense_reference_without_a_warmup_step():
    w, hw, hb, model, sw, optimizer, osw = _switched(0, cls=torch.optim.Rprop, lr=0.02)
    sched = _warm(optimizer)
    ref = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding.from_pretrained(w.clone(), freeze=False), "head": _head(hw, hb)}
    )
    ropt = torch.optim.Rprop(ref.parameters(), lr=0.02)
    rs = _warm(ropt)
    for ids, y in full_batches(4):
        _sw_step(model, sw, optimizer, osw, ids, y)
        sched.step()
        ropt.zero_grad()
        loss_of(ref, ids, y).backward()
        ropt.step()
        rs.step()
    assert torch.equal(torch.from_numpy(sw.getNumpyVersion()), ref["emb"].weight.detach())
    assert torch.equal(
        torch.from_numpy(osw.getNumpyVersion()["step_size"]),
        ropt.state[ref["emb"].weight]["step_size"],
    )


def test_optimizer_switch_load_torch_layouts_and_refusals(tmp_path):
    _, _, _, ma, swa, oa, osa = _switched(0, lr=0.05)
    for ids, y in full_batches(2):
        _sw_step(ma, swa, oa, osa, ids, y)
    st = osa.getNumpyVersion()
    torch.save(
        [torch.from_numpy(st["exp_avg"]), torch.from_numpy(st["exp_avg_sq"])], tmp_path / "list.pt"
    )
    _, _, _, mb, swb, ob, osb = _switched(3, lr=0.05)
    osb.loadTorch(tmp_path / "list.pt")  # SpeedTorch's list in state order
    for k in st:
        assert (osb.getNumpyVersion()[k] == st[k]).all(), k
    before = copy.deepcopy(osb.getNumpyVersion())
    bad = {
        "int": {"exp_avg": torch.zeros(N, D, dtype=torch.int32), "exp_avg_sq": torch.zeros(N, D)},
        "missing": {"exp_avg": torch.zeros(N, D)},
        "extra": {
            "exp_avg": torch.zeros(N, D),
            "exp_avg_sq": torch.zeros(N, D),
            "bogus": torch.zeros(N, D),
        },
    }
    for name, obj in bad.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        with pytest.raises(gl.GadgetError) as ei:
            osb.loadTorch(tmp_path / f"{name}.pt")
        assert isinstance(ei.value, (TypeError, ValueError)), name
        for k in st:
            assert (osb.getNumpyVersion()[k] == before[k]).all(), (name, k)
    # refused while a step is under way (its write-back would undo the load)
    ids = torch.arange(N)
    swb.beforeForwardPass(ids)
    osb.beforeForwardPass(ids)
    with pytest.raises(gl.GadgetValueError):
        osb.loadTorch(tmp_path / "list.pt")
