"""Black-box review (session 31) of checkpoints of offloaded models and optimizers
(``gl.save_checkpoint`` / ``gl.load_checkpoint``, state_dict round trips, torch.save /
pickle / deepcopy, atomicity, refusals, bit-identical resume, float16 / bfloat16 tables);
written from README.md, SPEC.md and the public docstrings only."""

from __future__ import annotations

import copy
import errno
import io
import os
import pathlib
import pickle
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.nn import functional as nnf

import gadgetloader as gl

FORMATS = ["npy", "hdf5", "zarr"]


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


# ----------------------------------------------------------------------------- helpers

N_ITEM, N_BAG, DIM = 20, 15, 4


def build(
    seed=0,
    *,
    n=N_ITEM,
    nb=N_BAG,
    d=DIM,
    dtype=torch.float32,
    optc=torch.optim.Adam,
    head=True,
    extra=None,
    opt_kwargs=None,
):
    torch.manual_seed(seed)
    mods = {
        "item": gl.OffloadedEmbedding(n, d, placement="cpu", device="cpu", dtype=dtype),
        "bag": gl.OffloadedEmbeddingBag(
            nb, d, mode="mean", placement="cpu", device="cpu", dtype=dtype
        ),
    }
    if head:
        mods["head"] = torch.nn.Linear(d, 1)
    if extra:
        mods.update(extra)
    model = torch.nn.ModuleDict(mods)
    opt = gl.OffloadedOptimizer(optc, model, **(opt_kwargs or {"lr": 0.01}))
    return model, opt


def batches(k, seed=123, n=N_ITEM, nb=N_BAG):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, n, (8,), generator=g), torch.randint(0, nb, (6, 3), generator=g))
        for _ in range(k)
    ]


def forward_loss(model, ids, hist):
    x = model["item"](ids).float()[:6] * model["bag"](hist).float()
    if "head" in model:
        x = model["head"](x)
    return x.pow(2).sum()


def train(model, opt, bs):
    for ids, hist in bs:
        loss = forward_loss(model, ids, hist)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _bits(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def full_state(model, opt=None):
    """Everything a resume depends on, as detached copies."""
    out = {}
    for k, v in model.state_dict().items():
        out["m." + k] = torch.as_tensor(v).detach().clone()
    if opt is not None:
        sd = opt.state_dict()
        out["opt"] = copy.deepcopy(sd)
    return out


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(_bits(a), _bits(b)), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            path,
            sorted(map(str, a)),
            sorted(map(str, b)),
        )
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b and type(a) is type(b), (path, a, b)


def tables_state(model):
    return {k: torch.as_tensor(v).detach().clone() for k, v in model.state_dict().items()}


def listing(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else None


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_into_fresh_objects(tmp_path, fmt, verify):
    model, opt = build()
    train(model, opt, batches(3))
    want = full_state(model, opt)
    gl.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt}, format=fmt)
    assert os.path.isfile(tmp_path / "ck" / "meta.pt")
    m2, o2 = build(seed=7, opt_kwargs={"lr": 0.5})
    assert not torch.equal(m2["head"].weight, model["head"].weight)
    gl.load_checkpoint(str(tmp_path / "ck"), {"model": m2, "optimizer": o2}, verify=verify)
    assert_same(want, full_state(m2, o2))
    assert o2.param_groups[0]["lr"] == 0.01  # the saved options come back


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_does_not_change_objects(tmp_path, fmt):
    model, opt = build()
    train(model, opt, batches(2))
    want = full_state(model, opt)
    gl.save_checkpoint(
        tmp_path / "ck", {"model": model, "optimizer": opt}, format=fmt, progress=False
    )
    assert_same(want, full_state(model, opt))


