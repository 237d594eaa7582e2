"""Black-box review (session 32) of training with the offloaded embedding / optimizer
paths (OffloadedEmbedding, OffloadedEmbeddingBag, OffloadedOptimizer, ModelSwitch /
OptimizerSwitch, ModelFactory / OptimizerFactory) combined with ordinary torch features
(param groups, LR schedulers, weight decay, momentum / nesterov, maximize, amsgrad,
foreach, gradient clipping, zero_grad modes, padding_idx, EmbeddingBag modes, repeated
ids, optimizer state_dict round trips); written from README.md, SPEC.md and the public
docstrings only.

Reference: the README promises results "bit-identical to a dense ``nn.Embedding`` trained
the same way on the rows a step looks up", with lazy per-row updates ("rows a step does
not look up keep their values and optimizer state", "one step count per table as in
torch's SparseAdam").  ``LazyRef`` below is exactly that: a full dense table and full
per-row state tables in plain torch; each step a fresh ``nn.Parameter`` holding the
step's distinct rows is trained by the very same torch optimizer class / options, its
state rows gathered from and written back to the full state tables.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


N_A, N_B, DIM = 50, 40, 8
B = 6  # batch rows


# --------------------------------------------------------------------------- reference


class LazyRef:
    """Plain-torch lazy reference: full tables + full row-state tables, one step count
    (and other scalar state) per table, a fresh parameter of the step's distinct rows."""

    def __init__(self, opt_cls, groups, tables, **kw):
        # groups: list of dicts with "tables": [names] and/or "dense": [params] + options
        self.W = {k: v.detach().clone() for k, v in tables.items()}
        self.state = {k: {} for k in tables}
        self.pos = {}
        self.placeholder = {}
        tgroups = []
        for gi, g in enumerate(groups):
            params = []
            for name in g.get("tables", []):
                ph = nn.Parameter(torch.zeros(1, self.W[name].shape[1], dtype=self.W[name].dtype))
                self.placeholder[name] = ph
                self.pos[name] = (gi, len(params))
                params.append(ph)
            params += list(g.get("dense", []))
            opts = {k: v for k, v in g.items() if k not in ("tables", "dense")}
            tgroups.append({"params": params, **opts})
        self.opt_cls = opt_cls
        self.kw = kw
        self.opt = opt_cls(tgroups, **kw)
        self.P = {}
        self.U = {}

    def begin(self, lookups):
        """lookups: name -> list of id tensors. Returns name -> list of local ids."""
        out = {}
        self.P, self.U = {}, {}
        for name, idss in lookups.items():
            flat = torch.cat([i.reshape(-1) for i in idss])
            U, inv = torch.unique(flat, sorted=True, return_inverse=True)
            P = nn.Parameter(self.W[name][U].clone())
            locs, o = [], 0
            for i in idss:
                locs.append(inv[o : o + i.numel()].reshape(i.shape))
                o += i.numel()
            out[name] = locs
            self.P[name], self.U[name] = P, U
            gi, j = self.pos[name]
            self.opt.param_groups[gi]["params"][j] = P
            st = self.state[name]
            if st:
                self.opt.state[P] = {
                    k: (
                        v[U].clone()
                        if torch.is_tensor(v) and v.dim() == 2
                        else (v.clone() if torch.is_tensor(v) else v)
                    )
                    for k, v in st.items()
                }
            elif self.opt_cls is torch.optim.Adagrad:
                iav = self.kw.get("initial_accumulator_value", 0.0)
                self.opt.state[P] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(P.detach(), iav),
                }
        return out

    def step(self):
        self.opt.step()
        for name, P in self.P.items():
            U = self.U[name]
            self.W[name][U] = P.detach()
            st = self.opt.state.pop(P, {})
            full = self.state[name]
            for k, v in st.items():
                if torch.is_tensor(v) and v.shape == P.shape:
                    if k not in full:
                        init = 0.0
                        if self.opt_cls is torch.optim.Adagrad and k == "sum":
                            init = self.kw.get("initial_accumulator_value", 0.0)
                        if self.opt_cls is torch.optim.Rprop and k == "step_size":
                            # torch fills step_size with the first step's lr
                            init = self.opt.param_groups[self.pos[name][0]]["lr"]
                        full[k] = torch.full_like(self.W[name], init)
                    full[k][U] = v.detach()
                elif v is not None:
                    full[k] = v.clone() if torch.is_tensor(v) else v
            gi, j = self.pos[name]
            self.opt.param_groups[gi]["params"][j] = self.placeholder[name]
        self.P, self.U = {}, {}

    def all_params(self):
        return [p for g in self.opt.param_groups for p in g["params"]]


def lib_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def table(mod):
    return torch.as_tensor(mod.weight.getNumpyVersion()).clone()


def make_emb(W0, cls=gl.OffloadedEmbedding, **kw):
    m = cls(W0.shape[0], W0.shape[1], placement="cpu", device="cpu", **kw)
    m.load_state_dict({"weight": W0.clone()})
    return m


def gen_ids(step, n, shape, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    ids = torch.randint(0, n, shape, generator=g)
    # force repeats inside every batch
    ids.view(-1)[1] = ids.view(-1)[0]
    ids.view(-1)[-1] = ids.view(-1)[0]
    return ids


def gen_y(step, n=B):
    return torch.randn(n, generator=torch.Generator().manual_seed(77 + step))


# optimizer configurations: id -> (class, kwargs)
OPT_CONFIGS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_mom": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_mom_wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.5, weight_decay=0.05)),
    "sgd_maximize": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, maximize=True)),
    "sgd_foreach": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    "sgd_noforeach": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=False)),
    "adam": (torch.optim.Adam, dict(lr=0.05)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=0.05, amsgrad=True)),
    "adam_wd": (torch.optim.Adam, dict(lr=0.05, weight_decay=0.1)),
    "adam_maximize": (torch.optim.Adam, dict(lr=0.05, maximize=True)),
    "adam_foreach": (torch.optim.Adam, dict(lr=0.05, foreach=True, amsgrad=True)),
    "adam_noforeach": (torch.optim.Adam, dict(lr=0.05, foreach=False, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
    "adamw_amsgrad_max": (torch.optim.AdamW, dict(lr=0.05, amsgrad=True, maximize=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.01, lr_decay=0.01)),
    "adagrad_iav": (torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.5)),
    "rmsprop_mc": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
    "rmsprop_wd_foreach": (torch.optim.RMSprop, dict(lr=0.01, weight_decay=0.1, foreach=True)),
    "adamax": (torch.optim.Adamax, dict(lr=0.05, weight_decay=0.01)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0, weight_decay=0.01)),
    "nadam": (torch.optim.NAdam, dict(lr=0.05)),
    "radam": (torch.optim.RAdam, dict(lr=0.05, weight_decay=0.01)),
    "adagrad_max": (torch.optim.Adagrad, dict(lr=0.1, maximize=True, foreach=True)),
    "rmsprop_max": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, maximize=True)),
    "adadelta_max": (torch.optim.Adadelta, dict(lr=1.0, maximize=True)),
    "adamax_max_foreach": (torch.optim.Adamax, dict(lr=0.05, maximize=True, foreach=True)),
    "nadam_wd_foreach": (
        torch.optim.NAdam,
        dict(lr=0.05, weight_decay=0.05, foreach=True, decoupled_weight_decay=True),
    ),
    "rprop": (torch.optim.Rprop, dict(lr=0.01, step_sizes=(1e-4, 1.0))),
    "asgd": (torch.optim.ASGD, dict(lr=0.05, t0=1, weight_decay=0.01)),
}


# --------------------------------------------------------------------------- A: one table


def _run_single(opt_cls, kw, steps=5, clip=None, set_to_none=True, sched=None, hook=None):
    torch.manual_seed(0)
    W0 = torch.randn(N_A, DIM)
    head = nn.Linear(DIM, 1)
    head_ref = copy.deepcopy(head)
    emb = make_emb(W0)
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = gl.OffloadedOptimizer(opt_cls, model, **kw)
    ref = LazyRef(
        opt_cls, [{"tables": ["emb"], "dense": list(head_ref.parameters())}], {"emb": W0}, **kw
    )
    sch = sched(opt) if sched else None
    rsch = sched(ref.opt) if sched else None
    touched = set()
    for s in range(steps):
        if hook:
            hook(s, opt)
            hook(s, ref.opt)
        ids = gen_ids(s, 20 if s % 2 else N_A, (B, 3))  # odd steps stay in rows < 20
        touched |= set(ids.view(-1).tolist())
        y = gen_y(s)
        out = emb(ids)
        loss = F.mse_loss(head(out.sum(1)).squeeze(-1), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(lib_params(opt), clip)
        opt.step()

        (loc,) = ref.begin({"emb": [ids]})["emb"]
        rout = F.embedding(loc, ref.P["emb"])
        torch.testing.assert_close(out.detach(), rout.detach())
        rloss = F.mse_loss(head_ref(rout.sum(1)).squeeze(-1), y)
        ref.opt.zero_grad(set_to_none=set_to_none)
        rloss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.all_params(), clip)
        ref.step()
        if sch:
            sch.step()
            rsch.step()
            assert opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]
    return W0, emb, head, ref, head_ref, touched, opt


