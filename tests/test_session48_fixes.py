"""Session 48's fixes, from black-box reviews.

- ``GadgetSampler.load_state_dict`` took a state whose settings only compared equal to
  the sampler's own (``num_rows=50.0``, ``drop_last=0``, ``batch_size=True``): such a
  state was not written by ``state_dict()``, and is now refused with the sampler unchanged.
- ``OffloadedEmbeddingBag`` casts ``per_sample_weights`` of any floating dtype to the
  table's (documented; checked against ``nn.EmbeddingBag`` with weights of its own dtype).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA, MEMORY_PLACEMENTS

import gadgetloader as gl

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


# ------------------------------------------------------ GadgetSampler: kinds of saved settings
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_rows", 100.0),
        ("num_replicas", True),
        ("batch_size", 10.0),
        ("drop_last", 0),
        ("pad", 0.0),
        ("order", b"random"),
    ],
)
def test_sampler_state_with_a_setting_of_another_kind_is_refused(key, value):
    sampler = gl.GadgetSampler(100, batch_size=10, seed=3)
    it = iter(sampler)
    next(it)
    before = sampler.state_dict()
    other = gl.GadgetSampler(100, batch_size=10, seed=5)
    state = dict(other.state_dict(), position=4)
    state[key] = value
    with pytest.raises(gl.GadgetValueError, match=key):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == before  # unchanged: seed, epoch and position kept


def test_sampler_state_with_numpy_ints_still_loads():
    sampler = gl.GadgetSampler(100, batch_size=10, seed=3)
    reference = gl.GadgetSampler(100, batch_size=10, seed=3)
    state = reference.state_dict()
    it = iter(reference)
    expected = [next(it).tolist() for _ in range(3)]
    state = {k: (np.int64(v) if type(v) is int else v) for k, v in state.items()}
    sampler.load_state_dict(state)
    got = [b.tolist() for b, _ in zip(sampler, range(3), strict=False)]
    assert got == expected


@pytest.mark.parametrize("order", ["sequential", "random", "chunk"])
def test_sampler_state_round_trip_keeps_working(order):
    kw = {"chunk_rows": 8} if order == "chunk" else {}
    a = gl.GadgetSampler(90, batch_size=7, order=order, seed=11, **kw)
    it = iter(a)
    seen = [next(it).tolist() for _ in range(4)]
    state = a.state_dict()
    b = gl.GadgetSampler(90, batch_size=7, order=order, seed=0, **kw)
    b.load_state_dict(state)
    rest = [x.tolist() for x in b]
    assert sorted(i for batch in seen + rest for i in batch) == list(range(90))


# ------------------------------------------- OffloadedEmbeddingBag: per_sample_weights dtypes
@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
@pytest.mark.parametrize("wdtype", [torch.float64, torch.float16, torch.bfloat16])
def test_bag_per_sample_weights_of_another_float_dtype_are_cast(placement, wdtype):
    torch.manual_seed(0)
    bag = gl.OffloadedEmbeddingBag(40, 6, mode="sum", placement=placement, device=DEVICE)
    table = torch.as_tensor(bag.table.getNumpyVersion()).to(DEVICE)
    ref = torch.nn.EmbeddingBag.from_pretrained(table, mode="sum", freeze=True)
    ids = torch.tensor([[1, 5, 5], [39, 0, 2]], device=DEVICE)
    w = torch.rand(2, 3, device=DEVICE).to(wdtype)
    out = bag(ids, per_sample_weights=w)
    assert out.dtype == torch.float32
    expected = ref(ids, per_sample_weights=w.to(torch.float32))
    torch.testing.assert_close(out.detach(), expected)


# ------------------------------------------------------------------ the public namespace
def test_namespace_has_no_future_import_leak():
    public = {n for n in dir(gl) if not n.startswith("_")}
    assert "annotations" not in public
    assert set(gl.__all__) <= set(dir(gl))


# ------------------------------------------- switched weights: zero padding rows (documented)
def test_switched_weight_keeps_its_rows_and_pads_with_zeros():
    emb = torch.nn.Embedding(8, 3)
    sw = gl.ModelSwitch(emb, 50, 3, placement="cpu")
    sw.uniformDistributionInit(-1.0, 1.0)
    table = sw.getNumpyVersion()
    ids = torch.tensor([7, 3, 7, 41])
    local = sw.beforeForwardPass(ids)
    w = emb.weight.detach()
    assert tuple(w.shape) == (8, 3)  # the module's own rows: more than the batch's
    np.testing.assert_array_equal(w[local].numpy(), table[ids.numpy()])
    assert not w[3:].any()  # three distinct ids: the rest is zero padding


# ------------------------------------------- a missing name whose .npy exists: a hint
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_missing_path_names_the_npy_that_save_wrote(tmp_path, placement):
    g = gl.DataGadget(np.arange(6, dtype=np.float32).reshape(3, 2), placement="cpu")
    stem = str(tmp_path / "emb")
    g.saveCupy(stem)  # writes emb.npy, as numpy.save
    other = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetFileNotFoundError, match=r"emb\.npy exists"):
        other.loadCupy(stem)
    np.testing.assert_array_equal(other.getNumpyVersion(), np.ones((3, 2), np.float32))
    with pytest.raises(gl.GadgetFileNotFoundError, match=r"emb\.npy exists"):
        gl.DataGadget(stem, placement=placement)
    with pytest.raises(gl.GadgetFileNotFoundError) as info:
        gl.DataGadget(str(tmp_path / "nothing"), placement=placement)
    assert "exists" not in str(info.value)


# ------------------------- rolling back to a state saved before an option turned state on
def _lazy_sgd_reference(w0, ids, lr, momentum_from):
    """SGD over a whole table with lazy rows: plain steps before ``momentum_from``, then
    momentum 0.9 with buffers starting at zero (torch's first buffer is the gradient)."""
    w = w0.clone()
    buf = torch.zeros_like(w)
    for n, (batch, square) in enumerate(ids):
        u, c = batch.unique(return_counts=True)
        g = (2 * w[u] if square else torch.ones_like(w[u])) * c[:, None].to(w.dtype)
        if n >= momentum_from:
            buf[u] = 0.9 * buf[u] + g
            g = buf[u]
        w[u] -= lr * g
    return w


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
@pytest.mark.parametrize("how", ["state_dict", "npy", "hdf5", "zarr"])
def test_rollback_to_state_saved_before_momentum_came_on(placement, how, tmp_path):
    """torch loads a state saved with momentum 0 into an optimizer whose momentum is on now:
    the options load with it and the buffers start afresh. Session 47 refused it."""
    import copy

    if how in ("hdf5", "zarr"):
        pytest.importorskip({"hdf5": "h5py", "zarr": "zarr"}[how])
    torch.manual_seed(1)
    e = gl.OffloadedEmbedding(12, 4, placement=placement, device=DEVICE, dtype=torch.float64)
    w0 = torch.as_tensor(e.table.getNumpyVersion()).clone()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.1, momentum=0.0)
    ids = [torch.tensor([1, 2, 2]), torch.tensor([3, 1]), torch.tensor([5, 2, 11])]
    e(ids[0].to(DEVICE)).sum().backward()
    opt.step()
    if how == "state_dict":
        saved = (copy.deepcopy(e.state_dict()), copy.deepcopy(opt.state_dict()))
    else:
        gl.save_checkpoint(tmp_path / "ck", {"e": e, "o": opt}, format=how)
    opt.param_groups[0]["momentum"] = 0.9  # a scheduler turns momentum on
    e(ids[1].to(DEVICE)).sum().backward()
    opt.step()
    assert opt.state_dict()["tables"][0]["momentum_buffer"].any()
    if how == "state_dict":
        e.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    else:
        gl.load_checkpoint(tmp_path / "ck", {"e": e, "o": opt})
    assert opt.param_groups[0]["momentum"] == 0.0  # the saved options came back
    assert not opt.state_dict()["tables"][0]["momentum_buffer"].any()
    opt.param_groups[0]["momentum"] = 0.9
    for batch in ids[1:]:
        (e(batch.to(DEVICE)) ** 2).sum().backward()
        opt.step()
    expected = _lazy_sgd_reference(
        w0, [(ids[0], False), (ids[1], True), (ids[2], True)], 0.1, momentum_from=1
    )
    np.testing.assert_allclose(e.table.getNumpyVersion(), expected.numpy(), rtol=0, atol=1e-12)


