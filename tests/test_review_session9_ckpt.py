"""Review session 9, checkpoints: a damaged table file leaves every object as it was,
a failed save leaves no files of its own, object names stay inside the directory, and
bad arguments or a damaged ``meta.pt`` give Gadget* errors naming what was expected."""

from __future__ import annotations

import errno
import glob
import os

import numpy as np
import pytest
import torch
from torch import nn

import gadgetloader as gl
from gadgetloader import io as gl_io
from gadgetloader.gadget import DataGadget

N, D = 300, 4


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        init = torch.randn(N, D, generator=g)
        self.emb = gl.OffloadedEmbedding(
            N, D, placement="cpu", device="cpu", init=lambda t: t.copy_(init)
        )
        self.lin = nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids)).squeeze(-1)


def _build(seed: int, steps: int) -> tuple[Model, gl.OffloadedOptimizer]:
    torch.manual_seed(seed)
    m = Model(seed)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, N, (16,), generator=g)
        opt.zero_grad()
        m(ids).pow(2).sum().backward()
        opt.step()
    return m, opt


def _snapshot(m: Model, opt: gl.OffloadedOptimizer) -> list:
    out: list = [m.emb.table.getNumpyVersion().copy()]
    out += [v.detach().clone() for v in m.lin.parameters()]
    out += [t.getNumpyVersion().copy() for p in opt.pagers for t in p.tables.values()]
    out.append(repr(opt._inner_state_without_rows()))  # step counts, the Linear's state
    return out


def _same(a: list, b: list) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _table_file(d, part: str) -> str:
    (name,) = [f for f in os.listdir(d) if part in f]
    return os.path.join(d, name)


# ---- 1. a damaged table file leaves every object as it was ---------------------------------


@pytest.mark.skipif("zarr" not in gl_io.FORMATS, reason="zarr not installed")
def test_damaged_zarr_chunk_leaves_every_object_unchanged(tmp_path) -> None:
    m, opt = _build(0, 3)
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": opt}, format="zarr")
    # the last table loaded: the model and the first state table would go first
    path = _table_file(tmp_path / "ck", "exp_avg_sq")
    chunks = [c for c in glob.glob(path + "/c/**", recursive=True) if os.path.isfile(c)]
    with open(chunks[0], "r+b") as f:
        f.truncate(10)
    m2, opt2 = _build(1, 1)
    before = _snapshot(m2, opt2)
    with pytest.raises(gl.GadgetFileError, match="damaged or truncated"):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": opt2})
    assert _same(before, _snapshot(m2, opt2))
    # and the objects still train and load a good checkpoint afterwards
    gl.save_checkpoint(tmp_path / "ok", {"model": m, "optimizer": opt}, format="zarr")
    gl.load_checkpoint(tmp_path / "ok", {"model": m2, "optimizer": opt2})
    assert _same(_snapshot(m, opt), _snapshot(m2, opt2))


@pytest.mark.skipif("hdf5" not in gl_io.FORMATS, reason="h5py not installed")
def test_damaged_hdf5_chunk_leaves_every_object_unchanged(tmp_path) -> None:
    h5py = pytest.importorskip("h5py")
    m, opt = _build(0, 3)
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": opt}, format="hdf5")
    # rewrite the last state table compressed, then spoil one chunk's deflate stream
    path = _table_file(tmp_path / "ck", "exp_avg_sq")
    rows = DataGadget(gl_io.open_source(path, format="hdf5").shape, placement="cpu")
    rows.load(path, format="hdf5")
    rows.save(path, format="hdf5", compression="gzip", chunk_rows=50)
    with h5py.File(path, "r") as f:
        (ds,) = [f[k] for k in f]
        info = ds.id.get_chunk_info(ds.id.get_num_chunks() - 1)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset)
        f.write(b"\xff" * info.size)
    m2, opt2 = _build(1, 1)
    before = _snapshot(m2, opt2)
    with pytest.raises(gl.GadgetFileError):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": opt2})
    assert _same(before, _snapshot(m2, opt2))


