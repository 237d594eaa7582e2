"""Review session 28: black-box GPU tests, written from README.md, SPEC.md and docstrings only.

Everything here runs on a CUDA device with CuPy (placements ``cuda`` and ``pinned``) and is
checked against NumPy / torch references computed on the CPU; every test carries the ``gpu``
marker and skips with a reason elsewhere. The tests of ``check_ids=False`` with ids out of
range come last in the file: should a kernel ever touch memory outside a table, the CUDA
context would be lost for every test after it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY, NEEDS_GPU
from torch.utils.data import DataLoader

import gadgetloader as gl

try:
    import cupy
except ImportError:  # CPU-only machines: every test here skips
    cupy = None

pytestmark = [pytest.mark.gpu, NEEDS_GPU, NEEDS_CUPY]

DEV = torch.device("cuda")
CUDA_P = "cuda"
PINNED_P = "pinned"
PLACEMENTS = (PINNED_P, CUDA_P)
mse_loss = torch.nn.functional.mse_loss

# --- helpers ---------------------------------------------------------------------------------

_INT_RANGES = {
    torch.uint8: (0, 256),
    torch.int8: (-128, 128),
    torch.int16: (-(2**15), 2**15),
    torch.int32: (-(2**31), 2**31),
    torch.int64: (-(2**62), 2**62),
}


def rand_tensor(shape, dtype=torch.float32, seed=0):
    """A CPU tensor of random values of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    low, high = _INT_RANGES[dtype]
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)


def rand_ids(n, high, seed=0):
    """``n`` uniform int64 ids in ``[0, high)`` (NumPy)."""
    return np.random.default_rng(seed).integers(0, high, size=n, dtype=np.int64)


def repeated_ids(n_rows, seed=0):
    """1,200 ids in random order: 1,000 uniform ids plus 200 drawn from only 30 rows."""
    ids = np.concatenate([rand_ids(1000, n_rows, seed), rand_ids(200, 30, seed + 1)])
    return np.random.default_rng(seed + 2).permutation(ids)


def make(placement, data, **kwargs):
    """A table holding a copy of the CPU tensor ``data``."""
    return gl.DataGadget(data.clone(), placement=placement, **kwargs)


def snap(g):
    """The whole table as a CPU tensor, read through ``as_tensor`` (not the gather path)."""
    return g.as_tensor().detach().cpu().clone()


def last_wins(table, ids, rows):
    """NumPy's sequential assignment ``table[ids[i]] = rows[i]``: the last occurrence wins."""
    out = table.clone()
    flat = ids.reshape(-1).numpy()
    if flat.size == 0:
        return out
    flat_rows = rows.reshape((flat.size, *table.shape[1:]))
    _, first_in_reversed = np.unique(flat[::-1], return_index=True)
    last = flat.size - 1 - first_in_reversed
    out[torch.from_numpy(flat[last])] = flat_rows[torch.from_numpy(last)]
    return out


def _ids_as(kind, ids_np):
    """``ids_np`` in the form ``kind``, and the same ids as a CPU int64 tensor (same shape)."""
    ref = torch.from_numpy(ids_np)
    if kind == "cuda":
        return ref.to(DEV), ref
    if kind == "cuda_int32":
        return ref.to(torch.int32).to(DEV), ref
    if kind == "cuda_2d":
        two_d = ref[:1000].reshape(40, 25)
        return two_d.to(DEV), two_d
    if kind == "cuda_strided":
        return ref.to(DEV)[::2], ref[::2].clone()
    if kind == "cpu":
        return ref.clone(), ref
    if kind == "cpu_int32":
        return ref.to(torch.int32), ref
    if kind == "numpy":
        return ids_np.copy(), ref
    if kind == "numpy_int32":
        return ids_np.astype(np.int32), ref
    if kind == "numpy_uint64":
        return ids_np.astype(np.uint64), ref
    if kind == "list":
        return ids_np.tolist(), ref
    if kind == "range":
        return range(3, 2900, 7), torch.arange(3, 2900, 7)
    if kind == "cupy":
        return cupy.asarray(ids_np), ref
    if kind == "cupy_int32":
        return cupy.asarray(ids_np.astype(np.int32)), ref
    raise AssertionError(kind)


def _case_id(dtype, row_shape):
    shape = "x".join(str(n) for n in row_shape) or "1d"
    return f"{str(dtype).removeprefix('torch.')}-{shape}"


# --- gather and scatter against NumPy, per dtype and row width --------------------------------

_WIDTHS_PINNED = [
    (torch.float32, ()),
    (torch.float32, (1,)),
    (torch.float32, (3,)),
    (torch.float32, (5,)),
    (torch.float32, (257,)),
    (torch.float32, (1024,)),
    (torch.float32, (3, 5)),
    (torch.float16, ()),
    (torch.float16, (3,)),
    (torch.float16, (2048,)),
    (torch.bfloat16, (7,)),
    (torch.float64, (3,)),
    (torch.int64, ()),
    (torch.int64, (3,)),
    (torch.int64, (512,)),
    (torch.int32, (5,)),
    (torch.int8, (13,)),
    (torch.uint8, ()),
    (torch.uint8, (7,)),
    (torch.uint8, (4096,)),
    (torch.bool, (19,)),
]
_WIDTHS_CUDA = [
    (torch.float32, (3,)),
    (torch.float32, (1024,)),
    (torch.float16, (3,)),
    (torch.int64, ()),
    (torch.bool, (19,)),
]
WIDTH_PARAMS = [
    pytest.param(p, dt, rs, id=f"{p}-{_case_id(dt, rs)}")
    for p, cases in ((PINNED_P, _WIDTHS_PINNED), (CUDA_P, _WIDTHS_CUDA))
    for dt, rs in cases
]


@pytest.mark.parametrize(("placement", "dtype", "row_shape"), WIDTH_PARAMS)
def test_gather_and_scatter_match_numpy(placement, dtype, row_shape):
    n_rows = 3000
    data = rand_tensor((n_rows, *row_shape), dtype, seed=1)
    g = make(placement, data)
    assert tuple(g.shape) == tuple(data.shape)
    assert len(g) == n_rows
    assert g.placement == placement
    ids = torch.from_numpy(repeated_ids(n_rows, seed=2))

    got = g.getData(ids.to(DEV))
    assert got.device.type == DEV.type
    assert got.dtype == dtype
    assert tuple(got.shape) == (ids.numel(), *row_shape)
    assert torch.equal(got.cpu(), data[ids])
    assert torch.equal(g[ids.to(DEV)].cpu(), data[ids])

    rows = rand_tensor((ids.numel(), *row_shape), dtype, seed=3)
    g.insertData(rows.to(DEV), ids.to(DEV))
    expected = last_wins(data, ids, rows)
    assert torch.equal(snap(g), expected)
    # CPU ids after the write see the written rows
    assert torch.equal(g.getData(ids).cpu(), expected[ids])


# --- every documented id form ------------------------------------------------------------------

