"""Black-box review (session 33): the drop-in offloaded embedding modules.

``OffloadedEmbedding`` / ``OffloadedEmbeddingBag`` and ``OffloadedOptimizer`` checked
against ``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` (forward values, gradients,
several training steps against a dense table trained with lazy per-row updates), module
plumbing (state dicts, dtype casts, containers, repr, parameters, modes, no_grad) and error
handling (clear errors, tables unchanged).
"""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


N, D = 12, 4


def _emb(n=N, d=D, **kw):
    kw.setdefault("placement", "cpu")
    kw.setdefault("device", "cpu")
    return gl.OffloadedEmbedding(n, d, **kw)


def _bag(n=N, d=D, mode="mean", **kw):
    kw.setdefault("placement", "cpu")
    kw.setdefault("device", "cpu")
    return gl.OffloadedEmbeddingBag(n, d, mode, **kw)


def _table(m) -> torch.Tensor:
    return m.state_dict()["weight"].detach().clone()


# --------------------------------------------------------------------------------------
# Forward values against torch
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 2, 3), ()])
@pytest.mark.parametrize("idtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_embedding_forward_matches_nn_embedding(shape, idtype):
    emb = _emb()
    W = _table(emb)
    ref = torch.nn.Embedding.from_pretrained(W.clone())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, N, shape, generator=g)
    out = emb(ids.to(idtype))
    exp = ref(ids)
    if ids.dim() == 2:  # non-contiguous ids too
        assert torch.equal(emb(ids.t().to(idtype)), ref(ids.t()))
    assert out.shape == exp.shape
    assert out.dtype == exp.dtype
    assert torch.equal(out, exp)


def test_embedding_forward_empty_ids():
    emb = _emb()
    for shape in [(0,), (3, 0), (0, 2)]:
        ids = torch.zeros(shape, dtype=torch.long)
        out = emb(ids)
        exp = torch.nn.Embedding(N, D)(ids)
        assert out.shape == exp.shape == (*shape, D)
        assert out.dtype == torch.float32


def test_embedding_int32_and_int64_ids_give_same_result_and_gradients():
    tabs = []
    for idtype in (torch.int32, torch.int64):
        torch.manual_seed(3)
        emb = _emb()
        _opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
        ids = torch.tensor([[1, 5, 5], [0, 11, 1]], dtype=idtype)
        (emb(ids) * torch.arange(6.0 * D).reshape(2, 3, D)).sum().backward()
        _opt.step()
        tabs.append(_table(emb))
    assert torch.equal(tabs[0], tabs[1])


def test_embedding_init_callable_and_default_normal():
    emb = _emb(init=functools.partial(torch.nn.init.constant_, val=0.25))
    assert torch.equal(_table(emb), torch.full((N, D), 0.25))
    torch.manual_seed(0)
    big = _emb(2000, 8)
    W = _table(big)
    # default N(0, 1) like nn.Embedding
    assert abs(W.mean().item()) < 0.05
    assert abs(W.std().item() - 1.0) < 0.05


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("idtype", [torch.int64, torch.int32])
def test_bag_offsets_forward_matches_nn_embeddingbag(mode, idtype):
    bag = _bag(mode=mode)
    W = _table(bag)
    ref = torch.nn.EmbeddingBag.from_pretrained(W.clone(), mode=mode)
    ids = torch.tensor([1, 2, 2, 7, 11, 0, 3])
    offsets = torch.tensor([0, 3, 3, 5])  # includes an empty bag
    out = bag(ids.to(idtype), offsets.to(idtype))
    exp = ref(ids, offsets)
    assert out.shape == exp.shape == (4, D)
    torch.testing.assert_close(out, exp, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], torch.zeros(D))  # empty bag: zeros


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_2d_input_matches_nn_embeddingbag(mode):
    bag = _bag(mode=mode)
    W = _table(bag)
    ref = torch.nn.EmbeddingBag.from_pretrained(W.clone(), mode=mode)
    ids = torch.tensor([[1, 2, 2], [7, 11, 0]])
    torch.testing.assert_close(bag(ids), ref(ids), rtol=1e-6, atol=1e-6)
    # 2-D equals the 1-D form with offsets at every row start
    torch.testing.assert_close(bag(ids), bag(ids.reshape(-1), torch.tensor([0, 3])), rtol=0, atol=0)


def test_bag_2d_input_without_columns_gives_zero_bags():
    bag = _bag(mode="mean")
    out = bag(torch.zeros(3, 0, dtype=torch.long))
    assert out.shape == (3, D)
    assert torch.equal(out, torch.zeros(3, D))


def test_bag_empty_input_with_empty_offsets_gives_no_bags():
    bag = _bag(mode="sum")
    out = bag(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, D)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_include_last_offset_matches_nn_embeddingbag(mode):
    bag = _bag(mode=mode, include_last_offset=True)
    W = _table(bag)
    ref = torch.nn.EmbeddingBag.from_pretrained(W.clone(), mode=mode, include_last_offset=True)
    ids = torch.tensor([4, 2, 9, 9, 10, 1])
    offsets = torch.tensor([0, 2, 2, 5, 6])
    out = bag(ids, offsets)
    exp = ref(ids, offsets)
    assert out.shape == exp.shape == (4, D)
    torch.testing.assert_close(out, exp, rtol=1e-6, atol=1e-6)


def test_bag_2d_input_ignores_include_last_offset():
    bag = _bag(mode="sum", include_last_offset=True)
    W = _table(bag)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    out = bag(ids)
    assert out.shape == (3, D)  # one bag per row
    torch.testing.assert_close(out, W[ids].sum(1), rtol=1e-6, atol=1e-6)


