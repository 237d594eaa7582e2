"""Black-box review of `gadgetloader bench` (seed, sweep, files, pipeline, train) and
`gadgetloader info` on a machine without CUDA (session 33).

Written from README.md ("`gadgetloader bench` ... every method checked against a CPU
reference first", the exit-status paragraph, the suites' sections) and the commands' own
``-h`` text only. Every benchmark runs with the smallest sizes its options allow. The real
runs start together, in the background, when the module starts (one process per suite
plus two driver processes that call ``gadgetloader.cli.main`` -- the console script's entry
point -- several times, some with a public method of the library deliberately broken to see
whether the benchmark's ``check`` column notices), so the whole file stays well under 90 s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gadgetloader.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
ENV = dict(
    os.environ,
    CUDA_VISIBLE_DEVICES="",
    # the repository first, then whatever the test process was given (packages carried
    # onto a machine through PYTHONPATH, such as zarr)
    PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
)
HAS_H5PY = importlib.util.find_spec("h5py") is not None
HAS_ZARR = importlib.util.find_spec("zarr") is not None
FORMATS = ["npy"] + (["hdf5"] if HAS_H5PY else []) + (["zarr"] if HAS_ZARR else [])
REL = 1e-6


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# --------------------------------------------------------------------------------------
# background runs
# --------------------------------------------------------------------------------------

#: a driver: runs ``gadgetloader.cli.main(argv)`` for each step of a JSON spec, some with one
#: public method of the library replaced for that step only, and records exit status and output
DRIVER = r"""
import contextlib, hashlib, io, json, sys, traceback
import torch
import gadgetloader as gl
from gadgetloader.cli import main

spec = json.load(open(sys.argv[1]))
ids_log = []

def plus_one(orig):
    def f(self, *a, **k):
        r = orig(self, *a, **k)
        return r + 1 if torch.is_tensor(r) and r.is_floating_point() else r
    return f

def noop(orig):
    def f(self, *a, **k):
        return None
    return f

def items_plus_one(orig):
    def f(self, *a, **k):
        r = orig(self, *a, **k)
        r[0][0].add_(1)
        return r
    return f

def fwd_wrong(orig):
    def f(self, *a, **k):
        return orig(self, *a, **k) * 3 + 1
    return f

def log_ids(orig):
    def f(self, ids, *a, **k):
        t = torch.as_tensor(ids).cpu().contiguous()
        ids_log.append(hashlib.sha1(t.numpy().tobytes()).hexdigest()[:12])
        return orig(self, ids, *a, **k)
    return f

PATCHES = {
    "getData+1": (gl.DataGadget, "getData", plus_one),
    "insertData-noop": (gl.DataGadget, "insertData", noop),
    "getitems+1": (gl.GadgetDataset, "__getitems__", items_plus_one),
    "forward-wrong": (gl.OffloadedEmbedding, "forward", fwd_wrong),
    "step-noop": (gl.OffloadedOptimizer, "step", noop),
    "log-getData": (gl.DataGadget, "getData", log_ids),
}

out = {}
for step in spec:
    patch = step.get("patch")
    if patch:
        cls, attr, make = PATCHES[patch]
        saved = cls.__dict__[attr]
        setattr(cls, attr, make(getattr(cls, attr)))
    ids_log.clear()
    o, e = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            rc = main(step["argv"])
    except SystemExit as ex:
        rc = ex.code if isinstance(ex.code, int) else 1
    except BaseException:
        rc = "raised"
        e.write(traceback.format_exc())
    finally:
        if patch:
            setattr(cls, attr, saved)
    out[step["name"]] = {"rc": rc, "stdout": o.getvalue(), "stderr": e.getvalue(),
                         "ids": list(ids_log)}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
