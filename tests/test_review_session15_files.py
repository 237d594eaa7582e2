"""Session 15 review: the storage layer (DataGadget over .npy / HDF5 / zarr files, the
file-backed store and ``gadgetloader convert``) checked against NumPy as the reference.

Tests marked ``# DEFECT:`` fail against the code as reviewed; the others pin behaviour
that was checked and found right.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import gadgetloader as gl
import gadgetloader.convert as gl_convert
import gadgetloader.io._stream as gl_stream
from gadgetloader.convert import convert

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def _as_np_ids(ids: object) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        return ids.cpu().numpy().astype(np.int64)
    if isinstance(ids, range):
        return np.array(list(ids), dtype=np.int64)
    return np.asarray(ids, dtype=np.int64)


def _table(kind: str, base: np.ndarray, tmp_path: Path) -> gl.DataGadget:
    if kind == "cpu":
        return gl.DataGadget(base.copy(), placement="cpu")
    path = tmp_path / f"t.{kind}"
    gl.DataGadget(base.copy(), placement="cpu").save(path)
    return gl.DataGadget(str(path), placement="file", cache_bytes=0)


_ID_FORMS = {
    "repeats": [3, 3, 1, 3],
    "unsorted": [5, 2, 9, 0],
    "empty-list": [],
    "numpy-0d": np.int64(4),
    "numpy-0d-array": np.array(4),
    "torch-0d": torch.tensor(4),
    "tuple": (1, 2, 2),
    "range": range(3, 8, 2),
    "int32": np.array([1, 2, 11], dtype=np.int32),
    "torch-int32": torch.tensor([7, 1], dtype=torch.int32),
    "2d": np.array([[1, 2], [3, 1]]),
    "empty-int64": np.array([], dtype=np.int64),
    "python-int": 7,
    "torch-strided": torch.arange(12)[::3],
    "torch-expanded": torch.tensor([2]).expand(5),
}


@pytest.mark.parametrize("kind", ["cpu", "npy", "h5", "zarr"])
def test_gather_and_scatter_follow_numpy_for_every_id_form(kind: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((12, 3, 2)).astype(np.float32)
    g = _table(kind, base, tmp_path)
    ref = base.copy()
    try:
        for name, ids in _ID_FORMS.items():
            a = _as_np_ids(ids)
            got = _np(g.getData(ids))
            assert got.shape == ref[a].shape, name
            np.testing.assert_array_equal(got, ref[a], err_msg=name)
            data = rng.standard_normal(a.shape + (3, 2)).astype(np.float32)
            g.insertData(torch.from_numpy(data), ids)
            ref[a] = data  # NumPy: sequential assignment, the last repeat wins
            np.testing.assert_array_equal(g.getNumpyVersion(), ref, err_msg=name)
    finally:
        g.close()


@pytest.mark.parametrize("kind", ["npy", "h5", "zarr"])
def test_negative_ids_and_masks_are_refused_and_the_file_is_unchanged(
    kind: str, tmp_path: Path
) -> None:
    base = np.arange(60, dtype=np.float32).reshape(20, 3)
    g = _table(kind, base, tmp_path)
    bad = {
        "negative": ([1, -1], torch.ones(2, 3)),
        "negative-int": (-1, torch.ones(3)),
        "negative-range": (range(-1, 2), torch.ones(3, 3)),
        "torch-mask": (torch.zeros(20, dtype=torch.bool), torch.ones(20, 3)),
        "numpy-mask": (np.zeros(20, dtype=bool), torch.ones(20, 3)),
    }
    try:
        for name, (ids, rows) in bad.items():
            with pytest.raises(gl.GadgetError):
                g.insertData(rows, ids)
            with pytest.raises(gl.GadgetError):
                g.getData(ids)
            np.testing.assert_array_equal(g.getNumpyVersion(), base, err_msg=name)
    finally:
        g.close()
    back = gl.DataGadget(str(tmp_path / f"t.{kind}"), placement="cpu")
    np.testing.assert_array_equal(back.getNumpyVersion(), base)


_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _values(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
        flat = t.view(-1)
        flat[0], flat[1], flat[2] = float("nan"), float("-inf"), -0.0
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bool else t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_convert_chain_across_every_format_keeps_dtype_shape_and_bits(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    chain = ["h5", "zarr", "h5"] if dtype == torch.bfloat16 else ["h5", "zarr", "npy", "h5"]
    for shape in [(7,), (7, 3), (5, 2, 3)]:
        t = _values(dtype, shape)
        prev = None
        for i, ext in enumerate(chain):
            path = tmp_path / f"{len(shape)}-{i}.{ext}"
            if prev is None:
                gl.DataGadget(t, placement="cpu").save(path, chunk_rows=2)
            else:
                convert(prev, path, progress=False)
            back = gl.DataGadget(str(path), placement="cpu")
            assert back.dtype == dtype and tuple(back.shape) == shape, (ext, shape)
            assert torch.equal(_bits(back.as_tensor().cpu()), _bits(t)), (ext, shape)
            with gl.DataGadget(str(path), placement="file") as f:
                rows = f.getData(range(shape[0])).cpu()
                assert torch.equal(_bits(rows), _bits(t)), (ext, shape, "file")
            prev = path


@pytest.mark.parametrize(
    ("module", "sink", "ext"),
    [
        ("gadgetloader.io._npy", "NpySink", "npy"),
        ("gadgetloader.io._hdf5", "Hdf5Sink", "h5"),
        ("gadgetloader.io._zarr", "ZarrSink", "zarr"),
    ],
)
def test_convert_failing_mid_write_keeps_the_old_target_and_leaves_no_temporary(
    module: str, sink: str, ext: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    old = np.arange(9, dtype=np.float32).reshape(3, 3)
    target = tmp_path / f"out.{ext}"
    gl.DataGadget(old, placement="cpu").save(target)
    src = tmp_path / "src.npy"
    np.save(src, np.ones((500, 3), np.float32))
    monkeypatch.setattr(gl_convert, "STAGING_BYTES", 600)  # many blocks
    cls = getattr(importlib.import_module(module), sink)
    real = cls.write
    calls = []

    def failing(self, start, rows):  # type: ignore[no-untyped-def]
        calls.append(start)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, start, rows)

    monkeypatch.setattr(cls, "write", failing)
    before = _listing(tmp_path)
    kw = {} if ext == "npy" else {"chunk_rows": 10}
    with pytest.raises(OSError, match="simulated"):
        convert(src, target, progress=False, **kw)
    assert len(calls) == 2
    assert _listing(tmp_path) == before  # no hidden .partial file or directory
    np.testing.assert_array_equal(
        gl.DataGadget(str(target), placement="cpu").getNumpyVersion(), old
    )


def test_progress_bars_of_chunked_saves_loads_and_converts_count_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bars: list = []

    class Bar:
        def __init__(self, total, desc, disable, **kw):  # type: ignore[no-untyped-def]
            self.total, self.desc, self.disable, self.n = total, desc, disable, 0
            bars.append(self)

        def update(self, n):  # type: ignore[no-untyped-def]
            self.n += n

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            return None

    monkeypatch.setattr(gl_stream, "tqdm", Bar)
    monkeypatch.setattr(gl_stream, "STAGING_BYTES", 1000)
    monkeypatch.setattr(gl_convert, "STAGING_BYTES", 1000)
    a = np.arange(3000, dtype=np.float32).reshape(1000, 3)
    g = gl.DataGadget(a, placement="cpu")
    for ext in ("npy", "h5", "zarr"):
        path = tmp_path / f"a.{ext}"
        g.save(path, progress=True, **({} if ext == "npy" else {"chunk_rows": 7}))
        gl.DataGadget(str(path), placement="cpu", progress=True)
        convert(path, tmp_path / f"b-{ext}.{'zarr' if ext == 'h5' else 'h5'}", progress=True)
    assert len(bars) == 9
    for bar in bars:
        assert not bar.disable and bar.total == a.nbytes and bar.n == a.nbytes, bar.desc


# DEFECT: a gzip HDF5 file table whose block_rows does not divide the chunk length raises a false "truncated" GadgetFileError on a valid insertData, after writing part of the rows
def test_hdf5_gzip_file_table_with_unaligned_block_rows_writes_like_numpy(tmp_path: Path) -> None:
    path = tmp_path / "g.h5"
    n = 200
    ref = np.zeros((n, 8), np.float32)
    gl.DataGadget(ref.copy(), placement="cpu").save(path, chunk_rows=7, compression="gzip")
    ids = np.arange(0, n, 4)
    rows = np.random.default_rng(0).standard_normal((ids.size, 8)).astype(np.float32)
    g = gl.DataGadget(str(path), placement="file", block_rows=3)
    try:
        g.insertData(torch.from_numpy(rows), ids)
    finally:
        g.close()
    ref[ids] = rows
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["data"][:], ref)


# DEFECT: a gzip-compressed HDF5 dataset with unallocated chunks (h5py's create_dataset without data) makes a file table with a small cache raise a bare MemoryError on insertData and on later reads
def test_hdf5_gzip_dataset_with_unallocated_chunks_is_writable_without_a_cache(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fresh.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(100, 4), dtype="f4", chunks=(10, 4), compression="gzip")
    g = gl.DataGadget(str(path), placement="file", cache_bytes=0)
    try:
        g.insertData(torch.full((1, 4), 7.0), [15])
        got = _np(g.getData([15, 16, 55]))
    finally:
        g.close()
    np.testing.assert_array_equal(got, np.array([[7.0] * 4, [0.0] * 4, [0.0] * 4], np.float32))
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["x"][15], np.full(4, 7.0, np.float32))


# DEFECT: a slice into the rows with a negative or zero step (or non-integer bounds) escapes as torch's bare ValueError / TypeError instead of a GadgetError (NumPy takes [..., ::-1])
@pytest.mark.parametrize(
    "inner",
    [slice(None, None, -1), slice(0, 4, 0), slice(0.5, 3)],
    ids=["negative-step", "zero-step", "float-bound"],
)
def test_row_part_slices_follow_numpy_or_are_gadget_errors(inner: slice) -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    g = gl.DataGadget(a.copy(), placement="cpu")
    try:
        want = a[0:2, inner]
    except (TypeError, ValueError):
        want = None
    try:
        got = g.getData((slice(0, 2), inner))
    except gl.GadgetError:
        got = None  # a refusal must be the library's own error (a bare one fails here)
    if got is not None:
        assert want is not None
        np.testing.assert_array_equal(_np(got), want)
    try:
        rows = torch.zeros(want.shape if want is not None else (2, 3))
        g.insertData(rows, (slice(0, 2), inner))
    except gl.GadgetError:
        np.testing.assert_array_equal(g.getNumpyVersion(), a)


# DEFECT: g[[1, 2], 0] (list of ids, then an int into the row, as torch and NumPy index) is refused as a "ragged tuple" of ids
def test_list_of_ids_with_an_int_into_the_row_indexes_like_numpy() -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    g = gl.DataGadget(a.copy(), placement="cpu")
    np.testing.assert_array_equal(_np(g[[1, 2], 0]), a[[1, 2], 0])
    g[[3, 0], -1] = torch.tensor([50.0, 60.0])
    want = a.copy()
    want[[3, 0], -1] = [50.0, 60.0]
    np.testing.assert_array_equal(g.getNumpyVersion(), want)
