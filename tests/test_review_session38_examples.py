"""Black-box review (session 38): the public docstrings' ``>>>`` examples, run as a user
would (on the CPU) with their documented outputs checked against NumPy, and the
documented parameter validation of the names in ``gadgetloader.__all__``.

Written from README.md, SPEC.md and the public docstrings only. Angles: ids of every
integer dtype (bool / uint8 / int8 / int16 ...), 0-d ids, non-contiguous id tensors and
arrays, ``range`` and NumPy integer scalars, float ids, ids near and past 2**63, empty id
lists, ``gather_many`` / ``scatter_many`` over mismatched tables, and the file errors (a
missing path, a truncated .npy, a dataset name not in an HDF5 file or zarr store). Every
refusal is checked for its documented class, for a message naming what was expected and
what arrived, and for the table (or the file on disk) being unchanged afterwards.

Every table is built with ``placement='cpu'`` (or ``'file'``) and ``device='cpu'``, so the
file runs the same on a GPU host.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl

pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")

ROWS, DIM = 10, 4
BASE = (np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) * 1.5) - 7.0


def cpu_table(arr=None, **kw):
    return gl.DataGadget(BASE.copy() if arr is None else arr, placement="cpu", device="cpu", **kw)


def table_np(g):
    return np.array(g.getNumpyVersion(), copy=True)


def _idx_np(ids):
    """The NumPy view of a documented id kind (for the reference)."""
    if isinstance(ids, torch.Tensor):
        return ids.cpu().numpy().astype(np.int64)
    if isinstance(ids, range):
        return np.array(list(ids), dtype=np.int64)
    return np.asarray(ids).astype(np.int64)


# ---------------------------------------------------------------------------------------
# 1. The docstrings' >>> examples, as written (values checked against NumPy too)
# ---------------------------------------------------------------------------------------


def test_example_datagadget_docstring():
    # gadget.py: DataGadget's example, verbatim (placement-agnostic result: .tolist()).
    g = gl.DataGadget((1000, 16), dtype="float32", placement="cpu")
    g.insertData(torch.ones(2, 16), [3, 7])
    assert g.getData([7, 3, 0]).sum(dim=1).tolist() == [16.0, 16.0, 0.0]
    # and the whole table against NumPy
    ref = np.zeros((1000, 16), np.float32)
    ref[[3, 7]] = 1.0
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    assert g.shape == (1000, 16) and g.dtype == torch.float32 and g.placement == "cpu"


def test_example_gadgetdataset_docstring_and_values():
    x, y = np.ones((10, 4), np.float32), np.arange(10)
    ds = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    assert [tuple(t.shape) for t in next(iter(DataLoader(ds, batch_size=4)))] == [(4, 4), (4,)]
    # the same with distinct values: every batch of the default DataLoader is the rows in order
    x2 = np.arange(40, dtype=np.float32).reshape(10, 4)
    ds2 = gl.GadgetDataset(x2, y, placement="cpu", device="cpu")
    batches = list(DataLoader(ds2, batch_size=4))
    assert [tuple(b[0].shape) for b in batches] == [(4, 4), (4, 4), (2, 4)]
    np.testing.assert_array_equal(np.concatenate([b[0].numpy() for b in batches]), x2)
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in batches]), y)


def test_example_gadgetloader_docstring():
    ds = gl.GadgetDataset(torch.arange(10.0), placement="cpu", device="cpu")
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential")
    assert [b[0].tolist() for b in loader] == [
        [0.0, 1.0, 2.0, 3.0],
        [4.0, 5.0, 6.0, 7.0],
        [8.0, 9.0],
    ]


def test_example_gadgetsampler_docstring():
    from gadgetloader.data import GadgetSampler

    assert [b.tolist() for b in GadgetSampler(10, batch_size=4, order="sequential")] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    got = [
        [
            b.tolist()
            for b in GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=r)
        ]
        for r in (0, 1)
    ]
    assert got == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8]]]
    # the docstring says the batches are int64 id tensors
    assert all(b.dtype == torch.int64 for b in GadgetSampler(10, batch_size=4, order="sequential"))


def _sequential_shares(n, R, B):
    """The docstring's default rule ("Ranks"), for order='sequential'."""
    out, start = [], 0
    for r in range(R):
        size = n // R + (1 if r < n % R else 0)
        k = -(-(n // R) // B)
        share = list(range(start, start + size))
        start += size
        batches = [share[i * B : (i + 1) * B] for i in range(k - 1)]
        batches.append(share[(k - 1) * B :])
        out.append(batches)
    return out


@pytest.mark.parametrize(
    "n,R,B", [(9, 2, 2), (10, 3, 3), (7, 7, 1), (13, 4, 3), (12, 2, 6), (5, 2, 5)]
)
def test_sampler_rank_shares_follow_documented_rule(n, R, B):
    got = [
        [
            b.tolist()
            for b in gl.GadgetSampler(n, batch_size=B, order="sequential", num_replicas=R, rank=r)
        ]
        for r in range(R)
    ]
    assert got == _sequential_shares(n, R, B)
    assert all(len(s) == len(got[0]) for s in got)  # the same number of batches on every rank
    assert sorted(i for s in got for b in s for i in b) == list(range(n))


@pytest.mark.parametrize("n,R,B", [(9, 2, 2), (13, 3, 2), (20, 2, 4)])
def test_sampler_drop_last_and_pad_counts(n, R, B):
    drop = [
        [
            b.tolist()
            for b in gl.GadgetSampler(
                n, batch_size=B, order="sequential", num_replicas=R, rank=r, drop_last=True
            )
        ]
        for r in range(R)
    ]
    k = n // (R * B)
    assert all(len(s) == k and all(len(b) == B for b in s) for s in drop)
    seen = sorted(i for s in drop for b in s for i in b)
    assert seen == list(range(R * B * k))  # the last n % (R*B) rows of the order are not yielded
    pad = [
        [
            b.tolist()
            for b in gl.GadgetSampler(
                n, batch_size=B, order="sequential", num_replicas=R, rank=r, pad=True
            )
        ]
        for r in range(R)
    ]
    kp = -(-n // (R * B))
    assert all(len(s) == kp and all(len(b) == B for b in s) for s in pad)
    missing = R * B * kp - n
    counts = np.bincount([i for s in pad for b in s for i in b], minlength=n)
    expected = np.ones(n, np.int64)
    for j in range(missing):
        expected[j % n] += 1  # taken again from the start of the order, cyclically
    np.testing.assert_array_equal(counts, expected)


def test_example_modelfactory_docstring_and_rows():
    emb = torch.nn.Embedding(3, 4)  # rows for one batch's ids
    sw = gl.ModelFactory(emb, total_classes=100, embed_dimension=4, placement="cpu")
    sw.uniformDistributionInit(-0.1, 0.1)
    local = sw.beforeForwardPass(torch.tensor([5, 9, 5]))
    assert (local.tolist(), tuple(emb.weight.shape)) == ([0, 1, 0], (3, 4))
    table = np.array(sw.getNumpyVersion(), copy=True)
    assert table.shape == (100, 4)
    assert table.min() >= -0.1 and table.max() <= 0.1 and np.unique(table).size > 300
    # the variable's local rows 0 and 1 are the table's rows 5 and 9
    w = emb.weight.detach().cpu().numpy()
    np.testing.assert_array_equal(w[0], table[5])
    np.testing.assert_array_equal(w[1], table[9])
    # an update of the variable goes back to rows 5 and 9 only
    with torch.no_grad():
        emb.weight[0] += 1.0
        emb.weight[1] -= 2.0
    sw.afterOptimizerStep(torch.tensor([5, 9, 5]))
    ref = table.copy()
    ref[5] += 1.0
    ref[9] -= 2.0
    np.testing.assert_allclose(sw.getNumpyVersion(), ref, rtol=0, atol=1e-7)


def test_example_offloaded_embedding_docstring_matches_dense_adam():
    emb = gl.OffloadedEmbedding(1000, 8, placement="cpu", device="cpu")
    w0 = torch.from_numpy(np.array(emb.weight.getNumpyVersion(), copy=True))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)
    emb(torch.tensor([[1, 2], [2, 3]])).sum().backward()
    opt.step()
    # a dense nn.Embedding with the same rows, trained with torch's Adam: after one step
    # (zero moments) only rows 1, 2 and 3 move, and by the same amounts
    ref = torch.nn.Embedding(1000, 8)
    with torch.no_grad():
        ref.weight.copy_(w0)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref(torch.tensor([[1, 2], [2, 3]])).sum().backward()
    ropt.step()
    got = np.array(emb.weight.getNumpyVersion(), copy=True)
    np.testing.assert_allclose(got, ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7)
    changed = np.nonzero((got != w0.numpy()).any(axis=1))[0].tolist()
    assert changed == [1, 2, 3]


def test_example_convert_docstring(tmp_path):
    pytest.importorskip("h5py")
    from gadgetloader.convert import convert

    d = str(tmp_path)
    src = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(os.path.join(d, "t.npy"), src)
    info = convert(os.path.join(d, "t.npy"), os.path.join(d, "t.h5"), progress=False)
    assert (info["shape"], info["dst_format"]) == ((4, 3), "hdf5")
    g = gl.DataGadget(os.path.join(d, "t.h5"), placement="cpu", device="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), src)


def test_convert_missing_source_and_missing_dataset_leave_dst(tmp_path):
    h5py = pytest.importorskip("h5py")
    from gadgetloader.convert import convert

    dst = tmp_path / "out.npy"
    np.save(dst, np.ones((2, 2), np.float32))
    before = dst.read_bytes()
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        convert(str(tmp_path / "nope.npy"), str(dst), progress=False)
    assert ei.value.errno == errno.ENOENT and "nope.npy" in str(ei.value)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f["emb"] = BASE
    with pytest.raises(gl.GadgetKeyError) as ei:
        convert(str(tmp_path / "s.h5"), str(dst), dataset="missing", progress=False)
    assert "missing" in str(ei.value) and "emb" in str(ei.value)
    raw = tmp_path / "full.npy"
    np.save(raw, BASE)
    (tmp_path / "trunc.npy").write_bytes(raw.read_bytes()[:-5])
    with pytest.raises(gl.GadgetFileError):
        convert(str(tmp_path / "trunc.npy"), str(dst), progress=False)
    assert dst.read_bytes() == before


# ---------------------------------------------------------------------------------------
# 2. Id kinds that the docs accept ("ids of any integer dtype and shape"), against NumPy
# ---------------------------------------------------------------------------------------


def _good_ids():
    cases = {
        "uint8": torch.tensor([9, 0, 3], dtype=torch.uint8),
        "int8": torch.tensor([9, 0, 3], dtype=torch.int8),
        "int16": torch.tensor([[1, 2], [2, 1]], dtype=torch.int16),
        "int32": torch.tensor([5, 5, 5], dtype=torch.int32),
        "np_uint8": np.array([7, 1], dtype=np.uint8),
        "np_int16": np.array([7, 1], dtype=np.int16),
        "np_uint32": np.array([4, 2], dtype=np.uint32),
        "np_uint64_small": np.array([4, 2], dtype=np.uint64),
        "big_endian": np.array([3, 8, 1], dtype=">i8"),
        "strided_tensor": torch.arange(20)[::3][:4],
        "transposed_tensor": torch.arange(8).reshape(2, 4).t(),
        "expanded_tensor": torch.tensor([6]).expand(4),
        "offset_view": torch.arange(12)[5:9],
        "flipped_numpy": np.arange(6)[::-1],
        "fortran_numpy": np.asfortranarray(np.arange(6).reshape(2, 3)),
        "readonly_numpy": np.frombuffer(np.array([2, 4, 6], np.int64).tobytes(), dtype=np.int64),
        "range": range(2, 6),
        "range_step": range(9, 0, -4),
        "list_np_ints": [np.int64(1), np.int32(8)],
        "list_0d_tensors": [torch.tensor(3), torch.tensor(0)],
        "tuple_ints": (4, 5, 4),
        "nested_list": [[1, 2, 3], [3, 2, 1]],
    }
    for name in ("uint16", "uint32"):
        dt = getattr(torch, name, None)
        if dt is not None:
            cases["torch_" + name] = torch.tensor([9, 1], dtype=dt)
    return cases


GOOD = _good_ids()


@pytest.mark.parametrize("name", sorted(GOOD))
def test_getdata_accepts_integer_id_kinds_and_matches_numpy(name):
    ids = GOOD[name]
    g = cpu_table()
    got = g.getData(ids)
    idx = _idx_np(ids)
    assert tuple(got.shape) == idx.shape + (DIM,)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    np.testing.assert_array_equal(got.numpy(), BASE[idx])


@pytest.mark.parametrize("name", sorted(GOOD))
def test_insertdata_accepts_integer_id_kinds_last_occurrence_wins(name):
    ids = GOOD[name]
    g = cpu_table()
    idx = _idx_np(ids)
    data = np.arange(idx.size * DIM, dtype=np.float32).reshape(idx.shape + (DIM,)) + 1000.0
    g.insertData(torch.from_numpy(data.copy()), ids)
    ref = BASE.copy()
    flat_i, flat_d = idx.reshape(-1), data.reshape(-1, DIM)
    for k in range(flat_i.size):  # NumPy's sequential assignment: the last occurrence wins
        ref[flat_i[k]] = flat_d[k]
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


@pytest.mark.parametrize(
    "ids",
    [torch.tensor(7), np.array(7), np.int64(7), np.int32(7), np.uint8(7), 7],
    ids=["0d_tensor", "0d_array", "np_int64", "np_int32", "np_uint8", "int"],
)
def test_scalar_ids_give_one_row_without_leading_axis(ids):
    g = cpu_table()
    got = g.getData(ids)
    assert tuple(got.shape) == (DIM,)
    np.testing.assert_array_equal(got.numpy(), BASE[7])
    g.insertData(torch.full((DIM,), 42.0), ids)
    ref = BASE.copy()
    ref[7] = 42.0
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    # a (1, DIM) block for a scalar id has the wrong shape: refused, table unchanged
    with pytest.raises(gl.GadgetValueError) as ei:
        g.insertData(torch.zeros(1, DIM), ids)
    assert "(4,)" in str(ei.value) and "(1, 4)" in str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


@pytest.mark.parametrize(
    "ids,shape",
    [
        ([], (0,)),
        (torch.empty(0, dtype=torch.int64), (0,)),
        (np.empty(0, np.int32), (0,)),
        (range(0), (0,)),
        (range(5, 5), (0,)),
        (torch.empty(0, 3, dtype=torch.int16), (0, 3)),
        ([[]], (1, 0)),
    ],
    ids=["list", "tensor", "np_int32", "range0", "range55", "tensor_0x3", "nested_empty"],
)
def test_empty_ids_read_and_write_nothing(ids, shape):
    g = cpu_table()
    got = g.getData(ids)
    assert tuple(got.shape) == shape + (DIM,) and got.dtype == torch.float32
    g.insertData(torch.zeros(shape + (DIM,)), ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    outs = gl.gather_many([g, cpu_table()], ids)
    assert [tuple(o.shape) for o in outs] == [shape + (DIM,)] * 2
    gl.scatter_many([g, g], [torch.zeros(shape + (DIM,))] * 2, ids)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)


@pytest.mark.parametrize(
    "sl",
    [slice(8, 100), slice(None, None, -3), slice(-2, None), slice(2**70, None), slice(1, 9, 4)],
    ids=["clipped", "neg_step", "neg_start", "huge_start", "step"],
)
def test_slice_of_rows_follows_python(sl):
    g = cpu_table()
    np.testing.assert_array_equal(g.getData(sl).numpy(), BASE[sl])
    np.testing.assert_array_equal(g[sl].numpy(), BASE[sl])
    outs = gl.gather_many([g, cpu_table(BASE * 2)], sl)
    np.testing.assert_array_equal(outs[0].numpy(), BASE[sl])
    np.testing.assert_array_equal(outs[1].numpy(), (BASE * 2)[sl])


def test_insertdata_from_a_view_of_the_table_is_numpy_assignment():
    # data that overlaps the rows it is written to: NumPy's a[ids] = a[0:3]
    for ids in ([1, 2, 3], [2, 1, 0], [0, 0, 1]):
        g = cpu_table()
        view = g.as_tensor()
        g.insertData(view[0:3], ids)
        ref = BASE.copy()
        src = BASE[0:3].copy()
        for k, i in enumerate(ids):
            ref[i] = src[k]
        np.testing.assert_array_equal(g.getNumpyVersion(), ref, err_msg=str(ids))


# ---------------------------------------------------------------------------------------
# 3. Bad ids: class, message, and the tables unchanged
# ---------------------------------------------------------------------------------------

_TYPE_BAD = {
    "bool_tensor": (torch.tensor([True, False]), "bool"),
    "bool_numpy": (np.array([True, False]), "bool"),
    "bool_list": ([True, False], "bool"),
    "bool_mixed_list": ([1, True], "bool"),
    "python_bool": (True, "bool"),
    "float_tensor": (torch.tensor([1.0, 2.0]), "float32"),
    "float16_tensor": (torch.tensor([1.0], dtype=torch.float16), "float16"),
    "float_0d": (torch.tensor(2.0), "float32"),
    "float_list": ([1.0, 2.0], "float"),
    "integral_float_numpy": (np.array([1.0, 2.0]), "float64"),
    "np_float_scalar": (np.float64(2.0), "float64"),
    "python_float": (2.0, "float"),
    "empty_float_tensor": (torch.tensor([]), "float32"),
    "complex": (torch.tensor([1 + 0j]), "complex"),
    "str": ("1", "str"),
    "list_of_str": (["1"], "U1"),
    "none": (None, "NoneType"),
    "set": ({1, 2}, "set"),
    "ragged": ([[1], [2, 3]], "ragged"),
}


@pytest.mark.parametrize("name", sorted(_TYPE_BAD))
def test_non_integer_ids_are_gadget_type_errors_everywhere(name):
    ids, arrived = _TYPE_BAD[name]
    a, b = cpu_table(), cpu_table(BASE + 1)
    calls = {
        "getData": lambda: a.getData(ids),
        "insertData": lambda: a.insertData(torch.zeros(2, DIM), ids),
        "getitem": lambda: a[ids],
        "gather_many": lambda: gl.gather_many([a, b], ids),
        "scatter_many": lambda: gl.scatter_many([a, b], [torch.zeros(2, DIM)] * 2, ids),
    }
    for call, fn in calls.items():
        with pytest.raises(gl.GadgetTypeError) as ei:
            fn()
        assert isinstance(ei.value, TypeError)
        msg = str(ei.value)
        assert "integer" in msg or "ids must be" in msg, (call, msg)  # what was expected
        assert arrived in msg, (call, msg)  # what arrived
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
    np.testing.assert_array_equal(b.getNumpyVersion(), BASE + 1)


_INDEX_BAD = {
    "negative": ([3, -1], "-1"),
    "past_end": ([3, 10], "10"),
    "int_neg": (-1, "-1"),
    "int_past_end": (10, "10"),
    "int8_negative": (torch.tensor([-3], dtype=torch.int8), "-3"),
    "uint8_255": (torch.tensor([255], dtype=torch.uint8), "255"),
    "int16_big": (torch.tensor([300], dtype=torch.int16), "300"),
    "np_int64_scalar_big": (np.int64(2**62), str(2**62)),
    "int64_max": (torch.tensor([2**63 - 1]), str(2**63 - 1)),
    "int64_min": (np.array([-(2**63)]), str(-(2**63))),
    "strided_with_bad": (torch.arange(20)[::2], "18"),
    "range_negative": (range(-1, 2), "-1"),
    "range_1e12": (range(0, 10**12), "999999999999"),
    "0d_tensor_neg": (torch.tensor(-2), "-2"),
}


@pytest.mark.parametrize("name", sorted(_INDEX_BAD))
def test_out_of_range_ids_are_gadget_index_errors_and_write_nothing(name):
    ids, arrived = _INDEX_BAD[name]
    a, b = cpu_table(), cpu_table(BASE + 1)
    n = _idx_np(ids).shape if not isinstance(ids, range) or len(ids) < 100 else None
    data = torch.zeros((n if n is not None else (1,)) + (DIM,))
    calls = {
        "getData": lambda: a.getData(ids),
        "getData_unchecked": lambda: a.getData(ids, check_ids=False),
        "insertData": lambda: a.insertData(data, ids),
        "insertData_unchecked": lambda: a.insertData(data, ids, check_ids=False),
        "gather_many": lambda: gl.gather_many([a, b], ids),
        "scatter_many": lambda: gl.scatter_many([a, b], [data, data], ids),
    }
    for call, fn in calls.items():
        with pytest.raises(gl.GadgetIndexError) as ei:
            fn()
        assert isinstance(ei.value, IndexError)
        msg = str(ei.value)
        assert arrived in msg, (call, msg)
        assert "[0, 9]" in msg or "10 rows" in msg, (call, msg)
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
    np.testing.assert_array_equal(b.getNumpyVersion(), BASE + 1)


def _big_ids():
    """name -> (ids, the offending id)"""
    cases = {
        "list_2**63": ([1, 2**63], 2**63),
        "np_uint64_2**64-1": (np.array([2**64 - 1], dtype=np.uint64), 2**64 - 1),
        "python_int_2**70": (2**70, 2**70),
        "python_int_-2**70": (-(2**70), -(2**70)),
        "range_past_2**63": (range(2**63, 2**63 + 2), 2**63),
    }
    if hasattr(torch, "uint64"):
        cases["torch_uint64_2**63"] = (torch.tensor([2**63], dtype=torch.uint64), 2**63)
    return cases


BIG = _big_ids()


@pytest.mark.parametrize("name", sorted(BIG))
def test_ids_beyond_int64_are_index_errors_that_say_what_was_expected(name):
    """README: a bad id raises an error "that says what was expected and what arrived".
    Every other out-of-range id's message names the id and the table's valid range; here at
    least one of the two must be named (the offending id, or the table's rows)."""
    ids, value = BIG[name]
    a, b = cpu_table(), cpu_table(BASE + 1)
    for fn in (
        lambda: a.getData(ids),
        lambda: a.insertData(torch.zeros(1, DIM), ids),
        lambda: gl.scatter_many([a, b], [torch.zeros(1, DIM)] * 2, ids),
    ):
        with pytest.raises(gl.GadgetIndexError) as ei:
            fn()
        msg = str(ei.value)
        assert str(value) in msg or "[0, 9]" in msg or "10 rows" in msg, msg
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
    np.testing.assert_array_equal(b.getNumpyVersion(), BASE + 1)


def test_ids_on_meta_device_are_type_errors():
    a = cpu_table()
    with pytest.raises(gl.GadgetTypeError) as ei:
        a.getData(torch.tensor([1], device="meta"))
    assert "meta" in str(ei.value) and "CPU" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        a.insertData(torch.zeros(1, DIM), torch.tensor([1], device="meta"))
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)


@pytest.mark.parametrize("flag", ["False", "True", 2, None, 0.0], ids=repr)
def test_boolean_flags_refuse_non_bool(flag):
    a, b = cpu_table(), cpu_table()
    for fn in (
        lambda: a.getData([1], check_ids=flag),
        lambda: a.insertData(torch.zeros(1, DIM), [1], check_ids=flag),
        lambda: gl.gather_many([a, b], [1], check_ids=flag),
        lambda: gl.scatter_many([a, b], [torch.zeros(1, DIM)] * 2, [1], check_ids=flag),
        lambda: a.getNumpyVersion(copy=flag),
    ):
        with pytest.raises(gl.GadgetTypeError) as ei:
            fn()
        assert "True or False" in str(ei.value)
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)


def test_out_that_is_part_of_the_table_is_unchanged_on_a_bad_id():
    g = cpu_table()
    with pytest.raises(gl.GadgetIndexError):
        g.getData([3, 11], out=g.as_tensor()[0:2])
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)


