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
