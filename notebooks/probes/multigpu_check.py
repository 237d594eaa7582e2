#!/usr/bin/env python3
"""Two-GPU black-box checks of gadgetloader's documented behaviour: tables and batches on
cuda:1, device arguments, a table used from both GPUs, pipeline, training, two processes.

Usage: multigpu_check.py OUT.json [--cpu-dry-run]

Written from README.md and the public docstrings. Each check runs in try/except
and is recorded PASS / FAIL / ERROR / SKIP in OUT.json (rewritten after every check, so a
hang caught by the watchdog -- 60 s a check, 240 s in all -- keeps the results so far).
Every check SKIPs with fewer than two GPUs, except under --cpu-dry-run, which runs the same
code with 'cpu' wherever cuda:0 / cuda:1 would be used (CuPy and wrong-GPU parts SKIP).
"""

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import gadgetloader as gl

try:
    import cupy as cp
except Exception:
    cp = None

DRY = "--cpu-dry-run" in sys.argv
_ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
OUT_JSON = _ARGS[0] if _ARGS else "./multigpu.json"
CHECK_TIMEOUT, TOTAL_TIMEOUT, CHILD_TIMEOUT = 60.0, 240.0, 45.0
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU = NGPU >= 2 and not DRY
FALLBACK = not (torch.cuda.is_available() and cp is not None)  # cuda/pinned -> cpu (documented)
RESULTS, CHILDREN, GPU_NAMES, T0 = [], [], [], time.time()
CUR = {"name": None, "t0": None}
warnings.simplefilter("ignore")  # FallbackWarning in the dry run


class Skip(Exception):
    """The check does not apply here."""


class Fail(AssertionError):
    """The library did not do what the docs say."""


# ----------------------------------------------------------------------------- recording
def counts():
    return {s: sum(r["status"] == s for r in RESULTS) for s in ("PASS", "FAIL", "ERROR", "SKIP")}


