"""Black-box review (session 32) of ``placement='file'`` tables (.npy, HDF5, zarr) used for
reading AND writing: write-through, the chunk cache, flush/close, memory-mapped readers,
two tables of one file, refused writes, save() and gather_many/scatter_many; written from
README.md, SPEC.md and the public docstrings only.

Every table is checked against a NumPy model kept alongside, and after every write the
file itself is read back with plain NumPy / h5py / zarr (HDF5 datasets byte by byte from
the file, bypassing the HDF5 library's caches, and once per sequence in a fresh process).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


D = 8
CHUNK = 10  # rows per chunk of the chunked formats

KINDS = [
    "npy",
    "h5-contig",
    "h5-chunk",
    "h5-gzip",
    "h5-narrow",  # chunks of 3 columns: a row spans several chunks
    "zarr3",
    "zarr3-narrow",
    "zarr2",
    "zarr3-shard",
]


# --------------------------------------------------------------------------- helpers


def make_file(kind: str, tmp: Path, data: np.ndarray, chunk: int = CHUNK):
    """Write ``data`` in format ``kind``; return (path, DataGadget kwargs)."""
    n = data.shape[0]
    row = data.shape[1:]
    if kind == "npy":
        p = tmp / "t.npy"
        np.save(p, data)
        return p, {}
    if kind.startswith("h5"):
        p = tmp / "t.h5"
        kw: dict = {}
        if kind == "h5-chunk":
            kw = {"chunks": (chunk,) + row}
        elif kind == "h5-gzip":
            kw = {"chunks": (chunk,) + row, "compression": "gzip"}
        elif kind == "h5-narrow":
            kw = {"chunks": (7,) + tuple(min(3, s) for s in row)}
        with h5py.File(p, "w") as f:
            f.create_dataset("grp/emb", data=data, **kw)
            f.create_dataset("other", data=np.arange(12, dtype=np.int16))
        return p, {"dataset": "grp/emb"}
    p = tmp / "t.zarr"
    if kind == "zarr3":
        z = zarr.create_array(str(p), shape=data.shape, chunks=(chunk,) + row, dtype=data.dtype)
    elif kind == "zarr3-narrow":
        z = zarr.create_array(
            str(p), shape=data.shape, chunks=(9,) + tuple(min(3, s) for s in row), dtype=data.dtype
        )
    elif kind == "zarr2":
        z = zarr.create_array(
            str(p), shape=data.shape, chunks=(chunk,) + row, dtype=data.dtype, zarr_format=2
        )
    elif kind == "zarr3-shard":
        z = zarr.create_array(
            str(p), shape=data.shape, chunks=(5,) + row, shards=(20,) + row, dtype=data.dtype
        )
    else:  # pragma: no cover
        raise AssertionError(kind)
    z[...] = data
    assert n == z.shape[0]
    return p, {}


def _h5_raw(path: Path, name: str) -> np.ndarray:
    """The dataset's values read from the file's bytes (not through HDF5's caches)."""
    with h5py.File(path, "r") as f:
        d = f[name]
        shape, dtype, chunks = d.shape, d.dtype, d.chunks
        comp = d.compression
        if chunks is None:
            off = d.id.get_offset()
            infos = None
        else:
            infos = [d.id.get_chunk_info(i) for i in range(d.id.get_num_chunks())]
    out = np.empty(shape, dtype)
    with open(path, "rb") as fh:
        if infos is None:
            fh.seek(off)
            return np.frombuffer(fh.read(out.nbytes), dtype).reshape(shape).copy()
        covered = np.zeros(shape, bool)
        for info in infos:
            fh.seek(info.byte_offset)
            buf = fh.read(info.size)
            if comp == "gzip":
                buf = zlib.decompress(buf)
            else:
                assert comp is None
            blk = np.frombuffer(buf, dtype).reshape(chunks)
            sl = tuple(
                slice(o, min(o + c, s))
                for o, c, s in zip(info.chunk_offset, chunks, shape, strict=True)
            )
            out[sl] = blk[tuple(slice(0, s.stop - s.start) for s in sl)]
            covered[sl] = True
    assert covered.all(), "some chunks of the dataset are not allocated in the file"
    return out


def read_back(kind: str, path: Path) -> np.ndarray:
    if kind == "npy":
        return np.load(path)
    if kind.startswith("h5"):
        return _h5_raw(path, "grp/emb")
    return zarr.open_array(str(path), mode="r")[...]


_READER = r"""
import sys, numpy as np
kind, path, out = sys.argv[1:4]
if kind == "npy":
    a = np.load(path)
elif kind.startswith("h5"):
    import h5py
    with h5py.File(path, "r") as f:
        a = f["grp/emb"][...]
else:
    import zarr
    a = zarr.open_array(path, mode="r")[...]
np.save(out, a)
"""


def read_in_other_process(kind: str, path: Path, tmp: Path) -> np.ndarray:
    out = tmp / "other_process.npy"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HDF5_USE_FILE_LOCKING="FALSE")
    subprocess.run(
        [sys.executable, "-c", _READER, kind, str(path), str(out)],
        check=True,
        env=env,
        timeout=60,
        capture_output=True,
    )
    return np.load(out)


def digest(path: Path) -> str:
    """Hash of the file (or of every file of a directory store, with names)."""
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(path.rglob("*")):
            if f.is_file():
                h.update(str(f.relative_to(path)).encode())
                h.update(f.read_bytes())
    else:
        data = bytearray(path.read_bytes())
        if data[:8] == b"\x89HDF\r\n\x1a\n":
            # HDF5 itself sets the superblock's "open for writing" flags while a handle
            # has the file open to write (and clears them on close): bookkeeping, not data.
            flags = slice(20, 24) if data[8] in (0, 1) else slice(11, 12)
            data[flags] = bytes(flags.stop - flags.start)
        h.update(bytes(data))
    return h.hexdigest()


def seq_assign(model: np.ndarray, ids, rows: np.ndarray, cols=None) -> None:
    """NumPy's sequential assignment: the last occurrence of an id wins."""
    flat = np.asarray(ids).reshape(-1)
    rows = np.asarray(rows).reshape((flat.size,) + rows.shape[np.asarray(ids).ndim :])
    for i, r in zip(flat, rows, strict=True):
        if cols is None:
            model[i] = r
        else:
            model[(i,) + cols] = r


def as_np(t) -> np.ndarray:
    assert isinstance(t, torch.Tensor)
    return t.cpu().numpy()


def ids_as(kind_idx: int, ids: np.ndarray):
    k = kind_idx % 5
    if k == 0:
        return torch.from_numpy(ids.astype(np.int64))
    if k == 1:
        return ids.astype(np.int32)
    if k == 2:
        return ids.tolist()
    if k == 3:
        return torch.from_numpy(ids.astype(np.int16))
    return ids.astype(np.uint8)


def open_file(path: Path, kw: dict, **opts) -> gl.DataGadget:
    return gl.DataGadget(str(path), placement="file", **kw, **opts)


# --------------------------------------------------------------------------- random sequences


def _random_ids(rng, n, size=None):
    size = size or int(rng.integers(1, 40))
    ids = rng.integers(0, n, size)
    if size > 2:  # force repeats
        ids[rng.integers(0, size, 3)] = ids[0]
    return ids


SEQ_CASES = [
    (k, n)
    for k in KINDS
    for n in (100, 103)
    if not (n == 100 and k in ("zarr3-narrow", "zarr3-shard"))
]


