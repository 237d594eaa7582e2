"""Session 35 review: property-based checks of DataGadget tables against a NumPy model.

Written from README.md, SPEC.md and the public docstrings only. Every table is built
with ``placement='cpu'`` or ``placement='file'`` and ``device='cpu'``, so the file runs
the same on a CPU-only machine and on a GPU host (no fallback, no CUDA involved).

Tables: ``cpu`` (0 rows allowed) and ``file`` tables backed by .npy, HDF5 (written with
h5py: contiguous or chunked, compressed or not; bfloat16 through ``save``) and zarr.
Each drawn sequence of operations (gathers with every id form, writes with repeated ids,
row-part indexes, NumPy conversions, saves to every format, ``load``, closing and
reopening the file, and bad calls that must raise the documented error and change
nothing) is applied to the table and to a NumPy model; after each one they must agree.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

pytestmark = pytest.mark.filterwarnings("error")

#: ``np.asarray(x, copy=False)`` is NumPy 2's protocol
NEEDS_NUMPY2 = pytest.mark.skipif(
    np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="np.asarray(copy=) needs NumPy 2"
)

# Hypothesis' pytest plugin imports its patch writer (libcst, mypy_extensions) only when a
# test fails, inside pytest's report hook, where that import's DeprecationWarning (made an
# error by the project's filterwarnings) would crash the run: import it now, quietly.
with warnings.catch_warnings(), contextlib.suppress(Exception):
    warnings.simplefilter("ignore")
    import hypothesis.extra._patching  # noqa: F401

CPU = "cpu"

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
FILE_KINDS = ["npy", "h5", "zarr"]
NP_ID_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
TORCH_ID_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _settings(n: int) -> Any:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        # no shrinking: a failure is reported as found, so a failing run stays short
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )


# --------------------------------------------------------------------------- model helpers


def np_dtype(dt: torch.dtype) -> np.dtype:
    """The model's dtype: the table's, with bfloat16 modelled as float32 (exact)."""
    if dt == torch.bfloat16:
        return np.dtype(np.float32)
    return torch.empty(0, dtype=dt).numpy().dtype


def to_torch(a: np.ndarray, dt: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np_dtype(dt), copy=True)).to(dt)


def to_np(t: torch.Tensor) -> np.ndarray:
    assert isinstance(t, torch.Tensor)
    assert t.device.type == "cpu", t.device
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.to(torch.float32).numpy()
    return t.numpy()


def assert_same(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Same shape, dtype and bytes (bit-exact, -0.0 included)."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    np.testing.assert_array_equal(got, want, err_msg=what)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


def assert_tensor(got: torch.Tensor, want: np.ndarray, dt: torch.dtype, what: str = "") -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got)}"
    assert got.dtype == dt, f"{what}: dtype {got.dtype} != {dt}"
    assert_same(to_np(got), want, what)


def rand_values(rng: np.random.Generator, dt: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    npd = np_dtype(dt)
    if dt == torch.bool:
        return rng.integers(0, 2, shape).astype(bool)
    if dt.is_floating_point:
        # quarters in [-16, 16): exact in float16 and bfloat16; -0.0 now and then
        v = (rng.integers(-64, 64, shape) / 4).astype(npd)
        if v.size and rng.random() < 0.3:
            v.reshape(-1)[0] = -0.0
        return v
    info = np.iinfo(npd)
    lo, hi = max(int(info.min), -(2**40)), min(int(info.max), 2**40)
    v = rng.integers(lo, hi, shape, endpoint=True).astype(npd)
    if v.size:
        v.reshape(-1)[-1] = info.max if rng.random() < 0.5 else info.min
    return v


def other_dtype(dt: torch.dtype, k: int) -> torch.dtype:
    others = [d for d in DTYPES if d != dt]
    return others[k % len(others)]


def model_write(model: np.ndarray, idx: np.ndarray, vals: np.ndarray, inner: tuple = ()) -> None:
    """Sequential assignment: a repeated id takes its last occurrence."""
    part_shape = vals.shape[idx.ndim :]
    flat = vals.reshape((idx.size, *part_shape))
    for k, i in enumerate(idx.reshape(-1)):
        if inner:
            model[int(i)][inner] = flat[k]
        else:
            model[int(i)] = flat[k]


def model_read(model: np.ndarray, idx: np.ndarray, inner: tuple = ()) -> np.ndarray:
    sel = model[idx]
    if inner:
        sel = sel[(slice(None),) * idx.ndim + tuple(inner)]
    return np.array(sel, copy=True)


# --------------------------------------------------------------------------- files

_TORCH_OF = {np_dtype(d): d for d in DTYPES if d != torch.bfloat16}


@dataclass
class FileSpec:
    kind: str
    path: str
    dataset: str | None = None
    opts: dict = field(default_factory=dict)

    def open(self, **extra: Any) -> gl.DataGadget:
        kw = dict(self.opts)
        kw.update(extra)
        if self.dataset is not None:
            kw["dataset"] = self.dataset
        return gl.DataGadget(self.path, placement="file", device=CPU, **kw)


def _unwritten_chunks(data: st.DataObject, model: np.ndarray, crow: int) -> tuple[Any, list]:
    """Leave some chunks of a new HDF5 dataset / zarr array unwritten: they read as the
    fill value (drawn here), which the model (changed in place) then holds there."""
    rows = model.shape[0]
    fv = rand_values(
        np.random.default_rng(data.draw(st.integers(0, 99))), _TORCH_OF[model.dtype], ()
    )
    spans = []
    for a in range(0, rows, crow):
        b = min(rows, a + crow)
        if data.draw(st.booleans(), label="chunk written"):
            spans.append((a, b))
        else:
            model[a:b] = fv
    return fv[()], spans


def write_file(
    data: st.DataObject, d: str, name: str, kind: str, model: np.ndarray, dt: torch.dtype
) -> FileSpec:
    """Write ``model`` as a file of ``kind`` with the format's own library (bfloat16,
    which has no NumPy form, through a ``cpu`` table's ``save``)."""
    rows = model.shape[0]
    row_shape = model.shape[1:]
    if kind == "npy":
        path = os.path.join(d, name + ".npy")
        version = data.draw(st.sampled_from([None, (1, 0), (2, 0), (3, 0)]), label="npy version")
        with open(path, "wb") as fh:
            np.lib.format.write_array(fh, model, version=version)
        return FileSpec("npy", path)
    if kind == "h5":
        path = os.path.join(d, name + ".h5")
        dataset = data.draw(st.sampled_from([None, "emb", "grp/emb"]), label="h5 dataset")
        layout = data.draw(
            st.sampled_from(["contiguous", "chunked", "gzip", "lzf"]), label="h5 layout"
        )
        crow = data.draw(st.integers(1, max(1, rows + 1)), label="h5 chunk rows")
        if dt == torch.bfloat16:
            src = gl.DataGadget(to_torch(model, dt), placement="cpu", device=CPU)
            comp = {"contiguous": None, "chunked": "none", "gzip": "gzip", "lzf": "lzf"}[layout]
            src.save(path, dataset=dataset, chunk_rows=crow, compression=comp)
            src.close()
        else:
            kw: dict[str, Any] = {}
            if layout != "contiguous":
                kw["chunks"] = (min(crow, rows), *row_shape) if row_shape else (min(crow, rows),)
                if data.draw(st.booleans(), label="h5 resizable"):
                    kw["maxshape"] = (None, *row_shape)
            if layout in ("gzip", "lzf"):
                kw["compression"] = layout
            with h5py.File(path, "w") as f:
                if "chunks" in kw and data.draw(st.booleans(), label="h5 unwritten chunks"):
                    fv, spans = _unwritten_chunks(data, model, kw["chunks"][0])
                    ds = f.create_dataset(
                        dataset or "data", shape=model.shape, dtype=model.dtype, fillvalue=fv, **kw
                    )
                    for a, b in spans:
                        ds[a:b] = model[a:b]
                else:
                    f.create_dataset(dataset or "data", data=model, **kw)
        return FileSpec("h5", path, dataset)
    path = os.path.join(d, name + ".zarr")
    dataset = data.draw(st.sampled_from([None, "emb"]), label="zarr dataset")
    crow = data.draw(st.integers(1, max(1, rows + 1)), label="zarr chunk rows")
    compressed = data.draw(st.booleans(), label="zarr compressed")
    if dt == torch.bfloat16:
        src = gl.DataGadget(to_torch(model, dt), placement="cpu", device=CPU)
        src.save(path, dataset=dataset, chunk_rows=crow, compression=None if compressed else "none")
        src.close()
    else:
        chunks = (crow, *row_shape)
        kw = {} if compressed else {"compressors": None}
        kw["zarr_format"] = data.draw(st.sampled_from([3, 2]), label="zarr format")
        if kw["zarr_format"] == 3 and data.draw(st.booleans(), label="zarr sharded"):
            kw["shards"] = (crow * data.draw(st.integers(1, 3), label="chunks a shard"), *row_shape)
        spans = [(0, rows)]
        if data.draw(st.booleans(), label="zarr unwritten chunks"):
            fv, spans = _unwritten_chunks(data, model, crow)
            kw["fill_value"] = fv
        if dataset is None:
            z = zarr.create_array(path, shape=model.shape, dtype=model.dtype, chunks=chunks, **kw)
        else:
            grp = zarr.open_group(path, mode="w", zarr_format=kw.pop("zarr_format"))
            z = grp.create_array(dataset, shape=model.shape, dtype=model.dtype, chunks=chunks, **kw)
        for a, b in spans:
            z[a:b] = model[a:b]
    return FileSpec("zarr", path, dataset)


