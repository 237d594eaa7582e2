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


@pytest.mark.parametrize(
    ("device_type", "error"),
    [
        ("CPU", gl.GadgetValueError),
        ("gpu", gl.GadgetValueError),
        ("meta", gl.GadgetValueError),
        (0, gl.GadgetTypeError),  # not a device string or torch.device: the wrong kind
        (None, gl.GadgetTypeError),
    ],
)
def test_speedtorch_device_type_refuses_other_values(device_type, error):
    with pytest.raises(error, match="deviceType"):
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


def _unsigned_file(tmp_path, fmt: str, a: np.ndarray) -> str:
    if fmt == "npy":
        p = str(tmp_path / "u.npy")
        np.save(p, a)
    elif fmt == "hdf5":
        import h5py

        p = str(tmp_path / "u.h5")
        with h5py.File(p, "w") as f:
            f.create_dataset("x", data=a, chunks=(3, a.shape[1]))
    else:
        zarr = pytest.importorskip("zarr")
        p = str(tmp_path / "u.zarr")
        z = zarr.open_array(p, mode="w", shape=a.shape, dtype=a.dtype, chunks=(3, a.shape[1]))
        z[:] = a
    return p


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
@pytest.mark.parametrize(
    ("file_dtype", "target"),
    [("uint16", "int32"), ("uint32", "int64"), ("uint64", "int64"), ("uint32", "float64")],
)
def test_wide_unsigned_files_convert_with_dtype(tmp_path, placement, fmt, file_dtype, target):
    """A uint16/32/64 file converts into a memory table with dtype=, values exact (numpy
    reference), on every placement; the rows come back through getData too."""
    hi = np.iinfo(file_dtype).max if file_dtype != "uint64" else np.iinfo(np.int64).max
    a = np.array([[0, 1, 2], [hi, hi - 1, 7], *[[i, i * 3, i * 7] for i in range(3, 10)]])
    a = a.astype(file_dtype)  # (uint32 values are exact in float64)
    p = _unsigned_file(tmp_path, fmt, a)
    g = gl.DataGadget(p, dtype=target, placement=placement, dataset="x" if fmt == "hdf5" else None)
    assert g.dtype == getattr(torch, target) and g.shape == a.shape
    ref = a.astype(target)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)
    np.testing.assert_array_equal(g.getData([1, 8, 1]).cpu().numpy(), ref[[1, 8, 1]])


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_wide_unsigned_file_values_that_do_not_fit_are_refused(tmp_path, fmt):
    a = np.array([[1, 2], [3, 2**31]], dtype=np.uint32)
    p = _unsigned_file(tmp_path, fmt, np.repeat(a, 4, axis=0))
    kw = {"dataset": "x"} if fmt == "hdf5" else {}
    before = open_fds()
    with pytest.raises(gl.GadgetValueError, match="2147483648.*int32"):
        gl.DataGadget(p, dtype="int32", placement="cpu", **kw)
    with pytest.raises(gl.GadgetTypeError, match="int64"):  # no dtype=: refused with advice
        gl.DataGadget(p, placement="cpu", **kw)
    with pytest.raises(gl.GadgetTypeError, match="placement='file'"):  # read as it is: refused
        gl.DataGadget(p, dtype="int64", placement="file", **kw)
    with pytest.raises(gl.GadgetTypeError, match="numeric"):
        gl.DataGadget(p, dtype="bool", placement="cpu", **kw)
    assert open_fds() == before


@pytest.mark.parametrize("value", ["False", "no", 2, None, 0.0])
def test_flags_refuse_values_that_only_look_like_bools(tmp_path, value):
    """bool('False') is True: CPUPinn, pinType and progress take True/False (or 1/0) only."""
    with pytest.raises(gl.GadgetTypeError, match="CPUPinn must be True or False"):
        gl.DataGadget((3, 2), CPUPinn=value)
    with pytest.raises(gl.GadgetTypeError, match="CPUPinn must be True or False"):
        gl.ModelFactory(torch.nn.Embedding(4, 2), 10, 2, CPUPinn=value)
    with pytest.raises(gl.GadgetTypeError, match="pinType must be True or False"):
        gl.PytorchModelFactory(torch.nn.Embedding(4, 2), 10, 2, "float32", "cpu", value)
    if value is not None:  # None is progress's automatic default
        p = tmp_path / "t.npy"
        np.save(p, np.ones((3, 2), np.float32))
        with pytest.raises(gl.GadgetTypeError, match="progress must be True or False"):
            gl.DataGadget(str(p), placement="cpu", progress=value)


@pytest.mark.parametrize("value", [True, False, 1, 0, np.True_, np.False_])
def test_flags_take_bools_and_one_or_zero(value):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gl.FallbackWarning)
        g = gl.DataGadget((3, 2), CPUPinn=value, device="cpu")
    expected = ("pinned" if value else "cuda") if torch.cuda.is_available() else "cpu"
    assert g.placement == expected