@pytest.mark.skipif("zarr" not in gl_io.FORMATS, reason="zarr not installed")
def test_verify_false_skips_the_extra_read(tmp_path, monkeypatch) -> None:
    m, opt = _build(0, 2)
    gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": opt}, format="zarr")
    reads: list[str] = []
    real = gl_io.ZarrSource.read_into

    def counting(self, start, stop, out):
        reads.append(self.path)
        return real(self, start, stop, out)

    monkeypatch.setattr(gl_io.ZarrSource, "read_into", counting)
    m2, opt2 = _build(1, 0)
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": opt2}, verify=False)
    once = len(reads)
    reads.clear()
    gl.load_checkpoint(tmp_path / "ck", {"model": m2, "optimizer": opt2})
    assert len(reads) == 2 * once  # verified: each file read through once more
    assert _same(_snapshot(m, opt), _snapshot(m2, opt2))
    with pytest.raises(gl.GadgetTypeError, match="verify"):
        gl.load_checkpoint(tmp_path / "ck", {"model": m2}, verify="yes")  # type: ignore[arg-type]


# ---- 2. a save that fails part-way removes its own files -----------------------------------


def _files(d) -> dict[str, bytes]:
    out = {}
    for f in sorted(os.listdir(d)):
        with open(os.path.join(d, f), "rb") as fh:
            out[f] = fh.read()
    return out