OPTIMIZERS = [
    ("Adam", torch.optim.Adam, {"lr": 0.01}),
    ("AdamW-amsgrad", torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    ("SGD-nesterov", torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 0.1}),
    ("RMSprop-centered", torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("Rprop", torch.optim.Rprop, {"lr": 0.01}),
    ("ASGD", torch.optim.ASGD, {"lr": 0.01}),
    ("Adadelta", torch.optim.Adadelta, {"lr": 1.0}),
    ("Adamax", torch.optim.Adamax, {"lr": 0.01}),
    ("NAdam", torch.optim.NAdam, {"lr": 0.01}),
    ("RAdam", torch.optim.RAdam, {"lr": 0.01}),
    ("SparseAdam", torch.optim.SparseAdam, {"lr": 0.01}),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,optc,kw", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_resume_bit_identical_to_uninterrupted(tmp_path, fmt, name, optc, kw):
    head = optc is not torch.optim.SparseAdam
    bs = batches(6)
    ref_m, ref_o = build(optc=optc, opt_kwargs=kw, head=head)
    train(ref_m, ref_o, bs)

    m1, o1 = build(optc=optc, opt_kwargs=kw, head=head)
    train(m1, o1, bs[:3])
    gl.save_checkpoint(tmp_path / "ck", {"model": m1, "optimizer": o1}, format=fmt)
    m2, o2 = build(seed=99, optc=optc, opt_kwargs=kw, head=head)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    del m1, o1
    train(m2, o2, bs[3:])
    assert_same(full_state(ref_m, ref_o), full_state(m2, o2))


def _plain_reference(model0, bs, lr, steps):
    """Dense torch reference: each step trains nn.Parameters holding the step's distinct
    rows with torch.optim.Adam (lazy per-row updates, one step count per table)."""
    W = {k: model0[k].weight.getNumpyVersion().copy() for k in ("item", "bag")}
    W = {k: torch.from_numpy(v) for k, v in W.items()}
    M = {k: torch.zeros_like(v) for k, v in W.items()}
    V = {k: torch.zeros_like(v) for k, v in W.items()}
    S = {k: 0 for k in W}
    head = copy.deepcopy(model0["head"])
    hopt = torch.optim.Adam(head.parameters(), lr=lr)
    for ids, hist in bs[:steps]:
        ui, li = torch.unique(ids, return_inverse=True)
        ub, lb = torch.unique(hist, return_inverse=True)
        P = {
            "item": W["item"][ui].clone().requires_grad_(),
            "bag": W["bag"][ub].clone().requires_grad_(),
        }
        x = nnf.embedding(li, P["item"])[:6] * nnf.embedding_bag(lb, P["bag"], mode="mean")
        loss = head(x).pow(2).sum()
        hopt.zero_grad()
        loss.backward()
        hopt.step()
        for k, u in (("item", ui), ("bag", ub)):
            o = torch.optim.Adam([P[k]], lr=lr)
            o.state[P[k]] = {
                "step": torch.tensor(float(S[k])),
                "exp_avg": M[k][u].clone(),
                "exp_avg_sq": V[k][u].clone(),
            }
            o.step()
            st = o.state[P[k]]
            W[k][u] = P[k].detach()
            M[k][u] = st["exp_avg"]
            V[k][u] = st["exp_avg_sq"]
            S[k] += 1
    return W, M, V, head


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_matches_plain_torch_reference(tmp_path, fmt):
    bs = batches(6)
    m1, o1 = build()
    W, M, V, head = _plain_reference(m1, bs, 0.01, 6)
    train(m1, o1, bs[:3])
    gl.save_checkpoint(tmp_path / "ck", {"model": m1, "optimizer": o1}, format=fmt)
    m2, o2 = build(seed=5)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    train(m2, o2, bs[3:])
    for i, k in enumerate(("item", "bag")):
        assert torch.equal(torch.from_numpy(m2[k].weight.getNumpyVersion()), W[k]), k
        tabs = o2.pagers[i].tables
        assert tabs["exp_avg"].shape == M[k].shape
        got_m = torch.from_numpy(tabs["exp_avg"].getNumpyVersion())
        got_v = torch.from_numpy(tabs["exp_avg_sq"].getNumpyVersion())
        # pager order is not documented: match by content
        cand = [(M[kk], V[kk]) for kk in ("item", "bag") if M[kk].shape == got_m.shape]
        assert any(torch.equal(got_m, a) and torch.equal(got_v, b) for a, b in cand), k
    assert torch.equal(m2["head"].weight, head.weight)
    assert torch.equal(m2["head"].bias, head.bias)


def test_only_some_objects_loaded(tmp_path):
    model, opt = build()
    train(model, opt, batches(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt})
    m2, o2 = build(seed=3)
    before_opt = copy.deepcopy(o2.state_dict())
    gl.load_checkpoint(tmp_path / "ck", {"model": m2})
    assert_same(full_state(model), full_state(m2))
    assert_same(before_opt, o2.state_dict())


# ----------------------------------------------------------------------------- overwrite


@pytest.mark.parametrize("fmt", FORMATS)
def test_overwrite_keeps_one_checkpoint(tmp_path, fmt):
    d = tmp_path / "ck"
    model, opt = build()
    train(model, opt, batches(2))
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=fmt)
    first = listing(d)
    train(model, opt, batches(2, seed=9))
    want = full_state(model, opt)
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=fmt)
    second = listing(d)
    assert len(second) == len(first)
    assert not (set(first) - {"meta.pt"}) & set(second)  # old table files removed
    m2, o2 = build(seed=4)
    gl.load_checkpoint(d, {"model": m2, "optimizer": o2})
    assert_same(want, full_state(m2, o2))


def test_overwrite_in_another_format(tmp_path):
    d = tmp_path / "ck"
    model, opt = build()
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="npy")
    train(model, opt, batches(2))
    want = full_state(model, opt)
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="hdf5")
    names = listing(d)
    assert not [n for n in names if n.endswith(".npy")], names
    m2, o2 = build(seed=4)
    gl.load_checkpoint(d, {"model": m2, "optimizer": o2})
    assert_same(want, full_state(m2, o2))


def test_overwrite_with_fewer_objects(tmp_path):
    d = tmp_path / "ck"
    model, opt = build()
    gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    train(model, opt, batches(2))
    gl.save_checkpoint(d, {"model": model})
    assert not [n for n in listing(d) if n.startswith("optimizer")]
    m2, o2 = build(seed=4)
    with pytest.raises(gl.GadgetKeyError):
        gl.load_checkpoint(d, {"model": m2, "optimizer": o2})
    gl.load_checkpoint(d, {"model": m2})
    assert_same(full_state(model), full_state(m2))


# ----------------------------------------------------------------------------- atomicity


def _fail_nth(mp, mod, name, n, exc):
    """Make the n-th call fail; for os.fsync only calls on regular files count (an fsync of
    a directory is best-effort on many systems)."""
    orig = getattr(mod, name)
    calls = [0]

    def f(*a, **k):
        if name == "fsync" and not stat.S_ISREG(os.fstat(a[0]).st_mode):
            return orig(*a, **k)
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return orig(*a, **k)

    mp.setattr(mod, name, f)
    return calls


FAILURES = ["fsync-enospc", "fsync-interrupt", "meta-replace", "meta-write"]


@pytest.mark.parametrize("how", FAILURES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_failed_save_keeps_old_checkpoint(tmp_path, monkeypatch, fmt, how):
    d = tmp_path / "ck"
    model, opt = build()
    train(model, opt, batches(2))
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=fmt)
    old = full_state(model, opt)
    before = listing(d)
    train(model, opt, batches(2, seed=11))
    with monkeypatch.context() as mp:
        if how == "fsync-enospc":
            calls = _fail_nth(mp, os, "fsync", 3, OSError(errno.ENOSPC, "No space left on device"))
            exc = (OSError,)
        elif how == "fsync-interrupt":
            calls = _fail_nth(mp, os, "fsync", 3, KeyboardInterrupt())
            exc = (KeyboardInterrupt,)
        elif how == "meta-replace":
            orig = os.replace
            calls = [0]

            def rep(a, b, *r, **k):
                if os.fspath(b).endswith("meta.pt"):
                    calls[0] += 1
                    raise OSError(errno.EIO, "I/O error")
                return orig(a, b, *r, **k)

            mp.setattr(os, "replace", rep)
            exc = (OSError,)
        else:  # the real write of meta.pt fails (not an in-memory check)
            orig = torch.save
            calls = [0]

            def sv(obj, f, *a, **k):
                if not isinstance(f, io.BytesIO):
                    calls[0] += 1
                    raise OSError(errno.ENOSPC, "No space left on device")
                return orig(obj, f, *a, **k)

            mp.setattr(torch, "save", sv)
            exc = (OSError,)
        with pytest.raises(exc):
            gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=fmt)
    assert calls[0] >= 1, "the simulated failure was not reached"
    assert listing(d) == before  # the files it had written are removed
    m2, o2 = build(seed=4)
    gl.load_checkpoint(d, {"model": m2, "optimizer": o2})
    assert_same(old, full_state(m2, o2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_failed_first_save_leaves_no_table_files(tmp_path, monkeypatch, fmt):
    d = tmp_path / "ck"
    model, opt = build()
    with monkeypatch.context() as mp:
        _fail_nth(mp, os, "fsync", 2, OSError(errno.ENOSPC, "No space left on device"))
        with pytest.raises(OSError):
            gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=fmt)
    assert not listing(d)
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(d, {"model": model})


@pytest.mark.parametrize(
    "fmt,how",
    [
        ("npy", "fsync-enospc"),
        ("hdf5", "fsync-enospc"),
        ("zarr", "fsync-enospc"),
        ("npy", "meta-replace"),
    ],
)
def test_write_failure_is_a_gadget_error(tmp_path, monkeypatch, fmt, how):
    """README, Errors: "Every error the library raises derives from gl.GadgetError and the
    matching builtin" (GadgetFileError is an OSError)."""
    model, opt = build()
    with monkeypatch.context() as mp:
        if how == "fsync-enospc":
            calls = _fail_nth(mp, os, "fsync", 1, OSError(errno.ENOSPC, "No space left on device"))
        else:
            orig = os.replace
            calls = [0]

            def rep(a, b, *r, **k):
                if os.fspath(b).endswith("meta.pt"):
                    calls[0] += 1
                    raise OSError(errno.EIO, "I/O error")
                return orig(a, b, *r, **k)

            mp.setattr(os, "replace", rep)
        with pytest.raises(OSError) as ei:
            gl.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt}, format=fmt)
    assert calls[0] >= 1
    assert isinstance(ei.value, gl.GadgetError), repr(ei.value)