@pytest.mark.parametrize("kind, n_rows", SEQ_CASES)
def test_random_sequence_writer_and_reader(kind, n_rows, tmp_path):
    """A long random sequence of reads and writes through two tables of one file, with
    caches small enough to evict; the file read back after every write equals the model."""
    rng = np.random.default_rng(KINDS.index(kind) * 1000 + n_rows)
    model = rng.standard_normal((n_rows, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    block = CHUNK * D * 4
    caches = (2 * block + 4, 3 * block)
    a = open_file(path, kw, cache_bytes=caches[0])
    b = open_file(path, kw, cache_bytes=caches[1])
    tables = (a, b)
    for step in range(36):
        t = tables[int(rng.integers(0, 2))]
        op = int(rng.integers(0, 11))
        wrote = True
        if op == 0:  # insertData with repeated ids
            ids = _random_ids(rng, n_rows)
            rows = rng.standard_normal((ids.size, D)).astype(np.float32)
            t.insertData(torch.from_numpy(rows), ids_as(step, ids))
            seq_assign(model, ids, rows)
        elif op == 1:  # g[ids] = rows, 2-D ids, numpy data
            ids = _random_ids(rng, n_rows, 12).reshape(3, 4)
            rows = rng.standard_normal((3, 4, D)).astype(np.float32)
            t[torch.from_numpy(ids)] = rows
            seq_assign(model, ids, rows)
        elif op == 2:  # a slice of rows
            lo = int(rng.integers(0, n_rows))
            hi = int(rng.integers(lo, n_rows + 5))
            rows = rng.standard_normal(model[lo:hi].shape).astype(np.float32)
            t[lo:hi] = torch.from_numpy(rows)
            model[lo:hi] = rows
        elif op == 3:  # part of each row, repeated ids
            ids = _random_ids(rng, n_rows, 9)
            c0 = int(rng.integers(0, D - 1))
            c1 = int(rng.integers(c0 + 1, D + 1))
            part = rng.standard_normal((ids.size, c1 - c0)).astype(np.float32)
            t[ids.tolist(), c0:c1] = torch.from_numpy(part)
            seq_assign(model, ids, part, (slice(c0, c1),))
        elif op == 4:  # one element of each row
            ids = _random_ids(rng, n_rows, 6)
            col = int(rng.integers(0, D))
            vals = rng.standard_normal(ids.size).astype(np.float32)
            t[ids.tolist(), col] = torch.from_numpy(vals)
            seq_assign(model, ids, vals, (col,))
        elif op == 5 and step % 3 == 0:
            v = float(np.float32(rng.standard_normal()))
            assert t.fill_(v) is t
            model[...] = v
        elif op == 6 and step % 4 == 0:
            assert t.zero_() is t
            model[...] = 0
        elif op == 7 and step % 3 == 0:
            gen = torch.Generator().manual_seed(step)
            t.uniform_(-0.5, 0.25, generator=gen)
            got = read_back(kind, path)
            assert got.min() >= -0.5 and got.max() <= 0.25
            assert got.std() > 0.1  # not constant
            model[...] = got
        elif op == 8:  # a batch with one bad id: refused, nothing written
            ids = _random_ids(rng, n_rows, 10)
            ids[int(rng.integers(0, 10))] = n_rows + int(rng.integers(0, 3))
            before = digest(path)
            with pytest.raises(gl.GadgetIndexError):
                t.insertData(torch.ones(10, D), ids)
            assert digest(path) == before
        elif op == 9:  # wrong dtype: refused, nothing written
            ids = _random_ids(rng, n_rows, 5)
            before = digest(path)
            with pytest.raises(gl.GadgetTypeError):
                t.insertData(torch.ones(5, D, dtype=torch.float64), ids)
            with pytest.raises(gl.GadgetTypeError):
                t[ids] = np.ones((5, D), np.int32)
            assert digest(path) == before
        else:
            wrote = False
        if wrote:
            np.testing.assert_array_equal(
                read_back(kind, path), model, err_msg=f"step {step} op {op}"
            )
        # both tables read the model, through their (small) caches
        for u, cap in zip(tables, caches, strict=True):
            ids = _random_ids(rng, n_rows)
            np.testing.assert_array_equal(as_np(u.getData(ids_as(step + 1, ids))), model[ids])
            lo = int(rng.integers(0, n_rows))
            np.testing.assert_array_equal(as_np(u[lo : lo + 25]), model[lo : lo + 25])
            assert u.store.cached_bytes <= cap
    np.testing.assert_array_equal(a.getNumpyVersion(), model)
    np.testing.assert_array_equal(np.asarray(b), model)
    a.flush()
    b.flush()
    np.testing.assert_array_equal(read_in_other_process(kind, path, tmp_path), model)
    a.close()
    b.close()
    np.testing.assert_array_equal(read_back(kind, path), model)
    if kind.startswith("h5"):
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(f["other"][...], np.arange(12, dtype=np.int16))
            np.testing.assert_array_equal(f["grp/emb"][...], model)


@pytest.mark.parametrize("cache", [0, 1, 4 << 10, None])
@pytest.mark.parametrize("kind", ["npy", "h5-narrow", "zarr3"])
def test_cache_sizes_exact(kind, cache, tmp_path):
    """cache_bytes from 0 (off) to the default: reads and writes stay exact."""
    rng = np.random.default_rng(7)
    n = 137
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    opts = {} if cache is None else {"cache_bytes": cache}
    g = open_file(path, kw, **opts)
    for _ in range(10):
        ids = rng.integers(0, n, 50)  # spans most chunks
        np.testing.assert_array_equal(as_np(g.getData(ids)), model[ids])
        w = rng.integers(0, n, 30)
        rows = rng.standard_normal((30, D)).astype(np.float32)
        g.insertData(rows, w)
        seq_assign(model, w, rows)
        np.testing.assert_array_equal(as_np(g.getData(ids)), model[ids])
        if cache is not None:
            assert g.store.cached_bytes <= cache
    np.testing.assert_array_equal(read_back(kind, path), model)
    g.close()


# --------------------------------------------------------------------------- visibility


@pytest.mark.parametrize("reader_writable", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_second_table_sees_writes_immediately(kind, reader_writable, tmp_path):
    """README: several file tables of one file in one process see each other's writes
    (each drops its cached blocks when another writes); a read-only .npy / uncompressed
    HDF5 table reads through a memory map."""
    rng = np.random.default_rng(3)
    n = 103
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    w = open_file(path, kw, cache_bytes=1 << 20)
    r = open_file(path, kw, cache_bytes=1 << 20, writable=reader_writable)
    every = np.arange(n)
    np.testing.assert_array_equal(as_np(r.getData(every)), model)  # fill r's cache
    np.testing.assert_array_equal(as_np(r.getData(every)), model)
    for k in range(5):
        ids = rng.integers(0, n, 20)
        rows = rng.standard_normal((20, D)).astype(np.float32)
        w.insertData(torch.from_numpy(rows), ids)
        seq_assign(model, ids, rows)
        np.testing.assert_array_equal(as_np(r.getData(every)), model, err_msg=f"round {k}")
        np.testing.assert_array_equal(as_np(r[ids]), model[ids])
    w.fill_(2.5)
    model[...] = 2.5
    np.testing.assert_array_equal(r.getNumpyVersion(), model)
    w.close()
    np.testing.assert_array_equal(as_np(r.getData(every)), model)
    r.close()


@pytest.mark.parametrize("kind", ["npy", "h5-contig", "h5-chunk", "zarr3"])
def test_writer_sees_writes_of_readonly_opened_later(kind, tmp_path):
    """A writable table's cache does not go stale when another table of the file writes."""
    rng = np.random.default_rng(4)
    model = rng.standard_normal((60, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    a = open_file(path, kw, cache_bytes=1 << 20)
    b = open_file(path, kw, cache_bytes=1 << 20)
    np.testing.assert_array_equal(as_np(a[0:60]), model)
    np.testing.assert_array_equal(as_np(b[0:60]), model)
    b[5:15] = torch.zeros(10, D)
    model[5:15] = 0
    a[[7, 30]] = torch.ones(2, D)
    model[[7, 30]] = 1
    for t in (a, b):
        np.testing.assert_array_equal(t.getNumpyVersion(), model)
    np.testing.assert_array_equal(read_back(kind, path), model)
    a.close()
    b.close()


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_tables_under_two_names_see_each_others_writes(link, tmp_path):
    """README: one lock for the file under any name, hard links included; tables of one
    file see each other's writes."""
    rng = np.random.default_rng(5)
    model = rng.standard_normal((50, D)).astype(np.float32)
    path, kw = make_file("npy", tmp_path, model)
    other = tmp_path / "alias.npy"
    if link == "symlink":
        other.symlink_to(path)
    else:
        os.link(path, other)
    a = open_file(path, kw, cache_bytes=1 << 20)
    b = open_file(other, kw, cache_bytes=1 << 20)
    np.testing.assert_array_equal(as_np(b[0:50]), model)
    a[[1, 2, 1]] = torch.from_numpy(np.stack([model[9], model[8], model[7]]))
    model[1] = model[7]
    model[2] = model[8]
    np.testing.assert_array_equal(as_np(b[0:50]), model)
    a.close()
    b.close()


# --------------------------------------------------------------------------- refused writes


BAD_WRITES = {
    "id-past-end": lambda g, n: g.insertData(torch.ones(4, D), [0, 11, n, 3]),
    "negative-id": lambda g, n: g.insertData(torch.ones(3, D), torch.tensor([5, -1, 6])),
    "float-ids": lambda g, n: g.insertData(torch.ones(2, D), torch.tensor([1.0, 2.0])),
    "bool-ids": lambda g, n: g.insertData(torch.ones(2, D), torch.tensor([True, False])),
    "float64-data": lambda g, n: g.insertData(torch.ones(2, D, dtype=torch.float64), [1, 2]),
    "int-data": lambda g, n: g.insertData(np.ones((2, D), np.int32), [1, 2]),
    "short-data": lambda g, n: g.insertData(torch.ones(1, D), [1, 2]),
    "scalar-data": lambda g, n: g.insertData(1.0, [1, 2]),
    "broadcast-row": lambda g, n: g.__setitem__([1, 2, 3], torch.ones(D)),
    "slice-wrong-len": lambda g, n: g.__setitem__(slice(0, 10), torch.ones(9, D)),
    "part-wrong-width": lambda g, n: g.__setitem__(([1, 40], slice(0, 3)), torch.ones(2, 4)),
    "part-bad-id": lambda g, n: g.__setitem__(([1, n + 5], slice(0, 3)), torch.ones(2, 3)),
    "part-int-bad-id": lambda g, n: g.__setitem__(([3, 4, n], 2), torch.ones(3)),
    "fill-string": lambda g, n: g.fill_("1"),
    "fill-overflow": lambda g, n: g.fill_(1e39),
    "uniform-reversed": lambda g, n: g.uniform_(1.0, 0.0),
    "uniform-inf": lambda g, n: g.uniform_(0.0, float("inf")),
    "normal-neg-std": lambda g, n: g.normal_(0.0, -1.0),
    "init-xavier": lambda g, n: g.init_(torch.nn.init.xavier_uniform_),
    "init-orthogonal": lambda g, n: g.init_(torch.nn.init.orthogonal_),
}

ERRTYPES = {
    "id-past-end": gl.GadgetIndexError,
    "negative-id": gl.GadgetIndexError,
    "float-ids": gl.GadgetTypeError,
    "bool-ids": gl.GadgetTypeError,
    "float64-data": gl.GadgetTypeError,
    "int-data": gl.GadgetTypeError,
    "short-data": gl.GadgetValueError,
    "scalar-data": gl.GadgetError,
    "broadcast-row": gl.GadgetValueError,
    "slice-wrong-len": gl.GadgetValueError,
    "part-wrong-width": gl.GadgetValueError,
    "part-bad-id": gl.GadgetIndexError,
    "part-int-bad-id": gl.GadgetIndexError,
    "fill-string": gl.GadgetError,
    "fill-overflow": gl.GadgetError,
    "uniform-reversed": gl.GadgetError,
    "uniform-inf": gl.GadgetError,
    "normal-neg-std": gl.GadgetError,
    "init-xavier": gl.GadgetTypeError,
    "init-orthogonal": gl.GadgetTypeError,
}


@pytest.mark.parametrize("bad", sorted(BAD_WRITES))
def test_refused_write_leaves_file_and_cache_unchanged(bad, tmp_path):
    for kind in ("npy", "h5-gzip", "h5-narrow", "zarr3-shard"):
        d = tmp_path / kind
        d.mkdir()
        _refused_write_case(kind, bad, d)


def _refused_write_case(kind, bad, tmp_path):
    rng = np.random.default_rng(11)
    n = 83
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=3 * CHUNK * D * 4)
    other = open_file(path, kw, cache_bytes=1 << 20)
    np.testing.assert_array_equal(as_np(g[0:n]), model)  # warm both caches
    np.testing.assert_array_equal(as_np(other[0:n]), model)
    before = digest(path)
    with pytest.raises(ERRTYPES[bad]):
        BAD_WRITES[bad](g, n)
    assert digest(path) == before, kind
    np.testing.assert_array_equal(g.getNumpyVersion(), model, err_msg=kind)
    np.testing.assert_array_equal(as_np(g.getData(np.arange(n)[::-1].copy())), model[::-1])
    np.testing.assert_array_equal(other.getNumpyVersion(), model)
    # and the table still writes correctly afterwards
    g[[0, n - 1, 0]] = torch.from_numpy(np.stack([model[5], model[6], model[7]]))
    model[0] = model[7]
    model[n - 1] = model[6]
    np.testing.assert_array_equal(read_back(kind, path), model, err_msg=kind)
    g.close()
    other.close()


@pytest.mark.parametrize("kind", ["npy", "h5-contig", "h5-chunk", "zarr3"])
def test_readonly_table_refuses_every_write(kind, tmp_path):
    model = np.arange(40 * D, dtype=np.float32).reshape(40, D)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, writable=False)
    before = digest(path)
    calls = [
        lambda: g.insertData(torch.ones(1, D), [0]),
        lambda: g.__setitem__(slice(0, 2), torch.ones(2, D)),
        lambda: g.__setitem__(([1], slice(0, 2)), torch.ones(1, 2)),
        lambda: g.fill_(1.0),
        lambda: g.zero_(),
        lambda: g.uniform_(0.0, 1.0),
        lambda: g.normal_(),
        lambda: g.init_(torch.nn.init.zeros_),
        lambda: gl.scatter_many([g], [torch.ones(1, D)], [0]),
    ]
    for c in calls:
        with pytest.raises(gl.ReadOnlyError):
            c()
    assert digest(path) == before
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    g.close()


@pytest.mark.parametrize("value", [1, "yes", "False", 0, 2.0])
def test_writable_option_takes_only_bools(value, tmp_path):
    """README: ``writable=`` takes only True, False (NumPy's bools too) or None."""
    path, kw = make_file("npy", tmp_path, np.zeros((5, D), np.float32))
    with pytest.raises(gl.GadgetTypeError):
        open_file(path, kw, writable=value)


def test_writable_numpy_bool(tmp_path):
    path, kw = make_file("npy", tmp_path, np.zeros((5, D), np.float32))
    g = open_file(path, kw, writable=np.bool_(False))
    with pytest.raises(gl.ReadOnlyError):
        g[0] = torch.ones(D)
    g.close()
    g = open_file(path, kw, writable=np.bool_(True))
    g[0] = torch.ones(D)
    g.close()
    np.testing.assert_array_equal(np.load(path)[0], np.ones(D, np.float32))


def test_fortran_npy_is_read_only(tmp_path):
    """README: read-only sources raise ReadOnlyError saying why, e.g. a Fortran-ordered .npy."""
    a = np.asfortranarray(np.arange(30, dtype=np.float32).reshape(10, 3))
    p = tmp_path / "f.npy"
    np.save(p, a)
    g = gl.DataGadget(str(p), placement="file")
    np.testing.assert_array_equal(as_np(g.getData([9, 0, 9])), a[[9, 0, 9]])
    before = digest(p)
    with pytest.raises(gl.ReadOnlyError, match="(?i)fortran"):
        g.insertData(torch.ones(1, 3), [0])
    assert digest(p) == before
    g.close()
    with pytest.raises(gl.ReadOnlyError):
        gl.DataGadget(str(p), placement="file", writable=True)


# --------------------------------------------------------------------------- damaged chunks


@pytest.mark.parametrize("via", ["insertData", "partial", "scatter_many"])
@pytest.mark.parametrize("kind", ["zarr3", "zarr3-shard"])
def test_damaged_zarr_chunk_write_refused_before_any_write(kind, via, tmp_path):
    """README: a write reads every chunk (or zarr shard) it partly rewrites before its
    first write, so a damaged chunk raises GadgetFileError and leaves the file unchanged;
    scatter_many: a damaged chunk raises GadgetFileError naming the table, with no table
    changed."""
    rng = np.random.default_rng(8)
    model = rng.standard_normal((100, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    key = path / "c" / str(55 // (CHUNK if kind == "zarr3" else 20)) / "0"
    assert key.is_file(), sorted(str(q.relative_to(path)) for q in path.rglob("*"))
    key.write_bytes(b"\x00garbage" * 3)
    g = open_file(path, kw, cache_bytes=0)
    d2 = tmp_path / "second"
    d2.mkdir()
    p2, kw2 = make_file("npy", d2, model)
    before = digest(path), digest(p2)
    ids = [1, 2, 95, 55]  # row 55's chunk (shard) is damaged, the others are fine
    with pytest.raises(gl.GadgetFileError) as ei:
        if via == "insertData":
            g.insertData(torch.ones(4, D), ids)
        elif via == "partial":
            g[ids, 0:2] = torch.ones(4, 2)
        else:
            h = gl.DataGadget(np.zeros((100, D), np.float32), placement="cpu")
            f2 = open_file(p2, kw2)
            try:
                gl.scatter_many([h, f2, g], [torch.ones(4, D)] * 3, ids)
            finally:
                np.testing.assert_array_equal(h.getNumpyVersion(), 0)
                np.testing.assert_array_equal(f2.getNumpyVersion(), model)
                f2.close()
    if via == "scatter_many":
        assert "t.zarr" in str(ei.value)
    assert (digest(path), digest(p2)) == before
    good = [0, 1, 2, 3, 90, 95, 99] if kind == "zarr3" else [0, 1, 2, 3, 95, 99]
    np.testing.assert_array_equal(as_np(g.getData(good)), model[good])
    with pytest.raises(gl.GadgetFileError):
        g.getData([55])
    g.close()


def test_damaged_h5_gzip_chunk_write_refused(tmp_path):
    rng = np.random.default_rng(9)
    model = rng.standard_normal((100, D)).astype(np.float32)
    path, kw = make_file("h5-gzip", tmp_path, model)
    with h5py.File(path, "r") as f:
        info = f["grp/emb"].id.get_chunk_info_by_coord((50, 0))
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * min(16, info.size))
    g = open_file(path, kw, cache_bytes=0)
    before = digest(path)
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.ones(3, D), [0, 55, 99])
    assert digest(path) == before
    np.testing.assert_array_equal(as_np(g.getData([0, 99])), model[[0, 99]])
    g.close()


# --------------------------------------------------------------------------- initialisers


@pytest.mark.parametrize("kind", ["npy", "h5-gzip", "h5-narrow", "zarr3-narrow", "zarr2"])
def test_initialisers_reach_the_file(kind, tmp_path):
    n = 203
    model = np.zeros((n, D), np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=2 * CHUNK * D * 4)
    g.fill_(torch.tensor([1.5]))
    np.testing.assert_array_equal(read_back(kind, path), np.full((n, D), 1.5, np.float32))
    g.fill_(np.array(-3.0))
    np.testing.assert_array_equal(read_back(kind, path), np.full((n, D), -3.0, np.float32))
    g.fill_(float("nan"))
    assert np.isnan(read_back(kind, path)).all()
    g.zero_()
    np.testing.assert_array_equal(read_back(kind, path), 0)
    g.uniform_(2.0, 3.0, generator=torch.Generator().manual_seed(0))
    u = read_back(kind, path)
    assert u.min() >= 2.0 and u.max() <= 3.0
    assert abs(u.mean() - 2.5) < 0.05 and abs(u.std() - (1 / 12) ** 0.5) < 0.03
    assert len(np.unique(u)) > 0.9 * u.size  # no block repeats another block's numbers
    np.testing.assert_array_equal(g.getNumpyVersion(), u)
    g.normal_(10.0, 2.0, generator=torch.Generator().manual_seed(1))
    v = read_back(kind, path)
    assert abs(v.mean() - 10.0) < 0.2 and abs(v.std() - 2.0) < 0.15
    assert len(np.unique(v)) > 0.9 * v.size
    np.testing.assert_array_equal(as_np(g.getData(np.arange(n))), v)
    g.init_(torch.nn.init.constant_, 0.75)
    np.testing.assert_array_equal(read_back(kind, path), 0.75)
    g.init_(torch.nn.init.uniform_, -1.0, -0.5)
    w = read_back(kind, path)
    assert w.min() >= -1.0 and w.max() <= -0.5 and w.std() > 0.1
    g.close()
    np.testing.assert_array_equal(read_back(kind, path), w)


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_seeded_initialiser_is_reproducible_on_file(kind, tmp_path):
    """The same generator seed on two file tables of equal shape gives equal tables."""
    out = []
    for k in range(2):
        d = tmp_path / str(k)
        d.mkdir()
        path, kw = make_file(kind, d, np.zeros((97, D), np.float32))
        g = open_file(path, kw, cache_bytes=CHUNK * D * 4)
        g.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(42))
        g.close()
        out.append(read_back(kind, path))
    np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_int_table_fill_out_of_range_unchanged(kind, tmp_path):
    model = np.arange(50 * 4, dtype=np.int16).reshape(50, 4)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw)
    before = digest(path)
    for bad in (2**15, -(2**15) - 1, 1.5, float("nan")):
        with pytest.raises(gl.GadgetError):
            g.fill_(bad)
    with pytest.raises(gl.GadgetError):
        g.uniform_(0.0, 1.0)
    assert digest(path) == before
    g.fill_(3.0)  # an integral float is fine
    np.testing.assert_array_equal(read_back(kind, path), np.full((50, 4), 3, np.int16))
    g.fill_(-(2**15))
    np.testing.assert_array_equal(read_back(kind, path), np.full((50, 4), -(2**15), np.int16))
    g.close()


# --------------------------------------------------------------------------- dtypes / row shapes


DTYPES = ["float16", "float64", "int8", "int32", "int64", "uint8", "bool"]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_dtypes_write_through_exact(kind, dt, tmp_path):
    rng = np.random.default_rng(DTYPES.index(dt))
    n = 71
    if dt == "bool":
        model = rng.integers(0, 2, (n, 5)).astype(bool)
    elif dt.startswith("float"):
        model = rng.standard_normal((n, 5)).astype(dt)
    else:
        info = np.iinfo(dt)
        model = rng.integers(info.min, info.max, (n, 5), endpoint=True, dtype=dt)
    path, kw = make_file(kind, tmp_path, model, chunk=8)
    g = open_file(path, kw, cache_bytes=2 * 8 * 5 * model.itemsize)
    assert g.dtype == torch.from_numpy(model[:1]).dtype
    for _ in range(6):
        ids = rng.integers(0, n, 25)
        np.testing.assert_array_equal(as_np(g.getData(ids)), model[ids])
        rows = model[rng.integers(0, n, 25)][:, ::-1].copy()
        g[ids] = torch.from_numpy(rows)
        seq_assign(model, ids, rows)
        np.testing.assert_array_equal(read_back(kind, path), model)
        wrong = torch.zeros((25, 5), dtype=torch.float32 if dt != "float32" else torch.float64)
        with pytest.raises(gl.GadgetTypeError):
            g[ids] = wrong
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "h5-narrow", "zarr3", "zarr3-narrow"])
def test_multidim_rows(kind, tmp_path):
    """Rows of shape (3, 4): ids.shape + row_shape; parts index into the row."""
    rng = np.random.default_rng(12)
    n = 45
    model = rng.standard_normal((n, 3, 4)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model, chunk=7)
    g = open_file(path, kw, cache_bytes=7 * 48 + 1)
    assert tuple(g.shape) == (n, 3, 4)
    ids = np.array([[1, 44, 1], [20, 21, 22]])
    np.testing.assert_array_equal(as_np(g[torch.from_numpy(ids)]), model[ids])
    rows = rng.standard_normal((2, 3, 3, 4)).astype(np.float32)
    g.insertData(torch.from_numpy(rows), torch.from_numpy(ids))
    seq_assign(model, ids, rows)
    np.testing.assert_array_equal(read_back(kind, path), model)
    part = rng.standard_normal((3, 3, 2)).astype(np.float32)
    g[[5, 6, 5], slice(0, 3), slice(1, 3)] = torch.from_numpy(part)
    seq_assign(model, [5, 6, 5], part, (slice(0, 3), slice(1, 3)))
    np.testing.assert_array_equal(read_back(kind, path), model)
    np.testing.assert_array_equal(as_np(g[[5, 6], 1, 2]), model[[5, 6], 1, 2])
    np.testing.assert_array_equal(as_np(g[0:40:3, 2]), model[0:40:3, 2])
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_slices_with_steps_and_negative_bounds(kind, tmp_path):
    rng = np.random.default_rng(13)
    n = 64
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=0)
    for sl in [
        slice(None, None, 7),
        slice(-5, None),
        slice(3, -3, 4),
        slice(60, 100),
        slice(10, 5),
    ]:
        np.testing.assert_array_equal(as_np(g[sl]), model[sl])
        rows = rng.standard_normal(model[sl].shape).astype(np.float32)
        g[sl] = torch.from_numpy(rows)
        model[sl] = rows
        np.testing.assert_array_equal(read_back(kind, path), model, err_msg=str(sl))
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_block_rows_option(kind, tmp_path):
    """block_rows (rows per read) that divides nothing: results stay exact."""
    rng = np.random.default_rng(14)
    n = 101
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, block_rows=7, cache_bytes=2 * 7 * D * 4)
    for _ in range(10):
        ids = rng.integers(0, n, 33)
        rows = rng.standard_normal((33, D)).astype(np.float32)
        g.insertData(rows, ids)
        seq_assign(model, ids, rows)
        np.testing.assert_array_equal(as_np(g.getData(ids[::-1].copy())), model[ids[::-1]])
    np.testing.assert_array_equal(read_back(kind, path), model)
    g.close()


