"""Review (session 38): the drop-in modules under ``torch.compile`` and the torch features a
demanding user combines them with.

Docs relied on (README "Training embeddings larger than GPU memory", its "torch.compile"
paragraph, and the ``OffloadedEmbedding`` / ``OffloadedEmbeddingBag`` / ``OffloadedOptimizer``
docstrings):

* a model holding the modules compiles with ``torch.compile(model)``; the lookup runs
  eagerly "as ``torch.compiler.disable`` makes it" (one graph break, its output an input of
  the compiled rest) and "training equals the eager model's exactly";
* float32 training is bit-identical to a dense ``nn.Embedding`` trained the same way on the
  rows a step looks up (lazy updates, one step count per table, the gradients of several
  lookups summed in autograd's order);
* LR schedulers, clipping over ``opt.param_groups``, ``zero_grad(set_to_none=...)`` (a
  table with no lookup since the last step is not stepped), lookups under
  ``torch.no_grad()`` leave no pending state, the table cannot be changed while a training
  lookup waits for its step, checkpoints resume bit-identically;
* ``padding_idx`` / ``max_norm`` are not taken (a ``TypeError``).

The reference is a lazy dense one written here: each step the distinct rows the step looks
up (ascending) become one ``nn.Parameter`` with their optimizer state rows, a plain torch
optimizer steps it, and rows and state are written back.

Backends: most tests compile with ``backend="aot_eager"`` (torch's own AOTAutograd path
without code generation: fast and bit-for-bit the eager kernels, so "equals the eager model
exactly" is testable without inductor's own re-rounding of fused dense code, which differs
from eager for plain torch models too). One test uses the default backend (inductor, needs a
C++ compiler; skipped without one) and compares against a reference whose lookup is
``torch.compiler.disable``-d, which is exactly the documented semantics.

Everything is built with ``placement="cpu"`` and ``device="cpu"`` explicitly, so the file
behaves the same on a CUDA host; the fallback placements (``cuda`` / ``pinned`` asked for on
a machine without CUDA) are tested only where there is no CUDA.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import gadgetloader as gl

pytestmark = [
    # torch's own: TorchDynamo reads .grad of the lookup's output (a non-leaf) as it takes
    # it as a graph input (a plain nn.Embedding under torch.compiler.disable does too)
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
    ),
    # torch's own: torch._dynamo.reset() imports inductor, which warns on some versions
    pytest.mark.filterwarnings(
        "ignore:.*torch.jit.script_method.* is deprecated:DeprecationWarning"
    ),
]

CPU = torch.device("cpu")
N_ITEM, N_BAG, D, B = 40, 30, 6, 6
STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------
# data


def _w0(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g)


def _head0() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return torch.randn(1, D, generator=g) * 0.3, torch.randn(1, generator=g) * 0.1


def _batches(steps: int, bag_form: str | None, seed: int = 1, sizes=None) -> list[dict]:
    """Per step: ids ``a`` and ``b`` for the item table (repeats inside and between them)
    and bag inputs (2-D, or 1-D ids with offsets of uneven, sometimes empty bags).
    ``sizes`` gives each step's batch size (default ``B``; 2-D bag inputs only)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        n = B if sizes is None else sizes[s % len(sizes)]
        a = torch.randint(0, N_ITEM, (n,), generator=g)
        b = torch.randint(0, N_ITEM, (n,), generator=g)
        a[1] = a[0]
        b[2] = a[3]
        batch: dict = {"a": a, "b": b, "bag_in": None, "offsets": None, "psw": None}
        if bag_form == "2d":
            x = torch.randint(0, N_BAG, (n, 3), generator=g)
            x[0, 1] = x[0, 0]
            batch["bag_in"] = x
        elif bag_form in ("offsets", "offsets32"):
            # uneven bags, one empty, the same total each step (no recompiles)
            lens = torch.tensor([3, 1, 0, 2, 4, 2])[torch.randperm(B, generator=g)]
            total = int(lens.sum())
            x = torch.randint(0, N_BAG, (total,), generator=g)
            x[1] = x[0]
            offs = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
            if bag_form == "offsets32":
                x, offs = x.to(torch.int32), offs.to(torch.int32)
            batch["bag_in"], batch["offsets"] = x, offs
        out.append(batch)
    return out


