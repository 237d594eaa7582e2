"""Session 12 review: object lifecycle and resources across the public API.

Closed tables (every method, every placement and file format), ``with`` blocks that raise,
file handles after normal use and after refused opens / loads / dataset builds, copies and
pickles of tables, datasets and samplers, DataLoader workers (``fork`` and ``spawn``)
against the inline loader, sampler / loader states through ``torch.save`` with
``weights_only=True``, threads sharing tables and datasets, files deleted or moved under
open tables, and the drop-in module, optimizer and checkpoints around closed tables.

References are NumPy arrays indexed by the same ids, uninterrupted runs of the same
sampler, or a dense torch parameter trained by the same optimizer.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

CPU = torch.device("cpu")
FORMATS = ["npy", "h5", "zarr"]


# ---- helpers ----------------------------------------------------------------------------------
def _table(n: int = 300, d: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, d), dtype=np.float32)


def _write(a: np.ndarray, path: Path, ext: str, **kw: Any) -> str:
    """``a`` saved as ``path`` (an independent writer for .npy; the library's save for the
    chunked formats, small chunks so that caches and block reads matter)."""
    p = str(path)
    if ext == "npy":
        np.save(p, a)
    else:
        kw.setdefault("chunk_rows", 32)
        gl.DataGadget(a, placement="cpu").save(p, **kw)
    return p


def _fds_under(root: Path) -> list[str]:
    """Targets of this process's open file descriptors that lie under ``root``."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    prefix = os.path.realpath(root)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            out.append(target)
    return sorted(out)


def _maps_under(root: Path) -> list[str]:
    """Memory maps of files under ``root`` (a .npy table is read through one)."""
    prefix = os.path.realpath(root)
    with open("/proc/self/maps") as f:
        return [line for line in f if prefix in line]


def _rows(g: gl.DataGadget, ids: Any) -> np.ndarray:
    return g.getData(ids).cpu().numpy()


def _remove(p: str) -> None:
    if os.path.isdir(p):
        shutil.rmtree(p)
    else:
        os.remove(p)


def _batches(it: Any) -> list[list[torch.Tensor]]:
    return [[torch.as_tensor(t).cpu().clone() for t in b] for b in it]


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        len(p) == len(q) and all(torch.equal(x, y) for x, y in zip(p, q, strict=True))
        for p, q in zip(a, b, strict=True)
    )


def _zeros(g: gl.DataGadget) -> torch.Tensor:
    """One row of zeros of the table's dtype, on the device its rows are delivered to."""
    return torch.zeros((1, *g.shape[1:]), dtype=g.dtype, device=g.device)


def _roundtrip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


#: every call on a table that must refuse a closed one; each gets the gadget and a scratch dir
CLOSED_CALLS: list[tuple[str, Callable[[gl.DataGadget, Path], Any]]] = [
    ("getData", lambda g, d: g.getData([1, 2])),
    ("getData_check_ids_false", lambda g, d: g.getData(torch.tensor([1]), check_ids=False)),
    ("getitem", lambda g, d: g[[0, 3]]),
    ("getitem_int", lambda g, d: g[0]),
    ("insertData", lambda g, d: g.insertData(_zeros(g), [1])),
    ("setitem", lambda g, d: g.__setitem__([1], _zeros(g))),
    ("scatter", lambda g, d: g.scatter([1], _zeros(g))),
    ("as_tensor", lambda g, d: g.as_tensor()),
    ("getNumpyVersion", lambda g, d: g.getNumpyVersion()),
    ("getNumpyVersion_nocopy", lambda g, d: g.getNumpyVersion(copy=False)),
    ("numpy", lambda g, d: g.numpy()),
    ("save_npy", lambda g, d: g.save(str(d / "out.npy"))),
    ("save_h5", lambda g, d: g.save(str(d / "out.h5"))),
    ("save_zarr", lambda g, d: g.save(str(d / "out.zarr"))),
    ("saveCupy", lambda g, d: g.saveCupy(str(d / "out"))),
    ("zero_", lambda g, d: g.zero_()),
    ("fill_", lambda g, d: g.fill_(1.0)),
    ("uniform_", lambda g, d: g.uniform_(0.0, 1.0)),
    ("normal_", lambda g, d: g.normal_(0.0, 1.0)),
    ("init_", lambda g, d: g.init_(torch.nn.init.zeros_)),
    ("gadgetInit", lambda g, d: g.gadgetInit()),
    ("iteration", lambda g, d: list(g)),
    ("gather_many", lambda g, d: gl.gather_many([g], [1])),
    ("scatter_many", lambda g, d: gl.scatter_many([g], [_zeros(g)], [1])),
]


def _check_closed_everywhere(g: gl.DataGadget, scratch: Path) -> None:
    scratch.mkdir(exist_ok=True)
    for name, call in CLOSED_CALLS:
        with pytest.raises(gl.GadgetClosedError):
            call(g, scratch)
        # a refused save leaves nothing behind (no file, no partial)
        assert os.listdir(scratch) == [], name
    g.close()  # closing again is fine
    with g as same:  # and so is a with block on a closed table
        assert same is g
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])


