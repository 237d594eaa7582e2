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
such a process never collects the reference cycles it inherited. The parent moves every
object the garbage collector tracks to its permanent generation just before the fork
(:func:`gc.freeze`, a constant-time list move) and back just after it
(:func:`gc.unfreeze`); the child keeps them frozen, so no cycle of its parent's -- a
CuPy array, kernel or stream, a CUDA event or tensor of a caller's own -- is ever
destroyed there. Objects the child makes are collected as usual. A process that froze
objects itself (``gc.get_freeze_count() > 0``) keeps its freeze untouched: its child
then freezes what it inherited first thing after the fork instead.
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


def keep_in_forked_child(obj: _T) -> _T:
    """Register ``obj`` (weakly) so that a process forked while it is alive never
    destroys it; returns ``obj`` (an object that takes no weak reference is left alone)."""
    with contextlib.suppress(TypeError):
        _HOLDERS[id(obj)] = obj
    return obj


#: in the parent, from just before a fork to just after it: whether this module froze the
#: garbage collector's objects for the fork (and so unfreezes them after it), and whether
#: the child must freeze them itself (the parent had started CUDA but had frozen objects
#: of its own, which an unfreeze would release)
_FROZE: list[bool] = [False]
_FREEZE_IN_CHILD: list[bool] = [False]


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
    _FROZE[0] = _FREEZE_IN_CHILD[0] = False
    if _cuda_started():
        if gc.get_freeze_count() == 0:
            gc.freeze()  # the child inherits them frozen: never collected there
            _FROZE[0] = True
        else:  # objects frozen by someone else stay so: the child freezes on its side
            _FREEZE_IN_CHILD[0] = True


def _after_fork_in_parent() -> None:
    _AT_FORK.clear()
    _FREEZE_IN_CHILD[0] = False
    if _FROZE[0]:
        _FROZE[0] = False
        gc.unfreeze()


def _after_fork_in_child() -> None:
    _KEPT.extend(_AT_FORK)
    _AT_FORK.clear()
    if _FREEZE_IN_CHILD[0]:
        gc.freeze()
    _FROZE[0] = _FREEZE_IN_CHILD[0] = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
