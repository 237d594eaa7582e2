"""Black-box review (session 31) of the transfer engine and multi-table API
(``gadgetloader.transfer``: gather, scatter, resolve_strategy, STRATEGIES; forced
strategies; ``gl.gather_many`` / ``gl.scatter_many``; ``check_ids``; repeated ids;
row widths, dtypes, 1-D tables, empty requests, ``out=``, id dtypes; behaviour without
a GPU); written from README.md, SPEC.md and the public docstrings only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl
import gadgetloader.transfer as tr


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


STRATS = ("auto", "kernel", "sorted", "hybrid", "torch")
CONCRETE = ("kernel", "sorted", "hybrid", "torch")
HAVE_CUPY = importlib.util.find_spec("cupy") is not None

ALL_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


def _rand(shape, dtype, seed=0):
    """A deterministic torch tensor of ``dtype`` (no NaNs)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**20)), min(info.max, 2**20)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def _seq_assign(ref: torch.Tensor, ids, rows: torch.Tensor) -> torch.Tensor:
    """NumPy-style sequential assignment: the last occurrence of an id wins."""
    out = ref.clone()
    flat_ids = torch.as_tensor(np.asarray(ids)).reshape(-1).tolist()
    flat_rows = rows.reshape((len(flat_ids),) + tuple(ref.shape[1:]))
    for i, j in enumerate(flat_ids):
        out[j] = flat_rows[i]
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (dtype, shape and values)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a, b)


def _cpu_table(data, strategy="auto", **kw):
    return gl.DataGadget(data, placement="cpu", strategy=strategy, **kw)


# ---------------------------------------------------------------------------
# gadgetloader.transfer: STRATEGIES and resolve_strategy
# ---------------------------------------------------------------------------


def test_strategies_tuple_is_documented_list():
    assert tr.STRATEGIES == STRATS


@pytest.mark.parametrize("name", ["fast", "Kernel", "", "auto ", "cuda"])
def test_resolve_strategy_unknown_name_is_keyerror_listing_valid(name):
    table = torch.zeros(10, 4)
    for kind in ("gather", "scatter"):
        with pytest.raises(gl.GadgetKeyError) as ei:
            tr.resolve_strategy(name, table, 3, kind=kind)
        assert isinstance(ei.value, KeyError)
        msg = str(ei.value)
        for valid in STRATS:
            assert valid in msg


@pytest.mark.parametrize("strategy", STRATS)
def test_resolve_strategy_is_concrete(strategy):
    table = torch.zeros(64, 8)
    for kind in ("gather", "scatter"):
        for n_ids in (0, 1, 1024, 1025, 300_000):
            got = tr.resolve_strategy(strategy, table, n_ids, kind=kind)
            assert got in CONCRETE, (kind, n_ids)
            if not HAVE_CUPY:
                # "Without CuPy every strategy but ``torch`` becomes ``torch``."
                assert got == "torch", (kind, n_ids)


def test_transfer_gather_and_scatter_refuse_unknown_strategy_table_unchanged():
    table = torch.arange(40.0).reshape(10, 4)
    before = table.clone()
    with pytest.raises(gl.GadgetKeyError):
        tr.gather(table, torch.tensor([1, 2]), strategy="fastest")
    with pytest.raises(gl.GadgetKeyError):
        tr.scatter(table, torch.tensor([1, 2]), torch.ones(2, 4), strategy="fastest")
    assert torch.equal(table, before)


# ---------------------------------------------------------------------------
# gadgetloader.transfer.gather / scatter, forcing each strategy
# ---------------------------------------------------------------------------

TRANSFER_DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool)


@pytest.mark.parametrize("strategy", STRATS)
def test_transfer_gather_matches_reference(strategy):
    for dtype in TRANSFER_DTYPES:
        table = _rand((50, 6), dtype, seed=1)
        ids = torch.tensor([[0, 49, 7], [7, 7, 3]])
        host = table if strategy == "hybrid" else None
        got = tr.gather(table, ids, strategy=strategy, host=host)
        assert got.shape == (2, 3, 6), dtype
        assert got.is_contiguous(), dtype
        assert _same(got, table[ids]), dtype


@pytest.mark.parametrize("strategy", STRATS)
def test_transfer_scatter_last_occurrence_wins(strategy):
    for dtype in TRANSFER_DTYPES:
        table = _rand((30, 5), dtype, seed=2)
        ids = torch.tensor([4, 9, 4, 0, 29, 9, 4])
        rows = _rand((7, 5), dtype, seed=3)
        expected = _seq_assign(table, ids, rows)
        tr.scatter(table, ids, rows, strategy=strategy)
        assert _same(table, expected), dtype


def test_transfer_gather_fills_out():
    for strategy in STRATS:
        table = torch.arange(40.0).reshape(10, 4)
        out = torch.full((3, 4), -1.0)
        got = tr.gather(table, torch.tensor([9, 0, 9]), out=out, strategy=strategy)
        assert torch.equal(out, table[[9, 0, 9]])
        assert torch.equal(got, table[[9, 0, 9]])


def test_transfer_gather_returns_the_given_out():
    # docstring: "Rows ``table[ids]`` as a new (or the given ``out``) contiguous ... tensor."
    table = torch.arange(40.0).reshape(10, 4)
    out = torch.empty(3, 4)
    got = tr.gather(table, torch.tensor([1, 2, 3]), out=out)
    assert got is out


def test_transfer_empty_request_and_1d_table():
    for strategy in STRATS:
        table = torch.arange(10.0)
        empty = torch.zeros(0, dtype=torch.int64)
        assert tr.gather(table, empty, strategy=strategy).shape == (0,)
        got = tr.gather(table, torch.tensor([[9, 0], [3, 3]]), strategy=strategy)
        assert _same(got, table[torch.tensor([[9, 0], [3, 3]])])
        before = table.clone()
        tr.scatter(table, empty, torch.zeros(0), strategy=strategy)
        assert torch.equal(table, before)
        tr.scatter(table, torch.tensor([3, 3, 3]), torch.tensor([1.0, 2.0, 3.0]), strategy=strategy)
        assert table[3].item() == 3.0