def read_file_natively(spec: FileSpec, dt: torch.dtype) -> np.ndarray:
    """The file's rows as the format's library reads them (bfloat16 through a fresh
    read-only table, as its storage is the library's own)."""
    if dt == torch.bfloat16:
        g = spec.open(writable=False)
        try:
            return to_np(g.getData(slice(None)))
        finally:
            g.close()
    if spec.kind == "npy":
        return np.load(spec.path)
    if spec.kind == "h5":
        with h5py.File(spec.path, "r") as f:
            return f[spec.dataset or "data"][...]
    z = zarr.open_array(spec.path, mode="r", path=spec.dataset or "")
    return np.asarray(z[...])


def check_file(spec: FileSpec, model: np.ndarray, dt: torch.dtype, what: str = "file") -> None:
    assert_same(read_file_natively(spec, dt), model, what + " (read natively)")
    g = spec.open(writable=False)
    try:
        assert g.shape == model.shape and g.dtype == dt
        assert_same(to_np(g.getData(slice(None))), model, what + " (reopened)")
    finally:
        g.close()


# --------------------------------------------------------------------------- ids


@st.composite
def id_sets(draw: Any, rows: int, allow_int: bool = True, allow_slice: bool = True) -> tuple:
    """(ids object, the model's int64 index array with the result's leading shape)."""
    forms = ["list", "np", "torch", "torch_strided", "range", "tuple", "list2d"]
    if allow_slice:
        forms.append("slice")
    if allow_int and rows > 0:
        forms.append("int")
    form = draw(st.sampled_from(forms), label="id form")
    if form == "slice":
        b = st.one_of(st.none(), st.integers(-rows - 3, rows + 3))
        step = draw(st.sampled_from([None, 1, 2, 3, -1, -2]), label="slice step")
        s = slice(draw(b, label="start"), draw(b, label="stop"), step)
        return s, np.arange(rows, dtype=np.int64)[s]
    if form == "range":
        if rows == 0:
            return range(0), np.zeros(0, np.int64)
        step = draw(st.sampled_from([1, 2, 3, -1, -2]), label="range step")
        a = draw(st.integers(0, rows - 1), label="range a")
        b = draw(st.integers(-1, rows), label="range b")
        r = range(a, b, step)
        return r, np.array(list(r), dtype=np.int64)
    if form == "int":
        i = draw(st.integers(0, rows - 1), label="int id")
        kind = draw(st.sampled_from(["py", "np", "tensor0d"]), label="int kind")
        obj = {"py": i, "np": np.int64(i), "tensor0d": torch.tensor(i)}[kind]
        return obj, np.array(i, dtype=np.int64)
    ids_st = st.integers(0, rows - 1) if rows > 0 else st.nothing()
    if form == "list2d":
        n0 = draw(st.integers(0 if rows == 0 else 1, 3), label="list2d n0")
        n1 = draw(st.integers(0, 4) if rows > 0 else st.just(0), label="list2d n1")
        vals = [[draw(ids_st) for _ in range(n1)] for _ in range(n0)]
        arr = np.array(vals, dtype=np.int64).reshape(n0, n1)
        if rows == 0:
            return np.zeros((n0, 0), np.int64), arr
        return vals, arr
    if rows == 0:
        flat: list[int] = []
        form = "list" if form == "tuple" else form
    else:
        flat = draw(st.lists(ids_st, min_size=1 if form == "tuple" else 0, max_size=3 * rows + 2))
    arr = np.array(flat, dtype=np.int64)
    if form == "list":
        return flat, arr
    if form == "tuple":
        return tuple(flat), arr
    if form == "np":
        dt = draw(st.sampled_from(NP_ID_DTYPES), label="np id dtype")
        two_d = len(flat) % 2 == 0 and len(flat) > 0 and draw(st.booleans(), label="np 2d")
        a = arr.astype(dt)
        if two_d:
            a, arr = a.reshape(2, -1), arr.reshape(2, -1)
            if draw(st.booleans(), label="np transposed"):
                a, arr = a.T, arr.T  # a non-contiguous view
        elif len(flat) >= 2 and draw(st.booleans(), label="np reversed view"):
            # (length 1 reversed: see test_numpy_negative_stride_on_a_length_one_axis)
            a = a[::-1].copy()[::-1]  # negative strides
        return a, arr
    dt = draw(st.sampled_from(TORCH_ID_DTYPES), label="torch id dtype")
    t = torch.from_numpy(arr).to(dt)
    if form == "torch_strided":
        big = torch.zeros(2 * len(flat), dtype=dt)
        big[::2] = t
        t = big[::2]
        assert not t.is_contiguous() or len(flat) <= 1
    return t, arr


@st.composite
def inner_index(draw: Any, row_shape: tuple[int, ...]) -> tuple:
    """Slices (positive step, any int bounds) and ints (negative too) into the row."""
    n = draw(st.integers(1, len(row_shape)), label="inner n")
    out: list[Any] = []
    for d in row_shape[:n]:
        if draw(st.booleans(), label="inner is slice"):
            b = st.one_of(st.none(), st.integers(-d - 2, d + 2))
            out.append(slice(draw(b), draw(b), draw(st.sampled_from([None, 1, 2]))))
        else:
            out.append(draw(st.integers(-d, d - 1), label="inner int"))
    return tuple(out)


@st.composite
def part_rows(draw: Any, rows: int, inner: tuple) -> tuple:
    """Row ids for a tuple index: list, array, tensor, slice; an int row where a slice
    follows (a tuple of plain ints would be a list of ids)."""
    forms = ["list", "np", "torch", "slice"]
    if rows > 0 and any(isinstance(x, slice) for x in inner):
        forms.append("int")
    form = draw(st.sampled_from(forms), label="part rows form")
    if form == "slice":
        b = st.one_of(st.none(), st.integers(-rows - 2, rows + 2))
        s = slice(draw(b), draw(b), draw(st.sampled_from([None, 1, -1, 2])))
        return s, np.arange(rows, dtype=np.int64)[s]
    if form == "int":
        i = draw(st.integers(0, rows - 1))
        return i, np.array(i, dtype=np.int64)
    ids_st = st.integers(0, rows - 1) if rows > 0 else st.nothing()
    flat = draw(st.lists(ids_st, min_size=1, max_size=2 * rows + 1)) if rows else []
    arr = np.array(flat, dtype=np.int64)
    if form == "list":
        return flat, arr
    if form == "np":
        return arr.astype(draw(st.sampled_from(NP_ID_DTYPES))), arr
    return torch.from_numpy(arr).to(draw(st.sampled_from(TORCH_ID_DTYPES))), arr


def value_object(data: st.DataObject, vals: np.ndarray, dt: torch.dtype) -> Any:
    """The rows to write, as a tensor (maybe strided), a NumPy array, or a list (only where
    NumPy reads a list as the table's dtype: float64, int64, bool)."""
    forms = ["tensor", "tensor_strided"]
    if dt != torch.bfloat16:
        forms.append("numpy")
    if dt in (torch.float64, torch.int64, torch.bool) and vals.ndim > 0 and vals.size > 0:
        forms.append("list")
    form = data.draw(st.sampled_from(forms), label="value form")
    if form == "numpy":
        if vals.ndim >= 2 and data.draw(st.booleans(), label="numpy fortran"):
            return np.asfortranarray(vals)
        if (
            vals.ndim >= 1
            and vals.shape[0] >= 2
            and data.draw(st.booleans(), label="numpy reversed")
        ):
            return vals[::-1].copy()[::-1]
        return np.array(vals, copy=True)
    if form == "list":
        return vals.tolist()
    t = to_torch(vals, dt)
    if form == "tensor_strided" and t.ndim >= 1:
        big = torch.zeros((2 * t.shape[0], *t.shape[1:]), dtype=dt)
        big[::2] = t
        t = big[::2]
    return t


# --------------------------------------------------------------------------- the harness


