"""Black-box review (session 32) of resource leaks and memory use on the CPU (file
descriptors, threads, RSS, temporary files); written from README.md, SPEC.md and the
public docstrings only.

Measurements that need clean numbers (RSS, peak RSS, a file size limit) run in one
subprocess started with ``CUDA_VISIBLE_DEVICES=""``; descriptor and thread counts are
checked in-process as deltas around repeated work, after a warm-up (lazily created
process-wide helpers -- an I/O pool, tqdm's monitor, multiprocessing's resource sharer --
are fine once; growth with every repetition is a leak).
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import json
import multiprocessing
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc for fd/thread/RSS counts"
)


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")
ROWS, DIM = 4096, 32
X = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
Y = np.arange(ROWS, dtype=np.int64) * 3
FMTS = ("npy", "h5", "zarr")


# ---------------------------------------------------------------- helpers


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_targets() -> list[str]:
    out = []
    for f in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{f}"))
    return out


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


#: thread pools (the library's, zarr's, tqdm's monitor) that grow on demand up to their
#: size, one thread per core: a machine with many cores adds threads to them over several
#: calls, which is not a leak, so their threads are not counted
_POOLS = ("gadgetloader-io_", "gl-zarr_", "asyncio_", "zarr_io", "tqdm_monitor")


def _snapshot():
    gc.collect()
    pooled = sum(t.name.startswith(_POOLS) for t in threading.enumerate())
    return _fd_count(), threading.active_count() - pooled, _tasks() - pooled, _fd_targets()


def _settle(base, timeout=3.0):
    """Wait (briefly) for threads / fds that are on their way out, then snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snap = _snapshot()
        if (snap[0] <= base[0] and snap[1] <= base[1] and snap[2] <= base[2]) or (
            time.monotonic() > deadline
        ):
            return snap
        time.sleep(0.05)


def _assert_back(base, after, what):
    new = sorted(set(after[3]) - set(base[3]))
    assert after[0] <= base[0], f"{what}: open fds {base[0]} -> {after[0]}; new: {new}"
    assert after[1] <= base[1], (
        f"{what}: threading.active_count {base[1]} -> {after[1]}: "
        f"{sorted(t.name for t in threading.enumerate())}"
    )
    assert after[2] <= base[2], f"{what}: /proc/self/task {base[2]} -> {after[2]}"


def _repeat_clean(fn, n, what, warmup=2):
    for _ in range(warmup):
        fn()
    base = _snapshot()
    for _ in range(n):
        fn()
    _assert_back(base, _settle(base), what)


def _hidden(folder) -> list[str]:
    return sorted(
        f for f in os.listdir(folder) if f.startswith(".") or "partial" in f or ".old-" in f
    )


@contextlib.contextmanager
def _no_fallback_noise():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        yield