@pytest.mark.parametrize(
    "kind, blocks", [("zarr3", 3), ("zarr2", 3), ("h5-gzip", 3), ("zarr3-shard", 4)]
)
def test_chunk_reads_once_per_call_and_write_through_cache(kind, blocks, tmp_path):
    """README: getData reads only the chunks holding those ids (each once per call)
    through an LRU chunk cache; FileStore: ``stats`` counts cache hits, misses and reads,
    and a write goes through the store's cache as well."""
    model = np.arange(100 * D, dtype=np.float32).reshape(100, D)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=1 << 20)
    s0 = dict(g.store.stats)
    # chunks of 10 rows: 0, 5, 9; zarr3-shard's inner chunks of 5 rows: 0, 50, 55, 95
    ids = [3, 4, 3, 57, 51, 3, 99, 58]
    np.testing.assert_array_equal(as_np(g.getData(ids)), model[ids])
    s1 = dict(g.store.stats)
    assert s1["misses"] - s0["misses"] == blocks
    np.testing.assert_array_equal(as_np(g.getData(ids)), model[ids])
    s2 = dict(g.store.stats)
    assert s2["misses"] == s1["misses"]
    assert s2["hits"] - s1["hits"] == blocks
    g.insertData(torch.ones(1, D), [52])
    model[52] = 1
    np.testing.assert_array_equal(as_np(g.getData(ids + [52])), model[ids + [52]])
    assert g.store.stats["misses"] == s2["misses"]
    np.testing.assert_array_equal(read_back(kind, path), model)
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-narrow", "zarr3-narrow", "h5-gzip"])
def test_row_slices_of_every_shape(kind, tmp_path):
    """README: slices into the row take integer bounds (any size, clipped as Python clips
    them) and a positive step; insertData with such an index writes only that part."""
    rng = np.random.default_rng(24)
    model = rng.standard_normal((50, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=100)
    for cols in [
        slice(None, None, 2),
        slice(0, 100),
        slice(-3, None),
        slice(-100, 2),
        slice(5, 2),
        slice(1, -1, 3),
    ]:
        for ids in [np.array([[1, 2], [2, 40]]), torch.tensor([3, 3, 49]), slice(10, 20)]:
            idn = ids.numpy() if isinstance(ids, torch.Tensor) else ids
            lead = 1 if isinstance(idn, slice) else idn.ndim
            want = model[idn][(slice(None),) * lead + (cols,)]
            np.testing.assert_array_equal(as_np(g[ids, cols]), want)
            data = rng.standard_normal(want.shape).astype(np.float32)
            g[ids, cols] = torch.from_numpy(data)
            if isinstance(idn, slice):
                model[idn, cols] = data
            else:
                seq_assign(model, idn, data, (cols,))
            np.testing.assert_array_equal(read_back(kind, path), model, err_msg=f"{ids} {cols}")
    g.close()


# --------------------------------------------------------------------------- flush / close


@pytest.mark.parametrize("kind", KINDS)
def test_close_flushes_and_then_refuses(kind, tmp_path):
    rng = np.random.default_rng(15)
    model = rng.standard_normal((30, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw)
    rows = rng.standard_normal((4, D)).astype(np.float32)
    g[[29, 0, 29, 12]] = rows
    seq_assign(model, [29, 0, 29, 12], rows)
    g.flush()
    np.testing.assert_array_equal(read_back(kind, path), model)
    g[3] = torch.from_numpy(rows[0])
    model[3] = rows[0]
    g.close()
    g.close()  # idempotent
    np.testing.assert_array_equal(read_back(kind, path), model)
    assert len(g) == 30 and tuple(g.shape) == (30, D) and g.dtype == torch.float32
    assert "file" in repr(g)
    for c in (
        lambda: g.getData([0]),
        lambda: g.insertData(torch.ones(1, D), [0]),
        lambda: g[0],
        lambda: g.flush(),
        lambda: g.fill_(0.0),
        lambda: g.getNumpyVersion(),
        lambda: g.save(str(tmp_path / "x.npy")),
        lambda: gl.gather_many([g], [0]),
    ):
        with pytest.raises(gl.GadgetClosedError):
            c()
    np.testing.assert_array_equal(read_back(kind, path), model)


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_with_block_closes_and_writes_persist(kind, tmp_path):
    model = np.zeros((20, D), np.float32)
    path, kw = make_file(kind, tmp_path, model)
    with open_file(path, kw) as g:
        g[5:7] = torch.full((2, D), 4.0)
    model[5:7] = 4.0
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    np.testing.assert_array_equal(read_back(kind, path), model)
    with open_file(path, kw) as g2:
        np.testing.assert_array_equal(g2.getNumpyVersion(), model)


def test_h5_write_visible_to_another_process_without_flush(tmp_path):
    """README: each write reaches the file before it returns (an HDF5 write flushes HDF5's
    caches)."""
    model = np.zeros((40, D), np.float32)
    path, kw = make_file("h5-gzip", tmp_path, model)
    g = open_file(path, kw)
    g[[3, 39]] = torch.ones(2, D)
    model[[3, 39]] = 1
    np.testing.assert_array_equal(read_in_other_process("h5-gzip", path, tmp_path), model)
    g.close()


# --------------------------------------------------------------------------- save


@pytest.mark.parametrize("target", ["t2.npy", "t2.h5", "t2.zarr"])
@pytest.mark.parametrize("kind", ["npy", "h5-gzip", "zarr3-shard"])
def test_save_file_table_to_new_path(kind, target, tmp_path):
    rng = np.random.default_rng(16)
    n = 57
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=CHUNK * D * 4)
    rows = rng.standard_normal((5, D)).astype(np.float32)
    g[[1, 50, 1, 2, 3]] = rows
    seq_assign(model, [1, 50, 1, 2, 3], rows)
    out = tmp_path / "out" / target
    out.parent.mkdir()
    g.save(str(out), chunk_rows=6) if not target.endswith(".npy") else g.save(str(out))
    if target.endswith(".npy"):
        saved = np.load(out)
    elif target.endswith(".h5"):
        with h5py.File(out, "r") as f:
            assert list(f.keys()) == ["data"]
            saved = f["data"][...]
    else:
        saved = zarr.open_array(str(out), mode="r")[...]
    np.testing.assert_array_equal(saved, model)
    # the table stays on its own file: later writes do not reach the copy
    saved_digest = digest(out)
    g[0] = torch.zeros(D)
    model[0] = 0
    assert digest(out) == saved_digest
    np.testing.assert_array_equal(read_back(kind, path), model)
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    g.close()
    h = gl.DataGadget(str(out), placement="file")
    np.testing.assert_array_equal(h.getNumpyVersion()[1:], model[1:])
    h.close()


@pytest.mark.parametrize(
    "kind, opts",
    [
        ("npy", {}),
        ("h5-chunk", {}),
        ("h5-chunk", {"chunk_rows": 7}),
        ("h5-gzip", {"compression": "none"}),
        ("h5-gzip", {"chunk_rows": 7, "compression": "lzf"}),
        ("zarr3", {}),
        ("zarr3", {"chunk_rows": 7, "compression": "gzip"}),
        ("zarr2", {"compression": "none"}),
        ("zarr3-shard", {"chunk_rows": 11}),
    ],
)
def test_save_file_table_over_its_own_path(kind, opts, tmp_path):
    """README: a file table saved over its own file keeps its dataset's name (it reads
    that file on)."""
    rng = np.random.default_rng(17)
    n = 63
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=2 * CHUNK * D * 4)
    g[[0, 62, 0]] = torch.from_numpy(model[[5, 6, 7]])
    seq_assign(model, [0, 62, 0], model[[5, 6, 7]].copy())
    np.testing.assert_array_equal(as_np(g[0:n]), model)
    g.save(str(path), **opts)
    if kind.startswith("h5"):
        with h5py.File(path, "r") as f:
            assert list(f.keys()) == ["grp"]
            np.testing.assert_array_equal(f["grp/emb"][...], model)
    else:
        np.testing.assert_array_equal(read_back(kind, path), model)
    # the table reads and writes the saved file on
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    rows = rng.standard_normal((3, D)).astype(np.float32)
    g[[10, 40, 10]] = rows
    seq_assign(model, [10, 40, 10], rows)
    np.testing.assert_array_equal(as_np(g.getData(np.arange(n))), model)
    if kind.startswith("h5"):
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(f["grp/emb"][...], model)
    else:
        np.testing.assert_array_equal(read_back(kind, path), model)
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_other_table_of_replaced_file_raises(kind, tmp_path):
    """README: once another save replaces the file a file table opened, its reads and
    writes raise GadgetFileError."""
    model = np.arange(30 * D, dtype=np.float32).reshape(30, D)
    path, kw = make_file(kind, tmp_path, model)
    stale = open_file(path, kw)
    np.testing.assert_array_equal(as_np(stale[0:30]), model)
    src = gl.DataGadget(np.zeros((30, D), np.float32), placement="cpu")
    src.save(str(path), **kw)
    with pytest.raises(gl.GadgetFileError):
        stale.getData([0, 1])
    with pytest.raises(gl.GadgetFileError):
        stale.insertData(torch.ones(1, D), [0])
    np.testing.assert_array_equal(read_back(kind, path), 0)
    stale.close()


