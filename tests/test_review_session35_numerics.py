"""Black-box review (session 35): numerics of the training side against a dense torch reference.

Written from README.md ("Training embeddings larger than GPU memory"), ../shared/SPEC.md and the
public docstrings of ``OffloadedEmbedding`` / ``OffloadedEmbeddingBag`` / ``OffloadedOptimizer`` and
the SpeedTorch switchers.  Everything runs with ``placement="cpu"`` and ``device="cpu"``.

Reference (README): "the result is bit-identical to a dense ``nn.Embedding`` trained the same way on
the rows a step looks up. Updates are lazy, as torch's SparseAdam makes them: rows a step does not
look up keep their values and optimizer state"; "Bit-identical holds for float32 and float64 tables
with torch's default (for-each) kernels; ... float16 / bfloat16 arithmetic round some values
differently ..., so there results match a dense table to rounding".  ``RefTable`` / ``RefOpt``
below are plain torch: ONE ``nn.Parameter`` per table whose data is set, each step, to the step's
distinct rows in ascending id order (the README's switcher layout, and the order the per-step
variable has), with per-row optimizer state kept in full-size tensors and gathered / scattered
around a normal ``torch.optim`` step of the SAME optimizer object (so schedulers, clipping and
``state_dict`` act on it as on any torch optimizer, and scalar state such as ``step`` is per table).

Combinations covered: LR schedulers (StepLR, LambdaLR, OneCycleLR, CyclicLR, SequentialLR) on the
wrapper; ``clip_grad_norm_`` over the optimizer's groups (README: "Clip over the optimizer's
groups, not ``model.parameters()``"); weight_decay / maximize; float64 and float16 / bfloat16
tables; several lookups per step with overlapping ids and gradient accumulation; zero_grad with
``set_to_none`` False / True; EmbeddingBag modes, ``per_sample_weights``, ``include_last_offset``;
two optimizers over different tables; optimizer ``state_dict`` resume and ``save_checkpoint`` /
``load_checkpoint`` resume against an uninterrupted run; the switchers (ModelFactory /
OptimizerFactory / PytorchModelFactory / PytorchOptimizerFactory) with the same combinations.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from torch import nn

import gadgetloader as gl

N, D = 24, 6
CPU = {"placement": "cpu", "device": "cpu"}

A, AW, NA, RA, AM = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
)
SGD, AG, RMS, ADD = torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta


# ----------------------------------------------------------------------------- dense reference


class RefTable:
    """A full table plus one Parameter that holds the current step's distinct rows (ascending)."""

    def __init__(self, w0: torch.Tensor, padding_idx: int | None = None) -> None:
        self.W = w0.detach().clone()
        self.P = nn.Parameter(torch.zeros(0, w0.shape[1], dtype=w0.dtype))
        self.full: dict[str, torch.Tensor] = {}
        self.uniq: torch.Tensor | None = None
        self.pad = padding_idx
        self.owner: RefOpt | None = None

    def begin(self, *ids: torch.Tensor) -> None:
        """A new leaf for this step's rows, swapped into the owning optimizer in place of the old
        one (its state moves along), so no autograd node of an earlier step sees a new shape."""
        self.uniq = torch.unique(torch.cat([i.reshape(-1) for i in ids]))
        new = nn.Parameter(self.W[self.uniq].clone())
        if self.owner is not None:
            opt = self.owner.opt
            for g in opt.param_groups:
                g["params"] = [new if p is self.P else p for p in g["params"]]
            if self.P in opt.state:
                opt.state[new] = opt.state.pop(self.P)
        self.P = new

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.uniq, ids.to(torch.int64))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.local(ids), self.P, padding_idx=self._local_pad())

    def _local_pad(self):
        if self.pad is not None and bool((self.uniq == self.pad).any()):
            return int(torch.searchsorted(self.uniq, torch.tensor(self.pad)))
        return None

    def bag(self, ids, offsets=None, *, mode, per_sample_weights=None, include_last_offset=False):
        return F.embedding_bag(
            self.local(ids),
            self.P,
            offsets,
            mode=mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=include_last_offset,
            padding_idx=self._local_pad(),
        )


class RefOpt:
    """A torch optimizer over dense params and RefTables' per-step Parameters (lazy rows)."""

    def __init__(self, cls, params, tables, **kw) -> None:
        self.opt = cls(params, **kw)
        self.tables = list(tables)
        for t in self.tables:
            t.owner = self
        for t in self.tables:  # state torch makes in __init__ (Adagrad's sum)
            group = next(g for g in self.opt.param_groups if any(p is t.P for p in g["params"]))
            for name, v in self.opt.state[t.P].items():
                if torch.is_tensor(v) and v.shape == t.P.shape:
                    fill = group.get("initial_accumulator_value", 0.0)
                    t.full[name] = torch.full(t.W.shape, fill, dtype=v.dtype)

    @property
    def param_groups(self):
        return self.opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        for t in self.tables:  # README: zero_grad throws away the lookups since the last step
            t.uniq = None
            t.P.grad = None

    def step(self) -> None:
        for t in self.tables:
            if t.uniq is None:
                t.P.grad = None  # a table with no lookup since the last step is not stepped
                continue
            st = self.opt.state[t.P]
            for name, full in t.full.items():
                if name in st:
                    st[name] = full[t.uniq].clone()
        lr_before = {id(t): self._group(t)["lr"] for t in self.tables}
        self.opt.step()
        for t in self.tables:
            if t.uniq is None:
                continue
            st = self.opt.state[t.P]
            for name, v in st.items():
                if torch.is_tensor(v) and v.shape == t.P.shape:
                    if name not in t.full:
                        # rows not yet looked up start where torch starts a whole table at its
                        # first step: Rprop's step_size at that step's lr, the rest at zero
                        fill = float(lr_before[id(t)]) if name == "step_size" else 0.0
                        t.full[name] = torch.full(t.W.shape, fill, dtype=v.dtype)
                    t.full[name][t.uniq] = v.detach()
            t.W[t.uniq] = t.P.detach()
            t.uniq = None
            t.P.grad = None

    def _group(self, t: RefTable) -> dict:
        return next(g for g in self.opt.param_groups if any(p is t.P for p in g["params"]))

    def step_count(self, t: RefTable):
        return self.opt.state[t.P].get("step")


# ----------------------------------------------------------------------------- helpers


def _w0(seed: int, n: int = N, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g).to(dtype)


def _emb(w0: torch.Tensor) -> gl.OffloadedEmbedding:
    emb = gl.OffloadedEmbedding(w0.shape[0], D, dtype=w0.dtype, **CPU)
    emb.load_state_dict({"weight": w0.clone()})
    return emb


def _bag(w0: torch.Tensor, mode: str, include_last_offset: bool = False):
    bag = gl.OffloadedEmbeddingBag(
        w0.shape[0], D, mode=mode, include_last_offset=include_last_offset, dtype=w0.dtype, **CPU
    )
    bag.load_state_dict({"weight": w0.clone()})
    return bag


def _head(seed: int, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(D, 1).to(dtype)


def _table(gadget) -> torch.Tensor:
    """The whole table as a CPU tensor."""
    return gadget.getData(torch.arange(gadget.shape[0])).detach().clone()


def _batches(seed: int, steps: int = 4, n: int = N, lookups: int = 2, size: int = 7):
    """Per step: ``lookups`` id tensors with repeats inside and overlaps between them, and
    fixed loss coefficients per lookup."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(steps):
        ids = [torch.randint(0, (2 * n) // 3, (size,), generator=g) for _ in range(lookups)]
        ids[0][1] = ids[0][0]
        for k in range(1, lookups):
            ids[k][0] = ids[0][2]  # an id shared with the first lookup
        coef = [torch.randn(size, D, generator=g) for _ in ids]
        out.append((ids, coef))
    return out


def _loss(outs, coef, head=None):
    total = 0
    for o, c in zip(outs, coef, strict=True):
        c = c.to(o.dtype)
        total = total + (o * o * c).sum() * 0.25 + (o * c.flip(0)).sum()
        if head is not None:
            total = total + (head(o) ** 2).sum() * 0.5
    return total


def _same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        n_bad = int((a != b).sum())
        raise AssertionError(f"{what}: not bit-identical ({n_bad} values, max |diff| {diff:.3e})")


def _state_tables(opt: gl.OffloadedOptimizer, i: int = 0) -> dict:
    return opt.state_dict()["tables"][i]


def _check_state(opt: gl.OffloadedOptimizer, rt: RefTable, i: int = 0, exact: bool = True):
    tabs = _state_tables(opt, i)
    for name, full in rt.full.items():
        assert name in tabs, f"state table {name!r} missing: {sorted(tabs)}"
        got = tabs[name]
        if exact:
            _same(got.to(full.dtype), full, f"state {name}")
        else:
            torch.testing.assert_close(got.float(), full.float(), rtol=2e-2, atol=2e-2)


class Pair:
    """The library (table + optional dense head) and its dense twin, one optimizer each."""

    def __init__(self, cls, *, seed=0, dtype=torch.float32, head=True, n=N, **kw) -> None:
        w0 = _w0(seed, n, dtype)
        self.emb = _emb(w0)
        self.head = _head(seed, dtype) if head else None
        mods = {"emb": self.emb}
        if head:
            mods["head"] = self.head
        self.model = nn.ModuleDict(mods)
        self.opt = gl.OffloadedOptimizer(cls, self.model, **kw)
        self.rt = RefTable(w0)
        self.rhead = copy.deepcopy(self.head) if head else None
        dense = list(self.rhead.parameters()) if head else []
        # the wrapper's one group holds the dense params first, then the tables' rows
        self.ropt = RefOpt(cls, dense + [self.rt.P], [self.rt], **kw)

    def lib_loss(self, ids, coef):
        return _loss([self.emb(i) for i in ids], coef, self.head)

    def ref_loss(self, ids, coef, begin=True):
        if begin:
            self.rt.begin(*ids)
        return _loss([self.rt.lookup(i) for i in ids], coef, self.rhead)

    def step(self, ids, coef, *, set_to_none=True, clip=None):
        self.opt.zero_grad(set_to_none=set_to_none)
        self.lib_loss(ids, coef).backward()
        self.ropt.zero_grad(set_to_none=set_to_none)
        self.ref_loss(ids, coef).backward()
        norms = None
        if clip is not None:
            max_norm, norm_type = clip
            lp = [p for g in self.opt.param_groups for p in g["params"]]
            rp = [p for g in self.ropt.param_groups for p in g["params"]]
            n1 = torch.nn.utils.clip_grad_norm_(lp, max_norm, norm_type=norm_type)
            n2 = torch.nn.utils.clip_grad_norm_(rp, max_norm, norm_type=norm_type)
            norms = (n1, n2)
        self.opt.step()
        self.ropt.step()
        return norms

    def check(self, exact=True, what=""):
        got = _table(self.emb.weight)
        if exact:
            _same(got, self.rt.W, f"table {what}")
            if self.head is not None:
                for (k, p), q in zip(
                    self.head.named_parameters(), self.rhead.parameters(), strict=True
                ):
                    _same(p.detach(), q.detach(), f"head.{k} {what}")
        else:
            tol = _TOL[got.dtype]
            torch.testing.assert_close(got.float(), self.rt.W.float(), **tol)
            if self.head is not None:
                for p, q in zip(self.head.parameters(), self.rhead.parameters(), strict=True):
                    torch.testing.assert_close(p.detach().float(), q.detach().float(), **tol)


# "to rounding": a few units in the last place of the dtype (eps 9.8e-4 / 7.8e-3), values O(1)
_TOL = {
    torch.float16: {"rtol": 8e-3, "atol": 8e-3},
    torch.bfloat16: {"rtol": 6e-2, "atol": 6e-2},
}


def _torch_has(cls, kw) -> bool:
    try:
        cls([torch.zeros(2, requires_grad=True)], **kw)
    except TypeError:
        return False
    return True


def _need(cls, kw):
    if not _torch_has(cls, kw):
        pytest.skip(f"torch {torch.__version__} {cls.__name__} lacks one of {sorted(kw)}")


# ============================================================================ weight decay, maximize

WD_MAX_CASES = [
    pytest.param(
        A,
        {"lr": 0.05, "weight_decay": 0.1, "maximize": True, "amsgrad": True},
        id="adam-ams-wd-max",
    ),
    pytest.param(AW, {"lr": 0.05, "weight_decay": 0.3, "maximize": True}, id="adamw-wd-max"),
    pytest.param(
        NA, {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True}, id="nadam-dwd"
    ),
    pytest.param(RA, {"lr": 0.05, "weight_decay": 0.1, "maximize": True}, id="radam-wd-max"),
    pytest.param(AM, {"lr": 0.05, "weight_decay": 0.1, "maximize": True}, id="adamax-wd-max"),
    pytest.param(
        SGD,
        {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "maximize": True},
        id="sgd-mom-wd-max",
    ),
    pytest.param(
        SGD,
        {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05},
        id="sgd-nesterov-wd",
    ),
    pytest.param(
        AG,
        {"lr": 0.1, "weight_decay": 0.1, "lr_decay": 0.01, "maximize": True},
        id="adagrad-wd-max",
    ),
    pytest.param(
        RMS,
        {"lr": 0.01, "weight_decay": 0.1, "momentum": 0.5, "centered": True, "maximize": True},
        id="rms-all",
    ),
    pytest.param(ADD, {"lr": 0.5, "weight_decay": 0.1, "maximize": True}, id="adadelta-wd-max"),
]


def _with_f64(cases, f64_ids):
    out = []
    for c in cases:
        out.append(pytest.param(*c.values, torch.float32, id=f"{c.id}-f32"))
        if c.id in f64_ids:
            out.append(pytest.param(*c.values, torch.float64, id=f"{c.id}-f64"))
    return out


@pytest.mark.parametrize(
    ("cls", "kw", "dtype"),
    _with_f64(WD_MAX_CASES, {"adam-ams-wd-max", "rms-all"}),
)
def test_weight_decay_and_maximize_bit_identical(cls, kw, dtype):
    """README: bit-identical to a dense embedding trained on the step's rows, lazy updates (weight
    decay moves only looked-up rows), float32 and float64 alike; table, head and state tables."""
    _need(cls, kw)
    pair = Pair(cls, dtype=dtype, **kw)
    for k, (ids, coef) in enumerate(_batches(1, steps=4)):
        pair.step(ids, coef)
        pair.check(what=f"step {k}")
    _check_state(pair.opt, pair.rt)


@pytest.mark.parametrize(("cls", "kw"), [WD_MAX_CASES[5]])
def test_weight_decay_leaves_rows_outside_batches_alone(cls, kw):
    """README: rows a step does not look up keep their values (also with weight decay)."""
    _need(cls, kw)
    pair = Pair(cls, **kw)
    w_before = _table(pair.emb.weight)
    touched = torch.zeros(N, dtype=torch.bool)
    for ids, coef in _batches(2, steps=3):
        pair.step(ids, coef)
        for i in ids:
            touched[i] = True
    w_after = _table(pair.emb.weight)
    assert (~touched).any()
    _same(w_after[~touched], w_before[~touched], "untouched rows")


# ============================================================================ LR schedulers


def _sched(name: str, opt, steps: int):
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    if name == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.7 * e))
    if name == "cyclic":  # cycles momentum / betas too (README: turns SGD's momentum on)
        return torch.optim.lr_scheduler.CyclicLR(
            opt, base_lr=0.01, max_lr=0.1, step_size_up=2, base_momentum=0.8, max_momentum=0.9
        )
    if name == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps + 1)
    raise AssertionError(name)


SCHED_OPTS = [
    pytest.param(A, {"lr": 0.05, "weight_decay": 0.01}, id="adam"),
    pytest.param(SGD, {"lr": 0.05, "momentum": 0.8}, id="sgd-mom"),
    pytest.param(SGD, {"lr": 0.05}, id="sgd-plain"),
    pytest.param(RMS, {"lr": 0.01, "momentum": 0.3}, id="rms-mom"),
]


@pytest.mark.parametrize("sched", ["step", "onecycle", "cyclic"])
@pytest.mark.parametrize(("cls", "kw"), SCHED_OPTS)
def test_lr_scheduler_stepping_wrapper_bit_identical(cls, kw, sched):
    """README: "LR schedulers work, also ones that warm ``lr`` up before the first step or turn
    ``momentum`` on (OneCycleLR ...): the paged state follows the hyper-parameters as torch's
    would". The wrapper's groups carry the scheduler's lr (and OneCycle's momentum / betas)."""
    steps = 5
    pair = Pair(cls, **kw)
    s1 = _sched(sched, pair.opt, steps)
    s2 = _sched(sched, pair.ropt.opt, steps)
    for k, (ids, coef) in enumerate(_batches(3, steps=steps)):
        for g1, g2 in zip(pair.opt.param_groups, pair.ropt.param_groups, strict=True):
            assert g1["lr"] == g2["lr"]
        pair.step(ids, coef)
        s1.step()
        s2.step()
        pair.check(what=f"{sched} step {k}")
    _check_state(pair.opt, pair.rt)
    assert s1.get_last_lr() == s2.get_last_lr()


