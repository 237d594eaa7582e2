"""Session 33 review: the README read top to bottom as a new user would.

Every Python block of README.md that runs on a CPU-only machine is run here (smaller sizes,
tmp_path for files), and the concrete claims of the prose around it (defaults, parameters,
errors and their types, file contents, CLI options, output and exit codes) are checked
against behaviour.  Black-box: only README.md, SPEC.md and the public docstrings were read.

The command-line checks run as subprocesses (CUDA hidden) in one module-scoped pool, a few
at a time, so the whole file stays fast.
"""

from __future__ import annotations

import concurrent.futures
import copy
import gc
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as nnf
from torch.utils.data import ConcatDataset, DataLoader, Subset

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


class _Quiet:
    """A block that may fall back to the CPU (the warning is given once a process)."""

    def __enter__(self):
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("ignore", gl.FallbackWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def _np(g):
    return np.array(g.getNumpyVersion(), copy=True)


def _cpu(t):
    return t.detach().cpu()


# ----------------------------------------------------------------------------------------
# Subprocess pool: every CLI / fresh-process check of the README, run a few at a time.
# ----------------------------------------------------------------------------------------

_FALLBACK_TABLE_FIRST = textwrap.dedent(
    """
    import json, warnings, numpy as np, torch, gadgetloader as gl
    out = {}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = gl.GadgetDataset(np.zeros((8, 3), np.float32), np.arange(8))
        x, = ds[[0, 1]][:1]
        e = gl.OffloadedEmbedding(10, 4)
        b = gl.OffloadedEmbeddingBag(10, 4)
        sw = gl.ModelSwitch(torch.nn.Embedding(5, 4), 10, 4)
        out["silent"] = [str(m.message) for m in w]
        out["ds_device"] = str(x.device)
        out["emb_placement"] = e.weight.placement
        out["bag_placement"] = b.weight.placement
        out["switch_repr"] = repr(sw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = gl.DataGadget((3, 2))                       # default: cuda (CPUPinn=False)
        out["default_placement"] = g.placement
        g2 = gl.DataGadget((3, 2), CPUPinn=True)         # pinned
        out["pinn_placement"] = g2.placement
        r = g.getData([0], device="cuda")
        out["rows_device"] = str(r.device)
        e2 = gl.OffloadedEmbedding(10, 4, placement="cuda")
        out["emb_cuda_placement"] = e2.weight.placement
        out["warnings"] = [(m.category.__name__, str(m.message)) for m in w]
    print(json.dumps(out))
    """
)

_FALLBACK_ROWS_FIRST_NO_DEPS = textwrap.dedent(
    """
    import sys, json, warnings
    for m in ("h5py", "zarr", "cupy"):
        sys.modules[m] = None                # as if not installed
    import numpy as np, torch, gadgetloader as gl
    out = {"imported": sorted(k for k in sys.modules
                              if k.split(".")[0] in ("h5py", "zarr", "cupy") and sys.modules[k] is not None)}
    g = gl.DataGadget(np.zeros((3, 2), np.float32), placement="cpu")
    errs = {}
    for p in (sys.argv[1] + "/x.h5", sys.argv[1] + "/x.zarr"):
        try:
            g.save(p)
            errs[p] = None
        except Exception as e:
            errs[p] = [type(e).__name__, isinstance(e, ImportError), isinstance(e, gl.GadgetError), str(e)]
    out["save_errors"] = errs
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        r = g.getData([0, 1], device="cuda")
        out["rows_device"] = str(r.device)
        g2 = gl.DataGadget((3, 2), placement="pinned")
        out["pinned_placement"] = g2.placement
        r2 = g2.getData([0], device="cuda")
        out["warnings"] = [(m.category.__name__, str(m.message)) for m in w]
    print(json.dumps(out))
    """
)


def _make_cli_inputs(d: Path) -> None:
    np.save(d / "emb.npy", np.arange(30, dtype=np.float32).reshape(10, 3))
    with h5py.File(d / "data.h5", "w") as f:
        f.create_dataset("emb/words", data=np.arange(40, dtype=np.float32).reshape(20, 2))
        f.create_dataset("other", data=np.zeros((5, 2), np.float32))
    np.save(d / "counts.npy", np.array([[1], [2**32 - 1]], dtype=np.uint32))
    os.symlink("emb.npy", d / "embl.npy")
    os.mkdir(d / "bf")
    # word2vec corpus: a few related words, plus a word with a byte that is not UTF-8
    rng = np.random.default_rng(0)
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
        "castle",
    ]
    lines = [" ".join(rng.choice(words, 12)) for _ in range(200)]
    data = ("\n".join(lines) + "\n").encode() + b"caf\xff king queen\n" * 10
    (d / "corpus.txt").write_bytes(data)
    (d / "one.txt").write_text("hello hello hello\n")
    os.mkdir(d / "outdir")


# Runs several CLI invocations in one process (one torch import), exactly as
# `python -m MODULE ARGS...` runs them: runpy with run_name="__main__", sys.argv set,
# stdout / stderr captured, the exit status taken from SystemExit.
_RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys, time
    jobs = json.loads(sys.argv[1])
    results = {}
    for name, module, argv in jobs:
        out, err = io.StringIO(), io.StringIO()
        sys.argv = [module] + argv
        t0 = time.perf_counter()
        rc = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException as e:
                import traceback
                traceback.print_exc()
                rc = -999
        results[name] = [rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0]
    sys.stdout = sys.__stdout__
    print("RESULTS" + json.dumps(results))
    """
)


def _batches(d: Path):
    s = str
    G, W = "gadgetloader", "datasets.word2vec"
    cli_batch = [
        [
            "bench_seed",
            G,
            [
                "bench",
                "--rows",
                "2000",
                "--ids",
                "5000",
                "--repeats",
                "1",
                "--json",
                s(d / "seed.json"),
            ],
        ],
        [
            "bench_files",
            G,
            [
                "bench",
                "files",
                "--mb",
                "1",
                "--random-mb",
                "1",
                "--ids",
                "64",
                "--repeats",
                "1",
                "--dir",
                s(d / "bf"),
                "--json",
                s(d / "files.json"),
            ],
        ],
        [
            "convert_h5",
            G,
            ["convert", "emb.npy", "emb.h5", "--chunk-rows", "4096", "--compression", "gzip"],
        ],
        ["convert_zarr", G, ["convert", "data.h5", "emb.zarr", "--dataset", "emb/words"]],
        ["convert_self_link", G, ["convert", "emb.npy", "embl.npy"]],
        ["convert_npy_compression", G, ["convert", "emb.npy", "x1.npy", "--compression", "gzip"]],
        ["convert_npy_src_dataset", G, ["convert", "emb.npy", "x2.h5", "--dataset", "foo"]],
        ["convert_missing", G, ["convert", "missing.npy", "x3.h5"]],
        ["convert_uint32", G, ["convert", "counts.npy", "x4.h5"]],
        ["sweep_bad_sizes", G, ["bench", "sweep", "--sizes-gb", "-1"]],
        ["pipeline_width", G, ["bench", "pipeline", "--width", "2"]],
        ["files_bad_json", G, ["bench", "files", "--json", s(d / "nodir" / "f.json")]],
    ]
    w2v_batch = [
        # first in its process: the FallbackWarning is given once a process
        [
            "w2v_diverge_cuda",
            W,
            [
                s(d / "corpus.txt"),
                "--dim",
                "8",
                "--epochs",
                "1",
                "--lr",
                "1e29",
                "--device",
                "cuda",
                "--out",
                s(d / "diverged"),
                "--no-progress",
            ],
        ],
        [
            "w2v_readme",
            W,
            [
                s(d / "corpus.txt"),
                "--dim",
                "16",
                "--epochs",
                "1",
                "--out",
                s(d / "vectors"),
                "--show",
                "King,Nosuchword",
                "--no-progress",
            ],
        ],
        ["w2v_missing", W, [s(d / "missing.txt")]],
        ["w2v_lr_inf", W, [s(d / "corpus.txt"), "--lr", "inf"]],
        ["w2v_one_word", W, [s(d / "one.txt"), "--no-progress"]],
        ["w2v_out_folder", W, [s(d / "corpus.txt"), "--out", s(d / "outdir"), "--no-progress"]],
        ["info", G, ["info", "--no-measure", "--json", s(d / "info.json")]],
    ]
    return [cli_batch, w2v_batch]


def _jobs(d: Path) -> dict[str, tuple[list[str], Path]]:
    """Processes of their own: the real entry point, and the fresh-process checks."""
    gl_ = [sys.executable, "-m", "gadgetloader"]
    py = [sys.executable, "-c"]
    return {
        "help": (gl_ + ["--help"], d),
        "sweep_unknown_option": (gl_ + ["bench", "sweep", "--sizez-gb", "4"], d),
        "fallback_table": (py + [_FALLBACK_TABLE_FIRST], d),
        "fallback_rows_nodeps": (py + [_FALLBACK_ROWS_FIRST_NO_DEPS, str(d)], d),
    }


def _env():
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PYTHONWARNINGS", None)
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + pp if pp else "")
    return env


def _run_one(argv, cwd):
    t0 = time.perf_counter()
    p = subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, errors="replace", timeout=300
    )
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0


def _run_batch(batch, cwd):
    rc, out, err, _ = _run_one([sys.executable, "-c", _RUNNER, json.dumps(batch)], cwd)
    marker = out.rfind("RESULTS")
    assert rc == 0 and marker >= 0, f"runner failed (rc {rc}):\n{err[-3000:]}"
    return {k: tuple(v) for k, v in json.loads(out[marker + len("RESULTS") :]).items()}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme_cli")
    _make_cli_inputs(d)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as ex:
        futs = [ex.submit(_run_batch, b, d) for b in _batches(d)]
        single = {name: ex.submit(_run_one, argv, cwd) for name, (argv, cwd) in _jobs(d).items()}
        for f in futs:
            results.update(f.result())
        for name, f in single.items():
            results[name] = f.result()
    return d, results


def _one_line_error(stderr: str) -> None:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    assert lines, "no error message"
    assert "error" in lines[-1].lower(), stderr


# ---------------------------------------------------------------------------- install / CLI


def test_cli_help_lists_the_three_commands(cli):
    _, r = cli
    rc, out, err, _ = r["help"]
    assert rc == 0, err
    for cmd in ("info", "bench", "convert"):
        assert cmd in out


def test_fallback_without_cuda_warns_once_and_defaults_are_silent(cli):
    """README: a table or drop-in module asked for a GPU placement by name, or a call asked
    for device="cuda" rows, falls back to the CPU with a FallbackWarning, given once per
    process; GadgetDataset and the modules' default placement pick cpu silently."""
    _, r = cli
    rc, out, err, _ = r["fallback_table"]
    assert rc == 0, err
    o = json.loads(out.strip().splitlines()[-1])
    assert o["silent"] == []
    assert o["ds_device"] == "cpu"
    assert o["emb_placement"] == "cpu" and o["bag_placement"] == "cpu"
    assert "placement='cpu'" in o["switch_repr"]
    assert o["default_placement"] == "cpu" and o["pinn_placement"] == "cpu"
    assert o["rows_device"] == "cpu" and o["emb_cuda_placement"] == "cpu"
    ws = o["warnings"]
    assert len(ws) == 1, ws
    assert ws[0][0] == "FallbackWarning"


def test_fallback_rows_first_and_import_without_optional_deps(cli):
    """README: `import gadgetloader` needs only numpy, torch and tqdm; MissingDependencyError
    names the pip extra; the first fallback (here a device="cuda" call) warns, once."""
    _, r = cli
    rc, out, err, _ = r["fallback_rows_nodeps"]
    assert rc == 0, err
    o = json.loads(out.strip().splitlines()[-1])
    assert o["imported"] == []
    for path, e in o["save_errors"].items():
        assert e is not None, f"save to {path} without its library did not raise"
        name, is_import, is_gadget, msg = e
        assert name == "MissingDependencyError" and is_import and is_gadget
        extra = "hdf5" if path.endswith(".h5") else "zarr"
        assert f"gadgetloader[{extra}]" in msg or f".[{extra}]" in msg, msg
    assert o["rows_device"] == "cpu" and o["pinned_placement"] == "cpu"
    assert [w[0] for w in o["warnings"]] == ["FallbackWarning"], o["warnings"]


def test_bench_on_cpu_times_cpu_methods_and_lists_skipped(cli):
    """README: without CUDA `gadgetloader bench` times the CPU methods and lists what it
    skipped; columns `of limit`, `x naive`, `check`; --ids above --rows is capped and the
    report gives the count used."""
    d, r = cli
    rc, out, err, _ = r["bench_seed"]
    assert rc == 0, err
    assert "skipped" in out.lower()
    for col in ("of limit", "x naive", "check"):
        assert col in out
    res = json.loads((d / "seed.json").read_text())
    assert res["ids"] == 2000
    assert res["skipped"]
    kinds = {x["kind"] for x in res["results"]}
    assert kinds == {"gather", "scatter"}
    assert all(x["check"] == "ok" for x in res["results"])


