"""Cases found by two independent reviews (documented API, bad input): each failed before
its fix. Bad input must raise a clear error and change nothing."""

from __future__ import annotations

import copy
import glob
import os

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl
from gadgetloader.switching import load_checkpoint, save_checkpoint


def _emb_and_opt(placement: str, device: torch.device, opt_cls=torch.optim.Adam):
    emb = gl.OffloadedEmbedding(20, 4, placement=placement, device=device)
    opt = gl.OffloadedOptimizer(opt_cls, emb, lr=0.1)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    opt.step()
    return emb, opt


# ---- state that does not fit changes nothing ---------------------------------------
def test_offloaded_optimizer_bad_state_dict_changes_nothing(placement, device):
    emb, opt = _emb_and_opt(placement, device)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(before)
    sd["inner"]["state"][0]["step"] = torch.tensor(99.0)
    sd["tables"][0]["exp_avg"] = torch.full((20, 4), 5.0)
    sd["tables"][0]["exp_avg_sq"] = torch.zeros(21, 4)  # wrong shape, found last
    with pytest.raises(gl.GadgetValueError, match="exp_avg_sq"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert float(after["inner"]["state"][0]["step"]) == float(before["inner"]["state"][0]["step"])
    for k, t in before["tables"][0].items():
        assert torch.equal(after["tables"][0][k], t), k


def test_offloaded_optimizer_state_dict_refuses_non_tensors(placement, device):
    _, opt = _emb_and_opt(placement, device)
    sd = copy.deepcopy(opt.state_dict())
    sd["tables"][0]["exp_avg"] = np.zeros((20, 4), np.float32)
    with pytest.raises(gl.GadgetTypeError, match="expected a tensor"):
        opt.load_state_dict(sd)


def test_load_checkpoint_checks_every_object_before_loading_any(tmp_path, placement, device):
    emb, opt = _emb_and_opt(placement, device)
    save_checkpoint(tmp_path / "ck", {"model": emb, "opt": opt})
    emb2 = gl.OffloadedEmbedding(20, 4, placement=placement, device=device)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adagrad, emb2, lr=0.1)  # another optimizer
    w = emb2.weight.as_tensor().clone()
    with pytest.raises(gl.GadgetValueError, match="exp_avg"):
        load_checkpoint(tmp_path / "ck", {"model": emb2, "opt": opt2})
    assert torch.equal(emb2.weight.as_tensor(), w)  # the model was not loaded either


def test_load_checkpoint_refuses_a_module_of_another_shape_first(tmp_path):
    model = nn.Linear(3, 2)
    emb = gl.OffloadedEmbedding(8, 3, placement="cpu", device="cpu")
    save_checkpoint(tmp_path / "ck", {"lin": model, "emb": emb})
    emb2 = gl.OffloadedEmbedding(8, 3, placement="cpu", device="cpu")
    w = emb2.weight.as_tensor().clone()
    with pytest.raises(gl.GadgetValueError, match="shape"):
        load_checkpoint(tmp_path / "ck", {"emb": emb2, "lin": nn.Linear(4, 2)})
    assert torch.equal(emb2.weight.as_tensor(), w)


# ---- saveTorch / loadTorch -------------------------------------------------------------
def _model_switch(placement: str = "cpu"):
    emb = nn.Embedding(3, 4)
    return gl.PytorchModelFactory(emb, 20, 4, deviceType="cpu") if placement == "cpu" else None


