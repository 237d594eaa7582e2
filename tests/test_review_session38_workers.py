"""Black-box review (session 38): the input pipeline inside DataLoader worker processes.

GadgetDataset, GadgetSampler, GadgetLoader and DataGadget stores (in RAM and file-backed:
.npy, HDF5, zarr) under ``torch.utils.data.DataLoader`` with ``num_workers > 0``, as
README's "Input pipeline" and "Files" sections document: the ``fork``, ``spawn`` and
``forkserver`` start methods, persistent workers, ``prefetch_factor``, ``worker_init_fn``,
the default form and the fast sampler forms, a store written in the parent after the
loader was made, a store closed while a loader iterates, epochs with ``set_epoch``,
resume from ``state_dict`` mid-epoch with workers, and the README's fork-safety
statements (a process that has used the library forks workers safely; what the parent
holds is not destroyed in a child, and nothing is held longer in the parent).

Every test checks rows against NumPy (each row exactly once per epoch, values equal) or
an exact documented error class. Placements and devices are given explicitly
(``placement='cpu'`` / ``'file'``, ``device='cpu'``), so the file runs the same on a GPU
host. Written from README.md, SPEC.md and the public docstrings only.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import gadgetloader as gl

h5py = pytest.importorskip("h5py")
pytest.importorskip("zarr")

HAS_FORK = "fork" in multiprocessing.get_all_start_methods()
HAS_FORKSERVER = "forkserver" in multiprocessing.get_all_start_methods()

pytestmark = [
    pytest.mark.filterwarnings("ignore::gadgetloader.FallbackWarning"),
    # Python 3.12+ warns on any fork of a multi-threaded process (zarr's I/O thread, the
    # sampler's order threads, the tests' own reader threads): not what is tested here
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
    pytest.mark.skipif(not HAS_FORK, reason="needs the fork start method"),
]

N = 37  # rows: not a multiple of any batch size used below


# --------------------------------------------------------------------------------------
# data: one source of truth per column, written to .npy, HDF5 (plain and gzip) and zarr
# --------------------------------------------------------------------------------------


def _x() -> np.ndarray:
    return (np.arange(N * 3, dtype=np.float32).reshape(N, 3) - 7.0) * 0.5


def _h() -> np.ndarray:
    return np.arange(N * 2, dtype=np.float64).reshape(N, 2) * 1.5 + 0.25


def _z() -> np.ndarray:
    return (np.arange(N * 2, dtype=np.int32).reshape(N, 2) * 3) - 40


@pytest.fixture()
def files(tmp_path):
    np.save(tmp_path / "x.npy", _x())
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f.create_dataset("d", data=_h())
    with h5py.File(tmp_path / "gz.h5", "w") as f:
        f.create_dataset("d", data=_h(), chunks=(5, 2), compression="gzip")
    src = gl.DataGadget(_z(), placement="cpu", device="cpu")
    src.save(str(tmp_path / "z.zarr"), chunk_rows=4)
    src.close()
    return tmp_path


def _file_tables(tmp_path, **kw) -> list[gl.DataGadget]:
    return [
        gl.DataGadget(str(tmp_path / "x.npy"), placement="file", device="cpu", **kw),
        gl.DataGadget(
            str(tmp_path / "plain.h5"), dataset="d", placement="file", device="cpu", **kw
        ),
        gl.DataGadget(str(tmp_path / "gz.h5"), dataset="d", placement="file", device="cpu", **kw),
        gl.DataGadget(str(tmp_path / "z.zarr"), placement="file", device="cpu", **kw),
    ]


def _refs() -> list[np.ndarray]:
    """Sources of the columns of :func:`_dataset`, in order (the last is the row id)."""
    return [_x(), _h(), _h(), _z(), _x() + 100, np.arange(N, dtype=np.int64)]


def _dataset(tmp_path) -> gl.GadgetDataset:
    """.npy, plain HDF5, gzip HDF5 and zarr file columns, a ``cpu`` float column and a
    ``cpu`` int64 column holding each row's id."""
    cols = _file_tables(tmp_path)
    cols.append(gl.DataGadget(_x() + 100, placement="cpu", device="cpu"))
    cols.append(gl.DataGadget(np.arange(N, dtype=np.int64), placement="cpu", device="cpu"))
    return gl.GadgetDataset(*cols, device="cpu")


