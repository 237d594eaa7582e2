"""Black-box review (session 29) of gl.OffloadedEmbedding / gl.OffloadedEmbeddingBag trained
with gl.OffloadedOptimizer on the CPU placement, against plain torch.nn.EmbeddingBag /
torch.nn.Embedding and the same torch optimizers; written from README.md, SPEC.md and the
public docstrings only.

Reference semantics (README "Duplicates" / SPEC): "results equal training the whole table as
one parameter with lazy per-row updates (rows outside a batch untouched, one step count per
table as in torch's SparseAdam)", and gradients of several lookups "bit-identical to a dense
nn.Embedding trained the same way". The reference below trains a plain torch module with dense
gradients and applies the same torch optimizer class to the rows looked up in the step, with
per-row state kept in full-size tables and one step count per table.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(scope="module", autouse=True)
def _hide_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


N, D = 16, 4


# ----------------------------------------------------------------------------- helpers


def table(m) -> torch.Tensor:
    return torch.from_numpy(np.array(m.weight.getNumpyVersion(), copy=True))


class _RefBag(torch.nn.EmbeddingBag):
    """torch's EmbeddingBag read as torch >= 2.5 reads a 2-D input (one bag per row whatever
    ``include_last_offset`` says), as the drop-in documents; torch 2.4 dropped the last bag."""

    def forward(self, input, offsets=None, per_sample_weights=None):
        if input.dim() == 2 and self.include_last_offset:
            return torch.nn.functional.embedding_bag(
                input,
                self.weight,
                None,
                mode=self.mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=False,
            )
        return super().forward(input, offsets, per_sample_weights)


def make_bag(mode="sum", include_last_offset=False, n=N, d=D, seed=0):
    torch.manual_seed(seed)
    off = gl.OffloadedEmbeddingBag(
        n, d, mode=mode, placement="cpu", include_last_offset=include_last_offset, device="cpu"
    )
    ref = _RefBag(n, d, mode=mode, include_last_offset=include_last_offset, _weight=table(off))
    return off, ref


def make_emb(n=N, d=D, seed=1):
    torch.manual_seed(seed)
    off = gl.OffloadedEmbedding(n, d, placement="cpu", device="cpu")
    ref = torch.nn.Embedding(n, d, _weight=table(off))
    return off, ref


class LazyRef:
    """One table trained as a whole parameter with lazy per-row updates (plain torch)."""

    def __init__(self, module, opt_cls, kw):
        self.m = module
        self.w = module.weight
        self.cls, self.kw = opt_cls, dict(kw)
        self.rows: dict[str, torch.Tensor] = {}
        self.scalars = None
        self.used: list[torch.Tensor] = []
        module.register_forward_pre_hook(self._record)

    def _record(self, mod, args):
        if torch.is_grad_enabled():
            self.used.append(torch.as_tensor(args[0]).reshape(-1).long())

    def _init_rows(self):
        p = torch.nn.Parameter(torch.zeros(1, self.w.shape[1], dtype=self.w.dtype))
        p.grad = torch.zeros_like(p)
        o = self.cls([p], **self.kw)
        o.step()
        return {
            k: v.detach().clone()
            for k, v in o.state[p].items()
            if torch.is_tensor(v) and v.shape == p.shape
        }

    def step(self):
        if not self.used:
            self.w.grad = None
            return
        ids = torch.unique(torch.cat(self.used))
        self.used = []
        g = self.w.grad if self.w.grad is not None else torch.zeros_like(self.w)
        p = torch.nn.Parameter(self.w.detach()[ids].clone())
        p.grad = g[ids].clone()
        o = self.cls([p], **self.kw)
        if self.scalars is not None:
            st = {
                k: (v.clone() if torch.is_tensor(v) else copy.copy(v))
                for k, v in self.scalars.items()
            }
            st.update({k: t[ids].clone() for k, t in self.rows.items()})
            o.state[p] = st
        o.step()
        with torch.no_grad():
            self.w[ids] = p.detach()
        st = o.state[p]
        if self.scalars is None:
            init = self._init_rows()
            self.rows = {k: v.repeat(self.w.shape[0], 1) for k, v in init.items()}
        self.scalars = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == p.shape:
                self.rows[k][ids] = v.detach()
            else:
                self.scalars[k] = v.clone() if torch.is_tensor(v) else copy.copy(v)
        self.w.grad = None


class Pair:
    """An offloaded model and its plain-torch twin, trained step by step."""

    def __init__(self, off: dict, ref: dict, opt_cls, kw, groups=None, ref_kw=None):
        self.off = torch.nn.ModuleDict(off)
        self.ref = torch.nn.ModuleDict(ref)
        ref_kw = ref_kw or {}
        self.opt = gl.OffloadedOptimizer(opt_cls, groups if groups is not None else self.off, **kw)
        self.lazy = {}
        dense = []
        for name, m in self.ref.items():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                self.lazy[name] = LazyRef(m, opt_cls, {**kw, **ref_kw.get(name, {})})
            else:
                dense += list(m.parameters())
        self.dense_opt = opt_cls(dense, **kw) if dense else None

    def run(self, batch, compare_out=True):
        """batch: list of (module name, args, R, through_head)."""
        self.opt.zero_grad()
        outs_o, outs_r = [], []
        loss_o = self._loss(self.off, batch, outs_o)
        loss_r = self._loss(self.ref, batch, outs_r)
        if compare_out:
            for a, b in zip(outs_o, outs_r, strict=True):
                assert a.shape == b.shape
                assert torch.equal(a.detach(), b.detach())
        loss_o.backward()
        loss_r.backward()
        self.opt.step()
        for lz in self.lazy.values():
            lz.step()
        if self.dense_opt is not None:
            self.dense_opt.step()
            self.dense_opt.zero_grad()

    @staticmethod
    def _loss(model, batch, outs):
        total = 0
        for name, args, R, head in batch:
            out = model[name](*args)
            outs.append(out)
            if head:
                out = model["head"](out)
            total = total + (out * R).sum()
        return total

    def check(self, exact=True):
        for name, m in self.off.items():
            if isinstance(m, (gl.OffloadedEmbedding, gl.OffloadedEmbeddingBag)):
                got, want = table(m), self.ref[name].weight.detach()
                if exact:
                    assert torch.equal(got, want), (name, (got - want).abs().max())
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            else:
                for a, b in zip(m.parameters(), self.ref[name].parameters(), strict=True):
                    assert torch.equal(a.detach(), b.detach()), name


def rnd(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def bag_lookup(ids, offsets, n_bags, seed, psw=None, head=False, name="bag"):
    args = (ids, offsets) if psw is None else (ids, offsets, psw)
    return (name, args, rnd(n_bags, 1 if head else D, seed=seed), head)


# Batches with repeated ids within and across bags, empty bags, and rows never used.
BAG_BATCHES = [
    (torch.tensor([1, 2, 2, 5, 1, 7, 7, 7]), torch.tensor([0, 3, 3, 6])),  # empty bag 1
    (torch.tensor([3, 3, 0, 9, 1]), torch.tensor([0, 0, 2])),  # leading empty bag
    (torch.tensor([2, 4, 4, 4, 1, 15]), torch.tensor([0, 1, 4, 6])),  # trailing empty bag
    (torch.tensor([1, 1, 1, 1]), torch.tensor([0, 2])),
]


def with_last(offsets, n):
    return torch.cat([offsets, torch.tensor([n])])


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("k", range(len(BAG_BATCHES)))
def test_forward_1d_offsets_equals_torch(mode, last, k):
    off, ref = make_bag(mode, include_last_offset=last)
    ids, offs = BAG_BATCHES[k]
    if last:
        offs = with_last(offs, len(ids))
    with torch.no_grad():
        got, want = off(ids, offs), ref(ids, offs)
    assert got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [False, True])
def test_forward_2d_input_one_bag_per_row(mode, last):
    off, ref = make_bag(mode, include_last_offset=last)
    ids = torch.tensor([[1, 2, 2], [5, 5, 5], [0, 15, 3]])
    got = off(ids)
    want = ref(ids)
    assert got.shape == (3, D)
    assert torch.equal(got.detach(), want.detach())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_forward_2d_input_no_columns_gives_zeros(mode):
    off, _ = make_bag(mode)
    got = off(torch.zeros(3, 0, dtype=torch.long))
    assert got.shape == (3, D)
    assert torch.equal(got.detach(), torch.zeros(3, D))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_forward_all_bags_empty(mode):
    off, ref = make_bag(mode)
    ids = torch.zeros(0, dtype=torch.long)
    offs = torch.tensor([0, 0, 0])
    got = off(ids, offs)
    assert torch.equal(got.detach(), torch.zeros(3, D))
    assert torch.equal(got.detach(), ref(ids, offs).detach())


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("off_dtype", [torch.int64, torch.int32])
def test_forward_integer_dtypes(id_dtype, off_dtype):
    off, ref = make_bag("sum")
    ids, offs = BAG_BATCHES[0]
    got = off(ids.to(id_dtype), offs.to(off_dtype))
    want = ref(ids, offs)
    assert torch.equal(got.detach(), want.detach())


def test_forward_per_sample_weights_and_their_grad():
    off, ref = make_bag("sum")
    ids, offs = BAG_BATCHES[0]
    w1 = rnd(len(ids), seed=3).requires_grad_()
    w2 = w1.detach().clone().requires_grad_()
    R = rnd(len(offs), D, seed=4)
    gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)
    a, b = off(ids, offs, w1), ref(ids, offs, w2)
    assert torch.equal(a.detach(), b.detach())
    (a * R).sum().backward()
    (b * R).sum().backward()
    assert torch.equal(w1.grad, w2.grad)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 2, 3), (0,), (3, 0)])
def test_embedding_forward_shapes(shape):
    off, ref = make_emb()
    ids = torch.randint(0, N, shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = off(ids)
    assert got.shape == tuple(shape) + (D,)
    assert torch.equal(got, ref(ids).detach())


# ----------------------------------------------------------------------------- training

OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.05}),
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1, "lr_decay": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    (torch.optim.Adamax, {"lr": 0.05}),
    (torch.optim.NAdam, {"lr": 0.05}),
    (torch.optim.RAdam, {"lr": 0.05}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.Rprop, {"lr": 0.01}),
    (torch.optim.ASGD, {"lr": 0.05, "t0": 2}),
]
OPT_IDS = [
    "sgd",
    "sgd_mom",
    "sgd_nesterov_wd",
    "adam",
    "adam_wd_amsgrad",
    "adamw",
    "adagrad",
    "rmsprop",
    "rmsprop_mom_centered",
    "adamax",
    "nadam",
    "radam",
    "adadelta",
    "rprop",
    "asgd",
]


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS, ids=OPT_IDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_training_equals_lazy_torch(opt_cls, kw, mode):
    off, ref = make_bag(mode)
    p = Pair({"bag": off}, {"bag": ref}, opt_cls, kw)
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        p.run([bag_lookup(ids, offs, len(offs), seed=100 + s)])
        p.check()


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS[:9], ids=OPT_IDS[:9])
def test_bag_all_rows_every_step_equals_plain_torch_optimizer(opt_cls, kw):
    """Every row in every batch: lazy and dense training coincide, so the plain torch
    optimizer over nn.EmbeddingBag.weight is the reference, no bookkeeping needed."""
    off, ref = make_bag("mean", include_last_offset=True)
    opt = gl.OffloadedOptimizer(opt_cls, off, **kw)
    ropt = opt_cls(ref.parameters(), **kw)
    for s in range(4):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(s))
        ids = torch.cat([perm, perm[:5]])
        offs = torch.tensor([0, 3, 3, 10, len(ids)])
        R = rnd(4, D, seed=s)
        opt.zero_grad()
        ropt.zero_grad()
        (off(ids, offs) * R).sum().backward()
        (ref(ids, offs) * R).sum().backward()
        opt.step()
        ropt.step()
        assert torch.equal(table(off), ref.weight.detach()), s


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS[:9], ids=OPT_IDS[:9])
def test_embedding_training_equals_lazy_torch(opt_cls, kw):
    off, ref = make_emb()
    p = Pair({"emb": off}, {"emb": ref}, opt_cls, kw)
    batches = [
        torch.tensor([[1, 2, 2], [5, 1, 1]]),
        torch.tensor([3, 3, 3]),
        torch.tensor([2, 9, 2, 0]),
    ]
    for s, ids in enumerate(batches):
        p.run([("emb", (ids,), rnd(*ids.shape, D, seed=s), False)])
        p.check()


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("opt_cls,kw", [OPTIMIZERS[1], OPTIMIZERS[5]], ids=["sgd_mom", "adamw"])
def test_bag_per_sample_weights_training(last, opt_cls, kw):
    off, ref = make_bag("sum", include_last_offset=last)
    p = Pair({"bag": off}, {"bag": ref}, opt_cls, kw)
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        if last:
            offs = with_last(offs, len(ids))
        psw = rnd(len(ids), seed=50 + s)
        psw[0] = 0.0  # a looked-up row with zero weight
        nb = len(offs) - 1 if last else len(offs)
        p.run([bag_lookup(ids, offs, nb, seed=s, psw=psw)])
        p.check()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("opt_cls,kw", [OPTIMIZERS[1], OPTIMIZERS[3]], ids=["sgd_mom", "adam"])
def test_bag_2d_input_training(mode, opt_cls, kw):
    off, ref = make_bag(mode, include_last_offset=True)
    p = Pair({"bag": off}, {"bag": ref}, opt_cls, kw)
    for s in range(3):
        ids = torch.randint(0, 6, (4, 3), generator=torch.Generator().manual_seed(s))
        p.run([("bag", (ids,), rnd(4, D, seed=s), False)])
        p.check()


@pytest.mark.parametrize(
    "opt_cls,kw", [OPTIMIZERS[1], OPTIMIZERS[3], OPTIMIZERS[6]], ids=["sgd_mom", "adam", "adagrad"]
)
def test_several_lookups_and_two_backwards_in_a_step(opt_cls, kw):
    """README: several lookups of a table in a step (and several backward passes) are summed
    bit-identically to a dense nn.Embedding trained the same way."""
    bag, rbag = make_bag("sum")
    emb, remb = make_emb()
    p = Pair({"bag": bag, "emb": emb}, {"bag": rbag, "emb": remb}, opt_cls, kw)
    for s in range(3):
        p.opt.zero_grad()
        # first micro-batch: two bag lookups and one embedding lookup
        b1 = [
            bag_lookup(torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2]), 2, seed=10 * s),
            bag_lookup(torch.tensor([2, 3, 3, 7]), torch.tensor([0, 1]), 2, seed=10 * s + 1),
            ("emb", (torch.tensor([2, 2, 4]),), rnd(3, D, seed=10 * s + 2), False),
        ]
        b2 = [
            bag_lookup(torch.tensor([7, 2, 1]), torch.tensor([0, 0]), 2, seed=10 * s + 3),
            ("emb", (torch.tensor([4, 11]),), rnd(2, D, seed=10 * s + 4), False),
        ]
        for mb in (b1, b2):
            Pair._loss(p.off, mb, []).backward()
            Pair._loss(p.ref, mb, []).backward()
        p.opt.step()
        for lz in p.lazy.values():
            lz.step()
        p.check()


@pytest.mark.parametrize(
    "opt_cls,kw",
    [OPTIMIZERS[1], OPTIMIZERS[3], OPTIMIZERS[5], OPTIMIZERS[8]],
    ids=["sgd_mom", "adam", "adamw", "rmsprop"],
)
def test_two_tables_and_dense_head_share_one_optimizer(opt_cls, kw):
    bag, rbag = make_bag("mean")
    emb, remb = make_emb()
    torch.manual_seed(7)
    head = torch.nn.Linear(D, 1)
    rhead = copy.deepcopy(head)
    p = Pair(
        {"bag": bag, "emb": emb, "head": head},
        {"bag": rbag, "emb": remb, "head": rhead},
        opt_cls,
        kw,
    )
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        batch = [bag_lookup(ids, offs, len(offs), seed=s, head=True)]
        if s != 1:  # the embedding is not looked up in step 1: not stepped, step count kept
            batch.append(("emb", (ids[:3],), rnd(3, 1, seed=90 + s), True))
        p.run(batch)
        p.check()


def test_param_group_dict_gives_a_table_its_own_lr():
    bag, rbag = make_bag("sum")
    emb, remb = make_emb()
    off = {"bag": bag, "emb": emb}
    groups = [{"params": bag, "lr": 0.5}, emb]
    p = Pair(
        off,
        {"bag": rbag, "emb": remb},
        torch.optim.Adam,
        {"lr": 0.01},
        groups=groups,
        ref_kw={"bag": {"lr": 0.5}},
    )
    for s, (ids, offs) in enumerate(BAG_BATCHES[:3]):
        p.run(
            [
                bag_lookup(ids, offs, len(offs), seed=s),
                ("emb", (ids,), rnd(len(ids), D, seed=s), False),
            ]
        )
        p.check()


def test_sparse_adam_equals_torch_sparse_embedding_bag():
    off, _ = make_bag("sum")
    ref = torch.nn.EmbeddingBag(N, D, mode="sum", sparse=True, _weight=table(off))
    opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, off, lr=0.05)
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        R = rnd(len(offs), D, seed=s)
        opt.zero_grad()
        ropt.zero_grad()
        (off(ids, offs) * R).sum().backward()
        (ref(ids, offs) * R).sum().backward()
        opt.step()
        ropt.step()
        # README: a sparse nn.Embedding may round differently from its dense twin
        torch.testing.assert_close(table(off), ref.weight.detach(), rtol=1e-6, atol=1e-7)
    # rows never looked up are untouched
    unused = sorted(set(range(N)) - set(torch.cat([b[0] for b in BAG_BATCHES]).tolist()))
    torch.manual_seed(0)
    w0 = table(make_bag("sum")[0])
    assert torch.equal(table(off)[unused], w0[unused])


def test_sparse_adam_lazy_reference_is_exact():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    q_off, q_ref = make_bag("sum")
    q = gl.OffloadedOptimizer(torch.optim.SparseAdam, q_off, lr=0.05)
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        R = rnd(len(offs), D, seed=s)
        p.run([("bag", (ids, offs), R, False)])
        q.zero_grad()
        (q_off(ids, offs) * R).sum().backward()
        q.step()
        # SparseAdam's lazy update of the used rows is Adam's update on those rows
        torch.testing.assert_close(table(q_off), table(off), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- step semantics


def test_second_step_without_backward_changes_nothing():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    ids, offs = BAG_BATCHES[0]
    p.run([bag_lookup(ids, offs, len(offs), seed=0)])
    before = table(off)
    p.opt.step()
    assert torch.equal(table(off), before)
    # and the step count did not move: the next real step still equals the reference
    ids, offs = BAG_BATCHES[1]
    p.run([bag_lookup(ids, offs, len(offs), seed=1)])
    p.check()


def test_zero_grad_discards_lookups_and_step_count():
    off, ref = make_bag("mean")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    before = table(off)
    ids, offs = BAG_BATCHES[0]
    off(ids, offs).sum().backward()
    p.opt.zero_grad()
    p.opt.step()
    assert torch.equal(table(off), before)
    for s, (ids, offs) in enumerate(BAG_BATCHES[1:]):
        p.run([bag_lookup(ids, offs, len(offs), seed=s)])
        p.check()


def test_module_zero_grad_discards_lookups():
    off, _ = make_bag("sum")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5)
    before = table(off)
    off(*BAG_BATCHES[0]).sum().backward()
    off.zero_grad()
    opt.step()
    assert torch.equal(table(off), before)


def test_frozen_bag_is_not_trained():
    off, _ = make_bag("sum")
    torch.manual_seed(3)
    head = torch.nn.Linear(D, 1)
    model = torch.nn.ModuleDict({"bag": off, "head": head})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.1)
    off.requires_grad_(False)
    before, hb = table(off), head.weight.detach().clone()
    out = off(*BAG_BATCHES[0])
    assert not out.requires_grad
    head(out).sum().backward()
    opt.step()
    assert torch.equal(table(off), before)
    assert not torch.equal(head.weight.detach(), hb)


def test_double_module_returns_float64_table_stays_float32():
    off, ref = make_bag("sum")
    off.double()
    out = off(*BAG_BATCHES[0])
    assert out.dtype == torch.float64
    assert table(off).dtype == torch.float32
    torch.testing.assert_close(out.detach(), ref(*BAG_BATCHES[0]).detach().double())


# ----------------------------------------------------------------------------- state dicts


def _train_steps(model, opt, batches, seeds):
    for (ids, offs), s in zip(batches, seeds, strict=True):
        opt.zero_grad()
        loss = (model["bag"](ids, offs) * rnd(len(offs), D, seed=s)).sum()
        loss = loss + (model["emb"](ids) * rnd(len(ids), D, seed=s + 7)).sum()
        loss.backward()
        opt.step()


def _build(seed, opt_cls, kw):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict(
        {
            "bag": gl.OffloadedEmbeddingBag(N, D, mode="mean", placement="cpu", device="cpu"),
            "emb": gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu"),
        }
    )
    return model, gl.OffloadedOptimizer(opt_cls, model, **kw)


def _state_tables(opt):
    return [{k: table_of(g) for k, g in pg.tables.items()} for pg in opt.pagers]


def table_of(g):
    return torch.from_numpy(np.array(g.getNumpyVersion(), copy=True))


@pytest.mark.parametrize(
    "opt_cls,kw",
    [OPTIMIZERS[1], OPTIMIZERS[3], OPTIMIZERS[6], OPTIMIZERS[8]],
    ids=["sgd_mom", "adam", "adagrad", "rmsprop_centered"],
)
@pytest.mark.parametrize("via_bytes", [False, True])
def test_state_dict_round_trip_continues_like_uninterrupted(opt_cls, kw, via_bytes):
    a, opt_a = _build(0, opt_cls, kw)
    _train_steps(a, opt_a, BAG_BATCHES[:2], [0, 1])
    sd_m, sd_o = a.state_dict(), opt_a.state_dict()
    if via_bytes:
        buf = io.BytesIO()
        torch.save({"m": sd_m, "o": sd_o}, buf)
        buf.seek(0)
        both = torch.load(buf, weights_only=True)
        sd_m, sd_o = both["m"], both["o"]
    else:
        sd_m, sd_o = copy.deepcopy(sd_m), copy.deepcopy(sd_o)
    b, opt_b = _build(123, opt_cls, kw)
    b.load_state_dict(sd_m)
    opt_b.load_state_dict(sd_o)
    assert torch.equal(table(b["bag"]), table(a["bag"]))
    _train_steps(a, opt_a, BAG_BATCHES[2:], [2, 3])
    _train_steps(b, opt_b, BAG_BATCHES[2:], [2, 3])
    for k in ("bag", "emb"):
        assert torch.equal(table(b[k]), table(a[k])), k
    for ta, tb in zip(_state_tables(opt_a), _state_tables(opt_b), strict=True):
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), k


def test_state_dict_weight_is_whole_table_and_opt_state_matches_reference():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        p.run([bag_lookup(ids, offs, len(offs), seed=s)])
    sd = off.state_dict()
    assert list(sd.keys()) == ["weight"]
    assert torch.equal(sd["weight"], ref.weight.detach())
    st = _state_tables(p.opt)[0]
    lz = p.lazy["bag"]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(st[k], lz.rows[k]), k


def test_optimizer_state_of_another_class_refused_unchanged():
    a, opt_a = _build(0, torch.optim.Adam, {"lr": 0.05})
    _train_steps(a, opt_a, BAG_BATCHES[:2], [0, 1])
    b, opt_b = _build(1, torch.optim.NAdam, {"lr": 0.05})
    _train_steps(b, opt_b, BAG_BATCHES[:1], [5])
    before = _state_tables(opt_b)
    inner_before = copy.deepcopy(opt_b.state_dict()["inner"]["state"])
    with pytest.raises(gl.GadgetError):
        opt_b.load_state_dict(opt_a.state_dict())
    after = _state_tables(opt_b)
    for x, y in zip(before, after, strict=True):
        for k in x:
            assert torch.equal(x[k], y[k])
    assert repr(opt_b.state_dict()["inner"]["state"]) == repr(inner_before)


def test_module_load_state_dict_wrong_shape_refused_unchanged():
    off, _ = make_bag("sum")
    before = table(off)
    with pytest.raises(RuntimeError):
        off.load_state_dict({"weight": torch.zeros(N + 1, D)})
    assert torch.equal(table(off), before)


def test_module_load_state_dict_float64_rounds_like_torch():
    off, _ = make_bag("sum")
    w = rnd(N, D, seed=9).double() / 3
    off.load_state_dict({"weight": w})
    assert torch.equal(table(off), w.float())


def test_load_refused_while_lookup_waits_for_step():
    """README: loading a table's rows (load_state_dict) or changing them through the table
    (fill_, insertData) while a training lookup waits for its step is refused, changing
    nothing; the pending lookup's step then proceeds normally."""
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    ids, offs = BAG_BATCHES[0]
    p.run([bag_lookup(ids, offs, len(offs), seed=0)])
    ids, offs = BAG_BATCHES[1]
    R = rnd(len(offs), D, seed=1)
    p.opt.zero_grad()
    (off(ids, offs) * R).sum().backward()
    (ref(ids, offs) * R).sum().backward()
    before = table(off)
    with pytest.raises(gl.GadgetError):
        off.weight.fill_(0.0)
    assert torch.equal(table(off), before)
    with pytest.raises(gl.GadgetError):
        off.weight.insertData(torch.zeros(1, D), torch.tensor([3]))
    assert torch.equal(table(off), before)
    with pytest.raises((RuntimeError, gl.GadgetError)):
        off.load_state_dict({"weight": torch.zeros(N, D)})
    assert torch.equal(table(off), before)
    p.opt.step()
    p.lazy["bag"].step()
    p.check()