def test_bench_files_small_run_checks_and_cleans_temp_files(cli):
    """README: bench files measures load rates and random getData against h5py fancy
    indexing, zarr oindex and np.load(mmap_mode='r')[ids]; --keep keeps the files (so
    without it they are removed)."""
    d, r = cli
    rc, out, err, _ = r["bench_files"]
    assert rc == 0, err
    assert "np.load(mmap_mode='r')[ids]" in out
    assert "oindex" in out and "h5py" in out
    assert json.loads((d / "files.json").read_text())
    assert list((d / "bf").iterdir()) == []


def test_info_no_measure_json(cli):
    d, r = cli
    rc, out, err, _ = r["info"]
    assert rc == 0, err
    assert "torch" in out and "gadgetloader" in out
    info = json.loads((d / "info.json").read_text())
    assert isinstance(info, dict) and info


def test_convert_readme_commands(cli):
    """README: `gadgetloader convert emb.npy emb.h5 --chunk-rows 4096 --compression gzip` and
    `gadgetloader convert data.h5 emb.zarr --dataset emb/words` exit 0 with the same rows."""
    d, r = cli
    rc, out, err, _ = r["convert_h5"]
    assert rc == 0, err
    src = np.load(d / "emb.npy")
    with h5py.File(d / "emb.h5", "r") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert len(names) == 1
        ds = f[names[0]]
        assert ds.compression == "gzip"
        np.testing.assert_array_equal(ds[...], src)
    rc, out, err, _ = r["convert_zarr"]
    assert rc == 0, err
    with h5py.File(d / "data.h5", "r") as f:
        want = f["emb/words"][...]
    g = gl.DataGadget(str(d / "emb.zarr"), placement="cpu")
    np.testing.assert_array_equal(_np(g), want)


def test_convert_refuses_its_source_through_a_symlink(cli):
    d, r = cli
    rc, out, err, _ = r["convert_self_link"]
    assert rc != 0
    _one_line_error(err)
    np.testing.assert_array_equal(
        np.load(d / "emb.npy"), np.arange(30, dtype=np.float32).reshape(10, 3)
    )
    assert os.path.islink(d / "embl.npy")


@pytest.mark.parametrize(
    "job",
    ["convert_npy_compression", "convert_npy_src_dataset", "sweep_bad_sizes", "pipeline_width"],
)
def test_cli_bad_argument_exits_2_with_usage_and_command_line(cli, job):
    """README: exit 2 for a bad argument (argparse's usage, then a line naming the command,
    such as "bench sweep: error: --sizes-gb values must be ..."), also for values checked
    after parsing: a pipeline --width below 3, --compression for a .npy destination,
    --dataset for a .npy source."""
    _, r = cli
    rc, out, err, _ = r[job]
    assert rc == 2, (rc, err)
    assert "usage:" in err
    last = err.strip().splitlines()[-1]
    cmd = {
        "convert_npy_compression": "convert",
        "convert_npy_src_dataset": "convert",
        "sweep_bad_sizes": "bench sweep",
        "pipeline_width": "bench pipeline",
    }[job]
    assert f"{cmd}: error:" in last, last
    if job == "sweep_bad_sizes":
        assert "--sizes-gb values must be" in last


def test_cli_unknown_option_of_a_subcommand_names_the_command(cli):
    """README: 'Every gadgetloader command exits ... 2 for a bad argument (argparse's usage,
    then a line naming the command, such as "bench sweep: error: ...")'.  A mistyped
    option of `bench sweep` should get sweep's usage and a `bench sweep: error:` line."""
    _, r = cli
    rc, out, err, _ = r["sweep_unknown_option"]
    assert rc == 2, (rc, err)
    last = err.strip().splitlines()[-1]
    assert "bench sweep: error:" in last, err
    assert "--sizes-gb" in err, "the usage shown is not sweep's: " + err


@pytest.mark.parametrize("job", ["convert_missing", "convert_uint32"])
def test_cli_other_errors_exit_1_with_one_line(cli, job):
    """README: 1 for other errors (one line: a file that cannot be read ..., a dtype no table
    holds)."""
    d, r = cli
    rc, out, err, _ = r[job]
    assert rc == 1, (rc, err)
    assert len(err.strip().splitlines()) == 1, err
    _one_line_error(err)
    assert not (d / "x3.h5").exists() and not (d / "x4.h5").exists()


def test_bench_json_path_checked_before_the_run(cli):
    """README: `--json` paths are checked before the run."""
    d, r = cli
    rc, out, err, elapsed = r["files_bad_json"]
    assert rc != 0
    _one_line_error(err)
    assert "nodir" in err
    assert "MB/s" not in out and "GB/s" not in out  # nothing was measured


# ---------------------------------------------------------------------------- word2vec CLI


def test_word2vec_readme_command(cli):
    """README: `python -m datasets.word2vec corpus.txt --dim 128 --epochs 1 --out vectors
    --show king` (smaller); --show takes comma-separated words, lower-cased like the corpus,
    unknown ones reported; the corpus is read as UTF-8 (undecodable bytes become U+FFFD)."""
    d, r = cli
    rc, out, err, _ = r["w2v_readme"]
    assert rc == 0, err
    assert "Traceback" not in err
    vec = np.load(d / "vectors.npy")
    vocab = (d / "vectors.vocab.txt").read_text(encoding="utf-8").split("\n")
    vocab = [ln.split()[0] for ln in vocab if ln.strip()]
    assert vec.shape == (len(vocab), 16)
    assert np.isfinite(vec).all()
    assert "king" in vocab
    assert "caf\ufffd" in vocab
    low = out.lower()
    assert "king:" in low  # 'King' lower-cased like the corpus
    assert "nosuchword" in low  # unknown word reported


@pytest.mark.parametrize("job", ["w2v_missing", "w2v_lr_inf", "w2v_one_word", "w2v_out_folder"])
def test_word2vec_errors_are_one_line_before_training(cli, job):
    """README: a missing corpus, an `--out` that names a folder, bad numbers (an infinite
    --lr) or a corpus with fewer than two distinct words are one-line errors before any
    training (exit status 2 for bad arguments, 1 for the rest)."""
    d, r = cli
    rc, out, err, _ = r[job]
    assert rc in (1, 2), (rc, err)
    _one_line_error(err)
    if job == "w2v_lr_inf":
        assert rc == 2
    assert "loss per epoch" not in out
    assert list((d / "outdir").iterdir()) == []


def test_word2vec_diverging_run_writes_nothing_and_cuda_falls_back(cli):
    """README: training that diverges (e.g. a huge --lr) stops with a one-line error and
    writes nothing; a CUDA --device without CUDA falls back to the CPU with a FallbackWarning."""
    d, r = cli
    rc, out, err, _ = r["w2v_diverge_cuda"]
    assert rc == 1, (rc, err)
    assert "FallbackWarning" in err
    assert "Traceback" not in err
    assert "error" in err.strip().splitlines()[-1].lower()
    assert not (d / "diverged.npy").exists()
    assert not (d / "diverged.vocab.txt").exists()


# ---------------------------------------------------------------------------- rows in and out


def test_readme_rows_in_and_out_block(tmp_path):
    """The "Rows in and out" block, with a small table."""
    path = tmp_path / "embeddings.npy"
    start = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
    np.save(path, start)
    with _Quiet():
        table = gl.DataGadget(str(path), CPUPinn=True)
    ids = torch.randint(0, len(table), (4096,))
    rows = table.getData(ids)
    assert rows.shape == (4096, 8) and rows.dtype == torch.float32
    np.testing.assert_array_equal(_cpu(rows).numpy(), start[ids.numpy()])
    table.insertData(rows * 0.5, ids)
    table.saveCupy(str(path))
    back = np.load(path)
    touched = np.unique(ids.numpy())
    np.testing.assert_array_equal(back[touched], start[touched] * np.float32(0.5))
    untouched = np.setdiff1d(np.arange(300), touched)
    np.testing.assert_array_equal(back[untouched], start[untouched])
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


@pytest.mark.parametrize("flag", ["CPUPinn", "progress", "check_ids", "copy"])
def test_bool_flags_take_true_false_or_1_0_and_refuse_strings(tmp_path, flag):
    """README: CPUPinn, the factories' pinType, progress, check_ids= and getNumpyVersion's
    copy= are True/False or 1/0, and a string such as "False" is a GadgetTypeError."""
    np.save(tmp_path / "t.npy", np.zeros((4, 2), np.float32))
    g = gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu")
    calls = {
        "CPUPinn": lambda v: gl.DataGadget((4, 2), CPUPinn=v, placement="cpu"),
        "progress": lambda v: gl.DataGadget(str(tmp_path / "t.npy"), placement="cpu", progress=v),
        "check_ids": lambda v: g.getData([1], check_ids=v),
        "copy": lambda v: g.getNumpyVersion(copy=v),
    }
    for ok in (True, False, 1, 0):
        calls[flag](ok)
    with pytest.raises(gl.GadgetTypeError, match="False"):
        calls[flag]("False")


def test_pytorch_factory_pintype_refuses_string():
    with pytest.raises(gl.GadgetTypeError):
        gl.PytorchModelFactory(nn.Embedding(3, 2), 6, 2, deviceType="cpu", pinType="False")


def test_tuple_shape_makes_a_zero_table_and_dtype_is_torch_dtype():
    g = gl.DataGadget((5, 3), dtype="int16", placement="cpu")
    assert g.shape == (5, 3) and tuple(g.shape) == (5, 3)
    assert g.dtype == torch.int16 and isinstance(g.dtype, torch.dtype)
    assert len(g) == 5 and g.nbytes == 5 * 3 * 2 and g.placement == "cpu"
    assert (_np(g) == 0).all()


