"""Session 28 probe: what the several-lookups sum order costs the drop-in's training step.

Each training lookup of an ``OffloadedEmbedding`` registers a post-accumulate-grad hook
(``switching/_embedding.py``, ``_arrived``) that notes the backward pass and arrival order
of its gradient. This times ``gadgetloader bench train``'s drop-in step (10M x 128 float32
x 2 tables, 4096 pairs + 5 negatives, Adam, tables and state pinned) with the hooks and
without them (``torch.Tensor.register_post_accumulate_grad_hook`` made a no-op: with one
lookup per table a step, as here, the hook's record is never read), A/B in one process:
the variants alternate, ROUNDS rounds, each the bench's median of 3 repeats of 20 steps.
Usage: python notebooks/probes/train_hook_ab.py OUT.json [ROUNDS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("this probe measures the GPU: run it on a CUDA machine")

from gadgetloader.bench import _train

p = argparse.ArgumentParser()
_train.add_arguments(p)
args = p.parse_args(["--repeats", "3"])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
dev = torch.device("cuda", 0)
batches = _train._batches(args, dev, 64)
m = _train._DropIn(args, dev)
for i in range(10):
    m.step(batches[i])
torch.cuda.synchronize()

real = torch.Tensor.register_post_accumulate_grad_hook
calls = {"n": 0}


def no_hook(self: torch.Tensor, hook: object) -> None:
    calls["n"] += 1


times: dict[str, list[float]] = {"hook": [], "no hook": []}
for r in range(rounds):
    for name in (("hook", "no hook") if r % 2 == 0 else ("no hook", "hook")):
        torch.Tensor.register_post_accumulate_grad_hook = (  # type: ignore[method-assign]
            real if name == "hook" else no_hook
        )
        times[name].append(_train._time_steps(m, batches, args, dev))
torch.Tensor.register_post_accumulate_grad_hook = real  # type: ignore[method-assign]
assert calls["n"] > 0, "the no-hook variant never replaced a registration"
out = {
    "ms_per_step": times,
    "median": {k: statistics.median(v) for k, v in times.items()},
    "skipped_registrations": calls["n"],
    "device": torch.cuda.get_device_name(dev),
    "torch": torch.__version__,
}
print(json.dumps(out["median"]), "rounds:", json.dumps(times))
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
m.close()
