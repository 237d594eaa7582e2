"""Black-box review (session 30) of ``gl.gather_many`` / ``gl.scatter_many``, the README's
"Interleaved tables" paragraph and the other public names of the "Rows in and out"
section; written from README.md, SPEC.md and the public docstrings only.

Everything runs on the ``cpu`` placement and on ``file`` tables (.npy, HDF5, zarr), with
NumPy arrays as the reference.
"""

from __future__ import annotations

import copy
import glob
import os
import pickle

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


h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

N = 12  # rows of every table in a group


# --------------------------------------------------------------------------- helpers


def _ref_tables(seed: int = 0) -> list[np.ndarray]:
    """Tables of one row count and mixed dtypes / row shapes."""
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((N, 4)).astype(np.float32),
        rng.integers(-1000, 1000, size=(N, 2, 3)).astype(np.int16),
        (rng.integers(0, 2, size=N) == 1),  # bool labels, scalar rows
        rng.standard_normal((N, 3)).astype(np.float64),
        rng.integers(0, 255, size=(N, 5)).astype(np.uint8),
    ]


def _cpu_group(seed: int = 0):
    refs = _ref_tables(seed)
    return [gl.DataGadget(r.copy(), placement="cpu") for r in refs], refs


def _snapshot(tables):
    return [t.getNumpyVersion().copy() for t in tables]


def _assert_unchanged(tables, snaps):
    for k, (t, s) in enumerate(zip(tables, snaps, strict=True)):
        assert np.array_equal(t.getNumpyVersion(), s), f"table {k} changed by a refused call"


def _np_ids(ids):
    """NumPy reference index for the id forms the docs allow."""
    if isinstance(ids, slice):
        return ids
    if isinstance(ids, torch.Tensor):
        return ids.numpy().astype(np.int64)
    if isinstance(ids, range):
        return np.asarray(list(ids), dtype=np.int64)
    return np.asarray(ids).astype(np.int64)


def _ref_scatter(ref: np.ndarray, rows: np.ndarray, ids) -> np.ndarray:
    """NumPy's sequential assignment: a repeated id keeps its last occurrence."""
    out = ref.copy()
    idx = _np_ids(ids)
    if isinstance(idx, slice):
        out[idx] = rows
        return out
    flat = idx.reshape(-1)
    rflat = rows.reshape((flat.size,) + ref.shape[1:])
    for i, r in zip(flat, rflat, strict=True):
        out[i] = r
    return out


def _rows_for(refs, ids, seed=1):
    rng = np.random.default_rng(seed)
    idx = _np_ids(ids)
    lead = np.empty(N)[idx].shape if isinstance(idx, slice) else idx.shape
    rows = []
    for r in refs:
        shape = lead + r.shape[1:]
        if r.dtype == np.bool_:
            rows.append(rng.integers(0, 2, size=shape) == 1)
        elif np.issubdtype(r.dtype, np.floating):
            rows.append(rng.standard_normal(shape).astype(r.dtype))
        else:
            info = np.iinfo(r.dtype)
            rows.append(
                rng.integers(max(info.min, -500), min(info.max, 500), size=shape).astype(r.dtype)
            )
    return rows


ID_FORMS = {
    "list": [3, 0, 11, 3],
    "tuple_of_ints": (5, 5, 1),
    "range": range(2, 9, 3),
    "np_int8": np.array([7, 1, 7], dtype=np.int8),
    "np_uint8": np.array([0, 11], dtype=np.uint8),
    "np_int16": np.array([4, 4, 4], dtype=np.int16),
    "np_int32": np.array([[1, 2], [10, 2]], dtype=np.int32),
    "np_uint64": np.array([6, 9], dtype=np.uint64),
    "torch_int8": torch.tensor([2, 8, 2], dtype=torch.int8),
    "torch_uint8": torch.tensor([11, 0], dtype=torch.uint8),
    "torch_int32": torch.tensor([9, 3], dtype=torch.int32),
    "torch_int64_2d": torch.tensor([[0, 1, 0], [11, 11, 5]]),
    "empty": np.array([], dtype=np.int64),
    "empty_2d": torch.zeros((0, 3), dtype=torch.int64),
    "slice": slice(2, 7),
    "slice_step": slice(1, None, 4),
    "slice_neg_start": slice(-3, None),
    "slice_reverse": slice(10, 2, -3),
    "slice_past_end": slice(8, 100),
    "slice_empty": slice(5, 5),
}


# ------------------------------------------------------------------ gather_many (cpu)


@pytest.mark.parametrize("form", list(ID_FORMS))
def test_gather_many_matches_numpy_for_every_id_form(form):
    ids = ID_FORMS[form]
    tables, refs = _cpu_group()
    got = gl.gather_many(tables, ids)
    assert isinstance(got, list) and len(got) == len(tables)
    idx = _np_ids(ids)
    for t, g, r in zip(tables, got, refs, strict=True):
        exp = r[idx]
        assert g.dtype == t.dtype
        assert tuple(g.shape) == exp.shape
        assert np.array_equal(g.numpy(), exp)


@pytest.mark.parametrize("ids", [4, np.int64(7), torch.tensor(11)])
def test_gather_many_scalar_id_gives_one_row_without_leading_axis(ids):
    tables, refs = _cpu_group()
    got = gl.gather_many(tables, ids)
    for g, r in zip(got, refs, strict=True):
        assert tuple(g.shape) == r.shape[1:]
        assert np.array_equal(g.numpy(), r[int(ids)])


def test_gather_many_equals_getData_per_table_and_tuple_of_tables():
    tables, _ = _cpu_group()
    ids = torch.tensor([[5, 0], [5, 11]])
    many = gl.gather_many(tuple(tables), ids)
    for t, g in zip(tables, many, strict=True):
        assert torch.equal(g, t.getData(ids))


def test_gather_many_result_is_a_copy_not_a_view():
    tables, refs = _cpu_group()
    got = gl.gather_many(tables, [1, 2])
    got[0].fill_(123.0)
    assert np.array_equal(tables[0].getNumpyVersion(), refs[0])


def test_gather_many_device_cpu_explicit():
    tables, refs = _cpu_group()
    got = gl.gather_many(tables, [3, 4], device="cpu")
    for g, r in zip(got, refs, strict=True):
        assert g.device.type == "cpu"
        assert np.array_equal(g.numpy(), r[[3, 4]])


@pytest.mark.parametrize("flag", [True, False, 1, 0])
def test_gather_many_check_ids_accepts_bools_and_01(flag):
    tables, refs = _cpu_group()
    got = gl.gather_many(tables, [2], check_ids=flag)
    assert np.array_equal(got[0].numpy(), refs[0][[2]])


@pytest.mark.parametrize("flag", ["False", "True", None, 2])
def test_gather_many_check_ids_refuses_non_bool(flag):
    tables, _ = _cpu_group()
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many(tables, [2], check_ids=flag)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("ids", [[1, N], [-1, 2], torch.tensor([0, N + 5])])
def test_gather_many_bad_cpu_ids_always_checked(ids, check):
    # "CPU ids are always checked" -- also with check_ids=False.
    tables, _ = _cpu_group()
    with pytest.raises(gl.GadgetIndexError) as ei:
        gl.gather_many(tables, ids, check_ids=check)
    assert isinstance(ei.value, IndexError)
    assert str(N) in str(ei.value)


@pytest.mark.parametrize(
    "ids, frag",
    [
        ([1.0, 2.0], "integer"),
        (np.array([1.5]), "integer"),
        (torch.tensor([True, False]), "nonzero"),
        ("3", None),
        (None, None),
    ],
)
def test_gather_many_bad_id_types(ids, frag):
    tables, _ = _cpu_group()
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.gather_many(tables, ids)
    assert isinstance(ei.value, TypeError)
    if frag:
        assert frag in str(ei.value)