def test_save_torch_is_atomic(tmp_path, monkeypatch):
    sw = _model_switch()
    sw.uniformDistributionInit(-1, 1)
    path = tmp_path / "t.pt"
    sw.saveTorch(path)
    good = path.read_bytes()

    def dies(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(OSError, match="disk full"):
        sw.saveTorch(path)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["t.pt"]  # no partial file left beside it


def test_load_torch_refuses_other_dtypes_and_bad_files(tmp_path):
    sw = _model_switch()
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    torch.save(torch.full((20, 4), 0.1, dtype=torch.float64), tmp_path / "f64.pt")
    with pytest.raises(gl.GadgetTypeError, match="float64"):  # the dtype alone differs
        sw.loadTorch(tmp_path / "f64.pt")  # 0.1 has no exact float32 form
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(gl.GadgetFileError, match="junk.pt"):
        sw.loadTorch(tmp_path / "junk.pt")
    with pytest.raises(gl.GadgetFileNotFoundError):
        sw.loadTorch(tmp_path / "missing.pt")
    with pytest.raises(gl.GadgetFileError, match="not a file"):
        sw.loadTorch(tmp_path)
    with pytest.raises(gl.GadgetValueError, match="directory"):
        sw.saveTorch(tmp_path)
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def _optimizer_switch(opt_name: str = "Adam"):
    emb = nn.Embedding(3, 4)
    model = nn.Module()
    model.e = emb
    opt = getattr(torch.optim, opt_name)(model.parameters(), lr=0.1)
    sw = gl.PytorchModelFactory(emb, 20, 4, deviceType="cpu")
    sw.uniformDistributionInit(-1, 1)
    so = gl.PytorchOptimizerFactory(opt, 20, 4, model, "e", deviceType="cpu")
    so.optInit()
    return emb, opt, sw, so


def test_optimizer_factory_save_load_torch_and_custom_init(tmp_path):
    emb, opt, sw, so = _optimizer_switch()
    ids = torch.tensor([1, 5, 5])
    local = sw.beforeForwardPass(ids)
    so.beforeForwardPass(ids)
    emb(local).sum().backward()
    opt.step()
    sw.afterOptimizerStep(ids)
    so.afterOptimizerStep(ids)
    trained = so.getNumpyVersion()
    assert set(trained) == {"exp_avg", "exp_avg_sq"}
    assert np.abs(trained["exp_avg"][[1, 5]]).sum() > 0 and not trained["exp_avg"][0].any()
    so.saveTorch(tmp_path / "s.pt")
    so.customInit(torch.nn.init.constant_, 0.25)
    assert all((v == 0.25).all() for v in so.getNumpyVersion().values())
    so.loadTorch(tmp_path / "s.pt")
    for k, v in so.getNumpyVersion().items():
        np.testing.assert_array_equal(v, trained[k])
    # SpeedTorch's layout: a list of tensors in state order
    torch.save([torch.full((20, 4), 2.0), torch.full((20, 4), 3.0)], tmp_path / "list.pt")
    so.loadTorch(tmp_path / "list.pt")
    got = so.getNumpyVersion()
    assert (got["exp_avg"] == 2).all() and (got["exp_avg_sq"] == 3).all()


def test_optimizer_factory_load_torch_checks_everything_first(tmp_path):
    _, _, _, so = _optimizer_switch()
    before = so.getNumpyVersion()
    torch.save(
        {"exp_avg": torch.full((20, 4), 7.0), "exp_avg_sq": torch.zeros(20, 5)}, tmp_path / "b.pt"
    )
    with pytest.raises(gl.GadgetValueError, match="exp_avg_sq"):
        so.loadTorch(tmp_path / "b.pt")
    torch.save({"sum": torch.zeros(20, 4)}, tmp_path / "c.pt")
    with pytest.raises(gl.GadgetValueError, match="expected"):
        so.loadTorch(tmp_path / "c.pt")
    for k, v in so.getNumpyVersion().items():
        np.testing.assert_array_equal(v, before[k])


def test_save_and_load_torch_keep_bfloat16(tmp_path):
    emb = nn.Embedding(3, 4)
    sw = gl.PytorchModelFactory(emb, 20, 4, datatype="bfloat16", deviceType="cpu")
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    sw.saveTorch(tmp_path / "bf.pt")
    assert torch.load(tmp_path / "bf.pt", weights_only=True).dtype == torch.bfloat16
    sw.zerosInit()
    sw.loadTorch(tmp_path / "bf.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)
    torch.save(torch.from_numpy(before), tmp_path / "f32.pt")  # exact in bfloat16: taken
    sw.zerosInit()
    sw.loadTorch(tmp_path / "f32.pt")
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_save_cupy_appends_npy_like_numpy(tmp_path):
    g = gl.DataGadget(np.arange(10, dtype=np.float32).reshape(5, 2), placement="cpu")
    g.saveCupy(tmp_path / "emb")
    assert os.listdir(tmp_path) == ["emb.npy"]
    h = gl.DataGadget((5, 2), placement="cpu")
    h.loadCupy(tmp_path / "emb.npy")
    np.testing.assert_array_equal(h.getNumpyVersion(), g.getNumpyVersion())


# ---- switchers with a table dtype other than the variable's ---------------------------
@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("state_dtype", [None, "float32"])
def test_switcher_dtype_other_than_the_variable(placement, dtype, state_dtype, opt_name):
    torch.manual_seed(0)
    dev = "cuda" if placement != "cpu" else "cpu"
    emb = nn.Embedding(4, 3).to(dev)
    model = nn.Module()
    model.e = emb
    sw = gl.ModelFactory(emb, 10, 3, datatype=dtype, placement=placement)
    sw.uniformDistributionInit(-1, 1)
    if opt_name == "SGD":
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
    so = gl.OptimizerFactory(
        opt, 10, 3, model, "e", dtype=state_dtype or dtype, placement=placement
    )
    so.optInit()
    start = sw.getNumpyVersion().astype(np.float64)
    ids = torch.tensor([1, 2, 2], device=dev)
    for _ in range(2):
        local = sw.beforeForwardPass(ids)
        so.beforeForwardPass(ids)
        opt.zero_grad()
        emb(local).double().sum().backward()
        opt.step()
        sw.afterOptimizerStep(ids)
        so.afterOptimizerStep(ids)
    end = sw.getNumpyVersion().astype(np.float64)
    counts = np.zeros(10)
    counts[[1, 2]] = [1, 2]
    if opt_name == "SGD":
        # momentum 0.9, lr 0.5, gradient = the id's count: two steps move -lr * g * 2.9
        expect = start - 0.5 * counts[:, None] * 2.9
    else:
        # Adam with a constant positive gradient moves every element by -lr per step
        expect = start - 0.2 * (counts[:, None] > 0)
    tol = 2e-2 if dtype == "float16" else 1e-6
    np.testing.assert_allclose(end, expect, atol=tol)


# ---- late gradients are reported even when no other lookup had one ------------------
def test_late_gradient_reported_when_the_step_had_no_gradients(placement, device):
    emb = gl.OffloadedEmbedding(10, 4, placement=placement, device=device)
    w0 = emb.weight.as_tensor().clone()
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    loss = emb(torch.tensor([1, 2], device=device)).sum()
    opt.step()  # before backward: a mistake
    loss.backward()
    with pytest.raises(gl.GadgetValueError, match="after that step"):
        opt.step()
    assert torch.equal(emb.weight.as_tensor(), w0)


def test_an_untrained_lookup_is_not_reported(placement, device):
    emb = gl.OffloadedEmbedding(10, 4, placement=placement, device=device)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, emb, lr=1.0)
    emb(torch.tensor([3], device=device))  # an evaluation forward, never trained
    opt.step()
    emb(torch.tensor([1], device=device)).sum().backward()
    opt.step()  # no error: the first lookup never got a gradient
    assert not torch.equal(emb.weight.as_tensor()[1], emb.weight.as_tensor()[0])


# ---- file tables: a damaged chunk found by a write leaves the file unchanged ---------
@pytest.mark.parametrize("ext", ["zarr", "h5"])
def test_file_write_with_a_damaged_chunk_changes_nothing(tmp_path, ext):
    if ext == "zarr":
        pytest.importorskip("zarr")
    else:
        pytest.importorskip("h5py")
    data = np.arange(40, dtype=np.float32).reshape(10, 4)
    path = str(tmp_path / f"c.{ext}")
    opts = {"compression": "gzip"} if ext == "h5" else {}
    gl.DataGadget(data, placement="cpu").save(path, chunk_rows=2, **opts)
    if ext == "zarr":
        chunk = glob.glob(f"{path}/**/c/3/*", recursive=True) or glob.glob(f"{path}/3.*")
        with open(chunk[0], "wb") as f:
            f.write(b"garbage!")
    else:
        import h5py

        with h5py.File(path, "r") as f:
            ds = f["data"] if "data" in f else f[list(f)[0]]
            info = ds.id.get_chunk_info_by_coord((6, 0))
        with open(path, "r+b") as f:
            f.seek(info.byte_offset)
            f.write(b"\0" * info.size)
    g = gl.DataGadget(path, placement="file")
    with pytest.raises(gl.GadgetFileError, match="c\\.(zarr|h5)"):
        g.insertData(torch.full((2, 4), -5.0), [0, 7])
    g.close()
    again = gl.DataGadget(path, placement="file")
    np.testing.assert_array_equal(again.getData([0, 1]).cpu().numpy(), data[:2])


# ---- arguments -----------------------------------------------------------------------
def test_array_source_dtype_casts_only_what_keeps_values():
    with pytest.raises(gl.GadgetTypeError, match="float64.*uint8"):
        gl.DataGadget(np.array([[300.0, -1.0]]), dtype="uint8", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="range"):
        gl.DataGadget(np.array([[300, 1]]), dtype="uint8", placement="cpu")
    g = gl.DataGadget(np.array([[3, 1]]), dtype="float32", placement="cpu")
    assert g.dtype == torch.float32 and g.getNumpyVersion().tolist() == [[3.0, 1.0]]
    g = gl.DataGadget(np.array([[0.5, 1.0]]), dtype="float16", placement="cpu")
    assert g.getNumpyVersion().tolist() == [[0.5, 1.0]]


def test_id_lists_holding_bools_are_refused():
    g = gl.DataGadget(np.arange(10.0, dtype=np.float32).reshape(5, 2), placement="cpu")
    before = g.getNumpyVersion().copy()
    for ids in (
        [1, True],
        [[1, 2], [3, False]],
        [np.bool_(True), 2],
        [np.array(True), 2],
        [torch.tensor(True), 2],
    ):
        with pytest.raises(gl.GadgetTypeError, match="bool"):
            g.getData(ids)
        with pytest.raises(gl.GadgetTypeError, match="bool"):
            g.insertData(torch.zeros(2, 2), [1, True])
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    assert g.getData([[1, 2], [3, 4]]).shape == (2, 2, 2)


def test_unknown_strategy_and_device_names():
    with pytest.raises(gl.GadgetKeyError, match="nope"):
        gl.DataGadget((3, 2), placement="cpu", strategy="nope")
    g = gl.DataGadget((3, 2), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="'gpu'"):
        g.getData([0], device="gpu")
    with pytest.raises(gl.GadgetTypeError, match="device"):
        gl.DataGadget((3, 2), placement="cpu", device=1.5)


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_save_refuses_bad_dataset_names(tmp_path, ext):
    pytest.importorskip("h5py" if ext == "h5" else "zarr")
    g = gl.DataGadget(np.ones((3, 2), np.float32), placement="cpu")
    path = tmp_path / f"x.{ext}"
    with pytest.raises(gl.GadgetTypeError, match="string"):
        g.save(path, dataset=5)
    for bad in ("/", "", "//"):
        with pytest.raises(gl.GadgetValueError, match="name an array"):
            g.save(path, dataset=bad)
    assert not path.exists()
    g.save(path, dataset="grp/emb")
    assert gl.DataGadget(path, dataset="grp/emb", placement="cpu").shape == (3, 2)


def test_embedding_dtype_and_sizes():
    with pytest.raises(gl.GadgetTypeError, match="floating-point"):
        gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu", dtype=torch.int64)
    with pytest.raises(gl.GadgetValueError, match="whole number"):
        gl.OffloadedEmbedding(5.5, 2, placement="cpu", device="cpu")
    with pytest.raises(gl.GadgetTypeError, match="integer"):
        gl.OffloadedEmbedding(True, 2, placement="cpu", device="cpu")
    assert gl.OffloadedEmbedding(5.0, 2, placement="cpu", device="cpu").weight.shape == (5, 2)


def test_switcher_numeric_arguments():
    emb = nn.Embedding(3, 4)
    with pytest.raises(gl.GadgetValueError, match="whole number"):
        gl.PytorchModelFactory(emb, 20.7, 4, deviceType="cpu")
    sw = gl.PytorchModelFactory(emb, 20, 4, deviceType="cpu")
    with pytest.raises(gl.GadgetValueError, match="batchSize"):
        sw.variableTransformer(-1, 2)
    with pytest.raises(gl.GadgetValueError, match="batchSize"):
        sw.variableTransformer(2.5, 2)
    pos, neg = sw.variableTransformer(2, 3, 0)
    assert pos.shape == (2, 3) and neg.shape == (2, 0)
    model = nn.Module()
    model.e = emb
    opt = torch.optim.Adam(model.parameters())
    so = gl.PytorchOptimizerFactory(opt, 30, 4, model, "e", deviceType="cpu")
    with pytest.raises(gl.GadgetValueError, match="total_classes"):
        so.optInit()


def test_afterOptimizerStep_refuses_a_variable_of_another_shape():
    emb = nn.Embedding(3, 4)
    sw = gl.PytorchModelFactory(emb, 20, 4, deviceType="cpu")
    sw.uniformDistributionInit(-1, 1)
    before = sw.getNumpyVersion().copy()
    sw.beforeForwardPass(torch.tensor([3, 4]))
    for shape in ((1, 8), (2, 5)):
        emb.weight.data = torch.zeros(shape)
        with pytest.raises(gl.GadgetValueError, match="model variable has shape"):
            sw.afterOptimizerStep(torch.tensor([3, 4]))
    np.testing.assert_array_equal(sw.getNumpyVersion(), before)


def test_embedding_bag_argument_checks_leave_no_pending_rows(device):
    bag = gl.OffloadedEmbeddingBag(10, 3, mode="sum", placement="cpu", device=device)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=1.0)
    ids = torch.tensor([1, 2, 3, 4], device=device)
    bad = [
        ((ids, torch.tensor([0, 5])), gl.GadgetValueError, "offsets"),
        ((ids, torch.tensor([1, 2])), gl.GadgetValueError, "start at 0"),
        ((ids, torch.tensor([0, 3, 2])), gl.GadgetValueError, "never decrease"),
        ((ids, torch.tensor([0.0, 2.0])), gl.GadgetTypeError, "int64"),
        ((ids.view(2, 2), torch.tensor([0, 1])), gl.GadgetValueError, "1-D input"),
        (
            (ids, torch.tensor([0, 2]), torch.ones(4, dtype=torch.int64)),
            gl.GadgetTypeError,
            "per_sample",
        ),
        ((ids, torch.tensor([0, 2]), torch.ones(3)), gl.GadgetValueError, "per_sample"),
    ]
    for args, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            bag(*args)
    w = bag.weight.as_tensor().clone()
    out = bag(ids, torch.tensor([0, 2]))
    assert out.shape == (2, 3)
    torch.testing.assert_close(out[0], (w[1] + w[2]).to(out.device))
    out.sum().backward()
    opt.step()  # only the good lookup is trained
    changed = (bag.weight.as_tensor() != w).any(dim=1).nonzero().flatten().tolist()
    assert changed == [1, 2, 3, 4]


def test_embedding_load_state_dict_takes_numpy():
    emb = gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")
    w = np.arange(10, dtype=np.float32).reshape(5, 2)
    emb.load_state_dict({"weight": w})
    np.testing.assert_array_equal(emb.weight.as_tensor().numpy(), w)
    with pytest.raises(RuntimeError, match="tensor or NumPy"):
        emb.load_state_dict({"weight": [[1.0, 2.0]] * 5})
