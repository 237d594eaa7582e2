"""Checkpoint and resume for offloaded training: tables to files, the rest to ``meta.pt``.

Every full table -- embedding weights and each row-shaped optimizer state -- is
written with :meth:`DataGadget.save` (streamed block by block, atomically, in the
format the extension names: ``.npy``, or HDF5 / zarr where those formats are
installed). Everything small -- step counts and other scalar state, ordinary
parameters, optimizer hyper-parameters -- goes into one ``meta.pt`` written last,
so a directory with a ``meta.pt`` is complete; table files get names of their own per
save, so overwriting a checkpoint never mixes two of them. Loading writes the same bytes back,
so training resumes bit-identically.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import io as _io
from .._dtypes import dtype_name
from .._errors import (
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetKeyError,
    GadgetTypeError,
    GadgetValueError,
    as_choice,
    as_flag,
    table_mismatch,
)
from .._paths import as_path
from ..gadget import DataGadget
from ..io._atomic import interrupts_deferred, replace_atomically, temp_prefix
from ..io._chunks import save_errors
from ..io._stream import STAGING_BYTES, blocks
from . import _embedding
from ._embedding import OffloadedOptimizer, _OffloadedTable
from ._model import ModelSwitch
from ._optim import (
    OptimizerSwitch,
    check_optimizer_kind,
    check_optimizer_state,
    keep_saved_scalar_dtypes,
    optimizer_kind,
    optimizer_tags,
)

__all__ = ["load_checkpoint", "save_checkpoint"]

_META = "meta.pt"
_VERSION = 1


class ObjectKindError(GadgetTypeError, GadgetValueError):
    """``load_checkpoint`` given an object of another kind than the one saved under its
    name (a module where an optimizer was saved): a ``GadgetTypeError``, and a
    ``GadgetValueError`` as every refused entry is."""


def _extension(fmt: str) -> str:
    formats = _io.FORMATS
    return formats[as_choice(fmt, "format", sorted(formats))][2][0]


def _check_objects(objects: Any, what: str) -> None:
    """Refuse anything but a mapping of safe names (they become file-name prefixes)."""
    if not isinstance(objects, Mapping):
        raise GadgetTypeError(
            f"{what} expected a mapping of names to modules / optimizers, e.g. "
            f"{{'model': model, 'optimizer': opt}}; got {type(objects).__name__}"
        )
    for name in objects:
        if not isinstance(name, str):
            raise GadgetTypeError(
                f"{what}: object names start the checkpoint's file names, so each must be a "
                f"str; got {type(name).__name__} {name!r}"
            )
        if (
            name in ("", ".", "..")
            or "/" in name
            or "\\" in name
            or "\0" in name
            or (os.altsep is not None and os.altsep in name)
        ):
            raise GadgetValueError(
                f"{what}: object names start the checkpoint's file names, so each must be "
                "a non-empty str without '/', '\\' or NUL characters and not '.' or '..'; "
                f"got {name!r}"
            )


def _refuse_mid_step(name: str, obj: Any, what: str) -> None:
    """Refuse a switcher, its optimizer switcher or the torch optimizer that steps its
    variable while a training step waits for ``afterOptimizerStep``: a load would be
    overwritten by the write-back (or get another batch's optimizer state written into
    this batch's rows), a save would pair the tables from before the step with the
    optimizer's state from after it."""
    from ._model import ModelSwitch, switch_for
    from ._optim import OptimizerSwitch

    def busy(param: Any) -> bool:
        sw = switch_for(param)
        return sw is not None and sw.step_under_way()

    if isinstance(obj, ModelSwitch):
        under_way = obj.step_under_way()
    elif isinstance(obj, OptimizerSwitch):
        under_way = (obj.pager is not None and obj.pager.step_pending) or busy(obj.param)
    elif isinstance(obj, torch.optim.Optimizer) and not hasattr(obj, "pagers"):
        under_way = any(busy(p) for g in obj.param_groups for p in g["params"])
    else:
        return
    if under_way:
        raise GadgetValueError(
            f"checkpoint object {name!r}: {what} a checkpoint is refused while a switcher's "
            "training step is under way (between beforeForwardPass and afterOptimizerStep): "
            "the tables and the optimizer state would not belong to one moment; save or load "
            "before beforeForwardPass or after afterOptimizerStep"
        )


def _plain_file_name(f: Any) -> bool:
    """Whether ``f`` names a file right inside the checkpoint directory."""
    return (
        isinstance(f, str)
        and f not in ("", ".", "..")
        and "\0" not in f
        and os.path.basename(f) == f
        and not os.path.isabs(f)
        and "\\" not in f
    )


def _parts(obj: Any, caller: str = "save_checkpoint") -> tuple[str, dict[str, DataGadget], Any]:
    """(kind, tables by name, small metadata) for one checkpointed object."""
    if isinstance(obj, ModelSwitch):
        return "model_switch", {"table": obj.table}, None
    if isinstance(obj, OptimizerSwitch):
        pager = obj._need_pager()
        return (
            "optimizer_switch",
            dict(pager.tables),
            {"scalars": pager.scalar_state(), **optimizer_tags(pager.optimizer)},
        )
    if isinstance(obj, OffloadedOptimizer):
        for pager in obj.pagers:
            pager.follow_hyper()  # state a scheduler turned on has its table
        tables = {
            f"{i}.{k}": t for i, pager in enumerate(obj.pagers) for k, t in pager.tables.items()
        }
        return (
            "offloaded_optimizer",
            tables,
            {"inner": obj._inner_state_without_rows(), **optimizer_tags(obj.inner)},
        )
    if isinstance(obj, nn.Module):
        tables = {
            f"{name}.weight" if name else "weight": m.table  # (the object itself: "weight")
            for name, m in obj.named_modules()
            if isinstance(m, _OffloadedTable)
        }
        _embedding._EXTERNAL_TABLES.append(True)
        try:
            sd = obj.state_dict()
        finally:
            _embedding._EXTERNAL_TABLES.pop()
        # a switcher's per-step variable holds only the last batch's rows (its table is
        # saved with the switcher): leave it out, so a fresh model of any size loads this
        paged = _paged_names(obj)
        sd = {k: v for k, v in sd.items() if k not in paged}
        return "module", tables, {"state_dict": sd}
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer", {}, {"state_dict": obj.state_dict(), **optimizer_tags(obj)}
    raise GadgetTypeError(
        f"{caller} takes ModelSwitch / ModelFactory, OptimizerSwitch / OptimizerFactory, "
        f"OffloadedOptimizer, nn.Module or torch optimizer objects; got {type(obj).__name__}"
    )


def _check_switchers_saved(objects: Mapping[str, Any]) -> None:
    """Refuse a checkpoint of a model whose variables a model switcher pages, without
    that switcher: the model's state leaves those variables out (they hold only the last
    batch's rows), so the table would not be saved at all."""
    from ._model import switch_for

    given = {id(o) for o in objects.values()}
    for name, obj in objects.items():
        if not isinstance(obj, nn.Module):
            continue
        missing = [
            pname
            for pname, p in obj.named_parameters()
            if (sw := switch_for(p)) is not None and id(sw) not in given
        ]
        if missing:
            raise GadgetValueError(
                f"checkpoint object {name!r} has variables paged by model switchers that are "
                f"not in the checkpoint ({missing}); their tables hold the rows, so pass the "
                "switchers (and their optimizer switchers) too, e.g. "
                "{'model': model, 'emb': switcher, 'emb_opt': opt_switcher, 'opt': optimizer}"
            )


def _paged_names(model: nn.Module) -> set[str]:
    """State-dict names of ``model``'s parameters that a model switcher pages."""
    from ._model import switch_for

    return {name for name, p in model.named_parameters() if switch_for(p) is not None}


def save_checkpoint(
    directory: str | os.PathLike[str],
    objects: Mapping[str, Any],
    *,
    format: str = "npy",
    progress: bool | None = None,
) -> None:
    """Save tables, optimizer state (step counts included) and small state to ``directory``.

    Parameters
    ----------
    directory : path
        Created if missing. Holds one file per table plus ``meta.pt``. ``''`` is the
        working directory.
    objects : mapping of name to object
        What to save, e.g. ``{"model": model, "optimizer": opt}`` for the drop-in
        module, or ``{"u": u_switch, "u_opt": u_opt_switch, "opt": optimizer}`` for
        SpeedTorch-style switchers. Names start the table files' names, so each must
        be a non-empty str without ``/``, ``\\`` or NUL, and not ``.`` or ``..``.
    format : {'npy', 'hdf5', 'zarr'}, default 'npy'
        File format of the tables (HDF5 / zarr need their extras). bfloat16 tables
        need 'hdf5' or 'zarr' (NumPy has no bfloat16); 'npy' refuses them before
        writing anything.
    progress : bool, optional
        A progress bar per table file, as :meth:`DataGadget.save` (default: only for
        large tables); True / False force it on / off.

    Notes
    -----
    Tables are streamed from their store (no full-size temporary on the GPU or in
    RAM) into files named for this save; ``meta.pt`` is written last and atomically,
    and only then are the previous checkpoint's table files removed. A save that dies
    part-way therefore leaves the previous checkpoint in ``directory`` loadable, whole;
    one that raises (a full disk, an interrupt) also removes the files it had written.
    A Ctrl-C that comes while ``meta.pt`` takes its place is held until the previous
    tables are removed, then raised (``KeyboardInterrupt``: the checkpoint was written).

    Raises
    ------
    GadgetTypeError
        ``objects`` is not a mapping, holds an object of another kind, or a bfloat16
        table is to be saved as ``.npy``.
    GadgetValueError
        An object name that cannot be part of a file name, or two names whose table
        files would be named alike.
    GadgetFileError
        ``directory`` is an existing file, or cannot be created.
    GadgetKeyError
        An unknown ``format``.
    """
    _check_objects(objects, "save_checkpoint")
    progress = as_flag(progress, "progress", allow_none=True)  # before the directory exists
    ext = _extension(format)
    _check_switchers_saved(objects)
    for name, obj in objects.items():
        _refuse_mid_step(name, obj, "saving")
    parts = {name: _parts(obj) for name, obj in objects.items()}
    if format == "npy":
        bf16 = [
            f"{name}.{t}"
            for name, (_, tables, _) in parts.items()
            for t, table in tables.items()
            if table.dtype == torch.bfloat16
        ]
        if bf16:
            raise GadgetTypeError(
                f"bfloat16 tables {bf16} have no .npy form; save the checkpoint with "
                "format='hdf5' or format='zarr' (both keep bfloat16 bit-exact)"
            )
    # new table files get names of their own: until the new meta.pt replaces the old one,
    # the previous checkpoint stays whole (a save killed part-way never mixes the two)
    token = uuid.uuid4().hex[:8]
    names = {
        (name, tname): f"{name}.{tname}.{token}{ext}"
        for name, (_, tables, _) in parts.items()
        for tname in tables
    }
    if len(set(names.values())) != len(names):
        seen: dict[str, tuple[str, str]] = {}
        for key, fname in names.items():
            if fname in seen:
                raise GadgetValueError(
                    f"save_checkpoint: object {seen[fname][0]!r} (table {seen[fname][1]!r}) and "
                    f"object {key[0]!r} (table {key[1]!r}) would share the file name "
                    f"{fname!r}; rename one of the objects"
                )
            seen[fname] = key
    for (name, tname), fname in names.items():
        # (a save also writes a hidden temporary beside each file, its name cut to fit)
        if len(os.fsencode(fname)) > 255:
            raise GadgetValueError(
                f"save_checkpoint: object {name!r} (table {tname!r}) makes the file name "
                f"{fname[:40]!r}... of {len(os.fsencode(fname))} bytes; file systems take at "
                "most 255: give the object a shorter name"
            )
    for _, tables, _ in parts.values():
        for table in tables.values():
            table.store.check_open()  # a closed table: refused before the directory exists
    metas = {name: _encode_numpy(meta) for name, (_, _, meta) in parts.items()}
    _check_loadable(metas)  # before anything is written, the directory included
    d = as_path(directory, "directory", allow_empty=True) or "."  # ('': os.path.dirname's)
    if os.path.exists(d) and not os.path.isdir(d):
        raise GadgetFileError(
            f"save_checkpoint: {d} is an existing file; expected a directory (or a path "
            "where one can be created)"
        )
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as exc:
        raise GadgetFileError(
            f"save_checkpoint: cannot create the checkpoint directory {d} ({exc})"
        ) from exc
    previous = _listed_files(d)
    entries: dict[str, Any] = {}
    tmp = os.path.join(
        d, "." + _META + ".tmp"
    )  # hidden; a killed save leaves it, the next overwrites it
    written: list[str] = []
    try:
        for name, (kind, tables, _) in parts.items():
            files = {}
            for tname, table in tables.items():
                fname = names[(name, tname)]
                written.append(fname)  # before the save: whatever it leaves goes on failure
                table.save(os.path.join(d, fname), format=format, progress=progress)
                files[tname] = fname
            entries[name] = {"kind": kind, "tables": files, "meta": metas[name]}
        meta_path = os.path.join(d, _META)
        # a full disk: torch's writer raises RuntimeError, the file system OSError
        with save_errors(meta_path, "write it", also=(RuntimeError,)):
            torch.save({"version": _VERSION, "format": format, "objects": entries}, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())  # complete on disk before it names the new files
        # a Ctrl-C from here on is held: once meta.pt names the new files, the previous
        # checkpoint's are removed before it is raised (saying the checkpoint was written)
        with interrupts_deferred() as held:
            held()  # the last point where the save stops
            replace_atomically(tmp, meta_path)
            held.committed = True
            _remove_stale(d, parts, entries, previous)
    except BaseException:
        # this save's files are a full copy of the tables (and a full disk the likeliest
        # cause): remove them, so the previous checkpoint is all that is left, as it was
        # (a removal that fails itself must not hide the error that brought us here)
        with contextlib.suppress(OSError):
            _remove(tmp)
        if set(written) & _listed_files(d):  # an interrupt just after meta.pt took its place
            raise
        for fname in written:
            with contextlib.suppress(OSError):
                _remove(os.path.join(d, fname))
                real = os.path.realpath(os.path.join(d, fname))
                pattern = os.path.join(
                    glob.escape(os.path.dirname(real)),
                    glob.escape(temp_prefix(real)) + "*",
                )
                for stray in glob.glob(pattern):  # a temporary a failed write left
                    _remove(stray)
        raise
    held.deliver(f"the checkpoint in {d}")


def _remove_stale(
    d: str, parts: dict[str, Any], entries: dict[str, Any], previous: set[str]
) -> None:
    """After a checkpoint's meta.pt took its place: remove the previous checkpoint's
    tables, those of saves that died part-way, which nothing names any more, and the
    hidden partial table files such saves left (those of a process still running are
    kept). The checkpoint is written by then: a file that cannot be removed is a
    ``UserWarning`` naming it, not an error."""
    current = {f for e in entries.values() for f in e["tables"].values()}
    prefixes = [
        re.escape(f"{name}.{tname}.") for name, (_, tables, _) in parts.items() for tname in tables
    ]
    stale: set[str] = set()
    if prefixes:
        alt = "|".join(prefixes)
        ours = re.compile("^(?:" + alt + r")[0-9a-f]{8}\.")
        partial = re.compile(r"^\.(?:" + alt + r")[0-9a-f]{8}\..*\.partial-([0-9]+)-[0-9a-f]{8}$")
        for f in os.listdir(d):
            m = partial.match(f)
            if ours.match(f) or (m is not None and not _process_alive(int(m.group(1)))):
                stale.add(f)
    left = []
    for fname in sorted((previous | stale) - current):
        try:
            _remove(os.path.join(d, fname))
        except OSError as exc:
            left.append(f"{fname} ({exc.strerror or exc})")
    if left:
        warnings.warn(
            f"save_checkpoint wrote the checkpoint in {d}, but could not remove "
            f"{len(left)} file(s) of an earlier one, which nothing names now: "
            + "; ".join(left[:5])
            + (" ..." if len(left) > 5 else ""),
            UserWarning,
            stacklevel=3,
        )


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this one included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or a pid this system cannot say about
    return True


#: how a NumPy number in an object's meta (an optimizer's ``lr=np.float32(...)``) is kept:
#: ``torch.load(weights_only=True)`` refuses NumPy scalars, and a Python float in its place
#: would change float32 arithmetic after a resume. A user's dict that holds either key is
#: itself wrapped under :data:`_ESCAPE_TAG`, so it never reads back as a NumPy number.
_NUMPY_TAG = "__gadgetloader_numpy_scalar__"
_ESCAPE_TAG = "__gadgetloader_plain_dict__"


def _numpy_value(x: np.generic) -> Any:
    """A Python value that gives ``x`` back exactly: long doubles as decimal strings,
    complex numbers as their two parts (older torch cannot read a Python ``complex``
    with ``weights_only=True``)."""
    if isinstance(x, np.clongdouble):
        return [np.format_float_scientific(v, unique=True) for v in (x.real, x.imag)]
    if isinstance(x, np.complexfloating):
        return [float(x.real), float(x.imag)]
    if isinstance(x, np.longdouble):
        return np.format_float_scientific(x, unique=True)
    return x.item()


def _numpy_scalar(tag: str, value: Any) -> Any:
    kind = np.dtype(tag).type
    if issubclass(kind, np.complexfloating) and isinstance(value, (list, tuple)):
        z = np.zeros((), dtype=kind)  # parts set one by one: exact for inf, -0, nan
        part = np.longdouble if kind is np.clongdouble else float
        z.real, z.imag = (part(v) for v in value)
        return z[()]
    if kind is np.longdouble:
        return np.longdouble(value)
    return kind(value)


def _rebuild(obj: Any, items: Any) -> Any:
    """A container of ``obj``'s exact type holding ``items`` (a dict's as key-value pairs:
    a copy of the dict refilled, so a ``defaultdict`` keeps its factory); a plain dict,
    tuple or list where the type cannot be rebuilt."""
    items = list(items)
    try:
        if isinstance(obj, dict):
            new = copy.copy(obj)
            new.clear()
            new.update(items)
            return new
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*items)
        return type(obj)(items)
    except Exception:
        if isinstance(obj, dict):
            return dict(items)
        return tuple(items) if isinstance(obj, tuple) else items


