"""Session 12 review: README.md followed literally by a new user.

Every code example of the README is run as written (with small sizes; on a machine
without CUDA through the CPU fallback the README describes), and its checkable claims --
signatures, defaults, return types, error types and messages, CLI commands, file formats,
checkpoint behaviour, DataLoader forms, sampler state, the drop-in module, the word2vec
script -- are compared against independent references (NumPy, plain torch, dense torch
parameters trained by the same optimizer).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from speedtorch_loop import speedtorch_step
from torch.utils.data import ConcatDataset, DataLoader, Subset, random_split

import gadgetloader as gl
from gadgetloader.cli import main as cli_main

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

# the CPU fallback warns once per process (the conftest resets it per test); the README's
# "one warning" is checked on its own below
pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")

REPO = Path(__file__).resolve().parents[1]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Run the gadgetloader command in-process; (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(code or 0), out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------
# Install and try: the gadgetloader command
# ---------------------------------------------------------------------------------------


def test_cli_help_lists_info_bench_convert():
    code, out, _ = _run_cli(["--help"])
    assert code == 0
    for sub in ("info", "bench", "convert"):
        assert sub in out


@pytest.mark.parametrize(
    ("suite", "defaults"),
    [
        ("seed", ["1,000,000", "default 128", "131,072", "float32"]),
        ("train", ["10,000,000", "default 128", "default 4096", "default 5"]),
        ("files", ["default 64", "default 4096", "1/8", "--gb", "--dir", "--json"]),
        ("pipeline", ["--batch", "--workers", "--json"]),
        ("sweep", ["--sizes-gb", "--json", "--repeats"]),
    ],
)
def test_cli_bench_suite_help_states_readme_defaults(suite, defaults):
    """README: seed 1,000,000 x 128 float32 / 131,072 ids; train 10M x 128, 4096 pairs
    + 5 negatives; files: 256 MB table, 32 MB (1/8) cache, chunks of 64 rows, 4,096 ids."""
    code, out, _ = _run_cli(["bench", suite, "-h"])
    assert code == 0
    for text in defaults:
        assert text in out, (suite, text)


def test_cli_info_reports_versions_and_gpu_state():
    code, out, _ = _run_cli(["info"])
    assert code == 0
    fields = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
        for line in out.splitlines()
        if ":" in line
    }
    assert fields["gadgetloader"] == gl.__version__
    assert fields["torch"] == torch.__version__
    assert fields["cuda_available"] == str(gl.cuda_available())
    assert "gpu" in fields


def test_cli_bench_seed_small_run_checks_every_method(tmp_path):
    """`gadgetloader bench` (the seed suite) checks every method against a CPU reference;
    without CUDA it times the CPU methods and lists what it skipped."""
    path = tmp_path / "s.json"
    code, out, _ = _run_cli(
        ["bench", "--rows", "2000", "--width", "8", "--ids", "256", "--repeats", "1"]
        + ["--no-speedtorch", "--json", str(path)]
    )
    assert code == 0, out
    data = json.loads(path.read_text())
    assert data["benchmark"] == "seed"
    assert (data["rows"], data["width"], data["ids"]) == (2000, 8, 256)
    kinds = {r["kind"] for r in data["results"]}
    assert kinds == {"gather", "scatter"}
    # every method is checked; the memcpy limit rows (CUDA only) move no table rows
    checked = [r for r in data["results"] if not r["method"].startswith("limit")]
    assert checked and all(r["check"] == "ok" for r in checked), data["results"]
    if not torch.cuda.is_available():
        assert data["skipped"], "without CUDA the README says it lists what it skipped"


@pytest.mark.parametrize("argv", [["bench", "files", "--mb", "1"], ["bench"]])
def test_cli_bench_json_path_checked_before_the_run(tmp_path, argv):
    bad = tmp_path / "missing" / "f.json"
    code, out, err = _run_cli([*argv, "--json", str(bad)])
    assert code == 2
    assert "no such directory" in err
    assert "benchmark" not in out  # nothing ran
    assert not bad.parent.exists()


def test_cli_convert_readme_commands(tmp_path, monkeypatch):
    """`gadgetloader convert emb.npy emb.h5 --chunk-rows 4096 --compression gzip` and
    `gadgetloader convert data.h5 emb.zarr --dataset emb/words`, then the README's
    `gl.DataGadget("emb.zarr", placement="cuda")`."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((5000, 16)).astype(np.float32)
    words = rng.standard_normal((300, 8)).astype(np.float32)
    np.save("emb.npy", emb)
    with h5py.File("data.h5", "w") as f:
        f.create_dataset("emb/words", data=words)
    code, _, err = _run_cli(
        ["convert", "emb.npy", "emb.h5", "--chunk-rows", "4096", "--compression", "gzip"]
        + ["--no-progress"]
    )
    assert code == 0, err
    with h5py.File("emb.h5", "r") as f:
        (name,) = list(f)
        assert f[name].chunks == (4096, 16)
        assert f[name].compression == "gzip"
        np.testing.assert_array_equal(f[name][...], emb)
    code, _, err = _run_cli(
        ["convert", "data.h5", "emb.zarr", "--dataset", "emb/words", "--no-progress"]
    )
    assert code == 0, err
    g = gl.DataGadget("emb.zarr", placement="cuda")
    assert g.shape == (300, 8)
    np.testing.assert_array_equal(g.getNumpyVersion(), words)


def test_cli_bench_train_small_run_has_the_five_methods(tmp_path):
    """`gadgetloader bench train` compares all-on-GPU SparseAdam, the SpeedTorch protocol
    (no merging of repeats), the switchers, the drop-in module and the `resident` bound;
    the switchers and the drop-in move the same bytes, the protocol more."""
    path = tmp_path / "t.json"
    code, out, _ = _run_cli(
        ["bench", "train", "--rows", "3000", "--dim", "8", "--batch", "32", "--steps", "1"]
        + ["--warmup", "1", "--repeats", "1", "--json", str(path)]
    )
    assert code == 0, out
    data = json.loads(path.read_text())
    methods = data["methods"]
    assert set(methods) == {"gpu", "speedtorch", "switchers", "dropin", "resident"}
    assert data["config"]["negatives"] == 5
    assert all(data["verified"].values()) and data["verified"]
    assert methods["switchers"]["bytes_per_step"] == methods["dropin"]["bytes_per_step"]
    assert methods["resident"]["bytes_per_step"] == 0
    if data["device"] == "cpu":  # nothing crosses PCIe without CUDA (session 15)
        assert all(m["bytes_per_step"] == 0 for m in methods.values())
    else:
        assert methods["speedtorch"]["bytes_per_step"] > methods["dropin"]["bytes_per_step"]


def test_cli_bench_pipeline_small_run_checks_every_method(tmp_path):
    path = tmp_path / "p.json"
    code, out, _ = _run_cli(
        ["bench", "pipeline", "--rows", "4096", "--width", "4", "--batch", "256"]
        + ["--batches", "4", "--seconds", "0.05", "--repeats", "1", "--workers", "0"]
        + ["--dir", str(tmp_path), "--json", str(path)]
    )
    assert code == 0, out
    data = json.loads(path.read_text())
    assert data["results"] and all(r["check"] == "ok" for r in data["results"])
    labels = " ".join(r["method"] for r in data["results"])
    for tag in ["(a)", "(b)", "(c)", "(d)", "(e)"]:
        assert tag in labels


# ---------------------------------------------------------------------------------------
# Rows in and out
# ---------------------------------------------------------------------------------------


def test_rows_in_and_out_readme_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((300, 16)).astype(np.float32)
    np.save("embeddings.npy", ref)

    table = gl.DataGadget("embeddings.npy", CPUPinn=True)
    ids = torch.randint(0, len(table), (4096,))
    rows = table.getData(ids)
    assert tuple(rows.shape) == (4096, 16)
    np.testing.assert_array_equal(_np(rows), ref[ids.numpy()])
    table.insertData(rows * 0.5, ids)  # repeated ids: the last occurrence wins
    expected = ref.copy()
    new = _np(rows) * 0.5
    for k, i in enumerate(ids.tolist()):  # NumPy's sequential assignment
        expected[i] = new[k]
    table.saveCupy("embeddings.npy")
    np.testing.assert_array_equal(np.load("embeddings.npy"), expected)
    if not torch.cuda.is_available():
        assert table.placement == "cpu"  # the fallback
        assert rows.device.type == "cpu"


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([[3, 1], [0, 3]], dtype=torch.uint8),
        torch.tensor([4, 2], dtype=torch.int8),
        torch.tensor([[[1]], [[5]]], dtype=torch.int16),
        torch.tensor([5, 5, 0], dtype=torch.int32),
        np.array([[2, 1, 0]], dtype=np.uint64),
        np.array([1, 1], dtype=np.uint16),
        [4, 0, 4],
        range(1, 6, 2),
    ],
    ids=["u8-2d", "i8", "i16-3d", "i32", "np-u64", "np-u16", "list", "range"],
)
def test_ids_of_any_integer_type_and_shape(placement, ids):
    """ids of any integer dtype and shape; the result has shape ids.shape + row_shape."""
    ref = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
    g = gl.DataGadget(ref, placement=placement)
    idx = np.asarray(ids if not isinstance(ids, torch.Tensor) else ids.numpy()).astype(np.int64)
    out = g.getData(ids)
    assert tuple(out.shape) == idx.shape + (3,)
    np.testing.assert_array_equal(_np(out), ref[idx])


@pytest.mark.parametrize(
    ("case", "builtin", "words"),
    [
        ("negative id", IndexError, ["-1", "[0, 4]"]),
        ("id out of range", IndexError, ["5", "[0, 4]"]),
        ("float id", TypeError, ["integers", "float"]),
        ("wrong dtype", TypeError, ["float32", "float64"]),
        ("wrong shape", ValueError, ["(2, 3)", "(2, 4)"]),
    ],
)
def test_bad_ids_and_data_raise_before_anything_is_written(placement, case, builtin, words):
    ref = np.arange(15, dtype=np.float32).reshape(5, 3)
    g = gl.DataGadget(ref, placement=placement)
    data = torch.full((2, 3), 9.0)
    ids = torch.tensor([0, 1])
    if case == "negative id":
        ids = torch.tensor([0, -1])
    elif case == "id out of range":
        ids = torch.tensor([0, 5])
    elif case == "float id":
        ids = torch.tensor([0.0, 1.0])
    elif case == "wrong dtype":
        data = np.full((2, 3), 9.0)
    elif case == "wrong shape":
        data = torch.full((2, 4), 9.0)
    with pytest.raises(gl.GadgetError) as info:
        g.insertData(data, ids)
    assert isinstance(info.value, builtin)
    for w in words:
        assert w in str(info.value), (case, str(info.value))
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_insert_repeated_ids_take_the_last_occurrence(placement):
    g = gl.DataGadget(np.zeros((4, 2), np.float32), placement=placement)
    ids = np.array([2, 0, 2, 2, 0, 3])
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    g.insertData(rows, ids)
    ref = np.zeros((4, 2), np.float32)
    ref[ids] = rows  # NumPy's sequential assignment: the last one wins
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_tuple_shape_builds_a_zero_table_and_a_list_is_data():
    g = gl.DataGadget((10, 4), dtype="float32", placement="pinned")
    assert g.shape == (10, 4) and g.dtype == torch.float32
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((10, 4), np.float32))
    h = gl.DataGadget(shape=(3, 2), dtype="int16", placement="cpu")
    assert h.dtype == torch.int16 and h.getNumpyVersion().sum() == 0
    lst = gl.DataGadget([[1, 2], [3, 4]], placement="cpu")  # a (nested) list is data
    np.testing.assert_array_equal(lst.getNumpyVersion(), np.array([[1, 2], [3, 4]]))