@pytest.mark.parametrize(
    "out,err,words",
    [
        (torch.empty(2, DIM, dtype=torch.float64), gl.GadgetTypeError, ("float32", "float64")),
        (torch.empty(3, DIM), gl.GadgetValueError, ("(2, 4)", "(3, 4)")),
        (torch.empty(DIM, 2).t(), gl.GadgetValueError, ("contiguous",)),
        (np.zeros((2, DIM), np.float32), gl.GadgetTypeError, ("tensor", "ndarray")),
    ],
    ids=["dtype", "shape", "noncontig", "numpy"],
)
def test_out_validation(out, err, words):
    g = cpu_table()
    with pytest.raises(err) as ei:
        g.getData([1, 2], out=out)
    for w in words:
        assert w in str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)


# ---------------------------------------------------------------------------------------
# 4. insertData data validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,err,words",
    [
        (torch.ones(2, DIM, dtype=torch.float64), gl.GadgetTypeError, ("float32", "float64")),
        (np.ones((2, DIM), np.float16), gl.GadgetTypeError, ("float32", "float16")),
        (torch.ones(2, DIM, dtype=torch.int8), gl.GadgetTypeError, ("float32", "int8")),
        (torch.ones(2, DIM, dtype=torch.bool), gl.GadgetTypeError, ("float32", "bool")),
        ([[1.5] * DIM] * 2, gl.GadgetTypeError, ("float32", "float64")),
        (1.0, gl.GadgetTypeError, ("tensor", "float")),
        (torch.ones(DIM), gl.GadgetValueError, ("(2, 4)", "(4,)")),
        (torch.ones(2, DIM + 1), gl.GadgetValueError, ("(2, 4)", "(2, 5)")),
        (torch.ones(2, 1, DIM), gl.GadgetValueError, ("(2, 4)", "(2, 1, 4)")),
        (torch.ones(2, DIM, device="meta"), gl.GadgetTypeError, ("meta",)),
    ],
    ids=[
        "f64",
        "np_f16",
        "int8",
        "bool",
        "list_f64",
        "scalar",
        "broadcast",
        "width",
        "extra_axis",
        "meta",
    ],
)
def test_insertdata_refuses_wrong_data_and_names_expected_and_got(data, err, words):
    g = cpu_table()
    with pytest.raises(err) as ei:
        g.insertData(data, [1, 2])
    for w in words:
        assert w in str(ei.value), str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    with pytest.raises(err):
        g[[1, 2]] = data
    np.testing.assert_array_equal(g.getNumpyVersion(), BASE)