"""

SEED_ARGS = [
    "bench",
    "seed",
    "--rows",
    "300",
    "--width",
    "5",
    "--ids",
    "1000",
    "--dtype",
    "float64",
    "--repeats",
    "2",
    "--seed",
    "11",
    "--no-speedtorch",
    "--json",
    "seed.json",
]
FILES_ARGS = [
    "bench",
    "files",
    "--mb",
    "0.3",
    "--width",
    "6",
    "--dir",
    "fdir",
    "--keep",
    "--formats",
    ",".join(FORMATS),
    "--chunk-rows",
    "2000",
    "--compression",
    "gzip",
    "--random-mb",
    "0.05",
    "--random-chunk-rows",
    "40",
    "--cache-mb",
    "0.01",
    "--ids",
    "16",
    "--repeats",
    "2",
    "--seed",
    "7",
    "--json",
    "files.json",
]
PIPE_ARGS = [
    "bench",
    "pipeline",
    "--rows",
    "64",
    "--width",
    "5",
    "--dtype",
    "float64",
    "--batch",
    "100",
    "--batches",
    "3",
    "--seconds",
    "0.2",
    "--repeats",
    "1",
    "--workers",
    "0",
    "--prefetch",
    "1",
    "--coalesce",
    "2",
    "--dir",
    "pdir",
    "--seed",
    "3",
    "--json",
    "pipe.json",
]
TRAIN_ARGS = [
    "bench",
    "train",
    "--rows",
    "120",
    "--dim",
    "4",
    "--batch",
    "8",
    "--negatives",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--repeats",
    "2",
    "--lr",
    "0.01",
    "--zipf",
    "0",
    "--placement",
    "pinned",
    "--seed",
    "5",
    "--json",
    "train.json",
]
SMALL_SEED = ["--rows", "100", "--width", "4", "--ids", "20", "--no-speedtorch"]
SMALL_TRAIN = [
    "--rows",
    "100",
    "--dim",
    "4",
    "--batch",
    "8",
    "--negatives",
    "1",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--repeats",
    "1",
    "--lr",
    "0.05",
]

D1 = [  # info, the default suite, sweep, seed's --repeats/--seed, seed's checks
    {"name": "info", "argv": ["info", "--json", "info.json"]},
    {"name": "info_nomeasure", "argv": ["info", "--no-measure", "--json", "info2.json"]},
    {
        "name": "default",
        "argv": [
            "bench",
            "--rows",
            "40",
            "--width",
            "2",
            "--ids",
            "10",
            "--dtype",
            "int16",
            "--repeats",
            "1",
            "--no-speedtorch",
            "--json",
            "default.json",
        ],
    },
    {
        "name": "sweep",
        "argv": [
            "bench",
            "sweep",
            "--sizes-gb",
            "0.001",
            "--widths",
            "8",
            "--ids",
            "16",
            "--repeats",
            "1",
            "--json",
            "sweep.json",
            "--plot",
            "sweep.png",
        ],
    },
    {
        "name": "rep1_s1",
        "patch": "log-getData",
        "argv": ["bench", "seed", *SMALL_SEED, "--repeats", "1", "--seed", "1"],
    },
    {
        "name": "rep4_s1",
        "patch": "log-getData",
        "argv": ["bench", "seed", *SMALL_SEED, "--repeats", "4", "--seed", "1"],
    },
    {
        "name": "rep1_s1_again",
        "patch": "log-getData",
        "argv": ["bench", "seed", *SMALL_SEED, "--repeats", "1", "--seed", "1"],
    },
    {
        "name": "rep1_s2",
        "patch": "log-getData",
        "argv": ["bench", "seed", *SMALL_SEED, "--repeats", "1", "--seed", "2"],
    },
    {
        "name": "seed_bad_gather",
        "patch": "getData+1",
        "argv": ["bench", "seed", *SMALL_SEED, "--repeats", "1", "--json", "seed_bad_gather.json"],
    },
    {
        "name": "seed_bad_scatter",
        "patch": "insertData-noop",
        "argv": ["bench", "seed", *SMALL_SEED, "--repeats", "1", "--json", "seed_bad_scatter.json"],
    },
]

D2 = [  # pipeline / files / train with a broken library method; train --no-verify
    {
        "name": "pipe_bad",
        "patch": "getitems+1",
        "argv": [
            "bench",
            "pipeline",
            "--rows",
            "64",
            "--width",
            "3",
            "--batch",
            "16",
            "--batches",
            "2",
            "--seconds",
            "0.1",
            "--repeats",
            "1",
            "--workers",
            "0",
            "--sources",
            "memory",
            "--json",
            "pipe_bad.json",
        ],
    },
    {
        "name": "files_bad",
        "patch": "getData+1",
        "argv": [
            "bench",
            "files",
            "--mb",
            "0.05",
            "--width",
            "4",
            "--random-mb",
            "0.05",
            "--ids",
            "8",
            "--repeats",
            "1",
            "--formats",
            "npy",
            "--no-baselines",
            "--dir",
            "fdir_bad",
            "--json",
            "files_bad.json",
        ],
    },
    {
        "name": "train_fwd_pair",
        "patch": "forward-wrong",
        "argv": [
            "bench",
            "train",
            *SMALL_TRAIN,
            "--methods",
            "gpu,dropin",
            "--json",
            "t_fwd_pair.json",
        ],
    },
    {
        "name": "train_fwd_alone",
        "patch": "forward-wrong",
        "argv": [
            "bench",
            "train",
            *SMALL_TRAIN,
            "--methods",
            "dropin",
            "--json",
            "t_fwd_alone.json",
        ],
    },
    {
        "name": "train_step_noop",
        "patch": "step-noop",
        "argv": [
            "bench",
            "train",
            *SMALL_TRAIN,
            "--methods",
            "gpu,dropin",
            "--json",
            "t_noop.json",
        ],
    },
    {
        "name": "train_noverify",
        "argv": [
            "bench",
            "train",
            *SMALL_TRAIN,
            "--methods",
            "switchers,dropin",
            "--no-verify",
            "--profile",
            "prof.txt",
            "--json",
            "t_nv.json",
        ],
    },
]


class Run:
    """One background process; ``result()`` waits for it (once)."""

    def __init__(self, name: str, cmd: list[str], cwd: Path):
        self.name, self.cwd = name, cwd
        self._out = open(cwd / f"{name}.stdout", "wb")  # noqa: SIM115
        self._err = open(cwd / f"{name}.stderr", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=ENV, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err
        )
        self._done = None

    def result(self, timeout: float = 240) -> tuple[int, str, str]:
        if self._done is None:
            try:
                rc = self.proc.wait(timeout=timeout)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
                self._out.close()
                self._err.close()
            self._done = (
                rc,
                (self.cwd / f"{self.name}.stdout").read_text(),
                (self.cwd / f"{self.name}.stderr").read_text(),
            )
        return self._done

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.result(timeout=120)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench33")
    (base / "fdir").mkdir()
    (base / "fdir_bad").mkdir()
    (base / "pdir").mkdir()
    (base / "d1.json").write_text(json.dumps(D1))
    (base / "d2.json").write_text(json.dumps(D2))
    m = [sys.executable, "-m", "gadgetloader"]
    procs = {
        "seed": Run("seed", m + SEED_ARGS, base),
        "train": Run("train", m + TRAIN_ARGS, base),
        "d2": Run("d2", [sys.executable, "-c", DRIVER, "d2.json", "d2.out.json"], base),
        "d1": Run("d1", [sys.executable, "-c", DRIVER, "d1.json", "d1.out.json"], base),
        "files": Run("files", m + FILES_ARGS, base),
        "pipe": Run("pipe", m + PIPE_ARGS, base),
    }
    procs["base"] = base
    yield procs
    for k, r in procs.items():
        if k != "base":
            r.close()


def _proc(runs, name):
    rc, out, err = runs[name].result()
    assert rc == 0, f"{name} exited {rc}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
    return out, err


def _json(runs, name):
    return json.loads((runs["base"] / name).read_text())


def _driver(runs, which):
    rc, out, err = runs[which].result()
    assert rc == 0, f"driver {which} exited {rc}: {err[-3000:]}"
    return json.loads((runs["base"] / f"{which}.out.json").read_text())


def _table(text: str) -> list[dict[str, str]]:
    """The first markdown table of ``text`` as a list of {header: cell}."""
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len(rows) >= 3, text
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    return [
        dict(zip(head, [c.strip() for c in r.strip("|").split("|")], strict=False))
        for r in rows[2:]
        if not set(r) <= set("|- ")
    ]


def _close(a, b, rel=REL):
    return math.isclose(float(a), float(b), rel_tol=rel)


def _num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x%"))


NO_GPU_WORDS = re.compile(r"cuda|nvidia|h200|pinned|gpu-resident", re.I)


# --------------------------------------------------------------------------------------
# bad option values (in process, through the console script's entry point)
# --------------------------------------------------------------------------------------

BAD = [
    ("bench seed --rows 0", "bench seed", "--rows"),
    ("bench seed --width 0", "bench seed", "--width"),
    ("bench seed --dtype complex64", "bench seed", "--dtype"),
    ("bench seed --repeats 0", "bench seed", "--repeats"),
    ("bench seed --seed -1", "bench seed", "--seed"),
    ("bench seed --seed 4611686018427387905", "bench seed", "--seed"),
    ("bench --ids 0", "bench", "--ids"),
    ("bench seed --json {missing}/x.json", "bench seed", "--json"),
    ("bench seed --json {tmp}", "bench seed", "--json"),
    ("bench sweep --sizes-gb -1", "bench sweep", "--sizes-gb"),
    ("bench sweep --sizes-gb abc", "bench sweep", "--sizes-gb"),
    ("bench sweep --widths 8,x", "bench sweep", "--widths"),
    ("bench sweep --strategies kernel,bogus", "bench sweep", "--strategies"),
    ("bench sweep --strategies kernel-u17", "bench sweep", "--strategies"),
    ("bench sweep --hybrid-fractions 1.5", "bench sweep", "--hybrid-fractions"),
    ("bench sweep --pages weird", "bench sweep", "--pages"),
    ("bench sweep --naive-max-ids -1", "bench sweep", "--naive-max-ids"),
    ("bench sweep --plot {tmp}", "bench sweep", "--plot"),
    ("bench sweep --plot {missing}/p.png", "bench sweep", "--plot"),
    ("bench files --mb 0", "bench files", "--mb"),
    ("bench files --gb inf", "bench files", "--gb"),
    ("bench files --dir {missing}", "bench files", "--dir"),
    ("bench files --dir {file}", "bench files", "--dir"),
    ("bench files --formats npy,foo", "bench files", "--formats"),
    ("bench files --compression foo", "bench files", "--compression"),
    ("bench files --chunk-rows 0", "bench files", "--chunk-rows"),
    ("bench files --cache-mb -1", "bench files", "--cache-mb"),
    ("bench pipeline --width 2", "bench pipeline", "--width"),
    ("bench pipeline --dtype int8", "bench pipeline", "--dtype"),
    ("bench pipeline --seconds nan", "bench pipeline", "--seconds"),
    ("bench pipeline --workers -1", "bench pipeline", "--workers"),
    ("bench pipeline --sources disk", "bench pipeline", "--sources"),
    ("bench pipeline --dir {missing}", "bench pipeline", "--dir"),
    ("bench train --lr inf", "bench train", "--lr"),
    ("bench train --zipf -1", "bench train", "--zipf"),
    ("bench train --placement nowhere", "bench train", "--placement"),
    ("bench train --methods gpu,foo", "bench train", "--methods"),
    ("bench train --profile {missing}/p.txt", "bench train", "--profile"),
    ("info --json {tmp}", "info", "--json"),
]


@pytest.mark.parametrize("line,command,option", BAD, ids=[b[0].split(" {")[0] for b in BAD])
def test_bad_option_exits_2_with_one_line_naming_command_and_option(
    line, command, option, tmp_path, capsys
):
    """README: 'Every gadgetloader command exits ... 2 for a bad argument (argparse's usage,
    then a line naming the command, such as "bench sweep: error: --sizes-gb values must be
    ..."'; '--json paths are checked before the run' (nothing is written)."""
    (tmp_path / "afile").write_text("x")
    argv = line.format(tmp=tmp_path, missing=tmp_path / "nope", file=tmp_path / "afile").split()
    out_json = tmp_path / "never.json"
    if argv[0] == "bench" and "--json" not in argv:
        argv += ["--json", str(out_json)]
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as ei:
        cli_main(argv)
    cap = capsys.readouterr()
    assert ei.value.code == 2, (argv, cap.err)
    assert cap.out == ""
    assert "Traceback" not in cap.err
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("usage:"), cap.err
    err_lines = [ln for ln in lines if ": error:" in ln]
    assert err_lines == [lines[-1]], cap.err
    assert lines[-1].startswith(f"gadgetloader {command}: error:"), lines[-1]
    assert option in lines[-1], lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize(
    "suite,options",
    [
        ("seed", ["--json", "--rows", "--width", "--ids", "--dtype", "--repeats", "--seed"]),
        ("sweep", ["--json", "--sizes-gb", "--widths", "--repeats", "--plot"]),
        ("files", ["--json", "--gb", "--mb", "--dir", "--keep", "--formats", "--ids"]),
        ("pipeline", ["--json", "--rows", "--width", "--batch", "--workers", "--dir"]),
        (
            "train",
            ["--json", "--rows", "--dim", "--batch", "--negatives", "--fused", "--no-verify"],
        ),
    ],
)
def test_each_suite_help_lists_the_documented_options(suite, options, capsys):
    """README: `gadgetloader bench files --gb 4 --dir ... --json files.json`, `--repeats 5`,
    `--sizes-gb`, a pipeline `--width`, `--fused`; help: '`gadgetloader bench SUITE -h`
    lists a suite's options'."""
    with pytest.raises(SystemExit) as ei:
        cli_main(["bench", suite, "-h"])
    out = capsys.readouterr().out
    assert ei.value.code == 0
    assert out.startswith(f"usage: gadgetloader bench {suite}")
    missing = [o for o in options if not re.search(re.escape(o) + r"\b", out)]
    assert not missing, (suite, missing)


