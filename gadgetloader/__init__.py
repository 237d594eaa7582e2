"""gadgetloader: PyTorch tables too big for the GPU.

Tables live in GPU memory, in page-locked host RAM the GPU reads and writes in
place, in ordinary RAM, or in .npy / HDF5 / zarr files; rows move to and from the
GPU with one kernel per batch.

``import gadgetloader`` needs only numpy, torch and tqdm: CuPy, h5py and zarr are
imported when a feature needs them, and their absence raises an error naming the
pip extra to install.
"""

from ._device import PLACEMENTS, cuda_available
from ._dtypes import SUPPORTED_DTYPES
from ._errors import (
    FallbackWarning,
    GadgetClosedError,
    GadgetError,
    GadgetFileError,
    GadgetFileNotFoundError,
    GadgetIndexError,
    GadgetKeyError,
    GadgetMemoryError,
    GadgetTypeError,
    GadgetValueError,
    MissingDependencyError,
    ReadOnlyError,
)
from .data import GadgetBatch, GadgetDataset, GadgetLoader, GadgetSampler
from .gadget import DataGadget, gather_many, scatter_many
from .switching import (
    SUPPORTED_OPTIMIZERS,
    ModelFactory,
    ModelSwitch,
    OffloadedEmbedding,
    OffloadedEmbeddingBag,
    OffloadedOptimizer,
    OptimizerFactory,
    OptimizerSwitch,
    PytorchModelFactory,
    PytorchOptimizerFactory,
    load_checkpoint,
    save_checkpoint,
)

__version__ = "0.1.0"

__all__ = [
    "PLACEMENTS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_OPTIMIZERS",
    "DataGadget",
    "GadgetBatch",
    "GadgetDataset",
    "GadgetLoader",
    "GadgetSampler",
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
    "FallbackWarning",
    "GadgetClosedError",
    "GadgetError",
    "GadgetFileError",
    "GadgetFileNotFoundError",
    "GadgetIndexError",
    "GadgetKeyError",
    "GadgetMemoryError",
    "GadgetTypeError",
    "GadgetValueError",
    "MissingDependencyError",
    "ReadOnlyError",
    "__version__",
    "cuda_available",
    "gather_many",
    "scatter_many",
]
