"""Row ids: accept every form users pass, check them once, merge duplicates.

Ids arrive as torch tensors (CPU or CUDA), NumPy or CuPy arrays, lists, ranges or
Python ints, of any integer dtype. :func:`as_ids` turns them into one int64 torch
tensor on the device that will use them and checks the range *before* anything is
written, so a bad id never half-updates a table. (A GPU gather by the row kernels, which
never read outside a table, may run before its ids' check finishes: :func:`checked_after`;
a GPU scatter too, guarded on the GPU by the ids' (smallest, largest) pair, so that it
writes nothing if an id is bad: :func:`start_guarded_check`; or by a flag that the
sort-free merge of its repeated ids raises for an id outside the table: :func:`flag_word`,
as does the slots launch of a gather that reads each distinct row once:
:func:`start_flag_check`.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from ._device import pinned_empty
from ._dtypes import c_order, dtype_name, plain_items
from ._errors import GadgetIndexError, GadgetTypeError, GadgetValueError
from ._fork import keep_in_forked_child

__all__ = [
    "FlagCheck",
    "GuardedCheck",
    "as_ids",
    "check_range",
    "checked_after",
    "flag_word",
    "read_flag",
    "int64_ids",
    "last_writer",
    "LastWriter",
    "range_check_of",
    "start_flag_check",
    "start_guarded_check",
    "start_range_check",
]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _holds_bool(seq: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a (nested) list or tuple holds a Python or NumPy bool anywhere."""
    types = set(map(type, seq))
    if bool in types or np.bool_ in types:
        return True
    arrays = np.ndarray in types or torch.Tensor in types  # 0-d arrays, tensors as elements
    if arrays and any(
        getattr(x, "dtype", None) in (np.bool_, torch.bool)
        for x in seq
        if isinstance(x, (np.ndarray, torch.Tensor))
    ):
        return True
    if list in types or tuple in types:
        return any(_holds_bool(x) for x in seq if isinstance(x, (list, tuple)))
    return False


#: torch's wide unsigned dtypes (torch >= 2.3), read as int64 ids after a range check
_WIDE_UNSIGNED = tuple(
    d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64")) if d is not None
)


def _beyond_int64(v: int) -> GadgetIndexError:
    """The error for an id past int64: it names the id and what ids must be."""
    return GadgetIndexError(
        f"id {v} is out of range: ids must be in [0, 2**63-1] (int64), and below the table's row count"
    )


