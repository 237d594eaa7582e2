"""``gadgetloader bench sweep``: gather/scatter GB/s against table size, row width and strategy.

One pinned buffer of the largest size is allocated once; each table size is its
first rows (the address range a kernel touches is what matters). Every method is
checked against a CPU reference before it is timed, and the pinned memcpy
ceiling for the same bytes is measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
from typing import Any

import torch

from ._common import (
    OptionError,
    comma_list,
    format_table,
    gbps,
    measure_memcpy,
    non_negative_int,
    positive_int,
    time_fn,
)

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes-gb", default="0.5,4,16,64", help="table sizes in GB (capped by free RAM)"
    )
    p.add_argument(
        "--widths",
        default="128",
        help="row widths in float32 elements (8 -> 32 B rows, 1024 -> 4 KB rows)",
    )
    p.add_argument("--ids", default="131072,1048576", help="ids per call")
    p.add_argument(
        "--strategies",
        default="auto,kernel,sorted,hybrid,torch,staged,naive",
        help="methods to time; also kernel-u<N> (row kernel unrolled N times, 1-16) and "
        "kernel-v<B> (widest vector B bytes: 1, 2, 4, 8, 16)",
    )
    p.add_argument(
        "--hybrid-fractions", default="0.6", help="CPU shares to try for the hybrid strategy"
    )
    p.add_argument("--pages", default="default", help="host page kinds to try: default,thp,hugetlb")
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument(
        "--naive-max-ids",
        type=non_negative_int,
        default=131072,
        help="skip naive torch above this many ids (slow)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw GB/s against table size per method")


_METHODS = ("auto", "kernel", "sorted", "hybrid", "torch", "staged", "naive")


def _options(
    args: argparse.Namespace,
) -> tuple[list[float], list[int], list[int], list[str], list[float]]:
    """The sweep's comma-separated options, checked (a clear error names the bad one)."""

    def numbers(text: str, kind: type, what: str, low: float, high: float | None = None) -> list:
        try:
            values = [kind(t) for t in str(text).split(",") if t.strip()]
        except ValueError:
            raise OptionError(f"{what} must be comma-separated numbers; got {text!r}") from None
        if not values or any(
            not math.isfinite(v) or v < low or (high is not None and v > high) for v in values
        ):
            bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
            raise OptionError(f"{what} values must be {bound}; got {text!r}")
        return values

    sizes = sorted(numbers(args.sizes_gb, float, "--sizes-gb", 1e-6))
    widths = numbers(args.widths, int, "--widths", 1)
    id_counts = numbers(args.ids, int, "--ids", 1)
    variants = tuple(
        m.strip() for m in str(args.strategies).split(",") if m.strip().startswith("kernel-")
    )
    for m in variants:
        # kernel-u<unroll> (1-16) or kernel-v<widest vector in bytes> (1, 2, 4, 8 or 16)
        match = re.fullmatch(r"kernel-(u|v)([0-9]+)", m)
        ok = match is not None and (
            1 <= int(match.group(2)) <= 16
            if match.group(1) == "u"
            else int(match.group(2)) in (1, 2, 4, 8, 16)
        )
        if not ok:
            raise OptionError(
                f"--strategies: {m!r} is no kernel variant; expected kernel-u<unroll 1-16> or "
                "kernel-v<vector bytes: 1, 2, 4, 8 or 16>"
            )
    methods = comma_list(str(args.strategies), _METHODS + variants, "--strategies")
    fractions = numbers(args.hybrid_fractions, float, "--hybrid-fractions", 0.0, 1.0)
    return sizes, widths, id_counts, methods, fractions