def _check_batch(batch, refs) -> list[int]:
    ids = batch[-1]
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert len(batch) == len(refs)
    for k, (col, ref) in enumerate(zip(batch, refs, strict=True)):
        assert col.device.type == "cpu"
        want = torch.from_numpy(np.ascontiguousarray(ref[ids.numpy()]))
        assert col.dtype == want.dtype, (k, col.dtype, want.dtype)
        assert torch.equal(col, want), f"column {k} differs from NumPy at ids {ids.tolist()}"
    return ids.tolist()


def _check_epoch(batches, refs, n=N) -> list[int]:
    seen: list[int] = []
    for b in batches:
        seen += _check_batch(b, refs)
    assert sorted(seen) == list(range(n)), f"rows not seen exactly once: {sorted(seen)}"
    return seen


def _drain(it) -> None:
    """Drop a (possibly multi-process) iterator now, so its workers shut down here."""
    del it
    gc.collect()


# module-level helpers (picklable for spawn / forkserver workers)


def _record_worker(folder, worker_id):
    info = get_worker_info()
    ds = info.dataset
    rows = ds[[0, N - 1]]
    with open(os.path.join(folder, f"w{worker_id}-{os.getpid()}"), "w") as f:
        f.write(
            f"{info.num_workers} {len(ds)} {type(ds).__name__} "
            f"{rows[0].tolist()} {rows[-1].tolist()}"
        )


def _write_own_copy(worker_id):
    ds = get_worker_info().dataset
    ds.columns[0].insertData(torch.full((1, 3), -999.0), [0])


def _collect_in_worker(worker_id):
    gc.collect()  # the worker's collector runs over everything the fork handed it
    gc.collect()


# ======================================================================================
# start methods, persistent workers, prefetch_factor: every row once, values equal
# ======================================================================================


@pytest.mark.parametrize(
    "ctx,num_workers",
    [
        ("fork", 2),
        pytest.param(
            "forkserver",
            1,
            marks=pytest.mark.skipif(not HAS_FORKSERVER, reason="no forkserver here"),
        ),
    ],
)
def test_default_form_start_methods_persistent_two_epochs(files, ctx, num_workers):
    """README: ``for x, y in DataLoader(ds, batch_size=..., shuffle=True)``, the default form,
    with worker processes of each start method; persistent workers serve both epochs."""
    ds = _dataset(files)
    dl = DataLoader(
        ds,
        batch_size=5,
        shuffle=True,
        num_workers=num_workers,
        multiprocessing_context=ctx,
        persistent_workers=True,
        prefetch_factor=3,
    )
    orders = [_check_epoch(list(dl), _refs()) for _ in range(2)]
    assert len(orders[0]) == N
    del dl
    gc.collect()


@pytest.mark.parametrize("form", ["batch_sampler", "sampler_none", "gadgetloader"])
def test_sampler_forms_set_epoch_with_persistent_fork_workers(files, form):
    """``set_epoch(e)`` picks epoch e's order (also a jump ahead, and back); batches keep
    the sampler's order through persistent workers with ``prefetch_factor``."""
    ds = _dataset(files)
    kw = dict(num_workers=2, persistent_workers=True, prefetch_factor=4)
    if form == "gadgetloader":
        loader = gl.GadgetLoader(ds, batch_size=4, seed=11, multiprocessing_context="fork", **kw)
        sampler = loader.sampler
    else:
        sampler = gl.GadgetSampler(ds, batch_size=4, seed=11)
        if form == "batch_sampler":
            loader = DataLoader(ds, batch_sampler=sampler, multiprocessing_context="fork", **kw)
        else:
            loader = DataLoader(
                ds, sampler=sampler, batch_size=None, multiprocessing_context="fork", **kw
            )
    reference = gl.GadgetSampler(N, batch_size=4, seed=11)
    for epoch in (0, 1, 5, 2):
        sampler.set_epoch(epoch)
        seen = _check_epoch(list(loader), _refs())
        assert seen == reference.epoch_order(epoch).tolist(), epoch
    del loader
    gc.collect()