def _write_zarr(path, arr, chunks):
    z = zarr.create_array(str(path), shape=arr.shape, dtype=arr.dtype, chunks=chunks)
    z[:] = arr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("res32")
    np.save(d / "x.npy", X)
    with h5py.File(d / "x.h5", "w") as f:
        f.create_dataset("data", data=X, chunks=(256, DIM))
    _write_zarr(d / "x.zarr", X, (256, DIM))
    raw = (d / "x.npy").read_bytes()
    (d / "trunc.npy").write_bytes(raw[: len(raw) // 2])
    (d / "junk.h5").write_bytes(b"this is not an HDF5 file" * 64)
    np.save(d / "u32.npy", np.arange(64, dtype=np.uint32).reshape(32, 2))
    np.save(d / "obj.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    np.save(d / "y.npy", Y)
    np.save(d / "x2.npy", X[::-1].copy())
    return d


def _path(files, fmt, stem="x"):
    return str(files / f"{stem}.{fmt}")


# ------------------------------------------------- the subprocess (clean numbers)

PROBE = r'''
import gc, json, os, resource, signal, sys, threading, time, warnings
import numpy as np
import torch
import gadgetloader as gl
import h5py, zarr
warnings.simplefilter("ignore")
D = sys.argv[1]
R = {}
MB = 1 << 20


def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


try:
    import ctypes
    _trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _trim = None


def settled():
    """VmRSS after a collection, with freed heap memory handed back (glibc's malloc_trim):
    growth measured this way is memory still in use, not the allocator's free lists."""
    gc.collect()
    if _trim is not None:
        _trim(0)
    return status()["VmRSS"]


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(name, make, nbytes):
    gc.collect()
    s0 = status()
    try:
        reset_peak()
        can_peak = True
    except OSError:
        can_peak = False
    t = time.time()
    g = make()
    s1 = status()
    R[name] = dict(nbytes=nbytes, rss=s1["VmRSS"] - s0["VmRSS"], anon=s1["RssAnon"] - s0["RssAnon"],
                   peak=(s1["VmHWM"] - s0["VmRSS"]) if can_peak else None, secs=time.time() - t)
    return g


# -- 1. a 256 MB 'cpu' table costs ~1x its bytes ---------------------------------------
N = 256 * MB
shape = (N // (16384 * 4), 16384)
for name, kw in (("shape_cpu", dict(placement="cpu")), ("shape_cpupinn", dict(CPUPinn=True))):
    g = measure(name, lambda: gl.DataGadget(shape, dtype="float32", **kw), N)
    g.fill_(1.5)
    R[name]["placement"] = g.placement
    R[name]["ok"] = bool(g.getData([0, shape[0] - 1]).eq(1.5).all())
    g.close(); del g; gc.collect()
    R[name]["after_close"] = status()["VmRSS"]

a = np.lib.format.open_memmap(os.path.join(D, "big.npy"), mode="w+", dtype=np.float32, shape=shape)
a[:] = 2.5
a.flush(); del a
with h5py.File(os.path.join(D, "big.h5"), "w") as f:
    ds = f.create_dataset("data", shape=shape, dtype="float32", chunks=(64, 16384), fillvalue=2.5)
    ds[:64] = 1.0
z = zarr.create_array(os.path.join(D, "big.zarr"), shape=shape, dtype="float32", chunks=(64, 16384), fill_value=2.5)
z[:64] = 1.0
del z
for fmt in ("npy", "h5", "zarr"):
    name = "load_" + fmt
    g = measure(name, lambda: gl.DataGadget(os.path.join(D, "big." + fmt), placement="cpu", progress=False), N)
    row = g.getData([63, 64, shape[0] - 1])[:, 0].tolist()
    R[name]["ok"] = row == ([2.5, 2.5, 2.5] if fmt == "npy" else [1.0, 2.5, 2.5])
    R[name]["row"] = row
    g.close(); del g; gc.collect()
import shutil
os.remove(os.path.join(D, "big.npy"))
shutil.rmtree(os.path.join(D, "big.zarr"), ignore_errors=True)
os.remove(os.path.join(D, "big.h5"))

# -- 2. 200 create/close cycles of a 16 MB cpu table -----------------------------------
S16 = (256, 16384)
src16 = np.random.default_rng(0).random(S16, dtype=np.float32)
np.save(os.path.join(D, "t16.npy"), src16)


def cyc_shape_close(i):
    g = gl.DataGadget(S16, dtype="float32", placement="cpu"); g.fill_(float(i)); v = g.getData([5])[0, 0].item(); g.close(); return v == float(i)


def cyc_shape_del(i):
    g = gl.DataGadget(S16, dtype="float32", placement="cpu"); g.fill_(float(i)); v = g.getData([5])[0, 0].item(); del g; return v == float(i)


def cyc_array_with(i):
    with gl.DataGadget(src16, placement="cpu") as g:
        return bool(g.getData([7])[0].eq(torch.from_numpy(src16[7])).all())


def cyc_npy_close(i):
    g = gl.DataGadget(os.path.join(D, "t16.npy"), placement="cpu", progress=False); v = bool(g.getData([9])[0].eq(torch.from_numpy(src16[9])).all()); g.close(); return v


def cyc_pinn_close(i):
    g = gl.DataGadget(S16, dtype="float32", CPUPinn=True); g.fill_(1.0); g.close(); return True


for name, fn, n in (("cyc_shape_close", cyc_shape_close, 200), ("cyc_shape_del", cyc_shape_del, 100),
                    ("cyc_array_with", cyc_array_with, 60), ("cyc_npy_close", cyc_npy_close, 30),
                    ("cyc_pinn_close", cyc_pinn_close, 60)):
    for i in range(5):
        fn(i)
    s0 = settled()
    ok = all(fn(i) for i in range(n))
    s1 = settled()
    R[name] = dict(growth=s1 - s0, ok=ok, n=n)

# -- 3. repeated save/load -------------------------------------------------------------
for fmt, n_warm, n in (("npy", 3, 12), ("h5", 3, 12), ("zarr", 2, 6)):
    p = os.path.join(D, "sl." + fmt)
    g = gl.DataGadget(src16, placement="cpu")
    opts = {"compression": "none"} if fmt == "zarr" else {}

    def cycle(i):
        g.save(p, progress=False, **opts)
        g.load(p, progress=False)
        h = gl.DataGadget(p, placement="cpu", progress=False)
        ok = bool(h.getData([i % 256])[0].eq(torch.from_numpy(src16[i % 256])).all())
        h.close()
        return ok
    for i in range(n_warm):
        cycle(i)
    s0 = settled()
    ok = all(cycle(i) for i in range(n))
    s1 = settled()
    R["saveload_" + fmt] = dict(growth=s1 - s0, ok=ok and bool(torch.equal(g.as_tensor(), torch.from_numpy(src16))),
                                listing=sorted(os.listdir(D)))
    g.close()

# -- 4. 'file' placement, 512 MB file, 16 MB cache -------------------------------------
BR, BD = 8192, 16384                              # 512 MiB, 64 KiB rows
exp = np.zeros(BR, np.float32); exp[::512] = np.arange(16) + 1
a = np.lib.format.open_memmap(os.path.join(D, "huge.npy"), mode="w+", dtype=np.float32, shape=(BR, BD))
a[::512, 0] = np.arange(16) + 1
a.flush(); del a
with h5py.File(os.path.join(D, "huge.h5"), "w") as f:
    ds = f.create_dataset("data", shape=(BR, BD), dtype="float32", chunks=(64, BD), fillvalue=0.0)
    ds[::512, 0] = np.arange(16) + 1
z = zarr.create_array(os.path.join(D, "huge.zarr"), shape=(BR, BD), dtype="float32", chunks=(64, BD), fill_value=0.0)
for i in range(16):
    z[i * 512, 0] = i + 1
del z
for fmt, wr in (("npy", None), ("h5", None), ("h5", False), ("zarr", None)):
    name = f"file_{fmt}_{wr}"
    gc.collect(); s0 = status()
    g = gl.DataGadget(os.path.join(D, "huge." + fmt), placement="file", cache_bytes=16 * MB, writable=wr)
    worst = 0
    worst_cache = 0
    ok = True
    t = time.time()
    for start in range(0, BR, 128):
        r = g.getData(torch.arange(start, start + 128))
        ok = ok and bool(np.array_equal(r[:, 0].numpy(), exp[start:start + 128]))
        del r
        worst = max(worst, status()["RssAnon"] - s0["RssAnon"])
        worst_cache = max(worst_cache, g.store.cached_bytes)
    ids = torch.from_numpy(np.random.default_rng(1).permutation(BR)[:512])
    r = g.getData(ids)
    ok = ok and bool(np.array_equal(r[:, 0].numpy(), exp[ids.numpy()]))
    del r
    worst = max(worst, status()["RssAnon"] - s0["RssAnon"])
    R[name] = dict(worst_anon=worst, file_bytes=BR * BD * 4, cache_bytes=16 * MB, worst_cached=worst_cache, ok=ok, secs=time.time() - t)
    g.close(); del g; gc.collect()

# -- 5. a save that fails part-way (file size limit) -----------------------------------
old = np.arange(40, dtype=np.float32).reshape(10, 4)
for fmt in ("npy", "h5", "zarr"):
    gl.DataGadget(old, placement="cpu").save(os.path.join(D, "fs_old." + fmt), progress=False)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
g = gl.DataGadget((1024, 1024), dtype="float32", placement="cpu")
g.fill_(7.0)
for fmt in ("npy", "h5", "zarr"):
    opts = {"compression": "none", "chunk_rows": 512} if fmt == "zarr" else {}
    for target in ("fs_old", "fs_new"):
        p = os.path.join(D, f"{target}.{fmt}")
        before = sorted(os.listdir(D))
        try:
            g.save(p, progress=False, **opts)
            err = None
        except BaseException as e:
            err = [type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)]
        after = sorted(os.listdir(D))
        intact = None
        if target == "fs_old":
            try:
                h = gl.DataGadget(p, placement="cpu", progress=False)
                intact = bool(np.array_equal(h.getNumpyVersion(), old))
                h.close()
            except BaseException as e:
                intact = repr(e)
        R[f"fsize_{target}_{fmt}"] = dict(err=err, before=before, after=after, intact=intact, path=p)
print("@@RESULT@@" + json.dumps(R))
'''


@pytest.fixture(scope="module", autouse=True)
def _probe_proc(tmp_path_factory):
    """Start the measuring subprocess as soon as the module starts, so that it runs while
    the in-process tests do; `probe` collects its result."""
    d = tmp_path_factory.mktemp("probe32")
    script = d / "probe.py"
    script.write_text(PROBE)
    work = d / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(work)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    holder = {"proc": proc, "work": str(work), "result": None}
    yield holder
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):  # (also when no test read them)
        if pipe is not None:
            pipe.close()


@pytest.fixture(scope="module")
def probe(_probe_proc):
    if _probe_proc["result"] is None:
        proc = _probe_proc["proc"]
        out, err = proc.communicate(timeout=300)
        line = [x for x in out.splitlines() if x.startswith("@@RESULT@@")]
        assert proc.returncode == 0 and line, f"probe failed rc={proc.returncode}\n{err[-3000:]}"
        res = json.loads(line[0][len("@@RESULT@@") :])
        res["_dir"] = _probe_proc["work"]
        _probe_proc["result"] = res
    return _probe_proc["result"]


MB = 1 << 20


# ------------------------------------------------------- fds / threads (in-process)


@pytest.mark.parametrize("release", ["close", "del", "with"])
@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("fmt", FMTS)
def test_gadget_open_release_no_leak(files, fmt, placement, release):
    path = _path(files, fmt)
    ids = torch.tensor([1, 4000, 77, 1])

    def once():
        if release == "with":
            with gl.DataGadget(path, placement=placement, progress=False) as g:
                r = g.getData(ids)
        else:
            g = gl.DataGadget(path, placement=placement, progress=False)
            r = g.getData(ids)
            if release == "close":
                g.close()
            del g
        assert torch.equal(r, torch.from_numpy(X[ids.numpy()]))

    _repeat_clean(once, 15, f"{fmt}/{placement}/{release}")


@pytest.mark.parametrize("fmt", FMTS)
def test_file_table_writes_flush_close_no_leak(files, fmt, tmp_path):
    p = str(tmp_path / f"w.{fmt}")
    gl.DataGadget(X, placement="cpu").save(p, progress=False)
    ids = torch.tensor([3, 2000, 4095])
    state = {"i": 0}

    def once():
        state["i"] += 1
        g = gl.DataGadget(p, placement="file")
        g.insertData(torch.full((3, DIM), float(state["i"])), ids)
        g.flush()
        g.close()

    _repeat_clean(once, 10, f"file writes {fmt}")
    with gl.DataGadget(p, placement="cpu", progress=False) as g:
        assert g.getData(ids).eq(float(state["i"])).all()
        assert torch.equal(g.getData([0, 1]), torch.from_numpy(X[[0, 1]]))
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_reload_other_files_no_leak(files, placement):
    """load() 'Replace the table with a file's contents, keeping the placement.'"""
    g = gl.DataGadget(_path(files, "npy"), placement=placement, progress=False)
    srcs = [
        (_path(files, "npy", "x2"), X[::-1]),
        (_path(files, "h5"), X),
        (_path(files, "zarr"), X),
    ]
    state = {"i": 0}

    def once():
        p, ref = srcs[state["i"] % 3]
        state["i"] += 1
        g.load(p, progress=False)
        assert torch.equal(g.getData([0, 4095]), torch.from_numpy(ref[[0, 4095]].copy()))

    _repeat_clean(once, 9, f"load() cycles on {placement}", warmup=3)
    g.close()


@pytest.mark.parametrize("fmt", FMTS)
def test_file_gathers_threads_stable(files, fmt):
    g = gl.DataGadget(_path(files, fmt), placement="file", cache_bytes=64 * 1024)
    rng = np.random.default_rng(5)

    def once():
        ids = rng.integers(0, ROWS, 3000)
        assert np.array_equal(g.getData(torch.from_numpy(ids)).numpy(), X[ids])

    _repeat_clean(once, 10, f"file gathers {fmt}")
    g.close()


@pytest.mark.parametrize("release", ["close", "del"])
@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("fmt", FMTS)
def test_dataset_open_release_no_leak(files, fmt, placement, release):
    path = _path(files, fmt)

    def once():
        ds = gl.GadgetDataset(path, _path(files, "npy", "y"), placement=placement, device="cpu")
        b = ds[[5, 9, 4095]]
        assert torch.equal(b[0], torch.from_numpy(X[[5, 9, 4095]]))
        assert b[1].tolist() == Y[[5, 9, 4095]].tolist()
        if release == "close":
            ds.close()
        del ds, b

    _repeat_clean(once, 8, f"dataset {fmt}/{placement}/{release}")


def test_dataset_close_leaves_passed_gadgets_open(files):
    """GadgetDataset.close(): 'Free the tables this dataset created (not DataGadgets
    passed in).'"""
    g = gl.DataGadget(_path(files, "h5"), placement="file")
    ds = gl.GadgetDataset(g, Y, device="cpu")
    ds.close()
    assert torch.equal(g.getData([7]), torch.from_numpy(X[[7]]))
    g.close()


def _failed_open_cases(files):
    return {
        "trunc_npy_cpu": (
            lambda: gl.DataGadget(_path(files, "npy", "trunc"), placement="cpu", progress=False),
            gl.GadgetFileError,
            "truncated",
        ),
        "trunc_npy_file": (
            lambda: gl.DataGadget(_path(files, "npy", "trunc"), placement="file"),
            gl.GadgetFileError,
            "truncated",
        ),
        "junk_h5_file": (
            lambda: gl.DataGadget(_path(files, "h5", "junk"), placement="file"),
            gl.GadgetFileError,
            "junk.h5",
        ),
        "junk_h5_cpu": (
            lambda: gl.DataGadget(_path(files, "h5", "junk"), placement="cpu"),
            gl.GadgetFileError,
            "junk.h5",
        ),
        "h5_bad_dataset_file": (
            lambda: gl.DataGadget(_path(files, "h5"), placement="file", dataset="nope"),
            gl.GadgetKeyError,
            "data",
        ),
        "h5_bad_dataset_cpu": (
            lambda: gl.DataGadget(_path(files, "h5"), placement="cpu", dataset="nope"),
            gl.GadgetKeyError,
            "data",
        ),
        "zarr_bad_dataset": (
            lambda: gl.DataGadget(_path(files, "zarr"), placement="file", dataset="nope"),
            gl.GadgetKeyError,
            "nope",
        ),
        "uint32_file": (
            lambda: gl.DataGadget(_path(files, "npy", "u32"), placement="file"),
            gl.GadgetTypeError,
            "uint32",
        ),
        "object_dtype": (
            lambda: gl.DataGadget(_path(files, "npy", "obj"), placement="cpu"),
            gl.GadgetTypeError,
            "object",
        ),
        "missing": (
            lambda: gl.DataGadget(str(files / "missing.npy"), placement="file"),
            gl.GadgetFileNotFoundError,
            "missing.npy",
        ),
        "bad_cache_h5": (
            lambda: gl.DataGadget(_path(files, "h5"), placement="file", cache_bytes=-1),
            gl.GadgetValueError,
            "cache_bytes",
        ),
        "bad_writable_zarr": (
            lambda: gl.DataGadget(_path(files, "zarr"), placement="file", writable="yes"),
            gl.GadgetTypeError,
            "writable",
        ),
        "dataset_missing_col": (
            lambda: gl.GadgetDataset(
                _path(files, "h5"), str(files / "nothere.npy"), placement="file", device="cpu"
            ),
            gl.GadgetFileNotFoundError,
            "nothere",
        ),
        "dataset_row_mismatch": (
            lambda: gl.GadgetDataset(
                _path(files, "zarr"), np.arange(5), placement="file", device="cpu"
            ),
            gl.GadgetValueError,
            "",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "trunc_npy_cpu",
        "trunc_npy_file",
        "junk_h5_file",
        "junk_h5_cpu",
        "h5_bad_dataset_file",
        "h5_bad_dataset_cpu",
        "zarr_bad_dataset",
        "uint32_file",
        "object_dtype",
        "missing",
        "bad_cache_h5",
        "bad_writable_zarr",
        "dataset_missing_col",
        "dataset_row_mismatch",
    ],
)
def test_failed_open_releases_everything(files, case):
    """A refused file (README, Errors: truncated/unreadable files, wrong dataset names,
    unsupported dtypes, bad options) must not leave its handle open."""
    fn, exc, frag = _failed_open_cases(files)[case]

    def once():
        with pytest.raises(exc) as ei:
            fn()
        assert frag in str(ei.value)
        del ei

    _repeat_clean(once, 10, case)
    if case == "h5_bad_dataset_file":
        # the HDF5 file must be free for writing again (no handle left)
        with h5py.File(_path(files, "h5"), "r+") as f:
            assert f["data"].shape == (ROWS, DIM)


def _run_loader(files, fmt, placement, kind, nw, early_break=False, persistent=False):
    ds = gl.GadgetDataset(_path(files, fmt), Y, placement=placement, device="cpu")
    kw = dict(num_workers=nw)
    if persistent:
        kw["persistent_workers"] = True
    if kind == "dl":
        loader = DataLoader(ds, batch_size=512, shuffle=True, **kw)
    elif kind == "dl_sampler":
        loader = DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=512, seed=1), **kw)
    else:
        loader = gl.GadgetLoader(ds, batch_size=512, **kw)
    seen = []
    for _ in range(2 if persistent else 1):
        for xb, yb in loader:
            idx = yb.numpy() // 3
            assert np.array_equal(xb.numpy(), X[idx])
            seen.append(idx)
            if early_break and len(seen) == 2:
                break
    if not early_break:
        got = np.sort(np.concatenate(seen))
        assert np.array_equal(got, np.sort(np.tile(np.arange(ROWS), 2 if persistent else 1)))
    del loader
    ds.close()


