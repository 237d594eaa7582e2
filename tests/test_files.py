"""Files: .npy / HDF5 / zarr sources and sinks, the ``file`` placement, save / load / convert.

The store behaviour suite runs over every format x placement (``cpu`` and ``file``
here; ``cuda`` / ``pinned`` on the GPU machine). Every check compares against NumPy.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr
from conftest import MEMORY_PLACEMENTS, NEEDS_CUPY

import gadgetloader as gl
from gadgetloader import io as gio
from gadgetloader._dtypes import SUPPORTED_DTYPES, dtype_name
from gadgetloader.stores import FileStore, file_store

ROWS, WIDTH, CHUNK = 203, 6, 16
FORMATS = {"npy": ".npy", "hdf5": ".h5", "zarr": ".zarr"}
PLACEMENTS = [*MEMORY_PLACEMENTS, pytest.param("file", id="file")]


def table(
    dtype: torch.dtype = torch.float32, rows: int = ROWS, width: int = WIDTH, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, width), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(rows, width, generator=g) * 50).to(dtype)
    lo = 0 if dtype == torch.uint8 else -100
    return torch.randint(lo, 100, (rows, width), generator=g).to(dtype)


def write(src: torch.Tensor, path: Path, **options: object) -> Path:
    """Write ``src`` to ``path`` through gadgetloader's sinks (chunked for HDF5 / zarr)."""
    if path.suffix != ".npy":
        options.setdefault("chunk_rows", CHUNK)
    with gl.DataGadget(src, placement="cpu") as g:
        g.save(path, progress=False, **options)
    return path