_KINDS_PINNED = [
    "cuda",
    "cuda_int32",
    "cuda_2d",
    "cuda_strided",
    "cpu",
    "cpu_int32",
    "numpy",
    "numpy_int32",
    "numpy_uint64",
    "list",
    "range",
    "cupy",
    "cupy_int32",
]
_KINDS_CUDA = ["cuda", "cpu", "cupy"]
KIND_PARAMS = [
    pytest.param(p, k, id=f"{p}-{k}")
    for p, kinds in ((PINNED_P, _KINDS_PINNED), (CUDA_P, _KINDS_CUDA))
    for k in kinds
]


@pytest.mark.parametrize(("placement", "kind"), KIND_PARAMS)
def test_id_forms(placement, kind):
    n_rows, dim = 3000, 12
    data = rand_tensor((n_rows, dim), seed=5)
    g = make(placement, data)
    ids, ref = _ids_as(kind, repeated_ids(n_rows, seed=6))
    want = data[ref]

    got = g.getData(ids)
    assert got.device.type == DEV.type
    assert got.dtype == torch.float32
    assert tuple(got.shape) == (*ref.shape, dim)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(g[ids].cpu(), want)

    rows = rand_tensor((*ref.shape, dim), seed=7)
    g.insertData(rows.to(DEV), ids)
    expected = last_wins(data, ref, rows)
    assert torch.equal(snap(g), expected)

    rows2 = rand_tensor((*ref.shape, dim), seed=8)
    g[ids] = rows2.to(DEV)
    assert torch.equal(snap(g), last_wins(expected, ref, rows2))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_empty_ids(placement):
    dim = 6
    data = rand_tensor((500, dim), seed=10)
    g = make(placement, data)
    empties = [
        (torch.empty(0, dtype=torch.int64, device=DEV), (0,)),
        (torch.empty(0, dtype=torch.int64), (0,)),
        (np.empty(0, dtype=np.int64), (0,)),
        ([], (0,)),
        (torch.empty((0, 3), dtype=torch.int64, device=DEV), (0, 3)),
    ]
    for ids, shape in empties:
        got = g.getData(ids)
        assert tuple(got.shape) == (*shape, dim)
        assert got.device.type == DEV.type
        assert got.dtype == torch.float32
        g.insertData(torch.empty((*shape, dim), device=DEV), ids)
    assert torch.equal(snap(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_int_slice_and_tuple_indexing(placement):
    data = rand_tensor((400, 8), seed=12)
    g = make(placement, data)
    assert torch.equal(g.getData(5).cpu(), data[5])
    assert torch.equal(g[2:50].cpu(), data[2:50])
    assert torch.equal(g.getData(slice(10, 100, 3)).cpu(), data[10:100:3])
    ids = torch.tensor([7, 3, 7, 399], device=DEV)
    assert torch.equal(g[ids, 1:4].cpu(), data[ids.cpu()][:, 1:4])
    assert torch.equal(g.getData((slice(0, 6), slice(0, 3))).cpu(), data[0:6, 0:3])

    expected = data.clone()
    g[[1, 2], 0] = torch.tensor([7.0, 8.0], device=DEV)
    expected[[1, 2], 0] = torch.tensor([7.0, 8.0])
    rows = rand_tensor((10, 8), seed=13)
    g.insertData(rows.to(DEV), slice(100, 110))
    expected[100:110] = rows
    assert torch.equal(snap(g), expected)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_insert_data_forms(placement):
    n_rows, dim = 1000, 10
    data = rand_tensor((n_rows, dim), seed=14)
    g = make(placement, data)
    expected = data.clone()
    for k, kind in enumerate(["cuda", "cpu", "numpy", "cupy"]):
        ids = torch.from_numpy(rand_ids(300, n_rows, 20 + k))
        rows = rand_tensor((300, dim), seed=30 + k)
        if kind == "cuda":
            obj = rows.to(DEV)
        elif kind == "cpu":
            obj = rows.clone()
        elif kind == "numpy":
            obj = rows.numpy().copy()
        else:
            obj = cupy.asarray(rows.numpy())
        g.insertData(obj, ids.to(DEV))
        expected = last_wins(expected, ids, rows)
        assert torch.equal(snap(g), expected), kind


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_insert_non_contiguous_data(placement):
    n_rows, dim = 1000, 10
    data = rand_tensor((n_rows, dim), seed=15)
    g = make(placement, data)
    expected = data.clone()
    ids = torch.from_numpy(rand_ids(300, n_rows, 16))
    rows = rand_tensor((300, dim), seed=17)
    strided_cuda = torch.cat([rows, rows], dim=1).to(DEV)[:, :dim]
    assert not strided_cuda.is_contiguous()
    g.insertData(strided_cuda, ids.to(DEV))
    expected = last_wins(expected, ids, rows)
    assert torch.equal(snap(g), expected)

    rows2 = rand_tensor((300, dim), seed=18)
    column_major = rows2.t().contiguous().t()
    assert not column_major.is_contiguous()
    g.insertData(column_major, ids)
    expected = last_wins(expected, ids, rows2)
    assert torch.equal(snap(g), expected)


# --- transfer strategies: the same rows whatever the strategy ---------------------------------

STRATEGY_PARAMS = [
    pytest.param(p, s, id=f"{p}-{s}")
    for p, strategies in (
        (PINNED_P, ("auto", "kernel", "sorted", "hybrid", "torch")),
        (CUDA_P, ("auto", "kernel", "sorted", "torch")),
    )
    for s in strategies
]
STRATEGY_WIDTH_PARAMS = [
    pytest.param(p, s, dt, rs, id=f"{p}-{s}-{_case_id(dt, rs)}")
    for p, strategies, widths in (
        (
            PINNED_P,
            ("auto", "kernel", "sorted", "hybrid", "torch"),
            ((torch.float32, (25,)), (torch.float16, (3,))),
        ),
        (CUDA_P, ("auto", "kernel", "sorted", "torch"), ((torch.float32, (25,)),)),
    )
    for s in strategies
    for dt, rs in widths
] + [
    pytest.param(PINNED_P, s, torch.float32, (128,), id=f"pinned-{s}-float32-128")
    for s in ("sorted", "kernel")
]


@pytest.mark.parametrize(("placement", "strategy", "dtype", "row_shape"), STRATEGY_WIDTH_PARAMS)
def test_forced_strategy_gives_the_same_rows(placement, strategy, dtype, row_shape):
    n_rows = 20_000
    data = rand_tensor((n_rows, *row_shape), dtype, seed=40)
    g = make(placement, data, strategy=strategy)
    row_bytes = data[0].numel() * data.element_size()
    sizes = (1, 900, 70_000, 300_000) if row_bytes <= 128 else (1, 900, 70_000)
    rng = np.random.default_rng(41)
    for n in sizes:
        ref = torch.from_numpy(rng.integers(0, n_rows, n))
        want = data[ref]
        assert torch.equal(g.getData(ref.to(DEV)).cpu(), want), n
        assert torch.equal(g.getData(ref).cpu(), want), n
        ascending = torch.sort(ref).values
        assert torch.equal(g.getData(ascending.to(DEV)).cpu(), data[ascending]), n

    expected = data.clone()
    for n in sizes:
        ref = torch.from_numpy(rng.integers(0, n_rows, n))
        rows = rand_tensor((n, *row_shape), dtype, seed=n)
        g.insertData(rows.to(DEV), ref.to(DEV))
        expected = last_wins(expected, ref, rows)
        assert torch.equal(snap(g), expected), n
    ref = torch.from_numpy(rng.integers(0, n_rows, 5000))
    rows = rand_tensor((5000, *row_shape), dtype, seed=42)
    g.insertData(rows, ref)  # CPU rows, CPU ids
    expected = last_wins(expected, ref, rows)
    assert torch.equal(snap(g), expected)


def test_unknown_strategy_is_a_key_error():
    data = rand_tensor((100, 4), seed=43)
    with pytest.raises(gl.GadgetKeyError) as info:
        g = make(PINNED_P, data, strategy="fastest")
        g.getData(torch.tensor([1, 2], device=DEV))
    assert isinstance(info.value, KeyError)


# --- repeated ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("placement", "n_ids"),
    [(PINNED_P, 2), (PINNED_P, 5000), (PINNED_P, 300_000), (CUDA_P, 5000), (CUDA_P, 300_000)],
)
def test_scatter_repeated_ids_last_occurrence_wins(placement, n_ids):
    n_rows, dim = 1000, 16
    data = rand_tensor((n_rows, dim), seed=50)
    g = make(placement, data)
    ids_np = np.array([7, 7]) if n_ids == 2 else rand_ids(n_ids, n_rows, 51)
    ref = torch.from_numpy(ids_np)
    rows = rand_tensor((n_ids, dim), seed=52)
    g.insertData(rows.to(DEV), ref.to(DEV))
    expected = last_wins(data, ref, rows)
    assert torch.equal(snap(g), expected)

    # the same with CPU ids and CPU rows
    rows2 = rand_tensor((n_ids, dim), seed=53)
    g.insertData(rows2, ref)
    expected = last_wins(expected, ref, rows2)
    assert torch.equal(snap(g), expected)

    # every entry naming one row: the last entry's row is written
    same = torch.full((n_ids,), n_rows - 1, dtype=torch.int64)
    rows3 = rand_tensor((n_ids, dim), seed=54)
    g.insertData(rows3.to(DEV), same.to(DEV))
    expected[n_rows - 1] = rows3[-1]
    assert torch.equal(snap(g), expected)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_large_gathers_with_repeated_ids(placement):
    """At least 65,536 ids, at most 16 rows per id: the pinned table reads each row once."""
    n_rows, dim = 50_000, 8
    data = rand_tensor((n_rows, dim), seed=60)
    g = make(placement, data)
    kernel = make(placement, data, strategy="kernel")
    uniform = torch.from_numpy(rand_ids(100_000, n_rows, 61))
    skewed = torch.from_numpy(
        np.random.default_rng(62).permutation(
            np.concatenate([rand_ids(70_000, 100, 63), rand_ids(30_000, n_rows, 64)])
        )
    )
    for ref in (uniform, skewed):
        want = data[ref]
        assert torch.equal(g.getData(ref.to(DEV)).cpu(), want)
        assert torch.equal(g.getData(ref).cpu(), want)
        assert torch.equal(kernel.getData(ref.to(DEV)).cpu(), want)
        two_d = ref.reshape(400, 250)
        assert torch.equal(g.getData(two_d.to(DEV)).cpu(), data[two_d])
        outs = gl.gather_many([g, kernel], ref.to(DEV))
        assert all(torch.equal(o.cpu(), want) for o in outs)
        batch = gl.GadgetDataset(g).gather(ref.to(DEV))
        assert torch.equal(batch[0].cpu(), want)
    assert torch.equal(snap(g), data)


# --- fused transfers over several tables -------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gather_many_and_scatter_many_table_and_states(placement):
    n_rows, dim = 5000, 16
    datas = [rand_tensor((n_rows, dim), seed=70 + k) for k in range(3)]
    tables = [make(placement, d) for d in datas]
    ids_np = repeated_ids(n_rows, seed=73)
    ref = torch.from_numpy(ids_np)
    for ids in (ref.to(DEV), ref, ids_np, cupy.asarray(ids_np)):
        outs = gl.gather_many(tables, ids)
        assert len(outs) == 3
        for out, d in zip(outs, datas, strict=True):
            assert out.device.type == DEV.type
            assert torch.equal(out.cpu(), d[ref])
    rows = [rand_tensor((ref.numel(), dim), seed=80 + k) for k in range(3)]
    gl.scatter_many(tables, [r.to(DEV) for r in rows], ref.to(DEV))
    expected = [last_wins(d, ref, r) for d, r in zip(datas, rows, strict=True)]
    for t, e in zip(tables, expected, strict=True):
        assert torch.equal(snap(t), e)
    rows2 = [rand_tensor((ref.numel(), dim), seed=90 + k) for k in range(3)]
    gl.scatter_many(tables, rows2, ref)  # CPU rows, CPU ids
    for t, e, r in zip(tables, expected, rows2, strict=True):
        assert torch.equal(snap(t), last_wins(e, ref, r))


def test_gather_many_five_tables_of_one_row_size():
    """32-byte rows of five dtypes: more tables than one launch takes."""
    n_rows = 4000
    specs = [
        (torch.float32, 8),
        (torch.int32, 8),
        (torch.float16, 16),
        (torch.int64, 4),
        (torch.uint8, 32),
    ]
    datas = [rand_tensor((n_rows, w), dt, seed=100 + k) for k, (dt, w) in enumerate(specs)]
    tables = [make(PINNED_P, d) for d in datas]
    ref = torch.from_numpy(repeated_ids(n_rows, seed=105))
    outs = gl.gather_many(tables, ref.to(DEV))
    assert len(outs) == 5
    for out, d in zip(outs, datas, strict=True):
        assert out.dtype == d.dtype
        assert torch.equal(out.cpu(), d[ref])
    rows = [rand_tensor((ref.numel(), w), dt, seed=110 + k) for k, (dt, w) in enumerate(specs)]
    gl.scatter_many(tables, [r.to(DEV) for r in rows], ref.to(DEV))
    for t, d, r in zip(tables, datas, rows, strict=True):
        assert torch.equal(snap(t), last_wins(d, ref, r))


def test_gather_many_mixed_placements_dtypes_and_widths():
    n_rows = 3000
    specs = [
        (PINNED_P, torch.float32, (16,)),
        (CUDA_P, torch.float16, (3,)),
        (PINNED_P, torch.int64, ()),
        (CUDA_P, torch.uint8, (7,)),
    ]
    datas = [rand_tensor((n_rows, *rs), dt, seed=120 + k) for k, (_, dt, rs) in enumerate(specs)]
    tables = [make(p, d) for (p, _, _), d in zip(specs, datas, strict=True)]
    ref = torch.from_numpy(repeated_ids(n_rows, seed=125))
    outs = gl.gather_many(tables, ref.to(DEV))
    for out, d in zip(outs, datas, strict=True):
        assert out.device.type == DEV.type
        assert torch.equal(out.cpu(), d[ref])
    rows = [
        rand_tensor((ref.numel(), *rs), dt, seed=130 + k) for k, (_, dt, rs) in enumerate(specs)
    ]
    gl.scatter_many(tables, [r.to(DEV) for r in rows], ref.to(DEV))
    for t, d, r in zip(tables, datas, rows, strict=True):
        assert torch.equal(snap(t), last_wins(d, ref, r))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_fused_transfers_with_a_bad_id_change_nothing(placement):
    n_rows, dim = 2000, 8
    datas = [rand_tensor((n_rows, dim), seed=140 + k) for k in range(3)]
    tables = [make(placement, d) for d in datas]
    ids = torch.from_numpy(rand_ids(1500, n_rows, 143))
    ids[-1] = n_rows
    rows = [rand_tensor((1500, dim), seed=144 + k).to(DEV) for k in range(3)]
    with pytest.raises(gl.GadgetIndexError):
        gl.gather_many(tables, ids.to(DEV))
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(tables, rows, ids.to(DEV))
    ids[-1] = -3
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(tables, rows, ids.to(DEV))
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(tables, rows, ids)
    for t, d in zip(tables, datas, strict=True):
        assert torch.equal(snap(t), d)


def test_gather_many_over_a_table_and_its_interleaved_optimizer_states():
    n_rows, dim = 500, 8
    emb = gl.OffloadedEmbedding(n_rows, dim, placement=PINNED_P)
    model = torch.nn.ModuleDict({"emb": emb}).cuda()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.01)
    ids = torch.from_numpy(rand_ids(700, n_rows, 150)).to(DEV)
    opt.zero_grad()
    emb(ids).square().sum().backward()
    opt.step()
    tables = [emb.weight, *dict(opt.pagers[0].tables).values()]
    assert len(tables) >= 3  # the table, exp_avg, exp_avg_sq
    full = [torch.from_numpy(t.getNumpyVersion()) for t in tables]
    assert full[1].abs().sum() > 0  # the step wrote state rows
    ref = torch.from_numpy(repeated_ids(n_rows, seed=151))
    outs = gl.gather_many(tables, ref.to(DEV))
    for t, out, f in zip(tables, outs, full, strict=True):
        assert torch.equal(out.cpu(), f[ref])
        assert torch.equal(t.getData(ref.to(DEV)).cpu(), f[ref])
    rows = [rand_tensor((ref.numel(), dim), seed=152 + k) for k in range(len(tables))]
    gl.scatter_many(tables, [r.to(DEV) for r in rows], ref.to(DEV))
    for t, f, r in zip(tables, full, rows, strict=True):
        assert torch.equal(torch.from_numpy(t.getNumpyVersion()), last_wins(f, ref, r))


