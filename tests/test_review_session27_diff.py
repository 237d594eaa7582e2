"""Review (session 27) of the kernel work since 39761d2: the sort-free merge of repeated
ids (``gl_last_slot`` phases 0-1, scatter modes 2 and 3, the guard pair), the gather that
reads each distinct row once (phase 2, ``gl_gather_repeats``), the in-order launches, and
the Python that drives them (``_engine.slot_scatter``, ``scatter_many``'s slot path,
``DataGadget.getData`` / ``insertData``, the thread's page-locked check word).

* *emulated* (run everywhere): session 15's CPU emulator of the kernels
  (``test_review_session15_kernels``) knows the gathers, phase 2 and the scatter modes 0-1
  only; :class:`_Emu27` adds phases 0 and 1 (with the flag word), modes 2 and 3, the guard
  pair transcribed from ``_kernels._SOURCE``. Phase 2's plain
  stores are emulated with a *random* winner per id (the GPU may keep any of them), and
  every access outside the tensors handed to the launcher raises. Results are compared
  with NumPy: ``table[ids]`` for gathers, a sequential loop (the last occurrence wins) for
  scatters; ids outside the table are skipped by unchecked writes and refuse the whole
  write when guarded.
* *GPU* (``gpu`` marker): the same promises on the real kernels, plus what only a GPU can
  show (tables past 2**31 bytes, side streams, two threads with their own check words).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY
from test_review_session15_kernels import _Emulator, _guarded

import gadgetloader as gl
from gadgetloader import _ids
from gadgetloader.transfer import _engine, _kernels


# ---- the emulator, extended -------------------------------------------------------------------
class _Emu27(_Emulator):
    """Session 15's emulator plus ``gl_last_slot`` phases 0-2 (with ``flag_out``), scatter
    modes 0-3 with ``slot`` and the ``ends`` guard, for the grid-stride and in-order
    launches alike."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def launch(self, kernel: Any, grid: Any, words: list[int], *args: Any, **kw: Any) -> None:
        name = kernel[0]
        w = [int(x) for x in words]
        if name == "gl_last_slot":
            self.launches.append(name)
            self._last_slot(w)
        elif name.startswith("gl_scatter_"):
            self.launches.append(name)
            self._scatter27(int(name.rsplit("_", 1)[1]), int(grid[1]), w)
        else:
            super().launch(kernel, grid, words, *args, **kw)

    def w32(self, addr: int, v: int) -> None:
        self.write(addr, int(v).to_bytes(4, "little", signed=True))

    def _last_slot(self, w: list[int]) -> None:
        ids, slot, n, n_rows, phase, flag_out = w[0:6]
        if phase == 0 and flag_out:  # this call's flags, raised by phase 1
            self.w32(slot + 4 * n_rows, 0)
            self.write(flag_out, bytes(8))
        order = list(range(n))
        if phase == 2:
            self.rng.shuffle(order)  # plain stores: whichever lands last stays
        for j in order:
            r = self.i64(ids + 8 * j)
            if not 0 <= r < n_rows:
                if phase == 1 and flag_out:
                    self.w32(slot + 4 * n_rows, 1)
                if phase != 0 and flag_out:  # (phase 2: the fused gather check)
                    self.write(flag_out, (1).to_bytes(8, "little", signed=True))
                continue
            if phase == 0:
                self.w32(slot + 4 * r, -1)
            elif phase == 1:
                self.w32(slot + 4 * r, max(self.i32(slot + 4 * r), j))
            else:
                self.w32(slot + 4 * r, j)

    def _scatter27(self, vec: int, gy: int, w: list[int]) -> None:
        tables, rows = w[0:4], w[4:8]
        n_rows, vpr, pitch, segs, ids, pos, mode, n, count, slot, ends = w[8:19]
        if mode == 3 and self.i32(slot + 4 * n_rows) != 0:
            return  # refused: the flag
        if ends and (self.i64(ends) < 0 or self.i64(ends + 8) >= n_rows):
            return  # refused: the guard pair
        m = n if not count else min(max(self.i64(count), 0), n)
        for y in range(gy):
            for j in range(m):
                r = self.i64(ids + 8 * j)
                if not 0 <= r < n_rows:
                    continue
                if mode == 0:
                    wins = True
                elif mode == 1:
                    wins = j + 1 == m or self.i64(ids + 8 * (j + 1)) != r
                else:
                    wins = self.i32(slot + 4 * r) == j
                if not wins:
                    continue
                p = self.i64(pos + 8 * j) if pos else j
                for s in range(segs):
                    data = self.read(rows[y + s] + p * vpr * vec, vpr * vec)
                    self.write(tables[y] + (r * pitch + s * vpr) * vec, data)