def test_unknown_suite_exits_2_naming_bench(capsys):
    with pytest.raises(SystemExit) as ei:
        cli_main(["bench", "nosuch"])
    err = capsys.readouterr().err
    assert ei.value.code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("gadgetloader bench: error:") and "nosuch" in last, err


# --------------------------------------------------------------------------------------
# seed
# --------------------------------------------------------------------------------------


def test_seed_json_fields_and_options_honoured(runs):
    """help: '--ids ... at most --rows: a larger value is capped to it ... the report gives
    the count used'; --dtype/--width/--rows reach the report."""
    out, _ = _proc(runs, "seed")
    d = _json(runs, "seed.json")
    assert d["benchmark"] == "seed"
    assert (d["rows"], d["width"], d["dtype"]) == (300, 5, "float64")
    assert d["ids"] == 300  # 1000 asked, capped to --rows
    assert d["bytes_moved"] == 300 * 5 * 8
    assert "300 x 5 float64" in out and "300 random ids" in out, out.splitlines()[0]
    kinds = {r["kind"] for r in d["results"]}
    assert kinds == {"gather", "scatter"}
    for r in d["results"]:
        assert {"method", "kind", "ms", "GBps", "of_limit", "x_naive", "check"} <= set(r), r
        assert r["check"] == "ok", r