# ----------------------------------------------------------------------------- bad input

BAD_BAG_CALLS = {
    # name: (args builder, expected exception classes)
    "id_out_of_range": (
        lambda: (torch.tensor([1, N]), torch.tensor([0, 1])),
        (gl.GadgetIndexError, IndexError),
    ),
    "id_negative": (
        lambda: (torch.tensor([1, -1]), torch.tensor([0, 1])),
        (gl.GadgetIndexError, IndexError),
    ),
    "id_out_of_range_2d": (
        lambda: (torch.tensor([[1, 2], [3, N + 5]]),),
        (gl.GadgetIndexError, IndexError),
    ),
    "id_negative_2d": (lambda: (torch.tensor([[-3, 2]]),), (gl.GadgetIndexError, IndexError)),
    "float_ids": (
        lambda: (torch.tensor([1.0, 2.0]), torch.tensor([0, 1])),
        (gl.GadgetTypeError, TypeError),
    ),
    "float_ids_2d": (lambda: (torch.tensor([[1.0, 2.0]]),), (gl.GadgetTypeError, TypeError)),
    "psw_wrong_shape": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.ones(2)),
        (gl.GadgetValueError, ValueError),
    ),
    "psw_2d_for_1d": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.ones(3, 1)),
        (gl.GadgetValueError, ValueError),
    ),
    "psw_int_dtype": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.ones(3, dtype=torch.long)),
        (gl.GadgetTypeError, TypeError),
    ),
    "offsets_not_from_0": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([1, 2])),
        (gl.GadgetValueError, ValueError),
    ),
    "offsets_decreasing": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])),
        (gl.GadgetValueError, ValueError),
    ),
    "offsets_past_input": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([0, 4])),
        (gl.GadgetValueError, ValueError),
    ),
    "offsets_float": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([0.0, 1.0])),
        (gl.GadgetTypeError, TypeError),
    ),
    "offsets_2d": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([[0, 1]])),
        (gl.GadgetValueError, ValueError),
    ),
    "offsets_int16": (
        lambda: (torch.tensor([1, 2, 3]), torch.tensor([0, 1], dtype=torch.int16)),
        (gl.GadgetTypeError, TypeError),
    ),
    "bool_ids": (
        lambda: (torch.tensor([True, False]), torch.tensor([0, 1])),
        (gl.GadgetTypeError, TypeError),
    ),
    "huge_id": (
        lambda: (torch.tensor([1, 2**40]), torch.tensor([0])),
        (gl.GadgetIndexError, IndexError),
    ),
    "offsets_with_2d_input": (
        lambda: (torch.tensor([[1, 2]]), torch.tensor([0])),
        (gl.GadgetValueError, ValueError),
    ),
    "1d_input_without_offsets": (
        lambda: (torch.tensor([1, 2]),),
        (gl.GadgetValueError, ValueError),
    ),
}