LOADER_CASES = [
    ("npy", "file", "dl", 2, False, False),
    ("h5", "file", "dl", 2, False, False),
    ("zarr", "file", "dl", 2, False, False),
    ("h5", "file", "dl_sampler", 2, False, False),
    ("npy", "cpu", "dl_sampler", 2, False, False),
    ("npy", "file", "gl", 2, False, False),
    ("h5", "file", "gl", 2, False, False),
    ("zarr", "file", "gl", 2, False, False),
    ("h5", "file", "gl", 0, False, False),
    ("h5", "file", "dl", 2, True, False),
    ("zarr", "file", "gl", 2, True, False),
    ("h5", "file", "gl", 1, False, True),
]


@pytest.mark.parametrize("fmt,placement,kind,nw,early,persistent", LOADER_CASES)
def test_loader_iteration_no_leak(files, fmt, placement, kind, nw, early, persistent):
    """Iterating DataLoader / GadgetLoader (workers reopen file gadgets: README, 'Worker
    processes') and dropping the loader leaves no fds, threads or worker processes."""
    children_before = {c.pid for c in multiprocessing.active_children()}

    def once():
        _run_loader(files, fmt, placement, kind, nw, early, persistent)

    _repeat_clean(once, 2, f"{kind} {fmt}/{placement} workers={nw}", warmup=1)
    deadline = time.monotonic() + 5
    new: set[int] = set()
    while time.monotonic() < deadline:
        new = {c.pid for c in multiprocessing.active_children()} - children_before
        if not new:
            break
        time.sleep(0.05)
    assert not new, f"worker processes still alive: {new}"


