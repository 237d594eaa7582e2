"""Black-box review (session 32) of DataGadget row I/O and GadgetSampler resume through
hypothesis stateful testing against a NumPy model; written from README.md, SPEC.md and the
public docstrings only.

Machine (a): one DataGadget (``cpu``, or ``file`` over .npy / HDF5 / zarr) plus a second
``cpu`` table, every rule mirrored on NumPy arrays; after every rule the tables must equal
the model. Machine (b): a GadgetSampler whose batches are predicted from ``epoch_order``
and the documented rank / batch layout, checkpointed into fresh samplers at random points.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import tempfile

import numpy as np
import pytest
import torch

import gadgetloader as gl

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

try:
    import h5py
except ImportError:  # pragma: no cover
    h5py = None
try:
    import zarr
except ImportError:  # pragma: no cover
    zarr = None


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


STATE_SETTINGS = dict(
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=False,
)

# --------------------------------------------------------------------------------------
# helpers for machine (a)
# --------------------------------------------------------------------------------------

NP_ID_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
TORCH_ID_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
ID_KINDS = (
    ["list", "tuple", "np_strided", "torch_strided", "np2d", "torch2d"]
    + [f"np_{d}" for d in NP_ID_DTYPES]
    + [f"torch_{str(d).split('.')[-1]}" for d in TORCH_ID_DTYPES]
)


def as_ids(ids: list[int], kind: str):
    """Convert a list of ids to ``kind``; returns (ids object, numpy int64 model ids)."""
    ref = np.asarray(ids, dtype=np.int64)
    if kind == "list":
        return list(ids), ref
    if kind == "tuple":
        assert len(ids) >= 1
        return tuple(int(i) for i in ids), ref
    if kind == "np_strided":
        big = np.zeros(2 * len(ids), dtype=np.int64)
        big[::2] = ids
        return big[::2], ref
    if kind == "torch_strided":
        big = torch.zeros(2 * len(ids), dtype=torch.int64)
        big[::2] = torch.tensor(ids, dtype=torch.int64)
        return big[::2], ref
    if kind == "np2d":
        assert len(ids) % 2 == 0
        return ref.reshape(2, -1).copy(), ref.reshape(2, -1)
    if kind == "torch2d":
        assert len(ids) % 2 == 0
        return torch.tensor(ids, dtype=torch.int64).reshape(2, -1), ref.reshape(2, -1)
    if kind.startswith("np_"):
        return np.asarray(ids, dtype=np.dtype(kind[3:])), ref
    if kind.startswith("torch_"):
        return torch.tensor(ids, dtype=getattr(torch, kind[6:])), ref
    raise AssertionError(kind)


def kind_fits(kind: str, ids: list[int]) -> bool:
    if kind == "tuple" and len(ids) == 0:
        return False
    if kind in ("np2d", "torch2d") and len(ids) % 2:
        return False
    if kind.endswith(("uint8", "uint16", "uint32", "uint64")) and any(i < 0 for i in ids):
        return False
    if (
        kind.endswith("int8")
        and not kind.endswith("uint8")
        and any(not -128 <= i <= 127 for i in ids)
    ):
        return False
    return not (kind.endswith("uint8") and any(i > 255 for i in ids))


def model_assign_rows(model: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """NumPy's sequential assignment: the last occurrence of a repeated id wins."""
    flat_ids = ids.reshape(-1)
    flat_rows = rows.reshape((-1,) + model.shape[1:])
    for i, r in zip(flat_ids.tolist(), flat_rows, strict=True):
        model[i] = r


def write_source(backend: str, arr: np.ndarray, d: str, **options):
    """Create the backend's table over a copy of ``arr``; returns (gadget, path, dataset)."""
    if backend.startswith("cpu"):
        return gl.DataGadget(arr, placement="cpu"), None, None
    if backend == "npy":
        p = os.path.join(d, "src.npy")
        np.save(p, arr)
        return gl.DataGadget(p, placement="file", **options), p, None
    if backend in ("h5", "h5gz"):
        if h5py is None:
            pytest.skip("h5py not installed")
        p = os.path.join(d, "src.h5")
        kw = dict(compression="gzip") if backend == "h5gz" else {}
        with h5py.File(p, "w") as f:
            f.create_dataset("emb", data=arr, chunks=(min(3, arr.shape[0]),) + arr.shape[1:], **kw)
        return gl.DataGadget(p, placement="file", **options), p, "emb"
    if backend == "zarr":
        if zarr is None:
            pytest.skip("zarr not installed")
        p = os.path.join(d, "src.zarr")
        gl.DataGadget(arr, placement="cpu").save(p, chunk_rows=3)
        return gl.DataGadget(p, placement="file", **options), p, None
    raise AssertionError(backend)


def read_file_independently(path: str, dataset: str | None) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path)
    if path.endswith(".h5"):
        with h5py.File(path, "r") as f:
            if dataset is None:
                (dataset,) = list(f.keys())
            return f[dataset][...]
    if path.endswith(".zarr"):
        return np.asarray(zarr.open(path, mode="r")[...])
    raise AssertionError(path)