# --------------------------------------------------------------------------------------
# the lazy dense reference


class _LazyTable:
    """A full table and full-size optimizer state; each step one per-step Parameter."""

    def __init__(self, w0: torch.Tensor) -> None:
        self.W = w0.clone()
        self.P = torch.nn.Parameter(torch.empty(0, w0.shape[1]))
        self.rows: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, torch.Tensor] = {}
        self.uniq: torch.Tensor | None = None
        self.used = False

    def begin(self, ids: list[torch.Tensor]) -> None:
        ids = [i.reshape(-1).long() for i in ids]
        self.uniq = torch.unique(torch.cat(ids)) if ids else None
        self.used = bool(ids)
        if self.uniq is not None:
            # a new leaf each step (autograd keeps a leaf's shape); swapped into the groups
            self.P = torch.nn.Parameter(self.W[self.uniq].clone())
        self.P.grad = None

    def swap_into(self, opt: torch.optim.Optimizer, old: torch.nn.Parameter) -> None:
        for g in opt.param_groups:
            g["params"] = [self.P if p is old else p for p in g["params"]]
        opt.state.pop(old, None)

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.uniq, ids.long())

    def inject(self, opt: torch.optim.Optimizer) -> None:
        if not self.used:
            return
        if self.rows or self.scalars:
            st = {k: v[self.uniq].clone() for k, v in self.rows.items()}
            st.update({k: v.clone() for k, v in self.scalars.items()})
            opt.state[self.P] = st
        else:
            opt.state.pop(self.P, None)
            if isinstance(opt, torch.optim.Adagrad):
                # (older torch makes Adagrad's state in its __init__ only, as here)
                init = opt.param_groups[0]["initial_accumulator_value"]
                opt.state[self.P] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(self.P.data, init),
                }

    def collect(self, opt: torch.optim.Optimizer) -> None:
        if self.P.grad is None:
            return
        self.W[self.uniq] = self.P.data
        for k, v in opt.state.get(self.P, {}).items():
            if not torch.is_tensor(v):
                continue
            if v.shape == self.P.shape:
                if k not in self.rows:
                    self.rows[k] = torch.zeros_like(self.W)
                self.rows[k][self.uniq] = v
            else:
                self.scalars[k] = v.clone()


class _RefEmb(torch.nn.Module):
    def __init__(self, w0: torch.Tensor, bag_mode: str | None = None, disable: bool = False):
        super().__init__()
        self.t = _LazyTable(w0)
        self.bag_mode = bag_mode
        if disable:
            self.forward = torch.compiler.disable(self.forward)  # type: ignore[method-assign]

    def forward(self, ids, offsets=None, per_sample_weights=None):
        loc = self.t.local(ids)
        if self.bag_mode is None:
            return F.embedding(loc, self.t.P)
        return F.embedding_bag(
            loc,
            self.t.P,
            None if offsets is None else offsets.long(),
            mode=self.bag_mode,
            per_sample_weights=per_sample_weights,
        )


# --------------------------------------------------------------------------------------
# the model


class Net(torch.nn.Module):
    def __init__(self, item, bag, twice: bool) -> None:
        super().__init__()
        self.item = item
        self.bag = bag
        self.head = torch.nn.Linear(D, 1)
        self.twice = twice
        w, bias = _head0()
        with torch.no_grad():
            self.head.weight.copy_(w)
            self.head.bias.copy_(bias)

    def forward(self, a, b, bag_in, offsets, psw, use_item: bool = True):
        # (no list built across the lookups' graph breaks: torch 2.11's TorchDynamo warns
        # that it cannot trace list.append in the resumed frame)
        h = None
        if use_item:
            x = self.item(a)
            if self.twice:
                x = x * torch.sigmoid(self.item(b))
            h = x
        if self.bag is not None:
            y = self.bag(bag_in, offsets, psw) if psw is not None else self.bag(bag_in, offsets)
            h = y if h is None else h + y
        pred = self.head(torch.tanh(h)).squeeze(-1)
        return ((pred.float() - 0.25) ** 2).mean()


