"""Session 19 review probes: README "Rows in and out" and "Errors" on the ``cpu`` placement
(and ``file`` where the README says a rule holds on every placement).

Randomised operation sequences are checked against a NumPy reference array; refused
calls must raise the README's error class and leave every table unchanged.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gadgetloader as gl


@pytest.fixture(autouse=True)
def _rows_delivered_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """These probes check a CPU machine's behaviour against NumPy: on a CUDA machine rows
    would arrive on the GPU by default (``device=None``), so the default is the CPU here."""
    import gadgetloader._device as _dev

    monkeypatch.setattr(_dev, "default_device", lambda: torch.device("cpu"))


HYP = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _ref_write(ref: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """Sequential assignment: a repeated id takes its last occurrence's row."""
    flat_ids = ids.reshape(-1)
    flat_rows = rows.reshape((flat_ids.size, *ref.shape[1:]))
    for i, r in zip(flat_ids.tolist(), flat_rows, strict=True):
        ref[i] = r


def _id_forms(ids: np.ndarray) -> list:
    """The same ids in every documented container."""
    return [
        ids.tolist(),
        ids.astype(np.int32),
        ids.astype(np.int64),
        torch.from_numpy(ids.astype(np.int64)),
        torch.from_numpy(ids.astype(np.int32)),
        torch.from_numpy(ids.astype(np.int16)),
    ]


def _snapshot(*gs: gl.DataGadget) -> list[np.ndarray]:
    return [g.getNumpyVersion() for g in gs]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(
        np.array_equal(x, y, equal_nan=x.dtype.kind == "f") for x, y in zip(a, b, strict=True)
    )


# ------------------------------------------------------------------------------------
# randomised sequences against a NumPy reference
# ------------------------------------------------------------------------------------

_N = 12
_ROW = (2, 3)

_op = st.one_of(
    st.tuples(st.just("get"), st.lists(st.integers(0, _N - 1), max_size=9), st.integers(0, 5)),
    st.tuples(st.just("get2d"), st.lists(st.integers(0, _N - 1), min_size=6, max_size=6)),
    st.tuples(st.just("put"), st.lists(st.integers(0, _N - 1), max_size=9), st.integers(0, 5)),
    st.tuples(
        st.just("slice"),
        st.integers(-_N - 2, _N + 2) | st.none(),
        st.integers(-_N - 2, _N + 2) | st.none(),
        st.sampled_from([None, 1, 2, 3, -1, -2]),
    ),
    st.tuples(
        st.just("putslice"),
        st.integers(-_N - 2, _N + 2) | st.none(),
        st.integers(-_N - 2, _N + 2) | st.none(),
        st.sampled_from([None, 1, 2, -1, -3]),
    ),
    st.tuples(
        st.just("putpart"),
        st.lists(st.integers(0, _N - 1), min_size=1, max_size=6),
        st.integers(-2, 1),
        st.integers(0, 2),
        st.integers(1, 3),
    ),
    st.tuples(st.just("fill"), st.integers(-100, 100)),
    st.tuples(
        st.just("bad_id"),
        st.lists(st.integers(0, _N - 1), max_size=4),
        st.sampled_from([-1, _N, _N + 5, -_N]),
    ),
    st.tuples(st.just("bad_dtype"), st.lists(st.integers(0, _N - 1), min_size=1, max_size=4)),
    st.tuples(st.just("bad_shape"), st.lists(st.integers(0, _N - 1), min_size=1, max_size=4)),
    st.tuples(st.just("many"), st.lists(st.integers(0, _N - 1), max_size=7)),
)


def _run_ops(g: gl.DataGadget, h: gl.DataGadget, ops: list, rng: np.random.Generator) -> None:
    ref = g.getNumpyVersion()
    href = h.getNumpyVersion()
    for op in ops:
        kind = op[0]
        if kind == "get":
            ids = np.array(op[1], dtype=np.int64)
            form = _id_forms(ids)[op[2]]
            out = g.getData(form)
            assert tuple(out.shape) == (len(ids), *_ROW)
            assert np.array_equal(out.numpy(), ref[ids])
        elif kind == "get2d":
            ids = np.array(op[1], dtype=np.int64).reshape(2, 3)
            out = g[torch.from_numpy(ids)]
            assert tuple(out.shape) == (2, 3, *_ROW)
            assert np.array_equal(out.numpy(), ref[ids])
        elif kind == "put":
            ids = np.array(op[1], dtype=np.int64)
            rows = rng.standard_normal((len(ids), *_ROW)).astype(np.float32)
            form = _id_forms(ids)[op[2]]
            g.insertData(torch.from_numpy(rows), form)
            _ref_write(ref, ids, rows)
        elif kind == "slice":
            sl = slice(op[1], op[2], op[3])
            assert np.array_equal(g[sl].numpy(), ref[sl])
        elif kind == "putslice":
            sl = slice(op[1], op[2], op[3])
            n = len(range(*sl.indices(_N)))
            rows = rng.standard_normal((n, *_ROW)).astype(np.float32)
            g[sl] = rows
            ref[sl] = rows
        elif kind == "putpart":
            ids = np.array(op[1], dtype=np.int64)
            col, lo, width = op[2], op[3], op[4]
            part = (slice(None), col, slice(lo, lo + width))
            shape = ref[ids][part].shape
            vals = rng.standard_normal(shape).astype(np.float32)
            g[torch.from_numpy(ids), col, lo : lo + width] = torch.from_numpy(vals)
            # NumPy reference, sequential (last occurrence wins)
            for k, i in enumerate(ids.tolist()):
                ref[i, col, lo : lo + width] = vals[k]
            got = g[torch.from_numpy(ids), col, lo : lo + width]
            assert np.array_equal(got.numpy(), ref[ids][part])
        elif kind == "fill":
            g.fill_(float(op[1]))
            ref[...] = op[1]
        elif kind == "bad_id":
            ids = op[1] + [op[2]]
            rows = torch.ones((len(ids), *_ROW))
            with pytest.raises(gl.GadgetIndexError):
                g.insertData(rows, ids)
            with pytest.raises(gl.GadgetIndexError):
                g.getData(ids)
            with pytest.raises(gl.GadgetIndexError):
                gl.scatter_many([g, h], [rows, torch.ones(len(ids), dtype=torch.int64)], ids)
        elif kind == "bad_dtype":
            ids = op[1]
            with pytest.raises(gl.GadgetTypeError):
                g.insertData(torch.ones((len(ids), *_ROW), dtype=torch.float64), ids)
            with pytest.raises(gl.GadgetTypeError):
                g.insertData(np.ones((len(ids), *_ROW)), ids)
            with pytest.raises(gl.GadgetTypeError):  # the second table's dtype is wrong
                gl.scatter_many([g, h], [torch.ones((len(ids), *_ROW)), torch.ones(len(ids))], ids)
        elif kind == "bad_shape":
            ids = op[1]
            with pytest.raises(gl.GadgetValueError):
                g.insertData(torch.ones((len(ids) + 1, *_ROW)), ids)
            with pytest.raises(gl.GadgetValueError):
                g.insertData(torch.ones((len(ids), 3, 2)), ids)
            with pytest.raises(gl.GadgetValueError):
                gl.scatter_many(
                    [g, h],
                    [torch.ones((len(ids), *_ROW)), torch.ones(len(ids) + 1, dtype=torch.int64)],
                    ids,
                )
        elif kind == "many":
            ids = np.array(op[1], dtype=np.int64)
            rows = rng.standard_normal((len(ids), *_ROW)).astype(np.float32)
            hrows = rng.integers(-1000, 1000, len(ids)).astype(np.int64)
            gl.scatter_many([g, h], [torch.from_numpy(rows), hrows], ids)
            _ref_write(ref, ids, rows)
            _ref_write(href, ids, hrows)
            a, b = gl.gather_many([g, h], ids)
            assert np.array_equal(a.numpy(), ref[ids]) and np.array_equal(b.numpy(), href[ids])
        assert np.array_equal(g.getNumpyVersion(), ref), f"after {op}"
        assert np.array_equal(h.getNumpyVersion(), href), f"after {op}"


@HYP
@given(ops=st.lists(_op, max_size=14), seed=st.integers(0, 2**32 - 1))
def test_random_sequences_cpu_match_numpy(ops: list, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = gl.DataGadget(rng.standard_normal((_N, *_ROW)).astype(np.float32), placement="cpu")
    h = gl.DataGadget(np.arange(_N, dtype=np.int64), placement="cpu")
    with g, h:
        _run_ops(g, h, ops, rng)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(_op, max_size=10), seed=st.integers(0, 2**32 - 1))
