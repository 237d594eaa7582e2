"""Shared fixtures: every behaviour test runs over every placement.

``cpu`` runs everywhere; ``cuda`` and ``pinned`` carry the ``gpu`` marker and skip,
with a reason, where no CUDA device (or, for ``pinned``, no CuPy) is present.
"""

from __future__ import annotations

import signal

import pytest
import torch

from gadgetloader._device import _reset_fallback_warnings, cupy_available

HAS_CUDA = torch.cuda.is_available()
NEEDS_GPU = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
NEEDS_CUPY = pytest.mark.skipif(
    not (HAS_CUDA and cupy_available()), reason="needs a CUDA device and CuPy"
)


def pytest_configure(config: pytest.Config) -> None:
    """A run started in the background of a non-interactive shell (``cmd &``) inherits an
    ignored SIGINT, and Python then installs no KeyboardInterrupt handler: the Ctrl-C probes
    (a save interrupted mid-way, ``convert`` exiting 130) need Ctrl-C to work as it does in
    a terminal, here and in the processes the tests start."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(NEEDS_GPU)


#: in-memory placements; the file-backed ones are added by the files suite
MEMORY_PLACEMENTS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, NEEDS_GPU]),
    pytest.param("pinned", id="pinned", marks=[pytest.mark.gpu, NEEDS_CUPY]),
]


@pytest.fixture(params=MEMORY_PLACEMENTS)
def placement(request: pytest.FixtureRequest) -> str:
    """Each in-memory placement in turn."""
    return str(request.param)


@pytest.fixture
def device() -> torch.device:
    """Where gathered rows arrive: the GPU where present, else the CPU."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings() -> None:
    _reset_fallback_warnings()