def test_seed_numbers_are_consistent(runs):
    """Columns `GB/s`, `of limit` (the memcpy row), `x naive` (the naive row)."""
    _proc(runs, "seed")
    d = _json(runs, "seed.json")
    B = d["bytes_moved"]
    for kind in ("gather", "scatter"):
        rows = [r for r in d["results"] if r["kind"] == kind]
        naive = [r for r in rows if "naive" in r["method"]]
        limit = [r for r in rows if r["method"].startswith("limit")]
        assert len(naive) == 1, rows
        for r in rows:
            assert r["ms"] > 0
            assert _close(r["GBps"], B / (r["ms"] * 1e-3) / 1e9), r
            assert _close(r["x_naive"], naive[0]["ms"] / r["ms"]), r
            if limit:
                assert _close(r["of_limit"], limit[0]["ms"] / r["ms"]), r
            else:
                assert r["of_limit"] is None, r
        assert naive[0]["x_naive"] == 1.0


def test_seed_printed_table_matches_json(runs):
    out, _ = _proc(runs, "seed")
    d = _json(runs, "seed.json")
    table = _table(out)
    assert [(t["kind"], t["method"]) for t in table] == [
        (r["kind"], r["method"]) for r in d["results"]
    ]
    for t, r in zip(table, d["results"], strict=True):
        assert _close(_num(t["ms"]), r["ms"], rel=6e-3), (t, r)
        assert _close(_num(t["GB/s"]), r["GBps"], rel=6e-3), (t, r)
        assert _close(_num(t["x naive"]), r["x_naive"], rel=6e-3), (t, r)
        assert t["check"] == r["check"]


