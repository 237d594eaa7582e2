"""Session 46's fixes, from the findings session 45's reviews left open.

- Gradient edits made through ``param_groups`` between two backward passes (clipping,
  scaling in place, replacing or clearing ``.grad``) were lost by the offloaded optimizer
  when the step's rows had been looked up more than once: the next merge rebuilt the
  gradient from the lookups. A merge now takes the lookups' gradients over, and a later
  backward adds to ``.grad`` as the user left it, as torch does for a dense parameter.
- An optimizer class of the user's own whose row state starts from the parameter's
  values got a zero start; it is refused.
- Saves to a name near the file system's name limit failed with a raw ``OSError``
  (the temporary beside it was longer than the limit).
- A zarr store replaced while the old one's files could not all be removed left a hidden
  ``.trash-`` copy without a word; it now warns, naming the copy.
- Lists holding tensors that require grad or are bfloat16, nested tensors, a meta value
  for ``fill_``, and a ``generator=`` that is not a ``torch.Generator`` raised raw torch
  or NumPy errors; each is a ``GadgetError`` now (or works, where it should).
- A float128 file's message pointed to ``dtype='float64'``, which a file refuses.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA, MEMORY_PLACEMENTS

import gadgetloader as gl
from gadgetloader.io import _atomic

PLACEMENTS = [*MEMORY_PLACEMENTS, "file"]
N, D = 12, 4
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


# ----------------------------------------------------------------------------- gradient edits
def _w0() -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, N * D, dtype=torch.float32).reshape(N, D)


def _pair(placement: str, opt_cls: type, sparse: bool = False, **kw):
    """An offloaded embedding and its optimizer, and a dense nn.Embedding trained by the
    same torch optimizer (the reference), both starting from the same table."""
    emb = gl.OffloadedEmbedding(N, D, placement=placement, device=DEVICE)
    emb.weight.insertData(_w0(), torch.arange(N))
    ref = torch.nn.Embedding(N, D, sparse=sparse, _weight=_w0().to(DEVICE).clone())
    return (emb, gl.OffloadedOptimizer(opt_cls, emb, **kw)), (ref, opt_cls(ref.parameters(), **kw))


def _table(emb) -> torch.Tensor:
    return torch.as_tensor(emb.weight[torch.arange(N)]).detach().cpu()


def _grads(opt) -> list[torch.Tensor]:
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _edit(opt, how: str) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    if how == "clip":
        torch.nn.utils.clip_grad_norm_(params, 0.5)
    elif how == "scale":
        for g in _grads(opt):
            g.mul_(0.25)
    elif how == "replace":
        for p in params:
            if p.grad is not None:
                p.grad = p.grad * 3.0
    elif how == "clear":
        for p in params:
            p.grad = None
    elif how == "prepare":  # a read of the groups that changes nothing
        assert _grads(opt)
    else:
        raise AssertionError(how)


def _two_passes(emb, opt, how: str, third_ids: list[int]) -> None:
    ids_a = torch.tensor([1, 2, 2, 5], device=DEVICE)
    ids_b = torch.tensor([[2, 7], [9, 1]], device=DEVICE)
    c = torch.arange(D, dtype=torch.float32, device=DEVICE) + 1.0
    opt.zero_grad()
    (emb(ids_a) * c).sum().add((emb(ids_b) * c * 2.0).sum()).backward()
    _edit(opt, how)
    third = torch.tensor(third_ids, device=DEVICE)
    (emb(third) * c * 3.0).sum().backward()
    opt.step()


EDITS = ["clip", "scale", "replace", "clear", "prepare"]


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
@pytest.mark.parametrize("how", EDITS)
@pytest.mark.parametrize("third", [[2, 7], [2, 11, 0]], ids=["same-rows", "new-rows"])
def test_sgd_keeps_gradient_edits_between_backward_passes(placement, how, third):
    (emb, opt), (ref, ref_opt) = _pair(placement, torch.optim.SGD, lr=0.5)
    for _ in range(2):
        _two_passes(emb, opt, how, third)
        _two_passes(ref, ref_opt, how, third)
    # SGD without momentum: exactly the dense parameter's result
    torch.testing.assert_close(_table(emb), ref.weight.detach().cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
@pytest.mark.parametrize("how", ["clip", "scale", "clear"])
def test_adam_keeps_gradient_edits_between_backward_passes(placement, how):
    # one step: the dense Adam's untouched rows have zero moments and do not move either
    # (a large eps: Adam's first step is otherwise nearly blind to the gradient's scale)
    (emb, opt), (ref, ref_opt) = _pair(placement, torch.optim.Adam, lr=0.1, eps=1.0)
    _two_passes(emb, opt, how, [2, 11])
    _two_passes(ref, ref_opt, how, [2, 11])
    torch.testing.assert_close(_table(emb), ref.weight.detach().cpu())


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_sparse_adam_keeps_in_place_scaling_between_backward_passes(placement):
    (emb, opt), (ref, ref_opt) = _pair(
        placement, torch.optim.SparseAdam, sparse=True, lr=0.1, eps=1.0
    )
    for _ in range(2):
        _two_passes(emb, opt, "scale", [2, 11])
        _two_passes(ref, ref_opt, "scale", [2, 11])
    torch.testing.assert_close(_table(emb), ref.weight.detach().cpu())


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_passes_after_a_merge_add_to_the_gradient_in_turn(placement):
    # a dense .grad gets (merged + pass 2) + pass 3, which rounds differently from
    # merged + (pass 2 + pass 3): SGD's result is bit-identical to the dense one
    torch.manual_seed(0)
    w0 = torch.randn(N, 64)
    emb = gl.OffloadedEmbedding(N, 64, placement=placement, device=DEVICE)
    emb.weight.insertData(w0.clone(), torch.arange(N))
    ref = torch.nn.Embedding(N, 64, _weight=w0.to(DEVICE).clone())
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    ids = torch.tensor([3, 5], device=DEVICE)
    targets = [torch.randn(2, 64, device=DEVICE) * s for s in (1e3, 1.0, 1e-3)]
    a, b, c = (t.cpu() for t in targets)
    assert not torch.equal((a + b) + c, a + (b + c))  # the orders differ here
    for n, t in enumerate(targets):
        (emb(ids) * t).sum().backward()
        (ref(ids) * t).sum().backward()
        if n == 0:
            assert opt.param_groups[0]["lr"] == 1.0  # reading the groups merges
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(
        torch.as_tensor(emb.weight[torch.arange(N)]).cpu(),
        ref.weight.detach().cpu(),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_merge_then_zero_grad_leaves_nothing_to_step(placement):
    (emb, opt), _ = _pair(placement, torch.optim.SGD, lr=0.5)
    emb(torch.tensor([1, 2], device=DEVICE)).sum().add(
        emb(torch.tensor([2, 3], device=DEVICE)).sum()
    ).backward()
    assert _grads(opt)  # merged: the groups show the rows' gradient
    opt.zero_grad()
    assert not _grads(opt)
    opt.step()  # nothing to apply
    torch.testing.assert_close(_table(emb), _w0(), rtol=0, atol=0)


# ----------------------------------------------------------------------------- probed state
class _AveragingAdam(torch.optim.Adam):
    """Adam keeping a running average of the weights, started from the weights."""

    @staticmethod
    def _start(p):
        return p.detach().clone()

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                avg = st.get("avg")
                if avg is None:
                    avg = st["avg"] = self._start(p)
                avg.mul_(0.9).add_(p, alpha=0.1)
        return loss


class _ZeroAveragingAdam(_AveragingAdam):
    """The same, started from zeros (which paging reproduces)."""

    @staticmethod
    def _start(p):
        return torch.zeros_like(p)


class _MySGD(torch.optim.SGD):
    pass


class _ScaledMomentumSGD(torch.optim.SGD):
    """SGD whose momentum buffer starts from the parameter (not the gradient)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("momentum_buffer", p.detach().clone() * 5)
        return super().step(closure)


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_state_started_from_the_parameter_is_refused(placement):
    emb = gl.OffloadedEmbedding(N, D, placement=placement, device=DEVICE)
    with pytest.raises(gl.GadgetTypeError, match=r"_AveragingAdam starts its state 'avg' from"):
        gl.OffloadedOptimizer(_AveragingAdam, emb, lr=0.1)
    # nothing was attached: a supported optimizer takes the table after the refusal
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1], device=DEVICE)).sum().backward()
    opt.step()


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_subclass_state_from_constants_trains_like_the_dense_reference(placement):
    (emb, opt), (ref, ref_opt) = _pair(placement, _ZeroAveragingAdam, lr=0.1)
    ids = torch.tensor([3, 4, 4], device=DEVICE)
    for _ in range(3):
        for m, o in ((emb, opt), (ref, ref_opt)):
            o.zero_grad()
            (m(ids) ** 2).sum().backward()
            o.step()
    torch.testing.assert_close(_table(emb), ref.weight.detach().cpu())
    # the average is paged as row state, equal to the dense one on the rows trained
    (pager,) = opt.pagers
    avg = torch.as_tensor(pager.tables["avg"][torch.tensor([3, 4])]).cpu()
    torch.testing.assert_close(avg, ref_opt.state[ref.weight]["avg"][[3, 4]].cpu())


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_sgd_momentum_buffer_started_from_the_parameter_is_refused(placement):
    emb = gl.OffloadedEmbedding(N, D, placement=placement, device=DEVICE)
    with pytest.raises(gl.GadgetTypeError, match=r"starts its state 'momentum_buffer' from"):
        gl.OffloadedOptimizer(_ScaledMomentumSGD, emb, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_sgd_subclass_with_momentum_and_weight_decay_is_accepted(placement):
    (emb, opt), (ref, ref_opt) = _pair(placement, _MySGD, lr=0.1, momentum=0.9, weight_decay=0.1)
    ids = torch.tensor([0, 5, 5], device=DEVICE)
    for m, o in ((emb, opt), (ref, ref_opt)):
        o.zero_grad()
        m(ids).sum().backward()
        o.step()
    rows = [0, 5]
    torch.testing.assert_close(_table(emb)[rows], ref.weight.detach().cpu()[rows])


# ----------------------------------------------------------------------------- long save names
def _long_name(tmp_path, ext: str, spare: int = 0) -> str:
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    return str(tmp_path / ("t" * (limit - len(ext) - spare) + ext))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr"])
def test_save_to_a_name_at_the_file_name_limit(tmp_path, placement, ext):
    pytest.importorskip("zarr")
    data = np.arange(N * D, dtype=np.float32).reshape(N, D)
    if placement == "file":
        np.save(tmp_path / "src.npy", data)
        g = gl.DataGadget(str(tmp_path / "src.npy"), placement="file")
    else:
        g = gl.DataGadget(torch.from_numpy(data.copy()), placement=placement)
    path = _long_name(tmp_path, ext)
    g.save(path)
    g.save(path)  # and over itself (a replacement: the old one goes aside first)
    back = gl.DataGadget(path, placement="cpu", device="cpu")
    np.testing.assert_array_equal(torch.as_tensor(back[torch.arange(N)]).numpy(), data)
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(
        ["src.npy", os.path.basename(path)] if placement == "file" else [os.path.basename(path)]
    )


def test_temporary_names_fit_the_limit_and_keep_their_prefix(tmp_path):
    target = _long_name(tmp_path, ".npy")
    for tag in ("partial", "old", "trash"):
        tmp = _atomic.temp_path_beside(target, tag)
        assert len(os.fsencode(tmp.name)) <= os.pathconf(tmp_path, "PC_NAME_MAX")
        assert tmp.name.startswith(_atomic.temp_prefix(target, tag))
        assert tmp.parent == tmp_path
    short = str(tmp_path / "a.npy")
    assert _atomic.temp_path_beside(short).name.startswith(".a.npy.partial-")
    # a name of multi-byte characters is cut at a byte and still names a file
    wide = str(tmp_path / ("\u00e9" * 125 + ".npy"))
    tmp = _atomic.temp_path_beside(wide)
    tmp.write_bytes(b"x")
    assert tmp.read_bytes() == b"x"


# ----------------------------------------------------------------------------- zarr trash warning
def test_replacing_a_zarr_store_warns_when_the_old_one_stays(tmp_path, monkeypatch):
    pytest.importorskip("zarr")
    path = str(tmp_path / "t.zarr")
    gl.DataGadget(torch.zeros(N, D), placement="cpu", device="cpu").save(path)
    # the old store's files cannot be removed (read-only folders, for a user who is not
    # root): the removal leaves them
    monkeypatch.setattr(_atomic, "remove_path", lambda p: None)
    with pytest.warns(UserWarning, match=r"could not all be removed; remove .*\.trash-") as got:
        gl.DataGadget(torch.ones(N, D), placement="cpu", device="cpu").save(path)
    assert got[0].filename == __file__  # the warning points at the caller's save
    back = gl.DataGadget(path, placement="cpu", device="cpu")
    assert torch.equal(torch.as_tensor(back[torch.arange(N)]), torch.ones(N, D))
    assert any(n.startswith(".t.zarr.trash-") for n in os.listdir(tmp_path))


def test_replacing_a_zarr_store_is_quiet_when_the_old_one_goes(tmp_path):
    pytest.importorskip("zarr")
    path = str(tmp_path / "t.zarr")
    gl.DataGadget(torch.zeros(N, D), placement="cpu", device="cpu").save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gl.DataGadget(torch.ones(N, D), placement="cpu", device="cpu").save(path)
    assert os.listdir(tmp_path) == ["t.zarr"]


# ----------------------------------------------------------------------------- raw exceptions
def _gadget(tmp_path, placement):
    data = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
    if placement == "file":
        np.save(tmp_path / "t.npy", data)
        return gl.DataGadget(str(tmp_path / "t.npy"), placement="file"), data
    return gl.DataGadget(torch.from_numpy(data.copy()), placement=placement), data


def _rows(g) -> np.ndarray:
    return torch.as_tensor(g[torch.arange(g.shape[0])]).cpu().numpy()


def _nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype notice
        return torch.nested.nested_tensor([torch.ones(3), torch.ones(3)])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_lists_of_tensors_that_require_grad_write_their_values(tmp_path, placement):
    g, data = _gadget(tmp_path, placement)
    a = torch.full((3,), 7.0, requires_grad=True)
    g[[0, 4]] = [a, torch.full((3,), 8.0)]
    data[[0, 4]] = [[7.0] * 3, [8.0] * 3]
    np.testing.assert_array_equal(_rows(g), data)
    assert a.grad is None and a.requires_grad


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "ids, dtype_word",
    [
        ([torch.tensor(1.0, requires_grad=True)], "float32"),
        ([torch.tensor(1, dtype=torch.bfloat16)], "bfloat16"),
    ],
    ids=["requires-grad", "bfloat16"],
)
def test_lists_of_float_id_tensors_are_refused_by_name(tmp_path, placement, ids, dtype_word):
    g, data = _gadget(tmp_path, placement)
    with pytest.raises(gl.GadgetTypeError, match=f"ids must be integers.*{dtype_word}"):
        g[ids]
    with pytest.raises(gl.GadgetTypeError, match=f"ids must be integers.*{dtype_word}"):
        g[ids] = np.zeros((1, 3), dtype=np.float32)
    np.testing.assert_array_equal(_rows(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_list_holding_a_negated_view_writes_its_values(tmp_path, placement):
    g, data = _gadget(tmp_path, placement)
    c = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    neg = c.conj().imag  # a view with its negation pending
    assert neg.is_neg()
    g[[2, 3]] = [neg, torch.zeros(3)]
    data[2] = [-2.0, 4.0, -0.5]
    data[3] = 0.0
    np.testing.assert_array_equal(_rows(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_list_of_int_tensors_reads_the_rows(tmp_path, placement):
    g, data = _gadget(tmp_path, placement)
    got = g[[torch.tensor(4), torch.tensor(1)]]
    np.testing.assert_array_equal(torch.as_tensor(got).cpu().numpy(), data[[4, 1]])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bfloat16_list_on_a_float32_table_is_a_dtype_error(tmp_path, placement):
    g, data = _gadget(tmp_path, placement)
    with pytest.raises(gl.GadgetTypeError, match="float32.*bfloat16"):
        g[[0, 1]] = [torch.ones(3, dtype=torch.bfloat16)] * 2
    np.testing.assert_array_equal(_rows(g), data)


def test_list_of_bfloat16_tensors_makes_a_bfloat16_table():
    rows = [torch.tensor([1.5, -2.25], dtype=torch.bfloat16), torch.tensor([3.0, 0.5]).bfloat16()]
    g = gl.DataGadget(rows, placement="cpu", device="cpu")
    assert g.dtype == torch.bfloat16
    assert torch.equal(torch.as_tensor(g[torch.arange(2)]), torch.stack(rows))
    g2 = gl.DataGadget([torch.ones(2, requires_grad=True)], placement="cpu", device="cpu")
    assert g2.dtype == torch.float32 and torch.equal(g2[torch.arange(1)], torch.ones(1, 2))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_nested_and_meta_tensors_are_refused(tmp_path, placement):
    g, data = _gadget(tmp_path, placement)
    with pytest.raises(gl.GadgetTypeError, match="ids must be a dense.*nested"):
        g[_nested()]
    with pytest.raises(gl.GadgetTypeError, match="data must be a dense tensor; got a nested"):
        g[[0, 1]] = _nested()
    with pytest.raises(gl.GadgetTypeError, match="on the CPU or a CUDA device; got meta"):
        g[[0, 1]] = [torch.ones(3, device="meta"), torch.ones(3)]
    with pytest.raises(gl.GadgetTypeError, match="fill_.*on the CPU or a CUDA device; got meta"):
        g.fill_(torch.tensor(1.0, device="meta"))
    with pytest.raises(gl.GadgetTypeError, match="uniform_'s low must be on the CPU"):
        g.uniform_(torch.tensor(0.0, device="meta"), 1.0)
    np.testing.assert_array_equal(_rows(g), data)
    with pytest.raises(gl.GadgetTypeError, match="source array must be a dense.*nested"):
        gl.DataGadget(_nested(), placement="cpu", device="cpu")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("method", ["uniform_", "normal_"])
@pytest.mark.parametrize("gen", [5, "seed", np.random.default_rng(0)], ids=["int", "str", "numpy"])
def test_generator_that_is_not_a_torch_generator_is_refused(tmp_path, placement, method, gen):
    g, data = _gadget(tmp_path, placement)
    with pytest.raises(gl.GadgetTypeError, match=f"{method} takes a torch.Generator"):
        getattr(g, method)(0.0, 1.0, generator=gen)
    with pytest.raises(gl.GadgetTypeError, match="init_ takes a torch.Generator"):
        g.init_(getattr(torch.nn.init, method), generator=gen)
    np.testing.assert_array_equal(_rows(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_torch_generator_still_gives_reproducible_draws(tmp_path, placement):
    g, _ = _gadget(tmp_path, placement)
    dev = "cuda" if placement in ("cuda", "pinned") else "cpu"
    g.uniform_(-1.0, 1.0, generator=torch.Generator(device=dev).manual_seed(3))
    first = _rows(g).copy()
    g.uniform_(-1.0, 1.0, generator=torch.Generator(device=dev).manual_seed(3))
    np.testing.assert_array_equal(_rows(g), first)
    assert np.all(np.abs(first) <= 1.0) and len(np.unique(first)) > 1


# ----------------------------------------------------------------------------- float128 advice
needs_longdouble = pytest.mark.skipif(
    np.dtype(np.longdouble).itemsize <= 8, reason="NumPy's long double is float64 here"
)


@needs_longdouble
def test_float128_file_message_says_how_to_rewrite_it(tmp_path):
    path = str(tmp_path / "ld.npy")
    np.save(path, np.ones((2, 2), dtype=np.longdouble))
    for kw in ({}, {"dtype": "float64"}):
        with pytest.raises(gl.GadgetTypeError, match=r"a file of this dtype is rewritten first"):
            gl.DataGadget(path, placement="cpu", device="cpu", **kw)
    # an array of that dtype is converted with dtype=, as the message says
    g = gl.DataGadget(np.ones((2, 2), dtype=np.longdouble), placement="cpu", dtype="float64")
    assert g.dtype == torch.float64
    out = subprocess.run(
        [sys.executable, "-m", "gadgetloader", "convert", path, str(tmp_path / "o.h5")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "convert keeps the dtype; rewrite the file as float64 first" in out.stderr
    assert "dtype=" not in out.stderr
    assert not os.path.exists(tmp_path / "o.h5")


# ----------------------------------------------------------------------------- second review
def _model_and_opt(placement):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(50, 4, placement=placement, device=DEVICE),
            "l": torch.nn.Linear(4, 1).to(DEVICE),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=1e-2)

    def step():
        ids = torch.randint(0, 50, (8,), device=DEVICE)
        opt.zero_grad()
        model["l"](model["e"](ids)).sum().backward()
        opt.step()

    step()
    return model, opt, step


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
@pytest.mark.parametrize(
    "option, value, error",
    [
        ("differentiable", True, "differentiable=True\\) cannot be paged"),
        ("betas", (0.9,), "expected 2 values"),
        ("betas", (2.0, 2.0), "could not build an Adam like the given one"),
        ("weight_decay", -1.0, "could not build an Adam like the given one"),
        ("amsgrad", "yes", "expected True or False"),
    ],
)
def test_optimizer_state_dict_with_options_the_constructor_refuses(placement, option, value, error):
    model, opt, step = _model_and_opt(placement)
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    bad["inner"]["param_groups"][0][option] = value
    rows = _rows(model["e"].weight).copy()
    with pytest.raises(gl.GadgetError, match=f"the state dict.*{error}"):
        opt.load_state_dict(bad)
    np.testing.assert_array_equal(_rows(model["e"].weight), rows)
    assert opt.param_groups[0][option] == good["inner"]["param_groups"][0][option]
    opt.load_state_dict(good)  # the optimizer takes its own state and steps on
    step()
    assert not np.array_equal(_rows(model["e"].weight), rows)


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
@pytest.mark.parametrize(
    "tables", [None, 1, [{0: torch.zeros(50, 4)}]], ids=["none", "int", "intkey"]
)
def test_optimizer_state_dict_with_malformed_tables(placement, tables):
    model, opt, _ = _model_and_opt(placement)
    sd = opt.state_dict()
    sd["tables"] = tables
    with pytest.raises(gl.GadgetValueError, match="state_dict|state tables"):
        opt.load_state_dict(sd)


def test_optimizer_options_torch_refuses_with_an_index_error():
    emb = gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError, match=r"Adam refused the options \['betas'\]"):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, betas=(0.9,))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr"])
def test_save_names_no_file_system_takes(tmp_path, placement, ext, monkeypatch):
    pytest.importorskip("zarr")
    g, data = _gadget(tmp_path, placement)
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(gl.GadgetValueError, match="must not contain a NUL"):
        g.save("a\0b" + ext)
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(gl.GadgetFileError, match=f"takes names of at most {limit} bytes"):
        g.save("a" * (limit + 1 - len(ext)) + ext)
    with pytest.raises(gl.GadgetValueError, match="needs a file"):
        g.save(".", format=ext[1:].replace("h5", "hdf5"))
    assert sorted(os.listdir(tmp_path)) == before
    np.testing.assert_array_equal(_rows(g), data)


def test_checkpoint_object_name_too_long_for_a_file(tmp_path):
    emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError, match="give the object a shorter name"):
        gl.save_checkpoint(str(tmp_path / "ck"), {"m" * 300: emb})
    assert not os.path.exists(tmp_path / "ck")  # refused before the directory is made
    with pytest.raises(gl.GadgetValueError, match="must not contain a NUL"):
        gl.save_checkpoint(str(tmp_path / "c\0k"), {"m": emb})


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
@pytest.mark.parametrize(
    "weight",
    [lambda: torch.ones(10, 4, device="meta"), lambda: torch.ones(10, 4).to_sparse()],
    ids=["meta", "sparse"],
)
def test_module_load_state_dict_with_a_tensor_without_dense_values(placement, weight):
    emb = gl.OffloadedEmbedding(10, 4, placement=placement, device=DEVICE)
    rows = _rows(emb.weight).copy()
    with pytest.raises(RuntimeError, match=r"(?s)Error\(s\) in loading state_dict.*dense tensor"):
        emb.load_state_dict({"weight": weight()})
    np.testing.assert_array_equal(_rows(emb.weight), rows)
