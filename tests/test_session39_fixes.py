"""Session 39's fixes.

- A failed zarr read through zarr itself (arrays whose chunks the library does not decode
  directly: sharded, or with a codec such as crc32c) returns only once zarr's other chunk
  tasks have stopped: zarr raises at the first failed chunk while the others run on,
  writing into the caller's buffer, which the caller may free right after.
- A pinned table on driver-allocated pages (``pages='cudahost'``) frees them only once
  the last host view handed out is gone, as the mmap-backed pages always did: closing the
  store used to free the memory under a live view.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time

import numpy as np
import pytest
import torch

zarr = pytest.importorskip("zarr", minversion="3")

from conftest import NEEDS_CUPY  # noqa: E402
from zarr.codecs import Crc32cCodec  # noqa: E402

import gadgetloader as gl  # noqa: E402
from gadgetloader.io._zarr import ZarrSource  # noqa: E402


def _with_crc32c(path, rows: int = 64, chunk: int = 4, width: int = 8) -> np.ndarray:
    data = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    from zarr.codecs import BytesCodec

    z = zarr.create_array(
        str(path),
        shape=data.shape,
        chunks=(chunk, width),
        dtype="float32",
        serializer=BytesCodec(),
        compressors=[Crc32cCodec()],
    )
    z[:] = data
    return data


def test_a_failed_zarr_read_returns_after_zarrs_other_chunk_tasks(tmp_path, monkeypatch):
    path = tmp_path / "c.zarr"
    data = _with_crc32c(path)
    src = ZarrSource(str(path))
    assert src._decoders is None  # the read goes through zarr
    # damage chunk 0 (its checksum no longer matches); the other chunks decode slowly
    first = os.path.join(str(path), "c", "0", "0")
    with open(first, "r+b") as f:
        f.seek(3)
        f.write(b"\xff\xff\xff")
    original = Crc32cCodec._decode_single
    done: list[float] = []

    async def slow(self, chunk_bytes, chunk_spec):
        out = await original(self, chunk_bytes, chunk_spec)  # chunk 0 raises here at once
        await asyncio.sleep(0.3)
        done.append(time.monotonic())
        return out

    monkeypatch.setattr(Crc32cCodec, "_decode_single", slow)
    out = np.zeros_like(data)
    with pytest.raises(gl.GadgetFileError, match="cannot read rows 0:64"):
        src.read_into(0, 64, out)
    returned = time.monotonic()
    seen = out.copy()
    time.sleep(0.8)
    # every other chunk finished before the call returned, and nothing wrote after it
    assert len(done) == 15 and max(done) <= returned
    np.testing.assert_array_equal(out, seen)
    np.testing.assert_array_equal(out[4:], data[4:])


@pytest.mark.gpu
@NEEDS_CUPY
@pytest.mark.parametrize("pages", ["cudahost", "default"])
def test_a_host_view_outlives_its_closed_pinned_store(pages):
    from gadgetloader.stores._pinned import PinnedStore

    store = PinnedStore((256, 16), torch.float32, pages=pages)
    view = store.host_view()
    assert view is not None
    view.copy_(torch.arange(256 * 16, dtype=torch.float32).reshape(256, 16))
    fin = store._buf._finalizer
    store.close()
    del store
    gc.collect()
    torch.cuda.synchronize()
    if pages == "cudahost":  # the view holds the memory
        assert fin is not None and fin.alive
    # the rows are still there, and writable
    assert torch.equal(view, torch.arange(256 * 16, dtype=torch.float32).reshape(256, 16))
    view[3] = -1.0
    assert float(view[3].sum()) == -16.0
    del view
    gc.collect()
    assert fin is not None and not fin.alive  # freed (unregistered) with the last view
