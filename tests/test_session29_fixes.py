"""Session 29's fixes, each found by a black-box review (tests/test_review_session29_*.py):

* a new ``iter()`` of a ``GadgetSampler`` takes the state over when it is called;
* the drop-in modules' default placement is ``pinned`` with CUDA, else ``cpu`` silently;
* an ``OffloadedEmbeddingBag`` takes empty offsets with an empty input (no bags), as torch;
* a file table's ``cache_bytes`` / ``block_rows`` of the wrong kind are ``GadgetTypeError``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl
from tests.conftest import HAS_CUDA


def _ids(batches) -> list[list[int]]:
    return [b.tolist() for b in batches]


# ---- the sampler: a new pass takes over at iter() ----------------------------------------------
@pytest.mark.parametrize("order", ["sequential", "random"])
def test_state_between_iter_and_first_batch_is_the_new_pass(order: str) -> None:
    s = gl.GadgetSampler(20, batch_size=3, order=order, seed=1)
    old = iter(s)
    next(old), next(old)
    assert s.state_dict()["position"] == 2
    new = iter(s)  # restarts the epoch (the pass was left before its end)
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (0, 0)
    next(old)  # the old pass no longer moves the state
    assert s.state_dict()["position"] == 0
    resumed = gl.GadgetSampler(20, batch_size=3, order=order, seed=1)
    resumed.load_state_dict(state)
    assert _ids(resumed) == _ids(new)
    assert len(_ids(gl.GadgetSampler(20, batch_size=3, order=order, seed=1))) == 7


def test_state_after_a_finished_epoch_and_a_new_iter_reads_the_next_epoch() -> None:
    s = gl.GadgetSampler(10, batch_size=4, seed=3)
    first = _ids(s)
    it = iter(s)
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    second = _ids(it)
    assert second != first and sorted(sum(second, [])) == list(range(10))
    assert s.epoch == 2


def test_two_iters_before_a_batch_keep_a_loaded_position() -> None:
    """DataLoader with workers calls iter() twice before its first batch: both start at the
    loaded position (and a load after iter() still wins at the first next())."""
    ref = _ids(gl.GadgetSampler(30, batch_size=4, seed=5))
    s = gl.GadgetSampler(30, batch_size=4, seed=5)
    s.load_state_dict({**s.state_dict(), "position": 3})
    iter(s)
    assert s.state_dict()["position"] == 3
    assert _ids(iter(s)) == ref[3:]
    t = gl.GadgetSampler(30, batch_size=4, seed=5)
    it = iter(t)
    t.load_state_dict({**t.state_dict(), "position": 5})
    assert _ids(it) == ref[5:]


def test_resume_through_a_dataloader_with_workers() -> None:
    ds = gl.GadgetDataset(np.arange(40, dtype=np.float32), device="cpu")
    ref = [
        b[0].tolist()
        for b in torch.utils.data.DataLoader(
            ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, seed=2)
        )
    ]
    s = gl.GadgetSampler(ds, batch_size=4, seed=2)
    s.load_state_dict({**s.state_dict(), "position": 6})
    dl = torch.utils.data.DataLoader(ds, batch_sampler=s, num_workers=2)
    assert [b[0].tolist() for b in dl] == ref[6:]


# ---- the drop-in modules' default placement ------------------------------------------------
@pytest.mark.parametrize("cls", [gl.OffloadedEmbedding, gl.OffloadedEmbeddingBag])
def test_default_placement(cls: type) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning for the default
        m = cls(8, 3)
    assert m.placement == ("pinned" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("cls", [gl.OffloadedEmbedding, gl.OffloadedEmbeddingBag])
def test_default_placement_without_cuda_is_silent(cls: type, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = cls(8, 3, device="cpu")
    assert m.placement == "cpu"
    with pytest.warns(gl.FallbackWarning, match="needs CUDA"):
        assert cls(8, 3, placement="pinned", device="cpu").placement == "cpu"


# ---- empty offsets -----------------------------------------------------------------------------
def test_bag_empty_offsets_with_an_empty_input_is_no_bags(placement: str, device) -> None:
    bag = gl.OffloadedEmbeddingBag(6, 4, mode="sum", placement=placement, device=device)
    ref = torch.nn.EmbeddingBag(6, 4, mode="sum").to(device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    out = bag(empty, empty)
    assert tuple(out.shape) == tuple(ref(empty, empty).shape) == (0, 4)
    before = bag.table.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError, match="at least one bag start for an input of 2 ids"):
        bag(torch.tensor([1, 2], device=device), empty)
    last = gl.OffloadedEmbeddingBag(
        6, 4, mode="sum", placement=placement, device=device, include_last_offset=True
    )
    with pytest.raises(gl.GadgetValueError, match="the end too"):
        last(empty, empty)
    np.testing.assert_array_equal(bag.table.getNumpyVersion(), before)


# ---- file options of the wrong kind ------------------------------------------------------------
@pytest.mark.parametrize(
    "options,exc",
    [
        ({"cache_bytes": "1"}, gl.GadgetTypeError),
        ({"cache_bytes": None}, gl.GadgetTypeError),
        ({"cache_bytes": True}, gl.GadgetTypeError),
        ({"cache_bytes": -1}, gl.GadgetValueError),
        ({"block_rows": 2.0}, gl.GadgetTypeError),
        ({"block_rows": 0}, gl.GadgetValueError),
    ],
)
def test_file_options_kind_and_range(tmp_path, options: dict, exc: type) -> None:
    path = tmp_path / "t.npy"
    np.save(path, np.ones((3, 2), np.float32))
    with pytest.raises(exc, match=next(iter(options))):
        gl.DataGadget(str(path), placement="file", **options)
    g = gl.DataGadget(str(path), placement="file", cache_bytes=np.int64(0), block_rows=np.int32(2))
    np.testing.assert_array_equal(
        g.getData([2, 0], device="cpu").numpy(), np.ones((2, 2), np.float32)
    )
    g.close()


# ---- CUDA columns delivered to the CPU in the main process ------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["default", "batch_sampler", "loader"])
def test_cuda_columns_delivered_to_the_cpu(form: str) -> None:
    """``device='cpu'`` over columns in GPU memory: a GPU gather, then a copy (the refusal
    is for DataLoader workers, which must not touch CUDA)."""
    x = torch.arange(37 * 3, dtype=torch.float32, device="cuda").reshape(37, 3)
    y = torch.arange(37, device="cuda") * 7
    ds = gl.GadgetDataset(x, y, device="cpu")
    assert [g.placement for g in ds.columns] == ["cuda", "cuda"]
    if form == "default":
        batches = list(torch.utils.data.DataLoader(ds, batch_size=8))
        order = torch.arange(37)
    elif form == "batch_sampler":
        s = gl.GadgetSampler(ds, batch_size=8, seed=4)
        batches = list(torch.utils.data.DataLoader(ds, batch_sampler=s))
        order = s.epoch_order(0)
    else:
        batches = list(gl.GadgetLoader(ds, batch_size=8, order="sequential"))
        order = torch.arange(37)
    assert [len(b[0]) for b in batches] == [8, 8, 8, 8, 5]
    got_x = torch.cat([b[0] for b in batches])
    got_y = torch.cat([b[1] for b in batches])
    assert got_x.device.type == got_y.device.type == "cpu"
    assert torch.equal(got_x, x.cpu()[order]) and torch.equal(got_y, y.cpu()[order])