def test_random_sequences_file_match_numpy(
    tmp_path_factory: pytest.TempPathFactory, ops: list, seed: int
) -> None:
    # "Rules that hold on every placement": the file placement, small blocks, no cache
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("rows")
    np.save(d / "t.npy", rng.standard_normal((_N, *_ROW)).astype(np.float32))
    np.save(d / "h.npy", np.arange(_N, dtype=np.int64))
    g = gl.DataGadget(str(d / "t.npy"), placement="file", block_rows=5, cache_bytes=0)
    h = gl.DataGadget(str(d / "h.npy"), placement="file", block_rows=3)
    with g, h:
        _run_ops(g, h, ops, rng)
        final_g, final_h = g.getNumpyVersion(), h.getNumpyVersion()
    # written through to the files
    assert np.array_equal(np.load(d / "t.npy"), final_g)
    assert np.array_equal(np.load(d / "h.npy"), final_h)


# ------------------------------------------------------------------------------------
# the README's example and signature
# ------------------------------------------------------------------------------------


def test_readme_example_runs_on_cpu(tmp_path: os.PathLike) -> None:
    path = os.path.join(tmp_path, "embeddings.npy")
    src = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    np.save(path, src)
    if torch.cuda.is_available():  # a pinned table (rows come to the CPU in these probes)
        table = gl.DataGadget(path, CPUPinn=True)
    else:  # README: without CUDA everything runs on the CPU, with one warning
        with pytest.warns(gl.FallbackWarning):
            table = gl.DataGadget(path, CPUPinn=True)
    ids = torch.randint(0, len(table), (4096,))
    rows = table.getData(ids)
    assert tuple(rows.shape) == (4096, 8)
    assert np.array_equal(rows.numpy(), src[ids.numpy()])
    table.insertData(rows * 0.5, ids)
    expected = src.copy()
    _ref_write(expected, ids.numpy(), src[ids.numpy()] * 0.5)
    assert np.array_equal(table.getNumpyVersion(), expected)
    table.saveCupy(path)
    assert np.array_equal(np.load(path), expected)


def test_signature_matches_readme() -> None:
    params = inspect.signature(gl.DataGadget).parameters
    names = list(params)
    assert names[:2] == ["fileName", "CPUPinn"]
    assert params["CPUPinn"].default is False
    for kw in ("placement", "shape", "dtype", "device"):
        assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[kw].default is None


@pytest.mark.parametrize("flag", ["False", "True", "0", 2, None, 0.0])
def test_cpupinn_non_bool_is_type_error(flag: object) -> None:
    with pytest.raises(gl.GadgetTypeError, match="CPUPinn"):
        gl.DataGadget((3, 2), flag, placement="cpu")


@pytest.mark.parametrize("flag", [True, False, 1, 0])
def test_cpupinn_bool_or_int_accepted(flag: object) -> None:
    assert gl.DataGadget((3, 2), flag, placement="cpu").placement == "cpu"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float", torch.float32),
        ("int", torch.int32),
        ("byte", torch.uint8),
        ("char", torch.int8),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        (np.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        ("float64", torch.float64),
    ],
)
def test_dtype_names_as_readme(name: object, expected: torch.dtype) -> None:
    assert gl.DataGadget((2, 2), dtype=name, placement="cpu").dtype == expected


def test_tuple_is_shape_list_is_data() -> None:
    assert gl.DataGadget((3, 2), placement="cpu").shape == (3, 2)
    g = gl.DataGadget([3, 2], placement="cpu")
    assert g.shape == (2,)
    assert g.getNumpyVersion().tolist() == [3, 2]


def test_data_copied_in_and_detached() -> None:
    src = np.ones((3, 2), np.float32)
    g = gl.DataGadget(src, placement="cpu")
    src[:] = 5
    assert g.getNumpyVersion().max() == 1
    t = torch.ones(3, 2, requires_grad=True)
    g2 = gl.DataGadget(t, placement="cpu")
    with torch.no_grad():
        t.mul_(3)
    assert not g2.as_tensor().requires_grad
    assert g2.getNumpyVersion().max() == 1


def test_facts_shape_dtype_placement_nbytes_len() -> None:
    g = gl.DataGadget((7, 3, 2), dtype="int16", placement="cpu")
    assert g.shape == (7, 3, 2)
    assert g.dtype == torch.int16
    assert g.placement == "cpu"
    assert g.nbytes == 7 * 3 * 2 * 2
    assert len(g) == 7


# ------------------------------------------------------------------------------------
# ids: forms, dtypes, shapes, edge cases
# ------------------------------------------------------------------------------------


@pytest.fixture
def table() -> gl.DataGadget:
    return gl.DataGadget(np.arange(40, dtype=np.float32).reshape(10, 4), placement="cpu")


REF = np.arange(40, dtype=np.float32).reshape(10, 4)


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 3],
        (3, 1, 3),
        np.array([3, 1, 3], dtype=np.uint8),
        np.array([3, 1, 3], dtype=np.int8),
        np.array([3, 1, 3], dtype=np.uint16),
        np.array([3, 1, 3], dtype=np.uint32),
        np.array([3, 1, 3], dtype=np.uint64),
        np.array([3, 1, 3], dtype=">i4"),
        torch.tensor([3, 1, 3], dtype=torch.uint8),
        torch.tensor([3, 1, 3], dtype=torch.int32),
        torch.tensor([3, 1, 3], dtype=torch.int16),
        torch.tensor([3, 1, 3], dtype=torch.uint16),
        torch.tensor([3, 1, 3], dtype=torch.uint64),
        [np.int64(3), np.int32(1), np.int16(3)],
        [torch.tensor(3), torch.tensor(1), torch.tensor(3)],
    ],
    ids=lambda x: type(x).__name__ + str(getattr(x, "dtype", "")),
)
def test_any_integer_id_form(table: gl.DataGadget, ids: object) -> None:
    assert np.array_equal(table.getData(ids).numpy(), REF[[3, 1, 3]])


def test_range_ids(table: gl.DataGadget) -> None:
    assert np.array_equal(table[range(9, -1, -3)].numpy(), REF[[9, 6, 3, 0]])
    assert np.array_equal(table[range(2, 2)].numpy(), REF[[]])
    with pytest.raises(gl.GadgetIndexError):
        table[range(8, 11)]


def test_noncontiguous_and_fortran_ids(table: gl.DataGadget) -> None:
    assert np.array_equal(table[np.arange(10)[::-3]].numpy(), REF[[9, 6, 3, 0]])
    t = torch.arange(10)[::3]
    assert np.array_equal(table[t].numpy(), REF[[0, 3, 6, 9]])
    f = np.asfortranarray(np.array([[1, 2, 3], [4, 5, 6]]))
    assert np.array_equal(table[f].numpy(), REF[f])
    ro = np.array([5, 2])
    ro.setflags(write=False)
    assert np.array_equal(table[ro].numpy(), REF[[5, 2]])
    assert np.array_equal(table[torch.tensor([7]).expand(3)].numpy(), REF[[7, 7, 7]])


def test_id_shapes(table: gl.DataGadget) -> None:
    assert tuple(table[3].shape) == (4,)
    assert tuple(table[torch.tensor(3)].shape) == (4,)
    assert tuple(table[np.int64(3)].shape) == (4,)
    assert tuple(table[[[1], [2]]].shape) == (2, 1, 4)
    assert tuple(table[torch.zeros(2, 0, 3, dtype=torch.int64)].shape) == (2, 0, 3, 4)
    assert tuple(table[[]].shape) == (0, 4)
    assert tuple(table[[[]]].shape) == (1, 0, 4)


def test_tuple_of_plain_ints_is_ids(table: gl.DataGadget) -> None:
    # README: "a tuple of plain ints stays a list of ids"
    assert np.array_equal(table[3, 0].numpy(), REF[[3, 0]])
    assert np.array_equal(table.getData((3, 0)).numpy(), REF[[3, 0]])


