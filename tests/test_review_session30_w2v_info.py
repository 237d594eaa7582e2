"""Black-box review (session 30) of the word2vec example (``python -m datasets.word2vec``)
and the ``gadgetloader info`` command line; written from README.md, SPEC.md and the public
docstrings only.

The command lines run as subprocesses (all started at once from a module fixture, a few at a
time, so the file stays well under its time budget); the many bad-number cases also go
through ``datasets.word2vec.main(argv)`` in-process, which is the same code the ``-m`` entry
point runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.metadata
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import gadgetloader as gl
from datasets import word2vec as w2v


@pytest.fixture(autouse=True, scope="module")
def _hide_cuda():
    """These tests check the behaviour on a machine without CUDA: on a GPU machine the
    library is made to see none (its defaults there differ: pinned tables, CUDA output)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


REPO = Path(__file__).resolve().parents[1]
GROUPS = [
    ["king", "queen", "royal", "crown"],
    ["cat", "dog", "pet", "fur"],
    ["apple", "banana", "fruit", "juice"],
]
GROUP_OF = {word: g for g in GROUPS for word in g}
TIMEOUT = 80


def _group_corpus(blocks: int = 20, per: int = 60, seed: int = 0) -> str:
    """Blocks of one topic each (strong co-occurrence), mixed case, plus two rare words."""
    rnd = random.Random(seed)
    lines = []
    for b in range(blocks):
        g = GROUPS[b % 3]
        toks = [rnd.choice(g) for _ in range(per)]
        toks = [
            t.upper() if rnd.random() < 0.2 else t.capitalize() if rnd.random() < 0.2 else t
            for t in toks
        ]
        for k in range(0, per, 6):
            lines.append(" ".join(toks[k : k + 6]))
    lines.insert(5, "Twice rareword")  # 'twice' twice only after lower-casing
    lines.insert(50, "twice")
    return "\n".join(lines) + "\n"


def _expected_counts(text: str, min_count: int) -> Counter:
    c = Counter(t.lower() for t in text.split())
    return Counter({k: v for k, v in c.items() if v >= min_count})


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PYTHONWARNINGS", None)
    env["OMP_NUM_THREADS"] = "1"  # tiny tables; keeps the parallel runs from oversubscribing
    env["CUDA_VISIBLE_DEVICES"] = ""  # the runs check the behaviour without a GPU
    return env


