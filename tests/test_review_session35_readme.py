"""Session 35 review: README.md's code examples and concrete claims, run as tests.

Written from README.md, SPEC.md and the public docstrings only. Every snippet of the README
runs as written, adapted to the CPU only (``placement="cpu"`` / ``device="cpu"``, tiny
sizes, files under ``tmp_path``); every test checks a value against NumPy or plain torch, an
error class the README names, the files a call leaves behind or a CLI exit status.

The placement and the device are given explicitly everywhere, so the tests take the same
paths on a CUDA machine; the few claims about a machine without CUDA (fallback warnings,
silent ``cpu`` defaults) skip where CUDA is present. Subprocesses see no GPU.
"""

from __future__ import annotations

import copy
import errno
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, random_split

import gadgetloader as gl
from gadgetloader import cli

REPO = Path(__file__).resolve().parents[1]
F = torch.nn.functional
CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
NO_CUDA_ONLY = pytest.mark.skipif(HAS_CUDA, reason="a claim about machines without CUDA")


# ----------------------------------------------------------------------------- helpers


def _h5py():
    return pytest.importorskip("h5py")


def _zarr():
    return pytest.importorskip("zarr")


def _g(data, **kw) -> gl.DataGadget:
    kw.setdefault("placement", "cpu")
    kw.setdefault("device", "cpu")
    return gl.DataGadget(data, **kw)


def _rows(g: gl.DataGadget) -> np.ndarray:
    return g.getNumpyVersion(copy=True)


def _env() -> dict[str, str]:
    env = os.environ.copy()
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _run(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=str(cwd or REPO),
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``gadgetloader ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's exits
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return int(rc or 0), out, err


def _arr(n=10, d=4, dtype=np.float32) -> np.ndarray:
    return np.arange(n * d, dtype=dtype).reshape(n, d)


def _listing(p: Path) -> list[str]:
    return sorted(x.name for x in p.iterdir())


# ----------------------------------------------------------------------------- Install and try


def test_cli_version_prints_package_version():
    r = _run("-m", "gadgetloader", "--version")
    assert r.returncode == 0, r.stderr
    assert gl.__version__ in r.stdout + r.stderr


def test_cli_info_reports_versions_exit_0(capsys):
    rc, out, err = _cli(["info"], capsys)
    assert rc == 0, err
    assert gl.__version__ in out
    assert torch.__version__.split("+")[0] in out


@NO_CUDA_ONLY
def test_gpu_placement_falls_back_to_cpu_with_one_warning_per_process():
    a = _arr()
    with pytest.warns(gl.FallbackWarning) as rec:
        g1 = gl.DataGadget(a, placement="cuda")
        g2 = gl.DataGadget(a, placement="pinned")
        rows = g1.getData([1, 2], device="cuda")
    assert len([w for w in rec if issubclass(w.category, gl.FallbackWarning)]) == 1
    assert g1.placement == "cpu" and g2.placement == "cpu"
    assert rows.device.type == "cpu"
    np.testing.assert_array_equal(rows.numpy(), a[[1, 2]])


@NO_CUDA_ONLY
def test_without_placement_cpupinn_and_default_fall_back_to_cpu_with_warning():
    with pytest.warns(gl.FallbackWarning):
        g = gl.DataGadget((4, 3), dtype="float32", CPUPinn=True)
    assert g.placement == "cpu" and g.shape == (4, 3)


@NO_CUDA_ONLY
def test_dataset_and_module_defaults_pick_cpu_silently(recwarn):
    ds = gl.GadgetDataset(_arr(), np.arange(10))
    emb = gl.OffloadedEmbedding(10, 4)
    bag = gl.OffloadedEmbeddingBag(10, 4, mode="sum")
    sw = gl.ModelSwitch(torch.nn.Embedding(3, 4), 10, 4)
    assert not [w for w in recwarn if issubclass(w.category, gl.FallbackWarning)]
    assert emb.weight.placement == "cpu" and bag.weight.placement == "cpu"
    x, y = ds[[0, 3]]
    assert x.device.type == "cpu"
    np.testing.assert_array_equal(y.cpu().numpy(), [0, 3])
    assert sw is not None


@pytest.mark.parametrize("bad", ["False", "True", 2, None])
def test_cpupinn_takes_bools_or_0_1_only(bad):
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(_arr(), bad, placement="cpu")


@pytest.mark.parametrize("ok", [0, 1, False, True])
def test_cpupinn_accepts_0_1(ok):
    g = gl.DataGadget(_arr(), ok, placement="cpu", device="cpu")
    np.testing.assert_array_equal(_rows(g), _arr())


def test_check_ids_and_getnumpy_copy_flags_refuse_strings():
    g = _g(_arr())
    before = _rows(g)
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1], check_ids="False")
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(np.zeros((1, 4), np.float32), [1], check_ids="False")
    with pytest.raises(gl.GadgetTypeError):
        g.getNumpyVersion(copy="False")
    np.testing.assert_array_equal(_rows(g), before)


# ----------------------------------------------------------------------------- Rows in and out


def test_rows_in_and_out_snippet(tmp_path):
    rng = np.random.default_rng(0)
    src = rng.standard_normal((64, 8)).astype(np.float32)
    path = tmp_path / "embeddings.npy"
    np.save(path, src)
    table = gl.DataGadget(str(path), True, placement="cpu", device="cpu")
    ids = torch.randint(0, len(table), (4096,))
    rows = table.getData(ids, device="cpu")
    assert rows.shape == (4096, 8) and rows.dtype == torch.float32
    np.testing.assert_array_equal(rows.numpy(), src[ids.numpy()])
    table.insertData(rows * 0.5, ids)
    ref = src.copy()
    ref[ids.numpy()] = src[ids.numpy()] * np.float32(0.5)
    np.testing.assert_array_equal(_rows(table), ref)
    table.saveCupy(str(path))
    np.testing.assert_array_equal(np.load(path), ref)
    assert _listing(tmp_path) == ["embeddings.npy"]  # streamed, atomic: nothing left beside


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([3, 1, 3]),
        np.array([3, 1, 3]),
        [3, 1, 3],
        range(2, 5),
    ],
    ids=["torch", "numpy", "list", "range"],
)
def test_id_kinds(ids):
    a = _arr()
    got = _g(a).getData(ids, device="cpu")
    np.testing.assert_array_equal(
        got.numpy(), a[np.asarray(list(ids) if isinstance(ids, range) else ids)]
    )


def test_repeated_ids_in_insert_last_occurrence_wins():
    a = _arr()
    g = _g(a)
    vals = np.stack([np.full(4, v, np.float32) for v in (10, 20, 30, 40)])
    g.insertData(vals, [2, 5, 2, 2])
    ref = a.copy()
    ref[[2, 5, 2, 2]] = vals  # NumPy's sequential assignment
    np.testing.assert_array_equal(_rows(g), ref)
    assert ref[2, 0] == 40


@pytest.mark.parametrize(
    "source",
    ["numpy", "tensor", "list", "tuple_shape"],
)
def test_sources_array_tensor_list_shape(source):
    a = _arr(5, 3)
    if source == "numpy":
        g = _g(a)
    elif source == "tensor":
        g = _g(torch.from_numpy(a))
    elif source == "list":
        g = _g(a.tolist(), dtype="float32")
    else:
        g = _g((5, 3), dtype="float32")
        assert g.shape == (5, 3) and g.dtype == torch.float32
        return
    np.testing.assert_array_equal(_rows(g), a)


def test_tuple_shape_example_dtype_and_shape():
    g = _g((7, 5), dtype="float32")
    assert g.shape == (7, 5) and len(g) == 7 and g.dtype == torch.float32
    assert g.nbytes == 7 * 5 * 4


def test_data_is_copied_in_and_detached():
    a = _arr()
    t = torch.from_numpy(a.copy()).requires_grad_(True)
    g1 = _g(a)
    g2 = _g(t)
    a[:] = -1
    with torch.no_grad():
        t.fill_(-1)
    np.testing.assert_array_equal(_rows(g1), _arr())
    np.testing.assert_array_equal(_rows(g2), _arr())
    assert not g2.as_tensor().requires_grad


def test_insert_float64_into_float32_is_an_error_that_says_so():
    g = _g(_arr())
    with pytest.raises(gl.GadgetTypeError, match="float64|double"):
        g.insertData(np.ones((2, 4), np.float64), [0, 1])
    np.testing.assert_array_equal(_rows(g), _arr())


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
        (np.dtype("int16"), torch.int16),
        (torch.bfloat16, torch.bfloat16),
        ("float64", torch.float64),
    ],
)
def test_dtype_names(name, expected):
    g = _g((3, 2), dtype=name)
    assert g.dtype == expected
    assert isinstance(g.dtype, torch.dtype)


def test_slice_tuple_index_is_numpy_style():
    a = _arr(10, 5)
    g = _g(a)
    np.testing.assert_array_equal(
        g.getData((slice(0, 6), slice(0, 3)), device="cpu").numpy(), a[0:6, 0:3]
    )
    np.testing.assert_array_equal(g[2:5].cpu().numpy(), a[2:5])
    np.testing.assert_array_equal(g[[1, 2], 0].cpu().numpy(), a[[1, 2], 0])
    np.testing.assert_array_equal(g[[1, 2], -1].cpu().numpy(), a[[1, 2], -1])
    ids = torch.tensor([4, 0])
    np.testing.assert_array_equal(g[ids, 0:3].cpu().numpy(), a[[4, 0], 0:3])


def test_insert_with_tuple_index_writes_only_that_part():
    a = _arr(10, 5)
    g = _g(a)
    part = -np.ones((6, 3), np.float32)
    g.insertData(part, (slice(0, 6), slice(0, 3)))
    ref = a.copy()
    ref[0:6, 0:3] = part
    np.testing.assert_array_equal(_rows(g), ref)
    g[[1, 2], 0] = np.array([100, 200], np.float32)
    ref[[1, 2], 0] = [100, 200]
    np.testing.assert_array_equal(_rows(g), ref)
    g[2:5] = np.zeros((3, 5), np.float32)
    ref[2:5] = 0
    np.testing.assert_array_equal(_rows(g), ref)


def test_tuple_of_ints_stays_ids_and_single_list_in_tuple_is_rows():
    a = _arr(10, 5)
    g = _g(a)
    np.testing.assert_array_equal(g.getData((1, 2), device="cpu").numpy(), a[[1, 2]])
    np.testing.assert_array_equal(g[([1, 2],)].cpu().numpy(), a[[1, 2]])


def test_tuple_of_id_lists_is_refused():
    g = _g(_arr(10, 5))
    with pytest.raises(gl.GadgetError):
        g[[1, 2], [0, 1]]


def test_negative_row_ids_refused_but_negative_column_allowed():
    a = _arr(10, 5)
    g = _g(a)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([-1], device="cpu")
    with pytest.raises(gl.GadgetIndexError):
        g[[-1, 2], 0]
    np.testing.assert_array_equal(g[[3], -2].cpu().numpy(), a[[3], -2])


def test_row_slices_clip_like_python_and_need_positive_step():
    a = _arr(10, 5)
    g = _g(a)
    np.testing.assert_array_equal(g[[1, 2], 2:1000].cpu().numpy(), a[[1, 2], 2:1000])
    np.testing.assert_array_equal(g[[1, 2], -1000:2].cpu().numpy(), a[[1, 2], -1000:2])
    np.testing.assert_array_equal(g[[1, 2], ::2].cpu().numpy(), a[[1, 2], ::2])
    with pytest.raises(gl.GadgetError):
        g[[1, 2], ::-1]
    with pytest.raises(gl.GadgetError):
        g[[1, 2], 0.5:3]


@pytest.mark.parametrize("idx", [Ellipsis, None, ([1, 2], Ellipsis), ([1, 2], None)])
def test_ellipsis_and_none_are_not_indexes(idx):
    g = _g(_arr())
    with pytest.raises(gl.GadgetTypeError):
        g[idx]


@pytest.mark.parametrize(
    "value",
    [
        np.float32(1.0),
        1.0,
        np.ones((4,), np.float32),
        np.ones((2, 4, 1), np.float32),
        np.ones((3, 4), np.float32),
    ],
    ids=["np-scalar", "py-scalar", "row-broadcast", "extra-dim", "wrong-count"],
)
def test_written_rows_are_not_broadcast(value):
    g = _g(_arr())
    with pytest.raises(gl.GadgetError):
        g.insertData(value, [0, 1])
    with pytest.raises(gl.GadgetError):
        g[[0, 1]] = value
    np.testing.assert_array_equal(_rows(g), _arr())


def test_list_rows_are_read_as_numpy_reads_them():
    g32 = _g(_arr())
    with pytest.raises(gl.GadgetTypeError):
        g32.insertData([[1.0, 2.0, 3.0, 4.0]], [0])  # a float64 list into float32
    np.testing.assert_array_equal(_rows(g32), _arr())
    g64 = _g(_arr(dtype=np.float64))
    g64.insertData([[1.0, 2.0, 3.0, 4.0]], [0])
    np.testing.assert_array_equal(_rows(g64)[0], [1, 2, 3, 4])


def test_getnumpy_copy_and_view():
    g = _g(_arr())
    c = g.getNumpyVersion(copy=True)
    c[:] = -5
    np.testing.assert_array_equal(_rows(g), _arr())
    v = g.getNumpyVersion(copy=False)
    v[0, 0] = 99
    assert g.getData([0], device="cpu")[0, 0].item() == 99


def test_getnumpy_bfloat16_copy_false_copies():
    g = _g((3, 2), dtype=torch.bfloat16)
    g.fill_(1.5)
    v = g.getNumpyVersion(copy=False)
    v[...] = 0
    assert torch.equal(
        g.getData([0, 1, 2], device="cpu"), torch.full((3, 2), 1.5, dtype=torch.bfloat16)
    )


def test_array_protocol_copy_and_view():
    g = _g(_arr())
    a = np.asarray(g)
    np.testing.assert_array_equal(a, _arr())
    a[:] = 0
    np.testing.assert_array_equal(_rows(g), _arr())
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        v = np.asarray(g, copy=False)
        v[1, 1] = -7
        assert _rows(g)[1, 1] == -7


def test_array_protocol_copy_false_on_file_table_raises_value_error(tmp_path):
    if np.lib.NumpyVersion(np.__version__) < "2.0.0":
        pytest.skip("numpy < 2 has no copy= in asarray")
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    np.testing.assert_array_equal(np.asarray(g), _arr())
    with pytest.raises(gl.GadgetValueError) as ei:
        np.asarray(g, copy=False)
    assert isinstance(ei.value, ValueError)
    g.close()


def test_as_tensor_is_a_zero_copy_view_until_load(tmp_path):
    g = _g(_arr())
    t = g.as_tensor()
    t[0, 0] = 123
    assert g.getData([0], device="cpu")[0, 0].item() == 123
    p = tmp_path / "x.npy"
    np.save(p, np.zeros((10, 4), np.float32))
    g.load(str(p))
    t[1, 1] = 555  # the old view no longer reaches the table
    assert _rows(g)[1, 1] == 0
    t2 = g.as_tensor()
    t2[1, 1] = 7
    assert _rows(g)[1, 1] == 7


