"""DataGadget: the user-facing object over one table."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import operator
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import io as _io
from ._device import cupy_available, resolve_device
from ._dtypes import as_torch_dtype, c_order, dtype_name, host_tensor, numpy_dtype, plain_items
from ._errors import (
    GadgetError,
    GadgetIndexError,
    GadgetKeyError,
    GadgetTypeError,
    GadgetValueError,
    as_flag,
    table_mismatch,
)
from ._ids import (
    _WIDE_UNSIGNED,
    FlagCheck,
    _nothing,
    _upload,
    as_ids,
    check_range,
    checked_after,
    int64_ids,
    start_flag_check,
    start_guarded_check,
)
from ._paths import as_path
from .stores import Store, empty_store
from .stores._base import StoreRetired
from .stores._base import gather_many as gather_stores
from .stores._base import scatter_many as scatter_stores
from .transfer import _engine, _kernels
from .transfer._engine import STRATEGIES, shares_memory

__all__ = ["DataGadget", "as_tensor_data", "gather_many", "scatter_many"]

_Shape = tuple[int, ...]


class _NotATensorError(GadgetTypeError, AttributeError):
    """A tensor's attribute asked of a DataGadget (an AttributeError too, for hasattr)."""


def as_tensor_data(data: Any, what: str = "data") -> torch.Tensor:
    """A torch tensor over ``data`` (tensor, NumPy or CuPy array) without copying where possible."""
    if isinstance(data, torch.Tensor):
        return host_tensor(data, what)  # rows are copied in; never part of a graph
    if isinstance(data, (np.generic, list)):
        want = None
        if isinstance(data, list):
            data, want = plain_items(data, f"a tensor in {what}")
        try:
            data = np.asarray(data)
        except ValueError as exc:
            raise GadgetTypeError(f"{what} must be rectangular; got a ragged list") from exc
        if want is not None:
            return torch.from_numpy(c_order(data)).to(want)
    if isinstance(data, np.ndarray):
        if not data.dtype.isnative:
            data = data.astype(data.dtype.newbyteorder("="))
        if not data.flags.writeable:
            data = data.copy()
        if data.dtype.name == "bfloat16" and data.dtype.itemsize == 2:  # ml_dtypes.bfloat16
            return torch.from_numpy(c_order(data).view(np.int16)).view(torch.bfloat16)
        if data.dtype.hasobject or data.dtype.kind in "OSUVMmc":
            raise GadgetTypeError(
                f"{what} has dtype {data.dtype}, which is not supported for a table; expected a numeric or bool dtype"
            )
        as_torch_dtype(data.dtype)  # raises for unsupported dtypes
        return torch.from_numpy(c_order(data))
    if hasattr(data, "__cuda_array_interface__") or hasattr(data, "__dlpack__"):
        return torch.from_dlpack(data)
    raise GadgetTypeError(
        f"{what} must be a torch tensor, a NumPy/CuPy array or a (nested) list of rows; "
        f"got {type(data).__name__}"
    )


def _check_generator(what: str, generator: Any) -> None:
    """Refuse a ``generator=`` that is not a ``torch.Generator`` (or None)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise GadgetTypeError(
            f"{what} takes a torch.Generator (or None) for generator=; got "
            f"{type(generator).__name__} {generator!r:.40}"
        )


def _on_current_store(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make a :class:`DataGadget` call again on the table's new store where another
    thread's ``load`` retired the store the call began on (see ``Store.retire``): the
    call then reads or writes the table as loaded, as if it had come after the load."""

    @functools.wraps(fn)
    def call(self: DataGadget, *args: Any, **kwargs: Any) -> Any:
        # made again without the swap lock first: a thread saving the table over its own
        # file holds the file's lock until it has loaded the new file (taking the swap
        # lock), so a call waiting for that file lock must not hold the swap lock
        for _ in range(_RETRIES):
            try:
                return fn(self, *args, **kwargs)
            except StoreRetired:
                pass
        while True:
            # loads kept overtaking the call: none replaces the store now. The file's
            # lock first, then the swap lock, in the order a save over the table's own
            # file takes them (it reloads while holding the file's lock)
            store = self._store
            exclusive = getattr(store, "exclusive", None)
            held = exclusive() if exclusive is not None else contextlib.nullcontext()
            with held, _SWAP_LOCK:
                if self._store is not store:
                    continue  # replaced while this thread waited for the locks
                return fn(self, *args, **kwargs)

    return call


#: held while a table's store is replaced, and by a call made again after many replacements
_SWAP_LOCK = threading.RLock()
#: how many times a call overtaken by loads is made again before it holds the swap lock
_RETRIES = 8


def _rows_of(sl: slice, n: int) -> range:
    """The rows a slice selects from a table of ``n`` rows (Python's rules)."""
    try:
        return range(*sl.indices(n))
    except ValueError:  # a zero step
        raise GadgetValueError(
            f"a slice of rows takes a non-zero step (a step of 0 selects nothing); got {sl!r}"
        ) from None
    except TypeError:  # a bound or step that is not an integer
        raise GadgetTypeError(
            f"a slice of rows takes integer bounds and step (or None); got {sl!r}"
        ) from None


def _is_row_part_index(indexes: Any) -> bool:
    """Whether ``indexes`` is row ids followed by an index into each row (see
    ``DataGadget._split_index``): a tuple holding a slice, an array or a tensor, or a list,
    range or tuple of ids followed by anything but further id sequences."""
    return isinstance(indexes, tuple) and (
        any(
            isinstance(x, (slice, np.ndarray, torch.Tensor))
            or hasattr(x, "__cuda_array_interface__")
            for x in indexes
        )
        or (
            # a list, range or tuple of ids, then ints into the row: g[[1, 2], 0], as
            # NumPy; anything else after such ids (a bool, None...) is refused as an index
            # into the row, not read as a ragged list of ids. Alone in a tuple, such ids
            # are the rows (g[([1, 2],)] is g[[1, 2]], as NumPy reads it)
            len(indexes) >= 1
            and isinstance(indexes[0], (list, range, tuple))
            and not any(isinstance(x, (list, range, tuple)) for x in indexes[1:])
        )
    )


def _many_ids(indexes: Any, num_rows: int, fn: str) -> Any:
    """The row ids of a :func:`gather_many` / :func:`scatter_many` call: ids, or a ``slice``
    of rows; an index into the rows is refused with a message that says so."""
    if _is_row_part_index(indexes) and len(indexes) == 1:
        indexes = indexes[0]  # rows alone in a tuple: those rows, as DataGadget reads them
    if isinstance(indexes, slice):
        return _rows_of(indexes, num_rows)
    if _is_row_part_index(indexes):
        raise GadgetTypeError(
            f"{fn} takes row ids (or a slice of rows), not an index into the rows; got a tuple "
            f"of {', '.join(type(x).__name__ for x in indexes)}: gather whole rows and index "
            "each table's result (or write each table with DataGadget.insertData)"
        )
    return indexes


#: ``torch.nn.init`` functions that fill a weight with one ``uniform_`` / ``normal_`` call of
#: the table's own (the fan-based initialisers and their helpers); any other function of that
#: module calling them would go on to use more of a tensor after the table was filled (torch
#: 2.4's ``trunc_normal_`` draws uniformly, then calls ``erfinv_``)
_WHOLE_TORCH_INITS = frozenset(
    {
        "uniform_",
        "normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "_no_grad_uniform_",
        "_no_grad_normal_",
    }
)


def _refuse_partial_torch_init() -> None:
    """Refuse, before anything is written, a ``torch.nn.init`` function that would fill the
    table and then fail on what a table lacks (refused calls change nothing)."""
    caller = sys._getframe(2)  # (1: DataGadget.uniform_ / normal_; 2: who called it)
    code = caller.f_code
    if (
        code.co_filename.replace(os.sep, "/").endswith("torch/nn/init.py")
        and code.co_name not in _WHOLE_TORCH_INITS
    ):
        name = code.co_name.removeprefix("_no_grad_")
        raise GadgetTypeError(
            f"torch.nn.init.{name} needs more of a tensor "
            "than a DataGadget is (nothing was changed); run it through init_, e.g. "
            "g.init_(torch.nn.init.trunc_normal_, std=0.02)"
        )


def _is_int(x: Any) -> bool:
    """An integer index: an int, a NumPy integer, or anything with ``__index__`` (a 0-d
    integer tensor), but no bool."""
    if isinstance(x, (bool, np.bool_)) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _check_row_slice(sl: slice) -> None:
    """A slice into each row: int bounds (or None) and a positive step (a tensor view has
    no negative strides)."""
    for name in ("start", "stop", "step"):
        v = getattr(sl, name)
        if v is not None and not _is_int(v):
            raise GadgetTypeError(
                f"a slice into the rows takes int bounds and step; got {name}={v!r} in {sl!r}"
            )
    if sl.step is not None and operator.index(sl.step) <= 0:
        raise GadgetValueError(
            f"a slice into the rows takes a positive step (a zero step selects nothing, and "
            f"a view of the rows cannot run backwards); got {sl!r}"
        )


def _index_text(rest: tuple[Any, ...]) -> str:
    return ", ".join(
        f"{x.start if x.start is not None else ''}:{x.stop if x.stop is not None else ''}"
        + (f":{x.step}" if x.step is not None else "")
        if isinstance(x, slice)
        else repr(x)
        for x in rest
    )


def _apply_rest(
    rows: torch.Tensor, lead: tuple[slice, ...], rest: tuple[Any, ...], row_shape: tuple[int, ...]
) -> torch.Tensor:
    """``rows[lead + rest]``: an index into each row (slices and ints: a view)."""
    for x, size in zip(rest, row_shape, strict=False):
        if not isinstance(x, slice) and not -size <= int(x) < size:
            raise GadgetIndexError(
                f"index {int(x)} is out of range for a row axis of size {size}; nothing was "
                "read or written"
            )
    return rows[lead + tuple(rest)]


