"""Review (session 15): the row kernels' promise that no kernel reads or writes outside
the tensors it is given, and the Python that builds their argument structs.

Two kinds of tests:

* *emulated* (run everywhere): the CUDA kernels of ``gadgetloader.transfer._kernels``
  (``gl_gather_*`` / ``gl_scatter_*``) are transcribed into Python below and stand in for
  the launch (``_kernels._launch``), reading the very argument words the library packs.
  The emulator only touches bytes inside the tensors handed to the public launcher call
  (tables, dense buffers, ids, pos, count); any other access raises ``AssertionError``
  instead of touching memory. CPU tensors' pointers are host addresses, so the
  emulated launch really moves the bytes a GPU would.
* *GPU* (``gpu`` marker, skip without CUDA / CuPy): the same situations on the real
  kernels, with canary bytes after the tensors to see what a kernel touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader.transfer import _engine, _kernels
from gadgetloader.transfer import gather as transfer_gather
from gadgetloader.transfer import scatter as transfer_scatter


# ---- the emulated kernels --------------------------------------------------------------------
def _extent(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to just past its last."""
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


class _Emulator:
    """``gl_gather_W`` / ``gl_scatter_W`` of ``_kernels._SOURCE``, run on host memory."""

    def __init__(self) -> None:
        self.ranges: list[list[tuple[int, int, str]]] = []
        self.launches: list[str] = []

    # what the launcher call was given: the only memory a kernel may touch
    def given(self, what: str, x: Any) -> list[tuple[int, int, str]]:
        out = []
        items = x if isinstance(x, (list, tuple)) else [x]
        for t in items:
            if isinstance(t, torch.Tensor) and t.numel():
                out.append((t.data_ptr(), t.data_ptr() + _extent(t), what))
        return out

    def _check(self, addr: int, nbytes: int, how: str) -> None:
        for frame in self.ranges:
            for a, b, _ in frame:
                if a <= addr and addr + nbytes <= b:
                    return
        known = [w for frame in self.ranges for _, _, w in frame]
        raise AssertionError(
            f"the kernel would {how} {nbytes} bytes at {addr:#x}, outside every tensor it "
            f"was given ({', '.join(known)})"
        )

    def read(self, addr: int, nbytes: int) -> bytes:
        self._check(addr, nbytes, "read")
        return ctypes.string_at(addr, nbytes)

    def write(self, addr: int, data: bytes) -> None:
        self._check(addr, len(data), "write")
        ctypes.memmove(addr, data, len(data))

    def i64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little", signed=True)

    def i32(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 4), "little", signed=True)

    def launch(self, kernel: Any, grid: Any, words: list[int], *args: Any, **kw: Any) -> None:
        name = kernel[0]
        self.launches.append(name)
        w = [int(x) for x in words]
        if name.startswith("gl_gather_repeats_"):
            self._repeats(int(name.rsplit("_", 1)[1]), int(grid[1]), w)
        elif name == "gl_last_slot" and w[4] == 2:
            self._claim(w)
        elif name.startswith("gl_gather_"):
            self._gather(int(name.rsplit("_", 1)[1]), int(grid[1]), w)
        elif name.startswith("gl_scatter_"):
            self._scatter(int(name.rsplit("_", 1)[1]), int(grid[1]), w)
        else:
            raise AssertionError(f"{name} was launched (not emulated here)")

    def _gather(self, vec: int, gy: int, w: list[int]) -> None:
        tables, outs = w[0:4], w[4:8]
        n_rows, vpr, pitch, segs, ids, pos, n, count, slot = w[8:17]
        valid = n if not count else min(max(self.i64(count), 0), n)
        for y in range(gy):
            for j in range(n):
                r = self.i64(ids + 8 * j) if j < valid else -1
                if slot and 0 <= r < n_rows and self.i32(slot + 4 * r) != j:
                    continue  # a repeat: gl_gather_repeats copies it
                p = self.i64(pos + 8 * j) if pos else j
                for s in range(segs):
                    if 0 <= r < n_rows:
                        data = self.read(tables[y] + (r * pitch + s * vpr) * vec, vpr * vec)
                    else:
                        data = bytes(vpr * vec)
                    self.write(outs[y + s] + p * vpr * vec, data)

    def _claim(self, w: list[int]) -> None:
        """``gl_last_slot`` phase 2: each id inside the table stores its position; with
        ``flag_out``, an id outside the table sets that word to 1."""
        ids, slot, n, n_rows, _phase, flag_out = w[0:6]
        for j in range(n):
            r = self.i64(ids + 8 * j)
            if 0 <= r < n_rows:
                self.write(slot + 4 * r, int(j).to_bytes(4, "little", signed=True))
            elif flag_out:
                self.write(flag_out, (1).to_bytes(8, "little", signed=True))

    def _repeats(self, vec: int, gy: int, w: list[int]) -> None:
        """``gl_gather_repeats``: entries their id's slot does not name copy the named
        entry's row, or read the table where the slot names no entry of that id."""
        tables, outs = w[0:4], w[4:8]
        n_rows, vpr, pitch, segs, ids, _pos, n, _count, slot = w[8:17]
        for y in range(gy):
            for j in range(n):
                r = self.i64(ids + 8 * j)
                if not 0 <= r < n_rows:
                    continue
                o = self.i32(slot + 4 * r)
                if o == j:
                    continue
                named = 0 <= o < n and self.i64(ids + 8 * o) == r
                for s in range(segs):
                    if named:
                        data = self.read(outs[y + s] + o * vpr * vec, vpr * vec)
                    else:
                        data = self.read(tables[y] + (r * pitch + s * vpr) * vec, vpr * vec)
                    self.write(outs[y + s] + j * vpr * vec, data)

    def _scatter(self, vec: int, gy: int, w: list[int]) -> None:
        tables, rows = w[0:4], w[4:8]
        n_rows, vpr, pitch, segs, ids, pos, mode, n, count = w[8:17]
        m = n if not count else min(max(self.i64(count), 0), n)
        for y in range(gy):
            for j in range(m):
                r = self.i64(ids + 8 * j)
                wins = mode == 0 or j + 1 == m or self.i64(ids + 8 * (j + 1)) != r
                if wins and 0 <= r < n_rows:
                    p = self.i64(pos + 8 * j) if pos else j
                    for s in range(segs):
                        data = self.read(rows[y + s] + p * vpr * vec, vpr * vec)
                        self.write(tables[y] + (r * pitch + s * vpr) * vec, data)