def test_bag_per_sample_weights_matches_nn_embeddingbag():
    bag = _bag(mode="sum")
    W = _table(bag)
    ref = torch.nn.EmbeddingBag.from_pretrained(W.clone(), mode="sum")
    ids = torch.tensor([1, 2, 2, 7, 11, 0])
    offsets = torch.tensor([0, 2, 4])
    psw = torch.tensor([0.5, -1.0, 2.0, 3.0, 0.25, 1.5])
    torch.testing.assert_close(
        bag(ids, offsets, per_sample_weights=psw),
        ref(ids, offsets, per_sample_weights=psw),
        rtol=1e-6,
        atol=1e-6,
    )
    ids2 = ids.reshape(2, 3)
    torch.testing.assert_close(
        bag(ids2, per_sample_weights=psw.reshape(2, 3)),
        ref(ids2, per_sample_weights=psw.reshape(2, 3)),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_bag_per_sample_weights_refused_outside_sum(mode):
    bag = _bag(mode=mode)
    W = _table(bag)
    with pytest.raises(gl.GadgetError, match="sum"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2))
    assert torch.equal(_table(bag), W)


# --------------------------------------------------------------------------------------
# Training against references
# --------------------------------------------------------------------------------------


def _make_steps(seed, n_steps=4, n=N):
    """Each step: a list of lookups (ids, coefficient tensor)."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(n_steps):
        lookups = []
        for shape in [(3, 2), (5,)][: 1 + (s % 2)]:
            ids = torch.randint(0, n // 2 + 2 * s, shape, generator=g)  # new rows appear later
            ids = ids.clamp_max(n - 1)
            coef = torch.randn(*shape, D, generator=g, dtype=torch.float64)
            lookups.append((ids, coef))
        steps.append(lookups)
    return steps


def _loss(outs, coefs):
    total = 0
    for o, c in zip(outs, coefs, strict=False):
        total = total + ((o * c.to(o.dtype)).sum(-1) ** 2).mean() + (o * c.to(o.dtype)).sum()
    return total


def _lazy_reference(W0, opt_cls, kw, steps, fill=None):
    """A dense table trained with lazy per-row updates: each step's distinct rows (sorted)
    become one torch parameter; per-row state kept in full tables, one scalar state
    (the step count) per table, as torch's SparseAdam does."""
    fill = fill or {}
    W = W0.clone()
    rows: dict = {}
    scalars: dict = {}
    for lookups in steps:
        allids = torch.cat([i.reshape(-1) for i, _ in lookups])
        U = torch.unique(allids)
        P = torch.nn.Parameter(W[U].clone())
        o = opt_cls([P], **kw)
        if rows or scalars:
            st = {k: v[U].clone() for k, v in rows.items()}
            st.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
            o.state[P] = st
        outs = [F.embedding(torch.searchsorted(U, i), P) for i, _ in lookups]
        _loss(outs, [c for _, c in lookups]).backward()
        o.step()
        for k, v in o.state[P].items():
            if torch.is_tensor(v) and v.shape == P.shape:
                if k not in rows:
                    rows[k] = torch.full_like(W, fill.get(k, 0.0))
                rows[k][U] = v
            else:
                scalars[k] = v
        with torch.no_grad():
            W[U] = P.detach()
    return W, rows, scalars


def _offloaded_train(emb, opt_cls, kw, steps):
    opt = gl.OffloadedOptimizer(opt_cls, emb, **kw)
    for lookups in steps:
        opt.zero_grad()
        outs = [emb(i) for i, _ in lookups]
        _loss(outs, [c for _, c in lookups]).backward()
        opt.step()
    return opt


OPTIMIZERS = [
    pytest.param(torch.optim.SGD, dict(lr=0.1), {}, id="sgd"),
    pytest.param(
        torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), {}, id="sgd-nesterov"
    ),
    pytest.param(
        torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01), {}, id="sgd-mom-wd"
    ),
    pytest.param(torch.optim.Adam, dict(lr=0.01), {}, id="adam"),
    pytest.param(
        torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True), {}, id="adamw-ams"
    ),
    pytest.param(torch.optim.Adamax, dict(lr=0.02), {}, id="adamax"),
    pytest.param(torch.optim.Adadelta, dict(lr=0.5), {}, id="adadelta"),
    pytest.param(torch.optim.Adagrad, dict(lr=0.1), {}, id="adagrad"),
    pytest.param(torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True), {}, id="rmsprop"),
    pytest.param(torch.optim.NAdam, dict(lr=0.01), {}, id="nadam"),
    pytest.param(torch.optim.RAdam, dict(lr=0.01), {}, id="radam"),
    pytest.param(torch.optim.ASGD, dict(lr=0.01), {}, id="asgd"),
    pytest.param(torch.optim.Rprop, dict(lr=0.01), {"step_size": 0.01}, id="rprop"),
    pytest.param(
        torch.optim.Adam, dict(lr=0.01, maximize=True, weight_decay=0.01), {}, id="adam-max-wd"
    ),
    pytest.param(torch.optim.Adam, dict(lr=0.01, foreach=False), {}, id="adam-forloop"),
    pytest.param(
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.1),
        {"sum": 0.1},
        id="adagrad-opts",
    ),
    pytest.param(torch.optim.RMSprop, dict(lr=0.01), {}, id="rmsprop-plain"),
    pytest.param(torch.optim.ASGD, dict(lr=0.01, t0=1.0), {}, id="asgd-avg"),
    pytest.param(torch.optim.Adamax, dict(lr=0.02, weight_decay=0.05), {}, id="adamax-wd"),
]