def test_insertdata_accepts_big_endian_and_strided_arrays_of_the_dtype():
    g = cpu_table()
    g.insertData(np.full((2, DIM), 7.25, dtype=">f4"), [1, 2])
    blk = np.arange(8, dtype=np.float32).reshape(DIM, 2).T  # non-contiguous (2, 4)
    g.insertData(blk, [4, 5])
    g.insertData(torch.arange(8, dtype=torch.float32).reshape(2, DIM).flip(0), [7, 8])
    ref = BASE.copy()
    ref[[1, 2]] = 7.25
    ref[[4, 5]] = blk
    ref[[7, 8]] = np.arange(8, dtype=np.float32).reshape(2, DIM)[::-1]
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


# ---------------------------------------------------------------------------------------
# 5. gather_many / scatter_many over mismatched tables
# ---------------------------------------------------------------------------------------


def test_gather_many_and_scatter_many_refuse_different_row_counts():
    a, short = cpu_table(), cpu_table(BASE[:5])
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.gather_many([a, short], [1, 2])
    assert "10" in str(ei.value) and "5" in str(ei.value)
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.scatter_many([a, short], [torch.zeros(2, DIM)] * 2, [1, 2])
    assert "10" in str(ei.value) and "5" in str(ei.value)
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
    np.testing.assert_array_equal(short.getNumpyVersion(), BASE[:5])