def _mapped(path) -> int:
    with open("/proc/self/maps") as f:
        return sum(str(path) in line for line in f)


@pytest.mark.parametrize("release", ["close", "del", "load_other"])
@pytest.mark.parametrize("writable", [None, False])
@pytest.mark.parametrize("fmt", ["npy", "h5"])
def test_file_table_memory_map_released(files, tmp_path, fmt, writable, release):
    """README: '.npy files and uncompressed HDF5 datasets opened read-only are gathered
    through a memory map'. close() ('Free the table's memory now'), garbage collection and
    load() of another file must unmap the file (a mapping holds the file like an fd)."""
    p = tmp_path / f"m.{fmt}"
    gl.DataGadget(X, placement="cpu").save(str(p), progress=False)
    for _ in range(3):
        g = gl.DataGadget(str(p), placement="file", writable=writable)
        assert torch.equal(g.getData([1, 4095]), torch.from_numpy(X[[1, 4095]]))
        if release == "close":
            g.close()
        elif release == "load_other":
            g.load(_path(files, "npy", "x2"))
            assert torch.equal(g.getData([0]), torch.from_numpy(X[[4095]]))
        del g
        gc.collect()
        assert _mapped(p) == 0, f"{p} still mapped after {release}"
    base = _snapshot()
    os.remove(p)  # nothing holds it: the space is really freed
    assert _snapshot()[0] == base[0]


