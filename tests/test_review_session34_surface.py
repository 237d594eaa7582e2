"""Session 34 review: the Python object surface a user pokes at in a notebook.

Black-box: written from README.md, SPEC.md and the public docstrings only.
Covers, for the names in ``gadgetloader.__all__``: properties that must agree with each
other and with the data, ``repr`` / ``str`` (also of closed objects), equality and
hashing, ``pickle`` / ``copy.copy`` / ``copy.deepcopy``, docstrings (every public
callable has one and names every parameter of its signature), type hints that resolve,
``__version__``, the ``python -m gadgetloader`` entry point, and unknown keyword
arguments (a ``TypeError``, never swallowed).
"""

from __future__ import annotations

import copy
import doctest
import errno
import inspect
import io
import json
import os
import pickle
import pydoc
import re
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

import gadgetloader as gl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# ----------------------------------------------------------------------------- helpers


def _env():
    env = os.environ.copy()
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _cli(*args, timeout=150):
    # subprocess.run closes both pipes whatever happens
    return subprocess.run(
        [sys.executable, "-m", "gadgetloader", *args],
        cwd=str(REPO),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _table(data, **kw):
    kw.setdefault("placement", "cpu")
    kw.setdefault("device", "cpu")
    return gl.DataGadget(data, **kw)


def _np(g):
    return np.asarray(g.getNumpyVersion())


_EXCEPTIONS = tuple(
    n
    for n in gl.__all__
    if inspect.isclass(getattr(gl, n)) and issubclass(getattr(gl, n), BaseException)
)
_PUBLIC_CLASSES = tuple(
    n
    for n in gl.__all__
    if inspect.isclass(getattr(gl, n)) and not issubclass(getattr(gl, n), BaseException)
)
_PUBLIC_FUNCTIONS = tuple(n for n in gl.__all__ if inspect.isfunction(getattr(gl, n)))


def _resolve(ref):
    tgt = gl
    for part in ref.split("."):
        if part == "gadgetloader":
            continue
        tgt = getattr(tgt, part, None)
        if tgt is None:
            return None
    return tgt


def _full_doc(obj, depth=0):
    """The docstring help() shows, plus the docstrings it points to (``:class:`X```,
    ``:meth:`X.y```, ``:func:`f```), so that "see X" counts as describing a parameter."""
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "__init__" in vars(obj):
        doc += "\n" + (inspect.getdoc(vars(obj)["__init__"]) or "")
    if depth < 2:
        for ref in re.findall(r":(?:class|meth|func):`~?([\w.]+)`", doc):
            tgt = _resolve(ref)
            if tgt is not None:
                doc += "\n" + _full_doc(tgt, depth + 1)
    return doc


def _undescribed(func, extra=""):
    """Named parameters of ``func`` that its docstring text never names."""
    sig = inspect.signature(func)
    doc = _full_doc(func) + "\n" + extra
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        # *args / **kwargs pass through; positional-only ones come from builtins (tuple)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        if not re.search(r"\b" + re.escape(p.name) + r"\b", doc):
            out.append(p.name)
    return out


def _own_public_methods(cls_name):
    """Public methods whose code lives in this public class (or in a private base of it,
    attributed to the first public class in ``__all__`` order that inherits it)."""
    cls = getattr(gl, cls_name)
    public = {getattr(gl, n) for n in _PUBLIC_CLASSES}
    out = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("gadgetloader"):
            continue
        if klass is not cls and klass in public:
            continue  # reported under that class
        if klass is not cls:
            # a private base: report it only under the first public class inheriting it
            first = next(
                getattr(gl, n) for n in _PUBLIC_CLASSES if issubclass(getattr(gl, n), klass)
            )
            if first is not cls:
                continue
        for an, av in vars(klass).items():
            if an.startswith("_") or an in out or isinstance(av, property):
                continue
            f = av.__func__ if isinstance(av, (staticmethod, classmethod)) else av
            if inspect.isfunction(f):
                out[an] = getattr(cls, an)
    return out


# ============================================================================ module surface


def test_all_names_exist_once_and_star_import_matches():
    assert len(gl.__all__) == len(set(gl.__all__)), "duplicate names in __all__"
    missing = [n for n in gl.__all__ if not hasattr(gl, n)]
    assert not missing, f"names in __all__ that the package lacks: {missing}"
    ns = {}
    exec("from gadgetloader import *", ns)
    assert set(gl.__all__) <= set(ns), set(gl.__all__) - set(ns)


def test_spec_names_are_exported():
    for name in (
        "DataGadget",
        "GadgetDataset",
        "ModelFactory",
        "OptimizerFactory",
        "PytorchModelFactory",
        "PytorchOptimizerFactory",
    ):
        assert name in gl.__all__, name
        assert inspect.isclass(getattr(gl, name)), name


def test_version_is_pep440_and_matches_pyproject():
    from packaging.version import InvalidVersion, Version

    v = gl.__version__
    assert isinstance(v, str) and v
    try:
        parsed = Version(v)
    except InvalidVersion as e:  # pragma: no cover - the failure path
        pytest.fail(f"__version__ {v!r} is not PEP 440: {e}")
    assert str(parsed) == v, f"__version__ {v!r} is not in PEP 440 normal form ({parsed})"
    pyproject = REPO / "pyproject.toml"
    if pyproject.exists():
        m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text())
        if m:
            assert Version(m.group(1)) == parsed, (m.group(1), v)


