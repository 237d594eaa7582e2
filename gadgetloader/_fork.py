"""Objects holding CUDA resources are never destroyed in a forked child.

A ``DataLoader`` worker forked from a process that used CUDA inherits all of its
parent's objects. Destroying one there that holds a CUDA resource -- a
``torch.cuda.Event``, a CUDA tensor, page-locked memory that took part in an
asynchronous copy -- calls into CUDA, which cannot work in a forked child, and torch
aborts the worker from inside the destructor (``CUDA error: initialization error``,
then ``DataLoader worker ... is killed by signal: Aborted``). The objects that die in a
worker are those its parent had left in reference cycles: the child's garbage collector
frees them. Objects registered here are instead kept alive for the child's whole life;
a worker ends with ``os._exit``, so they are never destroyed there (the child's memory
is a copy: nothing is held longer in the parent).

Per-thread buffers (a thread's page-locked id pair, its staging buffer) are registered
too: in the child, Python clears the states of every thread but the forking one before
any at-fork hook runs, which frees their ``threading.local`` values. So the parent takes
strong references to everything registered just before the fork (the child inherits
them, and keeps them) and drops them in the parent just after it.

Unregistered objects are covered as well where the parent had started CUDA: a child of
such a process never collects the reference cycles it inherited. Just before the fork the
parent disables the garbage collector (a flag: no collection can start in the child before
the next step; the collector's lists are not touched in the parent, where another thread
may be paused halfway through a collection); first thing in the child, every object the
collector tracks is moved to its permanent generation (:func:`gc.freeze`) and the
collector is enabled again, as it is in the parent just after the fork. So no cycle of
the parent's -- a CuPy array, kernel or stream, a CUDA event or tensor of a caller's
own -- is ever destroyed in the child (on the H200, collecting such garbage in a forked
child killed it with a segmentation fault); objects the child makes are collected as
usual.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from typing import Any, TypeVar

_T = TypeVar("_T")

#: objects to keep alive in a forked child, by id (held weakly here; keyed by id so that
#: no two objects are ever compared, which for tensors would compare their elements)
_HOLDERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
#: in a forked child: the registered objects that were alive at the fork
_KEPT: list[Any] = []
#: in the parent, from just before a fork to just after it: strong references to the
#: registered objects (the child's copy of this list keeps them alive)
_AT_FORK: list[Any] = []


def _weakref_unsafe_types() -> tuple[type, ...]:
    """Types whose instances must not be held here: torch's streams and events. Some
    torch versions (2.11 among them; fixed upstream by pytorch PR #183403) free a
    ``torch.cuda.Stream`` or ``torch.cuda.Event`` without clearing the weak references
    to it, so the registry would keep a reference into freed memory; :func:`_before_fork`
    reading it, or the registry's teardown at exit, then corrupts the allocator (the
    segmentation faults seen on the H200 up to session 41). Register the Python object
    that owns such a stream or event instead."""
    if _UNSAFE:
        return _UNSAFE[0]
    torch = sys.modules.get("torch")
    if torch is None:
        return ()  # (nothing of torch's can be passed in yet: asked again next time)
    found: list[type] = []
    for owner, names in ((torch, ("Stream", "Event")), (torch.cuda, ("Stream", "Event"))):
        for name in names:
            kind = getattr(owner, name, None)
            if isinstance(kind, type):
                found.append(kind)
    _UNSAFE.append(tuple(found))
    return _UNSAFE[0]


#: the answer of :func:`_weakref_unsafe_types`, once torch is imported
_UNSAFE: list[tuple[type, ...]] = []


def keep_in_forked_child(obj: _T) -> _T:
    """Register ``obj`` (weakly) so that a process forked while it is alive never
    destroys it; returns ``obj`` (an object that takes no weak reference is left alone).

    Raises ``TypeError`` for a torch stream or event (see :func:`_weakref_unsafe_types`):
    register the Python object that owns it."""
    unsafe = _weakref_unsafe_types()
    if unsafe and isinstance(obj, unsafe):
        raise TypeError(
            f"keep_in_forked_child: a {type(obj).__module__}.{type(obj).__qualname__} "
            "cannot be registered (some torch versions free streams and events without "
            "clearing weak references to them); register the Python object that owns it"
        )
    with contextlib.suppress(TypeError):
        _HOLDERS[id(obj)] = obj
    return obj


#: from just before a fork to just after it: whether the child must freeze the garbage
#: collector's objects (the parent had started CUDA), and whether the collector was
#: enabled (it is disabled across the fork, so no collection runs in the child before the
#: freeze)
_FREEZE_IN_CHILD: list[bool] = [False]
_GC_WAS_ENABLED: list[bool] = [False]


def _cuda_started() -> bool:
    """Whether this process has started CUDA (through torch or CuPy); asks without
    starting it (a fork must not be what starts CUDA)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                return True
    if sys.modules.get("cupy") is None:
        return False
    try:  # CuPy started CUDA here if this thread has a current context (the driver
        # API answers without making one; it refuses before the driver is started)
        from cupy.cuda import driver

        return bool(driver.ctxGetCurrent())
    except Exception:  # noqa: BLE001 - no driver, no CuPy CUDA: nothing started
        return False


def _before_fork() -> None:
    _AT_FORK[:] = list(_HOLDERS.values())
    _FREEZE_IN_CHILD[0] = _cuda_started()
    if _FREEZE_IN_CHILD[0]:
        # only a flag: the collector's lists are not touched here, where another thread
        # may be halfway through a collection (paused in a finalizer)
        _GC_WAS_ENABLED[0] = gc.isenabled()
        gc.disable()


def _after_fork_in_parent() -> None:
    _AT_FORK.clear()
    if _FREEZE_IN_CHILD[0]:
        _FREEZE_IN_CHILD[0] = False
        if _GC_WAS_ENABLED[0]:
            gc.enable()


def _after_fork_in_child() -> None:
    _KEPT.extend(_AT_FORK)
    _AT_FORK.clear()
    if _FREEZE_IN_CHILD[0]:
        _FREEZE_IN_CHILD[0] = False
        gc.freeze()  # everything inherited: never collected here
        if _GC_WAS_ENABLED[0]:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
