"""Probe (H200, session 19): where the drop-in training step's host time goes, against the
`resident` bound (the same model, loss and Adam with nothing paged). cProfile over 100 steps
of each (after 20 warm-up steps), plus plain timings without the profiler; tottime summed per
source (gadgetloader, torch's Python, C builtins) and the top functions by own time.
Run: PYTHONPATH=. python3 notebooks/probes/dropin_host.py OUT.json"""
import argparse, cProfile, collections, json, pstats, sys, time
import torch
if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU (CUDA, CuPy, pinned memory): run it on a CUDA machine")
from gadgetloader.bench import _train as T

p = argparse.ArgumentParser(); T.add_arguments(p); args = p.parse_args([])
dev = torch.device("cuda")
batches = T._batches(args, dev, 64)
out = {}


def timed(m, n, start):
    torch.cuda.synchronize(); t = time.perf_counter()
    for i in range(n):
        m.step(batches[(start + i) % 64])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / n


for name in ("dropin", "resident", "dropin", "resident"):
    m = T._BUILDERS[name](args, dev)
    m.prepare(batches)
    for i in range(20):
        m.step(batches[i % 64])
    plain = [timed(m, 60, 20), timed(m, 60, 80)]
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t = time.perf_counter()
    prof.enable()
    for i in range(100):
        m.step(batches[i % 64])
    prof.disable()
    host = (time.perf_counter() - t) * 1e3 / 100
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    by_src = collections.Counter()
    rows = []
    for (fn, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        src = ("gadgetloader" if "gadgetloader" in fn else "torch" if "torch" in fn
               else "builtin" if fn == "~" else "other")
        by_src[src] += tt * 1e3 / 100
        rows.append((tt * 1e3 / 100, ct * 1e3 / 100, nc / 100, f"{fn.split('site-packages/')[-1]}:{line}:{func}"))
    rows.sort(reverse=True)
    cum = sorted(rows, key=lambda r: -r[1])
    entry = {"plain_ms": plain, "profiled_host_ms": host, "tottime_ms_by_source": dict(by_src),
             "top_tottime": rows[:45], "top_cumtime_gadgetloader": [r for r in cum if "gadgetloader" in r[3]][:40]}
    out.setdefault(name, []).append(entry)
    print(name, "plain", [round(x, 3) for x in plain], "profiled", round(host, 3),
          {k: round(v, 3) for k, v in by_src.items()}, flush=True)
    for r in rows[:25]:
        print(f"   {r[0]:.4f} ms own {r[1]:.4f} cum {r[2]:.1f}/step {r[3]}")
    if hasattr(m, "close"):
        m.close()
    del m
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
