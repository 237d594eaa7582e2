"""Black-box review (session 28): checkpoint / resume of offloaded training, the word2vec
example and the ``gadgetloader`` command line, written from README.md, SPEC.md and the
public docstrings only."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl
from gadgetloader.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")


@pytest.fixture(scope="module", autouse=True)
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(args: list[str], cwd: Path | str = ROOT, timeout: int = 120, **kw):
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _no_traceback_one_line(stderr: str) -> str:
    """The error text: no traceback, exactly one line (FallbackWarning lines aside)."""
    assert "Traceback" not in stderr, stderr
    lines = [
        ln
        for ln in stderr.strip().splitlines()
        if ln.strip() and "FallbackWarning" not in ln and not ln.startswith("  ")
    ]
    assert len(lines) == 1, stderr
    return lines[0]


# ----------------------------------------------------------------------------------------
# 1. checkpoint and resume
# ----------------------------------------------------------------------------------------

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "asgd": (torch.optim.ASGD, {"lr": 0.05}),
    "rprop": (torch.optim.Rprop, {"lr": 0.05}),
}
FORMATS = ["npy", "hdf5", "zarr"]
DIM = 4


def _build(seed: int, opt_name: str = "adam", emb_rows: int = 30, bag_rows: int = 25, dim=DIM):
    torch.manual_seed(seed)
    model = nn.ModuleDict(
        {
            "emb": gl.OffloadedEmbedding(emb_rows, dim, placement="cpu", device="cpu"),
            "bag": gl.OffloadedEmbeddingBag(
                bag_rows, dim, mode="sum", placement="cpu", device="cpu"
            ),
            "head": nn.Linear(dim, 1),
        }
    )
    cls, kw = OPTIMIZERS[opt_name]
    opt = gl.OffloadedOptimizer(cls, model, **kw)
    return model, opt


def _batches(n: int, emb_rows: int = 30, bag_rows: int = 25, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, emb_rows, (8, 2), generator=g)
        bag = torch.randint(0, bag_rows, (8, 3), generator=g)
        y = torch.randn(8, generator=g)
        out.append((ids, bag, y))
    return out


def _train(model, opt, batches) -> None:
    for ids, bag, y in batches:
        pred = model["head"](model["emb"](ids).sum(1) * model["bag"](bag)).squeeze(-1)
        loss = nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _snapshot(model, opt) -> dict:
    return {
        "tables": {
            n: np.array(model[n].weight.getNumpyVersion(), copy=True) for n in ("emb", "bag")
        },
        "params": {k: v.detach().clone() for k, v in model["head"].state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
    }


def _equal(a, b, path="") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict), path
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, path
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, (path, a, b)


def _assert_same_snapshot(a: dict, b: dict) -> None:
    _equal(a, b)


def _steps_in(opt) -> list[float]:
    return [
        float(s["step"])
        for s in opt.state_dict()["inner"]["state"].values()
        if isinstance(s, dict) and "step" in s
    ]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_checkpoint_resume_is_bit_identical(tmp_path, opt_name, fmt):
    batches = _batches(9)
    # uninterrupted
    model_a, opt_a = _build(0, opt_name)
    init = _snapshot(model_a, opt_a)
    _train(model_a, opt_a, batches)
    ref = _snapshot(model_a, opt_a)
    assert not np.array_equal(ref["tables"]["emb"], init["tables"]["emb"])
    assert not np.array_equal(ref["tables"]["bag"], init["tables"]["bag"])
    assert all(np.isfinite(t).all() for t in ref["tables"].values())
    assert all(torch.isfinite(t).all() for t in ref["params"].values())

    # interrupted after 4 steps
    model_b, opt_b = _build(0, opt_name)
    _train(model_b, opt_b, batches[:4])
    at_ckpt = _snapshot(model_b, opt_b)
    gl.save_checkpoint(tmp_path / "ckpt", {"model": model_b, "optimizer": opt_b}, format=fmt)
    assert (tmp_path / "ckpt" / "meta.pt").is_file()
    _assert_same_snapshot(_snapshot(model_b, opt_b), at_ckpt)  # saving changes nothing

    # resume in freshly built objects (another init)
    model_c, opt_c = _build(123, opt_name)
    assert not np.array_equal(_snapshot(model_c, opt_c)["tables"]["emb"], at_ckpt["tables"]["emb"])
    gl.load_checkpoint(tmp_path / "ckpt", {"model": model_c, "optimizer": opt_c})
    _assert_same_snapshot(_snapshot(model_c, opt_c), at_ckpt)
    steps = _steps_in(opt_c)
    if steps:  # step counts preserved (every table and parameter stepped 4 times)
        assert steps == [4.0] * len(steps)
    _train(model_c, opt_c, batches[4:])
    _assert_same_snapshot(_snapshot(model_c, opt_c), ref)

    # the interrupted run itself continues identically
    _train(model_b, opt_b, batches[4:])
    _assert_same_snapshot(_snapshot(model_b, opt_b), ref)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_state_dict_resume_is_bit_identical(opt_name):
    batches = _batches(8)
    model_a, opt_a = _build(0, opt_name)
    _train(model_a, opt_a, batches)
    ref = _snapshot(model_a, opt_a)

    model_b, opt_b = _build(0, opt_name)
    _train(model_b, opt_b, batches[:3])
    at = _snapshot(model_b, opt_b)
    buf = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd["model"]) == {"emb.weight", "bag.weight", "head.weight", "head.bias"}
    np.testing.assert_array_equal(np.asarray(sd["model"]["emb.weight"]), at["tables"]["emb"])

    model_c, opt_c = _build(99, opt_name)
    model_c.load_state_dict(sd["model"])
    opt_c.load_state_dict(sd["opt"])
    _assert_same_snapshot(_snapshot(model_c, opt_c), at)
    _train(model_c, opt_c, batches[3:])
    _assert_same_snapshot(_snapshot(model_c, opt_c), ref)


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_checkpoint_resume_bag_modes(tmp_path, mode):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.ModuleDict(
            {
                "emb": gl.OffloadedEmbedding(30, DIM, placement="cpu", device="cpu"),
                "bag": gl.OffloadedEmbeddingBag(25, DIM, mode=mode, placement="cpu", device="cpu"),
                "head": nn.Linear(DIM, 1),
            }
        )
        return model, gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.05)

    batches = _batches(6)
    model_a, opt_a = build(0)
    _train(model_a, opt_a, batches)
    ref = _snapshot(model_a, opt_a)
    model_b, opt_b = build(0)
    _train(model_b, opt_b, batches[:3])
    gl.save_checkpoint(tmp_path / "c", {"model": model_b, "optimizer": opt_b}, format="hdf5")
    model_c, opt_c = build(3)
    gl.load_checkpoint(tmp_path / "c", {"model": model_c, "optimizer": opt_c})
    _train(model_c, opt_c, batches[3:])
    _assert_same_snapshot(_snapshot(model_c, opt_c), ref)


def _trained_target(opt_name="adam", **shape):
    """Live objects with their own trained state, to check that a refused load keeps it."""
    model, opt = _build(7, opt_name, **shape)
    _train(model, opt, _batches(2, shape.get("emb_rows", 30), shape.get("bag_rows", 25), seed=11))
    return model, opt


@pytest.fixture
def adam_ckpt(tmp_path):
    model, opt = _build(0, "adam")
    _train(model, opt, _batches(3))
    gl.save_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": opt}, format="npy")
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    "shape",
    [{"bag_rows": 26}, {"emb_rows": 31}, {"dim": 5}],
    ids=["bag_rows", "emb_rows", "dim"],
)
def test_load_checkpoint_into_other_shape_is_refused_unchanged(adam_ckpt, shape):
    model, opt = _trained_target(**shape)
    before = _snapshot(model, opt)
    with pytest.raises((gl.GadgetValueError, gl.GadgetKeyError)):
        gl.load_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    _assert_same_snapshot(_snapshot(model, opt), before)
    _train(model, opt, _batches(1, shape.get("emb_rows", 30), shape.get("bag_rows", 25)))


def test_load_checkpoint_with_wrong_object_name_is_refused_unchanged(adam_ckpt):
    model, opt = _trained_target()
    before = _snapshot(model, opt)
    with pytest.raises((gl.GadgetKeyError, gl.GadgetValueError)):
        gl.load_checkpoint(adam_ckpt, {"model": model, "opt": opt})
    _assert_same_snapshot(_snapshot(model, opt), before)


@pytest.mark.parametrize("other", ["AdamW", "NAdam", "SGD"])
def test_checkpoint_of_other_optimizer_class_is_refused_unchanged(adam_ckpt, other):
    cls = getattr(torch.optim, other)
    torch.manual_seed(7)
    model = nn.ModuleDict(
        {
            "emb": gl.OffloadedEmbedding(30, DIM, placement="cpu", device="cpu"),
            "bag": gl.OffloadedEmbeddingBag(25, DIM, mode="sum", placement="cpu", device="cpu"),
            "head": nn.Linear(DIM, 1),
        }
    )
    kw = {"lr": 0.01, "momentum": 0.9} if other == "SGD" else {"lr": 0.01}
    opt = gl.OffloadedOptimizer(cls, model, **kw)
    _train(model, opt, _batches(2, seed=3))
    before = _snapshot(model, opt)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    _assert_same_snapshot(_snapshot(model, opt), before)
    # the same through state dicts
    src_model, src_opt = _build(0, "adam")
    _train(src_model, src_opt, _batches(2))
    with pytest.raises(gl.GadgetError):
        opt.load_state_dict(src_opt.state_dict())
    _assert_same_snapshot(_snapshot(model, opt), before)


def test_optimizer_state_dict_of_other_shapes_is_refused_unchanged():
    src_model, src_opt = _build(0, "adam", bag_rows=26)
    _train(src_model, src_opt, _batches(2, bag_rows=26))
    model, opt = _trained_target()
    before = _snapshot(model, opt)
    with pytest.raises(gl.GadgetError):
        opt.load_state_dict(src_opt.state_dict())
    _assert_same_snapshot(_snapshot(model, opt), before)


def test_module_load_state_dict_follows_torch_semantics():
    """README: each table is checked before its rows change, but tables that fit are
    loaded even when another one does not (torch then raises)."""
    model, opt = _trained_target()
    before = _snapshot(model, opt)
    new_emb = torch.full((30, DIM), 0.25)
    sd = {
        "emb.weight": new_emb,
        "bag.weight": torch.zeros(26, DIM),  # wrong rows
        "head.weight": model["head"].weight.detach().clone(),
        "head.bias": model["head"].bias.detach().clone(),
    }
    with pytest.raises(RuntimeError):
        model.load_state_dict(sd)
    np.testing.assert_array_equal(model["bag"].weight.getNumpyVersion(), before["tables"]["bag"])
    np.testing.assert_array_equal(model["emb"].weight.getNumpyVersion(), new_emb.numpy())
    # a float64 tensor rounds into the float32 table, as torch converts it
    v = torch.rand(25, DIM, dtype=torch.float64)
    model["bag"].load_state_dict({"weight": v})
    np.testing.assert_array_equal(model["bag"].weight.getNumpyVersion(), v.float().numpy())


def test_load_checkpoint_missing_is_clear_error_unchanged(tmp_path):
    model, opt = _trained_target()
    before = _snapshot(model, opt)
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "nope", {"model": model, "optimizer": opt})
    (tmp_path / "empty").mkdir()
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(tmp_path / "empty", {"model": model, "optimizer": opt})
    assert issubclass(gl.GadgetFileNotFoundError, FileNotFoundError)
    _assert_same_snapshot(_snapshot(model, opt), before)


def test_load_checkpoint_damaged_meta_is_file_error_unchanged(adam_ckpt):
    model, opt = _trained_target()
    before = _snapshot(model, opt)
    (adam_ckpt / "meta.pt").write_bytes(b"this is not a checkpoint")
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    _assert_same_snapshot(_snapshot(model, opt), before)


def _table_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name != "meta.pt")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["first", "last"])
def test_load_checkpoint_truncated_table_is_file_error_unchanged(tmp_path, fmt, which):
    src_model, src_opt = _build(0, "adam", emb_rows=300, bag_rows=250)
    _train(src_model, src_opt, _batches(2, 300, 250))
    d = tmp_path / "ckpt"
    gl.save_checkpoint(d, {"model": src_model, "optimizer": src_opt}, format=fmt)
    files = _table_files(d)
    assert len(files) >= 4  # two tables + Adam's two moments
    victim = files[0] if which == "first" else files[-1]
    if victim.is_dir():  # zarr: cut one chunk file short
        chunks = sorted(
            (p for p in victim.rglob("*") if p.is_file() and not p.name.startswith(("zarr", "."))),
            key=lambda p: p.stat().st_size,
        )
        target = chunks[-1]
    else:
        target = victim
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])

    model, opt = _trained_target(emb_rows=300, bag_rows=250)
    before = _snapshot(model, opt)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(d, {"model": model, "optimizer": opt})
    _assert_same_snapshot(_snapshot(model, opt), before)


@pytest.mark.parametrize("case", ["deleted", "other_dtype", "other_shape", "state_other_shape"])
def test_load_checkpoint_table_file_problems_unchanged(adam_ckpt, case):
    files = _table_files(adam_ckpt)
    bag = next(p for p in files if "bag" in p.name)
    if case == "deleted":
        files[-1].unlink()
        err = (gl.GadgetFileError, gl.GadgetFileNotFoundError)
    elif case == "other_dtype":  # fits the shape, not the dtype
        np.save(bag, np.zeros((25, DIM), np.float64))
        err = gl.GadgetTypeError
    elif case == "other_shape":
        np.save(bag, np.zeros((26, DIM), np.float32))
        err = gl.GadgetValueError
    else:
        state = [p for p in files if "exp_avg_sq" in p.name][-1]
        np.save(state, np.zeros((3, DIM), np.float32))
        err = gl.GadgetValueError
    model, opt = _trained_target()
    before = _snapshot(model, opt)
    with pytest.raises(err):
        gl.load_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    _assert_same_snapshot(_snapshot(model, opt), before)


class _Injected(Exception):
    pass


def _patch_second_call(mp, targets):
    """Make the second call of any of ``targets`` (shared count) raise ``_Injected``."""
    calls = {"n": 0}
    for obj, name in targets:
        orig = getattr(obj, name)

        def wrapper(*a, _orig=orig, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise _Injected("simulated failure mid-save")
            return _orig(*a, **k)

        mp.setattr(obj, name, wrapper)
    return calls


@pytest.mark.parametrize("fmt", [*FORMATS, "meta", "meta_replace"])
def test_interrupted_save_keeps_previous_checkpoint(tmp_path, fmt):
    batches = _batches(6)
    model, opt = _build(0, "adam")
    _train(model, opt, batches[:2])
    first = _snapshot(model, opt)
    d = tmp_path / "ckpt"
    save_fmt = fmt if fmt in FORMATS else "npy"
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=save_fmt)
    listing = sorted(p.name for p in d.iterdir())

    _train(model, opt, batches[2:4])
    second = _snapshot(model, opt)
    assert not np.array_equal(first["tables"]["emb"], second["tables"]["emb"])
    if fmt == "npy":
        import numpy.lib.format as npf

        targets = [(npf, "write_array_header_1_0"), (npf, "write_array_header_2_0")]
    elif fmt == "hdf5":
        targets = [(h5py.Dataset, "write_direct"), (h5py.Dataset, "__setitem__")]
    elif fmt == "zarr":
        targets = [(zarr.Array, "__setitem__")]
    else:  # meta.pt is written last (the second torch.save, or the first that writes)
        targets = [(torch, "save")]
    if fmt == "meta_replace":  # the final rename of meta.pt fails
        targets = []
    with pytest.MonkeyPatch.context() as mp:
        calls = _patch_second_call(mp, targets)
        if fmt == "meta_replace":
            orig_replace = os.replace

            def replace(src, dst, *a, **k):
                if os.fspath(dst).endswith("meta.pt"):
                    calls["n"] += 2
                    raise _Injected("simulated failure of the final rename")
                return orig_replace(src, dst, *a, **k)

            mp.setattr(os, "replace", replace)
        # the exception itself, or (for a write error) a GadgetFileError naming the file
        with pytest.raises((_Injected, gl.GadgetFileError)):
            gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=save_fmt)
    assert calls["n"] >= 2, "the simulated failure never happened"
    # the files written by the failed save are removed, the old ones are whole
    assert sorted(p.name for p in d.iterdir()) == listing
    _assert_same_snapshot(_snapshot(model, opt), second)  # live objects untouched

    fresh_model, fresh_opt = _build(42, "adam")
    gl.load_checkpoint(d, {"model": fresh_model, "optimizer": fresh_opt})
    _assert_same_snapshot(_snapshot(fresh_model, fresh_opt), first)

    # a later successful save replaces it
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format=save_fmt)
    fresh_model, fresh_opt = _build(43, "adam")
    gl.load_checkpoint(d, {"model": fresh_model, "optimizer": fresh_opt})
    _assert_same_snapshot(_snapshot(fresh_model, fresh_opt), second)
    assert len(list(d.iterdir())) == len(listing)  # old table files removed


def test_failed_first_save_leaves_nothing_loadable(tmp_path):
    import numpy.lib.format as npf

    model, opt = _build(0)
    _train(model, opt, _batches(1))
    d = tmp_path / "c"
    with pytest.MonkeyPatch.context() as mp:
        calls = _patch_second_call(mp, [(npf, "write_array_header_1_0")])
        with pytest.raises(_Injected):
            gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    assert calls["n"] == 2
    assert not d.exists() or not any(d.iterdir()), list(d.iterdir())
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.load_checkpoint(d, {"model": model, "optimizer": opt})


_KILLED_SAVE = """
import os, sys, torch, numpy.lib.format as npf
sys.path.insert(0, {tests!r})
import test_review_session28_ckpt_cli as t
import gadgetloader as gl
model, opt = t._build(0)
t._train(model, opt, t._batches(4)[:2])
gl.save_checkpoint({d!r}, {{"model": model, "optimizer": opt}}, format={fmt!r})
t._train(model, opt, t._batches(4)[2:])
n = [0]
orig = npf.write_array_header_1_0
def die(*a, **k):
    n[0] += 1
    if n[0] == 2:
        os._exit(9)
    return orig(*a, **k)
