"""Review (session 10): ranks, worker processes and resume, as a training job meets them.

Real ``torch.distributed`` (gloo, 2 and 3 processes started with env:// rendezvous), DataLoader
workers (fork and spawn, persistent, prefetch_factor) over .npy / HDF5 / zarr / in-memory
columns, mid-epoch resume of the sampler and of ``GadgetLoader``, every order / drop_last /
pad / coalesce combination against ``len()``, and the structure of the ``chunk`` order.

Run as a script (``python this_file.py``) it is one rank of the distributed runs; the
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, REVIEW_OUT) says which.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta
from itertools import islice
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gadgetloader as gl
from gadgetloader.data._dataset import GadgetBatch

# ------------------------------------------------------------------------------------------
# helpers shared by the ranks and the tests
# ------------------------------------------------------------------------------------------


def _mem_ds(n: int) -> gl.GadgetDataset:
    """Features (n, 2) = (id, -id) as float64 and a label column = arange(n)."""
    ids = np.arange(n, dtype=np.int64)
    feats = np.stack([ids.astype(np.float64), -ids.astype(np.float64)], axis=1)
    return gl.GadgetDataset(feats, ids, placement="cpu", device="cpu")


def _labels(batch: Any) -> list[int]:
    return [int(v) for v in batch[-1].tolist()]


def _check_feats(batch: Any) -> None:
    f, y = batch[0], batch[-1]
    assert torch.equal(f[:, 0], y.to(torch.float64)) and torch.equal(f[:, 1], -y.to(torch.float64))


def _expected_sizes(n: int, R: int, r: int, B: int, mode: str) -> list[int]:
    """Batch sizes on rank r as the GadgetSampler docstring (*Ranks*) describes them."""
    if mode == "drop_last":
        return [B] * (n // (R * B))
    if mode == "pad":
        return [B] * (-(-n // (R * B)))
    q, extra = divmod(n, R)
    share = q + (1 if r < extra else 0)
    nb = -(-q // B)
    return [B] * (nb - 1) + [share - (nb - 1) * B]


def _mode_kwargs(mode: str) -> dict[str, bool]:
    return {"drop_last": mode == "drop_last", "pad": mode == "pad"}


# ------------------------------------------------------------------------------------------
# the rank program (runs in subprocesses)
# ------------------------------------------------------------------------------------------

#: (name, n, batch, order, mode, form); form: 'dl' = DataLoader(batch_sampler=GadgetSampler)
#: with set_epoch each epoch, 'gl' = GadgetLoader (epochs advance by themselves),
#: 'dlw' = DataLoader with 2 fork workers
_DIST_CASES = [
    ("dl_seq_23_4", 23, 4, "sequential", "default", "dl"),
    ("dl_rand_23_4", 23, 4, "random", "default", "dl"),
    ("dl_rand_25_4", 25, 4, "random", "default", "dl"),  # n // R multiple of B on R=3
    ("dl_rand_24_4", 24, 4, "random", "default", "dl"),
    ("dl_rand_23_4_drop", 23, 4, "random", "drop_last", "dl"),
    ("dl_seq_23_4_drop", 23, 4, "sequential", "drop_last", "dl"),
    ("dl_rand_23_4_pad", 23, 4, "random", "pad", "dl"),
    ("dl_seq_23_4_pad", 23, 4, "sequential", "pad", "dl"),
    ("dl_chunk_37_3", 37, 3, "chunk", "default", "dl"),
    ("gl_rand_23_4", 23, 4, "random", "default", "gl"),
    ("gl_rand_23_4_pad", 23, 4, "random", "pad", "gl"),
    ("gl_rand_23_4_drop", 23, 4, "random", "drop_last", "gl"),
    ("gl_chunk_37_3_drop", 37, 3, "chunk", "drop_last", "gl"),
    ("dlw_rand_29_3", 29, 3, "random", "default", "dlw"),
    ("glw_chunk_29_3_pad", 29, 3, "chunk", "pad", "glw"),
    # world size larger than the table
    ("tiny_default", 1, 4, "random", "default", "dl"),
    ("tiny_pad", 1, 4, "random", "pad", "dl"),
    ("tiny_pad_gl", 1, 4, "sequential", "pad", "gl"),
    ("tiny_drop", 1, 4, "random", "drop_last", "dl"),
]
_EPOCHS = 3


def _dist_case(n: int, B: int, order: str, mode: str, form: str) -> dict[str, Any]:
    ds = _mem_ds(n)
    kw: dict[str, Any] = dict(order=order, seed=7, **_mode_kwargs(mode))
    if order == "chunk":
        kw["chunk_rows"] = 5
        kw["window_chunks"] = 2
    out: dict[str, Any] = {"epochs": []}
    if form == "gl":
        loader: Any = gl.GadgetLoader(ds, batch_size=B, **kw)
        sampler = loader.sampler
    elif form == "glw":
        loader = gl.GadgetLoader(
            ds,
            batch_size=B,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=True,
            **kw,
        )
        sampler = loader.sampler
    else:
        sampler = gl.GadgetSampler(ds, batch_size=B, **kw)
        if form == "dlw":
            loader = DataLoader(
                ds, batch_sampler=sampler, num_workers=2, multiprocessing_context="fork"
            )
        else:
            loader = DataLoader(ds, batch_sampler=sampler)
    out["world"] = [sampler.num_replicas, sampler.rank]
    out["len_sampler"], out["len_loader"] = len(sampler), len(loader)
    for epoch in range(_EPOCHS):
        if form == "dl":
            sampler.set_epoch(epoch)
        batches = []
        for b in loader:
            _check_feats(b)
            batches.append(_labels(b))
        out["epochs"].append(batches)
    return out


def _dist_resume(world: int, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    n, B, k = 41, 3, 2
    ds = _mem_ds(n)
    out: dict[str, Any] = {}
    # (a) sampler + DataLoader: state after k batches of epoch 1; rank 0's state goes to all
    s = gl.GadgetSampler(ds, batch_size=B, seed=3)
    s.set_epoch(1)
    it = iter(DataLoader(ds, batch_sampler=s))
    head = [_labels(next(it)) for _ in range(k)]
    mine = s.state_dict()
    box = [mine if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    state0 = box[0]
    fresh = gl.GadgetSampler(ds, batch_size=B, seed=3)
    fresh.load_state_dict(json.loads(json.dumps(state0)))  # via JSON, as a checkpoint might
    fresh.set_epoch(1)  # the DistributedSampler idiom: keeps the loaded position
    tail = [_labels(b) for b in DataLoader(ds, batch_sampler=fresh)]
    nxt = [_labels(b) for b in DataLoader(ds, batch_sampler=fresh)]
    ref = gl.GadgetSampler(ds, batch_size=B, seed=3)
    ref.set_epoch(1)
    full = [_labels(b) for b in DataLoader(ds, batch_sampler=ref)]
    full_next = [_labels(b) for b in DataLoader(ds, batch_sampler=ref)]
    out["sampler"] = {"head": head, "tail": tail, "next": nxt, "full": full, "full_next": full_next}
    # (b) GadgetLoader with coalesce=4: read-ahead must not count
    loader = gl.GadgetLoader(ds, batch_size=B, seed=5, coalesce=4)
    it2 = iter(loader)
    head2 = [_labels(next(it2)) for _ in range(k + 1)]
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    buf.seek(0)
    st = torch.load(buf, weights_only=True)
    l2 = gl.GadgetLoader(ds, batch_size=B, seed=5, coalesce=4)
    l2.load_state_dict(st)
    tail2 = [_labels(b) for b in l2]
    full2 = [_labels(b) for b in gl.GadgetLoader(ds, batch_size=B, seed=5)]
    out["loader"] = {"head": head2, "tail": tail2, "full": full2}
    # (c) the state in another world size / dataset size: refused
    errs = {}
    for what, make in (
        ("world1", lambda: gl.GadgetSampler(ds, batch_size=B, num_replicas=1, rank=0)),
        ("world+1", lambda: gl.GadgetSampler(ds, batch_size=B, num_replicas=world + 1, rank=0)),
        ("rows", lambda: gl.GadgetSampler(_mem_ds(n + 1), batch_size=B)),
        ("batch", lambda: gl.GadgetSampler(ds, batch_size=B + 1)),
    ):
        try:
            make().load_state_dict(state0)
            errs[what] = None
        except Exception as e:  # noqa: BLE001
            errs[what] = f"{type(e).__name__}: {e}"
    out["errors"] = errs
    return out


def _rank_main() -> None:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    res: dict[str, Any] = {"cases": {}}
    for name, n, B, order, mode, form in _DIST_CASES:
        try:
            res["cases"][name] = _dist_case(n, B, order, mode, form)
        except Exception as e:  # noqa: BLE001
            res["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
    try:
        res["resume"] = _dist_resume(world, rank)
    except Exception as e:  # noqa: BLE001
        res["resume"] = {"error": f"{type(e).__name__}: {e}"}
    # a DDP-like loop: one collective per batch must not hang (equal batch counts)
    try:
        loader = gl.GadgetLoader(_mem_ds(31), batch_size=4, seed=1)
        steps = 0
        for _ in range(2):
            for b in loader:
                t = torch.tensor([float(b[0].shape[0])])
                dist.all_reduce(t)
                steps += 1
        res["ddp_steps"] = steps
    except Exception as e:  # noqa: BLE001
        res["ddp_steps"] = f"{type(e).__name__}: {e}"
    # a file-backed chunk order: chunk_rows from the zarr file, shares read disjoint chunks
    try:
        zds = gl.GadgetDataset(
            os.environ["REVIEW_ZARR"], np.arange(N_FILE), placement="file", device="cpu"
        )
        zl = gl.GadgetLoader(zds, batch_size=10, order="chunk", window_chunks=2, seed=2)
        res["zarr_chunk"] = {
            "chunk_rows": zl.sampler.chunk_rows,
            "epochs": [[_labels(b) for b in zl] for _ in range(2)],
            "order0": zl.sampler.epoch_order(0).tolist(),
        }
    except Exception as e:  # noqa: BLE001
        res["zarr_chunk"] = {"error": f"{type(e).__name__}: {e}"}
    # explicit num_replicas=1, rank=0 under an initialised group: every row on every rank
    try:
        res["explicit_one"] = [
            _labels(b)
            for b in gl.GadgetLoader(
                _mem_ds(10), batch_size=4, order="sequential", num_replicas=1, rank=0
            )
        ]
    except Exception as e:  # noqa: BLE001
        res["explicit_one"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(os.environ["REVIEW_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, out_dir: str, zarr_path: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            REVIEW_OUT=out_dir,
            REVIEW_ZARR=zarr_path,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Runs the rank program with 2 and 3 processes (at once) and returns each rank's results."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    zd = tmp_path_factory.mktemp("distzarr")
    x = (np.arange(N_FILE * 3, dtype=np.float32).reshape(N_FILE, 3) * 1.5) - 7.0
    g = gl.DataGadget(x, placement="cpu", device="cpu")
    g.save(str(zd / "d.zarr"), chunk_rows=16)
    g.close()
    runs = {}
    for world in (2, 3):
        d = str(tmp_path_factory.mktemp(f"world{world}"))
        runs[world] = (d, _launch(world, d, str(zd / "d.zarr")))
    results: dict[int, list[dict[str, Any]]] = {}
    deadline = time.monotonic() + 90
    for world, (d, procs) in runs.items():
        logs = []
        for p in procs:
            try:
                outp, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                outp, _ = p.communicate()
            logs.append(outp.decode(errors="replace")[-3000:])
            assert p.returncode == 0, f"rank of world {world} failed:\n" + logs[-1]
        results[world] = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                results[world].append(json.load(f))
    return results


# ------------------------------------------------------------------------------------------
# distributed tests
# ------------------------------------------------------------------------------------------

_NORMAL = [c for c in _DIST_CASES if not c[0].startswith("tiny")]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", _NORMAL, ids=[c[0] for c in _NORMAL])
def test_dist_ranks_share_every_epoch_as_documented(dist_results, world, case) -> None:
    name, n, B, order, mode, form = case
    ranks = [res["cases"][name] for res in dist_results[world]]
    for r, got in enumerate(ranks):
        assert "error" not in got, got
        # world size and rank come from torch.distributed (nothing passed)
        assert got["world"] == [world, r]
    for epoch in range(_EPOCHS):
        per_rank = [got["epochs"][epoch] for got in ranks]
        counts = [len(b) for b in per_rank]
        # every rank yields the same number of batches, and len() says how many
        assert len(set(counts)) == 1, counts
        for got in ranks:
            assert got["len_sampler"] == got["len_loader"] == counts[0]
        for r, batches in enumerate(per_rank):
            assert [len(b) for b in batches] == _expected_sizes(n, world, r, B, mode), (r, epoch)
        flat = [i for batches in per_rank for b in batches for i in b]
        if mode == "default":
            assert sorted(flat) == list(range(n))  # every row exactly once over all ranks
        elif mode == "drop_last":
            assert len(flat) == len(set(flat)) == n - n % (world * B)
            assert n % (world * B) < world * B
        else:  # pad
            total = world * B * (-(-n // (world * B)))
            assert len(flat) == total and set(flat) == set(range(n))
        if order == "sequential":
            # rank order then batch order reads the epoch order (cyclic with pad)
            want = [p % n for p in range(len(flat))]
            assert flat == want
    if order != "sequential":
        e = [sorted(map(tuple, ranks[0]["epochs"][k])) for k in range(_EPOCHS)]
        assert e[0] != e[1] != e[2]  # reshuffled every epoch


@pytest.mark.parametrize("world", [2, 3])
def test_dist_world_larger_than_rows(dist_results, world) -> None:
    ranks = [res["cases"] for res in dist_results[world]]
    # default: "Needs n >= R" -> a clear error on every rank
    for c in ranks:
        assert "error" in c["tiny_default"] and "GadgetValueError" in c["tiny_default"]["error"]
        assert "error" in c["tiny_drop"] and "GadgetValueError" in c["tiny_drop"]["error"]
    # pad=True: every rank one full batch, cyclic repeats of the one row
    for name in ("tiny_pad", "tiny_pad_gl"):
        for c in ranks:
            got = c[name]
            assert "error" not in got, got
            assert got["len_sampler"] == got["len_loader"] == 1
            for ep in got["epochs"]:
                assert ep == [[0, 0, 0, 0]]


@pytest.mark.parametrize("world", [2, 3])
def test_dist_mid_epoch_resume_from_rank0_state(dist_results, world) -> None:
    for r, res in enumerate(dist_results[world]):
        got = res["resume"]
        assert "error" not in got, got
        s = got["sampler"]
        # rank r continues its own share from rank 0's position ("loaded on any rank")
        assert s["head"] + s["tail"] == s["full"], r
        assert s["next"] == s["full_next"], r
        lo = got["loader"]
        assert lo["head"] + lo["tail"] == lo["full"], r


@pytest.mark.parametrize("world", [2, 3])
def test_dist_state_from_other_world_or_dataset_is_refused(dist_results, world) -> None:
    for res in dist_results[world]:
        errs = res["resume"]["errors"]
        for key in ("world1", "world+1", "rows", "batch"):
            assert errs[key] is not None, key
            assert errs[key].startswith("GadgetValueError"), errs[key]
        assert "world size" in errs["world1"] and "world size" in errs["world+1"]
        assert "dataset" in errs["rows"]


@pytest.mark.parametrize("world", [2, 3])
def test_dist_file_backed_chunk_order(dist_results, world) -> None:
    ranks = [res["zarr_chunk"] for res in dist_results[world]]
    for got in ranks:
        assert "error" not in got, got
        assert got["chunk_rows"] == 16
        assert got["order0"] == ranks[0]["order0"]  # one order on every rank
    _window_structure(ranks[0]["order0"], N_FILE, 16, 2)
    for e in range(2):
        per = [got["epochs"][e] for got in ranks]
        assert len({len(p) for p in per}) == 1
        flat = [i for p in per for b in p for i in b]
        assert sorted(flat) == list(range(N_FILE))
        if e == 0:
            assert flat == ranks[0]["order0"]
        chunks = [{i // 16 for b in p for i in b} for p in per]
        for a in range(world - 1):
            assert len(chunks[a] & chunks[a + 1]) <= 2  # one shared window at most


@pytest.mark.parametrize("world", [2, 3])
def test_dist_explicit_single_replica_ignores_the_group(dist_results, world) -> None:
    for res in dist_results[world]:
        assert res["explicit_one"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("world", [2, 3])
def test_dist_ddp_loop_one_collective_per_batch(dist_results, world) -> None:
    steps = [res["ddp_steps"] for res in dist_results[world]]
    per = -(-(31 // world) // 4)
    assert steps == [2 * per] * world


# ------------------------------------------------------------------------------------------
# files for the worker and chunk tests
# ------------------------------------------------------------------------------------------

N_FILE = 300


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("files")
    x = (np.arange(N_FILE * 3, dtype=np.float32).reshape(N_FILE, 3) * 1.5) - 7.0
    np.save(d / "x.npy", x)
    g = gl.DataGadget(x, placement="cpu", device="cpu")
    g.save(str(d / "x.h5"), dataset="x", chunk_rows=20, compression="gzip")
    g.save(str(d / "x.zarr"), chunk_rows=16)
    g.save(str(d / "x25.zarr"), chunk_rows=25)
    g.save(str(d / "x50.h5"), dataset="x", chunk_rows=50, compression="gzip")
    g.close()
    return {
        "x": x,
        "npy": str(d / "x.npy"),
        "h5": str(d / "x.h5"),
        "zarr": str(d / "x.zarr"),
        "zarr25": str(d / "x25.zarr"),
        "h550": str(d / "x50.h5"),
    }


def _file_ds(files: dict[str, Any], **opts: Any) -> gl.GadgetDataset:
    x = files["x"]
    return gl.GadgetDataset(
        files["npy"],
        files["h5"],
        files["zarr"],
        x.copy(),
        np.arange(N_FILE),
        placement="file",
        device="cpu",
        **opts,
    )


def _check_file_batch(batch: Any, x: np.ndarray) -> list[int]:
    a, h, z, m, lab = batch
    want = torch.from_numpy(x[lab.numpy()])
    for col in (a, h, z, m):
        assert torch.equal(col, want)
    return lab.tolist()


# ------------------------------------------------------------------------------------------
# DataLoader workers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ctx,persistent,prefetch_factor",
    [("fork", False, 2), ("fork", True, 3), ("spawn", True, 4)],
)
def test_workers_every_row_once_per_epoch(files, ctx, persistent, prefetch_factor) -> None:
    x = files["x"]
    ds = _file_ds(files)
    # the main process reads every column first (a validation pass, say), then forks workers
    assert sorted(
        i for b in gl.GadgetLoader(ds, batch_size=64) for i in _check_file_batch(b, x)
    ) == list(range(N_FILE))
    s = gl.GadgetSampler(ds, batch_size=17, order="random", seed=2)
    dl = DataLoader(
        ds,
        batch_sampler=s,
        num_workers=2,
        multiprocessing_context=ctx,
        persistent_workers=persistent,
        prefetch_factor=prefetch_factor,
    )
    epochs = []
    for _ in range(2):
        seen: list[int] = []
        nb = 0
        for b in dl:
            seen += _check_file_batch(b, x)
            nb += 1
        assert nb == len(dl) == len(s)
        assert sorted(seen) == list(range(N_FILE))
        epochs.append(seen)
    ref = gl.GadgetSampler(N_FILE, batch_size=17, order="random", seed=2)
    assert epochs == [[i for b in ref for i in b.tolist()] for _ in range(2)]
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_gadgetloader_workers_resume_and_restart(files, ctx) -> None:
    """GadgetLoader with workers: state counts handed-out batches; a break restarts the epoch."""
    x = files["x"]
    ds = _file_ds(files)
    kw = dict(
        batch_size=16,
        order="chunk",
        seed=4,
        num_workers=2,
        multiprocessing_context=ctx,
        persistent_workers=True,
        prefetch_factor=4,
    )
    loader = gl.GadgetLoader(ds, **kw)
    full0 = [_check_file_batch(b, x) for b in loader]
    full1 = [_check_file_batch(b, x) for b in loader]
    assert len(full0) == len(full1) == len(loader)
    assert sorted(i for b in full0 for i in b) == list(range(N_FILE))
    assert full0 != full1
    loader.set_epoch(0)
    # break after 3 batches: workers have drawn more; the next pass restarts epoch 0
    it = iter(loader)
    head = [_check_file_batch(next(it), x) for _ in range(3)]
    assert head == full0[:3]
    state = loader.state_dict()
    del it
    again = [_check_file_batch(b, x) for b in loader]
    assert again == full0
    # resume in a new loader (new workers) from the state after 3 batches
    l2 = gl.GadgetLoader(ds, **kw)
    l2.load_state_dict(state)
    tail = [_check_file_batch(b, x) for b in l2]
    assert head + tail == full0
    assert [_check_file_batch(b, x) for b in l2] == full1
    # roll the same loader (persistent workers still up) back to the saved position
    l2.load_state_dict(state)
    it = iter(l2)
    for _ in range(4):
        next(it)
    l2.load_state_dict(state)
    assert [_check_file_batch(b, x) for b in l2] == tail


def test_default_form_and_sampler_form_with_workers(files) -> None:
    x = files["x"]
    ds = _file_ds(files)
    dl = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2, multiprocessing_context="fork")
    seen = [i for b in dl for i in _check_file_batch(b, x)]
    assert sorted(seen) == list(range(N_FILE))
    s = gl.GadgetSampler(ds, batch_size=32, order="sequential")
    dl2 = DataLoader(ds, sampler=s, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = []
    for b in dl2:
        assert isinstance(b, (list, tuple)) and len(b) == 5
        got.append(_check_file_batch(b, x))
    assert got == [list(range(i, min(i + 32, N_FILE))) for i in range(0, N_FILE, 32)]
    assert len(dl2) == len(s) == len(got)
    with pytest.raises(gl.GadgetValueError):
        next(iter(DataLoader(ds, sampler=s)))  # without batch_size=None: refused


def test_dataloader_workers_ddp_idiom_early_break(files) -> None:
    """set_epoch at the top of each epoch, early break: each epoch starts at its first batch."""
    x = files["x"]
    ds = _file_ds(files)
    s = gl.GadgetSampler(ds, batch_size=16, order="random", seed=3)
    dl = DataLoader(
        ds,
        batch_sampler=s,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
        prefetch_factor=4,
    )
    s2 = gl.GadgetSampler(ds, batch_size=16, order="random", seed=3)
    lo = gl.GadgetLoader(
        ds, sampler=s2, num_workers=2, multiprocessing_context="fork", persistent_workers=True
    )
    for epoch in range(3):
        ref = gl.GadgetSampler(N_FILE, batch_size=16, order="random", seed=3)
        ref.set_epoch(epoch)
        want = [b.tolist() for b in islice(ref, 3)]
        for sampler, loader in ((s, dl), (s2, lo)):
            sampler.set_epoch(epoch)
            got = []
            for i, b in enumerate(loader):
                got.append(_check_file_batch(b, x))
                if i == 2:
                    break
            assert got == want, epoch
    # GadgetLoader with workers: a break right after the last batch moves to the next epoch
    lo.set_epoch(0)
    e0 = [_check_file_batch(b, x) for b in lo]
    e1 = [_check_file_batch(b, x) for b in lo]
    lo.set_epoch(0)
    got = []
    for i, b in enumerate(lo):
        got.append(_check_file_batch(b, x))
        if i == len(lo) - 1:
            break
    assert got == e0
    assert [_check_file_batch(b, x) for b in lo] == e1


def test_workers_started_later_see_main_process_writes(files, tmp_path) -> None:
    """Non-persistent workers (fork) read rows the main process wrote between epochs."""
    x = files["x"]
    paths = []
    for ext in ("npy", "h5", "zarr"):
        p = str(tmp_path / f"w.{ext}")
        g = gl.DataGadget(x, placement="cpu", device="cpu")
        g.save(p, **({"chunk_rows": 16} if ext != "npy" else {}))
        g.close()
        paths.append(p)
    ds = gl.GadgetDataset(*paths, np.arange(N_FILE), placement="file", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=32, seed=0)
    dl = DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork")
    cur = x.copy()
    for epoch in range(2):
        for b in dl:
            lab = b[-1].numpy()
            for col in b[:-1]:
                assert np.array_equal(col.numpy(), cur[lab]), epoch
        ids = np.arange(0, N_FILE, 7)
        cur[ids] += 1000.0
        for g in ds.columns[:-1]:
            g.insertData(torch.from_numpy(cur[ids]), torch.from_numpy(ids))


class _IdsProbe(gl.GadgetDataset):
    """Records, in the worker, the storage size of the ids it was handed."""

    def __getitems__(self, indices):
        out = super().__getitems__(indices)
        nbytes = indices.untyped_storage().nbytes()
        return [GadgetBatch([*out[0], torch.tensor([nbytes])])]


def test_worker_receives_only_its_batch_ids() -> None:
    n = 50_000
    ds = _IdsProbe(np.arange(n), placement="cpu", device="cpu")
    s = gl.GadgetSampler(ds, batch_size=100, seed=0)
    dl = DataLoader(ds, batch_sampler=s, num_workers=2, multiprocessing_context="fork")
    sizes = [int(b[1]) for b in islice(dl, 6)]
    assert all(sz == 100 * 8 for sz in sizes), sizes  # not the 400 kB epoch order
    batch = next(iter(s))
    buf = io.BytesIO()
    torch.save(batch, buf)
    assert len(buf.getvalue()) < 10_000
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back) is torch.Tensor and torch.equal(back, batch)
    assert len(pickle.dumps(batch)) < 10_000


# ------------------------------------------------------------------------------------------
# GadgetLoader orders x options against the sampler, and len()
# ------------------------------------------------------------------------------------------

_COMBOS = [
    (order, mode, coal, prefetch)
    for order in ("sequential", "random", "chunk")
    for mode in ("default", "drop_last", "pad")
    for coal in (1, 3)
    for prefetch in (0, 2)
]


@pytest.mark.parametrize("order,mode,coal,prefetch", _COMBOS)
def test_gadgetloader_matches_sampler_every_combination(files, order, mode, coal, prefetch):
    x = files["x"]
    ds = _file_ds(files)
    kw: dict[str, Any] = dict(order=order, seed=11, **_mode_kwargs(mode))
    if order == "chunk":
        kw["window_chunks"] = 3
    for R, r in ((1, 0), (3, 2)):
        loader = gl.GadgetLoader(
            ds, batch_size=23, coalesce=coal, prefetch=prefetch, num_replicas=R, rank=r, **kw
        )
        ref = gl.GadgetSampler(ds, batch_size=23, num_replicas=R, rank=r, **kw)
        for _ in range(2):  # iterating twice: the second pass is the next epoch
            want = [b.tolist() for b in ref]
            got = [_check_file_batch(b, x) for b in loader]
            assert got == want
            assert len(loader) == len(ref) == len(got)
            assert [len(b) for b in got] == _expected_sizes(N_FILE, R, r, 23, mode)
        # break mid-epoch, then a full pass: the same (third) epoch from its start
        want = [b.tolist() for b in ref]
        part = [_check_file_batch(b, x) for b in islice(loader, 2)]
        again = [_check_file_batch(b, x) for b in loader]
        assert part == want[:2] and again == want


@pytest.mark.parametrize("n", [1, 2, 5, 23, 24, 25, 47, 48, 97])
@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("B", [1, 4, 8])
@pytest.mark.parametrize("mode", ["default", "drop_last", "pad"])
def test_len_matches_batches_all_ranks(n, R, B, mode) -> None:
    kw = _mode_kwargs(mode)
    expect_error = (mode == "default" and n < R) or (mode == "drop_last" and n < R * B)
    if expect_error:
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=0, **kw)
        return
    flat = []
    counts = []
    order = None
    for r in range(R):
        s = gl.GadgetSampler(n, batch_size=B, order="random", seed=1, num_replicas=R, rank=r, **kw)
        order = s.epoch_order(0).tolist()
        batches = [b.tolist() for b in s]
        assert len(batches) == len(s)
        assert [len(b) for b in batches] == _expected_sizes(n, R, r, B, mode)
        counts.append(len(batches))
        flat += [i for b in batches for i in b]
    assert len(set(counts)) == 1
    # contiguous shares of the epoch order, rank after rank (cyclic with pad)
    assert flat == [order[p % n] for p in range(len(flat))]
    if mode == "default":
        assert sorted(flat) == list(range(n))
        for r in range(R):  # the last batch holds at most B + 1 rows
            assert max(_expected_sizes(n, R, r, B, mode)) <= B + 1
    elif mode == "drop_last":
        assert len(set(flat)) == len(flat) and n - len(flat) < R * B
    else:
        assert set(flat) == set(range(n)) and len(flat) % (R * B) == 0


# ------------------------------------------------------------------------------------------
# mid-epoch resume
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["sequential", "random", "chunk"])
@pytest.mark.parametrize("mode", ["default", "drop_last", "pad"])
@pytest.mark.parametrize("R", [1, 3])
def test_sampler_resume_every_position(order, mode, R) -> None:
    n, B = 53, 4
    kw: dict[str, Any] = dict(order=order, seed=9, **_mode_kwargs(mode))
    if order == "chunk":
        kw.update(chunk_rows=6, window_chunks=2)
    for r in range(R):
        ref = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, **kw)
        ref.set_epoch(2)
        full = [b.tolist() for b in ref]
        nxt = [b.tolist() for b in ref]
        for k in range(len(full) + 1):
            s = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, **kw)
            s.set_epoch(2)
            it = iter(s)
            head = [next(it).tolist() for _ in range(k)]
            st = s.state_dict()
            st = json.loads(json.dumps(st))
            s2 = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, **kw)
            s2.load_state_dict(st)
            s2.set_epoch(2)  # the loaded epoch keeps the loaded position
            tail = [b.tolist() for b in s2]
            assert head + tail == full, (r, k)
            assert [b.tolist() for b in s2] == nxt, (r, k)


def test_sampler_state_loaded_on_another_rank() -> None:
    n, B, R = 50, 3, 3
    s0 = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=0, seed=1)
    it = iter(s0)
    for _ in range(4):
        next(it)
    st = s0.state_dict()
    for r in range(R):
        ref = [
            b.tolist() for b in gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, seed=1)
        ]
        s = gl.GadgetSampler(n, batch_size=B, num_replicas=R, rank=r, seed=1)
        s.load_state_dict(st)
        assert [b.tolist() for b in s] == ref[4:]


def test_resume_at_epoch_boundary_sampler_and_loader() -> None:
    ds = _mem_ds(30)
    s = gl.GadgetSampler(ds, batch_size=7, seed=5)
    e0 = [b.tolist() for b in s]
    e1 = [b.tolist() for b in s]
    # state taken inside the loop right after the last batch (what StatefulDataLoader saves)
    s = gl.GadgetSampler(ds, batch_size=7, seed=5)
    it = iter(s)
    for _ in range(len(s)):
        next(it)
    st = s.state_dict()
    assert (st["epoch"], st["position"]) == (0, len(s))
    fresh = gl.GadgetSampler(ds, batch_size=7, seed=5)
    fresh.load_state_dict(st)
    assert [b.tolist() for b in fresh] == []
    assert [b.tolist() for b in fresh] == e1
    # GadgetLoader: state after its last batch, inside the loop
    loader = gl.GadgetLoader(ds, batch_size=7, seed=5, coalesce=2)
    for i, _b in enumerate(loader):
        if i == len(loader) - 1:
            lst = loader.state_dict()
    l2 = gl.GadgetLoader(ds, batch_size=7, seed=5)
    l2.load_state_dict(lst)
    passes = [[_labels(b) for b in l2] for _ in range(2)]
    nonempty = [p for p in passes if p]
    assert nonempty[0] == e1  # nothing of epoch 0 again, epoch 1 next
    # state after the loop finished
    l3 = gl.GadgetLoader(ds, batch_size=7, seed=5)
    assert [_labels(b) for b in l3] == e0
    l4 = gl.GadgetLoader(ds, batch_size=7, seed=5)
    l4.load_state_dict(l3.state_dict())
    assert [_labels(b) for b in l4] == e1
    # breaking exactly after the last batch (no StopIteration): the next pass is epoch 1
    l5 = gl.GadgetLoader(ds, batch_size=7, seed=5, coalesce=3)
    got = []
    for i, b in enumerate(l5):
        got.append(_labels(b))
        if i == len(l5) - 1:
            break
    assert got == e0
    assert [_labels(b) for b in l5] == e1


@pytest.mark.parametrize("coal", [1, 2, 5])
@pytest.mark.parametrize("mode", ["default", "pad", "drop_last"])
def test_loader_resume_with_coalesce_and_set_epoch(coal, mode) -> None:
    ds = _mem_ds(61)
    kw = dict(batch_size=4, seed=2, coalesce=coal, num_replicas=2, rank=1, **_mode_kwargs(mode))
    ref = gl.GadgetLoader(ds, **kw)
    ref.set_epoch(3)
    full = [_labels(b) for b in ref]
    nxt = [_labels(b) for b in ref]
    for k in (0, 1, 3, len(full) - 1):
        lo = gl.GadgetLoader(ds, **kw)
        lo.set_epoch(3)
        it = iter(lo)
        head = [_labels(next(it)) for _ in range(k)]
        buf = io.BytesIO()
        torch.save(lo.state_dict(), buf)
        buf.seek(0)
        st = torch.load(buf, weights_only=True)
        l2 = gl.GadgetLoader(ds, **kw)
        l2.load_state_dict(json.loads(json.dumps(st)))
        l2.set_epoch(3)
        tail = [_labels(b) for b in l2]
        assert head + tail == full, k
        assert [_labels(b) for b in l2] == nxt, k


def test_state_for_other_settings_refused_and_leaves_sampler_unchanged() -> None:
    ds = _mem_ds(40)
    s = gl.GadgetSampler(ds, batch_size=4, num_replicas=2, rank=0, seed=1)
    it = iter(s)
    next(it)
    st = s.state_dict()
    bad = {
        "world": dict(num_replicas=4, rank=0),
        "world1": dict(num_replicas=1, rank=0),
        "batch": dict(batch_size=5, num_replicas=2, rank=0),
        "order": dict(order="sequential", num_replicas=2, rank=0),
        "drop": dict(drop_last=True, num_replicas=2, rank=0),
        "pad": dict(pad=True, num_replicas=2, rank=0),
    }
    for name, kw in bad.items():
        kw = {"batch_size": 4, **kw}
        t = gl.GadgetSampler(ds, seed=1, **kw)
        before = [b.tolist() for b in gl.GadgetSampler(ds, seed=1, **kw)]
        with pytest.raises(gl.GadgetValueError):
            t.load_state_dict(st)
        assert [b.tolist() for b in t] == before, name
    with pytest.raises(gl.GadgetValueError, match="size"):
        gl.GadgetSampler(41, batch_size=4, num_replicas=2, rank=0).load_state_dict(st)
    loader = gl.GadgetLoader(_mem_ds(41), batch_size=4, num_replicas=2, rank=0)
    with pytest.raises(gl.GadgetValueError):
        loader.load_state_dict({"sampler": st})
    # chunk layout
    c = gl.GadgetSampler(40, batch_size=4, order="chunk", chunk_rows=5, window_chunks=2)
    st_c = c.state_dict()
    for kw2 in (dict(chunk_rows=4, window_chunks=2), dict(chunk_rows=5, window_chunks=3)):
        with pytest.raises(gl.GadgetValueError):
            gl.GadgetSampler(40, batch_size=4, order="chunk", **kw2).load_state_dict(st_c)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("form", ["batch_sampler", "sampler"])
def test_stateful_dataloader_resumes_exactly(workers, form) -> None:
    """README: StatefulDataLoader(ds, batch_sampler=sampler) resumes mid-epoch exactly."""
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")
    ds = _mem_ds(47)

    def make():
        s = gl.GadgetSampler(ds, batch_size=4, seed=6, num_replicas=2, rank=1, pad=True)
        kw: dict[str, Any] = {"num_workers": workers}
        if workers:
            kw["multiprocessing_context"] = "fork"
        if form == "batch_sampler":
            return s, sdl_mod.StatefulDataLoader(ds, batch_sampler=s, **kw)
        return s, sdl_mod.StatefulDataLoader(ds, sampler=s, batch_size=None, **kw)

    s, dl = make()
    epochs = []
    for e in range(3):
        s.set_epoch(e)
        epochs.append([_labels(b) for b in dl])
    for k in (0, 2, len(epochs[1]) - 1, len(epochs[1])):
        s, dl = make()
        s.set_epoch(1)
        it = iter(dl)
        head = [_labels(next(it)) for _ in range(k)]
        buf = io.BytesIO()
        torch.save(dl.state_dict(), buf)
        del it
        buf.seek(0)
        st = torch.load(buf, weights_only=False)
        s2, dl2 = make()
        dl2.load_state_dict(st)
        out = []
        for e in (1, 2):
            s2.set_epoch(e)
            out.append([_labels(b) for b in dl2])
        assert head + out[0] == epochs[1], k
        assert out[1] == epochs[2], k


def test_sampler_resume_through_loader_after_break() -> None:
    """A GadgetLoader over a sampler follows the sampler's own load_state_dict / set_epoch."""
    ds = _mem_ds(45)
    s = gl.GadgetSampler(ds, batch_size=4, seed=8)
    loader = gl.GadgetLoader(ds, sampler=s, coalesce=4)
    full = [_labels(b) for b in loader]
    s.set_epoch(0)
    it = iter(loader)
    head = [_labels(next(it)) for _ in range(5)]
    st = loader.state_dict()["sampler"]
    assert st["position"] == 5
    list(islice(it, 2))
    s.load_state_dict(st)
    assert head + [_labels(b) for b in loader] == full
    s.set_epoch(0)
    assert [_labels(b) for b in loader] == full