@pytest.mark.parametrize("cfg", list(OPT_CONFIGS))
def test_single_table_matches_lazy_reference(cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    W0, emb, head, ref, head_ref, touched, _opt = _run_single(opt_cls, kw)
    # README: bit-identical for float32 tables with torch's default (for-each) kernels
    torch.testing.assert_close(table(emb), ref.W["emb"], rtol=0, atol=0)
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(head.bias.detach(), head_ref.bias.detach(), rtol=0, atol=0)
    untouched = sorted(set(range(N_A)) - touched)
    assert untouched, "test setup: some rows must stay untouched"
    assert torch.equal(table(emb)[untouched], W0[untouched])


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam_amsgrad", "adamw", "rmsprop_mc", "adagrad"])
@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_single_table_clip_grad_norm_over_param_groups(cfg, clip):
    opt_cls, kw = OPT_CONFIGS[cfg]
    W0, emb, head, ref, head_ref, _t, _opt = _run_single(opt_cls, kw, clip=clip)
    torch.testing.assert_close(table(emb), ref.W["emb"])
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach())


def test_clip_actually_changes_result():
    """Sanity of the clip tests: a tight clip must change the trained table."""
    opt_cls, kw = OPT_CONFIGS["sgd_mom"]
    a = _run_single(opt_cls, kw, clip=0.05)[1]
    b = _run_single(opt_cls, kw, clip=None)[1]
    assert not torch.allclose(table(a), table(b))


def test_clip_grad_norm_returns_reference_norm():
    """The norm clip_grad_norm_ returns over opt.param_groups includes the table rows."""
    torch.manual_seed(0)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    head = nn.Linear(DIM, 1)
    head_ref = copy.deepcopy(head)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, nn.ModuleDict({"e": emb, "h": head}), lr=0.1)
    ids = gen_ids(0, N_A, (B, 3))
    y = gen_y(0)
    F.mse_loss(head(emb(ids).sum(1)).squeeze(-1), y).backward()
    n = torch.nn.utils.clip_grad_norm_(lib_params(opt), 1e9)
    P = nn.Parameter(W0.clone())
    F.mse_loss(head_ref(F.embedding(ids, P).sum(1)).squeeze(-1), y).backward()
    rn = torch.nn.utils.clip_grad_norm_([P, *head_ref.parameters()], 1e9)
    torch.testing.assert_close(n, rn)


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam", "adamw_amsgrad_max", "rmsprop_mc"])
def test_single_table_zero_grad_set_to_none_false(cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    W0, emb, head, ref, head_ref, _t, _opt = _run_single(opt_cls, kw, set_to_none=False)
    torch.testing.assert_close(table(emb), ref.W["emb"])
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach())


# --------------------------------------------------------------------------- whole-table twins