# --- out= buffers ------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_out_buffer(placement):
    n_rows, dim = 2000, 20
    data = rand_tensor((n_rows, dim), seed=160)
    g = make(placement, data)
    ref = torch.from_numpy(rand_ids(700, n_rows, 161))
    out = torch.full((700, dim), -1.0, device=DEV)
    res = g.getData(ref.to(DEV), out=out)
    assert torch.equal(out.cpu(), data[ref])
    assert torch.equal(res.cpu(), data[ref])
    out2 = torch.full((700, dim), -1.0, device=DEV)
    g.getData(ref, out=out2)
    assert torch.equal(out2.cpu(), data[ref])

    cuda_ids = ref.to(DEV)
    with pytest.raises(gl.GadgetValueError):
        g.getData(cuda_ids, out=torch.empty((700, dim + 1), device=DEV))
    with pytest.raises(gl.GadgetValueError):
        g.getData(cuda_ids, out=torch.empty((dim, 700), device=DEV).t())
    with pytest.raises(gl.GadgetTypeError):
        g.getData(cuda_ids, out=torch.empty((700, dim), dtype=torch.float64, device=DEV))
    with pytest.raises(gl.GadgetTypeError):
        g.getData(cuda_ids, out=torch.empty((700, dim)))  # a CPU out for rows delivered on CUDA
    assert torch.equal(snap(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_out_inside_the_table_with_a_bad_id_leaves_the_table(placement):
    data = rand_tensor((1000, 8), seed=165)
    g = make(placement, data)
    view = g.as_tensor()[100:104]
    with pytest.raises(gl.GadgetError):
        g.getData(torch.tensor([1, 2, 1000, 3], device=DEV), out=view)
    assert torch.equal(snap(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_delivery_to_another_device(placement):
    data = rand_tensor((1000, 8), seed=166)
    g = make(placement, data)
    ref = torch.from_numpy(rand_ids(300, 1000, 167))
    got = g.getData(ref.to(DEV), device="cpu")
    assert got.device.type == "cpu"
    assert torch.equal(got, data[ref])
    got = g.getData(ref, device=DEV)
    assert got.device.type == DEV.type
    assert torch.equal(got.cpu(), data[ref])


# --- bad input on the GPU ----------------------------------------------------------------------

BAD_ID_KINDS = ["negative", "len", "huge", "negative_int32", "cpu_len", "cupy_len"]


def _bad_ids(kind, n_rows):
    """Nine ids, the fifth of them bad."""
    base = [5, 0, n_rows - 1, 17]
    if kind == "negative":
        return torch.tensor([*base, -1, *base], device=DEV)
    if kind == "len":
        return torch.tensor([*base, n_rows, *base], device=DEV)
    if kind == "huge":
        return torch.tensor([*base, 2**40, *base], device=DEV)
    if kind == "negative_int32":
        return torch.tensor([*base, -7, *base], dtype=torch.int32, device=DEV)
    if kind == "cpu_len":
        return torch.tensor([*base, n_rows, *base])
    if kind == "cupy_len":
        return cupy.asarray(np.array([*base, n_rows, *base], dtype=np.int64))
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("placement", "kind"),
    [(PINNED_P, k) for k in BAD_ID_KINDS] + [(CUDA_P, k) for k in ("negative", "len", "cpu_len")],
)
def test_bad_ids_raise_and_change_nothing(placement, kind):
    n_rows, dim = 1000, 8
    data = rand_tensor((n_rows, dim), seed=170)
    g = make(placement, data)
    ids = _bad_ids(kind, n_rows)
    with pytest.raises(gl.GadgetIndexError) as info:
        g.getData(ids)
    assert isinstance(info.value, IndexError)
    with pytest.raises(gl.GadgetIndexError):
        _ = g[ids]
    rows = rand_tensor((9, dim), seed=171).to(DEV)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(rows, ids)
    with pytest.raises(gl.GadgetIndexError):
        g[ids] = rows
    assert torch.equal(snap(g), data)
    # the table still works
    assert torch.equal(g.getData(torch.tensor([3, 4], device=DEV)).cpu(), data[[3, 4]])


@pytest.mark.parametrize(("placement", "strategy"), STRATEGY_PARAMS)
def test_scatter_with_a_bad_id_writes_nothing(placement, strategy):
    n_rows, dim = 20_000, 12
    data = rand_tensor((n_rows, dim), seed=175)
    g = make(placement, data, strategy=strategy)
    for n in (10, 5000, 300_000):
        ids = torch.from_numpy(rand_ids(n, n_rows, n))
        rows = rand_tensor((n, dim), seed=n + 1)
        bad_last = ids.clone()
        bad_last[-1] = n_rows
        bad_first = ids.clone()
        bad_first[0] = -1
        for bad in (bad_last.to(DEV), bad_first.to(DEV), bad_last):
            with pytest.raises(gl.GadgetIndexError):
                g.insertData(rows.to(DEV), bad)
            assert torch.equal(snap(g), data), (n, bad.device)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_large_gather_with_a_bad_cuda_id_raises(placement):
    n_rows, dim = 50_000, 8
    data = rand_tensor((n_rows, dim), seed=180)
    for strategy in ("auto", "kernel"):
        g = make(placement, data, strategy=strategy)
        for bad_value in (n_rows, -1):
            ids = torch.from_numpy(rand_ids(100_000, n_rows, 181))
            ids[50_000] = bad_value
            with pytest.raises(gl.GadgetIndexError):
                g.getData(ids.to(DEV))
            out = torch.empty((100_000, dim), device=DEV)
            with pytest.raises(gl.GadgetIndexError):
                g.getData(ids.to(DEV), out=out)
        assert torch.equal(snap(g), data)


WRONG_DATA = [
    "float64",
    "float64_numpy",
    "int32",
    "row_width",
    "row_count",
    "meta_device",
    "float_ids",
]


@pytest.mark.parametrize(
    ("placement", "case"),
    [(PINNED_P, c) for c in WRONG_DATA]
    + [(CUDA_P, c) for c in ("float64", "row_width", "meta_device")],
)
def test_insert_wrong_data_is_refused_before_writing(placement, case):
    data = rand_tensor((500, 6), seed=185)
    g = make(placement, data)
    ids = torch.tensor([1, 2, 3], device=DEV)
    good = rand_tensor((3, 6), seed=186)
    if case == "float64":
        obj, exc = good.double().to(DEV), gl.GadgetTypeError
    elif case == "float64_numpy":
        obj, exc = good.double().numpy(), gl.GadgetTypeError
    elif case == "int32":
        obj, exc = good.to(torch.int32).to(DEV), gl.GadgetTypeError
    elif case == "row_width":
        obj, exc = rand_tensor((3, 7), seed=187).to(DEV), gl.GadgetValueError
    elif case == "row_count":
        obj, exc = rand_tensor((4, 6), seed=188).to(DEV), gl.GadgetValueError
    elif case == "meta_device":
        obj, exc = torch.empty((3, 6), device="meta"), gl.GadgetTypeError
    else:
        obj, exc = good.to(DEV), gl.GadgetTypeError
        ids = torch.tensor([1.0, 2.0, 3.0], device=DEV)
        with pytest.raises(gl.GadgetTypeError):
            g.getData(ids)
    with pytest.raises(exc) as info:
        g.insertData(obj, ids)
    assert isinstance(info.value, gl.GadgetError)
    assert isinstance(info.value, TypeError if exc is gl.GadgetTypeError else ValueError)
    assert torch.equal(snap(g), data)


# --- streams -----------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_work_is_queued_on_the_current_side_stream(placement):
    """Ids and rows made late on a side stream are seen by calls made on that stream."""
    n_rows, dim, n = 4000, 16, 3000
    data = rand_tensor((n_rows, dim), seed=190)
    g = make(placement, data)
    ref = torch.from_numpy(rand_ids(n, n_rows, 191))
    ref2 = torch.from_numpy(rand_ids(n, n_rows, 192))
    rows = rand_tensor((n, dim), seed=193)
    ids_src, ids2_src, rows_src = ref.to(DEV), ref2.to(DEV), rows.to(DEV)
    ids_buf = torch.zeros(n, dtype=torch.int64, device=DEV)
    ids2_buf = torch.zeros(n, dtype=torch.int64, device=DEV)
    rows_buf = torch.zeros((n, dim), device=DEV)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        ids_buf.copy_(ids_src)
        got = g.getData(ids_buf)
        torch.cuda._sleep(50_000_000)
        ids2_buf.copy_(ids2_src)
        got_unchecked = g.getData(ids2_buf, check_ids=False)
        torch.cuda._sleep(50_000_000)
        rows_buf.copy_(rows_src)
        g.insertData(rows_buf, ids_buf)
        after = g.getData(ids_buf)
    side.synchronize()
    assert torch.equal(got.cpu(), data[ref])
    assert torch.equal(got_unchecked.cpu(), data[ref2])
    expected = last_wins(data, ref, rows)
    assert torch.equal(after.cpu(), expected[ref])
    assert torch.equal(snap(g), expected)


def test_fused_transfers_on_a_side_stream():
    n_rows, dim, n = 3000, 8, 2000
    datas = [rand_tensor((n_rows, dim), seed=195 + k) for k in range(3)]
    tables = [make(PINNED_P, d) for d in datas]
    ref = torch.from_numpy(rand_ids(n, n_rows, 198))
    rows = [rand_tensor((n, dim), seed=199 + k) for k in range(3)]
    ids_src = ref.to(DEV)
    rows_src = [r.to(DEV) for r in rows]
    ids_buf = torch.zeros(n, dtype=torch.int64, device=DEV)
    rows_buf = [torch.zeros((n, dim), device=DEV) for _ in range(3)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        ids_buf.copy_(ids_src)
        before = gl.gather_many(tables, ids_buf)
        torch.cuda._sleep(50_000_000)
        for buf, src in zip(rows_buf, rows_src, strict=True):
            buf.copy_(src)
        gl.scatter_many(tables, rows_buf, ids_buf)
        after = gl.gather_many(tables, ids_buf)
    side.synchronize()
    for d, r, b, a, t in zip(datas, rows, before, after, tables, strict=True):
        assert torch.equal(b.cpu(), d[ref])
        expected = last_wins(d, ref, r)
        assert torch.equal(a.cpu(), expected[ref])
        assert torch.equal(snap(t), expected)


# --- training: OffloadedEmbedding + OffloadedOptimizer against a dense CUDA nn.Embedding ------


def _pair(n_rows, dim, placement, *, bag_mode=None, head=True, seed=0):
    """An offloaded model and its dense CUDA twin, starting from the same weights."""
    w0 = rand_tensor((n_rows, dim), seed=seed)
    if bag_mode is None:
        emb = gl.OffloadedEmbedding(n_rows, dim, placement=placement)
        dense = torch.nn.Embedding(n_rows, dim)
    else:
        emb = gl.OffloadedEmbeddingBag(n_rows, dim, mode=bag_mode, placement=placement)
        dense = torch.nn.EmbeddingBag(n_rows, dim, mode=bag_mode)
    emb.weight.insertData(w0.clone(), torch.arange(n_rows))
    with torch.no_grad():
        dense.weight.copy_(w0)
    parts, ref_parts = {"emb": emb}, {"emb": dense}
    if head:
        torch.manual_seed(seed)
        lin = torch.nn.Linear(dim, 1)
        parts["head"], ref_parts["head"] = lin, copy.deepcopy(lin)
    model = torch.nn.ModuleDict(parts).cuda()
    ref = torch.nn.ModuleDict(ref_parts).cuda()
    return model, ref, w0


def _id_batches(n_rows, steps, shape, *, full, seed):
    """CUDA id tensors of ``shape``; with ``full`` each one names every row at least once."""
    gen = torch.Generator().manual_seed(seed)
    count = int(np.prod(shape))
    out = []
    for _ in range(steps):
        if full:
            ids = torch.cat(
                [
                    torch.randperm(n_rows, generator=gen),
                    torch.randint(0, n_rows, (count - n_rows,), generator=gen),
                ]
            )
            ids = ids[torch.randperm(count, generator=gen)]
        else:
            ids = torch.randint(0, n_rows, (count,), generator=gen)
        out.append(ids.reshape(shape).to(DEV))
    return out


def _targets(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(s), generator=gen).to(DEV) for s in shapes]


def _assert_same_weights(model, ref, w0, *, exact=True):
    got = torch.from_numpy(model["emb"].weight.getNumpyVersion())
    want = ref["emb"].weight.detach().cpu()
    assert not torch.equal(want, w0)  # training moved the table
    tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    if "head" in model:
        for a, b in zip(model["head"].parameters(), ref["head"].parameters(), strict=True):
            torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), **tol)


# (optimizer, options, whether every step must name every row: optimizers whose dense update
# moves rows without gradient (momentum, moments, weight decay) equal lazy updates only then)
OPT_CASES = {
    "sgd": (torch.optim.SGD, {"lr": 0.5}, False),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, True),
    "adam": (torch.optim.Adam, {"lr": 0.01}, True),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}, True),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}, False),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01}, True),
}
TRAIN_PARAMS = [pytest.param(PINNED_P, k, id=f"pinned-{k}") for k in OPT_CASES] + [
    pytest.param(CUDA_P, "adam", id="cuda-adam"),
    pytest.param(CUDA_P, "sgd", id="cuda-sgd"),
]


