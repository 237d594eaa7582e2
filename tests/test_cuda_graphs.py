"""Captured CUDA graphs of training lookups (``gadgetloader.switching._graphs``).

The GPU tests train the same model twice, with graphs and without, and ask for
bit-identical tables and optimizer states, in loops that hold a step's outputs in
ways that a replay must not overwrite (two lookups of one table in a step, losses
kept alive, eval lookups between steps, a bad id, a partial batch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUPY

import gadgetloader as gl
from gadgetloader.switching import _graphs

N, D = 300, 8


def test_switch_reads_the_environment() -> None:
    code = "import gadgetloader.switching._graphs as g; print(g.ENABLED)"
    env = dict(os.environ)
    for value, want in (("0", "False"), ("off", "False"), ("1", "True"), ("", "True")):
        env["GADGETLOADER_CUDA_GRAPHS"] = value
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == want, value


def test_cpu_lookups_never_capture() -> None:
    emb = gl.OffloadedEmbedding(N, D, "cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        emb(torch.tensor([1, 2, 2, 7])).sum().backward()
        opt.step()
    assert emb._graphs is None


# ---- GPU: with graphs against without ----------------------------------------------------
def _init(seed: int) -> Any:
    def init(t: torch.Tensor) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        t.copy_(torch.randn(tuple(t.shape), generator=g).to(t.device, t.dtype))

    return init


def _batches(steps: int, b: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for k in range(steps):
        n = b - 3 if k == 4 else b  # one partial batch among full ones
        ids = torch.randint(0, N // 3, (n, 2), generator=g)  # many repeats
        out.append(ids.to("cuda"))
    return out


def _train(
    enabled: bool,
    monkeypatch: pytest.MonkeyPatch,
    *,
    placement: str = "pinned",
    optim: Any = torch.optim.Adam,
    kw: dict[str, Any] | None = None,
    twice: bool = False,
    keep: bool = False,
    evals: bool = False,
    steps: int = 9,
) -> tuple[np.ndarray, list[np.ndarray], Any]:
    monkeypatch.setattr(_graphs, "ENABLED", enabled)
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(N, D, placement, device="cuda", init=_init(1))
    head = torch.nn.Linear(D, 1).cuda()
    opt = gl.OffloadedOptimizer(optim, [emb, head], **(kw or {"lr": 0.05}))
    kept = []
    for ids in _batches(steps, 64):
        opt.zero_grad()
        out = head(emb(ids)).pow(2).mean()
        if twice:  # a second lookup of the same table in the step
            out = out + head(emb(ids[:, :1] + 1)).pow(2).mean()
        out.backward()
        if keep:
            kept.append(out)  # the loss (and its graph's saved tensors) stays alive
        opt.step()
        if evals:
            with torch.no_grad():
                kept_eval = emb(ids).sum()
            kept.append(kept_eval)
    states = [t.getNumpyVersion() for p in opt.pagers for t in p.tables.values()]
    g = emb._graphs  # (read now: the optimizer's end releases the table and its graphs)
    stats = None if g is None else (g.captures, g.replays, g.counts(), g.failed)
    return emb.weight.getNumpyVersion(), states, stats


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize(
    "optim,kw",
    [
        (torch.optim.Adam, {"lr": 0.05}),
        (torch.optim.SGD, {"lr": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}),
    ],
    ids=["adam", "sgd", "momentum", "adagrad", "rmsprop"],
)
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_training_with_graphs_equals_eager(monkeypatch, placement, optim, kw) -> None:
    t0, s0, _ = _train(False, monkeypatch, placement=placement, optim=optim, kw=kw)
    t1, s1, stats = _train(True, monkeypatch, placement=placement, optim=optim, kw=kw)
    np.testing.assert_array_equal(t1, t0)
    assert len(s1) == len(s0)
    for a, b in zip(s1, s0, strict=True):
        np.testing.assert_array_equal(a, b)
    if placement == "pinned":  # (a cuda table may have no fused transfer: then no graphs)
        assert stats is not None
    if stats is not None:
        captures, replays, _, failed = stats
        assert failed is None, failed
        assert captures >= 1 and replays >= 5


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize(
    "how", [{"twice": True}, {"keep": True}, {"evals": True}, {"twice": True, "keep": True}]
)
def test_outputs_still_in_use_are_not_replayed_over(monkeypatch, how) -> None:
    t0, s0, _ = _train(False, monkeypatch, **how)
    t1, s1, stats = _train(True, monkeypatch, **how)
    np.testing.assert_array_equal(t1, t0)
    for a, b in zip(s1, s0, strict=True):
        np.testing.assert_array_equal(a, b)
    assert stats is not None and stats[3] is None and stats[1] >= 1
    # never more copies per id count than allowed
    assert all(c <= _graphs.PER_COUNT for c in stats[2].values())


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_bad_id_in_a_replayed_lookup_is_refused_and_nothing_changes(monkeypatch) -> None:
    monkeypatch.setattr(_graphs, "ENABLED", True)
    emb = gl.OffloadedEmbedding(N, D, "pinned", device="cuda", init=_init(2))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    batches = _batches(4, 32)
    for ids in batches[:3]:  # the count is captured by now
        opt.zero_grad()
        emb(ids).sum().backward()
        opt.step()
    assert emb._graphs is not None and emb._graphs.replays >= 1
    table = emb.weight.getNumpyVersion()
    states = [t.getNumpyVersion() for t in opt.pagers[0].tables.values()]
    bad = batches[0].clone()
    bad[5, 1] = N  # one past the end
    opt.zero_grad()
    emb(bad).sum().backward()
    with pytest.raises(gl.GadgetIndexError, match=str(N)):
        opt.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), table)
    for t, want in zip(opt.pagers[0].tables.values(), states, strict=True):
        np.testing.assert_array_equal(t.getNumpyVersion(), want)
    # training goes on from the unchanged table, as a run without graphs does
    opt.zero_grad()
    emb(batches[3]).sum().backward()
    opt.step()
    monkeypatch.setattr(_graphs, "ENABLED", False)
    ref = gl.OffloadedEmbedding(N, D, "pinned", device="cuda", init=_init(2))
    ropt = gl.OffloadedOptimizer(torch.optim.Adam, ref, lr=0.05)
    for ids in [*batches[:3], batches[3]]:
        ropt.zero_grad()
        ref(ids).sum().backward()
        ropt.step()
    np.testing.assert_array_equal(emb.weight.getNumpyVersion(), ref.weight.getNumpyVersion())


@pytest.mark.gpu
@NEEDS_CUPY
def test_capture_and_replays_never_synchronise(monkeypatch) -> None:
    monkeypatch.setattr(_graphs, "ENABLED", True)
    emb = gl.OffloadedEmbedding(N, D, "pinned", device="cuda", init=_init(3))
    head = torch.nn.Linear(D, 1).cuda()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, [emb, head], lr=0.05)
    batches = _batches(6, 128)

    def step(ids: torch.Tensor) -> None:
        opt.zero_grad()
        head(emb(ids)).pow(2).mean().backward()
        opt.step()

    step(batches[0])  # eager: states created, kernels loaded
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in batches[1:4]:  # the capture, then replays
            step(ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert emb._graphs is not None and emb._graphs.captures >= 1
    assert emb._graphs.replays >= 3


@pytest.mark.gpu
@NEEDS_CUPY
def test_a_new_optimizer_or_a_closed_table_drops_the_graphs(monkeypatch) -> None:
    monkeypatch.setattr(_graphs, "ENABLED", True)
    emb = gl.OffloadedEmbedding(N, D, "pinned", device="cuda", init=_init(4))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    ids = _batches(1, 16)[0]
    for _ in range(3):
        opt.zero_grad()
        emb(ids).sum().backward()
        opt.step()
    first = emb._graphs
    assert first is not None and first.replays >= 1
    del opt
    import gc

    gc.collect()
    opt2 = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=0.1)
    before = emb.weight.getNumpyVersion()
    opt2.zero_grad()
    emb(ids).sum().backward()
    opt2.step()
    assert emb._graphs is not first  # a new transfer (other state tables): new graphs
    want = before.copy()
    uniq, counts = np.unique(ids.cpu().numpy(), return_counts=True)
    want[uniq] -= 0.1 * counts[:, None].astype(np.float32)
    np.testing.assert_allclose(emb.weight.getNumpyVersion(), want, rtol=1e-6, atol=1e-6)
    emb.weight.close()
    with pytest.raises(gl.GadgetError):
        emb(ids)


@pytest.mark.gpu
@NEEDS_CUPY
def test_byte_budget_and_count_limit_bound_what_is_kept(monkeypatch) -> None:
    monkeypatch.setattr(_graphs, "ENABLED", True)
    emb = gl.OffloadedEmbedding(N, D, "pinned", device="cuda", init=_init(5))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    g = torch.Generator(device="cpu").manual_seed(5)
    counts = [10, 11, 12, 13, 14, 15]
    for _ in range(3):
        for n in counts:  # more counts than a table keeps
            opt.zero_grad()
            emb(torch.randint(0, N, (n,), generator=g).cuda()).sum().backward()
            opt.step()
    graphs = emb._graphs
    assert graphs is not None and graphs.failed is None and graphs.captures >= 1
    assert len(graphs.counts()) <= _graphs.COUNTS
    assert graphs.nbytes <= _graphs.MAX_BYTES
    # with no room for outputs nothing is captured, and training matches the eager run
    monkeypatch.setattr(_graphs, "MAX_BYTES", 0)
    t0, s0, stats = _train(True, monkeypatch)
    assert stats is not None and stats[0] == 0 and stats[1] == 0
    t1, s1, _ = _train(False, monkeypatch)
    np.testing.assert_array_equal(t0, t1)
    for a, b in zip(s0, s1, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@NEEDS_CUPY
def test_capture_is_not_broken_by_a_collected_pinned_table(monkeypatch) -> None:
    """A pinned table freed by the garbage collector synchronises the device; a collection
    during a capture would break it (and the table's release)."""
    import gc

    monkeypatch.setattr(_graphs, "ENABLED", True)
    emb = gl.OffloadedEmbedding(N, D, "pinned", device="cuda", init=_init(6))
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.05)
    batches = _batches(5, 32)
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # collect at almost every allocation
    try:
        for ids in batches:
            cycle: dict[str, Any] = {}
            cycle["self"] = cycle  # garbage only the collector frees, with a pinned table
            cycle["table"] = gl.DataGadget((64, 8), dtype="float32", placement="pinned")
            del cycle
            opt.zero_grad()
            emb(ids).sum().backward()
            opt.step()
    finally:
        gc.set_threshold(*old)
    gc.collect()
    graphs = emb._graphs
    assert graphs is not None and graphs.failed is None and graphs.captures >= 1