def _walk(obj: Any, leaf: Any, node: Any) -> Any:
    """``obj`` with ``leaf`` applied to non-containers and ``node`` to dicts; containers
    whose contents did not change are returned as they are (their type kept)."""
    if isinstance(obj, dict):
        return node(obj)
    if isinstance(obj, (list, tuple)):
        items = [_walk(v, leaf, node) for v in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return _rebuild(obj, items)
    return leaf(obj)


def _encode_numpy(obj: Any) -> Any:
    """``obj`` with every NumPy number or bool replaced by a tagged (dtype, value) dict."""

    def leaf(x: Any) -> Any:
        if isinstance(x, (np.number, np.bool_)):
            return {_NUMPY_TAG: x.dtype.str, "value": _numpy_value(x)}
        return x

    def node(d: dict[Any, Any]) -> Any:
        items = {k: _walk(v, leaf, node) for k, v in d.items()}
        same = all(items[k] is d[k] for k in d)
        inner = d if same else _rebuild(d, items.items())
        if _NUMPY_TAG in d or _ESCAPE_TAG in d:
            return {_ESCAPE_TAG: inner}
        return inner

    return _walk(obj, leaf, node)


def _decode_numpy(obj: Any) -> Any:
    """The inverse of :func:`_encode_numpy`."""

    def node(d: dict[Any, Any]) -> Any:
        if set(d) == {_NUMPY_TAG, "value"}:
            return _numpy_scalar(d[_NUMPY_TAG], d["value"])
        if set(d) == {_ESCAPE_TAG} and isinstance(d[_ESCAPE_TAG], dict):
            inner = d[_ESCAPE_TAG]  # a user's dict holding a tag key: its own type kept
            items = {k: _walk(v, lambda x: x, node) for k, v in inner.items()}
            return (
                inner
                if all(items[k] is inner[k] for k in inner)
                else _rebuild(inner, items.items())
            )
        items = {k: _walk(v, lambda x: x, node) for k, v in d.items()}
        if all(items[k] is d[k] for k in d):
            return d
        return _rebuild(d, items.items())

    return _walk(obj, lambda x: x, node)


def _skeleton(obj: Any) -> Any:
    """``obj`` with its tensors left out (they always load): what :func:`_check_loadable`
    needs to try, without a second copy of a module's dense weights."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        return _rebuild(obj, ((k, _skeleton(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, (_skeleton(v) for v in obj))
    return obj


_KIND_TEXT = {
    "module": "a module",
    "offloaded_optimizer": "an OffloadedOptimizer",
    "model_switch": "a model switcher",
    "optimizer_switch": "an optimizer switcher",
}


def _kind_text(kind: Any) -> str:
    """A checkpoint object's kind, as a message names it."""
    return _KIND_TEXT.get(kind, repr(kind)) if isinstance(kind, str) else repr(kind)


def _check_loadable(metas: dict[str, Any]) -> None:
    """Refuse, before writing, what ``load_checkpoint``'s weights-only read would refuse."""
    try:
        buf = io.BytesIO()
        torch.save(_skeleton(metas), buf)
        buf.seek(0)
        torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        why = next(
            (ln for ln in lines if "GLOBAL" in ln or "global" in ln), lines[0] if lines else ""
        )
        raise GadgetTypeError(
            "save_checkpoint: an object's state holds a value that a checkpoint cannot keep "
            "(it is read back with torch.load(weights_only=True), which takes tensors, Python "
            f"numbers, strings and containers of them; NumPy numbers are converted): "
            f"{type(exc).__name__}: {why.strip()}"
        ) from exc


def _listed_files(d: str) -> set[str]:
    """Table files named by the checkpoint already in ``d`` (none if there is none)."""
    meta_path = os.path.join(d, _META)
    if not os.path.exists(meta_path):
        return set()
    try:
        saved = torch.load(meta_path, map_location="cpu", weights_only=True)
        listed = {f for e in saved["objects"].values() for f in e["tables"].values()}
    except Exception:  # an unreadable old meta.pt: leave its files alone
        return set()
    return {f for f in listed if _plain_file_name(f)}  # never a path outside ``d``


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path):  # a zarr array is a directory
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _saved_groups_of(optimizer: Any, objects: Mapping[str, Any], saved: Mapping[str, Any]) -> Any:
    """The ``param_groups`` a checkpoint saved for ``optimizer`` (a torch optimizer loaded in
    the same call), else None."""
    for name, obj in objects.items():
        entry = saved.get(name)
        if obj is optimizer and isinstance(entry, Mapping) and entry.get("kind") == "optimizer":
            meta = entry.get("meta")
            sd = meta.get("state_dict") if isinstance(meta, Mapping) else None
            if isinstance(sd, Mapping):
                return sd.get("param_groups")
    return None