class Harness:
    """One table and its NumPy model; ``spec`` is the backing file of a ``file`` table."""

    def __init__(
        self, data: st.DataObject, d: str, kind: str, dt: torch.dtype, shape: tuple, seed: int
    ) -> None:
        self.data, self.d, self.kind, self.dt = data, d, kind, dt
        self.rng = np.random.default_rng(seed)
        self.n = 0
        self.model = rand_values(self.rng, dt, shape)
        self.file_opts: dict = {}
        if kind == "cpu":
            src = data.draw(
                st.sampled_from(["tensor", "numpy"] if dt != torch.bfloat16 else ["tensor"]),
                label="cpu source",
            )
            obj = to_torch(self.model, dt) if src == "tensor" else self.model.copy()
            self.g = gl.DataGadget(obj, placement="cpu", device=CPU)
            self.spec: FileSpec | None = None
        else:
            self.spec = write_file(data, d, self.name(), kind, self.model, dt)
            self.file_opts = self.draw_file_opts()
            self.spec.opts = self.file_opts
            self.g = self.spec.open()
        assert self.g.shape == self.model.shape
        assert self.g.dtype == dt
        self.check("built")

    def draw_file_opts(self) -> dict:
        opts: dict[str, Any] = {}
        c = self.data.draw(st.sampled_from([None, 0, 1, 64, 1 << 20]), label="cache_bytes")
        if c is not None:
            opts["cache_bytes"] = c
        b = self.data.draw(st.sampled_from([None, 1, 2, 3]), label="block_rows")
        if b is not None:
            opts["block_rows"] = b
        return opts

    def name(self) -> str:
        self.n += 1
        return f"t{self.n}"

    @property
    def rows(self) -> int:
        return int(self.model.shape[0])

    @property
    def row_shape(self) -> tuple:
        return tuple(self.model.shape[1:])

    def check(self, what: str) -> None:
        assert self.g.shape == self.model.shape, what
        assert len(self.g) == self.rows, what
        assert_same(self.g.getNumpyVersion(), self.model, what + ": getNumpyVersion")

    def close(self) -> None:
        self.g.close()
        if self.spec is not None:
            check_file(self.spec, self.model, self.dt, "file at the end")

    # ---- good operations

    def op_get(self) -> None:
        obj, idx = self.data.draw(id_sets(self.rows), label="get ids")
        how = self.data.draw(st.sampled_from(["getData", "gather", "getitem", "device"]))
        if how == "getData":
            got = self.g.getData(obj)
        elif how == "gather":
            got = self.g.gather(obj)
        elif how == "device":
            got = self.g.getData(obj, device=CPU)
        else:
            got = self.g[obj]
        assert_tensor(got, model_read(self.model, idx), self.dt, f"{how}({obj!r})")

    def op_set(self) -> None:
        obj, idx = self.data.draw(id_sets(self.rows), label="set ids")
        vals = rand_values(self.rng, self.dt, idx.shape + self.row_shape)
        v = value_object(self.data, vals, self.dt)
        how = self.data.draw(st.sampled_from(["insertData", "scatter", "setitem"]))
        if how == "insertData":
            self.g.insertData(v, obj)
        elif how == "scatter":
            self.g.scatter(obj, v)
        else:
            self.g[obj] = v
        model_write(self.model, idx, vals)
        self.check(f"{how} at {obj!r}")

    def op_part(self) -> None:
        if not self.row_shape:
            return self.op_get()
        inner = self.data.draw(inner_index(self.row_shape), label="inner")
        robj, idx = self.data.draw(part_rows(self.rows, inner), label="part rows")
        index = (robj, *inner)
        want = model_read(self.model, idx, inner)
        got = self.g[index] if self.data.draw(st.booleans()) else self.g.getData(index)
        assert_tensor(got, want, self.dt, f"read of {index!r}")
        if self.data.draw(st.booleans(), label="part write"):
            vals = rand_values(self.rng, self.dt, want.shape)
            v = value_object(self.data, vals, self.dt)
            if self.data.draw(st.booleans()):
                self.g[index] = v
            else:
                self.g.insertData(v, index)
            model_write(self.model, idx, vals, inner)
            self.check(f"write of {index!r}")
        return None

    def op_numpy(self) -> None:
        how = self.data.draw(st.sampled_from(["gnv", "numpy", "asarray", "array", "copyfalse"]))
        if how == "gnv":
            got = self.g.getNumpyVersion()
        elif how == "numpy":
            got = self.g.numpy()
        elif how == "asarray":
            got = np.asarray(self.g)
        elif how == "array":
            got = np.array(self.g)
        else:
            got = self.g.getNumpyVersion(copy=False)
        assert_same(got, self.model, how)
        if how != "copyfalse":
            # a copy: changing it does not reach the table
            got[...] = rand_values(self.rng, self.dt, got.shape)
            self.check(f"after changing the {how} copy")

    def save_target(self) -> tuple[str, str, dict, str | None]:
        fmts = ["h5", "zarr"] if self.dt == torch.bfloat16 else ["npy", "h5", "zarr"]
        fmt = self.data.draw(st.sampled_from(fmts), label="save format")
        opts: dict[str, Any] = {}
        dataset = None
        if fmt != "npy":
            dataset = self.data.draw(
                st.sampled_from([None, "emb", "g/emb"] if fmt == "h5" else [None, "emb"])
            )
            if self.data.draw(st.booleans()):
                opts["chunk_rows"] = self.data.draw(st.integers(1, max(1, self.rows + 1)))
            comps = (
                [None, "gzip", "lzf", "none"]
                if fmt == "h5"
                else [None, "zstd", "gzip", "blosc", "none"]
            )
            opts["compression"] = self.data.draw(st.sampled_from(comps))
        path = os.path.join(self.d, self.name() + "." + fmt)
        return fmt, path, opts, dataset

    def op_save(self) -> None:
        fmt, path, opts, dataset = self.save_target()
        if self.rows == 0:
            with pytest.raises(gl.GadgetValueError):
                self.g.save(path, dataset=dataset, **opts)
            assert not os.path.exists(path), "a refused save left a file"
            self.check("after a refused save")
            return
        self.g.save(path, dataset=dataset, **opts)
        self.check("after save")
        spec = FileSpec(fmt, path, dataset)
        check_file(spec, self.model, self.dt, f"saved {fmt} {opts}")
        kw = {"dataset": dataset} if dataset else {}
        g2 = gl.DataGadget(path, placement="cpu", device=CPU, **kw)
        assert_same(g2.getNumpyVersion(), self.model, "saved file loaded into cpu")
        g2.close()

    def op_load(self) -> None:
        rows = self.data.draw(st.integers(1, 6), label="load rows")
        fmts = ["h5", "zarr"] if self.dt == torch.bfloat16 else FILE_KINDS
        fmt = self.data.draw(st.sampled_from(fmts), label="load format")
        new = rand_values(self.rng, self.dt, (rows, *self.row_shape))
        spec = write_file(self.data, self.d, self.name(), fmt, new, self.dt)
        placement = self.g.placement
        if self.spec is not None:
            # the old file keeps what the table wrote to it
            self.g.flush()
            check_file(self.spec, self.model, self.dt, "old file before load")
        self.g.load(spec.path, dataset=spec.dataset)
        assert self.g.placement == placement
        self.model = new
        if self.spec is not None:
            spec.opts = self.file_opts
            self.spec = spec
        self.check("after load")

    def op_reopen(self) -> None:
        if self.spec is None:
            return self.op_get()
        self.g.close()
        check_file(self.spec, self.model, self.dt, "file after close")
        self.spec.opts = self.file_opts = self.draw_file_opts()
        self.g = self.spec.open()
        self.check("reopened")
        return None

    def op_save_self(self) -> None:
        if self.spec is None:
            return self.op_save()
        # a file table saved over its own file reads that file on
        self.g.save(self.spec.path, dataset=self.spec.dataset)
        self.check("after saving over its own file")
        self.op_set()
        return None

    # ---- bad operations: the documented error, and nothing changes

    def bad(self) -> None:
        rows, row_shape, dt = self.rows, self.row_shape, self.dt
        kind = self.data.draw(
            st.sampled_from(
                [
                    "oob",
                    "neg",
                    "float",
                    "bool",
                    "shape",
                    "dtype",
                    "device",
                    "ids_device",
                    "scalar",
                    "index_obj",
                    "pointwise",
                    "inner_step",
                    "inner_oob",
                    "neg_in_tuple",
                    "list_dtype",
                ]
            ),
            label="bad kind",
        )
        write = self.data.draw(st.booleans(), label="bad is write")
        good_n = self.data.draw(st.integers(0, 3), label="good ids with the bad one")
        good = [int(x) for x in self.rng.integers(0, max(rows, 1), good_n)] if rows else []
        exc: type[BaseException] = gl.GadgetError
        ids: Any = good
        vals_shape = (len(good), *row_shape)
        value: Any = None
        form = self.data.draw(st.sampled_from(["list", "np", "torch"]), label="bad id form")

        def as_form(lst: list, npdt: Any = np.int64, tdt: Any = torch.int64) -> Any:
            if form == "list":
                return lst
            if form == "np":
                return np.array(lst, dtype=npdt)
            return torch.tensor(lst, dtype=tdt)

        if kind in ("oob", "neg"):
            b = (
                rows + self.data.draw(st.integers(0, 3))
                if kind == "oob"
                else -self.data.draw(st.integers(1, 3))
            )
            lst = list(good)
            lst.insert(self.data.draw(st.integers(0, len(lst))), b)
            ids, vals_shape, exc = as_form(lst), (len(lst), *row_shape), gl.GadgetIndexError
        elif kind == "float":
            lst = [float(x) for x in good] + [0.0]
            ids = as_form(lst, np.float64, torch.float32)
            vals_shape, exc = (len(lst), *row_shape), gl.GadgetTypeError
        elif kind == "bool":
            lst = [True] * (len(good) + 1)
            ids = np.array(lst) if form == "np" else torch.tensor(lst)
            vals_shape, exc = (len(lst), *row_shape), gl.GadgetTypeError
        elif kind == "ids_device":
            ids = torch.tensor(good, dtype=torch.int64, device="meta")
            exc = gl.GadgetTypeError
        elif kind == "index_obj":
            ids = self.data.draw(st.sampled_from([Ellipsis, None, "0", 1.0, b"\x00"]))
            write = write and ids is not None
            vals_shape, exc = row_shape, gl.GadgetTypeError
        elif kind == "pointwise":
            if len(row_shape) == 0 or rows == 0:
                return
            ids = (good or [0], [0] * len(good or [0]))
            vals_shape = (len(good or [0]),)
        elif kind == "inner_step":
            if len(row_shape) == 0:
                return
            ids = (good, slice(None, None, self.data.draw(st.sampled_from([-1, -2, 0]))))
            vals_shape = (len(good), *row_shape)
        elif kind == "inner_oob":
            if len(row_shape) == 0:
                return
            d0 = row_shape[0]
            k = self.data.draw(st.sampled_from([d0, d0 + 1, -d0 - 1, -d0 - 3]))
            ids, vals_shape, exc = (good, k), (len(good), *row_shape[1:]), gl.GadgetIndexError
        elif kind == "neg_in_tuple":
            if len(row_shape) == 0:
                return
            ids = ([*good, -1], slice(None))
            vals_shape, exc = (len(good) + 1, *row_shape), gl.GadgetIndexError
        else:
            ids = as_form(good)
        if not write:
            if kind in ("shape", "dtype", "device", "scalar", "list_dtype"):
                return
            with pytest.raises(exc):
                if self.data.draw(st.booleans()):
                    self.g.getData(ids)
                else:
                    self.g[ids]
            self.check(f"after a refused read ({kind}, {ids!r})")
            return
        vals = rand_values(self.rng, dt, tuple(vals_shape))
        value = to_torch(vals, dt)
        if kind == "shape":
            exc = gl.GadgetValueError
            choice = self.data.draw(st.sampled_from(["more", "less", "row", "flat"]))
            if choice == "more":
                value = to_torch(rand_values(self.rng, dt, (len(good) + 1, *row_shape)), dt)
            elif choice == "less" and len(good) > 0:
                value = to_torch(rand_values(self.rng, dt, (len(good) - 1, *row_shape)), dt)
            elif choice == "row":
                value = to_torch(rand_values(self.rng, dt, (len(good), *row_shape, 2)), dt)
            else:
                value = to_torch(
                    rand_values(self.rng, dt, (len(good) * max(1, int(np.prod(row_shape))) + 1,)),
                    dt,
                )
        elif kind == "dtype":
            exc = gl.GadgetTypeError
            odt = other_dtype(dt, self.data.draw(st.integers(0, 20)))
            value = to_torch(np.zeros(vals_shape, np_dtype(odt)), odt)
            if odt != torch.bfloat16 and self.data.draw(st.booleans()):
                value = np.zeros(vals_shape, np_dtype(odt))
        elif kind == "list_dtype":
            if dt in (torch.float64, torch.int64, torch.bool) or len(good) == 0:
                return
            exc = gl.GadgetTypeError
            value = np.zeros(vals_shape, np.float64 if dt.is_floating_point else np.int64).tolist()
        elif kind == "device":
            exc = gl.GadgetTypeError
            value = torch.zeros(vals_shape, dtype=dt, device="meta")
        elif kind == "scalar":
            value = self.data.draw(st.sampled_from([0, 1.0, True]))
        how = self.data.draw(st.sampled_from(["insertData", "scatter", "setitem"]))
        with pytest.raises(exc):
            if how == "insertData":
                self.g.insertData(value, ids)
            elif how == "scatter":
                self.g.scatter(ids, value)
            else:
                self.g[ids] = value
        self.check(f"after a refused write ({kind}, {how}, {ids!r})")

    def op_bad_load(self) -> None:
        """A load that fails leaves the table as it was (and a file table on its file)."""
        case = self.data.draw(
            st.sampled_from(
                ["missing", "truncated", "uint16", "zero_rows", "complex", "no_dataset"]
            ),
            label="bad load",
        )
        path = os.path.join(self.d, self.name() + ".npy")
        kw: dict[str, Any] = {}
        exc: type[BaseException] = gl.GadgetError
        if case == "missing":
            exc = gl.GadgetFileNotFoundError
        elif case == "truncated":
            np.save(path, np.zeros((4, *self.row_shape), np.float32))
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 3)
            exc = gl.GadgetFileError
        elif case == "uint16":
            np.save(path, np.zeros((3, *self.row_shape), np.uint16))
            exc = gl.GadgetTypeError
        elif case == "zero_rows":
            np.save(path, np.zeros((0, *self.row_shape), np.float32))
        elif case == "complex":
            np.save(path, np.zeros((2, *self.row_shape), np.complex64))
            exc = gl.GadgetTypeError
        else:
            path = path[:-4] + ".h5"
            with h5py.File(path, "w") as f:
                f["data"] = np.zeros((2, *self.row_shape), np.float32)
            kw["dataset"] = "nope"
            exc = gl.GadgetKeyError
        how = self.data.draw(st.sampled_from(["load", "loadCupy"]), label="bad load call")
        with pytest.raises(exc):
            if how == "load" or kw:
                self.g.load(path, **kw)
            else:
                self.g.loadCupy(path)
        self.check(f"after a failed {how} ({case})")
        # the table still reads and writes its own rows (a file table, its own file)
        self.op_set()

    def op_bad_save(self) -> None:
        """Bad save arguments are refused before any file is made; a file already at the
        target stays as it was."""
        if self.rows == 0 or self.dt == torch.bfloat16:
            return self.op_get()
        fmt = self.data.draw(st.sampled_from(["npy", "h5", "zarr"]), label="bad save fmt")
        bad = {
            "npy": [{"compression": "gzip"}, {"chunk_rows": 4}, {"foo": 1}],
            "h5": [
                {"compression": "zstd"},
                {"chunk_rows": 0},
                {"compression": "gzip", "compression_level": 12},
                {"foo": 1},
            ],
            "zarr": [
                {"compression": "lzf"},
                {"chunk_rows": -1},
                {"compression": "zstd", "compression_level": 99},
            ],
        }[fmt]
        opts = self.data.draw(st.sampled_from(bad), label="bad save opts")
        path = os.path.join(self.d, self.name() + "." + fmt)
        existing = self.data.draw(st.booleans(), label="target exists")
        old = np.arange(3, dtype=np.int16)
        if existing:
            spec = write_file(
                self.data, self.d, os.path.basename(path).rsplit(".", 1)[0], fmt, old, torch.int16
            )
            path = spec.path
        with pytest.raises(gl.GadgetError):
            self.g.save(path, **opts)
        if existing:
            check_file(spec, old, torch.int16, "old file after a refused save")
        else:
            assert not os.path.exists(path), f"a refused save ({opts}) left {path}"
        self.check(f"after a refused save {opts}")
        return None

    def run(self, n_ops: int, ops: list[str]) -> None:
        for _ in range(n_ops):
            op = self.data.draw(st.sampled_from(ops), label="op")
            getattr(self, "op_" + op if op != "bad" else "bad")()