def test_public_constants_agree_with_the_library():
    assert set(gl.PLACEMENTS) == {"cpu", "cuda", "pinned", "file"}
    # the unknown-placement error lists the valid ones (README, Errors)
    with pytest.raises(gl.GadgetKeyError) as ei:
        _table(np.zeros((2, 2), np.float32), placement="nowhere")
    for p in gl.PLACEMENTS:
        assert p in str(ei.value), (p, str(ei.value))
    assert "nowhere" in str(ei.value)
    # every supported dtype makes a table that reports it, with the right byte count
    for dt in gl.SUPPORTED_DTYPES:
        assert isinstance(dt, torch.dtype)
        g = gl.DataGadget((3, 2), dtype=dt, placement="cpu", device="cpu")
        assert g.dtype == dt
        assert g.nbytes == 6 * torch.empty((), dtype=dt).element_size()
    # every supported optimizer name is a torch optimizer class
    for name in gl.SUPPORTED_OPTIMIZERS:
        cls = getattr(torch.optim, name, None)
        assert inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer), name


_SPEC_SIGNATURES = {
    # SPEC.md, "Names that users already write (keep them working exactly)"
    "DataGadget": [("fileName", None), ("CPUPinn", False)],
    "ModelFactory": [
        ("model_variable", None),
        ("total_classes", None),
        ("embed_dimension", None),
        ("datatype", "float32"),
        ("CPUPinn", False),
    ],
    "OptimizerFactory": [
        ("given_optimizer", None),
        ("total_classes", None),
        ("embed_dimension", None),
        ("model", None),
        ("variable_name", None),
        ("dtype", "float32"),
        ("CPUPinn", False),
    ],
    "PytorchModelFactory": [
        ("model_variable", None),
        ("total_classes", None),
        ("embed_dimension", None),
        ("datatype", "float32"),
        ("deviceType", "cuda"),
        ("pinType", False),
    ],
    "PytorchOptimizerFactory": [
        ("given_optimizer", None),
        ("total_classes", None),
        ("embed_dimension", None),
        ("model", None),
        ("variable_name", None),
        ("dtype", "float32"),
        ("deviceType", "cuda"),
        ("pinType", False),
    ],
    "DataGadget.getData": [("indexes", None)],
    "DataGadget.insertData": [("dataObject", None), ("indexes", None)],
    "DataGadget.saveCupy": [("saveFileName", None)],
    "DataGadget.loadCupy": [("loadFileName", None)],
    "ModelFactory.uniformDistributionInit": [("low", None), ("high", None)],
    "ModelFactory.normalDistributionInit": [("mean", None), ("stdDev", None)],
    "ModelFactory.variableTransformer": [
        ("batchSize", None),
        ("posPerBatch", None),
        ("negPerBatch", None),
    ],
    "ModelFactory.beforeForwardPass": [
        ("retrievedPosIndexes", None),
        ("retrievedNegIndexes", None),
    ],
    "ModelFactory.afterOptimizerStep": [
        ("retrievedPosIndexes", None),
        ("retrievedNegIndexes", None),
    ],
    "OptimizerFactory.beforeForwardPass": [
        ("retrievedPosIndexes", None),
        ("retrievedNegIndexes", None),
    ],
    "OptimizerFactory.afterOptimizerStep": [
        ("retrievedPosIndexes", None),
        ("retrievedNegIndexes", None),
    ],
    "PytorchModelFactory.customInit": [("initFunction", None)],
    "PytorchModelFactory.saveTorch": [("saveFileName", None)],
    "PytorchModelFactory.loadTorch": [("loadFileName", None)],
}


@pytest.mark.parametrize("name", sorted(_SPEC_SIGNATURES))
def test_spec_signatures_keep_speedtorch_names(name):
    obj = _resolve(name)
    params = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    want = _SPEC_SIGNATURES[name]
    got = [p.name for p in params[: len(want)]]
    assert got == [w[0] for w in want], f"{name}: positional names {got}, SPEC says {want}"
    for p, (wname, wdefault) in zip(params, want, strict=False):
        assert p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD), (name, p)
        assert p.kind != p.POSITIONAL_ONLY, f"{name}: {wname} cannot be passed by keyword"
        if wdefault is not None:
            assert p.default == wdefault, (name, wname, p.default, wdefault)


def test_spec_keyword_calls_work(tmp_path):
    g = gl.DataGadget(
        fileName=np.arange(12, dtype=np.float32).reshape(4, 3),
        CPUPinn=False,
        placement="cpu",
        device="cpu",
    )
    g.insertData(dataObject=torch.full((1, 3), 9.0), indexes=[2])
    assert g.getData(indexes=[2]).tolist() == [[9.0, 9.0, 9.0]]
    g.saveCupy(saveFileName=str(tmp_path / "t"))
    h = _table(np.zeros((1, 1), np.float32))
    h.loadCupy(loadFileName=str(tmp_path / "t.npy"))
    np.testing.assert_array_equal(_np(h), _np(g))

    emb = torch.nn.Embedding(3, 3)
    sw = gl.ModelFactory(
        model_variable=emb,
        total_classes=10,
        embed_dimension=3,
        datatype="float32",
        CPUPinn=False,
        placement="cpu",
    )
    sw.uniformDistributionInit(low=-1.0, high=1.0)
    sw.normalDistributionInit(mean=0.0, stdDev=1.0)
    pos, neg = sw.variableTransformer(batchSize=2, posPerBatch=3, negPerBatch=4)
    assert pos.shape == (2, 3) and neg.shape == (2, 4) and pos.dtype == np.int64
    sw2 = gl.ModelFactory(torch.nn.Embedding(4, 3), 10, 3, placement="cpu")
    lp, ln = sw2.beforeForwardPass(
        retrievedPosIndexes=torch.tensor([1, 5]), retrievedNegIndexes=torch.tensor([5, 7])
    )
    assert lp.shape == (2,) and ln.shape == (2,)
    sw2.afterOptimizerStep(
        retrievedPosIndexes=torch.tensor([1, 5]), retrievedNegIndexes=torch.tensor([5, 7])
    )