def test_refused_save_keeps_table_and_file(tmp_path):
    model = np.arange(20 * D, dtype=np.float32).reshape(20, D)
    path, kw = make_file("h5-chunk", tmp_path, model)
    g = open_file(path, kw)
    before = digest(path)
    with pytest.raises((gl.GadgetValueError, gl.GadgetKeyError)):
        g.save(str(path), compression="nonsense")
    with pytest.raises(gl.GadgetFileError):
        (tmp_path / "dir.h5").mkdir()
        g.save(str(tmp_path / "dir.h5"))  # a directory
    with pytest.raises(gl.GadgetTypeError):
        g.save(None)
    assert digest(path) == before
    g[1] = torch.zeros(D)
    model[1] = 0
    np.testing.assert_array_equal(read_back("h5-chunk", path), model)
    g.close()


# --------------------------------------------------------------------------- gather_many / scatter_many


def _three_file_tables(tmp_path, n=90):
    rng = np.random.default_rng(18)
    models, tables, spec = [], [], []
    for kind in ("npy", "h5-gzip", "zarr3-narrow"):
        d = tmp_path / kind
        d.mkdir()
        m = rng.standard_normal((n, D)).astype(np.float32)
        p, kw = make_file(kind, d, m)
        models.append(m)
        tables.append(open_file(p, kw, cache_bytes=2 * CHUNK * D * 4))
        spec.append((kind, p))
    return rng, models, tables, spec


