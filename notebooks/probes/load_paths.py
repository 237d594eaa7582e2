"""Why torch's ``index_select`` beats the row kernel on narrow sparse rows (session 21).

Run on a CUDA machine from the repository root (needs 32 GB of pinnable host RAM)::

    python notebooks/probes/load_paths.py OUT.json

Session 20's probe (``sparse_shapes.py``) found torch's zero-copy ``index_select`` of sorted
ids 20-30% faster than every launch shape of the row kernel on rows under 512 B at 32-256 KB
of table per id, and as fast on 512 B rows. Torch's kernel differs from ours in three ways
this probe separates:

* **load instruction**: the row kernel reads the table through a ``const __restrict__``
  pointer, which lets the compiler use the read-only path (``ld.global.nc``); torch reads
  through a plain pointer. Variants ``plain`` (no ``__restrict__``), ``cg`` (``__ldcg``:
  cached in L2 only) and ``cs`` (``__ldcs``: streaming) compile the kernel source with that
  one line changed;
* **output order**: the ``sorted`` strategy writes each row to its original position
  (``pos``); torch's call here writes rows in sorted order (``nopos``);
* **launch shape**: torch runs 8 blocks of 128 threads per SM with 4-byte loads of float
  rows (``b4v4``: the same threads per SM in our kernel).

Also timed: torch's ``index_select`` of the unsorted ids and the row kernel on unsorted ids
(the ``kernel`` strategy). One 32 GB pinned table seen with 32 B, 128 B and 512 B rows;
random ids at 256 KB and 32 KB of table per id (131,072 and 1,048,576 ids). Each figure is
the median of two rounds of a median of 7 CUDA-event timings (ms); ``ptx`` counts the
read-only (``ld.global.nc``) loads in each build's gather kernels. Results:
``notebooks/results/h200-load-paths-session21.json``.

Further modes (second argument), each a later step of the same session:

* ``blocks``: the grid-stride kernel with blocks of 128-512 threads, and the kernels torch's
  ``index_select`` launches, from its profiler trace (``...-blocks-session21.json``: torch
  2.11 runs ``vectorized_gather_kernel<16>``, one block of 32 threads per id);
* ``warp``: the in-order launch (``r{rows per block}v{vector}``, ``launch_gather``'s
  ``rows_per_block``) against the rule, the default grid and torch, over rows of 32 B to
  1 KB, 32 KB to 1 MB of table per id, clustered and dense ids, and unsorted ids
  (``...-rows-session21.json``; run before the rule took the in-order launch, and
  ``...-warp-session21.json``, lost, timed a persistent one-warp-per-row kernel since
  removed: its figures are in ``h200-run-session21.log``);
* ``gaps``: the in-order launch against one block per SM (``b1v4``, ``b1v8``) and torch at
  32 KB to 1 MB of table per id, and 1M ids with a dense head (``...-gaps-session21.json``
  before the rule took it, ``...-rule-session21.json`` after: its ``rule`` column is the
  adopted ``ordered_shape``); a third argument sets the table's GB
  (``...-rule16-session21.json``: a 16 GB table);
* ``flush``: on a 16 GB table, each call timed repeated on the same ids (*warm*) and with the
  GPU's L2 cache flushed before it (*cold*), for the rule, one block per SM, the in-order
  launch (also with the table read through ``__ldg``) and torch (``...-flush-session21.json``:
  cold, torch and the in-order launch take the same time).
"""

from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import functools
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np
import torch

import gadgetloader as gl
from gadgetloader.transfer import _kernels as kernels

