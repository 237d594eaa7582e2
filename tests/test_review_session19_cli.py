"""Session 19 review probes: the command line a new user meets first (README "Install and
try", `gadgetloader info` / `bench` / `convert`, `python -m datasets.word2vec`).

Every probe runs the real command in a subprocess with tiny sizes (CPU only) and checks
its exit status, its output and the files it writes against NumPy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# tiny sizes for each suite, so every run takes a few seconds on the CPU
SEED = ["--rows", "100", "--width", "4", "--ids", "10", "--repeats", "1"]
FILES = ["--mb", "1", "--random-mb", "1", "--ids", "16", "--repeats", "1"]
PIPE = [
    "--rows", "512", "--width", "4", "--batch", "64", "--batches", "2",
    "--seconds", "0.05", "--repeats", "1", "--workers", "0",
]  # fmt: skip
TRAIN = [
    "--rows", "200", "--dim", "4", "--batch", "8", "--negatives", "1", "--steps", "1",
    "--warmup", "0", "--repeats", "1", "--memcpy-mib", "1",
]  # fmt: skip


def gl_process(
    *args: str, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """``python -m gadgetloader ARGS`` as a user runs it, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "gadgetloader", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def gl(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """The console script's ``main(ARGS)`` in this process (each new process costs ~3 s
    of imports): its exit status (argparse's ``SystemExit`` included), stdout and stderr.
    The probes that need a process of their own (signals, a clean interpreter) use
    :func:`gl_process`."""
    import contextlib
    import io
    import warnings

    from gadgetloader.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("default")  # as a user's interpreter shows them
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def w2v(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m datasets.word2vec ARGS`` from the repository root, as the README says."""
    return subprocess.run(
        [sys.executable, "-m", "datasets.word2vec", *args, "--no-progress"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def error_lines(stderr: str) -> list[str]:
    """stderr without the placement fallback warning (documented: one warning on the CPU)."""
    return [
        ln
        for ln in stderr.splitlines()
        if ln.strip() and "FallbackWarning" not in ln and "resolve_" not in ln
    ]


def assert_one_line_error(p: subprocess.CompletedProcess, *words: str) -> None:
    """A refused command: non-zero exit, no traceback, the error said in one line that names
    what was wrong, and no results printed."""
    assert p.returncode != 0, (p.returncode, p.stdout[-500:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    errs = [ln for ln in error_lines(p.stderr) if not ln.startswith(("usage:", " "))]
    assert len(errs) == 1, p.stderr
    assert "error" in errs[0], errs
    for w in words:
        assert w in errs[0], (w, errs[0])
    assert "|" not in p.stdout, p.stdout  # no results table


# ---------------------------------------------------------------------------- info


def test_info_no_measure_reports_installed_versions():
    p = gl("info", "--no-measure")
    assert p.returncode == 0, p.stderr
    assert torch.__version__ in p.stdout
    assert np.__version__ in p.stdout
    assert "cuda_available" in p.stdout


def test_info_json_matches_this_environment(tmp_path):
    out = tmp_path / "info.json"
    p = gl("info", "--no-measure", "--json", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert data["torch"] == torch.__version__
    assert data["numpy"] == np.__version__
    assert data["cuda_available"] is torch.cuda.is_available()


@pytest.mark.parametrize("where", ["/nonexistent_dir_r19/info.json", "DIR"])
def test_info_json_unwritable_is_one_line_error(tmp_path, where):
    target = str(tmp_path) if where == "DIR" else where
    p = gl("info", "--no-measure", "--json", target)
    assert p.returncode == 2
    assert_one_line_error(p, "--json")
    assert "gadgetloader: 0.1.0" not in p.stdout  # refused before collecting anything


def test_no_command_and_unknown_command_exit_2():
    for args in ([], ["bogus"], ["bench", "bogus"]):
        p = gl_process(*args)  # the real `python -m gadgetloader`
        assert p.returncode == 2, (args, p.returncode)
        assert "Traceback" not in p.stderr


def test_console_script_matches_python_m():
    """README: `gadgetloader info` (the console script of pyproject's [project.scripts])."""
    exe = shutil.which("gadgetloader", path=str(Path(sys.executable).parent)) or shutil.which(
        "gadgetloader"
    )
    if exe is None:
        import importlib.metadata

        try:
            importlib.metadata.distribution("gadgetloader")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("gadgetloader is not installed here (run from a source tree)")
    assert exe is not None, "the gadgetloader entry point is not on PATH"
    p = subprocess.run([exe, "info", "--no-measure"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert torch.__version__ in p.stdout


# ---------------------------------------------------------------------------- bench seed


def test_bench_without_suite_is_seed_and_writes_checked_json(tmp_path):
    out = tmp_path / "s.json"
    p = gl("bench", *SEED, "--json", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "seed"
    assert (data["rows"], data["width"], data["ids"]) == (100, 4, 10)
    assert data["bytes_moved"] == 10 * 4 * 4
    assert data["results"], data
    checked = [r for r in data["results"] if "check" in r]  # (limit rows carry no check)
    assert checked and all(r["check"] == "ok" for r in checked), data["results"]
    if not torch.cuda.is_available():  # README: "times the CPU methods and lists what it skipped"
        assert "skipped" in p.stdout


def test_bench_seed_suite_name_same_as_default(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert gl("bench", *SEED, "--json", str(a)).returncode == 0
    assert gl("bench", "seed", *SEED, "--json", str(b)).returncode == 0
    ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
    assert [r["method"] for r in ja["results"]] == [r["method"] for r in jb["results"]]


@pytest.mark.parametrize("dtype", ["float", "int", "byte", "char", "bool", "bfloat16"])
def test_bench_seed_dtype_names_as_readme(tmp_path, dtype):
    """README: 'float' is float32, 'int' int32, 'byte' uint8, 'char' int8."""
    want = {"float": "float32", "int": "int32", "byte": "uint8", "char": "int8"}.get(dtype, dtype)
    out = tmp_path / "s.json"
    p = gl("bench", *SEED, "--dtype", dtype, "--json", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert data["dtype"] == want
    checked = [r for r in data["results"] if "check" in r]  # (limit rows carry no check)
    assert checked and all(r["check"] == "ok" for r in checked)


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--rows", "0"], "--rows"),
        (["--rows", "-5"], "--rows"),
        (["--rows", "1e3"], "--rows"),
        (["--width", "0"], "--width"),
        (["--ids", "0"], "--ids"),
        (["--repeats", "0"], "--repeats"),
        (["--seed", "-1"], "--seed"),
        (["--dtype", "bogus"], "--dtype"),
        (["--dtype", "complex64"], "--dtype"),
    ],
)
def test_bench_seed_bad_argument_one_line(bad, word):
    p = gl("bench", *SEED, *bad)
    assert_one_line_error(p, word)


def test_bench_seed_rows_beyond_int64_one_line_error():
    """Sizes beyond this machine are 'not enough memory ... choose smaller sizes' (cli.py);
    a --rows beyond int64 crashes with torch's overflow traceback instead."""
    p = gl("bench", *SEED, "--rows", str(10**24))
    assert_one_line_error(p)


def test_bench_seed_too_large_seed_one_line_error():
    """`bench pipeline --seed 2**70` is a one-line error ('seed must be below 2**64');
    `bench seed` crashes with a traceback from torch.Generator.manual_seed."""
    p = gl("bench", *SEED, "--seed", str(2**64))
    assert_one_line_error(p, "seed")


def test_bench_options_before_suite_refused():
    p = gl("bench", "--rows", "10", "files")
    assert p.returncode == 2
    assert_one_line_error(p, "before the suite name")


def test_bench_json_checked_before_run():
    """README: `--json` paths are checked before the run."""
    t = time.perf_counter()
    p = gl("bench", "seed", "--json", "/nonexistent_dir_r19/x.json")  # default sizes: slow
    assert p.returncode == 2
    assert_one_line_error(p, "--json")
    assert time.perf_counter() - t < 15


# ---------------------------------------------------------------------------- bench sweep


def test_bench_sweep_on_cpu_skips_and_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour")
    out, png = tmp_path / "sw.json", tmp_path / "sw.png"
    p = gl("bench", "sweep", "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert "needs a CUDA device" in p.stdout
    data = json.loads(out.read_text())
    assert data["results"] == [] and data["skipped"]
    assert not png.exists()


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--sizes-gb", "abc"], "--sizes-gb"),
        (["--sizes-gb", "0"], "--sizes-gb"),
        (["--sizes-gb", "nan"], "--sizes-gb"),
        (["--widths", "1.5"], "--widths"),
        (["--ids", "0"], "--ids"),
        (["--strategies", "bogus"], "--strategies"),
        (["--hybrid-fractions", "2"], "--hybrid-fractions"),
        (["--pages", "bogus"], "--pages"),
        (["--repeats", "0"], "--repeats"),
        (["--naive-max-ids", "-1"], "--naive-max-ids"),
        (["--plot", "/nonexistent_dir_r19/p.png"], "--plot"),
    ],
)
def test_bench_sweep_bad_argument_one_line(bad, word):
    """Refused even on a machine without CUDA, before the sweep would be skipped."""
    p = gl("bench", "sweep", *bad)
    assert_one_line_error(p, word)


# ---------------------------------------------------------------------------- bench files


def test_bench_files_tiny_checks_against_numpy_and_cleans_up(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep me")
    out = tmp_path / "f.json"
    p = gl("bench", "files", *FILES, "--dir", str(folder), "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "all results checked against NumPy: True" in p.stdout
    json.loads(out.read_text())
    assert sorted(os.listdir(folder)) == ["mine.txt"]  # its own files gone, the user's kept
    assert (folder / "mine.txt").read_text() == "keep me"


def test_bench_files_keep_keeps_readable_files(tmp_path):
    p = gl("bench", "files", *FILES, "--formats", "npy", "--dir", str(tmp_path), "--keep")
    assert p.returncode == 0, p.stderr
    kept = list(tmp_path.rglob("*.npy"))
    assert kept, os.listdir(tmp_path)
    for f in kept:
        a = np.load(f)
        assert a.dtype == np.float32 and a.shape[1] == 128


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--mb", "0"], "--mb"),
        (["--mb", "nan"], "--mb"),
        (["--gb", "0"], "--gb"),
        (["--width", "0"], "--width"),
        (["--dir", "/nonexistent_dir_r19/d"], "--dir"),
        (["--formats", "bogus"], "--formats"),
        (["--chunk-rows", "0"], "--chunk-rows"),
        (["--compression", "bogus"], "--compression"),
        (["--cache-mb", "0"], "--cache-mb"),
        (["--ids", "0"], "--ids"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_bench_files_bad_argument_one_line(bad, word):
    p = gl("bench", "files", *FILES, *bad)
    assert_one_line_error(p, word)


def test_bench_files_dir_that_is_a_file(tmp_path):
    f = tmp_path / "plain.txt"
    f.write_text("x")
    p = gl("bench", "files", *FILES, "--dir", str(f))
    assert_one_line_error(p, "--dir")
    assert f.read_text() == "x"


# ---------------------------------------------------------------------------- bench pipeline


def test_bench_pipeline_tiny_all_checked(tmp_path):
    out = tmp_path / "p.json"
    p = gl("bench", "pipeline", *PIPE, "--json", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    rows = [r for r in data["results"] if "check" in r]
    assert rows and all(r["check"] == "ok" for r in rows), rows


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--width", "2"], "--width"),
        (["--dtype", "bogus"], "--dtype"),
        (["--batch", "0"], "--batch"),
        (["--seconds", "nan"], "--seconds"),
        (["--workers", "-1"], "--workers"),
        (["--workers", "abc"], "--workers"),
        (["--sources", "bogus"], "--sources"),
        (["--prefetch", "-1"], "--prefetch"),
        (["--coalesce", "0"], "--coalesce"),
        (["--dir", "/nonexistent_dir_r19"], "--dir"),
        (["--seed", str(2**70)], "seed"),
    ],
)
def test_bench_pipeline_bad_argument_one_line(bad, word):
    p = gl("bench", "pipeline", *PIPE, *bad)
    assert_one_line_error(p, word)


# ---------------------------------------------------------------------------- bench train


def test_bench_train_tiny_checked(tmp_path):
    out = tmp_path / "t.json"
    p = gl("bench", "train", *TRAIN, "--json", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"gpu", "speedtorch", "switchers", "dropin", "resident"}
    assert "checked" in p.stdout and "False" not in p.stdout


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--placement", "file"], "--placement"),
        (["--methods", "bogus"], "--methods"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--zipf", "nan"], "--zipf"),
        (["--steps", "0"], "--steps"),
        (["--profile", "/nonexistent_dir_r19/p.txt"], "--profile"),
    ],
)
def test_bench_train_bad_argument_one_line(bad, word):
    p = gl("bench", "train", *TRAIN, *bad)
    assert_one_line_error(p, word)


@pytest.mark.parametrize("seed", [2**64 - 1, 2**64])
def test_bench_train_large_seed_one_line_error_or_runs(seed):
    """`--seed` takes any whole number >= 0 (help: `--seed SEED`); `bench seed` accepts 2**64-1
    and `bench pipeline` says 'seed must be below 2**64'. `bench train` crashes with
    torch's 'Overflow when unpacking long long' traceback for both."""
    p = gl("bench", "train", *TRAIN, "--methods", "dropin", "--seed", str(seed))
    assert "Traceback" not in p.stderr, p.stderr[-800:]
    if p.returncode != 0:
        assert_one_line_error(p, "seed")


# ---------------------------------------------------------------------------- convert


@pytest.fixture
def emb(tmp_path):
    a = np.arange(60, dtype=np.float32).reshape(20, 3)
    np.save(tmp_path / "emb.npy", a)
    return a


def test_convert_readme_npy_to_gzip_hdf5(tmp_path, emb):
    h5py = pytest.importorskip("h5py")
    p = gl("convert", "emb.npy", "emb.h5", "--chunk-rows", "4096", "--compression", "gzip",
           cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    with h5py.File(tmp_path / "emb.h5", "r") as f:
        (name,) = list(f.keys())
        assert f[name].compression == "gzip"
        np.testing.assert_array_equal(f[name][...], emb)


def test_convert_readme_hdf5_dataset_to_zarr_and_back(tmp_path):
    h5py = pytest.importorskip("h5py")
    pytest.importorskip("zarr")
    words = np.arange(40, dtype=np.int64).reshape(10, 4)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("emb/words", data=words)
        f.create_dataset("other", data=np.ones(3))
    p = gl("convert", "data.h5", "emb.zarr", "--dataset", "emb/words", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    p = gl("convert", "emb.zarr", "back.npy", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    back = np.load(tmp_path / "back.npy")
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, words)


def test_convert_hdf5_with_two_datasets_needs_dataset(tmp_path):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("a", data=np.ones((2, 2)))
        f.create_dataset("b", data=np.ones((2, 2)))
    p = gl("convert", "data.h5", "o.npy", cwd=tmp_path)
    assert_one_line_error(p, "--dataset")
    assert not (tmp_path / "o.npy").exists()


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_convert_onto_its_source_refused_and_source_unchanged(tmp_path, emb, how):
    dst = tmp_path / "emb.npy"
    if how == "symlink":
        dst = tmp_path / "link.npy"
        dst.symlink_to(tmp_path / "emb.npy")
    elif how == "hardlink":
        dst = tmp_path / "hard.npy"
        os.link(tmp_path / "emb.npy", dst)
    p = gl("convert", "emb.npy", dst.name, cwd=tmp_path)
    assert_one_line_error(p, "same file")
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), emb)


@pytest.mark.parametrize(
    "args,word",
    [
        (["missing.npy", "o.h5"], "missing.npy"),
        (["emb.npy", "o.txt"], "format"),
        (["emb.npy", "o.h5", "--chunk-rows", "0"], "--chunk-rows"),
        (["emb.npy", "o.h5", "--compression", "bogus"], "compression"),
        (["emb.npy", "o.zarr", "--compression", "lzf"], "compression"),
        (["emb.npy", "o.npy", "--compression", "gzip"], "--compression"),
        (["emb.npy", "o.h5", "--format", "bogus"], "bogus"),
        (["emb.npy", "o.h5", "--dataset", "x"], "dataset"),
        (["emb.npy", "o.npy", "--dst-dataset", "x"], "--dst-dataset"),
        (["emb.npy", "o.h5", "--dst-dataset", "a/../b"], "a/../b"),
        (["emb.npy", "/nonexistent_dir_r19/o.h5"], "/nonexistent_dir_r19"),
    ],
)
def test_convert_bad_input_one_line_nothing_written(tmp_path, emb, args, word):
    pytest.importorskip("h5py")
    pytest.importorskip("zarr")
    before = sorted(os.listdir(tmp_path))
    p = gl("convert", *args, cwd=tmp_path)
    assert_one_line_error(p, word)
    assert sorted(os.listdir(tmp_path)) == before


def test_convert_onto_a_directory_refused(tmp_path, emb):
    (tmp_path / "d.npy").mkdir()
    (tmp_path / "d.npy" / "x").write_text("mine")
    p = gl("convert", "emb.npy", "d.npy", cwd=tmp_path)
    assert_one_line_error(p, "directory")
    assert (tmp_path / "d.npy" / "x").read_text() == "mine"


@pytest.mark.parametrize(
    "arr,word",
    [
        (np.zeros((0, 4), np.float32), "zero rows"),
        (np.ones((3, 2), np.complex64), "complex"),
        (np.float32(3), "scalar"),
    ],
)
def test_convert_untable_arrays_refused(tmp_path, arr, word):
    pytest.importorskip("h5py")
    np.save(tmp_path / "a.npy", arr)
    p = gl("convert", "a.npy", "a.h5", cwd=tmp_path)
    assert_one_line_error(p, word)
    assert not (tmp_path / "a.h5").exists()


def test_convert_fortran_order_and_1d_roundtrip(tmp_path):
    pytest.importorskip("h5py")
    pytest.importorskip("zarr")
    f = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    v = np.arange(5, dtype=np.int16)
    np.save(tmp_path / "f.npy", f)
    np.save(tmp_path / "v.npy", v)
    for src, ref in (("f", f), ("v", v)):
        for mid in ("h5", "zarr"):
            assert gl("convert", f"{src}.npy", f"{src}.{mid}", cwd=tmp_path).returncode == 0
            p = gl("convert", f"{src}.{mid}", f"{src}_{mid}.npy", cwd=tmp_path)
            assert p.returncode == 0, p.stderr
            back = np.load(tmp_path / f"{src}_{mid}.npy")
            assert back.dtype == ref.dtype
            np.testing.assert_array_equal(back, ref)


def test_convert_interrupt_exits_130_and_leaves_no_partial(tmp_path):
    """README: an interrupt during `convert` removes the partial file; the previous
    destination stays whole."""
    pytest.importorskip("h5py")
    rng = np.random.default_rng(0)
    a = np.lib.format.open_memmap(tmp_path / "big.npy", mode="w+", dtype=np.float32,
                                  shape=(1_000_000, 32))  # fmt: skip
    a[:] = rng.random((1_000_000, 32), dtype=np.float32)
    a.flush()
    del a
    old = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "old.npy", old)
    assert gl("convert", "old.npy", "big.h5", cwd=tmp_path).returncode == 0
    before = (tmp_path / "big.h5").read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gadgetloader", "convert", "big.npy", "big.h5",
         "--compression", "gzip", "--no-progress"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # (a loaded machine may take many seconds to import torch: interrupt only once the
    # conversion has started writing, never during start-up)
    deadline = time.monotonic() + 120
    started = False
    while time.monotonic() < deadline and proc.poll() is None:
        if any(n.startswith(".big.h5.partial") for n in os.listdir(tmp_path)):
            started = True
            break
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.skip("the conversion finished before it could be interrupted")
    assert started, "the conversion did not start writing within 120 s"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    assert "interrupted" in err
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]
    assert (tmp_path / "big.h5").read_bytes() == before


# ---------------------------------------------------------------------------- word2vec


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    royal = ["king", "queen", "prince", "princess", "royal", "crown", "palace", "throne"]
    fruit = ["apple", "banana", "fruit", "orange", "juice", "sweet", "pear", "plum"]
    lines = [" ".join(rng.choice(royal if i % 2 else fruit, size=10)) for i in range(1500)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_word2vec_readme_command(tmp_path, corpus):
    """README: python -m datasets.word2vec corpus.txt --dim 128 --epochs 1 --out vectors
    --show king (--show words lower-cased, unknown ones reported)."""
    out = tmp_path / "vectors"
    p = w2v(str(corpus), "--dim", "128", "--epochs", "1", "--out", str(out),
            "--show", "King,nosuchword")  # fmt: skip
    assert p.returncode == 0, p.stderr
    vec = np.load(f"{out}.npy")
    vocab = Path(f"{out}.vocab.txt").read_text().split("\n")
    vocab = [ln for ln in vocab if ln.strip()]
    assert vec.shape == (16, 128) and vec.dtype == np.float32
    assert len(vocab) == 16
    assert np.isfinite(vec).all()
    lines = p.stdout.splitlines()
    king = [ln for ln in lines if ln.startswith("king:")]
    assert king, p.stdout
    assert any(ln.startswith("nosuchword") and "not in the vocabulary" in ln for ln in lines)
    # related words ranked first after one epoch (README)
    royal = {"queen", "prince", "princess", "royal", "crown", "palace", "throne"}
    top = [w.split(" (")[0].strip() for w in king[0].split(":", 1)[1].split(",")]
    assert set(top[:3]) <= royal, king


@pytest.mark.parametrize(
    "bad,word",
    [
        (["--lr", "inf"], "--lr"),
        (["--seed", "-1"], "--seed"),
        (["--dim", "0"], "--dim"),
        (["--epochs", "abc"], "--epochs"),
        (["--out", "/nonexistent_dir_r19/vec"], "--out"),
        (["--out", "OUTDIR"], "--out"),
    ],
)
def test_word2vec_bad_argument_one_line_before_training(tmp_path, corpus, bad, word):
    bad = [str(tmp_path) if b == "OUTDIR" else b for b in bad]
    before = sorted(os.listdir(tmp_path))
    p = w2v(str(corpus), *bad)
    assert_one_line_error(p, word)
    assert "loss" not in p.stdout
    assert sorted(os.listdir(tmp_path)) == before


def test_word2vec_missing_or_tiny_corpus(tmp_path):
    p = w2v(str(tmp_path / "missing.txt"))
    assert_one_line_error(p, "missing.txt")
    one = tmp_path / "one.txt"
    one.write_text("word word word\n")
    p = w2v(str(one), "--out", str(tmp_path / "v"))
    assert_one_line_error(p, "distinct")
    assert not (tmp_path / "v.npy").exists()


# ---- fixes made after the review ----------------------------------------------------------------
@pytest.mark.parametrize("suite", ["seed", "files", "pipeline", "train"])
def test_every_suite_bounds_its_seed_in_one_line(suite: str) -> None:
    r = gl("bench", suite, "--seed", str(2**62 + 1))
    assert r.returncode == 2
    assert "--seed" in r.stderr and "at most 4611686018427387904" in r.stderr
    assert "Traceback" not in r.stderr


def test_counts_beyond_int64_are_one_line_errors() -> None:
    r = gl("bench", "seed", "--ids", str(2**63))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "at most 9223372036854775807" in r.stderr


@pytest.mark.parametrize("bad", ["kernel-bogus", "kernel-u0", "kernel-u17", "kernel-v3", "kernel-"])
def test_sweep_refuses_malformed_kernel_variants(bad: str) -> None:
    r = gl("bench", "sweep", "--strategies", f"kernel,{bad}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"{bad!r} is no kernel variant" in r.stderr


def test_files_default_formats_skip_missing_libraries_but_named_ones_do_not(tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = "
        "lambda name, *a: None if name in ('h5py', 'zarr') else real(name, *a)\n"
        "from gadgetloader.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "bench", "files", *FILES, "--json", str(tmp_path / "f.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "skipped: hdf5: h5py is not installed" in r.stdout
    assert "skipped: zarr: zarr is not installed" in r.stdout
    report = json.loads((tmp_path / "f.json").read_text())
    assert [w["format"] for w in report["write"]] == ["npy"]
    assert len(report["skipped"]) == 2 and report["checks_passed"] is True
