"""Review (session 14): real SpeedTorch user code, replayed call for call against gadgetloader.

The call sequences come from SpeedTorch's own README / source (Santosh-Gupta/SpeedTorch) and
from published code that used it:

* Lit2Vec2's training notebook (Santosh-Gupta/Lit2Vec2, ``Lit2Vec2TrainingPublic.ipynb``):
  ``ModelFactory(var, total_classes=..., embed_dimension=...)``, ``uniformDistributionInit(
  -r, r)`` / ``normalDistributionInit(0, sqrt(r))``, ``OptimizerFactory(opt, total_classes=,
  embed_dimension=, model=, variable_name=, CPUPinn=True)`` for Adagrad, ``optInit()``, the
  dummy inputs of ``variableTransformer(batchSize=, posPerBatch=[, negPerBatch=])`` turned
  into ``Variable(torch.LongTensor(torch.from_numpy(x).long()))``, int32 NumPy ids shaped
  ``(B, 1)`` / ``(B, P)`` / ``(B, K)``, every switcher call inside ``torch.no_grad()``,
  ``del`` of the optimizer switchers, then ``getNumpyVersion()`` and ``saveCupy('x.npy.cpy')``;
* two transfer scripts built on ``SpeedTorch.DataGadget(ndarray, CPUPinn=True)``,
  ``gadgetInit()``, ``xgpu[:] = g.getData(indexes=(slice(0, 6), slice(0, 3)))`` and
  ``g.insertData(dataObject=xgpu, indexes=(slice(0, 6), slice(0, 3)))``;
* SpeedTorch's README: Adamax through the switchers (``sparse=False`` embeddings), Rprop
  switchers built only after a first ``loss.backward()``, SGD tables with no optimizer
  switcher split between ``PytorchModelFactory`` (GPU) and ``ModelFactory(CPUPinn=True)``,
  ``saveTorch`` / ``loadTorch`` files written as SpeedTorch wrote them.

What SpeedTorch computes (read from its source): ``getData(i)`` is ``table[i]`` (a copy for
integer arrays), ``insertData(d, i)`` is ``table[i] = d``; ``beforeForwardPass(pos, neg)``
puts ``table[concat(pos.reshape(-1), neg.reshape(-1))]`` into the variable, one row per id
position, and ``afterOptimizerStep`` writes those rows back (the last copy of a repeated id
wins); ``uniformDistributionInit(low, high)`` draws U[low, high), ``normalDistributionInit(
mean, stdDev)`` N(mean, stdDev**2); ``saveCupy(name)`` is ``numpy.save`` (``.npy`` appended),
``loadCupy(path)`` replaces the table with the file; ``saveTorch`` is ``torch.save`` of the
tensor (a list of state tensors for the optimizer switchers). References below are plain
torch / NumPy.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.autograd import Variable

import gadgetloader as gl

pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")

N, D = 64, 16  # D = 16: whole vectors, so CPU kernels round alike on any row count
B, P, K = 4, 2, 3  # batch, positives and negatives per example
RTOL, ATOL = 1e-5, 1e-6  # the model may run on the GPU, the reference runs on the CPU


def _close(a, b, rtol=RTOL, atol=ATOL):
    a = a.detach().cpu().numpy() if torch.is_tensor(a) else np.asarray(a)
    b = b.detach().cpu().numpy() if torch.is_tensor(b) else np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


class Lit2VecSkipGram(nn.Module):
    """Lit2Vec2's model: bmm scores, BCEWithLogits on [pos, -neg], summed per row, averaged."""

    def __init__(self, rows: int, sparse: bool = True) -> None:
        super().__init__()
        self.u_embeddings = nn.Embedding(rows, D, sparse=sparse)
        self.v_embeddings = nn.Embedding(rows, D, sparse=sparse)
        self.lossFunction = nn.BCEWithLogitsLoss(reduction="none")

    def forward(self, pos_u, pos_v, neg_v, targets):
        return _lit2vec_loss(
            self.u_embeddings(pos_u),
            self.v_embeddings(pos_v),
            self.v_embeddings(neg_v),
            targets,
            self.lossFunction,
        )


def _lit2vec_loss(emb_u, emb_v, neg_emb_v, targets, fn):
    score_pos = torch.bmm(emb_u, torch.transpose(emb_v, 1, 2)).squeeze()
    score_neg = torch.bmm(emb_u, torch.transpose(neg_emb_v, 1, 2)).squeeze()
    total = torch.cat(
        (score_pos.reshape(score_pos.shape[0], -1), -score_neg.reshape(score_neg.shape[0], -1)),
        dim=1,
    )
    return torch.mean(torch.sum(fn(total, targets), dim=1))


def _distinct_batch(rng):
    """Lit2Vec2's generate_batch shapes and dtype (int32), here without repeated ids."""
    labels = rng.choice(N, size=(B, 1), replace=False).astype(np.int32)
    allv = rng.choice(N, size=B * (P + K), replace=False).astype(np.int32)
    return allv[: B * P].reshape(B, P), labels, allv[B * P :].reshape(B, K)