def test_as_tensor_on_file_table_is_type_error(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.as_tensor()
    g.close()


def test_zero_and_fill_values():
    g = _g(_arr())
    g.zero_()
    np.testing.assert_array_equal(_rows(g), 0)
    g.fill_(2.5)
    np.testing.assert_array_equal(_rows(g), 2.5)
    g.fill_(torch.tensor(3.0))
    np.testing.assert_array_equal(_rows(g), 3.0)
    g.fill_(np.array([4.0]))
    np.testing.assert_array_equal(_rows(g), 4.0)
    g.fill_(float("inf"))
    assert np.isposinf(_rows(g)).all()
    g.fill_(float("nan"))
    assert np.isnan(_rows(g)).all()


def test_fill_integer_tables():
    g = _g((3, 2), dtype="int16")
    g.fill_(3.0)  # an integral float
    np.testing.assert_array_equal(_rows(g), 3)
    before = _rows(g)
    for bad in (3.5, 40000, -40000, float("nan"), float("inf")):
        with pytest.raises(gl.GadgetError):
            g.fill_(bad)
    np.testing.assert_array_equal(_rows(g), before)
    u = _g((2, 2), dtype="uint8")
    with pytest.raises(gl.GadgetError):
        u.fill_(256)
    with pytest.raises(gl.GadgetError):
        u.fill_(-1)
    u.fill_(255)
    np.testing.assert_array_equal(_rows(u), 255)


def test_fill_bool_table():
    g = _g((2, 2), dtype=bool)
    g.fill_(True)
    assert _rows(g).all()
    g.fill_(0)
    assert not _rows(g).any()
    g.fill_(1.0)
    assert _rows(g).all()
    for bad in (2, 0.5, -1):
        with pytest.raises(gl.GadgetError):
            g.fill_(bad)
    assert _rows(g).all()


def test_fill_float16_out_of_finite_range_and_multi_element_refused():
    g = _g((2, 2), dtype="float16")
    g.fill_(65504.0)
    np.testing.assert_array_equal(_rows(g), np.float16(65504))
    for bad in (1e6, -1e6, np.ones(2, np.float16), torch.ones(2)):
        with pytest.raises(gl.GadgetError):
            g.fill_(bad)
    np.testing.assert_array_equal(_rows(g), np.float16(65504))


def test_uniform_and_normal_ranges():
    torch.manual_seed(0)
    g = _g((2000, 4), dtype="float32")
    g.uniform_(-0.5, 0.25)
    r = _rows(g)
    assert r.min() >= -0.5 and r.max() <= 0.25 and r.std() > 0.1
    g.uniform_(torch.tensor(1.0), torch.tensor(2.0))
    r = _rows(g)
    assert r.min() >= 1.0 and r.max() <= 2.0
    g.normal_(3.0, 0.5)
    r = _rows(g)
    assert abs(r.mean() - 3.0) < 0.05 and abs(r.std() - 0.5) < 0.05
    g.normal_(1.0, 0.0)
    np.testing.assert_array_equal(_rows(g), 1.0)


@pytest.mark.parametrize(
    ("dtype", "call"),
    [
        ("float32", ("normal_", 0.0, -1.0)),
        ("float32", ("uniform_", 0.0, float("inf"))),
        ("float32", ("normal_", float("nan"), 1.0)),
        ("float16", ("uniform_", -60000.0, 60000.0)),  # high - low beyond float16
        ("float16", ("normal_", 1e6, 1.0)),
    ],
)
def test_random_initialiser_bad_arguments_refused(dtype, call):
    g = _g((4, 2), dtype=dtype)
    g.fill_(1.0)
    with pytest.raises(gl.GadgetError):
        getattr(g, call[0])(*call[1:])
    np.testing.assert_array_equal(_rows(g), 1.0)


def test_init_with_torch_initialiser_and_gadget_init():
    torch.manual_seed(0)
    g = _g((50, 20), dtype="float32")
    g.init_(torch.nn.init.xavier_uniform_)
    bound = (6.0 / (50 + 20)) ** 0.5
    r = _rows(g)
    assert np.abs(r).max() <= bound + 1e-6 and r.std() > bound / 4
    g2 = _g(_arr())
    g2.gadgetInit()  # SpeedTorch's name is accepted
    with pytest.raises(gl.GadgetTypeError):
        g2.init_(5)


def test_file_table_takes_only_elementwise_initialisers(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, np.zeros((8, 4), np.float32))
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    g.init_(torch.nn.init.constant_, 2.0)
    np.testing.assert_array_equal(np.load(p), 2.0)
    with pytest.raises(gl.GadgetTypeError):
        g.init_(torch.nn.init.orthogonal_)
    np.testing.assert_array_equal(np.load(p), 2.0)
    g.close()


def test_close_and_with_block():
    with _g(_arr()) as g:
        np.testing.assert_array_equal(g.getData([1], device="cpu").numpy(), _arr()[[1]])
    for call in (
        lambda: g.getData([0], device="cpu"),
        lambda: g.insertData(np.zeros((1, 4), np.float32), [0]),
        lambda: g.load("x.npy"),
        lambda: g.flush(),
        lambda: g.getNumpyVersion(),
        lambda: g[0],
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert g.shape == (10, 4) and g.dtype == torch.float32 and len(g) == 10
    assert "DataGadget" in repr(g)


# ----------------------------------------------------------------------------- rules on every placement


@pytest.mark.parametrize("idt", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_ids_of_any_integer_dtype_and_shape(idt):
    a = _arr(10, 3)
    ids = torch.tensor([[1, 2, 3], [9, 0, 9]], dtype=idt)
    got = _g(a).getData(ids, device="cpu")
    assert got.shape == (2, 3, 3)
    np.testing.assert_array_equal(got.numpy(), a[ids.long().numpy()])


@pytest.mark.parametrize(
    ("ids", "err", "builtin"),
    [
        ([10], gl.GadgetIndexError, IndexError),
        ([-1], gl.GadgetIndexError, IndexError),
        ([1.0], gl.GadgetTypeError, TypeError),
        (torch.tensor([1.0]), gl.GadgetTypeError, TypeError),
        (["1"], gl.GadgetTypeError, TypeError),
        ([True], gl.GadgetTypeError, TypeError),
    ],
)
def test_bad_ids_raise_gadget_errors_before_writing(ids, err, builtin):
    g = _g(_arr())
    with pytest.raises(err) as ei:
        g.getData(ids, device="cpu")
    assert isinstance(ei.value, builtin) and isinstance(ei.value, gl.GadgetError)
    n = len(ids)
    with pytest.raises(err):
        g.insertData(np.zeros((n, 4), np.float32), ids)
    np.testing.assert_array_equal(_rows(g), _arr())


def test_one_bad_id_among_good_ones_writes_nothing():
    g = _g(_arr())
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(np.zeros((3, 4), np.float32), [0, 1, 10])
    with pytest.raises(gl.GadgetValueError):
        g.insertData(np.zeros((3, 5), np.float32), [0, 1, 2])
    np.testing.assert_array_equal(_rows(g), _arr())


def test_out_of_range_error_says_expected_and_arrived():
    g = _g(_arr())
    with pytest.raises(gl.GadgetIndexError) as ei:
        g.getData([3, 12], device="cpu")
    msg = str(ei.value)
    assert "12" in msg and "10" in msg


def test_bool_ids_point_to_nonzero_and_uint8_is_ids():
    a = _arr()
    g = _g(a)
    with pytest.raises(gl.GadgetTypeError, match="nonzero"):
        g.getData(torch.tensor([True, False] * 5), device="cpu")
    got = g.getData(torch.tensor([1, 3], dtype=torch.uint8), device="cpu")
    np.testing.assert_array_equal(got.numpy(), a[[1, 3]])


def test_check_ids_false_and_out_tensor():
    a = _arr()
    g = _g(a)
    out = torch.empty((3, 4))
    got = g.getData([5, 1, 5], device="cpu", out=out, check_ids=False)
    np.testing.assert_array_equal(out.numpy(), a[[5, 1, 5]])
    assert got.data_ptr() == out.data_ptr()


def test_slice_of_rows_follows_python():
    a = _arr()
    g = _g(a)
    np.testing.assert_array_equal(g[-2:].cpu().numpy(), a[-2:])
    np.testing.assert_array_equal(g.getData(slice(3, 100), device="cpu").numpy(), a[3:])


# ----------------------------------------------------------------------------- gather_many / scatter_many


def test_gather_many_and_scatter_many():
    a, m, v = _arr(), _arr() + 100, _arr() * 2
    ga, gm, gv = _g(a), _g(m), _g(v)
    ids = torch.tensor([4, 2, 4])
    got = gl.gather_many([ga, gm, gv], ids, device="cpu")
    assert len(got) == 3
    for t, ref in zip(got, (a, m, v), strict=True):
        np.testing.assert_array_equal(t.cpu().numpy(), ref[[4, 2, 4]])
    rows = [torch.full((2, 4), float(k)) for k in (1, 2, 3)]
    gl.scatter_many([ga, gm, gv], rows, torch.tensor([0, 9]))
    for g, ref, k in zip((ga, gm, gv), (a, m, v), (1, 2, 3), strict=True):
        exp = ref.copy()
        exp[[0, 9]] = k
        np.testing.assert_array_equal(_rows(g), exp)


def test_scatter_many_bad_id_writes_no_table():
    ga, gm = _g(_arr()), _g(_arr() + 1)
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many([ga, gm], [torch.zeros(2, 4), torch.zeros(2, 4)], [1, 10])
    np.testing.assert_array_equal(_rows(ga), _arr())
    np.testing.assert_array_equal(_rows(gm), _arr() + 1)


# ----------------------------------------------------------------------------- Files


def test_files_snippet_npy_h5_zarr(tmp_path):
    h5py = _h5py()
    zarr = _zarr()
    a = _arr(12, 3)
    np.save(tmp_path / "emb.npy", a)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("emb/words", data=a + 1)
        f.create_dataset("other", data=np.zeros((2, 2)))
    z = zarr.open_array(str(tmp_path / "emb.zarr"), mode="w", shape=a.shape, dtype="float32")
    z[:] = a + 2
    g = gl.DataGadget(str(tmp_path / "emb.npy"), CPUPinn=True, placement="cpu", device="cpu")
    np.testing.assert_array_equal(_rows(g), a)
    g = gl.DataGadget(str(tmp_path / "data.h5"), dataset="emb/words", placement="cpu", device="cpu")
    np.testing.assert_array_equal(_rows(g), a + 1)
    g = gl.DataGadget(str(tmp_path / "emb.zarr"), placement="cpu", device="cpu")
    np.testing.assert_array_equal(_rows(g), a + 2)


def test_hdf5_wrong_dataset_name_lists_existing(tmp_path):
    h5py = _h5py()
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("alpha", data=np.zeros((3, 2), np.float32))
        f.create_dataset("beta", data=np.ones((3, 2), np.float32))
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(str(tmp_path / "d.h5"), dataset="gamma", placement="cpu")
    assert "alpha" in str(ei.value) and "beta" in str(ei.value)
    assert isinstance(ei.value, KeyError)


def test_hdf5_single_dataset_needs_no_name(tmp_path):
    h5py = _h5py()
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("grp/only", data=_arr(5, 2))
    g = gl.DataGadget(str(tmp_path / "d.h5"), placement="cpu", device="cpu")
    np.testing.assert_array_equal(_rows(g), _arr(5, 2))


def test_format_from_content_and_forced(tmp_path):
    a = _arr(6, 2)
    p = tmp_path / "table.bin"
    with open(p, "wb") as f:
        np.save(f, a)
    np.testing.assert_array_equal(_rows(_g(str(p))), a)
    np.testing.assert_array_equal(_rows(_g(str(p), format="npy")), a)


def test_missing_file_is_file_not_found_with_errno_and_filename(tmp_path):
    p = tmp_path / "nope.npy"
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.DataGadget(str(p), placement="cpu")
    e = ei.value
    assert isinstance(e, FileNotFoundError) and isinstance(e, gl.GadgetFileError)
    assert e.errno == errno.ENOENT and str(p) in str(e.filename)


def test_truncated_and_bad_files_are_errors_naming_the_file(tmp_path):
    p = tmp_path / "cut.npy"
    np.save(p, _arr(100, 8))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(gl.GadgetFileError, match="cut.npy"):
        gl.DataGadget(str(p), placement="cpu")
    q = tmp_path / "obj.npy"
    np.save(q, np.array([["a", 1]], dtype=object), allow_pickle=True)
    with pytest.raises(gl.GadgetError, match="obj.npy"):
        gl.DataGadget(str(q), placement="cpu")
    r = tmp_path / "empty.npy"
    np.save(r, np.zeros((0, 4), np.float32))
    with pytest.raises(gl.GadgetError, match="empty.npy"):
        gl.DataGadget(str(r), placement="cpu")


def test_zero_row_table_in_memory_but_not_saved(tmp_path):
    g = _g((0, 4), dtype="float32")
    assert len(g) == 0 and g.shape == (0, 4)
    with pytest.raises(gl.GadgetError):
        g.save(str(tmp_path / "z.npy"))
    assert not (tmp_path / "z.npy").exists()


def test_file_placement_reads_and_writes_through(tmp_path):
    a = _arr(50, 4)
    p = tmp_path / "big.npy"
    np.save(p, a)
    g = gl.DataGadget(str(p), placement="file", cache_bytes=1 << 20, device="cpu")
    assert g.placement == "file"
    np.testing.assert_array_equal(g.getData([49, 0, 7], device="cpu").numpy(), a[[49, 0, 7]])
    g.insertData(np.full((2, 4), -3, np.float32), [1, 48])
    g.flush()
    ref = a.copy()
    ref[[1, 48]] = -3
    np.testing.assert_array_equal(np.load(p), ref)
    g.close()


def test_file_placement_hdf5_writes_through(tmp_path):
    h5py = _h5py()
    a = _arr(40, 3)
    with h5py.File(tmp_path / "big.h5", "w") as f:
        f.create_dataset("emb", data=a, chunks=(8, 3), compression="gzip")
    g = gl.DataGadget(str(tmp_path / "big.h5"), placement="file", device="cpu")
    g.insertData(np.full((1, 3), 9, np.float32), [20])
    np.testing.assert_array_equal(g.getData([20, 21], device="cpu").numpy(), [[9, 9, 9], a[21]])
    g.close()
    with h5py.File(tmp_path / "big.h5", "r") as f:
        np.testing.assert_array_equal(f["emb"][20], [9, 9, 9])


@pytest.mark.parametrize("ro", [False, np.False_])
def test_writable_false_is_read_only(tmp_path, ro):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    g = gl.DataGadget(str(p), placement="file", writable=ro, device="cpu")
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(np.zeros((1, 4), np.float32), [0])
    np.testing.assert_array_equal(np.load(p), _arr())
    g.close()


@pytest.mark.parametrize("bad", ["no", 0, 1, "False"])
def test_writable_takes_only_bools_or_none(tmp_path, bad):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(str(p), placement="file", writable=bad)


def test_fortran_npy_file_table_is_read_only_saying_why(tmp_path):
    p = tmp_path / "f.npy"
    np.save(p, np.asfortranarray(_arr()))
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    np.testing.assert_array_equal(g.getData([3], device="cpu").numpy(), _arr()[[3]])
    with pytest.raises(gl.ReadOnlyError, match="(?i)fortran"):
        g.insertData(np.zeros((1, 4), np.float32), [0])
    g.close()


def test_save_hdf5_with_options_roundtrip(tmp_path):
    h5py = _h5py()
    a = _arr(20, 3)
    g = _g(a)
    g.save(str(tmp_path / "t.h5"), dataset="emb", chunk_rows=4, compression="gzip")
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert list(f.keys()) == ["emb"]
        np.testing.assert_array_equal(f["emb"][()], a)
        assert f["emb"].compression == "gzip" and f["emb"].chunks[0] == 4
    g2 = _g((20, 3), dtype="float32")
    g2.load(str(tmp_path / "t.h5"), dataset="emb")
    np.testing.assert_array_equal(_rows(g2), a)
    assert _listing(tmp_path) == ["t.h5"]


def test_save_default_dataset_name_is_data_and_replaces_whole_file(tmp_path):
    h5py = _h5py()
    p = tmp_path / "t.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("old1", data=np.zeros(3))
        f.create_dataset("old2", data=np.zeros(3))
    _g(_arr()).save(str(p))
    with h5py.File(p, "r") as f:
        assert list(f.keys()) == ["data"]


@pytest.mark.parametrize("comp", ["zstd", "gzip", "none"])
def test_save_zarr_roundtrip(tmp_path, comp):
    _zarr()
    a = _arr(20, 3)
    p = tmp_path / "t.zarr"
    _g(a).save(str(p), compression=comp, chunk_rows=8)
    np.testing.assert_array_equal(_rows(_g(str(p))), a)


def test_bad_save_arguments_refused_before_any_file(tmp_path):
    _h5py()
    g = _g(_arr())
    with pytest.raises(gl.GadgetError):
        g.save(str(tmp_path / "t.h5"), compression="brotli9000")
    with pytest.raises(gl.GadgetTypeError):
        g.save(str(tmp_path / "u.npy"), progress="False")
    with pytest.raises(gl.GadgetValueError):
        g.save(str(tmp_path / "v.h5"), dataset="../x")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize(
    "dtype",
    ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"],
)
def test_every_dtype_roundtrips_npy_bit_exact(tmp_path, dtype):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((6, 3)) * 50).astype(dtype)
    p = tmp_path / "t.npy"
    _g(a).save(str(p))
    b = np.load(p)
    assert b.dtype == a.dtype
    np.testing.assert_array_equal(b, a)


def test_bfloat16_has_no_npy_form_but_roundtrips_hdf5(tmp_path):
    h5py = _h5py()
    t = torch.randn(5, 3).to(torch.bfloat16)
    g = _g(t)
    with pytest.raises(gl.GadgetError):
        g.save(str(tmp_path / "b.npy"))
    assert not (tmp_path / "b.npy").exists()
    g.save(str(tmp_path / "b.h5"))
    with h5py.File(tmp_path / "b.h5", "r") as f:
        assert f["data"].dtype == np.uint16
    back = _g(str(tmp_path / "b.h5"))
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.getData(range(5), device="cpu"), t)


def test_unsigned_arrays_convert_with_dtype_only():
    u16 = np.array([[0, 65535], [7, 8]], np.uint16)
    with pytest.raises(gl.GadgetError):
        _g(u16)
    g = _g(u16, dtype="int32")
    assert g.dtype == torch.int32
    np.testing.assert_array_equal(_rows(g), u16.astype(np.int32))
    u32 = np.array([[16777217], [4000000000]], np.uint32)
    with pytest.raises(gl.GadgetError):
        _g(u32, dtype="int32")  # 4e9 beyond int32
    f = _g(u32, dtype="float32")
    np.testing.assert_array_equal(_rows(f)[:, 0], [16777216.0, 4000000000.0])


def test_uint32_file_with_dtype_int64_and_refused_elsewhere(tmp_path):
    p = tmp_path / "counts.npy"
    c = np.array([[1], [4000000000]], np.uint32)
    np.save(p, c)
    g = gl.DataGadget(str(p), dtype="int64", placement="cpu", device="cpu")
    np.testing.assert_array_equal(_rows(g), c.astype(np.int64))
    t = _g((2, 1), dtype="int64")
    with pytest.raises(gl.GadgetError, match="dtype"):
        t.load(str(p))
    np.testing.assert_array_equal(_rows(t), 0)
    with pytest.raises(gl.GadgetError, match="dtype"):
        gl.DataGadget(str(p), placement="file")


def test_complex_refused():
    with pytest.raises(gl.GadgetError):
        _g(np.ones((2, 2), np.complex64))


def test_save_keeps_permission_bits_and_symlink(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, np.zeros((10, 4), np.float32))
    os.chmod(p, 0o640)
    link = tmp_path / "link.npy"
    link.symlink_to(p.name)
    hard = tmp_path / "hard.npy"
    os.link(p, hard)
    _g(_arr()).save(str(link))
    assert link.is_symlink()
    np.testing.assert_array_equal(np.load(p), _arr())
    np.testing.assert_array_equal(np.load(hard), 0)  # other hard links keep the old data
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    assert _listing(tmp_path) == ["hard.npy", "link.npy", "t.npy"]


def test_save_refuses_directory_target(tmp_path):
    d = tmp_path / "dir.npy"
    d.mkdir()
    with pytest.raises(gl.GadgetError):
        _g(_arr()).save(str(d))
    assert d.is_dir() and _listing(d) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_save_into_unwritable_folder_is_read_only_error(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o500)
    try:
        with pytest.raises(gl.ReadOnlyError) as ei:
            _g(_arr()).save(str(d / "t.npy"))
        assert isinstance(ei.value, PermissionError)
    finally:
        os.chmod(d, 0o700)


def test_file_table_replaced_by_another_save_keeps_raising(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    _g(_arr() + 1).save(str(p))
    for _ in range(2):
        with pytest.raises(gl.GadgetFileError):
            g.getData([0], device="cpu")
    g.load(str(p))
    np.testing.assert_array_equal(g.getData([0], device="cpu").numpy(), _arr()[[0]] + 1)
    g.close()


def test_two_file_tables_of_one_file_see_each_others_writes(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    g1 = gl.DataGadget(str(p), placement="file", device="cpu")
    g2 = gl.DataGadget(str(p), placement="file", device="cpu")
    g1.getData([2], device="cpu")
    g2.getData([2], device="cpu")
    g1.insertData(np.full((1, 4), 77, np.float32), [2])
    np.testing.assert_array_equal(g2.getData([2], device="cpu").numpy(), 77)
    g1.close()
    g2.close()


def test_pickling_file_and_cpu_gadgets(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    fg = gl.DataGadget(str(p), placement="file", device="cpu")
    data = pickle.dumps(fg)
    assert len(data) < _arr().nbytes + 2000  # pickles as its file name
    np.save(p.with_name("unused.npy"), _arr())
    fg2 = pickle.loads(data)
    np.testing.assert_array_equal(fg2.getData([1, 2], device="cpu").numpy(), _arr()[[1, 2]])
    cg = _g(_arr())
    cg2 = pickle.loads(pickle.dumps(cg))
    cg2.fill_(0)
    np.testing.assert_array_equal(_rows(cg), _arr())
    fg.close()
    fg2.close()


# ----------------------------------------------------------------------------- CLI convert and exit codes


def test_cli_convert_npy_to_h5_subprocess(tmp_path):
    h5py = _h5py()
    a = _arr(30, 4)
    np.save(tmp_path / "emb.npy", a)
    r = _run(
        "-m", "gadgetloader", "convert", str(tmp_path / "emb.npy"), str(tmp_path / "emb.h5"),
        "--chunk-rows", "4096", "--compression", "gzip", "--no-progress",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "emb.h5", "r") as f:
        (name,) = list(f.keys())
        np.testing.assert_array_equal(f[name][()], a)
        assert f[name].compression == "gzip"


def test_cli_convert_h5_dataset_to_zarr(tmp_path, capsys):
    h5py = _h5py()
    _zarr()
    a = _arr(30, 4)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("emb/words", data=a)
        f.create_dataset("other", data=np.zeros((3, 3)))
    rc, _, err = _cli(
        [
            "convert",
            str(tmp_path / "data.h5"),
            str(tmp_path / "emb.zarr"),
            "--dataset",
            "emb/words",
        ],
        capsys,
    )
    assert rc == 0, err
    np.testing.assert_array_equal(_rows(_g(str(tmp_path / "emb.zarr"))), a)


def test_cli_convert_refuses_its_source_also_through_links(tmp_path, capsys):
    p = tmp_path / "a.npy"
    np.save(p, _arr())
    (tmp_path / "sym.npy").symlink_to(p.name)
    os.link(p, tmp_path / "hard.npy")
    for dst in (p, tmp_path / "sym.npy", tmp_path / "hard.npy"):
        rc, _, err = _cli(["convert", str(p), str(dst)], capsys)
        assert rc in (1, 2), err
        np.testing.assert_array_equal(np.load(p), _arr())


@pytest.mark.parametrize(
    "extra",
    [
        ["--compression", "gzip"],  # for a .npy destination
        ["--chunk-rows", "8"],  # for a .npy destination
        ["--dataset", "x"],  # for a .npy source
        ["--dst-dataset", "x"],  # for a .npy destination
        ["--format", "parquet"],
        ["--to", "csv"],
    ],
)
def test_cli_convert_bad_option_exits_2(tmp_path, capsys, extra):
    np.save(tmp_path / "a.npy", _arr())
    rc, _, err = _cli(["convert", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), *extra], capsys)
    assert rc == 2, err
    assert "convert" in err and "error" in err
    assert not (tmp_path / "b.npy").exists()


def test_cli_convert_unknown_compression_for_h5_exits_2(tmp_path, capsys):
    _h5py()
    np.save(tmp_path / "a.npy", _arr())
    rc, _, err = _cli(
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "b.h5"), "--compression", "zstdx"],
        capsys,
    )
    assert rc == 2, err
    assert not (tmp_path / "b.h5").exists()


def test_cli_convert_missing_source_and_dataset_exit_1(tmp_path, capsys):
    h5py = _h5py()
    rc, out, err = _cli(["convert", str(tmp_path / "no.npy"), str(tmp_path / "b.h5")], capsys)
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("emb", data=_arr())
    rc, out, err = _cli(
        ["convert", str(tmp_path / "d.h5"), str(tmp_path / "b.npy"), "--dataset", "nope"], capsys
    )
    assert rc == 1
    assert not (tmp_path / "b.npy").exists() and not (tmp_path / "b.h5").exists()


def test_cli_bench_sweep_bad_sizes_exit_2_naming_command(capsys):
    rc, _, err = _cli(["bench", "sweep", "--sizes-gb", "-1"], capsys)
    assert rc == 2
    assert "bench sweep: error:" in err


def test_cli_bench_files_dir_not_folder_exit_2(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _cli(["bench", "files", "--dir", str(f)], capsys)
    assert rc == 2
    assert "bench files" in err


def test_cli_bench_pipeline_width_below_3_exit_2(capsys):
    rc, _, err = _cli(["bench", "pipeline", "--width", "2"], capsys)
    assert rc == 2
    assert "bench pipeline" in err


def test_cli_bench_json_path_checked_before_run(tmp_path, capsys):
    rc, out, err = _cli(
        ["bench", "files", "--json", str(tmp_path / "no" / "dir" / "f.json")], capsys
    )
    assert rc in (1, 2)
    assert "bench files" in err or "f.json" in err


# ----------------------------------------------------------------------------- Input pipeline


def _ds(n=40, d=3):
    feats = _arr(n, d)
    labels = np.arange(n, dtype=np.int64) * 10
    return feats, labels, gl.GadgetDataset(feats, labels, placement="cpu", device="cpu")


def test_dataset_default_form_snippet(tmp_path):
    feats = _arr(40, 3)
    np.save(tmp_path / "features.npy", feats)
    labels = np.arange(40, dtype=np.int64) * 10
    ds = gl.GadgetDataset(str(tmp_path / "features.npy"), labels, placement="cpu", device="cpu")
    seen = []
    for x, y in DataLoader(ds, batch_size=16, shuffle=True):
        assert x.device.type == "cpu" and x.dtype == torch.float32
        ids = (y // 10).numpy()
        np.testing.assert_array_equal(x.numpy(), feats[ids])
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(40))


def test_getitems_returns_one_element_list_and_custom_collate():
    feats, labels, ds = _ds()
    out = ds.__getitems__([3, 1])
    assert isinstance(out, list) and len(out) == 1
    x, y = out[0]
    np.testing.assert_array_equal(x.numpy(), feats[[3, 1]])
    dl = DataLoader(ds, batch_size=5, collate_fn=lambda b: b[0])
    x, y = next(iter(dl))
    np.testing.assert_array_equal(y.numpy(), labels[:5])


def test_subset_random_split_and_concat():
    feats, labels, ds = _ds()
    sub = Subset(ds, [5, 7, 9])
    x, y = next(iter(DataLoader(sub, batch_size=3)))
    np.testing.assert_array_equal(y.numpy(), labels[[5, 7, 9]])
    a, b = random_split(ds, [30, 10], generator=torch.Generator().manual_seed(0))
    ys = torch.cat([y for _, y in DataLoader(b, batch_size=4)])
    np.testing.assert_array_equal(ys.numpy(), labels[b.indices])
    cat = ConcatDataset([ds, ds])
    x, y = next(iter(DataLoader(cat, batch_size=4)))
    np.testing.assert_array_equal(y.numpy(), labels[:4])
    np.testing.assert_array_equal(x.numpy(), feats[:4])


def test_dataset_negative_index_and_out_of_range_list():
    feats, labels, ds = _ds()
    x, y = ds[-1]
    np.testing.assert_array_equal(x.numpy(), feats[-1])
    assert int(y) == labels[-1]
    with pytest.raises(gl.GadgetIndexError):
        ds[[0, -1]]
    with pytest.raises(gl.GadgetIndexError):
        ds[[40]]


def test_sampler_forms_every_row_once():
    feats, labels, ds = _ds(41)
    sampler = gl.GadgetSampler(ds, batch_size=8, order="random", seed=0)
    loader = DataLoader(ds, batch_sampler=sampler)
    seen = []
    for x, y in loader:
        np.testing.assert_array_equal(x.numpy(), feats[(y // 10).numpy()])
        assert len(y) <= 9
        seen.extend((y // 10).tolist())
    assert sorted(seen) == list(range(41))
    loader2 = DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=8), batch_size=None)
    assert sorted(torch.cat([y for _, y in loader2]).tolist()) == sorted(labels.tolist())


def test_gadget_loader_snippet():
    feats, labels, ds = _ds(41)
    loader = gl.GadgetLoader(ds, batch_size=8, prefetch=2)
    ys = []
    for x, y in loader:
        np.testing.assert_array_equal(x.numpy(), feats[(y // 10).numpy()])
        ys.append(y)
    assert sorted(torch.cat(ys).tolist()) == sorted(labels.tolist())


def test_sampler_epochs_seed_and_set_epoch():
    s1 = gl.GadgetSampler(100, batch_size=10, order="random", seed=3)
    s2 = gl.GadgetSampler(100, batch_size=10, order="random", seed=3)
    e0 = torch.cat([b.clone() for b in s1])
    e1 = torch.cat([b.clone() for b in s1])  # next pass: the next epoch
    assert sorted(e0.tolist()) == list(range(100)) == sorted(e1.tolist())
    assert not torch.equal(e0, e1)
    assert torch.equal(torch.cat([b.clone() for b in s2]), e0)
    s2.set_epoch(1)
    assert torch.equal(torch.cat([b.clone() for b in s2]), e1)
    for b in gl.GadgetSampler(100, batch_size=10, order="random", seed=3):
        assert b.dtype == torch.int64
        break


def test_sampler_sequential_drop_last_and_pad():
    seq = [b.tolist() for b in gl.GadgetSampler(10, batch_size=3, order="sequential")]
    assert sum(seq, []) == list(range(10))
    assert all(len(b) <= 4 for b in seq)
    dl = [
        b.tolist() for b in gl.GadgetSampler(10, batch_size=3, order="sequential", drop_last=True)
    ]
    assert all(len(b) == 3 for b in dl)
    assert 10 - len(sum(dl, [])) < 3
    pad = [b.tolist() for b in gl.GadgetSampler(10, batch_size=3, order="sequential", pad=True)]
    assert all(len(b) == 3 for b in pad)
    flat = sum(pad, [])
    assert flat[:10] == list(range(10)) and flat[10:] == list(range(len(flat) - 10))
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(5, batch_size=8, drop_last=True)


def test_sampler_unknown_order_lists_names():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.GadgetSampler(10, batch_size=3, order="shuffled")
    assert isinstance(ei.value, KeyError)
    assert "random" in str(ei.value) and "sequential" in str(ei.value)


def test_sampler_as_sampler_without_batch_size_none_is_refused_when_iterated():
    _, _, ds = _ds()
    loader = DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4))
    with pytest.raises(gl.GadgetValueError):
        next(iter(loader))


def test_sampler_ranks_disjoint_equal_counts():
    a = [b.clone() for b in gl.GadgetSampler(23, batch_size=4, num_replicas=2, rank=0, seed=1)]
    b = [b.clone() for b in gl.GadgetSampler(23, batch_size=4, num_replicas=2, rank=1, seed=1)]
    assert len(a) == len(b)
    ra, rb = torch.cat(a).tolist(), torch.cat(b).tolist()
    assert not set(ra) & set(rb)
    assert sorted(ra + rb) == list(range(23))
    assert all(len(x) <= 5 for x in a + b)


@pytest.mark.skipif(
    torch.distributed.is_available() and torch.distributed.is_initialized(),
    reason="needs no process group",
)
def test_sampler_num_replicas_without_rank_needs_rank():
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(20, batch_size=2, num_replicas=2)


def test_sampler_resume_mid_epoch_exact():
    s = gl.GadgetSampler(50, batch_size=5, order="random", seed=7)
    s.set_epoch(2)
    it = iter(s)
    first = [next(it).clone() for _ in range(3)]
    state = s.state_dict()
    rest = [b.clone() for b in it]
    r = gl.GadgetSampler(50, batch_size=5, order="random", seed=999)  # the state brings its seed
    r.load_state_dict(state)
    resumed = [b.clone() for b in r]
    assert len(resumed) == len(rest) == 7
    for x, y in zip(resumed, rest, strict=True):
        assert torch.equal(x, y)
    assert sorted(torch.cat(first + resumed).tolist()) == list(range(50))


@pytest.mark.parametrize(
    "kw",
    [
        {"data_source": 51},
        {"batch_size": 6},
        {"order": "sequential"},
        {"drop_last": True},
        {"pad": True},
    ],
)
def test_sampler_state_for_other_setup_is_refused_and_changes_nothing(kw):
    s = gl.GadgetSampler(50, batch_size=5, order="random", seed=1)
    it = iter(s)
    next(it)
    state = s.state_dict()
    args = {"data_source": 50, "batch_size": 5, "order": "random", "seed": 1}
    args.update(kw)
    other = gl.GadgetSampler(args.pop("data_source"), **args)
    before = other.state_dict()
    with pytest.raises(gl.GadgetError):
        other.load_state_dict(state)
    assert other.state_dict() == before


def test_stateful_dataloader_resumes_mid_epoch():
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    feats, labels, ds = _ds(30)
    s = gl.GadgetSampler(ds, batch_size=4, seed=5)
    dl = tdl.StatefulDataLoader(ds, batch_sampler=s)
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = dl.state_dict()
    rest = [y.clone() for _, y in it]
    s2 = gl.GadgetSampler(ds, batch_size=4, seed=5)
    dl2 = tdl.StatefulDataLoader(ds, batch_sampler=s2)
    dl2.load_state_dict(state)
    again = [y.clone() for _, y in dl2]
    assert len(again) == len(rest) > 0
    for a, b in zip(again, rest, strict=True):
        assert torch.equal(a, b)


def test_gadget_loader_state_dict_resume():
    feats, labels, ds = _ds(30)
    ld = gl.GadgetLoader(ds, batch_size=4, seed=2, prefetch=2)
    it = iter(ld)
    for _ in range(2):
        next(it)
    state = ld.state_dict()
    rest = [y.clone() for _, y in it]
    ld2 = gl.GadgetLoader(ds, batch_size=4, seed=2, prefetch=2)
    ld2.load_state_dict(state)
    again = [y.clone() for _, y in ld2]
    assert [a.tolist() for a in again] == [b.tolist() for b in rest]


def test_gadget_loader_state_after_loop_points_at_next_epoch():
    _, _, ds = _ds(12)
    ld = gl.GadgetLoader(ds, batch_size=4, seed=2)
    list(ld)
    state = ld.state_dict()
    nxt = [y.clone() for _, y in ld]
    ld2 = gl.GadgetLoader(ds, batch_size=4, seed=2)
    ld2.load_state_dict(state)
    again = [y.clone() for _, y in ld2]
    assert [a.tolist() for a in again] == [b.tolist() for b in nxt]


def test_gadget_loader_refusals():
    _, _, ds = _ds(12)
    s = gl.GadgetSampler(ds, batch_size=4)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=s, order="random")
    for kw in ({"shuffle": True}, {"collate_fn": lambda b: b}, {"batch_sampler": s}):
        with pytest.raises(gl.GadgetTypeError):
            gl.GadgetLoader(ds, batch_size=4, **kw)
    # (torch < 2.6 has no in_order at all: its DataLoader's TypeError is a refusal too)
    with pytest.raises((gl.GadgetError, TypeError)):
        iter(gl.GadgetLoader(ds, batch_size=4, num_workers=1, in_order=False))


def test_zero_row_dataset_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(
            gl.GadgetDataset(np.zeros((0, 3), np.float32), placement="cpu", device="cpu"),
            batch_size=4,
        )


def test_column_reloaded_to_other_row_count_raises(tmp_path):
    g = _g(_arr(20, 3))
    ds = gl.GadgetDataset(g, np.arange(20), placement="cpu", device="cpu")
    np.save(tmp_path / "small.npy", _arr(10, 3))
    g.load(str(tmp_path / "small.npy"))
    with pytest.raises(gl.GadgetValueError):
        ds[[0, 1]]


def test_prefetch_0_sees_writes_of_the_loop():
    g = _g(np.zeros((8, 2), np.float32))
    ds = gl.GadgetDataset(g, placement="cpu", device="cpu")
    ld = gl.GadgetLoader(ds, batch_size=2, prefetch=0, order="sequential")
    for k, batch in enumerate(ld):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        assert float(x.sum()) == 0.0 if k == 0 else float(x.min()) == 1.0
        g.insertData(np.ones((8, 2), np.float32), list(range(8)))


# ----------------------------------------------------------------------------- Training


def _dense_pair(n=20, d=4, seed=0):
    torch.manual_seed(seed)
    ref = torch.nn.Embedding(n, d)
    emb = gl.OffloadedEmbedding(n, d, placement="cpu", device="cpu")
    emb.weight.insertData(ref.weight.detach().clone(), torch.arange(n))
    return emb, ref


def _table(emb) -> torch.Tensor:
    return torch.from_numpy(emb.weight.getNumpyVersion(copy=True))


def test_file_placement_is_refused_for_training_tables():
    with pytest.raises(gl.GadgetKeyError):
        gl.OffloadedEmbedding(10, 4, placement="file")


def test_dropin_snippet_matches_dense_torch_bit_for_bit():
    n_item, n_user, d = 24, 16, 8
    torch.manual_seed(0)
    item_ref = torch.nn.Embedding(n_item, d)
    user_ref = torch.nn.EmbeddingBag(n_user, d, mode="mean")
    head_ref = torch.nn.Linear(d, 1)
    model = torch.nn.ModuleDict(
        {
            "item": gl.OffloadedEmbedding(n_item, d, placement="cpu", device="cpu"),
            "user": gl.OffloadedEmbeddingBag(n_user, d, mode="mean", placement="cpu", device="cpu"),
            "head": torch.nn.Linear(d, 1),
        }
    )
    model["item"].weight.insertData(item_ref.weight.detach().clone(), torch.arange(n_item))
    model["user"].weight.insertData(user_ref.weight.detach().clone(), torch.arange(n_user))
    model["head"].load_state_dict(head_ref.state_dict())
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(
        [item_ref.weight, user_ref.weight, *head_ref.parameters()], lr=1e-2, weight_decay=0.01
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        # every row is looked up each step, so lazy and dense updates coincide
        items = torch.cat(
            [torch.randperm(n_item, generator=g), torch.randint(0, n_item, (8,), generator=g)]
        )
        history = torch.cat(
            [
                torch.randperm(n_user, generator=g),
                torch.randint(0, n_user, ((n_item + 8) * 2 - n_user,), generator=g),
            ]
        ).view(n_item + 8, 2)
        y = torch.randn(n_item + 8, generator=g)
        pred = model["head"](model["item"](items) * model["user"](history)).squeeze(-1)
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rpred = head_ref(item_ref(items) * user_ref(history)).squeeze(-1)
        rloss = F.mse_loss(rpred, y)
        ref_opt.zero_grad()
        rloss.backward()
        ref_opt.step()
        assert torch.equal(loss.detach(), rloss.detach())
    assert torch.equal(_table(model["item"]), item_ref.weight.detach())
    torch.testing.assert_close(
        _table(model["user"]), user_ref.weight.detach(), rtol=1e-6, atol=1e-7
    )
    assert torch.equal(model["head"].weight.detach(), head_ref.weight.detach())


def test_several_lookups_in_a_step_sum_like_autograd():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.3)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, generator=g)
    for _ in range(3):
        a = torch.randint(0, 20, (30,), generator=g)
        b = torch.randint(0, 20, (17,), generator=g)
        loss = (emb(a) @ w).sin().sum() + (emb(b) * emb(a[:17])).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rloss = (ref(a) @ w).sin().sum() + (ref(b) * ref(a[:17])).sum()
        ropt.zero_grad()
        rloss.backward()
        ropt.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_updates_are_lazy_rows_not_looked_up_keep_values():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    after1 = _table(emb)
    emb(torch.tensor([3])).sum().backward()
    opt.step()
    after2 = _table(emb)
    assert torch.equal(after2[[1, 2]], after1[[1, 2]])  # momentum does not move them
    assert not torch.equal(after2[3], after1[3])


def test_optimizer_is_torch_optimizer_and_closure_returns_loss():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    assert isinstance(opt, torch.optim.Optimizer)
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(1))
    ids = torch.tensor([0, 5, 5])

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = emb(ids).pow(2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    rloss = ref(ids).pow(2).sum()
    rloss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert torch.equal(loss.detach(), rloss.detach())
    assert torch.equal(_table(emb), ref.weight.detach())
    assert seen == [1]


def test_lr_scheduler_drives_table_updates():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=1.0, momentum=0.9)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    rsch = torch.optim.lr_scheduler.StepLR(ropt, step_size=1, gamma=0.5)
    ids = torch.arange(20)
    for _ in range(3):
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()
        sch.step()
        ropt.zero_grad()
        ref(ids).pow(2).sum().backward()
        ropt.step()
        rsch.step()
    assert opt.param_groups[0]["lr"] == 0.125
    assert torch.equal(_table(emb), ref.weight.detach())


def test_clip_grad_norm_over_param_groups_reaches_tables():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    ids = torch.tensor([1, 4, 4, 7])
    (emb(ids) * 10).pow(2).sum().backward()
    params = [p for g in opt.param_groups for p in g["params"]]
    total = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    (ref(ids) * 10).pow(2).sum().backward()
    rtotal = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    torch.testing.assert_close(total, rtotal)
    torch.testing.assert_close(_table(emb), ref.weight.detach())


def test_param_group_dicts_naming_modules_and_add_param_group():
    emb, ref = _dense_pair()
    head = torch.nn.Linear(4, 1)
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD, [{"params": emb, "lr": 0.5}, {"params": head.parameters()}], lr=0.01
    )
    ids = torch.tensor([2, 3])
    before = _table(emb)
    head(emb(ids)).sum().backward()
    g_rows = head.weight.detach().clone().view(-1).expand(2, 4)
    opt.step()
    torch.testing.assert_close(_table(emb)[ids], before[ids] - 0.5 * g_rows, rtol=0, atol=1e-6)
    new_emb = gl.OffloadedEmbedding(5, 4, placement="cpu", device="cpu")
    new_emb.weight.zero_()
    opt.add_param_group({"params": new_emb, "lr": 2.0})
    opt.zero_grad()
    new_emb(torch.tensor([1])).sum().backward()
    opt.step()
    exp = np.zeros((5, 4), np.float32)
    exp[1] = -2.0
    np.testing.assert_array_equal(_table(new_emb).numpy(), exp)


def test_same_table_in_two_groups_refused_and_set_params_refused():
    emb, _ = _dense_pair()
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.SGD, [{"params": emb}, {"params": emb}], lr=0.1)
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.SGD, [{"params": {emb}}], lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.SGD, [emb.weight], lr=0.1)


