"""Black-box review (session 30) of the drop-in OffloadedEmbedding / OffloadedEmbeddingBag
with captured CUDA graphs (and ``GADGETLOADER_CUDA_GRAPHS=0``), trained by torch optimizers
through OffloadedOptimizer against dense ``torch.nn.Embedding`` / ``nn.EmbeddingBag`` twins
on the GPU, and of DataGadget gathers / scatters with CUDA ids; written from README.md,
SPEC.md and the public docstrings only.

Every test here carries the ``gpu`` marker (module level): the project's conftest skips
them where no CUDA device is present. The module imports and collects without CUDA.

What the docs promise and this file checks:

* OffloadedEmbedding docstring: "Several lookups in one step (and over several backward
  passes) are summed in the order torch's autograd sums several uses of one parameter,
  bit-identical to a dense ``nn.Embedding``"; README: "the result is bit-identical to a
  dense ``nn.Embedding`` trained the same way". Plain SGD leaves unused rows alone, as a
  lazy update does, so SGD runs are compared bit for bit (``torch.equal``).
* Optimizers with per-row state (Adam, AdamW, SGD with momentum) move every row of a dense
  table at each step, while the offloaded table is updated lazily ("Rows not used are
  untouched"): their batches therefore hold every row of the table (plus repeats), where
  lazy and dense updates are the same maths; they are compared with float32 tolerances.
  Adagrad (no weight decay) leaves rows with a zero gradient alone, so it takes partial
  batches. SparseAdam is compared with a sparse ``nn.Embedding`` + ``torch.optim.SparseAdam``.
* "captured into a CUDA graph the second time a lookup of the same id count is seen, and
  replayed from then on (one launch; bit-identical results). Each id count keeps up to two
  captured copies ..., at most four counts ...; a copy whose outputs are still referenced
  is never replayed over (the lookup then runs eagerly). Set the environment variable
  ``GADGETLOADER_CUDA_GRAPHS=0`` to turn this off." The docs do not say when the variable
  is read, so it is set (monkeypatch) before the module is built and kept set during the
  run, and once more in a fresh process where it is set from the start.
* "a training forward with an id out of range returns zeros for it, and the step raises
  GadgetIndexError leaving the table, its optimizer state and step counts unchanged (that
  step's lookups are dropped)"; eval lookups, lookups before an optimizer is attached and
  ``cpu``-placement tables are "checked before the forward returns".
* DataGadget: ids "torch tensor (CPU or CUDA) ... of any integer dtype and any shape";
  "a repeated id takes the row of its last occurrence"; bad ids raise GadgetIndexError
  "before anything is written"; "Results are identical whatever the strategy".
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import gadgetloader as gl

pytestmark = pytest.mark.gpu

HAS_CUDA = torch.cuda.is_available()


def _has_cupy() -> bool:
    if not HAS_CUDA:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy

            return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_CUPY = _has_cupy()
needs_cupy = pytest.mark.skipif(not HAS_CUPY, reason="needs a CUDA device and CuPy (pinned)")

#: where lookups are documented to land by default: the current CUDA device
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
ENV = "GADGETLOADER_CUDA_GRAPHS"
REPO = Path(__file__).resolve().parents[1]


def _set_graphs(monkeypatch, on: bool) -> None:
    """The variable is read once, at import (the docstring): in this process graphs are
    switched through the flag it sets (``gadgetloader.switching._graphs.ENABLED``)."""
    from gadgetloader.switching import _graphs

    monkeypatch.setattr(_graphs, "ENABLED", on)


N, D = 12, 5

PINNED = pytest.param("pinned", id="pinned", marks=needs_cupy)
CUDA = pytest.param("cuda", id="cuda")
CPU = pytest.param("cpu", id="cpu")

#: counts seen three times or more (captured at the second, replayed after), 2-D inputs,
#: and more than the four counts a table keeps (so captured copies are dropped)
PARTIAL_SHAPES = [6, 6, 6, 6, (2, 3), 9, 9, 9, 6, 12, 12, (3, 4), 15, 15, 18, 18, 6, 6, 9, 20]
#: the same for batches that hold every row of the N-row table (numel >= N)
FULL_SHAPES = [14, 14, 14, 14, (2, 7), 17, 17, 17, 14, 20, 20, (4, 5), 23, 23, 26, 26, 14, 14]

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "sparse_adam": (torch.optim.SparseAdam, {"lr": 0.05}),
}


# ----------------------------------------------------------------------------- helpers


def _sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def _init_rows(n: int = N, d: int = D, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float32)


def _batches(shapes, *, n: int = N, d: int = D, cover_all: bool, seed: int = 1, dev=DEV):
    """(ids, weights) per step. ``cover_all``: every row of the table is in every batch
    (the rest repeats rows); otherwise random ids with at least one forced repeat."""
    out = []
    for step, shape in enumerate(shapes):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = int(np.prod(shape))
        g = torch.Generator().manual_seed(seed * 1000 + step)
        if cover_all:
            assert numel >= n
            ids = torch.cat(
                [torch.randperm(n, generator=g), torch.randint(0, n, (numel - n,), generator=g)]
            )
            ids = ids[torch.randperm(numel, generator=g)]
        else:
            ids = torch.randint(0, n, (numel,), generator=g)
            ids[-1] = ids[0]
        w = torch.randn(shape + (d,), generator=g)
        out.append((ids.reshape(shape).to(dev), w.to(dev)))
    return out


def _offloaded(placement: str, init: torch.Tensor, *, dev=DEV) -> gl.OffloadedEmbedding:
    emb = gl.OffloadedEmbedding(init.shape[0], init.shape[1], placement=placement, device=dev)
    assert emb.placement == placement
    emb.weight.insertData(init.clone(), torch.arange(init.shape[0]))
    return emb


def _dense(init: torch.Tensor, *, sparse: bool = False, dev=DEV) -> torch.nn.Embedding:
    emb = torch.nn.Embedding(init.shape[0], init.shape[1], sparse=sparse).to(dev)
    with torch.no_grad():
        emb.weight.copy_(init.to(dev))
    return emb


def _train(module, opt, batches, *, keep_outputs: bool = False):
    """The usual loop: zero_grad, forward, backward of sum(out * w), step. Returns the
    forwards' outputs (clones, and the outputs themselves with ``keep_outputs``)."""
    clones, kept = [], []
    for ids, w in batches:
        opt.zero_grad()
        out = module(ids)
        (out * w).sum().backward()
        opt.step()
        clones.append(out.detach().clone())
        if keep_outputs:
            kept.append(out)
    _sync()
    return clones, kept


