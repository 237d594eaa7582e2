"""Review (session 15): a regression review of the session's library changes
(``git diff 2be859d..HEAD -- gadgetloader datasets``).

Each change was asked: can it break behaviour that worked before, and does it do what
its docstring / the README / DESIGN now promise? The row kernels are checked on the CPU
through an emulation of ``gl_gather_*`` / ``gl_scatter_*`` that stands in for the launch
(as ``test_review_session15_kernels.py`` does): it moves the bytes a GPU would and
raises ``AssertionError`` on any access outside the tensors the launcher call was given.
GPU-marked tests repeat the kernel cases on a CUDA device.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import os
import pickle
from typing import Any

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.data._dataset import GadgetBatch
from gadgetloader.transfer import _engine, _kernels
from gadgetloader.transfer import gather as transfer_gather
from gadgetloader.transfer import scatter as transfer_scatter


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


# ---- an emulation of the row kernels (CPU tensors as tables) -----------------------------------
def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


class _Emulator:
    """``gl_gather_W`` / ``gl_scatter_W`` run on host memory, touching only the tensors
    the public launcher call was given."""

    def __init__(self) -> None:
        self.ranges: list[list[tuple[int, int]]] = []

    def _check(self, addr: int, nbytes: int, how: str) -> None:
        for frame in self.ranges:
            for a, b in frame:
                if a <= addr and addr + nbytes <= b:
                    return
        raise AssertionError(
            f"the kernel would {how} {nbytes} bytes at {addr:#x}, outside the tensors given"
        )

    def read(self, addr: int, nbytes: int) -> bytes:
        self._check(addr, nbytes, "read")
        return ctypes.string_at(addr, nbytes)

    def write(self, addr: int, data: bytes) -> None:
        self._check(addr, len(data), "write")
        ctypes.memmove(addr, data, len(data))

    def i64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little", signed=True)

    def launch(self, kernel: Any, grid: Any, words: list[int], *args: Any, **kw: Any) -> None:
        name = kernel[0]
        w = [int(x) for x in words]
        vec, gy = int(name.rsplit("_", 1)[1]), int(grid[1])
        if name.startswith("gl_gather_"):
            tables, outs = w[0:4], w[4:8]
            n_rows, vpr, pitch, segs, ids, pos, n, count = w[8:16]
            valid = n if not count else min(max(self.i64(count), 0), n)
            for y in range(gy):
                for j in range(n):
                    r = self.i64(ids + 8 * j) if j < valid else -1
                    p = self.i64(pos + 8 * j) if pos else j
                    for s in range(segs):
                        if 0 <= r < n_rows:
                            data = self.read(tables[y] + (r * pitch + s * vpr) * vec, vpr * vec)
                        else:
                            data = bytes(vpr * vec)
                        self.write(outs[y + s] + p * vpr * vec, data)
        elif name.startswith("gl_scatter_"):
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
        else:
            raise AssertionError(f"{name} was launched (not emulated here)")


def _guarded(emu: _Emulator, fn: Any, extra: Any = None) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        frame = []
        for a in [*args, *kwargs.values()]:
            for t in a if isinstance(a, (list, tuple)) else [a]:
                if isinstance(t, torch.Tensor) and t.numel():
                    frame.append((t.data_ptr(), t.data_ptr() + _extent(t)))
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
    e = _Emulator()
    monkeypatch.setattr(_kernels, "_launch", e.launch)
    monkeypatch.setattr(_kernels, "_function", lambda idx, unroll, name: (name, 0))
    monkeypatch.setattr(_kernels, "_max_blocks", lambda idx: 64)
    monkeypatch.setattr(_kernels, "_sm_count", lambda idx: 8)
    monkeypatch.setattr(_kernels, "_row_gathers", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_engine, "cupy_available", lambda: True)
    for name in ("launch_gather", "launch_scatter", "gather_rows"):
        monkeypatch.setattr(_kernels, name, _guarded(e, getattr(_kernels, name)))
    fl = _kernels.FusedLauncher

    def tables(self: Any, *a: Any) -> list[tuple[int, int]]:
        row, pitch, _ = self.geometry
        span = (self.num_rows - 1) * pitch + row if self.num_rows else 0
        return [(p, p + span) for p in self.ptrs]

    monkeypatch.setattr(fl, "gather", _guarded(e, fl.gather, tables))
    monkeypatch.setattr(fl, "scatter", _guarded(e, fl.scatter, tables))
    return e


def _layouts() -> dict[str, torch.Tensor]:
    return {
        "1-D": torch.arange(30.0),
        "zero-width": torch.zeros(30, 0),
        "bool x3": torch.arange(90).reshape(30, 3) % 3 == 0,
        "uint8 x3": torch.arange(90, dtype=torch.uint8).reshape(30, 3),
        "bfloat16 x3": torch.arange(90.0).reshape(30, 3).to(torch.bfloat16),
        "float64 2x3": torch.arange(180.0, dtype=torch.float64).reshape(30, 2, 3),
        "column view": torch.arange(300.0).reshape(30, 10)[:, 2:5],
    }


# ---- passing checks: the new launch checks refuse nothing valid ------------------------------
@pytest.mark.parametrize("layout", list(_layouts()))
@pytest.mark.parametrize("strategy", ["kernel", "sorted"])
def test_emulated_odd_row_layouts_and_2d_ids_still_move_like_torch(
    emu: _Emulator, layout: str, strategy: str
) -> None:
    """1-D tables, zero-width rows, 1- and 2-byte rows, multi-dim rows and column views,
    with 1-D and 2-D ids and repeated ids (the sorted strategy's ``pos`` permutation):
    every launch passes the session's buffer / ids checks and moves torch's rows."""
    for ids in (torch.tensor([5, 1, 29, 5, 0, 7]), torch.tensor([[5, 1, 29], [5, 0, 7]])):
        t = _layouts()[layout]
        got = transfer_gather(t, ids, strategy=strategy)
        assert torch.equal(got, t[ids])
        rows = torch.flip(t[ids].reshape(6, *t.shape[1:]), [0]).reshape(got.shape).contiguous()
        want = t.clone()
        flat, r = ids.reshape(-1), rows.reshape(6, *t.shape[1:])
        for j in range(6):  # the last occurrence of an id wins
            want[flat[j]] = r[j]
        transfer_scatter(t, ids, rows, strategy=strategy)
        assert torch.equal(t, want)
    empty = torch.zeros(0, 4)  # a 0-row table and no ids
    none = torch.zeros(0, dtype=torch.int64)
    assert transfer_gather(empty, none, strategy=strategy).shape == (0, 4)
    transfer_scatter(empty, none, torch.zeros(0, 4), strategy=strategy)


def test_emulated_interleaved_slots_with_counts_and_misaligned_buffers(emu: _Emulator) -> None:
    inter = torch.arange(20 * 3 * 4, dtype=torch.uint8).reshape(20, 3, 4)
    slots = [inter[:, k] for k in range(3)]
    ids = torch.tensor([1, 4, 9, 9])
    outs = _engine.gather_many(slots, ids, None, "kernel", ids_sorted=True, count=torch.tensor([3]))
    for k, o in enumerate(outs):
        assert torch.equal(o[:3], inter[[1, 4, 9], k]) and bool((o[3:] == 0).all())
    launcher = _kernels.FusedLauncher(slots)
    raw = torch.zeros(4 * 4 + 1, dtype=torch.uint8)
    odd = [
        raw[1:].view(4, 4),
        torch.zeros(4, 4, dtype=torch.uint8),
        torch.zeros(4, 4, dtype=torch.uint8),
    ]
    launcher.gather(ids, odd, torch.tensor([4]))  # a buffer 1 byte off: narrower vectors
    for k, o in enumerate(odd):
        assert torch.equal(o, inter[ids, k])
    launcher.scatter(
        ids[:3],
        [torch.full((3, 4), 200 + k, dtype=torch.uint8) for k in range(3)],
        torch.tensor([2]),
    )
    for k in range(3):
        assert bool((inter[[1, 4], k] == 200 + k).all()) and not bool((inter[9, k] >= 200).any())


# ---- defect: pos is not checked ----------------------------------------------------------------
# DEFECT: launch_gather / launch_scatter check pos's dtype, device and contiguity but not its length (nor, for a gather with pos, the output's rows): the kernel reads pos past its end and writes past `out` (DESIGN: "a kernel is only ever given memory it may touch")
@pytest.mark.parametrize("case", ["gather-short-pos", "gather-small-out", "scatter-short-pos"])
def test_emulated_launch_with_pos_stays_inside_its_buffers(emu: _Emulator, case: str) -> None:
    table = torch.arange(40.0).reshape(10, 4)
    before = table.clone()
    ids = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError):
        if case == "gather-short-pos":
            _kernels.launch_gather(table, ids, torch.zeros(4, 4), torch.tensor([0, 1]))
        elif case == "gather-small-out":
            _kernels.launch_gather(table, ids, torch.zeros(2, 4), torch.tensor([3, 2, 1, 0]))
        else:
            _kernels.launch_scatter(table, ids, torch.zeros(4, 4), torch.tensor([0, 1]))
    assert torch.equal(table, before)


# DEFECT: on the GPU, launch_gather / launch_scatter take a `pos` shorter than the ids (and a gather's out smaller than pos names) without a check: the kernel reads pos past its end / writes past `out`
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gather-short-pos", "gather-small-out", "scatter-short-pos"])
def test_gpu_launch_with_pos_is_checked_before_the_kernel(case: str) -> None:
    pytest.importorskip("cupy")
    dev = torch.device("cuda")
    table = torch.arange(40.0, device=dev).reshape(10, 4)
    before = table.clone()
    ids = torch.tensor([1, 2, 3, 4], device=dev)
    # what the kernel would touch past the views lies inside the same allocations (canaries)
    pos_all = torch.tensor([0, 1, 0, 0, 0, 0], device=dev)
    canary = torch.full((8, 4), -9.0, device=dev)
    with pytest.raises(ValueError):
        if case == "gather-short-pos":
            _kernels.launch_gather(table, ids, canary[:4], pos_all[:2])
        elif case == "gather-small-out":
            _kernels.launch_gather(table, ids, canary[:2], torch.tensor([3, 2, 1, 0], device=dev))
        else:
            _kernels.launch_scatter(table, ids, canary[:4], pos_all[:2])
    torch.cuda.synchronize()
    assert torch.equal(table, before)
    assert bool((canary == -9.0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["cuda", "pinned"])
def test_gpu_tables_of_odd_layouts_read_and_write_like_numpy(placement: str) -> None:
    """The session's launch checks on real tables: 1-D, 1-byte rows, bfloat16, 2x3 rows,
    2-D ids and repeated ids (the last occurrence wins) through getData / insertData."""
    if placement == "pinned":
        pytest.importorskip("cupy")
    for name, src in _layouts().items():
        if name in ("column view", "zero-width"):
            continue
        g = gl.DataGadget(src.contiguous(), placement=placement)
        try:
            ids = torch.tensor([[5, 1, 29], [5, 0, 7]])
            assert torch.equal(g.getData(ids).cpu(), src[ids]), name
            rows = torch.flip(src[ids.reshape(-1)], [0]).contiguous()
            want = src.clone()
            for j, i in enumerate(ids.reshape(-1).tolist()):
                want[i] = rows[j]
            g.insertData(rows.to(g.device), ids.reshape(-1))
            assert torch.equal(g.getData(slice(None)).cpu(), want), name
        finally:
            g.close()


# ---- the sampler's / loader's epoch end --------------------------------------------------------
# DEFECT: after GadgetLoader's pass past epoch 2**64-1 is refused, loader.state_dict() reports epoch 2**64, a state no loader can load (the sampler's own state stays loadable); _loader.py __iter__ records the pass before the sampler refuses it
def test_loader_state_after_the_refused_pass_past_the_last_epoch_is_loadable() -> None:
    ds = gl.GadgetDataset(torch.arange(10.0))
    loader = gl.GadgetLoader(ds, batch_size=4)
    loader.set_epoch(2**64 - 1)
    assert len(list(loader)) == 3
    with pytest.raises(gl.GadgetValueError):
        next(iter(loader))  # nothing after the last orderable epoch
    state = loader.state_dict()
    assert state["sampler"]["epoch"] < 2**64
    fresh = gl.GadgetLoader(ds, batch_size=4)
    fresh.load_state_dict(state)  # its own state loads
    # (a state saved at an epoch's end gives one empty pass -- the rest of that epoch, as
    # StatefulDataLoader expects -- and then the next epoch, which here does not exist)
    assert list(fresh) == []
    with pytest.raises(gl.GadgetValueError):
        next(iter(fresh))


# ---- HDF5: the truncation check skipped while unflushed --------------------------------------
# DEFECT: a write call that fails part-way (a full disk) never flushes, so the HDF5 handle stays "_unflushed" and _check_extent skips the truncation check for good: a file truncated afterwards reads as rows of zeros (before session 15 this raised GadgetFileError)
@pytest.mark.parametrize("chunks", [(64, 16), None], ids=["chunked", "contiguous"])
def test_hdf5_truncation_after_a_failed_write_is_still_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, chunks: Any
) -> None:
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "t.h5"
    a = np.random.default_rng(0).standard_normal((4096, 16)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=a, chunks=chunks)
    g = gl.DataGadget(str(path), placement="file", cache_bytes=16384)
    try:
        np.testing.assert_array_equal(_np(g.getData([5])), a[5:6])

        def full_disk(self: Any, *args: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(h5py.Dataset, "write_direct", full_disk)
            with pytest.raises(gl.GadgetFileError):
                g.insertData(torch.ones(1, 16), torch.tensor([0]))
        with open(path, "r+b") as f:  # then the file is truncated in place
            f.truncate(os.path.getsize(path) // 2)
        with pytest.raises(gl.GadgetFileError):
            g.getData(list(range(4000, 4096)))
    finally:
        g.close()


# ---- bench CLI: which RuntimeErrors are "not enough memory" ---------------------------------
# DEFECT: the bench CLI reports any RuntimeError whose text holds "memory" or "alloc" as "not enough memory for the sizes asked; choose smaller sizes" (rc 1, no traceback): a CUDA "illegal memory access" (a crashed kernel) or an internal assert in CUDACachingAllocator.cpp is masked as a size problem (cli.py, the RuntimeError handler)
@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: an illegal memory access was encountered",
        # (torch's caching allocator's internal assert: a bug report, not a size problem)
        'NVML_SUCCESS == r INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":830',
    ],
    ids=["illegal-memory-access", "allocator-assert"],
)
def test_bench_crash_mentioning_memory_is_not_reported_as_out_of_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    import importlib

    from gadgetloader import cli

    seed = importlib.import_module("gadgetloader.bench._seed")

    def crash(args: Any) -> Any:
        raise RuntimeError(text)

    monkeypatch.setattr(seed, "run", crash)
    try:
        rc = cli.main(["bench", "seed"])
    except RuntimeError as exc:  # a crash shown as one: fine
        assert text in str(exc)
        return
    err = capsys.readouterr().err
    assert rc != 0
    assert "not enough memory" not in err and "smaller sizes" not in err, err


# ---- indexing: the new row-index rules ---------------------------------------------------------
# DEFECT: slices into the row now refuse bounds that are not Python/NumPy ints (_check_row_slice): a 0-d integer tensor bound, which torch and NumPy take through __index__ and which worked before session 15, raises GadgetTypeError
def test_row_slice_bounds_taking___index___work_as_before() -> None:
    a = np.arange(24.0, dtype=np.float32).reshape(4, 6)
    g = gl.DataGadget(torch.from_numpy(a.copy()), placement="cpu")
    start = torch.tensor(1)  # e.g. an offset computed by torch
    np.testing.assert_array_equal(_np(g[[1, 2], start:3]), a[[1, 2], 1:3])
    np.testing.assert_array_equal(_np(g[1:3, start : start + 2]), a[1:3, 1:3])


# DEFECT: g[[1, 2], [0, 1]] silently returns a (2, 2, D) block of rows (the tuple of lists read as a 2-D id array) while g[[1, 2], 0] now indexes like NumPy and g[[1, 2], np.array([0, 1])] is refused; NumPy / torch (and SpeedTorch's CuPy) give the elements (1, 0) and (2, 1)
def test_tuple_of_two_id_lists_is_numpy_style_or_refused() -> None:
    a = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(torch.from_numpy(a.copy()), placement="cpu")
    try:
        got = g[[1, 2], [0, 1]]
    except gl.GadgetError:
        return  # refused as ambiguous: fine
    np.testing.assert_array_equal(_np(got), a[[1, 2], [0, 1]])


def test_list_of_ids_then_ints_edge_cases_follow_numpy() -> None:
    """The session's ``(list, int)`` rule: ranges, empty lists, negative ints, nested
    id lists; out-of-range ints and 1-D tables (no row axis) are IndexErrors; writes."""
    a = np.arange(24.0, dtype=np.float32).reshape(4, 6)
    g = gl.DataGadget(torch.from_numpy(a.copy()), placement="cpu")
    for idx in [([1, 2], 0), ([1, 2], -1), (range(1, 3), 2), ([], 0), ([[1, 2], [0, 3]], 4)]:
        np.testing.assert_array_equal(_np(g[idx]), a[idx])
    for bad in [([1, 2], 6), ([1, 2], -7)]:
        with pytest.raises(IndexError):
            g[bad]
    g[[0, 3], 5] = torch.tensor([-1.0, -2.0])
    a[[0, 3], 5] = [-1.0, -2.0]
    np.testing.assert_array_equal(_np(g[:]), a)
    one = gl.DataGadget(torch.arange(5.0), placement="cpu")
    for bad in [([1, 2], 0), ([1, 2], -1), ([], 0)]:
        with pytest.raises(IndexError):
            one[bad]
    assert one[(1, 2)].tolist() == [1.0, 2.0]  # a tuple of plain ints stays a list of ids


# ---- GadgetBatch.to and the DataGadget's tensor-like surface ---------------------------------
def test_batch_to_devices_and_gadget_duck_typing_keep_working() -> None:
    b = GadgetBatch((torch.arange(3), torch.ones(3)))
    for dev in ("cpu", torch.device("cpu")):
        out = b.to(dev, non_blocking=True)
        assert isinstance(out, GadgetBatch) and out[0].dtype == torch.int64
        assert all(t.device.type == "cpu" for t in out)
    with pytest.raises(gl.GadgetTypeError):
        b.to(torch.float16)
    src = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    # (rows delivered on the CPU: on a GPU machine getData defaults to CUDA, which NumPy
    # cannot read through the sequence protocol)
    g = gl.DataGadget(torch.from_numpy(src.copy()), placement="cpu", device="cpu")
    np.testing.assert_array_equal(np.asarray(g), src)  # sequence protocol still works
    assert len(g) == 4 and len(list(iter(g))) == 4
    assert (g.dim(), g.ndim, g.numel(), tuple(g.size()), g.size(-1)) == (2, 2, 12, (4, 3), 3)
    assert not hasattr(g, "grad") and not hasattr(g, "is_cuda")
    assert getattr(g, "is_leaf", "default") == "default"
    for twin in (pickle.loads(pickle.dumps(g)), copy.copy(g), copy.deepcopy(g)):
        np.testing.assert_array_equal(_np(twin[:]), src)