@pytest.mark.parametrize(
    "name, want",
    [
        ("float", torch.float32),
        ("int", torch.int32),
        ("byte", torch.uint8),
        ("char", torch.int8),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        ("float32", torch.float32),
        (np.float16, torch.float16),
        (np.dtype("int64"), torch.int64),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_names(name, want):
    """README: where torch and NumPy name a dtype differently torch wins ("float" is float32,
    "int" int32, "byte" uint8, "char" int8), Python's types mean float64, int64 and bool."""
    assert gl.DataGadget((2, 2), dtype=name, placement="cpu").dtype == want


def test_data_is_copied_in_and_detached():
    src = np.ones((3, 2), np.float32)
    g = gl.DataGadget(src, placement="cpu")
    src[:] = 7
    assert (_np(g) == 1).all()
    t = torch.ones(3, 2, requires_grad=True)
    gt = gl.DataGadget(t, placement="cpu")
    assert not gt.as_tensor().requires_grad
    with torch.no_grad():
        t.mul_(5)
    assert (_np(gt) == 1).all()


def test_insert_wrong_dtype_is_an_error_that_says_so_not_a_cast():
    g = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.insertData(np.ones((2, 3)), [0, 1])
    assert "float32" in str(ei.value) and "float64" in str(ei.value)
    with pytest.raises(TypeError):
        g.insertData(torch.ones(2, 3, dtype=torch.float64), [0, 1])
    assert (_np(g) == 0).all()


def test_numpy_style_tuple_indexes():
    """README: g.getData((slice(0, 6), slice(0, 3))) is table[0:6, 0:3]; insertData with such
    an index writes only that part; g[[1, 2], 0]; a tuple of plain ints stays a list of ids;
    a tuple of id lists is refused; g[([1, 2],)] is g[[1, 2]]; negative ints into the row."""
    a = np.arange(60, dtype=np.float32).reshape(10, 6)
    g = gl.DataGadget(a, placement="cpu")
    np.testing.assert_array_equal(_cpu(g.getData((slice(0, 6), slice(0, 3)))).numpy(), a[0:6, 0:3])
    np.testing.assert_array_equal(_cpu(g[[1, 2], 0]).numpy(), a[[1, 2], 0])
    np.testing.assert_array_equal(_cpu(g[(1, 2)]).numpy(), a[[1, 2]])
    np.testing.assert_array_equal(_cpu(g[([1, 2],)]).numpy(), a[[1, 2]])
    np.testing.assert_array_equal(_cpu(g[[1, 2], -1]).numpy(), a[[1, 2], -1])
    np.testing.assert_array_equal(_cpu(g[2:5]).numpy(), a[2:5])
    np.testing.assert_array_equal(_cpu(g[[4, 7], 0:3]).numpy(), a[[4, 7], 0:3])
    # slices into the row clip as Python clips them
    np.testing.assert_array_equal(_cpu(g[[1, 2], 0:100]).numpy(), a[[1, 2], 0:100])
    np.testing.assert_array_equal(_cpu(g[[1], -100:2]).numpy(), a[[1], -100:2])
    with pytest.raises(gl.GadgetTypeError):
        g[([1, 2], [0, 1])]
    with pytest.raises(gl.GadgetIndexError):
        g[[-1, 2], 0]  # ids of rows may not be negative
    with pytest.raises(gl.GadgetError):
        g[[1, 2], ::-1]  # a positive step only
    with pytest.raises(gl.GadgetTypeError):
        g[[1, 2], 0.0:3]  # integer bounds
    # partial write
    g.insertData(torch.full((6, 3), -1.0), (slice(0, 6), slice(0, 3)))
    want = a.copy()
    want[0:6, 0:3] = -1
    np.testing.assert_array_equal(_np(g), want)


@pytest.mark.parametrize("index", [Ellipsis, None, (Ellipsis, 0), ([1, 2], None)])
def test_ellipsis_and_none_are_not_indexes(index):
    g = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g[index]


def test_written_rows_are_not_broadcast():
    g = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(1.0, [1])
    with pytest.raises(gl.GadgetValueError):
        g.insertData(torch.ones(3), [1, 2])
    with pytest.raises(gl.GadgetTypeError):  # a list is read as NumPy reads it: float64
        g.insertData([[1.0, 2.0, 3.0]], [1])
    assert (_np(g) == 0).all()
    g64 = gl.DataGadget(np.zeros((4, 2)), placement="cpu")
    g64.insertData([[1.0, 2.0]], [1])
    g64[[2]] = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    np.testing.assert_array_equal(_np(g64)[1:3], [[1, 2], [3, 4]])


def test_numpy_views_and_copies():
    """README: getNumpyVersion(copy=False) views a host-resident table; np.asarray(g) is a
    copy; np.asarray(g, copy=False) views a host-resident table or raises GadgetValueError."""
    g = gl.DataGadget(np.arange(12, dtype=np.float32).reshape(4, 3), placement="cpu")
    c = g.getNumpyVersion()
    c[0, 0] = 99
    assert float(g[0][0]) == 0
    v = g.getNumpyVersion(copy=False)
    v[0, 1] = 55
    assert float(g[0][1]) == 55
    a = np.asarray(g)
    a[0, 2] = 77
    assert float(g[0][2]) == 2
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        w = np.asarray(g, copy=False)
        assert np.shares_memory(w, g.getNumpyVersion(copy=False))
        gb = gl.DataGadget(torch.ones(3, 2).to(torch.bfloat16), placement="cpu")
        with pytest.raises(gl.GadgetValueError):
            np.asarray(gb, copy=False)
        assert gb.getNumpyVersion(copy=False).dtype == np.float32


def test_as_tensor_view_and_load_gives_new_storage(tmp_path):
    g = gl.DataGadget(np.zeros((4, 3), np.float32), placement="cpu")
    t = g.as_tensor()
    t[1, 1] = 5
    assert float(g[1][1]) == 5
    np.save(tmp_path / "n.npy", np.full((2, 3), 9, np.float32))
    g.load(str(tmp_path / "n.npy"))
    assert g.shape == (2, 3)
    assert float(t[1, 1]) == 5  # the older view keeps the old rows
    assert (_np(g) == 9).all()


def test_fill_rules():
    """README: fill_(value): an integer in range (an integral float such as 3.0 too),
    True/False/0/1 (or 1.0) for bool, floats within the finite range, inf or nan; else an
    error (and the table unchanged)."""
    gi = gl.DataGadget((3, 2), dtype="int32", placement="cpu")
    gi.fill_(3.0)
    assert (_np(gi) == 3).all()
    gi.fill_(np.array([7]))
    assert (_np(gi) == 7).all()
    gi.fill_(torch.tensor(8))
    assert (_np(gi) == 8).all()
    for bad in (3.5, 2**31):
        with pytest.raises(gl.GadgetError):
            gi.fill_(bad)
    assert (_np(gi) == 8).all()
    gb = gl.DataGadget((3, 2), dtype=bool, placement="cpu")
    for v in (True, 1, 1.0):
        gb.fill_(v)
        assert _np(gb).all()
    gb.fill_(0)
    assert not _np(gb).any()
    for bad in (2, 0.5):
        with pytest.raises(gl.GadgetError):
            gb.fill_(bad)
    assert not _np(gb).any()
    gf = gl.DataGadget((3, 2), dtype="float32", placement="cpu")
    gf.fill_(float("inf"))
    assert np.isinf(_np(gf)).all()
    gf.fill_(float("nan"))
    assert np.isnan(_np(gf)).all()
    gf.zero_()
    for bad in (1e39, -1e39):
        with pytest.raises(gl.GadgetValueError):
            gf.fill_(bad)
    assert (_np(gf) == 0).all()


def test_uniform_and_normal_argument_checks():
    gf = gl.DataGadget((50, 2), dtype="float32", placement="cpu")
    gf.uniform_(-0.5, 0.5)
    v = _np(gf)
    assert (v >= -0.5).all() and (v <= 0.5).all() and v.std() > 0
    gf.normal_(torch.tensor(0.0), torch.tensor(1.0))
    assert _np(gf).std() > 0.3
    snapshot = _np(gf)
    for call in (
        lambda: gf.uniform_(0, float("inf")),
        lambda: gf.uniform_(1, 0),
        lambda: gf.normal_(0, -1),
    ):
        with pytest.raises(gl.GadgetValueError):
            call()
    np.testing.assert_array_equal(_np(gf), snapshot)
    gh = gl.DataGadget((3, 2), dtype="float16", placement="cpu")
    with pytest.raises(gl.GadgetValueError):  # high - low beyond float16's range
        gh.uniform_(-60000, 60000)


def test_init_and_file_table_initialisers(tmp_path):
    gx = gl.DataGadget((4, 3), placement="cpu")
    gx.init_(torch.nn.init.xavier_uniform_)
    assert _np(gx).std() > 0
    with pytest.raises(gl.GadgetTypeError):
        gx.init_("not callable")
    gx.gadgetInit()  # SpeedTorch's name is accepted
    np.save(tmp_path / "f.npy", np.ones((8, 3), np.float32))
    gfile = gl.DataGadget(str(tmp_path / "f.npy"), placement="file")
    for f in (torch.nn.init.orthogonal_, torch.nn.init.xavier_uniform_):
        with pytest.raises(gl.GadgetTypeError):
            gfile.init_(f)
    assert (np.load(tmp_path / "f.npy") == 1).all()
    gfile.init_(torch.nn.init.zeros_)
    gfile.flush()
    assert (np.load(tmp_path / "f.npy") == 0).all()
    with pytest.raises(gl.GadgetTypeError):
        gfile.as_tensor()
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        with pytest.raises(gl.GadgetValueError):
            np.asarray(gfile, copy=False)
    gfile.close()


def test_close_and_with_block():
    """README: after close() every call that touches rows, load() and flush() included,
    raises GadgetClosedError; shape, dtype, len() and repr() still answer."""
    g = gl.DataGadget((3, 2), placement="cpu")
    g.close()
    g.close()
    for call in (
        lambda: g.getData([0]),
        lambda: g.insertData(torch.zeros(1, 2), [0]),
        lambda: g.load("x.npy"),
        lambda: g.flush(),
        lambda: g[0],
        lambda: g.getNumpyVersion(),
        lambda: g.as_tensor(),
        lambda: g.fill_(1),
    ):
        with pytest.raises(gl.GadgetClosedError):
            call()
    assert g.shape == (3, 2) and g.dtype == torch.float32 and len(g) == 3
    assert "DataGadget" in repr(g)
    with gl.DataGadget((3, 2), placement="cpu") as w:
        w.fill_(1.0)
    with pytest.raises(gl.GadgetClosedError):
        w.getData([0])


@pytest.mark.parametrize("dt", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_ids_of_any_integer_dtype_and_shape(dt):
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    g = gl.DataGadget(a, placement="cpu")
    ids = torch.tensor([[1, 2, 3], [9, 0, 9]], dtype=dt)
    r = g.getData(ids)
    assert r.shape == (2, 3, 3)
    np.testing.assert_array_equal(_cpu(r).numpy(), a[ids.long().numpy()])


def test_id_kinds_accepted():
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    g = gl.DataGadget(a, placement="cpu")
    for ids in ([3, 4], np.array([3, 4], dtype=np.int16), range(3, 5), torch.tensor([3, 4])):
        np.testing.assert_array_equal(_cpu(g.getData(ids)).numpy(), a[3:5])
    assert g[3].shape == (3,)
    np.testing.assert_array_equal(_cpu(g[-2:]).numpy(), a[-2:])
    np.testing.assert_array_equal(
        _cpu(g.getData(torch.tensor([1, 2]), check_ids=False)).numpy(), a[1:3]
    )
    out = torch.empty(2, 3)
    assert g.getData([0, 1], out=out) is out
    np.testing.assert_array_equal(out.numpy(), a[0:2])


def test_bad_ids_raise_before_anything_is_written():
    """README: a negative or out-of-range id, a float id, data of the wrong dtype or shape
    raise a GadgetError subclass (also IndexError/TypeError/ValueError) that says what was
    expected and what arrived, before anything is written."""
    g = gl.DataGadget(np.zeros((10, 3), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetIndexError) as ei:
        g.insertData(torch.ones(2, 3), [0, 10])
    assert isinstance(ei.value, IndexError)
    assert "10" in str(ei.value) and "[0, 9]" in str(ei.value)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.ones(2, 3), [0, -1])
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.insertData(torch.ones(2, 3), torch.tensor([0.0, 1.0]))
    assert isinstance(ei.value, TypeError)
    with pytest.raises(gl.GadgetValueError) as ei:
        g.insertData(torch.ones(3, 3), [0, 1])
    assert (
        isinstance(ei.value, ValueError) and "(2, 3)" in str(ei.value) and "(3, 3)" in str(ei.value)
    )
    assert (_np(g) == 0).all()


def test_bool_and_uint8_ids():
    """README: floats, strings and bools are refused as ids; a bool tensor's message points to
    mask.nonzero(); a uint8 tensor is ids, like every integer dtype."""
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    g = gl.DataGadget(a, placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match=r"nonzero"):
        g[torch.ones(10, dtype=torch.bool)]
    for bad in (["1"], [1.0], [True, False], "1"):
        with pytest.raises(gl.GadgetTypeError):
            g[bad]
    np.testing.assert_array_equal(
        _cpu(g[torch.tensor([1, 2], dtype=torch.uint8)]).numpy(), a[[1, 2]]
    )


def test_repeated_ids_last_occurrence_wins():
    g = gl.DataGadget(np.zeros((5, 2), np.float32), placement="cpu")
    g.insertData(torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), [1, 2, 1])
    np.testing.assert_array_equal(_np(g)[[1, 2]], [[3, 3], [2, 2]])


def test_gather_many_and_scatter_many():
    """README: gl.gather_many([table, m, v], ids) returns one tensor per table and
    gl.scatter_many writes them; bad input changes nothing."""
    t = gl.DataGadget(np.arange(30, dtype=np.float32).reshape(10, 3), placement="cpu")
    m = gl.DataGadget(np.zeros((10, 3), np.float32), placement="cpu")
    v = gl.DataGadget(np.ones((10, 3), np.float32), placement="cpu")
    rows = gl.gather_many([t, m, v], [1, 2])
    assert isinstance(rows, list) and len(rows) == 3
    np.testing.assert_array_equal(_cpu(rows[0]).numpy(), _np(t)[[1, 2]])
    gl.scatter_many(
        [t, m, v], [torch.zeros(2, 3), torch.ones(2, 3), torch.full((2, 3), 2.0)], [3, 4]
    )
    assert (
        (_np(t)[[3, 4]] == 0).all() and (_np(m)[[3, 4]] == 1).all() and (_np(v)[[3, 4]] == 2).all()
    )
    before = [_np(x) for x in (t, m, v)]
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many([t, m, v], [torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3)], [5, 10])
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(
            [t, m, v],
            [torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)],
            [5, 6],
        )
    for b, x in zip(before, (t, m, v), strict=True):
        np.testing.assert_array_equal(b, _np(x))


# ---------------------------------------------------------------------------- files


