"""Review (session 15): the drop-in training API (``OffloadedEmbedding``,
``OffloadedEmbeddingBag``, ``OffloadedOptimizer``) combined with the ordinary torch training
features a demanding user adds around it: several param groups mixing dense ``nn.Linear``
parameters and tables with per-group lambdas, gradient accumulation with
``zero_grad(set_to_none=False)``, ``torch.autocast`` around the forward, ``clip_grad_value_``,
torch's SWA tools (``SWALR``, ``AveragedModel``), ``copy.deepcopy`` / pickling in the middle of
training, forking a run (a copied model plus the optimizer's state dict), the ways torch users
name parameters in ``params`` (``emb.weight``, sets, ``model.parameters()``) and ``torch.nn.init``
on ``emb.weight``.

The reference is the same model with ``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` (dense)
trained by the same torch optimizer class; with plain SGD (no momentum, no weight decay) the
dense and the lazy per-row update are the same, so the comparison is exact on the CPU.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gadgetloader as gl

N, M, D = 50, 40, 8
CPU = torch.device("cpu")


def dev_of(placement: str) -> torch.device:
    return CPU if placement == "cpu" else torch.device("cuda")


def table(emb: nn.Module) -> torch.Tensor:
    """The full table of an offloaded or a plain embedding, as a CPU tensor."""
    w = emb.weight
    if isinstance(w, torch.Tensor):
        return w.detach().cpu().clone()
    return torch.as_tensor(w.getNumpyVersion()).clone()


def init_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.randn(M, D, generator=g)


class TwoTower(nn.Module):
    """An embedding, a bag (sum) and a linear head, offloaded or dense."""

    def __init__(self, offloaded: bool, placement: str = "cpu", seed: int = 0) -> None:
        super().__init__()
        dev = dev_of(placement)
        w, v = init_weights(seed)
        if offloaded:
            self.emb = gl.OffloadedEmbedding(N, D, placement=placement, device=dev)
            self.emb.weight.insertData(w.to(dev), torch.arange(N))
            self.bag = gl.OffloadedEmbeddingBag(M, D, "sum", placement=placement, device=dev)
            self.bag.weight.insertData(v.to(dev), torch.arange(M))
        else:
            self.emb = nn.Embedding(N, D).to(dev)
            self.bag = nn.EmbeddingBag(M, D, mode="sum").to(dev)
            with torch.no_grad():
                self.emb.weight.copy_(w)
                self.bag.weight.copy_(v)
        torch.manual_seed(seed + 1)
        self.head = nn.Linear(D, 1).to(dev)

    def forward(self, ids: torch.Tensor, hist: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids) * self.bag(hist)).squeeze(-1)


def batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, N, (6,), generator=g),
            torch.randint(0, M, (6, 3), generator=g),
            torch.randn(6, generator=g),
        )
        for _ in range(n)
    ]


def groups_of(m: TwoTower, offloaded: bool) -> list[dict]:
    if offloaded:
        return [
            {"params": m.emb, "lr": 0.3},
            {"params": m.bag, "lr": 0.1},
            {"params": m.head.parameters(), "lr": 0.05},
        ]
    return [
        {"params": m.emb.parameters(), "lr": 0.3},
        {"params": m.bag.parameters(), "lr": 0.1},
        {"params": m.head.parameters(), "lr": 0.05},
    ]


def all_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def train_step(m: nn.Module, opt: torch.optim.Optimizer, batch, dev: torch.device) -> None:
    ids, hist, y = batch
    opt.zero_grad()
    F.mse_loss(m(ids.to(dev), hist.to(dev)), y.to(dev)).backward()
    opt.step()


# ---------------------------------------------------------------------------------------------
# passing checks: the torch features combined, against the dense model
# ---------------------------------------------------------------------------------------------
def test_groups_lambdas_accumulation_autocast_clip_value_match_dense_sgd(placement):
    """Three param groups (table, bag, head) with their own lr and per-group LambdaLR
    lambdas, two accumulated micro-batches per step with ``zero_grad(set_to_none=False)``,
    the forward under ``torch.autocast`` (bfloat16), ``clip_grad_value_`` over the
    optimizer's groups before ``step()``: plain SGD gives the dense model's tables and head
    (exactly on the CPU)."""
    dev = dev_of(placement)
    # (on a GPU: bfloat16 matmuls, so a float32 rounding difference may show at bf16 scale)
    tol = {"rtol": 0.0, "atol": 0.0} if placement == "cpu" else {"rtol": 1e-3, "atol": 1e-4}
    off, ref = TwoTower(True, placement, seed=3), TwoTower(False, placement, seed=3)
    o_opt = gl.OffloadedOptimizer(torch.optim.SGD, groups_of(off, True))
    r_opt = torch.optim.SGD(groups_of(ref, False))
    lambdas = [lambda k: 1.0 / (k + 1), lambda k: 0.8**k, lambda k: 1.0 + k]
    o_s = torch.optim.lr_scheduler.LambdaLR(o_opt, lambdas)
    r_s = torch.optim.lr_scheduler.LambdaLR(r_opt, lambdas)
    data = batches(11, 10)
    for step in range(5):
        for m, opt in ((off, o_opt), (ref, r_opt)):
            opt.zero_grad(set_to_none=False)
            for ids, hist, y in data[2 * step : 2 * step + 2]:
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    pred = m(ids.to(dev), hist.to(dev))
                (F.mse_loss(pred.float(), y.to(dev)) / 2).backward()
            torch.nn.utils.clip_grad_value_(all_params(opt), 0.05)
            opt.step()
        o_s.step()
        r_s.step()
    assert [g["lr"] for g in o_opt.param_groups] == [g["lr"] for g in r_opt.param_groups]
    torch.testing.assert_close(table(off.emb), table(ref.emb), **tol)
    torch.testing.assert_close(table(off.bag), table(ref.bag), **tol)
    torch.testing.assert_close(off.head.weight.detach(), ref.head.weight.detach(), **tol)


def test_swalr_and_polynomial_lr_drive_the_tables_like_dense_sgd():
    """torch's SWA learning-rate schedule (``SWALR``, cosine anneal to ``swa_lr``) after a
    ``PolynomialLR`` phase, both stepping the wrapper: the tables get the dense model's
    updates (plain SGD, exact) and the groups the same lr."""
    from torch.optim.swa_utils import SWALR

    off, ref = TwoTower(True, seed=5), TwoTower(False, seed=5)
    o_opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.2)
    r_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    o_p = torch.optim.lr_scheduler.PolynomialLR(o_opt, total_iters=3, power=2.0)
    r_p = torch.optim.lr_scheduler.PolynomialLR(r_opt, total_iters=3, power=2.0)
    data = batches(12, 8)
    for batch in data[:3]:
        train_step(off, o_opt, batch, CPU)
        train_step(ref, r_opt, batch, CPU)
        o_p.step()
        r_p.step()
    o_swa = SWALR(o_opt, swa_lr=0.05, anneal_epochs=3)
    r_swa = SWALR(r_opt, swa_lr=0.05, anneal_epochs=3)
    for batch in data[3:]:
        train_step(off, o_opt, batch, CPU)
        train_step(ref, r_opt, batch, CPU)
        o_swa.step()
        r_swa.step()
    assert o_opt.param_groups[0]["lr"] == r_opt.param_groups[0]["lr"]
    torch.testing.assert_close(table(off.emb), table(ref.emb), rtol=0, atol=0)
    torch.testing.assert_close(table(off.bag), table(ref.bag), rtol=0, atol=0)
    torch.testing.assert_close(off.head.weight, ref.head.weight, rtol=0, atol=0)


def test_fork_by_deepcopy_plus_optimizer_state_dict_is_bit_identical():
    """A run forked after three Adam steps (``copy.deepcopy(model)``, a new
    ``OffloadedOptimizer`` over the copy loaded with the original's ``state_dict()``) continues
    bit for bit as the original does on the same batches, and neither disturbs the other."""
    data = batches(13, 7)
    a = TwoTower(True, seed=7)
    a_opt = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    for batch in data[:3]:
        train_step(a, a_opt, batch, CPU)
    b = copy.deepcopy(a)
    b_opt = gl.OffloadedOptimizer(torch.optim.Adam, b, lr=0.05)
    b_opt.load_state_dict(a_opt.state_dict())
    for batch in data[3:]:
        train_step(a, a_opt, batch, CPU)
        train_step(b, b_opt, batch, CPU)
    for mod in ("emb", "bag"):
        torch.testing.assert_close(table(getattr(b, mod)), table(getattr(a, mod)), rtol=0, atol=0)
    torch.testing.assert_close(b.head.weight, a.head.weight, rtol=0, atol=0)
    sa, sb = a_opt.state_dict()["tables"], b_opt.state_dict()["tables"]
    for ta, tb in zip(sa, sb, strict=True):
        assert set(ta) == set(tb)
        for k in ta:
            torch.testing.assert_close(tb[k], ta[k], rtol=0, atol=0)


def test_copies_taken_between_backward_and_step_do_not_change_the_run():
    """``copy.deepcopy`` and a pickle round trip of the model between ``backward()`` (with the
    gradients already merged by a clip over the groups) and ``step()``: the copies hold the
    rows before the step, the original's run equals an undisturbed twin bit for bit, and a
    copy trained by its own optimizer equals a fresh model loaded from its state dict."""
    data = batches(14, 6)
    a, twin = TwoTower(True, seed=9), TwoTower(True, seed=9)
    a_opt = gl.OffloadedOptimizer(torch.optim.Adam, a, lr=0.05)
    t_opt = gl.OffloadedOptimizer(torch.optim.Adam, twin, lr=0.05)
    copies = []
    for i, (ids, hist, y) in enumerate(data):
        train_step(twin, t_opt, (ids, hist, y), CPU)
        a_opt.zero_grad()
        F.mse_loss(a(ids, hist), y).backward()
        torch.nn.utils.clip_grad_norm_(all_params(a_opt), 1e6)  # merges the table gradients
        if i == 2:
            before = table(a.emb)
            copies = [copy.deepcopy(a), pickle.loads(pickle.dumps(a))]
            for c in copies:
                torch.testing.assert_close(table(c.emb), before, rtol=0, atol=0)
        a_opt.step()
    torch.testing.assert_close(table(a.emb), table(twin.emb), rtol=0, atol=0)
    torch.testing.assert_close(table(a.bag), table(twin.bag), rtol=0, atol=0)
    c = copies[0]
    fresh = TwoTower(True, seed=99)
    fresh.load_state_dict(c.state_dict())
    c_opt = gl.OffloadedOptimizer(torch.optim.Adam, c, lr=0.05)
    f_opt = gl.OffloadedOptimizer(torch.optim.Adam, fresh, lr=0.05)
    for batch in data[:3]:
        train_step(c, c_opt, batch, CPU)
        train_step(fresh, f_opt, batch, CPU)
    torch.testing.assert_close(table(c.emb), table(fresh.emb), rtol=0, atol=0)
    torch.testing.assert_close(c.head.weight, fresh.head.weight, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# defects: how torch users name what to train
# ---------------------------------------------------------------------------------------------
def _name_by_weight(how: str, emb: nn.Module, head: nn.Linear):
    """Build an optimizer naming ``emb.weight`` (the table) the way one names an
    nn.Embedding's weight; returns the optimizer."""
    if how == "bare":
        return gl.OffloadedOptimizer(torch.optim.SGD, emb.weight, lr=0.5)
    if how == "dict":
        return gl.OffloadedOptimizer(torch.optim.SGD, [{"params": emb.weight, "lr": 0.5}])
    other = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, [other, head], lr=0.5)
    opt.add_param_group({"params": emb.weight, "lr": 0.5})
    return opt