def write_json(extra=None):
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "dry_run": DRY,
        "gpus": GPU_NAMES,
        "cupy": getattr(cp, "__version__", None),
        "gadgetloader": getattr(gl, "__version__", "?"),
    }
    doc = {
        "env": env,
        "summary": counts(),
        "elapsed_s": round(time.time() - T0, 2),
        "results": RESULTS,
        **(extra or {}),
    }
    with open(OUT_JSON + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(OUT_JSON + ".tmp", OUT_JSON)


def summary():
    c = counts()
    print(
        f"multigpu: {c['PASS']} passed, {c['FAIL']} failed, {c['ERROR']} errors ({c['SKIP']} skipped)"
    )
    print(f"  ({time.time() - T0:.1f} s, dry_run={DRY}, gpus={NGPU})")
    for r in RESULTS:
        if r["status"] in ("FAIL", "ERROR"):
            print(f"  {r['status']:5s} {r['name']}: {r['detail']}")
    sys.stdout.flush()


def watchdog():
    while True:
        time.sleep(1.0)
        t0, now = CUR["t0"], time.time()
        if (t0 is not None and now - t0 > CHECK_TIMEOUT) or now - T0 > TOTAL_TIMEOUT:
            RESULTS.append(
                {
                    "name": CUR["name"] or "<between checks>",
                    "status": "ERROR",
                    "seconds": round(now - (t0 or now), 2),
                    "detail": f"TIMEOUT: check > {CHECK_TIMEOUT:.0f} s or total > "
                    f"{TOTAL_TIMEOUT:.0f} s; run aborted",
                }
            )
            for p in CHILDREN:  # check 6's ranks must not outlive us
                try:
                    p.kill()
                except Exception:
                    pass
            write_json({"aborted": True})
            summary()
            os._exit(3)


def run(name, fn, *args):
    CUR.update(name=name, t0=time.time())
    rec = {"name": name}
    try:
        set_dev(0)  # every check starts with device 0 current
        detail = fn(*args)
        if GPU:  # an asynchronous CUDA error belongs to this check
            for i in range(NGPU):
                torch.cuda.synchronize(i)
        rec.update(status="PASS", detail=str(detail or "")[:1500])
    except Skip as e:
        rec.update(status="SKIP", detail=str(e)[:500])
    except Fail as e:
        rec.update(status="FAIL", detail=str(e)[:500])
    except Exception as e:
        rec.update(
            status="ERROR",
            detail=f"{type(e).__name__}: {e}"[:500],
            trace="".join(traceback.format_exception(type(e), e, e.__traceback__)[-4:])[-1500:],
        )
    try:
        set_dev(0)
    except Exception:
        pass
    rec["seconds"] = round(time.time() - CUR["t0"], 3)
    CUR.update(name=None, t0=None)
    RESULTS.append(rec)
    write_json()


# ----------------------------------------------------------------------------- helpers
def D(i):
    """The device standing for cuda:i ('cpu' in the dry run)."""
    return torch.device("cpu") if DRY else torch.device(f"cuda:{i}")


def set_dev(i):
    if not DRY and NGPU:
        torch.cuda.set_device(i)


def need2():
    if not GPU and not DRY:
        raise Skip(f"needs 2 GPUs (found {NGPU})")


def need_gpu(what):
    need2()
    if DRY:
        raise Skip(f"GPU-specific ({what}); skipped in --cpu-dry-run")
    if what == "CuPy" and cp is None:
        raise Skip("CuPy not importable")


def cur_is(i):
    if not DRY and torch.cuda.current_device() != i:
        raise Fail(f"current device changed: expected {i}, got {torch.cuda.current_device()}")


def to_np(x):
    if cp is not None and isinstance(x, cp.ndarray):
        return cp.asnumpy(x)
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def eq(got, exp, what):
    g, e = to_np(got), to_np(exp)
    if g.shape != e.shape:
        raise Fail(f"{what}: shape expected {e.shape}, got {g.shape}")
    if not np.array_equal(g, e):
        bad = np.argwhere(g != e)
        i = tuple(int(k) for k in bad[0])
        raise Fail(
            f"{what}: {len(bad)} elements differ; first at {i}: expected {e[i]!r}, got {g[i]!r}"
        )


def close(got, exp, what, tol=1e-5):
    g, e = to_np(got).astype(np.float64), to_np(exp).astype(np.float64)
    if g.shape != e.shape:
        raise Fail(f"{what}: shape expected {e.shape}, got {g.shape}")
    err = np.abs(g - e) - tol * np.abs(e)
    if not np.all(err <= tol):
        i = tuple(int(k) for k in np.unravel_index(np.argmax(err), err.shape))
        raise Fail(f"{what}: beyond rtol=atol={tol}; at {i}: expected {e[i]!r}, got {g[i]!r}")
    return "exact" if np.array_equal(g, e) else f"max abs err {np.abs(g - e).max():.2g}"


def norm(dev):
    """A device attribute as a torch.device; a bare 'cuda' means the current device."""
    dev = torch.device(dev)
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dev.type == "cuda" and dev.index is None
        else dev
    )


def on(t, dev, what="result"):
    if t.device != dev:
        raise Fail(f"{what}: expected on {dev}, got {t.device}")


def raises(exc, fn, what):
    try:
        fn()
    except exc as e:
        if not isinstance(e, gl.GadgetError):
            raise Fail(f"{what}: {type(e).__name__} is not a GadgetError subclass")
        return
    except Exception as e:
        raise Fail(f"{what}: expected {exc.__name__}, got {type(e).__name__}: {e}")
    raise Fail(f"{what}: expected {exc.__name__}, nothing raised")


def outcome(fn, check, g, snap, what):
    """For corners the docs leave open: fn() either works (then check(result) must pass) or
    raises a GadgetError leaving the table equal to snap. Anything else fails. -> text."""
    try:
        r = fn()
    except gl.GadgetError as e:
        eq(g.getNumpyVersion(), snap, f"{what}: table after refusal")
        return f"refused({type(e).__name__}: {str(e)[:70]})"
    except Exception as e:
        raise Fail(f"{what}: neither worked nor a GadgetError: {type(e).__name__}: {e}")
    check(r)
    return f"ok@{r.device}" if isinstance(r, torch.Tensor) else "ok"


def rand(n, d, seed):
    return (np.random.default_rng(seed).standard_normal((n, d)) * 3).astype(np.float32)