npf.write_array_header_1_0 = die
import h5py
orig_w = h5py.Dataset.write_direct
def die_h5(*a, **k):
    n[0] += 1
    if n[0] == 2:
        os._exit(9)
    return orig_w(*a, **k)
h5py.Dataset.write_direct = die_h5
gl.save_checkpoint({d!r}, {{"model": model, "optimizer": opt}}, format={fmt!r})
sys.exit(0)
"""


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_killed_save_keeps_previous_checkpoint(tmp_path, fmt):
    d = tmp_path / "c"
    code = _KILLED_SAVE.format(tests=str(ROOT / "tests"), d=str(d), fmt=fmt)
    proc = _run(["-c", code], timeout=120)
    assert proc.returncode == 9, proc.stderr  # killed part-way through the second save
    model, opt = _build(0)
    _train(model, opt, _batches(4)[:2])
    first = _snapshot(model, opt)
    fresh_model, fresh_opt = _build(1)
    gl.load_checkpoint(d, {"model": fresh_model, "optimizer": fresh_opt})
    _assert_same_snapshot(_snapshot(fresh_model, fresh_opt), first)
    # a later save over what the killed one left behind works
    _train(fresh_model, fresh_opt, _batches(1, seed=12))
    later = _snapshot(fresh_model, fresh_opt)
    gl.save_checkpoint(d, {"model": fresh_model, "optimizer": fresh_opt}, format=fmt)
    again_model, again_opt = _build(2)
    gl.load_checkpoint(d, {"model": again_model, "optimizer": again_opt})
    _assert_same_snapshot(_snapshot(again_model, again_opt), later)


def test_save_checkpoint_bad_arguments_write_nothing(tmp_path):
    model, opt = _build(0, "adam")
    d = tmp_path / "ckpt"
    with pytest.raises(gl.GadgetKeyError):
        gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="parquet")
    for bad in ["a/b", "", "..", "x\\y"]:
        with pytest.raises(gl.GadgetValueError):
            gl.save_checkpoint(d, {bad: model, "optimizer": opt})
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(d, [("model", model)])
    assert not d.exists() or not any(d.iterdir())
    (tmp_path / "afile").write_text("x")
    with pytest.raises(gl.GadgetFileError):
        gl.save_checkpoint(tmp_path / "afile", {"model": model, "optimizer": opt})


def test_bfloat16_checkpoint_needs_hdf5_or_zarr(tmp_path):
    torch.manual_seed(0)
    emb = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu", dtype=torch.bfloat16)
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "c", {"emb": emb}, format="npy")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
    gl.save_checkpoint(tmp_path / "c", {"emb": emb}, format="hdf5")
    torch.manual_seed(1)
    emb2 = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu", dtype=torch.bfloat16)
    gl.load_checkpoint(tmp_path / "c", {"emb": emb2})
    a = emb.weight.as_tensor()
    b = emb2.weight.as_tensor()
    assert a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_checkpoint_keeps_separate_step_counts(tmp_path):
    """A table with no lookup in a step is not stepped: its count differs and survives."""
    batches = _batches(7)

    def train_alt(model, opt, bs, start):
        for i, (ids, bag, y) in enumerate(bs, start):
            h = model["emb"](ids).sum(1)
            if i % 2 == 0:
                h = h * model["bag"](bag)
            loss = nn.functional.mse_loss(model["head"](h).squeeze(-1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    model_a, opt_a = _build(0)
    train_alt(model_a, opt_a, batches, 0)
    ref = _snapshot(model_a, opt_a)
    model_b, opt_b = _build(0)
    train_alt(model_b, opt_b, batches[:4], 0)
    gl.save_checkpoint(tmp_path / "c", {"m": model_b, "o": opt_b}, format="zarr")
    model_c, opt_c = _build(1)
    gl.load_checkpoint(tmp_path / "c", {"m": model_c, "o": opt_c})
    steps = sorted(set(_steps_in(opt_c)))
    assert steps == [2.0, 4.0], steps  # bag stepped at 0 and 2; emb and head 4 times
    train_alt(model_c, opt_c, batches[4:], 4)
    _assert_same_snapshot(_snapshot(model_c, opt_c), ref)


def test_checkpoint_with_momentum_a_scheduler_turned_on(tmp_path):
    """README: a checkpoint holding state the optimizer has not turned on yet (a
    scheduler's momentum) loads, and that state is paged from then on."""
    batches = _batches(6)

    def build(seed):
        torch.manual_seed(seed)
        model = nn.ModuleDict(
            {
                "emb": gl.OffloadedEmbedding(30, DIM, placement="cpu", device="cpu"),
                "bag": gl.OffloadedEmbeddingBag(25, DIM, mode="sum", placement="cpu", device="cpu"),
                "head": nn.Linear(DIM, 1),
            }
        )
        return model, gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.01, momentum=0.0)

    def run(model, opt, bs):
        for group in opt.param_groups:
            group["momentum"] = 0.9  # what a scheduler (OneCycleLR, CyclicLR) does
        _train(model, opt, bs)

    model_a, opt_a = build(0)
    run(model_a, opt_a, batches)
    ref = _snapshot(model_a, opt_a)
    model_b, opt_b = build(0)
    run(model_b, opt_b, batches[:3])
    gl.save_checkpoint(tmp_path / "c", {"model": model_b, "optimizer": opt_b})
    model_c, opt_c = build(5)  # momentum off
    gl.load_checkpoint(tmp_path / "c", {"model": model_c, "optimizer": opt_c})
    assert all(g["momentum"] == 0.9 for g in opt_c.param_groups)
    _assert_same_snapshot(_snapshot(model_c, opt_c), _snapshot(model_b, opt_b))
    _train(model_c, opt_c, batches[3:])
    _assert_same_snapshot(_snapshot(model_c, opt_c), ref)


