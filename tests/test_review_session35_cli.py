"""Review (session 35): the ``gadgetloader`` command line, black-box.

Written from README.md (the "Install and try" block, the seed / sweep / files / pipeline /
train sections, the paragraph on ``convert`` and exit statuses), the commands' ``-h`` text
and ``gadgetloader.convert.convert``'s docstring. Every benchmark runs with the smallest
sizes its options allow, with CUDA hidden (``CUDA_VISIBLE_DEVICES=""``), in two driver
processes started together once (module fixture ``runs``), so the whole file stays well
under 90 s.
Usage errors and ``convert`` run in-process through ``gadgetloader.cli.main(argv)``, the
console script's entry point (``[project.scripts] gadgetloader = "gadgetloader.cli:main"``).

What the docs promise and this file checks:

* exit status 0 on success, 2 for a bad argument (argparse's usage, then one line naming the
  command: "gadgetloader bench sweep: error: ..."), 1 for other errors in one line (a file
  that cannot be written, not enough memory for the sizes asked, a result that failed its
  check -- the report and JSON are written first);
* ``--json`` (and ``--plot`` / ``--profile``) paths are checked before the run;
* JSON fields consistent with each other and with the options given;
* ``convert`` keeps values, dtypes and shapes, honours ``--dataset`` / ``--dst-dataset`` /
  ``--chunk-rows`` / ``--compression``, writes atomically (a failure leaves the target as
  it was) and refuses to write over its own source.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import gadgetloader as gl
from gadgetloader.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")

REPO = Path(__file__).resolve().parents[1]
ENV = os.environ.copy()
ENV["CUDA_VISIBLE_DEVICES"] = ""
ENV["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
HAS_H5PY = importlib.util.find_spec("h5py") is not None
HAS_ZARR = importlib.util.find_spec("zarr") is not None
FILE_FORMATS = ["npy"] + (["hdf5"] if HAS_H5PY else []) + (["zarr"] if HAS_ZARR else [])
REL = 1e-6
OLD_JSON = '{"old": "results of an earlier run"}\n'

# tiny sizes for every suite: a bad value that is wrongly accepted runs a small benchmark
TINY = {
    "seed": ["--rows", "100", "--width", "4", "--ids", "10", "--repeats", "1"],
    "sweep": ["--sizes-gb", "0.001", "--widths", "8", "--ids", "64", "--repeats", "1"],
    "files": ["--mb", "0.02", "--random-mb", "0.02", "--width", "4", "--ids", "16"]
    + ["--repeats", "1", "--formats", "npy"],
    "pipeline": ["--rows", "256", "--width", "4", "--batch", "32", "--batches", "4"]
    + ["--seconds", "0.1", "--repeats", "1", "--workers", "0", "--sources", "memory"],
    "train": ["--rows", "100", "--dim", "4", "--batch", "8", "--negatives", "1"]
    + ["--steps", "1", "--warmup", "0", "--repeats", "1"],
}

#: One driver process runs many steps, each ``gadgetloader.cli.main(argv)`` in its own folder
#: with stdout / stderr captured (an exception main() lets through is recorded with its
#: traceback, as the interpreter would print it, and exit status 1). A step may replace one
#: public method of the library for its duration (a simulated library bug, to see whether
#: the benchmark's check notices), limit the size of files written (RLIMIT_FSIZE: a write
#: past it fails with EFBIG, as on a full disk; Python ignores SIGXFSZ), or give main() a
#: stdout whose reader has gone (`gadgetloader ... | head -1` after head exited).
DRIVER = r"""
import contextlib, io, json, os, resource, sys, traceback
import torch
import gadgetloader as gl
from gadgetloader.cli import main


def _raising(orig):
    def bad(self, *a, **k):
        raise TypeError("simulated library bug")
    return bad


def _wrong_rows(orig):
    def bad(self, *a, **k):
        out = orig(self, *a, **k)
        return out + 1 if out.is_floating_point() else out
    return bad


def _corrupt(o):
    if isinstance(o, torch.Tensor):
        return o + 1
    if isinstance(o, (list, tuple)):
        return type(o)(_corrupt(x) for x in o)
    return o


def _wrong_batches(orig):
    def bad(self, *a, **k):
        return _corrupt(orig(self, *a, **k))
    return bad


PATCHES = {
    "raising_getdata": (gl.DataGadget, "getData", _raising),
    "wrong_getdata": (gl.DataGadget, "getData", _wrong_rows),
    "wrong_getitems": (gl.GadgetDataset, "__getitems__", _wrong_batches),
}