def _table(module) -> np.ndarray:
    if isinstance(module, (gl.OffloadedEmbedding, gl.OffloadedEmbeddingBag)):
        return module.weight.getNumpyVersion()
    return module.weight.detach().cpu().numpy()


def _pair(placement, opt_name, shapes, *, cover_all, sparse_ref=False, dev=DEV):
    """Train an offloaded table and its dense twin on the same batches."""
    cls, kw = OPTIMIZERS[opt_name]
    init = _init_rows()
    batches = _batches(shapes, cover_all=cover_all, dev=dev)
    emb = _offloaded(placement, init, dev=dev)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    outs, _ = _train(emb, opt, batches)
    ref = _dense(init, sparse=sparse_ref, dev=dev)
    ref_opt = cls(ref.parameters(), **kw)
    ref_outs, _ = _train(ref, ref_opt, batches)
    return emb, outs, ref, ref_outs


def _graph_sequence_run(placement: str = "pinned") -> tuple[np.ndarray, list[np.ndarray]]:
    """Adam over FULL_SHAPES; the final table and every forward's output (also run in a
    fresh process by ``test_graphs_off_in_fresh_process``)."""
    emb, outs, _, _ = _pair(placement, "adam", FULL_SHAPES, cover_all=True)
    return _table(emb), [o.cpu().numpy() for o in outs]


def _state_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_state_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_state_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _close(actual, expected, msg: str = "") -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual), torch.as_tensor(expected), atol=1e-5, rtol=1e-5, msg=msg or None
    )