_SUBPROC_HEADER = textwrap.dedent("""
    import os, sys, signal, resource, warnings
    import torch, gadgetloader as gl
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", module="zarr.*")
    def build(seed, init=None):
        torch.manual_seed(seed)
        return torch.nn.ModuleDict({
            "a": gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu", init=init),
            "b": gl.OffloadedEmbedding(20000, 16, placement="cpu", device="cpu", init=init)})
""")


def _run(code, cwd):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-c", _SUBPROC_HEADER + textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_save_on_full_disk_keeps_old_checkpoint(tmp_path):
    """A real write failure (RLIMIT_FSIZE: EFBIG once a file passes 60 kB) in each format."""
    code = """
    import numpy as np
    out = []
    for fmt in ["npy", "hdf5", "zarr"]:
        d = "ck_" + fmt
        model = build(0)
        gl.save_checkpoint(d, {"m": model}, format=fmt, progress=False)
        before = sorted(os.listdir(d))
        ref = {k: v.clone() for k, v in model.state_dict().items()}
        model["a"].weight.fill_(1.0); model["b"].weight.normal_(0.0, 1.0)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (60000, resource.RLIM_INFINITY))
        try:
            gl.save_checkpoint(d, {"m": model}, format=fmt, progress=False)
            err = "no error"
        except gl.GadgetError as e:
            err = "ok" if isinstance(e, OSError) else type(e).__name__
        except BaseException as e:
            err = type(e).__name__
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        same = sorted(os.listdir(d)) == before
        m2 = build(1, init=torch.nn.init.zeros_)
        gl.load_checkpoint(d, {"m": m2})
        old = all(torch.equal(ref[k], v) for k, v in m2.state_dict().items())
        out.append(f"{fmt}:{err}:{same}:{old}")
    print("RESULT", " ".join(out))
    """
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT npy:ok:True:True hdf5:ok:True:True zarr:ok:True:True" in r.stdout, r.stdout
    assert "ResourceWarning" not in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("where", ["meta", "table"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_killed_save_leaves_previous_checkpoint_whole(tmp_path, fmt, where):
    """The process dies (os._exit) when the new meta.pt is about to replace the old one,
    or half-way through the new table files."""
    code = f"""
    fmt, where = {fmt!r}, {where!r}
    model = build(0)
    gl.save_checkpoint("ck", {{"m": model}}, format=fmt, progress=False)
    torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, "ref.pt")
    model["a"].weight.fill_(1.0); model["b"].weight.fill_(2.0)
    orig_replace, orig_fsync = os.replace, os.fsync
    n = [0]
    def rep(a, b, *r, **k):
        if os.fspath(b).endswith("meta.pt"):
            os._exit(17)
        return orig_replace(a, b, *r, **k)
    def fs(fd):
        n[0] += 1
        if n[0] == 2:
            os._exit(17)
        return orig_fsync(fd)
    if where == "meta":
        os.replace = rep
    else:
        os.fsync = fs
    gl.save_checkpoint("ck", {{"m": model}}, format=fmt, progress=False)
    print("NOT KILLED")
    """
    r = _run(code, tmp_path)
    assert r.returncode == 17, (r.returncode, r.stdout, r.stderr[-2000:])
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    torch.manual_seed(1)
    m2 = torch.nn.ModuleDict(
        {
            "a": gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbedding(20000, 16, placement="cpu", device="cpu"),
        }
    )
    gl.load_checkpoint(tmp_path / "ck", {"m": m2})
    for k, v in m2.state_dict().items():
        assert torch.equal(v, ref[k]), k
    # a later save over the leftovers works and loads back
    m2["a"].weight.fill_(3.0)
    gl.save_checkpoint(tmp_path / "ck", {"m": m2}, format=fmt, progress=False)
    torch.manual_seed(2)
    m3 = torch.nn.ModuleDict(
        {
            "a": gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbedding(20000, 16, placement="cpu", device="cpu"),
        }
    )
    gl.load_checkpoint(tmp_path / "ck", {"m": m3})
    assert (m3["a"].weight.getNumpyVersion() == 3.0).all()
    assert np.array_equal(m3["b"].weight.getNumpyVersion(), ref["b.weight"].numpy())


# ----------------------------------------------------------------------------- refusals


def _misfit(case):
    """(model, optimizer) that do not fit a checkpoint of build()'s objects."""
    if case == "more-rows":
        return build(seed=3, n=N_ITEM + 1)
    if case == "fewer-rows-bag":
        return build(seed=3, nb=N_BAG - 1)
    if case == "dim":
        return build(seed=3, d=DIM + 1)
    if case == "dtype-f64":
        return build(seed=3, dtype=torch.float64)
    if case == "opt-NAdam":
        return build(seed=3, optc=torch.optim.NAdam)
    if case == "opt-AdamW":
        return build(seed=3, optc=torch.optim.AdamW)
    if case == "opt-SGD":
        return build(seed=3, optc=torch.optim.SGD, opt_kwargs={"lr": 0.1, "momentum": 0.9})
    if case == "extra-table":
        return build(
            seed=3, extra={"more": gl.OffloadedEmbedding(3, DIM, placement="cpu", device="cpu")}
        )
    if case == "extra-dense":
        return build(seed=3, extra={"lin2": torch.nn.Linear(2, 2)})
    if case == "no-bag":
        torch.manual_seed(3)
        m = torch.nn.ModuleDict(
            {
                "item": gl.OffloadedEmbedding(N_ITEM, DIM, placement="cpu", device="cpu"),
                "head": torch.nn.Linear(DIM, 1),
            }
        )
        return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.01)
    if case == "head-shape":
        torch.manual_seed(3)
        m = torch.nn.ModuleDict(
            {
                "item": gl.OffloadedEmbedding(N_ITEM, DIM, placement="cpu", device="cpu"),
                "bag": gl.OffloadedEmbeddingBag(
                    N_BAG, DIM, mode="mean", placement="cpu", device="cpu"
                ),
                "head": torch.nn.Linear(DIM, 2),
            }
        )
        return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.01)
    if case == "param-groups":
        torch.manual_seed(3)
        m = torch.nn.ModuleDict(
            {
                "item": gl.OffloadedEmbedding(N_ITEM, DIM, placement="cpu", device="cpu"),
                "bag": gl.OffloadedEmbeddingBag(
                    N_BAG, DIM, mode="mean", placement="cpu", device="cpu"
                ),
                "head": torch.nn.Linear(DIM, 1),
            }
        )
        o = gl.OffloadedOptimizer(
            torch.optim.Adam,
            [{"params": m["item"], "lr": 0.1}, {"params": [m["bag"], m["head"]]}],
            lr=0.01,
        )
        return m, o
    raise AssertionError(case)


