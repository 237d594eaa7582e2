"""Black-box review (session 34): a realistic recommender built from the README.

Several ``OffloadedEmbedding`` / ``OffloadedEmbeddingBag`` tables (different sizes,
float32 and float64, fixed-width bags, 1-D bags with offsets and per-sample weights,
sum / mean / max), initialised from .npy / HDF5 / zarr files, beside a dense MLP,
trained by ``OffloadedOptimizer`` from ``GadgetLoader`` batches of a file-backed
``GadgetDataset`` -- against the same model built from dense ``nn.Embedding`` /
``nn.EmbeddingBag`` with the same torch optimizer and the same batches.

The README: "Updates are lazy, as torch's SparseAdam makes them: rows a step does not
look up keep their values and optimizer state, where a dense optimizer with momentum,
per-row state or weight decay also moves them (plain SGD and a sparse nn.Embedding
leave them alone too, so there the whole table matches)". The dense reference for
optimizers with state therefore puts back, after each torch step, the rows (and their
state rows) that the step did not look up; for plain SGD and Adagrad the reference is a
sparse ``nn.Embedding`` / ``nn.EmbeddingBag`` with torch's own sparse update.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from torch import nn

import gadgetloader as gl


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    yield
    mp.undo()


# ----------------------------------------------------------------------------------
# data and model

N_ROWS = 96  # dataset rows
BATCH = 16  # 6 batches an epoch
DIM = 8
TAG_W = 5  # width of the variable-length tag bags (lengths 1..5)
TABLES = {  # name: (rows, dtype)
    "user": (300, torch.float32),
    "item": (500, torch.float64),
    "hist": (200, torch.float32),
    "tags": (120, torch.float32),
    "cat": (50, torch.float32),
}
TOL = dict(rtol=1e-5, atol=1e-6)


def _make_data(seed=0):
    rng = np.random.default_rng(seed)
    d = {
        "rowid": np.arange(N_ROWS, dtype=np.int64),
        "user": rng.integers(0, 300, N_ROWS).astype(np.int64),
        "item": rng.integers(0, 500, N_ROWS).astype(np.int64),
        "hist": rng.integers(0, 200, (N_ROWS, 4)).astype(np.int64),
        "tags": rng.integers(0, 120, (N_ROWS, TAG_W)).astype(np.int64),
        "tag_len": rng.integers(1, TAG_W + 1, N_ROWS).astype(np.int64),
        "tag_w": rng.uniform(0.1, 1.0, (N_ROWS, TAG_W)).astype(np.float32),
        "cat": rng.integers(0, 50, (N_ROWS, 3)).astype(np.int64),
        "label": (rng.random(N_ROWS) < 0.4).astype(np.float32),
    }
    # repeated ids inside a batch (popular items / users)
    d["item"][::7] = 11
    d["user"][::5] = 3
    return d


COLUMNS = ["rowid", "user", "item", "hist", "tags", "tag_len", "tag_w", "cat", "label"]


def _write_h5(path, arr, name="data"):
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=arr, chunks=(min(32, arr.shape[0]),) + arr.shape[1:])


def _write_zarr(path, arr):
    zarr = pytest.importorskip("zarr")
    z = zarr.open(
        str(path),
        mode="w",
        shape=arr.shape,
        dtype=arr.dtype,
        chunks=(min(32, arr.shape[0]),) + arr.shape[1:],
    )
    z[...] = arr


@pytest.fixture
def files(tmp_path):
    """Dataset columns and initial table weights in .npy, HDF5 and zarr files."""
    pytest.importorskip("h5py")
    pytest.importorskip("zarr")
    data = _make_data()
    rng = np.random.default_rng(1)
    weights = {
        name: (rng.standard_normal((rows, DIM)) * 0.3).astype(
            np.float64 if dt == torch.float64 else np.float32
        )
        for name, (rows, dt) in TABLES.items()
    }
    torch.manual_seed(5)
    mlp = _mlp()
    p = {
        "user_col": tmp_path / "user.npy",
        "item_col": tmp_path / "item.h5",
        "label_col": tmp_path / "label.zarr",
        "user_w": tmp_path / "user_w.npy",
        "item_w": tmp_path / "item_w.h5",
        "hist_w": tmp_path / "hist_w.zarr",
    }
    np.save(p["user_col"], data["user"])
    _write_h5(p["item_col"], data["item"], "item")
    _write_zarr(p["label_col"], data["label"])
    np.save(p["user_w"], weights["user"])
    _write_h5(p["item_w"], weights["item"], "emb")
    _write_zarr(p["hist_w"], weights["hist"])
    return {
        "data": data,
        "weights": weights,
        "mlp": {k: v.clone() for k, v in mlp.state_dict().items()},
        "paths": p,
        "tmp": tmp_path,
    }


def _mlp():
    return nn.Sequential(nn.Linear(4 * DIM, 16), nn.ReLU(), nn.Linear(16, 1))


class RecModel(nn.Module):
    """user x item interaction + history bag (mean) + weighted tag bag (sum, offsets)
    + category bag (max) -> MLP -> logit."""

    def __init__(self, offloaded: bool, sparse: bool = False):
        super().__init__()
        if offloaded:
            kw = dict(placement="cpu", device="cpu")
            self.user = gl.OffloadedEmbedding(300, DIM, **kw)
            self.item = gl.OffloadedEmbedding(500, DIM, dtype=torch.float64, **kw)
            self.hist = gl.OffloadedEmbeddingBag(200, DIM, mode="mean", **kw)
            self.tags = gl.OffloadedEmbeddingBag(120, DIM, mode="sum", **kw)
            self.cat = gl.OffloadedEmbeddingBag(50, DIM, mode="max", **kw)
        else:
            self.user = nn.Embedding(300, DIM, sparse=sparse)
            self.item = nn.Embedding(500, DIM, sparse=sparse, dtype=torch.float64)
            self.hist = nn.EmbeddingBag(200, DIM, mode="mean", sparse=sparse)
            self.tags = nn.EmbeddingBag(120, DIM, mode="sum", sparse=sparse)
            # torch's max mode has no sparse gradient; dense plain SGD / Adagrad leave
            # rows without gradient alone anyway
            self.cat = nn.EmbeddingBag(50, DIM, mode="max")
        self.mlp = _mlp()

    def forward(self, batch):
        _rowid, user, item, hist, tags, tag_len, tag_w, cat, _label = batch
        u = self.user(user)
        it = self.item(item).to(torch.float32)
        h = self.hist(hist)
        mask = torch.arange(TAG_W) < tag_len[:, None]
        offsets = torch.zeros_like(tag_len)
        offsets[1:] = torch.cumsum(tag_len, 0)[:-1]
        t = self.tags(tags[mask], offsets, per_sample_weights=tag_w[mask])
        c = self.cat(cat)
        return self.mlp(torch.cat([u * it, h, t, c], dim=1)).squeeze(-1)


def _loss(model, batch):
    return F.binary_cross_entropy_with_logits(model(batch), batch[-1])


def _looked_up(batch):
    """The ids each table looks up in a batch."""
    _rowid, user, item, hist, tags, tag_len, _w, cat, _label = batch
    mask = torch.arange(TAG_W) < tag_len[:, None]
    return {
        "user": user.reshape(-1),
        "item": item.reshape(-1),
        "hist": hist.reshape(-1),
        "tags": tags[mask].reshape(-1),
        "cat": cat.reshape(-1),
    }


def build_offloaded(f, *, init_seed=None):
    """The offloaded model; its tables come from the files (or, with init_seed, from
    other random values, for models that a checkpoint is loaded into)."""
    model = RecModel(offloaded=True)
    w = f["weights"]
    if init_seed is None:
        p = f["paths"]
        model.user.weight.load(p["user_w"])  # .npy
        model.item.weight.load(p["item_w"], dataset="emb")  # HDF5
        model.hist.weight.load(p["hist_w"])  # zarr
        model.tags.load_state_dict({"weight": torch.from_numpy(w["tags"])})
        model.cat.weight.insertData(torch.from_numpy(w["cat"]), torch.arange(50))
        model.mlp.load_state_dict(f["mlp"])
    else:
        g = torch.Generator().manual_seed(init_seed)
        sd = {}
        for k, v in model.state_dict().items():
            sd[k] = torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype)
        model.load_state_dict(sd)
    return model


def build_dense(f, *, sparse=False):
    model = RecModel(offloaded=False, sparse=sparse)
    with torch.no_grad():
        for name in TABLES:
            getattr(model, name).weight.copy_(torch.from_numpy(f["weights"][name]))
    model.mlp.load_state_dict(f["mlp"])
    return model


def build_dataset(f):
    d, p = f["data"], f["paths"]
    cols = []
    for c in COLUMNS:
        path = {"user": p["user_col"], "item": p["item_col"], "label": p["label_col"]}.get(c)
        # paths open file-backed (placement="file"); the other columns live in RAM
        cols.append(str(path) if path is not None else gl.DataGadget(d[c], placement="cpu"))
    return gl.GadgetDataset(*cols, placement="file", device="cpu")


def build_loader(ds, seed=7):
    return gl.GadgetLoader(ds, batch_size=BATCH, order="random", seed=seed)


def batches(loader, n):
    """n batches, running over epochs as a training loop does."""
    out = 0
    while out < n:
        got = False
        for b in loader:
            got = True
            yield b
            out += 1
            if out == n:
                return
        assert got, "the loader yielded an empty epoch"


OPTIMS = {
    "adam": (torch.optim.Adam, dict(lr=0.05)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.2, momentum=0.9)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.2, momentum=0.9, nesterov=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.5)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.05, amsgrad=True)),
}


def _groups_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def off_step(model, opt, batch, clip=None):
    opt.zero_grad()
    loss = _loss(model, batch)
    loss.backward()
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(_groups_params(opt), clip)
    opt.step()
    return loss.item(), norm


class LazyDenseRef:
    """A dense model trained by a torch optimizer, with the rows a step did not look
    up (values and per-row state) put back after each step: lazy per-row updates."""

    def __init__(self, model, opt_name, sparse=False):
        self.model = model
        cls, kw = OPTIMS[opt_name]
        self.opt = cls(model.parameters(), **kw)
        self.sparse = sparse

    def step(self, batch, clip=None):
        opt, model = self.opt, self.model
        opt.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        norm = None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        snaps = {}
        if not self.sparse:
            for name, ids in _looked_up(batch).items():
                p = getattr(model, name).weight
                untouched = torch.ones(p.shape[0], dtype=torch.bool)
                untouched[ids] = False
                st = {
                    k: v.clone()
                    for k, v in opt.state.get(p, {}).items()
                    if torch.is_tensor(v) and v.shape == p.shape
                }
                snaps[name] = (untouched, p.detach().clone(), st)
        opt.step()
        with torch.no_grad():
            for name, (untouched, w0, st0) in snaps.items():
                p = getattr(model, name).weight
                p[untouched] = w0[untouched]
                for k, v0 in st0.items():
                    opt.state[p][k][untouched] = v0[untouched]
        return loss.item(), norm


def _assert_models_close(off, ref, **tol):
    tol = tol or TOL
    sd_o, sd_r = off.state_dict(), ref.state_dict()
    assert set(sd_o) == set(sd_r), (sorted(sd_o), sorted(sd_r))
    for k in sd_r:
        a, b = sd_o[k], sd_r[k]
        assert a.dtype == b.dtype, (k, a.dtype, b.dtype)
        torch.testing.assert_close(a, b, **tol, msg=lambda m, k=k: f"{k}: {m}")


def _assert_sd_equal(a, b, path="sd"):
    """Exact equality of nested state dicts."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            path,
            sorted(a),
            sorted(b) if isinstance(b, dict) else b,
        )
        for k in a:
            _assert_sd_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _assert_sd_equal(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, (path, a, b)
        assert torch.equal(a, b), (
            path,
            (a - b).abs().max() if a.is_floating_point() else (a != b).sum(),
        )
    else:
        assert a == b, (path, a, b)


def _clone_sd(sd):
    if isinstance(sd, dict):
        return {k: _clone_sd(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone_sd(v) for v in sd]
    if isinstance(sd, tuple):
        return tuple(_clone_sd(v) for v in sd)
    if torch.is_tensor(sd):
        return sd.detach().clone()
    return sd


def _snapshot(model, opt):
    return _clone_sd(model.state_dict()), _clone_sd(opt.state_dict())


# ----------------------------------------------------------------------------------
# the pipeline itself


def test_file_backed_dataset_batches_match_arrays_and_cover_each_epoch(files):
    ds = build_dataset(files)
    assert len(ds) == N_ROWS
    placements = [c.placement for c in ds.columns]
    assert [placements[COLUMNS.index(c)] for c in ("user", "item", "label")] == ["file"] * 3, (
        placements
    )
    loader = build_loader(ds)
    assert len(loader) == N_ROWS // BATCH
    d = files["data"]
    seen = []
    for b in batches(loader, 2 * len(loader)):
        assert len(b) == len(COLUMNS)
        rowid = b[0]
        assert rowid.dtype == torch.int64 and rowid.shape == (BATCH,)
        for name, col in zip(COLUMNS, b, strict=False):
            exp = torch.from_numpy(d[name][rowid.numpy()])
            assert col.dtype == exp.dtype, (name, col.dtype, exp.dtype)
            assert col.device.type == "cpu"
            assert torch.equal(col, exp), name
        seen.append(rowid.clone())
    ep1, ep2 = torch.cat(seen[:6]), torch.cat(seen[6:])
    # every row once per epoch, a new order in the second epoch
    assert torch.equal(ep1.sort().values, torch.arange(N_ROWS))
    assert torch.equal(ep2.sort().values, torch.arange(N_ROWS))
    assert not torch.equal(ep1, ep2)


def test_loader_with_worker_processes_yields_the_same_batches(files):
    ds = build_dataset(files)
    want = [tuple(c.clone() for c in b) for b in batches(build_loader(ds, seed=4), 8)]
    loader = gl.GadgetLoader(ds, batch_size=BATCH, order="random", seed=4, num_workers=2)
    got = list(batches(loader, 8))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=False):
        assert len(g) == len(w)
        for a, b in zip(g, w, strict=False):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_tables_initialised_from_npy_hdf5_zarr_hold_the_files_rows(files):
    model = build_offloaded(files)
    sd = model.state_dict()
    for name, (rows, dt) in TABLES.items():
        w = sd[f"{name}.weight"]
        assert w.shape == (rows, DIM) and w.dtype == dt, (name, w.shape, w.dtype)
        assert torch.equal(w, torch.from_numpy(files["weights"][name])), name
        assert getattr(model, name).placement == "cpu"
    # the tables are not parameters: model.parameters() holds the MLP only
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in _mlp().parameters())