def _check_out(out: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """``getData(out=...)`` must be a contiguous tensor of the result's shape, dtype and device."""
    if not isinstance(out, torch.Tensor):
        raise GadgetTypeError(f"out must be a torch tensor; got {type(out).__name__}")
    if out.dtype != dtype or out.device != device:
        raise GadgetTypeError(
            f"out must be a {dtype_name(dtype)} tensor on {device}; got {dtype_name(out.dtype)} on {out.device}"
        )
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise GadgetValueError(
            f"out must be a contiguous tensor of shape {tuple(shape)}; got shape {tuple(out.shape)}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    if out.requires_grad and torch.is_grad_enabled():
        raise GadgetValueError(
            "out must not require grad (rows are written into it in place); "
            "pass out.detach(), or call getData under torch.no_grad()"
        )
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise GadgetValueError(
            "out is an inference tensor (made under torch.inference_mode()), which can only be "
            "written inside inference mode; pass a tensor made outside it, or call getData "
            "under torch.inference_mode()"
        )


def _cuda_unusable_here() -> bool:
    """True in a DataLoader worker or a process forked after CUDA started."""
    from torch.utils.data import get_worker_info

    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    return get_worker_info() is not None or bool(bad_fork())


def _is_shape(obj: Any) -> bool:
    return (
        isinstance(obj, tuple)  # a list is data: DataGadget([[1, 2], [3, 4]])
        and len(obj) > 0
        and all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in obj)
    )


def _unsigned_to(a: np.ndarray, target: torch.dtype, where: str = "the source array") -> np.ndarray:
    """A uint16/32/64 array (no torch table dtype) as ``target``, if every value is within
    its range (``where``: what holds the values, for the message). A float target rounds
    as NumPy's cast does (bfloat16 through float32), as an int64 array cast to a float
    dtype would."""
    if target == torch.bfloat16:  # no NumPy bfloat16: through float32, which holds any uint64
        return a.astype(np.float32)
    npd = numpy_dtype(target)
    if npd.kind not in "iuf":
        raise GadgetTypeError(
            f"a {a.dtype} array converts to a numeric dtype; got {dtype_name(target)}"
        )
    if a.size:
        hi = int(a.max())
        # Python numbers: comparing with a NumPy float16 would warn about its own overflow
        top = int(np.iinfo(npd).max) if npd.kind in "iu" else float(np.finfo(npd).max)
        if hi > top:
            raise GadgetValueError(
                f"{where} holds values up to {hi}, beyond {dtype_name(target)}'s range "
                "(nothing was loaded)"
            )
    return a.astype(npd)


def _longdouble_to_float64(a: np.ndarray) -> np.ndarray:
    """A long-double array (no torch dtype) as float64, on its way to a ``dtype=`` given
    with it; refused where a finite value is beyond float64's range."""
    with np.errstate(over="ignore"):
        out = a.astype(np.float64)
    if a.size and np.count_nonzero(np.isinf(out)) != np.count_nonzero(np.isinf(a)):
        raise GadgetValueError(
            f"the source array holds {a.dtype} values beyond float64's range (nothing was loaded)"
        )
    return out


class DataGadget:
    """A table of rows -- embeddings, features, labels -- that the GPU gathers from and scatters to.

    Parameters
    ----------
    fileName : str, path, numpy.ndarray, torch.Tensor, CuPy array, list or tuple of int, optional
        Where the table comes from: a file (.npy; HDF5 and zarr with the ``hdf5`` /
        ``zarr`` extras), an array, tensor or (nested) list (copied in), or a *tuple*
        shape for a new zero-filled table (then give ``dtype``).
    CPUPinn : bool, default False
        SpeedTorch's switch: True keeps the table in pinned host RAM that the GPU
        reads in place, False in GPU memory. ``placement`` overrides it.
    placement : {'cuda', 'pinned', 'cpu', 'file'}, optional
        Where the rows live. Default: ``pinned`` with ``CPUPinn=True``, else ``cuda``
        (SpeedTorch's defaults). ``cuda`` and ``pinned``, the defaults included, fall
        back to ``cpu`` on a machine without CUDA, with a ``FallbackWarning`` (once a
        process).
    shape, dtype
        For a new table (``dtype`` defaults to float32). ``dtype`` may be a string
        (``'float32'``), a NumPy or a torch dtype. With an array or tensor source,
        ``dtype`` converts it when the cast keeps its kind or widens it (float64 ->
        float32, int64 -> float32; values must fit the new type's range: an integer
        out of range, or a finite value that would become ``inf``, raises
        ``GadgetValueError``), and raises ``GadgetTypeError`` for a cast that would
        truncate (float -> int): convert such data yourself. A file source must already hold
        ``dtype``, except a uint16/32/64 file (no table dtype holds those) loaded into
        memory (not ``placement='file'``): it converts as such an array would.
    device : str or torch.device, optional
        Where :meth:`getData` delivers rows: the current CUDA device by default, the
        CPU where CUDA is missing.
    dataset, format : str, optional
        For files: the array inside an HDF5 file or zarr group; force a format.
    progress : bool, optional
        Progress bar for file loads (default: only for large files).
    strategy : str, default 'auto'
        Transfer strategy for GPU gathers/scatters (see ``gadgetloader.transfer``):
        ``auto``, ``kernel``, ``sorted``, ``hybrid`` or ``torch``. Results are identical
        whatever the strategy. ``hybrid`` needs a host copy of the table: on a ``cuda``
        table it runs as ``sorted``; without CuPy every strategy runs as ``torch``.
    **options
        For ``placement='file'`` only (anything else refuses them): ``cache_bytes``
        (the block cache's budget, default 256 MiB, 0 turns it off), ``writable``
        (True / False / None: whether writes go through to the file; default when it
        can be written) and ``block_rows`` (rows per read; default the file's chunk
        length, or about 4 KiB of rows), as :class:`~gadgetloader.stores.FileStore`.

    Notes
    -----
    With ``pinned`` the table costs its own size in host RAM (plus less than a
    page) and :meth:`getData` / :meth:`insertData` run as GPU kernels reading and
    writing that memory over PCIe, near the link's bandwidth, with no CPU
    indexing. All work is queued on torch's current CUDA stream.

    Examples
    --------
    >>> import torch, gadgetloader as gl
    >>> g = gl.DataGadget((1000, 16), dtype="float32", placement="cpu")
    >>> g.insertData(torch.ones(2, 16), [3, 7])
    >>> g.getData([7, 3, 0]).sum(dim=1).tolist()
    [16.0, 16.0, 0.0]
    """

    def __init__(
        self,
        fileName: Any = None,
        CPUPinn: bool = False,
        *,
        placement: str | None = None,
        shape: Sequence[int | np.integer[Any]] | None = None,
        dtype: Any = None,
        device: Any = None,
        dataset: str | None = None,
        format: str | None = None,
        progress: bool | None = None,
        strategy: str = "auto",
        **options: Any,
    ) -> None:
        pin = as_flag(CPUPinn, "CPUPinn")
        if progress is not None:
            progress = as_flag(progress, "progress")  # for every source, not files only
        requested = placement if placement is not None else ("pinned" if pin else "cuda")
        if isinstance(requested, str):
            requested = requested.lower()  # placement names are case-insensitive
        self._placement_requested = requested
        self._device = resolve_device(device)
        if not isinstance(strategy, str):
            raise GadgetTypeError(
                f"strategy must be a name, one of {list(STRATEGIES)}; got {type(strategy).__name__}"
            )
        strategy = strategy.lower()  # case-insensitive, as placement names
        if strategy not in STRATEGIES:
            raise GadgetKeyError(
                f"Unknown strategy {strategy!r}; expected one of {list(STRATEGIES)}"
            )
        self._strategy = strategy
        self._source_path: str | None = None
        #: options of a file-backed store (cache_bytes, writable, ...), kept for load()
        self._file_options: dict[str, Any] = dict(options)
        cuda_dev = self._device if self._device.type == "cuda" else None
        if fileName is not None and shape is not None:
            raise GadgetValueError("give either a source (fileName) or shape=, not both")
        if fileName is None and shape is None:
            raise GadgetValueError(
                "DataGadget needs a source: a file path, an array or tensor, or a shape "
                "(e.g. DataGadget((1000, 128), dtype='float32'))"
            )
        if not isinstance(fileName, (str, os.PathLike)):
            # what only a file source takes must not be dropped silently (writable=False
            # on an array would give a writable table)
            if options:
                raise GadgetTypeError(
                    f"unexpected options {sorted(options)}: they apply to a table opened from "
                    "a file path (placement='file'), not to an array, tensor or shape"
                )
            if dataset is not None or format is not None:
                given = "dataset=" if dataset is not None else "format="
                raise GadgetValueError(
                    f"{given} applies to a file path; this source is an array, tensor or shape"
                )
        # (a tuple in the first argument is a shape, a list is data: [] is an empty table)
        if (shape is None and type(fileName) is tuple and not fileName) or (
            isinstance(shape, (tuple, list)) and not shape
        ):
            raise GadgetTypeError(  # (the error class of every other unusable shape)
                "a table needs at least one axis (rows); got the empty shape () -- pass "
                "(num_rows,) or (num_rows, row_size, ...)"
            )
        if fileName is None or _is_shape(fileName):
            raw = shape if shape is not None else fileName
            if not (isinstance(raw, (tuple, list)) and _is_shape(tuple(raw))):
                raise GadgetTypeError(f"shape must be a tuple of non-negative ints; got {raw!r}")
            shp = tuple(int(s) for s in raw)
            if any(s < 0 for s in shp):
                raise GadgetValueError(f"shape must be non-negative; got {shp}")
            self._store: Store = empty_store(
                requested, shp, as_torch_dtype(dtype if dtype is not None else "float32"), cuda_dev
            )
        elif isinstance(fileName, tuple):
            raise GadgetTypeError(
                f"a shape must be a tuple of non-negative ints; got {fileName!r} "
                "(pass data as an array, tensor or list)"
            )
        elif isinstance(fileName, (str, bytes, os.PathLike)):
            # (bytes: a file name, refused with advice -- NumPy cannot hold raw bytes as rows)
            self._source_path = as_path(fileName)
            self._store = self._open_file(
                self._source_path, requested, dataset, format, progress, dtype, options
            )
        else:
            if (
                dtype is not None
                and isinstance(fileName, torch.Tensor)
                and fileName.dtype in _WIDE_UNSIGNED
            ):
                fileName = fileName.detach().cpu().numpy()  # torch has few ops for these
            if (
                isinstance(fileName, np.ndarray)
                and fileName.dtype.kind == "u"
                and fileName.dtype.itemsize > 1
                and dtype is not None
            ):
                fileName = _unsigned_to(fileName, as_torch_dtype(dtype))
            if (
                isinstance(fileName, np.ndarray)
                and fileName.dtype.kind == "f"
                and fileName.dtype.itemsize > 8
                and dtype is not None
                and as_torch_dtype(dtype).is_floating_point
            ):
                fileName = _longdouble_to_float64(fileName)
            if isinstance(fileName, (bool, int, float, complex, dict, set)) or fileName is None:
                raise GadgetTypeError(
                    "a DataGadget's source must be a shape (a tuple of ints, e.g. (1000, 64)), "
                    "a file path (.npy, .h5/.hdf5, .zarr), a NumPy array, a torch tensor, a "
                    f"CuPy array or a (nested) list of numbers; got {type(fileName).__name__}"
                    + (
                        f" {fileName!r} (for {fileName} rows, pass a shape such as ({fileName}, dim))"
                        if isinstance(fileName, int) and not isinstance(fileName, bool)
                        else ""
                    )
                )
            data = as_tensor_data(fileName, "the source array")
            if data.dim() == 0:
                raise GadgetValueError("a table needs at least one axis; got a 0-d array")
            if dtype is not None and as_torch_dtype(dtype) != data.dtype:
                target = as_torch_dtype(dtype)
                if not torch.can_cast(data.dtype, target):
                    raise GadgetTypeError(
                        f"the source array is {dtype_name(data.dtype)} and dtype={dtype_name(target)} "
                        "would change its values (only casts within a kind, e.g. float64 -> "
                        "float32, or to a wider kind, e.g. int64 -> float32, are made); convert "
                        "the array first"
                    )
                if not target.is_floating_point and data.numel() and not data.dtype.is_complex:
                    info = torch.iinfo(target) if target != torch.bool else None
                    lo, hi = data.min().item(), data.max().item()
                    if info is not None and (lo < info.min or hi > info.max):
                        raise GadgetValueError(
                            f"the source array holds values from {lo} to {hi}, outside "
                            f"{dtype_name(target)}'s range [{info.min}, {info.max}]"
                        )
                cast = data.to(target)
                if target.is_floating_point and data.numel() and not data.dtype.is_complex:
                    # a value beyond the new type's range would become inf
                    finite = (
                        torch.isfinite(data)
                        if data.dtype.is_floating_point
                        else torch.ones_like(data, dtype=torch.bool)
                    )
                    over = torch.isinf(cast) & finite
                    if bool(over.any()):
                        bad = data[over].reshape(-1)[0].item()
                        fmax = torch.finfo(target).max
                        raise GadgetValueError(
                            f"the source array holds {bad}, beyond {dtype_name(target)}'s range "
                            f"(largest finite value {fmax:g}); it would become inf"
                        )
                data = cast
            as_torch_dtype(data.dtype)
            self._store = empty_store(requested, tuple(data.shape), data.dtype, cuda_dev)
            if data.numel():
                self._store.write_block(0, data)
                self._store.synchronize()

    @classmethod
    def _of_store(cls, store: Store, device: Any = None, strategy: str = "auto") -> DataGadget:
        """A gadget over an existing store (internal: optimizer-state slots)."""
        g = cls.__new__(cls)
        g._placement_requested = store.placement
        g._device = resolve_device(device)
        g._strategy = strategy
        g._source_path = None
        g._file_options = {}
        g._store = store
        return g

    def _replace_store(self, store: Store) -> None:
        """Swap in ``store`` (same shape and dtype) and close the old one (internal)."""
        old = self._store
        if store.shape != old.shape or store.dtype != old.dtype:
            raise GadgetValueError(
                f"replacement store {store.shape} {store.dtype} does not match "
                f"{old.shape} {old.dtype}"
            )
        with _SWAP_LOCK:
            self._store = store
            old.retire()

    # ---- construction helpers --------------------------------------------------------
    def _open_file(
        self,
        path: str,
        placement: str,
        dataset: str | None,
        fmt: str | None,
        progress: bool | None,
        dtype: Any,
        options: dict[str, Any],
    ) -> Store:
        # with dtype=, a uint16/32/64 file (no table holds those) is read as bits and
        # converted on the way in, as an array of those dtypes would be
        extra = {"wide_unsigned": True} if dtype is not None and placement != "file" else {}
        source = _io.open_source(path, format=fmt, dataset=dataset, **extra)
        wide = source.unsigned_bits
        try:
            table_dtype = source.dtype if wide is None else as_torch_dtype(dtype)
            if wide is None and dtype is not None and as_torch_dtype(dtype) != source.dtype:
                raise GadgetTypeError(
                    f"{path} holds {dtype_name(source.dtype)} but dtype={dtype!r} was requested"
                )
            if source.num_rows == 0:
                raise GadgetValueError(
                    f"{path} holds a table with zero rows {source.shape}; nothing to load"
                )
            if placement == "file":
                from .stores import file_store  # provided by the files module

                return file_store(source, **options)  # the store owns the source now
            if options:
                raise GadgetTypeError(
                    f"unexpected options for an in-memory placement: {sorted(options)}"
                )
            if wide is not None:
                _unsigned_to(np.zeros(0, dtype=wide), table_dtype)  # a numeric target
            store = empty_store(
                placement,
                source.shape,
                table_dtype,
                self._device if self._device.type == "cuda" else None,
            )
        except BaseException:
            source.close()
            raise
        try:
            if wide is None:
                _io.load_into(source, store, progress=progress)
            else:
                _io.load_converted(
                    source, store, lambda a: _unsigned_to(a, table_dtype, path), progress=progress
                )
        except BaseException:
            store.close()
            raise
        finally:
            source.close()
        return store

    @classmethod
    def zeros(
        cls,
        shape: Sequence[int | np.integer[Any]],
        dtype: Any = "float32",
        *,
        placement: str = "cuda",
        **kwargs: Any,
    ) -> DataGadget:
        """A zero-filled table."""
        if not isinstance(shape, (str, bytes)):
            with contextlib.suppress(TypeError):  # not iterable: refused by the constructor
                shape = tuple(shape)
        return cls(shape=shape, dtype=dtype, placement=placement, **kwargs)

    # ---- facts ---------------------------------------------------------------------------
    @property
    def store(self) -> Store:
        """The store that holds the rows (a ``CpuStore``, ``SlotStore``, ``FileStore``, ...:
        placement-specific details such as a file's path, dataset name and chunk size)."""
        return self._store

    @property
    def shape(self) -> _Shape:
        """The table's shape: ``(rows,) + row_shape``."""
        return self._store.shape

    @property
    def dtype(self) -> torch.dtype:
        """The rows' torch dtype."""
        return self._store.dtype

    @property
    def placement(self) -> str:
        """Where the rows live (after any CPU fallback)."""
        return self._store.placement

    @property
    def device(self) -> torch.device:
        """Where :meth:`getData` delivers rows."""
        return self._device

    @property
    def nbytes(self) -> int:
        """Bytes the table's rows take (``rows * row bytes``; a file store's, on disk
        uncompressed)."""
        return self._store.nbytes

    @property
    def row_shape(self) -> _Shape:
        """The shape of one row (``shape[1:]``; ``()`` for a 1-D table)."""
        return self._store.row_shape

    def __len__(self) -> int:
        return self._store.num_rows

    def dim(self) -> int:
        """Number of dimensions (the rows, then the row's shape), as ``Tensor.dim()``.

        With :meth:`size`, :meth:`uniform_` and :meth:`normal_` this lets the
        ``torch.nn.init`` initialisers that read a weight's fans fill the table in place,
        as they would an ``nn.Embedding``'s weight: ``torch.nn.init.xavier_uniform_(emb.weight)``,
        ``kaiming_normal_``. Initialisers that need more of a tensor (``trunc_normal_``,
        ``orthogonal_``) are refused with :class:`~gadgetloader.GadgetTypeError`; run them
        through :meth:`init_`: ``emb.weight.init_(torch.nn.init.trunc_normal_, std=0.02)``.
        """
        return len(self.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions, as ``Tensor.ndim``."""
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        """The shape as a ``torch.Size``, or its length along ``dim``, as ``Tensor.size()``."""
        if dim is None:
            return torch.Size(self.shape)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise GadgetTypeError(f"size takes an int dimension; got {type(dim).__name__}")
        n = len(self.shape)
        if not -n <= int(dim) < n:
            raise GadgetIndexError(
                f"dimension {int(dim)} is out of range for a table of {n} dimensions"
            )
        return self.shape[int(dim)]

    def numel(self) -> int:
        """Number of elements, as ``Tensor.numel()``."""
        return math.prod(self.shape)

    def __getattr__(self, name: str) -> Any:
        # (only reached when the usual lookup fails) a tensor's attribute asked of a table:
        # say what a DataGadget is and what works, still as an AttributeError for hasattr()
        if not name.startswith("__") and hasattr(torch.Tensor, name):
            raise _NotATensorError(
                f"'DataGadget' object has no attribute {name!r}: a DataGadget is a table, not a "
                "tensor; read rows with g[ids] / getData, write them with insertData, and fill "
                "the table with a torch initializer through init_ (e.g. "
                "g.init_(torch.nn.init.trunc_normal_, std=0.02))"
            )
        raise AttributeError(f"'DataGadget' object has no attribute {name!r}")

    def __repr__(self) -> str:
        closed = ", closed" if self._store.closed else ""
        source = ""
        path = getattr(self._store, "path", None)  # a file table's file (and dataset)
        if isinstance(path, str):
            source = f", path={path!r}"
            dataset = getattr(self._store, "dataset", None)
            if dataset:
                source += f", dataset={dataset!r}"
        return (
            f"DataGadget(shape={self.shape}, dtype={dtype_name(self.dtype)}, "
            f"placement={self.placement!r}, device={str(self._device)!r}{source}{closed})"
        )

    # ---- rows in and out -----------------------------------------------------------------
    @_on_current_store
    def getData(
        self,
        indexes: Any,
        *,
        device: Any = None,
        out: torch.Tensor | None = None,
        check_ids: bool = True,
    ) -> torch.Tensor:
        """The rows at ``indexes``, as a tensor on :attr:`device` (CUDA where available).

        Parameters
        ----------
        indexes : torch tensor (CPU or CUDA), NumPy or CuPy array, list, tuple, range, int or slice
            Row ids of any integer dtype and any shape; the result has shape
            ``indexes.shape + row_shape`` (a plain int gives one row without a leading axis).
            As in SpeedTorch (CuPy indexing), a ``slice`` is a range of rows (Python's
            rules: ``slice(-2, None)`` is the last two rows, while a negative id is an
            error), and a tuple
            holding a slice, an array or a tensor is a NumPy-style index: row ids first,
            then slices or ints into each row, e.g. ``(slice(0, 6), slice(0, 3))`` is
            ``table[0:6, 0:3]`` (``out=`` then refused); so is a list of ids followed by
            ints, ``([1, 2], 0)`` (or a tuple of ids). A tuple of plain ints is a list of ids. Slices into the
            row take int bounds and a positive step.
        device : optional
            Deliver to this device instead of :attr:`device`. In a DataLoader worker
            process, or a process forked after CUDA started, rows come back on the
            CPU by default (CUDA cannot be used there) and an explicit CUDA device
            is an error.
        out : torch.Tensor, optional
            A contiguous tensor of the result's shape and dtype, on the result's device,
            to fill and return (any placement; refused with a tuple index).
        check_ids : bool, default True
            Check CUDA ids against the table's size before the gather. This costs one
            stream synchronisation (tens of microseconds); pass False for ids you know
            are valid (e.g. from a sampler). CPU ids are always checked (on the CPU, no
            synchronisation; for a GPU gather while the GPU gathers), and the GPU
            kernels never read outside the table whatever the ids: an unchecked
            out-of-range id yields a zero row. A gather that reads each row once (below)
            checks CUDA ids in the launch that prepares it, with no reduction of its own.

        Repeated ids are allowed. A large gather by the ``kernel`` strategy (what ``auto``
        picks up to 2 GB and 262,143 ids) from a ``pinned`` table of at most 2**24 rows (at
        least 65,536 ids, at most 16 table rows per id; README, "Repeated ids in a gather")
        reads each distinct row over the link once and copies it on the GPU to its repeats.

        Raises
        ------
        GadgetIndexError
            A negative id or one ``>= len(self)``: nothing outside the table is read,
            the table is unchanged, and no rows are returned (where the check runs
            alongside a GPU gather, an ``out`` tensor may then hold partial rows).
        GadgetTypeError
            Non-integer ids.
        """
        self._store.check_open()
        check_ids = bool(as_flag(check_ids, "check_ids"))  # (bool('False') is True)
        indexes, rest = self._split_index(indexes)
        if rest:
            if out is not None:
                raise GadgetValueError(
                    "out= takes rows of the whole row shape; got an index into the rows too "
                    f"({_index_text(rest)}): gather the rows into out, then index out"
                )
            rows = self.getData(indexes, device=device, check_ids=check_ids)
            lead = (slice(None),) * (rows.dim() - len(self.row_shape))
            return _apply_rest(rows, lead, rest, self.row_shape)
        dev = self._delivery_device(device)
        where = self._store.ids_device(dev)
        if (
            where.type == "cuda"
            and not _is_cuda_tensor(indexes)
            and self._store.hybrid_for(dev, _id_count(indexes), self._strategy)
        ):
            # a large sparse request on a huge host table: CPU threads gather part of it
            # from the ids where they are (uploading them would bring them back)
            where = torch.device("cpu")
        # a GPU gather by the row kernels (which never read outside the table) does not
        # wait for the ids' check: CPU ids are checked on the CPU while it runs, and the
        # two numbers of CUDA ids' check travel back meanwhile; a bad id still raises
        # before the rows are returned (unchecked CUDA ids, CuPy's included, skip the
        # check; an `out` inside the table, which the gather writes before a check could
        # refuse the ids, takes the plain path)
        if where.type == "cuda":
            may_repeat = not isinstance(indexes, range)  # (a slice of rows is a range)
            indexes = int64_ids(indexes, len(self), where)
            plan = self._kernel_plan(dev, indexes.numel())
            if plan is not None:
                how, view = plan
                if out is not None:
                    _check_out(out, (*indexes.shape, *self.row_shape), self.dtype, dev)
                if out is None or not shares_memory(out, view):
                    one_launch = how == "kernel" and indexes.dim() == 1
                    fused: FlagCheck | None = None
                    if (
                        check_ids
                        and indexes.is_cuda
                        and one_launch
                        and may_repeat
                        and _kernels.reads_once(view, indexes.numel())
                    ):
                        # the check rides on the launch that fills the gather's slots
                        fused = start_flag_check(indexes, len(self))
                    check: Callable[[], None]
                    if fused is not None:
                        ids, check = indexes, fused
                    elif check_ids or not indexes.is_cuda:
                        ids, check = checked_after(indexes, len(self), where)
                    else:
                        ids, check = indexes, _nothing
                    try:
                        if one_launch:
                            # one launch of the row kernel, as the engine's `kernel` strategy
                            # makes it, without the engine's general bookkeeping
                            rows = (
                                view.new_empty(ids.shape[0], *self.row_shape)
                                if out is None
                                else out
                            )
                            claimed = _kernels.gather_rows(
                                view,
                                ids,
                                rows,
                                dedup=may_repeat,
                                flag_out=0 if fused is None else fused.flag,
                            )
                            if fused is not None:
                                fused.event = claimed
                        else:
                            rows = self._store.gather(ids, dev, out=out, strategy=self._strategy)
                    except BaseException:
                        # the check's numbers must land before its buffer serves another
                        with contextlib.suppress(Exception):
                            check()
                        raise
                    check()
                    return rows
        ids = as_ids(indexes, len(self), where, check=check_ids)
        if out is not None:
            _check_out(out, (*ids.shape, *self.row_shape), self.dtype, dev)
        return self._store.gather(ids, dev, out=out, strategy=self._strategy)

    def _kernel_plan(self, dev: torch.device, n: int) -> tuple[str, torch.Tensor] | None:
        """``(strategy, CUDA view)`` where a gather of ``n`` ids to ``dev`` runs only the
        CuPy row kernels (``kernel`` or ``sorted``), which never read outside the table
        whatever the ids (so a range check may finish after it); else None. ``torch``
        (``index_select``: a device assert) and ``hybrid`` (CPU indexing) must see
        checked ids first."""
        store = self._store
        if type(store).gather is not Store.gather or not cupy_available():
            return None
        dv = store.device_view()
        if dv is None or dev.type != "cuda":
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if dv.device.index != index:
            return None
        try:
            how = _engine.resolve_strategy(self._strategy, dv, n, store.host_view())
        except Exception:
            return None
        return (how, dv) if how in ("kernel", "sorted") else None

    def _delivery_device(self, device: Any) -> torch.device:
        dev = self._device if device is None else resolve_device(device)
        if dev.type == "cuda" and _cuda_unusable_here():
            if device is not None:
                raise GadgetTypeError(
                    "CUDA cannot be used in this process (a DataLoader worker, or a process "
                    "forked after CUDA started); gather with device='cpu'"
                )
            dev = torch.device("cpu")
        return dev

    @_on_current_store
    def insertData(self, dataObject: Any, indexes: Any, *, check_ids: bool = True) -> None:
        """Write rows: ``table[indexes[i]] = dataObject[i]``.

        ``dataObject`` is a torch tensor (CPU or CUDA), NumPy or CuPy array of the
        table's dtype and shape ``indexes.shape + row_shape``. Where an id repeats,
        the row of its **last** occurrence is written (on every placement). ``indexes``
        takes what :meth:`getData` takes; with a NumPy-style tuple (rows, then slices or
        ints into each row) the data has the indexed part's shape and only that part is
        written (the rows are read, changed and written back; on a ``file`` table under
        the file's lock, so other threads' calls on that file wait rather than come in
        between).
        ``check_ids=False`` skips the synchronising range check of CUDA ids (see
        :meth:`getData`); unchecked out-of-range ids are then skipped by the kernel.
        Checked CUDA ids written by the GPU kernels are checked alongside the write: the
        kernel is queued first and writes nothing if an id is out of range, and the
        call returns (or raises) once the check's result is back.

        Raises
        ------
        GadgetIndexError, GadgetTypeError, GadgetValueError
            Bad ids, a wrong dtype or device, or a wrong shape -- all checked before
            anything is written, so the table is unchanged.
        """
        self._store.check_writable()
        check_ids = bool(as_flag(check_ids, "check_ids"))
        self._check_no_waiting_lookup("insertData into this table")
        indexes, rest = self._split_index(indexes)
        if not rest:
            self._insert_rows(dataObject, indexes, check_ids)
            return
        # part of each row: read the rows, write the part, write the rows back, all under
        # the store's lock (a file table's: no other call of that file comes in between)
        with self._store.exclusive():
            ids_only = as_ids(indexes, len(self), None, check=True)
            # (getData without its retry: a store a load retired meanwhile raises out of
            # this block, releasing the lock, and insertData's own retry makes the call
            # again; a retry waiting for the swap lock while holding the file's could
            # deadlock with another thread's retry that waits for the file's)
            get_rows = DataGadget.getData.__wrapped__  # type: ignore[attr-defined]
            rows = get_rows(self, ids_only, device=self._store.ids_device(self._device))
            lead = (slice(None),) * ids_only.dim()
            view = _apply_rest(rows, lead, rest, self.row_shape)
            part = self._part_data(dataObject, view)
            view[...] = part  # (a view of rows: basic indexing only, see _apply_rest)
            self._insert_rows(rows, ids_only, check_ids)

    def _insert_rows(self, dataObject: Any, indexes: Any, check_ids: bool) -> None:
        """:meth:`insertData` of whole rows."""
        data, ids, check_cuda = self._insert_args(dataObject, indexes, check_ids)
        if ids.numel() == 0:
            return
        try:
            if self._slot_write(data, ids, check_cuda):
                return
            check = start_guarded_check(ids, len(self)) if check_cuda else None
            try:
                self._store.scatter(ids, data, strategy=self._strategy, check=check)
            except BaseException:
                if check is not None:
                    # the check's numbers must land before its buffer serves another
                    with contextlib.suppress(Exception):
                        check()
                raise
        finally:
            self._wrote()

    def _slot_write(self, data: torch.Tensor, ids: torch.Tensor, check: bool) -> bool:
        """Write where the store's GPU path would take the ``kernel`` strategy with the
        sort-free merge of repeats anyway, straight through the engine's
        :func:`~gadgetloader.transfer._engine.slot_scatter`, which fuses the range check of
        CUDA ids into the merge (no reduction or copy of its own) and skips the store's
        general bookkeeping. False: not taken, nothing done."""
        store = self._store
        if not (ids.is_cuda and data.is_cuda) or type(store).scatter is not Store.scatter:
            return False
        dv = store.device_view()
        if dv is None or dv.device != ids.device or data.device != dv.device:
            return False
        n = ids.numel()
        if _engine.resolve_strategy(
            self._strategy, dv, n, None, kind="scatter"
        ) != "kernel" or not _engine._slot_merge(dv, n):
            return False
        flat = ids.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return _engine.slot_scatter(dv, flat, data.reshape(n, *self.row_shape), check=check)

    def _split_index(self, indexes: Any) -> tuple[Any, tuple[Any, ...]]:
        """(row ids, index into each row) of a NumPy-style index: a ``slice`` of rows is
        their ``range``; a tuple holding a slice, an array or a tensor, or a list (or
        range, or tuple) of ids followed by ints, is (rows, then an
        index into the row: slices and ints). Other indexes are row ids as they are
        (a tuple of ints is a list of ids)."""
        if isinstance(indexes, slice):
            return _rows_of(indexes, len(self)), ()
        if (
            isinstance(indexes, tuple)
            and len(indexes) > 1
            and isinstance(indexes[0], (list, range))
            and any(isinstance(x, (list, range)) for x in indexes[1:])
        ):
            raise GadgetTypeError(
                "a tuple of id lists is ambiguous: NumPy reads g[[1, 2], [0, 1]] as the elements "
                "(1, 0) and (2, 1), which is not supported here; pass a 2-D array or tensor of "
                "ids for a 2-D batch of rows, or gather the rows and index the result; got "
                f"g[{_index_text(tuple(indexes))}]"
            )
        if _is_row_part_index(indexes):
            if len(indexes) > 1 + len(self.row_shape):
                raise GadgetIndexError(
                    f"too many indices: this table has {1 + len(self.row_shape)} dimensions "
                    f"(rows, then shape {self.row_shape}); got {len(indexes)}"
                )
            rows, given = indexes[0], tuple(indexes[1:])
            if isinstance(rows, slice):
                rows = _rows_of(rows, len(self))
            rest = []
            for x, size in zip(given, self.row_shape, strict=False):
                if isinstance(x, slice):
                    _check_row_slice(x)
                    # Python's bounds for this axis; a step past the axis selects one
                    # element, as any larger one would (a view's stride must stay small)
                    start, stop, step = x.indices(size)
                    rest.append(slice(start, stop, min(step, max(size, 1))))
                    continue
                if _is_int(x) and getattr(x, "ndim", 0) == 0:
                    # a plain int: torch reads a uint8 tensor as a mask and any tensor as an
                    # advanced index (a copy, which a write would go into)
                    rest.append(operator.index(x))
                    continue
                shape = getattr(x, "shape", None)
                raise GadgetTypeError(
                    "an index into the rows (after the row ids) takes slices and ints (0-d "
                    f"integer tensors and arrays too); got {type(x).__name__}"
                    + (f" of shape {tuple(shape)}" if shape is not None else "")
                )
            return rows, tuple(rest)
        return indexes, ()

    def _part_data(self, dataObject: Any, view: torch.Tensor) -> torch.Tensor:
        """``dataObject`` checked for writing into ``view`` (an indexed part of the rows)."""
        data = self._write_data(dataObject)
        if tuple(data.shape) != tuple(view.shape):
            raise GadgetValueError(
                f"insertData expected data of the indexed part's shape {tuple(view.shape)} but "
                f"got {tuple(data.shape)}"
            )
        return data.to(view.device)

    def _insert_args(
        self, dataObject: Any, indexes: Any, check_ids: bool
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Checked (data, ids, whether CUDA ids still need their range check) for a write;
        raises before anything is written. CPU ids are checked here (whatever
        ``check_ids`` says). CUDA ids are checked by the write: fused into the GPU merge of
        repeats (:meth:`_slot_write`), or by a check queued on the GPU that the store
        finishes (:func:`~gadgetloader._ids.start_guarded_check`: a GPU write is queued
        first and writes nothing if an id is bad, so the check's round trip overlaps it;
        other writes finish the check before they start)."""
        data = self._write_data(dataObject)
        cuda_dev = self._store.cuda_device
        target = data.device if data.is_cuda else torch.device("cpu")
        device = self._store.ids_device(target if cuda_dev is not None else torch.device("cpu"))
        ids = int64_ids(indexes, len(self), device)
        check_cuda = bool(check_ids and ids.is_cuda and ids.numel())
        if not ids.is_cuda:
            check_range(ids, len(self))  # CPU ids: checked here, whatever check_ids says
        if ids.device != device:
            ids = _upload(ids, device) if device.type == "cuda" else ids.to(device)
        expected = (*ids.shape, *self.row_shape)
        if tuple(data.shape) != expected:
            if check_cuda:
                check_range(ids, len(self))  # bad ids are reported first, as for CPU ids
            raise GadgetValueError(
                f"insertData expected data of shape {expected} (ids shape {tuple(ids.shape)} + row "
                f"shape {self.row_shape}) but got {tuple(data.shape)}"
            )
        return data, ids, check_cuda

    def _write_data(self, dataObject: Any) -> torch.Tensor:
        """``dataObject`` as a tensor, checked for the table's dtype and device."""
        if isinstance(dataObject, (np.ndarray, np.generic, list)):
            # NumPy data (a list becomes a NumPy array): said in NumPy's terms, and for a
            # dtype with no table form too (complex, strings, uint16, ...)
            arr = dataObject if not isinstance(dataObject, list) else None
            try:
                dtype: Any = arr.dtype if arr is not None else np.asarray(dataObject).dtype
            except Exception:  # a ragged list: as_tensor_data below says so
                dtype = None
            try:
                numpy_ok = dtype is None or as_torch_dtype(dtype) == self.dtype
            except Exception:  # no table form (complex, strings, uint16, ...)
                numpy_ok = False
            if not numpy_ok:
                kind = "a list" if arr is None else f"a NumPy {type(dataObject).__name__}"
                raise GadgetTypeError(
                    f"insertData expected {dtype_name(self.dtype)} data (the table's dtype) but "
                    f"got {kind} of {dtype}; convert it with "
                    + (
                        "torch.as_tensor(data).to(torch.bfloat16) (NumPy has no bfloat16)"
                        if self.dtype == torch.bfloat16
                        else f"np.asarray(data, dtype='{dtype_name(self.dtype)}')"
                    )
                )
        data = as_tensor_data(dataObject)
        if data.dtype != self.dtype:
            raise GadgetTypeError(
                f"insertData expected {dtype_name(self.dtype)} data (the table's dtype) but got "
                f"{dtype_name(data.dtype) if isinstance(data.dtype, torch.dtype) else data.dtype}; "
                f"convert it with .to({self.dtype})"
            )
        if data.device.type not in ("cpu", "cuda"):
            raise GadgetTypeError(
                f"insertData expected data on the CPU or a CUDA device; got {data.device}"
            )
        cuda_dev = self._store.cuda_device
        if data.is_cuda and cuda_dev is not None and data.device != cuda_dev:
            raise GadgetTypeError(
                f"insertData got data on {data.device} but this table is addressed from {cuda_dev}"
            )
        return data

    def gadgetInit(self) -> DataGadget:
        """SpeedTorch's second construction step, kept so its code runs unchanged.

        gadgetloader loads the table when the gadget is built, so this only checks
        that the gadget is open and returns it.
        """
        self._store.check_open()
        return self

    def __getitem__(self, indexes: Any) -> torch.Tensor:
        return self.getData(indexes)

    def __setitem__(self, indexes: Any, value: Any) -> None:
        self.insertData(value, indexes)

    gather = getData

    def scatter(self, indexes: Any, data: Any) -> None:
        """``insertData`` with torch's argument order: ``scatter(ids, rows)`` writes ``data``
        (rows as :meth:`insertData` takes them) at the row ids ``indexes``."""
        self.insertData(data, indexes)

    # ---- whole-table access ------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        """Whether an offloaded embedding trains this table: ``emb.weight.requires_grad``
        (False for a table that no module trains; a table is never an autograd tensor)."""
        owner = self.__dict__.get("_owner")
        module = owner() if owner is not None else None
        return module is not None and not module._frozen

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        owner = self.__dict__.get("_owner")
        module = owner() if owner is not None else None
        if module is None:
            raise GadgetTypeError(
                "this DataGadget is a table, not an autograd tensor, so it has no requires_grad "
                "to set; to freeze an OffloadedEmbedding's table use module.requires_grad_(False) "
                "or module.weight.requires_grad = False"
            )
        if not isinstance(value, bool):
            raise GadgetTypeError(f"requires_grad must be True or False; got {value!r}")
        module.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> DataGadget:
        """``emb.weight.requires_grad_(False)`` freezes an offloaded embedding's table (as
        ``emb.requires_grad_(False)``); see :attr:`requires_grad`."""
        self.requires_grad = requires_grad
        return self

    def as_tensor(self) -> torch.Tensor:
        """The whole table as a torch tensor *without copying*: the CUDA view for
        ``cuda`` and ``pinned`` (GPU ops on it read/write host RAM in place for
        ``pinned``), the CPU tensor for ``cpu``. Valid until :meth:`close` or
        :meth:`load`: a load gives the table new storage (take a new view after it; an
        older view keeps the old rows), except on a table interleaved with its optimizer
        states, which a load refills in place (a view stays the table)."""
        self._store.check_open()
        view = self._store.device_view()
        if view is None:
            view = self._store.host_view()
        if view is None:
            raise GadgetTypeError(f"a {self.placement} table has no in-memory tensor view")
        return view

    @_on_current_store
    def getNumpyVersion(self, copy: bool = True) -> np.ndarray:
        """The table as a NumPy array: a copy, unless ``copy=False`` on a host-resident
        (``cpu`` or ``pinned``) table that is not bfloat16; such a view, like
        :meth:`as_tensor`'s, is the table until :meth:`close` or :meth:`load`. Where no
        view can be had (``cuda`` and ``file`` tables, bfloat16), ``copy=False`` gives
        a copy all the same: writes to it do not reach the table.

        bfloat16 tables come back as float32 (exact), since NumPy has no bfloat16.
        """
        self._store.check_open()
        copy = bool(as_flag(copy, "copy"))
        host = self._store.host_view()
        if host is not None and not copy and self.dtype != torch.bfloat16:
            self._store.wait_for_gpu()  # GPU writes still queued on a pinned table land first
            return host.numpy()
        out = np.empty(
            self.shape,
            dtype=np.float32 if self.dtype == torch.bfloat16 else numpy_dtype(self.dtype),
        )
        self._store.synchronize()
        step = max(1, (64 << 20) // max(1, self._store.row_nbytes))
        for start in range(0, len(self), step):
            stop = min(len(self), start + step)
            block = self._store.read_block(start, stop)
            if self.dtype == torch.bfloat16:
                block = block.float()
            out[start:stop] = block.numpy()
        return out

    numpy = getNumpyVersion

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """NumPy's array protocol: ``np.asarray(gadget)`` / ``np.array(gadget)`` read the
        whole table in one pass (as :meth:`getNumpyVersion`), not row by row.

        A copy unless NumPy asks for none (``np.asarray(gadget, copy=False)``, NumPy 2), which
        a host-resident table of a NumPy dtype gives as a view (valid until :meth:`close`
        or :meth:`load`); for any other table that request raises
        :class:`~gadgetloader.GadgetValueError` (a ``ValueError``, as NumPy's protocol asks).
        """
        if copy is False:
            self._store.check_open()
            if (
                self._store.host_view() is None
                or self.dtype == torch.bfloat16
                or (dtype is not None and np.dtype(dtype) != numpy_dtype(self.dtype))
            ):
                raise GadgetValueError(
                    f"this {self.placement!r} table of {dtype_name(self.dtype)} cannot be viewed "
                    "as a NumPy array without a copy; drop copy=False"
                )
            return self.getNumpyVersion(copy=False)
        out = self.getNumpyVersion()
        return out if dtype is None or out.dtype == np.dtype(dtype) else out.astype(dtype)

    # ---- initialisers ------------------------------------------------------------------
    @_on_current_store
    def init_(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> DataGadget:
        """Fill the table in place with any torch initializer, e.g.
        ``g.init_(torch.nn.init.xavier_uniform_)``: ``fn`` is called as
        ``fn(tensor, *args, **kwargs)`` on a tensor of the table's rows and must fill it in
        place (a ``file`` table takes elementwise initializers only, run block by block).
        On ``pinned`` the GPU writes straight into host RAM: no GPU-sized temporary."""
        if not callable(fn):
            raise GadgetTypeError(
                f"init_ takes a function that fills a tensor in place (e.g. "
                f"torch.nn.init.xavier_uniform_); got {type(fn).__name__} {fn!r:.60}"
            )
        if "generator" in kwargs:  # (torch's initializers take one)
            _check_generator("init_", kwargs["generator"])
        self._check_no_waiting_lookup("filling this table")
        try:
            self._store.apply_(fn, *args, **kwargs)
        finally:
            self._wrote()  # (a function that raised may have filled part of it)
        return self

    def _wrote(self) -> None:
        """After rows were (or may have been) written: rows a switcher read before are
        not written back over them (see ``ModelSwitch.afterOptimizerStep``)."""
        if "_switch" in self.__dict__:
            self.__dict__["_writes"] = self.__dict__.get("_writes", 0) + 1

    def _check_no_waiting_lookup(self, what: str) -> None:
        """Refuse to change the rows of an offloaded embedding's table while one of its
        lookups with a gradient waits for the step, or of a switcher's table (or state
        table) while a step's rows wait for ``afterOptimizerStep``: the step would write
        the rows it read back over the change."""
        self._store.check_open()  # a closed table says so first
        switch = self.__dict__.get("_switch")  # a switcher whose step will write back rows
        guard = switch() if switch is not None else None
        if guard is not None:
            guard._refuse_pending(what)
        owner = self.__dict__.get("_owner")
        module = owner() if owner is not None else None
        if module is not None and getattr(module, "_pending", None):
            # (no lookup is retired here: a refused or failed write changes nothing)
            raise GadgetValueError(
                f"{what} is refused while a training lookup of its OffloadedEmbedding waits "
                "for backward() and step(): the step would write the rows that lookup read "
                "over the change; change the rows after step() (evaluation forwards under "
                "torch.no_grad() leave nothing waiting)"
            )

    def zero_(self) -> DataGadget:
        """Set every element to zero (``fill_(0)``); returns the table."""
        return self.init_(torch.Tensor.zero_)

    def fill_(self, value: float) -> DataGadget:
        """Set every element to ``value`` (a number, or a tensor or array of one element),
        which the table's dtype must hold: an integer in range for integer tables,
        True/False/0/1 for bool tables, and for floating-point tables a value within the
        dtype's finite range (rounded to the dtype; a value past its largest finite number,
        even one that would round to it, is refused, as torch's own ``fill_`` refuses it)
        or inf/nan. Anything else is an error and leaves the table unchanged."""
        return self.init_(torch.Tensor.fill_, self._fill_value(value))

    def _fill_value(self, value: Any) -> bool | int | float:
        """``value`` as a Python number the table's dtype holds, or an error saying why."""
        what = f"fill_ on a {dtype_name(self.dtype)} table"
        if isinstance(value, torch.Tensor):
            value = host_tensor(value, f"the value of {what}")
        if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
            if (value.numel() if isinstance(value, torch.Tensor) else value.size) != 1:
                raise GadgetTypeError(
                    f"{what} takes one number; got an array of shape {tuple(value.shape)}"
                )
            value = value.item()
        if not isinstance(value, (bool, int, float)):
            raise GadgetTypeError(f"{what} takes a real number; got {type(value).__name__}")
        if self.dtype.is_floating_point:
            try:
                finite = math.isfinite(value)
                big = finite and abs(value) > torch.finfo(self.dtype).max
            except OverflowError:  # an int beyond any float
                big = True
            if big:
                raise GadgetValueError(
                    f"{what}: {value!r} overflows it (largest {torch.finfo(self.dtype).max})"
                )
            return float(value)
        if self.dtype == torch.bool:
            if value not in (0, 1):
                raise GadgetValueError(f"{what} takes True, False, 0 or 1; got {value!r}")
            return bool(value)
        if isinstance(value, float) and not value.is_integer():
            raise GadgetValueError(f"{what} takes an integer; got {value!r}")
        info = torch.iinfo(self.dtype)
        if not info.min <= value <= info.max:
            raise GadgetValueError(
                f"{what} takes a value in [{info.min}, {info.max}]; got {value!r}"
            )
        return int(value)

    def _check_float(self, what: str) -> None:
        if not self.dtype.is_floating_point:
            raise GadgetTypeError(
                f"{what} fills a floating-point table; this one is {dtype_name(self.dtype)}"
            )

    def _check_bounds(self, what: str, **values: Any) -> list[float]:
        """Each of ``values`` as a float: a finite real number (a 0-d tensor or array too,
        as torch takes) within the table dtype's range."""
        largest = torch.finfo(self.dtype).max
        out = []
        for name, v in values.items():
            if isinstance(v, torch.Tensor):
                v = host_tensor(v, f"{what}'s {name}")
            if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0:
                v = v.item()
            if isinstance(v, (bool, np.bool_)) or not isinstance(
                v, (int, float, np.integer, np.floating)
            ):
                raise GadgetTypeError(
                    f"{what} takes a real number for {name}; got {type(v).__name__}"
                )
            try:
                ok = math.isfinite(v) and abs(float(v)) <= largest
            except OverflowError:  # an int beyond any float
                ok = False
            if not ok:
                raise GadgetValueError(
                    f"{what} on a {dtype_name(self.dtype)} table needs a finite {name} within "
                    f"+-{largest}; got {name}={v!r}"
                )
            out.append(float(v))
        return out

    def uniform_(
        self, low: float = 0.0, high: float = 1.0, *, generator: torch.Generator | None = None
    ) -> DataGadget:
        """Fill the table from U(low, high) (``low <= high``, both finite and within the
        dtype's range, as is ``high - low``; floating-point tables). ``generator``: a
        ``torch.Generator`` on the table's device for reproducible draws (torch's default
        generator when None)."""
        _refuse_partial_torch_init()
        self._check_float("uniform_")
        _check_generator("uniform_", generator)
        low, high = self._check_bounds("uniform_", low=low, high=high)
        if not low <= high:
            raise GadgetValueError(f"uniform_ needs low <= high; got low={low}, high={high}")
        if high - low > torch.finfo(self.dtype).max:
            raise GadgetValueError(
                f"uniform_ on a {dtype_name(self.dtype)} table needs high - low within "
                f"{torch.finfo(self.dtype).max}; got low={low}, high={high}"
            )
        return self.init_(torch.Tensor.uniform_, low, high, generator=generator)

    def normal_(
        self, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
    ) -> DataGadget:
        """Fill the table from N(mean, std**2) (``std >= 0``; ``mean`` and ``std`` finite and
        within the dtype's range; floating-point tables). ``generator`` as for
        :meth:`uniform_`."""
        _refuse_partial_torch_init()
        self._check_float("normal_")
        _check_generator("normal_", generator)
        try:
            negative = not std >= 0  # nan too
        except (TypeError, RuntimeError, ValueError):  # not a number: the bounds check says so
            negative = False
        if negative:
            raise GadgetValueError(f"normal_ needs std >= 0; got std={std}")
        mean, std = self._check_bounds("normal_", mean=mean, std=std)
        return self.init_(torch.Tensor.normal_, mean, std, generator=generator)

    # ---- files ---------------------------------------------------------------------------
    @_on_current_store
    def save(
        self,
        path: str | os.PathLike[str],
        *,
        dataset: str | None = None,
        format: str | None = None,
        progress: bool | None = None,
        **options: Any,
    ) -> None:
        """Write the table to ``path`` (format from the extension, or ``format=``),
        streaming block by block with no full-size temporary, atomically: an error
        part-way leaves any previous file at ``path`` intact.

        Options (``**options``): ``chunk_rows`` (HDF5, zarr; default about 1 MiB of
        rows); ``compression`` -- HDF5 ``'gzip'`` / ``'lzf'`` (default none), zarr
        ``'zstd'`` (default) / ``'gzip'`` / ``'blosc'`` / ``'none'`` (``None`` means the
        default); ``compression_level`` (gzip and blosc 0-9, zstd -131072 to 22). A save
        replaces what is at ``path`` as a whole (an HDF5 file with all its datasets, a
        zarr group with all its arrays); a directory (.npy, HDF5) or anything but a zarr
        store (zarr) at ``path`` is refused. Without ``dataset=`` an HDF5 file gets one
        dataset named ``"data"`` and a zarr store is one bare array (no group), so either
        reopens without ``dataset=``; a ``file`` table saved over its own file keeps its
        dataset's name (it reads that file on).

        Raises
        ------
        GadgetFileError
            ``path`` is a directory / not a regular file (.npy, HDF5) or not a zarr store.
        GadgetValueError, GadgetKeyError
            Bad options (unknown compression, a level out of range, ...).
        """
        path = as_path(path)
        progress = as_flag(progress, "progress", allow_none=True)  # before any file is made
        self._store.check_open()
        self._store.synchronize()
        backing = getattr(self._store, "path", None) if self.placement == "file" else None
        same_path = backing is not None and os.path.realpath(backing) == os.path.realpath(path)
        # the save replaces everything at `path`: the table's own file or array folder too
        # when it lies there (a zarr array opened as "s.zarr/g/x", saved as "s.zarr")
        target = os.path.realpath(path)
        over_itself = same_path or any(
            os.path.realpath(w) == target or os.path.realpath(w).startswith(target + os.sep)
            for w in getattr(self._store, "_watch_paths", ())
        )
        if (
            same_path
            and dataset is None
            and _io.sink_takes(_io.sink_format(path, format), "dataset")
        ):
            # saving over the file this table reads: keep the dataset's name (an HDF5 file or
            # zarr group would otherwise get the format's default name; .npy has no names)
            dataset = getattr(self._store, "dataset", None)
        kwargs = dict(options)
        if dataset is not None:
            kwargs["dataset"] = dataset
        _io.sink_format(path, format)  # an unknown format: refused before anything is made
        with contextlib.ExitStack() as held:
            if over_itself and self.placement == "file":
                # other threads' calls on the table wait from the first row read until the
                # table reads the new file: a write made meanwhile would go to the old file
                # after the save read its rows (and be lost with it), a call between the
                # rename and the reload would find the file replaced. They are then made
                # on the new file (as after another thread's load()). Only the file's lock
                # is held: the swap lock, which the reload takes briefly, is never held
                # by a thread waiting for a file's lock (see _on_current_store)
                held.enter_context(self._store.exclusive())
                self._store.check_open()  # closed or reloaded while this thread waited
            saved = self._store
            try:
                _io.save_from(
                    self._store,
                    lambda: _io.open_sink(path, self.shape, self.dtype, format=format, **kwargs),
                    progress=progress,
                    desc=f"save {as_path(path)}",
                )
            except BaseException:
                # an interrupt held until after the new file took its place (see
                # interrupts_deferred): read the new file, then let the interrupt through
                if over_itself and getattr(saved, "file_replaced", lambda: False)():
                    self._load(path, dataset=dataset, format=format, progress=False, expect=saved)
                raise
            if over_itself:
                # the file this table reads was just replaced: read the new one from now on
                self._load(path, dataset=dataset, format=format, progress=False, expect=saved)

    def saveCupy(self, saveFileName: str | os.PathLike[str]) -> None:
        """Save as .npy to ``saveFileName`` (SpeedTorch's name); atomic and streamed like
        :meth:`save`.

        As ``numpy.save`` (which SpeedTorch used), ``.npy`` is appended to a name that
        does not end with it: ``saveCupy("emb")`` writes ``emb.npy``."""
        path = as_path(saveFileName)
        if not path.endswith(".npy"):
            path += ".npy"
        self.save(path, format="npy")

    def loadCupy(self, loadFileName: str | os.PathLike[str]) -> None:
        """Replace the table with the contents of the .npy file ``loadFileName`` (SpeedTorch's
        name), keeping the placement.

        The file is checked (exists, not truncated, supported dtype) before the
        current table is replaced; the new table is read before the old one is freed,
        so the load holds both at its peak, as :meth:`load` does.
        """
        self.load(loadFileName, format="npy")

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        dataset: str | None = None,
        format: str | None = None,
        progress: bool | None = None,
    ) -> None:
        """Replace the table with a file's contents, keeping the placement.

        The file is read as it is: a uint16/32/64 file (no table dtype holds those) is
        refused with :class:`~gadgetloader.GadgetTypeError`, and the table is unchanged;
        build a new table with ``DataGadget(path, dtype='int64')`` to convert one.

        A table interleaved with its optimizer states (see ``OffloadedOptimizer``)
        is overwritten in place, and then the file must hold the same shape and dtype;
        the file is read into a staging copy first (1x the table in ordinary RAM, as a
        new store would take), so a file that fails part-way leaves the table unchanged.
        """
        self._load(path, dataset=dataset, format=format, progress=progress)

    def _load(
        self,
        path: str | os.PathLike[str],
        *,
        dataset: str | None,
        format: str | None,
        progress: bool | None,
        expect: Store | None = None,
    ) -> None:
        """:meth:`load`; with ``expect``, only if the table still has that store when the
        new one is swapped in (a save over the table's own file reloading it: another
        thread's load() made meanwhile stands)."""
        self._store.check_open()  # a closed table stays closed: no new store behind it
        self._check_no_waiting_lookup("loading a file into this table")
        if progress is not None:  # checked here: a file table's reopen never reads rows
            progress = as_flag(progress, "progress")
        if getattr(self._store, "load_in_place", False):
            self._load_in_place(as_path(path), dataset, format, progress)
            self._wrote()
            return
        try:
            new = self._open_file(
                as_path(path),
                self.placement if self.placement != "file" else self._placement_requested,
                dataset,
                format,
                progress,
                None,
                self._file_options if self.placement == "file" else {},
            )
        except GadgetTypeError as exc:
            if "torch cannot index unsigned" not in str(exc):
                raise
            # the advice names DataGadget's dtype=, which load() does not take
            raise GadgetTypeError(
                f"{exc}; load() and loadCupy() read a file as it is (they take no dtype=): build "
                "a new table from it with DataGadget(path, dtype=...) instead (nothing was changed)"
            ) from None
        owner = self.__dict__.get("_owner")
        if (
            owner is not None
            and owner() is not None
            and (tuple(new.shape) != self.shape or new.dtype != self.dtype)
        ):
            got = f"{tuple(new.shape)} {dtype_name(new.dtype)}"
            same_shape = tuple(new.shape) == self.shape
            new.close()
            raise table_mismatch(
                same_shape,
                f"{as_path(path)} holds {got}; this table belongs to an OffloadedEmbedding "
                f"and must keep its {self.shape} {dtype_name(self.dtype)} (nothing was changed)",
            )
        with _SWAP_LOCK:
            if self._store.closed:  # close() came while the file was read: it stays closed
                new.close()
                self._store.check_open()  # raises GadgetClosedError naming the table
            if expect is not None and self._store is not expect:
                new.close()  # another thread loaded a file meanwhile: its load stands
                return
            old, self._store = self._store, new
            self._wrote()
            old.retire()

    def _load_in_place(
        self, path: str, dataset: str | None, fmt: str | None, progress: bool | None
    ) -> None:
        source = _io.open_source(path, format=fmt, dataset=dataset)
        try:
            if tuple(source.shape) != self.shape or source.dtype != self.dtype:
                raise table_mismatch(
                    tuple(source.shape) == self.shape,
                    f"{path} holds {tuple(source.shape)} {dtype_name(source.dtype)}; this table "
                    f"shares its rows with its optimizer state and is loaded in place, so the "
                    f"file must hold {self.shape} {dtype_name(self.dtype)}",
                )
            self._store.check_writable()
            # read into a staging copy first, so a file that fails part-way (a corrupt
            # chunk) leaves the table as it was, as replacing the store would
            from .stores import CpuStore

            staging = CpuStore(self.shape, self.dtype)
            try:
                _io.load_into(source, staging, progress=progress)
                self._store.synchronize()
                rows = staging.host_view()
                assert rows is not None
                self._store.write_block(0, rows)
                self._store.synchronize()
            finally:
                staging.close()
        finally:
            source.close()

    # ---- lifetime --------------------------------------------------------------------------
    def flush(self) -> None:
        """Push rows written to a ``file`` table out to its file (the OS may still hold
        them; ``close()`` also flushes). Other placements: nothing to do. A closed table
        raises ``GadgetClosedError``, as a closed Python file does."""
        self._store.check_open()
        flush = getattr(self.store, "flush", None)
        if flush is not None:
            flush()

    def close(self) -> None:
        """Free the table's memory now (idempotent). Also happens on garbage collection.
        A ``load()`` that another thread is making meanwhile raises ``GadgetClosedError``
        and leaves the table closed."""
        with _SWAP_LOCK:  # (not between a load's check and its swap)
            self._store.close()

    def __enter__(self) -> DataGadget:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- pickling (DataLoader worker processes) ------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Pickle for worker processes.

        ``file``: the file's name and options only (no rows); the copy reopens the
        file lazily in its own process. ``cpu``: by value, under every pickler (also
        when a DataLoader sends it to *spawned* workers: each gets its own copy of the
        rows, and the parent's rows and NumPy views stay where they are). ``cuda`` /
        ``pinned`` cannot be pickled: their rows live in this process's GPU mappings.
        """
        store = self.__dict__.get("_store")
        if store is not None and not store.closed and store.placement in ("cuda", "pinned"):
            raise GadgetTypeError(
                f"a DataGadget with placement {store.placement!r} cannot be pickled (its rows live in "
                "this process's GPU memory mappings); for DataLoader workers started with 'spawn' "
                "use placement='cpu' (each worker gets a copy of the rows) or, for a table "
                "read from a file, open the file with placement='file' (each worker reopens "
                "it); 'fork' workers inherit the gadget without pickling"
            )
        state = self.__dict__.copy()
        state.pop("_owner", None)  # the module that trains it (a weak reference) stays behind
        state.pop("_switch", None)  # so does the switcher that pages it
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __copy__(self) -> DataGadget:
        """``copy.copy`` gives an independent table, as ``copy.deepcopy`` and pickling do
        (a ``cpu`` table's rows copied, a ``file`` table's file reopened; ``cuda`` /
        ``pinned`` tables refuse): a shallow copy would share the store, and its
        ``close()`` would free the rows under the original."""
        return copy.deepcopy(self)


def _id_count(indexes: Any) -> int:
    """How many ids ``indexes`` holds, where that is cheap to tell (else 0)."""
    if isinstance(indexes, (torch.Tensor, np.ndarray)):
        return int(indexes.size if isinstance(indexes, np.ndarray) else indexes.numel())
    if isinstance(indexes, (list, tuple, range)):
        return len(indexes)
    return 0


def _is_cuda_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_cuda


def _fused_group(gadgets: Any) -> list[DataGadget]:
    if isinstance(gadgets, DataGadget):
        raise GadgetTypeError(
            "expected a non-empty list of DataGadget; got one DataGadget (pass [table] for "
            "one table, or use its getData / insertData)"
        )
    if isinstance(gadgets, (str, bytes, torch.Tensor, np.ndarray, set, frozenset, dict)):
        raise GadgetTypeError(
            f"expected a non-empty list (or tuple) of DataGadget; got {type(gadgets).__name__}"
        )
    try:
        group = list(gadgets)
    except TypeError:
        raise GadgetTypeError(
            f"expected a non-empty list (or tuple) of DataGadget; got {type(gadgets).__name__}"
        ) from None
    if not group or not all(isinstance(g, DataGadget) for g in group):
        kinds = ", ".join(type(g).__name__ for g in group[:8]) + (", ..." if len(group) > 8 else "")
        raise GadgetTypeError(
            "expected a non-empty list of DataGadget; got "
            + (f"an empty {type(gadgets).__name__}" if not group else f"a list of {kinds}")
        )
    first = group[0]
    for g in group[1:]:
        if len(g) != len(first):
            raise GadgetValueError(
                f"tables moved together must have the same number of rows; got {len(first)} and {len(g)}"
            )
    return group


def gather_many(
    gadgets: Any, indexes: Any, *, device: Any = None, check_ids: bool = True
) -> list[torch.Tensor]:
    """The rows at ``indexes`` of several tables at once: ``gadgets`` is a list (or tuple)
    of DataGadget with the same row count -- e.g. an embedding table and its optimizer
    states.

    The ids are converted and checked once; tables that are all CUDA-addressable
    (``cuda`` / ``pinned``) with the same row size in bytes are moved by one GPU launch
    per four tables, others one by one. Returns one tensor per table, as
    :meth:`DataGadget.getData` would (same rules for ``device`` and ``check_ids``; the ids
    may be a ``slice`` of rows too).
    """
    group = _fused_group(gadgets)
    first = group[0]
    for k, g in enumerate(group):
        try:
            g._store.check_open()
        except GadgetError as exc:  # say which table, keeping the error's class
            raise type(exc)(f"table {k} of {len(group)}: {exc}") from exc
    dev = first._delivery_device(device)
    check_ids = bool(as_flag(check_ids, "check_ids"))
    indexes = _many_ids(indexes, len(first), "gather_many")  # (a slice of rows, as getData takes)
    ids = as_ids(indexes, len(first), first._store.ids_device(dev), check=check_ids)
    stores = [g._store for g in group]
    if all(s.ids_device(dev) == ids.device for s in stores):
        return gather_stores(stores, ids, dev, strategy=first._strategy)
    return [g.getData(ids, device=dev, check_ids=False) for g in group]


def scatter_many(gadgets: Any, rows: Any, indexes: Any, *, check_ids: bool = True) -> None:
    """``gadgets[k][indexes] = rows[k]`` for every table, at once (see :func:`gather_many`).

    Every argument is checked before anything is written, and so is every file-backed
    table's part of the write (its chunks are read first, as a write to one table does: a
    damaged chunk raises :class:`~gadgetloader.GadgetFileError` naming the table, with no
    table changed); a repeated id takes its last occurrence's row in every table, as
    :meth:`DataGadget.insertData`.
    """
    group = _fused_group(gadgets)
    if isinstance(rows, (str, bytes, set, frozenset, dict)) or rows is None:
        raise GadgetTypeError(
            f"rows must be a list (or tuple) with one row tensor or array per table; got "
            f"{type(rows).__name__}"
        )
    try:
        rows = list(rows)  # a stacked tensor or array gives one per table along its first axis
    except TypeError:
        raise GadgetTypeError(
            f"rows must be a list (or tuple) with one row tensor or array per table; got "
            f"{type(rows).__name__}"
        ) from None
    if len(rows) != len(group):
        raise GadgetValueError(f"got {len(group)} tables but {len(rows)} row tensors")
    checked = []
    check_ids = bool(as_flag(check_ids, "check_ids"))
    ids = _many_ids(indexes, len(group[0]), "scatter_many")
    for k, (g, r) in enumerate(zip(group, rows, strict=True)):
        try:
            g._store.check_writable()
            g._check_no_waiting_lookup("scatter_many into this table")
            data, ids, pending = g._insert_args(r, ids, check_ids if k == 0 else False)
            if pending:
                check_range(ids, len(g))
        except GadgetError as exc:  # say which table, keeping the error's class
            raise type(exc)(f"table {k} of {len(group)}: {exc}") from exc
        checked.append((data, ids))
    if checked[0][1].numel() == 0:
        return
    if len(group) > 1:
        # what a table's own write would find before writing (a damaged file chunk) is
        # found for every table before the first one is written
        for k, g in enumerate(group):
            try:
                g._store.precheck_scatter(checked[k][1])
            except GadgetError as exc:
                raise type(exc)(f"table {k} of {len(group)}: {exc}") from exc
    try:
        if len({(d.device, i.device) for d, i in checked}) == 1:
            scatter_stores(
                [g._store for g in group],
                checked[0][1],
                [d for d, _ in checked],
                strategy=group[0]._strategy,
            )
        else:
            for g, (data, i) in zip(group, checked, strict=True):
                g._store.scatter(i, data, strategy=g._strategy)
    finally:
        for g in group:
            g._wrote()