def test_params_without_tables_warns_and_model_parameters_of_tables_errors():
    head = torch.nn.Linear(3, 1)
    with pytest.warns(Warning):
        gl.OffloadedOptimizer(torch.optim.SGD, head.parameters(), lr=0.1)
    emb, _ = _dense_pair()
    model = torch.nn.ModuleDict({"e": emb})
    with pytest.raises(gl.GadgetError, match="(?i)table"):
        gl.OffloadedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)


def test_state_dict_records_class_nadam_refuses_adam_state():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    emb2, _ = _dense_pair()
    opt2 = gl.OffloadedOptimizer(torch.optim.NAdam, emb2, lr=0.1)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(gl.GadgetValueError):
        opt2.load_state_dict(sd)
    after = opt2.state_dict()
    assert after["inner"]["state"] == before["inner"]["state"]
    for t0, t1 in zip(before["tables"], after["tables"], strict=True):
        for k in t0:
            assert torch.equal(t0[k], t1[k])


def test_optimizer_state_dict_roundtrip_resumes_exactly():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2, 2])).pow(2).sum().backward()
    opt.step()
    sd = opt.state_dict()
    w = emb.weight.getNumpyVersion()
    emb2 = gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")
    emb2.weight.insertData(w, list(range(20)))
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.1)
    opt2.load_state_dict(sd)
    for e, o in ((emb, opt), (emb2, opt2)):
        o.zero_grad()
        e(torch.tensor([2, 3])).pow(2).sum().backward()
        o.step()
    assert torch.equal(_table(emb), _table(emb2))