def _copy_init(t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        t.copy_(src)
    return t


def _off_emb(w0, placement="cpu"):
    return gl.OffloadedEmbedding(
        w0.shape[0], D, placement=placement, device=CPU, init=functools.partial(_copy_init, src=w0)
    )


def _off_bag(w0, mode, placement="cpu"):
    return gl.OffloadedEmbeddingBag(
        w0.shape[0],
        D,
        mode=mode,
        placement=placement,
        device=CPU,
        init=functools.partial(_copy_init, src=w0),
    )


def _table(mod) -> torch.Tensor:
    if isinstance(mod, _RefEmb):
        return mod.t.W.clone()
    return mod.weight.as_tensor().detach().cpu().clone()


def _ids_for(model: Net, batch: dict, use_item: bool) -> tuple[list, list]:
    item_ids = []
    if use_item:
        item_ids = [batch["a"], batch["b"]] if model.twice else [batch["a"]]
    bag_ids = [batch["bag_in"]] if model.bag is not None else []
    return item_ids, bag_ids


def _run(
    impl: str,
    *,
    opt_cls=torch.optim.Adam,
    opt_kw=None,
    bag_mode: str | None = None,
    bag_form: str | None = None,
    with_item: bool = True,
    twice: bool = False,
    psw: bool = False,
    backend: str | None = None,
    autocast: bool = False,
    clip: float | None = None,
    sched=None,
    set_to_none: bool = True,
    skip_item: tuple = (),
    probe=None,
    steps: int = STEPS,
    placement: str = "cpu",
    disable_ref_lookup: bool = False,
    accumulate: int = 1,
    sizes=None,
    closure: bool = False,
    inplace_compile: bool = False,
):
    """Train ``impl`` ('off' = gadgetloader, 'ref' = lazy dense reference) and return the
    final tables, head weights, losses and clip norms."""
    opt_kw = dict(opt_kw or {"lr": 0.05})
    wi, wb = _w0(N_ITEM, 10), _w0(N_BAG, 11)
    if impl == "off":
        item = _off_emb(wi, placement) if with_item else None
        bag = _off_bag(wb, bag_mode, placement) if bag_mode else None
    else:
        item = _RefEmb(wi, disable=disable_ref_lookup) if with_item else None
        bag = _RefEmb(wb, bag_mode, disable=disable_ref_lookup) if bag_mode else None
    model = Net(item, bag, twice)
    if impl == "off":
        opt = gl.OffloadedOptimizer(opt_cls, model, **opt_kw)
    else:
        tabs = [m.t for m in (item, bag) if m is not None]
        opt = opt_cls(list(model.head.parameters()) + [t.P for t in tabs], **opt_kw)
    sch = sched(opt) if sched is not None else None
    if backend and inplace_compile:
        model.compile(backend=backend)
        f = model
    else:
        f = torch.compile(model, backend=backend) if backend else model
    losses, norms = [], []
    data = _batches(steps * accumulate, bag_form, sizes=sizes)

    def _forward(batch, use_item):
        w = None
        if psw:
            w = torch.linspace(0.5, 1.5, batch["bag_in"].numel()).reshape(batch["bag_in"].shape)
        args = (batch["a"], batch["b"], batch["bag_in"], batch["offsets"], w, use_item)
        if autocast:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                return f(*args)
        return f(*args)

    for s in range(steps):
        micro = data[s * accumulate : (s + 1) * accumulate]
        use_item = with_item and s not in skip_item
        if impl == "ref":
            item_ids, bag_ids = [], []
            for batch in micro:
                i_ids, b_ids = _ids_for(model, batch, use_item)
                item_ids += i_ids
                bag_ids += b_ids
            for m, ids in ((item, item_ids), (bag, bag_ids)):
                if m is not None:
                    old = m.t.P
                    m.t.begin(ids)
                    m.t.swap_into(opt, old)
        if impl == "ref":
            for m in (item, bag):
                if m is not None:
                    m.t.inject(opt)
        if closure:

            def _closure(batch=micro[0], use_item=use_item):
                loss = _forward(batch, use_item)
                loss.backward()
                return loss

            loss = opt.step(_closure)
            assert torch.is_tensor(loss) and loss.grad_fn is not None
            losses.append(loss.detach().float().clone())
        else:
            for batch in micro:
                loss = _forward(batch, use_item)
                loss.backward()
                losses.append(loss.detach().float().clone())
            if probe is not None:
                probe(impl, model, f, micro[-1], s)
            if clip is not None:
                params = [p for g in opt.param_groups for p in g["params"]]
                norms.append(torch.nn.utils.clip_grad_norm_(params, clip).detach().clone())
            opt.step()
        if impl == "ref":
            for m in (item, bag):
                if m is not None:
                    m.t.collect(opt)
        opt.zero_grad(set_to_none=set_to_none)
        if sch is not None:
            sch.step()
    return {
        "item": _table(item) if item is not None else None,
        "bag": _table(bag) if bag is not None else None,
        "head_w": model.head.weight.detach().clone(),
        "head_b": model.head.bias.detach().clone(),
        "losses": torch.stack(losses),
        "norms": torch.stack(norms) if norms else None,
        "model": model,
        "opt": opt,
        "compiled": f,
    }


def _assert_same(got: dict, want: dict, exact: bool = True, what: str = "") -> None:
    for k in ("item", "bag", "head_w", "head_b", "losses"):
        if want[k] is None:
            assert got[k] is None
            continue
        if exact:
            assert torch.equal(got[k], want[k]), (
                f"{what} {k}: max diff {(got[k] - want[k]).abs().max().item():.3e}"
            )
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{what} {k}")


def _three_way(**kw) -> dict:
    """Reference, eager drop-in and compiled (aot_eager) drop-in; all must agree exactly."""
    ref = _run("ref", **kw)
    # training moved the tables (a step that does nothing cannot pass)
    if ref["item"] is not None:
        assert not torch.equal(ref["item"], _w0(N_ITEM, 10))
    if ref["bag"] is not None:
        assert not torch.equal(ref["bag"], _w0(N_BAG, 11))
    eager = _run("off", **kw)
    _assert_same(eager, ref, what="eager vs dense reference:")
    torch._dynamo.reset()
    comp = _run("off", backend="aot_eager", **kw)
    _assert_same(comp, eager, what="compiled vs eager:")
    return comp


def _have_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


# --------------------------------------------------------------------------------------
# torch.compile: training equals eager and the dense reference


# (Adam, SGD with momentum and Adagrad are trained by the tests further down)
OPTIMIZERS = [
    pytest.param(
        torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}, id="adamw-ams"
    ),
    pytest.param(
        torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}, id="rmsprop-c"
    ),
    pytest.param(torch.optim.NAdam, {"lr": 0.05}, id="nadam"),
]


