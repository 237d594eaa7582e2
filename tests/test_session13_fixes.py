"""Regression tests for the defects fixed in session 13."""

from __future__ import annotations

import torch

from gadgetloader.switching._rows import _fingerprint


def test_plans_of_inference_tensors_off_the_cpu_are_never_cached():
    """A non-CPU inference tensor has no version counter: its fingerprint is None (never
    cache), where reading ``_version`` used to raise (an eval lookup under
    ``torch.inference_mode`` with CUDA ids). The meta device stands in for CUDA here."""
    with torch.inference_mode():
        ids = torch.empty(6, dtype=torch.int64, device="meta")
    assert ids.is_inference()
    assert _fingerprint(ids) is None
    normal = torch.empty(6, dtype=torch.int64, device="meta")
    fp = _fingerprint(normal)
    assert fp is not None and fp[0] == normal._version
