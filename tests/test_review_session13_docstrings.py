"""Session 13 review: the public docstrings' promises, tested one by one.

Each test quotes (or paraphrases) the docstring it checks. References are NumPy /
plain torch on the CPU; results are moved to the CPU before comparing.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import stat
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl
import gadgetloader.io as gio
import gadgetloader.transfer as gtr
from gadgetloader._device import cupy_available

pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _doc_params(obj):
    """Names documented in a numpydoc ``Parameters`` section, with their spec text."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    out = {}
    try:
        start = lines.index("Parameters")
    except ValueError:
        return out
    i = start + 2
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1]):
            break  # next section
        if line and not line.startswith(" "):
            names, _, spec = line.partition(" : ")
            for name in names.split(","):
                name = name.strip().lstrip("*")
                if name:
                    out[name] = spec.strip()
        i += 1
    return out


def _sig_params(obj):
    sig = inspect.signature(obj)
    return {n: p for n, p in sig.parameters.items() if n != "self"}


def _table(placement, arr):
    return gl.DataGadget(arr, placement=placement, device="cpu")


# --------------------------------------------------------------------------------------
# docstring parameters against signatures
# --------------------------------------------------------------------------------------

ENTRY_POINTS = [
    "DataGadget",
    "GadgetDataset",
    "GadgetSampler",
    "GadgetLoader",
    "OffloadedEmbedding",
    "OffloadedOptimizer",
    "save_checkpoint",
    "load_checkpoint",
    "ModelSwitch",
    "OptimizerSwitch",
]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_documented_parameters_exist_in_signature(name):
    obj = getattr(gl, name)
    documented = _doc_params(obj)
    assert documented, f"{name} has no Parameters section"
    sig = _sig_params(obj)
    missing = sorted(set(documented) - set(sig))
    assert not missing, f"{name} documents {missing}, which its signature lacks"


@pytest.mark.parametrize(
    "name",
    [
        "DataGadget",
        "GadgetDataset",
        "GadgetSampler",
        "GadgetLoader",
        "OffloadedEmbedding",
        "OffloadedOptimizer",
        "load_checkpoint",
        "ModelSwitch",
        "OptimizerSwitch",
    ],
)
def test_named_signature_parameters_are_documented(name):
    obj = getattr(gl, name)
    documented = set(_doc_params(obj))
    sig = _sig_params(obj)
    named = {
        n
        for n, p in sig.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    assert named - documented == set()


# DEFECT: save_checkpoint(..., progress=None) has a ``progress`` keyword that its
# Parameters section does not document (directory, objects, format only).
def test_save_checkpoint_progress_parameter_is_documented():
    sig = _sig_params(gl.save_checkpoint)
    assert "progress" in sig
    assert "progress" in _doc_params(gl.save_checkpoint)


def _default_from_spec(spec):
    m = re.search(r"default\s+(.+)$", spec)
    return None if m is None else m.group(1).strip()


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_documented_defaults_match_signature(name):
    obj = getattr(gl, name)
    sig = _sig_params(obj)
    bad = []
    for pname, spec in _doc_params(obj).items():
        text = _default_from_spec(spec)
        if text is None or pname not in sig:
            continue
        actual = sig[pname].default
        try:
            expected = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            # e.g. "float32" for a torch dtype
            if str(actual).split(".")[-1] != text:
                bad.append((pname, text, actual))
            continue
        if actual != expected:
            bad.append((pname, text, actual))
    assert not bad, f"{name}: documented vs actual defaults {bad}"


def test_embedding_bag_takes_every_offloaded_embedding_parameter():
    # "Parameters otherwise as :class:`OffloadedEmbedding`."
    emb = _sig_params(gl.OffloadedEmbedding)
    bag = _sig_params(gl.OffloadedEmbeddingBag)
    assert set(emb) <= set(bag)
    for n in emb:
        assert bag[n].default == emb[n].default or n in ("num_embeddings", "embedding_dim")
    assert bag["mode"].default == "mean"  # as nn.EmbeddingBag
    assert bag["include_last_offset"].default is False


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("ModelFactory", {"CPUPinn": False, "placement": None, "duplicates": None}),
        ("OptimizerFactory", {"CPUPinn": False, "placement": None}),
        ("PytorchModelFactory", {"deviceType": "cuda", "pinType": False, "placement": None}),
        ("PytorchOptimizerFactory", {"deviceType": "cuda", "pinType": False}),
        ("gather_many", {"device": None, "check_ids": True}),
        ("scatter_many", {"check_ids": True}),
    ],
)
def test_factories_take_the_parameters_their_docstrings_name(name, params):
    sig = _sig_params(getattr(gl, name))
    for p, default in params.items():
        assert p in sig, (name, p)
        assert sig[p].default == default, (name, p, sig[p].default)


def test_speedtorch_factories_keep_speedtorch_positional_order():
    assert list(_sig_params(gl.ModelFactory))[:5] == [
        "model_variable",
        "total_classes",
        "embed_dimension",
        "datatype",
        "CPUPinn",
    ]
    assert list(_sig_params(gl.PytorchModelFactory))[:6] == [
        "model_variable",
        "total_classes",
        "embed_dimension",
        "datatype",
        "deviceType",
        "pinType",
    ]
    assert list(_sig_params(gl.OptimizerFactory))[:7] == [
        "given_optimizer",
        "total_classes",
        "embed_dimension",
        "model",
        "variable_name",
        "dtype",
        "CPUPinn",
    ]


def test_getdata_and_gather_share_documented_keywords():
    for meth in (gl.DataGadget.getData, gl.DataGadget.gather):
        sig = _sig_params(meth)
        assert sig["check_ids"].default is True
        assert sig["device"].default is None
        assert sig["out"].default is None


# --------------------------------------------------------------------------------------
# module constants and errors
# --------------------------------------------------------------------------------------


def test_constants_match_readme():
    assert set(gl.PLACEMENTS) == {"cpu", "cuda", "file", "pinned"}
    assert torch.float32 in gl.SUPPORTED_DTYPES and torch.bfloat16 in gl.SUPPORTED_DTYPES
    assert torch.uint16 not in gl.SUPPORTED_DTYPES if hasattr(torch, "uint16") else True
    for opt in gl.SUPPORTED_OPTIMIZERS:
        assert hasattr(torch.optim, opt)
    assert gl.cuda_available() == torch.cuda.is_available()


@pytest.mark.parametrize(
    ("err", "builtin"),
    [
        ("GadgetIndexError", IndexError),
        ("GadgetTypeError", TypeError),
        ("GadgetValueError", ValueError),
        ("GadgetKeyError", KeyError),
        ("GadgetFileNotFoundError", FileNotFoundError),
    ],
)
def test_error_classes_are_gadget_errors_and_builtins(err, builtin):
    cls = getattr(gl, err)
    assert issubclass(cls, gl.GadgetError)
    assert issubclass(cls, builtin)


def test_every_error_class_derives_from_gadget_error():
    for name in (
        "GadgetClosedError",
        "GadgetFileError",
        "MissingDependencyError",
        "ReadOnlyError",
    ):
        assert issubclass(getattr(gl, name), gl.GadgetError)
    assert issubclass(gl.FallbackWarning, Warning)


# --------------------------------------------------------------------------------------
# DataGadget
# --------------------------------------------------------------------------------------


def test_datagadget_docstring_example():
    g = gl.DataGadget((1000, 16), dtype="float32", placement="cpu")
    g.insertData(torch.ones(2, 16), [3, 7])
    assert g.getData([7, 3, 0]).sum(dim=1).cpu().tolist() == [16.0, 16.0, 0.0]


def test_datagadget_tuple_shape_defaults_to_float32_zeros():
    g = gl.DataGadget((4, 3), placement="cpu")
    assert g.dtype == torch.float32
    assert g.shape == (4, 3) and len(g) == 4 and g.row_shape == (3,)
    assert g.nbytes == 4 * 3 * 4
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((4, 3), np.float32))


def test_zeros_classmethod_defaults():
    # ``zeros(shape, dtype='float32', *, placement='cuda')``: float32, falls back to cpu.
    g = gl.DataGadget.zeros((3, 2))
    assert g.dtype == torch.float32
    assert g.placement in ("cuda", "cpu")
    if not torch.cuda.is_available():
        assert g.placement == "cpu"
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((3, 2), np.float32))


def test_getdata_shape_is_ids_shape_plus_row_shape(placement):
    ref = np.arange(60, dtype=np.float32).reshape(10, 2, 3)
    g = _table(placement, ref)
    ids = np.array([[1, 9], [0, 1], [5, 5]], dtype=np.int16)
    out = g.getData(ids).cpu()
    assert tuple(out.shape) == (3, 2, 2, 3)
    np.testing.assert_array_equal(out.numpy(), ref[ids])


def test_getdata_plain_int_has_no_leading_axis(placement):
    ref = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = _table(placement, ref)
    out = g.getData(2).cpu()
    assert tuple(out.shape) == (3,)
    np.testing.assert_array_equal(out.numpy(), ref[2])


@pytest.mark.parametrize(
    "ids",
    [
        [3, 0, 2],
        range(1, 4),
        np.array([3, 0, 2], dtype=np.uint8),
        torch.tensor([3, 0, 2], dtype=torch.int32),
    ],
    ids=["list", "range", "numpy-uint8", "torch-int32"],
)
def test_getdata_accepts_documented_id_kinds(ids):
    ref = np.arange(8, dtype=np.float32).reshape(4, 2)
    g = _table("cpu", ref)
    np.testing.assert_array_equal(g.getData(ids).cpu().numpy(), ref[np.asarray(list(ids))])