@pytest.mark.parametrize("k", [1, 3])
def test_scatter_many_refuses_wrong_number_of_row_tensors(k):
    a, b = cpu_table(), cpu_table(BASE + 1)
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.scatter_many([a, b], [torch.zeros(2, DIM)] * k, [1, 2])
    assert "2 tables" in str(ei.value) and str(k) in str(ei.value)
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
    np.testing.assert_array_equal(b.getNumpyVersion(), BASE + 1)


@pytest.mark.parametrize(
    "bad,err",
    [
        (torch.zeros(2, DIM, dtype=torch.float64), gl.GadgetTypeError),
        (torch.zeros(3, DIM), gl.GadgetValueError),
        (torch.zeros(2, DIM + 1), gl.GadgetValueError),
        (torch.zeros(2, DIM, device="meta"), gl.GadgetTypeError),
    ],
    ids=["dtype", "rows", "width", "meta"],
)
def test_scatter_many_bad_last_table_writes_no_table(bad, err, tmp_path):
    np.save(tmp_path / "f.npy", BASE)
    f = gl.DataGadget(str(tmp_path / "f.npy"), placement="file", device="cpu")
    try:
        a, b = cpu_table(), cpu_table(BASE + 1)
        with pytest.raises(err) as ei:
            gl.scatter_many([a, f, b], [torch.ones(2, DIM)] * 2 + [bad], [1, 2])
        assert "table 2 of 3" in str(ei.value)
        f.flush()
        np.testing.assert_array_equal(a.getNumpyVersion(), BASE)
        np.testing.assert_array_equal(b.getNumpyVersion(), BASE + 1)
        np.testing.assert_array_equal(f.getNumpyVersion(), BASE)
        np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), BASE)
    finally:
        f.close()