def test_optimizer_cannot_be_copied_or_pickled():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        copy.deepcopy(opt)
    with pytest.raises(gl.GadgetTypeError):
        pickle.dumps(opt)


def test_requires_grad_false_freezes_and_double_changes_lookup_dtype():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    before = _table(emb)
    emb.requires_grad_(False)
    out = emb(torch.tensor([1, 2]))
    assert not out.requires_grad
    opt.step()
    assert torch.equal(_table(emb), before)
    emb.requires_grad_(True)
    emb.double()
    out = emb(torch.tensor([1, 2]))
    assert out.dtype == torch.float64 and emb.weight.dtype == torch.float32
    torch.testing.assert_close(out, before[[1, 2]].double())


def test_step_consumes_gradients_and_zero_grad_discards():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    once = _table(emb)
    opt.step()  # no new backward
    assert torch.equal(_table(emb), once)
    emb(torch.tensor([2])).sum().backward()
    opt.zero_grad()
    opt.step()
    assert torch.equal(_table(emb), once)


def test_parent_zero_grad_does_not_reach_table_gradients():
    emb, _ = _dense_pair()
    model = torch.nn.ModuleDict({"e": emb, "h": torch.nn.Linear(4, 1)})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=1.0)
    before = _table(emb)
    emb(torch.tensor([3])).sum().backward()
    model.zero_grad()
    opt.step()
    np.testing.assert_allclose(_table(emb)[3].numpy(), before[3].numpy() - 1.0, rtol=0, atol=1e-6)


def test_gradient_after_step_is_reported_not_applied():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(torch.tensor([4]))
    opt.step()
    out.sum().backward()
    before = _table(emb)
    with pytest.raises(gl.GadgetError):
        opt.step()
    assert torch.equal(_table(emb), before)


def test_table_changes_refused_while_lookup_waits():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    before = _table(emb)
    out = emb(torch.tensor([4]))
    with pytest.raises(gl.GadgetError):
        emb.weight.fill_(0.0)
    with pytest.raises(gl.GadgetError):
        emb.weight.insertData(np.zeros((1, 4), np.float32), [0])
    out.sum().backward()
    with pytest.raises((gl.GadgetError, RuntimeError)):
        emb.load_state_dict({"weight": torch.zeros(20, 4)})
    assert torch.equal(_table(emb), before)
    assert opt is not None


def test_cpu_ids_out_of_range_checked_at_forward():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    before = _table(emb)
    with pytest.raises(gl.GadgetIndexError):
        emb(torch.tensor([0, 20]))
    opt.step()
    assert torch.equal(_table(emb), before)


@pytest.mark.parametrize("kw", [{"padding_idx": 0}, {"max_norm": 1.0}, {"sparse": True}])
def test_modules_take_no_padding_idx_max_norm_sparse(kw):
    with pytest.raises(TypeError):
        gl.OffloadedEmbedding(10, 4, placement="cpu", **kw)
    with pytest.raises(TypeError):
        gl.OffloadedEmbeddingBag(10, 4, placement="cpu", **kw)


def test_bag_mode_outside_list_is_value_error():
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedEmbeddingBag(10, 4, mode="median", placement="cpu")


def test_unsupported_optimizers_refused_with_list():
    emb, _ = _dense_pair()
    with pytest.raises(gl.GadgetTypeError, match="SparseAdam"):
        gl.OffloadedOptimizer(torch.optim.LBFGS, emb, lr=0.1)
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1, differentiable=True)


def test_fused_sgd_dampening_mix_refused_by_first_step():
    emb, _ = _dense_pair()
    head = torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"e": emb, "h": head})
    try:
        opt = gl.OffloadedOptimizer(
            torch.optim.SGD, model, lr=0.1, momentum=0.9, dampening=0.5, fused=True
        )
    except gl.GadgetValueError:
        return  # refused even earlier: nothing changed either way
    before = _table(emb)
    hw = head.weight.detach().clone()
    head(emb(torch.tensor([1]))).sum().backward()
    with pytest.raises(gl.GadgetValueError):
        opt.step()
    assert torch.equal(_table(emb), before) and torch.equal(head.weight.detach(), hw)


def test_init_on_weight_and_refused_initialisers():
    emb = gl.OffloadedEmbedding(50, 20, placement="cpu", device="cpu")
    torch.nn.init.xavier_uniform_(emb.weight)
    bound = (6.0 / (50 + 20)) ** 0.5
    r = _table(emb)
    assert r.abs().max() <= bound + 1e-6 and r.std() > bound / 4
    torch.nn.init.zeros_(emb.weight)
    assert not _table(emb).any()
    with pytest.raises(gl.GadgetTypeError):
        torch.nn.init.trunc_normal_(emb.weight, std=0.02)
    assert not _table(emb).any()
    emb.weight.init_(torch.nn.init.trunc_normal_, std=0.02)
    r = _table(emb)
    assert r.abs().max() <= 2.0 and 0.01 < r.std() < 0.03


def test_deepcopy_of_model_is_separate_table():
    emb, _ = _dense_pair()
    model = torch.nn.ModuleDict({"e": emb})
    gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.1)
    twin = copy.deepcopy(model)
    twin["e"].weight.fill_(0.0)
    assert _table(emb).abs().sum() > 0
    assert not _table(twin["e"]).any()


def test_interleaved_table_keeps_object_earlier_views_detached_and_failed_load(tmp_path):
    emb, _ = _dense_pair()
    w = emb.weight
    view = w.as_tensor()
    before = _table(emb)
    gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    assert emb.weight is w
    w.fill_(5.0)
    assert torch.equal(view, before)  # the earlier view no longer sees the table
    np.save(tmp_path / "bad.npy", np.zeros((21, 4), np.float32))
    with pytest.raises(gl.GadgetError):
        w.load(str(tmp_path / "bad.npy"))
    assert (_table(emb) == 5.0).all()
    np.save(tmp_path / "good.npy", np.full((20, 4), 2.0, np.float32))
    w.load(str(tmp_path / "good.npy"))
    assert (_table(emb) == 2.0).all()
    c = copy.deepcopy(w)
    c.fill_(-1.0)
    assert (_table(emb) == 2.0).all() and (c.getNumpyVersion() == -1.0).all()


def test_module_load_state_dict_like_torch():
    emb, _ = _dense_pair()
    sd = emb.state_dict()
    assert set(sd) == {"weight"} and sd["weight"].shape == (20, 4)
    emb.load_state_dict({"weight": torch.full((20, 4), 0.1, dtype=torch.float64)})
    np.testing.assert_array_equal(_table(emb).numpy(), np.float32(0.1))
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        emb.load_state_dict({"weight": torch.zeros(21, 4)})
    np.testing.assert_array_equal(_table(emb).numpy(), np.float32(0.1))


# ----------------------------------------------------------------------------- Checkpoints


def _trained(seed=0, n=20, d=4, cls=torch.optim.Adam):
    emb, _ = _dense_pair(n, d, seed)
    model = torch.nn.ModuleDict({"item": emb, "head": torch.nn.Linear(d, 1)})
    opt = gl.OffloadedOptimizer(cls, model, lr=0.05)
    return model, opt


def _train_steps(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 20, (12,), generator=g)
        opt.zero_grad()
        model["head"](model["item"](ids)).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_resumes_bit_identically(tmp_path, fmt):
    if fmt == "hdf5":
        _h5py()
    if fmt == "zarr":
        _zarr()
    model, opt = _trained()
    _train_steps(model, opt, 2, seed=1)
    ck = tmp_path / "ckpt"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt}, format=fmt)
    assert (ck / "meta.pt").is_file()
    model2, opt2 = _trained(seed=5)
    gl.load_checkpoint(str(ck), {"model": model2, "optimizer": opt2})
    assert torch.equal(_table(model2["item"]), _table(model["item"]))
    _train_steps(model, opt, 2, seed=2)
    _train_steps(model2, opt2, 2, seed=2)
    assert torch.equal(_table(model2["item"]), _table(model["item"]))
    assert torch.equal(model2["head"].weight, model["head"].weight)


def test_bfloat16_checkpoint_needs_hdf5_or_zarr(tmp_path):
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu", dtype=torch.bfloat16)
    ck = tmp_path / "ck"
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(str(ck), {"m": emb}, format="npy")
    assert not ck.exists() or _listing(ck) == []