def _last_wins(table: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """NumPy reference of a write where a repeated id takes its last occurrence's row."""
    ref = table.copy()
    flat = ids.reshape(-1)
    rows = rows.reshape((flat.size,) + table.shape[1:])
    rev = flat[::-1]
    uniq, first_in_rev = np.unique(rev, return_index=True)
    ref[uniq] = rows[flat.size - 1 - first_in_rev]
    return ref


# ------------------------------------------------ OffloadedEmbedding: bit-identical SGD


@pytest.mark.parametrize(
    "placement,graphs",
    [
        pytest.param("pinned", "on", id="pinned-graphs", marks=needs_cupy),
        pytest.param("pinned", "off", id="pinned-nographs", marks=needs_cupy),
        pytest.param("cuda", "on", id="cuda-graphs"),
        pytest.param("cuda", "off", id="cuda-nographs"),
        pytest.param("cpu", "on", id="cpu-graphs"),
    ],
)
def test_sgd_bit_identical_to_dense_embedding(placement, graphs, monkeypatch):
    """Plain SGD, repeated ids, 1-D and 2-D inputs, six id counts (captures, replays and
    dropped captures): every forward and the final table equal the dense twin's bit for bit,
    and lookups land on the CUDA device."""
    _set_graphs(monkeypatch, graphs == "on")
    emb, outs, ref, ref_outs = _pair(placement, "sgd", PARTIAL_SHAPES, cover_all=False)
    for step, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        assert o.device.type == DEV.type, f"step {step}: lookup on {o.device}"
        assert o.shape == r.shape
        assert torch.equal(o, r), f"step {step}: forward differs, max {(o - r).abs().max().item()}"
    got, want = _table(emb), _table(ref)
    assert np.array_equal(got, want), f"final table differs, max {np.abs(got - want).max()}"
    assert not np.array_equal(want, _init_rows().numpy())  # the run trained something


# ----------------------------------------------- OffloadedEmbedding: stateful optimizers


@pytest.mark.parametrize("placement", [PINNED, CUDA])
@pytest.mark.parametrize("opt_name", ["adam", "adamw", "sgd_nesterov", "adagrad"])
def test_optimizer_matches_dense_embedding(opt_name, placement, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cover_all = opt_name != "adagrad"
    shapes = FULL_SHAPES if cover_all else PARTIAL_SHAPES
    emb, outs, ref, ref_outs = _pair(placement, opt_name, shapes, cover_all=cover_all)
    for step, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        assert o.device.type == DEV.type
        _close(o, r, f"{opt_name} step {step}: forward differs")
    _close(_table(emb), _table(ref), f"{opt_name}: final table differs")
    assert not np.allclose(_table(ref), _init_rows().numpy())


def test_adam_cpu_placement_matches_dense_embedding(monkeypatch):
    """A ``cpu`` table on a CUDA machine still delivers lookups and steps on the GPU."""
    monkeypatch.delenv(ENV, raising=False)
    emb, outs, ref, ref_outs = _pair("cpu", "adam", FULL_SHAPES, cover_all=True)
    for o, r in zip(outs, ref_outs, strict=True):
        assert o.device.type == DEV.type
        _close(o, r)
    _close(_table(emb), _table(ref))


@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_sparse_adam_matches_sparse_embedding(placement, monkeypatch):
    """SparseAdam (lazy rows, one step count per table) against torch's own sparse twin."""
    monkeypatch.delenv(ENV, raising=False)
    emb, outs, ref, ref_outs = _pair(
        placement, "sparse_adam", PARTIAL_SHAPES, cover_all=False, sparse_ref=True
    )
    for step, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        _close(o, r, f"SparseAdam step {step}: forward differs")
    _close(_table(emb), _table(ref), "SparseAdam: final table differs")


# ------------------------------------------------------- CUDA graphs on / off, identity


@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_graphs_on_and_off_bit_identical(placement, monkeypatch):
    """ "replayed from then on (one launch; bit-identical results)": Adam over captured,
    replayed and dropped id counts gives the same bits with graphs on and off."""
    monkeypatch.delenv(ENV, raising=False)
    _set_graphs(monkeypatch, True)
    tab_on, outs_on = _graph_sequence_run(placement)
    _set_graphs(monkeypatch, False)
    tab_off, outs_off = _graph_sequence_run(placement)
    for step, (a, b) in enumerate(zip(outs_on, outs_off, strict=True)):
        assert np.array_equal(a, b), f"step {step}: forward differs with graphs off"
    assert np.array_equal(tab_on, tab_off), "final table differs with graphs off"


@needs_cupy
def test_graphs_off_in_fresh_process(tmp_path, monkeypatch):
    """The same run in a process started with GADGETLOADER_CUDA_GRAPHS=0 (whenever the
    library reads the variable) gives the same bits as this process with graphs on."""
    _set_graphs(monkeypatch, True)
    tab_on, outs_on = _graph_sequence_run("pinned")
    target = tmp_path / "off.npz"
    code = (
        "import sys, numpy as np\n"
        "sys.path.insert(0, 'tests')\n"
        "import test_review_session30_gpu as t\n"
        "tab, outs = t._graph_sequence_run('pinned')\n"
        "np.savez(sys.argv[1], tab=tab, *outs)\n"
    )
    env = dict(os.environ)
    env[ENV] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(target) as z:
        assert np.array_equal(z["tab"], tab_on), "final table differs with graphs off"
        for step, a in enumerate(outs_on):
            assert np.array_equal(z[f"arr_{step}"], a), f"step {step}: forward differs"


@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_kept_outputs_are_never_replayed_over(placement, monkeypatch):
    """Outputs kept alive across steps (same id count, so captured copies exist) keep the
    values they had when returned; an eval lookup between steps reads the current table."""
    monkeypatch.delenv(ENV, raising=False)
    init = _init_rows()
    batches = _batches([14] * 8 + [17] * 4 + [14] * 3, cover_all=True)
    emb = _offloaded(placement, init)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    clones, kept = _train(emb, opt, batches, keep_outputs=True)
    ref = _dense(init)
    ref_outs, _ = _train(ref, torch.optim.Adam(ref.parameters(), lr=0.05), batches)
    for step, (k, c, r) in enumerate(zip(kept, clones, ref_outs, strict=True)):
        assert torch.equal(k.detach(), c), f"output of step {step} was overwritten later"
        _close(k.detach(), r, f"step {step}")
    with torch.no_grad():
        ev = emb(batches[0][0])
        ev_ref = ref(batches[0][0])
    _close(ev, ev_ref)
    _close(_table(emb), _table(ref))


@pytest.mark.parametrize(
    "placement,how",
    [
        pytest.param("pinned", "three_lookups", id="pinned-three_lookups", marks=needs_cupy),
        pytest.param("cuda", "three_lookups", id="cuda-three_lookups"),
        pytest.param("pinned", "two_backwards", id="pinned-two_backwards", marks=needs_cupy),
    ],
)
def test_several_lookups_per_step_bit_identical(placement, how, monkeypatch):
    """Three lookups of one id count in a step (more than the two captured copies a count
    keeps), or two backward passes before a step: SGD bit-identical to the dense twin."""
    monkeypatch.delenv(ENV, raising=False)
    init = _init_rows()
    steps = [_batches([8, 8, 8], cover_all=False, seed=10 + s) for s in range(6)]
    emb = _offloaded(placement, init)
    ref = _dense(init)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, triple in enumerate(steps):
        for module, o in ((emb, opt), (ref, ref_opt)):
            o.zero_grad()
            if how == "three_lookups":
                outs = [module(ids) for ids, _ in triple]
                sum((out * w).sum() for out, (_, w) in zip(outs, triple, strict=True)).backward()
            else:
                for ids, w in triple[:2]:
                    (module(ids) * w).sum().backward()
            o.step()
        _sync()
        got, want = _table(emb), _table(ref)
        assert np.array_equal(got, want), f"step {step}: differs, max {np.abs(got - want).max()}"


# ------------------------------------------------------------------- bad CUDA ids


def _snapshot(emb, opt):
    return _table(emb).copy(), copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("bad", ["past_end", "negative"])
@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_bad_training_id_reported_by_step_nothing_changes(placement, bad, monkeypatch):
    """After three steps of one id count (captured, then replayed), a training forward of
    that count with a bad CUDA id returns zeros for it, ``step()`` raises GadgetIndexError
    and table, state and step counts stay as they were; training then goes on as if the
    bad step had never been."""
    monkeypatch.delenv(ENV, raising=False)
    init = _init_rows()
    good = _batches([14] * 6, cover_all=True)
    emb = _offloaded(placement, init)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    _train(emb, opt, good[:3])
    table0, state0 = _snapshot(emb, opt)

    ids, w = _batches([14], cover_all=True, seed=99)[0]
    ids = ids.clone()
    ids[5] = N if bad == "past_end" else -1
    opt.zero_grad()
    out = emb(ids)
    _sync()
    assert torch.equal(out[5].detach().cpu(), torch.zeros(D)), "bad id's row is not zeros"
    (out * w).sum().backward()
    with pytest.raises(gl.GadgetIndexError) as info:
        opt.step()
    assert isinstance(info.value, IndexError)
    _sync()
    assert np.array_equal(_table(emb), table0), "table changed by the refused step"
    assert _state_equal(opt.state_dict(), state0), "optimizer state changed by the refused step"

    _train(emb, opt, good[3:])
    ref = _dense(init)
    _train(ref, torch.optim.Adam(ref.parameters(), lr=0.05), good)
    _close(_table(emb), _table(ref), "training after the refused step differs")


@needs_cupy
def test_bad_training_id_reported_by_zero_grad(monkeypatch):
    """``zero_grad()`` raises GadgetIndexError for a bad CUDA id of a training lookup since
    the last step; nothing changes and training goes on."""
    monkeypatch.delenv(ENV, raising=False)
    init = _init_rows()
    good = _batches([14] * 5, cover_all=True)
    emb = _offloaded("pinned", init)
    opt = gl.OffloadedOptimizer(torch.optim.Adagrad, emb, lr=0.1)
    _train(emb, opt, good[:3])
    table0, state0 = _snapshot(emb, opt)
    ids, w = good[0]
    ids = ids.clone()
    ids[0] = N + 7
    (emb(ids) * w).sum().backward()
    with pytest.raises(gl.GadgetIndexError):
        opt.zero_grad()
    assert np.array_equal(_table(emb), table0)
    assert _state_equal(opt.state_dict(), state0)
    _train(emb, opt, good[3:])
    ref = _dense(init)
    _train(ref, torch.optim.Adagrad(ref.parameters(), lr=0.1), good)
    _close(_table(emb), _table(ref))


def test_bad_training_id_cpu_placement_raises_at_forward(monkeypatch):
    """A ``cpu`` table has no GPU path: a bad CUDA id is refused before the forward returns."""
    monkeypatch.delenv(ENV, raising=False)
    init = _init_rows()
    good = _batches([14] * 4, cover_all=True)
    emb = _offloaded("cpu", init)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    _train(emb, opt, good[:2])
    table0, state0 = _snapshot(emb, opt)
    ids = good[0][0].clone()
    ids[3] = N
    opt.zero_grad()
    with pytest.raises(gl.GadgetIndexError):
        emb(ids)
    opt.step()  # nothing recorded: a no-op
    assert np.array_equal(_table(emb), table0)
    assert _state_equal(opt.state_dict(), state0)
    _train(emb, opt, good[2:])
    ref = _dense(init)
    _train(ref, torch.optim.Adam(ref.parameters(), lr=0.05), good)
    _close(_table(emb), _table(ref))


@pytest.mark.parametrize(
    "placement,mode",
    [
        pytest.param("pinned", "no_grad", id="pinned-no_grad", marks=needs_cupy),
        pytest.param("cuda", "no_grad", id="cuda-no_grad"),
        pytest.param("pinned", "no_optimizer", id="pinned-no_optimizer", marks=needs_cupy),
    ],
)
def test_bad_lookup_without_training_raises_at_forward(placement, mode):
    """ "Lookups made without gradients (torch.no_grad(), or before an optimizer is
    attached) ... are checked before the forward returns"."""
    init = _init_rows()
    emb = _offloaded(placement, init)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1) if mode == "no_grad" else None
    for bad in (N, -1):
        ids = torch.tensor([0, 3, bad, 3], device=DEV)
        with pytest.raises(gl.GadgetIndexError):
            if mode == "no_grad":
                with torch.no_grad():
                    emb(ids)
            else:
                emb(ids)
    assert np.array_equal(_table(emb), init.numpy())
    del opt


# -------------------------------------------------------------- state_dict round trips


@pytest.mark.parametrize(
    "src,dst",
    [
        pytest.param("pinned", "pinned", id="pinned-pinned", marks=needs_cupy),
        pytest.param("cuda", "pinned", id="cuda-pinned", marks=needs_cupy),
        pytest.param("pinned", "cpu", id="pinned-cpu", marks=needs_cupy),
    ],
)
def test_state_dict_round_trip_resumes_training(src, dst, monkeypatch):
    """Module and optimizer state dicts taken mid-run (graphs captured) and loaded into a
    fresh table of another placement: both continue to the same table (bit for bit on the
    same placement), and equal to a dense Adam twin."""
    monkeypatch.delenv(ENV, raising=False)
    init = _init_rows()
    batches = _batches([14, 14, 14, 17, 14, 14, 17, 17], cover_all=True)
    emb = _offloaded(src, init)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    _train(emb, opt, batches[:4])
    sd_model = copy.deepcopy(emb.state_dict())
    sd_opt = copy.deepcopy(opt.state_dict())
    assert np.array_equal(np.asarray(sd_model["weight"].cpu()), _table(emb))

    emb2 = gl.OffloadedEmbedding(N, D, placement=dst)
    emb2.load_state_dict(sd_model)
    assert np.array_equal(_table(emb2), _table(emb))
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.05)
    opt2.load_state_dict(sd_opt)

    outs1, _ = _train(emb, opt, batches[4:])
    outs2, _ = _train(emb2, opt2, batches[4:])
    ref = _dense(init)
    _train(ref, torch.optim.Adam(ref.parameters(), lr=0.05), batches)
    for a, b in zip(outs1, outs2, strict=True):
        assert b.device.type == DEV.type
        if src == dst:
            assert torch.equal(a, b)
        else:
            _close(b, a)
    if src == dst:
        assert np.array_equal(_table(emb2), _table(emb))
    _close(_table(emb2), _table(ref), "resumed run differs from the dense twin")