def _repeating_batch(rng):
    """As Lit2Vec2's sampler produces them: ids repeat within and across the arrays."""
    batch = rng.integers(0, N // 4, size=(B, P)).astype(np.int32)
    labels = rng.integers(0, N // 4, size=(B, 1)).astype(np.int32)
    negs = rng.integers(0, N // 4, size=(B, K)).astype(np.int32)
    labels[1] = labels[0]
    negs[0, 0] = batch[2, 1]
    return batch, labels, negs


def _lit2vec_setup(device, rows=B * (2 * P + K)):
    torch.manual_seed(0)
    model = Lit2VecSkipGram(rows)
    model.to(device)
    optimizer = torch.optim.Adagrad(model.parameters())
    uEmbed_switcher = gl.ModelFactory(model.u_embeddings, total_classes=N, embed_dimension=D)
    vEmbed_switcher = gl.ModelFactory(model.v_embeddings, total_classes=N, embed_dimension=D)
    initrange = (2.0 / (N + D)) ** 0.5
    uEmbed_switcher.uniformDistributionInit(-initrange, initrange)
    vEmbed_switcher.normalDistributionInit(0, math.sqrt(initrange))
    uAdagrad_switcher = gl.OptimizerFactory(
        optimizer,
        total_classes=N,
        embed_dimension=D,
        model=model,
        variable_name="u_embeddings",
        CPUPinn=True,
    )
    vAdagrad_switcher = gl.OptimizerFactory(
        optimizer,
        total_classes=N,
        embed_dimension=D,
        model=model,
        variable_name="v_embeddings",
        CPUPinn=True,
    )
    uAdagrad_switcher.optInit()
    vAdagrad_switcher.optInit()
    labelsDummyInput = uEmbed_switcher.variableTransformer(batchSize=B, posPerBatch=1)
    batchDummpyInput, negzDummyInput = vEmbed_switcher.variableTransformer(
        batchSize=B, posPerBatch=P, negPerBatch=K
    )
    pos_u = Variable(torch.LongTensor(torch.from_numpy(labelsDummyInput).long())).to(device)
    pos_v = Variable(torch.LongTensor(torch.from_numpy(batchDummpyInput).long())).to(device)
    neg_v = Variable(torch.LongTensor(torch.from_numpy(negzDummyInput).long())).to(device)
    sw = (uEmbed_switcher, vEmbed_switcher, uAdagrad_switcher, vAdagrad_switcher)
    return model, optimizer, sw, (pos_u, pos_v, neg_v)


def _lit2vec_step(model, optimizer, sw, dummies, targets, batch, labels, negz):
    """Lit2Vec2's loop body, verbatim in its calls."""
    uEmbed_switcher, vEmbed_switcher, uAdagrad_switcher, vAdagrad_switcher = sw
    pos_u, pos_v, neg_v = dummies
    with torch.no_grad():
        uEmbed_switcher.beforeForwardPass(labels)
        vEmbed_switcher.beforeForwardPass(batch, negz)
        uAdagrad_switcher.beforeForwardPass(labels)
        vAdagrad_switcher.beforeForwardPass(batch, negz)
    optimizer.zero_grad()
    loss = model.forward(pos_u, pos_v, neg_v, targets)
    running = loss.data.item()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        uEmbed_switcher.afterOptimizerStep(labels)
        vEmbed_switcher.afterOptimizerStep(batch, negz)
        uAdagrad_switcher.afterOptimizerStep(labels)
        vAdagrad_switcher.afterOptimizerStep(batch, negz)
    return running


@pytest.mark.parametrize("rows", [B * (2 * P + K), 1], ids=["notebook-rows", "one-row"])
def test_lit2vec2_adagrad_loop_equals_sparse_full_table_adagrad(
    device, tmp_path, monkeypatch, rows
):
    monkeypatch.chdir(tmp_path)
    model, optimizer, sw, dummies = _lit2vec_setup(device, rows)
    u, v, uo, vo = sw
    # the variable stays the Parameter the user's optimizer holds
    weights_before = [id(p) for p in optimizer.param_groups[0]["params"]]
    # reference: both whole tables as sparse embeddings, trained by torch's own Adagrad
    ru = nn.Embedding(N, D, sparse=True)
    rv = nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        ru.weight.copy_(torch.from_numpy(u.getNumpyVersion()))
        rv.weight.copy_(torch.from_numpy(v.getNumpyVersion()))
    ropt = torch.optim.Adagrad([ru.weight, rv.weight])
    fn = nn.BCEWithLogitsLoss(reduction="none")
    targets = torch.ones(B, P + K, dtype=torch.float32)
    rng = np.random.default_rng(7)
    for _ in range(4):
        batch, labels, negz = _distinct_batch(rng)
        loss = _lit2vec_step(model, optimizer, sw, dummies, targets.to(device), batch, labels, negz)
        ropt.zero_grad()
        rl = _lit2vec_loss(
            ru(torch.from_numpy(labels).long()),
            rv(torch.from_numpy(batch).long()),
            rv(torch.from_numpy(negz).long()),
            targets,
            fn,
        )
        rl.backward()
        ropt.step()
        assert loss == pytest.approx(rl.item(), rel=1e-5)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == weights_before
    assert model.u_embeddings.weight is optimizer.param_groups[0]["params"][0]
    _close(u.getNumpyVersion(), ru.weight)
    _close(v.getNumpyVersion(), rv.weight)
    _close(uo.getNumpyVersion()["sum"], ropt.state[ru.weight]["sum"])
    _close(vo.getNumpyVersion()["sum"], ropt.state[rv.weight]["sum"])
    # the notebook's ending: drop the optimizer switchers, then read and save the tables
    del uo, vo, sw
    gc.collect()
    numpyU = u.getNumpyVersion()
    assert isinstance(numpyU, np.ndarray) and numpyU.dtype == np.float32
    _close(numpyU, ru.weight)
    u.saveCupy("uEmbedsFinal.npy.cpy")  # numpy.save appends .npy
    assert (tmp_path / "uEmbedsFinal.npy.cpy.npy").is_file()
    assert not (tmp_path / "uEmbedsFinal.npy.cpy").exists()
    _close(np.load(tmp_path / "uEmbedsFinal.npy.cpy.npy"), ru.weight)


def _speedtorch_protocol_reference(tables, states, flat, grads_fn, lr):
    """SpeedTorch's protocol in plain torch for Adagrad: gather one row per id position into a
    small parameter and its state, step it, write the rows back in order (last copy wins)."""
    small = torch.nn.Parameter(tables[flat].clone())
    opt = torch.optim.Adagrad([small], lr=lr)
    opt.state[small] = {"step": torch.tensor(0.0), "sum": states[flat].clone()}
    small.grad = grads_fn(small)
    opt.step()
    idx = flat.tolist()
    for pos, row in enumerate(idx):  # sequential assignment: the last occurrence wins
        tables[row] = small.data[pos]
        states[row] = opt.state[small]["sum"][pos]


def test_lit2vec2_loop_with_repeated_ids_follows_speedtorch_last_copy_wins(device):
    model, optimizer, sw, dummies = _lit2vec_setup(device)
    u, v, uo, vo = sw
    U = torch.from_numpy(u.getNumpyVersion().copy())
    V = torch.from_numpy(v.getNumpyVersion().copy())
    SU = torch.zeros(N, D)
    SV = torch.zeros(N, D)
    fn = nn.BCEWithLogitsLoss(reduction="none")
    targets = torch.ones(B, P + K, dtype=torch.float32)
    pos_u, pos_v, neg_v = (d.cpu() for d in dummies)
    rng = np.random.default_rng(3)
    for _ in range(3):
        batch, labels, negz = _repeating_batch(rng)
        _lit2vec_step(model, optimizer, sw, dummies, targets.to(device), batch, labels, negz)
        # reference: one small variable per table, one row per id position
        lu = torch.from_numpy(labels.reshape(-1)).long()
        lv = torch.from_numpy(np.concatenate([batch.reshape(-1), negz.reshape(-1)])).long()
        wu = U[lu].clone().requires_grad_(True)
        wv = V[lv].clone().requires_grad_(True)
        loss = _lit2vec_loss(wu[pos_u], wv[pos_v], wv[neg_v], targets, fn)
        gu, gv = torch.autograd.grad(loss, [wu, wv])
        _speedtorch_protocol_reference(U, SU, lu, lambda _p, g=gu: g, 0.01)
        _speedtorch_protocol_reference(V, SV, lv, lambda _p, g=gv: g, 0.01)
    _close(u.getNumpyVersion(), U)
    _close(v.getNumpyVersion(), V)
    _close(uo.getNumpyVersion()["sum"], SU)
    _close(vo.getNumpyVersion()["sum"], SV)


def test_ids_as_int32_int64_numpy_and_cpu_torch_give_same_training(device):
    """SpeedTorch took NumPy ids (its README: int32 ones too) and CPU torch tensors (they go
    through ``np.concatenate`` / ``.reshape(-1)``); all must train the same rows."""
    results = []
    for conv in (
        lambda a: a.astype(np.int32),
        lambda a: a.astype(np.int64),
        lambda a: torch.from_numpy(a.astype(np.int64)),
    ):
        model, optimizer, sw, dummies = _lit2vec_setup(device)
        targets = torch.ones(B, P + K, device=device)
        rng = np.random.default_rng(11)
        for _ in range(3):
            batch, labels, negz = _distinct_batch(rng)
            _lit2vec_step(
                model, optimizer, sw, dummies, targets, conv(batch), conv(labels), conv(negz)
            )
        results.append((sw[0].getNumpyVersion(), sw[1].getNumpyVersion()))
    for other in results[1:]:
        np.testing.assert_array_equal(other[0], results[0][0])
        np.testing.assert_array_equal(other[1], results[0][1])
    assert not np.array_equal(results[0][0], _lit2vec_setup(device)[2][0].getNumpyVersion())


def test_before_forward_pass_puts_one_row_per_id_position_in_the_variable(device):
    """What SpeedTorch left in ``model_variable.weight`` after ``beforeForwardPass(pos, neg)``:
    ``table[concat(pos.reshape(-1), neg.reshape(-1))]`` -- which the dummy inputs address."""
    emb = nn.Embedding(2, D).to(device)
    sw = gl.ModelFactory(emb, N, D)
    sw.normalDistributionInit(0.0, 1.0)
    table = sw.getNumpyVersion().copy()
    pos_d, neg_d = sw.variableTransformer(2, 3, 2)
    np.testing.assert_array_equal(pos_d, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(neg_d, np.arange(6, 10).reshape(2, 2))
    assert pos_d.dtype == np.int64 and neg_d.dtype == np.int64
    pos = np.array([[5, 9, 5], [0, 63, 1]], dtype=np.int32)
    neg = np.array([[9, 2], [40, 5]], dtype=np.int32)
    sw.beforeForwardPass(pos, neg)
    flat = np.concatenate([pos.reshape(-1), neg.reshape(-1)])
    w = emb.weight.detach().cpu()
    # the dummies address the rows of their ids
    _close(w[torch.from_numpy(pos_d)], table[pos])
    _close(w[torch.from_numpy(neg_d)], table[neg])
    _close(w[: flat.size], table[flat], rtol=0, atol=0)
    # a hand edit under no_grad is written back by afterOptimizerStep (last copy wins)
    with torch.no_grad():
        emb.weight[: flat.size] = torch.arange(flat.size, dtype=torch.float32)[:, None].to(
            emb.weight.device
        )
    sw.afterOptimizerStep(pos, neg)
    expect = table.copy()
    for k, row in enumerate(flat):
        expect[row] = k
    np.testing.assert_array_equal(sw.getNumpyVersion(), expect)


@pytest.mark.parametrize("no_grad", [False, True], ids=["grad", "no_grad"])
def test_adamax_through_pytorch_factories_equals_lazy_adamax(device, no_grad):
    """SpeedTorch's README guide: Adamax (no sparse support in torch) for embeddings, with
    ``sparse=False`` since every row of the variable is updated each step; here through the
    Pytorch factories with SpeedTorch's defaults (``deviceType='cuda'``, ``torch.float``)."""
    torch.manual_seed(1)
    model = Lit2VecSkipGram(B * (P + K), sparse=False).to(device)
    optimizer = torch.optim.Adamax(model.parameters(), lr=0.05)
    switching = torch.no_grad if no_grad else contextlib.nullcontext
    u = gl.PytorchModelFactory(model.u_embeddings, N, D, torch.float)
    v = gl.PytorchModelFactory(model.v_embeddings, N, D, datatype=torch.float)
    u.uniformDistributionInit(-0.5, 0.5)
    v.normalDistributionInit(0, 0.3)
    uo = gl.PytorchOptimizerFactory(optimizer, N, D, model, "u_embeddings", dtype="float32")
    vo = gl.PytorchOptimizerFactory(optimizer, N, D, model, "v_embeddings", torch.float)
    uo.optInit()
    vo.optInit()
    du = torch.from_numpy(u.variableTransformer(B, 1))
    dp, dn = (torch.from_numpy(x) for x in v.variableTransformer(B, P, K))
    dev = model.u_embeddings.weight.device
    targets = torch.ones(B, P + K)
    fn = nn.BCEWithLogitsLoss(reduction="none")
    # lazy Adamax reference: the whole tables, only each step's rows updated, one step count
    tables = {
        "u": torch.from_numpy(u.getNumpyVersion().copy()),
        "v": torch.from_numpy(v.getNumpyVersion().copy()),
    }
    states = {k: {"exp_avg": torch.zeros(N, D), "exp_inf": torch.zeros(N, D)} for k in tables}
    rng = np.random.default_rng(5)
    for step in range(1, 5):
        batch, labels, negz = _distinct_batch(rng)
        with switching():
            u.beforeForwardPass(labels)
            v.beforeForwardPass(batch, negz)
            uo.beforeForwardPass(labels)
            vo.beforeForwardPass(batch, negz)
        loss = model(du.to(dev), dp.to(dev), dn.to(dev), targets.to(dev))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with switching():
            u.afterOptimizerStep(labels)
            v.afterOptimizerStep(batch, negz)
            uo.afterOptimizerStep(labels)
            vo.afterOptimizerStep(batch, negz)
        ids = {
            "u": torch.from_numpy(labels.reshape(-1)).long(),
            "v": torch.from_numpy(np.concatenate([batch.reshape(-1), negz.reshape(-1)])).long(),
        }
        small = {k: nn.Parameter(tables[k][ids[k]].clone()) for k in tables}
        ref = torch.optim.Adamax(list(small.values()), lr=0.05)
        for k, p in small.items():
            ref.state[p] = {
                "step": torch.tensor(float(step - 1)),
                **{s: t[ids[k]].clone() for s, t in states[k].items()},
            }
        rl = _lit2vec_loss(small["u"][du], small["v"][dp], small["v"][dn], targets, fn)
        rl.backward()
        ref.step()
        assert loss.item() == pytest.approx(rl.item(), rel=1e-5)
        for k, p in small.items():
            tables[k][ids[k]] = p.detach()
            for s in states[k]:
                states[k][s][ids[k]] = ref.state[p][s]
    _close(u.getNumpyVersion(), tables["u"])
    _close(v.getNumpyVersion(), tables["v"])
    for name, sw in (("u", uo), ("v", vo)):
        got = sw.getNumpyVersion()
        assert sorted(got) == ["exp_avg", "exp_inf"]
        for s in got:
            _close(got[s], states[name][s])


def test_rprop_switchers_built_after_a_first_backward_as_speedtorch_required(device):
    """SpeedTorch: 'Rprop ... needs the first forward pass, and loss.backward() step to be
    completed for initializing the OptimizerFactory instance'. That order must still work,
    and the state must start as torch starts it (prev 0, step_size lr)."""
    torch.manual_seed(2)
    model = Lit2VecSkipGram(B * (P + K), sparse=False).to(device)
    optimizer = torch.optim.Rprop(model.parameters(), lr=0.01)
    u = gl.ModelFactory(model.u_embeddings, N, D)
    v = gl.ModelFactory(model.v_embeddings, N, D)
    u.normalDistributionInit(0, 0.5)
    v.normalDistributionInit(0, 0.5)
    du = torch.from_numpy(u.variableTransformer(B, 1))
    dp, dn = (torch.from_numpy(x) for x in v.variableTransformer(B, P, K))
    dev = model.u_embeddings.weight.device
    targets = torch.ones(B, P + K, device=dev)
    rng = np.random.default_rng(9)
    batch, labels, negz = _distinct_batch(rng)
    u.beforeForwardPass(labels)
    v.beforeForwardPass(batch, negz)
    model(du.to(dev), dp.to(dev), dn.to(dev), targets).backward()  # the warm-up SpeedTorch needed
    uo = gl.OptimizerFactory(optimizer, N, D, model, "u_embeddings", "float32", True)
    vo = gl.OptimizerFactory(optimizer, N, D, model, "v_embeddings", "float32", True)
    uo.optInit()
    vo.optInit()
    for sw in (uo, vo):
        st = sw.getNumpyVersion()
        np.testing.assert_array_equal(st["prev"], np.zeros((N, D), np.float32))
        np.testing.assert_allclose(st["step_size"], np.full((N, D), 0.01, np.float32))
    # two steps with distinct ids: dense Rprop over the whole tables updates the same rows
    # the same way (a row without gradient keeps its value there)
    ru = nn.Parameter(torch.from_numpy(u.getNumpyVersion().copy()))
    rv = nn.Parameter(torch.from_numpy(v.getNumpyVersion().copy()))
    ropt = torch.optim.Rprop([ru, rv], lr=0.01)
    fn = nn.BCEWithLogitsLoss(reduction="none")
    for _ in range(2):
        batch, labels, negz = _distinct_batch(rng)
        u.beforeForwardPass(labels)
        v.beforeForwardPass(batch, negz)
        uo.beforeForwardPass(labels)
        vo.beforeForwardPass(batch, negz)
        optimizer.zero_grad()
        model(du.to(dev), dp.to(dev), dn.to(dev), targets).backward()
        optimizer.step()
        u.afterOptimizerStep(labels)
        v.afterOptimizerStep(batch, negz)
        uo.afterOptimizerStep(labels)
        vo.afterOptimizerStep(batch, negz)
        ropt.zero_grad()
        tl = torch.from_numpy(labels).long()
        _lit2vec_loss(
            ru[tl],
            rv[torch.from_numpy(batch).long()],
            rv[torch.from_numpy(negz).long()],
            targets.cpu(),
            fn,
        ).backward()
        ropt.step()
    _close(u.getNumpyVersion(), ru)
    _close(v.getNumpyVersion(), rv)


def test_sgd_tables_split_between_gpu_tensor_and_pinned_switchers_without_optimizer_switchers(
    device,
):
    """SpeedTorch's best practice 3 (Research2Vec2): one table as a Pytorch cuda tensor, the
    other pinned, SGD (no optimizer state, so no optimizer switchers)."""
    torch.manual_seed(4)
    model = Lit2VecSkipGram(B * (P + K)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    u = gl.PytorchModelFactory(model.u_embeddings, N, D, deviceType="cuda")
    v = gl.ModelFactory(model.v_embeddings, N, D, CPUPinn=True)
    u.customInit(torch.nn.init.xavier_uniform_)
    v.normalDistributionInit(0, 0.1)
    du = torch.from_numpy(u.variableTransformer(B, 1))
    dp, dn = (torch.from_numpy(x) for x in v.variableTransformer(B, P, K))
    dev = model.u_embeddings.weight.device
    targets = torch.ones(B, P + K)
    ru = nn.Embedding(N, D, sparse=True)
    rv = nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        ru.weight.copy_(torch.from_numpy(u.getNumpyVersion()))
        rv.weight.copy_(torch.from_numpy(v.getNumpyVersion()))
    bound = math.sqrt(6.0 / (N + D))  # xavier on an (N, D) tensor
    assert np.abs(u.getNumpyVersion()).max() <= bound
    assert np.abs(u.getNumpyVersion()).max() > 0.9 * bound
    ropt = torch.optim.SGD([ru.weight, rv.weight], lr=0.5)
    fn = nn.BCEWithLogitsLoss(reduction="none")
    rng = np.random.default_rng(21)
    for _ in range(3):
        batch, labels, negz = _distinct_batch(rng)
        u.beforeForwardPass(labels)
        v.beforeForwardPass(batch, negz)
        optimizer.zero_grad()
        model(du.to(dev), dp.to(dev), dn.to(dev), targets.to(dev)).backward()
        optimizer.step()
        u.afterOptimizerStep(labels)
        v.afterOptimizerStep(batch, negz)
        ropt.zero_grad()
        _lit2vec_loss(
            ru(torch.from_numpy(labels).long()),
            rv(torch.from_numpy(batch).long()),
            rv(torch.from_numpy(negz).long()),
            targets,
            fn,
        ).backward()
        ropt.step()
    _close(u.getNumpyVersion(), ru.weight)
    _close(v.getNumpyVersion(), rv.weight)


FACTORIES = {
    "ModelFactory": lambda emb, dt: gl.ModelFactory(emb, N * 40, D, dt),
    "ModelFactory-pinned": lambda emb, dt: gl.ModelFactory(
        model_variable=emb, total_classes=N * 40, embed_dimension=D, datatype=dt, CPUPinn=True
    ),
    "PytorchModelFactory": lambda emb, dt: gl.PytorchModelFactory(emb, N * 40, D, dt),
    "PytorchModelFactory-cpu-pinned": lambda emb, dt: gl.PytorchModelFactory(
        emb, N * 40, D, datatype=dt, deviceType="cpu", pinType=True
    ),
}


@pytest.mark.parametrize("factory", sorted(FACTORIES))
@pytest.mark.parametrize(
    ("dt", "np_dtype"),
    [
        ("float32", np.float32),
        ("float16", np.float16),
        ("float64", np.float64),
        (torch.float, np.float32),
        (torch.float16, np.float16),
    ],
    ids=["float32", "float16", "float64", "torch.float", "torch.float16"],
)
def test_initialisers_draw_speedtorch_distributions(factory, dt, np_dtype):
    sw = FACTORIES[factory](nn.Embedding(2, D), dt)
    sw.uniformDistributionInit(-0.3, 0.7)
    a = np.asarray(sw.getNumpyVersion())
    assert a.dtype == np_dtype and a.shape == (N * 40, D)
    a = a.astype(np.float64)
    assert a.min() >= -0.3 - 1e-3 and a.max() <= 0.7 + 1e-3
    assert abs(a.mean() - 0.2) < 0.01  # 40960 draws: sd of the mean ~0.0014
    assert abs(a.std() - 1.0 / math.sqrt(12)) < 0.01
    sw.normalDistributionInit(2.0, 0.5)  # (mean, stdDev): a standard deviation, not a variance
    b = np.asarray(sw.getNumpyVersion()).astype(np.float64)
    assert abs(b.mean() - 2.0) < 0.02 and abs(b.std() - 0.5) < 0.02
    sw.zerosInit()
    assert not np.asarray(sw.getNumpyVersion()).any()


def test_custom_init_passes_its_args_like_speedtorch():
    """``customInit(initFunction, *args)`` calls ``initFunction(table, *args)``."""
    sw = gl.PytorchModelFactory(nn.Embedding(2, D), N, D, torch.float, "cpu", False)
    sw.customInit(torch.nn.init.constant_, 0.25)
    np.testing.assert_array_equal(sw.getNumpyVersion(), np.full((N, D), 0.25, np.float32))
    sw.customInit(torch.nn.init.uniform_, -2.0, -1.0)
    t = sw.getNumpyVersion()
    assert t.min() >= -2.0 and t.max() <= -1.0 and t.std() > 0.2
    sw.customInit(torch.nn.init.eye_)
    np.testing.assert_array_equal(sw.getNumpyVersion(), np.eye(N, D, dtype=np.float32))
    sw.customInit(torch.nn.init.xavier_uniform_, 3.0)  # gain
    bound = 3.0 * math.sqrt(6.0 / (N + D))
    t = np.abs(sw.getNumpyVersion())
    assert t.max() <= bound and t.max() > 0.9 * bound


def test_factory_signatures_keep_speedtorch_argument_order():
    """Positional SpeedTorch calls depend on the order of the arguments."""
    want = {
        gl.ModelFactory: [
            "model_variable",
            "total_classes",
            "embed_dimension",
            "datatype",
            "CPUPinn",
        ],
        gl.OptimizerFactory: [
            "given_optimizer",
            "total_classes",
            "embed_dimension",
            "model",
            "variable_name",
            "dtype",
            "CPUPinn",
        ],
        gl.PytorchModelFactory: [
            "model_variable",
            "total_classes",
            "embed_dimension",
            "datatype",
            "deviceType",
            "pinType",
        ],
        gl.PytorchOptimizerFactory: [
            "given_optimizer",
            "total_classes",
            "embed_dimension",
            "model",
            "variable_name",
            "dtype",
            "deviceType",
            "pinType",
        ],
        gl.DataGadget: ["fileName", "CPUPinn"],
    }
    for cls, names in want.items():
        params = [
            p
            for p in inspect.signature(cls).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        assert [p.name for p in params] == names, cls
    assert list(inspect.signature(gl.DataGadget.getData).parameters)[1] == "indexes"
    assert list(inspect.signature(gl.DataGadget.insertData).parameters)[1:3] == [
        "dataObject",
        "indexes",
    ]
    for m in ("beforeForwardPass", "afterOptimizerStep"):
        for cls in (gl.ModelFactory, gl.OptimizerFactory):
            assert list(inspect.signature(getattr(cls, m)).parameters)[1:] == [
                "retrievedPosIndexes",
                "retrievedNegIndexes",
            ]


# ---------------------------------------------------------------- DataGadget, as scripts used it


@pytest.mark.parametrize("pinned", [True, False], ids=["CPUPinn=True", "CPUPinn=False"])
def test_datagadget_from_saved_npy_file(tmp_path, monkeypatch, device, pinned):
    monkeypatch.chdir(tmp_path)
    sampl = np.random.default_rng(0).uniform(low=-1.0, high=1.0, size=(6, 3))
    np.save("data.npy", sampl)
    g = gl.DataGadget("data.npy", pinned)
    g.gadgetInit()
    idx = np.array([[5, 0], [2, 2]], dtype=np.int32)
    out = g.getData(idx)
    assert out.dtype == torch.float64 and tuple(out.shape) == (2, 2, 3)
    np.testing.assert_array_equal(out.cpu().numpy(), sampl[idx])
    np.testing.assert_array_equal(g.getData(indexes=[4, 1]).cpu().numpy(), sampl[[4, 1]])
    np.testing.assert_array_equal(g.getData(torch.tensor([3])).cpu().numpy(), sampl[[3]])
    np.testing.assert_array_equal(g.getData(2).cpu().numpy(), sampl[2])
    # into a float32 torch variable, as the scripts did (xgpu[:] = ...)
    xgpu = torch.zeros(2, 3, device=device)
    xgpu[:] = g.getData(indexes=np.array([1, 4]))
    np.testing.assert_array_equal(xgpu.cpu().numpy(), sampl[[1, 4]].astype(np.float32))
    # the result is a copy (SpeedTorch's integer-array indexing copies)
    out.add_(100.0)
    np.testing.assert_array_equal(g.getNumpyVersion(), sampl)
    # insertData from a GPU tensor with repeated ids: sequential assignment, the last wins
    rows = torch.arange(12, dtype=torch.float64, device=device).reshape(4, 3)
    ids = np.array([0, 3, 0, 5])
    g.insertData(dataObject=rows, indexes=ids)
    expect = sampl.copy()
    expect[ids] = rows.cpu().numpy()
    np.testing.assert_array_equal(g.getNumpyVersion(), expect)
    g.saveCupy("out")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expect)
    g.saveCupy("same.npy")  # numpy.save's names: no second .npy, a Path gets one too
    g.saveCupy(tmp_path / "viapath")
    assert (tmp_path / "same.npy").is_file() and not (tmp_path / "same.npy.npy").exists()
    np.testing.assert_array_equal(np.load(tmp_path / "viapath.npy"), expect)
    # SpeedTorch's loadCupy replaced the table with the file, whatever its shape
    other = gl.DataGadget(np.zeros((2, 2)), CPUPinn=pinned)
    other.gadgetInit()
    other.loadCupy("out.npy")
    assert tuple(other.shape) == (6, 3)
    np.testing.assert_array_equal(other.getNumpyVersion(), expect)
    np.testing.assert_array_equal(other.getData([5]).cpu().numpy(), expect[[5]])


# DEFECT: the DataGadget transfer scripts written for SpeedTorch index with slices, which
# SpeedTorch passed straight to CuPy (``CUPYcorpus[indexes]``); gadgetloader refuses them.
def test_datagadget_transfer_script_with_slice_indexes(device):
    data = np.random.default_rng(1).random((6, 3))
    cpu_pinned1 = gl.DataGadget(data, CPUPinn=True)
    cpu_pinned1.gadgetInit()
    xgpu = torch.zeros(6, 3, dtype=torch.float64, device=device)
    xgpu[:] = cpu_pinned1.getData(indexes=(slice(0, 6), slice(0, 3)))
    np.testing.assert_array_equal(xgpu.cpu().numpy(), data)
    cpu_pinned2 = gl.DataGadget(np.zeros((6, 3)), CPUPinn=True)
    cpu_pinned2.gadgetInit()
    cpu_pinned2.insertData(dataObject=xgpu, indexes=(slice(0, 6), slice(0, 3)))
    np.testing.assert_array_equal(cpu_pinned2.getNumpyVersion(), data)


# DEFECT: a row range as a slice (``g.getData(slice(a, b))`` is ``table[a:b]`` in SpeedTorch)
# is refused with GadgetTypeError.
def test_datagadget_row_slice_as_indexes():
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    g = gl.DataGadget(data, CPUPinn=False)
    np.testing.assert_array_equal(g.getData(slice(2, 5)).cpu().numpy(), data[2:5])
    g.insertData(torch.zeros(3, 3), slice(5, 8))
    expect = data.copy()
    expect[5:8] = 0
    np.testing.assert_array_equal(g.getNumpyVersion(), expect)


def test_datagadget_insert_of_other_dtype_is_refused_clearly_and_changes_nothing():
    """The first transfer script inserted a float32 tensor into a float64 table (CuPy cast
    it). gadgetloader documents a refusal instead (README: 'insertData wants the table's
    dtype exactly ... an error that says so'): it must name both dtypes and write nothing."""
    empty = np.zeros((6, 3))
    g = gl.DataGadget(empty, CPUPinn=True)
    g.gadgetInit()
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.insertData(dataObject=torch.ones(6, 3), indexes=np.arange(6))
    assert "float64" in str(ei.value) and "float32" in str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), empty)


# ----------------------------------------------------------- saves and loads, SpeedTorch's files


def test_model_factory_resumes_from_save_cupy_without_an_initialiser(tmp_path, device):
    """A new session: ``loadCupy`` alone set SpeedTorch's table (no init call before it)."""
    emb = nn.Embedding(3, D)
    sw = gl.ModelFactory(emb, N, D)
    sw.normalDistributionInit(0, 1)
    sw.saveCupy(str(tmp_path / "u"))  # numpy.save: u.npy
    saved = np.load(tmp_path / "u.npy")
    np.testing.assert_array_equal(saved, sw.getNumpyVersion())
    emb2 = nn.Embedding(3, D).to(device)
    sw2 = gl.ModelFactory(emb2, N, D)
    sw2.loadCupy(str(tmp_path / "u.npy"))
    np.testing.assert_array_equal(sw2.getNumpyVersion(), saved)
    sw2.variableTransformer(3, 1)
    ids = np.array([[7], [0], [63]])
    sw2.beforeForwardPass(ids)
    _close(emb2.weight[:3], saved[ids.reshape(-1)], rtol=0, atol=0)
    with torch.no_grad():
        emb2.weight.mul_(2.0)
    sw2.afterOptimizerStep(ids)
    expect = saved.copy()
    expect[[7, 0, 63]] *= 2.0
    np.testing.assert_array_equal(sw2.getNumpyVersion(), expect)


@pytest.mark.parametrize("deviceType", ["cuda", "cpu"])
def test_pytorch_model_factory_torch_files_are_speedtorch_files(tmp_path, deviceType):
    """``saveTorch`` was ``torch.save(tensor)``: a file ``torch.load`` gives back as the
    table; ``loadTorch`` read such a file."""
    sw = gl.PytorchModelFactory(nn.Embedding(2, D), N, D, deviceType=deviceType)
    sw.uniformDistributionInit(-1, 1)
    sw.saveTorch(str(tmp_path / "u.pt"))
    obj = torch.load(str(tmp_path / "u.pt"), map_location="cpu", weights_only=True)
    assert torch.is_tensor(obj)
    np.testing.assert_array_equal(obj.numpy(), sw.getNumpyVersion())
    written = torch.randn(N, D, dtype=torch.float32, device="cpu")
    torch.save(written, str(tmp_path / "speedtorch.pt"))
    sw.loadTorch(str(tmp_path / "speedtorch.pt"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), written.numpy())


def test_pytorch_optimizer_factory_loads_speedtorch_state_list(tmp_path):
    """SpeedTorch's optimizer ``saveTorch`` wrote a list of state tables in its state order
    (Adam: exp_avg, exp_avg_sq); the README says such a file loads."""
    model = Lit2VecSkipGram(4, sparse=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    uo = gl.PytorchOptimizerFactory(optimizer, N, D, model, "u_embeddings", deviceType="cpu")
    uo.optInit()
    m = torch.rand(N, D)
    v = torch.rand(N, D)
    torch.save([m, v], str(tmp_path / "uAdam.pt"))
    uo.loadTorch(str(tmp_path / "uAdam.pt"))
    got = uo.getNumpyVersion()
    np.testing.assert_array_equal(got["exp_avg"], m.numpy())
    np.testing.assert_array_equal(got["exp_avg_sq"], v.numpy())
    uo.saveTorch(str(tmp_path / "again.pt"))
    back = torch.load(str(tmp_path / "again.pt"), map_location="cpu", weights_only=True)
    np.testing.assert_array_equal(back["exp_avg"].numpy(), m.numpy())
    np.testing.assert_array_equal(back["exp_avg_sq"].numpy(), v.numpy())
