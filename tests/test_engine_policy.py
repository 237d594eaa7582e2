"""The transfer engine's automatic strategy choice and its validation (CPU-checkable parts)."""

from __future__ import annotations

import pytest
import torch

import gadgetloader as gl
from gadgetloader.transfer import _engine


@pytest.fixture
def with_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "cupy_available", lambda: True)


def _table(nbytes: int) -> torch.Tensor:
    # a meta tensor has a size but no memory: the policy only looks at sizes
    return torch.empty((nbytes // 512, 128), dtype=torch.float32, device="meta")


def test_auto_policy(with_cupy: None) -> None:
    host = torch.empty(1)
    small, big = _table(512 << 20), _table(64 << 30)
    assert _engine.resolve_strategy("auto", small, 131072, host) == "kernel"
    assert _engine.resolve_strategy("auto", big, 100, host) == "kernel"
    assert (
        _engine.resolve_strategy("auto", _table(16 << 30), 1 << 20, host) == "sorted"
    )  # 16 KB per id
    assert _engine.resolve_strategy("auto", big, 131072, host) == "hybrid"  # 512 KB per id
    # a switcher-sized request (a few thousand sparse rows): the CPU share's fixed costs lose
    assert _engine.resolve_strategy("auto", big, 3000, host) == "sorted"
    assert _engine.resolve_strategy("auto", big, 131072, None) == "sorted"  # no host view: GPU only
    assert _engine.resolve_strategy("auto", big, 131072, host, kind="scatter") == "kernel"
    assert _engine.resolve_strategy("hybrid", big, 131072, None) == "sorted"
    assert _engine.resolve_strategy("torch", big, 131072, host) == "torch"


def test_auto_sorts_large_requests_and_keeps_wide_rows_on_the_gpu(with_cupy: None) -> None:
    host = torch.empty(1)
    small = _table(512 << 20)
    assert _engine.resolve_strategy("auto", small, _engine.SORT_FROM_IDS - 1, host) == "kernel"
    assert _engine.resolve_strategy("auto", small, _engine.SORT_FROM_IDS, host) == "sorted"
    assert _engine.resolve_strategy("auto", small, 1 << 20, host, kind="scatter") == "kernel"
    for width, expect in ((128, "hybrid"), (255, "hybrid"), (256, "sorted"), (1024, "sorted")):
        wide = torch.empty(((64 << 30) // (4 * width), width), dtype=torch.float32, device="meta")
        assert _engine.resolve_strategy("auto", wide, 131072, host) == expect, width
    narrow = torch.empty(((16 << 30) // 32, 8), dtype=torch.float32, device="meta")
    assert _engine.resolve_strategy("auto", narrow, 131072, host) == "hybrid"  # 32 B rows


def test_without_cupy_everything_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "cupy_available", lambda: False)
    for s in ("auto", "kernel", "sorted", "hybrid", "torch"):
        assert _engine.resolve_strategy(s, _table(1 << 30), 10) == "torch"


def test_unknown_strategy_lists_valid_ones() -> None:
    with pytest.raises(
        gl.GadgetKeyError, match=r"Unknown strategy 'fast'; expected one of \['auto'"
    ):
        _engine.resolve_strategy("fast", _table(1 << 20), 10)
    with pytest.raises(gl.GadgetValueError):
        _engine.set_hybrid_fraction(1.5)


def test_small_tables_fuse_and_huge_ones_go_one_by_one() -> None:
    small = [_table(64 << 20) for _ in range(6)]
    assert [(g.start, g.stop) for g in _engine._groups(small)] == [(0, 4), (4, 6)]
    huge = [_table(1 << 30) for _ in range(3)]  # 3 GB together: translation-bound
    assert [(g.start, g.stop) for g in _engine._groups(huge)] == [(0, 1), (1, 2), (2, 3)]


def test_ordered_launch_shape_narrows_only_sparse_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ascending requests: dense ones (up to 16 KB of table per id) keep the default grid;
    sparse ones with rows of 512 B up to 2 KB get one block per SM with 8-byte vectors;
    rows of 32 B up to 512 B the in-order launch up to 128 KB of table per id and one
    block per SM with 4-byte vectors above; narrower and wider rows keep the default."""
    from gadgetloader.transfer import _kernels as k

    table = 32 << 30
    shape = k.ordered_shape
    for row in (32, 128, 512, 1024, 4096):
        assert shape(row, table, table // (8 << 10)) == (None, 16)  # 8 KB per id: dense
        assert shape(row, table, table // k.SPARSE_GAP_BYTES) == (None, 16)
    assert shape(512, table, 0) == (None, 16)
    for gap in (17 << 10, 32 << 10, 128 << 10, 129 << 10, 256 << 10, 1 << 20):
        n = table // gap
        assert shape(512, table, n) == (1, 8)  # 256 threads x 8 B = 4 rows of 512 B per SM
        assert shape(1536, table, n) == (1, 8)
        assert shape(2047, table, n) == (1, 8)
        # under 512 B: one warp per row in id order up to 128 KB per id, then
        # 256 threads x 4 B (1 KiB per SM)
        narrow = (k.IN_ORDER, 16) if gap <= k.IN_ORDER_GAP_BYTES else (1, 4)
        assert shape(511, table, n) == narrow
        assert shape(128, table, n) == narrow
        assert shape(32, table, n) == narrow
        assert shape(31, table, n) == (None, 16)  # narrower rows: the default
        assert shape(2048, table, n) == (None, 16)  # 2 KB and wider gained nothing
        assert shape(4096, table, n) == (None, 16)
    # the grid: capped at blocks_per_sm per SM, never more blocks than the work needs
    monkeypatch.setattr(k, "_sm_count", lambda idx: 132)
    monkeypatch.setattr(k, "_max_blocks", lambda idx: 132 * 16)
    assert k._grid(10**9, 0, 1, 1) == 132
    assert k._grid(10**9, 0, 1, None) == 132 * 16
    assert k._grid(300, 0, 1, 1) == 2


def test_ordered_launch_keeps_the_default_grid_where_the_shape_cannot_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launch whose rows or buffers allow only vectors narrower than the sparse shape's
    (1 or 2 B: slower than the default grid on clustered ids), or whose table is in GPU
    memory, keeps the default grid; a scatter's sparse shape uses 8-byte vectors; an
    interleaved group is sized by its whole row."""
    from gadgetloader.transfer import _kernels as k

    monkeypatch.setattr(k, "in_host_memory", lambda t: True)

    def choice(table: torch.Tensor, out: torch.Tensor, scatter: bool = False) -> tuple:
        return k._ordered_launch([table], [out], k.group_geometry([table]), 2, scatter=scatter)

    t = torch.zeros(1000, 32)  # 128 B rows, 64 KB of table per id
    assert choice(t, torch.zeros(2, 32)) == (k.IN_ORDER, 16)
    assert choice(t, torch.zeros(2, 32), scatter=True) == (1, 8)  # narrow: no in-order scatter
    t = torch.zeros(3000, 32)  # 192 KB per id: one block per SM
    assert choice(t, torch.zeros(2, 32)) == (1, 4)
    assert choice(t, torch.zeros(2, 32), scatter=True) == (1, 8)
    t8 = torch.zeros(1000, 33, dtype=torch.uint8)  # 33 B rows: 1-byte vectors only
    assert choice(t8, torch.zeros(2, 33, dtype=torch.uint8)) == (None, 16)
    t16 = torch.zeros(1000, 33, dtype=torch.float16)  # 66 B rows: 2-byte vectors only
    assert choice(t16, torch.zeros(2, 33, dtype=torch.float16)) == (None, 16)
    t4 = torch.zeros(1000, 25)  # 100 B rows: 4-byte vectors, enough for in-order
    assert choice(t4, torch.zeros(2, 25)) == (k.IN_ORDER, 16)
    tb = torch.zeros(1000, 128, dtype=torch.uint8)
    assert choice(tb, torch.zeros(2, 128, dtype=torch.uint8)) == (k.IN_ORDER, 16)
    odd = torch.zeros(2 * 128 + 1, dtype=torch.uint8)[1:].view(2, 128)  # an odd address
    assert odd.data_ptr() % 2 == 1
    assert choice(tb, odd) == (None, 16)
    tb = torch.zeros(3000, 128, dtype=torch.uint8)
    assert choice(tb, odd) == (None, 16)
    wide = torch.zeros(1000, 3, 4)  # three 16 B slots side by side: one 48 B row
    slots = [wide[:, j] for j in range(3)]
    outs = [torch.zeros(2, 4) for _ in range(3)]
    assert k._ordered_launch(slots, outs, k.group_geometry(slots), 2) == (k.IN_ORDER, 16)
    wide = torch.zeros(3000, 3, 4)  # 3000 48 B rows: 72 KB per id for 2 ids, 144 KB for 1
    slots = [wide[:, j] for j in range(3)]
    assert k._ordered_launch(slots, outs, k.group_geometry(slots), 2) == (k.IN_ORDER, 16)
    assert k._ordered_launch(slots, outs, k.group_geometry(slots), 1) == (1, 4)  # 144 KB
    monkeypatch.setattr(k, "in_host_memory", lambda t: False)  # GPU memory
    assert choice(t, torch.zeros(2, 32)) == (None, 16)
    assert choice(torch.zeros(1000, 32), torch.zeros(2, 32)) == (None, 16)


def test_in_order_launch_arguments_are_checked() -> None:
    """An in-order launch (gather or scatter) takes 1..32 rows a block, and no launch takes
    a negative blocks_per_sm: anything else is refused before a launch."""
    from gadgetloader.transfer import _kernels as k

    table, ids = torch.zeros(100, 8), torch.zeros(4, dtype=torch.int64)
    for bad in (0, 33, -1):
        with pytest.raises(ValueError, match="1..32 rows a block"):
            k.launch_gather(table, ids, torch.zeros(4, 8), rows_per_block=bad)
        with pytest.raises(ValueError, match="1..32 rows a block"):
            k.launch_scatter(table, ids, torch.zeros(4, 8), rows_per_block=bad)
    for launch in (k.launch_gather, k.launch_scatter):
        with pytest.raises(ValueError, match="blocks_per_sm >= 0; got -1"):
            launch(table, ids, torch.zeros(4, 8), blocks_per_sm=-1)


def test_sparse_scatters_of_512_b_to_1_kb_rows_take_the_in_order_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ascending scatters: rows of 512 B up to and including 1 KB more than 16 KB and at
    most 128 KB of table per id take the in-order launch; narrower and wider rows and
    sparser requests one block per SM with 8-byte vectors; dense requests, rows under
    32 B and of 2 KB and more the default grid; more ids than a grid may have blocks the
    default grid too."""
    from gadgetloader.transfer import _kernels as k

    monkeypatch.setattr(k, "in_host_memory", lambda t: True)

    def choice(row_bytes: int, gap: int, n: int = 4) -> tuple:
        table = torch.zeros(gap * n // row_bytes, row_bytes, dtype=torch.uint8)
        rows = torch.zeros(n, row_bytes, dtype=torch.uint8)
        return k._ordered_launch([table], [rows], k.group_geometry([table]), n, scatter=True)

    for row in (512, 640, 1024):
        assert choice(row, 8 << 10) == (None, 16)  # dense
        assert choice(row, 17 << 10) == (k.IN_ORDER, 16)
        assert choice(row, 128 << 10) == (k.IN_ORDER, 16)
        assert choice(row, 132 << 10) == (1, 8)  # sparser: one block per SM
    for row in (32, 128, 504, 1032, 2040):  # narrow rows (dense heads) and wider ones
        assert choice(row, 8 << 10) == (None, 16)
        assert choice(row, 64 << 10) == (1, 8)
    assert choice(16, 64 << 10) == (None, 16)  # narrower than 32 B
    assert choice(2048, 64 << 10) == (None, 16)
    assert choice(516, 64 << 10) == (k.IN_ORDER, 16)  # 4-byte vectors: enough
    assert choice(514, 64 << 10) == (None, 16)  # 2-byte vectors only: the default grid
    monkeypatch.setattr(k, "_MAX_GRID_X", 3)
    assert choice(512, 64 << 10) == (None, 16)


def test_in_order_launch_needs_a_grid_within_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """More ids than a grid may have blocks: the rule keeps the default grid, and an explicit
    in-order launch is refused."""
    from gadgetloader.transfer import _kernels as k

    monkeypatch.setattr(k, "in_host_memory", lambda t: True)
    table = torch.zeros(1000, 32)  # 128 B rows, 64 KB of table per id for 2 ids
    geom = k.group_geometry([table])
    assert k._ordered_launch([table], [torch.zeros(2, 32)], geom, 2) == (k.IN_ORDER, 16)
    monkeypatch.setattr(k, "_MAX_GRID_X", 1)
    assert k._ordered_launch([table], [torch.zeros(2, 32)], geom, 2) == (None, 16)
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 1 blocks"):
        k.launch_gather(table, ids, torch.zeros(2, 32), blocks_per_sm=k.IN_ORDER)