@pytest.mark.parametrize("cache", [0, 64 * 1024, 1 << 20])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_file_cache_budget_respected(files, fmt, cache):
    """DataGadget: ``cache_bytes`` is 'the block cache's budget, default 256 MiB, 0 turns
    it off'; FileStore.cached_bytes: 'Bytes of blocks the cache holds now (never above
    cache_bytes)'."""
    g = gl.DataGadget(_path(files, fmt), placement="file", cache_bytes=cache)
    rng = np.random.default_rng(3)
    worst = 0
    for _ in range(8):
        ids = rng.integers(0, ROWS, 700)
        assert np.array_equal(g.getData(torch.from_numpy(ids)).numpy(), X[ids])
        worst = max(worst, g.store.cached_bytes)
    assert worst <= cache
    if cache == 0:
        assert worst == 0
    g.close()


@pytest.mark.parametrize("release", ["close", "del", "with", "dataset_close", "loader_done"])
def test_hdf5_handle_released(files, tmp_path, release):
    """README: 'an open HDF5 `file` table, read-only ones (`writable=False`) too, holds the
    lock, so another process cannot open that file to write until the table is closed'.
    Once released, the file opens for writing again."""
    p = str(tmp_path / "lock.h5")
    gl.DataGadget(X, placement="cpu").save(p, progress=False)
    if release == "with":
        with gl.DataGadget(p, placement="file", writable=False) as g:
            g.getData([1])
    elif release in ("close", "del"):
        g = gl.DataGadget(p, placement="file", writable=False)
        g.getData([1])
        if release == "close":
            g.close()
        del g
    elif release == "dataset_close":
        ds = gl.GadgetDataset(p, placement="file", device="cpu")
        ds[[1, 2]]
        ds.close()
    else:
        ds = gl.GadgetDataset(p, placement="file", device="cpu")
        assert sum(len(b[0]) for b in gl.GadgetLoader(ds, batch_size=1000)) == ROWS
        del ds
    gc.collect()
    with h5py.File(p, "r+") as f:
        f["data"][0, 0] = -1.0
    with gl.DataGadget(p, placement="cpu", progress=False) as h:
        assert h.getData([0])[0, 0].item() == -1.0


@pytest.mark.parametrize("form", ["gadgetloader", "dl_sampler", "dl_default"])
def test_epochs_keep_thread_count(form):
    """README: sampler orders are computed in background threads (two epochs ahead);
    many epochs must not pile threads up."""
    ds = gl.GadgetDataset(X, Y, placement="cpu", device="cpu")
    if form == "gadgetloader":
        loader = gl.GadgetLoader(ds, batch_size=1000, seed=2)
    elif form == "dl_sampler":
        loader = DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=1000, seed=2))
    else:
        loader = DataLoader(ds, batch_size=1000, shuffle=True)

    def epoch():
        ys = np.concatenate([b[1].numpy() for b in loader])
        assert np.array_equal(np.sort(ys), Y)

    _repeat_clean(epoch, 8, f"epochs of {form}", warmup=3)
    ds.close()


# ---------------------------------------------------------------- saves


@pytest.mark.parametrize(
    "method", ["save_npy", "save_h5", "save_zarr", "saveCupy", "save_h5_gzip", "save_zarr_zstd"]
)
def test_saves_leave_no_temp_and_no_fds(tmp_path, method):
    g = gl.DataGadget(X, placement="cpu")
    state = {"i": 0}

    def once():
        state["i"] += 1
        g.fill_(float(state["i"]))
        if method == "saveCupy":
            g.saveCupy(str(tmp_path / "t"))
        elif method == "save_h5_gzip":
            g.save(str(tmp_path / "t.h5"), progress=False, compression="gzip", dataset="emb")
        elif method == "save_zarr_zstd":
            g.save(str(tmp_path / "t.zarr"), progress=False, compression="zstd", chunk_rows=512)
        else:
            g.save(str(tmp_path / f"t.{method[5:]}"), progress=False)

    _repeat_clean(once, 6, method)
    names = os.listdir(tmp_path)
    assert len(names) == 1 and not _hidden(tmp_path), names
    with gl.DataGadget(str(tmp_path / names[0]), placement="cpu", progress=False) as h:
        assert h.getData([0, 4095]).eq(float(state["i"])).all()
    g.close()