def _bad_then_good(bag_kwargs, bad_args, exc, grad):
    off, ref = make_bag(**bag_kwargs)
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    # one real step first, so the table has optimizer state and a step count
    ids, offs = BAG_BATCHES[0]
    if bag_kwargs.get("include_last_offset"):
        offs = with_last(offs, len(ids))
    p.run(
        [
            bag_lookup(
                ids, offs, len(offs) - (1 if bag_kwargs.get("include_last_offset") else 0), seed=0
            )
        ]
    )
    before = table(off)
    st_before = _state_tables(p.opt)
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx, pytest.raises(exc[0]) as ei:
        off(*bad_args)
    assert isinstance(ei.value, exc[1])
    assert torch.equal(table(off), before)
    p.opt.step()  # nothing recorded: nothing changes, the step count does not move
    assert torch.equal(table(off), before)
    for x, y in zip(st_before, _state_tables(p.opt), strict=True):
        for k in x:
            assert torch.equal(x[k], y[k]), k
    ids, offs = BAG_BATCHES[1]
    if bag_kwargs.get("include_last_offset"):
        offs = with_last(offs, len(ids))
    p.run(
        [
            bag_lookup(
                ids, offs, len(offs) - (1 if bag_kwargs.get("include_last_offset") else 0), seed=1
            )
        ]
    )
    p.check()