# ----------------------------------------------------------------------------------
# training against the dense reference


@pytest.mark.parametrize(
    "opt_name", ["adam", "adagrad", "sgd_momentum", "sgd_nesterov", "adamw_amsgrad"]
)
def test_recsys_training_matches_lazy_dense_reference(files, opt_name):
    steps = 8
    off = build_offloaded(files)
    cls, kw = OPTIMS[opt_name]
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    ref = LazyDenseRef(build_dense(files), opt_name)
    _assert_models_close(off, ref.model, rtol=0, atol=0)  # same start
    loader = build_loader(build_dataset(files))
    losses_o, losses_r = [], []
    for b in batches(loader, steps):
        losses_o.append(off_step(off, opt, b)[0])
        losses_r.append(ref.step(b)[0])
    torch.testing.assert_close(torch.tensor(losses_o), torch.tensor(losses_r), **TOL)
    _assert_models_close(off, ref.model)
    # training did something, and every table moved
    start = build_dense(files).state_dict()
    end = off.state_dict()
    for name in TABLES:
        assert not torch.equal(end[f"{name}.weight"], start[f"{name}.weight"]), name
    assert losses_o[-1] != losses_o[0]


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
def test_recsys_training_matches_sparse_embedding_reference(files, opt_name):
    """Plain SGD / Adagrad with sparse=True nn.Embedding(Bag): torch's own sparse
    update, no row restoring: the whole tables match."""
    steps = 7
    off = build_offloaded(files)
    cls, kw = OPTIMS[opt_name]
    opt = gl.OffloadedOptimizer(cls, off, **kw)
    dense = build_dense(files, sparse=True)
    ref = LazyDenseRef(dense, opt_name, sparse=True)
    loader = build_loader(build_dataset(files), seed=11)
    lo, lr_ = [], []
    for b in batches(loader, steps):
        lo.append(off_step(off, opt, b)[0])
        lr_.append(ref.step(b)[0])
    torch.testing.assert_close(torch.tensor(lo), torch.tensor(lr_), **TOL)
    _assert_models_close(off, dense)