def _run(args, cwd=REPO):
    p = subprocess.run(
        args,
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    return p


def _w2v(*args, cwd=REPO):
    return _run([sys.executable, "-m", "datasets.word2vec", *map(str, args)], cwd=cwd)


def _gl(*args, cwd=REPO):
    return _run([sys.executable, "-m", "gadgetloader", *map(str, args)], cwd=cwd)


def _console_script() -> str | None:
    """The installed ``gadgetloader`` entry point, or None in a source tree (PYTHONPATH runs)."""
    exe = Path(sys.executable).with_name("gadgetloader")
    return str(exe) if exe.exists() else shutil.which("gadgetloader")


def _gl_script(*args, cwd=REPO):
    exe = _console_script()
    cmd = [exe] if exe is not None else [sys.executable, "-m", "gadgetloader"]
    return _run(cmd + list(map(str, args)), cwd=cwd)


def _nonempty_lines(s: str) -> list[str]:
    return [ln for ln in s.splitlines() if ln.strip()]


def _read_vocab(path: Path) -> list[tuple[str, int]]:
    rows = []
    for ln in path.read_text(encoding="utf-8").splitlines():
        word, count = ln.split()
        rows.append((word, int(count)))
    return rows


def _losses(stdout: str) -> list[float]:
    m = re.search(r"loss per epoch:\s*(.*)", stdout)
    assert m, stdout
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", m.group(1))]


def _show_lines(stdout: str) -> dict[str, str]:
    out = {}
    for ln in stdout.splitlines():
        m = re.match(r"^(\S+): (.*)$", ln)
        if m and not ln.startswith("vocabulary") and not ln.startswith("wrote"):
            out[m.group(1)] = m.group(2)
    return out


def _cos(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float64)
    n = v / np.linalg.norm(v, axis=1, keepdims=True)
    return n @ n.T


COMMON = ["--placement", "cpu", "--dim", "16", "--batch-size", "256", "--no-progress"]


# ----------------------------------------------------------------------------------------
# all subprocesses, started at once


def _make_files(d: Path) -> Path:
    text = _group_corpus()
    (d / "corpus.txt").write_text(text, encoding="utf-8")
    (d / "empty.txt").write_text("", encoding="utf-8")
    (d / "blank.txt").write_text(" \n\t\n\n", encoding="utf-8")
    (d / "one.txt").write_text("Hello hello HELLO\nhello\n", encoding="utf-8")
    (d / "mc.txt").write_text("a a a b\n", encoding="utf-8")
    (d / "lc.txt").write_text(
        "ÉCOLE école\r\nKing\tqueen   KING\r\n\r\n  apple  Apple\tqueen\r\nking, king\n",
        encoding="utf-8",
    )
    (d / "adir").mkdir()
    (d / "npydir" / "v.npy").mkdir(parents=True)
    (d / "vocdir" / "v.vocab.txt").mkdir(parents=True)
    (d / "afile").write_text("x", encoding="utf-8")
    cwdrun = d / "cwdrun"
    cwdrun.mkdir()
    (cwdrun / "c.txt").write_text(text, encoding="utf-8")
    (d / "stale.json").write_text("not json {", encoding="utf-8")
    (d / "repeat.npy").write_bytes(b"junk")
    (d / "repeat.vocab.txt").write_text("junk 1\n", encoding="utf-8")
    (d / "ab.txt").write_text("a b\n", encoding="utf-8")
    (d / "sv").mkdir()
    (d / "sv" / "full.npy").symlink_to("/dev/full")
    (d / "sv" / "dangling.npy").symlink_to(d / "nodir" / "q.npy")
    return d


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Files for the subprocess runs."""
    return _make_files(tmp_path_factory.mktemp("w2v"))


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    """The same files for the in-process runs (nothing else writes here)."""
    return _make_files(tmp_path_factory.mktemp("w2v_inproc"))


@pytest.fixture(scope="module")
def runs(ws):
    c = ws / "corpus.txt"
    jobs = {
        # good runs
        "main": lambda: _w2v(
            c,
            *COMMON,
            "--epochs",
            "3",
            "--seed",
            "1",
            "--min-count",
            "2",
            "--out",
            ws / "main",
            "--show",
            "king,ZZZ,Queen,rareword",
        ),
        "ep1": lambda: _w2v(
            c,
            *COMMON,
            "--epochs",
            "1",
            "--seed",
            "1",
            "--min-count",
            "2",
            "--out",
            ws / "ep1",
            "--show",
            "king,ZZZ,Queen,rareword",
        ),
        "repeat": lambda: _w2v(
            c,
            *COMMON,
            "--epochs",
            "1",
            "--seed",
            "1",
            "--min-count",
            "2",
            "--out",
            ws / "repeat",
            "--show",
            "king,ZZZ,Queen,rareword",
        ),
        "seed2": lambda: _w2v(
            c, *COMMON, "--epochs", "1", "--seed", "2", "--min-count", "2", "--out", ws / "seed2"
        ),
        "lc": lambda: _w2v(
            ws / "lc.txt",
            *COMMON,
            "--epochs",
            "1",
            "--out",
            ws / "lc",
            "--show",
            "ÉCOLE,King,king,,apple",
        ),
        # default placement (pinned -> plain RAM here), no --out, progress left at default
        "cwd": lambda: _w2v(
            "c.txt",
            "--dim",
            "8",
            "--batch-size",
            "256",
            "--epochs",
            "1",
            "--show",
            "king",
            cwd=ws / "cwdrun",
        ),
        # documented one-line errors
        "e_missing": lambda: _w2v(ws / "nope.txt", *COMMON, "--out", ws / "e_missing"),
        "e_empty": lambda: _w2v(ws / "empty.txt", *COMMON, "--out", ws / "e_empty"),
        "e_one": lambda: _w2v(ws / "one.txt", *COMMON, "--out", ws / "e_one"),
        "e_outdir": lambda: _w2v(c, *COMMON, "--out", ws / "adir"),
        "e_lrinf": lambda: _w2v(c, *COMMON, "--lr", "inf", "--out", ws / "e_lrinf"),
        "e_seedneg": lambda: _w2v(c, *COMMON, "--seed", "-1", "--out", ws / "e_seedneg"),
        # gadgetloader CLI
        "info": lambda: _gl_script("info"),
        "info_m": lambda: _gl("info", "--no-measure", "--json", ws / "stale.json"),
        "info_json": lambda: _gl_script("info", "--no-measure", "--json", ws / "info.json"),
        "info_json_nodir": lambda: _gl("info", "--no-measure", "--json", ws / "nodir" / "i.json"),
        "info_json_dir": lambda: _gl("info", "--no-measure", "--json", ws / "adir"),
        "gl_help": lambda: _gl("--help"),
        "info_help": lambda: _gl("info", "--help"),
    }
    ex = cf.ThreadPoolExecutor(max_workers=3)
    futs = {k: ex.submit(f) for k, f in jobs.items()}
    yield futs
    ex.shutdown(wait=True)


def _get(runs, key) -> subprocess.CompletedProcess:
    return runs[key].result(timeout=2 * TIMEOUT)


# ----------------------------------------------------------------------------------------
# word2vec: outputs


def test_main_run_succeeds(runs):
    p = _get(runs, "main")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr


def test_npy_shape_dtype_finite(runs, ws):
    _get(runs, "main")
    v = np.load(ws / "main.npy")
    exp = _expected_counts((ws / "corpus.txt").read_text(encoding="utf-8"), 2)
    assert v.shape == (len(exp), 16)
    assert v.dtype == np.float32
    assert np.isfinite(v).all()


def test_vocab_file_words_and_counts_match_corpus(runs, ws):
    _get(runs, "main")
    rows = _read_vocab(ws / "main.vocab.txt")
    exp = _expected_counts((ws / "corpus.txt").read_text(encoding="utf-8"), 2)
    assert dict(rows) == dict(exp)
    assert len(rows) == len(set(w for w, _ in rows))


def test_vocab_file_most_frequent_first(runs, ws):
    _get(runs, "main")
    counts = [c for _, c in _read_vocab(ws / "main.vocab.txt")]
    assert counts == sorted(counts, reverse=True)


def test_vocab_rows_match_npy_rows(runs, ws):
    _get(runs, "main")
    assert len(_read_vocab(ws / "main.vocab.txt")) == np.load(ws / "main.npy").shape[0]


def test_min_count_boundary_kept_and_dropped(runs, ws):
    _get(runs, "main")
    words = [w for w, _ in _read_vocab(ws / "main.vocab.txt")]
    assert "twice" in words  # exactly min_count (2) occurrences after lower-casing
    assert "rareword" not in words


def test_vocab_is_lower_cased(runs, ws):
    _get(runs, "main")
    words = [w for w, _ in _read_vocab(ws / "main.vocab.txt")]
    assert all(w == w.lower() for w in words)
    assert "King" not in words and "KING" not in words


def test_stdout_reports_vocabulary_size(runs, ws):
    p = _get(runs, "main")
    exp = _expected_counts((ws / "corpus.txt").read_text(encoding="utf-8"), 2)
    m = re.search(r"vocabulary (\d+) words", p.stdout)
    assert m and int(m.group(1)) == len(exp)


def test_stdout_reports_written_files(runs, ws):
    p = _get(runs, "main")
    assert str(ws / "main.npy") in p.stdout
    assert str(ws / "main.vocab.txt") in p.stdout


def test_loss_per_epoch_one_value_per_epoch(runs):
    assert len(_losses(_get(runs, "main").stdout)) == 3
    assert len(_losses(_get(runs, "ep1").stdout)) == 1


def test_training_lowers_loss(runs):
    losses = _losses(_get(runs, "main").stdout)
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0]


def test_more_epochs_move_vectors(runs, ws):
    _get(runs, "main")
    _get(runs, "ep1")
    a = np.load(ws / "ep1.npy")
    b = np.load(ws / "main.npy")
    assert a.shape == b.shape
    assert not np.allclose(a, b)


def test_related_words_closest_after_three_epochs(runs, ws):
    _get(runs, "main")
    v = np.load(ws / "main.npy")
    words = [w for w, _ in _read_vocab(ws / "main.vocab.txt")]
    S = _cos(v)
    bad = []
    for i, word in enumerate(words):
        if word not in GROUP_OF:
            continue
        top = [words[j] for j in np.argsort(-S[i]) if j != i][:3]
        if set(top) != set(GROUP_OF[word]) - {word}:
            bad.append((word, top))
    assert not bad


def test_related_words_ranked_first_after_one_epoch(runs, ws):
    # README: "a small corpus ... ranks related words first after one epoch"
    _get(runs, "ep1")
    v = np.load(ws / "ep1.npy")
    words = [w for w, _ in _read_vocab(ws / "ep1.vocab.txt")]
    S = _cos(v)
    bad = []
    for i, word in enumerate(words):
        if word not in GROUP_OF:
            continue
        top = [words[j] for j in np.argsort(-S[i]) if j != i][0]
        if top not in GROUP_OF[word]:
            bad.append((word, top))
    assert len(bad) <= 2, bad  # a large majority of the 12 topic words


def test_same_seed_is_deterministic(runs, ws):
    # also: existing OUT.npy / OUT.vocab.txt (junk) are replaced
    p1, p2 = _get(runs, "ep1"), _get(runs, "repeat")
    assert p1.returncode == p2.returncode == 0
    assert np.array_equal(np.load(ws / "ep1.npy"), np.load(ws / "repeat.npy"))
    assert (ws / "ep1.vocab.txt").read_text() == (ws / "repeat.vocab.txt").read_text()
    assert _losses(p1.stdout) == _losses(p2.stdout)
    assert _show_lines(p1.stdout) == _show_lines(p2.stdout)


def test_different_seed_gives_different_vectors(runs, ws):
    _get(runs, "ep1")
    p = _get(runs, "seed2")
    assert p.returncode == 0, p.stderr
    assert (ws / "ep1.vocab.txt").read_text() == (ws / "seed2.vocab.txt").read_text()
    assert not np.allclose(np.load(ws / "ep1.npy"), np.load(ws / "seed2.npy"))


# --show


def test_show_known_word_lists_neighbours_matching_saved_vectors(runs, ws):
    p = _get(runs, "main")
    show = _show_lines(p.stdout)
    assert "king" in show, p.stdout
    items = re.findall(r"(\S+) \((-?\d+\.\d+)\)", show["king"])
    assert items, show["king"]
    words = [w for w, _ in _read_vocab(ws / "main.vocab.txt")]
    S = _cos(np.load(ws / "main.npy"))
    i = words.index("king")
    others = sorted((S[i, j] for j in range(len(words)) if j != i), reverse=True)
    vals = [float(x) for _, x in items]
    assert vals == sorted(vals, reverse=True)
    for word, val in items:
        word = word.rstrip(",")
        assert word != "king" and word in words
        assert abs(S[i, words.index(word)] - float(val)) < 0.0051
        assert S[i, words.index(word)] >= others[len(items) - 1] - 1e-6


def test_show_is_lower_cased(runs):
    show = _show_lines(_get(runs, "main").stdout)
    assert "queen" in show or "Queen" in show
    line = show.get("queen", show.get("Queen"))
    assert "not in the vocabulary" not in line


@pytest.mark.parametrize("word", ["ZZZ", "rareword"])
def test_show_unknown_word_reported(runs, word):
    p = _get(runs, "main")
    assert p.returncode == 0
    lines = [ln for ln in p.stdout.splitlines() if word.lower() in ln.lower()]
    assert lines and all("not in the vocabulary" in ln for ln in lines), p.stdout


def test_show_order_follows_request(runs):
    p = _get(runs, "main")
    keys = list(_show_lines(p.stdout))
    low = [k.lower() for k in keys]
    assert low.index("king") < low.index("zzz") < low.index("queen") < low.index("rareword")


# lower-casing, whitespace


def test_lc_run_vocab_lower_cased_and_whitespace_split(runs, ws):
    p = _get(runs, "lc")
    assert p.returncode == 0, p.stderr
    rows = dict(_read_vocab(ws / "lc.vocab.txt"))
    text = (ws / "lc.txt").read_text(encoding="utf-8")
    assert rows == dict(_expected_counts(text, 1))
    assert rows["école"] == 2 and rows["king"] == 3 and rows["king,"] == 1


def test_lc_run_crlf_not_in_tokens(runs, ws):
    _get(runs, "lc")
    raw = (ws / "lc.vocab.txt").read_bytes()
    assert b"\r" not in raw


def test_lc_run_show_unicode_upper_case(runs):
    show = _show_lines(_get(runs, "lc").stdout)
    key = next((k for k in show if k.lower() == "école"), None)
    assert key is not None, show
    assert "not in the vocabulary" not in show[key]


def test_lc_run_show_king_twice_same_answer(runs):
    p = _get(runs, "lc")
    lines = [ln for ln in p.stdout.splitlines() if ln.lower().startswith("king:")]
    assert len(lines) >= 1
    assert len(set(lines)) == 1
    assert "not in the vocabulary" not in lines[0]


def test_default_placement_runs_without_gpu_and_writes_nothing_without_out(runs, ws):
    p = _get(runs, "cwd")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert re.search(r"vocabulary \d+ words", p.stdout)
    assert sorted(x.name for x in (ws / "cwdrun").iterdir()) == ["c.txt"]
    assert "king:" in p.stdout


def test_no_progress_bar_when_stderr_is_not_a_terminal(runs):
    # train(): "progress: tqdm progress bar (default: when stderr is a terminal)"
    p = _get(runs, "cwd")
    assert "it/s" not in p.stderr and "%|" not in p.stderr


# ----------------------------------------------------------------------------------------
# word2vec: documented one-line errors, as subprocesses

ERROR_RUNS = {
    "e_missing": "nope.txt",
    "e_empty": "empty.txt",
    "e_one": "one.txt",
    "e_outdir": "adir",
    "e_lrinf": "--lr",
    "e_seedneg": "--seed",
}


@pytest.mark.parametrize("key", sorted(ERROR_RUNS))
def test_error_is_one_line_nonzero_no_traceback(runs, key):
    p = _get(runs, key)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    lines = _nonempty_lines(p.stderr)
    assert len(lines) == 1, p.stderr
    assert "error" in lines[0].lower()
    assert ERROR_RUNS[key] in lines[0]


@pytest.mark.parametrize("key", sorted(ERROR_RUNS))
def test_error_before_training_writes_nothing(runs, ws, key):
    p = _get(runs, key)
    assert p.returncode != 0
    assert "loss per epoch" not in p.stdout
    assert not (ws / f"{key}.npy").exists() and not (ws / f"{key}.vocab.txt").exists()


def test_error_out_names_folder_leaves_it_alone(runs, ws):
    _get(runs, "e_outdir")
    assert list((ws / "adir").iterdir()) == []
    assert not (ws / "adir.npy").exists()


# ----------------------------------------------------------------------------------------
# word2vec: bad numbers through main(argv) (what -m runs), one line on stderr


def _main(argv, capsys):
    try:
        rc = w2v.main([str(a) for a in argv])
    except SystemExit as e:  # argparse-style exits
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


BAD_NUMBERS = [
    ("--dim", "0"),
    ("--dim", "-3"),
    ("--dim", "abc"),
    ("--dim", "1.5"),
    ("--dim", ""),
    ("--epochs", "0"),
    ("--epochs", "-1"),
    ("--epochs", "2.0"),
    ("--epochs", "nan"),
    ("--window", "0"),
    ("--window", "-2"),
    ("--window", "x"),
    ("--negatives", "0"),
    ("--negatives", "-5"),
    ("--negatives", "1e9"),
    ("--batch-size", "0"),
    ("--batch-size", "-1"),
    ("--batch-size", "1e3"),
    ("--lr", "0"),
    ("--lr", "-0.1"),
    ("--lr", "inf"),
    ("--lr", "Infinity"),
    ("--lr", "nan"),
    ("--lr", "1e400"),
    ("--lr", "abc"),
    ("--lr", "-0"),
    ("--lr=-inf", None),
    ("--min-count", "0"),
    ("--min-count", "-1"),
    ("--min-count", "two"),
    ("--seed", "-1"),
    ("--seed", "1.5"),
    ("--seed", "abc"),
    ("--seed", str(2**64)),
    ("--placement", "gpu"),
]


@pytest.mark.parametrize("opt,val", BAD_NUMBERS, ids=[f"{o}={v}" for o, v in BAD_NUMBERS])
def test_bad_number_is_one_line_error(ws2, capsys, opt, val, tmp_path):
    out = tmp_path / "v"
    extra = [opt] if val is None else [opt, val]
    rc, so, se = _main(
        [ws2 / "corpus.txt", "--placement", "cpu", "--no-progress", "--out", out, *extra], capsys
    )
    assert rc not in (0, None)
    lines = _nonempty_lines(se)
    assert len(lines) == 1, se
    assert opt.split("=")[0] in lines[0]
    assert "loss per epoch" not in so
    assert list(tmp_path.iterdir()) == []


INPROC_ERRORS = {
    "dircorpus": (lambda ws: [ws / "adir"], "adir"),
    "blank": (lambda ws: [ws / "blank.txt"], "blank.txt"),
    "mincount": (lambda ws: [ws / "mc.txt", "--min-count", "2"], "mc.txt"),
    "case_folded_one_word": (lambda ws: [ws / "one.txt"], "one.txt"),
    "outdir_slash": (lambda ws: [ws / "corpus.txt", "--out", str(ws / "adir") + "/"], "adir"),
    "outparentfile": (lambda ws: [ws / "corpus.txt", "--out", ws / "afile" / "v"], "afile"),
    "vocdir": (lambda ws: [ws / "corpus.txt", "--out", ws / "vocdir" / "v"], "v.vocab.txt"),
    "npydir": (lambda ws: [ws / "corpus.txt", "--out", ws / "npydir" / "v"], "v.npy"),
}


@pytest.mark.parametrize("case", sorted(INPROC_ERRORS))
def test_corpus_and_out_errors_in_process(ws2, capsys, case):
    argv, frag = INPROC_ERRORS[case]
    before = sorted(str(p) for p in ws2.rglob("*"))
    rc, so, se = _main([*argv(ws2), "--placement", "cpu", "--no-progress", "--dim", "4"], capsys)
    assert rc not in (0, None)
    lines = _nonempty_lines(se)
    assert len(lines) == 1 and frag in lines[0], se
    assert "loss per epoch" not in so
    assert sorted(str(p) for p in ws2.rglob("*")) == before


@pytest.mark.parametrize("seed", ["0", str(2**63 - 1)])
def test_seed_bounds_accepted_by_parser(ws2, capsys, seed, tmp_path):
    # 0 and the largest accepted seed must not be rejected as "bad numbers"; a missing
    # corpus is then the (first) error reported.
    rc, so, se = _main([tmp_path / "missing.txt", "--placement", "cpu", "--seed", seed], capsys)
    assert rc not in (0, None)
    assert "--seed" not in se and "missing.txt" in se


def test_default_placement_fallback_warning_given_once(runs):
    # README: a GPU placement by name "falls back with a FallbackWarning, given once per
    # process"; the example's default placement is 'pinned' (plain RAM without CUDA).
    p = _get(runs, "cwd")
    assert p.stderr.count("FallbackWarning") <= 1


def test_default_lr_is_0_01(ws2, capsys, tmp_path):
    # README: "Adam's learning rate is 0.01 by default (`--lr`)"
    # several steps: the first step cannot move the input vectors when the output table
    # starts at zero (word2vec's usual start), so a one-step run would not show the lr
    base = [
        ws2 / "lc.txt",
        "--placement",
        "cpu",
        "--no-progress",
        "--dim",
        "4",
        "--seed",
        "3",
        "--batch-size",
        "4",
        "--epochs",
        "2",
    ]
    outs = {}
    for name, extra in [("default", []), ("lr001", ["--lr", "0.01"]), ("lr002", ["--lr", "0.02"])]:
        rc, so, se = _main([*base, "--out", tmp_path / name, *extra], capsys)
        assert rc in (0, None), se
        outs[name] = np.load(tmp_path / f"{name}.npy")
    assert np.array_equal(outs["default"], outs["lr001"])
    assert not np.allclose(outs["default"], outs["lr002"])


@pytest.mark.parametrize("link", ["full", "dangling"])
def test_save_failing_after_training_is_one_line_error(ws2, capsys, link):
    # README: "a save that fails after training is a one-line error too"; since session 51
    # these two outputs (a device, a link into a missing folder) are refused before training
    target = os.readlink(ws2 / "sv" / f"{link}.npy")
    rc, so, se = _main(
        [
            ws2 / "lc.txt",
            "--placement",
            "cpu",
            "--no-progress",
            "--dim",
            "4",
            "--out",
            ws2 / "sv" / link,
        ],
        capsys,
    )
    assert rc == 2
    lines = _nonempty_lines(se)
    assert len(lines) == 1 and "error" in lines[0] and link in lines[0], se
    assert "loss per epoch" not in so  # refused before training
    assert "wrote" not in so
    assert (ws2 / "sv" / f"{link}.npy").is_symlink()
    assert os.readlink(ws2 / "sv" / f"{link}.npy") == target
    assert not (ws2 / "sv" / f"{link}.vocab.txt").exists()


def test_two_word_corpus_is_enough(ws2, capsys, tmp_path):
    rc, so, se = _main(
        [
            ws2 / "ab.txt",
            "--placement",
            "cpu",
            "--no-progress",
            "--dim",
            "4",
            "--out",
            tmp_path / "ab",
            "--show",
            "a,b",
        ],
        capsys,
    )
    assert rc in (0, None), se
    assert np.load(tmp_path / "ab.npy").shape == (2, 4)
    assert sorted(_read_vocab(tmp_path / "ab.vocab.txt")) == [("a", 1), ("b", 1)]
    show = _show_lines(so)
    assert show["a"].startswith("b ") and show["b"].startswith("a ")


@pytest.mark.parametrize(
    "extra",
    [
        ["--seed", str(2**63 - 1)],
        ["--seed", "0"],
        ["--batch-size", "100000"],
        ["--window", "1000"],
        ["--negatives", "64"],
        ["--min-count", "1", "--epochs", "2"],
    ],
    ids=["seed-max", "seed-0", "batch>pairs", "window>corpus", "many-negatives", "epochs2"],
)
def test_edge_settings_train_and_save(ws2, capsys, tmp_path, extra):
    rc, so, se = _main(
        [
            ws2 / "lc.txt",
            "--placement",
            "cpu",
            "--no-progress",
            "--dim",
            "4",
            "--out",
            tmp_path / "v",
            *extra,
        ],
        capsys,
    )
    assert rc in (0, None), se
    exp = _expected_counts((ws2 / "lc.txt").read_text(encoding="utf-8"), 1)
    v = np.load(tmp_path / "v.npy")
    assert v.shape == (len(exp), 4) and np.isfinite(v).all()
    assert dict(_read_vocab(tmp_path / "v.vocab.txt")) == dict(exp)
    assert all(np.isfinite(_losses(so)))


# ----------------------------------------------------------------------------------------
# word2vec: the documented Python API (build_vocab, skipgram_pairs, Vocab, train)


@pytest.mark.parametrize("min_count", [1, 2, 3])
def test_build_vocab_counts_order_and_ids(tmp_path, min_count):
    text = "b B a\tC c c\r\n\nA a d E\u00c9 \u00e9 b\n"
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode("utf-8"))
    vocab, ids = w2v.build_vocab(f, min_count=min_count)
    exp = _expected_counts(text, min_count)
    assert dict(zip(vocab.words, vocab.counts.tolist(), strict=True)) == dict(exp)
    assert list(vocab.counts) == sorted(vocab.counts, reverse=True)
    assert len(vocab) == len(exp)
    toks = [t.lower() for t in text.split() if t.lower() in exp]
    assert [vocab.words[i] for i in np.asarray(ids).tolist()] == toks
    assert vocab.index == {w: i for i, w in enumerate(vocab.words)}


def test_vocab_index_default(tmp_path):
    v = w2v.Vocab(["x", "y", "z"], np.array([3, 2, 1]))
    assert v.index == {"x": 0, "y": 1, "z": 2}
    assert len(v) == 3


def _ref_window1(n):
    pairs = []
    for c in range(n):
        for x in (c - 1, c + 1):
            if 0 <= x < n:
                pairs.append((c, x))
    return sorted(pairs)


@pytest.mark.parametrize("n", [2, 3, 10, 37])
def test_skipgram_pairs_window1_exact(n):
    c, x = w2v.skipgram_pairs(np.arange(n), 1, np.random.default_rng(0))
    assert sorted(zip(np.asarray(c).tolist(), np.asarray(x).tolist(), strict=True)) == _ref_window1(
        n
    )


@pytest.mark.parametrize("window", [2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_skipgram_pairs_dynamic_window_shape(window, seed):
    n = 60
    c, x = w2v.skipgram_pairs(np.arange(n), window, np.random.default_rng(seed))
    c, x = np.asarray(c), np.asarray(x)
    assert len(c) == len(x)
    pairs = list(zip(c.tolist(), x.tolist(), strict=True))
    assert len(set(pairs)) == len(pairs)  # no pair twice
    assert all(1 <= abs(a - b) <= window for a, b in pairs)
    for center in range(n):
        ctx = sorted(b for a, b in pairs if a == center)
        assert ctx, center  # every center has its window (>= 1)
        b = max(abs(t - center) for t in ctx)
        want = [t for t in range(center - b, center + b + 1) if t != center and 0 <= t < n]
        assert ctx == want, (center, ctx)


def test_skipgram_pairs_maps_ids_not_positions():
    ids = np.array([7, 3, 9, 3])
    c, x = w2v.skipgram_pairs(ids, 1, np.random.default_rng(0))
    got = sorted(zip(np.asarray(c).tolist(), np.asarray(x).tolist(), strict=True))
    want = sorted((int(ids[a]), int(ids[b])) for a, b in _ref_window1(4))
    assert got == want


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("chunk", [5, 7, 13])
def test_skipgram_pairs_chunks_cover_every_pair_once(window, chunk):
    n = 40
    ids = np.arange(n)
    pairs = []
    rng = np.random.default_rng(3)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        start, stop = max(0, lo - window), min(n, hi + window)
        c, x = w2v.skipgram_pairs(ids[start:stop], window, rng, centers_in=(lo - start, hi - start))
        c, x = np.asarray(c), np.asarray(x)
        assert ((c >= lo) & (c < hi)).all()
        pairs += list(zip(c.tolist(), x.tolist(), strict=True))
    assert len(set(pairs)) == len(pairs)
    assert sorted({a for a, _ in pairs}) == list(range(n))
    assert all(1 <= abs(a - b) <= window for a, b in pairs)
    if window == 1:
        assert sorted(pairs) == _ref_window1(n)


def test_skipgram_pairs_same_rng_seed_same_pairs():
    ids = np.arange(50)
    a = w2v.skipgram_pairs(ids, 4, np.random.default_rng(5))
    b = w2v.skipgram_pairs(ids, 4, np.random.default_rng(5))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.fixture(scope="module")
def api_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    f = d / "g.txt"
    f.write_text(_group_corpus(blocks=10, seed=4), encoding="utf-8")
    return f


@pytest.fixture(scope="module")
def trained(api_corpus):
    return w2v.train(
        api_corpus,
        dim=12,
        epochs=3,
        batch_size=128,
        placement="cpu",
        device="cpu",
        seed=7,
        progress=False,
        min_count=2,
    )


def test_train_result_shapes_and_losses(trained, api_corpus):
    exp = _expected_counts(api_corpus.read_text(encoding="utf-8"), 2)
    v = trained.vectors()
    assert isinstance(v, np.ndarray) and v.shape == (len(exp), 12)
    assert len(trained.losses) == 3 and all(np.isfinite(trained.losses))
    assert trained.losses[-1] < trained.losses[0]
    assert dict(zip(trained.vocab.words, trained.vocab.counts.tolist(), strict=True)) == dict(exp)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_most_similar_matches_numpy_cosines(trained, k):
    words = trained.vocab.words
    S = _cos(trained.vectors())
    i = words.index("cat")
    got = trained.most_similar("cat", k)
    assert len(got) == k
    assert all(w != "cat" for w, _ in got)
    sims = [s for _, s in got]
    assert sims == sorted(sims, reverse=True)
    kth = sorted((S[i, j] for j in range(len(words)) if j != i), reverse=True)[k - 1]
    for w, s in got:
        assert abs(S[i, words.index(w)] - s) < 1e-4
        assert s >= kth - 1e-4


@pytest.mark.parametrize("k", [0, 100])
def test_most_similar_k_edges(trained, k):
    got = trained.most_similar("dog", k)
    assert len(got) == min(k, len(trained.vocab) - 1)
    assert "dog" not in [w for w, _ in got]


def test_most_similar_related_words(trained):
    top = {w for w, _ in trained.most_similar("apple", 3)}
    assert top == {"banana", "fruit", "juice"}


def test_save_writes_vectors_and_vocab(trained, tmp_path):
    trained.save(tmp_path / "p")
    v = np.load(tmp_path / "p.npy")
    assert np.array_equal(v, trained.vectors())
    rows = _read_vocab(tmp_path / "p.vocab.txt")
    assert [w for w, _ in rows] == list(trained.vocab.words)
    assert [c for _, c in rows] == trained.vocab.counts.tolist()


def test_train_vectors_move_from_init(api_corpus, trained):
    init = w2v.Word2VecResult(
        trained.vocab, w2v.SkipGram(len(trained.vocab), 12, "cpu", "cpu", 7), []
    ).vectors()
    assert init.shape == trained.vectors().shape
    assert not np.allclose(init, trained.vectors())
    # related words: ranked first after training, not at the random start
    words = trained.vocab.words

    def n_ok(v):
        S = _cos(v)
        ok = 0
        for i, a in enumerate(words):
            if a in GROUP_OF:
                top = [words[j] for j in np.argsort(-S[i]) if j != i][:3]
                ok += set(top) == set(GROUP_OF[a]) - {a}
        return ok

    assert n_ok(trained.vectors()) == 12
    assert n_ok(init) < 6


def test_train_small_chunks(api_corpus):
    r = w2v.train(
        api_corpus,
        dim=8,
        epochs=1,
        batch_size=128,
        placement="cpu",
        device="cpu",
        seed=1,
        progress=False,
        chunk_tokens=50,
    )
    assert len(r.losses) == 1 and all(np.isfinite(r.losses))
    assert r.vectors().shape == (len(r.vocab), 8)
    assert np.isfinite(r.vectors()).all()


# ----------------------------------------------------------------------------------------
# gadgetloader info / --help


def _info_fields(stdout: str) -> dict[str, str]:
    out = {}
    for ln in stdout.splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_]+): (.*)$", ln)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


@pytest.mark.parametrize("key", ["info", "info_m"])
def test_info_exit_zero_no_traceback(runs, key):
    p = _get(runs, key)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("key", ["info", "info_m", "info_json"])
def test_info_lists_versions(runs, key):
    f = _info_fields(_get(runs, key).stdout)
    assert f.get("gadgetloader") == gl.__version__
    assert f.get("torch") == torch.__version__
    assert f.get("numpy") == np.__version__
    assert f.get("python") == platform.python_version()


def test_info_reports_no_gpu(runs):
    f = _info_fields(_get(runs, "info").stdout)
    assert f.get("cuda_available") == "False"
    assert "none" in f.get("gpu", "").lower()


def test_info_torch_cuda_field_matches_torch(runs):
    f = _info_fields(_get(runs, "info").stdout)
    if torch.version.cuda is None:
        assert f.get("torch_cuda", "").startswith("none")
    else:
        assert torch.version.cuda in f.get("torch_cuda", "")


def test_info_no_bandwidth_claim_without_gpu(runs):
    # README: "measured link bandwidth (with a GPU ...)": nothing measured here
    out = _get(runs, "info").stdout
    assert "GB/s" not in out


def test_info_console_script_and_module_agree(runs):
    if _console_script() is None:
        pytest.skip(
            "the gadgetloader console script is not installed here (run from a source tree)"
        )
    assert _info_fields(_get(runs, "info").stdout) == _info_fields(_get(runs, "info_m").stdout)


def test_info_json_matches_printed(runs, ws):
    p = _get(runs, "info_json")
    assert p.returncode == 0, p.stderr
    data = json.loads((ws / "info.json").read_text())
    printed = _info_fields(p.stdout)
    assert set(data) == set(printed)
    assert data["gadgetloader"] == gl.__version__
    assert data["torch"] == torch.__version__
    assert data["numpy"] == np.__version__
    assert data["python"] == platform.python_version()
    assert data["cuda_available"] is False
    for k, v in data.items():
        if isinstance(v, str):
            assert printed[k] == v, k


@pytest.mark.parametrize("dist", ["h5py", "zarr", "tqdm"])
def test_info_json_optional_versions(runs, ws, dist):
    _get(runs, "info_json")
    data = json.loads((ws / "info.json").read_text())
    try:
        want = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        want = None
    if want is None:
        assert data.get(dist) in (None, "not installed")
    else:
        assert data[dist] == want


def test_info_json_overwrites_existing_file(runs, ws):
    p = _get(runs, "info_m")
    assert p.returncode == 0, p.stderr
    data = json.loads((ws / "stale.json").read_text())
    assert data["gadgetloader"] == gl.__version__


@pytest.mark.parametrize("key,frag", [("info_json_nodir", "nodir"), ("info_json_dir", "adir")])
def test_info_json_bad_path_refused(runs, ws, key, frag):
    p = _get(runs, key)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    err = [ln for ln in _nonempty_lines(p.stderr) if "error" in ln]
    assert len(err) == 1 and frag in err[0]
    assert (ws / "adir").is_dir() and not (ws / "nodir").exists()


@pytest.mark.parametrize("key", ["gl_help"])
def test_help_lists_subcommands(runs, key):
    p = _get(runs, key)
    assert p.returncode == 0
    for sub in ("info", "bench", "convert"):
        assert sub in p.stdout


def test_info_help_documents_flags(runs):
    p = _get(runs, "info_help")
    assert p.returncode == 0
    assert "--json" in p.stdout and "--no-measure" in p.stdout
