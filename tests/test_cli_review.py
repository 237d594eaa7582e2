"""The command line and the word2vec example, cases found by a review: options a suite
would have dropped, bad values, unwritable --json paths, keyword names in messages,
Ctrl-C during long writes, degenerate corpora. Each failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import gadgetloader as gl
from gadgetloader.cli import main
from gadgetloader.io._atomic import interrupts_deferred


def test_options_before_the_suite_name_are_refused(tmp_path, capsys):
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as err:
        main(["bench", "--json", str(out), "files", "--mb", "1"])
    assert err.value.code == 2
    assert "put options after it: gadgetloader bench files --json" in capsys.readouterr().err
    assert not out.exists()


def test_bench_seed_is_a_suite_name(tmp_path):
    out = tmp_path / "s.json"
    args = ["bench", "seed", "--rows", "2000", "--ids", "100", "--width", "8"]
    assert main([*args, "--repeats", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ids"] == 100 and data["bytes_moved"] == 100 * 8 * 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--rows", "0"], "at least 1"),
        (["bench", "files", "--width", "0"], "at least 1"),
        (["bench", "train", "--batch", "-3"], "at least 1"),
        (["bench", "files", "--mb", "-5"], "above 0"),
        (["bench", "pipeline", "--repeats", "x"], "whole number"),
    ],
)
def test_bad_numbers_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "train", "--methods", "bogus"], "unknown --methods ['bogus']"),
        (["bench", "train", "--placement", "bogus"], "--placement must be"),
        (["bench", "pipeline", "--sources", "bogus"], "unknown --sources"),
        (["bench", "pipeline", "--workers", "x"], "--workers must be"),
        (["bench", "pipeline", "--width", "2"], "--width must be >= 3"),
        (["bench", "pipeline", "--dir", "/nonexistent/gl-dir"], "no such directory"),
        (["bench", "sweep", "--strategies", "bogus"], "unknown --strategies"),
        (["bench", "sweep", "--hybrid-fractions", "1.5"], "--hybrid-fractions"),
        (["bench", "files", "--formats", "foo"], "unknown --formats ['foo']"),
    ],
)
def test_bad_choices_are_usage_errors(argv, message, capsys):
    # found after parsing, reported as argparse reports its own (since session 31; they were
    # one-line errors with exit status 1): the usage, then the command's name and the error
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage: gadgetloader bench ")
    assert lines[-1].startswith(f"gadgetloader bench {argv[1]}: error:") and message in lines[-1]


@pytest.mark.parametrize("command", [["info", "--no-measure"], ["bench", "--rows", "100"]])
def test_an_unwritable_json_path_is_refused_before_running(command, capsys):
    with pytest.raises(SystemExit) as err:
        main([*command, "--json", "/nonexistent/gl/x.json"])
    assert err.value.code == 2
    captured = capsys.readouterr()
    assert "no such directory" in captured.err and "seed benchmark" not in captured.out


def test_info_names_a_cpu_build(capsys):
    import torch

    assert main(["info", "--no-measure"]) == 0
    out = capsys.readouterr().out
    if torch.version.cuda is None:
        assert "torch_cuda: none (a CPU build of torch)" in out
    if not torch.cuda.is_available():
        assert "gpu: none found" in out
    else:
        assert "gpu: name=" in out


def test_convert_messages_name_flags(tmp_path, capsys):
    h5py = pytest.importorskip("h5py")
    src = tmp_path / "two.h5"
    with h5py.File(src, "w") as f:
        f["a"] = np.ones((3, 2), np.float32)
        f["b"] = np.ones((3, 2), np.float32)
    assert main(["convert", str(src), str(tmp_path / "x.npy")]) == 1
    assert "pass --dataset to choose one" in capsys.readouterr().err
    dst = tmp_path / "y.npy"
    argv = ["convert", str(src), str(dst), "--dataset", "a", "--dst-dataset", "x"]
    with pytest.raises(SystemExit) as exit_info:  # a usage error (exit status 2)
        main(argv)
    assert exit_info.value.code == 2
    assert "is a .npy file, which holds one array without a name" in capsys.readouterr().err
    assert not dst.exists()


# ---- Ctrl-C during long writes ---------------------------------------------------------
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_interrupts_are_held_until_the_check():
    with pytest.raises(KeyboardInterrupt), interrupts_deferred() as check:
        os.kill(os.getpid(), signal.SIGINT)  # held: no exception here
        reached = True
        check()  # raised here
    assert reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("ext", ["h5", "zarr", "npy"])
def test_ctrl_c_during_a_save_stops_it_and_removes_the_partial(tmp_path, ext, monkeypatch):
    if ext != "npy":
        pytest.importorskip("h5py" if ext == "h5" else "zarr")
    from gadgetloader.io import _stream

    g = gl.DataGadget(np.ones((4000, 8), np.float32), placement="cpu")
    target = tmp_path / f"t.{ext}"
    calls = []
    real = _stream.blocks

    def blocks_with_ctrl_c(n, per):
        for i, b in enumerate(real(n, min(per, 500))):
            if i == 2:
                os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C were pressed mid-save
            calls.append(b)
            yield b

    monkeypatch.setattr(_stream, "blocks", blocks_with_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        g.save(target, progress=False)
    assert len(calls) == 3  # stopped at the first safe point after the press
    assert os.listdir(tmp_path) == []


# ---- the word2vec example ----------------------------------------------------------------
def _w2v(argv, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from datasets import word2vec

    try:
        rc = word2vec.main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr()


def test_word2vec_user_errors_are_one_line(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b c a b c\n" * 20, encoding="utf-8")
    one = tmp_path / "one.txt"
    one.write_text("word word word\n", encoding="utf-8")
    cases = [
        ([str(tmp_path / "missing.txt")], "no such file"),
        ([str(tmp_path)], "not a file"),
        ([str(corpus), "--dim", "0"], "at least 1"),
        ([str(corpus), "--window", "0"], "at least 1"),
        ([str(corpus), "--out", "/nonexistent/gl/v"], "not a writable directory"),
        ([str(one), "--placement", "cpu"], "needs at least 2"),
    ]
    for argv, message in cases:
        rc, out = _w2v([*argv, "--no-progress"], capsys)
        assert rc in (1, 2), argv
        assert message in out.err and "Traceback" not in out.err, argv
        assert len(out.err.strip().splitlines()) == 1, out.err  # no usage block either


def test_bench_help_shows_the_suite_before_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith("usage: gadgetloader bench [-h] [SUITE]"), usage


def test_word2vec_show_lowercases_and_reports_unknown_words(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("King queen crown King queen\ncat dog pet cat dog\n" * 50, encoding="utf-8")
    argv = [str(corpus), "--dim", "8", "--placement", "cpu", "--device", "cpu"]
    rc, out = _w2v([*argv, "--no-progress", "--show", "King,nope"], capsys)
    assert rc == 0
    assert "king: " in out.out and "nope: not in the vocabulary" in out.out