def test_state_missing_what_its_own_options_keep_is_still_refused():
    """A state whose saved options keep momentum buffers but that holds none (made by hand)
    is refused, and nothing changes."""
    import copy

    e = gl.OffloadedEmbedding(12, 4, placement="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.1, momentum=0.9)
    e(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    del sd["tables"][0]["momentum_buffer"]
    before = opt.state_dict()
    with pytest.raises(gl.GadgetValueError, match="momentum_buffer"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert torch.equal(
        before["tables"][0]["momentum_buffer"], after["tables"][0]["momentum_buffer"]
    )


# ------------------------------------------------- a zarr array resized in place: refused
@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("writable", [True, False])
def test_zarr_file_table_refuses_an_array_resized_in_place(tmp_path, zarr_format, writable):
    zarr = pytest.importorskip("zarr")
    path = str(tmp_path / "r.zarr")
    values = np.arange(1000 * 8, dtype=np.float32).reshape(1000, 8)
    z = zarr.open_array(
        path, mode="w", shape=values.shape, chunks=(64, 8), dtype="f4", zarr_format=zarr_format
    )
    z[:] = values
    g = gl.DataGadget(path, placement="file", cache_bytes=0, writable=writable, device=DEVICE)
    np.testing.assert_array_equal(g.getData([900]).cpu().numpy(), values[[900]])
    z.attrs["note"] = "attributes only"  # the metadata file is rewritten, same array
    np.testing.assert_array_equal(g.getData([900, 3]).cpu().numpy(), values[[900, 3]])
    zarr.open_array(path, mode="a").resize((500, 8))
    with pytest.raises(gl.GadgetFileError, match=r"shape \[500, 8\], where it had \[1000, 8\]"):
        g.getData([900])
    with pytest.raises(gl.GadgetFileError, match="changed since this table opened it"):
        g.getData([3])  # for good: not only the rows past the new end
    if writable:
        with pytest.raises(gl.GadgetFileError):
            g.insertData(torch.ones(1, 8), [5])
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[:500], values[:500])
    again = gl.DataGadget(path, placement="file", device=DEVICE)
    assert again.shape == (500, 8)


# -------------------------- fused SGD with dampening: tables in a group of their own train
def _need_fused_sgd() -> None:
    p = torch.zeros(2, device=DEVICE, requires_grad=True)
    try:
        torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
    except (RuntimeError, ValueError) as exc:
        pytest.skip(f"this torch has no fused SGD on {DEVICE.type}: {exc}")


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_fused_sgd_dampening_with_tables_in_their_own_group(placement):
    import copy

    _need_fused_sgd()

    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(20, 4, placement=placement, device=DEVICE)
    head = torch.nn.Linear(4, 1).to(DEVICE)
    head_ref = copy.deepcopy(head)
    kw = {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "fused": True}
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD, [{"params": emb}, {"params": head.parameters()}], **kw
    )
    ref = torch.optim.SGD(head_ref.parameters(), **kw)
    for _ in range(3):
        x = emb(torch.tensor([[1, 2, 2], [3, 4, 5]], device=DEVICE)).sum(1)
        head(x).sum().backward()
        opt.step()
        opt.zero_grad()
        head_ref(x.detach()).sum().backward()
        ref.step()
        ref.zero_grad()
    for a, b in zip(head.parameters(), head_ref.parameters(), strict=True):
        assert torch.equal(a, b)  # the head's group stepped as torch's fused SGD steps it


def test_fused_sgd_dampening_mixed_in_one_group_is_still_refused():
    _need_fused_sgd()
    emb = gl.OffloadedEmbedding(20, 4, placement="cpu", device=DEVICE)
    head = torch.nn.Linear(4, 1).to(DEVICE)
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD,
        [{"params": [emb, *head.parameters()]}],
        lr=0.1,
        momentum=0.9,
        dampening=0.3,
        fused=True,
    )
    before = emb.table.getNumpyVersion().copy()
    w = head.weight.detach().clone()
    x = emb(torch.tensor([[1, 2]], device=DEVICE)).sum(1)
    ((x * head.weight).sum() + head.bias.sum()).backward()  # (no cuBLAS call)
    with pytest.raises(gl.GadgetValueError, match="group of their own"):
        opt.step()
    np.testing.assert_array_equal(emb.table.getNumpyVersion(), before)
    assert torch.equal(head.weight.detach(), w)


