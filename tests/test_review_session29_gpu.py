"""Black-box review (session 29) of the input pipeline on a CUDA machine (GadgetDataset,
GadgetSampler, GadgetLoader, GadgetBatch: GPU batches, prefetch, streams, resume, workers,
bad ids); written from README.md, SPEC.md and the public docstrings only.

Every test here carries the ``gpu`` marker (module level): the project's conftest skips
them where no CUDA device is present. The module imports and collects without CUDA.
Rows are made self-describing: feature row ``i`` is ``10 * i + [0, 1, 2]`` and label row
``i`` is ``1000 + 7 * i``, so any batch can be checked against NumPy whatever its order.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, random_split

import gadgetloader as gl

pytestmark = pytest.mark.gpu

HAS_CUDA = torch.cuda.is_available()


def _has_cupy() -> bool:
    if not HAS_CUDA:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy  # noqa: F401

            return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_CUPY = _has_cupy()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_cupy = pytest.mark.skipif(not HAS_CUPY, reason="needs a CUDA device and CuPy (pinned)")
needs_two_gpus = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
# DataLoader workers are forked explicitly (a pinned/cuda table cannot be pickled); Python
# >= 3.12 warns about fork() in a multi-threaded process (CUDA starts threads): not ours.
WORKERS = pytest.mark.filterwarnings("ignore:.*multi-threaded.*:DeprecationWarning")

#: documented default placement of array/tensor/path columns on this machine
DEFAULT_PLACEMENT = "pinned" if HAS_CUPY else "cpu"
N, D, B = 37, 3, 8
Y0, YS = 1000, 7
SLEEP_CYCLES = 10_000_000  # ~5 ms of GPU time per batch in the stream tests


def dev() -> torch.device:
    """Where batches are documented to land: the current CUDA device (CPU without CUDA)."""
    if HAS_CUDA:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_x(n: int = N, d: int = D) -> np.ndarray:
    return (np.arange(n, dtype=np.float32)[:, None] * 10 + np.arange(d, dtype=np.float32)).astype(
        np.float32
    )


def make_y(n: int = N) -> np.ndarray:
    return (Y0 + YS * np.arange(n)).astype(np.int64)


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def check(batch, x, ids=None, device=None) -> np.ndarray:
    """A (features, labels) batch against NumPy; returns the rows it holds."""
    device = dev() if device is None else device
    xb, yb = batch[0], batch[1]
    assert isinstance(xb, torch.Tensor) and isinstance(yb, torch.Tensor)
    assert xb.device == device, (xb.device, device)
    assert yb.device == device, (yb.device, device)
    assert xb.dtype == torch.float32 and yb.dtype == torch.int64
    assert yb.dim() == 1, yb.shape
    assert tuple(xb.shape) == (yb.shape[0], x.shape[1])
    yn = yb.cpu().numpy()
    assert ((yn - Y0) % YS == 0).all(), yn
    rows = (yn - Y0) // YS
    assert ((rows >= 0) & (rows < len(x))).all(), rows
    if ids is not None:
        np.testing.assert_array_equal(rows, np.asarray(ids))
    np.testing.assert_array_equal(xb.cpu().numpy(), x[rows])
    return rows


def ref_ids(n, bs, *, seed=0, order="random", epochs=1, set_epoch=None, **kw):
    """The batches a GadgetSampler yields (its order depends only on seed and epoch)."""
    s = gl.GadgetSampler(n, batch_size=bs, seed=seed, order=order, **kw)
    if set_epoch is not None:
        s.set_epoch(set_epoch)
    out = []
    for _ in range(epochs):
        out.extend(b.clone().numpy() for b in s)
    return out


def seq_ids(n, bs):
    return [np.arange(i, min(i + bs, n)) for i in range(0, n, bs)]


KINDS = [
    pytest.param("cuda_tensor", marks=needs_cuda),
    "numpy",
    "cpu_tensor",
    "numpy_cpu",
    "npy_path",
    "npy_file",
    pytest.param("gadget_pinned", marks=needs_cupy),
    pytest.param("gadget_cuda", marks=needs_cuda),
]


def build(kind, tmp_path, x, y, **kw):
    """A (features, labels) GadgetDataset of one column kind, and the placements it should get."""
    if kind == "cuda_tensor":
        cols, exp = (torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()), ("cuda", "cuda")
    elif kind == "numpy":
        cols, exp = (x, y), (DEFAULT_PLACEMENT,) * 2
    elif kind == "cpu_tensor":
        cols, exp = (torch.from_numpy(x), torch.from_numpy(y)), (DEFAULT_PLACEMENT,) * 2
    elif kind == "numpy_cpu":
        cols, exp = (x, y), ("cpu", "cpu")
        kw = dict(kw, placement="cpu")
    elif kind in ("npy_path", "npy_file"):
        px, py = tmp_path / "x.npy", tmp_path / "y.npy"
        np.save(px, x)
        np.save(py, y)
        if kind == "npy_path":
            cols, exp = (str(px), py), (DEFAULT_PLACEMENT,) * 2
        else:  # a file of features beside an in-memory label array
            cols, exp = (str(px), y), ("file", DEFAULT_PLACEMENT)
            kw = dict(kw, placement="file")
    elif kind == "gadget_pinned":
        cols = (gl.DataGadget(x, placement="pinned"), gl.DataGadget(y, placement="pinned"))
        exp = ("pinned", "pinned")
    elif kind == "gadget_cuda":
        cols, exp = (gl.DataGadget(x, placement="cuda"), y), ("cuda", DEFAULT_PLACEMENT)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return gl.GadgetDataset(*cols, **kw), exp


@pytest.fixture
def mk(tmp_path):
    made = []

    def _mk(kind="numpy", n=N, **kw):
        x, y = make_x(n), make_y(n)
        ds, exp = build(kind, tmp_path, x, y, **kw)
        made.append(ds)
        return ds, x, exp

    yield _mk
    for ds in made:
        ds.close()


# ---------------------------------------------------------------- default form


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "cpu_tensor"])
def test_default_form_gpu_batches_sequential(kind, mk):
    ds, x, exp = mk(kind)
    assert [c.placement for c in ds.columns] == list(exp)
    assert torch.device(ds.device).type == dev().type
    batches = list(DataLoader(ds, batch_size=B))
    sync()
    assert [len(b[1]) for b in batches] == [8, 8, 8, 8, 5]
    for b, ids in zip(
        batches, seq_ids(N, B), strict=True
    ):  # checked after all were made: none overwritten
        assert isinstance(b, gl.GadgetBatch) and len(b) == 2
        check(b, x, ids)


@pytest.mark.parametrize(
    "kind,drop_last",
    [pytest.param("cuda_tensor", False, marks=needs_cuda), ("npy_file", True)],
)
def test_default_form_shuffled_covers_rows(kind, drop_last, mk):
    ds, x, _ = mk(kind)
    torch.manual_seed(0)
    seen = [check(b, x) for b in DataLoader(ds, batch_size=B, shuffle=True, drop_last=drop_last)]
    sizes = [len(r) for r in seen]
    allrows = np.concatenate(seen)
    if drop_last:
        assert sizes == [8, 8, 8, 8]
        assert len(set(allrows.tolist())) == 32
    else:
        assert sizes == [8, 8, 8, 8, 5]
        np.testing.assert_array_equal(np.sort(allrows), np.arange(N))


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("cuda_tensor", marks=needs_cuda),
        pytest.param("gadget_pinned", marks=needs_cupy),
    ],
)
def test_device_cpu_delivers_cpu_batches(kind, mk):
    ds, x, _ = mk(kind, device="cpu")
    assert torch.device(ds.device) == torch.device("cpu")
    for b, ids in zip(DataLoader(ds, batch_size=B), seq_ids(N, B), strict=True):
        check(b, x, ids, device=torch.device("cpu"))
    s = gl.GadgetSampler(ds, batch_size=B, seed=4)
    for b, ids in zip(DataLoader(ds, batch_sampler=s), ref_ids(N, B, seed=4), strict=True):
        check(b, x, ids, device=torch.device("cpu"))


@needs_two_gpus
def test_device_cuda1_delivers_there(mk):
    ds, x, _ = mk("numpy", device="cuda:1")
    for b, ids in zip(DataLoader(ds, batch_size=B), seq_ids(N, B), strict=True):
        check(b, x, ids, device=torch.device("cuda", 1))
    for b, ids in zip(
        gl.GadgetLoader(ds, batch_size=B, seed=2), ref_ids(N, B, seed=2), strict=True
    ):
        check(b, x, ids, device=torch.device("cuda", 1))


def _mixed_columns(n):
    rng = np.random.default_rng(5)
    cols = [
        rng.standard_normal((n, 4)).astype(np.float16),
        rng.standard_normal(n),  # 1-D float64
        rng.integers(-100, 100, n).astype(np.int32),
        rng.integers(-100, 100, (n, 2, 2)).astype(np.int8),
        rng.integers(0, 255, (n, 3)).astype(np.uint8),
        rng.random(n) > 0.5,  # 1-D bool
        torch.randn(n, 2, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        np.arange(n, dtype=np.int64),  # row ids, to check any order
    ]
    refs = [torch.as_tensor(c) if isinstance(c, np.ndarray) else c for c in cols]
    return cols, refs


@pytest.mark.parametrize("form", ["default", "batch_sampler", "loader"])
def test_columns_of_many_dtypes_and_shapes(form, mk):
    n = 29
    cols, refs = _mixed_columns(n)
    ds = gl.GadgetDataset(*cols)
    if form == "default":
        it = DataLoader(ds, batch_size=6, shuffle=True)
    elif form == "batch_sampler":
        it = DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=6, seed=1))
    else:
        it = gl.GadgetLoader(ds, batch_size=6, seed=1)
    seen = []
    for b in it:
        assert len(b) == len(refs)
        ids = b[-1].cpu()
        seen.append(ids)
        for col, ref in zip(b, refs, strict=True):
            assert col.device == dev()
            assert col.dtype == ref.dtype
            assert tuple(col.shape) == (len(ids),) + tuple(ref.shape[1:])
            assert torch.equal(col.cpu(), ref[ids])
    assert sorted(torch.cat(seen).tolist()) == list(range(n))
    ds.close()


def test_getitem_int_slice_negative_and_list_on_gpu(mk):
    ds, x, _ = mk("numpy")
    r = ds[3]
    assert isinstance(r, tuple) and r[0].device == dev() and r[1].device == dev()
    assert r[0].tolist() == x[3].tolist() and int(r[1]) == Y0 + 3 * YS
    assert ds[-1][0].tolist() == x[-1].tolist() and int(ds[-1][1]) == Y0 + (N - 1) * YS
    check(ds[-3:], x, [N - 3, N - 2, N - 1])
    check(ds[2:30:9], x, [2, 11, 20, 29])
    check(ds[[5, 0, 5, 36]], x, [5, 0, 5, 36])
    check(ds[np.array([7, 1], dtype=np.int16)], x, [7, 1])
    check(ds[range(4, 7)], x, [4, 5, 6])


@pytest.mark.parametrize("kind", [pytest.param("cuda_tensor", marks=needs_cuda), "npy_file"])
def test_gather_with_cuda_ids_of_any_shape(kind, mk):
    ds, x, _ = mk(kind)
    ids = torch.tensor([[4, 0, 36], [4, 9, 2]], dtype=torch.int32, device=dev())
    b = ds.gather(ids)
    assert isinstance(b, gl.GadgetBatch)
    assert tuple(b[0].shape) == (2, 3, D) and tuple(b[1].shape) == (2, 3)
    assert b[0].device == dev() and b[1].device == dev()
    idn = ids.cpu().numpy()
    np.testing.assert_array_equal(b[0].cpu().numpy(), x[idn])
    np.testing.assert_array_equal(b[1].cpu().numpy(), make_y()[idn])


@needs_cupy
def test_large_repeated_gather_exact():
    """>= 65,536 ids from a small pinned table: the read-each-row-once path; same bits."""
    rng = np.random.default_rng(3)
    tab = rng.standard_normal((1000, 4)).astype(np.float32)
    ds = gl.GadgetDataset(tab, np.arange(1000))
    assert ds.columns[0].placement == "pinned"
    ids = torch.from_numpy(rng.integers(0, 1000, 70_000))
    for given in (ids.cuda(), ids, ids.numpy()):
        b = ds[given]
        assert b[0].device == dev()
        np.testing.assert_array_equal(b[0].cpu().numpy(), tab[ids.numpy()])
        np.testing.assert_array_equal(b[1].cpu().numpy(), ids.numpy())
    ds.close()


def test_custom_collate_gets_one_element_list(mk):
    ds, x, _ = mk("numpy")
    got = next(iter(DataLoader(ds, batch_size=B, collate_fn=lambda batch: batch)))
    assert isinstance(got, list) and len(got) == 1 and isinstance(got[0], gl.GadgetBatch)
    check(got[0], x, np.arange(8))


def test_subset_and_random_split_batches(mk):
    ds, x, _ = mk("numpy")
    sub = Subset(ds, [5, 3, 30, 0, 36, 12])
    out = list(DataLoader(sub, batch_size=4))
    assert all(isinstance(b, gl.GadgetBatch) for b in out)  # one gather per batch
    check(out[0], x, [5, 3, 30, 0])
    check(out[1], x, [36, 12])
    part, _rest = random_split(ds, [20, 17], generator=torch.Generator().manual_seed(0))
    rows = np.concatenate([check(b, x) for b in DataLoader(part, batch_size=B)])
    np.testing.assert_array_equal(rows, np.asarray(part.indices))


def test_concat_dataset_stacked_list_on_gpu(mk):
    ds, x, _ = mk("numpy")
    ds2, _, _ = mk("numpy_cpu")
    out = list(DataLoader(ConcatDataset([ds, ds2]), batch_size=10))
    assert all(isinstance(b, list) and len(b) == 2 for b in out)
    rows = np.concatenate([check(b, x) for b in out])
    np.testing.assert_array_equal(rows, np.concatenate([np.arange(N), np.arange(N)]))


# ---------------------------------------------------------------- sampler forms


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("cuda_tensor", marks=needs_cuda),
        "numpy",
        "npy_file",
        pytest.param("gadget_cuda", marks=needs_cuda),
    ],
)
def test_batch_sampler_form_two_epochs(kind, mk):
    ds, x, _ = mk(kind)
    s = gl.GadgetSampler(ds, batch_size=B, seed=3)
    loader = DataLoader(ds, batch_sampler=s)
    kept = [b for _ in range(2) for b in loader]
    sync()
    ref = ref_ids(N, B, seed=3, epochs=2)
    assert len(kept) == len(ref) == 10
    assert not np.array_equal(np.concatenate(ref[:5]), np.concatenate(ref[5:]))
    for b, ids in zip(kept, ref, strict=True):
        assert isinstance(b, gl.GadgetBatch)
        check(b, x, ids)


@pytest.mark.parametrize("kind", [pytest.param("cuda_tensor", marks=needs_cuda)])
def test_sampler_batch_size_none_form(kind, mk):
    ds, x, _ = mk(kind)
    s = gl.GadgetSampler(ds, batch_size=B, seed=9)
    out = list(DataLoader(ds, sampler=s, batch_size=None))
    for b, ids in zip(out, ref_ids(N, B, seed=9), strict=True):
        assert isinstance(b, list) and len(b) == 2  # default_convert turns the tuple into a list
        check(b, x, ids)
    assert len(out) == 5


def test_sampler_without_batch_size_none_refused(mk):
    ds, _, _ = mk("numpy")
    loader = DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=B))
    with pytest.raises(gl.GadgetValueError):
        next(iter(loader))


@pytest.mark.parametrize("mode", ["drop_last", "pad"])
def test_sampler_last_batch_modes(mode, mk):
    ds, x, _ = mk("numpy")
    kw = {"drop_last": dict(drop_last=True), "pad": dict(pad=True)}[mode]
    s = gl.GadgetSampler(ds, batch_size=B, seed=2, **kw)
    order0 = s.epoch_order(0).clone().numpy()
    out = [check(b, x) for b in DataLoader(ds, batch_sampler=s)]
    ref = ref_ids(N, B, seed=2, **kw)
    assert [len(r) for r in out] == [len(r) for r in ref]
    for got, want in zip(out, ref, strict=True):
        np.testing.assert_array_equal(got, want)
    if mode == "drop_last":
        assert [len(r) for r in out] == [8, 8, 8, 8]
        np.testing.assert_array_equal(np.concatenate(out), order0[:32])
    else:
        assert [len(r) for r in out] == [8] * 5
        np.testing.assert_array_equal(np.concatenate(out), np.concatenate([order0, order0[:3]]))


@pytest.mark.parametrize(
    "form,n,bs", [("default", 33, 8), ("batch_sampler", 5, 8), ("loader", 33, 8)]
)
def test_last_partial_batch_keeps_batch_axis(form, n, bs, mk):
    ds, x, _ = mk("numpy", n=n)
    if form == "default":
        out = list(DataLoader(ds, batch_size=bs))
    elif form == "batch_sampler":
        out = list(
            DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=bs, order="sequential"))
        )
    else:
        out = list(gl.GadgetLoader(ds, batch_size=bs, order="sequential"))
    want = seq_ids(n, bs)
    assert len(out) == len(want)
    for b, ids in zip(out, want, strict=True):
        check(b, x, ids)
    assert tuple(out[-1][0].shape) == (len(want[-1]), D)
    assert tuple(out[-1][1].shape) == (len(want[-1]),)


@pytest.mark.parametrize("coalesce", [1, 3, None])
def test_sampler_coalesce_same_batches_and_kept(coalesce, mk):
    ds, x, _ = mk("numpy")
    s = gl.GadgetSampler(ds, batch_size=4, seed=11, coalesce=coalesce)
    assert s.coalesce == coalesce
    loader = DataLoader(ds, batch_sampler=s)
    kept = []
    for _ in range(2):
        for b in loader:
            kept.append((b, check(b, x)))
    sync()
    ref = ref_ids(N, 4, seed=11, epochs=2)
    assert len(kept) == len(ref) == 20
    for (b, first), ids in zip(kept, ref, strict=True):
        np.testing.assert_array_equal(first, ids)
        check(b, x, ids)  # again, after every later group was gathered


@pytest.mark.parametrize("coalesce", [None])
def test_sampler_batch_changed_in_place_does_not_leak(coalesce, mk):
    ds, x, _ = mk("numpy")
    s = gl.GadgetSampler(ds, batch_size=4, seed=6, coalesce=coalesce)
    loader = DataLoader(ds, batch_sampler=s)
    ref = ref_ids(N, 4, seed=6)
    for b, ids in zip(loader, ref, strict=True):
        check(b, x, ids)  # earlier batches' changes did not reach this one
        b[0].fill_(-1.0)
        b[1].fill_(-1)
    s.set_epoch(0)  # a second request for the same batches gathers them anew
    out = list(loader)
    assert len(out) == len(ref)
    for b, ids in zip(out, ref, strict=True):
        check(b, x, ids)
    np.testing.assert_array_equal(ds.columns[0].getNumpyVersion(), x)


def test_two_interleaved_sampler_loaders(mk):
    ds, x, _ = mk("numpy")
    s1 = gl.GadgetSampler(ds, batch_size=4, seed=1, coalesce=4)
    s2 = gl.GadgetSampler(ds, batch_size=3, seed=2, coalesce=4)
    it1, it2 = iter(DataLoader(ds, batch_sampler=s1)), iter(DataLoader(ds, batch_sampler=s2))
    r1, r2 = ref_ids(N, 4, seed=1), ref_ids(N, 3, seed=2)
    for i in range(max(len(r1), len(r2))):
        if i < len(r1):
            check(next(it1), x, r1[i])
        if i < len(r2):
            check(next(it2), x, r2[i])


def _write_rows(g, ids, value):
    rows = torch.full((len(ids), D), float(value))
    if g.placement in ("pinned", "cuda"):
        rows = rows.to(dev())
    g.insertData(rows, torch.from_numpy(ids))


@pytest.mark.parametrize(
    "placement,form",
    [
        pytest.param("pinned", "sampler_coalesce1", marks=needs_cupy),
        pytest.param("pinned", "loader_prefetch0", marks=needs_cupy),
        pytest.param("cuda", "loader_prefetch0", marks=needs_cuda),
    ],
)
def test_writes_before_asking_are_seen(placement, form):
    x = make_x()
    g = gl.DataGadget(x, placement=placement)
    ds = gl.GadgetDataset(g, make_y())
    if form == "sampler_coalesce1":
        s = gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=1)
        it = iter(DataLoader(ds, batch_sampler=s))
    else:
        it = iter(gl.GadgetLoader(ds, batch_size=4, order="sequential", prefetch=0))
    for i, ids in enumerate(seq_ids(N, 4)):
        _write_rows(g, ids, -(i + 1))
        b = next(it)
        assert b[0].device == dev()
        np.testing.assert_array_equal(b[0].cpu().numpy(), np.full((len(ids), D), -(i + 1.0)))
        np.testing.assert_array_equal(b[1].cpu().numpy(), make_y()[ids])
    with pytest.raises(StopIteration):
        next(it)
    ds.close()
    g.close()


# ---------------------------------------------------------------- worker processes


def _collate_in_worker(batch):
    (gb,) = batch
    info = torch.utils.data.get_worker_info()
    on_cpu = torch.tensor([t.device.type == "cpu" for t in gb])
    return list(gb), on_cpu, torch.tensor(info is not None)


WORKER_KINDS = ["numpy", "npy_file", pytest.param("gadget_pinned", marks=needs_cupy)]


@WORKERS
@pytest.mark.parametrize("kind", WORKER_KINDS)
def test_default_form_workers_gather_on_cpu(kind, mk):
    ds, x, _ = mk(kind)
    loader = DataLoader(
        ds,
        batch_size=B,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=_collate_in_worker,
    )
    out = []
    for cols, on_cpu, in_worker in loader:
        assert bool(in_worker)
        assert bool(on_cpu.all())  # rows come back on the CPU inside the worker
        out.append(check(cols, x, device=torch.device("cpu")))
    for rows, ids in zip(out, seq_ids(N, B), strict=True):
        np.testing.assert_array_equal(rows, ids)
    # and without a collate_fn, the batches reach the main process as CPU tensors
    plain = list(DataLoader(ds, batch_size=B, num_workers=2, multiprocessing_context="fork"))
    assert len(plain) == 5
    for b, ids in zip(plain, seq_ids(N, B), strict=True):
        check(b, x, ids, device=torch.device("cpu"))


@WORKERS
def test_batch_sampler_form_with_workers(mk):
    ds, x, _ = mk("numpy")
    s = gl.GadgetSampler(ds, batch_size=B, seed=12)
    loader = DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork")
    out = [b for _ in range(2) for b in loader]
    ref = ref_ids(N, B, seed=12, epochs=2)
    assert len(out) == len(ref)
    for b, ids in zip(out, ref, strict=True):
        check(b, x, ids, device=torch.device("cpu"))


@WORKERS
@pytest.mark.parametrize("kind", ["numpy"])
def test_gadgetloader_workers_deliver_to_device(kind, mk):
    ds, x, _ = mk(kind)
    loader = gl.GadgetLoader(
        ds, batch_size=B, seed=4, num_workers=2, multiprocessing_context="fork"
    )
    assert loader.device == dev()
    out = [b for _ in range(2) for b in loader]
    sync()
    ref = ref_ids(N, B, seed=4, epochs=2)
    assert len(out) == len(ref)
    for b, ids in zip(out, ref, strict=True):
        check(b, x, ids)


@WORKERS
def test_gadgetloader_workers_resume_without_workers(mk):
    ds, x, _ = mk("numpy")
    l1 = gl.GadgetLoader(ds, batch_size=4, seed=21, num_workers=2, multiprocessing_context="fork")
    it = iter(l1)
    got = [check(next(it), x) for _ in range(3)]
    sd = l1.state_dict()
    del it
    l2 = gl.GadgetLoader(ds, batch_size=4, seed=0)
    l2.load_state_dict(sd)
    got += [check(b, x) for b in l2]
    ref = ref_ids(N, 4, seed=21)
    assert len(got) == len(ref)
    for g_, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g_, r)


# ---------------------------------------------------------------- GadgetLoader


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("cuda_tensor", marks=needs_cuda),
        "npy_file",
        pytest.param("gadget_pinned", marks=needs_cupy),
    ],
)
def test_loader_kinds_two_epochs(kind, mk):
    ds, x, _ = mk(kind)
    loader = gl.GadgetLoader(ds, batch_size=4, seed=13)
    assert loader.device == dev() and len(loader) == 10
    kept = [b for _ in range(2) for b in loader]
    sync()
    ref = ref_ids(N, 4, seed=13, epochs=2)
    assert len(kept) == 20
    for b, ids in zip(kept, ref, strict=True):
        assert isinstance(b, gl.GadgetBatch)
        check(b, x, ids)


@pytest.mark.parametrize("prefetch,coalesce", [(0, None), (1, 1), (4, 3)])
def test_loader_prefetch_coalesce_values_kept(prefetch, coalesce, mk):
    ds, x, _ = mk("numpy")
    loader = gl.GadgetLoader(ds, batch_size=4, seed=14, prefetch=prefetch, coalesce=coalesce)
    kept = []
    for _ in range(3):
        for b in loader:
            kept.append((b, check(b, x)))
    sync()
    ref = ref_ids(N, 4, seed=14, epochs=3)
    assert len(kept) == len(ref) == 30
    for (b, first), ids in zip(kept, ref, strict=True):
        np.testing.assert_array_equal(first, ids)
        check(b, x, ids)  # old batches not overwritten by later prefetches


@pytest.mark.parametrize("coalesce", [None])
def test_loader_batches_changed_in_place_do_not_leak(coalesce, mk):
    ds, x, _ = mk("numpy")
    loader = gl.GadgetLoader(ds, batch_size=4, seed=15, coalesce=coalesce)
    ref = ref_ids(N, 4, seed=15, epochs=2)
    i = 0
    for _ in range(2):
        for b in loader:
            check(b, x, ref[i])
            b[0].mul_(0).sub_(5)
            b[1].fill_(123456)
            i += 1
    assert i == 20
    np.testing.assert_array_equal(ds.columns[0].getNumpyVersion(), x)
    np.testing.assert_array_equal(ds.columns[1].getNumpyVersion(), make_y())


def _consume_on(stream, iterable):
    outs = []
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        for b in iterable:
            torch.cuda._sleep(SLEEP_CYCLES)  # the use runs late on this stream
            outs.append((b[0] * 1, b[1] + 0))
            del b  # only this stream's pending work still uses the batch
    torch.cuda.synchronize()
    return outs


@needs_cuda
@pytest.mark.parametrize("stream,coalesce", [("default", None), ("user", 1), ("user", None)])
def test_loader_batches_safe_on_consuming_stream(stream, coalesce, mk):
    ds, x, _ = mk("numpy")
    loader = gl.GadgetLoader(ds, batch_size=4, seed=16, prefetch=2, coalesce=coalesce)
    s = torch.cuda.Stream() if stream == "user" else None
    outs = _consume_on(s, loader) + _consume_on(s, loader)
    ref = ref_ids(N, 4, seed=16, epochs=2)
    assert len(outs) == len(ref)
    for o, ids in zip(outs, ref, strict=True):
        check(o, x, ids)


@needs_cuda
@pytest.mark.parametrize("coalesce", [None])
def test_sampler_form_batches_safe_on_user_stream(coalesce, mk):
    ds, x, _ = mk("numpy")
    s = gl.GadgetSampler(ds, batch_size=4, seed=17, coalesce=coalesce)
    loader = DataLoader(ds, batch_sampler=s)
    outs = _consume_on(torch.cuda.Stream(), loader)
    ref = ref_ids(N, 4, seed=17)
    assert len(outs) == len(ref)
    for o, ids in zip(outs, ref, strict=True):
        check(o, x, ids)


@needs_cuda
@pytest.mark.parametrize(
    "stream,placement", [pytest.param("default", "pinned", marks=needs_cupy), ("user", "cuda")]
)
def test_loader_side_stream_waits_for_writes_queued_before_iteration(stream, placement):
    """Docstring: the side stream waits for the current stream once, when iteration starts."""
    x = make_x()
    g = gl.DataGadget(x, placement=placement)
    ds = gl.GadgetDataset(g, make_y())
    loader = gl.GadgetLoader(ds, batch_size=4, order="sequential", prefetch=3)
    s = torch.cuda.Stream() if stream == "user" else None
    new = torch.from_numpy(-x).to(dev())
    with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
        torch.cuda._sleep(SLEEP_CYCLES * 10)  # the write below is still queued at iter()
        g.insertData(new, torch.arange(N))
        outs = [(b[0] * 1, b[1] + 0) for b in loader]
    torch.cuda.synchronize()
    assert len(outs) == 10
    for (xb, yb), ids in zip(outs, seq_ids(N, 4), strict=True):
        np.testing.assert_array_equal(xb.cpu().numpy(), -x[ids])
        np.testing.assert_array_equal(yb.cpu().numpy(), make_y()[ids])
    ds.close()
    g.close()


def test_loader_over_array_or_gadget_is_one_column():
    x = make_x()
    g = gl.DataGadget(x, placement=DEFAULT_PLACEMENT)
    for src in (g, x):
        out = list(gl.GadgetLoader(src, batch_size=B, order="sequential"))
        assert len(out) == 5
        for b, ids in zip(out, seq_ids(N, B), strict=True):
            assert isinstance(b, gl.GadgetBatch) and len(b) == 1
            assert b[0].device == dev()
            np.testing.assert_array_equal(b[0].cpu().numpy(), x[ids])
    g.close()


def test_loader_follows_sampler_set_epoch(mk):
    ds, x, _ = mk("numpy")
    s = gl.GadgetSampler(ds, batch_size=4, seed=6)
    loader = gl.GadgetLoader(ds, sampler=s)
    s.set_epoch(3)
    out = [check(b, x) for b in loader]
    ref = ref_ids(N, 4, seed=6, set_epoch=3)
    assert len(out) == len(ref)
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_array_equal(o, r)


def test_loader_refuses_kwargs_it_sets_and_sampler_options(mk):
    ds, _, _ = mk("numpy")
    for kw in (dict(shuffle=True), dict(batch_sampler=[[0, 1]]), dict(collate_fn=list)):
        with pytest.raises(gl.GadgetTypeError):
            gl.GadgetLoader(ds, batch_size=4, **kw)
    for kw in (dict(seed=0), dict(order="random"), dict(drop_last=False)):
        with pytest.raises(gl.GadgetError):
            gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4), **kw)


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("k,coalesce,prefetch", [(1, None, 2), (6, 1, 2), (9, None, 4)])
def test_loader_resume_mid_epoch_equals_uninterrupted(k, coalesce, prefetch, mk):
    ds, x, _ = mk("numpy")
    ref = ref_ids(N, 4, seed=5, epochs=2)
    l1 = gl.GadgetLoader(ds, batch_size=4, seed=5, coalesce=coalesce, prefetch=prefetch)
    it = iter(l1)
    got = [check(next(it), x) for _ in range(k)]
    sd = l1.state_dict()
    del it
    l2 = gl.GadgetLoader(ds, batch_size=4, seed=123, coalesce=coalesce, prefetch=prefetch)
    l2.load_state_dict(sd)  # brings the saved seed and epoch
    got += [check(b, x) for b in l2]
    assert len(got) == 10
    got += [check(b, x) for b in l2]
    assert len(got) == len(ref)
    for g_, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g_, r)


@pytest.mark.parametrize("where", ["inside_loop", "after_loop"])
def test_loader_resume_at_epoch_end(where, mk):
    ds, x, _ = mk("numpy")
    ref1 = ref_ids(N, 4, seed=5, set_epoch=1)
    l1 = gl.GadgetLoader(ds, batch_size=4, seed=5)
    sd = None
    for i, b in enumerate(l1):
        check(b, x)
        if i == len(l1) - 1 and where == "inside_loop":
            sd = l1.state_dict()
    if where == "after_loop":
        sd = l1.state_dict()
    l2 = gl.GadgetLoader(ds, batch_size=4, seed=0)
    l2.load_state_dict(sd)
    if where == "inside_loop":
        assert list(l2) == []  # one empty pass, then the next epoch
    got = [check(b, x) for b in l2]
    assert len(got) == len(ref1)
    for g_, r in zip(got, ref1, strict=True):
        np.testing.assert_array_equal(g_, r)


@pytest.mark.parametrize("coalesce", [None])
def test_sampler_resume_through_dataloader(coalesce, mk):
    ds, x, _ = mk("numpy")
    ref = ref_ids(N, 4, seed=8, epochs=2)
    s1 = gl.GadgetSampler(ds, batch_size=4, seed=8, coalesce=coalesce)
    it = iter(DataLoader(ds, batch_sampler=s1))
    got = [check(next(it), x) for _ in range(3)]
    sd = s1.state_dict()
    del it
    s2 = gl.GadgetSampler(ds, batch_size=4, seed=1, coalesce=coalesce)
    s2.load_state_dict(sd)
    loader2 = DataLoader(ds, batch_sampler=s2)
    got += [check(b, x) for b in loader2]
    got += [check(b, x) for b in loader2]
    assert len(got) == len(ref)
    for g_, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g_, r)


def test_stateful_dataloader_resume(mk):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds, x, _ = mk("numpy")
    ref = ref_ids(N, 4, seed=8)
    dl1 = sdl.StatefulDataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, seed=8))
    it = iter(dl1)
    got = [check(next(it), x) for _ in range(4)]
    sd = dl1.state_dict()
    del it
    dl2 = sdl.StatefulDataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, seed=2))
    dl2.load_state_dict(sd)
    got += [check(b, x) for b in dl2]
    assert len(got) == len(ref)
    for g_, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g_, r)


def test_loader_resume_refused_for_other_batch_size(mk):
    ds, x, _ = mk("numpy")
    l1 = gl.GadgetLoader(ds, batch_size=4, seed=5)
    it = iter(l1)
    next(it)
    sd = l1.state_dict()
    del it
    l2 = gl.GadgetLoader(ds, batch_size=5, seed=31)
    with pytest.raises(gl.GadgetValueError):
        l2.load_state_dict(sd)
    got = [check(b, x) for b in l2]  # left as it was: its own epoch 0 from the start
    ref = ref_ids(N, 5, seed=31)
    assert len(got) == len(ref)
    for g_, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g_, r)


# ---------------------------------------------------------------- GadgetBatch


def test_batch_to_cpu_and_back(mk):
    ds, x, _ = mk("numpy")
    b = ds.gather(torch.arange(5, 12))
    c = b.to("cpu")
    assert isinstance(c, gl.GadgetBatch)
    check(c, x, np.arange(5, 12), device=torch.device("cpu"))
    d = c.to(dev())
    assert isinstance(d, gl.GadgetBatch)
    check(d, x, np.arange(5, 12))
    e = b.to("cpu", non_blocking=True)
    sync()
    check(e, x, np.arange(5, 12), device=torch.device("cpu"))


@needs_cuda
def test_batch_to_cuda_index_and_no_copy_when_there(mk):
    ds, x, _ = mk("numpy")
    c = ds.gather([3, 1, 4]).to("cpu")
    for target in (0, "cuda", torch.device("cuda", 0)):
        d = c.to(target)
        check(d, x, [3, 1, 4], device=torch.device("cuda", 0))
    b = ds.gather([3, 1, 4])
    same = b.to(b[0].device)
    assert [t.data_ptr() for t in same] == [t.data_ptr() for t in b]


def test_batch_to_dtype_refused_batch_unchanged(mk):
    ds, x, _ = mk("numpy")
    b = ds.gather([0, 36, 2])
    for dtype in (torch.float16, torch.float32, torch.int64):
        with pytest.raises(gl.GadgetTypeError):
            b.to(dtype)
        check(b, x, [0, 36, 2])


@needs_cuda
def test_batch_pin_memory_pins_only_cpu_columns():
    g = torch.arange(6.0, device="cuda")
    c = torch.arange(4)
    pb = gl.GadgetBatch((g, c)).pin_memory()
    assert isinstance(pb, gl.GadgetBatch) and len(pb) == 2
    assert pb[0].device.type == "cuda" and pb[0].data_ptr() == g.data_ptr()
    assert pb[1].device.type == "cpu" and pb[1].is_pinned()
    assert torch.equal(pb[1], c)


def _torch_delegates_pin_memory() -> bool:
    from torch.utils.data._utils.pin_memory import pin_memory as _pin

    class _T(tuple):
        def pin_memory(self, *a, **k):
            return "delegated"

    try:
        return _pin(_T((torch.zeros(1),))) == "delegated"
    except Exception:
        return False


@needs_cuda
def test_dataloader_pin_memory_true_keeps_gpu_batches(mk):
    if not _torch_delegates_pin_memory():
        pytest.skip("this torch pins a tuple's tensors one by one (README: leave pin_memory off)")
    ds, x, _ = mk("numpy")
    out = list(DataLoader(ds, batch_size=B, pin_memory=True))
    for b, ids in zip(out, seq_ids(N, B), strict=True):
        check(b, x, ids)
    s = gl.GadgetSampler(ds, batch_size=B, seed=3)
    for b, ids in zip(
        DataLoader(ds, batch_sampler=s, pin_memory=True), ref_ids(N, B, seed=3), strict=True
    ):
        check(b, x, ids)


@needs_cuda
@WORKERS
def test_dataloader_workers_pin_memory_pins_cpu_batches(mk):
    if not _torch_delegates_pin_memory():
        pytest.skip("this torch pins a tuple's tensors one by one (README: leave pin_memory off)")
    ds, x, _ = mk("numpy")
    out = list(
        DataLoader(ds, batch_size=B, num_workers=2, multiprocessing_context="fork", pin_memory=True)
    )
    assert len(out) == 5
    for b, ids in zip(out, seq_ids(N, B), strict=True):
        check(b, x, ids, device=torch.device("cpu"))
        assert b[0].is_pinned() and b[1].is_pinned()


@needs_cuda
def test_batch_record_stream_keeps_memory_for_other_stream(mk):
    ds, x, _ = mk("numpy")
    ids = torch.arange(N, device="cuda")
    s = torch.cuda.Stream()
    b = ds.gather(ids)  # on the default stream
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES * 4)
        ox, oy = b[0] * 1, b[1] + 0
    b.record_stream(s)
    del b
    junk = [torch.full((N, D), -7.0, device="cuda") for _ in range(8)]
    junk += [torch.full((N,), -7, dtype=torch.int64, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    check((ox, oy), x, np.arange(N))
    assert all(int(j.min()) == -7 for j in junk)
    # a batch with a CPU column: only CUDA columns are marked (a CPU tensor would refuse)
    mixed = gl.GadgetBatch((torch.arange(6.0, device="cuda"), torch.arange(4)))
    assert mixed.record_stream(s) is None
    assert torch.equal(mixed[1], torch.arange(4))


# ---------------------------------------------------------------- bad input


BAD_KINDS = [pytest.param("cuda_tensor", marks=needs_cuda), "numpy", "npy_file"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_out_of_range_device_ids_refused_table_unchanged(kind, mk):
    ds, x, _ = mk(kind)
    for bad in (N, -1, 2**40):
        ids = torch.tensor([0, bad, 2], device=dev())
        with pytest.raises(gl.GadgetIndexError) as ei:
            ds.gather(ids)
        assert isinstance(ei.value, IndexError)
        with pytest.raises(gl.GadgetIndexError):
            ds[ids]
    np.testing.assert_array_equal(np.asarray(ds.columns[0]), x)
    np.testing.assert_array_equal(np.asarray(ds.columns[1]), make_y())
    check(ds.gather(torch.tensor([36, 0], device=dev())), x, [36, 0])  # still usable


def test_non_integer_device_ids_refused(mk):
    ds, x, _ = mk("numpy")
    for ids in (torch.tensor([0.0, 1.0]), torch.tensor([True, False])):
        with pytest.raises(gl.GadgetTypeError) as ei:
            ds.gather(ids.to(dev()))
        assert isinstance(ei.value, TypeError)
        if ids.dtype == torch.bool:
            assert "nonzero" in str(ei.value)
    np.testing.assert_array_equal(np.asarray(ds.columns[0]), x)


def test_bad_batch_in_dataloader_batch_sampler(mk):
    ds, x, _ = mk("numpy")
    batches = [torch.tensor([1, 2], device=dev()), torch.tensor([3, N], device=dev())]
    it = iter(DataLoader(ds, batch_sampler=batches))
    check(next(it), x, [1, 2])
    with pytest.raises(gl.GadgetIndexError):
        next(it)
    # the default form's list of Python ints
    it = iter(DataLoader(ds, batch_size=2, sampler=[0, 1, 2, N]))
    check(next(it), x, [0, 1])
    with pytest.raises(gl.GadgetIndexError):
        next(it)
    with pytest.raises(gl.GadgetIndexError):
        ds[[3, -2]]
    np.testing.assert_array_equal(np.asarray(ds.columns[0]), x)


@needs_cuda
def test_sampler_batch_changed_by_torch_is_checked(mk):
    for kind in ("cuda_tensor", "numpy"):  # cuda / pinned columns (no range check when tagged)
        ds, x, _ = mk(kind)
        s = gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=1)
        b = next(iter(s))
        b[1] = N  # a change through torch: the ids lose the sampler's tag
        with pytest.raises(gl.GadgetIndexError):
            ds.gather(b)
        np.testing.assert_array_equal(np.asarray(ds.columns[0]), x)
        check(ds.gather(torch.tensor([0, 1, 2, 3])), x, [0, 1, 2, 3])


def test_sampler_ids_changed_by_numpy_host_column_checks(mk):
    ds, x, _ = mk("numpy_cpu")
    s = gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=1)
    b = next(iter(s))
    b.numpy()[1] = N  # keeps the tag; host columns check anyway
    with pytest.raises(gl.GadgetIndexError):
        ds.gather(b)
    np.testing.assert_array_equal(np.asarray(ds.columns[0]), x)


@needs_cuda
def test_sampler_ids_changed_by_numpy_gpu_columns_stay_inside_table(mk):
    ds, x, exp = mk("cuda_tensor")
    s = gl.GadgetSampler(ds, batch_size=4, order="sequential", coalesce=1)
    b = next(iter(s))
    b.numpy()[1] = N  # tag kept: cuda columns may skip the check; the kernel never reads outside
    try:
        out = ds.gather(b)
    except gl.GadgetIndexError:
        out = None  # a check that runs anyway is fine too
    torch.cuda.synchronize()
    if out is not None:
        xb, yb = out[0].cpu().numpy(), out[1].cpu().numpy()
        for p in (0, 2, 3):
            np.testing.assert_array_equal(xb[p], x[p])
            assert yb[p] == make_y()[p]
        # the changed id: a zero row (unchecked id past the table) or the unchanged id's row
        assert np.array_equal(xb[1], np.zeros(D, np.float32)) or np.array_equal(xb[1], x[1])
        assert yb[1] in (0, make_y()[1])
    np.testing.assert_array_equal(np.asarray(ds.columns[0]), x)
    np.testing.assert_array_equal(np.asarray(ds.columns[1]), make_y())
    check(ds.gather(torch.arange(N, device="cuda")), x, np.arange(N))  # no sticky CUDA error
