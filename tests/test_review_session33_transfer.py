"""Black-box review (session 33): rows in and out of stores.

Written from README.md ("Rows in and out", "Errors"), /work/shared/SPEC.md and the public
docstrings of ``DataGadget``, ``gather_many`` / ``scatter_many``, ``gadgetloader.transfer``
and ``gadgetloader.stores`` only.  Every placement usable on a CPU-only machine is covered:
``cpu``, ``file`` and the ``cuda`` / ``pinned`` requests that fall back to ``cpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader import transfer as T  # noqa: N812


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


PLACEMENTS = ["cpu", "cuda", "pinned", "file"]
STRATEGIES = ["auto", "kernel", "sorted", "hybrid", "torch"]
INT_NP = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
INT_TORCH = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _np_of(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def _random_table(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g) * 40
    if dtype == torch.bool:
        return base > 0
    if dtype == torch.uint8:
        return base.abs().clamp(max=255).to(dtype)
    if dtype == torch.int8:
        return base.clamp(-128, 127).to(dtype)
    return base.to(dtype)


@pytest.fixture
def make(tmp_path):
    """make(src_tensor, placement, **kw) -> DataGadget holding a copy of src."""
    counter = [0]
    made = []

    def _make(src: torch.Tensor, placement: str, **kw):
        if placement == "file":
            if src.dtype == torch.bfloat16:
                pytest.skip("NumPy (hence .npy) has no bfloat16")
            counter[0] += 1
            p = tmp_path / f"t{counter[0]}.npy"
            np.save(p, src.numpy())
            g = gl.DataGadget(str(p), placement="file", **kw)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", gl.FallbackWarning)
                g = gl.DataGadget(src, placement=placement, **kw)
        made.append(g)
        return g

    yield _make
    for g in made:
        g.close()


def _snapshot(g) -> torch.Tensor:
    return g.getData(slice(None)).clone()


def _last_wins(ref: torch.Tensor, ids, rows: torch.Tensor) -> torch.Tensor:
    """Sequential (NumPy-like) assignment, done explicitly in Python."""
    out = ref.clone()
    flat_ids = torch.as_tensor(np.asarray(ids)).reshape(-1).tolist()
    flat_rows = rows.reshape((len(flat_ids),) + tuple(ref.shape[1:]))
    for k, i in enumerate(flat_ids):
        out[i] = flat_rows[k]
    return out


# --------------------------------------------------------------------------------------
# placements
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["cuda", "pinned"])
def test_gpu_placements_fall_back_to_cpu_with_the_same_rows(make, placement):
    src = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    g = make(src, placement)
    assert g.placement == "cpu"
    assert g.device == torch.device("cpu")
    r = g.getData([3, 0])
    assert r.device.type == "cpu"
    assert torch.equal(r, src[[3, 0]])


def test_cpupinn_defaults_fall_back_to_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        a = gl.DataGadget((5, 2), CPUPinn=True)
        b = gl.DataGadget((5, 2))
        c = gl.DataGadget((5, 2), CPUPinn=1)
    assert a.placement == b.placement == c.placement == "cpu"
    assert a.dtype == torch.float32 and a.shape == (5, 2)
    assert torch.count_nonzero(a.getData(slice(None))) == 0


@pytest.mark.parametrize("bad", ["False", 2, None, 1.5])
def test_cpupinn_rejects_non_bool(bad):
    with pytest.raises(gl.GadgetTypeError, match="CPUPinn"):
        gl.DataGadget((5, 2), CPUPinn=bad)


def test_fallback_warning_once_per_process():
    code = (
        "import warnings, gadgetloader as gl\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    a = gl.DataGadget((4, 2), placement='pinned')\n"
        "    b = gl.DataGadget((4, 2), placement='cuda')\n"
        "    c = gl.DataGadget((4, 2), CPUPinn=True)\n"
        "    a.getData([1], device='cuda')\n"
        "    gl.gather_many([a, b], [1], device='cuda')\n"
        "n = sum(issubclass(x.category, gl.FallbackWarning) for x in w)\n"
        "print('N', n, a.placement, b.placement, c.placement)\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert "N 1 cpu cpu cpu" in p.stdout, p.stdout


def test_unknown_placement_lists_valid_ones():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget((4, 2), placement="gpu")
    assert isinstance(ei.value, KeyError)
    for name in ("cpu", "cuda", "file", "pinned"):
        assert name in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((4, 2), placement=1)


def test_file_placement_refuses_in_memory_sources():
    with pytest.raises(gl.GadgetError):
        gl.DataGadget(np.zeros((4, 3), np.float32), placement="file")
    with pytest.raises(gl.GadgetError):
        gl.DataGadget((4, 3), placement="file")


def test_file_options_refused_elsewhere():
    with pytest.raises(gl.GadgetTypeError, match="cache_bytes"):
        gl.DataGadget((4, 3), placement="cpu", cache_bytes=0)


# --------------------------------------------------------------------------------------
# every dtype x placement x row width against NumPy
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", list(gl.SUPPORTED_DTYPES), ids=lambda d: str(d)[6:])
def test_gather_scatter_every_dtype_and_width(make, placement, dtype):
    for width in (1, 3, 17, 2049):
        src = _random_table(dtype, (11, width), seed=width)
        g = make(src, placement)
        assert g.dtype == dtype
        assert g.shape == (11, width) and len(g) == 11
        assert g.nbytes == 11 * width * src.element_size()
        ids = [3, 0, 10, 3]
        r = g.getData(ids)
        assert r.dtype == dtype and r.shape == (4, width)
        assert torch.equal(r, src[ids])
        new = _random_table(dtype, (5, width), seed=100 + width)
        wids = np.array([4, 7, 4, 0, 10], dtype=np.int16)
        g.insertData(new, wids)
        assert torch.equal(g.getData(slice(None)), _last_wins(src, wids, new))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_extreme_values_round_trip_exactly(make, placement):
    cases = [
        torch.tensor(
            [
                [torch.finfo(torch.float16).max, float("inf")],
                [float("-inf"), torch.finfo(torch.float16).tiny],
            ],
            dtype=torch.float16,
        ),
        torch.tensor([[2**63 - 1, -(2**63)], [0, -1]], dtype=torch.int64),
        torch.tensor([[255, 0], [128, 1]], dtype=torch.uint8),
        torch.tensor([[-128, 127], [0, -1]], dtype=torch.int8),
        torch.tensor([[1e308, -5e-324], [0.0, -0.0]], dtype=torch.float64),
    ]
    for src in cases:
        g = make(torch.zeros_like(src), placement)
        g.insertData(src, [0, 1])
        back = g.getData([1, 0])
        assert torch.equal(back, src[[1, 0]]), (src.dtype, back)
    nan = torch.tensor([[float("nan"), 1.0]], dtype=torch.float32)
    g = make(torch.zeros(2, 2), placement)
    g.insertData(nan, [1])
    assert torch.isnan(g.getData(1)[0]) and g.getData(1)[1] == 1.0


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_multi_dim_rows(make, placement):
    src = torch.arange(2 * 3 * 40, dtype=torch.float32).reshape(40, 2, 3)
    g = make(src, placement)
    assert g.row_shape == (2, 3)
    ids = np.array([[1, 39, 1], [0, 5, 7]])
    assert torch.equal(g.getData(ids), src[torch.as_tensor(ids)])
    rows = -torch.arange(5 * 6, dtype=torch.float32).reshape(5, 2, 3)
    wids = [5, 1, 5, 39, 0]
    g.insertData(rows, wids)
    assert torch.equal(g.getData(slice(None)), _last_wins(src, wids, rows))


# --------------------------------------------------------------------------------------
# 1-D tables
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_one_dimensional_table(make, placement):
    src = torch.arange(10, dtype=torch.int64) * 3
    g = make(src, placement)
    assert g.row_shape == () and g.shape == (10,)
    assert torch.equal(g.getData([1, 2, 2]), src[[1, 2, 2]])
    assert g.getData([1, 2]).shape == (2,)
    one = g.getData(4)
    assert one.shape == () and one.item() == 12
    assert g.getData(np.array([[1], [9]])).shape == (2, 1)
    g.insertData(torch.tensor([100, 200, 300]), [4, 4, 6])
    ref = src.clone()
    ref[4] = 200
    ref[6] = 300
    assert torch.equal(g.getData(slice(None)), ref)
    g.insertData(torch.tensor(7), 0)
    assert g.getData(0).item() == 7
    with pytest.raises(gl.GadgetValueError):
        g.insertData(torch.tensor([[1, 2]]), [1, 2])  # (1, 2) is not ids.shape (2,)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(torch.tensor([1, 2]), [1, 10])
    ref[0] = 7
    assert torch.equal(g.getData(slice(None)), ref)


def test_zero_rows_and_zero_width_tables():
    g0 = gl.DataGadget((0, 4), dtype="float32", placement="cpu")
    assert g0.getData([]).shape == (0, 4)
    with pytest.raises(gl.GadgetIndexError):
        g0.getData([0])
    gw = gl.DataGadget((5, 0), dtype="float32", placement="cpu")
    assert gw.getData([1, 2]).shape == (2, 0)
    gw.insertData(torch.empty(2, 0), [1, 4])
    with pytest.raises(gl.GadgetIndexError):
        gw.insertData(torch.empty(2, 0), [1, 5])
    with pytest.raises(gl.GadgetValueError):
        gw.insertData(torch.empty(2, 1), [1, 4])


# --------------------------------------------------------------------------------------
# id kinds
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_id_kinds_gather(make, placement):
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    g = make(src, placement)

    def ref(ids):
        return src[torch.as_tensor(np.asarray(ids, dtype=np.int64))]

    for dt in INT_NP:
        ids = np.array([[3, 14], [0, 3]], dtype=dt)
        assert torch.equal(g.getData(ids), ref(ids)), dt
    for dt in INT_TORCH:
        ids = torch.tensor([3, 14, 0, 3], dtype=dt)
        assert torch.equal(g.getData(ids), src[ids.long()]), dt
    assert torch.equal(g.getData(np.array([1, 2, 14], dtype=">i4")), ref([1, 2, 14]))
    assert torch.equal(g.getData(np.arange(12)[::3]), ref([0, 3, 6, 9]))
    assert torch.equal(g.getData(np.arange(6)[::-1]), ref([5, 4, 3, 2, 1, 0]))
    t2 = torch.arange(12).reshape(3, 4).t()
    assert torch.equal(g.getData(t2), src[t2])
    assert torch.equal(g.getData([np.int32(1), np.uint8(2)]), ref([1, 2]))
    assert torch.equal(g.getData([[1, 2], [3, 4]]), ref([[1, 2], [3, 4]]))
    assert torch.equal(g.getData((1, 2)), ref([1, 2]))
    assert torch.equal(g.getData(range(1, 10, 4)), ref([1, 5, 9]))
    assert torch.equal(g.getData(range(5, 0, -2)), ref([5, 3, 1]))
    assert torch.equal(g.getData(7), src[7])
    assert torch.equal(g.getData(np.int64(7)), src[7])
    assert torch.equal(g.getData(np.array(7)), src[7])
    assert torch.equal(g.getData(torch.tensor(7)), src[7])
    ro = np.array([2, 3])
    ro.flags.writeable = False
    assert torch.equal(g.getData(ro), ref([2, 3]))
    for empty in ([], np.array([], dtype=np.int32), torch.empty(0, dtype=torch.int64)):
        r = g.getData(empty)
        assert r.shape == (0, 4) and r.dtype == torch.float32
    assert g.getData(torch.zeros(2, 0, 3, dtype=torch.int64)).shape == (2, 0, 3, 4)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_slices_of_rows_follow_python(make, placement):
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    a = src.numpy()
    g = make(src, placement)
    for s in (
        slice(2, 5),
        slice(-2, None),
        slice(1, 12, 3),
        slice(None, None, -1),
        slice(10, 100),
        slice(5, 2),
        slice(None),
    ):
        assert np.array_equal(_np_of(g.getData(s)), a[s]), s
        assert np.array_equal(_np_of(g[s]), a[s]), s
    with pytest.raises(gl.GadgetValueError):
        g.getData(slice(None, None, 0))
    with pytest.raises(gl.GadgetTypeError):
        g.getData(slice(0, 5, 1.0))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "bad",
    [
        [15],
        [-1],
        [0, 15, 3],
        np.array([2**32 - 1], dtype=np.uint32),
        [2**63 - 1],
        torch.tensor([3, -1], dtype=torch.int8),
        np.array([255], dtype=np.uint8),
        range(10, 16),
        range(-1, 3),
        -1,
        15,
    ],
    ids=lambda b: repr(b)[:30],
)
def test_out_of_range_ids_raise_before_anything(make, placement, bad):
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    g = make(src, placement)
    with pytest.raises(gl.GadgetIndexError) as ei:
        g.getData(bad)
    assert isinstance(ei.value, IndexError) and isinstance(ei.value, gl.GadgetError)
    assert "15" in str(ei.value)  # says what was expected (the table's size)
    n = (
        1
        if isinstance(bad, int)
        else len(
            np.asarray(
                list(bad)
                if isinstance(bad, range)
                else bad.cpu()
                if isinstance(bad, torch.Tensor)
                else bad
            ).reshape(-1)
        )
    )
    rows = torch.full((n, 4), -9.0) if not isinstance(bad, int) else torch.full((4,), -9.0)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(rows, bad)
    with pytest.raises(gl.GadgetIndexError):
        g.insertData(rows, bad, check_ids=False)
    with pytest.raises(gl.GadgetIndexError):
        g.getData(bad, check_ids=False)
    assert torch.equal(_snapshot(g), src)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_out_of_range_message_names_the_bad_id(make, placement):
    g = make(torch.zeros(5, 2), placement)
    with pytest.raises(gl.GadgetIndexError, match="5") as ei:
        g.getData([0, 7])
    assert "7" in str(ei.value)
    with pytest.raises(gl.GadgetIndexError) as ei:
        g.getData([0, -3])
    assert "-3" in str(ei.value) and "negative" in str(ei.value)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_huge_ids_raise_index_error(make, placement):
    g = make(torch.zeros(5, 2), placement)
    for bad in ([2**70], [-(2**70)], np.array([2**63 + 1], dtype=np.uint64), 2**70):
        with pytest.raises(gl.GadgetIndexError):
            g.getData(bad)
    assert torch.count_nonzero(_snapshot(g)) == 0


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "bad",
    [
        np.array([1.0]),
        torch.tensor([1.0]),
        [1.0],
        [1, 2.5],
        ["a"],
        "1",
        b"\x01",
        None,
        {1, 2},
        {1: 2},
        True,
        [True, False],
        np.array([True, False]),
        np.array([1, 2], dtype=object),
        torch.tensor([1j]),
    ],
    ids=lambda b: type(b).__name__ + repr(b)[:20],
)
def test_non_integer_ids_are_type_errors(make, placement, bad):
    src = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    g = make(src, placement)
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.getData(bad)
    assert isinstance(ei.value, TypeError)
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(torch.zeros(2, 4), bad)
    assert torch.equal(_snapshot(g), src)


def test_bool_tensor_ids_point_to_nonzero():
    g = gl.DataGadget(torch.zeros(5, 2), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="nonzero"):
        g.getData(torch.tensor([True, False, True, False, False]))


def test_uint8_tensor_is_ids_not_a_mask():
    src = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    g = gl.DataGadget(src, placement="cpu")
    ids = torch.tensor([1, 0, 1], dtype=torch.uint8)
    assert torch.equal(g.getData(ids), src[ids.long()])


# --------------------------------------------------------------------------------------
# check_ids
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_check_ids_flag_values(make, placement):
    src = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    g = make(src, placement)
    for ok in (True, False, 0, 1, np.bool_(False)):
        assert torch.equal(g.getData([1], check_ids=ok), src[[1]])
        g.insertData(src[[2]], [2], check_ids=ok)
    for bad in ("False", "no", 2, None, 1.0, torch.tensor(True)):
        with pytest.raises(gl.GadgetTypeError, match="check_ids"):
            g.getData([1], check_ids=bad)
        with pytest.raises(gl.GadgetTypeError, match="check_ids"):
            g.insertData(torch.full((1, 4), -1.0), [1], check_ids=bad)
        with pytest.raises(gl.GadgetTypeError, match="check_ids"):
            gl.gather_many([g], [1], check_ids=bad)
        with pytest.raises(gl.GadgetTypeError, match="check_ids"):
            gl.scatter_many([g], [torch.full((1, 4), -1.0)], [1], check_ids=bad)
    assert torch.equal(_snapshot(g), src)


# --------------------------------------------------------------------------------------
# repeated ids in a scatter, strategies
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_give_numpy_results(make, placement, strategy):
    rng = np.random.default_rng(7)
    src = torch.as_tensor(rng.standard_normal((64, 5)).astype(np.float32))
    g = make(src, placement, strategy=strategy)
    ids = rng.integers(0, 64, size=(3, 50))
    assert np.array_equal(_np_of(g.getData(ids)), src.numpy()[ids])
    wids = rng.integers(0, 64, size=(7, 30))
    rows = torch.as_tensor(rng.standard_normal((7, 30, 5)).astype(np.float32))
    g.insertData(rows, wids)
    ref = src.numpy().copy()
    ref[wids.reshape(-1)] = rows.numpy().reshape(-1, 5)  # NumPy's sequential assignment
    assert np.array_equal(_np_of(g.getData(slice(None))), ref)
    assert torch.equal(g.getData(slice(None)), _last_wins(src, wids, rows))


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_strategies_identical_for_large_repeated_requests(make, placement):
    """>= 65,536 ids with repeats (the dedup gather's range) and > 2**18 scatter ids."""
    rng = np.random.default_rng(11)
    src = torch.as_tensor(rng.standard_normal((700, 2)).astype(np.float32))
    ids = rng.integers(0, 700, size=70_000)
    wids = rng.integers(0, 700, size=270_000)
    rows = torch.as_tensor(rng.standard_normal((270_000, 2)).astype(np.float32))
    ref = src.numpy().copy()
    ref[wids] = rows.numpy()
    results = []
    for s in STRATEGIES:
        g = make(src, placement, strategy=s)
        got = g.getData(ids)
        assert np.array_equal(got.numpy(), src.numpy()[ids]), s
        g.insertData(rows, wids)
        after = g.getData(slice(None))
        assert np.array_equal(after.numpy(), ref), s
        results.append(after)
        g.close()
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_strategy_names_validated():
    src = torch.zeros(4, 2)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(src, placement="cpu", strategy="bogus")
    for s in STRATEGIES:
        assert s in str(ei.value)
    for bad in (3, None):
        with pytest.raises(gl.GadgetTypeError):
            gl.DataGadget(src, placement="cpu", strategy=bad)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_engine_gather_scatter_on_cpu_tensors(strategy):
    tab = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    ids = torch.tensor([[3, 3], [0, 14]])
    assert torch.equal(T.gather(tab, ids, strategy=strategy), tab[ids])
    out = torch.empty(2, 2, 4)
    r = T.gather(tab, ids, out=out, strategy=strategy)
    assert r is out and torch.equal(out, tab[ids])
    flat = torch.empty(4, 4)  # documented: (ids.numel(), *row) -> a view in the result's shape
    r = T.gather(tab, ids, out=flat, strategy=strategy)
    assert r.shape == (2, 2, 4) and r.data_ptr() == flat.data_ptr()
    assert torch.equal(r, tab[ids])
    t2 = tab.clone()
    sids = torch.tensor([1, 1, 2, 1])
    rows = torch.stack([tab[5], tab[6], tab[7], tab[8]])
    T.scatter(t2, sids, rows, strategy=strategy)
    assert torch.equal(t2, _last_wins(tab, sids, rows))
    # a CPU table always resolves to torch
    assert T.resolve_strategy(strategy, tab, 4) == "torch"
    assert T.resolve_strategy(strategy, tab, 4, kind="scatter") == "torch"


def test_engine_strategy_errors():
    tab = torch.zeros(4, 2)
    ids = torch.tensor([1])
    with pytest.raises(gl.GadgetKeyError):
        T.gather(tab, ids, strategy="x")
    with pytest.raises(gl.GadgetKeyError):
        T.scatter(tab, ids, tab[:1], strategy="x")
    with pytest.raises(gl.GadgetTypeError):
        T.resolve_strategy(None, tab, 1)
    with pytest.raises(gl.GadgetKeyError):
        T.resolve_strategy("auto", tab, 1, kind="both")
    assert set(T.STRATEGIES) == set(STRATEGIES)


# --------------------------------------------------------------------------------------
# values: wrong dtype / shape / device, non-contiguous, aliasing
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_wrong_dtype_values_refused(make, placement):
    cases = [
        (torch.float32, torch.ones(2, 3, dtype=torch.float64), "float64"),
        (torch.float32, np.ones((2, 3)), "float64"),
        (torch.float32, [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], "float64"),
        (torch.float32, torch.ones(2, 3, dtype=torch.complex64), "complex64"),
        (torch.int32, torch.ones(2, 3, dtype=torch.int64), "int64"),
        (torch.int32, [[1, 2, 3], [4, 5, 6]], "int64"),
        (torch.uint8, torch.ones(2, 3, dtype=torch.bool), "bool"),
        (torch.uint8, torch.ones(2, 3, dtype=torch.int8), "int8"),
        (torch.bool, torch.ones(2, 3, dtype=torch.uint8), "uint8"),
        (torch.float16, torch.ones(2, 3, dtype=torch.bfloat16), "bfloat16"),
        (torch.int64, torch.ones(2, 3, dtype=torch.float32), "float32"),
    ]
    for tdt, data, got in cases:
        src = _random_table(tdt, (4, 3))
        g = make(src, placement)
        with pytest.raises(gl.GadgetTypeError) as ei:
            g.insertData(data, [0, 1])
        msg = str(ei.value)
        assert isinstance(ei.value, TypeError)
        assert str(tdt)[6:] in msg and got in msg, msg
        with pytest.raises(gl.GadgetTypeError):
            g[[0, 1]] = data
        assert torch.equal(_snapshot(g), src)


def test_bfloat16_table_refuses_float16_and_float32():
    src = _random_table(torch.bfloat16, (4, 3))
    g = gl.DataGadget(src, placement="cpu")
    for data in (
        torch.ones(1, 3, dtype=torch.float16),
        np.ones((1, 3), np.float32),
        torch.ones(1, 3),
    ):
        with pytest.raises(gl.GadgetTypeError, match="bfloat16"):
            g.insertData(data, [0])
    assert torch.equal(_snapshot(g), src)
    g.insertData(torch.ones(1, 3, dtype=torch.bfloat16), [0])
    assert torch.equal(g.getData(0), torch.ones(3, dtype=torch.bfloat16))
    assert g.getNumpyVersion().dtype == np.float32


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "data",
    [
        torch.ones(2, 3),
        torch.ones(3, 4),
        torch.ones(1, 4),
        torch.ones(8),
        torch.tensor(1.0),
        torch.ones(2, 4, 1),
        torch.ones(4, 2),
        np.ones((2, 1), np.float32),
    ],
    ids=lambda d: "x".join(map(str, tuple(d.shape))) or "0d",
)
def test_wrong_shape_values_refused_no_broadcast(make, placement, data):
    src = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    g = make(src, placement)
    with pytest.raises(gl.GadgetValueError) as ei:
        g.insertData(data, [0, 1])
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "(2, 4)" in msg and str(tuple(data.shape)) in msg, msg
    with pytest.raises(gl.GadgetValueError):
        gl.scatter_many([g], [data], [0, 1])
    assert torch.equal(_snapshot(g), src)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_values_of_wrong_kind_or_device_refused(make, placement):
    src = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    g = make(src, placement)
    for bad in (1.0, 3, None, "abc", torch.ones(2, 4).to_sparse()):
        with pytest.raises(gl.GadgetTypeError):
            g.insertData(bad, [0, 1])
    with pytest.raises(gl.GadgetTypeError) as ei:
        g.insertData(torch.ones(2, 4, device="meta"), [0, 1])
    assert "meta" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError):
        g[[0, 1]] = 5.0
    assert torch.equal(_snapshot(g), src)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_noncontiguous_and_unusual_values_written_exactly(make, placement):
    src = torch.zeros(8, 3, dtype=torch.float32)
    g = make(src, placement)
    ref = src.clone()
    t = torch.arange(6, dtype=torch.float32).reshape(3, 2).t()  # (2, 3), not contiguous
    g.insertData(t, [1, 2])
    ref[[1, 2]] = t
    rev = np.arange(6, dtype=np.float32).reshape(2, 3)[::-1] + 10  # negative strides
    g.insertData(rev, [3, 4])
    ref[[3, 4]] = torch.as_tensor(rev.copy())
    be = np.full((1, 3), 4.5, dtype=">f4")  # big-endian float32
    g.insertData(be, [5])
    ref[5] = 4.5
    ro = np.full((1, 3), 6.0, np.float32)
    ro.flags.writeable = False
    g.insertData(ro, [6])
    ref[6] = 6.0
    col = torch.arange(24, dtype=torch.float32).reshape(3, 8)[:, ::3].t().contiguous().t()
    assert col.shape == (3, 3)
    g.insertData(col, [7, 0, 7])
    ref[0] = col[1]
    ref[7] = col[2]
    assert torch.equal(g.getData(slice(None)), ref)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_values_requiring_grad_are_detached(make, placement):
    g = make(torch.zeros(4, 2), placement)
    v = torch.ones(1, 2, requires_grad=True) * 3
    g.insertData(v, [2])
    r = g.getData([2])
    assert not r.requires_grad
    assert torch.equal(r, torch.full((1, 2), 3.0))