def test_getdata_device_keyword_delivers_to_cpu(placement):
    g = _table(placement, np.ones((3, 2), np.float32))
    assert g.getData([0], device="cpu").device.type == "cpu"


def test_device_defaults_to_cpu_without_cuda():
    g = gl.DataGadget((3, 2), placement="cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.device(g.device).type == expected


@pytest.mark.parametrize("bad", [[-1], [4], np.array([0, 7])])
def test_getdata_out_of_range_raises_gadget_index_error(placement, bad):
    g = _table(placement, np.arange(8, dtype=np.float32).reshape(4, 2))
    with pytest.raises(gl.GadgetIndexError):
        g.getData(bad)


def test_getdata_float_ids_raise_gadget_type_error(placement):
    g = _table(placement, np.ones((4, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError):
        g.getData(torch.tensor([0.0, 1.0]))
    with pytest.raises(gl.GadgetTypeError):
        g.getData(np.array([1.0]))


def test_insertdata_last_occurrence_wins(placement):
    ref = np.zeros((5, 2), np.float32)
    g = _table(placement, ref)
    ids = np.array([1, 3, 1, 1, 3])
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    g.insertData(torch.from_numpy(rows), ids)
    for i, r in zip(ids, rows, strict=True):  # NumPy's sequential assignment
        ref[i] = r
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_insertdata_multi_dim_ids(placement):
    ref = np.zeros((6, 2), np.float32)
    g = _table(placement, ref)
    ids = np.array([[0, 5], [2, 3]])
    rows = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    g.insertData(rows, ids)
    ref[ids] = rows
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


@pytest.mark.parametrize(
    ("data", "ids", "err"),
    [
        (np.ones((2, 2), np.float64), [0, 1], gl.GadgetTypeError),
        (np.ones((3, 2), np.float32), [0, 1], gl.GadgetValueError),
        (np.ones((2, 3), np.float32), [0, 1], gl.GadgetValueError),
        (np.ones((2, 2), np.float32), [0, 9], gl.GadgetIndexError),
        (np.ones((2, 2), np.float32), [0, -1], gl.GadgetIndexError),
        (np.ones((2, 2), np.float32), np.array([0.0, 1.0]), gl.GadgetTypeError),
    ],
)
def test_insertdata_refused_leaves_table_unchanged(placement, data, ids, err):
    ref = np.arange(8, dtype=np.float32).reshape(4, 2)
    g = _table(placement, ref)
    with pytest.raises(err):
        g.insertData(data, ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_setitem_getitem_follow_insert_and_get(placement):
    ref = np.arange(8, dtype=np.float32).reshape(4, 2)
    g = _table(placement, ref.copy())
    g[[2, 0]] = torch.tensor([[9.0, 9.0], [8.0, 8.0]])
    ref[[2, 0]] = [[9, 9], [8, 8]]
    np.testing.assert_array_equal(g[[0, 2, 3]].cpu().numpy(), ref[[0, 2, 3]])


def test_scatter_takes_torch_argument_order(placement):
    ref = np.zeros((4, 2), np.float32)
    g = _table(placement, ref.copy())
    g.scatter([3, 1], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    ref[[3, 1]] = [[1, 2], [3, 4]]
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    np.testing.assert_array_equal(g.gather([3, 1]).cpu().numpy(), ref[[3, 1]])


def test_gadgetinit_returns_self_and_refuses_when_closed():
    g = gl.DataGadget((2, 2), placement="cpu")
    assert g.gadgetInit() is g
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        g.gadgetInit()


def test_as_tensor_is_zero_copy_on_cpu():
    g = gl.DataGadget(np.zeros((3, 2), np.float32), placement="cpu")
    t = g.as_tensor()
    t[1] = 5.0
    np.testing.assert_array_equal(g.getData(1).cpu().numpy(), [5.0, 5.0])


def test_getnumpyversion_copy_semantics_on_cpu():
    g = gl.DataGadget(np.zeros((3, 2), np.float32), placement="cpu")
    a = g.getNumpyVersion()
    a[0] = 7
    assert g.getData(0).cpu().tolist() == [0.0, 0.0]  # a copy by default
    v = g.getNumpyVersion(copy=False)
    v[0] = 7
    assert g.getData(0).cpu().tolist() == [7.0, 7.0]  # a view with copy=False
    np.testing.assert_array_equal(g.numpy(), g.getNumpyVersion())


def test_getnumpyversion_bfloat16_comes_back_as_float32_exactly():
    src = torch.tensor([[1.5, -2.25], [3.0, 0.0078125]], dtype=torch.bfloat16)
    g = gl.DataGadget(src, placement="cpu")
    a = g.getNumpyVersion()
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, src.float().numpy())


def test_requires_grad_of_plain_table_is_false_and_embedding_true():
    assert gl.DataGadget((2, 2), placement="cpu").requires_grad is False
    emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")
    assert emb.weight.requires_grad is True
    assert emb.weight.requires_grad_(False) is emb.weight
    assert emb.weight.requires_grad is False


def test_source_is_copied_in_and_detached():
    src = torch.ones(3, 2, requires_grad=True)
    g = gl.DataGadget(src, placement="cpu")
    with torch.no_grad():
        src.mul_(5)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.ones((3, 2), np.float32))
    assert not g.getData([0]).requires_grad


def test_nested_list_source():
    g = gl.DataGadget([[1, 2], [3, 4]], dtype="float32", placement="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), np.array([[1, 2], [3, 4]], np.float32))


@pytest.mark.parametrize(
    ("src", "dtype", "expected"),
    [
        (np.array([[1.5, 2.5]], np.float64), "float32", torch.float32),
        (np.array([[1, 2]], np.int64), "float32", torch.float32),
        (np.array([[1, 2]], np.int64), "int32", torch.int32),
    ],
)
def test_dtype_converts_within_kind_or_widening(src, dtype, expected):
    g = gl.DataGadget(src, dtype=dtype, placement="cpu")
    assert g.dtype == expected
    np.testing.assert_array_equal(g.getNumpyVersion(), src.astype(g.getNumpyVersion().dtype))


def test_dtype_truncating_cast_is_gadget_type_error():
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.ones((2, 2), np.float64), dtype="int32", placement="cpu")


@pytest.mark.parametrize(
    ("src", "dtype"),
    [
        (np.array([[300]], np.int64), "uint8"),
        (np.array([[1e300]], np.float64), "float32"),
        (np.array([[-1]], np.int64), "uint8"),
    ],
)
def test_dtype_out_of_range_is_gadget_value_error(src, dtype):
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(src, dtype=dtype, placement="cpu")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float", torch.float32),
        ("int", torch.int32),
        ("byte", torch.uint8),
        ("char", torch.int8),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        (np.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_names_as_readme(name, expected):
    assert gl.DataGadget((2, 2), dtype=name, placement="cpu").dtype == expected


@pytest.mark.parametrize("flag", ["False", "True", 2, None])
def test_cpupinn_must_be_bool_or_0_1(flag):
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((2, 2), flag)


def test_cpupinn_accepts_0_and_1():
    g = gl.DataGadget((2, 2), 0, placement="cpu")
    assert g.placement == "cpu"
    g = gl.DataGadget((2, 2), 1, placement="cpu")  # placement overrides it
    assert g.placement == "cpu"


def test_cuda_placement_falls_back_to_cpu_with_one_warning():
    if torch.cuda.is_available():
        pytest.skip("the fallback needs a machine without CUDA")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = gl.DataGadget((2, 2), placement="cuda")
        gl.DataGadget((2, 2), placement="pinned")
    assert g.placement == "cpu"
    assert sum(issubclass(x.category, gl.FallbackWarning) for x in w) == 1


def test_unknown_placement_is_gadget_key_error():
    with pytest.raises(gl.GadgetKeyError):
        gl.DataGadget((2, 2), placement="gpu0")


# ---- initialisers ---------------------------------------------------------------------


def test_zero_and_fill_return_self_and_set_values(placement):
    g = _table(placement, np.ones((3, 2), np.float32))
    assert g.fill_(2.5) is g
    np.testing.assert_array_equal(g.getNumpyVersion(), np.full((3, 2), 2.5, np.float32))
    assert g.zero_() is g
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((3, 2), np.float32))


def test_fill_inf_and_nan_allowed_on_float():
    g = gl.DataGadget((2, 2), placement="cpu")
    g.fill_(float("inf"))
    assert np.isinf(g.getNumpyVersion()).all()
    g.fill_(float("nan"))
    assert np.isnan(g.getNumpyVersion()).all()


def test_fill_rounds_to_dtype_as_torch():
    g = gl.DataGadget((1, 1), dtype="float16", placement="cpu")
    g.fill_(0.1)
    assert g.getNumpyVersion()[0, 0] == np.float16(0.1)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        ("float32", 1e40),
        ("float16", 1e6),
        ("int8", 200),
        ("int8", -129),
        ("uint8", -1),
        ("bool", 2),
        ("int32", 1.5),
    ],
)
def test_fill_refused_leaves_table_unchanged(dtype, value):
    g = gl.DataGadget((2, 2), dtype=dtype, placement="cpu").fill_(1)
    before = g.getNumpyVersion()
    with pytest.raises(gl.GadgetError):
        g.fill_(value)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)


@pytest.mark.parametrize("value", [True, False, 0, 1])
def test_fill_bool_accepts_documented_values(value):
    g = gl.DataGadget((2, 2), dtype="bool", placement="cpu")
    g.fill_(value)
    assert (g.getNumpyVersion() == bool(value)).all()


