"""The drop-in OffloadedEmbedding / OffloadedEmbeddingBag with OffloadedOptimizer.

Reference: the same model with an ordinary full-table nn.Embedding(Bag) trained by
the same torch optimizer, with every row outside the batch restored after each
step (lazy per-row updates).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from torch import nn

import gadgetloader as gl

N, D = 30, 5


def _init(seed: int) -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed))


def _copy_init(t: torch.Tensor):
    return lambda w: w.copy_(t.to(w.device))


def _restore_outside(
    opt: torch.optim.Optimizer, p: torch.Tensor, before, state_before, ids, lr
) -> None:
    with torch.no_grad():
        outside = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
        outside[ids.reshape(-1)] = False
        p[outside] = before[outside]
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                v[outside] = (
                    state_before[k][outside]
                    if k in state_before
                    else (lr if k == "step_size" else 0.0)
                )


class Tower(nn.Module):
    """An embedding feeding an ordinary layer (dense params train alongside)."""

    def __init__(self, emb: nn.Module, device) -> None:
        super().__init__()
        self.emb = emb
        self.lin = nn.Linear(D, 1).to(device)
        with torch.no_grad():
            self.lin.weight.fill_(0.3)
            self.lin.bias.fill_(0.1)

    def forward(self, ids, offsets=None):
        e = self.emb(ids) if offsets is None else self.emb(ids, offsets)
        return self.lin(e).squeeze(-1)


def _run_pair(make_ref_emb, make_off_emb, opt_name, kw, device, batches, *, bag_offsets=False):
    init = _init(0)
    ref = Tower(make_ref_emb(init), device)
    off = Tower(make_off_emb(init), device)
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), **kw)
    off_opt = gl.OffloadedOptimizer(getattr(torch.optim, opt_name), off, **kw)
    for ids, offsets, y in batches:
        for model, opt in ((ref, ref_opt), (off, off_opt)):
            opt.zero_grad()
            out = model(ids, offsets) if bag_offsets else model(ids)
            loss = (out.reshape(-1)[: y.numel()] - y).pow(2).sum()
            loss.backward()
            if model is ref:
                p = ref.emb.weight
                before = p.detach().clone()
                sb = {
                    k: v.clone()
                    for k, v in opt.state[p].items()
                    if isinstance(v, torch.Tensor) and v.shape == p.shape
                }
                opt.step()
                _restore_outside(opt, p, before, sb, ids, kw["lr"])
            else:
                opt.step()
    return ref, off, ref_opt, off_opt


def _batches(seed, device, shape=(6, 3), with_offsets=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(4):
        ids = torch.randint(0, N, shape, generator=g)
        ids.view(-1)[1] = ids.view(-1)[0]
        offsets = None
        if with_offsets:
            ids = ids.reshape(-1)
            offsets = torch.tensor([0, 2, 2, 7, 10])
        y = torch.randn(shape[0] if not with_offsets else 5, generator=g)
        out.append((ids.to(device), None if offsets is None else offsets.to(device), y.to(device)))
    return out


OPTS = [
    ("Adam", {"lr": 0.05}),
    ("AdamW", {"lr": 0.05, "amsgrad": True}),
    ("Adagrad", {"lr": 0.1}),
    ("Rprop", {"lr": 0.05}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.9, "centered": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("ASGD", {"lr": 0.05}),
]


@pytest.mark.parametrize(("opt_name", "kw"), OPTS, ids=[o[0] for o in OPTS])
def test_offloaded_embedding_matches_full_table(placement, device, opt_name, kw):
    ref, off, _, _ = _run_pair(
        lambda init: nn.Embedding.from_pretrained(init, freeze=False).to(device),
        lambda init: gl.OffloadedEmbedding(N, D, placement, device=device, init=_copy_init(init)),
        opt_name,
        kw,
        device,
        _batches(1, device),
    )
    torch.testing.assert_close(
        torch.from_numpy(off.emb.table.getNumpyVersion()),
        ref.emb.weight.detach().cpu(),
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(off.lin.weight, ref.lin.weight, rtol=1e-5, atol=1e-6)


def test_offloaded_embedding_is_exact_for_sgd(placement, device):
    ref, off, _, _ = _run_pair(
        lambda init: nn.Embedding.from_pretrained(init, freeze=False).to(device),
        lambda init: gl.OffloadedEmbedding(N, D, placement, device=device, init=_copy_init(init)),
        "SGD",
        {"lr": 0.1},
        device,
        _batches(2, device),
    )
    assert torch.equal(
        torch.from_numpy(off.emb.table.getNumpyVersion()), ref.emb.weight.detach().cpu()
    )


def test_sparse_adam_through_the_wrapper(placement, device):
    """SparseAdam on an offloaded table equals SparseAdam on nn.Embedding(sparse=True)."""
    init = _init(3)
    ref = nn.Embedding.from_pretrained(init, freeze=False, sparse=True).to(device)
    off = gl.OffloadedEmbedding(N, D, placement, device=device, init=_copy_init(init))
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    off_opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, off, lr=0.05)
    for ids, _, y in _batches(4, device):
        for emb, opt in ((ref, ref_opt), (off, off_opt)):
            opt.zero_grad()
            ((emb(ids).sum(-1) * 0.2).tanh().sum(-1) - y).pow(2).sum().backward()
            with torch.sparse.check_sparse_tensor_invariants(enable=True):
                opt.step()
    torch.testing.assert_close(
        torch.from_numpy(off.table.getNumpyVersion()),
        ref.weight.detach().cpu(),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("form", ["2d", "offsets"])
def test_offloaded_embedding_bag_matches_full_table(placement, device, mode, form):
    ref, off, _, _ = _run_pair(
        lambda init: nn.EmbeddingBag.from_pretrained(init, freeze=False, mode=mode).to(device),
        lambda init: gl.OffloadedEmbeddingBag(
            N, D, mode, placement, device=device, init=_copy_init(init)
        ),
        "Adam",
        {"lr": 0.05},
        device,
        _batches(5, device, with_offsets=form == "offsets"),
        bag_offsets=form == "offsets",
    )
    torch.testing.assert_close(
        torch.from_numpy(off.emb.table.getNumpyVersion()),
        ref.emb.weight.detach().cpu(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_two_lookups_of_one_table_per_step(placement, device):
    """word2vec's output table is looked up twice (positives, negatives) before one step."""
    init = _init(6)
    ref = nn.Embedding.from_pretrained(init, freeze=False).to(device)
    off = gl.OffloadedEmbedding(N, D, placement, device=device, init=_copy_init(init))
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    off_opt = gl.OffloadedOptimizer(torch.optim.Adagrad, off, lr=0.1)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        a = torch.randint(0, N, (8,), generator=g).to(device)
        b = torch.randint(0, N, (8, 3), generator=g).to(device)
        for emb, opt in ((ref, ref_opt), (off, off_opt)):
            opt.zero_grad()
            loss = -(F.logsigmoid(emb(a).sum(-1)).sum() + F.logsigmoid(-emb(b).sum(-1)).sum())
            loss.backward()
            if emb is ref:
                p = ref.weight
                before, sb = (
                    p.detach().clone(),
                    {k: v.clone() for k, v in opt.state[p].items() if v.shape == p.shape},
                )
                opt.step()
                _restore_outside(opt, p, before, sb, torch.cat([a, b.reshape(-1)]), 0.1)
            else:
                opt.step()
    torch.testing.assert_close(
        torch.from_numpy(off.table.getNumpyVersion()),
        ref.weight.detach().cpu(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_lr_scheduler_and_state_dict(placement, device):
    off = gl.OffloadedEmbedding(
        N, D, placement, device=device, init=functools.partial(nn.init.uniform_, a=-0.1, b=0.1)
    )
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    off(torch.tensor([1, 2, 2], device=device)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.05)
    sd_mod, sd_opt = off.state_dict(), opt.state_dict()
    assert tuple(sd_mod["weight"].shape) == (N, D)
    off2 = gl.OffloadedEmbedding(N, D, placement, device=device)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, off2, lr=0.1)
    off2.load_state_dict(sd_mod)
    opt2.load_state_dict(sd_opt)
    ids = torch.tensor([2, 3, 9], device=device)
    for emb, o in ((off, opt), (off2, opt2)):
        emb(ids).pow(2).sum().backward()
        o.step()
    assert torch.equal(
        torch.from_numpy(off.table.getNumpyVersion()),
        torch.from_numpy(off2.table.getNumpyVersion()),
    )
    for k in opt.pagers[0].tables:
        assert torch.equal(
            torch.from_numpy(opt.pagers[0].tables[k].getNumpyVersion()),
            torch.from_numpy(opt2.pagers[0].tables[k].getNumpyVersion()),
        )


def test_no_grad_forward_keeps_nothing(placement, device):
    off = gl.OffloadedEmbedding(N, D, placement, device=device)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.1)  # noqa: F841 (kept alive)
    with torch.no_grad():
        out = off(torch.tensor([[1, 2]], device=device))
    assert out.shape == (1, 2, D) and not off._pending