def test_checkpoint_numpy_options_keep_their_type(tmp_path):
    model, opt = _build(0)
    for g in opt.param_groups:
        g["lr"] = np.float64(0.02)
    _train(model, opt, _batches(2))
    gl.save_checkpoint(tmp_path / "c", {"model": model, "optimizer": opt})
    model2, opt2 = _build(1)
    gl.load_checkpoint(tmp_path / "c", {"model": model2, "optimizer": opt2})
    assert all(type(g["lr"]) is np.float64 and g["lr"] == 0.02 for g in opt2.param_groups)


def test_checkpoint_unkeepable_option_refused_before_writing(tmp_path, adam_ckpt):
    listing = sorted(p.name for p in adam_ckpt.iterdir())
    meta = (adam_ckpt / "meta.pt").read_bytes()
    model, opt = _build(0)
    _train(model, opt, _batches(1))
    opt.param_groups[0]["hook"] = lambda x: x
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    assert sorted(p.name for p in adam_ckpt.iterdir()) == listing
    assert (adam_ckpt / "meta.pt").read_bytes() == meta
    with pytest.raises(gl.GadgetTypeError):
        gl.save_checkpoint(tmp_path / "new", {"model": model, "optimizer": opt})
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


def test_load_checkpoint_while_lookup_waits_for_step_is_refused(adam_ckpt):
    model, opt = _trained_target()
    ids, bag, y = _batches(1, seed=9)[0]
    pred = model["head"](model["emb"](ids).sum(1) * model["bag"](bag)).squeeze(-1)
    opt.zero_grad()
    nn.functional.mse_loss(pred, y).backward()
    before = _snapshot(model, opt)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    _assert_same_snapshot(_snapshot(model, opt), before)
    opt.step()  # the pending step still applies
    assert not np.array_equal(model["emb"].weight.getNumpyVersion(), before["tables"]["emb"])