def _pager_for(obj: Any, tname: str) -> tuple[Any, str] | None:
    """(pager, state key) a checkpoint table name of an optimizer object would belong to."""
    if isinstance(obj, OffloadedOptimizer):
        index, _, key = tname.partition(".")
        if index.isdigit() and int(index) < len(obj.pagers) and key:
            return obj.pagers[int(index)], key
    if isinstance(obj, OptimizerSwitch) and tname:
        return obj._need_pager(), tname
    return None


def _check_shape(shape: tuple[int, ...], path: str, fmt: str, dtype: torch.dtype) -> None:
    """Refuse a state-table file that is missing, unreadable or of another shape or dtype."""
    src = _io.open_source(path, format=fmt)
    try:
        got, got_dtype = tuple(src.shape), src.dtype
    finally:
        src.close()
    if got != shape or got_dtype != dtype:
        raise table_mismatch(
            got == shape,
            f"{path} holds a {got} {dtype_name(got_dtype)} table; expected a {shape} "
            f"{dtype_name(dtype)} one (the dtype of this optimizer's other state tables)",
        )


def _check_table(table: DataGadget, path: str, fmt: str) -> None:
    """Refuse a closed table, and a table file that is missing, unreadable or of another
    shape or dtype."""
    table.store.check_open()
    src = _io.open_source(path, format=fmt)
    try:
        shape, dtype = tuple(src.shape), src.dtype
    finally:
        src.close()
    if shape != table.shape or dtype != table.dtype:
        raise table_mismatch(
            shape == table.shape,
            f"{path} holds a {shape} {dtype_name(dtype)} table; expected {table.shape} {dtype_name(table.dtype)}",
        )