def _to_tensor(indexes: Any) -> torch.Tensor:
    if isinstance(indexes, torch.Tensor):
        if getattr(indexes, "is_nested", False):
            raise GadgetTypeError("ids must be a dense (strided) tensor; got a nested tensor")
        if indexes.layout != torch.strided:
            raise GadgetTypeError(
                f"ids must be a dense (strided) tensor; got layout {indexes.layout} "
                "(use .to_dense())"
            )
        if indexes.dtype in _WIDE_UNSIGNED:
            # through NumPy, whose uint64 compares without wrapping (torch's wide unsigned
            # dtypes have few operations on older versions); rare, so the copy is fine
            arr = indexes.detach().cpu().numpy()
            if arr.size and int(arr.max()) > np.iinfo(np.int64).max:
                raise _beyond_int64(int(arr.max()))
            return torch.from_numpy(arr.astype(np.int64)).to(indexes.device)
        return indexes
    if isinstance(indexes, np.ndarray):
        if indexes.dtype.kind not in "iu":
            raise GadgetTypeError(
                f"ids must be integers; got a NumPy array of dtype {indexes.dtype}"
            )
        if indexes.dtype == np.uint64:
            if indexes.size and int(indexes.max()) > np.iinfo(np.int64).max:
                raise _beyond_int64(int(indexes.max()))
            indexes = indexes.astype(np.int64)
        elif indexes.dtype in (np.uint16, np.uint32):
            indexes = indexes.astype(np.int64)
        if not indexes.dtype.isnative:
            indexes = indexes.astype(indexes.dtype.newbyteorder("="))
        if not indexes.flags.writeable:  # torch cannot view read-only memory (np.load mmap ids)
            indexes = indexes.copy()
        return torch.from_numpy(c_order(indexes))  # keeps 0-d arrays 0-d
    if hasattr(indexes, "__cuda_array_interface__") or type(indexes).__module__.startswith("cupy"):
        # CuPy (or any CUDA array): no copy through DLPack
        try:
            return torch.from_dlpack(indexes)
        except Exception:
            return torch.as_tensor(indexes, device="cuda")
    if isinstance(indexes, (int, np.integer)) and not isinstance(indexes, bool):
        v = int(indexes)
        if v > np.iinfo(np.int64).max:
            raise _beyond_int64(v)
        if v < np.iinfo(np.int64).min:
            raise GadgetIndexError(f"id {v} is negative: ids address rows from 0")
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(indexes, range):
        # (no len(): a range may be longer than sys.maxsize)
        if not indexes:  # also a step pointing the other way, as Python's
            return torch.empty(0, dtype=torch.int64)
        first, last = indexes[0], indexes[-1]
        lo, hi = min(first, last), max(first, last)
        if hi > np.iinfo(np.int64).max:
            raise _beyond_int64(hi)
        if lo < 0:
            raise GadgetIndexError(f"id {lo} is negative: ids address rows from 0")
        if first == last:  # one id, with any step (also one beyond int64)
            return torch.tensor([first], dtype=torch.int64)
        # every id lies in [0, 2**63), so does the step; arange's end is one step past the
        # last id, which may lie beyond int64 only by less than a step: then build it from 0
        end = last + indexes.step
        big = np.iinfo(np.int64).max
        if -big <= end <= big and abs(end - first) + abs(indexes.step) <= big:
            # (arange computes its length in int64: end - first + step must fit too)
            return torch.arange(first, end, indexes.step, dtype=torch.int64)
        try:
            n = len(indexes)
        except OverflowError:
            raise GadgetValueError(
                f"{indexes} holds more than 2**63 ids; no table has that many rows"
            ) from None
        return torch.arange(n, dtype=torch.int64).mul_(indexes.step).add_(first)
    if isinstance(indexes, (list, tuple)):
        if len(indexes) == 0:
            return torch.empty(0, dtype=torch.int64)
        try:
            items, held = plain_items(indexes, "an id tensor in a list of ids")
            arr = np.asarray(items)
        except ValueError as exc:  # ragged nesting
            raise GadgetTypeError(
                f"ids must form a rectangular array of integers; got a ragged {type(indexes).__name__}"
            ) from exc
        if arr.dtype.kind not in "iu":
            if arr.size == 0:  # [[]]: an empty (1, 0) id array
                return torch.empty(arr.shape, dtype=torch.int64)
            if arr.dtype == object or arr.dtype.kind == "f":
                # NumPy made floats or objects of integers: mixed NumPy scalar types
                # (uint64 with int64), or Python ints beyond int64
                items = _flat_items(indexes)
                if items and all(
                    isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in items
                ):
                    ints = [int(x) for x in items]
                    if max(ints) > np.iinfo(np.int64).max:
                        raise _beyond_int64(max(ints))
                    if min(ints) < np.iinfo(np.int64).min:
                        raise GadgetIndexError(
                            f"id {min(ints)} is negative: ids address rows from 0"
                        )
                    return torch.tensor(ints, dtype=torch.int64).reshape(arr.shape)
            if arr.dtype == object:
                odd = {
                    "Ellipsis" if x is Ellipsis else "None"
                    for x in _flat_items(indexes)
                    if x is Ellipsis or x is None
                }
                if odd:  # (g[..., 0]: NumPy's Ellipsis and newaxis are not indexes here)
                    raise GadgetTypeError(
                        f"ids must be integers; got a {type(indexes).__name__} holding "
                        f"{' and '.join(sorted(odd))} (Ellipsis and None are not indexes here)"
                    )
            raise GadgetTypeError(
                f"ids must be integers; got a {type(indexes).__name__} holding "
                f"{dtype_name(held) if held is not None else arr.dtype} values"
            )
        if _holds_bool(indexes):  # NumPy reads [1, True] as [1, 1]
            raise GadgetTypeError(
                f"ids must be integers; got a {type(indexes).__name__} holding bools "
                "(True / False are not row ids)"
            )
        return _to_tensor(arr)
    raise GadgetTypeError(
        "ids must be a torch tensor, a NumPy or CuPy array, a list, a tuple, a range or an int; "
        f"got {type(indexes).__name__}"
    )


def _flat_items(seq: Any) -> list[Any]:
    """The leaves of a nested list / tuple."""
    out: list[Any] = []
    for x in seq:
        if isinstance(x, (list, tuple)):
            out.extend(_flat_items(x))
        else:
            out.append(x)
    return out