@pytest.mark.parametrize("name", list(BAD_BAG_CALLS))
def test_bad_bag_call_raises_documented_error_and_changes_nothing(name):
    build, exc = BAD_BAG_CALLS[name]
    _bad_then_good({"mode": "sum"}, build(), exc, grad=True)


@pytest.mark.parametrize(
    "name", ["id_out_of_range", "id_negative", "float_ids", "offsets_decreasing"]
)
def test_bad_bag_call_under_no_grad(name):
    build, exc = BAD_BAG_CALLS[name]
    _bad_then_good({"mode": "mean"}, build(), exc, grad=False)


@pytest.mark.parametrize(
    "offsets",
    [[0, 1, 2], [0, 1, 4], [1, 2, 3]],
    ids=["not_ending_at_len", "past_len", "not_from_0"],
)
def test_bad_offsets_with_include_last_offset(offsets):
    _bad_then_good(
        {"mode": "sum", "include_last_offset": True},
        (torch.tensor([1, 2, 3]), torch.tensor(offsets)),
        (gl.GadgetValueError, ValueError),
        grad=True,
    )


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_per_sample_weights_with_mean_or_max_refused_nothing_recorded(mode):
    _bad_then_good(
        {"mode": mode},
        (torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.ones(3)),
        (gl.GadgetValueError, ValueError),
        grad=True,
    )


