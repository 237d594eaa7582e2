"""Session 19 review probes: "Training embeddings larger than GPU memory" (README) and the
SpeedTorch-compatible names of SPEC.md, checked on the CPU against plain-torch references.

Reference for lazy per-row training: a dense torch parameter (the whole table) trained with
the same torch optimizer class and options, where after each step the rows outside the
batch (parameter and row-shaped state) are put back as they were -- exactly "rows outside
a batch untouched, one step count per table".
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import gadgetloader as gl


@pytest.fixture(autouse=True)
def _rows_delivered_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """These probes check a CPU machine's behaviour against NumPy: on a CUDA machine rows
    would arrive on the GPU by default (``device=None``), so the default is the CPU here."""
    import gadgetloader._device as _dev

    monkeypatch.setattr(_dev, "default_device", lambda: torch.device("cpu"))


#: torch.optim.Adafactor (torch >= 2.5): one more optimizer that cannot be paged
_ADAFACTOR = [torch.optim.Adafactor] if hasattr(torch.optim, "Adafactor") else []

N, D = 12, 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- helpers
def _batches(seed: int = 0, steps: int = 5, cover_first: bool = True):
    """(ids, target) pairs; ids have repeats; the first batch covers every row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        if s == 0 and cover_first:
            ids = torch.cat([torch.arange(N), torch.randint(0, N, (5,), generator=g)])
        else:
            ids = torch.randint(0, N // 2 + s % 3, (7,), generator=g)
            ids = torch.cat([ids, ids[:2]])  # guaranteed repeats
        tgt = torch.randn(ids.shape[0], D, generator=g)
        out.append((ids, tgt))
    return out


def _loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return ((out - tgt) ** 2 * torch.linspace(0.5, 1.5, out.shape[0])[:, None]).sum()


def _row_state_keys(state: dict, shape) -> list[str]:
    return [k for k, v in state.items() if torch.is_tensor(v) and tuple(v.shape) == tuple(shape)]


def lazy_reference(cls, kwargs, w0: np.ndarray, batches, init_state=None):
    """Dense full-table torch training with rows outside each batch put back."""
    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32).clone())
    opt = cls([p], **kwargs)
    for ids, tgt in batches:
        mask = torch.zeros(p.shape[0], dtype=torch.bool)
        mask[ids.unique()] = True
        before_p = p.detach().clone()
        had = p in opt.state and len(opt.state[p]) > 0
        before_s = (
            {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} if had else None
        )
        opt.zero_grad()
        _loss(F.embedding(ids, p), tgt).backward()
        opt.step()
        with torch.no_grad():
            p[~mask] = before_p[~mask]
            st = opt.state[p]
            for k in _row_state_keys(st, p.shape):
                if before_s is not None and k in before_s:
                    st[k][~mask] = before_s[k][~mask]
                elif init_state is not None:
                    st[k][~mask] = init_state[k]
                else:
                    assert bool(mask.all()), "first reference batch must cover every row"
    return p.detach().numpy(), {
        k: v.detach().numpy() for k, v in opt.state[p].items() if torch.is_tensor(v)
    }


def drop_in_train(cls, kwargs, batches, init=None, bag=None):
    torch.manual_seed(1)
    if bag is None:
        emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=init)
    else:
        emb = gl.OffloadedEmbeddingBag(N, D, mode=bag, placement="cpu", device="cpu", init=init)
    w0 = emb.weight.getNumpyVersion().copy()
    opt = gl.OffloadedOptimizer(cls, emb, **kwargs)
    for ids, tgt in batches:
        opt.zero_grad()
        _loss(emb(ids), tgt).backward()
        opt.step()
    return emb, opt, w0


OPTIMIZERS = [
    pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
    pytest.param(torch.optim.Adam, dict(lr=0.05, amsgrad=True, foreach=False), id="Adam-ams-loop"),
    pytest.param(torch.optim.Adam, dict(lr=0.05, foreach=True), id="Adam-foreach"),
    pytest.param(torch.optim.Adam, dict(lr=0.05, fused=True), id="Adam-fused"),
    pytest.param(torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, amsgrad=True), id="AdamW-ams"),
    pytest.param(torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, fused=True), id="AdamW-fused"),
    pytest.param(torch.optim.Adamax, dict(lr=0.05, weight_decay=0.01), id="Adamax"),
    pytest.param(torch.optim.Adamax, dict(lr=0.05, foreach=True), id="Adamax-foreach"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0, rho=0.8), id="Adadelta"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0, foreach=True), id="Adadelta-foreach"),
    pytest.param(torch.optim.RMSprop, dict(lr=0.01, momentum=0.9), id="RMSprop-mom"),
    pytest.param(
        torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True), id="RMSprop-centered"
    ),
    pytest.param(
        torch.optim.RMSprop, dict(lr=0.01, centered=True, foreach=True), id="RMSprop-c-foreach"
    ),
    pytest.param(torch.optim.Rprop, dict(lr=0.01), id="Rprop"),
    pytest.param(torch.optim.Rprop, dict(lr=0.02, foreach=True), id="Rprop-foreach"),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=2, lambd=0.01), id="ASGD"),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=1, foreach=True), id="ASGD-foreach"),
    pytest.param(
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
        id="Adagrad",
    ),
    pytest.param(torch.optim.Adagrad, dict(lr=0.1, fused=True), id="Adagrad-fused"),
    pytest.param(torch.optim.SGD, dict(lr=0.05), id="SGD"),
    pytest.param(torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), id="SGD-nesterov"),
    pytest.param(
        torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01, fused=True), id="SGD-fused"
    ),
    pytest.param(torch.optim.SGD, dict(lr=0.05, momentum=0.9, foreach=True), id="SGD-foreach"),
    pytest.param(torch.optim.NAdam, dict(lr=0.05), id="NAdam"),
    pytest.param(
        torch.optim.NAdam,
        dict(lr=0.05, decoupled_weight_decay=True, weight_decay=0.1),
        id="NAdam-dwd",
    ),
    pytest.param(torch.optim.RAdam, dict(lr=0.05), id="RAdam"),
    # exotic options
    pytest.param(
        torch.optim.Adam, dict(lr=0.05, maximize=True, weight_decay=0.1), id="Adam-maximize-wd"
    ),
    pytest.param(torch.optim.Adam, dict(lr=torch.tensor(0.05)), id="Adam-tensor-lr"),
    pytest.param(torch.optim.Adam, dict(lr=0.05, betas=(0.5, 0.9), eps=1e-3), id="Adam-betas"),
    pytest.param(torch.optim.SGD, dict(lr=0.05, momentum=0.9, maximize=True), id="SGD-maximize"),
    pytest.param(
        torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.0, foreach=False), id="SGD-loop"
    ),
    pytest.param(
        torch.optim.Adagrad, dict(lr=0.1, maximize=True, weight_decay=0.1), id="Adagrad-max-wd"
    ),
    pytest.param(
        torch.optim.Rprop, dict(lr=0.01, etas=(0.3, 1.5), step_sizes=(1e-4, 0.02)), id="Rprop-etas"
    ),
    pytest.param(
        torch.optim.ASGD, dict(lr=0.05, t0=1, alpha=0.5, weight_decay=0.1), id="ASGD-alpha-wd"
    ),
    pytest.param(
        torch.optim.RMSprop,
        dict(lr=0.01, alpha=0.5, weight_decay=0.1, maximize=True),
        id="RMSprop-wd-max",
    ),
    pytest.param(
        torch.optim.Adadelta, dict(lr=0.5, weight_decay=0.1, maximize=True), id="Adadelta-wd-max"
    ),
    pytest.param(torch.optim.Adamax, dict(lr=0.05, maximize=True), id="Adamax-maximize"),
    pytest.param(
        torch.optim.NAdam, dict(lr=0.05, momentum_decay=0.01, foreach=True), id="NAdam-foreach"
    ),
    pytest.param(
        torch.optim.RAdam,
        dict(lr=0.05, decoupled_weight_decay=True, weight_decay=0.1),
        id="RAdam-dwd",
    ),
    pytest.param(
        torch.optim.AdamW,
        dict(lr=0.05, amsgrad=True, foreach=True, maximize=True),
        id="AdamW-ams-foreach-max",
    ),
]

#: torch's initial row state of a fresh parameter, for rows first seen after step 1
INIT_STATE = {
    "Adam": {"exp_avg": 0.0, "exp_avg_sq": 0.0, "max_exp_avg_sq": 0.0},
    "Rprop": {"prev": 0.0, "step_size": 0.03},
    "Adagrad": {"sum": 0.25},
    "SGD": {"momentum_buffer": 0.0},
    "RMSprop": {"square_avg": 0.0, "momentum_buffer": 0.0, "grad_avg": 0.0},
    "ASGD": {"ax": 0.0},
}
LATE_ROWS = [
    pytest.param(torch.optim.Adam, dict(lr=0.05, amsgrad=True), "Adam", id="Adam"),
    pytest.param(torch.optim.Rprop, dict(lr=0.03), "Rprop", id="Rprop"),
    pytest.param(
        torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.25), "Adagrad", id="Adagrad"
    ),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9), "SGD", id="SGD"),
    pytest.param(
        torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True), "RMSprop", id="RMSprop"
    ),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=1), "ASGD", id="ASGD"),
]


def _state_tables(opt, i=0):
    return {k: t.getNumpyVersion() for k, t in opt.pagers[i].tables.items()}