def test_rows_never_looked_up_keep_values_and_state(files):
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    loader = build_loader(build_dataset(files))
    used = {name: set() for name in TABLES}
    for b in batches(loader, 3):
        for name, ids in _looked_up(b).items():
            used[name].update(ids.tolist())
        off_step(off, opt, b)
    sd = off.state_dict()
    for name, (rows, _dt) in TABLES.items():
        unused = sorted(set(range(rows)) - used[name])
        assert unused, name
        w0 = torch.from_numpy(files["weights"][name])
        assert torch.equal(sd[f"{name}.weight"][unused], w0[unused]), name
        used_l = sorted(used[name])
        assert not torch.equal(sd[f"{name}.weight"][used_l], w0[used_l]), name


# ----------------------------------------------------------------------------------
# evaluation


def test_eval_under_no_grad_changes_nothing_and_matches_dense(files):
    ds = build_dataset(files)
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ref = LazyDenseRef(build_dense(files), "adam")
    twin = build_offloaded(files)  # trained without the evaluation
    opt_twin = gl.OffloadedOptimizer(torch.optim.Adam, twin, lr=0.05)
    it = iter(list(batches(build_loader(ds), 6)))
    for _ in range(3):
        b = next(it)
        off_step(off, opt, b)
        off_step(twin, opt_twin, b)
        ref.step(b)
    before = _snapshot(off, opt)

    off.eval()
    ref.model.eval()
    with torch.no_grad():
        for ids in (torch.arange(0, 48), torch.arange(48, 96)):
            b = ds.gather(ids)
            out = off(b)
            assert not out.requires_grad
            torch.testing.assert_close(out, ref.model(b), **TOL)
    off.train()
    ref.model.train()

    after = _snapshot(off, opt)
    _assert_sd_equal(before[0], after[0], "model")
    _assert_sd_equal(before[1], after[1], "optimizer")

    # "evaluation forwards under torch.no_grad() leave none": writing a table is allowed
    row = off.cat.weight.getData(torch.tensor([0])).clone()
    off.cat.weight.insertData(row, torch.tensor([0]))

    # the next steps are exactly those of the run without evaluation
    for b in it:
        l1 = off_step(off, opt, b)[0]
        l2 = off_step(twin, opt_twin, b)[0]
        ref.step(b)
        assert l1 == l2
    _assert_sd_equal(off.state_dict(), twin.state_dict(), "model")
    _assert_sd_equal(opt.state_dict(), opt_twin.state_dict(), "optimizer")
    _assert_models_close(off, ref.model)