# ------------------------------------------------------------------------------------------
# chunk order
# ------------------------------------------------------------------------------------------


def _window_structure(order: list[int], n: int, cr: int, wc: int) -> None:
    """The documented structure: chunks shuffled, taken wc at a time, each window's rows
    occupying consecutive positions (all rows of a chunk within one window)."""
    assert sorted(order) == list(range(n))
    pos = np.empty(n, dtype=np.int64)
    pos[np.asarray(order)] = np.arange(n)
    nch = -(-n // cr)
    first = sorted(range(nch), key=lambda c: pos[c * cr : min(n, (c + 1) * cr)].min())
    at = 0
    for w in range(0, nch, wc):
        chunks = first[w : w + wc]
        p = np.concatenate([pos[c * cr : min(n, (c + 1) * cr)] for c in chunks])
        assert p.min() == at and p.max() == at + p.size - 1, (w, chunks)
        at += p.size
    assert at == n


@pytest.mark.parametrize(
    "n,cr,wc", [(100, 10, 3), (97, 10, 4), (64, 8, 1), (50, 7, 100), (13, 5, 2)]
)
def test_chunk_order_structure(n, cr, wc) -> None:
    s = gl.GadgetSampler(n, batch_size=3, order="chunk", chunk_rows=cr, window_chunks=wc, seed=4)
    orders = []
    for e in range(3):
        o = s.epoch_order(e).tolist()
        _window_structure(o, n, cr, wc)
        orders.append(o)
        got = [i for b in s for i in b.tolist()]
        assert got == o
    assert orders[0] != orders[1]


def test_chunk_order_default_window_and_dataset_chunk_rows(files) -> None:
    ds = gl.GadgetDataset(files["zarr"], placement="file", device="cpu")
    assert ds.chunk_rows == 16
    s = gl.GadgetSampler(ds, batch_size=10, order="chunk")
    assert s.chunk_rows == 16
    # "enough chunks to hold 16 batches, and at least 8"
    assert s.window_chunks == max(8, math.ceil(16 * 10 / 16))
    _window_structure(s.epoch_order(0).tolist(), N_FILE, 16, s.window_chunks)
    # columns of different chunk sizes: the least common multiple (<= 2x the largest) ...
    ds2 = gl.GadgetDataset(files["zarr25"], files["h550"], placement="file", device="cpu")
    assert ds2.chunk_rows == 50
    ds3 = gl.GadgetDataset(files["zarr"], files["h5"], placement="file", device="cpu")
    assert ds3.chunk_rows == 20  # lcm(16, 20) = 80 > 2 * 20: the largest
    # in-memory tables have no chunk size
    with pytest.raises(gl.GadgetValueError):
        gl.GadgetSampler(_mem_ds(10), batch_size=2, order="chunk")


def test_chunk_order_reads_each_chunk_once_per_epoch(files) -> None:
    """A cache of two windows and batches no larger than a window: each chunk read once."""
    cr, wc, B = 16, 3, 24  # window = 48 rows, two batches
    row_nbytes = 3 * 4
    cache = 2 * wc * cr * row_nbytes
    ds = gl.GadgetDataset(
        files["zarr"], np.arange(N_FILE), placement="file", device="cpu", cache_bytes=cache
    )
    store = ds.columns[0].store
    nchunks = -(-N_FILE // cr)
    for e in range(2):
        loader = gl.GadgetLoader(ds, batch_size=B, order="chunk", window_chunks=wc, seed=e)
        before = store.stats["misses"]
        seen = []
        for b in loader:
            assert torch.equal(b[0], torch.from_numpy(files["x"][b[1].numpy()]))
            seen += b[1].tolist()
        assert sorted(seen) == list(range(N_FILE))
        # epoch 0 reads every chunk once; later epochs may find some still cached
        read = store.stats["misses"] - before
        assert (read == nchunks) if e == 0 else (read <= nchunks), (e, store.stats)
    # default window_chunks with a cache of exactly two of its windows
    s = gl.GadgetSampler(ds, batch_size=20, order="chunk", seed=3)
    ds2 = gl.GadgetDataset(
        files["zarr"],
        np.arange(N_FILE),
        placement="file",
        device="cpu",
        cache_bytes=2 * s.window_chunks * cr * row_nbytes,
    )
    st2 = ds2.columns[0].store
    for _b in gl.GadgetLoader(
        ds2, sampler=gl.GadgetSampler(ds2, batch_size=20, order="chunk", seed=3)
    ):
        pass
    assert st2.stats["misses"] == nchunks


def test_chunk_order_lcm_columns_read_each_chunk_once(files) -> None:
    """Columns chunked by 25 and 50 rows: the order's chunk is 50, each column's chunks read once."""
    wc = 2
    ds = gl.GadgetDataset(
        files["zarr25"],
        files["h550"],
        np.arange(N_FILE),
        placement="file",
        device="cpu",
        cache_bytes=2 * wc * 50 * 12,
    )
    assert ds.chunk_rows == 50
    for b in gl.GadgetLoader(ds, batch_size=30, order="chunk", window_chunks=wc, seed=1):
        assert torch.equal(b[0], torch.from_numpy(files["x"][b[2].numpy()]))
        assert torch.equal(b[1], b[0])
    assert ds.columns[0].store.stats["misses"] == N_FILE // 25
    assert ds.columns[1].store.stats["misses"] == N_FILE // 50


def test_chunk_order_ranks_read_disjoint_chunks() -> None:
    n, cr, wc, B, R = 400, 10, 3, 7, 4
    chunks = []
    for r in range(R):
        s = gl.GadgetSampler(
            n,
            batch_size=B,
            order="chunk",
            chunk_rows=cr,
            window_chunks=wc,
            num_replicas=R,
            rank=r,
            seed=6,
        )
        chunks.append({i // cr for b in s for i in b.tolist()})
    for a in range(R):
        for b in range(a + 1, R):
            shared = chunks[a] & chunks[b]
            # at most one shared window per share boundary
            assert len(shared) <= (wc if b == a + 1 else 0), (a, b, shared)


if __name__ == "__main__":
    _rank_main()