# ------------------------------------------------------------ drop-in vs dense torch
@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS)
def test_dropin_matches_lazy_dense_reference(cls, kwargs):
    batches = _batches()
    emb, opt, w0 = drop_in_train(cls, kwargs, batches)
    ref_w, ref_s = lazy_reference(cls, kwargs, w0, batches)
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)
    got = _state_tables(opt)
    for k, v in got.items():
        assert k in ref_s, (k, list(ref_s))
        np.testing.assert_allclose(v, ref_s[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # step count: one per table step, as the dense parameter's
    inner_state = opt.state[emb._slot.param]
    if "step" in inner_state:
        assert float(inner_state["step"]) == float(len(batches))


@pytest.mark.parametrize(("cls", "kwargs", "name"), LATE_ROWS)
def test_dropin_rows_first_seen_late_start_from_torch_init(cls, kwargs, name):
    batches = _batches(seed=3, cover_first=False)
    emb, opt, w0 = drop_in_train(cls, kwargs, batches)
    ref_w, ref_s = lazy_reference(cls, kwargs, w0, batches, init_state=INIT_STATE[name])
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)
    for k, v in _state_tables(opt).items():
        np.testing.assert_allclose(v, ref_s[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_dropin_rows_outside_batches_bit_untouched():
    emb, opt, w0 = drop_in_train(
        torch.optim.AdamW, dict(lr=0.1, weight_decay=0.5), _batches(cover_first=False)
    )
    used = torch.cat([b[0] for b in _batches(cover_first=False)]).unique().numpy()
    unused = np.setdiff1d(np.arange(N), used)
    assert unused.size > 0
    w = emb.weight.getNumpyVersion()
    assert np.array_equal(w[unused], w0[unused])
    assert not np.allclose(w[used], w0[used])
    for k, v in _state_tables(opt).items():
        assert np.all(v[unused] == 0), k


def test_sparseadam_matches_torch_sparse_embedding():
    batches = _batches()
    emb, opt, w0 = drop_in_train(torch.optim.SparseAdam, dict(lr=0.05), batches)
    ref = torch.nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w0))
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    for ids, tgt in batches:
        ropt.zero_grad()
        _loss(ref(ids), tgt).backward()
        ropt.step()
    np.testing.assert_allclose(
        emb.weight.getNumpyVersion(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )
    rs = ropt.state[ref.weight]
    for k, v in _state_tables(opt).items():
        np.testing.assert_allclose(v, rs[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_dropin_with_ordinary_params_matches_torch():
    """A head's dense parameters beside a table: same result as all-dense torch (first
    batch covering every row, later batches too, so lazy == dense)."""
    torch.manual_seed(5)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    head = torch.nn.Linear(D, 1)
    model = torch.nn.ModuleDict({"e": emb, "h": head})
    ref_e = torch.nn.Embedding(N, D)
    ref_h = copy.deepcopy(head)
    with torch.no_grad():
        ref_e.weight.copy_(torch.from_numpy(emb.weight.getNumpyVersion()))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.02)
    ropt = torch.optim.Adam([*ref_e.parameters(), *ref_h.parameters()], lr=0.02)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.cat([torch.arange(N), torch.randint(0, N, (6,), generator=g)])
        y = torch.randn(ids.shape[0], generator=g)
        opt.zero_grad()
        F.mse_loss(head(emb(ids)).squeeze(-1), y).backward()
        opt.step()
        ropt.zero_grad()
        F.mse_loss(ref_h(ref_e(ids)).squeeze(-1), y).backward()
        ropt.step()
    np.testing.assert_allclose(
        emb.weight.getNumpyVersion(), ref_e.weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(head.weight, ref_h.weight)
    torch.testing.assert_close(head.bias, ref_h.bias)


# ------------------------------------------------------------------ EmbeddingBag
def _bag_ref(w0, opt_cls, kwargs, steps, mode):
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = opt_cls([p], **kwargs)
    for inp, off, psw, tgt in steps:
        opt.zero_grad()
        out = F.embedding_bag(inp, p, off, mode=mode, per_sample_weights=psw)
        ((out - tgt) ** 2).sum().backward()
        opt.step()
    return p.detach().numpy()


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("form", ["2d", "offsets", "offsets32", "numpy2d"])
def test_bag_matches_torch_embedding_bag(mode, form):
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(2)
    bag = gl.OffloadedEmbeddingBag(N, D, mode=mode, placement="cpu", device="cpu")
    w0 = bag.weight.getNumpyVersion().copy()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=0.1)  # SGD: lazy == dense
    steps = []
    for _ in range(3):
        inp2 = torch.randint(0, N, (4, 3), generator=g)
        inp2[0, 1] = inp2[0, 0]  # repeat inside a bag
        tgt = torch.randn(4, D, generator=g)
        flat = inp2.flatten()
        off = torch.tensor([0, 2, 2, 7])  # an empty bag (index 1) too
        steps.append((flat, off, None, tgt, inp2))
    for flat, off, _, tgt, inp2 in steps:
        opt.zero_grad()
        if form == "2d":
            out = bag(inp2)
        elif form == "numpy2d":
            out = bag(inp2.numpy())
        elif form == "offsets":
            out = bag(flat, off)
        else:
            out = bag(flat.to(torch.int32), off.to(torch.int32))
        ((out - tgt) ** 2).sum().backward()
        opt.step()
    if form in ("2d", "numpy2d"):
        ref_steps = [(inp2, None, None, tgt) for _, _, _, tgt, inp2 in steps]
    else:
        ref_steps = [(flat, off, None, tgt) for flat, off, _, tgt, _ in steps]
    ref = _bag_ref(w0, torch.optim.SGD, dict(lr=0.1), ref_steps, mode)
    np.testing.assert_allclose(bag.weight.getNumpyVersion(), ref, rtol=1e-5, atol=1e-6)


def test_bag_forward_values_and_per_sample_weights():
    bag = gl.OffloadedEmbeddingBag(N, D, mode="sum", placement="cpu", device="cpu")
    w = torch.from_numpy(bag.weight.getNumpyVersion().copy())
    inp = torch.tensor([1, 1, 4, 7, 2])
    off = torch.tensor([0, 3])
    psw = torch.tensor([0.5, 2.0, -1.0, 3.0, 1.5])
    with torch.no_grad():
        got = bag(inp, off, per_sample_weights=psw)
    ref = F.embedding_bag(inp, w, off, mode="sum", per_sample_weights=psw)
    torch.testing.assert_close(got, ref)


def test_bag_include_last_offset():
    bag = gl.OffloadedEmbeddingBag(
        N, D, mode="mean", placement="cpu", device="cpu", include_last_offset=True
    )
    w = torch.from_numpy(bag.weight.getNumpyVersion().copy())
    inp = torch.tensor([1, 3, 4, 7, 2])
    off = torch.tensor([0, 2, 5])
    with torch.no_grad():
        got = bag(inp, off)
    ref = F.embedding_bag(inp, w, off, mode="mean", include_last_offset=True)
    assert got.shape == (2, D)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((torch.tensor([1, 2, 3]),), gl.GadgetValueError),  # 1-D without offsets
        ((torch.tensor([1, 2, 3]), torch.tensor([1, 2])), gl.GadgetValueError),  # not from 0
        ((torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), gl.GadgetValueError),  # decreasing
        ((torch.tensor([1, 2, 3]), torch.tensor([0, 4])), gl.GadgetValueError),  # past end
        ((torch.tensor([1, 2, 3]), torch.tensor([0.0, 1.0])), gl.GadgetTypeError),  # float offs
        ((torch.tensor([[1, 2]]), torch.tensor([0])), gl.GadgetValueError),  # 2-D + offsets
        ((torch.tensor([[1, N]]),), gl.GadgetIndexError),  # id == len
        ((torch.tensor([[1, -1]]),), gl.GadgetIndexError),  # negative id
        ((torch.tensor([[1.0, 2.0]]),), gl.GadgetTypeError),  # float ids
    ],
)
def test_bag_bad_input_clear_error_and_nothing_recorded(args, exc):
    bag = gl.OffloadedEmbeddingBag(N, D, mode="sum", placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, bag, lr=0.1)
    w0 = bag.weight.getNumpyVersion().copy()
    with pytest.raises(exc) as ei:
        bag(*args)
    assert len(str(ei.value)) > 20
    # nothing pending: a good step afterwards trains just its own rows
    bag(torch.tensor([[5, 6]])).sum().backward()
    opt.step()
    w = bag.weight.getNumpyVersion()
    changed = np.where(~np.all(w == w0, axis=1))[0].tolist()
    assert changed == [5, 6]


def test_bag_unknown_mode_lists_valid():
    with pytest.raises(gl.GadgetValueError, match="sum"):
        gl.OffloadedEmbeddingBag(N, D, mode="median", placement="cpu", device="cpu")


# ------------------------------------------------------------- drop-in id forms
ID_FORMS = [
    pytest.param(lambda a: torch.from_numpy(a), id="int64-tensor"),
    pytest.param(lambda a: torch.from_numpy(a).to(torch.int32), id="int32-tensor"),
    pytest.param(lambda a: a.astype(np.int32), id="numpy-int32"),
    pytest.param(lambda a: a.tolist(), id="list"),
    pytest.param(lambda a: torch.from_numpy(np.stack([a, a])).t()[:, 0], id="non-contiguous"),
]


@pytest.mark.parametrize("form", ID_FORMS)
def test_dropin_id_forms_train_like_int64(form):
    ids = np.array([3, 1, 3, 7, 0, 3], dtype=np.int64)
    tgt = torch.randn(len(ids), D, generator=torch.Generator().manual_seed(0))

    def run(conv):
        torch.manual_seed(4)
        emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
        opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
        for _ in range(2):
            _loss(emb(conv(ids)), tgt).backward()
            opt.step()
            opt.zero_grad()
        return emb.weight.getNumpyVersion()

    ref = run(lambda a: torch.from_numpy(a))
    got = run(form)
    assert np.array_equal(got, ref)


def test_dropin_forward_values_equal_f_embedding_2d_ids():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    w = torch.from_numpy(emb.weight.getNumpyVersion().copy())
    ids = torch.tensor([[0, N - 1, 5], [5, 5, 2]])
    out = emb(ids)  # no optimizer attached yet: a constant lookup (docstring)
    torch.testing.assert_close(out.detach(), F.embedding(ids, w))


@pytest.mark.parametrize("bad", [N, -1, N + 100])
def test_dropin_out_of_range_id_refused_before_anything(bad):
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    w0 = emb.weight.getNumpyVersion().copy()
    s0 = _state_tables(opt)
    step0 = float(opt.state[emb._slot.param]["step"])
    with pytest.raises(gl.GadgetIndexError, match=str(bad)):
        emb(torch.tensor([1, bad, 3]))
    opt.step()  # nothing pending: no change at all
    assert np.array_equal(emb.weight.getNumpyVersion(), w0)
    for k, v in _state_tables(opt).items():
        assert np.array_equal(v, s0[k])
    assert float(opt.state[emb._slot.param]["step"]) == step0


def test_dropin_empty_batch_step_changes_nothing():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    w0 = emb.weight.getNumpyVersion().copy()
    out = emb(torch.tensor([], dtype=torch.long))
    assert out.shape == (0, D)
    (out.sum() * 1.0).backward()
    opt.step()
    assert np.array_equal(emb.weight.getNumpyVersion(), w0)


def test_dropin_second_step_without_backward_leaves_table():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    w1 = emb.weight.getNumpyVersion().copy()
    s1 = _state_tables(opt)
    opt.step()
    assert np.array_equal(emb.weight.getNumpyVersion(), w1)
    for k, v in _state_tables(opt).items():
        assert np.array_equal(v, s1[k])
    assert float(opt.state[emb._slot.param]["step"]) == 1.0


def test_dropin_two_forwards_before_step_sum_gradients():
    """Two lookups in one step: gradients add, as for a full-table parameter."""
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    w0 = emb.weight.getNumpyVersion().copy()
    opt = gl.OffloadedOptimizer(torch.optim.Adagrad, emb, lr=0.1)
    a, b = torch.tensor([1, 2, 2]), torch.tensor([2, 9])
    ta, tb = torch.randn(3, D), torch.randn(2, D)
    (_loss(emb(a), ta) + _loss(emb(b), tb)).backward()
    opt.step()
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    ro = torch.optim.Adagrad([p], lr=0.1)
    (_loss(F.embedding(a, p), ta) + _loss(F.embedding(b, p), tb)).backward()
    ro.step()
    np.testing.assert_allclose(
        emb.weight.getNumpyVersion(), p.detach().numpy(), rtol=1e-6, atol=1e-7
    )


def test_dropin_duplicates_accumulate_exactly_sgd():
    """With plain SGD an id repeated k times moves by k times a single gradient."""
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=torch.nn.init.zeros_)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    emb(torch.tensor([4, 4, 4, 6])).sum().backward()
    opt.step()
    w = emb.weight.getNumpyVersion()
    assert np.array_equal(w[4], np.full(D, -3.0, dtype=np.float32))
    assert np.array_equal(w[6], np.full(D, -1.0, dtype=np.float32))
    assert np.count_nonzero(w) == 2 * D


