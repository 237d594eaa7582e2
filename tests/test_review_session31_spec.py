"""Black-box review (session 31) of the public names SPEC.md lists (SpeedTorch's DataGadget,
ModelFactory, OptimizerFactory, PytorchModelFactory, PytorchOptimizerFactory, and
gadgetloader's GadgetDataset / GadgetSampler / DataLoader entry points, plus ``__all__``,
aliases and docstring examples) on a machine without CUDA; written from README.md, SPEC.md
and the public docstrings only."""

from __future__ import annotations

import doctest
import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


class _Quiet:
    """Ignore the once-per-process FallbackWarning of a GPU placement asked for by name."""

    def __enter__(self):
        self._cw = warnings.catch_warnings()
        self._cw.__enter__()
        warnings.simplefilter("ignore", gl.FallbackWarning)
        return self

    def __exit__(self, *exc):
        return self._cw.__exit__(*exc)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _table(n=10, d=4, dtype=np.float32, seed=0):
    a = _rng(seed).standard_normal((n, d)) * 10
    return a.astype(dtype)


def _cpu_gadget(arr, **kw):
    return gl.DataGadget(arr, placement="cpu", **kw)


def _np(t):
    return t.detach().cpu().numpy()


# --------------------------------------------------------------------------------------
# __all__, aliases, signatures
# --------------------------------------------------------------------------------------

SPEC_NAMES = [
    "DataGadget",
    "ModelFactory",
    "OptimizerFactory",
    "PytorchModelFactory",
    "PytorchOptimizerFactory",
    "GadgetDataset",
    "GadgetSampler",
]


def test_all_lists_resolvable_unique_names_including_spec_names():
    names = list(gl.__all__)
    assert len(names) == len(set(names))
    for n in names:
        assert hasattr(gl, n), n
    for n in SPEC_NAMES + ["GadgetError", "FallbackWarning", "gather_many", "scatter_many"]:
        assert n in names, n


def test_star_import_gives_exactly_all():
    ns: dict = {}
    exec("from gadgetloader import *", ns)
    got = {k for k in ns if k != "__builtins__"}
    assert got == set(gl.__all__)


def test_supported_optimizers_cover_spec_list():
    spec = [
        "SparseAdam",
        "Adam",
        "AdamW",
        "Adamax",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
        "Adagrad",
        "SGD",
    ]
    for n in spec:
        assert n in gl.SUPPORTED_OPTIMIZERS


def test_placements_constant():
    assert set(gl.PLACEMENTS) == {"cuda", "pinned", "cpu", "file"}


@pytest.mark.parametrize(
    "err, builtin",
    [
        ("GadgetIndexError", IndexError),
        ("GadgetTypeError", TypeError),
        ("GadgetValueError", ValueError),
        ("GadgetKeyError", KeyError),
        ("GadgetFileNotFoundError", FileNotFoundError),
        ("MissingDependencyError", ImportError),
        ("GadgetFileError", OSError),
    ],
)
def test_error_hierarchy(err, builtin):
    cls = getattr(gl, err)
    assert issubclass(cls, gl.GadgetError)
    assert issubclass(cls, builtin)


def test_fallback_warning_is_user_warning():
    assert issubclass(gl.FallbackWarning, UserWarning)


def test_cuda_available_false_without_cuda():
    assert gl.cuda_available() is False


def test_datagadget_aliases_are_same_functions():
    assert gl.DataGadget.gather is gl.DataGadget.getData
    assert gl.DataGadget.numpy is gl.DataGadget.getNumpyVersion


def test_scatter_is_insertData_with_torch_order():
    a = _table()
    g1, g2 = _cpu_gadget(a), _cpu_gadget(a)
    ids = torch.tensor([3, 1, 3])
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    g1.insertData(rows, ids)
    g2.scatter(ids, rows)
    np.testing.assert_array_equal(g1.getNumpyVersion(), g2.getNumpyVersion())
    g3 = _cpu_gadget(a)
    g3[ids] = rows
    np.testing.assert_array_equal(g1.getNumpyVersion(), g3.getNumpyVersion())


def test_factories_are_switch_subclasses():
    assert issubclass(gl.ModelFactory, gl.ModelSwitch)
    assert issubclass(gl.PytorchModelFactory, gl.ModelSwitch)
    assert issubclass(gl.OptimizerFactory, gl.OptimizerSwitch)
    assert issubclass(gl.PytorchOptimizerFactory, gl.OptimizerSwitch)


def _params(cls):
    sig = inspect.signature(cls)
    return [
        (p.name, p.default)
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)
    ]


E = inspect.Parameter.empty


@pytest.mark.parametrize(
    "cls, expected",
    [
        ("DataGadget", [("fileName", None), ("CPUPinn", False)]),
        (
            "ModelFactory",
            [
                ("model_variable", E),
                ("total_classes", E),
                ("embed_dimension", E),
                ("datatype", "float32"),
                ("CPUPinn", False),
            ],
        ),
        (
            "OptimizerFactory",
            [
                ("given_optimizer", E),
                ("total_classes", E),
                ("embed_dimension", E),
                ("model", E),
                ("variable_name", E),
                ("dtype", "float32"),
                ("CPUPinn", False),
            ],
        ),
        (
            "PytorchModelFactory",
            [
                ("model_variable", E),
                ("total_classes", E),
                ("embed_dimension", E),
                ("datatype", "float32"),
                ("deviceType", "cuda"),
                ("pinType", False),
            ],
        ),
        (
            "PytorchOptimizerFactory",
            [
                ("given_optimizer", E),
                ("total_classes", E),
                ("embed_dimension", E),
                ("model", E),
                ("variable_name", E),
                ("dtype", "float32"),
                ("deviceType", "cuda"),
                ("pinType", False),
            ],
        ),
    ],
)
def test_spec_signatures(cls, expected):
    assert _params(getattr(gl, cls)) == expected


def test_speedtorch_method_names_present():
    for name in ["getData", "insertData", "saveCupy", "loadCupy", "getNumpyVersion", "gadgetInit"]:
        assert callable(getattr(gl.DataGadget, name))
    for cls in (gl.ModelFactory, gl.PytorchModelFactory):
        for name in [
            "zerosInit",
            "uniformDistributionInit",
            "normalDistributionInit",
            "variableTransformer",
            "beforeForwardPass",
            "afterOptimizerStep",
            "saveCupy",
            "loadCupy",
            "getNumpyVersion",
            "customInit",
            "saveTorch",
            "loadTorch",
        ]:
            assert callable(getattr(cls, name)), (cls, name)
    for cls in (gl.OptimizerFactory, gl.PytorchOptimizerFactory):
        for name in [
            "optInit",
            "beforeForwardPass",
            "afterOptimizerStep",
            "customInit",
            "saveTorch",
            "loadTorch",
            "getNumpyVersion",
        ]:
            assert callable(getattr(cls, name)), (cls, name)


# --------------------------------------------------------------------------------------
# docstring examples
# --------------------------------------------------------------------------------------


def _doctests():
    finder = doctest.DocTestFinder()
    out = []
    for n in gl.__all__:
        obj = getattr(gl, n)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        for t in finder.find(obj, n, globs={}):
            if t.examples:
                out.append(t)
    return out


_DOCTESTS = _doctests()


def test_some_docstring_examples_exist():
    assert {t.name for t in _DOCTESTS} >= {
        "DataGadget",
        "ModelFactory",
        "GadgetDataset",
        "GadgetSampler",
    }


@pytest.mark.parametrize("dt", _DOCTESTS, ids=[t.name for t in _DOCTESTS])
def test_docstring_example_runs(dt):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = []
    with _Quiet():
        runner.run(dt, out=out.append)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, "".join(out)


