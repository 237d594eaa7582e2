"""Session 34's library fixes beyond the review files: GadgetLoader refuses at
construction what torch's DataLoader refuses only when a pass starts, and a torch
Dataset of its own; an HDF5 / NumPy array-typed dtype is named as such."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Subset

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


def _ds() -> gl.GadgetDataset:
    return gl.GadgetDataset(np.arange(60, dtype=np.float32).reshape(20, 3), placement="cpu")


@pytest.mark.parametrize(
    ("factor", "error", "match"),
    [
        (0, gl.GadgetValueError, "prefetch_factor must be >= 1; got 0"),
        (-1, gl.GadgetValueError, "prefetch_factor must be >= 1; got -1"),
        (2.5, gl.GadgetTypeError, "prefetch_factor must be an int; got float"),
    ],
)
def test_loader_refuses_a_bad_prefetch_factor_with_workers(factor, error, match):
    with pytest.raises(error, match=match):
        gl.GadgetLoader(_ds(), batch_size=4, num_workers=1, prefetch_factor=factor)


def test_loader_refuses_a_generator_that_is_not_one():
    with pytest.raises(gl.GadgetTypeError, match="torch.Generator.*got int"):
        gl.GadgetLoader(_ds(), batch_size=4, generator=5)
    # a real one is taken (and leaves the batch order to the sampler)
    loader = gl.GadgetLoader(
        _ds(), batch_size=4, order="sequential", generator=torch.Generator().manual_seed(1)
    )
    assert [b[0][0, 0].item() for b in loader] == [0.0, 12.0, 24.0, 36.0, 48.0]


def test_loader_names_a_torch_dataset_it_cannot_take():
    ds = _ds()
    with pytest.raises(gl.GadgetTypeError, match="takes a GadgetDataset.*got Subset"):
        gl.GadgetLoader(Subset(ds, [1, 2]), batch_size=4)
    assert ds[[1]][0].tolist() == [[3.0, 4.0, 5.0]]  # the dataset is untouched


def test_array_typed_hdf5_dataset_is_named_as_such(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "sub.h5"
    with h5py.File(path, "w") as f:
        # (an HDF5 array type: from data=, NumPy would fold the (3,) into the shape)
        f.create_dataset("x", shape=(4,), dtype=np.dtype(("<f4", (3,))))
    for placement in ("cpu", "file"):
        with pytest.raises(gl.GadgetTypeError, match=r"array type.*\(3,\) values of float32"):
            gl.DataGadget(str(path), placement=placement)


def test_modules_beside_group_dicts_form_the_last_group():
    # documented: the group of what no dict names comes after the dicts, in their order
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "emb": gl.OffloadedEmbedding(10, 3, placement="cpu", device="cpu"),
            "head": torch.nn.Linear(3, 1),
            "bias": torch.nn.Linear(1, 1),
        }
    )
    opt = gl.OffloadedOptimizer(
        torch.optim.Adam,
        [
            model["emb"],
            {"params": model["head"].parameters(), "lr": 0.01},
            {"params": model["bias"].parameters(), "lr": 0.02},
        ],
        lr=0.05,
    )
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02, 0.05]
    assert len(opt.param_groups[2]["params"]) == 1  # the table's per-step parameter


def test_ctrl_c_while_meta_takes_its_place_removes_the_old_tables_first(tmp_path, monkeypatch):
    import os
    import signal
    import threading

    from gadgetloader.switching import _checkpoint

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Ctrl-C is held only in the main thread")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("a SIGINT handler of the test runner's own is installed")
    emb = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu")
    emb.weight.fill_(1.0)
    ck = str(tmp_path / "ck")
    gl.save_checkpoint(ck, {"emb": emb})
    old = sorted(os.listdir(ck))
    emb.weight.fill_(2.0)
    real = _checkpoint.replace_atomically

    def replace_then_interrupt(tmp, target):
        real(tmp, target)
        if os.path.basename(str(target)) == "meta.pt":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C just after the commit

    monkeypatch.setattr(_checkpoint, "replace_atomically", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt, match="checkpoint in .* was written"):
        gl.save_checkpoint(ck, {"emb": emb})
    new = sorted(os.listdir(ck))
    assert len(new) == len(old) and not (set(new) - {"meta.pt"}) & set(old)  # old gone
    fresh = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu")
    gl.load_checkpoint(ck, {"emb": fresh})
    assert fresh.weight.getNumpyVersion().tolist() == [[2.0] * 3] * 12
