"""``gadgetloader info``: what a bug report needs -- versions, GPU, link bandwidth."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

import torch

__all__ = ["collect_info", "format_info"]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_info(*, measure: bool = True) -> dict[str, Any]:
    """Versions of gadgetloader and its dependencies, the GPU, and (with ``measure``)
    the pinned memcpy bandwidth host->device and device->host."""
    from . import __version__
    from ._device import cupy_available

    info: dict[str, Any] = {
        "gadgetloader": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (a CPU build of torch)",
        "numpy": _version("numpy"),
        "h5py": _version("h5py"),
        "zarr": _version("zarr"),
        "tqdm": _version("tqdm"),
        "cupy": None,
        "cuda_available": torch.cuda.is_available(),
    }
    if cupy_available():
        import cupy

        info["cupy"] = cupy.__version__
        try:
            info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        except Exception as exc:  # no driver
            info["cuda_runtime"] = f"unavailable ({type(exc).__name__})"
    if not torch.cuda.is_available():
        info["gpu"] = "none found: tables live in host RAM and every operation runs on the CPU"
    else:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = {
            "name": props.name,
            "memory_GiB": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "compute_capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        }
        if measure:
            from .bench._common import measure_memcpy

            info["pinned_memcpy"] = measure_memcpy(1 << 30)
    return info


def format_info(info: dict[str, Any]) -> str:
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            inner = ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items()
            )
            lines.append(f"{key:>16}: {inner}")
        else:
            lines.append(f"{key:>16}: {value if value is not None else 'not installed'}")
    return "\n".join(lines)