def test_transfer_scatter_unique_sorted_writes_in_order():
    for strategy in STRATS:
        table = torch.arange(40.0).reshape(10, 4)
        ids = torch.tensor([2, 5, 7])
        rows = -torch.arange(12.0).reshape(3, 4) - 1
        expected = _seq_assign(table, ids, rows)
        tr.scatter(table, ids, rows, strategy=strategy, unique=True, ids_sorted=True)
        assert torch.equal(table, expected)


def test_transfer_scatter_check_raises_before_any_write():
    for strategy in STRATS:
        # docstring: ``check`` "is called ... before anything is written"
        table = torch.arange(40.0).reshape(10, 4)
        before = table.clone()

        class Bad(Exception):
            pass

        def check():
            raise Bad("ids are bad")

        with pytest.raises(Bad):
            tr.scatter(
                table, torch.tensor([1, 1, 2]), torch.ones(3, 4), strategy=strategy, check=check
            )
        assert torch.equal(table, before)
        calls = []
        tr.scatter(
            table,
            torch.tensor([1, 1, 2]),
            torch.ones(3, 4),
            strategy=strategy,
            check=lambda calls=calls: calls.append(1),
        )
        assert calls == [1]
        assert torch.equal(table[[1, 2]], torch.ones(2, 4))


@pytest.mark.parametrize("strategy", STRATS)
def test_transfer_many_repeats_large_request(strategy):
    # 70,000 ids (above the documented 65,536 dedup threshold) into 257 rows
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(257, 2, generator=gen)
    ids = torch.randint(0, 257, (70_000,), generator=gen)
    got = tr.gather(table, ids, strategy=strategy, host=table if strategy == "hybrid" else None)
    assert torch.equal(got, table[ids])
    rows = torch.randn(70_000, 2, generator=gen)
    # reference: last position of each id
    last = {}
    for pos, i in enumerate(ids.tolist()):
        last[i] = pos
    expected = table.clone()
    for i, pos in last.items():
        expected[i] = rows[pos]
    tr.scatter(table, ids, rows, strategy=strategy)
    assert torch.equal(table, expected)


def test_transfer_on_strided_views_touches_only_the_view():
    for strategy in STRATS:
        # interleaved state tables are strided views of one buffer
        buf = torch.arange(120.0).reshape(10, 12)
        b = buf.clone()
        v = b[:, 4:8]
        assert torch.equal(
            tr.gather(v, torch.tensor([9, 0, 9]), strategy=strategy), buf[[9, 0, 9], 4:8]
        )
        tr.scatter(
            v,
            torch.tensor([1, 1, 3]),
            -torch.tensor([[1.0], [2.0], [3.0]]).expand(3, 4).contiguous(),
            strategy=strategy,
        )
        exp = buf.clone()
        exp[1, 4:8] = -2
        exp[3, 4:8] = -3
        assert torch.equal(b, exp)
        b = buf.clone()
        tr.scatter(b[::2], torch.tensor([0, 4]), torch.zeros(2, 12), strategy=strategy)
        exp = buf.clone()
        exp[0] = 0
        exp[8] = 0
        assert torch.equal(b, exp)


# ---------------------------------------------------------------------------
# DataGadget(strategy=...): every row width and dtype, all strategies identical
# ---------------------------------------------------------------------------

WIDTH_CASES = [
    (torch.float32, (1,)),  # 1-wide, 4 B
    (torch.float64, (1,)),  # 8 B
    (torch.int64, (1,)),  # 8 B
    (torch.float32, (2,)),  # 8 B
    (torch.uint8, (8,)),  # 8 B
    (torch.bool, (8,)),  # 8 B
    (torch.int16, (16,)),  # 32 B
    (torch.float16, (16,)),  # 32 B
    (torch.bfloat16, (32,)),  # 64 B
    (torch.int8, (64,)),  # 64 B
    (torch.float32, (256,)),  # 1 KB
    (torch.int32, (4, 64)),  # 1 KB, 2-D rows
    (torch.float64, (512,)),  # 4 KB
    (torch.int32, (1024,)),  # 4 KB
    (torch.float32, ()),  # 1-D table
    (torch.bool, ()),  # 1-D bool table
    (torch.int64, ()),  # 1-D int64 table
]


@pytest.mark.parametrize(
    "dtype,row_shape",
    WIDTH_CASES,
    ids=[f"{str(d)[6:]}-{'x'.join(map(str, s)) or 'scalar'}" for d, s in WIDTH_CASES],
)
def test_widths_and_dtypes_getdata_insertdata_every_strategy(dtype, row_shape):
    n = 40
    ref = _rand((n,) + row_shape, dtype, seed=7)
    ids = np.array([[0, n - 1, 5, 5], [17, 0, 5, 3]], dtype=np.int64)
    wids = np.array([3, 11, 3, 39, 0, 11, 3], dtype=np.int32)
    rows = _rand((len(wids),) + row_shape, dtype, seed=8)
    expected_after = _seq_assign(ref, wids, rows)
    gathered = {}
    for s in STRATS:
        g = _cpu_table(ref.clone(), strategy=s)
        assert g.shape == (n,) + row_shape and g.dtype == dtype
        got = g.getData(ids)
        assert got.shape == ids.shape + row_shape, s
        assert _same(got, ref[torch.as_tensor(ids)]), s
        if dtype != torch.bfloat16:
            assert np.array_equal(got.numpy(), ref.numpy()[ids]), s
        gathered[s] = got
        g.insertData(rows, wids)
        assert _same(g.as_tensor(), expected_after), s
        assert _same(g[wids], expected_after[torch.as_tensor(wids, dtype=torch.int64)]), s
    for s in STRATS:
        assert _same(gathered[s], gathered["torch"]), s