# ------------------------------------------------------------------ OffloadedEmbeddingBag


def _bag_pair(
    placement, mode, steps, *, opt_cls=torch.optim.SGD, kw=None, include_last_offset=False
):
    kw = kw or {"lr": 0.1}
    init = _init_rows()
    bag = gl.OffloadedEmbeddingBag(
        N, D, mode=mode, placement=placement, include_last_offset=include_last_offset
    )
    assert bag.placement == placement
    bag.weight.insertData(init.clone(), torch.arange(N))
    ref = torch.nn.EmbeddingBag(N, D, mode=mode, include_last_offset=include_last_offset).to(DEV)
    with torch.no_grad():
        ref.weight.copy_(init.to(DEV))
    opt = gl.OffloadedOptimizer(opt_cls, bag, **kw)
    ref_opt = opt_cls(ref.parameters(), **kw)
    for step, (args, w) in enumerate(steps):
        for module, o in ((bag, opt), (ref, ref_opt)):
            o.zero_grad()
            out = module(*args)
            (out * w).sum().backward()
            o.step()
            if module is bag:
                got = out.detach().clone()
            else:
                want = out.detach().clone()
        assert got.device.type == DEV.type
        _close(got, want, f"bag step {step}: forward differs")
    _close(_table(bag), _table(ref), "bag: final table differs")
    return bag, ref