@pytest.mark.parametrize("name", ["", "a/b", "a\\b", ".", "..", "a\x00b"])
def test_checkpoint_object_names_checked(tmp_path, name):
    emb, _ = _dense_pair()
    ck = tmp_path / "ck"
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(str(ck), {name: emb})
    assert not ck.exists() or _listing(ck) == []


def test_checkpoint_subset_and_unknown_name(tmp_path):
    model, opt = _trained()
    _train_steps(model, opt, 1, seed=1)
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt})
    model2, _ = _trained(seed=4)
    gl.load_checkpoint(str(ck), {"model": model2})
    assert torch.equal(_table(model2["item"]), _table(model["item"]))
    model3, _ = _trained(seed=4)
    before = _table(model3["item"])
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(str(ck), {"model": model3, "other": model3})
    assert torch.equal(_table(model3["item"]), before)


@pytest.mark.parametrize("flag", ["yes", "False", 2])
def test_checkpoint_flags_checked_first(tmp_path, flag):
    model, opt = _trained()
    ck = tmp_path / "ck"
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(str(ck), {"model": model}, progress=flag)
    assert not ck.exists() or _listing(ck) == []
    gl.save_checkpoint(str(ck), {"model": model})
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(str(ck), {"model": model}, verify=flag)


def test_checkpoint_shape_mismatch_and_kind_mismatch_change_nothing(tmp_path):
    model, opt = _trained()
    _train_steps(model, opt, 1, seed=1)
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt})
    big, bopt = _trained(n=21)
    before = _table(big["item"])
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(str(ck), {"model": big, "optimizer": bopt})
    assert torch.equal(_table(big["item"]), before)
    m2, o2 = _trained(seed=3)
    before = _table(m2["item"])
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.load_checkpoint(str(ck), {"model": o2, "optimizer": m2})
    assert isinstance(ei.value, gl.GadgetTypeError)
    assert torch.equal(_table(m2["item"]), before)


def test_checkpoint_table_file_gone_is_file_not_found(tmp_path):
    model, opt = _trained()
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt})
    tables = [p for p in ck.iterdir() if p.name != "meta.pt"]
    assert tables
    tables[0].unlink()
    m2, o2 = _trained(seed=3)
    before = _table(m2["item"])
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.load_checkpoint(str(ck), {"model": m2, "optimizer": o2})
    assert isinstance(ei.value, gl.GadgetFileError)
    assert torch.equal(_table(m2["item"]), before)


def test_checkpoint_saved_over_removes_old_tables(tmp_path):
    model, opt = _trained()
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt})
    first = _listing(ck)
    _train_steps(model, opt, 1, seed=1)
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt})
    second = _listing(ck)
    assert len(second) == len(first)
    assert not [n for n in second if "partial" in n or n.startswith(".")]
    m2, o2 = _trained(seed=3)
    gl.load_checkpoint(str(ck), {"model": m2, "optimizer": o2})
    assert torch.equal(_table(m2["item"]), _table(model["item"]))


def test_checkpoint_refuses_function_in_param_group(tmp_path):
    model, opt = _trained()
    opt.param_groups[0]["fn"] = lambda x: x
    ck = tmp_path / "ck"
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(str(ck), {"optimizer": opt, "model": model})
    assert not ck.exists() or _listing(ck) == []


# ----------------------------------------------------------------------------- switchers


class _SkipGram(torch.nn.Module):
    def __init__(self, rows, d):
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(rows, d)
        self.v_embeddings = torch.nn.Embedding(rows, d)

    def forward(self, c, p, n):
        u = self.u_embeddings(c)
        pos = (u * self.v_embeddings(p)).sum(-1)
        neg = torch.bmm(self.v_embeddings(n), u.unsqueeze(-1)).squeeze(-1)
        return -(F.logsigmoid(pos).sum() + F.logsigmoid(-neg).sum())


def test_switchers_snippet_equals_whole_table_training():
    total_words, d = 30, 8
    model = _SkipGram(1, d)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    u_switch = gl.ModelFactory(model.u_embeddings, total_words, d, CPUPinn=True, placement="cpu")
    v_switch = gl.ModelFactory(model.v_embeddings, total_words, d, CPUPinn=True, placement="cpu")
    torch.manual_seed(0)
    u_switch.uniformDistributionInit(-0.5, 0.5)
    v_switch.zerosInit()
    u_opt = gl.OptimizerFactory(
        optimizer, total_words, d, model, "u_embeddings", CPUPinn=True, placement="cpu"
    )
    v_opt = gl.OptimizerFactory(
        optimizer, total_words, d, model, "v_embeddings", CPUPinn=True, placement="cpu"
    )
    u_opt.optInit()
    v_opt.optInit()
    ref = _SkipGram(total_words, d)
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(torch.from_numpy(u_switch.getNumpyVersion()))
        ref.v_embeddings.weight.zero_()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        center = torch.randint(0, total_words, (16,), generator=g)
        ctx = torch.randint(0, total_words, (16,), generator=g)
        neg = torch.randint(0, total_words, (16, 3), generator=g)
        lcenter = u_switch.beforeForwardPass(center)
        u_opt.beforeForwardPass(center)
        lpos, lneg = v_switch.beforeForwardPass(ctx, neg)
        v_opt.beforeForwardPass(ctx, neg)
        loss = model(lcenter, lpos, lneg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_switch.afterOptimizerStep(center)
        u_opt.afterOptimizerStep(center)
        v_switch.afterOptimizerStep(ctx, neg)
        v_opt.afterOptimizerStep(ctx, neg)
        rloss = ref(center, ctx, neg)
        ropt.zero_grad()
        rloss.backward()
        ropt.step()
        torch.testing.assert_close(loss.detach(), rloss.detach())
    torch.testing.assert_close(
        torch.from_numpy(u_switch.getNumpyVersion()), ref.u_embeddings.weight.detach()
    )
    torch.testing.assert_close(
        torch.from_numpy(v_switch.getNumpyVersion()), ref.v_embeddings.weight.detach()
    )


def _switch(rows=12, d=4):
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(1, d)
    sw = gl.ModelSwitch(model.emb, rows, d, placement="cpu")
    return model, sw


def test_switcher_savecupy_adds_npy_and_loadcupy_refuses_other_shape(tmp_path):
    model, sw = _switch()
    sw.uniformDistributionInit(-1, 1)
    vals = sw.getNumpyVersion().copy()
    sw.saveCupy(str(tmp_path / "emb"))
    assert _listing(tmp_path) == ["emb.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), vals)
    np.save(tmp_path / "other.npy", np.zeros((13, 4), np.float32))
    with pytest.raises(gl.GadgetError):
        sw.loadCupy(str(tmp_path / "other.npy"))
    np.save(tmp_path / "f64.npy", np.zeros((12, 4), np.float64))
    with pytest.raises(gl.GadgetTypeError):
        sw.loadCupy(str(tmp_path / "f64.npy"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), vals)
    sw.zerosInit()
    sw.loadCupy(str(tmp_path / "emb.npy"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), vals)


def test_switcher_savetorch_loadtorch(tmp_path):
    model, sw = _switch()
    sw.normalDistributionInit(0.0, 1.0)
    vals = sw.getNumpyVersion().copy()
    p = tmp_path / "emb.pt"
    sw.saveTorch(str(p))
    sw.zerosInit()
    sw.loadTorch(str(p))
    np.testing.assert_array_equal(sw.getNumpyVersion(), vals)
    torch.save(torch.from_numpy(vals).double(), tmp_path / "d.pt")
    sw.zerosInit()
    sw.loadTorch(str(tmp_path / "d.pt"))  # float64 of float32 values: exact
    np.testing.assert_array_equal(sw.getNumpyVersion(), vals)
    torch.save(torch.zeros(12, 4, dtype=torch.int64), tmp_path / "i.pt")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(str(tmp_path / "i.pt"))
    torch.save(torch.zeros(11, 4), tmp_path / "s.pt")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(str(tmp_path / "s.pt"))
    torch.save(torch.from_numpy(vals).double() + 1e-12, tmp_path / "inexact.pt")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(str(tmp_path / "inexact.pt"))
    np.testing.assert_array_equal(sw.getNumpyVersion(), vals)


def test_optimizer_switcher_getnumpy_is_dict_of_arrays():
    model, sw = _switch()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    osw = gl.OptimizerSwitch(opt, 12, 4, model, "emb", placement="cpu")
    osw.optInit()
    state = osw.getNumpyVersion()
    assert isinstance(state, dict) and set(state) >= {"exp_avg", "exp_avg_sq"}
    assert all(isinstance(v, np.ndarray) and v.shape == (12, 4) for v in state.values())
    assert not hasattr(osw, "saveCupy")


def test_switcher_table_changes_refused_mid_step():
    model, sw = _switch()
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    ids = torch.tensor([1, 5])
    sw.beforeForwardPass(ids)
    with pytest.raises(gl.GadgetValueError):
        sw.zerosInit()
    with pytest.raises(gl.GadgetValueError):
        sw.table.insertData(np.zeros((1, 4), np.float32), [0])
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many([sw.table], [torch.zeros(2, 4)], [0, 1])
    sw.afterOptimizerStep(ids)
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_switcher_duplicates_map_to_one_local_row():
    model, sw = _switch()
    local = sw.beforeForwardPass(torch.tensor([7, 3, 7]))
    assert local[0] == local[2] and local[0] != local[1]
    np.testing.assert_array_equal(
        model.emb.weight.detach()[local].numpy(), sw.getNumpyVersion()[[7, 3, 7]]
    )


@pytest.mark.parametrize("dev", ["cpu", torch.device("cpu")])
def test_pytorch_factories_device_type_cpu(dev):
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(1, 4)
    sw = gl.PytorchModelFactory(model.emb, 10, 4, deviceType=dev)
    assert sw is not None
    sw.zerosInit()
    assert not sw.getNumpyVersion().any()


# ----------------------------------------------------------------------------- Errors


def test_error_hierarchy():
    pairs = [
        (gl.GadgetIndexError, IndexError),
        (gl.GadgetTypeError, TypeError),
        (gl.GadgetValueError, ValueError),
        (gl.GadgetKeyError, KeyError),
        (gl.GadgetFileNotFoundError, FileNotFoundError),
        (gl.ReadOnlyError, PermissionError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, gl.GadgetError) and issubclass(cls, builtin)
    assert issubclass(gl.GadgetFileNotFoundError, gl.GadgetFileError)
    for cls in (
        gl.GadgetFileError,
        gl.ReadOnlyError,
        gl.GadgetClosedError,
        gl.MissingDependencyError,
    ):
        assert issubclass(cls, gl.GadgetError)


def test_none_and_bytes_paths_are_type_errors(tmp_path):
    g = _g(_arr())
    for call in (g.save, g.load, g.saveCupy, g.loadCupy):
        with pytest.raises(gl.GadgetTypeError):
            call(None)
        with pytest.raises(gl.GadgetTypeError):
            call(os.fsencode(str(tmp_path / "x.npy")))
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(None)
    np.save(tmp_path / "ok.npy", _arr())
    g.load(os.fsdecode(os.fsencode(str(tmp_path / "ok.npy"))))
    np.testing.assert_array_equal(_rows(g), _arr())


@pytest.mark.parametrize("bad", [[1, 2], "state", None])
def test_state_dict_not_a_dict_is_type_error(bad):
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        opt.load_state_dict(bad)


@pytest.mark.parametrize(
    "make",
    [
        lambda: gl.DataGadget(_arr(), placement="gpu-ish"),
        lambda: gl.DataGadget(_arr(), placement="cpu", strategy="fastest"),
        lambda: gl.GadgetSampler(10, batch_size=2, order="zigzag"),
    ],
)
def test_unknown_names_are_key_errors_listing_valid(make):
    with pytest.raises(gl.GadgetKeyError) as ei:
        make()
    assert isinstance(ei.value, KeyError)
    assert "," in str(ei.value) or " or " in str(ei.value)


def test_import_needs_only_numpy_torch_tqdm():
    code = (
        "import sys\n"
        "for m in ('h5py', 'zarr', 'cupy', 'matplotlib', 'torchdata', 'hypothesis'):\n"
        "    sys.modules[m] = None\n"
        "import gadgetloader as gl\n"
        "g = gl.DataGadget([[1.0, 2.0]], dtype='float32', placement='cpu', device='cpu')\n"
        "print(g.getData([0], device='cpu').tolist())\n"
    )
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert "[[1.0, 2.0]]" in r.stdout


# ----------------------------------------------------------------------------- word2vec


def test_word2vec_example_runs_and_writes_vectors(tmp_path):
    words = [
        "king",
        "queen",
        "man",
        "woman",
        "prince",
        "princess",
        "royal",
        "crown",
        "throne",
        "palace",
    ]
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, 12)) for _ in range(80)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "vectors"
    r = _run(
        "-m", "datasets.word2vec", str(corpus), "--dim", "16", "--epochs", "1",
        "--out", str(out), "--show", "king,Queen,zzz", "--no-progress", "--device", "cpu",
        "--placement", "cpu",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    vec = np.load(str(out) + ".npy")
    lines = Path(str(out) + ".vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab = [ln.split()[0] for ln in lines if ln.strip()]
    assert vec.shape == (len(vocab), 16) and set(vocab) == set(words)
    assert np.isfinite(vec).all()
    assert "zzz" in r.stdout + r.stderr
    assert "queen" in r.stdout  # lower-cased like the corpus


def test_word2vec_bad_arguments(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b a b a b\n", encoding="utf-8")
    r = _run("-m", "datasets.word2vec", str(corpus), "--seed", "-1", "--no-progress")
    assert r.returncode == 2
    one = tmp_path / "one.txt"
    one.write_text("a a a a a\n", encoding="utf-8")
    r = _run("-m", "datasets.word2vec", str(one), "--no-progress", "--out", str(tmp_path / "v"))
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "v.npy").exists()


# ----------------------------------------------------------------------------- more claims


def test_bench_cpu_runs_checks_and_lists_what_it_skipped(tmp_path):
    js = tmp_path / "b.json"
    r = _run(
        "-m", "gadgetloader", "bench", "seed", "--rows", "1000", "--ids", "5000",
        "--width", "4", "--repeats", "1", "--json", str(js),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    head = r.stdout
    for col in ("of limit", "x naive", "check"):
        assert col in head
    assert "skip" in (r.stdout + r.stderr).lower()
    import json

    data = json.loads(js.read_text())
    assert data["ids"] == 1000  # capped to --rows, the report gives the count used
    assert data["results"] and all(x["check"] == "ok" for x in data["results"])


def test_state_tables_are_views_and_gather_many_moves_wide_rows():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 2, 2])).pow(2).sum().backward()
    opt.step()
    tables = opt.pagers[0].tables
    sd = opt.state_dict()["tables"][0]
    names = list(tables)
    ids = torch.tensor([2, 0, 1])
    got = gl.gather_many([emb.weight, *tables.values()], ids, device="cpu")
    assert torch.equal(got[0], _table(emb)[ids])
    for name, t in zip(names, got[1:], strict=True):
        assert torch.equal(t.cpu(), sd[name][ids])
    gl.scatter_many([emb.weight, *tables.values()], [torch.zeros(1, 4)] * 3, [1])
    assert not _table(emb)[1].any()
    sd2 = opt.state_dict()["tables"][0]
    assert all(not sd2[n][1].any() for n in names)
    assert torch.equal(sd2[names[0]][2], sd[names[0]][2])


def test_pickled_interleaved_cpu_table_is_ordinary():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    c = pickle.loads(pickle.dumps(emb.weight))
    assert c.shape == (20, 4)
    np.testing.assert_array_equal(c.getNumpyVersion(), _table(emb).numpy())
    c.fill_(3.0)
    assert not (_table(emb) == 3.0).all()
    assert opt is not None


def _adam_ref_row(w0, grads, extra_counts):
    """torch Adam on one row: ``grads`` per stepped step; ``extra_counts[i]`` steps counted
    without a change before the i-th gradient."""
    p = torch.nn.Parameter(w0.clone())
    o = torch.optim.Adam([p], lr=0.1)
    for g, extra in zip(grads, extra_counts, strict=True):
        if extra and o.state:
            o.state[p]["step"] += extra
        p.grad = g.clone()
        o.step()
    return p.detach()


def test_table_without_lookup_is_not_stepped_step_count_stays():
    emb, _ = _dense_pair()
    w0 = _table(emb)[1]
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.step()  # no lookup since: not stepped
    emb(torch.tensor([1])).mul(3).sum().backward()
    opt.step()
    ref = _adam_ref_row(w0, [torch.ones(4), torch.full((4,), 3.0)], [0, 0])
    assert torch.equal(_table(emb)[1], ref)


def test_empty_lookup_counts_a_step_and_changes_no_row():
    emb, _ = _dense_pair()
    w0 = _table(emb)[1]
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    mid = _table(emb)
    out = emb(torch.tensor([], dtype=torch.int64))
    assert out.shape == (0, 4)
    (out.sum() + 0.0).backward()
    opt.step()
    assert torch.equal(_table(emb), mid)
    emb(torch.tensor([1])).mul(3).sum().backward()
    opt.step()
    ref = _adam_ref_row(w0, [torch.ones(4), torch.full((4,), 3.0)], [0, 1])
    assert torch.equal(_table(emb)[1], ref)


def test_load_retires_waiting_lookup_and_late_gradient_is_reported():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    out = emb(torch.tensor([3]))
    emb.load_state_dict({"weight": torch.full((20, 4), 0.5)})
    out.sum().backward()
    with pytest.raises(gl.GadgetError, match="before its rows were loaded"):
        opt.step()
    np.testing.assert_array_equal(_table(emb).numpy(), 0.5)


def test_sgd_dampening_starts_momentum_at_zero():
    emb, _ = _dense_pair()
    before = _table(emb)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0, momentum=0.9, dampening=0.5)
    emb(torch.tensor([2])).sum().backward()
    opt.step()
    # buf = 0.9 * 0 + (1 - 0.5) * grad, where torch would start it at grad
    torch.testing.assert_close(_table(emb)[2], before[2] - 0.5, rtol=0, atol=1e-6)