# --------------------------------------------------------------------------------------
# fresh-process behaviour: imports, fallback warnings
# --------------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    r"""
    import json, os, sys, warnings
    import numpy as np
    import torch
    import gadgetloader as gl
    res = {"mods": sorted(m for m in ("cupy", "h5py", "zarr") if m in sys.modules)}
    emb = lambda: torch.nn.Embedding(2, 3)
    cases = {
        "dg_cpupinn_true": lambda: gl.DataGadget(np.ones((4, 3), np.float32), CPUPinn=True),
        "dg_default_cuda": lambda: gl.DataGadget(np.ones((4, 3), np.float32)),
        "dg_placement_pinned": lambda: gl.DataGadget((4, 3), placement="pinned"),
        "dg_placement_cpu": lambda: gl.DataGadget((4, 3), placement="cpu"),
        "mf_cpupinn": lambda: gl.ModelFactory(emb(), 5, 3, CPUPinn=True),
        "mf_default": lambda: gl.ModelFactory(emb(), 5, 3),
        "pmf_cuda": lambda: gl.PytorchModelFactory(emb(), 5, 3),
        "pmf_cpu": lambda: gl.PytorchModelFactory(emb(), 5, 3, deviceType="cpu"),
        "pmf_cpu_pin": lambda: gl.PytorchModelFactory(emb(), 5, 3, deviceType="cpu",
                                                      pinType=True),
        "dg_device_cuda": lambda: gl.DataGadget((4, 3), placement="cpu", device="cuda"),
        "ds_default": lambda: gl.GadgetDataset(np.ones((4, 3), np.float32)),
    }
    for name, fn in cases.items():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                obj = fn(); obj2 = fn()
            pl = getattr(obj, "placement", None)
            if pl is None:
                pl = obj.columns[0].placement
            msg = json.dumps({"cats": [c.category.__name__ for c in rec],
                              "msgs": [str(c.message) for c in rec], "placement": pl})
            os.write(w, msg.encode()); os._exit(0)
        os.close(w)
        data = b""
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
        os.waitpid(pid, 0)
        res[name] = json.loads(data.decode())
    print(json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_import_needs_no_optional_deps(child_results):
    assert child_results["mods"] == []


@pytest.mark.parametrize(
    "case",
    [
        "dg_cpupinn_true",
        "dg_default_cuda",
        "dg_placement_pinned",
        "mf_cpupinn",
        "mf_default",
        "pmf_cuda",
        "pmf_cpu_pin",
        "dg_device_cuda",
    ],
)
def test_gpu_placement_by_name_falls_back_with_one_warning(child_results, case):
    r = child_results[case]
    assert r["placement"] == "cpu"
    # two constructions in a fresh process: exactly one FallbackWarning, nothing else
    assert r["cats"] == ["FallbackWarning"], r


@pytest.mark.parametrize("case", ["dg_placement_cpu", "pmf_cpu", "ds_default"])
def test_cpu_placements_are_silent(child_results, case):
    r = child_results[case]
    assert r["placement"] == "cpu"
    assert r["cats"] == [], r


# --------------------------------------------------------------------------------------
# DataGadget: construction
# --------------------------------------------------------------------------------------

DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.bool_,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cpupinn", [False, True])
def test_datagadget_from_npy(tmp_path, dtype, cpupinn):
    a = _table(7, 3, seed=1)
    a = (a > 0) if dtype is np.bool_ else a.astype(dtype)
    p = tmp_path / "t.npy"
    np.save(p, a)
    with _Quiet():
        g = gl.DataGadget(str(p), CPUPinn=cpupinn)
    assert g.placement == "cpu"
    assert g.shape == (7, 3) and len(g) == 7
    assert g.nbytes == a.nbytes
    assert g.dtype == torch.from_numpy(a).dtype
    np.testing.assert_array_equal(g.getNumpyVersion(), a)
    ids = [6, 0, 0, 3]
    got = g.getData(ids)
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
    np.testing.assert_array_equal(_np(got), a[ids])


def test_datagadget_from_pathlike(tmp_path):
    a = _table()
    p = tmp_path / "t.npy"
    np.save(p, a)
    g = gl.DataGadget(p, placement="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


@pytest.mark.parametrize("flag", [1, 0, True, False])
def test_cpupinn_accepts_bool_and_01(flag):
    with _Quiet():
        g = gl.DataGadget(_table(), flag)
    assert g.placement == "cpu"


@pytest.mark.parametrize("flag", ["False", "True", 2, None])
def test_cpupinn_refuses_non_bool(flag):
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(_table(), CPUPinn=flag)


def test_datagadget_none_source():
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(None)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget()


def test_tuple_shape_new_table_defaults():
    g = gl.DataGadget((5, 3), placement="cpu")
    assert g.dtype == torch.float32 and g.shape == (5, 3)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((5, 3), np.float32))


def test_zeros_classmethod():
    with _Quiet():
        g = gl.DataGadget.zeros((4, 2), "int16")
    assert g.placement == "cpu" and g.dtype == torch.int16
    assert not g.getNumpyVersion().any()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float", torch.float32),
        ("int", torch.int32),
        ("byte", torch.uint8),
        ("char", torch.int8),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        ("float16", torch.float16),
        (np.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
        ("int64", torch.int64),
        (np.dtype("uint8"), torch.uint8),
    ],
)
def test_dtype_names(name, expected):
    g = gl.DataGadget((2, 2), dtype=name, placement="cpu")
    assert g.dtype == expected


def test_data_is_copied_in_and_detached():
    a = _table()
    g = _cpu_gadget(a)
    a[:] = 0
    assert g.getNumpyVersion().any()
    t = torch.ones(3, 2, requires_grad=True)
    g2 = gl.DataGadget(t, placement="cpu")
    with torch.no_grad():
        t.mul_(5)
    out = g2.getData([0, 1])
    assert not out.requires_grad
    np.testing.assert_array_equal(_np(out), np.ones((2, 2), np.float32))


def test_nested_list_source():
    g = gl.DataGadget([[1.0, 2.0], [3.0, 4.0]], placement="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), np.array([[1, 2], [3, 4]]))


def test_dtype_cast_widening_allowed_and_truncating_refused():
    a = np.array([[1.5, 2.25], [3.0, -4.0]], np.float64)
    g = gl.DataGadget(a, dtype="float32", placement="cpu")
    assert g.dtype == torch.float32
    np.testing.assert_array_equal(g.getNumpyVersion(), a.astype(np.float32))
    gi = gl.DataGadget(np.arange(6, dtype=np.int64).reshape(3, 2), dtype="float32", placement="cpu")
    np.testing.assert_array_equal(gi.getNumpyVersion(), np.arange(6).reshape(3, 2))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(a, dtype="int32", placement="cpu")


def test_dtype_cast_out_of_range_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.array([[300, 1]], np.int64), dtype="int8", placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.array([[1e300, 1.0]], np.float64), dtype="float32", placement="cpu")


def test_uint16_file_converts_in_memory_and_load_refuses(tmp_path):
    a = np.array([[1, 65535], [7, 8]], np.uint16)
    p = tmp_path / "u16.npy"
    np.save(p, a)
    g = gl.DataGadget(str(p), dtype="int32", placement="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), a.astype(np.int32))
    before = g.getNumpyVersion()
    with pytest.raises(gl.GadgetTypeError):
        g.load(str(p))
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


def test_gadgetInit_returns_gadget():
    g = _cpu_gadget(_table())
    assert g.gadgetInit() is g


# --------------------------------------------------------------------------------------
# DataGadget: getData
# --------------------------------------------------------------------------------------


def _id_kinds():
    base = [4, 0, 9, 4, 2]
    return {
        "list": base,
        "tuple_of_ints": tuple(base),
        "range": range(1, 8, 3),
        "np_int64": np.array(base, np.int64),
        "np_int32": np.array(base, np.int32),
        "np_uint8": np.array(base, np.uint8),
        "np_uint16": np.array(base, np.uint16),
        "np_uint64": np.array(base, np.uint64),
        "np_int8": np.array(base, np.int8),
        "torch_int64": torch.tensor(base),
        "torch_int32": torch.tensor(base, dtype=torch.int32),
        "torch_int16": torch.tensor(base, dtype=torch.int16),
        "torch_int8": torch.tensor(base, dtype=torch.int8),
        "torch_uint8": torch.tensor(base, dtype=torch.uint8),
        "torch_2d": torch.tensor([[1, 2, 3], [3, 2, 1]]),
        "np_3d": np.arange(8).reshape(2, 2, 2),
        "torch_noncontig": torch.arange(10).flip(0)[::2],
        "empty_list": [],
        "empty_tensor": torch.empty(0, dtype=torch.int64),
    }


_IDS = _id_kinds()


@pytest.mark.parametrize("kind", list(_IDS))
def test_getData_id_kinds_match_numpy(kind):
    a = _table(10, 4)
    g = _cpu_gadget(a)
    ids = _IDS[kind]
    ref_ids = np.asarray(
        list(ids)
        if isinstance(ids, (range, tuple))
        else (ids.numpy() if isinstance(ids, torch.Tensor) else ids),
        dtype=np.int64,
    )
    expected = a[ref_ids]
    got = g.getData(ids)
    assert isinstance(got, torch.Tensor)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert tuple(got.shape) == expected.shape
    np.testing.assert_array_equal(_np(got), expected)


def test_getData_int_and_zero_d():
    a = _table()
    g = _cpu_gadget(a)
    np.testing.assert_array_equal(_np(g.getData(3)), a[3])
    assert tuple(g.getData(3).shape) == (4,)
    assert tuple(g.getData(torch.tensor(3)).shape) == (4,)
    np.testing.assert_array_equal(_np(g.getData(np.int64(5))), a[5])


@pytest.mark.parametrize(
    "index, ref",
    [
        (slice(2, 5), np.s_[2:5]),
        (slice(-2, None), np.s_[-2:]),
        (slice(None, None, 3), np.s_[::3]),
        ((slice(0, 6), slice(0, 3)), np.s_[0:6, 0:3]),
        (([1, 2], 0), np.s_[[1, 2], 0]),
        ((np.array([3, 1]), slice(1, None)), np.s_[[3, 1], 1:]),
        ((torch.tensor([0, 9]), 2), np.s_[[0, 9], 2]),
    ],
)
def test_getData_slices_and_tuple_index(index, ref):
    a = _table()
    g = _cpu_gadget(a)
    np.testing.assert_array_equal(_np(g.getData(index)), a[ref])
    np.testing.assert_array_equal(_np(g[index]), a[ref])


def test_getitem_row_slices():
    a = _table()
    g = _cpu_gadget(a)
    np.testing.assert_array_equal(_np(g[2:5]), a[2:5])
    np.testing.assert_array_equal(_np(g[-2:]), a[-2:])
    np.testing.assert_array_equal(_np(g[[1, 2], 0]), a[[1, 2], 0])


def test_tuple_of_id_lists_refused():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetError):
        g.getData(([1, 2], [0, 1]))


def test_row_slice_negative_step_refused():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetError):
        g.getData(([1, 2], slice(None, None, -1)))


@pytest.mark.parametrize("row_shape", [(), (3,), (2, 3)])
def test_row_shapes(row_shape):
    a = _rng(3).standard_normal((6,) + row_shape).astype(np.float32)
    g = _cpu_gadget(a)
    ids = np.array([[5, 0], [2, 2]])
    got = g.getData(ids)
    assert tuple(got.shape) == (2, 2) + row_shape
    np.testing.assert_array_equal(_np(got), a[ids])


