"""Defects found in session 9, each with a test that failed before its fix."""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest
from torch.utils.data import DataLoader

import gadgetloader as gl

h5py = pytest.importorskip("h5py")

_FORK = "fork" in mp.get_all_start_methods()


@pytest.mark.skipif(not _FORK, reason="needs the fork start method")
def test_fork_while_another_thread_reads_an_hdf5_table(tmp_path):
    # A thread reading the file while DataLoader forks its workers used to leave the file
    # open in the child's copy of HDF5, and the worker's own (unlocked) open failed with
    # "file locking flag values don't match".
    n, width = 20_000, 8
    data = np.arange(n * width, dtype=np.float32).reshape(n, width)
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(512, width))
    g = gl.DataGadget(str(path), dataset="x", placement="file")
    rng = np.random.default_rng(0)
    g.getData(rng.integers(0, n, 100))  # first use (imports) before any thread starts
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        r = np.random.default_rng(1)
        try:
            while not stop.is_set():
                ids = r.integers(0, n, 3000)
                got = g.getData(ids).cpu().numpy()
                np.testing.assert_array_equal(got, data[ids])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        ds = gl.GadgetDataset(g)
        for epoch in range(8):
            loader = DataLoader(
                ds,
                batch_size=1000,
                shuffle=True,
                num_workers=2,
                multiprocessing_context="fork",
                timeout=120,
            )
            seen = []
            for (batch,) in loader:
                seen.append(batch.cpu().numpy())
            rows = np.concatenate(seen)
            order = np.argsort(rows[:, 0])
            np.testing.assert_array_equal(rows[order], data, err_msg=f"epoch {epoch}")
    finally:
        stop.set()
        th.join(30)
    assert not errors, errors