class GadgetMachine(RuleBasedStateMachine):
    """A DataGadget (``BACKEND``) and a second cpu table against NumPy models."""

    BACKEND = "cpu"
    EXTRA_ROW_AXES: tuple = ()
    OPTIONS: dict = {}

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="gl_s32_")
        self.g = None
        self.g2 = None
        self.saves = 0
        self.kept = []  # (tensor returned by a read, its expected value): reads are copies

    # ---------------------------------------------------------------- setup
    @initialize(n=st.integers(1, 12), d=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
    def setup(self, n, d, seed):
        rng = np.random.default_rng(seed)
        self.np_dtype = np.int32 if self.BACKEND == "cpu_i32" else np.float32
        row_shape = (d,) + self.EXTRA_ROW_AXES
        arr = rng.integers(-100, 100, size=(n,) + row_shape).astype(self.np_dtype)
        self.model = arr.copy()
        self.g, self.path, self.dataset = write_source(self.BACKEND, arr, self.dir, **self.OPTIONS)
        self.model2 = rng.integers(-(2**40), 2**40, size=(n, 2)).astype(np.int64)
        self.g2 = gl.DataGadget(self.model2.copy(), placement="cpu")
        self.placement = self.g.placement
        assert self.placement == ("cpu" if self.BACKEND.startswith("cpu") else "file")

    def teardown(self):
        for g in (self.g, self.g2):
            if g is not None:
                g.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---------------------------------------------------------------- draws
    @property
    def n(self):
        return self.model.shape[0]

    def draw_ids(self, data, *, allow_empty=True, max_size=8):
        ids = data.draw(
            st.lists(
                st.integers(0, self.n - 1), min_size=0 if allow_empty else 1, max_size=max_size
            ),
            label="ids",
        )
        kind = data.draw(st.sampled_from(ID_KINDS), label="kind")
        assume(kind_fits(kind, ids))
        return as_ids(ids, kind)

    def draw_rows(self, data, shape):
        seed = data.draw(st.integers(0, 2**32 - 1), label="rows seed")
        rng = np.random.default_rng(seed)
        return rng.integers(-1000, 1000, size=shape).astype(self.np_dtype)

    def draw_bad_ids(self, data):
        ids = data.draw(st.lists(st.integers(0, self.n - 1), max_size=5), label="good ids")
        bad = data.draw(
            st.one_of(
                st.integers(-self.n - 3, -1),
                st.integers(self.n, self.n + 5),
                st.sampled_from([2**31, 2**40, -(2**40)]),
            ),
            label="bad id",
        )
        pos = data.draw(st.integers(0, len(ids)), label="bad pos")
        ids = ids[:pos] + [bad] + ids[pos:]
        kind = data.draw(st.sampled_from(ID_KINDS), label="kind")
        if kind.startswith(("np_int", "np_uint", "torch_int", "torch_uint")):
            info = np.iinfo(kind.split("_")[1])
            assume(info.min <= bad <= info.max)
        assume(kind_fits(kind, ids))
        return as_ids(ids, kind)

    def draw_row_slice(self, data):
        n = self.n
        start = data.draw(st.one_of(st.none(), st.integers(-n - 2, n + 2)), label="start")
        stop = data.draw(st.one_of(st.none(), st.integers(-n - 2, n + 2)), label="stop")
        step = data.draw(st.sampled_from([None, 1, 2, 3, 5]), label="step")
        return slice(start, stop, step)

    def draw_col_index(self, data):
        """A tuple of ints / slices into the row's axes (1 .. row ndim entries)."""
        row_shape = self.model.shape[1:]
        k = data.draw(st.integers(1, len(row_shape)), label="row axes indexed")
        out = []
        for dcol in row_shape[:k]:
            if data.draw(st.booleans(), label="int column"):
                out.append(data.draw(st.integers(-dcol, dcol - 1), label="col"))
                continue
            start = data.draw(st.one_of(st.none(), st.integers(-dcol - 2, dcol + 2)), label="c0")
            stop = data.draw(st.one_of(st.none(), st.integers(-dcol - 2, dcol + 2)), label="c1")
            step = data.draw(st.sampled_from([None, 1, 2, 3]), label="cstep")
            out.append(slice(start, stop, step))
        return tuple(out)

    def model_part(self, ref_rows, cols):
        if isinstance(ref_rows, slice):
            return self.model[(ref_rows,) + cols]
        return self.model[ref_rows][(slice(None),) * ref_rows.ndim + cols]

    # ---------------------------------------------------------------- reads
    @rule(data=st.data(), form=st.sampled_from(["getData", "getitem", "gather"]))
    def get_rows(self, data, form):
        ids, ref = self.draw_ids(data)
        if form == "getData":
            out = self.g.getData(ids)
        elif form == "getitem":
            out = self.g[ids]
        else:
            out = self.g.gather(ids)
        assert isinstance(out, torch.Tensor)
        assert out.device.type == "cpu"
        expected = self.model[ref]
        assert tuple(out.shape) == expected.shape
        np.testing.assert_array_equal(out.numpy(), expected)
        self.keep(out, expected)

    def keep(self, out, expected):
        self.kept = self.kept[-3:] + [(out, expected.copy())]

    @rule(data=st.data())
    def get_scalar_ids(self, data):
        i = data.draw(st.integers(0, self.n - 1), label="i")
        form = data.draw(st.sampled_from(["int", "np_int64", "torch0d", "np0d"]), label="form")
        obj = {
            "int": i,
            "np_int64": np.int64(i),
            "torch0d": torch.tensor(i),
            "np0d": np.array(i, dtype=np.int32),
        }[form]
        out = self.g.getData(obj)
        assert tuple(out.shape) == self.model.shape[1:]
        np.testing.assert_array_equal(out.numpy(), self.model[i])

    @rule(data=st.data())
    def get_range(self, data):
        start = data.draw(st.integers(0, self.n), label="start")
        stop = data.draw(st.integers(start, self.n), label="stop")
        step = data.draw(st.integers(1, 3), label="step")
        out = self.g.getData(range(start, stop, step))
        np.testing.assert_array_equal(out.numpy(), self.model[start:stop:step])

    @rule(data=st.data())
    def get_slice(self, data):
        sl = self.draw_row_slice(data)
        out = self.g.getData(sl) if data.draw(st.booleans()) else self.g[sl]
        expected = self.model[sl]
        assert tuple(out.shape) == expected.shape
        np.testing.assert_array_equal(out.numpy(), expected)
        self.keep(out, expected)

    @rule(data=st.data())
    def get_tuple_index(self, data):
        if data.draw(st.booleans(), label="rows as slice"):
            rows = self.draw_row_slice(data)
            ref_rows = rows
        else:
            rows, ref_rows = self.draw_ids(data, allow_empty=False)
        cols = self.draw_col_index(data)
        index = (rows,) + cols
        out = self.g.getData(index) if data.draw(st.booleans()) else self.g[index]
        expected = self.model_part(ref_rows, cols)
        assert tuple(out.shape) == expected.shape, (index, out.shape, expected.shape)
        np.testing.assert_array_equal(out.numpy(), expected)
        self.keep(out, expected)

    @rule(data=st.data())
    def get_alone_in_tuple(self, data):
        ids = data.draw(st.lists(st.integers(0, self.n - 1), min_size=1, max_size=5))
        out = self.g[(list(ids),)]
        np.testing.assert_array_equal(out.numpy(), self.model[np.asarray(ids)])

    # ---------------------------------------------------------------- writes
    @rule(
        data=st.data(),
        form=st.sampled_from(
            [
                "torch",
                "numpy",
                "setitem",
                "scatter",
                "torch_strided",
                "numpy_fortran",
                "numpy_readonly",
            ]
        ),
    )
    def insert_rows(self, data, form):
        ids, ref = self.draw_ids(data)
        rows = self.draw_rows(data, ref.shape + self.model.shape[1:])
        if form == "torch":
            self.g.insertData(torch.from_numpy(rows.copy()), ids)
        elif form == "numpy":
            self.g.insertData(rows.copy(), ids)
        elif form == "torch_strided":
            big = torch.zeros(rows.shape + (2,), dtype=torch.from_numpy(rows[:0]).dtype)
            big[..., 1] = torch.from_numpy(rows)
            view = big[..., 1]  # same shape, not contiguous
            self.g.insertData(view, ids)
        elif form == "numpy_fortran":
            self.g.insertData(np.asfortranarray(rows), ids)
        elif form == "numpy_readonly":
            ro = rows.copy()
            ro.setflags(write=False)
            self.g.insertData(ro, ids)
        elif form == "setitem":
            self.g[ids] = torch.from_numpy(rows.copy())
        else:
            self.g.scatter(ids, torch.from_numpy(rows.copy()))
        model_assign_rows(self.model, ref, rows)

    @rule(data=st.data())
    def insert_slice(self, data):
        sl = self.draw_row_slice(data)
        shape = self.model[sl].shape
        rows = self.draw_rows(data, shape)
        if data.draw(st.booleans()):
            self.g.insertData(torch.from_numpy(rows), sl)
        else:
            self.g[sl] = rows
        self.model[sl] = rows

    @rule(data=st.data())
    def insert_tuple_index(self, data):
        if data.draw(st.booleans(), label="rows as slice"):
            rows = self.draw_row_slice(data)
            ref_rows = rows
        else:
            rows, ref_rows = self.draw_ids(data, allow_empty=False)
        cols = self.draw_col_index(data)
        shape = self.model_part(ref_rows, cols).shape
        vals = self.draw_rows(data, shape)
        index = (rows,) + cols
        if data.draw(st.booleans()):
            self.g.insertData(torch.from_numpy(vals.copy()), index)
        else:
            self.g[index] = torch.from_numpy(vals.copy())
        if isinstance(ref_rows, slice):
            self.model[(ref_rows,) + cols] = vals
        else:
            flat = ref_rows.reshape(-1)
            fvals = vals.reshape((flat.size,) + vals.shape[ref_rows.ndim :])
            for i, v in zip(flat.tolist(), fvals, strict=True):
                self.model[(i,) + cols] = v

    @rule(data=st.data(), op=st.sampled_from(["get", "insert"]))
    def bad_column_refused(self, data, op):
        ids = data.draw(st.lists(st.integers(0, self.n - 1), min_size=1, max_size=4))
        dcol = self.model.shape[1]
        col = data.draw(st.one_of(st.integers(dcol, dcol + 3), st.integers(-dcol - 3, -dcol - 1)))
        with pytest.raises(gl.GadgetIndexError):
            if op == "get":
                self.g.getData((ids, col))
            else:
                shape = (len(ids),) + self.model.shape[2:]
                self.g.insertData(torch.from_numpy(self.draw_rows(data, shape)), (ids, col))

    @precondition(lambda self: getattr(self, "placement", None) == "cpu")
    @rule(data=st.data())
    def insert_from_own_view(self, data):
        """Rows taken from as_tensor() (the table's own memory) written to other rows:
        the result is NumPy's (the source is read before it is overwritten)."""
        a = data.draw(st.integers(0, self.n - 1), label="a")
        b = data.draw(st.integers(a, self.n), label="b")
        src = self.g.as_tensor()[a:b]
        k = b - a
        if data.draw(st.booleans(), label="as slice"):
            c = data.draw(st.integers(0, self.n - k), label="c")
            dest, ref = slice(c, c + k), np.arange(c, c + k)
        else:
            ids = data.draw(
                st.lists(st.integers(0, self.n - 1), min_size=k, max_size=k), label="ids"
            )
            dest, ref = ids, np.asarray(ids, dtype=np.int64)
        rows = self.model[a:b].copy()
        self.g.insertData(src, dest)
        model_assign_rows(self.model, ref, rows)

    # ---------------------------------------------------------------- refusals
    @rule(
        data=st.data(),
        op=st.sampled_from(["get", "getitem", "insert", "setitem", "get_out"]),
        check=st.booleans(),
    )
    def bad_ids_refused(self, data, op, check):
        """CPU ids are always checked (check_ids=False only skips the CUDA id check)."""
        ids, ref = self.draw_bad_ids(data)
        rows = self.draw_rows(data, ref.shape + self.model.shape[1:])
        with pytest.raises(gl.GadgetIndexError) as ei:
            if op == "get":
                self.g.getData(ids, check_ids=check)
            elif op == "getitem":
                self.g[ids]
            elif op == "insert":
                self.g.insertData(torch.from_numpy(rows), ids, check_ids=check)
            elif op == "get_out":
                self.g.getData(ids, out=torch.from_numpy(rows), check_ids=check)
            else:
                self.g[ids] = torch.from_numpy(rows)
        assert isinstance(ei.value, IndexError)

    @rule(data=st.data())
    def get_into_out(self, data):
        ids, ref = self.draw_ids(data)
        expected = self.model[ref]
        out = torch.full(expected.shape, 7, dtype=torch.from_numpy(expected).dtype)
        ret = self.g.getData(ids, out=out)
        assert ret.data_ptr() == out.data_ptr() and tuple(ret.shape) == expected.shape
        np.testing.assert_array_equal(out.numpy(), expected)

    @rule(data=st.data(), what=st.sampled_from(["shape", "dtype", "noncontig", "tuple_index"]))
    def get_into_bad_out_refused(self, data, what):
        ids, ref = self.draw_ids(data, allow_empty=False)
        shape = ref.shape + self.model.shape[1:]
        dt = torch.from_numpy(self.model[:0]).dtype
        index = ids
        if what == "shape":
            out = torch.zeros((shape[0] + 1,) + shape[1:], dtype=dt)
        elif what == "dtype":
            out = torch.zeros(shape, dtype=torch.float64)
        elif what == "noncontig":
            out = torch.zeros(shape + (2,), dtype=dt)[..., 0]
            assume(not out.is_contiguous())  # torch calls a tensor of <= 1 element contiguous
        else:
            index = (np.asarray(ref), slice(None))
            out = torch.zeros(self.model_part(ref, (slice(None),)).shape, dtype=dt)
        with pytest.raises(gl.GadgetError):
            self.g.getData(index, out=out)

    @rule(data=st.data())
    def check_ids_must_be_bool(self, data):
        flag = data.draw(st.sampled_from(["False", "True", 2, None]))
        with pytest.raises(gl.GadgetTypeError):
            self.g.getData([0], check_ids=flag)
        with pytest.raises(gl.GadgetTypeError):
            self.g.insertData(torch.from_numpy(self.model[:1].copy()), [0], check_ids=flag)

    @rule()
    def array_protocol(self):
        np.testing.assert_array_equal(np.asarray(self.g), self.model)
        if self.placement == "cpu":
            view = np.asarray(self.g, copy=False)
            np.testing.assert_array_equal(view, self.model)
        else:
            with pytest.raises(gl.GadgetValueError):
                np.asarray(self.g, copy=False)

    @rule(data=st.data())
    def bad_scalar_id_refused(self, data):
        i = data.draw(st.one_of(st.integers(-5, -1), st.integers(self.n, self.n + 3)))
        with pytest.raises(gl.GadgetIndexError):
            self.g.getData(i)
        with pytest.raises(gl.GadgetIndexError):
            self.g.insertData(torch.from_numpy(self.model[0].copy()), i)

    @rule(data=st.data(), what=st.sampled_from(["dtype", "shape", "scalar", "list"]))
    def bad_data_refused(self, data, what):
        ids, ref = self.draw_ids(data, allow_empty=False)
        shape = ref.shape + self.model.shape[1:]
        rows = self.draw_rows(data, shape)
        if what == "dtype":
            bad = torch.from_numpy(rows.astype(np.float64))
            exc = gl.GadgetTypeError
        elif what == "shape":
            bad = torch.from_numpy(self.draw_rows(data, (shape[0] + 1,) + shape[1:]))
            exc = gl.GadgetValueError
        elif what == "scalar":
            bad = torch.tensor(rows.reshape(-1)[0])  # not broadcast
            exc = gl.GadgetError
        else:  # a list is read as NumPy reads it: float64 / int64, not the table's dtype
            bad = rows.tolist()
            exc = gl.GadgetTypeError
        with pytest.raises(exc):
            self.g.insertData(bad, ids)

    @rule(data=st.data())
    def float_ids_refused(self, data):
        ids = data.draw(st.lists(st.integers(0, self.n - 1), min_size=1, max_size=4))
        form = data.draw(st.sampled_from(["np", "torch", "list"]))
        obj = {
            "np": np.asarray(ids, dtype=np.float64),
            "torch": torch.tensor(ids, dtype=torch.float32),
            "list": [float(i) for i in ids],
        }[form]
        with pytest.raises(gl.GadgetTypeError):
            self.g.getData(obj)
        with pytest.raises(gl.GadgetTypeError):
            self.g.insertData(torch.from_numpy(self.model[np.asarray(ids)].copy()), obj)

    # ---------------------------------------------------------------- initialisers
    @rule(data=st.data())
    def fill(self, data):
        v = data.draw(st.integers(-100, 100), label="value")
        form = data.draw(st.sampled_from(["int", "float", "tensor0d", "array1"]), label="form")
        if form == "int":
            obj = v
        elif form == "float":
            obj = float(v)
        elif form == "tensor0d":
            obj = torch.tensor(v, dtype=torch.from_numpy(self.model[:0]).dtype)
        else:
            obj = np.array([v], dtype=self.np_dtype)
        ret = self.g.fill_(obj)
        assert ret is self.g
        self.model[...] = v

    @rule()
    def zero(self):
        ret = self.g.zero_()
        assert ret is self.g
        self.model[...] = 0

    @rule(data=st.data())
    def fill_refused(self, data):
        if self.np_dtype == np.int32:
            v = data.draw(st.sampled_from([2.5, 2**31, -(2**31) - 1, float("nan")]))
        else:
            v = data.draw(st.sampled_from([1e39, -1e39, 2.0**128]))
        with pytest.raises(gl.GadgetError):
            self.g.fill_(v)

    # ---------------------------------------------------------------- save / load
    @rule(fmt=st.sampled_from([".npy", ".h5", ".zarr"]), reload=st.booleans())
    def save_then_load(self, fmt, reload):
        if fmt == ".h5" and h5py is None or fmt == ".zarr" and zarr is None:
            return
        self.saves += 1
        p = os.path.join(self.dir, f"saved{self.saves}{fmt}")
        kw = {} if fmt == ".npy" else dict(chunk_rows=2)
        self.g.save(p, **kw)
        with gl.DataGadget(p, placement="cpu") as back:
            assert back.dtype == torch.from_numpy(self.model[:0]).dtype
            np.testing.assert_array_equal(back.getNumpyVersion(), self.model)
        np.testing.assert_array_equal(read_file_independently(p, None), self.model)
        if reload:
            self.g.load(p)
            assert self.g.placement == self.placement
            if self.placement == "file":
                self.path, self.dataset = p, None

    @precondition(lambda self: getattr(self, "path", None) is not None and self.placement == "file")
    @rule()
    def file_holds_model(self):
        np.testing.assert_array_equal(read_file_independently(self.path, self.dataset), self.model)

    @precondition(lambda self: getattr(self, "path", None) is not None and self.placement == "file")
    @rule()
    def close_and_reopen(self):
        opts = dict(self.OPTIONS)
        if self.dataset is not None:
            opts["dataset"] = self.dataset
        self.g.close()
        with pytest.raises(gl.GadgetClosedError):
            self.g.getData([0])
        self.g = gl.DataGadget(self.path, placement="file", **opts)

    @rule(data=st.data())
    def pickled_copy(self, data):
        """cpu: a copy by value (writes to it stay there); file: the file's name, so a
        write through the copy is seen by the original table."""
        other = pickle.loads(pickle.dumps(self.g))
        try:
            assert other.placement == self.placement
            np.testing.assert_array_equal(other.getNumpyVersion(), self.model)
            ids, ref = self.draw_ids(data, allow_empty=False)
            rows = self.draw_rows(data, ref.shape + self.model.shape[1:])
            other.insertData(torch.from_numpy(rows), ids)
            if self.placement == "file":
                model_assign_rows(self.model, ref, rows)
        finally:
            other.close()

    # ---------------------------------------------------------------- several tables
    @rule(data=st.data())
    def gather_two(self, data):
        if data.draw(st.booleans(), label="slice"):
            sl = self.draw_row_slice(data)
            ids, ref = sl, np.arange(self.n)[sl]
        else:
            ids, ref = self.draw_ids(data)
        a, b = gl.gather_many([self.g, self.g2], ids)
        np.testing.assert_array_equal(a.numpy(), self.model[ref])
        np.testing.assert_array_equal(b.numpy(), self.model2[ref])
        assert a.dtype == torch.from_numpy(self.model[:0]).dtype and b.dtype == torch.int64

    @rule(data=st.data())
    def scatter_two(self, data):
        ids, ref = self.draw_ids(data)
        rows = self.draw_rows(data, ref.shape + self.model.shape[1:])
        seed = data.draw(st.integers(0, 2**32 - 1))
        rows2 = np.random.default_rng(seed).integers(-(2**40), 2**40, size=ref.shape + (2,))
        gl.scatter_many([self.g, self.g2], [torch.from_numpy(rows), torch.from_numpy(rows2)], ids)
        model_assign_rows(self.model, ref, rows)
        model_assign_rows(self.model2, ref, rows2)

    @rule(data=st.data(), what=st.sampled_from(["ids", "dtype2", "shape2"]))
    def scatter_two_refused(self, data, what):
        if what == "ids":
            ids, ref = self.draw_bad_ids(data)
        else:
            ids, ref = self.draw_ids(data, allow_empty=False)
        rows = torch.from_numpy(self.draw_rows(data, ref.shape + self.model.shape[1:]))
        rows2 = torch.ones(ref.shape + (2,), dtype=torch.int64)
        if what == "dtype2":
            rows2 = rows2.to(torch.int32)
        elif what == "shape2":
            rows2 = torch.ones(ref.shape + (3,), dtype=torch.int64)
        with pytest.raises(gl.GadgetError):
            gl.scatter_many([self.g, self.g2], [rows, rows2], ids)

    # ---------------------------------------------------------------- invariants
    @invariant()
    def table_equals_model(self):
        if self.g is None:
            return
        assert len(self.g) == self.n
        assert tuple(self.g.shape) == self.model.shape
        np.testing.assert_array_equal(self.g.getNumpyVersion(), self.model)
        np.testing.assert_array_equal(self.g2.getNumpyVersion(), self.model2)
        for out, expected in self.kept:
            np.testing.assert_array_equal(out.numpy(), expected)


def _machine_test(backend, **attrs):
    cls = type(f"GadgetMachine_{backend}", (GadgetMachine,), {"BACKEND": backend, **attrs})
    case = cls.TestCase
    case.settings = settings(max_examples=30, stateful_step_count=25, **STATE_SETTINGS)
    return case


TestGadgetCpu = _machine_test("cpu")
TestGadgetCpuInt32 = _machine_test("cpu_i32")
TestGadgetCpu3d = _machine_test("cpu", EXTRA_ROW_AXES=(3,))
TestGadgetNpyFile = _machine_test("npy")
TestGadgetNpyFile3d = _machine_test("npy", EXTRA_ROW_AXES=(2,))
TestGadgetH5File = _machine_test("h5")
TestGadgetH5GzipFile = _machine_test("h5gz", OPTIONS=dict(cache_bytes=0))
TestGadgetH5File3dSmallCache = _machine_test(
    "h5", EXTRA_ROW_AXES=(2,), OPTIONS=dict(cache_bytes=64)
)
TestGadgetZarrFile = _machine_test("zarr")
TestGadgetZarrFileBlocks = _machine_test("zarr", OPTIONS=dict(cache_bytes=100, block_rows=2))


# --------------------------------------------------------------------------------------
# explicit edge cases for machine (a), one per backend
# --------------------------------------------------------------------------------------

BACKENDS = ["cpu", "npy", "h5", "h5gz", "zarr"]


@pytest.fixture
def table(request, tmp_path):
    arr = np.arange(7 * 4, dtype=np.float32).reshape(7, 4)
    opts = dict(cache_bytes=0) if request.param == "h5gz" else {}
    g, _, _ = write_source(request.param, arr, str(tmp_path), **opts)
    yield g, arr.copy()
    g.close()


@pytest.mark.parametrize("table", BACKENDS, indirect=True)
@pytest.mark.parametrize("kind", ["list", "np_int64", "torch_int64", "torch_uint8", "np_uint32"])
def test_empty_ids(table, kind):
    g, arr = table
    ids, _ = as_ids([], kind)
    out = g.getData(ids)
    assert tuple(out.shape) == (0, 4)
    g.insertData(torch.empty(0, 4, dtype=torch.float32), ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), arr)