@pytest.mark.parametrize(
    "ids, exc, builtin",
    [
        ([-1], gl.GadgetIndexError, IndexError),
        ([10], gl.GadgetIndexError, IndexError),
        (torch.tensor([0, 10]), gl.GadgetIndexError, IndexError),
        (np.array([3, -2]), gl.GadgetIndexError, IndexError),
        (-1, gl.GadgetIndexError, IndexError),
        (torch.tensor([1.0]), gl.GadgetTypeError, TypeError),
        ([1.0, 2.0], gl.GadgetTypeError, TypeError),
        (np.array([1.5]), gl.GadgetTypeError, TypeError),
        (["a"], gl.GadgetTypeError, TypeError),
        ("3", gl.GadgetTypeError, TypeError),
        ([True, False], gl.GadgetTypeError, TypeError),
        (torch.tensor([True] * 10), gl.GadgetTypeError, TypeError),
    ],
)
def test_getData_bad_ids(ids, exc, builtin):
    g = _cpu_gadget(_table())
    with pytest.raises(exc) as ei:
        g.getData(ids)
    assert isinstance(ei.value, builtin)


def test_bool_tensor_message_points_to_nonzero():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetTypeError, match="nonzero"):
        g.getData(torch.zeros(10, dtype=torch.bool))


def test_index_error_says_expected_and_got():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetIndexError) as ei:
        g.getData([0, 12])
    msg = str(ei.value)
    assert "12" in msg and "10" in msg


@pytest.mark.parametrize("flag", [True, False, 1, 0])
def test_check_ids_flag_accepts_bool_and_01(flag):
    a = _table()
    g = _cpu_gadget(a)
    np.testing.assert_array_equal(_np(g.getData([1, 2], check_ids=flag)), a[[1, 2]])


def test_check_ids_string_refused():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1], check_ids="False")
    before = g.getNumpyVersion()
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.zeros(1, 4), [1], check_ids="False")
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


def test_cpu_table_checks_ids_even_with_check_ids_false():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetIndexError):
        g.getData([11], check_ids=False)


def test_getData_out():
    a = _table()
    g = _cpu_gadget(a)
    out = torch.empty(3, 4)
    res = g.getData([2, 2, 7], out=out)
    np.testing.assert_array_equal(_np(out), a[[2, 2, 7]])
    assert res.data_ptr() == out.data_ptr()


def test_getData_out_refused_with_tuple_index():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetError):
        g.getData((slice(0, 2), slice(0, 2)), out=torch.empty(2, 2))


def test_getData_returns_independent_rows():
    a = _table()
    g = _cpu_gadget(a)
    rows = g.getData([1, 2])
    rows.zero_()
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


def test_device_default_cpu():
    g = _cpu_gadget(_table())
    assert torch.device(g.device).type == "cpu"
    assert g.getData([0]).device.type == "cpu"


# --------------------------------------------------------------------------------------
# DataGadget: insertData
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("src", ["torch", "numpy"])
def test_insertData_last_occurrence_wins(src):
    a = _table()
    g = _cpu_gadget(a)
    ids = [3, 1, 3, 7, 1, 3]
    rows = _rng(5).standard_normal((6, 4)).astype(np.float32)
    data = torch.from_numpy(rows) if src == "torch" else rows
    g.insertData(data, ids)
    ref = a.copy()
    for i, r in zip(ids, rows, strict=True):
        ref[i] = r
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_insertData_2d_ids():
    a = _table()
    g = _cpu_gadget(a)
    ids = torch.tensor([[0, 5], [9, 5]])
    rows = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4)
    g.insertData(rows, ids)
    ref = a.copy()
    for i, r in zip(ids.reshape(-1).tolist(), rows.reshape(-1, 4).numpy(), strict=True):
        ref[i] = r
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


@pytest.mark.parametrize(
    "data, ids, exc",
    [
        (torch.ones(2, 4, dtype=torch.float64), [0, 1], gl.GadgetTypeError),
        (np.ones((2, 4), np.float64), [0, 1], gl.GadgetTypeError),
        (torch.ones(2, 4, dtype=torch.int32), [0, 1], gl.GadgetTypeError),
        (torch.ones(2, 3), [0, 1], gl.GadgetValueError),
        (torch.ones(3, 4), [0, 1], gl.GadgetValueError),
        (torch.ones(2, 4), [0, 10], gl.GadgetIndexError),
        (torch.ones(2, 4), [-1, 0], gl.GadgetIndexError),
        (torch.ones(2, 4), [0.0, 1.0], gl.GadgetTypeError),
    ],
)
def test_insertData_refused_before_writing(data, ids, exc):
    a = _table()
    g = _cpu_gadget(a)
    with pytest.raises(exc):
        g.insertData(data, ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


def test_insertData_dtype_message_says_expected_and_got():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.insertData(torch.ones(1, 4, dtype=torch.float64), [0])
    assert "float32" in str(ei.value) and "float64" in str(ei.value)


def test_insertData_tuple_index_writes_only_part():
    a = _table()
    g = _cpu_gadget(a)
    g.insertData(torch.full((2, 2), 7.0), ([1, 4], slice(1, 3)))
    ref = a.copy()
    ref[[1, 4], 1:3] = 7.0
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    g[2:4, 0] = torch.tensor([-1.0, -2.0])
    ref[2:4, 0] = [-1.0, -2.0]
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_insertData_slice_of_rows():
    a = _table()
    g = _cpu_gadget(a)
    g.insertData(torch.zeros(3, 4), slice(-3, None))
    ref = a.copy()
    ref[-3:] = 0
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_insertData_bool_and_int_tables():
    gb = gl.DataGadget(np.zeros((4, 2), bool), placement="cpu")
    gb.insertData(torch.tensor([[True, False]]), [2])
    np.testing.assert_array_equal(gb.getNumpyVersion()[2], [True, False])
    gi = gl.DataGadget(np.zeros((4,), np.int16), placement="cpu")
    gi.insertData(torch.tensor([5, -3], dtype=torch.int16), [0, 3])
    np.testing.assert_array_equal(gi.getNumpyVersion(), [5, 0, 0, -3])


# --------------------------------------------------------------------------------------
# DataGadget: numpy views, saving, loading, closing, initialisers
# --------------------------------------------------------------------------------------


def test_getNumpyVersion_copy_and_view():
    a = _table()
    g = _cpu_gadget(a)
    c = g.getNumpyVersion()
    assert isinstance(c, np.ndarray) and c.dtype == np.float32
    c[:] = 0
    np.testing.assert_array_equal(g.getNumpyVersion(), a)
    v = g.getNumpyVersion(copy=False)
    v[0, 0] = 123.0
    assert g.getData(0)[0].item() == 123.0


def test_getNumpyVersion_copy_flag_refuses_string():
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetTypeError):
        g.getNumpyVersion(copy="False")


def test_bfloat16_numpy_version_is_float32():
    t = torch.tensor([[1.5, -2.0], [3.0, 0.25]], dtype=torch.bfloat16)
    g = gl.DataGadget(t, placement="cpu")
    assert g.dtype == torch.bfloat16
    n = g.getNumpyVersion()
    assert n.dtype == np.float32
    np.testing.assert_array_equal(n, t.float().numpy())


def test_array_protocol():
    a = _table()
    g = _cpu_gadget(a)
    c = np.asarray(g)
    np.testing.assert_array_equal(c, a)
    c[0] = 0
    np.testing.assert_array_equal(g.getNumpyVersion(), a)
    v = np.asarray(g, copy=False)
    v[1, 1] = -5.0
    assert g.getData(1)[1].item() == -5.0


def test_as_tensor_is_view_on_cpu():
    a = _table()
    g = _cpu_gadget(a)
    t = g.as_tensor()
    assert t.device.type == "cpu" and tuple(t.shape) == a.shape
    t[2, 2] = 99.0
    assert g.getData(2)[2].item() == 99.0


@pytest.mark.parametrize(
    "name, written", [("emb", "emb.npy"), ("emb.npy", "emb.npy"), ("a.b", "a.b.npy")]
)
def test_saveCupy_appends_npy_like_numpy_save(tmp_path, name, written):
    a = _table()
    g = _cpu_gadget(a)
    g.saveCupy(str(tmp_path / name))
    assert sorted(os.listdir(tmp_path)) == [written]
    np.testing.assert_array_equal(np.load(tmp_path / written), a)


def test_loadCupy_replaces_table_and_keeps_placement(tmp_path):
    a, b = _table(seed=1), _table(12, 3, seed=2)
    np.save(tmp_path / "b.npy", b)
    g = _cpu_gadget(a)
    g.loadCupy(str(tmp_path / "b.npy"))
    assert g.placement == "cpu" and g.shape == (12, 3)
    np.testing.assert_array_equal(g.getNumpyVersion(), b)


def test_loadCupy_missing_file_leaves_table(tmp_path):
    a = _table()
    g = _cpu_gadget(a)
    with pytest.raises(gl.GadgetFileNotFoundError):
        g.loadCupy(str(tmp_path / "nope.npy"))
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


def test_loadCupy_truncated_file_leaves_table(tmp_path):
    a = _table()
    p = tmp_path / "t.npy"
    np.save(p, _table(50, 4, seed=9))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 40])
    g = _cpu_gadget(a)
    with pytest.raises(gl.GadgetFileError):
        g.loadCupy(str(p))
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