# ============================================================================ docstrings


@pytest.mark.parametrize("name", _PUBLIC_CLASSES + _PUBLIC_FUNCTIONS + _EXCEPTIONS)
def test_public_callable_has_docstring(name):
    obj = getattr(gl, name)
    assert (inspect.getdoc(obj) or "").strip(), f"gl.{name} has no docstring"
    if name in _PUBLIC_CLASSES:
        nodoc = [
            m for m, f in _own_public_methods(name).items() if not (inspect.getdoc(f) or "").strip()
        ]
        assert not nodoc, f"public methods of gl.{name} without a docstring: {nodoc}"


@pytest.mark.parametrize("name", _PUBLIC_CLASSES + _PUBLIC_FUNCTIONS)
def test_signature_parameters_are_described(name):
    obj = getattr(gl, name)
    missing = _undescribed(obj)
    assert not missing, (
        f"help(gl.{name}) never names these parameters of {inspect.signature(obj)}: {missing}"
    )


@pytest.mark.parametrize("name", _PUBLIC_CLASSES)
def test_method_parameters_are_described(name):
    cls_doc = _full_doc(getattr(gl, name))
    bad = {}
    for mname, f in sorted(_own_public_methods(name).items()):
        missing = _undescribed(f, cls_doc)
        if missing:
            bad[mname] = missing
    assert not bad, f"gl.{name} methods whose docstrings never name these parameters: {bad}"


def test_public_properties_have_docstrings():
    bad = []
    for name in _PUBLIC_CLASSES:
        cls = getattr(gl, name)
        for klass in cls.__mro__:
            if not klass.__module__.startswith("gadgetloader"):
                continue
            for an, av in vars(klass).items():
                if (
                    isinstance(av, property)
                    and not an.startswith("_")
                    and not (inspect.getdoc(av) or "").strip()
                ):
                    bad.append(f"{name}.{an}")
    assert not bad, (
        f"public properties with no docstring (help() shows nothing): {sorted(set(bad))}"
    )


def test_docstring_examples_run():
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    objs = []
    for name in gl.__all__:
        o = getattr(gl, name)
        if not callable(o):
            continue
        objs.append((name, o))
        if inspect.isclass(o):
            for an, av in vars(o).items():
                if callable(av) or isinstance(av, property):
                    objs.append((f"{name}.{an}", av))
    out = []
    ran = 0
    for name, o in objs:
        for t in finder.find(o, name, globs={}):
            if t.examples:
                ran += 1
                runner.run(t, out=out.append)
    assert ran >= 3, "expected the documented Examples sections"
    res = runner.summarize(verbose=False)
    assert res.failed == 0, "".join(out)


@pytest.mark.parametrize("name", _PUBLIC_CLASSES + _PUBLIC_FUNCTIONS)
def test_help_renders_and_names_the_object(name):
    text = pydoc.render_doc(getattr(gl, name), renderer=pydoc.plaintext)
    assert name in text


# ============================================================================ type hints


@pytest.mark.parametrize("name", _PUBLIC_CLASSES + _PUBLIC_FUNCTIONS)
def test_type_hints_resolve(name):
    obj = getattr(gl, name)
    targets = [(name, obj)]
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            if not klass.__module__.startswith("gadgetloader"):
                continue
            for an, av in vars(klass).items():
                if an.startswith("_") and an != "__init__":
                    continue
                if isinstance(av, property):
                    if av.fget is not None:
                        targets.append((f"{name}.{an}", av.fget))
                elif isinstance(av, (staticmethod, classmethod)):
                    targets.append((f"{name}.{an}", av.__func__))
                elif inspect.isfunction(av):
                    targets.append((f"{name}.{an}", av))
    bad = []
    for tname, t in targets:
        try:
            typing.get_type_hints(t)
        except Exception as e:  # noqa: BLE001 - collect them all
            bad.append(f"{tname}: {type(e).__name__}: {e}")
    assert not bad, "typing.get_type_hints fails for:\n" + "\n".join(sorted(set(bad)))


# ============================================================================ command line


def test_cli_help():
    r = _cli("--help")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "usage" in r.stdout.lower()
    for cmd in ("info", "bench", "convert"):
        assert cmd in r.stdout
    assert "Traceback" not in r.stderr


def test_cli_version():
    r = _cli("--version")
    assert r.returncode == 0, (
        f"`python -m gadgetloader --version` exited {r.returncode}: {r.stderr.strip()!r}"
    )
    assert gl.__version__ in (r.stdout + r.stderr)


def test_cli_info_reports_the_package_version(tmp_path):
    out = tmp_path / "info.json"
    r = _cli("info", "--no-measure", "--json", str(out))
    assert r.returncode == 0, (r.returncode, r.stderr)
    data = json.loads(out.read_text())
    assert data["gadgetloader"] == gl.__version__
    assert gl.__version__ in r.stdout


# ============================================================================ DataGadget


_GADGET_CASES = [
    (torch.float32, (6, 4)),
    (torch.bool, (5,)),
    (torch.bfloat16, (3, 2, 2)),
    (torch.int16, (4, 1)),
    (torch.uint8, (0, 3)),
    (torch.float64, (2, 3, 4, 1)),
]