results = {}
for step in json.load(open(sys.argv[1])):
    os.chdir(step["cwd"])
    undo = None
    if step.get("patch"):
        owner, name, make = PATCHES[step["patch"]]
        undo = (owner, name, owner.__dict__[name])
        setattr(owner, name, make(undo[2]))
    out, err = io.StringIO(), io.StringIO()
    target = out
    if step.get("closed_stdout"):
        r, w = os.pipe()
        os.close(r)
        target = os.fdopen(w, "w", buffering=1)  # line-buffered: as under python -u
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        with contextlib.redirect_stdout(target), contextlib.redirect_stderr(err):
            if step.get("fsize"):
                resource.setrlimit(resource.RLIMIT_FSIZE, (step["fsize"], hard))
            try:
                rc = main(step["argv"])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                err.write(traceback.format_exc())
                rc = 1
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    finally:
        if undo is not None:
            setattr(*undo)
        if target is not out:
            with contextlib.suppress(OSError):
                target.close()
    results[step["name"]] = {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


@dataclass
class Step:
    argv: list[str]
    patch: str | None = None
    fsize: int | None = None
    closed_stdout: bool = False


@dataclass
class Result:
    rc: int
    out: str
    err: str
    cwd: Path


def _steps(base: Path) -> list[dict[str, Step]]:
    """Two groups of steps, one driver process each (they run side by side)."""
    keep_dir = base / "keep"
    keep_dir.mkdir()
    T = TINY
    first = {
        # no suite name: the seed benchmark; --ids above --rows is capped to --rows
        "seed": Step(
            ["bench", "--rows", "300", "--width", "6", "--ids", "1000", "--dtype", "float64"]
            + ["--repeats", "3", "--seed", "7", "--json", "seed.json"]
        ),
        "seed_bf16": Step(
            ["bench", "seed", "--rows", "64", "--width", "3", "--ids", "16"]
            + ["--dtype", "bfloat16", "--repeats", "1", "--json", "seed_bf16.json"]
        ),
        "files": Step(
            ["bench", "files", "--mb", "0.05", "--width", "4", "--random-mb", "0.03"]
            + ["--random-chunk-rows", "16", "--chunk-rows", "100", "--cache-mb", "0.01"]
            + ["--ids", "50", "--repeats", "1", "--compression", "gzip", "--seed", "3"]
            + ["--dir", str(keep_dir), "--keep", "--json", "files.json"]
        ),
        "files_gb": Step(
            ["bench", "files", "--gb", "0.00002", "--mb", "999", "--formats", "npy"]
            + ["--no-baselines", "--width", "4", "--random-mb", "0.01", "--ids", "20"]
            + ["--repeats", "1", "--json", "files_gb.json"]
        ),
        "pipeline": Step(
            ["bench", "pipeline", "--rows", "200", "--width", "5", "--dtype", "float64"]
            + ["--batch", "500", "--batches", "3", "--seconds", "0.2", "--repeats", "1"]
            + ["--workers", "0", "--prefetch", "0", "--coalesce", "2", "--sources", "memory"]
            + ["--json", "pipeline.json"]
        ),
        "sweep": Step(["bench", "sweep", *T["sweep"], "--json", "sweep.json", "--plot", "s.png"]),
        "info": Step(["info", "--json", "info.json"]),
        # a JSON write that fails part-way: no partial file
        "json_fsize": Step(["bench", "seed", *T["seed"], "--json", "limited.json"], fsize=600),
        # sizes whose byte count does not fit 64 bits: one line, not a traceback
        "overflow_seed": Step(["bench", "seed", "--rows", str(2**62), "--width", "1"]),
        "overflow_train": Step(["bench", "train", "--rows", str(2**62)]),
        "overflow_files": Step(["bench", "files", "--mb", "1", "--width", str(2**60)]),
        "overflow_pipeline": Step(["bench", "pipeline", "--rows", "1000", "--width", str(2**60)]),
        # convert into a file system that fails part-way
        "convert_fsize_h5": Step(["convert", "src.npy", "out.h5"], fsize=20_000),
    }
    second = {
        "train": Step(
            ["bench", "train", "--rows", "200", "--dim", "4", "--batch", "16"]
            + ["--negatives", "2", "--steps", "2", "--warmup", "1", "--repeats", "1"]
            + ["--lr", "0.01", "--zipf", "0", "--methods", "gpu,switchers,dropin,resident"]
            + ["--profile", "prof.txt", "--json", "train.json"]
        ),
        # a library bug the benchmark must not report as a success
        "seed_raising": Step(
            ["bench", "seed", *T["seed"], "--json", "raising.json"], patch="raising_getdata"
        ),
        "files_wrong": Step(
            ["bench", "files", *T["files"], "--no-baselines", "--json", "files_wrong.json"],
            patch="wrong_getdata",
        ),
        "pipeline_wrong": Step(
            ["bench", "pipeline", *T["pipeline"], "--json", "pipeline_wrong.json"],
            patch="wrong_getitems",
        ),
        # output paths that cannot be written: refused before the run
        "json_trailing_slash": Step(["bench", "seed", *T["seed"], "--json", "nodir/"]),
        "json_dangling_link": Step(["bench", "seed", *T["seed"], "--json", "dangling.json"]),
        "json_empty": Step(["bench", "seed", *T["seed"], "--json", ""]),
        "profile_empty": Step(["bench", "train", *T["train"], "--profile", ""]),
        "json_is_profile": Step(
            ["bench", "train", *T["train"], "--json", "same.txt", "--profile", "same.txt"]
        ),
        # stdout closed by its reader (`| head -1`)
        "closed_stdout_seed": Step(
            ["bench", "seed", *T["seed"], "--json", "closed_seed.json"], closed_stdout=True
        ),
        "closed_stdout_files": Step(
            ["bench", "files", *T["files"], "--json", "closed_files.json"], closed_stdout=True
        ),
    }
    return [first, second]


def _run_driver(steps: dict[str, Step], dirs: dict[str, Path], work: Path) -> dict[str, Result]:
    spec = [
        {
            "name": name,
            "cwd": str(dirs[name]),
            "argv": s.argv,
            "patch": s.patch,
            "fsize": s.fsize,
            "closed_stdout": s.closed_stdout,
        }
        for name, s in steps.items()
    ]
    spec_file, out_file = work / "spec.json", work / "results.json"
    spec_file.write_text(json.dumps(spec))
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, str(spec_file), str(out_file)],
        cwd=work,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    raw = json.loads(out_file.read_text())
    return {name: Result(v["rc"], v["out"], v["err"], dirs[name]) for name, v in raw.items()}


