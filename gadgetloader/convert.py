"""Convert a table between .npy, HDF5 and zarr, streaming chunk by chunk.

The command ``gadgetloader convert SRC DST`` and the function :func:`convert` read
the source in blocks of whole chunks and write each block to the destination
(written beside it and renamed into place when complete), so memory stays at one
staging block whatever the table's size.

Examples
--------
>>> import numpy as np, tempfile, os
>>> from gadgetloader.convert import convert
>>> d = tempfile.mkdtemp()
>>> np.save(os.path.join(d, "t.npy"), np.arange(12, dtype=np.float32).reshape(4, 3))
>>> info = convert(os.path.join(d, "t.npy"), os.path.join(d, "t.h5"), progress=False)
>>> info["shape"], info["dst_format"]
((4, 3), 'hdf5')
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

import numpy as np
import torch

from . import io as _io
from ._dtypes import dtype_name
from ._errors import GadgetError, GadgetTypeError, GadgetValueError, as_flag
from ._paths import as_path
from .io._atomic import InterruptedAfterWrite, interrupts_deferred
from .io._stream import STAGING_BYTES, blocks, progress_bar

__all__ = ["add_arguments", "convert", "run"]


def _rows_per_block(row_nbytes: int, src_chunk: int, dst_chunk: int | None) -> int:
    """About :data:`STAGING_BYTES` of rows, a multiple of the destination's chunk (and,
    where it fits, of the source's), so every chunk is read and written whole."""
    unit = dst_chunk or src_chunk or 1
    if src_chunk and dst_chunk and unit % src_chunk:
        lcm = int(np.lcm(src_chunk, dst_chunk))
        if lcm * row_nbytes <= 4 * STAGING_BYTES:
            unit = lcm
    target = max(1, STAGING_BYTES // max(1, row_nbytes))
    return max(unit, (target // unit) * unit)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dataset: str | None = None,
    dst_dataset: str | None = None,
    chunk_rows: int | None = None,
    compression: str | None = None,
    src_format: str | None = None,
    dst_format: str | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Copy the table at ``src`` into a new file ``dst`` (format from its extension).

    Parameters
    ----------
    src, dst : str or path
        Source and destination (.npy, .h5/.hdf5/.hdf, .zarr, or by content for ``src``).
    dataset : str, optional
        The array inside an HDF5 file or zarr group at ``src``.
    dst_dataset : str, optional
        Its name at ``dst`` (default: ``dataset``, else the format's default).
    chunk_rows : int, optional
        Rows per chunk at ``dst`` (HDF5 / zarr; default about 1 MiB of rows).
    compression : str, optional
        ``dst``'s compression: HDF5 ``'gzip'`` / ``'lzf'``; zarr ``'zstd'`` (default),
        ``'gzip'``, ``'blosc'``; ``'none'`` for none.
    src_format, dst_format : str, optional
        Force a format instead of guessing it.
    progress : bool, optional
        A progress bar (default: only for large tables).

    Returns
    -------
    dict
        ``src``, ``dst``, formats, ``shape``, ``dtype``, ``bytes``, ``seconds``.

    Raises
    ------
    GadgetError
        Any problem with either file; ``dst`` is then left as it was.
    """
    src_p, dst_p = as_path(src, "the source path"), as_path(dst, "the destination path")
    progress = as_flag(progress, "progress", allow_none=True)
    if os.path.realpath(src_p) == os.path.realpath(dst_p) or _same_file(src_p, dst_p):
        # (through a symbolic or hard link too: a save replaces the file the link names)
        raise GadgetValueError(
            f"source and destination are the same file {src_p!r}"
            + ("" if os.path.abspath(src_p) == os.path.abspath(dst_p) else f" (through {dst_p!r})")
        )
    t0 = time.perf_counter()
    try:
        source = _io.open_source(src_p, format=src_format, dataset=dataset)
    except GadgetValueError as exc:
        if dataset is not None and "does not apply" in str(exc):
            raise GadgetValueError(
                f"{exc}; --dataset / dataset= names the array inside the source, and "
                f"--dst-dataset / dst_dataset= names it in {dst_p}"
            ) from exc
        raise
    try:
        target = os.path.realpath(dst_p)
        for w in getattr(source, "watch_paths", None) or (source.path,):
            # the rows live in the destination (a zarr array inside it, an HDF5 external
            # link's target): replacing it would destroy them and the rest of that file
            real = os.path.realpath(w)
            if real == target or real.startswith(target + os.sep) or _same_file(w, dst_p):
                raise GadgetValueError(
                    f"the rows of {src_p!r} are stored in {real!r}, which the "
                    f"destination {dst_p!r} would replace; write to another file"
                )
        store = _zarr_store_root(src_p)
        if store is not None and target.startswith(store + os.sep):
            # a new array inside the source store would change the store (a group's list
            # of arrays, or an array's chunk folder)
            raise GadgetValueError(
                f"the destination {dst_p!r} lies inside the zarr store {store!r} that holds "
                f"the source {src_p!r}, which convert must leave as it was; write outside it"
            )
        if source.num_rows == 0:
            raise GadgetValueError(
                f"{src_p} holds a table with zero rows {tuple(source.shape)}; nothing to "
                "convert (gadgetloader cannot load a zero-row table)"
            )
        out_fmt = _io.sink_format(dst_p, dst_format)
        options: dict[str, Any] = {}
        if out_fmt == "npy" and source.dtype == torch.bfloat16:
            raise GadgetTypeError(
                f"{src_p} holds a bfloat16 table, which has no .npy form (NumPy has no "
                f"bfloat16 dtype) and convert keeps the dtype: convert it to HDF5 or zarr "
                f"(bit-exact) instead of {dst_p}"
            )
        if out_fmt == "npy" and dst_dataset is not None:
            raise GadgetValueError(
                f"--dst-dataset / dst_dataset= names an array inside an HDF5 file or zarr group; "
                f"{dst_p} is a .npy file, which holds one array without a name"
            )
        name = dst_dataset if dst_dataset is not None else (dataset if out_fmt != "npy" else None)
        if name is not None:
            options["dataset"] = name
        if chunk_rows is not None:
            options["chunk_rows"] = chunk_rows
        if compression is not None:
            options["compression"] = compression
        sink = None
        try:
            # Ctrl-C is held from before the sink makes its partial file (which an
            # interrupt landing in between would leave behind)
            with interrupts_deferred() as check:
                sink = _io.open_sink(dst_p, source.shape, source.dtype, format=out_fmt, **options)
                check()
                rpb = _rows_per_block(
                    source.row_nbytes,
                    source.chunk_rows if getattr(source, "chunked", False) else 0,
                    getattr(sink, "chunk_rows", None),
                )
                buf = np.empty(
                    (min(rpb, max(1, source.num_rows)), *source.shape[1:]),
                    dtype=source.numpy_dtype,
                )
                bar = progress_bar(source.nbytes, f"convert {src_p} -> {dst_p}", progress)
                with bar:
                    for start, stop in blocks(source.num_rows, rpb):
                        block = buf[: stop - start]
                        source.read_into(start, stop, block)
                        sink.write(start, block)
                        bar.update((stop - start) * source.row_nbytes)
                        check()
                check()  # the last point where the write can stop with the old file in place
                sink.commit()
                check.committed = True
        except BaseException:
            if sink is not None:
                sink.abort()
            raise
        check.deliver(dst_p)  # a Ctrl-C held during the commit, now the file is written
    finally:
        source.close()
    return {
        "src": src_p,
        "dst": dst_p,
        "src_format": source.format,
        "dst_format": out_fmt,
        "shape": tuple(source.shape),
        "dtype": dtype_name(source.dtype),
        "bytes": source.nbytes,
        "seconds": time.perf_counter() - t0,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gadgetloader convert``."""
    parser.add_argument("src", help="source table: .npy, .h5/.hdf5/.hdf or .zarr")
    parser.add_argument("dst", help="destination (format from its extension)")
    parser.add_argument("--dataset", help="array inside the source HDF5 file or zarr group")
    parser.add_argument("--dst-dataset", help="its name in the destination (default: --dataset)")
    from .bench._common import positive_int

    parser.add_argument("--chunk-rows", type=positive_int, help="rows per chunk in the destination")
    parser.add_argument(
        "--compression",
        help="destination compression: HDF5 gzip|lzf, zarr zstd|gzip|blosc, or none",
    )
    parser.add_argument(
        "--format", dest="src_format", help="force the source format (npy, hdf5, zarr)"
    )
    parser.add_argument("--to", dest="dst_format", help="force the destination format")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show a progress bar",
    )
    bar.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show a progress bar"
    )


def _zarr_store_root(path: str) -> str | None:
    """The outermost zarr node (group or array folder) that holds ``path`` (itself
    included), by real path; None where ``path`` is not in a zarr store."""
    from .io._zarr import is_zarr

    node, root = os.path.realpath(path), None
    while os.path.isdir(node) and is_zarr(node):
        root = node
        parent = os.path.dirname(node)
        if parent == node:
            break
        node = parent
    return root


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (yet)
        return False


def run(args: argparse.Namespace) -> int:
    """Run ``gadgetloader convert``; prints one line and returns the exit status (an
    option value the formats do not take raises ``bench.OptionError``, which the command
    line reports as a usage error, exit status 2)."""
    try:
        info = convert(
            args.src,
            args.dst,
            dataset=args.dataset,
            dst_dataset=getattr(args, "dst_dataset", None),
            chunk_rows=args.chunk_rows,
            compression=args.compression,
            src_format=getattr(args, "src_format", None),
            dst_format=getattr(args, "dst_format", None),
            progress=getattr(args, "progress", None),
        )
    except GadgetError as exc:
        # the library's messages name keyword arguments; on the command line they are flags
        msg = str(exc).replace("pass dataset= to", "pass --dataset to")
        msg = msg.replace("(omit dataset=)", "(omit --dataset)")
        msg = msg.replace("or pass format=...", "or pass --format (source) / --to (destination)")
        msg = msg.replace("chunk_rows must", "--chunk-rows must")
        msg = re.sub(
            r"unexpected option\(s\) \[([^\]]*)\]",
            lambda m: (
                "unexpected option "
                + ", ".join("--" + name.strip(" '").replace("_", "-") for name in m[1].split(","))
            ),
            msg,
        )
        msg = msg.replace(" compression '", " compression (--compression) '")
        if "torch cannot index unsigned integers" in msg:
            # the library's hint names DataGadget's dtype=, which this command does not take
            head, _, tail = msg.partition(" (torch cannot index")
            kept = tail.split("); tables hold", 1)
            msg = (
                f"{head} (torch cannot index unsigned integers wider than 8 bits on every version "
                "gadgetloader supports; write the values to a file of a signed type first, e.g. "
                "with NumPy in blocks, or load it with DataGadget(path, dtype='int64'))"
                + (f"; tables hold{kept[1]}" if len(kept) == 2 else "")
            )
        if "pass dtype='float64', or another float dtype," in msg:
            # the library's hint names DataGadget's dtype=, which this command does not take
            head, _, tail = msg.partition(" (pass dtype='float64'")
            kept = tail.split("); tables hold", 1)
            msg = (
                f"{head} (convert keeps the dtype; rewrite the file as float64 first, e.g. "
                "with NumPy: np.save(new_path, np.load(path).astype('float64')))"
                + (f"; tables hold{kept[1]}" if len(kept) == 2 else "")
            )
        if msg.startswith("Unknown format"):
            msg = f"{msg} (--format names the source's format, --to the destination's)"
        if (
            msg.startswith("Unknown format")
            or " compression (--compression) '" in msg
            or "unexpected option --" in msg
            or "--dataset / dataset= names the array inside the source" in msg
            or msg.startswith("--dst-dataset / dst_dataset= names an array inside")
        ):
            # an option value the destination (or source) format does not take: a usage
            # error, as argparse reports its own (exit status 2)
            from .bench._common import OptionError

            raise OptionError(msg) from exc
        # one line, whatever the message (h5py's error text may hold line breaks)
        print(f"gadgetloader convert: error: {' '.join(msg.split())}", file=sys.stderr)
        return 1
    except OSError as exc:  # the file system's refusal (a path through a file, no space...)
        print(f"gadgetloader convert: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except InterruptedAfterWrite:
        print(
            f"gadgetloader convert: interrupted after {args.dst} was written (complete)",
            file=sys.stderr,
        )
        return 130
    except KeyboardInterrupt:
        print(f"gadgetloader convert: interrupted; {args.dst} was not written", file=sys.stderr)
        return 130
    rate = info["bytes"] / info["seconds"] / 1e9 if info["seconds"] > 0 else float("inf")
    print(
        f"{info['src']} ({info['src_format']}) -> {info['dst']} ({info['dst_format']}): "
        f"{info['shape']} {info['dtype']}, {info['bytes'] / 1e6:.1f} MB in "
        f"{info['seconds']:.2f} s ({rate:.2f} GB/s)"
    )
    return 0