MISFITS = [
    "more-rows",
    "fewer-rows-bag",
    "dim",
    "dtype-f64",
    "opt-NAdam",
    "opt-AdamW",
    "opt-SGD",
    "extra-table",
    "extra-dense",
    "no-bag",
    "head-shape",
    "param-groups",
]


@pytest.fixture(scope="module")
def saved_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved") / "ck"
    model, opt = build()
    train(model, opt, batches(3))
    gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    return d


@pytest.mark.parametrize("case", MISFITS)
def test_misfit_refused_and_nothing_changed(saved_ckpt, case):
    m, o = _misfit(case)
    if case.startswith("opt-") or case == "param-groups":
        # the model fits and comes first; the optimizer does not fit
        objs = {"model": m, "optimizer": o}
        watched = [(m, o)]
    else:
        # a fitting optimizer (of another model) comes first; the model does not fit
        good_m, good_o = build(seed=8)
        objs = {"optimizer": good_o, "model": m}
        watched = [(good_m, good_o), (m, o)]
    before = [full_state(a, b) for a, b in watched]
    with pytest.raises((gl.GadgetValueError, gl.GadgetTypeError, gl.GadgetKeyError)):
        gl.load_checkpoint(saved_ckpt, objs)
    assert_same(before, [full_state(a, b) for a, b in watched])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "want,got",
    [
        (torch.float32, torch.float64),
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
    ],
)
def test_table_of_another_dtype_refused_with_type_error(tmp_path, fmt, want, got):
    model, opt = build(dtype=want, opt_kwargs={"lr": 0.01, "eps": 1e-3})
    train(model, opt, batches(1))
    gl.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt}, format=fmt)
    m2, o2 = build(seed=3, dtype=got, opt_kwargs={"lr": 0.01, "eps": 1e-3})
    before = full_state(m2, o2)
    with pytest.raises(gl.GadgetTypeError, match="float"):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    assert_same(before, full_state(m2, o2))


def test_wrong_names_refused(saved_ckpt):
    m, o = build(seed=3)
    before = full_state(m, o)
    with pytest.raises(gl.GadgetKeyError, match="opt"):
        gl.load_checkpoint(saved_ckpt, {"model": m, "opt": o})
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(saved_ckpt, {"model": o, "optimizer": m})
    assert_same(before, full_state(m, o))


@pytest.mark.parametrize("bad", [[("model", 1)], "model", None])
def test_load_objects_not_a_mapping(saved_ckpt, bad):
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(saved_ckpt, bad)


def test_load_bytes_directory_refused(saved_ckpt):
    m, o = build(seed=3)
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(os.fsencode(saved_ckpt), {"model": m})


def test_missing_checkpoint(tmp_path):
    m, o = build()
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "nothing", {"model": m})
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        gl.load_checkpoint(tmp_path / "empty", {"model": m})


@pytest.mark.parametrize("content", [b"garbage, not a checkpoint", "torch-other"])
def test_damaged_meta(tmp_path, saved_ckpt, content):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(saved_ckpt, d)
    if content == "torch-other":
        torch.save({"hello": torch.zeros(2)}, d / "meta.pt")
    else:
        (d / "meta.pt").write_bytes(content)
    m, o = build(seed=3)
    before = full_state(m, o)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(d, {"model": m, "optimizer": o})
    assert_same(before, full_state(m, o))


def _damage(d, fmt, how):
    # damage the optimizer's last table file (loaded after the model's tables)
    names = sorted(n for n in os.listdir(d) if n.startswith("optimizer"))
    p = d / names[-1]
    if fmt == "zarr":
        chunks = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and not f.name.endswith(".json") and not f.name.startswith(".")
        )
        assert chunks
        c = chunks[-1]
        if how == "truncate":
            with open(c, "r+b") as f:
                f.truncate(5)
        else:
            b = bytearray(c.read_bytes())
            for i in range(8, len(b), 5):
                b[i] ^= 0x5A
            c.write_bytes(bytes(b))
    else:
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.truncate(size - 64)


DAMAGES = [("npy", "truncate"), ("hdf5", "truncate"), ("zarr", "truncate"), ("zarr", "corrupt")]


@pytest.mark.parametrize("fmt,how", DAMAGES)
def test_damaged_table_with_verify_changes_nothing(tmp_path, fmt, how):
    d = tmp_path / "ck"
    model, opt = build(n=3000, d=8)
    train(model, opt, batches(2, n=3000))
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=fmt)
    _damage(d, fmt, how)
    m2, o2 = build(seed=3, n=3000, d=8)
    before = full_state(m2, o2)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(d, {"model": m2, "optimizer": o2}, verify=True)
    assert_same(before, full_state(m2, o2))


