"""Pipeline checks found in review: sampler ids changed in place, argument and state checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gadgetloader as gl


@pytest.mark.parametrize("placement", ["file", "cpu"])
def test_sampler_ids_changed_through_numpy_are_still_checked(
    tmp_path: Path, placement: str
) -> None:
    p = tmp_path / "ten.npy"
    np.save(p, np.arange(40, dtype=np.float32).reshape(10, 4))
    ds = gl.GadgetDataset(p, placement=placement, device="cpu")
    for bad in (-1, 10, 12345):
        batch = next(iter(gl.GadgetSampler(ds, batch_size=4, order="sequential")))
        batch.numpy()[0] = bad  # keeps the sampler's tag
        with pytest.raises(gl.GadgetIndexError, match="10 rows"):
            ds.__getitems__(batch)
    ok = next(iter(gl.GadgetSampler(ds, batch_size=4, order="sequential")))
    np.testing.assert_array_equal(ds[ok][0].numpy(), np.arange(16, dtype=np.float32).reshape(4, 4))


def test_sampler_takes_a_numpy_row_count() -> None:
    s = gl.GadgetSampler(np.int64(10), batch_size=3, order="sequential")
    assert [b.tolist() for b in s] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_seeds_must_fit_64_bits() -> None:
    gl.GadgetSampler(10, batch_size=3, seed=2**64 - 1)
    with pytest.raises(gl.GadgetValueError, match="2\\*\\*64"):
        gl.GadgetSampler(10, batch_size=3, seed=2**64 + 5)


def test_a_rejected_state_changes_nothing() -> None:
    s = gl.GadgetSampler(50, batch_size=5, seed=4)
    before = s.state_dict()
    bad = dict(before, seed=9, epoch=-1)
    with pytest.raises(gl.GadgetError):
        s.load_state_dict(bad)
    assert s.state_dict() == before
    for key in ("seed", "epoch"):
        partial = {k: v for k, v in before.items() if k != key}
        with pytest.raises(gl.GadgetValueError, match=key):
            s.load_state_dict(partial)
    assert s.state_dict() == before


def test_file_options_without_a_file_column_are_refused() -> None:
    with pytest.raises(gl.GadgetTypeError, match="bogus"):
        gl.GadgetDataset(np.ones(4), bogus=1, device="cpu")
