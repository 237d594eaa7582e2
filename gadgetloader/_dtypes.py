"""Dtype names: one table that maps strings, NumPy and torch dtypes to a torch dtype."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._errors import GadgetTypeError

__all__ = [
    "SUPPORTED_DTYPES",
    "as_torch_dtype",
    "numpy_dtype",
    "dtype_name",
    "host_tensor",
    "plain_items",
]

#: torch dtype -> the NumPy dtype with the same bytes (bfloat16 has none: its bits travel as uint16)
_NUMPY_OF: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(np.uint16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_NUMPY_OF)

_BY_NAME: dict[str, torch.dtype] = {
    dtype_str: dt for dt in SUPPORTED_DTYPES for dtype_str in (str(dt).removeprefix("torch."),)
}
_BY_NAME.update(
    {
        "float": torch.float32,
        "double": torch.float64,
        "half": torch.float16,
        "long": torch.int64,
        "int": torch.int32,
        "short": torch.int16,
        "byte": torch.uint8,  # torch's meaning (NumPy's 'byte' is int8)
        "char": torch.int8,
        "bool_": torch.bool,
    }
)
_TORCH_OF_NUMPY: dict[np.dtype, torch.dtype] = {
    v: k for k, v in _NUMPY_OF.items() if k is not torch.bfloat16
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``'float32'``."""
    return str(dtype).removeprefix("torch.")


def as_torch_dtype(dtype: Any) -> torch.dtype:
    """Turn a string (``'float32'``), NumPy dtype or type, or torch dtype into a supported torch dtype.

    A name means what it means in torch where torch and NumPy differ: ``'float'`` is
    float32 (``torch.float``), ``'int'`` int32, ``'byte'`` uint8, ``'char'`` int8,
    ``'torch.float16'`` float16. Python's own types mean what they mean to both:
    ``float`` is float64, ``int`` int64, ``bool`` bool. Other names are NumPy's (``'f4'``,
    ``'<i8'``, ``'single'``).

    Raises
    ------
    GadgetTypeError
        For object, string, complex and other dtypes a table cannot hold.
    """
    if isinstance(dtype, torch.dtype):
        result = dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in _BY_NAME:
        result = _BY_NAME[dtype.removeprefix("torch.")]
    elif not isinstance(dtype, (type, np.dtype)) and hasattr(
        dtype, "shape"
    ):  # tensor, array, table
        raise GadgetTypeError(
            f"dtype must be a dtype or its name (e.g. 'float32' or torch.float32); got a "
            f"{type(dtype).__name__} -- pass its .dtype for the dtype of that data"
        )
    else:
        try:
            npd = np.dtype(dtype)
        except (TypeError, ValueError) as exc:
            raise GadgetTypeError(
                f"unknown dtype {dtype!r}; expected one of {sorted(_BY_NAME)}"
            ) from exc
        if npd.name == "bfloat16":  # ml_dtypes.bfloat16
            return torch.bfloat16
        if npd.byteorder == ">":
            npd = npd.newbyteorder("=")
        result = _TORCH_OF_NUMPY.get(npd)  # type: ignore[assignment]
        if result is None:
            hint = ""
            if npd.kind == "u":
                wider = {2: "int32", 4: "int64"}.get(npd.itemsize)
                hint = (
                    " (torch cannot index unsigned integers wider than 8 bits on every "
                    "version gadgetloader supports; "
                    + (
                        f"pass dtype='{wider}' to convert it on the way in, e.g. "
                        f"DataGadget(arr_or_file, dtype='{wider}') (arrays, tensors, and files "
                        f"loaded into memory; refused if a value does not fit); for "
                        f"placement='file', save such a table to a new {wider} file first)"
                        if wider
                        else "pass dtype='int64' to convert it on the way in where every value "
                        "fits: arrays, tensors, and files loaded into memory)"
                    )
                )
            elif npd.kind == "f":
                hint = (
                    " (pass dtype='float64', or another float dtype, to convert an array or "
                    "tensor on the way in; a file of this dtype is rewritten first, e.g. "
                    "with NumPy: np.save(new_path, np.load(path).astype('float64')))"
                )
            elif npd.kind == "c":
                hint = " (complex tables are not supported; store the real and imaginary parts)"
            raise GadgetTypeError(
                f"dtype {npd} is not supported for a table{hint}; tables hold "
                f"{', '.join(dtype_name(d) for d in SUPPORTED_DTYPES)}"
            )
    if result not in _NUMPY_OF:
        wide = {"torch.uint16": "int32", "torch.uint32": "int64", "torch.uint64": "int64"}
        hint = (
            f" (torch cannot index it on every version gadgetloader supports; pass "
            f"dtype='{wide[str(result)]}' with a tensor source to convert it)"
            if str(result) in wide
            else ""
        )
        raise GadgetTypeError(
            f"dtype {result} is not supported for a table{hint}; tables hold "
            f"{', '.join(dtype_name(d) for d in SUPPORTED_DTYPES)}"
        )
    return result


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype holding the same bytes as ``dtype`` (``uint16`` for bfloat16)."""
    return _NUMPY_OF[dtype]


def c_order(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-ordered array that ``torch.from_numpy`` takes (a view where it already
    is one). NumPy calls a view contiguous whatever the strides of its length-1 axes
    (``np.array([2])[::-1]`` has stride -8), which ``np.require(a, requirements="C")``
    keeps and torch refuses with a raw ``ValueError``: such an array is copied."""
    a = np.require(a, requirements="C")
    if any(s < 0 for s in a.strides):
        a = a.copy(order="C")
    return a


def host_tensor(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` checked as an array of values (dense, on the CPU or a CUDA device, not a
    nested tensor) and detached: a table's rows never join an autograd graph."""
    if getattr(t, "is_nested", False):
        raise GadgetTypeError(f"{what} must be a dense tensor; got a nested tensor")
    if t.layout != torch.strided:
        raise GadgetTypeError(f"{what} must be a dense tensor; got layout {t.layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise GadgetTypeError(f"{what} must be on the CPU or a CUDA device; got {t.device}")
    return t.detach()


def plain_items(seq: list[Any] | tuple[Any, ...], what: str) -> tuple[Any, torch.dtype | None]:
    """A nested list / tuple ready for ``np.asarray``: its torch-tensor items checked (see
    :func:`host_tensor`), detached and moved to the host as NumPy arrays (bfloat16, which
    NumPy lacks, as float32, which holds it exactly). Also the dtype to give the result:
    bfloat16 where every tensor item was bfloat16 and nothing else is in it, else None."""
    kinds: set[Any] = set()

    def walk(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if isinstance(x, torch.Tensor):
            # (a view with its negation or conjugation pending is made plain for NumPy)
            t = host_tensor(x, what).cpu().resolve_conj().resolve_neg()
            kinds.add(t.dtype)
            return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        kinds.add(type(x))
        return x

    out = walk(seq)
    return out, (torch.bfloat16 if kinds == {torch.bfloat16} else None)