def test_data_is_copied_in_and_detached(placement):
    t = torch.arange(12.0, requires_grad=True).reshape(4, 3)
    g = gl.DataGadget(t, placement=placement)
    a = np.ones((4, 3), np.float32)
    h = gl.DataGadget(a, placement=placement)
    with torch.no_grad():
        t.mul_(0)
    a[:] = 7
    assert not g.as_tensor().requires_grad
    np.testing.assert_array_equal(g.getNumpyVersion(), np.arange(12.0).reshape(4, 3))
    np.testing.assert_array_equal(h.getNumpyVersion(), np.ones((4, 3)))


def test_insert_float64_into_float32_table_is_an_error_that_says_so(placement):
    g = gl.DataGadget(np.zeros((3, 2), np.float32), placement=placement)
    with pytest.raises(gl.GadgetTypeError, match="float32") as info:
        g.insertData(np.ones((1, 2), np.float64), [0])
    assert "float64" in str(info.value)
    assert g.getNumpyVersion().sum() == 0


def test_indexing_and_properties(placement):
    ref = np.arange(20, dtype=np.float32).reshape(5, 4)
    g = gl.DataGadget(ref, placement=placement)
    assert (g.shape, g.dtype, len(g), g.nbytes) == ((5, 4), torch.float32, 5, ref.nbytes)
    assert g.placement in gl.PLACEMENTS
    np.testing.assert_array_equal(_np(g[[4, 0]]), ref[[4, 0]])
    g[[1, 1]] = torch.tensor([[1.0] * 4, [2.0] * 4])
    ref[[1, 1]] = np.array([[1.0] * 4, [2.0] * 4], np.float32)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_getNumpyVersion_copies_and_as_tensor_is_a_zero_copy_view(placement):
    g = gl.DataGadget(np.zeros((3, 2), np.float32), placement=placement)
    a = g.getNumpyVersion(copy=True)
    a[0, 0] = 5
    assert _np(g.getData([0]))[0, 0] == 0
    v = g.as_tensor()
    v[2, 1] = 3.0
    assert _np(g.getData([2]))[0, 1] == 3.0


@pytest.mark.parametrize(
    ("dtype", "value", "ok"),
    [
        ("int8", 127, True),
        ("int8", 128, False),
        ("int8", -129, False),
        ("int8", 1.5, False),
        ("uint8", -1, False),
        ("bool", True, True),
        ("bool", 1, True),
        ("bool", 2, False),
        ("bool", 0.5, False),
        ("float16", 65504.0, True),
        ("float16", 70000.0, False),
        ("float16", float("inf"), True),
        ("float16", float("nan"), True),
        ("float32", 1e39, False),
        ("int64", 2**63, False),
    ],
)
def test_fill_takes_only_values_the_dtype_can_hold(dtype, value, ok):
    dt = getattr(torch, dtype)
    g = gl.DataGadget(torch.zeros(3, 2, dtype=dt), placement="cpu")
    if ok:
        g.fill_(value)
        ref = torch.full((3, 2), value, dtype=dt, device="cpu")
        assert torch.equal(_bits(g.as_tensor()), _bits(ref))
    else:
        with pytest.raises(gl.GadgetValueError):
            g.fill_(value)
        assert not bool(g.as_tensor().cpu().bool().any())  # unchanged: still zeros


def test_uniform_and_normal_argument_rules(placement):
    g = gl.DataGadget(torch.zeros(200, 3), placement=placement)
    g.uniform_(torch.tensor(-0.5), torch.tensor(0.25))  # 0-d tensors are accepted
    t = g.as_tensor().cpu()
    assert float(t.min()) >= -0.5 and float(t.max()) <= 0.25 and float(t.std()) > 0
    before = g.getNumpyVersion()
    for bad in [(1.0, 0.0), (float("inf"), 1.0), (0.0, float("nan")), (-3e38, 3e38)]:
        with pytest.raises(gl.GadgetValueError):
            g.uniform_(*bad)
    for bad in [(0.0, -1.0), (float("inf"), 1.0), (0.0, 1e39)]:
        with pytest.raises(gl.GadgetValueError):
            g.normal_(*bad)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.normal_(3.0, 0.0)  # std >= 0: zero is allowed
    np.testing.assert_array_equal(g.getNumpyVersion(), np.full((200, 3), 3.0, np.float32))
    ints = gl.DataGadget(torch.zeros(4, 2, dtype=torch.int32), placement=placement)
    with pytest.raises(gl.GadgetTypeError):
        ints.uniform_(0, 1)


def test_init_xavier_uniform_fills_within_its_bound(placement):
    g = gl.DataGadget((64, 32), dtype="float32", placement=placement)
    g.init_(torch.nn.init.xavier_uniform_)
    a = g.getNumpyVersion()
    bound = (6.0 / (64 + 32)) ** 0.5
    assert np.abs(a).max() <= bound and a.std() > bound / 4


def test_save_load_saveCupy_loadCupy_close_and_with(tmp_path, placement):
    ref = np.random.default_rng(2).standard_normal((20, 4)).astype(np.float32)
    with gl.DataGadget(ref, placement=placement) as g:
        assert g.gadgetInit() is g  # SpeedTorch's second step is accepted
        g.save(tmp_path / "t.h5")
        g.saveCupy(str(tmp_path / "t2"))  # as numpy.save: .npy is appended
    assert (tmp_path / "t2.npy").exists()
    np.testing.assert_array_equal(np.load(tmp_path / "t2.npy"), ref)
    with pytest.raises(gl.GadgetClosedError):
        g.getData([0])
    h = gl.DataGadget((20, 4), dtype="float32", placement=placement)
    h.load(tmp_path / "t.h5")
    np.testing.assert_array_equal(h.getNumpyVersion(), ref)
    h.zero_()
    h.loadCupy(str(tmp_path / "t2.npy"))
    np.testing.assert_array_equal(h.getNumpyVersion(), ref)
    h.close()
    h.close()  # idempotent


def test_cpu_fallback_warns_once_without_cuda():
    """'Without CUDA or CuPy everything still runs on the CPU (with one warning)'."""
    if torch.cuda.is_available():
        pytest.skip("the fallback warning is for machines without CUDA")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = gl.DataGadget((4, 2), dtype="float32", placement="pinned")
        b = gl.DataGadget((4, 2), dtype="float32", placement="cuda")
        c = gl.DataGadget(np.zeros((3, 3), np.float32), CPUPinn=True)
        e = gl.OffloadedEmbedding(10, 4)
        gl.ModelFactory(torch.nn.Embedding(4, 4), 10, 4, CPUPinn=True)
        gl.GadgetDataset(np.zeros((5, 2), np.float32))
    fallbacks = [w for w in caught if issubclass(w.category, gl.FallbackWarning)]
    assert len(fallbacks) == 1
    assert {a.placement, b.placement, c.placement, e.weight.placement} == {"cpu"}


def test_cpu_ids_are_checked_even_with_check_ids_false(placement, tmp_path):
    """'getData(ids, check_ids=False) skips it for ids you trust (CPU ids are checked on
    the CPU for free ...)'; and nothing is written for a refused insert."""
    ref = np.arange(10, dtype=np.float32).reshape(5, 2)
    g = gl.DataGadget(ref, placement=placement)
    np.save(tmp_path / "f.npy", ref)
    f = gl.DataGadget(tmp_path / "f.npy", placement="file")
    for table in (g, f):
        with pytest.raises(gl.GadgetIndexError):
            table.getData([10], check_ids=False)
        with pytest.raises(gl.GadgetIndexError):
            table.insertData(torch.ones(2, 2), [1, -1], check_ids=False)
        with pytest.raises(gl.GadgetIndexError):
            gl.gather_many([table], [9], check_ids=False)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), ref)


def test_gather_many_and_scatter_many_move_tables_together(placement):
    t = gl.DataGadget(np.zeros((6, 2), np.float32), placement=placement)
    m = gl.DataGadget(np.zeros((6, 3), np.float64), placement=placement)
    v = gl.DataGadget(np.zeros((6,), np.int32), placement=placement)
    ids = torch.tensor([1, 3, 1])
    rows = [
        torch.arange(6.0).view(3, 2),
        torch.arange(9.0, dtype=torch.float64).view(3, 3),
        torch.tensor([7, 8, 9], dtype=torch.int32),
    ]
    gl.scatter_many([t, m, v], rows, ids)
    refs = [np.zeros((6, 2), np.float32), np.zeros((6, 3)), np.zeros(6, np.int32)]
    for ref, r in zip(refs, rows, strict=True):
        ref[ids.numpy()] = r.numpy()
    out = gl.gather_many([t, m, v], np.array([[1], [3], [0]]))
    assert len(out) == 3
    for o, ref in zip(out, refs, strict=True):
        np.testing.assert_array_equal(_np(o), ref[[[1], [3], [0]]])
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many([t, m, v], rows, torch.tensor([1, 3, 6]))
    for g, ref in zip([t, m, v], refs, strict=True):
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)


# ---------------------------------------------------------------------------------------
# Files: .npy, HDF5 and zarr
# ---------------------------------------------------------------------------------------


def test_files_readme_constructors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal((50, 4)).astype(np.float32) for _ in range(3))
    np.save("emb.npy", a)
    with h5py.File("data.h5", "w") as f:
        f.create_dataset("emb/words", data=b)
        f.create_dataset("other", data=np.zeros((2, 2)))
    gl.DataGadget(c, placement="cpu").save("emb.zarr")
    g = gl.DataGadget("emb.npy", CPUPinn=True)
    np.testing.assert_array_equal(g.getNumpyVersion(), a)
    g = gl.DataGadget("data.h5", dataset="emb/words", placement="pinned")
    np.testing.assert_array_equal(g.getNumpyVersion(), b)
    g = gl.DataGadget("emb.zarr", placement="cuda")
    np.testing.assert_array_equal(g.getNumpyVersion(), c)
    g = gl.DataGadget("data.h5", dataset="emb/words", placement="file")
    np.testing.assert_array_equal(_np(g.getData([3, 0])), b[[3, 0]])


def test_format_from_extension_else_content_and_format_override(tmp_path):
    ref = np.arange(40, dtype=np.float32).reshape(10, 4)
    src = gl.DataGadget(ref, placement="cpu")
    for ext, fmt in [("npy", "npy"), ("h5", "hdf5"), ("zarr", "zarr")]:
        p = tmp_path / f"t.{ext}"
        src.save(p)
        renamed = tmp_path / f"noext_{fmt}"
        os.rename(p, renamed)
        np.testing.assert_array_equal(gl.DataGadget(renamed).getNumpyVersion(), ref)
        np.testing.assert_array_equal(gl.DataGadget(renamed, format=fmt).getNumpyVersion(), ref)
    with pytest.raises(gl.GadgetKeyError, match="parquet"):
        gl.DataGadget(tmp_path / "noext_npy", format="parquet")


def test_dataset_names_wrong_or_missing_list_the_existing_ones(tmp_path):
    p = tmp_path / "two.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("emb/words", data=np.zeros((3, 2), np.float32))
        f.create_dataset("other", data=np.zeros((3, 2), np.float32))
    for kw in [{"dataset": "nope"}, {}]:
        with pytest.raises(gl.GadgetKeyError) as info:
            gl.DataGadget(p, **kw)
        assert "emb/words" in str(info.value) and "other" in str(info.value)