# ------------------------------------- pickling a dataset with a GPU column names the column
@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["cuda", "pinned"])
def test_pickling_a_dataset_names_its_gpu_column(placement):
    import copy
    import pickle

    if not HAS_CUDA:
        pytest.skip("no CUDA device on this machine")
    table = gl.DataGadget(np.ones((6, 2), np.float32), placement=placement)
    labels = gl.DataGadget(np.arange(6), placement="cpu")
    ds = gl.GadgetDataset(labels, table)  # column 0 lives in RAM, column 1 is GPU's
    with pytest.raises(gl.GadgetTypeError, match=r"column 1: .*placement='cpu'") as info:
        pickle.dumps(ds)
    assert "this dataset placed" not in str(info.value)  # the user's own column
    shallow = copy.copy(ds)  # shares the columns: no pickling
    assert shallow[[1, 2]][1].shape == (2, 2)
    made = gl.GadgetDataset(np.arange(6), table, placement=placement)
    with pytest.raises(gl.GadgetTypeError, match=r"column 0: .*this dataset placed"):
        pickle.dumps(made)  # an array the dataset put on the GPU side: the hint says so


def test_pickling_a_dataset_of_cpu_and_file_columns_still_works(tmp_path):
    import pickle

    np.save(tmp_path / "a.npy", np.arange(12, dtype=np.float32).reshape(6, 2))
    ds = gl.GadgetDataset(
        gl.DataGadget(str(tmp_path / "a.npy"), placement="file"), np.arange(6) * 10, placement="cpu"
    )
    back = pickle.loads(pickle.dumps(ds))
    x, y = back[[4, 1]]
    np.testing.assert_array_equal(x.cpu().numpy(), [[8, 9], [2, 3]])
    np.testing.assert_array_equal(y.cpu().numpy(), [40, 10])