def test_setitem_getitem_with_forced_strategy_match_numpy():
    for strategy in STRATS:
        a = np.arange(60, dtype=np.float32).reshape(20, 3)
        g = _cpu_table(a, strategy=strategy)
        ref = a.copy()
        ids = [4, 4, 19, 0]
        vals = np.arange(12, dtype=np.float32).reshape(4, 3) + 100
        g[ids] = vals
        for i, j in enumerate(ids):
            ref[j] = vals[i]
        assert np.array_equal(np.asarray(g), ref)
        assert np.array_equal(g[2:5].numpy(), ref[2:5])
        assert np.array_equal(g[[1, 2], 0].numpy(), ref[[1, 2], 0])


def test_datagadget_unknown_strategy_is_keyerror_listing_valid():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu", strategy="fastest")
    assert isinstance(ei.value, KeyError)
    for valid in STRATS:
        assert valid in str(ei.value)


def test_datagadget_strategy_not_a_name_is_gadget_error():
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu", strategy=None)


def test_forced_strategy_on_cpu_table_gives_no_warning():
    for strategy in STRATS:
        g = _cpu_table(np.arange(20, dtype=np.float32).reshape(10, 2), strategy=strategy)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            got = g.getData([9, 1, 9])
            g.insertData(torch.ones(2, 2), [0, 0])
            gl.gather_many([g, g], [3])
        assert rec == []
        assert got[0].tolist() == [18.0, 19.0]


# ---------------------------------------------------------------------------
# ids of every integer dtype / kind
# ---------------------------------------------------------------------------

TORCH_ID_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
NP_ID_DTYPES = [
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.intp,
    np.uintp,
]


@pytest.mark.parametrize("id_dtype", TORCH_ID_DTYPES, ids=str)
def test_torch_id_dtypes_gather_and_scatter(id_dtype):
    a = np.arange(90, dtype=np.float32).reshape(30, 3)
    ids_list = [[29, 0], [7, 7]]
    ids = torch.tensor(ids_list, dtype=id_dtype)
    for s in ("auto", "kernel", "torch"):
        g = _cpu_table(a, strategy=s)
        got = g.getData(ids)
        assert np.array_equal(got.numpy(), a[np.array(ids_list)]), s
        rows = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3) - 50
        g.insertData(rows, ids)
        ref = a.copy()
        for i, j in enumerate(np.array(ids_list).reshape(-1)):
            ref[j] = rows.reshape(4, 3)[i].numpy()
        assert np.array_equal(np.asarray(g), ref), s


@pytest.mark.parametrize("id_dtype", NP_ID_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_id_dtypes_gather_and_scatter(id_dtype):
    a = np.arange(90, dtype=np.int16).reshape(30, 3)
    ids = np.array([5, 29, 5, 0], dtype=id_dtype)
    g = _cpu_table(a, strategy="sorted")
    assert np.array_equal(g.getData(ids).numpy(), a[ids.astype(np.int64)])
    rows = np.array([[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]], dtype=np.int16)
    g.insertData(rows, ids)
    ref = a.copy()
    for i, j in enumerate(ids.astype(np.int64)):
        ref[j] = rows[i]
    assert np.array_equal(np.asarray(g), ref)
    assert np.asarray(g)[5].tolist() == [3, 3, 3]


@pytest.mark.parametrize(
    "ids",
    [
        np.array([1, 2**63 + 1], dtype=np.uint64),
        np.array([2**64 - 1], dtype=np.uint64),
        torch.tensor([2**64 - 1], dtype=torch.uint64),
        torch.tensor([1, 2**63], dtype=torch.uint64),
        [2**70],
        np.array([3, -1], dtype=np.int8),
        torch.tensor([-128], dtype=torch.int8),
        np.array([30], dtype=np.uint8),
    ],
    ids=[
        "np-u64-2^63+1",
        "np-u64-max",
        "torch-u64-max",
        "torch-u64-2^63",
        "py-2^70",
        "np-i8-neg",
        "torch-i8-min",
        "np-u8-oob",
    ],
)
def test_bad_ids_of_every_kind_are_index_errors_nothing_written(ids):
    a = np.arange(60, dtype=np.float32).reshape(30, 2)
    g = _cpu_table(a)
    with pytest.raises(gl.GadgetIndexError) as ei:
        g.getData(ids)
    assert isinstance(ei.value, IndexError)
    n = len(ids)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.zeros(n, 2), ids, check_ids=False)
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many([g, g], [torch.zeros(n, 2), torch.zeros(n, 2)], ids, check_ids=False)
    assert np.array_equal(np.asarray(g), a)