# ============================================================================ gradient clipping

CLIP_OPTS = [
    pytest.param(A, {"lr": 0.05}, id="adam"),
    pytest.param(SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}, id="sgd-mom-wd"),
]


@pytest.mark.parametrize(
    "clip", [(0.5, 2.0), (1e6, 2.0), (0.3, float("inf"))], ids=["l2", "l2-noop", "inf"]
)
@pytest.mark.parametrize(("cls", "kw"), CLIP_OPTS)
def test_clip_grad_norm_over_param_groups_matches_dense(cls, kw, clip):
    """README: "clipping over ``param_groups`` work[s] in torch's usual order ...
    ``clip_grad_norm_([p for g in opt.param_groups for p in g['params']], 1.0)``": the total
    norm counts the table rows' gradients and the clipped step equals the dense one."""
    pair = Pair(cls, **kw)
    for k, (ids, coef) in enumerate(_batches(4, steps=3)):
        n1, n2 = pair.step(ids, coef, clip=clip)
        _same(n1.detach(), n2.detach(), f"total norm step {k}")
        pair.check(what=f"clip step {k}")


def test_clip_over_model_parameters_does_not_reach_the_table():
    """README: clip over the optimizer's groups, "not ``model.parameters()``, which does not reach
    the tables": clipping ``model.parameters()`` clips (and counts) the head only, and the table
    steps with its unclipped gradient."""
    pair = Pair(A, lr=0.05)
    for ids, coef in _batches(5, steps=3):
        pair.opt.zero_grad()
        pair.lib_loss(ids, coef).backward()
        pair.ropt.zero_grad()
        pair.ref_loss(ids, coef).backward()
        n1 = torch.nn.utils.clip_grad_norm_(list(pair.model.parameters()), 0.05)
        n2 = torch.nn.utils.clip_grad_norm_(list(pair.rhead.parameters()), 0.05)
        _same(n1.detach(), n2.detach(), "norm of the head alone")
        pair.opt.step()
        pair.ropt.step()
        pair.check()


def test_prepare_grads_then_clip_matches_dense():
    """``opt.prepare_grads()`` merges the row gradients explicitly; clipping after it (and after a
    second backward merged at the next merge, gradient accumulation) equals dense training."""
    pair = Pair(A, lr=0.05, weight_decay=0.01)
    bs = _batches(6, steps=3, lookups=2)
    for ids, coef in bs:
        pair.opt.zero_grad()
        pair.ropt.zero_grad()
        pair.rt.begin(*ids)
        # micro-batch 1 and 2, groups read between them (prepare_grads)
        pair.lib_loss(ids[:1], coef[:1]).backward()
        pair.opt.prepare_grads()
        pair.lib_loss(ids[1:], coef[1:]).backward()
        pair.ref_loss(ids[:1], coef[:1], begin=False).backward()
        pair.ref_loss(ids[1:], coef[1:], begin=False).backward()
        lp = [p for g in pair.opt.param_groups for p in g["params"]]
        rp = [p for g in pair.ropt.param_groups for p in g["params"]]
        n1 = torch.nn.utils.clip_grad_norm_(lp, 0.7)
        n2 = torch.nn.utils.clip_grad_norm_(rp, 0.7)
        _same(n1.detach(), n2.detach(), "total norm")
        pair.opt.step()
        pair.ropt.step()
        pair.check()


def test_clip_with_scheduler_and_weight_decay_combined():
    """Clipping + OneCycleLR + AdamW weight decay + maximize in one loop, all bit-identical."""
    steps = 5
    pair = Pair(AW, lr=0.05, weight_decay=0.1, maximize=True)
    s1 = _sched("onecycle", pair.opt, steps)
    s2 = _sched("onecycle", pair.ropt.opt, steps)
    for ids, coef in _batches(7, steps=steps):
        n1, n2 = pair.step(ids, coef, clip=(0.8, 2.0))
        _same(n1.detach(), n2.detach(), "norm")
        s1.step()
        s2.step()
        pair.check()
    _check_state(pair.opt, pair.rt)


# ============================================================================ float16 / bfloat16 / float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(SGD, {"lr": 0.05, "momentum": 0.9}, id="sgd-mom"),
        pytest.param(A, {"lr": 0.01, "weight_decay": 0.01}, id="adam-wd"),
    ],
)
def test_low_precision_tables_match_dense_to_rounding(cls, kw, dtype):
    """README: with float16 / bfloat16 arithmetic "results match a dense table to rounding";
    the lookups are of the table's dtype."""
    pair = Pair(cls, dtype=dtype, **kw)
    for ids, coef in _batches(8, steps=3):
        assert pair.emb(ids[0]).dtype == dtype
        pair.opt.zero_grad()  # the probe lookup above is discarded
        pair.step(ids, coef)
    pair.check(exact=False)
    _check_state(pair.opt, pair.rt, exact=False)


def test_low_precision_plain_sgd_without_head_is_exact():
    """Plain SGD on a float16 table: each row update is one rounding of ``w - lr*g`` in float16 on
    both sides (same gradient sums), so within one ulp (README: "to rounding")."""
    pair = Pair(SGD, dtype=torch.float16, head=False, lr=0.1)
    for ids, coef in _batches(9, steps=3):
        pair.step(ids, coef)
    got = _table(pair.emb.weight).float()
    want = pair.rt.W.float()
    ulp = torch.finfo(torch.float16).eps * want.abs().clamp_min(1.0)
    assert ((got - want).abs() <= 2 * ulp).all()


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}, id="sgd-mom-wd"),
    ],
)
def test_float64_table_with_float64_head_and_clip_bit_identical(cls, kw):
    pair = Pair(cls, dtype=torch.float64, **kw)
    for ids, coef in _batches(10, steps=3):
        n1, n2 = pair.step(ids, coef, clip=(0.6, 2.0))
        assert n1.dtype == torch.float64
        _same(n1.detach(), n2.detach(), "norm")
        pair.check()
    tabs = _state_tables(pair.opt)
    assert all(t.dtype == torch.float64 for t in tabs.values())


# ============================================================================ padding_idx / max_norm


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(gl.OffloadedEmbedding, {"padding_idx": 0}), (gl.OffloadedEmbeddingBag, {"max_norm": 1.0})],
)
def test_modules_refuse_padding_idx_max_norm_sparse(cls, kw):
    """README / docstrings: the modules take no ``padding_idx``, ``max_norm`` or ``sparse`` (a
    ``TypeError`` for the unknown keyword)."""
    with pytest.raises(TypeError):
        cls(N, D, **CPU, **kw)


# ============================================================================ several lookups, accumulation


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(A, {"lr": 0.05, "weight_decay": 0.05}, id="adam-wd"),
        pytest.param(SGD, {"lr": 0.05, "momentum": 0.9, "maximize": True}, id="sgd-mom-max"),
    ],
)
def test_overlapping_lookups_and_backward_passes_bit_identical(cls, kw, passes):
    """README: several lookups of a table in a step (and several backward passes) are summed in
    autograd's order: bit-identical to a dense ``nn.Embedding`` trained the same way."""
    pair = Pair(cls, **kw)
    for ids, coef in _batches(11, steps=3, lookups=3):
        pair.opt.zero_grad()
        pair.ropt.zero_grad()
        pair.rt.begin(*ids)
        # split the three lookups over `passes` backward passes
        parts = (
            [list(range(3))] if passes == 1 else ([[0], [1, 2]] if passes == 2 else [[0], [1], [2]])
        )
        for part in parts:
            sub_i = [ids[j] for j in part]
            sub_c = [coef[j] for j in part]
            pair.lib_loss(sub_i, sub_c).backward()
            pair.ref_loss(sub_i, sub_c, begin=False).backward()
        pair.opt.step()
        pair.ropt.step()
        pair.check()
    _check_state(pair.opt, pair.rt)


