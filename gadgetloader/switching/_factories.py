"""SpeedTorch's switcher names, as thin faces over :class:`ModelSwitch` / :class:`OptimizerSwitch`.

The four classes differ only in how they name the placement: ``CPUPinn`` for the
CuPy-era ``ModelFactory`` / ``OptimizerFactory``, ``deviceType`` and ``pinType``
for the ``Pytorch*`` ones. Tables, gathers, scatters and optimizer-state paging
are the same code for all of them.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import GadgetTypeError, GadgetValueError, as_flag
from ._model import ModelSwitch
from ._optim import OptimizerSwitch

__all__ = ["ModelFactory", "OptimizerFactory", "PytorchModelFactory", "PytorchOptimizerFactory"]


def _cupy_placement(CPUPinn: bool, placement: str | None) -> str:
    pin = as_flag(CPUPinn, "CPUPinn")  # checked even where placement= decides
    if placement is not None:
        return placement
    return "pinned" if pin else "cuda"


def _torch_placement(deviceType: Any, pinType: bool, placement: str | None) -> str:
    """The placement for SpeedTorch's ``deviceType`` (a device string such as ``'cuda'``,
    ``'cuda:0'``, ``'cpu'``, or a ``torch.device``: its type decides; a CUDA table lives on
    the model variable's GPU) and ``pinType``."""
    pin = as_flag(pinType, "pinType")  # checked even where deviceType or placement= decides
    if placement is not None:
        return placement
    if not isinstance(deviceType, (str, torch.device)):
        raise GadgetTypeError(
            f"deviceType must be a device string ('cuda', 'cpu', 'cuda:N') or a torch.device; "
            f"got {type(deviceType).__name__} {deviceType!r:.40}"
        )
    kind = None
    if isinstance(deviceType, torch.device):
        kind = deviceType.type
    else:
        try:
            kind = torch.device(deviceType).type
        except RuntimeError:
            kind = None
    if kind == "cuda":
        return "cuda"
    if kind == "cpu":
        return "pinned" if pin else "cpu"
    raise GadgetValueError(
        f"Unknown deviceType {deviceType!r}; expected 'cuda', 'cpu', 'cuda:N' or a torch.device "
        "of either type"
    )


class ModelFactory(ModelSwitch):
    """SpeedTorch's model-variable switcher: ``CPUPinn=True`` keeps the table in pinned
    host RAM, ``False`` on the GPU. See :class:`ModelSwitch` for the methods.
    ``datatype`` is the table's dtype (a torch / NumPy dtype or its name; SpeedTorch's
    default ``'float32'``), ``ModelSwitch``'s ``dtype``.

    ``placement=`` (``'pinned'``, ``'cuda'``, ``'cpu'``) overrides ``CPUPinn``;
    ``duplicates=`` chooses how repeated ids are laid out.

    Examples
    --------
    >>> import torch, gadgetloader as gl
    >>> emb = torch.nn.Embedding(3, 4)  # rows for one batch's ids
    >>> sw = gl.ModelFactory(emb, total_classes=100, embed_dimension=4, placement="cpu")
    >>> sw.uniformDistributionInit(-0.1, 0.1)
    >>> local = sw.beforeForwardPass(torch.tensor([5, 9, 5]))
    >>> local.tolist(), tuple(emb.weight.shape)
    ([0, 1, 0], (3, 4))
    """

    def __init__(
        self,
        model_variable: Any,
        total_classes: int,
        embed_dimension: int,
        datatype: Any = "float32",
        CPUPinn: bool = False,
        *,
        placement: str | None = None,
        duplicates: str | None = None,
    ) -> None:
        super().__init__(
            model_variable,
            total_classes,
            embed_dimension,
            dtype=datatype,
            placement=_cupy_placement(CPUPinn, placement),
            duplicates=duplicates,
        )


class PytorchModelFactory(ModelSwitch):
    """SpeedTorch's torch-tensor model switcher: ``deviceType='cuda'`` keeps the table on
    the GPU, ``'cpu'`` in host RAM (``pinType=True``: pinned and read by the GPU in place).
    ``datatype`` is the table's dtype, as for :class:`ModelFactory`. Same methods as
    :class:`ModelFactory`."""

    def __init__(
        self,
        model_variable: Any,
        total_classes: int,
        embed_dimension: int,
        datatype: Any = "float32",
        deviceType: Any = "cuda",
        pinType: bool = False,
        *,
        placement: str | None = None,
        duplicates: str | None = None,
    ) -> None:
        super().__init__(
            model_variable,
            total_classes,
            embed_dimension,
            dtype=datatype,
            placement=_torch_placement(deviceType, pinType, placement),
            duplicates=duplicates,
        )


class OptimizerFactory(OptimizerSwitch):
    """SpeedTorch's optimizer-state switcher (``CPUPinn`` as for :class:`ModelFactory`).

    Call :meth:`optInit` once, then ``beforeForwardPass`` / ``afterOptimizerStep`` each
    step with the same ids as the model switcher. See :class:`OptimizerSwitch`.
    The state tables have ``dtype`` (default float32, as in SpeedTorch, not the model
    factory's ``datatype``): give a float64 model factory ``dtype='float64'`` here too, or
    its state is rounded to float32 at each write-back.
    """

    def __init__(
        self,
        given_optimizer: torch.optim.Optimizer,
        total_classes: int,
        embed_dimension: int,
        model: torch.nn.Module,
        variable_name: str,
        dtype: Any = "float32",
        CPUPinn: bool = False,
        *,
        placement: str | None = None,
    ) -> None:
        super().__init__(
            given_optimizer,
            total_classes,
            embed_dimension,
            model,
            variable_name,
            dtype=dtype,
            placement=_cupy_placement(CPUPinn, placement),
        )


class PytorchOptimizerFactory(OptimizerSwitch):
    """SpeedTorch's torch-tensor optimizer-state switcher (``deviceType`` / ``pinType`` as
    for :class:`PytorchModelFactory`). Its state tables have ``dtype`` (default float32,
    as for :class:`OptimizerFactory`)."""

    def __init__(
        self,
        given_optimizer: torch.optim.Optimizer,
        total_classes: int,
        embed_dimension: int,
        model: torch.nn.Module,
        variable_name: str,
        dtype: Any = "float32",
        deviceType: Any = "cuda",
        pinType: bool = False,
        *,
        placement: str | None = None,
    ) -> None:
        super().__init__(
            given_optimizer,
            total_classes,
            embed_dimension,
            model,
            variable_name,
            dtype=dtype,
            placement=_torch_placement(deviceType, pinType, placement),
        )
