"""The fast read paths of file stores, each checked bit for bit against NumPy.

* HDF5 rows gathered through a memory map of the file (raw chunks, contiguous datasets),
  and every case that must fall back to whole-chunk reads;
* zarr chunk files read and decoded directly (every codec and chunk-key layout that
  reaches that path), and the arrays that must go through zarr;
* the chunk thread pool's bounded concurrency;
* a pinned store's background page-locking (with a stand-in for CuPy: the real
  registration runs only on the GPU machine, in tests/test_files.py's pinned cases).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import zarr

import gadgetloader as gl
from gadgetloader._dtypes import SUPPORTED_DTYPES, dtype_name, numpy_dtype
from gadgetloader.io import _chunks, load_into, open_source
from gadgetloader.io._base import SourceShape

ROWS, WIDTH = 301, 5


def table(dtype: torch.dtype, rows: int = ROWS, width: int = WIDTH, seed: int = 0) -> np.ndarray:
    """Random rows as NumPy bits (bfloat16 as its uint16 bit patterns)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, (rows, width), generator=g).bool()
    elif dtype.is_floating_point:
        t = (torch.randn(rows, width, generator=g) * 50).to(dtype)
    else:
        lo = 0 if dtype == torch.uint8 else -100
        t = torch.randint(lo, 100, (rows, width), generator=g).to(dtype)
    if dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def got(g: gl.DataGadget, ids: np.ndarray) -> np.ndarray:
    out = g.getData(ids).cpu()
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16).numpy().view(np.uint16)
    return out.numpy()