def check_range(ids: torch.Tensor, num_rows: int) -> None:
    """Raise :class:`GadgetIndexError` unless every id is in ``[0, num_rows)``.

    For CUDA ids this reads two numbers back (one stream synchronisation, no
    device-wide synchronisation).
    """
    if ids.numel() == 0:
        return
    if ids.is_cuda:
        lo, hi = torch.aminmax(ids)
        lo_v, hi_v = torch.stack((lo, hi)).tolist()
    else:  # one pass over the ids (min() then max() would take two)
        lo, hi = torch.aminmax(ids)
        lo_v, hi_v = int(lo), int(hi)
    if lo_v < 0 or hi_v >= num_rows:
        raise _range_error(lo_v, hi_v, num_rows, f"min {lo_v}, max {hi_v}")


def _range_error(lo: int, hi: int, num_rows: int, seen: str) -> GadgetIndexError:
    """The error for ids whose smallest is ``lo`` and largest ``hi`` when one of them lies
    outside ``[0, num_rows)``; ``seen`` describes the ids."""
    bad = lo if lo < 0 else hi
    what = "negative" if bad < 0 else "out of range"
    if num_rows == 0:
        return GadgetIndexError(
            f"id {bad} is {what}: this table has no rows, so no id addresses one; "
            "nothing was read or written"
        )
    return GadgetIndexError(
        f"id {bad} is {what}: this table has {num_rows} rows, so ids must be in "
        f"[0, {num_rows - 1}] (ids seen: {seen}); nothing was read or written"
    )


class _Pair:
    """A page-locked pair for the (smallest, largest) id of a check and, per CUDA device,
    0-d CUDA tensors aliasing its two numbers (the GPU writes them to host memory
    directly, so a check is one reduction, with no copy queued after it)."""

    __slots__ = ("buf", "host", "mapped")

    def __init__(self) -> None:
        # (kept in a forked child, which frees other threads' locals: see _fork)
        self.buf = keep_in_forked_child(pinned_empty(2, torch.int64))
        self.host = self.buf.numpy()  # NumPy's view of buf: a read costs no torch call
        self.mapped: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}


#: pairs of threads that have ended, for the next thread that needs one. A pair is never
#: given back to torch's page-locked allocator: a thread may end with a check unfinished,
#: and the GPU's write into the pair through its CUDA alias (which torch does not know
#: of) may still be queued then; the next thread to take the pair first waits for its
#: devices (:func:`_pair`)
_SPARE: list[_Pair] = []


class _Lease:
    """A thread's hold on its pair: handed to :data:`_SPARE` when the thread ends."""

    __slots__ = ("pair",)

    def __init__(self, pair: _Pair) -> None:
        self.pair = pair

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit the list may be gone)
            _SPARE.append(self.pair)


class _Ends(threading.local):
    """Per thread: its :class:`_Lease` (None until the thread's first check)."""

    def __init__(self) -> None:
        self.lease: _Lease | None = None


_ends = _Ends()


def _this_pair() -> _Pair:
    """This thread's pair: a spare one (once the GPU work its last owner queued is done) or
    a new one."""
    lease = _ends.lease
    if lease is not None:
        return lease.pair
    try:
        pair = _SPARE.pop()
    except IndexError:
        pair = _Pair()
    else:
        for index, mapped in pair.mapped.items():
            if mapped is not None:  # its alias may have a write queued by the ended thread
                torch.cuda.synchronize(index)
    _ends.lease = _Lease(pair)
    return pair


def _pair() -> torch.Tensor:
    """This thread's page-locked pair (made, or taken from an ended thread, on first use)."""
    return _this_pair().buf