GOOD_OPS = [
    "get",
    "set",
    "part",
    "numpy",
    "save",
    "load",
    "bad",
    "get",
    "set",
    "bad",
    "bad_load",
    "bad_save",
]
FILE_OPS = [*GOOD_OPS, "reopen", "save_self"]


@st.composite
def table_shapes(draw: Any, min_rows: int) -> tuple:
    rows = draw(st.integers(min_rows, 10), label="rows")
    nd = draw(st.sampled_from([0, 1, 2]), label="row ndim")
    row_shape = tuple(draw(st.integers(1, 4), label="row dim") for _ in range(nd))
    return (rows, *row_shape)


def _run_sequence(data: st.DataObject, kind: str, n_ops: int, ops: list[str]) -> None:
    dt = data.draw(st.sampled_from(DTYPES), label="dtype")
    if kind == "npy" and dt == torch.bfloat16:
        dt = torch.float32  # bfloat16 has no .npy form (README)
    shape = data.draw(table_shapes(0 if kind == "cpu" else 1), label="shape")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        h = Harness(data, d, kind, dt, shape, seed)
        try:
            h.run(n_ops, ops)
        finally:
            h.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# =========================================================================== sequences


@_settings(150)
@given(data=st.data())
def test_cpu_table_operation_sequences_match_numpy(data: st.DataObject) -> None:
    _run_sequence(data, "cpu", 10, GOOD_OPS)


@_settings(75)
@given(data=st.data())
def test_npy_file_table_operation_sequences_match_numpy(data: st.DataObject) -> None:
    _run_sequence(data, "npy", 9, FILE_OPS)


