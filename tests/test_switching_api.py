"""SpeedTorch's switcher names and protocol, duplicates semantics, errors, and a
property test against a dense full-table parameter."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gadgetloader as gl
from gadgetloader._device import _reset_fallback_warnings
from gadgetloader.switching import ModelSwitch, OptimizerSwitch

N, D, B, NEG = 50, 4, 6, 3
HAS_CUDA = torch.cuda.is_available()


class SkipGram(nn.Module):
    """SpeedTorch's word2vec model: batch-sized embeddings fed dummy inputs."""

    def __init__(self, device) -> None:
        super().__init__()
        self.u_embeddings = nn.Embedding(B, D).to(device)
        self.v_embeddings = nn.Embedding(B * (1 + NEG), D).to(device)

    def forward(self, u_in, pos_in, neg_in):
        u = self.u_embeddings(u_in).squeeze(1)
        pos = (u * self.v_embeddings(pos_in).squeeze(1)).sum(-1)
        neg = torch.bmm(self.v_embeddings(neg_in), u.unsqueeze(2)).squeeze(2)
        return -(F.logsigmoid(pos).sum() + F.logsigmoid(-neg).sum())


def _speedtorch_loop(placement, device, batches, opt_cls, kw, *, merge: bool):
    """Run SpeedTorch's loop (dummy inputs) or the merged-duplicates loop (local ids)."""
    torch.manual_seed(0)
    model = SkipGram(device)
    opt = opt_cls(model.parameters(), **kw)
    u_sw = gl.ModelFactory(model.u_embeddings, N, D, placement=placement)
    v_sw = gl.PytorchModelFactory(model.v_embeddings, N, D, placement=placement)
    g = torch.Generator().manual_seed(1)
    u0, v0 = torch.rand(N, D, generator=g) - 0.5, torch.rand(N, D, generator=g) - 0.5
    u_sw.customInit(lambda t: t.copy_(u0.to(t.device)))
    v_sw.customInit(lambda t: t.copy_(v0.to(t.device)))
    u_opt = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement=placement)
    v_opt = gl.PytorchOptimizerFactory(opt, N, D, model, "v_embeddings", placement=placement)
    u_opt.optInit()
    v_opt.optInit()
    if not merge:
        u_in = torch.LongTensor(u_sw.variableTransformer(B, 1)).to(device)  # SpeedTorch's idiom
        pos_np, neg_np = v_sw.variableTransformer(B, 1, NEG)
        pos_in, neg_in = torch.from_numpy(pos_np).to(device), torch.from_numpy(neg_np).to(device)
    for center, ctx, neg in batches:
        lu = u_sw.beforeForwardPass(center)
        lpos, lneg = v_sw.beforeForwardPass(ctx, neg)
        u_opt.beforeForwardPass(center)
        v_opt.beforeForwardPass(ctx, neg)
        opt.zero_grad()
        if merge:
            model(lu, lpos, lneg).backward()
        else:
            model(u_in, pos_in, neg_in).backward()
        opt.step()
        u_sw.afterOptimizerStep(center)
        v_sw.afterOptimizerStep(ctx, neg)
        u_opt.afterOptimizerStep(center)
        v_opt.afterOptimizerStep(ctx, neg)
    return u_sw, v_sw, u_opt, v_opt