def test_gadgetloader_passes_worker_init_fn_and_prefetch_factor(files, tmp_path):
    """``**dataloader_kwargs`` go to the DataLoader: each worker runs ``worker_init_fn``
    once (persistent workers: once for both epochs) on a working copy of the dataset."""
    marks = tmp_path / "marks"
    marks.mkdir()
    ds = _dataset(files)
    loader = gl.GadgetLoader(
        ds,
        batch_size=6,
        seed=2,
        num_workers=2,
        persistent_workers=True,
        prefetch_factor=1,
        worker_init_fn=_bind(_record_worker, str(marks)),
        multiprocessing_context="fork",
    )
    for epoch in range(2):
        seen = _check_epoch(list(loader), _refs())
        assert seen == loader.sampler.epoch_order(epoch).tolist()
    del loader
    gc.collect()
    names = sorted(os.listdir(marks))
    assert [n.split("-")[0] for n in names] == ["w0", "w1"], names
    refs = _refs()
    for name in names:
        text = (marks / name).read_text()
        assert text.startswith(f"2 {N} GadgetDataset "), text
        assert str(refs[0][0].tolist()) in text and str(refs[-1][N - 1].tolist()) in text


class _bind:  # noqa: N801 - a picklable functools.partial stand-in with a readable repr
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self, *more):
        return self.fn(*self.args, *more)


def test_gadgetloader_over_a_file_datagadget_with_workers(files):
    """A DataGadget given to GadgetLoader becomes a one-column dataset; with workers its
    batches, in the sampler's order, are the table's rows."""
    z = gl.DataGadget(str(files / "z.zarr"), placement="file", device="cpu")
    loader = gl.GadgetLoader(z, batch_size=5, seed=3, num_workers=2, multiprocessing_context="fork")
    for epoch in range(2):
        batches = list(loader)
        assert all(len(b) == 1 and b[0].device == loader.device for b in batches)
        got = torch.cat([b[0].cpu() for b in batches])  # (GPU batches where CUDA is present)
        order = loader.sampler.epoch_order(epoch).numpy()
        assert torch.equal(got, torch.from_numpy(_z()[order])), epoch
    del loader
    gc.collect()


# ======================================================================================
# a store written in the parent after the loader was made
# ======================================================================================


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("form", ["default", "gadgetloader"])
def test_writes_after_loader_is_made_reach_workers_started_later(files, persistent, form):
    """README: "Each write reaches the file before it returns ... so workers started later
    read it". Workers (persistent ones too) start at the first ``iter()``: rows written
    after the loader was made but before that are seen, in every format and in RAM, also
    a write of part of the rows ``insertData(v, (ids, slice(0, 1)))``."""
    tables = _file_tables(files)
    tables.append(gl.DataGadget(_h(), placement="cpu", device="cpu"))
    ids_col = gl.DataGadget(np.arange(N, dtype=np.int64), placement="cpu", device="cpu")
    for t in tables:  # the parent has read every table (block caches filled)
        t.getData(torch.arange(N))
    ds = gl.GadgetDataset(*tables, ids_col, device="cpu")
    kw = dict(num_workers=2, persistent_workers=persistent, multiprocessing_context="fork")
    if form == "default":
        loader = DataLoader(ds, batch_size=6, shuffle=True, **kw)
    else:
        loader = gl.GadgetLoader(ds, batch_size=6, seed=1, **kw)

    refs = [_x(), _h(), _h(), _z(), _h()]
    rows = torch.tensor([0, 9, 36])
    for k, (t, ref) in enumerate(zip(tables, refs, strict=True)):
        new = (ref[rows.numpy()] * 0 + 7 + k).astype(ref.dtype)
        t.insertData(torch.from_numpy(new), rows)
        ref[rows.numpy()] = new
        part = np.asarray(ref[[4, 5], 0:1] - 3, dtype=ref.dtype)  # first value of rows 4 and 5
        t.insertData(torch.from_numpy(part), (torch.tensor([4, 5]), slice(0, 1)))
        ref[[4, 5], 0:1] = part
    want = refs + [np.arange(N, dtype=np.int64)]
    for t, ref in zip(tables, refs, strict=True):  # the parent itself reads them back
        assert torch.equal(t.getData(torch.arange(N)), torch.from_numpy(ref))
    for _ in range(2):
        _check_epoch(list(loader), want)
    del loader
    gc.collect()


