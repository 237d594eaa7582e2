"""Black-box review (session 31) of the command line (`python -m gadgetloader` info / bench
seed, sweep, files, pipeline, train / convert, and `python -m datasets.word2vec`); written
from README.md, SPEC.md and the public docstrings only.

Runs that do real work (benchmarks, training, an interrupted convert) are real
subprocesses started together in a thread pool when the module starts; argument
validation and most `convert` runs are run in-process through `runpy` (exactly what
`python -m` does), which keeps the file well under its time budget on a 2-core machine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import importlib.util
import io
import json
import math
import os
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import gadgetloader as gl

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")
SEED_MAX = 2**62

try:
    import h5py
except ImportError:  # pragma: no cover
    h5py = None
try:
    import zarr
except ImportError:  # pragma: no cover
    zarr = None
try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:  # pragma: no cover
    HAVE_MPL = False

needs_h5 = pytest.mark.skipif(h5py is None, reason="h5py not installed")
needs_zarr = pytest.mark.skipif(zarr is None, reason="zarr not installed")


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


# --------------------------------------------------------------------------- helpers


def cli(module, *args):
    """Run `python -m module args` in this process; returns rc, out, err, warnings."""
    if module == "datasets.word2vec":
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        spec = importlib.util.find_spec("datasets")
        if spec is None or not str(spec.origin).startswith(str(REPO)):
            pytest.skip("another `datasets` package shadows the repository's")
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv[:]
    sys.argv = ["prog", *map(str, args)]
    rc = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code is None:
                rc = 0
            elif isinstance(e.code, int):
                rc = e.code
            else:
                err.write(str(e.code) + "\n")
                rc = 1
        except BaseException:  # an escaped exception is what a user sees as a traceback
            err.write(traceback.format_exc())
            rc = "exception"
        finally:
            sys.argv = old_argv
    return SimpleNamespace(
        rc=rc, out=out.getvalue(), err=err.getvalue(), warnings=[str(w.message) for w in caught]
    )


def gl_cli(*args):
    return cli("gadgetloader", *args)


# tiny sizes placed before the option under test (argparse keeps the last value), so that a
# value the library failed to refuse would still run a small benchmark, never the default one
TINY = {
    "seed": ["--rows", "64", "--width", "4", "--ids", "8", "--repeats", "1"],
    "sweep": [
        "--sizes-gb",
        "0.001",
        "--widths",
        "8",
        "--ids",
        "16",
        "--repeats",
        "1",
        "--naive-max-ids",
        "0",
    ],
    "files": ["--mb", "0.05", "--random-mb", "0.05", "--ids", "8", "--repeats", "1"],
    "pipeline": [
        "--rows",
        "64",
        "--width",
        "4",
        "--batch",
        "8",
        "--batches",
        "1",
        "--seconds",
        "0.05",
        "--repeats",
        "1",
        "--workers",
        "0",
    ],
    "train": [
        "--rows",
        "100",
        "--dim",
        "4",
        "--batch",
        "8",
        "--negatives",
        "1",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--memcpy-mib",
        "1",
    ],
}


def bench(suite, *args):
    """`gadgetloader bench [suite] TINY... args` in-process ('' = no suite name: seed)."""
    return gl_cli("bench", *([suite] if suite else []), *TINY[suite or "seed"], *map(str, args))


def w2v(*args):
    return cli("datasets.word2vec", *args)


def sub(args, cwd=REPO, timeout=85, **kw):
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def error_lines(text):
    return [ln for ln in text.splitlines() if "error:" in ln]


def assert_one_line_error(r, *fragments):
    """A refused command: nonzero status, one 'error:' line naming `fragments`, no traceback."""
    assert r.rc != 0 and r.rc != "exception", (r.rc, r.err[-2000:])
    assert "Traceback" not in r.err, r.err[-2000:]
    lines = error_lines(r.err)
    assert len(lines) == 1, r.err
    for f in fragments:
        assert f.lower() in lines[0].lower(), (f, lines[0])
    # nothing measured or trained before the refusal
    assert "|" not in r.out and "loss" not in r.out, r.out


def md_tables(text):
    """Markdown tables printed by the CLI, each a list of {column: cell} dicts."""
    tables, cur, header = [], None, None
    for ln in text.splitlines():
        if not ln.startswith("|"):
            cur = header = None
            continue
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if header is None:
            header, cur = cells, []
            tables.append(cur)
        elif set("".join(cells)) <= set("-: "):
            continue
        else:
            cur.append(dict(zip(header, cells, strict=True)))
    return tables


def same(printed, value, rel=0.011):
    if printed in ("-", "n/a"):
        return value is None
    if value is None:
        return False
    return math.isclose(float(printed.replace(",", "")), float(value), rel_tol=rel, abs_tol=1e-12)


def skipped_lines(out):
    return [ln[len("skipped: ") :] for ln in out.splitlines() if ln.startswith("skipped: ")]


# --------------------------------------------------------------------------- inputs


def _make_corpus(path):
    rnd = random.Random(0)
    words = ["king", "queen", "man", "woman", "Royal", "ROYAL", "café", "Café", "crown", "throne"]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(150):
            f.write(" ".join(rnd.choice(words) for _ in range(10)) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli31")
    _make_corpus(d / "corpus.txt")
    np.save(d / "a.npy", np.arange(60, dtype=np.float32).reshape(20, 3))
    for name in ("files_keep", "files_tmp", "pipe_dir", "w2v_out", "w2v_out2", "w2v_fail"):
        (d / name).mkdir()
    (d / "prof.txt").write_text("EXISTING LINE\n")
    return d


def _interrupted_convert(work):
    """Start a convert over an existing zarr store and Ctrl-C it while it writes."""
    src = work / "big.npy"
    np.save(src, np.random.default_rng(0).standard_normal((200_000, 64)).astype(np.float32))
    dst = work / "old.zarr"
    old = np.arange(12, dtype=np.int32).reshape(4, 3)
    z = zarr.open_array(dst, mode="w", shape=old.shape, dtype=old.dtype)
    z[...] = old
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gadgetloader",
            "convert",
            src,
            dst,
            "--compression",
            "gzip",
            "--no-progress",
        ],
        cwd=work,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.time()
    while time.time() - t0 < 60 and p.poll() is None:
        if glob.glob(str(work / ".old.zarr.partial-*")):
            break
        time.sleep(0.01)
    time.sleep(0.1)
    finished_early = p.poll() is not None
    if not finished_early:
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    leftovers = sorted(os.path.basename(x) for x in glob.glob(str(work / ".old.zarr*")))
    after = np.asarray(zarr.open_array(dst, mode="r")[...]) if dst.exists() else None
    return SimpleNamespace(
        rc=p.returncode,
        out=out,
        err=err,
        early=finished_early,
        leftovers=leftovers,
        old=old,
        after=after,
    )


#: word2vec's main with the 200-byte file size limit set once everything is imported
_SAVEFAIL = """
import resource, signal, sys
import numpy, torch, gadgetloader, datasets.word2vec as w2v
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))
sys.exit(w2v.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def runs(work):
    c = work / "corpus.txt"
    jobs = {
        # heavier ones first
        "train": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "train",
                "--rows",
                200,
                "--dim",
                8,
                "--batch",
                32,
                "--negatives",
                2,
                "--steps",
                2,
                "--warmup",
                1,
                "--repeats",
                1,
                "--json",
                work / "train.json",
            ]
        ),
        "interrupt": (lambda: _interrupted_convert(work)) if zarr is not None else (lambda: None),
        "w2v": lambda: sub(
            [
                "datasets.word2vec",
                c,
                "--dim",
                8,
                "--epochs",
                2,
                "--seed",
                5,
                "--out",
                work / "w2v_out" / "v",
                "--show",
                "King,QUEEN,zzz",
                "--no-progress",
            ]
        ),
        "w2v_again": lambda: sub(
            [
                "datasets.word2vec",
                c,
                "--dim",
                8,
                "--epochs",
                2,
                "--seed",
                5,
                "--out",
                work / "w2v_out2" / "v",
                "--no-progress",
            ]
        ),
        # the file size limit is set after the imports (a GPU machine's libraries may write
        # caches of their own while they load, and abort when they cannot)
        "w2v_savefail": lambda: subprocess.run(
            [
                sys.executable,
                "-c",
                _SAVEFAIL,
                str(c),
                "--dim",
                "4",
                "--no-progress",
                "--out",
                str(work / "w2v_fail" / "v"),
            ],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=85,
        ),
        "pipeline": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "pipeline",
                "--rows",
                2048,
                "--width",
                8,
                "--batch",
                256,
                "--batches",
                4,
                "--seconds",
                0.2,
                "--repeats",
                1,
                "--workers",
                0,
                "--dir",
                work / "pipe_dir",
                "--json",
                work / "pipe.json",
            ]
        ),
        "pipeline2": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "pipeline",
                "--rows",
                1000,
                "--width",
                3,
                "--dtype",
                "int64",
                "--batch",
                100,
                "--batches",
                2,
                "--seconds",
                0.1,
                "--repeats",
                1,
                "--workers",
                0,
                "--sources",
                "memory",
                "--prefetch",
                0,
                "--coalesce",
                2,
                "--json",
                work / "pipe2.json",
            ]
        ),
        "train2": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "train",
                "--rows",
                300,
                "--dim",
                4,
                "--batch",
                16,
                "--negatives",
                1,
                "--steps",
                1,
                "--warmup",
                0,
                "--repeats",
                1,
                "--methods",
                "dropin,gpu",
                "--fused",
                "--no-verify",
                "--zipf",
                0,
                "--profile",
                work / "prof.txt",
                "--json",
                work / "train2.json",
            ]
        ),
        "files": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "files",
                "--mb",
                0.2,
                "--random-mb",
                0.1,
                "--ids",
                32,
                "--repeats",
                1,
                "--dir",
                work / "files_keep",
                "--keep",
                "--json",
                work / "files.json",
            ]
        ),
        "files2": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "files",
                "--gb",
                0.0002,
                "--mb",
                5,
                "--formats",
                "npy,hdf5",
                "--no-baselines",
                "--ids",
                100000,
                "--repeats",
                1,
                "--dir",
                work / "files_tmp",
                "--json",
                work / "files2.json",
            ]
        ),
        "seed": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "--rows",
                50,
                "--width",
                3,
                "--ids",
                5000,
                "--dtype",
                "bfloat16",
                "--no-speedtorch",
                "--repeats",
                2,
                "--seed",
                SEED_MAX,
                "--json",
                work / "seed.json",
            ]
        ),
        "sweep": lambda: sub(
            [
                "gadgetloader",
                "bench",
                "sweep",
                "--sizes-gb",
                0.001,
                "--widths",
                8,
                "--ids",
                100,
                "--repeats",
                1,
                "--json",
                work / "sweep.json",
                "--plot",
                work / "sweep.png",
            ]
        ),
        "info": lambda: sub(["gadgetloader", "info", "--json", work / "info.json"]),
        "bad_bench": lambda: sub(["gadgetloader", "bench", "--rows", 0]),
    }
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    futs = {k: ex.submit(f) for k, f in jobs.items()}
    yield SimpleNamespace(get=lambda k: futs[k].result())
    ex.shutdown(wait=True)