def test_gather_many_different_row_counts_refused():
    a = gl.DataGadget(np.zeros((N, 2), np.float32), placement="cpu")
    b = gl.DataGadget(np.zeros((N + 1, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.gather_many([a, b], [0])
    assert isinstance(ei.value, ValueError)
    assert str(N) in str(ei.value) and str(N + 1) in str(ei.value)


@pytest.mark.parametrize(
    "tables",
    ["empty", "one", "not_gadget_array", "not_gadget_tensor", "none_in_list"],
)
def test_gather_many_refuses_non_lists_of_gadgets(tables):
    g = gl.DataGadget(np.zeros((N, 2), np.float32), placement="cpu")
    arg = {
        "one": g,
        "not_gadget_array": [g, np.zeros((N, 2))],
        "not_gadget_tensor": [g, torch.zeros(N, 2)],
        "none_in_list": [g, None],
        "empty": [],
    }[tables]
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many(arg, [0])


@pytest.mark.parametrize("idx", [(slice(0, 3), slice(0, 2)), ([1, 2], 0), (slice(None), 1)])
def test_gather_many_refuses_index_into_rows(idx):
    tables, _ = _cpu_group()
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many(tables, idx)


def test_gather_many_closed_table():
    tables, _ = _cpu_group()
    tables[2].close()
    with pytest.raises(gl.GadgetClosedError):
        gl.gather_many(tables, [0, 1])


def test_gather_many_same_table_twice():
    tables, refs = _cpu_group()
    a, b = gl.gather_many([tables[0], tables[0]], [4, 1])
    assert np.array_equal(a.numpy(), refs[0][[4, 1]])
    assert np.array_equal(b.numpy(), refs[0][[4, 1]])
    a.zero_()
    assert np.array_equal(b.numpy(), refs[0][[4, 1]]), "two results share memory"


# ----------------------------------------------------------------- scatter_many (cpu)


SCATTER_FORMS = [
    "list",
    "tuple_of_ints",
    "range",
    "np_int8",
    "np_int32",
    "np_uint64",
    "torch_int8",
    "torch_int64_2d",
    "empty",
    "empty_2d",
    "slice",
    "slice_step",
    "slice_neg_start",
    "slice_reverse",
    "slice_past_end",
]


@pytest.mark.parametrize("form", SCATTER_FORMS)
def test_scatter_many_matches_numpy_last_writer(form):
    ids = ID_FORMS[form]
    tables, refs = _cpu_group()
    rows = _rows_for(refs, ids)
    gl.scatter_many(tables, [torch.from_numpy(r.copy()) for r in rows], ids)
    for k, (t, ref, r) in enumerate(zip(tables, refs, rows, strict=True)):
        assert np.array_equal(t.getNumpyVersion(), _ref_scatter(ref, r, ids)), f"table {k}"


def test_scatter_many_repeated_ids_last_occurrence_in_every_table():
    tables, refs = _cpu_group()
    ids = [2, 7, 2, 2, 7, 0]
    rows = _rows_for(refs, ids, seed=5)
    gl.scatter_many(tables, [torch.from_numpy(r) for r in rows], ids)
    for t, r in zip(tables, rows, strict=True):
        got = t.getNumpyVersion()
        assert np.array_equal(got[2], r[3])
        assert np.array_equal(got[7], r[4])
        assert np.array_equal(got[0], r[5])


@pytest.mark.parametrize("kind", ["numpy", "tuple", "mixed"])
def test_scatter_many_row_containers(kind):
    tables, refs = _cpu_group()
    ids = torch.tensor([1, 9])
    rows = _rows_for(refs, ids, seed=3)
    if kind == "numpy":
        arg = rows
    elif kind == "tuple":
        arg = tuple(torch.from_numpy(r) for r in rows)
    else:
        arg = [torch.from_numpy(r) if i % 2 else r for i, r in enumerate(rows)]
    gl.scatter_many(tables, arg, ids)
    for t, ref, r in zip(tables, refs, rows, strict=True):
        assert np.array_equal(t.getNumpyVersion(), _ref_scatter(ref, r, ids))


def test_scatter_many_copies_data_in_and_detaches():
    g = gl.DataGadget(np.zeros((N, 3), np.float32), placement="cpu")
    h = gl.DataGadget(np.zeros((N, 3), np.float32), placement="cpu")
    src = torch.ones(2, 3, requires_grad=True)
    src2 = torch.full((2, 3), 2.0)
    gl.scatter_many([g, h], [src, src2], [4, 5])
    with torch.no_grad():
        src.mul_(10)
    src2.mul_(10)
    assert np.array_equal(g.getNumpyVersion()[4:6], np.ones((2, 3), np.float32))
    assert np.array_equal(h.getNumpyVersion()[4:6], np.full((2, 3), 2.0, np.float32))


def test_scatter_many_non_contiguous_rows():
    tables, refs = _cpu_group()
    t = tables[0]
    src = torch.arange(32, dtype=torch.float32).reshape(4, 8)[:, ::2]  # (4, 4), strided
    gl.scatter_many([t], [src], [0, 3, 6, 9])
    exp = refs[0].copy()
    exp[[0, 3, 6, 9]] = src.numpy()
    assert np.array_equal(t.getNumpyVersion(), exp)


# ---- refused scatters: right error, nothing written in ANY table


def _bad_rows_case(case, tables, refs):
    ids = [0, 5, 11]
    good = [torch.from_numpy(r) for r in _rows_for(refs, ids, seed=9)]
    if case == "dtype_last":
        rows = good[:-1] + [good[-1].to(torch.int64)]
        return rows, ids, gl.GadgetTypeError, "uint8"
    if case == "float64_into_float32_first":
        rows = [good[0].double()] + good[1:]
        return rows, ids, gl.GadgetTypeError, "float64"
    if case == "shape_middle":
        rows = list(good)
        rows[2] = rows[2][:2]
        return rows, ids, gl.GadgetValueError, None
    if case == "row_shape_middle":
        rows = list(good)
        rows[1] = rows[1].reshape(3, 3, 2)
        return rows, ids, gl.GadgetValueError, None
    if case == "too_few_rows":
        return good[:-1], ids, gl.GadgetValueError, None
    if case == "too_many_rows":
        return good + [good[0]], ids, gl.GadgetValueError, None
    if case == "id_out_of_range":
        return good, [0, 5, N], gl.GadgetIndexError, str(N)
    if case == "id_negative":
        return good, [0, -1, 11], gl.GadgetIndexError, None
    if case == "float_ids":
        return good, [0.0, 5.0, 11.0], gl.GadgetTypeError, None
    if case == "bool_ids":
        return good, torch.tensor([True, False, True]), gl.GadgetTypeError, None
    if case == "index_into_rows":
        return good, (slice(0, 3), 0), gl.GadgetTypeError, None
    if case == "python_list_rows":
        rows = list(good)
        rows[0] = rows[0].tolist()
        return rows, ids, gl.GadgetTypeError, None
    raise AssertionError(case)


BAD_CASES = [
    "dtype_last",
    "float64_into_float32_first",
    "shape_middle",
    "row_shape_middle",
    "too_few_rows",
    "too_many_rows",
    "id_out_of_range",
    "id_negative",
    "float_ids",
    "bool_ids",
    "index_into_rows",
    "python_list_rows",
]

_BUILTIN = {
    gl.GadgetTypeError: TypeError,
    gl.GadgetValueError: ValueError,
    gl.GadgetIndexError: IndexError,
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_scatter_many_refused_changes_nothing(case):
    tables, refs = _cpu_group()
    snaps = _snapshot(tables)
    rows, ids, exc, frag = _bad_rows_case(case, tables, refs)
    with pytest.raises(exc) as ei:
        gl.scatter_many(tables, rows, ids)
    assert isinstance(ei.value, gl.GadgetError) and isinstance(ei.value, _BUILTIN[exc])
    if frag:
        assert frag in str(ei.value)
    _assert_unchanged(tables, snaps)


def test_scatter_many_float64_message_names_both_dtypes():
    tables, refs = _cpu_group()
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.scatter_many(tables[:1], [torch.zeros(1, 4, dtype=torch.float64)], [0])
    msg = str(ei.value)
    assert "float32" in msg and "float64" in msg


def test_scatter_many_different_row_counts_refused_unchanged():
    a = gl.DataGadget(np.arange(N * 2, dtype=np.float32).reshape(N, 2), placement="cpu")
    b = gl.DataGadget(np.arange((N - 1) * 2, dtype=np.float32).reshape(N - 1, 2), placement="cpu")
    snaps = _snapshot([a, b])
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many([a, b], [torch.zeros(1, 2), torch.zeros(1, 2)], [0])
    _assert_unchanged([a, b], snaps)


@pytest.mark.parametrize("pos", [0, 2, 4])
def test_scatter_many_closed_table_refused_others_unchanged(pos):
    tables, refs = _cpu_group()
    tables[pos].close()
    live = [t for i, t in enumerate(tables) if i != pos]
    snaps = _snapshot(live)
    rows = [torch.from_numpy(r) for r in _rows_for(refs, [1, 2])]
    with pytest.raises(gl.GadgetClosedError):
        gl.scatter_many(tables, rows, [1, 2])
    _assert_unchanged(live, snaps)


@pytest.mark.parametrize("flag", ["False", None])
def test_scatter_many_check_ids_refuses_non_bool_unchanged(flag):
    tables, refs = _cpu_group()
    snaps = _snapshot(tables)
    rows = [torch.from_numpy(r) for r in _rows_for(refs, [1])]
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(tables, rows, [1], check_ids=flag)
    _assert_unchanged(tables, snaps)


def test_scatter_many_check_ids_false_cpu_ids_still_checked():
    tables, refs = _cpu_group()
    snaps = _snapshot(tables)
    rows = [torch.from_numpy(r) for r in _rows_for(refs, [1, 2])]
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(tables, rows, [1, N + 3], check_ids=False)
    _assert_unchanged(tables, snaps)


# ------------------------------------------------------------------------ file tables


@pytest.fixture
def files(tmp_path):
    """A .npy, an HDF5 (gzip, chunked) and a zarr (zstd, 2-row chunks) file of N rows."""
    rng = np.random.default_rng(42)
    a = rng.standard_normal((N, 4)).astype(np.float32)
    b = rng.integers(-100, 100, size=(N, 3)).astype(np.int32)
    c = rng.standard_normal((N, 2)).astype(np.float64)
    np.save(tmp_path / "a.npy", a)
    gl.DataGadget(b.copy(), placement="cpu").save(
        str(tmp_path / "b.h5"), dataset="emb", chunk_rows=2, compression="gzip"
    )
    gl.DataGadget(c.copy(), placement="cpu").save(str(tmp_path / "c.zarr"), chunk_rows=2)
    return tmp_path, [a, b, c]


def _open_files(path, **kw):
    return [
        gl.DataGadget(str(path / "a.npy"), placement="file", **kw),
        gl.DataGadget(str(path / "b.h5"), placement="file", **kw),
        gl.DataGadget(str(path / "c.zarr"), placement="file", **kw),
    ]


def _read_files(path):
    a = np.load(path / "a.npy")
    with h5py.File(path / "b.h5", "r") as f:
        b = f["emb"][...]
    c = zarr.open(str(path / "c.zarr"), mode="r")[...]
    return [a, b, c]


@pytest.mark.parametrize(
    "form", ["list", "np_int32", "torch_int64_2d", "slice_step", "empty", "slice_reverse"]
)
def test_gather_many_file_tables_match_numpy(files, form):
    path, refs = files
    ids = ID_FORMS[form]
    tables = _open_files(path)
    cpu = gl.DataGadget(refs[0] * 2, placement="cpu")
    got = gl.gather_many(tables + [cpu], ids)
    idx = _np_ids(ids)
    for g, r in zip(got, refs + [refs[0] * 2], strict=True):
        assert np.array_equal(g.numpy(), r[idx])
    for t in tables:
        t.close()


@pytest.mark.parametrize("form", ["list", "np_int8", "torch_int64_2d", "slice", "slice_neg_start"])
def test_scatter_many_file_tables_write_through(files, form):
    path, refs = files
    ids = ID_FORMS[form]
    tables = _open_files(path)
    cpu = gl.DataGadget(refs[2].copy(), placement="cpu")
    rows = _rows_for(refs + [refs[2]], ids, seed=11)
    gl.scatter_many(tables + [cpu], [torch.from_numpy(r) for r in rows], ids)
    exp = [
        _ref_scatter(ref, r, ids) for ref, r in zip(refs, rows, strict=False)
    ]  # (rows has one more: the cpu table's)
    # the tables themselves
    for t, e in zip(tables, exp, strict=True):
        assert np.array_equal(t.getNumpyVersion(), e)
    assert np.array_equal(cpu.getNumpyVersion(), _ref_scatter(refs[2], rows[3], ids))
    for t in tables:
        t.close()
    # and the files on disk
    for k, (got, e) in enumerate(zip(_read_files(path), exp, strict=True)):
        assert np.array_equal(got, e), f"file {k}"


def test_scatter_many_file_repeated_ids_reach_disk(files):
    path, refs = files
    tables = _open_files(path)
    ids = [3, 3, 4, 3]
    rows = _rows_for(refs, ids, seed=2)
    gl.scatter_many(tables, rows, ids)
    for t in tables:
        t.flush()
    for got, r in zip(_read_files(path), rows, strict=True):
        assert np.array_equal(got[3], r[3])
        assert np.array_equal(got[4], r[2])
    for t in tables:
        t.close()


@pytest.mark.parametrize("ro_pos", [0, 1, 2])
def test_scatter_many_read_only_file_refused_nothing_written(files, ro_pos):
    path, refs = files
    tables = _open_files(path)
    tables[ro_pos].close()
    names = ["a.npy", "b.h5", "c.zarr"]
    tables[ro_pos] = gl.DataGadget(str(path / names[ro_pos]), placement="file", writable=False)
    cpu = gl.DataGadget(refs[0].copy(), placement="cpu")
    group = [cpu] + tables
    snaps = _snapshot(group)
    rows = [torch.from_numpy(r) for r in _rows_for([refs[0]] + refs, [0, 7])]
    with pytest.raises(gl.ReadOnlyError) as ei:
        gl.scatter_many(group, rows, [0, 7])
    assert isinstance(ei.value, PermissionError)
    assert f"table {ro_pos + 1}" in str(ei.value) or names[ro_pos] in str(ei.value)
    _assert_unchanged(group, snaps)
    for t in tables:
        t.close()
    for got, r in zip(_read_files(path), refs, strict=True):
        assert np.array_equal(got, r)


def test_scatter_many_damaged_zarr_chunk_refused_no_table_changed(files):
    path, refs = files
    # rows 4 and 5 live in chunk c/2/0 of the 2-row-chunk zarr store
    chunk = [
        p
        for p in glob.glob(str(path / "c.zarr" / "**"), recursive=True)
        if p.endswith(os.sep + os.path.join("c", "2", "0"))
    ]
    assert chunk, "test setup: chunk file not found"
    with open(chunk[0], "wb") as f:
        f.write(b"\x00garbage, not zstd\xff" * 3)
    tables = _open_files(path)
    cpu = gl.DataGadget(refs[0].copy(), placement="cpu")
    group = [cpu, tables[0], tables[1], tables[2]]
    snaps = [cpu.getNumpyVersion().copy(), refs[0].copy(), refs[1].copy()]
    ids = [1, 4]  # row 4 partly rewrites the damaged chunk (row 5 is kept)
    rows = [torch.from_numpy(r) for r in _rows_for([refs[0]] + refs, ids)]
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.scatter_many(group, rows, ids)
    assert "table 3" in str(ei.value) or "c.zarr" in str(ei.value)
    _assert_unchanged(group[:3], snaps)
    for t in tables:
        t.close()
    assert np.array_equal(np.load(path / "a.npy"), refs[0])
    with h5py.File(path / "b.h5", "r") as f:
        assert np.array_equal(f["emb"][...], refs[1])


def test_gather_scatter_many_mixed_placement_file_cpu_different_dtypes(files):
    path, refs = files
    tables = _open_files(path)
    extra = gl.DataGadget(np.arange(N, dtype=np.int8), placement="cpu")
    group = [tables[2], extra, tables[0]]
    ids = torch.tensor([[11, 0], [6, 11]])
    got = gl.gather_many(group, ids)
    assert np.array_equal(got[0].numpy(), refs[2][ids.numpy()])
    assert np.array_equal(got[1].numpy(), np.arange(N, dtype=np.int8)[ids.numpy()])
    assert np.array_equal(got[2].numpy(), refs[0][ids.numpy()])
    for t in tables:
        t.close()


# -------------------------------------------------------------------- interleaved tables


OPTIMS = {
    "adam": (torch.optim.Adam, {"lr": 0.1}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "rmsprop_centered_mom": (torch.optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.9}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _interleaved(opt_name="adam", rows=N, dim=4, seed=0):
    torch.manual_seed(seed)
    emb = gl.OffloadedEmbedding(rows, dim, placement="cpu", device="cpu")
    cls, kw = OPTIMS[opt_name]
    opt = gl.OffloadedOptimizer(cls, emb, **kw)
    # one step so that the state tables hold something other than their initial values
    emb(torch.tensor([1, 2, 2, 5, rows - 1])).pow(2).sum().backward()
    opt.step()
    states = list(opt.pagers[0].tables.values())
    return emb, opt, [emb.weight] + states


def test_interleaved_state_tables_are_strided_views():
    emb, opt, tabs = _interleaved("adam")
    assert len(tabs) == 3
    for t in tabs:
        assert t.shape == (N, 4) and t.placement == "cpu"
    # "row i of each side by side": a row of each table lies 3 * 4 floats after the last
    for t in tabs:
        assert t.as_tensor().stride() == (12, 1)


@pytest.mark.parametrize("opt_name", list(OPTIMS))
@pytest.mark.parametrize("form", ["list", "torch_int64_2d", "slice_step", "empty"])
def test_interleaved_gather_many_matches_per_table(opt_name, form):
    emb, opt, tabs = _interleaved(opt_name)
    ids = ID_FORMS[form]
    refs = [t.getNumpyVersion() for t in tabs]
    got = gl.gather_many(tabs, ids)
    idx = _np_ids(ids)
    for k, (g, r, t) in enumerate(zip(got, refs, tabs, strict=True)):
        assert np.array_equal(g.numpy(), r[idx]), f"table {k}"
        assert torch.equal(g, t.getData(ids))


@pytest.mark.parametrize("opt_name", list(OPTIMS))
@pytest.mark.parametrize("form", ["list", "torch_int64_2d", "slice", "np_int16"])
def test_interleaved_scatter_many_whole_wide_rows(opt_name, form):
    emb, opt, tabs = _interleaved(opt_name)
    ids = ID_FORMS[form]
    refs = [t.getNumpyVersion().copy() for t in tabs]
    rows = _rows_for(refs, ids, seed=21)
    gl.scatter_many(tabs, [torch.from_numpy(r) for r in rows], ids)
    for k, (t, ref, r) in enumerate(zip(tabs, refs, rows, strict=True)):
        assert np.array_equal(t.getNumpyVersion(), _ref_scatter(ref, r, ids)), f"table {k}"


@pytest.mark.parametrize("subset", [(0, 1), (1, 2), (2, 0), (1,), (2,), (0, 2), (2, 1, 0)])
def test_interleaved_scatter_many_subset_leaves_other_tables(subset):
    emb, opt, tabs = _interleaved("adam")
    refs = [t.getNumpyVersion().copy() for t in tabs]
    ids = [3, 0, 3, 11]
    chosen = [tabs[i] for i in subset]
    rows = _rows_for([refs[i] for i in subset], ids, seed=7)
    gl.scatter_many(chosen, [torch.from_numpy(r) for r in rows], ids)
    for i, t in enumerate(tabs):
        if i in subset:
            r = rows[subset.index(i)]
            exp = _ref_scatter(refs[i], r, ids)
        else:
            exp = refs[i]
        assert np.array_equal(t.getNumpyVersion(), exp), f"table {i}"
    got = gl.gather_many(chosen, ids)
    for i, g in zip(subset, got, strict=True):
        assert np.array_equal(g.numpy(), tabs[i].getNumpyVersion()[ids])


@pytest.mark.parametrize(
    "case", ["dtype_last", "shape_middle", "id_out_of_range", "id_negative", "too_few_rows"]
)
def test_interleaved_scatter_many_refused_changes_nothing(case):
    emb, opt, tabs = _interleaved("adam_amsgrad")
    snaps = _snapshot(tabs)
    ids = [0, 5, 11]
    good = [torch.from_numpy(r) for r in _rows_for(snaps, ids, seed=4)]
    rows = list(good)
    exc = gl.GadgetError
    if case == "dtype_last":
        rows[-1] = rows[-1].double()
        exc = gl.GadgetTypeError
    elif case == "shape_middle":
        rows[1] = rows[1][:2]
        exc = gl.GadgetValueError
    elif case == "id_out_of_range":
        ids = [0, 5, N]
        exc = gl.GadgetIndexError
    elif case == "id_negative":
        ids = [0, -5, 1]
        exc = gl.GadgetIndexError
    elif case == "too_few_rows":
        rows = rows[:-1]
        exc = gl.GadgetValueError
    with pytest.raises(exc):
        gl.scatter_many(tabs, rows, ids)
    _assert_unchanged(tabs, snaps)


def test_interleaved_tables_of_two_optimizers_mixed_with_plain_and_file(tmp_path):
    e1, o1, t1 = _interleaved("adam", seed=1)
    e2, o2, t2 = _interleaved("adagrad", seed=2)
    plain = gl.DataGadget(np.arange(N * 2, dtype=np.int64).reshape(N, 2), placement="cpu")
    np.save(tmp_path / "f.npy", np.arange(N * 3, dtype=np.float32).reshape(N, 3))
    ft = gl.DataGadget(str(tmp_path / "f.npy"), placement="file")
    group = [t1[2], t2[0], plain, t1[0], ft, t2[1], t1[1]]
    refs = [t.getNumpyVersion().copy() for t in group]
    ids = torch.tensor([11, 4, 4, 0])
    got = gl.gather_many(group, ids)
    for g, r in zip(got, refs, strict=True):
        assert np.array_equal(g.numpy(), r[ids.numpy()])
    rows = _rows_for(refs, ids, seed=8)
    gl.scatter_many(group, [torch.from_numpy(r) for r in rows], ids)
    for k, (t, ref, r) in enumerate(zip(group, refs, rows, strict=True)):
        assert np.array_equal(t.getNumpyVersion(), _ref_scatter(ref, r, ids)), f"table {k}"
    ft.close()
    assert np.array_equal(np.load(tmp_path / "f.npy"), _ref_scatter(refs[4], rows[4], ids))


def test_interleaving_keeps_values_and_object_and_detaches_old_views():
    torch.manual_seed(3)
    emb = gl.OffloadedEmbedding(N, 4, placement="cpu", device="cpu")
    w = emb.weight
    before = w.getNumpyVersion().copy()
    old_view = w.as_tensor()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    assert emb.weight is w  # "stays the same object"
    assert np.array_equal(w.getNumpyVersion(), before)  # copied once, values kept
    w.insertData(torch.full((1, 4), 9.0), [0])
    assert np.array_equal(old_view.numpy(), before)  # earlier views no longer see it
    old_view[1] = -1.0
    assert np.array_equal(w.getNumpyVersion()[1], before[1])
    del opt


@pytest.mark.parametrize(
    "init",
    [
        lambda w: w.fill_(7.0),
        lambda w: w.zero_(),
        lambda w: w.normal_(0.0, 2.0),
        lambda w: w.uniform_(-1.0, 1.0),
        lambda w: w.init_(torch.nn.init.xavier_uniform_),
        lambda w: w.init_(torch.nn.init.constant_, 0.25),
        lambda w: torch.nn.init.kaiming_normal_(w),
    ],
    ids=["fill", "zero", "normal", "uniform", "init_xavier", "init_constant", "kaiming_on_gadget"],
)
def test_interleaved_initialisers_touch_only_the_table(init):
    emb, opt, tabs = _interleaved("adam")
    w, m, v = tabs
    W, M, V = (t.getNumpyVersion().copy() for t in tabs)
    init(w)
    assert not np.array_equal(w.getNumpyVersion(), W)
    assert np.array_equal(m.getNumpyVersion(), M)
    assert np.array_equal(v.getNumpyVersion(), V)


def test_interleaved_state_initialiser_touches_only_its_state():
    emb, opt, tabs = _interleaved("adam")
    w, m, v = tabs
    W, M, V = (t.getNumpyVersion().copy() for t in tabs)
    m.fill_(3.0)
    assert (m.getNumpyVersion() == 3.0).all()
    assert np.array_equal(w.getNumpyVersion(), W)
    assert np.array_equal(v.getNumpyVersion(), V)


def test_interleaved_load_in_place(tmp_path):
    emb, opt, tabs = _interleaved("adam")
    w, m, v = tabs
    M, V = m.getNumpyVersion().copy(), v.getNumpyVersion().copy()
    new = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    np.save(tmp_path / "new.npy", new)
    w.as_tensor()
    w.load(str(tmp_path / "new.npy"))
    assert np.array_equal(w.getNumpyVersion(), new)
    assert np.array_equal(m.getNumpyVersion(), M) and np.array_equal(v.getNumpyVersion(), V)
    got = gl.gather_many(tabs, [0, 11])
    assert np.array_equal(got[0].numpy(), new[[0, 11]])
    assert np.array_equal(got[1].numpy(), M[[0, 11]])


@pytest.mark.parametrize("bad", ["rows", "dtype", "truncated", "missing"])
def test_interleaved_failed_load_leaves_table_unchanged(tmp_path, bad):
    emb, opt, tabs = _interleaved("adam")
    snaps = _snapshot(tabs)
    p = tmp_path / "bad.npy"
    if bad == "rows":
        np.save(p, np.zeros((N + 1, 4), np.float32))
        exc = gl.GadgetValueError
    elif bad == "dtype":
        np.save(p, np.zeros((N, 4), np.float64))
        exc = gl.GadgetError
    elif bad == "truncated":
        np.save(p, np.ones((N, 4), np.float32))
        data = p.read_bytes()
        p.write_bytes(data[:-10])
        exc = gl.GadgetFileError
    else:
        exc = gl.GadgetFileNotFoundError
    with pytest.raises(exc):
        tabs[0].load(str(p))
    _assert_unchanged(tabs, snaps)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_interleaved_copy_is_an_ordinary_table_with_own_rows(how):
    emb, opt, tabs = _interleaved("adam")
    w, m, v = tabs
    W, M = w.getNumpyVersion().copy(), m.getNumpyVersion().copy()
    c = copy.deepcopy(w) if how == "deepcopy" else pickle.loads(pickle.dumps(w))
    assert c.shape == w.shape and c.dtype == w.dtype and c.placement == "cpu"
    assert np.array_equal(c.getNumpyVersion(), W)
    c.fill_(5.0)
    assert np.array_equal(w.getNumpyVersion(), W)
    assert np.array_equal(m.getNumpyVersion(), M)
    w.insertData(torch.zeros(1, 4), [2])
    assert (c.getNumpyVersion() == 5.0).all()


def test_interleaved_states_written_by_scatter_many_drive_the_next_step():
    """The state tables are views of the buffer the optimizer pages from: states written
    with scatter_many are what the next Adam step uses (dense torch Adam as reference)."""
    rows, dim = 6, 3
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(rows, dim, placement="cpu", device="cpu")
    W0 = torch.from_numpy(emb.weight.getNumpyVersion().copy())
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    ref = torch.nn.Parameter(W0.clone())
    ropt = torch.optim.Adam([ref], lr=0.05)
    all_ids = torch.arange(rows)
    # step 1 on both (every row used, so lazy == dense)
    emb(all_ids).pow(2).sum().backward()
    opt.step()
    ref.pow(2).sum().backward()
    ropt.step()
    ropt.zero_grad()
    tabs = [emb.weight] + list(opt.pagers[0].tables.values())
    assert torch.allclose(torch.from_numpy(tabs[0].getNumpyVersion()), ref.detach(), atol=1e-6)
    # overwrite the states of rows 1 and 4 through scatter_many, the same in the reference
    new_m = torch.full((2, dim), 0.5)
    new_v = torch.full((2, dim), 2.0)
    names = list(opt.pagers[0].tables)
    assert names == ["exp_avg", "exp_avg_sq"]
    gl.scatter_many(tabs[1:], [new_m, new_v], [1, 4])
    st = ropt.state[ref]
    st["exp_avg"][[1, 4]] = new_m
    st["exp_avg_sq"][[1, 4]] = new_v
    emb(all_ids).pow(2).sum().backward()
    opt.step()
    ref.pow(2).sum().backward()
    ropt.step()
    got = torch.from_numpy(tabs[0].getNumpyVersion())
    assert torch.allclose(got, ref.detach(), atol=1e-6)
    assert torch.allclose(torch.from_numpy(tabs[1].getNumpyVersion()), st["exp_avg"], atol=1e-6)
    assert torch.allclose(torch.from_numpy(tabs[2].getNumpyVersion()), st["exp_avg_sq"], atol=1e-6)


def test_optimizer_factory_tables_gather_scatter_many():
    torch.manual_seed(0)
    total, dim = 20, 3
    var = torch.nn.Embedding(4, dim)
    model = torch.nn.Module()
    model.u = var
    sw = gl.ModelFactory(var, total, dim, placement="cpu")
    sw.uniformDistributionInit(-0.1, 0.1)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    of = gl.OptimizerFactory(optim, total, dim, model, "u", placement="cpu")
    of.optInit()
    table_before = sw.getNumpyVersion().copy()
    names = list(of.tables)
    tabs = [of.tables[n] for n in names]
    ids = [19, 0, 19, 7]
    rows = [torch.randn(4, dim) for _ in tabs]
    gl.scatter_many(tabs, rows, ids)
    states = of.getNumpyVersion()
    for n, r in zip(names, rows, strict=True):
        exp = _ref_scatter(np.zeros((total, dim), np.float32), r.numpy(), ids)
        # rows not written keep their fresh zero state
        assert np.array_equal(states[n], exp), n
    assert np.array_equal(sw.getNumpyVersion(), table_before)
    got = gl.gather_many(tabs, [7, 19])
    for n, g in zip(names, got, strict=True):
        assert np.array_equal(g.numpy(), states[n][[7, 19]])


# ---------------------------------------------------- other "Rows in and out" names


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float", torch.float32),
        ("int", torch.int32),
        ("byte", torch.uint8),
        ("char", torch.int8),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        (np.float16, torch.float16),
        (np.dtype("int16"), torch.int16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_names(name, expected):
    g = gl.DataGadget((3, 2), dtype=name, placement="cpu")
    assert g.dtype == expected
    assert g.getData([0, 2]).dtype == expected


@pytest.mark.parametrize("flag", ["False", "True", "0"])
def test_cpupinn_string_refused(flag):
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((3, 2), flag, placement="cpu")


def test_tuple_index_semantics():
    ref = np.arange(N * 5, dtype=np.float32).reshape(N, 5)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    assert np.array_equal(g.getData((slice(0, 6), slice(0, 3))).numpy(), ref[0:6, 0:3])
    assert np.array_equal(g[[1, 2], 0].numpy(), ref[[1, 2], 0])
    assert np.array_equal(g[(1, 2)].numpy(), ref[[1, 2]])  # a tuple of plain ints: ids
    assert np.array_equal(g[2:5].numpy(), ref[2:5])
    assert np.array_equal(g[torch.tensor([4, 0]), 1:5:2].numpy(), ref[[4, 0]][:, 1:5:2])
    with pytest.raises(gl.GadgetTypeError):
        g[([1, 2], [0, 1])]


@pytest.mark.parametrize(
    "sl, exc",
    [
        (slice(None, None, -1), gl.GadgetValueError),
        (slice(0.5, 2), gl.GadgetTypeError),
        (slice(0, 3, 0), gl.GadgetValueError),
    ],
)
def test_row_slice_bounds_and_step(sl, exc):
    g = gl.DataGadget(np.zeros((N, 4), np.float32), placement="cpu")
    with pytest.raises(exc):
        g[[1, 2], sl]


def test_insert_tuple_index_writes_only_that_part():
    ref = np.arange(N * 5, dtype=np.float32).reshape(N, 5)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    g.insertData(torch.full((2, 2), -1.0), ([3, 3], slice(1, 3)))
    exp = ref.copy()
    exp[3, 1:3] = -1.0
    assert np.array_equal(g.getNumpyVersion(), exp)
    g[[0, 5], 4] = torch.tensor([7.0, 8.0])
    exp[[0, 5], 4] = [7.0, 8.0]
    assert np.array_equal(g.getNumpyVersion(), exp)


def test_getdata_out_and_refusals():
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    out = torch.empty(3, 4)
    assert g.getData([1, 1, 9], out=out) is out
    assert np.array_equal(out.numpy(), ref[[1, 1, 9]])
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1, 2, 3], out=torch.empty(3, 4, dtype=torch.float64))
    with pytest.raises(gl.GadgetValueError):
        g.getData([1, 2, 3], out=torch.empty(2, 4))
    with pytest.raises(gl.GadgetValueError):
        g.getData([1, 2, 3], out=torch.empty(4, 3).t())
    with pytest.raises(gl.GadgetError):
        g.getData((slice(0, 3), slice(0, 2)), out=torch.empty(3, 2))


def test_getdata_out_part_of_table_bad_id_leaves_table():
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    with pytest.raises(gl.GadgetIndexError):
        g.getData([1, N, 3], out=g.as_tensor()[0:3])
    assert np.array_equal(g.getNumpyVersion(), ref)


def test_gather_many_has_no_out_argument():
    # gather_many's documented signature takes no out=; a misspelt keyword is a TypeError
    tables, _ = _cpu_group()
    with pytest.raises(TypeError):
        gl.gather_many(tables, [0], out=[torch.empty(1, 4)])


def test_numpy_protocol_and_as_tensor(tmp_path):
    ref = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    a = np.asarray(g)
    a[0] = -1
    assert np.array_equal(g.getNumpyVersion(), ref)  # a copy
    v = np.asarray(g, copy=False)
    v[1] = -2
    assert (g.getData(1).numpy() == -2).all()  # a view
    t = g.as_tensor()
    t[2] = -3
    assert (g.getData(2).numpy() == -3).all()
    np.save(tmp_path / "f.npy", ref)
    f = gl.DataGadget(str(tmp_path / "f.npy"), placement="file")
    with pytest.raises(ValueError):
        np.asarray(f, copy=False)
    with pytest.raises(gl.GadgetTypeError):
        f.as_tensor()
    assert np.array_equal(np.asarray(f), ref)
    f.close()


def test_file_table_init_only_elementwise(tmp_path):
    np.save(tmp_path / "f.npy", np.ones((N, 3), np.float32))
    f = gl.DataGadget(str(tmp_path / "f.npy"), placement="file")
    with pytest.raises(gl.GadgetTypeError):
        f.init_(torch.nn.init.orthogonal_)
    assert (np.load(tmp_path / "f.npy") == 1).all()
    f.init_(torch.nn.init.constant_, 2.5)
    f.close()
    assert (np.load(tmp_path / "f.npy") == 2.5).all()


def test_closed_table_answers_metadata_refuses_rows(tmp_path):
    g = gl.DataGadget(np.zeros((N, 2), np.float32), placement="cpu")
    other = gl.DataGadget(np.zeros((N, 2), np.float32), placement="cpu")
    g.close()
    g.close()  # idempotent
    assert g.shape == (N, 2) and g.dtype == torch.float32 and len(g) == N
    assert "DataGadget" in repr(g)
    np.save(tmp_path / "x.npy", np.zeros((N, 2), np.float32))
    calls = [
        lambda: g.getData([0]),
        lambda: g.insertData(torch.zeros(1, 2), [0]),
        lambda: g.load(str(tmp_path / "x.npy")),
        lambda: g.flush(),
        lambda: g.gadgetInit(),
        lambda: gl.gather_many([other, g], [0]),
        lambda: gl.scatter_many([other, g], [torch.ones(1, 2), torch.ones(1, 2)], [0]),
    ]
    for c in calls:
        with pytest.raises(gl.GadgetClosedError):
            c()
    assert (other.getNumpyVersion() == 0).all()


@pytest.mark.parametrize(
    "dtype, call, ok",
    [
        ("int8", lambda g: g.fill_(1.5), False),
        ("int8", lambda g: g.fill_(128), False),
        ("int8", lambda g: g.fill_(-128), True),
        ("bool", lambda g: g.fill_(2), False),
        ("bool", lambda g: g.fill_(1), True),
        ("float16", lambda g: g.fill_(70000.0), False),
        ("float16", lambda g: g.fill_(float("inf")), True),
        ("float16", lambda g: g.uniform_(-60000.0, 60000.0), False),
        ("float32", lambda g: g.uniform_(1.0, 0.0), False),
        ("float32", lambda g: g.normal_(0.0, -1.0), False),
        ("float32", lambda g: g.normal_(float("nan"), 1.0), False),
        ("float32", lambda g: g.uniform_(torch.tensor(0.0), torch.tensor(1.0)), True),
        ("int32", lambda g: g.uniform_(0.0, 1.0), False),
    ],
)
def test_initialiser_value_rules(dtype, call, ok):
    g = gl.DataGadget(np.zeros((4, 2), dtype=dtype), placement="cpu")
    before = g.getNumpyVersion().copy()
    if ok:
        call(g)
        assert not np.array_equal(g.getNumpyVersion(), before) or dtype == "bool"
    else:
        with pytest.raises(gl.GadgetError):
            call(g)
        assert np.array_equal(g.getNumpyVersion(), before)


# ----------------------------------------------------------------- more id / row forms


MORE_IDS = {
    "np_big_endian_i8": np.array([3, 11, 3], dtype=">i8"),
    "np_big_endian_i2": np.array([[0, 1], [2, 0]], dtype=">i2"),
    "np_negative_stride": np.arange(N)[::-3],
    "torch_transposed": torch.tensor([[1, 2, 3], [4, 5, 6]]).t(),
    "torch_stepped": torch.arange(N)[1::4],
    "torch_uint16": torch.tensor([1, 9], dtype=torch.uint16),
    "torch_uint32": torch.tensor([10, 2], dtype=torch.uint32),
    "torch_uint64": torch.tensor([0, 11], dtype=torch.uint64),
    "list_of_np_ints": [np.int64(4), np.int32(2)],
    "list_of_0d_tensors": [torch.tensor(7), torch.tensor(0)],
    "nested_list": [[1, 2], [11, 1]],
    "empty_1x0": np.zeros((1, 0), dtype=np.int64),
}


def _ids_np(ids):
    if isinstance(ids, list):
        return np.asarray(
            [int(i) if not isinstance(i, list) else i for i in ids], dtype=object
        ).astype(np.int64)
    if isinstance(ids, torch.Tensor):
        return ids.to(torch.int64).numpy()
    return np.asarray(ids).astype(np.int64)


@pytest.mark.parametrize("form", list(MORE_IDS))
def test_gather_many_more_id_forms(form):
    ids = MORE_IDS[form]
    tables, refs = _cpu_group()
    idx = _ids_np(ids)
    got = gl.gather_many(tables, ids)
    for g, r in zip(got, refs, strict=True):
        assert np.array_equal(g.numpy(), r[idx])


@pytest.mark.parametrize(
    "form", ["np_big_endian_i8", "torch_transposed", "torch_uint32", "nested_list"]
)
def test_scatter_many_more_id_forms(form):
    ids = MORE_IDS[form]
    idx = _ids_np(ids)
    tables, refs = _cpu_group()
    rows = _rows_for(refs, idx, seed=13)
    gl.scatter_many(tables, rows, ids)
    for t, ref, r in zip(tables, refs, rows, strict=True):
        assert np.array_equal(t.getNumpyVersion(), _ref_scatter(ref, r, idx))


@pytest.mark.parametrize(
    "ids", [[2**63], [2**70], [-(2**70)], np.array([2**64 - 1], dtype=np.uint64)]
)
def test_huge_ids_are_index_errors_and_change_nothing(ids):
    tables, refs = _cpu_group()
    snaps = _snapshot(tables)
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many(tables, ids)
    rows = [torch.from_numpy(r) for r in _rows_for(refs, [0])]
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(tables, rows, ids)
    _assert_unchanged(tables, snaps)


def test_ragged_id_list_refused():
    tables, _ = _cpu_group()
    with pytest.raises(gl.GadgetError):
        gl.gather_many(tables, [[1, 2], [3]])


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(8, dtype=">f4").reshape(2, 4),
        lambda: np.arange(8, dtype=np.float32).reshape(2, 4)[::-1],
        lambda: np.arange(16, dtype=np.float32).reshape(4, 4)[::-2, ::-1],
        lambda: np.asfortranarray(np.arange(8, dtype=np.float32).reshape(2, 4)),
        lambda: torch.arange(4.0).expand(2, 4),
        lambda: torch.arange(8.0).reshape(4, 2).t(),
    ],
    ids=["big_endian", "neg_stride", "neg_stride_2d", "fortran", "expanded", "col_major"],
)
def test_scatter_many_odd_row_layouts(make):
    rows = make()
    tables, refs = _cpu_group()
    t = tables[0]
    gl.scatter_many([t, tables[3]], [rows, np.zeros((2, 3))], [6, 2])
    exp = refs[0].copy()
    exp[[6, 2]] = np.asarray(rows, dtype=np.float32)
    assert np.array_equal(t.getNumpyVersion(), exp)


def test_scatter_many_read_only_numpy_rows():
    tables, refs = _cpu_group()
    r = np.full((1, 4), 3.0, np.float32)
    r.flags.writeable = False
    gl.scatter_many(tables[:1], [r], [5])
    assert (tables[0].getNumpyVersion()[5] == 3.0).all()


def test_scatter_many_meta_rows_refused_unchanged():
    tables, refs = _cpu_group()
    snaps = _snapshot(tables[:1])
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(tables[:1], [torch.empty(2, 4, device="meta")], [0, 1])
    _assert_unchanged(tables[:1], snaps)


def test_scatter_many_empty_rows_of_wrong_row_shape_refused():
    tables, _ = _cpu_group()
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many(tables[:1], [torch.empty(0, 5)], [])
    gl.scatter_many(tables[:1], [torch.empty(0, 4)], [])


def test_ids_and_rows_not_mutated():
    tables, refs = _cpu_group()
    ids_np = np.array([9, 1, 5, 1])
    ids_t = torch.tensor([9, 1, 5, 1])
    rows = [torch.from_numpy(r) for r in _rows_for(refs, ids_np, seed=17)]
    rows_before = [r.clone() for r in rows]
    gl.gather_many(tables, ids_np)
    gl.gather_many(tables, ids_t)
    gl.scatter_many(tables, rows, ids_t)
    gl.scatter_many(tables, rows, ids_np)
    assert ids_np.tolist() == [9, 1, 5, 1] and ids_t.tolist() == [9, 1, 5, 1]
    for a, b in zip(rows, rows_before, strict=True):
        assert torch.equal(a, b)


def test_scatter_many_rows_viewing_a_later_table_in_the_group():
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    h = gl.DataGadget(ref.copy() * 10, placement="cpu")
    # rows for g are a view of h's rows 0..2, and h itself is written in the same call
    gl.scatter_many([g, h], [h.as_tensor()[0:3], torch.zeros(3, 4)], [0, 1, 2])
    exp_g = ref.copy()
    exp_g[0:3] = ref[0:3] * 10
    assert np.array_equal(g.getNumpyVersion(), exp_g)
    assert (h.getNumpyVersion()[0:3] == 0).all()


def test_insert_overlapping_view_of_same_table_like_numpy():
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    g.insertData(g.as_tensor()[0:3], [1, 2, 3])
    exp = ref.copy()
    exp[[1, 2, 3]] = exp[0:3]
    assert np.array_equal(g.getNumpyVersion(), exp)


def test_zero_row_tables():
    z1 = gl.DataGadget(np.zeros((0, 3), np.float32), placement="cpu")
    z2 = gl.DataGadget(np.zeros((0,), np.int64), placement="cpu")
    for ids in ([], slice(None)):
        a, b = gl.gather_many([z1, z2], ids)
        assert tuple(a.shape) == (0, 3) and tuple(b.shape) == (0,)
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many([z1, z2], [0])
    gl.scatter_many([z1, z2], [torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64)], [])


@pytest.mark.parametrize("kind", ["cpu", "npy", "h5", "zarr", "interleaved"])
def test_same_table_twice_in_scatter_many_later_entry_wins(tmp_path, kind):
    # docstring: gadgets[k][indexes] = rows[k] for every table (k in order)
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    if kind == "cpu":
        t = gl.DataGadget(ref.copy(), placement="cpu")
    elif kind == "interleaved":
        emb, opt, tabs = _interleaved("adam", dim=4)
        t = tabs[0]
    else:
        p = str(tmp_path / {"npy": "t.npy", "h5": "t.h5", "zarr": "t.zarr"}[kind])
        gl.DataGadget(ref.copy(), placement="cpu").save(p)
        t = gl.DataGadget(p, placement="file")
    gl.scatter_many([t, t], [torch.full((2, 4), 1.0), torch.full((2, 4), 2.0)], [3, 7])
    assert (t.getNumpyVersion()[[3, 7]] == 2.0).all()


# ------------------------------------------------------------------ more file cases


@pytest.mark.parametrize(
    "fmt, how",
    [
        (f, h)
        for f in ("npy", "h5", "zarr")
        for h in ("replace", "delete", "shrink")
        if (f, h) != ("zarr", "shrink")
    ],
)
def test_scatter_many_file_gone_or_replaced_refused_cpu_unchanged(tmp_path, fmt, how):
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    p = str(tmp_path / f"t.{fmt}")
    opts = {} if fmt == "npy" else {"chunk_rows": 2}
    gl.DataGadget(ref.copy(), placement="cpu").save(p, **opts)
    ft = gl.DataGadget(p, placement="file")
    ft.getData([0, 5])
    cpu = gl.DataGadget(ref.copy(), placement="cpu")
    if how == "replace":
        gl.DataGadget(ref * 2, placement="cpu").save(p, **opts)
    elif how == "delete":
        import shutil

        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    else:
        os.truncate(p, os.path.getsize(p) - 64 if fmt == "npy" else os.path.getsize(p) // 2)
    with pytest.raises(gl.GadgetFileError):
        gl.scatter_many([cpu, ft], [torch.full((2, 4), -1.0)] * 2, [0, 5])
    assert np.array_equal(cpu.getNumpyVersion(), ref)
    with pytest.raises(gl.GadgetFileError):
        gl.gather_many([cpu, ft], [0])


def _raw_files(d, ref):
    np.save(d / "fortran.npy", np.asfortranarray(ref))
    np.save(d / "be.npy", ref.astype(">f4"))
    with h5py.File(d / "raw.h5", "w") as f:
        f.create_dataset("g/contig", data=ref)
        f.create_dataset("g/chunked", data=ref, chunks=(5, 2))
        f.create_dataset("g/be", data=ref.astype(">f4"))
    z2 = zarr.open(
        str(d / "v2.zarr"), mode="w", zarr_format=2, shape=ref.shape, chunks=(5, 3), dtype="f4"
    )
    z2[...] = ref
    z3 = zarr.open(str(d / "v3.zarr"), mode="w", shape=ref.shape, chunks=(5, 3), dtype="f4")
    z3[...] = ref


RAW = {
    "be_npy": ("be.npy", {}),
    "h5_contiguous": ("raw.h5", {"dataset": "g/contig"}),
    "h5_chunked": ("raw.h5", {"dataset": "g/chunked"}),
    "h5_big_endian": ("raw.h5", {"dataset": "g/be"}),
    "zarr_v2": ("v2.zarr", {}),
    "zarr_v3": ("v3.zarr", {}),
}


@pytest.mark.parametrize("which", list(RAW))
def test_many_on_files_written_by_other_tools(tmp_path, which):
    ref = np.arange(N * 5, dtype=np.float32).reshape(N, 5)
    _raw_files(tmp_path, ref)
    name, kw = RAW[which]
    t = gl.DataGadget(str(tmp_path / name), placement="file", **kw)
    other = gl.DataGadget(np.arange(N, dtype=np.int32), placement="cpu")
    ids = np.array([[11, 0, 6], [6, 6, 3]])
    got, got_other = gl.gather_many([t, other], ids)
    assert np.array_equal(got.numpy(), ref[ids])
    assert np.array_equal(got_other.numpy(), np.arange(N, dtype=np.int32)[ids])
    rows = -np.arange(30, dtype=np.float32).reshape(2, 3, 5)
    gl.scatter_many([t, other], [rows, np.zeros((2, 3), np.int32)], ids)
    exp = _ref_scatter(ref, rows, ids)
    assert np.array_equal(t.getNumpyVersion(), exp)
    t.close()
    back = gl.DataGadget(str(tmp_path / name), placement="cpu", **kw)
    assert np.array_equal(back.getNumpyVersion(), exp)


def test_fortran_npy_gathers_right_and_refuses_writes(tmp_path):
    ref = np.arange(N * 5, dtype=np.float32).reshape(N, 5)
    _raw_files(tmp_path, ref)
    t = gl.DataGadget(str(tmp_path / "fortran.npy"), placement="file")
    cpu = gl.DataGadget(ref.copy(), placement="cpu")
    got = gl.gather_many([t, cpu], [7, 0, 7])
    assert np.array_equal(got[0].numpy(), ref[[7, 0, 7]])
    with pytest.raises(gl.ReadOnlyError) as ei:
        gl.scatter_many([cpu, t], [np.zeros((1, 5), np.float32)] * 2, [1])
    assert "Fortran" in str(ei.value)
    assert np.array_equal(cpu.getNumpyVersion(), ref)
    t.close()


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_bfloat16_file_tables(tmp_path, fmt):
    x = torch.randn(N, 3).to(torch.bfloat16)
    p = str(tmp_path / f"bf.{fmt}")
    gl.DataGadget(x, placement="cpu").save(p)
    t = gl.DataGadget(p, placement="file")
    assert t.dtype == torch.bfloat16
    (g,) = gl.gather_many([t], [3, 0, 3])
    assert torch.equal(g, x[[3, 0, 3]])
    gl.scatter_many([t], [torch.full((2, 3), 1.5, dtype=torch.bfloat16)], [5, 5])
    t.close()
    back = gl.DataGadget(p, placement="cpu")
    exp = x.clone()
    exp[5] = 1.5
    assert torch.equal(back.as_tensor(), exp)


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_two_file_tables_of_one_file_see_scatter_many_writes(tmp_path, fmt):
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    p = str(tmp_path / f"s.{fmt}")
    gl.DataGadget(ref.copy(), placement="cpu").save(
        p, **({} if fmt == "npy" else {"chunk_rows": 3})
    )
    a = gl.DataGadget(p, placement="file")
    b = gl.DataGadget(p, placement="file")
    gl.gather_many([b], [1, 2, 10])  # warm b's cache
    gl.scatter_many([a], [np.full((2, 4), 99.0, np.float32)], [1, 10])
    (got,) = gl.gather_many([b], [1, 2, 10])
    exp = ref[[1, 2, 10]].copy()
    exp[[0, 2]] = 99.0
    assert np.array_equal(got.numpy(), exp)
    a.close()
    b.close()


@pytest.mark.parametrize(
    "opts", [{"cache_bytes": 0}, {"block_rows": 1}, {"cache_bytes": 64, "block_rows": 5}]
)
def test_file_table_cache_options_with_many(tmp_path, opts):
    ref = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
    p = str(tmp_path / "o.h5")
    gl.DataGadget(ref.copy(), placement="cpu").save(p, chunk_rows=4, compression="gzip")
    t = gl.DataGadget(p, placement="file", **opts)
    ids = [11, 0, 4, 4, 7]
    rows = np.arange(20, dtype=np.float32).reshape(5, 4) + 1000
    gl.scatter_many([t], [rows], ids)
    (got,) = gl.gather_many([t], list(range(N)))
    assert np.array_equal(got.numpy(), _ref_scatter(ref, rows, ids))
    t.close()


# ---------------------------------------------------------- more interleaved checks


ALL_OPTIMS = {
    "SparseAdam": {},
    "Adam": {},
    "AdamW": {},
    "Adamax": {},
    "Adadelta": {},
    "RMSprop": {"momentum": 0.5, "centered": True},
    "Rprop": {},
    "ASGD": {},
    "Adagrad": {"initial_accumulator_value": 0.3},
    "SGD": {"momentum": 0.9},
    "NAdam": {},
    "RAdam": {},
}


@pytest.mark.parametrize(
    "name, dtype",
    [(n, torch.float32) for n in ALL_OPTIMS]
    + [(n, d) for n in ("Adam", "RMSprop", "Adagrad") for d in (torch.float16, torch.bfloat16)],
)
def test_interleaved_every_supported_optimizer_round_trip(name, dtype):
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu", dtype=dtype)
    opt = gl.OffloadedOptimizer(getattr(torch.optim, name), emb, lr=0.01, **ALL_OPTIMS[name])
    emb(torch.tensor([1, 2, 2])).float().sum().backward()
    opt.step()
    tabs = [emb.weight] + list(opt.pagers[0].tables.values())
    refs = [t.as_tensor().clone() for t in tabs]
    ids = torch.tensor([4, 1, 4, 9])
    for g, r in zip(gl.gather_many(tabs, ids), refs, strict=True):
        assert torch.equal(g, r[ids])
    rows = [torch.randn(4, 3).to(dtype) for _ in tabs]
    gl.scatter_many(tabs, rows, ids)
    for k, (t, r, rr) in enumerate(zip(tabs, refs, rows, strict=True)):
        exp = r.clone()
        exp[1], exp[4], exp[9] = rr[1], rr[2], rr[3]
        assert torch.equal(t.as_tensor(), exp), f"table {k}"


def test_interleaved_partial_row_writes_touch_only_that_part():
    emb, opt, tabs = _interleaved("adam")
    w, m, v = tabs
    W, M, V = (t.getNumpyVersion().copy() for t in tabs)
    w.insertData(torch.full((2, 2), -7.0), ([1, 2], slice(0, 2)))
    w[[3, 4], 3] = torch.tensor([5.0, 6.0])
    m.insertData(torch.full((1, 2), -9.0), ([1], slice(1, 3)))
    W[[1, 2], 0:2] = -7.0
    W[[3, 4], 3] = [5.0, 6.0]
    M[1, 1:3] = -9.0
    assert np.array_equal(w.getNumpyVersion(), W)
    assert np.array_equal(m.getNumpyVersion(), M)
    assert np.array_equal(v.getNumpyVersion(), V)
    assert np.array_equal(w[[1, 2], 0:2].numpy(), W[[1, 2], 0:2])
    assert np.array_equal(w[2:9:3].numpy(), W[2:9:3])
    out = torch.empty(2, 4)
    w.getData([5, 1], out=out)
    assert np.array_equal(out.numpy(), W[[5, 1]])


@pytest.mark.parametrize("name", ["t.npy", "t.h5", "t.zarr", "cupy"])
def test_interleaved_table_and_state_save(tmp_path, name):
    emb, opt, tabs = _interleaved("adam")
    for k, t in enumerate(tabs):
        exp = t.getNumpyVersion().copy()
        if name == "cupy":
            t.saveCupy(str(tmp_path / f"s{k}"))
            back = np.load(tmp_path / f"s{k}.npy")
        else:
            p = str(tmp_path / f"{k}{name}")
            t.save(p)
            back = gl.DataGadget(p, placement="cpu").getNumpyVersion()
        assert np.array_equal(back, exp), f"table {k}"
        assert np.array_equal(np.asarray(t), exp)


def test_interleaved_loadcupy_in_place_keeps_states(tmp_path):
    emb, opt, tabs = _interleaved("adam")
    M, V = tabs[1].getNumpyVersion().copy(), tabs[2].getNumpyVersion().copy()
    np.save(tmp_path / "n.npy", np.full((N, 4), 4.0, np.float32))
    tabs[0].loadCupy(str(tmp_path / "n.npy"))
    assert (tabs[0].getNumpyVersion() == 4.0).all()
    assert np.array_equal(tabs[1].getNumpyVersion(), M) and np.array_equal(
        tabs[2].getNumpyVersion(), V
    )
    # and the optimizer still trains the loaded rows with its state
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    assert not (tabs[0].getNumpyVersion()[1] == 4.0).any()
    assert (tabs[0].getNumpyVersion()[0] == 4.0).all()


def test_interleaved_after_optimizer_is_collected_new_one_starts_fresh():
    import gc

    emb, opt, tabs = _interleaved("adam")
    W = tabs[0].getNumpyVersion().copy()
    del opt
    gc.collect()
    assert np.array_equal(emb.weight.getNumpyVersion(), W)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    new = list(opt2.pagers[0].tables.values())
    assert np.array_equal(emb.weight.getNumpyVersion(), W)
    for s in new:
        assert (s.getNumpyVersion() == 0).all()
    got = gl.gather_many([emb.weight] + new, [1, 5])
    assert np.array_equal(got[0].numpy(), W[[1, 5]])


@pytest.mark.parametrize("init", ["normal", "uniform"])
def test_interleaved_random_init_fills_every_element(init):
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(400, 8, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    w = emb.weight
    w.fill_(1000.0)
    if init == "normal":
        w.normal_(0.0, 1.0)
        x = w.getNumpyVersion()
        assert abs(float(x.mean())) < 0.1 and 0.9 < float(x.std()) < 1.1
    else:
        w.uniform_(-1.0, 1.0)
        x = w.getNumpyVersion()
        assert x.min() >= -1.0 and x.max() <= 1.0
    assert not (x == 1000.0).any()
    for s in opt.pagers[0].tables.values():
        assert (s.getNumpyVersion() == 0).all()


def test_interleaved_closed_state_table_refuses_scatter_many_others_unchanged():
    emb, opt, tabs = _interleaved("adam")
    w, m, v = tabs
    W, V = w.getNumpyVersion().copy(), v.getNumpyVersion().copy()
    m.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.scatter_many([w, v, m], [torch.zeros(1, 4)] * 3, [1])
    assert np.array_equal(w.getNumpyVersion(), W) and np.array_equal(v.getNumpyVersion(), V)
    a, b = gl.gather_many([w, v], [1])
    assert np.array_equal(a.numpy(), W[[1]]) and np.array_equal(b.numpy(), V[[1]])


def test_switcher_optinit_interleaves_and_keeps_values():
    torch.manual_seed(0)
    total, dim = 20, 3
    var = torch.nn.Embedding(4, dim)
    model = torch.nn.Module()
    model.u = var
    sw = gl.ModelFactory(var, total, dim, placement="cpu")
    sw.uniformDistributionInit(-0.1, 0.1)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    of = gl.OptimizerFactory(optim, total, dim, model, "u", placement="cpu")
    T0 = sw.getNumpyVersion().copy()
    of.optInit()
    assert np.array_equal(sw.getNumpyVersion(), T0)
    for t in of.tables.values():
        assert t.as_tensor().stride() == (3 * dim, 1)  # table + 2 states side by side
    ids = torch.tensor([5, 2, 5])
    loc = sw.beforeForwardPass(ids)
    of.beforeForwardPass(ids)
    var(loc).pow(2).sum().backward()
    optim.step()
    sw.afterOptimizerStep(ids)
    of.afterOptimizerStep(ids)
    ref = torch.nn.Parameter(torch.from_numpy(T0[[2, 5]].copy()))
    ro = torch.optim.Adam([ref], lr=0.1)
    (ref.pow(2) * torch.tensor([[1.0], [2.0]])).sum().backward()
    ro.step()
    T1 = sw.getNumpyVersion()
    assert np.allclose(T1[[2, 5]], ref.detach().numpy(), atol=1e-6)
    others = [i for i in range(total) if i not in (2, 5)]
    assert np.array_equal(T1[others], T0[others])
    S = of.getNumpyVersion()
    g = gl.gather_many(list(of.tables.values()), [2, 5])
    for x, k in zip(g, of.tables, strict=True):
        assert np.array_equal(x.numpy(), S[k][[2, 5]])
    assert np.allclose(S["exp_avg"][[2, 5]], ro.state[ref]["exp_avg"].numpy(), atol=1e-7)


# ------------------------------------------------------------- flags, views, bfloat16


@pytest.mark.parametrize(
    "call",
    [
        lambda g: g.getNumpyVersion(copy="False"),
        lambda g: g.insertData(torch.zeros(1, 2), [0], check_ids="False"),
        lambda g: g.getData([0], check_ids="no"),
    ],
    ids=["getNumpyVersion_copy", "insertData_check_ids", "getData_check_ids"],
)
def test_string_flags_refused(call):
    g = gl.DataGadget(np.arange(12, dtype=np.float32).reshape(6, 2), placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        call(g)
    assert np.array_equal(g.getNumpyVersion(), np.arange(12, dtype=np.float32).reshape(6, 2))


def test_load_gives_plain_table_new_storage_old_view_keeps_old_rows(tmp_path):
    ref = np.arange(12, dtype=np.float32).reshape(6, 2)
    g = gl.DataGadget(ref.copy(), placement="cpu")
    v = g.as_tensor()
    np.save(tmp_path / "n.npy", np.full((6, 2), 5.0, np.float32))
    g.load(str(tmp_path / "n.npy"))
    assert np.array_equal(v.numpy(), ref)
    v[1] = -1.0
    assert (g.getNumpyVersion() == 5.0).all()


def test_bfloat16_numpy_views():
    x = torch.randn(4, 2).to(torch.bfloat16)
    b = gl.DataGadget(x, placement="cpu")
    a = b.getNumpyVersion()
    assert a.dtype == np.float32 and np.array_equal(a, x.float().numpy())
    with pytest.raises(ValueError):
        np.asarray(b, copy=False)