def test_readme_files_block(tmp_path):
    a = np.arange(40, dtype=np.float32).reshape(20, 2)
    np.save(tmp_path / "emb.npy", a)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("emb/words", data=a * 2)
        f.create_dataset("other", data=a[:3])
    gl.DataGadget(a * 3, placement="cpu").save(str(tmp_path / "emb.zarr"))
    with _Quiet():
        g1 = gl.DataGadget(str(tmp_path / "emb.npy"), CPUPinn=True)
        g2 = gl.DataGadget(str(tmp_path / "data.h5"), dataset="emb/words", placement="pinned")
        g3 = gl.DataGadget(str(tmp_path / "emb.zarr"), placement="cuda")
    np.testing.assert_array_equal(_np(g1), a)
    np.testing.assert_array_equal(_np(g2), a * 2)
    np.testing.assert_array_equal(_np(g3), a * 3)
    # dataset= optional when there is one; a wrong name lists the ones that exist
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(str(tmp_path / "data.h5"), placement="cpu")
    assert "emb/words" in str(ei.value) and "other" in str(ei.value)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(str(tmp_path / "data.h5"), dataset="nope", placement="cpu")
    assert "emb/words" in str(ei.value)


def test_format_from_content_or_forced(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.save(tmp_path / "x.npy", a)
    os.rename(tmp_path / "x.npy", tmp_path / "x.bin")
    np.testing.assert_array_equal(_np(gl.DataGadget(str(tmp_path / "x.bin"), placement="cpu")), a)
    np.testing.assert_array_equal(
        _np(gl.DataGadget(str(tmp_path / "x.bin"), placement="cpu", format="npy", progress=False)),
        a,
    )


def test_bad_files_are_clear_errors_naming_the_file(tmp_path):
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    np.save(tmp_path / "ok.npy", a)
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.DataGadget(str(tmp_path / "missing.npy"), placement="cpu")
    assert isinstance(ei.value, FileNotFoundError) and "missing.npy" in str(ei.value)
    (tmp_path / "trunc.npy").write_bytes((tmp_path / "ok.npy").read_bytes()[:150])
    with pytest.raises(gl.GadgetFileError, match="trunc.npy"):
        gl.DataGadget(str(tmp_path / "trunc.npy"), placement="cpu")
    np.save(tmp_path / "zero.npy", np.zeros((0, 3), np.float32))
    with pytest.raises(gl.GadgetError, match="zero.npy"):
        gl.DataGadget(str(tmp_path / "zero.npy"), placement="cpu")
    np.save(tmp_path / "str.npy", np.array(["ab", "cd"]))
    with pytest.raises(gl.GadgetError, match="str.npy"):
        gl.DataGadget(str(tmp_path / "str.npy"), placement="cpu")
    # an in-memory table may have zero rows, but it is not saved either
    gz = gl.DataGadget((0, 3), placement="cpu")
    assert len(gz) == 0
    with pytest.raises(gl.GadgetError):
        gz.save(str(tmp_path / "zrow.npy"))
    assert not (tmp_path / "zrow.npy").exists()


def test_file_table_writes_through_and_read_only_options(tmp_path):
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    p = tmp_path / "w.npy"
    np.save(p, a)
    g = gl.DataGadget(str(p), placement="file", cache_bytes=1 << 20)
    g.insertData(torch.full((1, 3), -1.0), [4])
    g.insertData(torch.full((2, 2), -2.0), ([5, 6], slice(0, 2)))
    back = np.load(p)
    np.testing.assert_array_equal(back[4], [-1, -1, -1])
    np.testing.assert_array_equal(back[5:7], [[-2, -2, 17], [-2, -2, 20]])
    g.close()
    gr = gl.DataGadget(str(p), placement="file", writable=False)
    with pytest.raises(gl.ReadOnlyError) as ei:
        gr.insertData(torch.zeros(1, 3), [0])
    assert isinstance(ei.value, PermissionError)
    assert np.load(p)[0, 1] == 1
    gr.close()
    gl.DataGadget(str(p), placement="file", writable=np.bool_(False)).close()
    for bad in ("yes", 1):
        with pytest.raises(gl.GadgetTypeError):
            gl.DataGadget(str(p), placement="file", writable=bad)
    np.save(tmp_path / "fo.npy", np.asfortranarray(a))
    gfo = gl.DataGadget(str(tmp_path / "fo.npy"), placement="file")
    np.testing.assert_array_equal(_cpu(gfo.getData([1, 2])).numpy(), a[[1, 2]])
    with pytest.raises(gl.ReadOnlyError, match="Fortran"):
        gfo.insertData(torch.zeros(1, 3), [0])
    gfo.close()


def test_file_table_raises_after_its_file_is_replaced(tmp_path):
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    p = tmp_path / "w.npy"
    np.save(p, a)
    g = gl.DataGadget(str(p), placement="file")
    g.getData([0])
    gl.DataGadget(a * 2, placement="cpu").save(str(p))
    with pytest.raises(gl.GadgetFileError):
        g.getData([0])
    g.load(str(p))
    np.testing.assert_array_equal(_cpu(g.getData([1])).numpy(), a[[1]] * 2)
    g.close()


def test_file_tables_of_one_file_see_each_others_writes(tmp_path):
    p = tmp_path / "s.npy"
    np.save(p, np.zeros((10, 3), np.float32))
    g1 = gl.DataGadget(str(p), placement="file")
    g2 = gl.DataGadget(str(p), placement="file")
    g1.getData([0]), g2.getData([0])
    g1.insertData(torch.full((1, 3), 5.0), [0])
    np.testing.assert_array_equal(_cpu(g2.getData([0])).numpy(), [[5, 5, 5]])
    g1.close()
    g2.close()


def test_save_options_and_compressions(tmp_path):
    """README: g.save("t.h5", dataset="emb", chunk_rows=4096, compression="gzip") -- HDF5 takes
    gzip/lzf/"none", zarr zstd (default)/gzip/blosc/"none"; without dataset= an HDF5 file's
    dataset is named data and a zarr store is one bare array; bad arguments (progress="False",
    an unknown compression) are refused before any file is made."""
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    g = gl.DataGadget(a, placement="cpu")
    g.save(str(tmp_path / "t.h5"), dataset="emb", chunk_rows=4096, compression="gzip")
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert list(f.keys()) == ["emb"] and f["emb"].compression == "gzip"
        np.testing.assert_array_equal(f["emb"][...], a)
    for comp in ("lzf", "none"):
        g.save(str(tmp_path / f"t_{comp}.h5"), compression=comp)
        with h5py.File(tmp_path / f"t_{comp}.h5", "r") as f:
            assert list(f.keys()) == ["data"]
            assert f["data"].compression == (None if comp == "none" else comp)
    for comp in ("zstd", "gzip", "blosc", "none"):
        g.save(str(tmp_path / f"z_{comp}.zarr"), compression=comp)
        z = zarr.open(str(tmp_path / f"z_{comp}.zarr"), mode="r")
        assert hasattr(z, "shape") and tuple(z.shape) == (20, 3)  # one bare array, no group
        np.testing.assert_array_equal(z[...], a)
    for target, kw in (
        ("bad.h5", {"compression": "zstd"}),
        ("bad.zarr", {"compression": "lzf"}),
        ("bad2.h5", {"progress": "False"}),
        ("bad3.h5", {"dataset": "../x"}),
        ("bad4.h5", {"dataset": "a/./x"}),
    ):
        with pytest.raises(gl.GadgetError):
            g.save(str(tmp_path / target), **kw)
        assert not (tmp_path / target).exists()
    with pytest.raises(gl.GadgetValueError):
        g.save(str(tmp_path / "bad5.h5"), dataset="..")


def test_save_refuses_directories_and_bad_paths(tmp_path):
    g = gl.DataGadget(np.zeros((3, 2), np.float32), placement="cpu")
    for name in ("adir.npy", "adir.h5"):
        os.mkdir(tmp_path / name)
        with pytest.raises(gl.GadgetFileError):
            g.save(str(tmp_path / name))
    os.mkdir(tmp_path / "nonempty.zarr")
    (tmp_path / "nonempty.zarr" / "x").write_text("x")
    with pytest.raises(gl.GadgetFileError):
        g.save(str(tmp_path / "nonempty.zarr"))
    assert (tmp_path / "nonempty.zarr" / "x").read_text() == "x"
    os.mkdir(tmp_path / "empty.zarr")
    g.save(str(tmp_path / "empty.zarr"))  # an empty folder is fine
    for call in (
        lambda: g.save(None),
        lambda: g.load(None),
        lambda: g.saveCupy(None),
        lambda: g.loadCupy(None),
    ):
        with pytest.raises(gl.GadgetTypeError):
            call()
    with pytest.raises(gl.GadgetTypeError, match="fsdecode"):
        g.save(os.fsencode(str(tmp_path / "b.npy")))
    with pytest.raises(gl.GadgetValueError, match="shape"):
        gl.DataGadget(None)


def test_save_keeps_permissions_and_follows_symlinks(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    p = tmp_path / "p.npy"
    np.save(p, a)
    os.chmod(p, 0o640)
    gl.DataGadget(a * 2, placement="cpu").save(str(p))
    assert os.stat(p).st_mode & 0o777 == 0o640
    np.testing.assert_array_equal(np.load(p), a * 2)
    np.save(tmp_path / "target.npy", a)
    os.symlink("target.npy", tmp_path / "link.npy")
    os.link(tmp_path / "target.npy", tmp_path / "hard.npy")
    gl.DataGadget(a * 3, placement="cpu").save(str(tmp_path / "link.npy"))
    assert os.path.islink(tmp_path / "link.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "target.npy"), a * 3)
    np.testing.assert_array_equal(
        np.load(tmp_path / "hard.npy"), a
    )  # other hard links keep old data
    assert not [x for x in os.listdir(tmp_path) if "partial" in x]


def test_saveCupy_appends_npy_like_numpy_save(tmp_path):
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    g.saveCupy(str(tmp_path / "emb"))
    assert (tmp_path / "emb.npy").exists()
    g2 = gl.DataGadget((1, 1), placement="cpu")
    g2.loadCupy(str(tmp_path / "emb.npy"))  # DataGadget.loadCupy takes the file's shape and dtype
    assert g2.shape == (3, 2) and (_np(g2) == 1).all()


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    torch.manual_seed(0)
    for dt in gl.SUPPORTED_DTYPES:
        t = (torch.randn(6, 2) > 0) if dt == torch.bool else (torch.randn(6, 2) * 50).to(dt)
        g = gl.DataGadget(t, placement="cpu")
        exts = [".h5", ".zarr"] + ([] if dt == torch.bfloat16 else [".npy"])
        for ext in exts:
            p = tmp_path / f"rt_{str(dt).split('.')[-1]}{ext}"
            g.save(str(p))
            back = gl.DataGadget(str(p), placement="cpu")
            assert back.dtype == dt, (dt, ext)
            assert torch.equal(back.as_tensor(), t), (dt, ext)
    tn = torch.tensor([[float("nan"), -0.0, float("inf")]])
    for ext in (".npy", ".h5", ".zarr"):
        gl.DataGadget(tn, placement="cpu").save(str(tmp_path / f"nan{ext}"))
        b = gl.DataGadget(str(tmp_path / f"nan{ext}"), placement="cpu").as_tensor()
        assert torch.equal(b.view(torch.int32), tn.view(torch.int32)), ext


def test_bfloat16_storage(tmp_path):
    """README: bfloat16 is stored as uint16 bits plus an attribute (it has no .npy form)."""
    g = gl.DataGadget(torch.randn(5, 3).to(torch.bfloat16), placement="cpu")
    with pytest.raises(gl.GadgetError):
        g.save(str(tmp_path / "bf.npy"))
    assert not (tmp_path / "bf.npy").exists()
    g.save(str(tmp_path / "bf.h5"))
    with h5py.File(tmp_path / "bf.h5", "r") as f:
        assert f["data"].dtype == np.uint16
        assert len(f["data"].attrs) >= 1


def test_unsigned_files_convert_with_dtype(tmp_path):
    """README: gl.DataGadget("counts.npy", dtype="int64") reads a uint32 file; 'int32' for
    uint16; a float dtype rounds (uint32 16777217 becomes 16777216 in float32); refused if a
    value is beyond the dtype's range; load()/loadCupy() and file tables refuse such files."""
    p = tmp_path / "counts.npy"
    np.save(p, np.array([[1], [2**32 - 1], [16777217]], dtype=np.uint32))
    with pytest.raises(gl.GadgetTypeError, match="int64"):
        gl.DataGadget(str(p), placement="cpu")
    g = gl.DataGadget(str(p), dtype="int64", placement="cpu")
    assert g.dtype == torch.int64
    assert _np(g).ravel().tolist() == [1, 2**32 - 1, 16777217]
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(str(p), dtype="int32", placement="cpu")
    assert float(gl.DataGadget(str(p), dtype="float32", placement="cpu")[2][0]) == 16777216.0
    for kw in ({}, {"dtype": "int64"}):
        with pytest.raises(gl.GadgetTypeError, match="int64"):
            gl.DataGadget(str(p), placement="file", **kw)
    h = gl.DataGadget(np.zeros((2, 1), np.float32), placement="cpu")
    for call in (h.load, h.loadCupy):
        with pytest.raises(gl.GadgetTypeError):
            call(str(p))
        assert h.shape == (2, 1) and h.dtype == torch.float32
    np.save(tmp_path / "u16.npy", np.array([[1, 65535]], dtype=np.uint16))
    g16 = gl.DataGadget(str(tmp_path / "u16.npy"), dtype="int32", placement="cpu")
    assert g16.dtype == torch.int32 and _np(g16).tolist() == [[1, 65535]]


def test_complex_refused(tmp_path):
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.ones((2, 2), np.complex64), placement="cpu")
    np.save(tmp_path / "c.npy", np.ones((2, 2), np.complex64))
    with pytest.raises(gl.GadgetTypeError, match="imaginary"):
        gl.DataGadget(str(tmp_path / "c.npy"), placement="cpu")


def test_hdf5_external_link_is_read_only_and_virtual_dataset_checked(tmp_path):
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    with h5py.File(tmp_path / "target.h5", "w") as f:
        f.create_dataset("emb", data=a)
    with h5py.File(tmp_path / "linker.h5", "w") as f:
        f["ext"] = h5py.ExternalLink("target.h5", "emb")
    g = gl.DataGadget(str(tmp_path / "linker.h5"), dataset="ext", placement="file")
    np.testing.assert_array_equal(_cpu(g[[1]]).numpy(), a[[1]])
    with pytest.raises(gl.ReadOnlyError) as ei:
        g.insertData(torch.zeros(1, 3), [0])
    assert "target.h5" in str(ei.value) and "emb" in str(ei.value)
    g.close()
    lay = h5py.VirtualLayout(shape=(10, 3), dtype="float32")
    lay[:] = h5py.VirtualSource(str(tmp_path / "vsrc.h5"), "emb", shape=(10, 3))
    with h5py.File(tmp_path / "vsrc.h5", "w") as f:
        f.create_dataset("emb", data=a)
    with h5py.File(tmp_path / "virt.h5", "w") as f:
        f.create_virtual_dataset("v", lay, fillvalue=-1)
    np.testing.assert_array_equal(_np(gl.DataGadget(str(tmp_path / "virt.h5"), placement="cpu")), a)
    os.remove(tmp_path / "vsrc.h5")
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(str(tmp_path / "virt.h5"), placement="file")


def test_pickling_cpu_by_value_and_file_by_name(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(a, placement="cpu")
    p = pickle.loads(pickle.dumps(g))
    assert p.placement == "cpu" and torch.equal(p.as_tensor(), g.as_tensor())
    assert p.as_tensor().data_ptr() != g.as_tensor().data_ptr()
    np.save(tmp_path / "pk.npy", a)
    gf = gl.DataGadget(str(tmp_path / "pk.npy"), placement="file")
    s = pickle.dumps(gf)
    assert len(s) < a.nbytes + 2000 and b"pk.npy" in s
    gp = pickle.loads(s)
    assert gp.placement == "file"
    np.testing.assert_array_equal(_cpu(gp[[1]]).numpy(), a[[1]])
    gp.close()
    gf.close()


# ---------------------------------------------------------------------------- input pipeline


def test_readme_dataset_default_form(tmp_path):
    """The GadgetDataset block: DataLoader(ds, batch_size=..., shuffle=True), no collate_fn."""
    n = 50
    feat = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    np.save(tmp_path / "features.npy", feat)
    labels = np.arange(n, dtype=np.int64) * 10
    ds = gl.GadgetDataset(str(tmp_path / "features.npy"), labels)
    assert len(ds) == n
    seen = []
    for x, y in DataLoader(ds, batch_size=16, shuffle=True):
        assert isinstance(x, torch.Tensor) and x.shape[1:] == (3,) and x.dtype == torch.float32
        assert y.dtype == torch.int64 and y.shape == x.shape[:1]
        np.testing.assert_array_equal(_cpu(x).numpy(), feat[_cpu(y).numpy() // 10])
        seen.append(_cpu(y))
    assert sorted(torch.cat(seen).tolist()) == labels.tolist()


def test_getitems_is_one_element_list_and_custom_collate_takes_batch0():
    ds = gl.GadgetDataset(np.arange(30, dtype=np.float32).reshape(10, 3), np.arange(10))
    out = ds.__getitems__([1, 2])
    assert isinstance(out, list) and len(out) == 1
    n, b0 = next(iter(DataLoader(ds, batch_size=4, collate_fn=lambda b: (len(b), b[0]))))
    assert n == 1
    x, y = b0
    assert _cpu(y).tolist() == [0, 1, 2, 3]


def test_subset_concat_and_stack_datasets():
    feat = np.arange(30, dtype=np.float32).reshape(10, 3)
    ds = gl.GadgetDataset(feat, np.arange(10))
    x, y = next(iter(DataLoader(Subset(ds, [3, 4, 5]), batch_size=3)))
    assert _cpu(y).tolist() == [3, 4, 5]
    x, y = next(iter(DataLoader(ConcatDataset([ds, ds]), batch_size=3)))
    assert _cpu(y).tolist() == [0, 1, 2] and x.shape == (3, 3)
    sd = getattr(torch.utils.data, "StackDataset", None)
    if sd is not None:
        with pytest.raises(ValueError, match="output size mismatch"):
            next(iter(DataLoader(sd(ds, ds), batch_size=3)))


def test_dataset_indexing_follows_python():
    feat = np.arange(30, dtype=np.float32).reshape(10, 3)
    ds = gl.GadgetDataset(feat)
    (last,) = ds[-1]
    np.testing.assert_array_equal(_cpu(last).numpy(), feat[-1])
    (sl,) = ds[2:4]
    np.testing.assert_array_equal(_cpu(sl).numpy(), feat[2:4])
    with pytest.raises(gl.GadgetIndexError):
        ds[[-1]]
    with pytest.raises(gl.GadgetIndexError):
        ds[np.array([10])]
    with pytest.raises(IndexError):
        ds[10]


def test_readme_fast_forms_and_sampler():
    n = 50
    ds = gl.GadgetDataset(np.arange(n * 2, dtype=np.float32).reshape(n, 2))
    sampler = gl.GadgetSampler(ds, batch_size=16, order="random", seed=0)
    batches = [b.clone() for b in sampler]
    assert [len(b) for b in batches] == [16, 16, 16, 2]
    assert all(b.dtype == torch.int64 for b in batches)
    assert sorted(torch.cat(batches).tolist()) == list(range(n))
    for loader in (
        DataLoader(ds, batch_sampler=sampler),
        DataLoader(ds, sampler=sampler, batch_size=None),
        gl.GadgetLoader(ds, batch_size=16, prefetch=2),
    ):
        rows = torch.cat([_cpu(x) for (x,) in loader])
        assert rows.shape == (n, 2)
        assert sorted(rows[:, 0].tolist()) == [2.0 * i for i in range(n)]
    with pytest.raises(gl.GadgetValueError):
        list(DataLoader(ds, sampler=sampler))


def test_sampler_orders_and_epochs():
    s = gl.GadgetSampler(40, batch_size=10, seed=0)
    e0 = [b.clone() for b in s]
    e1 = [b.clone() for b in s]
    assert any(
        not torch.equal(a, b) for a, b in zip(e0, e1, strict=False)
    )  # a new permutation each epoch
    s.set_epoch(0)
    assert all(torch.equal(a, b) for a, b in zip(e0, [b.clone() for b in s], strict=True))
    s2 = gl.GadgetSampler(40, batch_size=10, seed=0)
    it = iter(s2)
    first = next(it).clone()
    del it
    assert torch.equal(next(iter(s2)), first)  # an early break starts the same epoch anew
    seq = [b.tolist() for b in gl.GadgetSampler(12, batch_size=5, order="sequential")]
    assert seq == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    with pytest.raises(gl.GadgetKeyError, match="sequential"):
        gl.GadgetSampler(12, batch_size=5, order="bogus")


def test_sampler_batches_are_views_of_one_order():
    bl = list(gl.GadgetSampler(40, batch_size=10, seed=0))
    assert bl[0]._base is not None
    assert bl[0].untyped_storage().data_ptr() == bl[1].untyped_storage().data_ptr()


def test_sampler_chunk_order_on_file_columns(tmp_path):
    np.save(tmp_path / "big.npy", np.arange(400, dtype=np.float32).reshape(200, 2))
    fds = gl.GadgetDataset(gl.DataGadget(str(tmp_path / "big.npy"), placement="file"))
    bl = [b.clone() for b in gl.GadgetSampler(fds, batch_size=16, order="chunk", chunk_rows=32)]
    assert sorted(torch.cat(bl).tolist()) == list(range(200))


def test_sampler_drop_last_pad_and_ranks():
    """README: by default every row once per epoch (the last batch on a rank may hold up to
    batch_size + 1 rows); drop_last drops fewer than num_replicas * batch_size rows (refused
    where fewer rows than that); pad=True makes every batch full; every rank gets the same
    number of batches; num_replicas > 1 without torch.distributed needs rank."""
    assert [len(b) for b in gl.GadgetSampler(50, batch_size=16, drop_last=True)] == [16, 16, 16]
    padded = [b.clone() for b in gl.GadgetSampler(50, batch_size=16, pad=True, seed=1)]
    assert [len(b) for b in padded] == [16] * 4
    assert set(torch.cat(padded).tolist()) == set(range(50))
    r0 = [b.clone() for b in gl.GadgetSampler(33, batch_size=16, num_replicas=2, rank=0)]
    r1 = [b.clone() for b in gl.GadgetSampler(33, batch_size=16, num_replicas=2, rank=1)]
    assert len(r0) == len(r1)
    assert max(len(b) for b in r0 + r1) <= 17
    allids = torch.cat(r0 + r1).tolist()
    assert sorted(allids) == list(range(33))
    for kw in (
        dict(batch_size=60, drop_last=True),
        dict(batch_size=13, num_replicas=4, rank=0, drop_last=True),
    ):
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetSampler(50, **kw)
    with pytest.raises(gl.GadgetValueError, match="rank"):
        gl.GadgetSampler(50, batch_size=16, num_replicas=2)
    ps = pickle.loads(pickle.dumps(gl.GadgetSampler(40, batch_size=10, num_replicas=2, rank=1)))
    assert ps.state_dict()["rank"] == 1


def test_sampler_resume_and_refusals():
    s = gl.GadgetSampler(100, batch_size=10, seed=3)
    it = iter(s)
    for _ in range(4):
        next(it)
    st = s.state_dict()
    rest = [b.clone() for b in it]
    s2 = gl.GadgetSampler(100, batch_size=10, seed=99)  # the loaded state brings its seed
    s2.load_state_dict(st)
    rest2 = [b.clone() for b in s2]
    assert len(rest) == len(rest2) == 6
    assert all(torch.equal(a, b) for a, b in zip(rest, rest2, strict=False))
    for n, kw in (
        (101, {}),
        (100, dict(batch_size=5)),
        (100, dict(order="sequential")),
        (100, dict(drop_last=True)),
        (100, dict(pad=True)),
        (100, dict(num_replicas=2, rank=0)),
    ):
        s3 = gl.GadgetSampler(n, **{"batch_size": 10, **kw})
        before = s3.state_dict()
        with pytest.raises(gl.GadgetValueError):
            s3.load_state_dict(st)
        assert s3.state_dict() == before


def test_state_saved_after_last_batch_resumes_with_empty_pass():
    s = gl.GadgetSampler(40, batch_size=10, seed=0)
    e0 = [b.clone() for b in s]
    e1 = [b.clone() for b in s]
    s = gl.GadgetSampler(40, batch_size=10, seed=0)
    for i, _ in enumerate(s):
        if i == 3:
            st = s.state_dict()
    s2 = gl.GadgetSampler(40, batch_size=10, seed=0)
    s2.load_state_dict(st)
    assert list(s2) == []
    assert all(torch.equal(a, b) for a, b in zip(e1, [b.clone() for b in s2], strict=True))
    # a loaded position holds until a batch is drawn
    s3 = gl.GadgetSampler(40, batch_size=10, seed=0)
    it = iter(s3)
    next(it), next(it)
    st = s3.state_dict()
    s4 = gl.GadgetSampler(40, batch_size=10, seed=0)
    s4.load_state_dict(st)
    iter(s4), iter(s4)
    rest = [b.clone() for b in s4]
    assert len(rest) == 2 and all(torch.equal(a, b) for a, b in zip(rest, e0[2:], strict=False))


def test_gadgetloader_resume_and_state_after_loop():
    ds = gl.GadgetDataset(np.arange(100, dtype=np.float32).reshape(100, 1))
    L = gl.GadgetLoader(ds, batch_size=10, seed=1)
    it = iter(L)
    for _ in range(3):
        next(it)
    sd = L.state_dict()
    rest = [_cpu(x).clone() for (x,) in it]
    L2 = gl.GadgetLoader(ds, batch_size=10, seed=1)
    L2.load_state_dict(sd)
    rest2 = [_cpu(x).clone() for (x,) in L2]
    assert len(rest) == 7 and all(torch.equal(a, b) for a, b in zip(rest, rest2, strict=False))
    # after the loop ended, the state points at the next epoch's start
    L3 = gl.GadgetLoader(ds, batch_size=10, seed=1)
    first = [_cpu(x).clone() for (x,) in L3]
    sd = L3.state_dict()
    nxt = [_cpu(x).clone() for (x,) in L3]
    L4 = gl.GadgetLoader(ds, batch_size=10, seed=1)
    L4.load_state_dict(sd)
    again = [_cpu(x).clone() for (x,) in L4]
    assert all(torch.equal(a, b) for a, b in zip(nxt, again, strict=False)) and len(again) == 10
    assert any(not torch.equal(a, b) for a, b in zip(first, nxt, strict=False))


def test_stateful_dataloader_resume():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = gl.GadgetDataset(np.arange(300, dtype=np.float32).reshape(100, 3))
    dl = sdl.StatefulDataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=10, seed=5))
    it = iter(dl)
    for _ in range(3):
        next(it)
    sd = dl.state_dict()
    rest = [_cpu(x).clone() for (x,) in it]
    dl2 = sdl.StatefulDataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=10, seed=5))
    dl2.load_state_dict(sd)
    rest2 = [_cpu(x).clone() for (x,) in dl2]
    assert len(rest) == 7 and all(torch.equal(a, b) for a, b in zip(rest, rest2, strict=False))


def test_column_reloaded_to_another_row_count_raises(tmp_path):
    g = gl.DataGadget(np.zeros((10, 2), np.float32), placement="cpu")
    ds = gl.GadgetDataset(g)
    np.save(tmp_path / "twelve.npy", np.zeros((12, 2), np.float32))
    g.load(str(tmp_path / "twelve.npy"))
    with pytest.raises(gl.GadgetValueError):
        ds[[0, 1]]


def test_gadgetloader_argument_refusals():
    ds = gl.GadgetDataset(np.zeros((20, 2), np.float32))
    sampler = gl.GadgetSampler(ds, batch_size=4)
    for kw in (dict(order="random"), dict(seed=1), dict(drop_last=True)):
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetLoader(ds, sampler=sampler, **kw)
    for kw in (dict(shuffle=True), dict(collate_fn=None), dict(batch_sampler=sampler)):
        with pytest.raises(gl.GadgetTypeError):
            gl.GadgetLoader(ds, batch_size=4, **kw)
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetLoader(ds, sampler=torch.utils.data.SequentialSampler(ds))
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(gl.GadgetDataset(np.zeros((0, 2), np.float32)), batch_size=4)
    # its drop_last= is the sampler option
    lens = [
        len(x)
        for (x,) in gl.GadgetLoader(
            gl.GadgetDataset(np.zeros((23, 1), np.float32)), batch_size=5, drop_last=True
        )
    ]
    assert lens == [5, 5, 5, 5]


def test_gadgetloader_prefetch0_sees_writes_and_coalesce_keeps_batches():
    g = gl.DataGadget(np.zeros((20, 1), np.float32), placement="cpu")
    ds = gl.GadgetDataset(g)
    seen = []
    for i, (x,) in enumerate(gl.GadgetLoader(ds, batch_size=5, prefetch=0, order="sequential")):
        seen.append(_cpu(x).flatten().tolist())
        if i < 3:
            g.insertData(torch.full((5, 1), float(i + 1)), torch.arange((i + 1) * 5, (i + 2) * 5))
    assert seen == [[0.0] * 5, [1.0] * 5, [2.0] * 5, [3.0] * 5]
    ds2 = gl.GadgetDataset(np.arange(100, dtype=np.float32).reshape(100, 1))
    a = [
        _cpu(x).clone()
        for (x,) in DataLoader(
            ds2, batch_sampler=gl.GadgetSampler(ds2, batch_size=7, seed=2, coalesce=4)
        )
    ]
    b = [
        _cpu(x).clone()
        for (x,) in DataLoader(
            ds2, batch_sampler=gl.GadgetSampler(ds2, batch_size=7, seed=2, coalesce=1)
        )
    ]
    assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=False))