@pytest.mark.parametrize(("placement", "opt_name"), TRAIN_PARAMS)
def test_training_equals_dense_embedding(placement, opt_name):
    opt_cls, kwargs, full = OPT_CASES[opt_name]
    n_rows = 64 if full else 3000
    model, ref, w0 = _pair(n_rows, 16, placement, seed=200)
    opt = gl.OffloadedOptimizer(opt_cls, model, **kwargs)
    ref_opt = opt_cls(ref.parameters(), **kwargs)
    batches = _id_batches(n_rows, 6, (32, 8), full=full, seed=201)
    targets = _targets([b.shape for b in batches], seed=202)
    for ids, target in zip(batches, targets, strict=True):
        opt.zero_grad()
        ref_opt.zero_grad()
        out = model["head"](model["emb"](ids)).squeeze(-1)
        want = ref["head"](ref["emb"](ids)).squeeze(-1)
        assert torch.equal(out, want)
        mse_loss(out, target).backward()
        mse_loss(want, target).backward()
        opt.step()
        ref_opt.step()
    _assert_same_weights(model, ref, w0)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_several_lookups_per_step_equal_dense(placement):
    n_rows = 64
    model, ref, w0 = _pair(n_rows, 16, placement, seed=210)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    first = _id_batches(n_rows, 5, (32, 8), full=True, seed=211)
    second = _id_batches(n_rows, 5, (16, 6), full=True, seed=212)
    third = _id_batches(n_rows, 5, (40,), full=False, seed=213)
    t1 = _targets([b.shape for b in first], seed=214)
    t2 = _targets([b.shape for b in second], seed=215)

    def loss_of(m, a, b, c, ta, tb):
        out_a = m["head"](m["emb"](a)).squeeze(-1)
        out_b = m["head"](m["emb"](b)).squeeze(-1)
        out_c = m["emb"](c).sum(-1)
        return mse_loss(out_a, ta) + mse_loss(out_b, tb) + out_c.square().mean()

    for a, b, c, ta, tb in zip(first, second, third, t1, t2, strict=True):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = loss_of(model, a, b, c, ta, tb)
        ref_loss = loss_of(ref, a, b, c, ta, tb)
        assert torch.equal(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
    _assert_same_weights(model, ref, w0)


def test_gradient_accumulation_over_two_backward_passes_equals_dense():
    n_rows = 64
    model, ref, w0 = _pair(n_rows, 16, PINNED_P, seed=220)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    batches = _id_batches(n_rows, 8, (32, 4), full=True, seed=221)
    targets = _targets([b.shape for b in batches], seed=222)
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            ids, target = batches[2 * step + micro], targets[2 * step + micro]
            out = model["head"](model["emb"](ids)).squeeze(-1)
            want = ref["head"](ref["emb"](ids)).squeeze(-1)
            (mse_loss(out, target) / 2).backward()
            (mse_loss(want, target) / 2).backward()
        opt.step()
        ref_opt.step()
    _assert_same_weights(model, ref, w0)


def test_readme_loop_order_zero_grad_after_forward():
    """README: ``pred = model(...); loss = ...; opt.zero_grad(); loss.backward(); opt.step()``."""
    n_rows = 2000
    model, ref, w0 = _pair(n_rows, 8, PINNED_P, seed=230)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batches = _id_batches(n_rows, 5, (64, 4), full=False, seed=231)
    targets = _targets([b.shape for b in batches], seed=232)
    for ids, target in zip(batches, targets, strict=True):
        loss = mse_loss(model["head"](model["emb"](ids)).squeeze(-1), target)
        ref_loss = mse_loss(ref["head"](ref["emb"](ids)).squeeze(-1), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    _assert_same_weights(model, ref, w0)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_embedding_bag_2d_input_trains_as_dense(mode, opt_name):
    opt_cls, kwargs, full = OPT_CASES[opt_name]
    n_rows = 64 if full else 2000
    model, ref, w0 = _pair(n_rows, 16, PINNED_P, bag_mode=mode, seed=240)
    opt = gl.OffloadedOptimizer(opt_cls, model, **kwargs)
    ref_opt = opt_cls(ref.parameters(), **kwargs)
    batches = _id_batches(n_rows, 5, (32, 8), full=full, seed=241)
    targets = _targets([(32,)] * len(batches), seed=242)
    for ids, target in zip(batches, targets, strict=True):
        opt.zero_grad()
        ref_opt.zero_grad()
        out = model["head"](model["emb"](ids)).squeeze(-1)
        want = ref["head"](ref["emb"](ids)).squeeze(-1)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        mse_loss(out, target).backward()
        mse_loss(want, target).backward()
        opt.step()
        ref_opt.step()
    _assert_same_weights(model, ref, w0, exact=False)


def test_embedding_bag_offsets_input_trains_as_dense():
    n_rows = 2000
    model, ref, w0 = _pair(n_rows, 8, PINNED_P, bag_mode="sum", seed=250)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    offsets = torch.tensor([0, 3, 3, 10, 50, 120, 199], device=DEV)  # one empty bag
    batches = _id_batches(n_rows, 4, (200,), full=False, seed=251)
    targets = _targets([(offsets.numel(),)] * len(batches), seed=252)
    for ids, target in zip(batches, targets, strict=True):
        opt.zero_grad()
        ref_opt.zero_grad()
        out = model["head"](model["emb"](ids, offsets)).squeeze(-1)
        want = ref["head"](ref["emb"](ids, offsets)).squeeze(-1)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        mse_loss(out, target).backward()
        mse_loss(want, target).backward()
        opt.step()
        ref_opt.step()
    _assert_same_weights(model, ref, w0, exact=False)


def test_cuda_id_out_of_range_in_training_is_reported_by_step_and_changes_nothing():
    n_rows, dim = 64, 8
    model, ref, w0 = _pair(n_rows, dim, PINNED_P, head=False, seed=260)
    emb, dense = model["emb"], ref["emb"]
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    batches = _id_batches(n_rows, 3, (32, 4), full=True, seed=261)
    targets = _targets([(32, 4)] * 3, seed=262)

    def good_step(ids, target):
        opt.zero_grad()
        ref_opt.zero_grad()
        mse_loss(emb(ids).sum(-1), target).backward()
        mse_loss(dense(ids).sum(-1), target).backward()
        opt.step()
        ref_opt.step()

    good_step(batches[0], targets[0])
    table_before = emb.weight.getNumpyVersion()
    states_before = {k: t.getNumpyVersion() for k, t in dict(opt.pagers[0].tables).items()}
    assert states_before

    bad = batches[1].clone()
    bad[0, 0] = n_rows
    opt.zero_grad()
    out = emb(bad)
    assert torch.count_nonzero(out[0, 0]).item() == 0  # the bad id's lookup is zeros
    mse_loss(out.sum(-1), targets[1]).backward()
    with pytest.raises(gl.GadgetIndexError):
        opt.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), table_before)
    for k, t in dict(opt.pagers[0].tables).items():
        np.testing.assert_array_equal(t.getNumpyVersion(), states_before[k])

    # that step was dropped: the next good step equals the dense twin's second step
    good_step(batches[2], targets[2])
    _assert_same_weights(model, ref, w0)


