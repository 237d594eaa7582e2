"""The seed benchmark: gather and scatter of random rows between a table and the GPU.

Every method is checked against a CPU reference before it is timed; times are
medians of CUDA-event-timed runs after warm-up; the pinned memcpy ceiling for the
same number of bytes is measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._dtypes import as_torch_dtype, dtype_name
from ._common import format_table, gbps, positive_int, seed_int, table_dtype, time_fn

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rows", type=positive_int, default=1_000_000, help="table rows (default 1,000,000)"
    )
    p.add_argument("--width", type=positive_int, default=128, help="elements per row (default 128)")
    p.add_argument(
        "--ids",
        type=positive_int,
        default=131_072,
        help="ids per call (default 131,072; at most --rows: a larger value is capped to it, "
        "as the scatter's ids are distinct; the report gives the count used)",
    )
    p.add_argument(
        "--dtype", type=table_dtype, default="float32", help="table dtype (default float32)"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=20, help="timed runs per method (median reported)"
    )
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (0 to 2**62)")
    p.add_argument("--no-speedtorch", action="store_true", help="skip SpeedTorch even if installed")


def _random_table(rows: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(rows, width, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, width), generator=gen).bool()
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -1000), min(info.max, 1000), (rows, width), generator=gen
    ).to(dtype)


def _then(action: Callable[[], Any], check: Callable[[], bool]) -> Callable[[], bool]:
    """A check that first runs ``action``."""

    def run() -> bool:
        action()
        return check()

    return run


def _same(fn: Callable[[], torch.Tensor], ref: torch.Tensor) -> Callable[[], bool]:
    """A check that ``fn()`` equals ``ref`` exactly (on the CPU)."""
    return lambda: bool(torch.equal(fn().cpu(), ref.cpu()))


class _Case:
    def __init__(
        self,
        name: str,
        kind: str,
        fn: Callable[[], Any] | None,
        check: Callable[[], bool] | None,
        note: str = "",
    ) -> None:
        self.name, self.kind, self.fn, self.check, self.note = name, kind, fn, check, note


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the seed benchmark; returns a JSON-able dict and prints a table."""
    from .. import DataGadget
    from ._common import measure_memcpy

    dtype = as_torch_dtype(table_dtype(args.dtype))  # (checked again: run() takes any Namespace)
    cuda = torch.cuda.is_available()
    gen = torch.Generator().manual_seed(args.seed)
    host = _random_table(args.rows, args.width, dtype, gen)
    row_bytes = args.width * dtype.itemsize
    n = min(args.ids, args.rows)
    ids_cpu = torch.randint(0, args.rows, (n,), generator=gen)  # gather: repeats allowed
    uids_cpu = torch.randperm(args.rows, generator=gen)[:n]  # scatter: distinct ids
    new_rows = _random_table(n, args.width, dtype, gen)
    nbytes = n * row_bytes
    ref_gather = host[ids_cpu]
    skipped: list[str] = []
    cases: list[_Case] = []
    keep: list[Any] = []  # keep objects alive

    def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a.cpu(), b.cpu()))

    if cuda:
        dev = torch.device("cuda")
        ids = ids_cpu.to(dev)
        uids = uids_cpu.to(dev)
        rows_dev = new_rows.to(dev)
        pinned_t = host.pin_memory()
        stage = torch.empty((n, args.width), dtype=dtype, pin_memory=True)
        stage_out = torch.empty((n, args.width), dtype=dtype, device=dev)
        keep += [pinned_t, stage, stage_out]
        resident = host.to(dev)
        out_buf = torch.empty((n, args.width), dtype=dtype, device=dev)
        link = measure_memcpy(nbytes, repeats=args.repeats)
        src_pin = torch.empty(nbytes // 4 + 1, dtype=torch.float32, pin_memory=True)
        dst_dev = torch.empty_like(src_pin, device=dev)
        keep += [src_pin, dst_dev]

        # ---- gather ------------------------------------------------------------
        cases.append(
            _Case(
                "limit: pinned memcpy",
                "gather",
                lambda: dst_dev.copy_(src_pin, non_blocking=True),
                None,
            )
        )
        cases.append(
            _Case(
                "torch naive: t[idx].to('cuda')",
                "gather",
                lambda: pinned_t[ids_cpu].to(dev),
                lambda: equal(pinned_t[ids_cpu].to(dev), ref_gather),
            )
        )

        def staged() -> torch.Tensor:
            torch.index_select(pinned_t, 0, ids_cpu, out=stage)
            return stage_out.copy_(stage, non_blocking=True)

        def staged_check() -> bool:
            r = staged()
            torch.cuda.synchronize()
            return equal(r, ref_gather)

        cases.append(
            _Case("torch staged: index_select+non_blocking", "gather", staged, staged_check)
        )
        for placement in ("pinned", "cuda"):
            g = DataGadget(host, placement=placement)
            keep.append(g)
            if placement == "pinned":
                cases.append(
                    _Case(
                        "gadgetloader pinned (CPU ids)",
                        "gather",
                        functools.partial(g.getData, ids_cpu, out=out_buf),
                        _same(functools.partial(g.getData, ids_cpu), ref_gather),
                    )
                )
                cases.append(
                    _Case(
                        "gadgetloader pinned (check_ids=False)",
                        "gather",
                        functools.partial(g.getData, ids, out=out_buf, check_ids=False),
                        _same(functools.partial(g.getData, ids, check_ids=False), ref_gather),
                    )
                )
            cases.append(
                _Case(
                    f"gadgetloader {placement}",
                    "gather",
                    functools.partial(g.getData, ids, out=out_buf),
                    _same(functools.partial(g.getData, ids), ref_gather),
                )
            )
            if placement == "pinned":
                view = g.as_tensor()
                cases.append(
                    _Case(
                        "zero-copy torch index_select (pinned view)",
                        "gather",
                        functools.partial(torch.index_select, view, 0, ids, out=out_buf),
                        _same(functools.partial(torch.index_select, view, 0, ids), ref_gather),
                    )
                )
        cases.append(
            _Case(
                "torch GPU-resident index_select",
                "gather",
                lambda: torch.index_select(resident, 0, ids, out=out_buf),
                lambda: equal(torch.index_select(resident, 0, ids), ref_gather),
            )
        )

        # ---- scatter -----------------------------------------------------------
        def expect_after_scatter() -> torch.Tensor:
            t = host.clone()
            t[uids_cpu] = new_rows
            return t

        after = expect_after_scatter()
        cases.append(
            _Case(
                "limit: pinned memcpy",
                "scatter",
                lambda: src_pin.copy_(dst_dev, non_blocking=True),
                None,
            )
        )

        def naive_scatter() -> None:
            pinned_t[uids_cpu] = rows_dev.cpu()

        cases.append(
            _Case(
                "torch naive: t[idx] = v.cpu()",
                "scatter",
                naive_scatter,
                _then(naive_scatter, functools.partial(equal, pinned_t, after)),
            )
        )

        def staged_scatter() -> None:
            stage.copy_(rows_dev, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            pinned_t.index_copy_(0, uids_cpu, stage)

        def staged_scatter_check() -> bool:
            pinned_t.copy_(host)
            staged_scatter()
            return equal(pinned_t, after)

        cases.append(
            _Case(
                "torch staged: non_blocking+index_copy_",
                "scatter",
                staged_scatter,
                staged_scatter_check,
            )
        )
        for placement in ("pinned", "cuda"):
            g = DataGadget(host, placement=placement)
            keep.append(g)

            every = torch.arange(args.rows, device=dev)
            chk = _then(
                functools.partial(g.insertData, rows_dev, uids),
                _same(functools.partial(g.getData, every), after),
            )

            cases.append(
                _Case(
                    f"gadgetloader {placement}",
                    "scatter",
                    functools.partial(g.insertData, rows_dev, uids),
                    chk,
                )
            )
            if placement == "pinned":
                # the same table written by torch through its CUDA view (no repeat merge,
                # no id check): what this table's memory allows a zero-copy scatter
                wview = g.as_tensor()
                cases.append(
                    _Case(
                        "zero-copy torch index_copy_ (pinned view)",
                        "scatter",
                        functools.partial(wview.index_copy_, 0, uids, rows_dev),
                        _then(
                            functools.partial(wview.index_copy_, 0, uids, rows_dev),
                            _same(functools.partial(g.getData, every), after),
                        ),
                    )
                )
        cases.append(
            _Case(
                "torch GPU-resident index_copy_",
                "scatter",
                lambda: resident.index_copy_(0, uids, rows_dev),
                _then(
                    lambda: resident.index_copy_(0, uids, rows_dev), lambda: equal(resident, after)
                ),
            )
        )

        # ---- SpeedTorch, where installed ----------------------------------------------
        if not args.no_speedtorch:
            cases += _speedtorch_cases(
                host, ids, uids, rows_dev, ref_gather, after, keep, skipped, equal
            )
    else:
        link = {}
        skipped.append("every GPU method (no CUDA device): only CPU-side methods ran")
        cases.append(
            _Case(
                "torch naive: t[idx]",
                "gather",
                lambda: host[ids_cpu],
                lambda: equal(host[ids_cpu], ref_gather),
            )
        )
        g = DataGadget(host, placement="cpu", device="cpu")
        keep.append(g)
        cases.append(
            _Case(
                "gadgetloader cpu",
                "gather",
                lambda: g.getData(ids_cpu),
                lambda: equal(g.getData(ids_cpu), ref_gather),
            )
        )
        after = host.clone()
        after[uids_cpu] = new_rows
        t2 = host.clone()
        cases.append(
            _Case(
                "torch naive: t[idx] = v",
                "scatter",
                lambda: t2.__setitem__(uids_cpu, new_rows),
                _then(lambda: t2.__setitem__(uids_cpu, new_rows), lambda: equal(t2, after)),
            )
        )
        g2 = DataGadget(host, placement="cpu", device="cpu")
        keep.append(g2)
        cases.append(
            _Case(
                "gadgetloader cpu",
                "scatter",
                lambda: g2.insertData(new_rows, uids_cpu),
                _then(
                    lambda: g2.insertData(new_rows, uids_cpu),
                    lambda: equal(g2.getData(torch.arange(args.rows)), after),
                ),
            )
        )

    results: list[dict[str, Any]] = []
    for c in cases:
        entry: dict[str, Any] = {"method": c.name, "kind": c.kind}
        try:
            if c.check is not None:
                ok = c.check()
                entry["check"] = "ok" if ok else "WRONG"
                if not ok:
                    results.append(entry)
                    continue
            assert c.fn is not None
            t = time_fn(c.fn, repeats=args.repeats)
            entry.update(ms=t["ms"], GBps=gbps(nbytes, t["ms"]))
        except Exception as exc:  # a baseline that cannot run here is reported, not fatal
            entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
        results.append(entry)

    for kind in ("gather", "scatter"):
        limit = next(
            (
                r
                for r in results
                if r["kind"] == kind and r["method"].startswith("limit") and "ms" in r
            ),
            None,
        )
        naive = next(
            (
                r
                for r in results
                if r["kind"] == kind and r["method"].startswith("torch naive") and "ms" in r
            ),
            None,
        )
        for r in results:
            if r["kind"] == kind and "ms" in r:
                r["of_limit"] = limit["ms"] / r["ms"] if limit else None
                r["x_naive"] = naive["ms"] / r["ms"] if naive else None

    report = {
        "benchmark": "seed",
        "rows": args.rows,
        "width": args.width,
        "dtype": dtype_name(dtype),
        "ids": n,
        "bytes_moved": nbytes,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "link": link,
        "results": results,
        "skipped": skipped,
    }
    headers = ["kind", "method", "ms", "GB/s", "of limit", "x naive", "check"]
    table_rows = [
        [
            r["kind"],
            r["method"],
            r.get("ms"),
            r.get("GBps"),
            r.get("of_limit"),
            r.get("x_naive"),
            r.get("check", r.get("error", "")),
        ]
        for r in results
    ]
    print(
        f"seed benchmark: table {args.rows} x {args.width} {dtype_name(dtype)}, {n} random ids "
        f"({nbytes / 2**20:.1f} MiB moved), {report['device']}"
    )
    print(format_table(headers, table_rows))
    for s in skipped:
        print(f"skipped: {s}")
    return report


def _speedtorch_cases(
    host: torch.Tensor,
    ids: torch.Tensor,
    uids: torch.Tensor,
    rows_dev: torch.Tensor,
    ref_gather: torch.Tensor,
    after: torch.Tensor,
    keep: list[Any],
    skipped: list[str],
    equal: Callable[[torch.Tensor, torch.Tensor], bool],
) -> list[_Case]:
    try:
        import cupy
        import SpeedTorch
    except Exception as exc:
        skipped.append(f"SpeedTorch ({type(exc).__name__}: install SpeedTorch==0.1.6 to compare)")
        return []
    if host.dtype == torch.bfloat16:
        skipped.append("SpeedTorch (no bfloat16)")
        return []
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "table.npy")
    np.save(path, host.numpy())
    cases = []
    try:
        st = SpeedTorch.DataGadget(path, CPUPinn=True)
        st.gadgetInit()
        st_w = SpeedTorch.DataGadget(path, CPUPinn=True)
        st_w.gadgetInit()
    except Exception as exc:
        skipped.append(f"SpeedTorch ({type(exc).__name__}: {exc})"[:200])
        return []
    finally:
        os.remove(path)
    keep += [st, st_w]
    ids_cp = cupy.asarray(ids)
    uids_cp = cupy.asarray(uids)
    ids_np = ids.cpu().numpy()
    cases.append(
        _Case(
            "SpeedTorch DataGadget CPUPinn (numpy ids)",
            "gather",
            lambda: st.getData(ids_np),
            lambda: equal(st.getData(ids_np), ref_gather),
        )
    )
    cases.append(
        _Case(
            "SpeedTorch DataGadget CPUPinn (CuPy ids)",
            "gather",
            lambda: st.getData(ids_cp),
            lambda: equal(st.getData(ids_cp), ref_gather),
        )
    )

    def st_scatter_check() -> bool:
        st_w.insertData(rows_dev, uids_cp)
        return equal(torch.as_tensor(cupy.asnumpy(st_w.CUPYcorpus)), after)

    cases.append(
        _Case(
            "SpeedTorch DataGadget CPUPinn (CuPy ids)",
            "scatter",
            lambda: st_w.insertData(rows_dev, uids_cp),
            st_scatter_check,
        )
    )
    return cases