@pytest.mark.parametrize("name", ["x.npy", "gz.h5", "z.zarr"])
def test_write_by_another_table_of_the_file_reaches_forked_workers(files, name):
    """README: "Several file tables of one file in one process may all write, and see each
    other's writes (each drops its cached blocks when another writes)". Workers forked
    from the table that did not write read the new rows too."""
    kw = {"dataset": "d"} if name.endswith(".h5") else {}
    reader = gl.DataGadget(str(files / name), placement="file", device="cpu", **kw)
    writer = gl.DataGadget(str(files / name), placement="file", device="cpu", **kw)
    ref = {"x.npy": _x(), "gz.h5": _h(), "z.zarr": _z()}[name]
    assert torch.equal(reader.getData(torch.arange(N)), torch.from_numpy(ref))  # cache warm
    ds = gl.GadgetDataset(reader, np.arange(N, dtype=np.int64), placement="cpu", device="cpu")
    dl = DataLoader(ds, batch_size=7, shuffle=True, num_workers=2, multiprocessing_context="fork")
    rows = np.array([1, 2, 3, 20, 36])
    new = (ref[rows] + 1000).astype(ref.dtype)
    writer.insertData(torch.from_numpy(new), torch.from_numpy(rows))
    ref = ref.copy()
    ref[rows] = new
    assert torch.equal(reader.getData(torch.from_numpy(rows)), torch.from_numpy(new))
    _check_epoch(list(dl), [ref, np.arange(N, dtype=np.int64)])
    del dl
    gc.collect()


# ======================================================================================
# a store closed while a loader iterates
# ======================================================================================


@pytest.mark.parametrize("kind", ["cpu", "npy", "zarr", "gz.h5"])
@pytest.mark.parametrize("form", ["default", "batch_sampler", "gadgetloader"])
def test_close_mid_epoch_without_workers_raises_closed_error(files, kind, form):
    """In the main process a closed table's next batch is ``GadgetClosedError`` (never
    stale or garbage rows); the batches before it were right."""
    if kind == "cpu":
        g = gl.DataGadget(_x(), placement="cpu", device="cpu")
        ref = _x()
    elif kind == "npy":
        g, ref = gl.DataGadget(str(files / "x.npy"), placement="file", device="cpu"), _x()
    elif kind == "zarr":
        g, ref = gl.DataGadget(str(files / "z.zarr"), placement="file", device="cpu"), _z()
    else:
        g, ref = (
            gl.DataGadget(str(files / "gz.h5"), dataset="d", placement="file", device="cpu"),
            _h(),
        )
    ds = gl.GadgetDataset(g, np.arange(N, dtype=np.int64), placement="cpu", device="cpu")
    if form == "default":
        loader = DataLoader(ds, batch_size=4, shuffle=True)
    elif form == "batch_sampler":
        loader = DataLoader(ds, batch_sampler=gl.GadgetSampler(ds, batch_size=4, seed=0))
    else:
        loader = gl.GadgetLoader(ds, batch_size=4, seed=0, prefetch=0)
    it = iter(loader)
    refs = [ref, np.arange(N, dtype=np.int64)]
    _check_batch(next(it), refs)
    _check_batch(next(it), refs)
    g.close()
    with pytest.raises(gl.GadgetClosedError, match="closed"):
        next(it)
    _drain(it)