@pytest.mark.parametrize("table", BACKENDS, indirect=True)
@pytest.mark.parametrize("bad", [-1, 7, 2**40])
@pytest.mark.parametrize("op", ["get", "insert", "partial_insert"])
def test_bad_id_refused_nothing_written(table, bad, op):
    g, arr = table
    ids = torch.tensor([0, 3, bad, 5])
    with pytest.raises(gl.GadgetIndexError):
        if op == "get":
            g.getData(ids)
        elif op == "insert":
            g.insertData(torch.full((4, 4), -1.0), ids)
        else:
            g.insertData(torch.full((4, 2), -1.0), (ids, slice(0, 2)))
    np.testing.assert_array_equal(g.getNumpyVersion(), arr)


@pytest.mark.parametrize("table", BACKENDS, indirect=True)
def test_repeated_ids_last_wins_partial(table):
    g, arr = table
    ids = [2, 2, 5, 2]
    vals = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    g.insertData(vals, (ids, slice(1, 4, 2)))
    arr[2, 1:4:2] = 4.0
    arr[5, 1:4:2] = 3.0
    np.testing.assert_array_equal(g.getNumpyVersion(), arr)


@pytest.mark.parametrize("table", BACKENDS, indirect=True)
@pytest.mark.parametrize(
    "index,exc",
    [
        ((Ellipsis,), gl.GadgetTypeError),
        (Ellipsis, gl.GadgetTypeError),
        ((slice(None), None), gl.GadgetTypeError),
        (([1, 2], [3, 0]), gl.GadgetError),
        ((slice(0, 3), slice(None, None, -1)), gl.GadgetError),
        ((slice(0, 3), slice(0, 2, 0)), gl.GadgetError),
    ],
    ids=["ellipsis_in_tuple", "ellipsis", "none", "pointwise", "negstep", "zerostep"],
)
@pytest.mark.parametrize("op", ["get", "set"])
def test_refused_tuple_indexes(table, index, exc, op):
    g, arr = table
    with pytest.raises(exc):
        if op == "get":
            g.getData(index)
        else:
            g[index] = torch.zeros(2, 2)
    np.testing.assert_array_equal(g.getNumpyVersion(), arr)


