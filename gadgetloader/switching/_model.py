"""Model-variable paging: a full table in a store, a batch's rows in the model.

:class:`ModelSwitch` is the one implementation behind ``ModelFactory`` and
``PytorchModelFactory``. The model keeps an ordinary variable (for example the
weight of an ``nn.Embedding``); before the forward pass the switch gathers the
batch's rows from the table into it, after the optimizer step it scatters them
back. The table can be far larger than GPU memory.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, overload

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import io as _io
from .._device import cuda_available
from .._dtypes import as_torch_dtype, dtype_name
from .._errors import GadgetTypeError, GadgetValueError, as_choice, as_count, table_mismatch
from .._ids import as_ids
from .._paths import as_path
from ..gadget import DataGadget
from ..stores._base import gather_many as gather_stores
from ._optim import pagers_for
from ._rows import (
    DUPLICATE_MODES,
    PlanCache,
    RowPlan,
    check_training_placement,
    plan_rows,
    rows_preview,
    same_rows,
    split_local,
)
from ._torchfile import check_tensor, load_torch_file, save_torch_file, table_tensor

__all__ = ["ModelSwitch", "resolve_parameter", "switch_for"]

_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()


def switch_for(param: torch.Tensor) -> ModelSwitch | None:
    """The :class:`ModelSwitch` that pages ``param``, if any (optimizer switches follow its layout)."""
    ref = _REGISTRY.get(param)
    sw = ref() if ref is not None else None
    return sw if isinstance(sw, ModelSwitch) else None


def resolve_parameter(model_variable: Any) -> torch.nn.Parameter:
    """The parameter behind ``model_variable``: a parameter itself, or a module's ``weight``."""
    if isinstance(model_variable, torch.nn.Parameter):
        return model_variable
    weight = getattr(model_variable, "weight", None)
    if isinstance(model_variable, torch.nn.Module) and isinstance(weight, torch.nn.Parameter):
        return weight
    raise GadgetTypeError(
        "model_variable must be an nn.Parameter or a module with a .weight parameter "
        f"(e.g. model.u_embeddings); got {type(model_variable).__name__}"
    )


