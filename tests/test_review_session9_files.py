"""Session 9 review of file tables and saves: a shrunk HDF5 file, damaged chunks behind a
write unit larger than a block, refused writes, disk space, zarr's in-flight writes,
``writable=`` and dataset names."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.convert import convert

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")


def _tree_hash(p: Path) -> str:
    h = hashlib.md5()
    if p.is_file():
        h.update(p.read_bytes())
        return h.hexdigest()
    for f in sorted(p.rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(p)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _partials(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if ".partial-" in n]


# ---- 1. an HDF5 file read through a memory map shrinks in place -------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
@pytest.mark.parametrize("how", ["truncate", "copy"])
def test_hdf5_file_shrunk_in_place_raises_instead_of_sigbus(
    tmp_path: Path, layout: str, how: str
) -> None:
    # in a child process: before the fix the read killed the interpreter (SIGBUS)
    script = textwrap.dedent(
        f"""
        import os, shutil, warnings
        import numpy as np, h5py, gadgetloader as gl
        warnings.simplefilter("ignore")
        p, q = {str(tmp_path / "t.h5")!r}, {str(tmp_path / "small.h5")!r}
        chunks = None if {layout!r} == "contiguous" else (10, 4)
        with h5py.File(p, "w") as f:
            f.create_dataset("d", data=np.arange(40000, dtype=np.float32).reshape(10000, 4),
                             chunks=chunks)
        with h5py.File(q, "w") as f:
            f["d"] = np.zeros((10, 4), np.float32)
        g = gl.DataGadget(p, placement="file")
        assert g.getData([1]).tolist() == [[4.0, 5.0, 6.0, 7.0]]
        ino = os.stat(p).st_ino
        if {how!r} == "truncate":
            with open(p, "r+b") as fh:
                fh.truncate(os.path.getsize(p) // 2)
        else:
            shutil.copyfile(q, p)  # another program copies a smaller file over it
        assert os.stat(p).st_ino == ino
        try:
            g.getData([9999])
        except gl.GadgetFileError as exc:
            assert "shrank" in str(exc) and p in str(exc), exc
            print("RAISED")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "RAISED" in out.stdout


def test_hdf5_mapped_table_still_reads_after_growing(tmp_path: Path) -> None:
    p = tmp_path / "t.h5"
    a = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    with h5py.File(p, "w") as f:
        f.create_dataset("d", data=a, chunks=(10, 4))
    g = gl.DataGadget(p, placement="file")
    np.testing.assert_array_equal(g.getData([3, 999]).cpu().numpy(), a[[3, 999]])
    with open(p, "ab") as fh:  # larger: not detected, rows still there
        fh.write(b"\0" * 4096)
    np.testing.assert_array_equal(g.getData([5, 998]).cpu().numpy(), a[[5, 998]])
    g.close()


# ---- 2. a damaged chunk behind a write unit larger than the block ----------------------------
def test_sharded_zarr_write_checks_the_whole_shard_first(tmp_path: Path) -> None:
    p = tmp_path / "s.zarr"
    a = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    z = zarr.create_array(str(p), shape=a.shape, chunks=(4, 4), shards=(16, 4), dtype="f4")
    z[:] = a
    (p / "c" / "2" / "0").write_bytes(b"garbage" * 3)  # the shard of rows 32..47
    before = _tree_hash(p)
    g = gl.DataGadget(str(p), placement="file")
    assert g.store.block_rows == 4  # the inner chunk; zarr rewrites the whole shard
    with pytest.raises(gl.GadgetFileError, match="s.zarr"):
        g.insertData(np.zeros((5, 4), np.float32), [1, 32, 33, 34, 35])
    assert _tree_hash(p) == before
    np.testing.assert_array_equal(zarr.open(str(p))[1], a[1])


def test_sharded_zarr_writes_whole_and_partial_shards_correctly(tmp_path: Path) -> None:
    p = tmp_path / "s.zarr"
    a = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    z = zarr.create_array(str(p), shape=a.shape, chunks=(4, 4), shards=(16, 4), dtype="f4")
    z[:] = a
    g = gl.DataGadget(str(p), placement="file")
    ids = np.r_[0:16, 20, 21, 22, 23, 63]
    rows = -np.arange(ids.size * 4, dtype=np.float32).reshape(-1, 4)
    g.insertData(rows, ids)
    a[ids] = rows
    np.testing.assert_array_equal(zarr.open(str(p))[:], a)
    np.testing.assert_array_equal(g.getData(np.arange(64)).cpu().numpy(), a)


def test_zarr_block_rows_below_chunk_checks_the_chunk_first(tmp_path: Path) -> None:
    p = tmp_path / "z.zarr"
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    z = zarr.create_array(str(p), shape=a.shape, chunks=(10, 4), dtype="f4")
    z[:] = a
    (p / "c" / "5" / "0").write_bytes(b"garbage!!")
    before = _tree_hash(p)
    g = gl.DataGadget(str(p), placement="file", block_rows=5)
    with pytest.raises(gl.GadgetFileError, match="z.zarr"):
        g.insertData(np.zeros((6, 4), np.float32), [1, 50, 51, 52, 53, 54])
    assert _tree_hash(p) == before


def _damaged_gzip_h5(p: Path, a: np.ndarray, chunk: int) -> None:
    with h5py.File(p, "w") as f:
        d = f.create_dataset("d", data=a, chunks=(10, 4), compression="gzip")
        info = d.id.get_chunk_info(chunk)
        off, size = info.byte_offset, info.size
    b = bytearray(p.read_bytes())
    b[off : off + size] = bytes(size)
    p.write_bytes(bytes(b))


def test_hdf5_block_rows_below_chunk_checks_the_chunk_first(tmp_path: Path) -> None:
    p = tmp_path / "h.h5"
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    _damaged_gzip_h5(p, a, 5)
    before = p.read_bytes()
    g = gl.DataGadget(str(p), placement="file", block_rows=5)
    with pytest.raises(gl.GadgetFileError, match="h.h5"):
        g.insertData(np.zeros((6, 4), np.float32), [1, 50, 51, 52, 53, 54])
    g.close()
    assert p.read_bytes() == before


def test_hdf5_block_rows_below_chunk_writes_correctly(tmp_path: Path) -> None:
    p = tmp_path / "h.h5"
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    with h5py.File(p, "w") as f:
        f.create_dataset("d", data=a, chunks=(10, 4), compression="gzip")
    g = gl.DataGadget(str(p), placement="file", block_rows=5)
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = rng.choice(100, size=17, replace=False)
        rows = rng.standard_normal((17, 4)).astype(np.float32)
        g.insertData(rows, ids)
        a[ids] = rows
    np.testing.assert_array_equal(g.getData(np.arange(100)).cpu().numpy(), a)
    g.close()
    with h5py.File(p, "r") as f:
        np.testing.assert_array_equal(f["d"][:], a)


def test_hdf5_write_errors_are_gadget_file_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "h.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("d", data=np.zeros((20, 4), np.float32), chunks=(10, 4))
    g = gl.DataGadget(str(p), placement="file")

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Unable to synchronously write (errno = 28)")

    monkeypatch.setattr(h5py.Dataset, "write_direct", fail)
    with pytest.raises(gl.GadgetFileError, match="h.h5.*errno = 28"):
        g.insertData(np.ones((20, 4), np.float32), np.arange(20))
    monkeypatch.undo()
    g.close()


# ---- 3. a refused HDF5 write leaves the table readable ---------------------------------------
def test_refused_hdf5_write_leaves_reads_working(tmp_path: Path) -> None:
    p = tmp_path / "h.h5"
    with h5py.File(p, "w") as f:
        f["d"] = np.arange(40, dtype=np.float32).reshape(10, 4)
    user = h5py.File(p, "r")  # the user's own read-only handle
    try:
        g = gl.DataGadget(str(p), placement="file")
        assert g.getData([1]).tolist() == [[4.0, 5.0, 6.0, 7.0]]
        with pytest.raises(gl.GadgetFileError, match="r\\+"):
            g.insertData(np.zeros((1, 4), np.float32), [1])
        assert g.getData([1]).tolist() == [[4.0, 5.0, 6.0, 7.0]]
        assert g.getData([9]).tolist() == [[36.0, 37.0, 38.0, 39.0]]
    finally:
        user.close()
    g.insertData(np.zeros((1, 4), np.float32), [1])  # the handle gone, writes work
    assert g.getData([1]).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    g.close()


# ---- 4. the reason a Fortran-ordered .npy cannot be written ----------------------------------
def test_fortran_npy_write_refusal_says_why(tmp_path: Path) -> None:
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(np.zeros((4, 3), np.float32)))
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.ReadOnlyError) as info:
        g.insertData(np.ones((1, 3), np.float32), [0])
    msg = str(info.value)
    assert "Fortran-ordered" in msg and "cannot be written in place" in msg
    assert "without write access" not in msg and "writable=True" not in msg
    g.close()