# --------------------------------------------------------------------------------------
# machine (b): GadgetSampler
# --------------------------------------------------------------------------------------


def sampler_len(n, R, B, mode):
    if mode == "drop_last":
        return n // (R * B)
    if mode == "pad":
        return -(-n // (R * B))
    return -(-(n // R) // B)


def expected_rank_batches(order: list[int], n, R, r, B, mode) -> list[list[int]]:
    """The documented layout of rank ``r``'s batches over an epoch order."""
    L = sampler_len(n, R, B, mode)
    if mode == "default":
        base, extra = divmod(n, R)
        share = base + (1 if r < extra else 0)
        start = r * base + min(r, extra)
        pos = order[start : start + share]
        batches = [pos[i * B : (i + 1) * B] for i in range(L - 1)]
        batches.append(pos[(L - 1) * B :])
        return batches
    start = r * L * B
    pos = [order[(start + i) % n] for i in range(L * B)]
    return [pos[i * B : (i + 1) * B] for i in range(L)]


def make_sampler(p, *, seed=None, rank=None):
    return gl.GadgetSampler(
        p["n"],
        batch_size=p["B"],
        order=p["order"],
        drop_last=p["mode"] == "drop_last",
        pad=p["mode"] == "pad",
        seed=p["seed"] if seed is None else seed,
        num_replicas=p["R"],
        rank=p["rank"] if rank is None else rank,
    )


@st.composite
def sampler_params(draw):
    R = draw(st.integers(1, 4), label="R")
    B = draw(st.integers(1, 6), label="B")
    mode = draw(st.sampled_from(["default", "drop_last", "pad"]), label="mode")
    n = draw(st.integers(1, 30), label="n")
    if mode == "drop_last":
        n = max(n, R * B)
    elif mode == "default":
        n = max(n, R)
    rank = draw(st.integers(0, R - 1), label="rank")
    seed = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**64 - 1])), label="seed")
    order = draw(st.sampled_from(["random", "sequential"]), label="order")
    return dict(n=n, B=B, R=R, rank=rank, mode=mode, seed=seed, order=order)