@pytest.mark.parametrize("opt_cls,kw,fill", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_bit_identical_to_lazy_dense_reference(opt_cls, kw, fill, dtype):
    torch.manual_seed(11)
    emb = _emb(dtype=dtype)
    W0 = _table(emb)
    assert W0.dtype == dtype
    steps = _make_steps(5)
    opt = _offloaded_train(emb, opt_cls, kw, steps)
    W_ref, rows, scalars = _lazy_reference(W0, opt_cls, kw, steps, fill)
    W = _table(emb)
    assert W.dtype == dtype
    assert not torch.equal(W, W0)
    assert torch.equal(W, W_ref), (W - W_ref).abs().max()
    # untouched rows keep their values exactly
    used = torch.unique(torch.cat([i.reshape(-1) for st in steps for i, _ in st]))
    unused = torch.ones(N, dtype=torch.bool)
    unused[used] = False
    assert unused.any()
    assert torch.equal(W[unused], W0[unused])
    # the paged state matches the reference's per-row state
    sd = opt.state_dict()
    (tables,) = sd["tables"]
    assert set(tables) == set(rows)
    for k, v in rows.items():
        assert torch.equal(tables[k].to(v.dtype), v), k
    if "step" in scalars:
        (inner_state,) = sd["inner"]["state"].values()
        assert float(inner_state["step"]) == float(scalars["step"]) == len(steps)


def test_plain_sgd_whole_table_matches_dense_nn_embedding():
    torch.manual_seed(2)
    emb = _emb()
    ref = torch.nn.Embedding.from_pretrained(_table(emb), freeze=False)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.3)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for lookups in _make_steps(8, n_steps=5):
        opt.zero_grad()
        ropt.zero_grad()
        _loss([emb(i) for i, _ in lookups], [c for _, c in lookups]).backward()
        _loss([ref(i) for i, _ in lookups], [c for _, c in lookups]).backward()
        opt.step()
        ropt.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_sparse_adam_matches_sparse_nn_embedding():
    torch.manual_seed(4)
    emb = _emb()
    ref = torch.nn.Embedding.from_pretrained(_table(emb), freeze=False, sparse=True)
    opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, emb, lr=0.05)
    ropt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)
    for lookups in _make_steps(9, n_steps=5):
        opt.zero_grad()
        ropt.zero_grad()
        _loss([emb(i) for i, _ in lookups], [c for _, c in lookups]).backward()
        _loss([ref(i) for i, _ in lookups], [c for _, c in lookups]).backward()
        opt.step()
        ropt.step()
    torch.testing.assert_close(_table(emb), ref.weight.detach(), rtol=1e-6, atol=1e-6)


def test_gradient_accumulation_over_two_backwards_matches_reference():
    torch.manual_seed(5)
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.02)
    steps = _make_steps(12, n_steps=3)
    for lookups in steps:
        opt.zero_grad()
        for i, c in lookups:  # one backward per lookup
            _loss([emb(i)], [c]).backward()
        opt.step()
    # the reference: one parameter, accumulated grads over several backwards
    W = W0.clone()
    rows, step_t = None, None
    for lookups in steps:
        U = torch.unique(torch.cat([i.reshape(-1) for i, _ in lookups]))
        P = torch.nn.Parameter(W[U].clone())
        o = torch.optim.Adam([P], lr=0.02)
        if rows is not None:
            o.state[P] = {
                "step": step_t.clone(),
                "exp_avg": rows[0][U].clone(),
                "exp_avg_sq": rows[1][U].clone(),
            }
        for i, c in lookups:
            _loss([F.embedding(torch.searchsorted(U, i), P)], [c]).backward()
        o.step()
        if rows is None:
            rows = (torch.zeros_like(W), torch.zeros_like(W))
        rows[0][U] = o.state[P]["exp_avg"]
        rows[1][U] = o.state[P]["exp_avg_sq"]
        step_t = o.state[P]["step"]
        W[U] = P.detach()
    assert torch.equal(_table(emb), W)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_training_plain_sgd_matches_dense_embeddingbag(mode):
    torch.manual_seed(6)
    bag = _bag(mode=mode)
    ref = torch.nn.EmbeddingBag.from_pretrained(_table(bag), freeze=False, mode=mode)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=0.2)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(0)
    for _s in range(4):
        ids = torch.randint(0, N, (7,), generator=g)
        offsets = torch.tensor([0, 2, 2, 5])
        coef = torch.randn(4, D, generator=g)
        kwargs = {}
        if mode == "sum":
            kwargs["per_sample_weights"] = torch.rand(7, generator=g)
        opt.zero_grad()
        ropt.zero_grad()
        ((bag(ids, offsets, **kwargs) * coef).sum() ** 2).backward()
        ((ref(ids, offsets, **kwargs) * coef).sum() ** 2).backward()
        opt.step()
        ropt.step()
    torch.testing.assert_close(_table(bag), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_bag_training_2d_input_adam_matches_lazy_reference():
    torch.manual_seed(7)
    bag = _bag(mode="mean")
    W0 = _table(bag)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, bag, lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 6 + s, (3, 4), generator=g), torch.randn(3, D, generator=g))
        for s in range(3)
    ]
    for ids, c in data:
        opt.zero_grad()
        ((bag(ids) * c).sum() ** 2).backward()
        opt.step()
    W = W0.clone()
    rows, step_t = None, None
    for ids, c in data:
        U = torch.unique(ids)
        P = torch.nn.Parameter(W[U].clone())
        o = torch.optim.Adam([P], lr=0.05)
        if rows is not None:
            o.state[P] = {
                "step": step_t.clone(),
                "exp_avg": rows[0][U].clone(),
                "exp_avg_sq": rows[1][U].clone(),
            }
        ((F.embedding_bag(torch.searchsorted(U, ids), P, mode="mean") * c).sum() ** 2).backward()
        o.step()
        if rows is None:
            rows = (torch.zeros_like(W), torch.zeros_like(W))
        rows[0][U] = o.state[P]["exp_avg"]
        rows[1][U] = o.state[P]["exp_avg_sq"]
        step_t = o.state[P]["step"]
        W[U] = P.detach()
    torch.testing.assert_close(_table(bag), W, rtol=1e-5, atol=1e-6)


def test_sequential_model_trains_like_dense_model():
    torch.manual_seed(8)
    emb = _emb()
    lin = torch.nn.Linear(3 * D, 1)
    model = torch.nn.Sequential(emb, torch.nn.Flatten(), lin)
    ref = torch.nn.Sequential(
        torch.nn.Embedding.from_pretrained(_table(emb), freeze=False),
        torch.nn.Flatten(),
        copy.deepcopy(lin),
    )
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randint(0, N, (5, 3), generator=g)
        y = torch.randn(5, 1, generator=g)
        opt.zero_grad()
        ropt.zero_grad()
        F.mse_loss(model(x), y).backward()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        ropt.step()
    assert torch.equal(_table(emb), ref[0].weight.detach())
    assert torch.equal(lin.weight.detach(), ref[2].weight.detach())
    assert torch.equal(lin.bias.detach(), ref[2].bias.detach())