@pytest.mark.parametrize(
    "ids,msg",
    [
        (torch.tensor([1.0, 2.0]), "integer"),
        (np.array([1.5]), "integer"),
        (torch.tensor([True, False]), "nonzero"),
        (["a"], None),
    ],
    ids=["torch-float", "np-float", "bool-mask", "str"],
)
def test_non_integer_ids_are_type_errors(ids, msg):
    g = _cpu_table(np.zeros((5, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.getData(ids)
    assert isinstance(ei.value, TypeError)
    if msg:
        assert msg in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([g, g], ids)


def test_list_range_tuple_int_and_slice_ids():
    a = np.arange(30, dtype=np.float64).reshape(10, 3)
    g = _cpu_table(a)
    assert np.array_equal(g.getData(range(2, 7, 2)).numpy(), a[2:7:2])
    assert np.array_equal(g.getData((1, 1, 9)).numpy(), a[[1, 1, 9]])  # tuple of ints = ids
    assert np.array_equal(g.getData(np.int16(4)).numpy(), a[4])  # one row, no leading axis
    assert g.getData(4).shape == (3,)
    assert np.array_equal(g.getData(slice(-2, None)).numpy(), a[-2:])


def _readonly(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


ODD_IDS = {
    "np-reversed": (np.arange(10)[::-1], list(range(9, -1, -1))),
    "np-fortran-2d": (np.asfortranarray(np.array([[1, 2], [3, 9]])), [[1, 2], [3, 9]]),
    "np-readonly": (_readonly([4, 4, 0]), [4, 4, 0]),
    "np-bigendian": (np.array([7, 1, 7], dtype=">i4"), [7, 1, 7]),
    "np-0d": (np.array(6), 6),
    "torch-strided": (torch.arange(10)[::3], [0, 3, 6, 9]),
    "torch-expanded": (torch.tensor([3]).expand(5), [3] * 5),
    "torch-transposed": (torch.tensor([[1, 2], [3, 4]]).t(), [[1, 3], [2, 4]]),
    "torch-0d": (torch.tensor(6, dtype=torch.int16), 6),
}


@pytest.mark.parametrize("name", list(ODD_IDS))
def test_odd_layout_ids(name):
    ids, plain = ODD_IDS[name]
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    results = []
    for s in STRATS:
        g = _cpu_table(a, strategy=s)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning
            got = g.getData(ids)
        assert np.array_equal(got.numpy(), a[np.array(plain)]), s
        results.append(got)
        gm = gl.gather_many([g, g], ids)
        assert np.array_equal(gm[1].numpy(), a[np.array(plain)]), s
        rows = torch.full(np.array(plain).shape + (4,), -3.0)
        g.insertData(rows, ids)
        ref = a.copy()
        ref[np.array(plain)] = -3.0
        assert np.array_equal(np.asarray(g), ref), s


ODD_ROWS = {
    "np-readonly": lambda: _readonly(np.arange(8, dtype=np.float32).reshape(2, 4)),
    "np-bigendian": lambda: np.arange(8, dtype=">f4").reshape(2, 4),
    "np-reversed": lambda: np.arange(8, dtype=np.float32).reshape(2, 4)[::-1].copy()[::-1],
    "torch-transposed": lambda: torch.arange(8.0).reshape(4, 2).t(),
    "torch-requires-grad": lambda: torch.arange(8.0).reshape(2, 4).requires_grad_(),
    "torch-expanded": lambda: torch.arange(4.0).expand(2, 4),
}


@pytest.mark.parametrize("name", list(ODD_ROWS))
def test_odd_layout_rows_insert_and_scatter_many(name):
    a = np.zeros((10, 4), np.float32)
    rows = ODD_ROWS[name]()
    expect = (rows.detach().numpy() if isinstance(rows, torch.Tensor) else rows).astype(np.float32)
    for s in ("auto", "sorted", "torch"):
        g, h = _cpu_table(a, strategy=s), _cpu_table(a, strategy=s)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g.insertData(rows, [5, 2])
            gl.scatter_many([g, h], [rows, rows], [8, 1])
        ref = a.copy()
        ref[[5, 2]] = expect
        ref[[8, 1]] = expect
        assert np.array_equal(np.asarray(g), ref), s
        ref_h = a.copy()
        ref_h[[8, 1]] = expect
        assert np.array_equal(np.asarray(h), ref_h), s


def test_insert_rows_that_alias_the_table():
    for strategy in STRATS:
        # NumPy semantics: a[[1, 2, 3]] = a[0:3] reads the right side first
        b = np.arange(40, dtype=np.float32).reshape(10, 4)
        g = _cpu_table(b, strategy=strategy)
        g.insertData(g.as_tensor()[0:3], [1, 2, 3])
        exp = b.copy()
        exp[[1, 2, 3]] = b[0:3]
        assert np.array_equal(np.asarray(g), exp)
        g = _cpu_table(b, strategy=strategy)
        g.insertData(g.as_tensor()[[2, 1, 0]], [0, 1, 2])
        exp = b.copy()
        exp[[0, 1, 2]] = b[[2, 1, 0]]
        assert np.array_equal(np.asarray(g), exp)


def test_insert_shape_must_match_exactly_no_broadcast():
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    g = _cpu_table(a)
    for rows, ids in [
        (torch.ones(4), [1, 2]),
        (torch.ones(1, 4), [1, 2]),
        (torch.ones(2, 1), [1, 2]),
        (torch.ones(2, 4), [[1, 2]]),
    ]:
        with pytest.raises(gl.GadgetValueError) as ei:
            g.insertData(rows, ids)
        assert isinstance(ei.value, ValueError)
        with pytest.raises(gl.GadgetValueError):
            gl.scatter_many([g], [rows], ids)
    assert np.array_equal(np.asarray(g), a)
    g.insertData(torch.full((4,), 9.0), 3)  # a plain int id: one row, no leading axis
    assert np.asarray(g)[3].tolist() == [9.0] * 4


# ---------------------------------------------------------------------------
# empty requests
# ---------------------------------------------------------------------------

EMPTY_IDS = [
    [],
    np.array([], dtype=np.int64),
    np.zeros((3, 0), dtype=np.int32),
    torch.zeros(0, dtype=torch.int64),
    torch.zeros(0, 2, dtype=torch.uint8),
    range(0),
    slice(4, 4),
]


@pytest.mark.parametrize(
    "ids", EMPTY_IDS, ids=["list", "np", "np-3x0", "torch", "torch-0x2", "range", "slice"]
)
def test_empty_requests(ids):
    a = np.arange(20, dtype=np.float32).reshape(10, 2)
    lead = (0,) if isinstance(ids, (list, range, slice)) else tuple(ids.shape)
    for strategy in STRATS:
        g = _cpu_table(a, strategy=strategy)
        got = g.getData(ids)
        assert got.shape == lead + (2,) and got.dtype == torch.float32, strategy
        out = torch.empty(lead + (2,))
        assert g.getData(ids, out=out) is out, strategy
        g.insertData(torch.zeros(lead + (2,)), ids)
        gm = gl.gather_many([g, g], ids)
        assert [x.shape for x in gm] == [lead + (2,)] * 2, strategy
        gl.scatter_many([g, g], [torch.zeros(lead + (2,))] * 2, ids)
        assert np.array_equal(np.asarray(g), a), strategy


def test_empty_request_on_1d_table_and_empty_table():
    g = _cpu_table(np.arange(5, dtype=np.int64))
    assert g.getData([]).shape == (0,)
    z = gl.DataGadget((0, 3), dtype="float32", placement="cpu")
    assert len(z) == 0
    assert z.getData([]).shape == (0, 3)
    with pytest.raises(gl.GadgetIndexError):
        z.getData([0])


# ---------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------


def test_getdata_out_is_filled_and_returned():
    for strategy in STRATS:
        a = np.arange(60, dtype=np.float32).reshape(20, 3)
        g = _cpu_table(a, strategy=strategy)
        out = torch.full((2, 2, 3), -7.0)
        got = g.getData([[19, 0], [5, 5]], out=out)
        assert got is out
        assert np.array_equal(out.numpy(), a[[[19, 0], [5, 5]]])


def test_getdata_out_on_1d_table():
    g = _cpu_table(np.arange(10, dtype=np.int32))
    out = torch.zeros(3, dtype=torch.int32)
    assert g.getData([9, 9, 2], out=out) is out
    assert out.tolist() == [9, 9, 2]


@pytest.mark.parametrize(
    "out,exc",
    [
        (torch.empty(3, 2), gl.GadgetValueError),  # wrong shape
        (torch.empty(2, 3, dtype=torch.float64), gl.GadgetTypeError),  # wrong dtype
        (torch.empty(3, 2).t(), gl.GadgetError),  # not contiguous
        (torch.empty(6), gl.GadgetValueError),  # flat, right numel
    ],
    ids=["shape", "dtype", "noncontig", "flat"],
)
def test_getdata_bad_out_refused_and_untouched(out, exc):
    g = _cpu_table(np.arange(30, dtype=np.float32).reshape(10, 3))
    out.fill_(-1)
    before = out.clone()
    with pytest.raises(exc):
        g.getData([1, 2], out=out)
    assert torch.equal(out, before)


def test_getdata_out_refused_with_tuple_index():
    g = _cpu_table(np.arange(30, dtype=np.float32).reshape(10, 3))
    with pytest.raises(gl.GadgetError):
        g.getData((slice(0, 2), slice(0, 2)), out=torch.empty(2, 2))


@pytest.mark.parametrize("check_ids", [True, False])
def test_out_that_is_part_of_the_table_never_changes_it_on_bad_id(check_ids):
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    g = _cpu_table(a)
    view = g.as_tensor()
    with pytest.raises(gl.GadgetIndexError):
        g.getData([5, 99], out=view[0:2], check_ids=check_ids)
    assert np.array_equal(np.asarray(g), a)


# ---------------------------------------------------------------------------
# check_ids
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [True, False, 1, 0])
def test_check_ids_accepts_true_false_one_zero(flag):
    a = np.arange(20, dtype=np.float32).reshape(10, 2)
    g = _cpu_table(a)
    assert np.array_equal(g.getData([3, 3], check_ids=flag).numpy(), a[[3, 3]])
    g.insertData(torch.ones(1, 2), [9], check_ids=flag)
    assert np.asarray(g)[9].tolist() == [1.0, 1.0]
    r = gl.gather_many([g, g], [9], check_ids=flag)
    assert r[1].tolist() == [[1.0, 1.0]]
    gl.scatter_many([g, g], [torch.zeros(1, 2), torch.full((1, 2), 2.0)], [0], check_ids=flag)
    assert np.asarray(g)[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("flag", ["False", "True", None, "0"])
def test_check_ids_other_values_are_type_errors_nothing_written(flag):
    a = np.arange(20, dtype=np.float32).reshape(10, 2)
    g = _cpu_table(a)
    with pytest.raises(gl.GadgetTypeError):
        g.getData([1], check_ids=flag)
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.ones(1, 2), [1], check_ids=flag)
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([g], [1], check_ids=flag)
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many([g], [torch.ones(1, 2)], [1], check_ids=flag)
    assert np.array_equal(np.asarray(g), a)


def test_cpu_ids_always_checked_even_with_check_ids_false():
    for strategy in STRATS:
        # "CPU ids are always checked (on the CPU, no synchronisation ...)"
        a = np.arange(20, dtype=np.float32).reshape(10, 2)
        g = _cpu_table(a, strategy=strategy)
        h = _cpu_table(a * 2, strategy=strategy)
        with pytest.raises(gl.GadgetIndexError) as ei:
            g.getData(torch.tensor([1, 10]), check_ids=False)
        assert "10" in str(ei.value)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.ones(2, 2), torch.tensor([1, 10]), check_ids=False)
        with pytest.raises(gl.GadgetIndexError):
            gl.gather_many([g, h], [1, 10], check_ids=False)
        with pytest.raises(gl.GadgetIndexError):
            gl.scatter_many([g, h], [torch.ones(2, 2), torch.ones(2, 2)], [1, 10], check_ids=False)
        assert np.array_equal(np.asarray(g), a)
        assert np.array_equal(np.asarray(h), a * 2)


# ---------------------------------------------------------------------------
# gather_many / scatter_many
# ---------------------------------------------------------------------------


def _mixed_tables(strategies=("auto", "kernel", "sorted", "hybrid")):
    n = 25
    srcs = [
        _rand((n, 8), torch.float32, 11),
        _rand((n, 8), torch.float32, 12),
        _rand((n,), torch.int64, 13),
        _rand((n, 3, 2), torch.bfloat16, 14),
        _rand((n, 16), torch.bool, 15),
    ]
    tables = [
        _cpu_table(s.clone(), strategy=strategies[i % len(strategies)]) for i, s in enumerate(srcs)
    ]
    return srcs, tables


@pytest.mark.parametrize(
    "ids",
    [
        [3, 24, 3, 0],
        np.array([[1, 1], [2, 24]], np.int16),
        torch.tensor([7], dtype=torch.uint8),
        slice(20, None),
        range(5),
    ],
    ids=["list", "np2d", "torch-u8", "slice", "range"],
)
def test_gather_many_mixed_tables_matches_per_table(ids):
    srcs, tables = _mixed_tables()
    got = gl.gather_many(tables, ids)
    assert isinstance(got, list) and len(got) == len(tables)
    for k, (s, g, r) in enumerate(zip(srcs, tables, got, strict=True)):
        if isinstance(ids, slice):
            exp = s[ids]
        else:
            exp = s[
                torch.as_tensor(np.asarray(list(ids) if isinstance(ids, range) else ids)).long()
            ]
        assert _same(r, exp), k
        assert _same(r, g.getData(ids)), k


@pytest.mark.parametrize("gstrat", STRATS)
def test_scatter_many_repeated_ids_last_wins_in_every_table(gstrat):
    srcs, tables = _mixed_tables((gstrat,))
    ids = np.array([4, 0, 4, 24, 0, 4], dtype=np.int32)
    rows = [_rand((len(ids),) + tuple(s.shape[1:]), s.dtype, 100 + k) for k, s in enumerate(srcs)]
    gl.scatter_many(tables, rows, ids)
    for k, (s, g, r) in enumerate(zip(srcs, tables, rows, strict=True)):
        assert _same(g.as_tensor(), _seq_assign(s, ids, r)), k


def test_scatter_many_many_repeats():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(13, 4, generator=gen)
    b = torch.randint(0, 100, (13,), generator=gen)
    ga, gb = _cpu_table(a.clone(), "kernel"), _cpu_table(b.clone(), "sorted")
    ids = torch.randint(0, 13, (5000,), generator=gen)
    ra = torch.randn(5000, 4, generator=gen)
    rb = torch.arange(5000)
    gl.scatter_many([ga, gb], [ra, rb], ids)
    assert torch.equal(ga.as_tensor(), _seq_assign(a, ids, ra))
    assert torch.equal(gb.as_tensor(), _seq_assign(b, ids, rb))
    # the winner of each id is the position of its last occurrence
    for i in ids.unique().tolist():
        last = int((ids == i).nonzero().max())
        assert gb.as_tensor()[i].item() == last


def test_scatter_many_accepts_numpy_rows():
    a = np.zeros((6, 2), np.float32)
    b = np.zeros(6, np.int64)
    ga, gb = _cpu_table(a), _cpu_table(b)
    gl.scatter_many([ga, gb], [np.ones((2, 2), np.float32), np.array([5, 6])], [1, 1])
    assert np.asarray(ga)[1].tolist() == [1.0, 1.0]
    assert np.asarray(gb).tolist() == [0, 6, 0, 0, 0, 0]


def test_scatter_many_slice_ids():
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    b = np.arange(6, dtype=np.int64)
    ga, gb = _cpu_table(a), _cpu_table(b)
    gl.scatter_many([ga, gb], [np.zeros((2, 2), np.float32), np.array([-1, -2])], slice(-2, None))
    ea, eb = a.copy(), b.copy()
    ea[-2:] = 0
    eb[-2:] = [-1, -2]
    assert np.array_equal(np.asarray(ga), ea) and np.array_equal(np.asarray(gb), eb)


def _snapshot(tables):
    return [g.as_tensor().clone() for g in tables]


def _unchanged(tables, snap):
    return all(torch.equal(g.as_tensor(), s) for g, s in zip(tables, snap, strict=True))


def test_scatter_many_wrong_dtype_in_last_table_writes_nothing():
    srcs, tables = _mixed_tables()
    snap = _snapshot(tables)
    ids = [1, 2]
    rows = [_rand((2,) + tuple(s.shape[1:]), s.dtype, 1) for s in srcs]
    rows[-1] = rows[-1].to(torch.uint8)  # bool table gets uint8 rows
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.scatter_many(tables, rows, ids)
    assert isinstance(ei.value, TypeError)
    assert _unchanged(tables, snap)


def test_scatter_many_float64_into_float32_refused_not_cast():
    g = _cpu_table(np.zeros((4, 2), np.float32))
    h = _cpu_table(np.zeros((4, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.scatter_many([g, h], [np.ones((1, 2), np.float32), np.ones((1, 2), np.float64)], [0])
    assert "float32" in str(ei.value) and "float64" in str(ei.value)
    assert not np.asarray(g).any() and not np.asarray(h).any()


def test_scatter_many_wrong_shape_in_one_table_writes_nothing():
    srcs, tables = _mixed_tables()
    snap = _snapshot(tables)
    rows = [_rand((2,) + tuple(s.shape[1:]), s.dtype, 1) for s in srcs]
    rows[2] = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.scatter_many(tables, rows, [1, 2])
    assert isinstance(ei.value, ValueError)
    assert _unchanged(tables, snap)


def test_scatter_many_count_of_rows_differs_from_tables():
    srcs, tables = _mixed_tables()
    snap = _snapshot(tables)
    rows = [_rand((2,) + tuple(s.shape[1:]), s.dtype, 1) for s in srcs][:-1]
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many(tables, rows, [1, 2])
    assert _unchanged(tables, snap)


def test_many_refuse_tables_with_different_row_counts():
    g = _cpu_table(np.zeros((10, 2), np.float32))
    h = _cpu_table(np.zeros((9, 2), np.float32))
    with pytest.raises(gl.GadgetValueError):
        gl.gather_many([g, h], [1])
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many([g, h], [torch.ones(1, 2), torch.ones(1, 2)], [1])
    assert not np.asarray(g).any() and not np.asarray(h).any()


@pytest.mark.parametrize("bad", [[], "one-table"], ids=["empty-list", "bare-gadget"])
def test_many_need_a_nonempty_list_of_gadgets(bad):
    g = _cpu_table(np.zeros((4, 2), np.float32))
    gadgets = g if bad == "one-table" else []
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many(gadgets, [1])
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(gadgets, [torch.ones(1, 2)], [1])
    assert not np.asarray(g).any()


def test_gather_many_refuses_tuple_index_into_rows():
    g = _cpu_table(np.zeros((4, 2), np.float32))
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([g, g], ([1, 2], 0))


def test_many_with_a_file_table(tmp_path):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    p = tmp_path / "t.npy"
    np.save(p, a)
    f = gl.DataGadget(str(p), placement="file")
    m = _cpu_table(np.arange(10, dtype=np.int64), strategy="hybrid")
    try:
        got = gl.gather_many([m, f], [9, 9, 0])
        assert got[0].tolist() == [9, 9, 0]
        assert np.array_equal(got[1].numpy(), a[[9, 9, 0]])
        gl.scatter_many([m, f], [torch.tensor([7, 8]), torch.full((2, 4), 5.0)], [3, 3])
        f.flush()
        ea = a.copy()
        ea[3] = 5.0
        assert np.array_equal(np.load(p), ea)
        assert np.asarray(m)[3] == 8
        # a bad id: neither the file nor the cpu table is written
        with pytest.raises(gl.GadgetIndexError):
            gl.scatter_many([m, f], [torch.tensor([1, 1]), torch.zeros(2, 4)], [0, 10])
        assert np.array_equal(np.load(p), ea)
        assert np.asarray(m)[0] == 0
    finally:
        f.close()


def test_many_with_a_closed_table_raise_closed_error_and_write_nothing(tmp_path):
    p = tmp_path / "c.npy"
    np.save(p, np.zeros((6, 2), np.float32))
    f = gl.DataGadget(str(p), placement="file")
    m = _cpu_table(np.zeros((6, 2), np.float32))
    f.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.gather_many([m, f], [1])
    with pytest.raises(gl.GadgetClosedError):
        gl.scatter_many([m, f], [torch.ones(1, 2), torch.ones(1, 2)], [1])
    assert not np.asarray(m).any()


def test_many_with_closed_in_memory_table():
    g = _cpu_table(np.zeros((6, 2), np.float32))
    h = _cpu_table(np.zeros((6, 2), np.float32))
    h.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.gather_many([g, h], [1])
    with pytest.raises(gl.GadgetClosedError):
        gl.scatter_many([g, h], [torch.ones(1, 2), torch.ones(1, 2)], [1])
    assert not np.asarray(g).any()


# --- a table and its optimizer states (interleaved by OffloadedOptimizer) ---


@pytest.fixture
def emb_and_states():
    emb = gl.OffloadedEmbedding(30, 4, placement="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    table = emb.table
    states = list(opt.pagers[0].tables.values())
    table.normal_(0.0, 1.0)
    states[0].uniform_(-1.0, 1.0)
    states[1].fill_(3.0)
    return opt, table, states


@pytest.mark.parametrize("order", ["table-first", "states-reversed", "states-only", "table-alone"])
def test_gather_many_table_and_interleaved_states(emb_and_states, order):
    _opt, table, states = emb_and_states
    assert len(states) == 2
    pick = {
        "table-first": [table] + states,
        "states-reversed": states[::-1] + [table],
        "states-only": states,
        "table-alone": [table],
    }[order]
    refs = [np.array(g.getNumpyVersion()) for g in pick]
    ids = np.array([[29, 0, 29], [5, 5, 1]])
    got = gl.gather_many(pick, ids)
    for g, r, ref in zip(pick, got, refs, strict=True):
        assert r.shape == (2, 3, 4)
        assert np.array_equal(r.numpy(), ref[ids])
        assert np.array_equal(g.getData(ids).numpy(), ref[ids])


@pytest.mark.parametrize("order", ["table-first", "states-reversed", "one-state"])
def test_scatter_many_table_and_interleaved_states(emb_and_states, order):
    _opt, table, states = emb_and_states
    pick = {
        "table-first": [table] + states,
        "states-reversed": states[::-1] + [table],
        "one-state": [states[1]],
    }[order]
    everyone = [table] + states
    before = {id(g): np.array(g.getNumpyVersion()) for g in everyone}
    ids = [7, 2, 7, 29]
    rows = [
        torch.full((4, 4), 10.0 * (k + 1)) + torch.arange(4.0).unsqueeze(1)
        for k in range(len(pick))
    ]
    gl.scatter_many(pick, rows, ids)
    for g in everyone:
        exp = before[id(g)].copy()
        if any(g is p for p in pick):
            k = next(i for i, p in enumerate(pick) if p is g)
            for pos, i in enumerate(ids):
                exp[i] = rows[k][pos].numpy()
        assert np.array_equal(np.asarray(g), exp)
    # id 7's last occurrence is position 2
    assert np.asarray(pick[0])[7].tolist() == [12.0] * 4


def test_scatter_many_interleaved_bad_id_writes_nothing(emb_and_states):
    _opt, table, states = emb_and_states
    everyone = [table] + states
    before = [np.array(g.getNumpyVersion()) for g in everyone]
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(everyone, [torch.zeros(2, 4)] * 3, [0, 30], check_ids=False)
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(
            everyone,
            [torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64)],
            [0, 1],
        )
    for g, b in zip(everyone, before, strict=True):
        assert np.array_equal(np.asarray(g), b)


def test_many_on_interleaved_tables_after_load(emb_and_states, tmp_path):
    _opt, table, states = emb_and_states
    saved = np.array(table.getNumpyVersion())
    p = str(tmp_path / "t.npy")
    table.save(p)
    table.fill_(1.0)
    states[0].fill_(5.0)
    table.load(p)  # refilled in place: the state views still hold their rows
    got = gl.gather_many([table] + states, [3, 3, 29])
    assert np.array_equal(got[0].numpy(), saved[[3, 3, 29]])
    assert got[1].tolist() == [[5.0] * 4] * 3
    gl.scatter_many([table] + states, [torch.zeros(1, 4)] * 3, [3])
    assert not np.asarray(table)[3].any() and not np.asarray(states[0])[3].any()
    assert np.asarray(states[0])[4].tolist() == [5.0] * 4
    assert np.array_equal(np.asarray(table)[4], saved[4])


# ---------------------------------------------------------------------------
# without a GPU (subprocesses: the FallbackWarning is given once per process)
# ---------------------------------------------------------------------------

_SCENARIOS = {
    # a table asked for a GPU placement by name comes first
    "placement": """
        g = gl.DataGadget(np.arange(12, dtype=np.float32).reshape(6, 2), placement='pinned', strategy='kernel')
        log('after_pinned')
        h = gl.DataGadget((6, 2), CPUPinn=True)
        c = gl.DataGadget(np.zeros((6, 2), np.float32), placement='cuda', strategy='hybrid')
        d = gl.DataGadget((6, 2))
        log('after_more_tables')
        r = g.getData([5, 5, 0], device='cuda')
        rs = gl.gather_many([g, h, c], [1], device='cuda')
        c.insertData(torch.ones(2, 2), [3, 3])
        gl.scatter_many([g, c], [torch.zeros(1, 2), torch.full((1, 2), 4.0)], [0])
        log('end')
        res['placements'] = [g.placement, h.placement, c.placement, d.placement]
        res['devices'] = [str(g.device), str(r.device)] + [str(x.device) for x in rs]
        res['values'] = r.tolist()
        res['c'] = np.asarray(c).tolist()
        res['g0'] = np.asarray(g)[0].tolist()
    """,
    # a call asking for CUDA rows comes first
    "device": """
        g = gl.DataGadget(np.arange(12, dtype=np.float32).reshape(6, 2), placement='cpu')
        log('after_cpu_table')
        r = g.getData([2, 1], device='cuda')
        log('after_getdata')
        rs = gl.gather_many([g, g], [3], device='cuda')
        h = gl.DataGadget((6, 2), placement='pinned')
        log('end')
        res['devices'] = [str(r.device)] + [str(x.device) for x in rs]
        res['values'] = r.tolist() + rs[0].tolist()
        res['placements'] = [h.placement]
    """,
    # gather_many(device='cuda') comes first; default placements pick cpu silently
    "many": """
        e = gl.OffloadedEmbedding(6, 2)
        ds_table = gl.DataGadget(np.arange(12, dtype=np.float32).reshape(6, 2), placement='cpu')
        log('after_silent')
        rs = gl.gather_many([ds_table, e.table], [4], device='cuda')
        log('after_gather_many')
        r = ds_table.getData([1], device='cuda')
        log('end')
        res['placements'] = [e.placement, e.table.placement]
        res['devices'] = [str(x.device) for x in rs] + [str(r.device)]
        res['values'] = rs[0].tolist()
    """,
}

_PRELUDE = """
import json, warnings, numpy as np, torch, gadgetloader as gl
res = {'log': {}}
rec = []
def log(name):
    res['log'][name] = [(type(w.message).__name__, str(w.message)) for w in rec]
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter('always')
"""


@pytest.fixture(scope="module")
def no_gpu_runs():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = {}
    for name, body in _SCENARIOS.items():
        code = (
            _PRELUDE
            + textwrap.indent(textwrap.dedent(body), "    ")
            + "\nprint('RESULT' + json.dumps(res))\n"
        )
        p = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, p.stderr[-3000:]
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")][-1]
        out[name] = json.loads(line[len("RESULT") :])
    return out


def _fallbacks(entries):
    return [m for kind, m in entries if kind == "FallbackWarning"]


def test_no_gpu_pinned_placement_warns_once_then_silent(no_gpu_runs):
    r = no_gpu_runs["placement"]
    first = _fallbacks(r["log"]["after_pinned"])
    assert len(first) == 1 and "pinned" in first[0]
    # no further FallbackWarning for more tables, CUDA rows or scatters
    assert len(_fallbacks(r["log"]["end"])) == 1
    assert r["log"]["end"] == r["log"]["after_pinned"]


def test_no_gpu_gpu_placements_become_cpu_and_results_are_exact(no_gpu_runs):
    r = no_gpu_runs["placement"]
    assert r["placements"] == ["cpu"] * 4
    assert r["devices"] == ["cpu"] * 5
    assert r["values"] == [[10.0, 11.0], [10.0, 11.0], [0.0, 1.0]]
    assert r["c"] == [[4, 4], [0, 0], [0, 0], [1, 1], [0, 0], [0, 0]]
    assert r["g0"] == [0.0, 0.0]


def test_no_gpu_cuda_rows_call_warns_once(no_gpu_runs):
    r = no_gpu_runs["device"]
    assert _fallbacks(r["log"]["after_cpu_table"]) == []
    assert len(_fallbacks(r["log"]["after_getdata"])) == 1
    assert len(_fallbacks(r["log"]["end"])) == 1  # gather_many and a pinned table later: silent
    assert r["devices"] == ["cpu"] * 3
    assert r["values"] == [[4.0, 5.0], [2.0, 3.0], [6.0, 7.0]]
    assert r["placements"] == ["cpu"]


def test_no_gpu_default_placement_silent_gather_many_cuda_warns_once(no_gpu_runs):
    r = no_gpu_runs["many"]
    assert r["log"]["after_silent"] == []
    assert len(_fallbacks(r["log"]["after_gather_many"])) == 1
    assert len(_fallbacks(r["log"]["end"])) == 1
    assert r["placements"] == ["cpu", "cpu"]
    assert r["devices"] == ["cpu"] * 3
    assert r["values"] == [[8.0, 9.0]]