@pytest.mark.parametrize(
    "bad,exc",
    [
        (torch.tensor([0, N]), gl.GadgetIndexError),
        (torch.tensor([[-1, 0]]), gl.GadgetIndexError),
        (torch.tensor([0.0, 1.0]), gl.GadgetTypeError),
    ],
    ids=["out_of_range", "negative", "float"],
)
def test_bad_embedding_ids(bad, exc):
    off, ref = make_emb()
    p = Pair({"emb": off}, {"emb": ref}, torch.optim.Adam, {"lr": 0.05})
    p.run([("emb", (torch.tensor([1, 2, 2]),), rnd(3, D, seed=0), False)])
    before = table(off)
    with pytest.raises(exc) as ei:
        off(bad)
    assert isinstance(ei.value, (IndexError, TypeError))
    p.opt.step()
    assert torch.equal(table(off), before)
    p.run([("emb", (torch.tensor([2, 5]),), rnd(2, D, seed=1), False)])
    p.check()


def test_error_message_says_what_was_expected_and_what_arrived():
    off, _ = make_bag("sum")
    with pytest.raises(gl.GadgetIndexError) as ei:
        off(torch.tensor([[1, N + 3]]))
    msg = str(ei.value)
    assert str(N + 3) in msg and str(N) in msg