def test_readme_moduledict_example_trains_item_user_and_head():
    torch.manual_seed(9)
    model = torch.nn.ModuleDict(
        {
            "item": _emb(50, 8),
            "user": _bag(40, 8, mode="mean"),
            "head": torch.nn.Linear(8, 1),
        }
    )
    before = {k: _table(model[k]) for k in ("item", "user")}
    head_before = model["head"].weight.detach().clone()
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, lr=1e-2, weight_decay=0.01)
    items = torch.randint(0, 50, (6,))
    history = torch.randint(0, 40, (6, 3))
    y = torch.randn(6)
    losses = []
    for _ in range(5):
        pred = model["head"](model["item"](items) * model["user"](history)).squeeze(-1)
        loss = F.mse_loss(pred, y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0]
    item_after = _table(model["item"])
    changed = (item_after != before["item"]).any(1)
    assert torch.equal(changed.nonzero().flatten(), torch.unique(items))
    assert not torch.equal(_table(model["user"]), before["user"])
    assert not torch.equal(model["head"].weight.detach(), head_before)


# --------------------------------------------------------------------------------------
# Step semantics documented in the README
# --------------------------------------------------------------------------------------


def test_zero_grad_discards_lookup_gradients():
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.zero_grad()
    opt.step()
    assert torch.equal(_table(emb), W0)
    emb(torch.tensor([3])).sum().backward()
    emb.zero_grad()
    opt.step()
    assert torch.equal(_table(emb), W0)


def test_second_step_without_backward_leaves_table_alone():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    W1 = _table(emb)
    step1 = float(opt.state_dict()["inner"]["state"][0]["step"])
    opt.step()
    assert torch.equal(_table(emb), W1)
    assert float(opt.state_dict()["inner"]["state"][0]["step"]) == step1 == 1.0


def test_empty_lookup_counts_a_step_and_changes_no_row():
    torch.manual_seed(1)
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    out = emb(torch.zeros(0, dtype=torch.long))
    (out.sum() + 0.0).backward()
    opt.step()
    assert torch.equal(_table(emb), W0)
    assert float(opt.state_dict()["inner"]["state"][0]["step"]) == 1.0
    # the next real step uses step count 2 (bias correction), as SparseAdam would
    emb(torch.tensor([3])).sum().backward()
    opt.step()
    P = torch.nn.Parameter(W0[3:4].clone())
    ref = torch.optim.Adam([P], lr=0.1)
    ref.state[P] = {
        "step": torch.tensor(1.0),
        "exp_avg": torch.zeros_like(P),
        "exp_avg_sq": torch.zeros_like(P),
    }
    P.grad = torch.ones_like(P)
    ref.step()
    assert torch.equal(_table(emb)[3:4], P.detach())


def test_table_without_lookup_is_not_stepped():
    torch.manual_seed(2)
    model = torch.nn.ModuleDict({"a": _emb(), "b": _emb()})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.1)
    model["a"](torch.tensor([1])).sum().backward()
    model["b"](torch.tensor([1])).sum().backward()
    opt.step()
    Wb = _table(model["b"])
    for _ in range(2):
        opt.zero_grad()
        model["a"](torch.tensor([2])).sum().backward()
        opt.step()
    assert torch.equal(_table(model["b"]), Wb)
    steps = sorted(float(s["step"]) for s in opt.state_dict()["inner"]["state"].values())
    assert steps == [1.0, 3.0]


def test_no_grad_forward_returns_constants_and_leaves_nothing_for_step():
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    with torch.no_grad():
        out = emb(torch.tensor([[1, 2], [3, 4]]))
    assert not out.requires_grad
    assert torch.equal(out, W0[torch.tensor([[1, 2], [3, 4]])])
    opt.step()
    assert torch.equal(_table(emb), W0)


def test_train_eval_modes_do_not_change_lookups_and_training_still_works():
    emb = _emb()
    W0 = _table(emb)
    _opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    ids = torch.tensor([0, 5])
    assert emb.training
    with torch.no_grad():
        a = emb(ids)
    assert emb.eval() is emb
    assert not emb.training
    with torch.no_grad():
        b = emb(ids)
    assert torch.equal(a, b)
    # nn.Embedding trains the same in eval mode: the mode is only a flag
    emb(ids).sum().backward()
    _opt.step()
    exp = W0.clone()
    exp[ids] -= 1.0
    assert torch.equal(_table(emb), exp)
    emb.train()
    assert emb.training


def test_requires_grad_false_freezes_table():
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    assert emb.requires_grad_(False) is emb
    out = emb(torch.tensor([1, 2]))
    assert not out.requires_grad
    opt.step()
    assert torch.equal(_table(emb), W0)
    emb.requires_grad_(True)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    assert not torch.equal(_table(emb), W0)


def test_parameters_hold_only_dense_params_and_optimizer_needs_model():
    emb = _emb()
    assert list(emb.parameters()) == []
    model = torch.nn.Sequential(emb, torch.nn.Linear(D, 2))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["1.weight", "1.bias"]
    # passing model.parameters() finds no table: a warning (the model works)
    with pytest.warns(UserWarning):
        _opt = gl.OffloadedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.SGD, [emb.weight], lr=0.1)


def test_unsupported_optimizer_is_refused_with_list():
    emb = _emb()
    with pytest.raises(gl.GadgetTypeError, match="Adam"):
        gl.OffloadedOptimizer(torch.optim.LBFGS, emb, lr=0.1)


# --------------------------------------------------------------------------------------
# state_dict, casts, copies, repr
# --------------------------------------------------------------------------------------


def test_state_dict_round_trip_between_modules_and_with_nn_embedding(tmp_path):
    a = _emb()
    b = _emb()
    sd = a.state_dict()
    assert list(sd) == ["weight"]
    assert sd["weight"].shape == (N, D)
    res = b.load_state_dict(sd)
    assert list(res.missing_keys) == [] and list(res.unexpected_keys) == []
    assert torch.equal(_table(b), _table(a))
    # through a file, weights-only
    torch.save(a.state_dict(), tmp_path / "e.pt")
    c = _emb()
    c.load_state_dict(torch.load(tmp_path / "e.pt", weights_only=True))
    assert torch.equal(_table(c), _table(a))
    # with nn.Embedding both ways
    ref = torch.nn.Embedding(N, D)
    ref.load_state_dict(a.state_dict())
    assert torch.equal(ref.weight.detach(), _table(a))
    ref2 = torch.nn.Embedding(N, D)
    a.load_state_dict(ref2.state_dict())
    assert torch.equal(_table(a), ref2.weight.detach())
    # lookups see the loaded rows
    assert torch.equal(a(torch.tensor([3, 1])), ref2.weight.detach()[[3, 1]])