@pytest.mark.parametrize("bad", [None, b"x.npy", 3])
@pytest.mark.parametrize("method", ["saveCupy", "loadCupy", "save", "load"])
def test_path_kinds_refused(method, bad):
    g = _cpu_gadget(_table())
    with pytest.raises(gl.GadgetTypeError):
        getattr(g, method)(bad)


def test_saveCupy_overwrite_roundtrip(tmp_path):
    p = str(tmp_path / "x.npy")
    g = _cpu_gadget(_table(seed=1))
    g.saveCupy(p)
    g.insertData(torch.zeros(1, 4), [0])
    g.saveCupy(p)
    np.testing.assert_array_equal(np.load(p), g.getNumpyVersion())


def test_close_semantics():
    g = _cpu_gadget(_table())
    g.close()
    g.close()  # idempotent
    assert g.shape == (10, 4) and len(g) == 10 and g.dtype == torch.float32
    assert isinstance(repr(g), str)
    for call in (
        lambda: g.getData([0]),
        lambda: g.insertData(torch.zeros(1, 4), [0]),
        lambda: g.getNumpyVersion(),
        lambda: g.flush(),
        lambda: g.gadgetInit(),
        lambda: g[0],
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()


def test_close_refuses_load(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _table())
    g = _cpu_gadget(_table())
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        g.load(str(p))
    with pytest.raises(gl.GadgetClosedError):
        g.loadCupy(str(p))


def test_with_block_closes():
    with _cpu_gadget(_table()) as g:
        assert g.getData([1]).shape == (1, 4)
    with pytest.raises(gl.GadgetClosedError):
        g.getData([1])


def test_initialisers():
    g = gl.DataGadget((200, 50), placement="cpu")
    g.uniform_(-0.5, 0.25)
    u = g.getNumpyVersion()
    assert u.min() >= -0.5 and u.max() <= 0.25 and u.min() < -0.45 and u.max() > 0.2
    g.normal_(2.0, 0.5)
    n = g.getNumpyVersion()
    assert abs(n.mean() - 2.0) < 0.03 and abs(n.std() - 0.5) < 0.03
    g.fill_(1.5)
    assert (g.getNumpyVersion() == 1.5).all()
    g.zero_()
    assert not g.getNumpyVersion().any()
    g.init_(torch.nn.init.constant_, 3.0)
    assert (g.getNumpyVersion() == 3.0).all()


@pytest.mark.parametrize(
    "dtype, value",
    [
        ("int8", 128),
        ("int8", -129),
        ("uint8", -1),
        ("bool", 2),
        ("int32", 1.5),
        ("float16", 1e6),
        ("float32", 1e300),
    ],
)
def test_fill_out_of_range_refused_and_unchanged(dtype, value):
    g = gl.DataGadget((3, 2), dtype=dtype, placement="cpu")
    before = g.getNumpyVersion()
    with pytest.raises(gl.GadgetError):
        g.fill_(value)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


@pytest.mark.parametrize("args", [(1.0, 0.0), (float("nan"), 1.0), (0.0, float("inf"))])
def test_uniform_bad_range_refused(args):
    g = gl.DataGadget((3, 2), placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        g.uniform_(*args)
    assert not g.getNumpyVersion().any()


def test_normal_negative_std_refused():
    g = gl.DataGadget((3, 2), placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        g.normal_(0.0, -1.0)
    assert not g.getNumpyVersion().any()


# --------------------------------------------------------------------------------------
# gather_many / scatter_many (gadgetloader's own)
# --------------------------------------------------------------------------------------


def test_gather_scatter_many():
    a, b = _table(seed=1), _table(seed=2).astype(np.float64)
    ga, gb = _cpu_gadget(a), _cpu_gadget(b)
    ids = torch.tensor([4, 2, 4])
    ra, rb = gl.gather_many([ga, gb], ids)
    np.testing.assert_array_equal(_np(ra), a[[4, 2, 4]])
    np.testing.assert_array_equal(_np(rb), b[[4, 2, 4]])
    gl.scatter_many([ga, gb], [ra * 0 + torch.tensor([1.0, 2.0, 3.0])[:, None], rb * 0 + 5], ids)
    ref = a.copy()
    ref[4], ref[2] = 3.0, 2.0
    np.testing.assert_array_equal(ga.getNumpyVersion(), ref)
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many([ga, gb], [ra, rb], torch.tensor([1, 2, 10]))
    np.testing.assert_array_equal(ga.getNumpyVersion(), ref)


# --------------------------------------------------------------------------------------
# ModelFactory / PytorchModelFactory
# --------------------------------------------------------------------------------------


def _mf(total=20, dim=4, rows=3, cls=None, **kw):
    emb = nn.Embedding(rows, dim)
    cls = cls or gl.ModelFactory
    with _Quiet():
        sw = cls(emb, total, dim, **kw)
    return emb, sw


@pytest.mark.parametrize("cpupinn", [False, True])
def test_modelfactory_falls_back_to_cpu(cpupinn):
    _, sw = _mf(CPUPinn=cpupinn)
    assert sw.placement == "cpu"
    assert torch.device(sw.device).type == "cpu"


def test_modelfactory_zeros_uniform_normal_custom():
    _, sw = _mf(total=400, dim=25)
    sw.zerosInit()
    z = sw.getNumpyVersion()
    assert isinstance(z, np.ndarray) and z.shape == (400, 25) and z.dtype == np.float32
    assert not z.any()
    sw.uniformDistributionInit(-0.3, 0.1)
    u = sw.getNumpyVersion()
    assert u.min() >= -0.3 and u.max() <= 0.1 and u.min() < -0.28 and u.max() > 0.08
    sw.normalDistributionInit(-1.0, 0.25)
    n = sw.getNumpyVersion()
    assert abs(n.mean() + 1.0) < 0.02 and abs(n.std() - 0.25) < 0.02
    sw.customInit(torch.nn.init.constant_, 0.75)
    assert (sw.getNumpyVersion() == 0.75).all()
    sw.customInit(torch.nn.init.xavier_uniform_)
    x = sw.getNumpyVersion()
    bound = np.sqrt(6.0 / (400 + 25))
    assert np.abs(x).max() <= bound and np.abs(x).max() > 0.9 * bound


@pytest.mark.parametrize("neg", [None, 4])
@pytest.mark.parametrize("cls", [gl.ModelFactory, gl.PytorchModelFactory])
def test_variableTransformer_matches_speedtorch(cls, neg):
    _, sw = _mf(cls=cls)
    out = sw.variableTransformer(3, 2, neg)
    if neg is None:
        assert isinstance(out, np.ndarray) and out.dtype == np.int64
        np.testing.assert_array_equal(out, np.arange(6).reshape(3, 2))
    else:
        pos, ng = out
        assert pos.dtype == np.int64 and ng.dtype == np.int64
        np.testing.assert_array_equal(pos, np.arange(6).reshape(3, 2))
        np.testing.assert_array_equal(ng, np.arange(6, 18).reshape(3, 4))
    assert sw.duplicates == "separate"


def test_beforeForwardPass_local_ids_and_rows():
    emb, sw = _mf(total=20, dim=4, rows=2)
    sw.normalDistributionInit(0.0, 1.0)
    table = sw.getNumpyVersion()
    ids = torch.tensor([[7, 3, 7], [19, 0, 3]])
    local = sw.beforeForwardPass(ids)
    assert isinstance(local, torch.Tensor) and local.shape == ids.shape
    assert local.dtype == torch.int64 and local.device.type == "cpu"
    np.testing.assert_array_equal(_np(emb.weight[local]), table[ids.numpy()])
    # merged: a repeated id is one local row
    assert local[0, 0] == local[0, 2] and local[0, 1] == local[1, 2]
    assert len(set(local.reshape(-1).tolist())) == 4


@pytest.mark.parametrize("idkind", ["torch", "numpy", "list"])
def test_beforeForwardPass_with_negatives(idkind):
    emb, sw = _mf(total=30, dim=3, rows=2)
    sw.uniformDistributionInit(-1, 1)
    table = sw.getNumpyVersion()
    pos = np.array([[1, 2], [2, 29]])
    neg = np.array([[5, 1, 1], [0, 29, 6]])
    conv = {"torch": torch.from_numpy, "numpy": lambda x: x, "list": lambda x: x.tolist()}[idkind]
    lp, ln = sw.beforeForwardPass(conv(pos), conv(neg))
    assert lp.shape == (2, 2) and ln.shape == (2, 3)
    np.testing.assert_array_equal(_np(emb.weight[lp]), table[pos])
    np.testing.assert_array_equal(_np(emb.weight[ln]), table[neg])


def test_afterOptimizerStep_writes_back_only_batch_rows():
    emb, sw = _mf(total=12, dim=3, rows=2)
    sw.uniformDistributionInit(-1, 1)
    table = sw.getNumpyVersion()
    ids = torch.tensor([4, 9, 4])
    local = sw.beforeForwardPass(ids)
    with torch.no_grad():
        emb.weight[local] += 10.0
    sw.afterOptimizerStep(ids)
    ref = table.copy()
    ref[[4, 9]] += 10.0
    np.testing.assert_allclose(sw.getNumpyVersion(), ref, rtol=0, atol=1e-6)


def test_modelfactory_datatype_float16_makes_variable_float16():
    emb, sw = _mf(total=10, dim=3, rows=2, datatype="float16")
    sw.uniformDistributionInit(-1, 1)
    assert sw.getNumpyVersion().dtype == np.float16
    local = sw.beforeForwardPass(torch.tensor([1, 5]))
    assert emb.weight.dtype == torch.float16
    np.testing.assert_array_equal(_np(emb.weight[local]), sw.getNumpyVersion()[[1, 5]])


@pytest.mark.parametrize("cls", [gl.ModelFactory, gl.PytorchModelFactory])
def test_modelfactory_saveCupy_loadCupy(tmp_path, cls):
    _, sw = _mf(cls=cls)
    sw.uniformDistributionInit(-1, 1)
    t = sw.getNumpyVersion()
    sw.saveCupy(str(tmp_path / "emb"))
    assert os.listdir(tmp_path) == ["emb.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), t)
    sw.zerosInit()
    sw.loadCupy(str(tmp_path / "emb.npy"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), t)


def test_modelfactory_loadCupy_wrong_shape_refused(tmp_path):
    _, sw = _mf(total=20, dim=4)
    sw.uniformDistributionInit(-1, 1)
    t = sw.getNumpyVersion()
    np.save(tmp_path / "bad.npy", np.zeros((21, 4), np.float32))
    with pytest.raises(gl.GadgetError):
        sw.loadCupy(str(tmp_path / "bad.npy"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), t)


@pytest.mark.parametrize(
    "device_type, pin",
    [
        ("cpu", False),
        ("cpu", True),
        ("cuda", False),
        ("cuda:0", False),
        (torch.device("cpu"), False),
        (torch.device("cuda"), False),
    ],
)
def test_pytorchmodelfactory_device_types_fall_back_to_cpu(device_type, pin):
    emb, sw = _mf(cls=gl.PytorchModelFactory, deviceType=device_type, pinType=pin)
    assert sw.placement == "cpu"
    sw.normalDistributionInit(0, 1)
    local = sw.beforeForwardPass(torch.tensor([2, 2, 5]))
    np.testing.assert_array_equal(_np(emb.weight[local]), sw.getNumpyVersion()[[2, 2, 5]])


@pytest.mark.parametrize("pin", ["False", 2])
def test_pytorchmodelfactory_pintype_refuses_non_bool(pin):
    with pytest.raises(gl.GadgetTypeError):
        gl.PytorchModelFactory(nn.Embedding(2, 3), 5, 3, deviceType="cpu", pinType=pin)


def test_modelfactory_cpupinn_refuses_string():
    with pytest.raises(gl.GadgetTypeError):
        gl.ModelFactory(nn.Embedding(2, 3), 5, 3, CPUPinn="True")


def test_pytorchmodelfactory_saveTorch_loadTorch(tmp_path):
    _, sw = _mf(cls=gl.PytorchModelFactory, total=8, dim=3, deviceType="cpu")
    sw.uniformDistributionInit(-1, 1)
    t = sw.getNumpyVersion()
    p = str(tmp_path / "emb.pt")
    sw.saveTorch(p)
    saved = torch.load(p, weights_only=True)
    assert isinstance(saved, torch.Tensor) and saved.device.type == "cpu"
    np.testing.assert_array_equal(saved.numpy(), t)
    sw.zerosInit()
    sw.loadTorch(p)
    np.testing.assert_array_equal(sw.getNumpyVersion(), t)


def test_pytorchmodelfactory_loadTorch_float64_exact_ok_inexact_refused(tmp_path):
    _, sw = _mf(cls=gl.PytorchModelFactory, total=8, dim=3, deviceType="cpu")
    sw.uniformDistributionInit(-1, 1)
    t = sw.getNumpyVersion()
    exact = torch.from_numpy(t.astype(np.float64) * 2)
    torch.save(exact, tmp_path / "exact.pt")
    sw.loadTorch(str(tmp_path / "exact.pt"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), t * 2)
    inexact = exact.clone()
    inexact[3, 1] = 0.1  # not a float32 value
    torch.save(inexact, tmp_path / "inexact.pt")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(str(tmp_path / "inexact.pt"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), t * 2)
    torch.save(torch.zeros(9, 3), tmp_path / "shape.pt")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(str(tmp_path / "shape.pt"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), t * 2)


def test_modelfactory_embed_dimension_mismatch_refused():
    with pytest.raises(gl.GadgetError):
        gl.ModelFactory(nn.Embedding(2, 3), 10, 4, placement="cpu")


# --------------------------------------------------------------------------------------
# Switchers: training equals a full-table parameter (every batch covers every row)
# --------------------------------------------------------------------------------------

OPT_CASES = {
    "SparseAdam": (torch.optim.SparseAdam, {"lr": 0.05}, True),
    "Adam": (torch.optim.Adam, {"lr": 0.05}, False),
    "Adam_amsgrad": (torch.optim.Adam, {"lr": 0.05, "amsgrad": True}, False),
    "AdamW": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}, False),
    "Adamax": (torch.optim.Adamax, {"lr": 0.05}, False),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}, False),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01}, False),
    "RMSprop_mom_centered": (
        torch.optim.RMSprop,
        {"lr": 0.01, "momentum": 0.9, "centered": True},
        False,
    ),
    "Rprop": (torch.optim.Rprop, {"lr": 0.05}, False),
    "ASGD": (torch.optim.ASGD, {"lr": 0.05}, False),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}, False),
    "SGD": (torch.optim.SGD, {"lr": 0.1}, False),
    "SGD_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, False),
    "SGD_nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, False),
    "NAdam": (torch.optim.NAdam, {"lr": 0.05}, False),
    "RAdam": (torch.optim.RAdam, {"lr": 0.05}, False),
}

