"""``saveTorch`` / ``loadTorch`` files (SpeedTorch's names): atomic writes, checked reads."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import (
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetTypeError,
    GadgetValueError,
    ReadOnlyError,
)
from .._paths import as_path
from ..io._atomic import remove_path, replace_atomically, resolved_target, temp_path_beside
from ..io._chunks import save_errors

__all__ = ["check_tensor", "load_torch_file", "save_torch_file", "table_tensor"]


def save_torch_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` written beside ``path`` and renamed over it, so a save
    that fails part-way leaves any previous file whole."""
    target = as_path(path)
    if os.path.isdir(target):
        raise GadgetValueError(f"saveTorch needs a file path; {target} is a directory")
    folder = as_path(resolved_target(os.path.abspath(target)).parent)  # a link: its file's
    if not os.path.isdir(folder):
        raise GadgetFileNotFoundError(
            f"directory {folder} does not exist (saving {target})", folder
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ReadOnlyError(f"cannot save {target}: the directory {folder} is not writable")
    tmp = temp_path_beside(target)
    try:
        with save_errors(target, "write the torch.save file"):
            try:
                torch.save(obj, tmp)
            except RuntimeError as exc:
                # a full disk or a file size limit: torch's zip writer raises a RuntimeError
                # (out-of-memory and CUDA errors pass as they are)
                if not _write_failure(exc):
                    raise
                raise GadgetFileError(
                    f"cannot save {target}: cannot write the torch.save file ({exc})"
                ) from exc
        replace_atomically(tmp, target)
    except BaseException:
        remove_path(tmp)
        raise


def _write_failure(exc: RuntimeError) -> bool:
    """Whether torch's writer raised ``exc`` because the file could not be written."""
    if type(exc).__name__ == "OutOfMemoryError":
        return False
    text = str(exc)
    return any(
        mark in text for mark in ("inline_container", "PytorchStreamWriter", "file write failed")
    )


def load_torch_file(path: str | os.PathLike[str]) -> Any:
    """What ``torch.save`` wrote to ``path`` (tensors and containers only, on the CPU)."""
    p = as_path(path)
    if not os.path.exists(p):
        raise GadgetFileNotFoundError(f"{p} does not exist", p)
    if not os.path.isfile(p):
        raise GadgetFileError(f"{p} is not a file (expected one written by saveTorch)")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise GadgetFileError(
            f"{p} is not a torch.save file this table can read ({type(exc).__name__}: {first})"
        ) from exc


def table_tensor(table: Any) -> torch.Tensor:
    """A DataGadget's rows as a compact CPU tensor of its own dtype (bfloat16 included)."""
    rows = table.store.read_block(0, len(table))
    out = torch.empty(tuple(rows.shape), dtype=rows.dtype)  # never a view of a shared buffer
    out.copy_(rows)
    return out


def check_tensor(t: Any, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a tensor of ``shape`` and ``dtype``, else a clear error. Another floating dtype
    is accepted when every value converts exactly (a float32 file of a bfloat16 table)."""
    from .._dtypes import dtype_name

    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise GadgetValueError(
            f"{what} holds {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}; "
            f"expected a tensor of shape {shape}"
        )
    if t.dtype == dtype:
        return t
    if t.is_floating_point() and dtype.is_floating_point:
        cast = t.to(dtype)
        back = cast.to(t.dtype)
        # NaN converts exactly too (but is unequal to itself)
        if bool(((back == t) | (torch.isnan(back) & torch.isnan(t))).all()):
            return cast
    raise GadgetTypeError(
        f"{what} holds a tensor of dtype {dtype_name(t.dtype)}; expected {dtype_name(dtype)} "
        "(the table's dtype; another float dtype is taken only where every value converts "
        "exactly, an integer or bool one never)"
    )