def _run_command(argv: list[str], cwd: Path) -> Result:
    p = subprocess.run(
        [sys.executable, "-m", "gadgetloader", *argv],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return Result(p.returncode, p.stdout, p.stderr, cwd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    base = tmp_path_factory.mktemp("cli35")
    groups = _steps(base)
    dirs: dict[str, Path] = {}
    for group in groups:
        for name in group:
            dirs[name] = base / name
            dirs[name].mkdir()
    (dirs["seed"] / "seed.json").write_text("x" * 100_000)  # an older, longer file
    (dirs["train"] / "prof.txt").write_text("EARLIER PROFILE\n")
    os.symlink("missing-folder/x.json", dirs["json_dangling_link"] / "dangling.json")
    (dirs["json_fsize"] / "limited.json").write_text(OLD_JSON)
    rng = np.random.default_rng(0)
    np.save(dirs["convert_fsize_h5"] / "src.npy", rng.random((2000, 16), dtype=np.float32))
    (dirs["convert_fsize_h5"] / "out.h5").write_bytes(b"an older out.h5")
    (base / "console").mkdir()
    with ThreadPoolExecutor(3) as pool:
        futures = []
        for i, group in enumerate(groups):
            work = base / f"driver{i}"
            work.mkdir()
            futures.append(pool.submit(_run_driver, group, dirs, work))
        console = pool.submit(
            _run_command, ["bench", "seed", *TINY["seed"], "--rows", "0"], base / "console"
        )
        results: dict[str, Result] = {}
        for f in futures:
            results.update(f.result())
        results["console"] = console.result()
    return results


def _json(res: Result, name: str) -> dict:
    return json.loads((res.cwd / name).read_text())


def _ok(res: Result) -> None:
    assert res.rc == 0, (res.rc, res.err[-3000:])


def _close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def _one_line_error(res: Result, rc: int | tuple[int, ...] = 1) -> None:
    codes = (rc,) if isinstance(rc, int) else rc
    assert res.rc in codes, (res.rc, res.err[-3000:])
    assert "Traceback" not in res.err, res.err[-3000:]
    lines = [ln for ln in res.err.strip().splitlines() if ln.strip()]
    if res.rc == 1:
        assert len(lines) == 1, res.err[-3000:]
    assert lines and "error" in lines[-1], res.err[-3000:]


def _table(out: str, first_cells: tuple[str, ...]) -> list[list[str]]:
    rows = []
    for line in out.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] in first_cells:
                rows.append(cells)
    return rows


# --------------------------------------------------------------------------------------
# in-process helpers
# --------------------------------------------------------------------------------------


def _main(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) with stdout / stderr captured; a SystemExit is turned into its code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(rc), out.getvalue(), err.getvalue()


def _usage_error(rc: int, out: str, err: str, command: str, word: str) -> None:
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"usage: gadgetloader {command}"), err
    assert lines[-1].startswith(f"gadgetloader {command}: error:"), err
    assert word in lines[-1], err
    assert out == ""


# ======================================================================================
# help, version, command words
# ======================================================================================


def test_top_level_help_lists_the_three_commands_and_version():
    rc, out, _ = _main(["--help"])
    assert rc == 0
    for word in ("info", "bench", "convert", "--version"):
        assert word in out
    rc, out, _ = _main(["--version"])
    assert rc == 0 and out.strip() == f"gadgetloader {gl.__version__}"


def test_console_module_reports_a_bad_value_as_one_usage_error(runs):
    """`python -m gadgetloader` (the console script) in its own process: exit 2, argparse's
    usage, then one line naming the command and the option; no traceback."""
    r = runs["console"]
    assert r.rc == 2 and r.out == "" and "Traceback" not in r.err
    lines = r.err.strip().splitlines()
    assert lines[0].startswith("usage: gadgetloader bench seed")
    assert lines[-1].startswith("gadgetloader bench seed: error:") and "--rows" in lines[-1]


SUITE_OPTIONS = {
    "seed": ["--json", "--rows", "--width", "--ids", "--dtype", "--repeats", "--seed"],
    "sweep": ["--sizes-gb", "--widths", "--strategies", "--hybrid-fractions", "--pages", "--plot"],
    "files": ["--mb", "--gb", "--dir", "--keep", "--formats", "--cache-mb", "--no-baselines"],
    "pipeline": ["--batch", "--batches", "--seconds", "--workers", "--sources", "--coalesce"],
    "train": ["--dim", "--negatives", "--zipf", "--placement", "--methods", "--profile"],
}


def test_each_suite_help_lists_its_documented_options():
    rc, out, _ = _main(["bench", "-h"])
    assert rc == 0
    for suite, options in SUITE_OPTIONS.items():
        assert suite in out
        rc, out_suite, _ = _main(["bench", suite, "-h"])
        assert rc == 0 and out_suite.startswith(f"usage: gadgetloader bench {suite}")
        for opt in options:
            assert opt in out_suite, (suite, opt)


@pytest.mark.parametrize(
    "argv, command",
    [
        ([], ""),
        (["bench", "bogus-suite"], "bench"),
        (["bench", "--rows", "100", "files"], "bench"),
        (["convert", "a.npy", "b.h5", "--progress", "--no-progress"], "convert"),
    ],
)
def test_command_word_errors_are_usage_errors(argv, command):
    rc, out, err = _main(argv)
    assert rc == 2 and out == "" and "Traceback" not in err
    prefix = f"gadgetloader {command}".strip() + ":"
    assert err.strip().splitlines()[-1].startswith(prefix), err


# ======================================================================================
# bad option values: exit 2, one line naming the command and the option, nothing written
# ======================================================================================

BAD_VALUES = [
    ("seed", ["--rows", "0"], "--rows"),
    ("seed", ["--seed", str(2**62 + 1)], "--seed"),
    ("seed", ["--dtype", "uint16"], "--dtype"),
    ("sweep", ["--sizes-gb", "nan"], "--sizes-gb"),
    ("sweep", ["--strategies", "kernel-u17"], "--strategies"),
    ("sweep", ["--pages", "bogus"], "--pages"),
    ("sweep", ["--hybrid-fractions", "1.5"], "--hybrid-fractions"),
    ("files", ["--mb", "0"], "--mb"),
    ("files", ["--formats", "npy,foo"], "--formats"),
    ("files", ["--formats", "npy,zarr", "--compression", "lzf"], "--compression"),
    ("pipeline", ["--width", "2"], "--width"),
    ("pipeline", ["--sources", "disk"], "--sources"),
    ("pipeline", ["--coalesce", "0"], "--coalesce"),
    ("train", ["--lr", "inf"], "--lr"),
    ("train", ["--placement", "file"], "--placement"),
    ("train", ["--methods", "gpu,bogus"], "--methods"),
]


