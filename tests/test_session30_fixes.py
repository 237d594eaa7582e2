"""Session 30's fixes:

* a ``range`` of ids reaching below 0 names the table's row count, as every other id does;
* ``GadgetDataset`` reads a 0-d tensor or array as an id (a ``GadgetBatch`` of rows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _hide_cuda():
    """These tests check the behaviour on a machine without CUDA: on a GPU machine the
    library is made to see none (its defaults there differ: pinned tables, CUDA output)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


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


def test_word2vec_default_placement_is_silent_without_cuda(small_corpus, capsys) -> None:
    import warnings

    from datasets import word2vec

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FallbackWarning would fail here
        rc = word2vec.main([str(small_corpus), "--dim", "8", "--batch-size", "64", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr()
    assert "vocabulary" in out.out and "Warning" not in out.err


def test_word2vec_pinned_by_name_still_warns_without_cuda(small_corpus) -> None:
    from datasets import word2vec

    with pytest.warns(gl.FallbackWarning):
        word2vec.train(small_corpus, dim=8, batch_size=64, placement="pinned", progress=False)


def test_word2vec_most_similar_lower_cases_and_names_unknown_words(small_corpus) -> None:
    from datasets import word2vec

    r = word2vec.train(small_corpus, dim=8, batch_size=64, progress=False)
    assert r.most_similar("KING", 3) == r.most_similar("king", 3)
    assert all(w != "king" for w, _ in r.most_similar("King", 20))
    with pytest.raises(KeyError, match="'prince' is not in the vocabulary"):
        r.most_similar("Prince")


# ---- file tables shared by threads --------------------------------------------------------------
def _file_table(tmp_path, fmt: str, arr: np.ndarray, name: str = "t"):
    if fmt == "npy":
        path = tmp_path / f"{name}.npy"
        np.save(path, arr)
    elif fmt == "h5":
        h5py = pytest.importorskip("h5py")
        path = tmp_path / f"{name}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("emb", data=arr, chunks=(4, arr.shape[1]))
    else:
        zarr = pytest.importorskip("zarr")
        path = tmp_path / f"{name}.zarr"
        z = zarr.create_array(str(path), shape=arr.shape, chunks=(4, arr.shape[1]), dtype=arr.dtype)
        z[...] = arr
    return path


FORMATS = ["npy", "h5", "zarr"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shared", [True, False], ids=["one-table", "two-tables"])
def test_a_part_of_rows_write_is_not_interleaved_with_another_threads(
    tmp_path, fmt: str, shared: bool, monkeypatch
) -> None:
    """Thread A's write of columns 0-3 pauses between reading the rows and writing them
    back; thread B writes columns 4-7 of the same rows meanwhile. B must wait for A (the
    file's lock covers the read, change and write-back), so both parts survive."""
    import threading

    arr = np.zeros((12, 8), np.float32)
    path = _file_table(tmp_path, fmt, arr)
    a = gl.DataGadget(str(path), placement="file")
    b = a if shared else gl.DataGadget(str(path), placement="file")
    paused, b_done = threading.Event(), threading.Event()
    orig = gl.DataGadget._insert_rows

    def slow(self, data, ids, check_ids):
        if threading.current_thread().name == "A":
            paused.set()
            b_done.wait(0.5)  # with the fix B cannot finish while A holds the lock
        return orig(self, data, ids, check_ids)

    monkeypatch.setattr(gl.DataGadget, "_insert_rows", slow)
    ids = np.arange(0, 12, 2)

    def write_a():
        a.insertData(torch.full((6, 4), 1.0), (ids, slice(0, 4)))

    def write_b():
        paused.wait(5)
        b.insertData(torch.full((6, 4), 2.0), (ids, slice(4, 8)))
        b_done.set()

    ta = threading.Thread(target=write_a, name="A")
    tb = threading.Thread(target=write_b, name="B")
    ta.start(), tb.start()
    ta.join(10), tb.join(10)
    want = arr.copy()
    want[ids, :4], want[ids, 4:] = 1.0, 2.0
    for g in {id(a): a, id(b): b}.values():
        np.testing.assert_array_equal(g.getNumpyVersion(), want)
    a.close(), b.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("call", ["getData", "insertData", "getNumpyVersion"])
def test_a_call_overtaken_by_a_load_is_made_on_the_loaded_file(
    tmp_path, fmt: str, call: str, monkeypatch
) -> None:
    """Another thread's load() replaces the table's store after a call began: the call is
    made on the loaded file, not refused as if the table were closed."""
    import threading

    from gadgetloader.stores import FileStore

    old_rows = np.zeros((12, 8), np.float32)
    new_rows = np.arange(96, dtype=np.float32).reshape(12, 8)
    old_path = _file_table(tmp_path, fmt, old_rows, "old")
    new_path = _file_table(tmp_path, fmt, new_rows, "new")
    g = gl.DataGadget(str(old_path), placement="file")
    loads = []

    def load_in_another_thread():
        if not loads:
            loads.append(1)
            t = threading.Thread(target=g.load, args=(str(new_path),))
            t.start()
            t.join(10)

    for name in ("gather", "scatter", "read_block"):
        orig = getattr(FileStore, name)

        def hooked(self, *args, _orig=orig, **kwargs):
            load_in_another_thread()
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(FileStore, name, hooked)
    ids = [1, 5, 5, 9]
    if call == "getData":
        np.testing.assert_array_equal(g.getData(ids).numpy(), new_rows[ids])
    elif call == "getNumpyVersion":
        np.testing.assert_array_equal(g.getNumpyVersion(), new_rows)
    else:
        g.insertData(torch.full((4, 8), -1.0), ids)
        want = new_rows.copy()
        want[ids] = -1.0
        np.testing.assert_array_equal(g.getNumpyVersion(), want)
    assert loads == [1]
    g.close()


@pytest.mark.parametrize("fmt", ["npy", "h5"])
def test_tables_of_one_file_through_a_hard_link_write_and_see_each_other(tmp_path, fmt) -> None:
    import os

    arr = np.zeros((12, 8), np.float32)
    path = _file_table(tmp_path, fmt, arr)
    alt = tmp_path / f"alt.{fmt}"
    os.link(path, alt)
    a = gl.DataGadget(str(path), placement="file")
    b = gl.DataGadget(str(alt), placement="file")
    b.getData([0, 1])  # b caches the first block
    a.insertData(torch.ones(2, 8), [0, 1])
    np.testing.assert_array_equal(b.getData([0, 1]).numpy(), np.ones((2, 8)))  # not stale
    b.insertData(torch.full((1, 8), 3.0), [2])
    np.testing.assert_array_equal(a.getData([2]).numpy(), np.full((1, 8), 3.0))
    a.close(), b.close()