@pytest.mark.parametrize(("opt_cls", "opt_kw"), OPTIMIZERS)
def test_compiled_twice_looked_up_embedding_equals_eager_and_dense(opt_cls, opt_kw):
    """The table is looked up twice per forward (repeats within and across the lookups)."""
    _three_way(opt_cls=opt_cls, opt_kw=opt_kw, twice=True)


@pytest.mark.parametrize(
    ("mode", "form"),
    [
        ("sum", "2d"),
        ("mean", "offsets32"),
        ("max", "offsets"),
    ],
)
def test_compiled_bag_with_embedding_equals_eager_and_dense(mode, form):
    _three_way(opt_cls=torch.optim.Adam, bag_mode=mode, bag_form=form)


def test_compiled_bag_per_sample_weights_equals_eager_and_dense():
    _three_way(
        opt_cls=torch.optim.Adagrad,
        opt_kw={"lr": 0.1},
        bag_mode="sum",
        bag_form="offsets",
        psw=True,
    )


def test_compiled_with_default_backend_equals_disabled_lookup_reference():
    """``torch.compile(model)`` (inductor): the lookup is documented to run as
    ``torch.compiler.disable`` makes it, so a dense reference whose lookup is disabled the
    same way, compiled the same way, gives the same bits; against the eager model the
    compiled dense code may round differently (as for any torch model), so to rounding."""
    if not _have_cxx():
        pytest.skip("inductor needs a C++ compiler (none found); other tests use aot_eager")
    # the smallest model (one lookup, the head compiled): inductor's C++ builds are slow
    kw = {"opt_cls": torch.optim.Adam}
    ref = _run("ref", backend="inductor", disable_ref_lookup=True, **kw)
    torch._dynamo.reset()
    comp = _run("off", backend="inductor", **kw)
    _assert_same(comp, ref, what="inductor drop-in vs inductor reference:")
    eager = _run("off", **kw)
    _assert_same(comp, eager, exact=False, what="inductor vs eager:")