def id_sets(rows: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [
        rng.integers(0, rows, 7),  # sparse, with any repeats chance gives
        np.array([rows - 1, 0, rows - 1, 3, 3]),  # both ends, repeated
        rng.permutation(rows),  # every row, shuffled
        np.arange(rows)[::-1].copy(),
    ]


def check_reads(path: Path, want: np.ndarray, **kwargs: Any) -> gl.DataGadget:
    g = gl.DataGadget(path, placement="file", device="cpu", **kwargs)
    for ids in id_sets(want.shape[0]):
        assert np.array_equal(got(g, ids), want[ids]), ids
    return g


DTYPES = [pytest.param(d, id=dtype_name(d)) for d in SUPPORTED_DTYPES]


# ---- HDF5: rows through a memory map --------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["chunked", "contiguous"])
def test_hdf5_rows_through_the_map_every_dtype(
    tmp_path: Path, dtype: torch.dtype, layout: str
) -> None:
    want = table(dtype)
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("emb", data=want, chunks=(16, WIDTH) if layout == "chunked" else None)
        if dtype == torch.bfloat16:
            ds.attrs["gadgetloader_dtype"] = "bfloat16"
    with check_reads(path, want, cache_bytes=0) as g:
        assert g.dtype == dtype
        assert g.store.stats["misses"] == 0  # no whole chunks: every row came through the map


@pytest.mark.parametrize(
    "case", ["gzip", "big-endian", "partial-row-chunks", "unallocated", "userblock"]
)
def test_hdf5_files_the_map_cannot_serve_fall_back(tmp_path: Path, case: str) -> None:
    want = table(torch.float32)
    path = tmp_path / "t.h5"
    opts: dict[str, Any] = {"chunks": (16, WIDTH)}
    file_opts: dict[str, Any] = {}
    data = want
    if case == "gzip":
        opts["compression"] = "gzip"
    elif case == "big-endian":
        data = want.astype(">f4")
    elif case == "partial-row-chunks":
        opts["chunks"] = (16, 2)
    elif case == "userblock":
        file_opts["userblock_size"] = 512
    with h5py.File(path, "w", **file_opts) as f:
        if case == "unallocated":
            ds = f.create_dataset("emb", shape=want.shape, dtype=want.dtype, fillvalue=7.5, **opts)
            ds[32:200] = want[32:200]  # chunks 0-1 and the tail are never written
            want = want.copy()
            want[:32] = 7.5
            want[200:] = 7.5
        else:
            f.create_dataset("emb", data=data, **opts)
    with check_reads(path, want, cache_bytes=1 << 16):
        pass


def test_hdf5_contiguous_dataset_never_written(tmp_path: Path) -> None:
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("emb", shape=(40, 3), dtype="f8", fillvalue=1.5)  # not allocated
        f.create_dataset("other", data=np.arange(4))
    with check_reads(path, np.full((40, 3), 1.5), dataset="emb"):
        pass


def test_hdf5_map_follows_writes_through_the_store(tmp_path: Path) -> None:
    want = table(torch.int32)
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("emb", data=want, chunks=(8, WIDTH))
    with gl.DataGadget(path, placement="file", device="cpu") as g:
        ids = np.array([5, 100, 5, 300])
        assert np.array_equal(got(g, ids), want[ids])
        g.insertData(torch.full((2, WIDTH), -9, dtype=torch.int32), [100, 7])
        want[[100, 7]] = -9
        every = np.arange(ROWS)
        assert np.array_equal(got(g, every), want)
    with check_reads(path, want):  # and a fresh read-only handle maps the written file
        pass


# ---- zarr: chunk files read and decoded directly ------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compression", ["zstd", "gzip", "blosc", "none"])
def test_zarr_direct_chunks_every_dtype_and_codec(
    tmp_path: Path, dtype: torch.dtype, compression: str
) -> None:
    want = table(dtype)
    src = torch.from_numpy(want)
    if dtype == torch.bfloat16:
        src = src.view(torch.int16).view(torch.bfloat16)
    path = tmp_path / "t.zarr"
    with gl.DataGadget(src, placement="cpu") as g:
        g.save(path, chunk_rows=16, compression=compression, progress=False)
    source = open_source(path)
    assert source._decoders is not None  # type: ignore[attr-defined]  # the direct path
    with check_reads(path, want, cache_bytes=3 * 16 * WIDTH * want.itemsize) as g:
        assert g.dtype == dtype


@pytest.mark.parametrize(
    "layout", ["v3-default", "v3-dot-keys", "v3-v2-keys", "v2-dot", "v2-slash", "group"]
)
def test_zarr_direct_chunks_every_key_layout(tmp_path: Path, layout: str) -> None:
    want = table(torch.float32)
    path = tmp_path / "t.zarr"
    kw: dict[str, Any] = {"shape": want.shape, "chunks": (16, WIDTH), "dtype": want.dtype}
    dataset = None
    if layout == "v3-dot-keys":
        kw["chunk_key_encoding"] = {"name": "default", "separator": "."}
    elif layout == "v3-v2-keys":
        kw["chunk_key_encoding"] = {"name": "v2", "separator": "."}
    elif layout == "v2-dot":
        kw["zarr_format"] = 2
    elif layout == "v2-slash":
        kw["zarr_format"] = 2
        kw["chunk_key_encoding"] = {"name": "v2", "separator": "/"}
    if layout == "group":
        grp = zarr.open_group(str(path), mode="w")
        arr = grp.create_array("a/b", **kw)
        grp.create_array("c", shape=(2,), dtype="i1")
        dataset = "a/b"
    else:
        arr = zarr.create_array(str(path), **kw)
    arr[:] = want
    source = open_source(path, dataset=dataset)
    assert source._decoders is not None  # type: ignore[attr-defined]
    key = source._chunk_file(3)  # type: ignore[attr-defined]
    assert Path(key).is_file()
    with check_reads(path, want, dataset=dataset, cache_bytes=0):
        pass


def test_zarr_missing_chunks_read_as_fill_value(tmp_path: Path) -> None:
    path = tmp_path / "t.zarr"
    arr = zarr.create_array(
        str(path), shape=(100, 4), chunks=(8, 4), dtype="i2", fill_value=-3, compressors=None
    )
    arr[20:30] = 1
    want = np.full((100, 4), -3, dtype=np.int16)
    want[20:30] = 1
    with check_reads(path, want, cache_bytes=0):
        pass


@pytest.mark.parametrize("case", ["sharded", "partial-row-chunks", "big-endian", "transposed"])
def test_zarr_arrays_the_direct_path_cannot_serve_go_through_zarr(
    tmp_path: Path, case: str
) -> None:
    want = table(torch.float64)
    path = tmp_path / "t.zarr"
    kw: dict[str, Any] = {"shape": want.shape, "chunks": (16, WIDTH), "dtype": want.dtype}
    if case == "sharded":
        kw["shards"] = (64, WIDTH)
    elif case == "partial-row-chunks":
        kw["chunks"] = (16, 2)
    elif case == "big-endian":
        from zarr.codecs import BytesCodec

        kw["serializer"] = BytesCodec(endian="big")
    elif case == "transposed":
        from zarr.codecs import TransposeCodec

        kw["filters"] = [TransposeCodec(order=(1, 0))]
    arr = zarr.create_array(str(path), **kw)
    arr[:] = want
    assert open_source(path)._decoders is None  # type: ignore[attr-defined]
    with check_reads(path, want, cache_bytes=1 << 12):
        pass


def test_zarr_damaged_chunk_is_a_clear_error(tmp_path: Path) -> None:
    want = table(torch.float32)
    path = tmp_path / "t.zarr"
    with gl.DataGadget(torch.from_numpy(want), placement="cpu") as g:
        g.save(path, chunk_rows=16, progress=False)
    chunk = Path(open_source(path)._chunk_file(2))  # type: ignore[attr-defined]
    chunk.write_bytes(chunk.read_bytes()[:10])
    with (
        gl.DataGadget(path, placement="file", device="cpu") as g,
        pytest.raises(gl.GadgetFileError, match="chunk 2"),
    ):
        g.getData([40])


# ---- the chunk pool ------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_nbytes", [1 << 10, 1 << 20])
def test_for_each_chunk_calls_every_pair_once(
    monkeypatch: pytest.MonkeyPatch, chunk_nbytes: int
) -> None:
    monkeypatch.setattr(_chunks.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(_chunks, "_PARALLEL_BYTES", 0)
    seen: list[tuple[int, int]] = []
    threads: set[int] = set()
    lock = threading.Lock()

    def fn(k: int, s: int) -> None:
        time.sleep(0.0005)
        with lock:
            seen.append((k, s))
            threads.add(threading.get_ident())

    ks = list(range(1000, 1500))
    _chunks.for_each_chunk(fn, ks, [k - 1000 for k in ks], chunk_nbytes)
    assert sorted(seen) == [(k, k - 1000) for k in ks]
    assert len(threads) <= _chunks._concurrency(chunk_nbytes)
    assert _chunks._concurrency(1 << 10) == _chunks._SMALL_CHUNK_THREADS
    assert _chunks._concurrency(1 << 20) == 8


def test_for_each_chunk_raises_what_a_chunk_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_chunks.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(_chunks, "_PARALLEL_BYTES", 0)

    def fn(k: int, _s: int) -> None:
        if k == 77:
            raise gl.GadgetFileError("chunk 77 is damaged")

    with pytest.raises(gl.GadgetFileError, match="chunk 77"):
        _chunks.for_each_chunk(fn, list(range(200)), list(range(200)), 1 << 20)


# ---- pinned stores page-lock themselves while a load reads -------------------------------------------
class _FakeRuntime:
    """Records cudaHostRegister calls; optionally slow or failing."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay, self.fail = delay, fail
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.devices: list[int] = []
        self.threads: list[str] = []

    def getDevice(self) -> int:  # noqa: N802 - CUDA's name
        return 0

    def setDevice(self, d: int) -> None:  # noqa: N802
        self.devices.append(d)

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:  # noqa: N802
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("cudaErrorMemoryAllocation")
        self.registered.append((ptr, size, flags))

    def hostUnregister(self, ptr: int) -> None:  # noqa: N802
        self.unregistered.append(ptr)

    def deviceSynchronize(self) -> None:  # noqa: N802
        pass

    def pointerGetAttributes(self, ptr: int) -> Any:  # noqa: N802
        return type("Attrs", (), {"devicePointer": ptr})()


class _FakeCupy:
    def __init__(self, runtime: _FakeRuntime) -> None:
        self.cuda = type("Cuda", (), {"runtime": runtime})()


def _fake(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> _FakeRuntime:
    from gadgetloader.stores import _pinned

    rt = _FakeRuntime(**kw)
    monkeypatch.setattr(_pinned, "get_cupy", lambda what: _FakeCupy(rt))
    return rt


def test_host_buffer_registers_whole_in_the_background(monkeypatch: pytest.MonkeyPatch) -> None:
    from gadgetloader.stores import HostBuffer

    rt = _fake(monkeypatch, delay=0.2)
    t0 = time.perf_counter()
    buf = HostBuffer(1 << 20, background=True)
    assert time.perf_counter() - t0 < 0.15  # did not wait for the registration
    assert buf.pending
    buf.array[:] = 7  # the caller fills it meanwhile
    buf.wait()
    assert not buf.pending
    assert rt.registered == [(buf.host_ptr, 1 << 20, 3)]  # one registration, the whole buffer
    assert rt.threads == ["gadgetloader-pin"] and rt.devices == [0]
    assert buf.device_ptr == buf.host_ptr and (buf.array == 7).all()
    ptr = buf.host_ptr
    del buf
    import gc

    gc.collect()
    assert rt.unregistered == [ptr]  # unregistered when collected


def test_host_buffer_registers_at_once_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from gadgetloader.stores import HostBuffer

    rt = _fake(monkeypatch)
    buf = HostBuffer(5000)
    assert not buf.pending and rt.registered == [(buf.host_ptr, 5000, 3)]
    assert rt.threads == ["MainThread"]


def test_background_registration_failure_is_a_memory_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gadgetloader.stores import HostBuffer

    _fake(monkeypatch, fail=True)
    buf = HostBuffer(1 << 16, background=True)
    for _ in range(2):  # and stays one
        with pytest.raises(MemoryError, match="ulimit -l"):
            buf.wait()
    with pytest.raises(MemoryError, match="ulimit -l"):
        HostBuffer(1 << 16)


def test_load_waits_for_a_store_that_is_still_getting_ready(tmp_path: Path) -> None:
    want = table(torch.float32, rows=1000)
    path = tmp_path / "t.npy"
    np.save(path, want)
    source = open_source(path)
    assert isinstance(source.shape, SourceShape) and source.shape == want.shape

    class Store:
        """A host store that is not ready until waited for."""

        def __init__(self) -> None:
            self.host = torch.zeros(want.shape)
            self.waited_after: int | None = None

        def host_view(self) -> torch.Tensor:
            return self.host

        def wait_ready(self) -> None:
            self.waited_after = int((self.host != 0).any(dim=1).sum())

    store = Store()
    with source:
        load_into(source, store, progress=False)  # type: ignore[arg-type]
    assert np.array_equal(store.host.numpy(), want)
    assert store.waited_after == 1000  # waited once, after every row was read


def test_source_shapes_stay_plain_tuples_elsewhere(tmp_path: Path) -> None:
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((4, 2), dtype=numpy_dtype(torch.float32)))
    with open_source(path) as src:
        assert src.shape == (4, 2) and src.shape[1:] == (2,) and type(src.shape[1:]) is tuple
    with gl.DataGadget(path, placement="cpu") as g:
        assert type(g.shape) is tuple


def test_populate_keeps_what_another_thread_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    from gadgetloader.stores import _pinned

    monkeypatch.setattr(_pinned, "_POPULATE_SLICE", 1 << 20)  # many slices, several threads
    n = 24 << 20
    mm = mmap.mmap(-1, n)
    words = np.frombuffer(mm, dtype=np.int64)
    pattern = np.arange(words.size, dtype=np.int64) * 7 + 1

    def writer() -> None:
        for o in range(0, words.size, 1 << 16):
            words[o : o + (1 << 16)] = pattern[o : o + (1 << 16)]

    th = threading.Thread(target=writer)
    th.start()
    supported = _pinned.populate(words.ctypes.data, n, threads=4)
    th.join()
    assert np.array_equal(words, pattern)
    if supported:  # Linux 5.14+: every page is resident now
        fresh = mmap.mmap(-1, 4 << 20)
        zeros = np.frombuffer(fresh, dtype=np.uint8)
        assert _pinned.populate(zeros.ctypes.data, zeros.size)
        assert not zeros.any()
        del zeros
        fresh.close()


def test_populate_is_skipped_where_the_kernel_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    from gadgetloader.stores import HostBuffer, _pinned

    calls: list[int] = []

    def failing(ptr: int, size: int, advice: int) -> int:
        calls.append(advice)
        return -1  # EINVAL before Linux 5.14

    monkeypatch.setattr(_pinned, "_LIBC", [failing])
    assert not _pinned.populate(1 << 12, 1 << 30)
    assert calls == [_pinned._MADV_POPULATE_WRITE]  # one try, then nothing
    rt = _fake(monkeypatch)
    buf = HostBuffer(1 << 16)  # registration still happens
    assert rt.registered == [(buf.host_ptr, 1 << 16, 3)]


@pytest.mark.parametrize("case", ["raw", "gzip", "zarr"])
def test_overlapped_block_loads_are_exact_and_raise_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    from gadgetloader.io import _stream

    monkeypatch.setattr(_stream, "STAGING_BYTES", 16 * WIDTH * 4 * 2)  # two chunks per block
    want = table(torch.float32, rows=1001)
    path = tmp_path / ("t.zarr" if case == "zarr" else "t.h5")
    with gl.DataGadget(torch.from_numpy(want), placement="cpu") as g:
        opts = {"compression": "gzip"} if case == "gzip" else {}
        g.save(path, chunk_rows=16, progress=False, **opts)
    with open_source(path) as source:
        assert source.concurrent_reads  # type: ignore[attr-defined]
    with gl.DataGadget(path, placement="cpu") as g:
        assert np.array_equal(g.getNumpyVersion(), want)
    real = type(open_source(path)).read_into

    def flaky(self: Any, start: int, stop: int, out: np.ndarray) -> None:
        if start <= 500 < stop:
            raise gl.GadgetFileError("disk gone at row 500")
        real(self, start, stop, out)

    monkeypatch.setattr(type(open_source(path)), "read_into", flaky)
    with pytest.raises(gl.GadgetFileError, match="row 500"):
        gl.DataGadget(path, placement="cpu")


def test_chunk_reads_leave_no_descriptor_open(tmp_path: Path) -> None:
    import os

    want = table(torch.float32, rows=500)
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("emb", data=want, chunks=(16, WIDTH), compression="gzip")
    with gl.DataGadget(path, placement="file", device="cpu", cache_bytes=0) as g:
        got(g, np.arange(0, 500, 7))
        before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
        for _ in range(20):
            assert np.array_equal(got(g, np.arange(0, 500, 3)), want[::3])
        if before:
            assert len(os.listdir("/proc/self/fd")) == before