@_settings(75)
@given(data=st.data())
def test_hdf5_file_table_operation_sequences_match_numpy(data: st.DataObject) -> None:
    _run_sequence(data, "h5", 9, FILE_OPS)


@_settings(50)
@given(data=st.data())
def test_zarr_file_table_operation_sequences_match_numpy(data: st.DataObject) -> None:
    _run_sequence(data, "zarr", 8, FILE_OPS)


@_settings(75)
@given(data=st.data(), kind=st.sampled_from(["cpu", *FILE_KINDS]))
def test_bad_operations_change_nothing_in_table_or_file(data: st.DataObject, kind: str) -> None:
    """Only refused calls, then the file is closed and reopened: it must be as built."""
    _run_sequence(data, kind, 6, ["bad", "bad", "bad", "bad_load", "bad_save"])


@_settings(62)
@given(data=st.data(), kind=st.sampled_from(["cpu", *FILE_KINDS]))
def test_writes_with_repeated_ids_sequences(data: st.DataObject, kind: str) -> None:
    _run_sequence(data, kind, 5, ["set", "part", "set"])


# =========================================================================== focused checks


def _table(kind: str, model: np.ndarray, dt: torch.dtype, d: str, data: st.DataObject, **opts: Any):
    if kind == "cpu":
        return gl.DataGadget(to_torch(model, dt), placement="cpu", device=CPU), None
    spec = write_file(data, d, "t", kind, model, dt)
    spec.opts = opts
    return spec.open(), spec


def _dt_for(kind: str, dt: torch.dtype) -> torch.dtype:
    return torch.float32 if (kind == "npy" and dt == torch.bfloat16) else dt


@_settings(60)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from(DTYPES),
    shape=table_shapes(1),
)
def test_every_id_form_gathers_like_numpy(data, kind, dt, shape) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        model = rand_values(np.random.default_rng(1), dt, shape)
        g, _ = _table(kind, model, dt, d, data)
        with g:
            for _ in range(4):
                obj, idx = data.draw(id_sets(shape[0]))
                want = model_read(model, idx)
                assert_tensor(g.getData(obj), want, dt, f"getData({obj!r})")
                assert_tensor(g[obj], want, dt, f"g[{obj!r}]")
                assert g.getData(obj).shape == idx.shape + tuple(shape[1:])
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("tdt", ["uint16", "uint32", "uint64"])
@pytest.mark.parametrize("kind", ["cpu", "npy"])
def test_wide_unsigned_torch_ids_are_ids(tmp_path, kind, tdt) -> None:
    """README: ids of any integer dtype (torch's uint16/32/64 exist since torch 2.3)."""
    t_dt = getattr(torch, tdt)
    model = np.arange(30, dtype=np.float32).reshape(10, 3)
    if kind == "cpu":
        g = gl.DataGadget(model.copy(), placement="cpu", device=CPU)
    else:
        np.save(tmp_path / "a.npy", model)
        g = gl.DataGadget(str(tmp_path / "a.npy"), placement="file", device=CPU)
    ids = torch.tensor([9, 0, 9, 4], dtype=torch.int64).to(t_dt)
    with g:
        assert_same(to_np(g.getData(ids)), model[[9, 0, 9, 4]])
        g.insertData(torch.ones(4, 3), ids)
        model[[9, 0, 4]] = 1
        assert_same(g.getNumpyVersion(), model)
        with pytest.raises(gl.GadgetIndexError):
            g.getData(torch.tensor([10], dtype=torch.int64).to(t_dt))


@_settings(50)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from(DTYPES),
    shape=table_shapes(1),
)
def test_repeated_ids_last_occurrence_wins_for_every_write_call(data, kind, dt, shape) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    rng = np.random.default_rng(7)
    try:
        model = rand_values(rng, dt, shape)
        g, spec = _table(kind, model, dt, d, data)
        rows = shape[0]
        for how in ("insertData", "scatter", "setitem"):
            ids = np.array(data.draw(st.lists(st.integers(0, rows - 1), min_size=2, max_size=12)))
            ids[-1] = ids[0]  # at least one repeat
            vals = rand_values(rng, dt, (len(ids), *shape[1:]))
            v, t_ids = to_torch(vals, dt), torch.from_numpy(ids)
            if how == "insertData":
                g.insertData(v, t_ids)
            elif how == "scatter":
                g.scatter(t_ids, v)
            else:
                g[t_ids] = v
            model_write(model, ids, vals)
            last = {int(i): k for k, i in enumerate(ids)}
            for i, k in last.items():
                assert_same(to_np(g.getData(i)), vals[k], f"{how}: row {i}")
            assert_same(g.getNumpyVersion(), model, how)
        g.close()
        if spec is not None:
            check_file(spec, model, dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@_settings(50)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from(DTYPES),
    rows=st.integers(1, 9),
    step=st.sampled_from([None, 1, 2, -1, -3]),
)
def test_slice_of_rows_reads_and_writes_as_python(data, kind, dt, rows, step) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    rng = np.random.default_rng(3)
    try:
        model = rand_values(rng, dt, (rows, 2))
        g, spec = _table(kind, model, dt, d, data)
        b = st.one_of(st.none(), st.integers(-rows - 4, rows + 4))
        s = slice(data.draw(b), data.draw(b), step)
        assert_tensor(g.getData(s), model[s], dt, f"getData({s})")
        assert_tensor(g[s], model[s], dt, f"g[{s}]")
        vals = rand_values(rng, dt, model[s].shape)
        g[s] = to_torch(vals, dt)
        model[s] = vals
        assert_same(g.getNumpyVersion(), model, f"g[{s}] = ...")
        assert_tensor(g[-2:], model[-2:], dt, "g[-2:] is the last two rows")
        g.close()
        if spec is not None:
            check_file(spec, model, dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@_settings(60)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from(DTYPES),
    rows=st.integers(1, 8),
    row_shape=st.lists(st.integers(1, 5), min_size=1, max_size=2).map(tuple),
)
def test_tuple_index_reads_and_writes_only_that_part(data, kind, dt, rows, row_shape) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    rng = np.random.default_rng(11)
    try:
        model = rand_values(rng, dt, (rows, *row_shape))
        g, spec = _table(kind, model, dt, d, data)
        for _ in range(3):
            inner = data.draw(inner_index(row_shape))
            robj, idx = data.draw(part_rows(rows, inner))
            index = (robj, *inner)
            want = model_read(model, idx, inner)
            assert_tensor(g.getData(index), want, dt, f"getData({index!r})")
            vals = rand_values(rng, dt, want.shape)
            g.insertData(to_torch(vals, dt), index)
            model_write(model, idx, vals, inner)
            assert_same(g.getNumpyVersion(), model, f"insertData at {index!r}")
        g.close()
        if spec is not None:
            check_file(spec, model, dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_tuple_index_examples_from_readme() -> None:
    m = np.arange(60, dtype=np.float32).reshape(10, 6)
    g = gl.DataGadget(m.copy(), placement="cpu", device=CPU)
    assert_same(to_np(g.getData((slice(0, 6), slice(0, 3)))), m[0:6, 0:3])
    assert_same(to_np(g[[1, 2], 0]), m[[1, 2], 0])
    assert_same(to_np(g[[1, 2], -1]), m[[1, 2], -1])
    assert_same(to_np(g[([1, 2],)]), m[[1, 2]])
    assert_same(to_np(g[(1, 2)]), m[[1, 2]])  # a tuple of plain ints is a list of ids
    assert_same(to_np(g[2:5]), m[2:5])
    assert_same(to_np(g[[3, 1], 0:3]), m[[3, 1], 0:3])
    assert_same(to_np(g[[3], 1:100]), m[[3], 1:100])  # clipped as Python clips
    with pytest.raises(gl.GadgetError):
        g[[1, 2], [0, 1]]
    with pytest.raises(gl.GadgetTypeError):
        g[...]
    with pytest.raises(gl.GadgetTypeError):
        g[None]
    with pytest.raises(gl.GadgetIndexError):
        g[[-1], 0]
    assert_same(g.getNumpyVersion(), m)


# ---------------------------------------------------------------- save / load / reopen


@_settings(60)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from(DTYPES),
    shape=table_shapes(1),
)
def test_save_to_every_format_round_trips_bit_exact(data, kind, dt, shape) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        h = Harness(data, d, kind, dt, shape, 5)
        for _ in range(2):
            h.op_save()
        h.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@_settings(50)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from(DTYPES),
    shape=table_shapes(1),
)
def test_load_replaces_rows_and_keeps_placement(data, kind, dt, shape) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        h = Harness(data, d, kind, dt, shape, 9)
        h.op_load()
        h.op_set()
        h.op_get()
        h.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("dt", [d for d in DTYPES if d != torch.bfloat16], ids=str)