@pytest.mark.parametrize(
    "suite, bad, word", BAD_VALUES, ids=[f"{s}{''.join(b)}" for s, b, _ in BAD_VALUES]
)
def test_bad_option_value_is_a_usage_error_and_writes_nothing(tmp_path, suite, bad, word):
    out_json = tmp_path / "r.json"
    rc, out, err = _main(["bench", suite, *TINY[suite], *bad, "--json", str(out_json)])
    _usage_error(rc, out, err, f"bench {suite}", word)
    assert not out_json.exists()


@pytest.mark.parametrize(
    "option, where",
    [
        ("--json", "missing-folder/r.json"),
        ("--json", "a-file/r.json"),
        ("--plot", "missing-folder/p.png"),
        ("--profile", "missing-folder/prof.txt"),
    ],
)
def test_unwritable_output_paths_are_refused_before_the_run(tmp_path, option, where):
    (tmp_path / "a-file").write_text("x")
    suite = {"--json": "seed", "--plot": "sweep", "--profile": "train"}[option]
    path = str(tmp_path / where)
    rc, out, err = _main(["bench", suite, *TINY[suite], option, path])
    _usage_error(rc, out, err, f"bench {suite}", option)
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_info_json_empty_path_is_refused(tmp_path):
    """`--json FILE`: an empty name is no file; taking it silently writes nothing."""
    rc, out, err = _main(["info", "--no-measure", "--json", ""])
    assert rc == 2, (rc, out[-500:], err)


# ======================================================================================
# seed
# ======================================================================================


def test_seed_default_suite_json_fields_and_ids_capped(runs):
    r = runs["seed"]
    _ok(r)
    d = _json(r, "seed.json")  # an older, longer file was there: replaced, not appended to
    assert d["benchmark"] == "seed"
    assert (d["rows"], d["width"], d["dtype"]) == (300, 6, "float64")
    assert d["ids"] == 300  # --ids 1000 > --rows: capped, "the report gives the count used"
    assert d["bytes_moved"] == 300 * 6 * 8
    assert d["device"] == "cpu"
    assert {x["kind"] for x in d["results"]} == {"gather", "scatter"}
    assert all(x["check"] == "ok" for x in d["results"])
    assert "wrote seed.json" in r.out


def test_seed_rates_and_ratios_are_consistent(runs):
    d = _json(runs["seed"], "seed.json")
    naive = {x["kind"]: x["ms"] for x in d["results"] if x["method"].startswith("torch naive")}
    assert set(naive) == {"gather", "scatter"}
    for x in d["results"]:
        assert x["ms"] > 0
        assert _close(x["GBps"], d["bytes_moved"] / (x["ms"] * 1e-3) / 1e9), x
        assert _close(x["x_naive"], naive[x["kind"]] / x["ms"]), x


def test_seed_printed_table_matches_json(runs):
    r = runs["seed"]
    d = _json(r, "seed.json")
    rows = _table(r.out, ("gather", "scatter"))
    assert len(rows) == len(d["results"])
    for cells, x in zip(rows, d["results"], strict=True):
        assert (cells[0], cells[1], cells[-1]) == (x["kind"], x["method"], x["check"])
        assert _close(float(cells[2]), x["ms"], 0.006), (cells, x)


def test_seed_without_cuda_lists_what_it_skipped(runs):
    r = runs["seed"]
    d = _json(r, "seed.json")
    assert d["skipped"] and "skipped:" in r.out
    assert all(x["of_limit"] is None for x in d["results"])


def test_seed_bfloat16_bytes_moved_uses_two_bytes(runs):
    r = runs["seed_bf16"]
    _ok(r)
    d = _json(r, "seed_bf16.json")
    assert d["dtype"] == "bfloat16" and d["ids"] == 16
    assert d["bytes_moved"] == 16 * 3 * 2
    assert all(x["check"] == "ok" for x in d["results"])


# ======================================================================================
# files
# ======================================================================================


def test_files_config_honours_every_size_option(runs):
    r = runs["files"]
    _ok(r)
    c = _json(r, "files.json")["config"]
    assert c["table_bytes"] == 50_000 and c["width"] == 4 and c["dtype"] == "float32"
    assert c["rows"] == 50_000 // 16
    assert c["random_table_bytes"] == 30_000 and c["random_rows"] == 30_000 // 16
    assert c["random_chunk_rows"] == 16
    assert c["cache_bytes"] == 10_000
    assert c["ids_per_call"] == 50 and c["repeats"] == 1
    assert Path(c["dir"]).resolve().is_relative_to((r.cwd.parent / "keep").resolve())


def test_files_load_and_write_rates_are_consistent(runs):
    d = _json(runs["files"], "files.json")
    size = d["config"]["table_bytes"]
    disk = d["disk"]["read_GBps"]
    assert [x["format"] for x in d["load"]] == FILE_FORMATS
    for x in d["load"]:
        assert _close(x["GBps"] * x["seconds"], size / 1e9), x
        assert _close(x["fraction_of_disk"], x["GBps"] / disk), x
        assert _close(x["fraction_of_disk_with_alloc"], x["GBps_with_alloc"] / disk), x
        assert x["checked"] is True
    for x in d["write"]:
        assert _close(x["GBps"] * x["seconds"], size / 1e9), x


def test_files_random_reads_are_consistent(runs):
    d = _json(runs["files"], "files.json")
    ids = d["config"]["ids_per_call"]
    by_format: dict[str, list[dict]] = {}
    for x in d["random"]:
        by_format.setdefault(x["format"], []).append(x)
        assert _close(x["rows_per_s"], ids / (x["ms"] * 1e-3)), x
        assert _close(x["GBps"], x["rows_per_s"] * 4 * 4 / 1e9), x
    assert sorted(by_format) == sorted(FILE_FORMATS)
    for rows in by_format.values():
        ours = [x for x in rows if x["method"] == "gadgetloader file store"]
        base = [x for x in rows if x["method"] != "gadgetloader file store"]
        assert len(ours) == 1 and len(base) == 1
        assert _close(ours[0]["speedup_vs_baseline"], base[0]["ms"] / ours[0]["ms"])
    checks = [x["checked"] for x in d["load"] + d["random"]]
    assert d["checks_passed"] is all(checks) is True


