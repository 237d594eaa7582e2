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
"""

from __future__ import annotations

import contextlib
import os
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


def _before_fork() -> None:
    _AT_FORK[:] = list(_HOLDERS.values())


def _after_fork_in_parent() -> None:
    _AT_FORK.clear()


def _after_fork_in_child() -> None:
    _KEPT.extend(_AT_FORK)
    _AT_FORK.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