# ----------------------------------------------------------------------------------
# resume


def _uninterrupted(files, opt_name, steps, seed=7):
    model = build_offloaded(files)
    cls, kw = OPTIMS[opt_name]
    opt = gl.OffloadedOptimizer(cls, model, **kw)
    losses = [
        off_step(model, opt, b)[0] for b in batches(build_loader(build_dataset(files), seed), steps)
    ]
    return model, opt, losses


@pytest.mark.parametrize("opt_name", ["adam", "sgd_momentum"])
def test_resume_from_state_dicts_is_identical_to_uninterrupted(files, opt_name):
    total, cut = 9, 4  # the cut is inside the first epoch, the run crosses into the second
    full_model, full_opt, full_losses = _uninterrupted(files, opt_name, total)

    cls, kw = OPTIMS[opt_name]
    model = build_offloaded(files)
    opt = gl.OffloadedOptimizer(cls, model, **kw)
    loader = build_loader(build_dataset(files))
    losses = [off_step(model, opt, b)[0] for b in batches(loader, cut)]
    path = files["tmp"] / "resume.pt"
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader.state_dict()},
        path,
    )
    del opt, model, loader

    saved = torch.load(path, weights_only=True)
    model2 = build_offloaded(files, init_seed=123)
    opt2 = gl.OffloadedOptimizer(cls, model2, **kw)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    loader2 = build_loader(build_dataset(files), seed=999)  # the state brings its seed
    loader2.load_state_dict(saved["loader"])
    losses += [off_step(model2, opt2, b)[0] for b in batches(loader2, total - cut)]

    assert losses == full_losses
    _assert_sd_equal(model2.state_dict(), full_model.state_dict(), "model")
    _assert_sd_equal(opt2.state_dict(), full_opt.state_dict(), "optimizer")


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_resume_from_checkpoint_is_identical_to_uninterrupted(files, fmt):
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    if fmt == "zarr":
        pytest.importorskip("zarr")
    total, cut = 8, 5
    full_model, full_opt, full_losses = _uninterrupted(files, "adam", total)

    model = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.05)
    loader = build_loader(build_dataset(files))
    losses = [off_step(model, opt, b)[0] for b in batches(loader, cut)]
    ck = files["tmp"] / f"ckpt_{fmt}"
    gl.save_checkpoint(ck, {"model": model, "optimizer": opt}, format=fmt)
    torch.save(loader.state_dict(), ck / "loader.pt")
    # keep training the original past the checkpoint: the checkpoint must not follow it
    for b in batches(loader, 1):
        off_step(model, opt, b)
    del opt, model, loader

    model2 = build_offloaded(files, init_seed=321)
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, model2, lr=0.05)
    gl.load_checkpoint(ck, {"model": model2, "optimizer": opt2})
    loader2 = build_loader(build_dataset(files), seed=1)
    loader2.load_state_dict(torch.load(ck / "loader.pt", weights_only=True))
    losses += [off_step(model2, opt2, b)[0] for b in batches(loader2, total - cut)]

    assert losses == full_losses
    _assert_sd_equal(model2.state_dict(), full_model.state_dict(), "model")
    _assert_sd_equal(opt2.state_dict(), full_opt.state_dict(), "optimizer")