# ---- use after close ----------------------------------------------------------------------------
def test_every_call_on_a_closed_memory_table_is_a_closed_error(placement, tmp_path):
    a = _table(10)
    g = gl.DataGadget(a, placement=placement)
    # the same calls work while it is open (iteration goes row by row)
    np.testing.assert_array_equal(torch.stack(list(g)).cpu().numpy(), a)
    np.testing.assert_array_equal(_rows(g, [7, 1]), a[[7, 1]])
    g.close()
    _check_closed_everywhere(g, tmp_path / "scratch")
    assert len(g) == 10 and g.shape == (10, 4)  # facts stay readable


@pytest.mark.parametrize("ext", FORMATS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_every_call_on_a_closed_file_table_is_a_closed_error(tmp_path, ext, placement):
    a = _table(10)
    path = _write(a, tmp_path / f"t.{ext}", ext)
    g = gl.DataGadget(path, placement=placement, device="cpu")
    np.testing.assert_array_equal(_rows(g, [9, 0]), a[[9, 0]])
    g.close()
    _check_closed_everywhere(g, tmp_path / "scratch")
    # and the file the table came from is unchanged by all those refused calls
    np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), a)


@pytest.mark.parametrize("ext", ["cpu", *FORMATS])
@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_a_copy_of_a_closed_table_is_closed_too(tmp_path, ext, how):
    a = _table(10)
    if ext == "cpu":
        g = gl.DataGadget(a, placement="cpu", device="cpu")
    else:
        g = gl.DataGadget(_write(a, tmp_path / f"t.{ext}", ext), placement="file", device="cpu")
    g.close()
    make = {
        "pickle": lambda o: pickle.loads(pickle.dumps(o)),
        "deepcopy": copy.deepcopy,
        "copy": copy.copy,
    }[how]
    c = make(g)
    with pytest.raises(gl.GadgetClosedError):
        c.getData([1])
    with pytest.raises(gl.GadgetClosedError):
        c.insertData(torch.zeros(1, 4), [1])


@pytest.mark.parametrize("ext", ["memory", *FORMATS])
def test_a_with_block_that_raises_closes_the_table_and_lets_the_error_through(
    tmp_path, ext, placement
):
    a = _table(50)
    if ext == "memory":
        src: Any = a
        where = placement
    else:
        if placement != "cpu":
            pytest.skip("file tables: one run is enough")
        src = _write(a, tmp_path / f"t.{ext}", ext)
        where = "file"

    class Boom(Exception):
        pass

    with pytest.raises(Boom), gl.DataGadget(src, placement=where) as g:
        np.testing.assert_array_equal(_rows(g, [3, 49]), a[[3, 49]])
        raise Boom
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    assert _fds_under(tmp_path) == []


# ---- file handles ------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", ["npy", "h5", "h5gz", "zarr"])
@pytest.mark.parametrize("end", ["close", "del", "with", "dataset_close", "dataset_del"])
def test_file_handles_and_maps_are_released(tmp_path, ext, end):
    a = _table(2000, 8)
    real = "h5" if ext == "h5gz" else ext
    path = _write(
        a, tmp_path / f"t.{real}", real, **({"compression": "gzip"} if ext == "h5gz" else {})
    )
    gc.collect()
    assert _fds_under(tmp_path) == []
    ids = np.array([1, 1500, 7])
    if end.startswith("dataset"):
        ds = gl.GadgetDataset(path, placement="file", device="cpu")
        np.testing.assert_array_equal(ds[ids][0].cpu().numpy(), a[ids])
        if end == "dataset_close":
            ds.close()
        else:
            del ds
    elif end == "with":
        with gl.DataGadget(path, placement="file", device="cpu") as g:
            np.testing.assert_array_equal(_rows(g, ids), a[ids])
            g.insertData(torch.from_numpy(a[[5]] + 1), [5])
    else:
        g = gl.DataGadget(path, placement="file", device="cpu")
        np.testing.assert_array_equal(_rows(g, ids), a[ids])
        g.insertData(torch.from_numpy(a[[5]] + 1), [5])
        if end == "close":
            g.close()
        else:
            del g
    gc.collect()
    assert _fds_under(tmp_path) == []
    assert _maps_under(tmp_path) == []
    if end in ("close", "del", "with"):  # the write made before the close reached the file
        expect = a.copy()
        expect[5] += 1
        np.testing.assert_array_equal(
            gl.DataGadget(path, placement="cpu").getNumpyVersion(), expect
        )