@pytest.mark.parametrize("dtype,shape", _GADGET_CASES, ids=lambda v: str(v))
def test_gadget_properties_agree_with_each_other_and_the_data(dtype, shape):
    n = int(np.prod(shape))
    src = (torch.arange(n) % 7).to(dtype).reshape(shape)
    g = _table(src)
    assert g.shape == tuple(shape) and isinstance(g.shape, tuple)
    assert len(g) == shape[0]
    assert g.row_shape == tuple(shape[1:])
    assert g.ndim == len(shape) == g.dim()
    assert g.size() == torch.Size(shape)
    for d in range(len(shape)):
        assert g.size(d) == shape[d]
    assert g.size(-1) == shape[-1]
    assert g.numel() == n
    assert isinstance(g.dtype, torch.dtype) and g.dtype == dtype
    assert g.nbytes == n * src.element_size()
    assert g.placement == "cpu" and g.placement in gl.PLACEMENTS
    assert torch.device(g.device) == torch.device("cpu")
    t = g.as_tensor()
    assert t.dtype == dtype and tuple(t.shape) == tuple(shape)
    assert torch.equal(t, src)
    a = np.asarray(g)
    assert a.shape == tuple(shape)
    want_np = np.float32 if dtype == torch.bfloat16 else src.numpy().dtype
    assert a.dtype == want_np
    np.testing.assert_array_equal(
        a, src.float().numpy() if dtype == torch.bfloat16 else src.numpy()
    )
    rows = g.getData(slice(None))
    assert tuple(rows.shape) == tuple(shape) and rows.dtype == dtype and torch.equal(rows, src)


def test_gadget_properties_follow_a_load_of_another_shape_and_dtype(tmp_path):
    path = tmp_path / "b.npy"
    arr = np.arange(30, dtype=np.int16).reshape(5, 2, 3)
    np.save(path, arr)
    g = _table(np.zeros((4, 3), np.float32))
    g.loadCupy(str(path))  # DataGadget.loadCupy takes the file's shape and dtype
    assert g.shape == (5, 2, 3) and len(g) == 5 and g.row_shape == (2, 3)
    assert g.dtype == torch.int16 and g.nbytes == arr.nbytes and g.numel() == 30
    assert g.size() == torch.Size([5, 2, 3]) and g.ndim == 3
    assert tuple(g.as_tensor().shape) == (5, 2, 3)
    r = repr(g)
    assert "(5, 2, 3)" in r and "int16" in r
    np.testing.assert_array_equal(_np(g), arr)


def test_gadget_repr_and_str_are_informative():
    for dtype, shape in [(torch.float32, (6, 4)), (torch.int64, (3,)), (torch.bfloat16, (2, 5))]:
        g = gl.DataGadget(shape, dtype=dtype, placement="cpu", device="cpu")
        for text in (repr(g), str(g)):
            assert "DataGadget" in text
            assert str(tuple(shape)) in text, text
            assert str(dtype).replace("torch.", "") in text, text
            assert "cpu" in text


def test_file_gadget_properties_agree_with_the_file(tmp_path):
    path = tmp_path / "c.npy"
    arr = np.arange(21, dtype=np.float64).reshape(7, 3)
    np.save(path, arr)
    g = gl.DataGadget(str(path), placement="file", device="cpu")
    assert g.placement == "file"
    assert g.shape == (7, 3) and len(g) == 7 and g.row_shape == (3,)
    assert g.dtype == torch.float64 and g.nbytes == arr.nbytes
    np.testing.assert_array_equal(np.asarray(g), arr)
    assert "file" in repr(g) and "DataGadget" in repr(g)
    g.close()
    assert "closed" in repr(g) and len(g) == 7 and g.shape == (7, 3)


def test_file_gadget_repr_names_its_file(tmp_path):
    # two file tables of the same shape over different files must be told apart in a
    # notebook (h5py and zarr reprs name their file / dataset)
    path = tmp_path / "named_table.npy"
    np.save(path, np.zeros((3, 2), np.float32))
    g = gl.DataGadget(str(path), placement="file", device="cpu")
    assert "named_table" in repr(g), repr(g)


def test_closed_gadget_still_answers_metadata_and_repr():
    g = _table(np.arange(8, dtype=np.float32).reshape(4, 2))
    g.close()
    g.close()  # idempotent
    for text in (repr(g), str(g)):
        assert "DataGadget" in text and "closed" in text and "(4, 2)" in text
    assert g.shape == (4, 2) and g.dtype == torch.float32 and len(g) == 4
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    with gl.DataGadget((2, 2), placement="cpu", device="cpu") as w:
        assert isinstance(w, gl.DataGadget)
        assert w.getData([0]).shape == (1, 2)
    assert "closed" in repr(w)
    with pytest.raises(gl.GadgetClosedError):
        w.getData([0])


def test_gadget_equality_and_hash_are_sane():
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    g, h = _table(a), _table(a)
    assert (g == g) is True and (g != g) is False
    assert hash(g) == hash(g)
    eq = g == h
    assert isinstance(eq, bool), f"== gives {type(eq).__name__}, not a bool"
    if eq:
        assert hash(g) == hash(h)
    s = {g, h, g}
    assert g in s and len(s) == (1 if eq else 2)
    d = {g: "g"}
    assert d[g] == "g"


def test_cpu_gadget_pickles_by_value_and_independently():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = _table(a)
    p = pickle.loads(pickle.dumps(g))
    assert isinstance(p, gl.DataGadget)
    assert (p.shape, p.dtype, p.placement, p.nbytes) == (g.shape, g.dtype, g.placement, g.nbytes)
    np.testing.assert_array_equal(_np(p), a)
    p.insertData(torch.full((1, 3), -1.0), [0])
    np.testing.assert_array_equal(_np(g), a)
    g.insertData(torch.full((1, 3), -2.0), [1])
    assert _np(p)[1].tolist() == a[1].tolist()
    p.close()
    np.testing.assert_array_equal(_np(g)[2:], a[2:])