def test_state_dict_inside_model_and_float64_tensor_converted():
    m1 = torch.nn.Sequential(_emb(), torch.nn.Linear(D, 1))
    m2 = torch.nn.Sequential(_emb(), torch.nn.Linear(D, 1))
    sd = m1.state_dict()
    assert set(sd) == {"0.weight", "1.weight", "1.bias"}
    m2.load_state_dict(sd)
    assert torch.equal(_table(m2[0]), _table(m1[0]))
    W64 = torch.randn(N, D, dtype=torch.float64)
    m2[0].load_state_dict({"weight": W64})
    assert _table(m2[0]).dtype == torch.float32
    assert torch.equal(_table(m2[0]), W64.float())


def test_state_dict_does_not_alias_table():
    emb = _emb()
    sd = emb.state_dict()
    before = sd["weight"].clone()
    _opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    emb(torch.tensor([0])).sum().backward()
    _opt.step()
    W = _table(emb)
    assert not torch.equal(W, before)
    # a state dict taken before training either still holds the old rows (a copy) or
    # follows the table (as nn.Embedding's does); it must never be half-updated
    assert torch.equal(sd["weight"], before) or torch.equal(sd["weight"], W)


def test_load_state_dict_wrong_shape_is_refused_and_table_unchanged():
    emb = _emb()
    W0 = _table(emb)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        emb.load_state_dict({"weight": torch.zeros(N + 1, D)})
    assert torch.equal(_table(emb), W0)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        emb.load_state_dict({"weight": torch.zeros(N, D, dtype=torch.int64)})
    assert torch.equal(_table(emb), W0)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        emb.load_state_dict({"bogus": torch.zeros(N, D)})
    assert torch.equal(_table(emb), W0)


def test_load_state_dict_refused_while_lookup_waits_for_step():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    emb(torch.tensor([2])).sum().backward()
    W0 = _table(emb)
    with pytest.raises(Exception) as ei:
        emb.load_state_dict({"weight": torch.zeros(N, D)})
    assert isinstance(ei.value, (gl.GadgetError, RuntimeError))
    assert torch.equal(_table(emb), W0)
    opt.step()
    exp = W0.clone()
    exp[2] -= 1.0
    assert torch.equal(_table(emb), exp)


@pytest.mark.parametrize(
    "cast,dtype",
    [
        (lambda m: m.half(), torch.float16),
        (lambda m: m.double(), torch.float64),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.to(torch.float64), torch.float64),
        (lambda m: m.to("cpu", torch.float16), torch.float16),
    ],
)
def test_dtype_casts_change_lookup_dtype_not_table(cast, dtype):
    emb = _emb()
    W0 = _table(emb)
    assert cast(emb) is emb
    assert emb.weight.dtype == torch.float32
    out = emb(torch.tensor([1, 3]))
    assert out.dtype == dtype
    assert torch.equal(out, W0[[1, 3]].to(dtype))
    assert "output_dtype" in repr(emb)
    emb.float()
    assert emb(torch.tensor([1])).dtype == torch.float32
    assert "output_dtype" not in repr(emb)


def test_double_cast_training_updates_float32_table():
    emb = _emb()
    W0 = _table(emb)
    _opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    emb.double()
    out = emb(torch.tensor([4]))
    assert out.dtype == torch.float64
    out.sum().backward()
    _opt.step()
    W = _table(emb)
    assert W.dtype == torch.float32
    exp = W0.clone()
    exp[4] -= 0.5
    assert torch.equal(W, exp)