def test_file_table_saved_over_its_own_file(files, tmp_path):
    p = str(tmp_path / "own.h5")
    gl.DataGadget(X, placement="cpu").save(p, progress=False, dataset="emb/words")
    g = gl.DataGadget(p, placement="file", dataset="emb/words")
    base = _snapshot()
    for _ in range(3):
        g.save(p, progress=False)
    _assert_back(base, _settle(base), "file table saved over its own file")
    assert _hidden(tmp_path) == [] and os.listdir(tmp_path) == ["own.h5"]
    assert torch.equal(g.getData([9, 10]), torch.from_numpy(X[[9, 10]]))
    g.close()
    with h5py.File(p, "r") as f:
        assert list(f["emb"].keys()) == ["words"]


def _refused_save_cases(tmp_path):
    (tmp_path / "dir.npy").mkdir()
    (tmp_path / "dir.h5").mkdir()
    (tmp_path / "notzarr.zarr").mkdir()
    (tmp_path / "notzarr.zarr" / "stuff.txt").write_text("x")
    return {
        "bad_compression_h5": (
            dict(path="t.h5", compression="bogus"),
            (gl.GadgetKeyError, gl.GadgetValueError),
        ),
        "bad_compression_zarr": (
            dict(path="t.zarr", compression="lzf"),
            (gl.GadgetKeyError, gl.GadgetValueError),
        ),
        "bad_level": (
            dict(path="t.h5", compression="gzip", compression_level=99),
            (gl.GadgetValueError,),
        ),
        "progress_str": (dict(path="t.npy", progress="False"), (gl.GadgetTypeError,)),
        "dataset_dotdot": (dict(path="t.h5", dataset="a/../b"), (gl.GadgetValueError,)),
        "dir_npy": (dict(path="dir.npy"), (gl.GadgetFileError,)),
        "dir_h5": (dict(path="dir.h5"), (gl.GadgetFileError,)),
        "notzarr": (dict(path="notzarr.zarr"), (gl.GadgetFileError,)),
        "none_path": (dict(path=None), (gl.GadgetTypeError,)),
    }


@pytest.mark.parametrize(
    "case",
    [
        "bad_compression_h5",
        "bad_compression_zarr",
        "bad_level",
        "progress_str",
        "dataset_dotdot",
        "dir_npy",
        "dir_h5",
        "notzarr",
        "none_path",
    ],
)
def test_refused_save_makes_no_file(tmp_path, case):
    """README: 'Bad arguments (progress="False", an unknown compression) are refused before
    any file is made'; a directory target (.npy, HDF5) or a folder that is not a zarr store
    is refused."""
    cases = _refused_save_cases(tmp_path)
    kw, excs = cases[case]
    kw = dict(kw)
    name = kw.pop("path")
    target = None if name is None else str(tmp_path / name)
    kw.setdefault("progress", False)
    g = gl.DataGadget(X, placement="cpu")
    before = sorted(os.listdir(tmp_path))
    tree_before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))

    def once():
        with pytest.raises(excs):
            g.save(target, **kw)

    _repeat_clean(once, 5, case)
    assert sorted(os.listdir(tmp_path)) == before
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == tree_before
    assert torch.equal(g.as_tensor(), torch.from_numpy(X))
    g.close()


def _save_opts(fmt):
    return {"compression": "none"} if fmt == "zarr" else {}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("fmt", FMTS)
def test_interrupted_save_leaves_no_partial(tmp_path, fmt):
    """README: 'An interrupt (Ctrl-C) during a save or convert removes the partial file;
    one that comes while the finished file replaces the target is held until it is in
    place and then raised as a KeyboardInterrupt saying "interrupted after ... was
    written"'; otherwise the old file stays ('an exception or a kill part-way leaves the
    old file')."""
    old = np.arange(40, dtype=np.float32).reshape(10, 4)
    target = str(tmp_path / f"t.{fmt}")
    big = gl.DataGadget((1024, 16384), dtype="float32", placement="cpu")  # 64 MiB
    big.fill_(4.0)
    # warm-up: lazily made I/O pools (save and load)
    big.save(target, progress=False, **_save_opts(fmt))
    gl.DataGadget(target, placement="cpu", progress=False).close()
    outcomes = []
    base = _snapshot()
    for delay in (0.03, 0.08):
        gl.DataGadget(old, placement="cpu").save(target, progress=False)
        timer = threading.Timer(delay, _thread.interrupt_main)
        try:
            timer.start()
            big.save(target, progress=False, **_save_opts(fmt))
            time.sleep(1.0)  # the interrupt lands here if the save won the race
            outcomes.append("no interrupt")
        except KeyboardInterrupt as e:
            outcomes.append(f"KI {e}")
        finally:
            timer.cancel()
            timer.join()
        assert _hidden(tmp_path) == [], (outcomes, _hidden(tmp_path))
        assert os.listdir(tmp_path) == [f"t.{fmt}"]
        with gl.DataGadget(target, placement="cpu", progress=False) as h:
            if h.shape == (10, 4):
                assert np.array_equal(h.getNumpyVersion(), old), outcomes
            else:
                assert h.shape == (1024, 16384) and h.getData([0, 1023]).eq(4.0).all(), outcomes
    _assert_back(base, _settle(base), "interrupted saves")
    big.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_interrupt_as_soon_as_partial_appears(tmp_path, fmt):
    """README: 'An interrupt (Ctrl-C) during a save or convert removes the partial file'.
    Here Ctrl-C (``_thread.interrupt_main``) comes the moment the hidden
    ``.NAME.partial-PID-XXXXXXXX`` shows up beside the target (a watcher thread, with a
    short thread switch interval so that it sees it early); repeated 40 times."""
    g = gl.DataGadget((64, 16384), dtype="float32", placement="cpu")  # 4 MiB
    g.fill_(1.0)
    target = str(tmp_path / f"t.{fmt}")
    leftovers = []
    outcomes = []

    def watch(stop):
        while not stop.is_set():
            try:
                names = os.listdir(tmp_path)
            except OSError:
                continue
            if any(".partial-" in n for n in names):
                _thread.interrupt_main()
                return

    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        for _ in range(40):
            stop = threading.Event()
            th = threading.Thread(target=watch, args=(stop,))
            th.start()
            try:
                g.save(target, progress=False, **_save_opts(fmt))
                time.sleep(0.02)
                outcomes.append("completed")
            except KeyboardInterrupt:
                outcomes.append("KI")
            finally:
                stop.set()
                th.join()
            left = _hidden(tmp_path)
            if left:
                leftovers.append(left)
            for n in os.listdir(tmp_path):
                fp = tmp_path / n
                shutil.rmtree(fp) if fp.is_dir() else fp.unlink()
    finally:
        sys.setswitchinterval(old_switch)
    assert leftovers == [], (
        f"{len(leftovers)} of 40 interrupted saves left a partial file: {leftovers[:3]}; "
        f"outcomes {outcomes}"
    )
    g.close()