def test_unknown_mode_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedEmbeddingBag(N, D, mode="median", placement="cpu")


def test_padding_idx_is_not_a_parameter_of_the_drop_in_bag():
    """The documented signatures have no padding_idx (only the switchers take it from an
    nn.Embedding/nn.EmbeddingBag); passing one must not be silently ignored."""
    with pytest.raises(TypeError):
        gl.OffloadedEmbeddingBag(N, D, mode="sum", placement="cpu", padding_idx=0)
    with pytest.raises(TypeError):
        gl.OffloadedEmbedding(N, D, placement="cpu", padding_idx=0)


def test_file_placement_refused_with_valid_names():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.OffloadedEmbeddingBag(N, D, placement="file")
    assert "cpu" in str(ei.value)


def test_optimizer_over_weight_gadget_refused():
    off, _ = make_bag()
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.SGD, off.weight, lr=0.1)


def test_optimizer_over_parameters_of_tables_only_model_refused():
    model = torch.nn.ModuleDict({"bag": make_bag()[0]})
    with pytest.raises(gl.GadgetError) as ei:
        gl.OffloadedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    assert "parameters()" in str(ei.value) or "table" in str(ei.value)


def test_optimizer_without_tables_warns():
    with pytest.warns(UserWarning, match="Offloaded"):
        gl.OffloadedOptimizer(torch.optim.SGD, torch.nn.Linear(2, 2).parameters(), lr=0.1)


def test_unsupported_optimizer_refused():
    class MyOpt(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        def step(self, closure=None):
            pass

    off, _ = make_bag()
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(MyOpt, off, lr=0.1)


# ----------------------------------------------------------------------------- placement fallback
# The fallback warning is given once per process, so these run in fresh interpreters.

_PRELUDE = """
import warnings, torch
torch.cuda.is_available = lambda: False
import gadgetloader as gl
"""


def _py(code):
    r = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r


@pytest.mark.parametrize("cls", ["OffloadedEmbeddingBag", "OffloadedEmbedding"])
def test_default_placement_picks_cpu_silently(cls):
    """README: "the modules' default placement pick `cpu` there silently"."""
    r = _py(f"""
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            m = gl.{cls}(8, 3)
        print(m.placement, len(w), [str(x.message) for x in w])
    """)
    assert r.returncode == 0, r.stderr
    placement, n = r.stdout.split()[:2]
    assert placement == "cpu"
    assert n == "0", r.stdout


@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_gpu_placement_by_name_falls_back_with_one_warning_same_results(placement):
    r = _py(f"""
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            a = gl.OffloadedEmbeddingBag(8, 3, mode="sum", placement="{placement}")
            b = gl.OffloadedEmbeddingBag(8, 3, mode="sum", placement="{placement}")
        cats = [x.category.__name__ for x in w]
        torch.manual_seed(0)
        c = gl.OffloadedEmbeddingBag(8, 3, mode="sum", placement="cpu")
        ids, offs = torch.tensor([1, 2, 2, 7]), torch.tensor([0, 3])
        oa = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.1)
        oc = gl.OffloadedOptimizer(torch.optim.Adam, c, lr=0.1)
        for m, o in ((a, oa), (c, oc)):
            (m(ids, offs) * torch.arange(6.).view(2, 3)).sum().backward(); o.step()
        same = bool((torch.from_numpy(a.weight.getNumpyVersion()) == torch.from_numpy(c.weight.getNumpyVersion())).all())
        print(a.placement, len(w), cats[0] if cats else None, same)
    """)
    assert r.returncode == 0, r.stderr
    placement_got, n, cat, same = r.stdout.split()
    assert placement_got == "cpu"
    assert n == "1"
    assert cat == "FallbackWarning"
    assert same == "True"


# ----------------------------------------------------------------------------- more edges


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize(
    "opt_cls,kw",
    [OPTIMIZERS[2], OPTIMIZERS[4], OPTIMIZERS[9]],
    ids=["sgd_nesterov_wd", "adam_amsgrad", "adamax"],
)
def test_bag_training_include_last_offset(mode, opt_cls, kw):
    off, ref = make_bag(mode, include_last_offset=True)
    p = Pair({"bag": off}, {"bag": ref}, opt_cls, kw)
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        p.run([bag_lookup(ids, with_last(offs, len(ids)), len(offs), seed=30 + s)])
        p.check()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_float64_table_trains_like_torch_float64(mode):
    torch.manual_seed(4)
    off = gl.OffloadedEmbeddingBag(
        N, D, mode=mode, placement="cpu", dtype=torch.float64, device="cpu"
    )
    ref = torch.nn.EmbeddingBag(N, D, mode=mode, _weight=table(off))
    assert ref.weight.dtype == torch.float64
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        p.run([("bag", (ids, offs), rnd(len(offs), D, seed=s).double(), False)])
        p.check()


def test_2d_input_with_2d_per_sample_weights_training():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1})
    for s in range(3):
        ids = torch.randint(0, 6, (3, 4), generator=torch.Generator().manual_seed(40 + s))
        psw = rnd(3, 4, seed=60 + s)
        p.run([("bag", (ids, None, psw), rnd(3, D, seed=s), False)])
        p.check()