def rand_ids(n, k, seed):
    ids = np.random.default_rng(seed).integers(0, n, k).astype(np.int64)
    ids[: k // 8] = ids[k // 8 : 2 * (k // 8)]  # guaranteed repeats
    return ids


def last_wins(ref, ids, rows):
    """NumPy-style sequential assignment (the last occurrence of a repeated id wins), in place."""
    ids = np.asarray(ids).reshape(-1)
    rows = np.asarray(rows).reshape((len(ids),) + ref.shape[1:])
    _, first_in_rev = np.unique(ids[::-1], return_index=True)
    last = len(ids) - 1 - first_in_rev
    ref[ids[last]] = rows[last]
    return ref


def mk(a, kind, dev):
    """NumPy ids / rows as kind: numpy, cpu (torch), cuda (torch on cuda:dev), cupy (on dev)."""
    a = np.ascontiguousarray(a)
    if kind == "numpy":
        return a
    if kind in ("cpu", "cuda"):
        return torch.from_numpy(a).to(D(dev) if kind == "cuda" else "cpu")
    with cp.cuda.Device(dev):
        return cp.asarray(a)


def check_pl(g, pl):
    exp = "cpu" if FALLBACK else pl
    if g.placement != exp:
        raise Fail(f"placement: expected {exp}, got {g.placement}")


N, DIM = 1000, 8


# ================================================== 1. set_device(1), DataGadget on cuda:1
def c1_get_insert(pl, kind):
    need_gpu("CuPy") if kind == "cupy" else need2()
    set_dev(1)
    data, ids, rows = rand(N, DIM, 1), rand_ids(N, 300, 2), rand(300, DIM, 3)
    g = gl.DataGadget(data, placement=pl)
    check_pl(g, pl)
    if norm(g.device) != D(1):
        raise Fail(f"g.device: expected {D(1)} (the current device), got {g.device}")
    r = g.getData(mk(ids, kind, 1))
    on(r, D(1), "getData result")
    eq(r, data[ids], f"getData({kind} ids)")
    ids2 = ids[:200].reshape(10, 20)
    eq(g.getData(mk(ids2, kind, 1)), data[ids2], f"getData(2-D {kind} ids)")
    g.insertData(mk(rows, "cupy" if kind == "cupy" else "cuda", 1), mk(ids, kind, 1))
    ref = last_wins(data.copy(), ids, rows)
    eq(g.getNumpyVersion(), ref, f"table after insertData({kind} ids with repeats: last wins)")
    eq(g.getData(mk(ids, kind, 1)), ref[ids], "getData after insertData")
    cur_is(1)
    return f"rows live on {g.as_tensor().device}"


def c1_strategies(pl):
    need2()
    set_dev(1)
    n, d = 20000, 16
    data, ids, rows = rand(n, d, 4), rand_ids(n, 5000, 5), rand(5000, d, 6)
    exp_tab, notes = last_wins(data.copy(), ids, rows), []
    for s in gl.transfer.STRATEGIES:
        try:
            g = gl.DataGadget(data, placement=pl, strategy=s)
            r1, r2 = g.getData(mk(ids, "cuda", 1)), g.getData(mk(ids, "cpu", 1))
        except gl.GadgetError as e:  # a documented refusal is acceptable
            notes.append(f"{s}:refused({type(e).__name__})")
            continue
        on(r1, D(1), f"strategy={s} result")
        eq(r1, data[ids], f"strategy={s} gather, cuda:1 ids")
        eq(r2, data[ids], f"strategy={s} gather, CPU ids")
        g.insertData(mk(rows, "cuda", 1), mk(ids, "cuda", 1))
        eq(g.getNumpyVersion(), exp_tab, f"strategy={s} scatter with repeats")
        notes.append(s)
    cur_is(1)
    return ",".join(notes)


def c1_bad_ids(pl):
    need2()
    set_dev(1)
    data, d1 = rand(N, DIM, 7), D(1)
    g = gl.DataGadget(data, placement=pl)
    t = lambda v, dev=d1: torch.tensor(v, device=dev)
    rows = torch.ones(3, DIM, device=d1)
    cases = [
        (gl.GadgetIndexError, lambda: g.getData(t([0, N], "cpu")), "getData CPU id == len"),
        (gl.GadgetIndexError, lambda: g.getData(t([3, -1])), "getData cuda:1 id -1"),
        (gl.GadgetIndexError, lambda: g.getData(t([5, N + 7])), "getData cuda:1 id > len"),
        (gl.GadgetTypeError, lambda: g.getData(t([0.0, 1.0])), "getData float ids"),
        (
            gl.GadgetIndexError,
            lambda: g.insertData(rows, t([1, 2, N])),
            "insertData cuda:1 id == len",
        ),
        (
            gl.GadgetIndexError,
            lambda: g.insertData(rows, t([-1, 2, 3], "cpu")),
            "insertData CPU id -1",
        ),
        (
            gl.GadgetTypeError,
            lambda: g.insertData(rows.double(), t([1, 2, 3])),
            "insertData float64 rows",
        ),
        (
            gl.GadgetValueError,
            lambda: g.insertData(torch.ones(3, DIM + 1, device=d1), t([1, 2, 3])),
            "insertData rows of the wrong shape",
        ),
    ]
    if GPU and cp is not None:
        with cp.cuda.Device(1):
            bad = cp.asarray([0, N])
        cases += [
            (gl.GadgetIndexError, lambda: g.getData(bad), "getData CuPy id == len"),
            (gl.GadgetIndexError, lambda: g.insertData(rows[:2], bad), "insertData CuPy id == len"),
        ]
    for exc, fn, what in cases:
        raises(exc, fn, what)
        eq(g.getNumpyVersion(), data, f"table after refused {what}")
    eq(g.getData(t([4, 4, 9])), data[[4, 4, 9]], "getData after the refusals")
    cur_is(1)
    return f"{len(cases)} refusals"


# ============================================= 2. current device 0, explicit device=cuda:1
def c2_device_arg(pl):
    need2()
    data, ids, rows = rand(N, DIM, 8), rand_ids(N, 257, 9), rand(257, DIM, 10)
    g = gl.DataGadget(data, placement=pl, device=D(1))
    check_pl(g, pl)
    if norm(g.device) != D(1):
        raise Fail(f"g.device: expected {D(1)}, got {g.device}")
    for kind in ("cpu", "numpy", "cuda"):
        r = g.getData(mk(ids, kind, 1))
        on(r, D(1), f"getData({kind} ids) result")
        eq(r, data[ids], f"device=cuda:1 table, getData({kind} ids)")
    g.insertData(mk(rows, "cuda", 1), mk(ids, "cuda", 1))
    eq(g.getNumpyVersion(), last_wins(data.copy(), ids, rows), "table after insertData from cuda:1")
    g0 = gl.DataGadget(data, placement=pl)  # default: the current device, 0
    if norm(g0.device) != D(0):
        raise Fail(f"default device: expected {D(0)}, got {g0.device}")
    for kind in ("cpu", "cuda"):
        r = g0.getData(mk(ids, kind, 0), device=D(1))
        on(r, D(1), f"getData({kind} ids, device=cuda:1)")
        eq(r, data[ids], f"getData({kind} ids, device=cuda:1)")
    cur_is(0)
    return f"device=cuda:1 table's rows live on {g.as_tensor().device}"


def c2_wrong_gpu(pl, what, check_ids=True):
    """A cuda:1 table (device=cuda:1, built with 1 current), used with 0 current: ids or rows
    on cuda:0. README: data of the wrong device raises a GadgetError before anything is
    written; ids on another GPU are not named, so working correctly is accepted too."""
    need_gpu(what)
    set_dev(1)
    data, ids, rows = rand(N, DIM, 11), rand_ids(N, 200, 12), rand(200, DIM, 13)
    g = gl.DataGadget(data, placement=pl, device=D(1))
    set_dev(0)
    snap, exp = data.copy(), last_wins(data.copy(), ids, rows)
    log = []

    def ins_ok(_):
        eq(g.getNumpyVersion(), exp, "table after the accepted insertData")
        snap[:] = exp

    if what == "ids on the other GPU":
        log.append(
            "getData: "
            + outcome(
                lambda: g.getData(mk(ids, "cuda", 0), check_ids=check_ids),
                lambda r: (on(r, D(1)), eq(r, data[ids], "getData(cuda:0 ids)")),
                g,
                snap,
                "getData",
            )
        )
        log.append(
            "insertData: "
            + outcome(
                lambda: g.insertData(mk(rows, "cuda", 1), mk(ids, "cuda", 0), check_ids=check_ids),
                ins_ok,
                g,
                snap,
                "insertData(cuda:1 rows, cuda:0 ids)",
            )
        )
    else:
        for idk in ("cpu", "cuda"):
            log.append(
                f"rows on cuda:0, {idk} ids: "
                + outcome(
                    lambda: g.insertData(mk(rows, "cuda", 0), mk(ids, idk, 1)),
                    ins_ok,
                    g,
                    snap,
                    f"insertData(cuda:0 rows, {idk} ids)",
                )
            )
    cur_is(0)
    return "; ".join(log)


# ================================================ 3. a table made on 0, used from 1 (and 0)
def c3_cross_device(pl):
    need2()
    data = rand(N, DIM, 17)
    g = gl.DataGadget(data, placement=pl)  # device 0 current
    ref, log = data.copy(), [f"made with cuda:0 current, g.device={g.device}"]
    for step, dev in enumerate([1, 1, 0, 1, 0, 1]):
        set_dev(dev)
        ids, rows = rand_ids(N, 128, 100 + step), rand(128, DIM, 200 + step)
        exp = last_wins(ref.copy(), ids, rows)

        def get_ok(r, ids=ids, step=step):  # docs: rows are delivered to g.device
            if r.device != norm(g.device):
                raise Fail(f"step {step}: getData result on {r.device}, g.device says {g.device}")
            eq(r, ref[ids], f"step {step} (cuda:{dev} current) getData")

        def ins_ok(_, exp=exp):
            eq(g.getNumpyVersion(), exp, f"step {step} (cuda:{dev} current) insertData")
            ref[:] = exp

        a = outcome(
            lambda: g.getData(mk(ids, "cuda", dev)),
            get_ok,
            g,
            ref,
            f"step {step} getData(cuda ids)",
        )
        b = outcome(
            lambda: g.getData(mk(ids, "cpu", dev)), get_ok, g, ref, f"step {step} getData(CPU ids)"
        )
        c = outcome(
            lambda: g.insertData(mk(rows, "cuda", dev), mk(ids, "cuda", dev)),
            ins_ok,
            g,
            ref,
            f"step {step} insertData",
        )
        log.append(f"dev{dev}: get={a} cpu_get={b} insert={c}")
        cur_is(dev)
    return " | ".join(log)


# ====================================================================== 4. pipeline on cuda:1
NP, B = 5000, 512


def c4_pipeline(pl, form, how):
    need2()
    X, Y = rand(NP, 6, 18), np.arange(NP, dtype=np.int64)  # Y: each row's own id
    if how == "device_arg":
        ds = gl.GadgetDataset(X, Y, placement=pl, device=D(1))
    else:
        set_dev(1)
        ds = gl.GadgetDataset(X, Y, placement=pl)
    if norm(ds.device) != D(1):
        raise Fail(f"ds.device: expected {D(1)}, got {ds.device}")
    check_pl(ds.columns[0], pl)
    n_exp = -(-NP // B)
    if form == "default":
        loader = DataLoader(ds, batch_size=B, shuffle=True)
    elif form == "sampler":
        sampler = gl.GadgetSampler(ds, batch_size=B, order="random", seed=3)
        loader, n_exp = DataLoader(ds, batch_sampler=sampler), len(sampler)
    else:
        loader = gl.GadgetLoader(ds, batch_size=B, prefetch=2)
    orders = []
    for ep in range(2):
        seen = []
        for x, y in loader:
            on(x, D(1), f"epoch {ep} x")
            on(y, D(1), f"epoch {ep} y")
            yn = to_np(y)
            eq(x, X[yn], f"epoch {ep} batch {len(seen)} rows vs numpy")
            eq(x * 2, X[yn] * 2, f"epoch {ep} batch {len(seen)} used by a kernel on its device")
            seen.append(yn)
        if len(seen) != n_exp:
            raise Fail(f"epoch {ep}: expected {n_exp} batches, got {len(seen)}")
        allids = np.concatenate(seen)
        if not np.array_equal(np.sort(allids), Y):
            raise Fail(
                f"epoch {ep}: not every row once ({len(allids)} ids, {len(np.unique(allids))} distinct)"
            )
        orders.append(allids)
    if np.array_equal(orders[0], orders[1]):
        raise Fail("both epochs came in the same order (a new shuffle each epoch expected)")
    cur_is(0 if how == "device_arg" else 1)
    return f"{n_exp} batches x 2 epochs"


# ====================================================================== 5. training on cuda:1
# Lazy Adam and SparseAdam differ only in where eps enters (Adam: sqrt(v)/sqrt(bc2) + eps,
# SparseAdam: (sqrt(v) + eps)/sqrt(bc2)): an element whose gradient is within a few thousand
# times eps/sqrt(bc2) moves by a visibly different step (seen here: a 2e-8 gradient, eps=1e-12,
# 1.5e-5 apart, with gadgetloader matching a float64 lazy Adam to 5e-8). eps=1e-16 on both sides.
ADAM_KW = {"Adam": {"lr": 0.01, "eps": 1e-16}, "SparseAdam": {"lr": 0.01}}


def emb_loss(out, w):
    return (out * w).sum() + 0.5 * (out * out).sum()


def c5_offloaded(pl, optname, how):
    need2()
    n, d = 1000, 16
    if how == "set_device":
        set_dev(1)
        emb = gl.OffloadedEmbedding(n, d, placement=pl)
    else:
        emb = gl.OffloadedEmbedding(n, d, placement=pl, device=D(1))
    w0 = emb.weight.getNumpyVersion().copy()
    sparse = optname != "SGD"
    ref = nn.Embedding(n, d, sparse=sparse).to(D(1))
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w0))
    if sparse:  # both vs nn.Embedding(sparse=True) + SparseAdam
        opt = gl.OffloadedOptimizer(getattr(torch.optim, optname), emb, **ADAM_KW[optname])
        ropt = torch.optim.SparseAdam(ref.parameters(), **ADAM_KW[optname])
    else:  # vs a dense nn.Embedding + SGD: untouched rows get zero gradient, exact
        opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for k in range(5):
        ids = torch.randint(0, 300, (64, 4), generator=gen).to(D(1))  # many repeats
        w = torch.randn(64, 4, d, generator=gen).to(D(1))
        out, exp = emb(ids), ref(ids)
        on(out, D(1), f"step {k} lookup")
        eq(out, exp, f"step {k} forward") if k == 0 or not sparse else close(
            out, exp, f"step {k} forward"
        )
        opt.zero_grad()
        emb_loss(out, w).backward()
        opt.step()
        ropt.zero_grad()
        emb_loss(exp, w).backward()
        ropt.step()
    got = emb.weight.getNumpyVersion()
    eq(got[300:], w0[300:], "untouched rows")
    cur_is(1 if how == "set_device" else 0)
    if not sparse:
        eq(got, ref.weight, "SGD vs dense nn.Embedding + SGD (exact)")
        return "exact"
    return "vs SparseAdam: " + close(
        got, ref.weight, f"{optname} vs nn.Embedding(sparse) + SparseAdam"
    )


