"""The store behaviour suite: the same assertions over every placement.

``cpu`` runs everywhere; ``cuda`` and ``pinned`` run on the GPU machine (``gpu`` marker).
Every check compares against NumPy / a plain torch CPU tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader._dtypes import SUPPORTED_DTYPES, dtype_name

ROWS, WIDTH = 257, 12


def _table(
    dtype: torch.dtype = torch.float32,
    rows: int = ROWS,
    row_shape: tuple[int, ...] = (WIDTH,),
    seed: int = 0,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, *row_shape), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(rows, *row_shape, generator=g).to(dtype)
    return torch.randint(
        -100 if dtype != torch.uint8 else 0, 100, (rows, *row_shape), generator=g
    ).to(dtype)


def _gadget(src: torch.Tensor, placement: str, device: torch.device) -> gl.DataGadget:
    return gl.DataGadget(src, placement=placement, device=device)


def test_getdata_matches_numpy_for_every_id_form(placement: str, device: torch.device) -> None:
    src = _table()
    g = _gadget(src, placement, device)
    ids_np = np.array([5, 0, 255, 5, 17, 17, 3])
    expected = src.numpy()[ids_np]
    forms = [
        ids_np,
        ids_np.astype(np.int32),
        ids_np.astype(np.uint8),
        ids_np.tolist(),
        torch.from_numpy(ids_np),
        torch.from_numpy(ids_np).to(device),
    ]
    for ids in forms:
        out = g.getData(ids)
        assert out.device.type == device.type
        assert out.dtype == torch.float32
        np.testing.assert_array_equal(out.cpu().numpy(), expected)


def test_getdata_keeps_id_shape_and_scalar(placement: str, device: torch.device) -> None:
    src = _table(row_shape=(3, 4))
    g = _gadget(src, placement, device)
    ids = torch.tensor([[1, 2, 3], [4, 4, 0]])
    out = g.getData(ids)
    assert out.shape == (2, 3, 3, 4)
    np.testing.assert_array_equal(out.cpu().numpy(), src.numpy()[ids.numpy()])
    np.testing.assert_array_equal(g.getData(7).cpu().numpy(), src.numpy()[7])
    assert g.getData([]).shape == (0, 3, 4)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_roundtrip_every_dtype(placement: str, device: torch.device, dtype: torch.dtype) -> None:
    src = _table(dtype)
    g = _gadget(src, placement, device)
    assert g.dtype == dtype and g.shape == tuple(src.shape) and len(g) == ROWS
    assert g.nbytes == src.numel() * src.element_size()
    ids = torch.tensor([0, 10, 10, 256])
    assert torch.equal(g.getData(ids).cpu(), src[ids])
    new = _table(dtype, rows=4, seed=1)
    g.insertData(new.to(device), ids)
    expected = src.clone()
    expected[0], expected[10], expected[256] = new[0], new[2], new[3]  # last occurrence of 10 wins
    assert torch.equal(g.getData(torch.arange(ROWS)).cpu(), expected)


def test_insert_last_occurrence_wins_on_many_repeats(placement: str, device: torch.device) -> None:
    src = _table()
    g = _gadget(src, placement, device)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 20, size=500)
    data = torch.randn(500, WIDTH)
    g.insertData(data.to(device), torch.from_numpy(ids).to(device))
    expected = src.numpy().copy()
    for i, r in enumerate(ids):  # sequential semantics: the last write stays
        expected[r] = data[i].numpy()
    np.testing.assert_array_equal(g.getNumpyVersion(), expected)


def test_insert_from_cpu_data_and_numpy(placement: str, device: torch.device) -> None:
    g = _gadget(_table(), placement, device)
    g.insertData(np.full((2, WIDTH), 7, dtype=np.float32), [1, 2])
    g.insertData(torch.full((1, WIDTH), 9.0), torch.tensor([3]))
    out = g.getData([1, 2, 3]).cpu()
    assert out[:2].eq(7).all() and out[2].eq(9).all()


@pytest.mark.parametrize(
    "bad, exc",
    [
        ([0, ROWS], gl.GadgetIndexError),
        ([-1, 2], gl.GadgetIndexError),
        ([0.5, 2.0], gl.GadgetTypeError),
        (np.array([1.0]), gl.GadgetTypeError),
        (torch.tensor([True, False]), gl.GadgetTypeError),
        ("3", gl.GadgetTypeError),
    ],
)
def test_bad_ids_raise_before_anything_changes(
    placement: str, device: torch.device, bad: object, exc: type[Exception]
) -> None:
    src = _table()
    g = _gadget(src, placement, device)
    with pytest.raises(exc):
        g.getData(bad)
    n = len(bad) if hasattr(bad, "__len__") else 1
    with pytest.raises(exc):
        g.insertData(torch.zeros(n, WIDTH, device=device), bad)
    assert torch.equal(g.getData(torch.arange(ROWS)).cpu(), src)


def test_out_of_range_message_says_expected_and_got(placement: str, device: torch.device) -> None:
    g = _gadget(_table(), placement, device)
    with pytest.raises(IndexError, match=r"id 257 is out of range.*257 rows.*\[0, 256\]"):
        g.getData(torch.tensor([3, 257], device=device))
    with pytest.raises(IndexError, match="negative"):
        g.getData([-4])


def test_bad_data_raises_and_leaves_table_unchanged(placement: str, device: torch.device) -> None:
    src = _table()
    g = _gadget(src, placement, device)
    with pytest.raises(gl.GadgetTypeError, match="float32.*float64"):
        g.insertData(torch.zeros(2, WIDTH, dtype=torch.float64), [0, 1])
    with pytest.raises(gl.GadgetValueError, match=r"expected data of shape \(2, 12\).*\(2, 11\)"):
        g.insertData(torch.zeros(2, WIDTH - 1), [0, 1])
    with pytest.raises(gl.GadgetValueError):
        g.insertData(torch.zeros(3, WIDTH), [0, 1])
    with pytest.raises(gl.GadgetTypeError):
        g.insertData(np.array([["a"] * WIDTH] * 2), [0, 1])
    with pytest.raises(gl.GadgetTypeError):
        g.insertData("not data", [0])
    assert torch.equal(g.getData(torch.arange(ROWS)).cpu(), src)
    assert isinstance(gl.GadgetTypeError("x"), TypeError) and isinstance(
        gl.GadgetIndexError("x"), IndexError
    )


def test_shape_construction_and_initialisers(placement: str, device: torch.device) -> None:
    g = gl.DataGadget((1000, 8), dtype="float32", placement=placement, device=device)
    assert g.getNumpyVersion().sum() == 0
    torch.manual_seed(0)
    g.uniform_(-0.5, 0.5)
    a = g.getNumpyVersion()
    assert a.min() >= -0.5 and a.max() <= 0.5 and a.std() > 0.2
    g.normal_(3.0, 0.01)
    assert abs(g.getNumpyVersion().mean() - 3.0) < 0.01
    g.init_(torch.nn.init.xavier_uniform_)
    bound = (6 / (1000 + 8)) ** 0.5
    a = g.getNumpyVersion()
    assert np.abs(a).max() <= bound and a.std() > bound / 4
    g.zero_()
    assert not g.getNumpyVersion().any()
    g.fill_(2.5)
    assert (g.getNumpyVersion() == 2.5).all()


def test_zero_copy_numpy_view_on_host_placements(placement: str, device: torch.device) -> None:
    g = _gadget(_table(), placement, device)
    if placement == "cuda":
        pytest.skip("a cuda table has no host view")
    view = g.getNumpyVersion(copy=False)
    view[4] = 42.0
    assert g.getData([4]).cpu().eq(42.0).all()


def test_save_and_load_npy_roundtrip(
    placement: str, device: torch.device, tmp_path: object
) -> None:
    src = _table()
    g = _gadget(src, placement, device)
    path = tmp_path / "t.npy"  # type: ignore[operator]
    g.saveCupy(str(path))
    np.testing.assert_array_equal(np.load(path), src.numpy())
    h = gl.DataGadget(str(path), placement=placement, device=device)
    np.testing.assert_array_equal(h.getNumpyVersion(), src.numpy())
    h.insertData(torch.zeros(1, WIDTH, device=device), [0])
    h.loadCupy(str(path))  # replaces the contents again
    np.testing.assert_array_equal(h.getNumpyVersion(), src.numpy())
    assert h.placement == g.placement


def test_close_releases_and_later_use_fails(placement: str, device: torch.device) -> None:
    g = _gadget(_table(), placement, device)
    with g:
        assert g.getData([1]).shape == (1, WIDTH)
    with pytest.raises(gl.GadgetClosedError):
        g.getData([1])
    g.close()  # idempotent


def test_as_tensor_is_zero_copy(placement: str, device: torch.device) -> None:
    g = _gadget(_table(), placement, device)
    t = g.as_tensor()
    t[3].fill_(5.0)
    assert g.getData([3]).cpu().eq(5.0).all()


def test_scalar_id_on_a_one_dimensional_table(placement: str, device: torch.device) -> None:
    g = gl.DataGadget(np.arange(5, dtype=np.int64) * 10, placement=placement, device=device)
    assert g.getData(3).shape == () and int(g.getData(3)) == 30
    assert g.getData([4, 0]).cpu().tolist() == [40, 0]
    g.insertData(torch.tensor([7, 9]), [1, 1])
    assert int(g.getData(1)) == 9


def test_speedtorch_construction_sequence(tmp_path: object) -> None:
    """SpeedTorch code: DataGadget(file, CPUPinn=...) then gadgetInit() then getData."""
    path = str(tmp_path / "t.npy")  # type: ignore[operator]
    np.save(path, np.arange(30, dtype=np.float32).reshape(10, 3))
    g = gl.DataGadget(path, placement="cpu")
    assert g.gadgetInit() is g
    np.testing.assert_array_equal(g.getData(np.array([2])).cpu().numpy(), [[6.0, 7.0, 8.0]])
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        g.gadgetInit()


def test_lists_are_data_and_tuples_are_shapes() -> None:
    g = gl.DataGadget([[1.5, 2.0], [3.0, 4.0]], placement="cpu", device="cpu")
    assert g.shape == (2, 2) and g.dtype == torch.float64
    assert g.getData([1]).tolist() == [[3.0, 4.0]]
    h = gl.DataGadget((2, 2), placement="cpu", device="cpu")
    assert h.shape == (2, 2) and h.dtype == torch.float32 and not h.getNumpyVersion().any()
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget([["a", "b"]], placement="cpu")


def test_odd_inputs_are_handled(placement: str, device: torch.device, tmp_path: object) -> None:
    src = torch.nn.Embedding(6, 3).weight  # requires grad
    g = gl.DataGadget(src, placement=placement, device=device)
    assert g.getData([0]).grad_fn is None and g.getNumpyVersion().shape == (6, 3)
    g.insertData(torch.ones(1, 3, requires_grad=True, device=device) * 2, [1])
    g.saveCupy(str(tmp_path / "g.npy"))  # type: ignore[operator]
    assert (np.load(tmp_path / "g.npy")[1] == 2).all()  # type: ignore[operator]
    assert g.getData(np.array(4)).shape == (3,)  # 0-d ids give one row without an axis
    assert g.getData(np.array([4, 5], dtype=">i4")).shape == (2, 3)  # big-endian ids
    ro = np.array([2, 3])
    ro.setflags(write=False)
    assert g.getData(ro).shape == (2, 3)  # read-only ids (np.load mmap)
    g.insertData(np.full((1, 3), 7, dtype=">f4"), [0])  # big-endian data
    assert g.getData([0]).cpu().eq(7).all()
    with pytest.raises(gl.GadgetTypeError, match="ragged"):
        g.getData([[1], [2, 3]])
    with pytest.raises(gl.GadgetTypeError, match="dense"):
        g.insertData(torch.ones(1, 3).to_sparse(), [0])
    with pytest.raises(gl.GadgetTypeError, match="meta"):
        gl.DataGadget(torch.empty(2, 2, device="meta"), placement="cpu")
