"""Session 23 fixes: warnings point at the user's line, clearer messages for empty shapes
and non-integer slice bounds, NumPy's array protocol on a DataGadget, the bench command
line's usage errors, and GadgetLoader's pass-through options."""

from __future__ import annotations

import os
import pathlib
import warnings

import numpy as np
import pytest
import torch

import gadgetloader as gl
from gadgetloader._device import _reset_fallback_warnings, cuda_available
from gadgetloader.cli import main


# ---- 1. warnings name the caller's line, not a line inside the package ------------------------
@pytest.mark.skipif(cuda_available(), reason="the fallback warning is for CPU-only machines")
def test_fallback_warning_points_at_the_user() -> None:
    _reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gl.DataGadget((3, 2), placement="pinned")
    fallbacks = [w for w in seen if issubclass(w.category, gl.FallbackWarning)]
    assert len(fallbacks) == 1
    assert fallbacks[0].filename == __file__


def test_optimizer_warning_points_at_the_user() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gl.OffloadedOptimizer(torch.optim.SGD, torch.nn.Linear(2, 2).parameters(), lr=0.1)
    found = [w for w in seen if "found no OffloadedEmbedding" in str(w.message)]
    assert len(found) == 1
    assert found[0].filename == __file__


# ---- 2. messages that say what is wrong ----------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"fileName": ()}, {"shape": ()}, {"shape": []}])
def test_empty_shape_says_a_table_needs_an_axis(kwargs: dict[str, object]) -> None:
    with pytest.raises(gl.GadgetTypeError, match="at least one axis"):
        gl.DataGadget(**kwargs)  # type: ignore[arg-type]


def test_empty_list_is_still_an_empty_table() -> None:
    assert gl.DataGadget([], placement="cpu").shape == (0,)


def test_slice_messages() -> None:
    g = gl.DataGadget(np.arange(8.0).reshape(4, 2), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="integer bounds") as info:
        g[slice(0.0, 2)]
    assert "step of 0" not in str(info.value)
    with pytest.raises(gl.GadgetValueError, match="non-zero step"):
        g[::0]


def test_negative_sampler_count_is_not_called_empty() -> None:
    with pytest.raises(gl.GadgetValueError, match="must be positive; got -1 rows"):
        gl.GadgetSampler(-1, batch_size=4)
    with pytest.raises(gl.GadgetValueError, match="empty dataset"):
        gl.GadgetSampler(0, batch_size=4)


# ---- 3. NumPy's array protocol -----------------------------------------------------------
def test_numpy_array_protocol_reads_the_table() -> None:
    data = np.arange(40_000, dtype=np.float32).reshape(10_000, 4)
    g = gl.DataGadget(data, placement="cpu")
    a = np.asarray(g)
    np.testing.assert_array_equal(a, data)
    a[0, 0] = -1.0  # a copy: the table keeps its value
    assert g[0][0].item() == 0.0
    b = np.array(g, dtype=np.float64)
    assert b.dtype == np.float64
    np.testing.assert_array_equal(b, data.astype(np.float64))
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        view = np.asarray(g, copy=False)  # a host table can be viewed
        view[1, 1] = 42.0
        assert g[1][1].item() == 42.0


def test_numpy_array_protocol_bfloat16_and_closed() -> None:
    g = gl.DataGadget(torch.arange(6.0).reshape(3, 2).bfloat16(), placement="cpu")
    a = np.asarray(g)
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, np.arange(6.0, dtype=np.float32).reshape(3, 2))
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        with pytest.raises(ValueError, match="without a copy"):
            np.asarray(g, copy=False)
    g.close()
    with pytest.raises(gl.GadgetClosedError):
        np.asarray(g)


# ---- 4. the bench command line ---------------------------------------------------------------
def test_bench_dtype_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "seed", "--dtype", "complex64"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "gadgetloader bench seed: error:" in err and "complex64" in err


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["bench", "seed", "--json", "/no/such/dir/x.json"], "gadgetloader bench seed"),
        (["bench", "--json", "/no/such/dir/x.json"], "gadgetloader bench"),
        (["info", "--json", "/no/such/dir/x.json"], "gadgetloader info"),
    ],
)
def test_output_path_errors_name_the_command(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"{prog}: error: --json" in capsys.readouterr().err


def test_bench_ids_help_mentions_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "seed", "--help"])
    assert "at most --rows" in " ".join(capsys.readouterr().out.split())


