"""Tables whose rows sit side by side in one buffer: a table and its optimizer states.

A random row of a multi-GB host table costs the GPU one address translation of the
host page it lies in, and past ~2 GB those translations, not the link, bound a
sparse gather (DESIGN.md). A training step touches the same ids in a table and in
each of its optimizer states (Adam: three tables). Laid out separately, each row
costs three translations; interleaved -- row ``i`` of every table in one
``slots x row`` block -- the slots of a row share their pages, and consecutive
slots move as one wide row (see ``transfer._kernels``). Measured on the H200 with
two 10M x 128 float32 tables' worth of rows: 28,000 sparse rows of three 5 GB
tables gathered in 2.08 ms (20.6 GB/s) separately and in 0.87 ms (49.4 GB/s)
interleaved; scattered in 2.41 against 0.94 ms.

A :class:`SlotStore` is one slot of such a buffer, seen as an ordinary store of
``num_rows`` rows whose row pitch is the whole block. The buffer is freed when
every slot is closed (or collected).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ._base import Store

__all__ = ["SlotStore"]


class _Group:
    """The shared buffer and which of its slots are still open."""

    def __init__(self, parent: Store, nslots: int) -> None:
        self.parent = parent
        self.nslots = nslots
        self.open = set(range(nslots))
        self.lock = threading.Lock()

    def release(self, slot: int) -> None:
        with self.lock:
            self.open.discard(slot)
            last = not self.open
        if last:
            self.parent.close()


class SlotStore(Store):
    """Slot ``slot`` of an interleaved table: rows ``parent[:, slot]``.

    Behaves as a store of the parent's placement (``pinned`` or ``cpu``) whose
    views are strided (row pitch = the parent's row). Gathers and scatters of
    consecutive slots of one parent with the same ids move whole wide rows.
    """

    #: :meth:`DataGadget.load` writes a file's rows into this slot instead of
    #: replacing the store, so the table stays interleaved with its states
    load_in_place = True

    def __init__(self, group: _Group, slot: int) -> None:
        parent = group.parent
        super().__init__((parent.num_rows, *parent.row_shape[1:]), parent.dtype)
        self._group: _Group | None = group
        self._slot = int(slot)
        self._placement = parent.placement
        hv = parent.host_view()
        self._host: torch.Tensor | None = hv[:, slot] if hv is not None else None
        self._dev: torch.Tensor | None = None
        # a slot store collected without close() (an optimizer's state table that went
        # away with it) gives its slot back too: the shared buffer is freed with the last
        self._fin = weakref.finalize(self, group.release, self._slot)
        self._fin.atexit = False

    @property  # type: ignore[misc]
    def placement(self) -> str:  # type: ignore[override]
        return self._placement

    @property
    def slot(self) -> int:
        """This table's slot in the shared rows."""
        return self._slot

    @property
    def nslots(self) -> int:
        """Tables sharing the rows."""
        return self._group.nslots if self._group is not None else 0

    def host_view(self) -> torch.Tensor | None:
        return self._host

    def device_view(self) -> torch.Tensor | None:
        if self._dev is None and self._group is not None:
            dv = self._group.parent.device_view()
            if dv is not None:
                self._dev = dv[:, self._slot]
        return self._dev

    def gpu_view_in_use(self) -> torch.Tensor | None:
        # kernels may have used the shared buffer through another slot's (or a fused) view
        return self._group.parent.gpu_view_in_use() if self._group is not None else None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle (or deep-copy) by value as an ordinary ``cpu`` store of this slot's rows:
        the copy no longer shares rows with the other slots. (A ``pinned`` table's gadget
        refuses pickling before it gets here.)"""
        self.check_open()
        hv = self._host
        if hv is None or self._placement != "cpu":
            raise TypeError(
                f"a {self._placement} table shared with its optimizer state cannot be pickled"
            )
        from ._memory import rows_by_value

        return rows_by_value(hv)

    def _release(self) -> None:
        group, self._group = self._group, None
        self._host = None
        self._dev = None
        self._fin.detach()
        if group is not None:
            group.release(self._slot)


def interleave(parent: Store) -> list[SlotStore]:
    """One :class:`SlotStore` per slot of ``parent`` (shape ``(rows, slots, *row)``)."""
    if len(parent.shape) < 2 or parent.shape[1] < 1:
        raise ValueError(f"an interleaved table has shape (rows, slots, ...); got {parent.shape}")
    group = _Group(parent, parent.shape[1])
    return [SlotStore(group, k) for k in range(parent.shape[1])]


def slot_info(store: Any) -> tuple[Any, int] | None:
    """(the shared group, slot) of a :class:`SlotStore`, else None."""
    if isinstance(store, SlotStore) and store._group is not None:
        return store._group, store.slot
    return None
