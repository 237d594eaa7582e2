"""Session 27 review: README / SPEC promises checked on a CPU-only machine.

Written from README.md, SPEC.md and the docstrings only (not from the other tests).
Every test compares against a NumPy or plain-torch reference.

These tests read the README as a CPU-only machine (CI's) runs it: rows delivered to the
CPU, ``pinned`` falling back to ``cpu``. On a CUDA machine torch is told, for the length
of each test, that it has no GPU, so the library takes the same paths there too (its
processes started by the tests, DataLoader workers and the CLI, see the real machine).
The CUDA machine's behaviour is the behaviour suite's and the GPU review tests' to check.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import pickle
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, random_split

import gadgetloader as gl

REPO = Path(__file__).resolve().parents[1]
F = torch.nn.functional

pytestmark = pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning")


@pytest.fixture(autouse=True)
def _a_cpu_only_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch sees no GPU for the length of each test (see the module's docstring)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _h5py():
    return pytest.importorskip("h5py")


def _zarr():
    return pytest.importorskip("zarr")


def _digest(p: str | Path) -> str:
    p = Path(p)
    h = hashlib.sha256()
    if p.is_dir():
        for root, dirs, files in sorted(os.walk(p)):
            dirs.sort()
            for f in sorted(files):
                h.update(f.encode())
                h.update(Path(root, f).read_bytes())
    else:
        h.update(p.read_bytes())
    return h.hexdigest()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "gadgetloader", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---------------------------------------------------------------------------
# README code blocks, run as written (sizes shrunk where the README says so)
# ---------------------------------------------------------------------------


def test_readme_rows_in_and_out_block(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ref = np.random.default_rng(0).random((1000, 16), dtype=np.float32)
    np.save("embeddings.npy", ref)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        table = gl.DataGadget("embeddings.npy", CPUPinn=True)
    # CPU fallback warns once (README: "falls back with one warning")
    assert sum(issubclass(x.category, gl.FallbackWarning) for x in w) == 1
    assert table.placement == "cpu"
    ids = torch.randint(0, len(table), (4096,))
    rows = table.getData(ids)
    assert rows.shape == (4096, 16) and rows.dtype == torch.float32
    assert torch.equal(rows, torch.from_numpy(ref)[ids])
    table.insertData(rows * 0.5, ids)
    table.saveCupy("embeddings.npy")
    exp = ref.copy()
    u = np.unique(ids.numpy())
    exp[u] = ref[u] * np.float32(0.5)
    assert np.array_equal(np.load("embeddings.npy"), exp)


def test_readme_files_block(tmp_path, monkeypatch):
    h5py = _h5py()
    zarr = _zarr()
    monkeypatch.chdir(tmp_path)
    a = np.random.default_rng(1).random((500, 8), dtype=np.float32)
    np.save("emb.npy", a)
    with h5py.File("data.h5", "w") as f:
        f.create_dataset("emb/words", data=a)
        f.create_dataset("other", data=a[:10])
    zarr.save_array("emb.zarr", a)
    g = gl.DataGadget("emb.npy", CPUPinn=True)
    assert np.array_equal(g.getNumpyVersion(), a)
    g = gl.DataGadget("data.h5", dataset="emb/words", placement="pinned")
    assert np.array_equal(g.getNumpyVersion(), a)
    g = gl.DataGadget("emb.zarr", placement="cuda")
    assert np.array_equal(g.getNumpyVersion(), a)
    with h5py.File("big.h5", "w") as f:
        f.create_dataset("x", data=a, chunks=(64, 8), compression="gzip")
    g = gl.DataGadget("big.h5", placement="file", cache_bytes=2 << 30)
    ids = torch.tensor([5, 499, 0, 5])
    assert g.placement == "file"
    assert torch.equal(g.getData(ids), torch.from_numpy(a)[ids])


def test_readme_dataset_default_form_block(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    feat = np.random.default_rng(2).random((10000, 4), dtype=np.float32)
    np.save("features.npy", feat)
    labels = torch.arange(10000) % 7
    ds = gl.GadgetDataset("features.npy", labels)
    seen = []
    for x, y in DataLoader(ds, batch_size=4096, shuffle=True):
        assert x.dtype == torch.float32 and x.shape[1] == 4 and x.shape[0] == y.shape[0]
        seen.append(x)
    allx = torch.cat(seen).numpy()
    # every row exactly once, in some order
    order = np.lexsort(allx.T[::-1])
    ref_order = np.lexsort(feat.T[::-1])
    assert np.array_equal(allx[order], feat[ref_order])


def test_readme_fast_forms_block():
    x = torch.randn(10000, 4)
    y = torch.arange(10000)
    ds = gl.GadgetDataset(x, y)
    sampler = gl.GadgetSampler(ds, batch_size=4096, order="random", seed=0)
    for loader in (
        DataLoader(ds, batch_sampler=sampler),
        DataLoader(ds, sampler=sampler, batch_size=None),
        gl.GadgetLoader(ds, batch_size=4096, prefetch=2),
    ):
        xs, ys = zip(*[(b[0].clone(), b[1].clone()) for b in loader], strict=True)
        X, Y = torch.cat(xs), torch.cat(ys)
        assert torch.equal(Y.sort().values, y)
        assert torch.equal(X, x[Y])


def test_readme_dropin_block_small():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "item": gl.OffloadedEmbedding(5000, 16, placement="pinned"),
            "user": gl.OffloadedEmbeddingBag(1000, 16, mode="mean"),
            "head": torch.nn.Linear(16, 1),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.AdamW, model, lr=1e-3, weight_decay=0.01)
    item0 = model["item"].weight.getNumpyVersion()
    user0 = model["user"].weight.getNumpyVersion()
    head0 = model["head"].weight.detach().clone()
    items = torch.randint(0, 5000, (32,))
    history = torch.randint(0, 1000, (32, 5))
    y = torch.randn(32)
    pred = model["head"](model["item"](items) * model["user"](history)).squeeze(-1)
    loss = F.mse_loss(pred, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    item1 = model["item"].weight.getNumpyVersion()
    changed = np.nonzero((item1 != item0).any(1))[0]
    assert set(changed.tolist()) == set(items.unique().tolist())
    changed_u = np.nonzero((model["user"].weight.getNumpyVersion() != user0).any(1))[0]
    assert set(changed_u.tolist()) == set(history.unique().tolist())
    assert not torch.equal(head0, model["head"].weight)


class _SkipGram(torch.nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(n, d)
        self.v_embeddings = torch.nn.Embedding(n, d)

    def forward(self, c, p, n):
        u = self.u_embeddings(c)
        v = self.v_embeddings(p)
        vn = self.v_embeddings(n)
        pos = F.logsigmoid((u * v).sum(-1)).sum()
        neg = F.logsigmoid(-(u.unsqueeze(1) * vn).sum(-1)).sum()
        return -(pos + neg)


def test_readme_switchers_block_runs_and_trains():
    total_words = 300
    model = _SkipGram(10, 128)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = [
        (
            torch.randint(0, total_words, (16,)),
            torch.randint(0, total_words, (16,)),
            torch.randint(0, total_words, (16, 3)),
        )
        for _ in range(4)
    ]
    u_switch = gl.ModelFactory(model.u_embeddings, total_words, 128, CPUPinn=True)
    v_switch = gl.ModelFactory(model.v_embeddings, total_words, 128, CPUPinn=True)
    u_switch.uniformDistributionInit(-0.01, 0.01)
    v_switch.zerosInit()
    u0 = u_switch.getNumpyVersion()
    assert np.all(np.abs(u0) <= 0.01) and np.array_equal(
        v_switch.getNumpyVersion(), np.zeros((300, 128))
    )
    u_opt = gl.OptimizerFactory(optimizer, total_words, 128, model, "u_embeddings", CPUPinn=True)
    v_opt = gl.OptimizerFactory(optimizer, total_words, 128, model, "v_embeddings", CPUPinn=True)
    u_opt.optInit()
    v_opt.optInit()
    touched = set()
    for center, ctx, neg in batches:
        lcenter = u_switch.beforeForwardPass(center)
        u_opt.beforeForwardPass(center)
        lpos, lneg = v_switch.beforeForwardPass(ctx, neg)
        v_opt.beforeForwardPass(ctx, neg)
        loss = model(lcenter, lpos, lneg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_switch.afterOptimizerStep(center)
        u_opt.afterOptimizerStep(center)
        v_switch.afterOptimizerStep(ctx, neg)
        v_opt.afterOptimizerStep(ctx, neg)
        touched |= set(center.tolist())
    u1 = u_switch.getNumpyVersion()
    changed = set(np.nonzero((u1 != u0).any(1))[0].tolist())
    # rows outside the batches never move; v starts at zero, so only later steps move u
    assert changed and changed <= touched


def test_readme_cli_convert_block(tmp_path):
    h5py = _h5py()
    zarr = _zarr()
    a = np.random.default_rng(3).random((500, 8), dtype=np.float32)
    np.save(tmp_path / "emb.npy", a)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("emb/words", data=a)
    r = _cli(
        "convert",
        "emb.npy",
        "emb.h5",
        "--chunk-rows",
        "4096",
        "--compression",
        "gzip",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "emb.h5") as f:
        (name,) = list(f.keys())
        assert f[name].compression == "gzip"
        assert np.array_equal(f[name][:], a)
    r = _cli("convert", "data.h5", "emb.zarr", "--dataset", "emb/words", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(zarr.open_array(str(tmp_path / "emb.zarr"), path="emb/words")[:], a)
    assert np.array_equal(gl.DataGadget(str(tmp_path / "emb.zarr")).getNumpyVersion(), a)


def test_cli_convert_errors(tmp_path):
    h5py = _h5py()
    a = np.ones((20, 2), np.float32)
    np.save(tmp_path / "s.npy", a)
    with h5py.File(tmp_path / "ok.h5", "w") as f:
        f.create_dataset("grp/emb", data=a)
    os.link(tmp_path / "s.npy", tmp_path / "s_hard.npy")
    before = _digest(tmp_path / "s.npy")
    r = _cli("convert", "s.npy", "s.npy", cwd=tmp_path)
    assert r.returncode != 0 and "same file" in r.stderr
    r = _cli("convert", "s.npy", "s_hard.npy", cwd=tmp_path)
    assert r.returncode != 0 and "same file" in r.stderr
    assert _digest(tmp_path / "s.npy") == before
    r = _cli("convert", "missing.npy", "o.h5", cwd=tmp_path)
    assert r.returncode != 0 and "missing.npy" in r.stderr
    r = _cli("convert", "ok.h5", "o.npy", "--dataset", "nope", cwd=tmp_path)
    assert r.returncode != 0 and "grp/emb" in r.stderr
    assert not (tmp_path / "o.npy").exists()


@pytest.mark.parametrize(
    "suite",
    [
        ["seed", "--rows", "2000", "--width", "8", "--ids", "256", "--repeats", "1"],
        [
            "files",
            "--mb",
            "1",
            "--random-mb",
            "1",
            "--ids",
            "32",
            "--repeats",
            "1",
            "--formats",
            "npy,hdf5",
        ],
        [
            "pipeline",
            "--rows",
            "2048",
            "--width",
            "4",
            "--batch",
            "256",
            "--batches",
            "4",
            "--seconds",
            "0.1",
            "--repeats",
            "1",
            "--workers",
            "0",
        ],
        [
            "train",
            "--rows",
            "1000",
            "--dim",
            "8",
            "--batch",
            "32",
            "--negatives",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
        ],
    ],
    ids=lambda s: s[0],
)
def test_cli_bench_cpu_suites_tiny(tmp_path, suite):
    pytest.importorskip("h5py")
    out = tmp_path / "r.json"
    r = _cli("bench", *suite, "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.exists() and out.stat().st_size > 0
    assert "False" not in r.stdout.split("checked")[-1] if "checked" in r.stdout else True


def test_cli_info_and_bad_json_dir(tmp_path):
    r = _cli("info", cwd=tmp_path)
    assert r.returncode == 0 and "gadgetloader" in r.stdout and "torch" in r.stdout
    r = _cli("bench", "seed", "--json", str(tmp_path / "no" / "x.json"), cwd=tmp_path)
    assert r.returncode != 0


def test_word2vec_script_tiny(tmp_path):
    words = [
        "king",
        "queen",
        "man",
        "woman",
        "royal",
        "palace",
        "crown",
        "throne",
        "apple",
        "banana",
        "fruit",
        "eat",
    ]
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(300)) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-m", "datasets.word2vec", str(corpus), "--dim", "8", "--epochs", "1"]
        + ["--out", str(tmp_path / "vectors"), "--show", "king,nosuchword"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "nosuchword" in r.stdout
    vec = np.load(tmp_path / "vectors.npy")
    vocab = [line.split()[0] for line in (tmp_path / "vectors.vocab.txt").read_text().splitlines()]
    assert sorted(vocab) == sorted(words) and vec.shape == (len(words), 8)
    assert np.isfinite(vec).all()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "datasets.word2vec",
            str(tmp_path / "nope.txt"),
            "--out",
            str(tmp_path / "v"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "nope.txt" in r.stderr


# ---------------------------------------------------------------------------
# ids: kinds, shapes, dtypes and bad ids, on cpu and file tables
# ---------------------------------------------------------------------------


@pytest.fixture(params=["cpu", "file"])
def table(request, tmp_path):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    if request.param == "file":
        np.save(tmp_path / "t.npy", a)
        g = gl.DataGadget(str(tmp_path / "t.npy"), placement="file")
    else:
        g = gl.DataGadget(a.copy())
    yield g, a
    g.close()


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([], dtype=torch.int64),
        torch.tensor(3),
        torch.tensor([[1, 2], [3, 4]]),
        torch.tensor([1, 0, 1], dtype=torch.int32),
        torch.tensor([1, 0, 9], dtype=torch.uint8),
        torch.tensor([1, 0, 9], dtype=torch.int8),
        torch.tensor([1, 0, 9], dtype=torch.int16),
        torch.arange(10)[::3],
        torch.tensor([3]).expand(5),
        np.array([1, 2], dtype=np.uint64),
        np.array([1, 2], dtype=np.uint32),
        np.arange(10)[::-2],
        np.asfortranarray(np.array([[1, 2, 3], [4, 5, 6]])),
        [],
        [[1, 2], [3, 4]],
        [np.int32(1), np.int64(2)],
        range(2, 5),
        7,
        np.int64(3),
    ],
    ids=lambda v: (
        f"{type(v).__name__}-{getattr(v, 'dtype', '')}-{np.shape(v) if not isinstance(v, range) else 'r'}"
    ),
)
def test_getdata_id_kinds_shape_and_values(table, ids):
    g, a = table
    r = g.getData(ids)
    ref_ids = np.asarray(list(ids) if isinstance(ids, range) else ids, dtype=np.int64)
    if isinstance(ids, torch.Tensor):
        ref_ids = ids.to(torch.int64).numpy()
    exp = a[ref_ids]
    assert tuple(r.shape) == exp.shape
    assert r.dtype == torch.float32 and r.device.type == "cpu"
    assert np.array_equal(r.numpy(), exp)


def test_getdata_slices_and_tuple_indexes(table):
    g, a = table
    assert np.array_equal(g.getData(slice(2, 5)).numpy(), a[2:5])
    assert np.array_equal(g.getData(slice(-3, None)).numpy(), a[-3:])
    assert np.array_equal(g[::-1].numpy(), a[::-1])
    assert np.array_equal(g.getData((slice(0, 6), slice(0, 3))).numpy(), a[0:6, 0:3])
    assert np.array_equal(g[[1, 2], 0].numpy(), a[[1, 2], 0])
    assert np.array_equal(g[(1, 2)].numpy(), a[[1, 2]])
    with pytest.raises(gl.GadgetTypeError):
        g[([1], [2])]
    with pytest.raises(gl.GadgetValueError):
        g[[0], ::-1]
    with pytest.raises(gl.GadgetTypeError):
        g[[0], 0.5:2]


@pytest.mark.parametrize(
    "bad, exc",
    [
        (torch.tensor([-1]), gl.GadgetIndexError),
        (torch.tensor([10]), gl.GadgetIndexError),
        (torch.tensor([2**62]), gl.GadgetIndexError),
        (torch.tensor([-(2**63)]), gl.GadgetIndexError),
        ([1, -1], gl.GadgetIndexError),
        ([1, 2**70], gl.GadgetIndexError),
        (np.array([2**64 - 1], np.uint64), gl.GadgetIndexError),
        (torch.tensor([1.0]), gl.GadgetTypeError),
        (np.array([1.5]), gl.GadgetTypeError),
        (torch.tensor([True, False]), gl.GadgetTypeError),
        ([True, False], gl.GadgetTypeError),
        ("1", gl.GadgetTypeError),
        (None, gl.GadgetTypeError),
        ([[1, 2], [3]], gl.GadgetTypeError),
    ],
)
def test_bad_ids_raise_documented_errors_and_builtin(table, bad, exc):
    g, a = table
    with pytest.raises(exc) as ei:
        g.getData(bad)
    assert isinstance(ei.value, gl.GadgetError)
    builtin = IndexError if exc is gl.GadgetIndexError else TypeError
    assert isinstance(ei.value, builtin)
    with pytest.raises(exc):
        g.insertData(torch.zeros((2, 4)), bad)
    assert np.array_equal(g.getNumpyVersion(), a)
    # check_ids=False on CPU still checks (CPU ids are checked for free)
    if exc is gl.GadgetIndexError and isinstance(bad, torch.Tensor):
        with pytest.raises(gl.GadgetIndexError):
            g.getData(bad, check_ids=False)


def test_insertdata_bad_data_leaves_table_unchanged(table):
    g, a = table
    ids = torch.tensor([0, 1])
    cases = [
        (torch.ones(2, 4, dtype=torch.float64), gl.GadgetTypeError),
        (torch.ones(2, 3), gl.GadgetValueError),
        (torch.ones(3, 4), gl.GadgetValueError),
        (torch.ones(4), gl.GadgetValueError),
        (torch.tensor(1.0), gl.GadgetValueError),
    ]
    for data, exc in cases:
        with pytest.raises(exc) as ei:
            g.insertData(data, ids)
        assert "expected" in str(ei.value)
    assert np.array_equal(g.getNumpyVersion(), a)


def test_insertdata_forms_match_numpy(table):
    g, a = table
    exp = a.copy()
    g.insertData(torch.ones(4).expand(3, 4), torch.tensor([0, 1, 2]))
    exp[[0, 1, 2]] = 1
    data = np.arange(8, dtype=np.float32).reshape(2, 4)[::-1]
    g.insertData(data, torch.tensor([7, 8]))
    exp[[7, 8]] = data
    rg = torch.full((1, 4), 3.0, requires_grad=True)
    g.insertData(rg * 2, torch.tensor([9]))
    exp[9] = 6
    g.insertData(torch.ones(0, 4), torch.tensor([], dtype=torch.long))
    g.insertData(torch.full((2, 2, 4), 5.0), torch.tensor([[3, 4], [5, 6]]))
    exp[[3, 4, 5, 6]] = 5
    g.insertData(torch.full((6, 2), -5.0), (slice(0, 6), slice(1, 3)))
    exp[0:6, 1:3] = -5
    g[[1, 2], 0] = torch.tensor([100.0, 200.0])
    exp[[1, 2], 0] = [100, 200]
    g[0:10:3] = torch.full((4, 4), 42.0)
    exp[0:10:3] = 42
    # repeated ids: the last occurrence wins
    g.insertData(torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4]), torch.tensor([5, 5, 5]))
    exp[5] = 3
    assert np.array_equal(g.getNumpyVersion(), exp)


def test_overlapping_writes_follow_numpy():
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    g = gl.DataGadget(a.copy())
    v = g.as_tensor()
    before = g.getNumpyVersion()
    g.insertData(v[0:3], torch.tensor([1, 2, 3]))
    exp = before.copy()
    exp[[1, 2, 3]] = before[0:3]
    assert np.array_equal(g.getNumpyVersion(), exp)
    before = g.getNumpyVersion()
    g.getData(torch.tensor([4, 5]), out=v[5:7])
    exp = before.copy()
    exp[5:7] = before[[4, 5]]
    assert np.array_equal(g.getNumpyVersion(), exp)


def test_out_argument_checks(table):
    g, a = table
    o = torch.empty(2, 4)
    g.getData(torch.tensor([1, 2]), out=o)
    assert np.array_equal(o.numpy(), a[[1, 2]])
    with pytest.raises(gl.GadgetValueError):
        g.getData(torch.tensor([1, 2]), out=torch.empty(3, 4))
    with pytest.raises(gl.GadgetTypeError):
        g.getData(torch.tensor([1, 2]), out=torch.empty(2, 4, dtype=torch.float64))
    with pytest.raises(gl.GadgetValueError):
        g.getData(torch.tensor([1, 2]), out=torch.empty(4, 2).t())


@pytest.mark.parametrize(
    "dt",
    [
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    ],
)
def test_every_table_dtype_round_trips_all_formats(tmp_path, dt):
    pytest.importorskip("h5py")
    pytest.importorskip("zarr")
    t = (torch.randn(50, 3) * 50).to(dt)
    g = gl.DataGadget(t)
    assert g.dtype == dt
    ids = torch.tensor([49, 0, 7, 7])
    assert torch.equal(g.getData(ids), t[ids])
    for ext in ("npy", "h5", "zarr"):
        p = str(tmp_path / f"rt.{ext}")
        if ext == "npy" and dt == torch.bfloat16:
            with pytest.raises(gl.GadgetTypeError):
                g.save(p)
            assert not os.path.exists(p)
            continue
        if ext == "npy":
            g.save(p)
        else:
            g.save(p, chunk_rows=7)
        for pl in ("cpu", "file"):
            b = gl.DataGadget(p, placement=pl)
            assert b.dtype == dt
            r = b.getData(torch.arange(50))
            assert torch.equal(r.view(torch.uint8), t.view(torch.uint8))
            b.close()


def test_one_d_and_width_one_tables(tmp_path):
    lab = gl.DataGadget(np.arange(10, dtype=np.int64))
    assert lab.shape == (10,)
    assert torch.equal(lab.getData(torch.tensor([1, 2])), torch.tensor([1, 2]))
    r = lab.getData(torch.tensor(3))
    assert r.shape == () and r.item() == 3
    lab.insertData(torch.tensor([7, 8]), torch.tensor([0, 1]))
    with pytest.raises(gl.GadgetTypeError):
        lab.insertData(torch.tensor([7, 8], dtype=torch.int32), torch.tensor([0, 1]))
    assert np.array_equal(lab.getNumpyVersion(), np.array([7, 8, 2, 3, 4, 5, 6, 7, 8, 9]))
    w1 = gl.DataGadget(np.arange(5, dtype=np.float32).reshape(5, 1))
    assert w1.getData([4]).shape == (1, 1) and w1.getData([4]).item() == 4
    lab.save(str(tmp_path / "lab.npy"))
    f = gl.DataGadget(str(tmp_path / "lab.npy"), placement="file")
    assert f.getData(torch.tensor(1)).item() == 8
    f.insertData(torch.tensor(-3), torch.tensor(2))
    f.close()
    assert np.load(tmp_path / "lab.npy")[2] == -3


def test_dtype_names_and_constructors():
    assert gl.DataGadget((2, 3), dtype="float").dtype == torch.float32
    assert gl.DataGadget((2, 3), dtype="int").dtype == torch.int32
    assert gl.DataGadget((2, 3), dtype="byte").dtype == torch.uint8
    assert gl.DataGadget((2, 3), dtype="char").dtype == torch.int8
    assert gl.DataGadget((2, 3), dtype=float).dtype == torch.float64
    assert gl.DataGadget((2, 3), dtype=int).dtype == torch.int64
    assert gl.DataGadget((2, 3), dtype=bool).dtype == torch.bool
    assert gl.DataGadget((2, 3), dtype=np.dtype("int16")).dtype == torch.int16
    g = gl.DataGadget([[1, 2], [3, 4]])
    assert g.dtype == torch.int64 and np.array_equal(g.getNumpyVersion(), [[1, 2], [3, 4]])
    assert gl.DataGadget(None, shape=(3, 2)).shape == (3, 2)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((7, 3), CPUPinn="False")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((2, 3), dtype="float8")
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget((4, 2), placement="gpu")
    assert "pinned" in str(ei.value)
    with pytest.raises(gl.GadgetKeyError):
        gl.DataGadget((4, 2), strategy="magic")
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.ones(5, np.complex64))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget(np.arange(5, dtype=np.uint16))
    assert gl.DataGadget(np.arange(5, dtype=np.uint16), dtype="int32").dtype == torch.int32


def test_initialisers_ranges():
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget((2, 3), dtype="uint8").fill_(300)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget((2, 3), dtype="float32").fill_(1e39)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget((2, 3), dtype="bool").fill_(2)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget((2, 3), dtype="int32").fill_(1.5)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget((2, 3), dtype="float16").uniform_(-60000, 60000)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget((2, 3)).normal_(0, -1)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget((2, 3)).init_(3)
    g = gl.DataGadget((2, 3), dtype="float16").fill_(float("inf"))
    assert torch.isinf(g.getData(slice(0, 2))).all()
    g = gl.DataGadget((200, 30)).uniform_(-0.5, 0.25)
    v = g.getNumpyVersion()
    assert v.min() >= -0.5 and v.max() <= 0.25
    g = gl.DataGadget((20, 30)).init_(torch.nn.init.xavier_uniform_)
    bound = (6 / (20 + 30)) ** 0.5
    assert np.abs(g.getNumpyVersion()).max() <= bound


def test_numpy_protocol_and_as_tensor(tmp_path):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    g = gl.DataGadget(a.copy())
    c = np.asarray(g)
    c[0, 0] = -1
    assert g.getData(0)[0].item() == 0
    v = np.asarray(g, copy=False)
    v[0, 0] = 99
    assert g.getData(0)[0].item() == 99
    t = g.as_tensor()
    t[1] = 7
    assert g.getData(1).tolist() == [7.0] * 4
    np.save(tmp_path / "a.npy", a)
    f = gl.DataGadget(str(tmp_path / "a.npy"), placement="file")
    assert np.array_equal(np.asarray(f), a)
    with pytest.raises(ValueError):
        np.asarray(f, copy=False)
    with pytest.raises(gl.GadgetTypeError):
        f.as_tensor()


# ---------------------------------------------------------------------------
# close() / closed stores
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_closed_store_raises_but_metadata_answers(tmp_path, placement):
    np.save(tmp_path / "c.npy", np.ones((4, 2), np.float32))
    with gl.DataGadget(str(tmp_path / "c.npy"), placement=placement) as g:
        assert g.getData([0]).shape == (1, 2)
    assert g.shape == (4, 2) and g.dtype == torch.float32 and len(g) == 4
    assert "closed" in repr(g)
    calls = [
        lambda: g.getData([0]),
        lambda: g.insertData(torch.zeros(1, 2), [0]),
        lambda: g.load(str(tmp_path / "c.npy")),
        lambda: g.flush(),
        lambda: g.save(str(tmp_path / "d.npy")),
        lambda: g.getNumpyVersion(),
        lambda: g.fill_(1),
        lambda: np.asarray(g),
        lambda: g[0],
    ]
    for call in calls:
        with pytest.raises(gl.GadgetClosedError):
            call()
    g.close()  # a second close is harmless
    assert not (tmp_path / "d.npy").exists()


# ---------------------------------------------------------------------------
# Files: errors, atomic saves, formats
# ---------------------------------------------------------------------------


def test_file_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = np.random.default_rng(4).random((100, 8), dtype=np.float32)
    np.save("good.npy", a)
    b = Path("good.npy").read_bytes()
    Path("trunc.npy").write_bytes(b[:-10])
    for pl in ("cpu", "file"):
        with pytest.raises(gl.GadgetFileError) as ei:
            gl.DataGadget("trunc.npy", placement=pl)
        assert "trunc.npy" in str(ei.value) and "truncated" in str(ei.value)
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.DataGadget("nope.npy")
    with pytest.raises(FileNotFoundError):
        gl.DataGadget("nope.npy")
    Path("garbage.npy").write_bytes(b"hello world garbage" * 10)
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget("garbage.npy")
    np.save("obj.npy", np.array([object(), 1], dtype=object), allow_pickle=True)
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget("obj.npy")
    np.save("str.npy", np.array(["a", "b"]))
    with pytest.raises(gl.GadgetTypeError):
        gl.DataGadget("str.npy")
    np.save("zero.npy", np.ones((0, 3), np.float32))
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.DataGadget("zero.npy")
    assert "zero.npy" in str(ei.value)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(np.ones((0, 3), np.float32)).save("zero2.npy")
    assert not Path("zero2.npy").exists()
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.DataGadget(b"good.npy")
    assert "fsdecode" in str(ei.value)
    g = gl.DataGadget((4, 2))
    for call in (g.save, g.load, g.saveCupy):
        with pytest.raises(gl.GadgetTypeError):
            call(None)


def test_dataset_names(tmp_path):
    h5py = _h5py()
    zarr = _zarr()
    a = np.ones((5, 2), np.float32)
    p = tmp_path / "d.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("emb/words", data=a)
        f.create_dataset("other", data=a)
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(str(p), dataset="nope")
    assert "emb/words" in str(ei.value) and "other" in str(ei.value)
    with pytest.raises(gl.GadgetKeyError):
        gl.DataGadget(str(p))
    assert np.array_equal(gl.DataGadget(str(p), dataset="emb/words").getNumpyVersion(), a)
    zp = str(tmp_path / "g.zarr")
    grp = zarr.open_group(zp, mode="w")
    grp.create_array("x", shape=(5, 2), dtype="f4")[:] = a
    grp.create_array("y", shape=(5, 2), dtype="f4")[:] = a * 2
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.DataGadget(zp, dataset="z")
    assert "x" in str(ei.value) and "y" in str(ei.value)
    assert np.array_equal(gl.DataGadget(zp, dataset="y").getNumpyVersion(), a * 2)
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(a).save(str(tmp_path / "x.h5"), dataset="a/../b")
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(a).save(str(tmp_path / "x.zarr"), dataset="./b")


@pytest.mark.parametrize("ext", ["npy", "h5", "zarr"])
def test_save_is_atomic_when_the_writer_fails_midway(tmp_path, ext):
    from gadgetloader.io import _hdf5, _npy, _zarr

    if ext != "npy":
        pytest.importorskip("h5py" if ext == "h5" else "zarr")
    cls = {"npy": _npy.NpySink, "h5": _hdf5.Hdf5Sink, "zarr": _zarr.ZarrSink}[ext]
    old = np.arange(2000 * 8, dtype=np.float32).reshape(2000, 8)
    p = str(tmp_path / f"t.{ext}")
    gl.DataGadget(old).save(p)
    d0 = _digest(p)
    orig = cls.write

    def failing(self, start, rows):
        orig(self, start, rows)  # part of the new data is written ...
        raise OSError(28, "No space left on device (simulated)")  # ... then the disk fills

    cls.write = failing
    try:
        with pytest.raises(OSError):
            gl.DataGadget(-old).save(p)
    finally:
        cls.write = orig
    assert _digest(p) == d0
    assert sorted(os.listdir(tmp_path)) == [f"t.{ext}"]  # partial file removed
    assert np.array_equal(gl.DataGadget(p).getNumpyVersion(), old)


def test_save_keeps_mode_symlink_and_hardlinks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = np.random.default_rng(5).random((100, 4), dtype=np.float32)
    np.save("t.npy", a)
    os.chmod("t.npy", 0o640)
    gl.DataGadget(-a).save("t.npy")
    assert os.stat("t.npy").st_mode & 0o777 == 0o640
    os.symlink("t.npy", "link.npy")
    gl.DataGadget(a).save("link.npy")
    assert os.path.islink("link.npy") and np.array_equal(np.load("t.npy"), a)
    os.link("t.npy", "hard.npy")
    gl.DataGadget(-a).save("t.npy")
    assert np.array_equal(np.load("hard.npy"), a) and np.array_equal(np.load("t.npy"), -a)
    os.mkdir("d.npy")
    with pytest.raises(gl.GadgetFileError):
        gl.DataGadget(a).save("d.npy")
    with pytest.raises(gl.GadgetFileNotFoundError):
        gl.DataGadget(a).save("nodir/x.npy")


def test_save_options_and_bfloat16_layout(tmp_path):
    h5py = _h5py()
    zarr = _zarr()
    a = np.random.default_rng(6).random((100, 4), dtype=np.float32)
    gl.DataGadget(a).save(
        str(tmp_path / "ok.h5"), dataset="grp/emb", chunk_rows=16, compression="gzip"
    )
    with h5py.File(tmp_path / "ok.h5") as f:
        assert f["grp/emb"].chunks == (16, 4) and f["grp/emb"].compression == "gzip"
        assert np.array_equal(f["grp/emb"][:], a)
    with pytest.raises(gl.GadgetKeyError):
        gl.DataGadget(a).save(str(tmp_path / "bad.h5"), compression="zstd")
    with pytest.raises(gl.GadgetKeyError):
        gl.DataGadget(a).save(str(tmp_path / "bad.zarr"), compression="lzf")
    gl.DataGadget(a).save(str(tmp_path / "z.zarr"), compression="none", chunk_rows=10)
    z = zarr.open_array(str(tmp_path / "z.zarr"))
    assert z.chunks == (10, 4) and np.array_equal(z[:], a)
    bf = torch.randn(10, 3).to(torch.bfloat16)
    gl.DataGadget(bf).save(str(tmp_path / "bf.h5"))
    with h5py.File(tmp_path / "bf.h5") as f:
        (k,) = list(f.keys())
        assert f[k].dtype == np.uint16
        assert np.array_equal(f[k][:], bf.view(torch.int16).numpy().view(np.uint16))


def test_uint32_file_conversion(tmp_path):
    p = str(tmp_path / "u32.npy")
    np.save(p, np.array([16777217, 5, 2**32 - 1], dtype=np.uint32))
    r = gl.DataGadget(p, dtype="float32").getNumpyVersion()
    assert np.array_equal(r, np.array([16777216, 5, 2**32], dtype=np.float32))
    assert np.array_equal(
        gl.DataGadget(p, dtype="int64").getNumpyVersion(), [16777217, 5, 2**32 - 1]
    )
    with pytest.raises(gl.GadgetValueError):
        gl.DataGadget(p, dtype="int32")
    for kw in ({}, {"placement": "file"}):
        with pytest.raises(gl.GadgetTypeError) as ei:
            gl.DataGadget(p, **kw)
        assert "dtype=" in str(ei.value)
    g = gl.DataGadget((3,), dtype="int64")
    with pytest.raises(gl.GadgetTypeError):
        g.load(p)
    assert np.array_equal(g.getNumpyVersion(), np.zeros(3))


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_fortran_order_and_big_endian_npy(tmp_path, placement):
    a = (np.random.default_rng(7).random((64, 3)) * 100).astype(np.float32)
    a3 = np.random.default_rng(8).random((6, 3, 2))
    np.save(tmp_path / "fort.npy", np.asfortranarray(a))
    np.save(tmp_path / "f3.npy", np.asfortranarray(a3))
    np.save(tmp_path / "be.npy", a.astype(">f4"))
    ids = torch.tensor([0, 63, 7, 7])
    g = gl.DataGadget(str(tmp_path / "fort.npy"), placement=placement)
    assert np.array_equal(g.getData(ids).numpy(), a[ids.numpy()])
    g3 = gl.DataGadget(str(tmp_path / "f3.npy"), placement=placement)
    assert g3.shape == (6, 3, 2) and np.array_equal(
        g3.getData(torch.tensor([5, 1])).numpy(), a3[[5, 1]]
    )
    if placement == "file":
        with pytest.raises(gl.ReadOnlyError) as ei:
            g.insertData(torch.zeros(1, 3), torch.tensor([0]))
        assert "Fortran" in str(ei.value)
        assert np.array_equal(np.load(tmp_path / "fort.npy"), a)
    be = gl.DataGadget(str(tmp_path / "be.npy"), placement=placement)
    assert be.dtype == torch.float32 and np.array_equal(be.getData(ids).numpy(), a[ids.numpy()])
    if placement == "file":
        be.insertData(torch.full((1, 3), 5.0), torch.tensor([2]))
        be.close()
        back = np.load(tmp_path / "be.npy")
        exp = a.copy()
        exp[2] = 5
        assert np.array_equal(back, exp)


def test_zarr_v3_sharded_v2_and_odd_chunks_read_and_write(tmp_path):
    zarr = _zarr()
    a = np.random.default_rng(9).random((1000, 6), dtype=np.float32)
    paths = {}
    z = zarr.create_array(
        str(tmp_path / "sh.zarr"), shape=a.shape, dtype=a.dtype, chunks=(10, 3), shards=(100, 6)
    )
    z[:] = a
    paths["sh"] = tmp_path / "sh.zarr"
    z = zarr.create_array(
        str(tmp_path / "v2.zarr"), shape=a.shape, dtype=a.dtype, chunks=(64, 6), zarr_format=2
    )
    z[:] = a
    paths["v2"] = tmp_path / "v2.zarr"
    z = zarr.create_array(
        str(tmp_path / "c3.zarr"), shape=a.shape, dtype=a.dtype, chunks=(7, 4), compressors=None
    )
    z[:] = a
    paths["c3"] = tmp_path / "c3.zarr"
    ids = torch.tensor([999, 0, 5, 5, 500, 123])
    rows = torch.randn(3, 6)
    wid = torch.tensor([1, 998, 450])
    for p in paths.values():
        for pl in ("cpu", "file"):
            g = gl.DataGadget(str(p), placement=pl)
            assert torch.equal(g.getData(ids), torch.from_numpy(a)[ids])
            if pl == "file":
                g.insertData(rows, wid)
                g.close()
                exp = a.copy()
                exp[wid.numpy()] = rows.numpy()
                assert np.array_equal(zarr.open_array(str(p))[:], exp)


def test_file_table_detects_replacement_and_shares_writes(tmp_path):
    h5py = _h5py()
    a = np.random.default_rng(10).random((100, 4), dtype=np.float32)
    p = str(tmp_path / "r.npy")
    np.save(p, a)
    ft = gl.DataGadget(p, placement="file")
    ft.getData([0])
    gl.DataGadget(-a).save(p)
    with pytest.raises(gl.GadgetFileError):
        ft.getData([0])
    p2 = str(tmp_path / "r2.npy")
    np.save(p2, a)
    ft2 = gl.DataGadget(p2, placement="file")
    os.remove(p2)
    with pytest.raises(gl.GadgetFileError):
        ft2.getData([1])
    p3 = str(tmp_path / "s.npy")
    np.save(p3, a)
    f1 = gl.DataGadget(p3, placement="file")
    f2 = gl.DataGadget(p3, placement="file")
    f1.getData([3])
    f2.getData([3])
    f1.insertData(torch.zeros(1, 4), torch.tensor([3]))
    assert torch.equal(f2.getData([3]), torch.zeros(1, 4))
    p4 = str(tmp_path / "c.h5")
    with h5py.File(p4, "w") as f:
        f.create_dataset("x", data=a, chunks=(8, 4), compression="gzip")
    c1 = gl.DataGadget(p4, placement="file")
    c2 = gl.DataGadget(p4, placement="file")
    c1.getData([3])
    c2.getData([3])
    c1.insertData(torch.ones(2, 4), torch.tensor([3, 99]))
    assert torch.equal(c2.getData([3, 99]), torch.ones(2, 4))
    c1.close()
    c2.close()
    exp = a.copy()
    exp[[3, 99]] = 1
    with h5py.File(p4) as f:
        assert np.array_equal(f["x"][:], exp)


def test_read_only_file_tables(tmp_path):
    p = str(tmp_path / "g.npy")
    a = np.ones((5, 2), np.float32)
    np.save(p, a)
    ro = gl.DataGadget(p, placement="file", writable=False)
    with pytest.raises(gl.ReadOnlyError):
        ro.insertData(torch.zeros(1, 2), torch.tensor([0]))
    with pytest.raises(PermissionError):
        ro.insertData(torch.zeros(1, 2), torch.tensor([0]))
    for bad in (1, "no"):
        with pytest.raises(gl.GadgetTypeError):
            gl.DataGadget(p, placement="file", writable=bad)
    assert np.array_equal(np.load(p), a)


def test_file_table_threads(tmp_path):
    h5py = _h5py()
    a = np.random.default_rng(11).random((2000, 8), dtype=np.float32)
    np.save(tmp_path / "th.npy", a)
    with h5py.File(tmp_path / "th.h5", "w") as f:
        f.create_dataset("x", data=a, chunks=(16, 8), compression="gzip")
    for p in ("th.npy", "th.h5"):
        g = gl.DataGadget(str(tmp_path / p), placement="file", cache_bytes=4096)
        errs = []

        def work(seed, g=g, errs=errs):
            rng = np.random.default_rng(seed)
            for _ in range(100):
                ids = rng.integers(0, 2000, 64)
                if not np.array_equal(g.getData(torch.from_numpy(ids)).numpy(), a[ids]):
                    errs.append(seed)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs


def test_missing_dependency_error_names_extra(tmp_path):
    code = (
        "import sys; sys.modules['h5py'] = None; sys.modules['zarr'] = None\n"
        "import numpy as np, gadgetloader as gl\n"
        "for p, extra in [('x.h5', 'hdf5'), ('x.zarr', 'zarr')]:\n"
        "    try:\n"
        "        gl.DataGadget(np.ones((3, 2))).save(p)\n"
        "    except gl.MissingDependencyError as e:\n"
        "        assert isinstance(e, ImportError) and f'gadgetloader[{extra}]' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_error_hierarchy():
    pairs = {
        "GadgetIndexError": IndexError,
        "GadgetTypeError": TypeError,
        "GadgetValueError": ValueError,
        "GadgetKeyError": KeyError,
        "GadgetFileNotFoundError": FileNotFoundError,
        "GadgetFileError": OSError,
        "ReadOnlyError": PermissionError,
        "MissingDependencyError": ImportError,
    }
    for name, builtin in pairs.items():
        cls = getattr(gl, name)
        assert issubclass(cls, gl.GadgetError) and issubclass(cls, builtin)
    assert issubclass(gl.GadgetClosedError, gl.GadgetError)


# ---------------------------------------------------------------------------
# pickling and DataLoader workers
# ---------------------------------------------------------------------------


def test_pickling_gadgets(tmp_path):
    a = np.random.default_rng(12).random((50, 3), dtype=np.float32)
    c = gl.DataGadget(a)
    c2 = pickle.loads(pickle.dumps(c))
    assert np.array_equal(c2.getNumpyVersion(), a)
    c2.insertData(torch.zeros(1, 3), torch.tensor([0]))
    assert np.array_equal(c.getNumpyVersion(), a)  # by value
    np.save(tmp_path / "w.npy", a)
    f = gl.DataGadget(str(tmp_path / "w.npy"), placement="file")
    f2 = pickle.loads(pickle.dumps(f))
    assert f2.placement == "file"
    assert torch.equal(f2.getData([3, 49]), torch.from_numpy(a[[3, 49]]))


@pytest.mark.parametrize("ext", ["npy", "h5", "zarr"])
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_workers_with_file_backed_columns(tmp_path, ext, ctx):
    n = 300
    a = np.random.default_rng(13).random((n, 5), dtype=np.float32)
    p = str(tmp_path / f"w.{ext}")
    gl.DataGadget(a).save(p, **({} if ext == "npy" else {"chunk_rows": 32}))
    ds = gl.GadgetDataset(gl.DataGadget(p, placement="file"), np.arange(n))
    for loader in (
        DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, multiprocessing_context=ctx),
        DataLoader(
            ds,
            batch_sampler=gl.GadgetSampler(ds, batch_size=64, seed=0),
            num_workers=2,
            multiprocessing_context=ctx,
        ),
    ):
        xs, ys = zip(*[(x, y) for x, y in loader], strict=True)
        X, Y = torch.cat(xs), torch.cat(ys)
        assert X.device.type == "cpu"
        assert torch.equal(Y.sort().values, torch.arange(n))
        assert torch.equal(X, torch.from_numpy(a)[Y])


def test_gadgetloader_workers_and_resume(tmp_path):
    n = 500
    a = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    np.save(tmp_path / "g.npy", a)
    ds = gl.GadgetDataset(str(tmp_path / "g.npy"), np.arange(n), placement="file")
    L = gl.GadgetLoader(ds, batch_size=64, num_workers=2, seed=1)
    got = [(b[0].clone(), b[1].clone()) for b in L]
    X = torch.cat([g[0] for g in got])
    Y = torch.cat([g[1] for g in got])
    assert torch.equal(X[:, 0], 2 * Y.to(torch.float32)) and torch.equal(
        Y.sort().values, torch.arange(n)
    )
    L = gl.GadgetLoader(ds, batch_size=64, num_workers=2, seed=1)
    it = iter(L)
    [next(it) for _ in range(3)]
    st = L.state_dict()
    rest = [b[1].clone() for b in it]
    L2 = gl.GadgetLoader(ds, batch_size=64, num_workers=2, seed=1)
    L2.load_state_dict(st)
    rest2 = [b[1].clone() for b in L2]
    assert len(rest) == len(rest2) == 5 and all(
        torch.equal(u, v) for u, v in zip(rest, rest2, strict=True)
    )


# ---------------------------------------------------------------------------
# GadgetDataset and torch's dataset tools
# ---------------------------------------------------------------------------


def test_dataset_indexing_and_torch_wrappers():
    n = 50
    x = torch.randn(n, 3)
    y = torch.arange(n) % 3 == 0
    w = torch.randn(n).to(torch.bfloat16)
    ds = gl.GadgetDataset(x, y, w)
    r = ds[5]
    assert torch.equal(r[0], x[5]) and r[1].item() == y[5].item() and torch.equal(r[2], w[5])
    assert torch.equal(ds[-1][0], x[-1]) and torch.equal(ds[2:7][0], x[2:7])
    assert torch.equal(ds[torch.tensor([[1, 2], [3, 4]])][0], x[torch.tensor([[1, 2], [3, 4]])])
    for bad in (n, -n - 1):
        with pytest.raises(gl.GadgetIndexError):
            ds[bad]
    with pytest.raises(gl.GadgetIndexError):
        ds[[1, -1]]
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetDataset(torch.randn(5, 2), torch.arange(6))
    b = next(iter(DataLoader(Subset(ds, [3, 1, 4, 1, 5]), batch_size=5)))
    assert torch.equal(b[0], x[[3, 1, 4, 1, 5]])
    _, te = random_split(ds, [40, 10], generator=torch.Generator().manual_seed(0))
    b = next(iter(DataLoader(te, batch_size=10)))
    assert torch.equal(b[0], x[te.indices])
    b = next(iter(DataLoader(ConcatDataset([ds, ds]), batch_size=4)))
    assert torch.equal(b[0], x[:4])
    b = next(iter(DataLoader(ds, batch_size=4, collate_fn=lambda batch: batch[0])))
    assert torch.equal(b[0], x[:4])
    assert sum(len(b[0]) for b in DataLoader(ds, batch_size=8, drop_last=True)) == 48


def test_reloaded_column_with_other_row_count_is_refused(tmp_path):
    x = torch.randn(50, 3)
    g = gl.DataGadget(x.clone())
    ds = gl.GadgetDataset(g, torch.arange(50))
    np.save(tmp_path / "bigger.npy", np.zeros((60, 3), np.float32))
    g.load(str(tmp_path / "bigger.npy"))
    with pytest.raises(gl.GadgetValueError):
        ds[0]


# ---------------------------------------------------------------------------
# GadgetSampler: determinism, epochs, resume, ranks
# ---------------------------------------------------------------------------


def _epoch(s):
    return [b.clone() for b in s]


def _ds(n=1003):
    return gl.GadgetDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def test_sampler_determinism_epochs_and_set_epoch():
    n = 1003
    ds = _ds(n)
    s1 = gl.GadgetSampler(ds, batch_size=64, order="random", seed=5)
    s2 = gl.GadgetSampler(ds, batch_size=64, order="random", seed=5)
    e1, e2 = _epoch(s1), _epoch(s2)
    assert len(e1) == len(s1) == 16
    assert all(torch.equal(a, b) for a, b in zip(e1, e2, strict=True))
    assert torch.equal(torch.cat(e1).sort().values, torch.arange(n))
    e1b = _epoch(s1)
    assert not torch.equal(torch.cat(e1), torch.cat(e1b))
    s2.set_epoch(1)
    assert torch.equal(torch.cat(_epoch(s2)), torch.cat(e1b))
    s2.set_epoch(0)
    assert torch.equal(torch.cat(_epoch(s2)), torch.cat(e1))
    s3 = gl.GadgetSampler(ds, batch_size=64, order="random", seed=6)
    assert not torch.equal(torch.cat(_epoch(s3)), torch.cat(e1))
    sq = _epoch(gl.GadgetSampler(ds, batch_size=100, order="sequential"))
    assert torch.equal(torch.cat(sq), torch.arange(n))


def test_sampler_resume_equals_uninterrupted_run():
    ds = _ds()
    s = gl.GadgetSampler(ds, batch_size=64, order="random", seed=1)
    it = iter(s)
    [next(it) for _ in range(5)]
    st = s.state_dict()
    rest = [b.clone() for b in it]
    r = gl.GadgetSampler(ds, batch_size=64, order="random", seed=999)
    r.load_state_dict(st)
    rest2 = _epoch(r)
    assert len(rest) == len(rest2) == 11
    assert all(torch.equal(a, b) for a, b in zip(rest, rest2, strict=True))
    assert torch.equal(torch.cat(_epoch(s)), torch.cat(_epoch(r)))
    bad = gl.GadgetSampler(ds, batch_size=16, seed=9)
    before = bad.state_dict()
    with pytest.raises(gl.GadgetValueError):
        bad.load_state_dict(st)
    assert bad.state_dict() == before


def test_stateful_dataloader_resume():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = _ds(500)
    s = gl.GadgetSampler(ds, batch_size=32, seed=9)
    dl = sdl.StatefulDataLoader(ds, batch_sampler=s)
    it = iter(dl)
    [next(it) for _ in range(3)]
    st = dl.state_dict()
    rest = [b[1].clone() for b in it]
    dl2 = sdl.StatefulDataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=32, seed=9))
    dl2.load_state_dict(st)
    rest2 = [b[1].clone() for b in dl2]
    assert len(rest) == len(rest2) == 13 and all(
        torch.equal(a, b) for a, b in zip(rest, rest2, strict=True)
    )


def test_gadgetloader_resume_mid_epoch_and_after_loop():
    ds = _ds(500)
    L1 = gl.GadgetLoader(ds, batch_size=32, seed=4)
    it = iter(L1)
    [next(it) for _ in range(4)]
    st = L1.state_dict()
    post = [b[1].clone() for b in it]
    L2 = gl.GadgetLoader(ds, batch_size=32, seed=4)
    L2.load_state_dict(st)
    post2 = [b[1].clone() for b in L2]
    assert len(post) == len(post2) == 12 and all(
        torch.equal(a, c) for a, c in zip(post, post2, strict=True)
    )
    assert torch.equal(torch.cat([b[1] for b in L1]), torch.cat([b[1] for b in L2]))
    L3 = gl.GadgetLoader(ds, batch_size=32, seed=4)
    [b for b in L3]
    st = L3.state_dict()
    e1 = [b[1].clone() for b in L3]
    L4 = gl.GadgetLoader(ds, batch_size=32, seed=4)
    L4.load_state_dict(st)
    e1b = [b[1].clone() for b in L4]
    assert len(e1b) == 16 and all(torch.equal(a, c) for a, c in zip(e1, e1b, strict=True))
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=4), seed=1)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("mode", ["default", "drop_last", "pad"])
def test_rank_sharding(world, mode):
    n, bs = 1003, 32
    ds = _ds(n)
    kw = {} if mode == "default" else {mode: True}
    parts = [
        _epoch(
            gl.GadgetSampler(
                ds, batch_size=bs, order="random", seed=3, num_replicas=world, rank=k, **kw
            )
        )
        for k in range(world)
    ]
    assert len({len(p) for p in parts}) == 1  # equal batch counts
    allids = torch.cat([torch.cat(p) for p in parts])
    sizes = [len(b) for p in parts for b in p]
    if mode == "default":
        assert torch.equal(allids.sort().values, torch.arange(n))
        assert max(sizes) <= bs + 1
    elif mode == "drop_last":
        assert len(allids.unique()) == len(allids) and 0 <= n - len(allids) < world * bs
    else:
        assert all(s == bs for s in sizes) and set(allids.tolist()) == set(range(n))


def test_chunk_order_file_columns_each_row_once(tmp_path):
    h5py = _h5py()
    n = 1000
    a = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    with h5py.File(tmp_path / "ch.h5", "w") as f:
        f.create_dataset("x", data=a[:, 0], chunks=(48,), compression="gzip")
    with h5py.File(tmp_path / "ch2.h5", "w") as f:
        f.create_dataset("x", data=a, chunks=(64, 2))
    ds = gl.GadgetDataset(str(tmp_path / "ch2.h5"), str(tmp_path / "ch.h5"), placement="file")
    for world in (1, 3):
        parts = [
            _epoch(
                gl.GadgetSampler(
                    ds, batch_size=50, order="chunk", seed=2, num_replicas=world, rank=k
                )
            )
            for k in range(world)
        ]
        assert len({len(p) for p in parts}) == 1
        assert torch.equal(torch.cat([torch.cat(p) for p in parts]).sort().values, torch.arange(n))
    xs, ys = zip(
        *DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=50, order="chunk", seed=2)),
        strict=False,
    )
    assert torch.equal(torch.cat(xs)[:, 0], torch.cat(ys))


def test_sampler_argument_errors():
    ds = _ds(50)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(ds, batch_size=1000, drop_last=True)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(ds, batch_size=0)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(ds, batch_size=4, num_replicas=2)
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(ds, batch_size=4, num_replicas=2, rank=2)
    with pytest.raises(gl.GadgetKeyError):
        gl.GadgetSampler(ds, batch_size=4, order="shuffled")
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(ds, batch_size=4, order="chunk")
    assert [len(b) for b in gl.GadgetSampler(ds, batch_size=1000)] == [50]
    with pytest.raises(gl.GadgetValueError):
        list(DataLoader(ds, sampler=gl.GadgetSampler(ds, batch_size=10)))


def test_gadgetloader_prefetch0_sees_writes():
    g = gl.DataGadget(np.zeros((20, 1), np.float32))
    ds = gl.GadgetDataset(g)
    seen = []
    for i, (x,) in enumerate(gl.GadgetLoader(ds, batch_size=5, prefetch=0, order="sequential")):
        seen.append(x[0, 0].item())
        g.insertData(torch.full((20, 1), float(i + 1)), torch.arange(20))
    assert seen == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------
# Training: OffloadedEmbedding / OffloadedOptimizer against torch references
# ---------------------------------------------------------------------------

N_ROWS, DIM = 50, 4


def _w0():
    return torch.randn(N_ROWS, DIM, generator=torch.Generator().manual_seed(0))


def _batches(seed=1, k=6):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, N_ROWS, (3, 7), generator=g), torch.randn(3, 7, DIM, generator=g))
        for _ in range(k)
    ]


def _run_off(optcls, batches, **kw):
    emb = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu")
    emb.weight.insertData(_w0(), torch.arange(N_ROWS))
    opt = gl.OffloadedOptimizer(optcls, emb, **kw)
    for ids, t in batches:
        opt.zero_grad()
        ((emb(ids) - t) ** 2).sum().backward()
        opt.step()
    return emb.weight.getNumpyVersion()


def _run_torch(optcls, batches, sparse, **kw):
    emb = torch.nn.Embedding(N_ROWS, DIM, sparse=sparse)
    with torch.no_grad():
        emb.weight.copy_(_w0())
    opt = optcls(emb.parameters(), **kw)
    for ids, t in batches:
        opt.zero_grad()
        ((emb(ids) - t) ** 2).sum().backward()
        opt.step()
    return emb.weight.detach().numpy()


def _run_lazy(optcls, batches, **kw):
    """Lazy per-row reference: torch's optimizer on just the batch's distinct rows, with
    per-row state gathered and scattered and one shared step count."""
    w = _w0()
    state: dict = {}
    init_full = {"step_size": kw.get("lr", 0.01)}  # Rprop starts every row's step size at lr
    for ids, t in batches:
        u, inv = torch.unique(ids, return_inverse=True)
        p = torch.nn.Parameter(w[u].clone())
        ((p[inv] - t) ** 2).sum().backward()
        opt = optcls([p], **kw)
        if state:
            opt.state[p] = {
                k: (
                    v[u].clone()
                    if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == N_ROWS
                    else v.clone()
                )
                for k, v in state.items()
            }
        opt.step()
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == len(u):
                if k not in state:
                    state[k] = torch.full(
                        (N_ROWS,) + v.shape[1:], init_full.get(k, 0.0), dtype=v.dtype
                    )
                state[k][u] = v
            else:
                state[k] = v.clone()
        w[u] = p.detach()
    return w.numpy()


def test_offloaded_sparseadam_equals_torch_sparse_embedding_bitwise():
    b = _batches()
    assert np.array_equal(
        _run_off(torch.optim.SparseAdam, b, lr=0.1),
        _run_torch(torch.optim.SparseAdam, b, True, lr=0.1),
    )


@pytest.mark.parametrize("optcls", [torch.optim.SGD, torch.optim.Adagrad])
def test_offloaded_sgd_adagrad_equal_dense_reference(optcls):
    b = _batches()
    assert np.array_equal(_run_off(optcls, b, lr=0.1), _run_torch(optcls, b, False, lr=0.1))
    np.testing.assert_allclose(
        _run_off(optcls, b, lr=0.1), _run_torch(optcls, b, True, lr=0.1), atol=1e-6
    )


@pytest.mark.parametrize(
    "optcls, kw",
    [
        (torch.optim.Adam, {"lr": 0.05}),
        (torch.optim.Adam, {"lr": 0.05, "amsgrad": True}),
        (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
        (torch.optim.RMSprop, {"lr": 0.05, "momentum": 0.5, "centered": True}),
        (torch.optim.Adadelta, {"lr": 1.0}),
        (torch.optim.Adamax, {"lr": 0.05}),
        (torch.optim.NAdam, {"lr": 0.05}),
        (torch.optim.RAdam, {"lr": 0.05}),
        (torch.optim.ASGD, {"lr": 0.05}),
        (torch.optim.Rprop, {"lr": 0.05}),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_offloaded_optimizers_equal_lazy_per_row_reference(optcls, kw):
    b = _batches()
    assert np.array_equal(_run_off(optcls, b, **kw), _run_lazy(optcls, b, **kw))


@pytest.mark.parametrize(
    "optcls, kw",
    [(torch.optim.Adam, {"lr": 0.05}), (torch.optim.RMSprop, {"lr": 0.05, "momentum": 0.9})],
)
def test_offloaded_dense_optimizers_equal_torch_when_every_row_is_used(optcls, kw):
    g = torch.Generator().manual_seed(2)
    b = [
        (torch.randperm(N_ROWS, generator=g).reshape(5, 10), torch.randn(5, 10, DIM, generator=g))
        for _ in range(4)
    ]
    assert np.array_equal(_run_off(optcls, b, **kw), _run_torch(optcls, b, False, **kw))


def test_offloaded_lookup_edge_cases_match_nn_embedding():
    emb = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu")
    ref = torch.nn.Embedding(N_ROWS, DIM)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(emb.weight.getNumpyVersion()))
    for ids in (
        torch.tensor([], dtype=torch.long),
        torch.tensor(3),
        torch.tensor([[1, 2], [2, 3]], dtype=torch.int32),
        torch.tensor([1, 2], dtype=torch.uint8),
        torch.arange(20).reshape(4, 5)[:, ::2],
    ):
        out = emb(ids)
        assert out.shape == ids.shape + (DIM,)
        assert torch.equal(out, ref(ids.long()))
    for bad, exc in (
        (torch.tensor([N_ROWS]), gl.GadgetIndexError),
        (torch.tensor([-1]), gl.GadgetIndexError),
    ):
        with pytest.raises(exc):
            emb(bad)
    with pytest.raises(gl.GadgetTypeError):
        emb(torch.tensor([1.0]))


def test_offloaded_empty_batch_step_and_noop_step():
    emb = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.1)
    w0 = emb.weight.getNumpyVersion()
    emb(torch.tensor([], dtype=torch.long)).sum().backward()
    opt.step()
    assert np.array_equal(w0, emb.weight.getNumpyVersion())
    opt.step()
    assert np.array_equal(w0, emb.weight.getNumpyVersion())


def test_offloaded_accumulation_clipping_scheduler_match_torch():
    def pair():
        e = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu")
        e.weight.insertData(_w0(), torch.arange(N_ROWS))
        r = torch.nn.Embedding(N_ROWS, DIM)
        with torch.no_grad():
            r.weight.copy_(_w0())
        return e, r

    g = torch.Generator().manual_seed(3)
    b = [
        (torch.randint(0, N_ROWS, (5,), generator=g), torch.randint(0, N_ROWS, (2, 3), generator=g))
        for _ in range(4)
    ]
    e, r = pair()
    o = gl.OffloadedOptimizer(torch.optim.Adagrad, e, lr=0.3)
    ro = torch.optim.Adagrad(r.parameters(), lr=0.3)
    for i1, i2 in b:
        for m, opt in ((e, o), (r, ro)):
            opt.zero_grad()
            (m(i1).sum() * 2).backward()  # gradient accumulation over backward calls,
            (m(i2) ** 2).sum().backward()  # repeated ids inside and across lookups
            (m(i1) ** 3).sum().backward()
            opt.step()
    assert np.array_equal(e.weight.getNumpyVersion(), r.weight.detach().numpy())
    e, r = pair()
    o = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.5)
    ro = torch.optim.SGD(r.parameters(), lr=0.5)
    s1 = torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ro, 1, gamma=0.5)
    norms = []
    for i1, _ in b:
        for m, opt, s in ((e, o, s1), (r, ro, s2)):
            opt.zero_grad()
            (m(i1) ** 2).sum().mul(10).backward()
            params = [p for grp in opt.param_groups for p in grp["params"]]
            norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0))
            opt.step()
            s.step()
    # the norm runs over the distinct rows' gradient vs torch's dense one: equal up to rounding
    assert all(torch.allclose(norms[i], norms[i + 1], rtol=1e-6) for i in range(0, len(norms), 2))
    np.testing.assert_allclose(
        e.weight.getNumpyVersion(), r.weight.detach().numpy(), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_offloaded_embedding_bag_matches_nn_embedding_bag(mode):
    torch.manual_seed(0)
    bag = gl.OffloadedEmbeddingBag(30, DIM, mode=mode, placement="cpu", device="cpu")
    ref = torch.nn.EmbeddingBag(30, DIM, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(bag.weight.getNumpyVersion()))
    inp2 = torch.randint(0, 30, (5, 3))
    assert torch.equal(bag(inp2), ref(inp2))
    flat = torch.randint(0, 30, (10,))
    offs = torch.tensor([0, 3, 3, 7])  # with an empty bag
    assert torch.equal(bag(flat, offs), ref(flat, offs))
    if mode == "sum":
        psw = torch.rand(10)
        assert torch.equal(
            bag(flat, offs, per_sample_weights=psw), ref(flat, offs, per_sample_weights=psw)
        )
    opt = gl.OffloadedOptimizer(torch.optim.SGD, bag, lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        x = torch.randint(0, 30, (4, 5))
        opt.zero_grad()
        (bag(x) ** 2).sum().backward()
        opt.step()
        ropt.zero_grad()
        (ref(x) ** 2).sum().backward()
        ropt.step()
    assert np.array_equal(bag.weight.getNumpyVersion(), ref.weight.detach().numpy())


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_checkpoint_resume_is_bit_identical(tmp_path, fmt):
    if fmt != "npy":
        pytest.importorskip("h5py" if fmt == "hdf5" else "zarr")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (8,), generator=g) for _ in range(10)]

    def make():
        torch.manual_seed(7)
        m = torch.nn.ModuleDict(
            {
                "e": gl.OffloadedEmbedding(40, 3, placement="cpu", device="cpu"),
                "bag": gl.OffloadedEmbeddingBag(40, 3, mode="sum", placement="cpu", device="cpu"),
                "h": torch.nn.Linear(3, 1),
            }
        )
        return m, gl.OffloadedOptimizer(torch.optim.Adam, m, lr=0.05)

    def step(m, o, ids):
        o.zero_grad()
        (m["h"](m["e"](ids) * m["bag"](ids.view(2, 4)).repeat(4, 1)) ** 2).sum().backward()
        o.step()

    m, o = make()
    for b in batches:
        step(m, o, b)
    full = (
        m["e"].weight.getNumpyVersion(),
        m["bag"].weight.getNumpyVersion(),
        m["h"].weight.detach().clone(),
    )
    m, o = make()
    for b in batches[:5]:
        step(m, o, b)
    ck = tmp_path / "ck"
    gl.save_checkpoint(str(ck), {"model": m, "optimizer": o}, format=fmt)
    for b in batches[5:7]:
        step(m, o, b)  # diverge, then load into these same objects
    m2, o2 = make()
    gl.load_checkpoint(str(ck), {"model": m2, "optimizer": o2})
    gl.load_checkpoint(str(ck), {"model": m, "optimizer": o})
    for mm, oo in ((m2, o2), (m, o)):
        for b in batches[5:]:
            step(mm, oo, b)
        assert np.array_equal(full[0], mm["e"].weight.getNumpyVersion())
        assert np.array_equal(full[1], mm["bag"].weight.getNumpyVersion())
        assert torch.equal(full[2], mm["h"].weight)


def test_checkpoint_bad_names_and_bfloat16_npy_refused(tmp_path):
    e = gl.OffloadedEmbedding(10, 2, placement="cpu", device="cpu", dtype=torch.bfloat16)
    o = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=0.1)
    with pytest.raises(gl.GadgetError):
        gl.save_checkpoint(str(tmp_path / "a"), {"model": e, "optimizer": o}, format="npy")
    assert not any((tmp_path / "a").glob("*.npy")) if (tmp_path / "a").exists() else True
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(gl.GadgetError):
            gl.save_checkpoint(str(tmp_path / "b"), {bad: e}, format="hdf5")


def test_offloaded_module_misc():
    w0 = _w0()
    e = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu")
    e.weight.insertData(w0.clone(), torch.arange(N_ROWS))
    e2 = copy.deepcopy(e)
    e2.weight.fill_(0.0)
    assert np.array_equal(e.weight.getNumpyVersion(), w0.numpy())
    buf = io.BytesIO()
    torch.save(e, buf)
    buf.seek(0)
    e3 = torch.load(buf, weights_only=False)
    assert torch.equal(e3(torch.tensor([4])), w0[[4]])
    sd = e.state_dict()
    assert list(sd) == ["weight"] and torch.equal(sd["weight"], w0)
    e4 = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu")
    e4.load_state_dict(sd)
    assert np.array_equal(e4.weight.getNumpyVersion(), w0.numpy())
    with pytest.raises(RuntimeError):
        e4.load_state_dict({"weight": torch.zeros(N_ROWS + 1, DIM)})
    assert np.array_equal(e4.weight.getNumpyVersion(), w0.numpy())
    e.half()
    assert e(torch.tensor([1])).dtype == torch.float16 and e.weight.dtype == torch.float32
    f = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu")
    o = gl.OffloadedOptimizer(torch.optim.SGD, f, lr=0.5)
    f.requires_grad_(False)
    assert not f(torch.tensor([1, 2])).requires_grad
    before = f.weight.getNumpyVersion()
    o.step()
    assert np.array_equal(before, f.weight.getNumpyVersion())
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.SGD, f, lr=1)
    with pytest.raises(gl.GadgetValueError):
        gl.OffloadedOptimizer(torch.optim.SGD, torch.nn.ModuleDict({"e": e4}).parameters(), lr=1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.SGD, [e4.weight], lr=1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.LBFGS, e4, lr=1)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedOptimizer(torch.optim.Adam, e4, lr=1, differentiable=True)
    with pytest.raises(gl.GadgetTypeError):
        gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu", dtype=torch.int64)
    with pytest.raises(gl.GadgetTypeError):
        torch.nn.init.trunc_normal_(e4.weight)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float64])
def test_offloaded_low_and_high_precision_tables_train_only_used_rows(dt):
    e = gl.OffloadedEmbedding(N_ROWS, DIM, placement="cpu", device="cpu", dtype=dt)
    e.weight.insertData(_w0().to(dt), torch.arange(N_ROWS))
    o = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    out = e(torch.tensor([1, 1, 3]))
    assert out.dtype == dt
    out.float().sum().backward()
    o.step()
    changed = (e.weight.as_tensor() != _w0().to(dt)).any(1).nonzero().flatten().tolist()
    assert changed == [1, 3]


def test_interleaved_table_views_save_load_and_refusals(tmp_path):
    e = gl.OffloadedEmbedding(12, 3, placement="cpu", device="cpu")
    w0 = e.weight.getNumpyVersion()
    o = gl.OffloadedOptimizer(torch.optim.Adam, e, lr=0.1)
    assert np.array_equal(w0, e.weight.getNumpyVersion())
    assert np.array_equal(np.asarray(e.weight, copy=False), w0)
    e(torch.tensor([1, 2])).sum().backward()
    o.step()
    states = dict(o.pagers[0].tables)
    ex = states["exp_avg"].getNumpyVersion()
    assert np.nonzero(np.abs(ex).sum(1))[0].tolist() == [1, 2]
    p = str(tmp_path / "il.npy")
    e.weight.save(p)
    w1 = e.weight.getNumpyVersion()
    assert np.array_equal(np.load(p), w1)
    e.weight.fill_(2.0)
    e.weight.load(p)
    assert np.array_equal(w1, e.weight.getNumpyVersion())
    assert np.array_equal(ex, states["exp_avg"].getNumpyVersion())
    c = pickle.loads(pickle.dumps(e.weight))
    assert np.array_equal(c.getNumpyVersion(), w1) and c.as_tensor().is_contiguous()
    e(torch.tensor([3])).sum().backward()
    with pytest.raises(gl.GadgetValueError):
        e.weight.load(p)
    with pytest.raises(gl.GadgetValueError):
        e.weight.insertData(torch.zeros(1, 3), torch.tensor([0]))
    assert np.array_equal(w1, e.weight.getNumpyVersion())
    o.step()


# ---------------------------------------------------------------------------
# SpeedTorch switchers against a dense torch reference
# ---------------------------------------------------------------------------

SW_N, SW_D = 20, 5


def _sw_batches(all_rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(5):
        if all_rows:
            c = torch.cat(
                [torch.randperm(SW_N, generator=g), torch.randint(0, SW_N, (4,), generator=g)]
            )
            p = torch.cat(
                [torch.randperm(SW_N, generator=g), torch.randint(0, SW_N, (4,), generator=g)]
            )
        else:
            c = torch.randint(0, SW_N, (6,), generator=g)
            p = torch.randint(0, SW_N, (6,), generator=g)
        out.append((c, p, torch.randint(0, SW_N, (len(c), 3), generator=g)))
    return out


def _sw_init():
    g = torch.Generator().manual_seed(4)
    return torch.rand(SW_N, SW_D, generator=g) - 0.5, torch.rand(SW_N, SW_D, generator=g) - 0.5


def _sw_ref(optcls, bs, **kw):
    u0, v0 = _sw_init()
    m = _SkipGram(SW_N, SW_D)
    with torch.no_grad():
        m.u_embeddings.weight.copy_(u0)
        m.v_embeddings.weight.copy_(v0)
    o = optcls(m.parameters(), **kw)
    for c, p, n in bs:
        o.zero_grad()
        m(c, p, n).backward()
        o.step()
    return m.u_embeddings.weight.detach().numpy(), m.v_embeddings.weight.detach().numpy()


def _sw_run(optcls, bs, kind, **kw):
    u0, v0 = _sw_init()
    m = _SkipGram(3, SW_D)
    o = optcls(m.parameters(), **kw)
    if kind == "cupy":
        us = gl.ModelFactory(m.u_embeddings, SW_N, SW_D, CPUPinn=True)
        vs = gl.ModelFactory(m.v_embeddings, SW_N, SW_D, CPUPinn=True)
        uo = gl.OptimizerFactory(o, SW_N, SW_D, m, "u_embeddings", CPUPinn=True)
        vo = gl.OptimizerFactory(o, SW_N, SW_D, m, "v_embeddings", CPUPinn=True)
    else:
        us = gl.PytorchModelFactory(m.u_embeddings, SW_N, SW_D, deviceType="cpu", pinType=True)
        vs = gl.PytorchModelFactory(m.v_embeddings, SW_N, SW_D, deviceType="cpu")
        uo = gl.PytorchOptimizerFactory(o, SW_N, SW_D, m, "u_embeddings", deviceType="cpu")
        vo = gl.PytorchOptimizerFactory(
            o, SW_N, SW_D, m, "v_embeddings", deviceType=torch.device("cpu")
        )
    us.customInit(lambda t: t.copy_(u0))
    vs.customInit(lambda t: t.copy_(v0))
    uo.optInit()
    vo.optInit()
    for c, p, n in bs:
        lc = us.beforeForwardPass(c)
        uo.beforeForwardPass(c)
        lp, ln = vs.beforeForwardPass(p, n)
        vo.beforeForwardPass(p, n)
        o.zero_grad()
        m(lc, lp, ln).backward()
        o.step()
        us.afterOptimizerStep(c)
        uo.afterOptimizerStep(c)
        vs.afterOptimizerStep(p, n)
        vo.afterOptimizerStep(p, n)
    return us.getNumpyVersion(), vs.getNumpyVersion()


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_switchers_sgd_sparse_batches_equal_dense_full_table(kind):
    bs = _sw_batches(False)
    a = _sw_run(torch.optim.SGD, bs, kind, lr=0.1)
    b = _sw_ref(torch.optim.SGD, bs, lr=0.1)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize(
    "optcls, kw",
    [
        (torch.optim.Adam, {"lr": 0.05}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9}),
        (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.Rprop, {"lr": 0.01}),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_switchers_equal_dense_torch_when_every_row_is_used(kind, optcls, kw):
    bs = _sw_batches(True)
    a = _sw_run(optcls, bs, kind, **kw)
    b = _sw_ref(optcls, bs, **kw)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_switcher_savetorch_loadtorch_round_trip(tmp_path):
    m = _SkipGram(3, SW_D)
    sw = gl.PytorchModelFactory(m.u_embeddings, SW_N, SW_D, deviceType="cpu")
    sw.normalDistributionInit(0.0, 1.0)
    ref = sw.getNumpyVersion()
    p = str(tmp_path / "u.pt")
    sw.saveTorch(p)
    sw.zerosInit()
    sw.loadTorch(p)
    assert np.array_equal(sw.getNumpyVersion(), ref)
    torch.save(torch.zeros(SW_N + 1, SW_D), tmp_path / "bad.pt")
    with pytest.raises(gl.GadgetError):
        sw.loadTorch(str(tmp_path / "bad.pt"))
    assert np.array_equal(sw.getNumpyVersion(), ref)
    sw.saveCupy(str(tmp_path / "emb"))
    assert np.array_equal(np.load(tmp_path / "emb.npy"), ref)


# ---------------------------------------------------------------------------
# Finding (fixed in session 27): the gradients of several lookups of one row are summed in
# torch's autograd order, bit for bit
# ---------------------------------------------------------------------------

BIG = 2.0**24  # float32: BIG + 1 rounds back to BIG, BIG + 2 is exact


def _sum_order_case(m, opt, accumulate_first, coefs):
    opt.zero_grad()
    idx = torch.tensor([0])
    if accumulate_first:
        (m(idx) * coefs[0]).sum().backward()
        (m(idx) * coefs[1] + m(idx) * coefs[2]).sum().backward()
    else:
        (m(idx) * coefs[0] + m(idx) * coefs[1] + m(idx) * coefs[2]).sum().backward()
    opt.step()


@pytest.mark.parametrize(
    "accumulate_first", [False, True], ids=["three-lookups-one-backward", "accumulate-then-two"]
)
def test_gradient_sum_order_matches_torch_bitwise(accumulate_first):
    mismatches = []
    for coefs in [(1.0, 1.0, BIG), (BIG, 1.0, 1.0), (1.0, BIG, 1.0)]:
        e = gl.OffloadedEmbedding(1, 1, placement="cpu", device="cpu")
        e.weight.fill_(0.0)
        r = torch.nn.Embedding(1, 1)
        torch.nn.init.zeros_(r.weight)
        o = gl.OffloadedOptimizer(torch.optim.SGD, e, lr=1.0)
        ro = torch.optim.SGD(r.parameters(), lr=1.0)
        _sum_order_case(e, o, accumulate_first, coefs)
        _sum_order_case(r, ro, accumulate_first, coefs)
        if e.weight.getNumpyVersion().item() != r.weight.item():
            mismatches.append((coefs, e.weight.getNumpyVersion().item(), r.weight.item()))
    assert not mismatches, mismatches