def test_scatter_many_gather_many_file_tables_sequence(tmp_path):
    rng, models, tables, spec = _three_file_tables(tmp_path)
    n = 90
    for step in range(12):
        ids = _random_ids(rng, n, 30)
        rows = [rng.standard_normal((30, D)).astype(np.float32) for _ in tables]
        idx = ids_as(step, ids)
        gl.scatter_many(tables, [torch.from_numpy(r) for r in rows], idx)
        for m, r in zip(models, rows, strict=True):
            seq_assign(m, ids, r)
        for (kind, p), m in zip(spec, models, strict=True):
            np.testing.assert_array_equal(read_back(kind, p), m, err_msg=f"{kind} step {step}")
        q = _random_ids(rng, n, 40)
        got = gl.gather_many(tables, ids_as(step + 2, q))
        assert len(got) == 3
        for g_, m in zip(got, models, strict=True):
            np.testing.assert_array_equal(as_np(g_), m[q])
    got = gl.gather_many(tables, slice(80, None))
    for g_, m in zip(got, models, strict=True):
        np.testing.assert_array_equal(as_np(g_), m[80:])
    for t in tables:
        t.close()


BAD_MANY = {
    "bad-id": lambda ts, n: gl.scatter_many(ts, [torch.ones(3, D)] * 3, [0, n, 1]),
    "neg-id": lambda ts, n: gl.scatter_many(ts, [torch.ones(3, D)] * 3, [0, -2, 1]),
    "one-dtype-wrong": lambda ts, n: gl.scatter_many(
        ts, [torch.ones(3, D), torch.ones(3, D), torch.ones(3, D, dtype=torch.float64)], [0, 1, 2]
    ),
    "one-shape-wrong": lambda ts, n: gl.scatter_many(
        ts, [torch.ones(3, D), torch.ones(2, D), torch.ones(3, D)], [0, 1, 2]
    ),
    "too-few-rows": lambda ts, n: gl.scatter_many(ts, [torch.ones(3, D)] * 2, [0, 1, 2]),
}