def test_uniform_defaults_are_0_1_and_range_respected():
    g = gl.DataGadget((500, 4), placement="cpu")
    assert g.uniform_() is g
    a = g.getNumpyVersion()
    assert a.min() >= 0.0 and a.max() <= 1.0 and a.std() > 0.1
    g.uniform_(-3.0, -2.0)
    a = g.getNumpyVersion()
    assert a.min() >= -3.0 and a.max() <= -2.0


def test_normal_moments():
    g = gl.DataGadget((4000, 8), placement="cpu")
    g.normal_(2.0, 0.5, generator=torch.Generator().manual_seed(0))
    a = g.getNumpyVersion()
    assert abs(a.mean() - 2.0) < 0.02 and abs(a.std() - 0.5) < 0.02


def test_generator_makes_fills_reproducible():
    g1 = gl.DataGadget((50, 3), placement="cpu")
    g2 = gl.DataGadget((50, 3), placement="cpu")
    g1.uniform_(generator=torch.Generator().manual_seed(7))
    g2.uniform_(generator=torch.Generator().manual_seed(7))
    np.testing.assert_array_equal(g1.getNumpyVersion(), g2.getNumpyVersion())


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("uniform_", (1.0, 0.0)),
        ("uniform_", (float("-inf"), 0.0)),
        ("uniform_", (-3e38, 3e38)),  # high - low overflows float32
        ("normal_", (0.0, -1.0)),
        ("normal_", (float("nan"), 1.0)),
        ("normal_", (0.0, float("inf"))),
    ],
)
def test_random_fill_refused_leaves_table_unchanged(call, args):
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError):
        getattr(g, call)(*args)
    np.testing.assert_array_equal(g.getNumpyVersion(), np.ones((3, 2), np.float32))


@pytest.mark.parametrize("call", ["uniform_", "normal_"])
def test_random_fill_on_integer_table_refused(call):
    g = gl.DataGadget(np.ones((3, 2), np.int32), placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        getattr(g, call)()
    np.testing.assert_array_equal(g.getNumpyVersion(), np.ones((3, 2), np.int32))


def test_uniform_accepts_zero_d_tensors():
    g = gl.DataGadget((100, 2), placement="cpu")
    g.uniform_(torch.tensor(5.0), torch.tensor(6.0))
    a = g.getNumpyVersion()
    assert a.min() >= 5.0 and a.max() <= 6.0


def test_init_applies_torch_initialiser():
    g = gl.DataGadget((3, 4), placement="cpu")
    assert g.init_(torch.nn.init.constant_, 0.25) is g
    np.testing.assert_array_equal(g.getNumpyVersion(), np.full((3, 4), 0.25, np.float32))
    torch.manual_seed(3)
    g.init_(torch.nn.init.xavier_uniform_)
    torch.manual_seed(3)
    ref = torch.nn.init.xavier_uniform_(torch.empty(3, 4))
    np.testing.assert_array_equal(g.getNumpyVersion(), ref.numpy())


# ---- files ----------------------------------------------------------------------------


@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr"])
def test_save_load_roundtrip_by_extension(tmp_path, ext):
    ref = np.arange(24, dtype=np.float32).reshape(8, 3)
    g = gl.DataGadget(ref, placement="cpu")
    path = tmp_path / f"t{ext}"
    g.save(path)
    h = gl.DataGadget((8, 3), placement="cpu")
    h.load(path)
    np.testing.assert_array_equal(h.getNumpyVersion(), ref)
    np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), ref)


def test_save_format_keyword_overrides_extension(tmp_path):
    g = gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu")
    path = tmp_path / "t.bin"
    g.save(path, format="npy")
    np.testing.assert_array_equal(np.load(path), np.ones((2, 2), np.float32))


def test_savecupy_appends_npy(tmp_path):
    ref = np.arange(6, dtype=np.float32).reshape(3, 2)
    g = gl.DataGadget(ref, placement="cpu")
    g.saveCupy(str(tmp_path / "emb"))
    assert os.listdir(tmp_path) == ["emb.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), ref)
    g.saveCupy(str(tmp_path / "emb2.npy"))
    assert (tmp_path / "emb2.npy").exists() and not (tmp_path / "emb2.npy.npy").exists()


@pytest.mark.parametrize("ext", [".npy", ".h5"])
def test_save_to_directory_is_gadget_file_error(tmp_path, ext):
    target = tmp_path / f"d{ext}"
    target.mkdir()
    (target / "keep").write_text("x")
    g = gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetFileError):
        g.save(target)
    assert (target / "keep").read_text() == "x"


def test_save_zarr_over_regular_file_is_gadget_file_error(tmp_path):
    target = tmp_path / "d.zarr"
    target.write_text("keep")
    g = gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetFileError):
        g.save(target)
    assert target.read_text() == "keep"


@pytest.mark.parametrize(
    ("ext", "opts"),
    [
        (".h5", {"compression": "bogus"}),
        (".zarr", {"compression": "lzf"}),
        (".zarr", {"compression_level": 99}),
        (".zarr", {"compression": "gzip", "compression_level": 10}),
        (".h5", {"compression": "gzip", "compression_level": -1}),
    ],
)
def test_save_bad_options_raise_and_keep_previous_file(tmp_path, ext, opts):
    old = np.full((2, 2), 3.0, np.float32)
    path = tmp_path / f"t{ext}"
    gl.DataGadget(old, placement="cpu").save(path)
    g = gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu")
    with pytest.raises((gl.GadgetValueError, gl.GadgetKeyError)):
        g.save(path, **opts)
    np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"t{ext}"]


def test_save_replaces_whole_hdf5_file(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f["other"] = np.zeros(3)
    gl.DataGadget(np.ones((2, 2), np.float32), placement="cpu").save(path)
    with h5py.File(path, "r") as f:
        assert "other" not in f


def test_hdf5_dataset_name_roundtrip(tmp_path):
    pytest.importorskip("h5py")
    ref = np.arange(6, dtype=np.float32).reshape(3, 2)
    path = tmp_path / "t.h5"
    gl.DataGadget(ref, placement="cpu").save(path, dataset="grp/emb", chunk_rows=2)
    g = gl.DataGadget(path, dataset="grp/emb", placement="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_loadcupy_truncated_file_refused_table_unchanged(tmp_path):
    ref = np.arange(8, dtype=np.float32).reshape(4, 2)
    g = gl.DataGadget(ref, placement="cpu")
    path = tmp_path / "bad.npy"
    np.save(path, np.ones((100, 2), np.float32))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(gl.GadgetFileError):
        g.loadCupy(str(path))
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_loadcupy_missing_file_refused_table_unchanged(tmp_path):
    ref = np.arange(8, dtype=np.float32).reshape(4, 2)
    g = gl.DataGadget(ref, placement="cpu")
    with pytest.raises(gl.GadgetFileNotFoundError):
        g.loadCupy(str(tmp_path / "nope.npy"))
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_loadcupy_replaces_table_keeping_placement(tmp_path):
    g = gl.DataGadget((2, 2), placement="cpu")
    new = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.save(tmp_path / "n.npy", new)
    g.loadCupy(str(tmp_path / "n.npy"))
    assert g.placement == "cpu" and g.shape == (5, 3)
    np.testing.assert_array_equal(g.getNumpyVersion(), new)


def test_file_placement_flush_writes_through(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.zeros((4, 2), np.float32))
    g = gl.DataGadget(path, placement="file")
    g.insertData(np.full((1, 2), 6.0, np.float32), [2])
    g.flush()
    np.testing.assert_array_equal(np.load(path)[2], [6.0, 6.0])
    g.close()


def test_uint16_file_loaded_into_memory_converts(tmp_path):
    path = tmp_path / "u.npy"
    src = np.array([[1, 65535]], np.uint16)
    np.save(path, src)
    # "except a uint16/32/64 file ... loaded into memory: it converts as such an array would"
    g = gl.DataGadget(path, placement="cpu", dtype="int32")
    assert g.dtype == torch.int32
    np.testing.assert_array_equal(g.getNumpyVersion(), src.astype(np.int32))
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(path, placement="cpu", dtype="int16")  # 65535 does not fit


# ---- close ----------------------------------------------------------------------------


def test_close_then_row_calls_raise_but_facts_answer(tmp_path):
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    np.save(tmp_path / "x.npy", np.ones((3, 2), np.float32))
    g.close()
    g.close()  # idempotent
    assert g.shape == (3, 2) and g.dtype == torch.float32 and len(g) == 3
    assert "closed" in repr(g)
    for call in (
        lambda: g.getData([0]),
        lambda: g.insertData(np.ones((1, 2), np.float32), [0]),
        lambda: g.flush(),
        lambda: g.load(tmp_path / "x.npy"),
        lambda: g.fill_(1.0),
        lambda: g.as_tensor(),
        lambda: g.getNumpyVersion(),
        lambda: g.save(tmp_path / "y.npy"),
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert not (tmp_path / "y.npy").exists()


def test_with_block_closes():
    with gl.DataGadget((2, 2), placement="cpu") as g:
        g.fill_(1.0)
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])


# --------------------------------------------------------------------------------------
# gather_many / scatter_many
# --------------------------------------------------------------------------------------


def test_gather_many_matches_numpy(placement):
    refs = [
        np.arange(20, dtype=np.float32).reshape(5, 4),
        np.arange(10, dtype=np.float64).reshape(5, 2),
        np.arange(5, dtype=np.int32),
    ]
    tables = [_table(placement, r) for r in refs]
    ids = np.array([[4, 0], [0, 2]])
    outs = gl.gather_many(tables, ids)
    assert isinstance(outs, list) and len(outs) == 3
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(o.cpu().numpy(), r[ids])


def test_gather_many_device_cpu(placement):
    tables = [_table(placement, np.ones((3, 2), np.float32)) for _ in range(2)]
    assert all(o.device.type == "cpu" for o in gl.gather_many(tables, [0], device="cpu"))


def test_scatter_many_last_occurrence_wins(placement):
    refs = [np.zeros((5, 3), np.float32), np.zeros((5, 3), np.float32)]
    tables = [_table(placement, r.copy()) for r in refs]
    ids = np.array([2, 4, 2])
    rows = [np.arange(9, dtype=np.float32).reshape(3, 3), -np.ones((3, 3), np.float32)]
    rows[1][2] = 7
    gl.scatter_many(tables, [torch.from_numpy(r) for r in rows], ids)
    for t, ref, r in zip(tables, refs, rows, strict=True):
        for i, row in zip(ids, r, strict=True):
            ref[i] = row
        np.testing.assert_array_equal(t.getNumpyVersion(), ref)


@pytest.mark.parametrize("which", ["dtype", "shape", "ids"])
def test_scatter_many_checks_everything_before_writing(placement, which):
    refs = [np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)]
    tables = [_table(placement, r.copy()) for r in refs]
    good = np.ones((2, 2), np.float32)
    bad = {
        "dtype": np.ones((2, 2), np.float64),
        "shape": np.ones((3, 2), np.float32),
        "ids": good,
    }[which]
    ids = [0, 9] if which == "ids" else [0, 1]
    with pytest.raises(gl.GadgetError):
        gl.scatter_many(tables, [good, bad], ids)
    for t, r in zip(tables, refs, strict=True):
        np.testing.assert_array_equal(t.getNumpyVersion(), r)