def test_no_grad_lookup_checks_cuda_ids_at_once():
    n_rows = 100
    emb = gl.OffloadedEmbedding(n_rows, 4, placement=PINNED_P).cuda()
    _opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)  # kept alive: trains `emb`
    before = emb.weight.getNumpyVersion()
    with torch.no_grad(), pytest.raises(gl.GadgetIndexError):
        emb(torch.tensor([1, n_rows], device=DEV))
    with torch.no_grad():
        out = emb(torch.tensor([1, n_rows - 1, 1], device=DEV))
    assert out.device.type == DEV.type
    assert torch.equal(out.cpu(), torch.from_numpy(before)[[1, n_rows - 1, 1]])
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), before)


# --- input pipeline on CUDA --------------------------------------------------------------------

N_DATA = 10_003


def _pipeline_data(n_rows=N_DATA, dim=12, seed=300):
    x = rand_tensor((n_rows, dim), seed=seed).numpy()
    y = np.arange(n_rows, dtype=np.int64)
    return x, y


def _collect(batches):
    """CPU copies of ``(x, y)`` batches, checking that each arrives on the GPU."""
    out = []
    for bx, by in batches:
        assert bx.device.type == DEV.type
        assert by.device.type == DEV.type
        assert bx.dtype == torch.float32
        assert by.dtype == torch.int64
        out.append((bx.cpu(), by.cpu()))
    return out