@pytest.mark.parametrize("kind", ["missing", "truncated", "object", "string", "zero rows"])
def test_bad_files_are_clear_errors_naming_the_file(tmp_path, kind):
    p = tmp_path / f"bad_{kind.replace(' ', '_')}.npy"
    expected: type[Exception] = gl.GadgetError
    if kind == "missing":
        expected = gl.GadgetFileNotFoundError
    elif kind == "truncated":
        np.save(p, np.zeros((100, 4), np.float32))
        p.write_bytes(p.read_bytes()[:500])
        expected = gl.GadgetFileError
    elif kind == "object":
        np.save(p, np.array([[1, "a"]], dtype=object), allow_pickle=True)
        expected = gl.GadgetTypeError
    elif kind == "string":
        np.save(p, np.array([["a", "b"]]))
        expected = gl.GadgetTypeError
    else:
        np.save(p, np.zeros((0, 4), np.float32))
        expected = gl.GadgetValueError
    with pytest.raises(expected) as info:
        gl.DataGadget(p)
    assert p.name in str(info.value)


def test_zero_row_table_is_not_saved(tmp_path):
    z = gl.DataGadget(np.zeros((0, 3), np.float32), placement="cpu")
    for name in ["z.npy", "z.h5", "z.zarr"]:
        with pytest.raises(gl.GadgetValueError, match="zero rows"):
            z.save(tmp_path / name)
        assert not (tmp_path / name).exists()


def test_file_placement_writes_through_and_read_only_rules(tmp_path):
    ref = np.random.default_rng(4).standard_normal((64, 4)).astype(np.float32)
    p = tmp_path / "f.npy"
    np.save(p, ref)
    g = gl.DataGadget(p, placement="file")
    assert g.placement == "file"
    np.testing.assert_array_equal(_np(g.getData([[5, 63]])), ref[[[5, 63]]])
    g.insertData(torch.full((2, 4), 3.0), [7, 9])
    ref[[7, 9]] = 3.0
    np.testing.assert_array_equal(np.load(p), ref)
    ro = gl.DataGadget(p, placement="file", writable=False)
    with pytest.raises(gl.ReadOnlyError):
        ro.insertData(torch.zeros(1, 4), [0])
    for bad in ["no", 1]:
        with pytest.raises(gl.GadgetTypeError):
            gl.DataGadget(p, placement="file", writable=bad)
    pf = tmp_path / "fortran.npy"
    np.save(pf, np.asfortranarray(ref))
    fg = gl.DataGadget(pf, placement="file")
    np.testing.assert_array_equal(_np(fg.getData([1, 2])), ref[[1, 2]])
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        fg.insertData(torch.zeros(1, 4), [0])
    assert isinstance(gl.ReadOnlyError("x"), PermissionError)
    np.testing.assert_array_equal(np.load(pf), ref)


def test_file_placement_hdf5_with_cache_bytes(tmp_path):
    """`gl.DataGadget("big.h5", placement="file", cache_bytes=2 << 30)`."""
    ref = np.random.default_rng(5).standard_normal((200, 3)).astype(np.float32)
    gl.DataGadget(ref, placement="cpu").save(tmp_path / "big.h5", chunk_rows=16, compression="gzip")
    g = gl.DataGadget(tmp_path / "big.h5", placement="file", cache_bytes=2 << 30)
    ids = np.array([199, 0, 17, 17])
    np.testing.assert_array_equal(_np(g.getData(ids)), ref[ids])
    g.insertData(torch.full((1, 3), 8.0), [100])
    g.flush()
    ref[100] = 8.0
    g.close()
    np.testing.assert_array_equal(gl.DataGadget(tmp_path / "big.h5").getNumpyVersion(), ref)


def test_save_options_from_the_readme(tmp_path):
    ref = np.arange(10000 * 4, dtype=np.float32).reshape(10000, 4)
    g = gl.DataGadget(ref, placement="cpu")
    g.save(tmp_path / "t.h5", dataset="emb", chunk_rows=4096, compression="gzip")
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert list(f) == ["emb"]
        assert f["emb"].chunks == (4096, 4) and f["emb"].compression == "gzip"
        np.testing.assert_array_equal(f["emb"][...], ref)
    for comp in ["gzip", "lzf", "none"]:
        g.save(tmp_path / f"c_{comp}.h5", compression=comp)
        np.testing.assert_array_equal(
            gl.DataGadget(tmp_path / f"c_{comp}.h5").getNumpyVersion(), ref
        )
    for comp in ["zstd", "gzip", "blosc", "none"]:
        g.save(tmp_path / f"c_{comp}.zarr", compression=comp)
        np.testing.assert_array_equal(
            gl.DataGadget(tmp_path / f"c_{comp}.zarr").getNumpyVersion(), ref
        )
    with pytest.raises(gl.GadgetKeyError):
        g.save(tmp_path / "x.zarr", compression="lzf")
    with pytest.raises(gl.GadgetKeyError):
        g.save(tmp_path / "x.h5", compression="zstd")
    for bad in ["a/../b", "./b"]:
        with pytest.raises(gl.GadgetValueError):
            g.save(tmp_path / "y.zarr", dataset=bad)
    assert not (tmp_path / "x.zarr").exists() and not (tmp_path / "y.zarr").exists()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", gl.SUPPORTED_DTYPES, ids=lambda d: str(d)[6:])
def test_every_table_dtype_round_trips_bit_exactly(tmp_path, dtype):
    gen = torch.Generator().manual_seed(6)
    if dtype.is_floating_point:
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            torch.empty((), dtype=dtype).element_size()
        ]
        t = torch.randint(-100, 100, (40, 3), generator=gen).to(width)
        t = (t * 7919 + 12345).to(width).view(dtype)  # arbitrary bit patterns
    elif dtype == torch.bool:
        t = torch.rand(40, 3, generator=gen) > 0.5
    else:
        t = torch.randint(0, 100, (40, 3), generator=gen).to(dtype)
    g = gl.DataGadget(t, placement="cpu")
    for ext in ["npy", "h5", "zarr"]:
        p = tmp_path / f"rt.{ext}"
        if dtype == torch.bfloat16 and ext == "npy":
            with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
                g.save(p)
            assert not p.exists()
            continue
        g.save(p)
        back = gl.DataGadget(p, placement="cpu")
        assert back.dtype == dtype
        assert torch.equal(_bits(back.as_tensor()), _bits(t))
        if dtype == torch.bfloat16 and ext == "h5":
            with h5py.File(p, "r") as f:
                (name,) = list(f)
                assert f[name].dtype == np.uint16  # stored as its bits


def test_unsigned_arrays_convert_with_dtype_and_such_files_are_refused(tmp_path):
    with pytest.raises(gl.GadgetTypeError, match="int64"):
        gl.DataGadget(np.array([[1, 2]], np.uint32))
    g = gl.DataGadget(np.array([[1, 2**32 - 1]], np.uint32), dtype="int64")
    np.testing.assert_array_equal(g.getNumpyVersion(), np.array([[1, 2**32 - 1]]))
    g = gl.DataGadget(np.array([[1, 65535]], np.uint16), dtype="int32")
    assert g.dtype == torch.int32 and int(g.getNumpyVersion()[0, 1]) == 65535
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.array([[2**32 - 1]], np.uint32), dtype="int32")
    p = tmp_path / "u16.npy"
    np.save(p, np.array([[1, 2]], np.uint16))
    with pytest.raises(gl.GadgetTypeError, match="int32"):
        gl.DataGadget(p)


def test_save_keeps_permissions_and_replaces_the_file_a_link_names(tmp_path):
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    p = tmp_path / "perm.npy"
    gl.DataGadget(a, placement="cpu").save(p)
    os.chmod(p, 0o640)
    gl.DataGadget(a + 1, placement="cpu").save(p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    link = tmp_path / "link.npy"
    os.symlink(p.name, link)
    gl.DataGadget(a * 2, placement="cpu").save(link)
    assert link.is_symlink()
    np.testing.assert_array_equal(np.load(p), a * 2)


def test_save_refuses_a_directory_or_a_non_zarr_target(tmp_path):
    g = gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu")
    for name in ["d.npy", "d.h5"]:
        (tmp_path / name).mkdir()
        with pytest.raises(gl.GadgetFileError):
            g.save(tmp_path / name)
    (tmp_path / "f.zarr").write_text("x")
    with pytest.raises(gl.GadgetFileError):
        g.save(tmp_path / "f.zarr")
    assert (tmp_path / "f.zarr").read_text() == "x"


def test_a_file_table_raises_once_its_file_is_replaced(tmp_path):
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    p = tmp_path / "r.npy"
    np.save(p, a)
    g = gl.DataGadget(p, placement="file")
    gl.DataGadget(a * 3, placement="cpu").save(p)
    with pytest.raises(gl.GadgetFileError):
        g.getData([0])
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.zeros(1, 2), [0])
    np.testing.assert_array_equal(np.load(p), a * 3)


def test_file_gadget_pickles_as_its_name_and_cpu_gadget_by_value(tmp_path):
    a = np.arange(2000, dtype=np.float32).reshape(500, 4)
    p = tmp_path / "pk.npy"
    np.save(p, a)
    f = gl.DataGadget(p, placement="file")
    blob = pickle.dumps(f)
    assert len(blob) < a.nbytes // 4  # the name, not the rows
    back = pickle.loads(blob)
    assert back.placement == "file"
    np.testing.assert_array_equal(_np(back.getData([499])), a[[499]])
    c = gl.DataGadget(a, placement="cpu")
    c2 = pickle.loads(pickle.dumps(c))
    c2.fill_(0.0)
    np.testing.assert_array_equal(c.getNumpyVersion(), a)


def test_save_checks_free_space_before_writing(tmp_path, monkeypatch):
    """'A save or convert to an uncompressed .npy or HDF5 file first checks the free
    space ... and raises GadgetFileError ("not enough space: need N bytes, M free on
    ...") before writing anything'."""
    a = np.ones((1000, 16), np.float32)
    old = np.zeros((2, 2), np.float32)
    for name in ["s.npy", "s.h5"]:
        np.save(tmp_path / "old.npy", old)
        gl.DataGadget(old, placement="cpu").save(tmp_path / name)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    before = sorted(os.listdir(tmp_path))
    g = gl.DataGadget(a, placement="cpu")
    for name in ["s.npy", "s.h5"]:
        with pytest.raises(gl.GadgetFileError, match="not enough space"):
            g.save(tmp_path / name)
    code, _, err = _run_cli(
        ["convert", str(tmp_path / "old.npy"), str(tmp_path / "new.npy"), "--no-progress"]
    )
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before  # no partial files
    np.testing.assert_array_equal(np.load(tmp_path / "s.npy"), old)
    np.testing.assert_array_equal(gl.DataGadget(tmp_path / "s.h5").getNumpyVersion(), old)
    assert code != 0 and "not enough space" in err


def test_write_to_a_damaged_chunk_leaves_the_file_unchanged(tmp_path):
    a = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    p = tmp_path / "dmg.zarr"
    gl.DataGadget(a, placement="cpu").save(p, chunk_rows=16)
    g = gl.DataGadget(p, placement="file")
    chunk2 = [q for q in p.rglob("*") if q.is_file() and q.relative_to(p).parts[-2:] == ("2", "0")]
    assert chunk2, sorted(str(q) for q in p.rglob("*"))
    chunk2[0].write_bytes(b"garbage")
    with pytest.raises(gl.GadgetFileError):
        g.insertData(torch.full((2, 4), -1.0), [1, 33])
    z = zarr.open_array(str(p), mode="r")
    np.testing.assert_array_equal(z[:16], a[:16])