def test_gather_many_out_of_range_is_index_error():
    tables = [gl.DataGadget((3, 2), placement="cpu") for _ in range(2)]
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many(tables, [3])


# --------------------------------------------------------------------------------------
# GadgetBatch
# --------------------------------------------------------------------------------------


def test_gadget_batch_is_a_tuple_and_to_moves_columns():
    a, b = torch.ones(2, 3), torch.arange(2)
    batch = gl.GadgetBatch((a, b))
    x, y = batch
    assert x is a and y is b
    moved = batch.to("cpu")
    assert isinstance(moved, gl.GadgetBatch)
    assert moved[0].data_ptr() == a.data_ptr()  # no copy for columns already there
    assert isinstance(batch.to("cpu", non_blocking=True), gl.GadgetBatch)


# --------------------------------------------------------------------------------------
# GadgetDataset
# --------------------------------------------------------------------------------------


def test_dataset_docstring_example():
    x, y = np.ones((10, 4), np.float32), np.arange(10)
    ds = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    shapes = [tuple(t.shape) for t in next(iter(DataLoader(ds, batch_size=4)))]
    assert shapes == [(4, 4), (4,)]


def test_dataset_indexing_rules():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    y = np.arange(5) * 10
    ds = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    assert len(ds) == 5
    row = ds[-1]
    assert isinstance(row, tuple) and not isinstance(row, gl.GadgetBatch)
    np.testing.assert_array_equal(row[0].cpu().numpy(), x[-1])
    assert int(row[1]) == 40
    tail = ds[-3:]
    assert isinstance(tail, gl.GadgetBatch)
    np.testing.assert_array_equal(tail[0].cpu().numpy(), x[-3:])
    np.testing.assert_array_equal(tail[1].cpu().numpy(), y[-3:])
    with pytest.raises(gl.GadgetIndexError):
        ds[[0, -1]]
    with pytest.raises(gl.GadgetIndexError):
        ds[np.array([5])]


def test_dataset_gather_shapes_and_errors():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = gl.GadgetDataset(x, np.arange(6), placement="cpu", device="cpu")
    ids = np.array([[0, 5], [3, 3]])
    b = ds.gather(ids)
    assert isinstance(b, gl.GadgetBatch)
    np.testing.assert_array_equal(b[0].cpu().numpy(), x[ids])
    np.testing.assert_array_equal(b[1].cpu().numpy(), ids)
    with pytest.raises(gl.GadgetIndexError):
        ds.gather([6])
    with pytest.raises(gl.GadgetTypeError):
        ds.gather(np.array([0.5]))


def test_dataset_properties():
    ds = gl.GadgetDataset(
        np.ones((5, 3), np.float32), np.arange(5, dtype=np.int64), placement="cpu", device="cpu"
    )
    assert ds.row_nbytes == 3 * 4 + 8
    assert ds.chunk_rows is None
    assert len(ds.columns) == 2 and all(isinstance(c, gl.DataGadget) for c in ds.columns)
    assert torch.device(ds.device).type == "cpu"


def test_dataset_mismatched_rows_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(np.ones((5, 2), np.float32), np.arange(4), placement="cpu")


def test_dataset_close_frees_only_created_tables():
    mine = gl.DataGadget(np.ones((4, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(mine, np.arange(4), placement="cpu", device="cpu")
    created = ds.columns[1]
    ds.close()
    ds.close()  # idempotent
    np.testing.assert_array_equal(mine.getNumpyVersion(), np.ones((4, 2), np.float32))
    with pytest.raises(gl.GadgetClosedError):
        created.getData([0])


def test_dataset_getitems_returns_one_element_list():
    ds = gl.GadgetDataset(np.arange(4.0, dtype=np.float32), placement="cpu", device="cpu")
    out = ds.__getitems__([2, 0])
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], gl.GadgetBatch)
    assert out[0][0].cpu().tolist() == [2.0, 0.0]


def test_dataset_file_path_column_with_placement_file(tmp_path):
    path = tmp_path / "c.npy"
    ref = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.save(path, ref)
    ds = gl.GadgetDataset(str(path), placement="file", device="cpu")
    assert ds.columns[0].placement == "file"
    assert isinstance(ds.chunk_rows, int) and ds.chunk_rows > 0
    np.testing.assert_array_equal(ds[[3, 1]][0].cpu().numpy(), ref[[3, 1]])
    ds.close()


# --------------------------------------------------------------------------------------
# GadgetSampler
# --------------------------------------------------------------------------------------


def test_sampler_docstring_examples():
    s = gl.GadgetSampler(10, batch_size=4, order="sequential")
    assert [b.tolist() for b in s] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    got = [
        [
            b.tolist()
            for b in gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r)
        ]
        for r in (0, 1)
    ]
    assert got == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]


def test_sampler_yields_int64_and_defaults():
    s = gl.GadgetSampler(7, batch_size=3)
    assert s.order == "random" and s.seed == 0 and s.drop_last is False and s.pad is False
    assert s.num_replicas == 1 and s.rank == 0 and s.epoch == 0
    batches = list(s)
    assert all(b.dtype == torch.int64 for b in batches)
    assert sorted(torch.cat(batches).tolist()) == list(range(7))


@pytest.mark.parametrize(("n", "R", "B"), [(10, 3, 2), (9, 2, 2), (17, 4, 3), (8, 4, 2), (5, 5, 1)])
def test_sampler_default_rank_rules(n, R, B):
    shares = []
    lens = set()
    for r in range(R):
        s = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, seed=3)
        batches = [b.tolist() for b in s]
        lens.add(len(batches))
        assert len(batches) == len(s) == -(-(n // R) // B)
        share = [i for b in batches for i in b]
        assert len(share) == n // R + (1 if r < n % R else 0)
        for b in batches[:-1]:
            assert len(b) == B
        assert 1 <= len(batches[-1]) <= B + 1
        shares += share
    assert len(lens) == 1
    assert sorted(shares) == list(range(n))


@pytest.mark.parametrize(("n", "R", "B"), [(10, 3, 2), (17, 2, 4)])
def test_sampler_drop_last_rule(n, R, B):
    seen = []
    for r in range(R):
        s = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, drop_last=True)
        bs = list(s)
        assert len(bs) == len(s) == n // (R * B)
        assert all(len(b) == B for b in bs)
        seen += [i for b in bs for i in b.tolist()]
    order = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=0, drop_last=True).epoch_order()
    assert sorted(seen) == sorted(order[: n - n % (R * B)].tolist())


@pytest.mark.parametrize(("n", "R", "B"), [(10, 3, 2), (7, 2, 4)])
def test_sampler_pad_rule(n, R, B):
    seen = []
    nb = -(-n // (R * B))
    for r in range(R):
        s = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, pad=True)
        bs = list(s)
        assert len(bs) == len(s) == nb
        assert all(len(b) == B for b in bs)
        seen += [i for b in bs for i in b.tolist()]
    assert len(seen) == R * B * nb
    order = (
        gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=0, pad=True).epoch_order().tolist()
    )
    missing = R * B * nb - n
    assert sorted(seen) == sorted(order + [order[i % n] for i in range(missing)])


def test_sampler_refuses_bad_settings():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(10, batch_size=0)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(10, batch_size=2, drop_last=True, pad=True)
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(10, batch_size=2, order="shuffled")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(2, batch_size=1, num_replicas=3, rank=0)  # needs n >= R


def test_sampler_order_depends_only_on_seed_and_epoch():
    a = gl.GadgetSampler(50, batch_size=8, seed=5)
    b = gl.GadgetSampler(50, batch_size=8, seed=5)
    assert torch.equal(a.epoch_order(0), b.epoch_order(0))
    assert torch.equal(a.epoch_order(3), b.epoch_order(3))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    c = gl.GadgetSampler(50, batch_size=8, seed=6)
    assert not torch.equal(a.epoch_order(0), c.epoch_order(0))
    assert a.epoch_order().dtype == torch.int64


def test_sampler_epoch_advances_after_full_pass_and_matches_epoch_order():
    s = gl.GadgetSampler(20, batch_size=6, seed=1)
    e0 = torch.cat(list(s))
    assert torch.equal(e0, s.epoch_order(0))
    assert s.epoch == 1
    e1 = torch.cat(list(s))
    assert torch.equal(e1, s.epoch_order(1))
    # calling set_epoch every epoch gives the same result
    t = gl.GadgetSampler(20, batch_size=6, seed=1)
    t.set_epoch(1)
    assert torch.equal(torch.cat(list(t)), e1)