def _refused_opens(tmp_path: Path) -> list[tuple[str, str, dict[str, Any], type]]:
    a = _table(10)
    np.save(tmp_path / "a.npy", a)
    with h5py.File(tmp_path / "multi.h5", "w") as f:
        f["x"] = a
        f["y"] = a
        f["s"] = np.array([b"a", b"b"])
        f["z"] = np.zeros((0, 4), np.float32)
    gl.DataGadget(a, placement="cpu").save(str(tmp_path / "a.zarr"))
    np.save(tmp_path / "zero.npy", np.zeros((0, 4), np.float32))
    np.save(tmp_path / "obj.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    np.save(tmp_path / "u32.npy", np.arange(10, dtype=np.uint32))
    raw = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "trunc.npy").write_bytes(raw[: len(raw) - 40])
    (tmp_path / "junk.h5").write_bytes(b"not an hdf5 file" * 20)
    t = str(tmp_path)
    return [
        ("missing dataset", f"{t}/multi.h5", {"dataset": "nope"}, gl.GadgetKeyError),
        ("ambiguous dataset", f"{t}/multi.h5", {}, gl.GadgetKeyError),
        ("string dataset", f"{t}/multi.h5", {"dataset": "s"}, gl.GadgetTypeError),
        ("zero-row dataset", f"{t}/multi.h5", {"dataset": "z"}, gl.GadgetValueError),
        ("zarr missing array", f"{t}/a.zarr", {"dataset": "nope"}, gl.GadgetKeyError),
        ("zero-row npy", f"{t}/zero.npy", {}, gl.GadgetValueError),
        ("object npy", f"{t}/obj.npy", {}, gl.GadgetTypeError),
        ("uint32 npy", f"{t}/u32.npy", {}, gl.GadgetTypeError),
        ("truncated npy", f"{t}/trunc.npy", {}, gl.GadgetFileError),
        ("not hdf5", f"{t}/junk.h5", {}, gl.GadgetFileError),
        ("h5 bad option", f"{t}/multi.h5", {"dataset": "x", "bogus": 1}, gl.GadgetTypeError),
        ("npy bad writable", f"{t}/a.npy", {"writable": "yes"}, gl.GadgetTypeError),
        ("h5 bad cache", f"{t}/multi.h5", {"dataset": "x", "cache_bytes": -1}, gl.GadgetError),
        ("zarr bad writable", f"{t}/a.zarr", {"writable": 1}, gl.GadgetTypeError),
    ]


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_refused_opens_hold_no_file_open(tmp_path, placement):
    for name, path, kw, err in _refused_opens(tmp_path):
        with pytest.raises(err) as info:
            gl.DataGadget(path, placement=placement, device="cpu", **kw)
        # checked while the error (and its traceback) is still referenced
        assert _fds_under(tmp_path) == [], (name, str(info.value))
        assert _maps_under(tmp_path) == [], name