class W2V(nn.Module):
    def __init__(self, rows, dim, sparse=False):
        super().__init__()
        self.u_embeddings = nn.Embedding(rows, dim, sparse=sparse)
        self.v_embeddings = nn.Embedding(rows, dim, sparse=sparse)

    def forward(self, c, p, n):
        u, vp, vn = self.u_embeddings(c), self.v_embeddings(p), self.v_embeddings(n)
        neg = F.logsigmoid(-(vn @ u.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return -(F.logsigmoid((u * vp).sum(-1)) + neg).mean()


def c5_switchers(variant, optname):
    need2()
    total, dim, bsz, kneg = 1000, 16, 64, 3
    if variant.endswith("set_device(1)"):
        set_dev(1)
    model = W2V(8, dim).to(D(1))
    sparse = optname == "Adam"  # lazy Adam == SparseAdam over a sparse nn.Embedding
    opt_cls, kw = (torch.optim.Adam, ADAM_KW["Adam"]) if sparse else (torch.optim.SGD, {"lr": 0.5})
    optimizer = opt_cls(model.parameters(), **kw)
    if variant.startswith("ModelFactory"):
        mk_m = lambda var: gl.ModelFactory(var, total, dim, CPUPinn=True)
        mk_o = lambda nm: gl.OptimizerFactory(optimizer, total, dim, model, nm, CPUPinn=True)
    else:
        dev, pin = ("cpu", True) if "pinType" in variant else (str(D(1)), False)
        mk_m = lambda var: gl.PytorchModelFactory(var, total, dim, deviceType=dev, pinType=pin)
        mk_o = lambda nm: gl.PytorchOptimizerFactory(
            optimizer, total, dim, model, nm, deviceType=dev, pinType=pin
        )
    u_sw, v_sw = mk_m(model.u_embeddings), mk_m(model.v_embeddings)
    u_sw.uniformDistributionInit(-0.5, 0.5)
    v_sw.uniformDistributionInit(-0.5, 0.5)
    u_opt, v_opt = mk_o("u_embeddings"), mk_o("v_embeddings")
    u_opt.optInit()
    v_opt.optInit()
    U0, V0 = u_sw.getNumpyVersion().copy(), v_sw.getNumpyVersion().copy()
    ref = W2V(total, dim, sparse=sparse).to(D(1))
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(torch.from_numpy(U0))
        ref.v_embeddings.weight.copy_(torch.from_numpy(V0))
    ropt = (torch.optim.SparseAdam if sparse else torch.optim.SGD)(ref.parameters(), **kw)
    gen = torch.Generator().manual_seed(11)
    for k in range(3):
        center, ctx = (torch.randint(0, 300, (bsz,), generator=gen).to(D(1)) for _ in range(2))
        neg = torch.randint(0, 300, (bsz, kneg), generator=gen).to(D(1))
        lc, _ = u_sw.beforeForwardPass(center), u_opt.beforeForwardPass(center)
        (lp, ln), _ = v_sw.beforeForwardPass(ctx, neg), v_opt.beforeForwardPass(ctx, neg)
        loss = model(lc, lp, ln)
        on(loss, D(1), f"step {k} loss")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for sw in (u_sw, u_opt):
            sw.afterOptimizerStep(center)
        for sw in (v_sw, v_opt):
            sw.afterOptimizerStep(ctx, neg)
        rl = ref(center, ctx, neg)
        ropt.zero_grad()
        rl.backward()
        ropt.step()
        close(loss.detach(), rl.detach(), f"step {k} loss")
    U, V = u_sw.getNumpyVersion(), v_sw.getNumpyVersion()
    eq(U[300:], U0[300:], "untouched u rows")
    tol, rname = (1e-5, "SparseAdam") if sparse else (1e-6, "dense SGD")
    a = close(U, ref.u_embeddings.weight, f"u table vs {rname}", tol)
    return f"u {a}; v " + close(V, ref.v_embeddings.weight, f"v table vs {rname}", tol)


# ================================================================ 6. two processes, gloo
N6, B6 = 4099, 256


def _rank_main(rank, world, tmp, dry):
    """One rank: its own device, a pinned dataset from the parent's .npy files, one epoch."""
    res = {"rank": rank, "error": None}
    try:
        import torch.distributed as dist

        warnings.simplefilter("ignore")
        if not dry:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/pg",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=30),
        )
        X = np.load(f"{tmp}/x.npy")
        kw = {"device": "cpu"} if dry else {}  # on GPUs the default: the current device
        ds = gl.GadgetDataset(f"{tmp}/x.npy", f"{tmp}/y.npy", placement="pinned", **kw)
        sampler = gl.GadgetSampler(ds, batch_size=B6, order="random", seed=1)  # ranks from dist
        res.update(
            placement=ds.columns[0].placement,
            sampler=[sampler.num_replicas, sampler.rank],
            len_sampler=len(sampler),
            expect_device="cpu" if dry else f"cuda:{rank}",
        )
        ids, devs = [], set()
        for x, y in DataLoader(ds, batch_sampler=sampler):
            devs.update((str(x.device), str(y.device)))
            yn = y.cpu().numpy()
            if not np.array_equal(x.cpu().numpy(), X[yn]):
                raise RuntimeError(f"batch {len(ids)}: rows differ from the .npy file at those ids")
            ids.append(yn)
        res.update(n_batches=len(ids), devices=sorted(devs))
        np.save(f"{tmp}/ids{rank}.npy", np.concatenate(ids) if ids else np.zeros(0, np.int64))
    except BaseException as e:
        res.update(error=f"{type(e).__name__}: {e}"[:400], trace=traceback.format_exc()[-1500:])
    with open(f"{tmp}/res{rank}.json.tmp", "w") as f:
        json.dump(res, f)
    os.replace(f"{tmp}/res{rank}.json.tmp", f"{tmp}/res{rank}.json")
    os._exit(0)  # no teardown (process group, CUDA): nothing can hang once the result is written


def c6_two_processes():
    need2()
    import torch.multiprocessing as tmp_mp

    tmp = tempfile.mkdtemp(prefix="gl_mgpu6_")
    try:
        np.save(f"{tmp}/x.npy", rand(N6, 5, 19))
        np.save(f"{tmp}/y.npy", np.arange(N6, dtype=np.int64))
        ctx = tmp_mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, 2, tmp, DRY), daemon=True) for r in (0, 1)]
        CHILDREN.extend(procs)
        for p in procs:
            p.start()
        deadline = time.time() + CHILD_TIMEOUT
        for p in procs:
            p.join(max(0.1, deadline - time.time()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:  # never leave a rank behind
            for stop in (p.terminate, p.kill):
                if p.is_alive():
                    stop()
                    p.join(3)
        res = [
            json.load(open(f"{tmp}/res{r}.json"))
            if os.path.exists(f"{tmp}/res{r}.json")
            else {"error": f"no result (exit code {procs[r].exitcode})"}
            for r in (0, 1)
        ]
        if hung:
            raise Fail(
                f"rank(s) {hung} still running after {CHILD_TIMEOUT:.0f} s (terminated); {res}"
            )
        for r, x in enumerate(res):
            if x.get("error"):
                raise Fail(f"rank {r}: {x['error']} {x.get('trace', '')[-300:]}")
            for bad, msg in (
                (
                    x["sampler"] != [2, r],
                    f"sampler (num_replicas, rank) {x['sampler']}, expected [2, {r}]",
                ),
                (
                    x["devices"] != [x["expect_device"]],
                    f"batches on {x['devices']}, expected only {x['expect_device']}",
                ),
                (
                    x["n_batches"] != x["len_sampler"],
                    f"{x['n_batches']} batches, len(sampler) {x['len_sampler']}",
                ),
                (
                    x["n_batches"] != res[0]["n_batches"],
                    f"batches per rank differ: {[y['n_batches'] for y in res]}",
                ),
            ):
                if bad:
                    raise Fail(f"rank {r}: {msg}")
        ids = [np.load(f"{tmp}/ids{r}.npy") for r in (0, 1)]
        both = np.concatenate(ids)
        if not np.array_equal(np.sort(both), np.arange(N6)):
            raise Fail(
                f"union of the ranks' ids is not every row once: {len(both)} ids, "
                f"{len(np.unique(both))} distinct of {N6}, {len(np.intersect1d(*ids))} on both"
            )
        return (
            f"{res[0]['n_batches']} batches/rank, ids {len(ids[0])}+{len(ids[1])}, placement "
            f"{res[0]['placement']}, devices {res[0]['devices']}/{res[1]['devices']}"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ============================================================================ main
def main():
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        GPU_NAMES.extend(torch.cuda.get_device_name(i) for i in range(NGPU))
    except Exception as e:
        GPU_NAMES.append(f"? {type(e).__name__}: {e}")
    print(
        f"gadgetloader multi-GPU checks: torch {torch.__version__}, {NGPU} GPU(s), "
        f"cupy {getattr(cp, '__version__', None)}, dry_run={DRY} -> {OUT_JSON}"
    )
    pls, checks = ("pinned", "cuda"), []
    for pl in pls:
        checks += [
            (f"1/set_device1/{pl}/get_insert_{k}_ids", c1_get_insert, pl, k)
            for k in ("cpu", "numpy", "cuda", "cupy")
        ]
        checks += [
            (f"1/set_device1/{pl}/strategies", c1_strategies, pl),
            (f"1/set_device1/{pl}/bad_ids_and_data", c1_bad_ids, pl),
        ]
    checks += [(f"2/device_arg_cuda1/{pl}", c2_device_arg, pl) for pl in pls]
    checks += [
        (f"4/pipeline/{pl}/{form}/{how}", c4_pipeline, pl, form, how)
        for pl in pls
        for form in ("default", "sampler", "gadgetloader")
        for how in ("device_arg", "set_device")
    ]
    checks += [
        (f"5/offloaded/{pl}/{o}/{how}", c5_offloaded, pl, o, how)
        for pl in pls
        for o in ("Adam", "SparseAdam", "SGD")
        for how in ("device_arg", "set_device")
    ]
    checks += [
        (f"5/switchers/{v}/{o}", c5_switchers, v, o)
        for o in ("Adam", "SGD")
        for v in (
            "PytorchModelFactory(deviceType=cuda:1)",
            "PytorchModelFactory(deviceType=cpu,pinType=True)",
            "ModelFactory(CPUPinn=True)+set_device(1)",
        )
    ]
    checks.append(("6/two_processes_gloo_GadgetSampler", c6_two_processes))  # fresh processes
    # last: the corners most likely to leave a broken CUDA context behind
    checks += [(f"3/made_on_0_used_from_1_and_0/{pl}", c3_cross_device, pl) for pl in pls]
    checks += [
        (f"2/wrong_gpu_{w.split()[0]}/{pl}", c2_wrong_gpu, pl, w)
        for pl in pls
        for w in ("data on the other GPU", "ids on the other GPU")
    ]
    checks += [
        (f"2/wrong_gpu_ids_check_ids_False/{pl}", c2_wrong_gpu, pl, "ids on the other GPU", False)
        for pl in pls
    ]
    for name, fn, *args in checks:
        run(name, fn, *args)
    write_json()
    summary()
    os._exit(0)  # skip interpreter teardown; the results are written


if __name__ == "__main__":
    main()
