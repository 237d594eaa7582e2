"""Probe (H200, session 15): is the drop-in training step bound by the GPU or the host, and
what would running its fused scatter on a side stream (overlapping the next step's gather)
give? Modes: base (as shipped), side (scatter on a side stream, NO hazard handling: timing
only), none (no scatter: timing only). Run: PYTHONPATH=. python3 notebooks/probes/overlap_scatter.py base,side,none
Results: notebooks/results/h200-run-session15.log."""
import argparse, time, json, sys, os
import torch
if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine")
from gadgetloader.bench import _train as T
from gadgetloader import _ids
from gadgetloader.stores import _base
out = {}
p = argparse.ArgumentParser(); T.add_arguments(p); args = p.parse_args([])
dev = torch.device("cuda")
batches = T._batches(args, dev, 64)
wait = [0.0]
orig_rc = _ids.range_check_of
def rc(ends, n, done):
    f = orig_rc(ends, n, done)
    def g():
        t = time.perf_counter(); f(); wait[0] += time.perf_counter() - t
    return g
import gadgetloader.switching._embedding as E
E.range_check_of = rc

def timeit(m, n=60, start=10):
    for i in range(start): m.step(batches[i % 64])
    torch.cuda.synchronize(); wait[0] = 0.0; t = time.perf_counter()
    for i in range(n): m.step(batches[(start + i) % 64])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / n, wait[0] * 1e3 / n

def gpu_busy(m, n=10):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n): m.step(batches[i % 64])
        torch.cuda.synchronize()
    ka = prof.key_averages()
    rows = sorted(((e.key, e.self_device_time_total / n / 1e3, e.count // n) for e in ka if getattr(e, "self_device_time_total", 0) > 0), key=lambda r: -r[1])
    return rows[:25]

orig_scatter = _base.FusedRows.scatter
side = {}
def side_scatter(self, ids, rows, count):
    cur = torch.cuda.current_stream()
    s = side.setdefault("s", torch.cuda.Stream())
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        orig_scatter(self, ids, rows, count)
    for t in (ids, count, *rows): t.record_stream(s)
def no_scatter(self, ids, rows, count):
    return None

modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["base", "side", "none", "base"]
for mode in modes:
    _base.FusedRows.scatter = {"base": orig_scatter, "side": side_scatter, "none": no_scatter}[mode]
    m = T._DropIn(args, dev)
    ms, w = timeit(m)
    ms2, w2 = timeit(m)
    r = {"ms": [ms, ms2], "wait_ms": [w, w2]}
    if mode in ("base",) and "busy" not in out:
        rows = gpu_busy(m)
        r["kernels"] = rows
        r["gpu_sum_ms"] = sum(x[1] for x in rows)
    out.setdefault(mode, []).append(r)
    print(mode, json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
    if "kernels" in r:
        for k in r["kernels"]: print("   %-70s %.4f ms x%d" % (k[0][:70], k[1], k[2]))
    m.close(); del m; torch.cuda.empty_cache()
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/ovl.json", "w"), indent=1)