@pytest.mark.parametrize(
    "bad",
    [
        [-1],
        [10],
        [0, 10],
        np.array([-1], np.int8),
        torch.tensor([10], dtype=torch.int32),
        10,
        -1,
        np.array([2**64 - 1], np.uint64),
        [2**70],
        [-(2**70)],
        2**70,
    ],
    ids=repr,
)
def test_out_of_range_ids_are_index_errors(table: gl.DataGadget, bad: object) -> None:
    with pytest.raises(gl.GadgetIndexError) as e:
        table.getData(bad)
    assert isinstance(e.value, IndexError)
    shape = (len(bad), 4) if isinstance(bad, list) else (4,) if isinstance(bad, int) else (1, 4)
    with pytest.raises(gl.GadgetIndexError):
        table.insertData(torch.zeros(shape), bad)
    assert np.array_equal(table.getNumpyVersion(), REF)


def test_index_error_message_says_expected_and_got(table: gl.DataGadget) -> None:
    with pytest.raises(gl.GadgetIndexError) as e:
        table.insertData(torch.zeros(2, 4), [1, 10])
    msg = str(e.value)
    assert "10" in msg and "[0, 9]" in msg


@pytest.mark.parametrize(
    "bad",
    [
        [1.0],
        torch.tensor([1.0]),
        torch.empty(0),
        np.array([1.5]),
        [True, False],
        [1, True],
        torch.ones(10, dtype=torch.bool),
        np.ones(10, dtype=bool),
        True,
        np.float64(1.0),
        None,
        "1",
        {1, 2},
        np.array([1j]),
        np.array([1, None], dtype=object),
    ],
    ids=repr,
)
def test_non_integer_ids_are_type_errors(table: gl.DataGadget, bad: object) -> None:
    with pytest.raises(gl.GadgetTypeError) as e:
        table.getData(bad)
    assert isinstance(e.value, TypeError)
    assert "ids" in str(e.value) or "slice" in str(e.value)
    with pytest.raises(gl.GadgetTypeError):
        table.insertData(torch.zeros(1, 4), bad)
    assert np.array_equal(table.getNumpyVersion(), REF)


def test_check_ids_false_on_cpu_still_checks(table: gl.DataGadget) -> None:
    # README: "CPU ids are checked on the CPU for free"
    with pytest.raises(gl.GadgetIndexError):
        table.getData([10], check_ids=False)
    with pytest.raises(gl.GadgetIndexError):
        table.insertData(torch.zeros(1, 4), [10], check_ids=False)
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many([table], [10], check_ids=False)
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many([table], [torch.zeros(1, 4)], [-1], check_ids=False)
    assert np.array_equal(table.getNumpyVersion(), REF)
    assert np.array_equal(table.getData([4, 2], check_ids=False).numpy(), REF[[4, 2]])


def test_zero_row_table_ids(tmp_path: os.PathLike) -> None:
    z = gl.DataGadget((0, 4), placement="cpu")
    assert tuple(z[[]].shape) == (0, 4)
    assert tuple(z[:].shape) == (0, 4)
    with pytest.raises(gl.GadgetIndexError):
        z[0]
    z.insertData(torch.zeros(0, 4), [])
    assert [tuple(r.shape) for r in gl.gather_many([z], [])] == [(0, 4)]


# ------------------------------------------------------------------------------------
# slices and tuple (row-part) indexes
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sl",
    [
        slice(2, 5),
        slice(None),
        slice(-3, None),
        slice(None, None, -2),
        slice(8, 20),
        slice(5, 2),
        slice(-100, 3),
        slice(1, 9, 3),
    ],
    ids=repr,
)
def test_slices_of_rows_as_numpy(table: gl.DataGadget, sl: slice) -> None:
    assert np.array_equal(table[sl].numpy(), REF[sl])
    n = len(range(*sl.indices(10)))
    rows = np.full((n, 4), -7, np.float32)
    table[sl] = rows
    ref = REF.copy()
    ref[sl] = rows
    assert np.array_equal(table.getNumpyVersion(), ref)


def test_slice_step_zero_and_float_bounds(table: gl.DataGadget) -> None:
    with pytest.raises(gl.GadgetValueError):
        table[::0]
    with pytest.raises(gl.GadgetTypeError):
        table[1.0:3]
    with pytest.raises(gl.GadgetValueError):
        table[::0] = torch.zeros(0, 4)
    assert np.array_equal(table.getNumpyVersion(), REF)


def test_readme_tuple_index_examples(table: gl.DataGadget) -> None:
    assert np.array_equal(table.getData((slice(0, 6), slice(0, 3))).numpy(), REF[0:6, 0:3])
    assert np.array_equal(table[[1, 2], 0].numpy(), REF[[1, 2], 0])
    assert np.array_equal(table[2:5].numpy(), REF[2:5])
    ids = torch.tensor([4, 1])
    assert np.array_equal(table[ids, 0:3].numpy(), REF[[4, 1], 0:3])
    assert np.array_equal(table[np.array([4, 1]), -1].numpy(), REF[[4, 1], -1])
    assert np.array_equal(table[range(1, 3), 1].numpy(), REF[1:3, 1])
    assert np.array_equal(table[(torch.tensor(3), slice(0, 2))].numpy(), REF[3, 0:2])


def test_insert_with_tuple_index_writes_only_that_part(table: gl.DataGadget) -> None:
    table.insertData(torch.full((6, 3), -1.0), (slice(0, 6), slice(0, 3)))
    ref = REF.copy()
    ref[0:6, 0:3] = -1
    assert np.array_equal(table.getNumpyVersion(), ref)
    table[[7, 8], -1] = torch.tensor([100.0, 200.0])
    ref[[7, 8], -1] = [100, 200]
    assert np.array_equal(table.getNumpyVersion(), ref)
    table[[5, 5], 0] = torch.tensor([1.0, 2.0])  # last occurrence wins
    ref[5, 0] = 2
    assert np.array_equal(table.getNumpyVersion(), ref)


def test_tuple_of_id_lists_refused(table: gl.DataGadget) -> None:
    with pytest.raises(gl.GadgetTypeError):
        table[[1, 2], [0, 1]]
    with pytest.raises(gl.GadgetTypeError):
        table[[1, 2], [0, 1]] = torch.zeros(2)
    assert np.array_equal(table.getNumpyVersion(), REF)


@pytest.mark.parametrize(
    ("index", "exc"),
    [
        (([1, 2], slice(None, None, -1)), gl.GadgetValueError),
        ((torch.tensor([1]), slice(None, None, 0)), gl.GadgetValueError),
        ((torch.tensor([1]), slice(0.5, 2)), gl.GadgetTypeError),
        ((torch.tensor([1]), slice(0, 2.0)), gl.GadgetTypeError),
        (([1, 2], 4), gl.GadgetIndexError),
        (([1, 2], -5), gl.GadgetIndexError),
        (([1, 2], 0, 0), gl.GadgetIndexError),
        ((torch.tensor([1]), torch.tensor([0, 1])), gl.GadgetTypeError),
        ((torch.tensor([1]), 1.5), gl.GadgetTypeError),
        ((slice(0, 12), 0), None),  # clipped like NumPy: not an error
    ],
    ids=repr,
)
def test_bad_row_part_indexes(table: gl.DataGadget, index: tuple, exc: type | None) -> None:
    if exc is None:
        assert np.array_equal(table[index].numpy(), REF[index])
        return
    with pytest.raises(exc):
        table[index]
    with pytest.raises(exc):
        table[index] = torch.zeros(1)
    assert np.array_equal(table.getNumpyVersion(), REF)


@pytest.mark.parametrize(
    ("index", "word"),
    [(([1], True), "bool"), (([1, 2], None), "nonetype")],
    ids=["list-then-bool", "list-then-none"],
)
def test_row_part_refusal_message_names_the_problem(
    table: gl.DataGadget, index: tuple, word: str
) -> None:
    # g[[1], True] (a bool is no index into the row) and g[(1, 2), 0] (a tuple of ids, then
    # an int: README only allows a *list* of ids there). A GadgetTypeError is right, but the
    # message should say what was wrong, not "a ragged tuple" of ids
    with pytest.raises(gl.GadgetTypeError) as e:
        table[index]
    msg = str(e.value)
    assert "ragged" not in msg and word in msg.lower(), msg


def test_tuple_of_ids_then_int_reads_and_writes_as_numpy(table: gl.DataGadget) -> None:
    # g[(1, 2), 0]: a tuple of ids followed by ints into the row, as NumPy (and as a list)
    assert np.array_equal(table[(1, 2), 0].numpy(), REF[[1, 2], 0])
    assert np.array_equal(table[(3, 1), 1:3].numpy(), REF[[3, 1], 1:3])
    table[(1, 2), 0] = torch.tensor([-1.0, -2.0], dtype=table.dtype)
    ref = REF.copy()
    ref[[1, 2], 0] = [-1.0, -2.0]
    assert np.array_equal(table.getNumpyVersion(), ref)


