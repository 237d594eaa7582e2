"""Files, edge cases found in review: byte order and layout of .npy write-through, several
tables of one HDF5 file, saves that must not replace a directory, convert's refusals."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr

import gadgetloader as gl
from gadgetloader import convert as conv


def _file_gadget(path: Path, **kw: object) -> gl.DataGadget:
    return gl.DataGadget(path, placement="file", device="cpu", **kw)


def test_big_endian_npy_writes_in_the_files_byte_order(tmp_path: Path) -> None:
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    p = tmp_path / "be.npy"
    np.save(p, a.astype(">f4"))
    g = _file_gadget(p)
    g.insertData(torch.full((2, 4), 1.5), [3, 60])
    assert torch.equal(
        g.getData([3, 4, 60]), torch.tensor(a[[3, 4, 60]]).index_fill_(0, torch.tensor([0, 2]), 1.5)
    )
    g.close()
    back = np.load(p)
    assert back.dtype == np.dtype(">f4")  # the file keeps its byte order
    want = a.copy()
    want[[3, 60]] = 1.5
    np.testing.assert_array_equal(back, want)  # neighbours of the written rows unchanged
    g = _file_gadget(p)
    g.fill_(2.5)
    g.close()
    np.testing.assert_array_equal(np.load(p), np.full_like(a, 2.5))


def test_fortran_npy_is_a_read_only_file_table(tmp_path: Path) -> None:
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(a))
    before = p.read_bytes()
    g = _file_gadget(p)
    assert not g.store.supports_writes
    np.testing.assert_array_equal(g.getData([0, 7, 19]).numpy(), a[[0, 7, 19]])
    with pytest.raises(gl.ReadOnlyError, match="read-only"):
        g.insertData(torch.zeros((1, 3)), [0])
    g.close()
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        _file_gadget(p, writable=True)
    assert p.read_bytes() == before


@pytest.mark.parametrize("first", ["words", "chars"])
def test_two_tables_of_one_hdf5_file_both_write(tmp_path: Path, first: str) -> None:
    p = tmp_path / "m.h5"
    words = np.arange(40, dtype=np.float32).reshape(10, 4)
    chars = np.zeros((6, 4), np.float32)
    with h5py.File(p, "w") as f:
        f.create_dataset("emb/words", data=words, chunks=(2, 4))
        f.create_dataset("emb/chars", data=chars, chunks=(2, 4))
    g = {name: _file_gadget(p, dataset=f"emb/{name}") for name in ("words", "chars")}
    for x in g.values():  # both hold the file open read-only now
        x.getData([1])
    second = "chars" if first == "words" else "words"
    g[first].insertData(torch.full((1, 4), 7.0), [3])
    g[second].insertData(torch.full((1, 4), 9.0), [2])
    assert g[first].getData([3]).eq(7.0).all() and g[second].getData([2]).eq(9.0).all()
    np.testing.assert_array_equal(g["words"].getData([1]).numpy(), words[[1]])
    for x in g.values():
        x.close()
    with h5py.File(p, "r") as f:
        assert (f[f"emb/{first}"][3] == 7.0).all() and (f[f"emb/{second}"][2] == 9.0).all()
        assert f["emb/words"][1].tolist() == words[1].tolist()


def test_truncated_hdf5_gets_no_lock_hint(tmp_path: Path) -> None:
    p = tmp_path / "t.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.ones((100, 8), np.float32))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])
    with pytest.raises(gl.GadgetError) as info:
        gl.DataGadget(p, placement="cpu", device="cpu")
    assert str(p) in str(info.value) and "locks files" not in str(info.value)


def test_npy_truncated_after_opening_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "x.npy"
    np.save(p, np.ones((1000, 16), np.float32))
    g = _file_gadget(p, cache_bytes=0)
    with open(p, "r+b") as f:
        f.truncate(1024)
    with pytest.raises(gl.GadgetError, match="x.npy"):
        g.getData([900])
    g.close()


@pytest.mark.parametrize("name", ["d.npy", "d.h5", "d.zarr"])
def test_save_never_replaces_a_directory_that_is_not_a_store(tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetFileError, match="cannot save to"):
        g.save(target)
    assert (target / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(target)) == ["keep.txt"]
    assert not [q for q in os.listdir(tmp_path) if q.startswith(".")]  # no temporary left


def test_save_replaces_a_zarr_store_and_refuses_a_plain_file(tmp_path: Path) -> None:
    g = gl.DataGadget(np.arange(6, dtype=np.float32).reshape(3, 2), placement="cpu", device="cpu")
    z = tmp_path / "t.zarr"
    g.save(z)
    g.insertData(torch.zeros((1, 2)), [0])
    g.save(z)  # an existing zarr store is replaced
    np.testing.assert_array_equal(zarr.open_array(z, mode="r")[:], g.getNumpyVersion())
    f = tmp_path / "f.zarr"
    f.write_text("not a store")
    with pytest.raises(gl.GadgetFileError, match="not a zarr store"):
        g.save(f)
    assert f.read_text() == "not a store"


def test_convert_refuses_a_zero_row_table_before_writing(tmp_path: Path) -> None:
    src = tmp_path / "z.npy"
    np.save(src, np.zeros((0, 4), np.float32))
    with pytest.raises(gl.GadgetValueError, match="zero rows"):
        conv.convert(src, tmp_path / "z.h5", progress=False)
    assert not (tmp_path / "z.h5").exists()


def test_convert_dataset_of_a_npy_source_points_at_dst_dataset(tmp_path: Path) -> None:
    src = tmp_path / "a.npy"
    np.save(src, np.ones((5, 4), np.float32))
    with pytest.raises(gl.GadgetValueError, match="--dst-dataset"):
        conv.convert(src, tmp_path / "a.h5", dataset="emb", progress=False)
    conv.convert(src, tmp_path / "a.h5", dst_dataset="emb", progress=False)
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert list(f) == ["emb"] and f["emb"].shape == (5, 4)


def test_file_cache_slots_never_outnumber_the_tables_blocks(tmp_path: Path) -> None:
    p = tmp_path / "small.npy"
    np.save(p, np.arange(10, dtype=np.uint8))
    g = _file_gadget(p)  # default budget is far above the table
    assert g.store._capacity == 1 and len(g.store._free) <= 1
    assert g.getData([3, 9]).tolist() == [3, 9]
    q = tmp_path / "narrow.npy"
    np.save(q, np.arange(5000, dtype=np.int32))
    h = _file_gadget(q, block_rows=1)
    assert h.store._capacity <= 5000
    assert h.getData([0, 4999]).tolist() == [0, 4999]
    h.close()
    g.close()


def test_hdf5_file_table_writes_while_a_worker_reads(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    p = tmp_path / "w.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.arange(300, dtype=np.float32).reshape(100, 3), chunks=(10, 3))
    g = _file_gadget(p)
    dl = DataLoader(gl.GadgetDataset(g), batch_size=20, num_workers=1, persistent_workers=True)
    assert sum(b[0].shape[0] for b in dl) == 100  # the worker holds the file open now
    g.insertData(torch.full((1, 3), -1.0), [7])  # the main process writes meanwhile
    g.flush()
    assert g.getData([7]).eq(-1.0).all()
    for i, _ in enumerate(dl):  # and during an epoch
        g.insertData(torch.full((1, 3), -2.0), [i])
    g.close()
    with h5py.File(p, "r") as f:
        assert (f["x"][7] == -1.0).all() and (f["x"][:5] == -2.0).all()


def test_a_second_table_of_one_hdf5_dataset_sees_writes(tmp_path: Path) -> None:
    p = tmp_path / "two.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.arange(200, dtype=np.float32).reshape(50, 4), chunks=(5, 4))
    a = _file_gadget(p, cache_bytes=0)
    b = _file_gadget(p)
    a.getData(list(range(50)))
    b.insertData(-torch.ones(3, 4), [0, 9, 40])
    assert a.getData([0, 9, 40]).eq(-1.0).all()
    a.close()
    b.close()


def test_save_refuses_a_path_that_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.npy"
    os.mkfifo(fifo)
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetFileError, match="not a regular file"):
        g.save(fifo)
    assert fifo.is_fifo()


def test_convert_cli_reports_file_system_errors_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    src = tmp_path / "c.npy"
    np.save(src, np.ones((4, 2), np.float32))
    proc = subprocess.run(
        [sys.executable, "-m", "gadgetloader", "convert", str(src), str(src / "x.h5")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("gadgetloader convert: error:") and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("ext", "options", "match"),
    [
        (".h5", {"compression": "gzip", "compression_level": 12}, r"\[0, 9\]"),
        (".zarr", {"compression": "zstd", "compression_level": 99}, r"\[-131072, 22\]"),
        (".zarr", {"compression": "blosc", "compression_level": 1.5}, "integer"),
        (".h5", {"compression": "lzf", "compression_level": 3}, "takes no level"),
        (".h5", {"compression_level": 3}, "takes no level"),
    ],
)
def test_compression_level_is_checked(
    tmp_path: Path, ext: str, options: dict[str, object], match: str
) -> None:
    g = gl.DataGadget(np.ones((30, 2), np.float32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError, match=match):
        g.save(tmp_path / f"t{ext}", **options)
    assert not list(tmp_path.iterdir())


def test_compression_levels_in_range_round_trip(tmp_path: Path) -> None:
    data = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
    g = gl.DataGadget(data, placement="cpu", device="cpu")
    for name, options in {
        "a.h5": {"compression": "gzip", "compression_level": 9},
        "b.zarr": {"compression": "zstd", "compression_level": -5},
        "c.zarr": {"compression": "blosc", "compression_level": 0},
    }.items():
        g.save(tmp_path / name, **options)
        np.testing.assert_array_equal(
            gl.DataGadget(tmp_path / name, placement="cpu", device="cpu").getNumpyVersion(), data
        )


def test_zarr_save_into_an_empty_directory(tmp_path: Path) -> None:
    target = tmp_path / "empty"
    target.mkdir()
    g = gl.DataGadget(np.arange(6, dtype=np.float32).reshape(3, 2), placement="cpu", device="cpu")
    g.save(target, format="zarr")
    np.testing.assert_array_equal(zarr.open_array(target, mode="r")[:], g.getNumpyVersion())


def test_hdf5_writes_are_seen_after_a_worker_was_forked(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    p = tmp_path / "c.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.arange(400, dtype=np.float32).reshape(100, 4))
    a = _file_gadget(p, cache_bytes=0)
    b = _file_gadget(p, cache_bytes=0)
    a.getData([1])
    b.getData([1])
    assert (
        sum(x[0].shape[0] for x in DataLoader(gl.GadgetDataset(a), batch_size=50, num_workers=1))
        == 100
    )
    b.insertData(torch.full((1, 4), -1.0), [40])
    assert a.getData([40]).eq(-1.0).all()
    a.close()
    b.close()


def test_rewritten_compressed_hdf5_chunks_are_read_from_their_new_place(tmp_path: Path) -> None:
    p = tmp_path / "gz.h5"
    data = np.arange(2000, dtype=np.float32).reshape(500, 4)
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=data, chunks=(5, 4), compression="gzip")
    a = _file_gadget(p, cache_bytes=0)
    b = _file_gadget(p, cache_bytes=0)
    np.testing.assert_array_equal(a.getData(list(range(500))).numpy(), data)
    b.insertData(torch.full((3, 4), -1.0), [40, 41, 250])
    got = a.getData([39, 40, 41, 250, 499]).numpy()
    np.testing.assert_array_equal(got[[1, 2, 3]], -np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(got[[0, 4]], data[[39, 499]])
    a.close()
    b.close()


def test_bench_files_with_a_missing_dir_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gadgetloader.cli import main

    with pytest.raises(SystemExit) as exit_info:  # a usage error (exit status 2)
        main(["bench", "files", "--dir", "/nonexistent/gadgetloader-dir", "--mb", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gadgetloader bench files: error:") and "no such directory" in err
