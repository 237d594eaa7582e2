"""Session 22 probe: ``getData`` of one library version against another, same machine.

Runs the seed request (1M x 128 float32 pinned table, 131,072 random ids) through
``DataGadget.getData`` with CPU ids (torch and NumPy), CUDA ids, and CUDA ids with
``check_ids=False``, timed as ``gadgetloader bench`` times (CUDA events around each call,
medians of 41, the cases' order rotating between repeats), in one subprocess per
version, alternating versions ``ROUNDS`` times so a drifting host affects both alike;
torch's zero-copy ``index_select`` is the reference.
Usage: python notebooks/probes/getdata_ab.py OUT.json NAME=DIR [NAME=DIR ...]
(each DIR holds a ``gadgetloader`` package).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROUNDS = 5

CHILD = r"""
import json, statistics, sys
import torch
from gadgetloader import DataGadget
dev = torch.device("cuda", 0)
gen = torch.Generator().manual_seed(0)
host = torch.randn(1_000_000, 128, generator=gen)
g = DataGadget(host, placement="pinned")
view = g.as_tensor()
ids_cpu = torch.randint(0, 1_000_000, (131_072,), generator=gen)
ids_np = ids_cpu.numpy()
ids = ids_cpu.to(dev)
out = torch.empty(131_072, 128, device=dev)
ref = host[ids_cpu].to(dev)
cases = {
    "CPU ids (torch)": lambda: g.getData(ids_cpu, out=out),
    "CPU ids (NumPy)": lambda: g.getData(ids_np, out=out),
    "CUDA ids": lambda: g.getData(ids, out=out),
    "CUDA ids, check_ids=False": lambda: g.getData(ids, out=out, check_ids=False),
    "torch index_select": lambda: torch.index_select(view, 0, ids, out=out),
}
times = {k: [] for k in cases}
for fn in cases.values():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
names = list(cases)
for i in range(41):  # the order rotates, so no case always follows the same one
    for k in names[i % len(names):] + names[:i % len(names)]:
        fn = cases[k]
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times[k].append(a.elapsed_time(b))
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
"""


def main() -> None:
    from _ab_args import ab_args

    out_path, specs = ab_args("getdata_ab.py")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in specs}
    for _ in range(ROUNDS):
        for name, path in specs:
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(
                    [os.path.abspath(path), os.environ.get("PYTHONPATH", "")]
                ),
            )
            res = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CHILD
                    + f"\nimport gadgetloader; assert gadgetloader.__file__.startswith({os.path.abspath(path)!r})",
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd="/tmp",  # (not the repository: its package would shadow DIR's)
            )
            rounds[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    summary = {
        name: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
        for name, rs in rounds.items()
    }
    with open(out_path, "w") as f:
        json.dump(
            {"probe": "getdata_ab", "rounds": rounds, "median_of_rounds": summary}, f, indent=1
        )
    for name, row in summary.items():
        print(name, "  ".join(f"{k}: {v:.3f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