def test_same_ids_looked_up_in_2d_and_1d_in_one_step():
    """A 2-D lookup and a 1-D lookup of the same ids in one step (shapes ``ids.shape + (D,)``)."""
    pair = Pair(A, lr=0.05)
    g = torch.Generator().manual_seed(12)
    for _ in range(3):
        ids2 = torch.randint(0, 10, (3, 4), generator=g)
        ids1 = ids2.reshape(-1).flip(0)
        c2 = torch.randn(3, 4, D, generator=g)
        c1 = torch.randn(12, D, generator=g)
        pair.opt.zero_grad()
        o2, o1 = pair.emb(ids2), pair.emb(ids1)
        assert o2.shape == (3, 4, D)
        ((o2 * c2).sum() + (o1 * o1 * c1).sum() + (pair.head(o1) ** 2).sum()).backward()
        pair.ropt.zero_grad()
        pair.rt.begin(ids2, ids1)
        r2, r1 = pair.rt.lookup(ids2), pair.rt.lookup(ids1)
        ((r2 * c2).sum() + (r1 * r1 * c1).sum() + (pair.rhead(r1) ** 2).sum()).backward()
        pair.opt.step()
        pair.ropt.step()
        pair.check()


# ============================================================================ zero_grad


@pytest.mark.parametrize(
    ("cls", "kw", "set_to_none"),
    [
        pytest.param(A, {"lr": 0.05, "weight_decay": 0.1}, False, id="adam-wd-zeros"),
        pytest.param(RMS, {"lr": 0.01, "centered": True}, True, id="rms-centered-none"),
    ],
)
def test_zero_grad_modes_in_a_normal_loop_bit_identical(cls, kw, set_to_none):
    pair = Pair(cls, **kw)
    for ids, coef in _batches(13, steps=4):
        pair.step(ids, coef, set_to_none=set_to_none)
        pair.check()
    _check_state(pair.opt, pair.rt)


@pytest.mark.parametrize(
    ("cls", "kw", "set_to_none"),
    [
        pytest.param(A, {"lr": 0.05}, False, id="adam-zeros"),
        pytest.param(SGD, {"lr": 0.05, "momentum": 0.9}, True, id="sgd-mom-none"),
    ],
)
def test_zero_grad_discards_lookups_then_step_moves_dense_only(cls, kw, set_to_none):
    """Docstring: "a table with no lookup since the last step is not stepped, even where
    ``zero_grad(set_to_none=False)`` would have left torch a zero gradient to count a step for";
    the dense head does what torch does with its zeroed (or None) gradient; the step count of the
    table does not move; training then continues bit-identically."""
    pair = Pair(cls, **kw)
    bs = _batches(14, steps=4)
    pair.step(*bs[0])
    count0 = _inner_step_count(pair.opt)
    w_before = _table(pair.emb.weight)
    # a forward + backward that zero_grad throws away, then a step
    pair.lib_loss(*bs[1]).backward()
    pair.opt.zero_grad(set_to_none=set_to_none)
    pair.opt.step()
    pair.ref_loss(*bs[1]).backward()
    pair.ropt.zero_grad(set_to_none=set_to_none)
    pair.ropt.step()
    _same(_table(pair.emb.weight), w_before, "table after a discarded lookup")
    assert _inner_step_count(pair.opt) == count0
    pair.check(what="after the discarded step")
    for ids, coef in bs[2:]:
        pair.step(ids, coef, set_to_none=set_to_none)
        pair.check(what="after resuming")
    _check_state(pair.opt, pair.rt)
    want = pair.ropt.step_count(pair.rt)
    assert _inner_step_count(pair.opt) == (None if want is None else float(want))


def _inner_step_count(opt: gl.OffloadedOptimizer, table_index: int = 0) -> float:
    """The table's step count from the optimizer's state dict (the one entry per table in the
    inner state whose param index comes after the dense params)."""
    sd = opt.state_dict()["inner"]
    n_dense = sum(1 for _ in _dense_params(opt))
    st = sd["state"][n_dense + table_index]
    return float(st["step"]) if "step" in st else None


def _dense_params(opt):
    # the tables' per-step variables come last in the group, dense params first
    for g in opt.state_dict()["inner"]["param_groups"]:
        yield from g["params"][: len(g["params"]) - len(opt.pagers)]


# ============================================================================ EmbeddingBag

BAG_FORMS = ["2d", "offsets", "offsets-last"]


def _bag_batch(g: torch.Generator, form: str, n_bags: int = 4, width: int = 3):
    if form == "2d":
        ids = torch.randint(0, 15, (n_bags, width), generator=g)
        ids[1, 1] = ids[0, 0]
        return ids, None
    lens = [3, 0, 4, 2][:n_bags]  # one empty bag
    ids = torch.randint(0, 15, (sum(lens),), generator=g)
    ids[4] = ids[0]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()])
    if form == "offsets-last":
        starts = torch.cat([starts, torch.tensor([ids.numel()])])
    return ids, starts