def test_missing_extra_names_the_pip_extra_and_import_needs_no_extras(tmp_path):
    code = (
        "import sys\n"
        "for m in ('h5py', 'zarr', 'cupy', 'matplotlib'): sys.modules[m] = None\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "import numpy as np, gadgetloader as gl\n"
        "g = gl.DataGadget(np.ones((3, 2), np.float32), placement='cpu')\n"
        "assert float(g.getData([1]).sum()) == 2.0\n"
        "for name, extra in (('x.h5', 'hdf5'), ('x.zarr', 'zarr')):\n"
        "    try:\n"
        "        g.save(name)\n"
        "    except gl.MissingDependencyError as e:\n"
        "        assert isinstance(e, ImportError)\n"
        '        assert f"gadgetloader[{extra}]" in str(e), str(e)\n'
        "    else:\n"
        "        raise SystemExit('no MissingDependencyError for ' + name)\n"
        "print('OK')\n"
    )
    # the repository first, then whatever the run already had (where zarr may be installed)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


_INTERRUPT_SCRIPT = """
import os, signal, sys, warnings
warnings.simplefilter("ignore")
import numpy as np, gadgetloader as gl
from gadgetloader.io import _atomic, _hdf5, _npy, _stream, _zarr
from gadgetloader.cli import main
mode, ext = sys.argv[1], sys.argv[2]
_stream.STAGING_BYTES = 4096  # several blocks for a small table
old = np.zeros((8, 4), np.float32)
new = np.ones((512, 4), np.float32)
target = "t." + ext
gl.DataGadget(old, placement="cpu").save(target)
if mode == "early":  # Ctrl-C while the blocks are written
    orig = _stream._numpy_view
    calls = [0]
    def view(t):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return orig(t)
    _stream._numpy_view = view
else:  # Ctrl-C while the finished file replaces the target
    orig_rep = _atomic.replace_atomically
    def rep(tmp, tgt):
        os.kill(os.getpid(), signal.SIGINT)
        return orig_rep(tmp, tgt)
    {"npy": _npy, "h5": _hdf5, "zarr": _zarr}[ext].replace_atomically = rep
if mode == "convert":
    np.save("src.npy", new)
    sys.exit(main(["convert", "src.npy", target, "--no-progress"]))
try:
    gl.DataGadget(new, placement="cpu").save(target)
    print("RESULT none")
except KeyboardInterrupt as exc:
    print("RESULT", type(exc).__name__, exc)
back = gl.DataGadget(target).getNumpyVersion()
print("CONTENT", "old" if back.shape == old.shape else ("new" if (back == 1).all() else "?"))
print("HIDDEN", sorted(f for f in os.listdir(".") if f.startswith(".")))
"""


def _run_script(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # the repository first, then whatever the run already had (where zarr may be installed)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("ext", "modes"),
    [("npy", ["early", "late"]), ("h5", ["late", "convert"]), ("zarr", ["early", "late"])],
)
def test_ctrl_c_during_a_save_and_during_its_commit(tmp_path, ext, modes):
    """'An interrupt (Ctrl-C) during a save or convert removes the partial file; one that
    comes while the finished file replaces the target is held until it is in place and
    then raised as a KeyboardInterrupt saying "interrupted after ... was written"
    (convert exits 130 saying the file is complete)'."""
    for mode in modes:
        d = tmp_path / mode
        d.mkdir()
        r = _run_script(_INTERRUPT_SCRIPT, [mode, ext], d)
        if mode == "convert":
            assert r.returncode == 130, r.stderr[-2000:]
            assert "interrupted after" in r.stderr and "complete" in r.stderr
            np.testing.assert_array_equal(
                gl.DataGadget(d / f"t.{ext}").getNumpyVersion(), np.ones((512, 4), np.float32)
            )
            assert not [f for f in os.listdir(d) if f.startswith(".")]
            continue
        assert r.returncode == 0, r.stderr[-2000:]
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
        if mode == "early":
            assert lines["RESULT"].strip() == "KeyboardInterrupt"
            assert lines["CONTENT"] == "old"
        else:
            assert lines["RESULT"].startswith("InterruptedAfterWrite interrupted after")
            assert "was written" in lines["RESULT"]
            assert lines["CONTENT"] == "new"
        assert lines["HIDDEN"] == "[]"


_KILL_SCRIPT = """
import os, signal, sys, warnings
warnings.simplefilter("ignore")
import numpy as np, gadgetloader as gl
from gadgetloader.io import _stream
ext, where = sys.argv[1], sys.argv[2]
_stream.STAGING_BYTES = 4096
gl.DataGadget(np.zeros((8, 4), np.float32), placement="cpu").save("t." + ext)
if where == "mid":
    orig = _stream._numpy_view
    calls = [0]
    def view(t):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(t)
    _stream._numpy_view = view
else:  # a zarr store: killed between its two renames
    for name in ("rename", "replace"):
        orig_fn = getattr(os, name)
        def moved(a, b, *x, _orig=orig_fn, **kw):
            r = _orig(a, b, *x, **kw)
            if ".old-" in str(b):
                os.kill(os.getpid(), signal.SIGKILL)
            return r
        setattr(os, name, moved)
print(os.getpid(), flush=True)
gl.DataGadget(np.ones((512, 4), np.float32), placement="cpu").save("t." + ext)
"""


@pytest.mark.parametrize(("ext", "where"), [("npy", "mid"), ("zarr", "between")])
def test_a_killed_save_leaves_the_old_table_whole_and_a_hidden_partial(tmp_path, ext, where):
    r = _run_script(_KILL_SCRIPT, [ext, where], tmp_path)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    pid = r.stdout.split()[0]
    names = sorted(os.listdir(tmp_path))
    partial = [n for n in names if n.startswith(f".t.{ext}.partial-{pid}-")]
    assert len(partial) == 1, names
    assert len(partial[0].rsplit("-", 1)[1]) == 8
    if where == "mid":
        np.testing.assert_array_equal(
            gl.DataGadget(tmp_path / f"t.{ext}").getNumpyVersion(), np.zeros((8, 4), np.float32)
        )
    else:  # the old store is complete under .NAME.old-PID-XXXXXXXX
        old = [n for n in names if n.startswith(f".t.{ext}.old-{pid}-")]
        assert len(old) == 1, names
        np.testing.assert_array_equal(
            gl.DataGadget(tmp_path / old[0], format="zarr").getNumpyVersion(),
            np.zeros((8, 4), np.float32),
        )


@pytest.mark.parametrize("replaced", ["target", "linker"])
def test_external_link_is_read_only_and_both_files_are_watched(tmp_path, replaced):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    target, linker = tmp_path / "target.h5", tmp_path / "linker.h5"
    with h5py.File(target, "w") as f:
        f.create_dataset("d", data=a)
    with h5py.File(linker, "w") as f:
        f["ext"] = h5py.ExternalLink(target.name, "d")
    np.testing.assert_array_equal(gl.DataGadget(linker).getNumpyVersion(), a)
    g = gl.DataGadget(linker, placement="file")
    np.testing.assert_array_equal(_np(g.getData([1, 9])), a[[1, 9]])
    with pytest.raises(gl.ReadOnlyError):
        g.insertData(torch.zeros(1, 4), [0])
    if replaced == "target":
        gl.DataGadget(a * 2, placement="cpu").save(target, dataset="d")
    else:
        tmp = tmp_path / "new_linker.h5"
        with h5py.File(tmp, "w") as f:
            f["ext"] = h5py.ExternalLink(target.name, "d")
        os.replace(tmp, linker)
    with pytest.raises(gl.GadgetFileError):
        g.getData([1])


@pytest.mark.parametrize("ext", ["npy", "h5", "zarr"])
def test_file_tables_of_one_file_see_each_others_writes_and_threads_share_one(tmp_path, ext):
    import threading

    a = np.random.default_rng(8).standard_normal((2000, 8)).astype(np.float32)
    p = tmp_path / f"shared.{ext}"
    kw = {} if ext == "npy" else {"chunk_rows": 16, "compression": "gzip"}
    gl.DataGadget(a, placement="cpu").save(p, **kw)
    t1 = gl.DataGadget(p, placement="file", cache_bytes=1 << 12)
    t2 = gl.DataGadget(p, placement="file", cache_bytes=1 << 12)
    t1.getData([3, 1500])
    t2.getData([3, 1500])  # both hold the blocks
    t1.insertData(torch.full((2, 8), 9.0), [3, 1500])
    a[[3, 1500]] = 9.0
    np.testing.assert_array_equal(_np(t2.getData([3, 1500])), a[[3, 1500]])
    bad, errors = [], []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(25):
                ids = rng.integers(0, 2000, 48)
                if not np.array_equal(_np(t1.getData(ids)), a[ids]):
                    bad.append(seed)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad, (errors, bad)


def test_workers_started_after_a_file_write_read_it(tmp_path):
    """'Each write reaches the file before it returns (an HDF5 write flushes HDF5's
    caches ...), so workers started later read it'."""
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    gl.DataGadget(a, placement="cpu").save(tmp_path / "w.h5", chunk_rows=8, compression="gzip")
    g = gl.DataGadget(tmp_path / "w.h5", placement="file")
    g.getData([0, 50])  # blocks in the cache
    g.insertData(torch.full((2, 4), -7.0), [3, 60])
    a[[3, 60]] = -7.0
    ds = gl.GadgetDataset(g, torch.arange(100))
    sampler = gl.GadgetSampler(ds, batch_size=25, order="sequential")
    got = list(DataLoader(ds, batch_sampler=sampler, num_workers=1))
    np.testing.assert_array_equal(np.concatenate([_np(x) for x, _ in got]), a)


# ---------------------------------------------------------------------------------------
# Input pipeline
# ---------------------------------------------------------------------------------------


def _id_dataset(tmp_path: Path, n: int = 1000) -> tuple[gl.GadgetDataset, np.ndarray]:
    feat = np.random.default_rng(7).standard_normal((n, 3)).astype(np.float32)
    feat[:, 0] = np.arange(n)
    np.save(tmp_path / "features.npy", feat)
    labels = torch.arange(n) * 2
    return gl.GadgetDataset(str(tmp_path / "features.npy"), labels), feat


def test_default_dataloader_form(tmp_path):
    ds, feat = _id_dataset(tmp_path)
    seen = []
    for x, y in DataLoader(ds, batch_size=128, shuffle=True):  # default form, no collate_fn
        xi = _np(x[:, 0]).astype(np.int64)
        np.testing.assert_array_equal(_np(x), feat[xi])
        np.testing.assert_array_equal(_np(y), xi * 2)
        seen.append(xi)
    assert sorted(np.concatenate(seen).tolist()) == list(range(1000))