@pytest.mark.parametrize("placement", ["cpu", "cuda", "pinned"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_values_aliasing_the_table_act_as_copies(make, placement, strategy):
    src = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    g = make(src, placement, strategy=strategy)
    g.insertData(g.as_tensor()[0:3], [1, 2, 3])
    ref = src.clone()
    ref[1:4] = src[0:3]
    assert torch.equal(g.getData(slice(None)), ref)
    v = g.as_tensor()
    g.insertData(v[2:5], [4, 3, 2])
    tmp = ref[2:5].clone()
    ref[[4, 3, 2]] = tmp
    assert torch.equal(g.getData(slice(None)), ref)
    g[(slice(0, 4), slice(1, 3))] = g.as_tensor()[1:5, 0:2]
    tmp = ref[1:5, 0:2].clone()
    ref[0:4, 1:3] = tmp
    assert torch.equal(g.getData(slice(None)), ref)


def test_sources_are_copied_in():
    for placement in ("cpu", "cuda", "pinned"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gl.FallbackWarning)
            src = torch.arange(6.0).reshape(3, 2)
            g = gl.DataGadget(src, placement=placement)
            arr = np.arange(6.0).reshape(3, 2)
            g2 = gl.DataGadget(arr, placement=placement)
            s3 = torch.ones(3, 2, requires_grad=True)
            g3 = gl.DataGadget(s3, placement=placement)
        src[0, 0] = 100
        arr[0, 0] = 100
        assert g.getData(0).tolist() == [0.0, 1.0]
        assert g2.getData(0).tolist() == [0.0, 1.0]
        g.insertData(torch.full((1, 2), 7.0), [1])
        assert src[1].tolist() == [2.0, 3.0]
        assert not g3.as_tensor().requires_grad
        assert not g3.getData([0]).requires_grad


# --------------------------------------------------------------------------------------
# out=
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_out_buffer(make, placement):
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    g = make(src, placement)
    out = torch.full((3, 4), -1.0)
    r = g.getData([5, 0, 5], out=out)
    assert r is out and torch.equal(out, src[[5, 0, 5]])
    out2 = torch.empty(2, 2, 4)
    assert g.getData(np.array([[1, 2], [3, 4]]), out=out2) is out2
    assert torch.equal(out2, src[torch.tensor([[1, 2], [3, 4]])])
    o1 = torch.empty(4)
    assert g.getData(3, out=o1) is o1 and torch.equal(o1, src[3])
    o3 = torch.empty(3, 4)
    assert g.getData(slice(2, 5), out=o3) is o3 and torch.equal(o3, src[2:5])
    assert g.getData([], out=torch.empty(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_out_buffer_errors(make, placement):
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    g = make(src, placement)
    bad = [
        (torch.empty(3, 4), gl.GadgetValueError, "(2, 4)"),
        (torch.empty(8), gl.GadgetValueError, "(2, 4)"),
        (torch.empty(2, 4, dtype=torch.float64), gl.GadgetTypeError, "float64"),
        (torch.empty(4, 2).t(), gl.GadgetValueError, "contiguous"),
        (torch.empty(2, 4, device="meta"), gl.GadgetTypeError, "meta"),
        (np.empty((2, 4), np.float32), gl.GadgetTypeError, "tensor"),
        (torch.empty(2, 4, requires_grad=True), gl.GadgetValueError, "grad"),
    ]
    for o, exc, text in bad:
        with pytest.raises(exc) as ei:
            g.getData([0, 1], out=o)
        assert text in str(ei.value), str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        g.getData(([0, 1], 0), out=torch.empty(2))
    o = torch.zeros(2, 4)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([5, 99], out=o)
    assert torch.equal(_snapshot(g), src)


@pytest.mark.parametrize("placement", ["cpu", "cuda", "pinned"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_out_inside_the_table(make, placement, strategy):
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    g = make(src, placement, strategy=strategy)
    with pytest.raises(gl.GadgetIndexError):
        g.getData([5, 99], out=g.as_tensor()[0:2])
    assert torch.equal(_snapshot(g), src)  # "an out that is part of the table ... never changes"
    r = g.getData([1, 0], out=g.as_tensor()[0:2])  # overlaps what it reads: a swap
    assert torch.equal(r, src[[1, 0]])
    ref = src.clone()
    ref[0:2] = src[[1, 0]]
    assert torch.equal(_snapshot(g), ref)


# --------------------------------------------------------------------------------------
# NumPy-style tuple indexes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_tuple_indexes_read_and_write(make, placement):
    a = np.arange(120, dtype=np.float32).reshape(10, 3, 4)
    g = make(torch.as_tensor(a), placement)
    reads = [
        ((slice(0, 6), slice(0, 3)), a[0:6, 0:3]),
        (([1, 2], 0), a[[1, 2], 0]),
        (([1, 2], -1), a[[1, 2], -1]),
        (([1, 2], slice(-100, 100)), a[[1, 2], -100:100]),
        (([1, 2], slice(None, None, 2)), a[[1, 2], ::2]),
        (([1, 2], 0, 1), a[[1, 2], 0, 1]),
        (([1, 2], 2, slice(1, 3)), a[[1, 2], 2, 1:3]),
        ((np.array([1, 2]), 0), a[[1, 2], 0]),
        ((torch.tensor([[1], [2]]), slice(1, 3)), a[np.array([[1], [2]]), 1:3]),
        ((slice(2, 5), 1), a[2:5, 1]),
        ((3, slice(1, 3)), a[3, 1:3]),
        (([1, 2],), a[[1, 2]]),
        ((range(2), 0), a[[0, 1], 0]),
        (([], 0), a[[], 0]),
    ]
    for idx, ref in reads:
        got = _np_of(g.getData(idx))
        assert got.shape == ref.shape and np.array_equal(got, ref), idx
        assert np.array_equal(_np_of(g[idx]), ref), idx
    errs = [
        (([1, 2], [0, 1]), gl.GadgetTypeError),
        (([1, 2], slice(None, None, -1)), gl.GadgetValueError),
        (([1, 2], 0, 1, 0), gl.GadgetIndexError),
        (([1, 2], -4), gl.GadgetIndexError),
        (([1, 2], 3), gl.GadgetIndexError),
        (([1, 2], slice(0, 2.0)), gl.GadgetTypeError),
        (([1, 10], 0), gl.GadgetIndexError),
        (([-1], 0), gl.GadgetIndexError),
        ((Ellipsis, 0), gl.GadgetTypeError),
        ((None,), gl.GadgetTypeError),
    ]
    for idx, exc in errs:
        with pytest.raises(exc):
            g.getData(idx)
        with pytest.raises(exc):
            g[idx] = np.zeros((2, 4), np.float32)
    assert np.array_equal(_np_of(g.getData(slice(None))), a)
    # writes touch only the indexed part; repeated rows: last occurrence
    ref = a.copy()
    g[[4, 4], 1, ::2] = np.array([[1, 2], [3, 4]], np.float32)
    ref[4, 1, ::2] = [3, 4]
    g.insertData(-np.ones((2, 3, 2), np.float32), (slice(6, 8), slice(None), slice(0, 2)))
    ref[6:8, :, 0:2] = -1
    g[[5, 9], -1] = np.array([[9] * 4, [8] * 4], np.float32)
    ref[[5, 9], -1] = [[9] * 4, [8] * 4]
    assert np.array_equal(_np_of(g.getData(slice(None))), ref)
    # part writes with bad data: nothing written
    for data, exc in (
        (np.zeros((2, 3), np.float32), gl.GadgetValueError),
        (np.zeros((2, 4), np.float64), gl.GadgetTypeError),
    ):
        with pytest.raises(exc):
            g[[5, 9], 1] = data
    with pytest.raises(gl.GadgetIndexError):
        g[[5, 10], 1] = np.zeros((2, 4), np.float32)
    assert np.array_equal(_np_of(g.getData(slice(None))), ref)


def test_tuple_of_plain_ints_is_a_list_of_ids():
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    g = gl.DataGadget(src, placement="cpu")
    assert torch.equal(g[3, 1], src[[3, 1]])
    assert torch.equal(g.getData((3, 1)), src[[3, 1]])


# --------------------------------------------------------------------------------------
# aliases: g[ids], g[ids] = rows, gather / scatter
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_item_and_torch_style_aliases(make, placement):
    src = torch.arange(24, dtype=torch.int32).reshape(6, 4)
    g = make(src, placement)
    assert torch.equal(g[[1, 1, 5]], src[[1, 1, 5]])
    assert torch.equal(g.gather([2, 0]), src[[2, 0]])
    rows = torch.arange(12, dtype=torch.int32).reshape(3, 4) * -1
    g[[0, 3, 0]] = rows
    ref = _last_wins(src, [0, 3, 0], rows)
    assert torch.equal(g[slice(None)], ref)
    g.scatter([5, 5], rows[:2])
    ref[5] = rows[1]
    assert torch.equal(g.getData(slice(None)), ref)
    g[2:4] = torch.full((2, 4), 7, dtype=torch.int32)
    ref[2:4] = 7
    assert torch.equal(g.getData(slice(None)), ref)
    with pytest.raises(gl.GadgetValueError):
        g[2:4] = torch.full((3, 4), 7, dtype=torch.int32)
    assert torch.equal(g.getData(slice(None)), ref)


# --------------------------------------------------------------------------------------
# gather_many / scatter_many
# --------------------------------------------------------------------------------------


def _three(make, placements):
    A = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    B = torch.arange(20, dtype=torch.int64).reshape(10, 2)
    C = torch.arange(10, dtype=torch.float16)
    return (A, B, C), [make(s, p) for s, p in zip((A, B, C), placements, strict=False)]


@pytest.mark.parametrize(
    "placements",
    [
        ("cpu", "cpu", "cpu"),
        ("cpu", "file", "pinned"),
        ("file", "file", "file"),
        ("cuda", "pinned", "cpu"),
    ],
    ids="-".join,
)
def test_gather_scatter_many_mixed(make, placements):
    (A, B, C), gs = _three(make, placements)
    ids = np.array([[3, 3], [0, 9]], dtype=np.int32)
    res = gl.gather_many(gs, ids)
    assert len(res) == 3
    for r, s in zip(res, (A, B, C), strict=False):
        assert torch.equal(r, s[torch.as_tensor(ids).long()])
    assert [r.shape for r in gl.gather_many(gs, [])] == [(0, 4), (0, 2), (0,)]
    assert [r.shape for r in gl.gather_many(gs, 3)] == [(4,), (2,), ()]
    assert torch.equal(gl.gather_many(gs, slice(2, 5))[1], B[2:5])
    assert torch.equal(gl.gather_many(tuple(gs), range(1, 4))[2], C[1:4])
    wids = [1, 4, 1]
    rows = [
        -torch.arange(12, dtype=torch.float32).reshape(3, 4),
        -torch.arange(6, dtype=torch.int64).reshape(3, 2),
        torch.tensor([1.5, 2.5, 3.5], dtype=torch.float16),
    ]
    gl.scatter_many(gs, rows, wids)
    for g, s, r in zip(gs, (A, B, C), rows, strict=False):
        assert torch.equal(g.getData(slice(None)), _last_wins(s, wids, r))


@pytest.mark.parametrize(
    "placements", [("cpu", "cpu", "cpu"), ("cpu", "file", "pinned")], ids="-".join
)
def test_scatter_many_errors_change_no_table(make, placements):
    (A, B, C), gs = _three(make, placements)

    def rows(a=None, b=None, c=None):
        return [
            a if a is not None else torch.zeros(2, 4),
            b if b is not None else torch.zeros(2, 2, dtype=torch.int64),
            c if c is not None else torch.zeros(2, dtype=torch.float16),
        ]

    cases = [
        (rows(c=torch.zeros(2)), [1, 2], gl.GadgetTypeError, "table 2"),
        (rows(b=torch.zeros(2, 3, dtype=torch.int64)), [1, 2], gl.GadgetValueError, "table 1"),
        (rows(a=torch.zeros(2, 4, device="meta")), [1, 2], gl.GadgetTypeError, "meta"),
        (rows(), [1, 10], gl.GadgetIndexError, "10"),
        (rows(), [-1, 2], gl.GadgetIndexError, "-1"),
        (rows(), np.array([1.0, 2.0]), gl.GadgetTypeError, "integer"),
        (rows()[:2], [1, 2], gl.GadgetValueError, "3"),
        (None, [1, 2], gl.GadgetTypeError, "rows"),
        (rows(), ([1, 2], 0), gl.GadgetTypeError, "index into the rows"),
    ]
    for rws, ids, exc, text in cases:
        with pytest.raises(exc) as ei:
            gl.scatter_many(gs, rws, ids)
        assert text in str(ei.value), str(ei.value)
        for g, s in zip(gs, (A, B, C), strict=False):
            assert torch.equal(g.getData(slice(None)), s), (ids, text)


def test_gather_scatter_many_argument_errors(make):
    a = make(torch.zeros(10, 4), "cpu")
    b = make(torch.zeros(11, 4), "cpu")
    with pytest.raises(gl.GadgetValueError, match="same number of rows"):
        gl.gather_many([a, b], [1])
    with pytest.raises(gl.GadgetValueError, match="same number of rows"):
        gl.scatter_many([a, b], [torch.ones(1, 4)] * 2, [1])
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([], [1])
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many(a, [1])
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([a, torch.zeros(10, 4)], [1])
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([a], ([1, 2], 0))
    assert torch.count_nonzero(a.getData(slice(None))) == 0
    assert torch.count_nonzero(b.getData(slice(None))) == 0


def test_scatter_many_with_read_only_file_changes_nothing(make, tmp_path):
    p = tmp_path / "ro.npy"
    np.save(p, np.arange(20, dtype=np.int32).reshape(10, 2))
    ro = gl.DataGadget(str(p), placement="file", writable=False)
    a = make(torch.zeros(10, 3), "cpu")
    try:
        with pytest.raises(gl.ReadOnlyError):
            gl.scatter_many([a, ro], [torch.ones(1, 3), torch.ones(1, 2, dtype=torch.int32)], [0])
        with pytest.raises(gl.ReadOnlyError):
            ro.insertData(torch.ones(1, 2, dtype=torch.int32), [0])
        assert torch.count_nonzero(a.getData(slice(None))) == 0
        assert np.array_equal(np.load(p), np.arange(20, dtype=np.int32).reshape(10, 2))
        assert torch.equal(ro.getData([9]), torch.tensor([[18, 19]], dtype=torch.int32))
    finally:
        ro.close()


def test_closed_tables_refuse_rows(make):
    a = make(torch.zeros(10, 4), "cpu")
    z = gl.DataGadget(torch.zeros(10, 4), placement="cpu")
    z.close()
    for f in (
        lambda: z.getData([1]),
        lambda: z.insertData(torch.ones(1, 4), [1]),
        lambda: z[[1]],
        lambda: gl.gather_many([a, z], [1]),
        lambda: gl.scatter_many([a, z], [torch.ones(1, 4)] * 2, [1]),
    ):
        with pytest.raises(gl.GadgetClosedError):
            f()
    assert torch.count_nonzero(a.getData(slice(None))) == 0
    assert z.shape == (10, 4) and len(z) == 10 and z.dtype == torch.float32


def test_gather_scatter_many_over_interleaved_optimizer_tables():
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(20, 4, placement="cpu")
    model = torch.nn.ModuleDict({"e": emb})
    _opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.1)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    _opt.step()
    states = list(_opt.pagers[0].tables.values())
    assert len(states) == 2
    tabs = [emb.weight, *states]
    ids = [3, 1, 1, 19, 0]
    many = gl.gather_many(tabs, ids)
    for r, t in zip(many, tabs, strict=False):
        assert torch.equal(r, t.getData(ids))
        assert torch.equal(r, torch.as_tensor(t.getNumpyVersion())[ids])
    before = [t.getData(slice(None)).clone() for t in tabs]
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many(
            tabs,
            [torch.zeros(5, 4), torch.zeros(5, 4), torch.zeros(5, 4, dtype=torch.float64)],
            ids,
        )
    with pytest.raises(gl.GadgetIndexError):
        gl.scatter_many(tabs, [torch.zeros(5, 4)] * 3, [0, 1, 2, 3, 20])
    for b, t in zip(before, tabs, strict=False):
        assert torch.equal(b, t.getData(slice(None)))
    rows = [torch.randn(5, 4) for _ in tabs]
    gl.scatter_many(tabs, rows, ids)
    for b, t, r in zip(before, tabs, rows, strict=False):
        assert torch.equal(t.getData(slice(None)), _last_wins(b, ids, r))
    # the states in another order, and one table alone
    r2 = gl.gather_many([tabs[2], tabs[0]], ids)
    assert torch.equal(r2[0], tabs[2].getData(ids)) and torch.equal(r2[1], tabs[0].getData(ids))


# --------------------------------------------------------------------------------------
# file tables: every format, block sizes, cache coherence between tables of one file
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_file_formats_block_sizes_and_coherence(tmp_path, fmt):
    if fmt == "h5":
        h5py = pytest.importorskip("h5py")
    if fmt == "zarr":
        zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(3)
    for dt in (np.float16, np.bool_, np.int64):
        A = (rng.standard_normal((23, 5)) * 20).astype(dt)
        p = str(tmp_path / f"a_{np.dtype(dt).name}.{fmt}")
        if fmt == "npy":
            np.save(p, A)
        elif fmt == "h5":
            with h5py.File(p, "w") as f:
                f.create_dataset("data", data=A, chunks=(3, 5))
        else:
            z = zarr.open_array(p, mode="w", shape=A.shape, chunks=(3, 5), dtype=A.dtype)
            z[:] = A
        for kw in ({}, {"cache_bytes": 0}, {"block_rows": 1}, {"block_rows": 7}):
            g = gl.DataGadget(p, placement="file", **kw)
            g2 = gl.DataGadget(p, placement="file", **kw)
            try:
                ids = rng.integers(0, 23, size=(4, 6))
                g2.getData(ids)  # fills g2's cache
                assert np.array_equal(g.getData(ids).numpy(), A[ids])
                wids = rng.integers(0, 23, size=30)
                rows = (rng.standard_normal((30, 5)) * 20).astype(dt)
                g.insertData(rows, wids)
                ref = A.copy()
                ref[wids] = rows
                assert np.array_equal(g.getNumpyVersion(), ref)
                assert np.array_equal(g2.getData(ids).numpy(), ref[ids])  # other table sees it
                with pytest.raises(gl.GadgetIndexError):
                    g.insertData(rows, np.r_[wids[:-1], 23])
                assert np.array_equal(g2.getData(slice(None)).numpy(), ref)
                A = ref
            finally:
                g.close()
                g2.close()


# --------------------------------------------------------------------------------------
# NumPy views / copies of the table
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["cpu", "cuda", "pinned"])
def test_numpy_views_and_copies(make, placement):
    g = make(torch.zeros(4, 2), placement)
    v = g.getNumpyVersion(copy=False)
    v[2, 0] = 3
    assert g.getData(2).tolist() == [3.0, 0.0]
    c = g.getNumpyVersion()
    c[3, 0] = 9
    assert g.getData(3).tolist() == [0.0, 0.0]
    c2 = np.asarray(g)
    c2[1, 1] = 5
    assert g.getData(1).tolist() == [0.0, 0.0]
    with pytest.raises(gl.GadgetTypeError, match="copy"):
        g.getNumpyVersion(copy="False")


def test_file_and_bfloat16_tables_have_no_numpy_view(make):
    gf = make(torch.ones(4, 2), "file")
    c = gf.getNumpyVersion(copy=False)
    c[0, 0] = 42
    assert gf.getData(0).tolist() == [1.0, 1.0]
    gb = gl.DataGadget(torch.ones(3, 2, dtype=torch.bfloat16), placement="cpu")
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        for g in (gf, gb):
            with pytest.raises(gl.GadgetValueError):
                np.asarray(g, copy=False)
    with pytest.raises(gl.GadgetTypeError):
        gf.as_tensor()


# --------------------------------------------------------------------------------------
# more option / id validation, aliasing of out with ids, global torch modes
# --------------------------------------------------------------------------------------


def test_file_option_values_validated(tmp_path):
    p = str(tmp_path / "a.npy")
    A = np.arange(200, dtype=np.float32).reshape(50, 4)
    np.save(p, A)
    ids = np.random.default_rng(0).integers(0, 50, 500)
    for kw in ({"cache_bytes": 1}, {"block_rows": 1000}, {"writable": np.bool_(False)}):
        g = gl.DataGadget(p, placement="file", **kw)
        try:
            assert np.array_equal(g.getData(ids).numpy(), A[ids]), kw
        finally:
            g.close()
    for kw, exc in (
        ({"block_rows": 0}, gl.GadgetValueError),
        ({"block_rows": -1}, gl.GadgetValueError),
        ({"cache_bytes": -1}, gl.GadgetValueError),
        ({"block_rows": 2.5}, gl.GadgetTypeError),
        ({"cache_bytes": "1"}, gl.GadgetTypeError),
        ({"block_rows": True}, gl.GadgetTypeError),
        ({"writable": 1}, gl.GadgetTypeError),
        ({"writable": "yes"}, gl.GadgetTypeError),
        ({"foo": 1}, gl.GadgetTypeError),
    ):
        with pytest.raises(exc) as ei:
            gl.DataGadget(p, placement="file", **kw)
        assert next(iter(kw)) in str(ei.value)


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_bools_hidden_in_id_lists_are_refused(make, placement):
    src = torch.arange(60, dtype=torch.float32).reshape(15, 4)
    g = make(src, placement)
    b = make(torch.zeros(15, dtype=torch.int64), placement)
    for ids in (
        [1, True],
        [True, 1],
        [0, 1, 2, False],
        [1, np.bool_(True)],
        (1, True),
        ([1, True], 0),
    ):
        with pytest.raises(gl.GadgetTypeError, match="bool"):
            g.getData(ids)
        with pytest.raises(gl.GadgetTypeError):
            g.insertData(torch.zeros(2, 4), ids)
    with pytest.raises(gl.GadgetTypeError):
        gl.gather_many([g, b], [1, True])
    with pytest.raises(gl.GadgetTypeError):
        gl.scatter_many([g, b], [torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64)], [1, True])
    for ids in ([2**63, -(2**63)], [2**64, 1 - 2**64], [1, 2**70, -(2**70)]):
        with pytest.raises(gl.GadgetIndexError):
            g.getData(ids)
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(torch.zeros(len(ids), 4), ids)
    assert torch.equal(_snapshot(g), src)


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_out_may_be_the_ids_tensor(make, placement, strategy):
    """An id-remapping table: ``ids = remap.getData(ids, out=ids)``."""
    perm = torch.tensor([3, 0, 4, 1, 2, 9, 8, 7, 6, 5])
    g = make(perm, placement, strategy=strategy)
    ids = torch.tensor([[1, 0, 2], [2, 9, 5]])
    exp = perm[ids]
    r = g.getData(ids, out=ids)
    assert r is ids and torch.equal(ids, exp)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deterministic_algorithms_mode(strategy):
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        g = gl.DataGadget(np.zeros((10, 3), np.float32), placement="cpu", strategy=strategy)
        g.insertData(torch.arange(9.0).reshape(3, 3), [1, 1, 2])
        assert g.getData([1, 2]).tolist() == [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]
        ids = np.arange(70_000) % 10
        assert torch.equal(g.getData(ids), g.getData(slice(None))[torch.as_tensor(ids)])
    finally:
        torch.use_deterministic_algorithms(prev)


def test_default_dtype_does_not_change_table_dtype():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        g = gl.DataGadget((4, 2), placement="cpu")
        assert g.dtype == torch.float32
        assert gl.DataGadget.zeros((4, 2), placement="cpu").dtype == torch.float32
        g.insertData(torch.ones(1, 2, dtype=torch.float32), [0])
        assert g.getData([0]).dtype == torch.float32
    finally:
        torch.set_default_dtype(prev)


@pytest.mark.parametrize("placement", ["cpu", "cuda", "pinned", "file"])
def test_table_built_under_inference_mode_is_writable_afterwards(make, placement):
    """README: data is copied in; a table is the library's own storage.  A table built
    (e.g. in an evaluation script) under ``torch.inference_mode()`` must still take rows
    outside it, or at least refuse with a ``GadgetError`` -- not leak torch's
    "Inplace update to inference tensor" RuntimeError."""
    with torch.inference_mode():
        g = make(torch.zeros(5, 3), placement)
    rows = torch.ones(2, 3)
    g.insertData(rows, [1, 3])
    g[[4]] = torch.full((1, 3), 2.0)
    gl.scatter_many([g], [torch.full((1, 3), 5.0)], [0])
    ref = torch.zeros(5, 3)
    ref[[1, 3]] = 1.0
    ref[4] = 2.0
    ref[0] = 5.0
    assert torch.equal(g.getData(slice(None)), ref)


def test_table_loaded_under_inference_mode_is_writable_afterwards(tmp_path):
    p = str(tmp_path / "a.npy")
    np.save(p, np.zeros((5, 3), np.float32))
    g = gl.DataGadget((5, 3), placement="cpu")
    with torch.inference_mode():
        g.load(p)
    g.insertData(torch.ones(1, 3), [2])
    assert g.getData(2).tolist() == [1.0, 1.0, 1.0]


def test_inference_tensor_out_is_a_gadget_error():
    """README, Errors: every error the library raises derives from ``gl.GadgetError``;
    ``out`` that cannot be written (``requires_grad``) is already a ``GadgetValueError``."""
    g = gl.DataGadget(torch.arange(12.0).reshape(4, 3), placement="cpu")
    with torch.inference_mode():
        o = torch.empty(2, 3)
    with pytest.raises(gl.GadgetError):
        g.getData([0, 1], out=o)


def test_damaged_chunk_write_changes_nothing(tmp_path):
    zarr = pytest.importorskip("zarr")
    p = str(tmp_path / "a.zarr")
    A = np.arange(80, dtype=np.float32).reshape(20, 4)
    z = zarr.open_array(p, mode="w", shape=A.shape, chunks=(5, 4), dtype="float32")
    z[:] = A
    chunk = os.path.join(p, "c", "2", "0")
    if not os.path.exists(chunk):
        pytest.skip("unexpected zarr chunk layout")
    with open(chunk, "wb") as f:
        f.write(b"garbage" * 3)
    g = gl.DataGadget(p, placement="file")
    c = gl.DataGadget(np.zeros((20, 2), np.float32), placement="cpu")
    try:
        with pytest.raises(gl.GadgetFileError):
            g.getData([11])
        assert np.array_equal(g.getData([1, 16]).numpy(), A[[1, 16]])
        for ids in ([1, 11], [11, 16]):
            with pytest.raises(gl.GadgetFileError):
                g.insertData(np.full((2, 4), -1, np.float32), ids)
        with pytest.raises(gl.GadgetFileError, match="table 1"):
            gl.scatter_many(
                [c, g], [np.ones((2, 2), np.float32), np.full((2, 4), -1, np.float32)], [0, 12]
            )
        assert np.count_nonzero(c.getNumpyVersion()) == 0
        g2 = gl.DataGadget(p, placement="file", cache_bytes=0)
        try:
            assert np.array_equal(g2.getData([1, 16]).numpy(), A[[1, 16]])
        finally:
            g2.close()
    finally:
        g.close()