@pytest.mark.parametrize("form", BAG_FORMS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_modes_and_forms_bit_identical(mode, form):
    """``OffloadedEmbeddingBag`` = ``nn.EmbeddingBag`` over the step's rows, 2-D input or 1-D
    input with offsets (``include_last_offset`` too), trained by Adam with a dense head."""
    w0 = _w0(20)
    last = form == "offsets-last"
    bag = _bag(w0, mode, include_last_offset=last)
    head = _head(20)
    model = nn.ModuleDict({"bag": bag, "head": head})
    opt = gl.OffloadedOptimizer(A, model, lr=0.05, weight_decay=0.01)
    rt, rhead = RefTable(w0), copy.deepcopy(head)
    ropt = RefOpt(A, [*rhead.parameters(), rt.P], [rt], lr=0.05, weight_decay=0.01)
    g = torch.Generator().manual_seed(21)
    for _ in range(3):
        ids, offs = _bag_batch(g, form)
        c = torch.randn(4, D, generator=g)
        opt.zero_grad()
        out = bag(ids, offs)
        assert out.shape == (4, D)
        ((out * c).sum() + (head(out) ** 2).sum()).backward()
        opt.step()
        ropt.zero_grad()
        rt.begin(ids)
        rout = rt.bag(ids, offs, mode=mode, include_last_offset=last)
        ((rout * c).sum() + (rhead(rout) ** 2).sum()).backward()
        ropt.step()
        _same(_table(bag.weight), rt.W, f"bag {mode} {form}")
        _same(head.weight.detach(), rhead.weight.detach(), "head")
    _check_state(opt, rt)


@pytest.mark.parametrize(
    ("form", "dtype"),
    [
        pytest.param("2d", torch.float32, id="2d-f32"),
        pytest.param("offsets", torch.float32, id="offsets-f32"),
        pytest.param("offsets-last", torch.float64, id="offsets-last-f64"),
    ],
)
def test_bag_per_sample_weights_sum_bit_identical(form, dtype):
    """``per_sample_weights`` (a float tensor of the input's shape) with ``mode='sum'``: the
    weights scale each entry's gradient, as in torch; SGD with momentum and clipping over the
    groups on top."""
    w0 = _w0(22, dtype=dtype)
    last = form == "offsets-last"
    bag = _bag(w0, "sum", include_last_offset=last)
    opt = gl.OffloadedOptimizer(SGD, bag, lr=0.1, momentum=0.9)
    rt = RefTable(w0)
    ropt = RefOpt(SGD, [rt.P], [rt], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(23)
    for _ in range(3):
        ids, offs = _bag_batch(g, form)
        psw = torch.randn(ids.shape, generator=g).to(dtype)
        c = torch.randn(4, D, generator=g).to(dtype)
        opt.zero_grad()
        out = bag(ids, offs, per_sample_weights=psw)
        ((out * c).sum() + (out**2).sum()).backward()
        n1 = torch.nn.utils.clip_grad_norm_(
            [p for gr in opt.param_groups for p in gr["params"]], 1.0
        )
        opt.step()
        ropt.zero_grad()
        rt.begin(ids)
        rout = rt.bag(ids, offs, mode="sum", per_sample_weights=psw, include_last_offset=last)
        ((rout * c).sum() + (rout**2).sum()).backward()
        n2 = torch.nn.utils.clip_grad_norm_([rt.P], 1.0)
        ropt.step()
        _same(n1.detach(), n2.detach(), "norm")
        _same(_table(bag.weight), rt.W, f"bag psw {form}")
    _check_state(opt, rt)


def test_bag_per_sample_weights_receive_torchs_gradient():
    """``per_sample_weights`` that require grad receive torch's gradient (the bag output is
    differentiable in them as in ``F.embedding_bag``; to rounding: nothing promises this sum's
    order), and the forward equals ``F.embedding_bag`` exactly."""
    w0 = _w0(24)
    bag = _bag(w0, "sum")
    gl.OffloadedOptimizer(SGD, bag, lr=0.1)
    ids = torch.tensor([1, 2, 2, 5, 7])
    offs = torch.tensor([0, 2])
    psw = torch.randn(5, requires_grad=True)
    psw_ref = psw.detach().clone().requires_grad_(True)
    out = bag(ids, offs, per_sample_weights=psw)
    ref = F.embedding_bag(ids, w0.clone(), offs, mode="sum", per_sample_weights=psw_ref)
    _same(out.detach(), ref.detach(), "forward")
    (out**2).sum().backward()
    (ref**2).sum().backward()
    torch.testing.assert_close(psw.grad, psw_ref.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["mean"])
def test_bag_per_sample_weights_outside_sum_refused_and_nothing_recorded(mode):
    """torch takes ``per_sample_weights`` only with mode 'sum'; the docstring: bad arguments are
    "checked before the lookup is recorded ..., so a bad call leaves nothing for the step"."""
    w0 = _w0(25)
    bag = _bag(w0, mode)
    opt = gl.OffloadedOptimizer(A, bag, lr=0.1)
    ids = torch.tensor([1, 2, 3, 4])
    offs = torch.tensor([0, 2])
    with pytest.raises((NotImplementedError, ValueError)):
        bag(ids, offs, per_sample_weights=torch.ones(4))
    opt.step()
    _same(_table(bag.weight), w0, "table")
    assert not _state_tables(opt) or all(bool((t == 0).all()) for t in _state_tables(opt).values())


def test_bag_2d_input_ignores_include_last_offset():
    """Docstring: a 2-D input is one bag per row "whatever include_last_offset says"."""
    w0 = _w0(26)
    bag = _bag(w0, "sum", include_last_offset=True)
    opt = gl.OffloadedOptimizer(SGD, bag, lr=0.1)
    ids = torch.tensor([[1, 2, 2], [4, 5, 6]])
    out = bag(ids)
    _same(out.detach(), F.embedding_bag(ids, w0, mode="sum"), "forward")
    out.pow(2).sum().backward()
    opt.step()
    rt = RefTable(w0)
    ropt = RefOpt(SGD, [rt.P], [rt], lr=0.1)
    rt.begin(ids)
    rt.bag(ids, mode="sum").pow(2).sum().backward()
    ropt.step()
    _same(_table(bag.weight), rt.W, "table")


def test_bag_and_embedding_share_no_rows_two_tables_one_optimizer():
    """An embedding and a bag over different tables under one optimizer with per-table groups."""
    w1, w2 = _w0(27), _w0(28)
    emb, bag = _emb(w1), _bag(w2, "mean")
    head = _head(27)
    model = nn.ModuleDict({"emb": emb, "bag": bag, "head": head})
    opt = gl.OffloadedOptimizer(
        A, [{"params": bag, "lr": 0.2, "weight_decay": 0.1}, model], lr=0.03, amsgrad=True
    )
    r1, r2, rhead = RefTable(w1), RefTable(w2), copy.deepcopy(head)
    # dicts first, then the group with the keyword options (dense params, then emb's rows)
    ropt = RefOpt(
        A,
        [
            {"params": [r2.P], "lr": 0.2, "weight_decay": 0.1},
            {"params": [*rhead.parameters(), r1.P]},
        ],
        [r1, r2],
        lr=0.03,
        amsgrad=True,
    )
    g = torch.Generator().manual_seed(29)
    for _ in range(3):
        i1 = torch.randint(0, N, (6,), generator=g)
        i2 = torch.randint(0, N, (3, 4), generator=g)
        opt.zero_grad()
        (head(emb(i1)[:3] * bag(i2)) ** 2).sum().backward()
        opt.step()
        ropt.zero_grad()
        r1.begin(i1)
        r2.begin(i2)
        (rhead(r1.lookup(i1)[:3] * r2.bag(i2, mode="mean")) ** 2).sum().backward()
        ropt.step()
        _same(_table(emb.weight), r1.W, "emb")
        _same(_table(bag.weight), r2.W, "bag")
        _same(head.bias.detach(), rhead.bias.detach(), "head")


# ============================================================================ two optimizers


@pytest.mark.parametrize("with_sched", [False, True], ids=["plain", "sched"])
def test_two_optimizers_over_different_tables(with_sched):
    """Two ``OffloadedOptimizer``s (Adam on one table, SGD-momentum on another table plus the
    head) trained in one loop each match their own dense twin; an LR scheduler on one of them
    does not touch the other."""
    w1, w2 = _w0(30), _w0(31)
    e1, e2 = _emb(w1), _emb(w2)
    head = _head(30)
    o1 = gl.OffloadedOptimizer(A, e1, lr=0.05, weight_decay=0.05)
    o2 = gl.OffloadedOptimizer(SGD, nn.ModuleList([e2, head]), lr=0.05, momentum=0.9)
    r1, r2, rhead = RefTable(w1), RefTable(w2), copy.deepcopy(head)
    q1 = RefOpt(A, [r1.P], [r1], lr=0.05, weight_decay=0.05)
    q2 = RefOpt(SGD, [*rhead.parameters(), r2.P], [r2], lr=0.05, momentum=0.9)
    if with_sched:
        s1 = torch.optim.lr_scheduler.StepLR(o1, 1, gamma=0.5)
        t1 = torch.optim.lr_scheduler.StepLR(q1.opt, 1, gamma=0.5)
    for ids, coef in _batches(32, steps=4):
        o1.zero_grad()
        o2.zero_grad()
        x = e1(ids[0]) * e2(ids[1])
        ((head(x) ** 2).sum() + (x * coef[0]).sum()).backward()
        o1.step()
        o2.step()
        q1.zero_grad()
        q2.zero_grad()
        r1.begin(ids[0])
        r2.begin(ids[1])
        y = r1.lookup(ids[0]) * r2.lookup(ids[1])
        ((rhead(y) ** 2).sum() + (y * coef[0]).sum()).backward()
        q1.step()
        q2.step()
        if with_sched:
            s1.step()
            t1.step()
        _same(_table(e1.weight), r1.W, "table 1")
        _same(_table(e2.weight), r2.W, "table 2")
        _same(head.weight.detach(), rhead.weight.detach(), "head")
    assert o2.param_groups[0]["lr"] == 0.05
    _check_state(o1, r1)
    _check_state(o2, r2)


def test_second_optimizer_over_a_taken_table_is_refused_and_first_keeps_training():
    """README: "A table belongs to one ``OffloadedOptimizer`` at a time"."""
    pair = Pair(A, lr=0.05)
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(SGD, pair.emb, lr=0.1)
    for ids, coef in _batches(33, steps=2):
        pair.step(ids, coef)
        pair.check()


# ============================================================================ state_dict resume

RESUME_OPTS = [
    pytest.param(A, {"lr": 0.05, "weight_decay": 0.01, "amsgrad": True}, id="adam-ams"),
    pytest.param(SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}, id="sgd-nesterov"),
    pytest.param(RMS, {"lr": 0.01, "momentum": 0.5, "centered": True}, id="rms"),
    pytest.param(NA, {"lr": 0.05}, id="nadam"),
]


def _make_lib(cls, kw, w0, head_state, sched=None, steps=8):
    emb = _emb(w0)
    head = _head(0)
    head.load_state_dict(head_state)
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = gl.OffloadedOptimizer(cls, model, **kw)
    s = _sched(sched, opt, steps) if sched else None
    return model, opt, s


def _lib_train(model, opt, batches, sched=None):
    for ids, coef in batches:
        opt.zero_grad()
        _loss([model["emb"](i) for i in ids], coef, model["head"]).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("sched", [None, "onecycle"], ids=["nosched", "onecycle"])
@pytest.mark.parametrize(("cls", "kw"), RESUME_OPTS)
def test_state_dict_resume_in_fresh_objects_bit_identical(cls, kw, sched):
    """Optimizer ``state_dict()`` mid-training (plus the model's and the scheduler's) loaded into
    freshly built objects continues bit-identically to an uninterrupted run."""
    steps = 6
    w0 = _w0(40)
    h0 = _head(40).state_dict()
    bs = _batches(41, steps=steps)
    m_a, o_a, s_a = _make_lib(cls, kw, w0, h0, sched, steps)
    _lib_train(m_a, o_a, bs, s_a)

    m_b, o_b, s_b = _make_lib(cls, kw, w0, h0, sched, steps)
    _lib_train(m_b, o_b, bs[:3], s_b)
    buf = io.BytesIO()
    torch.save(
        {
            "model": m_b.state_dict(),
            "opt": o_b.state_dict(),
            "sched": s_b.state_dict() if s_b else None,
        },
        buf,
    )
    del o_b, s_b
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    m_c, o_c, s_c = _make_lib(cls, kw, _w0(99), _head(99).state_dict(), sched, steps)
    m_c.load_state_dict(saved["model"])
    o_c.load_state_dict(saved["opt"])
    if s_c is not None:
        s_c.load_state_dict(saved["sched"])
    _lib_train(m_c, o_c, bs[3:], s_c)

    _same(_table(m_c["emb"].weight), _table(m_a["emb"].weight), "table")
    for p, q in zip(m_c["head"].parameters(), m_a["head"].parameters(), strict=True):
        _same(p.detach(), q.detach(), "head")
    ta, tc = _state_tables(o_a), _state_tables(o_c)
    assert sorted(ta) == sorted(tc)
    for k in ta:
        _same(tc[k], ta[k], f"state {k}")
    assert o_c.param_groups[0]["lr"] == o_a.param_groups[0]["lr"]
    assert _inner_step_count(o_c) == _inner_step_count(o_a)


@pytest.mark.parametrize(("cls", "kw"), RESUME_OPTS[1:2])
def test_state_dict_rewind_same_objects_replays_identically(cls, kw):
    """Loading an earlier ``state_dict`` (model and optimizer) into the SAME objects rewinds them:
    replaying the same batches gives the same tables, bit for bit."""
    w0 = _w0(42)
    model, opt, _ = _make_lib(cls, kw, w0, _head(42).state_dict())
    bs = _batches(43, steps=5)
    _lib_train(model, opt, bs[:2])
    sd_m = copy.deepcopy(model.state_dict())
    sd_o = copy.deepcopy(opt.state_dict())
    _lib_train(model, opt, bs[2:])
    w_first = _table(model["emb"].weight)
    st_first = {k: v.clone() for k, v in _state_tables(opt).items()}
    model.load_state_dict(sd_m)
    opt.load_state_dict(sd_o)
    _same(_table(model["emb"].weight), sd_m["emb.weight"], "rewound table")
    _lib_train(model, opt, bs[2:])
    _same(_table(model["emb"].weight), w_first, "replayed table")
    for k, v in _state_tables(opt).items():
        _same(v, st_first[k], f"replayed state {k}")


def test_state_dict_resume_matches_dense_reference_after_load():
    """Resumed training still equals the dense twin (not just the uninterrupted library run)."""
    pair = Pair(A, lr=0.05, weight_decay=0.02)
    bs = _batches(44, steps=5)
    for ids, coef in bs[:2]:
        pair.step(ids, coef)
    sd_o = pair.opt.state_dict()
    sd_m = pair.model.state_dict()
    del pair.opt
    emb2 = gl.OffloadedEmbedding(N, D, **CPU)
    head2 = _head(77)
    model2 = nn.ModuleDict({"emb": emb2, "head": head2})
    model2.load_state_dict(sd_m)
    opt2 = gl.OffloadedOptimizer(A, model2, lr=0.05, weight_decay=0.02)
    opt2.load_state_dict(sd_o)
    pair.emb, pair.head, pair.model, pair.opt = emb2, head2, model2, opt2
    for ids, coef in bs[2:]:
        pair.step(ids, coef)
        pair.check()
    _check_state(pair.opt, pair.rt)


def test_bag_state_dict_resume_bit_identical():
    """The same resume for an ``OffloadedEmbeddingBag`` with per-sample weights."""
    w0 = _w0(45)
    g = torch.Generator().manual_seed(46)
    batches = []
    for _ in range(5):
        ids, offs = _bag_batch(g, "offsets")
        batches.append((ids, offs, torch.rand(ids.shape, generator=g)))

    def build(w):
        bag = _bag(w, "sum")
        return bag, gl.OffloadedOptimizer(RMS, bag, lr=0.01, momentum=0.4, centered=True)

    def train(bag, opt, bs):
        for ids, offs, psw in bs:
            opt.zero_grad()
            (bag(ids, offs, per_sample_weights=psw) ** 2).sum().backward()
            opt.step()

    b_a, o_a = build(w0)
    train(b_a, o_a, batches)
    b_b, o_b = build(w0)
    train(b_b, o_b, batches[:2])
    sd_m, sd_o = b_b.state_dict(), o_b.state_dict()
    b_c, o_c = build(_w0(0))
    b_c.load_state_dict(sd_m)
    o_c.load_state_dict(sd_o)
    train(b_c, o_c, batches[2:])
    _same(_table(b_c.weight), _table(b_a.weight), "bag table")
    for k, v in _state_tables(o_a).items():
        _same(_state_tables(o_c)[k], v, f"state {k}")


# ============================================================================ checkpoints


def _fmt(fmt: str) -> str:
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    return fmt


@pytest.mark.parametrize(
    ("cls", "kw", "fmt"),
    [
        pytest.param(A, {"lr": 0.05, "weight_decay": 0.01}, "npy", id="adam-wd-npy"),
        pytest.param(A, {"lr": 0.05, "weight_decay": 0.01}, "hdf5", id="adam-wd-hdf5"),
        pytest.param(A, {"lr": 0.05, "weight_decay": 0.01}, "zarr", id="adam-wd-zarr"),
        pytest.param(
            SGD, {"lr": 0.05, "momentum": 0.9, "maximize": True}, "npy", id="sgd-mom-max-npy"
        ),
    ],
)
def test_checkpoint_resume_bit_identical(cls, kw, fmt, tmp_path):
    """README: ``gl.load_checkpoint`` "resumes bit-identically" (tables, state tables, step counts);
    a StepLR scheduler saved beside it with ``torch.save``."""
    _fmt(fmt)
    steps = 6
    w0 = _w0(50)
    h0 = _head(50).state_dict()
    bs = _batches(51, steps=steps)
    m_a, o_a, s_a = _make_lib(cls, kw, w0, h0, "step", steps)
    _lib_train(m_a, o_a, bs, s_a)

    m_b, o_b, s_b = _make_lib(cls, kw, w0, h0, "step", steps)
    _lib_train(m_b, o_b, bs[:3], s_b)
    gl.save_checkpoint(
        tmp_path / "ck", {"model": m_b, "optimizer": o_b}, format=fmt, progress=False
    )
    torch.save(s_b.state_dict(), tmp_path / "sched.pt")
    _lib_train(m_b, o_b, bs[3:4], s_b)  # training on after the save does not change the files

    m_c, o_c, s_c = _make_lib(cls, kw, _w0(98), _head(98).state_dict(), "step", steps)
    gl.load_checkpoint(tmp_path / "ck", {"model": m_c, "optimizer": o_c})
    s_c.load_state_dict(torch.load(tmp_path / "sched.pt", weights_only=False))
    _lib_train(m_c, o_c, bs[3:], s_c)
    _same(_table(m_c["emb"].weight), _table(m_a["emb"].weight), "table")
    for p, q in zip(m_c["head"].parameters(), m_a["head"].parameters(), strict=True):
        _same(p.detach(), q.detach(), "head")
    for k, v in _state_tables(o_a).items():
        _same(_state_tables(o_c)[k], v, f"state {k}")
    assert _inner_step_count(o_c) == _inner_step_count(o_a)
    assert o_c.param_groups[0]["lr"] == o_a.param_groups[0]["lr"]


def test_checkpoint_of_two_optimizers_and_a_bag_resume_bit_identical(tmp_path):
    """Two optimizers over an embedding and a bag, both in one checkpoint."""
    w1, w2 = _w0(52), _w0(53)

    def build(a, b):
        emb, bag = _emb(a), _bag(b, "max")
        return (
            emb,
            bag,
            gl.OffloadedOptimizer(A, emb, lr=0.05),
            gl.OffloadedOptimizer(AG, bag, lr=0.1),
        )

    g = torch.Generator().manual_seed(54)
    bs = [
        (torch.randint(0, N, (4,), generator=g), torch.randint(0, N, (4, 3), generator=g))
        for _ in range(5)
    ]

    def train(emb, bag, o1, o2, part):
        for i1, i2 in part:
            o1.zero_grad()
            o2.zero_grad()
            (emb(i1) * bag(i2)).pow(2).sum().backward()
            o1.step()
            o2.step()

    full = build(w1, w2)
    train(*full, bs)
    half = build(w1, w2)
    train(*half, bs[:2])
    gl.save_checkpoint(
        tmp_path / "ck", {"e": half[0], "b": half[1], "o1": half[2], "o2": half[3]}, progress=False
    )
    new = build(_w0(0), _w0(1))
    gl.load_checkpoint(tmp_path / "ck", {"e": new[0], "b": new[1], "o1": new[2], "o2": new[3]})
    train(*new, bs[2:])
    _same(_table(new[0].weight), _table(full[0].weight), "emb")
    _same(_table(new[1].weight), _table(full[1].weight), "bag")
    for o_new, o_full in ((new[2], full[2]), (new[3], full[3])):
        for k, v in _state_tables(o_full).items():
            _same(_state_tables(o_new)[k], v, f"state {k}")


# ============================================================================ switchers

FACTORIES = [
    pytest.param("speedtorch", id="ModelFactory"),
    pytest.param("pytorch", id="PytorchModelFactory"),
]


def _factories(kind, model, var, opt, n, dtype="float32"):
    emb = getattr(model, var)
    if kind == "speedtorch":
        ms = gl.ModelFactory(emb, n, D, datatype=dtype, placement="cpu")
        os_ = gl.OptimizerFactory(opt, n, D, model, var, dtype=dtype, placement="cpu")
    else:
        ms = gl.PytorchModelFactory(emb, n, D, datatype=dtype, deviceType="cpu")
        os_ = gl.PytorchOptimizerFactory(opt, n, D, model, var, dtype=dtype, deviceType="cpu")
    return ms, os_


class SwModel(nn.Module):
    def __init__(self, dtype=torch.float32, padding_idx=None):
        super().__init__()
        self.u = nn.Embedding(3, D, padding_idx=padding_idx).to(dtype)
        self.head = nn.Linear(D, 1).to(dtype)


class SwPair:
    """A switcher-driven torch model and its dense twin (same torch optimizer class)."""

    def __init__(self, kind, cls, *, seed=0, dtype=torch.float32, padding_idx=None, **kw):
        torch.manual_seed(seed)
        self.model = SwModel(dtype, padding_idx)
        self.opt = cls(self.model.parameters(), **kw)
        name = str(dtype).replace("torch.", "")
        self.ms, self.os = _factories(kind, self.model, "u", self.opt, N, name)
        w0 = _w0(seed, dtype=dtype)
        self.ms.customInit(lambda t: t.copy_(w0))
        _same(torch.as_tensor(self.ms.getNumpyVersion()).to(dtype), w0, "initialised table")
        self.os.optInit()
        self.rt = RefTable(w0, padding_idx=padding_idx)
        self.rhead = copy.deepcopy(self.model.head)
        # model.parameters(): u.weight, then head
        self.ropt = RefOpt(cls, [self.rt.P, *self.rhead.parameters()], [self.rt], **kw)

    def lib_loss(self, ids, coef):
        locs = self.ms.beforeForwardPass(*ids)
        self.os.beforeForwardPass(*ids)
        locs = locs if isinstance(locs, (tuple, list)) else (locs,)
        return _loss([self.model.u(torch.as_tensor(li)) for li in locs], coef, self.model.head)

    def step(self, ids, coef, *, clip=None, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)
        self.lib_loss(ids, coef).backward()
        self.ropt.zero_grad(set_to_none=set_to_none)
        self.rt.begin(*ids)
        _loss([self.rt.lookup(i) for i in ids], coef, self.rhead).backward()
        if clip is not None:
            n1 = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            rp = [p for g in self.ropt.param_groups for p in g["params"]]
            n2 = torch.nn.utils.clip_grad_norm_(rp, clip)
            torch.testing.assert_close(n1.detach(), n2.detach(), rtol=1e-6, atol=0)
        self.opt.step()
        self.ropt.step()
        self.ms.afterOptimizerStep(*ids)
        self.os.afterOptimizerStep(*ids)

    def table(self):
        # NumPy has no bfloat16: such a table reads back as float32 (exact)
        return torch.as_tensor(self.ms.getNumpyVersion()).to(self.rt.W.dtype)

    def check(self, exact=True):
        if exact:
            _same(self.table(), self.rt.W, "switcher table")
            for p, q in zip(self.model.head.parameters(), self.rhead.parameters(), strict=True):
                _same(p.detach(), q.detach(), "head")
        else:
            torch.testing.assert_close(
                self.table().float(), self.rt.W.float(), **_TOL[self.rt.W.dtype]
            )

    def check_state(self):
        tabs = self.os.getNumpyVersion()
        for name, full in self.rt.full.items():
            assert name in tabs, f"switcher state {name!r} missing: {sorted(tabs)}"
            _same(torch.as_tensor(tabs[name]).to(full.dtype), full, f"switcher state {name}")


SW_OPTS = [
    pytest.param(A, {"lr": 0.05, "weight_decay": 0.05}, id="adam-wd"),
    pytest.param(AW, {"lr": 0.05, "weight_decay": 0.1, "maximize": True}, id="adamw-max"),
    pytest.param(SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}, id="sgd-nesterov"),
    pytest.param(RMS, {"lr": 0.01, "centered": True, "momentum": 0.3}, id="rms"),
]