@pytest.mark.parametrize("kind", ["cpu", "npy", "zarr", "gz.h5"])
def test_close_mid_epoch_with_workers_then_next_epoch_is_closed_error(files, kind):
    """With workers the pass in flight yields only right rows (or the documented
    ``GadgetClosedError``); a pass started after the close fails with
    ``GadgetClosedError`` in its workers."""
    if kind == "cpu":
        g, ref = gl.DataGadget(_x(), placement="cpu", device="cpu"), _x()
    elif kind == "npy":
        g, ref = gl.DataGadget(str(files / "x.npy"), placement="file", device="cpu"), _x()
    elif kind == "zarr":
        g, ref = gl.DataGadget(str(files / "z.zarr"), placement="file", device="cpu"), _z()
    else:
        g, ref = (
            gl.DataGadget(str(files / "gz.h5"), dataset="d", placement="file", device="cpu"),
            _h(),
        )
    refs = [ref, np.arange(N, dtype=np.int64)]
    ds = gl.GadgetDataset(g, np.arange(N, dtype=np.int64), placement="cpu", device="cpu")
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="fork")
    it = iter(dl)
    _check_batch(next(it), refs)
    g.close()
    try:
        for b in it:
            _check_batch(b, refs)
    except gl.GadgetClosedError:
        pass
    _drain(it)
    kind_seen = None
    try:
        for _ in dl:
            pass
    except Exception as e:  # noqa: BLE001 - the type is checked below
        kind_seen = type(e)
        e.__traceback__ = None
        del e
    gc.collect()
    assert kind_seen is not None and issubclass(kind_seen, gl.GadgetClosedError), kind_seen


# ======================================================================================
# resume mid-epoch with workers
# ======================================================================================


@pytest.mark.parametrize("order", ["random", "chunk"])
def test_gadgetloader_state_from_workers_resumes_with_other_worker_counts(files, order):
    """``state_dict()`` counts batches handed out, not those the workers drew ahead, so a
    state saved under persistent fork workers resumes exactly without workers and under
    another worker count; the saved seed comes with it."""
    loader = gl.GadgetLoader(
        _dataset(files),
        batch_size=4,
        order=order,
        seed=21,
        num_workers=2,
        persistent_workers=True,
        prefetch_factor=4,
        multiprocessing_context="fork",
    )
    first_epoch = _check_epoch(list(loader), _refs())  # the state then sits in epoch 1
    assert first_epoch == loader.sampler.epoch_order(0).tolist()
    it = iter(loader)
    head = [_check_batch(next(it), _refs()) for _ in range(3)]
    state = loader.state_dict()
    _drain(it)
    del loader
    gc.collect()
    want = (
        gl.GadgetSampler(_dataset(files), batch_size=4, order=order, seed=21)
        .epoch_order(1)
        .tolist()
    )
    assert [i for b in head for i in b] == want[:12]
    for kw in (dict(num_workers=0), dict(num_workers=1, multiprocessing_context="fork")):
        other = gl.GadgetLoader(_dataset(files), batch_size=4, order=order, seed=999, **kw)
        other.load_state_dict(state)
        rest = [i for b in other for i in _check_batch(b, _refs())]
        assert rest == want[12:], kw
        # and the epoch after follows the saved run's seed
        assert [i for b in other for i in _check_batch(b, _refs())] == (
            gl.GadgetSampler(N, batch_size=4, order=order, seed=21).epoch_order(2).tolist()
            if order == "random"
            else other.sampler.epoch_order(2).tolist()
        ), kw
        del other
        gc.collect()