# --------------------------------------------------------------------------------------
# autocast, clipping, schedulers, zero_grad


def test_lookup_dtype_under_autocast_matches_nn_embedding():
    """Under CPU bf16 autocast a lookup gives what ``nn.Embedding`` / ``nn.EmbeddingBag``
    give (dtype and values), eager and compiled."""
    w = _w0(N_ITEM, 3)
    emb = _off_emb(w)
    bag = _off_bag(w, "mean")
    dense = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False)
    dbag = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="mean")
    ids = torch.tensor([3, 1, 3, 7])
    bids = torch.tensor([[3, 1], [7, 7]])
    cemb = torch.compile(lambda i: emb(i) * 2, backend="aot_eager")
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16), torch.no_grad():
        want, wantb = dense(ids), dbag(bids)
        got, gotb = emb(ids), bag(bids)
        gotc = cemb(ids)
    assert got.dtype == want.dtype and gotb.dtype == wantb.dtype
    assert torch.equal(got, want) and torch.equal(gotb, wantb)
    assert torch.equal(gotc, want * 2)


@pytest.mark.parametrize("opt", ["sgd"])
def test_compiled_training_under_bf16_autocast_equals_eager_and_dense(opt):
    kw = (
        {"opt_cls": torch.optim.Adam}
        if opt == "adam"
        else {
            "opt_cls": torch.optim.SGD,
            "opt_kw": {"lr": 0.1, "momentum": 0.9},
        }
    )
    _three_way(autocast=True, twice=True, bag_mode="sum", bag_form="offsets", **kw)


@pytest.mark.parametrize("max_norm", [0.05])
def test_compiled_clipping_over_param_groups(max_norm):
    """Clipping over the optimizer's groups sees the tables' row gradients: the returned
    norm equals the dense reference's (to rounding: torch sums the per-tensor norms in
    the groups' order) and training follows it; compiled equals eager exactly."""
    kw = {
        "opt_cls": torch.optim.SGD,
        "opt_kw": {"lr": 0.5},
        "twice": True,
        "bag_mode": "mean",
        "bag_form": "2d",
        "clip": max_norm,
    }
    ref = _run("ref", **kw)
    eager = _run("off", **kw)
    torch.testing.assert_close(eager["norms"], ref["norms"], rtol=1e-6, atol=0)
    _assert_same(eager, ref, exact=False, what="clipped eager vs reference:")
    if max_norm < 1:
        # the clip did something: unclipped training ends elsewhere
        assert bool((ref["norms"] > max_norm).all())
        plain = _run("ref", **{**kw, "clip": None})
        assert not torch.allclose(plain["item"], ref["item"])
    torch._dynamo.reset()
    comp = _run("off", backend="aot_eager", **kw)
    _assert_same(comp, eager, what="clipped compiled vs eager:")
    assert torch.equal(comp["norms"], eager["norms"])