def _guarded(emu: _Emulator, fn: Any, extra: Any = None) -> Any:
    """``fn`` with every tensor argument registered as memory its launches may touch."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        frame = []
        for k, a in [*enumerate(args), *kwargs.items()]:
            frame += emu.given(str(k), a)
        if extra is not None:
            frame += extra(*args)
        emu.ranges.append(frame)
        try:
            return fn(*args, **kwargs)
        finally:
            emu.ranges.pop()

    return call


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> _Emulator:
    """Launches of the row kernels emulated on the CPU (CPU tensors as tables)."""
    e = _Emulator()
    monkeypatch.setattr(_kernels, "_launch", e.launch)
    monkeypatch.setattr(_kernels, "_function", lambda idx, unroll, name: (name, 0))
    monkeypatch.setattr(_kernels, "_max_blocks", lambda idx: 64)
    monkeypatch.setattr(_kernels, "_sm_count", lambda idx: 8)
    monkeypatch.setattr(_kernels, "_row_gathers", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_engine, "cupy_available", lambda: True)
    for name in (
        "launch_gather",
        "launch_scatter",
        "gather_rows",
        "launch_segment_sum",
        "launch_gather_slots",
    ):
        monkeypatch.setattr(_kernels, name, _guarded(e, getattr(_kernels, name)))
    fl = _kernels.FusedLauncher

    def tables(self: Any, *a: Any) -> list[tuple[int, int, str]]:
        # (the launcher keeps its tables' pointers and geometry, not the tensors)
        row, pitch, _ = self.geometry
        span = (self.num_rows - 1) * pitch + row if self.num_rows else 0
        return [(p, p + span, "launcher tables") for p in self.ptrs]

    monkeypatch.setattr(fl, "gather", _guarded(e, fl.gather, tables))
    monkeypatch.setattr(fl, "scatter", _guarded(e, fl.scatter, tables))
    return e


def _table(rows: int = 50, width: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(rows * width, dtype=torch.float64).reshape(rows, width).to(dtype)


# ---- emulated: what the structs say is right ----------------------------------------------------
def test_emulated_launches_of_views_bad_ids_and_counts_stay_inside(emu: _Emulator) -> None:
    """The struct words (pointers, pitch in vectors, vector width, count) are packed right:
    a column slice one element in (4-byte vectors, pitch != row), interleaved slots, bad
    ids (negative, == rows, near 2**63), counts past n and negative."""
    base = _table(40, 9)
    view = base[:, 1:5]  # 16-byte rows, 36-byte pitch, pointer 4 bytes in
    ids = torch.tensor([3, -1, 39, 40, 2**63 - 1, 0])
    out = torch.full((6, 4), -7.0)
    _kernels.launch_gather(view, ids, out)
    want = torch.zeros(6, 4)
    want[[0, 2, 5]] = view[[3, 39, 0]]
    assert torch.equal(out, want)
    _kernels.gather_rows(view, ids, out.fill_(-7.0))
    assert torch.equal(out, want)
    before = base.clone()
    _kernels.launch_scatter(view, ids, torch.full((6, 4), 5.0))
    expect = before.clone()
    expect[[3, 39, 0], 1:5] = 5.0
    assert torch.equal(base, expect)  # columns 0 and 5..8 and bad ids untouched
    # interleaved slots: one wide row per id, a count past n and a negative count
    inter = torch.arange(30 * 3 * 4, dtype=torch.float32).reshape(30, 3, 4)
    slots = [inter[:, k] for k in range(3)]
    assert _kernels.group_geometry(slots)[2] == 3
    launcher = _kernels.FusedLauncher(slots)
    sid = torch.tensor([1, 29, 30, -5])
    outs = [torch.full((4, 4), -1.0) for _ in slots]
    launcher.gather(sid, outs, torch.tensor([99]))
    for k, o in enumerate(outs):
        assert torch.equal(o[:2], inter[[1, 29], k]) and bool((o[2:] == 0).all())
    launcher.gather(sid, outs, torch.tensor([-3]))
    assert all(bool((o == 0).all()) for o in outs)
    snap = inter.clone()
    launcher.scatter(sid, [torch.full((4, 4), 9.0)] * 3, torch.tensor([1]))
    snap[1] = 9.0
    assert torch.equal(inter, snap)


# ---- emulated: defects --------------------------------------------------------------------------
# DEFECT: launch_gather / gather_rows / FusedLauncher.gather never check the output's row count or row size: the kernel writes past `out`
@pytest.mark.parametrize("how", ["launch_gather", "gather_rows", "fused"])
@pytest.mark.parametrize("bad", ["fewer_rows", "narrower_dtype"])
def test_emulated_gather_refuses_an_output_smaller_than_the_rows(
    emu: _Emulator, how: str, bad: str
) -> None:
    table = _table(20, 4, torch.float64)
    ids = torch.tensor([1, 2, 3, 4])
    if bad == "fewer_rows":
        out = torch.zeros(3, 4, dtype=torch.float64)  # 3 rows for 4 ids
    else:
        out = torch.zeros(4, 4, dtype=torch.float32)  # 16-byte rows for 32-byte rows
    if how == "gather_rows" and bad == "fewer_rows":
        out = torch.zeros(4, 2, dtype=torch.float64)  # (its own check looks at shape[0] only)
    with pytest.raises(ValueError):
        if how == "launch_gather":
            _kernels.launch_gather(table, ids, out)
        elif how == "gather_rows":
            _kernels.gather_rows(table, ids, out)
        else:
            _kernels.FusedLauncher([table]).gather(ids, [out], torch.tensor([4]))


# DEFECT: launch_scatter / FusedLauncher.scatter never check the source rows' size: the kernel reads past them into the table
@pytest.mark.parametrize("how", ["launch_scatter", "fused"])
def test_emulated_scatter_refuses_source_rows_smaller_than_the_ids(
    emu: _Emulator, how: str
) -> None:
    table = _table(20, 4)
    before = table.clone()
    ids = torch.tensor([1, 2, 3, 4])
    rows = torch.full((2, 4), 5.0)  # 2 rows for 4 ids
    with pytest.raises(ValueError):
        if how == "launch_scatter":
            _kernels.launch_scatter(table, ids, rows)
        else:
            _kernels.FusedLauncher([table]).scatter(ids, [rows], torch.tensor([4]))
    assert torch.equal(table, before)


# DEFECT: launch_gather / launch_scatter read ids (and gather_rows's fallback hands them) densely from data_ptr(): strided ids move the wrong rows
def test_emulated_strided_ids_move_the_rows_they_name(emu: _Emulator) -> None:
    table = _table(30, 4)
    all_ids = torch.arange(29, -1, -1)  # 29, 28, ..., 0
    ids = all_ids[::3]  # 29, 26, 23, ... (not contiguous)
    n = ids.numel()
    out = torch.zeros(n, 4)
    _kernels.gather_rows(table, ids, out)  # falls back to launch_gather for strided ids
    assert torch.equal(out, table[ids])
    # (session 15: the launchers themselves refuse ids they would misread)
    out2 = torch.zeros(n, 4)
    with pytest.raises(ValueError, match="contiguous"):
        _kernels.launch_gather(table, ids, out2)
    assert not out2.any()
    before = table.clone()
    with pytest.raises(ValueError, match="contiguous"):
        _kernels.launch_scatter(table, ids, torch.full((n, 4), -1.0))
    assert torch.equal(table, before)
    _kernels.launch_scatter(table, ids.contiguous(), torch.full((n, 4), -1.0))
    before[ids] = -1.0
    assert torch.equal(table, before)


# DEFECT: transfer.gather's kernel strategy reads int32 ids as int64 (past the ids, wrong rows) while its torch strategy gathers them right
def test_emulated_int32_ids_give_the_same_rows_with_every_strategy(emu: _Emulator) -> None:
    table = _table(20, 4)
    ids = torch.tensor([3, 0, 19, 7], dtype=torch.int32)
    want = transfer_gather(table, ids, strategy="torch")
    assert torch.equal(want, table[ids.long()])
    try:
        got = transfer_gather(table, ids, strategy="kernel")
    except (TypeError, ValueError):
        return  # a clear refusal before the launch would be fine too
    assert torch.equal(got, want)


# DEFECT: transfer.scatter's kernel strategy writes rows of another dtype as raw bytes into the table (the torch strategy raises)
def test_emulated_scatter_of_rows_of_another_dtype_is_refused(emu: _Emulator) -> None:
    table = _table(20, 4)
    before = table.clone()
    ids = torch.tensor([1, 5])
    rows = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], dtype=torch.float64)
    with pytest.raises((TypeError, RuntimeError)):
        transfer_scatter(table, ids, rows, strategy="torch")  # refused (torch refuses too)
    assert torch.equal(table, before)
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        transfer_scatter(table, ids, rows, strategy="kernel")
    assert torch.equal(table, before)  # not the float64 rows' bytes read as float32


# DEFECT: pitch_nbytes skips its row-contiguity check for a one-row view, so the kernels move a strided row as if dense (writing elements outside the view)
def test_one_row_strided_view_is_refused_or_moved_element_by_element(emu: _Emulator) -> None:
    base = torch.arange(8, dtype=torch.float32).reshape(1, 8)
    view = base[:, ::2]  # one row of elements 0, 2, 4, 6
    two = torch.arange(16, dtype=torch.float32).reshape(2, 8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        _kernels.pitch_nbytes(two)  # two such rows: refused
    try:
        _kernels.launch_scatter(view, torch.tensor([0]), torch.tensor([[10.0, 11.0, 12.0, 13.0]]))
    except ValueError:
        assert torch.equal(base, torch.arange(8, dtype=torch.float32).reshape(1, 8))
        return
    want = torch.tensor([[10.0, 1.0, 11.0, 3.0, 12.0, 5.0, 13.0, 7.0]])
    assert torch.equal(base, want)  # elements 1 and 3 are not part of the view


# DEFECT: pitch_nbytes returns a dense pitch for a one-row strided view instead of refusing it
def test_pitch_of_a_one_row_strided_view_is_refused_like_two_rows() -> None:
    """(The cause of the defect above, without any launch.)"""
    one = torch.zeros(1, 8)[:, ::2]
    with pytest.raises(ValueError):
        _kernels.pitch_nbytes(one)


# DEFECT: launch_segment_sum checks grad/out but not order_local (length, dtype): the kernel reads order_local[n - 1] and beyond
def test_emulated_segment_sum_refuses_a_short_order_local(emu: _Emulator) -> None:
    grad = torch.ones(4, 3)
    out = torch.zeros(4, 3)
    order = torch.arange(4)
    with pytest.raises(ValueError):
        _kernels.launch_segment_sum(grad, order, torch.zeros(2, dtype=torch.int64), out)
    with pytest.raises(ValueError):
        _kernels.launch_segment_sum(grad, order, torch.zeros(4, dtype=torch.int32), out)


def test_fused_group_refuses_mismatched_tables_before_any_launch() -> None:
    a = torch.zeros(10, 4)
    for other in (torch.zeros(11, 4), torch.zeros(10, 5), torch.zeros(10, 8)[:, :4]):
        with pytest.raises(ValueError):
            _kernels.group_geometry([a, other])
    with pytest.raises(ValueError):
        _kernels.group_geometry([a] * 5)
    with pytest.raises(ValueError):
        _kernels.pitch_nbytes(torch.zeros(1, 4).expand(10, 4))


# ---- GPU: the real kernels ------------------------------------------------------------------
def _canary(nbytes: int, extra: int = 4096) -> torch.Tensor:
    """A CUDA byte buffer filled with 0xA5: views of its start are the tensors under test."""
    return torch.full((nbytes + extra,), 0xA5, dtype=torch.uint8, device="cuda")


# DEFECT: launch_gather / gather_rows write past an output with too few rows or a narrower dtype (no check of the dense buffer)
@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("how", ["launch_gather", "gather_rows"])
@pytest.mark.parametrize("bad", ["fewer_rows", "narrower_dtype"])
def test_gpu_gather_into_a_small_output_is_refused_and_leaves_the_canary(
    how: str, bad: str
) -> None:
    table = torch.arange(80, dtype=torch.float64, device="cuda").reshape(20, 4)
    ids = torch.tensor([1, 2, 3, 4], device="cuda")
    buf = _canary(128)
    if bad == "fewer_rows":  # 3 rows (gather_rows: 4 rows of half the size)
        shape, dtype = (
            ((3, 4), torch.float64) if how == "launch_gather" else ((4, 2), torch.float64)
        )
    else:
        shape, dtype = (4, 4), torch.float32
    out = buf[: int(np.prod(shape)) * (8 if dtype == torch.float64 else 4)].view(dtype).view(shape)
    tail = out.numel() * out.element_size()
    fn = _kernels.launch_gather if how == "launch_gather" else _kernels.gather_rows
    raised = False
    try:
        fn(table, ids, out)
    except ValueError:
        raised = True
    torch.cuda.synchronize()
    assert bool((buf[tail:] == 0xA5).all()), "the kernel wrote past the output"
    assert raised


# DEFECT: launch_scatter reads past source rows shorter than the ids and writes those bytes into the table
@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_scatter_of_too_few_rows_is_refused_and_the_table_kept() -> None:
    table = torch.zeros(20, 4, device="cuda")
    ids = torch.tensor([1, 2, 3, 4], device="cuda")
    buf = _canary(2 * 16)
    rows = buf[:32].view(torch.float32).view(2, 4)  # 2 rows for 4 ids; 0xA5 bytes after
    rows.fill_(5.0)
    with pytest.raises(ValueError):
        _kernels.launch_scatter(table, ids, rows)
    torch.cuda.synchronize()
    assert bool((table == 0).all()), "rows 3 and 4 got the canary's bytes"


# DEFECT: strided ids are read densely by launch_gather / launch_scatter (and gather_rows's fallback): wrong rows moved
@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_strided_ids_move_the_rows_they_name() -> None:
    table = torch.arange(120, dtype=torch.float32, device="cuda").reshape(30, 4)
    ids = torch.arange(29, -1, -1, device="cuda")[::3]
    n = ids.numel()
    out = torch.zeros(n, 4, device="cuda")
    _kernels.gather_rows(table, ids, out)
    assert torch.equal(out.cpu(), table.cpu()[ids.cpu()])
    # (session 15: the launchers themselves refuse ids they would misread)
    out2 = torch.zeros(n, 4, device="cuda")
    with pytest.raises(ValueError, match="contiguous"):
        _kernels.launch_gather(table, ids, out2)
    want = table.cpu().clone()
    with pytest.raises(ValueError, match="contiguous"):
        _kernels.launch_scatter(table, ids, torch.full((n, 4), -1.0, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(table.cpu(), want) and not out2.any()
    want[ids.cpu()] = -1.0
    _kernels.launch_scatter(table, ids.contiguous(), torch.full((n, 4), -1.0, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(table.cpu(), want)


# DEFECT: transfer.gather(strategy="kernel") reads int32 CUDA ids as int64 (wrong rows, reads past the ids); "torch" gathers them right
@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_int32_ids_give_the_same_rows_with_every_strategy() -> None:
    table = torch.arange(80, dtype=torch.float32, device="cuda").reshape(20, 4)
    spare = torch.zeros(64, dtype=torch.int32, device="cuda")  # reads past the ids land here
    ids = spare[:4]
    ids.copy_(torch.tensor([3, 0, 19, 7], dtype=torch.int32))
    want = transfer_gather(table, ids, strategy="torch")
    try:
        got = transfer_gather(table, ids, strategy="kernel")
    except (TypeError, ValueError):
        return
    assert torch.equal(got.cpu(), want.cpu())


# DEFECT: transfer.scatter(strategy="kernel") writes float64 rows' raw bytes into a float32 table (torch's strategy raises)
@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_scatter_of_rows_of_another_dtype_is_refused() -> None:
    table = torch.zeros(20, 4, device="cuda")
    rows = torch.ones(2, 4, dtype=torch.float64, device="cuda")
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        transfer_scatter(table, torch.tensor([1, 5], device="cuda"), rows, strategy="kernel")
    torch.cuda.synchronize()
    assert bool((table == 0).all())


# DEFECT: a one-row strided view (pitch_nbytes skips the check for one row) is scattered as if dense: elements outside the view are overwritten
@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_one_row_strided_view_never_writes_between_its_elements() -> None:
    base = torch.arange(8, dtype=torch.float32, device="cuda").reshape(1, 8)
    view = base[:, ::2]
    rows = torch.tensor([[10.0, 11.0, 12.0, 13.0]], device="cuda")
    with contextlib.suppress(ValueError):  # a refusal is fine
        _kernels.launch_scatter(view, torch.tensor([0], device="cuda"), rows)
    torch.cuda.synchronize()
    assert base[0, 1::2].cpu().tolist() == [1.0, 3.0, 5.0, 7.0]


_MISMATCH = """
import torch
from gadgetloader.transfer import _kernels
table = torch.arange(40.0, device="cuda").reshape(10, 4)
ids = torch.tensor([1, 2], device="cuda")
out = torch.zeros(2, 4, device="cuda")
case = {case!r}
try:
    if case == "cpu_ids":
        _kernels.launch_gather(table, ids.cpu(), out)
    elif case == "cpu_out":
        _kernels.launch_gather(table, ids, out.cpu())
    else:
        _kernels.launch_gather([table, table.cpu()], ids, [out, out.clone()])
