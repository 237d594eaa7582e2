"""Session 22 fixes: the sampler's chunk-only options with the other orders, the HDF5
external-link write message, and file names given as bytes."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.convert import convert
from gadgetloader.stores import file_store

h5py = pytest.importorskip("h5py")


def _epochs(s: gl.GadgetSampler, n: int = 2) -> list[list[int]]:
    return [[i for b in s for i in b.tolist()] for _ in range(n)]


# ---- 1. window_chunks / chunk_rows with order='random' or 'sequential' ------------------------
@pytest.mark.parametrize("order", ["random", "sequential"])
@pytest.mark.parametrize(
    "extra",
    [{"window_chunks": 3}, {"chunk_rows": 5}, {"window_chunks": 1, "chunk_rows": 7}],
    ids=["window", "chunk_rows", "both"],
)
def test_chunk_options_do_not_change_the_other_orders(order: str, extra: dict[str, int]) -> None:
    kw: dict[str, Any] = dict(batch_size=4, order=order, seed=5)
    ref = gl.GadgetSampler(50, **kw)
    s = gl.GadgetSampler(50, **kw, **extra)
    assert _epochs(s, 3) == _epochs(ref, 3)
    # the loader builds the same sampler from the same options
    ds = gl.GadgetDataset(torch.arange(50.0), placement="cpu", device="cpu")
    ref_l = gl.GadgetLoader(ds, **kw)
    loader = gl.GadgetLoader(ds, **kw, **extra)
    for _ in range(2):
        got = [b[0].tolist() for b in loader]
        want = [b[0].tolist() for b in ref_l]
        assert got == want


def test_window_chunks_still_shapes_the_chunk_order() -> None:
    """The no-op is confined to the other orders: the chunk order still follows it."""
    kw: dict[str, Any] = dict(batch_size=4, order="chunk", chunk_rows=5, seed=5)
    narrow = gl.GadgetSampler(200, window_chunks=1, **kw).epoch_order(0).tolist()
    wide = gl.GadgetSampler(200, window_chunks=40, **kw).epoch_order(0).tolist()
    assert narrow != wide
    # window_chunks=1: every run of 5 positions is one whole chunk
    for w in range(0, 200, 5):
        assert len({i // 5 for i in narrow[w : w + 5]}) == 1


@pytest.mark.parametrize("order", ["random", "sequential"])
@pytest.mark.parametrize(
    "value, err, words",
    [
        (0, gl.GadgetValueError, "window_chunks must be >= 1; got 0"),
        (-2, gl.GadgetValueError, "window_chunks must be >= 1; got -2"),
        (1.5, gl.GadgetTypeError, "window_chunks must be an int; got float"),
        (True, gl.GadgetTypeError, "window_chunks must be an int; got a bool"),
    ],
)
def test_a_bad_window_chunks_is_refused_whatever_the_order(
    order: str, value: Any, err: type, words: str
) -> None:
    with pytest.raises(err) as info:
        gl.GadgetSampler(50, batch_size=4, order=order, window_chunks=value)
    assert words in str(info.value)


@pytest.mark.parametrize("order", ["random", "sequential"])
@pytest.mark.parametrize("saved_with, loaded_with", [(3, None), (None, 3), (3, 9)])
def test_states_resume_across_window_chunks_for_the_other_orders(
    order: str, saved_with: int | None, loaded_with: int | None
) -> None:
    kw: dict[str, Any] = dict(batch_size=4, order=order, seed=11)
    full = _epochs(gl.GadgetSampler(50, **kw), 2)
    first = gl.GadgetSampler(50, window_chunks=saved_with, **kw)
    it = iter(first)
    head = [i for _ in range(5) for i in next(it).tolist()]
    state = first.state_dict()
    second = gl.GadgetSampler(50, window_chunks=loaded_with, **kw)
    second.load_state_dict(state)
    rest = [i for b in second for i in b.tolist()]
    assert head + rest == full[0]
    assert [i for b in second for i in b.tolist()] == full[1]  # then the next epoch


def test_chunk_order_states_still_compare_window_chunks_and_change_nothing() -> None:
    kw: dict[str, Any] = dict(batch_size=4, order="chunk", chunk_rows=5, seed=3)
    saver = gl.GadgetSampler(60, window_chunks=2, **kw)
    it = iter(saver)
    next(it)
    state = saver.state_dict()
    s = gl.GadgetSampler(60, window_chunks=3, **kw)
    before = s.state_dict()
    with pytest.raises(gl.GadgetValueError) as info:
        s.load_state_dict(state)
    assert "window_chunks=2" in str(info.value) and "window_chunks=3" in str(info.value)
    assert s.state_dict() == before
    assert _epochs(s, 1) == _epochs(gl.GadgetSampler(60, window_chunks=3, **kw), 1)


def test_window_chunks_docstring_and_readme_say_the_other_orders_ignore_it() -> None:
    doc = gl.GadgetSampler.__doc__ or ""
    assert "no effect" in doc and "so one set of options can serve every" in doc
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    assert "`window_chunks` and `chunk_rows` shape only this order" in readme


# ---- 2. writes through an HDF5 external link ---------------------------------------------------
@pytest.fixture
def linked(tmp_path: pathlib.Path) -> dict[str, Any]:
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    target = tmp_path / "rows.h5"
    with h5py.File(target, "w") as f:
        f["emb"] = rows
        f.create_group("grp")["inner"] = rows * 2
    main = tmp_path / "main.h5"
    with h5py.File(main, "w") as f:
        f["link"] = h5py.ExternalLink("rows.h5", "/emb")
        f["glink"] = h5py.ExternalLink("rows.h5", "/grp")
    return {"rows": rows, "target": target, "main": main}


def _target_rows(path: pathlib.Path, name: str) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[name][()]


@pytest.mark.parametrize(
    "dataset, inner, scale", [("link", "emb", 1), ("glink/inner", "grp/inner", 2)]
)
def test_write_through_an_external_link_says_each_thing_once(
    linked: dict[str, Any], dataset: str, inner: str, scale: int
) -> None:
    main, target = linked["main"], linked["target"]
    real = os.path.realpath(target)
    g = gl.DataGadget(str(main), dataset=dataset, placement="file", device="cpu")
    try:
        np.testing.assert_array_equal(g.getData(torch.arange(8)).numpy(), linked["rows"] * scale)
        for write in (
            lambda: g.insertData(torch.ones(2, 3), torch.tensor([0, 1])),
            lambda: g.__setitem__(torch.tensor([3]), torch.ones(1, 3)),
        ):
            with pytest.raises(gl.ReadOnlyError) as info:
                write()
            msg = str(info.value)
            # what arrived: the link and where it leads; what to do: open that file
            assert f"{main}[{dataset!r}] is an HDF5 external link to {real}[{inner!r}]" in msg
            assert f"open {real} with dataset={inner!r}" in msg
            # each piece of advice once (it said "load ... into memory" twice)
            assert msg.count("into memory") == 1, msg
            assert msg.count("open ") == 1, msg
            assert msg.count("external link") == 1, msg
        np.testing.assert_array_equal(_target_rows(target, inner), linked["rows"] * scale)
        np.testing.assert_array_equal(g.getData(torch.arange(8)).numpy(), linked["rows"] * scale)
    finally:
        g.close()
    # the advice works: the file it names takes the write
    with gl.DataGadget(real, dataset=inner, placement="file", device="cpu") as direct:
        direct.insertData(torch.full((1, 3), -1.0), torch.tensor([0]))
    assert (_target_rows(target, inner)[0] == -1).all()


def test_writable_true_through_an_external_link_names_the_target(linked: dict[str, Any]) -> None:
    main, target = linked["main"], linked["target"]
    real = os.path.realpath(target)
    with pytest.raises(gl.ReadOnlyError) as info:
        gl.DataGadget(str(main), dataset="link", placement="file", writable=True)
    msg = str(info.value)
    assert msg.startswith("writable=True but rows are written only into the file the table opened")
    assert f"external link to {real}['emb']" in msg
    assert msg.count(f"open {real} with dataset='emb'") == 1
    np.testing.assert_array_equal(_target_rows(target, "emb"), linked["rows"])


# ---- 3. file names as bytes ---------------------------------------------------------------------
class _BytesPath:
    def __init__(self, p: bytes) -> None:
        self.p = p

    def __fspath__(self) -> bytes:
        return self.p


def _check_bytes_refusal(call: Any, raw: bytes, kind: str) -> None:
    with pytest.raises(gl.GadgetTypeError) as info:
        call()
    msg = str(info.value)
    assert "must be a str or" in msg and "os.PathLike" in msg, msg
    assert "os.fsdecode(path)" in msg, msg
    assert repr(raw) in msg, msg  # the whole path, not a cut-off repr
    if kind == "pathlike":
        assert "_BytesPath, whose __fspath__() gives bytes" in msg, msg


@pytest.mark.parametrize("kind", ["bytes", "pathlike"])
def test_bytes_paths_on_write_paths_are_clear_type_errors_and_write_nothing(
    tmp_path: pathlib.Path, kind: str
) -> None:
    deep = tmp_path / ("d" * 70)  # a long path: the message keeps it whole
    deep.mkdir()
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    np.save(deep / "in.npy", a)

    def mk(name: str) -> Any:
        raw = os.fsencode(str(deep / name))
        return raw if kind == "bytes" else _BytesPath(raw)

    for name, call in [
        ("out.npy", lambda: g.save(mk("out.npy"))),
        ("out.h5", lambda: g.save(mk("out.h5"), dataset="x")),
        ("out", lambda: g.saveCupy(mk("out"))),
        ("c.npy", lambda: convert(str(deep / "in.npy"), mk("c.npy"))),
        ("ck", lambda: gl.save_checkpoint(mk("ck"), {"t": torch.nn.Linear(1, 1)})),
    ]:
        _check_bytes_refusal(call, os.fsencode(str(deep / name)), kind)
    assert os.listdir(deep) == ["in.npy"]


@pytest.mark.parametrize("kind", ["bytes", "pathlike"])
def test_bytes_paths_on_read_paths_are_clear_type_errors_and_change_nothing(
    tmp_path: pathlib.Path, kind: str
) -> None:
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = tmp_path / "in.npy"
    np.save(p, a * 5)
    raw = os.fsencode(str(p))
    arg: Any = raw if kind == "bytes" else _BytesPath(raw)
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    calls = [
        lambda: g.load(arg),
        lambda: g.loadCupy(arg),
        lambda: convert(arg, str(tmp_path / "out.npy")),
        lambda: file_store(arg),
        lambda: gl.GadgetDataset(arg, placement="cpu", device="cpu"),
        # options for a path column: the column's message, not "this dataset has no path"
        lambda: gl.GadgetDataset(arg, placement="file", device="cpu", cache_bytes=0),
    ]
    if kind == "pathlike":  # a bytes object itself is read as data by the constructor
        calls.append(lambda: gl.DataGadget(arg, placement="file"))
    for call in calls:
        _check_bytes_refusal(call, raw, kind)
    np.testing.assert_array_equal(g.getNumpyVersion(), a)
    assert sorted(os.listdir(tmp_path)) == ["in.npy"]


def test_the_dataset_message_names_the_column(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "in.npy"
    np.save(p, np.zeros((4, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError, match=r"^a file path in column 1 must be a str"):
        gl.GadgetDataset(np.zeros((4, 2), np.float32), os.fsencode(str(p)), device="cpu")


def test_the_advised_fsdecode_round_trips_even_undecodable_names(tmp_path: pathlib.Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(a, placement="cpu", device="cpu")
    for raw in (os.fsencode(str(tmp_path / "plain.npy")), os.fsencode(str(tmp_path)) + b"/\xff.h5"):
        path = os.fsdecode(raw)
        g.save(path)
        assert os.path.exists(raw)  # the file the bytes name
        back = gl.DataGadget(path, placement="file", device="cpu")
        try:
            np.testing.assert_array_equal(back.getData(torch.arange(4)).numpy(), a)
        finally:
            back.close()


def test_other_wrong_kinds_keep_their_message() -> None:
    g = gl.DataGadget(np.zeros((2, 2), np.float32), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError) as info:
        g.save(None)  # type: ignore[arg-type]
    msg = str(info.value)
    assert msg == "path must be a str or os.PathLike (a file or directory name); got NoneType None"


def test_a_bytes_file_name_given_to_datagadget_is_refused_with_advice(tmp_path) -> None:
    # DataGadget(b"x.npy") said "the source array must be a torch tensor or a NumPy/CuPy
    # array; got bytes"; it now says what every other file-taking call says
    path = tmp_path / "x.npy"
    np.save(path, np.arange(6, dtype=np.float32).reshape(3, 2))
    with pytest.raises(gl.GadgetTypeError, match=r"got bytes .*x\.npy.*os\.fsdecode"):
        gl.DataGadget(os.fsencode(path))
    g = gl.DataGadget(os.fsdecode(os.fsencode(path)), placement="cpu")
    assert g.getData([2]).tolist() == [[4.0, 5.0]]


@pytest.mark.parametrize("repeats", [False, True])
@pytest.mark.parametrize("aliased", [False, True])
def test_cpu_table_scatter_matches_numpy(repeats: bool, aliased: bool) -> None:
    # a host table's insertData writes each id's last occurrence; distinct ids take one
    # index_copy_, repeats the winners in their given order; rows that are a view of the
    # table itself are read before anything is written (as NumPy's a[ids] = a[k:m])
    gen = torch.Generator().manual_seed(int(repeats) * 2 + int(aliased))
    src = torch.randn(500, 6, generator=gen)
    g = gl.DataGadget(src.clone(), placement="cpu")
    n = 200
    ids = (
        torch.randint(0, 500, (n,), generator=gen)
        if repeats
        else torch.randperm(500, generator=gen)[:n]
    )
    if repeats:
        ids[3] = ids[150]  # a repeat for sure
    view = g.as_tensor()
    rows = view[100:300] if aliased else torch.randn(n, 6, generator=gen)
    expect = src.numpy().copy()
    expect[ids.numpy()] = (expect[100:300] if aliased else rows.numpy()).copy()
    g.insertData(rows, ids)
    assert np.array_equal(g.as_tensor().numpy(), expect)