def _bag_2d_steps(seed: int = 3):
    steps = []
    for step, (bags, per) in enumerate([(3, 4), (3, 4), (3, 4), (5, 2), (3, 4), (2, 6)]):
        g = torch.Generator().manual_seed(seed * 100 + step)
        ids = torch.randint(0, N, (bags, per), generator=g)
        ids[0, -1] = ids[0, 0]  # a repeat inside a bag
        w = torch.randn(bags, D, generator=g)
        steps.append(((ids.to(DEV),), w.to(DEV)))
    return steps


@pytest.mark.parametrize(
    "placement,mode",
    [
        pytest.param("pinned", "sum", id="pinned-sum", marks=needs_cupy),
        pytest.param("pinned", "mean", id="pinned-mean", marks=needs_cupy),
        pytest.param("pinned", "max", id="pinned-max", marks=needs_cupy),
    ],
)
def test_bag_2d_input_matches_dense_bag(placement, mode):
    _bag_pair(placement, mode, _bag_2d_steps())


@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_bag_offsets_and_per_sample_weights_match_dense_bag(placement):
    """1-D input with int32 / int64 CUDA offsets (an empty bag among them) and
    per_sample_weights, mode 'sum', trained by Adagrad."""
    steps = []
    for step, offs in enumerate([[0, 3, 3, 7], [0, 2, 5, 9], [0, 3, 3, 7], [0, 1, 4, 6]]):
        g = torch.Generator().manual_seed(500 + step)
        length = offs[-1] + 2
        ids = torch.randint(0, N, (length,), generator=g)
        ids[-1] = ids[0]
        psw = torch.rand(length, generator=g) + 0.5
        odtype = torch.int32 if step % 2 else torch.int64
        offsets = torch.tensor(offs, dtype=odtype)
        w = torch.randn(len(offs), D, generator=g)
        steps.append(((ids.to(DEV), offsets.to(DEV), psw.to(DEV)), w.to(DEV)))
    _bag_pair(placement, "sum", steps, opt_cls=torch.optim.Adagrad, kw={"lr": 0.1})


