"""How files are read and written: one module per format behind :class:`ArraySource` / :class:`ArraySink`."""

from __future__ import annotations

from ._atomic import replace_atomically, temp_path_beside
from ._base import ArraySink, ArraySource, SourceShape
from ._hdf5 import Hdf5Sink, Hdf5Source, is_hdf5
from ._npy import NpySink, NpySource, is_npy
from ._open import (
    FORMATS,
    guess_format,
    open_sink,
    open_source,
    register_format,
    sink_format,
    sink_takes,
)
from ._stream import load_converted, load_into, save_from
from ._zarr import ZarrSink, ZarrSource, is_zarr

__all__ = [
    "FORMATS",
    "ArraySink",
    "guess_format",
    "open_sink",
    "open_source",
    "register_format",
    "sink_format",
    "sink_takes",
    "ArraySource",
    "Hdf5Sink",
    "Hdf5Source",
    "NpySink",
    "NpySource",
    "SourceShape",
    "ZarrSink",
    "ZarrSource",
    "is_hdf5",
    "is_npy",
    "is_zarr",
    "load_converted",
    "load_into",
    "replace_atomically",
    "save_from",
    "temp_path_beside",
]
