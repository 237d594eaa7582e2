"""Session 51's fixes, from three black-box reviews (zarr, the embedding bag, the command
line and the word2vec example).

- An initializer (``fill_``, ``zero_``, ``uniform_``, ...) of a ``file`` table read each
  64 MiB block before writing it: a damaged chunk past the first block raised after the
  first blocks were written. Initializers no longer read (their values do not depend on
  the old ones) and write whole chunks or shards, so a damaged chunk is overwritten.
- A zarr chunk file that is a device (``/dev/zero``) was read without end on compressed
  arrays; a named pipe blocked for ever on arrays zarr reads itself (sharded, crc32c); an
  empty shard file read as the fill value. All are ``GadgetFileError`` now, and so is a
  compressed chunk file far larger than any codec writes.
- An array opened by name from a group with consolidated metadata took its shape from
  that copy, which may be out of date (a resize): rows past its real end read as zeros
  and writes to them went to chunk files outside the array.
- ``--json`` (and ``--plot``) replaced a device, a named pipe or ``/dev/stdout`` with a
  plain file; ``--plot`` with a name matplotlib cannot write failed after the sweep.
- ``bench pipeline --workers ""`` ran with no worker counts but 0.
- word2vec: a large ``--window`` took all memory before failing; outputs that cannot be
  written (a named pipe, a link into a missing folder) were found after training, and a
  save that failed part-way left new vectors beside the old word list.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MEMORY_PLACEMENTS

import gadgetloader as gl

zarr = pytest.importorskip("zarr")

PLACEMENTS = [*MEMORY_PLACEMENTS, "file"]
ROOT = Path(__file__).resolve().parents[1]


def _rows(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


def _zarr_table(path: Path, kind: str, rows: int = 20, width: int = 4) -> np.ndarray:
    a = (np.arange(rows * width, dtype=np.float32).reshape(rows, width) + 1).copy()
    kw: dict = {}
    if kind == "shard":
        kw = {"shards": (10, width)}
    elif kind == "crc":
        kw = {"compressors": [zarr.codecs.ZstdCodec(), zarr.codecs.Crc32cCodec()]}
    elif kind == "zstd":
        kw = {"compressors": zarr.codecs.ZstdCodec()}
    elif kind == "raw":
        kw = {"compressors": None}
    zarr.create_array(str(path), shape=a.shape, chunks=(5, width), dtype="f4", **kw)[:] = a
    return a


# ---- initializers of file tables ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["zstd", "shard"])
@pytest.mark.parametrize(
    "init,expect",
    [
        (lambda g: g.fill_(5.0), lambda a: (a == 5.0).all()),
        (lambda g: g.zero_(), lambda a: (a == 0.0).all()),
        (lambda g: g.uniform_(2.0, 3.0), lambda a: ((a >= 2.0) & (a <= 3.0)).all()),
    ],
    ids=["fill_", "zero_", "uniform_"],
)
def test_initializer_overwrites_a_damaged_chunk_past_the_first_block(
    kind, init, expect, tmp_path, monkeypatch
):
    from gadgetloader.stores import _file

    p = tmp_path / "t.zarr"
    _zarr_table(p, kind, rows=40)
    damaged = p / "c" / "3" / "0"  # rows 30:40 (a shard), or 15:20 (a chunk of 5 rows)
    damaged.write_bytes(b"not a chunk")
    # blocks of 7 rows: not whole chunks or shards, and the damage is past the first block
    monkeypatch.setattr(_file, "INIT_BLOCK_BYTES", 7 * 16)
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetFileError):  # (the damage is there before the call)
        g.getData(np.arange(40))
    init(g)
    after = _rows(g.getData(np.arange(40)))
    g.close()
    on_disk = zarr.open_array(str(p), mode="r")[:]
    np.testing.assert_array_equal(on_disk, after)
    assert expect(on_disk)


def test_initializer_failing_part_way_removes_no_healthy_shard(tmp_path, monkeypatch):
    from gadgetloader.io import _zarr as zarr_source
    from gadgetloader.stores import _file

    p = tmp_path / "t.zarr"
    a = _zarr_table(p, "shard", rows=40)
    real = zarr_source.ZarrSource.write_rows

    def disk_full_from_row_20(self, start, rows):
        if start >= 20:
            raise gl.GadgetFileError("no space left (simulated)")
        return real(self, start, rows)

    monkeypatch.setattr(zarr_source.ZarrSource, "write_rows", disk_full_from_row_20)
    monkeypatch.setattr(_file, "INIT_BLOCK_BYTES", 7 * 16)  # blocks of one shard (10 rows)
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetFileError, match="simulated"):
        g.fill_(5.0)
    g.close()
    monkeypatch.undo()
    on_disk = zarr.open_array(str(p), mode="r")[:]
    assert (on_disk[:20] == 5.0).all()
    np.testing.assert_array_equal(on_disk[20:], a[20:])  # not removed, not zeroed


def test_initializer_holds_a_huge_shard_in_chunks(tmp_path, monkeypatch):
    from gadgetloader.stores import _file

    p = tmp_path / "t.zarr"
    _zarr_table(p, "shard", rows=40)  # shards of 10 rows (160 B), chunks of 5
    seen = []
    real = _file.FileStore._write_block

    def spy(self, start, rows, **kw):
        seen.append(rows.shape[0])
        return real(self, start, rows, **kw)

    monkeypatch.setattr(_file.FileStore, "_write_block", spy)
    monkeypatch.setattr(_file, "INIT_BLOCK_BYTES", 16)
    monkeypatch.setattr(_file, "INIT_MAX_UNIT_BYTES", 100)  # a shard is "huge"
    g = gl.DataGadget(str(p), placement="file")
    g.fill_(3.0)
    g.close()
    assert seen == [5] * 8  # whole chunks, not whole shards
    assert (zarr.open_array(str(p), mode="r")[:] == 3.0).all()


def test_initializer_writes_every_row_of_an_hdf5_table(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    from gadgetloader.stores import _file

    p = tmp_path / "t.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.ones((23, 3), np.float32), chunks=(4, 3))
    monkeypatch.setattr(_file, "INIT_BLOCK_BYTES", 5 * 12)  # 5 rows: rounded to 4
    g = gl.DataGadget(str(p), placement="file")
    g.fill_(-2.0)
    g.close()
    with h5py.File(p, "r") as f:
        np.testing.assert_array_equal(f["x"][:], np.full((23, 3), -2.0, np.float32))


# ---- chunk files that are not chunks ----------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", ["shard", "crc", "zstd", "raw"])
def test_named_pipe_chunk_is_an_error_not_a_hang(kind, placement, tmp_path):
    p = tmp_path / "t.zarr"
    _zarr_table(p, kind)
    chunk = p / "c" / "1" / "0"
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(gl.GadgetFileError, match="not a regular file"):
        g = gl.DataGadget(str(p), placement=placement)
        g.getData(np.arange(20))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", ["shard", "zstd", "raw"])
def test_device_chunk_is_an_error(kind, placement, tmp_path):
    p = tmp_path / "t.zarr"
    _zarr_table(p, kind)
    chunk = p / "c" / "1" / "0"
    chunk.unlink()
    os.symlink("/dev/zero", chunk)
    with pytest.raises(gl.GadgetFileError, match="not a regular file"):
        g = gl.DataGadget(str(p), placement=placement)
        g.getData(np.arange(20))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_compressed_chunk_far_larger_than_any_codec_writes_is_an_error(placement, tmp_path):
    p = tmp_path / "t.zarr"
    _zarr_table(p, "zstd")
    (p / "c" / "2" / "0").write_bytes(os.urandom(1 << 20))  # a chunk of 80 bytes
    with pytest.raises(gl.GadgetFileError, match="more than"):
        g = gl.DataGadget(str(p), placement=placement)
        g.getData(np.arange(20))


def test_chunk_read_bound_holds_with_a_larger_kept_buffer(tmp_path):
    from gadgetloader.io import _zarr as zarr_source

    zarr_source._SCRATCH.buf = bytearray(1 << 20)  # this thread read a larger chunk before
    # (what fits the kept buffer is returned whole; the decoder then judges its size)
    for size, ok in ((900, True), (5000, True), (3 << 20, False)):
        f = tmp_path / f"chunk{size}"
        data = os.urandom(size)
        f.write_bytes(data)
        fd = os.open(f, os.O_RDONLY)
        try:
            if ok:
                assert bytes(zarr_source._read_compressed(fd, 1000)) == data
            else:
                with pytest.raises(ValueError, match="more than 4000 bytes"):
                    zarr_source._read_compressed(fd, 1000)
        finally:
            os.close(fd)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_empty_shard_file_is_damage_not_fill_values(placement, tmp_path):
    p = tmp_path / "t.zarr"
    _zarr_table(p, "shard")
    (p / "c" / "0" / "0").write_bytes(b"")
    with pytest.raises(gl.GadgetFileError, match="empty file"):
        g = gl.DataGadget(
            str(p), placement=placement, **({"block_rows": 10} if placement == "file" else {})
        )
        g.getData(np.arange(20))


def test_write_into_a_shard_that_is_a_named_pipe_is_refused_unchanged(tmp_path):
    p = tmp_path / "t.zarr"
    a = _zarr_table(p, "shard")
    g = gl.DataGadget(str(p), placement="file")
    chunk = p / "c" / "1" / "0"
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(gl.GadgetFileError, match="not a regular file"):
        g.insertData(np.zeros((1, 4), np.float32), [12])
    g.close()
    assert stat.S_ISFIFO(os.lstat(chunk).st_mode)
    np.testing.assert_array_equal(zarr.open_array(str(p), mode="r")[:10], a[:10])


# ---- consolidated metadata ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_array_in_a_consolidated_group_has_its_own_shape(fmt, placement, tmp_path):
    p = str(tmp_path / "g.zarr")
    a = np.arange(56, dtype=np.float32).reshape(14, 4) + 1
    root = zarr.open_group(p, mode="w", zarr_format=fmt)
    root.create_array("x", shape=a.shape, chunks=(3, 4), dtype="f4")[:] = a
    zarr.consolidate_metadata(p)
    zarr.open_array(p, path="x", mode="r+", zarr_format=fmt).resize((10, 4))
    for g in (
        gl.DataGadget(p, dataset="x", placement=placement),
        gl.DataGadget(p, placement=placement),  # the group's only array
        gl.DataGadget(p + "/x", placement=placement),
    ):
        assert g.shape == (10, 4)
        np.testing.assert_array_equal(_rows(g.getData(np.arange(10))), a[:10])
        with pytest.raises(gl.GadgetIndexError):
            g.getData([12])
        g.close()


# ---- the command line -----------------------------------------------------------------------


def _cli(argv, capsys):
    from gadgetloader.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code, capsys.readouterr().err


def test_json_into_a_named_pipe_or_device_is_refused_before_the_run(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # (no real device here: were the check to regress, the run would replace it)
    code, err = _cli(["bench", "--rows", "100", "--ids", "10", "--json", str(fifo)], capsys)
    assert code == 2 and "not a regular file" in err, err
    code, err = _cli(["info", "--no-measure", "--json", str(fifo)], capsys)
    assert code == 2 and "not a regular file" in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_json_to_stdout_is_refused(capsys):
    code, err = _cli(["bench", "--rows", "100", "--ids", "10", "--json", "/dev/stdout"], capsys)
    assert code == 2 and "file descriptor" in err, err


def test_json_onto_the_file_stdout_goes_to_is_refused(tmp_path):
    out = tmp_path / "out.json"
    link = tmp_path / "link.json"
    link.symlink_to(out)
    for target in (out, link):
        with open(out, "w") as f:
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gadgetloader",
                    "info",
                    "--no-measure",
                    "--json",
                    str(target),
                ],
                stdout=f,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        assert r.returncode == 2 and "standard" in r.stderr, r.stderr
    assert out.read_text() == ""  # not replaced


def test_json_in_an_ordinary_folder_under_dev_is_written(tmp_path, capsys):
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    target = shm / f"gadgetloader-test-{os.getpid()}.json"
    try:
        from gadgetloader.cli import main

        assert main(["info", "--no-measure", "--json", str(target)]) in (0, None)
        assert target.read_text().startswith("{")
    finally:
        target.unlink(missing_ok=True)


@pytest.mark.parametrize("name,says", [("plot", "no extension"), ("plot.jpgz", ".jpgz")])
def test_plot_name_matplotlib_cannot_write_is_refused(name, says, tmp_path, capsys):
    code, err = _cli(["bench", "sweep", "--plot", str(tmp_path / name)], capsys)
    assert code == 2 and says in err and ".png" in err, err
    assert not (tmp_path / name).exists()


def test_pipeline_needs_a_worker_count(capsys):
    code, err = _cli(["bench", "pipeline", "--workers", ""], capsys)
    assert code == 2 and "--workers" in err, err


# ---- word2vec ---------------------------------------------------------------------------------


def _corpus(tmp_path: Path, tokens: int = 3000) -> Path:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(50)]
    p = tmp_path / "c.txt"
    p.write_text(" ".join(words[i] for i in rng.integers(0, 50, tokens)))
    return p


def _w2v(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "datasets.word2vec", *args, "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_word2vec_window_beyond_memory_is_refused_before_training(tmp_path):
    from datasets import word2vec
    from gadgetloader._errors import host_memory_bytes

    ram = host_memory_bytes(swap=False)
    if ram is None:
        pytest.skip("this OS does not say how much RAM it has")
    tokens = 3000
    # pairs of a chunk: tokens * min(window + 1, tokens - 1); make them need more than RAM
    window = 2**62
    need = tokens * (tokens - 1) * word2vec._PAIR_BYTES
    corpus = _corpus(tmp_path, tokens)
    if need <= ram:
        with pytest.raises(MemoryError, match="window"):
            word2vec._check_pair_memory(10**7, 10**9, 10**7)
        return
    r = _w2v(str(corpus), "--window", str(window))
    assert r.returncode == 1 and "--window" in r.stderr and "RAM" in r.stderr, r.stderr


def test_word2vec_pair_estimate_refuses_what_does_not_fit(monkeypatch):
    from datasets import word2vec
    from gadgetloader import _errors

    monkeypatch.setattr(_errors, "host_memory_bytes", lambda swap=True: 10**6)
    word2vec._check_pair_memory(1000, 5, 1 << 20)  # 6000 pairs: 288 kB
    with pytest.raises(MemoryError, match="window 50 makes about 51,000"):
        word2vec._check_pair_memory(1000, 50, 1 << 20)
    with pytest.raises(MemoryError, match="about 999,000"):  # at most tokens - 1 a center
        word2vec._check_pair_memory(1000, 2**62, 1 << 20)


def test_word2vec_unwritable_outputs_are_refused_before_training(tmp_path):
    corpus = _corpus(tmp_path)
    os.mkfifo(tmp_path / "a.vocab.txt")
    r = _w2v(str(corpus), "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    os.symlink(tmp_path / "missing" / "x", tmp_path / "b.npy")
    r = _w2v(str(corpus), "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "not a writable directory" in r.stderr, r.stderr
    assert not (tmp_path / "a.npy").exists() and not (tmp_path / "b.vocab.txt").exists()


def test_word2vec_failed_save_keeps_the_previous_pair(tmp_path, monkeypatch):
    from datasets import word2vec

    corpus = _corpus(tmp_path, 400)
    result = word2vec.train(corpus, dim=4, epochs=1, progress=False)
    prefix = tmp_path / "v"
    result.save(prefix)
    vectors = np.load(f"{prefix}.npy")
    words = Path(f"{prefix}.vocab.txt").read_text()
    assert vectors.shape == (len(result.vocab), 4)
    assert words.splitlines()[0].split()[0] == result.vocab.words[0]

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    result.vocab.words.reverse()  # a save that would change the word list
    result.model.u.table.fill_(1.0)  # and the vectors
    # the word list cannot be written, then the vectors cannot: either way nothing changes
    monkeypatch.setattr(word2vec, "open", refuse, raising=False)
    with pytest.raises(OSError, match="No space"):
        result.save(prefix)
    monkeypatch.undo()
    monkeypatch.setattr(type(result.model.u.table), "save", refuse)
    with pytest.raises(OSError, match="No space"):
        result.save(prefix)
    assert Path(f"{prefix}.vocab.txt").read_text() == words
    np.testing.assert_array_equal(np.load(f"{prefix}.npy"), vectors)
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "v.npy", "v.vocab.txt"]


# ---- HDF5 (a fourth review: HDF5 and .npy) -----------------------------------------------------

h5py = pytest.importorskip("h5py")


def _damage_h5_chunk(path: Path, coord: tuple[int, ...]) -> None:
    with h5py.File(path, "r") as f:
        info = f["x"].id.get_chunk_info_by_coord(coord)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * info.size)


def _h5_table(path: Path, shape, chunks) -> np.ndarray:
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=a, chunks=chunks, compression="gzip")
    return a


@pytest.mark.parametrize(
    "shape,chunks,bad",
    [((50, 6), (8, 6), (48, 0)), ((48, 6), (8, 4), (0, 4))],
    ids=["row-edge", "column-edge"],
)
def test_hdf5_damaged_edge_chunk_refused_before_anything_is_written(shape, chunks, bad, tmp_path):
    p = tmp_path / "t.h5"
    _h5_table(p, shape, chunks)
    _damage_h5_chunk(p, bad)
    before = p.read_bytes()
    g = gl.DataGadget(str(p), placement="file")
    with pytest.raises(gl.GadgetFileError):
        g.fill_(2.0)
    ids = [0, 1, 2, 3, 4, 5, 6, 7, shape[0] - 1]
    with pytest.raises(gl.GadgetFileError):
        g.insertData(np.zeros((len(ids), shape[1]), np.float32), ids)
    g.close()
    assert p.read_bytes() == before  # (compared once closed: an open file is marked so)


def test_hdf5_damaged_interior_chunk_is_replaced_by_an_initializer(tmp_path):
    p = tmp_path / "t.h5"
    _h5_table(p, (50, 6), (8, 6))
    _damage_h5_chunk(p, (8, 0))
    g = gl.DataGadget(str(p), placement="file")
    g.fill_(2.0)
    g.close()
    with h5py.File(p, "r") as f:
        assert (f["x"][:] == 2.0).all()


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_hdf5_external_link_to_a_named_pipe_is_an_error_not_a_hang(placement, tmp_path):
    main = tmp_path / "main.h5"
    with h5py.File(main, "w") as f:
        f["ext"] = h5py.ExternalLink("target.h5", "/x")
        f["g/soft"] = h5py.SoftLink("/ext")
        f["good"] = np.ones((3, 2), np.float32)
    os.mkfifo(tmp_path / "target.h5")
    for name in ("ext", "g/soft"):
        with pytest.raises(gl.GadgetFileError, match="not a regular file"):
            gl.DataGadget(str(main), dataset=name, placement=placement)
    with pytest.raises(gl.GadgetKeyError, match="'good'"):  # the listing skips the link
        gl.DataGadget(str(main), dataset="wrong", placement=placement)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_hdf5_external_raw_storage_in_a_named_pipe_says_so(placement, tmp_path):
    main = tmp_path / "main.h5"
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.ones((4, 2), np.float32).tobytes())
    with h5py.File(main, "w") as f:
        f.create_dataset("x", shape=(4, 2), dtype="f4", external=[("raw.bin", 0, 32)])
    raw.unlink()
    os.mkfifo(raw)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(gl.GadgetFileError, match="not a regular file"):
            gl.DataGadget(str(main), placement=placement)
    finally:
        os.chdir(cwd)


def test_hdf5_lossy_table_reads_what_the_file_stores_after_a_write(tmp_path):
    p = tmp_path / "so.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.zeros((8, 4), np.float32), chunks=(4, 4), scaleoffset=2)
    g = gl.DataGadget(str(p), placement="file")
    g.insertData(np.array([[1.23456, 2.34567, 3.45678, 4.56789]], np.float32), [0])
    seen = g.getData([0]).cpu().numpy()
    g.close()
    with h5py.File(p, "r") as f:
        stored = f["x"][0]
    np.testing.assert_array_equal(seen[0], stored)
    assert not np.allclose(stored, [1.23456, 2.34567, 3.45678, 4.56789], rtol=0, atol=1e-5)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_hdf5_damaged_metadata_is_a_gadget_error_naming_the_file(placement, tmp_path):
    p = tmp_path / "t.h5"
    with h5py.File(p, "w", libver="earliest") as f:
        f["x"] = np.ones((4, 2), np.float32)
    data = bytearray(p.read_bytes())
    at = data.find(b"HEAP")
    assert at > 0
    data[at : at + 4] = b"XXXX"
    p.write_bytes(bytes(data))
    with pytest.raises(gl.GadgetFileError, match=str(p)):
        gl.DataGadget(str(p), dataset="x", placement=placement)


# ---- a review of the fixes above -----------------------------------------------------------


def test_hdf5_external_link_through_another_file_to_a_named_pipe(tmp_path):
    with h5py.File(tmp_path / "mid.h5", "w") as f:
        f["g"] = h5py.ExternalLink("fifo.h5", "/g")
    os.mkfifo(tmp_path / "fifo.h5")
    with h5py.File(tmp_path / "main.h5", "w") as f:
        f["e"] = h5py.ExternalLink("mid.h5", "/g/x")
    with pytest.raises(gl.GadgetFileError, match="fifo.h5"):
        gl.DataGadget(str(tmp_path / "main.h5"), dataset="e", placement="cpu")
    with pytest.raises(gl.GadgetError):  # the listing skips it: no dataset left
        gl.DataGadget(str(tmp_path / "main.h5"), placement="cpu")


def test_hdf5_external_link_from_a_linked_file_looks_beside_the_link(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    with h5py.File(b / "main.h5", "w") as f:
        f["e"] = h5py.ExternalLink("data.h5", "/x")
    (a / "main.h5").symlink_to(b / "main.h5")
    with h5py.File(a / "data.h5", "w") as f:
        f["x"] = np.full((2, 2), 7.0, np.float32)
    os.mkfifo(b / "data.h5")  # HDF5 looks beside the path it opened (A), not here
    g = gl.DataGadget(str(a / "main.h5"), dataset="e", placement="cpu")
    assert (g.getData([0]).cpu().numpy() == 7.0).all()


def test_hdf5_damaged_full_chunk_of_a_column_edge_table_is_replaced(tmp_path):
    p = tmp_path / "t.h5"
    _h5_table(p, (40, 6), (4, 4))  # every row's last chunk is a column edge
    _damage_h5_chunk(p, (8, 0))  # a full chunk
    g = gl.DataGadget(str(p), placement="file")
    g.fill_(5.0)
    g.close()
    with h5py.File(p, "r") as f:
        assert (f["x"][:] == 5.0).all()


def test_hdf5_lossy_table_beside_another_writing_table_of_the_file(tmp_path):
    p = tmp_path / "two.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("a", data=np.zeros((8, 4), np.float32), chunks=(4, 4), compression="gzip")
        f.create_dataset("x", data=np.zeros((8, 4), np.float32), chunks=(4, 4), scaleoffset=2)
    a = gl.DataGadget(str(p), dataset="a", placement="file")
    a.insertData(np.ones((1, 4), np.float32), [0])
    x = gl.DataGadget(str(p), dataset="x", placement="file")
    x.insertData(np.array([[1.23456, 2.34567, 3.45678, 4.56789]], np.float32), [0])
    seen = x.getData([0]).cpu().numpy()[0]
    x.close()
    a.close()
    with h5py.File(p, "r") as f:
        np.testing.assert_array_equal(seen, f["x"][0])


def test_initializer_removes_only_the_damaged_column_shard(tmp_path, monkeypatch):
    from gadgetloader.io import _zarr as zarr_source
    from gadgetloader.stores import _file

    p = tmp_path / "t.zarr"
    a = (np.arange(40 * 8, dtype=np.float32).reshape(40, 8) + 1).copy()
    zarr.create_array(str(p), shape=a.shape, chunks=(5, 4), shards=(10, 4), dtype="f4")[:] = a
    (p / "c" / "1" / "0").write_bytes(b"garbage")  # rows 10:20, columns 0:4
    removed = []
    real_unlink = os.unlink

    def spy(path, *args, **kwargs):
        removed.append(os.path.relpath(path, p))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(zarr_source.os, "unlink", spy)
    monkeypatch.setattr(_file, "INIT_BLOCK_BYTES", 10 * 32)
    g = gl.DataGadget(str(p), placement="file")
    g.fill_(5.0)
    g.close()
    assert removed == [os.path.join("c", "1", "0")]
    assert (zarr.open_array(str(p), mode="r")[:] == 5.0).all()


@pytest.mark.parametrize("kind", ["zstd", "raw", "shard"])
def test_initializer_replaces_a_named_pipe_chunk(kind, tmp_path):
    p = tmp_path / "t.zarr"
    _zarr_table(p, kind)
    chunk = p / "c" / "1" / "0"
    chunk.unlink()
    os.mkfifo(chunk)
    g = gl.DataGadget(str(p), placement="file")
    g.fill_(5.0)
    g.close()
    assert chunk.is_file()
    assert (zarr.open_array(str(p), mode="r")[:] == 5.0).all()


@pytest.mark.parametrize("layout", ["chunked", "contiguous"])
def test_hdf5_rows_never_come_from_a_file_renamed_over_the_open_one(layout, tmp_path):
    from gadgetloader.io._hdf5 import Hdf5Source

    old = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    kw = {"chunks": (8, 4)} if layout == "chunked" else {}
    p = tmp_path / "t.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("emb", data=old, **kw)
    with h5py.File(tmp_path / "new.h5", "w") as f:
        f.create_dataset("emb", data=old + 1000, **kw)
    src = Hdf5Source(str(p), dataset="emb")
    try:
        src._dataset()  # the HDF5 handle is open on the old file
        os.replace(tmp_path / "new.h5", p)  # a save renames a new file into place
        for read in (
            lambda out: src.gather_rows(np.arange(64), out),  # the memory map's gather
            lambda out: src.read_into(0, 64, out),
        ):
            out = np.full_like(old, -1)
            try:
                done = read(out)
            except gl.GadgetFileError as exc:
                assert "replaced" in str(exc)
                continue
            if done is not False:  # (False: the map declined; nothing was read)
                np.testing.assert_array_equal(out, old)  # through the open handle: old rows
    finally:
        src.close()