# ---------------------------------------------------------------- convert


def _convert_inprocess(argv):
    saved = sys.argv
    sys.argv = ["gadgetloader", *argv]
    try:
        runpy.run_module("gadgetloader", run_name="__main__", alter_sys=False)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved


@pytest.mark.parametrize(
    "src,dst,extra",
    [
        ("npy", "h5", ["--chunk-rows", "512", "--compression", "gzip"]),
        ("npy", "zarr", []),
        ("h5", "npy", []),
        ("zarr", "h5", []),
    ],
)
def test_convert_no_leak_no_temp(files, tmp_path, src, dst, extra, capsys):
    """`gadgetloader convert` (run as `python -m gadgetloader`, here in-process) writes
    its destination atomically and leaves no fds, threads or temporary files."""
    out = str(tmp_path / f"out.{dst}")

    def once():
        rc = _convert_inprocess(["convert", _path(files, src), out, "--no-progress", *extra])
        assert rc == 0, capsys.readouterr().err

    _repeat_clean(once, 3, f"convert {src}->{dst}", warmup=1)
    assert os.listdir(tmp_path) == [f"out.{dst}"]
    with gl.DataGadget(out, placement="cpu", progress=False) as h:
        assert np.array_equal(h.getNumpyVersion(), X)


def test_convert_bad_argument_makes_no_file(files, tmp_path, capsys):
    """README: a convert option the formats do not take ('--compression or --chunk-rows
    for a .npy destination') exits 2."""
    rc = _convert_inprocess(
        ["convert", _path(files, "h5"), str(tmp_path / "o.npy"), "--compression", "gzip"]
    )
    assert rc == 2
    assert os.listdir(tmp_path) == []
    assert "convert" in capsys.readouterr().err


@pytest.fixture
def big_source(tmp_path):
    a = np.lib.format.open_memmap(
        str(tmp_path / "src.npy"), mode="w+", dtype=np.float32, shape=(8192, 8192)
    )
    a[::5] = 1.0  # 256 MiB, mostly sparse
    a.flush()
    del a
    return tmp_path


def _convert_and_signal(d, dst, sig, pause):
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gadgetloader",
            "convert",
            str(d / "src.npy"),
            str(d / dst),
            "--no-progress",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = None
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < 60:
        part = [f for f in os.listdir(d) if f.startswith(f".{dst}.partial-")]
        if part:
            seen = part
            break
        time.sleep(0.002)
    if seen is None:
        p.kill()
        p.communicate()
        pytest.skip("convert finished before its partial file could be seen")
    time.sleep(pause)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return p, seen, out, err


@pytest.mark.parametrize("dst", ["out.h5", "out.zarr"])
def test_convert_interrupted_removes_partial(big_source, dst):
    """README: 'An interrupt while it writes removes the partial file and exits 130 saying
    the destination was not written.'"""
    d = big_source
    p, seen, out, err = _convert_and_signal(d, dst, signal.SIGINT, pause=0.1)
    listing = sorted(os.listdir(d))
    if p.returncode == 130 and "complete" in err:
        assert dst in listing  # it landed: the file is complete
    else:
        assert p.returncode == 130, (p.returncode, err[-500:])
        assert "not written" in err, err[-500:]
        assert dst not in listing
    assert [f for f in listing if f.startswith(".")] == [], listing


def test_convert_killed_leaves_named_partial_only(big_source):
    """README: 'A process killed part-way leaves a hidden `.NAME.partial-PID-XXXXXXXX`
    file or directory beside the target (the previous file stays whole)'."""
    d = big_source
    old = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.save(d / "old.npy", old)
    p, seen, out, err = _convert_and_signal(d, "old.npy", signal.SIGKILL, pause=0.02)
    assert p.returncode == -signal.SIGKILL
    left = [f for f in os.listdir(d) if f.startswith(".")]
    assert left and all(
        re.fullmatch(rf"\.old\.npy\.partial-{p.pid}-[0-9A-Za-z]{{8}}", f) for f in left
    ), left
    assert np.array_equal(np.load(d / "old.npy"), old)


# ---------------------------------------------------------------- misc