def test_numpy_number_options_count_as_values():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=np.float32(0.5), momentum=np.float32(0.9))
    ropt = torch.optim.SGD(
        ref.parameters(), lr=float(np.float32(0.5)), momentum=float(np.float32(0.9))
    )
    ids = torch.arange(20)
    for _ in range(2):
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()
        ropt.zero_grad()
        ref(ids).pow(2).sum().backward()
        ropt.step()
    torch.testing.assert_close(_table(emb), ref.weight.detach())
    assert set(opt.pagers[0].tables) == {"momentum_buffer"}


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (torch.optim.Adam, {"lr": 0.05, "amsgrad": True}),
        (torch.optim.AdamW, {"lr": 0.05}),
        (torch.optim.Adamax, {"lr": 0.05}),
        (torch.optim.Adadelta, {"lr": 1.0}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
        (torch.optim.Rprop, {"lr": 0.05}),
        (torch.optim.ASGD, {"lr": 0.05}),
        (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
        (torch.optim.NAdam, {"lr": 0.05}),
        (torch.optim.RAdam, {"lr": 0.05}),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "",
)
def test_listed_optimizers_match_dense_torch_when_every_row_is_looked_up(cls, kw):
    emb, ref = _dense_pair(12, 3)
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    ropt = cls(ref.parameters(), **kw)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        ids = torch.cat([torch.randperm(12, generator=g), torch.randint(0, 12, (5,), generator=g)])
        w = torch.randn(ids.shape[0], 3, generator=g)
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        ropt.zero_grad()
        (ref(ids) * w).sum().backward()
        ropt.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_sparse_adam_matches_sparse_embedding_to_rounding():
    emb, ref = _dense_pair(12, 3)
    ref.sparse = True
    opt = gl.OffloadedOptimizer(torch.optim.SparseAdam, emb, lr=0.05)
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        ids = torch.randint(0, 12, (6,), generator=g)
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()
        ropt.zero_grad()
        ref(ids).pow(2).sum().backward()
        ropt.step()
    torch.testing.assert_close(_table(emb), ref.weight.detach())


def test_half_lookups_and_averaged_model_leaves_tables():
    emb, _ = _dense_pair()
    model = torch.nn.ModuleDict({"e": emb})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=1.0)
    avg = torch.optim.swa_utils.AveragedModel(model)
    before = _table(emb)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    avg.update_parameters(model)
    assert torch.equal(_table(avg.module["e"]), before)
    emb.half()
    out = emb(torch.tensor([1]))
    assert out.dtype == torch.float16 and emb.weight.dtype == torch.float32


def test_checkpoint_keeps_numpy_option_types(tmp_path):
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1, momentum=np.float64(0.9))
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    gl.save_checkpoint(str(tmp_path / "ck"), {"m": emb, "o": opt})
    emb2, _ = _dense_pair(seed=3)
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb2, lr=0.1, momentum=0.9)
    gl.load_checkpoint(str(tmp_path / "ck"), {"m": emb2, "o": opt2})
    assert type(opt2.param_groups[0]["momentum"]) is np.float64
    assert torch.equal(_table(emb2), _table(emb))


def test_checkpoint_damaged_zarr_chunk_raises_file_error_and_changes_nothing(tmp_path):
    _zarr()
    model, opt = _trained()
    _train_steps(model, opt, 1, seed=1)
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt}, format="zarr")
    chunks = [
        p
        for p in ck.rglob("*")
        if p.is_file() and p.name not in ("meta.pt", "zarr.json", ".zarray", ".zattrs", ".zgroup")
    ]
    assert chunks
    for c in chunks:
        c.write_bytes(b"\x00garbage" * 8)
    m2, o2 = _trained(seed=3)
    before = _table(m2["item"])
    hw = m2["head"].weight.detach().clone()
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(str(ck), {"model": m2, "optimizer": o2})
    assert torch.equal(_table(m2["item"]), before)
    assert torch.equal(m2["head"].weight.detach(), hw)


def test_checkpoint_cut_npy_table_refused(tmp_path):
    model, opt = _trained()
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt}, format="npy")
    npys = sorted(ck.glob("*.npy"))
    assert npys
    data = npys[0].read_bytes()
    npys[0].write_bytes(data[:-8])
    m2, o2 = _trained(seed=3)
    before = _table(m2["item"])
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(str(ck), {"model": m2, "optimizer": o2}, verify=False)
    assert torch.equal(_table(m2["item"]), before)


def test_checkpoint_of_switched_model_needs_its_switchers(tmp_path):
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(1, 4)
    sw = gl.ModelSwitch(model.emb, 12, 4, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    ck = tmp_path / "ck"
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(str(ck), {"model": model})
    assert not ck.exists() or _listing(ck) == []
    gl.save_checkpoint(str(ck), {"model": model, "sw": sw})
    model2 = torch.nn.Module()
    model2.emb = torch.nn.Embedding(1, 4)
    sw2 = gl.ModelSwitch(model2.emb, 12, 4, placement="cpu")
    gl.load_checkpoint(str(ck), {"model": model2, "sw": sw2})
    np.testing.assert_array_equal(sw2.getNumpyVersion(), sw.getNumpyVersion())


def test_sampler_chunk_order_shuffles_within_windows():
    s = gl.GadgetSampler(24, batch_size=4, order="chunk", chunk_rows=4, window_chunks=1, seed=3)
    order = torch.cat([b.clone() for b in s]).tolist()
    assert sorted(order) == list(range(24))
    for k in range(0, 24, 4):
        group = order[k : k + 4]
        assert len({x // 4 for x in group}) == 1  # one chunk per window
    seq = [
        b.tolist()
        for b in gl.GadgetSampler(
            24, batch_size=4, order="sequential", chunk_rows=4, window_chunks=2
        )
    ]
    assert sum(seq, []) == list(range(24))
    r1 = torch.cat([b.clone() for b in gl.GadgetSampler(24, batch_size=4, seed=9)])
    r2 = torch.cat(
        [
            b.clone()
            for b in gl.GadgetSampler(24, batch_size=4, seed=9, chunk_rows=4, window_chunks=2)
        ]
    )
    assert torch.equal(r1, r2)


def test_drop_last_with_ranks_refused_below_replicas_times_batch():
    with pytest.raises(gl.GadgetError):
        gl.GadgetSampler(7, batch_size=4, num_replicas=2, rank=0, drop_last=True)
    s = gl.GadgetSampler(9, batch_size=4, num_replicas=2, rank=1, drop_last=True)
    assert [len(b) for b in s] == [4]


def test_pickled_sampler_keeps_rank():
    s = gl.GadgetSampler(20, batch_size=3, num_replicas=2, rank=1, seed=4)
    s2 = pickle.loads(pickle.dumps(s))
    a = [b.tolist() for b in s]
    b = [b.tolist() for b in s2]
    assert a == b


def test_state_saved_after_last_batch_resumes_with_empty_pass_then_next_epoch():
    s = gl.GadgetSampler(12, batch_size=4, seed=1)
    it = iter(s)
    for _ in range(3):
        next(it)
    state = s.state_dict()
    nxt = [b.clone() for b in s]  # the next epoch
    r = gl.GadgetSampler(12, batch_size=4, seed=1)
    r.load_state_dict(state)
    assert list(r) == []
    again = [b.clone() for b in r]
    assert [a.tolist() for a in again] == [b.tolist() for b in nxt]


def test_loaded_position_holds_until_a_batch_is_drawn_and_set_epoch_keeps_it():
    s = gl.GadgetSampler(20, batch_size=4, seed=2)
    s.set_epoch(3)
    it = iter(s)
    next(it)
    next(it)
    state = s.state_dict()
    rest = [b.clone() for b in it]
    r = gl.GadgetSampler(20, batch_size=4, seed=2)
    r.load_state_dict(state)
    iter(r)  # draws nothing
    r.set_epoch(3)  # the loaded epoch: keeps the position
    got = [b.clone() for b in r]
    assert [a.tolist() for a in got] == [b.tolist() for b in rest]


def test_state_after_break_reads_epoch_start_of_new_pass():
    s = gl.GadgetSampler(20, batch_size=4, seed=2)
    for _ in s:
        break
    it = iter(s)
    state = s.state_dict()
    first = next(it).clone()
    r = gl.GadgetSampler(20, batch_size=4, seed=2)
    r.load_state_dict(state)
    assert torch.equal(next(iter(r)), first)


def test_gadget_loader_coalesce_keeps_batches():
    _, _, ds = _ds(37)
    a = [y.clone() for _, y in gl.GadgetLoader(ds, batch_size=4, seed=6, coalesce=1)]
    b = [y.clone() for _, y in gl.GadgetLoader(ds, batch_size=4, seed=6, coalesce=4)]
    assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_gadget_loader_follows_its_sampler_set_epoch():
    _, _, ds = _ds(20)
    s = gl.GadgetSampler(ds, batch_size=4, seed=8)
    ref = gl.GadgetSampler(ds, batch_size=4, seed=8)
    ref.set_epoch(5)
    exp = [b.tolist() for b in ref]
    s.set_epoch(5)
    ld = gl.GadgetLoader(ds, sampler=s)
    got = [(y // 10).tolist() for _, y in ld]
    assert got == exp


def test_stack_dataset_refuses_with_size_mismatch():
    from torch.utils.data import StackDataset

    _, _, ds = _ds(8)
    sd = StackDataset(ds, ds)
    with pytest.raises(ValueError, match="size mismatch"):
        next(iter(DataLoader(sd, batch_size=4)))


def test_file_table_saved_over_its_own_file_keeps_dataset_name(tmp_path):
    h5py = _h5py()
    p = tmp_path / "d.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("emb/words", data=_arr())
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    g.insertData(np.full((1, 4), 5, np.float32), [0])
    g.save(str(p))
    with h5py.File(p, "r") as f:
        assert "emb/words" in f
        assert f["emb/words"][0, 0] == 5
    g.close()


def test_zarr_save_refuses_non_empty_non_zarr_folder(tmp_path):
    _zarr()
    d = tmp_path / "t.zarr"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    with pytest.raises(gl.GadgetError):
        _g(_arr()).save(str(d))
    assert (d / "keep.txt").read_text() == "mine"


def test_zarr_missing_chunk_reads_as_fill_value_and_damaged_chunk_blocks_write(tmp_path):
    zarr = _zarr()
    p = tmp_path / "t.zarr"
    z = zarr.open_array(
        str(p), mode="w", shape=(16, 2), chunks=(4, 2), dtype="float32", fill_value=0
    )
    z[:] = np.arange(32, dtype=np.float32).reshape(16, 2) + 1
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.name != "zarr.json")
    assert len(files) == 4
    files[1].unlink()  # rows 4:8
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    np.testing.assert_array_equal(g.getData([4, 0], device="cpu").numpy(), [[0, 0], [1, 2]])
    g.close()
    files[2].write_bytes(b"\x00bad")  # rows 8:12, damaged
    good3 = files[3].read_bytes()
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    with pytest.raises(gl.GadgetFileError):
        g.insertData(np.zeros((2, 2), np.float32), [12, 9])  # a good chunk and a damaged one
    assert files[3].read_bytes() == good3
    g.close()


def test_deleted_file_table_raises_file_error(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    g.getData([0], device="cpu")
    p.unlink()
    with pytest.raises(gl.GadgetFileError):
        g.getData([0], device="cpu")
    g.close()


def test_hdf5_external_link_is_read_only_naming_file_and_dataset(tmp_path):
    h5py = _h5py()
    with h5py.File(tmp_path / "real.h5", "w") as f:
        f.create_dataset("emb", data=_arr())
    with h5py.File(tmp_path / "link.h5", "w") as f:
        f["emb"] = h5py.ExternalLink("real.h5", "/emb")
    g = gl.DataGadget(str(tmp_path / "link.h5"), dataset="emb", placement="file", device="cpu")
    np.testing.assert_array_equal(g.getData([3], device="cpu").numpy(), _arr()[[3]])
    with pytest.raises(gl.ReadOnlyError, match="real.h5"):
        g.insertData(np.zeros((1, 4), np.float32), [3])
    g.close()


def test_hdf5_virtual_dataset_with_missing_source_is_file_error(tmp_path):
    h5py = _h5py()
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f.create_dataset("x", data=_arr())
    layout = h5py.VirtualLayout(shape=(10, 4), dtype="float32")
    layout[:] = h5py.VirtualSource(str(tmp_path / "src.h5"), "x", shape=(10, 4))
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f.create_virtual_dataset("v", layout, fillvalue=0)
    g = gl.DataGadget(str(tmp_path / "v.h5"), placement="file", device="cpu")
    np.testing.assert_array_equal(g.getData([2], device="cpu").numpy(), _arr()[[2]])
    g.close()
    (tmp_path / "src.h5").unlink()
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(str(tmp_path / "v.h5"), placement="file", device="cpu")


def test_word2vec_more_bad_arguments(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b c a b c\n", encoding="utf-8")
    r = _run("-m", "datasets.word2vec", str(corpus), "--device", "tpu", "--no-progress")
    assert r.returncode == 2
    r = _run("-m", "datasets.word2vec", str(corpus), "--lr", "inf", "--no-progress")
    assert r.returncode == 2


# ----------------------------------------------------------------------------- indexing details


def test_zero_d_and_scalar_ids_give_row_shape():
    a = _arr()
    g = _g(a)
    assert g.getData(torch.tensor(3), device="cpu").shape == (4,)
    np.testing.assert_array_equal(g.getData(torch.tensor(3), device="cpu").numpy(), a[3])
    np.testing.assert_array_equal(g[np.int64(7)].cpu().numpy(), a[7])


def test_array_and_tensor_in_tuple_index_and_huge_slice_bounds():
    a = _arr(10, 6)
    g = _g(a)
    np.testing.assert_array_equal(g[np.array([1, 2]), 0].cpu().numpy(), a[[1, 2], 0])
    np.testing.assert_array_equal(
        g[torch.tensor([[1, 2], [3, 4]]), 1:3].cpu().numpy(), a[[[1, 2], [3, 4]], 1:3]
    )
    np.testing.assert_array_equal(g[[5], 2 : 10**30].cpu().numpy(), a[[5], 2 : 10**30])
    np.testing.assert_array_equal(g[[5], -(10**30) : 3].cpu().numpy(), a[[5], -(10**30) : 3])


def test_three_d_rows_index_each_row():
    a = np.arange(5 * 2 * 3, dtype=np.float32).reshape(5, 2, 3)
    g = _g(a)
    assert g.shape == (5, 2, 3)
    np.testing.assert_array_equal(g.getData([4, 0], device="cpu").numpy(), a[[4, 0]])
    np.testing.assert_array_equal(g[[1, 3], 1, 0:2].cpu().numpy(), a[[1, 3], 1, 0:2])
    np.testing.assert_array_equal(g[[1, 3], -1, -1].cpu().numpy(), a[[1, 3], -1, -1])
    g.insertData(np.zeros((2, 2), np.float32), ([1, 3], 1, slice(0, 2)))
    ref = a.copy()
    ref[[1, 3], 1, 0:2] = 0
    np.testing.assert_array_equal(_rows(g), ref)


@pytest.mark.parametrize(
    ("table", "data"),
    [
        ("int64", np.ones((1, 4), np.int32)),
        ("float16", torch.ones(1, 4)),
        ("float32", torch.ones(1, 4, dtype=torch.bfloat16)),
        ("bool", np.ones((1, 4), np.uint8)),
    ],
)
def test_insert_wants_table_dtype_exactly(table, data):
    g = _g((3, 4), dtype=table)
    before = _rows(g)
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(data, [0])
    np.testing.assert_array_equal(_rows(g), before)


def test_loadcupy_takes_file_shape_and_dtype(tmp_path):
    g = _g(_arr())
    np.save(tmp_path / "o.npy", np.arange(6, dtype=np.float64).reshape(3, 2))
    g.loadCupy(str(tmp_path / "o.npy"))
    assert g.shape == (3, 2) and g.dtype == torch.float64
    np.testing.assert_array_equal(_rows(g), np.arange(6).reshape(3, 2))


@pytest.mark.parametrize(("ext", "comp"), [("h5", "zstd"), ("h5", "blosc"), ("zarr", "lzf")])
def test_compression_per_format_refused_before_any_file(tmp_path, ext, comp):
    if ext == "h5":
        _h5py()
    else:
        _zarr()
    with pytest.raises(gl.GadgetError):
        _g(_arr()).save(str(tmp_path / f"t.{ext}"), compression=comp)
    assert _listing(tmp_path) == []


def test_hdf5_lzf_and_zarr_blosc_roundtrip(tmp_path):
    _h5py()
    _zarr()
    a = _arr(30, 5)
    _g(a).save(str(tmp_path / "t.h5"), compression="lzf")
    _g(a).save(str(tmp_path / "t.zarr"), compression="blosc", dataset="emb")
    np.testing.assert_array_equal(_rows(_g(str(tmp_path / "t.h5"))), a)
    np.testing.assert_array_equal(_rows(_g(str(tmp_path / "t.zarr"), dataset="emb")), a)


def test_zarr_group_dataset_name(tmp_path):
    zarr = _zarr()
    grp = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    grp.create_array("a", shape=(4, 2), dtype="float32")[:] = 1
    grp.create_array("b", shape=(5, 2), dtype="float32")[:] = 2
    g = _g(str(tmp_path / "g.zarr"), dataset="b")
    assert g.shape == (5, 2)
    np.testing.assert_array_equal(_rows(g), 2)
    with pytest.raises(gl.GadgetKeyError, match="a"):
        _g(str(tmp_path / "g.zarr"), dataset="c")


def test_forced_format_overrides_extension(tmp_path):
    p = tmp_path / "really_npy.h5"
    with open(p, "wb") as f:
        np.save(f, _arr())
    np.testing.assert_array_equal(_rows(_g(str(p), format="npy")), _arr())


def test_uint_file_value_that_does_not_fit_stops_the_load(tmp_path):
    np.save(tmp_path / "u.npy", np.array([[1], [4000000000]], np.uint32))
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(str(tmp_path / "u.npy"), dtype="int32", placement="cpu")
    np.save(tmp_path / "u64.npy", np.array([[1], [2**63]], np.uint64))
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(str(tmp_path / "u64.npy"), dtype="int64", placement="cpu")


def test_external_link_target_replaced_is_file_error(tmp_path):
    h5py = _h5py()
    with h5py.File(tmp_path / "real.h5", "w") as f:
        f.create_dataset("emb", data=_arr())
    with h5py.File(tmp_path / "link.h5", "w") as f:
        f["emb"] = h5py.ExternalLink("real.h5", "/emb")
    g = gl.DataGadget(str(tmp_path / "link.h5"), dataset="emb", placement="file", device="cpu")
    g.getData([0], device="cpu")
    _g(_arr() + 1).save(str(tmp_path / "real.h5"), dataset="emb")
    with pytest.raises(gl.GadgetFileError):
        g.getData([0], device="cpu")
    g.close()


def test_cli_convert_complex_source_exit_1(tmp_path, capsys):
    np.save(tmp_path / "c.npy", np.ones((3, 2), np.complex64))
    rc, _, err = _cli(["convert", str(tmp_path / "c.npy"), str(tmp_path / "d.npy")], capsys)
    assert rc == 1, err
    assert not (tmp_path / "d.npy").exists()


def test_cli_bench_sweep_unknown_strategy_exit_2(capsys):
    rc, _, err = _cli(["bench", "sweep", "--strategies", "kernel,bogus"], capsys)
    assert rc == 2
    assert "bench sweep: error:" in err and "bogus" in err


# ----------------------------------------------------------------------------- more pipeline / training


def test_dataset_columns_of_every_kind_and_slices(tmp_path):
    h5py = _h5py()
    a = _arr(12, 3)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("x", data=a + 1)
    ds = gl.GadgetDataset(
        _g(a),
        torch.from_numpy(a * 2),
        str(tmp_path / "f.h5"),
        np.arange(12),
        placement="cpu",
        device="cpu",
    )
    c0, c1, c2, c3 = ds[2:5]
    np.testing.assert_array_equal(c0.numpy(), a[2:5])
    np.testing.assert_array_equal(c1.numpy(), a[2:5] * 2)
    np.testing.assert_array_equal(c2.numpy(), a[2:5] + 1)
    np.testing.assert_array_equal(c3.numpy(), [2, 3, 4])
    c0, *_ = ds[-3:]
    np.testing.assert_array_equal(c0.numpy(), a[-3:])


def test_bag_forward_matches_torch_for_2d_and_offsets():
    torch.manual_seed(0)
    w = torch.randn(10, 3)
    for mode in ("sum", "mean", "max"):
        bag = gl.OffloadedEmbeddingBag(10, 3, mode=mode, placement="cpu", device="cpu")
        bag.weight.insertData(w.clone(), torch.arange(10))
        x2 = torch.tensor([[1, 2, 2], [9, 0, 4]])
        torch.testing.assert_close(bag(x2), F.embedding_bag(x2, w, mode=mode), rtol=0, atol=0)
        flat = torch.tensor([1, 2, 9, 0, 4, 4])
        off = torch.tensor([0, 2, 5])
        torch.testing.assert_close(
            bag(flat, off), F.embedding_bag(flat, w, off, mode=mode), rtol=0, atol=0
        )
    bag = gl.OffloadedEmbeddingBag(
        10, 3, mode="sum", placement="cpu", device="cpu", include_last_offset=True
    )
    bag.weight.insertData(w.clone(), torch.arange(10))
    off = torch.tensor([0, 2, 6])
    torch.testing.assert_close(
        bag(flat, off),
        F.embedding_bag(flat, w, off, mode="sum", include_last_offset=True),
        rtol=0,
        atol=0,
    )


def test_one_cycle_lr_follows_torch():
    emb, ref = _dense_pair(12, 3)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.01)
    sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)
    rsch = torch.optim.lr_scheduler.OneCycleLR(ropt, max_lr=0.1, total_steps=6)
    ids = torch.arange(12)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        w = torch.randn(12, 3, generator=g)
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        sch.step()
        ropt.zero_grad()
        (ref(ids) * w).sum().backward()
        ropt.step()
        rsch.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_cyclic_lr_turning_momentum_on_follows_torch():
    emb, ref = _dense_pair(12, 3)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.01)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01)
    kw = {
        "base_lr": 0.01,
        "max_lr": 0.1,
        "step_size_up": 2,
        "base_momentum": 0.8,
        "max_momentum": 0.9,
    }
    sch = torch.optim.lr_scheduler.CyclicLR(opt, **kw)
    rsch = torch.optim.lr_scheduler.CyclicLR(ropt, **kw)
    ids = torch.arange(12)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        w = torch.randn(12, 3, generator=g)
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        sch.step()
        ropt.zero_grad()
        (ref(ids) * w).sum().backward()
        ropt.step()
        rsch.step()
    assert "momentum_buffer" in opt.pagers[0].tables
    assert torch.equal(_table(emb), ref.weight.detach())


@pytest.mark.parametrize("cls", [torch.optim.Rprop, torch.optim.ASGD], ids=["Rprop", "ASGD"])
def test_warmed_lr_before_first_step_follows_torch(cls):
    emb, ref = _dense_pair(12, 3)
    opt = gl.OffloadedOptimizer(cls, emb, lr=0.1)
    ropt = cls(ref.parameters(), lr=0.1)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.1 * (e + 1))
    rsch = torch.optim.lr_scheduler.LambdaLR(ropt, lambda e: 0.1 * (e + 1))
    ids = torch.arange(12)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        w = torch.randn(12, 3, generator=g)
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        sch.step()
        ropt.zero_grad()
        (ref(ids) * w).sum().backward()
        ropt.step()
        rsch.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_weight_requires_grad_false_and_module_zero_grad():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    before = _table(emb)
    emb.weight.requires_grad = False
    assert not emb(torch.tensor([1])).requires_grad
    emb.weight.requires_grad = True
    emb(torch.tensor([1])).sum().backward()
    emb.zero_grad()
    opt.step()
    assert torch.equal(_table(emb), before)


def test_table_belongs_to_one_optimizer_at_a_time():
    import gc

    emb, _ = _dense_pair()
    opt1 = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt1.step()
    del opt1
    gc.collect()
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    before = _table(emb)
    emb(torch.tensor([2])).sum().backward()
    opt2.step()
    torch.testing.assert_close(_table(emb)[2], before[2] - 1.0)


def test_module_load_state_dict_loads_fitting_tables_then_raises():
    model = torch.nn.ModuleDict(
        {
            "a": gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu"),
            "b": gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu"),
        }
    )
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        model.load_state_dict({"a.weight": torch.full((5, 2), 3.0), "b.weight": torch.zeros(7, 2)})
    np.testing.assert_array_equal(_table(model["a"]).numpy(), 3.0)


def test_optimizer_load_state_dict_converts_float64_state():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd64 = copy.deepcopy(sd)
    for t in sd64["tables"]:
        for k in t:
            t[k] = t[k].double() + 1e-12
    emb2, _ = _dense_pair()
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb2, lr=0.1)
    opt2.load_state_dict(sd64)
    got = opt2.state_dict()["tables"][0]
    for k, v in sd64["tables"][0].items():
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], v.float())


