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
    assert result["verified"] == {"gpu": True, "switchers": True, "dropin": True}
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