class SamplerMachine(RuleBasedStateMachine):
    """One live sampler, swapped for a fresh one loaded from its state at random points."""

    def __init__(self):
        super().__init__()
        self.s = None
        self.orders = {}
        self.trace = []
        self.old = None

    @initialize(p=sampler_params())
    def setup(self, p):
        self.p = p
        self.s = make_sampler(p)
        self.ref = make_sampler(p)  # the uninterrupted run's orders
        self.rank = p["rank"]
        self.L = sampler_len(p["n"], p["R"], p["B"], p["mode"])
        assert len(self.s) == self.L
        self.epoch, self.pos, self.pending, self.loaded_epoch = 0, 0, True, None
        self.it = None

    def order(self, e):
        if e not in self.orders:
            o = self.ref.epoch_order(e)
            assert o.dtype == torch.int64
            ol = o.tolist()
            assert sorted(ol) == list(range(self.p["n"]))
            if self.p["order"] == "sequential":
                assert ol == list(range(self.p["n"]))
            self.orders[e] = ol
        return self.orders[e]

    def expected(self, e, pos):
        p = self.p
        return expected_rank_batches(self.order(e), p["n"], p["R"], self.rank, p["B"], p["mode"])[
            pos
        ]

    def start_pass(self):
        """iter(): a pending position (a load, set_epoch, a finished pass) is where the
        pass starts; else every batch drawn -> the next epoch, or the same epoch anew."""
        self.trace.append("iter")
        self.it = iter(self.s)
        self.fresh_iter = True
        if not self.pending:
            if self.pos == self.L:
                self.epoch += 1
            self.pos = 0
            self.pending = True

    @rule(k=st.integers(1, 4))
    def draw(self, k):
        if self.it is None:
            self.start_pass()
        for _ in range(k):
            self.trace.append("next")
            if self.fresh_iter:
                self.fresh_iter = False
                self.pending = False
                self.loaded_epoch = None
            try:
                b = next(self.it)
            except StopIteration:
                assert self.pos == self.L, (
                    f"pass ended after {self.pos} of {self.L} batches (epoch {self.epoch}); {self.trace}"
                )
                # a finished pass advances the epoch: the state points at the next start
                self.it = None
                self.epoch, self.pos, self.pending = self.epoch + 1, 0, True
                return
            assert self.pos < self.L, (
                f"batch {b.tolist()} after the epoch's {self.L} batches; {self.trace}"
            )
            assert isinstance(b, torch.Tensor) and b.dtype == torch.int64 and b.dim() == 1
            exp = self.expected(self.epoch, self.pos)
            assert b.tolist() == exp, (
                f"epoch {self.epoch} batch {self.pos}: got {b.tolist()} expected {exp}; {self.trace}"
            )
            self.pos += 1

    def keep_old_pass(self):
        if self.it is not None and not self.fresh_iter:
            self.old = dict(it=self.it, epoch=self.epoch, pos=self.pos, rank=self.rank)

    def loaded_and_untouched(self):
        # After load_state_dict, an iter() that drew nothing followed by another iter()
        # or set_epoch is not described by the docs (see the report): not exercised.
        return self.it is not None and self.fresh_iter and self.loaded_epoch is not None

    @rule()
    def restart(self):
        """A new iter() before the pass ends restarts the epoch (or starts the next one)."""
        if self.loaded_and_untouched():
            return
        self.keep_old_pass()
        self.it = None
        self.start_pass()

    @precondition(lambda self: getattr(self, "old", None) is not None)
    @rule(k=st.integers(1, 3))
    def draw_old_pass(self, k):
        """An older pass still read yields its batches but no longer moves the state."""
        old = self.old
        before = self.s.state_dict()
        for _ in range(k):
            self.trace.append("next(old)")
            try:
                b = next(old["it"])
            except StopIteration:
                assert old["pos"] == self.L, (old, self.trace)
                self.old = None
                break
            assert old["pos"] < self.L, (b.tolist(), self.trace)
            p = self.p
            exp = expected_rank_batches(
                self.order(old["epoch"]), p["n"], p["R"], old["rank"], p["B"], p["mode"]
            )
            assert b.tolist() == exp[old["pos"]], (b.tolist(), exp[old["pos"]], self.trace)
            old["pos"] += 1
        assert self.s.state_dict() == before, self.trace

    @rule(e=st.integers(0, 4))
    def set_epoch(self, e):
        if self.loaded_and_untouched():
            return
        self.trace.append(f"set_epoch({e})")
        self.keep_old_pass()
        self.s.set_epoch(e)
        self.it = None
        if self.pending and self.loaded_epoch is not None and e == self.loaded_epoch:
            pass  # keeps the loaded position
        else:
            self.epoch, self.pos, self.pending, self.loaded_epoch = e, 0, True, None
        assert self.s.epoch == self.epoch

    @rule(
        new_seed=st.integers(0, 2**64 - 1),
        new_rank=st.integers(0, 3),
        how=st.sampled_from(["deepcopy", "pickle", "torch"]),
    )
    def checkpoint_into_fresh_sampler(self, new_seed, new_rank, how):
        new_rank %= self.p["R"]
        sd = self.s.state_dict()
        assert isinstance(sd, dict)
        if how == "deepcopy":
            sd = copy.deepcopy(sd)
        elif how == "pickle":
            sd = pickle.loads(pickle.dumps(sd))
        else:
            import io

            buf = io.BytesIO()
            torch.save(sd, buf)
            buf.seek(0)
            sd = torch.load(buf, weights_only=True)
        self.trace.append(f"checkpoint(rank {new_rank}, seed {new_seed})")
        fresh = make_sampler(self.p, seed=new_seed, rank=new_rank)
        fresh.load_state_dict(sd)
        self.old = None
        self.s = fresh
        self.rank = new_rank
        self.it = None
        self.pending = True
        self.loaded_epoch = self.epoch
        assert self.s.epoch == self.epoch
        assert self.s.seed == self.p["seed"]

    @rule(field=st.sampled_from(["n", "B", "R", "order", "mode", "junk", "notdict"]))
    def mismatched_state_refused(self, field):
        p = dict(self.p)
        if field == "n":
            p["n"] += 1
        elif field == "B":
            p["B"] += 1
        elif field == "R":
            p["R"] += 1
            p["rank"] = 0
        elif field == "order":
            p["order"] = "sequential" if p["order"] == "random" else "random"
        elif field == "mode":
            p["mode"] = {"default": "pad", "pad": "default", "drop_last": "pad"}[p["mode"]]
        if field in ("junk", "notdict"):
            bad = [1, 2] if field == "notdict" else {"epoch": 1}
            exc = gl.GadgetTypeError if field == "notdict" else gl.GadgetValueError
        else:
            try:
                other = make_sampler(
                    p, rank=p["rank"] if field == "R" else min(p["rank"], p["R"] - 1)
                )
            except gl.GadgetValueError:
                return
            bad = other.state_dict()
            exc = gl.GadgetValueError
        before = self.s.state_dict()
        self.trace.append(f"bad load({field})")
        with pytest.raises(exc):
            self.s.load_state_dict(bad)
        assert self.s.state_dict() == before

    @invariant()
    def length_and_epoch(self):
        if self.s is None:
            return
        assert len(self.s) == self.L
        if self.pending or (self.it is not None and 0 < self.pos < self.L):
            assert self.s.epoch == self.epoch, (self.s.epoch, self.epoch, self.trace)


