"""Property-based tests: gather and scatter against NumPy, every dtype, repeated ids."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gadgetloader as gl
from gadgetloader._dtypes import SUPPORTED_DTYPES, numpy_dtype


def _np_table(dtype: torch.dtype, rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    npd = numpy_dtype(dtype)
    if npd == np.bool_:
        return rng.integers(0, 2, (rows, width)).astype(bool)
    if npd.kind == "f":
        return rng.standard_normal((rows, width)).astype(npd)
    return rng.integers(0, 100, (rows, width)).astype(npd)  # uint16 bits for bfloat16 too


def _torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(a.view(np.int16) if dtype == torch.bfloat16 else a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    rows=st.integers(1, 64),
    width=st.integers(1, 9),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_gather_then_scatter_matches_numpy(
    placement: str,
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    width: int,
    data: st.DataObject,
    seed: int,
) -> None:
    table = _np_table(dtype, rows, width, seed)
    g = gl.DataGadget(_torch(table, dtype), placement=placement, device=device)
    ids = np.array(data.draw(st.lists(st.integers(0, rows - 1), max_size=3 * rows)), dtype=np.int64)
    got = g.getData(ids)
    np.testing.assert_array_equal(_bits(got).reshape(len(ids), width), table[ids])

    new = _np_table(dtype, len(ids), width, seed + 1)
    g.insertData(_torch(new, dtype).to(device), torch.from_numpy(ids).to(device))
    expected = table.copy()
    for i, r in enumerate(ids):  # NumPy's sequential assignment: the last occurrence wins
        expected[r] = new[i]
    np.testing.assert_array_equal(_bits(g.getData(np.arange(rows))), expected)
