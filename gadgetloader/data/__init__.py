"""The input pipeline: tables as a torch Dataset, a batch sampler, GPU prefetch.

* :class:`GadgetDataset` -- columns (DataGadgets, files, arrays) with the same
  rows; ``DataLoader(GadgetDataset(...), batch_size=B, shuffle=True)`` yields
  GPU batches, one gather per column per batch.
* :class:`GadgetSampler` -- the fast form's batch sampler: seeded, resumable,
  sharded over ranks, with a chunk-aware order for file-backed tables.
* :class:`GadgetLoader` -- a DataLoader that gathers the next batches on a side
  CUDA stream while the current step computes.
"""

from __future__ import annotations

from ._dataset import GadgetBatch, GadgetDataset
from ._loader import GadgetLoader
from ._sampler import ORDERS, GadgetSampler

__all__ = ["ORDERS", "GadgetBatch", "GadgetDataset", "GadgetLoader", "GadgetSampler"]