TestSamplerResume = SamplerMachine.TestCase
TestSamplerResume.settings = settings(max_examples=300, stateful_step_count=30, **STATE_SETTINGS)


# --------------------------------------------------------------------------------------
# explicit sampler properties
# --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(p=sampler_params(), epoch=st.integers(0, 3))
def test_ranks_cover_the_epoch_as_documented(p, epoch):
    n, R, B, mode = p["n"], p["R"], p["B"], p["mode"]
    per_rank = []
    for r in range(R):
        s = make_sampler(p, rank=r)
        s.set_epoch(epoch)
        per_rank.append([b.tolist() for b in s])
    L = sampler_len(n, R, B, mode)
    assert all(len(bs) == L for bs in per_rank)
    allids = [i for bs in per_rank for b in bs for i in b]
    if mode == "default":
        assert sorted(allids) == list(range(n))
        for bs in per_rank:
            assert all(len(b) == B for b in bs[:-1])
            assert 1 <= len(bs[-1]) <= B + 1
    elif mode == "drop_last":
        assert len(allids) == len(set(allids)) == R * B * (n // (R * B))
        assert all(len(b) == B for bs in per_rank for b in bs)
    else:
        assert len(allids) == R * B * L
        assert set(allids) == set(range(n))  # R * B * L >= n: every row at least once
        assert all(len(b) == B for bs in per_rank for b in bs)


@settings(max_examples=30, deadline=None)
@given(p=sampler_params())
def test_epochs_advance_by_themselves_like_set_epoch(p):
    a = make_sampler(p)
    b = make_sampler(p)
    seq_a = [[x.tolist() for x in a] for _ in range(3)]
    seq_b = []
    for e in range(3):
        b.set_epoch(e)
        seq_b.append([x.tolist() for x in b])
    assert seq_a == seq_b


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5])
def test_seed_out_of_range_refused(seed):
    with pytest.raises((gl.GadgetValueError, gl.GadgetTypeError)):
        gl.GadgetSampler(10, batch_size=2, seed=seed)