# ------------------------------------------------------------------ switchers
class SkipGram(torch.nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(n, d)
        self.v_embeddings = torch.nn.Embedding(n, d)

    def forward(self, c, p, ng):
        u = self.u_embeddings(c)
        v = self.v_embeddings(p)
        vn = self.v_embeddings(ng)
        pos = F.logsigmoid((u * v).sum(-1)).sum()
        neg = F.logsigmoid(-(u[:, None, :] * vn).sum(-1)).sum()
        return -(pos + neg)


def _w2v_batches(total, steps=4, seed=0, b=5, k=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        c = torch.randint(0, total, (b,), generator=g)
        c[1] = c[0]  # a repeated center
        p = torch.randint(0, total, (b,), generator=g)
        n = torch.randint(0, total, (b, k), generator=g)
        n[0, 0] = p[0]  # an id both in ctx and in negatives
        if s == 0:  # the first batch covers every row of both tables
            c = torch.cat([torch.arange(total), c])
            p = torch.cat([torch.arange(total), p])
            n = torch.cat([n, n[:1].repeat(total, 1)])
        out.append((c, p, n))
    return out


def _w2v_reference(cls, kwargs, u0, v0, batches):
    total, d = u0.shape
    m = SkipGram(total, d)
    with torch.no_grad():
        m.u_embeddings.weight.copy_(torch.from_numpy(u0))
        m.v_embeddings.weight.copy_(torch.from_numpy(v0))
    opt = cls(m.parameters(), **kwargs)
    for c, p, n in batches:
        masks = {}
        for prm, ids in (
            (m.u_embeddings.weight, c),
            (m.v_embeddings.weight, torch.cat([p, n.flatten()])),
        ):
            mk = torch.zeros(total, dtype=torch.bool)
            mk[ids.unique()] = True
            had = {k: v.clone() for k, v in opt.state[prm].items() if torch.is_tensor(v)}
            masks[prm] = (mk, prm.detach().clone(), had)
        opt.zero_grad()
        m(c, p, n).backward()
        opt.step()
        with torch.no_grad():
            for prm, (mk, before, had) in masks.items():
                prm[~mk] = before[~mk]
                for k in _row_state_keys(opt.state[prm], prm.shape):
                    if k in had:
                        opt.state[prm][k][~mk] = had[k][~mk]
                    else:
                        assert bool(mk.all())
    return m, opt


SWITCHER_OPTS = [
    pytest.param(torch.optim.Adam, dict(lr=0.05), id="Adam"),
    pytest.param(torch.optim.AdamW, dict(lr=0.05, amsgrad=True, weight_decay=0.1), id="AdamW-ams"),
    pytest.param(torch.optim.Adamax, dict(lr=0.05), id="Adamax"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0), id="Adadelta"),
    pytest.param(torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True), id="RMSprop"),
    pytest.param(torch.optim.Rprop, dict(lr=0.01), id="Rprop"),
    pytest.param(torch.optim.ASGD, dict(lr=0.05, t0=1), id="ASGD"),
    pytest.param(torch.optim.Adagrad, dict(lr=0.1), id="Adagrad"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), id="SGD-nesterov"),
    pytest.param(torch.optim.Adam, dict(lr=0.05, fused=True), id="Adam-fused"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True), id="SGD-foreach"),
]