except (ValueError, TypeError) as e:
    print("REFUSED", type(e).__name__)
else:
    torch.cuda.synchronize()
    print("LAUNCHED")
"""


# DEFECT: launch_gather never checks that ids / out / the tables are on the launch's device: host pointers reach the kernel
@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("case", ["cpu_ids", "cpu_out", "cpu_table_in_group"])
def test_gpu_tensors_on_another_device_are_refused_before_the_launch(case: str) -> None:
    # in a child process: a kernel given a host pointer may poison this CUDA context
    code = textwrap.dedent(_MISMATCH.format(case=case))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "REFUSED" in res.stdout, (res.stdout, res.stderr[-2000:])


# DEFECT: a closed `cuda` table keeps its GPU memory while an embedding's (and optimizer's) prepared fused transfer / captured graphs hold its view
@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_closing_a_trained_cuda_table_frees_its_memory() -> None:
    n, d = 1 << 16, 16  # 4 MiB
    emb = gl.OffloadedEmbedding(n, d, "cuda", device="cuda")
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    g = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(4):  # eager, then a capture and replays
        opt.zero_grad()
        emb(torch.randint(0, n, (256,), generator=g).cuda()).sum().backward()
        opt.step()
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    emb.weight.close()
    gc.collect()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= n * d * 4, f"closing freed {freed} bytes of a {n * d * 4}-byte table"


@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_bad_ids_counts_and_interleaved_slots_stay_inside_canaries() -> None:
    rows, width = 64, 6  # 24-byte rows: 8-byte vectors
    buf = _canary(rows * 3 * width * 4)
    inter = buf[: rows * 3 * width * 4].view(torch.float32).view(rows, 3, width)
    inter.copy_(torch.arange(inter.numel(), dtype=torch.float32, device="cuda").view_as(inter))
    slots = [inter[:, k] for k in range(3)]
    launcher = _kernels.FusedLauncher(slots)
    spare = torch.zeros(16, dtype=torch.int64, device="cuda")  # ids past n are 0 (valid)
    ids = spare[:5]
    ids.copy_(torch.tensor([2, -1, rows, 2**63 - 1, rows - 1]))
    outs = [torch.full((5, width), -3.0, device="cuda") for _ in slots]
    launcher.gather(ids, outs, torch.tensor([1000], device="cuda"))  # a count past n
    ref = inter.cpu()
    for k, o in enumerate(outs):
        got = o.cpu()
        assert torch.equal(got[0], ref[2, k]) and torch.equal(got[4], ref[rows - 1, k])
        assert bool((got[1:4] == 0).all())
    snap = inter.cpu().clone()
    launcher.scatter(
        ids, [torch.full((5, width), 9.0, device="cuda")] * 3, torch.tensor([-4], device="cuda")
    )
    launcher.scatter(
        ids, [torch.full((5, width), 9.0, device="cuda")] * 3, torch.tensor([99], device="cuda")
    )
    torch.cuda.synchronize()
    snap[[2, rows - 1]] = 9.0
    assert torch.equal(inter.cpu(), snap)  # row 0 (the ids past n) untouched
    assert bool((buf[rows * 3 * width * 4 :] == 0xA5).all())


@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_rows_past_two_gib_of_a_table_are_moved() -> None:
    """64-bit offsets: rows whose byte and element offsets pass 2**31 and 2**32."""
    nbytes = (1 << 31) + (1 << 20)
    try:
        big = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:  # pragma: no cover
        pytest.skip("no room for a 2 GiB table")
    for row in (16, 3):  # 16-byte vectors; 1-byte vectors (element offsets > 2**31)
        table = big[: (nbytes // row) * row].view(-1, row)
        last = table.shape[0] - 1
        ids = torch.tensor([last, last - 1, 5, table.shape[0]], device="cuda")
        new = torch.arange(4 * row, dtype=torch.uint8, device="cuda").view(4, row) + 1
        _kernels.launch_scatter(table, ids, new)
        out = torch.zeros(4, row, dtype=torch.uint8, device="cuda")
        _kernels.launch_gather(table, ids, out)
        torch.cuda.synchronize()
        assert torch.equal(out[:3].cpu(), new[:3].cpu()) and bool((out[3] == 0).all())
        table[ids[:3]] = 0
    del big
    torch.cuda.empty_cache()