# ------------------------------ the rollback's follow-ups (a review of session 48's fixes)
@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_rollback_with_a_closed_table_to_reset_changes_nothing(how, tmp_path):
    import copy

    def pair(momentum):
        m = torch.nn.ModuleDict(
            {
                "a": gl.OffloadedEmbedding(12, 4, placement="cpu"),
                "b": gl.OffloadedEmbedding(10, 4, placement="cpu"),
            }
        )
        return m, gl.OffloadedOptimizer(torch.optim.SGD, m, lr=0.1, momentum=momentum)

    def step(m, o):
        (m["a"](torch.tensor([1, 2])).sum() + m["b"](torch.tensor([3])).sum()).backward()
        o.step()
        o.zero_grad()

    m0, o0 = pair(0.0)
    step(m0, o0)
    sd = copy.deepcopy(o0.state_dict())
    gl.save_checkpoint(tmp_path / "ck", {"m": m0, "o": o0})
    m, o = pair(0.9)
    step(m, o)
    buf = o.pagers[0].tables["momentum_buffer"].getNumpyVersion().copy()
    weights = m["a"].table.getNumpyVersion().copy()
    o.pagers[1].tables["momentum_buffer"].close()
    with pytest.raises(gl.GadgetClosedError):
        if how == "state_dict":
            o.load_state_dict(sd)
        else:
            gl.load_checkpoint(tmp_path / "ck", {"m": m, "o": o})
    assert [g["momentum"] for g in o.param_groups] == [0.9]
    np.testing.assert_array_equal(o.pagers[0].tables["momentum_buffer"].getNumpyVersion(), buf)
    np.testing.assert_array_equal(m["a"].table.getNumpyVersion(), weights)