def test_seed_on_cpu_is_labelled_cpu_and_lists_what_it_skipped(runs):
    """README: 'Without CUDA ... `gadgetloader bench` then times the CPU methods and lists what
    it skipped.'"""
    out, _ = _proc(runs, "seed")
    d = _json(runs, "seed.json")
    assert d["device"] == "cpu"
    assert d["link"] in ({}, None)
    assert d["skipped"] and any(re.search("cuda|gpu", s, re.I) for s in d["skipped"])
    assert "skipped" in out
    for r in d["results"]:
        assert not NO_GPU_WORDS.search(r["method"]), r["method"]
    assert not NO_GPU_WORDS.search(out.splitlines()[0]), out.splitlines()[0]


def test_bench_without_suite_runs_seed_with_its_options(runs):
    """README: '`gadgetloader bench` (or `gadgetloader bench seed` ...)'; help: 'Without SUITE
    the seed benchmark runs (its options then follow 'bench' directly)'."""
    res = _driver(runs, "d1")["default"]
    assert res["rc"] == 0, res["stderr"][-2000:]
    d = _json(runs, "default.json")
    assert d["benchmark"] == "seed"
    assert (d["rows"], d["width"], d["ids"], d["dtype"]) == (40, 2, 10, "int16")
    assert d["bytes_moved"] == 10 * 2 * 2
    assert all(r["check"] == "ok" for r in d["results"])


def test_seed_repeats_and_seed_are_honoured(runs):
    """--repeats: 'timed runs per method'; --seed: 'random seed'. Seen from outside: the ids
    handed to `DataGadget.getData`."""
    dr = _driver(runs, "d1")
    a, b, a2, c = (dr[k] for k in ("rep1_s1", "rep4_s1", "rep1_s1_again", "rep1_s2"))
    for r in (a, b, a2, c):
        assert r["rc"] == 0, r["stderr"][-2000:]
        assert r["ids"], "the seed benchmark did not call DataGadget.getData"
    assert len(b["ids"]) >= len(a["ids"]) + 3, (len(a["ids"]), len(b["ids"]))
    assert a["ids"] == a2["ids"]  # same --seed: same requests
    assert a["ids"][0] != c["ids"][0]  # another --seed: other ids


def test_seed_check_column_is_a_real_comparison(runs):
    """README: 'every method checked against a CPU reference first'. A gather that returns
    wrong rows, or a scatter that writes nothing, must not be reported `ok`."""
    dr = _driver(runs, "d1")
    g = _json(runs, "seed_bad_gather.json")
    s = _json(runs, "seed_bad_scatter.json")
    gl_g = [
        r for r in g["results"] if r["method"].startswith("gadgetloader") and r["kind"] == "gather"
    ]
    gl_s = [
        r for r in s["results"] if r["method"].startswith("gadgetloader") and r["kind"] == "scatter"
    ]
    assert gl_g and all(r["check"] != "ok" for r in gl_g), gl_g
    assert gl_s and all(r["check"] != "ok" for r in gl_s), gl_s
    # the baselines and the untouched gather stay ok
    assert all(r["check"] == "ok" for r in g["results"] if "naive" in r["method"])
    assert all(r["check"] == "ok" for r in s["results"] if r["kind"] == "gather")
    assert (
        "WRONG" in dr["seed_bad_gather"]["stdout"] or "MISMATCH" in dr["seed_bad_gather"]["stdout"]
    )


def test_failed_check_gives_nonzero_exit_status(runs):
    """README: 'Every `gadgetloader` command exits 0 when it succeeds, ... 1 for other
    errors'. A benchmark whose library results failed the check against the reference did
    not succeed: scripts and CI (`.ci/gpu ... seed sweep files pipeline train`) only see the
    exit status."""
    d1, d2 = _driver(runs, "d1"), _driver(runs, "d2")
    got = {
        k: v["rc"]
        for k, v in [
            ("seed getData wrong", d1["seed_bad_gather"]),
            ("seed insertData no-op", d1["seed_bad_scatter"]),
            ("pipeline __getitems__ wrong", d2["pipe_bad"]),
            ("files getData wrong", d2["files_bad"]),
        ]
    }
    assert all(rc not in (0, "raised") for rc in got.values()), got


# --------------------------------------------------------------------------------------
# sweep
# --------------------------------------------------------------------------------------


def test_sweep_on_cpu_is_skipped_and_says_so(runs):
    res = _driver(runs, "d1")["sweep"]
    assert res["rc"] == 0, res["stderr"][-2000:]
    d = _json(runs, "sweep.json")
    assert d["benchmark"] == "sweep"
    assert d["results"] == []
    assert d["skipped"] and any("cuda" in s.lower() for s in d["skipped"]), d
    assert "skipped" in res["stdout"]
    png = runs["base"] / "sweep.png"
    if png.exists():  # nothing to draw: if a file is written anyway it must be a PNG
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "not written" in res["stdout"]