def test_files_keep_leaves_files_with_the_chunking_asked_for(runs):
    """--keep: the files stay in --dir; the load-test table has --chunk-rows rows a chunk
    (zarr: --compression), the random-read table --random-chunk-rows; both hold the same
    table in every format (found by shape, whatever the files are called)."""
    d = _json(runs["files"], "files.json")
    c = d["config"]
    folder = Path(c["dir"])
    if not folder.is_absolute():
        folder = runs["files"].cwd / folder
    assert folder.is_dir()
    load_shape, random_shape = (c["rows"], 4), (c["random_rows"], 4)
    npys = {np.load(p, mmap_mode="r").shape: np.load(p) for p in folder.rglob("*.npy")}
    assert set(npys) == {load_shape, random_shape}
    if HAS_H5PY:
        import h5py

        seen = set()
        for path in folder.rglob("*.h5"):
            with h5py.File(path, "r") as f:
                (name,) = list(f)
                ds = f[name]
                want = 100 if ds.shape == load_shape else 16
                assert ds.chunks[0] == want, (path.name, ds.chunks)
                np.testing.assert_array_equal(ds[...], npys[ds.shape])
                seen.add(ds.shape)
        assert seen == {load_shape, random_shape}
    if HAS_ZARR:
        import zarr

        seen = set()
        for path in folder.glob("*.zarr"):
            z = zarr.open(str(path), mode="r")
            if z.shape == load_shape:
                assert z.chunks[0] == 100, z.chunks
                assert "gzip" in " ".join(type(x).__name__.lower() for x in z.compressors)
            else:
                assert z.chunks[0] == 16, z.chunks
            np.testing.assert_array_equal(z[...], npys[z.shape])
            seen.add(z.shape)
        assert seen == {load_shape, random_shape}


def test_files_gb_overrides_mb_formats_subset_no_baselines_temp_removed(runs):
    r = runs["files_gb"]
    _ok(r)
    d = _json(r, "files_gb.json")
    assert d["config"]["table_bytes"] == 20_000  # --gb 0.00002 wins over --mb 999
    assert [x["format"] for x in d["load"]] == ["npy"]
    assert [x["method"] for x in d["random"]] == ["gadgetloader file store"]
    folder = Path(d["config"]["dir"])
    assert not folder.exists()  # no --keep: the temporary files are gone


# ======================================================================================
# pipeline
# ======================================================================================


def test_pipeline_json_honours_options(runs):
    r = runs["pipeline"]
    _ok(r)
    d = _json(r, "pipeline.json")
    assert (d["rows"], d["width"], d["dtype"]) == (200, 5, "float64")
    assert d["batch"] == 200  # --batch 500: "at most --rows"
    assert d["row_bytes"] == 5 * 8
    sources = {x["source"] for x in d["results"]}
    assert not any(s.startswith("file") for s in sources), sources  # --sources memory
    assert [x["workers"] for x in d["results"] if "workers" in x] == [0]
    loader = [x["method"] for x in d["results"] if x["method"].startswith("(d)")]
    assert loader and all("prefetch=0" in m and "coalesce=2" in m for m in loader), loader
    assert all(x["check"] == "ok" for x in d["results"])


def test_pipeline_rates_and_summary_are_consistent(runs):
    d = _json(runs["pipeline"], "pipeline.json")
    best = d["summary"]["best_torch_rows_per_s"]
    for x in d["results"]:
        assert _close(x["rows_per_s"], d["batch"] / (x["us_per_batch"] * 1e-6)), x
        assert _close(x["GBps"], x["rows_per_s"] * d["row_bytes"] / 1e9), x
        assert _close(x["x_torch"], x["rows_per_s"] / best), x
    torch_rows = [x for x in d["results"] if x["method"].startswith("(a)")]
    assert _close(best, max(x["rows_per_s"] for x in torch_rows))
    mem = [x for x in d["results"] if x["source"].startswith("memory")]
    (default,) = [x for x in mem if x["method"].startswith("(b)")]
    (fast,) = [x for x in mem if x["method"].startswith("(c) ") and "random" in x["method"]]
    s = d["summary"]
    assert _close(s["memory_fast_x_torch"], fast["x_torch"])
    assert _close(s["memory_default_vs_fast"], default["us_per_batch"] / fast["us_per_batch"])
    sampler = d["sampler_us_per_batch"]["torch RandomSampler + BatchSampler"]
    if sampler is None:  # "not measured" where an epoch is one batch (--batch == --rows)
        assert s["torch_sampler_vs_fast"] is None
    else:
        assert _close(s["torch_sampler_vs_fast"], sampler / fast["us_per_batch"])


# ======================================================================================
# train
# ======================================================================================


def test_train_json_honours_options(runs):
    r = runs["train"]
    _ok(r)
    d = _json(r, "train.json")
    c = d["config"]
    assert (c["rows"], c["dim"], c["batch"], c["negatives"]) == (200, 4, 16, 2)
    assert (c["steps"], c["warmup"], c["repeats"], c["zipf"]) == (2, 1, 1, 0.0)
    assert list(d["methods"]) == ["gpu", "switchers", "dropin", "resident"]
    assert d["verified"] == {"gpu": "reference", "switchers": True, "dropin": True}
    assert d["device"] == "cpu" and d["skipped"]


def test_train_numbers_are_consistent(runs):
    d = _json(runs["train"], "train.json")
    ms = {k: v["ms_per_step"] for k, v in d["methods"].items()}
    for v in d["methods"].values():
        assert _close(v["steps_per_s"] * v["ms_per_step"], 1000.0), v
        assert v["bytes_per_step"] == v["h2d_bytes_per_step"] + v["d2h_bytes_per_step"]
    assert _close(d["dropin_x_resident"], ms["dropin"] / ms["resident"])