def test_checkpoint_that_does_not_fit_leaves_model_and_optimizer_unchanged(files):
    model = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.05)
    for b in batches(build_loader(build_dataset(files)), 2):
        off_step(model, opt, b)
    ck = files["tmp"] / "ck_fit"
    gl.save_checkpoint(ck, {"model": model, "optimizer": opt})

    # a model whose item table has another row count: refused, nothing changes
    other = RecModel(offloaded=True)
    other.item = gl.OffloadedEmbedding(499, DIM, dtype=torch.float64, placement="cpu", device="cpu")
    opt_o = gl.OffloadedOptimizer(torch.optim.Adam, other, lr=0.05)
    for b in batches(build_loader(build_dataset(files), seed=3), 1):
        b = list(b)
        b[2] = b[2].clamp(max=498)
        off_step(other, opt_o, b)
    before = _snapshot(other, opt_o)
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.load_checkpoint(ck, {"model": other, "optimizer": opt_o})
    msg = str(ei.value)
    assert "500" in msg and "499" in msg, msg
    after = _snapshot(other, opt_o)
    _assert_sd_equal(before[0], after[0], "model")
    _assert_sd_equal(before[1], after[1], "optimizer")

    # an optimizer of another class: refused before anything changes
    model3 = build_offloaded(files, init_seed=5)
    opt3 = gl.OffloadedOptimizer(torch.optim.Adagrad, model3, lr=0.1)
    before = _snapshot(model3, opt3)
    with pytest.raises(gl.GadgetValueError):
        gl.load_checkpoint(ck, {"model": model3, "optimizer": opt3})
    with pytest.raises(gl.GadgetValueError):
        opt3.load_state_dict(opt.state_dict())
    after = _snapshot(model3, opt3)
    _assert_sd_equal(before[0], after[0], "model")
    _assert_sd_equal(before[1], after[1], "optimizer")


def test_bfloat16_table_checkpoint_npy_refused_before_writing_hdf5_works(files):
    pytest.importorskip("h5py")
    model = nn.ModuleDict(
        {
            "emb": gl.OffloadedEmbedding(
                40, DIM, dtype=torch.bfloat16, placement="cpu", device="cpu"
            ),
            "head": nn.Linear(DIM, 1),
        }
    )
    opt = gl.OffloadedOptimizer(torch.optim.Adam, model, lr=0.01)
    ids = torch.tensor([1, 2, 2, 7])
    model["head"](model["emb"](ids).float()).sum().backward()
    opt.step()
    ck = files["tmp"] / "ck_bf16"
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.save_checkpoint(ck, {"model": model, "optimizer": opt}, format="npy")
    assert "bfloat16" in str(ei.value)
    assert not ck.exists() or not any(ck.iterdir()), list(ck.iterdir())
    gl.save_checkpoint(ck, {"model": model, "optimizer": opt}, format="hdf5")
    model2 = nn.ModuleDict(
        {
            "emb": gl.OffloadedEmbedding(
                40, DIM, dtype=torch.bfloat16, placement="cpu", device="cpu"
            ),
            "head": nn.Linear(DIM, 1),
        }
    )
    opt2 = gl.OffloadedOptimizer(torch.optim.Adam, model2, lr=0.01)
    gl.load_checkpoint(ck, {"model": model2, "optimizer": opt2})
    _assert_sd_equal(model.state_dict(), model2.state_dict(), "model")
    _assert_sd_equal(opt.state_dict(), opt2.state_dict(), "optimizer")