def test_load_checkpoint_retires_lookup_waiting_for_backward(adam_ckpt):
    model, opt = _trained_target()
    ids, bag, _ = _batches(1, seed=9)[0]
    # tables only: the load rewrites the head's weights in place, which torch's own
    # autograd would refuse to differentiate through
    out = (model["emb"](ids).sum(1) * model["bag"](bag)).pow(2).sum()
    gl.load_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    loaded = _snapshot(model, opt)
    out.backward()
    with pytest.raises(gl.GadgetValueError, match="before its rows were loaded"):
        opt.step()
    for n in ("emb", "bag"):
        np.testing.assert_array_equal(model[n].weight.getNumpyVersion(), loaded["tables"][n])


def test_load_checkpoint_other_dtype_or_kind_refused_unchanged(tmp_path):
    torch.manual_seed(0)
    src = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu", dtype=torch.float64)
    gl.save_checkpoint(tmp_path / "c", {"emb": src})
    dst = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu")
    before = dst.weight.getNumpyVersion()
    with pytest.raises(gl.GadgetTypeError):
        gl.load_checkpoint(tmp_path / "c", {"emb": dst})
    np.testing.assert_array_equal(dst.weight.getNumpyVersion(), before)
    # an object of another kind under the saved name
    model, opt = _build(0)
    with pytest.raises((gl.GadgetKeyError, gl.GadgetValueError, gl.GadgetTypeError)):
        gl.load_checkpoint(tmp_path / "c", {"emb": opt})


def test_load_checkpoint_closed_table_loads_nothing(adam_ckpt):
    model, opt = _trained_target()
    emb_before = model["emb"].weight.getNumpyVersion()
    model["bag"].weight.close()
    with pytest.raises(gl.GadgetClosedError):
        gl.load_checkpoint(adam_ckpt, {"model": model, "optimizer": opt})
    np.testing.assert_array_equal(model["emb"].weight.getNumpyVersion(), emb_before)


