"""Session 12 fixes: a closed table stays closed, file handles on refused opens, torch's dtype names."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader._dtypes import as_torch_dtype


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def npy(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, np.arange(12, dtype=np.float32).reshape(4, 3))
    return p


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_load_after_close_is_refused_and_the_table_stays_closed(npy, tmp_path, placement):
    other = tmp_path / "o.npy"
    np.save(other, np.full((4, 3), 7, dtype=np.float32))
    g = gl.DataGadget(str(npy), placement=placement, device="cpu")
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        g.load(str(other))
    with pytest.raises(gl.GadgetClosedError):  # not revived by the refused load
        g.getData([0])
    assert "closed" in repr(g)
    assert g.shape == (4, 3) and len(g) == 4


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_flush_after_close_is_refused(npy, placement):
    g = gl.DataGadget(str(npy), placement=placement, device="cpu")
    g.flush()  # open: fine
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        g.flush()


def test_open_table_repr_does_not_say_closed(npy):
    g = gl.DataGadget(str(npy), placement="cpu", device="cpu")
    assert "closed" not in repr(g)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_refused_opens_leave_no_file_handle(npy, tmp_path, placement):
    import h5py

    h5 = tmp_path / "t.h5"
    with h5py.File(h5, "w") as f:
        f["x"] = np.ones((4, 3), dtype=np.float32)
        f["empty"] = np.ones((0, 3), dtype=np.float32)
    before = open_fds()
    for _ in range(5):
        with pytest.raises(gl.GadgetTypeError, match="float64"):
            gl.DataGadget(str(npy), placement=placement, dtype="float64", device="cpu")
        with pytest.raises(gl.GadgetTypeError, match="float64"):
            gl.DataGadget(str(h5), dataset="x", placement=placement, dtype="float64", device="cpu")
        with pytest.raises(gl.GadgetValueError, match="zero rows"):
            gl.DataGadget(str(h5), dataset="empty", placement=placement, device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="unexpected option"):
        gl.DataGadget(str(h5), dataset="x", placement="file", no_such_option=1, device="cpu")
    assert open_fds() == before


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float", torch.float32),
        ("double", torch.float64),
        ("half", torch.float16),
        ("int", torch.int32),
        ("long", torch.int64),
        ("short", torch.int16),
        ("byte", torch.uint8),
        ("char", torch.int8),
        ("torch.float16", torch.float16),
        (float, torch.float64),
        (int, torch.int64),
        (bool, torch.bool),
        ("f4", torch.float32),
        (np.int16, torch.int16),
    ],
)
def test_dtype_names_mean_what_torch_means(name, expected):
    assert as_torch_dtype(name) == expected
    if isinstance(name, str) and hasattr(torch, name.removeprefix("torch.")):
        assert getattr(torch, name.removeprefix("torch.")) == expected  # torch agrees
    g = gl.DataGadget((3, 2), dtype=name, placement="cpu", device="cpu")
    assert g.dtype == expected


@pytest.mark.parametrize(
    ("device_type", "pin", "expected"),
    [
        ("cpu", False, "cpu"),
        ("cpu:0", False, "cpu"),
        (torch.device("cpu"), False, "cpu"),
        (torch.device("cpu"), True, "pinned"),
        ("cuda", False, "cuda"),
        ("cuda:0", False, "cuda"),
        (torch.device("cuda", 0), False, "cuda"),
    ],
)
def test_speedtorch_device_type_takes_torch_device_forms(device_type, pin, expected):
    from gadgetloader.switching._factories import _torch_placement

    assert _torch_placement(device_type, pin, None) == expected


@pytest.mark.parametrize("device_type", ["CPU", "gpu", 0, None, "meta"])
def test_speedtorch_device_type_refuses_other_values(device_type):
    with pytest.raises(gl.GadgetValueError, match="deviceType"):
        gl.PytorchModelFactory(torch.nn.Embedding(4, 3), 10, 3, "float32", device_type)


def test_optimizer_switcher_called_first_plans_afresh_each_step(monkeypatch):
    """An optimizer switcher whose beforeForwardPass runs before the model switcher's starts
    the step's plan afresh: an id buffer refilled where torch cannot see it (CuPy writes to a
    CUDA tensor leave its version counter alone; emulated here by fingerprinting tensors by
    identity only) must not reuse last step's plan. Checked against the usual order."""
    from gadgetloader.switching import _rows

    def blind(x):  # what a CUDA tensor refilled through CuPy looks like to the cache
        return () if x is None else (id(x), tuple(x.shape))

    def train(optimizer_first: bool) -> tuple[np.ndarray, np.ndarray]:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 3)
        model = torch.nn.ModuleDict({"e": emb})
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        sw = gl.PytorchModelFactory(emb, 40, 3, "float32", "cpu")
        sw.uniformDistributionInit(-0.5, 0.5)
        osw = gl.PytorchOptimizerFactory(opt, 40, 3, model, "e", "float32", "cpu")
        osw.optInit()
        buf = torch.zeros(6, dtype=torch.int64)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            buf.numpy()[:] = torch.randint(0, 40, (6,), generator=g).numpy()  # no version bump
            if optimizer_first:
                osw.beforeForwardPass(buf)
                local = sw.beforeForwardPass(buf)
            else:
                local = sw.beforeForwardPass(buf)
                osw.beforeForwardPass(buf)
            opt.zero_grad()
            (emb(local) ** 2).sum().backward()
            opt.step()
            osw.afterOptimizerStep(buf)
            sw.afterOptimizerStep(buf)
        return sw.getNumpyVersion(), osw.getNumpyVersion()["exp_avg"]

    monkeypatch.setattr(_rows, "_fingerprint", blind)
    usual = train(False)
    first = train(True)
    np.testing.assert_array_equal(first[0], usual[0])
    np.testing.assert_array_equal(first[1], usual[1])