@needs_cupy
def test_bag_include_last_offset_matches_dense_bag():
    steps = []
    for step, offs in enumerate([[0, 2, 6, 9], [0, 4, 4, 8], [0, 2, 6, 9]]):
        g = torch.Generator().manual_seed(700 + step)
        ids = torch.randint(0, N, (offs[-1],), generator=g)
        w = torch.randn(len(offs) - 1, D, generator=g)
        steps.append(((ids.to(DEV), torch.tensor(offs).to(DEV)), w.to(DEV)))
    _bag_pair("pinned", "mean", steps, include_last_offset=True)


@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_bag_bad_cuda_id_refused_nothing_changes(placement):
    """A bag lookup with an id past the table: GadgetIndexError (at the forward or at the
    step), the table and optimizer state unchanged, later steps train normally."""
    init = _init_rows()
    bag = gl.OffloadedEmbeddingBag(N, D, mode="sum", placement=placement)
    bag.weight.insertData(init.clone(), torch.arange(N))
    opt = gl.OffloadedOptimizer(torch.optim.Adagrad, bag, lr=0.1)
    steps = _bag_2d_steps(seed=9)
    for args, w in steps[:2]:
        opt.zero_grad()
        (bag(*args) * w).sum().backward()
        opt.step()
    table0, state0 = _snapshot(bag, opt)
    ids = steps[0][0][0].clone()
    ids[1, 1] = N
    opt.zero_grad()
    with pytest.raises(gl.GadgetIndexError):
        out = bag(ids)
        (out * steps[0][1]).sum().backward()
        opt.step()
    _sync()
    assert np.array_equal(_table(bag), table0)
    assert _state_equal(opt.state_dict(), state0)
    opt.zero_grad()
    for args, w in steps[2:]:
        opt.zero_grad()
        (bag(*args) * w).sum().backward()
        opt.step()
    ref = torch.nn.EmbeddingBag(N, D, mode="sum").to(DEV)
    with torch.no_grad():
        ref.weight.copy_(init.to(DEV))
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    for args, w in steps:
        ref_opt.zero_grad()
        (ref(*args) * w).sum().backward()
        ref_opt.step()
    _close(_table(bag), _table(ref))