@pytest.mark.parametrize(
    ("kind", "cls", "kw"),
    [
        pytest.param(
            k, *c.values, id=f"{c.id}-{'ModelFactory' if k == 'speedtorch' else 'Pytorch'}"
        )
        for k, c in zip(["speedtorch", "pytorch", "speedtorch", "pytorch"], SW_OPTS, strict=True)
    ],
)
def test_switchers_pos_neg_bit_identical(kind, cls, kw):
    """README "Duplicates": results equal training the whole table as one parameter with lazy
    per-row updates; two id sets per step (``beforeForwardPass(pos, neg)``), overlapping."""
    pair = SwPair(kind, cls, **kw)
    for ids, coef in _batches(60, steps=4, lookups=2):
        pair.step(ids, coef)
        pair.check()
    pair.check_state()


@pytest.mark.parametrize(
    ("kind", "sched"),
    [
        ("speedtorch", "step"),
        ("pytorch", "lambda"),
        ("speedtorch", "onecycle"),
        ("pytorch", "cyclic"),
    ],
)
def test_switchers_with_scheduler_and_clipping(kind, sched):
    """Switchers with a scheduler on the user's torch optimizer and clipping over
    ``model.parameters()`` (there the variable holds the batch's rows). The switcher's variable
    has one row per id position (distinct rows first, then zero rows), so the norm's reduction
    (and so the clipped step) may round differently from a tensor of the distinct rows only:
    compared to rounding."""
    steps = 5
    pair = SwPair(kind, A, lr=0.05, weight_decay=0.01)
    s1 = _sched(sched, pair.opt, steps)
    s2 = _sched(sched, pair.ropt.opt, steps)
    for ids, coef in _batches(61, steps=steps, lookups=2):
        pair.step(ids, coef, clip=0.5)
        s1.step()
        s2.step()
    torch.testing.assert_close(pair.table(), pair.rt.W, rtol=1e-5, atol=1e-6)
    for p, q in zip(pair.model.head.parameters(), pair.rhead.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["pytorch"])
def test_switchers_onecycle_turns_sgd_momentum_on(kind):
    """README: a checkpoint / state table a scheduler turned on (a momentum buffer) is paged:
    OneCycleLR sets SGD's momentum before the first step."""
    steps = 4
    pair = SwPair(kind, SGD, lr=0.05)
    s1 = _sched("onecycle", pair.opt, steps)
    s2 = _sched("onecycle", pair.ropt.opt, steps)
    assert pair.opt.param_groups[0]["momentum"] > 0
    for ids, coef in _batches(62, steps=steps):
        pair.step(ids, coef)
        s1.step()
        s2.step()
        pair.check()
    pair.check_state()


@pytest.mark.parametrize("kind", ["speedtorch"])
def test_switchers_float64_both_factories_bit_identical(kind):
    """Docstring: give a float64 model factory ``dtype='float64'`` on the optimizer factory too;
    then float64 training is bit-identical."""
    pair = SwPair(kind, A, dtype=torch.float64, lr=0.05, amsgrad=True)
    for ids, coef in _batches(63, steps=3):
        pair.step(ids, coef)
        pair.check()
    pair.check_state()


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("speedtorch", torch.float16), ("pytorch", torch.bfloat16)],
    ids=["f16", "bf16"],
)
def test_switchers_low_precision_match_to_rounding(kind, dtype):
    pair = SwPair(kind, SGD, dtype=dtype, lr=0.05, momentum=0.9)
    for ids, coef in _batches(64, steps=3):
        pair.step(ids, coef)
    pair.check(exact=False)


@pytest.mark.parametrize(("kind", "set_to_none"), [("speedtorch", False), ("pytorch", True)])
def test_switchers_zero_grad_modes(kind, set_to_none):
    pair = SwPair(kind, RMS, lr=0.01, momentum=0.5)
    for ids, coef in _batches(65, steps=3):
        pair.step(ids, coef, set_to_none=set_to_none)
        pair.check()
    pair.check_state()


@pytest.mark.parametrize(
    ("kind", "cls", "kw"),
    [
        pytest.param("speedtorch", A, {"lr": 0.05}, id="ModelFactory-adam"),
        pytest.param(
            "pytorch", SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}, id="Pytorch-sgd-wd"
        ),
    ],
)
def test_switchers_padding_idx_row_gets_no_gradient(kind, cls, kw):
    """README: an ``nn.Embedding`` with ``padding_idx`` has it taken as a global id of the table;
    that row gets no gradient, as in a full-table embedding (weight decay still moves it when it
    is in a batch)."""
    pad = 2
    pair = SwPair(kind, cls, padding_idx=pad, **kw)
    w0 = pair.table().clone()
    bs = _batches(66, steps=4, lookups=2)
    for ids, coef in bs:
        ids[0][3] = pad
        pair.step(ids, coef)
        pair.check()
    if not kw.get("weight_decay"):
        _same(pair.table()[pad], w0[pad], "padding row")


@pytest.mark.parametrize(("kind", "fmt"), [("speedtorch", "npy"), ("pytorch", "hdf5")])
def test_switchers_checkpoint_resume_bit_identical(kind, fmt, tmp_path):
    """README: ``save_checkpoint({"u": u_switch, "u_opt": u_opt_switch, "opt": optimizer})`` and
    ``load_checkpoint`` into freshly built switchers resume bit-identically (step counts too)."""
    _fmt(fmt)
    bs = _batches(67, steps=5)

    def build(seed):
        return SwPair(kind, A, seed=seed, lr=0.05, weight_decay=0.01)

    def train(p, part):
        for ids, coef in part:
            p.opt.zero_grad()
            p.lib_loss(ids, coef).backward()
            p.opt.step()
            p.ms.afterOptimizerStep(*ids)
            p.os.afterOptimizerStep(*ids)

    full = build(0)
    train(full, bs)
    half = build(0)
    train(half, bs[:2])
    objs = {"u": half.ms, "u_opt": half.os, "opt": half.opt, "model": half.model}
    gl.save_checkpoint(tmp_path / "ck", objs, format=fmt, progress=False)
    new = build(5)
    gl.load_checkpoint(
        tmp_path / "ck", {"u": new.ms, "u_opt": new.os, "opt": new.opt, "model": new.model}
    )
    train(new, bs[2:])
    _same(new.table(), full.table(), "table")
    for p, q in zip(new.model.head.parameters(), full.model.head.parameters(), strict=True):
        _same(p.detach(), q.detach(), "head")
    st_new, st_full = new.os.getNumpyVersion(), full.os.getNumpyVersion()
    assert sorted(st_new) == sorted(st_full)
    for k in st_full:
        _same(torch.as_tensor(st_new[k]), torch.as_tensor(st_full[k]), f"state {k}")


