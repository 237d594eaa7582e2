"""Session 31's fixes:

* ``--lr`` of ``gadgetloader bench train`` and of the word2vec example refuses a learning
  rate above 1e30 (Adam's first float32 step, ten times ``lr``, overflows a little above
  3e37 and used to end in a traceback) with a one-line error naming ``--lr``;
* (documented) an empty lookup counts a step for its table, as ``SparseAdam`` counts one;
  the optimizer's own ``load_state_dict`` is taken while a lookup waits for its step, the
  module's is refused.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gadgetloader.bench._common import MAX_LEARNING_RATE, learning_rate

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text", ["1e-3", "0.5", "10", "1e30"])
def test_learning_rate_takes_rates_up_to_the_cap(text: str) -> None:
    assert learning_rate(text) == float(text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("1e31", "at most 1e30"),
        ("1e38", "at most 1e30"),
        ("0", "above 0"),
        ("-1", "above 0"),
        ("inf", "finite"),
        ("nan", "finite"),
        ("x", "expected a number"),
    ],
)
def test_learning_rate_refuses_with_the_value(text: str, fragment: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=fragment) as info:
        learning_rate(text)
    assert text in str(info.value)


def test_the_cap_is_below_the_float32_overflow_of_adams_first_step() -> None:
    import numpy as np

    # Adam's first step divides lr by 1 - beta1 = 0.1: the cap's step stays finite
    assert np.isfinite(np.float32(MAX_LEARNING_RATE / 0.1))


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "gadgetloader", "bench", "train", "--lr", "1e38"],
        ["-m", "datasets.word2vec", "CORPUS", "--lr", "1e38"],
    ],
    ids=["bench-train", "word2vec"],
)
def test_a_learning_rate_that_overflows_is_a_one_line_error(args: list[str], tmp_path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat\n")
    p = _run([str(corpus) if a == "CORPUS" else a for a in args])
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr
    assert "--lr" in lines[-1] and "at most 1e30" in lines[-1] and "1e38" in lines[-1]


# ---- documented in session 31: empty lookups, the optimizer's load_state_dict -----------
@pytest.fixture()
def _no_cuda():
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.mark.usefixtures("_no_cuda")
def test_an_empty_lookup_counts_a_step_as_sparse_adam_does_and_changes_no_row() -> None:
    import torch

    import gadgetloader as gl

    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    before = emb.weight.getData(range(6)).clone()
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    ref = torch.nn.Embedding(6, 2, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for _ in range(2):
        emb(torch.zeros(0, dtype=torch.long)).sum().backward()
        opt.step()
        ref(torch.zeros(0, dtype=torch.long)).sum().backward()
        ref_opt.step()
    steps = {k: float(v["step"]) for k, v in opt.state_dict()["inner"]["state"].items()}
    assert steps == {0: float(next(iter(ref_opt.state.values()))["step"])} == {0: 2.0}
    torch.testing.assert_close(emb.weight.getData(range(6)), before, rtol=0, atol=0)


@pytest.mark.usefixtures("_no_cuda")
def test_the_optimizers_load_state_dict_is_taken_while_a_lookup_waits() -> None:
    import torch

    import gadgetloader as gl

    def build():
        torch.manual_seed(0)
        e = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
        return e, gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)

    ids = torch.tensor([1, 2, 2])
    emb, opt = build()
    emb(ids).square().sum().backward()
    opt.step()
    saved = opt.state_dict()
    emb(ids).square().sum().backward()  # waits for its step
    rows = emb.weight.getData(range(6)).clone()
    opt.load_state_dict(saved)  # optimizer state only: taken
    opt.step()
    # reference: the same two steps without the load (the loaded state is the state there)
    ref, ref_opt = build()
    ref(ids).square().sum().backward()
    ref_opt.step()
    ref(ids).square().sum().backward()
    torch.testing.assert_close(ref.weight.getData(range(6)), rows, rtol=0, atol=0)
    ref_opt.step()
    after = emb.weight.getData(range(6)).clone()
    torch.testing.assert_close(after, ref.weight.getData(range(6)), rtol=0, atol=0)
    assert not torch.equal(after, rows)
    with pytest.raises(RuntimeError, match="waits for step"):
        emb(ids).sum().backward()
        emb.load_state_dict({"weight": torch.zeros(6, 2)})
    torch.testing.assert_close(emb.weight.getData(range(6)), after, rtol=0, atol=0)


@pytest.mark.usefixtures("_no_cuda")
@pytest.mark.parametrize("kind", ["bf16", "file", "dtype"])
def test_array_protocol_without_copy_raises_gadget_value_error(kind: str, tmp_path) -> None:
    import numpy as np
    import torch

    import gadgetloader as gl

    if kind == "bf16":
        g = gl.DataGadget(torch.arange(6.0).view(3, 2).bfloat16(), placement="cpu")
        dtype = None
    elif kind == "file":
        np.save(tmp_path / "t.npy", np.arange(6, dtype=np.float32).reshape(3, 2))
        g = gl.DataGadget(tmp_path / "t.npy", placement="file")
        dtype = None
    else:
        g = gl.DataGadget(torch.arange(6.0).view(3, 2), placement="cpu")
        dtype = np.float64
    before = g.getNumpyVersion().copy()
    with pytest.raises(gl.GadgetValueError, match="without a copy; drop copy=False"):
        np.asarray(g, dtype=dtype, copy=False)
    with pytest.raises(ValueError, match="cannot be viewed"):  # NumPy's protocol: ValueError
        g.__array__(dtype, copy=False)
    np.testing.assert_array_equal(g.getNumpyVersion(), before)
    g.close()


@pytest.mark.usefixtures("_no_cuda")
@pytest.mark.parametrize("bad", [[1], None, "sd", 3])
def test_optimizer_load_state_dict_of_a_non_dict_is_a_type_error(bad) -> None:
    import torch

    import gadgetloader as gl

    emb = gl.OffloadedEmbedding(6, 2, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    emb(torch.tensor([1, 4])).sum().backward()
    opt.step()
    before = opt.state_dict()
    rows = emb.weight.getData(range(6)).clone()
    with pytest.raises(gl.GadgetTypeError, match=f"a dict.*got {type(bad).__name__}"):
        opt.load_state_dict(bad)
    with pytest.raises(gl.GadgetValueError, match=r"got keys \[1, 'a'\]"):
        opt.load_state_dict({"a": 1, 1: 2})
    after = opt.state_dict()
    torch.testing.assert_close(after["tables"], before["tables"], rtol=0, atol=0)
    torch.testing.assert_close(emb.weight.getData(range(6)), rows, rtol=0, atol=0)


@pytest.mark.usefixtures("_no_cuda")
@pytest.mark.parametrize("stage", ["write", "create"])
def test_a_zarr_save_that_fails_for_want_of_space_is_a_gadget_file_error(
    stage: str, tmp_path, monkeypatch
) -> None:
    """As .npy and HDF5 saves say it: ``cannot save PATH: cannot ...``; old store kept."""
    import errno

    import numpy as np
    import torch
    import zarr

    import gadgetloader as gl

    target = tmp_path / "t.zarr"
    old = np.arange(12, dtype=np.float32).reshape(4, 3)
    gl.DataGadget(torch.from_numpy(old.copy()), placement="cpu").save(target)
    g = gl.DataGadget(torch.full((6, 3), 5.0), placement="cpu")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if stage == "write":
        monkeypatch.setattr(zarr.Array, "__setitem__", no_space)
        what = "cannot write rows 0:6"
    else:
        monkeypatch.setattr(zarr, "create_array", no_space)
        what = "cannot create the store"
    with pytest.raises(gl.GadgetFileError, match=f"cannot save .*t.zarr: {what}") as info:
        g.save(target)
    assert isinstance(info.value, OSError) and "No space left" in str(info.value)
    monkeypatch.undo()
    np.testing.assert_array_equal(gl.DataGadget(target, placement="cpu").getNumpyVersion(), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.zarr"]  # no partial store left


@pytest.mark.usefixtures("_no_cuda")
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_an_hdf5_file_of_dangling_external_links_names_them(placement: str, tmp_path) -> None:
    h5py = pytest.importorskip("h5py")

    import gadgetloader as gl

    path = tmp_path / "links.h5"
    with h5py.File(path, "w") as f:
        f["e"] = h5py.ExternalLink(str(tmp_path / "missing.h5"), "x")
    with pytest.raises(gl.GadgetFileError, match=r"no datasets it can open.*'e'.*missing\.h5:x"):
        gl.DataGadget(path, placement=placement)
    with h5py.File(tmp_path / "empty.h5", "w"):
        pass
    with pytest.raises(gl.GadgetKeyError, match="holds no datasets"):
        gl.DataGadget(tmp_path / "empty.h5", placement=placement)


@pytest.mark.usefixtures("_no_cuda")
def test_default_dataset_names_of_a_save(tmp_path) -> None:
    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    import numpy as np
    import torch

    import gadgetloader as gl

    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    g = gl.DataGadget(torch.from_numpy(rows.copy()), placement="cpu")
    g.save(tmp_path / "a.h5")
    g.save(tmp_path / "a.zarr")
    with h5py.File(tmp_path / "a.h5") as f:
        assert list(f) == ["data"]
    assert isinstance(zarr.open(tmp_path / "a.zarr", mode="r"), zarr.Array)  # no group
    # a file table saved over its own file keeps its dataset's name; elsewhere: "data"
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f.create_dataset("grp/emb", data=rows)
    t = gl.DataGadget(tmp_path / "b.h5", placement="file")
    t.save(tmp_path / "b.h5")
    t.save(tmp_path / "c.h5")
    with h5py.File(tmp_path / "b.h5") as f:
        np.testing.assert_array_equal(f["grp/emb"][...], rows)
    with h5py.File(tmp_path / "c.h5") as f:
        assert list(f) == ["data"]
    np.testing.assert_array_equal(t.getNumpyVersion(), rows)
    t.close()


# ---- rows: one-element tuples of ids, huge slice bounds into the row ----------------------
@pytest.mark.usefixtures("_no_cuda")
@pytest.mark.parametrize(
    "index",
    [
        ([1, 2],),
        ((1, 2),),
        (range(1, 3),),
        ([1, 2], slice(None, None, 2**63)),
        (slice(0, 3), slice(1, None, 2**63)),
        ([1, 2], slice(-(2**63), None)),
        ([1, 2], slice(None, 2**70)),
        ([2, 1], slice(3, -(2**64), 1)),
    ],
    ids=["list", "tuple", "range", "step-2^63", "slice-rows-step", "start", "stop", "empty"],
)
def test_indexes_numpy_reads_alike(index, tmp_path) -> None:
    import warnings

    import numpy as np

    import gadgetloader as gl

    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.save(tmp_path / "t.npy", a)
    for g in (
        gl.DataGadget(a.copy(), placement="cpu"),
        gl.DataGadget(tmp_path / "t.npy", placement="file"),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning of torch's about truncated bounds
            got = g[index]
        np.testing.assert_array_equal(got.numpy(), a[index])
        expect = a.copy()
        value = np.full(a[index].shape, -1.0, np.float32)
        expect[index] = value
        g[index] = value
        np.testing.assert_array_equal(g.getNumpyVersion(), expect)
        g.close()


@pytest.mark.usefixtures("_no_cuda")
def test_a_pointwise_index_names_what_arrived() -> None:
    import gadgetloader as gl

    g = gl.DataGadget((5, 3), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match=r"got g\[\[1, 2\], \[0\]\]"):
        g[[1, 2], [0]]


# ---- the transfer engine: out= returned as given; strategy and kind checked ---------------
@pytest.mark.usefixtures("_no_cuda")
def test_engine_gather_returns_the_given_out_and_checks_its_names() -> None:
    import torch

    import gadgetloader as gl
    import gadgetloader.transfer as tr

    t = torch.arange(40.0).reshape(10, 4)
    out = torch.empty(3, 4)
    assert tr.gather(t, torch.tensor([1, 2, 3]), out=out) is out
    torch.testing.assert_close(out, t[1:4], rtol=0, atol=0)
    flat = torch.empty(4, 4)  # N-d ids into a flat out: a view of it in the result's shape
    got = tr.gather(t, torch.tensor([[1, 2], [3, 4]]), out=flat)
    assert got.shape == (2, 2, 4) and got.data_ptr() == flat.data_ptr()
    torch.testing.assert_close(flat, t[1:5], rtol=0, atol=0)
    with pytest.raises(gl.GadgetTypeError, match="strategy must be a string.*NoneType"):
        tr.resolve_strategy(None, t, 3)
    with pytest.raises(gl.GadgetKeyError, match="Unknown kind 'bogus'"):
        tr.resolve_strategy("auto", t, 3, kind="bogus")


# ---- checkpoints: a meta.pt or HDF5 flush that fails is a GadgetFileError ------------------
@pytest.mark.usefixtures("_no_cuda")
@pytest.mark.parametrize("where", ["meta-write", "meta-replace", "hdf5-fsync"])
def test_a_checkpoint_write_that_fails_is_a_gadget_file_error(where, tmp_path, monkeypatch):
    import errno
    import os
    import stat

    import torch

    import gadgetloader as gl

    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")})
    ck = tmp_path / "ck"
    fmt = "hdf5" if where == "hdf5-fsync" else "npy"
    gl.save_checkpoint(ck, {"m": m}, format=fmt)
    saved = m["e"].weight.getData(range(5)).clone()
    before = sorted(os.listdir(ck))
    m["e"].weight.fill_(3.0)
    if where == "meta-write":
        real_save = torch.save

        def save(obj, f, *a, **k):
            if str(f).endswith("meta.pt.tmp"):
                raise RuntimeError("PytorchStreamWriter failed writing file: file write failed")
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", save)
        match = "cannot save .*meta.pt: cannot write it"
    elif where == "meta-replace":
        real = os.replace

        def replace(a, b, *r, **k):
            if str(b).endswith("meta.pt"):
                raise OSError(errno.EIO, "Input/output error")
            return real(a, b, *r, **k)

        monkeypatch.setattr(os, "replace", replace)
        match = "cannot put the new .*meta.pt in place of the old one"
    else:
        real_fsync = os.fsync

        def fsync(fd):
            if stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        match = "cannot save .*: cannot flush the file"
    with pytest.raises(gl.GadgetFileError, match=match):
        gl.save_checkpoint(ck, {"m": m}, format=fmt)
    monkeypatch.undo()
    assert sorted(os.listdir(ck)) == before  # the old checkpoint, whole; nothing of the new
    gl.load_checkpoint(ck, {"m": m})
    torch.testing.assert_close(m["e"].weight.getData(range(5)), saved, rtol=0, atol=0)


@pytest.mark.usefixtures("_no_cuda")
@pytest.mark.parametrize("kind", ["list", "array", "slice", "range"])
def test_many_calls_read_rows_alone_in_a_tuple_as_those_rows(kind: str) -> None:
    import numpy as np
    import torch

    import gadgetloader as gl

    rows = {"list": [1, 2], "array": np.array([1, 2]), "slice": slice(1, 3), "range": range(1, 3)}
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = gl.DataGadget(a.copy(), placement="cpu")
    h = gl.DataGadget(a.copy() * 10, placement="cpu")
    got = gl.gather_many([g, h], (rows[kind],))
    np.testing.assert_array_equal(got[0].numpy(), a[1:3])
    np.testing.assert_array_equal(got[1].numpy(), a[1:3] * 10)
    gl.scatter_many([g, h], [torch.zeros(2, 3), torch.ones(2, 3)], (rows[kind],))
    np.testing.assert_array_equal(g.getNumpyVersion()[1:3], 0)
    np.testing.assert_array_equal(h.getNumpyVersion()[1:3], 1)
    with pytest.raises(gl.GadgetTypeError, match="not an index into the rows"):
        gl.gather_many([g, h], (rows[kind], 0))


def test_word2vec_training_that_diverges_stops_and_writes_nothing(tmp_path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    env.pop("PYTHONWARNINGS", None)
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat\n")
    out = tmp_path / "vec"
    p = subprocess.run(
        [sys.executable, "-m", "datasets.word2vec", str(corpus), "--dim", "4", "--epochs", "3"]
        + ["--lr", "1e30", "--no-progress", "--out", str(out), "--device", "cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    assert "training diverged" in p.stderr and "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == [corpus]  # no vectors written


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "mps"])
def test_word2vec_device_is_checked_before_training(device: str, tmp_path) -> None:
    p = _run(["-m", "datasets.word2vec", str(tmp_path / "missing.txt"), "--device", device])
    assert p.returncode == 2 and "argument --device" in p.stderr and device in p.stderr


@pytest.mark.parametrize("strategy", ["auto", "kernel", "sorted", "hybrid", "torch"])
@pytest.mark.parametrize("kind", ["gather", "scatter"])
def test_a_cpu_table_moves_with_torch_even_where_cupy_is_present(
    strategy: str, kind: str, monkeypatch
) -> None:
    """The row kernels address tables through CUDA pointers: a CPU tensor given to the
    engine (``gadgetloader.transfer``) must never reach them (on the H200 it was an illegal
    memory access that poisoned the process)."""
    import torch

    import gadgetloader.transfer as tr
    from gadgetloader.transfer import _engine

    monkeypatch.setattr(_engine, "cupy_available", lambda: True)
    t = torch.arange(40.0).reshape(10, 4)
    assert tr.resolve_strategy(strategy, t, 5000, t, kind=kind) == "torch"
    ids = torch.tensor([3, 1, 3, 7])
    if kind == "gather":
        torch.testing.assert_close(tr.gather(t, ids, strategy=strategy), t[ids], rtol=0, atol=0)
    else:
        expect = t.clone()
        expect[torch.tensor([1, 7, 3])] = torch.tensor([[1.0] * 4, [3.0] * 4, [2.0] * 4])
        rows = torch.tensor([[0.0] * 4, [1.0] * 4, [2.0] * 4, [3.0] * 4])
        tr.scatter(t, ids, rows, strategy=strategy)  # the last of the repeated 3s wins
        torch.testing.assert_close(t, expect, rtol=0, atol=0)