def test_switcher_checkpoint_rollback_takes_the_saved_torch_options(tmp_path):
    """An optimizer switcher's checkpoint saved before momentum came on loads with the torch
    optimizer saved beside it, as torch's own load does; training then goes on exactly as
    lazy SGD with buffers starting at zero."""
    torch.manual_seed(0)
    n, d = 20, 4
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(6, d, dtype=torch.float64)})
    emb = model["u"]
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.0)
    su = gl.ModelFactory(emb, n, d, datatype="float64", placement="cpu")
    w0 = torch.arange(n * d, dtype=torch.float64).reshape(n, d) / 100
    su.customInit(lambda t: t.copy_(w0))
    ou = gl.OptimizerFactory(opt, n, d, model, "u", dtype="float64", placement="cpu")
    ou.optInit()

    def step(ids):
        local = su.beforeForwardPass(ids)
        ou.beforeForwardPass(ids)
        opt.zero_grad()
        (emb(local) ** 2).sum().backward()
        opt.step()
        su.afterOptimizerStep(ids)
        ou.afterOptimizerStep(ids)

    ids = [torch.tensor([1, 2, 2]), torch.tensor([3, 1]), torch.tensor([5, 2, 11])]
    step(ids[0])
    objects = {"model": model, "opt": opt, "su": su, "ou": ou}
    gl.save_checkpoint(tmp_path / "ck", objects)
    opt.param_groups[0]["momentum"] = 0.9
    step(ids[1])
    assert "momentum_buffer" in ou.getNumpyVersion()
    gl.load_checkpoint(tmp_path / "ck", objects)
    assert opt.param_groups[0]["momentum"] == 0.0
    assert not ou.getNumpyVersion()["momentum_buffer"].any()
    opt.param_groups[0]["momentum"] = 0.9
    for batch in ids[1:]:
        step(batch)
    w = w0.clone()
    buf = torch.zeros_like(w)
    for k, batch in enumerate(ids):
        u, c = batch.unique(return_counts=True)
        g = 2 * w[u] * c[:, None].to(w.dtype)
        if k:
            buf[u] = 0.9 * buf[u] + g
            g = buf[u]
        w[u] -= 0.1 * g
    np.testing.assert_allclose(su.getNumpyVersion(), w.numpy(), rtol=0, atol=1e-12)


def test_sampler_state_through_numpy_scalars_still_loads():
    sampler = gl.GadgetSampler(50, batch_size=5, seed=2)
    state = sampler.state_dict()
    state.update(
        drop_last=np.bool_(False),
        pad=np.bool_(False),
        order=np.str_("random"),
        num_rows=np.int64(50),
    )
    sampler.load_state_dict(state)
    bad = dict(state, drop_last=np.int64(0))
    with pytest.raises(gl.GadgetValueError, match=r"numpy\.int64"):
        sampler.load_state_dict(bad)


def test_zarr_metadata_that_no_longer_parses_says_so(tmp_path):
    zarr = pytest.importorskip("zarr")
    path = tmp_path / "r.zarr"
    z = zarr.open_array(str(path), mode="w", shape=(10, 2), chunks=(5, 2), dtype="f4")
    z[:] = 1.0
    g = gl.DataGadget(str(path), placement="file", device=DEVICE)
    assert g.getData([3]).shape == (1, 2)
    (path / "zarr.json").write_text("{ not json")
    with pytest.raises(gl.GadgetFileError, match="is now unreadable"):
        g.getData([3])
