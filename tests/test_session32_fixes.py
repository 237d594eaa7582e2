"""Session 32's fixes:

* a long-double (float96/float128) array source converts with a floating ``dtype=``
  (through float64, refused where a finite value is beyond float64's range); without
  ``dtype=`` the refusal says how to convert it;
* the wrong-dtype message of ``insertData`` into a bfloat16 table names a conversion that
  exists (NumPy has no bfloat16);
* the word2vec example's ``train()`` refuses bad settings with ``ValueError`` (as its
  docstring says; ``dim=0`` was a ZeroDivisionError, ``batch_size=-1`` trained nothing) and
  catches divergence that only the last step of an epoch shows;
* a Ctrl-C that lands while a save creates its partial file stops the save and removes
  the partial file (it was left behind, and the interrupt sometimes lost);
* (code review) ``GadgetBatch.to`` keeps devices other than CUDA and the CPU (``meta``);
  ``convert`` with several options a .npy file does not take is a usage error too; the
  word2vec ``train()`` takes NumPy integers and NumPy / tensor learning rates.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

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


# ---- the word2vec example's train() checks its settings as the command line does -----------


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("\n".join(["apple car bus grape"] * 20), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"dim": 0}, "dim must be at least 1"),
        ({"negatives": 0}, "negatives must be at least 1"),
        ({"negatives": (1 << 20) + 1}, "at most 1048576"),
        ({"epochs": -1}, "epochs must be at least 1"),
        ({"batch_size": -1}, "batch_size must be at least 1"),
        ({"window": 0}, "window must be at least 1"),
        ({"batch_size": 2.0}, "batch_size must be a whole number"),
        ({"seed": True}, "seed must be a whole number"),
        ({"lr": 0.0}, "lr must be a number above 0"),
        ({"lr": float("nan")}, "lr must be a number above 0"),
        ({"lr": 1e31}, "at most 1e+30"),
    ],
)
def test_word2vec_train_refuses_bad_settings(corpus, kw, fragment) -> None:
    from datasets import word2vec

    with pytest.raises(ValueError, match=re.escape(fragment)):
        word2vec.train(corpus, progress=False, **kw)


def test_word2vec_last_step_divergence_is_caught(corpus) -> None:
    """A one-batch corpus: the loss of every epoch is measured before its only step, so the
    blow-up of the last step shows only in the vectors it leaves."""
    from datasets import word2vec

    with pytest.raises(ValueError, match="not finite in the"):
        word2vec.train(corpus, dim=4, epochs=2, lr=1e30, placement="cpu", progress=False)
    ok = word2vec.train(corpus, dim=4, epochs=2, lr=0.01, placement="cpu", progress=False)
    assert np.isfinite(ok.vectors()).all() and len(ok.losses) == 2


# ---- Ctrl-C while a save makes its partial file --------------------------------------------


@pytest.mark.parametrize("ext", ["npy", "h5", "zarr"])
def test_interrupt_while_the_partial_file_is_made(tmp_path, ext) -> None:
    """A watcher thread interrupts the main thread the moment the partial file appears;
    every save must raise KeyboardInterrupt and leave no partial file behind."""
    import _thread
    import sys
    import threading
    import time

    if ext != "npy":
        pytest.importorskip("h5py" if ext == "h5" else "zarr")
    g = gl.DataGadget((32, 4096), dtype="float32", placement="cpu")
    g.fill_(1.0)
    target = tmp_path / f"t.{ext}"
    g.save(target, progress=False)  # the old file, which must survive
    g.fill_(2.0)

    fired: list[bool] = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            if any(".partial-" in n for n in os.listdir(tmp_path)):
                fired.append(True)
                _thread.interrupt_main()
                return

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    raised = 0
    try:
        for _ in range(15):
            stop = threading.Event()
            t = threading.Thread(target=watch, args=(stop,))
            t.start()
            try:
                try:
                    g.save(target, progress=False)
                    time.sleep(0.05)  # an interrupt that comes late lands here
                finally:
                    stop.set()
                    t.join()  # (the watcher interrupts once at most: nothing after this)
            except KeyboardInterrupt:
                raised += 1
    finally:
        sys.setswitchinterval(old_interval)
    # (on a busy machine the watcher may miss a save's partial file: then no interrupt)
    assert raised == len(fired) and len(fired) >= 5
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    # the old file, or the new one where the interrupt came during the commit (then it is
    # InterruptedAfterWrite, a KeyboardInterrupt): never a mix
    back = gl.DataGadget(str(target), placement="cpu").as_tensor()
    assert torch.equal(back, torch.ones(32, 4096)) or torch.equal(back, torch.full((32, 4096), 2.0))


# ---- GadgetBatch.to, convert's usage errors, word2vec's NumPy settings -----------------------


def test_batch_to_keeps_other_device_types_and_maps_indexes() -> None:
    b = gl.GadgetBatch((torch.arange(3), torch.ones(3)))
    for dev in ("meta", torch.device("meta")):
        out = b.to(dev)
        assert all(t.device.type == "meta" for t in out) and out[0].dtype == torch.int64
    with warnings.catch_warnings():  # (CUDA is hidden here: a CUDA device means the CPU)
        warnings.simplefilter("ignore", gl.FallbackWarning)
        assert [t.device.type for t in b.to(np.int64(0))] == ["cpu", "cpu"]
    for bad in (-1, None, "bogus", 1.5):
        with pytest.raises(gl.GadgetTypeError, match="GadgetBatch.to takes a device"):
            b.to(bad)


def test_convert_several_options_a_npy_file_does_not_take_is_a_usage_error(tmp_path) -> None:
    src = tmp_path / "s.npy"
    np.save(src, np.ones((4, 3), np.float32))
    r = subprocess.run(
        [sys.executable, "-m", "gadgetloader", "convert", str(src), str(tmp_path / "o.npy")]
        + ["--compression", "gzip", "--chunk-rows", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 2, r.stderr
    assert "unexpected option --chunk-rows, --compression" in r.stderr
    assert not (tmp_path / "o.npy").exists()


def test_word2vec_train_takes_numpy_and_tensor_numbers(corpus) -> None:
    from datasets import word2vec

    a = word2vec.train(corpus, dim=4, seed=3, lr=0.01, placement="cpu", progress=False)
    b = word2vec.train(
        corpus,
        dim=np.int64(4),
        seed=np.int64(3),
        lr=np.float32(0.01),
        placement="cpu",
        progress=False,
    )
    c = word2vec.train(
        corpus, dim=4, seed=3, lr=torch.tensor(0.01), placement="cpu", progress=False
    )
    assert a.vectors().shape == (4, 4)
    np.testing.assert_allclose(b.vectors(), a.vectors(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(c.vectors(), a.vectors(), rtol=1e-6, atol=1e-7)
