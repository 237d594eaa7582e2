"""Session 47's fixes, from four black-box reviews (pipeline, files and CLI, training,
README and core API).

- ``GadgetLoader`` forgot a loaded resume position when an ``iter()`` was made and
  dropped before it handed out a batch: the next pass restarted the epoch at batch 0.
- ``ConcatDataset`` of a ``GadgetDataset`` and another dataset, read with tensor ids,
  failed to collate when a batch's first sample came from the ``GadgetDataset``.
- ``gadgetloader bench --bogus 3`` reported ``invalid choice: '3'`` for SUITE instead of
  the unknown option (and a suite's option given before the suite name was not named).
- A checkpoint of a bare ``OffloadedEmbedding`` named its table ``m..weight``.
- ``gadgetloader convert X X`` said ``convert: error: convert: ...`` (a doubled prefix).
- A closed ``DataGadget`` was taken as a ``GadgetDataset`` column; the error came at the
  first batch.
- ``insertData``'s message for a scalar did not say that lists are taken.
- zarr chunks whose decoded size was not the chunk's (a short zstd / gzip / lz4 frame,
  an empty or truncated blosc frame, a raw chunk file that is too long) were read without
  an error: the missing rows were whatever the buffer held.
- ``scatter_many`` over a sharded zarr table checked only the written chunks before
  writing the other tables: a damaged chunk elsewhere in the shard was found after the
  first table was written.
- A ``.npy`` file table that could no longer be opened for writing raised a raw
  ``PermissionError``.
- Over a lossy filter (zarr's ``Quantize``, HDF5's scale-offset) a ``file`` table's cache
  kept the written values instead of what the file stores.
- A named pipe called ``x.npy`` / ``x.h5`` made ``DataGadget`` and ``convert`` block.
- ``convert`` into a destination inside the source zarr store changed the source.
- ``placement='file'`` for a training table said "open it from a path instead", which
  these classes cannot do.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA, MEMORY_PLACEMENTS
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

import gadgetloader as gl

PLACEMENTS = [*MEMORY_PLACEMENTS, "file"]
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def _column(placement: str, values: np.ndarray, tmp_path) -> gl.DataGadget:
    if placement == "file":
        path = tmp_path / "col.npy"
        np.save(path, values)
        return gl.DataGadget(str(path), placement="file", device=DEVICE)
    return gl.DataGadget(values, placement=placement, device=DEVICE)


def _values(batch) -> list[float]:
    return batch[0].reshape(-1).cpu().tolist()


# ------------------------------------------------------------- GadgetLoader: an unused iter()
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch,coalesce", [(0, 1), (2, 1), (2, 4)])
@pytest.mark.parametrize("via", ["loader", "sampler"])
def test_unused_iter_keeps_a_loaded_position(placement, prefetch, coalesce, via, tmp_path):
    x = np.arange(40, dtype=np.float32)
    ds = gl.GadgetDataset(_column(placement, x, tmp_path), device=DEVICE)
    ref = [b.tolist() for b in gl.GadgetSampler(ds, batch_size=4, seed=1)]
    first = gl.GadgetLoader(ds, batch_size=4, seed=1)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    assert state["sampler"]["position"] == 3
    if via == "loader":
        loader = gl.GadgetLoader(ds, batch_size=4, seed=1, prefetch=prefetch, coalesce=coalesce)
        loader.load_state_dict(state)
    else:  # the state loaded into the sampler the loader is then given
        sampler = gl.GadgetSampler(ds, batch_size=4, seed=1)
        sampler.load_state_dict(state["sampler"])
        loader = gl.GadgetLoader(ds, sampler=sampler, prefetch=prefetch, coalesce=coalesce)
    unused = iter(loader)  # made and dropped without a batch
    del unused
    iter(loader)  # twice over
    assert loader.state_dict()["sampler"]["position"] == 3
    got = [[int(v) for v in _values(b)] for b in loader]
    assert got == ref[3:]  # not ref: batches 0-2 are not read twice
    # the epoch was finished: the next pass is the next epoch, from its first batch
    nxt = [[int(v) for v in _values(b)] for b in loader]
    assert len(nxt) == len(ref) and nxt != ref
    assert sorted(v for b in nxt for v in b) == list(range(40))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_pass_that_drew_batches_still_restarts_its_epoch(placement, tmp_path):
    # unchanged: a pass left after handing out batches restarts its epoch (as a bare
    # sampler's does); only a pass that handed out nothing keeps its start
    x = np.arange(24, dtype=np.float32)
    ds = gl.GadgetDataset(_column(placement, x, tmp_path), device=DEVICE)
    ref = [b.tolist() for b in gl.GadgetSampler(ds, batch_size=4, seed=3)]
    loader = gl.GadgetLoader(ds, batch_size=4, seed=3)
    it = iter(loader)
    next(it)
    next(it)
    del it
    assert [[int(v) for v in _values(b)] for b in loader] == ref


# ---------------------------------------------------------- ConcatDataset with another dataset
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_concat_with_other_dataset_collates_whatever_comes_first(placement, tmp_path):
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10, dtype=np.int64)
    ds = gl.GadgetDataset(
        _column(placement, x, tmp_path), torch.from_numpy(y), device=torch.device("cpu")
    )
    other = TensorDataset(torch.from_numpy(x + 100), torch.from_numpy(y + 100))
    cat = ConcatDataset([ds, other])
    for ids in ([0, 15, 3], [15, 0, 3]):
        ((xb, yb),) = list(DataLoader(cat, batch_sampler=[torch.tensor(ids)]))
        want_x = np.stack([x[i] if i < 10 else x[i - 10] + 100 for i in ids])
        want_y = [int(y[i]) if i < 10 else int(y[i - 10]) + 100 for i in ids]
        assert np.array_equal(xb.cpu().numpy(), want_x)
        assert yb.cpu().tolist() == want_y
    # GadgetSampler batches over the whole concatenation: every row once, in order
    sampler = gl.GadgetSampler(len(cat), batch_size=20, order="sequential")
    ((xb, yb),) = list(DataLoader(cat, batch_sampler=sampler))
    assert yb.cpu().tolist() == list(range(10)) + list(range(100, 110))
    assert np.array_equal(xb.cpu().numpy(), np.concatenate([x, x + 100]))


def test_concat_with_samples_of_another_width_is_a_clear_error():
    ds = gl.GadgetDataset(np.zeros((4, 2), np.float32), np.arange(4), device="cpu")
    other = TensorDataset(torch.ones(4, 2))  # one column, not two
    cat = ConcatDataset([ds, other])
    with pytest.raises(gl.GadgetTypeError, match="column counts"):
        next(iter(DataLoader(cat, batch_sampler=[torch.tensor([0, 5])])))


def test_rows_beside_batches_still_refused():
    ds = gl.GadgetDataset(np.zeros((4, 2), np.float32), device="cpu")
    from torch.utils.data import default_collate

    with pytest.raises(gl.GadgetTypeError, match="both rows of single ids"):
        default_collate([ds[torch.tensor(0)], ds[torch.tensor([1, 2])]])


# -------------------------------------------------------------------------------- bench CLI
def _cli(argv, capsys):
    from gadgetloader.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,named",
    [
        (["bench", "--bogus", "3"], "--bogus"),
        (["bench", "--rows", "100", "--bogus", "3"], "--bogus"),
        (["bench", "--rows=100", "--bogus=3"], "--bogus=3"),
    ],
)
def test_bench_unknown_option_is_named(argv, named, capsys):
    code, err = _cli(argv, capsys)
    assert code == 2
    assert f"unrecognized arguments: {named}" in err and "invalid choice" not in err


def test_bench_suite_option_before_the_suite_name_names_its_suite(capsys):
    code, err = _cli(["bench", "--rows", "100", "--profile", "p.txt"], capsys)
    assert code == 2 and "--profile" in err and "bench train" in err
    assert "invalid choice" not in err and not os.path.exists("p.txt")


def test_bench_seed_options_still_parse(capsys):
    # known seed options (with values, with '=', flags) pass the new check: the error that
    # follows is the suite-order one, as before
    code, err = _cli(["bench", "--rows=10", "--ids", "4", "sweep"], capsys)
    assert code == 2 and "given before the suite name" in err


# ------------------------------------------------------------------- checkpoint table names
@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_bare_module_checkpoint_names_its_table_weight(placement, tmp_path):
    emb = gl.OffloadedEmbedding(6, 3, placement=placement, device=DEVICE)
    w = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    emb.weight.insertData(w, torch.arange(6))
    gl.save_checkpoint(tmp_path / "c", {"m": emb}, format="npy")
    names = sorted(os.listdir(tmp_path / "c"))
    assert any(n.startswith("m.weight.") for n in names), names
    assert not any(".." in n for n in names), names
    back = gl.OffloadedEmbedding(6, 3, placement=placement, device=DEVICE)
    gl.load_checkpoint(tmp_path / "c", {"m": back})
    assert torch.equal(torch.as_tensor(back.weight[torch.arange(6)]).cpu(), w)


def test_checkpoint_with_the_old_root_table_name_still_loads(tmp_path):
    emb = gl.OffloadedEmbedding(6, 3, placement="cpu")
    w = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    emb.weight.insertData(w, torch.arange(6))
    d = tmp_path / "c"
    gl.save_checkpoint(d, {"m": emb}, format="npy")
    # rewrite meta.pt as a checkpoint written before session 47 named it (".weight")
    meta = torch.load(d / "meta.pt", weights_only=True)
    tables = meta["objects"]["m"]["tables"]
    tables[".weight"] = tables.pop("weight")
    torch.save(meta, d / "meta.pt")
    back = gl.OffloadedEmbedding(6, 3, placement="cpu")
    gl.load_checkpoint(d, {"m": back})
    assert torch.equal(torch.as_tensor(back.weight[torch.arange(6)]).cpu(), w)


def test_nested_module_checkpoint_names_unchanged(tmp_path):
    m = torch.nn.ModuleDict({"e": gl.OffloadedEmbedding(4, 2, placement="cpu")})
    gl.save_checkpoint(tmp_path / "c", {"m": m}, format="npy")
    assert any(n.startswith("m.e.weight.") for n in os.listdir(tmp_path / "c"))


# -------------------------------------------------------------------- convert onto itself
def test_convert_onto_its_source_names_it_once(tmp_path, capsys):
    from gadgetloader.cli import main

    src = tmp_path / "a.npy"
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.save(src, a)
    assert main(["convert", str(src), str(src)]) == 1  # one line, as other refusals
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "convert: error: source and destination are the same file" in err
    assert "convert: source" not in err  # one prefix, not two
    assert np.array_equal(np.load(src), a)
    with pytest.raises(gl.GadgetValueError, match="^source and destination are the same file"):
        from gadgetloader.convert import convert

        convert(src, src)


# ------------------------------------------------------------------- closed dataset columns
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_closed_gadget_column_refused_at_construction(placement, tmp_path):
    g = _column(placement, np.zeros((10, 4), np.float32), tmp_path)
    g.close()
    with pytest.raises(gl.GadgetClosedError, match="column 1: .*closed"):
        gl.GadgetDataset(np.zeros((10, 1), np.float32), g, device=DEVICE)


# ------------------------------------------------------------------------ insertData scalar
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_insert_scalar_message_names_lists(placement, tmp_path):
    g = _column(placement, np.zeros((4, 2), np.float64), tmp_path)
    with pytest.raises(gl.GadgetTypeError, match="list of rows; got float"):
        g.insertData(3.0, [1])
    assert torch.equal(
        torch.as_tensor(g.getData([0, 1, 2, 3])).cpu(), torch.zeros(4, 2, dtype=torch.float64)
    )
    g.insertData([[1.0, 2.0]], [1])  # as the message says
    assert torch.as_tensor(g.getData([1])).cpu().tolist() == [[1.0, 2.0]]


# ------------------------------------------------------------- training tables and 'file'
@pytest.mark.parametrize("make", ["embedding", "bag", "switcher"])
def test_file_placement_for_training_tables_says_what_to_do(make):
    emb = torch.nn.Embedding(2, 3, padding_idx=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(gl.GadgetKeyError) as ei:
            if make == "embedding":
                gl.OffloadedEmbedding(5, 3, placement="file")
            elif make == "bag":
                gl.OffloadedEmbeddingBag(5, 3, placement="FILE")
            else:
                gl.ModelFactory(emb, 5, 3, placement="file")
    text = str(ei.value)
    assert "cannot use placement 'file'" in text and "save_checkpoint" in text
    assert "open it from a path" not in text
    # the switcher was refused before it touched the module
    assert not hasattr(emb, "_gadget_padding_id") and emb.padding_idx == 1


# ---------------------------------------------------------------- zarr chunks of a wrong size
zarr = pytest.importorskip("zarr")
numcodecs = pytest.importorskip("numcodecs")
A = (np.arange(40, dtype=np.float32) + 1).reshape(10, 4)  # chunks of 5 rows = 80 bytes


def _zarr_array(path, kind):
    if kind == "zstd":
        arr = zarr.create_array(path, shape=A.shape, dtype="f4", chunks=(5, 4))
    elif kind == "gzip":
        arr = zarr.create_array(
            path, shape=A.shape, dtype="f4", chunks=(5, 4), compressors=zarr.codecs.GzipCodec()
        )
    elif kind == "blosc":
        arr = zarr.create_array(
            path, shape=A.shape, dtype="f4", chunks=(5, 4), compressors=zarr.codecs.BloscCodec()
        )
    elif kind == "lz4":
        arr = zarr.create_array(
            path,
            shape=A.shape,
            dtype="f4",
            chunks=(5, 4),
            zarr_format=2,
            compressors=numcodecs.LZ4(),
        )
    elif kind == "raw":
        arr = zarr.create_array(path, shape=A.shape, dtype="f4", chunks=(5, 4), compressors=None)
    else:
        raise AssertionError(kind)
    arr[...] = A
    chunk = os.path.join(path, "c", "1", "0")
    return chunk if os.path.exists(chunk) else os.path.join(path, "1.0")


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


_ENCODERS = {
    "zstd": lambda b: numcodecs.Zstd().encode(b),
    "gzip": lambda b: numcodecs.GZip().encode(b),
    "blosc": lambda b: numcodecs.Blosc().encode(b),
    "lz4": lambda b: numcodecs.LZ4().encode(b),
    "raw": lambda b: b,
}


@pytest.mark.parametrize("placement", [*MEMORY_PLACEMENTS, "file"])
@pytest.mark.parametrize(
    "kind,damage",
    [
        ("zstd", "short"),
        ("gzip", "short"),
        ("lz4", "short"),
        ("blosc", "short"),
        ("gzip", "empty"),
        ("blosc", "empty"),
        ("blosc", "cut"),
        ("raw", "long"),
        ("raw", "short"),
    ],
)
def test_zarr_chunk_of_a_wrong_size_is_an_error(placement, kind, damage, tmp_path):
    path = str(tmp_path / "a.zarr")
    chunk = _zarr_array(path, kind)
    if damage == "short":  # a valid frame of 2 rows where the chunk has 5
        data = _ENCODERS[kind](np.full(8, -7.0, np.float32).tobytes())
    elif damage == "long":
        data = np.full(30, -7.0, np.float32).tobytes()
    elif damage == "cut":
        data = _bytes(chunk)[:-8]
    else:
        data = b""
    with open(chunk, "wb") as f:
        f.write(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if placement == "file":
            g = gl.DataGadget(path, placement="file", device=DEVICE)
            with pytest.raises(gl.GadgetFileError, match="chunk 1"):
                g.getData(torch.arange(10))
            # rows of the good chunk still read, and equal the file's
            got = torch.as_tensor(g.getData(torch.arange(5))).cpu().numpy()
            assert np.array_equal(got, A[:5])
            # a write into the damaged chunk is refused, the file as it was
            before = _bytes(chunk)
            with pytest.raises(gl.GadgetFileError):
                g.insertData(torch.zeros(1, 4), torch.tensor([6]))
            assert _bytes(chunk) == before
        else:
            with pytest.raises(gl.GadgetFileError, match="chunk 1"):
                gl.DataGadget(path, placement=placement, device=DEVICE)


@pytest.mark.parametrize("kind", ["zstd", "gzip", "blosc", "lz4", "raw"])
def test_zarr_chunks_of_the_right_size_still_read(kind, tmp_path):
    path = str(tmp_path / "a.zarr")
    _zarr_array(path, kind)
    g = gl.DataGadget(path, placement="file")
    assert np.array_equal(torch.as_tensor(g.getData(torch.arange(10))).cpu().numpy(), A)
    assert np.array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), A)


# --------------------------------------------------------------- scatter_many over a shard
def test_scatter_many_prechecks_the_rest_of_a_shard(tmp_path):
    import struct

    a = np.arange(80, dtype=np.float32).reshape(20, 4)
    pa, pb = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    zarr.create_array(pa, shape=a.shape, dtype="f4", chunks=(5, 4))[...] = a
    zarr.create_array(pb, shape=a.shape, dtype="f4", chunks=(5, 4), shards=(20, 4))[...] = a
    shard = os.path.join(pb, "c", "0", "0")
    raw = bytearray(_bytes(shard))
    index = raw[-(4 * 16 + 4) : -4]  # 4 chunks x (offset, nbytes), then a crc32c
    off, n = struct.unpack("<QQ", index[3 * 16 : 4 * 16])
    raw[off : off + n] = b"\xff" * n  # chunk 3 (rows 15..19) damaged
    with open(shard, "wb") as f:
        f.write(bytes(raw))
    ga, gb = gl.DataGadget(pa, placement="file"), gl.DataGadget(pb, placement="file")
    before_b = _bytes(shard)
    with pytest.raises(gl.GadgetFileError, match="table 1 of 2"):
        gl.scatter_many(
            [ga, gb], [torch.full((1, 4), -1.0), torch.full((1, 4), -2.0)], torch.tensor([2])
        )
    assert np.array_equal(np.asarray(zarr.open(pa, mode="r")[...]), a)  # table 0 unchanged
    assert torch.equal(torch.as_tensor(ga.getData(torch.arange(20))).cpu(), torch.from_numpy(a))
    assert _bytes(shard) == before_b


# ---------------------------------------------------------- .npy write that cannot open
def test_npy_write_that_cannot_open_the_file_is_a_gadget_error(tmp_path, monkeypatch):
    from gadgetloader.io import _npy

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "a.npy", a)
    g = gl.DataGadget(str(tmp_path / "a.npy"), placement="file")
    assert np.array_equal(torch.as_tensor(g.getData(torch.arange(3))).cpu().numpy(), a)

    def refused(path, mode="r", *args, **kwargs):
        if "+" in mode:
            raise PermissionError(13, "Permission denied", path)
        return open(path, mode, *args, **kwargs)

    for src in list(getattr(g.store, "_sources", {}).values()) or []:
        src._f = None
    monkeypatch.setattr(_npy, "open", refused, raising=False)
    with pytest.raises(gl.GadgetFileError, match="cannot open it for writing"):
        g.insertData(torch.zeros(1, 4), torch.tensor([0]))
    monkeypatch.undo()
    assert np.array_equal(np.load(tmp_path / "a.npy"), a)
    assert np.array_equal(torch.as_tensor(g.getData(torch.arange(3))).cpu().numpy(), a)


# ------------------------------------------------------------------- lossy filters, cache
def _lossy(path_kind, tmp_path):
    if path_kind == "zarr-quantize":
        p = str(tmp_path / "q.zarr")
        zarr.create_array(
            p,
            shape=(20, 4),
            dtype="f4",
            chunks=(5, 4),
            zarr_format=2,
            filters=[numcodecs.Quantize(digits=2, dtype="f4")],
        )[...] = 0
        return p, None, lambda: np.asarray(zarr.open(p, mode="r")[...])
    h5py = pytest.importorskip("h5py")
    p = str(tmp_path / "s.h5")
    with h5py.File(p, "w") as f:
        f.create_dataset(
            "x",
            data=np.linspace(0, 3, 80, dtype=np.float32).reshape(20, 4),
            chunks=(5, 4),
            scaleoffset=2,
        )

    def read():
        with h5py.File(p, "r") as f:
            return f["x"][...]

    return p, "x", read


@pytest.mark.parametrize("kind", ["zarr-quantize", "hdf5-scaleoffset"])
def test_file_table_reads_what_a_lossy_filter_stored(kind, tmp_path):
    path, dataset, read = _lossy(kind, tmp_path)
    g = gl.DataGadget(path, dataset=dataset, placement="file")
    g.getData(torch.arange(20))  # every block in the table's cache
    rows = torch.tensor([[1.23456789, 2.5, 0.001, 2.9999]] * 2)
    g.insertData(rows, torch.tensor([3, 17]))
    stored = read()
    if kind == "zarr-quantize":  # (HDF5's scale-offset may keep some values exactly)
        assert not np.array_equal(stored[3], rows[0].numpy())  # the filter changed them
    got = torch.as_tensor(g.getData(torch.arange(20))).cpu().numpy()
    assert np.array_equal(got, stored)
    fresh = gl.DataGadget(path, dataset=dataset, placement="file")
    assert np.array_equal(torch.as_tensor(fresh.getData(torch.arange(20))).cpu().numpy(), stored)


def test_lossless_files_keep_their_write_through_cache(tmp_path):
    from gadgetloader.io import open_source

    zarr.create_array(str(tmp_path / "a.zarr"), data=A, chunks=(5, 4))
    zarr.create_array(str(tmp_path / "s.zarr"), data=A, chunks=(5, 4), shards=(10, 4))
    zarr.create_array(str(tmp_path / "v2.zarr"), data=A, chunks=(5, 4), zarr_format=2)
    np.save(tmp_path / "a.npy", A)
    for name in ("a.zarr", "s.zarr", "v2.zarr", "a.npy"):
        src = open_source(str(tmp_path / name))
        assert src.exact_writes, name
        src.close()


# --------------------------------------------------------------------------- named pipes
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("ext", ["npy", "h5", "zarr"])
def test_named_pipe_is_refused_at_once(ext, tmp_path):
    p = str(tmp_path / f"pipe.{ext}")
    os.mkfifo(p)
    with pytest.raises(gl.GadgetFileError, match="named pipe"):
        gl.DataGadget(p, placement="cpu")
    from gadgetloader.convert import convert

    with pytest.raises(gl.GadgetFileError, match="named pipe"):
        convert(p, str(tmp_path / "out.npy"))
    assert not os.path.exists(tmp_path / "out.npy")


# ---------------------------------------------------------- convert inside the source store
def test_convert_into_the_source_store_is_refused(tmp_path):
    from gadgetloader.convert import convert

    src = str(tmp_path / "s.zarr")
    group = zarr.open_group(src, mode="w")
    group.create_array("emb", data=A)
    listing = sorted(os.listdir(src))
    for dst in ("copy.zarr", "emb/copy.npy", "sub/copy.h5"):
        with pytest.raises(gl.GadgetValueError, match="inside the zarr store"):
            convert(src, os.path.join(src, dst))
    assert sorted(os.listdir(src)) == listing
    assert np.array_equal(gl.DataGadget(src, placement="cpu").getNumpyVersion(), A)
    convert(src, str(tmp_path / "copy.zarr"))  # outside it: fine
    assert np.array_equal(
        gl.DataGadget(str(tmp_path / "copy.zarr"), placement="cpu").getNumpyVersion(), A
    )


# ------------------------------------------- follow-ups from a review of the fixes above
@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("via", ["loader", "sampler"])
def test_set_epoch_after_an_unused_iter_keeps_a_loaded_position(placement, workers, via, tmp_path):
    # with workers, torch draws batches ahead at iter(): the sampler moved, though the user
    # got nothing; set_epoch of the loaded epoch (the top-of-epoch call) keeps the position
    x = np.arange(40, dtype=np.float32)
    col = _column(placement, x, tmp_path) if placement == "file" else x
    ds = gl.GadgetDataset(col, device="cpu")
    ref = [b.tolist() for b in gl.GadgetSampler(ds, batch_size=4, seed=5)]
    first = gl.GadgetLoader(ds, batch_size=4, seed=5)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    loader = gl.GadgetLoader(ds, batch_size=4, seed=5, num_workers=workers)
    loader.load_state_dict(state)
    unused = iter(loader)
    del unused
    epoch = state["sampler"]["epoch"]
    (loader if via == "loader" else loader.sampler).set_epoch(epoch)
    got = [[int(v) for v in _values(b)] for b in loader]
    assert got == ref[3:]
    # set_epoch of the epoch after restarts from its first batch, as documented
    loader.set_epoch(epoch + 1)
    nxt = [[int(v) for v in _values(b)] for b in loader]
    assert len(nxt) == len(ref) and sorted(v for b in nxt for v in b) == list(range(40))


def test_set_epoch_without_a_loaded_position_still_restarts():
    ds = gl.GadgetDataset(np.arange(20, dtype=np.float32), device="cpu")
    ref = [b.tolist() for b in gl.GadgetSampler(ds, batch_size=4, seed=2)]
    loader = gl.GadgetLoader(ds, batch_size=4, seed=2)
    it = iter(loader)
    next(it)
    del it
    loader.set_epoch(0)
    assert [[int(v) for v in _values(b)] for b in loader] == ref


@pytest.mark.parametrize(
    "argv", [["bench", "--bogus", "-h"], ["bench", "-h", "--bogus"], ["--version", "bench", "--x"]]
)
def test_help_and_version_win_over_an_unknown_bench_option(argv, capsys):
    from gadgetloader.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert ("usage:" in out) if "-h" in argv else ("gadgetloader " in out)


@pytest.mark.parametrize("extra", [1, 16])
def test_blosc_chunk_with_trailing_bytes_reads_as_zarr_reads_it(extra, tmp_path):
    path = str(tmp_path / "a.zarr")
    chunk = _zarr_array(path, "blosc")
    with open(chunk, "ab") as f:
        f.write(b"\0" * extra)
    assert np.array_equal(np.asarray(zarr.open(path, mode="r")[...]), A)
    for placement in ("cpu", "file"):
        g = gl.DataGadget(path, placement=placement)
        assert np.array_equal(torch.as_tensor(g.getData(torch.arange(10))).cpu().numpy(), A)


def test_optimizer_switch_refuses_file_placement_up_front():
    model = torch.nn.Embedding(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gl.GadgetKeyError, match="cannot use placement 'file'"):
        gl.OptimizerFactory(opt, 10, 3, model, "weight", placement="file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_named_pipe_inside_a_zarr_store_does_not_block(placement, tmp_path):
    path = str(tmp_path / "a.zarr")
    chunk = _zarr_array(path, "zstd")
    os.remove(chunk)
    os.mkfifo(chunk)
    with pytest.raises(gl.GadgetFileError, match="chunk 1"):
        gl.DataGadget(path, placement=placement).getData(torch.arange(10))


def test_convert_from_an_array_of_a_group_into_that_group_is_refused(tmp_path):
    from gadgetloader.convert import convert

    src = str(tmp_path / "s.zarr")
    group = zarr.open_group(src, mode="w")
    group.create_array("x", data=A)
    with pytest.raises(gl.GadgetValueError, match="inside the zarr store"):
        convert(os.path.join(src, "x"), os.path.join(src, "y.zarr"))
    assert sorted(os.listdir(src)) == ["x", "zarr.json"]
    assert np.array_equal(gl.DataGadget(src, placement="cpu").getNumpyVersion(), A)


# ------------------------------------------------ a state dict that turns amsgrad on
class _Net(torch.nn.Module):
    def __init__(self, placement):
        super().__init__()
        self.emb = gl.OffloadedEmbedding(8, 3, placement=placement, device=DEVICE)
        self.head = torch.nn.Linear(3, 1).to(DEVICE)

    def forward(self, ids):
        return self.head(self.emb(ids)).sum()


@pytest.mark.parametrize("placement", MEMORY_PLACEMENTS)
def test_state_dict_turning_amsgrad_on_without_its_state_is_refused(placement):
    torch.manual_seed(0)
    net = _Net(placement)
    opt = gl.OffloadedOptimizer(torch.optim.Adam, net, lr=0.1)
    for ids in ([1, 2, 2], [0, 5]):
        opt.zero_grad()
        net(torch.tensor(ids, device=DEVICE)).backward()
        opt.step()
    saved = opt.state_dict()
    bad = opt.state_dict()
    for g in bad["inner"]["param_groups"]:
        g["amsgrad"] = True
    table = torch.as_tensor(net.emb.weight[torch.arange(8)]).cpu().clone()
    with pytest.raises(gl.GadgetValueError, match="turns amsgrad on"):
        opt.load_state_dict(bad)
    # nothing changed: no new state table, the groups as they were, the earlier state loads
    after = opt.state_dict()
    assert sorted(after["tables"][0]) == sorted(saved["tables"][0])
    assert all(g["amsgrad"] is False for g in opt.param_groups)
    opt.load_state_dict(saved)
    opt.zero_grad()
    net(torch.tensor([2, 7], device=DEVICE)).backward()
    opt.step()  # trains on
    assert not torch.equal(torch.as_tensor(net.emb.weight[torch.arange(8)]).cpu(), table)


def test_amsgrad_turned_on_before_any_dense_state_still_loads():
    net = _Net("cpu")
    opt = gl.OffloadedOptimizer(torch.optim.Adam, net, lr=0.1)
    sd = opt.state_dict()  # no step yet: no state to lack anything
    for g in sd["inner"]["param_groups"]:
        g["amsgrad"] = True
    opt.load_state_dict(sd)
    assert all(g["amsgrad"] is True for g in opt.param_groups)
    opt.zero_grad()
    net(torch.tensor([1, 3])).backward()
    opt.step()