def test_train_profile_is_appended_to(runs):
    text = (runs["train"].cwd / "prof.txt").read_text()
    assert text.startswith("EARLIER PROFILE\n")  # "append torch.profiler tables ... to FILE"
    rest = text[len("EARLIER PROFILE\n") :]
    assert "dropin" in rest and "switchers" in rest


# ======================================================================================
# sweep, info
# ======================================================================================


def test_sweep_without_cuda_is_skipped_plot_not_written_and_says_so(runs):
    r = runs["sweep"]
    _ok(r)
    d = _json(r, "sweep.json")
    assert d["benchmark"] == "sweep" and d["device"] == "cpu"
    assert d["results"] == [] and d["skipped"]
    assert not (r.cwd / "s.png").exists()
    assert "s.png" in r.out and "not written" in r.out


def test_info_json_matches_printed_lines_and_installed_versions(runs):
    r = runs["info"]
    _ok(r)
    d = _json(r, "info.json")
    import numpy
    import torch

    assert d["gadgetloader"] == gl.__version__
    assert d["torch"] == torch.__version__ and d["numpy"] == numpy.__version__
    if HAS_H5PY:
        import h5py

        assert d["h5py"] == h5py.__version__
    if HAS_ZARR:
        import zarr

        assert d["zarr"] == zarr.__version__
    assert d["cuda_available"] is False
    printed = {}
    for line in r.out.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in d:
            printed[key.strip()] = value.strip()
    assert set(printed) == set(d)
    for key, value in d.items():
        if value is not None:
            assert printed[key] == str(value), key


# ======================================================================================
# a failed check: report and JSON written, then exit 1
# ======================================================================================


def test_files_wrong_rows_exit_1_after_writing_json(runs):
    r = runs["files_wrong"]
    assert r.rc == 1, (r.rc, r.err[-2000:])
    d = _json(r, "files_wrong.json")
    assert d["checks_passed"] is False
    assert any(x["checked"] is False for x in d["random"])
    assert r.err.strip().splitlines()[-1].startswith("gadgetloader bench: error:")


def test_pipeline_wrong_batches_exit_1_with_mismatch_rows(runs):
    r = runs["pipeline_wrong"]
    assert r.rc == 1, (r.rc, r.err[-2000:])
    d = _json(r, "pipeline_wrong.json")
    checks = {x["method"]: x["check"] for x in d["results"]}
    assert "MISMATCH" in checks.values()
    assert checks["(a) torch per-sample DataLoader"] == "ok"


def test_seed_run_whose_gadgetloader_methods_raise_is_not_a_success(runs):
    """README: exit 0 "when it succeeds", 1 for other errors. With every gadgetloader
    gather/scatter raising, nothing of gadgetloader was measured or checked."""
    r = runs["seed_raising"]
    d = _json(r, "raising.json")
    errors = [x for x in d["results"] if "error" in x]
    assert errors and all("gadgetloader" in x["method"] for x in errors)
    assert r.rc == 1, f"exit status {r.rc} for a run where {len(errors)} methods raised"


# ======================================================================================
# output paths checked before the run; no partial output
# ======================================================================================


@pytest.mark.parametrize(
    "name, banner",
    [
        ("json_trailing_slash", "seed benchmark"),
        ("json_dangling_link", "seed benchmark"),
        ("json_empty", "seed benchmark"),
        ("profile_empty", "train:"),
    ],
)
def test_output_path_that_cannot_be_a_file_is_refused_before_the_run(runs, name, banner):
    """README: "`--json` paths are checked before the run"; a bad argument exits 2."""
    r = runs[name]
    assert r.rc == 2, (r.rc, r.out[-300:], r.err[-1000:])
    assert banner not in r.out  # the benchmark did not run


def test_json_and_profile_on_one_path_is_refused(runs):
    """Two outputs on one path: the JSON would silently replace the profile just appended."""
    r = runs["json_is_profile"]
    assert r.rc == 2, (r.rc, r.err[-1000:])
    assert not (r.cwd / "same.txt").exists()


def test_json_write_failing_part_way_leaves_no_partial_file(runs):
    r = runs["json_fsize"]
    _one_line_error(r, 1)
    text = (r.cwd / "limited.json").read_text()
    assert text == OLD_JSON, f"left a {len(text)}-byte partial file: {text[:80]!r}"


@pytest.mark.parametrize(
    "name", ["overflow_seed", "overflow_train", "overflow_files", "overflow_pipeline"]
)
def test_sizes_beyond_64_bits_of_bytes_are_one_line_errors(runs, name):
    """README: 1 for ... "not enough memory for the sizes asked" (one line), or a usage
    error (2); never a traceback."""
    _one_line_error(runs[name], (1, 2))


@pytest.mark.parametrize("name", ["closed_stdout_seed", "closed_stdout_files"])
def test_closed_stdout_ends_quietly_and_keeps_the_json(runs, name):
    """A closed stdout (`gadgetloader ... | head`) "ends quietly" (CHANGELOG; `info --json`
    writes its file and ends quietly so): the results, already measured, still reach the
    --json file, and no error is reported for the reader having gone. stdout is
    line-buffered here, as under `python -u` / PYTHONUNBUFFERED=1 (common in containers and
    CI), where each printed line reaches the pipe at once."""
    r = runs[name]
    suite = name.rsplit("_", 1)[1]
    assert "error" not in r.err, r.err[-1000:]
    assert (r.cwd / f"closed_{suite}.json").exists()


# ======================================================================================
# convert
# ======================================================================================

needs_h5 = pytest.mark.skipif(not HAS_H5PY, reason="h5py not installed")
needs_zarr = pytest.mark.skipif(not HAS_ZARR, reason="zarr not installed")
DST_EXT = [
    pytest.param("h5", marks=needs_h5, id="hdf5"),
    pytest.param("zarr", marks=needs_zarr, id="zarr"),
]