# ------------------------------------------------------ DataGadget gathers / scatters


TN, TD = 50, 3


def _table_arr(n: int = TN, d: int = TD, seed: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def _gadget(placement: str, arr: np.ndarray, tmp_path: Path, **kw) -> gl.DataGadget:
    if placement == "file":
        path = tmp_path / "table.npy"
        np.save(path, arr)
        g = gl.DataGadget(str(path), placement="file", **kw)
    else:
        g = gl.DataGadget(arr, placement=placement, **kw)
    assert g.placement == placement
    return g


FILE = pytest.param("file", id="file")


@pytest.mark.parametrize("placement", [PINNED, CUDA, FILE])
def test_getdata_cuda_ids_matches_numpy(placement, tmp_path):
    """1-D int64 CUDA ids with repeats, 2-D int32 CUDA ids, through getData, gather and
    ``g[ids]``: rows on the CUDA device, equal to NumPy's."""
    arr = _table_arr()
    g = _gadget(placement, arr, tmp_path)
    rng = np.random.default_rng(0)
    ids1 = rng.integers(0, TN, 40)
    ids1[-3:] = ids1[0]
    ids2 = rng.integers(0, TN, (4, 6)).astype(np.int32)
    ids2[-1, -1] = TN - 1
    for ids in (ids1, ids2):
        t = torch.from_numpy(ids).to(DEV)
        for res in (g.getData(t), g.gather(t), g[t]):
            assert res.device.type == DEV.type
            assert res.shape == ids.shape + (TD,)
            assert np.array_equal(res.cpu().numpy(), arr[ids])
    # check_ids=False on valid ids and a given ``out`` tensor
    t = torch.from_numpy(ids1).to(DEV)
    assert np.array_equal(g.getData(t, check_ids=False).cpu().numpy(), arr[ids1])
    out = torch.empty((ids1.size, TD), device=DEV)
    res = g.getData(t, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert np.array_equal(out.cpu().numpy(), arr[ids1])


@pytest.mark.parametrize("placement", [PINNED, CUDA, FILE])
def test_scatter_cuda_ids_last_occurrence_wins(placement, tmp_path):
    arr = _table_arr()
    g = _gadget(placement, arr, tmp_path)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, TN, 200)  # many repeats
    rows = rng.standard_normal((200, TD)).astype(np.float32)
    g.scatter(torch.from_numpy(ids).to(DEV), torch.from_numpy(rows).to(DEV))
    _sync()
    ref = _last_wins(arr, ids, rows)
    assert np.array_equal(g.getNumpyVersion(), ref)
    # SpeedTorch's order, 2-D CUDA ids
    ids2 = rng.integers(0, TN, (5, 8))
    ids2[4, 7] = ids2[0, 0]
    rows2 = rng.standard_normal((5, 8, TD)).astype(np.float32)
    g.insertData(torch.from_numpy(rows2).to(DEV), torch.from_numpy(ids2).to(DEV))
    _sync()
    ref = _last_wins(ref, ids2, rows2)
    assert np.array_equal(g.getNumpyVersion(), ref)
    if placement == "file":
        g.flush()
        assert np.array_equal(np.load(tmp_path / "table.npy"), ref)


@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_large_gather_and_scatter_with_repeats(placement, tmp_path):
    """70,000 CUDA ids over 4,096 rows (the pinned "read each distinct row once" gather)
    and a 2**18-id scatter full of repeats, against NumPy."""
    n = 4096
    arr = _table_arr(n, 8, seed=5)
    g = _gadget(placement, arr, tmp_path)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, n, 70_000)
    t = torch.from_numpy(ids).to(DEV)
    assert np.array_equal(g.getData(t).cpu().numpy(), arr[ids])
    assert np.array_equal(g.getData(t, check_ids=False).cpu().numpy(), arr[ids])
    sids = rng.integers(0, n, 2**18)
    rows = rng.standard_normal((2**18, 8)).astype(np.float32)
    g.insertData(torch.from_numpy(rows).to(DEV), torch.from_numpy(sids).to(DEV))
    _sync()
    assert np.array_equal(g.getNumpyVersion(), _last_wins(arr, sids, rows))