SCHEDULERS = [
    pytest.param(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), id="steplr"),
    pytest.param(
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=STEPS),
        id="onecycle",
    ),
]


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_compiled_with_lr_scheduler_equals_eager_and_dense(sched):
    """OneCycleLR also warms ``lr`` up before the first step and cycles Adam's betas."""
    out = _three_way(
        opt_cls=torch.optim.Adam,
        opt_kw={"lr": 0.05},
        sched=sched,
        twice=True,
        bag_mode="sum",
        bag_form="2d",
    )
    # the scheduler really reached the wrapped optimizer's groups
    lrs = [g["lr"] for g in out["opt"].param_groups]
    assert all(lr != 0.05 for lr in lrs), lrs


def test_scheduler_changes_training():
    """Sanity of the reference: the scheduler runs above do change the result."""
    a = _run("ref", opt_cls=torch.optim.Adam, twice=True)
    b = _run("ref", opt_cls=torch.optim.Adam, twice=True, sched=SCHEDULERS[0].values[0])
    assert not torch.allclose(a["item"], b["item"])


@pytest.mark.parametrize("set_to_none", [False])
def test_compiled_zero_grad_and_skipped_table_steps(set_to_none):
    """Steps 1 and 2 do not look the item table up: it is not stepped (its rows, state and
    step count stay, so Adam's bias correction continues from 1 at step 3), also with
    ``zero_grad(set_to_none=False)``; the bag and the head train every step."""
    _three_way(
        opt_cls=torch.optim.Adam,
        opt_kw={"lr": 0.05, "weight_decay": 0.1},
        bag_mode="sum",
        bag_form="offsets",
        set_to_none=set_to_none,
        skip_item=(1, 2),
        steps=4,
    )


# --------------------------------------------------------------------------------------
# train / eval and torch.no_grad lookups


def _eval_probe(impl, model, f, batch, s):
    """Between backward and step: eval-mode compiled lookups under no_grad must return the
    table's current rows and change neither the table nor what the step will do."""
    if impl != "off":
        return
    before_item = _table(model.item)
    before_bag = _table(model.bag)
    ids = torch.cat([batch["a"], torch.arange(0, N_ITEM, 7)])
    model.eval()
    with torch.no_grad():
        got = f.item(ids) if hasattr(f, "item") else model.item(ids)
        loss = f(batch["b"], batch["a"], torch.randint(0, N_BAG, (B, 2)), None, None, True)
    model.train()
    assert torch.isfinite(loss)
    assert not got.requires_grad
    assert torch.equal(got, before_item[ids])
    assert torch.equal(_table(model.item), before_item)
    assert torch.equal(_table(model.bag), before_bag)


def test_compiled_no_grad_eval_lookups_between_backward_and_step_change_nothing():
    kw = {"opt_cls": torch.optim.Adam, "twice": True, "bag_mode": "mean", "bag_form": "2d"}
    want = _run("ref", **kw)
    torch._dynamo.reset()
    got = _run("off", backend="aot_eager", probe=_eval_probe, **kw)
    _assert_same(got, want, what="with eval lookups vs reference without:")


def test_no_grad_compiled_lookup_leaves_nothing_pending_but_a_grad_lookup_does():
    """After a step: a compiled forward without gradients (``torch.no_grad()``; also
    ``torch.inference_mode()``, stricter still) leaves no pending lookup, so writing the
    table is allowed; a compiled forward with gradients (no backward yet) is a training
    lookup: writing the table is refused and changes nothing."""
    kw = {"opt_cls": torch.optim.Adam, "twice": True, "steps": 2}
    out = _run("off", backend="aot_eager", **kw)
    model, f, opt = out["model"], out["compiled"], out["opt"]
    a = torch.tensor([0, 1, 2, 3, 4, 5])
    model.eval()
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            out = f(a, a, None, None, None, True)
        assert torch.isfinite(out)
    model.train()
    new = torch.full((2, D), 7.0)
    model.item.weight.insertData(new, torch.tensor([0, 1]))
    t = _table(model.item)
    assert torch.equal(t[:2], new)
    # a training forward through the compiled model, not yet backward-ed
    loss = f(a, a, None, None, None, True)
    with pytest.raises(gl.GadgetError):
        model.item.weight.insertData(torch.zeros(2, D), torch.tensor([0, 1]))
    assert torch.equal(_table(model.item), t)
    # and its step still trains rows 0..5 from the values written above
    loss.backward()
    opt.step()
    t2 = _table(model.item)
    assert not torch.equal(t2[:6], t[:6])
    assert torch.equal(t2[6:], t[6:])