def test_saveCupy_appends_npy_and_loadCupy_round_trips(tmp_path, dt) -> None:
    rng = np.random.default_rng(2)
    model = rand_values(rng, dt, (7, 3))
    g = gl.DataGadget(to_torch(model, dt), placement="cpu", device=CPU)
    g.saveCupy(str(tmp_path / "emb"))
    assert_same(np.load(tmp_path / "emb.npy"), model)
    other = rand_values(rng, dt, (4, 3))
    np.save(tmp_path / "o.npy", other)
    g.loadCupy(str(tmp_path / "o.npy"))
    assert g.placement == "cpu"
    assert_same(g.getNumpyVersion(), other)
    f = gl.DataGadget(str(tmp_path / "emb.npy"), placement="file", device=CPU)
    f.loadCupy(str(tmp_path / "o.npy"))
    assert f.placement == "file"
    assert_same(f.getNumpyVersion(), other)
    f.close()


def test_bfloat16_has_no_npy_form_and_nothing_is_written(tmp_path) -> None:
    g = gl.DataGadget(torch.ones(3, 2, dtype=torch.bfloat16), placement="cpu", device=CPU)
    with pytest.raises(gl.GadgetTypeError):
        g.save(str(tmp_path / "b.npy"))
    assert not (tmp_path / "b.npy").exists()
    assert list(tmp_path.iterdir()) == []


@_settings(40)
@given(
    dt=st.sampled_from(DTYPES),
    row_shape=st.lists(st.integers(0, 3), max_size=2).map(tuple),
    fmt=st.sampled_from(FILE_KINDS),
)
def test_zero_row_cpu_table(dt, row_shape, fmt) -> None:
    """README: an in-memory table may have zero rows, but it is not saved either."""
    model = np.zeros((0, *row_shape), np_dtype(dt))
    g = gl.DataGadget(to_torch(model, dt), placement="cpu", device=CPU)
    assert len(g) == 0 and g.shape == (0, *row_shape)
    assert_tensor(g.getData([]), model, dt)
    assert_tensor(g[:], model, dt)
    assert_tensor(
        g.getData(np.zeros((2, 0), np.int32)), np.zeros((2, 0, *row_shape), model.dtype), dt
    )
    g.insertData(to_torch(model, dt), torch.zeros(0, dtype=torch.int64))
    assert_same(g.getNumpyVersion(), model)
    assert_same(np.asarray(g), model)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([0])
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(to_torch(np.zeros((1, *row_shape), model.dtype), dt), [0])
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        if fmt == "npy" and dt == torch.bfloat16:
            fmt = "h5"
        path = os.path.join(d, "z." + fmt)
        with pytest.raises(gl.GadgetValueError):
            g.save(path)
        assert os.listdir(d) == []
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("fmt", FILE_KINDS)
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_zero_row_files_are_refused_naming_the_file(tmp_path, fmt, placement) -> None:
    model = np.zeros((0, 3), np.float32)
    path = str(tmp_path / ("z." + fmt))
    if fmt == "npy":
        np.save(path, model)
    elif fmt == "h5":
        with h5py.File(path, "w") as f:
            f["data"] = model
    else:
        zarr.create_array(path, shape=(0, 3), dtype=np.float32, chunks=(1, 3))
    with pytest.raises(gl.GadgetError) as ei:
        gl.DataGadget(path, placement=placement, device=CPU)
    assert "z." + fmt in str(ei.value)


# ---------------------------------------------------------------- NumPy conversions


@NEEDS_NUMPY2
@pytest.mark.parametrize("dt", [d for d in DTYPES if d != torch.bfloat16], ids=str)
def test_cpu_numpy_view_without_copy_is_the_table(dt) -> None:
    rng = np.random.default_rng(4)
    model = rand_values(rng, dt, (5, 2))
    g = gl.DataGadget(to_torch(model, dt), placement="cpu", device=CPU)
    v = g.getNumpyVersion(copy=False)
    a = np.asarray(g, copy=False)
    new = rand_values(rng, dt, (2,))
    v[1] = new
    model[1] = new
    assert_same(to_np(g.getData([1])), model[[1]])
    assert_same(a, model)
    c = g.getNumpyVersion()
    c[...] = rand_values(rng, dt, c.shape)
    assert_same(g.getNumpyVersion(), model)


@NEEDS_NUMPY2
@_settings(40)
@given(data=st.data(), kind=st.sampled_from(FILE_KINDS), dt=st.sampled_from(DTYPES))
def test_file_and_bfloat16_tables_have_no_numpy_view(data, kind, dt) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        model = rand_values(np.random.default_rng(6), dt, (4, 3))
        g, spec = _table(kind, model, dt, d, data)
        with pytest.raises(gl.GadgetValueError):
            np.asarray(g, copy=False)
        c = g.getNumpyVersion(copy=False)  # a copy all the same
        assert_same(c, model)
        c[...] = rand_values(np.random.default_rng(8), dt, c.shape)
        assert_same(g.getNumpyVersion(), model)
        g.close()
        check_file(spec, model, dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    b = gl.DataGadget(torch.ones(2, 2, dtype=torch.bfloat16), placement="cpu", device=CPU)
    with pytest.raises(gl.GadgetValueError):
        np.asarray(b, copy=False)
    assert_same(b.getNumpyVersion(copy=False), np.ones((2, 2), np.float32))


@_settings(40)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from(DTYPES),
    to=st.sampled_from([np.float64, np.float32, np.int64]),
)
def test_asarray_with_dtype_casts_the_whole_table(data, kind, dt, to) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        model = rand_values(np.random.default_rng(6), dt, (4, 2))
        g, _ = _table(kind, model, dt, d, data)
        with g:
            assert_same(np.asarray(g, dtype=to), model.astype(to))
            assert_same(np.array(g), model)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- bad calls, one by one


def _bad_case(kind: str, data: st.DataObject, dt: torch.dtype, call, exc) -> None:
    """Build a table, make ``call(g, model)`` which must raise ``exc``; the table, and the
    file after it is closed and reopened, are unchanged."""
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        model = rand_values(np.random.default_rng(12), dt, (6, 3))
        g, spec = _table(kind, model, dt, d, data)  # (may set unwritten chunks' fill value)
        before = model.copy()
        with pytest.raises(exc):
            call(g, model, dt)
        assert_same(g.getNumpyVersion(), before, "table after a refused call")
        g.close()
        if spec is not None:
            check_file(spec, before, dt, "file after a refused call")
    finally:
        shutil.rmtree(d, ignore_errors=True)


KINDS = st.sampled_from(["cpu", *FILE_KINDS])


@_settings(40)
@given(
    data=st.data(), kind=KINDS, dt=st.sampled_from(DTYPES), bad=st.sampled_from([6, 7, 100, 2**40])
)
def test_out_of_range_id_in_a_write_writes_nothing(data, kind, dt, bad) -> None:
    def call(g, model, dt):
        ids = torch.tensor([0, 1, bad, 2])
        g.insertData(to_torch(np.ones((4, 3), np_dtype(dt)), dt), ids)

    _bad_case(kind, data, dt, call, gl.GadgetIndexError)


@_settings(40)
@given(data=st.data(), kind=KINDS, dt=st.sampled_from(DTYPES), neg=st.integers(-7, -1))
def test_negative_id_in_a_write_writes_nothing(data, kind, dt, neg) -> None:
    def call(g, model, dt):
        g[np.array([3, neg, 0])] = to_torch(np.ones((3, 3), np_dtype(dt)), dt)

    _bad_case(kind, data, dt, call, gl.GadgetIndexError)


@_settings(40)
@given(
    data=st.data(),
    kind=KINDS,
    dt=st.sampled_from(DTYPES),
    ids=st.sampled_from(
        [
            [0.0, 1.0],
            np.array([1.5]),
            torch.tensor([1.0]),
            torch.tensor([True, False]),
            np.array([True]),
        ]
    ),
    write=st.booleans(),
)
def test_float_and_bool_ids_are_type_errors(data, kind, dt, ids, write) -> None:
    def call(g, model, dt):
        if write:
            n = len(ids)
            g.insertData(to_torch(np.ones((n, 3), np_dtype(dt)), dt), ids)
        else:
            g.getData(ids)

    _bad_case(kind, data, dt, call, gl.GadgetTypeError)


@_settings(40)
@given(
    data=st.data(),
    kind=KINDS,
    dt=st.sampled_from(DTYPES),
    vshape=st.sampled_from([(3, 3), (2, 2), (2,), (2, 3, 1), (1, 3), (6,)]),
)
def test_wrong_value_shape_is_a_value_error_and_not_broadcast(data, kind, dt, vshape) -> None:
    def call(g, model, dt):
        g.insertData(to_torch(np.ones(vshape, np_dtype(dt)), dt), [4, 5])

    _bad_case(kind, data, dt, call, gl.GadgetValueError)


@_settings(50)
@given(
    data=st.data(), kind=KINDS, dt=st.sampled_from(DTYPES), k=st.integers(0, 8), arr=st.booleans()
)
def test_wrong_value_dtype_is_a_type_error_not_a_cast(data, kind, dt, k, arr) -> None:
    odt = other_dtype(_dt_for(kind, dt), k)

    def call(g, model, dt):
        v: Any = to_torch(np.ones((2, 3), np_dtype(odt)), odt)
        if arr and odt != torch.bfloat16:
            v = np.ones((2, 3), np_dtype(odt))
        g[[0, 5]] = v

    _bad_case(kind, data, dt, call, gl.GadgetTypeError)