@needs_cupy
@pytest.mark.parametrize("strategy", ["sorted", "hybrid"])
def test_strategies_give_identical_results(strategy, tmp_path):
    """ "Results are identical whatever the strategy": a pinned table with CUDA ids."""
    n = 2000
    arr = _table_arr(n, 4, seed=6)
    g = _gadget("pinned", arr, tmp_path, strategy=strategy)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, n, 3000)
    assert np.array_equal(g.getData(torch.from_numpy(ids).to(DEV)).cpu().numpy(), arr[ids])
    sids = np.sort(rng.integers(0, n, 2500))
    assert np.array_equal(g.getData(torch.from_numpy(sids).to(DEV)).cpu().numpy(), arr[sids])
    rows = rng.standard_normal((3000, 4)).astype(np.float32)
    g.insertData(torch.from_numpy(rows).to(DEV), torch.from_numpy(ids).to(DEV))
    _sync()
    assert np.array_equal(g.getNumpyVersion(), _last_wins(arr, ids, rows))


@pytest.mark.parametrize("placement", [PINNED, CUDA, FILE])
def test_bad_cuda_ids_raise_table_unchanged(placement, tmp_path):
    arr = _table_arr()
    g = _gadget(placement, arr, tmp_path)
    for bad in (TN, -1, TN + 1000):
        ids = torch.tensor([0, 7, bad, 7], device=DEV)
        with pytest.raises(gl.GadgetIndexError) as info:
            g.getData(ids)
        assert isinstance(info.value, IndexError)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.ones(4, TD, device=DEV), ids)
        with pytest.raises(gl.GadgetIndexError):
            g.scatter(ids, torch.ones(4, TD, device=DEV))
        _sync()
        assert np.array_equal(g.getNumpyVersion(), arr), f"table changed by a refused write ({bad})"
    if placement == "file":
        assert np.array_equal(np.load(tmp_path / "table.npy"), arr)


@pytest.mark.parametrize("placement", [PINNED, CUDA])
def test_large_scatter_with_one_bad_cuda_id_writes_nothing(placement, tmp_path):
    n = 4096
    arr = _table_arr(n, 8, seed=7)
    g = _gadget(placement, arr, tmp_path)
    rng = np.random.default_rng(4)
    for count in (3000, 2**18):
        ids = torch.from_numpy(rng.integers(0, n, count)).to(DEV)
        ids[count // 2] = n
        rows = torch.ones(count, 8, device=DEV)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(rows, ids)
        _sync()
        assert np.array_equal(g.getNumpyVersion(), arr), f"{count} ids: table changed"


@needs_cupy
def test_gather_many_scatter_many_cuda_ids(tmp_path):
    """Tables of one row count (pinned float32, pinned float32, cuda int64 of the same row
    bytes): rows as NumPy's, writes last-wins in every table; a bad id changes none."""
    arrs = [
        _table_arr(TN, 4, seed=8),
        _table_arr(TN, 4, seed=9),
        np.arange(TN * 2, dtype=np.int64).reshape(TN, 2),
    ]
    gs = [
        gl.DataGadget(arrs[0], placement="pinned"),
        gl.DataGadget(arrs[1], placement="pinned"),
        gl.DataGadget(arrs[2], placement="cuda"),
    ]
    rng = np.random.default_rng(5)
    ids = rng.integers(0, TN, (6, 7))
    t = torch.from_numpy(ids).to(DEV)
    res = gl.gather_many(gs, t)
    assert len(res) == 3
    for r, a in zip(res, arrs, strict=True):
        assert r.device.type == DEV.type
        assert np.array_equal(r.cpu().numpy(), a[ids])
    rows = [
        rng.standard_normal((6, 7, 4)).astype(np.float32),
        rng.standard_normal((6, 7, 4)).astype(np.float32),
        rng.integers(-100, 100, (6, 7, 2)).astype(np.int64),
    ]
    gl.scatter_many(gs, [torch.from_numpy(r).to(DEV) for r in rows], t)
    _sync()
    refs = [_last_wins(a, ids, r) for a, r in zip(arrs, rows, strict=True)]
    for g, ref in zip(gs, refs, strict=True):
        assert np.array_equal(g.getNumpyVersion(), ref)
    bad = t.clone()
    bad[2, 3] = TN
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many(gs, bad)
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(gs, [torch.zeros_like(torch.from_numpy(r)).to(DEV) for r in rows], bad)
    _sync()
    for g, ref in zip(gs, refs, strict=True):
        assert np.array_equal(g.getNumpyVersion(), ref), "a table changed by a refused scatter_many"