@pytest.mark.parametrize("fmt,how", DAMAGES)
def test_damaged_table_without_verify_still_raises(tmp_path, fmt, how):
    d = tmp_path / "ck"
    model, opt = build(n=3000, d=8)
    train(model, opt, batches(2, n=3000))
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=fmt)
    _damage(d, fmt, how)
    m2, o2 = build(seed=3, n=3000, d=8)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(d, {"model": m2, "optimizer": o2}, verify=False)


def test_missing_table_file_changes_nothing(tmp_path):
    d = tmp_path / "ck"
    model, opt = build()
    gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    victim = sorted(n for n in os.listdir(d) if n.startswith("optimizer"))[-1]
    os.remove(d / victim)
    m2, o2 = build(seed=3)
    before = full_state(m2, o2)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(d, {"model": m2, "optimizer": o2})
    assert_same(before, full_state(m2, o2))


def test_closed_table_refused_nothing_loaded(saved_ckpt):
    m, o = build(seed=3)
    before = full_state(m)
    head_before = m["head"].weight.detach().clone()
    m["bag"].weight.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.load_checkpoint(saved_ckpt, {"model": m, "optimizer": o})
    assert torch.equal(m["head"].weight, head_before)
    assert np.array_equal(m["item"].weight.getNumpyVersion(), before["m.item.weight"].numpy())


# ----------------------------------------------------------------------------- save argument checks


@pytest.mark.parametrize("name", ["", "a/b", "a\\b", "a\x00b", ".", ".."])
def test_bad_object_names_refused_before_writing(tmp_path, name):
    model, opt = build()
    d = tmp_path / "ck"
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(d, {"ok": opt, name: model})
    assert not listing(d)


def test_non_str_name_refused(tmp_path):
    model, opt = build()
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(tmp_path / "ck", {3: model})
    assert not listing(tmp_path / "ck")


@pytest.mark.parametrize("bad", [[("model", 1)], 3, None])
def test_save_objects_not_a_mapping(tmp_path, bad):
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", bad)
    assert not listing(tmp_path / "ck")


@pytest.mark.parametrize("obj", [3, torch.zeros(3), "model"])
def test_save_object_of_another_kind(tmp_path, obj):
    model, _ = build()
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", {"model": model, "x": obj})
    assert not listing(tmp_path / "ck")


@pytest.mark.parametrize("fmt", ["pt", "NPY5", "", "h5"])
def test_unknown_format(tmp_path, fmt):
    model, _ = build()
    with pytest.raises(gl.GadgetKeyError):
        gl.save_checkpoint(tmp_path / "ck", {"model": model}, format=fmt)
    assert not listing(tmp_path / "ck")


def test_directory_is_a_file(tmp_path):
    model, _ = build()
    p = tmp_path / "afile"
    p.write_text("x")
    with pytest.raises(gl.GadgetFileError):
        gl.save_checkpoint(p, {"model": model})
    assert p.read_text() == "x"


def test_save_bytes_directory_refused(tmp_path):
    model, _ = build()
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(os.fsencode(tmp_path / "ck"), {"model": model})


def test_function_in_param_group_refused_before_writing(tmp_path):
    d = tmp_path / "ck"
    model, opt = build()
    gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    before = listing(d)
    train(model, opt, batches(1))
    opt.param_groups[0]["callback"] = lambda x: x
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    assert listing(d) == before


def test_numpy_options_come_back_as_numpy(tmp_path):
    model, opt = build(opt_kwargs={"lr": np.float32(0.01), "betas": (np.float64(0.9), 0.999)})
    train(model, opt, batches(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt})
    m2, o2 = build(seed=2, opt_kwargs={"lr": 0.3})
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    lr = o2.param_groups[0]["lr"]
    assert type(lr) is np.float32 and lr == np.float32(0.01)
    assert type(o2.param_groups[0]["betas"][0]) is np.float64


def test_pathlib_and_str_directories(tmp_path):
    model, opt = build()
    train(model, opt, batches(1))
    gl.save_checkpoint(pathlib.Path(tmp_path) / "a" / "b", {"model": model, "optimizer": opt})
    m2, o2 = build(seed=2)
    gl.load_checkpoint(str(tmp_path / "a" / "b"), {"model": m2, "optimizer": o2})
    assert_same(full_state(model, opt), full_state(m2, o2))