def _mapped_ends(buf: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """CUDA aliases of ``buf``'s two int64s on device ``index`` (None without CuPy, which
    finds the buffer's device address)."""
    from ._device import cupy_available, get_cupy

    if not cupy_available():
        return None
    cp = get_cupy("range checks")
    try:
        with cp.cuda.Device(index):
            ptr = int(cp.cuda.runtime.pointerGetAttributes(buf.data_ptr()).devicePointer)
            if not ptr:
                # (a thread with no CUDA context of its own yet is told 0.) Page-locked
                # memory has the same address on the device where the device says so for
                # registered memory (it always does for cudaHostAlloc's under UVA);
                # otherwise copy
                attr = getattr(cp.cuda.runtime, "cudaDevAttrCanUseHostPointerForRegisteredMem", 91)
                if cp.cuda.runtime.deviceGetAttribute(attr, index) != 1:
                    return None
                ptr = buf.data_ptr()
            mem = cp.cuda.UnownedMemory(ptr, 16, buf, device_id=index)
            arr = cp.ndarray((2,), dtype=cp.int64, memptr=cp.cuda.MemoryPointer(mem, 0))
            with torch.inference_mode(False):  # (kept across calls, as pinned_empty's)
                pair = torch.from_dlpack(arr)
    except Exception:  # not mapped into this device (or a very old CuPy): copy instead
        return None
    if pair.data_ptr() != ptr or pair.device.index != index:
        return None
    lo, hi = keep_in_forked_child(pair[0]), keep_in_forked_child(pair[1])
    keep_in_forked_child(pair)
    # once per thread and device: the GPU's two numbers must reach the buffer the host reads
    buf.fill_(0)
    with torch.inference_mode(False):
        torch.aminmax(torch.tensor([-3, 7], device=f"cuda:{index}"), out=(lo, hi))
    torch.cuda.current_stream(index).synchronize()
    return (lo, hi) if buf.tolist() == [-3, 7] else None


def flag_word(device: torch.device) -> int | None:
    """The address on CUDA ``device`` of this thread's page-locked int64 flag (the first
    number of the pair that range checks use), for a kernel that reports bad ids by
    writing it (:func:`gadgetloader.transfer._kernels.launch_last_slots`); None where the
    pair is not mapped into the device (no CuPy, no unified addressing). Like the checks,
    a flag must be read (:func:`read_flag`, after the work writing it) before the thread
    starts another check."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mapped = _aliases(_this_pair(), index)
    return None if mapped is None else int(mapped[0].data_ptr())


def _aliases(pair: _Pair, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``pair``'s CUDA aliases on device ``index`` (found on first use)."""
    if index not in pair.mapped:
        pair.mapped[index] = _mapped_ends(pair.buf, index)
    return pair.mapped[index]


def read_flag() -> int:
    """The flag a kernel wrote at :func:`flag_word` (once the work writing it is done)."""
    return int(_this_pair().host[0])


class GuardedCheck:
    """A pending range check of CUDA ids whose (smallest, largest) id also lies in
    ``ends``, a 2-element int64 tensor on the ids' device: a scatter kernel given it
    writes nothing when an id is out of range, so the write can be queued before the
    check's result reaches the host. Calling it finishes the check (waits for the two
    numbers, raises :class:`GadgetIndexError`)."""

    __slots__ = ("_finish", "done", "ends")

    def __init__(self, ends: torch.Tensor, finish: Callable[[], None]) -> None:
        self.ends = ends
        self._finish = finish
        self.done = False

    def __call__(self) -> None:
        """Finish the check once (later calls return at once): wait, then raise if bad."""
        if self.done:
            return
        self.done = True
        self._finish()


def start_guarded_check(ids: torch.Tensor, num_rows: int) -> GuardedCheck:
    """Queue the range check of non-empty CUDA ``ids`` with its two numbers kept on the
    GPU as well (see :class:`GuardedCheck`): one ``aminmax`` into device memory and a
    16-byte copy to the thread's page-locked pair -- the pair :func:`start_range_check`
    uses too, so the check must be finished (called) before the thread starts another,
    also when the write it guards fails."""
    flat = ids.reshape(-1)
    ends = torch.empty(2, dtype=torch.int64, device=ids.device)
    torch.aminmax(flat, out=(ends[0], ends[1]))
    buf = _pair()
    buf.copy_(ends, non_blocking=True)
    done = torch.cuda.current_stream(ids.device).record_event()
    return GuardedCheck(ends, range_check_of(buf, num_rows, done))


class FlagCheck:
    """A range check of CUDA ids fused into the gather that reads them: the gather's
    slots launch (:func:`gadgetloader.transfer._kernels.gather_rows`, given
    :attr:`flag`) sets the thread's page-locked flag word for any id outside the table,
    and :attr:`event` follows that launch. Calling it finishes the check: waits for the
    event (not for the gather), and raises :class:`GadgetIndexError` with the usual
    message if the flag is set. Where the gather did not arm the flag (:attr:`event`
    None), calling it checks the ids the ordinary way. Like the other checks it must be
    finished before the thread starts another."""

    __slots__ = ("event", "flag", "ids", "num_rows")

    def __init__(self, flag: int, ids: torch.Tensor, num_rows: int) -> None:
        self.flag, self.ids, self.num_rows = flag, ids, num_rows
        self.event: Any = None

    def __call__(self) -> None:
        event, self.event = self.event, None
        if event is None:
            check_range(self.ids, self.num_rows)
            return
        event.synchronize()
        if read_flag():
            check_range(self.ids, self.num_rows)  # raises, saying which id
            raise GadgetIndexError(  # (the ids changed after the gather read them)
                f"an id was outside the table ({self.num_rows} rows) when it was read"
            )


def start_flag_check(ids: torch.Tensor, num_rows: int) -> FlagCheck | None:
    """A :class:`FlagCheck` of the CUDA ``ids`` with this thread's flag word zeroed, for a
    gather that takes the flag; None where the word is not mapped into the ids' device
    (then check the ordinary way)."""
    flag = flag_word(ids.device)
    if flag is None:
        return None
    _this_pair().host[0] = 0  # (no GPU work writes it: the thread's last check has finished)
    return FlagCheck(flag, ids, num_rows)


def start_range_check(ids: torch.Tensor, num_rows: int, *, private: bool = False) -> Any:
    """Queue the range check of CUDA ``ids`` on the current stream and return a function
    that finishes it (waits for the two numbers, raises :class:`GadgetIndexError` if an
    id is out of range). Work queued in between runs on the GPU while the check's result
    travels back, so a gather pays no idle round trip for its check.

    The check is one ``aminmax`` writing its two numbers straight into page-locked host
    memory (with CuPy; else a reduction and a copy), so little is queued ahead of the
    work it guards. ``private=True`` gives the check its own pinned buffer (instead of
    the thread's one), for a check left pending while others start (a training lookup's
    deferred check)."""
    if ids.numel() == 0 or not ids.is_cuda:
        check_range(ids, num_rows)
        return _nothing
    flat = ids.reshape(-1)
    stream = torch.cuda.current_stream(ids.device)
    if private:
        buf = pinned_empty(2, torch.int64)
        buf.copy_(torch.stack(torch.aminmax(flat)), non_blocking=True)
        return range_check_of(buf, num_rows, stream.record_event())
    pair = _this_pair()
    buf = pair.buf
    index = ids.device.index if ids.device.index is not None else torch.cuda.current_device()
    mapped = _aliases(pair, index)
    if mapped is None:
        buf.copy_(torch.stack(torch.aminmax(flat)), non_blocking=True)
    else:
        torch.aminmax(flat, out=mapped)
    return range_check_of(buf, num_rows, stream.record_event())


def range_check_of(ends: torch.Tensor, num_rows: int, done: Any) -> Any:
    """A function finishing a range check whose (smallest, largest) id is being copied
    into the pinned pair ``ends`` by GPU work that the event ``done`` follows: it waits
    for the event and raises :class:`GadgetIndexError` if an id is out of range."""

    def finish() -> None:
        done.synchronize()
        lo, hi = ends.tolist()
        if lo < 0 or hi >= num_rows:
            check_range(torch.tensor([lo, hi]), num_rows)  # raises with the usual message

    return finish


def _nothing() -> None:
    return None


def as_ids(
    indexes: Any, num_rows: int, device: torch.device | None = None, *, check: bool = True
) -> torch.Tensor:
    """Convert ``indexes`` to a checked int64 tensor on ``device`` (default: where it is).

    The returned tensor keeps the shape of ``indexes`` (a Python int gives a 0-d tensor).
    ``check=False`` skips the range check of CUDA ids kept on the GPU (it costs one stream
    synchronisation); the kernels still never touch memory outside a table. Ids that end
    on the CPU (``device`` is the CPU) are always checked.

    Raises
    ------
    GadgetTypeError
        Non-integer ids (floats, bools) or an unsupported container.
    GadgetIndexError
        A negative id or one ``>= num_rows``.
    """
    t = int64_ids(indexes, num_rows, device)
    if check or not t.is_cuda:  # CPU ids are checked always: it costs no GPU synchronisation
        check_range(t, num_rows)
    if device is not None and t.device != device:
        t = _upload(t, device) if device.type == "cuda" else t.to(device)
    return t


def int64_ids(indexes: Any, num_rows: int, device: torch.device | None = None) -> torch.Tensor:
    """``indexes`` as an int64 tensor (on the CPU or its CUDA device), not yet checked
    against the table (only a ``range`` past it is refused, before it is built)."""
    if isinstance(indexes, range) and indexes:
        # checked from its ends before it is built (a range far past the table would
        # first take gigabytes)
        lo, hi = min(indexes[0], indexes[-1]), max(indexes[0], indexes[-1])
        if lo < 0 or hi >= num_rows:
            raise _range_error(lo, hi, num_rows, str(indexes))
    t = _to_tensor(indexes)
    if t.dtype == torch.bool:
        raise GadgetTypeError(
            "ids must be integers; got a bool tensor (use mask.nonzero().squeeze(1) for a mask)"
        )
    if t.dtype not in _INT_DTYPES and not (
        t.dtype in (torch.uint16, torch.uint32, torch.uint64) if hasattr(torch, "uint16") else False
    ):
        raise GadgetTypeError(f"ids must be integers; got dtype {t.dtype}")
    if t.device.type not in ("cpu", "cuda"):
        raise GadgetTypeError(f"ids must be on the CPU or a CUDA device; got {t.device}")
    if device is not None and t.is_cuda and device.type == "cuda" and t.device != device:
        raise GadgetTypeError(f"ids are on {t.device} but this table is used from {device}")
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    if device is not None and t.is_cuda and device.type == "cpu":
        # a host table's ids come to the CPU anyway (the copy synchronises): then they are
        # CPU ids, checked for free, since no kernel guards a host table's torch indexing
        t = t.to(device)
    return t


def checked_after(
    ids: torch.Tensor, num_rows: int, device: torch.device
) -> tuple[torch.Tensor, Callable[[], None]]:
    """For a gather to the CUDA ``device`` by the row kernels (which never read outside a
    table, whatever the ids) of the int64 ``ids`` from :func:`int64_ids`: the ids on
    ``device``, *not yet checked*, and the range check to run once the gather is queued,
    which raises :class:`GadgetIndexError` as :func:`as_ids` would.

    CPU ids are uploaded unchecked and checked on the CPU while the GPU gathers, so the
    gather's kernel starts without waiting for the check. CUDA ids are checked by
    :func:`start_range_check`, queued here ahead of the gather (one small reduction); the
    returned function then waits for its two numbers only, not for the gather.
    """
    if ids.numel() == 0:
        return (ids if ids.device == device else ids.to(device)), _nothing
    if not ids.is_cuda:
        cpu = ids
        return _upload(ids, device), lambda: check_range(cpu, num_rows)
    return ids, start_range_check(ids, num_rows)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU ``t`` on the CUDA ``device`` without a synchronising pageable copy: staged in
    page-locked memory from torch's caching host allocator (which reuses a block only once
    the copy reading it has finished), then copied asynchronously; a page-locked ``t`` is
    copied as it is. Two torch calls: a host that has just waited on the GPU runs each
    call several times slower than back to back, and on the H200 this took 91 us of host
    time per call against 146 for a ring of two pinned buffers with its own events
    (DESIGN.md, "CPU ids go up in two torch calls")."""
    if not t.is_contiguous():  # (pin_memory keeps strides: an expanded tensor cannot)
        t = t.contiguous()
    return t.pin_memory().to(device, non_blocking=True)


class LastWriter(NamedTuple):
    """The plan for a scatter with repeated ids: for each *distinct* id the position of
    its last occurrence, in ascending id order.

    ``ids[keep]`` are the distinct ids, sorted; ``pos[keep]`` are the rows of the data
    that win. Entries where ``keep`` is False are repeats that lose and are skipped.
    Keeping the mask (instead of compacting) avoids a GPU->CPU synchronisation.
    """

    ids: torch.Tensor
    pos: torch.Tensor
    keep: torch.Tensor


def last_writer(ids: torch.Tensor) -> LastWriter:
    """Sort ``ids`` (stably) and mark the last occurrence of each distinct id."""
    flat = ids.reshape(-1)
    sorted_ids, pos = torch.sort(flat, stable=True)
    keep = torch.ones_like(sorted_ids, dtype=torch.bool)
    if flat.numel() > 1:
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=keep[:-1])
    return LastWriter(sorted_ids, pos, keep)