def ok_run(runs, name):
    r = runs.get(name)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    return r


# =========================================================================== --help


def test_top_level_help_lists_the_three_commands():
    r = gl_cli("--help")
    assert r.rc == 0
    for cmd in ("info", "bench", "convert"):
        assert re.search(rf"^\s+{cmd}\s", r.out, re.M), r.out


def test_bench_help_lists_every_suite_and_seed_is_default():
    r = gl_cli("bench", "--help")
    assert r.rc == 0
    for suite in ("seed", "sweep", "files", "pipeline", "train"):
        assert re.search(rf"^\s+{suite}\s", r.out, re.M), suite
    assert "(the default)" in r.out


def _options(text):
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))


def test_bench_help_options_are_the_seed_suites():
    # README: `gadgetloader bench` (or `gadgetloader bench seed`) -- same benchmark, same options
    a, b = gl_cli("bench", "--help"), gl_cli("bench", "seed", "--help")
    assert a.rc == b.rc == 0
    assert _options(a.out) == _options(b.out)


SUITE_OPTIONS = {
    "seed": [
        "--json",
        "--rows",
        "--width",
        "--ids",
        "--dtype",
        "--repeats",
        "--seed",
        "--no-speedtorch",
    ],
    "sweep": [
        "--json",
        "--sizes-gb",
        "--widths",
        "--ids",
        "--strategies",
        "--repeats",
        "--plot",
        "--hybrid-fractions",
        "--pages",
        "--naive-max-ids",
    ],
    "files": [
        "--json",
        "--gb",
        "--mb",
        "--dir",
        "--formats",
        "--keep",
        "--no-baselines",
        "--ids",
        "--cache-mb",
        "--random-chunk-rows",
    ],
    "pipeline": [
        "--json",
        "--rows",
        "--width",
        "--batch",
        "--workers",
        "--prefetch",
        "--coalesce",
        "--sources",
        "--dir",
    ],
    "train": [
        "--json",
        "--rows",
        "--dim",
        "--batch",
        "--negatives",
        "--steps",
        "--repeats",
        "--methods",
        "--fused",
        "--no-verify",
        "--placement",
        "--lr",
        "--profile",
    ],
}

# README figures for each suite's defaults, as its help must say them
SUITE_DEFAULTS = {
    "seed": ["default 1,000,000", "default 128", "default 131,072", "default float32"],
    "files": ["default 256", "default 64", "default 4096", "1/8 of the random"],
    "pipeline": ["default 4096", "up to 32"],
    "train": ["default 10,000,000", "default 128", "default 4096", "default 5"],
}


@pytest.mark.parametrize("suite", sorted(SUITE_OPTIONS))
def test_suite_help_has_documented_options_and_defaults(suite):
    r = gl_cli("bench", suite, "--help")
    assert r.rc == 0 and r.err == ""
    assert set(SUITE_OPTIONS[suite]) <= _options(r.out), set(SUITE_OPTIONS[suite]) - _options(r.out)
    flat = " ".join(r.out.split())
    for frag in SUITE_DEFAULTS.get(suite, []):
        assert frag in flat, (frag, flat)


def test_convert_and_info_help_match_readme():
    r = gl_cli("convert", "--help")
    assert r.rc == 0
    assert {
        "--dataset",
        "--dst-dataset",
        "--chunk-rows",
        "--compression",
        "--format",
        "--to",
        "--progress",
        "--no-progress",
    } <= _options(r.out)
    flat = " ".join(r.out.split())
    # README: HDF5 takes gzip/lzf/"none", zarr zstd (default)/gzip/blosc/"none"
    assert "gzip|lzf" in flat and "zstd|gzip|blosc" in flat and "none" in flat
    i = gl_cli("info", "--help")
    assert i.rc == 0 and {"--no-measure", "--json"} <= _options(i.out)