def _convert(*argv: str) -> tuple[int, str, str]:
    return _main(["convert", *argv])


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("dtype", ["float16", "int8", "bool", ">f4"])
@pytest.mark.parametrize("ext", DST_EXT)
def test_convert_round_trip_keeps_values_dtype_and_shape(tmp_path, monkeypatch, dtype, ext):
    monkeypatch.chdir(tmp_path)
    a = (np.arange(7 * 5).reshape(7, 5) % 11 - 3).astype(dtype)
    np.save("a.npy", a)
    assert _convert("a.npy", f"mid.{ext}")[0] == 0
    assert _convert(f"mid.{ext}", "back.npy")[0] == 0
    b = np.load("back.npy")
    assert b.shape == a.shape and b.dtype == a.dtype.newbyteorder("=")
    np.testing.assert_array_equal(b, a)


@needs_h5
@needs_zarr
@pytest.mark.parametrize("shape", [(6,), (3, 4, 2)])
def test_convert_keeps_one_and_three_dimensional_shapes(tmp_path, monkeypatch, shape):
    monkeypatch.chdir(tmp_path)
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    np.save("a.npy", a)
    assert _convert("a.npy", "a.h5")[0] == 0
    assert _convert("a.h5", "a.zarr")[0] == 0
    assert _convert("a.zarr", "b.npy")[0] == 0
    np.testing.assert_array_equal(np.load("b.npy"), a)
    assert np.load("b.npy").shape == shape


@needs_h5
def test_convert_hdf5_chunk_rows_and_compression_honoured(tmp_path):
    import h5py

    a = np.random.default_rng(1).random((50, 3), dtype=np.float32)
    np.save(tmp_path / "a.npy", a)
    for comp, expect in [("gzip", "gzip"), ("lzf", "lzf"), ("none", None)]:
        dst = tmp_path / f"{comp}.h5"
        rc, _, err = _convert(
            str(tmp_path / "a.npy"), str(dst), "--chunk-rows", "7", "--compression", comp
        )
        assert rc == 0, err
        with h5py.File(dst, "r") as f:
            (name,) = list(f)
            assert f[name].compression == expect, comp
            assert f[name].chunks[0] == 7
            np.testing.assert_array_equal(f[name][...], a)


@needs_zarr
def test_convert_zarr_chunk_rows_and_compression_honoured(tmp_path):
    import zarr

    a = np.random.default_rng(2).random((50, 3), dtype=np.float32)
    np.save(tmp_path / "a.npy", a)
    for comp in ["zstd", "gzip", "blosc", "none"]:
        dst = tmp_path / f"{comp}.zarr"
        rc, _, err = _convert(
            str(tmp_path / "a.npy"), str(dst), "--chunk-rows", "9", "--compression", comp
        )
        assert rc == 0, err
        z = zarr.open(str(dst), mode="r")
        assert z.chunks[0] == 9
        names = " ".join(type(c).__name__.lower() for c in z.compressors)
        if comp == "none":
            assert z.compressors == (), names
        else:
            assert comp in names, (comp, names)
        np.testing.assert_array_equal(z[...], a)


@needs_zarr
def test_convert_default_zarr_is_zstd_with_about_one_mib_chunks(tmp_path):
    import zarr

    a = np.zeros((100_000, 8), np.float32)  # 32 B rows, 3.2 MB
    np.save(tmp_path / "a.npy", a)
    assert _convert(str(tmp_path / "a.npy"), str(tmp_path / "a.zarr"))[0] == 0
    z = zarr.open(str(tmp_path / "a.zarr"), mode="r")
    assert "zstd" in " ".join(type(c).__name__.lower() for c in z.compressors)
    chunk_bytes = z.chunks[0] * 8 * 4
    assert 2**19 <= chunk_bytes <= 2**21, z.chunks


@needs_h5
@needs_zarr
def test_convert_dataset_and_dst_dataset(tmp_path, monkeypatch):
    import h5py
    import zarr

    monkeypatch.chdir(tmp_path)
    words = np.random.default_rng(3).random((20, 4), dtype=np.float32)
    other = np.arange(30, dtype=np.int64).reshape(10, 3)
    with h5py.File("data.h5", "w") as f:
        f["emb/words"] = words
        f["other"] = other
    # README: `gadgetloader convert data.h5 emb.zarr --dataset emb/words`
    assert _convert("data.h5", "emb.zarr", "--dataset", "emb/words")[0] == 0
    np.testing.assert_array_equal(zarr.open("emb.zarr", mode="r")["emb/words"][...], words)
    # --dst-dataset names it in the destination
    assert _convert("emb.zarr", "back.h5", "--dataset", "emb/words", "--dst-dataset", "w/v")[0] == 0
    with h5py.File("back.h5", "r") as f:
        np.testing.assert_array_equal(f["w/v"][...], words)
    assert _convert("data.h5", "other.npy", "--dataset", "other")[0] == 0
    got = np.load("other.npy")
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, other)


@needs_h5
def test_convert_needs_dataset_when_several_and_names_them(tmp_path, monkeypatch):
    import h5py

    monkeypatch.chdir(tmp_path)
    with h5py.File("two.h5", "w") as f:
        f["a"] = np.ones((3, 2), np.float32)
        f["b"] = np.ones((3, 2), np.float32)
    for extra in ([], ["--dataset", "nope"]):
        rc, out, err = _convert("two.h5", "x.npy", *extra)
        assert rc == 1 and len(err.strip().splitlines()) == 1
        assert "'a'" in err and "'b'" in err
        assert not Path("x.npy").exists()


def test_convert_api_returns_documented_fields(tmp_path):
    from gadgetloader.convert import convert

    a = np.arange(24, dtype=np.int16).reshape(8, 3)
    np.save(tmp_path / "a.npy", a)
    info = convert(tmp_path / "a.npy", tmp_path / "b.npy", progress=False)
    for key in ("src", "dst", "shape", "dtype", "bytes", "seconds"):
        assert key in info, key
    assert tuple(info["shape"]) == (8, 3) and str(info["dtype"]) == "int16"
    assert info["bytes"] == a.nbytes and info["seconds"] >= 0
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), a)