@pytest.mark.parametrize("factory", ["cupy", "pytorch"])
@pytest.mark.parametrize(("cls", "kwargs"), SWITCHER_OPTS)
def test_switchers_readme_loop_match_lazy_reference(cls, kwargs, factory):
    total, d, cap = 10, 4, 64
    torch.manual_seed(3)
    model = SkipGram(cap, d)
    optimizer = cls(model.parameters(), **kwargs)
    if factory == "cupy":
        mk = functools.partial(gl.ModelFactory, placement="cpu")
        ok = functools.partial(gl.OptimizerFactory, placement="cpu")
    else:
        mk = functools.partial(gl.PytorchModelFactory, deviceType="cpu")
        ok = functools.partial(gl.PytorchOptimizerFactory, deviceType="cpu")
    u_switch = mk(model.u_embeddings, total, d)
    v_switch = mk(model.v_embeddings, total, d)
    u_switch.uniformDistributionInit(-0.5, 0.5)
    v_switch.normalDistributionInit(0.0, 0.3)
    u0, v0 = u_switch.getNumpyVersion().copy(), v_switch.getNumpyVersion().copy()
    u_opt = ok(optimizer, total, d, model, "u_embeddings")
    v_opt = ok(optimizer, total, d, model, "v_embeddings")
    u_opt.optInit()
    v_opt.optInit()
    batches = _w2v_batches(total)
    for center, ctx, neg in batches:
        lcenter = u_switch.beforeForwardPass(center)
        u_opt.beforeForwardPass(center)
        lpos, lneg = v_switch.beforeForwardPass(ctx, neg)
        v_opt.beforeForwardPass(ctx, neg)
        loss = model(lcenter, lpos, lneg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_switch.afterOptimizerStep(center)
        u_opt.afterOptimizerStep(center)
        v_switch.afterOptimizerStep(ctx, neg)
        v_opt.afterOptimizerStep(ctx, neg)
    ref, ropt = _w2v_reference(cls, kwargs, u0, v0, batches)
    np.testing.assert_allclose(
        u_switch.getNumpyVersion(), ref.u_embeddings.weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        v_switch.getNumpyVersion(), ref.v_embeddings.weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )
    for sw, prm in ((u_opt, ref.u_embeddings.weight), (v_opt, ref.v_embeddings.weight)):
        got = sw.getNumpyVersion()
        assert isinstance(got, dict) and got
        for k, v in got.items():
            np.testing.assert_allclose(
                v, ropt.state[prm][k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k
            )


def test_switchers_optimizer_switcher_first_order_same_result():
    """README: 'The two switchers of a variable may be called in either order within a step.'"""

    def run(opt_first: bool):
        torch.manual_seed(3)
        model = SkipGram(40, 4)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        sws = {}
        for name in ("u_embeddings", "v_embeddings"):
            s = gl.ModelFactory(getattr(model, name), 10, 4, placement="cpu")
            s.uniformDistributionInit(-0.5, 0.5)
            o = gl.OptimizerFactory(optimizer, 10, 4, model, name, placement="cpu")
            o.optInit()
            sws[name] = (s, o)
        for c, p, n in _w2v_batches(10, seed=9):
            (us, uo), (vs, vo) = sws["u_embeddings"], sws["v_embeddings"]
            if opt_first:
                uo.beforeForwardPass(c)
                vo.beforeForwardPass(p, n)
            lc = us.beforeForwardPass(c)
            lp, ln = vs.beforeForwardPass(p, n)
            if not opt_first:
                uo.beforeForwardPass(c)
                vo.beforeForwardPass(p, n)
            optimizer.zero_grad()
            model(lc, lp, ln).backward()
            optimizer.step()
            if opt_first:
                uo.afterOptimizerStep(c)
                vo.afterOptimizerStep(p, n)
            us.afterOptimizerStep(c)
            vs.afterOptimizerStep(p, n)
            if not opt_first:
                uo.afterOptimizerStep(c)
                vo.afterOptimizerStep(p, n)
        return [sws[k][0].getNumpyVersion() for k in sws] + [
            a for k in sws for a in sws[k][1].getNumpyVersion().values()
        ]

    for a, b in zip(run(False), run(True), strict=True):
        assert np.array_equal(a, b)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU fallback of pinned placements: a machine without CUDA",
)
def test_cpupinn_true_falls_back_to_cpu_with_one_warning():
    model = SkipGram(8, 4)
    with pytest.warns(gl.FallbackWarning):
        sw = gl.ModelFactory(model.u_embeddings, 20, 4, CPUPinn=True)
    assert sw.placement == "cpu"
    assert sw.getNumpyVersion().shape == (20, 4)


@pytest.mark.parametrize(
    ("dt", "want"),
    [
        ("float64", torch.float64),
        (torch.float64, torch.float64),
        ("float16", torch.float16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_model_factory_datatype_string_or_torch_dtype(dt, want):
    model = SkipGram(8, 4)
    sw = gl.PytorchModelFactory(model.u_embeddings, 20, 4, datatype=dt, deviceType="cpu")
    sw.normalDistributionInit(0.0, 1.0)
    local = sw.beforeForwardPass(torch.tensor([3, 3, 19]))
    assert local.tolist() == [0, 0, 1]
    # README: a datatype other than the variable's makes the variable that dtype while paged
    assert model.u_embeddings.weight.dtype == want
    full = sw.table.getNumpyVersion() if want is not torch.bfloat16 else None
    if full is not None:
        assert full.dtype == np.dtype(str(want).split(".")[1])
        assert np.array_equal(model.u_embeddings.weight[:2].detach().numpy(), full[[3, 19]])


@pytest.mark.parametrize("dt", ["float64", torch.float64])
def test_optimizer_factory_dtype_string_or_torch_dtype(dt):
    model = SkipGram(16, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    sw = gl.ModelFactory(model.u_embeddings, 20, 4, datatype=dt, placement="cpu")
    o = gl.OptimizerFactory(optimizer, 20, 4, model, "u_embeddings", dtype=dt, placement="cpu")
    o.optInit()
    for k, v in o.getNumpyVersion().items():
        assert v.dtype == np.float64, k
        assert v.shape == (20, 4)
    c = torch.tensor([1, 1, 5])
    lc = sw.beforeForwardPass(c)
    o.beforeForwardPass(c)
    model.u_embeddings(lc).sum().backward()
    optimizer.step()
    sw.afterOptimizerStep(c)
    o.afterOptimizerStep(c)
    st = o.getNumpyVersion()
    # Adam's first step: exp_avg = 0.1 * grad; grad of row 1 is 2 (two lookups), row 5 is 1
    np.testing.assert_allclose(st["exp_avg"][1], 0.2, rtol=1e-6)
    np.testing.assert_allclose(st["exp_avg"][5], 0.1, rtol=1e-6)
    assert np.all(st["exp_avg"][[0, 2, 3, 4, 6]] == 0)


def test_deviceType_forms_and_bad_values():
    m = torch.nn.Embedding(5, 4)
    assert gl.PytorchModelFactory(m, 20, 4, deviceType=torch.device("cpu")).placement == "cpu"
    assert (
        gl.PytorchOptimizerFactory(
            torch.optim.Adam(m.parameters()),
            20,
            4,
            torch.nn.ModuleDict({"e": m}),
            "e",
            deviceType="cpu",
        ).optimizer_name
        == "Adam"
    )
    with pytest.raises(gl.GadgetValueError, match="deviceType"):
        gl.PytorchModelFactory(torch.nn.Embedding(5, 4), 20, 4, deviceType="tpu")
    with pytest.raises(gl.GadgetTypeError, match="deviceType"):
        gl.PytorchModelFactory(torch.nn.Embedding(5, 4), 20, 4, deviceType=0)


def test_variable_transformer_speedtorch_dummies():
    sw = gl.PytorchModelFactory(torch.nn.Embedding(12, 4), 20, 4, deviceType="cpu")
    pos = sw.variableTransformer(2, 3)
    assert isinstance(pos, np.ndarray) and pos.dtype == np.int64
    assert pos.tolist() == [[0, 1, 2], [3, 4, 5]]
    pos, neg = sw.variableTransformer(2, 1, 3)
    assert pos.tolist() == [[0], [1]]
    assert neg.tolist() == [[2, 3, 4], [5, 6, 7]]
    assert sw.duplicates == "separate"
    with pytest.raises(gl.GadgetValueError):
        sw.variableTransformer(0, 3)


def test_variable_transformer_separate_last_copy_wins():
    """SpeedTorch layout: each copy of a repeated id is stepped on its own, last write wins."""
    emb = torch.nn.Embedding(6, 2)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    sw = gl.PytorchModelFactory(emb, 10, 2, deviceType="cpu")
    sw.zerosInit()
    dummy = torch.from_numpy(sw.variableTransformer(1, 3))
    ids = torch.tensor([[4, 4, 7]])
    sw.beforeForwardPass(ids)
    (emb(dummy) * torch.tensor([[[1.0], [2.0], [3.0]]])).sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    w = sw.getNumpyVersion()
    assert np.array_equal(w[4], [-2.0, -2.0])  # the second copy's update, not -3
    assert np.array_equal(w[7], [-3.0, -3.0])


def test_model_switch_save_load_roundtrips(tmp_path):
    os.chdir(tmp_path)
    sw = gl.PytorchModelFactory(torch.nn.Embedding(5, 4), 20, 4, deviceType="cpu")
    sw.customInit(torch.nn.init.xavier_uniform_)
    a = sw.getNumpyVersion().copy()
    bound = float(np.sqrt(6.0 / (20 + 4)))
    assert np.abs(a).max() <= bound and np.abs(a).max() > bound / 2
    sw.saveCupy("emb")
    assert (tmp_path / "emb.npy").exists()
    assert np.array_equal(np.load(tmp_path / "emb.npy"), a)
    sw.saveTorch(tmp_path / "t.pt")
    t = torch.load(tmp_path / "t.pt", weights_only=True)
    assert t.shape == (20, 4) and t.dtype == torch.float32
    sw.zerosInit()
    assert not sw.getNumpyVersion().any()
    sw.loadCupy("emb.npy")
    assert np.array_equal(sw.getNumpyVersion(), a)
    sw.zerosInit()
    torch.save(torch.from_numpy(a).double(), tmp_path / "d.pt")  # float64 of float32 values
    sw.loadTorch(tmp_path / "d.pt")
    assert np.array_equal(sw.getNumpyVersion(), a)


@pytest.mark.parametrize(
    ("obj", "exc"),
    [
        (torch.zeros(19, 4), gl.GadgetValueError),
        (torch.zeros(20, 4, dtype=torch.float64) + 1e-300, gl.GadgetTypeError),
        (torch.zeros(20, 4, dtype=torch.int64), gl.GadgetTypeError),
    ],
)
def test_model_switch_loadtorch_refuses_and_keeps_table(tmp_path, obj, exc):
    sw = gl.PytorchModelFactory(torch.nn.Embedding(5, 4), 20, 4, deviceType="cpu")
    a = sw.getNumpyVersion().copy()
    torch.save(obj, tmp_path / "bad.pt")
    with pytest.raises(exc, match="bad.pt"):
        sw.loadTorch(tmp_path / "bad.pt")
    assert np.array_equal(sw.getNumpyVersion(), a)


def _trained_opt_switch(cls=torch.optim.Adam, **kw):
    model = SkipGram(16, 4)
    optimizer = cls(model.parameters(), **kw)
    sw = gl.PytorchModelFactory(model.u_embeddings, 20, 4, deviceType="cpu")
    o = gl.PytorchOptimizerFactory(optimizer, 20, 4, model, "u_embeddings", deviceType="cpu")
    o.optInit()
    c = torch.tensor([1, 1, 5, 19])
    lc = sw.beforeForwardPass(c)
    o.beforeForwardPass(c)
    (model.u_embeddings(lc) * torch.arange(1.0, 5.0)).sum().backward()
    optimizer.step()
    sw.afterOptimizerStep(c)
    o.afterOptimizerStep(c)
    return model, optimizer, sw, o


def test_optimizer_switch_savetorch_loadtorch_dict_and_list(tmp_path):
    _, _, _, o = _trained_opt_switch()
    st = o.getNumpyVersion()
    assert set(st) == {"exp_avg", "exp_avg_sq"} and all(v.shape == (20, 4) for v in st.values())
    assert st["exp_avg"][1].any() and not st["exp_avg"][2].any()
    o.saveTorch(tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    assert isinstance(saved, dict) and set(saved) == set(st)
    o.customInit(torch.nn.init.constant_, 0.5)
    assert all(np.all(v == 0.5) for v in o.getNumpyVersion().values())
    o.loadTorch(tmp_path / "s.pt")
    for k, v in o.getNumpyVersion().items():
        assert np.array_equal(v, st[k])
    # SpeedTorch's layout: a list of tensors in state order
    torch.save([saved[k] * 2 for k in o.tables], tmp_path / "l.pt")
    o.loadTorch(tmp_path / "l.pt")
    for k, v in o.getNumpyVersion().items():
        assert np.array_equal(v, st[k] * 2)


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: {"exp_avg": s["exp_avg"]},
        lambda s: {**s, "extra": s["exp_avg"]},
        lambda s: {"exp_avg": s["exp_avg"][:5], "exp_avg_sq": s["exp_avg_sq"]},
        lambda s: [s["exp_avg"]],
        lambda s: {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"].double() + 1e-300},
    ],
)
def test_optimizer_switch_loadtorch_refused_changes_nothing(tmp_path, bad):
    _, _, _, o = _trained_opt_switch()
    st = o.getNumpyVersion()
    good = {k: torch.from_numpy(v.copy()) for k, v in st.items()}
    torch.save(bad(good), tmp_path / "bad.pt")
    with pytest.raises((gl.GadgetValueError, gl.GadgetTypeError)):
        o.loadTorch(tmp_path / "bad.pt")
    for k, v in o.getNumpyVersion().items():
        assert np.array_equal(v, st[k])


def test_optimizer_switch_before_optinit_clear_error():
    model = SkipGram(16, 4)
    o = gl.OptimizerFactory(
        torch.optim.Adam(model.parameters()), 20, 4, model, "u_embeddings", placement="cpu"
    )
    with pytest.raises(gl.GadgetValueError, match="optInit"):
        o.getNumpyVersion()


# -------------------------------------------------------- unsupported optimizers
class _NotTorchOpt(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        pass


@pytest.mark.parametrize(
    "cls",
    [torch.optim.LBFGS, *_ADAFACTOR, _NotTorchOpt],
    ids=["LBFGS", *(["Adafactor"] if _ADAFACTOR else []), "custom"],
)
def test_unsupported_optimizer_dropin_names_supported(cls):
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.OffloadedOptimizer(cls, emb, lr=0.1)
    msg = str(ei.value)
    assert cls.__name__ in msg
    for name in (
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
    ):
        assert name in msg
    # the table can still be taken by a supported optimizer (nothing was attached)
    gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)


@pytest.mark.parametrize(
    "cls",
    [torch.optim.LBFGS, *_ADAFACTOR],
    ids=["LBFGS", *(["Adafactor"] if _ADAFACTOR else [])],
)
def test_unsupported_optimizer_factory_names_supported(cls):
    model = SkipGram(8, 4)
    opt = cls(model.parameters(), lr=0.1)
    with pytest.raises(gl.GadgetTypeError, match="Rprop") as ei:
        gl.OptimizerFactory(opt, 20, 4, model, "u_embeddings", placement="cpu")
    assert cls.__name__ in str(ei.value)


def test_supported_optimizers_constant_matches_readme():
    assert set(gl.SUPPORTED_OPTIMIZERS) == {
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
        "NAdam",
        "RAdam",
    }


def test_differentiable_refused():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    w0 = emb.weight.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetTypeError, match="differentiable"):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1, differentiable=True)
    gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)  # the table was not taken
    assert np.array_equal(emb.weight.getNumpyVersion(), w0)


def test_optimizer_instance_refused():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="class"):
        gl.OffloadedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), emb)


def test_weight_passed_instead_of_module_refused():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, [emb.weight], lr=0.1)


def test_model_parameters_of_tables_only_says_so():
    model = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")})
    with pytest.raises(gl.GadgetValueError, match="parameters"):
        gl.OffloadedOptimizer(torch.optim.Adam, model.parameters(), lr=0.1)


# ------------------------------------------------------------------ checkpoints
def _make_dropin(cls=torch.optim.AdamW, **kw):
    torch.manual_seed(11)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    bag = gl.OffloadedEmbeddingBag(N + 3, D, mode="mean", placement="cpu", device="cpu")
    head = torch.nn.Linear(D, 1)
    model = torch.nn.ModuleDict({"item": emb, "user": bag, "head": head})
    opt = gl.OffloadedOptimizer(
        cls, model, **(kw or dict(lr=0.05, weight_decay=0.01, amsgrad=True))
    )
    return model, opt