@pytest.mark.parametrize("n,R,B", [(5, 1, 6), (7, 2, 4), (3, 4, 1)])
def test_drop_last_with_too_few_rows_refused(n, R, B):
    with pytest.raises(gl.GadgetValueError):
        s = gl.GadgetSampler(n, batch_size=B, drop_last=True, num_replicas=R, rank=0)
        list(s)


def test_num_replicas_without_rank_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(10, batch_size=2, num_replicas=2)


@pytest.mark.parametrize("mode", ["default", "pad", "drop_last"])
def test_state_after_last_batch_gives_empty_pass_then_next_epoch(mode):
    p = dict(n=11, B=3, R=1, rank=0, mode=mode, seed=5, order="random")
    s = make_sampler(p)
    it = iter(s)
    first = [next(it).tolist() for _ in range(len(s))]
    sd = s.state_dict()  # inside the loop, after the epoch's last batch
    fresh = make_sampler(p, seed=99)
    fresh.load_state_dict(sd)
    assert list(fresh) == []
    nxt = [b.tolist() for b in fresh]
    ref = make_sampler(p)
    ref.set_epoch(1)
    assert nxt == [b.tolist() for b in ref]
    ref0 = make_sampler(p)
    assert first == [b.tolist() for b in ref0]


def test_old_pass_no_longer_moves_state():
    p = dict(n=20, B=2, R=1, rank=0, mode="default", seed=1, order="random")
    s = make_sampler(p)
    old = iter(s)
    next(old)
    next(old)
    new = iter(s)  # takes over: the state reads the epoch's start
    sd0 = s.state_dict()
    next(old)  # still yields, but no longer moves the state
    assert s.state_dict() == sd0
    fresh = make_sampler(p)
    fresh.load_state_dict(sd0)
    ref = make_sampler(p)
    assert [b.tolist() for b in fresh] == [b.tolist() for b in ref]
    assert next(new).tolist() == [b.tolist() for b in make_sampler(p)][0]