def test_cpu_gadget_deepcopy_is_equal_and_independent():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = _table(a)
    d = copy.deepcopy(g)
    assert d is not g and (d.shape, d.dtype, d.placement) == (g.shape, g.dtype, g.placement)
    np.testing.assert_array_equal(_np(d), a)
    d.insertData(torch.full((1, 3), -1.0), [0])
    d.close()
    np.testing.assert_array_equal(_np(g), a)


@pytest.mark.parametrize("kind", ["DataGadget", "GadgetDataset"])
def test_shallow_copy_close_does_not_close_the_original(kind):
    # copy.copy must give an independent object or refuse with a clear error; what it
    # must not give is a second handle whose close() frees the original's rows
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    obj = _table(a) if kind == "DataGadget" else gl.GadgetDataset(a, placement="cpu", device="cpu")
    try:
        c = copy.copy(obj)
    except gl.GadgetError as e:
        assert "copy" in str(e).lower()
        return
    c.close()
    try:
        if kind == "DataGadget":
            np.testing.assert_array_equal(_np(obj), a)
        else:
            assert obj[1][0].tolist() == a[1].tolist()
    except gl.GadgetClosedError as e:
        pytest.fail(f"closing copy.copy({kind}) closed the original too: {e}")


def test_file_gadget_pickles_as_its_file(tmp_path):
    path = tmp_path / "f.npy"
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(path, a)
    g = gl.DataGadget(str(path), placement="file", device="cpu")
    p = pickle.loads(pickle.dumps(g))
    assert p.placement == "file" and p.shape == g.shape and p.dtype == g.dtype
    np.testing.assert_array_equal(_np(p), a)
    # same file: a write through one is seen by the other (README, file tables)
    p.insertData(torch.full((1, 3), 5.0), [2])
    assert g.getData([2]).tolist() == [[5.0, 5.0, 5.0]]
    p.close()
    assert g.getData([0]).tolist() == [a[0].tolist()]