class _Stream:
    """What ``slot_scatter`` asks of torch's current stream, on the CPU."""

    def record_event(self) -> Any:
        return self

    def synchronize(self) -> None:
        return None


@pytest.fixture
def emu27(monkeypatch: pytest.MonkeyPatch) -> _Emu27:
    e = _Emu27(seed=27)
    monkeypatch.setattr(_kernels, "_launch", e.launch)
    monkeypatch.setattr(_kernels, "_function", lambda idx, unroll, name: (name, 0))
    monkeypatch.setattr(_kernels, "_max_blocks", lambda idx: 64)
    monkeypatch.setattr(_kernels, "_sm_count", lambda idx: 8)
    monkeypatch.setattr(_kernels, "_row_gathers", {})
    monkeypatch.setattr(_kernels, "in_host_memory", lambda t: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(_engine, "cupy_available", lambda: True)
    monkeypatch.setattr(_engine, "_gpu_addressable", lambda t: True)  # CPU stand-ins

    for name in (
        "launch_gather",
        "launch_scatter",
        "gather_rows",
        "launch_gather_slots",
        "launch_last_slots",
    ):
        monkeypatch.setattr(_kernels, name, _guarded(e, getattr(_kernels, name)))
    return e


def _flag(monkeypatch: pytest.MonkeyPatch, emu: _Emu27) -> torch.Tensor:
    """A CPU int64 standing in for the thread's page-locked check word (set to garbage:
    the launch must overwrite it)."""
    word = torch.full((1,), -99, dtype=torch.int64)
    emu.ranges.append(emu.given("flag word", word))
    monkeypatch.setattr(_engine, "flag_word", lambda device: word.data_ptr())
    monkeypatch.setattr(_engine, "read_flag", lambda: int(word.item()))
    return word


def _numpy_scatter(table: np.ndarray, ids: list[int], rows: np.ndarray) -> np.ndarray:
    """``table[ids] = rows`` as NumPy runs it in order (the last occurrence wins), ids
    outside the table skipped (an unchecked kernel write)."""
    out = table.copy()
    for j, r in enumerate(ids):
        if 0 <= r < len(out):
            out[r] = rows[j]
    return out


def _views(seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, base, view) tables of every geometry the kernels take: contiguous, a column
    slice one element in (pitch != row, 4-byte vectors), a slot of an interleaved table,
    one row, 2-byte elements."""
    gen = torch.Generator().manual_seed(seed)
    plain = torch.randn(37, 8, generator=gen)
    wide = torch.randn(37, 11, generator=gen)
    inter = torch.randn(37, 3, 4, generator=gen)
    one = torch.randn(1, 6, generator=gen)
    half = torch.randn(37, 5, generator=gen).to(torch.float16)
    return [
        ("contiguous", plain, plain),
        ("column slice", wide, wide[:, 1:7]),
        ("interleaved slot", inter, inter[:, 1]),
        ("one row", one, one),
        ("float16 odd row", half, half),
    ]


def _make_ids(rows: int, n: int, seed: int, bad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=g)
    ids[n // 3 :: 5] = ids[0]  # repeats of one id throughout
    if bad:
        ids[n // 2] = [-1, rows, 2**63 - 1, -(2**63)][seed % 4]
    return ids


# ---- emulated: the scatter modes and launch shapes against NumPy --------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "shape", [{}, {"blocks_per_sm": _kernels.IN_ORDER}, {"rows_per_block": 3}, {"blocks_per_sm": 1}]
)
def test_emulated_slot_scatter_modes_match_numpy_on_every_geometry(
    emu27: _Emu27, seed: int, shape: dict[str, int]
) -> None:
    """Modes 2 (unguarded, guarded by the pair) and 3, and mode 1 after a stable sort, on
    every table geometry and launch shape: each id's last occurrence is written, bad ids
    are skipped when unchecked and refuse the whole write when guarded, and nothing
    outside the table, the rows, the ids or the slots is touched."""
    for name, base, view in _views(seed):
        rows, n = view.shape[0], 23
        for bad in (False, True):
            ids = _make_ids(rows, n, seed, bad)
            gen = torch.Generator().manual_seed(seed + 100)
            src = torch.randn(n, *view.shape[1:], generator=gen).to(view.dtype)
            inside = ids[(ids >= 0) & (ids < rows)].tolist()
            want = torch.from_numpy(_numpy_scatter(view.clone().numpy(), ids.tolist(), src.numpy()))
            ends = torch.stack([ids.min(), ids.max()])
            for how in ("mode 2", "mode 2 guarded", "mode 3", "mode 1 sorted"):
                snap = base.clone()
                if how == "mode 3":
                    slot = torch.full((rows + 1,), 7, dtype=torch.int32)
                    flag = torch.full((1,), -5, dtype=torch.int64)
                    emu27.ranges.append(emu27.given("flag", flag))
                    _kernels.launch_last_slots(ids, slot, flag_out=flag.data_ptr())
                    emu27.ranges.pop()
                    assert flag.item() == int(bad), (name, how)
                    assert slot[-1].item() == int(bad)
                    _kernels.launch_scatter(
                        view, ids, src, None, _kernels.SCATTER_LAST_BY_SLOT_GUARDED,
                        slot=slot, **shape,
                    )  # fmt: skip
                    refused = bad
                elif how.startswith("mode 2"):
                    slot = torch.full((rows,), 7, dtype=torch.int32)
                    _kernels.launch_last_slots(ids, slot)
                    for r in set(inside):  # each id's slot: its last position
                        assert slot[r].item() == max(
                            j for j, x in enumerate(ids.tolist()) if x == r
                        )
                    guard = ends if how.endswith("guarded") else None
                    _kernels.launch_scatter(
                        view, ids, src, None, _kernels.SCATTER_LAST_BY_SLOT,
                        slot=slot, guard=guard, **shape,
                    )  # fmt: skip
                    refused = bad and guard is not None
                else:
                    keys, pos = torch.sort(ids, stable=True)
                    _kernels.launch_scatter(
                        view, keys, src, pos, _kernels.SCATTER_LAST_OF_RUN, guard=ends, **shape
                    )
                    refused = bad
                if refused:
                    assert torch.equal(base, snap), (name, how, "wrote despite a bad id")
                else:
                    assert torch.equal(view, want), (name, how)
                base.copy_(snap)


@pytest.mark.parametrize("seed", range(3))
def test_emulated_engine_slot_scatter_checks_merges_and_refuses(
    emu27: _Emu27, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """``_engine.slot_scatter`` end to end (merge with the fused flag, guarded scatter,
    the host's read of the word): repeats take their last row on every geometry; a bad id
    raises ``GadgetIndexError`` naming it with the table unchanged; the word left set by a
    failed write does not fail the next good one; rows read from the table itself are read
    before they are overwritten."""
    word = _flag(monkeypatch, emu27)
    for name, base, view in _views(seed):
        rows, n = view.shape[0], 19
        for bad in (True, False):
            ids = _make_ids(rows, n, seed, bad)
            src = torch.randn(n, *view.shape[1:]).to(view.dtype)
            snap = base.clone()
            want = _numpy_scatter(view.clone().numpy(), ids.tolist(), src.numpy())
            if bad:
                with pytest.raises(gl.GadgetIndexError, match=r"id -?\d+ is "):
                    _engine.slot_scatter(view, ids, src, check=True)
                assert word.item() == 1 and torch.equal(base, snap), name
            else:
                assert _engine.slot_scatter(view, ids, src, check=True) is True
                assert word.item() == 0
                np.testing.assert_array_equal(view.numpy(), want, err_msg=name)
        # the source rows are the table's own (a shifted block): read all before writing
        if rows > 4:
            snap = view.clone()
            k = rows - 2
            sid = torch.arange(2, 2 + k)
            assert _engine.slot_scatter(view, sid, view[:k], check=True)
            assert torch.equal(view[2:], snap[:k]) and torch.equal(view[:2], snap[:2]), name
        # unchecked: bad ids are skipped, the others written
        ids = _make_ids(rows, n, seed + 1, True)
        src = torch.randn(n, *view.shape[1:]).to(view.dtype)
        want = _numpy_scatter(view.clone().numpy(), ids.tolist(), src.numpy())
        assert _engine.slot_scatter(view, ids, src, check=False)
        np.testing.assert_array_equal(view.numpy(), want, err_msg=name)


def test_emulated_scatter_many_slot_path_with_a_guarded_check(
    emu27: _Emu27, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scatter_many``'s slot path (taken here on CPU tables) with a
    :class:`GuardedCheck`: the scatter is queued before the check finishes and writes
    nothing for a bad id; every table of a fused group takes each id's last row."""
    monkeypatch.setattr(_engine, "_slot_merge", lambda table, n: True)
    tables = [torch.randn(30, 4) for _ in range(3)]
    ids = torch.tensor([3, 29, 3, 0, 29, 3, 7])
    srcs = [torch.randn(7, 4) for _ in tables]
    order: list[str] = []

    def finish() -> None:
        order.append("check")
        _ids.check_range(ids_now[0], 30)

    ids_now = [ids]
    check = _ids.GuardedCheck(torch.stack([ids.min(), ids.max()]), finish)
    n_before = len(emu27.launches)
    _engine.scatter_many(tables, ids, srcs, "kernel", check=check)
    assert emu27.launches[n_before:] == ["gl_last_slot"] * 2 + ["gl_scatter_16"]
    assert order == ["check"]
    for t, s in zip(tables, srcs, strict=True):
        assert torch.equal(t[3], s[5]) and torch.equal(t[29], s[4]) and torch.equal(t[0], s[3])
    bad = ids.clone()
    bad[4] = 30
    ids_now[0] = bad
    snaps = [t.clone() for t in tables]
    check = _ids.GuardedCheck(torch.stack([bad.min(), bad.max()]), finish)
    with pytest.raises(gl.GadgetIndexError, match="id 30 is out of range"):
        _engine.scatter_many(tables, bad, srcs, "kernel", check=check)
    assert all(torch.equal(t, s) for t, s in zip(tables, snaps, strict=True))


@pytest.mark.parametrize("seed", range(6))
def test_emulated_gather_that_reads_rows_once_matches_numpy_whatever_slot_wins(
    emu27: _Emu27, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """``gather_rows(dedup=True)`` and ``launch_gather(slot=...)`` with a random winner
    of each id's plain stores: ``table[ids]`` on every geometry, zero rows for bad ids,
    also into an output whose pointer allows only narrower vectors (the general launch)."""
    emu27.rng.seed(seed)
    made: list[torch.Tensor] = []

    def slots(table: torch.Tensor, n: int) -> torch.Tensor:
        s = torch.full((table.shape[0],), 2**31 - 1, dtype=torch.int32)  # never read
        made.append(s)
        emu27.ranges.append(emu27.given("slots", s))
        return s

    monkeypatch.setattr(_kernels, "dedup_slots", slots)
    for name, _base, view in _views(seed):
        rows, n = view.shape[0], 41
        ids = _make_ids(rows, n, seed, bad=True)
        ok = (ids >= 0) & (ids < rows)
        want = torch.zeros(n, *view.shape[1:], dtype=view.dtype)
        want[ok] = view[ids[ok]]
        out = torch.full((n, *view.shape[1:]), 9, dtype=view.dtype)
        _kernels.gather_rows(view, ids, out, dedup=True)
        assert torch.equal(out, want), name
        # an output one element in: the general launch, narrower vectors
        big = torch.full((n * view[0].numel() + 1,), 9, dtype=view.dtype)
        odd = big[1:].view(n, *view.shape[1:])
        _kernels.gather_rows(view, ids, odd, dedup=True)
        assert torch.equal(odd, want) and big[0].item() == 9, name
        # a fused pair of separate tables in one launch
        other = torch.empty_strided(view.size(), view.stride(), dtype=view.dtype)
        other.copy_(view * 2)  # (the same pitch: one launch)
        outs = [torch.empty_like(want), torch.empty_like(want)]
        slot = slots(view, n)
        _kernels.launch_gather_slots(ids, slot)
        _kernels.launch_gather([view, other], ids, outs, slot=slot)
        assert torch.equal(outs[0], want) and torch.equal(outs[1], want * 2), name


def test_emulated_in_order_launches_of_views_match_numpy(emu27: _Emu27) -> None:
    """The in-order gather (one warp per row) with ``pos``, a count and views: the
    emulator runs the same words, so the struct the in-order launch is handed is the
    grid-stride launch's."""
    for name, _base, view in _views(5):
        rows, n = view.shape[0], 17
        ids = _make_ids(rows, n, 5, bad=True)
        keys, pos = torch.sort(ids)
        ok = (ids >= 0) & (ids < rows)
        want = torch.zeros(n, *view.shape[1:], dtype=view.dtype)
        want[ok] = view[ids[ok]]
        for shape in ({"blocks_per_sm": _kernels.IN_ORDER}, {"rows_per_block": 32}):
            out = torch.full_like(want, 3)
            _kernels.launch_gather(view, keys, out, pos, **shape)  # type: ignore[arg-type]
            assert torch.equal(out, want), (name, shape)
            out = torch.full_like(want, 3)
            k = 5
            _kernels.launch_gather(
                view,
                ids,
                out,
                count=torch.tensor([k]),
                **shape,  # type: ignore[arg-type]
            )
            part = torch.zeros_like(want)
            okk = ok.clone()
            okk[k:] = False
            part[okk] = view[ids[okk]]
            assert torch.equal(out, part), (name, shape)


# ---- on the CPU: the policy conditions the docs state ------------------------------------------
class _FakeCuda:
    def __init__(self, rows: int, row_bytes: int) -> None:
        self.shape = (rows, row_bytes // 4)
        self.is_cuda = True

    def is_contiguous(self) -> bool:
        return True

    def element_size(self) -> int:
        return 4


def test_slot_merge_limits_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN/``scatter``'s docstring: the slot merge for fewer than ``SORT_FROM_IDS``
    ids, tables of at most ``SLOT_MERGE_MAX_ROWS`` rows and ``SORT_ABOVE_BYTES`` bytes,
    at most ``SPARSE_GAP_BYTES`` of table per id."""
    monkeypatch.setattr(_kernels, "pitch_nbytes", lambda t: t.shape[1] * 4)

    def merge(rows: int, row_bytes: int, n: int) -> bool:
        return _engine._slot_merge(_FakeCuda(rows, row_bytes), n)  # type: ignore[arg-type]

    gap = _kernels.SPARSE_GAP_BYTES
    assert merge(1_000_000, 512, 131_072)  # the seed scatter
    assert not merge(1_000_000, 512, _engine.SORT_FROM_IDS)
    assert merge(1_000, 512, _engine.SORT_FROM_IDS - 1)
    assert merge(gap // 64 * 10, 64, 10) and not merge(gap // 64 * 10 + 1, 64, 10)
    assert not merge(_engine.SLOT_MERGE_MAX_ROWS + 1, 4, _engine.SORT_FROM_IDS - 1)
    assert not merge((_engine.SORT_ABOVE_BYTES // 4096) + 1, 4096, _engine.SORT_FROM_IDS - 1)
    assert not merge(10, 64, 0)


# ---- on the GPU -----------------------------------------------------------------------------------
def _reference_scatter(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> np.ndarray:
    return _numpy_scatter(table.cpu().numpy(), ids.cpu().tolist(), rows.cpu().numpy())


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_gpu_scatter_modes_and_shapes_on_views_match_numpy(placement: str) -> None:
    """The real kernels of modes 1-3 (grid-stride and in-order, 1 and 3 rows a block) on
    a column slice and an interleaved slot of a table in host or GPU memory, with repeats
    and bad ids, against NumPy; the bytes around the view (the other columns / slots)
    are never touched."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    for geometry in ("column slice", "interleaved slot"):
        if geometry == "column slice":
            host = torch.randn(4099, 35, generator=gen)
            pick = (slice(None), slice(1, 33))  # 128 B rows, pitch 140 B, 4 B in
        else:
            host = torch.randn(4099, 3, 32, generator=gen)
            pick = (slice(None), 1)
        g = gl.DataGadget(host.clone(), placement=placement)
        base = g._store.device_view()
        view = base[pick]
        rows, n = view.shape[0], 3000
        for bad in (False, True):
            ids = _make_ids(rows, n, 11, bad).to(dev)
            src = torch.randn(n, *view.shape[1:], generator=gen).to(dev)
            ends = torch.stack([ids.min(), ids.max()])
            want = _reference_scatter(view, ids, src)
            for shape in ({}, {"blocks_per_sm": _kernels.IN_ORDER}, {"rows_per_block": 3}):
                for how in ("mode 2", "mode 2 guarded", "mode 3", "mode 1 sorted"):
                    snap = base.clone()
                    if how == "mode 3":
                        slot = torch.full((rows + 1,), 7, dtype=torch.int32, device=dev)
                        word = gl._ids.flag_word(dev)
                        assert word is not None
                        _kernels.launch_last_slots(ids, slot, flag_out=word)
                        _kernels.launch_scatter(
                            view, ids, src, None, _kernels.SCATTER_LAST_BY_SLOT_GUARDED,
                            slot=slot, **shape,
                        )  # fmt: skip
                        torch.cuda.synchronize()
                        assert gl._ids.read_flag() == int(bad)
                        refused = bad
                    elif how.startswith("mode 2"):
                        slot = torch.full((rows,), 7, dtype=torch.int32, device=dev)
                        guard = ends if how.endswith("guarded") else None
                        _kernels.launch_last_slots(ids, slot)
                        _kernels.launch_scatter(
                            view, ids, src, None, _kernels.SCATTER_LAST_BY_SLOT,
                            slot=slot, guard=guard, **shape,
                        )  # fmt: skip
                        refused = bad and guard is not None
                    else:
                        keys, pos = torch.sort(ids, stable=True)
                        _kernels.launch_scatter(
                            view, keys, src, pos, _kernels.SCATTER_LAST_OF_RUN,
                            guard=ends, **shape,
                        )  # fmt: skip
                        refused = bad
                    torch.cuda.synchronize()
                    if refused:
                        assert torch.equal(base, snap), (geometry, how, shape)
                    else:
                        np.testing.assert_array_equal(
                            view.cpu().numpy(), want, err_msg=f"{geometry} {how} {shape}"
                        )
                        outside = base.clone()
                        outside[pick] = snap[pick]
                        assert torch.equal(outside, snap), (geometry, how, "outside the view")
                    base.copy_(snap)
        g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_gather_reading_rows_once_past_two_gib_matches_numpy() -> None:
    """A deduplicated gather (slots on) from a pinned table of more than 2**31 bytes
    (2**22 rows of 640 B): rows near the end (byte offsets past 2**31 and 2**32) with
    many repeats, bad ids unchecked (zero rows), through ``gather_rows`` and ``getData``."""
    rows, width = 1 << 22, 160
    g = gl.DataGadget((rows, width), dtype="float32", placement="pinned", strategy="kernel")
    hv = g._store.host_view()
    dv = g._store.device_view()
    assert hv is not None and dv is not None
    tail = torch.arange(rows - 4096, rows)
    hv[tail] = (tail.float()[:, None] * 1000 + torch.arange(width).float()).contiguous()
    hv[:4096] = torch.arange(4096).float()[:, None] - 7.0
    n = rows // _kernels.DEDUP_ROWS_PER_ID  # the most rows per id the slots take
    gen = torch.Generator().manual_seed(5)
    ids = torch.cat([
        tail[torch.randint(0, 4096, (n // 2,), generator=gen)],
        torch.randint(0, 4096, (n - n // 2 - 3,), generator=gen),
        torch.tensor([rows - 1, rows, -1]),
    ])  # fmt: skip
    ids = ids[torch.randperm(n, generator=gen)]
    ok = (ids >= 0) & (ids < rows)
    want = torch.zeros(n, width)
    want[ok] = hv[ids[ok]]
    assert _kernels.dedup_slots(dv, n) is not None  # the slots are on for this request
    dids = ids.cuda()
    out = torch.full((n, width), 5.0, device="cuda")
    _kernels.gather_rows(dv, dids, out, dedup=True)
    assert torch.equal(out.cpu(), want)
    got = g.getData(dids, check_ids=False)
    assert torch.equal(got.cpu(), want)
    good = dids[ok.cuda()]
    assert torch.equal(g.getData(good).cpu(), want[ok])
    with pytest.raises(gl.GadgetIndexError):
        g.getData(dids)
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_two_threads_with_checked_writes_and_gathers_keep_their_own_check_words() -> None:
    """Each thread's page-locked word carries its own write's verdict: a thread whose
    writes always hold a bad id always raises with its table unchanged, while a thread
    writing and gathering good ids at the same time never raises and ends with NumPy's
    result."""
    rows, width, n = 5000, 16, 4000
    bad_table = gl.DataGadget(torch.zeros(rows, width), placement="pinned")
    good_table = gl.DataGadget(torch.zeros(rows, width), placement="pinned")
    errors: list[str] = []
    want = np.zeros((rows, width), dtype=np.float32)
    rounds = 60

    def bad_writer() -> None:
        gen = torch.Generator().manual_seed(1)
        for k in range(rounds):
            ids = torch.randint(0, rows, (n,), generator=gen)
            ids[k % n] = rows + k
            try:
                bad_table.insertData(torch.ones(n, width, device="cuda"), ids.cuda())
                errors.append(f"bad write {k} did not raise")
            except gl.GadgetIndexError:
                pass

    def good_writer() -> None:
        gen = torch.Generator().manual_seed(2)
        for k in range(rounds):
            ids = torch.randint(0, rows, (n,), generator=gen)
            rows_k = torch.full((n, width), float(k + 1))
            rows_k[:, 0] = torch.arange(n).float()
            try:
                good_table.insertData(rows_k.cuda(), ids.cuda())
                nonlocal want
                want = _numpy_scatter(want, ids.tolist(), rows_k.numpy())
                good_table.getData(ids.cuda())  # a checked gather on the same word
            except Exception as exc:  # noqa: BLE001
                errors.append(f"good round {k}: {exc!r}")

    threads = [threading.Thread(target=bad_writer), threading.Thread(target=good_writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert (bad_table.getData(torch.arange(rows)) == 0).all()
    np.testing.assert_array_equal(good_table.getData(torch.arange(rows)).cpu().numpy(), want)
    bad_table.close()
    good_table.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_checks_alternating_on_one_thread_never_see_a_stale_word() -> None:
    """The thread's word serves the gather check (``start_range_check``), the guarded
    scatter check (a ``sorted`` table) and the fused flag in turn: a failed check of one
    kind must not make the next good call of another kind raise, and each bad call raises
    with the table unchanged."""
    rows, width, n = 3000, 8, 2500
    g = gl.DataGadget(torch.zeros(rows, width), placement="pinned")
    s = gl.DataGadget(torch.zeros(rows, width), placement="pinned", strategy="sorted")
    gen = torch.Generator().manual_seed(4)
    good = torch.randint(0, rows, (n,), generator=gen).cuda()
    bad = good.clone()
    bad[7] = -3
    ones = torch.ones(n, width, device="cuda")
    calls = [
        ("fused write", lambda ids: g.insertData(ones, ids)),
        ("guarded write", lambda ids: s.insertData(ones, ids)),
        ("checked gather", lambda ids: g.getData(ids)),
    ]
    for first_name, first in calls:
        for second_name, second in calls:
            with pytest.raises(gl.GadgetIndexError):
                first(bad)
            second(good)  # must not raise
            torch.cuda.synchronize()
            assert first_name and second_name
    touched = torch.zeros(rows, dtype=torch.bool)
    touched[good.cpu()] = True
    for t in (g, s):
        got = t.getData(torch.arange(rows)).cpu()
        assert bool((got[touched] == 1).all()) and bool((got[~touched] == 0).all())
    g.close()
    s.close()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_gpu_checked_writes_and_deduplicated_gathers_on_a_side_stream(placement: str) -> None:
    """On a side stream: a fused checked write with repeats takes each id's last row, a
    bad id raises with the table unchanged, and a deduplicated gather (``getData`` of
    65,536+ ids with repeats) returns ``table[ids]`` once the stream is done."""
    rows, width = 60_000, 32
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(rows, width, generator=gen)
    g = gl.DataGadget(base.clone(), placement=placement)
    n = _kernels.DEDUP_MIN_IDS
    ids = torch.randint(0, rows, (n,), generator=gen)
    new = torch.randn(n, width, generator=gen)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dids, dnew = ids.cuda(), new.cuda()
        wrong = dids.clone()
        wrong[-1] = rows
        with pytest.raises(gl.GadgetIndexError):
            g.insertData(dnew, wrong)
        g.insertData(dnew, dids)
        got = g.getData(dids)
        got2 = g.getData(ids)  # CPU ids: checked on the CPU while the GPU gathers
    side.synchronize()
    want = torch.from_numpy(_numpy_scatter(base.numpy(), ids.tolist(), new.numpy()))
    assert torch.equal(g.getData(torch.arange(rows)).cpu(), want)
    assert torch.equal(got.cpu(), want[ids]) and torch.equal(got2.cpu(), want[ids])
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_gpu_fused_write_of_strided_or_aliasing_rows_matches_numpy(placement: str) -> None:
    """The fused write (``_slot_write``) given rows that are a transposed view, or a
    strided view of the table itself, with repeated ids: NumPy's result (each id's last
    row, the source read before anything is written)."""
    rows, width, n = 4000, 16, 1500
    gen = torch.Generator().manual_seed(12)
    base = torch.randn(rows, width, generator=gen)
    g = gl.DataGadget(base.clone(), placement=placement)
    ids = torch.randint(0, rows, (n,), generator=gen)
    ids[::7] = ids[3]
    t = torch.randn(width, n, generator=gen).cuda().t()  # (n, width), not contiguous
    g.insertData(t, ids.cuda())
    want = _numpy_scatter(base.numpy(), ids.tolist(), t.cpu().numpy())
    np.testing.assert_array_equal(g.getData(torch.arange(rows)).cpu().numpy(), want)
    own = g.as_tensor()[1::2][:n]  # every other row of the table itself
    src = own.cpu().numpy().copy()
    g.insertData(own, ids.cuda())
    want = _numpy_scatter(want, ids.tolist(), src)
    np.testing.assert_array_equal(g.getData(torch.arange(rows)).cpu().numpy(), want)
    g.close()


@pytest.mark.gpu
@NEEDS_CUPY
def test_gpu_gather_many_and_dataset_read_rows_once_and_match_numpy() -> None:
    """``gl.gather_many`` of two pinned tables and a ``GadgetDataset`` given ids, both with
    65,536+ repeated ids (the slots on): ``table[ids]`` for every table / column."""
    rows, width, n = 50_000, 8, _kernels.DEDUP_MIN_IDS + 3
    gen = torch.Generator().manual_seed(13)
    a = torch.randn(rows, width, generator=gen)
    b = torch.randn(rows, width, generator=gen)
    ga = gl.DataGadget(a.clone(), placement="pinned")
    gb = gl.DataGadget(b.clone(), placement="pinned")
    ids = torch.randint(0, rows // 10, (n,), generator=gen)  # many repeats
    assert _kernels.dedup_slots(ga._store.device_view(), n) is not None
    for where in (ids, ids.cuda()):
        got_a, got_b = gl.gather_many([ga, gb], where)
        assert torch.equal(got_a.cpu(), a[ids]) and torch.equal(got_b.cpu(), b[ids])
    ds = gl.GadgetDataset(ga, gb, device="cuda")
    batch = ds.gather(ids.cuda())
    assert torch.equal(batch[0].cpu(), a[ids]) and torch.equal(batch[1].cpu(), b[ids])
    ga.close()
    gb.close()