def _check_module(name: str, obj: nn.Module, saved_sd: Mapping[str, Any]) -> None:
    """Refuse a saved module state that does not fit ``obj`` (keys or shapes)."""
    _embedding._EXTERNAL_TABLES.append(True)
    try:
        own = obj.state_dict()
    finally:
        _embedding._EXTERNAL_TABLES.pop()
    paged = _paged_names(obj)
    missing = sorted(k for k in own if k not in saved_sd and k not in paged)
    unexpected = sorted(k for k in saved_sd if k not in own)
    if missing or unexpected:
        raise GadgetValueError(
            f"checkpoint object {name!r} does not fit this model: missing keys "
            f"{missing}, unexpected keys {unexpected}"
        )
    for k, v in saved_sd.items():
        mine = own[k]
        if k in paged or not isinstance(v, torch.Tensor) or not isinstance(mine, torch.Tensor):
            continue
        if tuple(v.shape) != tuple(mine.shape):
            raise GadgetValueError(
                f"checkpoint object {name!r}: {k} has shape {tuple(v.shape)} in the checkpoint; "
                f"this model's is {tuple(mine.shape)}"
            )


def _check_optimizer(name: str, opt: torch.optim.Optimizer, saved_sd: Mapping[str, Any]) -> None:
    """Refuse a saved optimizer state that does not fit ``opt`` (its groups, their
    options, state tensors without values; see :func:`check_optimizer_state`)."""
    check_optimizer_state(opt, saved_sd, f"checkpoint object {name!r}")


