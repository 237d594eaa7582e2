"""Files, continued: worker processes, interrupted saves, bad files, convert, properties, the bench."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gadgetloader as gl
from gadgetloader import convert as conv
from gadgetloader.io._chunks import ChunkAligner
from gadgetloader.io._hdf5 import Hdf5Sink
from gadgetloader.io._npy import NpySink
from gadgetloader.io._zarr import ZarrSink

FORMATS = {"npy": ".npy", "hdf5": ".h5", "zarr": ".zarr"}
ROWS, WIDTH = 300, 5


def table(rows: int = ROWS, width: int = WIDTH, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def write(data: np.ndarray, path: Path, **options: object) -> Path:
    if path.suffix != ".npy":
        options.setdefault("chunk_rows", 32)
    with gl.DataGadget(data, placement="cpu") as g:
        g.save(path, progress=False, **options)
    return path


def on_disk(path: Path) -> np.ndarray:
    with gl.DataGadget(path, placement="cpu") as g:
        return g.getNumpyVersion()


# ---- DataLoader worker processes ----------------------------------------------------------------------------
class RowsDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Item ``i``: row ``i`` of each file-backed gadget and the worker's pid."""

    def __init__(self, gadgets: list[gl.DataGadget]) -> None:
        self.gadgets = gadgets

    def __len__(self) -> int:
        return len(self.gadgets[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        rows = [g.getData([i], device="cpu")[0] for g in self.gadgets]
        return (*rows, torch.tensor(os.getpid()))


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_dataloader_workers_read_file_backed_gadgets(tmp_path: Path, context: str) -> None:
    data = table()
    gadgets = [
        gl.DataGadget(write(data, tmp_path / f"t{ext}"), placement="file")
        for ext in FORMATS.values()
    ]
    for g in gadgets:
        g.getData([0, 299])  # handles open (and a block cached) in the parent before the fork
    loader = torch.utils.data.DataLoader(
        RowsDataset(gadgets),
        batch_size=16,
        shuffle=True,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context(context),
        generator=torch.Generator().manual_seed(0),
    )
    seen = np.zeros(ROWS, dtype=bool)
    pids: set[int] = set()
    got: dict[int, list[np.ndarray]] = {}
    for *rows, pid in loader:
        pids.update(pid.tolist())
        for k, r in enumerate(rows):
            got.setdefault(k, []).append(r.numpy())
    order = np.arange(ROWS)
    # every format gave the same rows in the same (shuffled) order, each row once
    for k in range(len(gadgets)):
        batch = np.concatenate(got[k])
        idx = np.array([int(np.flatnonzero((data == row).all(axis=1))[0]) for row in batch])
        seen[idx] = True
        assert sorted(idx.tolist()) == order.tolist()
        assert np.array_equal(batch, data[idx])
    assert seen.all()
    assert os.getpid() not in pids and len(pids) == 2
    for g in gadgets:  # the parent's copies still work after the workers are gone
        assert np.array_equal(g.getData([5]).cpu().numpy(), data[[5]])
        g.close()


def test_fork_child_reopens_hdf5(tmp_path: Path) -> None:
    data = table()
    path = write(data, tmp_path / "t.h5")
    g = gl.DataGadget(path, placement="file", cache_bytes=0)
    g.getData([1])
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child() -> None:
        q.put(g.getData([7, 250]).cpu().numpy())

    p = ctx.Process(target=child)
    p.start()
    rows = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert np.array_equal(rows, data[[7, 250]])
    assert np.array_equal(g.getData([9]).cpu().numpy(), data[[9]])
    g.close()


# ---- interrupted saves --------------------------------------------------------------------------------------------
_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import gadgetloader as gl
    from gadgetloader.io import _stream
    from gadgetloader.io._hdf5 import Hdf5Sink
    from gadgetloader.io._npy import NpySink
    from gadgetloader.io._zarr import ZarrSink

    _stream.STAGING_BYTES = 1 << 20  # many small blocks
    for cls in (NpySink, Hdf5Sink, ZarrSink):
        def slow(self, start, rows, _orig=cls.write):
            _orig(self, start, rows)
            time.sleep(0.02)
        cls.write = slow
    # 25.6 MB of random floats (incompressible): about 25 blocks, 0.5 s or more
    data = np.random.default_rng(0).standard_normal((400_000, 16), dtype=np.float32)
    g = gl.DataGadget(data, placement="cpu")
    print("saving", flush=True)
    g.save(sys.argv[1], progress=False, chunk_rows=4096) if not sys.argv[1].endswith(".npy") else g.save(sys.argv[1], progress=False)
    print("done", flush=True)
    """
)


def _partial_bytes(directory: Path, name: str) -> int:
    """Bytes written so far into ``.name.partial-*`` files or directories beside the target."""
    total = 0
    for p in directory.iterdir():
        if p.name.startswith(f".{name}.partial-"):
            for f in [p] if p.is_file() else p.rglob("*"):
                with contextlib.suppress(FileNotFoundError):  # renamed while we looked
                    total += f.stat().st_size if f.is_file() else 0
    return total


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kill_during_save_keeps_the_previous_file(tmp_path: Path, fmt: str) -> None:
    old = table(seed=3)
    target = write(old, tmp_path / f"t{FORMATS[fmt]}")
    script = tmp_path / "save.py"
    script.write_text(_KILL_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(target)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the new file is part-way written
            if _partial_bytes(tmp_path, target.name) > 2 << 20:
                break
            time.sleep(0.01)
        else:  # pragma: no cover
            pytest.fail("the save never got going")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:  # pragma: no cover
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert np.array_equal(on_disk(target), old)  # the previous file, intact
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in (target.name, "save.py")]
    assert leftovers and all(n.startswith(f".{target.name}.partial-") for n in leftovers)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_exception_during_save_keeps_the_previous_file(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = table(seed=4)
    target = write(old, tmp_path / f"t{FORMATS[fmt]}")
    sink = {"npy": NpySink, "hdf5": Hdf5Sink, "zarr": ZarrSink}[fmt]
    calls = []
    original = sink.write

    def failing(self: object, start: int, rows: np.ndarray) -> None:
        calls.append(start)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        original(self, start, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(sink, "write", failing)
    monkeypatch.setattr("gadgetloader.io._stream.STAGING_BYTES", 1024)
    with (
        gl.DataGadget(table(seed=5, rows=2000), placement="cpu") as g,
        pytest.raises(RuntimeError, match="disk on fire"),
    ):
        g.save(target, progress=False)
    assert len(calls) == 3
    monkeypatch.undo()
    assert np.array_equal(on_disk(target), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # the partial file is gone


# ---- bad files -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr"])
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_missing_path(tmp_path: Path, ext: str, placement: str) -> None:
    path = tmp_path / f"nothing{ext}"
    with pytest.raises(gl.GadgetFileNotFoundError, match=str(path)):
        gl.DataGadget(path, placement=placement)


def test_truncated_npy(tmp_path: Path) -> None:
    path = write(table(), tmp_path / "t.npy")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError, match=rf"{path}.*truncated"):
            gl.DataGadget(path, placement=placement)


def test_truncated_and_garbage_hdf5(tmp_path: Path) -> None:
    path = tmp_path / "t.h5"
    path.write_bytes(b"not an hdf5 file at all" * 10)
    with pytest.raises(gl.GadgetFileError, match=rf"{path}.*not an HDF5 file"):
        gl.DataGadget(path, placement="cpu")
    good = write(table(), tmp_path / "g.h5")
    cut = tmp_path / "cut.h5"
    cut.write_bytes(good.read_bytes()[:3000])
    with pytest.raises(gl.GadgetFileError, match=str(cut)):
        gl.DataGadget(cut, placement="cpu")


def test_directory_that_is_not_zarr(tmp_path: Path) -> None:
    d = tmp_path / "empty.zarr"
    d.mkdir()
    (d / "README").write_text("hello")
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError, match=rf"{d} is not a zarr array or group"):
            gl.DataGadget(d, placement=placement)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(gl.GadgetValueError, match="cannot tell the format"):
        gl.DataGadget(plain, placement="cpu")
    with pytest.raises(gl.GadgetFileError, match="not a zarr"):
        gl.DataGadget(plain, placement="cpu", format="zarr")


def test_wrong_dataset_lists_what_is_there(tmp_path: Path) -> None:
    h5 = tmp_path / "t.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("emb/words", data=table())
        f.create_dataset("emb/pages", data=table())
        f.create_dataset("labels", data=np.arange(5))
    with pytest.raises(
        gl.GadgetKeyError, match=r"no dataset 'emb/word'.*\['emb/pages', 'emb/words', 'labels'\]"
    ) as e:
        gl.DataGadget(h5, placement="cpu", dataset="emb/word")
    assert str(h5) in str(e.value)
    with pytest.raises(gl.GadgetKeyError, match=r"3 datasets.*pass dataset="):
        gl.DataGadget(h5, placement="cpu")
    with pytest.raises(gl.GadgetKeyError, match="no dataset 'emb'"):  # a group is not a dataset
        gl.DataGadget(h5, placement="file", dataset="emb")
    with gl.DataGadget(h5, placement="file", dataset="/labels") as g:
        assert g.getData([4]).tolist() == [4]
    grp = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    grp.create_array("a/x", shape=(4, 2), dtype="f4")
    grp.create_array("b", shape=(4,), dtype="i8")
    with pytest.raises(gl.GadgetKeyError, match=r"no zarr array 'c'.*\['a/x', 'b'\]"):
        gl.DataGadget(tmp_path / "g.zarr", placement="cpu", dataset="c")
    with pytest.raises(gl.GadgetKeyError, match="2 arrays"):
        gl.DataGadget(tmp_path / "g.zarr", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="holds one array"):
        gl.DataGadget(write(table(), tmp_path / "t.npy"), placement="cpu", dataset="x")


def test_object_and_string_dtypes(tmp_path: Path) -> None:
    npy = tmp_path / "o.npy"
    np.save(npy, np.array([[1, "a"]], dtype=object), allow_pickle=True)
    with pytest.raises(gl.GadgetTypeError, match=rf"{npy}.*object"):
        gl.DataGadget(npy, placement="cpu")
    s = tmp_path / "s.npy"
    np.save(s, np.array(["ab", "cd"]))
    with pytest.raises(gl.GadgetTypeError, match=str(s)):
        gl.DataGadget(s, placement="file")
    h5 = tmp_path / "s.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("s", data=np.array([b"ab", b"cd"]))
        f.create_dataset("c", data=np.ones(3, dtype=np.complex64))
    with pytest.raises(gl.GadgetTypeError, match=rf"{h5}.*'s'.*cannot be a table"):
        gl.DataGadget(h5, placement="cpu", dataset="s")
    with pytest.raises(gl.GadgetTypeError, match=rf"{h5}.*complex64"):
        gl.DataGadget(h5, placement="file", dataset="c")
    z = zarr.create_array(str(tmp_path / "s.zarr"), shape=(2,), dtype=str)
    z[:] = np.array(["ab", "cd"])
    with pytest.raises(gl.GadgetTypeError, match=r"s.zarr.*cannot be a table"):
        gl.DataGadget(tmp_path / "s.zarr", placement="cpu")


@pytest.mark.parametrize("ext", list(FORMATS.values()))
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_zero_row_table(tmp_path: Path, ext: str, placement: str) -> None:
    path = tmp_path / f"z{ext}"
    empty = np.empty((0, 4), dtype=np.float32)
    if ext == ".npy":
        np.save(path, empty)
    elif ext == ".zarr":
        import zarr

        zarr.create_array(str(path), shape=empty.shape, dtype=empty.dtype)
    else:
        import h5py

        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=empty)
    with pytest.raises(gl.GadgetValueError, match=rf"{path}.*zero rows"):
        gl.DataGadget(path, placement=placement)
    # so gadgetloader writes no such file either
    with pytest.raises(gl.GadgetValueError, match="zero rows"):
        gl.DataGadget(empty, placement="cpu").save(tmp_path / f"again{ext}")
    assert not (tmp_path / f"again{ext}").exists()


# ---- convert ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src_fmt", list(FORMATS))
@pytest.mark.parametrize("dst_fmt", list(FORMATS))
def test_convert_between_formats(tmp_path: Path, src_fmt: str, dst_fmt: str) -> None:
    data = table(rows=1000)
    src = write(
        data,
        tmp_path / f"src{FORMATS[src_fmt]}",
        **({} if src_fmt == "npy" else {"chunk_rows": 37}),
    )
    dst = tmp_path / f"dst{FORMATS[dst_fmt]}"
    opts = {} if dst_fmt == "npy" else {"chunk_rows": 64}
    info = conv.convert(src, dst, progress=False, **opts)
    assert (
        info["shape"] == (1000, WIDTH)
        and info["dst_format"] == dst_fmt
        and info["bytes"] == data.nbytes
    )
    assert np.array_equal(on_disk(dst), data)


def test_convert_keeps_bfloat16_bits_and_refuses_npy(tmp_path: Path) -> None:
    bf = torch.randn(100, 4).to(torch.bfloat16)
    with gl.DataGadget(bf, placement="cpu") as g:
        g.save(tmp_path / "b.h5", dataset="emb", progress=False)
    conv.convert(
        tmp_path / "b.h5", tmp_path / "b.zarr", dataset="emb", compression="gzip", progress=False
    )
    with gl.DataGadget(tmp_path / "b.zarr", placement="file", dataset="emb") as g:
        assert g.dtype == torch.bfloat16
        assert torch.equal(g.getData(range(100)).cpu().view(torch.int16), bf.view(torch.int16))
    with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
        conv.convert(tmp_path / "b.zarr", tmp_path / "b.npy", dataset="emb", progress=False)
    assert not (tmp_path / "b.npy").exists()


def test_convert_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = table()
    src = write(data, tmp_path / "a.npy")
    parser = argparse.ArgumentParser()
    conv.add_arguments(parser)
    args = parser.parse_args(
        [
            str(src),
            str(tmp_path / "a.h5"),
            "--chunk-rows",
            "50",
            "--compression",
            "gzip",
            "--dst-dataset",
            "x/y",
        ]
    )
    assert conv.run(args) == 0
    out = capsys.readouterr().out
    assert "a.npy (npy) -> " in out and "(hdf5)" in out and "(300, 5) float32" in out
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert f["x/y"].chunks == (50, WIDTH) and f["x/y"].compression == "gzip"
        assert np.array_equal(f["x/y"][:], data)
    args = parser.parse_args(
        [str(tmp_path / "a.h5"), str(tmp_path / "b.zarr"), "--dataset", "nope"]
    )
    assert conv.run(args) == 1
    err = capsys.readouterr().err
    assert "no dataset 'nope'" in err and "x/y" in err
    assert not (tmp_path / "b.zarr").exists()
    args = parser.parse_args([str(src), str(src)])
    assert conv.run(args) == 1
    assert "same file" in capsys.readouterr().err


# ---- properties -------------------------------------------------------------------------------------------------------------
def test_chunk_aligner_writes_whole_chunks() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, c = int(rng.integers(1, 120)), int(rng.integers(1, 20))
        data = rng.standard_normal((n, 2)).astype(np.float32)
        out = np.full_like(data, np.nan)
        writes: list[tuple[int, int]] = []

        def sink(
            start: int,
            rows: np.ndarray,
            out: np.ndarray = out,
            writes: list[tuple[int, int]] = writes,
        ) -> None:
            out[start : start + len(rows)] = rows
            writes.append((start, len(rows)))

        al = ChunkAligner(sink, n, c, (2,), np.dtype(np.float32))
        pos = 0
        while pos < n:
            k = int(rng.integers(1, 30))
            al.write(pos, data[pos : pos + k].copy())
            pos += k
        al.flush()
        assert np.array_equal(out, data)
        for start, length in writes:  # sequential streams: every write is whole chunks
            assert start % c == 0 and (length % c == 0 or start + length == n)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(list(FORMATS)),
    rows=st.integers(1, 60),
    chunk=st.integers(1, 9),
    cache_blocks=st.sampled_from([0, 1, 3, 100]),
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 59), min_size=0, max_size=25)),
        min_size=1,
        max_size=6,
    ),
)
def test_file_store_matches_numpy(
    fmt: str, rows: int, chunk: int, cache_blocks: int, ops: list[tuple[bool, list[int]]]
) -> None:
    width = 3
    ref = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"t{FORMATS[fmt]}"
        write(ref, path, **({} if fmt == "npy" else {"chunk_rows": chunk}))
        g = gl.DataGadget(
            path, placement="file", cache_bytes=cache_blocks * chunk * width * 4, block_rows=chunk
        )
        try:
            for k, (is_write, ids) in enumerate(ops):
                ids = [i % rows for i in ids]
                if is_write:
                    vals = (
                        np.random.default_rng(k)
                        .standard_normal((len(ids), width))
                        .astype(np.float32)
                    )
                    g.insertData(torch.from_numpy(vals), ids)
                    for i, j in enumerate(ids):  # the last occurrence wins
                        ref[j] = vals[i]
                else:
                    assert np.array_equal(g.getData(ids).cpu().numpy().reshape(-1, width), ref[ids])
                assert g.store.cached_bytes <= g.store.cache_bytes
            assert np.array_equal(g.getData(range(rows)).cpu().numpy(), ref)
        finally:
            g.close()
        assert np.array_equal(on_disk(path), ref)


# ---- the bench at a tiny size --------------------------------------------------------------------------------------------------
def test_bench_files_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gadgetloader.bench import _files

    parser = argparse.ArgumentParser()
    _files.add_arguments(parser)
    args = parser.parse_args(
        ["--mb", "2", "--random-mb", "1", "--ids", "64", "--repeats", "2", "--dir", str(tmp_path)]
    )
    report = _files.run(args)
    out = capsys.readouterr().out
    assert "disk sequential read" in out and "h5py ds[sorted ids]" in out
    assert report["checks_passed"] is True
    assert report["disk"]["read_GBps"] > 0
    assert {r["format"] for r in report["load"]} == set(FORMATS)
    for r in report["load"]:
        assert r["checked"] and r["GBps"] > 0 and r["fraction_of_disk"] > 0
    ours = [r for r in report["random"] if r["method"] == "gadgetloader file store"]
    assert len(ours) == 3 and len(report["random"]) == 6
    for r in report["random"]:
        assert r["checked"] and r["ms"] > 0 and r["rows_per_s"] > 0
    for r in ours:
        assert r["speedup_vs_baseline"] > 0
        # zarr goes through the block cache; .npy (memory map) and uncompressed HDF5
        # (single-row reads for sparse ids) do not read whole chunks
        assert r["cache_misses"] > 0 if r["format"] == "zarr" else r["cache_misses"] == 0
    assert report["config"]["cache_bytes"] < report["config"]["random_table_bytes"]
    assert not list(tmp_path.iterdir())  # the temp files are gone
    import json

    json.dumps(report)