def test_names_prefixing_each_other_do_not_collide(tmp_path):
    torch.manual_seed(0)
    a = torch.nn.ModuleDict({"x": gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")})
    b = gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")
    try:
        gl.save_checkpoint(tmp_path / "ck", {"m": a, "m.x": b})
    except gl.GadgetValueError:
        return  # documented refusal of names whose files would be named alike
    torch.manual_seed(9)
    a2 = torch.nn.ModuleDict({"x": gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")})
    b2 = gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")
    gl.load_checkpoint(tmp_path / "ck", {"m": a2, "m.x": b2})
    assert np.array_equal(a2["x"].weight.getNumpyVersion(), a["x"].weight.getNumpyVersion())
    assert np.array_equal(b2.weight.getNumpyVersion(), b.weight.getNumpyVersion())


def test_progress_false_prints_nothing(tmp_path, capfd):
    model, opt = build()
    gl.save_checkpoint(tmp_path / "ck", {"model": model, "optimizer": opt}, progress=False)
    m2, o2 = build(seed=1)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# ----------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_bfloat16_npy_refused_before_writing(tmp_path, dt):
    model, opt = build(dtype=dt, opt_kwargs={"lr": 0.01, "eps": 1e-3})
    d = tmp_path / "ck"
    if dt is torch.float16:
        gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="npy")
        assert "meta.pt" in listing(d)
        return
    with pytest.raises(gl.GadgetTypeError, match="hdf5|zarr"):
        gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="npy")
    assert not listing(d)


def test_bfloat16_npy_refused_keeps_existing_checkpoint(tmp_path):
    d = tmp_path / "ck"
    model32, opt32 = build()
    gl.save_checkpoint(d, {"model": model32, "optimizer": opt32}, format="npy")
    before = listing(d)
    model, opt = build(dtype=torch.bfloat16, opt_kwargs={"lr": 0.01, "eps": 1e-3})
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="npy")
    assert listing(d) == before


@pytest.mark.parametrize(
    "fmt,dt",
    [
        ("hdf5", torch.bfloat16),
        ("zarr", torch.bfloat16),
        ("npy", torch.float16),
        ("hdf5", torch.float16),
        ("zarr", torch.float16),
    ],
)
def test_half_tables_resume_bit_identical(tmp_path, fmt, dt):
    kw = {"lr": 0.01, "eps": 1e-3}
    bs = batches(5)
    ref_m, ref_o = build(dtype=dt, opt_kwargs=kw)
    train(ref_m, ref_o, bs)
    m1, o1 = build(dtype=dt, opt_kwargs=kw)
    train(m1, o1, bs[:2])
    gl.save_checkpoint(tmp_path / "ck", {"model": m1, "optimizer": o1}, format=fmt)
    m2, o2 = build(seed=4, dtype=dt, opt_kwargs=kw)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    assert m2["item"].weight.dtype == dt
    assert_same(full_state(m1, o1), full_state(m2, o2))
    train(m2, o2, bs[2:])
    assert_same(full_state(ref_m, ref_o), full_state(m2, o2))
    assert torch.isfinite(m2["item"].weight.as_tensor().float()).all()


# ----------------------------------------------------------------------------- pending lookups


def test_load_refused_while_gradient_waits_for_step(saved_ckpt):
    m, o = build(seed=3)
    ids, hist = batches(1, seed=77)[0]
    forward_loss(m, ids, hist).backward()
    before = full_state(m)
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(saved_ckpt, {"model": m, "optimizer": o})
    assert_same(before, full_state(m))


def test_optimizer_only_load_taken_while_gradient_waits(saved_ckpt):
    ref_m, ref_o = build(seed=3)
    gl.load_checkpoint(saved_ckpt, {"optimizer": ref_o})
    m, o = build(seed=3)
    ids, hist = batches(1, seed=77)[0]
    forward_loss(m, ids, hist).backward()
    gl.load_checkpoint(saved_ckpt, {"optimizer": o})
    o.step()
    forward_loss(ref_m, ids, hist).backward()
    ref_o.step()
    assert_same(full_state(ref_m, ref_o), full_state(m, o))


def test_load_retires_lookup_waiting_for_backward(saved_ckpt):
    m, o = build(seed=3)
    ref, ref_o = build(seed=5)
    gl.load_checkpoint(saved_ckpt, {"model": ref, "optimizer": ref_o})
    out = m["item"](torch.tensor([1, 2, 3]))
    gl.load_checkpoint(saved_ckpt, {"model": m, "optimizer": o})
    out.sum().backward()
    with pytest.raises(gl.GadgetValueError, match="before its rows were loaded"):
        o.step()
    assert_same(full_state(ref), full_state(m))


# ----------------------------------------------------------------------------- scheduler-added state


def test_state_turned_on_by_scheduler_loads_into_fresh_optimizer(tmp_path):
    def mk(seed):
        torch.manual_seed(seed)
        m = torch.nn.ModuleDict(
            {"item": gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")}
        )
        return m, gl.OffloadedOptimizer(torch.optim.SGD, m, lr=0.1)

    def run(m, o, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            ids = torch.randint(0, 20, (6,), generator=g)
            o.zero_grad()
            m["item"](ids).pow(2).sum().backward()
            o.step()

    ref, ref_o = mk(0)
    ref_o.param_groups[0]["momentum"] = 0.9
    run(ref, ref_o, 3, 1)
    m, o = mk(0)
    o.param_groups[0]["momentum"] = 0.9
    run(m, o, 3, 1)
    gl.save_checkpoint(tmp_path / "ck", {"m": m, "o": o})
    m2, o2 = mk(7)  # built with momentum off
    gl.load_checkpoint(tmp_path / "ck", {"m": m2, "o": o2})
    assert o2.param_groups[0]["momentum"] == 0.9
    run(ref, ref_o, 2, 2)
    run(m2, o2, 2, 2)
    assert_same(full_state(ref, ref_o), full_state(m2, o2))


# ----------------------------------------------------------------------------- switchers


class _W2V(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.u = torch.nn.Embedding(4, 3)
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, ids):
        return self.lin(self.u(ids)).pow(2).sum()


def _build_switchers(seed=0, optc=torch.optim.Adam, n=30, factory="cupy", **kw):
    torch.manual_seed(seed)
    m = _W2V()
    o = optc(m.parameters(), **(kw or {"lr": 0.01}))
    if factory == "cupy":
        sw = gl.ModelFactory(m.u, n, 3, placement="cpu")
        osw = gl.OptimizerFactory(o, n, 3, m, "u", placement="cpu")
    else:
        sw = gl.PytorchModelFactory(m.u, n, 3, deviceType="cpu")
        osw = gl.PytorchOptimizerFactory(o, n, 3, m, "u", deviceType="cpu")
    sw.uniformDistributionInit(-0.1, 0.1)
    osw.optInit()
    return m, o, sw, osw


def _train_switchers(m, o, sw, osw, bs):
    for ids in bs:
        loc = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        loss = m(loc)
        o.zero_grad()
        loss.backward()
        o.step()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)


def _sw_state(m, sw, osw):
    return {
        "table": torch.from_numpy(np.array(sw.getNumpyVersion())),
        **{k: torch.from_numpy(np.array(v)) for k, v in osw.getNumpyVersion().items()},
        "lin.w": m.lin.weight.detach().clone(),
        "lin.b": m.lin.bias.detach().clone(),
    }


def _sw_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 30, (6,), generator=g) for _ in range(6)]


@pytest.mark.parametrize("factory", ["cupy", "torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_switchers_resume_bit_identical(tmp_path, fmt, factory):
    bs = _sw_batches()
    ref = _build_switchers(factory=factory)
    _train_switchers(*ref, bs)
    a = _build_switchers(factory=factory)
    _train_switchers(*a, bs[:3])
    m, o, sw, osw = a
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "u": sw, "u_opt": osw, "opt": o}, format=fmt)
    b = _build_switchers(seed=5, factory=factory)
    m2, o2, sw2, osw2 = b
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "u": sw2, "u_opt": osw2, "opt": o2})
    assert_same(_sw_state(m, sw, osw), _sw_state(m2, sw2, osw2))
    _train_switchers(*b, bs[3:])
    assert_same(_sw_state(ref[0], ref[2], ref[3]), _sw_state(m2, sw2, osw2))


def test_model_without_its_switchers_refused_before_writing(tmp_path):
    m, o, sw, osw = _build_switchers()
    _train_switchers(m, o, sw, osw, _sw_batches()[:1])
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(tmp_path / "ck", {"model": m, "opt": o})
    assert not listing(tmp_path / "ck")