# ----------------------------------------------------------------------------------
# clipping and freezing


def test_gradient_clipping_over_param_groups_matches_dense_clipping(files):
    steps, max_norm = 6, 0.05
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.SGD, off, lr=0.5, momentum=0.9)
    ref = LazyDenseRef(build_dense(files), "sgd_momentum")
    ref.opt.param_groups[0]["lr"] = 0.5
    norms_o, norms_r = [], []
    for b in batches(build_loader(build_dataset(files)), steps):
        lo, no = off_step(off, opt, b, clip=max_norm)
        lr_, nr = ref.step(b, clip=max_norm)
        assert lo == pytest.approx(lr_, rel=1e-5, abs=1e-6)
        norms_o.append(float(no))
        norms_r.append(float(nr))
    # the norm includes the tables' row gradients, as the dense model's does
    np.testing.assert_allclose(norms_o, norms_r, rtol=1e-5, atol=1e-7)
    assert max(norms_r) > max_norm  # clipping was active
    _assert_models_close(off, ref.model)


def test_clipping_sees_table_gradients_through_param_groups(files):
    """The groups' norm is larger than the dense-only norm over model.parameters()."""
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    dense = build_dense(files)
    b = next(iter(build_loader(build_dataset(files))))
    opt.zero_grad()
    _loss(off, b).backward()
    _loss(dense, b).backward()
    n_groups = torch.nn.utils.clip_grad_norm_(_groups_params(opt), 1e9)
    n_mlp = torch.nn.utils.clip_grad_norm_(list(off.parameters()), 1e9)
    n_dense_all = torch.nn.utils.clip_grad_norm_(list(dense.parameters()), 1e9)
    n_dense_mlp = torch.nn.utils.clip_grad_norm_(list(dense.mlp.parameters()), 1e9)
    torch.testing.assert_close(n_groups.double(), n_dense_all.double(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(n_mlp, n_dense_mlp, rtol=1e-5, atol=1e-7)
    assert n_groups > n_mlp
    opt.step()


def test_freezing_one_table_then_unfreezing_matches_dense(files):
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ref = LazyDenseRef(build_dense(files), "adam")
    loader = build_loader(build_dataset(files))
    it = batches(loader, 8)
    for _ in range(2):
        b = next(it)
        off_step(off, opt, b)
        ref.step(b)
    off.item.requires_grad_(False)
    ref.model.item.weight.requires_grad_(False)
    item_before = off.state_dict()["item.weight"].clone()
    opt_tables_before = _clone_sd(opt.state_dict()["tables"])
    for _ in range(3):
        b = next(it)
        out = off.item(b[2])
        assert not out.requires_grad
        off_step(off, opt, b)
        ref.step(b)
    assert torch.equal(off.state_dict()["item.weight"], item_before)
    # the frozen table's optimizer state did not move; the others' did
    opt_tables_after = opt.state_dict()["tables"]
    changed = [
        not all(torch.equal(a[k], b_[k]) for k in a)
        for a, b_ in zip(opt_tables_before, opt_tables_after, strict=False)
    ]
    assert changed.count(False) == 1, changed
    _assert_models_close(off, ref.model)
    # a parent's requires_grad_ reaches only parameters; unfreeze the embedding itself
    off.item.requires_grad_(True)
    ref.model.item.weight.requires_grad_(True)
    for b in it:
        off_step(off, opt, b)
        ref.step(b)
    assert not torch.equal(off.state_dict()["item.weight"], item_before)
    _assert_models_close(off, ref.model)


# ----------------------------------------------------------------------------------
# bad input mid-training: clear errors, nothing recorded, training continues exactly


def test_bad_bag_calls_and_bad_ids_mid_training_leave_nothing_behind(files):
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ref = LazyDenseRef(build_dense(files), "adam")
    it = batches(build_loader(build_dataset(files)), 5)
    for _ in range(2):
        b = next(it)
        off_step(off, opt, b)
        ref.step(b)
    before = _snapshot(off, opt)

    with pytest.raises(gl.GadgetValueError) as ei:  # offsets not starting at 0
        off.tags(torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
    assert "offsets" in str(ei.value) and "[1, 2]" in str(ei.value)
    with pytest.raises(gl.GadgetValueError) as ei:  # decreasing offsets
        off.tags(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    assert "offsets" in str(ei.value)
    with pytest.raises(gl.GadgetValueError) as ei:  # weights of the wrong shape
        off.tags(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), per_sample_weights=torch.ones(2))
    msg = str(ei.value)
    assert "per_sample_weights" in msg and "(3,)" in msg and "(2,)" in msg, msg
    with pytest.raises(gl.GadgetIndexError) as ei:  # an id past the table
        off.cat(torch.tensor([[1, 2, 50]]))
    msg = str(ei.value)
    assert "50" in msg and "49" in msg, msg
    with pytest.raises(gl.GadgetIndexError):  # a negative id
        off.user(torch.tensor([4, -1]))
    with pytest.raises(gl.GadgetTypeError):  # float ids
        off.item(torch.tensor([1.0, 2.0]))

    after = _snapshot(off, opt)
    _assert_sd_equal(before[0], after[0], "model")
    _assert_sd_equal(before[1], after[1], "optimizer")
    # the failed calls recorded nothing: the next steps match the reference exactly
    for b in it:
        lo = off_step(off, opt, b)[0]
        lr_ = ref.step(b)[0]
        assert lo == pytest.approx(lr_, rel=1e-5, abs=1e-6)
    _assert_models_close(off, ref.model)


def test_construction_errors_for_unsupported_table_options():
    with pytest.raises(gl.GadgetKeyError) as ei:
        gl.OffloadedEmbedding(100, DIM, placement="file")
    assert isinstance(ei.value, KeyError)
    assert "file" in str(ei.value) and "cpu" in str(ei.value)
    with pytest.raises(gl.GadgetKeyError):
        gl.OffloadedEmbeddingBag(100, DIM, placement="file")
    for kw in (dict(padding_idx=0), dict(max_norm=1.0), dict(sparse=True)):
        with pytest.raises(TypeError):
            gl.OffloadedEmbedding(100, DIM, placement="cpu", device="cpu", **kw)
        with pytest.raises(TypeError):
            gl.OffloadedEmbeddingBag(100, DIM, placement="cpu", device="cpu", **kw)
    with pytest.raises(gl.GadgetValueError) as ei:
        gl.OffloadedEmbeddingBag(100, DIM, mode="median", placement="cpu", device="cpu")
    assert "median" in str(ei.value) and "sum" in str(ei.value)
    with pytest.raises(gl.GadgetTypeError) as ei:
        gl.OffloadedEmbedding(100, DIM, dtype=torch.int32, placement="cpu", device="cpu")
    assert "int32" in str(ei.value)


def test_optimizer_over_model_parameters_warns_and_does_not_train_tables(files):
    """README: pass the model, not model.parameters() (the tables are not parameters;
    it warns when it finds no table)."""
    off = build_offloaded(files)
    with pytest.warns(UserWarning) as rec:
        opt = gl.OffloadedOptimizer(torch.optim.Adam, off.parameters(), lr=0.05)
    assert any("table" in str(w.message).lower() for w in rec), [str(w.message) for w in rec]
    b = next(iter(build_loader(build_dataset(files))))
    before = _clone_sd(off.state_dict())
    opt.zero_grad()
    _loss(off, b).backward()
    opt.step()
    after = off.state_dict()
    for name in TABLES:
        assert torch.equal(after[f"{name}.weight"], before[f"{name}.weight"]), name
    assert not torch.equal(after["mlp.0.weight"], before["mlp.0.weight"])


# ----------------------------------------------------------------------------------
# more of a realistic loop: per-group options, accumulation, a forgotten no_grad


def test_param_groups_with_table_specific_options_match_torch_groups(files):
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(
        torch.optim.Adam,
        [
            {"params": [off.user, off.tags, off.cat]},
            {"params": off.mlp.parameters(), "lr": 0.01},
            {"params": off.hist, "lr": 0.2},
            {"params": off.item, "lr": 0.005, "betas": (0.8, 0.99)},
        ],
        lr=0.05,
    )
    ref_model = build_dense(files)
    r = ref_model
    ref_opt = torch.optim.Adam(
        [
            {"params": [r.user.weight, r.tags.weight, r.cat.weight]},
            {"params": r.mlp.parameters(), "lr": 0.01},
            {"params": [r.hist.weight], "lr": 0.2},
            {"params": [r.item.weight], "lr": 0.005, "betas": (0.8, 0.99)},
        ],
        lr=0.05,
    )
    ref = LazyDenseRef(ref_model, "adam")
    ref.opt = ref_opt
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.01, 0.2, 0.005]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for b in batches(build_loader(build_dataset(files)), 6):
        lo = off_step(off, opt, b)[0]
        lr_ = ref.step(b)[0]
        assert lo == pytest.approx(lr_, rel=1e-5, abs=1e-6)
        sched.step()
        ref_sched.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert opt.param_groups[2]["lr"] == pytest.approx(0.2 * 0.5**3)
    _assert_models_close(off, ref_model)


def test_modules_beside_group_dicts_share_the_keyword_options(files):
    """[model, {"params": model.head.parameters(), "lr": 0.01}]: what the dict names is
    left out of the model; everything else shares one group with the keyword options."""
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(
        torch.optim.SGD, [off, {"params": off.mlp.parameters(), "lr": 0.01}], lr=0.3
    )
    groups = sorted(opt.param_groups, key=lambda g: g["lr"])
    assert [g["lr"] for g in groups] == [0.01, 0.3]
    assert len(groups[0]["params"]) == 4  # the MLP's weights and biases only
    ref_model = build_dense(files)
    ref = LazyDenseRef(ref_model, "sgd")
    ref.opt = torch.optim.SGD(
        [
            {"params": [getattr(ref_model, n).weight for n in TABLES], "lr": 0.3},
            {"params": ref_model.mlp.parameters(), "lr": 0.01},
        ]
    )
    for b in batches(build_loader(build_dataset(files)), 4):
        lo = off_step(off, opt, b)[0]
        lr_ = ref.step(b)[0]
        assert lo == pytest.approx(lr_, rel=1e-5, abs=1e-6)
    _assert_models_close(off, ref_model)


def test_gradient_accumulation_over_two_micro_batches_matches_dense(files):
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    dense = build_dense(files)
    ref_opt = torch.optim.Adam(dense.parameters(), lr=0.05)
    bl = list(batches(build_loader(build_dataset(files)), 6))
    for b1, b2 in zip(bl[0::2], bl[1::2], strict=False):
        opt.zero_grad()
        (_loss(off, b1) / 2).backward()
        (_loss(off, b2) / 2).backward()
        opt.step()

        ref_opt.zero_grad()
        (_loss(dense, b1) / 2).backward()
        (_loss(dense, b2) / 2).backward()
        snaps = {}
        for name in TABLES:
            p = getattr(dense, name).weight
            ids = torch.cat([_looked_up(b1)[name], _looked_up(b2)[name]])
            untouched = torch.ones(p.shape[0], dtype=torch.bool)
            untouched[ids] = False
            snaps[name] = (
                untouched,
                p.detach().clone(),
                {
                    k: v.clone()
                    for k, v in ref_opt.state.get(p, {}).items()
                    if torch.is_tensor(v) and v.shape == p.shape
                },
            )
        ref_opt.step()
        with torch.no_grad():
            for name, (untouched, w0, st0) in snaps.items():
                p = getattr(dense, name).weight
                p[untouched] = w0[untouched]
                for k, v0 in st0.items():
                    ref_opt.state[p][k][untouched] = v0[untouched]
    _assert_models_close(off, dense)


def test_evaluation_forgetting_no_grad_does_not_disturb_training(files):
    """model.eval() without torch.no_grad(): the lookups are kept until the next step
    but get no gradient; the optimizer's zero_grad() throws them away, so training goes
    on as if the evaluation had not happened."""
    ds = build_dataset(files)
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ref = LazyDenseRef(build_dense(files), "adam")
    bl = list(batches(build_loader(ds), 6))
    for b in bl[:3]:
        off_step(off, opt, b)
        ref.step(b)
    off.eval()
    out = off(ds.gather(torch.arange(0, 40)))  # gradients enabled
    assert out.requires_grad
    off.train()
    del out
    for b in bl[3:]:
        lo = off_step(off, opt, b)[0]
        lr_ = ref.step(b)[0]
        assert lo == pytest.approx(lr_, rel=1e-5, abs=1e-6)
    _assert_models_close(off, ref.model)


def test_loading_rows_while_a_gradient_waits_is_refused_and_changes_nothing(files):
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, off, lr=0.05)
    ref = LazyDenseRef(build_dense(files), "adam")
    bl = list(batches(build_loader(build_dataset(files)), 3))
    off_step(off, opt, bl[0])
    ref.step(bl[0])
    # the next step's forward and backward, then an attempt to load rows before step()
    opt.zero_grad()
    loss = _loss(off, bl[1])
    loss.backward()
    before = _snapshot(off, opt)
    other = {k: torch.zeros_like(v) for k, v in off.state_dict().items()}
    # "a module's load_state_dict reports what it refuses as torch's does, in torch's
    # RuntimeError"
    with pytest.raises(RuntimeError, match="step"):
        off.user.load_state_dict({"weight": other["user.weight"]})
    with pytest.raises(gl.GadgetError):
        off.user.weight.insertData(torch.zeros(2, DIM), torch.tensor([0, 1]))
    with pytest.raises(gl.GadgetError):
        off.tags.weight.fill_(0.0)
    after = _snapshot(off, opt)
    _assert_sd_equal(before[0], after[0], "model")
    _assert_sd_equal(before[1], after[1], "optimizer")
    opt.step()
    ref.step(bl[1])
    lo = off_step(off, opt, bl[2])[0]
    lr_ = ref.step(bl[2])[0]
    assert lo == pytest.approx(lr_, rel=1e-5, abs=1e-6)
    _assert_models_close(off, ref.model)


def test_step_with_closure_returns_the_loss_and_matches_dense(files):
    off = build_offloaded(files)
    opt = gl.OffloadedOptimizer(torch.optim.Adagrad, off, lr=0.1)
    ref = LazyDenseRef(build_dense(files), "adagrad")
    for b in batches(build_loader(build_dataset(files)), 4):

        def closure(b=b):
            opt.zero_grad()
            loss = _loss(off, b)
            loss.backward()
            return loss

        got = opt.step(closure)
        exp = ref.step(b)[0]
        assert torch.is_tensor(got)
        assert got.item() == pytest.approx(exp, rel=1e-5, abs=1e-6)
    _assert_models_close(off, ref.model)