# --------------------------------------------------------------------------------------
# checkpoints: saved from a compiled model, restored into an eager one


@pytest.mark.parametrize(
    ("opt_cls", "opt_kw", "inplace"),
    [
        pytest.param(torch.optim.Adam, {"lr": 0.05}, False, id="adam-torch.compile"),
        pytest.param(
            torch.optim.SGD,
            {"lr": 0.1, "momentum": 0.9, "nesterov": True},
            True,
            id="sgd-module.compile",
        ),
    ],
)
def test_checkpoint_from_compiled_model_resumes_bit_identically_in_eager(
    tmp_path, opt_cls, opt_kw, inplace
):
    """Trained compiled (``torch.compile(model)``, saving ``model``; or ``model.compile()``),
    saved, loaded into a freshly built eager model: the next step equals uninterrupted
    training exactly."""
    kw = {
        "opt_cls": opt_cls,
        "opt_kw": opt_kw,
        "twice": True,
        "bag_mode": "mean",
        "bag_form": "offsets",
    }
    full = _run("ref", steps=3, **kw)
    first = _run("off", backend="aot_eager", steps=2, inplace_compile=inplace, **kw)
    gl.save_checkpoint(tmp_path / "ck", {"model": first["model"], "optimizer": first["opt"]})

    # a fresh eager model built the same way (other initial values), then restored
    item = _off_emb(_w0(N_ITEM, 123))
    bag = _off_bag(_w0(N_BAG, 124), "mean")
    model = Net(item, bag, True)
    with torch.no_grad():
        model.head.weight.zero_()
    opt = gl.OffloadedOptimizer(opt_cls, model, **opt_kw)
    gl.load_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt})
    assert torch.equal(_table(item), _table(first["model"].item))
    assert torch.equal(_table(bag), _table(first["model"].bag))
    assert torch.equal(model.head.weight, first["model"].head.weight)

    # continue with step 3 of the same data, eagerly
    data = _batches(3, "offsets")[2:]
    for batch in data:
        loss = model(batch["a"], batch["b"], batch["bag_in"], batch["offsets"], None, True)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(_table(item), full["item"])
    assert torch.equal(_table(bag), full["bag"])
    assert torch.equal(model.head.weight.detach(), full["head_w"])
    assert torch.equal(model.head.bias.detach(), full["head_b"])


def test_state_dict_round_trip_from_compiled_into_eager():
    """Small tables: the modules' and the optimizer's ``state_dict`` taken after compiled
    training load into an eager twin, which then trains as the compiled one goes on."""
    kw = {
        "opt_cls": torch.optim.AdamW,
        "opt_kw": {"lr": 0.05, "weight_decay": 0.1},
        "twice": True,
        "bag_mode": "sum",
        "bag_form": "2d",
        "steps": 2,
    }
    src = _run("off", backend="aot_eager", **kw)
    item = _off_emb(_w0(N_ITEM, 5))
    bag = _off_bag(_w0(N_BAG, 6), "sum")
    model = Net(item, bag, True)
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, lr=0.05, weight_decay=0.1)
    model.load_state_dict(src["model"].state_dict())
    opt.load_state_dict(src["opt"].state_dict())
    batch = _batches(1, "2d", seed=77)[0]
    for o, call in ((src["opt"], src["compiled"]), (opt, model)):
        loss = call(batch["a"], batch["b"], batch["bag_in"], None, None, True)
        loss.backward()
        o.step()
        o.zero_grad()
    assert torch.equal(_table(item), _table(src["model"].item))
    assert torch.equal(_table(bag), _table(src["model"].bag))
    assert torch.equal(model.head.weight, src["model"].head.weight)