def test_load_checkpoint_verify_false_damaged_hdf5_still_raises(tmp_path):
    model, opt = _build(0, emb_rows=300, bag_rows=250)
    _train(model, opt, _batches(1, 300, 250))
    d = tmp_path / "c"
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="hdf5")
    victim = _table_files(d)[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    model2, opt2 = _build(1, emb_rows=300, bag_rows=250)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(d, {"model": model2, "optimizer": opt2}, verify=False)


def test_interrupted_save_by_keyboard_interrupt(tmp_path):
    import numpy.lib.format as npf

    model, opt = _build(0)
    _train(model, opt, _batches(2))
    first = _snapshot(model, opt)
    d = tmp_path / "c"
    gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    listing = sorted(p.name for p in d.iterdir())
    _train(model, opt, _batches(2, seed=8))
    calls = {"n": 0}
    orig = npf.write_array_header_1_0

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return orig(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(npf, "write_array_header_1_0", boom)
        with pytest.raises(KeyboardInterrupt):
            gl.save_checkpoint(d, {"model": model, "optimizer": opt})
    assert calls["n"] == 3
    assert sorted(p.name for p in d.iterdir()) == listing
    model2, opt2 = _build(3)
    gl.load_checkpoint(d, {"model": model2, "optimizer": opt2})
    _assert_same_snapshot(_snapshot(model2, opt2), first)


def _grouped(seed, layout="a"):
    torch.manual_seed(seed)
    model = nn.ModuleDict(
        {
            "emb": gl.OffloadedEmbedding(30, DIM, placement="cpu", device="cpu"),
            "bag": gl.OffloadedEmbeddingBag(25, DIM, mode="sum", placement="cpu", device="cpu"),
            "head": nn.Linear(DIM, 1),
        }
    )
    if layout == "a":
        groups = [
            {"params": model["emb"], "lr": 0.1},
            {"params": model["head"].parameters(), "lr": 0.01},
            model["bag"],
        ]
    else:
        groups = [{"params": model["emb"], "lr": 0.1}, model["bag"], model["head"]]
    return model, gl.OffloadedOptimizer(torch.optim.Adam, groups, lr=0.03)


def test_checkpoint_param_groups_resume_and_mismatch(tmp_path):
    batches = _batches(6)
    model_a, opt_a = _grouped(0)
    _train(model_a, opt_a, batches)
    ref = _snapshot(model_a, opt_a)
    model_b, opt_b = _grouped(0)
    _train(model_b, opt_b, batches[:2])
    gl.save_checkpoint(tmp_path / "c", {"model": model_b, "optimizer": opt_b})
    model_c, opt_c = _grouped(4)
    gl.load_checkpoint(tmp_path / "c", {"model": model_c, "optimizer": opt_c})
    assert [g["lr"] for g in opt_c.param_groups] == [g["lr"] for g in opt_b.param_groups]
    _train(model_c, opt_c, batches[2:])
    _assert_same_snapshot(_snapshot(model_c, opt_c), ref)
    # another grouping of the same model: refused, nothing changed
    model_d, opt_d = _grouped(4, layout="b")
    _train(model_d, opt_d, batches[:1])
    before = _snapshot(model_d, opt_d)
    with pytest.raises(gl.GadgetError):
        gl.load_checkpoint(tmp_path / "c", {"model": model_d, "optimizer": opt_d})
    _assert_same_snapshot(_snapshot(model_d, opt_d), before)
    with pytest.raises(gl.GadgetError):
        opt_d.load_state_dict(opt_b.state_dict())
    _assert_same_snapshot(_snapshot(model_d, opt_d), before)


@pytest.mark.parametrize("opt_name", ["rprop", "asgd", "adam"])
def test_checkpoint_before_first_step(tmp_path, opt_name):
    batches = _batches(4)
    model_a, opt_a = _build(0, opt_name)
    _train(model_a, opt_a, batches)
    ref = _snapshot(model_a, opt_a)
    model_b, opt_b = _build(0, opt_name)
    gl.save_checkpoint(tmp_path / "c", {"model": model_b, "optimizer": opt_b})
    model_c, opt_c = _build(8, opt_name)
    gl.load_checkpoint(tmp_path / "c", {"model": model_c, "optimizer": opt_c})
    _train(model_c, opt_c, batches)
    _assert_same_snapshot(_snapshot(model_c, opt_c), ref)


def test_resave_in_other_format_replaces_old_files(tmp_path):
    model, opt = _build(0)
    _train(model, opt, _batches(2))
    d = tmp_path / "c"
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="npy")
    _train(model, opt, _batches(1, seed=2))
    snap = _snapshot(model, opt)
    gl.save_checkpoint(d, {"model": model, "optimizer": opt}, format="zarr")
    names = sorted(p.name for p in d.iterdir())
    assert "meta.pt" in names
    assert all(n == "meta.pt" or n.endswith(".zarr") for n in names), names
    model2, opt2 = _build(1)
    gl.load_checkpoint(d, {"model": model2, "optimizer": opt2})
    _assert_same_snapshot(_snapshot(model2, opt2), snap)


def test_save_checkpoint_names_that_look_alike_do_not_mix(tmp_path):
    """ "m.emb" (a table) and "m" holding "emb": either refused (GadgetValueError, as the
    docstring says for names whose files would be named alike) or kept apart."""
    torch.manual_seed(0)
    inner = gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")
    outer = nn.ModuleDict({"emb": gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")})
    try:
        gl.save_checkpoint(tmp_path / "c", {"m.emb": inner, "m": outer})
    except gl.GadgetValueError:
        assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
        return
    a = gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")
    b = nn.ModuleDict({"emb": gl.OffloadedEmbedding(5, 2, placement="cpu", device="cpu")})
    gl.load_checkpoint(tmp_path / "c", {"m.emb": a, "m": b})
    np.testing.assert_array_equal(a.weight.getNumpyVersion(), inner.weight.getNumpyVersion())
    np.testing.assert_array_equal(
        b["emb"].weight.getNumpyVersion(), outer["emb"].weight.getNumpyVersion()
    )


class _SG(nn.Module):
    def __init__(self):
        super().__init__()
        self.u = nn.Embedding(10, 4)
        self.v = nn.Embedding(10, 4)

    def forward(self, c, p):
        return -nn.functional.logsigmoid((self.u(c) * self.v(p)).sum(-1)).mean()


def _switchers(seed):
    torch.manual_seed(seed)
    m = _SG()
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    us = gl.PytorchModelFactory(m.u, 50, 4, deviceType="cpu")
    vs = gl.PytorchModelFactory(m.v, 50, 4, deviceType="cpu")
    us.uniformDistributionInit(-0.1, 0.1)
    vs.uniformDistributionInit(-0.1, 0.1)
    uo = gl.PytorchOptimizerFactory(opt, 50, 4, m, "u", deviceType="cpu")
    vo = gl.PytorchOptimizerFactory(opt, 50, 4, m, "v", deviceType="cpu")
    uo.optInit()
    vo.optInit()
    return {"model": m, "u": us, "v": vs, "uo": uo, "vo": vo, "opt": opt}


def _switch_train(o, batches):
    for c, p in batches:
        lc = o["u"].beforeForwardPass(c)
        o["uo"].beforeForwardPass(c)
        lp = o["v"].beforeForwardPass(p)
        o["vo"].beforeForwardPass(p)
        loss = o["model"](lc, lp)
        o["opt"].zero_grad()
        loss.backward()
        o["opt"].step()
        o["u"].afterOptimizerStep(c)
        o["uo"].afterOptimizerStep(c)
        o["v"].afterOptimizerStep(p)
        o["vo"].afterOptimizerStep(p)


def _switch_snap(o):
    return {
        "u": o["u"].getNumpyVersion(),
        "v": o["v"].getNumpyVersion(),
        "uo": o["uo"].getNumpyVersion(),
        "vo": o["vo"].getNumpyVersion(),
        "steps": [float(s["step"]) for s in o["opt"].state_dict()["state"].values()],
    }


def test_switchers_checkpoint_resume_is_bit_identical(tmp_path):
    g = torch.Generator().manual_seed(4)
    batches = [
        (torch.randint(0, 50, (16,), generator=g), torch.randint(0, 50, (16,), generator=g))
        for _ in range(6)
    ]
    a = _switchers(0)
    _switch_train(a, batches)
    ref = _switch_snap(a)
    b = _switchers(0)
    _switch_train(b, batches[:3])
    with pytest.raises(gl.GadgetValueError):  # the model without its switchers
        gl.save_checkpoint(tmp_path / "bad", {"model": b["model"], "opt": b["opt"]})
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
    gl.save_checkpoint(tmp_path / "c", b, format="hdf5")
    c = _switchers(9)
    gl.load_checkpoint(tmp_path / "c", c)
    _equal(_switch_snap(c), _switch_snap(b))
    assert _switch_snap(c)["steps"] == [3.0, 3.0]
    _switch_train(c, batches[3:])
    _equal(_switch_snap(c), ref)


# ----------------------------------------------------------------------------------------
# 2. word2vec example
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(20)] + ["King", "queen", "KING"]
    toks = rng.choice(words, size=400)
    p = tmp_path_factory.mktemp("w2v") / "corpus.txt"
    lines = [" ".join(toks[i : i + 20]) for i in range(0, len(toks), 20)]
    p.write_text("\n".join(lines) + "\n")
    return p


def _expected_counts(path: Path) -> Counter:
    return Counter(t.lower() for t in path.read_text().split())


def test_word2vec_command_line_outputs(tmp_path, corpus):
    import fcntl
    import pty
    import struct
    import termios

    out = tmp_path / "vec"
    master, slave = pty.openpty()
    # a terminal of 100 columns (a fresh pty has 0, where tqdm draws no bar)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc = subprocess.run(
            [
                sys.executable, "-m", "datasets.word2vec", str(corpus),
                "--dim", "8", "--epochs", "2", "--batch-size", "128", "--lr", "0.05",
                "--placement", "cpu", "--device", "cpu",
                "--out", str(out), "--show", "king,nosuchword",
            ],
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=slave, timeout=120,
        )  # fmt: skip
        os.close(slave)
        slave = -1
        err = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            err += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    stdout = proc.stdout.decode()
    stderr = err.decode(errors="replace")
    assert proc.returncode == 0, stdout + stderr
    assert "Traceback" not in stderr
    # progress bar on the terminal (README: "progress bar"; default when stderr is a tty)
    assert re.search(r"\d+%\|", stderr) or "it/s" in stderr or "s/it" in stderr, stderr

    vec = np.load(f"{out}.npy")
    vocab_lines = Path(f"{out}.vocab.txt").read_text().splitlines()
    counts = _expected_counts(corpus)
    assert vec.shape == (len(counts), 8)
    assert np.isfinite(vec).all()
    words = [ln.split()[0] for ln in vocab_lines]
    got = {ln.split()[0]: int(ln.split()[1]) for ln in vocab_lines}
    assert got == dict(counts)  # lower-cased, with counts
    assert [got[w] for w in words] == sorted(got.values(), reverse=True)  # most frequent first

    # --show: neighbours of king by cosine of the saved vectors; the unknown word reported
    assert "nosuchword" in stdout
    line = next(ln for ln in stdout.splitlines() if ln.startswith("king"))
    shown = re.findall(r"(\w+) \((-?\d+\.\d+)\)", line.split(":", 1)[1])
    assert shown, line
    unit = vec / np.linalg.norm(vec, axis=1, keepdims=True)
    cos = unit @ unit[words.index("king")]
    for w, c in shown:
        assert w != "king"
        assert abs(cos[words.index(w)] - float(c)) <= 0.0051, (w, c, cos[words.index(w)])
    lowest = min(cos[words.index(w)] for w, _ in shown)
    others = [cos[i] for i, w in enumerate(words) if w not in {"king"} | {s for s, _ in shown}]
    assert max(others) <= lowest + 1e-5


def test_word2vec_python_api(tmp_path, corpus):
    from datasets import word2vec as w2v

    res = w2v.train(
        corpus, dim=6, epochs=2, batch_size=64, lr=0.05, placement="cpu", device="cpu",
        seed=3, progress=False,
    )  # fmt: skip
    counts = _expected_counts(corpus)
    assert len(res.vocab) == len(counts)
    assert len(res.losses) == 2 and all(np.isfinite(res.losses))
    vec = res.vectors()
    assert vec.shape == (len(counts), 6)
    res.save(tmp_path / "v")
    np.testing.assert_array_equal(np.load(tmp_path / "v.npy"), vec)
    assert (tmp_path / "v.vocab.txt").is_file()
    sim = res.most_similar("queen", k=4)
    assert len(sim) == 4
    words = list(res.vocab.words)
    unit = vec / np.linalg.norm(vec, axis=1, keepdims=True)
    cos = unit @ unit[words.index("queen")]
    for w, c in sim:
        assert w != "queen"
        assert abs(cos[words.index(w)] - c) < 1e-4
    assert [c for _, c in sim] == sorted((c for _, c in sim), reverse=True)


def test_word2vec_min_count_vocabulary(tmp_path):
    from datasets import word2vec as w2v

    p = tmp_path / "c.txt"
    p.write_text("The cat the DOG the cat\nbird cat The\n")
    vocab, ids = w2v.build_vocab(p, min_count=2)
    counts = Counter(t.lower() for t in p.read_text().split())
    kept = {w: c for w, c in counts.items() if c >= 2}
    assert dict(zip(vocab.words, (int(c) for c in vocab.counts), strict=True)) == kept
    assert list(vocab.counts) == sorted(vocab.counts, reverse=True)
    expect = [vocab.words.index(t.lower()) for t in p.read_text().split() if t.lower() in kept]
    assert list(np.asarray(ids)) == expect


def test_word2vec_missing_corpus_one_line_error(tmp_path):
    proc = _run(
        ["-m", "datasets.word2vec", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "v")]
    )
    assert proc.returncode != 0
    line = _no_traceback_one_line(proc.stderr)
    assert "missing.txt" in line
    assert not (tmp_path / "v.npy").exists()