def test_stateful_dataloader_resume_with_persistent_workers_chunk_order(files):
    """README: ``StatefulDataLoader(ds, batch_sampler=sampler)`` resumes mid-epoch exactly,
    here with persistent workers drawing ahead over file columns in chunk order."""
    sdl_mod = pytest.importorskip("torchdata.stateful_dataloader")
    kw = dict(num_workers=2, persistent_workers=True, prefetch_factor=3)
    sampler = gl.GadgetSampler(_dataset(files), batch_size=5, order="chunk", seed=8)
    dl = sdl_mod.StatefulDataLoader(_dataset(files), batch_sampler=sampler, **kw)
    it = iter(dl)
    head = [_check_batch(next(it), _refs()) for _ in range(4)]
    state = dl.state_dict()
    _drain(it)
    del dl
    gc.collect()
    sampler2 = gl.GadgetSampler(_dataset(files), batch_size=5, order="chunk", seed=8)
    dl2 = sdl_mod.StatefulDataLoader(_dataset(files), batch_sampler=sampler2, **kw)
    dl2.load_state_dict(state)
    rest = [_check_batch(b, _refs()) for b in dl2]
    ref = [
        b.tolist() for b in gl.GadgetSampler(_dataset(files), batch_size=5, order="chunk", seed=8)
    ]
    assert head + rest == ref
    del dl2
    gc.collect()


# ======================================================================================
# fork safety: a process that has used the library forks workers safely
# ======================================================================================


def test_fork_while_threads_read_zarr_and_hdf5_tables(files):
    """README: HDF5 handles do not cross a fork and each worker reopens its files; forking
    while another thread of the parent reads the same files (zarr, gzip HDF5) must give
    workers that read right rows, and leave the reading thread right too."""
    readers = [
        gl.DataGadget(str(files / "z.zarr"), placement="file", device="cpu", cache_bytes=64),
        gl.DataGadget(
            str(files / "gz.h5"), dataset="d", placement="file", device="cpu", cache_bytes=64
        ),
    ]
    refs_r = [_z(), _h()]
    for r, ref in zip(readers, refs_r, strict=True):  # warm up: every import done here
        assert torch.equal(r.getData(torch.arange(N)), torch.from_numpy(ref))
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def read_loop():
        rng = np.random.default_rng(0)
        while not stop.is_set():
            for r, ref in zip(readers, refs_r, strict=True):
                ids = rng.integers(0, N, 16)
                try:
                    if not torch.equal(
                        r.getData(torch.from_numpy(ids)), torch.from_numpy(ref[ids])
                    ):
                        errors.append("wrong rows")
                except Exception as e:  # noqa: BLE001 - any error is a failure
                    errors.append(repr(e))
            reads[0] += 1

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        time.sleep(0.05)
        ds = _dataset(files)
        for _ in range(3):
            dl = DataLoader(
                ds,
                batch_size=5,
                shuffle=True,
                num_workers=2,
                multiprocessing_context="fork",
                timeout=30,
            )
            _check_epoch(list(dl), _refs())
            del dl
    finally:
        stop.set()
        thread.join()
    gc.collect()
    assert errors == [] and reads[0] > 0, errors[:3]