def test_checkpoint_of_the_compiled_wrapper(tmp_path):
    """The optimizer built over, and the checkpoint saved from, the ``torch.compile``
    wrapper itself: its module names carry torch's ``_orig_mod.`` prefix (as its
    ``state_dict`` does), so loading it into a bare eager model is refused before anything
    changes (as torch's ``load_state_dict`` refuses those keys); loaded through a wrapper of
    a fresh model it resumes bit-identically, and the eager model then trains on."""
    kw = {"opt_cls": torch.optim.Adam, "twice": True, "bag_mode": "sum", "bag_form": "2d"}
    full = _run("ref", steps=3, **kw)
    item = _off_emb(_w0(N_ITEM, 10))
    bag = _off_bag(_w0(N_BAG, 11), "sum")
    src = Net(item, bag, True)
    csrc = torch.compile(src, backend="aot_eager")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, csrc, lr=0.05)
    data = _batches(3, "2d")
    for batch in data[:2]:
        csrc(batch["a"], batch["b"], batch["bag_in"], None, None, True).backward()
        opt.step()
        opt.zero_grad()
    gl.save_checkpoint(tmp_path / "ck", {"model": csrc, "optimizer": opt})

    m2 = Net(_off_emb(_w0(N_ITEM, 1)), _off_bag(_w0(N_BAG, 2), "sum"), True)
    o2 = gl.OffloadedOptimizer(torch.optim.Adam, m2, lr=0.05)
    before = (_table(m2.item), _table(m2.bag), m2.head.weight.detach().clone())
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    assert torch.equal(_table(m2.item), before[0])
    assert torch.equal(_table(m2.bag), before[1])
    assert torch.equal(m2.head.weight, before[2])

    m3 = Net(_off_emb(_w0(N_ITEM, 3)), _off_bag(_w0(N_BAG, 4), "sum"), True)
    c3 = torch.compile(m3, backend="aot_eager")
    o3 = gl.OffloadedOptimizer(torch.optim.Adam, c3, lr=0.05)
    gl.load_checkpoint(tmp_path / "ck", {"model": c3, "optimizer": o3})
    batch = data[2]
    m3(batch["a"], batch["b"], batch["bag_in"], None, None, True).backward()  # eagerly
    o3.step()
    assert torch.equal(_table(m3.item), full["item"])
    assert torch.equal(_table(m3.bag), full["bag"])
    assert torch.equal(m3.head.weight.detach(), full["head_w"])


# --------------------------------------------------------------------------------------
# documented refusals and placements


@pytest.mark.parametrize("cls", ["emb", "bag"])
@pytest.mark.parametrize("kw", [{"padding_idx": 0}, {"max_norm": 1.0}, {"sparse": True}])
def test_nn_embedding_only_keywords_are_refused(cls, kw):
    with pytest.raises(TypeError):
        if cls == "emb":
            gl.OffloadedEmbedding(10, 4, placement="cpu", device=CPU, **kw)
        else:
            gl.OffloadedEmbeddingBag(10, 4, mode="sum", placement="cpu", device=CPU, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fallback placements: CPU-only host")
@pytest.mark.parametrize("placement", ["pinned"])
def test_fallback_placements_train_compiled_as_cpu(placement):
    """On a machine without CUDA, ``cuda`` / ``pinned`` asked for by name fall back to
    ``cpu`` with a ``FallbackWarning`` and train as the ``cpu`` placement does."""
    want = _run("off", opt_cls=torch.optim.Adam, twice=True, bag_mode="sum", bag_form="2d")
    torch._dynamo.reset()
    with pytest.warns(gl.FallbackWarning):
        got = _run(
            "off",
            backend="aot_eager",
            opt_cls=torch.optim.Adam,
            twice=True,
            bag_mode="sum",
            bag_form="2d",
            placement=placement,
        )
    assert got["model"].item.placement == "cpu"
    _assert_same(got, want, what=f"{placement} fallback vs cpu:")
