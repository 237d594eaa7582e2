"""Session 23 fixes: warnings point at the user's line, clearer messages for empty shapes
and non-integer slice bounds, NumPy's array protocol on a DataGadget, the bench command
line's usage errors, and GadgetLoader's pass-through options."""

from __future__ import annotations

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
    with pytest.raises(gl.GadgetValueError, match="must be positive; got -1"):
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
        ({"timeout": -1}, gl.GadgetValueError, "'timeout'"),
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