def test_cpu_and_to_cpu_are_noops_for_cpu_module():
    emb = _emb()
    W0 = _table(emb)
    assert emb.cpu() is emb
    assert emb.to("cpu") is emb
    assert emb.to(torch.device("cpu")) is emb
    out = emb(torch.tensor([2]))
    assert out.device.type == "cpu"
    assert torch.equal(out, W0[[2]])
    assert torch.equal(_table(emb), W0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_table_dtype_option(dtype):
    emb = _emb(dtype=dtype)
    assert emb.weight.dtype == dtype
    W = _table(emb)
    assert W.dtype == dtype
    out = emb(torch.tensor([[0, 11]]))
    assert out.dtype == dtype
    assert torch.equal(out, W[torch.tensor([[0, 11]])])
    assert f"dtype={str(dtype).replace('torch.', '')}" in repr(emb)
    bag = _bag(dtype=dtype, mode="sum")
    assert bag(torch.tensor([[1, 2]])).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_training_matches_reference_to_rounding(dtype):
    torch.manual_seed(3)
    emb = _emb(dtype=dtype)
    W0 = _table(emb)
    steps = _make_steps(21, n_steps=3)
    _offloaded_train(emb, torch.optim.Adam, dict(lr=0.01), steps)
    W_ref, _, _ = _lazy_reference(W0, torch.optim.Adam, dict(lr=0.01), steps)
    torch.testing.assert_close(_table(emb).float(), W_ref.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(_table(emb), W0)


def test_repr_shows_shape_placement_dtype_and_mode():
    emb = _emb(7, 3)
    r = repr(emb)
    assert r.startswith("OffloadedEmbedding(7, 3")
    assert "placement='cpu'" in r and "dtype=float32" in r
    bag = _bag(7, 3, mode="max")
    rb = repr(bag)
    assert rb.startswith("OffloadedEmbeddingBag(7, 3") and "mode='max'" in rb
    model = torch.nn.Sequential(emb, torch.nn.ReLU())
    assert "(0): OffloadedEmbedding(7, 3" in repr(model)


def test_deepcopy_and_pickle_are_separate_tables():
    emb = _emb()
    W0 = _table(emb)
    cp = copy.deepcopy(emb)
    pk = pickle.loads(pickle.dumps(emb))
    for other in (cp, pk):
        assert torch.equal(_table(other), W0)
        other.load_state_dict({"weight": torch.zeros(N, D)})
        assert torch.equal(_table(emb), W0)
        assert torch.equal(other(torch.tensor([1])), torch.zeros(1, D))


def test_torch_init_on_weight():
    emb = _emb()
    torch.nn.init.constant_(emb.weight, 0.5)
    assert torch.equal(_table(emb), torch.full((N, D), 0.5))
    torch.nn.init.zeros_(emb.weight)
    assert torch.equal(emb(torch.tensor([3])), torch.zeros(1, D))
    with pytest.raises(gl.GadgetTypeError):
        torch.nn.init.trunc_normal_(emb.weight)
    assert torch.equal(_table(emb), torch.zeros(N, D))
    emb.weight.init_(torch.nn.init.trunc_normal_, std=0.02, a=-0.04, b=0.04)
    W = _table(emb)
    assert W.abs().max() <= 0.04 + 1e-6 and W.abs().max() > 0


# --------------------------------------------------------------------------------------
# Errors: clear messages, nothing changed
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad,exc,words",
    [
        (torch.tensor([1, N]), gl.GadgetIndexError, [str(N), "rows"]),
        (torch.tensor([[0, -1]]), gl.GadgetIndexError, ["-1", "negative"]),
        (torch.tensor([1.0, 2.0]), gl.GadgetTypeError, ["integer", "float32"]),
        (torch.tensor([True, False]), gl.GadgetTypeError, ["bool", "nonzero"]),
    ],
)
def test_bad_ids_raise_clear_error_and_change_nothing(bad, exc, words):
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    good = emb(torch.tensor([2]))
    with pytest.raises(exc) as ei:
        emb(bad)
    msg = str(ei.value)
    for w in words:
        assert w in msg, msg
    assert isinstance(ei.value, gl.GadgetError)
    # the failed lookup leaves nothing for the step: only the good one trains
    good.sum().backward()
    opt.step()
    exp = W0.clone()
    exp[2] -= 1.0
    assert torch.equal(_table(emb), exp)


def test_bad_ids_under_no_grad_raise_too():
    emb = _emb()
    W0 = _table(emb)
    with torch.no_grad():
        with pytest.raises(gl.GadgetIndexError):
            emb(torch.tensor([N + 5]))
        with pytest.raises(IndexError):  # also a builtin IndexError
            emb(torch.tensor([-3]))
    assert torch.equal(_table(emb), W0)


@pytest.mark.parametrize("bad", [torch.tensor([[0, N]]), torch.tensor([[-1, 2]])])
def test_bag_bad_ids_raise_and_change_nothing(bad):
    bag = _bag(mode="sum")
    W0 = _table(bag)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=1.0)
    with pytest.raises(gl.GadgetIndexError):
        bag(bad)
    with pytest.raises(gl.GadgetIndexError):
        bag(bad.reshape(-1), torch.tensor([0]))
    with pytest.raises(gl.GadgetTypeError):
        bag(torch.tensor([[0.0, 1.0]]))
    opt.step()
    assert torch.equal(_table(bag), W0)


@pytest.mark.parametrize(
    "offsets,exc",
    [
        (torch.tensor([1, 2]), gl.GadgetValueError),
        (torch.tensor([0, 3, 2]), gl.GadgetValueError),
        (torch.tensor([0, 7]), gl.GadgetValueError),
        (torch.tensor([0.0, 2.0]), gl.GadgetTypeError),
        (torch.tensor([[0, 2]]), (gl.GadgetTypeError, gl.GadgetValueError)),
    ],
)
def test_bag_bad_offsets_refused_before_lookup(offsets, exc):
    bag = _bag(mode="sum")
    W0 = _table(bag)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=1.0)
    with pytest.raises(exc) as ei:
        bag(torch.tensor([1, 2, 3, 4]), offsets)
    assert "offsets" in str(ei.value)
    opt.step()
    assert torch.equal(_table(bag), W0)


def test_bag_offsets_and_input_rules():
    bag = _bag(mode="sum")
    with pytest.raises(gl.GadgetValueError, match="offsets"):
        bag(torch.tensor([1, 2, 3]))  # 1-D needs offsets
    with pytest.raises(gl.GadgetValueError, match="1-D"):
        bag(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    with pytest.raises(gl.GadgetValueError):  # empty offsets go only with an empty input
        bag(torch.tensor([1, 2]), torch.zeros(0, dtype=torch.long))
    with pytest.raises(gl.GadgetValueError, match="per_sample_weights"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0]), per_sample_weights=torch.ones(2))
    with pytest.raises(gl.GadgetTypeError, match="per_sample_weights"):
        bag(
            torch.tensor([1, 2, 3]),
            torch.tensor([0]),
            per_sample_weights=torch.ones(3, dtype=torch.long),
        )
    bl = _bag(mode="sum", include_last_offset=True)
    with pytest.raises(gl.GadgetValueError):  # must end at the input's length
        bl(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))


def test_constructor_errors():
    with pytest.raises(gl.GadgetValueError, match="mode"):
        _bag(mode="bogus")
    with pytest.raises(ValueError, match="'sum'"):
        _bag(mode="median")
    with pytest.raises(gl.GadgetKeyError, match="pinned"):
        _emb(placement="bogus")
    with pytest.raises(gl.GadgetKeyError):
        _emb(placement="file")
    with pytest.raises(gl.GadgetValueError, match="num_embeddings"):
        _emb(0)
    with pytest.raises(gl.GadgetValueError, match="embedding_dim"):
        _emb(4, 0)
    with pytest.raises(gl.GadgetTypeError, match="int64"):
        _emb(dtype=torch.int64)
    with pytest.raises(gl.GadgetTypeError):
        _bag(dtype=torch.bool)
    for kw in ("padding_idx", "max_norm", "sparse", "scale_grad_by_freq"):
        with pytest.raises(TypeError, match=kw):
            _emb(**{kw: 1})
        with pytest.raises(TypeError, match=kw):
            _bag(**{kw: 1})