def test_sweep_json_records_the_device_like_the_published_runs(runs):
    """The README's sweep results (e.g. notebooks/results/h200-sweep-session20.json) carry
    'device' (and 'cpu_threads'); a results file from a CPU-only machine should say which
    device it describes too."""
    _driver(runs, "d1")
    d = _json(runs, "sweep.json")
    published = json.loads((REPO / "notebooks/results/h200-sweep-session20.json").read_text())
    assert "device" in published
    assert "device" in d, sorted(d)
    assert not NO_GPU_WORDS.search(str(d["device"]))


# --------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------


def test_files_config_honours_options(runs):
    _proc(runs, "files")
    d = _json(runs, "files.json")
    c = d["config"]
    assert c["table_bytes"] == 300_000 and c["width"] == 6 and c["dtype"] == "float32"
    assert c["rows"] == 300_000 // 24
    assert c["random_rows"] == 50_000 // 24  # --random-mb 0.05, in whole rows
    assert c["random_table_bytes"] == c["random_rows"] * 24
    assert c["random_chunk_rows"] == 40
    assert c["cache_bytes"] == 10_000
    assert c["ids_per_call"] == 16 and c["repeats"] == 2
    assert c["device"] == "cpu" and c["placement"] == "cpu"
    assert Path(c["dir"]).parent.name == "fdir" or Path(c["dir"]).name == "fdir"
    assert [x["format"] for x in d["load"]] == FORMATS
    assert sorted({x["format"] for x in d["random"]}) == sorted(FORMATS)
    assert d["checks_passed"] is True
    assert all(x["checked"] for x in d["load"] + d["random"])


def test_files_keep_keeps_files_with_the_chunking_asked_for(runs):
    """--keep, --chunk-rows (load-test files), --random-chunk-rows, --compression (zarr)."""
    _proc(runs, "files")
    d = _json(runs, "files.json")
    where = (
        runs["base"] / d["config"]["dir"]
        if not Path(d["config"]["dir"]).is_absolute()
        else Path(d["config"]["dir"])
    )
    assert where.is_dir() and str(where.resolve()).startswith(
        str((runs["base"] / "fdir").resolve())
    )
    names = sorted(p.name for p in where.iterdir())
    npys = [n for n in names if n.endswith(".npy")]
    assert len(npys) == 2, names
    shapes = sorted(np.load(where / n, mmap_mode="r").shape for n in npys)
    assert shapes == sorted([(12500, 6), (2083, 6)]), shapes
    if HAS_H5PY:
        import h5py

        chunks = set()
        for n in names:
            if n.endswith((".h5", ".hdf5")):
                with h5py.File(where / n, "r") as f:
                    ds = [f[k] for k in f]
                    chunks.add((ds[0].shape[0], ds[0].chunks))
        assert chunks == {(12500, (2000, 6)), (2083, (40, 6))}, chunks
    if HAS_ZARR:
        import zarr

        zs = [n for n in names if n.endswith(".zarr")]
        assert len(zs) == 2, names
        for n in zs:
            z = zarr.open(str(where / n), mode="r")
            want = (2000, 6) if z.shape[0] == 12500 else (40, 6)
            assert tuple(z.chunks) == want, (n, z.chunks)
            if z.shape[0] == 12500:
                comp = getattr(z, "compressors", None) or (getattr(z, "compressor", None),)
                assert "gzip" in repr(comp).lower(), comp


def test_files_numbers_are_consistent(runs):
    _proc(runs, "files")
    d = _json(runs, "files.json")
    c = d["config"]
    disk = d["disk"]["read_GBps"]
    assert disk > 0
    for w in d["write"]:
        assert _close(w["GBps"], c["table_bytes"] / w["seconds"] / 1e9), w
    for x in d["load"]:
        assert _close(x["GBps"], c["table_bytes"] / x["seconds"] / 1e9), x
        assert _close(x["fraction_of_disk"], x["GBps"] / disk), x
        assert _close(x["fraction_of_disk_with_alloc"], x["GBps_with_alloc"] / disk), x
    row_bytes = c["width"] * 4
    for fmt in FORMATS:
        rows = [r for r in d["random"] if r["format"] == fmt]
        ours = [r for r in rows if r["method"].startswith("gadgetloader")]
        base = [r for r in rows if not r["method"].startswith("gadgetloader")]
        assert len(ours) == 1 and len(base) == 1, rows
        for r in rows:
            assert _close(r["rows_per_s"], c["ids_per_call"] / (r["ms"] * 1e-3)), r
            assert _close(r["GBps"], c["ids_per_call"] * row_bytes / (r["ms"] * 1e-3) / 1e9), r
        assert _close(ours[0]["speedup_vs_baseline"], base[0]["ms"] / ours[0]["ms"]), rows


