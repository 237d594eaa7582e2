"""How embedding rows and their optimizer state are paged around a training step.

* :class:`ModelSwitch` / :class:`OptimizerSwitch` -- one table per model variable and
  per optimizer state, gathered into the model before the forward pass and written
  back after the optimizer step (SpeedTorch's protocol, with exact duplicates).
* ``ModelFactory``, ``OptimizerFactory``, ``PytorchModelFactory``,
  ``PytorchOptimizerFactory`` -- SpeedTorch's names for them.
* :class:`OffloadedEmbedding`, :class:`OffloadedEmbeddingBag`, :class:`OffloadedOptimizer`
  -- a drop-in module and optimizer wrapper: no before/after calls in the loop.
* :func:`save_checkpoint` / :func:`load_checkpoint` -- bit-identical resume.
"""

from __future__ import annotations

from ._checkpoint import load_checkpoint, save_checkpoint
from ._embedding import OffloadedEmbedding, OffloadedEmbeddingBag, OffloadedOptimizer
from ._factories import ModelFactory, OptimizerFactory, PytorchModelFactory, PytorchOptimizerFactory
from ._model import ModelSwitch
from ._optim import SUPPORTED_OPTIMIZERS, OptimizerSwitch
from ._rows import DUPLICATE_MODES

__all__ = [
    "DUPLICATE_MODES",
    "SUPPORTED_OPTIMIZERS",
    "ModelFactory",
    "ModelSwitch",
    "OffloadedEmbedding",
    "OffloadedEmbeddingBag",
    "OffloadedOptimizer",
    "OptimizerFactory",
    "OptimizerSwitch",
    "PytorchModelFactory",
    "PytorchOptimizerFactory",
    "load_checkpoint",
    "save_checkpoint",
]