def test_gather_many_and_scatter_many_refuse_non_lists():
    a = cpu_table()
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.gather_many([], [1])
    assert "empty" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.gather_many(a, [1])
    assert "DataGadget" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.gather_many([a, torch.zeros(ROWS, DIM)], [1])
    assert "Tensor" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many([], [], [1])
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many([a, BASE.copy()], [torch.zeros(1, DIM)] * 2, [1])
    np.testing.assert_array_equal(a.getNumpyVersion(), BASE)


def test_many_over_tables_of_different_widths_and_dtypes_matches_numpy():
    wide = (np.arange(ROWS * 7, dtype=np.float64).reshape(ROWS, 7)) / 3
    ints = np.arange(ROWS, dtype=np.int16) * -3
    flags = np.arange(ROWS) % 3 == 0
    a, w, i, fl = cpu_table(), cpu_table(wide), cpu_table(ints), cpu_table(flags)
    ids = torch.tensor([[9, 0], [4, 9]]).t()  # non-contiguous 2-D ids
    outs = gl.gather_many([a, w, i, fl], ids)
    idx = ids.numpy()
    for o, src in zip(outs, (BASE, wide, ints, flags), strict=True):
        assert tuple(o.shape) == idx.shape + src.shape[1:]
        np.testing.assert_array_equal(o.numpy(), src[idx])
    # 0-d ids: one row per table, without a leading axis
    outs = gl.gather_many([a, w, i, fl], np.int64(3))
    assert [tuple(o.shape) for o in outs] == [(DIM,), (7,), (), ()]
    # scatter with a repeated id: the last occurrence wins in every table
    sids = np.array([2, 5, 2], dtype=np.uint8)
    rows = [
        torch.arange(3 * DIM, dtype=torch.float32).reshape(3, DIM),
        torch.arange(21, dtype=torch.float64).reshape(3, 7),
        torch.tensor([11, 22, 33], dtype=torch.int16),
        torch.tensor([True, False, False]),
    ]
    gl.scatter_many([a, w, i, fl], rows, sids)
    for g, src, r in zip((a, w, i, fl), (BASE, wide, ints, flags), rows, strict=True):
        ref = src.copy()
        for k, j in enumerate(sids):
            ref[j] = r[k].numpy()
        np.testing.assert_array_equal(g.getNumpyVersion(), ref)


# ---------------------------------------------------------------------------------------
# 6. Files: missing paths, truncated .npy, datasets not in the file
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_missing_path_is_file_not_found_with_errno_and_filename(tmp_path, placement):
    for p in (tmp_path / "nope.npy", tmp_path / "no_dir" / "x.npy"):
        with pytest.raises(gl.GadgetFileNotFoundError) as ei:
            gl.DataGadget(str(p), placement=placement, device="cpu")
        e = ei.value
        assert isinstance(e, FileNotFoundError) and isinstance(e, gl.GadgetFileError)
        assert e.errno == errno.ENOENT
        assert str(p) in str(e) and os.fspath(e.filename) == str(p)


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("cut", ["data", "header", "magic", "empty", "junk"])
def test_damaged_npy_is_a_gadget_file_error(tmp_path, placement, cut):
    np.save(tmp_path / "t.npy", BASE)
    raw = (tmp_path / "t.npy").read_bytes()
    body = {
        "data": raw[:-7],
        "header": raw[:40],
        "magic": raw[:4],
        "empty": b"",
        "junk": b"not a numpy file" * 8,
    }[cut]
    bad = tmp_path / "bad.npy"
    bad.write_bytes(body)
    with pytest.raises(gl.GadgetFileError) as ei:
        gl.DataGadget(str(bad), placement=placement, device="cpu")
    assert not isinstance(ei.value, FileNotFoundError)
    assert str(bad) in str(ei.value)
    if cut == "data":  # what the header promised, and what the file has
        assert "(10, 4)" in str(ei.value) and str(len(body)) in str(ei.value)