# ---- 5. GadgetLoader's DataLoader options ------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "cls", "word"),
    [
        ({"foo": 1}, gl.GadgetTypeError, "'foo'"),
        # (refused by DataLoader without workers; a bad timeout is GadgetLoader's own check)
        ({"prefetch_factor": 2}, gl.GadgetValueError, "'prefetch_factor'"),
    ],
)
def test_loader_refused_options_are_gadget_errors(
    kwargs: dict[str, int], cls: type[Exception], word: str
) -> None:
    ds = gl.GadgetDataset(np.zeros((10, 2), np.float32), placement="cpu", device="cpu")
    with pytest.raises(cls, match="DataLoader") as info:
        gl.GadgetLoader(ds, batch_size=4, **kwargs)
    assert word in str(info.value)
    assert "pin_memory" not in str(info.value)  # only what the caller gave is named


# ---- 6. HDF5 datasets whose rows live in other files ---------------------------------------
def _vds(tmp: str) -> np.ndarray:
    h5py = pytest.importorskip("h5py")
    a = np.arange(200 * 4, dtype=np.float32).reshape(200, 4)
    for name, part in (("src1.h5", a[:100]), ("src2.h5", a[100:])):
        with h5py.File(os.path.join(tmp, name), "w") as f:
            f["d"] = part
    layout = h5py.VirtualLayout(shape=(200, 4), dtype="f4")
    layout[:100] = h5py.VirtualSource("src1.h5", "d", shape=(100, 4))
    layout[100:] = h5py.VirtualSource("src2.h5", "d", shape=(100, 4))
    with h5py.File(os.path.join(tmp, "vds.h5"), "w") as f:
        f.create_virtual_dataset("v", layout, fillvalue=0)
    return a


def _external(tmp: str) -> np.ndarray:
    h5py = pytest.importorskip("h5py")
    a = np.arange(200 * 4, dtype=np.float32).reshape(200, 4)
    a.tofile(os.path.join(tmp, "raw.bin"))
    with h5py.File(os.path.join(tmp, "ext.h5"), "w") as f:
        f.create_dataset("e", shape=(200, 4), dtype="f4", external=[("raw.bin", 0, a.nbytes)])
    return a


@pytest.mark.parametrize("placement", ["cpu", "file"])
@pytest.mark.parametrize("kind", ["virtual", "external"])
def test_rows_in_other_files_read_correctly_and_read_only(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, placement: str, kind: str
) -> None:
    monkeypatch.chdir(tmp_path)  # (HDF5 looks for relative external files from here)
    a = _vds(str(tmp_path)) if kind == "virtual" else _external(str(tmp_path))
    path, name = ("vds.h5", "v") if kind == "virtual" else ("ext.h5", "e")
    g = gl.DataGadget(str(tmp_path / path), dataset=name, placement=placement)
    np.testing.assert_array_equal(g.getNumpyVersion(), a)
    ids = [5, 150, 199, 0, 100]
    np.testing.assert_array_equal(g.getData(ids, device="cpu").numpy(), a[ids])
    if placement == "file":
        with pytest.raises(gl.ReadOnlyError, match="virtual dataset|external raw storage"):
            g.insertData(torch.zeros(1, 4), [3])
        np.testing.assert_array_equal(g.getNumpyVersion(), a)
    g.close()


@pytest.mark.parametrize("placement", ["cpu", "file"])
def test_virtual_dataset_with_a_missing_source_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    monkeypatch.chdir(tmp_path)
    _vds(str(tmp_path))
    os.rename(tmp_path / "src2.h5", tmp_path / "moved.h5")
    with pytest.raises(gl.GadgetFileError, match="src2.h5.*cannot be found"):
        gl.DataGadget(str(tmp_path / "vds.h5"), dataset="v", placement=placement)


def test_virtual_dataset_with_a_missing_source_dataset_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h5py = pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    _vds(str(tmp_path))
    with h5py.File(tmp_path / "src1.h5", "a") as f:
        f.move("d", "renamed")
    with pytest.raises(gl.GadgetFileError, match="not in that file"):
        gl.DataGadget(str(tmp_path / "vds.h5"), dataset="v", placement="cpu")


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_external_storage_missing_or_short_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.chdir(tmp_path)
    _external(str(tmp_path))
    raw = tmp_path / "raw.bin"
    if damage == "missing":
        raw.unlink()
        match = "cannot be found"
    else:
        with open(raw, "r+b") as f:
            f.truncate(1000)
        match = "1000 of the 3200 bytes"
    with pytest.raises(gl.GadgetFileError, match=match):
        gl.DataGadget(str(tmp_path / "ext.h5"), dataset="e", placement="cpu")