def test_files_check_is_real_and_temp_files_are_removed_without_keep(runs):
    """A file store whose getData returns wrong rows must not be reported checked; without
    --keep the benchmark's files under --dir are removed."""
    res = _driver(runs, "d2")["files_bad"]
    assert res["rc"] in (0, 1), res["stderr"][-2000:]
    d = _json(runs, "files_bad.json")
    ours = [r for r in d["random"] if r["method"].startswith("gadgetloader")]
    assert ours and not any(r["checked"] for r in ours), ours
    assert d["checks_passed"] is False
    assert list((runs["base"] / "fdir_bad").iterdir()) == []


# --------------------------------------------------------------------------------------
# pipeline
# --------------------------------------------------------------------------------------


def test_pipeline_json_honours_options(runs):
    out, _ = _proc(runs, "pipe")
    d = _json(runs, "pipe.json")
    assert d["benchmark"] == "pipeline"
    assert (d["rows"], d["width"], d["dtype"]) == (64, 5, "float64")
    assert d["batch"] == 64  # 100 asked, at most --rows
    assert d["row_bytes"] == 5 * 8
    assert d["device"] == "cpu" and d["link"] in ({}, None)
    assert "batch 64" in out.splitlines()[0]
    torch_rows = [r for r in d["results"] if r["method"].startswith("(a)")]
    assert [r["workers"] for r in torch_rows] == [0]
    loader = [r for r in d["results"] if r["method"].startswith("(d)")]
    assert loader and all(
        "prefetch=1" in r["method"] and "coalesce=2" in r["method"] for r in loader
    )
    sources = {r["source"] for r in d["results"] if not r["method"].startswith("(a)")}
    assert any(s.startswith("memory") for s in sources) and any(
        s.startswith("file") for s in sources
    )
    assert all(r["check"] == "ok" for r in d["results"]), d["results"]
    for r in d["results"]:
        assert not NO_GPU_WORDS.search(r["source"] + r["method"]), r
    assert list((runs["base"] / "pdir").iterdir()) == []  # its .npy is removed afterwards


def test_pipeline_numbers_are_consistent(runs):
    _proc(runs, "pipe")
    d = _json(runs, "pipe.json")
    res = d["results"]
    best = max((r for r in res if r["method"].startswith("(a)")), key=lambda r: r["rows_per_s"])
    for r in res:
        assert _close(r["rows_per_s"] * r["us_per_batch"] * 1e-6, d["batch"], rel=1e-3), r
        assert _close(r["GBps"], r["rows_per_s"] * d["row_bytes"] / 1e9), r
        assert _close(r["x_torch"], r["rows_per_s"] / best["rows_per_s"]), r
        assert r["of_limit"] is None  # no memcpy limit without a GPU
    s = d["summary"]
    assert s["best_torch_workers"] == best["workers"]
    assert _close(s["best_torch_rows_per_s"], best["rows_per_s"])
    fast = [r for r in res if r["source"].startswith("memory") and r["method"].startswith("(c) ")]
    default = [r for r in res if r["source"].startswith("memory") and r["method"].startswith("(b)")]
    assert len(fast) == 1 and len(default) == 1
    assert _close(s["memory_fast_x_torch"], fast[0]["x_torch"])
    assert _close(s["memory_default_vs_fast"], default[0]["us_per_batch"] / fast[0]["us_per_batch"])
    sampler = d["sampler_us_per_batch"]["torch RandomSampler + BatchSampler"]
    if sampler is None:
        assert s["torch_sampler_vs_fast"] is None
    else:
        assert _close(s["torch_sampler_vs_fast"], sampler / fast[0]["us_per_batch"])


def test_pipeline_sampler_alone_is_reported_or_explained(runs):
    """README: 'The benchmark now times torch's `RandomSampler` + `BatchSampler` alone on the
    same host'. With the smallest table (--batch equal to --rows: one batch an epoch) every
    'sampler alone' figure is null and the printed line ends in 'sampler alone: ' with
    nothing after it: the figure should be given, or the report should say why not."""
    out, _ = _proc(runs, "pipe")
    d = _json(runs, "pipe.json")
    values = d["sampler_us_per_batch"]
    line = [ln for ln in out.splitlines() if "sampler alone:" in ln]
    assert len(line) == 1, out
    said = line[0].split("sampler alone:", 1)[1].strip()
    assert all(v is not None for v in values.values()) or said, (values, line[0])


def test_pipeline_check_is_real_and_sources_honoured(runs):
    res = _driver(runs, "d2")["pipe_bad"]
    assert res["rc"] in (0, 1), res["stderr"][-2000:]
    d = _json(runs, "pipe_bad.json")
    assert {r["source"] for r in d["results"]} <= {"npy mmap", "memory (cpu)"}, d["results"]
    via_items = [r for r in d["results"] if r["method"][:3] in ("(b)", "(c)", "(c1", "(e)")]
    assert via_items and all(r["check"] != "ok" for r in via_items), via_items
    assert all(r["check"] == "ok" for r in d["results"] if r["method"].startswith("(a)"))


# --------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------