def test_optimizer_cannot_be_pickled_or_deepcopied():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        pickle.dumps(opt)
    with pytest.raises(gl.GadgetTypeError):
        copy.deepcopy(opt)


def test_optimizer_state_dict_round_trip_resumes_identically():
    torch.manual_seed(13)
    steps = _make_steps(31, n_steps=4)
    emb = _emb()
    W0 = _table(emb)
    opt = _offloaded_train(emb, torch.optim.Adam, dict(lr=0.02), steps[:2])
    esd, osd = copy.deepcopy(emb.state_dict()), copy.deepcopy(opt.state_dict())
    for lookups in steps[2:]:
        opt.zero_grad()
        _loss([emb(i) for i, _ in lookups], [c for _, c in lookups]).backward()
        opt.step()
    emb2 = _emb()
    emb2.load_state_dict(esd)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.02)
    opt2.load_state_dict(osd)
    for lookups in steps[2:]:
        opt2.zero_grad()
        _loss([emb2(i) for i, _ in lookups], [c for _, c in lookups]).backward()
        opt2.step()
    assert torch.equal(_table(emb2), _table(emb))
    assert not torch.equal(_table(emb), W0)
    # another optimizer class is refused before anything changes
    emb3 = _emb()
    opt3 = gl.OffloadedOptimizer(torch.optim.NAdam, emb3, lr=0.02)
    with pytest.raises(gl.GadgetValueError):
        opt3.load_state_dict(osd)


# --------------------------------------------------------------------------------------
# More optimizer plumbing documented in the README
# --------------------------------------------------------------------------------------


def test_late_gradient_is_reported_not_applied():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(torch.tensor([1]))
    opt.step()
    W = _table(emb)
    out.sum().backward()
    with pytest.raises(gl.GadgetValueError, match="backward"):
        opt.step()
    assert torch.equal(_table(emb), W)
    # zero_grad discards such a gradient first, as torch's would
    out2 = emb(torch.tensor([2]))
    opt.step()
    out2.sum().backward()
    opt.zero_grad()
    opt.step()
    assert torch.equal(_table(emb), W)


def test_table_changes_refused_while_training_lookup_waits():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(torch.tensor([1]))
    W = _table(emb)
    with pytest.raises(gl.GadgetValueError):
        emb.weight.fill_(0.0)
    with pytest.raises(gl.GadgetValueError):
        torch.nn.init.zeros_(emb.weight)
    assert torch.equal(_table(emb), W)
    out.sum().backward()
    opt.step()
    exp = W.clone()
    exp[1] -= 1.0
    assert torch.equal(_table(emb), exp)
    emb.weight.fill_(0.0)  # fine after the step
    assert torch.equal(_table(emb), torch.zeros(N, D))


def test_load_retires_lookup_waiting_for_backward():
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(torch.tensor([1]))
    emb.load_state_dict({"weight": torch.zeros(N, D)})
    out.sum().backward()
    with pytest.raises(gl.GadgetValueError, match="loaded"):
        opt.step()
    assert torch.equal(_table(emb), torch.zeros(N, D))


def test_bag_per_sample_weights_receive_gradient_like_torch():
    torch.manual_seed(0)
    bag = _bag(mode="sum")
    W = _table(bag)
    ref = torch.nn.EmbeddingBag.from_pretrained(W.clone(), freeze=False, mode="sum")
    _opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=1.0)
    ids = torch.tensor([1, 2, 2, 7])
    off = torch.tensor([0, 2])
    psw = torch.rand(4, requires_grad=True)
    psw2 = psw.detach().clone().requires_grad_()
    c = torch.randn(2, D)
    (bag(ids, off, per_sample_weights=psw) * c).sum().backward()
    (ref(ids, off, per_sample_weights=psw2) * c).sum().backward()
    torch.testing.assert_close(psw.grad, psw2.grad)
    # a frozen table still passes gradient on to the weights
    bag.requires_grad_(False)
    psw3 = torch.rand(4, requires_grad=True)
    bag(ids, off, per_sample_weights=psw3).sum().backward()
    torch.testing.assert_close(psw3.grad, W[ids].sum(1))


def test_lr_scheduler_group_options_closure_and_add_param_group():
    torch.manual_seed(0)
    emb = _emb()
    ref = torch.nn.Embedding.from_pretrained(_table(emb), freeze=False)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    s = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    rs = torch.optim.lr_scheduler.StepLR(ropt, 1, gamma=0.5)
    for k in range(4):
        ids = torch.tensor([k, k + 1, k + 1])
        opt.zero_grad()
        ropt.zero_grad()
        (emb(ids) ** 2).sum().backward()
        (ref(ids) ** 2).sum().backward()
        opt.step()
        ropt.step()
        s.step()
        rs.step()
    assert torch.equal(_table(emb), ref.weight.detach())
    # group options for a table; closure returns its loss
    model = torch.nn.ModuleDict({"e": _emb(), "h": torch.nn.Linear(D, 1)})
    W0 = _table(model["e"])
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD,
        [{"params": model["e"], "lr": 2.0}, {"params": model["h"].parameters()}],
        lr=0.1,
    )

    def closure():
        opt.zero_grad()
        loss = model["e"](torch.tensor([3])).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() == pytest.approx(W0[3].sum().item(), rel=1e-6)
    assert torch.equal(_table(model["e"])[3], W0[3] - 2.0)
    # a table added later with its own options
    e2 = _emb()
    W2 = _table(e2)
    opt.add_param_group({"params": e2, "lr": 3.0})
    e2(torch.tensor([4])).sum().backward()
    opt.step()
    assert torch.equal(_table(e2)[4], W2[4] - 3.0)


def test_clip_grad_norm_over_param_groups_reaches_tables():
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    (emb(torch.tensor([1, 2])) * 10).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    assert float(norm) == pytest.approx(10 * (2 * D) ** 0.5, rel=1e-5)
    opt.step()
    assert float((W0 - _table(emb)).norm()) == pytest.approx(1.0, rel=1e-4)


