"""Construction errors, the CPU fallback, optional dependencies, atomic .npy saves."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA

import gadgetloader as gl
from gadgetloader import _device


def test_unknown_placement_lists_valid_ones() -> None:
    with pytest.raises(
        KeyError,
        match=r"Unknown placement 'pined'; expected one of \['cpu', 'cuda', 'file', 'pinned'\]",
    ):
        gl.DataGadget((4, 2), placement="pined")


@pytest.mark.skipif(HAS_CUDA, reason="the fallback only happens without CUDA")
def test_cuda_and_pinned_fall_back_to_cpu_with_one_warning() -> None:
    with pytest.warns(gl.FallbackWarning, match="needs CUDA"):
        g = gl.DataGadget(np.ones((4, 2), np.float32), CPUPinn=True)
    assert g.placement == "cpu" and g.device.type == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second fallback in the same process says nothing
        h = gl.DataGadget((4, 2))
    assert h.placement == "cpu"
    assert g.getData([1]).device.type == "cpu"


def test_missing_cupy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    _device._import_cupy.cache_clear()
    try:
        with pytest.raises(gl.MissingDependencyError, match=r"gadgetloader\[cuda12\]"):
            _device.get_cupy("the pinned placement")
        assert not _device.cupy_available()
    finally:
        _device._import_cupy.cache_clear()


def test_import_needs_no_optional_packages() -> None:
    import subprocess

    code = (
        "import sys\n"
        "for m in ('cupy', 'h5py', 'zarr'): sys.modules[m] = None\n"
        "import gadgetloader as gl\n"
        "g = gl.DataGadget((3, 2), placement='cpu')\n"
        "print(g.getData([1]).shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch.Size([1, 2])" in out.stdout


def test_source_errors() -> None:
    with pytest.raises(gl.GadgetValueError, match="needs a source"):
        gl.DataGadget()
    with pytest.raises(gl.GadgetTypeError, match="not supported"):
        gl.DataGadget(np.array([["a", "b"]]), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="not supported"):
        gl.DataGadget(np.array([[object()]]), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="unknown dtype"):
        gl.DataGadget((3, 2), dtype="float33", placement="cpu")
    with pytest.raises(gl.GadgetValueError, match="at least one axis"):
        gl.DataGadget(np.float32(3.0), placement="cpu")


def test_missing_and_truncated_npy(tmp_path: Path) -> None:
    with pytest.raises(gl.GadgetFileNotFoundError, match="nope.npy"):
        gl.DataGadget(str(tmp_path / "nope.npy"), placement="cpu")
    good = tmp_path / "good.npy"
    np.save(good, np.arange(1000, dtype=np.float32).reshape(100, 10))
    cut = tmp_path / "cut.npy"
    cut.write_bytes(good.read_bytes()[:-7])
    with pytest.raises(gl.GadgetFileError, match=r"cut.npy is truncated"):
        gl.DataGadget(str(cut), placement="cpu")
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not an array at all")
    with pytest.raises(gl.GadgetFileError, match="junk.npy"):
        gl.DataGadget(str(junk), placement="cpu")
    obj = tmp_path / "obj.npy"
    np.save(obj, np.array([[1, "x"]], dtype=object), allow_pickle=True)
    with pytest.raises(gl.GadgetTypeError, match="obj.npy"):
        gl.DataGadget(str(obj), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="float64"):
        gl.DataGadget(str(good), placement="cpu", dtype="float64")


def test_fortran_and_big_endian_npy_load(tmp_path: Path) -> None:
    a = np.arange(60, dtype=np.float64).reshape(12, 5)
    np.save(tmp_path / "f.npy", np.asfortranarray(a))
    np.save(tmp_path / "b.npy", a.astype(">f8"))
    for name in ("f.npy", "b.npy"):
        g = gl.DataGadget(str(tmp_path / name), placement="cpu")
        np.testing.assert_array_equal(g.getNumpyVersion(), a)


def test_save_is_atomic_when_it_fails_part_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gadgetloader.io import _stream

    path = tmp_path / "t.npy"
    old = np.arange(20, dtype=np.float32).reshape(10, 2)
    np.save(path, old)
    g = gl.DataGadget(np.ones((5000, 64), np.float32), placement="cpu")
    monkeypatch.setattr(_stream, "STAGING_BYTES", 4096)  # many blocks
    calls = {"n": 0}
    real = g.store.read_block

    def failing(start: int, stop: int) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return real(start, stop)

    monkeypatch.setattr(g.store, "read_block", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        g.saveCupy(str(path))
    np.testing.assert_array_equal(np.load(path), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npy"]  # no partial file left


def test_bfloat16_has_no_npy_form(tmp_path: Path) -> None:
    g = gl.DataGadget(torch.ones(3, 2, dtype=torch.bfloat16), placement="cpu")
    with pytest.raises(gl.GadgetTypeError, match="no bfloat16"):
        g.saveCupy(str(tmp_path / "b.npy"))
    assert not os.listdir(tmp_path)
    assert g.getNumpyVersion().dtype == np.float32


def test_cli_bench_and_info_run_and_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import json

    from gadgetloader.cli import main

    out = tmp_path / "b.json"
    assert (
        main(
            [
                "bench",
                "--rows",
                "5000",
                "--ids",
                "512",
                "--width",
                "16",
                "--repeats",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["ids"] == 512 and data["bytes_moved"] == 512 * 16 * 4
    methods = [r for r in data["results"] if "ms" in r]
    assert methods and all(r.get("check", "ok") == "ok" and r["ms"] > 0 for r in methods)
    assert any(r["method"].startswith("gadgetloader") for r in methods)
    assert main(["info", "--no-measure"]) == 0
    assert "torch" in capsys.readouterr().out


@pytest.mark.skipif(HAS_CUDA, reason="the fallback only happens without CUDA")
def test_one_warning_for_device_and_placement_fallback() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = gl.DataGadget((3, 2), device="cuda", placement="pinned")
        gl.DataGadget((3, 2))
    assert g.placement == "cpu" and g.device.type == "cpu"
    assert len([w for w in caught if issubclass(w.category, gl.FallbackWarning)]) == 1


def test_float_shape_is_a_clear_error() -> None:
    with pytest.raises(gl.GadgetTypeError, match="tuple of non-negative ints"):
        gl.DataGadget((3.0, 2), placement="cpu")