@pytest.mark.parametrize(
    ("kind", "cls", "kw"),
    [
        pytest.param("speedtorch", A, {"lr": 0.05, "weight_decay": 0.01}, id="ModelFactory-adam"),
        pytest.param("pytorch", SGD, {"lr": 0.05, "momentum": 0.9}, id="Pytorch-sgd-mom"),
    ],
)
def test_switchers_save_load_torch_and_optimizer_state_dict_resume(kind, cls, kw, tmp_path):
    """The SpeedTorch way to resume: ``saveTorch`` of the model switcher's table and of the
    optimizer switcher's state tables, plus the torch optimizer's own ``state_dict`` (its step
    count and the head's state), loaded into fresh objects, continue bit-identically."""
    bs = _batches(68, steps=5)

    def build(seed):
        return SwPair(kind, cls, seed=seed, **kw)

    def train(p, part):
        for ids, coef in part:
            p.opt.zero_grad()
            p.lib_loss(ids, coef).backward()
            p.opt.step()
            p.ms.afterOptimizerStep(*ids)
            p.os.afterOptimizerStep(*ids)

    full = build(0)
    train(full, bs)
    half = build(0)
    train(half, bs[:2])
    half.ms.saveTorch(str(tmp_path / "table.pt"))
    half.os.saveTorch(str(tmp_path / "state.pt"))
    torch.save(
        {"head": half.model.head.state_dict(), "opt": half.opt.state_dict()}, tmp_path / "rest.pt"
    )
    new = build(7)
    new.ms.loadTorch(str(tmp_path / "table.pt"))
    new.os.loadTorch(str(tmp_path / "state.pt"))
    rest = torch.load(tmp_path / "rest.pt", weights_only=False)
    new.model.head.load_state_dict(rest["head"])
    new.opt.load_state_dict(rest["opt"])
    train(new, bs[2:])
    _same(new.table(), full.table(), "table")
    for p, q in zip(new.model.head.parameters(), full.model.head.parameters(), strict=True):
        _same(p.detach(), q.detach(), "head")
    st_new, st_full = new.os.getNumpyVersion(), full.os.getNumpyVersion()
    for k in st_full:
        _same(torch.as_tensor(st_new[k]), torch.as_tensor(st_full[k]), f"state {k}")


def test_switcher_float16_tables_for_a_float32_variable():
    """README: "A ``datatype`` other than the model variable's (e.g. float16 tables for a float32
    ``nn.Embedding``) makes the variable that dtype while it is paged, and the optimizer's state
    rows follow it": the step is a float16 dense step on the batch's rows (to rounding)."""
    torch.manual_seed(90)
    model = nn.Module()
    model.u = nn.Embedding(3, D)
    opt = A(model.parameters(), lr=0.01)
    ms = gl.ModelFactory(model.u, N, D, datatype="float16", placement="cpu")
    os_ = gl.OptimizerFactory(opt, N, D, model, "u", dtype="float16", placement="cpu")
    w0 = _w0(90, dtype=torch.float16)
    ms.customInit(lambda t: t.copy_(w0))
    os_.optInit()
    rt = RefTable(w0)
    ropt = RefOpt(A, [rt.P], [rt], lr=0.01)
    for ids, coef in _batches(91, steps=3, lookups=1):
        loc = ms.beforeForwardPass(ids[0])
        os_.beforeForwardPass(ids[0])
        assert model.u.weight.dtype == torch.float16
        opt.zero_grad()
        _loss([model.u(loc)], coef).backward()
        opt.step()
        ms.afterOptimizerStep(ids[0])
        os_.afterOptimizerStep(ids[0])
        ropt.zero_grad()
        rt.begin(ids[0])
        _loss([rt.lookup(ids[0])], coef).backward()
        ropt.step()
    got = torch.as_tensor(ms.getNumpyVersion())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), rt.W.float(), **_TOL[torch.float16])


# ============================================================================ misc combinations


def test_closure_step_with_scheduler_and_clip_bit_identical():
    """``step(closure)`` runs the closure with grad enabled and returns its loss; inside the
    closure clipping over the groups; StepLR on top."""
    pair = Pair(A, lr=0.05)
    s1 = _sched("step", pair.opt, 4)
    s2 = _sched("step", pair.ropt.opt, 4)
    for ids, coef in _batches(70, steps=4):

        def closure(ids=ids, coef=coef):
            pair.opt.zero_grad()
            loss = pair.lib_loss(ids, coef)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                [p for g in pair.opt.param_groups for p in g["params"]], 0.9
            )
            return loss

        with torch.no_grad():
            loss = pair.opt.step(closure)
        assert loss is not None and loss.requires_grad
        pair.ropt.zero_grad()
        rloss = pair.ref_loss(ids, coef)
        rloss.backward()
        torch.nn.utils.clip_grad_norm_(
            [p for g in pair.ropt.param_groups for p in g["params"]], 0.9
        )
        pair.ropt.step()
        _same(loss.detach(), rloss.detach(), "closure loss")
        s1.step()
        s2.step()
        pair.check()


def test_init_partial_table_init_then_train_matches_reference():
    """An ``init=`` initialiser then training: the reference starts from the same table."""
    init = functools.partial(torch.nn.init.uniform_, a=-0.3, b=0.3)
    torch.manual_seed(71)
    emb = gl.OffloadedEmbedding(N, D, init=init, **CPU)
    w0 = _table(emb.weight)
    assert float(w0.abs().max()) <= 0.3
    opt = gl.OffloadedOptimizer(RA, emb, lr=0.05, weight_decay=0.1)
    rt = RefTable(w0)
    ropt = RefOpt(RA, [rt.P], [rt], lr=0.05, weight_decay=0.1)
    for ids, coef in _batches(72, steps=4, lookups=1):
        opt.zero_grad()
        _loss([emb(ids[0])], coef).backward()
        opt.step()
        ropt.zero_grad()
        rt.begin(ids[0])
        _loss([rt.lookup(ids[0])], coef).backward()
        ropt.step()
        _same(_table(emb.weight), rt.W, "table")


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=["half", "bf16"])
def test_table_gradient_via_dtype_cast_lookup_matches_dense(out_dtype):
    """``.half()`` / ``.to(bfloat16)`` make lookups that dtype while the table keeps
    float32 (README); the step then equals a dense float32 table whose lookup is cast (autograd
    casts each lookup's gradient back to float32 before the repeated ids are summed)."""
    w0 = _w0(73)
    emb = _emb(w0).to(out_dtype)
    opt = gl.OffloadedOptimizer(SGD, emb, lr=0.1, momentum=0.5)
    assert emb.weight.dtype == torch.float32
    rt = RefTable(w0)
    ropt = RefOpt(SGD, [rt.P], [rt], lr=0.1, momentum=0.5)
    for ids, coef in _batches(74, steps=3, lookups=2):
        opt.zero_grad()
        outs = [emb(i) for i in ids]
        assert outs[0].dtype == out_dtype
        _loss(outs, coef).backward()
        opt.step()
        ropt.zero_grad()
        rt.begin(*ids)
        _loss([rt.lookup(i).to(out_dtype) for i in ids], coef).backward()
        ropt.step()
        _same(_table(emb.weight), rt.W, "table")


# ============================================================================ more combinations


def test_optimizer_load_state_dict_with_pending_lookup_next_step_starts_from_it():
    """README: "the optimizer's own ``load_state_dict`` loads only optimizer state and is not
    [refused]: the next step starts from it" -- with a backward waiting, loading an earlier state
    dict makes the step use that state (and step count) with the current rows and gradients."""
    pair = Pair(A, lr=0.05, weight_decay=0.02)
    bs = _batches(80, steps=3)
    pair.step(*bs[0])
    sd_lib = copy.deepcopy(pair.opt.state_dict())
    snap_full = {k: v.clone() for k, v in pair.rt.full.items()}
    snap_opt = copy.deepcopy(pair.ropt.opt.state_dict())
    pair.step(*bs[1])
    # step 3: backward first, then load the state saved after step 1, then step
    pair.opt.zero_grad()
    pair.lib_loss(*bs[2]).backward()
    pair.opt.load_state_dict(sd_lib)
    pair.opt.step()
    pair.ropt.zero_grad()
    pair.ref_loss(*bs[2]).backward()
    pair.ropt.opt.load_state_dict(snap_opt)
    pair.rt.full = snap_full
    pair.ropt.step()
    pair.check()
    _check_state(pair.opt, pair.rt)
    assert _inner_step_count(pair.opt) == 2.0


def test_eval_lookup_between_training_lookups_is_not_stepped():
    """README: evaluation forwards under ``torch.no_grad()`` leave no lookup for the step: rows
    only an eval lookup read keep their values and state (Adam with weight decay would move any
    stepped row)."""
    pair = Pair(A, lr=0.05, weight_decay=0.5)
    only_eval = torch.tensor([N - 1, N - 2])  # _batches never draws ids >= 2N/3
    for ids, coef in _batches(81, steps=3):
        pair.opt.zero_grad()
        o1 = pair.emb(ids[0])
        with torch.no_grad():
            ev = pair.emb(only_eval)
        _same(ev, pair.rt.W[only_eval], "eval lookup")
        o2 = pair.emb(ids[1])
        _loss([o1, o2], coef, pair.head).backward()
        pair.opt.step()
        pair.ropt.zero_grad()
        pair.ref_loss(ids, coef).backward()
        pair.ropt.step()
        pair.check()
    _check_state(pair.opt, pair.rt)
    for t in _state_tables(pair.opt).values():
        assert bool((t[only_eval] == 0).all())


def test_frozen_table_mid_training_keeps_rows_state_and_count():
    """README: ``emb.requires_grad_(False)`` freezes its table (lookups become constants); a table
    with no lookup to step is not stepped and its step count does not move. Unfrozen, it trains
    on as its dense twin, whose optimizer skipped it for those steps."""
    w1, w2 = _w0(82), _w0(83)
    e1, e2 = _emb(w1), _emb(w2)
    model = nn.ModuleDict({"a": e1, "b": e2})
    opt = gl.OffloadedOptimizer(A, model, lr=0.05)
    r1, r2 = RefTable(w1), RefTable(w2)
    ropt = RefOpt(A, [r1.P, r2.P], [r1, r2], lr=0.05)
    for k, (ids, coef) in enumerate(_batches(84, steps=5)):
        frozen = k in (1, 2)
        e2.requires_grad_(not frozen)
        opt.zero_grad()
        out2 = e2(ids[1])
        assert out2.requires_grad is not frozen
        _loss([e1(ids[0]), out2], coef).backward()
        opt.step()
        ropt.zero_grad()
        r1.begin(ids[0])
        if frozen:
            r2o = r2.W[ids[1]]
        else:
            r2.begin(ids[1])
            r2o = r2.lookup(ids[1])
        _loss([r1.lookup(ids[0]), r2o], coef).backward()
        ropt.step()
        _same(_table(e1.weight), r1.W, f"table a, step {k}")
        _same(_table(e2.weight), r2.W, f"table b, step {k}")
    _check_state(opt, r1, 0)
    _check_state(opt, r2, 1)
    sd = opt.state_dict()["inner"]["state"]
    assert float(sd[0]["step"]) == 5.0
    assert float(sd[1]["step"]) == 3.0


@pytest.mark.parametrize("sched", [None, "step", "onecycle"], ids=["nosched", "step", "onecycle"])
def test_sparse_adam_matches_torch_sparse_embedding(sched):
    """SparseAdam over the table against ``nn.Embedding(sparse=True)`` trained by torch's
    SparseAdam (one lookup a step), with a scheduler stepping both (OneCycleLR cycles betas)."""
    steps = 4
    w0 = _w0(85)
    emb = _emb(w0)
    opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, emb, lr=0.05)
    ref = nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(w0)
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    s1 = _sched(sched, opt, steps) if sched else None
    s2 = _sched(sched, ropt, steps) if sched else None
    for ids, coef in _batches(86, steps=steps, lookups=1):
        opt.zero_grad()
        _loss([emb(ids[0])], coef).backward()
        opt.step()
        ropt.zero_grad()
        _loss([ref(ids[0])], coef).backward()
        ropt.step()
        if sched:
            s1.step()
            s2.step()
        _same(_table(emb.weight), ref.weight.detach(), "table")
    tabs = _state_tables(opt)
    _same(tabs["exp_avg"], ropt.state[ref.weight]["exp_avg"], "exp_avg")
    _same(tabs["exp_avg_sq"], ropt.state[ref.weight]["exp_avg_sq"], "exp_avg_sq")


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_bfloat16_checkpoint_resume_bit_identical(fmt, tmp_path):
    """README: bfloat16 tables need ``format="hdf5"`` or ``"zarr"``; ``load_checkpoint`` resumes
    bit-identically."""
    _fmt(fmt)
    w0 = _w0(87, dtype=torch.bfloat16)
    bs = _batches(88, steps=4)

    def build(w):
        emb = _emb(w)
        return emb, gl.OffloadedOptimizer(A, emb, lr=0.05, weight_decay=0.01)

    def train(emb, opt, part):
        for ids, coef in part:
            opt.zero_grad()
            _loss([emb(i) for i in ids], coef).backward()
            opt.step()

    e_a, o_a = build(w0)
    train(e_a, o_a, bs)
    e_b, o_b = build(w0)
    train(e_b, o_b, bs[:2])
    gl.save_checkpoint(tmp_path / "ck", {"m": e_b, "o": o_b}, format=fmt, progress=False)
    e_c, o_c = build(_w0(0, dtype=torch.bfloat16))
    gl.load_checkpoint(tmp_path / "ck", {"m": e_c, "o": o_c})
    train(e_c, o_c, bs[2:])
    _same(_table(e_c.weight), _table(e_a.weight), "bf16 table")
    for k, v in _state_tables(o_a).items():
        _same(_state_tables(o_c)[k], v, f"state {k}")


