"""Session 30's fixes:

* a ``range`` of ids reaching below 0 names the table's row count, as every other id does;
* ``GadgetDataset`` reads a 0-d tensor or array as an id (a ``GadgetBatch`` of rows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gadgetloader as gl


@pytest.mark.parametrize(
    ("ids", "bad"),
    [
        (range(-2, 3), -2),
        (range(0, -5, -1), -4),
        (range(3, -1, -1), None),  # all in range: read
        (range(3, 8), 7),
        (range(-3, 9), -3),
    ],
)
def test_a_range_past_either_end_names_the_row_count(ids: range, bad: int | None) -> None:
    a = torch.arange(10.0).view(5, 2)
    g = gl.DataGadget(a.clone(), placement="cpu")
    if bad is None:
        torch.testing.assert_close(g.getData(ids), a[list(ids)], rtol=0, atol=0)
        return
    for call in (lambda: g.getData(ids), lambda: g.insertData(torch.ones(len(ids), 2), ids)):
        with pytest.raises(gl.GadgetIndexError) as info:
            call()
        msg = str(info.value)
        assert f"id {bad} is" in msg
        assert "this table has 5 rows" in msg and "[0, 4]" in msg
        assert "nothing was read or written" in msg
    torch.testing.assert_close(g.getData(range(5)), a, rtol=0, atol=0)


def test_a_range_on_an_empty_table_says_it_has_no_rows() -> None:
    g = gl.DataGadget(torch.zeros(0, 2), placement="cpu")
    for ids in (range(-1, 1), range(0, 2)):
        with pytest.raises(gl.GadgetIndexError, match="this table has no rows"):
            g.getData(ids)


@pytest.mark.parametrize("make", [torch.tensor, np.array], ids=["tensor", "numpy"])
def test_a_zero_dim_id_reads_one_row_as_a_batch(make) -> None:
    x = torch.arange(10.0).view(5, 2)
    y = torch.arange(5) * 3
    ds = gl.GadgetDataset(x, y, device="cpu")
    got = ds[make(3)]
    assert isinstance(got, gl.GadgetBatch)
    torch.testing.assert_close(got[0], x[3], rtol=0, atol=0)
    assert int(got[1]) == 9 and got[1].dim() == 0
    with pytest.raises(gl.GadgetIndexError, match="negative"):
        ds[make(-1)]