TOTAL, DIM = 6, 3


class _W2V(nn.Module):
    def __init__(self, rows, dim, sparse):
        super().__init__()
        self.u_embeddings = nn.Embedding(rows, dim, sparse=sparse)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids, w):
        e = self.u_embeddings(ids)
        return (e * w).sum() + 0.5 * (e**2).sum() + self.head(e).pow(2).sum()


def _batches(steps=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        extra = torch.randint(0, TOTAL, (4,), generator=g)
        ids = torch.cat([torch.randperm(TOTAL, generator=g), extra]).reshape(2, 5)
        w = torch.randn(2, 5, DIM, generator=g)
        out.append((ids, w))
    return out


def _train_pair(case, model_cls=None, opt_cls=None, extra_model=None, extra_opt=None):
    optcls, kw, sparse = OPT_CASES[case]
    torch.manual_seed(0)
    init = torch.randn(TOTAL, DIM)
    ref = _W2V(TOTAL, DIM, sparse)
    sw_model = _W2V(2, DIM, sparse)
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(init)
        sw_model.head.load_state_dict(ref.head.state_dict())
    if sparse:
        ref_opt = optcls([ref.u_embeddings.weight], **kw)
        ref_dense = torch.optim.SGD(ref.head.parameters(), lr=0.0)
        opt = optcls([sw_model.u_embeddings.weight], **kw)
        sw_dense = torch.optim.SGD(sw_model.head.parameters(), lr=0.0)
    else:
        ref_opt = optcls(ref.parameters(), **kw)
        ref_dense = None
        opt = optcls(sw_model.parameters(), **kw)
        sw_dense = None
    model_cls = model_cls or gl.ModelFactory
    opt_cls = opt_cls or gl.OptimizerFactory
    with _Quiet():
        msw = model_cls(sw_model.u_embeddings, TOTAL, DIM, **(extra_model or {"CPUPinn": True}))
        osw = opt_cls(opt, TOTAL, DIM, sw_model, "u_embeddings", **(extra_opt or {"CPUPinn": True}))
    msw.zerosInit()
    # put the initial table in through the documented protocol: load a .npy
    return ref, ref_opt, ref_dense, sw_model, opt, sw_dense, msw, osw, init


@pytest.mark.parametrize("case", list(OPT_CASES))
def test_switchers_train_like_full_table(tmp_path, case):
    ref, ref_opt, ref_dense, sw_model, opt, sw_dense, msw, osw, init = _train_pair(case)
    np.save(tmp_path / "init.npy", init.numpy())
    msw.loadCupy(str(tmp_path / "init.npy"))
    osw.optInit()  # before any step: Rprop included (no warm-up step)
    for ids, w in _batches():
        # reference
        ref_opt.zero_grad()
        if ref_dense:
            ref_dense.zero_grad()
        ref(ids, w).backward()
        ref_opt.step()
        # switchers, SpeedTorch protocol
        local = msw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        opt.zero_grad()
        if sw_dense:
            sw_dense.zero_grad()
        sw_model(local, w).backward()
        opt.step()
        msw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
    torch.testing.assert_close(
        torch.from_numpy(msw.getNumpyVersion()),
        ref.u_embeddings.weight.detach(),
        rtol=1e-5,
        atol=1e-6,
    )
    states = osw.getNumpyVersion()
    assert isinstance(states, dict)
    assert bool(states) == (case != "SGD")  # plain SGD keeps no per-row state
    ref_state = ref_opt.state[ref.u_embeddings.weight]
    compared = 0
    for name, arr in states.items():
        assert arr.shape == (TOTAL, DIM), name
        if (
            name in ref_state
            and torch.is_tensor(ref_state[name])
            and ref_state[name].shape == (TOTAL, DIM)
        ):
            torch.testing.assert_close(torch.from_numpy(arr), ref_state[name], rtol=1e-5, atol=1e-6)
            compared += 1
    if case not in ("SGD",):
        assert compared >= 1, (case, list(states), list(ref_state))


def test_adam_state_names_and_fresh_values():
    *_, msw, osw, _init = _train_pair("Adam")
    osw.optInit()
    st = osw.getNumpyVersion()
    assert set(st) == {"exp_avg", "exp_avg_sq"}
    for a in st.values():
        assert a.shape == (TOTAL, DIM) and a.dtype == np.float32 and not a.any()
    assert set(osw.tables) == {"exp_avg", "exp_avg_sq"}


def test_adagrad_initial_accumulator_from_constructor():
    emb_model = _W2V(2, DIM, False)
    opt = torch.optim.Adagrad(emb_model.parameters(), lr=0.1, initial_accumulator_value=0.3)
    msw = gl.ModelFactory(emb_model.u_embeddings, TOTAL, DIM, placement="cpu")
    osw = gl.OptimizerFactory(opt, TOTAL, DIM, emb_model, "u_embeddings", placement="cpu")
    msw.zerosInit()
    osw.optInit()
    st = osw.getNumpyVersion()
    np.testing.assert_allclose(st["sum"], np.full((TOTAL, DIM), 0.3, np.float32))


def test_switchers_lazy_rows_outside_batch_untouched():
    *_, sw_model, opt, _sd, msw, osw, _init = _train_pair("AdamW")
    msw.uniformDistributionInit(-1, 1)
    osw.optInit()
    before = msw.getNumpyVersion()
    ids = torch.tensor([0, 2, 2, 4])
    w = torch.randn(4, DIM)
    for _ in range(2):
        local = msw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        opt.zero_grad()
        sw_model(local, w).backward()
        opt.step()
        msw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
    after = msw.getNumpyVersion()
    for r in (1, 3, 5):
        np.testing.assert_array_equal(after[r], before[r])
    for r in (0, 2, 4):
        assert not np.array_equal(after[r], before[r])
    st = osw.getNumpyVersion()
    for name in ("exp_avg", "exp_avg_sq"):
        assert not st[name][[1, 3, 5]].any()
        assert st[name][[0, 2, 4]].any()


def test_switchers_with_negatives_match_full_table():
    """``beforeForwardPass(pos, neg)`` pages both id sets (repeats across them merged)."""
    torch.manual_seed(3)
    init = torch.randn(TOTAL, DIM)
    ref = nn.Embedding(TOTAL, DIM)
    with torch.no_grad():
        ref.weight.copy_(init)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.v_embeddings = nn.Embedding(2, DIM)

    m = M()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    msw = gl.PytorchModelFactory(m.v_embeddings, TOTAL, DIM, deviceType="cpu")
    osw = gl.PytorchOptimizerFactory(opt, TOTAL, DIM, m, "v_embeddings", deviceType="cpu")
    msw.customInit(lambda t: t.copy_(init))
    osw.optInit()
    np.testing.assert_array_equal(msw.getNumpyVersion(), init.numpy())
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        pos = torch.cat([torch.randperm(TOTAL, generator=g)[:4], torch.tensor([0, 1])]).reshape(
            3, 2
        )
        neg = torch.cat([torch.randperm(TOTAL, generator=g), torch.tensor([5, 5, 0])]).reshape(3, 3)
        w1, w2 = torch.randn(3, 2, DIM, generator=g), torch.randn(3, 3, DIM, generator=g)
        ref_opt.zero_grad()
        ((ref(pos) * w1).sum() + (ref(neg) ** 2 * w2).sum()).backward()
        ref_opt.step()
        lp, ln = msw.beforeForwardPass(pos, neg)
        osw.beforeForwardPass(pos, neg)
        opt.zero_grad()
        ((m.v_embeddings(lp) * w1).sum() + (m.v_embeddings(ln) ** 2 * w2).sum()).backward()
        opt.step()
        msw.afterOptimizerStep(pos, neg)
        osw.afterOptimizerStep(pos, neg)
    torch.testing.assert_close(
        torch.from_numpy(msw.getNumpyVersion()), ref.weight.detach(), rtol=1e-5, atol=1e-6
    )


def test_variableTransformer_separate_last_copy_wins():
    """SpeedTorch's dummy-input layout: repeats updated separately, last write wins."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.u_embeddings = nn.Embedding(4, 2)

    m = M()
    msw = gl.ModelFactory(m.u_embeddings, 5, 2, placement="cpu")
    msw.customInit(lambda t: t.copy_(torch.arange(10, dtype=torch.float32).reshape(5, 2)))
    dummy = torch.from_numpy(msw.variableTransformer(2, 2))
    ids = torch.tensor([[3, 1], [3, 0]])
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    msw.beforeForwardPass(ids)
    np.testing.assert_array_equal(_np(m.u_embeddings(dummy)), np.arange(10).reshape(5, 2)[ids])
    w = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    opt.zero_grad()
    (m.u_embeddings(dummy) * w).sum().backward()
    opt.step()
    msw.afterOptimizerStep(ids)
    t = msw.getNumpyVersion()
    base = np.arange(10, dtype=np.float32).reshape(5, 2)
    np.testing.assert_array_equal(t[3], base[3] - [5.0, 6.0])  # last copy of id 3 wins
    np.testing.assert_array_equal(t[1], base[1] - [3.0, 4.0])
    np.testing.assert_array_equal(t[0], base[0] - [7.0, 8.0])
    np.testing.assert_array_equal(t[[2, 4]], base[[2, 4]])


@pytest.mark.parametrize("case", ["Adam", "Rprop", "SGD_momentum"])
def test_pytorch_factories_train_like_full_table(tmp_path, case):
    ref, ref_opt, _rd, sw_model, opt, _sd, msw, osw, init = _train_pair(
        case,
        gl.PytorchModelFactory,
        gl.PytorchOptimizerFactory,
        {"deviceType": "cpu"},
        {"deviceType": "cpu"},
    )
    torch.save(init.clone(), tmp_path / "init.pt")
    msw.loadTorch(str(tmp_path / "init.pt"))
    osw.optInit()
    for ids, w in _batches():
        ref_opt.zero_grad()
        ref(ids, w).backward()
        ref_opt.step()
        local = msw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        opt.zero_grad()
        sw_model(local, w).backward()
        opt.step()
        msw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
    torch.testing.assert_close(
        torch.from_numpy(msw.getNumpyVersion()),
        ref.u_embeddings.weight.detach(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_optimizerfactory_unsupported_optimizer_refused():
    m = _W2V(2, DIM, False)
    opt = torch.optim.LBFGS(m.parameters())
    gl.ModelFactory(m.u_embeddings, TOTAL, DIM, placement="cpu")
    with pytest.raises(gl.GadgetTypeError) as ei:
        osw = gl.OptimizerFactory(opt, TOTAL, DIM, m, "u_embeddings", placement="cpu")
        osw.optInit()
    assert "Adam" in str(ei.value) and "SGD" in str(ei.value)


def test_optimizerfactory_cpupinn_refuses_string():
    m = _W2V(2, DIM, False)
    opt = torch.optim.Adam(m.parameters())
    gl.ModelFactory(m.u_embeddings, TOTAL, DIM, placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.OptimizerFactory(opt, TOTAL, DIM, m, "u_embeddings", CPUPinn="False")


def test_optimizer_saveTorch_loadTorch_dict_and_list(tmp_path):
    *_, msw, osw, _init = _train_pair("Adam")
    osw.optInit()
    osw.customInit(torch.nn.init.uniform_, -1.0, 1.0)
    st = osw.getNumpyVersion()
    assert st["exp_avg"].any() and not np.array_equal(st["exp_avg"], st["exp_avg_sq"])
    p = str(tmp_path / "opt.pt")
    osw.saveTorch(p)
    saved = torch.load(p, weights_only=True)
    assert isinstance(saved, dict) and set(saved) == set(st)
    for k, v in saved.items():
        assert v.device.type == "cpu"
        np.testing.assert_array_equal(v.numpy(), st[k])
    osw.customInit(torch.nn.init.zeros_)
    osw.loadTorch(p)
    for k, v in osw.getNumpyVersion().items():
        np.testing.assert_array_equal(v, st[k])
    # SpeedTorch's list layout, in `tables` order
    lst = [torch.from_numpy(st[k]) * 2 for k in osw.tables]
    torch.save(lst, tmp_path / "list.pt")
    osw.loadTorch(str(tmp_path / "list.pt"))
    for k, v in osw.getNumpyVersion().items():
        np.testing.assert_array_equal(v, st[k] * 2)
    # wrong shape: refused, nothing written
    bad = {k: torch.zeros(TOTAL + 1, DIM) for k in st}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(gl.GadgetError):
        osw.loadTorch(str(tmp_path / "bad.pt"))
    for k, v in osw.getNumpyVersion().items():
        np.testing.assert_array_equal(v, st[k] * 2)


# --------------------------------------------------------------------------------------
# GadgetDataset + DataLoader + GadgetSampler
# --------------------------------------------------------------------------------------


def _xy(n=23, d=3):
    x = np.arange(n, dtype=np.float32)[:, None] * 10 + np.arange(d, dtype=np.float32)
    y = np.arange(n, dtype=np.int64) * 7
    return x, y


def _check_pairs(bx, by):
    # row i of x is i*10 + [0..d); label is i*7
    rows = (bx[:, 0] / 10).round().long()
    assert torch.equal(by, rows * 7)
    return rows


@pytest.mark.parametrize("shuffle", [False, True])
def test_dataloader_default_form(shuffle):
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    assert len(ds) == 23
    assert torch.device(ds.device).type == "cpu"
    seen = []
    sizes = []
    for bx, by in DataLoader(ds, batch_size=5, shuffle=shuffle):
        assert bx.device.type == "cpu" and bx.dtype == torch.float32
        assert by.dtype == torch.int64 and by.shape == (bx.shape[0],)
        sizes.append(len(bx))
        np.testing.assert_array_equal(_np(bx), x[_np(_check_pairs(bx, by))])
        seen += _check_pairs(bx, by).tolist()
    assert sizes == [5, 5, 5, 5, 3]
    if shuffle:
        assert sorted(seen) == list(range(23))
    else:
        assert seen == list(range(23))


def test_dataloader_from_path_and_gadget(tmp_path):
    x, y = _xy()
    np.save(tmp_path / "x.npy", x)
    gy = _cpu_gadget(y)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), gy)
    assert ds.columns[1] is gy
    out = [b for b in DataLoader(ds, batch_size=23)]
    assert len(out) == 1
    np.testing.assert_array_equal(_np(out[0][0]), x)
    np.testing.assert_array_equal(_np(out[0][1]), y)


def test_dataloader_drop_last():
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    batches = list(DataLoader(ds, batch_size=5, drop_last=True))
    assert [len(b[0]) for b in batches] == [5, 5, 5, 5]


@pytest.mark.parametrize("form", ["batch_sampler", "sampler_none"])
@pytest.mark.parametrize("order", ["random", "sequential"])
def test_gadget_sampler_forms(form, order):
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    sampler = gl.GadgetSampler(ds, batch_size=4, order=order, seed=3)
    assert len(sampler) == 6
    if form == "batch_sampler":
        loader = DataLoader(ds, batch_sampler=sampler)
    else:
        loader = DataLoader(ds, sampler=sampler, batch_size=None)
    seen = []
    for bx, by in loader:
        seen += _check_pairs(bx, by).tolist()
    if order == "sequential":
        assert seen == list(range(23))
    else:
        assert sorted(seen) == list(range(23)) and seen != list(range(23))


def test_gadget_sampler_as_sampler_without_batch_size_none_refused():
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    loader = DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4))
    with pytest.raises(gl.GadgetValueError):
        next(iter(loader))


def test_gadget_sampler_seed_reproducible_and_epochs_differ():
    s1 = gl.GadgetSampler(50, batch_size=8, seed=7)
    s2 = gl.GadgetSampler(50, batch_size=8, seed=7)
    e1 = [b.clone() for b in s1]
    assert all(b.dtype == torch.int64 for b in e1)
    assert torch.equal(torch.cat(e1), torch.cat([b.clone() for b in s2]))
    e2 = torch.cat([b.clone() for b in s1])  # next epoch, advanced by itself
    assert not torch.equal(torch.cat(e1), e2)
    assert sorted(e2.tolist()) == list(range(50))
    s1.set_epoch(0)
    assert torch.equal(torch.cat([b.clone() for b in s1]), torch.cat(e1))


@pytest.mark.parametrize("n, b, R", [(23, 4, 1), (23, 4, 2), (24, 4, 3), (10, 3, 4)])
def test_sampler_ranks_default_every_row_once(n, b, R):
    got = []
    lens = set()
    for r in range(R):
        s = gl.GadgetSampler(n, batch_size=b, order="random", seed=1, num_replicas=R, rank=r)
        bs = [x.tolist() for x in s]
        lens.add(len(bs))
        assert len(bs) == len(s)
        got += [i for x in bs for i in x]
    assert len(lens) == 1
    assert sorted(got) == list(range(n))


@pytest.mark.parametrize("n, b, R", [(23, 4, 1), (23, 4, 2), (10, 3, 2)])
def test_sampler_drop_last_and_pad(n, b, R):
    dl, pd = [], []
    for r in range(R):
        dl += [
            x.tolist()
            for x in gl.GadgetSampler(n, batch_size=b, drop_last=True, num_replicas=R, rank=r)
        ]
        pd += [
            x.tolist() for x in gl.GadgetSampler(n, batch_size=b, pad=True, num_replicas=R, rank=r)
        ]
    assert all(len(x) == b for x in dl) and len(dl) == R * (n // (R * b))
    flat = [i for x in dl for i in x]
    assert len(set(flat)) == len(flat)
    import math

    assert all(len(x) == b for x in pd) and len(pd) == R * math.ceil(n / (R * b))
    assert set(i for x in pd for i in x) == set(range(n))


def test_sampler_drop_last_and_pad_exclusive():
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(10, batch_size=3, drop_last=True, pad=True)


def test_sampler_file_path_refused(tmp_path):
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(str(tmp_path / "x.npy"), batch_size=2)


def test_sampler_unknown_order_is_key_error():
    with pytest.raises(gl.GadgetKeyError):
        gl.GadgetSampler(10, batch_size=3, order="shuffled")


def test_sampler_state_dict_resume():
    s = gl.GadgetSampler(40, batch_size=6, seed=11)
    it = iter(s)
    first = [next(it).clone() for _ in range(3)]
    st = s.state_dict()
    rest = [b.clone() for b in it]
    s2 = gl.GadgetSampler(40, batch_size=6, seed=0)
    s2.load_state_dict(st)
    rest2 = [b.clone() for b in s2]
    assert len(rest) == len(rest2) == 4
    for a, b in zip(rest, rest2, strict=True):
        assert torch.equal(a, b)
    assert len(first) == 3
    bad = gl.GadgetSampler(41, batch_size=6)
    with pytest.raises(gl.GadgetValueError):
        bad.load_state_dict(st)


def test_dataset_indexing_rules():
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    r = ds[-1]
    np.testing.assert_array_equal(_np(r[0]), x[-1])
    assert int(r[1]) == y[-1]
    bx, by = ds[-3:]
    np.testing.assert_array_equal(_np(bx), x[-3:])
    np.testing.assert_array_equal(_np(by), y[-3:])
    b = ds[[4, 4, 0]]
    assert isinstance(b, gl.GadgetBatch) and isinstance(b, tuple)
    np.testing.assert_array_equal(_np(b[0]), x[[4, 4, 0]])
    with pytest.raises(gl.GadgetIndexError):
        ds[[0, -1]]
    with pytest.raises(gl.GadgetIndexError):
        ds[torch.tensor([23])]
    with pytest.raises(gl.GadgetTypeError):
        ds[[0.5]]


def test_dataset_mismatched_rows_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(np.zeros((5, 2), np.float32), np.zeros(6, np.int64))


def test_dataset_custom_collate_gets_one_element_list():
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    got = []

    def collate(batch):
        got.append(len(batch))
        return batch[0]

    b = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate)))
    assert got == [1]
    np.testing.assert_array_equal(_np(b[0]), x[:4])


def test_gadget_batch_to_refuses_dtype():
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    b = ds[[1, 2]]
    moved = b.to("cpu")
    assert isinstance(moved, gl.GadgetBatch)
    np.testing.assert_array_equal(_np(moved[1]), y[[1, 2]])
    with pytest.raises(gl.GadgetTypeError):
        b.to(torch.float16)


def test_gadget_loader_matches_sampler_order():
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    loader = gl.GadgetLoader(ds, batch_size=4, seed=5)
    seen = []
    for bx, by in loader:
        seen += _check_pairs(bx, by).tolist()
    ref = gl.GadgetSampler(ds, batch_size=4, seed=5)
    assert seen == torch.cat([b.clone() for b in ref]).tolist()


# --------------------------------------------------------------------------------------
# More edges found while probing
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("src", ["bf16_cpu", "file"])
def test_array_protocol_copy_false_error_is_gadget_value_error(tmp_path, src):
    """README, Errors: "Every error the library raises derives from gl.GadgetError and the
    matching builtin"; __array__: "for any other table that request raises ValueError"."""
    if src == "file":
        np.save(tmp_path / "a.npy", _table())
        g = gl.DataGadget(str(tmp_path / "a.npy"), placement="file")
    else:
        g = gl.DataGadget((3, 2), dtype=torch.bfloat16, placement="cpu")
    with g, pytest.raises(ValueError) as ei:
        np.asarray(g, copy=False)
    assert isinstance(ei.value, gl.GadgetValueError)


def test_switchers_optimizer_switcher_first_within_step():
    """README: "The two switchers of a variable may be called in either order within a step."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Embedding(2, 3)

    m = M()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    msw = gl.ModelFactory(m.u, 8, 3, placement="cpu")
    osw = gl.OptimizerFactory(opt, 8, 3, m, "u", placement="cpu")
    msw.uniformDistributionInit(-1, 1)
    osw.optInit()
    before = msw.getNumpyVersion()
    ref = torch.tensor(before, requires_grad=True)
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    for ids in (torch.tensor([3, 5, 3]), torch.tensor([5, 0])):
        osw.beforeForwardPass(ids)
        local = msw.beforeForwardPass(ids)
        opt.zero_grad()
        (m.u(local) ** 3).sum().backward()
        opt.step()
        osw.afterOptimizerStep(ids)
        msw.afterOptimizerStep(ids)
        # lazy reference: only the batch's rows move, one step count per table
        ref_opt.zero_grad()
        (ref[ids] ** 3).sum().backward()
        keep = [r for r in range(8) if r not in ids.tolist()]
        saved = ref.detach()[keep].clone()
        saved_state = {
            k: v[keep].clone()
            for k, v in ref_opt.state[ref].items()
            if torch.is_tensor(v) and v.dim() == 2
        }
        ref_opt.step()
        with torch.no_grad():
            ref[keep] = saved
            for k, v in saved_state.items():
                ref_opt.state[ref][k][keep] = v
    torch.testing.assert_close(
        torch.from_numpy(msw.getNumpyVersion()), ref.detach(), rtol=1e-6, atol=1e-7
    )
    st = osw.getNumpyVersion()
    torch.testing.assert_close(torch.from_numpy(st["exp_avg"]), ref_opt.state[ref]["exp_avg"])
    np.testing.assert_array_equal(st["exp_avg"][[1, 2, 4, 6, 7]], 0)


def test_changes_refused_while_step_under_way(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Embedding(2, 3)

    m = M()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    msw = gl.ModelFactory(m.u, 8, 3, placement="cpu")
    osw = gl.OptimizerFactory(opt, 8, 3, m, "u", placement="cpu")
    msw.uniformDistributionInit(-1, 1)
    osw.optInit()
    np.save(tmp_path / "t.npy", np.zeros((8, 3), np.float32))
    msw.saveTorch(str(tmp_path / "t.pt"))
    before = msw.getNumpyVersion()
    ids = torch.tensor([1, 6])
    msw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    assert msw.step_under_way()
    for call in (
        msw.zerosInit,
        lambda: msw.uniformDistributionInit(0, 1),
        lambda: msw.normalDistributionInit(0, 1),
        lambda: msw.customInit(torch.nn.init.zeros_),
        lambda: msw.loadCupy(str(tmp_path / "t.npy")),
        lambda: msw.loadTorch(str(tmp_path / "t.pt")),
        lambda: osw.customInit(torch.nn.init.ones_),
    ):
        with pytest.raises(gl.GadgetValueError):
            call()
    np.testing.assert_array_equal(msw.getNumpyVersion(), before)
    assert not any(v.any() for v in osw.getNumpyVersion().values())


def test_afterOptimizerStep_refuses_to_overwrite_later_change():
    emb, sw = _mf(total=8, dim=3, rows=2)
    sw.uniformDistributionInit(-1, 1)
    with torch.no_grad():
        sw.beforeForwardPass(torch.tensor([1]))
    sw.zerosInit()  # evaluation lookups start no step: allowed
    with pytest.raises(gl.GadgetValueError):
        sw.afterOptimizerStep(torch.tensor([1]))
    assert not sw.getNumpyVersion().any()


@pytest.mark.parametrize("ids", [torch.tensor([1, 8]), torch.tensor([-1]), [0, 100]])
def test_beforeForwardPass_bad_ids_refused(ids):
    emb, sw = _mf(total=8, dim=3, rows=2)
    sw.uniformDistributionInit(-1, 1)
    w = emb.weight.detach().clone()
    with pytest.raises(gl.GadgetIndexError):
        sw.beforeForwardPass(ids)
    assert not sw.step_under_way()
    assert torch.equal(emb.weight.detach(), w)


def test_switchers_checkpoint_resume_bit_identical(tmp_path):
    def build():
        torch.manual_seed(0)
        m = _W2V(2, DIM, False)
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        msw = gl.ModelFactory(m.u_embeddings, TOTAL, DIM, placement="cpu")
        osw = gl.OptimizerFactory(opt, TOTAL, DIM, m, "u_embeddings", placement="cpu")
        msw.customInit(
            lambda t: t.copy_(
                torch.arange(TOTAL * DIM, dtype=torch.float32).reshape(TOTAL, DIM) / 10
            )
        )
        osw.optInit()
        return m, opt, msw, osw

    def step(m, opt, msw, osw, ids, w):
        local = msw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        opt.zero_grad()
        m(local, w).backward()
        opt.step()
        msw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)

    batches = _batches(4)
    a = build()
    for ids, w in batches:
        step(*a, ids, w)
    b = build()
    for ids, w in batches[:2]:
        step(*b, ids, w)
    gl.save_checkpoint(tmp_path / "ck", {"model": b[0], "u": b[2], "u_opt": b[3], "opt": b[1]})
    c = build()
    gl.load_checkpoint(tmp_path / "ck", {"model": c[0], "u": c[2], "u_opt": c[3], "opt": c[1]})
    for ids, w in batches[2:]:
        step(*c, ids, w)
    np.testing.assert_array_equal(c[2].getNumpyVersion(), a[2].getNumpyVersion())
    for k, v in a[3].getNumpyVersion().items():
        np.testing.assert_array_equal(c[3].getNumpyVersion()[k], v)


def test_float16_tables_for_float32_embedding_train_to_rounding():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Embedding(2, 3)

    m = M()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    msw = gl.ModelFactory(m.u, 6, 3, "float16", placement="cpu")
    osw = gl.OptimizerFactory(opt, 6, 3, m, "u", "float16", placement="cpu")
    msw.customInit(lambda t: t.copy_(torch.linspace(-1, 1, 18).reshape(6, 3)))
    osw.optInit()
    for st in osw.getNumpyVersion().values():
        assert st.dtype == np.float16
    ref = torch.linspace(-1, 1, 18).reshape(6, 3).half().float().requires_grad_(True)
    ref_opt = torch.optim.Adam([ref], lr=0.01)
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 2])
    for _ in range(3):
        local = msw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        assert m.u.weight.dtype == torch.float16
        opt.zero_grad()
        (m.u(local).float() ** 2).sum().backward()
        opt.step()
        msw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
        ref_opt.zero_grad()
        (ref[ids] ** 2).sum().backward()
        ref_opt.step()
    got = msw.getNumpyVersion()
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), ref.detach().numpy(), atol=3e-3)


def _write(fmt, path, arr):
    if fmt == "npy":
        np.save(path, arr)
    elif fmt == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "w") as f:
            f["x"] = arr
    else:
        zarr = pytest.importorskip("zarr")
        zarr.save_array(str(path), arr)


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
@pytest.mark.parametrize("placement", ["cpupinn", "file"])
def test_speedtorch_names_on_file_sources(tmp_path, fmt, placement):
    a = _table(12, 3, seed=4)
    src = tmp_path / f"t.{fmt}"
    _write(fmt, src, a)
    with _Quiet():
        g = (
            gl.DataGadget(str(src), CPUPinn=True)
            if placement == "cpupinn"
            else gl.DataGadget(str(src), placement="file")
        )
    with g:
        ids = np.array([[11, 0], [5, 5]])
        np.testing.assert_array_equal(_np(g.getData(ids)), a[ids])
        g.insertData(torch.full((2, 3), -1.0), [7, 2])
        ref = a.copy()
        ref[[7, 2]] = -1.0
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.zeros(1, 3), [12])
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)
        g.saveCupy(str(tmp_path / "out"))
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), ref)


@pytest.mark.parametrize("layout", ["big_endian", "fortran"])
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_npy_layouts_read_correctly(tmp_path, layout, placement):
    a = _table(6, 3, seed=6)
    arr = a.astype(">f4") if layout == "big_endian" else np.asfortranarray(a)
    np.save(tmp_path / "t.npy", arr)
    with gl.DataGadget(str(tmp_path / "t.npy"), placement=placement) as g:
        assert g.dtype == torch.float32
        np.testing.assert_array_equal(_np(g.getData([5, 0, 2])), a[[5, 0, 2]])
        np.testing.assert_array_equal(g.getNumpyVersion(), a)


def test_getData_out_overlapping_table_view():
    a = _table(4, 3)
    g = _cpu_gadget(a)
    g.getData([1, 0], out=g.as_tensor()[0:2])
    ref = a.copy()
    ref[0:2] = a[[1, 0]]
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    g2 = _cpu_gadget(a)
    with pytest.raises(gl.GadgetIndexError):
        g2.getData([1, 9], out=g2.as_tensor()[0:2])
    np.testing.assert_array_equal(g2.getNumpyVersion(), a)


def test_insertData_from_overlapping_table_view():
    a = _table(4, 3)
    g = _cpu_gadget(a)
    g.insertData(g.as_tensor()[0:3], [1, 2, 3])
    ref = a.copy()
    ref[1:4] = a[0:3]
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


@pytest.mark.parametrize("dt", [torch.uint16, torch.uint32, torch.uint64])
def test_getData_wide_unsigned_torch_ids(dt):
    a = _table()
    g = _cpu_gadget(a)
    np.testing.assert_array_equal(_np(g.getData(torch.tensor([9, 1], dtype=dt))), a[[9, 1]])
    with pytest.raises(gl.GadgetIndexError):
        g.getData(torch.tensor([10], dtype=dt))


def test_dataloader_workers_with_file_column(tmp_path):
    x, y = _xy()
    np.save(tmp_path / "x.npy", x)
    ds = gl.GadgetDataset(str(tmp_path / "x.npy"), y, placement="file")
    assert ds.columns[0].placement == "file"
    seen = []
    for bx, by in DataLoader(
        ds, batch_size=6, num_workers=1, shuffle=True, generator=torch.Generator().manual_seed(2)
    ):
        assert bx.device.type == "cpu" and by.device.type == "cpu"
        rows = _check_pairs(bx, by)
        np.testing.assert_array_equal(_np(bx), x[_np(rows)])
        seen += rows.tolist()
    assert sorted(seen) == list(range(23))
    ds.close()


def test_sampler_batch_changed_in_place_is_checked():
    x, y = _xy()
    ds = gl.GadgetDataset(x, y)
    b = next(iter(gl.GadgetSampler(ds, batch_size=4, order="sequential"))).clone()
    b[0] = 10**6
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(b)
    b2 = next(iter(gl.GadgetSampler(ds, batch_size=4, order="sequential")))
    b2[1] = -1  # in place on the sampler's own view
    with pytest.raises(gl.GadgetIndexError):
        ds[b2]