@pytest.mark.parametrize("ext", ["npy", "h5"])
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_a_refused_load_keeps_the_table_open_and_unchanged(tmp_path, ext, placement):
    a = _table(20)
    path = _write(a, tmp_path / f"t.{ext}", ext)
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    refused = [c for c in _refused_opens(bad_dir) if set(c[2]) <= {"dataset"}]
    g = gl.DataGadget(path, placement=placement, device="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), a)  # (opens the file of a file table)
    before = _fds_under(tmp_path)
    for name, p, kw, err in refused:
        with pytest.raises(err):
            g.load(p, **kw)
        assert _fds_under(tmp_path) == before, name
        np.testing.assert_array_equal(g.getNumpyVersion(), a, err_msg=name)
    with pytest.raises(gl.GadgetFileNotFoundError):
        g.load(str(tmp_path / "missing.npy"))
    g.insertData(torch.full((1, 4), 9.0), [2])  # still a working table of its file
    assert float(_rows(g, [2])[0, 0]) == 9.0
    g.close()
    gc.collect()
    assert _fds_under(tmp_path) == []


def test_a_refused_dataset_build_closes_the_columns_it_opened(tmp_path):
    a = _table(100, 3)
    paths = {ext: _write(a, tmp_path / f"x.{ext}", ext) for ext in FORMATS}
    gc.collect()
    for ext, p in paths.items():
        for second, err in [
            (np.zeros(5), gl.GadgetValueError),  # another row count
            (str(tmp_path / "missing.npy"), gl.GadgetFileNotFoundError),
            (object(), gl.GadgetTypeError),
        ]:
            with pytest.raises(err):
                gl.GadgetDataset(p, second, placement="file", device="cpu")
            assert _fds_under(tmp_path) == [], (ext, type(second).__name__)


def test_exiting_without_close_keeps_writes_and_prints_nothing(tmp_path):
    """Open file tables (one of them on a deleted file) left to interpreter exit: the
    writes are in the files and nothing is reported on stderr (ResourceWarnings are
    errors there)."""
    a = np.zeros((1000, 4), np.float32)
    for ext in FORMATS:
        _write(a, tmp_path / f"t.{ext}", ext)
        _write(a, tmp_path / f"gone.{ext}", ext)
    script = textwrap.dedent(
        f"""
        import os, shutil, torch, gadgetloader as gl
        d = {str(tmp_path)!r}
        keep = []
        for ext in ("npy", "h5", "zarr"):
            g = gl.DataGadget(f"{{d}}/t.{{ext}}", placement="file", device="cpu")
            g.insertData(torch.full((2, 4), 3.0), [5, 900])
            g.getData([1, 2])
            keep.append(g)
            h = gl.DataGadget(f"{{d}}/gone.{{ext}}", placement="file", device="cpu")
            h.insertData(torch.full((1, 4), 3.0), [5])
            keep.append(h)
            p = f"{{d}}/gone.{{ext}}"
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1])] + sys.path))
    r = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    for ext in FORMATS:
        got = gl.DataGadget(str(tmp_path / f"t.{ext}"), placement="cpu").getNumpyVersion()
        expect = a.copy()
        expect[[5, 900]] = 3.0
        np.testing.assert_array_equal(got, expect, err_msg=ext)


# ---- files deleted or moved under open tables ------------------------------------------------------
@pytest.mark.parametrize("ext", FORMATS)
@pytest.mark.parametrize("action", ["delete", "move", "move_and_replace"])
def test_tables_whose_files_went_away_fail_clearly_and_collect_quietly(
    tmp_path, ext, action, monkeypatch
):
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    a = _table(2000, 4)
    path = _write(a, tmp_path / f"t.{ext}", ext)
    g = gl.DataGadget(path, placement="file", device="cpu")
    c = copy.deepcopy(g)  # a second table of the same file (what a worker would hold)
    np.testing.assert_array_equal(_rows(g, [1, 1999]), a[[1, 1999]])
    g.insertData(torch.full((1, 4), 5.0), [2])  # reaches the file before it returns
    newer = a + 100
    if action == "delete":
        _remove(path)
    else:
        os.rename(path, path + ".moved")
        if action == "move_and_replace":
            _write(newer, Path(path), ext)
    match = "replaced" if action == "move_and_replace" else "gone"
    for t in (g, c):
        for call in (
            lambda t=t: t.getData([1]),
            lambda t=t: t.insertData(torch.zeros(1, 4), [3]),
            t.getNumpyVersion,
            lambda t=t: t.save(str(tmp_path / f"o.{ext}")),
        ):
            with pytest.raises(gl.GadgetFileError, match=match):
                call()
    assert not os.path.exists(tmp_path / f"o.{ext}")
    g.close()
    del g, c
    gc.collect()
    assert unraisable == []
    assert _fds_under(tmp_path) == []
    expect = a.copy()
    expect[2] = 5.0
    if action != "delete":  # the moved file holds the write made before the move, nothing after
        moved = gl.DataGadget(path + ".moved", placement="cpu").getNumpyVersion()
        np.testing.assert_array_equal(moved, expect)
    if action == "move_and_replace":  # the new file at the old name is untouched
        np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), newer)


# ---- datasets, loaders and closed or reloaded columns ----------------------------------------------
@pytest.mark.parametrize("ext", ["cpu", *FORMATS])
def test_datasets_and_loaders_follow_reloads_and_refuse_closed_columns(tmp_path, ext):
    a = _table(40, 3)
    b = -a
    other = _write(b, tmp_path / "other.npy", "npy")
    if ext == "cpu":
        g = gl.DataGadget(a, placement="cpu", device="cpu")
    else:
        g = gl.DataGadget(_write(a, tmp_path / f"t.{ext}", ext), placement="file", device="cpu")
    ds = gl.GadgetDataset(g, np.arange(40), placement="cpu", device="cpu")
    ids = np.array([3, 0, 39, 3])
    np.testing.assert_array_equal(ds[ids][0].cpu().numpy(), a[ids])  # plan made
    g.load(other)  # same rows, new values: no stale plan
    np.testing.assert_array_equal(ds[ids][0].cpu().numpy(), b[ids])
    loader = gl.GadgetLoader(ds, batch_size=8, order="sequential", prefetch=0)
    it = iter(loader)
    first = next(it)
    np.testing.assert_array_equal(first[0].cpu().numpy(), b[:8])
    g.insertData(torch.full((8, 3), 7.0), np.arange(8, 16))  # a loop writing what it reads
    second = next(it)
    np.testing.assert_array_equal(second[0].cpu().numpy(), np.full((8, 3), 7.0, np.float32))
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        next(it)
    with pytest.raises(gl.GadgetClosedError):
        ds[ids]
    with pytest.raises(gl.GadgetClosedError):
        next(iter(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4))))
    assert len(ds) == 40


def test_a_dataset_closes_only_the_tables_it_created(tmp_path):
    a = _table(30, 3)
    mine = gl.DataGadget(a, placement="cpu", device="cpu")
    path = _write(a, tmp_path / "t.h5", "h5")

    class Boom(Exception):
        pass

    with (
        pytest.raises(Boom),
        gl.GadgetDataset(mine, path, np.arange(30), placement="file", device="cpu") as ds,
    ):
        np.testing.assert_array_equal(ds[[4]][1].cpu().numpy(), a[[4]])
        raise Boom
    np.testing.assert_array_equal(_rows(mine, [4, 29]), a[[4, 29]])  # passed in: still open
    for col in ds.columns[1:]:  # opened by the dataset: closed
        with pytest.raises(gl.GadgetClosedError):
            col.getData([0])
    gc.collect()
    assert _fds_under(tmp_path) == []
    ds.close()  # again: fine


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_dataset_are_independent_where_documented(tmp_path, how):
    a = _table(60, 3)
    path = _write(a, tmp_path / "t.h5", "h5", compression="gzip")
    ds = gl.GadgetDataset(a, np.arange(60), placement="cpu", device="cpu")
    fds = gl.GadgetDataset(path, placement="file", device="cpu")
    fds[[5]]  # cached block
    make = copy.deepcopy if how == "deepcopy" else (lambda o: pickle.loads(pickle.dumps(o)))
    c, fc = make(ds), make(fds)
    # cpu columns are copied by value: writes and closes on one side stay there
    ds.columns[0].insertData(torch.zeros(1, 3), [5])
    np.testing.assert_array_equal(c[[5]][0].cpu().numpy(), a[[5]])
    c.close()
    np.testing.assert_array_equal(ds[[5, 6]][0].cpu().numpy(), np.stack([np.zeros(3), a[6]]))
    # file columns are the same file: a write through one is read through the other
    fc[[5]]
    fds.columns[0].insertData(torch.full((1, 3), 4.0), [5])
    np.testing.assert_array_equal(fc[[5]][0].cpu().numpy(), np.full((1, 3), 4.0, np.float32))
    fc.close()  # closing the copy leaves the original open
    np.testing.assert_array_equal(fds[[5, 7]][0].cpu().numpy()[1], a[7])
    fds.close()
    gc.collect()
    assert _fds_under(tmp_path) == []


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("ext", FORMATS)
def test_a_copied_file_table_keeps_its_options_and_shares_writes(tmp_path, how, ext):
    a = np.zeros((500, 4), np.float32)
    path = _write(a, tmp_path / f"t.{ext}", ext)
    make = copy.deepcopy if how == "deepcopy" else (lambda o: pickle.loads(pickle.dumps(o)))
    g = gl.DataGadget(path, placement="file", device="cpu")
    g.getData([5])
    c = make(g)
    c.getData([5, 6])  # both caches hold the block
    g.insertData(torch.full((1, 4), 1.0), [5])
    assert float(_rows(c, [5])[0, 0]) == 1.0
    c.insertData(torch.full((1, 4), 2.0), [6])
    assert float(_rows(g, [6])[0, 0]) == 2.0
    c.close()
    np.testing.assert_array_equal(_rows(g, [5, 6])[:, 0], [1.0, 2.0])
    ro = make(gl.DataGadget(path, placement="file", device="cpu", writable=False))
    with pytest.raises(gl.ReadOnlyError):
        ro.insertData(torch.zeros(1, 4), [1])
    assert float(_rows(ro, [6])[0, 0]) == 2.0


# ---- DataLoader workers ------------------------------------------------------------------------
def _worker_dataset(tmp_path: Path) -> tuple[gl.GadgetDataset, np.ndarray]:
    x = _table(600, 4, seed=3)
    cols = [gl.DataGadget(_write(x, tmp_path / "x.npy", "npy"), placement="file", device="cpu")]
    cols.append(
        gl.DataGadget(
            _write(x, tmp_path / "x.h5", "h5", compression="gzip"), placement="file", device="cpu"
        )
    )
    cols.append(
        gl.DataGadget(_write(x, tmp_path / "x.zarr", "zarr"), placement="file", device="cpu")
    )
    cols.append(gl.DataGadget(x, placement="cpu", device="cpu"))
    # rows written after opening (an HDF5 table then holds a handle open for writing)
    ids = np.arange(100, 140)
    vals = np.full((ids.size, 4), -1.0, np.float32)
    for g in cols:
        g.insertData(torch.from_numpy(vals), ids)
    ref = x.copy()
    ref[ids] = vals
    ds = gl.GadgetDataset(*cols, np.arange(600), placement="cpu", device="cpu")
    return ds, ref


def _check_rows(batches: list[list[torch.Tensor]], ref: np.ndarray) -> None:
    seen = np.concatenate([b[-1].numpy() for b in batches])
    assert sorted(seen.tolist()) == list(range(len(ref)))
    for b in batches:
        for col in b[:-1]:
            np.testing.assert_array_equal(col.numpy(), ref[b[-1].numpy()])


def test_fork_workers_give_the_inline_batches(tmp_path):
    ds, ref = _worker_dataset(tmp_path)

    def sampler_form(workers: int) -> list[list[torch.Tensor]]:
        s = gl.GadgetSampler(ds, batch_size=64, seed=5)
        kw = {"multiprocessing_context": "fork"} if workers else {}
        return _batches(DataLoader(ds, batch_sampler=s, num_workers=workers, **kw))

    def default_form(workers: int) -> list[list[torch.Tensor]]:
        gen = torch.Generator(device="cpu").manual_seed(11)
        kw = {"multiprocessing_context": "fork"} if workers else {}
        return _batches(
            DataLoader(ds, batch_size=64, shuffle=True, generator=gen, num_workers=workers, **kw)
        )

    for form in (sampler_form, default_form):
        inline = form(0)
        _check_rows(inline, ref)
        assert _same(form(2), inline), form.__name__


def test_spawn_workers_give_the_inline_batches(tmp_path):
    ds, ref = _worker_dataset(tmp_path)
    s = gl.GadgetSampler(ds, batch_size=100, seed=2)
    inline = _batches(DataLoader(ds, batch_sampler=s))
    _check_rows(inline, ref)
    s.set_epoch(0)
    spawned = _batches(
        DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="spawn")
    )
    assert _same(spawned, inline)


def test_loader_with_workers_resumes_through_a_weights_only_state(tmp_path):
    ds, ref = _worker_dataset(tmp_path)
    full = _batches(gl.GadgetLoader(ds, batch_size=64, seed=7))
    _check_rows(full, ref)
    loader = gl.GadgetLoader(
        ds, batch_size=64, seed=7, num_workers=2, multiprocessing_context="fork"
    )
    it = iter(loader)
    got = [[t.cpu().clone() for t in next(it)] for _ in range(4)]  # workers draw further ahead
    state = _roundtrip(loader.state_dict())
    del it
    resumed = gl.GadgetLoader(ds, batch_size=64, seed=0)  # the state brings its seed
    resumed.load_state_dict(state)
    got += _batches(resumed)
    assert _same(got, full)


# ---- sampler and loader states -----------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"order": "random", "seed": np.int64(3)},
        {"order": "sequential", "drop_last": np.bool_(True)},
        {
            "order": "chunk",
            "chunk_rows": np.int32(10),
            "window_chunks": np.int16(2),
            "seed": 2**64 - 1,
        },
        {"order": "random", "num_replicas": np.int64(3), "rank": np.int32(2), "pad": True},
    ],
    ids=["random", "sequential", "chunk", "ranks"],
)
def test_sampler_states_survive_weights_only_loads_and_copies(kw):
    n = 103

    def build(**extra: Any) -> gl.GadgetSampler:
        base = {k: v for k, v in kw.items() if k != "seed"}
        base.update(extra)
        return gl.GadgetSampler(n, batch_size=np.int64(7), **base)

    ref = build(seed=kw.get("seed", 0))
    ref.set_epoch(2)
    full = [b.clone() for b in ref]
    s = build(seed=kw.get("seed", 0))
    s.set_epoch(2)
    it = iter(s)
    head = [next(it).clone() for _ in range(3)]
    state = s.state_dict()
    loaded = _roundtrip(state)
    assert loaded == state
    assert all(type(v) in (int, str, bool, type(None)) for v in state.values())
    for make in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        assert make(s).state_dict() == state
    fresh = build(seed=12345)  # the state's seed wins
    fresh.load_state_dict(loaded)
    tail = [b.clone() for b in fresh]
    assert len(head) + len(tail) == len(full)
    assert all(torch.equal(x, y) for x, y in zip(head + tail, full, strict=True))
    rest = [b.clone() for b in it]  # the original goes on unaffected
    assert len(head) + len(rest) == len(full)
    assert all(torch.equal(x, y) for x, y in zip(head + rest, full, strict=True))


def test_loader_state_round_trips_and_the_next_epoch_follows():
    x = _table(100, 3)
    ds = gl.GadgetDataset(x, np.arange(100), placement="cpu", device="cpu")
    ref = gl.GadgetLoader(ds, batch_size=8, seed=4)
    epoch0, epoch1 = _batches(ref), _batches(ref)
    loader = gl.GadgetLoader(ds, batch_size=8, seed=4)
    it = iter(loader)
    got = [[t.clone() for t in next(it)] for _ in range(5)]
    state = _roundtrip(loader.state_dict())
    again = gl.GadgetLoader(copy.deepcopy(ds), batch_size=8, seed=99)
    again.load_state_dict(state)
    assert _same(got + _batches(again), epoch0)
    assert _same(_batches(again), epoch1)
    for b in epoch0:
        np.testing.assert_array_equal(b[0].numpy(), x[b[1].numpy()])


# ---- threads ------------------------------------------------------------------------------------
def test_two_threads_on_one_cpu_table_match_a_numpy_reference():
    n, d = 20000, 16
    base = _table(n, d)
    g = gl.DataGadget(base, placement="cpu", device="cpu")
    m = gl.DataGadget(np.zeros((n, d), np.float32), placement="cpu", device="cpu")
    ref, refm = base.copy(), np.zeros((n, d), np.float32)
    errors: list[str] = []

    def worker(k: int) -> None:
        r = np.random.default_rng(k)
        mine = np.arange(k, n, 2)  # each thread writes its own rows
        try:
            for step in range(150):
                ids = r.choice(mine, 400)  # with repeats: the last occurrence wins
                vals = r.random((400, d), dtype=np.float32)
                g.insertData(torch.from_numpy(vals), torch.from_numpy(ids))
                ref[ids] = vals
                gl.scatter_many([g, m], [torch.from_numpy(vals), torch.from_numpy(2 * vals)], ids)
                refm[ids] = 2 * vals
                q = r.choice(mine, 300)
                if not np.array_equal(_rows(g, q), ref[q]):
                    errors.append(f"getData {k} {step}")
                rows, mrows = gl.gather_many([g, m], torch.from_numpy(q))
                if not (
                    np.array_equal(rows.cpu().numpy(), ref[q])
                    and np.array_equal(mrows.cpu().numpy(), refm[q])
                ):
                    errors.append(f"gather_many {k} {step}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    np.testing.assert_array_equal(m.getNumpyVersion(), refm)


@pytest.mark.parametrize("ext", ["cpu", "npy", "h5gz", "zarr"])
def test_closing_a_table_other_threads_read_gives_rows_or_a_closed_error(tmp_path, ext):
    n = 20000
    base = _table(n, 16)
    if ext == "cpu":
        g = gl.DataGadget(base, placement="cpu", device="cpu")
    else:
        real = "h5" if ext == "h5gz" else ext
        kw = {"compression": "gzip"} if ext == "h5gz" else {}
        if real != "npy":
            kw["chunk_rows"] = 64
        path = _write(base, tmp_path / f"t.{real}", real, **kw)
        g = gl.DataGadget(path, placement="file", device="cpu", cache_bytes=1 << 16)
    outcome: list[str] = []
    started = threading.Barrier(4)

    def reader(k: int) -> None:
        r = np.random.default_rng(k)
        started.wait()
        for _ in range(100000):
            ids = r.integers(0, n, 300)
            try:
                got = _rows(g, ids)
            except gl.GadgetClosedError:
                outcome.append("closed")
                return
            except Exception as exc:
                outcome.append(repr(exc))
                return
            if not np.array_equal(got, base[ids]):
                outcome.append("wrong rows")
                return
        outcome.append("never closed")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)
    g.close()
    for t in threads:
        t.join(timeout=60)
    assert outcome == ["closed"] * 3
    gc.collect()
    assert _fds_under(tmp_path) == []


def test_threads_iterating_their_own_loaders_over_one_dataset(tmp_path):
    x = _table(2000, 8)
    h5 = _write(x, tmp_path / "x.h5", "h5", chunk_rows=64, compression="gzip")
    zr = _write(x, tmp_path / "x.zarr", "zarr", chunk_rows=64)
    ds = gl.GadgetDataset(
        gl.DataGadget(h5, placement="file", device="cpu", cache_bytes=1 << 15),
        gl.DataGadget(zr, placement="file", device="cpu", cache_bytes=1 << 15),
        np.arange(2000),
        placement="cpu",
        device="cpu",
    )
    refs = {s: _batches(gl.GadgetLoader(ds, batch_size=100, seed=s)) for s in range(3)}
    for b in refs[0]:
        for col in b[:2]:
            np.testing.assert_array_equal(col.numpy(), x[b[2].numpy()])
    bad: list[int] = []

    def run(s: int) -> None:
        for _ in range(2):
            if not _same(_batches(gl.GadgetLoader(ds, batch_size=100, seed=s)), refs[s]):
                bad.append(s)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


# ---- drop-in module, optimizer and checkpoints ---------------------------------------------------
def _emb(seed: int, n: int = 30) -> gl.OffloadedEmbedding:
    torch.manual_seed(seed)
    return gl.OffloadedEmbedding(n, 4, placement="cpu", device="cpu")


def test_a_closed_embedding_table_refuses_lookups():
    emb = _emb(0)
    emb.weight.close()
    with pytest.raises(gl.GadgetClosedError):
        emb(torch.tensor([1, 2]))
    with torch.no_grad(), pytest.raises(gl.GadgetClosedError):
        emb(torch.tensor([1, 2]))
    emb2 = _emb(1)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.1)
    emb2(torch.tensor([3])).sum().backward()
    opt.step()
    emb2.weight.close()
    with pytest.raises(gl.GadgetClosedError):
        emb2(torch.tensor([3]))


def test_a_table_outlives_its_optimizer_and_trains_with_fresh_state():
    emb = _emb(2)
    ids = torch.tensor([1, 2, 2, 5])
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(ids).pow(2).sum().backward()
    opt.step()
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)  # still taken
    w1 = emb.weight.getNumpyVersion().copy()
    del opt
    gc.collect()
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), w1)
    copied = copy.deepcopy(emb)  # an ordinary table with its own rows, no optimizer
    emb(ids).pow(2).sum().backward()
    opt2.step()
    # reference: the touched rows as a dense parameter with a fresh Adam
    u = torch.unique(ids)
    p = torch.nn.Parameter(torch.from_numpy(w1[u.numpy()].copy()))
    ref_opt = torch.optim.Adam([p], lr=0.1)
    torch.nn.functional.embedding(torch.searchsorted(u, ids), p).pow(2).sum().backward()
    ref_opt.step()
    expect = w1.copy()
    expect[u.numpy()] = p.detach().numpy()
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), expect, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(copied.weight.getNumpyVersion(), w1)
    opt3 = gl.OffloadedOptimizer(torch.optim.SGD, copied, lr=1.0)  # the copy takes its own
    copied(torch.tensor([0])).sum().backward()
    opt3.step()
    expect_copy = w1.copy()
    expect_copy[0] -= 1.0
    np.testing.assert_allclose(copied.weight.getNumpyVersion(), expect_copy, rtol=0, atol=1e-6)


def _trained_pair() -> tuple[torch.nn.ModuleDict, gl.OffloadedOptimizer]:
    torch.manual_seed(0)
    m = torch.nn.ModuleDict(
        {
            "a": gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu"),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    (m["a"](torch.tensor([1, 4])).sum() + m["b"](torch.tensor([2])).sum()).backward()
    opt.step()
    return m, opt


def _fresh_pair(seed: int) -> tuple[torch.nn.ModuleDict, gl.OffloadedOptimizer]:
    torch.manual_seed(seed)
    m = torch.nn.ModuleDict(
        {
            "a": gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu"),
        }
    )
    return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)


def test_a_save_with_a_closed_table_keeps_the_previous_checkpoint(tmp_path):
    m, opt = _trained_pair()
    d = tmp_path / "ckpt"
    gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    files = sorted(os.listdir(d))
    wa = m["a"].weight.getNumpyVersion().copy()
    wb = m["b"].weight.getNumpyVersion().copy()
    m["b"].weight.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    assert sorted(os.listdir(d)) == files
    m2, opt2 = _fresh_pair(5)
    gl.load_checkpoint(d, {"model": m2, "optimizer": opt2})
    np.testing.assert_array_equal(m2["a"].weight.getNumpyVersion(), wa)
    np.testing.assert_array_equal(m2["b"].weight.getNumpyVersion(), wb)


# DEFECT: load_checkpoint promises to check every object before changing any ("a checkpoint
# that does not fit leaves every object as it was"), but a closed table is only found when
# its rows are loaded: the objects (and tables) before it already hold the checkpoint's state.
def test_load_checkpoint_into_a_closed_table_changes_nothing(tmp_path):
    m, opt = _trained_pair()
    d = tmp_path / "ckpt"
    gl.save_checkpoint(d, {"first": m["a"], "second": m["b"]})
    first = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu")
    second = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu")
    before = first.weight.getNumpyVersion().copy()
    assert not np.array_equal(before, m["a"].weight.getNumpyVersion())
    second.weight.close()
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(d, {"first": first, "second": second})
    np.testing.assert_array_equal(first.weight.getNumpyVersion(), before)


# DEFECT: the same for OffloadedOptimizer.load_state_dict ("check every object against the ...
# state dict ... before changing any, so one that does not fit leaves everything as it was"):
# with one of its state tables closed, the other table's state and the step counts change
# before the closed table raises.
def test_optimizer_load_state_dict_with_a_closed_state_table_changes_nothing():
    m, opt = _trained_pair()
    sd = opt.state_dict()
    m2, opt2 = _fresh_pair(3)
    before = [
        {k: t.getNumpyVersion().copy() for k, t in pager.tables.items()} for pager in opt2.pagers
    ]
    inner_before = copy.deepcopy(opt2.inner.state_dict()["state"])
    opt2.pagers[1].tables["exp_avg"].close()
    with pytest.raises(gl.GadgetError):
        opt2.load_state_dict(sd)
    for k, t in opt2.pagers[0].tables.items():
        np.testing.assert_array_equal(t.getNumpyVersion(), before[0][k], err_msg=k)
    assert opt2.inner.state_dict()["state"].keys() == inner_before.keys()


@pytest.mark.parametrize("kind", ["closed_cpu", "closed_file", "read_only_file"])
def test_scatter_many_with_an_unwritable_table_writes_nothing(tmp_path, kind):
    path = _write(np.zeros((10, 3), np.float32), tmp_path / "f.npy", "npy")
    a = gl.DataGadget(np.zeros((10, 3), np.float32), placement="cpu", device="cpu")
    if kind == "closed_cpu":
        b = gl.DataGadget(np.zeros((10, 3), np.float32), placement="cpu", device="cpu")
    else:
        b = gl.DataGadget(path, placement="file", device="cpu", writable=kind != "read_only_file")
    err = gl.ReadOnlyError if kind == "read_only_file" else gl.GadgetClosedError
    if kind != "read_only_file":
        b.close()
    for tables in ([a, b], [b, a]):
        with pytest.raises(err):
            gl.scatter_many(tables, [torch.ones(2, 3), torch.ones(2, 3)], [1, 2])
        np.testing.assert_array_equal(a.getNumpyVersion(), np.zeros((10, 3), np.float32))
    np.testing.assert_array_equal(np.load(path), np.zeros((10, 3), np.float32))


# DEFECT: step() over two tables, one of them closed since the backward, raises
# GadgetClosedError only after the open table's rows and optimizer state were written (and
# torch's step counts moved): a half-applied step. "Refused calls change nothing", and a
# step that finds a bad id reports it "before anything is written: the table, its optimizer
# state and step counts stay unchanged"; scatter_many already checks every table first.
def test_a_step_that_finds_a_closed_table_writes_nothing():
    m, opt = _trained_pair()
    (m["a"](torch.tensor([1, 3])).sum() + m["b"](torch.tensor([2])).sum()).backward()
    wa = m["a"].weight.getNumpyVersion().copy()
    sa = {k: t.getNumpyVersion().copy() for k, t in opt.pagers[0].tables.items()}
    steps = {p: float(s["step"]) for p, s in opt.inner.state_dict()["state"].items()}
    m["b"].weight.close()
    with pytest.raises(gl.GadgetClosedError):
        opt.step()
    np.testing.assert_array_equal(m["a"].weight.getNumpyVersion(), wa)
    for k, t in opt.pagers[0].tables.items():
        np.testing.assert_array_equal(t.getNumpyVersion(), sa[k], err_msg=k)
    assert {p: float(s["step"]) for p, s in opt.inner.state_dict()["state"].items()} == steps