def _dropin_steps(model, opt, seed, steps=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        items = torch.randint(0, N, (6,), generator=g)
        hist = torch.randint(0, N + 3, (6, 2), generator=g)
        y = torch.randn(6, generator=g)
        pred = model["head"](model["item"](items) * model["user"](hist)).squeeze(-1)
        opt.zero_grad()
        F.mse_loss(pred, y).backward()
        opt.step()


def _snapshot(model, opt):
    out = [
        model["item"].weight.getNumpyVersion().copy(),
        model["user"].weight.getNumpyVersion().copy(),
    ]
    out += [p.detach().numpy().copy() for p in model["head"].parameters()]
    for i in range(len(opt.pagers)):
        out += [v.copy() for v in _state_tables(opt, i).values()]
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and np.array_equal(x, y)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.01, amsgrad=True)),
        (torch.optim.Rprop, dict(lr=0.01)),
        (torch.optim.ASGD, dict(lr=0.05, t0=1)),
        (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    ],
    ids=["AdamW", "Rprop", "ASGD", "SGD"],
)
def test_checkpoint_resume_bit_identical(tmp_path, fmt, cls, kw):
    model, opt = _make_dropin(cls, **kw)
    _dropin_steps(model, opt, seed=1)
    gl.save_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": opt}, format=fmt)
    _dropin_steps(model, opt, seed=2)
    want = _snapshot(model, opt)
    # a fresh, differently initialised model resumes
    torch.manual_seed(99)
    model2, opt2 = _make_dropin(cls, **kw)
    with torch.no_grad():
        model2["head"].weight.add_(1.0)
    gl.load_checkpoint(tmp_path / "ckpt", {"model": model2, "optimizer": opt2})
    _dropin_steps(model2, opt2, seed=2)
    _assert_same(_snapshot(model2, opt2), want)
    assert opt2.state_dict()["inner"]["state"].keys() == opt.state_dict()["inner"]["state"].keys()


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (torch.optim.Adam, dict(lr=0.05)),
        (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
        (torch.optim.Adagrad, dict(lr=0.1)),
        (torch.optim.Adadelta, dict(lr=1.0)),
    ],
    ids=["Adam", "RMSprop", "Adagrad", "Adadelta"],
)
def test_state_dict_resume_bit_identical(cls, kw):
    model, opt = _make_dropin(cls, **kw)
    _dropin_steps(model, opt, seed=1)
    msd = copy.deepcopy(model.state_dict())
    osd = copy.deepcopy(opt.state_dict())
    _dropin_steps(model, opt, seed=2)
    want = _snapshot(model, opt)
    model2, opt2 = _make_dropin(cls, **kw)
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    _dropin_steps(model2, opt2, seed=2)
    _assert_same(_snapshot(model2, opt2), want)


def test_state_dict_via_torch_save_roundtrip(tmp_path):
    model, opt = _make_dropin()
    _dropin_steps(model, opt, seed=1)
    torch.save({"m": model.state_dict(), "o": opt.state_dict()}, tmp_path / "sd.pt")
    _dropin_steps(model, opt, seed=2)
    want = _snapshot(model, opt)
    model2, opt2 = _make_dropin()
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    model2.load_state_dict(sd["m"])
    opt2.load_state_dict(sd["o"])
    _dropin_steps(model2, opt2, seed=2)
    _assert_same(_snapshot(model2, opt2), want)


def test_load_state_dict_of_other_optimizer_class_refused_unchanged():
    model, opt = _make_dropin(torch.optim.Adam, lr=0.05)
    _dropin_steps(model, opt, seed=1)
    sd = opt.state_dict()
    model2, opt2 = _make_dropin(torch.optim.NAdam, lr=0.05)
    _dropin_steps(model2, opt2, seed=3)
    before = _snapshot(model2, opt2)
    before_sd = copy.deepcopy(opt2.state_dict()["inner"])
    with pytest.raises(gl.GadgetValueError, match="Adam"):
        opt2.load_state_dict(sd)
    _assert_same(_snapshot(model2, opt2), before)
    assert opt2.state_dict()["inner"]["param_groups"] == before_sd["param_groups"]


def test_load_checkpoint_wrong_shape_changes_nothing(tmp_path):
    model, opt = _make_dropin()
    _dropin_steps(model, opt, seed=1)
    gl.save_checkpoint(tmp_path / "c", {"model": model, "optimizer": opt})
    torch.manual_seed(5)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    bag = gl.OffloadedEmbeddingBag(
        N + 4, D, mode="mean", placement="cpu", device="cpu"
    )  # other shape
    model2 = torch.nn.ModuleDict({"item": emb, "user": bag, "head": torch.nn.Linear(D, 1)})
    opt2 = gl.OffloadedOptimizer(
        torch.optim.AdamW, model2, lr=0.05, weight_decay=0.01, amsgrad=True
    )
    before = _snapshot(model2, opt2)
    with pytest.raises((gl.GadgetValueError, gl.GadgetKeyError)):
        gl.load_checkpoint(tmp_path / "c", {"model": model2, "optimizer": opt2})
    _assert_same(_snapshot(model2, opt2), before)


def test_checkpoint_missing_dir_clear_error(tmp_path):
    model, opt = _make_dropin()
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "nope", {"model": model, "optimizer": opt})


def test_checkpoint_bad_format_key_error(tmp_path):
    model, opt = _make_dropin()
    with pytest.raises(gl.GadgetKeyError, match="npy"):
        gl.save_checkpoint(tmp_path / "c", {"model": model}, format="parquet")
    assert not (tmp_path / "c" / "meta.pt").exists()


@pytest.mark.parametrize("name", ["", "a/b", ".", "..", "a\\b", "a\x00b"])
def test_checkpoint_bad_object_names(tmp_path, name):
    model, opt = _make_dropin()
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(tmp_path / "c", {name: model, "optimizer": opt})
    assert not (tmp_path / "c" / "meta.pt").exists()


def test_bfloat16_npy_refused_hdf5_ok(tmp_path):
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", dtype=torch.bfloat16)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    emb(torch.tensor([1, 2])).float().sum().backward()
    opt.step()
    with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
        gl.save_checkpoint(tmp_path / "c", {"e": emb, "o": opt}, format="npy")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
    gl.save_checkpoint(tmp_path / "h", {"e": emb, "o": opt}, format="hdf5")
    emb2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", dtype=torch.bfloat16)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.05)
    gl.load_checkpoint(tmp_path / "h", {"e": emb2, "o": opt2})
    # bfloat16 values come back exactly (getNumpyVersion widens them to float32)
    assert np.array_equal(emb2.weight.getNumpyVersion(), emb.weight.getNumpyVersion())
    for k, v in _state_tables(opt2).items():
        assert np.array_equal(v, _state_tables(opt)[k]), k


# ------------------------------------------------------------- switcher checkpoints
def _switcher_setup(fmt_seed=3, cls=torch.optim.Adam, kw=None):
    kw = kw or dict(lr=0.05)
    torch.manual_seed(fmt_seed)
    model = SkipGram(64, 4)
    optimizer = cls(model.parameters(), **kw)
    us = gl.ModelFactory(model.u_embeddings, 10, 4, placement="cpu")
    vs = gl.ModelFactory(model.v_embeddings, 10, 4, placement="cpu")
    us.uniformDistributionInit(-0.5, 0.5)
    vs.uniformDistributionInit(-0.5, 0.5)
    uo = gl.OptimizerFactory(optimizer, 10, 4, model, "u_embeddings", placement="cpu")
    vo = gl.OptimizerFactory(optimizer, 10, 4, model, "v_embeddings", placement="cpu")
    uo.optInit()
    vo.optInit()
    return dict(model=model, opt=optimizer, us=us, vs=vs, uo=uo, vo=vo)


def _switcher_steps(o, seed):
    for c, p, n in _w2v_batches(10, steps=3, seed=seed):
        lc = o["us"].beforeForwardPass(c)
        o["uo"].beforeForwardPass(c)
        lp, ln = o["vs"].beforeForwardPass(p, n)
        o["vo"].beforeForwardPass(p, n)
        o["opt"].zero_grad()
        o["model"](lc, lp, ln).backward()
        o["opt"].step()
        o["us"].afterOptimizerStep(c)
        o["uo"].afterOptimizerStep(c)
        o["vs"].afterOptimizerStep(p, n)
        o["vo"].afterOptimizerStep(p, n)


def _switcher_snapshot(o):
    out = [o["us"].getNumpyVersion().copy(), o["vs"].getNumpyVersion().copy()]
    for k in ("uo", "vo"):
        out += [v.copy() for v in o[k].getNumpyVersion().values()]
    return out


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_switcher_checkpoint_resume_bit_identical(tmp_path, fmt):
    a = _switcher_setup()
    _switcher_steps(a, seed=1)
    gl.save_checkpoint(tmp_path / "c", a, format=fmt)
    _switcher_steps(a, seed=2)
    want = _switcher_snapshot(a)
    b = _switcher_setup(fmt_seed=8)
    gl.load_checkpoint(tmp_path / "c", b)
    _switcher_steps(b, seed=2)
    _assert_same(_switcher_snapshot(b), want)


def test_switcher_checkpoint_model_without_switchers_refused(tmp_path):
    a = _switcher_setup()
    _switcher_steps(a, seed=1)
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(tmp_path / "c", {"model": a["model"], "opt": a["opt"]})
    assert not (tmp_path / "c" / "meta.pt").exists()


def test_switcher_checkpoint_refused_mid_step(tmp_path):
    a = _switcher_setup()
    c = torch.tensor([1, 2])
    a["us"].beforeForwardPass(c)
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(tmp_path / "c", a)
    assert not (tmp_path / "c" / "meta.pt").exists()


def test_switcher_init_refused_mid_step_changes_nothing():
    a = _switcher_setup()
    c = torch.tensor([1, 2])
    a["us"].beforeForwardPass(c)
    before = a["us"].getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError):
        a["us"].zerosInit()
    assert np.array_equal(a["us"].getNumpyVersion(), before)


def test_after_step_other_ids_refused():
    a = _switcher_setup()
    c = torch.tensor([1, 2])
    a["us"].beforeForwardPass(c)
    before = a["us"].getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError, match="ids"):
        a["us"].afterOptimizerStep(torch.tensor([3, 4]))
    assert np.array_equal(a["us"].getNumpyVersion(), before)


@pytest.mark.parametrize("bad", [10, -1])
def test_switcher_out_of_range_id(bad):
    a = _switcher_setup()
    before = a["us"].getNumpyVersion().copy()
    with pytest.raises(gl.GadgetIndexError, match=str(bad)):
        a["us"].beforeForwardPass(torch.tensor([1, bad]))
    assert np.array_equal(a["us"].getNumpyVersion(), before)
    assert not a["us"].step_under_way()


