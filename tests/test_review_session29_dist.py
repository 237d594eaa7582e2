"""Black-box review (session 29) of gl.GadgetSampler, gl.GadgetLoader and gl.GadgetDataset
under a real torch.distributed process group (gloo, CPU only, 2 and 3 spawned ranks);
written from README.md, SPEC.md and the public docstrings only.

One spawn per world size runs every check in each rank and pickles the results to a
file; the tests below assert on them in the parent. CUDA is hidden in the children
(CUDA_VISIBLE_DEVICES="" and torch.cuda.is_available patched to return False) so the file
behaves the same on a GPU machine.

Documented claims checked (README "Ranks" / "Resume", GadgetSampler docstring "Ranks",
"Chunk order", ``num_replicas, rank``):
* "The sampler reads the world size and rank from torch.distributed (or takes
  num_replicas=, rank=)"; "Every rank gets the same number of batches";
* default / drop_last / pad share layouts of the docstring's *Ranks* section;
* "The order depends only on (seed, epoch): same on every rank and run";
* state_dict / load_state_dict per rank, "A state saved on one rank can be loaded on any
  rank of the same world size", a state of another world size refused, sampler unchanged;
* chunk order: "All rows of a chunk are therefore requested within one window", "ranks read
  disjoint chunks except at most one shared window per share boundary".

The docs say nothing about OffloadedEmbedding under DistributedDataParallel, so DDP is not
tested; each rank trains its own share without DDP against a plain-torch reference.
"""

import math
import os
import pickle
import warnings

if os.environ.get("GL_S29_DIST_CHILD") == "1":  # spawned rank: hide CUDA before gadgetloader loads
    import torch as _torch

    _torch.cuda.is_available = lambda: False

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp_mp

import gadgetloader as gl

WORLDS = (2, 3)
SIZES = {2: [1, 2, 7, 8, 9, 17, 40], 3: [2, 3, 7, 9, 10, 31]}
BATCHES = [1, 2, 3, 4]
ORDERS = ("sequential", "random")
MODES = ("default", "drop_last", "pad")
MODE_KW = {"default": {}, "drop_last": {"drop_last": True}, "pad": {"pad": True}}

NPY_ROWS, NPY_BLOCK, NPY_BATCH, NPY_WINDOW = 203, 8, 5, 3
H5_ROWS, H5_CHUNK, H5_BATCH = 400, 10, 7
RESUME_N, RESUME_B = 50, 4


def _seed(n, b):
    return 7 * n + b


# ---------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------


def _err(e):
    return {
        "err": type(e).__name__,
        "msg": str(e),
        "is_gadget_value": isinstance(e, gl.GadgetValueError),
        "is_gadget_type": isinstance(e, gl.GadgetTypeError),
        "is_gadget": isinstance(e, gl.GadgetError),
        "is_value": isinstance(e, ValueError),
    }


def _rec(res, name, fn):
    try:
        res[name] = {"ok": fn()}
    except Exception as e:  # noqa: BLE001 - every outcome is reported to the parent
        res[name] = _err(e)


def _batches(it):
    return [b.tolist() for b in it]


def _sampler_info(s):
    out = {"len": len(s), "nr": s.num_replicas, "rk": s.rank}
    out["batches"] = _batches(s)
    out["epoch_after"] = s.epoch
    out["order0"] = s.epoch_order(0).tolist()
    return out


def _ybatches(loader):
    return [(b[0].tolist(), b[1].tolist(), b[0].device.type) for b in loader]