@pytest.mark.parametrize(
    "case",
    ["empty", "one_word", "directory", "inf_lr", "negative_seed", "out_is_folder", "zero_dim"],
)
def test_word2vec_bad_arguments_one_line_errors(tmp_path, corpus, capsys, case):
    from datasets import word2vec as w2v

    args = [str(corpus)]
    if case == "empty":
        (tmp_path / "e.txt").write_text("  \n\n")
        args = [str(tmp_path / "e.txt")]
    elif case == "one_word":
        (tmp_path / "o.txt").write_text("Hello hello HELLO\nhello\n")
        args = [str(tmp_path / "o.txt")]
    elif case == "directory":
        args = [str(tmp_path)]
    elif case == "inf_lr":
        args += ["--lr", "inf"]
    elif case == "negative_seed":
        args += ["--seed", "-1"]
    elif case == "zero_dim":
        args += ["--dim", "0"]
    out = tmp_path / "vec"
    if case == "out_is_folder":
        (tmp_path / "folder").mkdir()
        out = tmp_path / "folder"
    args += ["--out", str(out), "--placement", "cpu", "--device", "cpu", "--no-progress"]
    try:
        rc = w2v.main(args)
    except SystemExit as e:
        rc = e.code
    assert rc not in (0, None)
    cap = capsys.readouterr()
    _no_traceback_one_line(cap.err)
    assert "loss" not in cap.out  # no training happened
    assert not Path(f"{out}.npy").exists()


