"""Where work runs: CUDA detection, the CPU fallback, lazy CuPy, stream interop."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._errors import FallbackWarning, GadgetKeyError, GadgetTypeError, MissingDependencyError

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "PLACEMENTS",
    "cuda_available",
    "default_device",
    "get_cupy",
    "cupy_available",
    "resolve_placement",
    "resolve_device",
    "user_stacklevel",
    "warn_fallback",
]

#: every placement a store can have; ``file`` reads rows from a file on demand
PLACEMENTS: tuple[str, ...] = ("cpu", "cuda", "file", "pinned")

_warned: set[str] = set()


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The device batches are delivered to: the current CUDA device, else the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: Any) -> torch.device:
    """``None`` -> :func:`default_device`; ``'cuda'`` -> the current CUDA device (or the CPU
    with one warning where CUDA is missing); anything else as ``torch.device``."""
    if device is None:
        return default_device()
    if isinstance(device, (bool, np.bool_)) or not isinstance(
        device, (str, int, np.integer, torch.device)
    ):
        raise GadgetTypeError(
            f"device must be a torch.device, a string or a CUDA index; got {type(device).__name__}"
        )
    if isinstance(device, (int, np.integer)):
        device = int(device)
        if device < 0:
            raise GadgetTypeError(f"unsupported device {device!r}; a CUDA index is >= 0")
        device = f"cuda:{device}"  # a CUDA index, as torch reads it on a CUDA machine
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise GadgetTypeError(
            f"unsupported device {device!r}; expected 'cuda', 'cuda:N' or 'cpu'"
        ) from exc
    if dev.type == "cuda":
        if not cuda_available():
            warn_fallback(
                "cuda",
                f"device {str(dev)!r} requested but CUDA is not available: tables live in "
                "ordinary host RAM and every operation runs on the CPU with the same results",
            )
            return torch.device("cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if dev.type != "cpu":
        raise GadgetTypeError(
            f"unsupported device {str(dev)!r}; expected 'cuda', 'cuda:N' or 'cpu'"
        )
    return dev


def warn_fallback(key: str, message: str) -> None:
    """Warn once per process and ``key`` that a slower path is in use."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, FallbackWarning, stacklevel=user_stacklevel())


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller point at the first
    frame outside gadgetloader: the user's line, however deep inside the package the
    warning arose (e.g. a store resolving its placement for ``DataGadget``)."""
    frame = sys._getframe(1)  # the function that will call warnings.warn
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def _reset_fallback_warnings() -> None:
    """Forget which fallbacks were announced (for tests)."""
    _warned.clear()


def resolve_placement(placement: str) -> str:
    """Validate a placement name and apply the CPU fallback.

    Raises
    ------
    GadgetKeyError
        For a name that is not a placement (any case: ``'CPU'`` is ``'cpu'``); the
        message lists the valid ones.
    GadgetTypeError
        For a placement that is not a string.
    """
    if not isinstance(placement, str):
        raise GadgetTypeError(
            f"placement must be a string, one of {list(PLACEMENTS)}; got "
            f"{type(placement).__name__} {placement!r:.40}"
        )
    if placement.lower() not in PLACEMENTS:
        raise GadgetKeyError(f"Unknown placement {placement!r}; expected one of {list(PLACEMENTS)}")
    placement = placement.lower()
    if placement in ("cuda", "pinned") and not cuda_available():
        warn_fallback(
            "cuda",  # one warning per process for every CUDA fallback
            f"placement {placement!r} needs CUDA, which is not available: tables live in "
            "ordinary host RAM ('cpu') and every operation runs on the CPU with the same results",
        )
        return "cpu"
    return placement


@functools.lru_cache(maxsize=1)
def _import_cupy() -> ModuleType | None:
    try:
        import cupy
    except Exception:  # ImportError, or a CuPy that cannot find its CUDA libraries
        return None
    return cupy


def cupy_available() -> bool:
    """True when CuPy imports (it does not need a GPU to import)."""
    return _import_cupy() is not None


def get_cupy(feature: str) -> ModuleType:
    """Import CuPy for ``feature`` or raise an error naming the pip extra."""
    cp = _import_cupy()
    if cp is None:
        raise MissingDependencyError(
            f"{feature} requires CuPy, which is not installed; install it with "
            "pip install 'gadgetloader[cuda12]' (CUDA 12) or 'gadgetloader[cuda13]' (CUDA 13) "
            "(from a checkout: pip install -e '.[cuda12]'; or pip install cupy-cuda12x / "
            "cupy-cuda13x)"
        )
    return cp


_streams: dict[int, Any] = {}


class _StreamHandle:
    """A raw CUDA stream handle in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(device: torch.device) -> Any:
    """A CuPy view of torch's current stream on ``device`` (cached per stream)."""
    cp = get_cupy("GPU kernels")
    handle = torch.cuda.current_stream(device).cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        stream = None
        from_external = getattr(cp.cuda.Stream, "from_external", None)
        if from_external is not None:  # CuPy >= 14: the CUDA stream protocol
            try:
                stream = from_external(_StreamHandle(handle))
            except Exception:
                stream = None
        if stream is None:  # CuPy 13 (deprecated from CuPy 14 on, hence the filter)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cp.cuda.ExternalStream(
                    handle, device.index if device.index is not None else 0
                )
        _streams[handle] = stream
    return stream


def pinned_empty(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked buffer kept across calls. Made outside inference mode: a buffer first
    made under ``torch.inference_mode`` would be an inference tensor, which nothing may
    write outside that mode later."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, pin_memory=True)
