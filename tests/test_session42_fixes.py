"""Session 42's fix: no torch stream or event is held through a weak reference.

The fork registry (:mod:`gadgetloader._fork`) holds the objects it keeps alive in a
forked child through weak references. Some torch versions (2.11, the H200's) free a
``torch.cuda.Stream`` or ``torch.cuda.Event`` without clearing the weak references to
it, and the registry used to hold the hybrid transfer's side stream and each copy's
completion event directly: its later reads and its teardown at exit wrote into freed
memory (the H200 suite's segmentation faults, found in session 41). The registry now
refuses streams and events, and the hybrid transfer registers a plain object that owns
them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import NEEDS_CUPY

from gadgetloader import _fork
from gadgetloader.transfer import _engine


@pytest.mark.parametrize("name", ["Stream", "Event"])
def test_the_fork_registry_refuses_torch_streams_and_events(name: str) -> None:
    kind = getattr(torch, name, None)
    if kind is None:
        pytest.skip(f"this torch has no torch.{name}")
    obj = kind("cpu")
    before = dict(_fork._HOLDERS)
    with pytest.raises(TypeError, match=rf"torch\.{name} cannot be registered.*owns it"):
        _fork.keep_in_forked_child(obj)
    assert dict(_fork._HOLDERS) == before  # nothing registered


def test_the_unsafe_types_include_the_cuda_stream_and_event_classes() -> None:
    unsafe = _fork._weakref_unsafe_types()
    assert torch.cuda.Stream in unsafe and torch.cuda.Event in unsafe
    # (subclasses are refused too: isinstance, not an exact type match)
    assert issubclass(torch.cuda.Stream, unsafe) and issubclass(torch.cuda.Event, unsafe)


def test_other_objects_are_still_registered_and_those_without_weakrefs_left_alone() -> None:
    class Owner:
        pass

    owner = Owner()
    assert _fork.keep_in_forked_child(owner) is owner
    assert _fork._HOLDERS[id(owner)] is owner
    plain = (1, 2)  # takes no weak reference: returned, not registered
    assert _fork.keep_in_forked_child(plain) is plain
    assert id(plain) not in _fork._HOLDERS


def test_each_threads_staging_registers_its_own_side_holder_not_a_stream() -> None:
    def sides() -> list[object]:
        staging = _engine._Staging()
        return [staging.side]

    box: list[object] = []
    t = threading.Thread(target=lambda: box.extend(sides()))
    t.start()
    t.join()
    mine = _engine._staging.side
    assert isinstance(mine, _engine._Side) and isinstance(box[0], _engine._Side)
    assert box[0] is not mine
    assert _fork._HOLDERS[id(mine)] is mine
    assert not any(isinstance(o, _fork._weakref_unsafe_types()) for o in _fork._HOLDERS.values())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_a_registered_side_holder_and_what_it_owns_survive_in_a_forked_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_fork, "_cuda_started", lambda: False)
    side = _fork.keep_in_forked_child(_engine._Side())
    side.done = ["event stand-in"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the holder is among the objects kept for its life
        try:
            kept = any(o is side and o.done == ["event stand-in"] for o in _fork._KEPT)
            os.write(w, b"K" if kept else b"-")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert got == b"K"
    assert not _fork._AT_FORK  # the parent's strong references were dropped after the fork


_HYBRID_THEN_FORK = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import torch
    import gadgetloader as gl
    from gadgetloader import _fork

    src = np.random.default_rng(0).standard_normal((20000, 64)).astype(np.float32)
    g = gl.DataGadget(src, placement="pinned", strategy="hybrid")
    rng = np.random.default_rng(1)
    for _ in range(40):  # every gather replaces the side holder's event
        ids = torch.from_numpy(rng.integers(0, 20000, 4096))
        got = g.getData(ids)
        assert np.array_equal(got.cpu().numpy(), src[ids.numpy()])
    unsafe = _fork._weakref_unsafe_types()
    held = [type(o).__name__ for o in _fork._HOLDERS.values() if isinstance(o, unsafe)]
    assert not held, held
    pid = os.fork()  # reads every registered object
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    g.close()
    print("OK")
    """
)


@pytest.mark.gpu
@NEEDS_CUPY
def test_hybrid_gathers_then_a_fork_and_exit_under_the_debug_allocator() -> None:
    """The crash's pattern, in a process of its own: many hybrid gathers, a fork, then the
    registry torn down at exit, under the debug allocator (freed memory overwritten). The
    registry must hold no stream or event: with the code before the fix it held two, the
    side stream and the last event (H200, session 42), so this assertion fails there.
    The clean exit is checked too, though in this short pattern the old code also ended
    cleanly (3 of 3 runs): a dangling reference only faults while its memory is free,
    and here the next event reuses it."""
    env = dict(os.environ, PYTHONMALLOC="debug")
    proc = subprocess.run(
        [sys.executable, "-c", _HYBRID_THEN_FORK],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert proc.stdout.strip().endswith("OK")