def test_collate_subset_concat_and_stack_datasets(tmp_path):
    ds, feat = _id_dataset(tmp_path, 50)
    (b,) = next(iter(DataLoader(ds, batch_size=4, collate_fn=lambda batch: batch)))
    x, y = next(iter(DataLoader(ds, batch_size=4, collate_fn=lambda batch: batch[0])))
    np.testing.assert_array_equal(_np(x), feat[:4])
    sub = Subset(ds, [5, 7, 9, 11])
    x, y = next(iter(DataLoader(sub, batch_size=4)))
    np.testing.assert_array_equal(_np(y), [10, 14, 18, 22])
    _, part = random_split(ds, [40, 10], generator=torch.Generator().manual_seed(0))
    x, y = next(iter(DataLoader(part, batch_size=5)))
    np.testing.assert_array_equal(_np(x[:, 0]).astype(np.int64) * 2, _np(y))
    cat = ConcatDataset([ds, ds])
    per_sample = next(iter(DataLoader(cat, batch_size=3, collate_fn=lambda batch: batch)))
    assert len(per_sample) == 3 and all(isinstance(s, tuple) for s in per_sample)
    x, y = next(iter(DataLoader(cat, batch_size=3)))
    np.testing.assert_array_equal(_np(y), [0, 2, 4])
    stack_cls = getattr(torch.utils.data, "StackDataset", None)
    if stack_cls is not None:
        with pytest.raises(ValueError, match="output size mismatch"):
            next(iter(DataLoader(stack_cls(ds, ds), batch_size=4)))


def test_sampler_forms_give_the_sampler_order(tmp_path):
    ds, feat = _id_dataset(tmp_path)
    order = torch.cat([b.clone() for b in gl.GadgetSampler(ds, batch_size=128, seed=0)])
    sampler = gl.GadgetSampler(ds, batch_size=128, order="random", seed=0)
    loader = DataLoader(ds, batch_sampler=sampler)
    got = torch.cat([y.cpu() for _, y in loader]) // 2
    assert torch.equal(got, order)
    loader = DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=128, seed=0), batch_size=None)
    got = torch.cat([y.cpu() for _, y in loader]) // 2
    assert torch.equal(got, order)
    loader = gl.GadgetLoader(ds, batch_size=128, prefetch=2)
    got = torch.cat([y.cpu() for _, y in loader]) // 2
    assert torch.equal(got, order)
    with pytest.raises(gl.GadgetError):
        list(DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=128)))


def test_sampler_orders_drop_last_pad_and_seed():
    n = 1000
    s = gl.GadgetSampler(n, batch_size=300, order="sequential")
    batches = list(s)
    assert [len(b) for b in batches] == [300, 300, 300, 100]
    assert torch.equal(torch.cat(batches), torch.arange(n))
    assert batches[0].dtype == torch.int64
    assert [len(b) for b in gl.GadgetSampler(n, batch_size=300, drop_last=True)] == [300] * 3
    padded = list(gl.GadgetSampler(n, batch_size=300, order="sequential", pad=True))
    assert [len(b) for b in padded] == [300] * 4
    assert torch.equal(padded[-1], torch.cat([torch.arange(900, 1000), torch.arange(0, 200)]))
    r = gl.GadgetSampler(n, batch_size=128, seed=5)
    e0 = torch.cat([b.clone() for b in r])
    e1 = torch.cat([b.clone() for b in r])
    assert torch.equal(torch.sort(e0).values, torch.arange(n))
    assert not torch.equal(e0, e1)  # a new permutation each epoch
    again = torch.cat([b.clone() for b in gl.GadgetSampler(n, batch_size=128, seed=5)])
    assert torch.equal(again, e0)
    with pytest.raises(gl.GadgetKeyError):
        gl.GadgetSampler(n, batch_size=4, order="bogus")


def test_a_sampler_batch_travels_as_its_own_ids():
    """'Sent to a DataLoader worker, a batch travels as its own ids (not the whole order
    it is a view of)'."""
    from multiprocessing.reduction import ForkingPickler

    s = gl.GadgetSampler(1_000_000, batch_size=16, seed=0)
    b = next(iter(s))
    assert b.dtype == torch.int64 and len(b) == 16
    blob = pickle.dumps(b)
    assert len(blob) < 4096  # the order itself is 8 MB
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(b)
    assert len(buf.getvalue()) < 4096
    back = pickle.loads(blob)
    assert torch.equal(back, b.clone())


def test_sampler_epochs_advance_only_after_every_batch():
    s = gl.GadgetSampler(100, batch_size=10, seed=1)
    first = next(iter(s)).clone()
    assert torch.equal(next(iter(s)), first)  # an early break: the same epoch anew
    full = [b.clone() for b in s]
    assert torch.equal(full[0], first)
    nxt = next(iter(s)).clone()
    assert not torch.equal(nxt, first)  # every batch drawn: the next epoch
    s.set_epoch(5)
    a = torch.cat([b.clone() for b in s])
    s.set_epoch(5)
    assert torch.equal(torch.cat([b.clone() for b in s]), a)


def test_sampler_state_resume_and_refusals():
    ds = gl.GadgetDataset(np.zeros((1000, 1), np.float32))
    full = [b.clone() for b in gl.GadgetSampler(ds, batch_size=100, seed=3)]
    s = gl.GadgetSampler(ds, batch_size=100, seed=3)
    it = iter(s)
    got = [next(it).clone() for _ in range(4)]
    state = s.state_dict()
    r = gl.GadgetSampler(ds, batch_size=100, seed=99)  # the state brings its seed
    r.load_state_dict(state)
    rest = [b.clone() for b in r]
    assert torch.equal(torch.cat(got + rest), torch.cat(full))
    for kw in [
        {"batch_size": 50},
        {"batch_size": 100, "order": "sequential"},
        {"batch_size": 100, "drop_last": True},
        {"batch_size": 100, "pad": True},
        {"batch_size": 100, "num_replicas": 2, "rank": 0},
    ]:
        q = gl.GadgetSampler(ds, seed=7, **kw)
        before = q.state_dict()
        with pytest.raises(gl.GadgetValueError):
            q.load_state_dict(state)
        assert q.state_dict() == before
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(999, batch_size=100).load_state_dict(state)


def test_state_after_the_last_batch_resumes_with_one_empty_pass():
    ds = gl.GadgetDataset(np.arange(100, dtype=np.int64).reshape(100, 1))
    ref = gl.GadgetSampler(ds, batch_size=10, seed=4)
    list(ref)
    epoch1 = torch.cat([b.clone() for b in ref])
    s = gl.GadgetSampler(ds, batch_size=10, seed=4)
    it = iter(s)
    for _ in range(10):
        next(it)
    state = s.state_dict()
    r = gl.GadgetSampler(ds, batch_size=10)
    r.load_state_dict(state)
    assert list(r) == []
    assert torch.equal(torch.cat([b.clone() for b in r]), epoch1)
    loader = gl.GadgetLoader(ds, batch_size=10, seed=4)
    it = iter(loader)
    for _ in range(10):
        next(it)
    lstate = loader.state_dict()
    fresh = gl.GadgetLoader(ds, batch_size=10)
    fresh.load_state_dict(lstate)
    assert list(fresh) == []
    got = torch.cat([x.cpu().view(-1) for (x,) in fresh])
    assert torch.equal(got, epoch1)


@pytest.mark.parametrize(("n", "bs", "world"), [(1000, 100, 3), (1001, 100, 3), (7, 1, 3)])
def test_ranks_see_every_row_once_and_the_same_number_of_batches(n, bs, world):
    per = [
        [b.clone() for b in gl.GadgetSampler(n, batch_size=bs, num_replicas=world, rank=r)]
        for r in range(world)
    ]
    assert len({len(p) for p in per}) == 1
    ids = torch.cat([torch.cat(p) for p in per])
    assert torch.equal(torch.sort(ids).values, torch.arange(n))
    assert max(len(b) for p in per for b in p) <= bs + 1
    dropped = [
        [
            b.clone()
            for b in gl.GadgetSampler(n, batch_size=bs, num_replicas=world, rank=r, drop_last=True)
        ]
        for r in range(world)
    ]
    ids = torch.cat([torch.cat(p) for p in dropped])
    assert len(ids.unique()) == len(ids) and n - len(ids) < world * bs
    assert all(len(b) == bs for p in dropped for b in p)
    padded = [
        [
            b.clone()
            for b in gl.GadgetSampler(n, batch_size=bs, num_replicas=world, rank=r, pad=True)
        ]
        for r in range(world)
    ]
    assert all(len(b) == bs for p in padded for b in p)
    assert len(torch.cat([torch.cat(p) for p in padded]).unique()) == n


def test_gadget_loader_prefetch0_sees_writes_and_sampler_options_belong_to_sampler():
    n = 100
    tab = gl.DataGadget(np.arange(n, dtype=np.float32).reshape(n, 1), placement="cpu")
    ds = gl.GadgetDataset(tab)
    out = []
    for i, (x,) in enumerate(gl.GadgetLoader(ds, batch_size=10, order="sequential", prefetch=0)):
        out.append(x.cpu().clone())
        if i == 0:
            tab.insertData(torch.full((10, 1), -1.0), torch.arange(10, 20))
    assert bool((out[1] == -1).all())
    s = gl.GadgetSampler(ds, batch_size=10)
    for kw in [{"seed": 1}, {"order": "random"}, {"drop_last": False}, {"batch_size": 10}]:
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetLoader(ds, sampler=s, **kw)


@pytest.mark.parametrize(
    "kw", [{"prefetch": 2}, {"prefetch": 2, "coalesce": 4}, {"prefetch": 0}, {"num_workers": 2}]
)
def test_gadget_loader_counts_batches_handed_out_after_an_early_break(kw):
    """'after an early break call set_epoch, or use GadgetLoader, which counts the batches
    it handed out': the next pass is the same epoch anew, and after a whole pass the next
    epoch."""
    ds = gl.GadgetDataset(np.arange(100, dtype=np.int64).reshape(100, 1))
    loader = gl.GadgetLoader(ds, batch_size=10, seed=3, **kw)
    it = iter(loader)
    first = [next(it)[0].cpu().view(-1).clone() for _ in range(3)]
    del it
    again = [x.cpu().view(-1).clone() for (x,) in loader]
    after = [x.cpu().view(-1).clone() for (x,) in loader]
    ref = gl.GadgetSampler(ds, batch_size=10, seed=3)
    epoch0 = [b.clone() for b in ref]
    epoch1 = [b.clone() for b in ref]
    assert all(torch.equal(x, y) for x, y in zip(first, epoch0, strict=False))
    assert torch.equal(torch.cat(again), torch.cat(epoch0))
    assert torch.equal(torch.cat(after), torch.cat(epoch1))


def test_gadget_loader_follows_its_samplers_set_epoch_and_state():
    ds = gl.GadgetDataset(np.arange(100, dtype=np.int64).reshape(100, 1))
    s = gl.GadgetSampler(ds, batch_size=10, seed=4)
    loader = gl.GadgetLoader(ds, sampler=s)
    s.set_epoch(3)
    got = torch.cat([x.cpu().view(-1) for (x,) in loader])
    s.set_epoch(3)
    assert torch.equal(got, torch.cat([b.clone() for b in s]))
    other = gl.GadgetSampler(ds, batch_size=10, seed=4)
    it = iter(other)
    for _ in range(4):
        next(it)
    s.load_state_dict(other.state_dict())
    got = torch.cat([x.cpu().view(-1) for (x,) in loader])
    assert torch.equal(got, torch.cat([b.clone() for b in it]))