@pytest.mark.parametrize("bad", sorted(BAD_MANY))
def test_scatter_many_refused_changes_no_table(bad, tmp_path):
    rng, models, tables, spec = _three_file_tables(tmp_path)
    for t, m in zip(tables, models, strict=True):
        np.testing.assert_array_equal(t.getNumpyVersion(), m)  # warm caches
    before = [digest(p) for _, p in spec]
    with pytest.raises(gl.GadgetError):
        BAD_MANY[bad](tables, 90)
    assert [digest(p) for _, p in spec] == before
    for t, m in zip(tables, models, strict=True):
        np.testing.assert_array_equal(as_np(t.getData(np.arange(90))), m)
        t.close()


def test_scatter_many_mixed_with_readonly_file_changes_nothing(tmp_path):
    rng, models, tables, spec = _three_file_tables(tmp_path)
    kind, p = spec[0]
    ro = open_file(p, {}, writable=False)
    mem = gl.DataGadget(np.zeros((90, D), np.float32), placement="cpu")
    before = [digest(q) for _, q in spec]
    with pytest.raises(gl.ReadOnlyError):
        gl.scatter_many([mem, tables[1], ro], [torch.ones(2, D)] * 3, [4, 5])
    assert [digest(q) for _, q in spec] == before
    np.testing.assert_array_equal(mem.getNumpyVersion(), 0)
    ro.close()
    for t in tables:
        t.close()


def test_scatter_many_row_count_mismatch_refused(tmp_path):
    rng, models, tables, spec = _three_file_tables(tmp_path)
    d = tmp_path / "short"
    d.mkdir()
    p, kw = make_file("npy", d, np.zeros((50, D), np.float32))
    short = open_file(p, kw)
    before = [digest(q) for _, q in spec] + [digest(p)]
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many([tables[0], short], [torch.ones(2, D)] * 2, [1, 2])
    with pytest.raises(gl.GadgetValueError):
        gl.gather_many([tables[0], short], [1, 2])
    assert [digest(q) for _, q in spec] + [digest(p)] == before
    short.close()
    for t in tables:
        t.close()


def test_scatter_many_same_file_twice_last_table_wins(tmp_path):
    """Two tables of one file in one scatter_many: gadgets[k][ids] = rows[k] for every k in
    order, so the later table's rows are what the file holds."""
    model = np.zeros((40, D), np.float32)
    path, kw = make_file("zarr3", tmp_path, model)
    a = open_file(path, kw)
    b = open_file(path, kw)
    gl.scatter_many([a, b], [torch.ones(2, D), torch.full((2, D), 2.0)], [3, 33])
    model[[3, 33]] = 2.0
    np.testing.assert_array_equal(read_back("zarr3", path), model)
    np.testing.assert_array_equal(a.getNumpyVersion(), model)
    a.close()
    b.close()


# --------------------------------------------------------------------------- reload


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_load_switches_file_and_writes_go_to_new_file(kind, tmp_path):
    rng = np.random.default_rng(19)
    m1 = rng.standard_normal((30, D)).astype(np.float32)
    m2 = rng.standard_normal((44, D)).astype(np.float32)
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir()
    d2.mkdir()
    p1, kw = make_file(kind, d1, m1)
    p2, _ = make_file(kind, d2, m2)
    g = open_file(p1, kw, cache_bytes=CHUNK * D * 4)
    np.testing.assert_array_equal(as_np(g[0:30]), m1)
    g.load(str(p2), **kw)
    assert g.placement == "file" and len(g) == 44
    np.testing.assert_array_equal(g.getNumpyVersion(), m2)
    g[[43, 0]] = torch.zeros(2, D)
    m2[[43, 0]] = 0
    np.testing.assert_array_equal(read_back(kind, p2), m2)
    np.testing.assert_array_equal(read_back(kind, p1), m1)
    g.close()


# --------------------------------------------------------------------------- more layouts