def test_empty_2d_lookup_beside_real_one_in_a_step():
    off, ref = make_bag("mean")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    for s, (ids, offs) in enumerate(BAG_BATCHES[:3]):
        R = rnd(len(offs), D, seed=s)
        p.opt.zero_grad()
        empty = off(torch.zeros(2, 0, dtype=torch.long))
        assert torch.equal(empty.detach(), torch.zeros(2, D))
        loss = (off(ids, offs) * R).sum() + (empty * 3.0).sum()
        loss.backward()
        (ref(ids, offs) * R).sum().backward()
        p.opt.step()
        p.lazy["bag"].step()
        p.check()


def test_good_lookup_kept_when_a_later_lookup_in_the_step_is_refused():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    ids, offs = BAG_BATCHES[0]
    R = rnd(len(offs), D, seed=0)
    (off(ids, offs) * R).sum().backward()
    (ref(ids, offs) * R).sum().backward()
    with pytest.raises(gl.GadgetIndexError):
        off(torch.tensor([1, N]), torch.tensor([0, 1]))
    with pytest.raises(gl.GadgetValueError):
        off(torch.tensor([1, 2]), torch.tensor([0, 3]))
    p.opt.step()
    p.lazy["bag"].step()
    p.check()


def test_forward_without_backward_then_late_gradient_is_reported_not_applied():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    ids, offs = BAG_BATCHES[0]
    p.run([bag_lookup(ids, offs, len(offs), seed=0)])  # Adam now has momentum
    before = table(off)
    out = off(*BAG_BATCHES[1])
    p.opt.step()  # no gradient arrived: like torch, a parameter without grad is not moved
    assert torch.equal(table(off), before)
    out.sum().backward()
    with pytest.raises(gl.GadgetValueError):
        p.opt.step()
    assert torch.equal(table(off), before)


def test_lr_scheduler_changes_table_lr_like_torch():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.SGD, {"lr": 0.5, "momentum": 0.9})
    sched = torch.optim.lr_scheduler.StepLR(p.opt, step_size=1, gamma=0.5)
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        p.lazy["bag"].kw["lr"] = p.opt.param_groups[0]["lr"]
        assert p.lazy["bag"].kw["lr"] == 0.5 * 0.5**s
        p.run([bag_lookup(ids, offs, len(offs), seed=s)])
        sched.step()
        p.check()


def test_add_param_group_adds_table_with_fresh_state():
    bag, rbag = make_bag("sum")
    emb, remb = make_emb()
    p = Pair({"bag": bag}, {"bag": rbag}, torch.optim.Adam, {"lr": 0.05})
    ids, offs = BAG_BATCHES[0]
    p.run([bag_lookup(ids, offs, len(offs), seed=0)])
    p.opt.add_param_group({"params": emb, "lr": 0.2})
    p.off["emb"] = emb
    p.ref["emb"] = remb
    p.lazy["emb"] = LazyRef(remb, torch.optim.Adam, {"lr": 0.2})
    for s, (ids, offs) in enumerate(BAG_BATCHES[1:]):
        p.run(
            [
                bag_lookup(ids, offs, len(offs), seed=s + 1),
                ("emb", (ids,), rnd(len(ids), D, seed=s), False),
            ]
        )
        p.check()


def test_table_belongs_to_one_optimizer_then_released():
    import gc

    off, ref = make_bag("sum")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.1)
    off(*BAG_BATCHES[0]).sum().backward()
    opt.step()
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.1)
    del opt
    gc.collect()
    # a new optimizer takes the table with fresh state: equals Adam from scratch on these rows
    with torch.no_grad():
        ref.weight.copy_(table(off))
    p = Pair.__new__(Pair)
    p.off, p.ref = torch.nn.ModuleDict({"bag": off}), torch.nn.ModuleDict({"bag": ref})
    p.opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.1)
    p.lazy = {"bag": LazyRef(ref, torch.optim.Adam, {"lr": 0.1})}
    p.dense_opt = None
    for s, (ids, offs) in enumerate(BAG_BATCHES[1:]):
        p.run([bag_lookup(ids, offs, len(offs), seed=s)])
        p.check()


def test_deepcopy_is_a_separate_table_without_optimizer():
    off, ref = make_bag("mean")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    ids, offs = BAG_BATCHES[0]
    p.run([bag_lookup(ids, offs, len(offs), seed=0)])
    twin = copy.deepcopy(off)
    snap = table(twin)
    assert torch.equal(snap, table(off))
    ids, offs = BAG_BATCHES[1]
    p.run([bag_lookup(ids, offs, len(offs), seed=1)])
    p.check()
    assert torch.equal(table(twin), snap)
    assert not torch.equal(table(off), snap)
    # the copy can take an optimizer of its own
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, twin, lr=1.0)
    (twin(*BAG_BATCHES[2]) * 0).sum().backward()
    opt2.step()
    assert torch.equal(table(twin), snap)


def test_eval_lookup_under_no_grad_records_nothing():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    ids, offs = BAG_BATCHES[0]
    p.run([bag_lookup(ids, offs, len(offs), seed=0)])
    before = table(off)
    with torch.no_grad():
        out = off(*BAG_BATCHES[2])
    assert not out.requires_grad
    p.opt.step()
    assert torch.equal(table(off), before)
    ids, offs = BAG_BATCHES[3]
    p.run([bag_lookup(ids, offs, len(offs), seed=3)])
    p.check()


def test_clip_grad_norm_over_param_groups_matches_torch():
    off, ref = make_bag("sum")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s, (ids, offs) in enumerate(BAG_BATCHES):
        R = rnd(len(offs), D, seed=s) * 10
        opt.zero_grad()
        ropt.zero_grad()
        (off(ids, offs) * R).sum().backward()
        (ref(ids, offs) * R).sum().backward()
        n1 = torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], 1.0)
        n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch.testing.assert_close(n1, n2)
        opt.step()
        ropt.step()
        torch.testing.assert_close(table(off), ref.weight.detach(), rtol=1e-6, atol=1e-7)