def test_bfloat16_checkpoint_npy_refused_before_writing(tmp_path):
    """README: ``"npy"`` refuses bfloat16 tables before writing anything (GadgetTypeError)."""
    emb = _emb(_w0(89, dtype=torch.bfloat16))
    opt = gl.OffloadedOptimizer(A, emb, lr=0.05)
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", {"m": emb, "o": opt}, format="npy", progress=False)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


@pytest.mark.parametrize("mode", ["max"])
def test_bag_int32_ids_and_offsets_train_like_int64(mode):
    """Docstring: ``offsets`` int64 or int32; an int32 id / offset pair trains exactly as int64."""
    w0 = _w0(92)
    bags = [_bag(w0, mode), _bag(w0, mode)]
    opts = [gl.OffloadedOptimizer(AW, b, lr=0.05, weight_decay=0.1) for b in bags]
    g = torch.Generator().manual_seed(93)
    for _ in range(3):
        ids, offs = _bag_batch(g, "offsets")
        c = torch.randn(4, D, generator=g)
        for b, o, dt in zip(bags, opts, (torch.int64, torch.int32), strict=True):
            o.zero_grad()
            out = b(ids.to(dt), offs.to(dt))
            ((out * c).sum() + (out**2).sum()).backward()
            o.step()
    _same(_table(bags[1].weight), _table(bags[0].weight), "int32 vs int64 table")
    for k, v in _state_tables(opts[0]).items():
        _same(_state_tables(opts[1])[k], v, f"state {k}")


def test_clip_grad_value_over_param_groups_matches_dense():
    """``clip_grad_value_`` over the optimizer's groups reaches the table's row gradients."""
    pair = Pair(SGD, lr=0.1, momentum=0.9)
    for ids, coef in _batches(94, steps=3):
        pair.opt.zero_grad()
        pair.lib_loss(ids, coef).backward()
        pair.ropt.zero_grad()
        pair.ref_loss(ids, coef).backward()
        torch.nn.utils.clip_grad_value_(
            [p for g in pair.opt.param_groups for p in g["params"]], 0.2
        )
        torch.nn.utils.clip_grad_value_(
            [p for g in pair.ropt.param_groups for p in g["params"]], 0.2
        )
        pair.opt.step()
        pair.ropt.step()
        pair.check()


@pytest.mark.parametrize(
    ("cls", "kw", "other"),
    [
        pytest.param(
            A, {"lr": 0.05, "weight_decay": 0.01}, {"lr": 0.9, "betas": (0.5, 0.6)}, id="adam"
        ),
        pytest.param(
            SGD, {"lr": 0.05, "momentum": 0.9}, {"lr": 0.9, "momentum": 0.0}, id="sgd-mom-off"
        ),
    ],
)
def test_state_dict_loaded_into_optimizer_built_with_other_options(cls, kw, other):
    """As in torch, ``load_state_dict`` brings the saved groups' options; README: a state dict
    holding state the optimizer has not turned on yet (momentum) loads, and that state is paged
    from then on. Training continues bit-identically to the uninterrupted run."""
    w0 = _w0(95)
    h0 = _head(95).state_dict()
    bs = _batches(96, steps=5)
    m_a, o_a, _ = _make_lib(cls, kw, w0, h0)
    _lib_train(m_a, o_a, bs)
    m_b, o_b, _ = _make_lib(cls, kw, w0, h0)
    _lib_train(m_b, o_b, bs[:2])
    sd_m, sd_o = m_b.state_dict(), o_b.state_dict()
    m_c, o_c, _ = _make_lib(cls, other, _w0(0), _head(0).state_dict())
    m_c.load_state_dict(sd_m)
    o_c.load_state_dict(sd_o)
    for k, v in kw.items():
        assert o_c.param_groups[0][k] == v
    _lib_train(m_c, o_c, bs[2:])
    _same(_table(m_c["emb"].weight), _table(m_a["emb"].weight), "table")
    for k, v in _state_tables(o_a).items():
        _same(_state_tables(o_c)[k], v, f"state {k}")


def test_zero_grad_of_one_optimizer_leaves_the_other_optimizers_lookups():
    """Each optimizer's ``zero_grad()`` throws away the lookups of ITS tables; another
    optimizer's pending table gradients survive it and are stepped."""
    w1, w2 = _w0(97), _w0(98)
    e1, e2 = _emb(w1), _emb(w2)
    o1 = gl.OffloadedOptimizer(A, e1, lr=0.05)
    o2 = gl.OffloadedOptimizer(A, e2, lr=0.05)
    r1, r2 = RefTable(w1), RefTable(w2)
    q1 = RefOpt(A, [r1.P], [r1], lr=0.05)
    q2 = RefOpt(A, [r2.P], [r2], lr=0.05)
    for ids, coef in _batches(99, steps=3):
        _loss([e1(ids[0]), e2(ids[1])], coef).backward()
        o2.zero_grad()  # discards e2's lookup only
        o1.step()
        o2.step()
        o1.zero_grad()
        r1.begin(ids[0])
        r2.begin(ids[1])
        _loss([r1.lookup(ids[0]), r2.lookup(ids[1])], coef).backward()
        q2.zero_grad()
        q1.step()
        q2.step()
        q1.zero_grad()
        _same(_table(e1.weight), r1.W, "table 1")
        _same(_table(e2.weight), r2.W, "table 2 (never stepped)")
    _same(_table(e2.weight), w2, "table 2 unchanged")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_after_a_merge_discards_the_merged_gradient(set_to_none):
    """A backward merged into the groups (``prepare_grads``), then ``zero_grad`` (either mode),
    then a new backward: the step sees only the new backward's gradient."""
    pair = Pair(A, lr=0.05)
    bs = _batches(100, steps=3)
    for k in range(2):
        ids_old, coef_old = bs[2 - k]
        ids, coef = bs[k]
        pair.lib_loss(ids_old, coef_old).backward()
        pair.opt.prepare_grads()
        pair.opt.zero_grad(set_to_none=set_to_none)
        pair.lib_loss(ids, coef).backward()
        pair.opt.step()
        pair.ropt.zero_grad(set_to_none=set_to_none)
        pair.ref_loss(ids, coef).backward()
        pair.ropt.step()
        pair.check(what=f"step {k}")
    _check_state(pair.opt, pair.rt)


def test_two_tables_one_group_clipped_together_bit_identical():
    """Two tables and a head in one group: the clip norm spans the head and both tables' rows
    (dense params first, then tables in module order, as the groups list them)."""
    w1, w2 = _w0(101), _w0(102)
    e1, e2 = _emb(w1), _emb(w2)
    head = _head(101)
    model = nn.ModuleDict({"a": e1, "head": head, "b": e2})
    opt = gl.OffloadedOptimizer(AW, model, lr=0.05, weight_decay=0.1)
    r1, r2, rhead = RefTable(w1), RefTable(w2), copy.deepcopy(head)
    ropt = RefOpt(AW, [*rhead.parameters(), r1.P, r2.P], [r1, r2], lr=0.05, weight_decay=0.1)
    for ids, coef in _batches(103, steps=4):
        opt.zero_grad()
        _loss([e1(ids[0]), e2(ids[1])], coef, head).backward()
        n1 = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.5)
        opt.step()
        ropt.zero_grad()
        r1.begin(ids[0])
        r2.begin(ids[1])
        _loss([r1.lookup(ids[0]), r2.lookup(ids[1])], coef, rhead).backward()
        n2 = torch.nn.utils.clip_grad_norm_(
            [p for g in ropt.param_groups for p in g["params"]], 0.5
        )
        ropt.step()
        _same(n1.detach(), n2.detach(), "norm")
        _same(_table(e1.weight), r1.W, "a")
        _same(_table(e2.weight), r2.W, "b")


@pytest.mark.parametrize("where", ["state_dict", "checkpoint"])
def test_scheduler_turned_momentum_loads_into_optimizer_built_without_it(where, tmp_path):
    """README: "A state dict or checkpoint holding state the optimizer has not turned on yet (a
    scheduler's momentum) loads, and that state is paged from then on": OneCycleLR turned SGD's
    momentum on; a fresh SGD(momentum=0) loads it and continues as the uninterrupted run (whose
    scheduler is not stepped after the save either)."""
    steps = 6
    w0 = _w0(104)
    h0 = _head(104).state_dict()
    bs = _batches(105, steps=5)
    m_a, o_a, s_a = _make_lib(SGD, {"lr": 0.05}, w0, h0, "onecycle", steps)
    _lib_train(m_a, o_a, bs[:2], s_a)
    if where == "state_dict":
        saved = (copy.deepcopy(m_a.state_dict()), copy.deepcopy(o_a.state_dict()))
    else:
        gl.save_checkpoint(tmp_path / "ck", {"m": m_a, "o": o_a}, progress=False)
    assert o_a.param_groups[0]["momentum"] > 0
    _lib_train(m_a, o_a, bs[2:])
    m_c, o_c, _ = _make_lib(SGD, {"lr": 0.05}, _w0(0), _head(0).state_dict())
    assert o_c.param_groups[0]["momentum"] == 0
    if where == "state_dict":
        m_c.load_state_dict(saved[0])
        o_c.load_state_dict(saved[1])
    else:
        gl.load_checkpoint(tmp_path / "ck", {"m": m_c, "o": o_c})
    assert o_c.param_groups[0]["momentum"] == o_a.param_groups[0]["momentum"]
    _lib_train(m_c, o_c, bs[2:])
    _same(_table(m_c["emb"].weight), _table(m_a["emb"].weight), "table")
    for k, v in _state_tables(o_a).items():
        assert k in _state_tables(o_c)
        _same(_state_tables(o_c)[k], v, f"state {k}")


@pytest.mark.parametrize("kind", ["speedtorch"])
def test_switchers_checkpoint_with_scheduler_momentum_into_switchers_built_without(kind, tmp_path):
    """README: "a checkpoint that holds a state table a scheduler turned on (a momentum buffer)
    loads into switchers built before that option was on"."""
    bs = _batches(106, steps=5)

    def train(p, part, sched=None):
        for ids, coef in part:
            p.opt.zero_grad()
            p.lib_loss(ids, coef).backward()
            p.opt.step()
            p.ms.afterOptimizerStep(*ids)
            p.os.afterOptimizerStep(*ids)
            if sched is not None:
                sched.step()

    a = SwPair(kind, SGD, seed=3, lr=0.05)
    s_a = _sched("onecycle", a.opt, 6)
    train(a, bs[:2], s_a)
    objs = {"u": a.ms, "u_opt": a.os, "opt": a.opt, "model": a.model}
    gl.save_checkpoint(tmp_path / "ck", objs, progress=False)
    train(a, bs[2:])
    c = SwPair(kind, SGD, seed=4, lr=0.05)
    assert c.opt.param_groups[0]["momentum"] == 0
    gl.load_checkpoint(tmp_path / "ck", {"u": c.ms, "u_opt": c.os, "opt": c.opt, "model": c.model})
    train(c, bs[2:])
    _same(c.table(), a.table(), "table")
    st_c, st_a = c.os.getNumpyVersion(), a.os.getNumpyVersion()
    assert "momentum_buffer" in st_a
    assert sorted(st_c) == sorted(st_a)
    for k in st_a:
        _same(torch.as_tensor(st_c[k]), torch.as_tensor(st_a[k]), f"state {k}")


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(
            A, {"lr": 0.05, "weight_decay": 0.1, "maximize": True, "foreach": True}, id="adam"
        ),
        pytest.param(
            SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "foreach": True}, id="sgd"
        ),
        pytest.param(
            RMS, {"lr": 0.01, "centered": True, "momentum": 0.2, "foreach": True}, id="rms"
        ),
    ],
)
def test_explicit_foreach_kernels_bit_identical(cls, kw):
    """README: bit-identical "with torch's default (for-each) kernels": ``foreach=True`` asked
    for explicitly, with a dense head in the same group, and clipping."""
    _need(cls, kw)
    pair = Pair(cls, **kw)
    for ids, coef in _batches(107, steps=3):
        n1, n2 = pair.step(ids, coef, clip=(0.7, 2.0))
        _same(n1.detach(), n2.detach(), "norm")
        pair.check()
    _check_state(pair.opt, pair.rt)