def test_many_refuse_row_part_indexes_by_name() -> None:
    a = gl.DataGadget(REF.copy(), placement="cpu")
    b = gl.DataGadget(REF.copy(), placement="cpu")
    for index in ((slice(2, 5), 0), ([1, 2], 0), ((1, 2), slice(0, 2))):
        with pytest.raises(gl.GadgetTypeError, match="not an index into the rows"):
            gl.gather_many([a, b], index)
        with pytest.raises(gl.GadgetTypeError, match="not an index into the rows"):
            gl.scatter_many([a, b], [torch.zeros(2), torch.zeros(2)], index)
    assert np.array_equal(a.getNumpyVersion(), REF) and np.array_equal(b.getNumpyVersion(), REF)
    # ids and slices of rows still work, a tuple of plain ints is a list of ids
    for ids in ((1, 2), [1, 2], slice(1, 3), ((1, 2), (3, 4))):
        ra, rb = gl.gather_many([a, b], ids)
        want = REF[np.asarray(range(10)[ids] if isinstance(ids, slice) else ids)]
        assert np.array_equal(ra.numpy(), want) and np.array_equal(rb.numpy(), want)


def test_row_part_on_scalar_row_table() -> None:
    g = gl.DataGadget(np.array([5, 6, 7], dtype=np.int64), placement="cpu")
    assert g[[2, 0]].tolist() == [7, 5]
    assert g[1].item() == 6
    with pytest.raises(gl.GadgetIndexError):
        g[[1, 2], 0]


def test_part_insert_data_checks(table: gl.DataGadget) -> None:
    with pytest.raises(gl.GadgetValueError):
        table.insertData(torch.zeros(3), ([1, 2], 0))
    with pytest.raises(gl.GadgetTypeError):
        table.insertData(torch.zeros(2, dtype=torch.float64), ([1, 2], 0))
    with pytest.raises(gl.GadgetIndexError):
        table.insertData(torch.zeros(2), ([1, 12], 0))
    with pytest.raises(gl.GadgetValueError):
        table.getData((slice(0, 2), 0), out=torch.empty(2))
    assert np.array_equal(table.getNumpyVersion(), REF)


# ------------------------------------------------------------------------------------
# insertData: data checks, repeated ids, aliasing
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "exc"),
    [
        (torch.zeros(2, 4, dtype=torch.float64), gl.GadgetTypeError),
        (np.zeros((2, 4)), gl.GadgetTypeError),
        ([[0.0] * 4] * 2, gl.GadgetTypeError),
        (torch.zeros(2, 4, dtype=torch.bool), gl.GadgetTypeError),
        (torch.zeros(2, 4, dtype=torch.int32), gl.GadgetTypeError),
        (torch.zeros(2, 4, dtype=torch.float16), gl.GadgetTypeError),
        (np.zeros((2, 4), np.complex64), gl.GadgetTypeError),
        (torch.zeros(3, 4), gl.GadgetValueError),
        (torch.zeros(2, 5), gl.GadgetValueError),
        (torch.zeros(4), gl.GadgetValueError),
        (torch.tensor(0.0), gl.GadgetValueError),
        (torch.zeros(2, 4, device="meta"), gl.GadgetTypeError),
        (torch.zeros(2, 4).to_sparse(), gl.GadgetTypeError),
        (None, gl.GadgetTypeError),
        ("rows", gl.GadgetTypeError),
    ],
    ids=lambda x: repr(x)[:30],
)
def test_insert_bad_data_refused_unchanged(table: gl.DataGadget, data: object, exc: type) -> None:
    with pytest.raises(exc) as e:
        table.insertData(data, [1, 2])
    assert isinstance(e.value, gl.GadgetError)
    with pytest.raises(exc):
        table[[1, 2]] = data
    with pytest.raises(exc):
        gl.scatter_many([table], [data], [1, 2])
    assert np.array_equal(table.getNumpyVersion(), REF)


def test_dtype_error_message_names_both_dtypes(table: gl.DataGadget) -> None:
    with pytest.raises(gl.GadgetTypeError) as e:
        table.insertData(torch.zeros(2, 4, dtype=torch.float64), [1, 2])
    assert "float32" in str(e.value) and "float64" in str(e.value)
    with pytest.raises(gl.GadgetValueError) as e2:
        table.insertData(torch.zeros(3, 4), [1, 2])
    assert "(2, 4)" in str(e2.value) and "(3, 4)" in str(e2.value)


def test_insert_accepts_numpy_views_and_byte_orders(table: gl.DataGadget) -> None:
    table.insertData(np.arange(16, dtype=np.float32).reshape(4, 4)[::2], [0, 1])
    assert table[0:2].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    ro = np.full((1, 4), 3, np.float32)
    ro.setflags(write=False)
    table.insertData(ro, [0])
    assert table[0].tolist() == [3] * 4
    table.insertData(np.full((1, 4), 4, ">f4"), [0])
    assert table[0].tolist() == [4] * 4
    table.insertData(torch.arange(16, dtype=torch.float32).reshape(4, 4).t()[:2], [2, 3])
    assert table[2:4].tolist() == [[0, 4, 8, 12], [1, 5, 9, 13]]


def test_insert_rows_aliasing_the_table(table: gl.DataGadget) -> None:
    # rows that are a view of the table itself (shifted by one row)
    table.insertData(table.as_tensor()[0:3], [1, 2, 3])
    ref = REF.copy()
    ref[1:4] = REF[0:3]
    assert np.array_equal(table.getNumpyVersion(), ref)


def test_insert_requires_grad_data_detached(table: gl.DataGadget) -> None:
    x = torch.full((2, 4), 2.0, requires_grad=True)
    table.insertData(x * 1, [0, 1])
    assert not table.as_tensor().requires_grad
    assert table[0].tolist() == [2.0] * 4


@HYP
@given(
    ids=st.lists(st.integers(0, 5), min_size=1, max_size=20),
    dtype=st.sampled_from(
        ["float32", "float64", "int8", "int64", "uint8", "bool", "float16", "bfloat16"]
    ),
)
def test_repeated_ids_last_wins_all_dtypes(ids: list[int], dtype: str) -> None:
    g = gl.DataGadget((6, 2), dtype=dtype, placement="cpu")
    tdt = g.dtype
    vals = (
        torch.arange(len(ids) * 2).reshape(len(ids), 2) % 2
        if tdt == torch.bool
        else torch.arange(len(ids) * 2).reshape(len(ids), 2)
    )
    rows = vals.to(tdt)
    g.insertData(rows, ids)
    ref = torch.zeros(6, 2, dtype=tdt)
    for k, i in enumerate(ids):
        ref[i] = rows[k]
    assert torch.equal(g.as_tensor(), ref)


def test_insert_int_and_bool_lists_when_dtype_matches() -> None:
    g = gl.DataGadget(np.zeros((2, 2), np.int64), placement="cpu")
    g.insertData([[1, 2]], [0])
    assert g[0].tolist() == [1, 2]
    b = gl.DataGadget((2, 2), dtype=bool, placement="cpu")
    b.insertData(torch.tensor([[True, False]]), [1])
    assert b.getNumpyVersion().tolist() == [[False, False], [True, False]]


def test_out_argument(table: gl.DataGadget) -> None:
    o = torch.empty(2, 4)
    r = table.getData([1, 2], out=o)
    assert r.data_ptr() == o.data_ptr()
    assert np.array_equal(o.numpy(), REF[[1, 2]])
    with pytest.raises(gl.GadgetValueError):
        table.getData([1, 2], out=torch.empty(2, 5))
    with pytest.raises(gl.GadgetTypeError):
        table.getData([1, 2], out=torch.empty(2, 4, dtype=torch.float64))
    with pytest.raises(gl.GadgetValueError):
        table.getData([1, 2], out=torch.empty(4, 2).t())


# ------------------------------------------------------------------------------------
# gather_many / scatter_many
# ------------------------------------------------------------------------------------


