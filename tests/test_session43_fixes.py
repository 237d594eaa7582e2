"""Session 43's fix: .npy headers are never parsed by two threads at once.

NumPy parses a .npy header with ``ast.literal_eval``. CPython 3.11 (CI's Python) keeps
the AST builder's recursion counter per interpreter rather than per thread, so two
threads parsing at once can fail with ``SystemError: AST constructor recursion depth
mismatch`` (CPython gh-106905). CI hit it once: two threads calling ``DataGadget.load``
on .npy files (``test_close_while_another_thread_loads[npy]``). Every header parse in
:mod:`gadgetloader.io._npy` now holds one lock, and the Fortran-order and big-endian
read path maps the file at the offset already parsed instead of parsing it again.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gadgetloader as gl
from gadgetloader.io import _npy


def _counting_parser(real, state):
    def parse(f, *args, **kwargs):
        with state["lock"]:
            state["active"] += 1
            state["most"] = max(state["most"], state["active"])
        try:
            time.sleep(0.02)  # long enough for the other threads to arrive
            return real(f, *args, **kwargs)
        finally:
            with state["lock"]:
                state["active"] -= 1

    return parse


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_threads_opening_npy_files_parse_their_headers_one_at_a_time(
    tmp_path, monkeypatch, version
) -> None:
    ref = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    path = tmp_path / "t.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, ref, version=version)
    state = {"lock": threading.Lock(), "active": 0, "most": 0}
    name = "read_array_header_1_0" if version == (1, 0) else "read_array_header_2_0"
    monkeypatch.setattr(np.lib.format, name, _counting_parser(getattr(np.lib.format, name), state))
    n = 4
    start = threading.Barrier(n)
    shapes: list[tuple[int, ...]] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            start.wait()
            src = _npy.NpySource(path)
            out = np.empty((40, 3), np.float32)
            src.read_into(0, 40, out)
            np.testing.assert_array_equal(out, ref)
            shapes.append(src.shape)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert shapes == [(40, 3)] * n
    assert state["most"] == 1, f"{state['most']} threads parsed a header at once"


def test_concurrent_loads_into_one_table_parse_one_header_at_a_time(tmp_path, monkeypatch):
    """The public form of the race CI hit: threads calling ``load`` on a .npy-backed table."""
    a = np.random.default_rng(1).standard_normal((300, 8)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((300, 8)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.save(tmp_path / "t.npy", np.zeros((300, 8), np.float32))
    g = gl.DataGadget(str(tmp_path / "t.npy"), placement="file", device="cpu")
    state = {"lock": threading.Lock(), "active": 0, "most": 0}
    monkeypatch.setattr(
        np.lib.format,
        "read_array_header_1_0",
        _counting_parser(np.lib.format.read_array_header_1_0, state),
    )
    start = threading.Barrier(3)
    errors: list[BaseException] = []

    def load(src) -> None:
        try:
            start.wait()
            g.load(str(src))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=load, args=(tmp_path / n,)) for n in ("a.npy", "b.npy", "b.npy")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert state["most"] == 1
        got = g.getNumpyVersion()
        assert np.array_equal(got, a) or np.array_equal(got, b)
    finally:
        g.close()


@pytest.mark.parametrize("order", ["F", "big-endian"])
def test_fortran_and_big_endian_files_read_without_a_second_header_parse(
    tmp_path, monkeypatch, order
) -> None:
    rng = np.random.default_rng(7)
    ref = rng.standard_normal((50, 6)).astype(np.float32)
    stored = np.asfortranarray(ref) if order == "F" else ref.astype(">f4")
    path = tmp_path / "t.npy"
    np.save(path, stored)
    src = _npy.NpySource(path)

    def no_load(*a, **k):
        raise AssertionError("np.load parses the header again")

    monkeypatch.setattr(np, "load", no_load)
    out = np.empty((20, 6), np.float32)
    src.read_into(17, 37, out)
    np.testing.assert_array_equal(out, ref[17:37])
    out = np.empty((50, 6), np.float32)
    src.read_into(0, 50, out)
    np.testing.assert_array_equal(out, ref)
