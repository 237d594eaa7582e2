"""Session 25 probe: the seed gather and scatter of one library version against another.

Runs the seed requests (1M x 128 float32 pinned table, 131,072 ids) through
``DataGadget.getData`` (CPU ids, CUDA ids, CUDA ids with ``check_ids=False``) and
``DataGadget.insertData`` (131,072 distinct CUDA ids, checked and unchecked), timed with
CUDA events around each call on an idle GPU (medians of 41, the cases' order rotating
between repeats; also the host time of the call), as ``gadgetloader bench`` times them (3
warm-up calls, then 20 calls of one case in a row), and back to back (50 calls, one
synchronisation: ms a call), in one subprocess per version, alternating versions
``ROUNDS`` times so a drifting host affects both alike. References in the same process:
torch's zero-copy ``index_select`` and CuPy's own fancy assignment into the pinned table
(what SpeedTorch's ``insertData`` runs).
Usage: python notebooks/probes/seed_ab.py OUT.json NAME=DIR [NAME=DIR ...]
(each DIR holds a ``gadgetloader`` package).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROUNDS = 5

CHILD = r"""
import json, statistics, time
import cupy as cp
import torch
from gadgetloader import DataGadget
dev = torch.device("cuda", 0)
gen = torch.Generator().manual_seed(0)
host = torch.randn(1_000_000, 128, generator=gen)
g = DataGadget(host, placement="pinned")
view = g.as_tensor()
cview = cp.from_dlpack(view)
ids_cpu = torch.randint(0, 1_000_000, (131_072,), generator=gen)
ids = ids_cpu.to(dev)
uids = torch.randperm(1_000_000, generator=gen)[:131_072].to(dev)
cuids = cp.from_dlpack(uids)
rows = torch.randn(131_072, 128, generator=gen).to(dev)
crows = cp.from_dlpack(rows)
out = torch.empty(131_072, 128, device=dev)
ref = host[ids_cpu].to(dev)
def cupy_scatter():
    cview[cuids] = crows
cases = {
    "gather CPU ids": lambda: g.getData(ids_cpu, out=out),
    "gather CUDA ids": lambda: g.getData(ids, out=out),
    "gather CUDA ids, check_ids=False": lambda: g.getData(ids, out=out, check_ids=False),
    "gather: torch index_select": lambda: torch.index_select(view, 0, ids, out=out),
    "scatter CUDA ids": lambda: g.insertData(rows, uids),
    "scatter CUDA ids, check_ids=False": lambda: g.insertData(rows, uids, check_ids=False),
    "scatter: CuPy fancy assignment": cupy_scatter,
}
for k, fn in cases.items():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if k.startswith("gather"):
        assert torch.equal(out, ref), k
expect = host.clone()
expect[uids.cpu()] = rows.cpu()
assert torch.equal(view.cpu(), expect)
times = {k: [] for k in cases}
hosts = {k: [] for k in cases}
names = list(cases)
def timed(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); b.record()
    b.synchronize()
    return a.elapsed_time(b), (t1 - t0) * 1e3
for i in range(41):  # the order rotates, so no case always follows the same one
    for k in names[i % len(names):] + names[:i % len(names)]:
        torch.cuda.synchronize()
        ms, host_ms = timed(cases[k])
        times[k].append(ms); hosts[k].append(host_ms)
res = {k: statistics.median(v) for k, v in times.items()}
res.update({k + " (host ms of the call)": statistics.median(v) for k, v in hosts.items()})
for k in names:  # as `gadgetloader bench` times: 3 warm-up calls, then 20 of this case in a row
    for _ in range(3):
        cases[k]()
    torch.cuda.synchronize()
    runs = [timed(cases[k]) for _ in range(20)]
    res[k + " (20 in a row)"] = statistics.median(r[0] for r in runs)
    res[k + " (20 in a row, host ms)"] = statistics.median(r[1] for r in runs)
for k in names:
    loops = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            cases[k]()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - t0) * 1e3 / 50)
    res[k + " (back to back)"] = statistics.median(loops)
print(json.dumps(res))
"""


def main() -> None:
    from _ab_args import ab_args

    out_path, specs = ab_args("seed_ab.py")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in specs}
    for _ in range(ROUNDS):
        for name, path in specs:
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(
                    [os.path.abspath(path), os.environ.get("PYTHONPATH", "")]
                ),
            )
            check = f"\nimport gadgetloader; assert gadgetloader.__file__.startswith({os.path.abspath(path)!r})"
            res = subprocess.run(
                [sys.executable, "-c", CHILD + check],
                env=env,
                capture_output=True,
                text=True,
                check=False,
                cwd="/tmp",  # (not the repository: its package would shadow DIR's)
            )
            if res.returncode:
                sys.exit(f"{name}: child failed\n{res.stderr[-3000:]}")
            rounds[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    summary = {
        name: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
        for name, rs in rounds.items()
    }
    with open(out_path, "w") as f:
        json.dump({"probe": "seed_ab", "rounds": rounds, "median_of_rounds": summary}, f, indent=1)
    for k in next(iter(summary.values())):
        print(f"{k:45s}", "  ".join(f"{name}: {row[k]:.3f}" for name, row in summary.items()))


if __name__ == "__main__":
    main()