def _free_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        return 8 << 30


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..stores._pinned import PinnedStore
    from ..transfer import _engine

    sizes, widths, id_counts, methods, fractions = _options(args)
    from ..stores._pinned import PAGE_KINDS

    comma_list(str(args.pages), PAGE_KINDS, "--pages")
    if not torch.cuda.is_available():
        print("sweep: skipped -- it measures host<->GPU transfers and needs a CUDA device")
        if getattr(args, "plot", None):
            print(f"plot: nothing to draw, {args.plot} not written")
        return {
            "benchmark": "sweep",
            "device": "cpu",
            "cpu_threads": torch.get_num_threads(),
            "skipped": ["no CUDA device"],
            "results": [],
        }
    dev = torch.device("cuda")
    cap = 0.6 * _free_ram()
    skipped = [f"{s} GB (over 60% of free RAM)" for s in sizes if s * 1e9 > cap]
    sizes = [s for s in sizes if s * 1e9 <= cap]
    results: list[dict[str, Any]] = []
    link_cache: dict[int, dict[str, float]] = {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for pages in comma_list(str(args.pages), PAGE_KINDS, "--pages"):
        if not sizes:  # every size over the RAM cap: all reported as skipped
            break
        max_bytes = int(max(sizes) * 1e9)
        try:
            store = PinnedStore((max_bytes // 4,), torch.float32, dev, pages=pages)
        except MemoryError as exc:
            skipped.append(f"pages={pages}: {exc}")
            continue
        flat_dev = store.device_view()
        flat_host = store.host_view()
        assert flat_dev is not None and flat_host is not None
        flat_dev.uniform_(-1, 1)  # the GPU fills host RAM in place
        torch.cuda.synchronize()
        for size in sizes:
            for width in widths:
                rows = int(size * 1e9) // (4 * width)
                table = flat_dev[: rows * width].view(rows, width)
                host = flat_host[: rows * width].view(rows, width)
                row_bytes = 4 * width
                for requested in id_counts:
                    n = min(requested, rows)
                    ids_cpu = torch.randint(0, rows, (n,), generator=gen)
                    ids = ids_cpu.to(dev)
                    uniq = torch.unique(ids_cpu)
                    uids_cpu = uniq[torch.randperm(uniq.numel(), generator=gen)]
                    uids = uids_cpu.to(dev)
                    nbytes = n * row_bytes
                    scatter_bytes = uids.numel() * row_bytes  # distinct rows written
                    if nbytes not in link_cache:
                        link_cache[nbytes] = measure_memcpy(nbytes, repeats=args.repeats)
                    link = link_cache[nbytes]
                    ref = host[ids_cpu].to(dev)
                    out = torch.empty_like(ref)
                    new_rows = torch.rand(uids.numel(), width, device=dev)
                    base = {
                        "pages": pages,
                        "table_GB": size,
                        "width": width,
                        "row_bytes": row_bytes,
                        "ids": n,
                        "ids_requested": requested,
                    }
                    results.append(
                        {**base, "method": "memcpy", "kind": "gather", "GBps": link["h2d_GBps"]}
                    )
                    results.append(
                        {**base, "method": "memcpy", "kind": "scatter", "GBps": link["d2h_GBps"]}
                    )
                    for method in methods:
                        variants = (
                            [(f"hybrid {f:.2f}", f) for f in fractions]
                            if method == "hybrid"
                            else [(method, None)]
                        )
                        for name, frac in variants:
                            if frac is not None:
                                _engine.set_hybrid_fraction(frac)
                            if method == "naive" and n > args.naive_max_ids:
                                continue
                            g_fn, s_fn = _methods(
                                method,
                                table,
                                host,
                                ids,
                                ids_cpu,
                                uids,
                                uids_cpu,
                                out,
                                new_rows,
                                dev,
                            )
                            for kind, fn in (("gather", g_fn), ("scatter", s_fn)):
                                entry: dict[str, Any] = {**base, "method": name, "kind": kind}
                                try:
                                    if kind == "gather":
                                        out.zero_()
                                        got = fn()
                                        torch.cuda.synchronize()
                                        entry["check"] = "ok" if torch.equal(got, ref) else "WRONG"
                                    else:
                                        saved = host[uids_cpu].clone()
                                        fn()
                                        torch.cuda.synchronize()
                                        ok = torch.equal(
                                            torch.index_select(table, 0, uids), new_rows
                                        )
                                        entry["check"] = "ok" if ok else "WRONG"
                                    if entry["check"] == "ok":
                                        reps = 3 if method == "naive" else args.repeats
                                        t = time_fn(fn, repeats=reps, warmup=1)
                                        moved = nbytes if kind == "gather" else scatter_bytes
                                        entry.update(ms=t["ms"], GBps=gbps(moved, t["ms"]))
                                        entry["of_memcpy"] = entry["GBps"] / (
                                            link["h2d_GBps"]
                                            if kind == "gather"
                                            else link["d2h_GBps"]
                                        )
                                    if kind == "scatter":
                                        host[uids_cpu] = (
                                            saved  # restore for the next method's gather check
                                        )
                                        torch.cuda.synchronize()
                                except Exception as exc:
                                    entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                                results.append(entry)
                    _engine.set_hybrid_fraction(0.6)
                    print(f"  done: pages={pages} {size} GB width {width} ids {n}", flush=True)
        store.close()
        del store, flat_dev, flat_host
    report = {
        "benchmark": "sweep",
        "device": torch.cuda.get_device_name(),
        "cpu_threads": torch.get_num_threads(),
        "results": results,
        "skipped": skipped,
    }
    _print(report)
    if getattr(args, "plot", None):
        _plot(report, args.plot)
    return report


def _methods(
    method: str,
    table: torch.Tensor,
    host: torch.Tensor,
    ids: torch.Tensor,
    ids_cpu: torch.Tensor,
    uids: torch.Tensor,
    uids_cpu: torch.Tensor,
    out: torch.Tensor,
    new_rows: torch.Tensor,
    dev: torch.device,
) -> tuple[Any, Any]:
    from ..transfer import _engine

    if method in ("auto", "kernel", "sorted", "torch", "hybrid"):
        gids = ids_cpu if method in ("hybrid", "auto") else ids
        return (
            lambda: _engine.gather(table, gids, out=out, strategy=method, host=host),
            lambda: _engine.scatter(table, uids, new_rows, strategy=method, host=host),
        )
    if method.startswith(
        "kernel-"
    ):  # kernel variants: kernel-u<unroll>, kernel-v<max vector bytes>
        from ..transfer import _kernels

        value = int(method[8:])
        unroll, vector = (value, 16) if method[7] == "u" else (_kernels.UNROLL, value)

        def variant() -> torch.Tensor:
            _kernels.launch_gather(table, ids, out, unroll=unroll, max_vector=vector)
            return out

        return (
            variant,
            lambda: _engine.scatter(table, uids, new_rows, strategy="kernel", host=host),
        )
    if method == "staged":
        stage = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        stage_s = torch.empty(new_rows.shape, dtype=out.dtype, pin_memory=True)

        def g() -> torch.Tensor:
            torch.index_select(host, 0, ids_cpu, out=stage)
            return out.copy_(stage, non_blocking=True)

        def s() -> None:
            stage_s.copy_(new_rows, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            host.index_copy_(0, uids_cpu, stage_s)

        return g, s
    if method == "naive":

        def ng() -> torch.Tensor:
            return host[ids_cpu].to(dev)

        def ns() -> None:
            host[uids_cpu] = new_rows.cpu()

        return ng, ns
    raise ValueError(f"unknown method {method!r}")


def _print(report: dict[str, Any]) -> None:
    rows = [
        [
            r["pages"],
            r["table_GB"],
            r["row_bytes"],
            r["ids"],
            r["kind"],
            r["method"],
            r.get("GBps"),
            r.get("of_memcpy"),
            r.get("check", r.get("error", "")),
        ]
        for r in report["results"]
    ]
    print(f"sweep on {report['device']} ({report['cpu_threads']} CPU threads)")
    print(
        format_table(
            ["pages", "table GB", "row B", "ids", "kind", "method", "GB/s", "of memcpy", "check"],
            rows,
        )
    )
    for s in report["skipped"]:
        print(f"skipped: {s}")


def _plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed (pip install 'gadgetloader[plot]')")
        return
    res = [r for r in report["results"] if "GBps" in r]
    for r in res:
        r.setdefault("ids_requested", r["ids"])
    columns = sorted({(r["ids_requested"], r["row_bytes"]) for r in res})
    kinds = ["gather", "scatter"]
    # one colour per method in every panel
    names = sorted(
        {r["method"] if r["pages"] == "default" else f"{r['method']} [{r['pages']}]" for r in res}
    )
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {name: palette(i % palette.N) for i, name in enumerate(names)}
    fig, axes = plt.subplots(
        2, max(1, len(columns)), figsize=(6 * max(1, len(columns)), 8), squeeze=False
    )
    for (row, kind), (col, (n, rb)) in itertools.product(enumerate(kinds), enumerate(columns)):
        ax = axes[row][col]
        sel = [r for r in res if (r["kind"], r["ids_requested"], r["row_bytes"]) == (kind, n, rb)]
        for label in sorted({(r["method"], r["pages"]) for r in sel}):
            pts = sorted(
                (r["table_GB"], r["GBps"]) for r in sel if (r["method"], r["pages"]) == label
            )
            name = label[0] if label[1] == "default" else f"{label[0]} [{label[1]}]"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=name,
                color=colour[name],
                linestyle="--" if label[0] == "memcpy" else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("table size (GB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{kind}, {n} ids, {rb} B rows")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {os.path.abspath(path)}")