def _child_checks(rank, world, files, res):
    import torch.distributed as dist

    res["env"] = {
        "cuda": torch.cuda.is_available(),
        "dist_init": dist.is_initialized(),
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
    }

    # -- shares for every size / batch / order / mode, default ranks from the group ----------
    for n in SIZES[world]:
        for b in BATCHES:
            for order in ORDERS:
                for mode in MODES:
                    _rec(
                        res,
                        ("share", n, b, order, mode),
                        lambda n=n, b=b, order=order, mode=mode: _sampler_info(
                            gl.GadgetSampler(
                                n, batch_size=b, order=order, seed=_seed(n, b), **MODE_KW[mode]
                            )
                        ),
                    )
                _rec(
                    res,
                    ("solo_order", n, b, order),
                    lambda n=n, b=b, order=order: (
                        gl.GadgetSampler(
                            n, batch_size=b, order=order, seed=_seed(n, b), num_replicas=1, rank=0
                        )
                        .epoch_order(0)
                        .tolist()
                    ),
                )
    _rec(
        res,
        "pad_and_drop_last",
        lambda: gl.GadgetSampler(40, batch_size=2, drop_last=True, pad=True),
    )

    # -- epochs -----------------------------------------------------------------------------
    def epochs():
        s = gl.GadgetSampler(23, batch_size=3, order="random", seed=4)
        first, second = _batches(s), _batches(s)
        s2 = gl.GadgetSampler(23, batch_size=3, order="random", seed=4)
        s2.set_epoch(1)
        e1 = _batches(s2)
        s3 = gl.GadgetSampler(23, batch_size=3, order="random", seed=4)
        s3.set_epoch(5)
        e5 = _batches(s3)
        return {
            "first": first,
            "second": second,
            "set1": e1,
            "set5": e5,
            "order1": s.epoch_order(1).tolist(),
            "order5": s.epoch_order(5).tolist(),
            "epoch_after_two": s.epoch,
        }

    _rec(res, "epochs", epochs)

    # -- explicit num_replicas / rank override the group ------------------------------------
    _rec(
        res,
        "ov_solo",
        lambda: _sampler_info(
            gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=1, rank=0)
        ),
    )
    _rec(
        res,
        "ov_doc_example",
        lambda: _sampler_info(
            gl.GadgetSampler(9, batch_size=2, order="sequential", num_replicas=2, rank=rank % 2)
        ),
    )
    _rec(
        res,
        "ov_other_rank",
        lambda: _sampler_info(
            gl.GadgetSampler(
                23,
                batch_size=3,
                order="random",
                seed=5,
                num_replicas=world,
                rank=(rank + 1) % world,
            )
        ),
    )
    _rec(
        res,
        "ov_own_default",
        lambda: _sampler_info(gl.GadgetSampler(23, batch_size=3, order="random", seed=5)),
    )
    _rec(
        res,
        "ov_rank_only",
        lambda: _sampler_info(
            gl.GadgetSampler(23, batch_size=3, order="random", seed=5, rank=(rank + 1) % world)
        ),
    )
    _rec(
        res,
        "ov_nr_only",
        lambda: _sampler_info(
            gl.GadgetSampler(23, batch_size=3, order="random", seed=5, num_replicas=world)
        ),
    )
    _rec(
        res,
        "ov_bigger",
        lambda: _sampler_info(
            gl.GadgetSampler(
                29, batch_size=2, order="random", seed=6, num_replicas=world + 2, rank=rank + 1
            )
        ),
    )
    _rec(
        res,
        "ov_bad_rank_high",
        lambda: gl.GadgetSampler(23, batch_size=3, num_replicas=world, rank=world),
    )
    _rec(
        res,
        "ov_bad_rank_neg",
        lambda: gl.GadgetSampler(23, batch_size=3, num_replicas=world, rank=-1),
    )
    _rec(res, "ov_bad_nr_zero", lambda: gl.GadgetSampler(23, batch_size=3, num_replicas=0, rank=0))

    # -- GadgetLoader / DataLoader over a GadgetDataset -------------------------------------
    n = 37
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n, dtype=np.int64)
    ds = gl.GadgetDataset(x, y, placement="cpu", device="cpu")
    res["ds_device"] = str(ds.device)
    for mode in MODES:

        def loader_run(mode=mode):
            ld = gl.GadgetLoader(ds, batch_size=4, order="random", seed=3, **MODE_KW[mode])
            ref = gl.GadgetSampler(ds, batch_size=4, order="random", seed=3, **MODE_KW[mode])
            return {
                "len": len(ld),
                "nr": ld.sampler.num_replicas,
                "rk": ld.sampler.rank,
                "batches": _ybatches(ld),
                "ref": _batches(ref),
            }

        _rec(res, ("loader", mode), loader_run)
    _rec(
        res,
        "loader_solo",
        lambda: {
            "batches": _ybatches(
                gl.GadgetLoader(ds, batch_size=5, order="sequential", num_replicas=1, rank=0)
            )
        },
    )

    def dl_batch_sampler():
        from torch.utils.data import DataLoader

        s = gl.GadgetSampler(ds, batch_size=4, order="random", seed=8)
        ids = _batches(s)
        s.set_epoch(0)
        got = [(bx.tolist(), by.tolist()) for bx, by in DataLoader(ds, batch_sampler=s)]
        return {"ids": ids, "got": got}

    _rec(res, "dl_batch_sampler", dl_batch_sampler)

    def loader_conflict():
        s = gl.GadgetSampler(ds, batch_size=4)
        return gl.GadgetLoader(ds, sampler=s, num_replicas=world)

    _rec(res, "loader_conflict", loader_conflict)

    # -- resume --------------------------------------------------------------------------
    def full_run():
        s = gl.GadgetSampler(RESUME_N, batch_size=RESUME_B, order="random", seed=11)
        return [_batches(s), _batches(s)]

    _rec(res, "resume_full", full_run)
    nb = len(gl.GadgetSampler(RESUME_N, batch_size=RESUME_B))
    states = {}
    for k in (0, 3, nb):

        def resumed(k=k):
            s = gl.GadgetSampler(RESUME_N, batch_size=RESUME_B, order="random", seed=11)
            it = iter(s)
            for _ in range(k):
                next(it)
            st = s.state_dict()
            states[k] = st
            s2 = gl.GadgetSampler(RESUME_N, batch_size=RESUME_B, order="random", seed=99)
            s2.load_state_dict(st)
            out = {"passes": [_batches(s2), _batches(s2)]}
            s3 = gl.GadgetSampler(RESUME_N, batch_size=RESUME_B, order="random", seed=99)
            s3.load_state_dict(st)
            s3.set_epoch(0)
            out["set_epoch_same"] = _batches(s3)
            return out

        _rec(res, ("resume", k), resumed)

    # cross-rank: every rank loads the state saved on the next rank (same world size)
    gathered = [None] * world
    dist.all_gather_object(gathered, states.get(3))
    res["gathered_states_none"] = [g is None for g in gathered]

    def cross():
        st = gathered[(rank + 1) % world]
        s = gl.GadgetSampler(RESUME_N, batch_size=RESUME_B, order="random", seed=0)
        s.load_state_dict(st)
        return _batches(s)

    _rec(res, "resume_cross", cross)

    def wrong_world(direction):
        if direction == "bigger_state":
            other = gl.GadgetSampler(
                RESUME_N,
                batch_size=RESUME_B,
                order="random",
                seed=11,
                num_replicas=world + 1,
                rank=0,
            )
            target = gl.GadgetSampler(RESUME_N, batch_size=RESUME_B, order="random", seed=11)
        else:
            other = gl.GadgetSampler(RESUME_N, batch_size=RESUME_B, order="random", seed=11)
            target = gl.GadgetSampler(
                RESUME_N, batch_size=RESUME_B, order="random", seed=11, num_replicas=1, rank=0
            )
        it = iter(other)
        next(it)
        st = other.state_dict()
        it2 = iter(target)
        next(it2)
        next(it2)
        before = target.state_dict()
        out = {}
        try:
            target.load_state_dict(st)
            out["loaded"] = True
        except Exception as e:  # noqa: BLE001
            out["error"] = _err(e)
        out["state_same"] = pickle.dumps(target.state_dict()) == pickle.dumps(before)
        out["rest_of_old_iter"] = [b.tolist() for b in it2]
        fresh = gl.GadgetSampler(
            RESUME_N,
            batch_size=RESUME_B,
            order="random",
            seed=11,
            **({} if direction == "bigger_state" else {"num_replicas": 1, "rank": 0}),
        )
        out["expected"] = _batches(fresh)
        return out

    _rec(res, ("wrong_world", "bigger_state"), lambda: wrong_world("bigger_state"))
    _rec(res, ("wrong_world", "solo_target"), lambda: wrong_world("solo_target"))

    def loader_resume():
        full = gl.GadgetLoader(ds, batch_size=4, order="random", seed=7)
        full_b = [_ybatches(full), _ybatches(full)]
        ld = gl.GadgetLoader(ds, batch_size=4, order="random", seed=7)
        it = iter(ld)
        next(it)
        next(it)
        st = ld.state_dict()
        ld2 = gl.GadgetLoader(ds, batch_size=4, order="random", seed=1)
        ld2.load_state_dict(st)
        mid = [_ybatches(ld2), _ybatches(ld2)]
        ld3 = gl.GadgetLoader(ds, batch_size=4, order="random", seed=7)
        _ybatches(ld3)
        st_end = ld3.state_dict()
        ld4 = gl.GadgetLoader(ds, batch_size=4, order="random", seed=2)
        ld4.load_state_dict(st_end)
        end = _ybatches(ld4)
        ld5 = gl.GadgetLoader(ds, batch_size=4, order="random", seed=7)
        ld5.set_epoch(1)
        e1 = _ybatches(ld5)
        return {"full": full_b, "mid": mid, "end": end, "set1": e1, "state2": st}

    _rec(res, "loader_resume", loader_resume)

    lstates = [None] * world
    dist.all_gather_object(lstates, res["loader_resume"].get("ok", {}).get("state2"))

    def loader_cross():
        ld = gl.GadgetLoader(ds, batch_size=4, order="random", seed=0)
        ld.load_state_dict(lstates[(rank + 1) % world])
        return _ybatches(ld)

    _rec(res, "loader_cross", loader_cross)

    def loader_wrong_world():
        ld = gl.GadgetLoader(ds, batch_size=4, order="random", seed=7, num_replicas=1, rank=0)
        it = iter(ld)
        next(it)
        before = ld.state_dict()
        out = {}
        try:
            ld.load_state_dict(lstates[rank])
            out["loaded"] = True
        except Exception as e:  # noqa: BLE001
            out["error"] = _err(e)
        out["state_same"] = pickle.dumps(ld.state_dict()) == pickle.dumps(before)
        return out

    _rec(res, "loader_wrong_world", loader_wrong_world)

    def stateful_dl():
        from torchdata.stateful_dataloader import StatefulDataLoader

        s = gl.GadgetSampler(ds, batch_size=4, order="random", seed=12)
        full = [by.tolist() for _, by in StatefulDataLoader(ds, batch_sampler=s)]
        s1 = gl.GadgetSampler(ds, batch_size=4, order="random", seed=12)
        dl = StatefulDataLoader(ds, batch_sampler=s1)
        it = iter(dl)
        first = [next(it)[1].tolist() for _ in range(2)]
        sd = dl.state_dict()
        s2 = gl.GadgetSampler(ds, batch_size=4, order="random", seed=0)
        dl2 = StatefulDataLoader(ds, batch_sampler=s2)
        dl2.load_state_dict(sd)
        rest = [by.tolist() for _, by in dl2]
        return {"full": full, "first": first, "rest": rest}

    _rec(res, "stateful_dl", stateful_dl)

    _rec(
        res,
        "big_seed",
        lambda: _sampler_info(gl.GadgetSampler(31, batch_size=3, order="random", seed=2**64 - 1)),
    )

    # -- chunk order over file-backed columns --------------------------------------------
    def chunk_npy():
        dsf = gl.GadgetDataset(
            files["npy"], np.arange(NPY_ROWS), placement="file", device="cpu", block_rows=NPY_BLOCK
        )
        s = gl.GadgetSampler(
            dsf, batch_size=NPY_BATCH, order="chunk", window_chunks=NPY_WINDOW, seed=2
        )
        out = _sampler_info(s)
        out["chunk_rows"] = s.chunk_rows
        out["ds_chunk_rows"] = dsf.chunk_rows
        out["window_chunks"] = s.window_chunks
        s.set_epoch(0)
        out["loader"] = [(bx.tolist(), by.tolist()) for bx, by in gl.GadgetLoader(dsf, sampler=s)]
        plain = gl.GadgetSampler(
            NPY_ROWS,
            batch_size=NPY_BATCH,
            order="chunk",
            window_chunks=NPY_WINDOW,
            chunk_rows=NPY_BLOCK,
            seed=2,
        )
        out["plain_order"] = plain.epoch_order(0).tolist()
        # resume through GadgetLoader on the file dataset
        ld = gl.GadgetLoader(
            dsf, batch_size=NPY_BATCH, order="chunk", window_chunks=NPY_WINDOW, seed=2
        )
        it = iter(ld)
        first = [next(it)[1].tolist() for _ in range(2)]
        st = ld.state_dict()
        ld2 = gl.GadgetLoader(
            dsf, batch_size=NPY_BATCH, order="chunk", window_chunks=NPY_WINDOW, seed=0
        )
        ld2.load_state_dict(st)
        out["resume_first"] = first
        out["resume_rest"] = [b[1].tolist() for b in ld2]
        for mode in ("drop_last", "pad"):
            out[mode] = _sampler_info(
                gl.GadgetSampler(
                    dsf,
                    batch_size=NPY_BATCH,
                    order="chunk",
                    window_chunks=NPY_WINDOW,
                    seed=2,
                    **MODE_KW[mode],
                )
            )
        ldw = gl.GadgetLoader(
            dsf,
            batch_size=NPY_BATCH,
            order="chunk",
            window_chunks=NPY_WINDOW,
            seed=2,
            num_workers=1,
        )
        out["workers"] = [(bx.tolist(), by.tolist(), bx.device.type) for bx, by in ldw]
        dsf.close()
        return out

    _rec(res, "chunk_npy", chunk_npy)

    def chunk_h5():
        dsf = gl.GadgetDataset(
            files["h5"], np.arange(H5_ROWS), placement="file", device="cpu", dataset="x"
        )
        s = gl.GadgetSampler(dsf, batch_size=H5_BATCH, order="chunk", seed=3)
        out = _sampler_info(s)
        out["chunk_rows"] = s.chunk_rows
        out["ds_chunk_rows"] = dsf.chunk_rows
        out["window_chunks"] = s.window_chunks
        s.set_epoch(0)
        out["loader"] = [(bx.tolist(), by.tolist()) for bx, by in gl.GadgetLoader(dsf, sampler=s)]
        st_s = gl.GadgetSampler(dsf, batch_size=H5_BATCH, order="chunk", seed=3)
        it = iter(st_s)
        first = [next(it).tolist() for _ in range(3)]
        st = st_s.state_dict()
        s2 = gl.GadgetSampler(dsf, batch_size=H5_BATCH, order="chunk", seed=9)
        s2.load_state_dict(st)
        out["resume_first"] = first
        out["resume_rest"] = _batches(s2)
        dsf.close()
        return out

    _rec(res, "chunk_h5", chunk_h5)

    # -- a small training loop per rank (no DDP: the docs say nothing about it) -----------
    def train():
        torch.manual_seed(100 + rank)
        rows, dim = 20, 4
        ids = torch.randint(0, rows, (30, 2))
        tgt = torch.randn(30)
        tds = gl.GadgetDataset(ids, tgt, placement="cpu", device="cpu")
        emb = gl.OffloadedEmbedding(rows, dim, placement="cpu", device="cpu")
        head = torch.nn.Linear(dim, 1)
        w0 = emb.state_dict()["weight"].clone()
        ref_emb = torch.nn.Embedding(rows, dim)
        with torch.no_grad():
            ref_emb.weight.copy_(w0)
        ref_head = torch.nn.Linear(dim, 1)
        ref_head.load_state_dict(head.state_dict())
        model = torch.nn.ModuleDict({"emb": emb, "head": head})
        opt = gl.OffloadedOptimizer(torch.optim.SGD, model, lr=0.05)
        ref_opt = torch.optim.SGD(list(ref_emb.parameters()) + list(ref_head.parameters()), lr=0.05)
        loader = gl.GadgetLoader(tds, batch_size=4, order="random", seed=1)
        seen = set()
        for _ in range(2):
            for bid, bt in loader:
                seen.update(bid.flatten().tolist())
                opt.zero_grad()
                loss = ((head(emb(bid).sum(1)).squeeze(-1) - bt) ** 2).mean()
                loss.backward()
                opt.step()
                ref_opt.zero_grad()
                rl = ((ref_head(ref_emb(bid).sum(1)).squeeze(-1) - bt) ** 2).mean()
                rl.backward()
                ref_opt.step()
        w = emb.state_dict()["weight"]
        unseen = sorted(set(range(rows)) - seen)
        return {
            "emb_maxdiff": float((w - ref_emb.weight.detach()).abs().max()),
            "head_maxdiff": float((head.weight - ref_head.weight).detach().abs().max()),
            "unseen_unchanged": bool(torch.equal(w[unseen], w0[unseen])) if unseen else True,
            "seen_changed": bool(not torch.equal(w[sorted(seen)], w0[sorted(seen)])),
            "nbatches": len(loader),
        }

    _rec(res, "train", train)