def test_sampler_restart_before_end_repeats_current_epoch():
    s = gl.GadgetSampler(20, batch_size=5, seed=2)
    it = iter(s)
    next(it)
    assert s.epoch == 0
    full = torch.cat(list(s))
    assert torch.equal(full, s.epoch_order(0))


def test_sampler_state_dict_resume_mid_epoch():
    s = gl.GadgetSampler(23, batch_size=4, seed=9)
    ref = [b.clone() for b in gl.GadgetSampler(23, batch_size=4, seed=9)]
    it = iter(s)
    first = [next(it).clone() for _ in range(2)]
    state = s.state_dict()
    t = gl.GadgetSampler(23, batch_size=4, seed=0)
    t.load_state_dict(state)
    assert t.seed == 9
    rest = list(t)
    assert all(torch.equal(a, b) for a, b in zip(first + rest, ref, strict=True))
    assert len(first + rest) == len(ref)


def test_sampler_state_at_epoch_end_gives_empty_pass_then_next_epoch():
    s = gl.GadgetSampler(10, batch_size=4, seed=4)
    it = iter(s)
    for _ in range(len(s)):  # the last batch drawn, the pass not yet ended
        next(it)
    state = s.state_dict()
    t = gl.GadgetSampler(10, batch_size=4, seed=4)
    t.load_state_dict(state)
    assert list(t) == []
    assert torch.equal(torch.cat(list(t)), s.epoch_order(1))


@pytest.mark.parametrize(
    "other",
    [
        {"data_source": 11},
        {"batch_size": 3},
        {"order": "sequential"},
        {"drop_last": True},
        {"num_replicas": 2, "rank": 0},
    ],
)
def test_sampler_load_state_mismatch_refused_and_unchanged(other):
    kw = {"data_source": 10, "batch_size": 4, "seed": 1}
    src = gl.GadgetSampler(**{**kw, **other})
    it = iter(src)
    next(it)
    state = src.state_dict()
    s = gl.GadgetSampler(**kw)
    before = s.state_dict()
    with pytest.raises(gl.GadgetValueError):
        s.load_state_dict(state)
    assert s.state_dict() == before


def test_sampler_length_from_sized_source():
    g = gl.DataGadget((13, 2), placement="cpu")
    s = gl.GadgetSampler(g, batch_size=5)
    assert s.num_rows == 13 and len(s) == 3


def test_sampler_chunk_order_is_a_permutation_reading_chunks_in_windows():
    s = gl.GadgetSampler(64, batch_size=4, order="chunk", chunk_rows=8, window_chunks=2, seed=3)
    order = s.epoch_order().tolist()
    assert sorted(order) == list(range(64))
    # every window of 16 positions holds exactly two whole chunks
    for w in range(4):
        chunks = {i // 8 for i in order[w * 16 : (w + 1) * 16]}
        assert len(chunks) == 2


# --------------------------------------------------------------------------------------
# GadgetLoader
# --------------------------------------------------------------------------------------


def test_loader_docstring_example():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert [b[0].cpu().tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]
    assert len(loader) == 3


def test_loader_needs_batch_size_without_sampler():
    ds = gl.GadgetDataset(torch.arange(4.0), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds)


@pytest.mark.parametrize(
    "kw",
    [
        {"order": "random"},
        {"drop_last": False},
        {"pad": False},
        {"seed": 0},
        {"num_replicas": 1},
        {"rank": 0},
        {"chunk_rows": 2},
        {"window_chunks": 8},
        {"batch_size": 2},
    ],
)
def test_loader_refuses_sampler_options_with_sampler(kw):
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=2)
    with pytest.raises(gl.GadgetError):
        gl.GadgetLoader(ds, sampler=s, **kw)


def test_loader_builds_sampler_with_documented_defaults():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=3)
    s = loader.sampler
    assert (s.order, s.drop_last, s.pad, s.seed) == ("random", False, False, 0)
    ref = gl.GadgetSampler(10, batch_size=3).epoch_order(0)
    got = torch.cat([b[0].cpu() for b in loader])
    assert torch.equal(got, ref.float())


def test_loader_wraps_array_as_one_column_dataset():
    arr = np.arange(12, dtype=np.float32).reshape(6, 2)
    loader = gl.GadgetLoader(
        gl.DataGadget(arr, placement="cpu", device="cpu"), batch_size=4, order="sequential"
    )
    batches = [b[0].cpu().numpy() for b in loader]
    np.testing.assert_array_equal(np.concatenate(batches), arr)
    assert isinstance(loader.dataset, gl.GadgetDataset)


def test_loader_state_dict_resume():
    ds = gl.GadgetDataset(torch.arange(20.0), placement="cpu", device="cpu")
    ref = [b[0].cpu().clone() for b in gl.GadgetLoader(ds, batch_size=3, seed=4)]
    loader = gl.GadgetLoader(ds, batch_size=3, seed=4)
    it = iter(loader)
    got = [next(it)[0].cpu().clone() for _ in range(3)]
    state = loader.state_dict()
    other = gl.GadgetLoader(ds, batch_size=3, seed=4)
    other.load_state_dict(state)
    got += [b[0].cpu().clone() for b in other]
    assert len(got) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_loader_set_epoch_refused_changes_nothing():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=3)
    loader.set_epoch(2)
    before = loader.state_dict()
    with pytest.raises(gl.GadgetError):
        loader.set_epoch(-1)
    with pytest.raises(gl.GadgetError):
        loader.set_epoch("3")
    assert loader.state_dict() == before
    got = torch.cat([b[0].cpu() for b in loader])
    assert torch.equal(got, loader.sampler.epoch_order(2).float())


def test_loader_dataloader_property_is_torch_dataloader():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=3)
    assert isinstance(loader.dataloader, DataLoader)


# --------------------------------------------------------------------------------------
# switchers
# --------------------------------------------------------------------------------------


def test_model_factory_docstring_example():
    emb = torch.nn.Embedding(3, 4)
    sw = gl.ModelFactory(emb, total_classes=100, embed_dimension=4, placement="cpu")
    sw.uniformDistributionInit(-0.1, 0.1)
    local = sw.beforeForwardPass(torch.tensor([5, 9, 5]))
    assert (local.cpu().tolist(), tuple(emb.weight.shape)) == ([0, 1, 0], (3, 4))
    table = sw.getNumpyVersion()
    np.testing.assert_array_equal(emb.weight.detach().cpu().numpy()[:2], table[[5, 9]])
    assert table.min() >= -0.1 and table.max() <= 0.1


def test_variable_transformer_int64_numpy_and_selects_separate():
    sw = gl.ModelSwitch(torch.nn.Embedding(3, 2), 10, 2, placement="cpu")
    assert sw.duplicates == "merge"
    pos, neg = sw.variableTransformer(2, 3, 4)
    assert isinstance(pos, np.ndarray) and pos.dtype == np.int64
    np.testing.assert_array_equal(pos, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(neg, np.arange(6, 14).reshape(2, 4))
    assert sw.duplicates == "separate"
    only = gl.ModelSwitch(torch.nn.Embedding(3, 2), 10, 2, placement="cpu").variableTransformer(
        2, 2
    )
    assert isinstance(only, np.ndarray) and only.shape == (2, 2)


def test_variable_transformer_keeps_explicit_merge():
    sw = gl.ModelSwitch(torch.nn.Embedding(3, 2), 10, 2, placement="cpu", duplicates="merge")
    sw.variableTransformer(1, 2)
    assert sw.duplicates == "merge"


def test_model_switch_roundtrip_after_step_writes_back():
    emb = torch.nn.Embedding(2, 2)
    sw = gl.ModelSwitch(emb, 6, 2, placement="cpu")
    sw.zerosInit()
    ids = torch.tensor([4, 1])
    local = sw.beforeForwardPass(ids)
    with torch.no_grad():
        emb.weight[local] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    sw.afterOptimizerStep(ids)
    ref = np.zeros((6, 2), np.float32)
    ref[[4, 1]] = [[1, 2], [3, 4]]
    np.testing.assert_array_equal(sw.getNumpyVersion(), ref)


def test_model_switch_save_torch_and_savecupy(tmp_path):
    sw = gl.ModelSwitch(torch.nn.Embedding(2, 3), 5, 3, placement="cpu")
    sw.normalDistributionInit(0.0, 1.0)
    ref = sw.getNumpyVersion()
    sw.saveTorch(tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert loaded.device.type == "cpu"
    np.testing.assert_array_equal(loaded.numpy(), ref)
    sw.saveCupy(str(tmp_path / "c"))
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), ref)
    other = gl.ModelSwitch(torch.nn.Embedding(2, 3), 5, 3, placement="cpu")
    other.loadTorch(tmp_path / "t.pt")
    np.testing.assert_array_equal(other.getNumpyVersion(), ref)


def test_model_switch_loadcupy_wrong_shape_refused(tmp_path):
    sw = gl.ModelSwitch(torch.nn.Embedding(2, 3), 5, 3, placement="cpu")
    sw.customInit(torch.nn.init.constant_, 0.5)
    np.save(tmp_path / "w.npy", np.zeros((6, 3), np.float32))
    with pytest.raises(gl.GadgetError):
        sw.loadCupy(str(tmp_path / "w.npy"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), np.full((5, 3), 0.5, np.float32))


