"""Session 32's fixes:

* a long-double (float96/float128) array source converts with a floating ``dtype=``
  (through float64, refused where a finite value is beyond float64's range); without
  ``dtype=`` the refusal says how to convert it;
* the wrong-dtype message of ``insertData`` into a bfloat16 table names a conversion that
  exists (NumPy has no bfloat16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gadgetloader as gl

needs_longdouble = pytest.mark.skipif(
    np.dtype(np.longdouble).itemsize <= 8, reason="long double is float64 on this platform"
)


@pytest.fixture(autouse=True, scope="module")
def _no_cuda():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


@needs_longdouble
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", torch.bfloat16])
def test_longdouble_source_converts_with_a_float_dtype(dtype) -> None:
    src = np.array([[1.5, -2.25], [3.0, 0.125]], dtype=np.longdouble)
    g = gl.DataGadget(src, placement="cpu", dtype=dtype)
    want = torch.as_tensor(src.astype(np.float64)).to(g.dtype)
    assert g.dtype == want.dtype
    torch.testing.assert_close(g.as_tensor(), want, rtol=0, atol=0)


@needs_longdouble
def test_longdouble_source_keeps_inf_and_nan() -> None:
    src = np.array([[np.inf, -np.inf, np.nan]], dtype=np.longdouble)
    got = gl.DataGadget(src, placement="cpu", dtype="float32").getNumpyVersion()
    assert np.isposinf(got[0, 0]) and np.isneginf(got[0, 1]) and np.isnan(got[0, 2])


@needs_longdouble
def test_longdouble_beyond_float64_is_refused() -> None:
    src = np.array([[np.longdouble("1e400")]])
    with pytest.raises(gl.GadgetValueError, match="beyond float64's range"):
        gl.DataGadget(src, placement="cpu", dtype="float64")


@needs_longdouble
@pytest.mark.parametrize("kw", [{}, {"dtype": "int64"}])
def test_longdouble_without_a_float_dtype_says_how_to_convert(kw) -> None:
    src = np.ones((2, 2), dtype=np.longdouble)
    with pytest.raises(gl.GadgetTypeError, match="pass dtype='float64'"):
        gl.DataGadget(src, placement="cpu", **kw)


def test_bfloat16_insert_message_names_a_real_conversion() -> None:
    g = gl.DataGadget(torch.zeros(4, 2, dtype=torch.bfloat16), placement="cpu")
    rows = np.ones((1, 2), dtype=np.float32)
    with pytest.raises(gl.GadgetTypeError) as info:
        g.insertData(rows, [1])
    msg = str(info.value)
    assert "torch.as_tensor(data).to(torch.bfloat16)" in msg and "np.asarray" not in msg
    assert torch.equal(g.as_tensor(), torch.zeros(4, 2, dtype=torch.bfloat16))
    # the suggested conversion works
    g.insertData(torch.as_tensor(rows).to(torch.bfloat16), [1])
    assert torch.equal(g.as_tensor()[1], torch.ones(2, dtype=torch.bfloat16))