# ----------------------------------------------------------------------------------------
# 3. the gadgetloader command line
# ----------------------------------------------------------------------------------------


def _cli(argv: list[str], capsys):
    try:
        rc = cli_main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_help_subprocess():
    proc = _run(["-m", "gadgetloader", "--help"])
    assert proc.returncode == 0
    for sub in ("info", "bench", "convert"):
        assert sub in proc.stdout


@pytest.mark.parametrize(
    ("argv", "must"),
    [
        (["info"], ["--json", "--no-measure"]),
        (
            ["convert"],
            ["--dataset", "--dst-dataset", "--chunk-rows", "--compression", "src", "dst"],
        ),
        (["bench"], ["seed", "sweep", "files", "pipeline", "train"]),
        (["bench", "seed"], ["--json", "--rows", "--ids"]),
        (["bench", "sweep"], ["--json"]),
        (["bench", "files"], ["--json", "--gb", "--dir"]),
        (["bench", "pipeline"], ["--json"]),
        (["bench", "train"], ["--json", "--fused"]),
    ],
)
def test_cli_subcommand_help(capsys, argv, must):
    rc, out, err = _cli([*argv, "--help"], capsys)
    assert rc == 0, err
    assert out.startswith("usage: gadgetloader " + " ".join(argv)), out[:200]
    for m in must:
        assert m in out, m


def test_cli_info_json(tmp_path):
    p = tmp_path / "info.json"
    proc = _run(["-m", "gadgetloader", "info", "--json", str(p)])
    assert proc.returncode == 0, proc.stderr
    info = json.loads(p.read_text())
    assert info["torch"] == torch.__version__
    assert info["numpy"] == np.__version__
    assert info["h5py"] == h5py.__version__
    assert info["zarr"] == zarr.__version__
    assert "gadgetloader" in info and "python" in info and "gpu" in info
    assert info["cuda_available"] is False
    assert "torch" in proc.stdout and torch.__version__ in proc.stdout


def _write_h5(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "int16", "int64", "uint8", "bool", "float16"]
)
def test_cli_convert_roundtrip_npy_h5_zarr_npy(tmp_path, capsys, dtype):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((23, 3, 2)) * 50).astype(dtype)
    np.save(tmp_path / "a.npy", a)
    rc, out, err = _cli(
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "a.h5"), "--chunk-rows", "7",
         "--compression", "gzip", "--dst-dataset", "emb", "--no-progress"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert len(out.strip().splitlines()) == 1  # one line
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert list(f) == ["emb"]
        ds = f["emb"]
        assert ds.chunks[0] == 7 and ds.compression == "gzip"
        np.testing.assert_array_equal(ds[()], a)
        assert ds.dtype == a.dtype
    rc, out, err = _cli(
        ["convert", str(tmp_path / "a.h5"), str(tmp_path / "a.zarr"), "--dataset", "emb",
         "--chunk-rows", "5", "--no-progress"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    z = zarr.open_group(str(tmp_path / "a.zarr"), mode="r")["emb"]
    assert z.chunks[0] == 5
    np.testing.assert_array_equal(z[...], a)
    rc, out, err = _cli(
        ["convert", str(tmp_path / "a.zarr"), str(tmp_path / "b.npy"), "--no-progress"], capsys
    )
    assert rc == 0, err
    b = np.load(tmp_path / "b.npy")
    assert b.dtype == a.dtype
    np.testing.assert_array_equal(b, a)


def test_cli_convert_dataset_options(tmp_path, capsys):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    other = np.ones((3, 2), dtype=np.int32)
    _write_h5(tmp_path / "d.h5", {"emb/words": a, "other": other})
    # --dataset picks the array; its name is kept by default (README example)
    rc, _, err = _cli(
        ["convert", str(tmp_path / "d.h5"), str(tmp_path / "e.zarr"), "--dataset", "emb/words",
         "--compression", "none", "--no-progress"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    g = zarr.open_group(str(tmp_path / "e.zarr"), mode="r")
    np.testing.assert_array_equal(g["emb/words"][...], a)
    # to HDF5 under another name
    rc, _, err = _cli(
        ["convert", str(tmp_path / "d.h5"), str(tmp_path / "f.h5"), "--dataset", "other",
         "--dst-dataset", "x", "--no-progress"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert list(f) == ["x"]
        np.testing.assert_array_equal(f["x"][()], other)
    # several datasets and none named, or a wrong name: an error listing the ones that exist
    for extra in ([], ["--dataset", "nope"]):
        rc, out, err = _cli(
            ["convert", str(tmp_path / "d.h5"), str(tmp_path / "g.npy"), *extra, "--no-progress"],
            capsys,
        )
        assert rc not in (0, None)
        line = _no_traceback_one_line(err)
        assert "emb/words" in line and "other" in line, line
        assert not (tmp_path / "g.npy").exists()


def test_cli_convert_bad_arguments(tmp_path, capsys):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "a.npy", a)
    cases = [
        ["convert", str(tmp_path / "missing.npy"), str(tmp_path / "o1.h5")],
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "o2.h5"), "--compression", "zstd"],
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "o3.zarr"), "--compression", "lzma9"],
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "o4.h5"), "--chunk-rows", "0"],
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "o5.h5"), "--chunk-rows", "x"],
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "a.npy")],
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "o6.parquet")],
        ["convert", str(tmp_path / "a.npy")],
    ]
    for argv in cases:
        rc, out, err = _cli([*argv, "--no-progress"], capsys)
        assert rc not in (0, None), argv
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("gadgetloader"), err
    for n in ("o1.h5", "o2.h5", "o3.zarr", "o4.h5", "o5.h5", "o6.parquet"):
        assert not (tmp_path / n).exists(), n
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), a)  # source untouched
    # the convert errors are one line (``run`` "prints one line and returns the exit status")
    rc, out, err = _cli(["convert", str(tmp_path / "missing.npy"), str(tmp_path / "o.h5")], capsys)
    assert "missing.npy" in _no_traceback_one_line(err)


@pytest.mark.parametrize("comp", ["default", "none", "gzip", "blosc", "zstd"])
def test_cli_convert_zarr_compression(tmp_path, capsys, comp):
    a = np.arange(300, dtype=np.float64).reshape(50, 6)
    np.save(tmp_path / "a.npy", a)
    extra = [] if comp == "default" else ["--compression", comp]
    rc, _, err = _cli(
        [
            "convert",
            str(tmp_path / "a.npy"),
            str(tmp_path / "a.zarr"),
            "--chunk-rows",
            "9",
            *extra,
            "--no-progress",
        ],
        capsys,
    )
    assert rc == 0, err
    z = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    np.testing.assert_array_equal(z[...], a)
    assert z.chunks[0] == 9
    names = " ".join(type(c).__name__.lower() for c in z.compressors)
    want = "zstd" if comp == "default" else comp
    if want == "none":
        assert z.compressors == ()
    else:
        assert want in names, names