def test_pytorch_model_factory_cpu_device_type():
    emb = torch.nn.Embedding(2, 2)
    sw = gl.PytorchModelFactory(emb, 5, 2, deviceType="cpu")
    assert sw.placement == "cpu"


def test_optimizer_switch_tables_and_save_load(tmp_path):
    model = torch.nn.Module()
    model.u = torch.nn.Embedding(3, 2)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.3)
    sw = gl.ModelFactory(model.u, 8, 2, placement="cpu")
    osw = gl.OptimizerFactory(opt, 8, 2, model, "u", placement="cpu")
    osw.optInit()
    tables = osw.getNumpyVersion()
    assert set(tables) == {"sum"}
    np.testing.assert_array_equal(tables["sum"], np.full((8, 2), 0.3, np.float32))
    osw.customInit(torch.nn.init.constant_, 0.7)
    osw.saveTorch(tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    assert set(saved) == {"sum"} and saved["sum"].device.type == "cpu"
    osw.customInit(torch.nn.init.constant_, 0.0)
    bad = {"sum": torch.zeros(8, 3)}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(gl.GadgetError):
        osw.loadTorch(tmp_path / "bad.pt")
    np.testing.assert_array_equal(osw.getNumpyVersion()["sum"], np.zeros((8, 2), np.float32))
    osw.loadTorch(tmp_path / "s.pt")
    np.testing.assert_array_equal(osw.getNumpyVersion()["sum"], np.full((8, 2), 0.7, np.float32))
    del sw


# --------------------------------------------------------------------------------------
# OffloadedEmbedding / Bag / Optimizer
# --------------------------------------------------------------------------------------


def test_offloaded_embedding_docstring_example_and_rows_used_only():
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(1000, 8, placement="cpu", device="cpu")
    before = emb.weight.getNumpyVersion()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)
    emb(torch.tensor([[1, 2], [2, 3]])).sum().backward()
    opt.step()
    after = emb.weight.getNumpyVersion()
    changed = np.nonzero((after != before).any(axis=1))[0].tolist()
    assert changed == [1, 2, 3]
    # Adam's first step moves each used element by lr (gradient sign +)
    np.testing.assert_allclose(after[[1, 2, 3]], before[[1, 2, 3]] - 0.01, atol=1e-6)


def test_offloaded_embedding_default_init_is_standard_normal():
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(4000, 8, placement="cpu", device="cpu")
    a = emb.weight.getNumpyVersion()
    assert abs(a.mean()) < 0.02 and abs(a.std() - 1.0) < 0.02


def test_offloaded_embedding_custom_init_and_forward_matches_f_embedding():
    import functools

    init = functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1)
    emb = gl.OffloadedEmbedding(20, 3, placement="cpu", device="cpu", init=init)
    w = torch.from_numpy(emb.weight.getNumpyVersion())
    assert w.min() >= -0.1 and w.max() <= 0.1
    ids = torch.tensor([[3, 3, 19], [0, 7, 3]])
    with torch.no_grad():
        out = emb(ids)
    assert out.shape == (2, 3, 3)
    assert torch.equal(out.cpu(), torch.nn.functional.embedding(ids, w))


def test_offloaded_embedding_table_not_a_parameter_but_in_state_dict():
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    assert list(emb.parameters()) == []
    sd = emb.state_dict()
    assert list(sd) == ["weight"]
    np.testing.assert_array_equal(sd["weight"].cpu().numpy(), emb.weight.getNumpyVersion())


def test_offloaded_embedding_out_of_range_cpu_ids_refused():
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetIndexError):
        emb(torch.tensor([6]))
    with pytest.raises(gl.GadgetIndexError):
        emb(torch.tensor([-1]))


@pytest.mark.parametrize("opt_name", ["Adam", "SGD", "Adagrad", "RMSprop"])
def test_offloaded_training_matches_dense_torch(opt_name):
    torch.manual_seed(1)
    n, d = 12, 3
    emb = gl.OffloadedEmbedding(n, d, placement="cpu", device="cpu")
    w0 = torch.from_numpy(emb.weight.getNumpyVersion())
    dense = torch.nn.Embedding(n, d)
    with torch.no_grad():
        dense.weight.copy_(w0)
    cls = getattr(torch.optim, opt_name)
    kw = {"lr": 0.05}
    if opt_name == "SGD":
        kw["momentum"] = 0.9
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    dopt = cls(dense.parameters(), **kw)
    ids = torch.tensor([1, 4, 4, 9])
    target = torch.arange(12.0).reshape(4, 3)
    for _ in range(3):
        opt.zero_grad()
        ((emb(ids) - target) ** 2).sum().backward()
        opt.step()
        dopt.zero_grad()
        ((dense(ids) - target) ** 2).sum().backward()
        dopt.step()
    torch.testing.assert_close(
        torch.from_numpy(emb.weight.getNumpyVersion()), dense.weight.detach(), rtol=1e-5, atol=1e-6
    )


def test_offloaded_optimizer_warns_without_offloaded_table():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.warns(UserWarning):
        gl.OffloadedOptimizer(torch.optim.SGD, [p], lr=0.1)


def test_offloaded_optimizer_refuses_same_table_in_two_groups():
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.SGD, [{"params": emb}, {"params": emb}], lr=0.1)


def test_offloaded_optimizer_param_group_options_apply_to_table():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
            self.head = torch.nn.Linear(2, 1)

    torch.manual_seed(0)
    m = M()
    before = m.emb.weight.getNumpyVersion()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, [m, {"params": m.emb, "lr": 0.5}], lr=0.01)
    m.emb(torch.tensor([2])).sum().backward()
    opt.step()
    after = m.emb.weight.getNumpyVersion()
    np.testing.assert_allclose(after[2], before[2] - 0.5, atol=1e-6)


def test_offloaded_optimizer_state_tables_and_state_dict_roundtrip():
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    assert set(opt.pagers[0].tables) == {"exp_avg", "exp_avg_sq"}
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    esd = emb.state_dict()
    emb2 = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.1)
    emb2.load_state_dict(esd)
    opt2.load_state_dict(sd)
    for o in (opt, opt2):
        o.zero_grad()
    emb(torch.tensor([2, 5])).sum().backward()
    emb2(torch.tensor([2, 5])).sum().backward()
    opt.step()
    opt2.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), emb2.weight.getNumpyVersion())


def test_offloaded_optimizer_load_state_dict_wrong_class_refused_unchanged():
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    before = {k: v.getNumpyVersion() for k, v in opt.pagers[0].tables.items()}
    other_emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    other = gl.OffloadedOptimizer(torch.optim.Adagrad, other_emb, lr=0.1)
    with pytest.raises(gl.GadgetError):
        opt.load_state_dict(other.state_dict())
    for k, v in opt.pagers[0].tables.items():
        np.testing.assert_array_equal(v.getNumpyVersion(), before[k])


def test_embedding_bag_matches_torch_embedding_bag():
    torch.manual_seed(0)
    for mode in ("sum", "mean", "max"):
        bag = gl.OffloadedEmbeddingBag(10, 3, mode=mode, placement="cpu", device="cpu")
        w = torch.from_numpy(bag.weight.getNumpyVersion())
        inp = torch.tensor([1, 2, 4, 4, 9, 0])
        offsets = torch.tensor([0, 2, 5])
        with torch.no_grad():
            got = bag(inp, offsets).cpu()
        ref = torch.nn.functional.embedding_bag(inp, w, offsets, mode=mode)
        torch.testing.assert_close(got, ref)
        with torch.no_grad():
            got2 = bag(inp.reshape(2, 3)).cpu()
        torch.testing.assert_close(
            got2, torch.nn.functional.embedding_bag(inp.reshape(2, 3), w, mode=mode)
        )


def test_embedding_bag_include_last_offset_and_weights():
    bag = gl.OffloadedEmbeddingBag(
        10, 2, mode="sum", placement="cpu", device="cpu", include_last_offset=True
    )
    w = torch.from_numpy(bag.weight.getNumpyVersion())
    inp = torch.tensor([1, 2, 3])
    offsets = torch.tensor([0, 1, 3])
    psw = torch.tensor([0.5, 2.0, -1.0])
    with torch.no_grad():
        got = bag(inp, offsets, per_sample_weights=psw).cpu()
    ref = torch.nn.functional.embedding_bag(
        inp, w, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
    )
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize(
    ("offsets", "psw"),
    [
        (torch.tensor([1, 2]), None),
        (torch.tensor([0, 2, 1]), None),
        (torch.tensor([0, 5]), None),
        (torch.tensor([0.0, 1.0]), None),
        (torch.tensor([0, 1]), torch.ones(2)),  # wrong shape
        (torch.tensor([0, 1]), torch.ones(3, dtype=torch.int64)),  # not float
    ],
)
def test_embedding_bag_bad_call_leaves_nothing_for_step(offsets, psw):
    bag = gl.OffloadedEmbeddingBag(10, 2, mode="sum", placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=1.0)
    before = bag.weight.getNumpyVersion()
    with pytest.raises(gl.GadgetError):
        bag(torch.tensor([1, 2, 3]), offsets, per_sample_weights=psw)
    opt.step()
    np.testing.assert_array_equal(bag.weight.getNumpyVersion(), before)


# --------------------------------------------------------------------------------------
# save_checkpoint / load_checkpoint
# --------------------------------------------------------------------------------------


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.emb = gl.OffloadedEmbedding(8, 3, placement="cpu", device="cpu")
    m.lin = torch.nn.Linear(3, 1)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    return m, opt