def test_checkpoint_refuses_other_dtype_and_scheduler(tmp_path):
    e64 = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu", dtype=torch.float64)
    gl.save_checkpoint(str(tmp_path / "ck"), {"m": e64})
    e32 = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    e32.weight.fill_(1.0)
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"m": e32})
    np.testing.assert_array_equal(_table(e32).numpy(), 1.0)
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    sch = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(str(tmp_path / "ck2"), {"m": emb, "sch": sch})
    assert not (tmp_path / "ck2").exists() or _listing(tmp_path / "ck2") == []


# ----------------------------------------------------------------------------- batches changed in place, workers


def test_general_path_list_errors():
    _, _, ds = _ds(10)
    for bad in ([1.0, 2], [True, 1], ["1", 2]):
        with pytest.raises(gl.GadgetTypeError):
            ds.__getitems__(bad)
    x, y = ds.__getitems__([np.int64(1), torch.tensor(2), 3])[0]
    np.testing.assert_array_equal(y.numpy(), [10, 20, 30])


def test_batch_changed_in_place_is_checked_by_host_columns_and_replayed():
    _, labels, ds = _ds(10)
    s = gl.GadgetSampler(ds, batch_size=5, order="sequential")
    b = next(iter(s))
    b.numpy()[0] = 10**6  # through NumPy: host columns check anyway
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__(b)
    b2 = next(iter(gl.GadgetSampler(ds, batch_size=5, order="sequential")))
    b2[1] = 50  # through torch: loses the tag
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__(b2)


@pytest.mark.parametrize("order", ["random", "chunk", "sequential"])
def test_batch_changed_in_place_changes_the_epochs_replay(order):
    """README: changing a batch in place changes that epoch's cached order (random and
    chunk orders), so a replay of the epoch sees the change; the sequential order makes
    its ids anew for a replay."""
    s = gl.GadgetSampler(10, batch_size=5, order=order, seed=0, chunk_rows=2)
    s.set_epoch(0)
    first = next(iter(s))
    was = first[0].item()
    new = 7 if was != 7 else 8
    first[0] = new
    s.set_epoch(0)
    assert next(iter(s))[0].item() == (was if order == "sequential" else new)


def test_gadget_loader_with_sampler_refuses_drop_last():
    _, _, ds = _ds(12)
    s = gl.GadgetSampler(ds, batch_size=4)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=s, drop_last=True)


def test_workers_reopen_file_columns(tmp_path):
    h5py = _h5py()
    a = _arr(24, 3)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("x", data=a)
    np.save(tmp_path / "y.npy", np.arange(24)[:, None].astype(np.int64))
    ds = gl.GadgetDataset(
        gl.DataGadget(str(tmp_path / "f.h5"), placement="file", device="cpu"),
        gl.DataGadget(str(tmp_path / "y.npy"), placement="file", device="cpu"),
        device="cpu",
    )
    s = gl.GadgetSampler(ds, batch_size=6, seed=1)
    seen = []
    for x, y in DataLoader(ds, batch_sampler=s, num_workers=2):
        assert x.device.type == "cpu"
        np.testing.assert_array_equal(x.numpy(), a[y[:, 0].numpy()])
        seen.extend(y[:, 0].tolist())
    assert sorted(seen) == list(range(24))


# ----------------------------------------------------------------------------- more optimizer claims


def test_optimizer_torch_save_is_type_error():
    import io

    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    with pytest.raises(gl.GadgetTypeError):
        torch.save(opt, io.BytesIO())


def test_subclass_passing_kwargs_is_probed_with_group_options():
    class MyAdam(torch.optim.Adam):
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)

    emb, ref = _dense_pair(12, 3)
    opt = gl.OffloadedOptimizer(MyAdam, emb, lr=0.05, amsgrad=True)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05, amsgrad=True)
    ids = torch.arange(12)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        w = torch.randn(12, 3, generator=g)
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        ropt.zero_grad()
        (ref(ids) * w).sum().backward()
        ropt.step()
    assert "max_exp_avg_sq" in opt.pagers[0].tables
    assert torch.equal(_table(emb), ref.weight.detach())


def test_adagrad_initial_accumulator_from_constructor_only():
    emb, ref = _dense_pair(12, 3)
    opt = gl.OffloadedOptimizer(
        torch.optim.Adagrad, [{"params": emb, "initial_accumulator_value": 5.0}], lr=0.1,
        initial_accumulator_value=0.25,
    )  # fmt: skip
    ropt = torch.optim.Adagrad(
        [{"params": ref.parameters(), "initial_accumulator_value": 5.0}], lr=0.1,
        initial_accumulator_value=0.25,
    )  # fmt: skip
    ids = torch.arange(12)
    opt.zero_grad()
    emb(ids).pow(2).sum().backward()
    opt.step()
    ropt.zero_grad()
    ref(ids).pow(2).sum().backward()
    ropt.step()
    assert torch.equal(_table(emb), ref.weight.detach())


@pytest.mark.parametrize("kw", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_adam_foreach_exact_and_fused_to_rounding(kw):
    emb, ref = _dense_pair(12, 3)
    try:
        ropt = torch.optim.Adam(ref.parameters(), lr=0.05, **kw)
        ref(torch.arange(2)).sum().backward()
        ropt.step()  # a torch without this CPU kernel raises here
    except RuntimeError:
        pytest.skip("this torch has no such CPU kernel")
    emb, ref = _dense_pair(12, 3)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05, **kw)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05, **kw)
    ids = torch.arange(12)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        w = torch.randn(12, 3, generator=g)
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        ropt.zero_grad()
        (ref(ids) * w).sum().backward()
        ropt.step()
    if "foreach" in kw:
        assert torch.equal(_table(emb), ref.weight.detach())
    else:
        torch.testing.assert_close(_table(emb), ref.weight.detach())