def _three() -> tuple[list[gl.DataGadget], list[np.ndarray]]:
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    b = np.arange(10, dtype=np.int64) * -1
    c = np.arange(60, dtype=np.float64).reshape(10, 3, 2)
    return [gl.DataGadget(x, placement="cpu") for x in (a, b, c)], [a, b, c]


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 3],
        np.array([[1, 2], [3, 4]]),
        torch.tensor([9, 0], dtype=torch.int32),
        3,
        [],
        slice(7, None),
        range(2, 8, 2),
    ],
    ids=repr,
)
def test_gather_many_matches_numpy(ids: object) -> None:
    gs, refs = _three()
    out = gl.gather_many(gs, ids)
    assert len(out) == 3
    idx = np.asarray(
        list(range(10))[ids]
        if isinstance(ids, slice)
        else list(ids)
        if isinstance(ids, range)
        else ids,
        dtype=np.int64,
    )
    for o, r in zip(out, refs, strict=True):
        if isinstance(ids, torch.Tensor):
            idx = ids.numpy()
        assert np.array_equal(o.numpy(), r[idx])


def test_gather_many_accepts_tuple_and_generator() -> None:
    gs, refs = _three()
    assert len(gl.gather_many(tuple(gs), [1])) == 3
    assert len(gl.gather_many((g for g in gs), [1])) == 3


@pytest.mark.parametrize(
    ("group", "exc"),
    [
        ("one", gl.GadgetTypeError),
        ("empty", gl.GadgetTypeError),
        ("array", gl.GadgetTypeError),
        ("rows", gl.GadgetValueError),
    ],
)
def test_gather_many_bad_group(group: str, exc: type) -> None:
    gs, refs = _three()
    arg = {
        "one": gs[0],
        "empty": [],
        "array": [gs[0], refs[0]],
        "rows": [gs[0], gl.DataGadget(np.zeros((3, 4), np.float32), placement="cpu")],
    }[group]
    with pytest.raises(exc):
        gl.gather_many(arg, [1])
    with pytest.raises(exc):
        gl.scatter_many(arg, [torch.zeros(1, 4)] * 2, [1])
    assert _same(_snapshot(*gs), refs)


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("fault", ["dtype", "shape", "device"])
def test_scatter_many_fault_in_any_table_writes_nothing(k: int, fault: str) -> None:
    gs, refs = _three()
    rows = [
        torch.full((2, 4), 7.0),
        torch.full((2,), 7, dtype=torch.int64),
        torch.full((2, 3, 2), 7.0, dtype=torch.float64),
    ]
    if fault == "dtype":
        rows[k] = rows[k].to(torch.int32 if k != 1 else torch.float32)
        exc = gl.GadgetTypeError
    elif fault == "shape":
        rows[k] = rows[k][:1]
        exc = gl.GadgetValueError
    else:
        rows[k] = torch.empty(rows[k].shape, dtype=rows[k].dtype, device="meta")
        exc = gl.GadgetTypeError
    with pytest.raises(exc) as e:
        gl.scatter_many(gs, rows, [1, 2])
    assert f"table {k}" in str(e.value)
    assert _same(_snapshot(*gs), refs)


def test_scatter_many_bad_ids_and_counts_write_nothing() -> None:
    gs, refs = _three()
    rows = [np.full((2, 4), 7, np.float32), np.full((2,), 7, np.int64), np.full((2, 3, 2), 7.0)]
    for ids in ([1, 10], [-1, 2]):
        with pytest.raises(gl.GadgetIndexError):
            gl.scatter_many(gs, rows, ids)
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(gs, rows, [1.0, 2.0])
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many(gs, rows[:2], [1, 2])
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(gs, None, [1, 2])
    assert _same(_snapshot(*gs), refs)


def test_scatter_many_repeated_ids_last_wins_and_slice() -> None:
    gs, refs = _three()
    gl.scatter_many(
        gs,
        [
            np.stack([np.full(4, 1, np.float32), np.full(4, 2, np.float32)]),
            np.array([1, 2]),
            np.stack([np.full((3, 2), 1.0), np.full((3, 2), 2.0)]),
        ],
        [5, 5],
    )
    assert gs[0][5].tolist() == [2.0] * 4
    assert gs[1][5].item() == 2
    assert gs[2][5].flatten().tolist() == [2.0] * 6
    gl.scatter_many(
        gs,
        [
            torch.zeros(3, 4),
            torch.zeros(3, dtype=torch.int64),
            torch.zeros(3, 3, 2, dtype=torch.float64),
        ],
        slice(7, None),
    )
    for g, r in zip(gs, refs, strict=True):
        exp = r.copy()
        exp[5] = 2
        exp[7:] = 0
        assert np.array_equal(g.getNumpyVersion(), exp)


def test_scatter_many_same_table_twice_last_table_wins() -> None:
    g = gl.DataGadget(np.zeros((3, 4), np.float32), placement="cpu")
    gl.scatter_many([g, g], [torch.full((1, 4), 1.0), torch.full((1, 4), 2.0)], [0])
    assert g[0].tolist() == [2.0] * 4


def test_scatter_many_read_only_second_table_writes_nothing(tmp_path: os.PathLike) -> None:
    p = os.path.join(tmp_path, "r.npy")
    np.save(p, REF)
    ro = gl.DataGadget(p, placement="file", writable=False)
    c = gl.DataGadget(REF, placement="cpu")
    with ro:
        with pytest.raises(gl.ReadOnlyError):
            gl.scatter_many([c, ro], [torch.ones(1, 4), torch.ones(1, 4)], [0])
        assert np.array_equal(c.getNumpyVersion(), REF)
        assert np.array_equal(ro.getNumpyVersion(), REF)
        assert [r.tolist() for r in gl.gather_many([c, ro], [2])] == [REF[[2]].tolist()] * 2


def test_gather_many_with_row_part_index_message() -> None:
    # getData takes (slice, int); gather_many claims "the same rules" as getData: either it
    # works or it says why, in terms of the index given
    gs, refs = _three()
    try:
        out = gl.gather_many(gs[:1], (slice(2, 5), 0))
    except gl.GadgetTypeError as e:
        assert "object" not in str(e), str(e)
    else:
        assert np.array_equal(out[0].numpy(), refs[0][2:5, 0])


# ------------------------------------------------------------------------------------
# strategy=
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "kernel", "sorted", "hybrid", "torch"])
def test_forced_strategies_give_same_rows_on_cpu(strategy: str) -> None:
    rng = np.random.default_rng(1)
    src = rng.standard_normal((50, 3)).astype(np.float32)
    g = gl.DataGadget(src, placement="cpu", strategy=strategy)
    ids = rng.integers(0, 50, 200)
    assert np.array_equal(g.getData(ids).numpy(), src[ids])
    rows = rng.standard_normal((200, 3)).astype(np.float32)
    g.insertData(rows, ids)
    ref = src.copy()
    _ref_write(ref, ids, rows)
    assert np.array_equal(g.getNumpyVersion(), ref)
    h = gl.DataGadget(np.zeros(50, np.int64), placement="cpu", strategy=strategy)
    gl.scatter_many([g, h], [rows, ids.astype(np.int64)], ids)
    a, b = gl.gather_many([g, h], ids)
    href = np.zeros(50, np.int64)
    _ref_write(href, ids, ids)
    assert np.array_equal(b.numpy(), href[ids])


@pytest.mark.parametrize("strategy", ["bogus", "", "fast"])
def test_unknown_strategy_is_key_error_listing_valid(strategy: object) -> None:
    with pytest.raises(gl.GadgetKeyError) as e:
        gl.DataGadget((3, 2), placement="cpu", strategy=strategy)
    assert "kernel" in str(e.value) and "sorted" in str(e.value)


def test_unknown_placement_is_key_error_listing_valid() -> None:
    with pytest.raises(gl.GadgetKeyError) as e:
        gl.DataGadget((3, 2), placement="gpu")
    assert isinstance(e.value, KeyError)
    for name in ("cpu", "cuda", "pinned", "file"):
        assert name in str(e.value)


# ------------------------------------------------------------------------------------
# initialisers
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [
        ("float32", 2**63, float(np.float32(2**63))),
        ("float32", float("inf"), float("inf")),
        ("float16", 65504, 65504.0),
        ("float16", -1.5, -1.5),
        ("bfloat16", 70000.0, 70144.0),
        ("int8", -128, -128),
        ("int8", 127, 127),
        ("uint8", 255, 255),
        ("int64", 2**63 - 1, 2**63 - 1),
        ("int32", 2.0, 2),
        ("bool", True, True),
        ("bool", 0, False),
        ("bool", 1, True),
        ("float64", np.float64(2.5), 2.5),
        ("float32", torch.tensor(3), 3.0),
    ],
)
def test_fill_accepted_values(dtype: str, value: object, expected: object) -> None:
    g = gl.DataGadget((3, 2), dtype=dtype, placement="cpu")
    assert g.fill_(value) is g
    arr = g.getNumpyVersion()
    assert (arr == expected).all()