class _IterSampler(IterableDataset):
    """Iterates an inherited GadgetSampler for two epochs inside a worker; yields, per
    epoch, (epoch index, rows drawn, sum of ids, first 5 ids)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        for e in range(2):
            ids = torch.cat(list(self.sampler))
            yield torch.tensor([e, len(ids), int(ids.sum())]), ids[:5].clone()


def test_sampler_used_by_the_parent_works_in_a_forked_worker():
    """A sampler the parent has iterated computes the next epoch's order in a background
    thread (docstring, *Cost*). A worker forked meanwhile inherits the sampler: drawing
    its epochs there must give every row once per epoch (not wait forever for a thread
    that exists only in the parent)."""
    n = 4_000_000  # a shuffle of tens of milliseconds: the fork lands while it runs
    sampler = gl.GadgetSampler(n, batch_size=n // 4, seed=3)
    it = iter(sampler)
    first = next(it)  # epoch 0 under way; epoch 1's order is being made in the background
    dl = DataLoader(
        _IterSampler(sampler),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        timeout=10,
    )
    kind = None
    out = []
    try:
        out = list(dl)
    except RuntimeError as e:
        kind = str(e)
        e.__traceback__ = None
        del e
    del dl
    gc.collect()
    assert kind is None, f"the forked worker's sampler never finished: {kind}"
    total = n * (n - 1) // 2
    assert [o[0].tolist() for o in out] == [[0, n, total], [1, n, total]]
    # the parent's pass is unharmed: it goes on with epoch 0's order
    assert torch.equal(first, sampler.epoch_order(0)[: n // 4])
    rest = torch.cat([first] + list(it))
    assert torch.equal(rest, sampler.epoch_order(0))
    del it


class _CloseInChild(Dataset):
    """Closes, in the worker, the dataset and tables it inherited; reports whether a read
    there then raises GadgetClosedError."""

    def __init__(self, ds, tables):
        self.ds, self.tables = ds, tables

    def __len__(self):
        return 1

    def __getitem__(self, i):
        self.ds.close()
        for t in self.tables:
            t.close()
        closed = []
        for t in self.tables:
            try:
                t.getData([0])
                closed.append(False)
            except gl.GadgetClosedError:
                closed.append(True)
        del self.ds, self.tables
        gc.collect()
        return torch.tensor(closed)


def test_worker_closing_what_it_inherited_leaves_the_parent_open(files):
    """Objects of the parent are not destroyed in a child: a worker that closes (and drops)
    its copies of the parent's tables and dataset leaves the parent's tables open, their
    rows and files as they were."""
    tables = _file_tables(files)
    tables.append(gl.DataGadget(_h(), placement="cpu", device="cpu"))
    refs = [_x(), _h(), _h(), _z(), _h()]
    ds = gl.GadgetDataset(
        *tables,
        str(files / "x.npy"),
        gl.DataGadget(np.arange(N, dtype=np.int64), placement="cpu", device="cpu"),
        placement="file",
        device="cpu",
    )
    for t in tables:
        t.getData(torch.arange(N))
    dl = DataLoader(
        _CloseInChild(ds, tables),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        timeout=30,
    )
    (closed,) = list(dl)
    del dl
    gc.collect()
    assert closed.tolist() == [True] * len(tables)  # the child's copies did close
    for t, ref in zip(tables, refs, strict=True):
        assert torch.equal(t.getData(torch.arange(N)), torch.from_numpy(ref))
    _check_epoch(
        list(DataLoader(ds, batch_size=6, shuffle=True, num_workers=2)),
        refs + [_x(), np.arange(N, dtype=np.int64)],
    )
    assert np.array_equal(np.load(files / "x.npy"), _x())
    with h5py.File(files / "gz.h5", "r") as f:
        assert np.array_equal(f["d"][...], _h())


def test_library_objects_in_parent_cycles_survive_workers_and_are_freed_in_the_parent(files):
    """README: objects the parent left in reference cycles are kept alive in a forked child
    ("nothing is held longer in the parent"). Workers whose ``worker_init_fn`` collects
    garbage read right rows; afterwards the parent collects those cycles as usual."""
    ds_c = _dataset(files)
    loader_c = gl.GadgetLoader(ds_c, batch_size=4, seed=0)
    pass_c = iter(loader_c)
    _check_batch(next(pass_c), _refs())  # a pass left open mid-epoch
    sampler_c = gl.GadgetSampler(ds_c, batch_size=4, seed=0)
    spass_c = iter(sampler_c)
    next(spass_c)

    class Holder:
        pass

    h = Holder()
    h.self, h.objs = h, [ds_c, loader_c, pass_c, sampler_c, spass_c]
    refs = [weakref.ref(o) for o in (ds_c, loader_c, sampler_c, h)]
    del ds_c, loader_c, pass_c, sampler_c, spass_c, h
    was_enabled = gc.isenabled()

    ds = _dataset(files)
    for _ in range(2):
        dl = DataLoader(
            ds,
            batch_size=6,
            shuffle=True,
            num_workers=2,
            multiprocessing_context="fork",
            worker_init_fn=_collect_in_worker,
            timeout=30,
        )
        _check_epoch(list(dl), _refs())
        del dl
    assert gc.isenabled() == was_enabled
    time.sleep(0.3)  # the sampler's background order threads end
    gc.collect()
    alive = [r() is not None for r in refs]
    assert alive == [False] * 4, f"held in the parent after the fork: {alive}"


def test_user_disabled_collector_stays_disabled_across_worker_forks(files):
    """The collector is only switched off across a fork (README); a user's own
    ``gc.disable()`` is left as it was."""
    ds = _dataset(files)
    gc.disable()
    try:
        dl = DataLoader(
            ds, batch_size=6, shuffle=True, num_workers=2, multiprocessing_context="fork"
        )
        _check_epoch(list(dl), _refs())
        del dl
        assert not gc.isenabled()
    finally:
        gc.enable()
    dl = DataLoader(ds, batch_size=6, shuffle=True, num_workers=2, multiprocessing_context="fork")
    _check_epoch(list(dl), _refs())
    del dl
    assert gc.isenabled()


def test_parent_loader_left_mid_epoch_then_workers_then_it_goes_on(files):
    """A GadgetLoader pass left open in the parent, workers of another loader forked
    meanwhile over the same dataset, then the parent's pass continues: each loop sees
    every row once, in its own order."""
    ds = _dataset(files)
    mine = gl.GadgetLoader(ds, batch_size=4, seed=6, prefetch=0)
    it = iter(mine)
    head = [_check_batch(next(it), _refs()) for _ in range(3)]
    _check_epoch(
        list(
            DataLoader(
                ds, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context="fork"
            )
        ),
        _refs(),
    )
    _check_epoch(
        list(
            gl.GadgetLoader(ds, batch_size=3, seed=9, num_workers=2, multiprocessing_context="fork")
        ),
        _refs(),
    )
    rest = [_check_batch(b, _refs()) for b in it]
    flat = [i for b in head + rest for i in b]
    assert flat == mine.sampler.epoch_order(0).tolist()


# ======================================================================================
# spawn: cpu tables "pickle by value" to workers
# ======================================================================================


def test_spawn_workers_leave_the_parents_numpy_view_valid():
    """``getNumpyVersion(copy=False)`` of a ``cpu`` table "is the table until close() or
    load()". Sending the table to spawn workers (by value) must not move the parent's
    rows away from under that view."""
    x = _x()
    g = gl.DataGadget(x.copy(), placement="cpu", device="cpu")
    view = g.getNumpyVersion(copy=False)
    ds = gl.GadgetDataset(g, np.arange(N, dtype=np.int64), placement="cpu", device="cpu")
    dl = DataLoader(ds, batch_size=8, shuffle=True, num_workers=1, multiprocessing_context="spawn")
    _check_epoch(list(dl), [x, np.arange(N, dtype=np.int64)])
    del dl
    gc.collect()
    assert np.array_equal(g.getNumpyVersion(), x)
    g.insertData(torch.full((2, 3), 55.0), [3, 4])
    want = x.copy()
    want[[3, 4]] = 55.0
    assert np.array_equal(g.getNumpyVersion(), want)
    assert np.array_equal(view, want), "the copy=False view no longer shows the table's rows"


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_worker_write_into_its_copy_of_a_cpu_table_stays_in_the_worker(ctx):
    """README: "``cpu`` gadgets pickle by value"; DataGadget: pickling gives "an independent
    table (a cpu table's rows copied)". A worker that writes into its copy changes its own
    batches only, never the parent's table, whatever the start method."""
    x = _x()
    g = gl.DataGadget(x.copy(), placement="cpu", device="cpu")
    ds = gl.GadgetDataset(g, np.arange(N, dtype=np.int64), placement="cpu", device="cpu")
    dl = DataLoader(
        ds,
        batch_size=N,
        shuffle=False,
        num_workers=1,
        multiprocessing_context=ctx,
        worker_init_fn=_write_own_copy,
    )
    (batch,) = list(dl)
    del dl
    gc.collect()
    in_worker = x.copy()
    in_worker[0] = -999.0
    assert torch.equal(batch[0], torch.from_numpy(in_worker))  # the worker's copy changed
    assert np.array_equal(g.getNumpyVersion(), x), "the worker's write reached the parent"
    assert torch.equal(ds[0][0], torch.from_numpy(x[0]))