def test_failed_table_save_removes_this_saves_files(tmp_path, monkeypatch) -> None:
    m, opt = _build(0, 2)
    d = tmp_path / "ck"
    gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    before = _files(d)
    real = DataGadget.save
    calls = [0]

    def flaky(self, *a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(self, *a, **k)

    monkeypatch.setattr(DataGadget, "save", flaky)
    with pytest.raises(OSError, match="No space left"):
        gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    monkeypatch.undo()
    assert _files(d) == before
    m2, opt2 = _build(1, 0)
    gl.load_checkpoint(d, {"model": m2, "optimizer": opt2})
    assert _same(_snapshot(m, opt), _snapshot(m2, opt2))


def test_failed_meta_save_removes_tables_and_tmp_meta(tmp_path, monkeypatch) -> None:
    m, opt = _build(0, 2)
    d = tmp_path / "ck"
    gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    before = _files(d)
    real = torch.save

    def bad_save(obj, f, *a, **k):
        if str(f).endswith("meta.pt.tmp"):
            with open(f, "wb") as fh:
                fh.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", bad_save)
    with pytest.raises(OSError, match="No space left"):
        gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    monkeypatch.undo()
    assert _files(d) == before
    m2, opt2 = _build(1, 0)
    gl.load_checkpoint(d, {"model": m2, "optimizer": opt2})
    assert _same(_snapshot(m, opt), _snapshot(m2, opt2))


def test_failed_first_save_leaves_an_empty_directory(tmp_path, monkeypatch) -> None:
    m, opt = _build(0, 1)
    real = DataGadget.save
    calls = [0]

    def flaky(self, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(DataGadget, "save", flaky)
    with pytest.raises(KeyboardInterrupt):
        gl.save_checkpoint(tmp_path / "ck", {"model": m, "optimizer": opt})
    assert os.listdir(tmp_path / "ck") == []


def test_interrupt_after_meta_replaced_keeps_the_new_checkpoint(tmp_path, monkeypatch) -> None:
    m, opt = _build(0, 2)
    d = tmp_path / "ck"
    gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    m, opt = _build(3, 2)
    real = os.replace

    def replace_then_interrupt(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if str(dst).endswith("meta.pt"):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        gl.save_checkpoint(d, {"model": m, "optimizer": opt})
    monkeypatch.undo()
    m2, opt2 = _build(1, 0)
    gl.load_checkpoint(d, {"model": m2, "optimizer": opt2})  # the new one, whole
    assert _same(_snapshot(m, opt), _snapshot(m2, opt2))


# ---- 3. object names ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../evil", "a/b", "..", ".", "", "a\\b", "a\0b", 3])
def test_unsafe_object_names_are_refused_before_writing(tmp_path, name) -> None:
    m = Model(0)
    d = tmp_path / "x" / "y" / "ck"
    # a name that is no str is an argument of the wrong kind
    err = gl.GadgetValueError if isinstance(name, str) else gl.GadgetTypeError
    with pytest.raises(err, match="object names") as info:
        gl.save_checkpoint(d, {name: m})
    assert repr(name) in str(info.value)
    assert list(tmp_path.rglob("*")) == []  # not even the directory
    gl.save_checkpoint(d, {"model": m})
    with pytest.raises(err, match="object names"):
        gl.load_checkpoint(d, {name: m})


def test_names_sharing_a_file_name_are_refused(tmp_path) -> None:
    # object "a" with table "b.emb.weight" and object "a.b" with table "emb.weight"
    inner = nn.Module()
    inner.b = Model(0)
    with pytest.raises(gl.GadgetValueError, match="share the file name"):
        gl.save_checkpoint(tmp_path / "ck", {"a": inner, "a.b": Model(1)})
    assert not (tmp_path / "ck").exists()


def test_meta_naming_files_outside_the_directory_is_refused(tmp_path) -> None:
    m = Model(0)
    d = tmp_path / "ck"
    gl.save_checkpoint(d, {"model": m})
    meta = torch.load(d / "meta.pt", weights_only=True)
    victim = tmp_path / "victim.npy"
    m.emb.table.save(victim)
    meta["objects"]["model"]["tables"]["emb.weight"] = "../victim.npy"
    torch.save(meta, d / "meta.pt")
    with pytest.raises(gl.GadgetFileError, match="damaged"):
        gl.load_checkpoint(d, {"model": Model(1)})
    gl.save_checkpoint(d, {"model": m})  # the old meta.pt's files are removed: never ../
    assert victim.exists()


# ---- 4. Gadget* errors instead of raw ones -----------------------------------------------------


def test_directory_that_is_a_file(tmp_path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(gl.GadgetFileError, match="existing file; expected a directory"):
        gl.save_checkpoint(f, {"model": Model(0)})
    assert f.read_text() == "x"
    with pytest.raises(gl.GadgetFileNotFoundError, match="it is a file"):
        gl.load_checkpoint(f, {"model": Model(0)})


@pytest.mark.parametrize("objects", [[Model(0)], None, (("model", 1),)])
def test_objects_must_be_a_mapping(tmp_path, objects) -> None:
    with pytest.raises(gl.GadgetTypeError, match="expected a mapping of names"):
        gl.save_checkpoint(tmp_path / "ck", objects)
    assert not (tmp_path / "ck").exists()
    gl.save_checkpoint(tmp_path / "ck", {"model": Model(0)})
    with pytest.raises(gl.GadgetTypeError, match="expected a mapping of names"):
        gl.load_checkpoint(tmp_path / "ck", objects)


@pytest.mark.parametrize(
    "entry",
    [
        {"kind": "module"},
        {"kind": "module", "tables": ["x"], "meta": {"state_dict": {}}},
        {"kind": "module", "tables": {"emb.weight": "x.npy"}, "meta": None},
        "module",
    ],
)
def test_damaged_meta_entry(tmp_path, entry) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    torch.save({"version": 1, "format": "npy", "objects": {"m": entry}}, d / "meta.pt")
    with pytest.raises(gl.GadgetFileError, match="damaged or was not written by save_checkpoint"):
        gl.load_checkpoint(d, {"m": Model(0)})


def test_damaged_meta_objects_and_format(tmp_path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    torch.save({"format": "npy", "objects": [1, 2]}, d / "meta.pt")
    with pytest.raises(gl.GadgetFileError, match="'objects' should map"):
        gl.load_checkpoint(d, {"m": Model(0)})
    torch.save({"format": "bogus", "objects": {}}, d / "meta.pt")
    with pytest.raises(gl.GadgetFileError, match="format is 'bogus'"):
        gl.load_checkpoint(d, {"m": Model(0)})


def test_plain_nadam_float64_resumes_bit_identically_through_a_checkpoint(tmp_path):
    # torch's load_state_dict casts NAdam's float32 mu_product to float64; the checkpoint
    # puts the saved dtype back, so the resumed run rounds as the uninterrupted one
    def build():
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 2).double()
        return lin, torch.optim.NAdam(lin.parameters(), lr=0.01)

    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def train(lin, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            (lin(x) ** 2).sum().backward()
            opt.step()

    full = build()
    train(*full, 6)
    part = build()
    train(*part, 3)
    gl.save_checkpoint(tmp_path / "ck", {"m": part[0], "o": part[1]})
    resumed = build()
    gl.load_checkpoint(tmp_path / "ck", {"m": resumed[0], "o": resumed[1]})
    train(*resumed, 3)
    assert torch.equal(resumed[0].weight, full[0].weight)