def test_clip_one_group_reached_by_indexing_param_groups():
    """The table in its own param-group dict; ``opt.param_groups[0]["params"]`` (indexing, not
    iterating, README: "iterating or indexing") reaches its rows after a backward, and clipping
    only that group clips only the table."""
    w0 = _w0(108)
    emb, head = _emb(w0), _head(108)
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = gl.OffloadedOptimizer(A, [{"params": emb, "lr": 0.1}, model], lr=0.01)
    rt, rhead = RefTable(w0), copy.deepcopy(head)
    ropt = RefOpt(
        A, [{"params": [rt.P], "lr": 0.1}, {"params": list(rhead.parameters())}], [rt], lr=0.01
    )
    for ids, coef in _batches(109, steps=3):
        opt.zero_grad()
        _loss([emb(i) for i in ids], coef, head).backward()
        g0 = opt.param_groups[0]["params"]
        assert len(g0) == 1 and g0[0].grad is not None
        n1 = torch.nn.utils.clip_grad_norm_(g0, 0.3)
        opt.step()
        ropt.zero_grad()
        rt.begin(*ids)
        _loss([rt.lookup(i) for i in ids], coef, rhead).backward()
        n2 = torch.nn.utils.clip_grad_norm_(ropt.param_groups[0]["params"], 0.3)
        ropt.step()
        _same(n1.detach(), n2.detach(), "norm")
        _same(_table(emb.weight), rt.W, "table")
        _same(head.weight.detach(), rhead.weight.detach(), "head")


def test_parent_zero_grad_does_not_reach_tables_but_embedding_zero_grad_does():
    """README: "a parent module's ``model.zero_grad()`` does not reach them (they are not
    parameters)", while "the embedding's own ``emb.zero_grad()``" throws away its lookups."""
    pair = Pair(A, lr=0.05)
    bs = _batches(110, steps=4)
    # step 1: a backward, model.zero_grad() (the head only), another backward: table gets both
    pair.lib_loss(*bs[0]).backward()
    pair.model.zero_grad()
    pair.lib_loss(*bs[1]).backward()
    pair.opt.step()
    pair.rt.begin(*bs[0][0], *bs[1][0])
    pair.ref_loss(*bs[0], begin=False).backward()
    pair.rhead.zero_grad()
    pair.ref_loss(*bs[1], begin=False).backward()
    pair.ropt.step()
    pair.check(what="after model.zero_grad()")
    # step 2: a backward, emb.zero_grad() + head zero_grad, another backward: only the second
    pair.opt.zero_grad()
    pair.lib_loss(*bs[2]).backward()
    pair.emb.zero_grad()
    pair.head.zero_grad()
    pair.lib_loss(*bs[3]).backward()
    pair.opt.step()
    pair.ropt.zero_grad()
    pair.ref_loss(*bs[3]).backward()
    pair.ropt.step()
    pair.check(what="after emb.zero_grad()")


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        pytest.param(AW, {"lr": 0.05, "weight_decay": 0.1}, id="adamw"),
        pytest.param(RMS, {"lr": 0.01}, id="rms-onecycle-turns-momentum-on"),
    ],
)
def test_warmup_then_cosine_sequential_scheduler(cls, kw):
    """SequentialLR(LinearLR warm-up, CosineAnnealingLR) -- the warm-up lowers ``lr`` before the
    first step -- or, for RMSprop, OneCycleLR turning its momentum on: bit-identical."""
    steps = 5
    pair = Pair(cls, **kw)
    scheds = []
    for o in (pair.opt, pair.ropt.opt):
        if cls is RMS:
            scheds.append(_sched("onecycle", o, steps))
        else:
            lin = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2)
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3)
            scheds.append(torch.optim.lr_scheduler.SequentialLR(o, [lin, cos], milestones=[2]))
    if cls is RMS:
        assert pair.opt.param_groups[0]["momentum"] > 0
    for ids, coef in _batches(111, steps=steps):
        pair.step(ids, coef)
        for s in scheds:
            s.step()
        pair.check()
    _check_state(pair.opt, pair.rt)


@pytest.mark.parametrize(
    ("cls", "kw", "sched"),
    [
        pytest.param(
            torch.optim.Rprop, {"lr": 0.02, "maximize": True}, "step", id="rprop-max-step"
        ),
        pytest.param(
            torch.optim.ASGD,
            {"lr": 0.05, "weight_decay": 0.05, "t0": 2.0},
            "lambda",
            id="asgd-wd-lambda",
        ),
    ],
)
def test_rprop_and_asgd_with_scheduler_bit_identical(cls, kw, sched):
    """Rprop (per-row step sizes starting at the first step's lr, README) and ASGD (eta / mu per
    table, recomputed from the scheduled lr) with an LR scheduler and a dense head."""
    _need(cls, kw)
    pair = Pair(cls, **kw)
    s1, s2 = _sched(sched, pair.opt, 5), _sched(sched, pair.ropt.opt, 5)
    for ids, coef in _batches(112, steps=5):
        pair.step(ids, coef)
        s1.step()
        s2.step()
        pair.check()
    _check_state(pair.opt, pair.rt)


@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_adagrad_initial_accumulator_checkpoint_resume(fmt, tmp_path):
    """Adagrad with ``initial_accumulator_value``: rows first looked up after a checkpoint resume
    still start from it (zarr keeps chunks of a non-zero fill), and the resumed run equals the
    dense twin."""
    _fmt(fmt)
    kw = {"lr": 0.1, "initial_accumulator_value": 0.3, "lr_decay": 0.05}
    pair = Pair(AG, **kw)
    bs = _batches(113, steps=4)
    for ids, coef in bs[:2]:
        pair.step(ids, coef)
    gl.save_checkpoint(
        tmp_path / "ck", {"m": pair.model, "o": pair.opt}, format=fmt, progress=False
    )
    del pair.opt
    emb2, head2 = gl.OffloadedEmbedding(N, D, **CPU), _head(5)
    model2 = nn.ModuleDict({"emb": emb2, "head": head2})
    opt2 = gl.OffloadedOptimizer(AG, model2, **kw)
    gl.load_checkpoint(tmp_path / "ck", {"m": model2, "o": opt2})
    pair.emb, pair.head, pair.model, pair.opt = emb2, head2, model2, opt2
    unseen = torch.tensor([N - 1])
    for k, (ids, coef) in enumerate(bs[2:]):
        if k == 1:
            ids = [torch.cat([ids[0], unseen]), ids[1]]
            coef = [torch.cat([coef[0], coef[0][:1]]), coef[1]]
        pair.step(ids, coef)
        pair.check()
    _check_state(pair.opt, pair.rt)


@pytest.mark.parametrize("mode", ["mean", "sum", "max"])
def test_switcher_over_embedding_bag_with_padding_idx(mode):
    """README: an ``nn.EmbeddingBag`` with ``padding_idx`` passed as the module has it taken as a
    global id: each forward sets it to the local row (``None`` when the batch lacks it), so the
    padding entries are left out of the bags (and of 'mean''s count) and get no gradient, as in a
    full-table ``nn.EmbeddingBag(padding_idx=...)``."""
    pad = 2  # torch wants padding_idx below the module's own row count
    torch.manual_seed(114)
    model = nn.Module()
    model.u = nn.EmbeddingBag(3, D, mode=mode, padding_idx=pad)
    opt = A(model.parameters(), lr=0.05)
    ms = gl.ModelFactory(model.u, N, D, placement="cpu")
    os_ = gl.OptimizerFactory(opt, N, D, model, "u", placement="cpu")
    w0 = _w0(114)
    ms.customInit(lambda t: t.copy_(w0))
    os_.optInit()
    rt = RefTable(w0, padding_idx=pad)
    ropt = RefOpt(A, [rt.P], [rt], lr=0.05)
    full = nn.EmbeddingBag(N, D, mode=mode, padding_idx=pad)
    g = torch.Generator().manual_seed(115)
    for k in range(4):
        ids = torch.randint(0, 12, (4, 3), generator=g)
        if k != 2:
            ids[0, 1] = pad
            ids[3, 0] = pad
        c = torch.randn(4, D, generator=g)
        loc = ms.beforeForwardPass(ids)
        os_.beforeForwardPass(ids)
        opt.zero_grad()
        out = model.u(loc)
        with torch.no_grad():
            full.weight.copy_(torch.as_tensor(ms.getNumpyVersion()))
            _same(out.detach(), full(ids), "forward = full-table EmbeddingBag(padding_idx)")
        ((out * c).sum() + (out**2).sum()).backward()
        opt.step()
        ms.afterOptimizerStep(ids)
        os_.afterOptimizerStep(ids)
        ropt.zero_grad()
        rt.begin(ids)
        rout = rt.bag(ids, mode=mode)
        ((rout * c).sum() + (rout**2).sum()).backward()
        ropt.step()
        _same(torch.as_tensor(ms.getNumpyVersion()), rt.W, f"table step {k}")
    _same(torch.as_tensor(ms.getNumpyVersion())[pad], w0[pad], "padding row")


@pytest.mark.parametrize("how", ["module_load_state_dict", "load_checkpoint"])
def test_loading_rows_while_a_gradient_waits_is_refused_then_step_is_exact(how, tmp_path):
    """README: loading a table's rows (the module's ``load_state_dict``, ``load_checkpoint``)
    while a lookup with a gradient waits for its step is refused; refused calls change nothing,
    so the following step is the dense twin's."""
    pair = Pair(A, lr=0.05, weight_decay=0.01)
    bs = _batches(116, steps=3)
    pair.step(*bs[0])
    if how == "load_checkpoint":
        gl.save_checkpoint(tmp_path / "ck", {"m": pair.model, "o": pair.opt}, progress=False)
    sd = copy.deepcopy(pair.model.state_dict())
    pair.step(*bs[1])
    before = _table(pair.emb.weight)
    st_before = {k: v.clone() for k, v in _state_tables(pair.opt).items()}
    pair.opt.zero_grad()
    pair.lib_loss(*bs[2]).backward()
    # README: a module's load_state_dict reports what it refuses in torch's RuntimeError
    exc = gl.GadgetError if how == "load_checkpoint" else RuntimeError
    with pytest.raises(exc):
        if how == "load_checkpoint":
            gl.load_checkpoint(tmp_path / "ck", {"m": pair.model, "o": pair.opt})
        else:  # the embedding's own (a parent's would load the head as torch does, then raise)
            pair.emb.load_state_dict({"weight": sd["emb.weight"]})
    _same(_table(pair.emb.weight), before, "table after the refused load")
    for k, v in _state_tables(pair.opt).items():
        _same(v, st_before[k], f"state {k} after the refused load")
    pair.opt.step()
    pair.ropt.zero_grad()
    pair.ref_loss(*bs[2]).backward()
    pair.ropt.step()
    pair.check()


def test_gradient_reaching_a_lookup_retired_by_a_load_is_reported_not_applied():
    """README: a training lookup still waiting for its backward is retired by a load; a gradient
    that reaches it afterwards is reported by the next ``step()`` ("made before its rows were
    loaded"), not applied. After ``zero_grad()`` training goes on from the loaded rows."""
    pair = Pair(SGD, lr=0.05, momentum=0.9)
    bs = _batches(117, steps=4)
    pair.step(*bs[0])
    new_w = _w0(118)
    pair.opt.zero_grad()
    loss = pair.lib_loss(*bs[1])  # forward only
    pair.emb.load_state_dict({"weight": new_w.clone()})
    loss.backward()
    st_before = {k: v.clone() for k, v in _state_tables(pair.opt).items()}
    with pytest.raises(gl.GadgetValueError, match="loaded"):
        pair.opt.step()
    _same(_table(pair.emb.weight), new_w, "loaded rows kept")
    for k, v in _state_tables(pair.opt).items():
        _same(v, st_before[k], f"state {k}")
    pair.opt.zero_grad()
    # the dense twin: same load, then the next steps
    pair.rt.W = new_w.clone()
    pair.ropt.zero_grad()
    # the head stepped? the failed step() must not have moved it either
    for p, q in zip(pair.head.parameters(), pair.rhead.parameters(), strict=True):
        _same(p.detach(), q.detach(), "head after the refused step")
    for ids, coef in bs[2:]:
        pair.step(ids, coef)
        pair.check()
