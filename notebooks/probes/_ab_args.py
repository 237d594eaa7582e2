"""Arguments of the A/B probes (``seed_ab.py``, ``getdata_ab.py``): ``OUT.json NAME=DIR ...``,
each DIR a checkout whose ``gadgetloader`` package the probe imports in a child process."""

from __future__ import annotations

import os
import sys


def ab_args(probe: str) -> tuple[str, list[tuple[str, str]]]:
    """``(out_path, [(name, dir), ...])`` from ``sys.argv``; a usage line and exit status 2
    for anything else."""
    usage = f"usage: python {probe} OUT.json NAME=DIR [NAME=DIR ...]"
    args = sys.argv[1:]
    if len(args) < 2 or "=" in args[0] or not all("=" in a for a in args[1:]):
        print(usage, file=sys.stderr)
        sys.exit(2)
    specs = [tuple(a.split("=", 1)) for a in args[1:]]
    for name, path in specs:
        if not name or not os.path.isdir(os.path.join(path, "gadgetloader")):
            print(f"{usage}\n{probe}: {name}={path}: no gadgetloader package in {path}", file=sys.stderr)
            sys.exit(2)
    return args[0], specs  # type: ignore[return-value]