def _train(m, opt, ids):
    opt.zero_grad()
    m.lin(m.emb(torch.tensor(ids))).sum().backward()
    opt.step()


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_roundtrip_continues_identically(tmp_path, fmt):
    m, opt = _model_and_opt(0)
    _train(m, opt, [1, 2, 2])
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "opt": opt}, format=fmt)
    assert (tmp_path / "ck" / "meta.pt").exists()
    m2, opt2 = _model_and_opt(5)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "opt": opt2})
    np.testing.assert_array_equal(m.emb.weight.getNumpyVersion(), m2.emb.weight.getNumpyVersion())
    _train(m, opt, [2, 7])
    _train(m2, opt2, [2, 7])
    np.testing.assert_array_equal(m.emb.weight.getNumpyVersion(), m2.emb.weight.getNumpyVersion())
    torch.testing.assert_close(m.lin.weight, m2.lin.weight, rtol=0, atol=0)


def test_save_checkpoint_default_format_is_npy(tmp_path):
    m, opt = _model_and_opt()
    gl.save_checkpoint(tmp_path / "ck", {"model": m})
    files = os.listdir(tmp_path / "ck")
    assert any(f.endswith(".npy") for f in files)


def test_load_checkpoint_missing_meta(tmp_path):
    m, _ = _model_and_opt()
    (tmp_path / "empty").mkdir()
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "empty", {"model": m})
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "nope", {"model": m})


def test_load_checkpoint_damaged_meta_is_file_error(tmp_path):
    m, _ = _model_and_opt()
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "meta.pt").write_bytes(b"garbage")
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m})


def test_load_checkpoint_type_errors(tmp_path):
    m, opt = _model_and_opt()
    gl.save_checkpoint(tmp_path / "ck", {"model": m})
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(tmp_path / "ck", [m])
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(123, {"model": m})
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(tmp_path / "ck", {1: m})


def test_load_checkpoint_mismatch_leaves_every_object_unchanged(tmp_path):
    m, opt = _model_and_opt(0)
    _train(m, opt, [1, 2])
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "opt": opt})
    m2, opt2 = _model_and_opt(3)
    before = m2.emb.weight.getNumpyVersion()
    lin_before = m2.lin.weight.detach().clone()
    with pytest.raises((gl.GadgetKeyError, gl.GadgetValueError)):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2, "other": opt2})
    np.testing.assert_array_equal(m2.emb.weight.getNumpyVersion(), before)
    assert torch.equal(m2.lin.weight.detach(), lin_before)
    torch.manual_seed(0)
    small = torch.nn.Module()
    small.emb = gl.OffloadedEmbedding(7, 3, placement="cpu", device="cpu")
    small.lin = torch.nn.Linear(3, 1)
    sb = small.emb.weight.getNumpyVersion()
    with pytest.raises((gl.GadgetKeyError, gl.GadgetValueError)):
        gl.load_checkpoint(tmp_path / "ck", {"model": small})
    np.testing.assert_array_equal(small.emb.weight.getNumpyVersion(), sb)


def test_load_checkpoint_truncated_table_file_is_file_error_unchanged(tmp_path):
    m, opt = _model_and_opt(0)
    gl.save_checkpoint(tmp_path / "ck", {"model": m})
    npys = [p for p in (tmp_path / "ck").iterdir() if p.suffix == ".npy"]
    assert npys
    data = npys[0].read_bytes()
    npys[0].write_bytes(data[:-8])
    m2, _ = _model_and_opt(4)
    before = m2.emb.weight.getNumpyVersion()
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2})
    np.testing.assert_array_equal(m2.emb.weight.getNumpyVersion(), before)


def test_load_checkpoint_closed_table(tmp_path):
    m, _ = _model_and_opt(0)
    gl.save_checkpoint(tmp_path / "ck", {"model": m})
    m2, _ = _model_and_opt(1)
    m2.emb.weight.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2})


@pytest.mark.parametrize("name", ["", "a/b", "a\\b", "a\0b", ".", ".."])
def test_save_checkpoint_bad_names_refused_nothing_written(tmp_path, name):
    m, _ = _model_and_opt()
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(tmp_path / "ck", {name: m})
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_save_checkpoint_documented_errors(tmp_path):
    m, _ = _model_and_opt()
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", [m])
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", {"g": gl.DataGadget((2, 2), placement="cpu")})
    with pytest.raises(gl.GadgetKeyError):
        gl.save_checkpoint(tmp_path / "ck", {"m": m}, format="pickle")
    (tmp_path / "file").write_text("x")
    with pytest.raises(gl.GadgetFileError):
        gl.save_checkpoint(tmp_path / "file", {"m": m})
    assert (tmp_path / "file").read_text() == "x"


def test_save_checkpoint_bfloat16_npy_refused_before_writing(tmp_path):
    m = torch.nn.Module()
    m.emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu", dtype=torch.bfloat16)
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "ck", {"m": m})
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_save_checkpoint_bfloat16_hdf5_bit_exact(tmp_path):
    pytest.importorskip("h5py")
    m = torch.nn.Module()
    m.emb = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu", dtype=torch.bfloat16)
    gl.save_checkpoint(tmp_path / "ck", {"m": m}, format="hdf5")
    m2 = torch.nn.Module()
    m2.emb = gl.OffloadedEmbedding(
        4, 2, placement="cpu", device="cpu", dtype=torch.bfloat16, init=torch.nn.init.zeros_
    )
    gl.load_checkpoint(tmp_path / "ck", {"m": m2})
    np.testing.assert_array_equal(m.emb.weight.getNumpyVersion(), m2.emb.weight.getNumpyVersion())


def test_save_checkpoint_second_save_removes_previous_table_files(tmp_path):
    m, opt = _model_and_opt()
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "opt": opt})
    first = set(os.listdir(tmp_path / "ck"))
    _train(m, opt, [1])
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "opt": opt})
    second = set(os.listdir(tmp_path / "ck"))
    assert len(second) == len(first)
    m2, opt2 = _model_and_opt(9)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "opt": opt2})
    np.testing.assert_array_equal(m.emb.weight.getNumpyVersion(), m2.emb.weight.getNumpyVersion())