def test_word2vec_help_matches_readme():
    r = w2v("--help")
    assert r.rc == 0
    assert {
        "--dim",
        "--epochs",
        "--out",
        "--show",
        "--placement",
        "--lr",
        "--seed",
        "--min-count",
        "--negatives",
        "--window",
        "--batch-size",
        "--device",
    } <= _options(r.out)
    flat = " ".join(r.out.split())
    assert "default 0.01" in flat  # README: Adam's learning rate is 0.01 by default (`--lr`)
    assert "{pinned,cpu,cuda}" in flat
    assert "comma-separated" in flat


# =========================================================================== info


def test_info_json_matches_printed_table(runs, work):
    r = ok_run(runs, "info")
    data = json.loads((work / "info.json").read_text())
    printed = {}
    for ln in r.stdout.splitlines():
        m = re.match(r"^\s*([a-z0-9_]+): (.*)$", ln)
        if m:
            printed[m.group(1)] = m.group(2)
    assert list(printed) == list(data), (list(printed), list(data))
    for k, v in data.items():
        if v is None:
            assert printed[k] == "not installed", (k, printed[k])
        else:
            assert printed[k] == str(v), (k, printed[k], v)
    assert data["cuda_available"] is False
    assert data["gadgetloader"] == gl.__version__
    assert data["torch"] == torch.__version__
    assert data["numpy"] == np.__version__


# =========================================================================== bench seed


def _check_seed(run, path, rows, width, ids, dtype, itemsize):
    data = json.loads(path.read_text())
    assert data["benchmark"] == "seed"
    assert (data["rows"], data["width"], data["ids"], data["dtype"]) == (rows, width, ids, dtype)
    assert data["bytes_moved"] == ids * width * itemsize
    assert f"table {rows} x {width} {dtype}, {ids} random ids" in run.stdout
    (table,) = md_tables(run.stdout)
    assert len(table) == len(data["results"]) >= 4
    naive = {}
    for res in data["results"]:
        if res["method"].startswith("torch naive"):
            naive[res["kind"]] = res["ms"]
    assert set(naive) == {"gather", "scatter"}
    for row, res in zip(table, data["results"], strict=True):
        assert row["kind"] == res["kind"] and row["method"] == res["method"]
        assert row["check"] == res["check"] == "ok"
        assert same(row["ms"], res["ms"]) and same(row["GB/s"], res["GBps"])
        assert same(row["of limit"], res["of_limit"]) and same(row["x naive"], res["x_naive"])
        assert res["GBps"] == pytest.approx(
            data["bytes_moved"] / (res["ms"] * 1e-3) / 1e9, rel=1e-6
        )
        assert res["x_naive"] == pytest.approx(naive[res["kind"]] / res["ms"], rel=1e-6)
    assert skipped_lines(run.stdout) == data["skipped"]
    assert any("CUDA" in s or "GPU" in s for s in data["skipped"])


def test_bench_seed_default_suite_json_matches_table(runs, work):
    # `bench` without a suite runs the seed benchmark; --seed 2**62 is accepted ("0 to 2**62");
    # help: "--ids ... at most --rows: a larger value is capped to it ... the report gives the
    # count used"
    r = ok_run(runs, "seed")
    _check_seed(r, work / "seed.json", 50, 3, 50, "bfloat16", 2)
    kinds = [res["kind"] for res in json.loads((work / "seed.json").read_text())["results"]]
    assert set(kinds) == {"gather", "scatter"}


SEED_BAD = [
    (["--rows", "0"], "--rows"),
    (["--rows", "-1"], "--rows"),
    (["--rows", "abc"], "--rows"),
    (["--rows", "1e3"], "--rows"),
    (["--width", "0"], "--width"),
    (["--ids", "0"], "--ids"),
    (["--dtype", "bogus"], "--dtype"),
    (["--dtype", "uint16"], "--dtype"),
    (["--repeats", "0"], "--repeats"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(SEED_MAX + 1)], "--seed"),
]


@pytest.mark.parametrize("args,opt", SEED_BAD, ids=[" ".join(a) for a, _ in SEED_BAD])
def test_bench_seed_bad_values_are_one_line_usage_errors(args, opt):
    r = bench("", *args)
    assert_one_line_error(r, opt)
    assert r.rc == 2


@pytest.mark.parametrize("args,opt", SEED_BAD[::4], ids=[" ".join(a) for a, _ in SEED_BAD[::4]])
def test_bench_seed_named_suite_same_validation(args, opt):
    r = bench("seed", *args)
    assert_one_line_error(r, opt)
    assert r.rc == 2


def test_bench_unknown_suite_and_options_before_suite():
    r = gl_cli("bench", "nosuch")
    assert_one_line_error(r, "nosuch")
    for s in ("seed", "sweep", "files", "pipeline", "train"):
        assert s in error_lines(r.err)[0]
    r = gl_cli("bench", "--rows", "100", "files")
    assert_one_line_error(r, "--rows")
    assert "gadgetloader bench files --rows 100" in r.err  # the advice names the right order
    r = bench("seed", "--mb", "3")  # an option of another suite
    assert_one_line_error(r, "--mb")


def test_bench_bad_subprocess_has_no_traceback(runs):
    r = runs.get("bad_bench")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(error_lines(r.stderr)) == 1 and r.stdout == ""


@pytest.mark.parametrize("suite", ["", "seed", "sweep", "files", "pipeline", "train", "info"])
@pytest.mark.parametrize("where", ["missing_dir", "is_dir", "parent_is_file"])
def test_json_path_checked_before_the_run(work, suite, where):
    target = {
        "missing_dir": work / "no-such-dir" / "r.json",
        "is_dir": work,
        "parent_is_file": work / "a.npy" / "r.json",
    }[where]
    t0 = time.time()
    if suite == "info":
        r = gl_cli("info", "--no-measure", "--json", target)
    else:
        r = bench(suite, "--json", target)
    assert_one_line_error(r, "--json")
    assert time.time() - t0 < 5
    assert not (work / "no-such-dir").exists()


# =========================================================================== bench sweep


def test_bench_sweep_without_gpu_is_skipped_with_reason(runs, work):
    r = ok_run(runs, "sweep")
    assert "skipped" in r.stdout and "CUDA" in r.stdout
    data = json.loads((work / "sweep.json").read_text())
    assert data["benchmark"] == "sweep"
    assert data["results"] == [] and data["skipped"]
    assert md_tables(r.stdout) == []


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed (--plot needs it)")
def test_bench_sweep_plot_without_results_writes_nothing(runs, work):
    r = ok_run(runs, "sweep")
    assert not (work / "sweep.png").exists()
    assert "not written" in r.stdout + r.stderr


SWEEP_BAD = [
    (["--sizes-gb", "0"], "--sizes-gb"),
    (["--sizes-gb", "-1"], "--sizes-gb"),
    (["--sizes-gb", "abc"], "--sizes-gb"),
    (["--sizes-gb", "nan"], "--sizes-gb"),
    (["--sizes-gb", "inf"], "--sizes-gb"),
    (["--widths", "0"], "--widths"),
    (["--widths", "3.5"], "--widths"),
    (["--ids", "0"], "--ids"),
    (["--strategies", "bogus"], "--strategies"),
    (["--strategies", "kernel-u17"], "kernel-u17"),
    (["--strategies", "kernel-u0"], "kernel-u0"),
    (["--strategies", "kernel-v3"], "kernel-v3"),
    (["--hybrid-fractions", "1.5"], "--hybrid-fractions"),
    (["--hybrid-fractions", "-0.1"], "--hybrid-fractions"),
    (["--pages", "bogus"], "--pages"),
    (["--repeats", "0"], "--repeats"),
    (["--naive-max-ids", "-1"], "--naive-max-ids"),
    (["--plot", "/no-such-dir-cli31/p.png"], "--plot"),
    (["--plot", "."], "--plot"),
]