GB = 32
LOAD = "v[u] = (r >= 0 && r < a.n_rows) ? src[r * a.pitch + cc] : V();"
SOURCES = {
    "base": kernels._SOURCE,
    "plain": kernels._SOURCE.replace(
        "const V* __restrict__ src = (const V*)a.table[y];", "const V* src = (const V*)a.table[y];"
    ),
    "cg": kernels._SOURCE.replace(
        LOAD, LOAD.replace("src[r * a.pitch + cc]", "__ldcg(src + r * a.pitch + cc)")
    ),
    "ldg": kernels._SOURCE.replace("src[r * a.pitch + cc]", "__ldg(src + r * a.pitch + cc)"),
    "cs": kernels._SOURCE.replace(
        LOAD, LOAD.replace("src[r * a.pitch + cc]", "__ldcs(src + r * a.pitch + cc)")
    ),
}
_original_module = kernels._module
assert all(s != kernels._SOURCE for k, s in SOURCES.items() if k != "base"), (
    "a build did not change"
)


def ptx_counts(source: str) -> dict[str, int]:
    """Loads of each kind in the build's PTX (empty if NVRTC's PTX is not reachable)."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        prog = nvrtc.createProgram(source, "k.cu", [], [])
        arch = "".join(map(str, torch.cuda.get_device_capability()))
        nvrtc.compileProgram(
            prog, ["-std=c++14", "-DUNROLL=1", f"--gpu-architecture=compute_{arch}"]
        )
        ptx = nvrtc.getPTX(prog)
        if isinstance(ptx, bytes):
            ptx = ptx.decode()
        return {
            k: len(re.findall(k.replace(".", r"\."), ptx))
            for k in ("ld.global.nc", "ld.global.cg", "ld.global.cs", "ld.global.u", "ld.global.v")
        }
    except Exception as e:  # (a diagnostic only)
        return {"error": repr(e)[:200]}


def use(name: str) -> None:
    """Make the row kernels come from build ``name``."""
    if name == "base":
        kernels._module = _original_module
    else:
        dev = torch.cuda.current_device()
        with cp.cuda.Device(dev):
            mod = cp.RawModule(code=SOURCES[name], options=("-std=c++14", "-DUNROLL=1"))
            mod.compile()
        kernels._module = lambda idx, unroll=1, _m=mod: _m  # type: ignore[assignment]
    kernels._functions.clear()


def timed(fn: Callable[[], object], reps: int = 7, scratch: torch.Tensor | None = None) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` (ms), after one untimed call; with
    ``scratch``, the GPU's L2 cache is flushed (a write of ``scratch``) before each timed
    call, so no row read by an earlier call is still cached."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if scratch is not None:
            scratch.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def case(table: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    n, width = ids.numel(), table.shape[1]
    # rows with content at the ids (the table is otherwise zeros)
    table.index_copy_(0, ids, torch.randn(n, width, device="cuda"))
    torch.cuda.synchronize()
    sorted_ids, perm = torch.sort(ids)
    out = torch.empty(n, width, device="cuda")
    want = torch.index_select(table, 0, ids)
    want_sorted = torch.index_select(table, 0, sorted_ids)

    def g(**kw: Any) -> Callable[[], None]:
        return lambda: kernels.launch_gather(table, sorted_ids, out, pos=perm, **kw)

    plans: dict[str, tuple[str, Callable[[], None], torch.Tensor]] = {}
    for build in SOURCES:
        plans[f"{build}_rule"] = (build, g(ordered=True), want)
        plans[f"{build}_b4v4"] = (build, g(blocks_per_sm=4, max_vector=4), want)
        plans[f"{build}_d"] = (build, g(), want)
    plans["base_rule_nopos"] = (
        "base", lambda: kernels.launch_gather(table, sorted_ids, out, ordered=True), want_sorted,
    )  # fmt: skip
    plans["plain_rule_nopos"] = (
        "plain", lambda: kernels.launch_gather(table, sorted_ids, out, ordered=True), want_sorted,
    )  # fmt: skip
    plans["base_unsorted_d"] = ("base", lambda: kernels.launch_gather(table, ids, out), want)
    plans["plain_unsorted_d"] = ("plain", lambda: kernels.launch_gather(table, ids, out), want)
    plans["torch_sorted"] = (
        "base", lambda: torch.index_select(table, 0, sorted_ids, out=out), want_sorted,
    )  # fmt: skip
    plans["torch_unsorted"] = ("base", lambda: torch.index_select(table, 0, ids, out=out), want)
    runs: dict[str, list[float]] = {}
    wrong: list[str] = []
    for _ in range(2):
        for build in SOURCES:
            use(build)
            for name, (b, fn, expect) in plans.items():
                if b != build:
                    continue
                out.zero_()
                runs.setdefault(name, []).append(timed(fn))
                if not torch.equal(out, expect):
                    wrong.append(name)
    use("base")
    return {
        "median": {k: round(float(np.median(v)), 3) for k, v in runs.items()},
        "rounds": runs,
        "wrong": sorted(set(wrong)),
        "memcpy_ms": n * width * 4 / 55.3e6,
    }


def torch_kernels(table: torch.Tensor, ids: torch.Tensor) -> list[dict[str, Any]]:
    """The kernels torch's ``index_select`` of ``ids`` launches, with grid and block."""
    from torch.profiler import ProfilerActivity, profile

    sorted_ids = torch.sort(ids)[0]
    torch.index_select(table, 0, sorted_ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.index_select(table, 0, sorted_ids)
        torch.cuda.synchronize()
    found = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            found.append(
                {
                    "name": ev.name[:300],
                    "us": ev.device_time_total if hasattr(ev, "device_time_total") else None,
                }
            )
    try:
        import os
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        for e in trace.get("traceEvents", []):
            if e.get("cat") == "kernel":
                a = e.get("args", {})
                found.append(
                    {
                        "kernel": e.get("name", "")[:300],
                        "grid": a.get("grid"),
                        "block": a.get("block"),
                        "dur_us": e.get("dur"),
                        "regs": a.get("registers per thread"),
                    }
                )
    except Exception as e:  # (a diagnostic only)
        found.append({"error": repr(e)[:200]})
    return found


def block_shapes(table: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    """The row kernel with blocks of 128 threads (torch's), ids sorted with ``pos``."""
    n, width = ids.numel(), table.shape[1]
    sorted_ids, perm = torch.sort(ids)
    out = torch.empty(n, width, device="cuda")
    want = torch.index_select(table, 0, ids)
    launch, block = kernels._launch, kernels.BLOCK
    med: dict[str, float] = {}
    wrong = []
    try:
        for threads in (128, 256, 512):
            kernels.BLOCK = threads
            kernels._launch = functools.partial(launch, block=threads)  # type: ignore[assignment]
            for per_sm, vec in ((8, 4), (16, 4), (2, 4), (8, 16), (16, 16), (8, 8)):
                if per_sm * threads > 2048:
                    continue
                name = f"b{per_sm}t{threads}v{vec}"
                fn = functools.partial(
                    kernels.launch_gather, table, sorted_ids, out, pos=perm,
                    blocks_per_sm=per_sm, max_vector=vec,
                )  # fmt: skip
                out.zero_()
                med[name] = round(timed(fn), 3)
                if not torch.equal(out, want):
                    wrong.append(name)
    finally:
        kernels._launch, kernels.BLOCK = launch, block
    med["torch_sorted"] = round(timed(lambda: torch.index_select(table, 0, sorted_ids, out=out)), 3)
    return {"median": med, "wrong": wrong}


ROW_SHAPES = ((1, 16), (2, 16), (4, 16), (8, 16), (1, 4), (4, 4))


def warp_case(table: torch.Tensor, ids: torch.Tensor, unsorted: bool) -> dict[str, Any]:
    """The in-order gather, a warp per row (``r{rows per block}v{vector}``) against the rule, the
    default grid and torch, ids sorted with ``pos``; with ``unsorted`` also the ids as given."""
    n, width = ids.numel(), table.shape[1]
    table.index_copy_(0, ids, torch.randn(n, width, device="cuda"))
    sorted_ids, perm = torch.sort(ids)
    out = torch.empty(n, width, device="cuda")
    want = torch.index_select(table, 0, ids)
    want_sorted = torch.index_select(table, 0, sorted_ids)
    g = kernels.launch_gather
    plans: dict[str, tuple[Callable[[], None], torch.Tensor]] = {
        "rule": (functools.partial(g, table, sorted_ids, out, pos=perm, ordered=True), want),
        "d": (functools.partial(g, table, sorted_ids, out, pos=perm), want),
        "torch_sorted": (
            functools.partial(torch.index_select, table, 0, sorted_ids, out=out), want_sorted,
        ),
    }  # fmt: skip
    for b, v in ROW_SHAPES:
        plans[f"r{b}v{v}"] = (
            functools.partial(g, table, sorted_ids, out, pos=perm, rows_per_block=b, max_vector=v),
            want,
        )
    if unsorted:
        plans["u_d"] = (functools.partial(g, table, ids, out), want)
        plans["u_torch"] = (functools.partial(torch.index_select, table, 0, ids, out=out), want)
        for b in (1, 4):
            plans[f"u_r{b}v16"] = (functools.partial(g, table, ids, out, rows_per_block=b), want)
    runs: dict[str, list[float]] = {}
    wrong: list[str] = []
    for _ in range(2):
        for name, (fn, expect) in plans.items():
            out.zero_()
            runs.setdefault(name, []).append(timed(fn))
            if not torch.equal(out, expect):
                wrong.append(name)
    return {
        "median": {k: round(float(np.median(v)), 3) for k, v in runs.items()},
        "rounds": runs,
        "wrong": sorted(set(wrong)),
        "memcpy_ms": n * width * 4 / 55.3e6,
    }


def warp_main(path: str) -> None:
    start = time.time()
    results: dict[str, Any] = {}
    g = gl.DataGadget(((GB << 30) // 4,), dtype="float32", placement="pinned")
    flat = g.as_tensor()
    print(f"{GB} GB ready in {time.time() - start:.1f}s", flush=True)
    for width in (8, 32, 64, 128, 256):
        table = flat.view(-1, width)
        rows = table.shape[0]
        cases: list[tuple[str, torch.Tensor]] = []
        for gap in (256 << 10, 32 << 10, 512 << 10, 1 << 20):
            if width == 384 and gap > 256 << 10:
                continue
            torch.manual_seed(width + gap)
            n = (GB << 30) // gap
            cases.append((f"gap{gap >> 10}K/{n}", torch.randint(0, rows, (n,), device="cuda")))
        n = 131_072
        torch.manual_seed(width)
        if width in (32, 128):
            head = torch.randint(0, rows // 512, (n * 6 // 10,), device="cuda")
            tail = torch.randint(0, rows, (n - head.numel(),), device="cuda")
            cases.append(("corner", torch.randint(0, rows // 32, (n,), device="cuda")))
            cases.append(("head+tail", torch.cat([head, tail])))
            # dense: a 1 GB table's worth of rows (8 KB of table per id)
            cases.append(
                ("dense1GB", torch.randint(0, (1 << 30) // (width * 4), (n,), device="cuda"))
            )
        for name, ids in cases:
            key = f"{width * 4}B/{name}"
            results[key] = r = warp_case(table, ids, unsorted=name.startswith(("gap256K", "dense")))
            print(key, r["wrong"], r["median"], flush=True)
    g.close()
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def gap_case(table: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    """In-order single-row blocks with and without ``pos`` against the rule and torch."""
    n, width = ids.numel(), table.shape[1]
    table.index_copy_(0, ids, torch.randn(n, width, device="cuda"))
    sorted_ids, perm = torch.sort(ids)
    out = torch.empty(n, width, device="cuda")
    tmp = torch.empty(n, width, device="cuda")
    want = torch.index_select(table, 0, ids)
    want_sorted = torch.index_select(table, 0, sorted_ids)
    g = kernels.launch_gather

    def unpermuted(v: int) -> None:
        g(table, sorted_ids, tmp, rows_per_block=1, max_vector=v)
        out.index_copy_(0, perm, tmp)

    plans: dict[str, tuple[Callable[[], None], torch.Tensor]] = {
        "rule": (functools.partial(g, table, sorted_ids, out, pos=perm, ordered=True), want),
        "torch_sorted": (
            functools.partial(torch.index_select, table, 0, sorted_ids, out=out), want_sorted,
        ),
        "b1v4": (
            functools.partial(g, table, sorted_ids, out, pos=perm, blocks_per_sm=1, max_vector=4),
            want,
        ),
        "b1v8": (
            functools.partial(g, table, sorted_ids, out, pos=perm, blocks_per_sm=1, max_vector=8),
            want,
        ),
        "r1v16": (functools.partial(g, table, sorted_ids, out, pos=perm, rows_per_block=1), want),
        "r1v4": (
            functools.partial(g, table, sorted_ids, out, pos=perm, rows_per_block=1, max_vector=4),
            want,
        ),
        "r1v16_nopos": (functools.partial(g, table, sorted_ids, out, rows_per_block=1), want_sorted),
        "r1v4_nopos": (
            functools.partial(g, table, sorted_ids, out, rows_per_block=1, max_vector=4),
            want_sorted,
        ),
        "r1v16_copy": (functools.partial(unpermuted, 16), want),
    }  # fmt: skip
    runs: dict[str, list[float]] = {}
    wrong: list[str] = []
    for _ in range(2):
        for name, (fn, expect) in plans.items():
            out.zero_()
            runs.setdefault(name, []).append(timed(fn))
            if not torch.equal(out, expect):
                wrong.append(name)
    return {
        "median": {k: round(float(np.median(v)), 3) for k, v in runs.items()},
        "rounds": runs,
        "wrong": sorted(set(wrong)),
        "memcpy_ms": n * width * 4 / 55.3e6,
    }


def gaps_main(path: str, gb: int = GB) -> None:
    start = time.time()
    results: dict[str, Any] = {}
    g = gl.DataGadget(((gb << 30) // 4,), dtype="float32", placement="pinned")
    flat = g.as_tensor()
    print(f"{gb} GB ready in {time.time() - start:.1f}s", flush=True)
    for width in (8, 32, 128):
        table = flat.view(-1, width)
        rows = table.shape[0]
        for gap in (32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20):
            torch.manual_seed(width + gap)
            n = (gb << 30) // gap
            key = f"{width * 4}B/gap{gap >> 10}K/{n}"
            results[key] = r = gap_case(table, torch.randint(0, rows, (n,), device="cuda"))
            r["rule_shape"] = list(kernels.ordered_shape(width * 4, gb << 30, n))
            print(key, r["wrong"], r["median"], flush=True)
        if width != 8:
            # 1M ids (32 KB of table per id) of which 60% in the table's first 1/512
            n = 1 << 20
            torch.manual_seed(width)
            head = torch.randint(0, rows // 512, (n * 6 // 10,), device="cuda")
            tail = torch.randint(0, rows, (n - head.numel(),), device="cuda")
            key = f"{width * 4}B/head+tail/{n}"
            results[key] = r = gap_case(table, torch.cat([head, tail]))
            print(key, r["wrong"], r["median"], flush=True)
    g.close()
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def flush_main(path: str, gb: int = 16) -> None:
    """Warm (repeated calls, rows possibly still in L2) against cold (L2 flushed) timings of
    the rule, one block per SM, the in-order launch with plain and ``__ldg`` loads, and
    torch, where torch was faster than the in-order launch."""
    start = time.time()
    results: dict[str, Any] = {}
    g = gl.DataGadget(((gb << 30) // 4,), dtype="float32", placement="pinned")
    flat = g.as_tensor()
    scratch = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # 5x the L2
    print(f"{gb} GB ready in {time.time() - start:.1f}s", flush=True)
    for width, gap in (
        (8, 64 << 10),
        (8, 128 << 10),
        (32, 128 << 10),
        (32, 256 << 10),
        (128, 128 << 10),
    ):
        table = flat.view(-1, width)
        n = (gb << 30) // gap
        torch.manual_seed(width + gap)
        ids = torch.randint(0, table.shape[0], (n,), device="cuda")
        table.index_copy_(0, ids, torch.randn(n, width, device="cuda"))
        sorted_ids, perm = torch.sort(ids)
        out = torch.empty(n, width, device="cuda")
        want = torch.index_select(table, 0, ids)
        lg = kernels.launch_gather
        plans = {
            "rule": ("base", functools.partial(lg, table, sorted_ids, out, pos=perm, ordered=True)),
            "b1v4": ("base", functools.partial(lg, table, sorted_ids, out, pos=perm, blocks_per_sm=1, max_vector=4)),
            "r1v16": ("base", functools.partial(lg, table, sorted_ids, out, pos=perm, rows_per_block=1)),
            "ldg_r1v16": ("ldg", functools.partial(lg, table, sorted_ids, out, pos=perm, rows_per_block=1)),
            "ldg_b1v4": ("ldg", functools.partial(lg, table, sorted_ids, out, pos=perm, blocks_per_sm=1, max_vector=4)),
            "torch_sorted": ("base", functools.partial(torch.index_select, table, 0, sorted_ids, out=out)),
        }  # fmt: skip
        med: dict[str, list[float]] = {}
        wrong = []
        for _ in range(2):
            for build in ("base", "ldg"):
                use(build)
                for name, (b, fn) in plans.items():
                    if b != build:
                        continue
                    out.zero_()
                    for mode, timer in (
                        ("warm", timed),
                        ("cold", functools.partial(timed, scratch=scratch)),
                    ):
                        med.setdefault(f"{name}/{mode}", []).append(timer(fn))
                    if name != "torch_sorted" and not torch.equal(out, want):
                        wrong.append(name)
        use("base")
        key = f"{width * 4}B/gap{gap >> 10}K/{n}"
        results[key] = r = {
            "median": {k: round(float(np.median(v)), 3) for k, v in med.items()},
            "wrong": sorted(set(wrong)),
        }
        print(key, r, flush=True)
    g.close()
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    start = time.time()
    if len(sys.argv) > 2 and sys.argv[2] == "flush":
        flush_main(sys.argv[1])
        return
    if len(sys.argv) > 2 and sys.argv[2] == "gaps":
        gaps_main(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else GB)
        return
    if len(sys.argv) > 2 and sys.argv[2] == "warp":
        warp_main(sys.argv[1])
        return
    if len(sys.argv) > 2 and sys.argv[2] == "blocks":
        results: dict[str, Any] = {}
        g = gl.DataGadget(((GB << 30) // 4,), dtype="float32", placement="pinned")
        flat = g.as_tensor()
        print(f"{GB} GB ready in {time.time() - start:.1f}s", flush=True)
        for width in (8, 32, 128):
            table = flat.view(-1, width)
            for gap in (256 << 10, 32 << 10):
                n = (GB << 30) // gap
                torch.manual_seed(width + gap)
                ids = torch.randint(0, table.shape[0], (n,), device="cuda")
                table.index_copy_(0, ids, torch.randn(n, width, device="cuda"))
                key = f"{width * 4}B/gap{gap >> 10}K/{n}"
                r = block_shapes(table, ids)
                if gap == 256 << 10:
                    r["torch_kernels"] = torch_kernels(table, ids)
                results[key] = r
                print(key, r, flush=True)
        g.close()
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
        return
    results: dict[str, Any] = {"ptx": {b: ptx_counts(s) for b, s in SOURCES.items()}}
    print(results["ptx"], flush=True)
    g = gl.DataGadget(((GB << 30) // 4,), dtype="float32", placement="pinned")
    flat = g.as_tensor()
    print(f"{GB} GB ready in {time.time() - start:.1f}s", flush=True)
    for width in (8, 32, 128):
        table = flat.view(-1, width)
        rows = table.shape[0]
        for gap in (256 << 10, 32 << 10):
            n = (GB << 30) // gap
            torch.manual_seed(width + gap)
            ids = torch.randint(0, rows, (n,), device="cuda")
            key = f"{width * 4}B/gap{gap >> 10}K/{n}"
            results[key] = r = case(table, ids)
            print(key, r["wrong"], r["median"], flush=True)
    g.close()
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