# ---------------------------------------------------------------------------- training


def test_readme_drop_in_module_block():
    """The drop-in block with small tables, on the CPU (without .cuda())."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "item": gl.OffloadedEmbedding(500, 8, placement="cpu"),
            "user": gl.OffloadedEmbeddingBag(300, 8, mode="mean"),
            "head": torch.nn.Linear(8, 1),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, lr=1e-2, weight_decay=0.01)
    assert isinstance(opt, torch.optim.Optimizer)
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randint(0, 500, (32,), generator=g),
            torch.randint(0, 300, (32, 5), generator=g),
            torch.randn(32, generator=g),
        )
    ] * 25
    item0 = _np(model["item"].weight)
    losses = []
    for items, history, y in batches:
        pred = model["head"](model["item"](items) * model["user"](history)).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.5
    item1 = _np(model["item"].weight)
    used = np.unique(batches[0][0].numpy())
    unused = np.setdiff1d(np.arange(500), used)
    assert not np.array_equal(item1[used], item0[used])
    np.testing.assert_array_equal(item1[unused], item0[unused])  # lazy: untouched rows keep values


@pytest.mark.parametrize(
    "opt_cls, kw",
    [
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.01)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
    ],
)
def test_drop_in_is_bit_identical_to_dense_on_looked_up_rows(opt_cls, kw):
    """README: several lookups of a table in a step; the result is bit-identical to a dense
    nn.Embedding trained the same way on the rows a step looks up (float32, default kernels);
    rows a step does not look up keep their values."""
    torch.manual_seed(0)
    n, d = 30, 4
    w0 = torch.randn(n, d)
    emb = gl.OffloadedEmbedding(n, d, placement="cpu")
    emb.weight.insertData(w0.clone(), torch.arange(n))
    head = torch.nn.Linear(d, 1)
    head2 = copy.deepcopy(head)
    opt = gl.OffloadedOptimizer(opt_cls, torch.nn.ModuleDict({"e": emb, "h": head}), **kw)
    dense = torch.nn.Embedding(n, d)
    dense.weight.data.copy_(w0)
    dopt = opt_cls(list(dense.parameters()) + list(head2.parameters()), **kw)
    S = torch.tensor([1, 3, 4, 7, 9, 12])
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = torch.cat([S, S[torch.randint(0, len(S), (10,), generator=g)]])[
            torch.randperm(16, generator=g)
        ]
        ids2 = S[torch.randint(0, len(S), (5,), generator=g)]
        loss = head(emb(ids)).sum() + emb(ids2).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dloss = head2(dense(ids)).sum() + dense(ids2).pow(2).sum()
        dopt.zero_grad()
        dloss.backward()
        dopt.step()
    got = torch.from_numpy(_np(emb.weight))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[S] = True
    assert torch.equal(got[mask], dense.weight.detach()[mask])
    assert torch.equal(got[~mask], w0[~mask])
    assert torch.equal(head.weight, head2.weight)


def test_training_table_refuses_file_placement_and_torch_only_options():
    with pytest.raises(gl.GadgetKeyError):
        gl.OffloadedEmbedding(10, 4, placement="file")
    for kw in (dict(padding_idx=0), dict(max_norm=1.0), dict(sparse=True)):
        with pytest.raises(TypeError):
            gl.OffloadedEmbedding(10, 4, **kw)
    with pytest.raises(TypeError):
        gl.OffloadedEmbeddingBag(10, 4, padding_idx=0)
    with pytest.raises(gl.GadgetValueError, match="sum"):
        gl.OffloadedEmbeddingBag(10, 4, mode="median")


def test_offloaded_optimizer_refusals():
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4), "h": torch.nn.Linear(4, 1)})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m)
    for call in (
        lambda: copy.deepcopy(opt),
        lambda: pickle.dumps(opt),
        lambda: torch.save(opt, io.BytesIO()),
    ):
        with pytest.raises(gl.GadgetTypeError):
            call()
    m2 = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4)})
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, [m2["a"].weight])
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, {m2["a"]})
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.OffloadedOptimizer(torch.optim.LBFGS, m2)
    assert "SparseAdam" in str(ei.value) and "RAdam" in str(ei.value)
    with pytest.raises(gl.GadgetError):
        gl.OffloadedOptimizer(torch.optim.Adam, m2, differentiable=True)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.Adam, [{"params": m2["a"]}, {"params": m2["a"]}])
    with pytest.raises(gl.GadgetError, match="model.parameters"):
        gl.OffloadedOptimizer(
            torch.optim.Adam, torch.nn.ModuleDict({"b": gl.OffloadedEmbedding(10, 4)}).parameters()
        )
    with pytest.warns(UserWarning, match="OffloadedEmbedding"):
        gl.OffloadedOptimizer(torch.optim.Adam, torch.nn.Linear(2, 2).parameters())


def test_table_changes_owner_after_optimizer_is_gone():
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4)})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.Adam, m)
    del opt
    gc.collect()
    _opt2 = gl.OffloadedOptimizer(torch.optim.Adam, m)
    m["a"](torch.tensor([1])).sum().backward()
    before = _np(m["a"].weight)
    _opt2.step()
    assert not np.array_equal(before, _np(m["a"].weight))


def test_init_of_emb_weight():
    e = gl.OffloadedEmbedding(10, 4)
    for f in (torch.nn.init.xavier_uniform_, torch.nn.init.kaiming_normal_):
        f(e.weight)
        assert _np(e.weight).std() > 0
    torch.nn.init.constant_(e.weight, 0.5)
    assert (_np(e.weight) == 0.5).all()
    torch.nn.init.zeros_(e.weight)
    assert (_np(e.weight) == 0).all()
    for f in (torch.nn.init.trunc_normal_, torch.nn.init.orthogonal_):
        with pytest.raises(gl.GadgetTypeError):
            f(e.weight)
    e.weight.init_(torch.nn.init.trunc_normal_, std=0.02)
    v = _np(e.weight)
    assert 0 < v.std() < 0.1


def test_step_semantics_closure_zero_grad_freeze_and_dtype():
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4)})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)

    def closure():
        opt.zero_grad()
        loss = m["a"](torch.tensor([3])).sum()
        loss.backward()
        return loss

    ret = opt.step(closure)
    assert isinstance(ret, torch.Tensor)
    before = _np(m["a"].weight)
    opt.step()  # no new backward: the tables are left alone
    np.testing.assert_array_equal(before, _np(m["a"].weight))
    m["a"](torch.tensor([4])).sum().backward()
    opt.zero_grad()
    opt.step()
    np.testing.assert_array_equal(before, _np(m["a"].weight))
    m["a"].requires_grad_(False)
    assert not m["a"](torch.tensor([1])).requires_grad
    m["a"].requires_grad_(True)
    ed = gl.OffloadedEmbedding(10, 4).double()
    assert ed(torch.tensor([1])).dtype == torch.float64 and ed.weight.dtype == torch.float32


def test_out_of_range_cpu_ids_checked_before_forward_returns():
    e = gl.OffloadedEmbedding(10, 4)
    for bad in ([10], [-1]):
        with pytest.raises(gl.GadgetIndexError):
            e(torch.tensor(bad))


def test_loading_rows_while_a_lookup_waits_is_refused():
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4)})
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m)
    m["a"](torch.tensor([1])).sum().backward()
    before = _np(m["a"].weight)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        m["a"].load_state_dict({"weight": torch.zeros(10, 4)})
    with pytest.raises(gl.GadgetValueError):
        m["a"].weight.fill_(0.0)
    np.testing.assert_array_equal(before, _np(m["a"].weight))
    opt.step()
    m["a"].load_state_dict(
        {"weight": torch.zeros(10, 4, dtype=torch.float64)}
    )  # converted as torch does
    assert (_np(m["a"].weight) == 0).all()


def test_module_load_state_dict_loads_the_tables_that_fit():
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4), "b": gl.OffloadedEmbedding(6, 4)})
    sd = {"a.weight": torch.ones(10, 4), "b.weight": torch.ones(7, 4)}
    before_b = _np(m["b"].weight)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict"):
        m.load_state_dict(sd)
    assert (_np(m["a"].weight) == 1).all()
    np.testing.assert_array_equal(before_b, _np(m["b"].weight))


def test_optimizer_state_dict_class_check_and_type():
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4)})
    oa = gl.OffloadedOptimizer(torch.optim.Adam, m)
    m["a"](torch.tensor([1, 2])).sum().backward()
    oa.step()
    sd = oa.state_dict()
    on = gl.OffloadedOptimizer(
        torch.optim.NAdam, torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4)})
    )
    with pytest.raises(gl.GadgetValueError, match="Adam"):
        on.load_state_dict(sd)
    with pytest.raises(gl.GadgetTypeError):
        oa.load_state_dict([1])


def test_param_group_dicts_and_add_param_group():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"item": gl.OffloadedEmbedding(10, 4), "head": torch.nn.Linear(4, 1)}
    )
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD,
        [{"params": model["item"], "lr": 1.0}, {"params": model["head"].parameters()}],
        lr=0.0,
    )
    new_emb = gl.OffloadedEmbedding(6, 4)
    opt.add_param_group({"params": new_emb, "lr": 1.0})
    w_item, w_new, w_head = (
        _np(model["item"].weight),
        _np(new_emb.weight),
        model["head"].weight.detach().clone(),
    )
    loss = model["head"](model["item"](torch.tensor([1]))).sum() + new_emb(torch.tensor([2])).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert not np.array_equal(w_item[1], _np(model["item"].weight)[1])
    np.testing.assert_allclose(_np(new_emb.weight)[2], w_new[2] - 1.0)
    assert torch.equal(w_head, model["head"].weight)  # lr 0 for the head


def test_clip_over_param_groups_matches_dense():
    """README: the tables' row gradients join param_groups as soon as anything walks the
    groups after a backward, so clipping over param_groups works in torch's usual order."""
    torch.manual_seed(0)
    n, d = 12, 3
    w0 = torch.randn(n, d) * 10
    emb = gl.OffloadedEmbedding(n, d)
    emb.weight.insertData(w0.clone(), torch.arange(n))
    opt = gl.OffloadedOptimizer(torch.optim.SGD, torch.nn.ModuleDict({"e": emb}), lr=0.5)
    dense = torch.nn.Embedding(n, d)
    dense.weight.data.copy_(w0)
    dopt = torch.optim.SGD(dense.parameters(), lr=0.5)
    ids = torch.tensor([1, 2, 2, 5])
    emb(ids).pow(2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    dense(ids).pow(2).sum().backward()
    dnorm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
    dopt.step()
    assert torch.allclose(norm, dnorm, rtol=1e-5)
    np.testing.assert_allclose(_np(emb.weight), dense.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(_np(emb.weight)[1], w0[1].numpy())


def test_lr_scheduler_follows():
    torch.manual_seed(0)
    n, d = 8, 2
    w0 = torch.randn(n, d)
    emb = gl.OffloadedEmbedding(n, d)
    emb.weight.insertData(w0.clone(), torch.arange(n))
    opt = gl.OffloadedOptimizer(torch.optim.SGD, torch.nn.ModuleDict({"e": emb}), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    dense = torch.nn.Embedding(n, d)
    dense.weight.data.copy_(w0)
    dopt = torch.optim.SGD(dense.parameters(), lr=1.0)
    dsched = torch.optim.lr_scheduler.StepLR(dopt, step_size=1, gamma=0.1)
    for _ in range(3):
        ids = torch.tensor([0, 3])
        opt.zero_grad()
        emb(ids).sum().backward()
        opt.step()
        sched.step()
        dopt.zero_grad()
        dense(ids).sum().backward()
        dopt.step()
        dsched.step()
    assert torch.equal(torch.from_numpy(_np(emb.weight)), dense.weight.detach())


def test_deepcopy_of_model_is_a_separate_table():
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4)})
    opt = gl.OffloadedOptimizer(torch.optim.SGD, m, lr=1.0)
    c = copy.deepcopy(m)
    before = _np(c["a"].weight)
    m["a"](torch.tensor([1])).sum().backward()
    opt.step()
    np.testing.assert_array_equal(before, _np(c["a"].weight))
    _opt_c = gl.OffloadedOptimizer(
        torch.optim.SGD, c, lr=1.0
    )  # no optimizer yet: a new one takes it