def test_noncontiguous_ids_train_like_contiguous():
    off, ref = make_bag("sum")
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.Adam, {"lr": 0.05})
    for s in range(3):
        base = torch.randint(0, N, (4, 3), generator=torch.Generator().manual_seed(70 + s))
        ids2d = base.t()  # (3, 4), not contiguous
        assert not ids2d.is_contiguous()
        flat = torch.randint(0, N, (12,), generator=torch.Generator().manual_seed(80 + s))[::2]
        p.run(
            [
                ("bag", (ids2d,), rnd(3, D, seed=s), False),
                ("bag", (flat, torch.tensor([0, 2, 2])), rnd(3, D, seed=s + 9), False),
            ]
        )
        p.check()


def test_module_load_state_dict_loads_tables_that_fit():
    """README: a module's own load_state_dict behaves as torch's: tables that fit are
    loaded even when another one does not (torch then raises)."""
    torch.manual_seed(0)
    m = torch.nn.ModuleDict(
        {
            "bag": gl.OffloadedEmbeddingBag(N, D, placement="cpu", device="cpu"),
            "emb": gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu"),
        }
    )
    emb_before = table(m["emb"])
    with pytest.raises(RuntimeError, match="emb.weight"):
        m.load_state_dict({"bag.weight": torch.ones(N, D), "emb.weight": torch.ones(N + 1, D)})
    assert torch.equal(table(m["bag"]), torch.ones(N, D))
    assert torch.equal(table(m["emb"]), emb_before)


def test_optimizer_state_of_other_shape_refused_unchanged():
    a, opt_a = _build(0, torch.optim.Adam, {"lr": 0.05})
    _train_steps(a, opt_a, BAG_BATCHES[:1], [0])
    torch.manual_seed(1)
    b = torch.nn.ModuleDict(
        {
            "bag": gl.OffloadedEmbeddingBag(N + 1, D, mode="mean", placement="cpu", device="cpu"),
            "emb": gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu"),
        }
    )
    opt_b = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    (b["emb"](torch.tensor([1, 2])).sum() + b["bag"](torch.tensor([[3]])).sum()).backward()
    opt_b.step()
    before = _state_tables(opt_b)
    with pytest.raises(gl.GadgetValueError):
        opt_b.load_state_dict(opt_a.state_dict())
    for x, y in zip(before, _state_tables(opt_b), strict=True):
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_optimizer_load_state_dict_converts_float64_state_tables():
    a, opt_a = _build(0, torch.optim.Adam, {"lr": 0.05})
    _train_steps(a, opt_a, BAG_BATCHES[:2], [0, 1])
    sd = copy.deepcopy(opt_a.state_dict())
    for t in sd["tables"]:
        for k in t:
            t[k] = t[k].double() / 3
    b, opt_b = _build(5, torch.optim.Adam, {"lr": 0.05})
    opt_b.load_state_dict(sd)
    for got, want in zip(_state_tables(opt_b), sd["tables"], strict=True):
        for k in want:
            assert torch.equal(got[k], want[k].float()), k


def test_max_mode_ties_route_gradient_like_torch():
    off, ref = make_bag("max")
    w = table(off)
    w[5] = w[3]
    w[7] = w[3]
    off.load_state_dict({"weight": w})
    with torch.no_grad():
        ref.weight.copy_(w)
    p = Pair({"bag": off}, {"bag": ref}, torch.optim.SGD, {"lr": 0.5, "momentum": 0.5})
    p.run([bag_lookup(torch.tensor([5, 3, 7, 5]), torch.tensor([0, 2]), 2, seed=1)])
    p.check()
    p.run([("bag", (torch.tensor([[7, 3, 5]]),), rnd(1, D, seed=2), False)])
    p.check()


@pytest.mark.parametrize("how", ["iterate_groups", "prepare_grads"])
def test_accumulation_with_merge_between_micro_batches(how):
    """prepare_grads docstring: a backward after a merge is merged in at the next merge: the
    sums equal accumulating first."""
    bag, rbag = make_bag("sum")
    emb, remb = make_emb()
    p = Pair({"bag": bag, "emb": emb}, {"bag": rbag, "emb": remb}, torch.optim.Adam, {"lr": 0.05})
    for s in range(2):
        p.opt.zero_grad()
        mbs = [
            [
                bag_lookup(torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2]), 2, seed=s),
                ("emb", (torch.tensor([2, 4, 4]),), rnd(3, D, seed=s + 1), False),
            ],
            [
                bag_lookup(torch.tensor([3, 3, 9]), torch.tensor([0, 1]), 2, seed=s + 2),
                ("emb", (torch.tensor([4, 2]),), rnd(2, D, seed=s + 3), False),
            ],
        ]
        for mb in mbs:
            Pair._loss(p.off, mb, []).backward()
            Pair._loss(p.ref, mb, []).backward()
            if how == "prepare_grads":
                p.opt.prepare_grads()
            else:
                n = sum(q.numel() for g in p.opt.param_groups for q in g["params"])
                assert n > 0
        p.opt.step()
        for lz in p.lazy.values():
            lz.step()
        p.check()


def test_half_module_lookups_float16_table_keeps_float32():
    off, ref = make_bag("mean")
    gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)
    ids, offs = BAG_BATCHES[0]
    want = ref(ids, offs).detach()
    off.half()
    out = off(ids, offs)
    assert out.dtype == torch.float16
    assert table(off).dtype == torch.float32
    torch.testing.assert_close(out.detach().float(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int16, torch.uint8])
def test_embedding_training_small_integer_ids(id_dtype):
    off, ref = make_emb()
    p = Pair({"emb": off}, {"emb": ref}, torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5})
    for s, ids in enumerate([torch.tensor([[1, 2, 2], [5, 1, 1]]), torch.tensor([3, 3, 15])]):
        out = off(ids.to(id_dtype))
        R = rnd(*ids.shape, D, seed=s)
        p.opt.zero_grad()
        (out * R).sum().backward()
        (ref(ids) * R).sum().backward()
        p.opt.step()
        p.lazy["emb"].step()
        p.check()