_SAME_WIDTH_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (so NaN == NaN and -0.0 != 0.0)."""
    return t.view(_SAME_WIDTH_INT[t.dtype]) if t.dtype in _SAME_WIDTH_INT else t


def on_disk(path: Path, dataset: str | None = None) -> np.ndarray:
    with gl.DataGadget(path, placement="cpu", dataset=dataset) as g:
        return g.getNumpyVersion()


@pytest.fixture(params=list(FORMATS))
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=PLACEMENTS)
def file_placement(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ---- the store behaviour suite over every format x placement ----------------------------------------------
def test_gather_matches_numpy(
    tmp_path: Path, fmt: str, file_placement: str, device: torch.device
) -> None:
    src = table()
    path = write(src, tmp_path / f"t{FORMATS[fmt]}")
    with gl.DataGadget(path, placement=file_placement, device=device, progress=False) as g:
        assert g.shape == (ROWS, WIDTH) and g.dtype == torch.float32
        ids = np.array([[5, 5, 0], [ROWS - 1, 17, 5]])
        for form in (ids, torch.from_numpy(ids), ids.tolist()):
            got = g.getData(form)
            assert got.device.type == device.type
            assert torch.equal(got.cpu(), src[torch.from_numpy(ids)])
        assert torch.equal(g.getData(7).cpu(), src[7])
        assert g.getData([]).shape == (0, WIDTH)
        assert torch.equal(g.getData(range(ROWS)).cpu(), src)


def test_scatter_last_occurrence_wins(
    tmp_path: Path, fmt: str, file_placement: str, device: torch.device
) -> None:
    src = table()
    path = write(src, tmp_path / f"t{FORMATS[fmt]}")
    ids = torch.tensor([3, 40, 3, 200, 41, 40, 3])
    rows = torch.arange(len(ids) * WIDTH, dtype=torch.float32).view(len(ids), WIDTH)
    expect = src.clone()
    for i, j in enumerate(ids.tolist()):
        expect[j] = rows[i]
    with gl.DataGadget(path, placement=file_placement, device=device, progress=False) as g:
        g.insertData(rows.to(device), ids)
        assert torch.equal(g.getData(range(ROWS)).cpu(), expect)
    if file_placement == "file":  # written through to the file
        assert np.array_equal(on_disk(path), expect.numpy())
    else:  # an in-memory copy leaves the file alone
        assert np.array_equal(on_disk(path), src.numpy())


def test_read_and_write_blocks(
    tmp_path: Path, fmt: str, file_placement: str, device: torch.device
) -> None:
    src = table()
    path = write(src, tmp_path / f"t{FORMATS[fmt]}")
    with gl.DataGadget(path, placement=file_placement, device=device, progress=False) as g:
        store = g.store
        assert torch.equal(store.read_block(10, 50).cpu(), src[10:50])
        new = torch.full((37, WIDTH), 7.5)
        store.write_block(13, new)  # spans chunk boundaries on both ends
        store.synchronize()
        expect = src.clone()
        expect[13:50] = new
        assert torch.equal(g.getData(range(ROWS)).cpu(), expect)
        assert np.array_equal(g.getNumpyVersion(), expect.numpy())


@pytest.mark.parametrize("bad", [[-1], [ROWS], [0, ROWS + 5]])
def test_bad_ids_leave_table_unchanged(
    tmp_path: Path, fmt: str, file_placement: str, device: torch.device, bad: list[int]
) -> None:
    src = table()
    path = write(src, tmp_path / f"t{FORMATS[fmt]}")
    with gl.DataGadget(path, placement=file_placement, device=device, progress=False) as g:
        with pytest.raises(gl.GadgetIndexError, match="rows"):
            g.getData(bad)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.ones(len(bad), WIDTH), bad)
        with pytest.raises(gl.GadgetValueError, match="shape"):
            g.insertData(torch.ones(3, WIDTH), [1, 2])
        with pytest.raises(gl.GadgetTypeError, match="float32"):
            g.insertData(torch.ones(2, WIDTH, dtype=torch.float64), [1, 2])
        with pytest.raises(gl.GadgetTypeError):
            g.getData([1.5, 2.0])
        assert torch.equal(g.getData(range(ROWS)).cpu(), src)
    assert np.array_equal(on_disk(path), src.numpy())


def test_read_only_file_store_refuses_writes(tmp_path: Path, fmt: str) -> None:
    src = table()
    path = write(src, tmp_path / f"t{FORMATS[fmt]}")
    with gl.DataGadget(path, placement="file", writable=False) as g:
        assert not g.store.supports_writes
        with pytest.raises(gl.ReadOnlyError, match=str(path)):
            g.insertData(torch.ones(1, WIDTH), [0])
        with pytest.raises(gl.ReadOnlyError):
            g.store.write_block(0, torch.ones(1, WIDTH))
        with pytest.raises(gl.ReadOnlyError):
            g.zero_()
    assert np.array_equal(on_disk(path), src.numpy())


def test_file_store_on_unwritable_file_is_read_only(tmp_path: Path) -> None:
    src = table()
    path = write(src, tmp_path / "t.h5")
    os.chmod(path, 0o444)
    try:
        if os.access(path, os.W_OK):
            pytest.skip("running as a user that can write read-only files")
        with (
            gl.DataGadget(path, placement="file") as g,
            pytest.raises(gl.ReadOnlyError, match="read-only"),
        ):
            g.insertData(torch.ones(1, WIDTH), [0])
        with pytest.raises(gl.ReadOnlyError, match="cannot be written"):
            gl.DataGadget(path, placement="file", writable=True)
    finally:
        os.chmod(path, 0o644)


def test_closed_file_store(tmp_path: Path, fmt: str) -> None:
    path = write(table(), tmp_path / f"t{FORMATS[fmt]}")
    g = gl.DataGadget(path, placement="file")
    g.close()
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])


# ---- round trips -----------------------------------------------------------------------------------------
SAVE_VARIANTS = [
    pytest.param(".npy", {}, id="npy"),
    pytest.param(".h5", {}, id="h5"),
    pytest.param(".hdf5", {"compression": "gzip", "dataset": "g/emb"}, id="h5-gzip"),
    pytest.param(".hdf", {"compression": "lzf"}, id="h5-lzf"),
    pytest.param(".zarr", {}, id="zarr-zstd"),
    pytest.param(".zarr", {"compression": "none", "dataset": "a/b"}, id="zarr-raw"),
    pytest.param(".zarr", {"compression": "blosc"}, id="zarr-blosc"),
    pytest.param(".zarr", {"compression": "gzip"}, id="zarr-gzip"),
]


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
@pytest.mark.parametrize(("ext", "options"), SAVE_VARIANTS)
def test_round_trip_bit_exact(
    tmp_path: Path, dtype: torch.dtype, ext: str, options: dict[str, str]
) -> None:
    src = table(dtype)
    if dtype.is_floating_point:
        src[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    path = tmp_path / f"t{ext}"
    if ext == ".npy" and dtype == torch.bfloat16:
        with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
            write(src, path, **options)
        assert not path.exists() and not list(tmp_path.iterdir())
        return
    write(src, path, **options)
    for placement in ("cpu", "file"):
        with gl.DataGadget(path, placement=placement, dataset=options.get("dataset")) as g:
            assert g.dtype == dtype and g.shape == tuple(src.shape)
            assert torch.equal(bits(g.getData(range(ROWS)).cpu()), bits(src))
            ids = [5, 199, 5, 0]
            assert torch.equal(bits(g.getData(ids).cpu()), bits(src[ids]))


def test_rows_of_any_shape_and_1d_tables(tmp_path: Path, fmt: str) -> None:
    for src in (torch.arange(50, dtype=torch.int64), torch.randn(40, 3, 2)):
        path = write(src, tmp_path / f"t{src.dim()}{FORMATS[fmt]}")
        for placement in ("cpu", "file"):
            with gl.DataGadget(path, placement=placement) as g:
                assert g.shape == tuple(src.shape)
                assert torch.equal(g.getData([3, 1, 3]).cpu(), src[[3, 1, 3]])


def test_saving_over_a_file_replaces_it(tmp_path: Path, fmt: str) -> None:
    path = write(table(seed=1), tmp_path / f"t{FORMATS[fmt]}")
    new = table(seed=2, rows=50)
    write(new, path)
    assert np.array_equal(on_disk(path), new.numpy())
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing left beside it


def test_save_options_are_checked(tmp_path: Path) -> None:
    with gl.DataGadget(table(), placement="cpu") as g:
        with pytest.raises(gl.GadgetTypeError, match="chunk_rows"):
            g.save(tmp_path / "t.npy", chunk_rows=10)
        with pytest.raises(gl.GadgetKeyError, match="gzip"):
            g.save(tmp_path / "t.h5", compression="zstd")
        with pytest.raises(gl.GadgetKeyError, match="zstd"):
            g.save(tmp_path / "t.zarr", compression="lzf")
        with pytest.raises(gl.GadgetValueError, match="chunk_rows"):
            g.save(tmp_path / "t.h5", chunk_rows=0)
        with pytest.raises(gl.GadgetValueError, match="cannot tell the format"):
            g.save(tmp_path / "t.bin")
    assert not list(tmp_path.iterdir())


def test_hdf5_chunking_and_compression_are_what_was_asked(tmp_path: Path) -> None:
    path = write(table(), tmp_path / "t.h5", chunk_rows=10, compression="gzip", dataset="grp/emb")
    with h5py.File(path, "r") as f:
        ds = f["grp/emb"]
        assert ds.chunks == (10, WIDTH) and ds.compression == "gzip"
    path = write(table(), tmp_path / "z.zarr", chunk_rows=10)
    z = zarr.open_array(str(path), mode="r")
    assert z.chunks == (10, WIDTH) and z.compressors


# ---- HDF5 and zarr read paths ------------------------------------------------------------------------------
def _h5(path: Path, data: np.ndarray, **kwargs: object) -> Path:
    with h5py.File(path, "w", **{k: v for k, v in kwargs.items() if k == "userblock_size"}) as f:
        f.create_dataset(
            "x", data=data, **{k: v for k, v in kwargs.items() if k != "userblock_size"}
        )
    return path


H5_LAYOUTS = [
    pytest.param({}, id="contiguous"),
    pytest.param({"chunks": (16, WIDTH)}, id="raw-chunks"),
    pytest.param({"chunks": (16, WIDTH), "compression": "gzip"}, id="deflate"),
    pytest.param(
        {"chunks": (16, WIDTH), "compression": "gzip", "shuffle": True}, id="shuffle-deflate"
    ),
    pytest.param({"chunks": (16, WIDTH), "compression": "lzf"}, id="lzf"),
    pytest.param({"chunks": (16, WIDTH), "fletcher32": True}, id="fletcher32"),
    pytest.param({"chunks": (7, 2)}, id="partial-row-chunks"),
    pytest.param({"chunks": (16, WIDTH), "userblock_size": 512}, id="userblock"),
    pytest.param({"chunks": (16, WIDTH), "dtype": ">f4"}, id="big-endian"),
]


@pytest.mark.parametrize("layout", H5_LAYOUTS)
def test_hdf5_layouts_read_exactly(tmp_path: Path, layout: dict[str, object]) -> None:
    data = table().numpy()
    path = _h5(tmp_path / "x.h5", data, **layout)
    ids = np.random.default_rng(0).integers(0, ROWS, 300)
    with gl.DataGadget(path, placement="cpu") as g:
        assert np.array_equal(g.getNumpyVersion(), data)
    with gl.DataGadget(path, placement="file", cache_bytes=1000) as g:
        assert np.array_equal(g.getData(ids).cpu().numpy(), data[ids])
        assert np.array_equal(g.store.read_block(3, 150).numpy(), data[3:150])


def test_hdf5_unwritten_chunks_read_as_fill_value(tmp_path: Path) -> None:
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("x", shape=(100, 4), chunks=(10, 4), dtype="f4", fillvalue=2.5)
        ds[20:30] = 1.0
    expect = np.full((100, 4), 2.5, dtype=np.float32)
    expect[20:30] = 1.0
    with gl.DataGadget(path, placement="file") as g:
        assert np.array_equal(g.getData(range(100)).cpu().numpy(), expect)


def test_zarr_v2_arrays_and_groups(tmp_path: Path) -> None:
    data = table().numpy()
    v2 = zarr.create_array(
        str(tmp_path / "v2.zarr"),
        shape=data.shape,
        chunks=(16, WIDTH),
        dtype=data.dtype,
        zarr_format=2,
    )
    v2[:] = data
    grp = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    arr = grp.create_array(
        "deep/emb", shape=data.shape, chunks=(10, 3), dtype=data.dtype
    )  # partial-row chunks
    arr[:] = data
    grp.create_array("other", shape=(3,), dtype="i4")
    ids = [0, 202, 17, 17]
    for path, dataset in ((tmp_path / "v2.zarr", None), (tmp_path / "g.zarr", "deep/emb")):
        for placement in ("cpu", "file"):
            with gl.DataGadget(path, placement=placement, dataset=dataset) as g:
                assert np.array_equal(g.getData(ids).cpu().numpy(), data[ids])
                assert np.array_equal(g.getNumpyVersion(), data)


def test_zarr_missing_chunks_read_as_fill_value(tmp_path: Path) -> None:
    z = zarr.create_array(
        str(tmp_path / "f.zarr"), shape=(40, 3), chunks=(8, 3), dtype="f4", fill_value=-1.0
    )
    z[8:16] = 5.0
    expect = np.full((40, 3), -1.0, dtype=np.float32)
    expect[8:16] = 5.0
    with gl.DataGadget(tmp_path / "f.zarr", placement="file") as g:
        assert np.array_equal(g.getData(range(40)).cpu().numpy(), expect)


def test_format_by_extension_content_or_argument(tmp_path: Path) -> None:
    src = table()
    h5 = write(src, tmp_path / "t.h5")
    zr = write(src, tmp_path / "t.zarr")
    npy = write(src, tmp_path / "t.npy")
    for p, name in ((h5, "hdf5"), (zr, "zarr"), (npy, "npy")):
        plain = tmp_path / f"noext_{name}"
        os.rename(p, plain)
        assert gio.guess_format(plain) == name
        with gl.DataGadget(plain, placement="cpu") as g:
            assert torch.equal(g.getData(range(ROWS)).cpu(), src)
        with gl.DataGadget(plain, placement="cpu", format=name) as g:
            assert g.shape == (ROWS, WIDTH)
    assert gio.guess_format(tmp_path / "x.HDF5", must_exist=False) == "hdf5"
    with pytest.raises(gl.GadgetKeyError, match="Unknown format 'parquet'"):
        gl.DataGadget(tmp_path / "noext_npy", format="parquet")


# ---- the file store's reads: chunks once per call, the cache under its budget -----------------------------------
def test_each_chunk_read_once_per_call(tmp_path: Path) -> None:
    path = write(table(), tmp_path / "t.h5", compression="gzip")  # chunks must be decoded whole
    with gl.DataGadget(path, placement="file", cache_bytes=0) as g:
        store = g.store
        assert isinstance(store, FileStore) and store.block_rows == CHUNK
        g.getData([1, 15, 3, 3, 0, 2])  # all in chunk 0
        assert store.stats == {"hits": 0, "misses": 1, "reads": 1}
        g.getData([100, 20, 180, 101, 21])  # three chunks, one read call
        assert store.stats["misses"] == 4 and store.stats["reads"] == 2
        g.getData([16, 40, 33])  # chunks 1 and 2
        assert store.stats["misses"] == 6 and store.stats["reads"] == 3
    path = write(table(), tmp_path / "t.npy")  # .npy: one gather through a memory map per call
    with gl.DataGadget(path, placement="file", cache_bytes=0, block_rows=10) as g:
        assert np.array_equal(g.getData([0, 5, 9]).cpu().numpy(), table().numpy()[[0, 5, 9]])
        ids = [12, 25, 39, 100, 12]
        assert np.array_equal(g.getData(ids).cpu().numpy(), table().numpy()[ids])
        assert g.store.stats == {"hits": 0, "misses": 0, "reads": 2}


def test_cache_stays_under_budget_and_serves_hits(tmp_path: Path) -> None:
    path = write(table(), tmp_path / "t.zarr")
    chunk_bytes = CHUNK * WIDTH * 4
    with gl.DataGadget(path, placement="file", cache_bytes=3 * chunk_bytes) as g:
        store = g.store
        rng = np.random.default_rng(1)
        for _ in range(20):
            ids = rng.integers(0, ROWS, 30)
            assert np.array_equal(g.getData(ids).cpu().numpy(), table().numpy()[ids])
            assert store.cached_bytes <= 3 * chunk_bytes
        before = dict(store.stats)
        g.getData([200, 201])  # the last chunk read is cached
        g.getData([200, 201])
        assert store.stats["hits"] > before["hits"]
    with gl.DataGadget(path, placement="file", cache_bytes=0) as g:
        g.getData([0, 1])
        g.getData([0, 1])
        assert g.store.cached_bytes == 0 and g.store.stats["hits"] == 0


def test_file_store_options(tmp_path: Path) -> None:
    path = write(table(), tmp_path / "t.npy")
    with pytest.raises(gl.GadgetTypeError, match="cache_bytes"):
        gl.DataGadget(path, placement="file", cache_mb=5)
    with pytest.raises(gl.GadgetValueError, match="cache_bytes"):
        gl.DataGadget(path, placement="file", cache_bytes=-1)
    store = file_store(path, cache_bytes=1 << 20, block_rows=10)
    try:
        assert store.block_rows == 10 and store.placement == "file" and store.device_view() is None
        assert store.host_view() is None
        assert "FileStore npy" in repr(store)
    finally:
        store.close()


def test_elementwise_initializers_only(tmp_path: Path) -> None:
    path = write(table(), tmp_path / "t.h5")
    with gl.DataGadget(path, placement="file") as g:
        g.fill_(3.0)
        assert torch.all(g.getData(range(ROWS)) == 3.0)
        with pytest.raises(gl.GadgetTypeError, match="xavier"):
            g.init_(torch.nn.init.xavier_uniform_)
    assert np.all(on_disk(path) == 3.0)


def test_save_and_load_from_a_file_store(tmp_path: Path) -> None:
    src = table()
    path = write(src, tmp_path / "t.zarr")
    with gl.DataGadget(path, placement="file") as g:
        g.save(tmp_path / "copy.h5", dataset="x", progress=False)
        g.load(tmp_path / "copy.h5", dataset="x")
        assert g.placement == "file" and torch.equal(g.getData(range(ROWS)).cpu(), src)
    assert np.array_equal(on_disk(tmp_path / "copy.h5", "x"), src.numpy())


# ---- pickling --------------------------------------------------------------------------------------------------
def test_file_gadget_pickles_without_its_rows(tmp_path: Path, fmt: str) -> None:
    src = table(rows=20000)
    path = write(
        src, tmp_path / f"big{FORMATS[fmt]}", **({} if fmt == "npy" else {"chunk_rows": 1000})
    )
    with gl.DataGadget(path, placement="file") as g:
        g.getData([1, 2])  # the file is open and a block cached
        blob = pickle.dumps(g)
        assert len(blob) < 4000 < src.numel() * 4
        copy = pickle.loads(blob)
        try:
            assert copy.placement == "file" and copy.store.cached_bytes == 0
            assert torch.equal(copy.getData([19999, 0]).cpu(), src[[19999, 0]])
        finally:
            copy.close()


def test_cpu_gadget_pickles_by_value() -> None:
    src = table()
    with gl.DataGadget(src, placement="cpu") as g:
        copy = pickle.loads(pickle.dumps(g))
        assert torch.equal(copy.getData(range(ROWS)).cpu(), src)
        copy.insertData(torch.zeros(1, WIDTH), [0])
        assert torch.equal(g.getData(0).cpu(), src[0])  # an independent copy


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["cuda", pytest.param("pinned", marks=NEEDS_CUPY)])
def test_gpu_gadgets_refuse_to_pickle(placement: str) -> None:
    with (
        gl.DataGadget(table(), placement=placement) as g,
        pytest.raises(gl.GadgetTypeError, match="placement='file'"),
    ):
        pickle.dumps(g)


# ---- optional dependencies ------------------------------------------------------------------------------------------
def test_missing_h5py_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(table(), tmp_path / "t.h5")
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(gl.MissingDependencyError, match=r"pip install 'gadgetloader\[hdf5\]'"):
        gl.DataGadget(path, placement="cpu")
    with pytest.raises(gl.MissingDependencyError, match="hdf5"):
        gl.DataGadget(table(), placement="cpu").save(tmp_path / "new.h5")
    assert not (tmp_path / "new.h5").exists()


def test_missing_zarr_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(table(), tmp_path / "t.zarr")
    monkeypatch.setitem(sys.modules, "zarr", None)
    with pytest.raises(gl.MissingDependencyError, match=r"pip install 'gadgetloader\[zarr\]'"):
        gl.DataGadget(path, placement="file")
    with pytest.raises(gl.MissingDependencyError, match=r"zarr>=3"):
        gl.DataGadget(table(), placement="cpu").save(tmp_path / "new.zarr")


def test_import_needs_neither_h5py_nor_zarr() -> None:
    import subprocess

    code = (
        "import sys; sys.modules['h5py'] = None; sys.modules['zarr'] = None\n"
        "import gadgetloader, gadgetloader.io, gadgetloader.stores, gadgetloader.convert\n"
        "import gadgetloader.bench._files\n"
        "assert 'h5py' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("ext", "options"),
    [
        (".h5", {}),
        (".h5", {"compression": "gzip"}),
        (".zarr", {}),
        (".zarr", {"compression": "none"}),
    ],
)
def test_many_chunks_are_read_on_the_thread_pool(
    tmp_path: Path, ext: str, options: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gadgetloader.io import _chunks

    monkeypatch.setattr(_chunks.os, "cpu_count", lambda: 4)  # take the threaded path even on 1 core
    monkeypatch.setattr(_chunks, "_PARALLEL_BYTES", 0)  # ... and for this small table
    calls: list[int] = []
    real = _chunks.thread_pool

    def counting() -> object:
        calls.append(1)
        return real()

    monkeypatch.setattr(_chunks, "thread_pool", counting)
    src = table(rows=2003)
    path = write(src, tmp_path / f"t{ext}", chunk_rows=8, **options)  # 251 chunks
    with gl.DataGadget(path, placement="cpu") as g:
        assert torch.equal(g.getData(range(2003)).cpu(), src)
    with gl.DataGadget(path, placement="file", cache_bytes=20 * 8 * WIDTH * 4) as g:
        ids = np.random.default_rng(0).integers(0, 2003, 1500)
        assert torch.equal(g.getData(ids).cpu(), src[ids])
        assert torch.equal(g.getData(ids[::-1].copy()).cpu(), src[ids[::-1].copy()])
        assert torch.equal(g.store.read_block(3, 1990), src[3:1990])
    assert calls  # the pool was used


def test_raw_hdf5_rows_are_read_through_a_memory_map(tmp_path: Path) -> None:
    src = table(rows=2000)
    path = write(src, tmp_path / "raw.h5", chunk_rows=64)  # uncompressed chunks
    with gl.DataGadget(path, placement="file", cache_bytes=1 << 20, device="cpu") as g:
        ids = np.random.default_rng(0).integers(0, 2000, 40)  # sparse: about one id per chunk
        ids[3] = ids[7]  # and a repeat
        assert np.array_equal(g.getData(ids).numpy(), src.numpy()[ids])
        assert g.store.stats["misses"] == 0 and g.store.cached_bytes == 0  # no whole chunks read
        dense = np.arange(100, 400)  # dense requests too: the page cache is the cache
        assert np.array_equal(g.getData(dense).numpy(), src.numpy()[dense])
        assert g.store.stats["misses"] == 0
        g.insertData(torch.zeros(1, WIDTH), [ids[0]])  # a writable handle: chunk reads again
        assert not g.getData(ids).numpy()[0].any()
        assert np.array_equal(
            g.getData(ids).numpy()[1:], src.numpy()[ids][1:] * (ids[1:, None] != ids[0])
        )
        assert g.store.stats["misses"] > 0