# DEFECT: an offloaded embedding's table (emb.weight, a DataGadget) given as params is iterated as
# rows: OffloadedOptimizer(SGD, emb.weight), {"params": emb.weight} and add_param_group build an
# optimizer over N detached row copies (add_param_group without any warning) and never train
# the table, where [emb.weight] is a clear GadgetTypeError.
@pytest.mark.parametrize("how", ["bare", "dict", "add_param_group"])
def test_table_weight_given_as_params_is_refused_or_trains_the_table(how):
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    head = nn.Linear(D, 1)
    before = table(emb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            opt = _name_by_weight(how, emb, head)
        except TypeError:  # (GadgetTypeError) a clear refusal is fine
            assert not emb._attached
            return
    # accepted: then it must train the table, and hold no stray copies of its rows
    n_rows = sum(1 for p in all_params(opt) if tuple(p.shape) == (D,))
    assert n_rows == 0, f"the optimizer holds {n_rows} copies of table rows as parameters"
    assert emb in opt.tables
    emb(torch.tensor([3])).sum().backward()
    opt.step()
    assert not torch.equal(table(emb)[3], before[3])


# DEFECT: a set in a param group's "params" (or in add_param_group) is accepted, while torch
# refuses it with TypeError because a set's order (and so which table each saved state table
# loads into) changes between runs; OffloadedOptimizer's state dict is positional too.
@pytest.mark.parametrize("how", ["dict", "add_param_group"])
def test_set_of_tables_in_a_param_group_is_refused_like_torch(how):
    head = nn.Linear(D, 1)
    with pytest.raises(TypeError, match="ordered|order"):
        torch.optim.SGD([{"params": {head.weight, head.bias}}], lr=0.1)  # torch's behaviour
    e1 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    e2 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    with pytest.raises(TypeError, match="order"):
        if how == "dict":
            gl.OffloadedOptimizer(torch.optim.SGD, [{"params": {e1, e2}, "lr": 0.1}])
        else:
            e0 = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
            opt = gl.OffloadedOptimizer(torch.optim.SGD, [e0, head], lr=0.1)
            opt.add_param_group({"params": {e1, e2}})
    assert not e1._attached and not e2._attached


# DEFECT: OffloadedOptimizer(cls, model.parameters()) for a model whose only trainable weights
# are offloaded tables (word2vec-style) raises "got no parameters and no offloaded embeddings"
# without saying why or what to do, though the same mistake beside a dense parameter gets a
# warning that says "model.parameters() does not reach them; pass the model".
def test_parameters_of_an_embeddings_only_model_error_names_the_fix():
    model = nn.ModuleDict(
        {
            "u": gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu"),
            "v": gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu"),
        }
    )
    with pytest.raises(gl.GadgetError) as info:
        gl.OffloadedOptimizer(torch.optim.SparseAdam, model.parameters(), lr=0.01)
    msg = str(info.value)
    assert "parameters()" in msg or "pass the model" in msg, msg


# ---------------------------------------------------------------------------------------------
# defects: torch tools that work on an nn.Embedding model
# ---------------------------------------------------------------------------------------------
# (session 15: AveragedModel walks parameters(), which the tables are not; the README says so
# beside the other tools that do not reach the tables -- no test asserts the limitation)


# DEFECT: torch.nn.init on emb.weight half works: normal_ / uniform_ / zeros_ / constant_ fill the
# table, but xavier_uniform_ and trunc_normal_ (as users write for nn.Embedding) fail with a bare
# AttributeError ('DataGadget' object has no attribute 'dim' / 'is_meta') that does not point
# to emb.weight.init_(fn).
@pytest.mark.parametrize(
    "fn,bound",
    [
        (torch.nn.init.xavier_uniform_, (6.0 / (N + D)) ** 0.5),
        (lambda t: torch.nn.init.trunc_normal_(t, std=0.02), 2.0),
    ],
    ids=["xavier_uniform_", "trunc_normal_"],
)
def test_nn_init_on_the_weight_works_or_points_to_init_(fn, bound):
    emb = gl.OffloadedEmbedding(N, D, placement="cpu", device="cpu")
    before = table(emb)
    # (the duck-typed ones do work)
    torch.nn.init.uniform_(emb.weight, -0.01, 0.01)
    assert table(emb).abs().max() <= 0.01
    torch.nn.init.normal_(emb.weight, 0.0, 1.0)
    before = table(emb)
    try:
        fn(emb.weight)
    except gl.GadgetError as exc:  # a clear refusal naming the way that works
        assert "init_" in str(exc)
        # (unchanged where torch's trunc_normal_ asks is_meta before it writes; torch 2.4's
        # fills through uniform_ first and is refused at erfinv_)
        if "is_meta" in inspect.getsource(torch.nn.init._no_grad_trunc_normal_):
            torch.testing.assert_close(table(emb), before, rtol=0, atol=0)
        emb.weight.init_(fn)  # the way the message names works
        after = table(emb)
        assert not torch.equal(after, before)
        assert after.abs().max() <= bound + 1e-6
        return
    after = table(emb)
    assert not torch.equal(after, before)
    assert after.abs().max() <= bound + 1e-6