def _check_epoch(batches, x):
    """Every row exactly once, and each batch's features are the rows its labels name."""
    seen = torch.cat([by for _, by in batches])
    assert torch.equal(torch.sort(seen).values, torch.arange(x.shape[0]))
    xt = torch.from_numpy(x)
    for bx, by in batches:
        assert torch.equal(bx, xt[by])


def _order(batches):
    return torch.cat([by for _, by in batches])


def test_dataloader_default_form_gives_gpu_batches():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    batches = _collect(DataLoader(ds, batch_size=512, shuffle=True))
    assert len(batches) == -(-N_DATA // 512)
    _check_epoch(batches, x)


def test_dataloader_with_gadget_sampler_two_epochs():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    sampler = gl.GadgetSampler(ds, batch_size=500, order="random", seed=0)
    loader = DataLoader(ds, batch_sampler=sampler)
    first = _collect(loader)
    second = _collect(loader)
    _check_epoch(first, x)
    _check_epoch(second, x)
    assert not torch.equal(_order(first), _order(second))


def test_dataloader_with_sampler_and_batch_size_none():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    sampler = gl.GadgetSampler(ds, batch_size=700, order="random", seed=1)
    batches = _collect(DataLoader(ds, sampler=sampler, batch_size=None))
    _check_epoch(batches, x)


def test_sampler_read_ahead_gives_the_same_batches_as_coalesce_one():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    grouped = _collect(DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=256, seed=4)))
    single = _collect(
        DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=256, seed=4, coalesce=1))
    )
    _check_epoch(grouped, x)
    assert len(grouped) == len(single)
    for (gx, gy), (sx, sy) in zip(grouped, single, strict=True):
        assert torch.equal(gy, sy)
        assert torch.equal(gx, sx)