def _verify_rows(path: str, fmt: str) -> None:
    """Read every row of a table file through the reader a load uses, discarding them
    (one staging block of memory), so a damaged chunk is found before anything changes."""
    src = _io.open_source(path, format=fmt)
    try:
        if src.format == "npy":  # opening it checked the header against the file's size
            return
        rpb = max(1, STAGING_BYTES // max(1, src.row_nbytes))
        c = max(1, int(src.chunk_rows))
        rpb = max(c, rpb // c * c)  # whole chunks: each is decoded once
        buf = np.empty((min(rpb, src.num_rows), *src.shape[1:]), dtype=src.numpy_dtype)
        for start, stop in blocks(src.num_rows, rpb):
            src.read_into(start, stop, buf[: stop - start])
    finally:
        src.close()


#: what each kind of entry keeps in its ``meta``
_META_KEYS = {
    "module": ("state_dict",),
    "optimizer": ("state_dict",),
    "offloaded_optimizer": ("inner",),
    "optimizer_switch": ("scalars",),
}


def _damaged(meta_path: str, what: str) -> GadgetFileError:
    return GadgetFileError(f"{meta_path} is damaged or was not written by save_checkpoint: {what}")


def _check_entry(meta_path: str, name: str, entry: Any) -> None:
    """Refuse an object entry of ``meta.pt`` that lacks what a load reads."""
    if not isinstance(entry, Mapping) or not {"kind", "tables", "meta"} <= set(entry):
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        raise _damaged(
            meta_path, f"object {name!r} should have 'kind', 'tables' and 'meta'; got {got}"
        )
    tables = entry["tables"]
    if not isinstance(tables, Mapping) or not all(
        isinstance(t, str) and _plain_file_name(f) for t, f in tables.items()
    ):
        raise _damaged(
            meta_path,
            f"object {name!r} should map table names to file names in the checkpoint "
            f"directory; got {tables!r}"[:500],
        )
    meta = entry["meta"]
    keys = _META_KEYS.get(entry["kind"], ()) if isinstance(entry["kind"], str) else ()
    if keys and (not isinstance(meta, Mapping) or not set(keys) <= set(meta)):
        got = sorted(map(str, meta)) if isinstance(meta, Mapping) else type(meta).__name__
        raise _damaged(
            meta_path,
            f"the meta of {entry['kind']} object {name!r} should hold {list(keys)}; got {got}",
        )


def load_checkpoint(
    directory: str | os.PathLike[str], objects: Mapping[str, Any], *, verify: bool = True
) -> None:
    """Restore what :func:`save_checkpoint` wrote into freshly built, identically configured objects.

    Every object is checked against the checkpoint (names, kinds, table files, shapes,
    dtypes, module keys, optimizer parameter groups) before any of them is changed, so a
    checkpoint that does not fit leaves every object as it was.

    Parameters
    ----------
    directory : path
        What :func:`save_checkpoint` wrote (``''``: the working directory).
    objects : mapping of name to object
        The objects to restore, under the names they were saved with.
    verify : bool, default True
        Before changing anything, read every HDF5 / zarr table file through, chunk by
        chunk, and discard the rows, so a damaged or truncated chunk raises with every
        object left as it was (a ``.npy`` file needs only its header checked against the
        file's size). This costs one extra read of those table files (about doubling a
        load's disk reads and decompression), with one staging block (64 MiB) of RAM, never
        the table's size. ``verify=False`` skips it; a damaged chunk then still raises,
        but objects and tables loaded before it keep the checkpoint's state.

    Raises
    ------
    GadgetFileNotFoundError
        No ``meta.pt`` in ``directory`` (the checkpoint is missing or incomplete).
    GadgetFileError
        A ``meta.pt`` that is damaged or not a checkpoint, or a table file that is
        damaged or truncated.
    GadgetTypeError
        ``objects`` is not a mapping of str names to objects, ``directory`` is not a
        path, or a table file fits its table's shape but not its dtype.
    GadgetKeyError, GadgetValueError
        An object name, kind, table name or shape that does not match.
    GadgetClosedError
        A table of the objects is closed (nothing is loaded).
    """
    _check_objects(objects, "load_checkpoint")
    verify = bool(as_flag(verify, "verify"))
    d = as_path(directory, "directory", allow_empty=True) or "."  # ('': os.path.dirname's)
    meta_path = os.path.join(d, _META)
    if not os.path.exists(meta_path):
        if os.path.exists(d) and not os.path.isdir(d):
            raise GadgetFileNotFoundError(
                f"no checkpoint in {d}: it is a file; expected the directory save_checkpoint wrote",
                meta_path,
            )
        raise GadgetFileNotFoundError(f"no checkpoint in {d}: {_META} is missing", meta_path)
    try:
        saved = torch.load(meta_path, map_location="cpu", weights_only=True)
        fmt = saved["format"]
        saved_objects = _decode_numpy(saved["objects"])
    except Exception as exc:
        raise GadgetFileError(
            f"{meta_path} cannot be read as a gadgetloader checkpoint ({exc})"
        ) from exc
    if not isinstance(saved_objects, Mapping) or not all(isinstance(k, str) for k in saved_objects):
        raise _damaged(
            meta_path, f"'objects' should map names to objects; got {type(saved_objects).__name__}"
        )
    if not isinstance(fmt, str) or fmt not in _io.FORMATS:
        raise _damaged(
            meta_path, f"its tables' format is {fmt!r}; expected one of {sorted(_io.FORMATS)}"
        )
    plan = []
    for name, obj in objects.items():
        if name not in saved_objects:
            raise GadgetKeyError(
                f"the checkpoint has no object {name!r}; it holds {sorted(saved_objects)}"
            )
        entry = saved_objects[name]
        _check_entry(meta_path, name, entry)
        kind, tables, _ = _parts(obj, "load_checkpoint")
        if kind == "module" and ".weight" in entry["tables"] and "weight" not in entry["tables"]:
            # written before session 47, which named a bare module's own table ".weight"
            renamed = {("weight" if t == ".weight" else t): f for t, f in entry["tables"].items()}
            entry = {**entry, "tables": renamed}
        # an optimizer's checkpoint may hold state its hyper-parameters have not turned on
        # yet (a scheduler's momentum): those tables are added once everything is checked
        found = {
            t: _pager_for(obj, t)
            for t in set(entry["tables"]) - set(tables)
            if kind in ("offloaded_optimizer", "optimizer_switch")
        }
        inner = entry["meta"].get("inner") if isinstance(entry["meta"], Mapping) else None
        saved_groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
        missing_groups = saved_groups
        if kind == "optimizer_switch" and (found or set(tables) - set(entry["tables"])):
            # the torch optimizer is an object of its own (its saved options load with it):
            # a state table is allowed if its options, with any that are off turned on, keep
            # it, and may be missing if the options it loads with (saved in this checkpoint
            # too, else as they are now) do not keep it
            torch_opt = obj._need_pager().optimizer
            saved_groups = torch_opt.state_dict()["param_groups"]
            missing_groups = _saved_groups_of(torch_opt, objects, saved_objects) or saved_groups
        extra = {
            t: v
            for t, v in found.items()
            if v is not None and v[1] in v[0].extra_keys_allowed(saved_groups)
        }
        # it may lack state its saved options do not keep (saved before a scheduler turned
        # momentum on): torch drops such state, so those tables start afresh
        missing = {
            t: _pager_for(obj, t)
            for t in set(tables) - set(entry["tables"])
            if kind in ("offloaded_optimizer", "optimizer_switch")
        }
        resets = {
            t: v
            for t, v in missing.items()
            if v is not None and v[1] in v[0].missing_keys_allowed(missing_groups)
        }
        if (
            kind != entry["kind"]
            or len(resets) != len(set(tables) - set(entry["tables"]))
            or len(extra) != len(set(entry["tables"]) - set(tables))
        ):
            # another kind of object is a type error (and, as before, a value error);
            # other tables, a value error
            raise (ObjectKindError if kind != entry["kind"] else GadgetValueError)(
                f"checkpoint object {name!r} is {_kind_text(entry['kind'])} with tables "
                f"{sorted(entry['tables'])}; got {_kind_text(kind)} with tables {sorted(tables)}"
            )
        meta = entry["meta"]
        if kind == "module":
            _check_module(name, obj, meta["state_dict"])
            waiting = [
                n
                for n, m in obj.named_modules()
                if isinstance(m, _OffloadedTable) and m._blocks_load()
            ]
            if waiting:
                raise GadgetValueError(
                    f"checkpoint object {name!r}: training lookups of {waiting} have gradients "
                    "and wait for step() (their rows were read before this load and would "
                    "overwrite it); load before the forward or after step()"
                )
        elif kind == "optimizer":
            check_optimizer_kind(meta, obj, f"checkpoint object {name!r}")
            _check_optimizer(name, obj, meta["state_dict"])
        elif kind == "optimizer_switch" and isinstance(meta, Mapping):
            pager = obj._need_pager()
            check_optimizer_kind(meta, pager.optimizer, f"checkpoint object {name!r}")
            saved_scalars = meta.get("scalars")
            keeps = set(pager.layout.init_scalars)
            if isinstance(saved_scalars, Mapping) and keeps - set(saved_scalars):
                # kept from construction on: without them the state rows would load with
                # the step count restarted
                raise GadgetValueError(
                    f"checkpoint object {name!r}: the saved optimizer state lacks "
                    f"{sorted(keeps - set(saved_scalars))}, which this "
                    f"{optimizer_kind(pager.optimizer)} keeps (got {sorted(saved_scalars)})"
                )
            # written before the class was recorded: its scalar state must be this one's
            if (
                meta.get("optimizer") is None
                and isinstance(saved_scalars, Mapping)
                and saved_scalars
                and set(saved_scalars) != keeps
            ):
                raise GadgetValueError(
                    f"checkpoint object {name!r}: the saved optimizer state has scalars "
                    f"{sorted(saved_scalars)}; this {optimizer_kind(pager.optimizer)} keeps "
                    f"{sorted(keeps)} (state of another optimizer class?)"
                )
        elif kind == "offloaded_optimizer":
            check_optimizer_kind(meta, obj.inner, f"checkpoint object {name!r}")
            if meta.get("optimizer") is None:  # written before the class was recorded
                obj._check_untagged(meta["inner"], f"checkpoint object {name!r}")
            obj.check_inner_state(meta["inner"], f"checkpoint object {name!r}")
            obj._probe_saved_groups(meta["inner"], f"checkpoint object {name!r}")
        _refuse_mid_step(name, obj, "loading")
        files = {t: os.path.join(d, f) for t, f in entry["tables"].items()}
        for pager, key in resets.values():
            pager.tables[key].store.check_open()  # a closed table to reset: nothing loads
        for tname, path in files.items():
            if tname in extra:
                pager, key = extra[tname]
                first = next(iter(pager.tables.values()), None)
                dtype = first.dtype if first is not None else pager.param.dtype
                _check_shape(pager.table_shape(), path, fmt, dtype)
            else:
                _check_table(tables[tname], path, fmt)
        plan.append((obj, kind, tables, meta, files, extra, resets))
    if verify:  # a damaged chunk raises here, before anything below changes an object
        for *_, files, _, _ in plan:
            for path in files.values():
                _verify_rows(path, fmt)
    for obj, kind, tables, meta, files, extra, resets in plan:
        for tname, (pager, key) in extra.items():
            first = next(iter(pager.tables.values()), None)
            tables[tname] = pager.add_row_key(
                key, first.dtype if first is not None else pager.param.dtype
            )
        if kind == "module":
            _embedding._EXTERNAL_TABLES.append(True)
            try:
                obj.load_state_dict(meta["state_dict"], strict=False)
            finally:
                _embedding._EXTERNAL_TABLES.pop()
        elif kind == "optimizer":
            obj.load_state_dict(meta["state_dict"])
            keep_saved_scalar_dtypes(obj, meta["state_dict"])
        elif kind == "offloaded_optimizer":
            obj._load_inner(meta["inner"])
        switch_pager = None
        if kind == "optimizer_switch":
            # follow the torch optimizer's groups (loaded just before, if it came first)
            # before the tables load: a pager that never stepped refills its tables when the
            # hyper-parameters moved (Rprop's step_size from lr), which must not wipe them
            switch_pager = obj._need_pager()
        for tname, path in files.items():
            tables[tname].load(path, format=fmt)
        for pager, key in resets.values():
            pager.reset_row_keys([key])
        if switch_pager is not None:
            switch_pager.set_scalar_state(meta["scalars"])
        elif kind == "offloaded_optimizer":
            for pager in obj.pagers:
                pager.mark_loaded()