def test_convert_forced_formats(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save("a.npy", a)
    Path("a.npy").rename("table.bin")
    assert _convert("table.bin", "copy.data", "--format", "npy", "--to", "npy")[0] == 0
    np.testing.assert_array_equal(np.load("copy.data"), a)
    rc, out, err = _convert("table.bin", "x.npy", "--format", "hdf5")  # the wrong format
    assert rc == 1 and len(err.strip().splitlines()) == 1 and not Path("x.npy").exists()


@pytest.mark.parametrize(
    "dst, extra, word",
    [
        ("b.npy", ["--compression", "gzip"], "--compression"),
        ("b.npy", ["--chunk-rows", "2"], "--chunk-rows"),
        ("b.npy", ["--dst-dataset", "x"], "--dst-dataset"),
        ("b.h5", ["--dataset", "x"], "--dataset"),
        ("b.h5", ["--compression", "zstd"], "--compression"),
        ("b.zarr", ["--compression", "lzf"], "--compression"),
        ("b.h5", ["--format", "bogus"], "--format"),
        ("b.h5", ["--chunk-rows", "0"], "--chunk-rows"),
    ],
)
def test_convert_bad_options_are_usage_errors_nothing_written(
    tmp_path, monkeypatch, dst, extra, word
):
    if dst.endswith(".h5") and not HAS_H5PY or dst.endswith(".zarr") and not HAS_ZARR:
        pytest.skip("format library not installed")
    monkeypatch.chdir(tmp_path)
    np.save("a.npy", np.ones((4, 2), np.float32))
    rc, out, err = _convert("a.npy", dst, *extra)
    _usage_error(rc, out, err, "convert", word)
    assert _listing(tmp_path) == ["a.npy"]


@pytest.mark.parametrize(
    "make, dst, word",
    [
        (None, "b.npy", "no such file"),
        ("a", "missing-folder/b.npy", "missing-folder"),
        ("uint16", "b.npy", "uint16"),
        ("zero", "b.npy", "zero rows"),
        ("truncated", "b.npy", "truncated"),
    ],
)
def test_convert_file_problems_are_one_line_errors_nothing_written(
    tmp_path, monkeypatch, make, dst, word
):
    monkeypatch.chdir(tmp_path)
    if make == "a":
        np.save("a.npy", np.ones((4, 2), np.float32))
    elif make == "uint16":
        np.save("a.npy", np.ones((4, 2), np.uint16))
    elif make == "zero":
        np.save("a.npy", np.ones((0, 2), np.float32))
    elif make == "truncated":
        np.save("full.npy", np.ones((1000, 4), np.float32))
        raw = Path("full.npy").read_bytes()
        Path("a.npy").write_bytes(raw[: len(raw) // 2])
        Path("full.npy").unlink()
    before = _listing(tmp_path)
    rc, out, err = _convert("a.npy", dst)
    assert rc == 1, (rc, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert word in err
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("how", ["dot", "dotdot", "symlink", "hardlink"])
def test_convert_refuses_to_write_over_its_own_source(tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    Path("sub").mkdir()
    a = np.random.default_rng(4).random((30, 3), dtype=np.float32)
    np.save("a.npy", a)
    raw = Path("a.npy").read_bytes()
    dst = {"dot": "./a.npy", "dotdot": "sub/../a.npy"}.get(how, "link.npy")
    if how == "symlink":
        os.symlink("a.npy", "link.npy")
    elif how == "hardlink":
        os.link("a.npy", "link.npy")
    before = _listing(tmp_path)
    rc, out, err = _convert("a.npy", dst)
    assert rc != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert Path("a.npy").read_bytes() == raw
    assert _listing(tmp_path) == before


@needs_zarr
def test_convert_zarr_onto_itself_with_trailing_slash_refused(tmp_path, monkeypatch):
    import zarr

    monkeypatch.chdir(tmp_path)
    a = np.random.default_rng(5).random((30, 3), dtype=np.float32)
    np.save("a.npy", a)
    assert _convert("a.npy", "a.zarr")[0] == 0
    before = _listing(tmp_path)
    rc, out, err = _convert("a.zarr", "a.zarr/")
    assert rc != 0 and "Traceback" not in err
    assert _listing(tmp_path) == before
    np.testing.assert_array_equal(zarr.open("a.zarr", mode="r")[...], a)


@needs_zarr
@pytest.mark.parametrize("target", ["old.npy", pytest.param("old.h5", marks=needs_h5), "new.npy"])
def test_convert_failing_mid_copy_leaves_target_untouched(tmp_path, monkeypatch, target):
    """A damaged chunk in the middle of the source: the destination stays as it was (or
    absent), and no temporary file is left beside it."""
    monkeypatch.chdir(tmp_path)
    a = np.random.default_rng(6).random((1000, 3), dtype=np.float32)
    np.save("a.npy", a)
    assert _convert("a.npy", "src.zarr", "--chunk-rows", "100", "--compression", "zstd")[0] == 0
    chunk = next(
        p
        for p in Path("src.zarr").rglob("*")
        if p.is_file() and (p.parts[-2:] == ("5", "0") or p.name == "5.0")
    )
    chunk.write_bytes(b"garbage" * 10)
    old = np.full((2, 2), 7, np.float32)
    if target == "old.npy":
        np.save(target, old)
    elif target == "old.h5":
        import h5py

        with h5py.File(target, "w") as f:
            f["keep"] = old
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc, out, err = _convert("src.zarr", target)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_convert_write_failing_part_way_is_one_line_and_keeps_target(runs):
    """README: 1 for other errors, in one line (a file that cannot be written); `convert`
    writes its destination atomically."""
    r = runs["convert_fsize_h5"]
    assert r.rc == 1, (r.rc, r.err[-2000:])
    assert (r.cwd / "out.h5").read_bytes() == b"an older out.h5"
    assert sorted(os.listdir(r.cwd)) == ["out.h5", "src.npy"]  # no partial file
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.err