def test_load_and_loadcupy_failures_leave_the_table_unchanged(tmp_path):
    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    np.save(tmp_path / "t.npy", BASE * 3)
    (tmp_path / "trunc.npy").write_bytes((tmp_path / "t.npy").read_bytes()[:-9])
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["emb"] = BASE * 3
    zarr.save_group(str(tmp_path / "g.zarr"), emb=BASE * 3)
    g = cpu_table()
    view = g.as_tensor()
    cases = [
        (
            lambda: g.loadCupy(str(tmp_path / "missing.npy")),
            gl.GadgetFileNotFoundError,
            "missing.npy",
        ),
        (lambda: g.loadCupy(str(tmp_path / "trunc.npy")), gl.GadgetFileError, "truncated"),
        (lambda: g.load(str(tmp_path / "trunc.npy")), gl.GadgetFileError, "truncated"),
        (lambda: g.load(str(tmp_path / "t.h5"), dataset="nope"), gl.GadgetKeyError, "emb"),
        (lambda: g.load(str(tmp_path / "g.zarr"), dataset="nope"), gl.GadgetKeyError, "emb"),
    ]
    for fn, err, word in cases:
        with pytest.raises(err) as ei:
            fn()
        assert word in str(ei.value)
        np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
    np.testing.assert_array_equal(view.numpy(), BASE)  # the storage was not replaced either


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_dataset_not_in_hdf5_or_zarr_is_key_error_listing_what_is_there(tmp_path, placement):
    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["emb"] = BASE
        f["grp/sub"] = BASE
    zarr.save_group(str(tmp_path / "g.zarr"), emb=BASE, lab=np.arange(ROWS))
    for path, ds, there in (
        (tmp_path / "t.h5", "nope", ("emb", "grp/sub")),
        (tmp_path / "t.h5", "grp", ("emb", "grp/sub")),
        (tmp_path / "g.zarr", "nope", ("emb", "lab")),
    ):
        with pytest.raises(gl.GadgetKeyError) as ei:
            gl.DataGadget(str(path), dataset=ds, placement=placement, device="cpu")
        assert isinstance(ei.value, KeyError)
        msg = str(ei.value)
        assert repr(ds) in msg or ds in msg
        for name in there:
            assert name in msg
    # a file with several datasets and no dataset= : asks for one
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(str(tmp_path / "t.h5"), placement=placement, device="cpu")
    assert "dataset=" in str(ei.value)
    # the nested name works, and reads the rows
    g = gl.DataGadget(str(tmp_path / "t.h5"), dataset="grp/sub", placement=placement, device="cpu")
    try:
        np.testing.assert_array_equal(g.getData(range(9, -1, -3)).numpy(), BASE[9::-3])
    finally:
        g.close()


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_bad_writes_to_file_tables_leave_the_file_unchanged(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    if fmt == "npy":
        np.save(path, BASE)
        kw = {}
    elif fmt == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "w") as f:
            f.create_dataset("emb", data=BASE, chunks=(3, DIM))
        kw = {"dataset": "emb"}
    else:
        zarr = pytest.importorskip("zarr")
        zarr.save_group(str(path), emb=BASE)
        kw = {"dataset": "emb"}
    g = gl.DataGadget(str(path), placement="file", device="cpu", **kw)
    try:
        bad = [
            (lambda: g.insertData(torch.ones(2, DIM), [1, 10]), gl.GadgetIndexError),
            (
                lambda: g.insertData(torch.ones(2, DIM), torch.tensor([True, False])),
                gl.GadgetTypeError,
            ),
            (lambda: g.insertData(torch.ones(2, DIM), [1.0, 2.0]), gl.GadgetTypeError),
            (
                lambda: g.insertData(torch.ones(2, DIM, dtype=torch.float64), [1, 2]),
                gl.GadgetTypeError,
            ),
            (lambda: g.insertData(torch.ones(3, DIM), [1, 2]), gl.GadgetValueError),
            (lambda: g.insertData(torch.ones(1, DIM), [2**63]), gl.GadgetIndexError),
            (
                lambda: g.insertData(torch.ones(2, DIM), torch.tensor([-1, 2], dtype=torch.int8)),
                gl.GadgetIndexError,
            ),
        ]
        for fn, err in bad:
            with pytest.raises(err):
                fn()
        g.flush()
        np.testing.assert_array_equal(g.getNumpyVersion(), BASE)
        # ids of other kinds read the file as NumPy would
        for ids in (np.uint8([9, 0]), torch.arange(10)[::4], range(7, 2, -2), np.int64(6)):
            np.testing.assert_array_equal(g.getData(ids).numpy(), BASE[_idx_np(ids)])
    finally:
        g.close()
    if fmt == "npy":
        np.testing.assert_array_equal(np.load(path), BASE)


# ---------------------------------------------------------------------------------------
# 7. Constructors and the other public classes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,err,word",
    [
        ((10, -1), gl.GadgetValueError, "(10, -1)"),
        ((-1,), gl.GadgetValueError, "(-1,)"),
        ((10.0, 4), gl.GadgetTypeError, "10.0"),
        ((True, 2), gl.GadgetTypeError, "True"),
        ((), gl.GadgetTypeError, "()"),
    ],
    ids=["neg_dim", "neg_rows", "float_dim", "bool_dim", "empty"],
)
def test_tuple_shape_validation(shape, err, word):
    with pytest.raises(err) as ei:
        gl.DataGadget(shape, dtype="float32", placement="cpu", device="cpu")
    assert word in str(ei.value)


def test_tuple_shape_with_numpy_int_dims_is_zero_filled():
    g = gl.DataGadget((np.int64(3), np.int32(2)), dtype="int16", placement="cpu", device="cpu")
    assert g.shape == (3, 2) and g.dtype == torch.int16
    np.testing.assert_array_equal(g.getNumpyVersion(), np.zeros((3, 2), np.int16))


@pytest.mark.parametrize(
    "dtype",
    ["complex64", "uint16", np.uint32, torch.complex64, "bogus", object],
    ids=["complex_name", "uint16_name", "np_uint32", "torch_complex", "bogus", "object"],
)
def test_unsupported_dtypes_are_type_errors(dtype):
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget((3, 2), dtype=dtype, placement="cpu", device="cpu")
    assert "float32" in str(ei.value)  # names what a table holds


def test_placement_strategy_device_and_options_validation():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(BASE, placement="gpu", device="cpu")
    assert "gpu" in str(ei.value) and "pinned" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(BASE, placement=1, device="cpu")
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(BASE, placement="cpu", device="cpu", strategy="fastest")
    assert "fastest" in str(ei.value) and "kernel" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(BASE, placement="cpu", device="cpu", cache_bytes=10)
    assert "cache_bytes" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(BASE, placement="cpu", device="tpu")
    assert "tpu" in str(ei.value)
    g = cpu_table()
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.getData([1], device="meta")
    assert "meta" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(BASE, "False", placement="cpu", device="cpu")
    assert "CPUPinn" in str(ei.value)


