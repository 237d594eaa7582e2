"""``gadgetloader bench train`` runs in seconds at tiny sizes and reports every method."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from gadgetloader.bench import _train


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    _train.add_arguments(p)
    return p.parse_args(
        [
            "--rows",
            "3000",
            "--dim",
            "8",
            "--batch",
            "64",
            "--negatives",
            "3",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--repeats",
            "2",
            "--memcpy-mib",
            "16",
            *extra,
        ]
    )


def test_defaults_match_the_issue():
    p = argparse.ArgumentParser()
    _train.add_arguments(p)
    a = p.parse_args([])
    assert (a.rows, a.dim, a.batch, a.negatives, a.placement) == (
        10_000_000,
        128,
        4096,
        5,
        "pinned",
    )


def test_tiny_run_reports_every_method():
    result = _train.run(_args())
    json.dumps(result)  # JSON-able for --json
    assert set(result["methods"]) == set(_train.METHODS)
    for name, e in result["methods"].items():
        assert e["ms_per_step"] > 0 and e["steps_per_s"] > 0, name
    # merged duplicates never move more rows than one row per position
    assert (
        result["methods"]["switchers"]["bytes_per_step"]
        <= result["methods"]["speedtorch"]["bytes_per_step"]
    )
    assert (
        result["methods"]["switchers"]["bytes_per_step"]
        == result["methods"]["dropin"]["bytes_per_step"]
    )
    assert result["verified"] == {"gpu": "reference", "switchers": True, "dropin": True}
    # the resident bound moves nothing and is no table: never cross-checked
    assert result["methods"]["resident"]["bytes_per_step"] == 0
    assert result["dropin_x_resident"] == pytest.approx(
        result["methods"]["dropin"]["ms_per_step"] / result["methods"]["resident"]["ms_per_step"]
    )
    if torch.cuda.is_available():
        assert result["memcpy"]["h2d_GBps"] > 0
        assert result["methods"]["switchers"]["floor_ms"] > 0
    else:
        assert result["memcpy"] is None and any("no CUDA" in s for s in result["skipped"])
    text = _train.format_report(result)
    assert "switchers" in text and "ms/step" in text


def test_method_subset_and_errors():
    result = _train.run(_args("--methods", "dropin", "--zipf", "0"))
    assert list(result["methods"]) == ["dropin"]
    with pytest.raises(ValueError, match="unknown --methods"):
        _train.run(_args("--methods", "gpu,magic"))


def test_resident_bound_uses_each_batchs_own_rows():
    """The resident bound indexes scratch tables by each batch's local ids: the distinct
    ids of the batch, in a table as large as the largest batch's distinct rows."""
    args = _args()
    dev = torch.device("cpu")
    batches = _train._batches(args, dev, 4)
    m = _train._BUILDERS["resident"](args, dev)
    m.prepare(batches)
    for b in batches:
        center, context, neg = b
        local_u, local_v, uniq_v = m.plans[id(b)]
        ids_v = torch.cat([context.unsqueeze(1), neg], dim=1)
        assert torch.equal(uniq_v[local_v], ids_v)
        assert int(local_u.max()) < m.u.shape[0] and int(local_v.max()) < m.v.shape[0]
        assert local_u.shape == center.shape and local_v.shape == ids_v.shape
    assert m.v.shape[0] == max(
        torch.unique(torch.cat([b[1], b[2].reshape(-1)])).numel() for b in batches
    )
    before = m.v.detach().clone()
    m.step(batches[0])
    moved = (m.v.detach() != before).any(1)
    # Adam moves exactly the rows the batch used (the others have zero gradient, zero state)
    assert moved.sum().item() == torch.unique(m.plans[id(batches[0])][1]).numel()