def test_train_json_honours_options_and_is_labelled_cpu(runs):
    out, _ = _proc(runs, "train")
    d = _json(runs, "train.json")
    c = d["config"]
    assert (c["rows"], c["dim"], c["batch"], c["negatives"]) == (120, 4, 8, 2)
    assert (c["steps"], c["warmup"], c["repeats"]) == (2, 1, 2)
    assert c["zipf"] == 0.0
    assert c["placement"] == "cpu"  # 'pinned' asked, no CUDA: reported as what ran
    assert d["device"] == "cpu" and d["memcpy"] is None
    assert d["torch"] == torch.__version__
    assert list(d["methods"]) == ["gpu", "speedtorch", "switchers", "dropin", "resident"]
    for m in d["methods"].values():
        assert m["placement"] == "cpu"
        assert m["bytes_per_step"] == m["h2d_bytes_per_step"] + m["d2h_bytes_per_step"] == 0
    assert d["skipped"] and any("cuda" in s.lower() for s in d["skipped"])
    assert "on cpu" in out.splitlines()[0]
    # the bench's docstring: torch's SparseAdam ('gpu') is the reference the others are checked against
    assert d["verified"] == {"gpu": "reference", "switchers": True, "dropin": True}
    table = {t["method"]: t for t in _table(out)}
    assert {k: table[k]["checked"] for k in d["verified"]} == {
        k: str(v) for k, v in d["verified"].items()
    }


def test_train_numbers_are_consistent(runs):
    _proc(runs, "train")
    d = _json(runs, "train.json")
    ms = {k: v["ms_per_step"] for k, v in d["methods"].items()}
    for v in d["methods"].values():
        assert _close(v["steps_per_s"] * v["ms_per_step"], 1000.0), v
    assert _close(d["speedup_dropin_vs_speedtorch"], ms["speedtorch"] / ms["dropin"])
    assert _close(d["speedup_switchers_vs_speedtorch"], ms["speedtorch"] / ms["switchers"])
    assert _close(d["dropin_x_resident"], ms["dropin"] / ms["resident"])


def test_train_no_verify_and_profile(runs):
    res = _driver(runs, "d2")["train_noverify"]
    assert res["rc"] == 0, res["stderr"][-2000:]
    d = _json(runs, "t_nv.json")
    assert list(d["methods"]) == ["switchers", "dropin"]
    assert d["verified"] == {}
    table = {t["method"]: t for t in _table(res["stdout"])}
    assert table["dropin"]["checked"] != "True" and table["switchers"]["checked"] != "True"
    prof = (runs["base"] / "prof.txt").read_text()
    assert "dropin" in prof and "switchers" in prof


def test_train_check_blames_the_method_that_is_wrong(runs):
    """`OffloadedEmbedding.forward` returning wrong rows breaks the drop-in method only: the
    plain-torch 'gpu' method does not use it. The `checked` column must then say the drop-in
    failed and the 'gpu' method passed."""
    res = _driver(runs, "d2")["train_fwd_pair"]
    assert res["rc"] in (0, 1), res["stderr"][-2000:]
    d = _json(runs, "t_fwd_pair.json")
    assert d["verified"] == {"gpu": "reference", "dropin": False}, d["verified"]
    assert res["rc"] == 1  # a failed check is a failed run


def test_train_check_catches_a_wrong_dropin_run_alone(runs):
    """With `--methods dropin` only, a drop-in with wrong lookups must not be reported
    checked True."""
    res = _driver(runs, "d2")["train_fwd_alone"]
    assert res["rc"] in (0, 1), res["stderr"][-2000:]
    d = _json(runs, "t_fwd_alone.json")
    assert d["verified"].get("dropin") is not True, d["verified"]


def test_train_check_catches_an_optimizer_that_does_not_step(runs):
    """`OffloadedOptimizer.step` doing nothing (no row is ever trained, lr 0.05) must fail the
    cross-check against the plain-torch method."""
    res = _driver(runs, "d2")["train_step_noop"]
    assert res["rc"] in (0, 1), res["stderr"][-2000:]
    d = _json(runs, "t_noop.json")
    assert d["verified"].get("dropin") is False, d["verified"]


# --------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------


def test_info_reports_versions_and_no_gpu(runs):
    """README: '`gadgetloader info` # versions, GPU and measured link bandwidth (with a GPU;
    for bug reports)'."""
    dr = _driver(runs, "d1")
    res = dr["info"]
    assert res["rc"] == 0, res["stderr"][-2000:]
    d = _json(runs, "info.json")
    assert d["gadgetloader"] == __import__("gadgetloader").__version__
    assert d["torch"] == torch.__version__
    assert d["numpy"] == np.__version__
    assert d["python"] == platform.python_version()
    assert d["cuda_available"] is False
    assert re.match(r"(none|no|not)\b", str(d["gpu"]).lower()), d["gpu"]
    if HAS_H5PY:
        assert d["h5py"] == importlib.metadata.version("h5py")
    if HAS_ZARR:
        assert d["zarr"] == importlib.metadata.version("zarr")
    text = res["stdout"]
    for key in d:
        assert re.search(rf"^\s*{re.escape(key)}:", text, re.M), key
    assert re.search(r"^\s*cuda_available: False", text, re.M)
    assert not re.search(r"GB/s", text)  # nothing measured without a GPU
    d2 = _json(runs, "info2.json")
    assert dr["info_nomeasure"]["rc"] == 0
    assert d2 == d