# ---------------------------------------------------------------------------- checkpoints


def _ck_build(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(20, 4), "h": torch.nn.Linear(4, 1)})
    return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)


def _ck_step(m, o, ids):
    loss = m["h"](m["e"](ids)).sum()
    o.zero_grad()
    loss.backward()
    o.step()


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_resumes_bit_identically(tmp_path, fmt):
    ids = torch.tensor([1, 2, 2, 5])
    m, o = _ck_build()
    _ck_step(m, o, ids)
    gl.save_checkpoint(str(tmp_path / "ckpt"), {"model": m, "optimizer": o}, format=fmt)
    assert (tmp_path / "ckpt" / "meta.pt").exists()
    m2, o2 = _ck_build(seed=5)
    gl.load_checkpoint(str(tmp_path / "ckpt"), {"model": m2, "optimizer": o2})
    _ck_step(m, o, ids)
    _ck_step(m2, o2, ids)
    np.testing.assert_array_equal(_np(m["e"].weight), _np(m2["e"].weight))
    assert torch.equal(m["h"].weight, m2["h"].weight)


def test_checkpoint_names_formats_and_flags(tmp_path):
    m, o = _ck_build()
    for name in ("a/b", "", "..", ".", "a\\b", "a\x00b"):
        with pytest.raises(gl.GadgetValueError):
            gl.save_checkpoint(str(tmp_path / "bad"), {name: m})
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(str(tmp_path / "bad"), {"model": m}, progress="yes")
    assert not (tmp_path / "bad").exists()
    mb = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(20, 4, dtype=torch.bfloat16)})
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(str(tmp_path / "bf"), {"model": mb}, format="npy")
    assert not (tmp_path / "bf").exists() or not any((tmp_path / "bf").iterdir())
    gl.save_checkpoint(str(tmp_path / "bf2"), {"model": mb}, format="hdf5")
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m, "optimizer": o})
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": m}, verify="yes")
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"nope": m})