def test_dataset_indexing_follows_python_and_reload_is_refused(tmp_path):
    n = 20
    ref = np.arange(n, dtype=np.int64).reshape(n, 1)
    tab = gl.DataGadget(ref.copy(), placement="cpu")
    ds = gl.GadgetDataset(tab, torch.arange(n) * 10)
    x, y = ds[-1]
    assert int(x.cpu()[0]) == n - 1 and int(y) == (n - 1) * 10
    for sl in [slice(-3, None), slice(None, None, 2), slice(5, 2), slice(None, None, -1)]:
        x, _ = ds[sl]
        np.testing.assert_array_equal(_np(x).reshape(-1), ref.reshape(-1)[sl])
    with pytest.raises(gl.GadgetIndexError):
        ds[n]
    with pytest.raises(gl.GadgetIndexError):
        ds[[1, -1]]  # ids in lists must lie in [0, len(ds))
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__([0, n])
    np.save(tmp_path / "reload.npy", np.zeros((30, 1), np.int64))
    tab.load(tmp_path / "reload.npy")  # another row count
    with pytest.raises(gl.GadgetValueError):
        ds.__getitems__([0, 1])


def test_chunk_order_uses_the_lcm_rule_and_covers_every_row(tmp_path):
    n = 2000
    a = np.arange(n, dtype=np.float32).reshape(n, 1)
    for cr in (64, 96, 100):
        gl.DataGadget(a, placement="cpu").save(tmp_path / f"c{cr}.h5", chunk_rows=cr)
    for pair, expected in [((64, 96), 192), ((64, 100), 100), ((64,), 64)]:
        cols = [gl.DataGadget(tmp_path / f"c{c}.h5", placement="file") for c in pair]
        ds = gl.GadgetDataset(*cols)
        s = gl.GadgetSampler(ds, batch_size=32, order="chunk", seed=0)
        assert s.state_dict()["chunk_rows"] == expected
        assert sorted(torch.cat([b.clone() for b in s]).tolist()) == list(range(n))


def test_a_batch_changed_in_place_is_replayed_and_host_columns_check_it():
    n = 50
    # a host column: it checks ids changed through NumPy (cuda / pinned columns need not)
    ds = gl.GadgetDataset(np.arange(n, dtype=np.int64).reshape(n, 1), placement="cpu")
    s = gl.GadgetSampler(ds, batch_size=10, seed=2)
    s.set_epoch(0)
    b0 = next(iter(s))
    new = (int(b0[0]) + 1) % n
    b0[0] = new
    s.set_epoch(0)
    assert int(next(iter(s))[0]) == new
    s.set_epoch(1)
    it = iter(s)
    b = next(it)
    b.numpy()[1] = 10**6  # through NumPy: keeps the sampler's tag
    with pytest.raises(gl.GadgetIndexError):
        ds.__getitems__(b)


# ---------------------------------------------------------------------------------------
# Training embeddings larger than GPU memory
# ---------------------------------------------------------------------------------------


def test_dropin_readme_example_matches_dense_adamw(device):
    """The README's drop-in loop (small tables, `.to(device)` for `.cuda()`), against
    nn.Embedding / nn.EmbeddingBag + AdamW on the whole tables; every row is in every
    batch, so lazy per-row updates equal dense ones."""
    torch.manual_seed(0)
    ni, nu, d = 20, 10, 8
    model = torch.nn.ModuleDict(
        {
            "item": gl.OffloadedEmbedding(ni, d, placement="pinned"),
            "user": gl.OffloadedEmbeddingBag(nu, d, mode="mean"),
            "head": torch.nn.Linear(d, 1),
        }
    ).to(device)
    ref = torch.nn.ModuleDict(
        {
            "item": torch.nn.Embedding(ni, d),
            "user": torch.nn.EmbeddingBag(nu, d, mode="mean"),
            "head": torch.nn.Linear(d, 1),
        }
    )
    with torch.no_grad():
        ref["item"].weight.copy_(model["item"].weight.as_tensor().cpu())
        ref["user"].weight.copy_(model["user"].weight.as_tensor().cpu())
        ref["head"].load_state_dict({k: v.cpu() for k, v in model["head"].state_dict().items()})
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, lr=1e-2, weight_decay=0.01)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        items = torch.cat(
            [torch.randperm(ni, generator=g), torch.randint(0, ni, (12,), generator=g)]
        )
        history = torch.cat(
            [torch.randperm(nu, generator=g), torch.randint(0, nu, (2 * 32 - nu,), generator=g)]
        ).reshape(32, 2)
        batches.append((items, history, torch.randn(32, generator=g)))
    for items, history, y in batches:
        items_d, history_d, y_d = items.to(device), history.to(device), y.to(device)
        pred = model["head"](model["item"](items_d) * model["user"](history_d)).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, y_d)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rpred = ref["head"](ref["item"](items) * ref["user"](history)).squeeze(-1)
        rloss = torch.nn.functional.mse_loss(rpred, y)
        ropt.zero_grad()
        rloss.backward()
        ropt.step()
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(model["item"].weight.as_tensor().cpu(), ref["item"].weight, **tol)
    torch.testing.assert_close(model["user"].weight.as_tensor().cpu(), ref["user"].weight, **tol)
    torch.testing.assert_close(model["head"].weight.detach().cpu(), ref["head"].weight, **tol)


class _SkipGram(torch.nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(rows, dim)
        self.v_embeddings = torch.nn.Embedding(rows, dim)

    def forward(self, c, p, n):
        u = self.u_embeddings(c)
        v = self.v_embeddings(p)
        nv = self.v_embeddings(n)
        pos = F.logsigmoid((u * v).sum(-1))
        neg = F.logsigmoid(-(nv @ u.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return -(pos + neg).mean()


def test_switchers_readme_example_matches_dense_adam(device):
    total_words, d, b, k = 12, 4, 16, 3
    torch.manual_seed(0)
    model = _SkipGram(b * (k + 1), d).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    u_switch = gl.ModelFactory(model.u_embeddings, total_words, d, CPUPinn=True)
    v_switch = gl.ModelFactory(model.v_embeddings, total_words, d, CPUPinn=True)
    u_switch.uniformDistributionInit(-0.01, 0.01)
    v_switch.zerosInit()
    u_opt = gl.OptimizerFactory(optimizer, total_words, d, model, "u_embeddings", CPUPinn=True)
    v_opt = gl.OptimizerFactory(optimizer, total_words, d, model, "v_embeddings", CPUPinn=True)
    u_opt.optInit()
    v_opt.optInit()
    u0 = u_switch.getNumpyVersion()
    assert np.abs(u0).max() <= 0.01 and np.abs(u0).max() > 0
    assert not v_switch.getNumpyVersion().any()
    ref = _SkipGram(total_words, d)
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(torch.from_numpy(u0))
        ref.v_embeddings.weight.zero_()
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        center = torch.cat(
            [
                torch.randperm(total_words, generator=g),
                torch.randint(0, total_words, (4,), generator=g),
            ]
        )
        ctx = torch.cat(
            [
                torch.randperm(total_words, generator=g),
                torch.randint(0, total_words, (4,), generator=g),
            ]
        )
        neg = torch.randint(0, total_words, (b, k), generator=g)
        center, ctx, neg = center.to(device), ctx.to(device), neg.to(device)
        speedtorch_step(model, optimizer, u_switch, u_opt, v_switch, v_opt, center, ctx, neg)
        rloss = ref(center.cpu(), ctx.cpu(), neg.cpu())
        ropt.zero_grad()
        rloss.backward()
        ropt.step()
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(
        torch.from_numpy(u_switch.getNumpyVersion()), ref.u_embeddings.weight.detach(), **tol
    )
    torch.testing.assert_close(
        torch.from_numpy(v_switch.getNumpyVersion()), ref.v_embeddings.weight.detach(), **tol
    )
    state = u_opt.getNumpyVersion()
    assert set(state) == {"exp_avg", "exp_avg_sq"}
    rstate = ropt.state[ref.u_embeddings.weight]
    torch.testing.assert_close(torch.from_numpy(state["exp_avg"]), rstate["exp_avg"], **tol)


def _ckpt_model(seed: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.ModuleDict(
        {
            "item": gl.OffloadedEmbedding(30, 4, placement="cpu", dtype=dtype, device="cpu"),
            "head": torch.nn.Linear(4, 1),
        }
    )
    return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=1e-2)


def _ckpt_step(m, o, g: torch.Generator) -> None:
    ids = torch.randint(0, 30, (16,), generator=g)
    y = torch.randn(16, generator=g)
    dev = m["head"].weight.device
    out = m["head"](m["item"](ids.to(dev)).float()).squeeze(-1)
    loss = torch.nn.functional.mse_loss(out, y.to(dev))
    o.zero_grad()
    loss.backward()
    o.step()


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_resumes_bit_identically(tmp_path, fmt):
    m, o = _ckpt_model(0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _ckpt_step(m, o, g)
    gl.save_checkpoint(tmp_path / "ckpt", {"model": m, "optimizer": o}, format=fmt)
    assert (tmp_path / "ckpt" / "meta.pt").exists()
    gen_state = g.get_state()
    for _ in range(3):
        _ckpt_step(m, o, g)
    m2, o2 = _ckpt_model(5)
    gl.load_checkpoint(tmp_path / "ckpt", {"model": m2, "optimizer": o2})
    g.set_state(gen_state)
    for _ in range(3):
        _ckpt_step(m2, o2, g)
    assert torch.equal(m["item"].weight.as_tensor().cpu(), m2["item"].weight.as_tensor().cpu())
    assert torch.equal(m["head"].weight.detach().cpu(), m2["head"].weight.detach().cpu())


def test_checkpoint_refusals_write_nothing(tmp_path):
    m, o = _ckpt_model(0, dtype=torch.bfloat16)
    with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
        gl.save_checkpoint(tmp_path / "bf", {"model": m, "optimizer": o}, format="npy")
    assert not (tmp_path / "bf").exists()
    gl.save_checkpoint(tmp_path / "bf_h5", {"model": m, "optimizer": o}, format="hdf5")
    for name in ["", "a/b", "a\\b", "a\0b", ".", ".."]:
        with pytest.raises(gl.GadgetValueError):
            gl.save_checkpoint(tmp_path / "names", {name: m})
        assert not (tmp_path / "names").exists()
    m, o = _ckpt_model(0)
    o.param_groups[0]["fn"] = lambda x: x
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "fn", {"model": m, "optimizer": o})
    assert not (tmp_path / "fn").exists()


def test_checkpoint_with_a_damaged_table_leaves_every_object_as_it_was(tmp_path):
    m, o = _ckpt_model(0)
    _ckpt_step(m, o, torch.Generator().manual_seed(2))
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": o}, format="npy")
    first = sorted(os.listdir(tmp_path / "ck"))
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": o}, format="npy")
    second = sorted(os.listdir(tmp_path / "ck"))
    assert len(first) == len(second) and set(first) & set(second) == {"meta.pt"}
    victim = next(f for f in second if f.startswith("optimizer."))
    p = tmp_path / "ck" / victim
    p.write_bytes(p.read_bytes()[:-16])
    m2, o2 = _ckpt_model(7)
    before = m2["item"].weight.getNumpyVersion()
    head_before = m2["head"].weight.detach().clone()
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": o2})
    np.testing.assert_array_equal(m2["item"].weight.getNumpyVersion(), before)
    assert torch.equal(m2["head"].weight.detach(), head_before)


class _SwModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(4, 3)
        self.h = torch.nn.Linear(3, 1)


def _switched(opt_cls=torch.optim.Adam):
    m = _SwModel()
    opt = opt_cls(m.parameters(), lr=0.1)
    sw = gl.ModelFactory(m.e, 10, 3, placement="cpu")
    osw = gl.OptimizerFactory(opt, 10, 3, m, "e", placement="cpu")
    osw.optInit()
    return m, opt, sw, osw


def test_checkpoint_with_switchers(tmp_path):
    """A model paged by switchers needs them in the checkpoint; with them it resumes, and
    optimizer switchers record their optimizer's class."""
    torch.manual_seed(0)
    m, opt, sw, osw = _switched()
    sw.uniformDistributionInit(-1, 1)
    with pytest.raises(gl.GadgetValueError, match="switchers"):
        gl.save_checkpoint(tmp_path / "no_sw", {"model": m})
    assert not (tmp_path / "no_sw").exists()
    ids = torch.tensor([1, 5, 5, 9])
    for _ in range(2):
        local = sw.beforeForwardPass(ids)
        osw.beforeForwardPass(ids)
        m.h(m.e(local)).sum().backward()
        opt.step()
        opt.zero_grad()
        sw.afterOptimizerStep(ids)
        osw.afterOptimizerStep(ids)
    objs = {"model": m, "sw": sw, "osw": osw, "opt": opt}
    gl.save_checkpoint(tmp_path / "ck", objs)
    m2, opt2, sw2, osw2 = _switched()
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "sw": sw2, "osw": osw2, "opt": opt2})
    np.testing.assert_array_equal(sw2.getNumpyVersion(), sw.getNumpyVersion())
    for k in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(osw2.getNumpyVersion()[k], osw.getNumpyVersion()[k])
    assert torch.equal(m2.h.weight, m.h.weight)
    m3, opt3, sw3, osw3 = _switched(torch.optim.NAdam)
    with pytest.raises(gl.GadgetError, match="Adam"):
        gl.load_checkpoint(tmp_path / "ck", {"model": m3, "sw": sw3, "osw": osw3, "opt": opt3})
    assert not sw3.getNumpyVersion().any()  # nothing changed


def test_one_cycle_scheduler_and_clipping_over_param_groups_match_dense():
    """OneCycleLR turns momentum on before the first step; clipping over the optimizer's
    param_groups reaches the tables' row gradients."""
    torch.manual_seed(0)
    n, d = 8, 3
    emb = gl.OffloadedEmbedding(n, d, placement="cpu", device="cpu")
    model = torch.nn.ModuleDict({"e": emb, "h": torch.nn.Linear(d, 1)})
    ref = torch.nn.ModuleDict({"e": torch.nn.Embedding(n, d), "h": torch.nn.Linear(d, 1)})
    with torch.no_grad():
        ref["e"].weight.copy_(emb.weight.as_tensor().cpu())
        ref["h"].load_state_dict(model["h"].state_dict())
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    kw = {"max_lr": 0.5, "total_steps": 5, "base_momentum": 0.8, "max_momentum": 0.9}
    sch = torch.optim.lr_scheduler.OneCycleLR(opt, **kw)
    rsch = torch.optim.lr_scheduler.OneCycleLR(ropt, **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids = torch.cat([torch.randperm(n, generator=g), torch.randint(0, n, (5,), generator=g)])
        y = torch.randn(len(ids), generator=g)
        for mdl, o in [(model, opt), (ref, ropt)]:
            o.zero_grad()
            out = mdl["h"](mdl["e"](ids)).squeeze(-1)
            torch.nn.functional.mse_loss(out, y).backward()
            torch.nn.utils.clip_grad_norm_([p for gr in o.param_groups for p in gr["params"]], 0.5)
            o.step()
        sch.step()
        rsch.step()
    torch.testing.assert_close(emb.weight.as_tensor().cpu(), ref["e"].weight.detach())
    torch.testing.assert_close(model["h"].weight.detach(), ref["h"].weight.detach())


def test_offloaded_optimizer_refusals():
    m = torch.nn.ModuleDict(
        {"item": gl.OffloadedEmbedding(10, 3, placement="cpu"), "head": torch.nn.Linear(3, 1)}
    )
    with pytest.warns(UserWarning, match="no OffloadedEmbedding"):
        gl.OffloadedOptimizer(torch.optim.SGD, m.parameters(), lr=0.1)
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(
            torch.optim.SGD, [{"params": m["item"]}, {"params": m["item"], "lr": 1.0}], lr=0.1
        )
    opt = gl.OffloadedOptimizer(
        torch.optim.Adam,
        [{"params": m["item"], "lr": 1e-2}, {"params": m["head"].parameters()}],
        lr=1e-3,
    )
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.Adam, m["item"], lr=0.1)  # one optimizer at a time
    m2 = torch.nn.ModuleDict(
        {"item": gl.OffloadedEmbedding(10, 3, placement="cpu"), "head": torch.nn.Linear(3, 1)}
    )
    o2 = gl.OffloadedOptimizer(torch.optim.NAdam, m2, lr=0.1)
    before = m2["item"].weight.getNumpyVersion()
    with pytest.raises(gl.GadgetError, match="Adam"):
        o2.load_state_dict(opt.state_dict())
    np.testing.assert_array_equal(m2["item"].weight.getNumpyVersion(), before)


def test_step_semantics_freeze_and_late_gradients():
    e = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=1.0)
    w0 = e.weight.getNumpyVersion()
    e.requires_grad_(False)
    assert not e(torch.tensor([1, 2])).requires_grad
    e.requires_grad_(True)
    e(torch.tensor([1, 1, 2])).sum().backward()
    opt.step()
    w1 = e.weight.getNumpyVersion()
    ref = w0.copy()
    ref[1] -= 2.0  # repeated ids: gradients add up
    ref[2] -= 1.0
    np.testing.assert_allclose(w1, ref, rtol=0, atol=1e-6)
    opt.step()  # consumed: no new backward, tables untouched
    np.testing.assert_array_equal(e.weight.getNumpyVersion(), w1)
    loss = e(torch.tensor([4])).sum()
    loss.backward(retain_graph=True)
    opt.step()
    w2 = e.weight.getNumpyVersion()
    loss.backward()  # reaches a lookup after the step that read it
    with pytest.raises(gl.GadgetError):
        opt.step()
    np.testing.assert_array_equal(e.weight.getNumpyVersion(), w2)
    e(torch.tensor([5]))  # a training lookup waits for backward and step
    with pytest.raises(gl.GadgetError):
        e.weight.fill_(0.0)
    with pytest.raises(gl.GadgetError):
        e.weight.insertData(torch.zeros(1, 3), [0])
    np.testing.assert_array_equal(e.weight.getNumpyVersion(), w2)