@_settings(30)
@given(
    data=st.data(),
    kind=KINDS,
    dt=st.sampled_from(DTYPES),
    what=st.sampled_from(["data", "ids", "device"]),
)
def test_wrong_device_is_a_type_error(data, kind, dt, what) -> None:
    def call(g, model, dt):
        if what == "data":
            g.insertData(torch.zeros(2, 3, dtype=dt, device="meta"), [0, 1])
        elif what == "ids":
            g.insertData(
                to_torch(np.ones((2, 3), np_dtype(dt)), dt), torch.tensor([0, 1], device="meta")
            )
        else:
            g.getData([0, 1], device="meta")

    _bad_case(kind, data, dt, call, gl.GadgetTypeError)


@_settings(30)
@given(
    data=st.data(), kind=KINDS, dt=st.sampled_from(DTYPES), value=st.sampled_from([0, 1, 1.0, True])
)
def test_scalar_value_is_refused(data, kind, dt, value) -> None:
    def call(g, model, dt):
        g[[1, 2]] = value

    _bad_case(kind, data, dt, call, gl.GadgetError)


@_settings(30)
@given(
    data=st.data(),
    kind=KINDS,
    dt=st.sampled_from([torch.float32, torch.float16, torch.int32, torch.int8, torch.uint8]),
)
def test_list_values_of_another_dtype_are_refused(data, kind, dt) -> None:
    """README: a list is read as NumPy reads it, so it must have the table's dtype too."""

    def call(g, model, dt):
        lst = [[1.0, 2.0, 3.0]] if dt.is_floating_point else [[1, 2, 3]]
        g.insertData(lst, [2])

    _bad_case(kind, data, dt, call, gl.GadgetTypeError)