def test_two_ranks_share_every_row_once():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    parts = []
    for rank in (0, 1):
        sampler = gl.GadgetSampler(ds, batch_size=300, seed=2, num_replicas=2, rank=rank)
        parts.append(_collect(DataLoader(ds, batch_sampler=sampler)))
    assert len(parts[0]) == len(parts[1])
    _check_epoch(parts[0] + parts[1], x)


def test_gadget_loader_sequential_and_random_epochs():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    sequential = _collect(gl.GadgetLoader(ds, batch_size=512, order="sequential"))
    assert torch.equal(_order(sequential), torch.arange(N_DATA))
    _check_epoch(sequential, x)
    loader = gl.GadgetLoader(ds, batch_size=512, prefetch=2, seed=3)
    first = _collect(loader)
    second = _collect(loader)
    _check_epoch(first, x)
    _check_epoch(second, x)
    assert not torch.equal(_order(first), _order(second))


def test_gadget_loader_drop_last():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    batches = _collect(gl.GadgetLoader(ds, batch_size=1000, drop_last=True, seed=6))
    assert len(batches) == N_DATA // 1000
    assert all(by.numel() == 1000 for _, by in batches)
    seen = _order(batches)
    assert seen.unique().numel() == seen.numel()
    xt = torch.from_numpy(x)
    for bx, by in batches:
        assert torch.equal(bx, xt[by])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gadget_loader_without_prefetch_sees_writes(placement):
    n_rows, dim, batch = 4000, 4, 500
    gx = gl.DataGadget(torch.zeros(n_rows, dim), placement=placement)
    ds = gl.GadgetDataset(gx, torch.arange(n_rows))
    count = 0
    for k, (bx, by) in enumerate(
        gl.GadgetLoader(ds, batch_size=batch, prefetch=0, order="sequential")
    ):
        assert torch.equal(by.cpu(), torch.arange(k * batch, min((k + 1) * batch, n_rows)))
        assert torch.all(bx == float(k)).item(), k
        nxt = torch.arange((k + 1) * batch, min((k + 2) * batch, n_rows))
        if nxt.numel():
            gx.insertData(torch.full((nxt.numel(), dim), float(k + 1)), nxt.to(DEV))
        count += 1
    assert count == n_rows // batch