def test_half_and_double_change_lookups_not_the_table():
    e = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu")
    ref = e.weight.getNumpyVersion()
    h = e.half()
    out = h(torch.tensor([1, 2]))
    assert out.dtype == torch.float16 and h.weight.dtype == torch.float32
    np.testing.assert_array_equal(_np(out), ref[[1, 2]].astype(np.float16))
    assert e.double()(torch.tensor([3])).dtype == torch.float64


@pytest.mark.parametrize("mode", ["mean", "sum", "max"])
def test_embedding_bag_takes_2d_input_or_offsets_like_torch(mode):
    bag = gl.OffloadedEmbeddingBag(10, 4, mode=mode, placement="cpu", device="cpu")
    ref = torch.nn.EmbeddingBag(10, 4, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(bag.weight.as_tensor().cpu())
    x2 = torch.tensor([[1, 2, 2], [3, 4, 9]])
    torch.testing.assert_close(bag(x2), ref(x2))
    flat, offsets = torch.tensor([1, 2, 2, 3, 4, 9, 0]), torch.tensor([0, 3, 3])
    torch.testing.assert_close(bag(flat, offsets), ref(flat, offsets))


def test_deepcopy_and_pickle_of_a_trained_table_are_separate():
    e = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    ref = e.weight.getNumpyVersion()
    c = copy.deepcopy(e)
    np.testing.assert_array_equal(c.weight.getNumpyVersion(), ref)
    c.weight.fill_(0.0)
    p = pickle.loads(pickle.dumps(e.weight))
    p.fill_(1.0)
    np.testing.assert_array_equal(e.weight.getNumpyVersion(), ref)
    gl.OffloadedOptimizer(torch.optim.Adam, c, lr=0.1)  # no optimizer of its own yet


def test_offloaded_optimizer_is_a_torch_optimizer_with_row_grads_in_its_groups():
    e = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=1.0)
    assert isinstance(opt, torch.optim.Optimizer)
    e(torch.tensor([1, 1, 3])).sum().backward()
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    assert len(grads) == 1  # the batch's distinct rows, repeats summed
    assert sorted(grads[0].sum(dim=1).tolist()) == [2.0, 4.0]
    new = gl.OffloadedEmbedding(4, 2, placement="cpu", device="cpu")
    w = new.weight.getNumpyVersion()
    opt.add_param_group({"params": new, "lr": 0.5})
    opt.step()
    new(torch.tensor([0])).sum().backward()
    opt.step()
    np.testing.assert_allclose(
        w - new.weight.getNumpyVersion(), [[0.5, 0.5]] + [[0, 0]] * 3, atol=1e-6
    )
    e2 = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    o2 = gl.OffloadedOptimizer(torch.optim.SGD, e2, lr=1.0)
    w = e2.weight.getNumpyVersion()
    e2(torch.tensor([1])).sum().backward()
    o2.prepare_grads()
    e2(torch.tensor([1, 2])).sum().backward()  # accumulated: merged at the next one
    o2.step()
    expect = np.zeros((6, 2))
    expect[1] = 2.0
    expect[2] = 1.0
    np.testing.assert_allclose(w - e2.weight.getNumpyVersion(), expect, atol=1e-6)