def test_checkpoint_subset_and_missing_file(tmp_path):
    m, o = _ck_build()
    _ck_step(m, o, torch.tensor([1, 2]))
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m, "optimizer": o})
    m3, _o3 = _ck_build(3)
    gl.load_checkpoint(str(tmp_path / "ck"), {"model": m3})
    np.testing.assert_array_equal(_np(m3["e"].weight), _np(m["e"].weight))
    table_files = [p for p in (tmp_path / "ck").iterdir() if p.name.startswith("optimizer")]
    assert table_files
    table_files[0].unlink()
    m4, o4 = _ck_build(4)
    w4, h4 = _np(m4["e"].weight), m4["h"].weight.detach().clone()
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": m4, "optimizer": o4})
    assert isinstance(ei.value, gl.GadgetFileError)
    np.testing.assert_array_equal(w4, _np(m4["e"].weight))
    assert torch.equal(h4, m4["h"].weight)


def test_checkpoint_shape_and_dtype_mismatch_types(tmp_path):
    m, o = _ck_build()
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m})
    m5 = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(21, 4), "h": torch.nn.Linear(4, 1)})
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": m5})
    m6 = torch.nn.ModuleDict(
        {"e": gl.OffloadedEmbedding(20, 4, dtype=torch.float64), "h": torch.nn.Linear(4, 1)}
    )
    before = _np(m6["e"].weight)
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": m6})
    np.testing.assert_array_equal(before, _np(m6["e"].weight))


def test_checkpoint_numpy_options_and_unkeepable_values(tmp_path):
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(10, 4)})
    o = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=np.float32(0.01))
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m, "optimizer": o})
    m2 = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(10, 4)})
    o2 = gl.OffloadedOptimizer(torch.optim.Adam, m2, lr=0.5)
    gl.load_checkpoint(str(tmp_path / "ck"), {"model": m2, "optimizer": o2})
    assert isinstance(o2.param_groups[0]["lr"], np.float32)
    o.param_groups[0]["fn"] = lambda: 0
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(str(tmp_path / "ck2"), {"model": m, "optimizer": o})
    assert not (tmp_path / "ck2").exists() or not any((tmp_path / "ck2").iterdir())


def test_checkpoint_saved_over_keeps_one_set_of_files(tmp_path):
    m, o = _ck_build()
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m, "optimizer": o})
    first = sorted(p.name for p in (tmp_path / "ck").iterdir())
    _ck_step(m, o, torch.tensor([1]))
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m, "optimizer": o})
    second = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert len(first) == len(second)
    assert set(first) & set(second) == {"meta.pt"}


# ---------------------------------------------------------------------------- switchers