def test_switcher_checkpoint_refused_mid_step(tmp_path):
    m, o, sw, osw = _build_switchers()
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "u": sw, "u_opt": osw, "opt": o})
    ids = torch.tensor([1, 2, 3])
    sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    before = _sw_state(m, sw, osw)
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(tmp_path / "ck2", {"model": m, "u": sw, "u_opt": osw, "opt": o})
    assert not listing(tmp_path / "ck2")
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m, "u": sw, "u_opt": osw, "opt": o})
    assert_same(before, _sw_state(m, sw, osw))


@pytest.mark.parametrize("case", ["AdamW", "rows"])
def test_switcher_misfit_refused(tmp_path, case):
    m, o, sw, osw = _build_switchers()
    _train_switchers(m, o, sw, osw, _sw_batches()[:2])
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "u": sw, "u_opt": osw, "opt": o})
    if case == "AdamW":
        b = _build_switchers(seed=3, optc=torch.optim.AdamW)
    else:
        b = _build_switchers(seed=3, n=31)
    m2, o2, sw2, osw2 = b
    before = _sw_state(m2, sw2, osw2)
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2, "u": sw2, "u_opt": osw2, "opt": o2})
    assert_same(before, _sw_state(m2, sw2, osw2))


# ----------------------------------------------------------------------------- state dicts


