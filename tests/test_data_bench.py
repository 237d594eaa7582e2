"""The pipeline benchmark runs at a tiny size and reports sane, checked results."""

from __future__ import annotations

import argparse

import pytest

from gadgetloader.bench import _pipeline


def test_pipeline_bench_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    _pipeline.add_arguments(parser)
    args = parser.parse_args(
        [
            "--rows",
            "3000",
            "--width",
            "8",
            "--batch",
            "256",
            "--batches",
            "6",
            "--seconds",
            "0.5",
            "--repeats",
            "1",
            "--workers",
            "0",
        ]
    )
    report = _pipeline.run(args)
    out = capsys.readouterr().out
    assert "pipeline benchmark" in out and "(c) DataLoader + GadgetSampler" in out
    assert "us/batch" in out
    methods = {(r["source"], r["method"]) for r in report["results"]}
    assert ("npy mmap", "(a) torch per-sample DataLoader") in methods
    memory = [r for r in report["results"] if r["source"].startswith("memory")]
    assert {m["method"][:3] for m in memory} == {"(b)", "(c)", "(c1", "(d)", "(e)"}
    assert any("coalesce=1" in m["method"] for m in memory)
    routes = report["routes"]
    memory_label = next(k for k in routes if k.startswith("memory"))
    assert routes[memory_label] == (["kernel"] if "pinned" in memory_label else ["host"])
    assert all(v is None or v > 0 for v in report["sampler_us_per_batch"].values())
    assert report["sampler_us_per_batch"]["torch RandomSampler + BatchSampler"] > 0
    # torch's sampler alone, as a multiple of the fast form's time a batch
    fast_us = next(r["us_per_batch"] for r in memory if r["method"].startswith("(c)"))
    ratio = report["summary"]["torch_sampler_vs_fast"]
    assert ratio == pytest.approx(
        report["sampler_us_per_batch"]["torch RandomSampler + BatchSampler"] / fast_us, rel=0.5
    )
    assert "column routes:" in out
    for r in report["results"]:
        assert r["check"] == "ok", r
        assert r["rows_per_s"] > 0 and r["GBps"] > 0
        # one run's per-batch time and its rate agree (full batches of 256 rows)
        assert r["us_per_batch"] == pytest.approx(256 / r["rows_per_s"] * 1e6, rel=0.5)
    summary = report["summary"]
    assert summary["best_torch_workers"] == 0
    assert summary["memory_fast_x_torch"] > 1  # one gather per batch beats per-sample Python
    assert summary["memory_default_vs_fast"] > 0
    if not report["link"]:
        assert summary["memory_fast_of_limit"] is None


def test_pipeline_bench_rejects_bad_sizes() -> None:
    parser = argparse.ArgumentParser()
    _pipeline.add_arguments(parser)
    with pytest.raises(ValueError, match="width"):
        _pipeline.run(parser.parse_args(["--width", "2"]))