def test_module_errors(device):
    with pytest.raises(gl.GadgetValueError, match="mode"):
        gl.OffloadedEmbeddingBag(N, D, "median", "cpu", device=device)
    emb = gl.OffloadedEmbedding(N, D, "cpu", device=device)
    with pytest.raises(gl.GadgetIndexError):
        emb(torch.tensor([N]))
    with pytest.raises(gl.GadgetTypeError, match="SparseAdam"):
        gl.OffloadedOptimizer(torch.optim.LBFGS, emb)
    first = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)  # noqa: F841 (kept alive)
    with pytest.raises(gl.GadgetValueError, match="already"):
        gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    bag = gl.OffloadedEmbeddingBag(N, D, "sum", "cpu", device=device)
    with pytest.raises(gl.GadgetValueError, match="offsets"):
        bag(torch.tensor([1, 2]))


@pytest.mark.gpu
def test_model_to_cuda_moves_lookups_not_the_table(placement):
    """``model.to('cuda')`` moves where rows are delivered and the step runs."""
    init = _init(8)
    off = Tower(gl.OffloadedEmbedding(N, D, placement, device="cpu", init=_copy_init(init)), "cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    off.to("cuda")
    ids = torch.tensor([[1, 2, 2]], device="cuda")
    out = off(ids)
    assert out.is_cuda
    out.sum().backward()
    opt.step()
    table = torch.from_numpy(off.emb.table.getNumpyVersion())
    assert not torch.equal(table[1], init[1]) and torch.equal(table[0], init[0])


def test_grad_scaler_and_clipping_see_table_gradients(placement, device):
    """prepare_grads() puts the rows' gradients where GradScaler / clipping look."""
    init = _init(9)
    plain = gl.OffloadedEmbedding(N, D, placement, device=device, init=_copy_init(init))
    scaled = gl.OffloadedEmbedding(N, D, placement, device=device, init=_copy_init(init))
    opt_p = gl.OffloadedOptimizer(torch.optim.SGD, plain, lr=0.1)
    opt_s = gl.OffloadedOptimizer(torch.optim.SGD, scaled, lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    for ids, _, y in _batches(10, device):
        opt_p.zero_grad()
        ((plain(ids).sum((1, 2)) - y) ** 2).sum().backward()
        opt_p.prepare_grads()
        params = [p for g in opt_p.param_groups for p in g["params"]]
        assert any(p.grad is not None for p in params)
        torch.nn.utils.clip_grad_norm_(params, max_norm=1e9)  # sees the rows, changes nothing
        opt_p.step()
        opt_s.zero_grad()
        scaler.scale(((scaled(ids).sum((1, 2)) - y) ** 2).sum()).backward()
        opt_s.prepare_grads()
        scaler.step(opt_s)
        scaler.update()
    # scaling by a power of two and unscaling is exact
    assert torch.equal(
        torch.from_numpy(plain.table.getNumpyVersion()),
        torch.from_numpy(scaled.table.getNumpyVersion()),
    )
    # a backward after the merge (gradient accumulation, the groups read in between) merges
    # again: the step equals accumulating both backwards first
    opt_s.zero_grad()
    opt_p.zero_grad()
    for emb, opt, read_between in ((plain, opt_p, True), (scaled, opt_s, False)):
        emb(torch.tensor([1, 2], device=device)).sum().backward()
        if read_between:
            opt.prepare_grads()
            assert opt.param_groups[0]["params"][-1].grad is not None
        (emb(torch.tensor([2, 3, 3], device=device)) * 2).sum().backward()
        opt.step()
    assert torch.equal(
        torch.from_numpy(plain.table.getNumpyVersion()),
        torch.from_numpy(scaled.table.getNumpyVersion()),
    )
    moved = torch.from_numpy(plain.table.getNumpyVersion()) - init
    assert not torch.equal(moved[3], torch.zeros_like(moved[3]))