def _w2v_batches(device, steps=4, repeats=False, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if repeats:
            center = torch.randint(0, N, (B, 1), generator=g)
            ctx = torch.randint(0, N, (B, 1), generator=g)
            neg = torch.randint(0, N, (B, NEG), generator=g)
            ctx[0, 0] = neg[1, 2]
        else:  # all ids of the v table distinct, as SpeedTorch's protocol needs
            perm = torch.randperm(N, generator=g)
            center = perm[:B].view(B, 1)
            perm = torch.randperm(N, generator=g)
            ctx, neg = perm[:B].view(B, 1), perm[B : B * (1 + NEG)].view(B, NEG)
        out.append((center.to(device), ctx.to(device), neg.to(device)))
    return out


@pytest.mark.parametrize(
    ("name", "kw"), [("Adam", {"lr": 0.05}), ("Rprop", {"lr": 0.01}), ("Adamax", {"lr": 0.05})]
)
def test_speedtorch_dummy_input_protocol_unchanged(placement, device, name, kw):
    """Without repeated ids, SpeedTorch's dummy-input loop equals the exact (merged) loop."""
    batches = _w2v_batches(device)
    old = _speedtorch_loop(placement, device, batches, getattr(torch.optim, name), kw, merge=False)
    new = _speedtorch_loop(placement, device, batches, getattr(torch.optim, name), kw, merge=True)
    assert old[0].duplicates == "separate" and new[0].duplicates == "merge"
    for a, b in zip(old[:2], new[:2], strict=False):
        torch.testing.assert_close(
            torch.from_numpy(a.getNumpyVersion()),
            torch.from_numpy(b.getNumpyVersion()),
            rtol=1e-6,
            atol=1e-7,
        )
    for a, b in zip(old[2:], new[2:], strict=False):
        for key in a.tables:
            torch.testing.assert_close(
                torch.from_numpy(a.tables[key].getNumpyVersion()),
                torch.from_numpy(b.tables[key].getNumpyVersion()),
            )


def test_variable_transformer_shapes(device):
    emb = nn.Embedding(1, D).to(device)
    sw = ModelSwitch(emb, N, D, placement="cpu")
    pos, neg = sw.variableTransformer(3, 2, 4)
    assert pos.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert neg.shape == (3, 4) and neg[0, 0] == 6 and neg[-1, -1] == 17
    assert isinstance(pos, np.ndarray) and pos.dtype == np.int64  # as SpeedTorch returned them
    assert (
        torch.LongTensor(pos).tolist() == pos.tolist()
    )  # old `torch.LongTensor(dummy)` code works
    assert sw.variableTransformer(2, 3).shape == (2, 3)


def test_separate_duplicates_last_write_wins(placement, device):
    """The documented caveat of the dummy-input protocol: each copy of a repeated id is
    updated separately and the copy written back last wins."""
    emb = nn.Embedding(1, D).to(device)
    sw = ModelSwitch(emb, N, D, placement=placement, duplicates="separate")
    sw.customInit(lambda t: t.copy_(torch.arange(N * D, dtype=t.dtype, device=t.device).view(N, D)))
    opt = torch.optim.SGD([emb.weight], lr=1.0)
    ids = torch.tensor([7, 3, 7], device=device)
    local = sw.beforeForwardPass(ids)
    assert local.tolist() == [0, 1, 2] and emb.weight.shape == (3, D)
    scale = torch.tensor([1.0, 2.0, 3.0], device=device).unsqueeze(1)
    (emb(local) * scale).sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    table = torch.from_numpy(sw.getNumpyVersion())
    start = torch.arange(N * D, dtype=torch.float32).view(N, D)
    assert torch.equal(table[7], start[7] - 3.0)  # the last copy's update only (merged: -4.0)
    assert torch.equal(table[3], start[3] - 2.0)
    merged = ModelSwitch(nn.Embedding(1, D).to(device), N, D, placement=placement)
    merged.customInit(lambda t: t.copy_(start.to(t.device)))
    opt2 = torch.optim.SGD([merged.param], lr=1.0)
    local = merged.beforeForwardPass(ids)
    assert local.tolist() == [1, 0, 1]
    (F.embedding(local, merged.param) * scale).sum().backward()
    opt2.step()
    merged.afterOptimizerStep(ids)
    assert torch.equal(torch.from_numpy(merged.getNumpyVersion())[7], start[7] - 4.0)


def test_rprop_needs_no_warmup_step(device):
    model = SkipGram(device)
    opt = torch.optim.Rprop(model.parameters(), lr=0.02)
    sw = gl.OptimizerFactory(opt, N, D, model, "u_embeddings", placement="cpu")
    sw.optInit()  # SpeedTorch needed one training step before this
    assert set(sw.tables) == {"prev", "step_size"}
    assert np.all(sw.tables["step_size"].getNumpyVersion() == np.float32(0.02))
    assert np.all(sw.tables["prev"].getNumpyVersion() == 0)


def test_state_tables_follow_the_optimizer(device):
    model = SkipGram(device)
    cases = {
        torch.optim.Adam(model.parameters(), amsgrad=True): {
            "exp_avg",
            "exp_avg_sq",
            "max_exp_avg_sq",
        },
        torch.optim.RMSprop(model.parameters(), momentum=0.9, centered=True): {
            "square_avg",
            "momentum_buffer",
            "grad_avg",
        },
        torch.optim.ASGD(model.parameters()): {"ax"},
        torch.optim.Adagrad(model.parameters(), initial_accumulator_value=0.5): {"sum"},
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9): {"momentum_buffer"},
        torch.optim.SGD(model.parameters(), lr=0.1): set(),
    }
    for opt, keys in cases.items():
        sw = OptimizerSwitch(opt, N, D, model, "u_embeddings", placement="cpu")
        sw.optInit()
        assert set(sw.tables) == keys, type(opt).__name__
        if isinstance(opt, torch.optim.Adagrad):
            assert np.all(sw.tables["sum"].getNumpyVersion() == np.float32(0.5))
        if isinstance(opt, torch.optim.ASGD):
            st_ = opt.state[model.u_embeddings.weight]
            assert (
                float(st_["eta"]) == pytest.approx(opt.defaults["lr"]) and float(st_["mu"]) == 1.0
            )