@pytest.mark.parametrize("foreach", [None, True, False])
def test_plain_sgd_whole_table_matches_dense_embedding(foreach):
    """README: plain SGD ... there the whole table matches (a dense nn.Embedding)."""
    torch.manual_seed(1)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    dense = nn.Embedding(N_A, DIM)
    with torch.no_grad():
        dense.weight.copy_(W0)
    kw = dict(lr=0.3, foreach=foreach)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, **kw)
    dopt = torch.optim.SGD(dense.parameters(), **kw)
    for s in range(4):
        ids = gen_ids(s, N_A, (B, 4))
        y = torch.randn(B, 4, DIM, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        ((emb(ids) - y) ** 2).sum().backward()
        opt.step()
        dopt.zero_grad()
        ((dense(ids) - y) ** 2).sum().backward()
        dopt.step()
    torch.testing.assert_close(table(emb), dense.weight.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("opt_name", ["SparseAdam", "Adagrad", "SGD"])
def test_sparse_embedding_twin_whole_table(opt_name):
    """README: updates are lazy, as torch's SparseAdam makes them; a sparse nn.Embedding
    trained by the same optimizer is the dense twin for the whole table."""
    torch.manual_seed(2)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    twin = nn.Embedding(N_A, DIM, sparse=True)
    with torch.no_grad():
        twin.weight.copy_(W0)
    cls = getattr(torch.optim, opt_name)
    kw = {"SparseAdam": dict(lr=0.05), "Adagrad": dict(lr=0.2, lr_decay=0.01), "SGD": dict(lr=0.2)}[
        opt_name
    ]
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    topt = cls(list(twin.parameters()), **kw)
    for s in range(5):
        ids = gen_ids(s, 25 if s % 2 else N_A, (B, 3))
        y = torch.randn(B, 3, DIM, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        ((emb(ids) - y) ** 2).sum().backward()
        opt.step()
        topt.zero_grad()
        ((twin(ids) - y) ** 2).sum().backward()
        topt.step()
    torch.testing.assert_close(table(emb), twin.weight.detach())


# --------------------------------------------------------------------------- repeated ids


@pytest.mark.parametrize("pattern", ["all_same", "pairs", "one_distinct_per_row", "dup_heavy"])
@pytest.mark.parametrize("cfg", ["sgd", "adam"])
def test_repeated_ids_exact(pattern, cfg):
    ids = {
        "all_same": torch.full((4, 5), 7),
        "pairs": torch.tensor([[1, 1, 2, 2], [3, 3, 1, 1]]),
        "one_distinct_per_row": torch.tensor([[5, 5, 5], [9, 9, 9], [5, 5, 5]]),
        "dup_heavy": torch.tensor([[0, 49, 0, 49, 0], [49, 49, 0, 0, 13]]),
    }[pattern]
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(3)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    opt = gl.OffloadedOptimizer(opt_cls, emb, **kw)
    ref = LazyRef(opt_cls, [{"tables": ["e"]}], {"e": W0}, **kw)
    w = torch.randn(*ids.shape, DIM, generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        (loc,) = ref.begin({"e": [ids]})["e"]
        (F.embedding(loc, ref.P["e"]) * w).sum().backward()
        ref.step()
    torch.testing.assert_close(table(emb), ref.W["e"])
    # with plain SGD the repeated ids' gradients add up exactly: table = W0 - lr*sum(w)
    if cfg == "sgd":
        expect = W0.clone()
        for _ in range(3):
            expect.index_add_(0, ids.reshape(-1), -0.1 * w.reshape(-1, DIM))
        torch.testing.assert_close(table(emb), expect)


def test_several_lookups_and_accumulation_match_reference():
    """A table looked up twice in a step and over two backward passes (accumulation)."""
    opt_cls, kw = torch.optim.Adam, dict(lr=0.05, weight_decay=0.01)
    torch.manual_seed(4)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    opt = gl.OffloadedOptimizer(opt_cls, emb, **kw)
    ref = LazyRef(opt_cls, [{"tables": ["e"]}], {"e": W0}, **kw)
    for s in range(3):
        c = gen_ids(s, N_A, (B,), seed=1)
        ctx = gen_ids(s, N_A, (B, 2), seed=2)
        neg = gen_ids(s, N_A, (B, 3), seed=3)
        opt.zero_grad()
        (emb(c).unsqueeze(1) * emb(ctx)).sum().backward()
        (emb(c).unsqueeze(1) * emb(neg)).sigmoid().sum().backward()
        opt.step()
        lc1, lx, lc2, ln = ref.begin({"e": [c, ctx, c, neg]})["e"]
        P = ref.P["e"]
        (F.embedding(lc1, P).unsqueeze(1) * F.embedding(lx, P)).sum().backward()
        (F.embedding(lc2, P).unsqueeze(1) * F.embedding(ln, P)).sigmoid().sum().backward()
        ref.step()
    torch.testing.assert_close(table(emb), ref.W["e"])


# --------------------------------------------------------------------------- B: groups + schedulers


def _bag_batch(step, n=N_B, nbags=B, seed=9, empty_bag=False):
    g = torch.Generator().manual_seed(seed * 100 + step)
    lens = torch.randint(1, 4, (nbags,), generator=g)
    if empty_bag:
        lens[2] = 0
    inp = torch.randint(0, n, (int(lens.sum()),), generator=g)
    if inp.numel() > 2:
        inp[1] = inp[0]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    psw = torch.rand(inp.shape, generator=g) + 0.5
    return inp, offsets, psw


SCHEDS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "none": None,
}


def _run_multi(
    opt_cls,
    kw,
    sched="none",
    clip=None,
    bag_mode="sum",
    steps=5,
    set_to_none=True,
    skip_b_at=(3,),
    psw=True,
):
    torch.manual_seed(10)
    Wa, Wb = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    head = nn.Linear(DIM, 1)
    head_ref = copy.deepcopy(head)
    model = nn.ModuleDict(
        {
            "a": make_emb(Wa),
            "b": make_emb(Wb, cls=gl.OffloadedEmbeddingBag, mode=bag_mode),
            "head": head,
        }
    )
    g_a = {"lr": kw["lr"] * 2.0}
    g_b = {"lr": kw["lr"] * 0.5}
    g_h = {"lr": kw["lr"]}
    if "weight_decay" in kw:
        g_b["weight_decay"] = kw["weight_decay"] * 3
    opt = gl.OffloadedOptimizer(
        opt_cls,
        [
            {"params": model["a"], **g_a},
            {"params": model["b"], **g_b},
            {"params": model["head"].parameters(), **g_h},
        ],
        **kw,
    )
    ref = LazyRef(
        opt_cls,
        [
            {"tables": ["a"], **g_a},
            {"tables": ["b"], **g_b},
            {"dense": list(head_ref.parameters()), **g_h},
        ],
        {"a": Wa, "b": Wb},
        **kw,
    )
    sch = SCHEDS[sched](opt) if SCHEDS[sched] else None
    rsch = SCHEDS[sched](ref.opt) if SCHEDS[sched] else None
    use_psw = psw and bag_mode == "sum"
    for s in range(steps):
        ids = gen_ids(s, N_A, (B, 3))
        inp, offs, w = _bag_batch(s)
        y = gen_y(s)
        use_b = s not in skip_b_at
        xa = model["a"](ids).mean(1)
        if use_b:
            xb = model["b"](inp, offs, per_sample_weights=w if use_psw else None)
            x = xa * xb
        else:
            x = xa
        loss = F.mse_loss(head(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(lib_params(opt), clip)
        opt.step()
        if sch:
            sch.step()

        look = {"a": [ids]}
        if use_b:
            look["b"] = [inp]
        locs = ref.begin(look)
        rxa = F.embedding(locs["a"][0], ref.P["a"]).mean(1)
        if use_b:
            rxb = F.embedding_bag(
                locs["b"][0],
                ref.P["b"],
                offs,
                mode=bag_mode,
                per_sample_weights=w if use_psw else None,
            )
            torch.testing.assert_close(xb.detach(), rxb.detach())
            rx = rxa * rxb
        else:
            rx = rxa
        rloss = F.mse_loss(head_ref(rx).squeeze(-1), y)
        ref.opt.zero_grad(set_to_none=set_to_none)
        rloss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.all_params(), clip)
        ref.step()
        if rsch:
            rsch.step()
    return model, opt, ref, head_ref, Wb


MULTI_CFGS = ["sgd_nesterov", "sgd_mom_wd", "adam_amsgrad", "adamw", "rmsprop_mc", "adagrad"]


@pytest.mark.parametrize("sched", ["step", "lambda"])
@pytest.mark.parametrize("cfg", MULTI_CFGS)
def test_groups_with_scheduler(cfg, sched):
    opt_cls, kw = OPT_CONFIGS[cfg]
    model, opt, ref, head_ref, _ = _run_multi(opt_cls, kw, sched=sched)
    torch.testing.assert_close(table(model["a"]), ref.W["a"])
    torch.testing.assert_close(table(model["b"]), ref.W["b"])
    torch.testing.assert_close(model["head"].weight.detach(), head_ref.weight.detach())
    # the lr the scheduler set is what the groups hold
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx(
        sorted(g["lr"] for g in ref.opt.param_groups)
    )


@pytest.mark.parametrize("cfg", ["sgd_nesterov", "adam_amsgrad", "adamw"])
def test_groups_with_scheduler_and_clip(cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    model, opt, ref, head_ref, _ = _run_multi(opt_cls, kw, sched="step", clip=0.1)
    torch.testing.assert_close(table(model["a"]), ref.W["a"])
    torch.testing.assert_close(table(model["b"]), ref.W["b"])
    torch.testing.assert_close(model["head"].bias.detach(), head_ref.bias.detach())


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("cfg", ["sgd_mom", "adam", "adagrad"])
def test_unused_table_not_stepped(cfg, set_to_none):
    """A table with no lookup since the last step is not stepped and its step count does
    not move, also with zero_grad(set_to_none=False); the dense head still follows torch."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    model, opt, ref, head_ref, _ = _run_multi(
        opt_cls, kw, set_to_none=set_to_none, skip_b_at=(1, 2, 3), steps=6
    )
    torch.testing.assert_close(table(model["a"]), ref.W["a"])
    torch.testing.assert_close(table(model["b"]), ref.W["b"])
    torch.testing.assert_close(model["head"].weight.detach(), head_ref.weight.detach())


def test_table_untouched_during_skipped_steps_exact():
    opt_cls, kw = OPT_CONFIGS["adam_wd"]
    model, opt, ref, _h, Wb = _run_multi(opt_cls, kw, skip_b_at=(0, 1, 2, 3, 4))
    assert torch.equal(table(model["b"]), Wb)


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam"])
def test_scheduler_changes_lr_of_every_group(cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    model, opt, _ref, _h, _ = _run_multi(opt_cls, kw, sched="step", steps=4)
    # StepLR(step_size=2, gamma=0.3) after 4 steps: factor 0.09
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs == pytest.approx(
        sorted([kw["lr"] * 2 * 0.09, kw["lr"] * 0.5 * 0.09, kw["lr"] * 0.09])
    )


def test_lr_change_by_hand_between_steps_reaches_tables():
    """Setting group['lr'] = 0 between steps freezes the table rows of that group."""
    torch.manual_seed(0)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    ids = torch.tensor([1, 2, 3])
    emb(ids).sum().backward()
    opt.step()
    after1 = table(emb)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.zero_grad()
    emb(ids).sum().backward()
    opt.step()
    assert torch.equal(table(emb), after1)
    torch.testing.assert_close(after1[1:4], W0[1:4] - 0.5)


# --------------------------------------------------------------------------- C: EmbeddingBag


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("form", ["offsets", "offsets_last", "2d", "offsets_empty_bag"])
@pytest.mark.parametrize("cfg", ["sgd_mom", "adam_wd"])
def test_embedding_bag_modes(mode, form, cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(20)
    W0 = torch.randn(N_B, DIM)
    include_last = form == "offsets_last"
    bag = make_emb(W0, cls=gl.OffloadedEmbeddingBag, mode=mode, include_last_offset=include_last)
    opt = gl.OffloadedOptimizer(opt_cls, bag, **kw)
    ref = LazyRef(opt_cls, [{"tables": ["b"]}], {"b": W0}, **kw)
    for s in range(4):
        target = torch.randn(B, DIM, generator=torch.Generator().manual_seed(s))
        if form == "2d":
            inp = gen_ids(s, N_B, (B, 3))
            offs = None
        else:
            inp, offs, _w = _bag_batch(s, empty_bag=form == "offsets_empty_bag")
            if include_last:
                offs = torch.cat([offs, torch.tensor([inp.numel()])])
        out = bag(inp) if offs is None else bag(inp, offs)
        opt.zero_grad()
        ((out - target) ** 2).sum().backward()
        opt.step()
        (loc,) = ref.begin({"b": [inp]})["b"]
        rout = F.embedding_bag(
            loc, ref.P["b"], offs, mode=mode, include_last_offset=include_last and offs is not None
        )
        torch.testing.assert_close(out.detach(), rout.detach())
        ((rout - target) ** 2).sum().backward()
        ref.step()
    torch.testing.assert_close(table(bag), ref.W["b"])


@pytest.mark.parametrize("form", ["offsets", "2d"])
@pytest.mark.parametrize("cfg", ["sgd", "adam_amsgrad", "rmsprop_mc"])
def test_embedding_bag_per_sample_weights(form, cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(21)
    W0 = torch.randn(N_B, DIM)
    bag = make_emb(W0, cls=gl.OffloadedEmbeddingBag, mode="sum")
    opt = gl.OffloadedOptimizer(opt_cls, bag, **kw)
    ref = LazyRef(opt_cls, [{"tables": ["b"]}], {"b": W0}, **kw)
    for s in range(4):
        target = torch.randn(B, DIM, generator=torch.Generator().manual_seed(s))
        if form == "2d":
            inp = gen_ids(s, N_B, (B, 3))
            offs = None
            w = torch.rand(B, 3, generator=torch.Generator().manual_seed(s)) + 0.5
        else:
            inp, offs, w = _bag_batch(s)
        out = bag(inp, offs, per_sample_weights=w)
        opt.zero_grad()
        ((out - target) ** 2).sum().backward()
        opt.step()
        (loc,) = ref.begin({"b": [inp]})["b"]
        rout = F.embedding_bag(loc, ref.P["b"], offs, mode="sum", per_sample_weights=w)
        torch.testing.assert_close(out.detach(), rout.detach())
        ((rout - target) ** 2).sum().backward()
        ref.step()
    torch.testing.assert_close(table(bag), ref.W["b"])


def test_embedding_bag_psw_gradient_reaches_weights():
    """per_sample_weights that require grad get torch's gradient."""
    torch.manual_seed(22)
    W0 = torch.randn(N_B, DIM)
    bag = make_emb(W0, cls=gl.OffloadedEmbeddingBag, mode="sum")
    _opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=0.1)
    inp, offs, w = _bag_batch(0)
    w1 = w.clone().requires_grad_(True)
    w2 = w.clone().requires_grad_(True)
    bag(inp, offs, per_sample_weights=w1).pow(2).sum().backward()
    # (a reference weight that requires grad: torch 2.4 asserts on per_sample_weights that
    # require grad over a weight that does not)
    W_ref = W0.clone().requires_grad_(True)
    F.embedding_bag(inp, W_ref, offs, mode="sum", per_sample_weights=w2).pow(2).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_dense_twin_plain_sgd(mode):
    """Plain SGD: the whole table equals a dense nn.EmbeddingBag trained the same way."""
    torch.manual_seed(23)
    W0 = torch.randn(N_B, DIM)
    bag = make_emb(W0, cls=gl.OffloadedEmbeddingBag, mode=mode)
    twin = nn.EmbeddingBag(N_B, DIM, mode=mode)
    with torch.no_grad():
        twin.weight.copy_(W0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=0.2)
    topt = torch.optim.SGD(twin.parameters(), lr=0.2)
    for s in range(4):
        inp, offs, _w = _bag_batch(s)
        t = torch.randn(B, DIM, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        ((bag(inp, offs) - t) ** 2).sum().backward()
        opt.step()
        topt.zero_grad()
        ((twin(inp, offs) - t) ** 2).sum().backward()
        topt.step()
    torch.testing.assert_close(table(bag), twin.weight.detach())


# --------------------------------------------------------------------------- padding_idx


@pytest.mark.parametrize("cls", [gl.OffloadedEmbedding, gl.OffloadedEmbeddingBag])
@pytest.mark.parametrize("kw", [{"padding_idx": 0}, {"max_norm": 1.0}, {"sparse": True}])
def test_offloaded_refuses_nn_embedding_keywords(cls, kw):
    """Docstring: padding_idx, max_norm, scale_grad_by_freq and sparse are not taken (a
    TypeError for the unknown keyword)."""
    with pytest.raises(TypeError, match=next(iter(kw))):
        cls(N_A, DIM, placement="cpu", device="cpu", **kw)


# --------------------------------------------------------------------------- G: switchers


class SwModel(nn.Module):
    def __init__(self, var):
        super().__init__()
        self.u = var
        self.head = nn.Linear(DIM, 1)


def _make_switchers(kind, model, optimizer, n):
    if kind == "factory":
        sw = gl.ModelFactory(model.u, n, DIM, placement="cpu")
        osw = gl.OptimizerFactory(optimizer, n, DIM, model, "u", placement="cpu")
    elif kind == "switch":
        sw = gl.ModelSwitch(model.u, n, DIM, placement="cpu")
        osw = gl.OptimizerSwitch(optimizer, n, DIM, model, "u", placement="cpu")
    else:
        sw = gl.PytorchModelFactory(model.u, n, DIM, deviceType="cpu")
        osw = gl.PytorchOptimizerFactory(optimizer, n, DIM, model, "u", deviceType="cpu")
    return sw, osw


def _run_switchers(
    kind,
    opt_cls,
    kw,
    var="emb",
    bag_mode="sum",
    padding_idx=None,
    sched="none",
    clip=None,
    set_to_none=True,
    steps=5,
    n=N_A,
    ids_fn=None,
):
    torch.manual_seed(30)
    if var == "emb":
        v = nn.Embedding(10, DIM, padding_idx=padding_idx)
    else:
        v = nn.EmbeddingBag(10, DIM, mode=bag_mode, padding_idx=padding_idx)
    model = SwModel(v)
    head_ref = copy.deepcopy(model.head)
    g_u = {"lr": kw["lr"] * 2.0}
    g_h = {"lr": kw["lr"] * 0.5}
    optimizer = opt_cls(
        [{"params": model.u.parameters(), **g_u}, {"params": model.head.parameters(), **g_h}], **kw
    )
    sw, osw = _make_switchers(kind, model, optimizer, n)
    torch.manual_seed(31)
    sw.normalDistributionInit(0.0, 1.0)
    W0 = torch.as_tensor(sw.getNumpyVersion()).clone()
    osw.optInit()
    ref = LazyRef(
        opt_cls,
        [{"tables": ["u"], **g_u}, {"dense": list(head_ref.parameters()), **g_h}],
        {"u": W0},
        **kw,
    )
    sch = SCHEDS[sched](optimizer) if SCHEDS[sched] else None
    rsch = SCHEDS[sched](ref.opt) if SCHEDS[sched] else None
    for s in range(steps):
        ids = ids_fn(s) if ids_fn else gen_ids(s, n if s % 2 == 0 else 20, (B, 3))
        y = gen_y(s)
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        x = model.u(local).mean(1) if var == "emb" else model.u(local)
        loss = F.mse_loss(model.head(x).squeeze(-1), y)
        optimizer.zero_grad(set_to_none=set_to_none)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        if sch:
            sch.step()

        (loc,) = ref.begin({"u": [ids]})["u"]
        P = ref.P["u"]
        lpad = None
        if padding_idx is not None:
            hit = (ref.U["u"] == padding_idx).nonzero()
            lpad = int(hit[0, 0]) if hit.numel() else None
        if var == "emb":
            rx = F.embedding(loc, P, padding_idx=lpad).mean(1)
        else:
            rx = F.embedding_bag(loc, P, mode=bag_mode, padding_idx=lpad)
        torch.testing.assert_close(x.detach(), rx.detach())
        rloss = F.mse_loss(head_ref(rx).squeeze(-1), y)
        ref.opt.zero_grad(set_to_none=set_to_none)
        rloss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.all_params(), clip)
        ref.step()
        if rsch:
            rsch.step()
    return sw, osw, model, ref, head_ref, W0, optimizer


SW_CFGS = [
    "sgd_mom",
    "sgd_nesterov",
    "adam_amsgrad",
    "adamw",
    "adam_maximize",
    "rmsprop_mc",
    "adagrad",
    "adam_foreach",
    "sgd_noforeach",
]


@pytest.mark.parametrize("cfg", SW_CFGS)
@pytest.mark.parametrize("kind", ["factory", "switch", "pytorch"])
def test_switchers_match_lazy_reference(kind, cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    sw, _osw, model, ref, head_ref, _W0, _o = _run_switchers(kind, opt_cls, kw)
    torch.testing.assert_close(torch.as_tensor(sw.getNumpyVersion()), ref.W["u"])
    torch.testing.assert_close(model.head.weight.detach(), head_ref.weight.detach())


@pytest.mark.parametrize("cfg", ["sgd_nesterov", "adam_amsgrad", "adamw"])
@pytest.mark.parametrize("sched", ["step", "lambda"])
def test_switchers_with_scheduler_and_clip(cfg, sched):
    opt_cls, kw = OPT_CONFIGS[cfg]
    sw, _osw, model, ref, head_ref, _W0, _o = _run_switchers(
        "factory", opt_cls, kw, sched=sched, clip=0.1
    )
    torch.testing.assert_close(torch.as_tensor(sw.getNumpyVersion()), ref.W["u"])
    torch.testing.assert_close(model.head.bias.detach(), head_ref.bias.detach())


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam_wd"])
def test_switchers_zero_grad_set_to_none_false(cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    sw, _osw, model, ref, head_ref, _W0, _o = _run_switchers(
        "factory", opt_cls, kw, set_to_none=False
    )
    torch.testing.assert_close(torch.as_tensor(sw.getNumpyVersion()), ref.W["u"])


def test_switchers_optimizer_state_tables_match_reference():
    opt_cls, kw = OPT_CONFIGS["adam_amsgrad"]
    _sw, osw, _m, ref, _h, _W0, _o = _run_switchers("factory", opt_cls, kw)
    st = osw.getNumpyVersion()
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        torch.testing.assert_close(torch.as_tensor(st[k]), ref.state["u"][k])


def _pad_ids(s):
    ids = gen_ids(s, N_A, (B, 3))
    if s in (0, 2, 3):
        ids[0, 1] = 3
        ids[4, 2] = 3
    else:
        ids[ids == 3] = 4
    return ids


@pytest.mark.parametrize("cfg", ["sgd", "adam_wd", "sgd_mom_wd"])
@pytest.mark.parametrize("kind", ["factory", "switch"])
def test_switcher_padding_idx_embedding(kind, cfg):
    """README: nn.Embedding with padding_idx (passed as the module) has it taken as a
    global id; that row gets no gradient (weight decay still moves it when in a batch)."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    sw, _osw, model, ref, head_ref, W0, _o = _run_switchers(
        kind, opt_cls, kw, padding_idx=3, ids_fn=_pad_ids
    )
    final = torch.as_tensor(sw.getNumpyVersion())
    torch.testing.assert_close(final, ref.W["u"])
    if cfg == "sgd":
        assert torch.equal(final[3], W0[3])
    else:
        assert not torch.equal(final[3], W0[3])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_switcher_padding_idx_embedding_bag(mode):
    opt_cls, kw = OPT_CONFIGS["adam_wd"]
    sw, _osw, model, ref, head_ref, W0, _o = _run_switchers(
        "factory", opt_cls, kw, var="bag", bag_mode=mode, padding_idx=3, ids_fn=_pad_ids
    )
    torch.testing.assert_close(torch.as_tensor(sw.getNumpyVersion()), ref.W["u"])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("cfg", ["sgd_mom", "adagrad"])
def test_switcher_embedding_bag_modes(mode, cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    sw, _osw, model, ref, head_ref, W0, _o = _run_switchers(
        "factory", opt_cls, kw, var="bag", bag_mode=mode
    )
    torch.testing.assert_close(torch.as_tensor(sw.getNumpyVersion()), ref.W["u"])


# --------------------------------------------------------------------------- F: state dict round trip


def _build_rt(opt_cls, kw, W0a, W0b, head_sd):
    model = nn.ModuleDict(
        {
            "a": make_emb(W0a),
            "b": make_emb(W0b, cls=gl.OffloadedEmbeddingBag, mode="mean"),
            "head": nn.Linear(DIM, 1),
        }
    )
    model["head"].load_state_dict(head_sd)
    opt = gl.OffloadedOptimizer(
        opt_cls,
        [
            {"params": model["a"], "lr": kw["lr"] * 2},
            {"params": [model["b"], *model["head"].parameters()]},
        ],
        **kw,
    )
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sch


def _train_rt(model, opt, sch, steps, clip=True):
    for s in steps:
        ids = gen_ids(s, N_A, (B, 2))
        inp, offs, _w = _bag_batch(s)
        y = gen_y(s)
        x = model["a"](ids).sum(1) * model["b"](inp, offs)
        loss = F.mse_loss(model["head"](x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(lib_params(opt), 0.5)
        opt.step()
        sch.step()


RT_CFGS = [
    "sgd_nesterov",
    "adam_amsgrad",
    "adamw",
    "adagrad",
    "rmsprop_mc",
    "nadam",
    "adamax",
    "radam",
]


@pytest.mark.parametrize("via_bytes", [False, True])
@pytest.mark.parametrize("cfg", RT_CFGS)
def test_state_dict_round_trip_into_new_optimizer(cfg, via_bytes):
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(40)
    W0a, W0b = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    head_sd = nn.Linear(DIM, 1).state_dict()
    # uninterrupted
    m1, o1, s1 = _build_rt(opt_cls, kw, W0a, W0b, head_sd)
    _train_rt(m1, o1, s1, range(6))
    # interrupted after 3 steps
    m2, o2, s2 = _build_rt(opt_cls, kw, W0a, W0b, head_sd)
    _train_rt(m2, o2, s2, range(3))
    osd, msd, ssd = o2.state_dict(), m2.state_dict(), s2.state_dict()
    if via_bytes:
        buf = io.BytesIO()
        torch.save({"o": osd, "m": msd, "s": ssd}, buf)
        buf.seek(0)
        blob = torch.load(buf, weights_only=True)
        osd, msd, ssd = blob["o"], blob["m"], blob["s"]
    del o2, s2
    m3, o3, s3 = _build_rt(opt_cls, kw, torch.zeros(N_A, DIM), torch.zeros(N_B, DIM), head_sd)
    m3.load_state_dict(msd)
    o3.load_state_dict(osd)
    s3.load_state_dict(ssd)
    _train_rt(m3, o3, s3, range(3, 6))
    torch.testing.assert_close(table(m3["a"]), table(m1["a"]))
    torch.testing.assert_close(table(m3["b"]), table(m1["b"]))
    torch.testing.assert_close(m3["head"].weight.detach(), m1["head"].weight.detach())
    assert [g["lr"] for g in o3.param_groups] == pytest.approx([g["lr"] for g in o1.param_groups])


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam_amsgrad", "adagrad"])
def test_state_dict_rewind_same_optimizer(cfg):
    """Load a saved state back into the same optimizer (and the tables via the model's
    load_state_dict) and redo the steps: the same values as the first time."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(41)
    W0a, W0b = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    head_sd = nn.Linear(DIM, 1).state_dict()
    m, o, s = _build_rt(opt_cls, kw, W0a, W0b, head_sd)
    _train_rt(m, o, s, range(2))
    osd = copy.deepcopy(o.state_dict())
    msd = copy.deepcopy(m.state_dict())
    ssd = copy.deepcopy(s.state_dict())
    _train_rt(m, o, s, range(2, 5))
    first = (table(m["a"]), table(m["b"]))
    m.load_state_dict(msd)
    o.load_state_dict(osd)
    s.load_state_dict(ssd)
    _train_rt(m, o, s, range(2, 5))
    torch.testing.assert_close(table(m["a"]), first[0])
    torch.testing.assert_close(table(m["b"]), first[1])


def test_state_dict_is_a_snapshot():
    """state_dict() tables are CPU tensors that later steps must not change."""
    opt_cls, kw = OPT_CONFIGS["adam"]
    torch.manual_seed(42)
    head_sd = nn.Linear(DIM, 1).state_dict()
    m, o, s = _build_rt(opt_cls, kw, torch.randn(N_A, DIM), torch.randn(N_B, DIM), head_sd)
    _train_rt(m, o, s, range(2))
    sd = o.state_dict()
    snap = copy.deepcopy(sd)
    _train_rt(m, o, s, range(2, 4))
    for t_now, t_then in zip(sd["tables"], snap["tables"], strict=True):
        for k in t_then:
            assert torch.equal(t_now[k], t_then[k])


def test_state_dict_wrong_class_refused_and_unchanged():
    """README: state saved by another class (Adam's into NAdam) is refused before
    anything changes (GadgetValueError)."""
    torch.manual_seed(43)
    head_sd = nn.Linear(DIM, 1).state_dict()
    W0a, W0b = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    m, o, s = _build_rt(torch.optim.Adam, dict(lr=0.05), W0a, W0b, head_sd)
    _train_rt(m, o, s, range(2))
    m2, o2, s2 = _build_rt(torch.optim.NAdam, dict(lr=0.05), W0a, W0b, head_sd)
    _train_rt(m2, o2, s2, range(2))
    before = copy.deepcopy(o2.state_dict())
    with pytest.raises(gl.GadgetValueError):
        o2.load_state_dict(o.state_dict())
    after = o2.state_dict()
    for t_now, t_then in zip(after["tables"], before["tables"], strict=True):
        for k in t_then:
            assert torch.equal(t_now[k], t_then[k])


@pytest.mark.parametrize("cfg", ["sgd_nesterov", "adam_amsgrad", "rmsprop_mc"])
def test_switcher_checkpoint_round_trip(tmp_path, cfg):
    """Switchers + their torch optimizer through save_checkpoint / load_checkpoint mid
    training, then continue: equal to the uninterrupted run."""
    opt_cls, kw = OPT_CONFIGS[cfg]

    def build():
        torch.manual_seed(50)
        model = SwModel(nn.Embedding(10, DIM))
        optimizer = opt_cls(
            [
                {"params": model.u.parameters(), "lr": kw["lr"] * 2},
                {"params": model.head.parameters()},
            ],
            **kw,
        )
        sw = gl.ModelFactory(model.u, N_A, DIM, placement="cpu")
        osw = gl.OptimizerFactory(optimizer, N_A, DIM, model, "u", placement="cpu")
        torch.manual_seed(51)
        sw.normalDistributionInit(0.0, 1.0)
        osw.optInit()
        sch = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return model, optimizer, sw, osw, sch

    def train(model, optimizer, sw, osw, sch, steps):
        for s in steps:
            ids = gen_ids(s, N_A, (B, 3))
            local = sw.beforeForwardPass(ids)
            osw.beforeForwardPass(ids)
            loss = F.mse_loss(model.head(model.u(local).mean(1)).squeeze(-1), gen_y(s))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sw.afterOptimizerStep(ids)
            osw.afterOptimizerStep(ids)
            sch.step()

    a = build()
    train(*a, range(6))
    b = build()
    train(*b, range(3))
    gl.save_checkpoint(tmp_path / "ck", {"model": b[0], "opt": b[1], "u": b[2], "u_opt": b[3]})
    ssd = b[4].state_dict()
    c = build()
    gl.load_checkpoint(tmp_path / "ck", {"model": c[0], "opt": c[1], "u": c[2], "u_opt": c[3]})
    c[4].load_state_dict(ssd)
    train(*c, range(3, 6))
    torch.testing.assert_close(
        torch.as_tensor(c[2].getNumpyVersion()), torch.as_tensor(a[2].getNumpyVersion())
    )
    torch.testing.assert_close(c[0].head.weight.detach(), a[0].head.weight.detach())


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam_amsgrad"])
def test_offloaded_checkpoint_round_trip(tmp_path, cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(60)
    W0a, W0b = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    head_sd = nn.Linear(DIM, 1).state_dict()
    m1, o1, s1 = _build_rt(opt_cls, kw, W0a, W0b, head_sd)
    _train_rt(m1, o1, s1, range(5))
    m2, o2, s2 = _build_rt(opt_cls, kw, W0a, W0b, head_sd)
    _train_rt(m2, o2, s2, range(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    ssd = s2.state_dict()
    m3, o3, s3 = _build_rt(opt_cls, kw, torch.zeros(N_A, DIM), torch.zeros(N_B, DIM), head_sd)
    gl.load_checkpoint(tmp_path / "ck", {"model": m3, "optimizer": o3})
    s3.load_state_dict(ssd)
    _train_rt(m3, o3, s3, range(2, 5))
    torch.testing.assert_close(table(m3["a"]), table(m1["a"]))
    torch.testing.assert_close(table(m3["b"]), table(m1["b"]))


# --------------------------------------------------------------------------- misc torch features


def test_scheduler_emits_no_order_warning():
    """LR schedulers work: stepping the optimizer, then the scheduler, must not trigger
    torch's 'lr_scheduler.step() before optimizer.step()' warning (filterwarnings=error)."""
    emb = make_emb(torch.randn(N_A, DIM))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sch.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_add_param_group_table_with_own_lr():
    """add_param_group({"params": new_emb, "lr": ...}) trains the table with that lr."""
    torch.manual_seed(70)
    W0, W1 = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    e1, e2 = make_emb(W0), make_emb(W1)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, e1, lr=0.1)
    opt.add_param_group({"params": e2, "lr": 0.7})
    ids = torch.tensor([1, 1, 5])
    opt.zero_grad()
    (e1(ids).sum() + e2(ids).sum()).backward()
    opt.step()
    exp0, exp1 = W0.clone(), W1.clone()
    exp0[1] -= 0.2
    exp0[5] -= 0.1
    exp1[1] -= 1.4
    exp1[5] -= 0.7
    torch.testing.assert_close(table(e1), exp0)
    torch.testing.assert_close(table(e2), exp1)


@pytest.mark.parametrize("maximize", [False, True])
def test_sgd_maximize_direction_exact(maximize):
    W0 = torch.randn(N_A, DIM, generator=torch.Generator().manual_seed(80))
    emb = make_emb(W0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.25, maximize=maximize)
    ids = torch.tensor([[2, 7], [7, 7]])
    emb(ids).sum().backward()
    opt.step()
    sign = 1.0 if maximize else -1.0
    exp = W0.clone()
    exp[2] += sign * 0.25
    exp[7] += sign * 0.75
    torch.testing.assert_close(table(emb), exp)


def test_second_step_without_backward_leaves_tables():
    """step() consumes the gradients: a second step with no new backward leaves the
    tables alone (even with momentum, which torch would keep applying to a dense one)."""
    emb = make_emb(torch.randn(N_A, DIM))
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1, momentum=0.9)
    emb(torch.tensor([3, 4])).sum().backward()
    opt.step()
    t1 = table(emb)
    opt.step()
    assert torch.equal(table(emb), t1)


def test_zero_grad_discards_lookup_gradients():
    emb = make_emb(torch.randn(N_A, DIM))
    W0 = table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    emb(torch.tensor([3, 4])).sum().backward()
    opt.zero_grad(set_to_none=False)
    opt.step()
    assert torch.equal(table(emb), W0)


@pytest.mark.parametrize("cfg", ["adam", "sgd_mom"])
def test_grad_scaler_unscale_cpu(cfg):
    """GradScaler (cpu device, as on a CUDA-less machine): unscale_ then clip then step
    equals the unscaled run."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    except Exception:
        pytest.skip("no cpu GradScaler in this torch")
    W0 = torch.randn(N_A, DIM, generator=torch.Generator().manual_seed(90))
    e1, e2 = make_emb(W0), make_emb(W0)
    o1 = gl.OffloadedOptimizer(opt_cls, e1, **kw)
    o2 = gl.OffloadedOptimizer(opt_cls, e2, **kw)
    for s in range(3):
        ids = gen_ids(s, N_A, (B, 2))
        o1.zero_grad()
        scaler.scale((e1(ids) ** 2).sum()).backward()
        scaler.unscale_(o1)
        torch.nn.utils.clip_grad_norm_(lib_params(o1), 1.0)
        scaler.step(o1)
        scaler.update()
        o2.zero_grad()
        (e2(ids) ** 2).sum().backward()
        torch.nn.utils.clip_grad_norm_(lib_params(o2), 1.0)
        o2.step()
    torch.testing.assert_close(table(e1), table(e2))


def test_float64_table_matches_reference():
    torch.manual_seed(95)
    W0 = torch.randn(N_A, DIM, dtype=torch.float64)
    emb = gl.OffloadedEmbedding(N_A, DIM, placement="cpu", device="cpu", dtype=torch.float64)
    emb.load_state_dict({"weight": W0.clone()})
    kw = dict(lr=0.05, amsgrad=True, weight_decay=0.01)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, **kw)
    ref = LazyRef(torch.optim.Adam, [{"tables": ["e"]}], {"e": W0}, **kw)
    for s in range(4):
        ids = gen_ids(s, N_A, (B, 3))
        w = torch.randn(B, 3, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        (loc,) = ref.begin({"e": [ids]})["e"]
        (F.embedding(loc, ref.P["e"]) * w).sum().backward()
        ref.step()
    torch.testing.assert_close(table(emb), ref.W["e"], rtol=0, atol=0)


def test_math_sanity_lr_decay_lambda():
    """Guard against a vacuous scheduler comparison: LambdaLR really moves the lr."""
    opt_cls, kw = OPT_CONFIGS["sgd_mom"]
    _m, opt, _r, _h, _ = _run_multi(opt_cls, kw, sched="lambda", steps=3)
    assert max(g["lr"] for g in opt.param_groups) == pytest.approx(kw["lr"] * 2 / 4)
    assert not math.isclose(opt.param_groups[0]["lr"], kw["lr"] * 2)


# --------------------------------------------------------------------------- schedulers that change more than lr

ONE_SCHEDS = {
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=20),
    "cyclic": lambda o: torch.optim.lr_scheduler.CyclicLR(
        o, base_lr=0.01, max_lr=0.2, step_size_up=2, base_momentum=0.5, max_momentum=0.9
    ),
    "linear_warmup": lambda o: torch.optim.lr_scheduler.LinearLR(
        o, start_factor=0.1, total_iters=3
    ),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7),
        ],
        milestones=[2],
    ),
}


@pytest.mark.parametrize(
    "sched,cfg",
    [
        ("onecycle", "sgd"),  # OneCycleLR turns SGD's momentum on before step 1
        ("onecycle", "adam"),  # ... and cycles Adam's betas
        ("cyclic", "sgd"),
        ("cyclic", "rmsprop_mc"),
        ("linear_warmup", "rprop"),  # Rprop's step_size starts from the first step's lr
        ("linear_warmup", "asgd"),  # ASGD's eta starts from the first step's lr
        ("linear_warmup", "adagrad"),
        ("cosine", "adamw"),
        ("sequential", "sgd_nesterov"),
        ("sequential", "nadam"),
    ],
)
def test_single_table_with_scheduler(sched, cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    with warnings.catch_warnings():
        # torch 2.4's SequentialLR steps its schedulers with an epoch and warns about it
        warnings.filterwarnings(
            "ignore", message="The epoch parameter in `scheduler.step", category=UserWarning
        )
        W0, emb, head, ref, head_ref, _t, _opt = _run_single(
            opt_cls, kw, sched=ONE_SCHEDS[sched], steps=6
        )
    torch.testing.assert_close(table(emb), ref.W["emb"])
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach())


def _turn_momentum_on(s, o):
    if s == 2:
        for g in o.param_groups:
            g["momentum"] = 0.9
            g["nesterov"] = True


def _change_wd(s, o):
    for g in o.param_groups:
        g["weight_decay"] = 0.0 if s < 2 else 0.2


def _toggle_maximize(s, o):
    for g in o.param_groups:
        g["maximize"] = s % 2 == 1


@pytest.mark.parametrize(
    "hook,cfg",
    [
        (_turn_momentum_on, "sgd"),
        (_change_wd, "sgd_mom"),
        (_change_wd, "adam"),
        (_toggle_maximize, "adam_amsgrad"),
        (_toggle_maximize, "sgd_mom"),
    ],
)
def test_single_table_hyperparameters_changed_by_hand(hook, cfg):
    """Hyper-parameters changed in param_groups between steps: 'the paged state follows
    the hyper-parameters as torch's would (state that appears gets its own table)'."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    W0, emb, head, ref, head_ref, _t, _opt = _run_single(opt_cls, kw, hook=hook, steps=5)
    torch.testing.assert_close(table(emb), ref.W["emb"])
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach())


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam_amsgrad", "rmsprop_mc"])
def test_per_group_lambdas_follow_given_group_order(cfg):
    """LambdaLR with one lambda per group: the groups are in the order the dicts were
    given (torch's order); a lambda of 0 for the table-'b' group freezes that table."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(11)
    Wa, Wb = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    a, b = make_emb(Wa), make_emb(Wb, cls=gl.OffloadedEmbeddingBag, mode="sum")
    head = nn.Linear(DIM, 1)
    opt = gl.OffloadedOptimizer(
        opt_cls,
        [
            {"params": a, "lr": 0.05},
            {"params": b, "lr": 0.07},
            {"params": head.parameters(), "lr": 0.09},
        ],
        **{k: v for k, v in kw.items() if k != "lr"},
        lr=0.01,
    )
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.07, 0.09]
    sch = torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda e: 1.0, lambda e: 0.0 if e >= 1 else 1.0, lambda e: 0.5]
    )
    snap_b = None
    for s in range(4):
        ids = gen_ids(s, N_A, (B, 2))
        inp, offs, _w = _bag_batch(s)
        opt.zero_grad()
        F.mse_loss(head(a(ids).sum(1) * b(inp, offs)).squeeze(-1), gen_y(s)).backward()
        opt.step()
        sch.step()
        if s == 0:
            snap_b = table(b)
            assert not torch.equal(snap_b, Wb)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.0, 0.045])
    if cfg == "sgd_mom":
        # lr 0 → SGD changes nothing, whatever the momentum
        assert torch.equal(table(b), snap_b)


# --------------------------------------------------------------------------- closure / accumulation


@pytest.mark.parametrize("cfg", ["sgd_mom", "adam", "rmsprop_mc"])
def test_step_with_closure(cfg):
    """torch's optimizer.step(closure): the closure's forward/backward gradients are
    what the step applies (OffloadedOptimizer.step takes a closure)."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(12)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    head = nn.Linear(DIM, 1)
    head_ref = copy.deepcopy(head)
    opt = gl.OffloadedOptimizer(opt_cls, nn.ModuleDict({"e": emb, "h": head}), **kw)
    ref = LazyRef(
        opt_cls, [{"tables": ["e"], "dense": list(head_ref.parameters())}], {"e": W0}, **kw
    )
    losses = []
    for s in range(3):
        ids = gen_ids(s, N_A, (B, 3))
        y = gen_y(s)

        def closure(ids=ids, y=y):
            opt.zero_grad()
            loss = F.mse_loss(head(emb(ids).sum(1)).squeeze(-1), y)
            loss.backward()
            return loss

        losses.append(opt.step(closure).detach().item())
        (loc,) = ref.begin({"e": [ids]})["e"]
        ref.opt.zero_grad()
        rloss = F.mse_loss(head_ref(F.embedding(loc, ref.P["e"]).sum(1)).squeeze(-1), y)
        rloss.backward()
        assert losses[-1] == pytest.approx(rloss.detach().item())
        ref.step()
    torch.testing.assert_close(table(emb), ref.W["e"])
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach())


@pytest.mark.parametrize("walk", ["none", "iterate", "clip_between"])
@pytest.mark.parametrize("cfg", ["sgd_mom", "adam_wd"])
def test_gradient_accumulation_with_groups_read_between(cfg, walk):
    """README: 'a backward after such a merge (gradient accumulation) is merged in at the
    next one': reading param_groups between micro-batches must not lose gradient."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(13)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    head = nn.Linear(DIM, 1)
    head_ref = copy.deepcopy(head)
    opt = gl.OffloadedOptimizer(opt_cls, nn.ModuleDict({"e": emb, "h": head}), **kw)
    ref = LazyRef(
        opt_cls, [{"tables": ["e"], "dense": list(head_ref.parameters())}], {"e": W0}, **kw
    )
    for s in range(3):
        mids = [gen_ids(10 * s + k, N_A, (B, 2)) for k in range(3)]
        ys = [gen_y(10 * s + k) for k in range(3)]
        opt.zero_grad()
        for k in range(3):
            F.mse_loss(head(emb(mids[k]).sum(1)).squeeze(-1), ys[k]).backward()
            if walk == "iterate":
                _ = [p.grad for p in lib_params(opt)]
            elif walk == "clip_between" and k < 2:
                torch.nn.utils.clip_grad_norm_(lib_params(opt), 1e9)
        opt.step()
        locs = ref.begin({"e": mids})["e"]
        ref.opt.zero_grad()
        for k in range(3):
            F.mse_loss(
                head_ref(F.embedding(locs[k], ref.P["e"]).sum(1)).squeeze(-1), ys[k]
            ).backward()
        ref.step()
    torch.testing.assert_close(table(emb), ref.W["e"])
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach())


def test_clip_after_accumulation_sees_all_micro_batches():
    """Clip norm measured after reading groups mid-accumulation covers every backward."""
    torch.manual_seed(14)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    ids1, ids2 = torch.tensor([1, 2, 2]), torch.tensor([2, 3])
    (emb(ids1) ** 2).sum().backward()
    n1 = torch.nn.utils.clip_grad_norm_(lib_params(opt), 1e9)
    (emb(ids2) ** 2).sum().backward()
    n2 = torch.nn.utils.clip_grad_norm_(lib_params(opt), 1e9)
    P = nn.Parameter(W0.clone())
    (F.embedding(ids1, P) ** 2).sum().backward()
    r1 = P.grad.norm()
    (F.embedding(ids2, P) ** 2).sum().backward()
    r2 = P.grad.norm()
    torch.testing.assert_close(n1, r1)
    torch.testing.assert_close(n2, r2)


@pytest.mark.parametrize("cfg", ["adam_wd", "sgd_mom_wd", "adagrad"])
def test_zero_grad_discard_does_not_count_a_step(cfg):
    """A lookup whose gradient zero_grad() threw away leaves no lookup for the step: the
    table is not stepped (weight decay does not move it) and its step count stays."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(15)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    opt = gl.OffloadedOptimizer(opt_cls, emb, **kw)
    ref = LazyRef(opt_cls, [{"tables": ["e"]}], {"e": W0}, **kw)
    for s in range(4):
        ids = gen_ids(s, N_A, (B, 2))
        w = torch.randn(B, 2, DIM, generator=torch.Generator().manual_seed(s))
        if s == 1:
            (emb(ids) * w).sum().backward()
            opt.zero_grad(set_to_none=False)
            before = table(emb)
            opt.step()
            assert torch.equal(table(emb), before)
            continue
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        (loc,) = ref.begin({"e": [ids]})["e"]
        (F.embedding(loc, ref.P["e"]) * w).sum().backward()
        ref.step()
    torch.testing.assert_close(table(emb), ref.W["e"])


@pytest.mark.parametrize("how", ["module", "weight_attr"])
def test_frozen_table_beside_training_table(how):
    torch.manual_seed(16)
    Wa, Wb = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    a, b = make_emb(Wa), make_emb(Wb)
    if how == "module":
        b.requires_grad_(False)
    else:
        b.weight.requires_grad = False
    kw = dict(lr=0.05, weight_decay=0.1)
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, nn.ModuleDict({"a": a, "b": b}), **kw)
    ref = LazyRef(torch.optim.AdamW, [{"tables": ["a"]}], {"a": Wa}, **kw)
    for s in range(3):
        ia, ib = gen_ids(s, N_A, (B,)), gen_ids(s, N_B, (B,), seed=4)
        opt.zero_grad()
        out = a(ia) * b(ib)
        assert not b(ib).requires_grad
        out.pow(2).sum().backward()
        opt.step()
        (loc,) = ref.begin({"a": [ia]})["a"]
        (F.embedding(loc, ref.P["a"]) * Wb[ib]).pow(2).sum().backward()
        ref.step()
    assert torch.equal(table(b), Wb)
    torch.testing.assert_close(table(a), ref.W["a"])


# --------------------------------------------------------------------------- more torch features


def _exact(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "cfg", ["sgd_foreach", "adam_foreach", "rmsprop_wd_foreach", "adagrad_max", "nadam_wd_foreach"]
)
def test_two_tables_and_head_in_one_foreach_group(cfg):
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(17)
    Wa, Wb = torch.randn(N_A, DIM), torch.randn(N_B, DIM)
    a, b = make_emb(Wa), make_emb(Wb, cls=gl.OffloadedEmbeddingBag, mode="mean")
    head = nn.Linear(DIM, 1)
    head_ref = copy.deepcopy(head)
    opt = gl.OffloadedOptimizer(opt_cls, nn.ModuleDict({"a": a, "b": b, "h": head}), **kw)
    ref = LazyRef(
        opt_cls,
        [{"tables": ["a", "b"], "dense": list(head_ref.parameters())}],
        {"a": Wa, "b": Wb},
        **kw,
    )
    for s in range(4):
        ids = gen_ids(s, N_A, (B, 2))
        inp, offs, _w = _bag_batch(s)
        y = gen_y(s)
        opt.zero_grad()
        F.mse_loss(head(a(ids).sum(1) + b(inp, offs)).squeeze(-1), y).backward()
        opt.step()
        locs = ref.begin({"a": [ids], "b": [inp]})
        ref.opt.zero_grad()
        rx = F.embedding(locs["a"][0], ref.P["a"]).sum(1) + F.embedding_bag(
            locs["b"][0], ref.P["b"], offs, mode="mean"
        )
        F.mse_loss(head_ref(rx).squeeze(-1), y).backward()
        ref.step()
    _exact(table(a), ref.W["a"])
    _exact(table(b), ref.W["b"])
    _exact(head.weight.detach(), head_ref.weight.detach())


@pytest.mark.parametrize(
    "cls_name,extra",
    [("Adam", {}), ("AdamW", {"weight_decay": 0.1}), ("SGD", {"momentum": 0.9}), ("Adagrad", {})],
)
def test_fused_cpu_kernels_match_to_rounding(cls_name, extra):
    """README: torch's fused CPU kernels ... match a dense table to rounding."""
    opt_cls = getattr(torch.optim, cls_name)
    kw = dict(lr=0.05, fused=True, **extra)
    probe = nn.Parameter(torch.zeros(2, 2))
    try:
        po = opt_cls([probe], **kw)
        probe.grad = torch.ones(2, 2)
        po.step()
    except Exception:
        pytest.skip(f"this torch has no fused CPU {cls_name}")
    W0, emb, head, ref, head_ref, _t, _opt = _run_single(opt_cls, kw)
    torch.testing.assert_close(table(emb), ref.W["emb"])
    torch.testing.assert_close(head.weight.detach(), head_ref.weight.detach())


@pytest.mark.parametrize("cfg", ["adam", "adam_amsgrad", "nadam", "radam", "adagrad", "asgd"])
def test_empty_lookup_counts_a_step(cfg):
    """README: an empty lookup with a backward is a lookup: the next step() counts a step
    for its table (as SparseAdam does for an empty sparse gradient) and changes no row."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    torch.manual_seed(18)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    head = nn.Linear(DIM, 1)
    opt = gl.OffloadedOptimizer(opt_cls, nn.ModuleDict({"e": emb}), **kw)
    ref = LazyRef(opt_cls, [{"tables": ["e"]}], {"e": W0}, **kw)
    for s in range(4):
        ids = torch.zeros(0, dtype=torch.long) if s == 1 else gen_ids(s, N_A, (B,))
        w = torch.randn(ids.shape[0], DIM, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        before = table(emb)
        (emb(ids) * w).sum().backward()
        opt.step()
        if s == 1:
            assert torch.equal(table(emb), before)
        (loc,) = ref.begin({"e": [ids]})["e"]
        (F.embedding(loc, ref.P["e"]) * w).sum().backward()
        ref.step()
    _exact(table(emb), ref.W["e"])
    del head


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_id_dtypes_train_like_int64(dtype):
    torch.manual_seed(19)
    W0 = torch.randn(N_A, DIM)
    e1, e2 = make_emb(W0), make_emb(W0)
    o1 = gl.OffloadedOptimizer(torch.optim.Adam, e1, lr=0.05)
    o2 = gl.OffloadedOptimizer(torch.optim.Adam, e2, lr=0.05)
    for s in range(3):
        ids = gen_ids(s, N_A, (B, 3))
        w = torch.randn(B, 3, DIM, generator=torch.Generator().manual_seed(s))
        o1.zero_grad()
        (e1(ids.to(dtype)) * w).sum().backward()
        o1.step()
        o2.zero_grad()
        (e2(ids) * w).sum().backward()
        o2.step()
    _exact(table(e1), table(e2))


@pytest.mark.parametrize(
    "idt,odt", [(torch.int32, torch.int32), (torch.int64, torch.int32), (torch.int32, torch.int64)]
)
def test_bag_int32_offsets_and_ids(idt, odt):
    """Docstring: offsets (int64 or int32, 1-D)."""
    torch.manual_seed(24)
    W0 = torch.randn(N_B, DIM)
    b1, b2 = (make_emb(W0, cls=gl.OffloadedEmbeddingBag, mode="sum") for _ in range(2))
    o1 = gl.OffloadedOptimizer(torch.optim.Adam, b1, lr=0.05)
    o2 = gl.OffloadedOptimizer(torch.optim.Adam, b2, lr=0.05)
    for s in range(3):
        inp, offs, w = _bag_batch(s)
        o1.zero_grad()
        out1 = b1(inp.to(idt), offs.to(odt), per_sample_weights=w)
        out1.pow(2).sum().backward()
        o1.step()
        o2.zero_grad()
        out2 = b2(inp, offs, per_sample_weights=w)
        out2.pow(2).sum().backward()
        o2.step()
        _exact(out1.detach(), out2.detach())
    _exact(table(b1), table(b2))


def test_tied_module_used_twice_in_model():
    """The same OffloadedEmbedding reachable under two names (tied input/output tables)
    is one table: its lookups' gradients add up, and it is stepped once."""
    torch.manual_seed(25)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    model = nn.ModuleDict({"inp": emb, "out": emb})
    kw = dict(lr=0.05, amsgrad=True)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, **kw)
    ref = LazyRef(torch.optim.Adam, [{"tables": ["e"]}], {"e": W0}, **kw)
    for s in range(3):
        c, x = gen_ids(s, N_A, (B,)), gen_ids(s, N_A, (B, 2), seed=5)
        opt.zero_grad()
        (model["inp"](c).unsqueeze(1) * model["out"](x)).sum().sigmoid().backward()
        opt.step()
        lc, lx = ref.begin({"e": [c, x]})["e"]
        P = ref.P["e"]
        (F.embedding(lc, P).unsqueeze(1) * F.embedding(lx, P)).sum().sigmoid().backward()
        ref.step()
    _exact(table(emb), ref.W["e"])


@pytest.mark.parametrize("cfg", ["adam", "sgd_mom"])
def test_grad_scaler_skips_step_on_inf(cfg):
    """GradScaler: a table gradient with inf is 'checked for inf like any gradient', so
    scaler.step skips the step: the table is unchanged, and the run continues as if that
    step never happened."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    except Exception:
        pytest.skip("no cpu GradScaler in this torch")
    torch.manual_seed(26)
    W0 = torch.randn(N_A, DIM)
    emb = make_emb(W0)
    opt = gl.OffloadedOptimizer(opt_cls, emb, **kw)
    ref = LazyRef(opt_cls, [{"tables": ["e"]}], {"e": W0}, **kw)
    for s in range(4):
        ids = gen_ids(s, N_A, (B,))
        w = torch.randn(B, DIM, generator=torch.Generator().manual_seed(s))
        if s == 1:
            w[2, 3] = float("inf")
        opt.zero_grad()
        before = table(emb)
        scaler.scale((emb(ids) * w).sum()).backward()
        scaler.step(opt)
        scaler.update()
        if s == 1:
            assert torch.equal(table(emb), before)
            continue
        (loc,) = ref.begin({"e": [ids]})["e"]
        (F.embedding(loc, ref.P["e"]) * w).sum().backward()
        ref.step()
    torch.testing.assert_close(table(emb), ref.W["e"])


# --------------------------------------------------------------------------- state appearing / hooks


@pytest.mark.parametrize("cfg", ["sgd", "rprop", "asgd"])
def test_round_trip_state_turned_on_later(cfg):
    """README: a state dict holding state the optimizer has not turned on yet (a
    scheduler's momentum) loads, and that state is paged from then on. Also scalar
    per-table state (ASGD's eta/mu, Rprop's step sizes) survives the round trip."""
    opt_cls, kw = OPT_CONFIGS[cfg]
    hook = _turn_momentum_on if cfg == "sgd" else None

    def build(W):
        torch.manual_seed(0)
        emb = make_emb(W)
        head = nn.Linear(DIM, 1)
        model = nn.ModuleDict({"e": emb, "h": head})
        return model, gl.OffloadedOptimizer(opt_cls, model, **kw)

    def train(model, opt, steps):
        for s in steps:
            if hook:
                hook(s, opt)
            ids = gen_ids(s, N_A, (B, 2))
            opt.zero_grad()
            F.mse_loss(model["h"](model["e"](ids).sum(1)).squeeze(-1), gen_y(s)).backward()
            opt.step()

    W0 = torch.randn(N_A, DIM, generator=torch.Generator().manual_seed(3))
    m1, o1 = build(W0)
    train(m1, o1, range(6))
    m2, o2 = build(W0)
    train(m2, o2, range(4))
    blob = io.BytesIO()
    torch.save({"o": o2.state_dict(), "m": m2.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    m3, o3 = build(torch.zeros(N_A, DIM))
    m3.load_state_dict(saved["m"])
    o3.load_state_dict(saved["o"])
    # the loaded state equals the saved one
    for t3, t2 in zip(o3.state_dict()["tables"], saved["o"]["tables"], strict=True):
        assert sorted(t3) == sorted(t2)
        for k in t2:
            _exact(t3[k], t2[k])
    train(m3, o3, range(4, 6))
    _exact(table(m3["e"]), table(m1["e"]))
    _exact(m3["h"].weight.detach(), m1["h"].weight.detach())


def test_round_trip_before_a_table_was_ever_stepped():
    """Save while one table has never been looked up; load; then train it."""
    kw = dict(lr=0.05, amsgrad=True)
    Wa = torch.randn(N_A, DIM, generator=torch.Generator().manual_seed(1))
    Wb = torch.randn(N_B, DIM, generator=torch.Generator().manual_seed(2))

    def build(a0, b0):
        model = nn.ModuleDict({"a": make_emb(a0), "b": make_emb(b0)})
        return model, gl.OffloadedOptimizer(torch.optim.Adam, model, **kw)

    def train(model, opt, steps):
        for s in steps:
            opt.zero_grad()
            x = model["a"](gen_ids(s, N_A, (B,)))
            if s >= 2:
                x = x * model["b"](gen_ids(s, N_B, (B,), seed=7))
            x.pow(2).sum().backward()
            opt.step()

    m1, o1 = build(Wa, Wb)
    train(m1, o1, range(5))
    m2, o2 = build(Wa, Wb)
    train(m2, o2, range(2))
    sd, msd = copy.deepcopy(o2.state_dict()), copy.deepcopy(m2.state_dict())
    m3, o3 = build(torch.zeros(N_A, DIM), torch.zeros(N_B, DIM))
    m3.load_state_dict(msd)
    o3.load_state_dict(sd)
    train(m3, o3, range(2, 5))
    _exact(table(m3["a"]), table(m1["a"]))
    _exact(table(m3["b"]), table(m1["b"]))


def test_step_hooks_run_once_per_step():
    """README: hooks registered on it (step ...) run as torch runs them."""
    emb = make_emb(torch.randn(N_A, DIM))
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", table(emb)[1].clone())))
    h2 = opt.register_step_post_hook(lambda o, a, k: seen.append(("post", table(emb)[1].clone())))
    W0 = table(emb)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    assert [t for t, _ in seen] == ["pre", "post"]
    _exact(seen[0][1], W0[1])  # pre hook: before the update
    _exact(seen[1][1], W0[1] - 0.1)  # post hook: the table row already written
    h1.remove()
    h2.remove()
    opt.zero_grad()
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    assert len(seen) == 2


def test_switcher_checkpoint_with_momentum_turned_on_later(tmp_path):
    """README: a checkpoint that holds a state table a scheduler turned on (a momentum
    buffer) loads into switchers built before that option was on."""

    def build():
        torch.manual_seed(52)
        model = SwModel(nn.Embedding(10, DIM))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sw = gl.ModelFactory(model.u, N_A, DIM, placement="cpu")
        osw = gl.OptimizerFactory(optimizer, N_A, DIM, model, "u", placement="cpu")
        torch.manual_seed(53)
        sw.normalDistributionInit(0.0, 1.0)
        osw.optInit()
        return model, optimizer, sw, osw

    def train(model, optimizer, sw, osw, steps):
        for s in steps:
            if s == 1:
                for g in optimizer.param_groups:
                    g["momentum"] = 0.9
            ids = gen_ids(s, N_A, (B, 3))
            local = sw.beforeForwardPass(ids)
            osw.beforeForwardPass(ids)
            loss = F.mse_loss(model.head(model.u(local).mean(1)).squeeze(-1), gen_y(s))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sw.afterOptimizerStep(ids)
            osw.afterOptimizerStep(ids)

    a = build()
    train(*a, range(5))
    b = build()
    train(*b, range(3))
    gl.save_checkpoint(tmp_path / "ck", {"model": b[0], "opt": b[1], "u": b[2], "u_opt": b[3]})
    c = build()
    gl.load_checkpoint(tmp_path / "ck", {"model": c[0], "opt": c[1], "u": c[2], "u_opt": c[3]})
    assert c[1].param_groups[0]["momentum"] == 0.9
    train(*c, range(3, 5))
    torch.testing.assert_close(
        torch.as_tensor(c[2].getNumpyVersion()), torch.as_tensor(a[2].getNumpyVersion())
    )


@pytest.mark.parametrize("set_to_none", [True, False])
def test_clip_after_step_sees_no_stale_table_gradient(set_to_none):
    """After step() + zero_grad(), a backward that reaches only the head: clipping over
    param_groups measures the head's gradient alone (the last step's rows are consumed)."""
    emb = make_emb(torch.randn(N_A, DIM))
    head = nn.Linear(DIM, 1)
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD, nn.ModuleDict({"e": emb, "h": head}), lr=0.1, momentum=0.9
    )
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    head(torch.ones(3, DIM)).sum().backward()
    n = torch.nn.utils.clip_grad_norm_(lib_params(opt), 1e9)
    expect = torch.cat([head.weight.grad.view(-1), head.bias.grad]).norm()
    torch.testing.assert_close(n, expect)
    t = table(emb)
    opt.step()
    _exact(table(emb), t)