@_settings(30)
@given(data=st.data(), kind=KINDS, dt=st.sampled_from([torch.float64, torch.int64, torch.bool]))
def test_list_values_of_the_table_dtype_are_written(data, kind, dt) -> None:
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        model = rand_values(np.random.default_rng(1), dt, (5, 3))
        g, spec = _table(kind, model, dt, d, data)
        vals = rand_values(np.random.default_rng(2), dt, (3, 3))
        g.insertData(vals.tolist(), [4, 0, 4])
        model_write(model, np.array([4, 0, 4]), vals)
        assert_same(g.getNumpyVersion(), model)
        g.close()
        if spec is not None:
            check_file(spec, model, dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@_settings(40)
@given(
    data=st.data(),
    kind=KINDS,
    dt=st.sampled_from(DTYPES),
    index=st.sampled_from(
        [
            ([1, 2], slice(None, None, -1)),
            ([1, 2], slice(0, 2, 0)),
            ([1, 2], slice(0, 2.0)),
            ([1, 2], Ellipsis),
            ([1, 2], [0, 1]),
            ([1, 2], 3),
            ([1, 2], -4),
            ([-1, 2], 0),
            (slice(0, 3.0),),
        ]
    ),
)
def test_bad_row_part_index_writes_nothing(data, kind, dt, index) -> None:
    def call(g, model, dt):
        g.insertData(to_torch(np.ones((2,), np_dtype(dt)), dt), index)

    _bad_case(kind, data, dt, call, gl.GadgetError)


def test_refused_calls_raise_the_builtin_classes_too() -> None:
    g = gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu", device=CPU)
    with pytest.raises(IndexError):
        g.getData([4])
    with pytest.raises(TypeError):
        g.getData([0.5])
    with pytest.raises(ValueError):
        g.insertData(torch.zeros(3, 2), [0, 1])
    with pytest.raises(TypeError):
        g.insertData(torch.zeros(2, 2, dtype=torch.float64), [0, 1])
    assert_same(g.getNumpyVersion(), np.zeros((4, 2), np.float32))


@_settings(30)
@given(data=st.data(), kind=KINDS, dt=st.sampled_from(DTYPES))
def test_getdata_out_fills_and_returns_out(data, kind, dt) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        model = rand_values(np.random.default_rng(1), dt, (5, 3))
        g, _ = _table(kind, model, dt, d, data)
        with g:
            out = torch.empty(2, 2, 3, dtype=dt)
            ids = np.array([[4, 4], [0, 2]])
            r = g.getData(ids, out=out)
            assert r.data_ptr() == out.data_ptr()
            assert_tensor(out, model[ids], dt)
            with pytest.raises(gl.GadgetValueError):
                g.getData(ids, out=torch.empty(2, 3, dtype=dt))
            with pytest.raises(gl.GadgetIndexError):
                g.getData([5], out=torch.empty(1, 3, dtype=dt))
            assert_same(g.getNumpyVersion(), model)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- file options


@_settings(40)
@given(
    data=st.data(),
    kind=st.sampled_from(FILE_KINDS),
    dt=st.sampled_from(DTYPES),
    shape=table_shapes(1),
    cache=st.sampled_from([0, 1, 7, 100]),
    block_rows=st.sampled_from([None, 1, 2, 5]),
)
def test_small_cache_gives_the_same_rows(data, kind, dt, shape, cache, block_rows) -> None:
    """Two tables of one file, one with a tiny cache: every read agrees with the model and
    each sees the other's writes (README: several file tables of one file may all write)."""
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    rng = np.random.default_rng(21)
    try:
        model = rand_values(rng, dt, shape)
        spec = write_file(data, d, "c", kind, model, dt)
        opts: dict[str, Any] = {"cache_bytes": cache}
        if block_rows is not None:
            opts["block_rows"] = block_rows
        small = spec.open(**opts)
        big = spec.open()
        try:
            for _ in range(4):
                obj, idx = data.draw(id_sets(shape[0]))
                for g in (small, big):
                    assert_tensor(g.getData(obj), model_read(model, idx), dt, f"read {obj!r}")
                wobj, widx = data.draw(id_sets(shape[0]))
                vals = rand_values(rng, dt, widx.shape + tuple(shape[1:]))
                writer = data.draw(st.sampled_from([small, big]))
                writer.insertData(to_torch(vals, dt), wobj)
                model_write(model, widx, vals)
                assert_same(small.getNumpyVersion(), model, "small cache after a write")
                assert_same(big.getNumpyVersion(), model, "default cache after a write")
        finally:
            small.close()
            big.close()
        check_file(spec, model, dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_bad_cache_bytes_and_writable_values(tmp_path, kind) -> None:
    model = np.arange(8, dtype=np.float32).reshape(4, 2)

    spec = _write_plain(tmp_path, kind, model)
    with pytest.raises(gl.GadgetValueError):
        spec.open(cache_bytes=-1)
    for bad in (1.5, "1"):
        with pytest.raises(gl.GadgetTypeError):
            spec.open(cache_bytes=bad)
    for bad in ("False", 0, 1, "yes"):
        with pytest.raises(gl.GadgetTypeError):
            spec.open(writable=bad)
    for ok in (True, False, None, np.bool_(False), np.bool_(True)):
        g = spec.open(writable=ok)
        assert_same(g.getNumpyVersion(), model)
        g.close()
    check_file(spec, model, torch.float32)


def _write_plain(tmp_path, kind: str, model: np.ndarray) -> FileSpec:
    if kind == "npy":
        path = str(tmp_path / "p.npy")
        np.save(path, model)
    elif kind == "h5":
        path = str(tmp_path / "p.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=model, chunks=(1, *model.shape[1:]))
    else:
        path = str(tmp_path / "p.zarr")
        z = zarr.create_array(
            path, shape=model.shape, dtype=model.dtype, chunks=(1, *model.shape[1:])
        )
        z[...] = model
    return FileSpec(kind, path)


@pytest.mark.parametrize("opt", [{"cache_bytes": 1}, {"writable": False}, {"block_rows": 2}])
def test_file_options_are_refused_for_memory_tables(opt) -> None:
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.zeros((3, 2), np.float32), placement="cpu", device=CPU, **opt)


@_settings(50)
@given(
    data=st.data(),
    kind=st.sampled_from(FILE_KINDS),
    dt=st.sampled_from(DTYPES),
    shape=table_shapes(1),
    op=st.sampled_from(
        [
            "insertData",
            "scatter",
            "setitem",
            "part",
            "fill_",
            "zero_",
            "uniform_",
            "normal_",
            "init_",
            "bad_ids",
        ]
    ),
    cache=st.sampled_from([None, 0, 1]),
)
def test_read_only_file_table_refuses_writes_and_changes_nothing(
    data, kind, dt, shape, op, cache
) -> None:
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    rng = np.random.default_rng(31)
    try:
        model = rand_values(rng, dt, shape)
        spec = write_file(data, d, "r", kind, model, dt)
        opts: dict[str, Any] = {"writable": False}
        if cache is not None:
            opts["cache_bytes"] = cache
        g = spec.open(**opts)
        rows, row_shape = shape[0], tuple(shape[1:])
        obj, idx = data.draw(id_sets(rows))
        vals = to_torch(rand_values(rng, dt, idx.shape + row_shape), dt)
        if op in ("uniform_", "normal_", "init_") and not dt.is_floating_point:
            op = "fill_"
        with pytest.raises(gl.ReadOnlyError):
            if op == "insertData":
                g.insertData(vals, obj)
            elif op == "scatter":
                g.scatter(obj, vals)
            elif op == "setitem":
                g[obj] = vals
            elif op == "part":
                if row_shape:
                    g[[0], 0] = to_torch(rand_values(rng, dt, (1, *row_shape[1:])), dt)
                else:
                    g[[0]] = to_torch(rand_values(rng, dt, (1,)), dt)
            elif op == "fill_":
                g.fill_(1)
            elif op == "zero_":
                g.zero_()
            elif op == "uniform_":
                g.uniform_(0.0, 1.0)
            elif op == "normal_":
                g.normal_(0.0, 1.0)
            elif op == "init_":
                g.init_(torch.nn.init.ones_)
            else:
                g.insertData(to_torch(rand_values(rng, dt, (1, *row_shape)), dt), [0])
        assert issubclass(gl.ReadOnlyError, gl.GadgetError)
        assert issubclass(gl.ReadOnlyError, PermissionError)
        # reads still work and match
        obj, idx = data.draw(id_sets(rows))
        assert_tensor(g.getData(obj), model_read(model, idx), dt, "read of a read-only table")
        assert_same(g.getNumpyVersion(), model, "read-only table after a refused write")
        # it can still be saved elsewhere
        fmt = "h5" if dt == torch.bfloat16 else "npy"
        out = os.path.join(d, "copy." + fmt)
        g.save(out)
        g.close()
        check_file(FileSpec(fmt, out), model, dt, "copy of a read-only table")
        check_file(spec, model, dt, "read-only file after refused writes")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_default_writable_file_table_writes_through_on_each_call(tmp_path, kind) -> None:
    """README: each write reaches the file before it returns (read here natively while
    the table stays open, after flush() for safety with HDF5's own handle)."""
    model = np.arange(12, dtype=np.float32).reshape(6, 2)
    spec = _write_plain(tmp_path, kind, model)
    g = spec.open(cache_bytes=0)
    g.insertData(torch.full((2, 2), 5.0), [5, 1])
    model[[5, 1]] = 5.0
    g.flush()
    if kind != "h5":  # HDF5: another handle while the table holds the file's lock
        assert_same(read_file_natively(spec, torch.float32), model)
    g.close()
    check_file(spec, model, torch.float32)
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    with pytest.raises(gl.GadgetClosedError):
        g.insertData(torch.zeros(1, 2), [0])
    assert g.shape == (6, 2) and len(g) == 6
    check_file(spec, model, torch.float32, "file after calls on the closed table")


def test_fortran_ordered_npy_is_read_only_and_reads_right(tmp_path) -> None:
    """README: read-only sources raise ReadOnlyError saying why, e.g. a Fortran-ordered .npy."""
    m = np.arange(24, dtype=np.float64).reshape(6, 4)
    path = str(tmp_path / "f.npy")
    np.save(path, np.asfortranarray(m))
    g = gl.DataGadget(path, placement="file", device=CPU)
    assert_same(to_np(g.getData([5, 0, 5])), m[[5, 0, 5]])
    assert_same(to_np(g[[1, 2], -1]), m[[1, 2], -1])
    assert_same(np.asarray(g), m)
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        g.insertData(torch.zeros(1, 4, dtype=torch.float64), [0])
    with pytest.raises(gl.ReadOnlyError):
        g[[1], 0:2] = torch.zeros(1, 2, dtype=torch.float64)
    assert_same(g.getNumpyVersion(), m)
    g.close()
    assert_same(np.load(path), m)


def test_hdf5_external_link_is_read_only_and_reads_the_target(tmp_path) -> None:
    m = np.arange(18, dtype=np.int32).reshape(6, 3)
    tgt, lnk = str(tmp_path / "tgt.h5"), str(tmp_path / "lnk.h5")
    with h5py.File(tgt, "w") as f:
        f.create_dataset("d", data=m, chunks=(2, 3))
    with h5py.File(lnk, "w") as f:
        f["x"] = h5py.ExternalLink(tgt, "/d")
    g = gl.DataGadget(lnk, placement="file", device=CPU, dataset="x")
    assert_same(to_np(g.getData(np.array([[3, 3], [0, 5]], np.uint8))), m[[[3, 3], [0, 5]]])
    with pytest.raises(gl.ReadOnlyError):
        g.scatter([0], torch.zeros(1, 3, dtype=torch.int32))
    assert_same(g.getNumpyVersion(), m)
    g.close()
    with h5py.File(tgt, "r") as f:
        assert_same(f["d"][...], m)


@_settings(30)
@given(
    data=st.data(),
    dt=st.sampled_from(DTYPES),
    fmt=st.sampled_from(["npy", "hdf5", "zarr"]),
    placement=st.sampled_from(["cpu", "file"]),
)
def test_format_argument_forces_the_format_without_an_extension(data, dt, fmt, placement) -> None:
    if fmt == "npy" and dt == torch.bfloat16:
        dt = torch.float16
    d = tempfile.mkdtemp(prefix="gl35_")
    try:
        model = rand_values(np.random.default_rng(3), dt, (5, 2))
        g = gl.DataGadget(to_torch(model, dt), placement="cpu", device=CPU)
        path = os.path.join(d, "table_without_extension")
        g.save(path, format=fmt)
        for kw in ({"format": fmt}, {}):  # else the format comes from the content
            r = gl.DataGadget(path, placement=placement, device=CPU, **kw)
            assert r.dtype == dt
            assert_same(to_np(r.getData(slice(None))), model, f"reopened with {kw}")
            r.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", ["cpu", "npy"])
@pytest.mark.parametrize("what", ["ids", "ids_2d", "values", "values_1d"])
def test_numpy_negative_stride_on_a_length_one_axis(tmp_path, kind, what) -> None:
    """README: ids and rows may be NumPy arrays. A view reversed along an axis of length 1
    (``a[::-1]`` of one row) is a valid array that NumPy even flags C-contiguous; it must
    gather/write like its copy (or, at most, be refused with a GadgetError)."""
    m = np.arange(15, dtype=np.float32).reshape(5, 3)
    if what == "values_1d":
        m = m[:, 0].copy()
    if kind == "cpu":
        g = gl.DataGadget(m.copy(), placement="cpu", device=CPU)
    else:
        np.save(tmp_path / "a.npy", m)
        g = gl.DataGadget(str(tmp_path / "a.npy"), placement="file", device=CPU)
    with g:
        if what == "ids":
            ids = np.array([2])[::-1]
            assert_same(to_np(g.getData(ids)), m[[2]])
        elif what == "ids_2d":
            ids = np.array([[1, 4]])[::-1]
            assert_same(to_np(g.getData(ids)), m[[[1, 4]]])
        elif what == "values":
            g.insertData(np.full((1, 3), 7, np.float32)[::-1], [3])
            m[3] = 7
        else:
            g.insertData(np.array([5.0], np.float32)[::-1], [2])
            m[2] = 5
        assert_same(g.getNumpyVersion(), m)


@_settings(30)
@given(
    data=st.data(),
    kind=st.sampled_from(["cpu", *FILE_KINDS]),
    dt=st.sampled_from([torch.float32, torch.int16, torch.bfloat16, torch.bool, torch.uint8]),
    rows=st.integers(100, 400),
    width=st.integers(1, 3),
    cache=st.sampled_from([None, 0, 256]),
)
def test_many_ids_over_many_chunks(data, kind, dt, rows, width, cache) -> None:
    """Longer id batches (hundreds, mostly repeats, in no order) over tables of many small
    chunks: gathers and last-wins writes agree with the model."""
    dt = _dt_for(kind, dt)
    d = tempfile.mkdtemp(prefix="gl35_")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**20)))
    try:
        model = rand_values(rng, dt, (rows, width))
        opts = {} if cache is None or kind == "cpu" else {"cache_bytes": cache}
        g, spec = _table(kind, model, dt, d, data, **opts)
        for _ in range(3):
            n = int(rng.integers(0, 3 * rows))
            ids = rng.integers(0, rows, n)
            if rng.random() < 0.5:
                ids = np.sort(ids)
            tid = torch.from_numpy(ids).to(
                data.draw(st.sampled_from([torch.int16, torch.int32, torch.int64]))
            )
            assert_tensor(g.getData(tid), model[ids], dt, f"gather of {n} ids")
            w = rng.integers(0, rows, int(rng.integers(0, 2 * rows)))
            vals = rand_values(rng, dt, (len(w), width))
            g.insertData(to_torch(vals, dt), w.astype(np.int32))
            model_write(model, w, vals)
            assert_same(g.getNumpyVersion(), model, f"scatter of {len(w)} ids")
        g.close()
        if spec is not None:
            check_file(spec, model, dt)
    finally:
        shutil.rmtree(d, ignore_errors=True)
