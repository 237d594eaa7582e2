"""GadgetLoader's coalesced gathers hand out exactly the batches of the plain form."""

from __future__ import annotations

import pytest
import torch

import gadgetloader as gl


def _batches(loader: gl.GadgetLoader) -> list[list[torch.Tensor]]:
    return [[t.detach().cpu().clone() for t in b] for b in loader]


@pytest.mark.parametrize("k", [2, 3, 8, 100])
def test_coalesced_equals_plain(placement: str, device: torch.device, k: int) -> None:
    x = torch.randn(103, 5)
    y = torch.arange(103)
    ds = gl.GadgetDataset(x, y, placement=placement, device=device)
    plain = _batches(gl.GadgetLoader(ds, batch_size=10, seed=4, coalesce=1))
    merged = _batches(gl.GadgetLoader(ds, batch_size=10, seed=4, coalesce=k))
    assert len(plain) == len(merged) == 11
    for p, m in zip(plain, merged, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(p, m, strict=True))
    seen = torch.cat([b[1] for b in merged])
    assert sorted(seen.tolist()) == list(range(103))  # every row once per epoch
    assert all(torch.equal(b[0], x[b[1]]) for b in merged)


def test_coalesced_resume_matches(device: torch.device) -> None:
    ds = gl.GadgetDataset(torch.arange(200.0), placement="cpu", device=device)
    full = _batches(gl.GadgetLoader(ds, batch_size=16, seed=1, coalesce=4))
    loader = gl.GadgetLoader(ds, batch_size=16, seed=1, coalesce=4)
    it = iter(loader)
    head = [[t.cpu().clone() for t in next(it)] for _ in range(5)]  # mid-group
    state = loader.state_dict()
    again = gl.GadgetLoader(ds, batch_size=16, seed=1, coalesce=4)
    again.load_state_dict(state)
    tail = _batches(again)
    assert [h[0].tolist() for h in head + tail] == [f[0].tolist() for f in full]


def test_coalesce_needs_no_workers() -> None:
    ds = gl.GadgetDataset(torch.arange(20.0), placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetValueError, match="num_workers=0"):
        gl.GadgetLoader(ds, batch_size=4, coalesce=2, num_workers=2)
    with pytest.raises(gl.GadgetError):
        gl.GadgetLoader(ds, batch_size=4, coalesce=0)