def test_virtual_sources_are_found_beside_the_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HDF5 looks for a virtual dataset's relative sources beside it: so does the check."""
    a = _vds(str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    g = gl.DataGadget(str(tmp_path / "vds.h5"), dataset="v", placement="cpu")
    np.testing.assert_array_equal(g.getNumpyVersion(), a)


def test_external_storage_is_looked_for_where_hdf5_reads_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HDF5 reads a relative external file from the working directory only: from another
    one the table is refused at once instead of failing at its first read."""
    _external(str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(gl.GadgetFileError, match="cannot be found"):
        gl.DataGadget(str(tmp_path / "ext.h5"), dataset="e", placement="cpu")


# ---- 7. the io sinks refuse blocks that do not fit, and unwritten rows ---------------------------
@pytest.mark.parametrize("ext", ["npy", "h5", "zarr"])
def test_sink_checks_blocks_and_completeness(tmp_path: pathlib.Path, ext: str) -> None:
    if ext != "npy":
        pytest.importorskip("h5py" if ext == "h5" else "zarr")
    from gadgetloader import io as gio

    path = str(tmp_path / f"t.{ext}")
    good = np.arange(40, dtype=np.float32).reshape(10, 4)
    with gio.open_sink(path, (10, 4), torch.float32) as sink:
        sink.write(0, good.astype(np.float64))  # another dtype: converted, as NumPy assigns
    np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), good)
    before = sorted(os.listdir(tmp_path))

    sink = gio.open_sink(path, (10, 4), torch.float32)
    with pytest.raises(gl.GadgetValueError, match="8:12 do not fit"):
        sink.write(8, np.zeros((4, 4), np.float32))
    with pytest.raises(gl.GadgetValueError, match="shape"):
        sink.write(0, np.zeros((2, 5), np.float32))
    sink.write(0, np.zeros((5, 4), np.float32))
    with pytest.raises(gl.GadgetValueError, match="only 5 of this file's 10 rows"):
        sink.commit()
    # the old file is kept, and no partial file is left beside it
    assert sorted(os.listdir(tmp_path)) == before
    np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), good)


# ---- 8. a save whose final rename fails raises a GadgetError and keeps the old file -------------
@pytest.mark.parametrize("ext", ["npy", "h5", "zarr"])
def test_failed_rename_is_a_gadget_error(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, ext: str
) -> None:
    if ext != "npy":
        pytest.importorskip("h5py" if ext == "h5" else "zarr")
    from gadgetloader.io import _atomic

    path = str(tmp_path / f"t.{ext}")
    old = np.ones((6, 3), np.float32)
    gl.DataGadget(old, placement="cpu").save(path)
    before = sorted(os.listdir(tmp_path))
    real = os.replace

    def refuse(src: object, dst: object) -> None:
        # (the new file or store taking the path; a zarr store's old one moving back is let through)
        if os.fspath(dst) == path and ".old-" not in os.fspath(src):  # type: ignore[arg-type]
            raise PermissionError(1, "Operation not permitted", path)
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(_atomic.os, "replace", refuse)
    with pytest.raises(gl.ReadOnlyError, match="old file is kept") as info:
        gl.DataGadget(np.zeros((6, 3), np.float32), placement="cpu").save(path)
    assert isinstance(info.value, PermissionError)
    monkeypatch.setattr(_atomic.os, "replace", real)
    assert sorted(os.listdir(tmp_path)) == before
    np.testing.assert_array_equal(gl.DataGadget(path, placement="cpu").getNumpyVersion(), old)


def test_level_message_names_only_the_formats_compressors(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("h5py")
    g = gl.DataGadget(np.zeros((4, 2), np.float32), placement="cpu")
    with pytest.raises(gl.GadgetValueError, match=r"levels apply to \['gzip'\]"):
        g.save(str(tmp_path / "a.h5"), compression="lzf", compression_level=5)
    assert not os.listdir(tmp_path)