def test_factory_placements():
    emb = nn.Embedding(2, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        expect_cuda = "cuda" if HAS_CUDA else "cpu"
        assert gl.ModelFactory(emb, N, D).placement == expect_cuda
        assert gl.PytorchModelFactory(emb, N, D, deviceType="cuda").placement == expect_cuda
    assert gl.PytorchModelFactory(emb, N, D, deviceType="cpu").placement == "cpu"
    assert gl.ModelFactory(emb, N, D, "float64", placement="cpu").table.dtype == torch.float64
    assert gl.PytorchModelFactory(emb, N, D, torch.float16, "cpu").table.dtype == torch.float16
    if not HAS_CUDA:
        _reset_fallback_warnings()
        with pytest.warns(gl.FallbackWarning):
            gl.ModelFactory(emb, N, D, CPUPinn=True)
    with pytest.raises(gl.GadgetValueError, match="deviceType"):
        gl.PytorchModelFactory(emb, N, D, deviceType="tpu")


def test_bad_input_errors(device):
    model = SkipGram(device)
    sw = gl.ModelFactory(model.u_embeddings, N, D, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion()
    with pytest.raises(gl.GadgetIndexError, match="out of range"):
        sw.beforeForwardPass(torch.tensor([0, N]))
    with pytest.raises(gl.GadgetIndexError, match="negative"):
        sw.beforeForwardPass([-1])
    with pytest.raises(gl.GadgetTypeError):
        sw.beforeForwardPass(torch.tensor([0.5]))
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)
    with pytest.raises(gl.GadgetTypeError, match="SparseAdam, Adam"):
        gl.OptimizerFactory(torch.optim.LBFGS(model.parameters()), N, D, model, "u_embeddings")
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(gl.GadgetKeyError, match="u_embeddings"):
        gl.OptimizerFactory(adam, N, D, model, "u_embedding", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="embed_dimension"):
        gl.OptimizerFactory(adam, N, D + 1, model, "u_embeddings", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="embed_dimension"):
        gl.ModelFactory(model.u_embeddings, N, D + 1, placement="cpu")
    osw = gl.OptimizerFactory(adam, N, D, model, "u_embeddings", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="optInit"):
        osw.beforeForwardPass(torch.tensor([1]))
    other = torch.optim.Adam(nn.Linear(2, 2).parameters())
    with pytest.raises(gl.GadgetKeyError, match="not among the optimizer's parameters"):
        gl.OptimizerFactory(other, N, D, model, "u_embeddings", placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="model_variable"):
        gl.ModelFactory(nn.ReLU(), N, D, placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="duplicates"):
        ModelSwitch(model.u_embeddings, N, D, placement="cpu", duplicates="sum")
    sw.beforeForwardPass(torch.tensor([1, 2, 3]))
    with pytest.raises(gl.GadgetValueError, match="same ids"):
        sw.afterOptimizerStep(torch.tensor([1, 2]))
    sw.afterOptimizerStep(torch.tensor([1, 2, 3]))  # equal values, other tensor: fine


def test_save_and_load_tables(tmp_path, device):
    emb = nn.Embedding(1, D).to(device)
    sw = gl.PytorchModelFactory(emb, N, D, placement="cpu")
    sw.normalDistributionInit(0.0, 2.0)
    ref = sw.getNumpyVersion()
    sw.saveCupy(tmp_path / "t.npy")
    sw.saveTorch(tmp_path / "t.pt")
    sw.zerosInit()
    assert not sw.getNumpyVersion().any()
    sw.loadCupy(tmp_path / "t.npy")
    np.testing.assert_array_equal(sw.getNumpyVersion(), ref)
    sw.zerosInit()
    sw.loadTorch(tmp_path / "t.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), ref)
    np.save(tmp_path / "small.npy", np.zeros((3, D), np.float32))
    with pytest.raises(gl.GadgetValueError, match="expected"):
        sw.loadCupy(tmp_path / "small.npy")
    np.testing.assert_array_equal(sw.getNumpyVersion(), ref)  # unchanged after the error
    sw.customInit(torch.nn.init.xavier_uniform_)
    assert np.abs(sw.getNumpyVersion()).max() <= np.sqrt(6 / (N + D)) + 1e-6


@settings(max_examples=30, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=10), min_size=1, max_size=6),
    momentum=st.sampled_from([0.0, 0.9]),
)
def test_property_switcher_equals_dense_parameter(batches, momentum):
    """Any id sequence (repeats, empty overlaps, ...): SGD through the switcher equals a
    dense full-table parameter -- bit for bit without momentum."""
    n = 12
    init = torch.linspace(-1, 1, n * D).view(n, D)
    W = nn.Parameter(init.clone())
    ref_opt = torch.optim.SGD([W], lr=0.1, momentum=momentum)
    emb = nn.Embedding(1, D)
    sw = ModelSwitch(emb, n, D, placement="cpu")
    sw.customInit(lambda t: t.copy_(init))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=momentum)
    osw = OptimizerSwitch(opt, n, D, nn.ModuleDict({"emb": emb}), "emb", placement="cpu")
    osw.optInit()
    for raw in batches:
        ids = torch.tensor(raw)
        w = torch.arange(1, len(raw) + 1, dtype=torch.float32).unsqueeze(1)
        ref_opt.zero_grad()
        (F.embedding(ids, W).sin() * w).sum().backward()
        if momentum:
            before = W.detach().clone()
            buf = ref_opt.state[W].get("momentum_buffer")
            buf_before = None if buf is None else buf.clone()
        ref_opt.step()
        if momentum:  # lazy: restore rows outside the batch
            with torch.no_grad():
                outside = torch.ones(n, dtype=torch.bool)
                outside[ids] = False
                W[outside] = before[outside]
                ref_opt.state[W]["momentum_buffer"][outside] = (
                    0.0 if buf_before is None else buf_before[outside]
                )
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        opt.zero_grad()
        (emb(local).sin() * w).sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
    got = torch.from_numpy(sw.getNumpyVersion())
    if momentum:
        torch.testing.assert_close(got, W.detach(), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, W.detach())