# ------------------------------------------------------------------- word2vec CLI
def _w2v(argv, capsys):
    from datasets import word2vec

    try:
        rc = word2vec.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("the king rules the land\nthe queen rules the land\n" * 20)
    return p


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--dim", "0"], "--dim"),
        (["--dim", "x"], "--dim"),
        (["--epochs", "-1"], "--epochs"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "-0.1"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--seed", "-1"], "--seed"),
        (["--negatives", "0"], "--negatives"),
        (["--batch-size", "1.5"], "--batch-size"),
        (["--window", ""], "--window"),
    ],
)
def test_word2vec_bad_numbers_one_line(corpus, capsys, extra, needle):
    rc, out, err = _w2v([str(corpus), "--placement", "cpu", "--no-progress", *extra], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and needle in err and "error" in err
    assert "vocabulary" not in out  # no training


def test_word2vec_missing_corpus(tmp_path, capsys):
    rc, out, err = _w2v([str(tmp_path / "nope.txt"), "--placement", "cpu"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "nope.txt" in err


def test_word2vec_corpus_is_directory(tmp_path, capsys):
    rc, out, err = _w2v([str(tmp_path), "--placement", "cpu"], capsys)
    assert rc != 0 and err.count("\n") == 1 and str(tmp_path) in err


def test_word2vec_out_names_folder(corpus, tmp_path, capsys):
    rc, out, err = _w2v([str(corpus), "--placement", "cpu", "--out", str(tmp_path)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--out" in err and "vocabulary" not in out


def test_word2vec_out_in_missing_folder(corpus, tmp_path, capsys):
    rc, out, err = _w2v(
        [str(corpus), "--placement", "cpu", "--out", str(tmp_path / "no" / "v")], capsys
    )
    assert rc == 2 and err.count("\n") == 1 and "--out" in err and "vocabulary" not in out


def test_word2vec_out_target_npy_is_directory(corpus, tmp_path, capsys):
    (tmp_path / "v.npy").mkdir()
    rc, out, err = _w2v([str(corpus), "--placement", "cpu", "--out", str(tmp_path / "v")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "v.npy" in err and "vocabulary" not in out


@pytest.mark.parametrize("text", ["", "word word word\nword\n", "   \n\n"])
def test_word2vec_fewer_than_two_words(tmp_path, capsys, text):
    p = tmp_path / "c.txt"
    p.write_text(text)
    rc, out, err = _w2v([str(p), "--placement", "cpu", "--no-progress"], capsys)
    assert rc != 0 and err.count("\n") == 1 and "error" in err
    assert "Traceback" not in err and "vocabulary" not in out


def test_word2vec_min_count_leaves_one_word(corpus, capsys):
    rc, out, err = _w2v(
        [str(corpus), "--placement", "cpu", "--no-progress", "--min-count", "80"], capsys
    )
    # only "the" occurs 80 times: fewer than two distinct words
    assert rc != 0 and err.count("\n") == 1 and "vocabulary" not in out


def test_word2vec_runs_show_and_out(corpus, tmp_path, capsys):
    rc, out, err = _w2v(
        [
            str(corpus),
            "--placement",
            "cpu",
            "--device",
            "cpu",
            "--no-progress",
            "--dim",
            "8",
            "--epochs",
            "2",
            "--show",
            "KING, nosuchword",
            "--out",
            str(tmp_path / "vec"),
        ],
        capsys,
    )
    assert rc == 0, err
    assert "vocabulary 5 words" in out
    assert "king:" in out  # lower-cased
    assert "nosuchword: not in the vocabulary" in out
    arr = np.load(tmp_path / "vec.npy")
    vocab = [
        ln.split()[0] for ln in (tmp_path / "vec.vocab.txt").read_text().splitlines() if ln.strip()
    ]
    assert arr.shape == (5, 8) and len(vocab) == 5 and "king" in vocab


def test_word2vec_readme_command_from_repo_root(corpus, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "datasets.word2vec",
            str(corpus),
            "--dim",
            "8",
            "--epochs",
            "1",
            "--out",
            str(tmp_path / "vectors"),
            "--show",
            "king",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "vectors.npy").exists()
    assert "Traceback" not in r.stderr


# ------------------------------------------------- schedulers, clipping, param groups
def _lazy_ref_loop(w0, make_opt, batches, between=None, sched=None, init_state=None):
    """Like lazy_reference, with an optimizer factory, an optional hook between backward
    and step (clipping) and an optional scheduler factory."""
    p = torch.nn.Parameter(torch.tensor(w0).clone())
    opt = make_opt([p])
    sch = sched(opt) if sched else None
    for ids, tgt in batches:
        mask = torch.zeros(p.shape[0], dtype=torch.bool)
        mask[ids.unique()] = True
        before_p = p.detach().clone()
        before_s = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
        opt.zero_grad()
        _loss(F.embedding(ids, p), tgt).backward()
        if between:
            between([p])
        opt.step()
        if sch:
            sch.step()
        with torch.no_grad():
            p[~mask] = before_p[~mask]
            for k in _row_state_keys(opt.state[p], p.shape):
                if k in before_s:
                    opt.state[p][k][~mask] = before_s[k][~mask]
                else:
                    opt.state[p][k][~mask] = (init_state or {}).get(k, 0.0)
    return p.detach().numpy(), opt


def _dropin_loop(make_opt, batches, between=None, sched=None, seed=1):
    torch.manual_seed(seed)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    w0 = emb.weight.getNumpyVersion().copy()
    opt = make_opt(emb)
    sch = sched(opt) if sched else None
    for ids, tgt in batches:
        opt.zero_grad()
        _loss(emb(ids), tgt).backward()
        if between:
            between([q for g in opt.param_groups for q in g["params"]])
        opt.step()
        if sch:
            sch.step()
    return emb, opt, w0


def test_cycliclr_turning_sgd_momentum_on_matches_torch():
    batches = _batches(steps=6)
    mk = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.0)
    sched = functools.partial(
        torch.optim.lr_scheduler.CyclicLR,
        base_lr=0.01,
        max_lr=0.1,
        step_size_up=2,
        base_momentum=0.8,
        max_momentum=0.9,
        cycle_momentum=True,
    )
    emb, opt, w0 = _dropin_loop(
        lambda e: gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.05, momentum=0.0),
        batches,
        sched=sched,
    )
    ref_w, ropt = _lazy_ref_loop(w0, mk, batches, sched=sched)
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)
    rp = ropt.param_groups[0]["params"][0]
    st = _state_tables(opt)
    assert "momentum_buffer" in st
    np.testing.assert_allclose(
        st["momentum_buffer"], ropt.state[rp]["momentum_buffer"].numpy(), rtol=1e-5, atol=1e-6
    )


def test_onecyclelr_adam_matches_torch():
    batches = _batches(steps=6)
    sched = functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1, total_steps=10)
    emb, opt, w0 = _dropin_loop(
        lambda e: gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.05), batches, sched=sched
    )
    ref_w, _ = _lazy_ref_loop(
        w0, functools.partial(torch.optim.Adam, lr=0.05), batches, sched=sched
    )
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [torch.optim.Rprop, torch.optim.ASGD], ids=["Rprop", "ASGD"])
def test_warmup_scheduler_first_step_lr_starts_state(cls):
    """README: before the first step Rprop's step_size and ASGD's eta start from the
    first step's lr (a LambdaLR warm-up set at construction)."""
    batches = _batches(steps=4)
    sched = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda e: 0.1 * (e + 1))
    emb, opt, w0 = _dropin_loop(
        lambda e: gl.OffloadedOptimizer(cls, e, lr=0.1), batches, sched=sched
    )
    ref_w, ropt = _lazy_ref_loop(w0, functools.partial(cls, lr=0.1), batches, sched=sched)
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)
    rp = ropt.param_groups[0]["params"][0]
    for k, v in _state_tables(opt).items():
        np.testing.assert_allclose(v, ropt.state[rp][k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_clip_grad_norm_over_param_groups_matches_dense():
    batches = _batches(steps=4)
    clip = functools.partial(torch.nn.utils.clip_grad_norm_, max_norm=0.5)
    emb, opt, w0 = _dropin_loop(
        lambda e: gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.5), batches, between=clip
    )
    ref_w, _ = _lazy_ref_loop(w0, functools.partial(torch.optim.SGD, lr=0.5), batches, between=clip)
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)


def test_gradscaler_cpu_matches_unscaled_training():
    batches = _batches(steps=3)
    torch.manual_seed(1)
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    w0 = emb.weight.getNumpyVersion().copy()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for ids, tgt in batches:
        opt.zero_grad()
        scaler.scale(_loss(emb(ids), tgt)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], 1.0)
        scaler.step(opt)
        scaler.update()
    ref_w, _ = _lazy_ref_loop(
        w0,
        functools.partial(torch.optim.SGD, lr=0.1),
        batches,
        between=functools.partial(torch.nn.utils.clip_grad_norm_, max_norm=1.0),
    )
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)


def test_gradscaler_inf_skips_step():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    w0 = emb.weight.getNumpyVersion().copy()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    out = emb(torch.tensor([1, 2]))
    scaler.scale((out * torch.tensor(float("inf"))).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert np.array_equal(emb.weight.getNumpyVersion(), w0)
    assert scaler.get_scale() < 1024.0


def test_param_group_dict_gives_table_its_own_lr():
    torch.manual_seed(0)
    a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=torch.nn.init.zeros_)
    b = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=torch.nn.init.zeros_)
    head = torch.nn.Linear(D, 1)
    model = torch.nn.ModuleDict({"a": a, "b": b, "h": head})
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD,
        [{"params": model["a"], "lr": 1.0}, {"params": model["h"].parameters()}, model["b"]],
        lr=0.1,
    )
    (a(torch.tensor([3])).sum() + b(torch.tensor([3])).sum()).backward()
    opt.step()
    assert np.allclose(a.weight.getNumpyVersion()[3], -1.0)
    assert np.allclose(b.weight.getNumpyVersion()[3], -0.1)


def test_two_groups_naming_same_table_refused():
    a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.SGD, [{"params": a, "lr": 1.0}, {"params": a}], lr=0.1)
    gl.OffloadedOptimizer(torch.optim.SGD, a, lr=0.1)  # nothing was taken


def test_add_param_group_table_fresh_state():
    a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    b = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=torch.nn.init.zeros_)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, a, lr=0.1)
    opt.add_param_group({"params": b, "lr": 2.0})
    b(torch.tensor([4, 4])).sum().backward()
    opt.step()
    assert np.allclose(b.weight.getNumpyVersion()[4], -4.0)
    assert np.count_nonzero(b.weight.getNumpyVersion()) == D


def test_set_params_refused():
    a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    with pytest.raises((gl.GadgetTypeError, TypeError)):
        gl.OffloadedOptimizer(torch.optim.SGD, [{"params": {a}}], lr=0.1)


# ----------------------------------------------------------- zero_grad, freeze, dtype
def test_zero_grad_discards_lookups():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    w0 = emb.weight.getNumpyVersion().copy()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.zero_grad()
    opt.step()
    assert np.array_equal(emb.weight.getNumpyVersion(), w0)
    assert not opt.state[emb._slot.param] or float(opt.state[emb._slot.param].get("step", 0)) == 0


def test_embedding_own_zero_grad_discards_lookups():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    w0 = emb.weight.getNumpyVersion().copy()
    emb(torch.tensor([1, 2])).sum().backward()
    emb.zero_grad()
    opt.step()
    assert np.array_equal(emb.weight.getNumpyVersion(), w0)


def test_requires_grad_false_freezes_table():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    head = torch.nn.Linear(D, 1)
    model = torch.nn.ModuleDict({"e": emb, "h": head})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.1)
    emb.requires_grad_(False)
    w0 = emb.weight.getNumpyVersion().copy()
    h0 = head.weight.detach().clone()
    out = model["h"](emb(torch.tensor([1, 2]))).sum()
    out.backward()
    opt.step()
    assert np.array_equal(emb.weight.getNumpyVersion(), w0)
    assert not torch.equal(head.weight, h0)


