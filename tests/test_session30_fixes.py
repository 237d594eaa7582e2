"""Session 30's fixes:

* a ``range`` of ids reaching below 0 names the table's row count, as every other id does;
* ``GadgetDataset`` reads a 0-d tensor or array as an id (a ``GadgetBatch`` of rows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.mark.parametrize(
    ("ids", "bad"),
    [
        (range(-2, 3), -2),
        (range(0, -5, -1), -4),
        (range(3, -1, -1), None),  # all in range: read
        (range(3, 8), 7),
        (range(-3, 9), -3),
    ],
)
def test_a_range_past_either_end_names_the_row_count(ids: range, bad: int | None) -> None:
    a = torch.arange(10.0).view(5, 2)
    g = gl.DataGadget(a.clone(), placement="cpu")
    if bad is None:
        torch.testing.assert_close(g.getData(ids), a[list(ids)], rtol=0, atol=0)
        return
    for call in (lambda: g.getData(ids), lambda: g.insertData(torch.ones(len(ids), 2), ids)):
        with pytest.raises(gl.GadgetIndexError) as info:
            call()
        msg = str(info.value)
        assert f"id {bad} is" in msg
        assert "this table has 5 rows" in msg and "[0, 4]" in msg
        assert "nothing was read or written" in msg
    torch.testing.assert_close(g.getData(range(5)), a, rtol=0, atol=0)


def test_a_range_on_an_empty_table_says_it_has_no_rows() -> None:
    g = gl.DataGadget(torch.zeros(0, 2), placement="cpu")
    for ids in (range(-1, 1), range(0, 2)):
        with pytest.raises(gl.GadgetIndexError, match="this table has no rows"):
            g.getData(ids)


@pytest.mark.parametrize("make", [torch.tensor, np.array], ids=["tensor", "numpy"])
def test_a_zero_dim_id_reads_one_row_as_a_batch(make) -> None:
    x = torch.arange(10.0).view(5, 2)
    y = torch.arange(5) * 3
    ds = gl.GadgetDataset(x, y, device="cpu")
    got = ds[make(3)]
    assert isinstance(got, gl.GadgetBatch)
    torch.testing.assert_close(got[0], x[3], rtol=0, atol=0)
    assert int(got[1]) == 9 and got[1].dim() == 0
    with pytest.raises(gl.GadgetIndexError, match="negative"):
        ds[make(-1)]


# ---- the word2vec example: the library's default placement; most_similar's words ---------------
@pytest.fixture
def small_corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("King queen royal crown\nking queen throne\ncat dog pet fur\n" * 20)
    return path


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_word2vec_default_placement_is_silent_without_cuda(small_corpus, no_cuda, capsys) -> None:
    import warnings

    from datasets import word2vec

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FallbackWarning would fail here
        rc = word2vec.main([str(small_corpus), "--dim", "8", "--batch-size", "64", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr()
    assert "vocabulary" in out.out and "Warning" not in out.err


def test_word2vec_pinned_by_name_still_warns_without_cuda(small_corpus, no_cuda) -> None:
    from datasets import word2vec

    with pytest.warns(gl.FallbackWarning):
        word2vec.train(small_corpus, dim=8, batch_size=64, placement="pinned", progress=False)


def test_word2vec_most_similar_lower_cases_and_names_unknown_words(small_corpus, no_cuda) -> None:
    from datasets import word2vec

    r = word2vec.train(small_corpus, dim=8, batch_size=64, progress=False)
    assert r.most_similar("KING", 3) == r.most_similar("king", 3)
    assert all(w != "king" for w, _ in r.most_similar("King", 20))
    with pytest.raises(KeyError, match="'prince' is not in the vocabulary"):
        r.most_similar("Prince")