def test_dataset_columns_of_several_dtypes_and_placements():
    n_rows = 5000
    a = rand_tensor((n_rows, 3), torch.float16, seed=310)  # 6-byte rows, default placement
    b = rand_tensor((n_rows, 5), torch.uint8, seed=311)  # a `cuda` DataGadget
    c = rand_tensor((n_rows,), torch.int64, seed=312)  # a CUDA tensor: a `cuda` column
    ids = torch.arange(n_rows)
    ds = gl.GadgetDataset(a.numpy(), gl.DataGadget(b.clone(), placement=CUDA_P), c.to(DEV), ids)
    seen = []
    for ba, bb, bc, bi in gl.GadgetLoader(ds, batch_size=700, seed=7):
        for t in (ba, bb, bc, bi):
            assert t.device.type == DEV.type
        bi = bi.cpu()
        assert torch.equal(ba.cpu(), a[bi])
        assert torch.equal(bb.cpu(), b[bi])
        assert torch.equal(bc.cpu(), c[bi])
        seen.append(bi)
    assert torch.equal(torch.sort(torch.cat(seen)).values, ids)


def test_dataset_gather_with_cuda_ids():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    ref = torch.from_numpy(rand_ids(3000, N_DATA, 320))
    xt = torch.from_numpy(x)
    bx, by = ds.gather(ref.to(DEV))
    assert bx.device.type == DEV.type
    assert torch.equal(bx.cpu(), xt[ref])
    assert torch.equal(by.cpu(), ref)
    bx2, by2 = ds[ref.to(DEV)]
    assert torch.equal(bx2.cpu(), xt[ref])
    assert torch.equal(by2.cpu(), ref)
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(torch.tensor([0, N_DATA], device=DEV))
    with pytest.raises(gl.GadgetIndexError):
        _ = ds[torch.tensor([-1, 2], device=DEV)]


def test_gadget_loader_batches_used_on_a_side_stream():
    x, y = _pipeline_data()
    ds = gl.GadgetDataset(x, y)
    side = torch.cuda.Stream()
    doubled = []
    with torch.cuda.stream(side):
        for bx, by in gl.GadgetLoader(ds, batch_size=256, seed=5):
            doubled.append(((bx * 2).cpu(), by.cpu()))
    xt = torch.from_numpy(x)
    seen = torch.cat([by for _, by in doubled])
    assert torch.equal(torch.sort(seen).values, torch.arange(N_DATA))
    for b2, by in doubled:
        assert torch.equal(b2, xt[by] * 2)


# --- check_ids=False with ids out of range (last: see the module docstring) --------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_unchecked_gather_gives_zero_rows_for_ids_out_of_range(placement):
    n_rows, dim = 1000, 8
    data = rand_tensor((n_rows, dim), seed=400)
    g = make(placement, data)
    ids = torch.tensor([3, n_rows, 7, n_rows + 5, 2**40, 999], device=DEV)
    got = g.getData(ids, check_ids=False).cpu()
    assert tuple(got.shape) == (6, dim)
    assert torch.equal(got[[0, 2, 5]], data[[3, 7, 999]])
    assert torch.count_nonzero(got[[1, 3, 4]]).item() == 0
    assert torch.equal(snap(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_unchecked_large_gather_gives_zero_rows_for_ids_out_of_range(placement):
    n_rows, dim = 50_000, 8
    data = rand_tensor((n_rows, dim), seed=401)
    g = make(placement, data)
    ids = torch.from_numpy(rand_ids(100_000, n_rows, 402))
    bad = torch.tensor([0, 777, 50_000, 99_999])
    ids[bad] = torch.tensor([n_rows, n_rows + 1, 2**35, n_rows])
    got = g.getData(ids.to(DEV), check_ids=False).cpu()
    good = torch.ones(ids.numel(), dtype=torch.bool)
    good[bad] = False
    assert torch.equal(got[good], data[ids[good]])
    assert torch.count_nonzero(got[bad]).item() == 0
    assert torch.equal(snap(g), data)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_unchecked_scatter_skips_ids_out_of_range(placement):
    n_rows, dim = 1000, 8
    data = rand_tensor((n_rows, dim), seed=410)
    g = make(placement, data)
    ids = torch.tensor([3, n_rows, 7, 3, n_rows + 9, 2**40])
    rows = rand_tensor((6, dim), seed=411)
    g.insertData(rows.to(DEV), ids.to(DEV), check_ids=False)
    expected = data.clone()
    expected[3] = rows[3]
    expected[7] = rows[2]
    assert torch.equal(snap(g), expected)

    # a large write (sorted merge) with a few ids out of range
    big = torch.from_numpy(rand_ids(300_000, n_rows, 412))
    bad = torch.tensor([5, 150_000, 299_999])
    big[bad] = torch.tensor([n_rows, 2**33, n_rows + 1])
    rows = rand_tensor((300_000, dim), seed=413)
    g.insertData(rows.to(DEV), big.to(DEV), check_ids=False)
    good = torch.ones(big.numel(), dtype=torch.bool)
    good[bad] = False
    expected = last_wins(expected, big[good], rows[good])
    assert torch.equal(snap(g), expected)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_unchecked_negative_ids_stay_inside_the_table(placement):
    """README: no GPU kernel reads or writes outside a table, whatever the ids. What an
    unchecked negative id yields is not spelled out, so only the valid ids are checked."""
    n_rows, dim = 1000, 8
    data = rand_tensor((n_rows, dim), seed=420)
    g = make(placement, data)
    ids = torch.tensor([3, -1, 7, -(2**40), 999], device=DEV)
    got = g.getData(ids, check_ids=False).cpu()
    assert torch.equal(got[[0, 2, 4]], data[[3, 7, 999]])
    assert torch.equal(snap(g), data)