def _child(rank, world, initdir, outdir, files):
    import torch.distributed as dist

    torch.set_num_threads(1)
    res = {}
    dist.init_process_group(
        "gloo", init_method=f"file://{initdir}/init", rank=rank, world_size=world
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _child_checks(rank, world, files, res)
        res["warnings"] = [(w.category.__name__, str(w.message), w.filename) for w in caught]
    finally:
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(res, f)
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------

_RUNS = {}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("s29_files")
    xn = np.arange(NPY_ROWS * 3, dtype=np.float32).reshape(NPY_ROWS, 3)
    npy = d / "x.npy"
    np.save(npy, xn)
    out = {"npy": str(npy), "xnpy": xn}
    try:
        import h5py
    except ImportError:  # pragma: no cover - h5py is in the test extra
        out["h5"] = None
        return out
    xh = np.arange(H5_ROWS * 2, dtype=np.float32).reshape(H5_ROWS, 2) * 0.5
    h5 = d / "x.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("x", data=xh, chunks=(H5_CHUNK, 2))
    out["h5"] = str(h5)
    out["xh5"] = xh
    return out


def _run(world, tmp_path_factory, files):
    if world not in _RUNS:
        d = tmp_path_factory.mktemp(f"s29_world{world}")
        initdir, outdir = d / "init", d / "out"
        initdir.mkdir()
        outdir.mkdir()
        child_files = {"npy": files["npy"], "h5": files["h5"]}
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CUDA_VISIBLE_DEVICES", "")
            mp.setenv("GL_S29_DIST_CHILD", "1")
            tmp_mp.start_processes(
                _child,
                args=(world, str(initdir), str(outdir), child_files),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
        runs = []
        for r in range(world):
            with open(outdir / f"rank{r}.pkl", "rb") as f:
                runs.append(pickle.load(f))
        _RUNS[world] = runs
    return _RUNS[world]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def run(request, tmp_path_factory, files):
    return request.param, _run(request.param, tmp_path_factory, files)


def _ok(entry):
    assert "ok" in entry, f"unexpected error: {entry}"
    return entry["ok"]


def _expected_positions(n, world, b, mode, r):
    """Positions of the epoch order that rank r yields, batch by batch (docstring *Ranks*);
    None where the docs say the sampler is refused."""
    if mode == "default":
        if n < world:
            return None
        q, m = divmod(n, world)
        share = q + (1 if r < m else 0)
        start = r * q + min(r, m)
        nb = math.ceil(q / b)
        out = [list(range(start + i * b, start + (i + 1) * b)) for i in range(nb - 1)]
        out.append(list(range(start + (nb - 1) * b, start + share)))
        return out
    if mode == "drop_last":
        k = n // (world * b)
        if k == 0:
            return None
        start = r * k * b
        return [list(range(start + i * b, start + (i + 1) * b)) for i in range(k)]
    k = math.ceil(n / (world * b))
    start = r * k * b
    return [[(start + i * b + j) % n for j in range(b)] for i in range(k)]


def _configs(world):
    return [(n, b) for n in SIZES[world] for b in BATCHES]


# -- environment ------------------------------------------------------------------------------


def test_children_ran_in_a_real_group_without_cuda(run):
    world, ranks = run
    for r, res in enumerate(ranks):
        assert res["env"] == {"cuda": False, "dist_init": True, "dist_rank": r, "dist_world": world}
        assert res["ds_device"] == "cpu"


def test_no_gadgetloader_warnings_in_ranks(run):
    _, ranks = run
    for res in ranks:
        ours = [w for w in res["warnings"] if "gadgetloader" in w[2]]
        assert ours == []


# -- shares from the group's world size and rank ----------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_default_num_replicas_and_rank_come_from_group(run, order):
    world, ranks = run
    bad = []
    for r, res in enumerate(ranks):
        for n, b in _configs(world):
            e = res[("share", n, b, order, "default")]
            if "ok" in e and (e["ok"]["nr"], e["ok"]["rk"]) != (world, r):
                bad.append((n, b, e["ok"]["nr"], e["ok"]["rk"]))
    assert bad == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_same_number_of_batches_on_every_rank(run, order, mode):
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        es = [res[("share", n, b, order, mode)] for res in ranks]
        if not all("ok" in e for e in es):
            continue
        lens = [e["ok"]["len"] for e in es]
        yielded = [len(e["ok"]["batches"]) for e in es]
        if len(set(lens)) != 1 or lens != yielded:
            bad.append((n, b, lens, yielded))
    assert bad == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_shares_match_documented_layout(run, order, mode):
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        for r, res in enumerate(ranks):
            e = res[("share", n, b, order, mode)]
            pos = _expected_positions(n, world, b, mode, r)
            if pos is None:
                continue  # refusals: see test_refused_sizes
            if "ok" not in e:
                bad.append((n, b, r, "error", e))
                continue
            o = e["ok"]["order0"]
            want = [[o[p] for p in batch] for batch in pos]
            if e["ok"]["batches"] != want:
                bad.append((n, b, r, e["ok"]["batches"], want))
    assert bad == [], bad[:3]


@pytest.mark.parametrize("order", ORDERS)
def test_default_union_covers_every_row_once_without_padding(run, order):
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        if n < world:
            continue
        rows = []
        for res in ranks:
            rows += [
                i for batch in _ok(res[("share", n, b, order, "default")])["batches"] for i in batch
            ]
        if sorted(rows) != list(range(n)):
            bad.append((n, b, sorted(rows)))
    assert bad == []


@pytest.mark.parametrize("order", ORDERS)
def test_default_batch_sizes(run, order):
    """Full batches, then one last batch of 1 to B rows, or B + 1 on ranks holding an extra
    row when n // R is a multiple of B."""
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        if n < world:
            continue
        q, m = divmod(n, world)
        for r, res in enumerate(ranks):
            sizes = [len(x) for x in _ok(res[("share", n, b, order, "default")])["batches"]]
            extra = r < m
            last_ok = (1 <= sizes[-1] <= b) or (extra and q % b == 0 and sizes[-1] == b + 1)
            if any(s != b for s in sizes[:-1]) or not last_ok or sum(sizes) != q + extra:
                bad.append((n, b, r, sizes))
    assert bad == []


@pytest.mark.parametrize("order", ORDERS)
def test_drop_last_rows_disjoint_and_only_tail_dropped(run, order):
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        if n < world * b:
            continue
        rows, order0 = [], None
        for res in ranks:
            e = _ok(res[("share", n, b, order, "drop_last")])
            order0 = e["order0"]
            rows += [i for batch in e["batches"] for i in batch]
            if any(len(batch) != b for batch in e["batches"]):
                bad.append((n, b, "short batch"))
        kept = n - n % (world * b)
        if len(rows) != len(set(rows)) or sorted(rows) != sorted(order0[:kept]):
            bad.append((n, b, rows))
        if n - len(rows) >= world * b:
            bad.append((n, b, "dropped too many"))
    assert bad == []


@pytest.mark.parametrize("order", ORDERS)
def test_pad_full_batches_cover_all_rows(run, order):
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        k = math.ceil(n / (world * b))
        rows = []
        for res in ranks:
            e = _ok(res[("share", n, b, order, "pad")])
            if [len(x) for x in e["batches"]] != [b] * k:
                bad.append((n, b, [len(x) for x in e["batches"]]))
            rows += [i for batch in e["batches"] for i in batch]
        if set(rows) != set(range(n)) or len(rows) != world * b * k:
            bad.append((n, b, rows))
    assert bad == []


@pytest.mark.parametrize("mode", MODES)
def test_refused_sizes(run, mode):
    """default needs n >= R; drop_last refuses n < R * B (GadgetValueError); pad never."""
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        must_refuse = (mode == "default" and n < world) or (mode == "drop_last" and n < world * b)
        for res in ranks:
            e = res[("share", n, b, "random", mode)]
            if must_refuse and not e.get("is_gadget_value"):
                bad.append((n, b, e if "ok" not in e else "accepted"))
            if not must_refuse and "ok" not in e:
                bad.append((n, b, e))
    assert bad == []


def test_pad_and_drop_last_exclusive(run):
    _, ranks = run
    for res in ranks:
        e = res["pad_and_drop_last"]
        assert "ok" not in e and e["is_gadget_value"], e


@pytest.mark.parametrize("order", ORDERS)
def test_epoch_order_same_on_every_rank(run, order):
    world, ranks = run
    for n, b in _configs(world):
        for mode in MODES:
            orders = [
                res[("share", n, b, order, mode)].get("ok", {}).get("order0") for res in ranks
            ]
            orders = [o for o in orders if o is not None]
            assert all(o == orders[0] for o in orders), (n, b, mode)
            if orders:
                assert sorted(orders[0]) == list(range(n))
                if order == "sequential":
                    assert orders[0] == list(range(n))


@pytest.mark.parametrize("mode", MODES)
def test_epoch_order_independent_of_world_size(run, mode):
    """'The order depends only on (seed, epoch)': the group's order is the one-rank order."""
    world, ranks = run
    bad = []
    for n, b in _configs(world):
        for res in ranks:
            e = res[("share", n, b, "random", mode)]
            if "ok" in e and e["ok"]["order0"] != _ok(res[("solo_order", n, b, "random")]):
                bad.append((n, b))
    assert bad == []


def test_random_order_is_shuffled(run):
    world, ranks = run
    o = _ok(ranks[0][("share", 40 if world == 2 else 31, 2, "random", "default")])["order0"]
    assert o != sorted(o)


def test_a_full_pass_advances_the_epoch(run):
    world, ranks = run
    for res in ranks:
        for n, b in _configs(world):
            e = res[("share", n, b, "random", "default")]
            if "ok" in e:
                assert e["ok"]["epoch_after"] == 1


# -- epochs -------------------------------------------------------------------------------------


def test_second_pass_equals_set_epoch_1(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["epochs"])
        assert e["second"] == e["set1"]
        assert e["first"] != e["second"]
        assert e["epoch_after_two"] == 2


@pytest.mark.parametrize("epoch", [1, 5])
def test_set_epoch_shares_partition_that_epochs_order(run, epoch):
    world, ranks = run
    key = "set1" if epoch == 1 else "set5"
    orders = [_ok(res["epochs"])[f"order{epoch}"] for res in ranks]
    assert all(o == orders[0] for o in orders)
    got = [i for res in ranks for batch in _ok(res["epochs"])[key] for i in batch]
    assert got == orders[0]  # contiguous shares in rank order, every row once


# -- explicit num_replicas / rank ---------------------------------------------------------------


def test_explicit_single_replica_yields_every_row_on_every_rank(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["ov_solo"])
        assert (e["nr"], e["rk"]) == (1, 0)
        assert e["batches"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]


def test_explicit_docstring_example_overrides_group(run):
    _, ranks = run
    want = {0: [[0, 1], [2, 3, 4]], 1: [[5, 6], [7, 8]]}
    for r, res in enumerate(ranks):
        e = _ok(res["ov_doc_example"])
        assert (e["nr"], e["rk"]) == (2, r % 2)
        assert e["batches"] == want[r % 2]


def test_explicit_rank_reads_another_ranks_share(run):
    world, ranks = run
    for r, res in enumerate(ranks):
        other = (r + 1) % world
        e = _ok(res["ov_other_rank"])
        assert e["rk"] == other
        assert e["batches"] == _ok(ranks[other]["ov_own_default"])["batches"]


def test_rank_alone_takes_world_size_from_group(run):
    world, ranks = run
    for r, res in enumerate(ranks):
        e = _ok(res["ov_rank_only"])
        assert (e["nr"], e["rk"]) == (world, (r + 1) % world)
        assert e["batches"] == _ok(ranks[(r + 1) % world]["ov_own_default"])["batches"]


def test_num_replicas_alone_takes_rank_from_group(run):
    world, ranks = run
    for r, res in enumerate(ranks):
        e = _ok(res["ov_nr_only"])
        assert (e["nr"], e["rk"]) == (world, r)
        assert e["batches"] == _ok(res["ov_own_default"])["batches"]


def test_explicit_larger_world_follows_layout(run):
    world, ranks = run
    for r, res in enumerate(ranks):
        e = _ok(res["ov_bigger"])
        assert (e["nr"], e["rk"]) == (world + 2, r + 1)
        pos = _expected_positions(29, world + 2, 2, "default", r + 1)
        assert e["batches"] == [[e["order0"][p] for p in batch] for batch in pos]


@pytest.mark.parametrize("key", ["ov_bad_rank_high", "ov_bad_rank_neg", "ov_bad_nr_zero"])
def test_invalid_explicit_rank_or_replicas_refused(run, key):
    _, ranks = run
    for res in ranks:
        e = res[key]
        assert "ok" not in e and e["is_gadget_value"] and e["is_value"], e


# -- GadgetLoader / DataLoader ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_loader_shards_over_group(run, mode):
    world, ranks = run
    n, b = 37, 4
    lens = set()
    ys = []
    for r, res in enumerate(ranks):
        e = _ok(res[("loader", mode)])
        assert (e["nr"], e["rk"]) == (world, r)
        assert e["len"] == len(e["batches"])
        lens.add(e["len"])
        ys += [i for _, yb, _ in e["batches"] for i in yb]
    assert len(lens) == 1
    if mode == "default":
        assert sorted(ys) == list(range(n))
    elif mode == "drop_last":
        assert len(ys) == len(set(ys)) == n - n % (world * b)
    else:
        assert set(ys) == set(range(n)) and len(ys) == world * b * math.ceil(n / (world * b))


@pytest.mark.parametrize("mode", MODES)
def test_loader_batches_are_the_samplers_rows(run, mode):
    _, ranks = run
    for res in ranks:
        e = _ok(res[("loader", mode)])
        assert [yb for _, yb, _ in e["batches"]] == e["ref"]
        for xb, yb, dev in e["batches"]:
            assert dev == "cpu"
            assert xb == [[3 * i, 3 * i + 1, 3 * i + 2] for i in yb]


def test_loader_explicit_single_replica(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["loader_solo"])
        assert [yb for _, yb, _ in e["batches"]] == [
            list(range(i, min(i + 5, 37))) for i in range(0, 37, 5)
        ]


def test_dataloader_batch_sampler_under_group(run):
    world, ranks = run
    allids = []
    for res in ranks:
        e = _ok(res["dl_batch_sampler"])
        assert [yb for _, yb in e["got"]] == e["ids"]
        for xb, yb in e["got"]:
            assert xb == [[3 * i, 3 * i + 1, 3 * i + 2] for i in yb]
        allids += [i for batch in e["ids"] for i in batch]
    assert sorted(allids) == list(range(37))


def test_loader_refuses_num_replicas_beside_sampler(run):
    _, ranks = run
    for res in ranks:
        e = res["loader_conflict"]
        assert "ok" not in e and e["is_gadget"], e


# -- resume -------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", ["start", "mid", "end"])
def test_sampler_resume_equals_uninterrupted(run, k):
    _, ranks = run
    for res in ranks:
        full = _ok(res["resume_full"])
        nb = len(full[0])
        kk = {"start": 0, "mid": 3, "end": nb}[k]
        e = _ok(res[("resume", kk)])
        if kk == nb:
            assert e["passes"] == [[], full[1]]  # one empty pass, then the next epoch
        else:
            assert e["passes"] == [full[0][kk:], full[1]]


@pytest.mark.parametrize("k", [0, 3])
def test_set_epoch_of_loaded_epoch_keeps_position(run, k):
    _, ranks = run
    for res in ranks:
        full = _ok(res["resume_full"])
        assert _ok(res[("resume", k)])["set_epoch_same"] == full[0][k:]


def test_state_from_another_rank_of_same_world_resumes_own_share(run):
    _, ranks = run
    for res in ranks:
        assert res["gathered_states_none"] == [False] * len(ranks)
        assert _ok(res["resume_cross"]) == _ok(res["resume_full"])[0][3:]


@pytest.mark.parametrize("direction", ["bigger_state", "solo_target"])
def test_state_of_another_world_size_refused_and_sampler_unchanged(run, direction):
    _, ranks = run
    for res in ranks:
        e = _ok(res[("wrong_world", direction)])
        assert "error" in e, "a state of another world size was accepted"
        assert e["error"]["is_gadget_value"] and e["error"]["is_value"], e["error"]
        assert e["state_same"]
        assert e["rest_of_old_iter"] == e["expected"][2:]


def test_loader_resume_mid_epoch(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["loader_resume"])
        assert e["mid"] == [e["full"][0][2:], e["full"][1]]


def test_loader_state_after_loop_points_at_next_epoch(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["loader_resume"])
        assert e["end"] == e["full"][1]


# -- chunk order over .npy / HDF5 files ---------------------------------------------------------


def _chunk_entry(ranks, which):
    out = []
    for res in ranks:
        e = res[which]
        out.append(_ok(e))
    return out


def _window_segments_ok(order, chunk, wc):
    """Positions split into consecutive windows, each holding all rows of wc whole chunks."""
    n = len(order)
    size = {}
    for i in range(n):
        size[i // chunk] = size.get(i // chunk, 0) + 1
    i = 0
    while i < n:
        seen, total, j = set(), 0, i
        while True:
            c = order[j] // chunk
            if c not in seen:
                seen.add(c)
                total += size[c]
            j += 1
            if len(seen) > wc:
                return False
            if j - i == total and (len(seen) == wc or j == n):
                break
            if j == n:
                return False
        i = j
    return True


CHUNK_CASES = ["chunk_npy", "chunk_h5"]


def _chunk_params(which):
    if which == "chunk_npy":
        return NPY_ROWS, NPY_BLOCK, NPY_BATCH
    return H5_ROWS, H5_CHUNK, H5_BATCH


@pytest.mark.parametrize("which", CHUNK_CASES)
def test_chunk_rows_taken_from_file_column(run, which):
    _, ranks = run
    n, chunk, b = _chunk_params(which)
    for e in _chunk_entry(ranks, which):
        assert e["ds_chunk_rows"] == chunk
        assert e["chunk_rows"] == chunk
        if which == "chunk_npy":
            assert e["window_chunks"] == NPY_WINDOW
        else:  # default: enough chunks to hold 16 batches, and at least 8
            assert e["window_chunks"] == max(8, math.ceil(16 * b / chunk))


@pytest.mark.parametrize("which", CHUNK_CASES)
def test_chunk_order_shares_partition_rows(run, which):
    world, ranks = run
    n, chunk, b = _chunk_params(which)
    es = _chunk_entry(ranks, which)
    assert all(e["order0"] == es[0]["order0"] for e in es)
    assert len({e["len"] for e in es}) == 1
    got = [i for e in es for batch in e["batches"] for i in batch]
    assert got == es[0]["order0"]  # contiguous shares in rank order
    assert sorted(got) == list(range(n))
    for r, e in enumerate(es):
        pos = _expected_positions(n, world, b, "default", r)
        assert e["batches"] == [[e["order0"][p] for p in batch] for batch in pos]


@pytest.mark.parametrize("which", CHUNK_CASES)
def test_chunk_order_window_structure(run, which):
    _, ranks = run
    n, chunk, _ = _chunk_params(which)
    e = _chunk_entry(ranks, which)[0]
    o = e["order0"]
    wc = e["window_chunks"]
    assert _window_segments_ok(o, chunk, wc)
    pos = {row: p for p, row in enumerate(o)}
    for c in range(math.ceil(n / chunk)):
        ps = [pos[i] for i in range(c * chunk, min(n, (c + 1) * chunk))]
        assert max(ps) - min(ps) < wc * chunk
    assert o != list(range(n))


@pytest.mark.parametrize("which", CHUNK_CASES)
def test_chunk_order_ranks_share_at_most_one_window_per_boundary(run, which):
    world, ranks = run
    n, chunk, _ = _chunk_params(which)
    es = _chunk_entry(ranks, which)
    wc = es[0]["window_chunks"]
    chunks = [{i // chunk for batch in e["batches"] for i in batch} for e in es]
    for a in range(world):
        for bb in range(a + 1, world):
            shared = chunks[a] & chunks[bb]
            if bb - a > 1:
                assert shared == set()
            else:
                assert len(shared) <= wc


@pytest.mark.parametrize("which", CHUNK_CASES)
def test_chunk_loader_values_match_file(run, which, files):
    _, ranks = run
    ref = files["xnpy"] if which == "chunk_npy" else files["xh5"]
    for e in _chunk_entry(ranks, which):
        assert [yb for _, yb in e["loader"]] == e["batches"]
        for xb, yb in e["loader"]:
            np.testing.assert_array_equal(np.asarray(xb, dtype=np.float32), ref[yb])


def test_chunk_order_with_explicit_chunk_rows_on_int(run):
    _, ranks = run
    for e in _chunk_entry(ranks, "chunk_npy"):
        assert e["plain_order"] == e["order0"]


@pytest.mark.parametrize("which", CHUNK_CASES)
def test_chunk_resume_equals_uninterrupted(run, which):
    _, ranks = run
    for e in _chunk_entry(ranks, which):
        assert e["resume_first"] + e["resume_rest"] == e["batches"]


# -- training per rank ---------------------------------------------------------------------------


def test_offloaded_embedding_training_per_rank_matches_torch(run):
    _, ranks = run
    for res in ranks:
        t = _ok(res["train"])
        assert t["emb_maxdiff"] < 1e-6
        assert t["head_maxdiff"] < 1e-6
        assert t["unseen_unchanged"] and t["seen_changed"]
        assert t["nbatches"] == math.ceil((30 // len(ranks)) / 4)


# -- more resume / loader / chunk edges ----------------------------------------------------------


def test_loader_set_epoch_1_equals_second_pass(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["loader_resume"])
        assert e["set1"] == e["full"][1]
        assert e["full"][0] != e["full"][1]


def test_loader_state_from_another_rank_resumes_own_share(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["loader_resume"])
        assert _ok(res["loader_cross"]) == e["full"][0][2:]


def test_stateful_dataloader_resume_per_rank(run):
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    _, ranks = run
    allids = []
    for res in ranks:
        e = _ok(res["stateful_dl"])
        assert e["first"] + e["rest"] == e["full"]
        allids += [i for b in e["full"] for i in b]
    assert sorted(allids) == list(range(37))


def test_largest_seed_shares_partition(run):
    world, ranks = run
    es = [_ok(res["big_seed"]) for res in ranks]
    assert all(e["order0"] == es[0]["order0"] for e in es)
    assert [i for e in es for b in e["batches"] for i in b] == es[0]["order0"]
    assert sorted(es[0]["order0"]) == list(range(31))


@pytest.mark.parametrize("mode", ["drop_last", "pad"])
def test_chunk_order_drop_last_and_pad_layout(run, mode):
    world, ranks = run
    es = [_ok(res["chunk_npy"])[mode] for res in ranks]
    default_order = _ok(ranks[0]["chunk_npy"])["order0"]
    for r, e in enumerate(es):
        assert e["order0"] == default_order
        pos = _expected_positions(NPY_ROWS, world, NPY_BATCH, mode, r)
        assert e["batches"] == [[e["order0"][p] for p in batch] for batch in pos]
    assert len({e["len"] for e in es}) == 1


def test_chunk_loader_with_worker_process_matches(run, files):
    _, ranks = run
    for res in ranks:
        e = _ok(res["chunk_npy"])
        assert [yb for _, yb, _ in e["workers"]] == e["batches"]
        for xb, yb, dev in e["workers"]:
            assert dev == "cpu"
            np.testing.assert_array_equal(np.asarray(xb, dtype=np.float32), files["xnpy"][yb])


def test_loader_refuses_state_of_group_world_size(run):
    _, ranks = run
    for res in ranks:
        e = _ok(res["loader_wrong_world"])
        assert "error" in e, "a loader state of another world size was accepted"
        assert e["error"]["is_gadget_value"], e["error"]
        assert e["state_same"]