@pytest.mark.parametrize(("conv", "want"), [("double", torch.float64), ("half", torch.float16)])
def test_module_dtype_conversion_changes_lookups_only(conv, want):
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    w = emb.weight.getNumpyVersion().copy()
    getattr(emb, conv)()
    with torch.no_grad():
        out = emb(torch.tensor([0, 5]))
    assert out.dtype == want
    assert emb.weight.dtype in (torch.float32, "float32", np.float32) or str(
        emb.weight.dtype
    ).endswith("float32")
    torch.testing.assert_close(out, torch.from_numpy(w[[0, 5]]).to(want))


def test_nn_init_on_weight_and_trunc_normal_refused():
    emb = gl.OffloadedEmbedding(200, 8, placement="cpu", device="cpu")
    torch.nn.init.constant_(emb.weight, 0.25)
    assert np.all(emb.weight.getNumpyVersion() == 0.25)
    torch.nn.init.zeros_(emb.weight)
    assert not emb.weight.getNumpyVersion().any()
    torch.nn.init.xavier_uniform_(emb.weight)
    a = emb.weight.getNumpyVersion()
    bound = np.sqrt(6.0 / (200 + 8))
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound
    before = a.copy()
    with pytest.raises(gl.GadgetTypeError):
        torch.nn.init.trunc_normal_(emb.weight, std=0.02)
    assert np.array_equal(emb.weight.getNumpyVersion(), before)
    emb.weight.init_(torch.nn.init.trunc_normal_, std=0.02)
    b = emb.weight.getNumpyVersion()
    assert np.abs(b).max() <= 2.0 and 0.01 < b.std() < 0.03


def test_deepcopy_is_separate_table_without_optimizer():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    twin = copy.deepcopy(emb)
    w0 = twin.weight.getNumpyVersion().copy()
    assert np.array_equal(w0, emb.weight.getNumpyVersion())
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    assert np.array_equal(twin.weight.getNumpyVersion(), w0)
    assert not np.array_equal(emb.weight.getNumpyVersion(), w0)
    gl.OffloadedOptimizer(torch.optim.SGD, twin, lr=0.1)  # the copy can take an optimizer


def test_table_belongs_to_one_optimizer():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    del opt
    import gc

    gc.collect()
    gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)


def test_late_gradient_reported_by_next_step():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    out = emb(torch.tensor([1, 2]))
    opt.step()  # before backward
    w = emb.weight.getNumpyVersion().copy()
    out.sum().backward()
    with pytest.raises(gl.GadgetValueError):
        opt.step()
    assert np.array_equal(emb.weight.getNumpyVersion(), w)


def test_load_state_dict_refused_while_lookup_waits():
    model, opt = _make_dropin()
    _dropin_steps(model, opt, seed=1)
    msd = copy.deepcopy(model.state_dict())
    _dropin_steps(model, opt, seed=2)
    model["item"](torch.tensor([1, 2])).sum().backward()
    before = _snapshot(model, opt)
    # a module's load_state_dict reports as torch's does (RuntimeError listing the errors)
    with pytest.raises(RuntimeError, match="step"):
        model["item"].load_state_dict({"weight": msd["item.weight"]})
    _assert_same(_snapshot(model, opt), before)


# ------------------------------------------------------------------ more wrapper
class _AmsAdam(torch.optim.Adam):
    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, amsgrad=True)


class _KwAdam(torch.optim.Adam):
    def __init__(self, params, **kw):
        super().__init__(params, **kw)


class _MomSGD(torch.optim.SGD):
    def __init__(self, params, lr, **kw):
        super().__init__(params, lr=lr, momentum=0.9, **kw)


@pytest.mark.parametrize(
    ("cls", "kw", "base", "base_kw"),
    [
        (_AmsAdam, dict(lr=0.05), torch.optim.Adam, dict(lr=0.05, amsgrad=True)),
        (_KwAdam, dict(lr=0.05, amsgrad=True), torch.optim.Adam, dict(lr=0.05, amsgrad=True)),
        (
            _MomSGD,
            dict(lr=0.05, nesterov=True),
            torch.optim.SGD,
            dict(lr=0.05, momentum=0.9, nesterov=True),
        ),
    ],
    ids=["sets-amsgrad", "kwargs", "sets-momentum"],
)
def test_optimizer_subclass_pages_its_state(cls, kw, base, base_kw):
    batches = _batches()
    emb, opt, w0 = drop_in_train(cls, kw, batches)
    ref_w, ref_s = lazy_reference(base, base_kw, w0, batches)
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), ref_w, rtol=1e-5, atol=1e-6)
    got = _state_tables(opt)
    assert set(got) == set(
        _row_state_keys({k: torch.from_numpy(v) for k, v in ref_s.items()}, (N, D))
    )
    for k, v in got.items():
        np.testing.assert_allclose(v, ref_s[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_numpy_momentum_adds_table():
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=np.float32(0.1), momentum=np.float32(0.9))
    assert "momentum_buffer" in opt.pagers[0].tables


def test_fused_sgd_dampening_mix_refused_changes_nothing():
    e = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    h = torch.nn.Linear(D, 1)
    o = gl.OffloadedOptimizer(
        torch.optim.SGD,
        torch.nn.ModuleDict({"e": e, "h": h}),
        lr=0.1,
        momentum=0.9,
        dampening=0.5,
        fused=True,
    )
    w0 = e.weight.getNumpyVersion().copy()
    h0 = h.weight.detach().clone()
    h(e(torch.tensor([1]))).sum().backward()
    with pytest.raises(gl.GadgetValueError, match="dampening"):
        o.step()
    assert np.array_equal(e.weight.getNumpyVersion(), w0)
    assert torch.equal(h.weight, h0)


def test_fused_sgd_dampening0_beside_params_matches_torch():
    torch.manual_seed(0)
    e = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    h = torch.nn.Linear(D, 1)
    re_ = torch.nn.Embedding(N, D)
    rh = copy.deepcopy(h)
    with torch.no_grad():
        re_.weight.copy_(torch.from_numpy(e.weight.getNumpyVersion()))
    o = gl.OffloadedOptimizer(
        torch.optim.SGD, torch.nn.ModuleDict({"e": e, "h": h}), lr=0.1, momentum=0.9, fused=True
    )
    ro = torch.optim.SGD([*re_.parameters(), *rh.parameters()], lr=0.1, momentum=0.9, fused=True)
    for _ in range(3):
        ids = torch.arange(N)
        o.zero_grad()
        (h(e(ids)) ** 2).sum().backward()
        o.step()
        ro.zero_grad()
        (rh(re_(ids)) ** 2).sum().backward()
        ro.step()
    np.testing.assert_allclose(
        e.weight.getNumpyVersion(), re_.weight.detach().numpy(), rtol=1e-6, atol=1e-7
    )
    torch.testing.assert_close(h.weight, rh.weight)


def test_optimizer_hooks_run_like_torch():
    from torch.optim.optimizer import (
        register_optimizer_step_pre_hook,
    )

    e = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    o = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    calls = []
    o.register_step_pre_hook(lambda opt, a, k: calls.append("pre"))
    o.register_step_post_hook(lambda opt, a, k: calls.append("post"))
    o.register_state_dict_pre_hook(lambda opt: calls.append("sdpre"))
    o.register_load_state_dict_post_hook(lambda opt: calls.append("lsdpost"))
    h1 = register_optimizer_step_pre_hook(lambda opt, a, k: calls.append(("g", type(opt).__name__)))
    try:
        e(torch.tensor([1])).sum().backward()
        o.step()
    finally:
        h1.remove()
    o.load_state_dict(o.state_dict())
    assert calls.index("pre") < calls.index("post")
    assert ("g", "OffloadedOptimizer") in calls and ("g", "Adam") in calls
    assert "sdpre" in calls and calls[-1] == "lsdpost"


def test_step_with_closure_applies_its_gradient():
    e = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu", init=torch.nn.init.zeros_)
    o = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=1.0)

    def closure():
        o.zero_grad()
        loss = e(torch.tensor([3, 3])).sum()
        loss.backward()
        return loss

    loss = o.step(closure)
    assert float(loss.detach()) == 0.0
    assert np.allclose(e.weight.getNumpyVersion()[3], -2.0)


def test_unused_table_step_count_does_not_move():
    a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    b = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    o = gl.OffloadedOptimizer(torch.optim.Adam, torch.nn.ModuleDict({"a": a, "b": b}), lr=0.1)
    (a(torch.tensor([1])).sum() + b(torch.tensor([1])).sum()).backward()
    o.step()
    bw = b.weight.getNumpyVersion().copy()
    for _ in range(2):
        o.zero_grad(set_to_none=False)
        a(torch.tensor([2])).sum().backward()
        o.step()
    assert float(o.state[a._slot.param]["step"]) == 3.0
    assert float(o.state[b._slot.param]["step"]) == 1.0
    assert np.array_equal(b.weight.getNumpyVersion(), bw)


def test_load_into_pretrained_optimizer_resumes_identically(tmp_path):
    def mk(seed):
        torch.manual_seed(seed)
        a = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
        b = gl.OffloadedEmbeddingBag(N, D, mode="sum", placement="cpu", device="cpu")
        m = torch.nn.ModuleDict({"a": a, "b": b})
        return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1, amsgrad=True)

    def step(m, o, ids, use_b):
        o.zero_grad()
        loss = (m["a"](torch.tensor(ids)) ** 2).sum()
        if use_b:
            loss = loss + (m["b"](torch.tensor([ids])) ** 3).sum()
        loss.backward()
        o.step()

    def snap(m, o):
        r = [m["a"].weight.getNumpyVersion().copy(), m["b"].weight.getNumpyVersion().copy()]
        for p in o.pagers:
            r += [t.getNumpyVersion().copy() for t in p.tables.values()]
        return r

    for how in ("state_dict", "checkpoint"):
        A, oA = mk(0)
        step(A, oA, [1, 2, 2], False)  # table b never stepped before the save
        sd = (copy.deepcopy(A.state_dict()), copy.deepcopy(oA.state_dict()))
        gl.save_checkpoint(tmp_path / how, {"m": A, "o": oA})
        for ids in ([1, 5], [2, 7, 7]):
            step(A, oA, ids, True)
        B, oB = mk(1)
        for ids in ([3, 4], [4, 9, 9], [0, 1]):  # B has trained both tables
            step(B, oB, ids, True)
        if how == "state_dict":
            B.load_state_dict(sd[0])
            oB.load_state_dict(sd[1])
        else:
            gl.load_checkpoint(tmp_path / how, {"m": B, "o": oB})
        for ids in ([1, 5], [2, 7, 7]):
            step(B, oB, ids, True)
        _assert_same(snap(B, oB), snap(A, oA))