@pytest.mark.parametrize("args,opt", SWEEP_BAD, ids=[" ".join(a) for a, _ in SWEEP_BAD])
def test_bench_sweep_validates_before_the_gpu_skip(args, opt):
    r = bench("sweep", *args)
    assert_one_line_error(r, opt)
    assert "skipped" not in r.out


def test_bench_sweep_accepts_every_documented_strategy_and_page_kind():
    r = bench(
        "sweep",
        "--strategies",
        "auto,kernel,sorted,hybrid,torch,kernel-u1,kernel-u16,kernel-v1,kernel-v2,kernel-v4,kernel-v8,kernel-v16",
        "--pages",
        "default,thp,hugetlb",
        "--hybrid-fractions",
        "0,0.5,1",
        "--repeats",
        "1",
    )
    assert r.rc == 0, r.err
    assert "skipped" in r.out and not error_lines(r.err)


# =========================================================================== bench files


def test_bench_files_json_matches_tables(runs, work):
    r = ok_run(runs, "files")
    data = json.loads((work / "files.json").read_text())
    cfg = data["config"]
    assert cfg["width"] == 128 and cfg["dtype"] == "float32"
    assert cfg["rows"] == int(0.2e6) // 512 and cfg["table_bytes"] == cfg["rows"] * 512
    assert cfg["random_rows"] == int(0.1e6) // 512
    assert cfg["random_chunk_rows"] == 64  # help: default 64
    assert cfg["cache_bytes"] == cfg["random_table_bytes"] // 8  # help: 1/8 of the random table
    assert cfg["ids_per_call"] == 32 and cfg["repeats"] == 1
    load_t, rand_t = md_tables(r.stdout)
    assert (
        [x["format"] for x in load_t]
        == [x["format"] for x in data["load"]]
        == ["npy", "hdf5", "zarr"]
    )
    for row, res in zip(load_t, data["load"], strict=True):
        assert same(row["read into store GB/s"], res["GBps"])
        assert same(row["fraction of disk"], res["fraction_of_disk"])
        assert same(row["incl. allocation GB/s"], res["GBps_with_alloc"])
        assert same(row["fraction"], res["fraction_of_disk_with_alloc"])
        assert row["checked"] == str(res["checked"]) == "True"
        assert res["fraction_of_disk"] == pytest.approx(
            res["GBps"] / data["disk"]["read_GBps"], rel=1e-6
        )
    assert len(rand_t) == len(data["random"]) == 6
    base = {
        x["format"]: x["ms"] for x in data["random"] if not x["method"].startswith("gadgetloader")
    }
    for row, res in zip(rand_t, data["random"], strict=True):
        assert (row["format"], row["method"]) == (res["format"], res["method"])
        assert same(row["ms"], res["ms"]) and same(row["rows/s"], res["rows_per_s"])
        assert same(row["speedup"], res.get("speedup_vs_baseline"))
        assert row["checked"] == str(res["checked"]) == "True"
        assert res["rows_per_s"] == pytest.approx(cfg["ids_per_call"] / (res["ms"] / 1e3), rel=1e-6)
        if res["method"].startswith("gadgetloader"):
            assert res["speedup_vs_baseline"] == pytest.approx(
                base[res["format"]] / res["ms"], rel=1e-6
            )
    assert data["checks_passed"] is True
    assert "all results checked against NumPy: True" in r.stdout
    assert skipped_lines(r.stdout) == data["skipped"] == []


def test_bench_files_keep_leaves_the_files_in_dir(runs, work):
    ok_run(runs, "files")
    cfg = json.loads((work / "files.json").read_text())["config"]
    kept = Path(cfg["dir"])
    if not kept.is_absolute():
        kept = work / kept
    assert kept.parent.resolve() == (work / "files_keep").resolve()
    table = np.load(kept / "table.npy", mmap_mode="r")
    assert table.shape == (cfg["rows"], 128) and table.dtype == np.float32


def test_bench_files_gb_overrides_mb_subset_formats_no_baselines(runs, work):
    r = ok_run(runs, "files2")
    data = json.loads((work / "files2.json").read_text())
    cfg = data["config"]
    assert cfg["rows"] == int(0.0002e9) // 512  # --gb overrides --mb 5
    assert [x["format"] for x in data["load"]] == ["npy", "hdf5"]
    assert {x["format"] for x in data["random"]} == {"npy", "hdf5"}
    assert all(x["method"].startswith("gadgetloader") for x in data["random"])  # --no-baselines
    assert 1 <= cfg["ids_per_call"] <= cfg["random_rows"]  # distinct ids: at most the rows
    assert "zarr" not in r.stdout
    # without --keep the benchmark's files are gone
    assert list((work / "files_tmp").iterdir()) == []


FILES_BAD = [
    (["--mb", "0"], "--mb"),
    (["--mb", "-1"], "--mb"),
    (["--mb", "nan"], "--mb"),
    (["--gb", "0"], "--gb"),
    (["--gb", "inf"], "--gb"),
    (["--width", "0"], "--width"),
    (["--formats", "bogus"], "--formats"),
    (["--formats", "npy,bogus"], "--formats"),
    (["--chunk-rows", "0"], "--chunk-rows"),
    (["--compression", "bogus"], "--compression"),
    (["--random-mb", "0"], "--random-mb"),
    (["--random-chunk-rows", "0"], "--random-chunk-rows"),
    (["--cache-mb", "0"], "--cache-mb"),
    (["--ids", "0"], "--ids"),
    (["--repeats", "0"], "--repeats"),
    (["--seed", "-1"], "--seed"),
    (["--dir", "/no-such-dir-cli31"], "--dir"),
]


@pytest.mark.parametrize("args,opt", FILES_BAD, ids=[" ".join(a) for a, _ in FILES_BAD])
def test_bench_files_bad_values_refused(args, opt):
    r = bench("files", *args)
    assert_one_line_error(r, opt)


def test_bench_files_dir_that_is_a_file_refused(work):
    r = bench("files", "--dir", work / "a.npy")
    assert_one_line_error(r, "--dir")


# =========================================================================== bench pipeline


def test_bench_pipeline_json_matches_table(runs, work):
    r = ok_run(runs, "pipeline")
    data = json.loads((work / "pipe.json").read_text())
    assert data["benchmark"] == "pipeline"
    assert (data["rows"], data["width"], data["dtype"], data["batch"]) == (2048, 8, "float32", 256)
    assert data["row_bytes"] == 32
    assert "table 2048 x 8 float32" in r.stdout and "batch 256" in r.stdout
    (table,) = md_tables(r.stdout)
    res_all = data["results"]
    assert len(table) == len(res_all)
    best = data["summary"]["best_torch_rows_per_s"]
    for row, res in zip(table, res_all, strict=True):
        assert (row["source"], row["method"]) == (res["source"], res["method"])
        assert row["workers"] == str(res.get("workers", "-"))
        assert same(row["rows/s"], res["rows_per_s"]) and same(row["us/batch"], res["us_per_batch"])
        assert same(row["GB/s"], res["GBps"]) and same(row["of limit"], res["of_limit"])
        assert same(row["x torch"], res["x_torch"])
        assert row["check"] == res["check"] == "ok"
        assert res["rows_per_s"] == pytest.approx(256 * 1e6 / res["us_per_batch"], rel=1e-6)
        assert res["GBps"] == pytest.approx(res["rows_per_s"] * 32 / 1e9, rel=1e-6)
        assert res["x_torch"] == pytest.approx(res["rows_per_s"] / best, rel=1e-6)
    torch_rows = [x for x in res_all if x["method"].startswith("(a)")]
    assert [x["workers"] for x in torch_rows] == [0]  # --workers 0 only
    assert data["summary"]["best_torch_workers"] == 0
    sources = {x["source"] for x in res_all}
    assert any(s.startswith("memory") for s in sources) and any(
        s.startswith("file") for s in sources
    )
    assert skipped_lines(r.stdout) == data["skipped"]