def test_source_dtype_casts_as_documented():
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(BASE.astype(np.float64), dtype="int64", placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.DataGadget(np.array([2**40]), dtype="int32", placement="cpu", device="cpu")
    assert "int32" in str(ei.value) and str(2**40) in str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.array([1e300]), dtype="float32", placement="cpu", device="cpu")
    g = gl.DataGadget(
        np.arange(ROWS, dtype=np.int64), dtype="float32", placement="cpu", device="cpu"
    )
    assert g.dtype == torch.float32
    np.testing.assert_array_equal(g.getNumpyVersion(), np.arange(ROWS, dtype=np.float32))
    be = gl.DataGadget(BASE.astype(">f4"), placement="cpu", device="cpu")
    assert be.dtype == torch.float32
    np.testing.assert_array_equal(be.getNumpyVersion(), BASE)


def test_dataset_indexing_follows_its_docstring():
    x = BASE.copy()
    y = np.arange(ROWS) * 10
    ds = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    r = ds[-1]
    assert isinstance(r, tuple)
    np.testing.assert_array_equal(r[0].numpy(), x[-1])
    assert int(r[1]) == y[-1]
    r = ds[np.int16(-2)]
    np.testing.assert_array_equal(r[0].numpy(), x[-2])
    b = ds[torch.tensor(4)]  # a 0-d tensor is an id: a GadgetBatch of unbatched rows
    assert isinstance(b, gl.GadgetBatch)
    np.testing.assert_array_equal(b[0].numpy(), x[4])
    for ids in (torch.arange(10)[::3], np.uint8([9, 1]), range(8, 1, -3), [[1, 2], [3, 4]], (1, 0)):
        b = ds[ids]
        idx = _idx_np(ids)
        np.testing.assert_array_equal(b[0].numpy(), x[idx])
        np.testing.assert_array_equal(b[1].numpy(), y[idx])
    np.testing.assert_array_equal(ds[-3:][0].numpy(), x[-3:])
    np.testing.assert_array_equal(ds[::-4][1].numpy(), y[::-4])
    for bad, err in (
        (torch.tensor(-1), gl.GadgetIndexError),
        (np.array(-1), gl.GadgetIndexError),
        (-11, gl.GadgetIndexError),
        (10, gl.GadgetIndexError),
        ([1, 10], gl.GadgetIndexError),
        ([-1], gl.GadgetIndexError),
        (True, gl.GadgetTypeError),
        ([1.0], gl.GadgetTypeError),
        (torch.ones(ROWS, dtype=torch.bool), gl.GadgetTypeError),
    ):
        with pytest.raises(err):
            ds[bad]
    with pytest.raises(gl.GadgetTypeError):
        ds.gather(slice(0, 2))  # a slice of rows is ds[a:b]
    # the columns (copies of x and y) are unchanged, and so are the sources
    np.testing.assert_array_equal(ds[range(ROWS)][0].numpy(), BASE)
    np.testing.assert_array_equal(x, BASE)


def test_dataset_constructor_validation(tmp_path):
    x = BASE.copy()
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.GadgetDataset(x, np.arange(5), placement="cpu", device="cpu")
    assert "10" in str(ei.value) and "5" in str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(x[:0], placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(np.array(3.0), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetDataset(5, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetKeyError):
        gl.GadgetDataset(x, placement="gpu", device="cpu")
    with pytest.raises(gl.GadgetFileNotFoundError) as ei:
        gl.GadgetDataset(str(tmp_path / "none.npy"), placement="cpu", device="cpu")
    assert ei.value.errno == errno.ENOENT


@pytest.mark.parametrize(
    "kwargs,err,word",
    [
        ({"batch_size": 0}, gl.GadgetValueError, "batch_size"),
        ({"batch_size": 2.0}, gl.GadgetTypeError, "batch_size"),
        ({"batch_size": True}, gl.GadgetTypeError, "batch_size"),
        ({"batch_size": 2, "order": "shuffle"}, gl.GadgetKeyError, "shuffle"),
        ({"batch_size": 2, "seed": -1}, gl.GadgetValueError, "seed"),
        ({"batch_size": 2, "seed": 2**64}, gl.GadgetValueError, "seed"),
        ({"batch_size": 2, "drop_last": True, "pad": True}, gl.GadgetValueError, "pad"),
        ({"batch_size": 2, "num_replicas": 2}, gl.GadgetValueError, "rank"),
        ({"batch_size": 2, "num_replicas": 2, "rank": 2}, gl.GadgetValueError, "rank"),
        ({"batch_size": 2, "num_replicas": 2, "rank": -1}, gl.GadgetValueError, "rank"),
        ({"batch_size": 2, "window_chunks": 0}, gl.GadgetValueError, "window_chunks"),
        ({"batch_size": 2, "chunk_rows": 2.5}, gl.GadgetTypeError, "chunk_rows"),
        ({"batch_size": 2, "coalesce": 0}, gl.GadgetValueError, "coalesce"),
        (
            {"batch_size": 4, "num_replicas": 2, "rank": 0, "drop_last": True},
            gl.GadgetValueError,
            "drop_last",
        ),
    ],
)
def test_sampler_parameter_validation(kwargs, err, word):
    with pytest.raises(err) as ei:
        gl.GadgetSampler(7, **kwargs)
    assert word in str(ei.value)


def test_sampler_row_count_validation_and_numpy_ints():
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(0, batch_size=2)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(-5, batch_size=2)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.GadgetSampler("/tmp/table.npy", batch_size=2)
    assert "path" in str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(1, batch_size=2, num_replicas=2, rank=0)
    s = gl.GadgetSampler(np.int64(10), batch_size=np.int64(3), order="sequential")
    assert [b.tolist() for b in s] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    s = gl.GadgetSampler(10, batch_size=3, seed=2**64 - 1)
    seen = sorted(i for b in s for i in b.tolist())
    assert seen == list(range(10))


def test_loader_parameter_validation():
    ds = gl.GadgetDataset(BASE.copy(), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds)
    for kw in ({"shuffle": True}, {"collate_fn": list}, {"batch_sampler": [[0]]}):
        with pytest.raises(gl.GadgetTypeError):
            gl.GadgetLoader(ds, batch_size=2, **kw)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ROWS, batch_size=2), order="random")
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetLoader(torch.utils.data.Subset(ds, [1, 2]), batch_size=2)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=2, in_order=False)
    with pytest.raises(gl.GadgetTypeError):
        gl.GadgetLoader(ds, batch_size=2, generator=3)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, batch_size=2, prefetch=-1)
    with pytest.raises(gl.GadgetValueError) as ei:
        list(gl.GadgetLoader(ds, sampler=gl.GadgetSampler(20, batch_size=5, order="sequential")))
    assert "20" in str(ei.value) and "10" in str(ei.value)
    # the loader with rank options gives the sampler's shares, rows as in the table
    got = [
        np.concatenate(
            [
                b[0].numpy()
                for b in gl.GadgetLoader(
                    ds, batch_size=2, order="sequential", num_replicas=2, rank=r
                )
            ]
        )
        for r in (0, 1)
    ]
    np.testing.assert_array_equal(np.concatenate(got), BASE)