def _layout(name: str, tmp: Path, data: np.ndarray):
    """Unusual but valid files: (path, kwargs, reader)."""
    if name == "npy-bigendian":
        p = tmp / "be.npy"
        np.save(p, data.astype(">f4"))
        return p, {}, lambda: np.load(p)
    if name == "npy-v2-header":
        p = tmp / "v2.npy"
        with open(p, "wb") as fh:
            np.lib.format.write_array(fh, data, version=(2, 0))
        return p, {}, lambda: np.load(p)
    if name.startswith("h5-"):
        p = tmp / "x.h5"
        with h5py.File(p, "w") as f:
            if name == "h5-shuffle-fletcher32":
                f.create_dataset(
                    "x", data=data, chunks=(6, D), shuffle=True, compression="gzip", fletcher32=True
                )
            elif name == "h5-bigendian":
                f.create_dataset("x", data=data.astype(">f4"))
            elif name == "h5-bigendian-chunked":
                f.create_dataset("x", data=data.astype(">f4"), chunks=(9, 5))
            elif name == "h5-resizable":
                f.create_dataset("x", data=data, maxshape=(None, D), chunks=(16, D))
            else:  # pragma: no cover
                raise AssertionError(name)

        def rd():
            with h5py.File(p, "r") as f:
                return f["x"][...]

        return p, {"dataset": "x"}, rd
    p = tmp / "x.zarr"
    if name == "zarr2-fortran":
        z = zarr.create_array(
            str(p), shape=data.shape, chunks=(10, D), dtype="f4", zarr_format=2, order="F"
        )
    elif name == "zarr2-bigendian":
        z = zarr.create_array(str(p), shape=data.shape, chunks=(10, D), dtype=">f4", zarr_format=2)
    elif name == "zarr3-uncompressed":
        z = zarr.create_array(
            str(p), shape=data.shape, chunks=(10, D), dtype="f4", compressors=None
        )
    else:  # pragma: no cover
        raise AssertionError(name)
    z[...] = data
    return p, {}, lambda: zarr.open_array(str(p), mode="r")[...]


LAYOUTS = [
    "npy-bigendian",
    "npy-v2-header",
    "h5-shuffle-fletcher32",
    "h5-bigendian",
    "h5-bigendian-chunked",
    "h5-resizable",
    "zarr2-fortran",
    "zarr2-bigendian",
    "zarr3-uncompressed",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unusual_layouts_write_through(layout, tmp_path):
    rng = np.random.default_rng(LAYOUTS.index(layout))
    n = 61
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw, rd = _layout(layout, tmp_path, model)
    g = open_file(path, kw, cache_bytes=2 * 10 * D * 4)
    assert g.dtype == torch.float32
    for _ in range(6):
        ids = _random_ids(rng, n, 20)
        rows = rng.standard_normal((20, D)).astype(np.float32)
        g.insertData(torch.from_numpy(rows), ids)
        seq_assign(model, ids, rows)
        part = rng.standard_normal((3, 2)).astype(np.float32)
        g[[4, 50, 4], 1:3] = torch.from_numpy(part)
        seq_assign(model, [4, 50, 4], part, (slice(1, 3),))
        got = rd()
        np.testing.assert_array_equal(got.astype(np.float32), model)
        np.testing.assert_array_equal(as_np(g.getData(ids)), model[ids])
    if "bigendian" in layout:
        assert rd().dtype == np.dtype(">f4")  # the file keeps its byte order
    g.close()


@pytest.mark.parametrize("fmt", ["zarr", "h5"])
def test_missing_chunks_read_as_fill_value_and_partial_writes_keep_it(fmt, tmp_path):
    """README: a zarr chunk that is missing reads as the array's fill value; HDF5 chunks
    never written read as the dataset's fill value. A write of part of such a chunk keeps
    the other rows at the fill value."""
    n = 50
    model = np.full((n, D), 7.0, np.float32)
    model[0:10] = 1.0
    if fmt == "zarr":
        p = tmp_path / "fv.zarr"
        z = zarr.create_array(str(p), shape=(n, D), chunks=(10, D), dtype="f4", fill_value=7.0)
        z[0:10] = 1.0
        kw: dict = {}

        def rd():
            return zarr.open_array(str(p), mode="r")[...]
    else:
        p = tmp_path / "fv.h5"
        with h5py.File(p, "w") as f:
            d = f.create_dataset("x", shape=(n, D), chunks=(10, D), dtype="f4", fillvalue=7.0)
            d[0:10] = 1.0
        kw = {"dataset": "x"}

        def rd():
            with h5py.File(p, "r") as f:
                return f["x"][...]

    g = open_file(p, kw, cache_bytes=0)
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    g[[25, 41, 25]] = torch.from_numpy(
        np.stack([np.zeros(D), np.ones(D), np.full(D, 3.0)]).astype(np.float32)
    )
    model[25] = 3.0
    model[41] = 1.0
    g[33, 2:4] = torch.tensor([-1.0, -2.0])
    model[33, 2:4] = [-1.0, -2.0]
    np.testing.assert_array_equal(rd(), model)
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    g.fill_(7.0)
    np.testing.assert_array_equal(rd(), 7.0)
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_one_dimensional_tables(kind, tmp_path):
    n = 30
    model = np.arange(n, dtype=np.int64) * 3
    path, kw = make_file(kind, tmp_path, model, chunk=7)
    g = open_file(path, kw, cache_bytes=16)
    g[[3, 4, 3]] = torch.tensor([10, 11, 12])
    model[3], model[4] = 12, 11
    g[5] = torch.tensor(50)
    model[5] = 50
    g[20:23] = np.array([1, 2, 3])
    model[20:23] = [1, 2, 3]
    assert g[5].shape == () and g[5].item() == 50
    np.testing.assert_array_equal(
        as_np(g.getData(torch.tensor([[3, 4], [5, 29]]))), model[[[3, 4], [5, 29]]]
    )
    np.testing.assert_array_equal(read_back(kind, path), model)
    with pytest.raises(gl.GadgetIndexError):
        g[-1]
    with pytest.raises(gl.GadgetValueError):
        g[[1, 2]] = torch.tensor([1, 2, 3])
    np.testing.assert_array_equal(read_back(kind, path), model)
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_threads_partial_row_writes_of_same_rows_are_not_lost(kind, tmp_path):
    """README: threads may share file tables; a write of part of rows reads and writes the
    rows back under the file's lock (one lock per file, for every table of it)."""
    import threading

    n = 48
    path, kw = make_file(kind, tmp_path, np.zeros((n, D), np.float32), chunk=8)
    a = open_file(path, kw, cache_bytes=2 * 8 * D * 4)
    b = open_file(path, kw)
    errors = []

    def worker(t, c0, base):
        try:
            for k in range(15):
                t[np.arange(n), c0 : c0 + 4] = torch.full((n, 4), float(base + k))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    th = [
        threading.Thread(target=worker, args=(a, 0, 100)),
        threading.Thread(target=worker, args=(b, 4, 200)),
    ]
    for x in th:
        x.start()
    for x in th:
        x.join()
    assert not errors
    model = np.zeros((n, D), np.float32)
    model[:, :4] = 114
    model[:, 4:] = 214
    np.testing.assert_array_equal(read_back(kind, path), model)
    np.testing.assert_array_equal(a.getNumpyVersion(), model)
    np.testing.assert_array_equal(b.getNumpyVersion(), model)
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["npy", "h5-gzip", "zarr3"])
def test_pickled_copy_is_another_table_of_the_file(kind, tmp_path):
    """A file gadget pickles as its file name; the copy, in this process, is another table
    of the same file and sees the original's writes (and the original its)."""
    import pickle

    model = np.zeros((40, D), np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw)
    h = pickle.loads(pickle.dumps(g))
    assert h.placement == "file" and tuple(h.shape) == (40, D)
    np.testing.assert_array_equal(as_np(h.getData(np.arange(40))), model)
    g[3] = torch.ones(D)
    model[3] = 1
    np.testing.assert_array_equal(as_np(h.getData(np.arange(40))), model)
    h[[4, 39]] = torch.full((2, D), 2.0)
    model[[4, 39]] = 2
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    np.testing.assert_array_equal(read_back(kind, path), model)
    g.close()
    h.close()