def test_fill_nan() -> None:
    g = gl.DataGadget((3, 2), dtype="float16", placement="cpu")
    g.fill_(float("nan"))
    assert np.isnan(g.getNumpyVersion()).all()


@pytest.mark.parametrize(
    ("dtype", "value", "exc"),
    [
        ("float16", 70000.0, gl.GadgetValueError),
        ("float16", 2**31, gl.GadgetValueError),
        ("float32", 1e300, gl.GadgetValueError),
        ("float32", 10**400, gl.GadgetValueError),
        ("int8", 128, gl.GadgetValueError),
        ("int8", -129, gl.GadgetValueError),
        ("uint8", -1, gl.GadgetValueError),
        ("int64", 2**63, gl.GadgetValueError),
        ("int32", 1.5, gl.GadgetValueError),
        ("int32", float("nan"), gl.GadgetValueError),
        ("int32", float("inf"), gl.GadgetValueError),
        ("bool", 2, gl.GadgetValueError),
        ("bool", 0.5, gl.GadgetValueError),
        ("bool", -1, gl.GadgetValueError),
        ("float32", "1", gl.GadgetTypeError),
        ("float32", None, gl.GadgetTypeError),
        ("float32", 1 + 0j, gl.GadgetTypeError),
        ("float32", torch.tensor([1.0, 2.0]), gl.GadgetTypeError),
    ],
    ids=repr,
)
def test_fill_refused_values_leave_table(dtype: str, value: object, exc: type) -> None:
    g = gl.DataGadget((3, 2), dtype=dtype, placement="cpu")
    g.fill_(1)
    before = g.getNumpyVersion()
    with pytest.raises(exc):
        g.fill_(value)
    assert np.array_equal(g.getNumpyVersion(), before)


def test_zero_and_init_return_self_and_fill() -> None:
    g = gl.DataGadget(np.ones((4, 3), np.float32), placement="cpu")
    assert g.zero_() is g
    assert not g.getNumpyVersion().any()
    assert g.init_(torch.nn.init.constant_, val=3.0) is g
    assert (g.getNumpyVersion() == 3).all()
    assert g.init_(torch.nn.init.constant_, 4.0) is g
    assert (g.getNumpyVersion() == 4).all()


def test_uniform_normal_match_torch_same_seed() -> None:
    g = gl.DataGadget((5, 4), placement="cpu")
    torch.manual_seed(0)
    g.uniform_(-2, 3)
    torch.manual_seed(0)
    assert torch.equal(g.as_tensor(), torch.empty(5, 4).uniform_(-2, 3))
    gen = torch.Generator().manual_seed(5)
    g.normal_(1.0, 0.5, generator=gen)
    gen2 = torch.Generator().manual_seed(5)
    assert torch.equal(g.as_tensor(), torch.empty(5, 4).normal_(1.0, 0.5, generator=gen2))


def test_uniform_normal_defaults_and_zero_tensors() -> None:
    g = gl.DataGadget((500, 4), placement="cpu")
    g.uniform_()
    a = g.getNumpyVersion()
    assert a.min() >= 0 and a.max() <= 1 and a.std() > 0.1
    g.uniform_(torch.tensor(5.0), np.float64(6.0))
    a = g.getNumpyVersion()
    assert a.min() >= 5 and a.max() <= 6
    g.normal_(torch.tensor(3.0), torch.tensor(0.0))
    assert (g.getNumpyVersion() == 3).all()
    g.uniform_(2, 2)
    assert (g.getNumpyVersion() == 2).all()


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda g: g.uniform_(1, 0), gl.GadgetValueError),
        (lambda g: g.uniform_(0, 70000), gl.GadgetValueError),
        (lambda g: g.uniform_(-60000, 60000), gl.GadgetValueError),  # high - low overflows
        (lambda g: g.uniform_(float("nan"), 1), gl.GadgetValueError),
        (lambda g: g.uniform_(0, float("inf")), gl.GadgetValueError),
        (lambda g: g.uniform_(torch.tensor([0.0]), 1), gl.GadgetTypeError),
        (lambda g: g.uniform_(True, 2), gl.GadgetTypeError),
        (lambda g: g.uniform_("0", 1), gl.GadgetTypeError),
        (lambda g: g.normal_(0, -1), gl.GadgetValueError),
        (lambda g: g.normal_(0, float("nan")), gl.GadgetValueError),
        (lambda g: g.normal_(float("inf"), 1), gl.GadgetValueError),
        (lambda g: g.normal_(70000, 1), gl.GadgetValueError),
        (lambda g: g.normal_(0, 70000), gl.GadgetValueError),
        (lambda g: g.normal_(0, None), gl.GadgetTypeError),
        (lambda g: g.normal_(0, "1"), gl.GadgetTypeError),
        (lambda g: g.normal_(0, torch.tensor(-1.0)), gl.GadgetValueError),
        (lambda g: g.init_(5), gl.GadgetTypeError),
        (lambda g: g.init_(None), gl.GadgetTypeError),
    ],
)
def test_initialiser_refusals_leave_table(call: object, exc: type) -> None:
    g = gl.DataGadget((4, 3), dtype="float16", placement="cpu")
    g.fill_(7)
    with pytest.raises(exc):
        call(g)  # type: ignore[operator]
    assert (g.getNumpyVersion() == 7).all()


@pytest.mark.parametrize("dtype", ["int32", "uint8", "bool"])
def test_uniform_normal_on_non_float_tables_type_error(dtype: str) -> None:
    g = gl.DataGadget((4, 3), dtype=dtype, placement="cpu")
    g.fill_(1)
    with pytest.raises(gl.GadgetTypeError):
        g.uniform_(0, 1)
    with pytest.raises(gl.GadgetTypeError):
        g.normal_(0, 1)
    assert (g.getNumpyVersion() == 1).all()


def test_torch_init_functions_on_a_table() -> None:
    g = gl.DataGadget((50, 20), placement="cpu")
    g.init_(torch.nn.init.xavier_uniform_)
    bound = (6 / (50 + 20)) ** 0.5
    a = g.getNumpyVersion()
    assert np.abs(a).max() <= bound and a.std() > bound / 4
    torch.manual_seed(3)
    g.init_(torch.nn.init.orthogonal_)
    q = g.as_tensor()
    assert torch.allclose(q.T @ q, torch.eye(20), atol=1e-4)


def test_file_table_init_rules(tmp_path: os.PathLike) -> None:
    p = os.path.join(tmp_path, "f.npy")
    np.save(p, REF)
    with gl.DataGadget(p, placement="file") as g:
        with pytest.raises(gl.GadgetTypeError):
            g.as_tensor()
        for fn in (torch.nn.init.xavier_uniform_, torch.nn.init.orthogonal_, lambda t: t.add_(1)):
            with pytest.raises(gl.GadgetTypeError):
                g.init_(fn)
            assert np.array_equal(g.getNumpyVersion(), REF)
        g.fill_(2)
        assert (g.getNumpyVersion() == 2).all()
        g.uniform_(5, 6)
        a = g.getNumpyVersion()
        assert a.min() >= 5 and a.max() <= 6
        g.normal_(4, 0)
        assert (g.getNumpyVersion() == 4).all()
        g.zero_()
        assert not g.getNumpyVersion().any()
    assert not np.load(p).any()


def test_read_only_file_refuses_writes_unchanged(tmp_path: os.PathLike) -> None:
    p = os.path.join(tmp_path, "r.npy")
    np.save(p, REF)
    with gl.DataGadget(p, placement="file", writable=False) as r:
        for call in (
            lambda: r.insertData(torch.zeros(4), 0),
            lambda: r.__setitem__(([1], 0), torch.zeros(1)),
            lambda: r.fill_(1),
            lambda: r.zero_(),
            lambda: r.uniform_(),
        ):
            with pytest.raises(gl.ReadOnlyError) as e:
                call()
            assert isinstance(e.value, PermissionError)
        assert np.array_equal(r.getNumpyVersion(), REF)
    assert np.array_equal(np.load(p), REF)