def test_fresh_process_fd_baseline_exact(tmp_path):
    """In a fresh process (CUDA hidden): after one warm-up per format, 30 more
    open/gather/close cycles of file tables and datasets, a save and a DataLoader with two
    workers leave exactly as many fds and threads as before."""
    code = textwrap.dedent(
        r"""
        import gc, json, os, sys, threading, warnings
        warnings.simplefilter("ignore")
        import numpy as np, torch, gadgetloader as gl, h5py, zarr
        from torch.utils.data import DataLoader
        d = sys.argv[1]
        x = np.arange(2048 * 8, dtype=np.float32).reshape(2048, 8)
        gl.DataGadget(x, placement="cpu").save(d + "/a.npy", progress=False)
        gl.DataGadget(x, placement="cpu").save(d + "/a.h5", progress=False)
        gl.DataGadget(x, placement="cpu").save(d + "/a.zarr", progress=False)
        def work():
            for f in ("a.npy", "a.h5", "a.zarr"):
                for pl in ("file", "cpu"):
                    g = gl.DataGadget(d + "/" + f, placement=pl, progress=False)
                    assert torch.equal(g.getData([3, 2047]), torch.from_numpy(x[[3, 2047]]))
                    g.save(d + "/copy." + f.split(".")[1], progress=False)
                    g.close()
                ds = gl.GadgetDataset(d + "/" + f, placement="file", device="cpu")
                n = sum(len(b[0]) for b in DataLoader(ds, batch_size=256, num_workers=2))
                assert n == 2048
                ds.close()
        POOLS = ("gadgetloader-io_", "gl-zarr_", "asyncio_", "zarr_io", "tqdm_monitor")
        def snap():
            # (the library's and zarr's thread pools grow on demand up to their size, one
            # thread per core: threads of those pools are not counted as leaks)
            gc.collect()
            pooled = sum(t.name.startswith(POOLS) for t in threading.enumerate())
            return [len(os.listdir("/proc/self/fd")), threading.active_count() - pooled,
                    len(os.listdir("/proc/self/task")) - pooled]
        work()
        a = snap()
        for _ in range(2):
            work()
        import time
        for _ in range(40):
            b = snap()
            if b[0] <= a[0] and b[1] <= a[1] and b[2] <= a[2]:
                break
            time.sleep(0.05)
        print(json.dumps({"before": a, "after": b, "listing": sorted(os.listdir(d))}))
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["after"][0] <= r["before"][0], r
    assert r["after"][1] <= r["before"][1], r
    assert r["after"][2] <= r["before"][2], r
    assert not [f for f in r["listing"] if f.startswith(".")], r["listing"]


# ---------------------------------------------------------------- RSS (subprocess)


@pytest.mark.parametrize("name", ["shape_cpu", "shape_cpupinn"])
def test_table_from_shape_costs_about_1x(probe, name):
    """README table: `pinned` is '1.0x the table's bytes'; a `cpu` table is ordinary host
    RAM. A 256 MB table from a shape should cost ~1x, never ~2x (SPEC: SpeedTorch's tables
    cost ~1.5x)."""
    r = probe[name]
    assert r["placement"] == "cpu" and r["ok"]
    n = r["nbytes"]
    assert r["rss"] <= 1.1 * n + 16 * MB, r
    if r["peak"] is not None:
        assert r["peak"] <= 1.1 * n + 16 * MB, (
            f"peak while building: {r['peak'] / MB:.0f} MB for {n / MB:.0f} MB"
        )


@pytest.mark.parametrize("fmt", FMTS)
def test_load_256mb_costs_1x_plus_staging(probe, fmt):
    """README: 'Loads stream chunk by chunk straight into the store (extra RAM = two
    staging blocks)'. Peak RSS of loading a 256 MB file into a cpu table stays near 1x."""
    r = probe["load_" + fmt]
    assert r["ok"], r
    n = r["nbytes"]
    # two 64 MiB staging blocks, plus a little for the file library's own buffers (on a
    # 16-core machine an HDF5 load measured 105 MB above the table)
    bound = n + 2 * 64 * MB + 16 * MB
    assert 0.9 * n <= r["rss"] <= bound, r
    if r["peak"] is not None:
        assert r["peak"] <= bound, f"peak {r['peak'] / MB:.0f} MB for a {n / MB:.0f} MB load"


@pytest.mark.parametrize(
    "name",
    ["cyc_shape_close", "cyc_shape_del", "cyc_array_with", "cyc_npy_close", "cyc_pinn_close"],
)
def test_rss_flat_across_create_close_cycles(probe, name):
    """close(): 'Free the table's memory now (idempotent). Also happens on garbage
    collection.' Repeating create/close of a 16 MB table must not grow RSS."""
    r = probe[name]
    assert r["ok"]
    assert r["growth"] < 64 * MB, f"{r['n']} cycles grew VmRSS by {r['growth'] / MB:.1f} MB"


@pytest.mark.parametrize("fmt", FMTS)
def test_rss_flat_across_save_load(probe, fmt):
    r = probe["saveload_" + fmt]
    assert r["ok"]
    assert r["growth"] < 64 * MB, f"save/load cycles grew VmRSS by {r['growth'] / MB:.1f} MB"
    assert not [f for f in r["listing"] if f.startswith(".")], r["listing"]


@pytest.mark.parametrize(
    "name", ["file_npy_None", "file_h5_None", "file_h5_False", "file_zarr_None"]
)
def test_file_placement_small_cache_bounded_rss(probe, name):
    """README: `placement='file'` keeps the rows in the file and reads through an LRU
    chunk cache (`cache_bytes=`); FileStore.cached_bytes is 'never above cache_bytes'.
    Reading all of a 512 MB file through a 16 MB cache keeps anonymous RSS far below it."""
    r = probe[name]
    assert r["ok"]
    assert r["worst_cached"] <= r["cache_bytes"], r
    assert r["worst_anon"] < r["file_bytes"] // 4, (
        f"anonymous RSS grew {r['worst_anon'] / MB:.0f} MB reading a {r['file_bytes'] / MB:.0f} MB file "
        f"through a {r['cache_bytes'] / MB:.0f} MB cache"
    )


@pytest.mark.parametrize("fmt", FMTS)
def test_save_failing_partway_over_old_file(probe, fmt):
    """README: 'A save to a .npy, HDF5 or zarr file that fails part-way (the disk filled, a
    file size limit) is a GadgetFileError naming the target ("cannot save PATH: cannot
    write rows A:B (...)"), and the partial file is removed'; the old file stays."""
    r = probe[f"fsize_fs_old_{fmt}"]
    assert r["err"] is not None, "save past RLIMIT_FSIZE did not fail"
    assert "GadgetFileError" in r["err"][1], r["err"]
    assert f"cannot save {r['path']}" in r["err"][2] and "cannot write rows" in r["err"][2], r[
        "err"
    ][2]
    assert r["after"] == r["before"], f"left behind: {sorted(set(r['after']) - set(r['before']))}"
    assert r["intact"] is True, r["intact"]


@pytest.mark.parametrize("fmt", FMTS)
def test_save_failing_partway_new_target(probe, fmt):
    r = probe[f"fsize_fs_new_{fmt}"]
    assert r["err"] is not None and "GadgetFileError" in r["err"][1], r["err"]
    assert "cannot write rows" in r["err"][2]
    assert r["after"] == r["before"], f"left behind: {sorted(set(r['after']) - set(r['before']))}"
