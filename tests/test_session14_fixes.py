"""Session 14: NumPy-style indexes of DataGadget (slices, (rows, columns) tuples)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gadgetloader as gl


def _table(placement: str) -> tuple[gl.DataGadget, np.ndarray]:
    ref = np.arange(40, dtype=np.float32).reshape(10, 4)
    return gl.DataGadget(ref.copy(), placement=placement), ref


@pytest.mark.parametrize(
    "index",
    [slice(2, 7), slice(None, None, -3), slice(-4, None), slice(8, 2, -2), slice(5, 5)],
    ids=["2:7", "::-3", "-4:", "8:2:-2", "empty"],
)
def test_slices_of_rows_read_and_write_as_numpy(placement, index) -> None:
    g, ref = _table(placement)
    np.testing.assert_array_equal(g.getData(index).cpu().numpy(), ref[index])
    np.testing.assert_array_equal(g[index].cpu().numpy(), ref[index])
    new = -np.ones_like(ref[index])
    g[index] = torch.from_numpy(new)
    want = ref.copy()
    want[index] = new
    np.testing.assert_array_equal(g.getNumpyVersion(), want)


@pytest.mark.parametrize(
    "index",
    [
        (slice(0, 6), slice(0, 3)),
        (np.array([1, 1, 4]), 2),
        (torch.tensor([9, 0]), slice(1, None, 2)),
        (3, slice(1, None)),
        (np.array([[0, 1], [2, 3]]), -1),
        (np.array([0, 1]),),
    ],
    ids=["rows-cols", "array-int", "tensor-step", "int-slice", "2d-ids", "one-tuple"],
)
def test_row_and_column_indexes_read_and_write_as_numpy(placement, index) -> None:
    g, ref = _table(placement)
    np.testing.assert_array_equal(g.getData(index).cpu().numpy(), ref[index])
    part = np.full(ref[index].shape, -5.0, dtype=np.float32)
    g.insertData(torch.from_numpy(part), index)
    want = ref.copy()
    want[index] = part
    np.testing.assert_array_equal(g.getNumpyVersion(), want)


@pytest.mark.parametrize(
    "index,data,cls,words",
    [
        (slice(0, 3, 0), None, gl.GadgetValueError, ["slice(0, 3, 0)", "non-zero step"]),
        (slice("a", None), None, gl.GadgetTypeError, ["integer bounds"]),
        ((slice(0, 2), 4), None, gl.GadgetIndexError, ["index 4", "size 4"]),
        ((slice(0, 2), 1, 1), None, gl.GadgetIndexError, ["too many indices"]),
        ((slice(0, 2), [0, 1]), None, gl.GadgetTypeError, ["slices and ints", "list"]),
        ((slice(0, 2), slice(0, 2)), np.zeros((2, 3), np.float32), gl.GadgetValueError, ["(2, 2)"]),
        ((slice(0, 2), slice(0, 2)), np.zeros((2, 2), np.float64), gl.GadgetTypeError, ["float32"]),
        (
            (np.array([1, 10]), slice(0, 2)),
            np.zeros((2, 2), np.float32),
            gl.GadgetIndexError,
            ["10"],
        ),
    ],
)
def test_bad_indexes_are_refused_and_change_nothing(placement, index, data, cls, words) -> None:
    g, ref = _table(placement)
    with pytest.raises(cls) as ei:
        if data is None:
            g.getData(index)
        else:
            g.insertData(torch.from_numpy(data), index)
    for w in words:
        assert w in str(ei.value), str(ei.value)
    np.testing.assert_array_equal(g.getNumpyVersion(), ref)


def test_out_is_refused_with_an_index_into_the_rows() -> None:
    g, _ = _table("cpu")
    with pytest.raises(gl.GadgetValueError, match="out="):
        g.getData((slice(0, 2), slice(0, 2)), out=torch.empty(2, 2))


def test_a_tuple_of_ints_stays_a_list_of_ids() -> None:
    g, ref = _table("cpu")
    np.testing.assert_array_equal(g.getData((1, 3, 3)).cpu().numpy(), ref[[1, 3, 3]])


def test_epochs_past_64_bits_are_refused_not_wrapped() -> None:
    s = gl.GadgetSampler(10, batch_size=3, seed=1)
    state = s.state_dict()
    for bad in (
        lambda: s.set_epoch(2**64),
        lambda: s.set_epoch(2**70),
        lambda: s.load_state_dict({**state, "epoch": 2**64}),
    ):
        with pytest.raises(gl.GadgetValueError, match="2\\*\\*64"):
            bad()
    assert s.state_dict() == state  # refused calls change nothing
    s.set_epoch(2**64 - 1)  # the last epoch that is its own
    last = torch.cat(list(s))
    s.set_epoch(0)
    first = torch.cat(list(s))
    assert sorted(last.tolist()) == sorted(first.tolist()) == list(range(10))


def test_bag_include_last_offset_takes_a_bool_only() -> None:
    with pytest.raises(gl.GadgetTypeError, match="include_last_offset"):
        gl.OffloadedEmbeddingBag(5, 2, "sum", "cpu", device="cpu", include_last_offset="yes")
    bag = gl.OffloadedEmbeddingBag(5, 2, "sum", "cpu", device="cpu", include_last_offset=1)
    assert bag.include_last_offset is True


def test_convert_of_a_wide_unsigned_file_gives_advice_the_command_can_follow(tmp_path) -> None:
    import subprocess
    import sys

    src = tmp_path / "u.npy"
    np.save(src, np.arange(6, dtype=np.uint32).reshape(3, 2))
    out = subprocess.run(
        [sys.executable, "-m", "gadgetloader", "convert", str(src), str(tmp_path / "u.h5")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert "uint32" in out.stderr and "signed type" in out.stderr
    assert "pass dtype=" not in out.stderr  # (convert has no dtype option)
    assert not (tmp_path / "u.h5").exists()