def _as_id_parts(
    pos: Any, neg: Any, num_rows: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Ids as int64 tensors on ``device``; the range is checked by :func:`plan_rows`."""
    parts = [as_ids(pos, num_rows, device, check=False)]
    if neg is not None:
        parts.append(as_ids(neg, num_rows, device, check=False))
    return tuple(parts)


class ModelSwitch:
    """Pages the rows of one model variable between a full table and the model.

    Parameters
    ----------
    model_variable : nn.Module or nn.Parameter
        The variable the model uses (a module's ``weight`` is taken), e.g. the
        weight of an ``nn.Embedding`` with any number of rows.
    total_classes : int
        Rows of the full table.
    embed_dimension : int
        Row width; must match the variable's rows.
    dtype : str or dtype, default 'float32'
        The table's dtype.
    placement : {'pinned', 'cuda', 'cpu'}, optional
        Where the table lives. Default: ``pinned`` where CUDA is available, else ``cpu``
        (silently, as for :class:`OffloadedEmbedding`); ``cuda`` or ``pinned`` asked for
        by name falls back to ``cpu`` without CUDA, with a ``FallbackWarning``.
    duplicates : {'merge', 'separate'}, optional
        ``merge``: each distinct id is one row of the variable and
        :meth:`beforeForwardPass` returns the local ids to feed the model (exact
        gradients for repeated ids). ``separate``: one row per id position, as
        SpeedTorch did (repeats are updated separately and the last write wins).
        Default: ``merge``, switched to ``separate`` by :meth:`variableTransformer` on
        this switcher. In ``merge`` the variable holds the batch's distinct ids in
        ascending order, so SpeedTorch-style dummy inputs made elsewhere (another
        switcher's ``variableTransformer``, a hand-made ``arange``) address the wrong rows:
        call :meth:`variableTransformer` on every switcher whose variable reads dummies.

    Notes
    -----
    An ``nn.Embedding`` / ``nn.EmbeddingBag`` given with ``padding_idx`` (as a module, not
    its ``weight``) has it taken as a global id of the table: before each forward the
    module's ``padding_idx`` is set to that id's local row (``None`` when the batch lacks
    it), so that row gets no gradient, as in a full-table ``nn.Embedding(padding_idx=...)``
    (needs ``duplicates='merge'``). The table's row for it holds what the initialiser
    wrote: zero it (``insertData``) if it should be zeros. Given only the module's
    ``weight``, the switcher cannot see the module: its ``padding_idx`` then names a local
    row of each batch (whichever global id lands there gets no gradient), so pass the
    module itself.

    The variable keeps a fixed shape for a fixed batch size: its own number of rows,
    or one per id position if that is more (see :meth:`capacity_for`); rows past the
    batch's distinct ids are zero padding that no local id addresses and that is never
    written back. A step moves the batch's distinct rows in once (one gather) and out
    once (one scatter). With ``pinned`` both run as GPU kernels over PCIe, so no CPU
    indexing is involved; with ``merge`` the ids are sorted first, which also
    makes the accesses walk the table in address order.
    """

    def __init__(
        self,
        model_variable: Any,
        total_classes: int,
        embed_dimension: int,
        *,
        dtype: Any = "float32",
        placement: str | None = None,
        duplicates: str | None = None,
    ) -> None:
        if placement is None:
            placement = "pinned" if cuda_available() else "cpu"
        check_training_placement(placement, type(self).__name__)  # before anything changes
        self.param = resolve_parameter(model_variable)
        self.model_variable = model_variable
        total_classes = as_count(total_classes, "total_classes")
        embed_dimension = as_count(embed_dimension, "embed_dimension")
        row_shape = tuple(self.param.shape[1:])
        if row_shape != (int(embed_dimension),):
            raise GadgetValueError(
                f"embed_dimension={embed_dimension} but the model variable's rows have shape "
                f"{row_shape} (variable shape {tuple(self.param.shape)})"
            )
        if duplicates is not None:
            as_choice(duplicates, "duplicates mode", DUPLICATE_MODES, error=GadgetValueError)
        td = as_torch_dtype(dtype)
        if not td.is_floating_point:
            raise GadgetTypeError(
                f"datatype {dtype_name(td)!r}: the table of a trained model variable must be "
                "floating point (float16, bfloat16, float32 or float64)"
            )
        self.total_classes = int(total_classes)
        self.embed_dimension = int(embed_dimension)
        # an nn.Embedding's padding_idx names a global row of the table (see the Notes)
        pad = None
        if isinstance(model_variable, torch.nn.Module):
            # the global id, kept on the module: padding_idx itself is rewritten every step
            pad = getattr(model_variable, "_gadget_padding_id", None)
            if pad is None:
                pad = getattr(model_variable, "padding_idx", None)
        if pad is not None and not 0 <= int(pad) < self.total_classes:
            raise GadgetValueError(
                f"the model variable's padding_idx={pad} is not a row of the table "
                f"(total_classes={self.total_classes}): it names a global id here"
            )
        if pad is not None:
            setattr(model_variable, "_gadget_padding_id", int(pad))  # noqa: B010
        self._padding_id: int | None = None if pad is None else int(pad)
        self._duplicates = duplicates
        self._transformed = False
        self.table = DataGadget(
            shape=(self.total_classes, self.embed_dimension),
            dtype=td,
            placement=placement,
            device=self.param.device,
        )
        self._cache = PlanCache()
        self._capacity = 0
        self._loaded: RowPlan | None = None
        #: beforeForwardPass ran with gradients enabled and afterOptimizerStep has not yet:
        #: a step is under way (an optimizer switcher called first in a step starts the
        #: plan afresh otherwise)
        self._in_step = False
        #: a training beforeForwardPass loaded rows that its afterOptimizerStep will write
        #: back: the table's rows must not change in between (they would be overwritten)
        self._writeback_pending = False
        #: the table's write count when beforeForwardPass read the rows (see afterOptimizerStep)
        self._read_at = 0
        self.table.__dict__["_switch"] = weakref.ref(self)
        #: the optimizer switcher's pager when its states are interleaved with the table
        self._pager: Any = None
        #: (plan, state rows, pager, its generation) gathered with the rows, for the
        #: optimizer switcher; stale once that pager writes anything back
        self._prefetched: tuple[RowPlan, list[torch.Tensor], Any, int] | None = None
        _REGISTRY[self.param] = weakref.ref(self)  # a strong value would keep the key alive

    # ---- facts -------------------------------------------------------------------
    @property
    def duplicates(self) -> str:
        """How repeated ids are laid out (``'merge'`` or ``'separate'``)."""
        if self._duplicates is not None:
            return self._duplicates
        return "separate" if self._transformed else "merge"

    @property
    def placement(self) -> str:
        """Where the table's rows live (``'pinned'``, ``'cuda'``, ``'cpu'``, ...)."""
        return self.table.placement

    @property
    def device(self) -> torch.device:
        """Where the model variable lives (and the local ids are delivered)."""
        return self.param.device

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={self.total_classes}, dim={self.embed_dimension}, "
            f"dtype={dtype_name(self.table.dtype)}, placement={self.placement!r}, "
            f"duplicates={self.duplicates!r})"
        )

    # ---- initialisers ------------------------------------------------------------
    def zerosInit(self) -> None:
        """Fill the table with zeros."""
        self.table.zero_()

    def uniformDistributionInit(self, low: float, high: float) -> None:
        """Fill the table from U(low, high)."""
        self.table.uniform_(low, high)

    def normalDistributionInit(self, mean: float, stdDev: float) -> None:
        """Fill the table from N(mean, stdDev**2)."""
        self.table.normal_(mean, stdDev)

    def customInit(self, initFunction: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Fill the table with any in-place torch initializer, e.g.
        ``customInit(torch.nn.init.xavier_uniform_)``: ``initFunction(tensor, *args,
        **kwargs)`` on the table's rows (as :meth:`DataGadget.init_`)."""
        if not callable(initFunction):
            raise GadgetTypeError(
                "customInit takes a function that fills a tensor in place (e.g. "
                f"torch.nn.init.xavier_uniform_); got {type(initFunction).__name__}"
            )
        self.table.init_(initFunction, *args, **kwargs)

    # ---- the step protocol -------------------------------------------------------
    @overload
    def variableTransformer(
        self, batchSize: int, posPerBatch: int, negPerBatch: None = None
    ) -> np.ndarray: ...
    @overload
    def variableTransformer(
        self, batchSize: int, posPerBatch: int, negPerBatch: int
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def variableTransformer(
        self, batchSize: int, posPerBatch: int, negPerBatch: int | None = None
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """SpeedTorch's dummy inputs: local row numbers ``0..batchSize*posPerBatch-1``
        shaped ``(batchSize, posPerBatch)``, and the negatives' row numbers following
        them when ``negPerBatch`` is given -- int64 NumPy arrays, exactly as SpeedTorch
        returned them (so ``torch.LongTensor(x).cuda()`` or ``torch.from_numpy(x)``
        code keeps working).

        Calling it selects ``duplicates='separate'`` (unless set explicitly): the
        variable then holds one row per id position, so the dummy inputs address the
        right rows. A repeated id is then updated once per copy and the copy written
        back last wins -- use the local ids that :meth:`beforeForwardPass` returns
        (``duplicates='merge'``) for exact results.
        """
        b = as_count(batchSize, "batchSize")
        p = as_count(posPerBatch, "posPerBatch")
        q = None if negPerBatch is None else as_count(negPerBatch, "negPerBatch", minimum=0)
        self._transformed = True
        self._cache.clear()  # the layout may have changed
        n_pos = b * p
        pos = np.arange(n_pos, dtype=np.int64).reshape(b, p)
        if q is None:
            return pos
        neg = np.arange(n_pos, n_pos + b * q, dtype=np.int64).reshape(b, q)
        return pos, neg

    def plan(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> RowPlan:
        """The row plan for these ids (reused while the same id objects are unchanged):
        ``retrievedPosIndexes`` and the optional ``retrievedNegIndexes`` as for
        :meth:`beforeForwardPass`."""
        cached = self._cache.get(retrievedPosIndexes, retrievedNegIndexes)
        if cached is not None:
            return cached
        parts = _as_id_parts(
            retrievedPosIndexes, retrievedNegIndexes, self.total_classes, self.device
        )
        plan = plan_rows(parts, self.duplicates, self.total_classes)
        self._cache.put(retrievedPosIndexes, retrievedNegIndexes, plan)
        return plan

    @overload
    def beforeForwardPass(
        self, retrievedPosIndexes: Any, retrievedNegIndexes: None = None
    ) -> torch.Tensor: ...
    @overload
    def beforeForwardPass(
        self, retrievedPosIndexes: Any, retrievedNegIndexes: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def beforeForwardPass(
        self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Gather the rows of these ids into the model variable.

        ``retrievedPosIndexes`` are this step's global row ids (any shape; an integer
        tensor, array or list) and ``retrievedNegIndexes`` optional second ids (SpeedTorch's
        negative samples), laid out after them; pass the same ids to every call of a step.

        Returns
        -------
        torch.Tensor or (torch.Tensor, torch.Tensor)
            The local ids to feed the model in place of the global ids (same shapes),
            on the variable's device; a pair when negatives are given.
        """
        self._cache.clear()  # a step starts from the ids as they are now
        if torch.is_grad_enabled():  # (an evaluation lookup, under no_grad, starts no step)
            self._in_step = True
        if self._padding_id is not None and self.duplicates != "merge":
            raise GadgetValueError(
                f"the model variable has padding_idx={self._padding_id}, which needs "
                "duplicates='merge' (one local row per distinct id); with 'separate' (SpeedTorch's "
                "dummy inputs) a padding id may take several rows"
            )
        plan = self.plan(retrievedPosIndexes, retrievedNegIndexes)
        store = self.table.store
        dev = self.device
        writes = self.table.__dict__.get("_writes", 0)  # the table's rows as read now
        n, cap = plan.num_rows, self.capacity_for(plan)
        rows = torch.empty((cap, *store.row_shape), dtype=store.dtype, device=dev)
        state_stores = self._state_stores()
        states = [torch.empty((cap, *s.row_shape), dtype=s.dtype, device=dev) for s in state_stores]
        gather_stores(
            [store, *state_stores],
            plan.ids.to(store.ids_device(dev)),
            dev,
            [rows[:n], *(s[:n] for s in states)],
            ids_sorted=plan.distinct,
        )
        self._prefetched = (plan, states, self._pager, self._pager.generation) if states else None
        if cap > n:
            rows[n:].zero_()  # padding rows: no id maps to them, their gradient is zero
        # the rows of an earlier step are replaced here: its write-back can no longer run,
        # nor can its optimizer switchers' (unless they loaded these very rows: this step)
        self._writeback_pending = False
        for pager in pagers_for(self.param):
            if pager.step_pending and (
                pager.loaded_plan is None or not same_rows(plan, pager.loaded_plan)
            ):
                pager.step_pending = False
        _set_rows(self.param, rows)
        self.param.grad = None
        if self._padding_id is not None:
            # the padding id's local row (None when this batch lacks it) gets no gradient
            hit = (plan.ids[:n] == self._padding_id).nonzero().flatten().tolist()
            self.model_variable.padding_idx = hit[0] if hit else None
        self._loaded = plan
        self._read_at = writes
        self._writeback_pending = torch.is_grad_enabled()
        local = split_local(plan)
        return local[0] if len(local) == 1 else (local[0], local[1])

    def _state_stores(self) -> list[Any]:
        """The optimizer-state stores interleaved with the table (empty if none)."""
        pager = self._pager
        if pager is None or not pager.interleaved:
            return []
        stores = [t.store for t in pager.tables.values()]
        return [] if any(s.closed for s in stores) else stores

    def take_prefetched(self, plan: RowPlan) -> list[torch.Tensor] | None:
        """The state rows gathered with ``plan``'s rows (once), else None: also None when
        they were gathered for another pager or before its last write-back (stale)."""
        pre, self._prefetched = self._prefetched, None
        if pre is None or pre[0] is not plan:
            return None
        pager = self._pager
        if pre[2] is not pager or pager is None or pre[3] != pager.generation:
            return None
        return pre[1]

    def capacity_for(self, plan: RowPlan) -> int:
        """Rows of the model variable for ``plan``: never fewer than it had, nor than the
        batch has positions, so a fixed-size batch gives a fixed-shape variable.

        Notes
        -----
        A stable shape matters: autograd checks a parameter's gradient against the
        shape it had when the previous graph (still referenced by, e.g., the last
        ``loss``) was built. The rows past the batch's distinct ids are padding: no
        local id points at them, so their gradient is zero and they are never written
        back.
        """
        self._capacity = max(self._capacity, int(self.param.shape[0]), int(plan.local.numel()))
        return self._capacity

    def afterOptimizerStep(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> None:
        """Scatter the model variable's rows back into the table: ``retrievedPosIndexes``
        and ``retrievedNegIndexes`` are the ids given to this step's
        :meth:`beforeForwardPass`."""
        self._in_step = False
        plan = self.plan(retrievedPosIndexes, retrievedNegIndexes)
        loaded = self._loaded
        if loaded is None or not same_rows(plan, loaded):
            raise GadgetValueError(
                "afterOptimizerStep got ids other than those of the last beforeForwardPass "
                f"(here {rows_preview(plan)}; loaded {rows_preview(loaded)}); pass the same ids"
            )
        if self.table.__dict__.get("_writes", 0) != self._read_at:
            raise GadgetValueError(
                "afterOptimizerStep: the table was changed (a load, an initialiser, "
                "insertData...) after beforeForwardPass read these rows, so they are not "
                "written back over the change (nothing was written); call beforeForwardPass "
                "again for a step on the new rows"
            )
        rows = self.param.detach()
        n = plan.num_rows
        store = self.table.store
        row_shape = tuple(self.table.shape[1:])
        if tuple(rows.shape[1:]) != row_shape or rows.shape[0] < n:
            raise GadgetValueError(
                f"the model variable has shape {tuple(rows.shape)}; expected ({n} or more, "
                f"{', '.join(map(str, row_shape))}) rows for the {n} rows loaded by "
                "beforeForwardPass (was its .data replaced with another shape?)"
            )
        rows = rows[:n]
        if rows.dtype != store.dtype:
            rows = rows.to(store.dtype)
        pager = self._pager
        if (
            pager is not None
            and self._state_stores()
            and pager.loaded_plan is plan
            and pager.stored_plan is not plan
        ):
            # the optimizer has stepped this plan's state: rows and state go back together
            pager.check_unchanged()
            pager.store_back(plan, with_table=(store, rows))
        else:
            store.scatter(
                plan.ids.to(store.ids_device(rows.device)),
                rows,
                unique=plan.distinct,
                ids_sorted=plan.distinct,  # a distinct plan's ids ascend
            )
        self._writeback_pending = False

    def _refuse_pending(self, what: str) -> None:
        """Raise if a training step's rows wait for :meth:`afterOptimizerStep` (it would
        write the rows read before ``what`` over it)."""
        if self._writeback_pending:
            raise GadgetValueError(
                f"{what} is refused while a step of its model switcher is under way: "
                "beforeForwardPass loaded rows that afterOptimizerStep will write back over "
                "the change; change the table before beforeForwardPass or after "
                "afterOptimizerStep (lookups under torch.no_grad() start no step)"
            )

    def step_under_way(self) -> bool:
        """Whether a training step of this variable waits for an ``afterOptimizerStep``
        (this switcher's or one of its optimizer switchers')."""
        return self._writeback_pending or any(p.step_pending for p in pagers_for(self.param))

    # ---- whole table -------------------------------------------------------------
    def getNumpyVersion(self) -> Any:
        """The full table as a NumPy array."""
        return self.table.getNumpyVersion()

    def saveCupy(self, saveFileName: str | os.PathLike[str]) -> None:
        """Save the full table as .npy to ``saveFileName`` (``.npy`` is appended to a name
        without it, as ``numpy.save`` does)."""
        self.table.saveCupy(saveFileName)

    def loadCupy(self, loadFileName: str | os.PathLike[str]) -> None:
        """Load the full table from the .npy file ``loadFileName`` (shape and dtype must
        match)."""
        self._load_checked(loadFileName, format="npy")

    def save(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """Save the full table (format from the extension: .npy, .h5, .zarr)."""
        self.table.save(path, **kwargs)

    def load(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """Load the full table from a file written by :meth:`save`."""
        self._load_checked(path, **kwargs)

    def _load_checked(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        src = _io.open_source(
            as_path(path), format=kwargs.get("format"), dataset=kwargs.get("dataset")
        )
        try:
            shape, dtype = tuple(src.shape), src.dtype
        finally:
            src.close()
        if shape != self.table.shape or dtype != self.table.dtype:
            raise table_mismatch(
                shape == self.table.shape,
                f"{as_path(path)} holds a {shape} {dtype_name(dtype)} table; expected "
                f"{self.table.shape} {dtype_name(self.table.dtype)}",
            )
        self.table.load(path, **kwargs)

    def saveTorch(self, saveFileName: str | os.PathLike[str]) -> None:
        """Save the full table with ``torch.save`` (a CPU tensor) to ``saveFileName``.

        Written beside the target and renamed over it, so a save that fails part-way
        leaves any previous file whole.
        """
        save_torch_file(table_tensor(self.table), saveFileName)

    def loadTorch(self, loadFileName: str | os.PathLike[str]) -> None:
        """Load a table saved with :meth:`saveTorch` from ``loadFileName``. The shape must match; a tensor of
        another floating dtype is taken where every value converts exactly (a float64 file
        of float32 values), any other dtype is refused. Nothing is written on refusal."""
        t = load_torch_file(loadFileName)
        t = check_tensor(t, as_path(loadFileName), self.table.shape, self.table.dtype)
        self.table._check_no_waiting_lookup("loadTorch into this table")
        try:
            self.table.store.write_block(0, t)
        finally:
            self.table._wrote()
        self.table.store.synchronize()


def _set_rows(param: torch.Tensor, rows: torch.Tensor) -> None:
    """``param.data = rows``, also when ``rows`` has another shape while a graph built on
    ``param`` is still alive (the last step's ``loss``, kept by an ordinary loop).

    autograd keeps a leaf's gradient accumulator, with the shape the leaf had, for as
    long as such a graph references it, and checks the next graph's gradient against
    that shape: a batch with more positions than any before would fail in ``backward()``
    ("invalid gradient ... expected shape compatible with"). torch drops the
    accumulator when ``.data`` changes dtype (not when only the shape changes), so a
    new shape passes through an empty tensor of another dtype first; the next graph
    then gets an accumulator of the new shape.
    """
    if param.shape != rows.shape:
        other = torch.float32 if param.dtype == torch.float64 else torch.float64
        param.data = torch.empty(0, dtype=other, device=rows.device)
    param.data = rows