def test_state_dict_round_trip_resumes_bit_identically():
    bs = batches(5)
    ref_m, ref_o = build()
    train(ref_m, ref_o, bs)
    m1, o1 = build()
    train(m1, o1, bs[:2])
    buf = io.BytesIO()
    torch.save({"m": m1.state_dict(), "o": o1.state_dict()}, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    m2, o2 = build(seed=6)
    m2.load_state_dict(sd["m"])
    o2.load_state_dict(sd["o"])
    assert_same(full_state(m1, o1), full_state(m2, o2))
    train(m2, o2, bs[2:])
    assert_same(full_state(ref_m, ref_o), full_state(m2, o2))


def test_module_state_dict_holds_whole_table():
    m, _ = build()
    sd = m.state_dict()
    assert tuple(sd["item.weight"].shape) == (N_ITEM, DIM)
    assert np.array_equal(sd["item.weight"].numpy(), m["item"].weight.getNumpyVersion())
    assert tuple(sd["bag.weight"].shape) == (N_BAG, DIM)


def test_module_load_state_dict_shape_mismatch_like_torch():
    src, _ = build()
    m, _ = build(seed=3)
    before = full_state(m)
    sd = dict(src.state_dict())
    sd["bag.weight"] = torch.zeros(N_BAG + 1, DIM)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        m.load_state_dict(sd)
    # the misfit table is unchanged (tables that fit may be loaded, as torch does)
    assert torch.equal(torch.from_numpy(m["bag"].weight.getNumpyVersion()), before["m.bag.weight"])


def test_module_load_state_dict_converts_float64():
    src, _ = build()
    m, _ = build(seed=3)
    sd = dict(src.state_dict())
    w64 = sd["item.weight"].double() + 1e-9
    sd["item.weight"] = w64
    m.load_state_dict(sd)
    assert np.array_equal(m["item"].weight.getNumpyVersion(), w64.float().numpy())


def test_module_load_state_dict_refuses_integer_values():
    m, _ = build(seed=3)
    before = m["item"].weight.getNumpyVersion().copy()
    with pytest.raises(RuntimeError):
        m["item"].load_state_dict({"weight": torch.ones(N_ITEM, DIM, dtype=torch.int64)})
    assert np.array_equal(m["item"].weight.getNumpyVersion(), before)


def test_module_load_state_dict_takes_numpy():
    m, _ = build(seed=3)
    arr = np.arange(N_ITEM * DIM, dtype=np.float32).reshape(N_ITEM, DIM)
    m["item"].load_state_dict({"weight": arr})
    assert np.array_equal(m["item"].weight.getNumpyVersion(), arr)


def test_optimizer_load_state_dict_wrong_class_refused():
    _, opt = build()
    m2, o2 = build(seed=3, optc=torch.optim.NAdam)
    before = copy.deepcopy(o2.state_dict())
    with pytest.raises(gl.GadgetError):
        o2.load_state_dict(opt.state_dict())
    assert_same(before, o2.state_dict())


def test_optimizer_load_state_dict_not_a_dict():
    _, o2 = build(seed=3)
    with pytest.raises(gl.GadgetTypeError):
        o2.load_state_dict([1, 2])


def test_optimizer_load_state_dict_converts_float64_tables():
    m, opt = build()
    train(m, opt, batches(2))
    sd = opt.state_dict()
    sd64 = copy.deepcopy(sd)
    sd64["tables"] = [{k: v.double() for k, v in t.items()} for t in sd["tables"]]
    _, o2 = build(seed=3)
    o2.load_state_dict(sd64)
    assert_same(sd["tables"], o2.state_dict()["tables"])


# ----------------------------------------------------------------------------- copies


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copied_model_is_separate_table_without_optimizer(how):
    model, opt = build()
    train(model, opt, batches(2))
    want = full_state(model, opt)
    if how == "deepcopy":
        c = copy.deepcopy(model)
    elif how == "pickle":
        c = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    assert_same(full_state(model), full_state(c))
    # a new optimizer may take the copy while the original's is alive
    copt = gl.OffloadedOptimizer(torch.optim.Adam, c, lr=0.01)
    assert all(
        not np.abs(t.getNumpyVersion().astype(np.float64)).any()
        for p in copt.pagers
        for t in p.tables.values()
    )
    train(c, copt, batches(2, seed=50))
    c["item"].weight.fill_(3.0)
    assert_same(want, full_state(model, opt))
    # and the original still trains as an uninterrupted run would
    ref_m, ref_o = build()
    train(ref_m, ref_o, batches(2))
    train(ref_m, ref_o, batches(1, seed=51))
    train(model, opt, batches(1, seed=51))
    assert_same(full_state(ref_m, ref_o), full_state(model, opt))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_interleaved_table_is_ordinary(how):
    model, opt = build()
    train(model, opt, batches(2))
    g = model["item"].weight
    want = g.getNumpyVersion().copy()
    c = copy.deepcopy(g) if how == "deepcopy" else pickle.loads(pickle.dumps(g))
    assert isinstance(c, gl.DataGadget)
    assert c.shape == g.shape and c.dtype == g.dtype and c.placement == "cpu"
    assert np.array_equal(c.getNumpyVersion(), want)
    assert c.as_tensor().is_contiguous()
    c.fill_(7.0)
    assert np.array_equal(g.getNumpyVersion(), want)
    g_state = {k: t.getNumpyVersion().copy() for k, t in opt.pagers[0].tables.items()}
    c.insertData(torch.zeros(2, DIM), torch.tensor([0, 1]))
    assert {
        k: np.array_equal(t.getNumpyVersion(), g_state[k]) for k, t in opt.pagers[0].tables.items()
    } == {k: True for k in g_state}


def test_copied_model_checkpoint_loads_into_original_shape(tmp_path):
    model, opt = build()
    train(model, opt, batches(2))
    c = copy.deepcopy(model)
    copt = gl.OffloadedOptimizer(torch.optim.Adam, c, lr=0.01)
    gl.save_checkpoint(tmp_path / "ck", {"model": c, "optimizer": copt}, format="zarr")
    m2, o2 = build(seed=9)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    assert_same(full_state(model), full_state(m2))


# ----------------------------------------------------------------------------- more


def test_load_rolls_back_the_same_objects(tmp_path):
    m, o = build()
    train(m, o, batches(2))
    want = full_state(m, o)
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": o}, format="zarr")
    train(m, o, batches(3, seed=4))
    gl.load_checkpoint(tmp_path / "ck", {"model": m, "optimizer": o})
    assert_same(want, full_state(m, o))


def test_optimizer_load_state_dict_misfit_changes_nothing():
    m, o = build()
    train(m, o, batches(2))
    _, o2 = build(seed=3, n=N_ITEM + 1)
    before = copy.deepcopy(o2.state_dict())
    with pytest.raises(gl.GadgetValueError):
        o2.load_state_dict(o.state_dict())
    assert_same(before, o2.state_dict())


def test_param_groups_and_added_group_resume(tmp_path):
    def mk(seed):
        torch.manual_seed(seed)
        mm = torch.nn.ModuleDict(
            {
                "item": gl.OffloadedEmbedding(N_ITEM, DIM, placement="cpu", device="cpu"),
                "bag": gl.OffloadedEmbeddingBag(
                    N_BAG, DIM, mode="sum", placement="cpu", device="cpu"
                ),
                "head": torch.nn.Linear(DIM, 1),
            }
        )
        oo = gl.OffloadedOptimizer(
            torch.optim.Adam,
            [{"params": mm["item"], "lr": 0.05}, {"params": mm["head"].parameters()}],
            lr=0.01,
        )
        oo.add_param_group({"params": mm["bag"], "lr": 0.02})
        return mm, oo

    bs = batches(5)
    ref, ref_o = mk(0)
    train(ref, ref_o, bs)
    a, ao = mk(0)
    train(a, ao, bs[:2])
    gl.save_checkpoint(tmp_path / "ck", {"model": a, "optimizer": ao}, format="hdf5")
    b, bo = mk(1)
    gl.load_checkpoint(tmp_path / "ck", {"model": b, "optimizer": bo})
    train(b, bo, bs[2:])
    assert_same(full_state(ref, ref_o), full_state(b, bo))
    assert [g["lr"] for g in bo.param_groups] == [0.05, 0.01, 0.02]


def test_switcher_files_round_trip(tmp_path):
    m, o, sw, osw = _build_switchers()
    _train_switchers(m, o, sw, osw, _sw_batches()[:2])
    sw.saveCupy(str(tmp_path / "emb"))
    assert (tmp_path / "emb.npy").is_file()
    osw.saveTorch(str(tmp_path / "st.pt"))
    sw.saveTorch(str(tmp_path / "t.pt"))
    m2, o2, sw2, osw2 = _build_switchers(seed=3)
    sw2.loadCupy(str(tmp_path / "emb.npy"))
    osw2.loadTorch(str(tmp_path / "st.pt"))
    assert_same(_sw_state(m, sw, osw)["table"], _sw_state(m2, sw2, osw2)["table"])
    assert {
        k: np.array_equal(v, osw.getNumpyVersion()[k]) for k, v in osw2.getNumpyVersion().items()
    } == {"exp_avg": True, "exp_avg_sq": True}
    m3, o3, sw3, osw3 = _build_switchers(seed=4)
    sw3.loadTorch(str(tmp_path / "t.pt"))
    assert np.array_equal(sw3.getNumpyVersion(), sw.getNumpyVersion())
    # SpeedTorch's list of tensors in state order, and float64 values that convert exactly
    st = torch.load(tmp_path / "st.pt", weights_only=True)
    torch.save([st["exp_avg"].double(), st["exp_avg_sq"].double()], tmp_path / "stl.pt")
    osw3.loadTorch(str(tmp_path / "stl.pt"))
    assert all(
        np.array_equal(v, osw.getNumpyVersion()[k]) for k, v in osw3.getNumpyVersion().items()
    )


@pytest.mark.parametrize("bad", ["shape", "inexact-f64"])
def test_switcher_load_torch_refuses_before_writing(tmp_path, bad):
    m, o, sw, osw = _build_switchers()
    _train_switchers(m, o, sw, osw, _sw_batches()[:2])
    osw.saveTorch(str(tmp_path / "st.pt"))
    st = torch.load(tmp_path / "st.pt", weights_only=True)
    if bad == "shape":
        st = {"exp_avg": st["exp_avg"] + 1, "exp_avg_sq": torch.zeros(31, 3)}
        exc = gl.GadgetValueError
    else:
        st = {k: v.double() + 1e-12 for k, v in st.items()}
        exc = gl.GadgetTypeError
    torch.save(st, tmp_path / "bad.pt")
    _, _, _, osw2 = _build_switchers(seed=3)
    before = {k: v.copy() for k, v in osw2.getNumpyVersion().items()}
    with pytest.raises(exc):
        osw2.loadTorch(str(tmp_path / "bad.pt"))
    assert all(np.array_equal(v, before[k]) for k, v in osw2.getNumpyVersion().items())


@pytest.mark.parametrize(
    "arr,exc",
    [
        (np.zeros((31, 3), np.float32), gl.GadgetValueError),
        (np.zeros((30, 3), np.float64), gl.GadgetTypeError),
    ],
    ids=["shape", "dtype"],
)
def test_switcher_load_cupy_refuses_before_writing(tmp_path, arr, exc):
    np.save(tmp_path / "bad.npy", arr)
    _, _, sw, _ = _build_switchers(seed=3)
    before = np.array(sw.getNumpyVersion()).copy()
    with pytest.raises(exc):
        sw.loadCupy(str(tmp_path / "bad.npy"))
    assert np.array_equal(np.array(sw.getNumpyVersion()), before)
