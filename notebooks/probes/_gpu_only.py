"""Imported first by the probes that measure the GPU: on a machine without CUDA or CuPy
they stop here with one line (exit status 1) instead of a traceback, and before allocating
any table."""

from __future__ import annotations

import sys


def _usable() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - a missing or broken install says the same
        return False
    return True


if not _usable():
    sys.exit("this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine")