class _SkipGram(nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.u_embeddings = nn.Embedding(n, d)
        self.v_embeddings = nn.Embedding(n, d)

    def forward(self, c, p, n):
        u = self.u_embeddings(c)
        v = self.v_embeddings(p)
        nv = self.v_embeddings(n)
        return -(
            nnf.logsigmoid((u * v).sum(-1)).mean()
            + nnf.logsigmoid(-(nv * u.unsqueeze(1)).sum(-1)).mean()
        )


def test_readme_switchers_block_matches_dense_sgd():
    """The switchers block (word2vec-style), small, against one dense table trained the same
    way: with plain SGD lazy per-row updates equal the whole-table result."""
    total_words, d = 50, 8
    torch.manual_seed(0)
    model = _SkipGram(7, d)  # any row count
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with _Quiet():
        u_switch = gl.ModelFactory(model.u_embeddings, total_words, d, CPUPinn=True)
        v_switch = gl.ModelFactory(model.v_embeddings, total_words, d, CPUPinn=True)
        u_switch.uniformDistributionInit(-0.01, 0.01)
        v_switch.zerosInit()
        u_opt = gl.OptimizerFactory(optimizer, total_words, d, model, "u_embeddings", CPUPinn=True)
        v_opt = gl.OptimizerFactory(optimizer, total_words, d, model, "v_embeddings", CPUPinn=True)
    u_opt.optInit()
    v_opt.optInit()
    u0 = np.array(u_switch.getNumpyVersion(), copy=True)
    assert u0.shape == (total_words, d) and np.abs(u0).max() <= 0.01 and u0.std() > 0
    assert (np.asarray(v_switch.getNumpyVersion()) == 0).all()
    ref_u = torch.nn.Parameter(torch.from_numpy(u0.copy()))
    ref_v = torch.nn.Parameter(torch.zeros(total_words, d))
    ref_opt = torch.optim.SGD([ref_u, ref_v], lr=0.5)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
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
        u = ref_u[center]
        v = ref_v[ctx]
        nv = ref_v[neg]
        rl = -(
            nnf.logsigmoid((u * v).sum(-1)).mean()
            + nnf.logsigmoid(-(nv * u.unsqueeze(1)).sum(-1)).mean()
        )
        ref_opt.zero_grad()
        rl.backward()
        ref_opt.step()
    v_now = np.asarray(v_switch.getNumpyVersion())
    assert np.abs(v_now).max() > 0
    np.testing.assert_allclose(
        np.asarray(u_switch.getNumpyVersion()), ref_u.detach().numpy(), rtol=0, atol=1e-6
    )
    np.testing.assert_allclose(v_now, ref_v.detach().numpy(), rtol=0, atol=1e-6)


def test_switcher_files_and_state_dtype(tmp_path):
    """README: saveCupy("emb") writes emb.npy; a switcher's loadCupy refuses another shape or
    dtype before writing; loadTorch refuses another dtype unless every value converts exactly;
    the optimizer switchers have saveTorch/loadTorch and getNumpyVersion (a dict of arrays),
    no saveCupy/loadCupy; their state tables default to float32."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 3, dtype=torch.float64)

    m = M()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    ms = gl.ModelFactory(m.emb, 20, 3, datatype="float64", placement="cpu")
    ost = gl.OptimizerFactory(opt, 20, 3, m, "emb", placement="cpu")
    ost.optInit()
    st = ost.getNumpyVersion()
    assert isinstance(st, dict) and set(st) == {"exp_avg", "exp_avg_sq"}
    assert all(
        np.asarray(v).dtype == np.float32 and np.asarray(v).shape == (20, 3) for v in st.values()
    )
    assert not hasattr(ost, "saveCupy") and not hasattr(ost, "loadCupy")
    ms.normalDistributionInit(0.0, 1.0)
    ms.saveCupy(str(tmp_path / "emb"))
    assert (tmp_path / "emb.npy").exists()
    before = np.array(ms.getNumpyVersion(), copy=True)
    np.save(tmp_path / "bad.npy", np.zeros((21, 3)))
    with pytest.raises(gl.GadgetValueError):
        ms.loadCupy(str(tmp_path / "bad.npy"))
    np.save(tmp_path / "bad32.npy", np.zeros((20, 3), np.float32))
    with pytest.raises(gl.GadgetTypeError):
        ms.loadCupy(str(tmp_path / "bad32.npy"))
    np.testing.assert_array_equal(before, ms.getNumpyVersion())
    ost.saveTorch(str(tmp_path / "st.pt"))
    d = torch.load(str(tmp_path / "st.pt"), weights_only=True)
    assert isinstance(d, dict) and set(d) == {"exp_avg", "exp_avg_sq"}
    p = gl.PytorchModelFactory(nn.Embedding(3, 2), 6, 2, deviceType="cpu")
    p.customInit(torch.nn.init.constant_, 0.25)
    assert (np.asarray(p.getNumpyVersion()) == 0.25).all()
    torch.save(torch.full((6, 2), 0.5, dtype=torch.float64), str(tmp_path / "f64.pt"))
    p.loadTorch(str(tmp_path / "f64.pt"))
    assert (np.asarray(p.getNumpyVersion()) == 0.5).all()
    torch.save(torch.full((6, 2), 0.1, dtype=torch.float64), str(tmp_path / "f64b.pt"))
    with pytest.raises(gl.GadgetTypeError):
        p.loadTorch(str(tmp_path / "f64b.pt"))
    torch.save(torch.zeros(7, 2), str(tmp_path / "shape.pt"))
    with pytest.raises(gl.GadgetValueError):
        p.loadTorch(str(tmp_path / "shape.pt"))
    assert (np.asarray(p.getNumpyVersion()) == 0.5).all()


def test_switcher_changes_refused_during_a_step(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 3)

    m = M()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    ms = gl.ModelFactory(m.emb, 20, 3, placement="cpu")
    ost = gl.OptimizerFactory(opt, 20, 3, m, "emb", placement="cpu")
    ost.optInit()
    ms.normalDistributionInit(0, 1)
    ms.saveCupy(str(tmp_path / "good"))
    before = np.array(ms.getNumpyVersion(), copy=True)
    ids = torch.tensor([1, 5])
    ms.beforeForwardPass(ids)
    ost.beforeForwardPass(ids)
    for call in (
        lambda: ms.loadCupy(str(tmp_path / "good.npy")),
        lambda: ms.zerosInit(),
        lambda: ms.uniformDistributionInit(0, 1),
        lambda: gl.save_checkpoint(str(tmp_path / "ck"), {"s": ms}),
    ):
        with pytest.raises(gl.GadgetValueError):
            call()
    np.testing.assert_array_equal(before, ms.getNumpyVersion())
    loss = m.emb(torch.tensor([0, 1])).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ms.afterOptimizerStep(ids)
    ost.afterOptimizerStep(ids)
    ms.zerosInit()  # allowed again after the step
    assert (np.asarray(ms.getNumpyVersion()) == 0).all()


def test_variable_transformer_dummies_are_int64_numpy():
    ms = gl.ModelSwitch(nn.Embedding(3, 2), 10, 2)
    one = ms.variableTransformer(4, 2)
    assert isinstance(one, np.ndarray) and one.dtype == np.int64
    two = ms.variableTransformer(4, 2, 3)
    assert isinstance(two, tuple) and len(two) == 2
    assert all(isinstance(x, np.ndarray) and x.dtype == np.int64 for x in two)
    assert two[0].shape == (4, 2) and two[1].shape == (4, 3)


def test_pytorch_factory_device_types():
    for dev in ("cpu", torch.device("cpu")):
        p = gl.PytorchModelFactory(nn.Embedding(3, 2), 10, 2, deviceType=dev)
        assert "placement='cpu'" in repr(p)


# ---------------------------------------------------------------------------- errors section


def test_error_hierarchy():
    pairs = [
        (gl.GadgetIndexError, IndexError),
        (gl.GadgetTypeError, TypeError),
        (gl.GadgetValueError, ValueError),
        (gl.GadgetKeyError, KeyError),
        (gl.GadgetFileNotFoundError, FileNotFoundError),
        (gl.ReadOnlyError, PermissionError),
        (gl.MissingDependencyError, ImportError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, gl.GadgetError) and issubclass(cls, builtin)
    assert issubclass(gl.GadgetFileNotFoundError, gl.GadgetFileError)
    assert issubclass(gl.GadgetClosedError, gl.GadgetError)
    assert issubclass(gl.FallbackWarning, Warning)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget((3, 2), placement="bogus")
    for p in ("cpu", "cuda", "file", "pinned"):
        assert p in str(ei.value)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget((3, 2), placement="cpu", strategy="bogus")
    for s in ("auto", "kernel", "sorted", "hybrid", "torch"):
        assert s in str(ei.value)


def test_unexpected_options_for_memory_placement():
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((3, 2), placement="cpu", writable=False)


def test_array_source_dtype_cast_rules():
    assert gl.DataGadget(np.ones((2, 2)), dtype="float32", placement="cpu").dtype == torch.float32
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.ones((2, 2)), dtype="int32", placement="cpu")
    assert gl.DataGadget([[1, 2], [3, 4]], placement="cpu").dtype == torch.int64


# ---------------------------------------------------------------------------- more claims


def test_load_checkpoint_kind_mismatch_is_a_type_error(tmp_path):
    """README (Checkpoints): load_checkpoint checks every object against the checkpoint
    (names, kinds, table files, shapes, dtypes, ...) before changing any: 'a
    GadgetValueError for shapes and entries, a GadgetTypeError for dtypes and kinds'.
    An OffloadedOptimizer given for a saved module (and a module for a saved optimizer)
    is a kind mismatch."""
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(20, 4)})
    o = gl.OffloadedOptimizer(torch.optim.Adam, m)
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m, "optimizer": o})
    m2 = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(20, 4)})
    o2 = gl.OffloadedOptimizer(torch.optim.Adam, m2)
    before = _np(m2["e"].weight)
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": o2})
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(str(tmp_path / "ck"), {"optimizer": m2})
    np.testing.assert_array_equal(before, _np(m2["e"].weight))


def test_load_checkpoint_unsupported_object_error_names_load_checkpoint(tmp_path):
    """An error should say what was expected of the call that was made: load_checkpoint
    given an object it cannot load should not speak of save_checkpoint."""
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(20, 4)})
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m})
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.load_checkpoint(str(tmp_path / "ck"), {"model": 5})
    msg = str(ei.value)
    assert "int" in msg
    assert "save_checkpoint" not in msg, msg


def test_window_options_do_not_change_random_or_sequential_orders():
    """README: window_chunks and chunk_rows shape only the chunk order: "random" and
    "sequential" check them but are unchanged by them."""
    a = [b.clone() for b in gl.GadgetSampler(100, batch_size=10, order="random", seed=0)]
    b = [
        b.clone()
        for b in gl.GadgetSampler(
            100, batch_size=10, order="random", seed=0, window_chunks=3, chunk_rows=7
        )
    ]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False)) and len(a) == len(b)
    s = [
        b.tolist()
        for b in gl.GadgetSampler(
            30, batch_size=10, order="sequential", window_chunks=3, chunk_rows=7
        )
    ]
    assert s == [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    for kw in (dict(window_chunks=0), dict(chunk_rows=0)):
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetSampler(100, batch_size=10, **kw)


def test_gadgetloader_follows_its_samplers_set_epoch():
    ds = gl.GadgetDataset(np.arange(100, dtype=np.float32).reshape(100, 1))
    s = gl.GadgetSampler(ds, batch_size=10, seed=0)
    s.set_epoch(5)
    ref = [x.clone() for x in s]
    s.set_epoch(5)
    got = [_cpu(x).flatten().long() for (x,) in gl.GadgetLoader(ds, sampler=s)]
    assert len(got) == 10 and all(torch.equal(a, b) for a, b in zip(ref, got, strict=False))


def test_file_dataset_in_dataloader_workers(tmp_path):
    """README: a file gadget pickles as its file name and each worker reopens the file; in a
    worker getData delivers rows on the CPU."""
    a = np.arange(200, dtype=np.float32).reshape(100, 2)
    np.save(tmp_path / "wk.npy", a)
    fds = gl.GadgetDataset(gl.DataGadget(str(tmp_path / "wk.npy"), placement="file"))
    dl = DataLoader(fds, batch_sampler=gl.GadgetSampler(fds, batch_size=10, seed=0), num_workers=2)
    res = [x for (x,) in dl]
    assert all(x.device.type == "cpu" for x in res)
    got = torch.cat(res).numpy()
    np.testing.assert_array_equal(got[np.argsort(got[:, 0])], a)


def test_switchers_in_checkpoints(tmp_path):
    """README: save_checkpoint refuses a model passed without the switchers that page it
    before anything is written; with them, a freshly built model and switchers load it."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 3)
            self.lin = nn.Linear(3, 1)

    def build():
        m = M()
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        ms = gl.ModelFactory(m.emb, 20, 3, placement="cpu")
        ost = gl.OptimizerFactory(opt, 20, 3, m, "emb", placement="cpu")
        ost.optInit()
        return m, opt, ms, ost

    torch.manual_seed(0)
    m, opt, ms, ost = build()
    ms.normalDistributionInit(0, 1)
    ids = torch.tensor([1, 5])
    local = ms.beforeForwardPass(ids)
    ost.beforeForwardPass(ids)
    loss = m.lin(m.emb(local)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ms.afterOptimizerStep(ids)
    ost.afterOptimizerStep(ids)
    with pytest.raises(gl.GadgetValueError):
        gl.save_checkpoint(str(tmp_path / "bad"), {"model": m})
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
    gl.save_checkpoint(str(tmp_path / "ck"), {"model": m, "sw": ms, "osw": ost, "opt": opt})
    m2, opt2, ms2, ost2 = build()
    gl.load_checkpoint(str(tmp_path / "ck"), {"model": m2, "sw": ms2, "osw": ost2, "opt": opt2})
    np.testing.assert_array_equal(
        np.asarray(ms.getNumpyVersion()), np.asarray(ms2.getNumpyVersion())
    )
    s1, s2 = ost.getNumpyVersion(), ost2.getNumpyVersion()
    assert set(s1) == set(s2) and all(np.array_equal(s1[k], s2[k]) for k in s1)
    assert torch.equal(m.lin.weight, m2.lin.weight)


def test_step_counts_follow_lookups():
    """README: a table with no lookup since the last step is not stepped and its step count
    does not move; an empty lookup with a backward counts a step and changes no row."""
    m = torch.nn.ModuleDict({"a": gl.OffloadedEmbedding(10, 4), "b": gl.OffloadedEmbedding(10, 4)})
    o = gl.OffloadedOptimizer(torch.optim.Adam, m)
    wb = _np(m["b"].weight)
    m["a"](torch.tensor([1])).sum().backward()
    o.step()
    np.testing.assert_array_equal(wb, _np(m["b"].weight))

    def step_counts():
        found = []

        def walk(x):
            if isinstance(x, dict):
                for k, v in x.items():
                    if k == "step":
                        found.append(float(v))
                    else:
                        walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(o.state_dict())
        return sorted(found)

    assert step_counts() in ([1.0], [0.0, 1.0])
    wa = _np(m["a"].weight)
    out = m["a"](torch.tensor([], dtype=torch.long))
    assert out.shape == (0, 4)
    out.sum().backward()
    o.step()
    np.testing.assert_array_equal(wa, _np(m["a"].weight))
    assert max(step_counts()) == 2.0


def test_freeze_through_weight_requires_grad_and_half():
    e = gl.OffloadedEmbedding(10, 4)
    e.weight.requires_grad = False
    assert not e(torch.tensor([1])).requires_grad
    h = gl.OffloadedEmbedding(10, 4).half()
    assert h(torch.tensor([1])).dtype == torch.float16 and h.weight.dtype == torch.float32


def test_readme_big_h5_file_table_block(tmp_path):
    """README: g = gl.DataGadget("big.h5", placement="file", cache_bytes=2 << 30) -- rows stay
    in the file; getData reads the chunks holding the ids; insertData writes through."""
    a = np.arange(400, dtype=np.float32).reshape(100, 4)
    with h5py.File(tmp_path / "big.h5", "w") as f:
        f.create_dataset("data", data=a, chunks=(16, 4), compression="gzip")
    g = gl.DataGadget(str(tmp_path / "big.h5"), placement="file", cache_bytes=2 << 30)
    assert g.placement == "file" and g.shape == (100, 4)
    ids = np.array([[99, 0], [17, 17]])
    np.testing.assert_array_equal(_cpu(g.getData(ids)).numpy(), a[ids])
    g.insertData(torch.full((1, 4), -3.0), [50])
    g.flush()
    with h5py.File(tmp_path / "big.h5", "r") as f:
        np.testing.assert_array_equal(f["data"][50], [-3, -3, -3, -3])
        np.testing.assert_array_equal(f["data"][49], a[49])
    g.close()