def test_float64_tables_bit_identical():
    torch.manual_seed(0)
    ref = torch.nn.Embedding(12, 3).double()
    emb = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu", dtype=torch.float64)
    emb.weight.insertData(ref.weight.detach().clone(), torch.arange(12))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        ids = torch.cat([torch.randperm(12, generator=g), torch.randint(0, 12, (7,), generator=g)])
        w = torch.randn(ids.shape[0], 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        (emb(ids) * w).sum().backward()
        opt.step()
        ropt.zero_grad()
        (ref(ids) * w).sum().backward()
        ropt.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_prepare_grads_then_clip():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    ids = torch.tensor([1, 4, 4])
    (emb(ids) * 10).pow(2).sum().backward()
    opt.prepare_grads()
    params = [p for g in opt.param_groups for p in g["params"]]
    total = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    (ref(ids) * 10).pow(2).sum().backward()
    rtotal = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    torch.testing.assert_close(total, rtotal)
    torch.testing.assert_close(_table(emb), ref.weight.detach())


def test_load_checkpoint_refused_while_lookup_gradient_waits(tmp_path):
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    gl.save_checkpoint(str(tmp_path / "ck"), {"m": emb})
    emb.weight.fill_(0.25)
    emb(torch.tensor([2])).sum().backward()
    with pytest.raises((gl.GadgetError, RuntimeError)):
        gl.load_checkpoint(str(tmp_path / "ck"), {"m": emb})
    np.testing.assert_array_equal(_table(emb).numpy(), 0.25)
    opt.step()


# ----------------------------------------------------------------------------- more switcher claims


def test_switcher_checkpoint_refused_mid_step(tmp_path):
    model, sw = _switch()
    ids = torch.tensor([1, 2])
    sw.beforeForwardPass(ids)
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(str(tmp_path / "ck"), {"model": model, "sw": sw})
    assert not (tmp_path / "ck").exists() or _listing(tmp_path / "ck") == []
    sw.afterOptimizerStep(ids)


def test_switcher_after_step_never_writes_over_a_later_change():
    model, sw = _switch()
    sw.uniformDistributionInit(-1, 1)
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        local = sw.beforeForwardPass(ids)
        model.emb.weight[local] += 100.0
    sw.table.insertData(np.full((1, 4), 9.0, np.float32), [1])
    with pytest.raises(gl.GadgetValueError):
        sw.afterOptimizerStep(ids)
    np.testing.assert_array_equal(sw.getNumpyVersion()[1], 9.0)


def test_switcher_padding_idx_gets_no_gradient():
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(20, 4, padding_idx=3)
    sw = gl.ModelSwitch(model.emb, 20, 4, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.tensor([5, 3, 7])
    local = sw.beforeForwardPass(ids)
    assert model.emb.padding_idx == int(local[1])
    opt.zero_grad()
    model.emb(local).sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    after = sw.getNumpyVersion()
    np.testing.assert_array_equal(after[3], before[3])
    assert not np.array_equal(after[5], before[5])
    sw.beforeForwardPass(torch.tensor([1, 2]))
    assert model.emb.padding_idx is None
    sw.afterOptimizerStep(torch.tensor([1, 2]))


def test_optimizer_factory_state_dtype_default_float32():
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(1, 4)
    gl.ModelFactory(model.emb, 10, 4, datatype="float64", placement="cpu")
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    of = gl.OptimizerFactory(opt, 10, 4, model, "emb", placement="cpu")
    of.optInit()
    assert all(t.dtype == torch.float32 for t in of.tables.values())


@NO_CUDA_ONLY
def test_factories_follow_speedtorch_placement_switches_default_silently():
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(1, 4)
    with pytest.warns(gl.FallbackWarning):
        f = gl.ModelFactory(model.emb, 10, 4)  # CPUPinn=False: cuda, falls back
    assert f.placement == "cpu"
    model2 = torch.nn.Module()
    model2.emb = torch.nn.Embedding(1, 4)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw = gl.ModelSwitch(model2.emb, 10, 4)
        osw = gl.OptimizerSwitch(torch.optim.Adam(model2.parameters()), 10, 4, model2, "emb")
    assert sw.placement == "cpu" and osw is not None


# ----------------------------------------------------------------------------- more files / CLI


def test_npy_shrunk_in_place_is_file_error(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _arr(100, 4))
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    g.getData([99], device="cpu")
    os.truncate(p, os.path.getsize(p) - 64)
    with pytest.raises(gl.GadgetFileError):
        g.getData([99], device="cpu")
    g.close()


def test_cli_convert_dst_dataset(tmp_path, capsys):
    h5py = _h5py()
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x/y", data=_arr())
        f.create_dataset("z", data=_arr() + 1)
    rc, _, err = _cli(
        [
            "convert",
            str(tmp_path / "a.h5"),
            str(tmp_path / "b.h5"),
            "--dataset",
            "z",
            "--dst-dataset",
            "emb",
        ],
        capsys,
    )
    assert rc == 0, err
    with h5py.File(tmp_path / "b.h5", "r") as f:
        assert list(f.keys()) == ["emb"]
        np.testing.assert_array_equal(f["emb"][()], _arr() + 1)


def test_unknown_placement_lists_valid_names():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(_arr(), placement="gpu")
    for name in ("cpu", "cuda", "file", "pinned"):
        assert name in str(ei.value)


# ----------------------------------------------------------------------------- round three


def test_interleaved_table_numpy_view_and_as_tensor_reach_table():
    emb, _ = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    v = emb.weight.getNumpyVersion(copy=False)
    v[0, 0] = 42.0
    assert emb.weight.getData([0], device="cpu")[0, 0].item() == 42.0
    t = emb.weight.as_tensor()
    t[1, 1] = -42.0
    assert emb.weight.getData([1], device="cpu")[0, 1].item() == -42.0
    assert opt is not None


def test_every_row_call_after_close_raises_closed(tmp_path):
    g = _g(_arr())
    other = _g(_arr())
    g.close()
    calls = [
        lambda: g.save(str(tmp_path / "a.npy")),
        lambda: g.saveCupy(str(tmp_path / "b.npy")),
        lambda: g.as_tensor(),
        lambda: g.fill_(1.0),
        lambda: g.zero_(),
        lambda: g.uniform_(0, 1),
        lambda: g.normal_(0, 1),
        lambda: g.init_(torch.nn.init.zeros_),
        lambda: g.__setitem__([0], np.zeros((1, 4), np.float32)),
        lambda: np.asarray(g),
        lambda: gl.gather_many([other, g], [0], device="cpu"),
        lambda: gl.scatter_many([other, g], [torch.zeros(1, 4)] * 2, [0]),
    ]
    for call in calls:
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert _listing(tmp_path) == []
    np.testing.assert_array_equal(_rows(other), _arr())


def test_insert_with_2d_ids_and_grad_tensor():
    a = _arr()
    g = _g(a)
    ids = torch.tensor([[1, 2], [3, 4]])
    vals = torch.arange(16, dtype=torch.float32).view(2, 2, 4).requires_grad_(True)
    g.insertData(vals, ids)
    ref = a.copy()
    ref[[1, 2, 3, 4]] = vals.detach().view(4, 4).numpy()
    np.testing.assert_array_equal(_rows(g), ref)
    with pytest.raises(gl.GadgetValueError):
        g.insertData(torch.zeros(4, 4), ids)  # not ids.shape + row shape
    np.testing.assert_array_equal(_rows(g), ref)


def test_shape_keyword_without_source_and_string_flags():
    g = gl.DataGadget(shape=(3, 4), dtype="float32", placement="cpu", device="cpu")
    assert g.shape == (3, 4) and g.dtype == torch.float32
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(_arr(), placement="cpu", progress="False")
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(1, 4)
    with pytest.raises(gl.GadgetTypeError):
        gl.PytorchModelFactory(model.emb, 10, 4, deviceType="cpu", pinType="False")


def test_row_slice_step_zero_refused():
    g = _g(_arr(10, 6))
    with pytest.raises(gl.GadgetError):
        g[[1], 0:4:0]


@pytest.mark.parametrize(
    ("dtype", "call"),
    [
        ("uint8", ("fill_", 256)),
        ("float16", ("fill_", 1e6)),
        ("float32", ("normal_", 0.0, -1.0)),
        ("float32", ("uniform_", 0.0, float("inf"))),
    ],
)
def test_out_of_range_values_are_value_errors(dtype, call):
    g = _g((2, 2), dtype=dtype)
    with pytest.raises(gl.GadgetValueError):
        getattr(g, call[0])(*call[1:])


def test_checkpoint_file_names_start_with_object_names_and_verify_0(tmp_path):
    model, opt = _trained()
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt})
    tables = [n for n in _listing(ck) if n != "meta.pt"]
    assert tables and all(n.startswith(("model", "optimizer")) for n in tables)
    assert any(n.startswith("model") for n in tables) and any(
        n.startswith("optimizer") for n in tables
    )
    m2, o2 = _trained(seed=4)
    gl.load_checkpoint(str(ck), {"model": m2, "optimizer": o2}, verify=0)
    assert torch.equal(_table(m2["item"]), _table(model["item"]))


def test_checkpoint_param_group_mismatch_changes_nothing(tmp_path):
    model, opt = _trained()
    _train_steps(model, opt, 1, seed=1)
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": model, "optimizer": opt})
    emb, _ = _dense_pair(seed=6)
    m2 = torch.nn.ModuleDict({"item": emb, "head": torch.nn.Linear(4, 1)})
    o2 = gl.OffloadedOptimizer(
        torch.optim.Adam, [{"params": m2["item"]}, {"params": m2["head"].parameters()}], lr=0.05
    )
    before = _table(emb)
    hw = m2["head"].weight.detach().clone()
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": m2, "optimizer": o2})
    assert torch.equal(_table(emb), before) and torch.equal(m2["head"].weight.detach(), hw)


def test_dataset_columns_of_different_rows_refused():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(_arr(10, 2), np.arange(9), placement="cpu", device="cpu")


def test_pad_and_drop_last_with_ranks():
    pads = [
        [
            b.tolist()
            for b in gl.GadgetSampler(
                10, batch_size=3, order="sequential", pad=True, num_replicas=2, rank=r
            )
        ]
        for r in (0, 1)
    ]
    assert len(pads[0]) == len(pads[1])
    flat = sum(pads[0] + pads[1], [])
    assert all(len(b) == 3 for b in pads[0] + pads[1])
    assert set(flat) == set(range(10))
    extra = sorted(flat)
    for i in range(10):
        extra.remove(i)
    assert extra == list(range(len(extra)))  # repeats from the start of the epoch
    drops = [
        [
            b.tolist()
            for b in gl.GadgetSampler(
                23, batch_size=4, drop_last=True, num_replicas=2, rank=r, seed=2
            )
        ]
        for r in (0, 1)
    ]
    assert len(drops[0]) == len(drops[1])
    kept = sum(drops[0] + drops[1], [])
    assert all(len(b) == 4 for b in drops[0] + drops[1])
    assert len(set(kept)) == len(kept) and 23 - len(kept) < 8


def test_grad_scaler_works_in_torch_order():
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        rscaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    except (AttributeError, TypeError, RuntimeError):
        pytest.skip("no CPU GradScaler in this torch")
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ids = torch.tensor([1, 3, 3])
    scaler.scale(emb(ids).pow(2).sum()).backward()
    scaler.step(opt)
    scaler.update()
    rscaler.scale(ref(ids).pow(2).sum()).backward()
    rscaler.step(ropt)
    rscaler.update()
    assert torch.equal(_table(emb), ref.weight.detach())
    before = _table(emb)
    opt.zero_grad()
    scaler.scale(emb(ids).sum() * float("inf")).backward()
    scaler.step(opt)  # inf found: the step is skipped
    scaler.update()
    assert torch.equal(_table(emb), before)
    assert scaler.get_scale() < 1024.0


def test_fan_reading_initialisers_on_weight():
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(400, 50, placement="cpu", device="cpu")
    torch.nn.init.constant_(emb.weight, 0.5)
    np.testing.assert_array_equal(_table(emb).numpy(), 0.5)
    torch.nn.init.normal_(emb.weight, 1.0, 0.1)
    r = _table(emb)
    assert abs(r.mean().item() - 1.0) < 0.01 and abs(r.std().item() - 0.1) < 0.01
    torch.nn.init.uniform_(emb.weight, -0.2, 0.2)
    r = _table(emb)
    assert r.min() >= -0.2 and r.max() <= 0.2
    torch.nn.init.kaiming_normal_(emb.weight)
    expected = (2.0 / 50) ** 0.5  # fan_in of a (400, 50) weight
    assert abs(_table(emb).std().item() - expected) / expected < 0.05


# ----------------------------------------------------------------------------- round four


def test_fill_int64_bounds():
    g = _g((2, 2), dtype="int64")
    g.fill_(2**63 - 1)
    np.testing.assert_array_equal(_rows(g), 2**63 - 1)
    g.fill_(float(2**62))
    np.testing.assert_array_equal(_rows(g), 2**62)
    for bad in (2**63, -(2**63) - 1, float(2**63)):
        with pytest.raises(gl.GadgetError):
            g.fill_(bad)
    np.testing.assert_array_equal(_rows(g), 2**62)


def test_string_and_non_array_files_are_errors_naming_the_file(tmp_path):
    s = tmp_path / "strs.npy"
    np.save(s, np.array([["a", "b"]]))
    with pytest.raises(gl.GadgetError, match="strs.npy"):
        gl.DataGadget(str(s), placement="cpu")
    t = tmp_path / "text.npy"
    t.write_text("not an array at all\n" * 20)
    with pytest.raises(gl.GadgetFileError, match="text.npy"):
        gl.DataGadget(str(t), placement="cpu")
    h = tmp_path / "cut.h5"
    h5py = _h5py()
    with h5py.File(h, "w") as f:
        f.create_dataset("x", data=_arr(200, 8))
    data = h.read_bytes()
    h.write_bytes(data[: len(data) // 3])
    with pytest.raises(gl.GadgetFileError, match="cut.h5"):
        gl.DataGadget(str(h), placement="cpu")


def test_zarr_save_replaces_group_as_a_whole(tmp_path):
    zarr = _zarr()
    p = tmp_path / "g.zarr"
    grp = zarr.open_group(str(p), mode="w")
    grp.create_array("a", shape=(4, 2), dtype="float32")[:] = 1
    grp.create_array("b", shape=(4, 2), dtype="float32")[:] = 2
    _g(_arr()).save(str(p), dataset="emb")
    names = sorted(zarr.open_group(str(p), mode="r").array_keys())
    assert names == ["emb"]
    np.testing.assert_array_equal(_rows(_g(str(p), dataset="emb")), _arr())
    assert _listing(tmp_path) == ["g.zarr"]


def test_h5_save_refuses_directory_target(tmp_path):
    _h5py()
    d = tmp_path / "d.h5"
    d.mkdir()
    with pytest.raises(gl.GadgetError):
        _g(_arr()).save(str(d))
    assert d.is_dir()


def test_cli_convert_leaves_only_destination(tmp_path, capsys):
    _zarr()
    np.save(tmp_path / "a.npy", _arr(50, 4))
    rc, _, err = _cli(["convert", str(tmp_path / "a.npy"), str(tmp_path / "b.zarr")], capsys)
    assert rc == 0, err
    assert _listing(tmp_path) == ["a.npy", "b.zarr"]
    np.testing.assert_array_equal(_rows(_g(str(tmp_path / "b.zarr"))), _arr(50, 4))


def test_dataset_gather_shapes():
    feats, labels, ds = _ds(10)
    x, y = ds.gather(torch.tensor([[1, 2], [3, 9]]))
    assert x.shape == (2, 2, 3) and y.shape == (2, 2)
    np.testing.assert_array_equal(x.numpy(), feats[[[1, 2], [3, 9]]])
    with pytest.raises(gl.GadgetIndexError):
        ds.gather([10])


def test_state_dict_with_state_not_yet_on_loads_and_is_paged():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1, momentum=0.9)
    ids = torch.arange(20)
    emb(ids).pow(2).sum().backward()
    opt.step()
    sd = opt.state_dict()
    emb2 = gl.OffloadedEmbedding(20, 4, placement="cpu", device="cpu")
    emb2.weight.insertData(_table(emb), ids)
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb2, lr=0.1)  # momentum off
    opt2.load_state_dict(sd)
    for e, o in ((emb, opt), (emb2, opt2)):
        o.zero_grad()
        e(ids).pow(2).sum().backward()
        o.step()
    assert torch.equal(_table(emb2), _table(emb))


def test_same_dense_parameter_in_two_groups_refused():
    emb, _ = _dense_pair()
    head = torch.nn.Linear(4, 1)
    with pytest.raises((gl.GadgetError, ValueError)):
        gl.OffloadedOptimizer(
            torch.optim.SGD,
            [{"params": emb}, {"params": [head.weight]}, {"params": [head.weight]}],
            lr=0.1,
        )


def test_gradient_accumulation_over_backward_passes_bit_identical():
    emb, ref = _dense_pair()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.3)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(11)
    for _ in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        for _ in range(3):
            ids = torch.randint(0, 20, (25,), generator=g)
            w = torch.randn(25, 4, generator=g)
            (emb(ids) * w).sin().sum().backward()
            (ref(ids) * w).sin().sum().backward()
        opt.step()
        ropt.step()
    assert torch.equal(_table(emb), ref.weight.detach())


def test_failed_checkpoint_save_over_old_one_keeps_it(tmp_path):
    model, opt = _trained()
    _train_steps(model, opt, 1, seed=1)
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt})
    listing = _listing(ck)
    bf = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu", dtype=torch.bfloat16)
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(str(ck), {"model": model, "optimizer": opt, "bf": bf}, format="npy")
    assert _listing(ck) == listing
    m2, o2 = _trained(seed=4)
    gl.load_checkpoint(str(ck), {"model": m2, "optimizer": o2})
    assert torch.equal(_table(m2["item"]), _table(model["item"]))


def test_asarray_copy_false_of_bfloat16_host_table_raises_value_error():
    if np.lib.NumpyVersion(np.__version__) < "2.0.0":
        pytest.skip("numpy < 2 has no copy= in asarray")
    g = _g((2, 2), dtype=torch.bfloat16)
    with pytest.raises(gl.GadgetValueError):
        np.asarray(g, copy=False)


def test_getnumpy_copy_false_of_file_table_copies(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, _arr())
    g = gl.DataGadget(str(p), placement="file", device="cpu")
    v = g.getNumpyVersion(copy=False)
    np.testing.assert_array_equal(v, _arr())
    if v.flags.writeable:
        v[0, 0] = 1234
    np.testing.assert_array_equal(np.load(p), _arr())
    g.close()


@pytest.mark.parametrize("fmt", ["h5", "npy"])
def test_threads_writing_parts_of_rows_through_two_names_lose_nothing(tmp_path, fmt):
    import threading

    p = tmp_path / f"t.{fmt}"
    if fmt == "h5":
        h5py = _h5py()
        with h5py.File(p, "w") as f:
            f.create_dataset(
                "x", data=np.zeros((64, 4), np.float32), chunks=(16, 4), compression="gzip"
            )
    else:
        np.save(p, np.zeros((64, 4), np.float32))
    hard = tmp_path / f"hard.{fmt}"
    os.link(p, hard)
    g1 = gl.DataGadget(str(p), placement="file", device="cpu")
    g2 = gl.DataGadget(str(hard), placement="file", device="cpu")
    errors = []

    def writer(g, cols, base):
        try:
            for k in range(30):
                ids = torch.arange(64)
                g.insertData(torch.full((64, 2), float(base + k)), (ids, cols))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t1 = threading.Thread(target=writer, args=(g1, slice(0, 2), 100))
    t2 = threading.Thread(target=writer, args=(g2, slice(2, 4), 200))
    t1.start()
    t2.start()
    t1.join()
    t2.join()
    assert not errors
    got = g1.getData(range(64), device="cpu").numpy()
    g1.close()
    g2.close()
    np.testing.assert_array_equal(got[:, :2], 129.0)
    np.testing.assert_array_equal(got[:, 2:], 229.0)