def test_copies_of_a_closed_gadget_stay_closed():
    g = _table(np.zeros((3, 2), np.float32))
    g.close()
    for f in (copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        try:
            r = f(g)
        except gl.GadgetClosedError:
            continue
        assert "closed" in repr(r)
        with pytest.raises(gl.GadgetClosedError):
            r.getData([0])


def test_gadget_iterates_as_a_sequence_of_rows():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = _table(a)
    rows = list(g)
    assert len(rows) == len(g)
    np.testing.assert_array_equal(np.stack([r.numpy() for r in rows]), a)


def test_init_methods_return_the_table():
    g = gl.DataGadget((4, 3), dtype="float32", placement="cpu", device="cpu")
    for call in (
        lambda: g.zero_(),
        lambda: g.fill_(2.0),
        lambda: g.uniform_(0.0, 1.0),
        lambda: g.normal_(0.0, 1.0),
        lambda: g.init_(torch.nn.init.ones_),
        lambda: g.gadgetInit(),
    ):
        assert call() is g
    assert _np(g).tolist() == [[1.0] * 3] * 4
    z = gl.DataGadget.zeros((3, 2), placement="cpu", device="cpu")
    assert isinstance(z, gl.DataGadget) and z.shape == (3, 2) and not _np(z).any()


# ============================================================================ pipeline objects


def _dataset(n=10):
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    y = np.arange(n, dtype=np.int64)
    return gl.GadgetDataset(x, y, placement="cpu", device="cpu"), x, y


def test_dataset_properties_and_repr():
    ds, x, y = _dataset()
    assert len(ds) == 10
    cols = ds.columns
    assert isinstance(cols, tuple) and len(cols) == 2
    assert all(isinstance(c, gl.DataGadget) and len(c) == len(ds) for c in cols)
    assert ds.row_nbytes == sum(c.nbytes // len(c) for c in cols) == 4 * 4 + 8
    assert torch.device(ds.device) == torch.device("cpu")
    r = repr(ds)
    assert "GadgetDataset" in r and "10" in r
    xi, yi = ds[3]
    assert xi.tolist() == x[3].tolist() and int(yi) == 3
    ds.close()
    assert "GadgetDataset" in repr(ds) and len(ds) == 10


def test_dataset_pickle_and_deepcopy_are_equal_and_independent():
    for f in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        ds, x, y = _dataset()
        d = f(ds)
        assert len(d) == len(ds)
        b = d[[0, 5]]
        assert b[0].tolist() == x[[0, 5]].tolist() and b[1].tolist() == [0, 5]
        d.columns[0].insertData(torch.full((1, 4), -5.0), [0])
        assert ds[0][0].tolist() == x[0].tolist()
        d.close()
        assert ds[1][0].tolist() == x[1].tolist()


def _sampler_cases():
    cases = []
    for n, R, B in [(10, 1, 3), (10, 1, 5), (9, 2, 2), (10, 3, 3), (7, 2, 4), (12, 3, 2)]:
        for mode in ("default", "drop_last", "pad"):
            if mode == "drop_last" and n < R * B:
                continue
            cases.append((n, R, B, mode))
    return cases


@pytest.mark.parametrize("n,R,B,mode", _sampler_cases())
def test_sampler_len_agrees_with_its_batches(n, R, B, mode):
    seen = []
    lens = set()
    for r in range(R):
        s = gl.GadgetSampler(
            n,
            batch_size=B,
            order="random",
            seed=3,
            num_replicas=R,
            rank=r,
            drop_last=(mode == "drop_last"),
            pad=(mode == "pad"),
        )
        assert (s.num_rows, s.batch_size, s.num_replicas, s.rank) == (n, B, R, r)
        assert s.drop_last == (mode == "drop_last") and s.pad == (mode == "pad")
        batches = [b.clone() for b in s]
        assert len(batches) == len(s), (r, len(batches), len(s))
        lens.add(len(s))
        for b in batches:
            assert b.dtype == torch.int64
        if mode == "default":
            assert len(s) == -(-(n // R) // B)
            assert all(1 <= len(b) <= B + 1 for b in batches)
        elif mode == "drop_last":
            assert len(s) == n // (R * B)
            assert all(len(b) == B for b in batches)
        else:
            assert len(s) == -(-n // (R * B))
            assert all(len(b) == B for b in batches)
        seen.extend(torch.cat(batches).tolist() if batches else [])
    assert len(lens) == 1, "every rank yields the same number of batches"
    if mode == "default":
        assert sorted(seen) == list(range(n))
    elif mode == "pad":
        assert set(seen) == set(range(n))


def test_sampler_repr_and_copies():
    ds, _, _ = _dataset()
    s = gl.GadgetSampler(ds, batch_size=3, order="random", seed=7, num_replicas=2, rank=1)
    r = repr(s)
    assert "GadgetSampler" in r and "10" in r and "3" in r
    assert s.order == "random" and s.seed == 7 and s.chunk_rows is None
    for f in (copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        c = f(s)
        assert (c.num_rows, c.batch_size, c.order, c.seed, c.num_replicas, c.rank) == (
            s.num_rows,
            s.batch_size,
            s.order,
            s.seed,
            s.num_replicas,
            s.rank,
        )
        assert c.state_dict() == s.state_dict()
        assert len(c) == len(s)
    # the copies yield the same batches, and iterating one leaves the other's state alone
    ref = [b.tolist() for b in copy.deepcopy(s)]
    before = s.state_dict()
    p = pickle.loads(pickle.dumps(s))
    assert [b.tolist() for b in p] == ref
    assert s.state_dict() == before


def test_loader_properties():
    ds, _, _ = _dataset()
    L = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert L.dataset is ds
    assert isinstance(L.sampler, gl.GadgetSampler) and L.sampler.batch_size == 4
    assert len(L) == len(L.sampler) == 3
    assert torch.device(L.device) == torch.device(ds.device)
    batches = list(L)
    assert len(batches) == len(L)
    assert all(isinstance(b, gl.GadgetBatch) for b in batches)
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_loader_repr_is_informative():
    ds, _, _ = _dataset()
    L = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    r = repr(L)
    assert "GadgetLoader" in r
    assert " object at 0x" not in r, f"default object repr: {r}"
    assert "4" in r, r  # the batch size (or the sampler's repr, which holds it)


def test_gadget_batch_surface():
    ds, x, y = _dataset()
    b = ds[[1, 4, 2]]
    assert isinstance(b, gl.GadgetBatch) and isinstance(b, tuple) and len(b) == 2
    assert "GadgetBatch" in repr(b)
    xb, yb = b
    assert xb.tolist() == x[[1, 4, 2]].tolist() and yb.tolist() == [1, 4, 2]
    for f in (lambda o: pickle.loads(pickle.dumps(o)), copy.deepcopy):
        c = f(b)
        assert isinstance(c, gl.GadgetBatch)
        assert all(torch.equal(u, v) for u, v in zip(c, b, strict=False))
        c[0].add_(100)
        assert xb.tolist() == x[[1, 4, 2]].tolist()
    moved = b.to("cpu")
    assert isinstance(moved, gl.GadgetBatch) and all(
        torch.equal(u, v) for u, v in zip(moved, b, strict=False)
    )
    with pytest.raises(gl.GadgetTypeError):
        b.to(torch.float16)
    with pytest.raises(TypeError, match="bogus"):
        b.to("cpu", bogus=True)


# ============================================================================ modules


def test_offloaded_embedding_properties_and_repr():
    e = gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu", dtype=torch.float64)
    assert (e.num_embeddings, e.embedding_dim) == (10, 4)
    assert isinstance(e.weight, gl.DataGadget)
    assert e.weight.shape == (10, 4) and e.weight.dtype == torch.float64
    assert e.weight.nbytes == 10 * 4 * 8 and e.placement == e.weight.placement == "cpu"
    out = e(torch.tensor([[1, 2, 1]]))
    assert out.shape == (1, 3, 4) and out.dtype == torch.float64
    sd = e.state_dict()
    assert list(sd) == ["weight"]
    assert tuple(sd["weight"].shape) == (10, 4) and sd["weight"].dtype == torch.float64
    np.testing.assert_array_equal(sd["weight"].numpy(), _np(e.weight))
    r = repr(e)
    assert "OffloadedEmbedding" in r and "10" in r and "4" in r and "float64" in r
    assert e.weight.requires_grad is True
    e.requires_grad_(False)
    assert e.weight.requires_grad is False
    e.requires_grad_(True)
    h = gl.OffloadedEmbedding(6, 3, placement="cpu", device="cpu").half()
    assert h.weight.dtype == torch.float32 and h(torch.tensor([0])).dtype == torch.float16
    bag = gl.OffloadedEmbeddingBag(10, 4, mode="max", placement="cpu", device="cpu")
    assert "OffloadedEmbeddingBag" in repr(bag) and "max" in repr(bag)
    assert bag.weight.shape == (10, 4) and (bag.num_embeddings, bag.embedding_dim) == (10, 4)


def test_offloaded_embedding_copies_and_state_dict_roundtrip():
    e = gl.OffloadedEmbedding(8, 3, placement="cpu", device="cpu")
    ref = _np(e.weight).copy()
    for f in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        c = f(e)
        assert c.weight is not e.weight and (c.num_embeddings, c.embedding_dim) == (8, 3)
        np.testing.assert_array_equal(_np(c.weight), ref)
        c.weight.insertData(torch.full((1, 3), 7.0), [0])
        np.testing.assert_array_equal(_np(e.weight), ref)
    buf = io.BytesIO()
    torch.save(e.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    fresh = gl.OffloadedEmbedding(8, 3, placement="cpu", device="cpu")
    fresh.load_state_dict(sd)
    np.testing.assert_array_equal(_np(fresh.weight), ref)


def test_deepcopied_model_is_a_separate_table_from_the_trained_one():
    torch.manual_seed(0)
    m = torch.nn.ModuleDict(
        {
            "e": gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu"),
            "h": torch.nn.Linear(4, 1),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    before = _np(m["e"].weight).copy()
    d = copy.deepcopy(m)
    np.testing.assert_array_equal(_np(d["e"].weight), before)
    loss = m["h"](m["e"](torch.tensor([1, 2]))).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert not np.array_equal(_np(m["e"].weight), before)
    np.testing.assert_array_equal(_np(d["e"].weight), before)


def test_offloaded_optimizer_copy_and_pickle_are_refused_naming_the_alternative():
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(10, 4, placement="cpu", device="cpu")})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    r = repr(opt)
    assert "OffloadedOptimizer" in r and "Adam" in r
    for f in (copy.copy, copy.deepcopy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(gl.GadgetTypeError) as ei:
            f(opt)
        msg = str(ei.value)
        assert "state_dict" in msg and "save_checkpoint" in msg, msg


def _switchers():
    out = []
    out.append(gl.ModelFactory(torch.nn.Embedding(3, 4), 20, 4, placement="cpu"))
    out.append(gl.ModelSwitch(torch.nn.Embedding(3, 4), 20, 4, placement="cpu"))
    out.append(gl.PytorchModelFactory(torch.nn.Embedding(3, 4), 20, 4, deviceType="cpu"))
    return out


def test_model_switcher_properties_and_repr():
    for sw in _switchers():
        name = type(sw).__name__
        assert (sw.total_classes, sw.embed_dimension) == (20, 4), name
        assert isinstance(sw.table, gl.DataGadget) and sw.table.shape == (20, 4), name
        a = sw.getNumpyVersion()
        assert a.shape == (20, 4) and a.dtype == np.float32, name
        r = repr(sw)
        assert name in r and "20" in r and "4" in r and "float32" in r, r


def test_optimizer_switcher_properties_and_repr():
    model = torch.nn.Module()
    model.u = torch.nn.Embedding(3, 4)
    _msw = gl.ModelFactory(model.u, 20, 4, placement="cpu")
    _opt = torch.optim.Adam(model.parameters(), lr=0.1)
    of = gl.OptimizerFactory(_opt, 20, 4, model, "u", placement="cpu")
    r0 = repr(of)
    assert "OptimizerFactory" in r0 and "Adam" in r0
    of.optInit()
    r1 = repr(of)
    assert "OptimizerFactory" in r1 and "exp_avg" in r1
    assert (of.total_classes, of.embed_dimension, of.variable_name) == (20, 4, "u")
    assert set(of.tables) == {"exp_avg", "exp_avg_sq"}
    for k, t in of.tables.items():
        assert t.shape == (20, 4) and t.dtype == torch.float32, k
    nv = of.getNumpyVersion()
    assert set(nv) == set(of.tables) and all(v.shape == (20, 4) for v in nv.values())


def test_model_switcher_copies_are_equal_and_independent():
    for sw in _switchers():
        sw.uniformDistributionInit(-1.0, 1.0)
        ref = sw.getNumpyVersion().copy()
        for f in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
            c = f(sw)
            assert type(c) is type(sw)
            np.testing.assert_array_equal(c.getNumpyVersion(), ref)
            c.zerosInit()
            np.testing.assert_array_equal(sw.getNumpyVersion(), ref)


# ============================================================================ errors


_BUILTIN_BASE = {
    "GadgetIndexError": IndexError,
    "GadgetTypeError": TypeError,
    "GadgetValueError": ValueError,
    "GadgetKeyError": KeyError,
    "GadgetFileError": OSError,
    "GadgetFileNotFoundError": FileNotFoundError,
    "ReadOnlyError": PermissionError,
    "MissingDependencyError": ImportError,
}


def test_error_hierarchy_matches_the_readme():
    for name in _EXCEPTIONS:
        cls = getattr(gl, name)
        if name == "FallbackWarning":
            assert issubclass(cls, Warning)
            continue
        assert issubclass(cls, gl.GadgetError), name
        if name in _BUILTIN_BASE:
            assert issubclass(cls, _BUILTIN_BASE[name]), name
    assert issubclass(gl.GadgetFileNotFoundError, gl.GadgetFileError)


def _raised(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001
        return e
    pytest.fail("expected an error")


def test_raised_errors_pickle_with_their_type_and_message(tmp_path):
    g = _table(np.zeros((3, 2), np.float32))
    closed = _table(np.zeros((3, 2), np.float32))
    closed.close()
    errs = [
        _raised(
            lambda: gl.DataGadget(str(tmp_path / "missing.npy"), placement="cpu", device="cpu")
        ),
        _raised(lambda: _table(np.zeros((2, 2), np.float32), placement="bogus")),
        _raised(lambda: g.getData([5])),
        _raised(lambda: g.getData([0.5])),
        _raised(lambda: g.insertData(torch.zeros(2, 2), [0])),
        _raised(lambda: closed.getData([0])),
    ]
    for e in errs:
        assert isinstance(e, gl.GadgetError), e
        r = pickle.loads(pickle.dumps(e))
        assert type(r) is type(e) and str(r) == str(e)


def test_file_not_found_error_carries_errno_and_filename(tmp_path):
    # it is "also a FileNotFoundError": code written for OSError checks errno / filename
    missing = tmp_path / "missing.npy"
    e = _raised(lambda: gl.DataGadget(str(missing), placement="cpu", device="cpu"))
    assert isinstance(e, gl.GadgetFileNotFoundError) and isinstance(e, FileNotFoundError)
    assert "missing.npy" in str(e)
    assert e.errno == errno.ENOENT, f"errno is {e.errno!r}"
    assert e.filename is not None and "missing.npy" in str(e.filename), (
        f"filename is {e.filename!r}"
    )


# ============================================================================ unknown keywords


def _kw_cases(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    path = tmp_path / "k.npy"
    np.save(path, a)
    g = _table(a)
    ds = gl.GadgetDataset(a, placement="cpu", device="cpu")
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(5, 3, placement="cpu", device="cpu")})
    emb = torch.nn.Embedding(3, 3)
    sw = gl.ModelFactory(emb, 20, 3, placement="cpu")
    return (
        g,
        a,
        [
            ("DataGadget(array, bogus=)", lambda: _table(a, bogus=1), "bogus"),
            ("DataGadget(array, cpuPinn=)", lambda: _table(a, cpuPinn=True), "cpuPinn"),
            (
                "DataGadget(path, file, cache_byte=)",
                lambda: gl.DataGadget(str(path), placement="file", device="cpu", cache_byte=10),
                "cache_byte",
            ),
            ("DataGadget(path, cpu, bogus=)", lambda: _table(str(path), bogus=1), "bogus"),
            (
                "DataGadget.zeros(bogus=)",
                lambda: gl.DataGadget.zeros((2, 2), placement="cpu", bogus=1),
                "bogus",
            ),
            (
                "GadgetDataset(bogus=)",
                lambda: gl.GadgetDataset(a, placement="cpu", device="cpu", bogus=1),
                "bogus",
            ),
            ("GadgetSampler(bogus=)", lambda: gl.GadgetSampler(ds, batch_size=2, bogus=1), "bogus"),
            ("GadgetLoader(bogus=)", lambda: gl.GadgetLoader(ds, batch_size=2, bogus=1), "bogus"),
            (
                "OffloadedEmbedding(padding_idx=)",
                lambda: gl.OffloadedEmbedding(5, 3, placement="cpu", padding_idx=0),
                "padding_idx",
            ),
            (
                "OffloadedEmbeddingBag(bogus=)",
                lambda: gl.OffloadedEmbeddingBag(5, 3, placement="cpu", bogus=1),
                "bogus",
            ),
            (
                "OffloadedOptimizer(learning_rate=)",
                lambda: gl.OffloadedOptimizer(torch.optim.Adam, m, learning_rate=0.1),
                "learning_rate",
            ),
            (
                "ModelFactory(cpuPinn=)",
                lambda: gl.ModelFactory(emb, 20, 3, cpuPinn=True),
                "cpuPinn",
            ),
            ("getData(bogus=)", lambda: g.getData([0], bogus=1), "bogus"),
            ("insertData(bogus=)", lambda: g.insertData(torch.zeros(1, 3), [0], bogus=1), "bogus"),
            ("init_(fn, bogus=)", lambda: g.init_(torch.nn.init.zeros_, bogus=1), "bogus"),
            ("save(bogus=)", lambda: g.save(str(tmp_path / "o.npy"), bogus=1), "bogus"),
            ("gather_many(bogus=)", lambda: gl.gather_many([g], [0], bogus=1), "bogus"),
            (
                "scatter_many(bogus=)",
                lambda: gl.scatter_many([g], [torch.zeros(1, 3)], [0], bogus=1),
                "bogus",
            ),
            (
                "save_checkpoint(bogus=)",
                lambda: gl.save_checkpoint(str(tmp_path / "ck"), {"m": m}, bogus=1),
                "bogus",
            ),
            (
                "load_checkpoint(bogus=)",
                lambda: gl.load_checkpoint(str(tmp_path / "ck"), {"m": m}, bogus=1),
                "bogus",
            ),
            (
                "customInit(fn, bogus=)",
                lambda: sw.customInit(torch.nn.init.zeros_, bogus=1),
                "bogus",
            ),
            ("cuda_available(bogus=)", lambda: gl.cuda_available(bogus=1), "bogus"),
        ],
    )


def test_unknown_keywords_are_type_errors_naming_them(tmp_path):
    g, a, cases = _kw_cases(tmp_path)
    problems = []
    for label, call, kw in cases:
        try:
            call()
        except TypeError as e:
            if kw not in str(e):
                problems.append(f"{label}: TypeError does not name {kw!r}: {e}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"{label}: {type(e).__name__} instead of TypeError: {e}")
        else:
            problems.append(f"{label}: accepted silently")
    assert not problems, "\n".join(problems)
    # refused calls wrote nothing and made no file
    np.testing.assert_array_equal(_np(g), a)
    assert not (tmp_path / "o.npy").exists()
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