def test_bench_pipeline_sources_dtype_prefetch_coalesce(runs, work):
    r = ok_run(runs, "pipeline2")
    data = json.loads((work / "pipe2.json").read_text())
    assert data["dtype"] == "int64" and data["row_bytes"] == 3 * 8
    assert not any(x["source"].startswith("file") for x in data["results"])  # --sources memory
    d_rows = [x["method"] for x in data["results"] if x["method"].startswith("(d)")]
    assert d_rows and all("prefetch=0" in m and "coalesce=2" in m for m in d_rows)
    assert "int64" in r.stdout.splitlines()[0]


PIPE_BAD = [
    (["--rows", "0"], "--rows"),
    (["--width", "2"], "--width"),
    (["--width", "0"], "--width"),
    (["--dtype", "bool"], "--dtype"),
    (["--batch", "0"], "--batch"),
    (["--batches", "0"], "--batches"),
    (["--seconds", "0"], "--seconds"),
    (["--seconds", "nan"], "--seconds"),
    (["--repeats", "0"], "--repeats"),
    (["--workers", "-1"], "--workers"),
    (["--workers", "abc"], "--workers"),
    (["--sources", "bogus"], "--sources"),
    (["--prefetch", "-1"], "--prefetch"),
    (["--coalesce", "0"], "--coalesce"),
    (["--dir", "/no-such-dir-cli31"], "--dir"),
    (["--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize("args,opt", PIPE_BAD, ids=[" ".join(a) for a, _ in PIPE_BAD])
def test_bench_pipeline_bad_values_refused(args, opt):
    r = bench("pipeline", *args)
    assert_one_line_error(r, opt)


# =========================================================================== bench train


def test_bench_train_json_matches_table(runs, work):
    r = ok_run(runs, "train")
    data = json.loads((work / "train.json").read_text())
    cfg = data["config"]
    assert (
        cfg["rows"],
        cfg["dim"],
        cfg["batch"],
        cfg["negatives"],
        cfg["steps"],
        cfg["repeats"],
        cfg["warmup"],
    ) == (200, 8, 32, 2, 2, 1, 1)
    assert data["device"] == "cpu" and data["memcpy"] is None
    (table,) = md_tables(r.stdout)
    methods = data["methods"]
    assert (
        [row["method"] for row in table]
        == list(methods)
        == ["gpu", "speedtorch", "switchers", "dropin", "resident"]
    )
    for row in table:
        m = methods[row["method"]]
        assert row["tables"] == m["placement"]
        assert same(row["steps/s"], m["steps_per_s"]) and same(row["ms/step"], m["ms_per_step"])
        assert same(row["MB over PCIe/step"], m["bytes_per_step"] / 1e6) or same(
            row["MB over PCIe/step"], m["bytes_per_step"] / 2**20
        )
        assert row["floor ms"] == "-" and row["x floor"] == "-"  # no memcpy ceiling without CUDA
        v = data["verified"].get(row["method"])
        assert row["checked"] == ("n/a" if v is None else str(v))
        assert m["steps_per_s"] == pytest.approx(1000 / m["ms_per_step"], rel=1e-6)
    assert data["verified"] == {"gpu": "reference", "switchers": True, "dropin": True}
    st = methods["speedtorch"]["ms_per_step"]
    assert data["speedup_switchers_vs_speedtorch"] == pytest.approx(
        st / methods["switchers"]["ms_per_step"], rel=1e-6
    )
    assert data["speedup_dropin_vs_speedtorch"] == pytest.approx(
        st / methods["dropin"]["ms_per_step"], rel=1e-6
    )
    assert data["dropin_x_resident"] == pytest.approx(
        methods["dropin"]["ms_per_step"] / methods["resident"]["ms_per_step"], rel=1e-6
    )
    m = re.search(r"switchers ([\d.]+)x, drop-in ([\d.]+)x", r.stdout)
    assert m  # printed with two decimals
    assert float(m.group(1)) == pytest.approx(
        data["speedup_switchers_vs_speedtorch"], abs=0.006, rel=0.01
    )
    assert float(m.group(2)) == pytest.approx(
        data["speedup_dropin_vs_speedtorch"], abs=0.006, rel=0.01
    )
    assert skipped_lines(r.stdout) == data["skipped"]
    assert any("CUDA" in s for s in data["skipped"])


def test_bench_train_methods_fused_no_verify_profile(runs, work):
    r = ok_run(runs, "train2")
    data = json.loads((work / "train2.json").read_text())
    (table,) = md_tables(r.stdout)
    assert [row["method"] for row in table] == list(data["methods"]) == ["dropin", "gpu"]
    assert all(row["checked"] == "n/a" for row in table) and data["verified"] == {}
    assert data["config"]["zipf"] == 0
    assert any("--fused" in s for s in data["skipped"])  # fused Adam is CUDA only
    assert skipped_lines(r.stdout) == data["skipped"]
    assert data["speedup_dropin_vs_speedtorch"] is None  # no speedtorch method ran
    prof = (work / "prof.txt").read_text()
    assert prof.startswith("EXISTING LINE\n")  # help: "append ... to FILE"
    assert "dropin" in prof and "gpu" in prof and len(prof) > 200


TRAIN_BAD = [
    (["--rows", "0"], "--rows"),
    (["--dim", "0"], "--dim"),
    (["--batch", "0"], "--batch"),
    (["--negatives", "0"], "--negatives"),
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--repeats", "0"], "--repeats"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "1e31"], "--lr"),
    (["--zipf", "-1"], "--zipf"),
    (["--zipf", "nan"], "--zipf"),
    (["--placement", "bogus"], "--placement"),
    (["--placement", "file"], "--placement"),
    (["--methods", "bogus"], "--methods"),
    (["--methods", "dropin,bogus"], "--methods"),
    (["--memcpy-mib", "0"], "--memcpy-mib"),
    (["--seed", "-1"], "--seed"),
    (["--profile", "/no-such-dir-cli31/p.txt"], "--profile"),
]


@pytest.mark.parametrize("args,opt", TRAIN_BAD, ids=[" ".join(a) for a, _ in TRAIN_BAD])
def test_bench_train_bad_values_refused(args, opt):
    r = bench("train", *args)
    assert_one_line_error(r, opt)


# ---------------------------------------------------------- exit statuses of bad values
# A bad value to a bench/convert option exits 2 with argparse's usage line for most options
# (--rows 0, --dir FILE, --chunk-rows x); these siblings should not exit differently.

STATUS_PAIRS = [
    (
        "files --dir",
        ["bench", "files", "--dir", "/no-such-dir-cli31"],
        ["bench", "files", "--dir", "{a}"],
    ),
    (
        "files --formats",
        ["bench", "files", "--formats", "bogus"],
        ["bench", "files", "--width", "0"],
    ),
    (
        "sweep --sizes-gb",
        ["bench", "sweep", "--sizes-gb", "0"],
        ["bench", "sweep", "--repeats", "0"],
    ),
    (
        "pipeline --width",
        ["bench", "pipeline", "--width", "2"],
        ["bench", "pipeline", "--width", "0"],
    ),
    (
        "train --methods",
        ["bench", "train", "--methods", "bogus"],
        ["bench", "train", "--steps", "0"],
    ),
    (
        "convert --chunk-rows",
        ["convert", "{a}", "{d}", "--chunk-rows", "0"],
        ["convert", "{a}", "{d}", "--chunk-rows", "x"],
    ),
]


@pytest.mark.parametrize(
    "bad,sibling", [p[1:] for p in STATUS_PAIRS], ids=[p[0] for p in STATUS_PAIRS]
)
def test_bad_values_share_one_exit_status(work, bad, sibling):
    fill = {"{a}": str(work / "a.npy"), "{d}": str(work / "status.h5")}

    def go(argv):
        argv = [fill.get(x, x) for x in argv]
        return bench(*argv[1:]) if argv[0] == "bench" else gl_cli(*argv)

    r1, r2 = go(bad), go(sibling)
    assert r2.rc == 2
    assert r1.rc == r2.rc, (r1.rc, r1.err)
    assert not (work / "status.h5").exists()


# =========================================================================== convert

PAIR_DATA = {
    ("npy", "h5"): ("float16", (7, 3)),
    ("npy", "zarr"): ("int8", (11,)),
    ("npy", "npy"): ("float64", (5, 2, 2)),
    ("h5", "npy"): ("bool", (6, 2)),
    ("h5", "zarr"): ("float64", (4, 2, 3)),
    ("h5", "h5"): ("int32", (8, 5)),
    ("zarr", "npy"): ("uint8", (9, 4)),
    ("zarr", "h5"): ("int64", (5, 2)),
    ("zarr", "zarr"): ("int16", (13, 1)),
}


def _values(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) > 0.5
    if np.dtype(dtype).kind == "f":
        v = rng.standard_normal(shape).astype(dtype)
        v.flat[0] = -0.0
        return v
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)
    v.flat[0], v.flat[-1] = info.min, info.max
    return v


def _write(fmt, path, arr, dataset=None):
    if fmt == "npy":
        np.save(path, arr)
    elif fmt == "h5":
        with h5py.File(path, "w") as f:
            f.create_dataset(dataset or "emb", data=arr)
    else:
        if dataset:
            g = zarr.open_group(path, mode="w")
            g.create_array(dataset, data=arr)
        else:
            z = zarr.open_array(path, mode="w", shape=arr.shape, dtype=arr.dtype)
            z[...] = arr


def _read(fmt, path, dataset=None):
    if fmt == "npy":
        return np.load(path)
    if fmt == "h5":
        with h5py.File(path, "r") as f:
            return f[dataset or "data"][...]
    if dataset:
        return np.asarray(zarr.open_group(path, mode="r")[dataset][...])
    return np.asarray(zarr.open_array(path, mode="r")[...])


@pytest.mark.parametrize("src_fmt,dst_fmt", sorted(PAIR_DATA), ids=lambda x: str(x))
def test_convert_every_pair_of_formats_bit_exact(work, src_fmt, dst_fmt):
    if "h5" in (src_fmt, dst_fmt) and h5py is None:
        pytest.skip("h5py not installed")
    if "zarr" in (src_fmt, dst_fmt) and zarr is None:
        pytest.skip("zarr not installed")
    dtype, shape = PAIR_DATA[(src_fmt, dst_fmt)]
    arr = _values(dtype, shape, sorted(PAIR_DATA).index((src_fmt, dst_fmt)))
    d = work / f"pair_{src_fmt}_{dst_fmt}"
    d.mkdir()
    src, dst = d / f"src.{src_fmt}", d / f"dst.{dst_fmt}"
    _write(src_fmt, src, arr)
    before = _read(src_fmt, src, "emb" if src_fmt == "h5" else None)
    r = gl_cli("convert", src, dst, "--no-progress")
    assert r.rc == 0, r.err
    assert "Traceback" not in r.err
    got = _read(dst_fmt, dst)
    assert got.dtype == arr.dtype and got.shape == arr.shape
    assert np.array_equal(got.view(np.uint8), arr.view(np.uint8))  # bit-exact (-0.0 too)
    assert np.array_equal(_read(src_fmt, src, "emb" if src_fmt == "h5" else None), before)
    # the one-line report names both formats, the shape and the dtype
    line = r.out.strip().splitlines()[-1]
    assert str(shape) in line and dtype in line
    assert sorted(p.name for p in d.iterdir()) == sorted([src.name, dst.name])  # nothing left over


@needs_h5
@pytest.mark.parametrize("comp,expect", [("gzip", "gzip"), ("lzf", "lzf"), ("none", None)])
def test_convert_hdf5_compression_options(work, comp, expect):
    dst = work / f"comp_{comp}.h5"
    r = gl_cli("convert", work / "a.npy", dst, "--compression", comp, "--chunk-rows", 3)
    assert r.rc == 0, r.err
    with h5py.File(dst, "r") as f:
        assert f["data"].compression == expect and f["data"].chunks[0] == 3
        assert np.array_equal(f["data"][...], np.load(work / "a.npy"))


@needs_zarr
@pytest.mark.parametrize("comp", ["zstd", "gzip", "blosc", "none", None])
def test_convert_zarr_compression_options(work, comp):
    dst = work / f"comp_{comp}.zarr"
    extra = ["--compression", comp] if comp else []
    r = gl_cli("convert", work / "a.npy", dst, "--chunk-rows", 7, *extra)
    assert r.rc == 0, r.err
    z = zarr.open_array(dst, mode="r")
    assert z.chunks[0] == 7
    names = " ".join(type(c).__name__.lower() for c in z.compressors)
    if comp == "none":
        assert names == ""
    else:
        assert (comp or "zstd") in names  # README: zarr `zstd` (default)
    assert np.array_equal(z[...], np.load(work / "a.npy"))


@pytest.mark.parametrize(
    "dst,args,frag",
    [
        ("bad1.h5", ["--compression", "zstd"], "zstd"),
        ("bad2.zarr", ["--compression", "lzf"], "lzf"),
        ("bad3.h5", ["--compression", "bogus"], "bogus"),
        ("bad4.npy", ["--compression", "gzip"], "--compression"),
        ("bad5.npy", ["--chunk-rows", "4"], "--chunk-rows"),
        ("bad6.h5", ["--chunk-rows", "0"], "--chunk-rows"),
        ("bad7.h5", ["--chunk-rows", "-3"], "--chunk-rows"),
        ("bad8.bin", [], "--to"),
        ("bad9.bin", ["--to", "bogus"], "bogus"),
        ("bad10.h5", ["--format", "bogus"], "bogus"),
        ("bad11.h5", ["--format", "hdf5"], "hdf5"),
        ("bad12.h5", ["--dst-dataset", "../x"], "../x"),
        ("bad13.h5", ["--progress", "--no-progress"], "--no-progress"),
    ],
)
def test_convert_bad_options_refused_before_writing(work, dst, args, frag):
    src = work / "a.npy"
    before = src.read_bytes()
    r = gl_cli("convert", src, work / dst, *args)
    assert_one_line_error(r, frag)
    assert not (work / dst).exists()
    assert not glob.glob(str(work / f".{dst}*"))
    assert src.read_bytes() == before


def test_convert_missing_source_and_missing_target_dir(work):
    r = gl_cli("convert", work / "nosuch.npy", work / "x1.h5")
    assert_one_line_error(r, "nosuch.npy")
    assert not (work / "x1.h5").exists()
    r = gl_cli("convert", work / "a.npy", work / "no-dir" / "x.h5")
    assert_one_line_error(r, "no-dir")


def test_convert_refuses_its_own_source_also_through_links(work):
    d = work / "self"
    d.mkdir()
    src = d / "s.npy"
    np.save(src, np.arange(10, dtype=np.int32))
    before = src.read_bytes()
    os.symlink(src, d / "sym.npy")
    os.link(src, d / "hard.npy")
    for a, b in [
        (src, src),
        (src, d / "sym.npy"),
        (d / "hard.npy", src),
        (d / "sym.npy", d / "hard.npy"),
    ]:
        r = gl_cli("convert", a, b)
        assert_one_line_error(r, "same file")
        assert src.read_bytes() == before
    assert sorted(p.name for p in d.iterdir()) == ["hard.npy", "s.npy", "sym.npy"]


@needs_h5
def test_convert_refuses_hdf5_dataset_onto_its_own_file(work):
    p = work / "own.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(6.0)
        f["y"] = np.arange(4)
    r = gl_cli("convert", p, p, "--dataset", "x")
    assert_one_line_error(r, "same file")
    with h5py.File(p, "r") as f:
        assert sorted(f) == ["x", "y"]


@pytest.mark.parametrize("to", ["npy", "hdf5"])
def test_convert_refuses_a_directory_target(work, to):
    d = work / f"dir_{to}"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    r = gl_cli("convert", work / "a.npy", d, "--to", to)
    assert_one_line_error(r, "directory")
    assert (d / "notes.txt").read_text() == "keep"


@needs_zarr
def test_convert_refuses_non_zarr_directory_for_zarr(work):
    d = work / "notzarr.zarr"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    r = gl_cli("convert", work / "a.npy", d)
    assert_one_line_error(r, "not a zarr store")
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


@needs_zarr
def test_convert_replaces_an_existing_zarr_store(work):
    dst = work / "repl.zarr"
    _write("zarr", dst, np.zeros((3, 3), np.int8), dataset="other")
    r = gl_cli("convert", work / "a.npy", dst)
    assert r.rc == 0, r.err
    assert np.array_equal(_read("zarr", dst), np.load(work / "a.npy"))


@needs_h5
def test_convert_replaces_whole_hdf5_file(work):
    dst = work / "whole.h5"
    with h5py.File(dst, "w") as f:
        f["keep"] = np.zeros(3)
        f["data"] = np.zeros(3)
    r = gl_cli("convert", work / "a.npy", dst)
    assert r.rc == 0, r.err
    with h5py.File(dst, "r") as f:
        assert list(f) == ["data"]  # README: a save replaces ... an HDF5 file with all its datasets
        assert np.array_equal(f["data"][...], np.load(work / "a.npy"))


@needs_h5
@needs_zarr
def test_convert_dataset_choice_and_dst_dataset_default(work):
    h5 = work / "two.h5"
    y = np.arange(8, dtype=np.int32).reshape(4, 2)
    with h5py.File(h5, "w") as f:
        f["x"] = np.arange(6.0).reshape(3, 2)
        f.create_group("g")["y"] = y
    r = gl_cli("convert", h5, work / "two_a.npy")
    assert_one_line_error(r, "--dataset")
    assert "g/y" in r.err and "x" in r.err  # a wrong/missing name lists the ones that exist
    r = gl_cli("convert", h5, work / "two_b.npy", "--dataset", "nosuch")
    assert_one_line_error(r, "nosuch")
    assert "g/y" in r.err
    assert not (work / "two_a.npy").exists() and not (work / "two_b.npy").exists()
    # --dst-dataset defaults to --dataset
    r = gl_cli("convert", h5, work / "two_c.h5", "--dataset", "g/y")
    assert r.rc == 0, r.err
    assert np.array_equal(_read("h5", work / "two_c.h5", "g/y"), y)
    r = gl_cli("convert", h5, work / "two_d.zarr", "--dataset", "g/y", "--dst-dataset", "emb/words")
    assert r.rc == 0, r.err
    assert np.array_equal(_read("zarr", work / "two_d.zarr", "emb/words"), y)
    r = gl_cli("convert", h5, work / "two_e.npy", "--dataset", "/g/y")
    assert r.rc == 0 and np.array_equal(np.load(work / "two_e.npy"), y)


@needs_zarr
def test_convert_zarr_group_needs_dataset_and_zarr_v2_source(work):
    g = work / "grp.zarr"
    grp = zarr.open_group(g, mode="w")
    grp.create_array("p", data=np.arange(4, dtype=np.int16))
    grp.create_array("q", data=np.ones((2, 2), np.float32))
    r = gl_cli("convert", g, work / "grp.npy")
    assert_one_line_error(r, "--dataset")
    assert "'p'" in r.err and "'q'" in r.err
    r = gl_cli("convert", g, work / "grp.npy", "--dataset", "q")
    assert r.rc == 0 and np.array_equal(np.load(work / "grp.npy"), np.ones((2, 2), np.float32))
    v2 = work / "v2.zarr"
    arr = np.arange(30, dtype=np.float32).reshape(10, 3)
    z = zarr.open_array(
        v2, mode="w", shape=arr.shape, dtype=arr.dtype, chunks=(4, 3), zarr_format=2
    )
    z[...] = arr
    r = gl_cli("convert", v2, work / "v2.npy")
    assert r.rc == 0, r.err
    assert np.array_equal(np.load(work / "v2.npy"), arr)


@needs_h5
@needs_zarr
def test_convert_format_from_content_and_forced_destination(work):
    src = work / "content.bin"
    shutil.copy(work / "a.npy", src)
    r = gl_cli("convert", src, work / "content.h5")  # README: else from the content
    assert r.rc == 0, r.err
    assert np.array_equal(_read("h5", work / "content.h5"), np.load(work / "a.npy"))
    r = gl_cli("convert", work / "a.npy", work / "forced.dat", "--to", "zarr")
    assert r.rc == 0, r.err
    assert np.array_equal(
        np.asarray(zarr.open_array(work / "forced.dat", mode="r")[...]), np.load(work / "a.npy")
    )
    r = gl_cli("convert", work / "content.h5", work / "back.npy", "--format", "hdf5")
    assert r.rc == 0 and np.array_equal(np.load(work / "back.npy"), np.load(work / "a.npy"))


@pytest.mark.parametrize("kind", ["uint16", "complex64", "zero_rows", "junk", "object"])
def test_convert_unsupported_sources_are_one_line_errors(work, kind):
    src = work / f"uns_{kind}.npy"
    if kind == "uint16":
        np.save(src, np.arange(10, dtype=np.uint16))
    elif kind == "complex64":
        np.save(src, np.ones(4, np.complex64))
    elif kind == "zero_rows":
        np.save(src, np.zeros((0, 3), np.float32))
    elif kind == "object":
        np.save(src, np.array([1, "a"], dtype=object), allow_pickle=True)
    else:
        src.write_bytes(b"not a numpy file at all")
    dst = work / f"uns_{kind}.h5"
    r = gl_cli("convert", src, dst)
    assert_one_line_error(r, src.name)
    assert not dst.exists()


@needs_h5
@needs_zarr
def test_convert_bfloat16_between_hdf5_and_zarr_and_refused_to_npy(work):
    t = (torch.arange(12, dtype=torch.float32).reshape(4, 3) / 3).to(torch.bfloat16)
    src = work / "bf.h5"
    gl.DataGadget(t, placement="cpu").save(str(src))
    r = gl_cli("convert", src, work / "bf.zarr")
    assert r.rc == 0, r.err
    r = gl_cli("convert", work / "bf.zarr", work / "bf2.h5")
    assert r.rc == 0, r.err
    for p in (work / "bf.zarr", work / "bf2.h5"):
        g = gl.DataGadget(str(p), placement="cpu")
        got = g.getData(torch.arange(4))
        assert got.dtype == torch.bfloat16 and torch.equal(
            got.view(torch.int16), t.view(torch.int16)
        )
    r = gl_cli("convert", src, work / "bf.npy")
    assert_one_line_error(r, "bfloat16")
    assert not (work / "bf.npy").exists()


def test_convert_progress_flags(work):
    r = gl_cli("convert", work / "a.npy", work / "prog.npy", "--progress")
    assert r.rc == 0, r.err
    assert "convert" in r.err and "%" in r.err  # a bar on stderr
    r = gl_cli("convert", work / "a.npy", work / "prog2.npy", "--no-progress")
    assert r.rc == 0 and "%" not in r.err
    assert np.array_equal(np.load(work / "prog2.npy"), np.load(work / "a.npy"))


def test_convert_missing_arguments_are_usage_errors():
    r = gl_cli("convert")
    assert r.rc == 2 and "src" in r.err and "dst" in r.err
    r = gl_cli()
    assert r.rc == 2 and len(error_lines(r.err)) == 1
    r = gl_cli("bogus")
    assert_one_line_error(r, "bogus")


@needs_zarr
def test_convert_ctrl_c_removes_partial_and_keeps_old_target(runs):
    r = runs.get("interrupt")
    if r.early:
        pytest.skip("the convert finished before it could be interrupted")
    assert r.rc != 0
    assert "Traceback" not in r.err
    assert len([ln for ln in r.err.splitlines() if ln.strip()]) == 1, r.err
    assert "interrupt" in r.err.lower()
    assert r.leftovers == []  # README: an interrupt ... removes the partial file
    assert r.after is not None and np.array_equal(r.after, r.old)  # the old store stays whole


# =========================================================================== word2vec


def _vocab(path):
    rows = [ln.split() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [w for w, _ in rows], [int(c) for _, c in rows]


def test_word2vec_outputs_vocab_and_vectors(runs, work):
    r = ok_run(runs, "w2v")
    out = work / "w2v_out"
    vec = np.load(out / "v.npy")
    words, counts = _vocab(out / "v.vocab.txt")
    assert vec.dtype == np.float32 and vec.shape == (len(words), 8)
    assert np.isfinite(vec).all()
    # lower-cased like the corpus, read as UTF-8
    assert sorted(words) == sorted(
        ["king", "queen", "man", "woman", "royal", "café", "crown", "throne"]
    )
    assert sum(counts) == 1500
    assert counts == sorted(counts, reverse=True)
    assert f"vocabulary {len(words)} words" in r.stdout
    assert str(out / "v.npy") in r.stdout


def test_word2vec_show_neighbours_match_saved_vectors(runs, work):
    r = ok_run(runs, "w2v")
    vec = np.load(work / "w2v_out" / "v.npy").astype(np.float64)
    words, _ = _vocab(work / "w2v_out" / "v.vocab.txt")
    n = vec / np.linalg.norm(vec, axis=1, keepdims=True)
    shown = {}
    for ln in r.stdout.splitlines():
        m = re.match(r"^(\S+): (.*)$", ln)
        if m:
            shown[m.group(1)] = m.group(2)
    # --show King,QUEEN,zzz: lower-cased; the unknown one is reported
    assert set(shown) == {"king", "queen", "zzz"}, shown
    assert "not in the vocabulary" in shown["zzz"]
    for w in ("king", "queen"):
        pairs = re.findall(r"(\S+) \((-?[\d.]+)\)", shown[w])
        assert len(pairs) >= 3
        i = words.index(w)
        cos = n @ n[i]
        for other, c in pairs:
            assert other != w
            assert abs(cos[words.index(other)] - float(c)) <= 0.006, (w, other, c)
        order = [words[j] for j in np.argsort(-cos) if j != i][: len(pairs)]
        got = [p[0] for p in pairs]
        cs = [float(p[1]) for p in pairs]
        assert cs == sorted(cs, reverse=True)
        assert set(got) == set(order) or all(  # ties within rounding may swap
            abs(cos[words.index(a)] - cos[words.index(b)]) < 0.01
            for a, b in zip(got, order, strict=True)
        )


def test_word2vec_same_seed_same_vectors(runs, work):
    ok_run(runs, "w2v")
    ok_run(runs, "w2v_again")
    a = np.load(work / "w2v_out" / "v.npy")
    b = np.load(work / "w2v_out2" / "v.npy")
    assert np.array_equal(a, b)
    assert (work / "w2v_out" / "v.vocab.txt").read_text() == (
        work / "w2v_out2" / "v.vocab.txt"
    ).read_text()


def test_word2vec_save_failing_after_training_is_one_line_error(runs, work):
    r = runs.get("w2v_savefail")
    # README: a save that fails after training is a one-line error too (1 for the rest)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert len(error_lines(r.stderr)) == 1 and "v.npy" in r.stderr
    assert "vocabulary" in r.stdout  # the training did run


W2V_BAD = [
    (["--dim", "0"], "--dim"),
    (["--dim", "-1"], "--dim"),
    (["--dim", "x"], "--dim"),
    (["--epochs", "0"], "--epochs"),
    (["--window", "0"], "--window"),
    (["--negatives", "0"], "--negatives"),
    (["--batch-size", "0"], "--batch-size"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-0.5"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "1e31"], "--lr"),
    (["--min-count", "0"], "--min-count"),
    (["--seed", "-1"], "--seed"),
    (["--placement", "bogus"], "--placement"),
    (["--device", "bogus"], "bogus"),
    (["--bogus"], "--bogus"),
]


@pytest.mark.parametrize("args,frag", W2V_BAD, ids=[" ".join(a) for a, _ in W2V_BAD])
def test_word2vec_bad_arguments_exit_2_before_training(work, args, frag):
    out = work / "w2v_bad"
    r = w2v(work / "corpus.txt", "--no-progress", "--out", out, *args)
    assert_one_line_error(r, frag)
    assert r.rc == 2  # README: exit status 2 for bad arguments
    assert not glob.glob(str(work / "w2v_bad*"))


def test_word2vec_out_problems_are_errors_before_training(work):
    c = work / "corpus.txt"
    r = w2v(c, "--no-progress", "--out", work / "no-such-dir" / "v")
    assert_one_line_error(r, "--out")
    r = w2v(c, "--no-progress", "--out", work)  # an --out that names a folder
    assert_one_line_error(r, "--out")
    d = work / "outdir"
    (d / "v.npy").mkdir(parents=True)
    r = w2v(c, "--no-progress", "--out", d / "v")
    assert_one_line_error(r, "--out")
    assert sorted(p.name for p in d.iterdir()) == ["v.npy"]


def test_word2vec_missing_corpus_is_one_line_error(work):
    r = w2v(work / "nosuch.txt", "--no-progress")
    assert_one_line_error(r, "nosuch.txt")
    r = w2v(work, "--no-progress")  # a folder
    assert_one_line_error(r, str(work))


@pytest.mark.parametrize(
    "text,extra",
    [
        ("one one one\n", []),
        ("", []),
        ("a b a b c\n", ["--min-count", "5"]),
    ],
)
def test_word2vec_fewer_than_two_words_exit_1(work, text, extra):
    p = work / f"small_{len(text)}_{len(extra)}.txt"
    p.write_text(text)
    r = w2v(p, "--no-progress", "--out", work / "small_out", *extra)
    assert_one_line_error(r, p.name)
    assert r.rc == 1  # not a bad argument: "1 for the rest"
    assert not glob.glob(str(work / "small_out*"))
