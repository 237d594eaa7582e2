"""A forked child of a process that started CUDA never collects the reference cycles it
inherited (``gadgetloader._fork``): the parent freezes the garbage collector's objects
for the fork and unfreezes them after it; the child keeps them frozen."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

import gadgetloader  # noqa: F401 - registers the at-fork hooks
from gadgetloader import _fork

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]


def _cycle_with_finalizer(log, tag: str) -> None:
    """Leave a reference cycle whose object logs ``<pid> <tag>`` when it is destroyed."""

    class Node:
        def __del__(self) -> None:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {tag}\n")

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]


def _fork_and_collect(log) -> int:
    """Fork; the child collects garbage (its inherited cycles and one of its own) and
    exits; returns the child's pid after checking it exited with 0."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            gc.collect()
            _cycle_with_finalizer(log, "child-made")
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    return pid


def _lines(log, pid: int) -> list[str]:
    text = log.read_text() if log.exists() else ""
    return sorted(line.split(" ", 1)[1] for line in text.splitlines() if line.startswith(f"{pid} "))


@pytest.fixture
def no_garbage():
    gc.collect()
    was = gc.isenabled()
    gc.disable()  # no collection between making the cycle and the fork
    yield
    if was:
        gc.enable()


def test_child_of_a_cuda_process_never_collects_inherited_cycles(tmp_path, monkeypatch, no_garbage):
    log = tmp_path / "freed"
    monkeypatch.setattr(_fork, "_cuda_started", lambda: True)
    # (Python 3.12 counts immortal objects a collection met as frozen: a few hundred)
    frozen_before = gc.get_freeze_count()
    _cycle_with_finalizer(log, "inherited")
    pid = _fork_and_collect(log)
    # the inherited cycle did not die in the child; what the child made itself did
    assert _lines(log, pid) == ["child-made", "child-made"]
    # the parent is as before: nothing more frozen, and its own cycle is collected here
    assert gc.get_freeze_count() == frozen_before
    gc.collect()
    assert _lines(log, os.getpid()) == ["inherited", "inherited"]


def test_child_of_a_process_without_cuda_collects_as_usual(tmp_path, monkeypatch, no_garbage):
    log = tmp_path / "freed"
    monkeypatch.setattr(_fork, "_cuda_started", lambda: False)
    frozen_before = gc.get_freeze_count()
    _cycle_with_finalizer(log, "inherited")
    pid = _fork_and_collect(log)
    assert _lines(log, pid) == ["child-made", "child-made", "inherited", "inherited"]
    assert gc.get_freeze_count() == frozen_before
    gc.collect()
    assert _lines(log, os.getpid()) == ["inherited", "inherited"]


def test_a_callers_own_freeze_is_left_as_it_was(tmp_path, monkeypatch, no_garbage):
    """A process that froze objects itself keeps its freeze across the fork (the parent
    does not unfreeze); its child freezes what it inherited on its own side."""
    log = tmp_path / "freed"
    monkeypatch.setattr(_fork, "_cuda_started", lambda: True)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        _cycle_with_finalizer(log, "inherited")  # made after the caller's freeze
        pid = _fork_and_collect(log)
        assert _lines(log, pid) == ["child-made", "child-made"]
        # not unfrozen by the fork (objects frozen here may since have died, no more)
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    gc.collect()
    assert _lines(log, os.getpid()) == ["inherited", "inherited"]


def test_collector_state_across_the_fork(monkeypatch):
    """The collector is enabled again on both sides (it is off only across the fork), and
    the child starts with everything it inherited frozen."""
    monkeypatch.setattr(_fork, "_cuda_started", lambda: True)
    assert gc.isenabled()
    gc.collect()
    frozen = gc.get_freeze_count()  # (Python 3.12: immortal objects met by a collection)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, f"{gc.isenabled()} {gc.get_freeze_count() > frozen}".encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    got = os.read(r, 100).decode()
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert got == "True True"
    assert gc.isenabled()


def test_cuda_started_is_false_without_cuda_and_starts_nothing():
    """The question asked before every fork never starts CUDA itself."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        assert _fork._cuda_started() is True
        return
    assert _fork._cuda_started() is False
    assert not torch.cuda.is_initialized()


@pytest.mark.gpu
def test_child_of_a_cuda_process_keeps_its_parents_cuda_objects(tmp_path):
    """A real CUDA process (its own interpreter) leaves CUDA events, CUDA and page-locked
    tensors and CuPy arrays in reference cycles, then forks: the child collects garbage
    and exits cleanly, none of them destroyed there."""
    script = textwrap.dedent(
        """
        import gc, os, sys
        import torch
        import gadgetloader
        log = sys.argv[1]

        class Holder:
            def __del__(self):
                with open(log, "a") as f:
                    f.write(f"{os.getpid()}\\n")

        def leave_cycle():
            h = Holder()
            ev = torch.cuda.Event()
            x = torch.ones(1 << 16, device="cuda")
            p = torch.ones(1 << 16).pin_memory()
            x.copy_(p, non_blocking=True)
            ev.record()
            h.objs = [ev, x, p, h]
            try:
                import cupy
                h.objs.append(cupy.arange(1000))
            except ImportError:
                pass

        gc.disable()
        leave_cycle()
        torch.cuda.synchronize()
        before = gc.get_freeze_count()  # (some imports freeze objects of their own)
        pid = os.fork()
        if pid == 0:
            gc.collect()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child", pid, os.WIFEXITED(status) and os.WEXITSTATUS(status))
        print("frozen", gc.get_freeze_count() - before)
        gc.collect()
        print("parent", os.getpid())
        """
    )
    sp = tmp_path / "s.py"
    sp.write_text(script)
    log = tmp_path / "freed"
    r = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", str(sp), str(log)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    child, ok = out["child"].split()
    assert ok == "0", r.stderr[-3000:]
    assert out["frozen"] == "0"
    freed = log.read_text().split() if log.exists() else []
    # destroyed once, in the parent; never in the child
    assert freed == [out["parent"]], (freed, child)