def test_retain_graph_and_non_reentrant_checkpoint_match_dense():
    torch.manual_seed(1)
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    o = emb(torch.tensor([1, 1, 2]))
    (o**2).sum().backward(retain_graph=True)
    (o * 3).sum().backward()
    opt.step()
    ref = torch.nn.Embedding.from_pretrained(W0.clone(), freeze=False)
    o = ref(torch.tensor([1, 1, 2]))
    (o**2).sum().backward(retain_graph=True)
    (o * 3).sum().backward()
    with torch.no_grad():
        ref.weight -= ref.weight.grad
    torch.testing.assert_close(_table(emb), ref.weight.detach(), rtol=1e-6, atol=1e-6)

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(2)
    emb = _emb()
    lin = torch.nn.Linear(D, 1)
    model = torch.nn.ModuleDict({"e": emb, "l": lin})
    ref = torch.nn.Embedding.from_pretrained(_table(emb), freeze=False)
    rlin = copy.deepcopy(lin)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.1)
    ropt = torch.optim.SGD(list(ref.parameters()) + list(rlin.parameters()), lr=0.1)
    ids = torch.tensor([[1, 2], [2, 5]])
    for _ in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        checkpoint(lambda i: lin(emb(i)).sum(), ids, use_reentrant=False).backward()
        checkpoint(lambda i: rlin(ref(i)).sum(), ids, use_reentrant=False).backward()
        opt.step()
        ropt.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_weight_requires_grad_attribute_freezes():
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    assert emb.weight.requires_grad
    emb.weight.requires_grad = False
    out = emb(torch.tensor([1]))
    assert not out.requires_grad
    opt.step()
    assert torch.equal(_table(emb), W0)


def test_model_to_float64_and_whole_model_save_load(tmp_path):
    torch.manual_seed(1)
    m = torch.nn.Sequential(_emb(), torch.nn.Linear(D, 1))
    opt = gl.OffloadedOptimizer(torch.optim.SGD, m, lr=0.1)
    assert m.to(torch.float64) is m
    out = m(torch.tensor([1, 2]))
    assert out.dtype == torch.float64
    out.sum().backward()
    opt.step()
    assert m[0].weight.dtype == torch.float32
    torch.save(m, tmp_path / "m.pt")
    m2 = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.equal(_table(m2[0]), _table(m[0]))
    m2[0].load_state_dict({"weight": torch.zeros(N, D)})
    assert not torch.equal(_table(m[0]), torch.zeros(N, D))


def test_bag_load_state_dict_from_nn_embeddingbag():
    bag = _bag(mode="sum")
    r = torch.nn.EmbeddingBag(N, D, mode="sum")
    bag.load_state_dict(r.state_dict())
    ids = torch.tensor([[1, 2, 3], [4, 4, 0]])
    torch.testing.assert_close(bag(ids), r(ids), rtol=1e-6, atol=1e-6)
    r2 = torch.nn.EmbeddingBag(N, D, mode="sum")
    r2.load_state_dict(bag.state_dict())
    assert torch.equal(r2.weight.detach(), _table(bag))


def test_module_attributes_like_torch():
    emb = _emb(7, 3)
    assert (emb.num_embeddings, emb.embedding_dim) == (7, 3)
    assert tuple(emb.weight.shape) == (7, 3)
    bag = _bag(7, 3, mode="max", include_last_offset=True)
    assert (bag.num_embeddings, bag.embedding_dim, bag.mode, bag.include_last_offset) == (
        7,
        3,
        "max",
        True,
    )


def test_forward_hooks_run():
    emb = _emb()
    W0 = _table(emb)
    h = emb.register_forward_hook(lambda m, i, o: o * 2)
    assert torch.equal(emb(torch.tensor([1])), W0[[1]] * 2)
    h.remove()
    assert torch.equal(emb(torch.tensor([1])), W0[[1]])


def test_inference_mode_forward_and_nothing_left_for_step():
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    bag = _bag(mode="sum")
    Wb = _table(bag)
    with torch.inference_mode():
        assert torch.equal(emb(torch.tensor([1, 2])), W0[[1, 2]])
        torch.testing.assert_close(bag(torch.tensor([[1, 2]])), Wb[[1, 2]].sum(0, keepdim=True))
    opt.step()
    assert torch.equal(_table(emb), W0)


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler missing")
def test_grad_scaler_unscales_and_skips_inf_steps():
    torch.manual_seed(0)
    emb = _emb()
    W0 = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sc.scale(emb(torch.tensor([1, 2])).sum()).backward()
    sc.step(opt)
    sc.update()
    exp = W0.clone()
    exp[[1, 2]] -= 1.0
    assert torch.equal(_table(emb), exp)
    opt.zero_grad()
    o = emb(torch.tensor([3]))
    sc.scale(o.sum() * torch.tensor(float("inf"))).backward()
    sc.step(opt)
    sc.update()
    assert torch.equal(_table(emb), exp)
    assert sc.get_scale() == 512.0


def test_optimizer_state_dict_saves_weights_only(tmp_path):
    emb = _emb()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    osd = torch.load(tmp_path / "o.pt", weights_only=True)
    emb2 = _emb()
    emb2.load_state_dict(emb.state_dict())
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.1)
    opt2.load_state_dict(osd)
    for e, o in ((emb, opt), (emb2, opt2)):
        e(torch.tensor([1, 4])).sum().backward()
        o.step()
    assert torch.equal(_table(emb), _table(emb2))


def test_one_row_one_column_table_trains():
    e = _emb(1, 1, init=torch.nn.init.zeros_)
    o = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.5)
    e(torch.zeros(5, dtype=torch.long)).sum().backward()
    o.step()
    assert torch.equal(_table(e), torch.tensor([[-2.5]]))
    with pytest.raises(gl.GadgetIndexError):
        e(torch.tensor([1]))


def test_load_state_dict_numpy_and_integer_refusal():
    import numpy as np

    emb = _emb()
    emb.load_state_dict({"weight": np.full((N, D), 0.5, np.float32)})
    assert torch.equal(_table(emb), torch.full((N, D), 0.5))
    with pytest.raises(RuntimeError, match="floating"):
        emb.load_state_dict({"weight": np.ones((N, D), np.int32)})
    assert torch.equal(_table(emb), torch.full((N, D), 0.5))