# ------------------------------------------------------------------------------------
# getNumpyVersion / as_tensor
# ------------------------------------------------------------------------------------


def test_get_numpy_version_copy_semantics(table: gl.DataGadget) -> None:
    a = table.getNumpyVersion()
    a[0, 0] = 99
    assert table[0][0].item() == 0
    b = table.getNumpyVersion(copy=False)
    b[0, 1] = 98
    assert table[0][1].item() == 98
    assert table.numpy is not None


def test_as_tensor_is_zero_copy_on_cpu(table: gl.DataGadget) -> None:
    t = table.as_tensor()
    t[1, 0] = -5
    assert table[1][0].item() == -5
    table.insertData(torch.full((1, 4), 8.0), [2])
    assert t[2].tolist() == [8.0] * 4


def test_as_tensor_view_is_valid_until_load_or_close(tmp_path: os.PathLike) -> None:
    # as_tensor(): "Valid until close() or load()": load() gives the table new storage, so a
    # view taken before it keeps the old rows (untouched, not freed under it) and a new
    # view is the loaded table; writes through the new view are the table's
    p = os.path.join(tmp_path, "a.npy")
    np.save(p, REF * 2)
    g = gl.DataGadget(REF, placement="cpu")
    old = g.as_tensor()
    g.load(p)
    assert np.array_equal(old.numpy(), REF)
    new = g.as_tensor()
    assert np.array_equal(new.numpy(), REF * 2)
    new[0, 0] = -1
    assert g[0][0].item() == -1


def test_results_are_copies_on_cpu(table: gl.DataGadget) -> None:
    r = table[1:3]
    r[:] = 99
    q = table[[4]]
    q[:] = 99
    assert np.array_equal(table.getNumpyVersion(), REF)


def test_aliasing_writes_read_before_write() -> None:
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    g = gl.DataGadget(a, placement="cpu")
    h = gl.DataGadget(-a, placement="cpu")
    gl.scatter_many([g, h], [h.as_tensor()[0:2], g.as_tensor()[0:2]], [0, 1])
    assert np.array_equal(g.getNumpyVersion()[:2], -a[:2])
    assert np.array_equal(h.getNumpyVersion()[:2], a[:2])
    g2 = gl.DataGadget(a, placement="cpu")
    g2[::-1] = g2.as_tensor()
    assert np.array_equal(g2.getNumpyVersion(), a[::-1])
    g3 = gl.DataGadget(a, placement="cpu")
    g3[list(range(6)), 0] = g3.as_tensor()[:, 1]
    exp = a.copy()
    exp[:, 0] = a[:, 1]
    assert np.array_equal(g3.getNumpyVersion(), exp)


def test_bfloat16_numpy_version_is_float32_exact() -> None:
    src = torch.randn(5, 3).to(torch.bfloat16)
    g = gl.DataGadget(src, placement="cpu")
    a = g.getNumpyVersion()
    assert a.dtype == np.float32
    assert torch.equal(torch.from_numpy(a), src.float())


# ------------------------------------------------------------------------------------
# save / load, saveCupy / loadCupy
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", [".npy", ".h5", ".zarr"])
@pytest.mark.parametrize("dtype", ["float32", "int8", "bool", "float16", "int64"])
def test_save_load_round_trip(tmp_path: os.PathLike, ext: str, dtype: str) -> None:
    rng = np.random.default_rng(2)
    src = (rng.standard_normal((9, 3, 2)) * 50).astype(dtype)
    g = gl.DataGadget(src, placement="cpu")
    p = os.path.join(tmp_path, "t" + ext)
    g.save(p)
    h = gl.DataGadget((2, 2), placement="cpu")
    h.load(p)
    assert h.shape == src.shape and h.dtype == g.dtype and h.placement == "cpu"
    assert np.array_equal(h.getNumpyVersion(), src)
    assert np.array_equal(gl.DataGadget(p, placement="cpu").getNumpyVersion(), src)


def test_bfloat16_round_trip_hdf5(tmp_path: os.PathLike) -> None:
    src = torch.randn(5, 3).to(torch.bfloat16)
    g = gl.DataGadget(src, placement="cpu")
    p = os.path.join(tmp_path, "b.h5")
    g.save(p)
    h = gl.DataGadget(p, placement="cpu")
    assert h.dtype == torch.bfloat16 and torch.equal(h.as_tensor(), src)


def test_save_cupy_appends_npy_and_loads_back(tmp_path: os.PathLike, table: gl.DataGadget) -> None:
    base = os.path.join(tmp_path, "emb")
    table.saveCupy(base)
    assert os.path.exists(base + ".npy") and not os.path.exists(base)
    assert np.array_equal(np.load(base + ".npy"), REF)
    other = gl.DataGadget((1, 1), dtype="int8", placement="cpu")
    other.loadCupy(base + ".npy")
    assert other.shape == (10, 4) and other.dtype == torch.float32
    assert np.array_equal(other.getNumpyVersion(), REF)


def test_save_over_existing_is_replaced(tmp_path: os.PathLike, table: gl.DataGadget) -> None:
    p = os.path.join(tmp_path, "x.npy")
    np.save(p, np.zeros((100, 100)))
    table.save(p)
    assert np.array_equal(np.load(p), REF)


