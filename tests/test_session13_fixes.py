"""Regression tests for the defects fixed in session 13."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader.switching._rows import _fingerprint


def test_plans_of_inference_tensors_off_the_cpu_are_never_cached():
    """A non-CPU inference tensor has no version counter: its fingerprint is None (never
    cache), where reading ``_version`` used to raise (an eval lookup under
    ``torch.inference_mode`` with CUDA ids). The meta device stands in for CUDA here."""
    with torch.inference_mode():
        ids = torch.empty(6, dtype=torch.int64, device="meta")
    assert ids.is_inference()
    assert _fingerprint(ids) is None
    normal = torch.empty(6, dtype=torch.int64, device="meta")
    fp = _fingerprint(normal)
    assert fp is not None and fp[0] == normal._version


# ---- switchers: nothing changes a table while a step's rows wait for afterOptimizerStep ----
def _switchers():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3)
    model = torch.nn.ModuleDict({"e": emb})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sw = gl.PytorchModelFactory(emb, 30, 3, "float32", "cpu")
    sw.uniformDistributionInit(-1, 1)
    osw = gl.PytorchOptimizerFactory(opt, 30, 3, model, "e", "float32", "cpu")
    osw.optInit()
    return emb, opt, sw, osw


def _half_step(emb, opt, sw, osw, ids):
    local = sw.beforeForwardPass(ids)
    osw.beforeForwardPass(ids)
    opt.zero_grad()
    (emb(local) ** 2).sum().backward()
    opt.step()


def _finish(sw, osw, ids):
    osw.afterOptimizerStep(ids)
    sw.afterOptimizerStep(ids)


def test_switcher_tables_refuse_changes_while_a_step_is_under_way(tmp_path):
    emb, opt, sw, osw = _switchers()
    ids = torch.tensor([1, 4, 4, 7])
    _half_step(emb, opt, sw, osw, ids)  # one full step first: state is not fresh
    _finish(sw, osw, ids)
    gl.save_checkpoint(tmp_path / "ck", {"sw": sw, "osw": osw, "opt": opt})
    np.save(tmp_path / "t.npy", np.full((30, 3), 5.0, np.float32))
    torch.save(torch.full((30, 3), 6.0), tmp_path / "t.pt")
    osw.saveTorch(tmp_path / "s.pt")
    _half_step(emb, opt, sw, osw, ids)
    table, states = sw.getNumpyVersion(), osw.getNumpyVersion()
    refused = [
        lambda: gl.load_checkpoint(tmp_path / "ck", {"sw": sw, "osw": osw, "opt": opt}),
        lambda: gl.load_checkpoint(tmp_path / "ck", {"osw": osw}),
        lambda: sw.loadCupy(tmp_path / "t.npy"),
        lambda: sw.load(tmp_path / "t.npy"),
        lambda: sw.loadTorch(tmp_path / "t.pt"),
        lambda: sw.zerosInit(),
        lambda: sw.customInit(torch.nn.init.ones_),
        lambda: sw.table.load(tmp_path / "t.npy"),
        lambda: osw.loadTorch(tmp_path / "s.pt"),
        lambda: osw.customInit(torch.nn.init.constant_, 0.5),
    ]
    for call in refused:
        with pytest.raises(gl.GadgetValueError, match="under way"):
            call()
        np.testing.assert_array_equal(sw.getNumpyVersion(), table)
        for k, v in osw.getNumpyVersion().items():
            np.testing.assert_array_equal(v, states[k])
    _finish(sw, osw, ids)  # the step completes as if nothing had been tried
    after = sw.getNumpyVersion()
    assert not np.array_equal(after, table)  # the step wrote its rows
    # once the step is over, every one of them is accepted
    sw.loadCupy(tmp_path / "t.npy")
    np.testing.assert_array_equal(sw.getNumpyVersion(), np.full((30, 3), 5.0, np.float32))
    gl.load_checkpoint(tmp_path / "ck", {"sw": sw, "osw": osw, "opt": opt})
    osw.customInit(torch.nn.init.constant_, 0.5)
    assert all(np.all(v == 0.5) for v in osw.getNumpyVersion().values())


def test_eval_lookups_and_a_new_step_leave_no_step_under_way(tmp_path):
    emb, opt, sw, osw = _switchers()
    np.save(tmp_path / "t.npy", np.full((30, 3), 2.0, np.float32))
    with torch.no_grad():
        sw.beforeForwardPass(torch.tensor([0, 2]))  # an evaluation lookup starts no step
    sw.loadCupy(tmp_path / "t.npy")
    # a training step abandoned before its afterOptimizerStep is replaced by the next
    # beforeForwardPass; a no_grad lookup then leaves nothing to write back either
    sw.beforeForwardPass(torch.tensor([1, 3]))
    with pytest.raises(gl.GadgetValueError):
        sw.zerosInit()
    with torch.no_grad():
        sw.beforeForwardPass(torch.tensor([0, 2]))
    sw.zerosInit()
    assert not sw.getNumpyVersion().any()


# ---- sampler: a pass still being read no longer moves the state once it was taken back ----
def test_an_older_pass_read_to_its_end_leaves_a_newer_pass_state_alone():
    s = gl.GadgetSampler(30, batch_size=4, seed=7)  # 8 batches an epoch
    old = iter(s)
    next(old)
    new = iter(s)
    first_new = [next(new).tolist() for _ in range(2)]
    rest_old = [b.tolist() for b in old]  # the older pass is read to its end...
    assert len(rest_old) == 7
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (0, 2)  # ...and the newer pass owns the state
    ref = gl.GadgetSampler(30, batch_size=4, seed=7)
    want = [b.tolist() for b in ref]
    assert first_new == want[:2]
    assert [b.tolist() for b in new] == want[2:]
    assert s.state_dict()["epoch"] == 1


# ---- buffers kept across calls are made outside inference mode ---------------------------------
def test_first_use_under_inference_mode_leaves_reused_buffers_writable(placement, device):
    """The per-thread pinned buffers (CPU id uploads, id range checks) are made on first
    use; made under ``torch.inference_mode`` they were inference tensors, and every later
    call outside that mode failed to write them. A new thread starts without them."""
    import threading

    rng = np.random.default_rng(5)
    base = rng.standard_normal((300, 8)).astype(np.float32)
    g = gl.DataGadget(base.copy(), placement=placement)
    want = base.copy()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            ids = rng.integers(0, 300, 5000)
            for mode in (True, False, True, False):
                with torch.inference_mode(mode):
                    got = g.getData(torch.from_numpy(ids)).cpu().numpy()
                    np.testing.assert_array_equal(got, want[ids])
                    gpu_ids = torch.from_numpy(ids).to(device)
                    np.testing.assert_array_equal(g.getData(gpu_ids).cpu().numpy(), want[ids])
                    new = rng.standard_normal((4, 8)).astype(np.float32)
                    rows = np.array([3, 100, 7, 299])
                    g.insertData(torch.from_numpy(new), torch.from_numpy(rows))
                    want[rows] = new
                    with pytest.raises(gl.GadgetIndexError):
                        g.getData(torch.tensor([0, 300], device=device))
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    np.testing.assert_array_equal(g.getNumpyVersion(), want)
    g.close()


# ---- CPU ids of a hybrid gather stay on the CPU --------------------------------------------------
@pytest.mark.gpu
def test_hybrid_gathers_take_cpu_ids_where_they_are_and_check_them():
    """A gather the engine gives to ``hybrid`` (CPU threads + kernel) keeps CPU ids on the
    CPU (no upload and download); results equal NumPy's for every kind of CPU ids, CUDA
    ids still work, and a bad id is refused before anything is read."""
    from gadgetloader._device import cupy_available

    if not cupy_available():
        pytest.skip("needs CuPy (the pinned placement)")
    rng = np.random.default_rng(9)
    base = rng.standard_normal((70_000, 16)).astype(np.float32)
    g = gl.DataGadget(base, placement="pinned", strategy="hybrid")
    dev = torch.device("cuda")
    assert g._store.hybrid_for(dev, 70_000, "hybrid")
    assert not g._store.hybrid_for(torch.device("cpu"), 70_000, "hybrid")
    ids = rng.integers(0, 70_000, 66_000)
    for form in (torch.from_numpy(ids), ids, ids.tolist(), torch.from_numpy(ids).to(dev)):
        got = g.getData(form)
        assert got.device.type == "cuda"
        np.testing.assert_array_equal(got.cpu().numpy(), base[ids])
    out = torch.empty((ids.size, 16), device=dev)
    got = g.getData(ids, out=out)
    assert got.data_ptr() == out.data_ptr()  # filled in place (the result is a view of out)
    np.testing.assert_array_equal(out.cpu().numpy(), base[ids])
    bad = ids.copy()
    bad[123] = 70_000
    with pytest.raises(gl.GadgetIndexError):
        g.getData(bad)
    auto = gl.DataGadget(base, placement="pinned")  # a small table: auto never goes hybrid
    assert not auto._store.hybrid_for(dev, 70_000, "auto")
    np.testing.assert_array_equal(auto.getData(ids).cpu().numpy(), base[ids])
    g.close()
    auto.close()


def test_after_optimizer_step_never_writes_rows_read_before_a_change(tmp_path):
    """An evaluation lookup mid-step ends the guard (it starts no step), so a load is then
    accepted; the afterOptimizerStep that follows refuses to write the rows read before the
    load over it, and the next step trains on the loaded rows."""
    emb, opt, sw, osw = _switchers()
    five = np.full((30, 3), 5.0, np.float32)
    np.save(tmp_path / "five.npy", five)
    ids = torch.tensor([1, 4, 4, 7])
    _half_step(emb, opt, sw, osw, ids)
    with torch.no_grad():
        sw.beforeForwardPass(ids)
    sw.loadCupy(tmp_path / "five.npy")
    with pytest.raises(gl.GadgetValueError, match="changed"):
        sw.afterOptimizerStep(ids)
    np.testing.assert_array_equal(sw.getNumpyVersion(), five)
    # by hand under no_grad, with no change in between: written back as before
    with torch.no_grad():
        local = sw.beforeForwardPass(torch.tensor([2, 3]))
        emb.weight[local] += 1.0
    sw.afterOptimizerStep(torch.tensor([2, 3]))
    want = five.copy()
    want[[2, 3]] += 1.0
    np.testing.assert_array_equal(sw.getNumpyVersion(), want)
