"""Epoch bookkeeping found in review: a sampler's own set_epoch / load_state_dict win over a
GadgetLoader's restart after an early break; a bare sampler moves on after its last batch."""

from __future__ import annotations

from itertools import islice

import numpy as np
from torch.utils.data import DataLoader

import gadgetloader as gl


def _ds() -> gl.GadgetDataset:
    return gl.GadgetDataset(np.arange(100.0), placement="cpu", device="cpu")


def _firsts(batches: list) -> list[list[float]]:
    return [b[0].tolist() for b in batches]


def test_sampler_set_epoch_wins_after_an_early_break() -> None:
    ds = _ds()
    sampler = gl.GadgetSampler(ds, batch_size=10, seed=0)
    loader = gl.GadgetLoader(ds, sampler=sampler)
    seen = []
    for epoch in range(3):
        sampler.set_epoch(epoch)  # the DDP idiom: the sampler, not the loader
        seen.append(_firsts(list(islice(iter(loader), 3))))
    want = []
    for epoch in range(3):
        ref = gl.GadgetSampler(ds, batch_size=10, seed=0)
        ref.set_epoch(epoch)
        want.append([ds[b][0].tolist() for b in islice(iter(ref), 3)])
    assert seen == want
    assert seen[0] != seen[1] != seen[2]


def test_sampler_load_state_dict_wins_after_an_early_break() -> None:
    ds = _ds()
    full = _firsts(list(gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=10, seed=3))))
    sampler = gl.GadgetSampler(ds, batch_size=10, seed=3)
    loader = gl.GadgetLoader(ds, sampler=sampler)
    it = iter(loader)
    head = [next(it) for _ in range(4)]
    state = loader.state_dict()["sampler"]
    list(islice(it, 2))  # read on, then rewind the sampler itself
    sampler.load_state_dict(state)
    tail = _firsts(list(loader))
    assert _firsts(head) + tail == full


def test_loader_restart_after_an_early_break_is_unchanged() -> None:
    ds = _ds()
    loader = gl.GadgetLoader(ds, batch_size=10, seed=1)
    first = _firsts(list(islice(iter(loader), 3)))
    again = _firsts(list(islice(iter(loader), 3)))
    assert first == again  # an unfinished epoch restarts, as before


def test_bare_sampler_moves_on_after_its_last_batch() -> None:
    ds = _ds()
    s = gl.GadgetSampler(ds, batch_size=8, seed=0)
    dl = DataLoader(ds, batch_sampler=s)
    epochs = []
    for _ in range(3):
        epochs.append([b[0].tolist() for _, b in zip(range(len(dl)), dl, strict=False)])
        # zip stops without asking the sampler for one more batch
    assert s.epoch == 3
    assert epochs[0] != epochs[1] != epochs[2]
    for e, got in enumerate(epochs):
        ref = gl.GadgetSampler(ds, batch_size=8, seed=0)
        ref.set_epoch(e)
        assert got == [ds[b][0].tolist() for b in ref]
    state = s.state_dict()  # the last epoch, all handed out (what StatefulDataLoader saves)
    assert (state["epoch"], state["position"]) == (2, len(s))
    fresh = gl.GadgetSampler(ds, batch_size=8, seed=0)
    fresh.load_state_dict(state)
    assert list(fresh) == []  # the rest of epoch 2 is empty ...
    ref = gl.GadgetSampler(ds, batch_size=8, seed=0)
    ref.set_epoch(3)
    assert [b.tolist() for b in fresh] == [b.tolist() for b in ref]  # ... then epoch 3


def test_a_sampler_saved_after_its_last_batch_resumes_into_the_next_epoch() -> None:
    ds = _ds()
    s = gl.GadgetSampler(ds, batch_size=30, seed=2)
    it = iter(s)
    for _ in range(len(s)):
        next(it)
    assert s.epoch == 1  # every batch of epoch 0 was handed out
    ref = gl.GadgetSampler(ds, batch_size=30, seed=2)
    ref.set_epoch(1)
    want = [b.tolist() for b in ref]
    fresh = gl.GadgetSampler(ds, batch_size=30, seed=2)
    fresh.load_state_dict(s.state_dict())
    assert list(fresh) == []  # a resumed pass: the rest of epoch 0, which is empty
    assert [b.tolist() for b in fresh] == want
    assert [b.tolist() for b in s] == want  # the live sampler moves on by itself