def test_load_failures_leave_table(tmp_path: os.PathLike, table: gl.DataGadget) -> None:
    good = os.path.join(tmp_path, "g.npy")
    np.save(good, REF)
    trunc = os.path.join(tmp_path, "t.npy")
    with open(good, "rb") as f:
        head = f.read()[:100]
    with open(trunc, "wb") as f:
        f.write(head)
    u32 = os.path.join(tmp_path, "u.npy")
    np.save(u32, np.ones((3, 2), np.uint32))
    table.insertData(torch.full((1, 4), 5.0), [0])
    before = table.getNumpyVersion()
    cases = [
        (lambda: table.load(os.path.join(tmp_path, "missing.npy")), gl.GadgetFileNotFoundError),
        (lambda: table.loadCupy(os.path.join(tmp_path, "missing.npy")), gl.GadgetFileNotFoundError),
        (lambda: table.load(trunc), gl.GadgetFileError),
        (lambda: table.loadCupy(trunc), gl.GadgetFileError),
        (lambda: table.load(u32), gl.GadgetTypeError),
        (lambda: table.load(None), gl.GadgetTypeError),
        (lambda: table.load(good, format="parquet"), gl.GadgetKeyError),
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
        assert table.shape == (10, 4)
        assert np.array_equal(table.getNumpyVersion(), before)


def test_save_failures(tmp_path: os.PathLike, table: gl.DataGadget) -> None:
    with pytest.raises(gl.GadgetTypeError):
        table.save(None)
    with pytest.raises(gl.GadgetKeyError):
        table.save(os.path.join(tmp_path, "x.npy"), format="parquet")
    with pytest.raises(gl.GadgetTypeError):
        table.save(os.path.join(tmp_path, "x.npy"), chunk_rows=4)
    b = gl.DataGadget(torch.zeros(2, 2, dtype=torch.bfloat16), placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        b.saveCupy(os.path.join(tmp_path, "b"))
    assert not os.path.exists(os.path.join(tmp_path, "b.npy"))
    assert not os.path.exists(os.path.join(tmp_path, "x.npy"))


def test_save_to_a_directory_named_npy_is_file_error(
    tmp_path: os.PathLike, table: gl.DataGadget
) -> None:
    # save() docstring: "GadgetFileError: path is a directory / not a regular file (.npy, HDF5)"
    d = os.path.join(tmp_path, "dir.npy")
    os.mkdir(d)
    with pytest.raises(gl.GadgetFileError):
        table.save(d)
    with pytest.raises(gl.GadgetFileError):
        table.save(tmp_path, format="npy")
    assert os.path.isdir(d)


def test_zero_row_table_save_says_why(tmp_path: os.PathLike) -> None:
    z = gl.DataGadget((0, 4), placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="zero rows"):
        z.save(os.path.join(tmp_path, "z.npy"))
    assert not os.path.exists(os.path.join(tmp_path, "z.npy"))


# ------------------------------------------------------------------------------------
# close() and with blocks
# ------------------------------------------------------------------------------------


_ROW_CALLS = {
    "getData": lambda g, p: g.getData([0]),
    "getitem": lambda g, p: g[0],
    "slice": lambda g, p: g[0:2],
    "setitem": lambda g, p: g.__setitem__(0, torch.zeros(4)),
    "insertData": lambda g, p: g.insertData(torch.zeros(4), 0),
    "load": lambda g, p: g.load(p),
    "loadCupy": lambda g, p: g.loadCupy(p),
    "save": lambda g, p: g.save(p + ".2.npy"),
    "saveCupy": lambda g, p: g.saveCupy(p + ".3"),
    "flush": lambda g, p: g.flush(),
    "getNumpyVersion": lambda g, p: g.getNumpyVersion(),
    "getNumpyVersion_nocopy": lambda g, p: g.getNumpyVersion(copy=False),
    "as_tensor": lambda g, p: g.as_tensor(),
    "zero_": lambda g, p: g.zero_(),
    "fill_": lambda g, p: g.fill_(1),
    "uniform_": lambda g, p: g.uniform_(),
    "normal_": lambda g, p: g.normal_(),
    "init_": lambda g, p: g.init_(torch.nn.init.zeros_),
    "gadgetInit": lambda g, p: g.gadgetInit(),
    "gather_many": lambda g, p: gl.gather_many([g], [0]),
    "scatter_many": lambda g, p: gl.scatter_many([g], [torch.zeros(1, 4)], [0]),
}


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("name", sorted(_ROW_CALLS))
def test_closed_table_raises_closed_error(tmp_path: os.PathLike, placement: str, name: str) -> None:
    p = os.path.join(tmp_path, "c.npy")
    np.save(p, REF)
    g = gl.DataGadget(p, placement=placement)
    g.close()
    g.close()  # idempotent
    with pytest.raises(gl.GadgetClosedError) as e:
        _ROW_CALLS[name](g, p)
    assert isinstance(e.value, RuntimeError)
    assert not os.path.exists(p + ".2.npy") and not os.path.exists(p + ".3.npy")
    # facts still answer
    assert g.shape == (10, 4) and g.dtype == torch.float32 and len(g) == 10
    assert "closed" in repr(g)
    assert np.array_equal(np.load(p), REF)


def test_with_block_closes_even_on_error() -> None:
    with pytest.raises(RuntimeError, match="boom"), gl.DataGadget(REF, placement="cpu") as g:
        assert g[1].tolist() == REF[1].tolist()
        raise RuntimeError("boom")
    with pytest.raises(gl.GadgetClosedError):
        g[0]
    assert len(g) == 10


def test_with_returns_the_gadget() -> None:
    g = gl.DataGadget(REF, placement="cpu")
    with g as same:
        assert same is g


# ------------------------------------------------------------------------------------
# the Errors section: hierarchy
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (gl.GadgetIndexError, IndexError),
        (gl.GadgetTypeError, TypeError),
        (gl.GadgetValueError, ValueError),
        (gl.GadgetKeyError, KeyError),
        (gl.GadgetFileNotFoundError, FileNotFoundError),
        (gl.GadgetFileError, OSError),
        (gl.ReadOnlyError, PermissionError),
        (gl.GadgetClosedError, RuntimeError),
        (gl.MissingDependencyError, ImportError),
    ],
)
def test_error_classes_derive_from_gadget_error_and_builtin(cls: type, builtin: type) -> None:
    assert issubclass(cls, gl.GadgetError)
    assert issubclass(cls, builtin)


def test_key_error_message_readable() -> None:
    with pytest.raises(gl.GadgetKeyError) as e:
        gl.DataGadget((3, 2), placement="nowhere")
    assert not str(e.value).startswith('"')


def test_unknown_dataset_is_key_error_listing_names(tmp_path: os.PathLike) -> None:
    p = os.path.join(tmp_path, "d.h5")
    gl.DataGadget(REF, placement="cpu").save(p, dataset="emb")
    with pytest.raises(gl.GadgetKeyError) as e:
        gl.DataGadget(p, placement="cpu", dataset="nope")
    assert "emb" in str(e.value)


def test_path_none_is_type_error() -> None:
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(REF, placement="cpu").save(None)


def test_tensor_fits_shape_not_dtype_is_type_error(tmp_path: os.PathLike) -> None:
    # "a file or tensor that fits a table's shape but not its dtype" -> GadgetTypeError
    p = os.path.join(tmp_path, "i.npy")
    np.save(p, REF.astype(np.int32))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(p, placement="cpu", dtype="float32")


def test_torch_init_called_on_the_table_itself() -> None:
    # DataGadget.dim() docstring: torch.nn.init functions that read fans fill the table in
    # place; those needing more of a tensor are refused with GadgetTypeError
    g = gl.DataGadget((50, 20), placement="cpu")
    torch.nn.init.xavier_uniform_(g)
    a = g.getNumpyVersion()
    bound = (6 / 70) ** 0.5
    assert np.abs(a).max() <= bound and np.abs(a).max() > bound * 0.9
    before = g.getNumpyVersion()
    for fn in (torch.nn.init.trunc_normal_, torch.nn.init.orthogonal_):
        with pytest.raises(gl.GadgetTypeError):
            fn(g)
        assert np.array_equal(g.getNumpyVersion(), before)
    assert (g.dim(), g.ndim, tuple(g.size()), g.size(-1), g.numel()) == (2, 2, (50, 20), 20, 1000)
    with pytest.raises(gl.GadgetIndexError):
        g.size(2)


@pytest.mark.parametrize("bad", ["False", "no", None, 2, 0.0])
def test_row_call_flags_refuse_non_bools(table: gl.DataGadget, bad: object) -> None:
    """check_ids= and copy= take True/False (or 1/0) like CPUPinn: bool("False") is True,
    so a string would silently mean the opposite; refused, nothing written."""
    b = gl.DataGadget(REF.copy(), placement="cpu")
    calls = [
        lambda: table.getData([1], check_ids=bad),
        lambda: table.insertData(torch.zeros(1, 4), [1], check_ids=bad),
        lambda: gl.gather_many([table, b], [1], check_ids=bad),
        lambda: gl.scatter_many([table, b], [torch.zeros(1, 4)] * 2, [1], check_ids=bad),
        lambda: table.getNumpyVersion(copy=bad),
    ]
    for call in calls:
        with pytest.raises(gl.GadgetTypeError, match="must be True or False"):
            call()
    assert np.array_equal(table.getNumpyVersion(), REF)
    assert np.array_equal(b.getNumpyVersion(), REF)
    # 1/0 and NumPy bools still work
    assert table.getData([1], check_ids=1).tolist() == [REF[1].tolist()]
    assert table.getNumpyVersion(copy=np.bool_(False)).base is not None


def test_strategy_names_are_case_insensitive_and_typed() -> None:
    g = gl.DataGadget(REF.copy(), placement="cpu", strategy="SORTED")
    assert np.array_equal(g[[3, 1]].numpy(), REF[[3, 1]])
    with pytest.raises(gl.GadgetTypeError, match="strategy must be a name"):
        gl.DataGadget(REF.copy(), placement="cpu", strategy=None)
    with pytest.raises(gl.GadgetKeyError, match="Unknown strategy 'fast'"):
        gl.DataGadget(REF.copy(), placement="cpu", strategy="Fast")


def test_torch_init_that_would_fill_then_fail_is_refused_first() -> None:
    """A torch.nn.init function other than the fan-based ones that reaches the table's
    uniform_ / normal_ (torch 2.4's trunc_normal_ draws uniformly, then calls erfinv_,
    which a table lacks) is refused before anything is written. Simulated on any torch by
    a function of torch/nn/init.py's own namespace."""
    g = gl.DataGadget(np.full((8, 6), 7.0, np.float32), placement="cpu")
    src = "def _no_grad_trunc_normal_(t):\n    t.uniform_(-1.0, 1.0)\n    t.erfinv_()\n"
    ns: dict = {}
    exec(compile(src, torch.nn.init.__file__, "exec"), ns)
    with pytest.raises(gl.GadgetTypeError, match=r"torch\.nn\.init\.trunc_normal_ needs more"):
        ns["_no_grad_trunc_normal_"](g)
    assert (g.getNumpyVersion() == 7.0).all()
    with pytest.raises(gl.GadgetTypeError):
        torch.nn.init.trunc_normal_(g)  # (torch 2.13 fails before: no is_meta)
    assert (g.getNumpyVersion() == 7.0).all()
    torch.nn.init.kaiming_uniform_(g)  # the fan-based ones still fill the table in place
    assert not (g.getNumpyVersion() == 7.0).any()