def test_offloaded_embedding_parameter_and_id_validation():
    E = gl.OffloadedEmbedding
    for bad, err in (
        (0, gl.GadgetValueError),
        (-1, gl.GadgetValueError),
        (True, gl.GadgetTypeError),
        ("10", gl.GadgetTypeError),
        (10.5, gl.GadgetValueError),
    ):
        with pytest.raises(err) as ei:
            E(bad, 4, placement="cpu", device="cpu")
        assert "num_embeddings" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        E(10, 4, placement="cpu", device="cpu", dtype=torch.int64)
    with pytest.raises(gl.GadgetKeyError):
        E(10, 4, placement="file", device="cpu")
    emb = E(ROWS, DIM, placement="cpu", device="cpu")
    w0 = np.array(emb.weight.getNumpyVersion(), copy=True)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    for ids, err in (
        (torch.tensor([1.0]), gl.GadgetTypeError),
        (torch.tensor([True]), gl.GadgetTypeError),
        (torch.tensor([-1]), gl.GadgetIndexError),
        (torch.tensor([ROWS]), gl.GadgetIndexError),
        (torch.tensor([2**63 - 1]), gl.GadgetIndexError),
        (torch.tensor([300], dtype=torch.int16), gl.GadgetIndexError),
    ):
        with pytest.raises(err):
            emb(ids).sum().backward()
    opt.step()
    opt.zero_grad()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), w0)
    # accepted id kinds give the table's rows
    for ids in (
        torch.tensor([1, 2], dtype=torch.uint8),
        torch.arange(10)[::3],
        np.array([4, 4]),
        torch.tensor(3),
    ):
        with torch.no_grad():
            out = emb(ids)
        np.testing.assert_array_equal(out.numpy(), w0[_idx_np(ids)])


def test_modelfactory_bad_ids_leave_table_and_variable_unchanged():
    emb = torch.nn.Embedding(3, DIM)
    sw = gl.ModelFactory(emb, total_classes=100, embed_dimension=DIM, placement="cpu")
    sw.uniformDistributionInit(-0.5, 0.5)
    table = np.array(sw.getNumpyVersion(), copy=True)
    sw.beforeForwardPass(torch.tensor([7, 8]))
    w = emb.weight.detach().cpu().clone()
    for ids, err in (
        (torch.tensor([5, 100]), gl.GadgetIndexError),
        (torch.tensor([-1]), gl.GadgetIndexError),
        (torch.tensor([1.0]), gl.GadgetTypeError),
        (torch.tensor([True, False]), gl.GadgetTypeError),
        (torch.tensor([2**63 - 1]), gl.GadgetIndexError),
    ):
        with pytest.raises(err):
            sw.beforeForwardPass(ids)
        np.testing.assert_array_equal(sw.getNumpyVersion(), table)
        torch.testing.assert_close(emb.weight.detach().cpu(), w, rtol=0, atol=0)
        with pytest.raises(err):
            sw.afterOptimizerStep(ids)
        np.testing.assert_array_equal(sw.getNumpyVersion(), table)
    for args, err in (
        ((0.5, -0.5), gl.GadgetValueError),
        ((float("nan"), 1.0), gl.GadgetValueError),
    ):
        with pytest.raises(err):
            sw.uniformDistributionInit(*args)
    with pytest.raises(gl.GadgetValueError):
        sw.normalDistributionInit(0.0, -1.0)
    np.testing.assert_array_equal(sw.getNumpyVersion(), table)
    with pytest.raises(gl.GadgetValueError):
        gl.ModelFactory(emb, total_classes=100, embed_dimension=DIM + 1, placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.ModelFactory(emb, total_classes=True, embed_dimension=DIM, placement="cpu")
    with pytest.raises(gl.GadgetTypeError):
        gl.ModelFactory(
            emb, total_classes=100, embed_dimension=DIM, placement="cpu", datatype="int64"
        )


_PART_CASES = {
    "repeated_ids_slice": (([1, 1, 2], slice(0, 2)), (3, 2)),
    "ids_then_int": (([4, 2, 4], 3), (3,)),
    "ids_then_negative_int": (([0, 9], -1), (2,)),
    "uint8_ids_step": ((np.uint8([3, 3]), slice(None, None, 2)), (2, 2)),
    "range_clipped_slice": ((range(9, 0, -4), slice(2, 100)), (3, 2)),
    "rows_slice_then_int": ((slice(7, None), 1), (3,)),
}


@pytest.mark.parametrize("kind", ["cpu", "npy", "h5", "zarr"])
def test_part_of_rows_writes_match_numpy_sequential_assignment(tmp_path, kind):
    """README: a tuple (rows, then slices or ints into each row) writes only that part;
    a repeated id takes its last occurrence (NumPy's sequential assignment)."""
    if kind == "cpu":

        def make():
            return cpu_table()
    else:
        path = tmp_path / f"t.{kind}"
        kw = {} if kind == "npy" else {"dataset": "emb"}

        def make():
            if kind == "npy":
                np.save(path, BASE)
            elif kind == "h5":
                h5py = pytest.importorskip("h5py")
                with h5py.File(path, "w") as f:
                    f.create_dataset("emb", data=BASE, chunks=(3, DIM))
            else:
                zarr = pytest.importorskip("zarr")
                zarr.save_group(str(path), emb=BASE)
            return gl.DataGadget(str(path), placement="file", device="cpu", **kw)

    for name, ((rows, part), shape) in _PART_CASES.items():
        g = make()
        try:
            r = np.arange(ROWS)[rows] if isinstance(rows, slice) else _idx_np(rows)
            np.testing.assert_array_equal(g[rows, part].numpy(), BASE[r][:, part], err_msg=name)
            data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 100.0
            g[rows, part] = torch.from_numpy(data)
            ref = BASE.copy()
            for k, i in enumerate(r):
                ref[i, part] = data[k]
            np.testing.assert_array_equal(g.getNumpyVersion(), ref, err_msg=name)
            # refusals leave the table as it now is
            for index, block, err in (
                (([1, 10], 0), torch.ones(2), gl.GadgetIndexError),
                (([1, 2], DIM), torch.ones(2), gl.GadgetIndexError),
                (([1, 2], slice(0, 2)), torch.ones(2, 3), gl.GadgetValueError),
                (([1, 2], 1.0), torch.ones(2), gl.GadgetTypeError),
                (([1, 2], slice(None, None, -1)), torch.ones(2, DIM), gl.GadgetValueError),
            ):
                with pytest.raises(err):
                    g[index] = block
            np.testing.assert_array_equal(g.getNumpyVersion(), ref, err_msg=name)
        finally:
            g.close()
