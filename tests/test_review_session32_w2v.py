"""Black-box review (session 32) of the word2vec example (``python -m datasets.word2vec``
and the public functions of ``datasets.word2vec``); written from README.md, SPEC.md and
the public docstrings only."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import datasets.word2vec as w2v  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


ENV = dict(
    os.environ,
    CUDA_VISIBLE_DEVICES="",
    PYTHONDONTWRITEBYTECODE="1",
    PYTHONIOENCODING="utf-8",
)

GROUP_A = ["Apple", "banana", "CHERRY", "grape", "lemon", "mango", "peach", "plum"]
GROUP_B = ["car", "Truck", "bus", "train", "plane", "boat", "tram", "bike"]
A_LOW = [x.lower() for x in GROUP_A]
B_LOW = [x.lower() for x in GROUP_B]


# ----------------------------------------------------------------------------- helpers


def structured_text(seed: int = 0, lines: int = 300, per: int = 8) -> str:
    """Two disjoint vocabularies that never share a line (first half A, second half B),
    in mixed case, plus two words that occur once."""
    r = random.Random(seed)
    out = []
    for i in range(lines):
        g = GROUP_A if i < lines // 2 else GROUP_B
        out.append(
            " ".join(r.choice(g) if r.random() > 0.3 else r.choice(g).upper() for _ in range(per))
        )
    out.append("Singleton onlyonce")
    return "\n".join(out) + "\n"


def small_text(lines: int = 60) -> str:
    r = random.Random(5)
    words = A_LOW[:4] + B_LOW[:4]
    return "\n".join(" ".join(r.choice(words) for _ in range(6)) for _ in range(lines)) + "\n"


def cli(args, *, preexec_fn=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "datasets.word2vec", *map(str, args)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def assert_one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected a one-line error, got:\n{err}"
    assert "Traceback" not in err
    assert "error" in lines[0].lower(), lines[0]
    return lines[0]


def call_main(argv, capsys):
    capsys.readouterr()
    try:
        rc = w2v.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def read_vocab_file(path: Path):
    text = path.read_bytes().decode("utf-8")  # must be valid UTF-8
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split()
        assert len(parts) == 2, f"expected 'word count', got {line!r}"
        rows.append((parts[0], int(parts[1])))
    return rows


def cosine_matrix(v: np.ndarray) -> np.ndarray:
    x = v.astype(np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T


def parse_show(stdout: str) -> dict[str, str]:
    """Lines of the form '<word>: ...' keyed by word."""
    res = {}
    for line in stdout.splitlines():
        if ":" in line:
            head, _, rest = line.partition(":")
            res[head.strip()] = rest
    return res


# ----------------------------------------------------------------------------- fixtures

MAIN_ARGS = [
    "--dim", "16", "--epochs", "20", "--lr", "0.05", "--window", "2",
    "--min-count", "2", "--seed", "3", "--no-progress",
]  # fmt: skip
SHOW = "APPLE,car,zzzunknown,singleton,Peach"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("w2v_corpora")
    structured = d / "structured.txt"
    structured.write_text(structured_text(), encoding="utf-8")
    small = d / "small.txt"
    small.write_text(small_text(), encoding="utf-8")
    return {"dir": d, "structured": structured, "small": small}


@pytest.fixture(scope="module")
def main_runs(corpora, tmp_path_factory):
    """The structured corpus trained twice with the same seed (in parallel); the second
    run writes over junk files at its prefix."""
    d1 = tmp_path_factory.mktemp("w2v_out1")
    d2 = tmp_path_factory.mktemp("w2v_out2")
    (d2 / "vec.npy").write_bytes(b"junk")
    (d2 / "vec.vocab.txt").write_text("junk 1\n")
    procs = []
    for d in (d1, d2):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "datasets.word2vec",
                    str(corpora["structured"]),
                    *MAIN_ARGS,
                    "--out",
                    str(d / "vec"),
                    "--show",
                    SHOW,
                ],
                cwd=REPO,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )  # fmt: skip
        )
    results = []
    for p, d in zip(procs, (d1, d2), strict=True):
        out, err = p.communicate(timeout=240)
        results.append(
            {"rc": p.returncode, "out": out.decode("utf-8"), "err": err.decode("utf-8"), "dir": d}
        )
    return results


@pytest.fixture(scope="module")
def main_run(main_runs):
    r = main_runs[0]
    assert r["rc"] == 0, r["err"]
    return r


@pytest.fixture(scope="module")
def expected_counts(corpora):
    toks = corpora["structured"].read_text(encoding="utf-8").lower().split()
    return {w: c for w, c in Counter(toks).items() if c >= 2}


@pytest.fixture(scope="module")
def trained(corpora):
    return w2v.train(
        corpora["structured"], dim=16, epochs=12, lr=0.05, window=2, min_count=2,
        seed=1, progress=False,
    )  # fmt: skip


# ============================================================ CLI: argument errors (in-process main)

BAD_ARGS = [
    ("--dim", "0"), ("--dim", "-1"), ("--dim", "abc"), ("--dim", "1.5"), ("--dim", ""),
    ("--epochs", "0"), ("--epochs", "-3"), ("--epochs", "x"),
    ("--window", "0"), ("--window", "-1"),
    ("--negatives", "0"), ("--negatives", "-1"),
    ("--batch-size", "0"), ("--batch-size", "-5"),
    ("--lr", "0"), ("--lr", "-0.01"), ("--lr", "inf"), ("--lr", "-inf"), ("--lr", "nan"),
    ("--lr", "1e31"), ("--lr", "1e300"), ("--lr", "abc"),
    ("--min-count", "0"), ("--min-count", "-1"),
    ("--seed", "-1"), ("--seed", "abc"),
    ("--device", "gpu"), ("--device", "cuda:x"), ("--device", "cuda:-1"), ("--device", ""),
    ("--device", "mps"), ("--device", "tpu:0"),
    ("--placement", "bogus"), ("--placement", "file"),
]  # fmt: skip


@pytest.mark.parametrize("opt,val", BAD_ARGS, ids=[f"{o}={v}" for o, v in BAD_ARGS])
def test_bad_number_is_one_line_exit_2_and_writes_nothing(opt, val, corpora, tmp_path, capsys):
    rc, out, err = call_main(
        [corpora["small"], "--dim", "4", "--epochs", "1", "--no-progress",
         "--out", tmp_path / "vec", opt, val],
        capsys,
    )  # fmt: skip
    assert rc == 2, (rc, err)
    line = assert_one_line_error(err)
    assert opt in line, line
    assert out == ""
    assert list(tmp_path.iterdir()) == []


def test_lr_1e30_is_accepted_as_a_number(corpora, tmp_path, capsys):
    # "an infinite --lr, one above 1e30" is a bad number: 1e30 itself is not (exit 2 is
    # for bad arguments); with Adam on float32 it diverges -> status 1, nothing written.
    rc, out, err = call_main(
        [corpora["structured"], "--dim", "4", "--epochs", "2", "--no-progress",
         "--lr", "1e30", "--out", tmp_path / "vec"],
        capsys,
    )  # fmt: skip
    assert rc == 1, (rc, err)
    assert_one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_diverged_last_step_does_not_write_nan_vectors(corpora, tmp_path, capsys):
    # "training that diverges (an epoch's loss is not finite, e.g. with a huge --lr)
    # stops with a one-line error and writes nothing": a one-batch corpus with --lr 1e30
    # and two epochs turns every table row into NaN in its last step. Either that is
    # reported as divergence (status 1, nothing written) or the vectors written are finite.
    rc, out, err = call_main(
        [corpora["small"], "--dim", "4", "--epochs", "2", "--no-progress",
         "--lr", "1e30", "--out", tmp_path / "vec"],
        capsys,
    )  # fmt: skip
    if rc == 0:
        vec = np.load(tmp_path / "vec.npy")
        assert np.isfinite(vec).all(), f"exit 0 with non-finite vectors written:\n{vec}\n{out}"
    else:
        assert rc == 1, (rc, err)
        assert_one_line_error(err)
        assert list(tmp_path.iterdir()) == []


def test_no_corpus_argument_is_exit_2(capsys):
    rc, out, err = call_main([], capsys)
    assert rc == 2
    line = assert_one_line_error(err)
    assert "corpus" in line


def test_unknown_option_is_exit_2(corpora, capsys):
    rc, out, err = call_main([corpora["small"], "--bogus-option", "1"], capsys)
    assert rc == 2
    assert_one_line_error(err)


# ============================================================ CLI: path errors


def test_missing_corpus_is_one_line_error(tmp_path, capsys):
    missing = tmp_path / "no_such_corpus.txt"
    rc, out, err = call_main([missing, "--out", tmp_path / "vec"], capsys)
    assert rc == 2, (rc, err)
    line = assert_one_line_error(err)
    assert "no_such_corpus.txt" in line
    assert list(tmp_path.iterdir()) == []


def test_corpus_that_is_a_directory_is_one_line_error(tmp_path, capsys):
    (tmp_path / "corpusdir").mkdir()
    rc, out, err = call_main([tmp_path / "corpusdir", "--out", tmp_path / "vec"], capsys)
    assert rc == 2, (rc, err)
    assert_one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpusdir"]


@pytest.mark.parametrize(
    "kind", ["missing_folder", "folder_is_file", "names_folder", "empty", "trailing_slash"]
)
def test_bad_out_is_one_line_error_before_training(kind, corpora, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    out_arg = {
        "missing_folder": tmp_path / "nope" / "vec",
        "folder_is_file": tmp_path / "afile" / "vec",
        "names_folder": tmp_path / "adir",
        "empty": "",
        "trailing_slash": str(tmp_path / "adir") + os.sep,
    }[kind]
    rc, out, err = call_main(
        [corpora["small"], "--dim", "4", "--epochs", "1", "--no-progress", "--out", out_arg],
        capsys,
    )
    assert rc == 2, (rc, err)
    assert_one_line_error(err)
    assert out == ""  # before any training: no loss report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert list((tmp_path / "adir").iterdir()) == []
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores permissions"
)
def test_unwritable_out_folder_is_exit_2(corpora, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, out, err = call_main(
            [corpora["small"], "--dim", "4", "--epochs", "1", "--no-progress", "--out", ro / "vec"],
            capsys,
        )
        assert rc == 2, (rc, err)
        assert_one_line_error(err)
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


# ============================================================ CLI: corpora too small (status 1)

TOO_SMALL = {
    "empty": (b"", []),
    "whitespace_only": (b"  \n\t\n \r\n", []),
    "one_word_case_variants": (b"word WORD Word\nwOrD word\n", []),
    "min_count_leaves_one": (b"a a a b\n", ["--min-count", "2"]),
    "min_count_leaves_none": (b"a b c\n", ["--min-count", "2"]),
}


@pytest.mark.parametrize("name", list(TOO_SMALL))
def test_corpus_with_fewer_than_two_words_is_exit_1(name, tmp_path, capsys):
    data, extra = TOO_SMALL[name]
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(data)
    outdir = tmp_path / "out"
    outdir.mkdir()
    rc, out, err = call_main(
        [corpus, "--dim", "4", "--epochs", "1", "--no-progress", "--out", outdir / "vec", *extra],
        capsys,
    )
    assert rc == 1, (rc, err)
    assert_one_line_error(err)
    assert list(outdir.iterdir()) == []


def test_two_distinct_words_are_enough(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("x Y " * 50 + "\n")
    rc, out, err = call_main(
        [corpus, "--dim", "4", "--epochs", "2", "--no-progress", "--out", tmp_path / "v",
         "--show", "X"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    vec = np.load(tmp_path / "v.npy")
    assert vec.shape == (2, 4)
    assert sorted(w for w, _ in read_vocab_file(tmp_path / "v.vocab.txt")) == ["x", "y"]
    assert "y" in parse_show(out)["x"]


def test_show_without_out_writes_no_files(corpora, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, err = call_main(
        [
            corpora["small"],
            "--dim",
            "4",
            "--epochs",
            "1",
            "--no-progress",
            "--show",
            "apple,nosuchword",
        ],
        capsys,
    )
    assert rc == 0, err
    assert list(tmp_path.iterdir()) == []
    shown = parse_show(out)
    assert "apple" in shown and "nosuchword" in shown
    # apple's neighbours are vocabulary words (the small corpus has 8 of them)
    vocab = set(A_LOW[:4] + B_LOW[:4])
    assert any(w in shown["apple"] for w in vocab - {"apple"})
    assert not any(w in shown["nosuchword"] for w in vocab)


def test_default_placement_on_cpu_is_silent(corpora, tmp_path, capsys):
    # "tables and Adam state pinned with CUDA, else in plain RAM silently"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rc, out, err = call_main(
            [
                corpora["small"],
                "--dim",
                "4",
                "--epochs",
                "1",
                "--no-progress",
                "--out",
                tmp_path / "v",
            ],
            capsys,
        )
    assert rc == 0
    assert err == ""


# ============================================================ CLI: real subprocess runs


def test_cli_main_run_succeeds_silently(main_run):
    assert main_run["rc"] == 0
    # no progress bar (--no-progress), no placement warning (plain RAM silently)
    assert main_run["err"] == "", main_run["err"]


def test_cli_out_writes_exactly_two_files(main_run):
    assert sorted(p.name for p in main_run["dir"].iterdir()) == ["vec.npy", "vec.vocab.txt"]


def test_cli_npy_shape_is_vocab_by_dim(main_run, expected_counts):
    vec = np.load(main_run["dir"] / "vec.npy", allow_pickle=False)
    assert vec.shape == (len(expected_counts), 16)
    assert np.issubdtype(vec.dtype, np.floating)
    assert np.isfinite(vec).all()
    assert np.linalg.norm(vec, axis=1).min() > 0


def test_cli_vocab_file_words_and_counts(main_run, expected_counts):
    rows = read_vocab_file(main_run["dir"] / "vec.vocab.txt")
    words = [w for w, _ in rows]
    assert len(words) == len(set(words))
    assert all(w == w.lower() for w in words)
    assert dict(rows) == expected_counts
    # rows are ids "most frequent first"
    counts = [c for _, c in rows]
    assert counts == sorted(counts, reverse=True)


def test_cli_min_count_drops_rare_words(main_run):
    words = {w for w, _ in read_vocab_file(main_run["dir"] / "vec.vocab.txt")}
    assert "singleton" not in words and "onlyonce" not in words


def test_cli_vectors_separate_the_two_groups(main_run):
    rows = read_vocab_file(main_run["dir"] / "vec.vocab.txt")
    idx = {w: i for i, (w, _) in enumerate(rows)}
    s = cosine_matrix(np.load(main_run["dir"] / "vec.npy"))
    ia = [idx[w] for w in A_LOW]
    ib = [idx[w] for w in B_LOW]
    within = np.mean([s[i, j] for g in (ia, ib) for i in g for j in g if i != j])
    cross = s[np.ix_(ia, ib)].mean()
    assert within > cross + 0.3, (within, cross)
    # every word's nearest neighbour is from its own group
    for i in ia + ib:
        row = s[i].copy()
        row[i] = -np.inf
        nn = int(np.argmax(row))
        assert (nn in ia) == (i in ia), (rows[i][0], rows[nn][0])


def test_cli_show_lists_same_group_neighbours(main_run):
    shown = parse_show(main_run["out"])
    for word, group in (("apple", A_LOW), ("car", B_LOW), ("peach", A_LOW)):
        assert word in shown, main_run["out"]  # APPLE / Peach lower-cased like the corpus
        line = shown[word]
        tokens = [t.strip(" ,()0123456789.-") for t in line.split()]
        listed = [t for t in tokens if t in A_LOW + B_LOW]
        assert listed, line
        assert listed[0] in group and listed[0] != word, line


@pytest.mark.parametrize("word", ["zzzunknown", "singleton"])
def test_cli_show_reports_unknown_words(main_run, word):
    shown = parse_show(main_run["out"] + "\n" + main_run["err"])
    assert word in shown, main_run["out"]
    assert not any(w in shown[word] for w in A_LOW + B_LOW)


def test_cli_same_seed_gives_identical_files(main_runs):
    a, b = main_runs
    assert a["rc"] == 0 and b["rc"] == 0, (a["err"], b["err"])
    va = np.load(a["dir"] / "vec.npy")
    vb = np.load(b["dir"] / "vec.npy")  # also: the junk files at that prefix were replaced
    np.testing.assert_array_equal(va, vb)
    assert (a["dir"] / "vec.vocab.txt").read_bytes() == (b["dir"] / "vec.vocab.txt").read_bytes()


UTF8_WORDS = [
    b"caf\xe9",
    b"\xff",
    b"\xc3\x89COLE",
    b"\xc3\xa9cole",
    b"na\xc3\xafve",
    b"Stra\xc3\x9fe",
    b"\xe6\x97\xa5\xe6\x9c\xac",
]


def test_cli_utf8_with_undecodable_bytes(tmp_path):
    r = random.Random(3)
    lines = []
    for _ in range(120):
        lines.append(b" ".join(r.choice(UTF8_WORDS) for _ in range(6)))
    data = b"\n".join(lines) + b"\r\n"
    corpus = tmp_path / "u.txt"
    corpus.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    p = cli(
        [
            corpus,
            "--dim",
            "4",
            "--epochs",
            "2",
            "--no-progress",
            "--out",
            out / "u",
            "--show",
            "\u00c9COLE,CAF\ufffd",
        ]
    )
    assert p.returncode == 0, p.stderr.decode("utf-8", "replace")
    expected = Counter(data.decode("utf-8", "replace").lower().split())
    assert "caf\ufffd" in expected and "\ufffd" in expected and "école" in expected
    rows = read_vocab_file(out / "u.vocab.txt")
    assert dict(rows) == dict(expected)
    assert np.load(out / "u.npy").shape == (len(expected), 4)
    shown = parse_show(p.stdout.decode("utf-8"))
    assert "école" in shown and "caf\ufffd" in shown, p.stdout.decode("utf-8")
    assert any(w in shown["école"] for w in expected if w != "école")


def test_cli_too_small_corpus_exit_1(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Same same SAME\n" * 300)
    p = cli([corpus, "--dim", "4", "--out", tmp_path / "vec", "--no-progress"])
    assert p.returncode == 1, p.stderr
    assert_one_line_error(p.stderr.decode("utf-8"))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.txt"]


def test_cli_divergence_exit_1_and_writes_nothing(corpora, tmp_path):
    p = cli([corpora["small"], "--dim", "4", "--epochs", "3", "--lr", "1e30", "--no-progress",
             "--out", tmp_path / "vec", "--show", "apple"])  # fmt: skip
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert_one_line_error(p.stderr.decode("utf-8"))
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_number_exit_2(corpora, tmp_path):
    p = cli([corpora["small"], "--dim", "0", "--out", tmp_path / "vec"])
    assert p.returncode == 2
    assert p.stdout == b""
    assert "--dim" in assert_one_line_error(p.stderr.decode("utf-8"))
    assert list(tmp_path.iterdir()) == []


def test_cli_missing_corpus_exit_2(tmp_path):
    p = cli([tmp_path / "absent.txt", "--out", tmp_path / "vec"])
    assert p.returncode == 2
    assert "absent.txt" in assert_one_line_error(p.stderr.decode("utf-8"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE based")
def test_cli_failed_save_is_one_line_exit_1(corpora, tmp_path):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))

    p = cli([corpora["small"], "--dim", "32", "--epochs", "1", "--no-progress", "--out", tmp_path / "vec"],
            preexec_fn=limit)  # fmt: skip
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert_one_line_error(p.stderr.decode("utf-8"))


# ============================================================ train() and friends (in-process)


def test_train_losses_one_per_epoch_and_decrease(trained):
    assert len(trained.losses) == 12
    assert all(math.isfinite(x) for x in trained.losses)
    assert trained.losses[-1] < trained.losses[0] - 0.5, trained.losses


def test_train_vectors_shape_and_vocab(trained, expected_counts):
    v = trained.vectors()
    assert isinstance(v, np.ndarray)
    assert v.shape == (len(expected_counts), 16)
    assert len(trained.vocab) == len(expected_counts)
    assert (
        dict(zip(trained.vocab.words, (int(c) for c in trained.vocab.counts), strict=True))
        == expected_counts
    )
    assert all(trained.vocab.index[w] == i for i, w in enumerate(trained.vocab.words))


def test_most_similar_matches_numpy_cosines(trained):
    v = trained.vectors()
    s = cosine_matrix(v)
    i = trained.vocab.index["apple"]
    res = trained.most_similar("apple", k=5)
    assert len(res) == 5
    sims = [c for _, c in res]
    assert sims == sorted(sims, reverse=True)
    for w, c in res:
        assert w != "apple"
        assert c == pytest.approx(s[i, trained.vocab.index[w]], abs=1e-4)
    others = np.delete(s[i], i)
    assert sims[0] == pytest.approx(others.max(), abs=1e-4)
    assert {w for w, _ in res} <= set(A_LOW)


def test_most_similar_lower_cases_and_unknown_is_keyerror(trained):
    assert trained.most_similar("APPLE", k=3) == trained.most_similar("apple", k=3)
    with pytest.raises(KeyError):
        trained.most_similar("zzz-not-there")
    with pytest.raises(KeyError):
        trained.most_similar("singleton")  # dropped by min_count=2


def test_result_save_format(trained, tmp_path):
    trained.save(tmp_path / "vec")
    np.testing.assert_array_equal(np.load(tmp_path / "vec.npy"), trained.vectors())
    rows = read_vocab_file(tmp_path / "vec.vocab.txt")
    assert [w for w, _ in rows] == list(trained.vocab.words)
    assert [c for _, c in rows] == [int(c) for c in trained.vocab.counts]


def test_train_same_seed_identical_other_seed_differs(corpora):
    kw = dict(dim=8, epochs=2, window=2, progress=False)
    a = w2v.train(corpora["small"], seed=7, **kw)
    b = w2v.train(corpora["small"], seed=7, **kw)
    c = w2v.train(corpora["small"], seed=8, **kw)
    np.testing.assert_array_equal(a.vectors(), b.vectors())
    assert a.losses == b.losses
    assert not np.array_equal(a.vectors(), c.vectors())


def test_one_batch_corpus_moves_input_vectors_only_from_second_step(corpora):
    # "the output vectors start at zero ... a corpus that fits in one batch moves the
    # input vectors only from its second step": after one epoch of one batch the input
    # vectors do not depend on the learning rate; after two they do.
    kw = dict(dim=8, window=2, batch_size=10**6, seed=4, progress=False)
    one_lo = w2v.train(corpora["small"], epochs=1, lr=0.001, **kw)
    one_hi = w2v.train(corpora["small"], epochs=1, lr=0.1, **kw)
    two_hi = w2v.train(corpora["small"], epochs=2, lr=0.1, **kw)
    np.testing.assert_array_equal(one_lo.vectors(), one_hi.vectors())
    assert one_lo.losses == one_hi.losses
    assert not np.allclose(two_hi.vectors(), one_hi.vectors())


def test_pinned_placement_without_cuda_falls_back_with_same_results(corpora):
    kw = dict(dim=8, epochs=2, window=2, seed=2, progress=False)
    ref = w2v.train(corpora["small"], placement="cpu", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "asking for pinned by name warns and falls back"
        pinned = w2v.train(corpora["small"], placement="pinned", **kw)
    np.testing.assert_array_equal(pinned.vectors(), ref.vectors())
    assert pinned.losses == ref.losses


BAD_TRAIN = [
    dict(dim=0), dict(dim=-1), dict(epochs=-1), dict(window=0), dict(window=-1),
    dict(negatives=0), dict(negatives=-1), dict(batch_size=0), dict(batch_size=-1),
    dict(lr=float("nan")), dict(lr=-0.01), dict(seed=-1), dict(chunk_tokens=0),
]  # fmt: skip


@pytest.mark.parametrize("bad", BAD_TRAIN, ids=[str(b) for b in BAD_TRAIN])
def test_train_bad_settings_are_valueerror(bad, corpora):
    kw = dict(dim=4, epochs=1, progress=False)
    kw.update(bad)
    with pytest.raises(ValueError):
        w2v.train(corpora["small"], **kw)


@pytest.mark.parametrize("text", ["", "one ONE One\n", "a a a b\n"])
def test_train_too_small_corpus_is_valueerror(text, tmp_path):
    p = tmp_path / "c.txt"
    p.write_text(text)
    with pytest.raises(ValueError):
        w2v.train(p, dim=4, min_count=2 if text.startswith("a ") else 1, progress=False)


@pytest.mark.parametrize("lr", [1e30, float("inf")])
def test_train_divergence_is_valueerror(lr, corpora):
    with pytest.raises(ValueError):
        w2v.train(corpora["structured"], dim=4, epochs=2, lr=lr, progress=False)


def test_train_never_returns_nan_vectors_without_error(corpora):
    # Raises ValueError for "training that diverged"; a run whose last step made every
    # row NaN must not come back as a trained model.
    try:
        res = w2v.train(corpora["small"], dim=4, epochs=2, lr=1e30, progress=False)
    except ValueError:
        return
    assert np.isfinite(res.vectors()).all(), (res.losses, res.vectors())


# ============================================================ build_vocab / skipgram_pairs


def test_build_vocab_lowercases_counts_and_ids(tmp_path):
    text = "The cat\tTHE dog\r\nthe  CAT\n\n  Dog the bird\n"
    p = tmp_path / "c.txt"
    p.write_text(text, encoding="utf-8", newline="")
    vocab, ids = w2v.build_vocab(p)
    toks = text.lower().split()
    cnt = Counter(toks)
    assert dict(zip(vocab.words, (int(c) for c in vocab.counts), strict=True)) == dict(cnt)
    assert [vocab.words[i] for i in ids] == toks
    assert list(vocab.counts) == sorted(vocab.counts, reverse=True)
    assert vocab.words[0] == "the"


def test_build_vocab_min_count_drops_rare_words(tmp_path):
    text = "a b a c a b d\n"
    p = tmp_path / "c.txt"
    p.write_text(text)
    vocab, ids = w2v.build_vocab(p, min_count=2)
    assert set(vocab.words) == {"a", "b"}
    assert [vocab.words[i] for i in ids] == [t for t in text.split() if t in ("a", "b")]


def test_build_vocab_large_multibyte_file_is_not_split(tmp_path):
    # > 4 MiB of multi-byte words with assorted whitespace: however the file is read in
    # blocks, no character may turn into U+FFFD and no word may be cut in two.
    r = random.Random(1)
    words = ["café", "naïve", "日本語", "Ωmega", "x", "žluťoučký", "ab"]
    toks = [r.choice(words) for _ in range(600_000)]
    seps = [r.choice([" ", "\n", "\t", "  ", "\r\n"]) for _ in toks]
    p = tmp_path / "big.txt"
    p.write_text(
        "".join(t + s for t, s in zip(toks, seps, strict=True)), encoding="utf-8", newline=""
    )
    assert p.stat().st_size > 4 * 2**20
    vocab, ids = w2v.build_vocab(p)
    assert set(vocab.words) == {w.lower() for w in words}
    assert len(ids) == len(toks)
    lowered = np.array([vocab.index[t.lower()] for t in toks])
    np.testing.assert_array_equal(np.asarray(ids), lowered)


def test_build_vocab_undecodable_bytes(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"caf\xe9 ok \xff ok CAF\xe9\n")
    vocab, ids = w2v.build_vocab(p)
    assert dict(zip(vocab.words, (int(c) for c in vocab.counts), strict=True)) == {
        "caf\ufffd": 2,
        "ok": 2,
        "\ufffd": 1,
    }


def _pairs(c, x):
    return sorted(zip(np.asarray(c).tolist(), np.asarray(x).tolist(), strict=True))


@pytest.mark.parametrize("n", [2, 3, 10, 57])
def test_skipgram_pairs_window_1_is_every_neighbour(n):
    ids = np.arange(n)
    c, x = w2v.skipgram_pairs(ids, 1, np.random.default_rng(0))
    exp = sorted([(i, i + 1) for i in range(n - 1)] + [(i + 1, i) for i in range(n - 1)])
    assert _pairs(c, x) == exp


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skipgram_pairs_dynamic_window(seed):
    n, window = 40, 4
    ids = np.arange(n)
    c, x = w2v.skipgram_pairs(ids, window, np.random.default_rng(seed))
    pairs = _pairs(c, x)
    assert len(pairs) == len(set(pairs))
    by_center: dict[int, set[int]] = {}
    for ci, xi in pairs:
        by_center.setdefault(ci, set()).add(xi - ci)
    assert set(by_center) == set(range(n))  # every center draws a window of at least 1
    for ci, offs in by_center.items():
        b = max(abs(o) for o in offs)
        assert 1 <= b <= window
        exp = {o for o in range(-b, b + 1) if o != 0 and 0 <= ci + o < n}
        assert offs == exp, (ci, offs)


@pytest.mark.parametrize("lo,hi", [(0, 5), (3, 9), (0, 20), (19, 20)])
def test_skipgram_pairs_centers_in_keeps_those_centers(lo, hi):
    ids = np.arange(20)
    c, x = w2v.skipgram_pairs(ids, 1, np.random.default_rng(0), centers_in=(lo, hi))
    exp = sorted(
        [(i, i + 1) for i in range(lo, hi) if i + 1 < 20]
        + [(i, i - 1) for i in range(lo, hi) if i >= 1]
    )
    assert _pairs(c, x) == exp


@pytest.mark.parametrize("window", [1, 3])
def test_skipgram_pairs_overlapping_chunks_cover_every_pair_once(window):
    # "chunks of a corpus that overlap by window tokens then give every pair of the
    # corpus exactly once" (window 1 has no randomness, so the sets must match exactly;
    # with window 3 every pair is a valid one whose center lies in its own chunk).
    n, m = 50, 20
    ids = np.arange(n) + 100
    rng = np.random.default_rng(0)
    full = _pairs(*w2v.skipgram_pairs(ids, window, np.random.default_rng(0)))
    got = []
    start = 0
    while start < n:
        lo_ctx = max(0, start - window)
        chunk = ids[lo_ctx : min(n, start + m + window)]
        got += _pairs(
            *w2v.skipgram_pairs(
                chunk, window, rng, centers_in=(start - lo_ctx, start - lo_ctx + min(m, n - start))
            )
        )
        start += m
    got.sort()
    assert len(got) == len(set(got))
    centers = Counter(ci for ci, _ in got)
    assert set(centers) == set(range(100, 100 + n))
    assert all(1 <= abs(ci - xi) <= window for ci, xi in got)
    if window == 1:
        assert got == full