# --------------------------------------------------------------- more switchers
def test_switcher_ids_changed_in_place_refused_nothing_written():
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(5, D)})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sw = gl.ModelFactory(model["u"], 10, D, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    so = gl.OptimizerFactory(opt, 10, D, model, "u", placement="cpu")
    so.optInit()
    ids = torch.tensor([1, 2, 2])
    lc = sw.beforeForwardPass(ids)
    so.beforeForwardPass(ids)
    model["u"](lc).sum().backward()
    opt.step()
    w0 = sw.getNumpyVersion().copy()
    s0 = so.getNumpyVersion()
    ids[0] = 7  # the id buffer refilled in place
    with pytest.raises(gl.GadgetValueError, match="ids"):
        sw.afterOptimizerStep(ids)
    with pytest.raises(gl.GadgetValueError, match="ids"):
        so.afterOptimizerStep(ids)
    assert np.array_equal(sw.getNumpyVersion(), w0)
    for k, v in so.getNumpyVersion().items():
        assert np.array_equal(v, s0[k])


def test_switchers_sparseadam_match_torch_sparse():
    total = 10
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(16, D, sparse=True)})
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    sw = gl.ModelFactory(model["u"], total, D, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    so = gl.OptimizerFactory(opt, total, D, model, "u", placement="cpu")
    so.optInit()
    ref = torch.nn.Embedding(total, D, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(sw.getNumpyVersion()))
    ro = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, total, (6,), generator=g)
        t = torch.randn(6, D, generator=g)
        lc = sw.beforeForwardPass(ids)
        so.beforeForwardPass(ids)
        opt.zero_grad()
        ((model["u"](lc) - t) ** 2).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        so.afterOptimizerStep(ids)
        ro.zero_grad()
        ((ref(ids) - t) ** 2).sum().backward()
        ro.step()
    np.testing.assert_allclose(
        sw.getNumpyVersion(), ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7
    )


def test_switcher_variable_in_own_param_group():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.u = torch.nn.Embedding(8, D)
            self.v = torch.nn.Embedding(8, D)

    m = M()
    opt = torch.optim.SGD(
        [{"params": m.u.parameters(), "lr": 1.0}, {"params": m.v.parameters()}],
        lr=0.1,
        momentum=0.9,
    )
    sw = gl.ModelFactory(m.u, 10, D, placement="cpu")
    sw.zerosInit()
    so = gl.OptimizerFactory(opt, 10, D, m, "u", placement="cpu")
    so.optInit()
    for _ in range(2):
        ids = torch.tensor([3])
        lc = sw.beforeForwardPass(ids)
        so.beforeForwardPass(ids)
        opt.zero_grad()
        m.u(lc).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        so.afterOptimizerStep(ids)
    np.testing.assert_allclose(sw.getNumpyVersion()[3], -2.9, rtol=1e-6)
    np.testing.assert_allclose(so.getNumpyVersion()["momentum_buffer"][3], 1.9, rtol=1e-6)
    assert np.count_nonzero(sw.getNumpyVersion()) == D


def test_switcher_padding_idx_matches_full_table():
    total = 10
    emb = torch.nn.Embedding(8, D, padding_idx=2)
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    sw = gl.PytorchModelFactory(emb, total, D, deviceType="cpu")
    sw.uniformDistributionInit(-1, 1)
    so = gl.PytorchOptimizerFactory(
        opt, total, D, torch.nn.ModuleDict({"e": emb}), "e", deviceType="cpu"
    )
    so.optInit()
    w0 = sw.getNumpyVersion().copy()
    ref = torch.nn.Embedding(total, D, padding_idx=2)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w0))
    batches = [
        (torch.arange(total), None),
        (torch.tensor([2, 2, 5, 9]), None),
        (torch.tensor([1, 5, 5]), None),
    ]
    for ids, _ in batches:
        lc = sw.beforeForwardPass(ids)
        so.beforeForwardPass(ids)
        opt.zero_grad()
        (emb(lc) ** 2).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        so.afterOptimizerStep(ids)
    ro = torch.optim.Adam(ref.parameters(), lr=0.1)
    for ids, _ in batches:
        mask = torch.zeros(total, dtype=torch.bool)
        mask[ids.unique()] = True
        bp = ref.weight.detach().clone()
        bs = {k: v.clone() for k, v in ro.state[ref.weight].items()}
        ro.zero_grad()
        (ref(ids) ** 2).sum().backward()
        ro.step()
        with torch.no_grad():
            ref.weight[~mask] = bp[~mask]
            for k in ("exp_avg", "exp_avg_sq"):
                if k in bs:
                    ro.state[ref.weight][k][~mask] = bs[k][~mask]
    np.testing.assert_allclose(
        sw.getNumpyVersion(), ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7
    )
    assert np.array_equal(sw.getNumpyVersion()[2], w0[2])


def test_bag_2d_input_without_columns_clear_error_or_zeros():
    """A 2-D input of shape (B, 0): empty bags. Either the result torch would give for
    empty bags (zeros) or one of the library's errors -- not a raw RuntimeError."""
    bag = gl.OffloadedEmbeddingBag(N, D, mode="sum", placement="cpu", device="cpu")
    try:
        with torch.no_grad():
            out = bag(torch.zeros(2, 0, dtype=torch.long))
    except gl.GadgetError:
        return
    assert out.shape == (2, D) and not out.any()


def test_grad_accumulation_across_param_group_walks_matches_dense():
    torch.manual_seed(0)
    e = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    w0 = torch.from_numpy(e.weight.getNumpyVersion().copy())
    o = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    a, b, c = torch.tensor([1, 2, 2]), torch.tensor([2, 5]), torch.tensor([5, 7])
    ta, tb, tc = torch.randn(3, D), torch.randn(2, D), torch.randn(2, D)
    params = lambda: [q for g in o.param_groups for q in g["params"]]  # noqa: E731
    ((e(a) - ta) ** 2).sum().backward()
    n1 = torch.nn.utils.clip_grad_norm_(params(), 1e9)
    ((e(b) - tb) ** 2).sum().backward()
    o.prepare_grads()
    ((e(c) - tc) ** 2).sum().backward()
    n2 = torch.nn.utils.clip_grad_norm_(params(), 1e9)
    o.step()
    p = torch.nn.Parameter(w0.clone())
    ro = torch.optim.Adam([p], lr=0.1)
    ((F.embedding(a, p) - ta) ** 2).sum().backward()
    r1 = p.grad.norm().clone()
    ((F.embedding(b, p) - tb) ** 2).sum().backward()
    ((F.embedding(c, p) - tc) ** 2).sum().backward()
    r2 = p.grad.norm()
    ro.step()
    mask = torch.zeros(N, dtype=torch.bool)
    mask[torch.cat([a, b, c]).unique()] = True
    with torch.no_grad():
        p[~mask] = w0[~mask]
    torch.testing.assert_close(n1, r1)
    torch.testing.assert_close(n2, r2)
    np.testing.assert_allclose(e.weight.getNumpyVersion(), p.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU fallback of pinned placements: a machine without CUDA",
)
def test_readme_dropin_example_on_cpu():
    with pytest.warns(gl.FallbackWarning):
        model = torch.nn.ModuleDict(
            {
                "item": gl.OffloadedEmbedding(500, 16, placement="pinned"),
                "user": gl.OffloadedEmbeddingBag(100, 16, mode="mean"),
                "head": torch.nn.Linear(16, 1),
            }
        )
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 500, (8,), generator=g),
            torch.randint(0, 100, (8, 4), generator=g),
            torch.randn(8, generator=g),
        )
        for _ in range(3)
    ]
    w0 = model["item"].weight.getNumpyVersion().copy()
    u0 = model["user"].weight.getNumpyVersion().copy()
    h0 = model["head"].weight.detach().clone()
    for items, history, y in batches:
        pred = model["head"](model["item"](items) * model["user"](history)).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # noqa: E702
    changed = np.flatnonzero((model["item"].weight.getNumpyVersion() != w0).any(1))
    assert changed.tolist() == sorted(torch.cat([b[0] for b in batches]).unique().tolist())
    changed_u = np.flatnonzero((model["user"].weight.getNumpyVersion() != u0).any(1))
    assert changed_u.tolist() == sorted(
        torch.cat([b[1].flatten() for b in batches]).unique().tolist()
    )
    assert not torch.equal(model["head"].weight, h0)


def test_table_changes_refused_while_lookup_pending():
    e = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    o = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    with torch.no_grad():
        e(torch.tensor([1]))
    e.weight.insertData(torch.ones(1, D), torch.tensor([1]))  # eval lookups leave none
    out = e(torch.tensor([1, 2]))
    w0 = e.weight.getNumpyVersion().copy()
    for change in (
        lambda: e.weight.insertData(torch.zeros(1, D), torch.tensor([5])),
        lambda: e.weight.fill_(0.0),
        lambda: torch.nn.init.zeros_(e.weight),
    ):
        with pytest.raises(gl.GadgetValueError, match="step"):
            change()
    assert np.array_equal(e.weight.getNumpyVersion(), w0)
    out.sum().backward()
    o.step()
    e.weight.insertData(torch.zeros(1, D), torch.tensor([5]))
    assert not e.weight.getNumpyVersion()[5].any()


@pytest.mark.parametrize("fn", ["trunc_normal_", "orthogonal_", "eye_", "sparse_"])
def test_initialisers_needing_a_tensor_refused(fn):
    e = gl.OffloadedEmbedding(50, 8, placement="cpu", device="cpu")
    w0 = e.weight.getNumpyVersion().copy()
    args = (0.5,) if fn == "sparse_" else ()
    with pytest.raises(gl.GadgetTypeError):
        getattr(torch.nn.init, fn)(e.weight, *args)
    assert np.array_equal(e.weight.getNumpyVersion(), w0)


@pytest.mark.parametrize(
    "fn",
    [
        "uniform_",
        "normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
    ],
)
def test_initialisers_on_weight_draw_like_torch(fn):
    e = gl.OffloadedEmbedding(50, 8, placement="cpu", device="cpu")
    torch.manual_seed(0)
    getattr(torch.nn.init, fn)(e.weight)
    ref = torch.empty(50, 8)
    torch.manual_seed(0)
    getattr(torch.nn.init, fn)(ref)
    assert np.array_equal(e.weight.getNumpyVersion(), ref.numpy())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [False, True])
def test_bag_2d_input_of_empty_bags_gives_zeros_and_trains_nothing(mode, last, placement, device):
    """(B, 0) input: B empty bags, zeros as torch gives empty bags through offsets; a
    training step after it changes no row (and the table stays usable). Every placement."""
    bag = gl.OffloadedEmbeddingBag(
        N, D, mode=mode, placement=placement, device=device, include_last_offset=last
    )
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=0.5)
    before = bag.weight.getNumpyVersion().copy()
    out = bag(torch.zeros(3, 0, dtype=torch.long, device=device))
    assert out.shape == (3, D) and out.device.type == device.type and not out.any()
    kw = {"per_sample_weights": torch.zeros(3, 0, device=device)} if mode == "sum" else {}
    out2 = bag(torch.zeros(3, 0, dtype=torch.long, device=device), **kw)
    assert out2.shape == (3, D) and not out2.any()
    (out.sum() + out2.sum()).backward()
    opt.step()
    assert np.array_equal(bag.weight.getNumpyVersion(), before)
    ids = torch.tensor([[1, 2]])
    ref = F.embedding_bag(ids, torch.from_numpy(before), mode=mode)
    with torch.no_grad():
        assert torch.equal(bag(ids.to(device)).cpu(), ref)
