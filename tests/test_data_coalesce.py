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


def test_default_coalesce_is_bounded_by_bytes_and_count() -> None:
    from gadgetloader.data._loader import (
        COALESCE_BYTES,
        COALESCE_MAX,
        COALESCE_MAX_OTHER,
        default_coalesce,
    )

    assert default_coalesce(4096 * 512) == min(COALESCE_MAX, COALESCE_BYTES // (4096 * 512))
    assert default_coalesce(1) == COALESCE_MAX
    assert default_coalesce(COALESCE_BYTES // 3) == 3
    assert default_coalesce(4 * COALESCE_BYTES) == 1
    assert default_coalesce(0) == COALESCE_MAX
    assert default_coalesce(1, in_place=False) == COALESCE_MAX_OTHER < COALESCE_MAX
    assert default_coalesce(COALESCE_BYTES // 3, in_place=False) == 3


def test_default_coalesce_follows_the_device_and_route(
    placement: str, device: torch.device
) -> None:
    from gadgetloader.data._loader import default_coalesce

    x = torch.randn(300, 64)
    ds = gl.GadgetDataset(x, torch.arange(300), placement=placement, device=device)
    loader = gl.GadgetLoader(ds, batch_size=40, seed=2)
    in_place = all(r == "kernel" for r in ds._routes())
    want = default_coalesce(40 * ds.row_nbytes, in_place) if device.type == "cuda" else 1
    assert loader._coalesce == want
    assert gl.GadgetLoader(ds, batch_size=40, num_workers=1)._coalesce == 1
    got = _batches(loader)
    plain = _batches(gl.GadgetLoader(ds, batch_size=40, seed=2, coalesce=1))
    assert len(got) == len(plain) == 8
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, plain, strict=True)
    )
