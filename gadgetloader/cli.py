"""The ``gadgetloader`` command: ``info``, ``bench`` (and its suites), ``convert``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

#: bench suites: name -> (module, help); each module has add_arguments(parser) and run(args) -> dict
_SUITES: dict[str, tuple[str, str]] = {
    "seed": ("gadgetloader.bench._seed", "gather/scatter of random rows (the default)"),
    "sweep": ("gadgetloader.bench._sweep", "gather/scatter over table sizes and row widths"),
    "files": ("gadgetloader.bench._files", "loading and random reads from .npy / HDF5 / zarr"),
    "pipeline": (
        "gadgetloader.bench._pipeline",
        "DataLoader batches: torch per-sample vs gadgetloader",
    ),
    "train": ("gadgetloader.bench._train", "embedding training steps with offloaded tables"),
}


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gadgetloader", description="PyTorch tables too big for the GPU."
    )
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info", help="versions, GPU and measured link bandwidth (for bug reports)"
    )
    info.add_argument("--no-measure", action="store_true", help="skip the bandwidth measurement")
    info.add_argument("--json", metavar="FILE", help="also write the information as JSON")

    bench = sub.add_parser("bench", help="benchmarks against the baselines, in one run")
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON")
    suites = bench.add_subparsers(dest="suite", required=False, metavar="SUITE")
    importlib.import_module(_SUITES["seed"][0]).add_arguments(bench)
    for name, (module, help_text) in _SUITES.items():
        if name == "seed" or not _available(module):
            continue
        sp = suites.add_parser(name, help=help_text)
        sp.add_argument("--json", metavar="FILE", help="write the results as JSON")
        importlib.import_module(module).add_arguments(sp)

    if _available("gadgetloader.convert"):
        conv = sub.add_parser(
            "convert", help="convert a table between .npy, HDF5 and zarr (streaming)"
        )
        importlib.import_module("gadgetloader.convert").add_arguments(conv)
    return p


def _write_json(path: str | None, data: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gadgetloader`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "info":
        from .info import collect_info, format_info

        data = collect_info(measure=not args.no_measure)
        print(format_info(data))
        _write_json(args.json, data)
        return 0
    if args.command == "bench":
        from ._errors import GadgetError

        module = _SUITES[args.suite or "seed"][0]
        try:
            result = importlib.import_module(module).run(args)
        except GadgetError as exc:  # bad options (a missing --dir, ...): one line, not a trace
            print(f"gadgetloader bench: error: {exc}", file=sys.stderr)
            return 1
        _write_json(getattr(args, "json", None), result)
        return 0
    if args.command == "convert":
        return int(importlib.import_module("gadgetloader.convert").run(args) or 0)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