def test_save_over_own_file_through_symlink(tmp_path):
    """README: a save through a symbolic link replaces the file the link names (the link
    stays); the table, whose file that is, reads and writes it on."""
    model = np.arange(10 * D, dtype=np.float32).reshape(10, D)
    path, kw = make_file("npy", tmp_path, model)
    link = tmp_path / "link.npy"
    link.symlink_to(path.name)
    g = open_file(path, kw)
    g[0] = torch.ones(D)
    model[0] = 1
    g.save(str(link))
    assert link.is_symlink()
    np.testing.assert_array_equal(np.load(path), model)
    np.testing.assert_array_equal(as_np(g.getData([0, 1])), model[[0, 1]])
    g[1] = torch.zeros(D)
    model[1] = 0
    np.testing.assert_array_equal(np.load(path), model)
    g.close()


def test_zarr_group_table_saved_over_own_store(tmp_path):
    """README: a save replaces a zarr store with every array of its group; a file table
    saved over its own file keeps its dataset's name and reads that file on."""
    p = tmp_path / "g.zarr"
    grp = zarr.open_group(str(p), mode="w")
    arr = grp.create_array("sub/emb", shape=(20, D), chunks=(5, D), dtype="f4")
    arr[...] = 0
    grp.create_array("other", shape=(3,), dtype="i2")
    g = open_file(p, {"dataset": "sub/emb"})
    g[[1]] = torch.ones(1, D)
    g.save(str(p))
    g[2] = torch.ones(D)
    model = np.zeros((20, D), np.float32)
    model[1:3] = 1
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    z = zarr.open_group(str(p), mode="r")
    np.testing.assert_array_equal(z["sub/emb"][...], model)
    assert "other" not in list(z.keys())
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-chunk", "zarr3"])
def test_check_ids_false_cpu_ids_still_checked_on_file(kind, tmp_path):
    """README: CPU ids are checked on the CPU for free (also with check_ids=False)."""
    model = np.zeros((20, D), np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw)
    before = digest(path)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.ones(2, D), [1, 20], check_ids=False)
    with pytest.raises(gl.GadgetIndexError):
        g.getData(torch.tensor([1, 99]), check_ids=False)
    assert digest(path) == before
    g.close()


@pytest.mark.parametrize("kind", ["npy", "h5-gzip", "zarr3-narrow"])
def test_getdata_out_on_file_tables(kind, tmp_path):
    rng = np.random.default_rng(21)
    model = rng.standard_normal((33, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw, cache_bytes=CHUNK * D * 4)
    out = torch.empty(5, D)
    ids = [32, 0, 32, 11, 21]
    assert g.getData(ids, out=out) is out
    np.testing.assert_array_equal(out.numpy(), model[ids])
    g[[0]] = torch.zeros(1, D)
    model[0] = 0
    g.getData(ids, out=out)
    np.testing.assert_array_equal(out.numpy(), model[ids])
    with pytest.raises(gl.GadgetTypeError):
        g.getData(ids, out=torch.empty(5, D, dtype=torch.float64))
    with pytest.raises(gl.GadgetValueError):
        g.getData(ids, out=torch.empty(4, D))
    g.close()


def test_float16_and_bool_fill_refusals_leave_file(tmp_path):
    p16 = tmp_path / "h.npy"
    np.save(p16, np.ones((20, D), np.float16))
    g = open_file(p16, {})
    before = digest(p16)
    for bad in (65520.0, 1e6, -65520.0):
        with pytest.raises(gl.GadgetValueError):
            g.fill_(bad)
    with pytest.raises(gl.GadgetValueError):
        g.uniform_(-60000.0, 60000.0)  # high - low past float16's range
    assert digest(p16) == before
    g.fill_(65504.0)
    assert (np.load(p16) == 65504.0).all()
    g.normal_(3.0, 0.0)
    assert (np.load(p16) == 3.0).all()
    g.close()
    pb = tmp_path / "b.npy"
    np.save(pb, np.zeros((20, D), bool))
    g = open_file(pb, {})
    before = digest(pb)
    for bad in (2, 0.5, -1):
        with pytest.raises(gl.GadgetValueError):
            g.fill_(bad)
    assert digest(pb) == before
    g.fill_(1.0)
    assert np.load(pb).all()
    g.fill_(False)
    assert not np.load(pb).any()
    g.close()


def test_scatter_many_slice_of_rows_on_file_tables(tmp_path):
    rng, models, tables, spec = _three_file_tables(tmp_path)
    rows = [rng.standard_normal((5, D)).astype(np.float32) for _ in tables]
    gl.scatter_many(tables, [torch.from_numpy(r) for r in rows], slice(85, None))
    for (kind, p), m, r, t in zip(spec, models, rows, tables, strict=True):
        m[85:] = r
        np.testing.assert_array_equal(read_back(kind, p), m)
        t.close()


@pytest.mark.parametrize("kind", ["npy", "h5-contig", "h5-gzip", "zarr3", "zarr3-narrow"])
def test_tables_with_different_block_rows_see_each_others_writes(kind, tmp_path):
    """Tables of one file whose blocks (block_rows) do not line up: every write by one is
    seen by the others, through insertData, partial rows, scatter_many and uniform_."""
    rng = np.random.default_rng(22)
    n = 100
    model = rng.standard_normal((n, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    a = open_file(path, kw, block_rows=7, cache_bytes=1 << 20)
    b = open_file(path, kw, cache_bytes=1 << 20)
    c = open_file(path, kw, block_rows=13, cache_bytes=1 << 20, writable=False)
    for step in range(14):
        for t in (a, b, c):
            np.testing.assert_array_equal(
                as_np(t.getData(np.arange(n))), model, err_msg=f"step {step}"
            )
        w = (a, b)[step % 2]
        ids = rng.integers(0, n, 15)
        rows = rng.standard_normal((15, D)).astype(np.float32)
        if step % 3 == 0:
            gl.scatter_many([w], [torch.from_numpy(rows)], ids)
            seq_assign(model, ids, rows)
        elif step % 3 == 1:
            w.insertData(rows, ids)
            seq_assign(model, ids, rows)
        else:
            w[ids, 2:5] = torch.from_numpy(rows[:, :3].copy())
            seq_assign(model, ids, rows[:, :3], (slice(2, 5),))
        if step == 7:
            w.uniform_(0.0, 1.0)
            model[...] = read_back(kind, path)
    np.testing.assert_array_equal(read_back(kind, path), model)
    for t in (a, b, c):
        np.testing.assert_array_equal(t.getNumpyVersion(), model)
        t.close()


@pytest.mark.parametrize("kind", ["npy", "h5-gzip", "zarr3"])
def test_other_tables_after_own_path_save_raise_then_load(kind, tmp_path):
    """A table's save over its own file replaces the file for the file's other tables:
    they raise GadgetFileError (README) until load() opens the new file."""
    rng = np.random.default_rng(23)
    model = rng.standard_normal((40, D)).astype(np.float32)
    path, kw = make_file(kind, tmp_path, model)
    a = open_file(path, kw)
    b = open_file(path, kw)
    np.testing.assert_array_equal(b.getNumpyVersion(), model)
    a[3] = torch.zeros(D)
    model[3] = 0
    a.save(str(path))
    with pytest.raises(gl.GadgetFileError, match="replaced"):
        b.getData([0])
    with pytest.raises(gl.GadgetFileError):
        b[1] = torch.ones(D)
    a[4] = torch.ones(D)
    model[4] = 1
    np.testing.assert_array_equal(read_back(kind, path), model)
    b.load(str(path), **kw)
    assert b.placement == "file"
    np.testing.assert_array_equal(b.getNumpyVersion(), model)
    b[5] = torch.full((D,), 5.0)
    model[5] = 5
    np.testing.assert_array_equal(a.getNumpyVersion(), model)
    np.testing.assert_array_equal(read_back(kind, path), model)
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["npy", "h5-contig", "zarr3"])
def test_no_views_of_file_tables(kind, tmp_path):
    """README: getNumpyVersion(copy=False) copies a file table (writes to it do not reach
    the table); np.asarray(g, copy=False) raises GadgetValueError; as_tensor() raises
    GadgetTypeError."""
    model = np.arange(12 * D, dtype=np.float32).reshape(12, D)
    path, kw = make_file(kind, tmp_path, model)
    g = open_file(path, kw)
    arr = g.getNumpyVersion(copy=False)
    np.testing.assert_array_equal(arr, model)
    if arr.flags.writeable:
        arr[...] = 99
    before = digest(path)
    np.testing.assert_array_equal(g.getNumpyVersion(), model)
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        with pytest.raises(gl.GadgetValueError):
            np.asarray(g, copy=False)
    with pytest.raises(gl.GadgetTypeError):
        g.as_tensor()
    assert digest(path) == before
    np.testing.assert_array_equal(read_back(kind, path), model)
    g.close()