def test_interleaved_table_and_state_move_together_with_gather_many():
    """A cpu table's state is interleaved with it once the optimizer is built; the
    DataGadget stays the same object, views taken before no longer see it, and
    gather_many / scatter_many over the table and its state tables are exact."""
    torch.manual_seed(0)
    e = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu")
    w = e.weight
    early_view = w.as_tensor()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    assert e.weight is w
    w.insertData(torch.full((1, 3), 5.0), [0])
    assert float(early_view[0, 0]) != 5.0 and float(_np(w.getData([0]))[0, 0]) == 5.0
    e(torch.tensor([1, 4, 4, 7])).sum().backward()
    opt.step()
    tables = [w, opt.pagers[0].tables["exp_avg"], opt.pagers[0].tables["exp_avg_sq"]]
    ids = torch.tensor([[7, 1], [4, 4]])
    for g, out in zip(tables, gl.gather_many(tables, ids), strict=True):
        np.testing.assert_array_equal(_np(out), g.getNumpyVersion()[ids.numpy()])
    refs = [g.getNumpyVersion() for g in tables]
    rows = [torch.randn(2, 2, 3) for _ in tables]
    gl.scatter_many(tables, rows, ids)
    for ref, r in zip(refs, rows, strict=True):
        for k, i in enumerate(ids.view(-1).tolist()):  # the last occurrence wins
            ref[i] = r.view(-1, 3)[k].numpy()
    for g, ref in zip(tables, refs, strict=True):
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_optimizer_list_differentiable_and_numpy_options():
    with pytest.raises(gl.GadgetTypeError) as info:
        gl.OffloadedOptimizer(torch.optim.LBFGS, gl.OffloadedEmbedding(5, 2, placement="cpu"))
    for name in gl.SUPPORTED_OPTIMIZERS:
        assert name in str(info.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(
            torch.optim.Adam, gl.OffloadedEmbedding(5, 2, placement="cpu"), differentiable=True
        )
    on = gl.OffloadedOptimizer(
        torch.optim.SGD,
        gl.OffloadedEmbedding(5, 2, placement="cpu"),
        lr=0.1,
        momentum=np.float32(0.9),
    )
    off = gl.OffloadedOptimizer(
        torch.optim.SGD,
        gl.OffloadedEmbedding(5, 2, placement="cpu"),
        lr=0.1,
        momentum=np.float32(0.0),
    )
    assert "momentum_buffer" in on.pagers[0].tables
    assert "momentum_buffer" not in off.pagers[0].tables


class _OneVar(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(4, 3)


def test_switcher_saveTorch_loadTorch_rules(tmp_path):
    m = _OneVar()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    sw = gl.ModelFactory(m.e, 10, 3, placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    osw = gl.OptimizerFactory(opt, 10, 3, m, "e", placement="cpu")
    osw.optInit()
    ids = torch.tensor([1, 5, 5, 9])
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    m.e(local).sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)
    state = osw.getNumpyVersion()
    assert set(state) == {"exp_avg", "exp_avg_sq"} and state["exp_avg"].shape == (10, 3)
    osw.saveTorch(tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert set(saved) == {"exp_avg", "exp_avg_sq"}

    def fresh():
        m2 = _OneVar()
        o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
        s2 = gl.OptimizerFactory(o2, 10, 3, m2, "e", placement="cpu")
        s2.optInit()
        return s2

    exact = fresh()  # a float64 file of float32 values converts exactly
    torch.save({k: v.double() for k, v in saved.items()}, tmp_path / "f64.pt")
    exact.loadTorch(tmp_path / "f64.pt")
    for k in state:
        np.testing.assert_array_equal(exact.getNumpyVersion()[k], state[k])
    inexact = fresh()
    torch.save({k: v.double() + 1e-12 for k, v in saved.items()}, tmp_path / "f64x.pt")
    with pytest.raises(gl.GadgetError):
        inexact.loadTorch(tmp_path / "f64x.pt")
    assert not any(v.any() for v in inexact.getNumpyVersion().values())
    listed = fresh()  # SpeedTorch's list of tensors in state order
    torch.save([saved["exp_avg"], saved["exp_avg_sq"]], tmp_path / "list.pt")
    listed.loadTorch(tmp_path / "list.pt")
    for k in state:
        np.testing.assert_array_equal(listed.getNumpyVersion()[k], state[k])
    with pytest.raises(gl.GadgetError):
        torch.save({k: v[:5] for k, v in saved.items()}, tmp_path / "short.pt")
        fresh().loadTorch(tmp_path / "short.pt")
    sw.saveCupy(str(tmp_path / "emb"))
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), sw.getNumpyVersion())


def test_switcher_datatype_float16_pages_the_variable_as_float16():
    m = _OneVar()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    sw = gl.ModelFactory(m.e, 10, 3, "float16", placement="cpu")
    osw = gl.OptimizerFactory(opt, 10, 3, m, "e", "float16", placement="cpu")
    sw.uniformDistributionInit(-1, 1)
    osw.optInit()
    ids = torch.tensor([1, 5])
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    assert m.e.weight.dtype == torch.float16
    m.e(local).float().sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    osw.afterOptimizerStep(ids)
    assert sw.getNumpyVersion().dtype == np.float16
    assert {v.dtype for v in osw.getNumpyVersion().values()} == {np.dtype(np.float16)}


# ---------------------------------------------------------------------------------------
# word2vec example script
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    royal = ["king", "queen", "prince", "princess", "crown", "throne", "castle", "royal"]
    food = ["apple", "banana", "bread", "cheese", "milk", "butter", "soup", "salad"]
    lines = []
    for i in range(600):
        words = [str(w) for w in rng.choice(royal if i % 2 else food, size=8)]
        lines.append(" ".join(words).capitalize() if i % 3 == 0 else " ".join(words))
    path = tmp_path_factory.mktemp("w2v") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_word2vec_readme_command(small_corpus, tmp_path, capsys):
    from datasets import word2vec

    out = tmp_path / "vectors"
    code = word2vec.main(
        [str(small_corpus), "--dim", "16", "--epochs", "1", "--out", str(out)]
        + ["--show", "King,zzzunknown", "--no-progress"]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "king:" in text  # lower-cased like the corpus
    assert "zzzunknown: not in the vocabulary" in text
    vec = np.load(f"{out}.npy")
    vocab = Path(f"{out}.vocab.txt").read_text().split("\n")
    words = [line.split()[0] for line in vocab if line.strip()]
    assert vec.shape == (len(words), 16) and len(words) == 16
    assert "king" in words and "King" not in words


@pytest.mark.parametrize(
    "case",
    [
        "missing corpus",
        "out names a folder",
        "out folder missing",
        "lr inf",
        "seed negative",
        "one word",
    ],
)
def test_word2vec_bad_input_is_a_one_line_error_before_training(small_corpus, tmp_path, case):
    from datasets import word2vec

    argv = [str(small_corpus), "--dim", "8", "--no-progress"]
    if case == "missing corpus":
        argv[0] = str(tmp_path / "nope.txt")
    elif case == "out names a folder":
        (tmp_path / "folder").mkdir()
        argv += ["--out", str(tmp_path / "folder")]
    elif case == "out folder missing":
        argv += ["--out", str(tmp_path / "missing" / "v")]
    elif case == "lr inf":
        argv += ["--lr", "inf"]
    elif case == "seed negative":
        argv += ["--seed", "-1"]
    else:
        (tmp_path / "one.txt").write_text("word word word\n")
        argv[0] = str(tmp_path / "one.txt")
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = word2vec.main(argv)
        except SystemExit as exc:
            code = exc.code
    assert code not in (0, None)
    lines = [
        line
        for line in err.getvalue().splitlines()
        if "Warning" not in line and "resolve_placement" not in line
    ]
    assert len(lines) == 1 and "error" in lines[0], err.getvalue()
    assert "vocabulary" not in out.getvalue()  # no training ran


# ---------------------------------------------------------------------------------------
# Defects: behaviour that contradicts the README's error list
# ---------------------------------------------------------------------------------------


# DEFECT: README "Errors": GadgetTypeError is for dtypes (GadgetValueError for shapes,
# out-of-range values), and DataGadget(path, dtype=...) does raise GadgetTypeError for a
# file of another dtype; but loading a file of another dtype into a table that must keep
# its dtype (an OffloadedEmbedding's, `emb.weight.load` "keeps the table's shape and
# dtype") raises GadgetValueError, which is not a TypeError.
def test_loading_a_file_of_another_dtype_into_an_embedding_table_is_a_type_error(tmp_path):
    e = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu")
    before = e.weight.getNumpyVersion()
    np.save(tmp_path / "f64.npy", np.zeros((10, 3), np.float64))
    with pytest.raises(gl.GadgetError) as info:
        e.weight.load(tmp_path / "f64.npy")
    np.testing.assert_array_equal(e.weight.getNumpyVersion(), before)
    assert isinstance(info.value, gl.GadgetTypeError), repr(info.value)


# DEFECT: README "Errors": GadgetTypeError covers "arguments of the wrong kind"; a
# checkpoint object name that is not a string at all (an int) raises GadgetValueError.
def test_a_non_string_checkpoint_name_is_a_type_error(tmp_path):
    m, _ = _ckpt_model(0)
    with pytest.raises(gl.GadgetError) as info:
        gl.save_checkpoint(tmp_path / "ck", {5: m})
    assert not (tmp_path / "ck").exists()
    assert isinstance(info.value, gl.GadgetTypeError), repr(info.value)


# DEFECT: misleading message. An HDF5 file (or zarr group) that holds no dataset at all
# says "holds no datasets; pass dataset= to choose one": there is nothing to choose, and
# passing any dataset= only fails again.
@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_an_empty_file_does_not_ask_to_choose_a_dataset(tmp_path, fmt):
    if fmt == "hdf5":
        p = tmp_path / "empty.h5"
        with h5py.File(p, "w") as f:
            f.create_group("g")
    else:
        p = tmp_path / "empty.zarr"
        zarr.open_group(str(p), mode="w")
    with pytest.raises(gl.GadgetError) as info:
        gl.DataGadget(p)
    assert p.name in str(info.value)
    assert "choose one" not in str(info.value), str(info.value)


# DEFECT: README "Errors": "Every error derives from gl.GadgetError and the matching
# builtin", GadgetTypeError covering "arguments of the wrong kind"; a path argument that
# is not a path (None, an int) to save / load / saveCupy / loadCupy / save_checkpoint /
# load_checkpoint / saveTorch, or a non-callable to init_ / customInit, escapes as a
# plain TypeError ("expected str, bytes or os.PathLike object, not NoneType" / "'int'
# object is not callable") that `except gl.GadgetError` does not catch.
@pytest.mark.parametrize(
    "call",
    [
        "save",
        "load",
        "saveCupy",
        "loadCupy",
        "save_checkpoint",
        "load_checkpoint",
        "saveTorch",
        "init_",
        "customInit",
    ],
)
def test_arguments_of_the_wrong_kind_are_gadget_type_errors(call):
    g = gl.DataGadget(np.zeros((3, 2), np.float32), placement="cpu")
    sw = gl.ModelFactory(torch.nn.Embedding(2, 2), 5, 2, placement="cpu")
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(5, 2, placement="cpu")})
    calls = {
        "save": lambda: g.save(None),
        "load": lambda: g.load(None),
        "saveCupy": lambda: g.saveCupy(None),
        "loadCupy": lambda: g.loadCupy(None),
        "save_checkpoint": lambda: gl.save_checkpoint(None, {"m": m}),
        "load_checkpoint": lambda: gl.load_checkpoint(None, {"m": m}),
        "saveTorch": lambda: sw.saveTorch(None),
        "init_": lambda: g.init_(5),
        "customInit": lambda: sw.customInit(5),
    }
    with pytest.raises(TypeError) as info:
        calls[call]()
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((3, 2), np.float32))
    assert isinstance(info.value, gl.GadgetTypeError), repr(info.value)


# DEFECT: README (Files): "once ... a .npy or an uncompressed HDF5 file (read through a
# memory map) shrinks in place (truncated, or a smaller file copied over it), the table's
# reads and writes raise GadgetFileError". For an uncompressed HDF5 `file` table that
# has not gathered yet, a shrink goes unnoticed: getData of a row past the new end
# returns zeros (wrong numbers, no error); the same table after one earlier getData does
# raise GadgetFileError ("shrank to N bytes since this table mapped its rows"). A
# writable table's insertData after a smaller copy escapes as h5py's plain TypeError
# ("Can't broadcast (100, 4) -> (10, 4)").
@pytest.mark.parametrize("how", ["truncated", "smaller copy"])
@pytest.mark.parametrize("writable", [False, None])
def test_an_uncompressed_hdf5_file_that_shrinks_before_the_first_read_is_an_error(
    tmp_path, how, writable
):
    a = np.arange(400, dtype=np.float32).reshape(100, 4) + 1
    big, small = tmp_path / "big.h5", tmp_path / "small.h5"
    gl.DataGadget(a, placement="cpu").save(big)
    gl.DataGadget(a[:10], placement="cpu").save(small)
    g = gl.DataGadget(big, placement="file", writable=writable)
    inode = os.stat(big).st_ino
    if how == "truncated":
        os.truncate(big, os.path.getsize(big) // 2)
    else:
        shutil.copyfile(small, big)  # in place: the same file, now smaller
    assert os.stat(big).st_ino == inode
    with pytest.raises(gl.GadgetFileError):
        g.getData([95])
    if writable is None:
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.zeros(1, 4), [95])