@pytest.mark.parametrize("name", ["Adam", "SparseAdam"])
def test_loss_kept_alive_between_steps(placement, device, name):
    """A loop that keeps `loss` (hence the last graph) alive while it builds the next one:
    the variable keeps its shape, whatever the number of distinct ids."""
    sparse = name == "SparseAdam"
    emb = nn.Embedding(B * (1 + NEG), D, sparse=sparse).to(device)
    opt = getattr(torch.optim, name)(emb.parameters(), lr=0.01)
    sw = gl.PytorchModelFactory(emb, N, D, placement=placement)
    osw = gl.PytorchOptimizerFactory(opt, N, D, nn.ModuleDict({"e": emb}), "e", placement=placement)
    osw.optInit()
    g = torch.Generator().manual_seed(3)
    loss = None
    for step in range(6):
        ctx = torch.randint(0, 10 if step % 2 else N, (B,), generator=g).to(
            device
        )  # few or many repeats
        neg = torch.randint(0, N, (B, NEG), generator=g).to(device)
        lp, ln = sw.beforeForwardPass(ctx, neg)
        osw.beforeForwardPass(ctx, neg)
        assert emb.weight.shape == (B * (1 + NEG), D)
        loss = emb(lp).pow(2).sum() + emb(ln).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sw.afterOptimizerStep(ctx, neg)
        osw.afterOptimizerStep(ctx, neg)
    assert loss is not None and np.isfinite(sw.getNumpyVersion()).all()