def test_checkpoint_of_speedtorch_switchers(tmp_path):
    model = torch.nn.Module()
    model.u = torch.nn.Embedding(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sw = gl.ModelFactory(model.u, 6, 2, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    osw = gl.OptimizerFactory(opt, 6, 2, model, "u", placement="cpu")
    osw.optInit()
    gl.save_checkpoint(tmp_path / "ck", {"u": sw, "u_opt": osw, "opt": opt})
    model2 = torch.nn.Module()
    model2.u = torch.nn.Embedding(2, 2)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    sw2 = gl.ModelFactory(model2.u, 6, 2, placement="cpu")
    osw2 = gl.OptimizerFactory(opt2, 6, 2, model2, "u", placement="cpu")
    osw2.optInit()
    gl.load_checkpoint(tmp_path / "ck", {"u": sw2, "u_opt": osw2, "opt": opt2})
    np.testing.assert_array_equal(sw.getNumpyVersion(), sw2.getNumpyVersion())


# --------------------------------------------------------------------------------------
# gadgetloader.transfer
# --------------------------------------------------------------------------------------


def test_transfer_strategies_and_resolve():
    assert set(gtr.STRATEGIES) == {"auto", "kernel", "sorted", "hybrid", "torch"}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    table = torch.zeros(100, 4, device=dev)
    with pytest.raises(gl.GadgetKeyError):
        gtr.resolve_strategy("bogus", table, 10)
    if not cupy_available():
        # without CuPy every strategy resolves to torch's own indexing
        assert gtr.resolve_strategy("auto", table, 10) == "torch"
        return
    for s in ("kernel", "sorted", "torch"):
        assert gtr.resolve_strategy(s, table, 10) == s
    # "requests of up to 1024 ids -> kernel"
    assert gtr.resolve_strategy("auto", table, 1024) == "kernel"
    # "Scatters merge repeated ids by sorting them ... or ... by a sort-free pass ..., so
    # auto scatters with kernel"
    assert gtr.resolve_strategy("auto", table, 10**6, kind="scatter") == "kernel"


def test_datagadget_unknown_strategy_refused():
    with pytest.raises(gl.GadgetKeyError):
        gl.DataGadget((2, 2), placement="cpu", strategy="fastest")


# --------------------------------------------------------------------------------------
# gadgetloader.io
# --------------------------------------------------------------------------------------


def test_io_formats_and_guess(tmp_path):
    assert set(gio.FORMATS) >= {"npy", "hdf5", "zarr"}
    assert gio.guess_format("a.npy", must_exist=False) == "npy"
    assert gio.guess_format("a.h5", must_exist=False) == "hdf5"
    assert gio.guess_format("a.hdf5", must_exist=False) == "hdf5"
    assert gio.guess_format("a.zarr", must_exist=False) == "zarr"
    # "from its extension, else its content"
    p = tmp_path / "noext"
    np.save(p.with_suffix(".npy"), np.ones((2, 2), np.float32))
    os.rename(p.with_suffix(".npy"), p)
    assert gio.guess_format(p) == "npy"
    assert gio.sink_format("x.bin", "npy") == "npy"
    assert gio.sink_format("x.h5") == "hdf5"


def test_io_sniffers(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))
    assert gio.is_npy(tmp_path / "a.npy")
    assert not gio.is_hdf5(tmp_path / "a.npy")
    assert not gio.is_zarr(tmp_path / "a.npy")
    (tmp_path / "z").mkdir()
    assert not gio.is_zarr(tmp_path / "z")
    (tmp_path / "z" / "zarr.json").write_text("{}")
    assert gio.is_zarr(tmp_path / "z")
    (tmp_path / "z2").mkdir()
    (tmp_path / "z2" / ".zarray").write_text("{}")
    assert gio.is_zarr(tmp_path / "z2")
    assert not gio.is_npy(tmp_path / "missing")


def test_io_is_hdf5_signature_at_512(tmp_path):
    h5py = pytest.importorskip("h5py")
    p = tmp_path / "a.h5"
    with h5py.File(p, "w", userblock_size=512) as f:
        f["x"] = np.ones(2)
    assert gio.is_hdf5(p)
    assert not gio.is_npy(p)


def test_io_sink_takes():
    assert gio.sink_takes("hdf5", "compression")
    assert gio.sink_takes("zarr", "compression_level")
    assert not gio.sink_takes("npy", "compression")


def test_io_open_sink_source_roundtrip(tmp_path):
    for fmt, name in (("npy", "a.npy"), ("hdf5", "a.h5"), ("zarr", "a.zarr")):
        ref = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        g = gl.DataGadget(ref, placement="cpu")
        sink = gio.open_sink(tmp_path / name, (4, 3), torch.float32)
        gio.save_from(g.store, sink)
        src = gio.open_source(tmp_path / name)
        assert tuple(src.shape) == (4, 3) and src.dtype == torch.float32
        assert os.path.isabs(src.path)
        assert gl.DataGadget(tmp_path / name, placement="cpu").getNumpyVersion().tolist() == (
            ref.tolist()
        ), fmt


def test_io_npy_source_errors(tmp_path):
    with pytest.raises(gl.GadgetFileNotFoundError):
        gio.NpySource(tmp_path / "missing.npy")
    (tmp_path / "bad.npy").write_bytes(b"not a npy file at all")
    with pytest.raises(gl.GadgetFileError):
        gio.NpySource(tmp_path / "bad.npy")
    np.save(tmp_path / "s.npy", np.array([["a", "b"]]))
    with pytest.raises(gl.GadgetTypeError):
        gio.NpySource(tmp_path / "s.npy")
    np.save(tmp_path / "t.npy", np.ones((50, 4), np.float32))
    data = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(data[:-16])
    with pytest.raises(gl.GadgetFileError):
        gio.NpySource(tmp_path / "t.npy")


def test_io_hdf5_source_errors(tmp_path):
    h5py = pytest.importorskip("h5py")
    with pytest.raises(gl.GadgetFileNotFoundError):
        gio.Hdf5Source(tmp_path / "missing.h5")
    (tmp_path / "bad.h5").write_bytes(b"nope")
    with pytest.raises(gl.GadgetFileError):
        gio.Hdf5Source(tmp_path / "bad.h5")
    p = tmp_path / "two.h5"
    with h5py.File(p, "w") as f:
        f["a"] = np.ones((2, 2), np.float32)
        f["g/b"] = np.ones((3, 2), np.float32)
    with pytest.raises(gl.GadgetKeyError):
        gio.Hdf5Source(p)  # more than one dataset
    with pytest.raises(gl.GadgetKeyError) as e:
        gio.Hdf5Source(p, dataset="c")
    assert "a" in str(e.value) and "g/b" in str(e.value)  # lists the datasets there
    src = gio.Hdf5Source(p, dataset="g/b")
    assert src.dataset == "g/b" and tuple(src.shape) == (3, 2)


def test_io_hdf5_sink_default_dataset_is_data(tmp_path):
    h5py = pytest.importorskip("h5py")
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    g.save(tmp_path / "a.h5")
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert list(f.keys()) == ["data"]
        assert f["data"].compression is None


def test_io_zarr_source_errors(tmp_path):
    pytest.importorskip("zarr")
    with pytest.raises(gl.GadgetFileNotFoundError):
        gio.ZarrSource(tmp_path / "missing.zarr")
    (tmp_path / "plain").mkdir()
    with pytest.raises(gl.GadgetFileError):
        gio.ZarrSource(tmp_path / "plain")
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    g.save(tmp_path / "g.zarr", dataset="emb")
    with pytest.raises(gl.GadgetKeyError):
        gio.ZarrSource(tmp_path / "g.zarr", dataset="other")
    assert tuple(gio.ZarrSource(tmp_path / "g.zarr").shape) == (3, 2)


def test_io_temp_path_beside_pattern(tmp_path):
    t = gio.temp_path_beside(tmp_path / "emb.npy")
    assert t.parent == tmp_path
    assert re.fullmatch(rf"\.emb\.npy\.partial-{os.getpid()}-[0-9A-Za-z_]{{8}}", t.name), t.name
    assert not t.exists()
    assert gio.temp_path_beside(tmp_path / "emb.npy") != t
    t2 = gio.temp_path_beside(tmp_path / "emb.npy", tag="old")
    assert t2.name.startswith(".emb.npy.old-")


def test_io_replace_atomically_keeps_permission_bits(tmp_path):
    target = tmp_path / "t.npy"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    tmp = tmp_path / "new"
    tmp.write_bytes(b"new")
    os.chmod(tmp, 0o600)
    gio.replace_atomically(tmp, target)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert not tmp.exists()


def test_io_replace_atomically_symlink_stays_link(tmp_path):
    real = tmp_path / "real.npy"
    real.write_bytes(b"old")
    link = tmp_path / "link.npy"
    link.symlink_to(real)
    tmp = tmp_path / "new"
    tmp.write_bytes(b"new")
    gio.replace_atomically(tmp, link)
    assert link.is_symlink()
    assert real.read_bytes() == b"new"


def test_io_replace_atomically_directory(tmp_path):
    target = tmp_path / "a.zarr"
    target.mkdir()
    (target / "old").write_text("o")
    tmp = tmp_path / "new.zarr"
    tmp.mkdir()
    (tmp / "new").write_text("n")
    gio.replace_atomically(tmp, target)
    assert sorted(os.listdir(target)) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["a.zarr"]


def test_io_hard_link_keeps_old_data(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    other = tmp_path / "hard"
    os.link(target, other)
    tmp = tmp_path / "new"
    tmp.write_bytes(b"new")
    gio.replace_atomically(tmp, target)
    assert other.read_bytes() == b"old" and target.read_bytes() == b"new"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_loader_accepts_array_or_tensor_dataset(kind):
    arr = np.arange(5, dtype=np.float32)
    src = arr if kind == "numpy" else torch.from_numpy(arr.copy())
    loader = gl.GadgetLoader(src, batch_size=2, order="sequential")
    assert [b[0].cpu().tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0]]


def test_dataset_with_sampler_and_batch_size_none_gives_lists():
    # "With sampler=GadgetSampler(...), batch_size=None torch's default_convert turns
    # the tuple into a list of the same tensors."
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    ds = gl.GadgetDataset(x, placement="cpu", device="cpu")
    dl = DataLoader(
        ds, sampler=gl.GadgetSampler(ds, batch_size=2, order="sequential"), batch_size=None
    )
    got = list(dl)
    assert all(isinstance(b, list) for b in got)
    np.testing.assert_array_equal(torch.cat([b[0].cpu() for b in got]).numpy(), x)


def test_gradient_after_step_is_refused_and_not_applied():
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(torch.tensor([1]))
    opt.step()
    before = emb.weight.getNumpyVersion()
    out.sum().backward()
    with pytest.raises(gl.GadgetValueError):
        opt.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)


def test_zero_grad_discards_late_gradient():
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(torch.tensor([1]))
    opt.step()
    out.sum().backward()
    opt.zero_grad()
    before = emb.weight.getNumpyVersion()
    opt.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)


def test_loading_rows_while_lookup_waits_is_refused(tmp_path):
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    before = emb.weight.getNumpyVersion()
    with pytest.raises(RuntimeError):
        emb.load_state_dict({"weight": torch.zeros(6, 2)})
    np.save(tmp_path / "w.npy", np.zeros((6, 2), np.float32))
    with pytest.raises(gl.GadgetError):
        emb.weight.load(tmp_path / "w.npy")
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)
    opt.step()  # the waiting step still applies
    assert not np.array_equal(emb.weight.getNumpyVersion(), before)


def test_interleaved_table_load_wrong_shape_refused_unchanged(tmp_path):
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    assert opt.pagers  # the table is interleaved with its Adam states now
    before = emb.weight.getNumpyVersion()
    np.save(tmp_path / "w.npy", np.zeros((5, 2), np.float32))
    with pytest.raises(gl.GadgetError):
        emb.weight.load(tmp_path / "w.npy")
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)
    new = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.save(tmp_path / "ok.npy", new)
    emb.weight.load(tmp_path / "ok.npy")
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), new)


@pytest.mark.parametrize(
    ("build", "err"),
    [
        (
            lambda: gl.OffloadedEmbeddingBag(5, 2, mode="median", placement="cpu"),
            gl.GadgetValueError,
        ),
        (lambda: gl.OffloadedEmbedding(5, 2, placement="file"), gl.GadgetKeyError),
        (
            lambda: gl.ModelSwitch(torch.nn.Embedding(3, 4), 10, 2, placement="cpu"),
            gl.GadgetValueError,
        ),
        (
            lambda: gl.ModelSwitch(
                torch.nn.Embedding(3, 2), 10, 2, placement="cpu", duplicates="both"
            ),
            gl.GadgetValueError,
        ),
        (lambda: gl.GadgetSampler(10, batch_size=3, num_replicas=2, rank=2), gl.GadgetValueError),
    ],
)
def test_constructors_refuse_documented_bad_values(build, err):
    with pytest.raises(err):
        build()


def test_sampler_accepts_numpy_integer_source():
    s = gl.GadgetSampler(np.int64(10), batch_size=3)
    assert s.num_rows == 10 and len(s) == 4


def test_sampler_set_epoch_sets_epoch():
    s = gl.GadgetSampler(10, batch_size=3, seed=2)
    s.set_epoch(3)
    assert s.epoch == 3
    assert torch.equal(torch.cat(list(s)), s.epoch_order(3))
