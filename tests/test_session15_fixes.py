"""Session 15: the data loader's prepared row gather (``_kernels.gather_rows``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader.transfer import _kernels


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[gl.DataGadget, torch.Tensor]:
    src = (torch.arange(int(np.prod(shape))) % 251).reshape(shape).to(dtype)
    g = gl.DataGadget(src, placement="pinned", device="cuda")
    return g, src


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((3000, 128), torch.float32),  # 16-byte vectors
        ((3000, 3), torch.float16),  # 6-byte rows: 2-byte vectors
        ((3000, 5), torch.uint8),  # 1-byte vectors
        ((3000, 2, 4), torch.float64),  # a 2-D row shape
        ((3000,), torch.int64),  # a 1-D column
    ],
)
@pytest.mark.parametrize("n", [0, 1, 7, 4096])
def test_gather_rows_matches_launch_gather_and_numpy(
    shape: tuple[int, ...], dtype: torch.dtype, n: int
) -> None:
    g, src = _pinned(shape, dtype)
    view = g.store.device_view()
    ids = torch.randint(0, shape[0], (n,), device="cuda")
    a = view.new_empty(n, *shape[1:])
    b = view.new_empty(n, *shape[1:])
    a.fill_(7)
    b.fill_(7)
    _kernels.gather_rows(view, ids, a)
    _kernels.launch_gather(view, ids, b)
    assert torch.equal(a, b)
    assert torch.equal(a.cpu(), src[ids.cpu()])
    # twice more: the prepared launch is reused, and a misaligned output (a view one
    # element in) or strided ids fall back to the general launch with the same rows
    _kernels.gather_rows(view, ids, a)
    assert torch.equal(a.cpu(), src[ids.cpu()])
    if n > 1:
        big = view.new_empty(n + 1, *shape[1:])
        _kernels.gather_rows(view, ids, big[1:])
        assert torch.equal(big[1:].cpu(), src[ids.cpu()])
        ids2 = torch.randint(0, shape[0], (2 * n,), device="cuda")
        out = view.new_empty(n, *shape[1:])
        _kernels.gather_rows(view, ids2[::2], out)
        assert torch.equal(out.cpu(), src[ids2[::2].cpu()])
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_gather_rows_keeps_no_table_alive_and_survives_a_new_table_at_the_same_address() -> None:
    import gc
    import weakref

    g, _ = _pinned((2048, 32), torch.float32)
    view = g.store.device_view()
    ids = torch.arange(0, 2048, 3, device="cuda")
    out = view.new_empty(ids.numel(), 32)
    _kernels.gather_rows(view, ids, out)
    ref = weakref.ref(view)
    del view
    g.close()
    gc.collect()
    assert ref() is None  # the prepared launch holds numbers, not the table
    # a new table (maybe at the same address, same geometry) reads its own rows
    src = torch.randn(2048, 32)
    h = gl.DataGadget(src, placement="pinned", device="cuda")
    _kernels.gather_rows(h.store.device_view(), ids, out)
    assert torch.equal(out.cpu(), src[ids.cpu()])
    h.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_loader_batches_through_the_prepared_gather_equal_numpy() -> None:
    src = np.random.default_rng(3).standard_normal((10_000, 24)).astype(np.float32)
    labels = np.arange(10_000, dtype=np.int64)
    ds = gl.GadgetDataset(
        gl.DataGadget(src, placement="pinned", device="cuda"),
        gl.DataGadget(labels, placement="pinned", device="cuda"),
    )
    assert ds._routes() == ("kernel", "kernel")
    sampler = gl.GadgetSampler(ds, batch_size=512, seed=5)
    seen = []
    for x, y in DataLoader(ds, batch_sampler=sampler):
        assert x.is_cuda and y.is_cuda
        np.testing.assert_array_equal(x.cpu().numpy(), src[y.cpu().numpy()])
        seen.append(y.cpu().numpy())
    assert np.array_equal(np.sort(np.concatenate(seen)), labels)
    ds.close()


# ---- DataGadget's tensor-like facts and torch.nn.init ------------------------------------
@pytest.mark.parametrize("placement", ["cpu"])
def test_gadget_dim_size_numel_and_nn_init_fans(placement: str) -> None:
    g = gl.DataGadget((40, 6), dtype="float32", placement=placement, device="cpu")
    assert (g.dim(), g.ndim, g.numel()) == (2, 2, 240)
    assert g.size() == torch.Size([40, 6]) and g.size(0) == 40 and g.size(-1) == 6
    with pytest.raises(gl.GadgetIndexError, match="out of range"):
        g.size(2)
    with pytest.raises(gl.GadgetTypeError, match="int dimension"):
        g.size(1.0)  # type: ignore[arg-type]
    # xavier_uniform_ on the gadget equals xavier_uniform_ on the table's tensor
    torch.manual_seed(4)
    torch.nn.init.xavier_uniform_(g)  # type: ignore[arg-type]
    torch.manual_seed(4)
    ref = torch.nn.init.xavier_uniform_(torch.empty(40, 6))
    assert torch.equal(g.getData(range(40)).cpu(), ref)
    torch.nn.init.kaiming_normal_(g)  # type: ignore[arg-type]
    assert not torch.equal(g.getData(range(40)).cpu(), ref)


def test_a_tensor_attribute_of_a_gadget_is_a_clear_error_and_hasattr_is_false() -> None:
    g = gl.DataGadget(torch.ones(5, 2), placement="cpu", device="cpu")
    assert not hasattr(g, "is_meta") and not hasattr(g, "no_such_thing")
    with pytest.raises(gl.GadgetTypeError, match="init_") as info:
        g.erfinv_()  # type: ignore[attr-defined]
    assert isinstance(info.value, AttributeError)
    with pytest.raises(AttributeError) as plain:
        g.no_such_thing  # type: ignore[attr-defined]  # noqa: B018
    assert not isinstance(plain.value, gl.GadgetError)
    assert torch.equal(g.getData(range(5)).cpu(), torch.ones(5, 2))
    import copy
    import pickle

    h = pickle.loads(pickle.dumps(g))  # __getattr__ does not disturb unpickling
    assert torch.equal(h.getData(range(5)).cpu(), torch.ones(5, 2))
    assert torch.equal(copy.deepcopy(g).getData(range(5)).cpu(), torch.ones(5, 2))
