"""Review of the documented command line (README + --help), session 10."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gadgetloader.cli import main


def run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors
        rc = e.code
    out = capsys.readouterr()
    return (0 if rc is None else rc), out.out, out.err


def assert_clean_error(rc, out, err, *words):
    assert rc not in (0, None), (rc, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    for w in words:
        assert w in err, (w, err)


SEED = ["bench", "seed", "--rows", "200", "--width", "4", "--ids", "32", "--repeats", "1"]
PIPE = [
    "bench",
    "pipeline",
    "--rows",
    "2048",
    "--width",
    "8",
    "--batch",
    "256",
    "--batches",
    "4",
    "--seconds",
    "0.2",
    "--repeats",
    "1",
    "--workers",
    "0",
]
TRAIN = [
    "bench",
    "train",
    "--rows",
    "500",
    "--dim",
    "8",
    "--batch",
    "16",
    "--negatives",
    "2",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--repeats",
    "1",
    "--methods",
    "gpu",
]
FILES = ["bench", "files", "--mb", "1", "--random-mb", "1", "--ids", "16", "--repeats", "1"]


# ---------------------------------------------------------------- info
def test_info_fields_and_json(tmp_path, capsys):
    j = tmp_path / "i.json"
    rc, out, err = run(["info", "--no-measure", "--json", str(j)], capsys)
    assert rc == 0
    for key in ("gadgetloader", "python", "torch", "numpy", "cuda_available", "gpu"):
        assert key + ":" in out
    d = json.loads(j.read_text())
    import gadgetloader

    assert d["gadgetloader"] == gadgetloader.__version__
    assert d["numpy"] == np.__version__
    assert d["cuda_available"] is torch.cuda.is_available()


def test_info_json_in_missing_dir(tmp_path, capsys):
    rc, out, err = run(["info", "--json", str(tmp_path / "no" / "i.json")], capsys)
    assert_clean_error(rc, out, err, "--json")


# ---------------------------------------------------------------- seed
@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "bfloat16", "int8", "int64", "uint8", "bool"]
)
def test_seed_dtypes_json(tmp_path, capsys, dtype):
    j = tmp_path / "s.json"
    rc, out, err = run(
        SEED + ["--dtype", dtype, "--seed", "3", "--no-speedtorch", "--json", str(j)], capsys
    )
    assert rc == 0, err
    assert "| kind" in out and "gather" in out and "scatter" in out
    d = json.loads(j.read_text())
    assert d["benchmark"] == "seed" and d["rows"] == 200 and d["width"] == 4 and d["ids"] == 32
    assert d["dtype"] == dtype
    assert {r["kind"] for r in d["results"]} == {"gather", "scatter"}
    for r in d["results"]:
        assert "error" not in r, r
        if not r["method"].startswith("limit:"):  # the memcpy line has nothing to check
            assert r["check"] == "ok", r
        assert r["ms"] > 0 and r["GBps"] > 0


def test_bench_without_suite_is_seed(tmp_path, capsys):
    j = tmp_path / "s.json"
    rc, out, err = run(["bench"] + SEED[2:] + ["--json", str(j)], capsys)
    assert rc == 0
    assert json.loads(j.read_text())["benchmark"] == "seed"


@pytest.mark.parametrize(
    "opt,val",
    [
        ("--rows", "0"),
        ("--rows", "-5"),
        ("--rows", "abc"),
        ("--width", "0"),
        ("--ids", "0"),
        ("--ids", "-1"),
        ("--repeats", "0"),
        ("--seed", "-1"),
        ("--seed", "x"),
        ("--dtype", "foo"),
        ("--dtype", "uint16"),
    ],
)
def test_seed_bad_values(tmp_path, capsys, opt, val):
    j = tmp_path / "s.json"
    rc, out, err = run(SEED + [opt, val, "--json", str(j)], capsys)
    assert_clean_error(rc, out, err, opt, val)
    assert not j.exists()


@pytest.mark.parametrize("suite", ["seed", "sweep", "files", "pipeline", "train"])
def test_json_path_checked_first(tmp_path, capsys, suite):
    rc, out, err = run(["bench", suite, "--json", str(tmp_path / "nodir" / "x.json")], capsys)
    assert_clean_error(rc, out, err, "--json")
    rc, out, err = run(["bench", suite, "--json", str(tmp_path)], capsys)
    assert_clean_error(rc, out, err, "--json", "directory")
    assert list(tmp_path.iterdir()) == []


def test_unknown_suite(capsys):
    rc, out, err = run(["bench", "nosuch"], capsys)
    assert_clean_error(rc, out, err, "nosuch")


# ---------------------------------------------------------------- sweep
def test_sweep_cpu_json_and_plot(tmp_path, capsys):
    j, p = tmp_path / "w.json", tmp_path / "w.png"
    rc, out, err = run(
        [
            "bench",
            "sweep",
            "--sizes-gb",
            "0.001",
            "--widths",
            "8",
            "--ids",
            "64",
            "--strategies",
            "auto,torch",
            "--hybrid-fractions",
            "0.5",
            "--pages",
            "default",
            "--repeats",
            "1",
            "--naive-max-ids",
            "10",
            "--json",
            str(j),
            "--plot",
            str(p),
        ],
        capsys,
    )
    assert rc == 0
    d = json.loads(j.read_text())
    assert d["benchmark"] == "sweep"
    if torch.cuda.is_available():
        assert d["results"] and all(r["table_GB"] == 0.001 for r in d["results"])
        assert p.exists() and p.stat().st_size > 0
    else:
        assert d["results"] == []
        assert "CUDA" in out
        assert not p.exists() and "not written" in out


@pytest.mark.parametrize(
    "opt,val",
    [
        ("--sizes-gb", "-1"),
        ("--sizes-gb", "abc"),
        ("--widths", "0"),
        ("--widths", "x"),
        ("--strategies", "foo"),
        ("--hybrid-fractions", "2"),
        ("--ids", "0"),
        ("--repeats", "0"),
        ("--pages", "foo"),
        ("--naive-max-ids", "-1"),
    ],
)
def test_sweep_bad_values(tmp_path, capsys, opt, val):
    rc, out, err = run(["bench", "sweep", opt, val], capsys)
    assert_clean_error(rc, out, err, opt, val)


def test_sweep_plot_in_missing_dir(tmp_path, capsys):
    rc, out, err = run(["bench", "sweep", "--plot", str(tmp_path / "no" / "p.png")], capsys)
    assert_clean_error(rc, out, err, "--plot")


# ---------------------------------------------------------------- files
def test_files_json(tmp_path, capsys):
    j = tmp_path / "f.json"
    d = tmp_path / "work"
    d.mkdir()
    rc, out, err = run(
        FILES
        + [
            "--formats",
            "npy,hdf5,zarr",
            "--chunk-rows",
            "256",
            "--compression",
            "gzip",
            "--random-chunk-rows",
            "32",
            "--cache-mb",
            "0.1",
            "--seed",
            "1",
            "--dir",
            str(d),
            "--json",
            str(j),
        ],
        capsys,
    )
    assert rc == 0, err
    assert "all results checked against NumPy: True" in out
    r = json.loads(j.read_text())
    assert r["checks_passed"] is True
    assert {x["format"] for x in r["load"]} == {"npy", "hdf5", "zarr"}
    for x in r["random"]:
        assert x["checked"] is True and x["rows_per_s"] > 0
    assert r["config"]["random_chunk_rows"] == 32 and r["config"]["ids_per_call"] == 16
    assert list(d.iterdir()) == []  # no --keep: files removed


def test_files_keep_and_no_baselines(tmp_path, capsys):
    rc, out, err = run(
        FILES + ["--formats", "npy", "--keep", "--no-baselines", "--dir", str(tmp_path)], capsys
    )
    assert rc == 0, err
    assert "np.load(mmap_mode='r')" not in out
    kept = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert kept


@pytest.mark.parametrize(
    "opt,val",
    [
        ("--mb", "0"),
        ("--mb", "-1"),
        ("--mb", "abc"),
        ("--gb", "0"),
        ("--width", "0"),
        ("--formats", "foo"),
        ("--chunk-rows", "0"),
        ("--compression", "foo"),
        ("--random-mb", "0"),
        ("--random-chunk-rows", "0"),
        ("--cache-mb", "-1"),
        ("--ids", "0"),
        ("--repeats", "0"),
        ("--seed", "-1"),
    ],
)
def test_files_bad_values(tmp_path, capsys, opt, val):
    rc, out, err = run(FILES + ["--formats", "zarr", opt, val, "--dir", str(tmp_path)], capsys)
    assert_clean_error(rc, out, err, opt, val)
    assert list(tmp_path.iterdir()) == []


def test_files_dir_missing_or_a_file(tmp_path, capsys):
    rc, out, err = run(FILES + ["--dir", str(tmp_path / "no")], capsys)
    assert_clean_error(rc, out, err, "--dir")
    f = tmp_path / "f.txt"
    f.write_text("x")
    rc, out, err = run(FILES + ["--dir", str(f)], capsys)
    assert_clean_error(rc, out, err, "--dir", "not a directory")


# ---------------------------------------------------------------- pipeline
def test_pipeline_json(tmp_path, capsys):
    j = tmp_path / "p.json"
    rc, out, err = run(
        PIPE
        + [
            "--dtype",
            "int64",
            "--sources",
            "memory,file",
            "--prefetch",
            "1",
            "--coalesce",
            "2",
            "--dir",
            str(tmp_path),
            "--seed",
            "2",
            "--json",
            str(j),
        ],
        capsys,
    )
    assert rc == 0, err
    d = json.loads(j.read_text())
    assert (
        d["benchmark"] == "pipeline"
        and d["rows"] == 2048
        and d["batch"] == 256
        and d["dtype"] == "int64"
    )
    assert d["results"]
    for r in d["results"]:
        assert r["check"] == "ok" and r["rows_per_s"] > 0
    assert "prefetch=1 coalesce=2" in out
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_pipeline_prefetch_zero_is_a_valid_depth(tmp_path, capsys):
    # README: "`prefetch=0` gathers each batch only when it is asked for"
    rc, out, err = run(PIPE + ["--sources", "memory", "--prefetch", "0"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize(
    "opt,val",
    [
        ("--rows", "0"),
        ("--width", "2"),
        ("--dtype", "int8"),
        ("--batch", "0"),
        ("--batches", "0"),
        ("--seconds", "0"),
        ("--seconds", "-1"),
        ("--seconds", "nan"),
        ("--repeats", "0"),
        ("--workers", "-1"),
        ("--workers", "abc"),
        ("--sources", "foo"),
        ("--prefetch", "-1"),
        ("--coalesce", "0"),
        ("--seed", "-1"),
    ],
)
def test_pipeline_bad_values(capsys, opt, val):
    rc, out, err = run(PIPE + [opt, val], capsys)
    assert_clean_error(rc, out, err, opt, val)


def test_pipeline_dir_bad(tmp_path, capsys):
    rc, out, err = run(PIPE + ["--dir", str(tmp_path / "no")], capsys)
    assert_clean_error(rc, out, err, "--dir")
    f = tmp_path / "f"
    f.write_text("x")
    rc, out, err = run(PIPE + ["--dir", str(f)], capsys)
    assert_clean_error(rc, out, err, "--dir", "not a directory")


# ---------------------------------------------------------------- train
def test_train_json(tmp_path, capsys):
    j = tmp_path / "t.json"
    argv = TRAIN[:-1] + [
        "gpu,speedtorch,switchers,dropin,resident",
        "--lr",
        "0.05",
        "--zipf",
        "0",
        "--placement",
        "cpu",
        "--memcpy-mib",
        "1",
        "--seed",
        "1",
        "--json",
        str(j),
    ]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    d = json.loads(j.read_text())
    assert set(d["methods"]) == {"gpu", "speedtorch", "switchers", "dropin", "resident"}
    for m in d["methods"].values():
        assert m["ms_per_step"] > 0 and m["steps_per_s"] > 0
    assert all(d["verified"].values())
    assert d["config"]["zipf"] == 0 and d["config"]["rows"] == 500


def test_train_profile_and_no_verify(tmp_path, capsys):
    prof = tmp_path / "prof.txt"
    rc, out, err = run(TRAIN + ["--profile", str(prof), "--no-verify", "--fused"], capsys)
    assert rc == 0, err
    assert prof.exists() and prof.stat().st_size > 0


@pytest.mark.parametrize(
    "opt,val",
    [
        ("--rows", "0"),
        ("--dim", "0"),
        ("--batch", "0"),
        ("--negatives", "-1"),
        ("--steps", "0"),
        ("--warmup", "-1"),
        ("--repeats", "0"),
        ("--lr", "0"),
        ("--lr", "-1"),
        ("--lr", "nan"),
        ("--lr", "inf"),
        ("--lr", "abc"),
        ("--zipf", "-1"),
        ("--zipf", "nan"),
        ("--placement", "foo"),
        ("--methods", "foo"),
        ("--memcpy-mib", "0"),
        ("--seed", "-1"),
    ],
)
def test_train_bad_values(tmp_path, capsys, opt, val):
    j = tmp_path / "t.json"
    rc, out, err = run(TRAIN + [opt, val, "--json", str(j)], capsys)
    assert_clean_error(rc, out, err, opt, val)
    assert not j.exists()


def test_train_profile_in_missing_dir(tmp_path, capsys):
    j = tmp_path / "t.json"
    rc, out, err = run(
        TRAIN + ["--profile", str(tmp_path / "no" / "p.txt"), "--json", str(j)], capsys
    )
    assert_clean_error(rc, out, err, "--profile")
    assert not j.exists()


# ---------------------------------------------------------------- convert
def _read(path, dataset=None):
    import gadgetloader as gl

    kw = {"dataset": dataset} if dataset else {}
    return np.asarray(
        gl.DataGadget(str(path), placement="cpu", progress=False, **kw).getData(
            np.arange(len(np.load(path)) if str(path).endswith(".npy") else 0)
        )
    )


def _load_any(path, dataset="data"):
    p = str(path)
    if p.endswith(".npy"):
        return np.load(p)
    if p.endswith(".h5"):
        import h5py

        with h5py.File(p, "r") as f:
            names = []
            f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
            return f[dataset if dataset in names else names[0]][...]
    import zarr

    g = zarr.open(p, mode="r")
    if hasattr(g, "shape"):
        return g[...]
    try:
        return g[dataset][...]
    except KeyError:
        return list(g.arrays())[0][1][...]


ARRAYS = {
    "float32_2d": np.arange(60, dtype=np.float32).reshape(20, 3) / 7,
    "float64_2d": np.linspace(-1, 1, 30).reshape(10, 3),
    "float16_2d": (np.arange(16, dtype=np.float16) / 3).reshape(8, 2),
    "int8_2d": np.arange(-10, 10, dtype=np.int8).reshape(10, 2),
    "int64_1d": np.arange(7, dtype=np.int64) * 10**12,
    "uint8_3d": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
    "bool_2d": (np.arange(12) % 3 == 0).reshape(12, 1),
}


@pytest.mark.parametrize("name", list(ARRAYS))
@pytest.mark.parametrize("chain", [("npy", "h5", "zarr", "npy"), ("npy", "zarr", "h5", "npy")])
def test_convert_roundtrip(tmp_path, capsys, name, chain):
    a = ARRAYS[name]
    src = tmp_path / "t0.npy"
    np.save(src, a)
    prev = src
    for i, ext in enumerate(chain[1:], 1):
        dst = tmp_path / f"t{i}.{ext}"
        rc, out, err = run(["convert", str(prev), str(dst), "--no-progress"], capsys)
        assert rc == 0, err
        got = _load_any(dst)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got, a)
        prev = dst


def test_convert_chunk_and_compression(tmp_path, capsys):
    import h5py

    a = ARRAYS["float32_2d"]
    np.save(tmp_path / "a.npy", a)
    rc, out, err = run(
        [
            "convert",
            str(tmp_path / "a.npy"),
            str(tmp_path / "a.h5"),
            "--chunk-rows",
            "4",
            "--compression",
            "gzip",
            "--dst-dataset",
            "emb/words",
        ],
        capsys,
    )
    assert rc == 0, err
    with h5py.File(tmp_path / "a.h5", "r") as f:
        ds = f["emb/words"]
        assert ds.chunks[0] == 4 and ds.compression == "gzip"
        np.testing.assert_array_equal(ds[...], a)
    for comp in ("zstd", "gzip", "blosc", "none"):
        dst = tmp_path / f"a-{comp}.zarr"
        rc, out, err = run(
            [
                "convert",
                str(tmp_path / "a.h5"),
                str(dst),
                "--dataset",
                "emb/words",
                "--chunk-rows",
                "5",
                "--compression",
                comp,
            ],
            capsys,
        )
        assert rc == 0, err
        got = _load_any(dst, "emb/words")
        np.testing.assert_array_equal(got, a)
    rc, out, err = run(
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "l.h5"), "--compression", "lzf"], capsys
    )
    assert rc == 0, err


def test_convert_dataset_default_for_dst(tmp_path, capsys):
    import h5py

    with h5py.File(tmp_path / "m.h5", "w") as f:
        f["emb/words"] = np.ones((4, 2))
        f["other"] = np.zeros((3, 2))
    rc, out, err = run(
        ["convert", str(tmp_path / "m.h5"), str(tmp_path / "o.h5"), "--dataset", "emb/words"],
        capsys,
    )
    assert rc == 0, err
    with h5py.File(tmp_path / "o.h5", "r") as f:  # --dst-dataset defaults to --dataset
        np.testing.assert_array_equal(f["emb/words"][...], np.ones((4, 2)))


def test_convert_overwrites_whole_target(tmp_path, capsys):
    import h5py

    np.save(tmp_path / "a.npy", ARRAYS["float64_2d"])
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["old"] = np.zeros(3)
    rc, out, err = run(["convert", str(tmp_path / "a.npy"), str(tmp_path / "t.h5")], capsys)
    assert rc == 0, err
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert "old" not in f


def test_convert_format_and_to(tmp_path, capsys):
    a = ARRAYS["int8_2d"]
    np.save(tmp_path / "a.npy", a)
    os.rename(tmp_path / "a.npy", tmp_path / "a.bin")
    rc, out, err = run(
        [
            "convert",
            str(tmp_path / "a.bin"),
            str(tmp_path / "b.dat"),
            "--format",
            "npy",
            "--to",
            "hdf5",
            "--progress",
        ],
        capsys,
    )
    assert rc == 0, err
    import h5py

    with h5py.File(tmp_path / "b.dat", "r") as f:
        np.testing.assert_array_equal(list(f.values())[0][...], a)


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--chunk-rows", "0"], ["--chunk-rows", "0"]),
        (["--chunk-rows", "-1"], ["--chunk-rows", "-1"]),
        (["--chunk-rows", "abc"], ["--chunk-rows", "abc"]),
        (["--compression", "foo"], ["--compression", "foo"]),
        (["--to", "foo"], ["--to", "foo"]),
        (["--format", "foo"], ["--format", "foo"]),
    ],
)
def test_convert_bad_options(tmp_path, capsys, extra, words):
    np.save(tmp_path / "a.npy", ARRAYS["float32_2d"])
    rc, out, err = run(["convert", str(tmp_path / "a.npy"), str(tmp_path / "z.h5")] + extra, capsys)
    assert_clean_error(rc, out, err, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]


def test_convert_npy_refuses_chunk_option_naming_flag(tmp_path, capsys):
    np.save(tmp_path / "a.npy", ARRAYS["float32_2d"])
    rc, out, err = run(
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "z.npy"), "--chunk-rows", "3"], capsys
    )
    assert_clean_error(rc, out, err, "--chunk-rows")
    assert not (tmp_path / "z.npy").exists()


def test_convert_bad_inputs(tmp_path, capsys):
    import h5py

    np.save(tmp_path / "a.npy", ARRAYS["float32_2d"])
    data = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "tr.npy").write_bytes(data[:150])
    (tmp_path / "hdr.npy").write_bytes(data[:60])
    with h5py.File(tmp_path / "m.h5", "w") as f:
        f["x"] = np.ones((3, 2))
    np.save(tmp_path / "u.npy", np.arange(4, dtype=np.uint16))
    np.save(tmp_path / "zero.npy", np.zeros((0, 3), np.float32))
    cases = [
        (["missing.npy", "o.h5"], ["missing.npy"]),
        (["tr.npy", "o.h5"], ["tr.npy"]),
        (["hdr.npy", "o.zarr"], ["hdr.npy"]),
        (["m.h5", "o.npy", "--dataset", "nope"], ["nope", "'x'"]),
        (["u.npy", "o.h5"], ["uint16"]),
        (["zero.npy", "o.h5"], ["zero.npy"]),
        (["a.npy", "a.npy"], ["same"]),
        (["a.npy", "o.txt"], ["o.txt"]),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, words in cases:
        rc, out, err = run(
            ["convert"] + [str(tmp_path / args[0]), str(tmp_path / args[1])] + args[2:], capsys
        )
        assert_clean_error(rc, out, err, *words)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args


def test_convert_dst_missing_dir_and_directory(tmp_path, capsys):
    np.save(tmp_path / "a.npy", ARRAYS["float32_2d"])
    rc, out, err = run(["convert", str(tmp_path / "a.npy"), str(tmp_path / "no" / "o.h5")], capsys)
    assert_clean_error(rc, out, err, "does not exist")
    (tmp_path / "d.h5").mkdir()
    rc, out, err = run(["convert", str(tmp_path / "a.npy"), str(tmp_path / "d.h5")], capsys)
    assert_clean_error(rc, out, err, "directory")
    assert (tmp_path / "d.h5").is_dir() and list((tmp_path / "d.h5").iterdir()) == []


def test_convert_failure_keeps_old_target(tmp_path, capsys):
    np.save(tmp_path / "a.npy", ARRAYS["float32_2d"])
    np.save(tmp_path / "old.npy", ARRAYS["int8_2d"])
    (tmp_path / "bad.npy").write_bytes((tmp_path / "a.npy").read_bytes()[:140])
    rc, out, err = run(["convert", str(tmp_path / "bad.npy"), str(tmp_path / "old.npy")], capsys)
    assert_clean_error(rc, out, err)
    np.testing.assert_array_equal(np.load(tmp_path / "old.npy"), ARRAYS["int8_2d"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- as a program
def test_module_entry_point_errors_without_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "gadgetloader", "bench", "seed", "--rows", "-3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "--rows" in r.stderr and "Traceback" not in r.stderr
    np.save(tmp_path / "a.npy", ARRAYS["float32_2d"])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gadgetloader",
            "convert",
            str(tmp_path / "a.npy"),
            str(tmp_path / "b.zarr"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(_load_any(tmp_path / "b.zarr"), ARRAYS["float32_2d"])
