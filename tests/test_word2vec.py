"""The word2vec example learns planted structure: words of one topic end up closer."""

from __future__ import annotations

import numpy as np
import pytest

from datasets import word2vec


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Sentences each drawn from one of 8 topics of 6 words: same-topic words co-occur."""
    rng = np.random.default_rng(0)
    topics = [[f"t{t}w{i}" for i in range(6)] for t in range(8)]
    lines = [" ".join(rng.choice(topics[rng.integers(8)], size=8)) for _ in range(1500)]
    path = tmp_path_factory.mktemp("w2v") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_related_words_end_closer(corpus, placement, device):
    """On every placement (pinned: tables and Adam state in page-locked host RAM)."""
    r = word2vec.train(
        corpus,
        dim=16,
        epochs=2,
        window=3,
        negatives=5,
        batch_size=512,
        lr=0.02,
        placement=placement,
        device=device,
        progress=False,
    )
    assert r.losses[-1] < r.losses[0]
    vec = r.vectors()
    unit = vec / np.linalg.norm(vec, axis=1, keepdims=True)
    sims = unit @ unit.T
    topic = np.array([int(w.split("w")[0][1:]) for w in r.vocab.words])
    same = topic[:, None] == topic[None, :]
    np.fill_diagonal(same, False)
    assert sims[same].mean() > sims[~same & ~np.eye(len(topic), dtype=bool)].mean() + 0.3
    for w in ("t0w0", "t5w3"):
        assert all(n.split("w")[0] == w.split("w")[0] for n, _ in r.most_similar(w, 5))


def test_pairs_respect_the_window():
    ids = np.arange(20)
    c, x = word2vec.skipgram_pairs(ids, 3, np.random.default_rng(0))
    assert c.shape == x.shape and c.size > 0
    assert np.all(np.abs(c - x) <= 3) and np.all(c != x)


def test_cli_writes_vectors_and_vocab(corpus, tmp_path, capsys):
    out = tmp_path / "vec"
    rc = word2vec.main(
        [
            corpus,
            "--dim",
            "8",
            "--epochs",
            "1",
            "--window",
            "2",
            "--batch-size",
            "1024",
            "--placement",
            "cpu",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--show",
            "t1w1",
            "--no-progress",
        ]
    )
    assert rc == 0
    vec = np.load(str(out) + ".npy")
    words = (tmp_path / "vec.vocab.txt").read_text(encoding="utf-8").split("\n")
    assert vec.shape == (48, 8) and len([w for w in words if w]) == 48
    assert "t1w1:" in capsys.readouterr().out


def test_empty_vocabulary_is_an_error(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("a b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="min_count|at least"):
        word2vec.build_vocab(p, min_count=5)