def test_read_only_reasons(tmp_path: Path) -> None:
    p = tmp_path / "w.npy"
    np.save(p, np.zeros((4, 3), np.float32))
    g = gl.DataGadget(str(p), placement="file", writable=False)
    with pytest.raises(gl.ReadOnlyError, match="writable=False"):
        g.insertData(np.ones((1, 3), np.float32), [0])
    g.close()


# ---- 5. not enough space for a save ------------------------------------------------------------
def _little_space(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    real = shutil.disk_usage

    def fake(path: object) -> object:
        u = real(path)
        return type(u)(u.total, u.total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", fake)


@pytest.mark.parametrize(
    ("name", "options"),
    [("t.npy", {}), ("t.h5", {})],
)
def test_save_without_space_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, options: dict[str, str]
) -> None:
    target = tmp_path / name
    gl.DataGadget(np.ones((4, 4), np.float32), placement="cpu").save(str(target), **options)
    before = _tree_hash(target)
    _little_space(monkeypatch, 100_000)
    big = gl.DataGadget(torch.zeros(100_000, 4), placement="cpu")  # 1.6 MB
    with pytest.raises(gl.GadgetFileError, match="not enough space: need \\d+ bytes, 100000 free"):
        big.save(str(target), **options)
    assert _tree_hash(target) == before
    assert _partials(tmp_path) == []
    small = gl.DataGadget(np.full((4, 4), 2, np.float32), placement="cpu")
    small.save(str(target), **options)  # what fits is saved
    np.testing.assert_array_equal(gl.DataGadget(str(target), placement="cpu").getNumpyVersion(), 2)


def test_convert_without_space_refused_and_compressed_not_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "s.npy"
    np.save(src, np.zeros((100_000, 4), np.float32))
    _little_space(monkeypatch, 100_000)
    with pytest.raises(gl.GadgetFileError, match="not enough space"):
        convert(str(src), str(tmp_path / "d.h5"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["s.npy"]
    # a compressed file's size is not known beforehand: not refused (zeros compress well)
    convert(str(src), str(tmp_path / "d.zarr"), progress=False)
    convert(str(src), str(tmp_path / "d.h5"), compression="gzip", progress=False)


def test_hdf5_save_flush_error_is_a_gadget_file_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "t.h5"
    gl.DataGadget(np.ones((4, 4), np.float32), placement="cpu").save(str(target))
    before = target.read_bytes()

    def fail(self: object) -> None:
        raise RuntimeError("Unable to synchronously flush file (errno = 28)")

    monkeypatch.setattr(h5py.File, "flush", fail)
    with pytest.raises(gl.GadgetFileError, match="t.h5.*errno = 28"):
        gl.DataGadget(np.zeros((50, 4), np.float32), placement="cpu").save(str(target))
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert _partials(tmp_path) == []


# ---- 6. zarr's chunk writes still in flight when a save fails --------------------------------
def test_failed_zarr_save_leaves_no_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zarr.storage import LocalStore

    target = tmp_path / "t.zarr"
    gl.DataGadget(np.ones((4, 4), np.float32), placement="cpu").save(str(target))
    before = _tree_hash(target)
    orig = LocalStore.set

    async def flaky_set(self: LocalStore, key: str, value: object, *a: object, **k: object) -> None:
        if key == "c/3/0":
            raise OSError(28, "No space left on device (simulated)")
        if key.startswith("c/"):
            await asyncio.sleep(0.3)  # the other chunk writes are still running then
        return await orig(self, key, value, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalStore, "set", flaky_set)
    g = gl.DataGadget(np.ones((64, 4), np.float32), placement="cpu")
    with pytest.raises(OSError, match="No space left"):
        g.save(str(target), chunk_rows=8)
    time.sleep(0.8)  # past the delayed writes
    assert _partials(tmp_path) == []
    monkeypatch.undo()
    assert _tree_hash(target) == before


# ---- 7. writable= takes True, False or None --------------------------------------------------
@pytest.mark.parametrize("bad", ["no", "False", "0", 1, 0, 1.0])
def test_writable_must_be_a_bool(tmp_path: Path, bad: object) -> None:
    p = tmp_path / "w.npy"
    np.save(p, np.zeros((4, 3), np.float32))
    before = p.read_bytes()
    with pytest.raises(gl.GadgetTypeError, match="writable must be True, False or None"):
        gl.DataGadget(str(p), placement="file", writable=bad)
    assert p.read_bytes() == before


def test_writable_accepts_numpy_bools(tmp_path: Path) -> None:
    p = tmp_path / "w.npy"
    np.save(p, np.zeros((4, 3), np.float32))
    ro = gl.DataGadget(str(p), placement="file", writable=np.bool_(False))
    assert not ro.store.supports_writes
    ro.close()
    rw = gl.DataGadget(str(p), placement="file", writable=np.bool_(True))
    rw.insertData(np.ones((1, 3), np.float32), [2])
    rw.close()
    assert np.load(p)[2].tolist() == [1.0, 1.0, 1.0]


# ---- 8. dataset names of a save --------------------------------------------------------------
@pytest.mark.parametrize("ext", ["zarr", "h5"])
@pytest.mark.parametrize("name", ["..", "a/../../x", ".", "a/./b"])
def test_save_refuses_dot_dataset_names(tmp_path: Path, ext: str, name: str) -> None:
    g = gl.DataGadget(np.ones((4, 4), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="not a valid .* array name"):
        g.save(str(tmp_path / f"x.{ext}"), dataset=name)
    assert os.listdir(tmp_path) == []


def test_convert_refuses_dot_dst_dataset(tmp_path: Path) -> None:
    src = tmp_path / "s.npy"
    np.save(src, np.zeros((4, 4), np.float32))
    with pytest.raises(gl.GadgetValueError, match="'\\.\\.'"):
        convert(str(src), str(tmp_path / "d.zarr"), dst_dataset="..", progress=False)
    assert os.listdir(tmp_path) == ["s.npy"]


@pytest.mark.parametrize("ext", ["zarr", "h5"])
def test_save_dataset_name_with_empty_parts_still_works(tmp_path: Path, ext: str) -> None:
    target = tmp_path / f"x.{ext}"
    gl.DataGadget(np.ones((4, 4), np.float32), placement="cpu").save(
        str(target), dataset="/g//emb/"
    )
    back = gl.DataGadget(str(target), dataset="g/emb", placement="cpu")
    np.testing.assert_array_equal(back.getNumpyVersion(), 1)


def test_zarr_save_is_not_refused_for_chunks_it_never_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # zarr skips chunks equal to the fill value: an all-zero table takes a few bytes
    _little_space(monkeypatch, 100_000)
    target = tmp_path / "z.zarr"
    gl.DataGadget(torch.zeros(100_000, 4), placement="cpu").save(str(target), compression="none")
    assert not gl.DataGadget(str(target), placement="cpu").getNumpyVersion().any()
