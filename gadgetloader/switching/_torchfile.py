"""``saveTorch`` / ``loadTorch`` files (SpeedTorch's names): atomic writes, checked reads."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import GadgetFileError, GadgetFileNotFoundError, GadgetValueError
from ..io._atomic import remove_path, replace_atomically, temp_path_beside

__all__ = ["load_torch_file", "save_torch_file"]


def save_torch_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` written beside ``path`` and renamed over it, so a save
    that fails part-way leaves any previous file whole."""
    target = os.fspath(path)
    if os.path.isdir(target):
        raise GadgetValueError(f"saveTorch needs a file path; {target} is a directory")
    tmp = temp_path_beside(target)
    try:
        torch.save(obj, tmp)
        replace_atomically(tmp, target)
    except BaseException:
        remove_path(tmp)
        raise


def load_torch_file(path: str | os.PathLike[str]) -> Any:
    """What ``torch.save`` wrote to ``path`` (tensors and containers only, on the CPU)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise GadgetFileNotFoundError(f"{p} does not exist")
    if not os.path.isfile(p):
        raise GadgetFileError(f"{p} is not a file (expected one written by saveTorch)")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise GadgetFileError(
            f"{p} is not a torch.save file this table can read ({type(exc).__name__}: {first})"
        ) from exc


def check_tensor(t: Any, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``t`` if it is a tensor of ``shape`` and ``dtype``, else a clear error."""
    from .._dtypes import dtype_name

    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise GadgetValueError(
            f"{what} holds {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}; "
            f"expected a tensor of shape {shape}"
        )
    if t.dtype != dtype:
        raise GadgetValueError(
            f"{what} holds a {dtype_name(t.dtype)} tensor; expected {dtype_name(dtype)} "
            "(the table's dtype)"
        )
    return t