def test_cli_convert_forced_formats_and_progress(tmp_path, capsys):
    a = np.arange(24, dtype=np.int32).reshape(8, 3)
    np.save(tmp_path / "a.npy", a)
    (tmp_path / "a.npy").rename(tmp_path / "table.bin")
    rc, _, err = _cli(
        ["convert", str(tmp_path / "table.bin"), str(tmp_path / "out.data"), "--format", "npy",
         "--to", "hdf5", "--dst-dataset", "t", "--progress"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "100%" in err or "|" in err, err  # --progress: always a bar, even for 8 rows
    with h5py.File(tmp_path / "out.data", "r") as f:
        np.testing.assert_array_equal(f["t"][()], a)
    rc, _, err = _cli(
        [
            "convert",
            str(tmp_path / "table.bin"),
            str(tmp_path / "o2.h5"),
            "--format",
            "npy",
            "--no-progress",
        ],
        capsys,
    )
    assert rc == 0 and "%" not in err, err


@pytest.mark.parametrize("case", ["zero_rows", "truncated", "object"])
def test_cli_convert_bad_sources_name_the_file(tmp_path, capsys, case):
    src = tmp_path / "s.npy"
    if case == "zero_rows":
        np.save(src, np.zeros((0, 3), dtype=np.float32))
    elif case == "truncated":
        np.save(src, np.arange(3000, dtype=np.float32).reshape(1000, 3))
        src.write_bytes(src.read_bytes()[:5000])
    else:
        np.save(src, np.array([["a", 1]], dtype=object), allow_pickle=True)
    rc, _, err = _cli(["convert", str(src), str(tmp_path / "d.h5"), "--no-progress"], capsys)
    assert rc not in (0, None)
    assert "s.npy" in _no_traceback_one_line(err)
    assert not (tmp_path / "d.h5").exists()


def test_cli_convert_replaces_destination_atomically(tmp_path, capsys):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "a.npy", a)
    old = np.full((2, 2), 7, dtype=np.int8)
    _write_h5(tmp_path / "d.h5", {"old": old, "keep": old})
    rc, _, err = _cli(
        ["convert", str(tmp_path / "a.npy"), str(tmp_path / "d.h5"), "--compression", "zstd"],
        capsys,
    )
    assert rc not in (0, None)
    with h5py.File(tmp_path / "d.h5", "r") as f:  # left as it was
        assert sorted(f) == ["keep", "old"]
        np.testing.assert_array_equal(f["old"][()], old)
    rc, _, err = _cli(
        [
            "convert",
            str(tmp_path / "a.npy"),
            str(tmp_path / "d.h5"),
            "--dst-dataset",
            "new",
            "--no-progress",
        ],
        capsys,
    )
    assert rc == 0, err
    with h5py.File(tmp_path / "d.h5", "r") as f:  # replaced as a whole
        assert list(f) == ["new"]
        np.testing.assert_array_equal(f["new"][()], a)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_cli_convert_refuses_destination_linked_to_source(tmp_path, capsys, link):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "a.npy", a)
    dst = tmp_path / "b.npy"
    if link == "symlink":
        dst.symlink_to(tmp_path / "a.npy")
    else:
        os.link(tmp_path / "a.npy", dst)
    rc, _, err = _cli(["convert", str(tmp_path / "a.npy"), str(dst), "--no-progress"], capsys)
    assert rc not in (0, None)
    _no_traceback_one_line(err)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), a)


def test_cli_bad_arguments_no_traceback(tmp_path, capsys):
    cases = [
        ["nosuchcommand"],
        ["bench", "nosuchsuite"],
        ["bench", "seed", "--rows", "-5"],
        ["bench", "seed", "--rows", "abc"],
        ["bench", "seed", "--dtype", "complex64"],
        ["bench", "files", "--formats", "parquet", "--mb", "1"],
        ["info", "--json", str(tmp_path / "no" / "dir" / "i.json")],
        ["info", "--json", str(tmp_path)],
        ["bench", "pipeline", "--width", "2"],
        ["bench", "train", "--methods", "nosuch"],
        ["bench", "files", "--mb", "1", "--dir", str(tmp_path / "nodir")],
        ["bench", "seed", "--repeats", "0"],
    ]
    for argv in cases:
        rc, out, err = _cli(argv, capsys)
        assert rc not in (0, None), argv
        assert "Traceback" not in err, argv
        assert "error" in err.strip().splitlines()[-1], (argv, err)
    # --json paths are checked before the run
    rc, out, err = _cli(
        [
            "bench",
            "seed",
            "--rows",
            "100",
            "--ids",
            "10",
            "--json",
            str(tmp_path / "no" / "x.json"),
        ],
        capsys,
    )
    assert rc not in (0, None)
    assert "gather" not in out and "benchmark" not in out
    assert "x.json" in err or str(tmp_path / "no") in err


def _bench(tmp_path: Path, suite: str, *args: str) -> tuple[dict, str]:
    p = tmp_path / f"{suite}.json"
    proc = _run(["-m", "gadgetloader", "bench", suite, *args, "--json", str(p)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(p.read_text()), proc.stdout


def test_bench_seed_cpu(tmp_path):
    d, out = _bench(
        tmp_path, "seed", "--rows", "1000", "--width", "8", "--ids", "256", "--repeats", "1"
    )
    assert d["rows"] == 1000 and d["width"] == 8 and d["ids"] == 256
    kinds = {r["kind"] for r in d["results"]}
    assert kinds == {"gather", "scatter"}
    assert all(r["check"] == "ok" for r in d["results"])
    assert any("gadgetloader" in r["method"] for r in d["results"])
    # README: without CUDA it "times the CPU methods and lists what it skipped"
    assert d["skipped"] and "skipped" in out


def test_bench_files_cpu(tmp_path):
    d, _ = _bench(
        tmp_path, "files", "--mb", "1", "--random-mb", "1", "--ids", "64", "--repeats", "1",
        "--dir", str(tmp_path),
    )  # fmt: skip
    assert d["checks_passed"] is True
    assert {r["format"] for r in d["load"]} == {"npy", "hdf5", "zarr"}
    assert all(r["checked"] for r in d["load"] + d["random"])
    # no --keep: the test files are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files.json"]


def test_bench_pipeline_cpu(tmp_path):
    d, _ = _bench(
        tmp_path, "pipeline", "--rows", "4096", "--width", "8", "--batch", "256", "--batches", "4",
        "--seconds", "0.2", "--repeats", "1", "--workers", "0", "--dir", str(tmp_path),
    )  # fmt: skip
    assert d["results"] and all(r["check"] == "ok" for r in d["results"])
    assert d["rows"] == 4096 and d["batch"] == 256


def test_bench_train_cpu(tmp_path):
    d, _ = _bench(
        tmp_path, "train", "--rows", "2000", "--dim", "8", "--batch", "64", "--negatives", "2",
        "--steps", "2", "--warmup", "1", "--repeats", "1", "--memcpy-mib", "1",
    )  # fmt: skip
    assert set(d["methods"]) >= {"gpu", "speedtorch", "switchers", "dropin", "resident"}
    assert d["verified"] and all(d["verified"].values())
    assert all(m["ms_per_step"] > 0 for m in d["methods"].values())


def test_bench_sweep_without_cuda_skips(tmp_path):
    d, out = _bench(tmp_path, "sweep", "--sizes-gb", "0.001", "--widths", "8", "--ids", "256")
    assert d["skipped"] and d["results"] == []
    assert "skipped" in out
